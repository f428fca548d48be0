/* Math ops: element-wise arithmetic with PyTorch broadcasting, unary functions, reductions
 * and (log-)softmax. Each checks its inputs, computes through the backend and records a tape
 * node whose backward uses kernels directly (no double backward).
 *
 * Broadcasting never materialises the expanded operands: the kernels receive stack copies
 * of the input headers with stride 0 on broadcast dims (expanded_view), and backward sums
 * the full-size gradient back down with tdm_grad_accumulate_reduced.
 *
 * Softmax over a dim that is not the last one transposes that dim to the end, runs the
 * last-dim kernel on a contiguous copy and transposes the result back (two extra copies).
 * Softmax over a middle dim is rare in the models we train, and this keeps one simple,
 * vectorisable kernel per backend instead of a strided [outer, n, inner] variant.
 */
#include "autograd/ops.h"

#include <string.h>

/* A header-only view of t: same storage, the given geometry. Lives on the caller's stack and
 * is only ever handed to kernels, so it takes no reference and joins no scope. */
static tdm_tensor stack_view(const tdm_tensor *t, int ndim, const int64_t *shape,
                             const int64_t *strides) {
    tdm_tensor v = *t;
    v.ndim = ndim;
    memcpy(v.shape, shape, sizeof(int64_t) * (size_t)ndim);
    memcpy(v.strides, strides, sizeof(int64_t) * (size_t)ndim);
    v.requires_grad = false;
    v.grad = NULL;
    v.grad_fn = NULL;
    memset(v.internal_, 0, sizeof v.internal_); /* owned by nobody, on no list */
    return v;
}

/* t broadcast to s (t's shape broadcasts to s): stride 0 on new and size-1 dims. */
static tdm_tensor expanded_view(const tdm_tensor *t, tdm_shape s) {
    int64_t st[TDM_MAX_DIMS];
    int pad = s.ndim - t->ndim;
    for (int d = 0; d < s.ndim; d++) {
        int src = d - pad;
        st[d] = src >= 0 && t->shape[src] == s.d[d] ? t->strides[src] : 0;
    }
    return stack_view(t, s.ndim, s.d, st);
}

/* t with dims d0 and d1 swapped (a stack view). */
static tdm_tensor swapped_view(const tdm_tensor *t, int d0, int d1) {
    int64_t sh[TDM_MAX_DIMS], st[TDM_MAX_DIMS];
    memcpy(sh, t->shape, sizeof sh);
    memcpy(st, t->strides, sizeof st);
    sh[d0] = t->shape[d1];
    sh[d1] = t->shape[d0];
    st[d0] = t->strides[d1];
    st[d1] = t->strides[d0];
    return stack_view(t, t->ndim, sh, st);
}

/* ---- binary ops ---------------------------------------------------------------------- */

/* y = a op b with a, b expanded to y's shape */
static int binary_into(tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a, const tdm_tensor *b) {
    tdm_shape s = tdm_shape_of(y);
    tdm_tensor av = expanded_view(a, s), bv = expanded_view(b, s);
    return tdm_backend_for(y->device)->binary(op, y, &av, &bv);
}

/* A new tensor of gout's shape holding gout op other (other broadcast to it). */
static tdm_tensor *binary_new(tdm_binary_op op, const tdm_tensor *x, const tdm_tensor *other,
                              tdm_shape s) {
    tdm_tensor *g = tdm_tensor_alloc(s, tdm_promote(x->dtype, other->dtype), x->device);
    if (g && binary_into(op, g, x, other) != 0) return tdm_drop_fail(g);
    return g;
}

static int add_backward(tdm_node *n, tdm_tensor *gout) {
    int rc = tdm_grad_accumulate_reduced(n->in[0], gout);
    return rc ? rc : tdm_grad_accumulate_reduced(n->in[1], gout);
}

static int sub_backward(tdm_node *n, tdm_tensor *gout) {
    int rc = tdm_grad_accumulate_reduced(n->in[0], gout);
    if (rc || !tdm_node_wants(n, 1)) return rc;
    tdm_tensor *g = tdm_tensor_alloc(tdm_shape_of(gout), gout->dtype, gout->device);
    if (!g) return tdm_last_status();
    rc = tdm_backend_for(g->device)->unary(TDM_UN_NEG, g, gout, 0);
    return rc ? rc : tdm_grad_accumulate_reduced(n->in[1], g);
}

/* d(a*b)/da = b, d(a*b)/db = a, each summed down to its input's shape */
static int mul_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_shape s = tdm_shape_of(gout);
    for (int i = 0; i < 2; i++) {
        if (!tdm_node_wants(n, i)) continue;
        int rc =
            tdm_grad_accumulate_reduced(n->in[i], binary_new(TDM_BIN_MUL, gout, n->in[1 - i], s));
        if (rc) return rc;
    }
    return TDM_OK;
}

/* ga = gout / b; gb = -gout * a / b^2 = -ga * out */
static int div_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_shape s = tdm_shape_of(gout);
    tdm_tensor *ga = binary_new(TDM_BIN_DIV, gout, n->in[1], s);
    if (!ga) return tdm_last_status();
    if (tdm_node_wants(n, 1)) {
        tdm_tensor *gb = binary_new(TDM_BIN_MUL, ga, n->out, s);
        if (!gb || tdm_backend_for(gb->device)->unary(TDM_UN_NEG, gb, gb, 0) != 0)
            return tdm_last_status();
        int rc = tdm_grad_accumulate_reduced(n->in[1], gb);
        if (rc) return rc;
    }
    return tdm_grad_accumulate_reduced(n->in[0], ga);
}

static tdm_tensor *binary_op(tdm_binary_op op, const char *name, tdm_backward_fn bw, tdm_tensor *a,
                             tdm_tensor *b) {
    if (!a || !b) return tdm_null_input(name);
    if (tdm_check_float(a, name) || tdm_check_float(b, name) || tdm_check_same_device(a, b, name))
        return NULL;
    tdm_shape s;
    if (tdm_broadcast_shapes(a, b, &s, name)) return NULL;
    tdm_tensor *y = tdm_tensor_alloc(s, tdm_promote(a->dtype, b->dtype), a->device);
    if (!y) return NULL;
    if (binary_into(op, y, a, b) != 0) return tdm_drop_fail(y);
    tdm_tensor *in[2] = {a, b};
    if (tdm_needs_record(2, in) && !tdm_record(name, bw, y, 2, in)) return tdm_drop_fail(y);
    return y;
}

tdm_tensor *tdm_add(tdm_tensor *a, tdm_tensor *b) {
    return binary_op(TDM_BIN_ADD, "add", add_backward, a, b);
}

tdm_node *tdm_record_add(tdm_tensor *y, tdm_tensor *a, tdm_tensor *b) {
    tdm_tensor *in[2] = {a, b};
    return tdm_record("add", add_backward, y, 2, in);
}

tdm_tensor *tdm_sub(tdm_tensor *a, tdm_tensor *b) {
    return binary_op(TDM_BIN_SUB, "sub", sub_backward, a, b);
}

tdm_tensor *tdm_mul(tdm_tensor *a, tdm_tensor *b) {
    return binary_op(TDM_BIN_MUL, "mul", mul_backward, a, b);
}

tdm_tensor *tdm_div(tdm_tensor *a, tdm_tensor *b) {
    return binary_op(TDM_BIN_DIV, "div", div_backward, a, b);
}

/* ---- unary ops ----------------------------------------------------------------------- */

/* node args: arg.f[0] the scalar, arg2.i[0] the tdm_unary_op; the kernel reads x (in[0]) or
 * y (out), whichever its derivative needs */
static int unary_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *x = n->in[0];
    tdm_tensor *g = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (!g) return tdm_last_status();
    int rc = tdm_backend_for(x->device)->unary_backward((tdm_unary_op)n->arg2.i[0], g, gout, x,
                                                        n->out, n->arg.f[0]);
    return rc ? rc : tdm_grad_accumulate(x, g);
}

/* list: the autocast list of the op (TDM_AC_F32_CUDA for exp, log, pow), or -1 for none */
static tdm_tensor *unary_op(tdm_unary_op op, const char *name, tdm_tensor *a, float s, int list) {
    if (!a) return tdm_null_input(name);
    if (tdm_check_float(a, name)) return NULL;
    if (list >= 0) TDM_AUTOCAST_SCOPED(1, &a, unary_op(op, name, a, s, list));
    if (list >= 0 && !(a = tdm_autocast_arg(a, (tdm_autocast_list)list))) return NULL;
    tdm_tensor *y = tdm_tensor_alloc(tdm_shape_of(a), a->dtype, a->device);
    if (!y) return NULL;
    if (tdm_backend_for(a->device)->unary(op, y, a, s) != 0) return tdm_drop_fail(y);
    if (tdm_needs_record(1, &a)) {
        tdm_node *n = tdm_record(name, unary_backward, y, 1, &a);
        if (!n) return tdm_drop_fail(y);
        n->arg.f[0] = s;
        n->arg2.i[0] = op;
    }
    return y;
}

tdm_tensor *tdm_add_scalar(tdm_tensor *a, float s) {
    return unary_op(TDM_UN_ADD_SCALAR, "add_scalar", a, s, -1);
}

tdm_tensor *tdm_mul_scalar(tdm_tensor *a, float s) {
    return unary_op(TDM_UN_MUL_SCALAR, "mul_scalar", a, s, -1);
}

tdm_tensor *tdm_pow_scalar(tdm_tensor *a, float p) {
    return unary_op(TDM_UN_POW_SCALAR, "pow_scalar", a, p, TDM_AC_F32_CUDA);
}

tdm_tensor *tdm_neg(tdm_tensor *a) {
    return unary_op(TDM_UN_NEG, "neg", a, 0, -1);
}

tdm_tensor *tdm_exp(tdm_tensor *a) {
    return unary_op(TDM_UN_EXP, "exp", a, 0, TDM_AC_F32_CUDA);
}

tdm_tensor *tdm_log(tdm_tensor *a) {
    return unary_op(TDM_UN_LOG, "log", a, 0, TDM_AC_F32_CUDA);
}

tdm_tensor *tdm_sqrt(tdm_tensor *a) {
    return unary_op(TDM_UN_SQRT, "sqrt", a, 0, -1);
}

tdm_tensor *tdm_relu(tdm_tensor *a) {
    return unary_op(TDM_UN_RELU, "relu", a, 0, -1);
}

tdm_tensor *tdm_gelu(tdm_tensor *a, bool tanh_approx) {
    return unary_op(tanh_approx ? TDM_UN_GELU_TANH : TDM_UN_GELU_ERF, "gelu", a, 0, -1);
}

tdm_tensor *tdm_tanh(tdm_tensor *a) {
    return unary_op(TDM_UN_TANH, "tanh", a, 0, -1);
}

tdm_tensor *tdm_sigmoid(tdm_tensor *a) {
    return unary_op(TDM_UN_SIGMOID, "sigmoid", a, 0, -1);
}

tdm_tensor *tdm_softsign(tdm_tensor *a) {
    return unary_op(TDM_UN_SOFTSIGN, "softsign", a, 0, -1);
}

/* ---- reductions ---------------------------------------------------------------------- */

/* g [x's shape] = scale * gout broadcast back over the reduced dim d of x. gout has the
 * reduced shape (keepdim or not); it is read through a stride-0 view, never expanded. */
static tdm_tensor *unreduce(const tdm_tensor *x, const tdm_tensor *gout, int d, float scale) {
    int64_t st[TDM_MAX_DIMS];
    bool keep = gout->ndim == x->ndim;
    for (int i = 0, j = 0; i < x->ndim; i++) {
        if (i == d) {
            st[i] = 0;
            if (keep) j++;
        } else {
            st[i] = gout->strides[j++];
        }
    }
    tdm_tensor gv = stack_view(gout, x->ndim, x->shape, st);
    tdm_tensor *g = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (g && tdm_backend_for(x->device)->unary(TDM_UN_MUL_SCALAR, g, &gv, scale) != 0)
        return tdm_drop_fail(g);
    return g;
}

/* node args: arg.i[0] the reduced dim (-1: all dims) */
static int sum_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *x = n->in[0];
    int d = (int)n->arg.i[0];
    int64_t count = d < 0 ? tdm_numel(x) : (x->ndim ? x->shape[d] : 1);
    float scale = n->arg.i[1] ? 1.0f / (float)count : 1.0f; /* arg.i[1]: mean */
    tdm_tensor *g;
    if (d < 0) { /* every element gets the one upstream value */
        int64_t zero[TDM_MAX_DIMS] = {0};
        tdm_tensor gv = stack_view(gout, x->ndim, x->shape, zero);
        g = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
        if (g && tdm_backend_for(x->device)->unary(TDM_UN_MUL_SCALAR, g, &gv, scale) != 0)
            g = tdm_drop_fail(g);
    } else {
        g = unreduce(x, gout, d, scale);
    }
    return g ? tdm_grad_accumulate(x, g) : tdm_last_status();
}

static int max_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *x = n->in[0], *gy = tdm_dense(gout);
    tdm_tensor *g = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (!gy || !g) return tdm_last_status();
    int rc = tdm_backend_for(x->device)->max_backward(g, gy, n->saved[0], (int)n->arg.i[0]);
    tdm_drop_temp(gy, gout);
    return rc ? rc : tdm_grad_accumulate(x, g);
}

/* The shape of a reduced over dim d. */
static tdm_shape reduced_shape(const tdm_tensor *a, int d, bool keepdim) {
    tdm_shape s = {0, {0}};
    for (int i = 0; i < a->ndim; i++) {
        if (i != d)
            s.d[s.ndim++] = a->shape[i];
        else if (keepdim)
            s.d[s.ndim++] = 1;
    }
    return s;
}

static tdm_tensor *reduce_op(tdm_reduce_op op, const char *name, tdm_tensor *a, int dim,
                             bool keepdim, tdm_tensor **argmax) {
    if (argmax) *argmax = NULL;
    if (!a) return tdm_null_input(name);
    if (tdm_check_float(a, name)) return NULL;
    if (op == TDM_RED_SUM) TDM_AUTOCAST_SCOPED(1, &a, reduce_op(op, name, a, dim, keepdim, argmax));
    if (op == TDM_RED_SUM && !(a = tdm_autocast_arg(a, TDM_AC_F32_CUDA))) return NULL;
    int d = tdm_wrap_dim(dim, a->ndim, name);
    if (d < 0) return NULL;
    char b[96];
    if (op == TDM_RED_MAX && a->ndim && a->shape[d] == 0)
        return tdm_raise_null(TDM_ERR_SHAPE, "%s: dim %d of %s is empty", name, dim,
                              tdm_tensor_shape_str(a, b));
    tdm_shape s = reduced_shape(a, d, keepdim);
    tdm_tensor *x = tdm_dense(a);
    tdm_tensor *y = tdm_tensor_alloc(s, a->dtype, a->device);
    tdm_tensor *am = op == TDM_RED_MAX ? tdm_tensor_alloc(s, TDM_I64, a->device) : NULL;
    if (!x || !y || (op == TDM_RED_MAX && !am) ||
        tdm_backend_for(a->device)->reduce(op, y, x, d, am) != 0) {
        tdm_drop_temp(x, a);
        tdm_drop_temp(am, NULL);
        return tdm_drop_fail(y);
    }
    tdm_drop_temp(x, a);
    if (tdm_needs_record(1, &a)) {
        tdm_node *n = tdm_record(name, op == TDM_RED_MAX ? max_backward : sum_backward, y, 1, &a);
        if (!n) {
            tdm_drop_temp(am, NULL);
            return tdm_drop_fail(y);
        }
        n->arg.i[0] = d;
        n->arg.i[1] = op == TDM_RED_MEAN;
        n->saved[0] = am;
    }
    if (argmax)
        *argmax = am;
    else if (!y->grad_fn)
        tdm_drop_temp(am, NULL);
    return y;
}

tdm_tensor *tdm_sum(tdm_tensor *a, int dim, bool keepdim) {
    return reduce_op(TDM_RED_SUM, "sum", a, dim, keepdim, NULL);
}

tdm_tensor *tdm_mean(tdm_tensor *a, int dim, bool keepdim) {
    return reduce_op(TDM_RED_MEAN, "mean", a, dim, keepdim, NULL);
}

tdm_tensor *tdm_max(tdm_tensor *a, int dim, bool keepdim, tdm_tensor **argmax) {
    return reduce_op(TDM_RED_MAX, "max", a, dim, keepdim, argmax);
}

/* Sum or mean of every element into a scalar: the kernel sees a as one flat row. */
static tdm_tensor *reduce_all(tdm_reduce_op op, const char *name, tdm_tensor *a) {
    if (!a) return tdm_null_input(name);
    if (tdm_check_float(a, name)) return NULL;
    if (op == TDM_RED_SUM) TDM_AUTOCAST_SCOPED(1, &a, reduce_all(op, name, a));
    if (op == TDM_RED_SUM && !(a = tdm_autocast_arg(a, TDM_AC_F32_CUDA))) return NULL;
    tdm_tensor *x = tdm_dense(a);
    tdm_tensor *y = tdm_tensor_alloc(TDM_SHAPE0, a->dtype, a->device);
    if (!x || !y) {
        tdm_drop_temp(x, a);
        return tdm_drop_fail(y);
    }
    int64_t numel = tdm_numel(a), one = 1;
    tdm_tensor flat = stack_view(x, 1, &numel, &one);
    int rc = tdm_backend_for(a->device)->reduce(op, y, &flat, 0, NULL);
    tdm_drop_temp(x, a);
    if (rc != 0) return tdm_drop_fail(y);
    if (tdm_needs_record(1, &a)) {
        tdm_node *n = tdm_record(name, sum_backward, y, 1, &a);
        if (!n) return tdm_drop_fail(y);
        n->arg.i[0] = -1;
        n->arg.i[1] = op == TDM_RED_MEAN;
    }
    return y;
}

tdm_tensor *tdm_sum_all(tdm_tensor *a) {
    return reduce_all(TDM_RED_SUM, "sum_all", a);
}

tdm_tensor *tdm_mean_all(tdm_tensor *a) {
    return reduce_all(TDM_RED_MEAN, "mean_all", a);
}

/* ---- softmax ------------------------------------------------------------------------- */

/* A contiguous copy of t with dims d and last swapped (t itself if d is last and t is
 * contiguous). */
static tdm_tensor *to_last(const tdm_tensor *t, int d) {
    int last = t->ndim - 1;
    if (t->ndim == 0 || d == last) return tdm_dense(t);
    tdm_tensor v = swapped_view(t, d, last);
    tdm_tensor *c = tdm_tensor_alloc(tdm_shape_of(&v), t->dtype, t->device);
    if (c && tdm_backend_for(t->device)->copy(c, &v) != 0) return tdm_drop_fail(c);
    return c;
}

/* dst (contiguous, the original layout) = src with dims d and last swapped back. */
static int from_last(tdm_tensor *dst, const tdm_tensor *src, int d) {
    tdm_tensor v = swapped_view(src, d, src->ndim - 1);
    return tdm_backend_for(dst->device)->copy(dst, &v);
}

/* node args: arg.i[0] dim, arg.i[1] log; saved[0] the output in the transposed layout
 * when dim is not the last (else n->out is used) */
static int softmax_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *x = n->in[0];
    int d = (int)n->arg.i[0];
    bool is_log = n->arg.i[1] != 0, last = x->ndim == 0 || d == x->ndim - 1;
    const tdm_tensor *y = last ? n->out : n->saved[0];
    const tdm_backend *be = tdm_backend_for(x->device);
    tdm_tensor *gy = to_last(gout, d);
    tdm_tensor *gt = tdm_tensor_alloc(tdm_shape_of(y), x->dtype, x->device);
    if (!gy || !gt || be->softmax_backward(gt, gy, y, is_log) != 0) return tdm_last_status();
    tdm_drop_temp(gy, gout);
    if (last) return tdm_grad_accumulate(x, gt);
    tdm_tensor *g = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (!g || from_last(g, gt, d) != 0) return tdm_last_status();
    tdm_drop_temp(gt, NULL);
    return tdm_grad_accumulate(x, g);
}

static tdm_tensor *softmax_op(tdm_tensor *a, int dim, bool is_log, const char *name) {
    if (!a) return tdm_null_input(name);
    if (tdm_check_float(a, name)) return NULL;
    TDM_AUTOCAST_SCOPED(1, &a, softmax_op(a, dim, is_log, name));
    if (!(a = tdm_autocast_arg(a, TDM_AC_F32_CUDA))) return NULL;
    int d = tdm_wrap_dim(dim, a->ndim, name);
    if (d < 0) return NULL;
    bool last = a->ndim == 0 || d == a->ndim - 1;
    const tdm_backend *be = tdm_backend_for(a->device);
    tdm_tensor *x = to_last(a, d);
    tdm_tensor *yt = x ? tdm_tensor_alloc(tdm_shape_of(x), a->dtype, a->device) : NULL;
    if (!yt || be->softmax(yt, x, is_log) != 0) {
        tdm_drop_temp(x, a);
        return tdm_drop_fail(yt);
    }
    tdm_drop_temp(x, a);
    tdm_tensor *y = yt;
    if (!last) {
        y = tdm_tensor_alloc(tdm_shape_of(a), a->dtype, a->device);
        if (!y || from_last(y, yt, d) != 0) {
            tdm_drop_temp(yt, NULL);
            return tdm_drop_fail(y);
        }
    }
    if (tdm_needs_record(1, &a)) {
        tdm_node *n = tdm_record(name, softmax_backward, y, 1, &a);
        if (!n) {
            if (!last) tdm_drop_temp(yt, NULL);
            return tdm_drop_fail(y);
        }
        n->arg.i[0] = d;
        n->arg.i[1] = is_log;
        n->saved[0] = last ? NULL : yt;
    } else if (!last) {
        tdm_drop_temp(yt, NULL);
    }
    return y;
}

tdm_tensor *tdm_softmax(tdm_tensor *a, int dim) {
    return softmax_op(a, dim, false, "softmax");
}

tdm_tensor *tdm_log_softmax(tdm_tensor *a, int dim) {
    return softmax_op(a, dim, true, "log_softmax");
}
