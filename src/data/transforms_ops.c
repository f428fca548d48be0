/* The pixel kernels of the image transforms, each on one image [c, h, w] f32 with its
 * parameters given (the draws are elsewhere). They follow torchvision's tensor path and
 * PyTorch's CPU kernels down to the float operations where that is cheap (the resize's
 * weights, the blends), so that outputs agree with torchvision's to a few float ulps. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "data/transforms_internal.h"

/* ---- antialiased bilinear resize -------------------------------------------------------- */

/* The weights of one axis of a resize in -> out for the outputs [first, first + count): output
 * i reads n[i] inputs from lo[i] with weights w[i * taps ...]. */
typedef struct {
    int taps;
    int64_t *lo;
    int *n;
    float *w;
} tf_axis;

/* PIL's triangle filter (PyTorch's HelperInterpLinear::aa_filter), in its float/double mix */
static float triangle(float x) {
    x = fabsf(x);
    return x < 1.0f ? (float)(1.0 - (double)x) : 0.0f;
}

/* The support of the filter: 1 input pixel when enlarging, in/out (the downscale factor) when
 * shrinking, so that every input pixel contributes (the antialiasing). */
static float axis_scale(int64_t in, int64_t out, float *support, int *taps) {
    float scale = (float)in / (float)out;
    *support = scale >= 1.0f ? scale : 1.0f;
    *taps = (int)ceilf(*support) * 2 + 1;
    return scale;
}

/* PyTorch's _compute_indices_min_size_weights_aa with scalar_t = float, operation for
 * operation: which inputs an output reads depends on the float rounding of its center. */
static void axis_weights(int64_t in, int64_t out, int64_t first, int64_t count, tf_axis *a) {
    float support;
    int taps;
    float scale = axis_scale(in, out, &support, &taps);
    float invscale = scale >= 1.0f ? (float)(1.0 / (double)scale) : 1.0f;
    for (int64_t k = 0; k < count; k++) {
        int64_t i = first + k;
        float center = (float)((double)scale * ((double)i + 0.5));
        int64_t xmin = (int64_t)((double)(center - support) + 0.5);
        if (xmin < 0) xmin = 0;
        int64_t xmax = (int64_t)((double)(center + support) + 0.5);
        int64_t xsize = (xmax < in ? xmax : in) - xmin;
        if (xsize < 0) xsize = 0;
        if (xsize > taps) xsize = taps;
        float *w = a->w + k * taps, total = 0.0f;
        for (int64_t j = 0; j < xsize; j++) {
            w[j] = triangle((float)(((double)((float)(j + xmin) - center) + 0.5) * invscale));
            total += w[j];
        }
        if (total != 0.0f)
            for (int64_t j = 0; j < xsize; j++) w[j] /= total;
        a->lo[k] = xmin;
        a->n[k] = (int)xsize;
    }
}

/* Gives every output of the axis the same number of weights, the most any has, by adding
 * zero weights after its own (or before them, moving lo back, at the end of the row): the
 * horizontal pass then runs a loop of one trip count, without the mispredicted branches of
 * counts that change from pixel to pixel (3 or 4 alternating when shrinking by 1.5: twice the
 * time). Exact for finite pixels: t + 0 * s is t, and 0 * s + x is x. Returns the count. */
static int axis_pad(tf_axis *a, int64_t in, int64_t count) {
    int most = 0;
    for (int64_t k = 0; k < count; k++) most = a->n[k] > most ? a->n[k] : most;
    for (int64_t k = 0; k < count; k++) {
        float *w = a->w + k * a->taps;
        int64_t shift = a->lo[k] + most > in ? a->lo[k] + most - in : 0;
        memmove(w + shift, w, (size_t)a->n[k] * sizeof(float));
        for (int64_t j = 0; j < shift; j++) w[j] = 0.0f;
        for (int64_t j = shift + a->n[k]; j < most; j++) w[j] = 0.0f;
        a->lo[k] -= shift;
        a->n[k] = most;
    }
    return most;
}

/* One output of the horizontal pass, summed in PyTorch's order; n is a constant where the
 * callers below inline it, so the loop unrolls. */
static inline float dot_taps(const float *s, const float *w, int n) {
    float t = s[0] * w[0];
    for (int j = 1; j < n; j++) t += s[j] * w[j];
    return t;
}

/* Horizontal pass over one row: dst[k] = sum_j src[lo[k] + j] * w[k][j]; every output has
 * a->n[0] weights (axis_pad). */
static void resample_row(const float *restrict src, const tf_axis *a, int64_t count,
                         float *restrict dst) {
    const int64_t *lo = a->lo;
    const float *w = a->w;
    int taps = a->taps, n = count > 0 ? a->n[0] : 0;
    switch (n) {
    case 2:
        for (int64_t k = 0; k < count; k++) dst[k] = dot_taps(src + lo[k], w + k * taps, 2);
        break;
    case 3:
        for (int64_t k = 0; k < count; k++) dst[k] = dot_taps(src + lo[k], w + k * taps, 3);
        break;
    case 4:
        for (int64_t k = 0; k < count; k++) dst[k] = dot_taps(src + lo[k], w + k * taps, 4);
        break;
    case 5:
        for (int64_t k = 0; k < count; k++) dst[k] = dot_taps(src + lo[k], w + k * taps, 5);
        break;
    default:
        for (int64_t k = 0; k < count; k++)
            dst[k] = n > 0 ? dot_taps(src + lo[k], w + k * taps, n) : 0.0f;
    }
}

/* Vertical pass for one output row of cols: a weighted sum of whole input rows, row0 being
 * input row `base`; the inner loops run over contiguous columns and vectorise. */
static void resample_col(const float *src, int64_t stride, int64_t base, const tf_axis *a,
                         int64_t k, int64_t cols, float *restrict dst) {
    const float *w = a->w + k * a->taps;
    const float *restrict s0 = src + (a->lo[k] - base) * stride;
    if (a->n[k] == 0) {
        memset(dst, 0, (size_t)cols * sizeof(float));
        return;
    }
    for (int64_t x = 0; x < cols; x++) dst[x] = s0[x] * w[0];
    for (int j = 1; j < a->n[k]; j++) {
        const float *restrict s = s0 + j * stride;
        float wj = w[j];
        for (int64_t x = 0; x < cols; x++) dst[x] += s[x] * wj;
    }
}

/* The weights of both axes (one allocation) and the horizontal pass's rows (another, sized
 * once the vertical weights say which rows are read). */
typedef struct {
    tf_axis ax, ay;
    void *mem;
} tf_plan;

static int plan_make(tdm_tf_box src, int64_t oh, int64_t ow, tdm_tf_box part, bool hpass,
                     bool vpass, tf_plan *p) {
    float support;
    int tx = 1, ty = 1;
    if (hpass) axis_scale(src.w, ow, &support, &tx);
    if (vpass) axis_scale(src.h, oh, &support, &ty);
    /* int64 first, then int, then float: each part stays aligned */
    size_t bytes = (size_t)(part.w + part.h) * (sizeof(int64_t) + sizeof(int)) +
                   (size_t)(part.w * tx + part.h * ty) * sizeof(float);
    p->mem = malloc(bytes);
    if (!p->mem) return tdm_raise(TDM_ERR_NOMEM, "transform: resize weights of %zu bytes", bytes);
    int64_t *lo = p->mem;
    int *n = (int *)(lo + part.w + part.h);
    float *w = (float *)(n + part.w + part.h);
    p->ax = (tf_axis){tx, lo, n, w};
    p->ay = (tf_axis){ty, lo + part.w, n + part.w, w + part.w * tx};
    if (hpass) {
        axis_weights(src.w, ow, part.left, part.w, &p->ax);
        axis_pad(&p->ax, src.w, part.w);
    }
    if (vpass) axis_weights(src.h, oh, part.top, part.h, &p->ay);
    return TDM_OK;
}

int tdm_tf_resample(const float *in, int64_t c, int64_t H, int64_t W, tdm_tf_box src, int64_t oh,
                    int64_t ow, tdm_tf_box part, float *out) {
    /* PyTorch resizes the last dimension first, then the rows, and skips a dimension whose
     * size does not change (its weights would be the identity) */
    bool hpass = src.w != ow, vpass = src.h != oh;
    tf_plan p = {0};
    int st = plan_make(src, oh, ow, part, hpass, vpass, &p);
    if (st) return st;
    /* the window rows the vertical pass reads: lo does not decrease with the output row */
    int64_t r0 = part.top, r1 = part.top + part.h;
    if (vpass) r0 = p.ay.lo[0], r1 = p.ay.lo[part.h - 1] + p.ay.n[part.h - 1];
    float *tmp = NULL;
    if (hpass && !(tmp = malloc((size_t)((r1 - r0) * part.w) * sizeof(float)))) {
        free(p.mem);
        return tdm_raise(TDM_ERR_NOMEM, "transform: resize rows [%lld, %lld]", (long long)(r1 - r0),
                         (long long)part.w);
    }
    for (int64_t ch = 0; ch < c; ch++) {
        const float *base = in + ch * H * W + src.top * W + src.left;
        const float *rows = base + part.left; /* the vertical pass's input, row 0 = window row */
        int64_t stride = W, row0 = 0;
        if (hpass) {
            for (int64_t r = r0; r < r1; r++)
                resample_row(base + r * W, &p.ax, part.w, tmp + (r - r0) * part.w);
            rows = tmp, stride = part.w, row0 = r0;
        }
        float *o = out + ch * part.h * part.w;
        for (int64_t k = 0; k < part.h; k++) {
            if (vpass)
                resample_col(rows, stride, row0, &p.ay, k, part.w, o + k * part.w);
            else
                memcpy(o + k * part.w, rows + (part.top + k - row0) * stride,
                       (size_t)part.w * sizeof(float));
        }
    }
    free(tmp);
    free(p.mem);
    return TDM_OK;
}

/* ---- geometry ----------------------------------------------------------------------------- */

void tdm_tf_crop(const float *in, int64_t c, int64_t H, int64_t W, tdm_tf_box box, float *out) {
    /* the columns of every row that come from the image: [x0, x1) of the output */
    int64_t x0 = box.left < 0 ? -box.left : 0;
    int64_t x1 = W - box.left < box.w ? W - box.left : box.w;
    if (x1 < x0) x1 = x0;
    for (int64_t ch = 0; ch < c; ch++) {
        for (int64_t y = 0; y < box.h; y++) {
            float *o = out + (ch * box.h + y) * box.w;
            int64_t sy = box.top + y;
            if (sy < 0 || sy >= H || x1 == x0) {
                memset(o, 0, (size_t)box.w * sizeof(float));
                continue;
            }
            memset(o, 0, (size_t)x0 * sizeof(float));
            memcpy(o + x0, in + (ch * H + sy) * W + box.left + x0,
                   (size_t)(x1 - x0) * sizeof(float));
            memset(o + x1, 0, (size_t)(box.w - x1) * sizeof(float));
        }
    }
}

void tdm_tf_hflip(const float *in, int64_t c, int64_t h, int64_t w, float *out) {
    for (int64_t r = 0; r < c * h; r++) {
        const float *s = in + r * w;
        float *d = out + r * w;
        for (int64_t a = 0, b = w - 1; a <= b; a++, b--) {
            float t = s[a]; /* both ends read before either is written: in == out works */
            d[a] = s[b];
            d[b] = t;
        }
    }
}

/* ---- colour ------------------------------------------------------------------------------ */

/* torchvision's rgb_to_grayscale in float: (0.2989 r + 0.587 g) + 0.114 b */
static inline float grey(float r, float g, float b) {
    return 0.2989f * r + 0.587f * g + 0.114f * b;
}

static inline float clamp01(float v) {
    return v < 0.0f ? 0.0f : (v > 1.0f ? 1.0f : v);
}

/* torchvision's _blend(x, other, ratio) = clamp(ratio * x + (1 - ratio) * other, 0, 1), its
 * two scalars rounded to float as PyTorch does */
typedef struct {
    float r, q;
} tf_blend;

static tf_blend blend_of(float factor) {
    return (tf_blend){factor, (float)(1.0 - (double)factor)};
}

void tdm_tf_brightness(float *x, int64_t c, int64_t h, int64_t w, float factor) {
    tf_blend b = blend_of(factor); /* with black: the second term is 0 */
    for (int64_t i = 0; i < c * h * w; i++) x[i] = clamp01(b.r * x[i] + b.q * 0.0f);
}

void tdm_tf_contrast(float *x, int64_t c, int64_t h, int64_t w, float factor) {
    int64_t n = h * w;
    double sum = 0.0; /* PyTorch's mean sums in float by blocks; a double sum agrees to 1 ulp */
    if (c == 3)
        for (int64_t i = 0; i < n; i++) sum += grey(x[i], x[n + i], x[2 * n + i]);
    else
        for (int64_t i = 0; i < c * n; i++) sum += x[i];
    float mean = (float)(sum / (double)(c == 3 ? n : c * n));
    tf_blend b = blend_of(factor);
    float other = b.q * mean;
    for (int64_t i = 0; i < c * n; i++) x[i] = clamp01(b.r * x[i] + other);
}

void tdm_tf_saturation(float *x, int64_t c, int64_t h, int64_t w, float factor) {
    if (c != 3) return; /* torchvision: a grey image is left as it is (PIL's behaviour) */
    int64_t n = h * w;
    tf_blend b = blend_of(factor);
    for (int64_t i = 0; i < n; i++) {
        float g = b.q * grey(x[i], x[n + i], x[2 * n + i]);
        for (int64_t k = 0; k < 3; k++) x[k * n + i] = clamp01(b.r * x[k * n + i] + g);
    }
}

void tdm_tf_grayscale(const float *in, int64_t c, int64_t h, int64_t w, int out_c, float *out) {
    int64_t n = h * w;
    if (c == 3)
        for (int64_t i = 0; i < n; i++) out[i] = grey(in[i], in[n + i], in[2 * n + i]);
    else
        memcpy(out, in, (size_t)n * sizeof(float));
    for (int k = 1; k < out_c; k++) memcpy(out + k * n, out, (size_t)n * sizeof(float));
}

void tdm_tf_normalize(const float *in, int64_t c, int64_t h, int64_t w, const float *mean,
                      const float *std, float *out) {
    int64_t n = h * w;
    for (int64_t k = 0; k < c; k++) {
        float m = mean[c == 1 ? 0 : k], s = std[c == 1 ? 0 : k];
        const float *x = in + k * n;
        float *y = out + k * n;
        for (int64_t i = 0; i < n; i++) y[i] = (x[i] - m) / s; /* sub_ then div_ */
    }
}

void tdm_tf_erase(float *x, int64_t c, int64_t h, int64_t w, tdm_tf_box box, float value) {
    for (int64_t k = 0; k < c; k++)
        for (int64_t y = box.top; y < box.top + box.h && y < h; y++)
            for (int64_t i = box.left; i < box.left + box.w && i < w; i++)
                x[(k * h + y) * w + i] = value;
}
