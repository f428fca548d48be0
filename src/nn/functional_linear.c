/* tdm_linear: y = x @ w^T + b as one tape node with the bias fused into the GEMM (the backend's
 * linear kernel: cuBLASLt's bias epilogue on a GPU); tdm_linear_gelu: GELU(x @ w^T + b), the GELU
 * in the same GEMM's epilogue on a GPU, its input kept for backward.
 *
 * x [..., in] is seen as a matrix X [M, in] (M = product of the leading dims), so every
 * product is one BLAS call whatever the rank of x:
 *   forward   Y [M, out]  = b (broadcast rows) + X @ W^T        (the backend's linear)
 *   backward  dX [M, in]  = dY @ W
 *             dW [out, in] = dY^T @ X
 *             db [out]     = column sums of dY
 */
#include "autograd/ops.h"
#include "tandem/nn.h"

/* M: the product of x's leading dims (1 for a 1-D x). */
static int64_t leading_rows(const tdm_tensor *x) {
    int64_t rows = 1;
    for (int d = 0; d < x->ndim - 1; d++) rows *= x->shape[d];
    return rows;
}

/* gout may arrive with any strides; the kernels below want it contiguous. */
static tdm_tensor *contiguous_grad(tdm_tensor *g) {
    if (tdm_is_contiguous(g)) return g;
    tdm_tensor *c = tdm_tensor_alloc(tdm_shape_of(g), g->dtype, g->device);
    if (!c || tdm_backend_for(g->device)->copy(c, g)) return NULL;
    return c;
}

/* The gradients of linear(x, w, b) from gy, its output's (contiguous), for those wanted
 * (want[0..2]: x, w, b). */
static int linear_grads_of(tdm_tensor *x, tdm_tensor *w, tdm_tensor *b, tdm_tensor *gy,
                           const bool want[3]) {
    const tdm_backend *be = tdm_backend_for(x->device);
    int64_t out = w->shape[0], in = w->shape[1], rows = leading_rows(x);
    tdm_tensor gy3 = tdm_as_matrix(gy, rows, out);
    if (want[0]) { /* dX [M, in] = dY [M, out] @ W [out, in] */
        tdm_tensor *gx = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
        if (!gx) return tdm_last_status();
        tdm_tensor gx3 = tdm_as_matrix(gx, rows, in), w3 = tdm_as_matrix(w, out, in);
        int rc = be->matmul(&gx3, &gy3, &w3, false, false, 0.0f);
        if (rc || (rc = tdm_grad_accumulate(x, gx))) return rc;
    }
    if (!want[1] && !want[2]) return TDM_OK;
    /* dW [out, in] = dY^T [out, M] @ X [M, in]; db [out] = dY's column sums: one kernel; db
     * into the bias's own .grad where that is stale (nothing to copy after) */
    tdm_tensor *gbo = want[2] ? tdm_grad_overwrite_target(b) : NULL;
    tdm_tensor *gb = !want[2] || gbo ? gbo : tdm_tensor_alloc(tdm_shape_of(b), b->dtype, b->device);
    if (want[2] && !gb) return tdm_last_status();
    /* a parameter's gradient (a view of the flat buffer) takes the GEMM's sum directly */
    float beta = 0.0f;
    tdm_tensor *acc = want[1] ? tdm_grad_inplace_target(w, &beta) : NULL;
    tdm_tensor *gw = !want[1] || acc ? acc : tdm_tensor_alloc(tdm_shape_of(w), w->dtype, w->device);
    if (want[1] && !gw) return tdm_last_status();
    tdm_tensor gw3 = gw ? tdm_as_matrix(gw, out, in) : *w, x3 = tdm_as_matrix(x, rows, in);
    int rc = be->linear_wgrad(gw ? &gw3 : NULL, gb, &gy3, &x3, beta);
    if (!rc && gw && !acc) rc = tdm_grad_accumulate(w, gw);
    if (!rc && gb && !gbo) rc = tdm_grad_accumulate(b, gb);
    return rc;
}

/* The gradients of node n's linear (in: x, w, b) from gy. */
static int linear_grads(tdm_node *n, tdm_tensor *gy) {
    const bool want[3] = {tdm_node_wants(n, 0), tdm_node_wants(n, 1), tdm_node_wants(n, 2)};
    return linear_grads_of(n->in[0], n->in[1], n->in[2], gy, want);
}

static int linear_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *gy = contiguous_grad(gout);
    return gy ? linear_grads(n, gy) : tdm_last_status();
}

/* linear_gelu: the GELU's gradient from its saved input pre, then the linear's. */
static int linear_gelu_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *pre = n->saved[0], *gy = contiguous_grad(gout);
    tdm_tensor *gpre = gy ? tdm_tensor_alloc(tdm_shape_of(pre), pre->dtype, pre->device) : NULL;
    if (!gpre) return tdm_last_status();
    int rc =
        tdm_backend_for(pre->device)->unary_backward(TDM_UN_GELU_TANH, gpre, gy, pre, n->out, 0.0f);
    return rc ? rc : linear_grads(n, gpre);
}

/* linear_gelu_linear (in: x, w1, b1, w2, b2; saved: pre, h): the second linear's weight and
 * bias gradients, then the gradient of the GELU's input through it in one kernel (the product
 * dY W2 with GELU' applied as it is written), then the first linear's. */
static int linear_gelu_linear_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *gy = contiguous_grad(gout), *pre = n->saved[0], *w2 = n->in[3];
    if (!gy) return tdm_last_status();
    const bool want2[3] = {false, tdm_node_wants(n, 3), tdm_node_wants(n, 4)};
    const bool want1[3] = {tdm_node_wants(n, 0), tdm_node_wants(n, 1), tdm_node_wants(n, 2)};
    int rc = linear_grads_of(n->saved[1], w2, n->in[4], gy, want2);
    if (rc || !(want1[0] || want1[1] || want1[2])) return rc;
    int64_t rows = leading_rows(pre), mid = w2->shape[1], out = w2->shape[0];
    tdm_tensor *gpre = tdm_tensor_alloc(tdm_shape_of(pre), pre->dtype, pre->device);
    if (!gpre) return tdm_last_status();
    tdm_tensor g3 = tdm_as_matrix(gpre, rows, mid), gy3 = tdm_as_matrix(gy, rows, out),
               w3 = tdm_as_matrix(w2, out, mid), p3 = tdm_as_matrix(pre, rows, mid);
    rc = tdm_backend_for(pre->device)->linear_dgelu(&g3, &gy3, &w3, &p3);
    return rc ? rc : linear_grads_of(n->in[0], n->in[1], n->in[2], gpre, want1);
}

static int check_linear(const tdm_tensor *x, const tdm_tensor *w, const tdm_tensor *b) {
    char sx[96], sw[96], sb[96];
    if (tdm_check_float(x, "linear") || tdm_check_float(w, "linear") ||
        (b && tdm_check_float(b, "linear")) || tdm_check_same_device(x, w, "linear") ||
        (b && tdm_check_same_device(x, b, "linear")) || tdm_check_same_dtype(x, w, b, "linear"))
        return tdm_last_status();
    tdm_shape_str(tdm_shape_of(x), sx);
    tdm_shape_str(tdm_shape_of(w), sw);
    if (w->ndim != 2)
        return tdm_raise(TDM_ERR_SHAPE, "linear: weight must be 2-D [out, in], got %s", sw);
    if (x->ndim < 1 || x->shape[x->ndim - 1] != w->shape[1])
        return tdm_raise(TDM_ERR_SHAPE,
                         "linear: input %s does not end with in_features %lld of weight %s", sx,
                         (long long)w->shape[1], sw);
    if (b && (b->ndim != 1 || b->shape[0] != w->shape[0]))
        return tdm_raise(TDM_ERR_SHAPE, "linear: bias %s must be [%lld] for weight %s",
                         tdm_shape_str(tdm_shape_of(b), sb), (long long)w->shape[0], sw);
    return TDM_OK;
}

/* The GEMM wants unit stride in the last dim and a plain row layout: x, w, b made so (in
 * the caller's scope). TDM_OK or an error. */
static int linear_operands(tdm_tensor **x, tdm_tensor **w, tdm_tensor **b) {
    if (check_linear(*x, *w, *b)) return tdm_last_status();
    *x = tdm_contiguous(*x);
    *w = tdm_contiguous(*w);
    tdm_tensor *bc = *b ? tdm_contiguous(*b) : NULL;
    if (!*x || !*w || (*b && !bc)) return tdm_last_status();
    *b = bc;
    return TDM_OK;
}

/* A tensor of x's shape with its last dim out (linear's output). */
static tdm_tensor *linear_out(const tdm_tensor *x, int64_t out) {
    tdm_shape ys = tdm_shape_of(x);
    ys.d[ys.ndim - 1] = out;
    return tdm_tensor_alloc(ys, x->dtype, x->device);
}

tdm_tensor *tdm_linear(tdm_tensor *x, tdm_tensor *w, tdm_tensor *b) {
    if (!x || !w) return tdm_null_arg("linear", x ? "weight" : "input");
    tdm_tensor *in0[3] = {x, w, b};
    TDM_AUTOCAST_SCOPED(3, in0, tdm_linear(x, w, b));
    if (!(x = tdm_autocast_arg(x, TDM_AC_LOW)) || !(w = tdm_autocast_arg(w, TDM_AC_LOW)))
        return NULL;
    if (b && !(b = tdm_autocast_arg(b, TDM_AC_LOW))) return NULL;
    if (linear_operands(&x, &w, &b)) return NULL;
    const tdm_backend *be = tdm_backend_for(x->device);
    if (!be) return NULL;
    int64_t out = w->shape[0], in = w->shape[1], rows = leading_rows(x);
    tdm_tensor *y = linear_out(x, out);
    if (!y) return NULL;
    tdm_tensor y3 = tdm_as_matrix(y, rows, out), x3 = tdm_as_matrix(x, rows, in),
               w3 = tdm_as_matrix(w, out, in);
    if (be->linear(&y3, &x3, &w3, b)) return NULL;
    tdm_tensor *in3[3] = {x, w, b};
    if (tdm_needs_record(3, in3) && !tdm_record("linear", linear_backward, y, 3, in3))
        return tdm_drop_fail(y);
    return y;
}

tdm_tensor *tdm_linear_gelu(tdm_tensor *x, tdm_tensor *w, tdm_tensor *b) {
    if (!x || !w || !b) return tdm_null_arg("linear_gelu", !x ? "input" : !w ? "weight" : "bias");
    tdm_tensor *in0[3] = {x, w, b};
    TDM_AUTOCAST_SCOPED(3, in0, tdm_linear_gelu(x, w, b));
    if (!(x = tdm_autocast_arg(x, TDM_AC_LOW)) || !(w = tdm_autocast_arg(w, TDM_AC_LOW)) ||
        !(b = tdm_autocast_arg(b, TDM_AC_LOW)) || linear_operands(&x, &w, &b))
        return NULL;
    const tdm_backend *be = tdm_backend_for(x->device);
    if (!be) return NULL;
    int64_t out = w->shape[0], in = w->shape[1], rows = leading_rows(x);
    tdm_tensor *y = linear_out(x, out), *pre = y ? linear_out(x, out) : NULL;
    if (!pre) return y ? tdm_drop_fail(y) : NULL;
    tdm_tensor y3 = tdm_as_matrix(y, rows, out), p3 = tdm_as_matrix(pre, rows, out),
               x3 = tdm_as_matrix(x, rows, in), w3 = tdm_as_matrix(w, out, in);
    if (be->linear_gelu(&y3, &p3, &x3, &w3, b)) return tdm_drop_fail(pre), tdm_drop_fail(y);
    tdm_tensor *in3[3] = {x, w, b};
    if (tdm_needs_record(3, in3)) {
        tdm_node *n = tdm_record("linear_gelu", linear_gelu_backward, y, 3, in3);
        if (!n) return tdm_drop_fail(y);
        n->saved[0] = pre;
    }
    return y;
}

tdm_tensor *tdm_linear_gelu_linear(tdm_tensor *x, tdm_tensor *w1, tdm_tensor *b1, tdm_tensor *w2,
                                   tdm_tensor *b2) {
    if (!x || !w1 || !b1 || !w2)
        return tdm_null_arg("linear_gelu_linear", !x    ? "input"
                                                  : !w1 ? "first weight"
                                                  : !b1 ? "first bias"
                                                        : "second weight");
    /* its temporaries (pre, h) are a scope's */
    if (!tdm_current_scope()) TDM_RETURN_SCOPED(tdm_linear_gelu_linear(x, w1, b1, w2, b2));
    tdm_tensor *in0[5] = {x, w1, b1, w2, b2};
    TDM_AUTOCAST_SCOPED(5, in0, tdm_linear_gelu_linear(x, w1, b1, w2, b2));
    if (!(x = tdm_autocast_arg(x, TDM_AC_LOW)) || !(w1 = tdm_autocast_arg(w1, TDM_AC_LOW)) ||
        !(b1 = tdm_autocast_arg(b1, TDM_AC_LOW)) || !(w2 = tdm_autocast_arg(w2, TDM_AC_LOW)) ||
        (b2 && !(b2 = tdm_autocast_arg(b2, TDM_AC_LOW))) || linear_operands(&x, &w1, &b1))
        return NULL;
    const tdm_backend *be = tdm_backend_for(x->device);
    if (!be) return NULL;
    int64_t mid = w1->shape[0], in = w1->shape[1], rows = leading_rows(x);
    /* h, the second linear's input, made first so that its operands are checked before any
     * work */
    tdm_tensor *h = linear_out(x, mid), *pre = h ? linear_out(x, mid) : NULL;
    if (!pre || linear_operands(&h, &w2, &b2)) return NULL;
    int64_t out = w2->shape[0];
    tdm_tensor *y = linear_out(x, out);
    if (!y) return NULL;
    tdm_tensor h3 = tdm_as_matrix(h, rows, mid), p3 = tdm_as_matrix(pre, rows, mid),
               x3 = tdm_as_matrix(x, rows, in), w13 = tdm_as_matrix(w1, mid, in),
               y3 = tdm_as_matrix(y, rows, out), w23 = tdm_as_matrix(w2, out, mid);
    if (be->linear_gelu(&h3, &p3, &x3, &w13, b1) || be->linear(&y3, &h3, &w23, b2)) return NULL;
    tdm_tensor *in5[5] = {x, w1, b1, w2, b2};
    if (tdm_needs_record(5, in5)) {
        tdm_node *n = tdm_record("linear_gelu_linear", linear_gelu_linear_backward, y, 5, in5);
        if (!n) return NULL;
        n->saved[0] = pre;
        n->saved[1] = h;
    }
    return y;
}
