/* 2-D max and average pooling (NCHW, f32), with PyTorch's window rules.
 *
 * Every (image, channel) plane is independent: the kernels walk planes, and inside a plane
 * each output pixel reads its window. Windows are clipped to the image; the output size
 * (ceil_mode included) was fixed by the op, and the kernels take it from y's shape.
 */
#include "backend/conv_geom.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_lowp.h"
#include "backend/cpu/cpu_isa.h"

#include <assert.h>
#include <math.h>
#include <string.h>

/* The contract: the op (nn/functional_pool.c) refused an input that is not 4-D and hands
 * contiguous [N, C, H, W] tensors of equal N and C. */
static inline bool planes_match(const tdm_tensor *a, const tdm_tensor *b) {
    return a->ndim == 4 && b->ndim == 4 && a->shape[0] == b->shape[0] &&
           a->shape[1] == b->shape[1] && tdm_is_contiguous(a) && tdm_is_contiguous(b);
}

/* One step of PyTorch's scan: v replaces the best so far if larger or NaN. Branch-free:
 * with random data the comparison is unpredictable, and a branch costs more than the work. */
#define MAX_STEP(v, i)                                                                             \
    do {                                                                                           \
        float v_ = (v);                                                                            \
        bool t_ = (v_ > best) | (v_ != v_);                                                        \
        best = t_ ? v_ : best;                                                                     \
        bi = t_ ? (i) : bi;                                                                        \
    } while (0)

/* One plane of max pooling. The first index of a window starts the search and NaN wins, as in
 * PyTorch, so the gradient goes where PyTorch sends it. */
TDM_CPU_CLONES
static void max_plane(const float *x, float *y, int32_t *idx, const pool_geom *g) {
    for (int64_t oh = 0; oh < g->ho; oh++) {
        int64_t h0 = oh * g->sh - g->ph;
        int64_t h1 = h0 + (g->kh - 1) * g->dh + 1;
        if (h1 > g->h) h1 = g->h;
        while (h0 < 0) h0 += g->dh;
        for (int64_t ow = 0; ow < g->wo; ow++) {
            int64_t w0 = ow * g->sw - g->pw;
            int64_t w1 = w0 + (g->kw - 1) * g->dw + 1;
            if (w1 > g->w) w1 = g->w;
            while (w0 < 0) w0 += g->dw;
            int64_t bi = h0 * g->w + w0;
            float best = -INFINITY;
            for (int64_t ih = h0; ih < h1; ih += g->dh) {
                const float *row = x + ih * g->w;
                for (int64_t iw = w0; iw < w1; iw += g->dw) MAX_STEP(row[iw], ih * g->w + iw);
            }
            y[oh * g->wo + ow] = best;
            idx[oh * g->wo + ow] = (int32_t)bi; /* the op refused planes of 2^31 pixels */
        }
    }
}

/* Window (2oh, 2ow) of the common 2x2, stride 2, unpadded pool, every window inside the image.
 * Windows without NaN (the sum of four numbers is NaN if one is, or for inf - inf: then the
 * exact scan runs too) take a compare-and-select chain the compiler turns into blends and
 * cmovs. */
static inline void max_window_2x2(const float *x, int64_t w, int64_t oh, int64_t ow, float *y,
                                  int32_t *idx) {
    const float *r0 = x + 2 * oh * w, *r1 = r0 + w;
    int64_t c = 2 * ow, i0 = 2 * oh * w + c, i1 = i0 + w;
    float a = r0[c], b = r0[c + 1], d = r1[c], e = r1[c + 1];
    float best = a;
    int64_t bi = i0;
    if (a + b + d + e == a + b + d + e) {
        bi = b > best ? i0 + 1 : bi;
        best = b > best ? b : best;
        bi = d > best ? i1 : bi;
        best = d > best ? d : best;
        bi = e > best ? i1 + 1 : bi;
        best = e > best ? e : best;
    } else {
        best = -INFINITY;
        MAX_STEP(a, i0);
        MAX_STEP(b, i0 + 1);
        MAX_STEP(d, i1);
        MAX_STEP(e, i1 + 1);
    }
    *y = best;
    *idx = (int32_t)bi;
}

TDM_CPU_CLONES
static void max_plane_2x2(const float *x, float *y, int32_t *idx, const pool_geom *g) {
    /* in locals: the stores through idx could alias *g, which would reload it every pixel
     * (much slower where this function is not inlined: bench/RESULTS.md, "Figures behind the code")
     */
    const int64_t ho = g->ho, wo = g->wo, w = g->w;
    for (int64_t oh = 0; oh < ho; oh++)
        for (int64_t ow = 0; ow < wo; ow++)
            max_window_2x2(x, w, oh, ow, y + oh * wo + ow, idx + oh * wo + ow);
}

#ifdef TDM_HAVE_AVX512_CODE
#include <immintrin.h>

TDM_AVX2_BEGIN

/* The first k (1..8) of eight lanes: a load or store mask (the sign bits). */
static inline __m256i first_lanes(int k) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Windows (2oh, 2ow .. 2ow + 2(k - 1)) at once, k of them (1..8; fewer than eight where a row
 * ends: the CNN's second pool has seven a row): the even and odd columns of the two rows are
 * the windows' four pixels, compared in the scalar chain's order (ties keep the first).
 * Returns false, writing nothing, when a window holds NaN (the scalar scan then runs). */
static inline bool max_windows8_2x2(const float *x, int64_t w, int64_t oh, int64_t ow, int k,
                                    float *y, int32_t *idx) {
    const float *r0 = x + 2 * oh * w + 2 * ow, *r1 = r0 + w;
    __m256 p0, p1, q0, q1;
    if (k == 8) {
        p0 = _mm256_loadu_ps(r0), p1 = _mm256_loadu_ps(r0 + 8);
        q0 = _mm256_loadu_ps(r1), q1 = _mm256_loadu_ps(r1 + 8);
    } else { /* masked loads read no pixel past the row's 2k (lanes left out are 0: no NaN) */
        __m256i m0 = first_lanes(2 * k), m1 = first_lanes(2 * k - 8);
        p0 = _mm256_maskload_ps(r0, m0), p1 = _mm256_maskload_ps(r0 + 8, m1);
        q0 = _mm256_maskload_ps(r1, m0), q1 = _mm256_maskload_ps(r1 + 8, m1);
    }
    /* lanes 0, 2, 4, 6 of each, then the odd ones; permuted back to window order below */
    __m256 a = _mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(2, 0, 2, 0));
    __m256 b = _mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(3, 1, 3, 1));
    __m256 d = _mm256_shuffle_ps(q0, q1, _MM_SHUFFLE(2, 0, 2, 0));
    __m256 e = _mm256_shuffle_ps(q0, q1, _MM_SHUFFLE(3, 1, 3, 1));
    __m256 sum = _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(d, e));
    if (_mm256_movemask_ps(_mm256_cmp_ps(sum, sum, _CMP_UNORD_Q))) return false;
    __m256 best = a, bi = _mm256_setzero_ps(); /* bi: the winner's offset, as int32 bits */
    __m256 m = _mm256_cmp_ps(b, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, b, m);
    bi = _mm256_blendv_ps(bi, _mm256_castsi256_ps(_mm256_set1_epi32(1)), m);
    m = _mm256_cmp_ps(d, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, d, m);
    bi = _mm256_blendv_ps(bi, _mm256_castsi256_ps(_mm256_set1_epi32((int)w)), m);
    m = _mm256_cmp_ps(e, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, e, m);
    bi = _mm256_blendv_ps(bi, _mm256_castsi256_ps(_mm256_set1_epi32((int)w + 1)), m);
    /* shuffle_ps left the windows in order 0 1 4 5 | 2 3 6 7 (per 128-bit lane) */
    __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    best = _mm256_permutevar8x32_ps(best, order);
    __m256i off = _mm256_permutevar8x32_epi32(_mm256_castps_si256(bi), order);
    int32_t i0 = (int32_t)(2 * oh * w + 2 * ow);
    __m256i at =
        _mm256_add_epi32(_mm256_set1_epi32(i0), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    at = _mm256_add_epi32(at, off);
    if (k == 8) {
        _mm256_storeu_ps(y, best);
        _mm256_storeu_si256((__m256i *)idx, at);
    } else {
        __m256i m32 = first_lanes(k);
        _mm256_maskstore_ps(y, m32, best);
        _mm256_maskstore_epi32(idx, m32, at);
    }
    return true;
}

/* max_plane_2x2 eight windows at a time, the rest of a row (the CNN's first pool has 14 a
 * row, its second 7) in one masked step; the scalar chain for windows holding NaN. */
static void max_plane_2x2_256(const float *x, float *y, int32_t *idx, const pool_geom *g) {
    const int64_t ho = g->ho, wo = g->wo, w = g->w;
    for (int64_t oh = 0; oh < ho; oh++)
        for (int64_t ow = 0; ow < wo; ow += 8) {
            int k = wo - ow < 8 ? (int)(wo - ow) : 8;
            if (!max_windows8_2x2(x, w, oh, ow, k, y + oh * wo + ow, idx + oh * wo + ow))
                for (int64_t j = ow; j < ow + k; j++)
                    max_window_2x2(x, w, oh, j, y + oh * wo + j, idx + oh * wo + j);
        }
}

TDM_AVX2_END

/* AVX-512: sixteen windows a step, the rows' even and odd columns gathered by one two-source
 * permute each (the AVX2 step above takes eight, and a 14-window row in two steps). */
TDM_AVX512_BEGIN

/* Windows whose top row is (p0, p1) (32 columns: 2l, 2l + 1 are window l's) and bottom row
 * (q0, q1), compared in the scalar chain's order: lanes m of the winners' values and plane
 * offsets (base + 0, 1, w or w + 1), packed to the front, go to y and idx. Returns false,
 * writing nothing, when a window holds NaN. */
static inline bool max_windows16_2x2(__m512 p0, __m512 p1, __m512 q0, __m512 q1, __m512i base,
                                     int32_t w, __mmask16 m, float *y, int32_t *idx) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
    __m512 a = _mm512_permutex2var_ps(p0, ev, p1), b = _mm512_permutex2var_ps(p0, od, p1);
    __m512 d = _mm512_permutex2var_ps(q0, ev, q1), e = _mm512_permutex2var_ps(q0, od, q1);
    __m512 sum = _mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(d, e));
    if (_mm512_mask_cmp_ps_mask(m, sum, sum, _CMP_UNORD_Q)) return false;
    __m512 best = a;
    __m512i off = _mm512_setzero_si512();
    __mmask16 k = _mm512_cmp_ps_mask(b, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, k, b);
    off = _mm512_mask_mov_epi32(off, k, _mm512_set1_epi32(1));
    k = _mm512_cmp_ps_mask(d, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, k, d);
    off = _mm512_mask_mov_epi32(off, k, _mm512_set1_epi32(w));
    k = _mm512_cmp_ps_mask(e, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, k, e);
    off = _mm512_mask_mov_epi32(off, k, _mm512_set1_epi32(w + 1));
    __mmask16 out = (__mmask16)((1u << __builtin_popcount(m)) - 1);
    _mm512_mask_storeu_ps(y, out, _mm512_maskz_compress_ps(m, best));
    _mm512_mask_storeu_epi32(idx, out, _mm512_maskz_compress_epi32(m, _mm512_add_epi32(base, off)));
    return true;
}

/* max_plane_2x2 sixteen windows a step: a row's in steps of 16 (the CNN's first pool: 14 a
 * row, one step), or two rows a step where a row has at most 8 (its second pool: 7); the
 * scalar chain for a step holding NaN. */
static void max_plane_2x2_512(const float *x, float *y, int32_t *idx, const pool_geom *g) {
    const int64_t ho = g->ho, wo = g->wo, w = g->w;
    const __m512 zero = _mm512_setzero_ps();
    if (wo <= 8) { /* lanes 0-7: windows of row oh, 8-15: of row oh + 1 */
        __mmask16 cols = (__mmask16)((1u << (2 * wo)) - 1), one = (__mmask16)((1u << wo) - 1);
        /* window l's first pixel: column 2l of row 0 (lanes 0-7) or of row 2 (lanes 8-15) */
        const __m512i col = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
        __m512i at = _mm512_add_epi32(col, _mm512_maskz_set1_epi32(0xFF00, (int32_t)(2 * w)));
        for (int64_t oh = 0; oh < ho; oh += 2) {
            bool two = oh + 1 < ho;
            const float *r = x + 2 * oh * w;
            __m512 p0 = _mm512_maskz_loadu_ps(cols, r), q0 = _mm512_maskz_loadu_ps(cols, r + w);
            __m512 p1 = two ? _mm512_maskz_loadu_ps(cols, r + 2 * w) : zero;
            __m512 q1 = two ? _mm512_maskz_loadu_ps(cols, r + 3 * w) : zero;
            __m512i base = _mm512_add_epi32(at, _mm512_set1_epi32((int32_t)(2 * oh * w)));
            __mmask16 m = two ? (__mmask16)(one | one << 8) : one;
            if (!max_windows16_2x2(p0, p1, q0, q1, base, (int32_t)w, m, y + oh * wo, idx + oh * wo))
                for (int64_t i = oh; i < oh + 1 + two; i++)
                    for (int64_t j = 0; j < wo; j++)
                        max_window_2x2(x, w, i, j, y + i * wo + j, idx + i * wo + j);
        }
        return;
    }
    const __m512i at = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    for (int64_t oh = 0; oh < ho; oh++)
        for (int64_t ow = 0; ow < wo; ow += 16) {
            int64_t n = wo - ow < 16 ? wo - ow : 16; /* windows: 2n columns */
            __mmask16 c0 = n >= 8 ? 0xFFFF : (__mmask16)((1u << (2 * n)) - 1);
            __mmask16 c1 = n <= 8 ? 0 : (__mmask16)((1u << (2 * n - 16)) - 1);
            const float *r = x + 2 * oh * w + 2 * ow;
            __m512 p0 = _mm512_maskz_loadu_ps(c0, r), p1 = _mm512_maskz_loadu_ps(c1, r + 16);
            __m512 q0 = _mm512_maskz_loadu_ps(c0, r + w);
            __m512 q1 = _mm512_maskz_loadu_ps(c1, r + w + 16);
            __m512i base = _mm512_add_epi32(at, _mm512_set1_epi32((int32_t)(2 * oh * w + 2 * ow)));
            __mmask16 m = (__mmask16)((1u << n) - 1);
            if (!max_windows16_2x2(p0, p1, q0, q1, base, (int32_t)w, m, y + oh * wo + ow,
                                   idx + oh * wo + ow))
                for (int64_t j = ow; j < ow + n; j++)
                    max_window_2x2(x, w, oh, j, y + oh * wo + j, idx + oh * wo + j);
        }
}

TDM_AVX512_END
#endif

int tdm_cpu_max_pool2d(tdm_tensor *y, tdm_tensor *idx, const tdm_tensor *x,
                       const tdm_pool2d_args *args) {
    if (tdm_cpu_lowp_any(2, (const tdm_tensor *[]){y, x}))
        return tdm_cpu_lowp_max_pool2d(y, idx, x, args);
    assert(planes_match(x, y) && planes_match(x, idx) && idx->dtype == TDM_I32);
    pool_geom g = tdm_pool_geom(x, y, args);
    const float *xp = tdm_data_ptr(x);
    float *yp = tdm_data_ptr(y);
    int32_t *ip = tdm_data_ptr(idx);
    bool fast = g.kh == 2 && g.kw == 2 && g.sh == 2 && g.sw == 2 && g.ph == 0 && g.pw == 0 &&
                g.dh == 1 && g.dw == 1 && 2 * g.ho <= g.h && 2 * g.wo <= g.w;
    int64_t in_plane = g.h * g.w, out_plane = g.ho * g.wo;
    void (*plane_2x2)(const float *, float *, int32_t *, const pool_geom *) = max_plane_2x2;
#ifdef TDM_HAVE_AVX512_CODE
    if (tdm_cpu_vector_bits() >= 256) plane_2x2 = max_plane_2x2_256;
    if (tdm_cpu_vector_bits() == 512) plane_2x2 = max_plane_2x2_512;
#endif
    for (int64_t p = 0; p < g.planes; p++) {
        if (fast)
            plane_2x2(xp + p * in_plane, yp + p * out_plane, ip + p * out_plane, &g);
        else
            max_plane(xp + p * in_plane, yp + p * out_plane, ip + p * out_plane, &g);
    }
    return TDM_OK;
}

/* gx (zeroed here) [N, C, H, W]: each gy element goes to the input its index names. */
TDM_CPU_CLONES
int tdm_cpu_max_pool2d_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *idx) {
    if (tdm_cpu_lowp_any(2, (const tdm_tensor *[]){gx, gy}))
        return tdm_cpu_lowp_max_pool2d_backward(gx, gy, idx);
    assert(planes_match(gx, gy) && planes_match(gx, idx));
    int64_t planes = gx->shape[0] * gx->shape[1];
    int64_t in_plane = gx->shape[2] * gx->shape[3], out_plane = gy->shape[2] * gy->shape[3];
    float *gxp = tdm_data_ptr(gx);
    const float *gyp = tdm_data_ptr(gy);
    const int32_t *ip = tdm_data_ptr(idx);
    for (int64_t p = 0; p < planes; p++) {
        float *d = gxp + p * in_plane;
        const float *s = gyp + p * out_plane;
        const int32_t *ix = ip + p * out_plane;
        /* zeroed a plane at a time, so the scatter finds it in L1: one pass over gx (the
         * first pool's is 6.4 MB a batch of 64), not two */
        memset(d, 0, (size_t)in_plane * sizeof(float));
        for (int64_t q = 0; q < out_plane; q++) {
            if (ix[q] < 0 || ix[q] >= in_plane)
                return tdm_raise(TDM_ERR_ARG,
                                 "cpu max_pool2d_backward: index %lld outside a plane of %lld",
                                 (long long)ix[q], (long long)in_plane);
            d[ix[q]] += s[q];
        }
    }
    return TDM_OK;
}

/* The clipped window of output (oh, ow) and its divisor, as PyTorch computes them. Returns
 * false for a window with no input pixel (its output is 0). */
static bool avg_window(const pool_geom *g, int64_t oh, int64_t ow, int64_t *h0, int64_t *h1,
                       int64_t *w0, int64_t *w1, float *inv) {
    int64_t hs = oh * g->sh - g->ph, ws = ow * g->sw - g->pw;
    int64_t he = hs + g->kh, we = ws + g->kw;
    if (he > g->h + g->ph) he = g->h + g->ph;
    if (we > g->w + g->pw) we = g->w + g->pw;
    int64_t pool = (he - hs) * (we - ws); /* padding counts, beyond it does not */
    if (hs < 0) hs = 0;
    if (ws < 0) ws = 0;
    if (he > g->h) he = g->h;
    if (we > g->w) we = g->w;
    if (hs >= he || ws >= we) return false;
    *h0 = hs, *h1 = he, *w0 = ws, *w1 = we;
    *inv = 1.0f / (float)(g->include_pad ? pool : (he - hs) * (we - ws));
    return true;
}

TDM_CPU_CLONES
int tdm_cpu_avg_pool2d(tdm_tensor *y, const tdm_tensor *x, const tdm_pool2d_args *args) {
    if (tdm_cpu_lowp_any(2, (const tdm_tensor *[]){y, x}))
        return tdm_cpu_lowp_avg_pool2d(y, x, args);
    assert(planes_match(x, y));
    pool_geom g = tdm_pool_geom(x, y, args);
    const float *xp = tdm_data_ptr(x);
    float *yp = tdm_data_ptr(y);
    for (int64_t p = 0; p < g.planes; p++) {
        const float *xs = xp + p * g.h * g.w;
        float *ys = yp + p * g.ho * g.wo;
        for (int64_t oh = 0; oh < g.ho; oh++)
            for (int64_t ow = 0; ow < g.wo; ow++) {
                int64_t h0, h1, w0, w1;
                float inv;
                float acc = 0;
                if (avg_window(&g, oh, ow, &h0, &h1, &w0, &w1, &inv)) {
                    for (int64_t ih = h0; ih < h1; ih++)
                        for (int64_t iw = w0; iw < w1; iw++) acc += xs[ih * g.w + iw];
                    acc *= inv;
                }
                ys[oh * g.wo + ow] = acc;
            }
    }
    return TDM_OK;
}

/* gx (zeroed here): each gy element spread evenly over its window. */
TDM_CPU_CLONES
int tdm_cpu_avg_pool2d_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_pool2d_args *args) {
    if (tdm_cpu_lowp_any(2, (const tdm_tensor *[]){gx, gy}))
        return tdm_cpu_lowp_avg_pool2d_backward(gx, gy, args);
    assert(planes_match(gx, gy));
    pool_geom g = tdm_pool_geom(gx, gy, args);
    float *gxp = tdm_data_ptr(gx);
    const float *gyp = tdm_data_ptr(gy);
    for (int64_t p = 0; p < g.planes; p++) {
        float *gs = gxp + p * g.h * g.w;
        const float *ys = gyp + p * g.ho * g.wo;
        memset(gs, 0, (size_t)(g.h * g.w) * sizeof(float)); /* a plane at a time, as above */
        for (int64_t oh = 0; oh < g.ho; oh++)
            for (int64_t ow = 0; ow < g.wo; ow++) {
                int64_t h0, h1, w0, w1;
                float inv;
                if (!avg_window(&g, oh, ow, &h0, &h1, &w0, &w1, &inv)) continue;
                float v = ys[oh * g.wo + ow] * inv;
                for (int64_t ih = h0; ih < h1; ih++)
                    for (int64_t iw = w0; iw < w1; iw++) gs[ih * g.w + iw] += v;
            }
    }
    return TDM_OK;
}
