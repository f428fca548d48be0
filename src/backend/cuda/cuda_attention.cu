/* CUDA causal self-attention (the contract is backend.h's; the CPU twin is cpu_attention.c).
 *
 * qkv [B, T, 3C] holds q, k and v side by side; head h of each is the channel block
 * [h*hs, (h+1)*hs). The heads are first copied apart ([3, B*nh, T, hs], so that cuBLAS's
 * strided batches reach them), then for a chunk of heads at a time, with the scores S [T, T]
 * of each head of the chunk in scratch:
 *   forward   S = scale q k^T (cuBLAS), P = causal softmax of each row of S and its
 *             log-sum-exp lse (a row kernel), y = P v (cuBLAS)
 *   backward  S again, and dP = dy v^T (cuBLAS); P = exp(S - lse) and
 *             dS = P (dP - D), D_t = sum_s P_ts dP_ts (a row kernel);
 *             dv = P^T dy, dq = scale dS k, dk = scale dS^T q (cuBLAS)
 * The matrix products are most of the work and run at cuBLAS's speed: one block per row and
 * head with the dot products in each thread, the first version, took half of a GPT-2-small
 * step on an H200 (bench/RESULTS.md, "GPU check"). Half of each S is above the diagonal and
 * wasted; a fused kernel that skips it and keeps S out of memory is the next step. Every sum
 * runs in a fixed order (cuBLAS's kernels for given shapes, the block reductions' fixed
 * trees): the results are the same on every run.
 *
 * qkv, y, dy and dqkv may be bf16 or f16 (one dtype per call; lse stays f32, as in PyTorch's
 * flash kernels): the heads are loaded into the f32 scratch as they are copied apart and
 * rounded once as they are copied back, so everything between runs in f32. Products in the
 * low precision on tensor cores would be faster; they are not done yet. */
#include "backend/cuda/cuda_common.cuh"

#include <assert.h>
#include <math.h>

/* Floats of scores (S and dP) per chunk of heads: 128 MiB, whatever the context. */
#ifndef ATT_SCRATCH_FLOATS
#define ATT_SCRATCH_FLOATS (32ll << 20)
#endif

typedef struct {
    int64_t B, T, C, nh, hs;
    float scale;
} att_geom;

/* dst [parts, B*nh, T, hs] <- src [B, T, parts*C] (split), or back (merge); rows of type T. */
template <typename T>
__global__ void att_heads_kernel(float *heads, T *rows, att_geom g, int parts, bool split) {
    const int64_t n = parts * g.B * g.T * g.C;
    CU_LOOP(i, n) {
        int64_t d = i % g.hs, r = i / g.hs, t = r % g.T, bh = r / g.T, h = bh % g.nh;
        int64_t b = (bh / g.nh) % g.B, p = bh / (g.nh * g.B);
        T *row = rows + (b * g.T + t) * parts * g.C + p * g.C + h * g.hs + d;
        if (split)
            heads[i] = cu_ld(*row);
        else
            *row = cu_to<T>(heads[i]);
    }
}

/* Row t of the scores of one head (block j*T + t): P = softmax over s <= t, 0 above the
 * diagonal; lse_t = max + log(sum). */
__global__ void att_softmax_kernel(float *S, float *lse, int64_t T) {
    __shared__ float red[CU_THREADS];
    const int64_t row = blockIdx.x, t = row % T;
    float *s = S + row * T;
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t c = threadIdx.x; c <= t; c += blockDim.x) mx = cu_nanmax(mx, s[c]);
    mx = cu_block_max(mx, red);
    for (int64_t c = threadIdx.x; c <= t; c += blockDim.x) {
        float e = expf(s[c] - mx);
        s[c] = e, sum += e;
    }
    sum = cu_block_sum(sum, red);
    const float inv = 1.0f / sum;
    for (int64_t c = threadIdx.x; c < T; c += blockDim.x) s[c] = c <= t ? s[c] * inv : 0.0f;
    if (threadIdx.x == 0) lse[row] = mx + logf(sum);
}

/* Row t of one head in the backward pass: S becomes P = exp(S - lse_t) (0 above the
 * diagonal), dP becomes dS = P (dP - D_t). */
__global__ void att_bwd_rows_kernel(float *S, float *dP, const float *lse, int64_t T) {
    __shared__ float red[CU_THREADS];
    const int64_t row = blockIdx.x, t = row % T;
    float *s = S + row * T, *dp = dP + row * T;
    const float lt = lse[row];
    float part = 0.0f;
    for (int64_t c = threadIdx.x; c < T; c += blockDim.x) {
        float p = c <= t ? expf(s[c] - lt) : 0.0f;
        s[c] = p, part += p * dp[c];
    }
    const float D = cu_block_sum(part, red);
    for (int64_t c = threadIdx.x; c < T; c += blockDim.x)
        dp[c] = c <= t ? s[c] * (dp[c] - D) : 0.0f;
}

/* Row-major batched C = alpha op(A) op(B), op(X) = X^T when tX: cuBLAS is column-major, so
 * it computes C^T = op(B)^T op(A)^T on the same memory. */
static int att_gemm(cu_device *d, int index, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                    float alpha, const float *a, int64_t lda, int64_t sa, const float *b,
                    int64_t ldb, int64_t sb, float *c, int64_t ldc, int64_t sc, int64_t batch,
                    const char *what) {
    const float zero = 0.0f;
    cublasStatus_t st = cublasSgemmStridedBatched(
        d->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n, (int)m,
        (int)k, &alpha, b, (int)ldb, sb, a, (int)lda, sa, &zero, c, (int)ldc, sc, (int)batch);
    return cu_check_blas(st, what, index);
}

template <typename T>
static void att_heads_launch(cu_device *d, float *heads, const tdm_tensor *rows, att_geom g,
                             int parts, bool split) {
    att_heads_kernel<T><<<cu_blocks(parts * g.B * g.T * g.C), CU_THREADS, 0, d->compute>>>(
        heads, cu_p<T>(rows), g, parts, split);
}

/* Copies the heads of rows [B, T, parts*C] (f32, bf16 or f16) to or from f32 heads
 * [parts, B*nh, T, hs]. */
static int att_heads(cu_device *d, int index, float *heads, const tdm_tensor *rows, att_geom g,
                     int parts, bool split) {
    CU_DISPATCH(rows->dtype, att_heads_launch, d, heads, rows, g, parts, split);
    return cu_check_launch(split ? "attention (heads apart)" : "attention (heads together)", index);
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

/* Heads per chunk: as many as ATT_SCRATCH_FLOATS of scores hold (2 [T, T] arrays each in the
 * backward pass), at least one. */
static int64_t att_chunk(att_geom g) {
    int64_t n = ATT_SCRATCH_FLOATS / (2 * g.T * g.T);
    return n < 1 ? 1 : n > g.B * g.nh ? g.B * g.nh : n;
}

extern "C" int tdm_cuda_attention(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv,
                                  int n_head) {
    att_geom g;
    int rc = att_setup("cuda attention", qkv, y, lse, n_head, &g);
    if (rc) return rc > 0 ? TDM_OK : rc;
    int idx = qkv->device.index;
    cu_device *d = cu_dev_of(qkv, "attention");
    if (!d) return tdm_last_status();
    const int64_t H = g.B * g.nh, T = g.T, hs = g.hs, n = att_chunk(g), BTC = g.B * T * g.C;
    tdm_storage *hold;
    float *q = (float *)cu_scratch(idx, sizeof(float) * (size_t)(4 * BTC + n * T * T), &hold);
    if (!q) return tdm_last_status();
    float *k = q + BTC, *v = k + BTC, *yh = v + BTC, *S = yh + BTC;
    rc = att_heads(d, idx, q, qkv, g, 3, true);
    for (int64_t h0 = 0; h0 < H && !rc; h0 += n) {
        const int64_t m = H - h0 < n ? H - h0 : n, off = h0 * T * hs;
        rc = att_gemm(d, idx, false, true, T, T, hs, g.scale, q + off, hs, T * hs, k + off, hs,
                      T * hs, S, T, T * T, m, "attention (q k^T)");
        if (!rc) {
            att_softmax_kernel<<<(unsigned)(m * T), cu_row_threads(T), 0, d->compute>>>(
                S, cu_f(lse) + h0 * T, T);
            rc = cu_check_launch("attention (softmax)", idx);
        }
        if (!rc)
            rc = att_gemm(d, idx, false, false, T, hs, T, 1.0f, S, T, T * T, v + off, hs, T * hs,
                          yh + off, hs, T * hs, m, "attention (P v)");
    }
    if (!rc) rc = att_heads(d, idx, yh, y, g, 1, false);
    tdm_storage_release(hold); /* in stream order: the kernels above run first */
    return rc;
}

extern "C" int tdm_cuda_attention_backward(tdm_tensor *dqkv, const tdm_tensor *dy,
                                           const tdm_tensor *qkv, const tdm_tensor *lse,
                                           int n_head) {
    att_geom g;
    int rc = att_setup("cuda attention_backward", qkv, dy, lse, n_head, &g);
    if (rc) return rc > 0 ? TDM_OK : rc;
    assert(tdm_is_contiguous(dqkv) && tdm_numel(dqkv) == tdm_numel(qkv)); /* the op's alloc */
    if (cu_check_float("attention_backward", true, {qkv, dqkv})) return tdm_last_status();
    int idx = qkv->device.index;
    cu_device *d = cu_dev_of(qkv, "attention_backward");
    if (!d) return tdm_last_status();
    const int64_t H = g.B * g.nh, T = g.T, hs = g.hs, n = att_chunk(g), BTC = g.B * T * g.C;
    tdm_storage *hold;
    float *q = (float *)cu_scratch(idx, sizeof(float) * (size_t)(7 * BTC + 2 * n * T * T), &hold);
    if (!q) return tdm_last_status();
    float *k = q + BTC, *v = k + BTC, *gy = v + BTC, *dq = gy + BTC, *dk = dq + BTC, *dv = dk + BTC,
          *S = dv + BTC, *dP = S + n * T * T;
    rc = att_heads(d, idx, q, qkv, g, 3, true);
    if (!rc) rc = att_heads(d, idx, gy, dy, g, 1, true);
    for (int64_t h0 = 0; h0 < H && !rc; h0 += n) {
        const int64_t m = H - h0 < n ? H - h0 : n, off = h0 * T * hs, st = T * hs;
        rc = att_gemm(d, idx, false, true, T, T, hs, g.scale, q + off, hs, st, k + off, hs, st, S,
                      T, T * T, m, "attention_backward (q k^T)");
        if (!rc)
            rc = att_gemm(d, idx, false, true, T, T, hs, 1.0f, gy + off, hs, st, v + off, hs, st,
                          dP, T, T * T, m, "attention_backward (dy v^T)");
        if (!rc) {
            att_bwd_rows_kernel<<<(unsigned)(m * T), cu_row_threads(T), 0, d->compute>>>(
                S, dP, cu_f(lse) + h0 * T, T);
            rc = cu_check_launch("attention_backward (softmax)", idx);
        }
        if (!rc)
            rc = att_gemm(d, idx, true, false, T, hs, T, 1.0f, S, T, T * T, gy + off, hs, st,
                          dv + off, hs, st, m, "attention_backward (P^T dy)");
        if (!rc)
            rc = att_gemm(d, idx, false, false, T, hs, T, g.scale, dP, T, T * T, k + off, hs, st,
                          dq + off, hs, st, m, "attention_backward (dS k)");
        if (!rc)
            rc = att_gemm(d, idx, true, false, T, hs, T, g.scale, dP, T, T * T, q + off, hs, st,
                          dk + off, hs, st, m, "attention_backward (dS^T q)");
    }
    if (!rc) rc = att_heads(d, idx, dq, dqkv, g, 3, false);
    tdm_storage_release(hold); /* in stream order: the kernels above run first */
    return rc;
}
