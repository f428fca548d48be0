/* bf16 and fp16 conversions (tandem/half.h gives the rules). The scalar forms are integer
 * arithmetic on the bits, so the thread's flush-to-zero mode never touches them; the array
 * forms run the CPU's conversion instructions where that gives the same bits:
 * - vcvtne2ps2bf16 rounds as PyTorch does except on two kinds of input: it reads float
 *   denormals as zero (PyTorch rounds them to bf16 denormals) and keeps a NaN's sign and
 *   payload (PyTorch's tensor conversion writes 0xFFFF). A block of 32 holding either is
 *   converted by the scalar form instead; such values are rare in training data.
 * - vcvtps2ph and vcvtph2ps (F16C, immediate rounding to nearest even) give exactly the rules
 *   of the header, which is why the scalar forms write NaNs as F16C does.
 * The level is chosen once from cpuid and can be lowered for tests (core/half_isa.h). */
#include "tandem/half.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>

#include "core/half_isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HALF_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

static uint32_t bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float float_of(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

uint16_t tdm_bf16_from_float(float x) {
    uint32_t u = bits_of(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;
    /* adding 0x7FFF rounds up above the half-way point; the kept LSB breaks a tie to even */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float tdm_bf16_to_float(uint16_t h) {
    return float_of((uint32_t)h << 16);
}

/* Below 2^-14: an fp16 subnormal, in units of 2^-24, rounded to nearest even. */
static uint16_t f16_subnormal(uint32_t ax) {
    if (ax <= 0x33000000u) return 0; /* at most 2^-25: half a unit or less, ties to 0 */
    uint32_t e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126 - e; /* m * 2^(e - 150) in units of 2^-24: 14 to 24 bits off */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)q; /* 0x400 when it rounds up to the smallest normal: still right */
}

uint16_t tdm_f16_from_float(float x) {
    uint32_t u = bits_of(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t ax = u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00u | (uint16_t)((ax >> 13) & 0x3FFu);
    if (ax >= 0x477FF000u) return sign | 0x7C00u; /* 65520 and up (inf too): round to inf */
    if (ax < 0x38800000u) return sign | f16_subnormal(ax);
    /* rebias the exponent (127 - 15) and round away 13 bits, ties to even; a carry out of
     * the mantissa moves into the exponent, as it should */
    uint32_t r = ax + 0xFFFu + ((ax >> 13) & 1u);
    return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

float tdm_f16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return float_of(sign | 0x7F800000u | (m ? 0x400000u | (m << 13) : 0));
    if (e != 0) return float_of(sign | ((e + 112) << 23) | (m << 13));
    /* a subnormal, m * 2^-24: a normal float, exact, and no denormal operand for DAZ */
    return float_of(sign | bits_of((float)m * 0x1p-24f));
}

/* ---- levels ---- */

static _Atomic int level_cap = TDM_HALF_AVX512_BF16;

#ifdef HALF_X86
/* The XSAVE state components the OS enables (xgetbv 0), read only when cpuid says OSXSAVE. */
static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* From cpuid itself: GCC's __builtin_cpu_supports knows "f16c" and "avx512bf16", Clang 14's
 * does not. */
static tdm_half_level probe_level(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return TDM_HALF_SCALAR;
    bool osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
    uint64_t xcr = osxsave ? xcr0() : 0;
    if (!avx || !f16c || (xcr & 0x6) != 0x6) return TDM_HALF_SCALAR; /* SSE and AVX state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return TDM_HALF_F16C;
    bool avx512 = (b & (1u << 16)) && (b & (1u << 30)) && (b & (1u << 31)); /* F, BW, VL */
    if (!avx512 || (xcr & 0xE0) != 0xE0 || a < 1) return TDM_HALF_F16C;     /* opmask, ZMM state */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return TDM_HALF_F16C;
    return (a & (1u << 5)) ? TDM_HALF_AVX512_BF16 : TDM_HALF_F16C; /* AVX512_BF16 */
}
#endif

tdm_half_level tdm_half_level_supported(void) {
#ifdef HALF_X86
    static _Atomic int found = -1;
    int f = atomic_load_explicit(&found, memory_order_relaxed);
    if (f < 0) {
        f = (int)probe_level();
        atomic_store_explicit(&found, f, memory_order_relaxed);
    }
    return (tdm_half_level)f;
#else
    return TDM_HALF_SCALAR;
#endif
}

tdm_half_level tdm_half_set_max_level(tdm_half_level cap) {
    atomic_store_explicit(&level_cap, (int)cap, memory_order_relaxed);
    tdm_half_level s = tdm_half_level_supported();
    return cap < s ? cap : s;
}

static tdm_half_level level_now(void) {
    int cap = atomic_load_explicit(&level_cap, memory_order_relaxed);
    tdm_half_level s = tdm_half_level_supported();
    return (int)s < cap ? s : (tdm_half_level)cap;
}

const char *tdm_half_isa(void) {
    switch (level_now()) {
    case TDM_HALF_AVX512_BF16:
        return "avx512_bf16+f16c";
    case TDM_HALF_F16C:
        return "f16c";
    case TDM_HALF_SCALAR:
        break;
    }
    return "scalar";
}

/* ---- scalar arrays ---- */

static void bf16_from_f32_scalar(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = tdm_bf16_from_float(src[i]);
}

static void f16_from_f32_scalar(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = tdm_f16_from_float(src[i]);
}

static void f16_to_f32_scalar(float *dst, const uint16_t *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = tdm_f16_to_float(src[i]);
}

/* ---- x86 instructions ---- */

#ifdef HALF_X86
/* F16C under flush-to-zero (tdm_set_flush_denormal): the hardware we test on ignores
 * MXCSR.FTZ and DAZ in these conversions, but qemu's emulation flushes fp16 subnormals, and
 * no manual we have read promises either way; so the F16C loops run with both bits clear. */
#define MXCSR_FTZ_DAZ 0x8040u

static unsigned int mxcsr_clear_flush(void) {
    unsigned int csr = _mm_getcsr();
    if (csr & MXCSR_FTZ_DAZ) _mm_setcsr(csr & ~MXCSR_FTZ_DAZ);
    return csr;
}

static void mxcsr_restore(unsigned int csr) {
    if (csr & MXCSR_FTZ_DAZ) _mm_setcsr(csr);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void
bf16_from_f32_avx512(uint16_t *dst, const float *src, size_t n) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i inf = _mm512_set1_epi32(0x7F800000);
    const __m512i max_denormal = _mm512_set1_epi32(0x007FFFFE); /* |x| - 1 below: denormal */
    const __m512i one = _mm512_set1_epi32(1);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 lo = _mm512_loadu_ps(src + i), hi = _mm512_loadu_ps(src + i + 16);
        __m512i alo = _mm512_and_si512(_mm512_castps_si512(lo), abs_mask);
        __m512i ahi = _mm512_and_si512(_mm512_castps_si512(hi), abs_mask);
        __mmask16 special = _mm512_cmpgt_epu32_mask(alo, inf) | _mm512_cmpgt_epu32_mask(ahi, inf) |
                            _mm512_cmple_epu32_mask(_mm512_sub_epi32(alo, one), max_denormal) |
                            _mm512_cmple_epu32_mask(_mm512_sub_epi32(ahi, one), max_denormal);
        if (special) {
            bf16_from_f32_scalar(dst + i, src + i, 32);
            continue;
        }
        __m512bh b = _mm512_cvtne2ps_pbh(hi, lo); /* lanes 0-15 from lo, 16-31 from hi */
        _mm512_storeu_si512((void *)(dst + i), (__m512i)b);
    }
    bf16_from_f32_scalar(dst + i, src + i, n - i);
}

__attribute__((target("avx,f16c"))) static void f16_from_f32_f16c(uint16_t *dst, const float *src,
                                                                  size_t n) {
    unsigned int csr = mxcsr_clear_flush();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(void *)(dst + i), h);
    }
    mxcsr_restore(csr);
    f16_from_f32_scalar(dst + i, src + i, n - i);
}

__attribute__((target("avx,f16c"))) static void f16_to_f32_f16c(float *dst, const uint16_t *src,
                                                                size_t n) {
    unsigned int csr = mxcsr_clear_flush();
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(
            dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(src + i))));
    mxcsr_restore(csr);
    f16_to_f32_scalar(dst + i, src + i, n - i);
}
#endif

/* ---- the public arrays ---- */

void tdm_bf16_from_f32(uint16_t *dst, const float *src, size_t n) {
#ifdef HALF_X86
    if (level_now() >= TDM_HALF_AVX512_BF16) {
        bf16_from_f32_avx512(dst, src, n);
        return;
    }
#endif
    bf16_from_f32_scalar(dst, src, n);
}

void tdm_bf16_to_f32(float *dst, const uint16_t *src, size_t n) {
    /* a shift: the compiler's vectorised loop is all there is to it */
    for (size_t i = 0; i < n; i++) dst[i] = tdm_bf16_to_float(src[i]);
}

void tdm_f16_from_f32(uint16_t *dst, const float *src, size_t n) {
#ifdef HALF_X86
    if (level_now() >= TDM_HALF_F16C) {
        f16_from_f32_f16c(dst, src, n);
        return;
    }
#endif
    f16_from_f32_scalar(dst, src, n);
}

void tdm_f16_to_f32(float *dst, const uint16_t *src, size_t n) {
#ifdef HALF_X86
    if (level_now() >= TDM_HALF_F16C) {
        f16_to_f32_f16c(dst, src, n);
        return;
    }
#endif
    f16_to_f32_scalar(dst, src, n);
}
