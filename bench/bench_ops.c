/* Times the ops a training step spends its time in, for bench/run to set beside PyTorch:
 * matmul (also against the GEMM it calls, cpu_gemm.c, on the same buffers), cross-entropy
 * forward+backward, and a pre-norm block's residual add and layer norm (one op; also as the
 * two, tdm_add then tdm_layer_norm). Prints "BENCH <name> <ms per iteration>" lines. */
#include <stdio.h>
#include <time.h>

#include "backend/cpu/cpu.h" /* tdm_cpu_sgemm */
#include "tandem/tandem.h"

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* Best of 5 rounds of about 0.2 s each. */
#define TIME_IT(name, body)                                                                        \
    do {                                                                                           \
        body;          /* warm-up: fills the allocator's cache */                                  \
        int iters = 0; /* runs that fit in 20 ms, times 10: about 0.2 s a round */                 \
        for (double t0 = now_ms(); now_ms() - t0 < 20; iters++) body;                              \
        iters = iters < 1 ? 1 : iters * 10;                                                        \
        double best = 1e30;                                                                        \
        for (int rep_ = 0; rep_ < 5; rep_++) {                                                     \
            double t0 = now_ms();                                                                  \
            for (int i = 0; i < iters; i++) body;                                                  \
            double ms = (now_ms() - t0) / iters;                                                   \
            best = ms < best ? ms : best;                                                          \
        }                                                                                          \
        printf("BENCH %s %.5f\n", name, best);                                                     \
        fflush(stdout);                                                                            \
    } while (0)

static void bench_matmul(int n, int k, int m) {
    char name[64];
    tdm_rng r = tdm_rng_make(1);
    tdm_tensor *a = tdm_randn(TDM_SHAPE(n, k), 0, 1, tdm_cpu(0), &r);
    tdm_tensor *b = tdm_randn(TDM_SHAPE(k, m), 0, 1, tdm_cpu(0), &r);
    tdm_tensor *c = tdm_zeros(TDM_SHAPE(n, m), TDM_F32, tdm_cpu(0));
    const float *pa = tdm_data_ptr(a), *pb = tdm_data_ptr(b);
    float *pc = tdm_data_ptr(c);
    snprintf(name, sizeof name, "matmul_%dx%dx%d", n, k, m);
    TIME_IT(name, {
        tdm_scope_begin();
        tdm_matmul(a, b);
        tdm_scope_end();
    });
    snprintf(name, sizeof name, "sgemm_%dx%dx%d", n, k, m);
    TIME_IT(name, tdm_cpu_sgemm(false, false, n, m, k, 1.0f, pa, k, pb, m, 0.0f, pc, m));
    tdm_tensor_free(a), tdm_tensor_free(b), tdm_tensor_free(c);
}

static void bench_cross_entropy(int n, int classes) {
    char name[64];
    tdm_rng r = tdm_rng_make(2);
    tdm_tensor *x = tdm_randn(TDM_SHAPE(n, classes), 0, 1, tdm_cpu(0), &r);
    tdm_tensor *u = tdm_rand(TDM_SHAPE(n), 0, (float)classes, tdm_cpu(0), &r);
    tdm_tensor *y = tdm_cast(u, TDM_I64);
    tdm_requires_grad_(x, true);
    snprintf(name, sizeof name, "cross_entropy_fwd_bwd_%dx%d", n, classes);
    TIME_IT(name, {
        tdm_scope_begin();
        tdm_backward(tdm_cross_entropy(x, y, NULL));
        tdm_scope_end();
    });
    tdm_tensor_free(x), tdm_tensor_free(u), tdm_tensor_free(y);
}

/* s = x + r and layer_norm(s) over rows x cols, forward: tdm_add_layer_norm, and the two ops
 * it stands for (PyTorch's side is the two) */
static void bench_add_layer_norm(int rows, int cols) {
    char name[64];
    tdm_rng g = tdm_rng_make(3);
    tdm_tensor *x = tdm_randn(TDM_SHAPE(rows, cols), 0, 1, tdm_cpu(0), &g);
    tdm_tensor *r = tdm_randn(TDM_SHAPE(rows, cols), 0, 1, tdm_cpu(0), &g);
    tdm_tensor *w = tdm_randn(TDM_SHAPE(cols), 1, 0.1f, tdm_cpu(0), &g);
    tdm_tensor *b = tdm_randn(TDM_SHAPE(cols), 0, 0.1f, tdm_cpu(0), &g);
    snprintf(name, sizeof name, "add_layer_norm_%dx%d", rows, cols);
    TIME_IT(name, {
        tdm_scope_begin();
        tdm_tensor *s;
        tdm_add_layer_norm(x, r, &s, 1, w, b, 1e-5f);
        tdm_scope_end();
    });
    snprintf(name, sizeof name, "add_then_layer_norm_%dx%d", rows, cols);
    TIME_IT(name, {
        tdm_scope_begin();
        tdm_layer_norm(tdm_add(x, r), 1, w, b, 1e-5f);
        tdm_scope_end();
    });
    tdm_tensor_free(x), tdm_tensor_free(r), tdm_tensor_free(w), tdm_tensor_free(b);
}

int main(void) {
    bench_matmul(64, 784, 256);
    bench_matmul(256, 256, 256);
    bench_matmul(512, 512, 512);
    bench_matmul(1024, 1024, 1024);
    bench_cross_entropy(64, 10);
    bench_cross_entropy(1024, 1000);
    bench_cross_entropy(256, 50257);
    bench_add_layer_norm(2048, 768);
    bench_add_layer_norm(8192, 768);
    return 0;
}
