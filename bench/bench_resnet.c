/* One training step of the CIFAR-style ResNet-18 (3x3 stem, no max-pool; batch 32 of
 * 3x32x32, SGD with momentum) against PyTorch + torchvision (bench/torch_resnet.py, run by
 * this program), one thread each, in interleaved rounds: Tandem's steps, then PyTorch's, R
 * times. Prints each round's median ms per step and the median over rounds, and the ratio.
 *
 *   build/bench_resnet [--rounds 3] [--steps 5] [--batch 32] [--hw 32] [--depth 18]
 *                      [--script bench/torch_resnet.py | -]   (- : Tandem only)
 *
 * TANDEM_BENCH_PYTHON names the python with PyPI's torch and torchvision (bench/run sets it;
 * default: the venv of scripts/setup --bench). Step time = zero_grad + forward + loss +
 * backward + SGD step + reading the loss, the batch made before timing, one step scope. */
#include "tandem/tandem.h"

#include "backend/cpu/cpu.h" /* tdm_cpu_gemm_set_threads */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct {
    int rounds, steps, batch, hw, depth;
    const char *script;
} bench_opts;

/* Median ms of `steps` training steps of m on (x, y), after `warmup` untimed ones. */
static double tandem_round(tdm_module *m, tdm_optim *opt, tdm_tensor *x, tdm_tensor *y, int warmup,
                           int steps) {
    double t[64];
    for (int s = 0; s < warmup + steps; s++) {
        double t0 = now_ms();
        tdm_optim_zero_grad(opt);
        tdm_scope_begin();
        tdm_tensor *loss = tdm_cross_entropy(tdm_module_forward(m, x), y, NULL);
        if (!loss || tdm_backward(loss) || tdm_optim_step(opt) || !(tdm_item(loss) >= 0)) {
            fprintf(stderr, "bench_resnet: step failed: %s\n", tdm_last_error());
            exit(1);
        }
        tdm_scope_end();
        if (s >= warmup) t[s - warmup] = now_ms() - t0;
    }
    return median(t, steps);
}

/* PyTorch's median ms per step over one run of the script, or -1. */
static double torch_round(const bench_opts *o) {
    const char *py = getenv("TANDEM_BENCH_PYTHON");
    char venv[512], cmd[1024], line[256];
    if (!py) {
        snprintf(venv, sizeof venv, "%s/.cache/tandem/bench-venv/bin/python",
                 getenv("HOME") ? getenv("HOME") : "");
        py = venv;
    }
    snprintf(cmd, sizeof cmd, "%s %s --steps %d --batch %d --hw %d --depth %d --threads 1", py,
             o->script, o->steps, o->batch, o->hw, o->depth);
    FILE *p = popen(cmd, "r");
    double ms = -1;
    while (p && fgets(line, sizeof line, p)) sscanf(line, "torch median %lf", &ms);
    if (p) pclose(p);
    return ms;
}

static bench_opts parse(int argc, char **argv) {
    bench_opts o = {3, 5, 32, 32, 18, "bench/torch_resnet.py"};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--rounds"))
            o.rounds = atoi(v);
        else if (!strcmp(a, "--steps"))
            o.steps = atoi(v);
        else if (!strcmp(a, "--batch"))
            o.batch = atoi(v);
        else if (!strcmp(a, "--hw"))
            o.hw = atoi(v);
        else if (!strcmp(a, "--depth"))
            o.depth = atoi(v);
        else if (!strcmp(a, "--script"))
            o.script = v;
    }
    if (o.steps < 1 || o.steps > 64) o.steps = 5;
    if (o.rounds < 1 || o.rounds > 16) o.rounds = 3;
    return o;
}

int main(int argc, char **argv) {
    bench_opts o = parse(argc, argv);
    tdm_cpu_gemm_set_threads(1);
    tdm_resnet_opts ro = tdm_resnet_defaults(o.depth);
    ro.num_classes = 10;
    ro.small_input = true;
    tdm_rng rng = tdm_rng_make(0);
    tdm_module *m = tdm_resnet_new(&ro, tdm_cpu(0), &rng);
    tdm_sgd_opts so = tdm_sgd_defaults(0.05f);
    so.momentum = 0.9f;
    tdm_optim *opt = m ? tdm_sgd_new(tdm_module_parameters(m), &so) : NULL;
    tdm_tensor *x = tdm_randn(TDM_SHAPE(o.batch, 3, o.hw, o.hw), 0, 1, tdm_cpu(0), &rng);
    int64_t *labels = calloc((size_t)o.batch, sizeof *labels);
    for (int i = 0; labels && i < o.batch; i++) labels[i] = (i * 7) % 10;
    tdm_tensor *y = labels ? tdm_from_data(TDM_SHAPE(o.batch), TDM_I64, tdm_cpu(0), labels) : NULL;
    if (!opt || !x || !y) {
        fprintf(stderr, "bench_resnet: %s\n", tdm_last_error());
        return 1;
    }
    printf("resnet%d (CIFAR stem), batch %d of 3x%dx%d, SGD momentum; one thread; ms per step\n",
           o.depth, o.batch, o.hw, o.hw);
    printf("%-6s %10s %10s %8s\n", "round", "tandem", "torch", "ratio");
    double tt[16], pt[16];
    int np = 0;
    for (int r = 0; r < o.rounds; r++) {
        tt[r] = tandem_round(m, opt, x, y, r == 0 ? 2 : 1, o.steps);
        double p = strcmp(o.script, "-") ? torch_round(&o) : -1;
        if (p > 0) pt[np++] = p;
        printf("%-6d %10.1f %10.1f %8.2f\n", r + 1, tt[r], p, p > 0 ? tt[r] / p : 0);
        fflush(stdout);
    }
    double tm = median(tt, o.rounds), pm = np ? median(pt, np) : -1;
    printf("%-6s %10.1f %10.1f %8.2f   (Tandem / PyTorch; below 1: Tandem faster)\n", "median", tm,
           pm, pm > 0 ? tm / pm : 0);
    free(labels);
    tdm_optim_free(opt);
    tdm_module_free(m);
    return 0;
}
