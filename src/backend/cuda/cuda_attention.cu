/* CUDA causal self-attention (the contract is backend.h's; the CPU twin is cpu_attention.c).
 *
 * qkv [B, T, 3C] holds q, k and v side by side; head h of each is the channel block
 * [h*hs, (h+1)*hs). cuBLAS's strided batches reach the heads where they are (a leading
 * dimension of 3C, the next head hs further on, or the next batch row T*3C further on), so
 * nothing is copied apart. For a chunk of heads at a time, with the scores S [T, T] of each in
 * scratch:
 *   forward   S = scale q k^T (cuBLAS), P = causal softmax of each row of S and its
 *             log-sum-exp lse (a row kernel), y = P v (cuBLAS, into y)
 *   backward  S again, and dP = dy v^T (cuBLAS); P = exp(S - lse) and
 *             dS = P (dP - D), D_t = sum_s P_ts dP_ts (a row kernel);
 *             dv = P^T dy, dq = scale dS k, dk = scale dS^T q (cuBLAS, into dqkv)
 * In bf16 and f16 the products run on the tensor cores with f32 accumulation (S and dP are f32,
 * as the softmax and D are), and P and dS are rounded to the dtype for the products that take
 * them, as PyTorch's flash kernels round their probabilities and the CPU's bf16 path does
 * (cpu_attention.c): the f32 copies of the heads and the f32 products on the CUDA cores that
 * this replaced took 62% of a bf16 GPT-2-small step (bench/RESULTS.md, "GPU check ... mixed
 * precision"). lse stays f32. Half of each S is above the diagonal and wasted: heads that fit
 * the fused kernels (cuda_flash.cu: a head size a multiple of 16, up to 128) go there instead,
 * which skip it and keep S out of memory; this path takes the rest. Every sum runs in a fixed order
 * (cuBLAS's kernels for given shapes, the block reductions' fixed trees): the results are
 * the same on every run. */
#include "backend/cuda/cuda_common.cuh"

#include <assert.h>
#include <math.h>

/* Bytes of scores (S, dP, and P, dS in a low dtype) per chunk of heads, whatever the context. */
#ifndef ATT_SCRATCH_BYTES
#define ATT_SCRATCH_BYTES (256ll << 20)
#endif

typedef struct {
    int64_t B, T, C, nh, hs;
    float scale;
} att_geom;

/* Row t of the scores of one head (block j*T + t): P = softmax over s <= t, 0 above the
 * diagonal, into P (S itself in f32); lse_t = max + log(sum), head j's at lse + j*ls. */
template <typename T>
__global__ void att_softmax_kernel(float *S, T *P, float *lse, int64_t ls, int64_t len) {
    __shared__ float red[CU_THREADS];
    const int64_t row = blockIdx.x, t = row % len;
    float *s = S + row * len;
    T *p = P + row * len;
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t c = threadIdx.x; c <= t; c += blockDim.x) mx = cu_nanmax(mx, s[c]);
    mx = cu_block_max(mx, red);
    for (int64_t c = threadIdx.x; c <= t; c += blockDim.x) {
        float e = expf(s[c] - mx);
        s[c] = e, sum += e;
    }
    sum = cu_block_sum(sum, red);
    const float inv = 1.0f / sum;
    for (int64_t c = threadIdx.x; c < len; c += blockDim.x)
        p[c] = cu_to<T>(c <= t ? s[c] * inv : 0.0f);
    if (threadIdx.x == 0) lse[row / len * ls + t] = mx + logf(sum);
}

/* Row t of one head in the backward pass: P = exp(S - lse_t) (0 above the diagonal) into P,
 * dS = P (dP - D_t) into dS (S and dP themselves in f32). */
template <typename T>
__global__ void att_bwd_rows_kernel(float *S, float *dP, T *P, T *dS, const float *lse, int64_t ls,
                                    int64_t len) {
    __shared__ float red[CU_THREADS];
    const int64_t row = blockIdx.x, t = row % len;
    float *s = S + row * len, *dp = dP + row * len;
    const float lt = lse[row / len * ls + t];
    float part = 0.0f;
    for (int64_t c = threadIdx.x; c < len; c += blockDim.x) {
        float pc = c <= t ? expf(s[c] - lt) : 0.0f;
        s[c] = pc, part += pc * dp[c];
    }
    const float D = cu_block_sum(part, red);
    T *p = P + row * len, *ds = dS + row * len;
    for (int64_t c = threadIdx.x; c < len; c += blockDim.x) {
        float pc = s[c];
        ds[c] = cu_to<T>(c <= t ? pc * (dp[c] - D) : 0.0f);
        p[c] = cu_to<T>(pc);
    }
}

/* A matrix operand of a batch: its elements (at the batch's first), dtype, leading dimension
 * and the stride from one batch item to the next, in elements. */
typedef struct {
    void *p;
    cudaDataType type;
    int64_t ld, stride;
} att_mat;

/* Row-major batched C = alpha op(A) op(B), op(X) = X^T when tX, with f32 accumulation:
 * cuBLAS is column-major, so it computes C^T = op(B)^T op(A)^T on the same memory. */
static int att_gemm(cu_device *d, int index, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                    float alpha, att_mat a, att_mat b, att_mat c, int64_t batch, const char *what) {
    const float zero = 0.0f;
    cublasStatus_t st = cu_blas.cublasGemmStridedBatchedEx(
        d->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n, (int)m,
        (int)k, &alpha, b.p, b.type, (int)b.ld, b.stride, a.p, a.type, (int)a.ld, a.stride, &zero,
        c.p, c.type, (int)c.ld, c.stride, (int)batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    return cu_check_blas(st, what, index);
}

static cudaDataType att_type(tdm_dtype dt) {
    return dt == TDM_BF16 ? CUDA_R_16BF : dt == TDM_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* The geometry. The op (autograd/ops_attention.c) refused a qkv that is not [B, T, 3C] with C
 * divisible by n_head and allocated y and lse contiguous: asserted. cuBLAS's int sizes are
 * the limit only this backend has. Returns 1 when there is nothing to do. */
static int att_setup(const char *op, const tdm_tensor *qkv, const tdm_tensor *y,
                     const tdm_tensor *lse, int n_head, att_geom *g) {
    assert(qkv->ndim == 3 && qkv->shape[2] % 3 == 0 && n_head >= 1 &&
           (qkv->shape[2] / 3) % n_head == 0);
    int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3;
    assert(tdm_is_contiguous(qkv) && tdm_is_contiguous(y) && tdm_is_contiguous(lse) &&
           tdm_numel(y) == B * T * C && tdm_numel(lse) == B * n_head * T);
    *g = att_geom{B, T, C, n_head, C / n_head, 1.0f / sqrtf((float)(C / n_head))};
    if (!tdm_dtype_is_float(qkv->dtype) || y->dtype != qkv->dtype || lse->dtype != TDM_F32)
        return tdm_raise(TDM_ERR_DTYPE,
                         "%s: qkv %s and y (or dy) %s must be one of f32, bf16, "
                         "f16, and lse f32 (got %s)",
                         op, tdm_dtype_name(qkv->dtype), tdm_dtype_name(y->dtype),
                         tdm_dtype_name(lse->dtype));
    if (T * T > INT32_MAX || B * n_head * T > INT32_MAX)
        return tdm_raise(TDM_ERR_SHAPE, "%s: context %lld with %lld heads exceeds cuBLAS's sizes",
                         op, (long long)T, (long long)(B * n_head));
    return B * T * C == 0 ? 1 : TDM_OK;
}

/* How the heads go to cuBLAS: a batch over the heads of one batch row (the next head hs
 * further on in qkv) or over the batch rows of one head (T*3C further on), whichever is
 * longer, so that small heads make few launches; n of them a chunk, as many as
 * ATT_SCRATCH_BYTES of scores hold. */
typedef struct {
    bool over_heads;
    int64_t items, outer, n; /* items per batch, batches, items per chunk */
} att_plan;

static att_plan att_plan_of(att_geom g, int64_t bytes_per_item) {
    att_plan p;
    p.over_heads = g.nh >= g.B;
    p.items = p.over_heads ? g.nh : g.B;
    p.outer = p.over_heads ? g.B : g.nh;
    int64_t n = ATT_SCRATCH_BYTES / bytes_per_item;
    p.n = n < 1 ? 1 : n > p.items ? p.items : n;
    return p;
}

/* Items [i0, i0 + m) of batch o: the offsets (in elements) of the first one's q in qkv, its
 * rows in y (or dy) and its lse, and the strides from one item to the next in each. */
typedef struct {
    int64_t m, qkv, row, lse, qkv_stride, row_stride, lse_stride;
} att_chunk;

static att_chunk att_chunk_at(att_geom g, att_plan p, int64_t o, int64_t i0) {
    const int64_t b = p.over_heads ? o : i0, h = p.over_heads ? i0 : o, T = g.T;
    att_chunk c;
    c.m = p.items - i0 < p.n ? p.items - i0 : p.n;
    c.qkv = b * T * 3 * g.C + h * g.hs, c.row = b * T * g.C + h * g.hs, c.lse = (b * g.nh + h) * T;
    c.qkv_stride = p.over_heads ? g.hs : T * 3 * g.C;
    c.row_stride = p.over_heads ? g.hs : T * g.C;
    c.lse_stride = p.over_heads ? T : g.nh * T;
    return c;
}

template <typename E>
static void att_softmax_launch(cu_device *d, att_chunk c, float *S, void *P, float *lse,
                               int64_t T) {
    att_softmax_kernel<E><<<(unsigned)(c.m * T), cu_row_threads(T), 0, d->compute>>>(
        S, (E *)P, lse + c.lse, c.lse_stride, T);
}

template <typename E>
static void att_bwd_rows_launch(cu_device *d, att_chunk c, float *S, float *dP, void *P, void *dS,
                                const float *lse, int64_t T) {
    att_bwd_rows_kernel<E><<<(unsigned)(c.m * T), cu_row_threads(T), 0, d->compute>>>(
        S, dP, (E *)P, (E *)dS, lse + c.lse, c.lse_stride, T);
}

extern "C" int tdm_cuda_attention(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv,
                                  int n_head) {
    att_geom g;
    int rc = att_setup("cuda attention", qkv, y, lse, n_head, &g);
    if (rc) return rc > 0 ? TDM_OK : rc;
    if (tdm_cuda_flash_fits(qkv, n_head)) return tdm_cuda_flash_attention(y, lse, qkv, n_head);
    int idx = qkv->device.index;
    cu_device *d = cu_dev_of(qkv, "attention");
    if (!d) return tdm_last_status();
    const tdm_dtype dt = qkv->dtype;
    const int64_t T = g.T, TT = T * T, C = g.C, es = (int64_t)tdm_dtype_size(dt);
    const int64_t low = dt == TDM_F32 ? 0 : es; /* bytes of P per score, beside S's f32 */
    const att_plan p = att_plan_of(g, TT * (4 + low));
    tdm_storage *hold;
    float *S = (float *)cu_scratch(idx, (size_t)(p.n * TT * (4 + low)), &hold);
    if (!S) return tdm_last_status();
    void *P = low ? (void *)(S + p.n * TT) : (void *)S; /* f32: P over S */
    char *qb = (char *)tdm_cuda_ptr(qkv), *yb = (char *)tdm_cuda_ptr(y);
    const cudaDataType ty = att_type(dt);
    for (int64_t o = 0; o < p.outer && !rc; o++)
        for (int64_t i0 = 0; i0 < p.items && !rc; i0 += p.n) {
            const att_chunk c = att_chunk_at(g, p, o, i0);
            const att_mat q = {qb + c.qkv * es, ty, 3 * C, c.qkv_stride};
            const att_mat k = {qb + (c.qkv + C) * es, ty, 3 * C, c.qkv_stride};
            const att_mat v = {qb + (c.qkv + 2 * C) * es, ty, 3 * C, c.qkv_stride};
            const att_mat sm = {S, CUDA_R_32F, T, TT}, pm = {P, ty, T, TT};
            const att_mat ym = {yb + c.row * es, ty, C, c.row_stride};
            rc = att_gemm(d, idx, false, true, T, T, g.hs, g.scale, q, k, sm, c.m,
                          "attention (q k^T)");
            if (!rc) {
                CU_DISPATCH(dt, att_softmax_launch, d, c, S, P, cu_f(lse), T);
                rc = cu_check_launch("attention (softmax)", idx);
            }
            if (!rc)
                rc = att_gemm(d, idx, false, false, T, g.hs, T, 1.0f, pm, v, ym, c.m,
                              "attention (P v)");
        }
    tdm_storage_release(hold); /* in stream order: the kernels above run first */
    return rc;
}

extern "C" int tdm_cuda_attention_backward(tdm_tensor *dqkv, const tdm_tensor *dy,
                                           const tdm_tensor *qkv, const tdm_tensor *y,
                                           const tdm_tensor *lse, int n_head) {
    att_geom g;
    int rc = att_setup("cuda attention_backward", qkv, dy, lse, n_head, &g);
    if (rc) return rc > 0 ? TDM_OK : rc;
    assert(tdm_is_contiguous(dqkv) && tdm_numel(dqkv) == tdm_numel(qkv)); /* the op's alloc */
    if (cu_check_float("attention_backward", true, {qkv, dqkv, y})) return tdm_last_status();
    if (tdm_cuda_flash_fits(qkv, n_head)) {
        assert(tdm_is_contiguous(y) && tdm_numel(y) == tdm_numel(dy)); /* the forward's output */
        return tdm_cuda_flash_attention_backward(dqkv, dy, qkv, y, lse, n_head);
    }
    int idx = qkv->device.index;
    cu_device *d = cu_dev_of(qkv, "attention_backward");
    if (!d) return tdm_last_status();
    const tdm_dtype dt = qkv->dtype;
    const int64_t T = g.T, TT = T * T, C = g.C, es = (int64_t)tdm_dtype_size(dt);
    const int64_t low = dt == TDM_F32 ? 0 : es; /* bytes of P and of dS per score */
    const att_plan p = att_plan_of(g, TT * (8 + 2 * low));
    tdm_storage *hold;
    float *S = (float *)cu_scratch(idx, (size_t)(p.n * TT * (8 + 2 * low)), &hold);
    if (!S) return tdm_last_status();
    float *dP = S + p.n * TT;
    void *P = low ? (void *)(dP + p.n * TT) : (void *)S; /* f32: P over S, dS over dP */
    void *dS = low ? (void *)((char *)P + p.n * TT * es) : (void *)dP;
    char *qb = (char *)tdm_cuda_ptr(qkv), *gb = (char *)tdm_cuda_ptr(dqkv);
    char *yb = (char *)tdm_cuda_ptr(dy);
    const cudaDataType ty = att_type(dt);
    for (int64_t o = 0; o < p.outer && !rc; o++)
        for (int64_t i0 = 0; i0 < p.items && !rc; i0 += p.n) {
            const att_chunk c = att_chunk_at(g, p, o, i0);
            const int64_t ld = 3 * C, st = c.qkv_stride;
            const att_mat q = {qb + c.qkv * es, ty, ld, st},
                          k = {qb + (c.qkv + C) * es, ty, ld, st};
            const att_mat v = {qb + (c.qkv + 2 * C) * es, ty, ld, st};
            const att_mat dq = {gb + c.qkv * es, ty, ld, st},
                          dk = {gb + (c.qkv + C) * es, ty, ld, st};
            const att_mat dv = {gb + (c.qkv + 2 * C) * es, ty, ld, st};
            const att_mat gy = {yb + c.row * es, ty, C, c.row_stride};
            const att_mat sm = {S, CUDA_R_32F, T, TT}, dpm = {dP, CUDA_R_32F, T, TT};
            const att_mat pm = {P, ty, T, TT}, dsm = {dS, ty, T, TT};
            rc = att_gemm(d, idx, false, true, T, T, g.hs, g.scale, q, k, sm, c.m,
                          "attention_backward (q k^T)");
            if (!rc)
                rc = att_gemm(d, idx, false, true, T, T, g.hs, 1.0f, gy, v, dpm, c.m,
                              "attention_backward (dy v^T)");
            if (!rc) {
                CU_DISPATCH(dt, att_bwd_rows_launch, d, c, S, dP, P, dS, cu_f(lse), T);
                rc = cu_check_launch("attention_backward (softmax)", idx);
            }
            if (!rc)
                rc = att_gemm(d, idx, true, false, T, g.hs, T, 1.0f, pm, gy, dv, c.m,
                              "attention_backward (P^T dy)");
            if (!rc)
                rc = att_gemm(d, idx, false, false, T, g.hs, T, g.scale, dsm, k, dq, c.m,
                              "attention_backward (dS k)");
            if (!rc)
                rc = att_gemm(d, idx, true, false, T, g.hs, T, g.scale, dsm, q, dk, c.m,
                              "attention_backward (dS^T q)");
        }
    tdm_storage_release(hold); /* in stream order: the kernels above run first */
    return rc;
}
