/* Host emulation of the cuBLAS calls Tandem's CUDA backend makes (see cuda_runtime.h here):
 * column-major SGEMM by definition, summing in double; GemmEx's bf16 and fp16 operands with
 * fp32 compute (CUBLAS_COMPUTE_32F), the product rounded once into C's type. The enums keep
 * the real headers' values (library_types.h, cublas_api.h). */
#ifndef TDM_EMU_CUBLAS_V2_H
#define TDM_EMU_CUBLAS_V2_H

#include "cuda_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct emu_blas *cublasHandle_t;
typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15
} cublasStatus_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 } cudaDataType;
typedef enum { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_TF32 = 77 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_DEFAULT_MATH = 0 } cublasMath_t;

cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m);
/* cuBLAS's workspace (a GPU's: so that a captured product allocates nothing); unused here */
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *workspace, size_t bytes);
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *a, int lda,
                           const float *b, int ldb, const float *beta, float *c, int ldc);
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float *alpha, const float *a, int lda, long long sa,
                                         const float *b, int ldb, long long sb, const float *beta,
                                         float *c, int ldc, long long sc, int batch);
/* C = alpha op(A) op(B) + beta C with A and B of one type (f32, bf16 or f16) and C of that
 * type or f32; alpha and beta are floats (CUBLAS_COMPUTE_32F). CUBLAS_COMPUTE_32F_FAST_TF32
 * with all three f32: each element of A and B rounded to TF32 (10 mantissa bits, to nearest,
 * ties away from zero, as the tensor cores' conversion) first. Other combinations:
 * CUBLAS_STATUS_NOT_SUPPORTED, as cuBLAS answers. */
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta,
                                          cublasOperation_t tb, int m, int n, int k,
                                          const void *alpha, const void *a, cudaDataType at,
                                          int lda, long long sa, const void *b, cudaDataType bt,
                                          int ldb, long long sb, const void *beta, void *c,
                                          cudaDataType ct, int ldc, long long sc, int batch,
                                          cublasComputeType_t compute, cublasGemmAlgo_t algo);

#ifdef __cplusplus
}
#endif

#endif
