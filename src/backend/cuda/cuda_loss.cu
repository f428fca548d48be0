/* CUDA losses: the fused cross-entropy, one block per sample, and binary cross-entropy on
 * logits, one thread per element (formulas in cpu_loss.c).
 *
 * Determinism: no float atomics; a sample's sums run in a fixed block tree and accumulate in
 * double, as in cuda_reduce.cu. */
#include "backend/cuda/cuda_common.cuh"

#include <assert.h>
#include <math.h>

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

/* ---- cross-entropy: one block per sample (formulas in cpu_loss.c) ------------------------ */

typedef struct {
    const float *x, *w;
    const void *target;
    bool t64;
    int64_t tstride, N, C, ignore;
    float e;
    bool is_logits;
} ce_args;

/* The row's log-sum-exp (0 for log-probabilities) and, when smoothing, sum_c w[c]*(lse-x[c]);
 * every thread of the block gets them. */
__device__ void ce_row(const ce_args &a, const float *xr, double *lse_out, double *smooth_out) {
    __shared__ float shf[CU_THREADS];
    __shared__ double shd[CU_THREADS];
    double lse = 0;
    if (a.is_logits) {
        float m = -INFINITY;
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) m = cu_nanmax(m, xr[c]);
        m = cu_block_max(m, shf);
        double s = 0;
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) s += expf(xr[c] - m);
        lse = m + log(cu_block_sum(s, shd));
    }
    double sm = 0;
    if (a.e > 0) {
        double sx = 0, wt = 0;
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) {
            double w = a.w ? a.w[c] : 1.0;
            sx += w * xr[c];
            wt += w;
        }
        sx = cu_block_sum(sx, shd);
        wt = cu_block_sum(wt, shd);
        sm = lse * wt - sx;
    }
    *lse_out = lse;
    *smooth_out = sm;
}

__global__ void ce_kernel(float *loss, float *wsum, ce_args a) {
    int64_t i = blockIdx.x;
    int64_t t = cu_index_at(a.target, a.t64, a.tstride, i);
    if (t == a.ignore) { /* uniform across the block: no thread reaches a barrier below */
        if (threadIdx.x == 0) {
            loss[i] = 0;
            if (wsum) wsum[i] = 0;
        }
        return;
    }
    const float *xr = a.x + i * a.C;
    double lse, sm;
    ce_row(a, xr, &lse, &sm);
    if (threadIdx.x == 0) {
        double wt = a.w ? a.w[t] : 1.0, e = a.e;
        double l = (1 - e) * wt * (lse - xr[t]);
        if (e > 0) l += e / (double)a.C * sm;
        loss[i] = (float)l;
        if (wsum) wsum[i] = (float)wt;
    }
}

__global__ void ce_bwd_kernel(float *gx, const float *gloss, int64_t gstride, ce_args a) {
    __shared__ double shd[CU_THREADS];
    int64_t i = blockIdx.x;
    int64_t t = cu_index_at(a.target, a.t64, a.tstride, i);
    float *gr = gx + i * a.C;
    if (t == a.ignore) {
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) gr[c] = 0;
        return;
    }
    const float *xr = a.x + i * a.C;
    float g = gloss[i * gstride], wt = a.w ? a.w[t] : 1.0f;
    float eC = a.e / (float)a.C, ge = g * eC;
    if (a.is_logits) {
        double lse, unused;
        ce_row(a, xr, &lse, &unused);
        double wtot = 0;
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) wtot += a.w ? a.w[c] : 1.0;
        wtot = cu_block_sum(wtot, shd);
        float total = g * (float)((1 - a.e) * wt + eC * wtot), l = (float)lse;
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) {
            float v = expf(xr[c] - l) * total - ge * (a.w ? a.w[c] : 1.0f);
            gr[c] = c == t ? v - g * (1 - a.e) * wt : v;
        }
    } else {
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) {
            float v = -ge * (a.w ? a.w[c] : 1.0f);
            gr[c] = c == t ? v - g * (1 - a.e) * wt : v;
        }
    }
}

static int ce_prepare(ce_args *a, cu_device **d, const tdm_tensor *x, const tdm_tensor *target,
                      const tdm_tensor *weight, int64_t ignore, float smoothing, bool is_logits,
                      const char *op) {
    /* the op (nn/loss.c) refused an input that is not f32 [N, C] and made x and weight
     * contiguous */
    assert(x->ndim == 2 && tdm_is_contiguous(x) && x->dtype == TDM_F32 &&
           (!weight || tdm_is_contiguous(weight)));
    a->x = cu_f(x);
    a->w = cu_f(weight);
    a->target = tdm_cuda_ptr(target);
    a->t64 = target->dtype == TDM_I64;
    a->tstride = target->ndim ? target->strides[0] : 0;
    a->N = x->shape[0], a->C = x->shape[1], a->ignore = ignore;
    a->e = smoothing, a->is_logits = is_logits;
    if (!(*d = cu_dev_of(x, op))) return tdm_last_status();
    if (a->N > INT32_MAX) return tdm_raise(TDM_ERR_SHAPE, "cuda %s: too many samples", op);
    return cu_check_indices(*d, target, a->N, a->C, 0, "cross_entropy", true, ignore);
}

extern "C" int tdm_cuda_cross_entropy(tdm_tensor *loss, tdm_tensor *wsum, const tdm_tensor *x,
                                      const tdm_tensor *target, const tdm_tensor *weight,
                                      int64_t ignore_index, float smoothing, bool is_logits) {
    ce_args a;
    cu_device *d = NULL;
    if (ce_prepare(&a, &d, x, target, weight, ignore_index, smoothing, is_logits, "cross_entropy"))
        return tdm_last_status();
    if (a.N == 0) return TDM_OK;
    ce_kernel<<<(unsigned)a.N, cu_row_threads(a.C), 0, d->compute>>>(cu_f(loss), cu_f(wsum), a);
    return cu_check_launch("cross_entropy", x->device.index);
}

extern "C" int tdm_cuda_cross_entropy_backward(tdm_tensor *gx, const tdm_tensor *gloss,
                                               const tdm_tensor *x, const tdm_tensor *target,
                                               const tdm_tensor *weight, int64_t ignore_index,
                                               float smoothing, bool is_logits) {
    ce_args a;
    cu_device *d = NULL;
    if (ce_prepare(&a, &d, x, target, weight, ignore_index, smoothing, is_logits,
                   "cross_entropy_backward"))
        return tdm_last_status();
    if (a.N == 0) return TDM_OK;
    ce_bwd_kernel<<<(unsigned)a.N, cu_row_threads(a.C), 0, d->compute>>>(
        cu_f(gx), cu_f(gloss), gloss->ndim ? gloss->strides[0] : 0, a);
    return cu_check_launch("cross_entropy_backward", x->device.index);
}
