/* Vectorisable float math for the CPU kernels.
 *
 * libm's expf is a call per element, which keeps loops scalar; this one is branch-free
 * arithmetic on floats and ints (Cephes' polynomial, ~1 ulp on the normal range), so loops
 * built on it vectorise. Results below FLT_MIN (x < -87.33) flush to 0 instead of denormals;
 * NaN propagates; x > 88.72 gives +inf. v8_exp (cpu_simd.h) computes the same reduction and
 * polynomial, from the constants below, in eight explicit lanes with a cheaper ending.
 */
#ifndef TDM_CPU_MATH_H
#define TDM_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define TDM_EXP_HI    88.7228391f  /* above: +inf */
#define TDM_EXP_LO    -87.3365448f /* below: 0 (the result would be denormal) */
#define TDM_LOG2E     1.44269504088896341f
#define TDM_ROUND_MAG 12582912.0f /* 1.5 * 2^23: adding and removing it rounds to an integer */
#define TDM_LN2_HI    0.693359375f
#define TDM_LN2_LO    -2.12194440e-4f
#define TDM_EXP_P0    1.9875691500e-4f
#define TDM_EXP_P1    1.3981999507e-3f
#define TDM_EXP_P2    8.3334519073e-3f
#define TDM_EXP_P3    4.1665795894e-2f
#define TDM_EXP_P4    1.6666665459e-1f
#define TDM_EXP_P5    5.0000001201e-1f

static inline float tdm_expf(float x) {
    const float hi = TDM_EXP_HI, lo = TDM_EXP_LO;
    float xc = x > hi ? hi : x;
    xc = xc < lo ? lo : xc;
    xc = xc == xc ? xc : 0.0f; /* NaN: compute on 0, select NaN at the end */
    /* exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 with ln 2 split in two
     * parts so that r is exact */
    /* round to nearest by adding and removing 1.5 * 2^23 (floorf is a libm call that
     * stops vectorisation); exact since |x / ln 2| < 2^22 after the clamp */
    float n = (xc * TDM_LOG2E + TDM_ROUND_MAG) - TDM_ROUND_MAG;
    float r = xc - n * TDM_LN2_HI;
    r = r - n * TDM_LN2_LO;
    float p = TDM_EXP_P0;
    p = p * r + TDM_EXP_P1;
    p = p * r + TDM_EXP_P2;
    p = p * r + TDM_EXP_P3;
    p = p * r + TDM_EXP_P4;
    p = p * r + TDM_EXP_P5;
    p = p * r * r + r + 1.0f;
    /* 2^n from exponent bits; n is in [-126, 128] after the clamp and 128 has no bits
     * (255 means inf), so positive n is built as 2^(n-1) * 2 */
    int32_t ni = (int32_t)n, half = ni > 0 ? 1 : 0;
    int32_t bits = (ni - half + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = p * scale * (half ? 2.0f : 1.0f);
    y = x > hi ? INFINITY : y;
    y = x < lo ? 0.0f : y;
    return x == x ? y : x;
}

static inline float tdm_sigmoidf(float x) {
    return 1.0f / (1.0f + tdm_expf(-x)); /* exp overflow gives 1/inf = 0: still exact */
}

#endif
