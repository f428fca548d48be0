/* Gradient check against central finite differences.
 *
 * fn builds an output from the inputs with differentiable ops. The check reduces it to the
 * scalar L = sum(out * W) with a fixed random W (so every output element gets a distinct
 * upstream gradient), runs backward, and compares each input element's .grad with
 * (L(x + eps) - L(x - eps)) / (2 eps), evaluated in double from float outputs. */
#ifndef TDM_GRADCHECK_H
#define TDM_GRADCHECK_H

#include <stdlib.h>

#include "check.h"

typedef tdm_tensor *(*gradcheck_fn)(tdm_tensor **in, void *ctx);

/* L = sum(out * w) in double, with w from a fixed seed. */
static double gradcheck_loss(gradcheck_fn fn, tdm_tensor **in, void *ctx, const float *w,
                             int64_t nw) {
    tdm_scope_begin();
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *out = fn(in, ctx);
    tdm_set_grad_enabled(prev);
    double l = NAN;
    if (out && tdm_numel(out) == nw) {
        float *o = (float *)malloc((size_t)nw * sizeof(float));
        if (tdm_to_host(out, o, (size_t)nw * sizeof(float)) == 0) {
            l = 0;
            for (int64_t i = 0; i < nw; i++) l += (double)o[i] * w[i];
        }
        free(o);
    }
    tdm_scope_end();
    return l;
}

/* Checks d(sum(fn(in) * W))/d(in[i]) for every input with requires_grad. Inputs must be
 * caller-owned f32 tensors (views are allowed: the check perturbs their elements through
 * tdm_to_host/tdm_copy_ of the base). Returns the number of mismatching elements. */
static inline int gradcheck(const char *what, gradcheck_fn fn, int n_in, tdm_tensor **in, void *ctx,
                            double eps, double atol, double rtol) {
    int bad = 0;
    /* analytic gradients */
    for (int i = 0; i < n_in; i++)
        if (in[i] && in[i]->requires_grad) tdm_zero_grad(in[i]);
    tdm_scope_begin();
    tdm_tensor *out = fn(in, ctx);
    if (!out) {
        fprintf(stderr, "FAIL %s: forward failed: %s\n", what, tdm_last_error());
        tdm_scope_end();
        check_failed++;
        return 1;
    }
    int64_t nw = tdm_numel(out);
    tdm_rng r = tdm_rng_make(1234);
    tdm_tensor *wt = tdm_randn(tdm_shape_of(out), 0, 1, out->device, &r);
    float *w = (float *)malloc((size_t)nw * sizeof(float));
    tdm_to_host(wt, w, (size_t)nw * sizeof(float));
    tdm_tensor *loss = tdm_sum_all(tdm_mul(out, wt));
    if (!loss || tdm_backward(loss) != 0) {
        fprintf(stderr, "FAIL %s: backward failed: %s\n", what, tdm_last_error());
        tdm_scope_end();
        free(w);
        check_failed++;
        return 1;
    }
    tdm_scope_end();

    for (int i = 0; i < n_in; i++) {
        tdm_tensor *x = in[i];
        if (!x || !x->requires_grad) continue;
        int64_t n = tdm_numel(x);
        float *xv = (float *)malloc((size_t)n * sizeof(float));
        float *g = (float *)malloc((size_t)n * sizeof(float));
        tdm_to_host(x, xv, (size_t)n * sizeof(float));
        if (!x->grad) {
            memset(g, 0, (size_t)n * sizeof(float));
        } else {
            tdm_to_host(x->grad, g, (size_t)n * sizeof(float));
        }
        for (int64_t j = 0; j < n; j++) {
            float orig = xv[j];
            xv[j] = (float)(orig + eps);
            tdm_scope_begin();
            tdm_copy_(x, tdm_from_data(tdm_shape_of(x), TDM_F32, x->device, xv));
            tdm_scope_end();
            double lp = gradcheck_loss(fn, in, ctx, w, nw);
            xv[j] = (float)(orig - eps);
            tdm_scope_begin();
            tdm_copy_(x, tdm_from_data(tdm_shape_of(x), TDM_F32, x->device, xv));
            tdm_scope_end();
            double lm = gradcheck_loss(fn, in, ctx, w, nw);
            xv[j] = orig;
            tdm_scope_begin();
            tdm_copy_(x, tdm_from_data(tdm_shape_of(x), TDM_F32, x->device, xv));
            tdm_scope_end();
            double num = (lp - lm) / (2 * eps);
            if (!(fabs(num - g[j]) <= atol + rtol * fabs(num))) {
                if (bad < 5)
                    fprintf(stderr, "FAIL %s: input %d element %lld: analytic %.7g numeric %.7g\n",
                            what, i, (long long)j, g[j], num);
                bad++;
            }
        }
        free(xv);
        free(g);
    }
    free(w);
    if (bad)
        check_failed++;
    else
        check_passed++;
    return bad;
}

/* A caller-owned random f32 leaf that requires a gradient. */
static inline tdm_tensor *gradcheck_input(tdm_shape s, uint64_t seed) {
    tdm_rng r = tdm_rng_make(seed);
    tdm_tensor *t = tdm_randn(s, 0, 1, tdm_cpu(0), &r);
    tdm_requires_grad_(t, true);
    return t;
}

#endif
