/* bench_gpt: Tandem training the byte-level GPT of bench/torch_gpt.py, side by side with it.
 *
 *   $VENV/bin/python bench/torch_gpt.py --steps 40        # writes /tmp/tandem_bench_gpt/...
 *   build/bench_gpt [DIR] [--steps N] [--threads N] [--device D] [--batch B] [--precision P]
 *                   [--cuda-graphs]
 *
 * --precision bf16 (or fp16) runs the forward and the loss in an autocast region of that dtype,
 * as torch_gpt.py --autocast bf16 does on its side (default fp32: no region).
 * --cuda-graphs steps through the one-device strategy with tdm_strategy_set_graphs (the
 * trainer's --cuda-graphs): from the third step the zeroing, forward, loss and backward are
 * replayed from a CUDA graph (fp32 or bf16; one GPU).
 *
 * Starts from the same weights (DIR/model.bin, llm.c's format, written by the torch script)
 * and the same batches (DIR/tokens.bin, batch k = tokens [k*B*T, (k+1)*B*T + 1)), with the
 * same AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.1 on matrices only). Prints
 * both sides' losses, their largest difference and the median ms per step over steps 5 and
 * later (forward + backward + optimizer step; the batch is made before the clock starts).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h" /* tdm_cpu_gemm_set_threads */
#include "tandem/tandem.h"

static int B = 4;               /* --batch, torch_gpt.py's */
static tdm_dtype amp = TDM_F32; /* --precision: the autocast region's dtype; f32 for none */
static tdm_strategy *graphs;    /* --cuda-graphs: the one-device strategy stepping */
#define MAX_STEPS 1000

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median_from(const double *v, int n, int from) {
    if (n <= from) from = 0;
    double *s = malloc(sizeof(double) * (size_t)(n - from));
    memcpy(s, v + from, sizeof(double) * (size_t)(n - from));
    qsort(s, (size_t)(n - from), sizeof(double), cmp_double);
    double m = s[(n - from) / 2];
    free(s);
    return m;
}

/* Torch's "step loss ms" lines; returns how many were read. */
static int read_torch(const char *dir, float *loss, double *ms) {
    char path[512];
    snprintf(path, sizeof path, "%s/torch.txt", dir);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int n = 0, step;
    while (n < MAX_STEPS && fscanf(f, "%d %f %lf", &step, &loss[n], &ms[n]) == 3) n++;
    fclose(f);
    return n;
}

static int fail(const char *what) {
    fprintf(stderr, "bench_gpt: %s: %s\n", what, tdm_last_error());
    return 1;
}

static tdm_tensor *gpt_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0, (void)arg;
    return tdm_gpt_loss(out, target);
}

static tdm_optim *make_adamw(tdm_paramset *ps, void *arg) {
    return tdm_gpt_adamw_new(ps, arg);
}

/* One training step on batch k on device dev (the model's), its tokens read into x [2, B, T]
 * (inputs, then targets); *loss receives its loss, read back to the host as the trainer reads
 * it, so the step has ended on the device too. */
static int train_step(tdm_module *m, tdm_optim *opt, tdm_dataset *ds, int k, int T, tdm_device dev,
                      int64_t *x, float *loss) {
    int64_t *y = x + B * T;
    for (int i = 0; i < B; i++)
        if (ds->ops->get(ds, (int64_t)k * B + i, x + i * T, y + i * T)) return -1;
    tdm_scope_begin();
    tdm_tensor *xt = tdm_from_data(TDM_SHAPE(B, T), TDM_I64, dev, x);
    tdm_tensor *yt = tdm_from_data(TDM_SHAPE(B, T), TDM_I64, dev, y);
    if (graphs) { /* the strategy's step: the autocast region is its (set_precision) */
        int rc = xt && yt ? tdm_strategy_step(graphs, xt, yt, gpt_loss, NULL, loss) : -1;
        tdm_scope_end();
        return rc;
    }
    if (amp != TDM_F32 && tdm_autocast_begin(amp)) return -1;
    tdm_tensor *l = tdm_gpt_loss(tdm_gpt_forward(m, xt), yt);
    if (amp != TDM_F32 && tdm_autocast_end()) l = NULL;
    int rc = l ? tdm_optim_zero_grad(opt) : -1;
    if (!rc) rc = tdm_backward(l);
    if (!rc) rc = tdm_optim_step(opt);
    *loss = rc ? NAN : tdm_item(l);
    tdm_scope_end();
    return rc;
}

int main(int argc, char **argv) {
    const char *dir = "/tmp/tandem_bench_gpt";
    int steps = 40, threads = 1;
    bool cuda_graphs = false;
    tdm_device dev = tdm_cpu(0);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc)
            B = atoi(argv[++i]) > 0 ? atoi(argv[i]) : 4;
        else if (!strcmp(argv[i], "--precision") && i + 1 < argc) {
            const char *p = argv[++i];
            if (strcmp(p, "fp32") && strcmp(p, "bf16") && strcmp(p, "fp16")) {
                fprintf(stderr, "bench_gpt: --precision %s: expected fp32, bf16 or fp16\n", p);
                return 1;
            }
            amp = !strcmp(p, "bf16") ? TDM_BF16 : !strcmp(p, "fp16") ? TDM_F16 : TDM_F32;
        } else if (!strcmp(argv[i], "--cuda-graphs")) {
            cuda_graphs = true;
        } else if (!strcmp(argv[i], "--device") && i + 1 < argc) {
            if (tdm_device_parse(argv[++i], &dev)) return fail("--device");
        } else
            dir = argv[i];
    }
    if (steps < 1 || steps > MAX_STEPS) steps = 40;
    tdm_cpu_gemm_set_threads(threads);
    char path[512];
    snprintf(path, sizeof path, "%s/model.bin", dir);
    tdm_gpt_config cfg;
    tdm_module *m = tdm_gpt_load_llmc(path, dev, &cfg);
    if (!m) return fail("model (run bench/torch_gpt.py first)");
    snprintf(path, sizeof path, "%s/tokens.bin", dir);
    tdm_dataset *ds = tdm_token_dataset_open(path, cfg.context, cfg.vocab);
    if (!ds) return fail("tokens");
    if (ds->n < (int64_t)steps * B) steps = (int)(ds->n / B);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_adam_opts ao = tdm_adamw_defaults();
    ao.lr = 1e-4f, ao.weight_decay = 0.1f;
    tdm_optim *opt = NULL;
    if (cuda_graphs) { /* two eager steps, then replays */
        if (amp == TDM_F16) return fprintf(stderr, "bench_gpt: --cuda-graphs: fp32 or bf16\n"), 1;
        graphs = ps ? tdm_strategy_one_device(m, make_adamw, &ao) : NULL;
        if (!graphs || tdm_strategy_set_precision(graphs, amp) ||
            tdm_strategy_set_graphs(graphs, 2))
            return fail("--cuda-graphs");
        opt = tdm_strategy_optim(graphs, 0);
    } else {
        opt = ps ? tdm_gpt_adamw_new(ps, &ao) : NULL;
    }
    if (!opt) return fail("optimizer");
    static float loss[MAX_STEPS], tloss[MAX_STEPS];
    static double ms[MAX_STEPS], tms[MAX_STEPS];
    int64_t *tokens = malloc(sizeof(int64_t) * 2 * (size_t)B * (size_t)cfg.context);
    if (!tokens) return fail("tokens buffer");
    for (int k = 0; k < steps; k++) {
        double t0 = now_ms();
        if (train_step(m, opt, ds, k, cfg.context, dev, tokens, &loss[k])) return fail("step");
        ms[k] = now_ms() - t0;
    }
    free(tokens);
    int nt = read_torch(dir, tloss, tms);
    printf("step  tandem loss   torch loss     |diff|   tandem ms  torch ms\n");
    double maxdiff = 0;
    for (int k = 0; k < steps; k++) {
        double d = k < nt ? fabs((double)loss[k] - tloss[k]) : NAN;
        if (k < nt && d > maxdiff) maxdiff = d;
        printf("%4d  %.7f  %11.7f  %9.2e  %9.2f  %8.2f\n", k, loss[k], k < nt ? tloss[k] : NAN, d,
               ms[k], k < nt ? tms[k] : NAN);
    }
    double tm = median_from(ms, steps, 5), pm = nt ? median_from(tms, nt, 5) : NAN;
    double tmin = ms[steps > 5 ? 5 : 0], pmin = nt ? tms[nt > 5 ? 5 : 0] : NAN;
    for (int k = 5; k < steps; k++) tmin = ms[k] < tmin ? ms[k] : tmin;
    for (int k = 5; k < nt; k++) pmin = tms[k] < pmin ? tms[k] : pmin;
    char dname[32];
    printf("GPT L%d C%d NH%d T%d B%d V%d, %lld parameters, on %s, %d BLAS thread(s), %s\n",
           cfg.layers, cfg.channels, cfg.heads, cfg.context, B, cfg.vocab, (long long)ps->total,
           tdm_device_str(dev, dname), threads,
           amp == TDM_F32    ? "fp32"
           : amp == TDM_BF16 ? "autocast bf16"
                             : "autocast fp16");
    printf("tandem %.2f ms/step, torch %.2f ms/step (median of steps 5-%d): %.2fx; max |loss "
           "diff| %.2e over %d steps\n",
           tm, pm, steps - 1, pm / tm, maxdiff, nt < steps ? nt : steps);
    printf("fastest step: tandem %.2f ms, torch %.2f ms (%.2fx; the least disturbed by other "
           "load)\n",
           tmin, pmin, pmin / tmin);
    if (graphs) {
        const char *why = NULL;
        int64_t r = tdm_strategy_graph_replays(graphs, &why);
        printf("cuda graphs: %lld of %d steps replayed%s%s\n", (long long)r, steps, why ? ": " : "",
               why ? why : "");
        tdm_strategy_free(graphs); /* with its optimizer */
    } else {
        tdm_optim_free(opt);
    }
    tdm_dataset_free(ds);
    tdm_module_free(m);
    return 0;
}
