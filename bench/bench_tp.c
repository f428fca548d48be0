/* Tensor parallelism against data parallelism and one device (issue 40): a GPT of GPT-2
 * small's shape (12 layers, 768 channels, 12 heads, context 256, byte vocabulary), fp32,
 * AdamW, the same global batch of B sequences three ways:
 *   one  one CPU device, the whole batch;
 *   dp   DDP over 2 CPU devices (threads group), B/2 sequences each;
 *   tp   tdm_gpt_parallelize over 2 CPU devices, each the whole batch with half of every block;
 *   tpsp the same with sequence parallelism (each device half of the tokens between them).
 * Per device: the bytes held after a step (parameters, gradients, AdamW's two moments) and
 * the peak during one (the activations on top), from the device's allocator; and the median
 * step time. The cases run in interleaved rounds, so a change of load hits all alike.
 *   bench_tp [global batch (2)] [steps per case and round (4)] [rounds (2)] */
#include "tandem/tandem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define T 256

static const tdm_gpt_config CFG = {
    .layers = 12, .heads = 12, .channels = 768, .context = T, .vocab = 256};

typedef enum { ONE, DP, TP, SP, MODES } mode;
static const char *const mode_names[] = {"one", "dp", "tp", "tpsp"};

typedef struct {
    mode m;
    int batch, steps;
    double ms[64];            /* step times of this round, rank 0's */
    int64_t held[2], peak[2]; /* per device */
    int status;
} run;

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

/* steps of m (wrapped by d where not NULL) on rows of fixed tokens; rank 0 times them. */
static int train(run *rn, tdm_module *m, tdm_ddp *d, tdm_device dev, int rows, int rank) {
    tdm_adam_opts o = tdm_adamw_defaults();
    tdm_optim *opt = tdm_gpt_adamw_new(tdm_module_parameters(m), &o);
    int64_t *tok = malloc(sizeof *tok * (size_t)(rows * T));
    int rc = opt && tok ? 0 : -1;
    for (int i = 0; tok && i < rows * T; i++) tok[i] = (i * 7 + rank * 13) % CFG.vocab;
    for (int s = 0; s < rn->steps && !rc; s++) {
        if (s == 1) tdm_memory_reset_peak(dev);
        double t0 = now_ms();
        tdm_scope_begin();
        tdm_tensor *idx = tdm_from_data(TDM_SHAPE(rows, T), TDM_I64, dev, tok);
        tdm_tensor *logits = d ? tdm_ddp_forward(d, idx) : tdm_gpt_forward(m, idx);
        tdm_tensor *l = tdm_gpt_loss(logits, idx);
        rc = l ? tdm_optim_zero_grad(opt) : -1;
        if (!rc) rc = d ? tdm_ddp_backward(d, l) : tdm_backward(l);
        if (!rc) rc = tdm_optim_step(opt);
        if (!rc) tdm_item(l); /* the step is done when its loss is read */
        tdm_scope_end();
        if (rank == 0) rn->ms[s] = now_ms() - t0;
    }
    tdm_memory_stats st = tdm_memory_stats_get(dev);
    rn->held[rank] = st.allocated, rn->peak[rank] = st.peak_allocated;
    tdm_optim_free(opt);
    free(tok);
    return rc;
}

static int rank_main(tdm_rank_ctx *ctx, void *arg) {
    run *rn = arg;
    tdm_rng rng = tdm_rng_make(1);
    tdm_module *m = tdm_gpt_new(&CFG, ctx->device, &rng);
    int rc = m ? 0 : -1;
    tdm_ddp *d = NULL;
    tdm_gpt_tp_plan plan = {rn->m == SP, false};
    if (!rc && rn->m >= TP) rc = tdm_gpt_parallelize(m, ctx->group, &plan);
    if (!rc && rn->m == DP && !(d = tdm_ddp_new(m, ctx->group, NULL))) rc = -1;
    int rows = rn->m == DP ? rn->batch / ctx->size : rn->batch;
    if (!rc) rc = train(rn, m, d, ctx->device, rows, ctx->rank);
    if (rc)
        fprintf(stderr, "bench_tp %s rank %d: %s\n", mode_names[rn->m], ctx->rank,
                tdm_last_error());
    tdm_ddp_free(d);
    tdm_module_free(m);
    return rc;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int batch = argc > 1 ? atoi(argv[1]) : 2, steps = argc > 2 ? atoi(argv[2]) : 4;
    int rounds = argc > 3 ? atoi(argv[3]) : 2;
    if (batch < 2 || batch % 2 || steps < 2 || steps > 64 || rounds < 1) {
        fprintf(stderr, "usage: bench_tp [global batch, even (2)] [steps 2..64 (4)] [rounds]\n");
        return 2;
    }
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    double all[MODES][64 * 16];
    int nall[MODES] = {0};
    run last[MODES];
    for (int r = 0; r < rounds; r++)
        for (int k = 0; k < MODES; k++) {
            run rn = {.m = (mode)k, .batch = batch, .steps = steps};
            int rc = k == ONE ? rank_main(&(tdm_rank_ctx){0, 1, devs[0], NULL}, &rn)
                              : tdm_spawn(2, devs, rank_main, &rn);
            if (rc) return 1;
            for (int s = 1; s < steps && nall[k] < 64 * 16; s++) all[k][nall[k]++] = rn.ms[s];
            last[k] = rn;
        }
    printf("# GPT L12 C768 H12 T%d byte vocabulary, fp32 AdamW, global batch %d, %d rounds of "
           "%d steps (the first of each not timed)\n",
           T, batch, rounds, steps);
    printf("%-4s %12s %14s %14s %12s\n", "mode", "step_ms", "held_MiB/dev", "peak_MiB/dev",
           "act_MiB/dev");
    double med[MODES];
    for (int k = 0; k < MODES; k++) {
        qsort(all[k], (size_t)nall[k], sizeof(double), cmp);
        med[k] = all[k][nall[k] / 2];
        int64_t held = last[k].held[0], peak = last[k].peak[0];
        printf("%-4s %12.0f %14.1f %14.1f %12.1f\n", mode_names[k], med[k], held / 1048576.0,
               peak / 1048576.0, (peak - held) / 1048576.0);
    }
    for (int k = TP; k <= SP; k++)
        printf("%s: held %.2fx dp's; activations %.2fx dp's, %.2fx one device's; throughput "
               "%.2fx dp's, %.2fx one device's\n",
               mode_names[k], (double)last[k].held[0] / (double)last[DP].held[0],
               (double)(last[k].peak[0] - last[k].held[0]) /
                   (double)(last[DP].peak[0] - last[DP].held[0]),
               (double)(last[k].peak[0] - last[k].held[0]) /
                   (double)(last[ONE].peak[0] - last[ONE].held[0]),
               med[DP] / med[k], med[ONE] / med[k]);
    return 0;
}
