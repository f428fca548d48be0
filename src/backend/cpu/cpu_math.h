/* Vectorisable float math for the CPU kernels.
 *
 * libm's expf is a call per element, which keeps loops scalar; this one is branch-free
 * arithmetic on floats and ints (Cephes' polynomial, ~1 ulp on the normal range), so loops
 * built on it vectorise. Results below FLT_MIN (x < -87.33) flush to 0 instead of denormals;
 * NaN propagates; x > 88.72 gives +inf.
 */
#ifndef TDM_CPU_MATH_H
#define TDM_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float tdm_expf(float x) {
    const float hi = 88.7228391f, lo = -87.3365448f;
    float xc = x > hi ? hi : x;
    xc = xc < lo ? lo : xc;
    xc = xc == xc ? xc : 0.0f; /* NaN: compute on 0, select NaN at the end */
    /* exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 with ln 2 split in two
     * parts so that r is exact */
    /* round to nearest by adding and removing 1.5 * 2^23 (floorf is a libm call that
     * stops vectorisation); exact since |x / ln 2| < 2^22 after the clamp */
    float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
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
