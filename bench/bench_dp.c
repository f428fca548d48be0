/* DataParallel step latency: a tiny model (where the step is nothing but synchronisation), the
 * Fashion-MNIST MLP (SGD) and CNN (Adam) of `tandem train`, global batch 64, on 1 and 2 CPU
 * devices, next to the same step without DataParallel ("plain": forward, loss, backward and
 * the optimizer on the caller's thread).
 *   bench_dp [steps per case (default 400)] [tiny|mlp|cnn (default all)] [plain|1|2 (default all)]
 * A model's cases run in turns of a tenth of the steps each, so a change of load on this shared
 * machine hits all of them alike. Prints median, p90 and mean microseconds per step, images/s
 * at the median and, for 2 devices, the speed-up over 1 at the median. Set OPENBLAS_NUM_THREADS
 * to choose the plain step's BLAS threads (DataParallel on as many devices as cores makes BLAS
 * single-threaded itself). Then, for the MLP and the CNN, the ceiling of 2 devices over 1 on this
 * machine: two plain half-batch steps at once, one per core, with no communication at all. */
#include "tandem/tandem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define B       64
#define IN      784
#define CLASSES 10
#define WARMUP  30

typedef enum { TINY, MLP, CNN } model_kind;
static const char *const kind_names[] = {"tiny", "mlp", "cnn"};

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static tdm_module *make_model(model_kind kind, tdm_device dev) {
    tdm_rng rng = tdm_rng_make(7);
    if (kind != TINY) return tdm_model_new(kind_names[kind], dev, &rng); /* `tandem train`'s */
    /* x [64, 784] -> [64, 4] -> [64, 10]: ~3 K parameters, one 12 KiB bucket */
    tdm_module *l[3] = {tdm_linear_new(IN, 4, true, dev, &rng), tdm_relu_new(),
                        tdm_linear_new(4, CLASSES, true, dev, &rng)};
    return tdm_sequential_new(3, l);
}

/* The trainer's settings: SGD lr 0.01 for the MLP (and the tiny model), Adam 1e-3 for the CNN. */
static tdm_optim *make_optim(tdm_paramset *ps, void *arg) {
    if (*(const model_kind *)arg == CNN) {
        tdm_adam_opts o = tdm_adam_defaults();
        return tdm_adam_new(ps, &o);
    }
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

/* One case: devices 0 is the plain step on the caller's thread, otherwise DataParallel. */
typedef struct {
    int devices;
    tdm_module *m;
    tdm_dp *dp;
    tdm_optim *opt;
    double *t; /* [steps] microseconds */
} dp_case;

static int case_init(dp_case *c, model_kind *kind, int steps) {
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    c->m = make_model(*kind, tdm_cpu(0));
    if (!c->m) return -1;
    if (c->devices)
        c->dp = tdm_dp_new(c->m, devs, c->devices, make_optim, kind);
    else
        c->opt = make_optim(tdm_module_parameters(c->m), kind);
    c->t = malloc(sizeof *c->t * (size_t)steps);
    return (c->dp || c->opt) && c->t ? 0 : -1;
}

static int case_step(dp_case *c, tdm_tensor *x, tdm_tensor *y) {
    float loss;
    if (c->dp) return tdm_dp_step(c->dp, x, y, ce_loss, NULL, &loss);
    tdm_scope_begin();
    int rc = tdm_optim_zero_grad(c->opt);
    if (!rc) rc = tdm_backward(ce_loss(tdm_module_forward(c->m, x), y, 0, NULL));
    if (!rc) rc = tdm_optim_step(c->opt);
    tdm_scope_end();
    return rc;
}

static void case_free(dp_case *c) {
    tdm_dp_free(c->dp);
    tdm_optim_free(c->opt);
    tdm_module_free(c->m);
    free(c->t);
}

/* Median microseconds (sorts c->t) after printing the case's line. */
static double case_report(dp_case *c, model_kind kind, int steps, double one_dev) {
    double mean = 0;
    for (int i = 0; i < steps; i++) mean += c->t[i] / steps;
    qsort(c->t, (size_t)steps, sizeof *c->t, cmp_double);
    double med = c->t[steps / 2];
    char name[32];
    snprintf(name, sizeof name, c->devices ? "dp %d dev" : "plain", c->devices);
    printf("%-6s %-10s %10.1f %10.1f %10.1f %10.0f", kind_names[kind], name, med,
           c->t[steps * 9 / 10], mean, B / med * 1e6);
    if (c->devices == 2 && one_dev > 0) printf("  %.2fx 1 dev", one_dev / med);
    printf("\n");
    return med;
}

/* Runs the chosen cases of one model in turns of steps/10 steps each (after a warm-up each). */
static int run_model(model_kind kind, int only_devices, int steps, tdm_tensor *x, tdm_tensor *y,
                     double *plain_us) {
    dp_case cs[3] = {{.devices = 0}, {.devices = 1}, {.devices = 2}};
    int rc = 0, turn = steps / 10;
    for (int k = 0; k < 3 && !rc; k++)
        if (only_devices < 0 || only_devices == k) rc = case_init(&cs[k], &kind, steps);
    for (int k = 0; k < 3 && !rc; k++)
        for (int i = 0; i < WARMUP && cs[k].m && !rc; i++) rc = case_step(&cs[k], x, y);
    for (int done = 0; done < steps && !rc; done += turn)
        for (int k = 0; k < 3 && !rc; k++)
            for (int i = done; i < done + turn && i < steps && cs[k].m && !rc; i++) {
                double t0 = now_us();
                rc = case_step(&cs[k], x, y);
                cs[k].t[i] = now_us() - t0;
            }
    double one_dev = 0;
    for (int k = 0; k < 3 && !rc; k++)
        if (cs[k].m) {
            double med = case_report(&cs[k], kind, steps, one_dev);
            if (k == 0) *plain_us = med;
            if (k == 1) one_dev = med;
        }
    for (int k = 2; k >= 0; k--) case_free(&cs[k]);
    return rc;
}

/* The ceiling of 2 devices over 1 with free communication: two independent plain steps of half
 * the batch, one per core at once (tdm_spawn: pinned, BLAS single-threaded), against one of the
 * whole batch alone. Both cores computing share the caches and memory; one alone has them. */
typedef struct {
    model_kind kind;
    int steps;
    const float *xd;
    const int64_t *yd;
    double med[2]; /* per rank, microseconds */
} floor_arg;

static int floor_rank(tdm_rank_ctx *ctx, void *argp) {
    floor_arg *a = argp;
    int64_t rows = B / 2;
    tdm_shape xs = a->kind == CNN ? TDM_SHAPE(rows, 1, 28, 28) : TDM_SHAPE(rows, IN);
    dp_case c = {.devices = 0};
    tdm_tensor *x = tdm_from_data(xs, TDM_F32, ctx->device, a->xd + ctx->rank * rows * IN);
    tdm_tensor *y = tdm_from_data(TDM_SHAPE(rows), TDM_I64, ctx->device, a->yd + ctx->rank * rows);
    c.m = make_model(a->kind, ctx->device);
    c.opt = c.m ? make_optim(tdm_module_parameters(c.m), &a->kind) : NULL;
    c.t = malloc(sizeof *c.t * (size_t)a->steps);
    int rc = x && y && c.opt && c.t ? 0 : -1;
    for (int i = 0; i < WARMUP && !rc; i++) rc = case_step(&c, x, y);
    if (!rc) rc = tdm_work_wait(tdm_barrier(ctx->group)); /* start together */
    for (int i = 0; i < a->steps && !rc; i++) {
        double t0 = now_us();
        rc = case_step(&c, x, y);
        c.t[i] = now_us() - t0;
    }
    if (!rc) {
        qsort(c.t, (size_t)a->steps, sizeof *c.t, cmp_double);
        a->med[ctx->rank] = c.t[a->steps / 2];
    }
    case_free(&c);
    tdm_tensor_free(x);
    tdm_tensor_free(y);
    return rc;
}

static int print_floor(model_kind kind, int steps, const float *xd, const int64_t *yd,
                       double whole_us) {
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    floor_arg a = {.kind = kind, .steps = steps, .xd = xd, .yd = yd};
    if (tdm_spawn(2, devs, floor_rank, &a)) return -1;
    double slow = a.med[0] > a.med[1] ? a.med[0] : a.med[1];
    printf("# %s ceiling: 2 independent plain steps of batch %d at once, one per core: %.1f / "
           "%.1f us; 1 of batch %d alone %.1f us: 2 devices can be at most %.2fx one\n",
           kind_names[kind], B / 2, a.med[0], a.med[1], B, whole_us, whole_us / slow);
    return 0;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 400;
    const char *only = argc > 2 ? argv[2] : "";
    int only_devices = argc > 3 ? atoi(argv[3]) : -1;
    if (steps < 10 || only_devices > 2 ||
        (only[0] && strcmp(only, "tiny") && strcmp(only, "mlp") && strcmp(only, "cnn"))) {
        fprintf(stderr, "usage: bench_dp [steps per case, at least 10] [tiny|mlp|cnn] [0|1|2]\n");
        return 2;
    }
    float *xd = malloc(sizeof *xd * B * IN);
    int64_t yd[B];
    for (int i = 0; i < B * IN; i++) xd[i] = (float)((i * 7919) % 255) / 255.0f;
    for (int i = 0; i < B; i++) yd[i] = (i * 3) % CLASSES;
    tdm_tensor *flat = tdm_from_data(TDM_SHAPE(B, IN), TDM_F32, tdm_cpu(0), xd);
    tdm_tensor *image = tdm_from_data(TDM_SHAPE(B, 1, 28, 28), TDM_F32, tdm_cpu(0), xd);
    tdm_tensor *y = tdm_from_data(TDM_SHAPE(B), TDM_I64, tdm_cpu(0), yd);
    const char *blas = getenv("OPENBLAS_NUM_THREADS");
    printf("# bench_dp: batch %d, %d steps per case, %d CPU devices, OPENBLAS_NUM_THREADS=%s\n", B,
           steps, tdm_device_count(TDM_CPU), blas ? blas : "(unset)");
    printf("%-6s %-10s %10s %10s %10s %10s\n", "model", "step", "median_us", "p90_us", "mean_us",
           "img/s");
    int rc = 0;
    for (model_kind k = TINY; k <= CNN && !rc; k++) {
        if (only[0] && strcmp(only, kind_names[k]) != 0) continue;
        int n = k == CNN ? steps / 4 : steps; /* a CNN step is ~20x an MLP step */
        double plain_us = 0;
        rc = run_model(k, only_devices, n, k == CNN ? image : flat, y, &plain_us);
        if (!rc && k != TINY && only_devices <= 0) rc = print_floor(k, n, xd, yd, plain_us);
    }
    if (rc) fprintf(stderr, "bench_dp: %s\n", tdm_last_error());
    tdm_tensor_free(flat);
    tdm_tensor_free(image);
    tdm_tensor_free(y);
    free(xd);
    return rc ? 1 : 0;
}
