/* c [m, n] = alpha * a [m, k] @ b [n, k]^T + beta * c on one AVX-512 core, b never copied.
 *
 * Why: a linear layer's forward is this product with b its weights [out, in], and a GEMM
 * library packs b into its own panels on every call, which for b^T is a transposing copy of
 * the whole weight matrix. oneDNN 2.6.3 (and MKL) run the MLP's first layer, 64 x 256 x 784,
 * well below a @ b with b [k, n] on one core of the Xeon (family 6 model 207), with b in cache
 * and more so in a training step, where the optimizer has just pushed the weights out of L2
 * (bench/RESULTS.md, "Figures behind the code"). Here b is read once, in place, and the small side
 * is transposed instead:
 *
 *   per chunk of up to 64 rows of a (vw = 16, 32, 48 or 64 lanes; lanes past m are zeros)
 *     at [k, vw] = the chunk of a transposed (16 x 16 register transposes)
 *     ct [n, vw] = b @ at: R rows of b at a time, each element broadcast against the vw / 16
 *                  vectors of at's row kk, R * vw / 16 accumulators in registers
 *     c chunk    = alpha * ct^T + beta * c   (transposed back 16 x 16)
 *
 * at (196 KiB for k 784) stays in L2; each line of b serves 16 steps of kk. The MLP's first
 * layer runs faster than oneDNN's, with b in cache and in its training step (bench/RESULTS.md,
 * "Issue 15: A @ B^T without packing B, the loader's ring"; the rest of its time is reading
 * the batch, which the loader wrote on another core). cpu_gemm.c decides when this runs
 * (nt_pays). */
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_isa.h"
#include "core/core.h" /* tdm_storage_new: at and ct come from the caching allocator */

#ifdef TDM_HAVE_AVX512_CODE
#include <immintrin.h>

TDM_AVX512_BEGIN

/* r[0..15] (rows) := their transpose (r[j] lane i = old r[i] lane j). */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    /* each 128-bit lane q of r[i] now holds column 4q + (i % 4) of rows 4 (i / 4) .. + 3 */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

static inline __mmask16 lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

/* at [k, vw] = rows [0, m) of a (m <= vw), zeros in the lanes past m. */
static void transpose_in(float *at, int vw, const float *a, int64_t lda, int64_t m, int64_t k) {
    for (int64_t i0 = 0; i0 < vw; i0 += 16)
        for (int64_t k0 = 0; k0 < k; k0 += 16) {
            __mmask16 km = lanes(k - k0);
            __m512 r[16];
            for (int64_t i = 0; i < 16; i++)
                r[i] = i0 + i < m ? _mm512_maskz_loadu_ps(km, a + (i0 + i) * lda + k0)
                                  : _mm512_setzero_ps();
            transpose16(r);
            for (int64_t j = 0; j < 16 && k0 + j < k; j++)
                _mm512_store_ps(at + (k0 + j) * vw + i0, r[j]);
        }
}

/* c [m, n] = alpha * ct^T + beta * c, ct [n, vw] (rows up to n rounded up to 16 readable). */
static void transpose_out(float *c, int64_t ldc, const float *ct, int vw, int64_t m, int64_t n,
                          float alpha, float beta) {
    __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
    for (int64_t i0 = 0; i0 < m; i0 += 16)
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            __mmask16 jm = lanes(n - j0);
            __m512 r[16];
            for (int64_t j = 0; j < 16; j++) r[j] = _mm512_load_ps(ct + (j0 + j) * vw + i0);
            transpose16(r);
            for (int64_t i = 0; i < 16 && i0 + i < m; i++) {
                float *ci = c + (i0 + i) * ldc + j0;
                __m512 v = _mm512_mul_ps(va, r[i]);
                if (beta != 0.0f) v = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(jm, ci), v);
                _mm512_mask_storeu_ps(ci, jm, v);
            }
        }
}

/* ct rows [j, j + R) = b rows [j, j + R) @ at, V = vw / 16 vectors a row; rows of b past n
 * repeat row n - 1 (read, never stored). Fully unrolled: the R * V accumulators and the V
 * vectors of at's row stay in registers (GCC at -O3). */
#define NT_TILE(V, R)                                                                              \
    static void tile_##V##x##R(float *ct, const float *at, const float *b, int64_t ldb, int64_t j, \
                               int64_t n, int64_t k) {                                             \
        const float *br[R];                                                                        \
        for (int r = 0; r < R; r++) br[r] = b + (j + r < n ? j + r : n - 1) * ldb;                 \
        __m512 acc[R][V];                                                                          \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                       \
            _Pragma("GCC unroll 4") for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();   \
        for (int64_t kk = 0; kk < k; kk++) {                                                       \
            __m512 x[V];                                                                           \
            _Pragma("GCC unroll 4") for (int v = 0; v < V; v++) x[v] =                             \
                _mm512_load_ps(at + kk * (16 * V) + 16 * v);                                       \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                 \
                __m512 s = _mm512_set1_ps(br[r][kk]);                                              \
                _Pragma("GCC unroll 4") for (int v = 0; v < V; v++) acc[r][v] =                    \
                    _mm512_fmadd_ps(s, x[v], acc[r][v]);                                           \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R && j + r < n; r++)                                                   \
            for (int v = 0; v < V; v++)                                                            \
                _mm512_store_ps(ct + (j + r) * (16 * V) + 16 * v, acc[r][v]);                      \
    }
NT_TILE(1, 12)
NT_TILE(2, 12)
NT_TILE(3, 8)
NT_TILE(4, 6)
#undef NT_TILE

/* ct [n, vw] = b @ at. */
static void product(float *ct, const float *at, int vw, const float *b, int64_t ldb, int64_t n,
                    int64_t k) {
    switch (vw / 16) {
    case 1:
        for (int64_t j = 0; j < n; j += 12) tile_1x12(ct, at, b, ldb, j, n, k);
        break;
    case 2:
        for (int64_t j = 0; j < n; j += 12) tile_2x12(ct, at, b, ldb, j, n, k);
        break;
    case 3:
        for (int64_t j = 0; j < n; j += 8) tile_3x8(ct, at, b, ldb, j, n, k);
        break;
    default:
        for (int64_t j = 0; j < n; j += 6) tile_4x6(ct, at, b, ldb, j, n, k);
    }
}

TDM_AVX512_END

int tdm_cpu_sgemm_nt(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                     const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
    if (tdm_cpu_vector_bits() != 512 || m <= 0 || n <= 0 || k <= 0) return -1;
    int vw = m >= 64 ? 64 : (int)(m + 15) / 16 * 16;
    int64_t n16 = (n + 15) / 16 * 16;
    tdm_storage *s = tdm_storage_new(sizeof(float) * (size_t)(vw * (k + n16)), tdm_cpu(0));
    if (!s) return -1;
    float *at = s->data, *ct = at + vw * k; /* the allocator's blocks are 64-byte aligned */
    for (int64_t i0 = 0; i0 < m; i0 += 64) {
        int64_t rows = m - i0 < 64 ? m - i0 : 64;
        int w = rows == 64 ? 64 : (int)(rows + 15) / 16 * 16;
        transpose_in(at, w, a + i0 * lda, lda, rows, k);
        product(ct, at, w, b, ldb, n, k);
        transpose_out(c + i0 * ldc, ldc, ct, w, rows, n, alpha, beta);
    }
    tdm_storage_release(s);
    return 0;
}
#else
int tdm_cpu_sgemm_nt(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                     const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
    (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b, (void)ldb, (void)beta;
    (void)c, (void)ldc;
    return -1;
}
#endif
