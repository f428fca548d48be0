/* CPU optimizer kernels: one fused pass over flat f32 buffers per step.
 *
 * The formulas are PyTorch 1.13's single-tensor paths (torch/optim/sgd.py, adam.py, adamw.py),
 * with the same operation order where it changes the float rounding:
 *   SGD   g' = g (+ wd*p);  b = g' (first step) or mu*b + (1-dampening)*g';
 *         d = nesterov ? g' + mu*b : b;  p -= lr*d
 *   Adam  g' = g (+ wd*p, L2) or p *= 1 - lr*wd first (AdamW, decoupled);
 *         m = b1*m + (1-b1)*g';  v = b2*v + (1-b2)*g'^2;  (vmax = max(vmax, v))
 *         p += (-lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps),  bc_k = 1 - b_k^step
 * maximize negates g before anything else.
 *
 * Each loop is written once as an always-inline function over compile-time flags and
 * instantiated per flag combination, so every variant is a branch-free loop the compiler
 * vectorises at O3 (sqrtf too: the build has -fno-math-errno), in each instruction set of
 * TDM_CPU_CLONES.
 */
#pragma GCC optimize("O3")

#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_isa.h"

#include <math.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* ---- checks ----------------------------------------------------------------------------- */

static int check_flat(const tdm_tensor *t, int64_t n, const char *op, const char *what) {
    if (!t) return tdm_raise(TDM_ERR_ARG, "%s: %s is NULL", op, what);
    /* mixed precision keeps parameters, their gradients and the optimizer's state in fp32
     * (docs/MIXED_PRECISION.md): a bf16 or f16 buffer here is a caller's mistake */
    if (t->dtype == TDM_BF16 || t->dtype == TDM_F16)
        return tdm_raise(TDM_ERR_DTYPE,
                         "%s: %s is %s: the optimizers step fp32 parameters with fp32 gradients "
                         "and state only (cast a low-precision gradient to f32 first)",
                         op, what, tdm_dtype_name(t->dtype));
    if (t->dtype != TDM_F32 || !tdm_is_contiguous(t) || tdm_numel(t) != n)
        return tdm_raise(TDM_ERR_ARG,
                         "%s: %s must be a contiguous f32 buffer of %lld elements, got %s "
                         "with %lld elements",
                         op, what, (long long)n, tdm_dtype_name(t->dtype), (long long)tdm_numel(t));
    return TDM_OK;
}

/* ---- SGD -------------------------------------------------------------------------------- */

ALWAYS_INLINE void sgd_loop(float *restrict p, const float *restrict g, float *restrict b,
                            int64_t n, float lr, float mu, float damp1, float wd, float sign,
                            const bool has_wd, const bool has_mom, const bool nesterov,
                            const bool first) {
    for (int64_t i = 0; i < n; i++) {
        float d = sign * g[i];
        if (has_wd) d = d + wd * p[i];
        if (has_mom) {
            float bi = first ? d : b[i] * mu + damp1 * d;
            b[i] = bi;
            d = nesterov ? d + mu * bi : bi;
        }
        p[i] = p[i] - lr * d;
    }
}

/* One instantiation per (weight decay, momentum, nesterov, first) combination. */
#define SGD_CASE(wd_, mom_, nest_, first_)                                                         \
    sgd_loop(pp, gg, bb, n, h->lr, h->momentum, 1.0f - h->dampening, h->weight_decay, sign, wd_,   \
             mom_, nest_, first_)

TDM_CPU_CLONES
int tdm_cpu_sgd_step(tdm_tensor *p, const tdm_tensor *g, tdm_tensor *buf, const tdm_sgd_hparams *h,
                     bool first) {
    int64_t n = tdm_numel(p);
    if (check_flat(p, n, "cpu sgd_step", "p") || check_flat(g, n, "cpu sgd_step", "grad"))
        return tdm_last_status();
    bool mom = h->momentum != 0.0f;
    if (mom && check_flat(buf, n, "cpu sgd_step", "momentum buffer")) return tdm_last_status();
    float *pp = tdm_data_ptr(p), *bb = mom ? tdm_data_ptr(buf) : NULL;
    const float *gg = tdm_data_ptr(g);
    float sign = h->maximize ? -1.0f : 1.0f;
    bool wd = h->weight_decay != 0.0f, nest = h->nesterov;
    if (!mom) {
        if (wd)
            SGD_CASE(true, false, false, false);
        else
            SGD_CASE(false, false, false, false);
    } else if (first) {
        if (wd)
            nest ? SGD_CASE(true, true, true, true) : SGD_CASE(true, true, false, true);
        else
            nest ? SGD_CASE(false, true, true, true) : SGD_CASE(false, true, false, true);
    } else {
        if (wd)
            nest ? SGD_CASE(true, true, true, false) : SGD_CASE(true, true, false, false);
        else
            nest ? SGD_CASE(false, true, true, false) : SGD_CASE(false, true, false, false);
    }
    return TDM_OK;
}

/* ---- Adam / AdamW ----------------------------------------------------------------------- */

typedef struct {
    float sign, wd, decay; /* decay = 1 - lr*wd (AdamW) */
    float b1, omb1, b2, omb2;
    float bc2_sqrt, eps, neg_step_size;
} adam_consts;

ALWAYS_INLINE void adam_loop(float *restrict p, const float *restrict g, float *restrict m,
                             float *restrict v, float *restrict vmax, int64_t n,
                             const adam_consts *c, const bool l2, const bool decoupled,
                             const bool amsgrad) {
    const float sign = c->sign, wd = c->wd, decay = c->decay, b1 = c->b1, omb1 = c->omb1,
                b2 = c->b2, omb2 = c->omb2, bc2s = c->bc2_sqrt, eps = c->eps,
                nss = c->neg_step_size;
    int64_t i = 0;
    for (; i < n; i++) {
        float gi = sign * g[i];
        float pi = p[i];
        if (l2) gi = gi + wd * pi;
        if (decoupled) pi = pi * decay;
        float mi = m[i] * b1 + omb1 * gi;
        float vi = v[i] * b2 + omb2 * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        float vv = vi;
        if (amsgrad) {
            vv = vmax[i] > vi ? vmax[i] : vi;
            vmax[i] = vv;
        }
        float denom = sqrtf(vv) / bc2s + eps;
        p[i] = pi + nss * mi / denom;
    }
}

#define ADAM_CASE(l2_, dec_, ams_) adam_loop(pp, gg, mm, vv, vm, n, &c, l2_, dec_, ams_)

TDM_CPU_CLONES
int tdm_cpu_adam_step(tdm_tensor *p, const tdm_tensor *g, tdm_tensor *m, tdm_tensor *v,
                      tdm_tensor *vmax, const tdm_adam_hparams *h, int64_t step) {
    int64_t n = tdm_numel(p);
    if (check_flat(p, n, "cpu adam_step", "p") || check_flat(g, n, "cpu adam_step", "grad") ||
        check_flat(m, n, "cpu adam_step", "exp_avg") ||
        check_flat(v, n, "cpu adam_step", "exp_avg_sq") ||
        (h->amsgrad && check_flat(vmax, n, "cpu adam_step", "max_exp_avg_sq")))
        return tdm_last_status();
    if (step < 1) return tdm_raise(TDM_ERR_ARG, "cpu adam_step: step %lld < 1", (long long)step);
    /* Bias corrections in double, as PyTorch computes them in Python floats. */
    double bc1 = 1.0 - pow((double)h->beta1, (double)step);
    double bc2 = 1.0 - pow((double)h->beta2, (double)step);
    adam_consts c = {
        .sign = h->maximize ? -1.0f : 1.0f,
        .wd = h->weight_decay,
        .decay = (float)(1.0 - (double)h->lr * h->weight_decay),
        .b1 = h->beta1,
        .omb1 = (float)(1.0 - (double)h->beta1),
        .b2 = h->beta2,
        .omb2 = (float)(1.0 - (double)h->beta2),
        .bc2_sqrt = (float)sqrt(bc2),
        .eps = h->eps,
        .neg_step_size = (float)(-(double)h->lr / bc1),
    };
    float *pp = tdm_data_ptr(p), *mm = tdm_data_ptr(m), *vv = tdm_data_ptr(v);
    float *vm = h->amsgrad ? tdm_data_ptr(vmax) : NULL;
    const float *gg = tdm_data_ptr(g);
    bool wd = h->weight_decay != 0.0f;
    bool l2 = wd && !h->decoupled, dec = wd && h->decoupled;
    if (h->amsgrad) {
        if (l2)
            ADAM_CASE(true, false, true);
        else if (dec)
            ADAM_CASE(false, true, true);
        else
            ADAM_CASE(false, false, true);
    } else {
        if (l2)
            ADAM_CASE(true, false, false);
        else if (dec)
            ADAM_CASE(false, true, false);
        else
            ADAM_CASE(false, false, false);
    }
    return TDM_OK;
}
