/* Shape ops: views that share storage (reshape, transpose, permute, slice, expand, squeeze),
 * and the copies around them (contiguous, concat, to_device). Each records a node whose
 * backward maps the output gradient back to the input's geometry. */
#include "autograd/ops.h"

#include <stdlib.h>
#include <string.h>

/* ---- plain views ------------------------------------------------------------------------- */

/* reshape / squeeze / unsqueeze / flatten: the gradient is gout viewed in x's shape. */
static int reshape_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *x = n->in[0];
    int64_t strides[TDM_MAX_DIMS];
    tdm_contiguous_strides(x->ndim, x->shape, strides);
    tdm_tensor *g = tdm_tensor_view(gout, x->ndim, x->shape, strides, gout->offset);
    return g ? tdm_grad_accumulate(x, g) : tdm_last_status();
}

/* A view of x with new geometry, recording bw when x needs a gradient. */
static tdm_tensor *view_of(tdm_tensor *x, int ndim, const int64_t *shape, const int64_t *strides,
                           int64_t offset, const char *name, tdm_backward_fn bw) {
    tdm_tensor *y = tdm_tensor_view(x, ndim, shape, strides, offset);
    if (y && tdm_needs_record(1, &x) && !tdm_record(name, bw, y, 1, &x)) return tdm_drop_fail(y);
    return y;
}

/* Strides for viewing x as shape s without a copy, if x's layout allows it; false
 * otherwise. Groups x's dims into chunks that are contiguous among themselves and maps each
 * chunk onto consecutive dims of s (the stride computation of torch.view). */
static bool view_strides(const tdm_tensor *x, tdm_shape s, int64_t *out) {
    if (tdm_is_contiguous(x) || tdm_numel(x) == 0) {
        tdm_contiguous_strides(s.ndim, s.d, out);
        return true;
    }
    int vd = s.ndim - 1;
    int64_t base = x->strides[x->ndim - 1], tn = 1, vn = 1;
    for (int td = x->ndim - 1; td >= 0; td--) {
        tn *= x->shape[td];
        bool chunk_ends = td == 0 || (x->shape[td - 1] != 1 && x->strides[td - 1] != tn * base);
        if (!chunk_ends) continue;
        while (vd >= 0 && (vn < tn || s.d[vd] == 1)) {
            out[vd] = vn * base;
            vn *= s.d[vd];
            vd--;
        }
        if (vn != tn) return false;
        if (td > 0) {
            base = x->strides[td - 1];
            tn = vn = 1;
        }
    }
    return vd == -1;
}

tdm_tensor *tdm_reshape(tdm_tensor *x, tdm_shape s) {
    if (!x) return NULL;
    char a[96], b[96];
    int infer = -1;
    int64_t known = 1;
    if (s.ndim < 0 || s.ndim > TDM_MAX_DIMS)
        return tdm_raise_null(TDM_ERR_SHAPE, "reshape: %d dims", s.ndim);
    for (int i = 0; i < s.ndim; i++) {
        if (s.d[i] == -1 && infer < 0)
            infer = i;
        else if (s.d[i] < 0)
            return tdm_raise_null(TDM_ERR_SHAPE, "reshape: invalid shape %s", tdm_shape_str(s, a));
        else
            known *= s.d[i];
    }
    int64_t n = tdm_numel(x);
    if (infer >= 0) {
        if (known == 0 || n % known)
            return tdm_raise_null(TDM_ERR_SHAPE, "reshape: cannot view %s as %s",
                                  tdm_tensor_shape_str(x, b), tdm_shape_str(s, a));
        s.d[infer] = n / known;
    }
    if (tdm_shape_numel(s) != n)
        return tdm_raise_null(TDM_ERR_SHAPE, "reshape: cannot view %s (%lld elements) as %s",
                              tdm_tensor_shape_str(x, b), (long long)n, tdm_shape_str(s, a));
    int64_t strides[TDM_MAX_DIMS];
    if (!view_strides(x, s, strides)) {
        if (!tdm_current_scope() && !tdm_needs_record(1, &x)) TDM_RETURN_SCOPED(tdm_reshape(x, s));
        x = tdm_contiguous(x);
        if (!x) return NULL;
        tdm_contiguous_strides(s.ndim, s.d, strides);
    }
    return view_of(x, s.ndim, s.d, strides, x->offset, "reshape", reshape_backward);
}

tdm_tensor *tdm_flatten(tdm_tensor *x, int start_dim, int end_dim) {
    if (!x) return NULL;
    if (x->ndim == 0) return tdm_reshape(x, TDM_SHAPE(1));
    int s0 = tdm_wrap_dim(start_dim, x->ndim, "flatten");
    int s1 = tdm_wrap_dim(end_dim, x->ndim, "flatten");
    if (s0 < 0 || s1 < 0) return NULL;
    if (s0 > s1)
        return tdm_raise_null(TDM_ERR_ARG, "flatten: start_dim %d after end_dim %d", start_dim,
                              end_dim);
    tdm_shape s = {0, {0}};
    for (int i = 0; i < x->ndim; i++) {
        if (i > s0 && i <= s1)
            s.d[s.ndim - 1] *= x->shape[i];
        else
            s.d[s.ndim++] = x->shape[i];
    }
    return tdm_reshape(x, s);
}

tdm_tensor *tdm_unsqueeze(tdm_tensor *x, int dim) {
    if (!x) return NULL;
    int d = tdm_wrap_dim(dim, x->ndim + 1, "unsqueeze");
    if (d < 0) return NULL;
    if (x->ndim == TDM_MAX_DIMS) return tdm_raise_null(TDM_ERR_SHAPE, "unsqueeze: too many dims");
    int64_t shape[TDM_MAX_DIMS], strides[TDM_MAX_DIMS];
    for (int i = 0, j = 0; i <= x->ndim; i++) {
        if (i == d) {
            shape[i] = 1;
            strides[i] = j < x->ndim ? x->strides[j] * x->shape[j] : 1;
        } else {
            shape[i] = x->shape[j];
            strides[i] = x->strides[j++];
        }
    }
    return view_of(x, x->ndim + 1, shape, strides, x->offset, "unsqueeze", reshape_backward);
}

tdm_tensor *tdm_squeeze(tdm_tensor *x, int dim) {
    if (!x) return NULL;
    int d = tdm_wrap_dim(dim, x->ndim, "squeeze");
    if (d < 0) return NULL;
    if (x->shape[d] != 1) return x; /* as torch.squeeze(dim): a no-op for a dim of size > 1 */
    int64_t shape[TDM_MAX_DIMS], strides[TDM_MAX_DIMS];
    for (int i = 0, j = 0; i < x->ndim; i++)
        if (i != d) {
            shape[j] = x->shape[i];
            strides[j++] = x->strides[i];
        }
    return view_of(x, x->ndim - 1, shape, strides, x->offset, "squeeze", reshape_backward);
}

/* ---- permutations ------------------------------------------------------------------------ */

static int permute_backward(tdm_node *n, tdm_tensor *gout) {
    int inv[TDM_MAX_DIMS];
    for (int i = 0; i < gout->ndim; i++) inv[n->arg.i[i]] = i;
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *g = tdm_permute(gout, inv);
    tdm_set_grad_enabled(prev);
    return tdm_grad_accumulate(n->in[0], g);
}

tdm_tensor *tdm_permute(tdm_tensor *x, const int *dims) {
    if (!x) return NULL;
    if (!dims) return tdm_raise_null(TDM_ERR_ARG, "permute: NULL dims");
    int64_t shape[TDM_MAX_DIMS], strides[TDM_MAX_DIMS];
    bool seen[TDM_MAX_DIMS] = {false};
    int wrapped[TDM_MAX_DIMS];
    for (int i = 0; i < x->ndim; i++) {
        int d = tdm_wrap_dim(dims[i], x->ndim, "permute");
        if (d < 0) return NULL;
        if (seen[d]) return tdm_raise_null(TDM_ERR_ARG, "permute: dim %d repeated", dims[i]);
        seen[d] = true;
        wrapped[i] = d;
        shape[i] = x->shape[d];
        strides[i] = x->strides[d];
    }
    tdm_tensor *y = view_of(x, x->ndim, shape, strides, x->offset, "permute", permute_backward);
    if (y && y->grad_fn)
        for (int i = 0; i < x->ndim; i++) y->grad_fn->arg.i[i] = wrapped[i];
    return y;
}

tdm_tensor *tdm_transpose(tdm_tensor *x, int dim0, int dim1) {
    if (!x) return NULL;
    int a = tdm_wrap_dim(dim0, x->ndim, "transpose"), b = tdm_wrap_dim(dim1, x->ndim, "transpose");
    if (a < 0 || b < 0) return NULL;
    int dims[TDM_MAX_DIMS];
    for (int i = 0; i < x->ndim; i++) dims[i] = i;
    dims[a] = b;
    dims[b] = a;
    return tdm_permute(x, dims);
}

/* ---- slice and expand -------------------------------------------------------------------- */

/* gx = zeros(x); gx[slice] = gout */
static int slice_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *x = n->in[0];
    const tdm_backend *be = tdm_backend_for(x->device);
    tdm_tensor *gx = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (!gx || be->fill(gx, 0.0)) return tdm_last_status();
    int dim = (int)n->arg.i[0];
    int64_t start = n->arg.i[1], step = n->arg.i[2];
    tdm_tensor part = *gx;
    part.shape[dim] = gout->shape[dim];
    part.strides[dim] *= step;
    part.offset += start * gx->strides[dim];
    int rc = be->copy(&part, gout);
    return rc ? rc : tdm_grad_accumulate(x, gx);
}

tdm_tensor *tdm_slice(tdm_tensor *x, int dim, int64_t start, int64_t end, int64_t step) {
    if (!x) return NULL;
    int d = tdm_wrap_dim(dim, x->ndim, "slice");
    if (d < 0) return NULL;
    if (step < 1)
        return tdm_raise_null(TDM_ERR_ARG, "slice: step %lld must be >= 1", (long long)step);
    int64_t size = x->shape[d];
    if (start < 0) start += size;
    if (end < 0) end += size;
    start = start < 0 ? 0 : start > size ? size : start;
    end = end < start ? start : end > size ? size : end;
    int64_t shape[TDM_MAX_DIMS], strides[TDM_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    memcpy(strides, x->strides, sizeof strides);
    shape[d] = (end - start + step - 1) / step;
    strides[d] *= step;
    tdm_tensor *y = view_of(x, x->ndim, shape, strides, x->offset + start * x->strides[d], "slice",
                            slice_backward);
    if (y && y->grad_fn) {
        y->grad_fn->arg.i[0] = d;
        y->grad_fn->arg.i[1] = start;
        y->grad_fn->arg.i[2] = step;
    }
    return y;
}

static int expand_backward(tdm_node *n, tdm_tensor *gout) {
    return tdm_grad_accumulate_reduced(n->in[0], gout);
}

tdm_tensor *tdm_expand(tdm_tensor *x, tdm_shape s) {
    if (!x) return NULL;
    char a[96], b[96];
    int pad = s.ndim - x->ndim;
    if (pad < 0 || s.ndim > TDM_MAX_DIMS)
        return tdm_raise_null(TDM_ERR_SHAPE, "expand: cannot expand %s to %s",
                              tdm_tensor_shape_str(x, a), tdm_shape_str(s, b));
    int64_t shape[TDM_MAX_DIMS], strides[TDM_MAX_DIMS];
    for (int i = 0; i < s.ndim; i++) {
        int64_t have = i < pad ? 1 : x->shape[i - pad];
        int64_t want = s.d[i] == -1 ? have : s.d[i];
        if (i < pad && s.d[i] == -1)
            return tdm_raise_null(TDM_ERR_SHAPE, "expand: -1 in a new leading dim of %s",
                                  tdm_shape_str(s, b));
        if (have != want && have != 1)
            return tdm_raise_null(TDM_ERR_SHAPE, "expand: cannot expand %s to %s (dim %d)",
                                  tdm_tensor_shape_str(x, a), tdm_shape_str(s, b), i);
        shape[i] = want;
        strides[i] = (i < pad || have != want) ? 0 : x->strides[i - pad];
    }
    return view_of(x, s.ndim, shape, strides, x->offset, "expand", expand_backward);
}

/* ---- copies ------------------------------------------------------------------------------ */

static int identity_backward(tdm_node *n, tdm_tensor *gout) {
    return tdm_grad_accumulate(n->in[0], gout);
}

tdm_tensor *tdm_contiguous(tdm_tensor *x) {
    if (!x) return NULL;
    if (tdm_is_contiguous(x)) return x;
    tdm_tensor *y = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (!y || tdm_backend_for(x->device)->copy(y, x)) return NULL;
    if (tdm_needs_record(1, &x) && !tdm_record("contiguous", identity_backward, y, 1, &x))
        return tdm_drop_fail(y);
    return y;
}

static int to_device_backward(tdm_node *n, tdm_tensor *gout) {
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *g = tdm_to_device(gout, n->in[0]->device);
    tdm_set_grad_enabled(prev);
    return tdm_grad_accumulate(n->in[0], g);
}

tdm_tensor *tdm_to_device(tdm_tensor *x, tdm_device dev) {
    if (!x) return NULL;
    const tdm_backend *to = tdm_backend_for(dev), *from = tdm_backend_for(x->device);
    if (!to || !from) return NULL;
    tdm_tensor *y = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, dev);
    if (!y) return NULL;
    int rc;
    if (dev.type == TDM_CPU && x->device.type == TDM_CPU) {
        rc = from->copy(y, x); /* CPU devices share one address space */
    } else if (dev.type == TDM_CPU) {
        rc = from->to_host(tdm_data_ptr(y), x);
    } else if (x->device.type == TDM_CPU) {
        tdm_tensor *xc = tdm_contiguous(x);
        rc = xc ? to->from_host(y, tdm_data_ptr(xc)) : tdm_last_status();
    } else if (tdm_device_equal(dev, x->device)) {
        rc = from->copy(y, x);
    } else { /* GPU to GPU through host memory: correct everywhere, and rare (cloning a replica);
              * a peer copy would spare the host round trip */
        size_t bytes = (size_t)tdm_numel(x) * tdm_dtype_size(x->dtype);
        void *host = malloc(bytes ? bytes : 1);
        rc = host ? from->to_host(host, x) : tdm_raise(TDM_ERR_NOMEM, "to_device: out of memory");
        if (!rc) rc = to->from_host(y, host);
        free(host);
    }
    if (rc) return NULL;
    if (tdm_needs_record(1, &x) && !tdm_record("to_device", to_device_backward, y, 1, &x))
        return tdm_drop_fail(y);
    return y;
}

static int to_dtype_backward(tdm_node *n, tdm_tensor *gout) {
    /* a parameter's .grad (autocast casts every parameter it multiplies) takes the gradient
     * converted (beta 0) or added in its own dtype (beta 1) in one pass, with no copy in the
     * parameter's dtype between */
    float beta = 0.0f;
    tdm_tensor *acc = tdm_is_contiguous(gout) ? tdm_grad_inplace_target(n->in[0], &beta) : NULL;
    if (acc) {
        const tdm_backend *be = tdm_backend_for(acc->device);
        return beta == 0.0f ? be->copy(acc, gout) : be->axpy(acc, 1.0f, gout);
    }
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *g = tdm_cast(gout, n->in[0]->dtype);
    tdm_set_grad_enabled(prev);
    return g ? tdm_grad_accumulate(n->in[0], g) : tdm_last_status();
}

tdm_tensor *tdm_to_dtype(tdm_tensor *x, tdm_dtype dt) {
    if (!x) return NULL;
    tdm_tensor *y = tdm_cast(x, dt);
    if (!y) return NULL;
    /* only a float result carries a gradient, as an integer .to() in PyTorch */
    bool floats = tdm_dtype_is_float(x->dtype) && tdm_dtype_is_float(dt);
    if (floats && tdm_needs_record(1, &x) && !tdm_record("to_dtype", to_dtype_backward, y, 1, &x))
        return tdm_drop_fail(y);
    return y;
}

/* ---- concat and split -------------------------------------------------------------------- */

static int concat_backward(tdm_node *n, tdm_tensor *gout) {
    int dim = (int)n->arg.i[0];
    int64_t at = 0;
    bool prev = tdm_set_grad_enabled(false);
    int rc = TDM_OK;
    for (int i = 0; i < n->n_in && rc == TDM_OK; i++) {
        int64_t len = n->in[i]->shape[dim];
        if (tdm_node_wants(n, i))
            rc = tdm_grad_accumulate(n->in[i], tdm_slice(gout, dim, at, at + len, 1));
        at += len;
    }
    tdm_set_grad_enabled(prev);
    return rc;
}

tdm_tensor *tdm_concat(tdm_tensor *const *ts, int n, int dim) {
    if (!ts || n < 1) return tdm_raise_null(TDM_ERR_ARG, "concat: no tensors");
    for (int i = 0; i < n; i++)
        if (!ts[i]) return NULL;
    if (n > TDM_NODE_MAX_IN && tdm_needs_record(n, ts)) {
        /* more inputs than a node holds: join in two steps so autograd sees all of them */
        tdm_tensor *pair[2] = {tdm_concat(ts, n - 1, dim), ts[n - 1]};
        return pair[0] ? tdm_concat(pair, 2, dim) : NULL;
    }
    const tdm_tensor *t0 = ts[0];
    int d = tdm_wrap_dim(dim, t0->ndim, "concat");
    if (d < 0) return NULL;
    tdm_shape s = tdm_shape_of(t0);
    char a[96], b[96];
    tdm_dtype dt = t0->dtype; /* floats promote to the widest, as torch.cat */
    for (int i = 1; i < n; i++) {
        const tdm_tensor *t = ts[i];
        bool floats = tdm_dtype_is_float(t->dtype) && tdm_dtype_is_float(t0->dtype);
        bool ok = t->ndim == t0->ndim && (t->dtype == t0->dtype || floats);
        if (floats) dt = tdm_promote(dt, t->dtype);
        for (int k = 0; ok && k < t->ndim; k++) ok = k == d || t->shape[k] == t0->shape[k];
        if (!ok)
            return tdm_raise_null(TDM_ERR_SHAPE,
                                  "concat: tensor %d has shape %s (%s), tensor 0 "
                                  "has %s (%s), joining along dim %d",
                                  i, tdm_tensor_shape_str(t, a), tdm_dtype_name(t->dtype),
                                  tdm_tensor_shape_str(t0, b), tdm_dtype_name(t0->dtype), d);
        if (tdm_check_same_device(t0, t, "concat")) return NULL;
        s.d[d] += t->shape[d];
    }
    tdm_tensor *y = tdm_tensor_alloc(s, dt, t0->device);
    if (!y) return NULL;
    const tdm_backend *be = tdm_backend_for(y->device);
    int64_t at = 0;
    for (int i = 0; i < n; i++) {
        tdm_tensor part = *y;
        part.shape[d] = ts[i]->shape[d];
        part.offset = at * y->strides[d];
        if (be->copy(&part, ts[i])) return NULL;
        at += ts[i]->shape[d];
    }
    if (tdm_needs_record(n, ts)) {
        tdm_node *nd = tdm_record("concat", concat_backward, y, n, ts);
        if (!nd) return tdm_drop_fail(y);
        nd->arg.i[0] = d;
    }
    return y;
}

int tdm_split(tdm_tensor *t, const int64_t *sizes, int n, int dim, tdm_tensor **out) {
    if (!t || !sizes || !out || n < 1) return tdm_raise(TDM_ERR_ARG, "split: NULL argument");
    int d = tdm_wrap_dim(dim, t->ndim, "split");
    if (d < 0) return TDM_ERR_ARG;
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += sizes[i];
    char a[96];
    if (total != t->shape[d])
        return tdm_raise(TDM_ERR_SHAPE, "split: sizes sum to %lld but dim %d of %s is %lld",
                         (long long)total, d, tdm_tensor_shape_str(t, a), (long long)t->shape[d]);
    int64_t at = 0;
    for (int i = 0; i < n; i++) {
        if (!(out[i] = tdm_slice(t, d, at, at + sizes[i], 1))) return tdm_last_status();
        at += sizes[i];
    }
    return TDM_OK;
}
