/* Host emulation of the part of CUDA's cuda_bf16.h that Tandem's kernels use (see
 * cuda_runtime.h here): the storage type and its conversions to and from float, round to
 * nearest even as the real intrinsics, through include/tandem/half.h so that the bits are the
 * CPU backend's. (A NaN converts to half.h's NaN, 0xFFFF; a GPU writes 0x7FFF: both NaN.) */
#ifndef TDM_EMU_CUDA_BF16_H
#define TDM_EMU_CUDA_BF16_H

#include "cuda_fp16.h"
#include "tandem/half.h"

#ifdef __cplusplus
/* The raw bits only: kernels convert to float for arithmetic (no bf16 operators used). */
struct __nv_bfloat16 {
    uint16_t __x;
};
static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    __nv_bfloat16 h;
    h.__x = tdm_bf16_from_float(f);
    return h;
}
static inline float __bfloat162float(__nv_bfloat16 h) {
    return tdm_bf16_to_float(h.__x);
}
#endif

#endif
