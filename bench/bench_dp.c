/* DataParallel step latency: a tiny model (where the step is nothing but synchronisation) and
 * the Fashion-MNIST MLP, global batch 64, on 1 and 2 CPU devices, next to the same step
 * without DataParallel ("plain": forward, loss, backward, SGD on the caller's thread).
 *   bench_dp [steps per case (default 400)] [tiny|mlp (default both)] [plain|1|2 (default all)]
 * Prints median, p90 and mean microseconds per step and images/s at the median. Set
 * OPENBLAS_NUM_THREADS to choose the plain step's BLAS threads (DataParallel on as many
 * devices as cores makes BLAS single-threaded itself). Then the MLP step's GEMM floor: the
 * time of its 8 GEMMs (forward, weight and input gradients) alone at 64 and 32 rows, the
 * ceiling of what 2 devices can gain over 1 before any other work. */
#include "tandem/tandem.h"

#include <cblas.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define B       64
#define IN      784
#define CLASSES 10
#define WARMUP  30

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static tdm_module *make_model(bool tiny, tdm_device dev) {
    tdm_rng rng = tdm_rng_make(7);
    if (tiny) { /* x [64, 784] -> [64, 4] -> [64, 10]: ~3 K parameters, one 12 KiB bucket */
        tdm_module *l[3] = {tdm_linear_new(IN, 4, true, dev, &rng), tdm_relu_new(),
                            tdm_linear_new(4, CLASSES, true, dev, &rng)};
        return tdm_sequential_new(3, l);
    }
    /* the MLP of `tandem train --model mlp`: 235 K parameters */
    tdm_module *l[5] = {tdm_linear_new(IN, 256, true, dev, &rng), tdm_relu_new(),
                        tdm_linear_new(256, 128, true, dev, &rng), tdm_relu_new(),
                        tdm_linear_new(128, CLASSES, true, dev, &rng)};
    return tdm_sequential_new(5, l);
}

static tdm_optim *make_sgd(tdm_paramset *ps, void *arg) {
    (void)arg;
    tdm_sgd_opts o = tdm_sgd_defaults(0.01f);
    return tdm_sgd_new(ps, &o);
}

static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0, (void)arg;
    return tdm_cross_entropy(out, target, NULL);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* devices 0: the plain step on the caller's thread; otherwise DataParallel on that many. */
static int run_case(bool tiny, int devices, int steps, tdm_tensor *x, tdm_tensor *y) {
    tdm_module *m = make_model(tiny, tdm_cpu(0));
    if (!m) return -1;
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    tdm_dp *dp = devices ? tdm_dp_new(m, devs, devices, make_sgd, NULL) : NULL;
    tdm_optim *opt = devices ? NULL : make_sgd(tdm_module_parameters(m), NULL);
    if (devices ? !dp : !opt) return -1;
    double *t = malloc(sizeof *t * (size_t)steps);
    int rc = 0;
    for (int i = -WARMUP; i < steps && !rc; i++) {
        double t0 = now_us();
        float loss;
        if (dp) {
            rc = tdm_dp_step(dp, x, y, ce_loss, NULL, &loss);
        } else {
            tdm_scope_begin();
            rc = tdm_optim_zero_grad(opt);
            if (!rc) rc = tdm_backward(ce_loss(tdm_module_forward(m, x), y, 0, NULL));
            if (!rc) rc = tdm_optim_step(opt);
            tdm_scope_end();
        }
        if (i >= 0) t[i] = now_us() - t0;
    }
    if (!rc) {
        double mean = 0;
        for (int i = 0; i < steps; i++) mean += t[i] / steps;
        qsort(t, (size_t)steps, sizeof *t, cmp_double);
        double med = t[steps / 2];
        char name[32];
        snprintf(name, sizeof name, devices ? "dp %d dev" : "plain", devices);
        printf("%-6s %-10s %10.1f %10.1f %10.1f %10.0f\n", tiny ? "tiny" : "mlp", name, med,
               t[steps * 9 / 10], mean, B / med * 1e6);
    }
    free(t);
    tdm_dp_free(dp);
    tdm_optim_free(opt);
    tdm_module_free(m);
    return rc;
}

/* One GEMM of the MLP step, C [m, n] (+)= op(A) op(B) with k inner: row-major, as linear.c. */
typedef struct {
    bool ta, tb;
    int m, n, k;
    float beta;
} gemm;

/* Microseconds of the MLP's step GEMMs at `rows` rows (median of 7 rounds of 50). */
static double gemm_floor_us(int rows) {
    const gemm g[8] = {{0, 1, rows, 256, IN, 1},  {0, 1, rows, 128, 256, 1}, /* forward */
                       {0, 1, rows, 10, 128, 1},  {1, 0, 10, 128, rows, 1},  /* dW3 */
                       {0, 0, rows, 128, 10, 0},  {1, 0, 128, 256, rows, 1}, /* dX3, dW2 */
                       {0, 0, rows, 256, 128, 0}, {1, 0, 256, IN, rows, 1}}; /* dX2, dW1 */
    float *buf[3];
    for (int i = 0; i < 3; i++) {
        buf[i] = malloc(sizeof(float) * IN * 256);
        for (int j = 0; j < IN * 256; j++) buf[i][j] = (float)(j % 17) * 0.01f;
    }
    double t[7];
    for (int r = 0; r < 7; r++) {
        double t0 = now_us();
        for (int it = 0; it < 50; it++)
            for (int i = 0; i < 8; i++)
                cblas_sgemm(CblasRowMajor, g[i].ta ? CblasTrans : CblasNoTrans,
                            g[i].tb ? CblasTrans : CblasNoTrans, g[i].m, g[i].n, g[i].k, 1.0f,
                            buf[0], g[i].ta ? g[i].m : g[i].k, buf[1], g[i].tb ? g[i].k : g[i].n,
                            g[i].beta, buf[2], g[i].n);
        t[r] = (now_us() - t0) / 50;
    }
    for (int i = 0; i < 3; i++) free(buf[i]);
    qsort(t, 7, sizeof *t, cmp_double);
    return t[3];
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 400;
    if (steps < 10) {
        fprintf(stderr, "usage: bench_dp [steps per case, at least 10]\n");
        return 2;
    }
    float *xd = malloc(sizeof *xd * B * IN);
    int64_t yd[B];
    for (int i = 0; i < B * IN; i++) xd[i] = (float)((i * 7919) % 255) / 255.0f;
    for (int i = 0; i < B; i++) yd[i] = (i * 3) % CLASSES;
    tdm_tensor *x = tdm_from_data(TDM_SHAPE(B, IN), TDM_F32, tdm_cpu(0), xd);
    tdm_tensor *y = tdm_from_data(TDM_SHAPE(B), TDM_I64, tdm_cpu(0), yd);
    const char *blas = getenv("OPENBLAS_NUM_THREADS");
    printf("# bench_dp: batch %d, %d steps per case, %d CPU devices, OPENBLAS_NUM_THREADS=%s\n", B,
           steps, tdm_device_count(TDM_CPU), blas ? blas : "(unset)");
    printf("%-6s %-10s %10s %10s %10s %10s\n", "model", "step", "median_us", "p90_us", "mean_us",
           "img/s");
    const char *only = argc > 2 ? argv[2] : "";
    int rc = 0;
    for (int tiny = 1; tiny >= 0 && !rc; tiny--) {
        if (only[0] && strcmp(only, tiny ? "tiny" : "mlp") != 0) continue;
        for (int d = 0; d <= 2 && !rc; d++)
            if (argc <= 3 || atoi(argv[3]) == d) rc = run_case(tiny, d, steps, x, y);
    }
    if (!rc && (!only[0] || strcmp(only, "mlp") == 0) && argc <= 3) {
        double full = gemm_floor_us(B), half = gemm_floor_us(B / 2);
        printf("# the MLP step's GEMMs alone (cblas_sgemm, this thread): %.1f us at %d rows, %.1f "
               "us at %d: 2 devices can be at most %.2fx one before any other work\n",
               full, B, half, B / 2, full / half);
    }
    if (rc) fprintf(stderr, "bench_dp: %s\n", tdm_last_error());
    tdm_tensor_free(x);
    tdm_tensor_free(y);
    free(xd);
    return rc ? 1 : 0;
}
