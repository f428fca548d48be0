/* Eight-lane float vectors for the row kernels (norms, losses) through GCC/Clang vector
 * extensions: AVX with -march=native, plain scalar code elsewhere, one source either way.
 *
 * The build's -O2 does not vectorise loops of unknown length or float reductions (that would
 * reorder additions), so the hot loops say explicitly what may run in lanes. Each helper has a
 * scalar tail for the last n % 8 elements.
 */
#ifndef TDM_CPU_SIMD_H
#define TDM_CPU_SIMD_H

#include "backend/cpu/cpu_math.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* These helpers are static inline, never called across an ABI boundary: GCC's note that a
 * 32-byte vector is passed differently without AVX does not apply. */
#pragma GCC diagnostic ignored "-Wpsabi"

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f v8_load(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void v8_store(float *p, v8f v) {
    memcpy(p, &v, sizeof v);
}
static inline v8f v8_set1(float x) {
    return (v8f){x, x, x, x, x, x, x, x};
}
static inline float v8_hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
/* m ? a : b per lane, m from a vector comparison (all ones or zero); a cast between
 * vector types of one size reinterprets the bits */
static inline v8f v8_select(v8i m, v8f a, v8f b) {
    return (v8f)((m & (v8i)a) | (~m & (v8i)b));
}
static inline v8f v8_max(v8f a, v8f b) {
    return v8_select(a > b, a, b);
}
static inline float v8_hmax(v8f v) {
    float m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* exp in lanes: tdm_expf's range reduction and polynomial (cpu_math.h, the constants shared)
 * with a cheaper ending for the row kernels, whose inputs are x - max <= 0: n by floor, no
 * NaN or +inf cases (inputs above 88.38 clamp), 0 below -87.3. Making it tdm_expf bit for bit
 * cost the cross-entropy kernels ~12% (bench_ops). */
static inline v8f v8_exp(v8f x) {
    const v8f hi = v8_set1(88.3762626647949f), lo = v8_set1(TDM_EXP_LO);
    x = v8_select(x > hi, hi, x);
    v8i under = x < lo;
    x = v8_select(under, lo, x);
    v8f fx = x * v8_set1(TDM_LOG2E) + v8_set1(0.5f);
    v8f n = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8f); /* trunc */
    n = v8_select(n > fx, n - v8_set1(1.0f), n);                            /* floor */
    x = x - n * v8_set1(TDM_LN2_HI) - n * v8_set1(TDM_LN2_LO);
    v8f y = v8_set1(TDM_EXP_P0);
    y = y * x + v8_set1(TDM_EXP_P1);
    y = y * x + v8_set1(TDM_EXP_P2);
    y = y * x + v8_set1(TDM_EXP_P3);
    y = y * x + v8_set1(TDM_EXP_P4);
    y = y * x + v8_set1(TDM_EXP_P5);
    y = y * x * x + x + v8_set1(1.0f);
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    v8f scale;
    memcpy(&scale, &e, sizeof scale);
    v8f r = y * scale;
    return v8_select(under, v8_set1(0.0f), r);
}

static inline v8f v8_abs(v8f x) {
    return (v8f)((v8i)x & (v8i){0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff,
                                0x7fffffff, 0x7fffffff, 0x7fffffff});
}

/* log1p(z) for z in [0, 1] in lanes: 2 atanh(t) with t = z / (2 + z) <= 1/3, by its odd
 * series to t^13 (relative error < 2e-7, and exact in the small-z limit: no 1 + z rounding). */
static inline v8f v8_log1p_unit(v8f z) {
    v8f t = z / (v8_set1(2.0f) + z), t2 = t * t;
    v8f p = v8_set1(1.0f / 13);
    p = p * t2 + v8_set1(1.0f / 11);
    p = p * t2 + v8_set1(1.0f / 9);
    p = p * t2 + v8_set1(1.0f / 7);
    p = p * t2 + v8_set1(1.0f / 5);
    p = p * t2 + v8_set1(1.0f / 3);
    p = p * t2 + v8_set1(1.0f);
    return v8_set1(2.0f) * t * p;
}

/* sum of p[0..n) */
static inline float simd_sum(const float *p, int64_t n) {
    v8f a0 = v8_set1(0), a1 = v8_set1(0);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 += v8_load(p + i);
        a1 += v8_load(p + i + 8);
    }
    for (; i + 8 <= n; i += 8) a0 += v8_load(p + i);
    float s = v8_hsum(a0 + a1);
    for (; i < n; i++) s += p[i];
    return s;
}

/* sum of (p[i] - mu)^2, the squares added in double lanes (batch norm's statistics): added
 * in float without FMA contraction, as the sanitizer builds' baseline code does, a ResNet's
 * train-mode gradients came out 1,000x further from float64 PyTorch's than float32
 * PyTorch's (test_resnet). */
typedef float v4f __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));
static inline double simd_sq_dev_f64(const float *p, int64_t n, float mu) {
    v4d a0 = {0, 0, 0, 0}, a1 = {0, 0, 0, 0};
    v4f m = {mu, mu, mu, mu};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v4f x0, x1;
        memcpy(&x0, p + i, sizeof x0);
        memcpy(&x1, p + i + 4, sizeof x1);
        v4d d0 = __builtin_convertvector(x0 - m, v4d), d1 = __builtin_convertvector(x1 - m, v4d);
        a0 += d0 * d0, a1 += d1 * d1;
    }
    a0 += a1;
    double s = (a0[0] + a0[2]) + (a0[1] + a0[3]);
    for (; i < n; i++) {
        double d = (double)(p[i] - mu);
        s += d * d;
    }
    return s;
}

/* y[i] = x[i] * a + b */
static inline void simd_affine(float *y, const float *x, int64_t n, float a, float b) {
    v8f va = v8_set1(a), vb = v8_set1(b);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) v8_store(y + i, v8_load(x + i) * va + vb);
    for (; i < n; i++) y[i] = x[i] * a + b;
}

/* max of p[0..n), n >= 1 */
static inline float simd_max(const float *p, int64_t n) {
    int64_t i = 0;
    float m = p[0];
    if (n >= 8) {
        v8f a = v8_load(p);
        for (i = 8; i + 8 <= n; i += 8) a = v8_max(a, v8_load(p + i));
        m = v8_hmax(a);
    }
    for (; i < n; i++) m = p[i] > m ? p[i] : m;
    return m;
}

#endif
