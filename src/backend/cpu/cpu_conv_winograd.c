/* Winograd F(2x2, 3x3) for stride-1, undilated, ungrouped 3x3 convolutions (NCHW, f32).
 *
 * Each 2x2 block of output (a tile) is A^T [sum_ci (G g G^T) . (B^T d B)] A, where d is the 4x4
 * input patch under the tile and g a 3x3 filter: 16 products per tile and channel pair instead
 * of 36, so the GEMMs do 2.25x less arithmetic than im2col's. With the 16 transformed points xi
 * kept apart, the channel sums are 16 GEMMs per chunk of images:
 *
 *   forward      M[xi] [C2, T] = U[xi] [C2, C1] @ V[xi] [C1, T]      (T = tiles in the chunk)
 *   weight grad  dU[xi] [Cout, Cin] += dM[xi] [Cout, T] @ V[xi]^T, then gw = G^T dU G
 *   input grad   dV[xi] [Cin, T] = U[xi]^T @ dM[xi], then B dV B^T added at each tile's patch
 *
 * with dM = A dY A^T, the gradient of the tiles' M.
 *
 * The transforms are vectorised along a tile row: lane l of a 16-wide load at column 16k - pad
 * holds that column + l, so the even lanes are tiles 8k..8k+7. The loads are masked: lanes
 * outside the plane (the padding, the columns past a partial tile) read as zeros. The
 * transforms exist twice, for AVX-512 (one 16-lane vector) and for AVX2 (two 8-lane halves whose
 * even lanes are gathered into the 8 tiles); everything else (filter transforms, chunks, GEMMs) is
 * ISA-independent and reaches the transforms through a table picked once per call.
 * F(2x2, 3x3) is well conditioned (its transforms only add, subtract and halve): its error is
 * that of a reordered sum. Scratch (V, M: 16 (C1 + C2) floats per tile) is bounded by working
 * on a few images at a time; a plane too large for the budget goes to im2col instead.
 */
#include "backend/cpu/cpu_conv.h"
#include "backend/cpu/cpu_isa.h"

#include <string.h>

#ifdef TDM_HAVE_AVX512_CODE
/* floats of V and M together per chunk of images: well inside L2 (two images of the CNN's
 * second layer; measured: one to two images are fastest, five 5% and ten 40% slower) */
#define WINO_CHUNK_FLOATS (192 * 1024)
/* tiles per chunk at least (chunk_images) */
#define WINO_MIN_TILES 64
/* a plane is taken only if one image's V and M fit in this many floats */
#define WINO_IMAGE_FLOATS (4 * 1024 * 1024)

/* One correlation out [N, C2, H2, W2] = in [N, C1, H1, W1] (zero-padded by ph, pw) * filters. */
typedef struct {
    int64_t c1, h1, w1, ph, pw; /* input planes and padding (top/left) */
    int64_t c2, h2, w2;         /* output planes */
    int64_t ty, tx, tt;         /* tile grid ceil(H2/2) x ceil(W2/2), tt = ty * tx */
    int64_t kc;                 /* 8-tile vectors per tile row, ceil(tx / 8) */
} wgeom;

static wgeom wgeom_make(int64_t c1, int64_t h1, int64_t w1, int64_t ph, int64_t pw, int64_t c2,
                        int64_t h2, int64_t w2) {
    wgeom g = {c1, h1, w1, ph, pw, c2, h2, w2, (h2 + 1) / 2, (w2 + 1) / 2, 0, 0};
    g.tt = g.ty * g.tx;
    g.kc = (g.tx + 7) / 8;
    return g;
}

/* Whether the 8-tile store at tile row ty, block k may write past the row's last tile: the lanes
 * past it land on the first tiles of the next tile row, which the same call writes afterwards
 * (ty is the outer loop). Only a plane's last row then needs a masked store: on the CNN's
 * 14-wide planes (7 tiles) every store would be masked otherwise, and plain 8-float stores
 * made its second layer's forward and backward 6% faster on AVX-512 (bench_conv). */
static inline bool spill_ok(const wgeom *g, int64_t ty, int64_t k) {
    return ty + 1 < g->ty && 8 * (k + 1) - g->tx <= g->tx;
}

static float *scratch(int64_t n, tdm_device dev) {
    tdm_tensor *t = tdm_tensor_alloc(TDM_SHAPE(n > 0 ? n : 1), TDM_F32, dev);
    return t ? (float *)tdm_data_ptr(t) : NULL;
}

/* The transforms of one instruction set (the vectorised loops over a plane). */
typedef struct {
    void (*input_transform)(const float *x, const wgeom *g, float *v, int64_t xs);
    void (*output_transform)(const float *mm, int64_t xs, const wgeom *g, float bias, float *out);
    void (*grad_transform)(const float *dy, const wgeom *g, float *v, int64_t xs);
    void (*input_adjoint)(const float *dv, int64_t xs, const wgeom *g, float *gx);
} wino_kernels;

/* AVX-512 code, reached only where tdm_cpu_vector_bits() says 512 */
TDM_AVX512_BEGIN

/* Lanes of tiles 8k.. of a tile row that exist. */
static inline __mmask16 tile_mask(int64_t tx, int64_t k) {
    int64_t n = tx - 8 * k;
    return n >= 8 ? (__mmask16)0xFF : (__mmask16)((1u << n) - 1);
}

/* Tiles 8k.. (v's lanes 0-7) to d: all eight where spill_ok, else the lanes of m. */
static inline void store_tiles_512(float *d, __mmask16 m, __m512 v, bool spill) {
    if (spill)
        _mm256_storeu_ps(d, _mm512_castps512_ps256(v));
    else
        _mm512_mask_storeu_ps(d, m, v);
}

/* V[xi][t] (xi stride xs) = (B^T d B)[xi] for every tile t = ty * tx + tx of the plane x [H1, W1],
 * zero-padded by ph, pw. The patch rows are masked loads from x itself: a copy into a padded
 * buffer first had every load wait for the masked stores before it (no store forwarding from
 * them), a third of this function's time. */
static void input_transform_512(const float *x, const wgeom *g, float *v, int64_t xs) {
    const __m512i even = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
    for (int64_t ty = 0; ty < g->ty; ty++)
        for (int64_t k = 0; k < g->kc; k++) {
            int64_t c = 16 * k - g->pw; /* column of lane 0 */
            __mmask16 cm[4], m = tile_mask(g->tx, k);
            bool spill = spill_ok(g, ty, k);
            for (int j = 0; j < 4; j++) cm[j] = tdm_pixel_lanes(c + j, g->w1);
            __m512 h[4][4]; /* h[i][j]: row i of the patch times B, lane = column c + l */
            for (int i = 0; i < 4; i++) {
                int64_t y = 2 * ty + i - g->ph;
                bool in = y >= 0 && y < g->h1;
                const float *r = x + (in ? y : 0) * g->w1 + c;
                __m512 a0 = _mm512_maskz_loadu_ps(in ? cm[0] : 0, r);
                __m512 a1 = _mm512_maskz_loadu_ps(in ? cm[1] : 0, r + 1);
                __m512 a2 = _mm512_maskz_loadu_ps(in ? cm[2] : 0, r + 2);
                __m512 a3 = _mm512_maskz_loadu_ps(in ? cm[3] : 0, r + 3);
                h[i][0] = _mm512_sub_ps(a0, a2), h[i][1] = _mm512_add_ps(a1, a2);
                h[i][2] = _mm512_sub_ps(a2, a1), h[i][3] = _mm512_sub_ps(a1, a3);
            }
            float *d = v + ty * g->tx + 8 * k;
            for (int j = 0; j < 4; j++) {
                __m512 v0 = _mm512_sub_ps(h[0][j], h[2][j]), v1 = _mm512_add_ps(h[1][j], h[2][j]);
                __m512 v2 = _mm512_sub_ps(h[2][j], h[1][j]), v3 = _mm512_sub_ps(h[1][j], h[3][j]);
                store_tiles_512(d + j * xs, m, _mm512_permutexvar_ps(even, v0), spill);
                store_tiles_512(d + (4 + j) * xs, m, _mm512_permutexvar_ps(even, v1), spill);
                store_tiles_512(d + (8 + j) * xs, m, _mm512_permutexvar_ps(even, v2), spill);
                store_tiles_512(d + (12 + j) * xs, m, _mm512_permutexvar_ps(even, v3), spill);
            }
        }
}

/* out [H2, W2] = A^T M A + bias for every tile, M[xi][t] at mm + xi * xs + t. */
static void output_transform_512(const float *mm, int64_t xs, const wgeom *g, float bias,
                                 float *out) {
    /* lane 2l <- y.0[l], lane 2l + 1 <- y.1[l]: a tile's two columns side by side */
    const __m512i inter = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 b = _mm512_set1_ps(bias);
    for (int64_t ty = 0; ty < g->ty; ty++)
        for (int64_t k = 0; k < g->kc; k++) {
            __mmask16 m = tile_mask(g->tx, k), cm = tdm_pixel_lanes(16 * k, g->w2);
            const float *s = mm + ty * g->tx + 8 * k;
            __m512 s0[4], s1[4]; /* A^T applied to the rows */
            for (int j = 0; j < 4; j++) {
                __m512 q0 = _mm512_maskz_loadu_ps(m, s + j * xs);
                __m512 q1 = _mm512_maskz_loadu_ps(m, s + (4 + j) * xs);
                __m512 q2 = _mm512_maskz_loadu_ps(m, s + (8 + j) * xs);
                __m512 q3 = _mm512_maskz_loadu_ps(m, s + (12 + j) * xs);
                s0[j] = _mm512_add_ps(_mm512_add_ps(q0, q1), q2);
                s1[j] = _mm512_sub_ps(_mm512_sub_ps(q1, q2), q3);
            }
            __m512 y00 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(s0[0], s0[1]), s0[2]), b);
            __m512 y01 = _mm512_add_ps(_mm512_sub_ps(_mm512_sub_ps(s0[1], s0[2]), s0[3]), b);
            float *o = out + 2 * ty * g->w2 + 16 * k;
            _mm512_mask_storeu_ps(o, cm, _mm512_permutex2var_ps(y00, inter, y01));
            if (2 * ty + 1 < g->h2) {
                __m512 y10 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(s1[0], s1[1]), s1[2]), b);
                __m512 y11 = _mm512_add_ps(_mm512_sub_ps(_mm512_sub_ps(s1[1], s1[2]), s1[3]), b);
                _mm512_mask_storeu_ps(o + g->w2, cm, _mm512_permutex2var_ps(y10, inter, y11));
            }
        }
}

/* dM[xi][t] = (A dY A^T)[xi], the gradient of the tile's M, from the output gradient dY
 * [H2, W2] (rows and columns past H2, W2 read as zeros, so partial tiles contribute nothing). */
static void grad_transform_512(const float *dy, const wgeom *g, float *v, int64_t xs) {
    const __m512i even = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t ty = 0; ty < g->ty; ty++)
        for (int64_t k = 0; k < g->kc; k++) {
            __mmask16 cm = tdm_pixel_lanes(16 * k, g->w2), m = tile_mask(g->tx, k);
            bool spill = spill_ok(g, ty, k);
            __m512 e[2][4]; /* e[r][j]: row r of dY times A^T, lane = tile */
            for (int r = 0; r < 2; r++) {
                int64_t y = 2 * ty + r;
                __m512 a = _mm512_maskz_loadu_ps(y < g->h2 ? cm : 0,
                                                 dy + (y < g->h2 ? y : 0) * g->w2 + 16 * k);
                __m512 d0 = _mm512_permutexvar_ps(even, a), d1 = _mm512_permutexvar_ps(odd, a);
                e[r][0] = d0, e[r][1] = _mm512_add_ps(d0, d1);
                e[r][2] = _mm512_sub_ps(d0, d1), e[r][3] = _mm512_sub_ps(zero, d1);
            }
            float *d = v + ty * g->tx + 8 * k;
            for (int j = 0; j < 4; j++) {
                store_tiles_512(d + j * xs, m, e[0][j], spill);
                store_tiles_512(d + (4 + j) * xs, m, _mm512_add_ps(e[0][j], e[1][j]), spill);
                store_tiles_512(d + (8 + j) * xs, m, _mm512_sub_ps(e[0][j], e[1][j]), spill);
                store_tiles_512(d + (12 + j) * xs, m, _mm512_sub_ps(zero, e[1][j]), spill);
            }
        }
}

/* (x0, x1 - x2 + x3, x1 + x2 - x0, -x3): the transpose of input_transform's 1-D step (a0 - a2,
 * a1 + a2, a2 - a1, a1 - a3), applied to rows and then to columns by input_adjoint. */
static inline void bt_adjoint_512(__m512 x0, __m512 x1, __m512 x2, __m512 x3, __m512 *o) {
    o[0] = x0, o[1] = _mm512_add_ps(_mm512_sub_ps(x1, x2), x3);
    o[2] = _mm512_sub_ps(_mm512_add_ps(x1, x2), x0), o[3] = _mm512_sub_ps(_mm512_setzero_ps(), x3);
}

/* gx [H1, W1] = the adjoint of input_transform: every tile's B dV B^T, dV[xi][t] at
 * dv + xi * xs + t, added at its patch, what falls on the padding dropped. Patches overlap by
 * two columns and two rows: a block of 16 columns takes tiles 8k - 1 .. 8k + 7 (the one before
 * adds to its first two columns), and the tile row before leaves its last two rows in
 * registers, so every pixel is stored once and gx needs no zeroing. */
static void input_adjoint_512(const float *dv, int64_t xs, const wgeom *g, float *gx) {
    /* lanes 2j, 2j + 1 <- a[j + 1], b[j + 1] (tile 8k + j), or a[j], b[j] (the tile before) */
    const __m512i cur = _mm512_set_epi32(24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1);
    const __m512i prev = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 zero = _mm512_setzero_ps();
    const int64_t ty_n = g->ty, tx = g->tx, h = g->h1, w = g->w1, ph = g->ph;
    for (int64_t k = 0; 16 * k - g->pw < w; k++) {
        int64_t c = 16 * k - g->pw; /* the block's first column */
        __mmask16 tm = tdm_pixel_lanes(8 * k - 1, tx) & 0x1FF, cm = tdm_pixel_lanes(c, w);
        __m512 carry[2] = {zero, zero};
        for (int64_t ty = 0; ty <= ty_n; ty++) {
            __m512 r[4] = {zero, zero, zero, zero}; /* patch rows 0-3, summed over columns */
            if (ty < ty_n) {
                const float *s = dv + ty * tx + 8 * k - 1;
                __m512 dh[4][4]; /* dh[i][j]: patch row i of dV B^T's column j */
                for (int j = 0; j < 4; j++) {
                    __m512 o[4];
                    bt_adjoint_512(_mm512_maskz_loadu_ps(tm, s + j * xs),
                                   _mm512_maskz_loadu_ps(tm, s + (4 + j) * xs),
                                   _mm512_maskz_loadu_ps(tm, s + (8 + j) * xs),
                                   _mm512_maskz_loadu_ps(tm, s + (12 + j) * xs), o);
                    for (int i = 0; i < 4; i++) dh[i][j] = o[i];
                }
                for (int i = 0; i < 4; i++) {
                    __m512 d[4]; /* the patch's row i, columns 0-3, lane = tile */
                    bt_adjoint_512(dh[i][0], dh[i][1], dh[i][2], dh[i][3], d);
                    r[i] = _mm512_add_ps(_mm512_permutex2var_ps(d[0], cur, d[1]),
                                         _mm512_permutex2var_ps(d[2], prev, d[3]));
                }
            }
            for (int i = 0; i < 2; i++) { /* rows 2ty - ph + i, with the last tile row's 2 + i */
                int64_t y = 2 * ty - ph + i;
                if (y >= 0 && y < h)
                    _mm512_mask_storeu_ps(gx + y * w + c, cm, _mm512_add_ps(r[i], carry[i]));
                carry[i] = r[2 + i];
            }
        }
    }
}

TDM_AVX512_END

/* AVX2 + FMA code, reached only where tdm_cpu_vector_bits() says 256 or more: the same
 * transforms on 8-lane halves of the 16 columns. Columns 16k..16k+15 are two halves; the even
 * lanes of both, put side by side (evens()), are tiles 8k..8k+7, one 8-lane vector. */
TDM_AVX2_BEGIN

/* lanes [0, n) set, for maskload/maskstore */
static inline __m256i lanes_256(int64_t n) {
    int32_t c = n < 0 ? 0 : n > 8 ? 8 : (int32_t)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* v's lanes [0, n) to d: a plain store when all 8 are (vmaskmovps to memory is microcoded on
 * AMD's Zen, several times a store's cost, and the transforms are mostly stores) */
static inline void store_n(float *d, int64_t n, __m256i m, __m256 v) {
    if (n >= 8)
        _mm256_storeu_ps(d, v);
    else
        _mm256_maskstore_ps(d, m, v);
}

/* store_n where the lanes past n may be written (spill): they land on the first elements of
 * the next row of tiles (spill_ok) or of pixels, which the same call writes afterwards. */
static inline void store_row(float *d, int64_t n, __m256i m, __m256 v, bool spill) {
    if (spill)
        _mm256_storeu_ps(d, v);
    else
        store_n(d, n, m, v);
}

/* lanes 0, 2, 4, 6 of a, then of b */
static inline __m256 evens(__m256 a, __m256 b) {
    __m256 t = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)); /* a0 a2 b0 b2 | a4 a6 b4 b6 */
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(t), _MM_SHUFFLE(3, 1, 2, 0)));
}

static inline __m256 odds(__m256 a, __m256 b) {
    __m256 t = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(t), _MM_SHUFFLE(3, 1, 2, 0)));
}

/* Lanes l of an 8-lane load at column s of a w-wide row that hold a pixel (0 <= s + l < w), for
 * maskload: the others read as zeros, the padding (tdm_pixel_lanes' twin). */
static inline __m256i row_lanes_256(int64_t s, int64_t w) {
    __m256i c =
        _mm256_add_epi32(_mm256_set1_epi32((int32_t)s), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_and_si256(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(-1)),
                            _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)w), c));
}

static void input_transform_256(const float *x, const wgeom *g, float *v, int64_t xs) {
    const __m256i none = _mm256_setzero_si256();
    for (int64_t ty = 0; ty < g->ty; ty++)
        for (int64_t k = 0; k < g->kc; k++) {
            int64_t c = 16 * k - g->pw, nt = g->tx - 8 * k;
            __m256i cm[2][4], m = lanes_256(nt);
            for (int hf = 0; hf < 2; hf++)
                for (int j = 0; j < 4; j++) cm[hf][j] = row_lanes_256(c + 8 * hf + j, g->w1);
            __m256 o[2][16]; /* o[half][4i + j]: (B^T d B)[i][j], lane = column of the half */
            for (int hf = 0; hf < 2; hf++) {
                __m256 h[4][4]; /* h[i][j]: row i of the patch times B */
                for (int i = 0; i < 4; i++) {
                    int64_t y = 2 * ty + i - g->ph;
                    bool in = y >= 0 && y < g->h1;
                    const float *r = x + (in ? y : 0) * g->w1 + c + 8 * hf;
                    __m256 a0 = _mm256_maskload_ps(r, in ? cm[hf][0] : none);
                    __m256 a1 = _mm256_maskload_ps(r + 1, in ? cm[hf][1] : none);
                    __m256 a2 = _mm256_maskload_ps(r + 2, in ? cm[hf][2] : none);
                    __m256 a3 = _mm256_maskload_ps(r + 3, in ? cm[hf][3] : none);
                    h[i][0] = _mm256_sub_ps(a0, a2), h[i][1] = _mm256_add_ps(a1, a2);
                    h[i][2] = _mm256_sub_ps(a2, a1), h[i][3] = _mm256_sub_ps(a1, a3);
                }
                for (int j = 0; j < 4; j++) {
                    o[hf][j] = _mm256_sub_ps(h[0][j], h[2][j]);
                    o[hf][4 + j] = _mm256_add_ps(h[1][j], h[2][j]);
                    o[hf][8 + j] = _mm256_sub_ps(h[2][j], h[1][j]);
                    o[hf][12 + j] = _mm256_sub_ps(h[1][j], h[3][j]);
                }
            }
            float *d = v + ty * g->tx + 8 * k;
            bool spill = spill_ok(g, ty, k);
            for (int xi = 0; xi < 16; xi++)
                store_row(d + xi * xs, nt, m, evens(o[0][xi], o[1][xi]), spill);
        }
}

static void output_transform_256(const float *mm, int64_t xs, const wgeom *g, float bias,
                                 float *out) {
    const __m256 b = _mm256_set1_ps(bias);
    for (int64_t ty = 0; ty < g->ty; ty++)
        for (int64_t k = 0; k < g->kc; k++) {
            __m256i m = lanes_256(g->tx - 8 * k);
            __m256i lo = lanes_256(g->w2 - 16 * k), hi = lanes_256(g->w2 - 16 * k - 8);
            const float *s = mm + ty * g->tx + 8 * k;
            __m256 s0[4], s1[4]; /* A^T applied to the rows */
            for (int j = 0; j < 4; j++) {
                __m256 q0 = _mm256_maskload_ps(s + j * xs, m);
                __m256 q1 = _mm256_maskload_ps(s + (4 + j) * xs, m);
                __m256 q2 = _mm256_maskload_ps(s + (8 + j) * xs, m);
                __m256 q3 = _mm256_maskload_ps(s + (12 + j) * xs, m);
                s0[j] = _mm256_add_ps(_mm256_add_ps(q0, q1), q2);
                s1[j] = _mm256_sub_ps(_mm256_sub_ps(q1, q2), q3);
            }
            for (int r = 0; r < 2 && 2 * ty + r < g->h2; r++) {
                const __m256 *t = r ? s1 : s0;
                __m256 y0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(t[0], t[1]), t[2]), b);
                __m256 y1 = _mm256_add_ps(_mm256_sub_ps(_mm256_sub_ps(t[1], t[2]), t[3]), b);
                /* a tile's two columns side by side: y0[l], y1[l] at columns 2l, 2l + 1 */
                __m256 ul = _mm256_unpacklo_ps(y0, y1), uh = _mm256_unpackhi_ps(y0, y1);
                float *o = out + (2 * ty + r) * g->w2 + 16 * k;
                /* the spill lands on the next row, written after this one only if it is this
                 * tile row's second (when its columns are not split into blocks) or the next
                 * tile row's first */
                bool next = 2 * ty + r + 1 < g->h2 && (r == 1 || g->kc == 1);
                int64_t n0 = g->w2 - 16 * k, n1 = n0 - 8;
                store_row(o, n0, lo, _mm256_permute2f128_ps(ul, uh, 0x20), next && 8 - n0 <= g->w2);
                store_row(o + 8, n1, hi, _mm256_permute2f128_ps(ul, uh, 0x31),
                          next && 8 - n1 <= g->w2);
            }
        }
}

static void grad_transform_256(const float *dy, const wgeom *g, float *v, int64_t xs) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256i none = _mm256_setzero_si256();
    for (int64_t ty = 0; ty < g->ty; ty++)
        for (int64_t k = 0; k < g->kc; k++) {
            int64_t nt = g->tx - 8 * k;
            __m256i m = lanes_256(nt);
            __m256i lo = row_lanes_256(16 * k, g->w2), hi = row_lanes_256(16 * k + 8, g->w2);
            __m256 e[2][4]; /* e[r][j]: row r of dY times A^T, lane = tile */
            for (int r = 0; r < 2; r++) {
                int64_t y = 2 * ty + r;
                bool in = y < g->h2;
                const float *q = dy + (in ? y : 0) * g->w2 + 16 * k;
                __m256 a = _mm256_maskload_ps(q, in ? lo : none);
                __m256 c = _mm256_maskload_ps(q + 8, in ? hi : none);
                __m256 d0 = evens(a, c), d1 = odds(a, c);
                e[r][0] = d0, e[r][1] = _mm256_add_ps(d0, d1);
                e[r][2] = _mm256_sub_ps(d0, d1), e[r][3] = _mm256_sub_ps(zero, d1);
            }
            float *d = v + ty * g->tx + 8 * k;
            bool spill = spill_ok(g, ty, k);
            for (int j = 0; j < 4; j++) {
                store_row(d + j * xs, nt, m, e[0][j], spill);
                store_row(d + (4 + j) * xs, nt, m, _mm256_add_ps(e[0][j], e[1][j]), spill);
                store_row(d + (8 + j) * xs, nt, m, _mm256_sub_ps(e[0][j], e[1][j]), spill);
                store_row(d + (12 + j) * xs, nt, m, _mm256_sub_ps(zero, e[1][j]), spill);
            }
        }
}

static inline void bt_adjoint_256(__m256 x0, __m256 x1, __m256 x2, __m256 x3, __m256 *o) {
    o[0] = x0, o[1] = _mm256_add_ps(_mm256_sub_ps(x1, x2), x3);
    o[2] = _mm256_sub_ps(_mm256_add_ps(x1, x2), x0), o[3] = _mm256_sub_ps(_mm256_setzero_ps(), x3);
}

/* input_adjoint_512 in blocks of 8 columns: tiles 4k - 1 .. 4k + 3 in lanes 0-4 */
static void input_adjoint_256(const float *dv, int64_t xs, const wgeom *g, float *gx) {
    const __m256i cur = _mm256_setr_epi32(1, 1, 2, 2, 3, 3, 4, 4);
    const __m256i prev = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m256 zero = _mm256_setzero_ps();
    const int64_t ty_n = g->ty, tx = g->tx, h = g->h1, w = g->w1, ph = g->ph;
    for (int64_t k = 0; 8 * k - g->pw < w; k++) {
        int64_t c = 8 * k - g->pw;
        __m256i tm = _mm256_and_si256(row_lanes_256(4 * k - 1, tx), lanes_256(5));
        __m256i cm = row_lanes_256(c, w);
        bool full = c >= 0 && c + 8 <= w;
        __m256 carry[2] = {zero, zero};
        for (int64_t ty = 0; ty <= ty_n; ty++) {
            __m256 r[4] = {zero, zero, zero, zero};
            if (ty < ty_n) {
                const float *s = dv + ty * tx + 4 * k - 1;
                __m256 dh[4][4];
                for (int j = 0; j < 4; j++) {
                    __m256 o[4];
                    bt_adjoint_256(_mm256_maskload_ps(s + j * xs, tm),
                                   _mm256_maskload_ps(s + (4 + j) * xs, tm),
                                   _mm256_maskload_ps(s + (8 + j) * xs, tm),
                                   _mm256_maskload_ps(s + (12 + j) * xs, tm), o);
                    for (int i = 0; i < 4; i++) dh[i][j] = o[i];
                }
                for (int i = 0; i < 4; i++) {
                    __m256 d[4];
                    bt_adjoint_256(dh[i][0], dh[i][1], dh[i][2], dh[i][3], d);
                    __m256 a = _mm256_blend_ps(_mm256_permutevar8x32_ps(d[0], cur),
                                               _mm256_permutevar8x32_ps(d[1], cur), 0xAA);
                    __m256 b = _mm256_blend_ps(_mm256_permutevar8x32_ps(d[2], prev),
                                               _mm256_permutevar8x32_ps(d[3], prev), 0xAA);
                    r[i] = _mm256_add_ps(a, b);
                }
            }
            for (int i = 0; i < 2; i++) {
                int64_t y = 2 * ty - ph + i;
                if (y >= 0 && y < h) {
                    __m256 v = _mm256_add_ps(r[i], carry[i]);
                    if (full)
                        _mm256_storeu_ps(gx + y * w + c, v);
                    else
                        _mm256_maskstore_ps(gx + y * w + c, cm, v);
                }
                carry[i] = r[2 + i];
            }
        }
    }
}

TDM_AVX2_END

static const wino_kernels kernels_512 = {input_transform_512, output_transform_512,
                                         grad_transform_512, input_adjoint_512};
static const wino_kernels kernels_256 = {input_transform_256, output_transform_256,
                                         grad_transform_256, input_adjoint_256};

/* The transforms for this CPU (tdm_cpu_wino_applies has checked it has one of them). */
static const wino_kernels *wino_kernels_for_cpu(void) {
    return tdm_cpu_vector_bits() == 512 ? &kernels_512 : &kernels_256;
}

/* The n filters' taps f9 [9][n] (tap k of filter j at f9[k * n + j]) from w [n, 3, 3], so that
 * the transforms below run over j in vectors (scalar per filter they were 2% of the CNN's
 * step). */
static void filter_taps(const float *w, int64_t n, float *f9) {
    for (int64_t j = 0; j < n; j++)
        for (int k = 0; k < 9; k++) f9[k * n + j] = w[j * 9 + k];
}

/* (o0, o1, o2, o3) = G (a, b, c), G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1], for n filters at once
 * (row vectors over the filters: GCC vectorises this form, not a loop over filters of 3x3
 * matrices) */
TDM_CPU_CLONES
static void g_apply(const float *restrict a, const float *restrict b, const float *restrict c,
                    int64_t n, float *restrict o0, float *restrict o1, float *restrict o2,
                    float *restrict o3) {
    for (int64_t j = 0; j < n; j++) {
        o0[j] = a[j], o1[j] = 0.5f * (a[j] + b[j] + c[j]);
        o2[j] = 0.5f * (a[j] - b[j] + c[j]), o3[j] = c[j];
    }
}

/* (o0, o1, o2) = G^T (d0, d1, d2, d3), the adjoint of g_apply */
TDM_CPU_CLONES
static void g_adjoint(const float *restrict d0, const float *restrict d1, const float *restrict d2,
                      const float *restrict d3, int64_t n, float *restrict o0, float *restrict o1,
                      float *restrict o2) {
    for (int64_t j = 0; j < n; j++) {
        o0[j] = d0[j] + 0.5f * (d1[j] + d2[j]), o1[j] = 0.5f * (d1[j] - d2[j]);
        o2[j] = 0.5f * (d1[j] + d2[j]) + d3[j];
    }
}

/* u [16][n] = G f G^T for the n filters of f9 [9][n]; t [12][n] is scratch. */
static void filters_transform(const float *f9, int64_t n, float *t, float *u) {
    for (int b = 0; b < 3; b++) /* t[i][b] = (G f)[i][b] */
        g_apply(f9 + b * n, f9 + (3 + b) * n, f9 + (6 + b) * n, n, t + b * n, t + (3 + b) * n,
                t + (6 + b) * n, t + (9 + b) * n);
    for (int i = 0; i < 4; i++) /* u[i][j] = (t G^T)[i][j] */
        g_apply(t + 3 * i * n, t + (3 * i + 1) * n, t + (3 * i + 2) * n, n, u + 4 * i * n,
                u + (4 * i + 1) * n, u + (4 * i + 2) * n, u + (4 * i + 3) * n);
}

/* f9 [9][n] = G^T du G, the adjoint of filters_transform, for du [16][n]; t [12][n] scratch. */
static void filters_transform_adjoint(const float *du, int64_t n, float *t, float *f9) {
    for (int c = 0; c < 4; c++) /* t[a][c] = (G^T du)[a][c] */
        g_adjoint(du + c * n, du + (4 + c) * n, du + (8 + c) * n, du + (12 + c) * n, n, t + c * n,
                  t + (4 + c) * n, t + (8 + c) * n);
    for (int a = 0; a < 3; a++) /* f[a][b] = (t G)[a][b] */
        g_adjoint(t + 4 * a * n, t + (4 * a + 1) * n, t + (4 * a + 2) * n, t + (4 * a + 3) * n, n,
                  f9 + 3 * a * n, f9 + (3 * a + 1) * n, f9 + (3 * a + 2) * n);
}

/* U [16][n] for the n filters w [n, 3, 3], in scratch of the current scope. */
static float *filters_winograd(const float *w, int64_t n, tdm_device dev) {
    float *f9 = scratch(9 * n, dev), *t = scratch(12 * n, dev), *u = scratch(16 * n, dev);
    if (!f9 || !t || !u) return NULL;
    filter_taps(w, n, f9);
    filters_transform(f9, n, t, u);
    return u;
}

/* gw [n, 3, 3] = G^T dU G for the n filters' dU [16][n], with scratch of the current scope. */
static int filters_from_winograd(const float *du, int64_t n, float *gw, tdm_device dev) {
    float *t = scratch(12 * n, dev), *f9 = scratch(9 * n, dev);
    if (!t || !f9) return tdm_last_status();
    filters_transform_adjoint(du, n, t, f9);
    for (int64_t j = 0; j < n; j++)
        for (int k = 0; k < 9; k++) gw[j * 9 + k] = f9[k * n + j];
    return TDM_OK;
}

/* Images per chunk: V and M of the chunk fill about an L2. */
static int64_t chunk_images(const wgeom *g, int64_t n) {
    int64_t per = 16 * (g->c1 + g->c2) * g->tt;
    int64_t nb = WINO_CHUNK_FLOATS / (per > 0 ? per : 1);
    /* but at least WINO_MIN_TILES tiles: the deep layers' planes have few tiles (4 at 4x4, 16
     * at 7x7) and their 512-channel GEMMs would be [512, 8] @ ... (measured on AVX2 at
     * ResNet-18's layer4, forward and backward together: bench/RESULTS.md, "Figures behind the
     * code") */
    if (nb * g->tt < WINO_MIN_TILES) nb = (WINO_MIN_TILES + g->tt - 1) / g->tt;
    return nb < 1 ? 1 : nb > n ? n : nb;
}

/* The V leading dimension for nb images, rounded up to a cache line. */
static int64_t chunk_ld(const wgeom *g, int64_t nb) {
    return (nb * g->tt + 15) / 16 * 16;
}

/* Distance between the 16 matrices of V (or M) of c rows: one cache line more than c * ld, so
 * that the transforms' 16 store (load) streams do not all map to the same L1 sets, as they
 * would with a stride of a multiple of 4 KiB. */
static int64_t xi_stride(int64_t c, int64_t ld) {
    return c * ld + 16;
}

/* V[xi][c][i * tt + t] for images [n0, n0 + cnt) of in [N, C1, H1, W1]. */
static void transform_inputs(const wino_kernels *kt, const float *in, const wgeom *g, int64_t n0,
                             int64_t cnt, float *v, int64_t ld) {
    for (int64_t i = 0; i < cnt; i++)
        for (int64_t c = 0; c < g->c1; c++) {
            kt->input_transform(in + ((n0 + i) * g->c1 + c) * g->h1 * g->w1, g,
                                v + c * ld + i * g->tt, xi_stride(g->c1, ld));
        }
}

/* out [N, C2, H2, W2] = in [N, C1, H1, W1] correlated with the filters whose transforms are
 * U [16][C2][C1], plus bias [C2] (or NULL). */
static int wino_correlate(const float *in, const wgeom *g, int64_t n, const float *U,
                          const float *bias, float *out, tdm_device dev) {
    const wino_kernels *kt = wino_kernels_for_cpu();
    int64_t nb = chunk_images(g, n), ld = chunk_ld(g, nb);
    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    int64_t vs = xi_stride(g->c1, ld), ms = xi_stride(g->c2, ld);
    float *V = scratch(16 * vs, dev), *M = scratch(16 * ms, dev);
    if (!V || !M) {
        tdm_scope_end();
        return tdm_last_status();
    }
    for (int64_t n0 = 0; n0 < n; n0 += nb) {
        int64_t cnt = n - n0 < nb ? n - n0 : nb, t = cnt * g->tt;
        transform_inputs(kt, in, g, n0, cnt, V, ld);
        for (int xi = 0; xi < 16; xi++)
            tdm_cpu_sgemm(false, false, g->c2, t, g->c1, 1.0f, U + xi * g->c2 * g->c1, g->c1,
                          V + xi * vs, ld, 0.0f, M + xi * ms, ld);
        for (int64_t i = 0; i < cnt; i++)
            for (int64_t c = 0; c < g->c2; c++)
                kt->output_transform(M + c * ld + i * g->tt, ms, g, bias ? bias[c] : 0.0f,
                                     out + ((n0 + i) * g->c2 + c) * g->h2 * g->w2);
    }
    tdm_scope_end();
    return TDM_OK;
}

static wgeom forward_geom(const conv_geom *g) {
    return wgeom_make(g->cin, g->h, g->w, g->ph, g->pw, g->cout, g->ho, g->wo);
}

/* one image's transforms fit the budget */
static bool wino_fits(const conv_geom *g) {
    wgeom w = forward_geom(g);
    return 16 * (g->cin + g->cout) * w.tt <= WINO_IMAGE_FLOATS;
}

int tdm_cpu_wino_conv2d(float *y, const float *x, const float *w, const float *b,
                        const conv_geom *g, tdm_device dev) {
    wgeom fg = forward_geom(g);
    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    float *U = filters_winograd(w, g->cout * g->cin, dev); /* [16][Cout][Cin] */
    if (!U) {
        tdm_scope_end();
        return tdm_last_status();
    }
    int rc = wino_correlate(x, &fg, g->n, U, b, y, dev);
    tdm_scope_end();
    return rc;
}

/* gw [Cout, Cin, 3, 3] and gx [N, Cin, H, W] (either may be NULL) from one pass over the chunks:
 * D = A dY A^T of gy's tiles serves both. gw = G^T dU G with dU[xi] = sum over tiles of
 * D[xi] V[xi]^T (V: x's tiles transformed, as in the forward); gx adds every tile's
 * B dV B^T at its patch with dV[xi] = U[xi]^T D[xi] (U: the forward's filters), written into
 * V's buffer once the dU products have read it. (Computing gx as a correlation of gy padded by
 * 2 - pad with the flipped filters took a second transform of gy, of Cout planes, and an
 * output transform, slower on the CNN's second layer: bench/RESULTS.md, "Figures behind the code".)
 */
int tdm_cpu_wino_conv2d_backward(float *gx, float *gw, const float *gy, const float *x,
                                 const float *w, const conv_geom *g, tdm_device dev) {
    const wino_kernels *kt = wino_kernels_for_cpu();
    wgeom fg = forward_geom(g);
    int64_t nb = chunk_images(&fg, g->n), ld = chunk_ld(&fg, nb), nf = g->cout * g->cin;
    int64_t vs = xi_stride(g->cin, ld), ds = xi_stride(g->cout, ld);
    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    float *V = scratch(16 * vs, dev), *D = scratch(16 * ds, dev);
    float *dU = gw ? scratch(16 * nf, dev) : NULL; /* [16][Cout][Cin] */
    float *U = gx ? filters_winograd(w, nf, dev) : NULL;
    if (!V || !D || (gw && !dU) || (gx && !U)) {
        tdm_scope_end();
        return tdm_last_status();
    }
    for (int64_t n0 = 0; n0 < g->n; n0 += nb) {
        int64_t cnt = g->n - n0 < nb ? g->n - n0 : nb, t = cnt * fg.tt;
        for (int64_t i = 0; i < cnt; i++)
            for (int64_t c = 0; c < g->cout; c++)
                kt->grad_transform(gy + ((n0 + i) * g->cout + c) * g->p, &fg,
                                   D + c * ld + i * fg.tt, ds);
        if (gw) {
            transform_inputs(kt, x, &fg, n0, cnt, V, ld);
            for (int xi = 0; xi < 16; xi++)
                tdm_cpu_sgemm(false, true, g->cout, g->cin, t, 1.0f, D + xi * ds, ld, V + xi * vs,
                              ld, n0 == 0 ? 0.0f : 1.0f, dU + xi * nf, g->cin);
        }
        if (gx) {
            for (int xi = 0; xi < 16; xi++) /* dV [Cin, t] = U[xi]^T [Cin, Cout] @ D[xi] */
                tdm_cpu_sgemm(true, false, g->cin, t, g->cout, 1.0f, U + xi * nf, g->cin,
                              D + xi * ds, ld, 0.0f, V + xi * vs, ld);
            for (int64_t i = 0; i < cnt; i++)
                for (int64_t c = 0; c < g->cin; c++)
                    kt->input_adjoint(V + c * ld + i * fg.tt, vs, &fg,
                                      gx + ((n0 + i) * g->cin + c) * g->h * g->w);
        }
    }
    int rc = gw ? filters_from_winograd(dU, nf, gw, dev) : TDM_OK;
    tdm_scope_end();
    return rc;
}

bool tdm_cpu_wino_applies(const conv_geom *g) {
    if (tdm_cpu_vector_bits() < 256) return false; /* im2col on CPUs without AVX2 */
    if (g->kh != 3 || g->kw != 3 || g->sh != 1 || g->sw != 1 || g->dh != 1 || g->dw != 1 ||
        g->groups != 1)
        return false;
    /* pad <= 2, the pads tested (a 3x3 window padded more sees only zeros at the border); few
     * channels leave the transforms, not the GEMMs, as the cost (im2col is then as good) */
    if (g->ph > 2 || g->pw > 2 || g->cin < 8 || g->cout < 8 || g->ho < 1 || g->wo < 1) return false;
    return wino_fits(g);
}

#else /* not x86-64: im2col everywhere */

bool tdm_cpu_wino_applies(const conv_geom *g) {
    (void)g;
    return false;
}

int tdm_cpu_wino_conv2d(float *y, const float *x, const float *w, const float *b,
                        const conv_geom *g, tdm_device dev) {
    return tdm_raise(TDM_ERR_STATE, "cpu conv2d: Winograd path not compiled in");
}

int tdm_cpu_wino_conv2d_backward(float *gx, float *gw, const float *gy, const float *x,
                                 const float *w, const conv_geom *g, tdm_device dev) {
    return tdm_raise(TDM_ERR_STATE, "cpu conv2d_backward: Winograd path not compiled in");
}

#endif
