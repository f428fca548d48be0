/* bench_gemm: single-precision GEMM at the shapes Tandem's models run, one core, Tandem's
 * own (cpu_gemm.c: whatever library this build chose) beside other BLAS libraries loaded at
 * run time, shape by shape in interleaved turns.
 *
 *   build/bench_gemm [--rounds N] [LIB...]
 *
 * LIB is a shared library exporting cblas_sgemm, optionally with one environment setting it
 * reads when it loads: "NAME=path" or "NAME=path@VAR=VALUE", e.g.
 *   OpenBLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
 *   OpenBLAS-SkylakeX=/usr/lib/x86_64-linux-gnu/libopenblas.so.0@OPENBLAS_CORETYPE=SkylakeX
 * Each is loaded into a namespace of its own (dlmopen), so one library can be loaded twice
 * with two settings. Prints "GEMM <name> <shape> <GFLOP/s>" per library and shape, the median
 * of N rounds (3), each round timing every library once per shape for ~50 ms.
 */
#define _GNU_SOURCE /* dlmopen */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/cpu.h" /* tdm_cpu_sgemm */
#include "tandem/tandem.h"

typedef void (*cblas_sgemm_fn)(int order, int ta, int tb, int m, int n, int k, float alpha,
                               const float *a, int lda, const float *b, int ldb, float beta,
                               float *c, int ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, MAX_LIBS = 8, MAX_ROUNDS = 15 };

typedef struct {
    const char *name;
    int m, n, k;
    bool ta, tb;
} shape;

/* c [m, n] = op(a) @ op(b) as the layers call it: Linear forward x @ W^T, its weight grad
 * g^T @ x, its input grad g @ W; conv as im2col per image w [Cout, K] @ col [K, P]. ".dp":
 * a data-parallel device's half of the batch of 64. */
static const shape shapes[] = {
    {"mlp.fc1.fwd", 64, 256, 784, false, true},     {"mlp.fc1.fwd.dp", 32, 256, 784, false, true},
    {"cnn.fc1.fwd.dp", 32, 128, 3136, false, true}, {"mlp.fc1.dW", 256, 784, 64, true, false},
    {"mlp.fc1.dX", 64, 784, 256, false, false},     {"mlp.fc2.fwd", 64, 128, 256, false, true},
    {"cnn.conv2.fwd", 64, 196, 288, false, false},  {"cnn.fc1.fwd", 64, 128, 3136, false, true},
    {"cnn.fc1.dW", 128, 3136, 64, true, false},     {"gpt.qkv.fwd", 256, 384, 128, false, true},
    {"gpt.fc.fwd", 256, 512, 128, false, true},     {"gpt.proj.dW", 128, 512, 256, true, false},
    {"gpt.attn.qk", 64, 64, 32, false, true},       {"square.1024", 1024, 1024, 1024, false, false},
};
#define N_SHAPES (int)(sizeof shapes / sizeof shapes[0])

typedef struct {
    char name[64];
    cblas_sgemm_fn fn; /* NULL: tdm_cpu_sgemm */
} lib;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void run(const lib *l, const shape *s, const float *a, const float *b, float *c) {
    int lda = s->ta ? s->m : s->k, ldb = s->tb ? s->k : s->n;
    if (l->fn)
        l->fn(ROW_MAJOR, s->ta ? TRANS : NO_TRANS, s->tb ? TRANS : NO_TRANS, s->m, s->n, s->k, 1.0f,
              a, lda, b, ldb, 0.0f, c, s->n);
    else
        tdm_cpu_sgemm(s->ta, s->tb, s->m, s->n, s->k, 1.0f, a, lda, b, ldb, 0.0f, c, s->n);
}

/* GFLOP/s of ~50 ms of calls, after two warm-up calls */
static double gflops(const lib *l, const shape *s, const float *a, const float *b, float *c) {
    run(l, s, a, b, c), run(l, s, a, b, c);
    double flop = 2.0 * s->m * s->n * s->k, t0 = now_s();
    int reps = 0;
    while (now_s() - t0 < 0.05) run(l, s, a, b, c), reps++;
    return flop * reps / (now_s() - t0) / 1e9;
}

static int load(const char *spec, lib *l) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", spec);
    char *path = strchr(buf, '='), *env = strchr(buf, '@');
    if (!path) return fprintf(stderr, "bench_gemm: '%s' is not NAME=path\n", spec), -1;
    *path++ = '\0';
    if (env) {
        *env++ = '\0';
        char *val = strchr(env, '=');
        if (!val) return fprintf(stderr, "bench_gemm: '%s': no VAR=VALUE after @\n", spec), -1;
        *val++ = '\0';
        setenv(env, val, 1); /* read by the library's constructor as it loads */
    }
    void *h = dlmopen(LM_ID_NEWLM, path, RTLD_NOW | RTLD_LOCAL);
    if (env) unsetenv(env);
    if (!h) return fprintf(stderr, "bench_gemm: %s\n", dlerror()), -1;
    l->fn = (cblas_sgemm_fn)dlsym(h, "cblas_sgemm");
    if (!l->fn) return fprintf(stderr, "bench_gemm: %s has no cblas_sgemm\n", path), -1;
    snprintf(l->name, sizeof l->name, "%.63s", buf);
    return 0;
}

static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

int main(int argc, char **argv) {
    lib libs[MAX_LIBS];
    int n_libs = 1, rounds = 3;
    char desc[128];
    snprintf(libs[0].name, sizeof libs[0].name, "Tandem");
    libs[0].fn = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
            rounds = atoi(argv[++i]);
            if (rounds < 1 || rounds > MAX_ROUNDS) rounds = 3;
        } else if (n_libs < MAX_LIBS && load(argv[i], &libs[n_libs]) == 0) {
            n_libs++;
        } else {
            return 1;
        }
    }
    /* the product's scratch (cpu_gemm_nt.c) comes from the caching allocator, which serves CPU
     * memory once the backend is up: a tensor first, as in a program */
    tdm_tensor *first = tdm_zeros(TDM_SHAPE(1), TDM_F32, tdm_cpu(0));
    if (!first) return fprintf(stderr, "bench_gemm: %s\n", tdm_last_error()), 1;
    tdm_cpu_gemm_set_threads(1);
    printf("# bench_gemm: one thread; Tandem = %s; median of %d rounds\n",
           tdm_gemm_describe(desc, sizeof desc), rounds);
    size_t most = 1024 * 1024 + 3136 * 128;
    float *a = malloc(most * sizeof(float)), *b = malloc(most * sizeof(float));
    float *c = malloc(most * sizeof(float));
    for (size_t i = 0; i < most; i++) a[i] = (float)(i % 17) * 0.1f, b[i] = (float)(i % 13) * 0.1f;
    static double r[N_SHAPES][MAX_LIBS][MAX_ROUNDS];
    for (int round = 0; round < rounds; round++)
        for (int s = 0; s < N_SHAPES; s++)
            for (int l = 0; l < n_libs; l++) r[s][l][round] = gflops(&libs[l], &shapes[s], a, b, c);
    for (int s = 0; s < N_SHAPES; s++)
        for (int l = 0; l < n_libs; l++) {
            qsort(r[s][l], (size_t)rounds, sizeof(double), cmp_double);
            printf("GEMM %s %s %dx%dx%d(%s%s) %.1f\n", libs[l].name, shapes[s].name, shapes[s].m,
                   shapes[s].n, shapes[s].k, shapes[s].ta ? "T" : "N", shapes[s].tb ? "T" : "N",
                   r[s][l][rounds / 2]);
        }
    free(a), free(b), free(c);
    tdm_tensor_free(first);
    return 0;
}
