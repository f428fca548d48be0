/* conv2d and max_pool2d on the Fashion-MNIST CNN shapes (batch 64), forward and
 * forward+backward, against PyTorch (bench/torch_conv.py, run by this program).
 *
 *   OPENBLAS_NUM_THREADS=1 ./build/bench_conv [seconds per case] [path/to/torch_conv.py] [filter]
 *
 * filter (optional) runs only the cases whose name contains it (e.g. "conv2"), for profiling;
 * a torch script path of "-" skips PyTorch.
 *
 * Forward runs the op with gradients off. Forward+backward runs the op with gradients on
 * (it records its node) and then the backward kernel the engine would call, with the
 * upstream gradient given, as PyTorch's y.backward(gy) does. Each iteration is one step
 * scope, as in training. Prints ms per iteration (mean and best) and Tandem/PyTorch. */
#include "tandem/tandem.h"

#include "autograd/tape.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N 64

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    tdm_tensor *x, *w, *b, *gy, *gx, *gw, *gb;
    tdm_conv2d_opts o;
    bool x_grad;
} bench_case;

typedef void (*bench_fn)(bench_case *c);

static void conv_fwd(bench_case *c) {
    tdm_scope_begin();
    bool prev = tdm_set_grad_enabled(false);
    tdm_conv2d(c->x, c->w, c->b, &c->o);
    tdm_set_grad_enabled(prev);
    tdm_scope_end();
}

static void conv_fwdbwd(bench_case *c) {
    tdm_scope_begin();
    tdm_tensor *y = tdm_conv2d(c->x, c->w, c->b, &c->o);
    tdm_conv2d_args a = {1, 1, c->o.pad_h, c->o.pad_w, 1, 1, 1};
    if (!y ||
        tdm_backend_for(tdm_cpu(0))
            ->conv2d_backward(c->x_grad ? c->gx : NULL, c->gw, c->gb, c->gy, c->x, c->w, &a)) {
        fprintf(stderr, "bench_conv: %s\n", tdm_last_error());
        exit(1);
    }
    tdm_scope_end();
}

static const tdm_pool2d_opts pool2 = {.kernel_h = 2, .kernel_w = 2};

static void pool_fwd(bench_case *c) {
    tdm_scope_begin();
    bool prev = tdm_set_grad_enabled(false);
    tdm_max_pool2d(c->x, &pool2);
    tdm_set_grad_enabled(prev);
    tdm_scope_end();
}

static void pool_fwdbwd(bench_case *c) {
    tdm_scope_begin();
    tdm_tensor *y = tdm_max_pool2d(c->x, &pool2);
    /* the node keeps the indices; the backward kernel is what the engine runs */
    if (!y ||
        tdm_backend_for(tdm_cpu(0))->max_pool2d_backward(c->gx, c->gy, y->grad_fn->saved[0])) {
        fprintf(stderr, "bench_conv: %s\n", tdm_last_error());
        exit(1);
    }
    tdm_scope_end();
}

static void run(bench_case *c, bench_fn fn, double min_time, double *mean_ms, double *best_ms) {
    for (int i = 0; i < 5; i++) fn(c);
    double t0 = now(), best = 1e30;
    int iters = 0;
    while (now() - t0 < min_time || iters < 10) {
        double t = now();
        fn(c);
        t = now() - t;
        if (t < best) best = t;
        iters++;
    }
    *mean_ms = (now() - t0) / iters * 1e3;
    *best_ms = best * 1e3;
}

static bench_case make_conv(int64_t cin, int64_t cout, int64_t hw, bool x_grad) {
    tdm_rng r = tdm_rng_make(0);
    bench_case c = {0};
    c.x = tdm_randn(TDM_SHAPE(N, cin, hw, hw), 0, 1, tdm_cpu(0), &r);
    c.w = tdm_randn(TDM_SHAPE(cout, cin, 3, 3), 0, 0.1f, tdm_cpu(0), &r);
    c.b = tdm_randn(TDM_SHAPE(cout), 0, 0.1f, tdm_cpu(0), &r);
    c.gy = tdm_randn(TDM_SHAPE(N, cout, hw, hw), 0, 1, tdm_cpu(0), &r);
    c.gx = tdm_empty(TDM_SHAPE(N, cin, hw, hw), TDM_F32, tdm_cpu(0));
    c.gw = tdm_empty(TDM_SHAPE(cout, cin, 3, 3), TDM_F32, tdm_cpu(0));
    c.gb = tdm_empty(TDM_SHAPE(cout), TDM_F32, tdm_cpu(0));
    tdm_requires_grad_(c.w, true);
    tdm_requires_grad_(c.b, true);
    if (x_grad) tdm_requires_grad_(c.x, true);
    c.x_grad = x_grad;
    c.o = (tdm_conv2d_opts){.pad_h = 1, .pad_w = 1};
    return c;
}

static bench_case make_pool(int64_t ch, int64_t hw) {
    tdm_rng r = tdm_rng_make(0);
    bench_case c = {0};
    c.x = tdm_randn(TDM_SHAPE(N, ch, hw, hw), 0, 1, tdm_cpu(0), &r);
    c.gy = tdm_randn(TDM_SHAPE(N, ch, hw / 2, hw / 2), 0, 1, tdm_cpu(0), &r);
    c.gx = tdm_empty(TDM_SHAPE(N, ch, hw, hw), TDM_F32, tdm_cpu(0));
    tdm_requires_grad_(c.x, true);
    return c;
}

static void free_case(bench_case *c) {
    tdm_tensor *ts[] = {c->x, c->w, c->b, c->gy, c->gx, c->gw, c->gb};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        if (ts[i]) tdm_tensor_free(ts[i]);
}

/* PyTorch's figures, read from the script's "torch <case> <mean> <best>" lines. */
#define MAX_CASES 16
static char torch_names[MAX_CASES][32];
static double torch_mean[MAX_CASES];
static int n_torch;

static void run_torch(const char *script, double min_time) {
    char cmd[1024];
    const char *py = getenv("TANDEM_BENCH_PYTHON"); /* bench/run: the venv's, with PyPI's torch */
    snprintf(cmd, sizeof cmd, "%s %s %g 2>/dev/null", py ? py : "python3", script, min_time);
    FILE *p = popen(cmd, "r");
    if (!p) return;
    char line[256];
    while (fgets(line, sizeof line, p)) {
        if (line[0] == '#') {
            printf("%s", line);
            continue;
        }
        double mean, best;
        if (n_torch < MAX_CASES &&
            sscanf(line, "torch %31s %lf %lf", torch_names[n_torch], &mean, &best) == 3)
            torch_mean[n_torch++] = mean;
    }
    pclose(p);
}

static double torch_ms(const char *name) {
    for (int i = 0; i < n_torch; i++)
        if (!strcmp(torch_names[i], name)) return torch_mean[i];
    return 0;
}

int main(int argc, char **argv) {
    double min_time = argc > 1 ? atof(argv[1]) : 1.0;
    const char *script = argc > 2 ? argv[2] : "bench/torch_conv.py";
    const char *filter = argc > 3 ? argv[3] : NULL;
    const char *ct = getenv("OPENBLAS_CORETYPE"), *nt = getenv("OPENBLAS_NUM_THREADS");
    printf("# bench_conv: batch %d, OPENBLAS_NUM_THREADS=%s, OPENBLAS_CORETYPE=%s\n", N,
           nt ? nt : "(unset)", ct ? ct : "(unset)");

    struct {
        const char *name;
        bench_fn fn;
        int which; /* 0 conv1, 1 conv2, 2 pool1, 3 pool2 */
    } cases[] = {
        {"conv1_fwd", conv_fwd, 0}, {"conv1_fwdbwd", conv_fwdbwd, 0},
        {"conv2_fwd", conv_fwd, 1}, {"conv2_fwdbwd", conv_fwdbwd, 1},
        {"pool1_fwd", pool_fwd, 2}, {"pool1_fwdbwd", pool_fwdbwd, 2},
        {"pool2_fwd", pool_fwd, 3}, {"pool2_fwdbwd", pool_fwdbwd, 3},
    };
    int nc = (int)(sizeof cases / sizeof cases[0]);
    double mean[16], best[16];
    for (int i = 0; i < nc; i++) {
        mean[i] = best[i] = -1;
        if (filter && !strstr(cases[i].name, filter)) continue;
        bench_case c;
        switch (cases[i].which) {
        case 0:
            c = make_conv(1, 32, 28, false);
            break; /* conv1 1->32 on 28x28 */
        case 1:
            c = make_conv(32, 64, 14, true);
            break; /* conv2 32->64 on 14x14 */
        case 2:
            c = make_pool(32, 28);
            break; /* pool after conv1 */
        default:
            c = make_pool(64, 14);
            break; /* pool after conv2 */
        }
        run(&c, cases[i].fn, min_time, &mean[i], &best[i]);
        free_case(&c);
    }
    if (strcmp(script, "-")) run_torch(script, min_time);
    printf("%-14s %12s %12s %12s %10s\n", "case", "tandem ms", "best ms", "torch ms", "ratio");
    for (int i = 0; i < nc; i++) {
        if (mean[i] < 0) continue;
        double t = torch_ms(cases[i].name);
        if (t > 0)
            printf("%-14s %12.3f %12.3f %12.3f %10.2f\n", cases[i].name, mean[i], best[i], t,
                   mean[i] / t);
        else
            printf("%-14s %12.3f %12.3f %12s %10s\n", cases[i].name, mean[i], best[i], "-", "-");
    }
    if (!n_torch && strcmp(script, "-"))
        printf("# PyTorch figures unavailable (run from the repository root)\n");
    return 0;
}
