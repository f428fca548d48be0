/* CUDA losses: the fused cross-entropy, one block per sample, and binary cross-entropy on
 * logits, one thread per element (formulas in cpu_loss.c).
 *
 * Determinism: no float atomics; a sample's sums run in a fixed block tree and accumulate in
 * double, as in cuda_reduce.cu. Cross-entropy reads f32, bf16 or f16 logits (its gradient in
 * their dtype, rounded once); the loss, the weights and the incoming gradient are f32.
 * Binary cross-entropy stays f32 (autocast runs it in f32: docs/MIXED_PRECISION.md). */
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

/* f32 only: autocast runs this loss in f32 (docs/MIXED_PRECISION.md). */
static int bce_check(const char *op, std::initializer_list<const tdm_tensor *> ts) {
    for (const tdm_tensor *t : ts)
        if (t->dtype != TDM_F32)
            return tdm_raise(TDM_ERR_DTYPE, "cuda %s: f32 tensors only, got %s", op,
                             tdm_dtype_name(t->dtype));
    return TDM_OK;
}

extern "C" int tdm_cuda_bce_logits(tdm_tensor *loss, const tdm_tensor *x, const tdm_tensor *y) {
    if (bce_check("bce_logits", {loss, x, y})) return tdm_last_status();
    cu_device *d = cu_dev_of(x, "bce_logits");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(x);
    if (n == 0) return TDM_OK;
    bce_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_f(loss), cu_f(x), cu_f(y), n);
    return cu_check_launch("bce_logits", x->device.index);
}

extern "C" int tdm_cuda_bce_logits_backward(tdm_tensor *gx, const tdm_tensor *g,
                                            const tdm_tensor *x, const tdm_tensor *y) {
    if (bce_check("bce_logits_backward", {gx, g, x, y})) return tdm_last_status();
    cu_device *d = cu_dev_of(x, "bce_logits_backward");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(x);
    if (n == 0) return TDM_OK;
    bce_bwd_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_f(gx), cu_f(g), cu_f(x), cu_f(y),
                                                                n);
    return cu_check_launch("bce_logits_backward", x->device.index);
}

/* ---- cross-entropy: one block per sample (formulas in cpu_loss.c) ------------------------ */

template <typename T> struct ce_args {
    const T *x;
    const float *w;
    const void *target;
    bool t64;
    int64_t tstride, N, C, ignore;
    float e;
    bool is_logits;
};

/* The row's log-sum-exp (0 for log-probabilities) and, when smoothing, sum_c w[c]*(lse-x[c]);
 * every thread of the block gets them. */
template <typename T>
__device__ void ce_row(const ce_args<T> &a, const T *xr, double *lse_out, double *smooth_out) {
    __shared__ float shf[CU_THREADS];
    __shared__ double shd[CU_THREADS];
    double lse = 0;
    if (a.is_logits) {
        float m = -INFINITY;
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) m = cu_nanmax(m, cu_ld(xr[c]));
        m = cu_block_max(m, shf);
        double s = 0;
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) s += expf(cu_ld(xr[c]) - m);
        lse = m + log(cu_block_sum(s, shd));
    }
    double sm = 0;
    if (a.e > 0) {
        double sx = 0, wt = 0;
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) {
            double w = a.w ? a.w[c] : 1.0;
            sx += w * cu_ld(xr[c]);
            wt += w;
        }
        sx = cu_block_sum(sx, shd);
        wt = cu_block_sum(wt, shd);
        sm = lse * wt - sx;
    }
    *lse_out = lse;
    *smooth_out = sm;
}

/* The row's loss from ce_row's sums. */
template <typename T>
__device__ float ce_row_loss(const ce_args<T> &a, const T *xr, int64_t t, double lse, double sm) {
    double wt = a.w ? a.w[t] : 1.0, e = a.e;
    double l = (1 - e) * wt * (lse - cu_ld(xr[t]));
    if (e > 0) l += e / (double)a.C * sm;
    return (float)l;
}

/* Row gr's gradient for an upstream g, l the row's log-sum-exp (logits): the one body of the
 * backward and of the reduced loss's gradient, so both give the same bits. Every thread of
 * the block calls it (a block sum inside). */
template <typename T>
__device__ void ce_grad_row(const ce_args<T> &a, T *gr, const T *xr, int64_t t, float g, float l) {
    __shared__ double shd[CU_THREADS];
    float wt = a.w ? a.w[t] : 1.0f;
    float eC = a.e / (float)a.C, ge = g * eC;
    if (a.is_logits) {
        double wtot = (double)a.C;
        if (a.w) {
            wtot = 0;
            for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) wtot += a.w[c];
            wtot = cu_block_sum(wtot, shd);
        }
        float total = g * (float)((1 - a.e) * wt + eC * wtot);
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) {
            float v = expf(cu_ld(xr[c]) - l) * total - ge * (a.w ? a.w[c] : 1.0f);
            gr[c] = cu_to<T>(c == t ? v - g * (1 - a.e) * wt : v);
        }
    } else {
        for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) {
            float v = -ge * (a.w ? a.w[c] : 1.0f);
            gr[c] = cu_to<T>(c == t ? v - g * (1 - a.e) * wt : v);
        }
    }
}

template <typename T> __device__ void ce_zero_row(const ce_args<T> &a, T *gr) {
    for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) gr[c] = cu_to<T>(0.0f);
}

/* lse_in: the forward's log-sum-exps (a row then read once), or NULL (recomputed). */
template <typename T>
__global__ void ce_bwd_kernel(T *gx, const float *gloss, int64_t gstride, const float *lse_in,
                              ce_args<T> a) {
    int64_t i = blockIdx.x;
    int64_t t = cu_index_at(a.target, a.t64, a.tstride, i);
    T *gr = gx + i * a.C;
    if (t == a.ignore) return ce_zero_row(a, gr); /* uniform across the block */
    const T *xr = a.x + i * a.C;
    float l = 0;
    if (a.is_logits && lse_in) {
        l = lse_in[i];
    } else if (a.is_logits) {
        double lse, unused;
        ce_row(a, xr, &lse, &unused);
        l = (float)lse;
    }
    ce_grad_row(a, gr, xr, t, gloss[i * gstride], l);
}

/* ---- the reduced cross-entropy: den, then the rows with their gradient, then the sum ---- */

/* den = sum_i w[t_i] over the samples not ignored (mean), or 1; one block, a fixed tree. */
template <typename T> __global__ void ce_den_kernel(float *den, ce_args<T> a, bool mean) {
    __shared__ double shd[CU_THREADS];
    double s = 0;
    for (int64_t i = threadIdx.x; i < a.N; i += blockDim.x) {
        int64_t t = cu_index_at(a.target, a.t64, a.tstride, i);
        if (t != a.ignore) s += a.w ? a.w[t] : 1.0f;
    }
    s = cu_block_sum(s, shd);
    if (threadIdx.x == 0) *den = mean ? (float)s : 1.0f;
}

/* A sample's loss a block, with wsum (w[target]), lse, and gx the row's gradient for the
 * upstream 1/den (the reduced loss) while the row is read; each NULL where not wanted. */
template <typename T>
__global__ void ce_kernel(float *loss, float *wsum, float *lse_out, T *gx, const float *den,
                          ce_args<T> a) {
    int64_t i = blockIdx.x;
    int64_t t = cu_index_at(a.target, a.t64, a.tstride, i);
    if (t == a.ignore) { /* uniform across the block: no thread reaches a barrier below */
        if (threadIdx.x == 0) {
            loss[i] = 0;
            if (wsum) wsum[i] = 0;
        }
        if (gx) ce_zero_row(a, gx + i * a.C);
        return;
    }
    const T *xr = a.x + i * a.C;
    double lse, sm;
    ce_row(a, xr, &lse, &sm);
    if (threadIdx.x == 0) {
        loss[i] = ce_row_loss(a, xr, t, lse, sm);
        if (wsum) wsum[i] = a.w ? a.w[t] : 1.0f;
        if (lse_out && a.is_logits) lse_out[i] = (float)lse;
    }
    if (gx) ce_grad_row(a, gx + i * a.C, xr, t, 1.0f / *den, (float)lse);
}

/* out = sum_i loss[i] (in double, a fixed tree) / den, or the sum; one block. */
__global__ void ce_sum_kernel(float *out, const float *loss, const float *den, int64_t n,
                              bool mean) {
    __shared__ double shd[CU_THREADS];
    double s = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += loss[i];
    s = cu_block_sum(s, shd);
    if (threadIdx.x == 0) *out = mean ? (float)s / *den : (float)s;
}

template <typename T>
static int ce_prepare(ce_args<T> *a, cu_device **d, const tdm_tensor *x, const tdm_tensor *target,
                      const tdm_tensor *weight, int64_t ignore, float smoothing, bool is_logits,
                      const char *op) {
    /* the op (nn/loss.c) refused an input that is not [N, C] and made x and weight
     * contiguous */
    assert(x->ndim == 2 && tdm_is_contiguous(x) && (!weight || tdm_is_contiguous(weight)));
    a->x = cu_p<T>(x);
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

static int ce_check_f32(const char *op, const tdm_tensor *t) {
    if (t && t->dtype != TDM_F32)
        return tdm_raise(TDM_ERR_DTYPE,
                         "cuda %s: the loss, weights and gradient must be f32, got %s", op,
                         tdm_dtype_name(t->dtype));
    return TDM_OK;
}

template <typename T>
static int ce_launch(tdm_tensor *loss, tdm_tensor *wsum, tdm_tensor *lse, const tdm_tensor *x,
                     const tdm_tensor *target, const tdm_tensor *weight, int64_t ignore_index,
                     float smoothing, bool is_logits) {
    ce_args<T> a;
    cu_device *d = NULL;
    if (ce_prepare(&a, &d, x, target, weight, ignore_index, smoothing, is_logits, "cross_entropy"))
        return tdm_last_status();
    if (a.N == 0) return TDM_OK;
    ce_kernel<T><<<(unsigned)a.N, cu_row_threads(a.C), 0, d->compute>>>(
        cu_f(loss), cu_f(wsum), cu_f(lse), (T *)NULL, (const float *)NULL, a);
    return cu_check_launch("cross_entropy", x->device.index);
}

template <typename T>
static int ce_bwd_launch(tdm_tensor *gx, const tdm_tensor *gloss, const tdm_tensor *x,
                         const tdm_tensor *lse, const tdm_tensor *target, const tdm_tensor *weight,
                         int64_t ignore_index, float smoothing, bool is_logits) {
    ce_args<T> a;
    cu_device *d = NULL;
    if (ce_prepare(&a, &d, x, target, weight, ignore_index, smoothing, is_logits,
                   "cross_entropy_backward"))
        return tdm_last_status();
    if (a.N == 0) return TDM_OK;
    ce_bwd_kernel<T><<<(unsigned)a.N, cu_row_threads(a.C), 0, d->compute>>>(
        cu_p<T>(gx), cu_f(gloss), gloss->ndim ? gloss->strides[0] : 0, cu_f(lse), a);
    return cu_check_launch("cross_entropy_backward", x->device.index);
}

template <typename T>
static int ce_reduced_launch(tdm_tensor *out, tdm_tensor *den, tdm_tensor *lse, tdm_tensor *gx,
                             const tdm_tensor *x, const tdm_tensor *target,
                             const tdm_tensor *weight, int64_t ignore_index, float smoothing,
                             bool is_logits, bool mean) {
    ce_args<T> a;
    cu_device *d = NULL;
    if (ce_prepare(&a, &d, x, target, weight, ignore_index, smoothing, is_logits,
                   "cross_entropy_reduced"))
        return tdm_last_status();
    tdm_storage *hold;
    float *rows =
        (float *)cu_scratch(x->device.index, sizeof(float) * (size_t)(a.N ? a.N : 1), &hold);
    if (!rows) return tdm_last_status();
    ce_den_kernel<T><<<1, CU_THREADS, 0, d->compute>>>(cu_f(den), a, mean);
    if (a.N)
        ce_kernel<T><<<(unsigned)a.N, cu_row_threads(a.C), 0, d->compute>>>(
            rows, (float *)NULL, cu_f(lse), gx ? cu_p<T>(gx) : (T *)NULL, cu_f(den), a);
    ce_sum_kernel<<<1, CU_THREADS, 0, d->compute>>>(cu_f(out), rows, cu_f(den), a.N, mean);
    tdm_storage_release(hold); /* the cache reuses it in stream order */
    return cu_check_launch("cross_entropy_reduced", x->device.index);
}

extern "C" int tdm_cuda_cross_entropy(tdm_tensor *loss, tdm_tensor *wsum, tdm_tensor *lse,
                                      const tdm_tensor *x, const tdm_tensor *target,
                                      const tdm_tensor *weight, int64_t ignore_index,
                                      float smoothing, bool is_logits) {
    if (cu_check_float("cross_entropy", true, {x}) || ce_check_f32("cross_entropy", loss) ||
        ce_check_f32("cross_entropy", wsum) || ce_check_f32("cross_entropy", lse) ||
        ce_check_f32("cross_entropy", weight))
        return tdm_last_status();
    return CU_DISPATCH(x->dtype, ce_launch, loss, wsum, lse, x, target, weight, ignore_index,
                       smoothing, is_logits);
}

extern "C" int tdm_cuda_cross_entropy_backward(tdm_tensor *gx, const tdm_tensor *gloss,
                                               const tdm_tensor *x, const tdm_tensor *lse,
                                               const tdm_tensor *target, const tdm_tensor *weight,
                                               int64_t ignore_index, float smoothing,
                                               bool is_logits) {
    if (cu_check_float("cross_entropy_backward", true, {x, gx}) ||
        ce_check_f32("cross_entropy_backward", gloss) ||
        ce_check_f32("cross_entropy_backward", lse) ||
        ce_check_f32("cross_entropy_backward", weight))
        return tdm_last_status();
    return CU_DISPATCH(x->dtype, ce_bwd_launch, gx, gloss, x, lse, target, weight, ignore_index,
                       smoothing, is_logits);
}

extern "C" int tdm_cuda_cross_entropy_reduced(tdm_tensor *out, tdm_tensor *den, tdm_tensor *lse,
                                              tdm_tensor *gx, const tdm_tensor *x,
                                              const tdm_tensor *target, const tdm_tensor *weight,
                                              int64_t ignore_index, float smoothing, bool is_logits,
                                              bool mean) {
    const char *op = "cross_entropy_reduced";
    if (cu_check_float(op, true, {x, gx}) || ce_check_f32(op, out) || ce_check_f32(op, den) ||
        ce_check_f32(op, lse) || ce_check_f32(op, weight))
        return tdm_last_status();
    return CU_DISPATCH(x->dtype, ce_reduced_launch, out, den, lse, gx, x, target, weight,
                       ignore_index, smoothing, is_logits, mean);
}
