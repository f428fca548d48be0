/* Recomputation (torch.utils.checkpoint): a function run without keeping its activations and
 * run again when the backward reaches it (include/tandem/autograd.h, tdm_recompute).
 *
 * Forward: fn runs inside a scope of its own, with grad mode on, so its graph is recorded and
 * its output is exactly what it would be without recomputation. From that graph we keep the
 * leaves it reads (the parameters: the node's `reads`, so gradient-ready hooks wait for the
 * node) and the counters of its random draws; then the scope ends, freeing every tensor and
 * node fn made, and one node is recorded whose output shares the storage of fn's.
 *
 * Backward: fn runs again on the same x inside a scope of its own, replaying those counters,
 * and tdm_backward_from walks the new graph, seeded with the node's output gradient. The
 * walk accumulates into the same tensors the direct path would (x's producer, the leaves'
 * .grad) in the same order, so the gradients agree bit for bit. The gradients it hands to
 * tensors made before it (x's producer node) are moved to the outer scope before the inner
 * one ends; everything else it made goes with the scope.
 */
#include "autograd/ops.h"

#include <stdlib.h>
#include <string.h>

static _Thread_local int recomputing; /* depth of recomputations running on this thread */

bool tdm_recomputing(void) {
    return recomputing > 0;
}

typedef struct {
    tdm_recompute_fn fn;
    void *arg;
    uint64_t *draws; /* the first counter of each random draw of the first run */
    int n_draws;
    tdm_dtype autocast; /* the autocast dtype the first run saw, restored for the second */
} recompute_ctx;

/* t becomes a tensor of src's geometry sharing its storage, without history: how a tensor
 * made inside a scope outlives it (t's header belongs to an outer scope). */
static void adopt(tdm_tensor *t, const tdm_tensor *src) {
    t->dtype = src->dtype;
    t->ndim = src->ndim;
    memcpy(t->shape, src->shape, sizeof t->shape);
    memcpy(t->strides, src->strides, sizeof t->strides);
    t->offset = src->offset;
    t->device = src->device;
    t->storage = src->storage;
    tdm_storage_retain(t->storage);
}

/* ---- the leaves the recorded graph reads ------------------------------------------------- */

typedef struct {
    tdm_tensor **v;
    int n, cap;
    bool heap; /* v was grown on the heap (it starts in the caller's array) */
} leaf_list;

static int leaves_push(leaf_list *l, tdm_tensor *t) {
    for (int i = 0; i < l->n; i++)
        if (l->v[i] == t) return TDM_OK;
    if (l->n == l->cap) {
        int cap = 2 * l->cap;
        tdm_tensor **v =
            l->heap ? realloc(l->v, sizeof *v * (size_t)cap) : malloc(sizeof *v * (size_t)cap);
        if (!v) return tdm_raise(TDM_ERR_NOMEM, "recompute: out of memory listing parameters");
        if (!l->heap) memcpy(v, l->v, sizeof *v * (size_t)l->n);
        l->v = v;
        l->cap = cap;
        l->heap = true;
    }
    l->v[l->n++] = t;
    return TDM_OK;
}

/* The leaves that require a gradient read by the nodes recorded from mark on, except those
 * made in scope `inner` (they die with it). */
static int collect_leaves(int mark, const tdm_scope *inner, leaf_list *l) {
    int start, end;
    tdm_node **tape = tdm_tape_nodes(&start, &end);
    for (int i = mark; i < end; i++) {
        const tdm_node *n = tape[i];
        for (int j = 0; j < n->n_in + n->n_reads; j++) {
            tdm_tensor *x = j < n->n_in ? n->in[j] : n->reads[j - n->n_in];
            if (!x || !x->requires_grad || x->grad_fn || tdm_book(x)->owner == inner) continue;
            if (leaves_push(l, x)) return tdm_last_status();
        }
    }
    return TDM_OK;
}

/* ---- backward ------------------------------------------------------------------------------ */

/* Gradients the walk from mark on handed to tensors made before mark (x, a tensor fn reads
 * through its argument) are the current scope's, `inner`: each moves to a header of scope
 * outer (spare first, if not NULL, then the heap) sharing its storage. */
static int keep_outer_grads(int mark, const tdm_scope *inner, tdm_scope *outer,
                            tdm_tensor **spare) {
    int start, end;
    tdm_node **tape = tdm_tape_nodes(&start, &end);
    for (int i = mark; i < end; i++)
        for (int j = 0; j < tape[i]->n_in; j++) {
            tdm_tensor *t = tape[i]->in[j];
            tdm_node *p = t ? t->grad_fn : NULL;
            if (!p || p->index >= mark || !p->gout || tdm_book(p->gout)->owner != inner) continue;
            tdm_tensor *g = *spare ? *spare : tdm_tensor_header_owned(outer);
            *spare = NULL;
            if (!g) return tdm_last_status();
            adopt(g, p->gout);
            p->gout = g;
        }
    return TDM_OK;
}

/* Whether fn's second run (output y, its nodes from mark on, draws replayed from log)
 * matches the first, whose output was n->out. */
static int check_rerun(const tdm_node *n, const tdm_tensor *y, int mark, const tdm_rng_log *log) {
    char a[96], b[96];
    if (!y)
        return tdm_last_status() ? tdm_last_status()
                                 : tdm_raise(TDM_ERR_STATE, "recompute: the function returned "
                                                            "NULL, with no error, when run again");
    if (!y->grad_fn || y->grad_fn->index < mark)
        return tdm_raise(TDM_ERR_STATE, "recompute: run again in backward, the function's output "
                                        "has no history (it must compute the same graph as in "
                                        "forward)");
    if (!tdm_same_shape(y, n->out))
        return tdm_raise(TDM_ERR_SHAPE,
                         "recompute: the function returned %s in forward but %s when run again "
                         "in backward",
                         tdm_shape_str(tdm_shape_of(n->out), a), tdm_shape_str(tdm_shape_of(y), b));
    if (log->failed || log->next != log->n)
        return tdm_raise(TDM_ERR_STATE,
                         "recompute: the function drew random numbers %d times in forward but %s "
                         "when run again in backward (its draws must not depend on state that "
                         "changed in between)",
                         log->n, log->failed ? "more" : "fewer");
    return TDM_OK;
}

/* Runs fn again with the first run's draws and grad mode on; its nodes start at the tape's
 * current end. */
static tdm_tensor *rerun(const recompute_ctx *c, tdm_tensor *x, tdm_rng_log *log) {
    /* the ops run in the dtypes they ran in forward, whatever region backward runs in (a
     * region begun with f32 is autocast off, as it was then) */
    if (tdm_autocast_begin(c->autocast)) return NULL;
    bool cache = tdm_autocast_set_cache(false);
    tdm_rng_log_push(log);
    bool grad = tdm_set_grad_enabled(true);
    recomputing++;
    tdm_tensor *y = c->fn(c->arg, x);
    recomputing--;
    tdm_set_grad_enabled(grad);
    tdm_rng_log_pop(log);
    tdm_autocast_set_cache(cache);
    tdm_autocast_end();
    return y;
}

/* in: x; ctx: recompute_ctx; reads: the leaves fn reads */
static int recompute_backward(tdm_node *n, tdm_tensor *gout) {
    const recompute_ctx *c = n->ctx;
    tdm_scope *outer = tdm_current_scope();
    if (!outer)
        return tdm_raise(TDM_ERR_STATE, "recompute: the backward needs an open step scope "
                                        "(tdm_scope_begin) to run the function again");
    tdm_tensor *spare = tdm_tensor_header(); /* in the outer scope, for x's gradient */
    if (!spare || tdm_scope_begin()) return tdm_last_status();
    const tdm_scope *inner = tdm_current_scope();
    int mark = tdm_tape_size();
    tdm_rng_log log = {.offsets = c->draws, .n = c->n_draws, .cap = c->n_draws, .replay = true};
    tdm_tensor *y = rerun(c, n->in[0], &log);
    int rc = check_rerun(n, y, mark, &log);
    if (!rc) rc = tdm_backward_from(y, gout, mark);
    if (!rc) rc = keep_outer_grads(mark, inner, outer, &spare);
    tdm_scope_end();
    return rc;
}

/* ---- forward ------------------------------------------------------------------------------- */

/* The node for fn's output y, adopted by out (a header of the current scope), once fn's own
 * scope has ended: it reads x and the leaves, and replays the draws. */
static tdm_tensor *record(tdm_recompute_fn fn, void *arg, tdm_tensor *x, tdm_tensor *out,
                          const leaf_list *leaves, const tdm_rng_log *log) {
    recompute_ctx *c = tdm_scope_alloc(sizeof *c);
    tdm_tensor **reads = tdm_scope_alloc(sizeof *reads * (size_t)(leaves->n ? leaves->n : 1));
    uint64_t *draws = tdm_scope_alloc(sizeof *draws * (size_t)(log->n ? log->n : 1));
    if (!c || !reads || !draws) return NULL;
    memcpy(reads, leaves->v, sizeof *reads * (size_t)leaves->n);
    memcpy(draws, log->offsets, sizeof *draws * (size_t)log->n);
    *c = (recompute_ctx){fn, arg, draws, log->n, tdm_autocast_dtype()};
    tdm_node *n = tdm_record("recompute", recompute_backward, out, 1, &x);
    if (!n) return NULL;
    n->ctx = c;
    n->reads = reads;
    n->n_reads = leaves->n;
    return out;
}

/* TDM_OK when fn's first run gave an output y and its draws were all logged. */
static int first_run_status(const tdm_tensor *y, const tdm_rng_log *log) {
    if (y && !log->failed) return TDM_OK;
    if (y) return tdm_raise(TDM_ERR_NOMEM, "recompute: out of memory logging random draws");
    if (tdm_last_status()) return tdm_last_status();
    return tdm_raise(TDM_ERR_STATE, "recompute: the function returned NULL, with no error");
}

tdm_tensor *tdm_recompute(tdm_recompute_fn fn, void *arg, tdm_tensor *x) {
    if (!x) return tdm_null_input("recompute");
    if (!fn) return tdm_raise_null(TDM_ERR_ARG, "recompute: fn is NULL");
    if (!tdm_grad_enabled()) return fn(arg, x);
    if (!tdm_current_scope())
        return tdm_raise_null(TDM_ERR_STATE, "recompute: needs an open step scope "
                                             "(tdm_scope_begin) to record its node");
    tdm_tensor *out = tdm_tensor_header(); /* the result, in the caller's scope */
    if (!out || tdm_scope_begin()) return NULL;
    const tdm_scope *inner = tdm_current_scope();
    int mark = tdm_tape_size();
    uint64_t draws0[8];
    tdm_tensor *leaves0[64];
    tdm_rng_log log = {.offsets = draws0, .cap = 8};
    leaf_list leaves = {leaves0, 0, 64, false};
    tdm_rng_log_push(&log);
    bool cache = tdm_autocast_set_cache(false); /* the casts fn makes are its own, read again */
    tdm_tensor *y = fn(arg, x);
    tdm_autocast_set_cache(cache);
    tdm_rng_log_pop(&log);
    bool recorded = y && y->grad_fn && y->grad_fn->index >= mark;
    bool inner_owned = y && tdm_book(y)->owner == inner;
    int rc = first_run_status(y, &log);
    if (!rc && recorded) rc = collect_leaves(mark, inner, &leaves);
    if (!rc && (recorded || inner_owned)) adopt(out, y);
    tdm_scope_end(); /* fn's tensors and nodes: freed */
    tdm_tensor *result = rc            ? NULL
                         : recorded    ? record(fn, arg, x, out, &leaves, &log)
                         : inner_owned ? out /* nothing needs a gradient: a plain output */
                                       : y;  /* fn returned a tensor it did not make */
    if (log.heap) free(log.offsets);
    if (leaves.heap) free(leaves.v);
    return result;
}
