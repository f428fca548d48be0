/* CUDA matrix products: batched row-major GEMMs on cuBLAS: SGEMM in f32 (in TF32 on the
 * tensor cores, CUBLAS_COMPUTE_32F_FAST_TF32, where tdm_allow_tf32 says so); bf16 or f16
 * operands through cublasGemmStridedBatchedEx with fp32 accumulation (CUBLAS_COMPUTE_32F), the
 * product rounded once into c's dtype (a's, or f32).
 *
 * Row-major to column-major: cuBLAS sees a row-major [r, c] matrix with row stride ld as a
 * column-major [c, r] one with the same ld, so row-major C = A B is computed as the
 * column-major C^T = B^T A^T: operands swap places and the transposes stay as they are. */
#include "backend/cuda/cuda_common.cuh"
#include "tandem/runtime.h" /* tdm_allow_tf32 */

#include <limits.h>

/* ---- matmul ------------------------------------------------------------------------------ */

/* Leading dimension of a [rows, cols] view with unit stride in its last dim. */
static int64_t lead(const tdm_tensor *t) {
    int64_t ld = t->strides[t->ndim - 2];
    return ld < t->shape[t->ndim - 1] ? t->shape[t->ndim - 1] : ld;
}

extern "C" int tdm_cuda_matmul(tdm_tensor *c, const tdm_tensor *a, const tdm_tensor *b, bool ta,
                               bool tb, float beta) {
    /* c [B, n, m]; a [B, n, k] or [B, k, n]; b [B, k, m] or [B, m, k] */
    if (c->ndim != 3 || a->ndim != 3 || b->ndim != 3 || !tdm_is_contiguous(c))
        return tdm_raise(TDM_ERR_SHAPE, "cuda matmul: expects 3-D operands, c contiguous");
    if (a->strides[2] != 1 || b->strides[2] != 1)
        return tdm_raise(TDM_ERR_ARG, "cuda matmul: operands need unit stride in their last dim");
    /* a and b of one dtype; c of theirs or f32 (a bf16 product kept in f32) */
    if (cu_check_float("matmul", true, {a, b}) || cu_check_float("matmul", false, {c}))
        return tdm_last_status();
    if (c->dtype != a->dtype && c->dtype != TDM_F32)
        return tdm_raise(TDM_ERR_DTYPE, "cuda matmul: a %s product into %s (c must be %s or f32)",
                         tdm_dtype_name(a->dtype), tdm_dtype_name(c->dtype),
                         tdm_dtype_name(a->dtype));
    int64_t batch = c->shape[0], n = c->shape[1], m = c->shape[2];
    int64_t k = ta ? a->shape[1] : a->shape[2];
    cu_device *d = cu_dev_of(c, "matmul");
    if (!d) return tdm_last_status();
    if (batch == 0 || n == 0 || m == 0) return TDM_OK;
    if (k == 0) return beta == 0.0f ? tdm_cuda_fill(c, 0.0) : TDM_OK; /* an empty sum */
    int64_t lda = lead(a), ldb = lead(b);
    if (n > INT_MAX || m > INT_MAX || k > INT_MAX || batch > INT_MAX || lda > INT_MAX ||
        ldb > INT_MAX)
        return tdm_raise(TDM_ERR_SHAPE, "cuda matmul: a dimension exceeds cuBLAS's int range");
    const float one = 1.0f;
    const bool tf32 = a->dtype == TDM_F32 && tdm_allow_tf32();
    if (a->dtype != TDM_F32 || tf32) {
        cudaDataType t = a->dtype == TDM_BF16  ? CUDA_R_16BF
                         : a->dtype == TDM_F16 ? CUDA_R_16F
                                               : CUDA_R_32F;
        cudaDataType ct = c->dtype == TDM_F32 ? CUDA_R_32F : t;
        cublasStatus_t st = cublasGemmStridedBatchedEx(
            d->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)m, (int)n,
            (int)k, &one, tdm_cuda_ptr(b), t, (int)ldb, b->strides[0], tdm_cuda_ptr(a), t, (int)lda,
            a->strides[0], &beta, tdm_cuda_ptr(c), ct, (int)m, n * m, (int)batch,
            tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        return cu_check_blas(st, "matmul (cublasGemmStridedBatchedEx)", c->device.index);
    }
    cublasStatus_t st = cublasSgemmStridedBatched(
        d->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)m, (int)n,
        (int)k, &one, cu_f(b), (int)ldb, b->strides[0], cu_f(a), (int)lda, a->strides[0], &beta,
        cu_f(c), (int)m, n * m, (int)batch);
    return cu_check_blas(st, "matmul (cublasSgemmStridedBatched)", c->device.index);
}
