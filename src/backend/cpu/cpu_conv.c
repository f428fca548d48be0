/* 2-D convolution (NCHW, f32) as im2col + GEMM, with stride, padding, dilation and groups.
 *
 * Work goes image by image, and within an image by chunks of output rows. A chunk's column
 * matrix col [K, rows*Wo] has K = Cin*kh*kw rows ordered (c, ki, kj), so group g owns the
 * contiguous rows [g*K_g, (g+1)*K_g); column (oh - oh0)*Wo + ow holds what output pixel
 * (oh, ow) reads. Chunks are sized so col stays around 1 MiB (in L2): a whole image for the
 * Fashion-MNIST CNN, a band of rows for large images. The GEMMs then read and write the NCHW
 * tensors in place (leading dimension Ho*Wo), so nothing is staged or transposed; per image
 * they are 64x196x288 for the CNN's second layer, where OpenBLAS runs close to its large-GEMM
 * speed (batching images into one wider GEMM measured no faster once the staging copies were
 * paid). A 1x1, stride-1, unpadded convolution skips im2col: the image is its own col. Two
 * paths skip it altogether: Winograd (cpu_conv_winograd.c) for 3x3 layers with channels, and
 * on AVX-512 a direct 3x3 convolution of one input channel (a grey image's first layer).
 * bf16 goes to oneDNN where it has bf16 kernels (cpu_conv_bf16.c), else through f32 copies.
 *
 * Scratch memory comes from the device's caching allocator inside a scope of its own, so a
 * training step calls no malloc here, and nothing is static: several device threads may run
 * these kernels at once.
 */
#include "backend/cpu/cpu_conv.h"
#include "backend/cpu/cpu_conv_bf16.h"
#include "backend/cpu/cpu_lowp.h"
#include "backend/cpu/cpu_isa.h"

#include <assert.h>
#include <string.h>

/* The output columns [lo, hi) whose input column ow*s - pad + off lies in [0, size). */
static void valid_range(int64_t size, int64_t out, int64_t s, int64_t pad, int64_t off, int64_t *lo,
                        int64_t *hi) {
    int64_t start = pad - off; /* ow*s >= start */
    int64_t l = start <= 0 ? 0 : (start + s - 1) / s;
    int64_t end = size + pad - off; /* ow*s < end */
    int64_t h = end <= 0 ? 0 : (end + s - 1) / s;
    if (h > out) h = out;
    if (l > h) l = h;
    *lo = l, *hi = h;
}

static _Thread_local bool fast_paths_off; /* tdm_cpu_conv_set_fast_paths */

bool tdm_cpu_conv_set_fast_paths(bool on) {
    bool prev = !fast_paths_off;
    fast_paths_off = !on;
    return prev;
}

/* Short-row helpers for im2col/col2im. Rows are Wo long (14 for the CNN), so a call to
 * memcpy/memset per row (which GCC would otherwise substitute for these loops) costs more
 * than the copy: eight floats at a time through a vector type, then a scalar tail. */
typedef float v8f __attribute__((vector_size(32)));
#if defined(__GNUC__) && !defined(__clang__)
#define NO_LIBCALLS __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define NO_LIBCALLS
#endif

static inline NO_LIBCALLS void copy_row(float *d, const float *s, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f t;
        memcpy(&t, s + i, sizeof t);
        memcpy(d + i, &t, sizeof t);
    }
    for (; i < n; i++) d[i] = s[i];
}

static inline NO_LIBCALLS void zero_row(float *d, int64_t n) {
    int64_t i = 0;
    v8f z = {0};
    for (; i + 8 <= n; i += 8) memcpy(d + i, &z, sizeof z);
    for (; i < n; i++) d[i] = 0;
}

static inline NO_LIBCALLS void add_row(float *d, const float *s, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f a, b;
        memcpy(&a, d + i, sizeof a);
        memcpy(&b, s + i, sizeof b);
        a += b;
        memcpy(d + i, &a, sizeof a);
    }
    for (; i < n; i++) d[i] += s[i];
}

/* Rows [oh0, oh1) of the column matrix of one image x [C, H, W]: row (c, ki, kj) at
 * col + row*ld holds, for each output pixel (oh, ow) of the range, the input pixel that
 * kernel tap (ki, kj) reads, or 0 in the padding. */
TDM_CPU_CLONES
static NO_LIBCALLS void im2col(const float *x, int64_t channels, const conv_geom *g, int64_t oh0,
                               int64_t oh1, float *col, int64_t ld) {
    for (int64_t c = 0; c < channels; c++) {
        const float *xc = x + c * g->h * g->w;
        for (int64_t ki = 0; ki < g->kh; ki++) {
            int64_t lo, hi;
            valid_range(g->h, g->ho, g->sh, g->ph, ki * g->dh, &lo, &hi);
            lo = lo < oh0 ? oh0 : lo > oh1 ? oh1 : lo;
            hi = hi > oh1 ? oh1 : hi < lo ? lo : hi;
            for (int64_t kj = 0; kj < g->kw; kj++) {
                float *dst = col + ((c * g->kh + ki) * g->kw + kj) * ld;
                int64_t ow_lo, ow_hi;
                valid_range(g->w, g->wo, g->sw, g->pw, kj * g->dw, &ow_lo, &ow_hi);
                zero_row(dst, (lo - oh0) * g->wo);
                for (int64_t oh = lo; oh < hi; oh++) {
                    const float *src =
                        xc + (oh * g->sh - g->ph + ki * g->dh) * g->w + (kj * g->dw - g->pw);
                    float *d = dst + (oh - oh0) * g->wo;
                    zero_row(d, ow_lo);
                    if (g->sw == 1) {
                        copy_row(d + ow_lo, src + ow_lo, ow_hi - ow_lo);
                    } else {
                        for (int64_t ow = ow_lo; ow < ow_hi; ow++) d[ow] = src[ow * g->sw];
                    }
                    zero_row(d + ow_hi, g->wo - ow_hi);
                }
                zero_row(dst + (hi - oh0) * g->wo, (oh1 - hi) * g->wo);
            }
        }
    }
}

/* The adjoint of im2col for rows [oh0, oh1): adds each column entry back into gx [C, H, W]. */
TDM_CPU_CLONES
static NO_LIBCALLS void col2im(const float *col, int64_t ld, int64_t channels, const conv_geom *g,
                               int64_t oh0, int64_t oh1, float *gx) {
    for (int64_t c = 0; c < channels; c++) {
        float *gc = gx + c * g->h * g->w;
        for (int64_t ki = 0; ki < g->kh; ki++) {
            int64_t lo, hi;
            valid_range(g->h, g->ho, g->sh, g->ph, ki * g->dh, &lo, &hi);
            if (lo < oh0) lo = oh0;
            if (hi > oh1) hi = oh1;
            for (int64_t kj = 0; kj < g->kw; kj++) {
                const float *src = col + ((c * g->kh + ki) * g->kw + kj) * ld;
                int64_t ow_lo, ow_hi;
                valid_range(g->w, g->wo, g->sw, g->pw, kj * g->dw, &ow_lo, &ow_hi);
                for (int64_t oh = lo; oh < hi; oh++) {
                    float *d = gc + (oh * g->sh - g->ph + ki * g->dh) * g->w + (kj * g->dw - g->pw);
                    const float *s = src + (oh - oh0) * g->wo;
                    if (g->sw == 1) {
                        add_row(d + ow_lo, s + ow_lo, ow_hi - ow_lo);
                    } else {
                        for (int64_t ow = ow_lo; ow < ow_hi; ow++) d[ow * g->sw] += s[ow];
                    }
                }
            }
        }
    }
}

/* Output rows per chunk: the whole image when its column matrix fits the budget (~1 MiB,
 * half of L2), else as many rows as fit, so a 224x224 image does not need a 100 MB buffer.
 * Within an image the GEMMs read and write the NCHW tensors in place (ld = Ho*Wo). */
static int64_t chunk_rows(const conv_geom *g) {
    const int64_t budget = 256 * 1024; /* floats */
    int64_t rows = budget / (g->k * g->wo > 0 ? g->k * g->wo : 1);
    if (rows < 1) rows = 1;
    return rows < g->ho ? rows : g->ho;
}

/* Scratch f32 buffer of n floats from the current (kernel-local) scope. */
static float *scratch(int64_t n, tdm_device dev) {
    tdm_tensor *t = tdm_tensor_alloc(TDM_SHAPE(n > 0 ? n : 1), TDM_F32, dev);
    return t ? (float *)tdm_data_ptr(t) : NULL;
}

/* The contract: the op (nn/functional_conv.c) refused inputs that are not 4-D f32 and
 * handed contiguous tensors. */
static inline bool conv_args_ok(const tdm_tensor *x, const tdm_tensor *w, const tdm_tensor *y) {
    return x->ndim == 4 && w->ndim == 4 && y->ndim == 4 && x->dtype == TDM_F32 &&
           w->dtype == TDM_F32 && y->dtype == TDM_F32 && tdm_is_contiguous(x) &&
           tdm_is_contiguous(w) && tdm_is_contiguous(y);
}

/* y [Cout, P] (one image) += bias [Cout] per row. Cloned: baseline code would add 4 lanes at a
 * time, and this pass over the first layer's output was 1-2% of the CNN's step. */
TDM_CPU_CLONES
static void add_bias(float *y, const float *bias, const conv_geom *g) {
    for (int64_t co = 0; co < g->cout; co++) {
        float *d = y + co * g->p, b = bias[co];
        for (int64_t q = 0; q < g->p; q++) d[q] += b;
    }
}

#ifdef TDM_HAVE_AVX512_CODE
/* Input channels up to which the direct convolution runs: a grey image's first layer, where it
 * was measured (bench/RESULTS.md, "Issue 15's CNN: the Winograd backward and the pooling");
 * the loop takes more, an RGB stem is unmeasured. */
#define DIRECT_CIN_MAX 1

static bool direct_applies(const conv_geom *g) {
    return tdm_cpu_vector_bits() == 512 && g->cin <= DIRECT_CIN_MAX && g->groups == 1 &&
           g->kh == 3 && g->kw == 3 && g->sh == 1 && g->sw == 1 && g->dh == 1 && g->dw == 1;
}

TDM_AVX512_BEGIN

/* a0..a7 += v * the tap t of output channels co0..co0 + 7 */
#define FMA8(v, t)                                                                                 \
    a0 = _mm512_fmadd_ps(v, _mm512_set1_ps(w0[t]), a0);                                            \
    a1 = _mm512_fmadd_ps(v, _mm512_set1_ps(w1[t]), a1);                                            \
    a2 = _mm512_fmadd_ps(v, _mm512_set1_ps(w2[t]), a2);                                            \
    a3 = _mm512_fmadd_ps(v, _mm512_set1_ps(w3[t]), a3);                                            \
    a4 = _mm512_fmadd_ps(v, _mm512_set1_ps(w4[t]), a4);                                            \
    a5 = _mm512_fmadd_ps(v, _mm512_set1_ps(w5[t]), a5);                                            \
    a6 = _mm512_fmadd_ps(v, _mm512_set1_ps(w6[t]), a6);                                            \
    a7 = _mm512_fmadd_ps(v, _mm512_set1_ps(w7[t]), a7)

/* y = x * w + b for a 3x3, stride-1 convolution of few input channels, directly: im2col's
 * product has K = 9 cin, too thin for a GEMM, and its bias takes another pass over y. Eight
 * output channels by 16 columns of an output row at a time, in named accumulators (an array
 * of them GCC kept on the stack: slower than im2col): each tap is one masked load of an input
 * row (the padding reads as zeros) and eight FMAs. */
static void conv3x3_direct(float *y, const float *x, const float *w, const float *b,
                           const conv_geom *g) {
    const int64_t cin = g->cin, h = g->h, wd = g->w, ho = g->ho, wo = g->wo, p = g->p;
    for (int64_t n = 0; n < g->n; n++) {
        const float *xn = x + n * cin * h * wd;
        for (int64_t co0 = 0; co0 < g->cout; co0 += 8) {
            int nc = g->cout - co0 < 8 ? (int)(g->cout - co0) : 8;
            const float *wj[8]; /* channels past cout repeat the last; never stored */
            float bj[8];
            for (int j = 0; j < 8; j++) {
                int64_t co = co0 + (j < nc ? j : nc - 1);
                wj[j] = w + co * cin * 9, bj[j] = b ? b[co] : 0.0f;
            }
            const float *w0 = wj[0], *w1 = wj[1], *w2 = wj[2], *w3 = wj[3];
            const float *w4 = wj[4], *w5 = wj[5], *w6 = wj[6], *w7 = wj[7];
            float *yc = y + (n * g->cout + co0) * p;
            for (int64_t oy = 0; oy < ho; oy++)
                for (int64_t c = 0; c < wo; c += 16) {
                    __m512 a0 = _mm512_set1_ps(bj[0]), a1 = _mm512_set1_ps(bj[1]);
                    __m512 a2 = _mm512_set1_ps(bj[2]), a3 = _mm512_set1_ps(bj[3]);
                    __m512 a4 = _mm512_set1_ps(bj[4]), a5 = _mm512_set1_ps(bj[5]);
                    __m512 a6 = _mm512_set1_ps(bj[6]), a7 = _mm512_set1_ps(bj[7]);
                    __mmask16 m0 = tdm_pixel_lanes(c - g->pw, wd); /* taps dx = 0, 1, 2 */
                    __mmask16 m1 = tdm_pixel_lanes(c + 1 - g->pw, wd);
                    __mmask16 m2 = tdm_pixel_lanes(c + 2 - g->pw, wd);
                    for (int64_t ci = 0; ci < cin; ci++)
                        for (int dy = 0; dy < 3; dy++) {
                            int64_t iy = oy + dy - g->ph;
                            if (iy < 0 || iy >= h) continue;
                            const float *r = xn + (ci * h + iy) * wd + c - g->pw;
                            int t = (int)ci * 9 + dy * 3;
                            __m512 v = _mm512_maskz_loadu_ps(m0, r);
                            FMA8(v, t);
                            v = _mm512_maskz_loadu_ps(m1, r + 1);
                            FMA8(v, t + 1);
                            v = _mm512_maskz_loadu_ps(m2, r + 2);
                            FMA8(v, t + 2);
                        }
                    __mmask16 om = tdm_pixel_lanes(0, wo - c);
                    float *o = yc + oy * wo + c;
                    __m512 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
                    for (int j = 0; j < nc; j++) _mm512_mask_storeu_ps(o + j * p, om, acc[j]);
                }
        }
    }
}
#undef FMA8

TDM_AVX512_END
#else
static bool direct_applies(const conv_geom *g) {
    (void)g;
    return false;
}
static void conv3x3_direct(float *y, const float *x, const float *w, const float *b,
                           const conv_geom *g) {
    (void)y, (void)x, (void)w, (void)b, (void)g;
}
#endif

/* y [N, Cout, Ho, Wo] = conv(x, w) + b: per image and chunk of output rows,
 * y[n][:, rows] (ld Ho*Wo) = w_g [Cout_g, K_g] @ col_g [K_g, rows*Wo] for each group. */
int tdm_cpu_conv2d(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w, const tdm_tensor *b,
                   const tdm_conv2d_args *args) {
    if (tdm_cpu_lowp_any(4, (const tdm_tensor *[]){y, x, w, b})) {
        int rc = tdm_cpu_conv2d_bf16(y, x, w, b, args);
        return rc == TDM_CPU_CONV_BF16_NOT_HERE ? tdm_cpu_lowp_conv2d(y, x, w, b, args) : rc;
    }
    assert(conv_args_ok(x, w, y));
    conv_geom g = tdm_conv_geom(x, w, y->shape[2], y->shape[3], args);
    const float *xp = tdm_data_ptr(x), *wp = tdm_data_ptr(w);
    const float *bp = b ? tdm_data_ptr(b) : NULL;
    float *yp = tdm_data_ptr(y);
    if (g.n == 0 || g.cout == 0 || g.p == 0) return TDM_OK;
    if (!fast_paths_off && tdm_cpu_wino_applies(&g))
        return tdm_cpu_wino_conv2d(yp, xp, wp, bp, &g, x->device);
    if (!fast_paths_off && direct_applies(&g)) {
        conv3x3_direct(yp, xp, wp, bp, &g);
        return TDM_OK;
    }
    bool pointwise = tdm_conv_is_pointwise(&g);
    int64_t rows = pointwise ? g.ho : chunk_rows(&g);

    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    float *col = pointwise ? NULL : scratch(g.k * rows * g.wo, x->device);
    if (!pointwise && !col) {
        tdm_scope_end();
        return tdm_last_status();
    }
    for (int64_t n = 0; n < g.n; n++) {
        const float *xn = xp + n * g.cin * g.h * g.w;
        float *yn = yp + n * g.cout * g.p;
        for (int64_t oh0 = 0; oh0 < g.ho; oh0 += rows) {
            int64_t oh1 = oh0 + rows < g.ho ? oh0 + rows : g.ho;
            int64_t cols = (oh1 - oh0) * g.wo, ld = cols;
            const float *src = col;
            if (pointwise) {
                src = xn, ld = g.p;
            } else {
                im2col(xn, g.cin, &g, oh0, oh1, col, ld);
            }
            for (int64_t gi = 0; gi < g.groups; gi++)
                tdm_cpu_sgemm(false, false, g.cout_g, cols, g.k_g, 1.0f, wp + gi * g.cout_g * g.k_g,
                              g.k_g, src + gi * g.k_g * ld, ld, 0.0f,
                              yn + gi * g.cout_g * g.p + oh0 * g.wo, g.p);
        }
        if (bp) add_bias(yn, bp, &g); /* while y[n] is still in cache */
    }
    tdm_scope_end();
    return TDM_OK;
}

/* gb [Cout] += sum of one image's gy [Cout, P], in a fixed order: 16 lanes, then their sum and
 * the tail (a scalar loop costs as much as a small GEMM here). */
TDM_CPU_CLONES
static void bias_grad(float *gb, const float *gy, const conv_geom *g) {
    for (int64_t co = 0; co < g->cout; co++) {
        const float *s = gy + co * g->p;
        v8f a0 = {0}, a1 = {0};
        int64_t q = 0;
        for (; q + 16 <= g->p; q += 16) {
            v8f t0, t1;
            memcpy(&t0, s + q, sizeof t0);
            memcpy(&t1, s + q + 8, sizeof t1);
            a0 += t0, a1 += t1;
        }
        a0 += a1;
        float acc = ((a0[0] + a0[4]) + (a0[1] + a0[5])) + ((a0[2] + a0[6]) + (a0[3] + a0[7]));
        for (; q < g->p; q++) acc += s[q];
        gb[co] += acc;
    }
}

#ifdef TDM_HAVE_AVX512_CODE
/* rows k up to which gw_small_k beats the GEMM; it is AVX-512 code */
#define SMALL_K_MAX (tdm_cpu_vector_bits() == 512 ? 27 : 0)
TDM_AVX512_BEGIN

/* gw [cout, k] (ld ldw) += dy [cout, cols] (ld ldy) @ col [k, cols]^T (ld ldc) for a few rows k
 * (the first layer: k = 9): OpenBLAS spends most of such a thin GEMM packing, so this runs it
 * as dot products, two output channels by nine rows of col at a time (18 accumulators). With
 * gb, also gb [cout] += the row sums of dy (the bias gradient), in the same pass over dy. */
static void gw_small_k(float *gw, int64_t ldw, float *gb, const float *dy, int64_t ldy,
                       const float *col, int64_t ldc, int64_t cout, int64_t k, int64_t cols) {
    for (int64_t co = 0; co < cout; co += 2) {
        const float *d0 = dy + co * ldy, *d1 = co + 1 < cout ? d0 + ldy : d0;
        for (int64_t k0 = 0; k0 < k; k0 += 9) {
            const float *c[9]; /* rows past k repeat row k0; their sums are dropped */
            for (int j = 0; j < 9; j++) c[j] = col + (k0 + j < k ? k0 + j : k0) * ldc;
            __m512 a0[9], a1[9], s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
            for (int j = 0; j < 9; j++) a0[j] = a1[j] = _mm512_setzero_ps();
            for (int64_t q = 0; q < cols; q += 16) {
                __mmask16 m =
                    cols - q >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - q)) - 1);
                __m512 y0 = _mm512_maskz_loadu_ps(m, d0 + q), y1 = _mm512_maskz_loadu_ps(m, d1 + q);
                s0 = _mm512_add_ps(s0, y0), s1 = _mm512_add_ps(s1, y1);
                for (int j = 0; j < 9; j++) {
                    __m512 cv = _mm512_maskz_loadu_ps(m, c[j] + q);
                    a0[j] = _mm512_fmadd_ps(y0, cv, a0[j]);
                    a1[j] = _mm512_fmadd_ps(y1, cv, a1[j]);
                }
            }
            for (int j = 0; j < 9 && k0 + j < k; j++) {
                gw[co * ldw + k0 + j] += _mm512_reduce_add_ps(a0[j]);
                if (co + 1 < cout) gw[(co + 1) * ldw + k0 + j] += _mm512_reduce_add_ps(a1[j]);
            }
            if (gb && k0 == 0) {
                gb[co] += _mm512_reduce_add_ps(s0);
                if (co + 1 < cout) gb[co + 1] += _mm512_reduce_add_ps(s1);
            }
        }
    }
}
TDM_AVX512_END
#else
#define SMALL_K_MAX 0
static void gw_small_k(float *gw, int64_t ldw, float *gb, const float *dy, int64_t ldy,
                       const float *col, int64_t ldc, int64_t cout, int64_t k, int64_t cols) {
    (void)gw, (void)ldw, (void)gb, (void)dy, (void)ldy, (void)col, (void)ldc, (void)cout, (void)k,
        (void)cols;
}
#endif

/* Per image and chunk of output rows: gw_g += gy_g [Cout_g, rows*Wo] @ col_g^T,
 * gcol_g = w_g^T @ gy_g then col2im into gx[n], gb += row sums of gy. */
int tdm_cpu_conv2d_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb, const tdm_tensor *gy,
                            const tdm_tensor *x, const tdm_tensor *w, const tdm_conv2d_args *args) {
    if (tdm_cpu_lowp_any(6, (const tdm_tensor *[]){gx, gw, gb, gy, x, w})) {
        int rc = tdm_cpu_conv2d_backward_bf16(gx, gw, gb, gy, x, w, args);
        return rc == TDM_CPU_CONV_BF16_NOT_HERE
                   ? tdm_cpu_lowp_conv2d_backward(gx, gw, gb, gy, x, w, args)
                   : rc;
    }
    assert(conv_args_ok(x, w, gy));
    conv_geom g = tdm_conv_geom(x, w, gy->shape[2], gy->shape[3], args);
    const float *xp = tdm_data_ptr(x), *wp = tdm_data_ptr(w), *gyp = tdm_data_ptr(gy);
    float *gxp = gx ? tdm_data_ptr(gx) : NULL;
    float *gwp = gw ? tdm_data_ptr(gw) : NULL;
    float *gbp = gb ? tdm_data_ptr(gb) : NULL;
    if (gbp) memset(gbp, 0, (size_t)g.cout * sizeof(float));
    if (g.n > 0 && g.p > 0 && g.cout > 0 && !fast_paths_off && tdm_cpu_wino_applies(&g)) {
        for (int64_t n = 0; gbp && n < g.n; n++) bias_grad(gbp, gyp + n * g.cout * g.p, &g);
        return tdm_cpu_wino_conv2d_backward(gxp, gwp, gyp, xp, wp, &g, x->device);
    }
    if (gxp) memset(gxp, 0, (size_t)(g.n * g.cin * g.h * g.w) * sizeof(float));
    if (gwp) memset(gwp, 0, (size_t)(g.cout * g.k_g) * sizeof(float));
    if (g.n == 0 || g.p == 0 || g.cout == 0) return TDM_OK;
    bool pointwise = tdm_conv_is_pointwise(&g);
    int64_t rows = pointwise ? g.ho : chunk_rows(&g);

    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    float *col = pointwise ? NULL : scratch(g.k * rows * g.wo, x->device);
    if (!pointwise && !col) {
        tdm_scope_end();
        return tdm_last_status();
    }
    for (int64_t n = 0; n < g.n; n++) {
        const float *xn = xp + n * g.cin * g.h * g.w, *gyn = gyp + n * g.cout * g.p;
        float *gxn = gxp ? gxp + n * g.cin * g.h * g.w : NULL;
        /* the thin weight gradient sums the bias gradient in its own pass over gy */
        bool gb_in_gw = gbp && gwp && g.k_g <= SMALL_K_MAX;
        if (gbp && !gb_in_gw) bias_grad(gbp, gyn, &g);
        for (int64_t oh0 = 0; oh0 < g.ho && (gwp || gxp); oh0 += rows) {
            int64_t oh1 = oh0 + rows < g.ho ? oh0 + rows : g.ho;
            int64_t cols = (oh1 - oh0) * g.wo;
            const float *dy = gyn + oh0 * g.wo; /* [Cout, cols], ld P */
            if (gwp) {
                const float *src = pointwise ? xn : col;
                int64_t ld = pointwise ? g.p : cols;
                if (!pointwise) im2col(xn, g.cin, &g, oh0, oh1, col, ld);
                for (int64_t gi = 0; gi < g.groups; gi++)
                    if (g.k_g <= SMALL_K_MAX)
                        gw_small_k(gwp + gi * g.cout_g * g.k_g, g.k_g,
                                   gb_in_gw ? gbp + gi * g.cout_g : NULL, dy + gi * g.cout_g * g.p,
                                   g.p, src + gi * g.k_g * ld, ld, g.cout_g, g.k_g, cols);
                    else
                        tdm_cpu_sgemm(false, true, g.cout_g, g.k_g, cols, 1.0f,
                                      dy + gi * g.cout_g * g.p, g.p, src + gi * g.k_g * ld, ld,
                                      1.0f, gwp + gi * g.cout_g * g.k_g, g.k_g);
            }
            if (gxp) {
                /* pointwise: gx[n] is its own column matrix (ld P); else gcol reuses col */
                float *dst = pointwise ? gxn : col;
                int64_t ld = pointwise ? g.p : cols;
                for (int64_t gi = 0; gi < g.groups; gi++)
                    tdm_cpu_sgemm(true, false, g.k_g, cols, g.cout_g, 1.0f,
                                  wp + gi * g.cout_g * g.k_g, g.k_g, dy + gi * g.cout_g * g.p, g.p,
                                  0.0f, dst + gi * g.k_g * ld, ld);
                if (!pointwise) col2im(col, cols, g.cin, &g, oh0, oh1, gxn);
            }
        }
    }
    tdm_scope_end();
    return TDM_OK;
}
