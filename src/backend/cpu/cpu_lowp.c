/* The widening adapter: every float kernel of the CPU backend in bf16 and f16 (cpu_lowp.h).
 *
 * A wrapper per kernel says which of its tensors the kernel reads (lp_in), writes whole
 * (lp_out) or reads and writes (lp_inout: accumulating outputs, matmul's C when beta != 0).
 * Each bf16 or f16 tensor among them gets an fp32 twin with its shape and strides over a
 * temporary block from the device's caching allocator: the block covers the span of storage
 * the view reaches (a broadcast operand with stride 0 stays small), converted from the
 * caller's bits when the kernel reads it. The fp32 kernel runs on the twins; then each
 * written twin is rounded, once, into the caller's tensor (outputs are contiguous, as every
 * kernel's contract has them; a strided one is refused), and the blocks go back to the cache.
 * A kernel that fails leaves the caller's low-precision outputs untouched.
 *
 * Correct by construction: the arithmetic is the fp32 kernel's on the exact fp32 values of
 * the inputs (bf16 and f16 widen exactly), and the only new error is the output's rounding.
 */
#include "backend/cpu/cpu_lowp.h"

#include <string.h>

#include "backend/cpu/cpu.h"
#include "tandem/half.h"

/* The most tensors a kernel takes (batch_norm: 8). */
#define LP_MAX 10

typedef enum { LP_IN, LP_OUT, LP_INOUT } lp_mode;

typedef struct {
    const tdm_tensor *orig; /* the caller's bf16 or f16 tensor */
    lp_mode mode;
    int64_t lo;       /* the span's first element, relative to orig's first element (<= 0) */
    int64_t span;     /* elements of storage orig's view reaches */
    tdm_storage *buf; /* the fp32 block */
    tdm_tensor wide;  /* the fp32 twin: orig's geometry over buf */
} lp_arg;

typedef struct {
    const char *what; /* the kernel, for errors */
    int status;       /* TDM_ERR_NOMEM once a block could not be had */
    int n;
    lp_arg a[LP_MAX];
} lp_call;

static bool is_lowp(const tdm_tensor *t) {
    return t && (t->dtype == TDM_BF16 || t->dtype == TDM_F16);
}

/* Registers t and returns the tensor the fp32 kernel is to see: t itself unless it is bf16
 * or f16, else its fp32 twin (converted from t's values unless the kernel only writes it). */
static tdm_tensor *lp_arg_add(lp_call *c, const tdm_tensor *t, lp_mode mode) {
    if (!is_lowp(t) || c->status) return (tdm_tensor *)t;
    if (c->n == LP_MAX) { /* a wrapper passes at most LP_MAX tensors: cannot happen */
        c->status = tdm_raise(TDM_ERR_STATE, "%s: too many bf16/f16 operands", c->what);
        return (tdm_tensor *)t;
    }
    if (mode != LP_IN && !tdm_is_contiguous(t)) { /* every kernel's outputs are contiguous */
        char sh[96];
        c->status = tdm_raise(TDM_ERR_ARG, "%s: a %s output %s must be contiguous", c->what,
                              tdm_dtype_name(t->dtype), tdm_shape_str(tdm_shape_of(t), sh));
        return (tdm_tensor *)t;
    }
    lp_arg *a = &c->a[c->n];
    int64_t lo = 0, hi = 0;
    for (int d = 0; d < t->ndim; d++) {
        int64_t reach = (t->shape[d] - 1) * t->strides[d];
        if (reach < 0)
            lo += reach;
        else
            hi += reach;
    }
    int64_t span = tdm_numel(t) ? hi - lo + 1 : 0;
    /* one float at least, so that the twin has memory even when empty */
    tdm_storage *buf = tdm_storage_new((size_t)(span ? span : 1) * sizeof(float), t->device);
    if (!buf) {
        char sh[96];
        c->status =
            tdm_raise(TDM_ERR_NOMEM, "%s: no memory for the fp32 copy of a %s %s tensor", c->what,
                      tdm_dtype_name(t->dtype), tdm_shape_str(tdm_shape_of(t), sh));
        return (tdm_tensor *)t;
    }
    *a = (lp_arg){.orig = t, .mode = mode, .lo = lo, .span = span, .buf = buf};
    a->wide.dtype = TDM_F32;
    a->wide.ndim = t->ndim;
    memcpy(a->wide.shape, t->shape, sizeof t->shape);
    memcpy(a->wide.strides, t->strides, sizeof t->strides);
    a->wide.offset = -lo;
    a->wide.device = t->device;
    a->wide.storage = buf;
    if (mode != LP_OUT && span)
        tdm_cpu_lowp_widen(buf->data, (const uint16_t *)tdm_data_ptr(t) + lo, span, t->dtype);
    c->n++;
    return &a->wide;
}

static const tdm_tensor *lp_in(lp_call *c, const tdm_tensor *t) {
    return lp_arg_add(c, t, LP_IN);
}
static tdm_tensor *lp_out(lp_call *c, tdm_tensor *t) {
    return lp_arg_add(c, t, LP_OUT);
}
static tdm_tensor *lp_inout(lp_call *c, tdm_tensor *t) {
    return lp_arg_add(c, t, LP_INOUT);
}

/* Ends a call: rounds the outputs into the caller's tensors when the kernel succeeded, gives
 * the blocks back, and returns status. */
static int lp_end(lp_call *c, int status) {
    for (int i = 0; i < c->n; i++) {
        const lp_arg *a = &c->a[i];
        if (status == TDM_OK && a->mode != LP_IN)
            tdm_cpu_lowp_narrow(tdm_data_ptr(a->orig), tdm_data_ptr(&a->wide), a->span,
                                a->orig->dtype);
        tdm_storage_release(c->a[i].buf);
    }
    return status;
}

/* The kernel's status, or the adapter's when a temporary failed (the kernel not run). */
#define LP_RUN(c, call) lp_end(&(c), (c).status ? (c).status : (call))

/* ---- reductions ------------------------------------------------------------------------- */

int tdm_cpu_lowp_reduce(tdm_reduce_op op, tdm_tensor *y, const tdm_tensor *x, int dim,
                        tdm_tensor *argmax) {
    lp_call c = {.what = "cpu reduce"};
    tdm_tensor *wy = lp_out(&c, y);
    const tdm_tensor *wx = lp_in(&c, x);
    return LP_RUN(c, tdm_cpu_reduce(op, wy, wx, dim, argmax));
}

int tdm_cpu_lowp_sum_to(tdm_tensor *y, const tdm_tensor *x) {
    lp_call c = {.what = "cpu sum_to"};
    tdm_tensor *wy = lp_out(&c, y);
    const tdm_tensor *wx = lp_in(&c, x);
    return LP_RUN(c, tdm_cpu_sum_to(wy, wx));
}

int tdm_cpu_lowp_max_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *argmax,
                              int dim) {
    lp_call c = {.what = "cpu max_backward"};
    tdm_tensor *wgx = lp_out(&c, gx);
    const tdm_tensor *wgy = lp_in(&c, gy);
    return LP_RUN(c, tdm_cpu_max_backward(wgx, wgy, argmax, dim));
}

int tdm_cpu_lowp_softmax(tdm_tensor *y, const tdm_tensor *x, bool log) {
    lp_call c = {.what = "cpu softmax"};
    tdm_tensor *wy = lp_out(&c, y);
    const tdm_tensor *wx = lp_in(&c, x);
    return LP_RUN(c, tdm_cpu_softmax(wy, wx, log));
}

int tdm_cpu_lowp_softmax_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *y,
                                  bool log) {
    lp_call c = {.what = "cpu softmax_backward"};
    tdm_tensor *wgx = lp_out(&c, gx);
    const tdm_tensor *wgy = lp_in(&c, gy), *wy = lp_in(&c, y);
    return LP_RUN(c, tdm_cpu_softmax_backward(wgx, wgy, wy, log));
}

/* ---- matrix products -------------------------------------------------------------------- */

/* The combinations the bf16 GEMM does not take (f16, bf16 with f32); tdm_cpu_matmul runs
 * bf16 operands itself. */
int tdm_cpu_lowp_matmul(tdm_tensor *cm, const tdm_tensor *a, const tdm_tensor *b, bool ta, bool tb,
                        float beta) {
    lp_call c = {.what = "cpu matmul"};
    tdm_tensor *wc = beta != 0.0f ? lp_inout(&c, cm) : lp_out(&c, cm);
    const tdm_tensor *wa = lp_in(&c, a), *wb = lp_in(&c, b);
    return LP_RUN(c, tdm_cpu_matmul(wc, wa, wb, ta, tb, beta));
}

/* ---- indexing --------------------------------------------------------------------------- */

int tdm_cpu_lowp_index_select(tdm_tensor *y, const tdm_tensor *x, int dim, const tdm_tensor *idx) {
    lp_call c = {.what = "cpu index_select"};
    tdm_tensor *wy = lp_out(&c, y);
    const tdm_tensor *wx = lp_in(&c, x);
    return LP_RUN(c, tdm_cpu_index_select(wy, wx, dim, idx));
}

int tdm_cpu_lowp_index_add(tdm_tensor *gx, int dim, const tdm_tensor *idx, const tdm_tensor *gy) {
    lp_call c = {.what = "cpu index_add"};
    tdm_tensor *wgx = lp_inout(&c, gx);
    const tdm_tensor *wgy = lp_in(&c, gy);
    return LP_RUN(c, tdm_cpu_index_add(wgx, dim, idx, wgy));
}

/* ---- convolution and pooling ------------------------------------------------------------ */

int tdm_cpu_lowp_conv2d(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w,
                        const tdm_tensor *b, const tdm_conv2d_args *args) {
    lp_call c = {.what = "cpu conv2d"};
    tdm_tensor *wy = lp_out(&c, y);
    const tdm_tensor *wx = lp_in(&c, x), *ww = lp_in(&c, w), *wb = lp_in(&c, b);
    return LP_RUN(c, tdm_cpu_conv2d(wy, wx, ww, wb, args));
}

int tdm_cpu_lowp_conv2d_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                 const tdm_tensor *gy, const tdm_tensor *x, const tdm_tensor *w,
                                 const tdm_conv2d_args *args) {
    lp_call c = {.what = "cpu conv2d_backward"};
    tdm_tensor *wgx = lp_out(&c, gx), *wgw = lp_out(&c, gw), *wgb = lp_out(&c, gb);
    const tdm_tensor *wgy = lp_in(&c, gy), *wx = lp_in(&c, x), *ww = lp_in(&c, w);
    return LP_RUN(c, tdm_cpu_conv2d_backward(wgx, wgw, wgb, wgy, wx, ww, args));
}

int tdm_cpu_lowp_max_pool2d(tdm_tensor *y, tdm_tensor *idx, const tdm_tensor *x,
                            const tdm_pool2d_args *args) {
    lp_call c = {.what = "cpu max_pool2d"};
    tdm_tensor *wy = lp_out(&c, y);
    const tdm_tensor *wx = lp_in(&c, x);
    return LP_RUN(c, tdm_cpu_max_pool2d(wy, idx, wx, args));
}

int tdm_cpu_lowp_max_pool2d_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *idx) {
    lp_call c = {.what = "cpu max_pool2d_backward"};
    tdm_tensor *wgx = lp_out(&c, gx);
    const tdm_tensor *wgy = lp_in(&c, gy);
    return LP_RUN(c, tdm_cpu_max_pool2d_backward(wgx, wgy, idx));
}

int tdm_cpu_lowp_avg_pool2d(tdm_tensor *y, const tdm_tensor *x, const tdm_pool2d_args *args) {
    lp_call c = {.what = "cpu avg_pool2d"};
    tdm_tensor *wy = lp_out(&c, y);
    const tdm_tensor *wx = lp_in(&c, x);
    return LP_RUN(c, tdm_cpu_avg_pool2d(wy, wx, args));
}

int tdm_cpu_lowp_avg_pool2d_backward(tdm_tensor *gx, const tdm_tensor *gy,
                                     const tdm_pool2d_args *args) {
    lp_call c = {.what = "cpu avg_pool2d_backward"};
    tdm_tensor *wgx = lp_out(&c, gx);
    const tdm_tensor *wgy = lp_in(&c, gy);
    return LP_RUN(c, tdm_cpu_avg_pool2d_backward(wgx, wgy, args));
}

/* ---- normalisation ---------------------------------------------------------------------- */

int tdm_cpu_lowp_batch_norm(tdm_tensor *y, tdm_tensor *save_mean, tdm_tensor *save_invstd,
                            const tdm_tensor *x, const tdm_tensor *weight, const tdm_tensor *bias,
                            tdm_tensor *running_mean, tdm_tensor *running_var, bool training,
                            float momentum, float eps) {
    lp_call c = {.what = "cpu batch_norm"};
    tdm_tensor *wy = lp_out(&c, y), *wsm = lp_out(&c, save_mean), *wsi = lp_out(&c, save_invstd);
    const tdm_tensor *wx = lp_in(&c, x), *ww = lp_in(&c, weight), *wb = lp_in(&c, bias);
    tdm_tensor *wrm = lp_inout(&c, running_mean), *wrv = lp_inout(&c, running_var);
    return LP_RUN(c,
                  tdm_cpu_batch_norm(wy, wsm, wsi, wx, ww, wb, wrm, wrv, training, momentum, eps));
}

int tdm_cpu_lowp_batch_norm_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                     const tdm_tensor *gy, const tdm_tensor *x,
                                     const tdm_tensor *weight, const tdm_tensor *save_mean,
                                     const tdm_tensor *save_invstd, bool training) {
    lp_call c = {.what = "cpu batch_norm_backward"};
    tdm_tensor *wgx = lp_out(&c, gx), *wgw = lp_out(&c, gw), *wgb = lp_out(&c, gb);
    const tdm_tensor *wgy = lp_in(&c, gy), *wx = lp_in(&c, x), *ww = lp_in(&c, weight);
    const tdm_tensor *wsm = lp_in(&c, save_mean), *wsi = lp_in(&c, save_invstd);
    return LP_RUN(c, tdm_cpu_batch_norm_backward(wgx, wgw, wgb, wgy, wx, ww, wsm, wsi, training));
}

int tdm_cpu_lowp_batch_norm_stats(tdm_tensor *sum, const tdm_tensor *x, const tdm_tensor *center) {
    lp_call c = {.what = "cpu batch_norm_stats"};
    tdm_tensor *wsum = lp_out(&c, sum);
    const tdm_tensor *wx = lp_in(&c, x), *wc = lp_in(&c, center);
    return LP_RUN(c, tdm_cpu_batch_norm_stats(wsum, wx, wc));
}

int tdm_cpu_lowp_batch_norm_backward_reduce(tdm_tensor *sum_dy, tdm_tensor *sum_dy_xmu,
                                            tdm_tensor *gw, tdm_tensor *gb, const tdm_tensor *gy,
                                            const tdm_tensor *x, const tdm_tensor *mean,
                                            const tdm_tensor *invstd) {
    lp_call c = {.what = "cpu batch_norm_backward_reduce"};
    tdm_tensor *wsd = lp_out(&c, sum_dy), *wsdx = lp_out(&c, sum_dy_xmu);
    tdm_tensor *wgw = lp_out(&c, gw), *wgb = lp_out(&c, gb);
    const tdm_tensor *wgy = lp_in(&c, gy), *wx = lp_in(&c, x);
    const tdm_tensor *wm = lp_in(&c, mean), *wi = lp_in(&c, invstd);
    return LP_RUN(c, tdm_cpu_batch_norm_backward_reduce(wsd, wsdx, wgw, wgb, wgy, wx, wm, wi));
}

int tdm_cpu_lowp_batch_norm_backward_elemt(tdm_tensor *gx, const tdm_tensor *gy,
                                           const tdm_tensor *x, const tdm_tensor *weight,
                                           const tdm_tensor *mean, const tdm_tensor *invstd,
                                           const tdm_tensor *sum_dy, const tdm_tensor *sum_dy_xmu,
                                           double count) {
    lp_call c = {.what = "cpu batch_norm_backward_elemt"};
    tdm_tensor *wgx = lp_out(&c, gx);
    const tdm_tensor *wgy = lp_in(&c, gy), *wx = lp_in(&c, x), *ww = lp_in(&c, weight);
    const tdm_tensor *wm = lp_in(&c, mean), *wi = lp_in(&c, invstd);
    const tdm_tensor *wsd = lp_in(&c, sum_dy), *wsdx = lp_in(&c, sum_dy_xmu);
    return LP_RUN(c, tdm_cpu_batch_norm_backward_elemt(wgx, wgy, wx, ww, wm, wi, wsd, wsdx, count));
}

/* res and sum pass as they are: tdm_cpu_layer_norm sends a bf16/f16 sum to an add first, and
 * its f32 rows widen a bf16/f16 res a row at a time */
int tdm_cpu_lowp_layer_norm(tdm_tensor *y, tdm_tensor *mean, tdm_tensor *rstd, const tdm_tensor *x,
                            const tdm_tensor *weight, const tdm_tensor *bias, float eps,
                            const tdm_tensor *res, tdm_tensor *sum) {
    lp_call c = {.what = "cpu layer_norm"};
    tdm_tensor *wy = lp_out(&c, y), *wm = lp_out(&c, mean), *wr = lp_out(&c, rstd);
    const tdm_tensor *wx = lp_in(&c, x), *ww = lp_in(&c, weight), *wb = lp_in(&c, bias);
    return LP_RUN(c, tdm_cpu_layer_norm(wy, wm, wr, wx, ww, wb, eps, res, sum));
}

int tdm_cpu_lowp_layer_norm_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                     const tdm_tensor *gy, const tdm_tensor *x,
                                     const tdm_tensor *weight, const tdm_tensor *mean,
                                     const tdm_tensor *rstd, const tdm_tensor *gres) {
    lp_call c = {.what = "cpu layer_norm_backward"};
    tdm_tensor *wgx = lp_out(&c, gx), *wgw = lp_out(&c, gw), *wgb = lp_out(&c, gb);
    const tdm_tensor *wgy = lp_in(&c, gy), *wx = lp_in(&c, x), *ww = lp_in(&c, weight);
    const tdm_tensor *wm = lp_in(&c, mean), *wr = lp_in(&c, rstd);
    /* gres joins gx once gx is rounded to its dtype, as the contract's add would */
    int rc = LP_RUN(c, tdm_cpu_layer_norm_backward(wgx, wgw, wgb, wgy, wx, ww, wm, wr, NULL));
    return rc || !gres ? rc : tdm_cpu_axpy(gx, 1.0f, gres);
}

/* ---- dropout, losses, attention --------------------------------------------------------- */

int tdm_cpu_lowp_dropout(tdm_tensor *y, tdm_tensor *mask, const tdm_tensor *x, float p,
                         uint64_t seed, uint64_t offset, const uint64_t *at) {
    lp_call c = {.what = "cpu dropout"};
    tdm_tensor *wy = lp_out(&c, y), *wm = lp_out(&c, mask);
    const tdm_tensor *wx = lp_in(&c, x);
    return LP_RUN(c, tdm_cpu_dropout(wy, wm, wx, p, seed, offset, at));
}

int tdm_cpu_lowp_cross_entropy(tdm_tensor *loss, tdm_tensor *wsum, tdm_tensor *lse,
                               const tdm_tensor *x, const tdm_tensor *target,
                               const tdm_tensor *weight, int64_t ignore_index, float smoothing,
                               bool is_logits) {
    lp_call c = {.what = "cpu cross_entropy"};
    tdm_tensor *wl = lp_out(&c, loss), *ws = lp_out(&c, wsum), *wls = lp_out(&c, lse);
    const tdm_tensor *wx = lp_in(&c, x), *ww = lp_in(&c, weight);
    return LP_RUN(
        c, tdm_cpu_cross_entropy(wl, ws, wls, wx, target, ww, ignore_index, smoothing, is_logits));
}

int tdm_cpu_lowp_cross_entropy_backward(tdm_tensor *gx, const tdm_tensor *gloss,
                                        const tdm_tensor *x, const tdm_tensor *lse,
                                        const tdm_tensor *target, const tdm_tensor *weight,
                                        int64_t ignore_index, float smoothing, bool is_logits) {
    lp_call c = {.what = "cpu cross_entropy_backward"};
    tdm_tensor *wgx = lp_out(&c, gx);
    const tdm_tensor *wgl = lp_in(&c, gloss), *wx = lp_in(&c, x), *wls = lp_in(&c, lse),
                     *ww = lp_in(&c, weight);
    return LP_RUN(c, tdm_cpu_cross_entropy_backward(wgx, wgl, wx, wls, target, ww, ignore_index,
                                                    smoothing, is_logits));
}

int tdm_cpu_lowp_bce_logits(tdm_tensor *loss, const tdm_tensor *x, const tdm_tensor *y) {
    lp_call c = {.what = "cpu bce_logits"};
    tdm_tensor *wl = lp_out(&c, loss);
    const tdm_tensor *wx = lp_in(&c, x), *wy = lp_in(&c, y);
    return LP_RUN(c, tdm_cpu_bce_logits(wl, wx, wy));
}

int tdm_cpu_lowp_bce_logits_backward(tdm_tensor *gx, const tdm_tensor *g, const tdm_tensor *x,
                                     const tdm_tensor *y) {
    lp_call c = {.what = "cpu bce_logits_backward"};
    tdm_tensor *wgx = lp_out(&c, gx);
    const tdm_tensor *wg = lp_in(&c, g), *wx = lp_in(&c, x), *wy = lp_in(&c, y);
    return LP_RUN(c, tdm_cpu_bce_logits_backward(wgx, wg, wx, wy));
}

int tdm_cpu_lowp_attention(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv, int n_head) {
    lp_call c = {.what = "cpu attention"};
    tdm_tensor *wy = lp_out(&c, y), *wl = lp_out(&c, lse);
    const tdm_tensor *wq = lp_in(&c, qkv);
    return LP_RUN(c, tdm_cpu_attention(wy, wl, wq, n_head));
}

int tdm_cpu_lowp_attention_backward(tdm_tensor *dqkv, const tdm_tensor *dy, const tdm_tensor *qkv,
                                    const tdm_tensor *y, const tdm_tensor *lse, int n_head) {
    lp_call c = {.what = "cpu attention_backward"};
    tdm_tensor *wd = lp_out(&c, dqkv);
    const tdm_tensor *wdy = lp_in(&c, dy), *wq = lp_in(&c, qkv), *wl = lp_in(&c, lse);
    return LP_RUN(c, tdm_cpu_attention_backward(wd, wdy, wq, y, wl, n_head)); /* y unread */
}
