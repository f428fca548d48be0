/* Tensor parallelism (Megatron-LM's; PyTorch's ColwiseParallel and RowwiseParallel): one
 * layer's matrices split over the ranks of a group, and the differentiable collectives that
 * join the pieces.
 *
 * Megatron's two conjugate operators, and two for whole tensors at the ends:
 *   copy    forward identity,              backward all-reduce: a column-parallel layer's input,
 *           which every rank reads whole, gets from each rank the gradient of its part only;
 *   reduce  forward all-reduce,            backward identity: a row-parallel layer's output,
 *           each rank's partial product summed;
 *   gather  forward all-gather (last dim), backward this rank's slice;
 *   scatter forward this rank's slice,     backward all-gather.
 * Every rank computes the same loss from the same (reduced or gathered) output, so each
 * backward starts from the same gradient on every rank.
 *
 * The layers. A column-parallel linear (in -> out) holds rows [r out/n, (r+1) out/n) of the
 * whole weight and the same part of the bias; a row-parallel linear holds columns
 * [r in/n, (r+1) in/n) of the weight and the whole bias, added once after the reduction.
 * Each draws the whole layer's weight and bias from rng exactly as tdm_linear_new does and
 * keeps its part, so ranks given the same rng state hold the parts of the one-device layer
 * (the equivalence tests compare with it), and rng moves on as it would. */
#include "autograd/ops.h"
#include "parallel/group.h"
#include "tandem/nn.h"
#include "tandem/parallel.h"

#include <stdlib.h>
#include <string.h>

/* ---- the differentiable collectives ------------------------------------------------------- */

/* A contiguous copy of t, owned by the step scope, for a collective to work in. */
static tdm_tensor *scratch_copy(const tdm_tensor *t) {
    tdm_tensor *c = tdm_tensor_alloc(tdm_shape_of(t), t->dtype, t->device);
    if (c && tdm_copy_(c, t) != TDM_OK) return tdm_drop_fail(c);
    return c;
}

static int wait_for(tdm_work *w) {
    return w ? tdm_work_wait(w) : tdm_last_status();
}

static int copy_backward(tdm_node *n, tdm_tensor *gout) {
    if (!tdm_node_wants(n, 0)) return TDM_OK;
    tdm_tensor *g = scratch_copy(gout);
    if (!g) return tdm_last_status();
    tdm_collective_label("tensor-parallel copy's backward");
    int rc = wait_for(tdm_all_reduce(n->ctx, g, TDM_SUM));
    return rc ? rc : tdm_grad_accumulate(n->in[0], g);
}

/* y: a view of x (no copy) recorded under `name` with `backward` and group g. */
static tdm_tensor *record_alias(const char *name, tdm_backward_fn backward, tdm_group *g,
                                tdm_tensor *x, tdm_tensor *y) {
    if (!y || !tdm_needs_record(1, &x)) return y;
    tdm_node *n = tdm_record(name, backward, y, 1, &x);
    if (!n) return NULL;
    n->ctx = g;
    return y;
}

static bool check_group(const char *op, tdm_group *g, tdm_tensor *x) {
    if (!g || !x) {
        tdm_raise(TDM_ERR_ARG, "%s: NULL %s", op, g ? "input" : "group");
        return false;
    }
    return true;
}

tdm_tensor *tdm_tp_copy(tdm_group *g, tdm_tensor *x) {
    if (!check_group("tp_copy", g, x)) return NULL;
    if (!tdm_current_scope()) TDM_RETURN_SCOPED(tdm_tp_copy(g, x));
    tdm_tensor *y = tdm_tensor_view(x, x->ndim, x->shape, x->strides, x->offset);
    return record_alias("tp_copy", copy_backward, g, x, y);
}

static int reduce_backward(tdm_node *n, tdm_tensor *gout) {
    return tdm_grad_accumulate(n->in[0], gout);
}

tdm_tensor *tdm_tp_reduce(tdm_group *g, tdm_tensor *x) {
    if (!check_group("tp_reduce", g, x)) return NULL;
    if (!tdm_current_scope()) TDM_RETURN_SCOPED(tdm_tp_reduce(g, x));
    tdm_tensor *y = scratch_copy(x);
    if (!y) return NULL;
    tdm_collective_label("tensor-parallel reduce");
    if (wait_for(tdm_all_reduce(g, y, TDM_SUM))) return tdm_drop_fail(y);
    if (!tdm_needs_record(1, &x)) return y;
    tdm_node *n = tdm_record("tp_reduce", reduce_backward, y, 1, &x);
    if (!n) return NULL;
    n->ctx = g;
    return y;
}

/* x [..., k] of every rank -> [..., n k], rank r's at [r k, (r+1) k) of the last dim. */
static tdm_tensor *gather_last(tdm_group *g, tdm_tensor *x) {
    int n = tdm_group_size(g), d = x->ndim - 1;
    int64_t k = x->shape[d], rows = tdm_numel(x) / (k ? k : 1);
    tdm_tensor *in = scratch_copy(x);
    tdm_tensor *all = in ? tdm_tensor_alloc(TDM_SHAPE(n, rows, k), x->dtype, x->device) : NULL;
    if (!all) return NULL;
    tdm_collective_label("tensor-parallel gather");
    if (wait_for(tdm_all_gather(g, all, in))) return NULL;
    /* [n, rows, k] -> [rows, n, k] -> [..., n k] */
    tdm_tensor *t = tdm_contiguous(tdm_transpose(all, 0, 1));
    tdm_shape s = tdm_shape_of(x);
    s.d[d] = (int64_t)n * k;
    return t ? tdm_reshape(t, s) : NULL;
}

/* This rank's [..., r k, (r+1) k) of x's last dim, n k wide: a contiguous copy. */
static tdm_tensor *own_part(tdm_group *g, tdm_tensor *x) {
    int n = tdm_group_size(g), r = tdm_group_rank(g), d = x->ndim - 1;
    int64_t k = x->shape[d] / n;
    tdm_tensor *v = tdm_slice(x, d, r * k, (r + 1) * k, 1);
    return v ? scratch_copy(v) : NULL;
}

static int gather_backward(tdm_node *n, tdm_tensor *gout) {
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *g = own_part(n->ctx, gout);
    tdm_set_grad_enabled(prev);
    return g ? tdm_grad_accumulate(n->in[0], g) : tdm_last_status();
}

static int scatter_backward(tdm_node *n, tdm_tensor *gout) {
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *g = gather_last(n->ctx, gout);
    tdm_set_grad_enabled(prev);
    return g ? tdm_grad_accumulate(n->in[0], g) : tdm_last_status();
}

/* gather and scatter: the one computation `part` (no history), recorded with `backward`. */
static tdm_tensor *last_dim_op(const char *name, tdm_group *g, tdm_tensor *x, bool scatter) {
    if (x->ndim < 1) return tdm_raise_null(TDM_ERR_SHAPE, "%s: a 0-d tensor has no last dim", name);
    int n = tdm_group_size(g);
    if (scatter && x->shape[x->ndim - 1] % n) {
        char b[96];
        return tdm_raise_null(TDM_ERR_SHAPE, "%s: the last dim of %s does not split over %d ranks",
                              name, tdm_tensor_shape_str(x, b), n);
    }
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *y = scatter ? own_part(g, x) : gather_last(g, x);
    tdm_set_grad_enabled(prev);
    if (!y || !tdm_needs_record(1, &x)) return y;
    tdm_node *node =
        tdm_record(name, scatter ? scatter_backward : gather_backward, y, 1, (tdm_tensor *[]){x});
    if (!node) return NULL;
    node->ctx = g;
    return y;
}

tdm_tensor *tdm_tp_gather(tdm_group *g, tdm_tensor *x) {
    if (!check_group("tp_gather", g, x)) return NULL;
    if (!tdm_current_scope()) TDM_RETURN_SCOPED(tdm_tp_gather(g, x));
    return last_dim_op("tp_gather", g, x, false);
}

tdm_tensor *tdm_tp_scatter(tdm_group *g, tdm_tensor *x) {
    if (!check_group("tp_scatter", g, x)) return NULL;
    if (!tdm_current_scope()) TDM_RETURN_SCOPED(tdm_tp_scatter(g, x));
    return last_dim_op("tp_scatter", g, x, true);
}

/* ---- the layers --------------------------------------------------------------------------- */

typedef struct {
    tdm_group *tp;
    bool row;   /* row-parallel, else column-parallel */
    bool whole; /* column: gather the output; row: the input is whole (scatter it first) */
} tp_linear;

static tdm_tensor *tp_linear_forward(tdm_module *m, tdm_tensor *x) {
    const tp_linear *l = m->impl;
    tdm_tensor *w = m->params[0], *b = m->n_params > 1 ? m->params[1] : NULL;
    if (!l->row) {
        tdm_tensor *y = tdm_linear(tdm_tp_copy(l->tp, x), w, b);
        return l->whole ? tdm_tp_gather(l->tp, y) : y;
    }
    tdm_tensor *part = l->whole ? tdm_tp_scatter(l->tp, x) : x;
    tdm_tensor *y = tdm_tp_reduce(l->tp, tdm_linear(part, w, NULL));
    return b ? tdm_add(y, b) : y;
}

static void tp_linear_destroy(tdm_module *m) {
    free(m->impl);
}

/* impl_size stays 0: a copy would share the group, so tdm_module_clone refuses these layers
 * (a replica of a tensor-parallel layer is made on its own rank, from its own group) */
static const tdm_module_ops column_ops = {"ColumnParallelLinear", tp_linear_forward,
                                          tp_linear_destroy};
static const tdm_module_ops row_ops = {"RowParallelLinear", tp_linear_forward, tp_linear_destroy};

/* Rank r's part of p over n ranks as a new tensor, no history: along dim 1 (columns), or
 * along dim 0 with the rows seen as `blocks` equal blocks each split over the ranks (q, k and v
 * of a fused attention projection: 3 blocks), the parts of the blocks joined in order. */
static tdm_tensor *part_of(tdm_tensor *p, int dim, int blocks, int n, int r) {
    int64_t b = p->shape[dim] / blocks, k = b / n;
    tdm_tensor *pieces[8] = {0}, *c = NULL;
    int made = 0;
    for (; made < blocks; made++) {
        int64_t lo = made * b + r * k;
        if (!(pieces[made] = tdm_slice(p, dim, lo, lo + k, 1))) break;
    }
    if (made == blocks) c = blocks == 1 ? tdm_clone(pieces[0]) : tdm_concat(pieces, blocks, dim);
    for (int i = 0; i < made; i++) tdm_tensor_free(pieces[i]);
    return c;
}

/* A tensor-parallel layer holding this rank's part of `linear`'s weight and bias. */
static tdm_module *tp_linear_from(const char *kind, const tdm_module *linear, bool row, bool whole,
                                  int blocks, tdm_group *tp) {
    if (!linear || !tp)
        return tdm_raise_null(TDM_ERR_ARG, "%s: NULL %s", kind, tp ? "layer" : "group");
    if (strcmp(linear->ops->kind, "Linear") != 0 || linear->n_params < 1)
        return tdm_raise_null(TDM_ERR_ARG, "%s: a %s is not a Linear", kind, linear->ops->kind);
    if (blocks < 1 || blocks > 8 || (blocks > 1 && (row || whole)))
        return tdm_raise_null(TDM_ERR_ARG,
                              "%s: %d blocks (1 to 8, and only for a column-parallel "
                              "layer whose output stays split)",
                              kind, blocks);
    tdm_tensor *w = linear->params[0], *bias = linear->n_params > 1 ? linear->params[1] : NULL;
    int n = tdm_group_size(tp), r = tdm_group_rank(tp);
    int64_t split = row ? w->shape[1] : w->shape[0];
    if (split % ((int64_t)n * blocks))
        return tdm_raise_null(TDM_ERR_SHAPE, "%s: %s features %lld do not split over %d ranks%s",
                              kind, row ? "input" : "output", (long long)split, n,
                              blocks > 1 ? " in each block" : "");
    tp_linear *l = malloc(sizeof *l);
    tdm_module *m = l ? tdm_module_new(row ? &row_ops : &column_ops, linear->device, l) : NULL;
    if (!m) {
        free(l);
        return l ? NULL : tdm_raise_null(TDM_ERR_NOMEM, "%s: out of memory", kind);
    }
    *l = (tp_linear){tp, row, whole};
    bool grad = tdm_set_grad_enabled(false);
    /* weight [out, in]: a column-parallel rank keeps its rows, a row-parallel one its
     * columns; the bias follows the rows, or stays whole */
    int rc = tdm_module_add_param(m, "weight", part_of(w, row, blocks, n, r));
    if (!rc && bias)
        rc =
            tdm_module_add_param(m, "bias", row ? tdm_clone(bias) : part_of(bias, 0, blocks, n, r));
    tdm_set_grad_enabled(grad);
    if (rc) {
        tdm_module_free(m);
        return NULL;
    }
    return m;
}

tdm_module *tdm_column_linear_from(const tdm_module *linear, int blocks, bool gather_output,
                                   tdm_group *tp) {
    return tp_linear_from("column_linear_from", linear, false, gather_output, blocks, tp);
}

tdm_module *tdm_row_linear_from(const tdm_module *linear, bool input_is_parallel, tdm_group *tp) {
    return tp_linear_from("row_linear_from", linear, true, !input_is_parallel, 1, tp);
}

/* A whole Linear drawn from rng, then this rank's part of it. */
static tdm_module *tp_linear_new(int64_t in, int64_t out, bool bias, bool row, bool whole,
                                 tdm_group *tp, tdm_device dev, tdm_rng *rng) {
    const char *kind = row ? "row_linear_new" : "column_linear_new";
    if (!tp) return tdm_raise_null(TDM_ERR_ARG, "%s: NULL group", kind);
    tdm_module *full = tdm_linear_new(in, out, bias, dev, rng);
    tdm_module *m = full ? tp_linear_from(kind, full, row, whole, 1, tp) : NULL;
    tdm_module_free(full);
    return m;
}

tdm_module *tdm_column_linear_new(int64_t in, int64_t out, bool bias, bool gather_output,
                                  tdm_group *tp, tdm_device dev, tdm_rng *rng) {
    return tp_linear_new(in, out, bias, false, gather_output, tp, dev, rng);
}

tdm_module *tdm_row_linear_new(int64_t in, int64_t out, bool bias, bool input_is_parallel,
                               tdm_group *tp, tdm_device dev, tdm_rng *rng) {
    return tp_linear_new(in, out, bias, true, !input_is_parallel, tp, dev, rng);
}
