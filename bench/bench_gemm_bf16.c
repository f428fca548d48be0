/* bench_gemm_bf16: the bf16 GEMM (src/backend/cpu/cpu_gemm_bf16.c) at the GPT's shapes of
 * issue 37 (GPT-2 small's blocks: 768 channels, 3072 hidden, batch 2 x context 256 = 512
 * rows, byte vocabulary) and square 1024, one core, beside Tandem's fp32 GEMM at the same
 * shapes, in interleaved turns.
 *
 *   build/bench_gemm_bf16 [--rounds N]
 *   ONEDNN_MAX_CPU_ISA=AVX512_CORE build/bench_gemm_bf16    (oneDNN's bf16 emulation)
 *
 * Prints "GEMM <variant> <shape> <m>x<n>x<k>(<ta><tb>) <GFLOP/s>" per variant and shape, the
 * median of N rounds (3) of ~50 ms each, as bench_gemm does (bench/gemm.py reads both):
 * "Tandem" bf16 operands with an fp32 result, "Tandem-bf16out" with a bf16 result, and
 * "Tandem-fp32" tdm_cpu_sgemm. A header line names oneDNN's implementation of each shape.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_gemm_bf16.h"
#include "tandem/tandem.h"

enum { MAX_ROUNDS = 15, N_VARIANTS = 3 };

typedef struct {
    const char *name;
    int m, n, k;
    bool ta, tb;
} shape;

/* A block's products as a Linear calls them: forward x @ W^T, weight gradient g^T @ x, input
 * gradient g @ W. */
static const shape shapes[] = {
    {"gpt.qkv.fwd", 512, 2304, 768, false, true},
    {"gpt.attn_proj.fwd", 512, 768, 768, false, true},
    {"gpt.fc.fwd", 512, 3072, 768, false, true},
    {"gpt.fc_proj.fwd", 512, 768, 3072, false, true},
    {"gpt.fc.dW", 3072, 768, 512, true, false},
    {"gpt.fc.dX", 512, 768, 3072, false, false},
    {"gpt.lm_head.fwd", 512, 256, 768, false, true},
    {"square.1024", 1024, 1024, 1024, false, false},
};
#define N_SHAPES (int)(sizeof shapes / sizeof shapes[0])

static const char *variants[N_VARIANTS] = {"Tandem", "Tandem-bf16out", "Tandem-fp32"};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    uint16_t *a16, *b16, *c16;
    float *a, *b, *c;
} buffers;

static int run(int v, const shape *s, const buffers *x) {
    int lda = s->ta ? s->m : s->k, ldb = s->tb ? s->k : s->n;
    if (v == 2) {
        tdm_cpu_sgemm(s->ta, s->tb, s->m, s->n, s->k, 1.0f, x->a, lda, x->b, ldb, 0.0f, x->c, s->n);
        return 0;
    }
    return tdm_cpu_gemm_bf16(s->ta, s->tb, s->m, s->n, s->k, 1.0f, x->a16, lda, x->b16, ldb, 0.0f,
                             v == 1 ? (void *)x->c16 : (void *)x->c, v == 1, s->n);
}

/* GFLOP/s of ~50 ms of calls after two warm-up calls (the first makes the primitive); -1 on
 * an error */
static double gflops(int v, const shape *s, const buffers *x) {
    if (run(v, s, x) || run(v, s, x)) return -1;
    double flop = 2.0 * s->m * s->n * s->k, t0 = now_s();
    int reps = 0;
    while (now_s() - t0 < 0.05) run(v, s, x), reps++;
    return flop * reps / (now_s() - t0) / 1e9;
}

static int cmp_double(const void *p, const void *q) {
    double a = *(const double *)p, b = *(const double *)q;
    return a < b ? -1 : a > b;
}

int main(int argc, char **argv) {
    int rounds = 3;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
            rounds = atoi(argv[++i]);
            if (rounds < 1 || rounds > MAX_ROUNDS) rounds = 3;
        } else {
            fprintf(stderr, "usage: bench_gemm_bf16 [--rounds N]\n");
            return 1;
        }
    }
    /* the fp32 GEMM's scratch comes from the caching allocator: a tensor first, as in a
     * program */
    tdm_tensor *first = tdm_zeros(TDM_SHAPE(1), TDM_F32, tdm_cpu(0));
    if (!first) return fprintf(stderr, "bench_gemm_bf16: %s\n", tdm_last_error()), 1;
    tdm_cpu_gemm_set_threads(1);
    char desc[128];
    printf("# bench_gemm_bf16: one thread; fp32 = %s; half conversions %s; median of %d rounds\n",
           tdm_gemm_describe(desc, sizeof desc), tdm_half_isa(), rounds);
    size_t most = 3072 * 768 * 2;
    buffers x = {malloc(most * 2), malloc(most * 2), malloc(most * 2),
                 malloc(most * 4), malloc(most * 4), malloc(most * 4)};
    if (!x.a16 || !x.b16 || !x.c16 || !x.a || !x.b || !x.c)
        return fprintf(stderr, "bench_gemm_bf16: out of memory\n"), 1;
    for (size_t i = 0; i < most; i++) {
        x.a[i] = (float)(i % 17) * 0.1f - 0.8f, x.b[i] = (float)(i % 13) * 0.1f - 0.6f;
        x.a16[i] = tdm_bf16_from_float(x.a[i]), x.b16[i] = tdm_bf16_from_float(x.b[i]);
    }
    for (int s = 0; s < N_SHAPES; s++) {
        run(0, &shapes[s], &x);
        printf("# %s: %s\n", shapes[s].name, tdm_cpu_gemm_bf16_impl());
    }
    static double r[N_SHAPES][N_VARIANTS][MAX_ROUNDS];
    for (int round = 0; round < rounds; round++)
        for (int s = 0; s < N_SHAPES; s++)
            for (int v = 0; v < N_VARIANTS; v++) r[s][v][round] = gflops(v, &shapes[s], &x);
    for (int s = 0; s < N_SHAPES; s++)
        for (int v = 0; v < N_VARIANTS; v++) {
            qsort(r[s][v], (size_t)rounds, sizeof(double), cmp_double);
            printf("GEMM %s %s %dx%dx%d(%s%s) %.1f\n", variants[v], shapes[s].name, shapes[s].m,
                   shapes[s].n, shapes[s].k, shapes[s].ta ? "T" : "N", shapes[s].tb ? "T" : "N",
                   r[s][v][rounds / 2]);
        }
    free(x.a16), free(x.b16), free(x.c16), free(x.a), free(x.b), free(x.c);
    tdm_cpu_gemm_bf16_cache_clear();
    tdm_tensor_free(first);
    return 0;
}
