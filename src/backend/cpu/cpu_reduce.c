/* CPU reduction kernels: sum/mean/max over one dim, un-broadcast summation (sum_to), the
 * max gradient, (log-)softmax over the last dim, and the sum of squares for clipping.
 *
 * A reduction over dim of a contiguous tensor sees it as [outer, n, inner]. Sums accumulate
 * in double, in a fixed order (k = 0..n-1 for each output), so results do not depend on
 * how work is split and a long sum loses no precision. When inner > 1 the n rows are added
 * element-wise into a stack buffer of EW_CHUNK doubles, a chunk of inner at a time, which
 * keeps the loop contiguous (vectorised) and allocation-free.
 */
#include <assert.h>
#include <math.h>

#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_lowp.h"
#include "backend/cpu/cpu_isa.h"
#include "backend/cpu/cpu_iter.h"
#include "backend/cpu/cpu_math.h"
#include "tandem/half.h"

#define EW_CHUNK 256

/* outer, n, inner of a reduction over dim of a tensor of this shape */
static void split_dim(const tdm_tensor *t, int dim, int64_t *outer, int64_t *n, int64_t *inner) {
    *outer = 1;
    *inner = 1;
    for (int d = 0; d < dim; d++) *outer *= t->shape[d];
    for (int d = dim + 1; d < t->ndim; d++) *inner *= t->shape[d];
    *n = t->ndim ? t->shape[dim] : 1;
}

/* sum of x[0..n) in double; eight independent partial sums, which the compiler turns into
 * vector adds, in a fixed order */
TDM_CPU_CLONES
static double row_sum(const float *x, int64_t n) {
    double acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j];
    double s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += x[i];
    return s;
}

/* max of x[0..n) (n >= 1) ignoring NaN, in eight lanes that become one vector max; *nan
 * tells whether a NaN was seen */
TDM_CPU_CLONES
static float row_max_nonnan(const float *x, int64_t n, bool *nan) {
    float m[8];
    int bad[8] = {0};
    for (int j = 0; j < 8; j++) m[j] = x[0];
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            float v = x[i + j];
            m[j] = v > m[j] ? v : m[j];
            bad[j] |= v != v;
        }
    float r = m[0] == m[0] ? m[0] : -INFINITY; /* x[0] may itself be the NaN */
    int any = 0;
    for (int j = 0; j < 8; j++) {
        r = m[j] > r ? m[j] : r;
        any |= bad[j];
    }
    for (; i < n; i++) {
        r = x[i] > r ? x[i] : r;
        any |= x[i] != x[i];
    }
    *nan = any || x[0] != x[0];
    return r;
}

/* max of x[0..n) (n >= 1) and its first index; NaN counts as the maximum (as in PyTorch) */
TDM_CPU_CLONES
static float row_max(const float *x, int64_t n, int64_t *arg) {
    bool nan;
    float m = row_max_nonnan(x, n, &nan);
    for (int64_t i = 0; i < n; i++) { /* its first position, stopping there */
        if (nan ? x[i] != x[i] : x[i] == m) {
            *arg = i;
            return x[i];
        }
    }
    *arg = 0; /* unreachable: m is one of the values */
    return m;
}

/* y [outer, inner] = sum (or mean) over k of x [outer, n, inner] */
TDM_CPU_CLONES
static void reduce_sum(float *y, const float *x, int64_t outer, int64_t n, int64_t inner,
                       bool mean) {
    double scale = mean ? 1.0 / (double)n : 1.0; /* n == 0: mean is NaN, as in PyTorch */
    if (mean && n == 0) scale = NAN;
    if (inner == 1) {
        for (int64_t o = 0; o < outer; o++) y[o] = (float)(row_sum(x + o * n, n) * scale);
        return;
    }
    double acc[EW_CHUNK];
    for (int64_t o = 0; o < outer; o++) {
        for (int64_t c = 0; c < inner; c += EW_CHUNK) {
            int64_t len = inner - c < EW_CHUNK ? inner - c : EW_CHUNK;
            for (int64_t j = 0; j < len; j++) acc[j] = 0;
            for (int64_t k = 0; k < n; k++) {
                const float *row = x + (o * n + k) * inner + c;
                for (int64_t j = 0; j < len; j++) acc[j] += row[j];
            }
            float *yo = y + o * inner + c;
            for (int64_t j = 0; j < len; j++) yo[j] = (float)(acc[j] * scale);
        }
    }
}

/* v beats best if larger, or if it is the first NaN (max propagates NaN, as in PyTorch) */
static inline bool max_beats(float v, float best) {
    return v > best || (v != v && best == best);
}

/* y [outer, inner] = max over k of x [outer, n, inner]; am (may be NULL) the first argmax */
TDM_CPU_CLONES
static void reduce_max(float *y, int64_t *am, const float *x, int64_t outer, int64_t n,
                       int64_t inner) {
    float best[EW_CHUNK];
    int64_t arg[EW_CHUNK];
    if (inner == 1) {
        for (int64_t o = 0; o < outer; o++) {
            int64_t a;
            y[o] = row_max(x + o * n, n, &a);
            if (am) am[o] = a;
        }
        return;
    }
    for (int64_t o = 0; o < outer; o++) {
        for (int64_t c = 0; c < inner; c += EW_CHUNK) {
            int64_t len = inner - c < EW_CHUNK ? inner - c : EW_CHUNK;
            const float *x0 = x + o * n * inner + c;
            for (int64_t j = 0; j < len; j++) {
                best[j] = x0[j];
                arg[j] = 0;
            }
            for (int64_t k = 1; k < n; k++) {
                const float *row = x0 + k * inner;
                for (int64_t j = 0; j < len; j++) {
                    if (max_beats(row[j], best[j])) {
                        best[j] = row[j];
                        arg[j] = k;
                    }
                }
            }
            for (int64_t j = 0; j < len; j++) y[o * inner + c + j] = best[j];
            if (am)
                for (int64_t j = 0; j < len; j++) am[o * inner + c + j] = arg[j];
        }
    }
}

int tdm_cpu_reduce(tdm_reduce_op op, tdm_tensor *y, const tdm_tensor *x, int dim,
                   tdm_tensor *argmax) {
    if (tdm_cpu_lowp_any(2, (const tdm_tensor *[]){y, x}))
        return tdm_cpu_lowp_reduce(op, y, x, dim, argmax);
    /* the op (autograd/ops_math.c) refused a tensor that is not f32, a dim out of range and
     * a max over an empty dim; it hands x contiguous and allocates y (and argmax) for it */
    assert(ew_all_f32(2, (const tdm_tensor *[]){y, x}) && tdm_is_contiguous(x) &&
           tdm_is_contiguous(y));
    assert(x->ndim == 0 || (dim >= 0 && dim < x->ndim));
    int64_t outer, n, inner;
    split_dim(x, dim, &outer, &n, &inner);
    assert(tdm_numel(y) == outer * inner);
    float *yp = (float *)tdm_data_ptr(y);
    const float *xp = (const float *)tdm_data_ptr(x);
    switch (op) {
    case TDM_RED_SUM:
    case TDM_RED_MEAN:
        reduce_sum(yp, xp, outer, n, inner, op == TDM_RED_MEAN);
        return TDM_OK;
    case TDM_RED_MAX:
        assert(n > 0 || outer * inner == 0);
        assert(!argmax || (argmax->dtype == TDM_I64 && tdm_is_contiguous(argmax) &&
                           tdm_numel(argmax) == outer * inner));
        reduce_max(yp, argmax ? (int64_t *)tdm_data_ptr(argmax) : NULL, xp, outer, n, inner);
        return TDM_OK;
    }
    return tdm_raise(TDM_ERR_ARG, "cpu reduce: unknown op %d", (int)op);
}

/* ---- sum_to: the reverse of broadcasting ------------------------------------------------ */

TDM_CPU_CLONES
int tdm_cpu_sum_to(tdm_tensor *y, const tdm_tensor *x) {
    if (tdm_cpu_lowp_any(2, (const tdm_tensor *[]){y, x})) return tdm_cpu_lowp_sum_to(y, x);
    if (ew_check_f32("cpu sum_to", 2, (const tdm_tensor *[]){y, x})) return tdm_last_status();
    if (!tdm_is_contiguous(x) || !tdm_is_contiguous(y))
        return tdm_raise(TDM_ERR_ARG, "cpu sum_to: x and y must be contiguous");
    /* y's dims right-aligned against x's; missing leading dims and size-1 dims of y are
     * summed over (stride 0 in the walk) */
    int nd = x->ndim, lead = x->ndim - y->ndim;
    int64_t ys[TDM_MAX_DIMS], yst[TDM_MAX_DIMS], xst[TDM_MAX_DIMS];
    bool ok = lead >= 0;
    if (ok) tdm_contiguous_strides(y->ndim, y->shape, ys);
    for (int d = 0; ok && d < nd; d++) {
        int64_t yd = d < lead ? 1 : y->shape[d - lead];
        if (yd == x->shape[d])
            yst[d] = d < lead ? 0 : ys[d - lead];
        else if (yd == 1)
            yst[d] = 0;
        else
            ok = false;
    }
    if (!ok) {
        char sx[96], sy[96];
        return tdm_raise(TDM_ERR_SHAPE, "cpu sum_to: %s does not broadcast to %s",
                         tdm_shape_str(tdm_shape_of(y), sy), tdm_shape_str(tdm_shape_of(x), sx));
    }
    float *yp = (float *)tdm_data_ptr(y);
    const float *xp = (const float *)tdm_data_ptr(x);
    int64_t ny = tdm_numel(y);
    for (int64_t i = 0; i < ny; i++) yp[i] = 0;
    if (tdm_numel(x) == 0) return TDM_OK;
    if (ny == tdm_numel(x)) { /* nothing to sum: a copy */
        for (int64_t i = 0; i < ny; i++) yp[i] = xp[i];
        return TDM_OK;
    }
    tdm_contiguous_strides(nd, x->shape, xst);
    const int64_t *st[2] = {xst, yst};
    ew_iter it;
    int64_t off[EW_MAX_OPS], idx[TDM_MAX_DIMS];
    ew_init(&it, nd, x->shape, 2, st);
    ew_begin(&it, idx, off);
    int64_t n = it.n, sy = it.inner[1];
    /* x is contiguous, so after merging its rows have unit stride */
    for (int64_t r = 0; r < it.rows; r++, ew_next(&it, idx, off)) {
        const float *xr = xp + off[0];
        float *yr = yp + off[1];
        if (sy == 0) {
            yr[0] += (float)row_sum(xr, n); /* [.., n] -> [.., 1] */
        } else if (sy == 1) {
            for (int64_t i = 0; i < n; i++) yr[i] += xr[i]; /* [m, n] -> [1, n] */
        } else {
            for (int64_t i = 0; i < n; i++) yr[i * sy] += xr[i];
        }
    }
    return TDM_OK;
}

/* ---- max backward ----------------------------------------------------------------------- */

TDM_CPU_CLONES
int tdm_cpu_max_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *argmax, int dim) {
    if (tdm_cpu_lowp_any(2, (const tdm_tensor *[]){gx, gy}))
        return tdm_cpu_lowp_max_backward(gx, gy, argmax, dim);
    /* the forward op checked dim; its backward hands the forward's argmax and dense tensors */
    assert(ew_all_f32(2, (const tdm_tensor *[]){gx, gy}) && argmax->dtype == TDM_I64);
    assert(tdm_is_contiguous(gx) && tdm_is_contiguous(gy) && tdm_is_contiguous(argmax));
    assert(gx->ndim == 0 || (dim >= 0 && dim < gx->ndim));
    int64_t outer, n, inner;
    split_dim(gx, dim, &outer, &n, &inner);
    assert(tdm_numel(gy) == outer * inner && tdm_numel(argmax) == outer * inner);
    float *g = (float *)tdm_data_ptr(gx);
    const float *gyp = (const float *)tdm_data_ptr(gy);
    const int64_t *am = (const int64_t *)tdm_data_ptr(argmax);
    int64_t ng = tdm_numel(gx);
    for (int64_t i = 0; i < ng; i++) g[i] = 0;
    for (int64_t o = 0; o < outer; o++) {
        for (int64_t j = 0; j < inner; j++) {
            int64_t k = am[o * inner + j];
            if (k < 0 || k >= n)
                return tdm_raise(TDM_ERR_ARG,
                                 "cpu max_backward: argmax %lld out of range [0, %lld)",
                                 (long long)k, (long long)n);
            g[(o * n + k) * inner + j] = gyp[o * inner + j];
        }
    }
    return TDM_OK;
}

/* ---- softmax over the last dim ---------------------------------------------------------- */

/* The contract: f32 (the op refused other dtypes), contiguous, one shape (c may be NULL). */
static inline bool softmax_args_ok(const tdm_tensor *a, const tdm_tensor *b, const tdm_tensor *c) {
    const tdm_tensor *ts[3] = {a, b, c};
    int n = c ? 3 : 2;
    if (!ew_all_f32(n, ts)) return false;
    for (int i = 0; i < n; i++)
        if (!tdm_is_contiguous(ts[i]) || !ew_same_shape(ts[i], a)) return false;
    return true;
}

/* Subtracting the row max keeps every exp in (0, 1], so nothing overflows. */
TDM_CPU_CLONES
static void softmax_row(float *y, const float *x, int64_t n, bool is_log) {
    bool nan;
    float m = row_max_nonnan(x, n, &nan);
    if (nan) m = NAN; /* a NaN anywhere makes the whole row NaN, as in PyTorch */
    if (is_log) {
        for (int64_t i = 0; i < n; i++) y[i] = tdm_expf(x[i] - m); /* scratch */
        /* (x - m) is exact for x near m, so this keeps precision for large logits */
        float ls = (float)log(row_sum(y, n));
        for (int64_t i = 0; i < n; i++) y[i] = (x[i] - m) - ls;
    } else {
        for (int64_t i = 0; i < n; i++) y[i] = tdm_expf(x[i] - m);
        float inv = (float)(1.0 / row_sum(y, n));
        for (int64_t i = 0; i < n; i++) y[i] *= inv;
    }
}

int tdm_cpu_softmax(tdm_tensor *y, const tdm_tensor *x, bool is_log) {
    if (tdm_cpu_lowp_any(2, (const tdm_tensor *[]){y, x}))
        return tdm_cpu_lowp_softmax(y, x, is_log);
    assert(softmax_args_ok(y, x, NULL));
    int64_t n = x->ndim ? x->shape[x->ndim - 1] : 1, numel = tdm_numel(x);
    if (numel == 0) return TDM_OK;
    float *yp = (float *)tdm_data_ptr(y);
    const float *xp = (const float *)tdm_data_ptr(x);
    for (int64_t r = 0; r < numel / n; r++) softmax_row(yp + r * n, xp + r * n, n, is_log);
    return TDM_OK;
}

/* softmax: gx = y * (gy - sum(gy * y)); log-softmax: gx = gy - exp(y) * sum(gy). */
TDM_CPU_CLONES
int tdm_cpu_softmax_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *y,
                             bool is_log) {
    if (tdm_cpu_lowp_any(3, (const tdm_tensor *[]){gx, gy, y}))
        return tdm_cpu_lowp_softmax_backward(gx, gy, y, is_log);
    assert(softmax_args_ok(gx, gy, y));
    int64_t n = gx->ndim ? gx->shape[gx->ndim - 1] : 1, numel = tdm_numel(gx);
    if (numel == 0) return TDM_OK;
    float *g = (float *)tdm_data_ptr(gx);
    const float *gyp = (const float *)tdm_data_ptr(gy), *yp = (const float *)tdm_data_ptr(y);
    for (int64_t r = 0; r < numel / n; r++) {
        float *gr = g + r * n;
        const float *gyr = gyp + r * n, *yr = yp + r * n;
        double dot = 0;
        if (is_log) {
            dot = row_sum(gyr, n);
            float d = (float)dot;
            for (int64_t i = 0; i < n; i++) gr[i] = gyr[i] - tdm_expf(yr[i]) * d;
        } else {
            for (int64_t i = 0; i < n; i++) dot += (double)gyr[i] * yr[i];
            float d = (float)dot;
            for (int64_t i = 0; i < n; i++) gr[i] = yr[i] * (gyr[i] - d);
        }
    }
    return TDM_OK;
}

/* ---- sum of squares --------------------------------------------------------------------- */

/* *s0, *s1 += the squares of row[0..n) (stride sx), in pairs (i even into s0, i + 1 into
 * s1) and an odd last element into s0: the order both paths below keep. */
static inline void sum_squares_row(const float *row, int64_t sx, int64_t n, double *s0,
                                   double *s1) {
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
        double a = row[i * sx], b = row[(i + 1) * sx];
        *s0 += a * a;
        *s1 += b * b;
    }
    for (; i < n; i++) {
        double a = row[i * sx];
        *s0 += a * a;
    }
}

/* Elements of a bf16 or f16 row widened at a time (even, so that pairs stay the fp32 path's) */
#define SQ_CHUNK 512

/* Accepts any strides (a parameter's gradient may be a view into the flat buffer). A bf16 or
 * f16 x is widened a chunk at a time into a stack buffer: the same double as the fp32 path
 * gives for x's values, with no temporary tensor. */
TDM_CPU_CLONES
int tdm_cpu_sum_squares(double *out, const tdm_tensor *x) {
    bool lowp = tdm_cpu_lowp_any(1, &x);
    if (!lowp && ew_check_f32("cpu sum_squares", 1, &x)) return tdm_last_status();
    *out = 0;
    if (tdm_numel(x) == 0) return TDM_OK;
    int64_t off[EW_MAX_OPS], idx[TDM_MAX_DIMS];
    const int64_t *st[1] = {x->strides};
    ew_iter it;
    ew_init(&it, x->ndim, x->shape, 1, st);
    ew_begin(&it, idx, off);
    double s0 = 0, s1 = 0;
    if (!lowp) {
        const float *xp = (const float *)tdm_data_ptr(x);
        for (int64_t r = 0; r < it.rows; r++, ew_next(&it, idx, off))
            sum_squares_row(xp + off[0], it.inner[0], it.n, &s0, &s1);
        *out = s0 + s1;
        return TDM_OK;
    }
    const uint16_t *hp = (const uint16_t *)tdm_data_ptr(x);
    float buf[SQ_CHUNK];
    for (int64_t r = 0; r < it.rows; r++, ew_next(&it, idx, off)) {
        int64_t sx = it.inner[0];
        for (int64_t c = 0; c < it.n; c += SQ_CHUNK) {
            int64_t len = it.n - c < SQ_CHUNK ? it.n - c : SQ_CHUNK;
            const uint16_t *p = hp + off[0] + c * sx;
            if (sx == 1 && x->dtype == TDM_BF16)
                tdm_bf16_to_f32(buf, p, (size_t)len);
            else if (sx == 1)
                tdm_f16_to_f32(buf, p, (size_t)len);
            else
                for (int64_t i = 0; i < len; i++)
                    buf[i] = x->dtype == TDM_BF16 ? tdm_bf16_to_float(p[i * sx])
                                                  : tdm_f16_to_float(p[i * sx]);
            sum_squares_row(buf, 1, len, &s0, &s1);
        }
    }
    *out = s0 + s1;
    return TDM_OK;
}
