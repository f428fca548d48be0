/* Pipeline throughput: an MLP split into 2 stages on cpu:0 and cpu:1 (balanced by parameter
 * count), the batch cut into M micro-batches, GPipe and 1F1B, next to the same split without
 * pipelining (M = 1: the stages take turns) and the unsplit model on one thread.
 *   bench_pipeline [steps per case (default 8)] [batch (default 1024)]
 * Prints the median step, images/s, the speed-up over M = 1, and the bubble fraction measured
 * from the stages' forward/backward spans (1 - busy / (stages x step)) next to the ideal
 * (stages-1)/(M+stages-1). Times are wall-clock: on a shared machine they move with the load. */
#include "tandem/tandem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define IN      768
#define WIDTH   1024
#define CLASSES 512
#define WARMUP  2

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

/* 768 -> 1024 -> 1024 -> 1024 -> 512: 3.3 M parameters. Split by parameters after the second
 * Linear: both halves then cost 4.5 GEMMs of 1024x1024 per row (the first layer needs no
 * input gradient), so the stages are balanced in time. */
static tdm_module *make_model(void) {
    tdm_rng r = tdm_rng_make(7);
    tdm_module *l[7] = {tdm_linear_new(IN, WIDTH, true, tdm_cpu(0), &r),     tdm_relu_new(),
                        tdm_linear_new(WIDTH, WIDTH, true, tdm_cpu(0), &r),  tdm_relu_new(),
                        tdm_linear_new(WIDTH, WIDTH, true, tdm_cpu(0), &r),  tdm_relu_new(),
                        tdm_linear_new(WIDTH, CLASSES, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(7, l);
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

/* One configuration: M == 0 is the unsplit model on the caller's thread. */
typedef struct {
    const char *name;
    int M;
    tdm_pipe_schedule sched;
    tdm_module *m;
    tdm_pipe *p;
    tdm_optim *opt;
    double *t, bubble, busy[2]; /* means over the steps */
} bench_case;

static int case_init(bench_case *c) {
    c->m = make_model();
    tdm_pipe_opts o = tdm_pipe_defaults(2, c->M ? c->M : 1);
    o.schedule = c->sched;
    if (c->M)
        c->p = tdm_pipe_new(c->m, &o, make_sgd, NULL);
    else
        c->opt = make_sgd(tdm_module_parameters(c->m), NULL);
    return c->m && (c->p || c->opt) ? 0 : -1;
}

static int case_step(bench_case *c, tdm_tensor *x, tdm_tensor *y) {
    if (c->p) return tdm_pipe_step(c->p, x, y, ce_loss, NULL, NULL);
    tdm_scope_begin();
    int rc = tdm_optim_zero_grad(c->opt);
    if (!rc) rc = tdm_backward(ce_loss(tdm_module_forward(c->m, x), y, 0, NULL));
    if (!rc) rc = tdm_optim_step(c->opt);
    tdm_scope_end();
    return rc;
}

static void case_free(bench_case *c) {
    tdm_pipe_free(c->p);
    tdm_optim_free(c->opt);
    tdm_module_free(c->m);
    free(c->t);
}

static double median(double *t, int n) {
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    return t[n / 2];
}

/* Runs every case's steps round-robin, so a change of load on the shared machine hits all
 * cases alike instead of whichever ran then. */
static int run_all(bench_case *cs, int n, int steps, tdm_tensor *x, tdm_tensor *y) {
    for (int i = -WARMUP; i < steps; i++)
        for (int k = 0; k < n; k++) {
            double t0 = now_us();
            if (case_step(&cs[k], x, y)) return -1;
            if (i < 0) continue;
            cs[k].t[i] = now_us() - t0;
            tdm_pipe_stats st;
            tdm_pipe_get_stats(cs[k].p, &st);
            cs[k].bubble += st.bubble / steps;
            for (int s = 0; s < 2; s++) cs[k].busy[s] += st.busy_us[s] / steps;
        }
    return 0;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 8;
    int64_t b = argc > 2 ? atoll(argv[2]) : 1024;
    if (steps < 1 || b < 8 || b > 1 << 16) {
        fprintf(stderr, "usage: bench_pipeline [steps >= 1] [batch 8..65536]\n");
        return 2;
    }
    tdm_rng r = tdm_rng_make(1);
    tdm_tensor *x = tdm_randn(TDM_SHAPE(b, IN), 0, 1, tdm_cpu(0), &r);
    int64_t *labels = malloc(sizeof *labels * (size_t)b);
    for (int64_t i = 0; i < b; i++) labels[i] = (i * 37) % CLASSES;
    tdm_tensor *y = tdm_from_data(TDM_SHAPE(b), TDM_I64, tdm_cpu(0), labels);
    free(labels);
    printf("MLP %d-%d-%d-%d-%d, batch %lld, 2 stages on cpu:0 and cpu:1, %d steps per case\n", IN,
           WIDTH, WIDTH, WIDTH, CLASSES, (long long)b, steps);
    printf("%-22s %10s %10s %9s %9s %9s %15s\n", "case", "step ms", "images/s", "vs M=1", "bubble",
           "ideal", "busy ms s0/s1");
    /* pipelines first: the unsplit case then runs with their single-threaded BLAS, one core */
    bench_case cs[] = {{.name = "split, M=1", .M = 1, .sched = TDM_PIPE_1F1B},
                       {.name = "GPipe, M=2", .M = 2, .sched = TDM_PIPE_GPIPE},
                       {.name = "GPipe, M=4", .M = 4, .sched = TDM_PIPE_GPIPE},
                       {.name = "GPipe, M=8", .M = 8, .sched = TDM_PIPE_GPIPE},
                       {.name = "GPipe, M=16", .M = 16, .sched = TDM_PIPE_GPIPE},
                       {.name = "1F1B, M=2", .M = 2, .sched = TDM_PIPE_1F1B},
                       {.name = "1F1B, M=4", .M = 4, .sched = TDM_PIPE_1F1B},
                       {.name = "1F1B, M=8", .M = 8, .sched = TDM_PIPE_1F1B},
                       {.name = "1F1B, M=16", .M = 16, .sched = TDM_PIPE_1F1B},
                       {.name = "unsplit, 1 thread", .M = 0, .sched = 0}};
    int n = (int)(sizeof cs / sizeof cs[0]), rc = 0;
    for (int k = 0; k < n && !rc; k++) {
        cs[k].t = calloc((size_t)steps, sizeof(double));
        rc = cs[k].t && b >= cs[k].M ? case_init(&cs[k]) : -1;
    }
    if (!rc) rc = run_all(cs, n, steps, x, y);
    double base = rc ? 0 : median(cs[0].t, steps);
    for (int k = 0; k < n && !rc; k++) {
        double med = k ? median(cs[k].t, steps) : base;
        printf("%-22s %10.1f %10.0f", cs[k].name, med / 1e3, (double)b / med * 1e6);
        if (cs[k].M)
            printf(" %9.2f %9.3f %9.3f %7.1f/%-7.1f", base / med, cs[k].bubble,
                   tdm_pipe_ideal_bubble(2, cs[k].M), cs[k].busy[0] / 1e3, cs[k].busy[1] / 1e3);
        printf("\n");
    }
    for (int k = n - 1; k >= 0; k--) case_free(&cs[k]); /* restores BLAS threads in order */
    tdm_tensor_free(x);
    tdm_tensor_free(y);
    if (!rc) return 0;
    fprintf(stderr, "bench_pipeline: %s\n", tdm_last_error());
    return 1;
}
