/* bench_recompute: what recomputing the GPT's blocks (tdm_model_set_recompute, tandem train
 * --recompute) saves in memory and costs in time, for issue 19's figure "activation memory at
 * most 0.5x, step time at most 1.4x".
 *
 *   build/bench_recompute [--layers L] [--channels C] [--heads H] [--context T] [--batch B]
 *                         [--rounds R] [--threads N]
 *
 * One byte-level GPT (vocabulary 256, so the logits are small next to the blocks'
 * activations) and its AdamW train on one fixed batch, each round one step without and one
 * with recomputation (the same model; recomputation switched between steps), after two warm-up
 * steps of each that allocate the optimizer's moments and fill the allocator's cache. A step
 * is zero_grad, forward, backward and the optimizer's step. Activation memory is the
 * allocator's peak during the step above what was allocated before it (parameters, gradients,
 * moments: tdm_memory_stats). Prints every round, the medians and the fastest steps (on a
 * shared machine the ones other load disturbed least).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h" /* tdm_cpu_gemm_set_threads */
#include "tandem/tandem.h"

#define MAX_ROUNDS 100

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, int n) {
    double s[MAX_ROUNDS];
    memcpy(s, v, sizeof(double) * (size_t)n);
    qsort(s, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

static double least(const double *v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++) m = v[i] < m ? v[i] : m;
    return m;
}

static int fail(const char *what) {
    fprintf(stderr, "bench_recompute: %s: %s\n", what, tdm_last_error());
    return 1;
}

typedef struct {
    tdm_module *m;
    tdm_optim *opt;
    tdm_tensor *x, *y; /* the batch: tokens and next tokens [B, T], caller-owned */
} bench;

/* One step with recomputation on or off: its time in ms and its activation bytes. */
static int step(bench *b, bool recompute, double *ms, double *act_mib) {
    tdm_device dev = tdm_cpu(0);
    if (tdm_model_set_recompute(b->m, recompute)) return -1;
    int64_t before = tdm_memory_stats_get(dev).allocated;
    tdm_memory_reset_peak(dev);
    double t0 = now_ms();
    tdm_scope_begin();
    int rc = tdm_optim_zero_grad(b->opt);
    tdm_tensor *loss = rc ? NULL : tdm_gpt_loss(tdm_gpt_forward(b->m, b->x), b->y);
    rc = loss ? tdm_backward(loss) : -1;
    if (!rc) rc = tdm_optim_step(b->opt);
    tdm_scope_end();
    *ms = now_ms() - t0;
    *act_mib = (double)(tdm_memory_stats_get(dev).peak_allocated - before) / (1 << 20);
    return rc;
}

/* The GPT, its AdamW (llm.c's settings) and a batch of tokens drawn from a seed. */
static int setup(bench *b, const tdm_gpt_config *c, int batch) {
    tdm_rng r = tdm_rng_make(1);
    if (!(b->m = tdm_gpt_new(c, tdm_cpu(0), &r))) return fail("model");
    tdm_paramset *ps = tdm_module_parameters(b->m);
    tdm_adam_opts ao = tdm_adamw_defaults();
    ao.lr = 1e-4f, ao.weight_decay = 0.1f;
    if (!ps || !(b->opt = tdm_gpt_adamw_new(ps, &ao))) return fail("optimizer");
    int64_t n = (int64_t)batch * c->context;
    int64_t *tok = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!tok) return fail("tokens");
    for (int64_t i = 0; i <= n; i++) tok[i] = (i * 2654435761u >> 7) % (uint64_t)c->vocab;
    b->x = tdm_from_data(TDM_SHAPE(batch, c->context), TDM_I64, tdm_cpu(0), tok);
    b->y = tdm_from_data(TDM_SHAPE(batch, c->context), TDM_I64, tdm_cpu(0), tok + 1);
    free(tok);
    return b->x && b->y ? 0 : fail("batch");
}

int main(int argc, char **argv) {
    tdm_gpt_config c = {.layers = 6, .heads = 4, .channels = 192, .context = 128, .vocab = 256};
    int batch = 8, rounds = 7, threads = 2;
    for (int i = 1; i + 1 < argc; i += 2) {
        int v = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--layers"))
            c.layers = v;
        else if (!strcmp(argv[i], "--channels"))
            c.channels = v;
        else if (!strcmp(argv[i], "--heads"))
            c.heads = v;
        else if (!strcmp(argv[i], "--context"))
            c.context = v;
        else if (!strcmp(argv[i], "--batch"))
            batch = v;
        else if (!strcmp(argv[i], "--rounds"))
            rounds = v;
        else if (!strcmp(argv[i], "--threads"))
            threads = v;
        else {
            fprintf(stderr, "bench_recompute: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (rounds < 1 || rounds > MAX_ROUNDS || batch < 1) {
        fprintf(stderr, "bench_recompute: --rounds must be in [1, %d], --batch positive\n",
                MAX_ROUNDS);
        return 2;
    }
    tdm_cpu_gemm_set_threads(threads);
    bench b = {0};
    if (setup(&b, &c, batch)) return 1;
    char gemm[96];
    printf("GPT L%d H%d C%d T%d V%d, batch %d, %.2f M parameters, cpu:0, %d GEMM thread(s), %s\n",
           c.layers, c.heads, c.channels, c.context, c.vocab, batch,
           (double)tdm_module_parameters(b.m)->total / 1e6, threads,
           tdm_gemm_describe(gemm, sizeof gemm));
    double ms[2][MAX_ROUNDS], mib[2][MAX_ROUNDS], w_ms, w_mib;
    for (int k = 0; k < 4; k++) /* warm-up: AdamW's moments, the allocator's cache */
        if (step(&b, k % 2, &w_ms, &w_mib)) return fail("warm-up step");
    printf("before a step: %.1f MiB allocated (parameters, gradients, AdamW's moments)\n",
           (double)tdm_memory_stats_get(tdm_cpu(0)).allocated / (1 << 20));
    printf("round   plain ms  recompute ms   plain act MiB  recompute act MiB\n");
    for (int r = 0; r < rounds; r++) {
        for (int on = 0; on < 2; on++)
            if (step(&b, on, &ms[on][r], &mib[on][r])) return fail("step");
        printf("%-5d %10.1f %13.1f %15.1f %18.1f\n", r + 1, ms[0][r], ms[1][r], mib[0][r],
               mib[1][r]);
    }
    double t0 = median(ms[0], rounds), t1 = median(ms[1], rounds);
    double m0 = median(mib[0], rounds), m1 = median(mib[1], rounds);
    printf("median %9.1f %13.1f %15.1f %18.1f\n", t0, t1, m0, m1);
    printf("activation memory: recompute / plain = %.2f (issue 19: at most 0.5)\n", m1 / m0);
    printf("step time:         recompute / plain = %.2f (issue 19: at most 1.4)\n", t1 / t0);
    double f0 = least(ms[0], rounds), f1 = least(ms[1], rounds);
    printf("fastest steps:     %.1f and %.1f ms, recompute / plain = %.2f (the least disturbed "
           "by other load)\n",
           f0, f1, f1 / f0);
    tdm_tensor_free(b.x);
    tdm_tensor_free(b.y);
    tdm_optim_free(b.opt);
    tdm_module_free(b.m);
    return 0;
}
