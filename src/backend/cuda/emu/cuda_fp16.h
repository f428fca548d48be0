/* Host emulation of the part of CUDA's cuda_fp16.h that Tandem's kernels use: the storage
 * type __half and its conversions to and from float (round to nearest even), through
 * include/tandem/half.h, bit for bit the CPU backend's. */
#ifndef TDM_EMU_CUDA_FP16_H
#define TDM_EMU_CUDA_FP16_H

#include "tandem/half.h"

#ifdef __cplusplus
struct __half {
    uint16_t __x;
};
static inline __half __float2half_rn(float f) {
    __half h;
    h.__x = tdm_f16_from_float(f);
    return h;
}
static inline float __half2float(__half h) {
    return tdm_f16_to_float(h.__x);
}
#endif

#endif
