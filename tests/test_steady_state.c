/* A training step in steady state calls no malloc: after a few warm-up steps, whole steps
 * (forward, loss, backward, optimizer) of an MLP, a CNN and a model with batch norm and
 * dropout make no call to malloc, calloc, realloc or aligned_alloc from the library, and
 * the caching allocator reaches the system allocator no more.
 *
 * The allocation functions are wrapped at link time (-Wl,--wrap, set in CMakeLists.txt for
 * this test), so every call from the library's objects is counted. */
#include "check.h"
#include "core/core.h"

#include <stdlib.h>

static long n_calls;
static bool counting;

void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
void *__real_aligned_alloc(size_t a, size_t n);

void *__wrap_malloc(size_t n) {
    n_calls += counting;
    return __real_malloc(n);
}
void *__wrap_calloc(size_t k, size_t n) {
    n_calls += counting;
    return __real_calloc(k, n);
}
void *__wrap_realloc(void *p, size_t n) {
    n_calls += counting;
    return __real_realloc(p, n);
}
void *__wrap_aligned_alloc(size_t a, size_t n) {
    n_calls += counting;
    return __real_aligned_alloc(a, n);
}

static tdm_module *mlp(tdm_rng *r) {
    tdm_module *l[6] = {tdm_flatten_new(1, -1), tdm_linear_new(784, 256, true, tdm_cpu(0), r),
                        tdm_relu_new(),         tdm_linear_new(256, 128, true, tdm_cpu(0), r),
                        tdm_relu_new(),         tdm_linear_new(128, 10, true, tdm_cpu(0), r)};
    return tdm_sequential_new(6, l);
}

static tdm_module *cnn(tdm_rng *r) {
    tdm_conv2d_opts c = {.pad_h = 1, .pad_w = 1};
    tdm_pool2d_opts p = {.kernel_h = 2, .kernel_w = 2};
    tdm_module *l[10] = {tdm_conv2d_new(1, 32, 3, 3, &c, true, tdm_cpu(0), r),
                         tdm_relu_new(),
                         tdm_max_pool2d_new(&p),
                         tdm_conv2d_new(32, 64, 3, 3, &c, true, tdm_cpu(0), r),
                         tdm_relu_new(),
                         tdm_max_pool2d_new(&p),
                         tdm_flatten_new(1, -1),
                         tdm_linear_new(3136, 128, true, tdm_cpu(0), r),
                         tdm_relu_new(),
                         tdm_linear_new(128, 10, true, tdm_cpu(0), r)};
    return tdm_sequential_new(10, l);
}

static tdm_rng dropout_rng;

static tdm_module *bn_dropout(tdm_rng *r) {
    tdm_module *l[6] = {tdm_flatten_new(1, -1),
                        tdm_linear_new(784, 64, true, tdm_cpu(0), r),
                        tdm_batch_norm1d_new(64, 1e-5f, 0.1f, tdm_cpu(0)),
                        tdm_gelu_new(false),
                        tdm_dropout_new(0.2f, &dropout_rng),
                        tdm_linear_new(64, 10, true, tdm_cpu(0), r)};
    return tdm_sequential_new(6, l);
}

/* Runs warm-up steps, then counts allocations over measured steps; the forward and the loss
 * in an autocast region of dtype ac unless it is TDM_F32 (the region and its cast cache are
 * part of the step). */
static void check_model(const char *name, tdm_module *m, bool adam, tdm_dtype ac) {
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_adam_opts ao = tdm_adam_defaults();
    tdm_sgd_opts so = tdm_sgd_defaults(0.01f);
    so.momentum = 0.9f;
    tdm_optim *opt = adam ? tdm_adam_new(ps, &ao) : tdm_sgd_new(ps, &so);
    tdm_rng r = tdm_rng_make(3);
    tdm_tensor *x = tdm_randn(TDM_SHAPE(16, 1, 28, 28), 0, 1, tdm_cpu(0), &r);
    int64_t labels[16];
    for (int i = 0; i < 16; i++) labels[i] = i % 10;
    tdm_tensor *y = tdm_from_data(TDM_SHAPE(16), TDM_I64, tdm_cpu(0), labels);
    uint64_t sys_before = 0;
    int failures = 0;
    long first_step_calls = 0;
    n_calls = 0;
    counting = true; /* the first step allocates: proof that the counting works */
    for (int step = 0; step < 8; step++) {
        if (step == 1) first_step_calls = n_calls;
        if (step == 3) {
            sys_before = tdm_alloc_stats_get(tdm_cpu(0)).sys_allocs;
            n_calls = 0;
            counting = true;
        }
        tdm_scope_begin();
        if (ac != TDM_F32) failures += tdm_autocast_begin(ac) != TDM_OK;
        tdm_tensor *loss = tdm_cross_entropy(tdm_module_forward(m, x), y, NULL);
        if (ac != TDM_F32) failures += tdm_autocast_end() != TDM_OK;
        failures += !loss || tdm_optim_zero_grad(opt) || tdm_backward(loss) || tdm_optim_step(opt);
        tdm_scope_end();
    }
    counting = false;
    CHECK(failures == 0, "%s: a step failed: %s", name, tdm_last_error());
    CHECK(first_step_calls > 0,
          "%s: the first step made no allocation call: the wrapping "
          "does not count",
          name);
    CHECK(n_calls == 0, "%s: %ld allocation calls in 5 steady-state steps", name, n_calls);
    uint64_t sys_after = tdm_alloc_stats_get(tdm_cpu(0)).sys_allocs;
    CHECK(sys_after == sys_before, "%s: caching allocator missed %llu times", name,
          (unsigned long long)(sys_after - sys_before));
    tdm_tensor_free(x);
    tdm_tensor_free(y);
    tdm_optim_free(opt);
    tdm_module_free(m);
}

int main(void) {
    tdm_rng r = tdm_rng_make(1);
    dropout_rng = tdm_rng_make(2);
    check_model("mlp, sgd momentum", mlp(&r), false, TDM_F32);
    check_model("cnn, adam", cnn(&r), true, TDM_F32);
    check_model("batch norm + gelu + dropout, adam", bn_dropout(&r), true, TDM_F32);
    check_model("cnn under bf16 autocast, adam", cnn(&r), true, TDM_BF16);
    return check_summary();
}
