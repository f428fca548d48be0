/* Optimizer step speed: the fused Adam and SGD-momentum kernels over one flat buffer of 1M and
 * 10M parameters, one thread. Compare with PyTorch: python3 bench/torch_optim.py (which runs
 * this binary too when given its path, and prints the ratios).
 *
 * Output, one line per case: "tandem <optimizer> <params> <ms per step>".
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "tandem/tandem.h"

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static const tdm_module_ops holder_ops = {"Holder", NULL, NULL};

/* Median of reps timed steps after warmup ones. */
static double time_steps(tdm_optim *o, int reps) {
    double t[64];
    for (int i = 0; i < 3; i++) tdm_optim_step(o);
    for (int i = 0; i < reps; i++) {
        double t0 = now_ms();
        tdm_optim_step(o);
        t[i] = now_ms() - t0;
    }
    for (int i = 1; i < reps; i++) /* insertion sort */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    return t[reps / 2];
}

int main(void) {
    int64_t sizes[2] = {1000000, 10000000};
    for (int si = 0; si < 2; si++) {
        int64_t n = sizes[si];
        tdm_rng r = tdm_rng_make(42);
        tdm_module *m = tdm_module_new(&holder_ops, tdm_cpu(0), NULL);
        tdm_module_add_param(m, "w", tdm_randn(TDM_SHAPE(n), 0, 1, tdm_cpu(0), &r));
        tdm_paramset *ps = tdm_module_parameters(m);
        if (!ps) {
            fprintf(stderr, "bench_optim: %s\n", tdm_last_error());
            return 1;
        }
        tdm_normal_(ps->flat_grad, 0, 1, &r);
        int reps = n > 5000000 ? 15 : 41;

        tdm_adam_opts ao = tdm_adam_defaults();
        tdm_optim *adam = tdm_adam_new(ps, &ao);
        printf("tandem adam %lld %.3f\n", (long long)n, time_steps(adam, reps));
        tdm_optim_free(adam);

        tdm_adam_opts aw = tdm_adamw_defaults();
        tdm_optim *adamw = tdm_adamw_new(ps, &aw);
        printf("tandem adamw %lld %.3f\n", (long long)n, time_steps(adamw, reps));
        tdm_optim_free(adamw);

        tdm_sgd_opts so = tdm_sgd_defaults(0.01f);
        so.momentum = 0.9f;
        tdm_optim *sgd = tdm_sgd_new(ps, &so);
        printf("tandem sgd_momentum %lld %.3f\n", (long long)n, time_steps(sgd, reps));
        tdm_optim_free(sgd);
        tdm_module_free(m);
        fflush(stdout);
    }
    return 0;
}
