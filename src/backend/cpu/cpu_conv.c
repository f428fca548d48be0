/* 2-D convolution (NCHW, f32) as im2col + GEMM, with stride, padding, dilation and groups.
 *
 * A batch is processed in chunks of nb images. The column buffer of a chunk is
 * col [K, nb * P] with K = Cin * kh * kw (rows ordered (c, ki, kj), so group g owns the
 * contiguous rows [g*Kg, (g+1)*Kg)) and P = Ho * Wo; column i*P + p is output pixel p of image
 * i of the chunk. One GEMM per group and chunk then has a long inner dimension even when an
 * image is small (14x14), which is what keeps OpenBLAS near its peak. nb is chosen so that the
 * buffer stays around L2 size. With nb == 1 the GEMMs read and write the NCHW tensors in
 * place; with nb > 1 the output (forward) and the upstream gradient (backward) pass through a
 * [Cout, nb * P] staging buffer, a cheap copy next to the GEMM.
 *
 * Scratch memory comes from the device's caching allocator inside a scope of its own, so a
 * training step calls no malloc here, and nothing is static: several device threads may run
 * these kernels at once.
 */
#include "backend/cpu/cpu.h"

#include <cblas.h>
#include <string.h>

typedef struct {
    int64_t n, cin, h, w;      /* input */
    int64_t cout, kh, kw;      /* weight [cout, cin/groups, kh, kw] */
    int64_t ho, wo, p;         /* output plane, p = ho * wo */
    int64_t sh, sw, ph, pw, dh, dw;
    int64_t groups, cin_g, cout_g;
    int64_t k, k_g;            /* rows of col: cin * kh * kw, and per group */
} conv_geom;

static conv_geom geom_of(const tdm_tensor *x, const tdm_tensor *w, int64_t ho, int64_t wo,
                         const tdm_conv2d_args *a) {
    conv_geom g;
    g.n = x->shape[0], g.cin = x->shape[1], g.h = x->shape[2], g.w = x->shape[3];
    g.cout = w->shape[0], g.kh = w->shape[2], g.kw = w->shape[3];
    g.ho = ho, g.wo = wo, g.p = ho * wo;
    g.sh = a->stride_h > 0 ? a->stride_h : 1, g.sw = a->stride_w > 0 ? a->stride_w : 1;
    g.ph = a->pad_h, g.pw = a->pad_w;
    g.dh = a->dilation_h > 0 ? a->dilation_h : 1, g.dw = a->dilation_w > 0 ? a->dilation_w : 1;
    g.groups = a->groups > 0 ? a->groups : 1;
    g.cin_g = g.cin / g.groups, g.cout_g = g.cout / g.groups;
    g.k = g.cin * g.kh * g.kw, g.k_g = g.cin_g * g.kh * g.kw;
    return g;
}

/* The output columns [lo, hi) whose input column ow*s - pad + off lies in [0, size). */
static void valid_range(int64_t size, int64_t out, int64_t s, int64_t pad, int64_t off,
                        int64_t *lo, int64_t *hi) {
    int64_t start = pad - off; /* ow*s >= start */
    int64_t l = start <= 0 ? 0 : (start + s - 1) / s;
    int64_t end = size + pad - off; /* ow*s < end */
    int64_t h = end <= 0 ? 0 : (end + s - 1) / s;
    if (h > out) h = out;
    if (l > h) l = h;
    *lo = l, *hi = h;
}

/* col rows (c, ki, kj), each P long at col + row*ld, from one image x [C, H, W]. */
static void im2col(const float *x, int64_t channels, const conv_geom *g, float *col,
                   int64_t ld) {
    for (int64_t c = 0; c < channels; c++) {
        const float *xc = x + c * g->h * g->w;
        for (int64_t ki = 0; ki < g->kh; ki++) {
            int64_t oh_lo, oh_hi;
            valid_range(g->h, g->ho, g->sh, g->ph, ki * g->dh, &oh_lo, &oh_hi);
            for (int64_t kj = 0; kj < g->kw; kj++) {
                float *dst = col + ((c * g->kh + ki) * g->kw + kj) * ld;
                int64_t ow_lo, ow_hi;
                valid_range(g->w, g->wo, g->sw, g->pw, kj * g->dw, &ow_lo, &ow_hi);
                memset(dst, 0, (size_t)(oh_lo * g->wo) * sizeof(float));
                for (int64_t oh = oh_lo; oh < oh_hi; oh++) {
                    const float *src = xc + (oh * g->sh - g->ph + ki * g->dh) * g->w +
                                       (kj * g->dw - g->pw);
                    float *d = dst + oh * g->wo;
                    for (int64_t ow = 0; ow < ow_lo; ow++) d[ow] = 0;
                    if (g->sw == 1) {
                        memcpy(d + ow_lo, src + ow_lo, (size_t)(ow_hi - ow_lo) * sizeof(float));
                    } else {
                        for (int64_t ow = ow_lo; ow < ow_hi; ow++) d[ow] = src[ow * g->sw];
                    }
                    for (int64_t ow = ow_hi; ow < g->wo; ow++) d[ow] = 0;
                }
                memset(dst + oh_hi * g->wo, 0, (size_t)((g->ho - oh_hi) * g->wo) * sizeof(float));
            }
        }
    }
}

/* The adjoint of im2col: adds each column entry back into gx [C, H, W]. */
static void col2im(const float *col, int64_t ld, int64_t channels, const conv_geom *g,
                   float *gx) {
    for (int64_t c = 0; c < channels; c++) {
        float *gc = gx + c * g->h * g->w;
        for (int64_t ki = 0; ki < g->kh; ki++) {
            int64_t oh_lo, oh_hi;
            valid_range(g->h, g->ho, g->sh, g->ph, ki * g->dh, &oh_lo, &oh_hi);
            for (int64_t kj = 0; kj < g->kw; kj++) {
                const float *src = col + ((c * g->kh + ki) * g->kw + kj) * ld;
                int64_t ow_lo, ow_hi;
                valid_range(g->w, g->wo, g->sw, g->pw, kj * g->dw, &ow_lo, &ow_hi);
                for (int64_t oh = oh_lo; oh < oh_hi; oh++) {
                    float *d = gc + (oh * g->sh - g->ph + ki * g->dh) * g->w +
                               (kj * g->dw - g->pw);
                    const float *s = src + oh * g->wo;
                    if (g->sw == 1) {
                        for (int64_t ow = ow_lo; ow < ow_hi; ow++) d[ow] += s[ow];
                    } else {
                        for (int64_t ow = ow_lo; ow < ow_hi; ow++) d[ow * g->sw] += s[ow];
                    }
                }
            }
        }
    }
}

/* 1x1, stride 1, no padding: the image itself is its column matrix. */
static bool is_pointwise(const conv_geom *g) {
    return g->kh == 1 && g->kw == 1 && g->sh == 1 && g->sw == 1 && g->ph == 0 && g->pw == 0;
}

/* Images per chunk: enough columns for long GEMMs, few enough that col [K, nb*P] stays
 * near L2 size (~512 KiB). */
static int64_t chunk_images(const conv_geom *g) {
    const int64_t budget = 1 * 1024; /* floats */
    int64_t per_image = g->k * g->p;
    if (g->p >= 512 || per_image >= budget) return 1;
    int64_t nb = budget / per_image;
    if (nb > g->n) nb = g->n;
    return nb < 1 ? 1 : nb;
}

/* Scratch f32 buffer of n floats from the current (kernel-local) scope. */
static float *scratch(int64_t n, tdm_device dev) {
    tdm_tensor *t = tdm_tensor_alloc(TDM_SHAPE(n > 0 ? n : 1), TDM_F32, dev);
    return t ? (float *)tdm_data_ptr(t) : NULL;
}

static int check_args(const char *op, const tdm_tensor *x, const tdm_tensor *w,
                      const tdm_tensor *y) {
    if (x->ndim != 4 || w->ndim != 4 || y->ndim != 4 || x->dtype != TDM_F32 ||
        w->dtype != TDM_F32 || y->dtype != TDM_F32)
        return tdm_raise(TDM_ERR_ARG, "%s: expects 4-D f32 tensors", op);
    if (!tdm_is_contiguous(x) || !tdm_is_contiguous(w) || !tdm_is_contiguous(y))
        return tdm_raise(TDM_ERR_ARG, "%s: expects contiguous tensors", op);
    return TDM_OK;
}

/* y [N, Cout, Ho, Wo] = conv(x, w) + b */
int tdm_cpu_conv2d(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w, const tdm_tensor *b,
                   const tdm_conv2d_args *args) {
    if (check_args("cpu conv2d", x, w, y)) return tdm_last_status();
    conv_geom g = geom_of(x, w, y->shape[2], y->shape[3], args);
    const float *xp = tdm_data_ptr(x), *wp = tdm_data_ptr(w);
    const float *bp = b ? tdm_data_ptr(b) : NULL;
    float *yp = tdm_data_ptr(y);
    if (g.n == 0 || g.cout == 0 || g.p == 0) return TDM_OK;
    bool pointwise = is_pointwise(&g);
    int64_t nb = pointwise ? 1 : chunk_images(&g);

    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    float *col = pointwise ? NULL : scratch(g.k * nb * g.p, x->device);
    float *stage = nb > 1 ? scratch(g.cout * nb * g.p, x->device) : NULL;
    if ((!pointwise && !col) || (nb > 1 && !stage)) {
        tdm_scope_end();
        return tdm_last_status();
    }
    for (int64_t n0 = 0; n0 < g.n; n0 += nb) {
        int64_t cnt = g.n - n0 < nb ? g.n - n0 : nb;
        int64_t ld = cnt * g.p; /* columns of this chunk */
        const float *cols = xp + n0 * g.cin * g.h * g.w;
        if (!pointwise) {
            for (int64_t i = 0; i < cnt; i++)
                im2col(xp + (n0 + i) * g.cin * g.h * g.w, g.cin, &g, col + i * g.p, ld);
            cols = col;
        }
        /* out [Cout, cnt*P]: y[n0] itself when one image, else the staging buffer */
        float *out = nb > 1 ? stage : yp + n0 * g.cout * g.p;
        for (int64_t gi = 0; gi < g.groups; gi++)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)g.cout_g, (int)ld,
                        (int)g.k_g, 1.0f, wp + gi * g.cout_g * g.k_g, (int)g.k_g,
                        cols + gi * g.k_g * ld, (int)ld, 0.0f, out + gi * g.cout_g * ld,
                        (int)ld);
        for (int64_t i = 0; i < cnt; i++) {
            float *yi = yp + (n0 + i) * g.cout * g.p;
            for (int64_t co = 0; co < g.cout; co++) {
                float bias = bp ? bp[co] : 0.0f;
                float *dst = yi + co * g.p;
                const float *src = nb > 1 ? out + co * ld + i * g.p : dst;
                if (bp || nb > 1)
                    for (int64_t q = 0; q < g.p; q++) dst[q] = src[q] + bias;
            }
        }
    }
    tdm_scope_end();
    return TDM_OK;
}

/* gb [Cout] = sum of gy over images and pixels (fixed order). */
static void bias_grad(float *gb, const float *gy, const conv_geom *g) {
    for (int64_t co = 0; co < g->cout; co++) gb[co] = 0;
    for (int64_t n = 0; n < g->n; n++)
        for (int64_t co = 0; co < g->cout; co++) {
            const float *s = gy + (n * g->cout + co) * g->p;
            float acc = 0;
            for (int64_t q = 0; q < g->p; q++) acc += s[q];
            gb[co] += acc;
        }
}

int tdm_cpu_conv2d_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb, const tdm_tensor *gy,
                            const tdm_tensor *x, const tdm_tensor *w,
                            const tdm_conv2d_args *args) {
    if (check_args("cpu conv2d_backward", x, w, gy)) return tdm_last_status();
    conv_geom g = geom_of(x, w, gy->shape[2], gy->shape[3], args);
    const float *xp = tdm_data_ptr(x), *wp = tdm_data_ptr(w), *gyp = tdm_data_ptr(gy);
    float *gxp = gx ? tdm_data_ptr(gx) : NULL;
    float *gwp = gw ? tdm_data_ptr(gw) : NULL;
    if (gb) bias_grad(tdm_data_ptr(gb), gyp, &g);
    if (gxp) memset(gxp, 0, (size_t)(g.n * g.cin * g.h * g.w) * sizeof(float));
    if (gwp) memset(gwp, 0, (size_t)(g.cout * g.k_g) * sizeof(float));
    if ((!gxp && !gwp) || g.n == 0 || g.p == 0 || g.cout == 0) return TDM_OK;
    bool pointwise = is_pointwise(&g);
    int64_t nb = pointwise ? 1 : chunk_images(&g);

    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    float *col = pointwise ? NULL : scratch(g.k * nb * g.p, x->device);
    float *stage = nb > 1 ? scratch(g.cout * nb * g.p, x->device) : NULL;
    if ((!pointwise && !col) || (nb > 1 && !stage)) {
        tdm_scope_end();
        return tdm_last_status();
    }
    for (int64_t n0 = 0; n0 < g.n; n0 += nb) {
        int64_t cnt = g.n - n0 < nb ? g.n - n0 : nb;
        int64_t ld = cnt * g.p;
        /* dy [Cout, cnt*P]: gy[n0] itself when one image, else gathered into stage */
        const float *dy = gyp + n0 * g.cout * g.p;
        if (nb > 1) {
            for (int64_t i = 0; i < cnt; i++)
                for (int64_t co = 0; co < g.cout; co++)
                    memcpy(stage + co * ld + i * g.p, gyp + ((n0 + i) * g.cout + co) * g.p,
                           (size_t)g.p * sizeof(float));
            dy = stage;
        }
        if (gwp) {
            const float *cols = xp + n0 * g.cin * g.h * g.w;
            if (!pointwise) {
                for (int64_t i = 0; i < cnt; i++)
                    im2col(xp + (n0 + i) * g.cin * g.h * g.w, g.cin, &g, col + i * g.p, ld);
                cols = col;
            }
            /* gw_g [Cout_g, K_g] += dy_g [Cout_g, cnt*P] @ col_g^T */
            for (int64_t gi = 0; gi < g.groups; gi++)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)g.cout_g, (int)g.k_g,
                            (int)ld, 1.0f, dy + gi * g.cout_g * ld, (int)ld,
                            cols + gi * g.k_g * ld, (int)ld, 1.0f, gwp + gi * g.cout_g * g.k_g,
                            (int)g.k_g);
        }
        if (gxp) {
            /* gcol_g [K_g, cnt*P] = w_g^T @ dy_g, reusing col; pointwise: straight into gx */
            float *gcol = pointwise ? gxp + n0 * g.cin * g.h * g.w : col;
            for (int64_t gi = 0; gi < g.groups; gi++)
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)g.k_g, (int)ld,
                            (int)g.cout_g, 1.0f, wp + gi * g.cout_g * g.k_g, (int)g.k_g,
                            dy + gi * g.cout_g * ld, (int)ld, 0.0f, gcol + gi * g.k_g * ld,
                            (int)ld);
            if (!pointwise)
                for (int64_t i = 0; i < cnt; i++)
                    col2im(col + i * g.p, ld, g.cin, &g, gxp + (n0 + i) * g.cin * g.h * g.w);
        }
    }
    tdm_scope_end();
    return TDM_OK;
}
