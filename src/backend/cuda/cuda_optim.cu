/* CUDA optimizers: the fused SGD and Adam steps, one pass over flat f32 buffers, one thread
 * per element in a grid-stride loop (the formulas and their operation order are cpu_optim.c's). */
#include "backend/cuda/cuda_common.cuh"

#include <math.h>

static int check_flat(const tdm_tensor *t, int64_t n, const char *op, const char *what) {
    if (!t) return tdm_raise(TDM_ERR_ARG, "%s: %s is NULL", op, what);
    if (t->dtype != TDM_F32) /* mixed precision keeps f32 masters: docs/MIXED_PRECISION.md */
        return tdm_raise(TDM_ERR_DTYPE,
                         "%s: %s is %s: the optimizers step f32 parameters, gradients and state "
                         "only (mixed precision keeps them f32)",
                         op, what, tdm_dtype_name(t->dtype));
    if (t->dtype != TDM_F32 || !tdm_is_contiguous(t) || tdm_numel(t) != n ||
        t->device.type != TDM_CUDA)
        return tdm_raise(TDM_ERR_ARG,
                         "%s: %s must be a contiguous f32 CUDA buffer of %lld elements", op, what,
                         (long long)n);
    return TDM_OK;
}

/* PyTorch's SGD (see cpu_optim.c for the formulas and their operation order). */
__global__ void sgd_kernel(float *p, const float *g, float *b, int64_t n, float lr, float mu,
                           float damp1, float wd, float sign, bool nesterov, bool first) {
    CU_LOOP(i, n) {
        float d = sign * g[i];
        if (wd != 0.0f) d = d + wd * p[i];
        if (b) {
            float bi = first ? d : b[i] * mu + damp1 * d;
            b[i] = bi;
            d = nesterov ? d + mu * bi : bi;
        }
        p[i] = p[i] - lr * d;
    }
}

extern "C" int tdm_cuda_sgd_step(tdm_tensor *p, const tdm_tensor *g, tdm_tensor *buf,
                                 const tdm_sgd_hparams *h, bool first) {
    int64_t n = tdm_numel(p);
    bool mom = h->momentum != 0.0f;
    if (check_flat(p, n, "cuda sgd_step", "p") || check_flat(g, n, "cuda sgd_step", "grad") ||
        (mom && check_flat(buf, n, "cuda sgd_step", "momentum buffer")))
        return tdm_last_status();
    cu_device *d = cu_dev_of(p, "sgd_step");
    if (!d) return tdm_last_status();
    if (n == 0) return TDM_OK;
    sgd_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(
        cu_f(p), cu_f(g), mom ? cu_f(buf) : NULL, n, h->lr, h->momentum, 1.0f - h->dampening,
        h->weight_decay, h->maximize ? -1.0f : 1.0f, h->nesterov, first);
    return cu_check_launch("sgd_step", p->device.index);
}

typedef struct {
    float sign, wd, decay, b1, omb1, b2, omb2, bc2_sqrt, eps, neg_step_size;
    bool l2, decoupled;
} adam_consts;

/* PyTorch's Adam/AdamW (see cpu_optim.c). */
__global__ void adam_kernel(float *p, const float *g, float *m, float *v, float *vmax, int64_t n,
                            adam_consts c) {
    CU_LOOP(i, n) {
        float gi = c.sign * g[i], pi = p[i];
        if (c.l2) gi = gi + c.wd * pi;
        if (c.decoupled) pi = pi * c.decay;
        float mi = m[i] * c.b1 + c.omb1 * gi;
        float vi = v[i] * c.b2 + c.omb2 * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        float vv = vi;
        if (vmax) {
            vv = vmax[i] > vi ? vmax[i] : vi;
            vmax[i] = vv;
        }
        float denom = sqrtf(vv) / c.bc2_sqrt + c.eps;
        p[i] = pi + c.neg_step_size * mi / denom;
    }
}

extern "C" int tdm_cuda_adam_step(tdm_tensor *p, const tdm_tensor *g, tdm_tensor *m, tdm_tensor *v,
                                  tdm_tensor *vmax, const tdm_adam_hparams *h, int64_t step) {
    int64_t n = tdm_numel(p);
    if (check_flat(p, n, "cuda adam_step", "p") || check_flat(g, n, "cuda adam_step", "grad") ||
        check_flat(m, n, "cuda adam_step", "exp_avg") ||
        check_flat(v, n, "cuda adam_step", "exp_avg_sq") ||
        (h->amsgrad && check_flat(vmax, n, "cuda adam_step", "max_exp_avg_sq")))
        return tdm_last_status();
    if (step < 1) return tdm_raise(TDM_ERR_ARG, "cuda adam_step: step %lld < 1", (long long)step);
    cu_device *d = cu_dev_of(p, "adam_step");
    if (!d) return tdm_last_status();
    if (n == 0) return TDM_OK;
    /* bias corrections in double on the host, as PyTorch computes them in Python floats */
    double bc1 = 1.0 - pow((double)h->beta1, (double)step);
    double bc2 = 1.0 - pow((double)h->beta2, (double)step);
    bool wd = h->weight_decay != 0.0f;
    adam_consts c;
    c.sign = h->maximize ? -1.0f : 1.0f;
    c.wd = h->weight_decay;
    c.decay = (float)(1.0 - (double)h->lr * h->weight_decay);
    c.b1 = h->beta1;
    c.omb1 = (float)(1.0 - (double)h->beta1);
    c.b2 = h->beta2;
    c.omb2 = (float)(1.0 - (double)h->beta2);
    c.bc2_sqrt = (float)sqrt(bc2);
    c.eps = h->eps;
    c.neg_step_size = (float)(-(double)h->lr / bc1);
    c.l2 = wd && !h->decoupled;
    c.decoupled = wd && h->decoupled;
    adam_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_f(p), cu_f(g), cu_f(m), cu_f(v),
                                                             h->amsgrad ? cu_f(vmax) : NULL, n, c);
    return cu_check_launch("adam_step", p->device.index);
}
