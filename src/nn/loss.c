/* Losses with PyTorch's meaning: cross-entropy (logits) and NLL (log-probabilities) with class
 * weights, ignore_index and label smoothing; MSE; binary cross-entropy on logits.
 *
 * The heavy part of each loss is one fused node (kernels in cpu_loss.c). Cross-entropy's mean
 * or sum is one node over the reduced kernel, which can write the logits' gradient in the
 * forward's pass (ce_reduced); reduction none is a per-sample node. torch 1.13's mean divides
 * the sum of per-sample losses by the sum of w[target] over non-ignored samples (the count of
 * them without weights), for the smoothing term too. MSE's and BCE's reductions are composed
 * from scalar ops.
 */
#include "autograd/ops.h"
#include "tandem/nn.h"

tdm_ce_opts tdm_ce_defaults(void) {
    tdm_ce_opts o = {TDM_REDUCE_MEAN, -100, 0.0f, NULL};
    return o;
}

static int check_reduction(tdm_reduction r, const char *op) {
    if (r != TDM_REDUCE_MEAN && r != TDM_REDUCE_SUM && r != TDM_REDUCE_NONE)
        return tdm_raise(TDM_ERR_ARG, "%s: unknown reduction %d", op, (int)r);
    return TDM_OK;
}

/* The reduction of per-element losses; per is dropped when it is a temporary. */
static tdm_tensor *reduce(tdm_tensor *per, tdm_reduction r) {
    if (!per || r == TDM_REDUCE_NONE) return per;
    tdm_tensor *out = r == TDM_REDUCE_SUM ? tdm_sum_all(per) : tdm_mean_all(per);
    tdm_drop_temp(per, NULL);
    return out;
}

/* ---- cross-entropy and NLL ---- */

/* in: x [N, C] contiguous; saved: target, weight, the rows' log-sum-exps [N] (logits only);
 * arg.i[0] ignore_index; arg2.f[0] smoothing, arg2.f[1] is_logits */
static int ce_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *x = n->in[0];
    tdm_tensor *g = tdm_contiguous(gout);
    tdm_tensor *gx = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (!g || !gx) return tdm_last_status();
    int rc = tdm_backend_for(x->device)->cross_entropy_backward(gx, g, x, n->saved[2], n->saved[0],
                                                                n->saved[1], n->arg.i[0],
                                                                n->arg2.f[0], n->arg2.f[1] != 0);
    return rc ? rc : tdm_grad_accumulate(x, gx);
}

static int ce_check(const tdm_tensor *x, const tdm_tensor *target, const tdm_ce_opts *o,
                    const char *op) {
    char b1[96], b2[96];
    if (tdm_check_float(x, op)) return -1;
    if (x->ndim != 2)
        return tdm_raise(TDM_ERR_SHAPE, "%s: input must be [N, C], got %s", op,
                         tdm_shape_str(tdm_shape_of(x), b1));
    if (target->dtype != TDM_I32 && target->dtype != TDM_I64)
        return tdm_raise(TDM_ERR_DTYPE, "%s: target must be i32 or i64 class indices, got %s", op,
                         tdm_dtype_name(target->dtype));
    if (tdm_check_same_device(x, target, op)) return -1;
    if (target->ndim != 1 || target->shape[0] != x->shape[0])
        return tdm_raise(TDM_ERR_SHAPE, "%s: target %s does not match input %s (expected [%lld])",
                         op, tdm_shape_str(tdm_shape_of(target), b1),
                         tdm_shape_str(tdm_shape_of(x), b2), (long long)x->shape[0]);
    if (check_reduction(o->reduction, op)) return -1;
    if (!(o->label_smoothing >= 0.0f && o->label_smoothing <= 1.0f))
        return tdm_raise(TDM_ERR_ARG, "%s: label_smoothing must be in [0, 1], got %g", op,
                         (double)o->label_smoothing);
    const tdm_tensor *w = o->weight;
    if (w) {
        if (w->dtype != TDM_F32)
            return tdm_raise(TDM_ERR_DTYPE, "%s: weight must be f32, got %s", op,
                             tdm_dtype_name(w->dtype));
        if (tdm_check_same_device(x, w, op)) return -1;
        if (w->ndim != 1 || w->shape[0] != x->shape[1])
            return tdm_raise(TDM_ERR_SHAPE,
                             "%s: weight %s does not match input %s (expected [%lld])", op,
                             tdm_shape_str(tdm_shape_of(w), b1), tdm_shape_str(tdm_shape_of(x), b2),
                             (long long)x->shape[1]);
    }
    return TDM_OK;
}

/* x, and weight as a contiguous tensor (class weights are constants here, as in PyTorch's
 * loss: a copy is fine), or NULL on failure. */
static tdm_tensor *ce_inputs(tdm_tensor *x, const tdm_ce_opts *o, tdm_tensor **w) {
    *w = NULL;
    tdm_tensor *xc = tdm_contiguous(x);
    if (!xc || !o->weight) return xc;
    *w = tdm_is_contiguous(o->weight) ? o->weight : tdm_clone(o->weight);
    return *w ? xc : NULL;
}

/* The node's saved tensors and arguments (both nodes below). */
static void ce_save(tdm_node *n, tdm_tensor *tk, tdm_tensor *wk, const tdm_ce_opts *o,
                    bool is_logits) {
    n->saved[0] = tk;
    n->saved[1] = wk;
    n->arg.i[0] = o->ignore_index;
    n->arg2.f[0] = o->label_smoothing;
    n->arg2.f[1] = is_logits ? 1.0f : 0.0f;
}

/* The loss of every sample [N] (differentiable in x; reduction none). */
static tdm_tensor *ce_per_sample(tdm_tensor *x, const tdm_tensor *target, const tdm_ce_opts *o,
                                 bool is_logits) {
    const tdm_backend *be = tdm_backend_for(x->device);
    tdm_tensor *w, *xc = be ? ce_inputs(x, o, &w) : NULL;
    if (!xc) return NULL;
    tdm_shape ns = TDM_SHAPE(x->shape[0]);
    /* f32 whatever x's dtype (the backends' contract) */
    tdm_tensor *loss = tdm_tensor_alloc(ns, TDM_F32, x->device);
    tdm_tensor *in[1] = {xc};
    bool record = tdm_needs_record(1, in);
    /* the rows' log-sum-exps, N floats, spare the backward its own pass for them */
    tdm_tensor *lse = record && is_logits ? tdm_tensor_alloc(ns, TDM_F32, x->device) : NULL;
    if (!loss || (record && is_logits && !lse)) return NULL;
    if (be->cross_entropy(loss, NULL, lse, xc, target, w, o->ignore_index, o->label_smoothing,
                          is_logits))
        return NULL;
    if (record) {
        tdm_tensor *tk = tdm_index_keep(target), *wk = w ? tdm_index_keep(w) : NULL;
        if (!tk || (w && !wk)) return NULL;
        tdm_node *n =
            tdm_record(is_logits ? "cross_entropy" : "nll_loss", ce_backward, loss, 1, in);
        if (!n) return tdm_drop_fail(loss);
        ce_save(n, tk, wk, o, is_logits);
        n->saved[2] = lse;
    }
    tdm_drop_temp(xc, x);
    tdm_drop_temp(w, o->weight);
    return loss;
}

/* saved: target, weight, lse (logits), den (the mean's denominator, 1 for a sum), the
 * forward's gradient or NULL. A backward that starts here (the engine's unit seed) hands the
 * forward's gradient on; any other upstream g recomputes it from the logits and lse for
 * g / den a sample, as the per-sample node's backward does. */
static int ce_reduced_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *x = n->in[0], *gx = n->saved[4];
    if (gx && n->seed_one) return tdm_grad_accumulate_made(x, gx);
    if (gx) tdm_storage_resize(gx->storage, 0); /* not this upstream's: its memory back now */
    const tdm_backend *be = tdm_backend_for(x->device);
    tdm_tensor *g = tdm_tensor_alloc(TDM_SHAPE0, TDM_F32, x->device);
    tdm_tensor *gxn = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (!g || !gxn || be->binary(TDM_BIN_DIV, g, gout, n->saved[3])) return tdm_last_status();
    int rc = be->cross_entropy_backward(gxn, g, x, n->saved[2], n->saved[0], n->saved[1],
                                        n->arg.i[0], n->arg2.f[0], n->arg2.f[1] != 0);
    return rc ? rc : tdm_grad_accumulate(x, gxn);
}

/* The mean or sum in one node over the backend's reduced kernel. Where the backward will
 * likely start at this loss (f32, not cast after), the kernel writes the logits' gradient in
 * the forward's pass over them (llm.c's fused classifier), and the backward reads no logits;
 * f16 logits are left out, as their loss is scaled before its backward (tdm_grad_scaler),
 * and a gradient rounded to f16 before that scale would lose what the scale keeps. */
static tdm_tensor *ce_reduced(tdm_tensor *x, const tdm_tensor *target, const tdm_ce_opts *o,
                              bool is_logits, bool root_likely) {
    const tdm_backend *be = tdm_backend_for(x->device);
    tdm_tensor *w, *xc = be ? ce_inputs(x, o, &w) : NULL;
    if (!xc) return NULL;
    tdm_tensor *out = tdm_tensor_alloc(TDM_SHAPE0, TDM_F32, x->device);
    tdm_tensor *den = tdm_tensor_alloc(TDM_SHAPE0, TDM_F32, x->device);
    tdm_tensor *in[1] = {xc};
    bool record = tdm_needs_record(1, in), pre = record && root_likely && x->dtype != TDM_F16;
    tdm_tensor *lse = NULL, *gx = NULL;
    if (record && is_logits) lse = tdm_tensor_alloc(TDM_SHAPE(x->shape[0]), TDM_F32, x->device);
    if (pre) gx = tdm_tensor_alloc(tdm_shape_of(xc), xc->dtype, x->device);
    bool ok =
        out && den && (!record || !is_logits || lse) && (!pre || gx) &&
        !be->cross_entropy_reduced(out, den, lse, gx, xc, target, w, o->ignore_index,
                                   o->label_smoothing, is_logits, o->reduction == TDM_REDUCE_MEAN);
    tdm_tensor *tk = ok && record ? tdm_index_keep(target) : NULL;
    tdm_tensor *wk = tk && w ? tdm_index_keep(w) : NULL;
    tdm_node *n = tk && (wk || !w) ? tdm_record(is_logits ? "cross_entropy" : "nll_loss",
                                                ce_reduced_backward, out, 1, in)
                                   : NULL;
    if (n) {
        ce_save(n, tk, wk, o, is_logits);
        n->saved[2] = lse;
        n->saved[3] = den;
        n->saved[4] = gx;
    } else { /* temporaries where no scope owns them (no scope: no gradient either) */
        tdm_drop_temp(lse, NULL);
        tdm_drop_temp(gx, NULL);
        tdm_drop_temp(den, NULL);
    }
    tdm_drop_temp(xc, x);
    tdm_drop_temp(w, o->weight);
    return ok && (n || !record) ? out : tdm_drop_fail(out);
}

static tdm_tensor *ce_common(tdm_tensor *x, const tdm_tensor *target, const tdm_ce_opts *o,
                             bool is_logits, const char *op) {
    if (!x || !target) return tdm_null_input(op);
    TDM_AUTOCAST_SCOPED(1, &x, ce_common(x, target, o, is_logits, op));
    tdm_ce_opts defaults = tdm_ce_defaults();
    if (!o) o = &defaults;
    if (ce_check(x, target, o, op)) return NULL;
    /* Autocast runs the loss in f32, but the kernels read bf16 or f16 logits as they are: they
     * widen each element exactly and round the gradient once into x's dtype, the bits of the
     * cast and its backward without an f32 copy of the [N, C] logits and of their gradient. */
    tdm_dtype out_dt = tdm_autocast_want(x, TDM_AC_F32);
    if (!is_logits && o->label_smoothing != 0.0f)
        return tdm_raise_null(TDM_ERR_ARG,
                              "%s: label_smoothing must be 0 (got %g); use "
                              "cross_entropy on logits",
                              op, (double)o->label_smoothing);
    /* torch 1.13's mean: the sum of the losses over the sum of w[target] over the samples that
     * count (their count without weights) */
    tdm_tensor *out = o->reduction == TDM_REDUCE_NONE
                          ? ce_per_sample(x, target, o, is_logits)
                          : ce_reduced(x, target, o, is_logits, out_dt == TDM_F32);
    if (!out || out->dtype == out_dt) return out;
    /* computed in f32, given in x's dtype as PyTorch's (a bf16 loss outside a region) */
    tdm_tensor *f = out;
    out = tdm_to_dtype(f, out_dt);
    tdm_drop_temp(f, NULL);
    return out;
}

tdm_tensor *tdm_cross_entropy(tdm_tensor *logits, const tdm_tensor *target, const tdm_ce_opts *o) {
    return ce_common(logits, target, o, true, "cross_entropy");
}

tdm_tensor *tdm_nll_loss(tdm_tensor *logp, const tdm_tensor *target, const tdm_ce_opts *o) {
    return ce_common(logp, target, o, false, "nll_loss");
}

/* ---- MSE and BCE ---- */

/* input and target: floats, same device, same shape (no silent broadcasting of a target). */
static int check_pair(const tdm_tensor *a, const tdm_tensor *t, tdm_reduction r, const char *op) {
    char b1[96], b2[96];
    if (tdm_check_float(a, op) || tdm_check_float(t, op) || tdm_check_same_device(a, t, op))
        return -1;
    if (!tdm_same_shape(a, t))
        return tdm_raise(TDM_ERR_SHAPE, "%s: target %s does not match input %s", op,
                         tdm_shape_str(tdm_shape_of(t), b1), tdm_shape_str(tdm_shape_of(a), b2));
    return check_reduction(r, op);
}

tdm_tensor *tdm_mse_loss(tdm_tensor *input, tdm_tensor *target, tdm_reduction r) {
    if (!input || !target) return tdm_null_input("mse_loss");
    tdm_tensor *in0[2] = {input, target};
    TDM_AUTOCAST_SCOPED(2, in0, tdm_mse_loss(input, target, r));
    if (check_pair(input, target, r, "mse_loss")) return NULL;
    if (!(input = tdm_autocast_arg(input, TDM_AC_F32)) ||
        !(target = tdm_autocast_arg(target, TDM_AC_F32)))
        return NULL;
    tdm_tensor *d = tdm_sub(input, target);
    tdm_tensor *sq = tdm_mul(d, d);
    tdm_drop_temp(d, NULL);
    return reduce(sq, r);
}

/* in: x, target (both contiguous) */
static int bce_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *x = n->in[0], *t = n->in[1];
    const tdm_backend *be = tdm_backend_for(x->device);
    tdm_tensor *g = tdm_contiguous(gout);
    if (!g) return tdm_last_status();
    if (tdm_node_wants(n, 0)) {
        tdm_tensor *gx = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
        if (!gx) return tdm_last_status();
        int rc = be->bce_logits_backward(gx, g, x, t);
        if (!rc) rc = tdm_grad_accumulate(x, gx);
        if (rc) return rc;
    }
    if (tdm_node_wants(n, 1)) { /* d loss / d target = -x */
        tdm_tensor *gt = tdm_tensor_alloc(tdm_shape_of(t), t->dtype, t->device);
        if (!gt) return tdm_last_status();
        int rc = be->binary(TDM_BIN_MUL, gt, g, x);
        if (!rc) rc = be->unary(TDM_UN_NEG, gt, gt, 0.0f);
        if (!rc) rc = tdm_grad_accumulate(t, gt);
        if (rc) return rc;
    }
    return TDM_OK;
}

tdm_tensor *tdm_bce_with_logits(tdm_tensor *input, tdm_tensor *target, tdm_reduction r) {
    if (!input || !target) return tdm_null_input("bce_with_logits");
    tdm_tensor *in0[2] = {input, target};
    TDM_AUTOCAST_SCOPED(2, in0, tdm_bce_with_logits(input, target, r));
    if (check_pair(input, target, r, "bce_with_logits")) return NULL;
    if (!(input = tdm_autocast_arg(input, TDM_AC_F32)) ||
        !(target = tdm_autocast_arg(target, TDM_AC_F32)))
        return NULL;
    const tdm_backend *be = tdm_backend_for(input->device);
    if (!be) return NULL;
    tdm_tensor *x = tdm_contiguous(input), *t = tdm_contiguous(target);
    if (!x || !t) return NULL;
    tdm_tensor *loss = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (!loss || be->bce_logits(loss, x, t)) return NULL;
    tdm_tensor *in[2] = {x, t};
    if (tdm_needs_record(2, in) && !tdm_record("bce_with_logits", bce_backward, loss, 2, in))
        return tdm_drop_fail(loss);
    tdm_drop_temp(x, input);
    tdm_drop_temp(t, target);
    return reduce(loss, r);
}
