/* Ops across two devices fail with a message naming both; a tensor moved with
 * tdm_to_device joins the other device's ops and carries gradients back. */
#include "gradcheck.h"

static void test_mixed_devices(void) {
    tdm_scope_begin();
    tdm_tensor *a = tdm_ones(TDM_SHAPE(2, 3), TDM_F32, tdm_cpu(0));
    tdm_tensor *b = tdm_ones(TDM_SHAPE(2, 3), TDM_F32, tdm_cpu(1));
    const char *want = "tensors on different devices (cpu:0 and cpu:1)";
    CHECK_ERROR(tdm_add(a, b) == NULL, want);
    CHECK_ERROR(tdm_matmul(a, tdm_transpose(b, 0, 1)) == NULL, want);
    CHECK_ERROR(tdm_linear(a, tdm_ones(TDM_SHAPE(4, 3), TDM_F32, tdm_cpu(1)), NULL) == NULL, want);
    CHECK_ERROR(tdm_cross_entropy(a, tdm_zeros(TDM_SHAPE(2), TDM_I64, tdm_cpu(1)), NULL) == NULL,
                want);
    CHECK_ERROR(tdm_concat((tdm_tensor *[]){a, b}, 2, 0) == NULL, want);
    tdm_tensor *x = tdm_ones(TDM_SHAPE(1, 3, 4, 4), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(tdm_conv2d(x, tdm_ones(TDM_SHAPE(2, 3, 3, 3), TDM_F32, tdm_cpu(1)), NULL, NULL) ==
                    NULL,
                want);
    CHECK_ERROR(tdm_copy_(a, b) != 0, want);
    tdm_scope_end();
}

static tdm_tensor *f_cross_device(tdm_tensor **in, void *ctx) {
    /* x on cpu:0, w on cpu:1: move x over, multiply there, bring the result back */
    return tdm_to_device(tdm_mul(tdm_to_device(in[0], tdm_cpu(1)), in[1]), tdm_cpu(0));
}

static void test_to_device(void) {
    tdm_tensor *x = gradcheck_input(TDM_SHAPE(3, 4), 1);
    tdm_rng r = tdm_rng_make(2);
    tdm_tensor *w = tdm_randn(TDM_SHAPE(3, 4), 0, 1, tdm_cpu(1), &r);
    tdm_requires_grad_(w, true);
    tdm_tensor *in[2] = {x, w};
    gradcheck("to_device", f_cross_device, 2, in, NULL, 1e-2, 1e-3, 1e-3);
    CHECK(x->grad && tdm_device_equal(x->grad->device, tdm_cpu(0)) &&
              tdm_device_equal(w->grad->device, tdm_cpu(1)),
          "each gradient lives on its tensor's device");
    tdm_tensor_free(x);
    tdm_tensor_free(w);
}

int main(void) {
    test_mixed_devices();
    test_to_device();
    return check_summary();
}
