/* Shared by the convolution kernels: cpu_conv.c (im2col + GEMM, every shape; the dispatcher)
 * and cpu_conv_winograd.c (Winograd F(2x2, 3x3) for stride-1 3x3 convolutions). */
#ifndef TDM_CPU_CONV_H
#define TDM_CPU_CONV_H

#include "backend/conv_geom.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_isa.h"

#ifdef TDM_HAVE_AVX512_CODE
#include <immintrin.h>
TDM_AVX512_BEGIN
/* Lanes l of a 16-lane load at column s of a w-wide row that hold a pixel (0 <= s + l < w):
 * masked out, the others read as zeros, which are a convolution's padding. */
static inline __mmask16 tdm_pixel_lanes(int64_t s, int64_t w) {
    int64_t lo = s < 0 ? -s : 0, hi = w - s < 16 ? w - s : 16;
    return hi <= lo ? 0 : (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
}
TDM_AVX512_END
#endif

/* Whether the Winograd path takes this convolution (and is compiled in). */
bool tdm_cpu_wino_applies(const conv_geom *g);
/* Turns the fast paths (Winograd, ...) off (false) or back on for the calling thread's
 * convolutions, so that every shape runs per-image im2col + GEMM, and returns the previous
 * setting: tests and benchmarks compare each path with im2col on the same shape. */
bool tdm_cpu_conv_set_fast_paths(bool on);
/* y = conv(x, w) + b (b may be NULL), all contiguous, for a geometry the test above accepts. */
int tdm_cpu_wino_conv2d(float *y, const float *x, const float *w, const float *b,
                        const conv_geom *g, tdm_device dev);
/* gx and gw (either may be NULL), overwritten; gb is left to the caller. */
int tdm_cpu_wino_conv2d_backward(float *gx, float *gw, const float *gy, const float *x,
                                 const float *w, const conv_geom *g, tdm_device dev);

#endif
