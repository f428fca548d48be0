/* Ops across two devices fail with a message naming both; a tensor moved with
 * tdm_to_device joins the other device's ops and carries gradients back; a device's memory
 * limit refuses what passes it, after giving its cache back, with PyTorch's kind of message. */
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

/* tdm_device_set_memory_limit on cpu:7 (a pool no other test uses): 1 MiB. */
static void test_memory_limit(void) {
    tdm_device d = tdm_cpu(7);
    CHECK(tdm_device_set_memory_limit(d, 1 << 20) == TDM_OK, "%s", tdm_last_error());
    CHECK(tdm_memory_stats_get(d).limit == 1 << 20, "the limit is in the figures");
    tdm_tensor *a = tdm_zeros(TDM_SHAPE(160 * 1024), TDM_F32, d); /* 640 KiB */
    CHECK(a != NULL, "640 KiB under a 1 MiB limit: %s", tdm_last_error());
    tdm_tensor *b = tdm_zeros(TDM_SHAPE(128 * 1024), TDM_F32, d); /* 512 KiB more */
    CHECK_ERROR(b == NULL, "cpu:7 is out of memory: tried to allocate 512.00 KiB with 640.00 KiB "
                           "of its 1.00 MiB limit in use by tensors (0 B of cached blocks");
    tdm_tensor_free(a); /* its block stays cached: 640 KiB reserved */
    CHECK(tdm_memory_stats_get(d).reserved == 640 << 10, "the freed block is cached");
    b = tdm_zeros(TDM_SHAPE(192 * 1024), TDM_F32, d); /* 768 KiB: fits once the cache is gone */
    CHECK(b != NULL, "the cache given back makes room: %s", tdm_last_error());
    tdm_memory_stats m = tdm_memory_stats_get(d);
    CHECK(m.allocated == 768 << 10 && m.reserved == 768 << 10, "allocated %lld, reserved %lld",
          (long long)m.allocated, (long long)m.reserved);
    tdm_tensor_free(b);
    /* a model whose flat buffers do not fit: the optimizer made from its failed parameter set
     * names the cause, not the NULL it was handed */
    tdm_module *lin = tdm_linear_new(256, 400, true, d, NULL); /* 401 KiB, then 2 x 401 flat */
    tdm_adam_opts o = tdm_adamw_defaults();
    tdm_optim *opt = lin ? tdm_adamw_new(tdm_module_parameters(lin), &o) : NULL;
    CHECK(lin != NULL, "the layer alone fits: %s", tdm_last_error());
    CHECK_ERROR(opt == NULL, "cpu:7 is out of memory");
    tdm_optim_free(opt);
    tdm_module_free(lin);
    CHECK_ERROR(tdm_device_set_memory_limit(d, -1) != TDM_OK, "-1 bytes for cpu:7");
    CHECK_ERROR(tdm_device_set_memory_limit(tdm_cpu(64), 1) != TDM_OK, "cpu:64 has no memory pool");
    CHECK(tdm_device_set_memory_limit(d, 0) == TDM_OK, "no limit");
    a = tdm_zeros(TDM_SHAPE(1 << 20), TDM_F32, d);
    CHECK(a != NULL, "4 MiB without a limit: %s", tdm_last_error());
    tdm_tensor_free(a);
}

int main(void) {
    test_mixed_devices();
    test_to_device();
    test_memory_limit();
    return check_summary();
}
