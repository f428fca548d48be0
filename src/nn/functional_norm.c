/* Functional normalisation (batch norm, synchronised batch norm, layer norm): argument
 * checks, output allocation, kernel calls and tape nodes. The math is in the backend's
 * kernels (cpu_norm.c, cuda_norm.cu); dropout is functional_dropout.c. */
#include "autograd/ops.h"
#include "nn/batch_split.h"
#include "tandem/nn.h"

/* A contiguous version of an optional tensor (NULL stays NULL without an error). */
static tdm_tensor *opt_contiguous(tdm_tensor *t, bool *failed) {
    if (!t) return NULL;
    tdm_tensor *c = tdm_contiguous(t);
    if (!c) *failed = true;
    return c;
}

/* An optional per-channel/per-feature tensor must be a float tensor (any of the three,
 * whatever x's: f32 affine parameters with a bf16 input is mixed precision's usual case) on
 * x's device with exactly shape s. */
static int check_param(const tdm_tensor *p, const char *what, tdm_shape s, const tdm_tensor *x,
                       const char *op) {
    if (!p) return TDM_OK;
    char b1[96], b2[96], b3[96];
    if (!tdm_dtype_is_float(p->dtype))
        return tdm_raise(TDM_ERR_DTYPE, "%s: %s must be a float tensor (f32, bf16 or f16), got %s",
                         op, what, tdm_dtype_name(p->dtype));
    if (tdm_check_same_device(p, x, op)) return -1;
    tdm_shape ps = tdm_shape_of(p);
    bool same = ps.ndim == s.ndim;
    for (int i = 0; same && i < s.ndim; i++) same = ps.d[i] == s.d[i];
    if (!same)
        return tdm_raise(TDM_ERR_SHAPE, "%s: %s has shape %s, expected %s for input %s", op, what,
                         tdm_shape_str(ps, b1), tdm_shape_str(s, b2),
                         tdm_shape_str(tdm_shape_of(x), b3));
    return TDM_OK;
}

/* Allocates a gradient of t's shape if input i of the node wants one. */
static tdm_tensor *grad_for(tdm_node *n, int i, bool *failed) {
    if (!tdm_node_wants(n, i)) return NULL;
    tdm_tensor *g = tdm_tensor_alloc(tdm_shape_of(n->in[i]), n->in[i]->dtype, n->in[i]->device);
    if (!g) *failed = true;
    return g;
}

/* Input i's gradient for a kernel that writes it whole: a parameter's stale .grad itself
 * (tdm_grad_overwrite_target: no copy into it after), else grad_for's new tensor. */
static tdm_tensor *grad_whole(tdm_node *n, int i, bool *failed) {
    if (!tdm_node_wants(n, i)) return NULL;
    tdm_tensor *g = tdm_grad_overwrite_target(n->in[i]);
    return g ? g : grad_for(n, i, failed);
}

/* Accumulates each g[i] into input i, but for a leaf's own .grad (grad_whole's, written). */
static int accumulate_all(tdm_node *n, tdm_tensor *const *g, int k) {
    for (int i = 0; i < k; i++)
        if (g[i] && g[i] != n->in[i]->grad) {
            int rc = tdm_grad_accumulate(n->in[i], g[i]);
            if (rc) return rc;
        }
    return TDM_OK;
}

/* ---- batch norm ---- */

/* in: x, weight, bias; saved: mean, invstd; arg.i[0]: training */
static int batch_norm_backward(tdm_node *n, tdm_tensor *gout) {
    bool failed = false;
    tdm_tensor *gy = tdm_contiguous(gout);
    tdm_tensor *g[3] = {grad_for(n, 0, &failed), grad_whole(n, 1, &failed),
                        grad_whole(n, 2, &failed)};
    if (!gy || failed) return tdm_last_status();
    tdm_tensor *x = n->in[0];
    int rc = tdm_backend_for(x->device)->batch_norm_backward(
        g[0], g[1], g[2], gy, x, n->in[1], n->saved[0], n->saved[1], n->arg.i[0] != 0);
    return rc ? rc : accumulate_all(n, g, 3);
}

static int check_running(const tdm_tensor *r, const char *what, tdm_shape cs, const tdm_tensor *x) {
    if (!r) return TDM_OK;
    if (check_param(r, what, cs, x, "batch_norm")) return -1;
    if (r->dtype != TDM_F32) /* the statistics are kept in f32 whatever x's dtype */
        return tdm_raise(TDM_ERR_DTYPE, "batch_norm: %s must be f32, got %s", what,
                         tdm_dtype_name(r->dtype));
    if (!tdm_is_contiguous(r))
        return tdm_raise(TDM_ERR_ARG, "batch_norm: %s must be contiguous (it is updated in place)",
                         what);
    return TDM_OK;
}

/* ---- synchronised batch norm (under a parallel context with a group of size > 1) ----
 *
 * The statistics of the global batch, as PyTorch's SyncBatchNorm: forward all-reduces the
 * per-channel sums of x and the count of rows, then (around the global mean) the sums of
 * squared deviations, which keeps the two-pass accuracy of the one-device kernel; backward
 * all-reduces the per-channel sums of dy and dy * (x - mean). Reductions add in rank order,
 * so every rank normalises with the same bits. A local failure between collectives aborts
 * the group, so the other ranks fail at their next collective instead of waiting. */

typedef struct {
    tdm_batch_split split; /* a copy: the thread's context may change before backward */
    double count;          /* values per channel over every rank */
} sync_bn_ctx;

static int sync_fail(const tdm_batch_split *s, int rc) {
    tdm_batch_split_abort(s, tdm_last_error());
    return rc ? rc : TDM_ERR_ARG;
}

/* A [n] view of the contiguous buf starting at element at. */
static tdm_tensor *part(tdm_tensor *buf, int64_t at, int64_t n) {
    int64_t one = 1;
    return tdm_tensor_view(buf, 1, &n, &one, buf->offset + at);
}

/* in: x, weight, bias; saved: mean, invstd; ctx: sync_bn_ctx */
static int sync_batch_norm_backward(tdm_node *n, tdm_tensor *gout) {
    const sync_bn_ctx *sc = n->ctx;
    bool failed = false;
    tdm_tensor *gy = tdm_contiguous(gout);
    tdm_tensor *g[3] = {grad_for(n, 0, &failed), grad_whole(n, 1, &failed),
                        grad_whole(n, 2, &failed)};
    tdm_tensor *x = n->in[0];
    int64_t c = x->shape[1];
    tdm_tensor *buf = tdm_tensor_alloc(TDM_SHAPE(2 * c), TDM_F32, x->device);
    tdm_tensor *sdy = buf ? part(buf, 0, c) : NULL, *sdx = buf ? part(buf, c, c) : NULL;
    if (!gy || failed || !sdy || !sdx) return sync_fail(&sc->split, tdm_last_status());
    const tdm_backend *be = tdm_backend_for(x->device);
    tdm_tensor *mean = n->saved[0], *invstd = n->saved[1];
    if (be->batch_norm_backward_reduce(sdy, sdx, g[1], g[2], gy, x, mean, invstd))
        return sync_fail(&sc->split, tdm_last_status());
    /* every rank runs the same graph, so all of them skip or run this collective */
    if (g[0]) {
        int rc = tdm_batch_split_sum(&sc->split, buf);
        if (rc) return rc;
        if (be->batch_norm_backward_elemt(g[0], gy, x, n->in[1], mean, invstd, sdy, sdx, sc->count))
            return sync_fail(&sc->split, tdm_last_status());
    }
    return accumulate_all(n, g, 3);
}

/* Global statistics of the contiguous xc [N, C, ...] over sp's replicas: mean and biased var [C]
 * (new tensors), *count the values per channel. unbiased [C] gets the unbiased variance. */
static int sync_stats(const tdm_batch_split *sp, const tdm_backend *be, tdm_tensor *xc,
                      tdm_tensor **mean, tdm_tensor **var, tdm_tensor **unbiased, double *count) {
    int64_t c = xc->shape[1], s = 1; /* s: values per row and channel */
    for (int i = 2; i < xc->ndim; i++) s *= xc->shape[i];
    tdm_tensor *buf = tdm_tensor_alloc(TDM_SHAPE(c + 1), TDM_F32, xc->device); /* sums, rows */
    tdm_tensor *sums = buf ? part(buf, 0, c) : NULL, *rows = buf ? part(buf, c, 1) : NULL;
    if (!sums || !rows || be->batch_norm_stats(sums, xc, NULL) ||
        be->fill(rows, (double)xc->shape[0]))
        return sync_fail(sp, tdm_last_status());
    int rc = tdm_batch_split_sum(sp, buf);
    float total_rows = 0;
    if (rc) return rc;
    if (tdm_to_host(rows, &total_rows, sizeof total_rows)) return sync_fail(sp, tdm_last_status());
    double m = (double)total_rows * (double)s; /* f32 row counts are exact below 2^24 rows */
    char b[96];
    if (m <= 1) /* the same on every rank: they all fail here, none waits */
        return tdm_raise(TDM_ERR_SHAPE,
                         "batch_norm: expected more than 1 value per channel when training, "
                         "got %.0f over %d ranks (this rank's input %s)",
                         m, sp->replicas, tdm_shape_str(tdm_shape_of(xc), b));
    tdm_shape cs = TDM_SHAPE(c);
    tdm_tensor *sq = tdm_tensor_alloc(cs, TDM_F32, xc->device);
    *mean = tdm_tensor_alloc(cs, TDM_F32, xc->device);
    *var = tdm_tensor_alloc(cs, TDM_F32, xc->device);
    *unbiased = tdm_tensor_alloc(cs, TDM_F32, xc->device);
    if (!sq || !*mean || !*var || !*unbiased ||
        be->unary(TDM_UN_MUL_SCALAR, *mean, sums, (float)(1.0 / m)) ||
        be->batch_norm_stats(sq, xc, *mean))
        return sync_fail(sp, tdm_last_status());
    if ((rc = tdm_batch_split_sum(sp, sq))) return rc;
    if (be->unary(TDM_UN_MUL_SCALAR, *var, sq, (float)(1.0 / m)) ||
        be->unary(TDM_UN_MUL_SCALAR, *unbiased, sq, (float)(1.0 / (m - 1))))
        return sync_fail(sp, tdm_last_status());
    *count = m;
    return TDM_OK;
}

/* running = (1 - momentum) * running + momentum * batch, as the one-device kernel does. */
static int update_running(const tdm_backend *be, tdm_tensor *running, const tdm_tensor *batch,
                          float momentum) {
    if (!running) return TDM_OK;
    if (be->unary(TDM_UN_MUL_SCALAR, running, running, 1 - momentum)) return -1;
    return be->axpy(running, momentum, batch);
}

static tdm_tensor *sync_batch_norm(const tdm_batch_split *sp, tdm_tensor *xc,
                                   tdm_tensor *running_mean, tdm_tensor *running_var, tdm_tensor *w,
                                   tdm_tensor *bb, float momentum, float eps) {
    const tdm_backend *be = tdm_backend_for(xc->device);
    tdm_tensor *mean = NULL, *var = NULL, *unbiased = NULL;
    double count = 0;
    if (sync_stats(sp, be, xc, &mean, &var, &unbiased, &count)) return NULL;
    tdm_tensor *y = tdm_tensor_alloc(tdm_shape_of(xc), xc->dtype, xc->device);
    tdm_tensor *save_mean = tdm_tensor_alloc(tdm_shape_of(mean), TDM_F32, xc->device);
    tdm_tensor *invstd = tdm_tensor_alloc(tdm_shape_of(mean), TDM_F32, xc->device);
    /* the eval-mode kernel normalises with the statistics it is given: the global ones */
    if (!y || !save_mean || !invstd ||
        be->batch_norm(y, save_mean, invstd, xc, w, bb, mean, var, false, 0, eps) ||
        update_running(be, running_mean, mean, momentum) ||
        update_running(be, running_var, unbiased, momentum)) {
        sync_fail(sp, tdm_last_status());
        return NULL;
    }
    tdm_tensor *in[3] = {xc, w, bb};
    if (tdm_needs_record(3, in)) {
        tdm_node *n = tdm_record("sync_batch_norm", sync_batch_norm_backward, y, 3, in);
        sync_bn_ctx *sc = n ? tdm_scope_alloc(sizeof *sc) : NULL;
        if (!sc) {
            sync_fail(sp, tdm_last_status());
            return tdm_drop_fail(y);
        }
        *sc = (sync_bn_ctx){*sp, count};
        n->saved[0] = save_mean;
        n->saved[1] = invstd;
        n->ctx = sc;
    }
    return y;
}

tdm_tensor *tdm_batch_norm(tdm_tensor *x, tdm_tensor *running_mean, tdm_tensor *running_var,
                           tdm_tensor *weight, tdm_tensor *bias, bool training, float momentum,
                           float eps) {
    if (!x) return tdm_null_input("batch_norm");
    /* synchronised batch norm makes temporaries (statistics, views): they need a scope */
    tdm_batch_split split;
    bool split_on = training && tdm_batch_split_current(&split);
    if (split_on && !tdm_current_scope())
        TDM_RETURN_SCOPED(
            tdm_batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps));
    char b[96];
    if (tdm_check_float(x, "batch_norm")) return NULL;
    if (x->ndim < 2)
        return tdm_raise_null(TDM_ERR_SHAPE,
                              "batch_norm: input must be [N, C] or [N, C, ...], "
                              "got %s",
                              tdm_shape_str(tdm_shape_of(x), b));
    tdm_shape cs = TDM_SHAPE(x->shape[1]);
    if (check_param(weight, "weight", cs, x, "batch_norm") ||
        check_param(bias, "bias", cs, x, "batch_norm") ||
        check_running(running_mean, "running_mean", cs, x) ||
        check_running(running_var, "running_var", cs, x))
        return NULL;
    const tdm_batch_split *sync = split_on && split.replicas > 1 ? &split : NULL;
    int64_t per_channel = x->shape[1] ? tdm_numel(x) / x->shape[1] : 0;
    if (training && !sync && per_channel <= 1)
        return tdm_raise_null(TDM_ERR_SHAPE,
                              "batch_norm: expected more than 1 value per channel "
                              "when training, got input %s",
                              tdm_shape_str(tdm_shape_of(x), b));
    if (!training && (!running_mean || !running_var))
        return tdm_raise_null(TDM_ERR_ARG,
                              "batch_norm: eval mode needs running_mean and "
                              "running_var (input %s)",
                              tdm_shape_str(tdm_shape_of(x), b));
    const tdm_backend *be = tdm_backend_for(x->device);
    if (!be) return NULL;
    bool failed = false;
    tdm_tensor *xc = tdm_contiguous(x);
    tdm_tensor *w = opt_contiguous(weight, &failed), *bb = opt_contiguous(bias, &failed);
    if (!xc || failed) return NULL;
    /* a recomputation runs the forward a second time: the first one updated the statistics */
    if (training && tdm_recomputing()) running_mean = running_var = NULL;
    if (sync) return sync_batch_norm(sync, xc, running_mean, running_var, w, bb, momentum, eps);
    tdm_tensor *y = tdm_tensor_alloc(tdm_shape_of(xc), x->dtype, x->device);
    tdm_tensor *mean = tdm_tensor_alloc(cs, TDM_F32, x->device);
    tdm_tensor *invstd = tdm_tensor_alloc(cs, TDM_F32, x->device);
    if (!y || !mean || !invstd) return NULL;
    if (be->batch_norm(y, mean, invstd, xc, w, bb, running_mean, running_var, training, momentum,
                       eps))
        return NULL;
    tdm_tensor *in[3] = {xc, w, bb};
    if (tdm_needs_record(3, in)) {
        tdm_node *n = tdm_record("batch_norm", batch_norm_backward, y, 3, in);
        if (!n) return tdm_drop_fail(y);
        n->saved[0] = mean;
        n->saved[1] = invstd;
        n->arg.i[0] = training;
    } else {
        tdm_drop_temp(mean, NULL);
        tdm_drop_temp(invstd, NULL);
    }
    tdm_drop_temp(xc, x);
    tdm_drop_temp(w, weight);
    tdm_drop_temp(bb, bias);
    return y;
}

/* ---- layer norm ---- */

/* A [rows, cols] view of a contiguous tensor, as the kernels' contract states. */
static tdm_tensor *view2d(tdm_tensor *t, int64_t rows, int64_t cols) {
    int64_t shape[2] = {rows, cols}, strides[2] = {cols, 1};
    return tdm_tensor_view(t, 2, shape, strides, t->offset);
}
static tdm_tensor *view1d(tdm_tensor *t) {
    if (!t) return NULL;
    int64_t shape[1] = {tdm_numel(t)}, strides[1] = {1};
    return tdm_tensor_view(t, 1, shape, strides, t->offset);
}

/* in: x, weight, bias; saved: mean, rstd. In a pre-norm residual stream x's other consumer
 * (the next residual add) has given x its gradient already: the kernel adds it to gx as it
 * writes gx (gres), which then replaces it, one pass where gx and an add took two. */
static int layer_norm_backward(tdm_node *n, tdm_tensor *gout) {
    bool failed = false;
    tdm_tensor *gy = tdm_contiguous(gout);
    tdm_tensor *g[3] = {grad_for(n, 0, &failed), grad_whole(n, 1, &failed),
                        grad_whole(n, 2, &failed)};
    if (!gy || failed) return tdm_last_status();
    tdm_tensor *x = n->in[0], *mean = n->saved[0];
    tdm_tensor *gres = g[0] ? tdm_grad_pending(x) : NULL;
    int64_t rows = tdm_numel(mean), cols = rows ? tdm_numel(x) / rows : 0;
    int rc = tdm_backend_for(x->device)->layer_norm_backward(
        g[0] ? view2d(g[0], rows, cols) : NULL, g[1] ? view1d(g[1]) : NULL,
        g[2] ? view1d(g[2]) : NULL, view2d(gy, rows, cols), view2d(x, rows, cols),
        n->in[1] ? view1d(n->in[1]) : NULL, mean, n->saved[1],
        gres ? view2d(gres, rows, cols) : NULL);
    if (rc || (gres && (rc = tdm_grad_replace(x, g[0])))) return rc;
    if (gres) g[0] = NULL;
    return accumulate_all(n, g, 3);
}

/* tdm_layer_norm with its output in x's dtype (keep; as autocast made x) or in out. With res
 * (where add_fuses(x, res)): of s = x + res, one kernel writing s and the norm, s in *sum. */
static tdm_tensor *layer_norm_as(tdm_tensor *x, tdm_tensor *res, tdm_tensor **sum,
                                 int normalized_ndim, tdm_tensor *weight, tdm_tensor *bias,
                                 float eps, bool keep, tdm_dtype out) {
    if (!x) return tdm_null_input("layer_norm");
    tdm_tensor *in0[3] = {x, weight, bias};
    if (!res)
        TDM_AUTOCAST_SCOPED(
            3, in0, layer_norm_as(x, NULL, NULL, normalized_ndim, weight, bias, eps, keep, out));
    char b[96];
    if (tdm_check_float(x, "layer_norm")) return NULL;
    /* on autocast's fp32 list on CUDA devices only, as PyTorch's (the CPU's follows x) */
    if (!(x = tdm_autocast_arg(x, TDM_AC_F32_CUDA)) ||
        (weight && !(weight = tdm_autocast_arg(weight, TDM_AC_F32_CUDA))) ||
        (bias && !(bias = tdm_autocast_arg(bias, TDM_AC_F32_CUDA))))
        return NULL;
    if (normalized_ndim < 1 || normalized_ndim > x->ndim)
        return tdm_raise_null(TDM_ERR_ARG,
                              "layer_norm: normalized_ndim %d is not in [1, %d] for input %s",
                              normalized_ndim, x->ndim, tdm_shape_str(tdm_shape_of(x), b));
    int lead = x->ndim - normalized_ndim;
    tdm_shape ns = {normalized_ndim, {0}};
    int64_t rows = 1, cols = 1;
    for (int i = 0; i < x->ndim; i++) {
        if (i < lead)
            rows *= x->shape[i];
        else
            cols *= (ns.d[i - lead] = x->shape[i]);
    }
    if (check_param(weight, "weight", ns, x, "layer_norm") ||
        check_param(bias, "bias", ns, x, "layer_norm"))
        return NULL;
    const tdm_backend *be = tdm_backend_for(x->device);
    if (!be) return NULL;
    bool failed = false;
    tdm_tensor *xc = tdm_contiguous(x);
    tdm_tensor *w = opt_contiguous(weight, &failed), *bb = opt_contiguous(bias, &failed);
    if (!xc || failed) return NULL;
    tdm_tensor *y = tdm_tensor_alloc(tdm_shape_of(xc), keep ? x->dtype : out, x->device);
    /* the statistics stay f32 in every dtype */
    tdm_tensor *mean = tdm_tensor_alloc(TDM_SHAPE(rows), TDM_F32, x->device);
    tdm_tensor *rstd = tdm_tensor_alloc(TDM_SHAPE(rows), TDM_F32, x->device);
    tdm_tensor *s = res ? tdm_tensor_alloc(tdm_shape_of(xc), x->dtype, x->device) : NULL;
    if (!y || !mean || !rstd || (res && !s)) return NULL; /* a scope holds them (add_fuses) */
    tdm_tensor *y2 = view2d(y, rows, cols), *x2 = view2d(xc, rows, cols);
    tdm_tensor *w1 = w ? view1d(w) : NULL, *b1 = bb ? view1d(bb) : NULL;
    tdm_tensor *r2 = res ? view2d(res, rows, cols) : NULL, *s2 = s ? view2d(s, rows, cols) : NULL;
    if (!y2 || !x2 || (w && !w1) || (bb && !b1) || (res && (!r2 || !s2))) return NULL;
    if (be->layer_norm(y2, mean, rstd, x2, w1, b1, eps, r2, s2)) return NULL;
    tdm_drop_temp(y2, NULL);
    tdm_drop_temp(x2, NULL);
    tdm_drop_temp(w1, NULL);
    tdm_drop_temp(b1, NULL);
    tdm_drop_temp(r2, NULL);
    tdm_drop_temp(s2, NULL);
    tdm_tensor *ins[2] = {xc, res};
    if (s && tdm_needs_record(2, ins) && !tdm_record_add(s, xc, res)) return NULL;
    tdm_tensor *in[3] = {s ? s : xc, w, bb};
    if (tdm_needs_record(3, in)) {
        tdm_node *n = tdm_record("layer_norm", layer_norm_backward, y, 3, in);
        if (!n) return tdm_drop_fail(y);
        n->saved[0] = mean;
        n->saved[1] = rstd;
    } else {
        tdm_drop_temp(mean, NULL);
        tdm_drop_temp(rstd, NULL);
    }
    tdm_drop_temp(xc, x);
    tdm_drop_temp(w, weight);
    tdm_drop_temp(bb, bias);
    if (sum) *sum = s;
    return y;
}

/* Whether x + res and its norm can be one kernel with the bits of tdm_add and then the norm:
 * res of x's shape, both contiguous, the sum in x's dtype (res x's, or bf16/f16 beside f32 x)
 * and not cast by autocast for the norm; in a scope, which holds every tensor the op makes
 * (the failure paths' and an autocast cast's). Elsewhere the two ops run. */
static bool add_fuses(const tdm_tensor *x, const tdm_tensor *res) {
    return tdm_current_scope() && tdm_dtype_is_float(x->dtype) && tdm_dtype_is_float(res->dtype) &&
           (res->dtype == x->dtype || x->dtype == TDM_F32) &&
           tdm_device_equal(x->device, res->device) && tdm_same_shape(x, res) &&
           tdm_is_contiguous(x) && tdm_is_contiguous(res) &&
           tdm_autocast_want(x, TDM_AC_F32_CUDA) == x->dtype;
}

static tdm_tensor *add_layer_norm_as(tdm_tensor *x, tdm_tensor *res, tdm_tensor **sum,
                                     int normalized_ndim, tdm_tensor *weight, tdm_tensor *bias,
                                     float eps, bool keep, tdm_dtype out) {
    if (!sum) return tdm_raise_null(TDM_ERR_ARG, "add_layer_norm: sum is NULL");
    *sum = NULL;
    if (!x || !res) return tdm_null_input("add_layer_norm");
    if (add_fuses(x, res))
        return layer_norm_as(x, res, sum, normalized_ndim, weight, bias, eps, keep, out);
    tdm_tensor *s = tdm_add(x, res);
    tdm_tensor *y = layer_norm_as(s, NULL, NULL, normalized_ndim, weight, bias, eps, keep, out);
    if (!y) return s ? tdm_drop_fail(s) : NULL;
    *sum = s;
    return y;
}

tdm_tensor *tdm_layer_norm(tdm_tensor *x, int normalized_ndim, tdm_tensor *weight, tdm_tensor *bias,
                           float eps) {
    return layer_norm_as(x, NULL, NULL, normalized_ndim, weight, bias, eps, true, TDM_F32);
}

tdm_tensor *tdm_layer_norm_to(tdm_tensor *x, int normalized_ndim, tdm_tensor *weight,
                              tdm_tensor *bias, float eps, tdm_dtype dtype) {
    if (!tdm_dtype_is_float(dtype))
        return tdm_raise_null(TDM_ERR_DTYPE, "layer_norm_to: dtype %s is not a float dtype",
                              tdm_dtype_name(dtype));
    return layer_norm_as(x, NULL, NULL, normalized_ndim, weight, bias, eps, false, dtype);
}

tdm_tensor *tdm_add_layer_norm(tdm_tensor *x, tdm_tensor *r, tdm_tensor **sum, int normalized_ndim,
                               tdm_tensor *weight, tdm_tensor *bias, float eps) {
    return add_layer_norm_as(x, r, sum, normalized_ndim, weight, bias, eps, true, TDM_F32);
}

tdm_tensor *tdm_add_layer_norm_to(tdm_tensor *x, tdm_tensor *r, tdm_tensor **sum,
                                  int normalized_ndim, tdm_tensor *weight, tdm_tensor *bias,
                                  float eps, tdm_dtype dtype) {
    if (sum) *sum = NULL;
    if (!tdm_dtype_is_float(dtype))
        return tdm_raise_null(TDM_ERR_DTYPE, "add_layer_norm_to: dtype %s is not a float dtype",
                              tdm_dtype_name(dtype));
    return add_layer_norm_as(x, r, sum, normalized_ndim, weight, bias, eps, false, dtype);
}
