/* The CPU kernels in bf16 and f16 (issue 37): every kernel of kernels.def that reads or
 * writes floats accepts TDM_BF16 and TDM_F16 tensors in any mix with f32 ones, computing in
 * fp32 inside and rounding each low-precision output once (round to nearest even, half.h),
 * as PyTorch's CPU kernels do. Private to the CPU backend.
 *
 * How: each fp32 kernel tdm_cpu_<entry> asks tdm_cpu_lowp_any once per call, before its own
 * checks, and hands a call with a bf16 or f16 tensor to tdm_cpu_lowp_<entry> (cpu_lowp.c, the
 * widening adapter): it converts the low-precision tensors the kernel reads into fp32
 * temporaries from the caching allocator, calls the fp32 kernel on them, and rounds what it
 * wrote into the caller's low-precision outputs. f32 and integer tensors pass through as they
 * are, so the output's dtype is the caller's choice and the inputs' are what they are (a
 * bf16 a + an f32 b into an f32 y is PyTorch's type promotion). The fp32 paths are unchanged
 * but for that one test. Native paths that skip the widening are the kernels' own, chosen in
 * the same place: matmul with bf16 operands through the bf16 GEMM (cpu_matmul.c), the
 * element-wise kernels and sum_squares a chunk at a time through L1 (cpu_elementwise.c,
 * cpu_reduce.c), index_select of one dtype as bytes (cpu_index.c).
 *
 * The optimizers' kernels (sgd_step, adam_step) stay fp32 only and refuse other dtypes:
 * parameters, their gradients as the optimizer reads them, and its state stay fp32. The
 * memory kernels (copy, fill, random, host transfers) are cpu_memory.c's.
 */
#ifndef TDM_CPU_LOWP_H
#define TDM_CPU_LOWP_H

#include "backend/backend.h"
#include "tandem/half.h"

/* Whether any of the n tensors (NULL entries skipped) is bf16 or f16. */
static inline bool tdm_cpu_lowp_any(int n, const tdm_tensor *const *ts) {
    for (int i = 0; i < n; i++)
        if (ts[i] && (ts[i]->dtype == TDM_BF16 || ts[i]->dtype == TDM_F16)) return true;
    return false;
}

/* n 16-bit values of dtype dt (bf16 or f16) to floats, exactly, and back (rounded to nearest
 * even): for a kernel that reads or writes a low-precision row at a time. */
static inline void tdm_cpu_lowp_widen(float *dst, const uint16_t *src, int64_t n, tdm_dtype dt) {
    if (dt == TDM_BF16)
        tdm_bf16_to_f32(dst, src, (size_t)n);
    else
        tdm_f16_to_f32(dst, src, (size_t)n);
}
static inline void tdm_cpu_lowp_narrow(uint16_t *dst, const float *src, int64_t n, tdm_dtype dt) {
    if (dt == TDM_BF16)
        tdm_bf16_from_f32(dst, src, (size_t)n);
    else
        tdm_f16_from_f32(dst, src, (size_t)n);
}

/* tdm_cpu_lowp_<entry>: the widening adapter of kernel <entry>, with its signature. Defined
 * (cpu_lowp.c) for every kernel that takes float tensors except the memory and optimizer
 * kernels and the native ones (unary, unary_backward, binary, axpy: chunked, in
 * cpu_elementwise.c; sum_squares in cpu_reduce.c); declared for all from the one list so that a
 * signature cannot drift. Each returns the fp32 kernel's status, TDM_ERR_NOMEM naming the kernel
 * when a temporary cannot be had, or TDM_ERR_ARG for a low-precision output that is not contiguous
 * (no kernel's contract has one); on an error the caller's low-precision outputs are untouched. */
#define TDM_KERNEL(ret, entry, params) ret tdm_cpu_lowp_##entry params;
#define TDM_UPLOAD(ret, entry, params)
#include "backend/kernels.def"
#undef TDM_KERNEL
#undef TDM_UPLOAD

#endif
