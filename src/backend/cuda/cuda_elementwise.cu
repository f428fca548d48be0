/* CUDA element-wise kernels: unary ops and their derivatives, binary ops on broadcast views
 * (stride 0), axpy, dropout (the CPU's Philox counters, so masks match bit for bit), binary
 * cross-entropy on logits, and the fused SGD and Adam steps over flat buffers.
 *
 * One thread per output element in a grid-stride loop; strided operands are addressed with
 * cu_offset (a contiguous operand collapses to offset i). The operator switch is uniform
 * across a launch, so it costs no divergence. */
#include "backend/cuda/cuda_common.cuh"

/* after cuda_common.cuh, which includes the C headers for nvcc */
#include "backend/unary_math.h"

#include <assert.h>

static int check_f32(const char *op, const tdm_tensor *t) {
    if (t && t->dtype != TDM_F32)
        return tdm_raise(TDM_ERR_DTYPE, "cuda %s: f32 tensors only, got %s", op,
                         tdm_dtype_name(t->dtype));
    return TDM_OK;
}

/* ---- unary ------------------------------------------------------------------------------- */

__device__ __forceinline__ float sigmoidf_(float v) {
    return 1.0f / (1.0f + expf(-v));
}

__device__ float unary_fwd(tdm_unary_op op, float v, float s) {
    switch (op) {
    case TDM_UN_NEG:
        return -v;
    case TDM_UN_EXP:
        return expf(v);
    case TDM_UN_LOG:
        return logf(v);
    case TDM_UN_SQRT:
        return sqrtf(v);
    case TDM_UN_RELU:
        return v <= 0.0f ? 0.0f : v; /* NaN propagates, as torch.relu */
    case TDM_UN_GELU_TANH:
        return v * sigmoidf_(2.0f * TDM_GELU_BETA * (v + TDM_GELU_KAPPA * v * v * v));
    case TDM_UN_GELU_ERF:
        return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case TDM_UN_TANH:
        return tanhf(v);
    case TDM_UN_SIGMOID:
        return sigmoidf_(v);
    case TDM_UN_ADD_SCALAR:
        return v + s;
    case TDM_UN_MUL_SCALAR:
        return v * s;
    case TDM_UN_POW_SCALAR:
        if (s == 2.0f) return v * v;
        if (s == 1.0f) return v;
        if (s == 0.5f) return sqrtf(v);
        if (s == -1.0f) return 1.0f / v;
        return powf(v, s);
    case TDM_UN_SOFTSIGN:
        return v / (1.0f + fabsf(v));
    }
    return 0.0f;
}

__global__ void unary_kernel(tdm_unary_op op, float *y, const float *x, cu_view xv, float s,
                             int64_t n) {
    CU_LOOP(i, n) y[i] = unary_fwd(op, x[cu_offset(xv, i)], s);
}

extern "C" int tdm_cuda_unary(tdm_unary_op op, tdm_tensor *y, const tdm_tensor *x, float s) {
    if (op < TDM_UN_NEG || op > TDM_UN_LAST)
        return tdm_raise(TDM_ERR_ARG, "cuda unary: unknown op %d", (int)op);
    int64_t n = tdm_numel(y);
    /* the op refused a tensor that is not f32 and allocated y contiguous like x */
    assert(y->dtype == TDM_F32 && x->dtype == TDM_F32 && n == tdm_numel(x) && tdm_is_contiguous(y));
    cu_device *d = cu_dev_of(y, "unary");
    if (!d) return tdm_last_status();
    if (n == 0) return TDM_OK;
    unary_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(op, cu_f(y), cu_f(x), cu_view_of(x),
                                                              s, n);
    return cu_check_launch("unary", y->device.index);
}

__device__ float unary_grad(tdm_unary_op op, float g, float v, float o, float s) {
    switch (op) {
    case TDM_UN_NEG:
        return -g;
    case TDM_UN_EXP:
        return g * o;
    case TDM_UN_LOG:
        return g / v;
    case TDM_UN_SQRT:
        return g / (2.0f * o);
    case TDM_UN_RELU:
        return v > 0.0f ? g : 0.0f;
    case TDM_UN_GELU_TANH: {
        float x2 = v * v;
        float t = tanhf(TDM_GELU_BETA * (v + TDM_GELU_KAPPA * x2 * v));
        return g * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * TDM_GELU_BETA *
                                            (1.0f + 3.0f * TDM_GELU_KAPPA * x2));
    }
    case TDM_UN_GELU_ERF: {
        float cdf = 0.5f * (1.0f + erff(v * 0.70710678118654752f));
        float pdf = expf(-0.5f * v * v) * 0.3989422804014327f;
        return g * (cdf + v * pdf);
    }
    case TDM_UN_TANH:
        return g * (1.0f - o * o);
    case TDM_UN_SIGMOID:
        return g * o * (1.0f - o);
    case TDM_UN_ADD_SCALAR:
        return g;
    case TDM_UN_MUL_SCALAR:
        return g * s;
    case TDM_UN_POW_SCALAR:
        if (s == 0.0f) return 0.0f; /* PyTorch: 0 even at v == 0 */
        if (s == 2.0f) return g * 2.0f * v;
        if (s == 1.0f) return g;
        return g * s * powf(v, s - 1.0f);
    case TDM_UN_SOFTSIGN:
        return g / ((1.0f + fabsf(v)) * (1.0f + fabsf(v)));
    }
    return 0.0f;
}

/* saved is x or y (whichever the derivative reads) or gy itself when it reads neither. */
__global__ void unary_bwd_kernel(tdm_unary_op op, float *gx, const float *gy, cu_view gv,
                                 const float *saved, cu_view sv, bool saved_is_y, float s,
                                 int64_t n) {
    CU_LOOP(i, n) {
        float g = gy[cu_offset(gv, i)], t = saved[cu_offset(sv, i)];
        gx[i] = unary_grad(op, g, saved_is_y ? 0.0f : t, saved_is_y ? t : 0.0f, s);
    }
}

/* An operand with gx's numel: contiguous (any shape), or strided with gx's shape. */
static bool walkable(const tdm_tensor *t, const tdm_tensor *gx) {
    if (tdm_numel(t) != tdm_numel(gx)) return false;
    return tdm_is_contiguous(t) || tdm_same_shape(t, gx);
}

extern "C" int tdm_cuda_unary_backward(tdm_unary_op op, tdm_tensor *gx, const tdm_tensor *gy,
                                       const tdm_tensor *x, const tdm_tensor *y, float s) {
    if (op < TDM_UN_NEG || op > TDM_UN_LAST)
        return tdm_raise(TDM_ERR_ARG, "cuda unary_backward: unknown op %d", (int)op);
    char need = tdm_unary_bwd_needs(op);
    const tdm_tensor *saved = need == 'x' ? x : need == 'y' ? y : gy;
    if (!saved)
        return tdm_raise(TDM_ERR_ARG, "cuda unary_backward: op %d needs its saved %c", (int)op,
                         need);
    if (check_f32("unary_backward", gx) || check_f32("unary_backward", gy) ||
        check_f32("unary_backward", saved))
        return tdm_last_status();
    if (!tdm_is_contiguous(gx) || !walkable(gy, gx) || !walkable(saved, gx))
        return tdm_raise(TDM_ERR_SHAPE, "cuda unary_backward: gx must be contiguous and a "
                                        "strided operand must have gx's shape");
    cu_device *d = cu_dev_of(gx, "unary_backward");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(gx);
    if (n == 0) return TDM_OK;
    unary_bwd_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(
        op, cu_f(gx), cu_f(gy), cu_view_of(gy), cu_f(saved), cu_view_of(saved), need == 'y', s, n);
    return cu_check_launch("unary_backward", gx->device.index);
}

/* ---- binary, axpy ------------------------------------------------------------------------ */

__global__ void binary_kernel(tdm_binary_op op, float *y, const float *a, cu_view av,
                              const float *b, cu_view bv, int64_t n) {
    CU_LOOP(i, n) {
        float u = a[cu_offset(av, i)], v = b[cu_offset(bv, i)];
        float r = op == TDM_BIN_ADD   ? u + v
                  : op == TDM_BIN_SUB ? u - v
                  : op == TDM_BIN_MUL ? u * v
                                      : u / v;
        y[i] = r;
    }
}

extern "C" int tdm_cuda_binary(tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a,
                               const tdm_tensor *b) {
    if (op < TDM_BIN_ADD || op > TDM_BIN_DIV)
        return tdm_raise(TDM_ERR_ARG, "cuda binary: unknown op %d", (int)op);
    /* the op refused operands that are not f32 or do not broadcast, and expanded them */
    assert(y->dtype == TDM_F32 && a->dtype == TDM_F32 && b->dtype == TDM_F32);
    assert(tdm_is_contiguous(y) && tdm_same_shape(y, a) && tdm_same_shape(y, b));
    cu_device *d = cu_dev_of(y, "binary");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(y);
    if (n == 0) return TDM_OK;
    binary_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(op, cu_f(y), cu_f(a), cu_view_of(a),
                                                               cu_f(b), cu_view_of(b), n);
    return cu_check_launch("binary", y->device.index);
}

__global__ void axpy_kernel(float *y, float alpha, const float *x, int64_t n) {
    CU_LOOP(i, n) y[i] += alpha * x[i];
}

extern "C" int tdm_cuda_axpy(tdm_tensor *y, float alpha, const tdm_tensor *x) {
    if (check_f32("axpy", y) || check_f32("axpy", x)) return tdm_last_status();
    if (tdm_numel(y) != tdm_numel(x) || !tdm_is_contiguous(y) || !tdm_is_contiguous(x))
        return tdm_raise(TDM_ERR_ARG, "cuda axpy: y and x must be contiguous of one size");
    cu_device *d = cu_dev_of(y, "axpy");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(y);
    if (n == 0) return TDM_OK;
    axpy_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_f(y), alpha, cu_f(x), n);
    return cu_check_launch("axpy", y->device.index);
}

/* ---- dropout ----------------------------------------------------------------------------- */

/* Element i owns Philox counter offset + i of stream 0 and reads word 0, as the CPU does. */
__global__ void dropout_kernel(float *y, float *mask, const float *x, float p, float keep,
                               uint64_t seed, uint64_t offset, int64_t n) {
    CU_LOOP(i, n) {
        uint32_t r[4];
        cu_philox(seed, offset + (uint64_t)i, 0, r);
        float m = cu_unit(r[0]) >= p ? keep : 0.0f;
        if (mask) mask[i] = m;
        y[i] = x[i] * m;
    }
}

extern "C" int tdm_cuda_dropout(tdm_tensor *y, tdm_tensor *mask, const tdm_tensor *x, float p,
                                uint64_t seed, uint64_t offset) {
    /* the op (nn/functional_norm.c) makes x contiguous and allocates y and mask */
    assert(tdm_is_contiguous(x) && tdm_is_contiguous(y) && (!mask || tdm_is_contiguous(mask)));
    cu_device *d = cu_dev_of(y, "dropout");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(x);
    if (n == 0) return TDM_OK;
    float keep = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f; /* p = 1 drops everything */
    dropout_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_f(y), cu_f(mask), cu_f(x), p,
                                                                keep, seed, offset, n);
    return cu_check_launch("dropout", y->device.index);
}

/* ---- binary cross-entropy on logits ------------------------------------------------------ */

__global__ void bce_kernel(float *loss, const float *x, const float *y, int64_t n) {
    CU_LOOP(i, n) {
        float v = x[i];
        loss[i] = fmaxf(v, 0.0f) - v * y[i] + log1pf(expf(-fabsf(v)));
    }
}

__global__ void bce_bwd_kernel(float *gx, const float *g, const float *x, const float *y,
                               int64_t n) {
    CU_LOOP(i, n) {
        float v = x[i], z = expf(-fabsf(v));
        float s = v >= 0.0f ? 1.0f / (1.0f + z) : z / (1.0f + z); /* stable both sides */
        gx[i] = g[i] * (s - y[i]);
    }
}

extern "C" int tdm_cuda_bce_logits(tdm_tensor *loss, const tdm_tensor *x, const tdm_tensor *y) {
    cu_device *d = cu_dev_of(x, "bce_logits");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(x);
    if (n == 0) return TDM_OK;
    bce_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_f(loss), cu_f(x), cu_f(y), n);
    return cu_check_launch("bce_logits", x->device.index);
}

extern "C" int tdm_cuda_bce_logits_backward(tdm_tensor *gx, const tdm_tensor *g,
                                            const tdm_tensor *x, const tdm_tensor *y) {
    cu_device *d = cu_dev_of(x, "bce_logits_backward");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(x);
    if (n == 0) return TDM_OK;
    bce_bwd_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_f(gx), cu_f(g), cu_f(x), cu_f(y),
                                                                n);
    return cu_check_launch("bce_logits_backward", x->device.index);
}

/* ---- optimizers -------------------------------------------------------------------------- */

static int check_flat(const tdm_tensor *t, int64_t n, const char *op, const char *what) {
    if (!t) return tdm_raise(TDM_ERR_ARG, "%s: %s is NULL", op, what);
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
