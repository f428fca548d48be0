/* Issue 18's ResNet figures: one ResNet-18 training step on the machine's two cores, Tandem
 * against PyTorch + torchvision (bench/torch_resnet.py, kept running by this program), in
 * interleaved rounds. Two figures:
 *   imagenet  the ImageNet stem (7x7/2 conv + max-pool), batch 32 of 3x224x224, 1000 classes
 *   cifar     the CIFAR stem (3x3 conv, no max-pool), batch 128 of 3x32x32, 10 classes
 * Each round runs, one after the other, every configuration:
 *   tandem dp     DataParallel over cpu:0,cpu:1 (a replica and half the batch per core,
 *                 synchronised batch norm, the sharded update; made afresh each round)
 *   tandem 1dev   one device, the GEMMs on 2 OpenMP threads (the rest on one)
 *   torch nchw    torch.set_num_threads(2), contiguous tensors
 *   torch cl      the same, channels_last
 * and prints each one's median ms per step; at the end the medians over rounds and the ratio
 * PyTorch's best / Tandem's best (above 1: Tandem faster).
 *
 *   build/bench_resnet [--figure both|imagenet|cifar] [--rounds 5] [--steps 2] [--quick]
 *                      [--configs dp,1dev,nchw,cl] [--depth 18] [--precision fp32|bf16]
 *                      [--script bench/torch_resnet.py | -]   (- : Tandem only)
 *   --quick: one round of one step, without "tandem 1dev" (a smoke run, not a figure; the
 *   1dev configuration is 3x slower than dp and would take most of the time)
 *   --configs: the configurations to run, by the names below without "tandem "/"torch "
 *   --precision bf16: forward and loss in a bf16 autocast region on both sides (Tandem's
 *   DataParallel through tdm_strategy_set_precision, PyTorch's torch.autocast("cpu"))
 *
 * TANDEM_BENCH_PYTHON names the python with PyPI's torch and torchvision (bench/run sets it;
 * default: the venv of scripts/setup --bench). Step time = zero_grad + forward + loss +
 * backward + SGD step (lr 0.05, momentum 0.9) + reading the loss, the batch (random, fixed)
 * made before timing. Each configuration's first step of a round is not timed (DataParallel's
 * replica is new; for the others it costs nothing to be fair). */
#include "tandem/tandem.h"

#include "backend/backend.h" /* tdm_cpu_gemm_set_threads */

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_ROUNDS 16
#define MAX_STEPS  16

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, int n) {
    double s[64];
    if (n <= 0) return -1;
    memcpy(s, v, sizeof *v * (size_t)n);
    qsort(s, (size_t)n, sizeof *s, cmp_double);
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

typedef struct {
    const char *name;
    int batch, hw, classes;
    bool small_input;
} figure;

static const figure figures[] = {{"imagenet", 32, 224, 1000, false}, {"cifar", 128, 32, 10, true}};

typedef struct {
    int rounds, steps, depth;
    const char *figure, *script, *configs, *precision;
} bench_opts;

static bool bf16; /* --precision bf16 */

static void die(const char *what) {
    fprintf(stderr, "bench_resnet: %s: %s\n", what, tdm_last_error());
    exit(1);
}

/* ---- Tandem ------------------------------------------------------------------------------ */

static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0, (void)arg;
    return tdm_cross_entropy(out, target, NULL);
}

static tdm_optim *make_sgd(tdm_paramset *ps, void *arg) {
    (void)arg;
    tdm_sgd_opts so = tdm_sgd_defaults(0.05f);
    so.momentum = 0.9f;
    return tdm_sgd_new(ps, &so);
}

/* Median ms of `steps` plain steps of m (one device, the caller's thread), after one untimed. */
static double tandem_plain(tdm_module *m, tdm_optim *opt, tdm_tensor *x, tdm_tensor *y, int steps) {
    double t[MAX_STEPS];
    tdm_cpu_gemm_set_threads(2);
    for (int s = 0; s < 1 + steps; s++) {
        double t0 = now_ms();
        tdm_optim_zero_grad(opt);
        tdm_scope_begin();
        if (bf16 && tdm_autocast_begin(TDM_BF16)) die("autocast");
        tdm_tensor *loss = ce_loss(tdm_module_forward(m, x), y, 0, NULL);
        if (bf16 && tdm_autocast_end()) die("autocast");
        if (!loss || tdm_backward(loss) || tdm_optim_step(opt) || !(tdm_item(loss) >= 0))
            die("plain step");
        tdm_scope_end();
        if (s >= 1) t[s - 1] = now_ms() - t0;
    }
    return median(t, steps);
}

/* Median ms of `steps` DataParallel steps over cpu:0 and cpu:1, after one untimed. The
 * DataParallel is made and freed here: while it lives it pins this thread to core 0 and makes
 * its GEMMs single-threaded, which the plain configuration must not inherit. */
static double tandem_dp(tdm_module *m, tdm_tensor *x, tdm_tensor *y, int steps) {
    double t[MAX_STEPS];
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    /* the strategy, which in bf16 opens each replica's autocast region on its thread */
    tdm_strategy *st = tdm_strategy_data_parallel(m, devs, 2, NULL, make_sgd, NULL);
    if (!st || (bf16 && tdm_strategy_set_precision(st, TDM_BF16))) die("DataParallel");
    for (int s = 0; s < 1 + steps; s++) {
        float loss = -1;
        double t0 = now_ms();
        if (tdm_strategy_step(st, x, y, ce_loss, NULL, &loss) || !(loss >= 0))
            die("DataParallel step");
        if (s >= 1) t[s - 1] = now_ms() - t0;
    }
    tdm_strategy_free(st);
    return median(t, steps);
}

/* ---- PyTorch: one python process per figure, answering "run <variant> <steps>" ------------- */

typedef struct {
    pid_t pid;
    FILE *to, *from;
} torch_proc;

static bool torch_start(torch_proc *tp, const bench_opts *o, const figure *f) {
    const char *py = getenv("TANDEM_BENCH_PYTHON");
    char venv[512], batch[16], hw[16], classes[16], depth[16];
    if (!py) {
        snprintf(venv, sizeof venv, "%s/.cache/tandem/bench-venv/bin/python",
                 getenv("HOME") ? getenv("HOME") : "");
        py = venv;
    }
    snprintf(batch, sizeof batch, "%d", f->batch);
    snprintf(hw, sizeof hw, "%d", f->hw);
    snprintf(classes, sizeof classes, "%d", f->classes);
    snprintf(depth, sizeof depth, "%d", o->depth);
    int in[2], out[2];
    if (pipe(in) || pipe(out)) return false;
    fflush(NULL);
    tp->pid = fork();
    if (tp->pid < 0) return false;
    if (tp->pid == 0) {
        dup2(in[0], 0), dup2(out[1], 1);
        close(in[0]), close(in[1]), close(out[0]), close(out[1]);
        execl(py, py, o->script, "--serve", "--threads", "2", "--warmup", "1", "--batch", batch,
              "--hw", hw, "--classes", classes, "--depth", depth, "--stem",
              f->small_input ? "cifar" : "imagenet", "--autocast", bf16 ? "bf16" : "none",
              (char *)NULL);
        _exit(127);
    }
    close(in[0]), close(out[1]);
    tp->to = fdopen(in[1], "w"), tp->from = fdopen(out[0], "r");
    char line[256];
    while (tp->from && fgets(line, sizeof line, tp->from))
        if (!strncmp(line, "torch ready", 11)) {
            printf("PyTorch %s", line + 12);
            return true;
        }
    return false;
}

/* PyTorch's median ms per step of one round of a variant ("nchw" or "cl"), or -1. */
static double torch_round(torch_proc *tp, const char *variant, int steps) {
    char line[256];
    double ms = -1;
    fprintf(tp->to, "run %s %d\n", variant, steps);
    fflush(tp->to);
    while (fgets(line, sizeof line, tp->from))
        if (sscanf(line, "torch median %lf", &ms) == 1) break;
    return ms;
}

static void torch_stop(torch_proc *tp) {
    if (tp->to) fclose(tp->to); /* end of input: the script returns */
    if (tp->from) fclose(tp->from);
    if (tp->pid > 0) waitpid(tp->pid, NULL, 0);
}

/* ---- the rounds -------------------------------------------------------------------------- */

enum { DP, PLAIN, NCHW, CL, CONFIGS };
static const char *const config_names[CONFIGS] = {"tandem dp", "tandem 1dev", "torch nchw",
                                                  "torch cl"};

/* Whether the comma-separated list names config ("tandem dp" is named "dp"). */
static bool config_on(const char *list, const char *config) {
    const char *name = strchr(config, ' ') + 1;
    size_t len = strlen(name);
    for (const char *p = list; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
        if (!strncmp(p, name, len) && (p[len] == ',' || p[len] == 0)) return true;
    return false;
}

static void run_figure(const bench_opts *o, const figure *f) {
    tdm_resnet_opts ro = tdm_resnet_defaults(o->depth);
    ro.num_classes = f->classes;
    ro.small_input = f->small_input;
    tdm_rng rng = tdm_rng_make(0);
    tdm_module *m = tdm_resnet_new(&ro, tdm_cpu(0), &rng);
    tdm_optim *opt = m ? make_sgd(tdm_module_parameters(m), NULL) : NULL;
    tdm_tensor *x = tdm_randn(TDM_SHAPE(f->batch, 3, f->hw, f->hw), 0, 1, tdm_cpu(0), &rng);
    int64_t labels[256];
    for (int i = 0; i < f->batch; i++) labels[i] = (i * 7) % f->classes;
    tdm_tensor *y = tdm_from_data(TDM_SHAPE(f->batch), TDM_I64, tdm_cpu(0), labels);
    if (!opt || !x || !y) die("setup");
    torch_proc tp = {0};
    bool torch = strcmp(o->script, "-") != 0;
    if (torch && !torch_start(&tp, o, f)) {
        fprintf(stderr, "bench_resnet: %s did not start (TANDEM_BENCH_PYTHON?)\n", o->script);
        torch = false;
    }
    printf("\n%s: resnet%d, batch %d of 3x%dx%d, %d classes, SGD momentum, %s; 2 cores; ms per "
           "step (median of %d per round)\n",
           f->name, o->depth, f->batch, f->hw, f->hw, f->classes, o->precision, o->steps);
    printf("%-6s", "round");
    for (int c = 0; c < CONFIGS; c++) printf(" %12s", config_names[c]);
    printf("\n");
    double t[CONFIGS][MAX_ROUNDS];
    bool on[CONFIGS];
    for (int c = 0; c < CONFIGS; c++) on[c] = config_on(o->configs, config_names[c]);
    on[NCHW] &= torch, on[CL] &= torch;
    for (int r = 0; r < o->rounds; r++) {
        t[PLAIN][r] = on[PLAIN] ? tandem_plain(m, opt, x, y, o->steps) : -1;
        t[DP][r] = on[DP] ? tandem_dp(m, x, y, o->steps) : -1;
        t[NCHW][r] = on[NCHW] ? torch_round(&tp, "nchw", o->steps) : -1;
        t[CL][r] = on[CL] ? torch_round(&tp, "cl", o->steps) : -1;
        printf("%-6d", r + 1);
        for (int c = 0; c < CONFIGS; c++) printf(" %12.1f", t[c][r]);
        printf("\n");
        fflush(stdout);
    }
    double med[CONFIGS];
    printf("%-6s", "median");
    for (int c = 0; c < CONFIGS; c++) printf(" %12.1f", med[c] = median(t[c], o->rounds));
    printf("\n");
    int tb = med[DP] > 0 && (med[PLAIN] <= 0 || med[DP] <= med[PLAIN]) ? DP : PLAIN;
    int pb = med[NCHW] > 0 && (med[CL] <= 0 || med[NCHW] <= med[CL]) ? NCHW : CL;
    if (med[pb] > 0 && med[tb] > 0)
        printf("%s: PyTorch best (%s) / Tandem best (%s) = %.2f   (above 1: Tandem faster)\n",
               f->name, config_names[pb], config_names[tb], med[pb] / med[tb]);
    if (torch) torch_stop(&tp);
    tdm_optim_free(opt);
    tdm_tensor_free(x);
    tdm_tensor_free(y);
    tdm_module_free(m);
}

static bench_opts parse(int argc, char **argv) {
    bench_opts o = {5, 2, 18, "both", "bench/torch_resnet.py", "dp,1dev,nchw,cl", "fp32"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--quick")) {
            o.rounds = 1, o.steps = 1, o.configs = "dp,nchw,cl";
            continue;
        }
        if (!v) break;
        i++;
        if (!strcmp(a, "--rounds"))
            o.rounds = atoi(v);
        else if (!strcmp(a, "--steps"))
            o.steps = atoi(v);
        else if (!strcmp(a, "--depth"))
            o.depth = atoi(v);
        else if (!strcmp(a, "--figure"))
            o.figure = v;
        else if (!strcmp(a, "--configs"))
            o.configs = v;
        else if (!strcmp(a, "--script"))
            o.script = v;
        else if (!strcmp(a, "--precision"))
            o.precision = v;
    }
    if (o.steps < 1 || o.steps > MAX_STEPS) o.steps = 2;
    if (o.rounds < 1 || o.rounds > MAX_ROUNDS) o.rounds = 5;
    if (strcmp(o.precision, "fp32") && strcmp(o.precision, "bf16")) {
        fprintf(stderr, "bench_resnet: --precision %s: expected fp32 or bf16\n", o.precision);
        exit(2);
    }
    bf16 = !strcmp(o.precision, "bf16");
    return o;
}

int main(int argc, char **argv) {
    bench_opts o = parse(argc, argv);
    char gemm[128];
    signal(SIGPIPE, SIG_IGN); /* a PyTorch side that died shows as -1, not as our death */
    printf("Tandem GEMM: %s\n", tdm_gemm_describe(gemm, sizeof gemm));
    for (size_t i = 0; i < sizeof figures / sizeof figures[0]; i++)
        if (!strcmp(o.figure, "both") || !strcmp(o.figure, figures[i].name))
            run_figure(&o, &figures[i]);
    return 0;
}
