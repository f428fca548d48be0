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
#include "backend/backend.h"
#include "optim/clip.h"
#include "parallel/group.h"
#include "tandem/nn.h"
#include "tandem/parallel.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the differentiable collectives ------------------------------------------------------- */

/* Gives the memory of a temporary this op allocated back now instead of at the scope's end
 * (its header stays in the scope, empty): the collectives' copies are activations' size, and a
 * step keeps every tensor of its scope until it ends. Never for a view of another's tensor. */
static void release(tdm_tensor *t) {
    if (t && t->storage) tdm_storage_resize(t->storage, 0);
}

static int wait_for(tdm_work *w) {
    return w ? tdm_work_wait(w) : tdm_last_status();
}

static int copy_backward(tdm_node *n, tdm_tensor *gout) {
    if (!tdm_node_wants(n, 0)) return TDM_OK;
    tdm_tensor *g = tdm_clone(gout);
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
    if (!g) tdm_raise(TDM_ERR_ARG, "%s: NULL group", op);
    if (g && !x) tdm_null_input(op); /* a failed op before: its error stays the one told */
    if (!g || !x) return false;
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
    tdm_tensor *y = tdm_clone(x);
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
    tdm_tensor *in = tdm_clone(x);
    tdm_tensor *all = in ? tdm_tensor_alloc(TDM_SHAPE(n, rows, k), x->dtype, x->device) : NULL;
    if (!all) return NULL;
    tdm_collective_label("tensor-parallel gather");
    int rc = wait_for(tdm_all_gather(g, all, in));
    release(in);
    /* [n, rows, k] -> [rows, n, k] -> [..., n k] */
    tdm_tensor *t = rc ? NULL : tdm_clone(tdm_transpose(all, 0, 1));
    release(all);
    tdm_shape s = tdm_shape_of(x);
    s.d[d] = (int64_t)n * k;
    return t ? tdm_reshape(t, s) : NULL;
}

/* This rank's [..., r k, (r+1) k) of x's last dim, n k wide: a contiguous copy. */
static tdm_tensor *own_part(tdm_group *g, tdm_tensor *x) {
    int n = tdm_group_size(g), r = tdm_group_rank(g), d = x->ndim - 1;
    int64_t k = x->shape[d] / n;
    return tdm_clone(tdm_slice(x, d, r * k, (r + 1) * k, 1));
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

/* ---- sequence parallelism: the same along a dimension of tokens ---------------------------- */

/* x with dim d first, as a contiguous copy [S, ...] a collective can work in. */
static tdm_tensor *to_front(tdm_tensor *x, int d) {
    int perm[TDM_MAX_DIMS] = {d};
    for (int i = 0, k = 1; i < x->ndim; i++)
        if (i != d) perm[k++] = i;
    return tdm_clone(tdm_permute(x, perm));
}

/* t [S, ...] (to_front's layout) back with its first dim at d, contiguous; t is released. */
static tdm_tensor *from_front(tdm_tensor *t, int d) {
    int perm[TDM_MAX_DIMS];
    for (int i = 0; i < t->ndim; i++) perm[i] = i == d ? 0 : i < d ? i + 1 : i;
    if (!d) return t;
    tdm_tensor *c = tdm_clone(tdm_permute(t, perm));
    release(t);
    return c;
}

/* Every rank's x joined along d (rank order). */
static tdm_tensor *gather_dim(tdm_group *g, tdm_tensor *x, int d) {
    int n = tdm_group_size(g);
    tdm_tensor *f = to_front(x, d);
    if (!f) return NULL;
    tdm_shape s = tdm_shape_of(f);
    s.d[0] *= n;
    tdm_tensor *all = tdm_tensor_alloc(s, x->dtype, x->device);
    if (!all) return NULL;
    tdm_collective_label("sequence-parallel gather");
    int rc = wait_for(tdm_all_gather(g, all, f));
    release(f);
    if (rc) release(all);
    return rc ? NULL : from_front(all, d);
}

/* x summed over the ranks, rank r keeping its part [r S/n, (r+1) S/n) of d. */
static tdm_tensor *reduce_scatter_dim(tdm_group *g, tdm_tensor *x, int d) {
    tdm_tensor *f = to_front(x, d);
    if (!f) return NULL;
    tdm_shape s = tdm_shape_of(f);
    s.d[0] /= tdm_group_size(g);
    tdm_tensor *part = tdm_tensor_alloc(s, x->dtype, x->device);
    if (!part) return NULL;
    tdm_collective_label("sequence-parallel reduce-scatter");
    int rc = wait_for(tdm_reduce_scatter(g, part, f, TDM_SUM));
    release(f);
    if (rc) release(part);
    return rc ? NULL : from_front(part, d);
}

/* Rank r's part [r S/n, (r+1) S/n) of x's dim d, a contiguous copy. */
static tdm_tensor *shard_dim(tdm_group *g, tdm_tensor *x, int d) {
    int64_t k = x->shape[d] / tdm_group_size(g), r = tdm_group_rank(g);
    return tdm_clone(tdm_slice(x, d, r * k, (r + 1) * k, 1));
}

enum { SEQ_SHARD, SEQ_GATHER, SEQ_REDUCE_SCATTER };

/* What op `kind` computes forward (backward runs its conjugate through seq_backward). */
static tdm_tensor *seq_forward(int kind, tdm_group *g, tdm_tensor *x, int d) {
    return kind == SEQ_SHARD    ? shard_dim(g, x, d)
           : kind == SEQ_GATHER ? gather_dim(g, x, d)
                                : reduce_scatter_dim(g, x, d);
}

/* shard <-> gather, reduce-scatter <-> gather; a gather's gradient is reduce-scattered when the
 * ranks' gradients are parts of one (arg.i[2]), else each rank keeps its own shard of it. */
static int seq_backward(tdm_node *n, tdm_tensor *gout) {
    int kind = (int)n->arg.i[0], d = (int)n->arg.i[1];
    bool parts = n->arg.i[2];
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *g = kind != SEQ_GATHER ? gather_dim(n->ctx, gout, d)
                    : parts            ? reduce_scatter_dim(n->ctx, gout, d)
                                       : shard_dim(n->ctx, gout, d);
    tdm_set_grad_enabled(prev);
    return g ? tdm_grad_accumulate(n->in[0], g) : tdm_last_status();
}

static tdm_tensor *seq_op(const char *name, int kind, tdm_group *g, tdm_tensor *x, int dim,
                          bool parts) {
    if (!check_group(name, g, x)) return NULL;
    if (!tdm_current_scope()) TDM_RETURN_SCOPED(seq_op(name, kind, g, x, dim, parts));
    int d = dim < 0 ? dim + x->ndim : dim, n = tdm_group_size(g);
    char b[96];
    if (d < 0 || d >= x->ndim)
        return tdm_raise_null(TDM_ERR_SHAPE, "%s: dim %d of %s", name, dim,
                              tdm_tensor_shape_str(x, b));
    if (kind != SEQ_GATHER && x->shape[d] % n)
        return tdm_raise_null(TDM_ERR_SHAPE, "%s: dim %d of %s does not split over %d ranks", name,
                              dim, tdm_tensor_shape_str(x, b), n);
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *y = seq_forward(kind, g, x, d);
    tdm_set_grad_enabled(prev);
    if (!y || !tdm_needs_record(1, &x)) return y;
    tdm_node *node = tdm_record(name, seq_backward, y, 1, &x);
    if (!node) return NULL;
    node->ctx = g;
    node->arg.i[0] = kind, node->arg.i[1] = d, node->arg.i[2] = parts;
    return y;
}

tdm_tensor *tdm_tp_seq_shard(tdm_group *tp, tdm_tensor *x, int dim) {
    return seq_op("tp_seq_shard", SEQ_SHARD, tp, x, dim, false);
}

tdm_tensor *tdm_tp_seq_gather(tdm_group *tp, tdm_tensor *x, int dim, bool grad_parts) {
    return seq_op("tp_seq_gather", SEQ_GATHER, tp, x, dim, grad_parts);
}

tdm_tensor *tdm_tp_seq_reduce_scatter(tdm_group *tp, tdm_tensor *x, int dim) {
    return seq_op("tp_seq_reduce_scatter", SEQ_REDUCE_SCATTER, tp, x, dim, false);
}

/* ---- the column-parallel product under sequence parallelism ------------------------------- */

/* Megatron-LM's: the input's tokens are gathered for the product and not kept; backward
 * gathers them again for the weight's gradient. Saving the gathered input instead would hold
 * the whole sequence's activations at every such layer, more than tensor parallelism without
 * sequence parallelism keeps. x [..., S/n, ..., in] split along d, w [k, in], b [k] or NULL. */
static int seq_linear_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_group *g = n->ctx;
    int d = (int)n->arg.i[0];
    tdm_tensor *x = n->in[0], *w = n->in[1], *b = n->n_in > 2 ? n->in[2] : NULL;
    int64_t k = w->shape[0], in = w->shape[1];
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *xf = gather_dim(g, x, d); /* [..., S, ..., in] */
    int64_t rows = xf ? tdm_numel(xf) / in : 0;
    tdm_tensor *g2 = xf ? tdm_reshape(gout, TDM_SHAPE(rows, k)) : NULL;
    int rc = g2 ? TDM_OK : tdm_last_status();
    if (!rc && tdm_node_wants(n, 1)) { /* dW [k, in] = g^T x, into the gradient buffer */
        float beta = 0.0f;
        tdm_tensor *acc = tdm_grad_inplace_target(w, &beta);
        tdm_tensor *dw = acc ? acc : tdm_tensor_alloc(tdm_shape_of(w), w->dtype, w->device);
        tdm_tensor *gd = dw ? tdm_dense(g2) : NULL;
        if (gd) {
            tdm_tensor dw2 = tdm_as_matrix(dw, k, in), g2m = tdm_as_matrix(gd, rows, k);
            tdm_tensor x2 = tdm_as_matrix(xf, rows, in);
            rc = tdm_backend_for(w->device)->matmul(&dw2, &g2m, &x2, true, false, beta);
            if (!rc && !acc) rc = tdm_grad_accumulate(w, dw);
        } else {
            rc = tdm_last_status();
        }
    }
    if (!rc && b && tdm_node_wants(n, 2)) {
        tdm_tensor *db = tdm_sum(g2, 0, false);
        rc = db ? tdm_grad_accumulate(b, db) : tdm_last_status();
    }
    release(xf);
    if (!rc && tdm_node_wants(n, 0)) { /* dx: g W over the whole sequence, then each its part */
        tdm_tensor *dx = tdm_matmul(g2, w);
        tdm_shape s = tdm_shape_of(gout);
        s.d[s.ndim - 1] = in;
        tdm_tensor *full = dx ? tdm_reshape(dx, s) : NULL;
        tdm_tensor *part = full ? reduce_scatter_dim(g, full, d) : NULL;
        rc = part ? tdm_grad_accumulate(x, part) : tdm_last_status();
        release(dx); /* full, its view, is not read again */
    }
    tdm_set_grad_enabled(prev);
    return rc;
}

static tdm_tensor *seq_column_linear(tdm_group *g, tdm_tensor *x, tdm_tensor *w, tdm_tensor *b,
                                     int d) {
    if (!tdm_current_scope()) TDM_RETURN_SCOPED(seq_column_linear(g, x, w, b, d));
    if (d >= x->ndim - 1) {
        char s[96];
        return tdm_raise_null(TDM_ERR_SHAPE,
                              "column_linear: the sequence dim %d of %s is not before the "
                              "features",
                              d, tdm_tensor_shape_str(x, s));
    }
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *xf = gather_dim(g, x, d);
    tdm_tensor *y = xf ? tdm_linear(xf, w, b) : NULL;
    release(xf);
    tdm_set_grad_enabled(prev);
    tdm_tensor *in[3] = {x, w, b};
    if (!y || !tdm_needs_record(b ? 3 : 2, in)) return y;
    tdm_node *n = tdm_record("tp_seq_column_linear", seq_linear_backward, y, b ? 3 : 2, in);
    if (!n) return NULL;
    n->ctx = g;
    n->arg.i[0] = d;
    return y;
}

/* ---- the layers --------------------------------------------------------------------------- */

typedef struct {
    tdm_group *tp;
    bool row;    /* row-parallel, else column-parallel */
    bool whole;  /* column: gather the output; row: the input is whole (scatter it first) */
    int seq_dim; /* sequence parallelism: the token dim the input (column) or the output (row)
                    is split along; -1: none */
    int blocks;  /* column: the output's blocks, each split over the ranks (q, k, v: 3) */
} tp_linear;

static tdm_tensor *tp_linear_forward(tdm_module *m, tdm_tensor *x) {
    const tp_linear *l = m->impl;
    tdm_tensor *w = m->params[0], *b = m->n_params > 1 ? m->params[1] : NULL;
    bool seq = l->seq_dim >= 0;
    if (!l->row) { /* the whole input: gathered along the tokens, or the same on every rank */
        if (seq && x && x->dtype == TDM_F32 && tdm_autocast_dtype() == TDM_F32)
            return seq_column_linear(l->tp, x, w, b, l->seq_dim);
        tdm_tensor *in =
            seq ? tdm_tp_seq_gather(l->tp, x, l->seq_dim, true) : tdm_tp_copy(l->tp, x);
        tdm_tensor *y = tdm_linear(in, w, b);
        return l->whole ? tdm_tp_gather(l->tp, y) : y;
    }
    tdm_tensor *part = l->whole ? tdm_tp_scatter(l->tp, x) : x;
    tdm_tensor *p = tdm_linear(part, w, NULL);
    tdm_tensor *y = seq ? tdm_tp_seq_reduce_scatter(l->tp, p, l->seq_dim) : tdm_tp_reduce(l->tp, p);
    /* this rank's partial product [..., out] is read by no backward (the product's reads its
     * inputs, the reduction's nothing): its memory goes back now, not at the step's end */
    if (y && p) release(p);
    /* under sequence parallelism the bias meets this rank's tokens only: its gradient is summed
     * over the ranks in backward (tp_copy), so each holds the whole one, as without */
    return b ? tdm_add(y, seq ? tdm_tp_copy(l->tp, b) : b) : y;
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
    *l = (tp_linear){tp, row, whole, -1, blocks};
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

int tdm_tp_linear_set_sequence_dim(tdm_module *layer, int dim) {
    if (!layer || (layer->ops != &column_ops && layer->ops != &row_ops))
        return tdm_raise(TDM_ERR_ARG,
                         "tp_linear_set_sequence_dim: %s is not a tensor-parallel "
                         "Linear",
                         layer ? layer->ops->kind : "NULL");
    tp_linear *l = layer->impl;
    if (dim >= 0 && l->whole)
        return tdm_raise(TDM_ERR_ARG, "tp_linear_set_sequence_dim: a %s whose %s is whole",
                         layer->ops->kind, l->row ? "input" : "output");
    l->seq_dim = dim < 0 ? -1 : dim;
    return TDM_OK;
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

/* ---- the vocabulary-parallel embedding module ---------------------------------------------- */

static tdm_tensor *vocab_forward(tdm_module *m, tdm_tensor *idx) {
    return tdm_tp_embedding(m->impl, m->params[0], idx);
}

/* impl: the group (not owned); a copy would share it, so it cannot be cloned either */
static const tdm_module_ops vocab_ops = {"VocabParallelEmbedding", vocab_forward, NULL};

tdm_module *tdm_vocab_embedding_from(const tdm_module *embedding, tdm_group *tp) {
    if (!embedding || !tp)
        return tdm_raise_null(TDM_ERR_ARG, "vocab_embedding_from: NULL %s",
                              tp ? "embedding" : "group");
    tdm_tensor *w = embedding->n_params ? embedding->params[0] : NULL;
    int n = tdm_group_size(tp), r = tdm_group_rank(tp);
    if (!w || w->ndim != 2 || w->shape[0] % n)
        return tdm_raise_null(TDM_ERR_SHAPE,
                              "vocab_embedding_from: a %s whose rows do not split "
                              "over %d ranks",
                              embedding->ops->kind, n);
    tdm_module *m = tdm_module_new(&vocab_ops, embedding->device, tp);
    bool grad = tdm_set_grad_enabled(false);
    int rc = m ? tdm_module_add_param(m, "weight", part_of(w, 0, 1, n, r)) : tdm_last_status();
    tdm_set_grad_enabled(grad);
    if (rc) {
        tdm_module_free(m);
        return NULL;
    }
    return m;
}

/* ---- whole tensors from the ranks' parts, and parts from whole tensors ------------------- */

/* part's shape [p0, p1] (or [p0]) gathered over the ranks into whole's values: a row-parallel
 * weight's columns (cols), else rows in `blocks` blocks each split over the ranks. whole NULL:
 * this rank only takes part in the collective. */
static int gather_param(tdm_group *g, tdm_tensor *part, tdm_tensor *whole, bool cols, int blocks) {
    int n = tdm_group_size(g);
    int64_t numel = tdm_numel(part), p1 = part->ndim > 1 ? part->shape[1] : 1;
    int64_t p0 = part->shape[0], bk = p0 / blocks; /* rows of a block's part */
    tdm_tensor *in = tdm_clone(part);
    tdm_tensor *all =
        in ? tdm_tensor_alloc(TDM_SHAPE((int64_t)n * numel), part->dtype, part->device) : NULL;
    float *a = whole ? malloc(sizeof(float) * (size_t)(n * numel)) : NULL,
          *w = whole ? malloc(sizeof(float) * (size_t)(n * numel)) : NULL;
    int rc = all && (!whole || (a && w)) ? TDM_OK
             : tdm_last_status()         ? tdm_last_status()
                                         : TDM_ERR_NOMEM;
    if (!rc) tdm_collective_label("tensor-parallel parts made whole");
    if (!rc) rc = wait_for(tdm_all_gather(g, all, in));
    if (!rc && whole) rc = tdm_to_host(all, a, sizeof(float) * (size_t)(n * numel));
    for (int r = 0; !rc && whole && r < n; r++)
        for (int64_t i = 0; i < p0; i++)
            for (int64_t j = 0; j < p1; j++) {
                /* rank r's element (i, j) lands at row i, column r p1 + j (cols), or at row
                 * (block i / bk) n bk + r bk + i % bk */
                int64_t wi = cols ? i : (i / bk) * n * bk + r * bk + i % bk;
                int64_t wj = cols ? r * p1 + j : j, wcols = cols ? n * p1 : p1;
                w[wi * wcols + wj] = a[r * numel + i * p1 + j];
            }
    if (!rc && whole) rc = tdm_backend_for(whole->device)->from_host(whole, w);
    release(in);
    release(all);
    free(a), free(w);
    return rc;
}

/* One side of a walk: a model's parameters themselves (state NULL), or their elements of an
 * optimizer's flat state buffer over the model's paramset (the parameter's offset in ps). */
typedef struct {
    const tdm_paramset *ps;
    tdm_tensor *state;
} side;

/* p, or its elements of s's state buffer shaped as p (a view in the open scope). */
static tdm_tensor *on_side(const side *s, tdm_tensor *p) {
    if (!s || !s->state) return p;
    int64_t off = p->offset - s->ps->flat->offset;
    if (p->storage != s->ps->flat->storage || off < 0 || off + tdm_numel(p) > s->ps->total) {
        tdm_raise(TDM_ERR_STATE, "tp state: a parameter outside its model's flat buffer");
        return NULL;
    }
    return tdm_reshape(tdm_slice(s->state, 0, off, off + tdm_numel(p), 1), tdm_shape_of(p));
}

typedef struct {
    bool gather; /* parts to whole (a collective), else whole to parts (local) */
    side split, whole;
} walk;

/* How parameter i of split holds its part of the whole: *dim -1 whole on every rank, 0 its
 * rows (in *blocks blocks), 1 its columns; the ranks' group in *g. */
static void layout_of(const tdm_module *split, int i, int *dim, int *blocks, tdm_group **g) {
    *dim = -1, *blocks = 1, *g = NULL;
    if (split->ops == &vocab_ops) {
        *dim = 0, *g = split->impl;
    } else if (split->ops == &column_ops || split->ops == &row_ops) {
        const tp_linear *l = split->impl;
        *g = l->tp;
        if (!l->row) *dim = 0, *blocks = l->blocks;
        if (l->row && i == 0) *dim = 1;
    }
}

/* Parameter i of split and of whole (whole NULL: a rank that only takes part) moved along w. */
static int walk_param(const walk *w, tdm_module *split, tdm_module *whole, int i) {
    int dim, blocks;
    tdm_group *g;
    layout_of(split, i, &dim, &blocks, &g);
    tdm_tensor *p = split->params[i], *q = whole ? whole->params[i] : NULL;
    int64_t expect = tdm_numel(p) * (dim >= 0 ? tdm_group_size(g) : 1);
    if (q && (tdm_numel(q) != expect || p->dtype != TDM_F32 || q->dtype != TDM_F32))
        return tdm_raise(TDM_ERR_SHAPE, "tp_%s_whole: %s's %s holds %lld values, the whole %lld",
                         w->gather ? "gather" : "scatter", whole->ops->kind, whole->param_names[i],
                         (long long)tdm_numel(q), (long long)expect);
    tdm_tensor *ps = on_side(&w->split, p), *qs = q ? on_side(&w->whole, q) : NULL;
    if (!ps || (q && !qs)) return tdm_last_status();
    if (w->gather) /* (whole may be on another device: the host's) */
        return dim < 0 ? (qs ? tdm_copy_(qs, tdm_to_device(ps, qs->device)) : TDM_OK)
                       : gather_param(g, ps, qs, dim == 1, blocks);
    tdm_tensor *mine =
        dim < 0 ? qs : part_of(qs, dim, blocks, tdm_group_size(g), tdm_group_rank(g));
    tdm_tensor *here = mine ? tdm_to_device(mine, ps->device) : NULL; /* a view where it is */
    return here ? tdm_copy_(ps, here) : tdm_last_status();
}

static int walk_module(const walk *w, tdm_module *split, tdm_module *whole) {
    const char *op = w->gather ? "tp_gather_whole" : "tp_scatter_whole";
    if (whole && (split->n_params != whole->n_params || split->n_children != whole->n_children))
        return tdm_raise(TDM_ERR_ARG, "%s: a %s and a %s differ in their parts", op,
                         split->ops->kind, whole->ops->kind);
    for (int i = 0; i < split->n_params; i++) {
        int rc = walk_param(w, split, whole, i);
        if (rc) return rc;
    }
    for (int c = 0; c < split->n_children; c++) {
        int rc = walk_module(w, split->children[c], whole ? whole->children[c] : NULL);
        if (rc) return rc;
    }
    return TDM_OK;
}

static int run_walk(const walk *w, tdm_module *split, tdm_module *whole) {
    bool grad = tdm_set_grad_enabled(false);
    tdm_scope_begin();
    int rc = walk_module(w, split, whole);
    tdm_scope_end();
    tdm_set_grad_enabled(grad);
    return rc;
}

int tdm_tp_gather_whole(tdm_module *split, tdm_module *whole) {
    if (!split) return tdm_raise(TDM_ERR_ARG, "tp_gather_whole: NULL split model");
    return run_walk(&(walk){.gather = true}, split, whole);
}

int tdm_tp_scatter_whole(tdm_module *split, tdm_module *whole) {
    if (!split || !whole) return tdm_raise(TDM_ERR_ARG, "tp_scatter_whole: NULL model");
    return run_walk(&(walk){.gather = false}, split, whole);
}

/* Each state buffer of so with the same-named one of wo (wo NULL: gathering, this rank only
 * takes part) moved along a walk of the two models; steps follow. A sharded so (ZeRO over the
 * data-parallel ranks) takes its range of its parts' whole buffers when scattering. */
static int walk_state(bool gather, tdm_module *split, tdm_optim *so, tdm_module *whole,
                      tdm_optim *wo) {
    const char *op = gather ? "tp_gather_state" : "tp_scatter_state";
    if (!split || !so || (!gather && (!whole || !wo)) || (!whole != !wo))
        return tdm_raise(TDM_ERR_ARG, "%s: NULL model or optimizer", op);
    const char *sn[4], *wn[4] = {0};
    tdm_tensor *st[4], *wt[4] = {0};
    int n = tdm_optim_state(so, sn, st, 4), m = wo ? tdm_optim_state(wo, wn, wt, 4) : n;
    tdm_paramset *sps = tdm_module_parameters(split);
    int64_t lo, hi, total = sps->total;
    bool sharded = tdm_optim_shard_range(so, &lo, &hi) == TDM_OK && hi - lo != total;
    if (sharded && gather)
        return tdm_raise(TDM_ERR_STATE, "%s: a sharded optimizer (tdm_optim_gather it first)", op);
    if (wo && (m != n || strcmp(tdm_optim_kind(so), tdm_optim_kind(wo)) != 0))
        return tdm_raise(TDM_ERR_ARG, "%s: a %s and a %s optimizer", op, tdm_optim_kind(so),
                         tdm_optim_kind(wo));
    int rc = TDM_OK;
    for (int k = 0; k < n && !rc; k++) {
        int j = 0;
        while (wo && j < m && strcmp(wn[j], sn[k]) != 0) j++;
        if (wo && j == m)
            return tdm_raise(TDM_ERR_ARG, "%s: the whole optimizer has no %s", op, sn[k]);
        /* on the parameters' device (a pipeline stage's Sequential says cpu:0 wherever its
         * layers are) */
        tdm_tensor *mine =
            sharded ? tdm_zeros(TDM_SHAPE(total), TDM_F32, sps->flat->device) : st[k];
        walk w = {
            gather, {sps, mine}, {wo ? tdm_module_parameters(whole) : NULL, wo ? wt[j] : NULL}};
        rc = mine ? run_walk(&w, split, whole) : tdm_last_status();
        if (!rc && sharded) rc = tdm_optim_state_load(so, sn[k], mine);
        if (sharded) tdm_tensor_free(mine);
    }
    if (!rc && wo)
        rc = gather ? tdm_optim_set_steps(wo, tdm_optim_steps(so))
                    : tdm_optim_set_steps(so, tdm_optim_steps(wo));
    return rc;
}

int tdm_tp_gather_state(tdm_module *split, tdm_optim *so, tdm_module *whole, tdm_optim *wo) {
    return walk_state(true, split, so, whole, wo);
}

int tdm_tp_scatter_state(tdm_module *split, tdm_optim *so, tdm_module *whole, tdm_optim *wo) {
    return walk_state(false, split, so, whole, wo);
}

/* ---- the whole model's gradient norm ----------------------------------------------------- */

/* Where a split model's averaged gradient is: each parameter's .grad (views of ps's flat
 * gradient), or under ZeRO stage 2 this rank's shard of the flat gradient, elements
 * [lo, lo + numel(shard)). */
typedef struct {
    const tdm_paramset *ps;
    tdm_tensor *shard;
    int64_t lo;
} grads;

/* p's first element in ps's flat buffers, from the list (under ZeRO stage 3 a parameter's
 * storage is its unit's, not the flat buffer's); -1 for one not listed. */
static int64_t flat_offset(const tdm_paramset *ps, const tdm_tensor *p) {
    for (int i = 0; i < ps->n; i++)
        if (ps->params[i] == p) return ps->offsets[i];
    return -1;
}

/* The squares of flat gradient elements [a, b) that this rank holds, into *ss. */
static int squares_of(const grads *gr, int64_t a, int64_t b, double *ss) {
    if (!gr->shard) return tdm_clip_sum_squares(gr->ps, a, b, ss);
    int64_t lo = gr->lo, hi = lo + tdm_numel(gr->shard);
    a = a > lo ? a : lo, b = b < hi ? b : hi;
    if (a >= b) return (*ss = 0, TDM_OK);
    tdm_tensor *v = tdm_slice(gr->shard, 0, a - lo, b - lo, 1);
    int rc = v ? tdm_clip_sum_squares_of(v, ss) : tdm_last_status();
    tdm_tensor_free(v);
    return rc;
}

/* Adds to ss[0] the squares of m's tree's gradients held whole on every rank and to ss[1]
 * those of the parts, each parameter once (a tied weight is listed twice); *g becomes the
 * parts' group. seen: the parameters counted so far. */
static int sum_squares(tdm_module *m, const grads *gr, const tdm_tensor **seen, int *n_seen,
                       double ss[2], tdm_group **g) {
    for (int i = 0; i < m->n_params; i++) {
        tdm_tensor *p = m->params[i];
        bool counted = false;
        for (int k = 0; k < *n_seen && !counted; k++) counted = seen[k] == p;
        if (counted || (!gr->shard && !p->grad)) continue;
        seen[(*n_seen)++] = p;
        int dim, blocks;
        tdm_group *pg;
        layout_of(m, i, &dim, &blocks, &pg);
        if (dim >= 0 && *g && pg != *g)
            return tdm_raise(TDM_ERR_ARG, "tp_clip_grad_norm: the layers split over two groups");
        if (dim >= 0) *g = pg;
        int64_t off = flat_offset(gr->ps, p);
        if (off < 0) return tdm_raise(TDM_ERR_STATE, "tp_clip_grad_norm: a parameter not listed");
        double part = 0;
        int rc = squares_of(gr, off, off + tdm_numel(p), &part);
        if (rc) return rc;
        ss[dim >= 0] += part;
    }
    for (int c = 0; c < m->n_children; c++) {
        int rc = sum_squares(m->children[c], gr, seen, n_seen, ss, g);
        if (rc) return rc;
    }
    return TDM_OK;
}

int tdm_tp_grad_squares(tdm_module *m, double *whole, double *parts) {
    tdm_paramset *ps = m && whole && parts ? tdm_module_parameters(m) : NULL;
    if (!ps)
        return m && whole && parts ? tdm_last_status()
                                   : tdm_raise(TDM_ERR_ARG, "tp_grad_squares: NULL argument");
    const tdm_tensor **seen = malloc(sizeof *seen * (size_t)(ps->n ? ps->n : 1));
    if (!seen) return tdm_raise(TDM_ERR_NOMEM, "tp_grad_squares: out of memory");
    grads gr = {ps, NULL, 0};
    double ss[2] = {0, 0};
    int n_seen = 0;
    tdm_group *g = NULL;
    int rc = sum_squares(m, &gr, seen, &n_seen, ss, &g);
    free(seen);
    *whole = ss[0], *parts = ss[1];
    return rc;
}

/* v's n values summed over g (every rank the same sums, in rank order). */
static int sum_over(tdm_group *g, tdm_device dev, double *v, int n, const char *what) {
    float f[2] = {(float)v[0], n > 1 ? (float)v[1] : 0};
    tdm_scope_begin();
    tdm_tensor *t = tdm_from_data(TDM_SHAPE(n), TDM_F32, dev, f);
    tdm_collective_label("%s", what);
    int rc = t ? wait_for(tdm_all_reduce(g, t, TDM_SUM)) : tdm_last_status();
    if (!rc) rc = tdm_to_host(t, f, sizeof(float) * (size_t)n);
    tdm_scope_end();
    for (int i = 0; !rc && i < n; i++) v[i] = f[i];
    return rc;
}

int tdm_tp_clip_grad_norm(tdm_module *split, tdm_ddp *ddp, tdm_group *dp, float max_norm,
                          float *total_norm) {
    tdm_paramset *ps = split ? tdm_module_parameters(split) : NULL;
    if (!ps) return split ? tdm_last_status() : tdm_raise(TDM_ERR_ARG, "tp_clip_grad_norm: NULL");
    if (!(max_norm > 0) || !isfinite(max_norm))
        return tdm_raise(TDM_ERR_ARG, "tp_clip_grad_norm: max_norm %g must be > 0", max_norm);
    int64_t lo = 0;
    grads gr = {ps, ddp ? tdm_ddp_shard_grad(ddp, &lo) : NULL, 0};
    gr.lo = lo;
    if (gr.shard && !dp)
        return tdm_raise(TDM_ERR_ARG, "tp_clip_grad_norm: a sharded gradient needs its group");
    const tdm_tensor **seen = malloc(sizeof *seen * (size_t)(ps->n ? ps->n : 1));
    if (!seen) return tdm_raise(TDM_ERR_NOMEM, "tp_clip_grad_norm: out of memory");
    double ss[2] = {0, 0};
    int n_seen = 0;
    tdm_group *g = NULL;
    int rc = sum_squares(split, &gr, seen, &n_seen, ss, &g);
    free(seen);
    /* the shards' squares summed over dp, then the parts' over tp: the same total on each */
    if (!rc && gr.shard) rc = sum_over(dp, split->device, ss, 2, "sharded gradient norm");
    if (!rc && g) rc = sum_over(g, split->device, ss + 1, 1, "tensor-parallel gradient norm");
    float norm = (float)sqrt(ss[0] + ss[1]);
    if (total_norm) *total_norm = norm;
    if (rc) return rc;
    return gr.shard ? tdm_clip_scale_of(gr.shard, max_norm, norm)
                    : tdm_clip_scale(ps, 0, ps->total, max_norm, norm);
}

/* ---- vocabulary parallelism ----------------------------------------------------------------- */

/* idx's values (i32 or i64, any device) as int64 on the host: a malloc'd array of numel. */
static int64_t *indices_of(const tdm_tensor *idx) {
    int64_t m = tdm_numel(idx);
    int64_t *v = malloc(sizeof *v * (size_t)(m ? m : 1));
    tdm_tensor *wide = idx->dtype == TDM_I64 ? NULL : tdm_cast(idx, TDM_I64);
    int rc = v && (idx->dtype == TDM_I64 || wide) ? TDM_OK : tdm_last_status();
    if (!rc) rc = tdm_to_host(wide ? wide : idx, v, sizeof *v * (size_t)m);
    tdm_drop_temp(wide, NULL);
    if (rc) free(v);
    return rc ? NULL : v;
}

/* Where each of idx's values falls in rank r's block [r k, (r+1) k) of n k: its index inside
 * (or 0) plus i row_stride for the i-th (its row's offset in a flattened matrix) in *local,
 * and 1 or 0 in *mask, tensors on dev. TDM_ERR_ARG naming a value outside [0, n k). */
static int local_indices(const char *op, const tdm_tensor *idx, int n, int r, int64_t k,
                         int64_t row_stride, tdm_device dev, tdm_tensor **local,
                         tdm_tensor **mask) {
    int64_t m = tdm_numel(idx), *v = indices_of(idx);
    float *f = v ? malloc(sizeof *f * (size_t)(m ? m : 1)) : NULL;
    int rc = f ? TDM_OK : tdm_last_status() ? tdm_last_status() : TDM_ERR_NOMEM;
    for (int64_t i = 0; !rc && i < m; i++) {
        if (v[i] < 0 || v[i] >= n * k) {
            rc = tdm_raise(TDM_ERR_ARG,
                           "%s: index %lld of element %lld is outside [0, %lld) (%d "
                           "ranks of %lld)",
                           op, (long long)v[i], (long long)i, (long long)(n * k), n, (long long)k);
            break;
        }
        bool mine = v[i] >= r * k && v[i] < (r + 1) * k;
        f[i] = mine ? 1.0f : 0.0f;
        v[i] = i * row_stride + (mine ? v[i] - r * k : 0);
    }
    if (!rc) {
        *local = tdm_from_data(tdm_shape_of(idx), TDM_I64, dev, v);
        *mask = *local ? tdm_from_data(tdm_shape_of(idx), TDM_F32, dev, f) : NULL;
        if (!*mask) rc = tdm_last_status();
    }
    free(v), free(f);
    return rc;
}

tdm_tensor *tdm_tp_embedding(tdm_group *tp, tdm_tensor *weight, const tdm_tensor *idx) {
    if (!check_group("tp_embedding", tp, weight)) return NULL;
    if (!idx) return tdm_null_arg("tp_embedding", "idx");
    if (!tdm_current_scope()) TDM_RETURN_SCOPED(tdm_tp_embedding(tp, weight, idx));
    int n = tdm_group_size(tp), r = tdm_group_rank(tp);
    tdm_tensor *local = NULL, *mask = NULL;
    if (weight->ndim != 2)
        return tdm_raise_null(TDM_ERR_SHAPE, "tp_embedding: the weight's part must be 2-D");
    if (local_indices("tp_embedding", idx, n, r, weight->shape[0], 0, weight->device, &local,
                      &mask))
        return NULL;
    /* rows of other ranks' tokens are zeroed, then every rank's rows summed */
    tdm_shape s = tdm_shape_of(idx);
    s.d[s.ndim++] = 1;
    tdm_tensor *e = tdm_mul(tdm_embedding(weight, local), tdm_reshape(mask, s));
    return e ? tdm_tp_reduce(tp, e) : NULL;
}

tdm_tensor *tdm_tp_cross_entropy(tdm_group *tp, tdm_tensor *logits, const tdm_tensor *target) {
    if (!check_group("tp_cross_entropy", tp, logits)) return NULL;
    if (!target) return tdm_null_arg("tp_cross_entropy", "target");
    if (!tdm_current_scope()) TDM_RETURN_SCOPED(tdm_tp_cross_entropy(tp, logits, target));
    char a[96], b[96];
    if (logits->ndim != 2 || target->ndim != 1 || target->shape[0] != logits->shape[0])
        return tdm_raise_null(TDM_ERR_SHAPE,
                              "tp_cross_entropy: logits %s and targets %s must be [M, V/n] and [M]",
                              tdm_tensor_shape_str(logits, a), tdm_tensor_shape_str(target, b));
    int n = tdm_group_size(tp), r = tdm_group_rank(tp);
    int64_t m = logits->shape[0], k = logits->shape[1];
    /* in f32 whatever the logits' dtype, as autocast runs PyTorch's cross_entropy, but without
     * an f32 copy of bf16/f16 logits: their maxima are exact in their dtype, and the shift below
     * widens each element as it subtracts (the bits of the cast, one pass fewer each way) */
    /* every row's maximum over the whole vocabulary, a constant: it cancels in the loss and
     * only keeps exp() in range; the ranks' maxima gathered and their maximum taken on the
     * device (no wait for the host) */
    bool grad = tdm_set_grad_enabled(false);
    tdm_tensor *mx = tdm_max(logits, 1, false, NULL);
    if (mx && mx->dtype != TDM_F32) mx = tdm_to_dtype(mx, TDM_F32);
    tdm_tensor *all =
        mx ? tdm_tensor_alloc(TDM_SHAPE((int64_t)n * m), TDM_F32, logits->device) : NULL;
    int rc = all ? wait_for(tdm_all_gather(tp, all, mx)) : tdm_last_status();
    tdm_tensor *shift = rc ? NULL
                           : tdm_reshape(tdm_max(tdm_reshape(all, TDM_SHAPE(n, m)), 0, false, NULL),
                                         TDM_SHAPE(m, 1));
    tdm_set_grad_enabled(grad);
    tdm_tensor *local = NULL, *mask = NULL;
    if (!shift ||
        local_indices("tp_cross_entropy", target, n, r, k, k, logits->device, &local, &mask))
        return NULL;
    /* log sum over the vocabulary of exp(l - max), less the target's l - max; z is f32 */
    tdm_tensor *z = tdm_sub(logits, shift);
    tdm_tensor *sum = tdm_tp_reduce(tp, tdm_sum(tdm_exp(z), 1, false));
    tdm_tensor *picked =
        tdm_mul(tdm_index_select(tdm_reshape(z, TDM_SHAPE(m * k)), 0, local), mask);
    tdm_tensor *zt = tdm_tp_reduce(tp, picked);
    return tdm_mean_all(tdm_sub(tdm_log(sum), zt));
}
