/* The CPU's bf16 GEMM (issue 37): bf16 operands, fp32 accumulation, fp32 or bf16 result,
 * through oneDNN's matmul primitive where oneDNN has a bf16 kernel for this CPU, and by
 * converting to fp32 and calling tdm_cpu_sgemm where it has none. Private to the backend
 * until the tensor core has a bf16 dtype (then the backend's matmul entry calls it). */
#ifndef TDM_CPU_GEMM_BF16_H
#define TDM_CPU_GEMM_BF16_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* C = alpha * op(A) @ op(B) + beta * C, row-major, op(A) m x k and op(B) k x n, with the
 * transposes and leading dimensions of tdm_cpu_sgemm (ta: A is stored k x m with row stride
 * lda; tb: B is stored n x k with row stride ldb). A and B are bf16 bits (tandem/half.h); C
 * is float when c_bf16 is false, bf16 bits when it is true. The products are summed in fp32;
 * a bf16 C is read (when beta != 0) and written rounded to nearest even. beta == 0 ignores
 * C's old values (NaN included), as tdm_cpu_sgemm. All pointers stay the caller's; nothing
 * is kept of them. m, n or k of 0 is a no-op (k 0 with beta != 1 still scales C, as BLAS).
 * Returns TDM_OK; TDM_ERR_ARG naming the dimension for a negative size or a leading
 * dimension below its row length; TDM_ERR_NOMEM when the fp32 fallback cannot allocate its
 * copies; TDM_ERR_STATE with oneDNN's status when oneDNN fails to run a primitive it made. */
int tdm_cpu_gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                      const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, float beta,
                      void *c, bool c_bf16, int64_t ldc);

/* What the calling thread's last tdm_cpu_gemm_bf16 ran, a string valid until its next call:
 * "oneDNN <implementation>" (e.g. "oneDNN brg:avx512_core_bf16") or "fp32 sgemm" (the
 * convert-and-sgemm fallback: no oneDNN in the build, or no bf16 kernel but its reference
 * loops on this CPU), "scale" (k 0: C = beta * C, no product), "" before any call. */
const char *tdm_cpu_gemm_bf16_impl(void);

/* Primitives the cache holds now (at most TDM_GEMM_BF16_CACHE): one per distinct shape,
 * transposes, leading dimensions, alpha, beta and output dtype, evicting the least recently
 * used one not running at the moment. */
int tdm_cpu_gemm_bf16_cached(void);
#define TDM_GEMM_BF16_CACHE 64 /* TDM_DNNL_CACHE (cpu_dnnl.h) */

/* Frees every cached primitive not running at the moment (tests, and the leak checkers). */
void tdm_cpu_gemm_bf16_cache_clear(void);

#endif
