/* The CPU backend's kernels, one file per area (cpu_<area>.c, the sections of kernels.def);
 * the table is in cpu_backend.c. Private to src/backend: the layers above reach the CPU
 * through the table (tdm_backend_for) or the few calls backend.h declares for them. Tests and
 * benchmarks of a CPU kernel itself (test_gemm, bench_gemm) may include it. */
#ifndef TDM_CPU_H
#define TDM_CPU_H

#include "backend/backend.h"

/* tdm_cpu_<entry> for every kernel of kernels.def, defined in the cpu_<area>.c its section
 * names */
#define TDM_KERNEL(ret, entry, params) ret tdm_cpu_##entry params;
#define TDM_UPLOAD(ret, entry, params)
#include "backend/kernels.def"
#undef TDM_KERNEL
#undef TDM_UPLOAD

/* cpu_gemm.c: c[m, n] = alpha * op(a)[m, k] @ op(b)[k, n] + beta * c, row-major, op(x) = x^T
 * where ta/tb; lda, ldb, ldc are the row strides of a, b and c as stored */
void tdm_cpu_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                   int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
/* cpu_gemm_nt.c: c [m, n] = alpha * a [m, k] @ b [n, k]^T + beta * c on the calling thread
 * with AVX-512, b read in place (tdm_cpu_sgemm chooses it where measured faster). Nonzero,
 * nothing done, without AVX-512 or when its scratch cannot be had. */
int tdm_cpu_sgemm_nt(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                     const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
/* The widest vector ISA this CPU and its OS allow: 512 (AVX-512 F/BW/DQ/VL), 256 (AVX2 with
 * FMA) or 0 (baseline x86-64). */
int tdm_cpu_vector_bits(void);

#endif
