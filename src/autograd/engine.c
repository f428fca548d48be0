/* The backward engine: records nodes, walks the tape in reverse, accumulates gradients and
 * fires gradient-ready hooks. */
#include "autograd/ops.h"

#include <stdlib.h>
#include <string.h>

#define MAX_HOOKS 4

typedef struct {
    int n;
    tdm_grad_hook fn[MAX_HOOKS];
    void *ctx[MAX_HOOKS];
    tdm_grad_source_fn source; /* gives the leaf a .grad on demand (ZeRO stage 2), or NULL */
    void *source_ctx;
} hook_list;

static hook_list *hooks_of(tdm_tensor *leaf);

/* A leaf without .grad whose storage is given on demand (tdm_set_grad_source) gets it now.
 * TDM_OK with t->grad still NULL when t has no source. */
static int take_source(tdm_tensor *t) {
    hook_list *h = tdm_book(t)->hooks;
    if (t->grad || !h || !h->source) return TDM_OK;
    int rc = h->source(t, h->source_ctx);
    if (!rc && !t->grad)
        rc = tdm_raise(TDM_ERR_STATE, "backward: a gradient source gave a leaf no .grad");
    return rc;
}

static _Thread_local bool grad_disabled;

bool tdm_set_grad_enabled(bool enabled) {
    bool prev = !grad_disabled;
    grad_disabled = !enabled;
    return prev;
}

bool tdm_grad_enabled(void) {
    return !grad_disabled;
}

int tdm_requires_grad_(tdm_tensor *t, bool requires_grad) {
    if (!t) return tdm_raise(TDM_ERR_ARG, "requires_grad_: NULL tensor");
    if (requires_grad && !tdm_dtype_is_float(t->dtype))
        return tdm_raise(TDM_ERR_DTYPE,
                         "requires_grad_: only float tensors (f32, bf16, f16) can require "
                         "gradients, got %s",
                         tdm_dtype_name(t->dtype));
    if (t->grad_fn)
        return tdm_raise(TDM_ERR_STATE, "requires_grad_: only leaf tensors can be changed");
    t->requires_grad = requires_grad;
    return TDM_OK;
}

bool tdm_needs_record(int n_in, tdm_tensor *const *in) {
    if (grad_disabled) return false;
    for (int i = 0; i < n_in; i++)
        if (in[i] && in[i]->requires_grad) return true;
    return false;
}

tdm_node *tdm_record(const char *name, tdm_backward_fn backward, tdm_tensor *out, int n_in,
                     tdm_tensor *const *in) {
    if (!tdm_current_scope())
        return tdm_raise_null(TDM_ERR_STATE,
                              "%s: recording autograd history needs an open step "
                              "scope (tdm_scope_begin)",
                              name);
    tdm_node *n = tdm_scope_alloc(sizeof *n);
    if (!n) return NULL;
    n->name = name;
    n->backward = backward;
    n->out = out;
    n->n_in = n_in;
    for (int i = 0; i < n_in; i++) n->in[i] = in[i];
    if (tdm_tape_push(n) != 0) return NULL;
    out->requires_grad = true;
    out->grad_fn = n;
    return n;
}

/* ---- accumulation ------------------------------------------------------------------------ */

static int add_into(tdm_tensor *acc, tdm_tensor *g) {
    return tdm_backend_for(acc->device)->axpy(acc, 1.0f, g);
}

/* g in t's dtype, PyTorch's rule that a gradient has its tensor's dtype: a backward that
 * computed it in another (a bf16 + f32 add's gradient reaching the bf16 side) is cast here,
 * once. Contiguous either way, as axpy and the borrowing below want it. */
static tdm_tensor *grad_as(const tdm_tensor *t, tdm_tensor *g) {
    if (g->dtype == t->dtype) return tdm_dense(g);
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *c = tdm_cast(g, t->dtype);
    tdm_set_grad_enabled(prev);
    return c;
}

/* ---- gradients freed once consumed ------------------------------------------------------------
 *
 * A node's incoming gradient (its gout) is needed until its backward has run. Each node that
 * holds one on a storage counts on it (grad_holders: a gradient passed on unchanged, or a view
 * of it, is held by the next node too); when a node has run, its gout's storage loses a holder,
 * and one that has none left and was made during the walk (no caller's tensor: not a seed, not
 * a leaf's .grad made before it) gives its memory back to the cache at once, where the step's
 * scope would have kept it to the end. A backward function must not keep its gy, or a
 * gradient it passed to tdm_grad_accumulate, beyond its call. */
static void hold(tdm_tensor *g) {
    if (g && g->storage) g->storage->grad_holders++;
}

static void unhold(tdm_tensor *g) {
    if (g && g->storage) g->storage->grad_holders--;
}

static void consumed(tdm_tensor *g) {
    tdm_storage *s = g ? g->storage : NULL;
    if (!s || --s->grad_holders > 0 || !s->walk_born || !s->data) return;
    tdm_storage_resize(s, 0);
}

int tdm_grad_accumulate(tdm_tensor *t, tdm_tensor *g) {
    if (!t || !t->requires_grad) return TDM_OK;
    if (!g) return tdm_last_status() ? tdm_last_status() : TDM_ERR_STATE;
    char a[96], b[96];
    if (!tdm_same_shape(t, g))
        return tdm_raise(TDM_ERR_SHAPE, "backward: gradient of shape %s for a tensor of shape %s",
                         tdm_shape_str(tdm_shape_of(g), a), tdm_shape_str(tdm_shape_of(t), b));
    if (!(g = grad_as(t, g))) return tdm_last_status();
    tdm_node *n = t->grad_fn;
    if (n) {
        if (!n->gout) { /* borrow: the producer of g must not modify it afterwards */
            n->gout = g;
            n->gout_owned = false;
            hold(g);
            return TDM_OK;
        }
        if (!n->gout_owned) {
            /* the sum into a new tensor: one pass, where a copy and an add took two */
            tdm_tensor *own = tdm_tensor_alloc(tdm_shape_of(t), t->dtype, t->device);
            if (!own || tdm_backend_for(t->device)->binary(TDM_BIN_ADD, own, n->gout, g))
                return tdm_last_status();
            unhold(n->gout); /* its producer may still read it: kept to the scope's end */
            n->gout = own;
            n->gout_owned = true;
            hold(own);
            return TDM_OK;
        }
        n->seed_one = false;
        return add_into(n->gout, g);
    }
    /* a leaf: .grad lives as long as the leaf itself, or comes from its source */
    int rc = take_source(t);
    if (rc) return rc;
    if (!t->grad) {
        t->grad = tdm_tensor_alloc_owned(tdm_shape_of(t), t->dtype, t->device, tdm_book(t)->owner);
        if (!t->grad) return tdm_last_status();
        return tdm_backend_for(t->device)->copy(t->grad, g);
    }
    if (tdm_book(t)->grad_overwrite) {
        tdm_book(t)->grad_overwrite = false;
        return tdm_backend_for(t->device)->copy(t->grad, g);
    }
    return add_into(t->grad, g);
}

int tdm_grad_accumulate_made(tdm_tensor *t, tdm_tensor *g) {
    if (g && g->storage) g->storage->walk_born = true;
    return tdm_grad_accumulate(t, g);
}

tdm_tensor *tdm_grad_pending(tdm_tensor *t) {
    if (!t || !t->requires_grad || !t->grad_fn) return NULL;
    tdm_tensor *g = t->grad_fn->gout;
    return g && g->dtype == t->dtype && tdm_is_contiguous(g) && tdm_same_shape(g, t) ? g : NULL;
}

int tdm_grad_replace(tdm_tensor *t, tdm_tensor *g) {
    if (!tdm_grad_pending(t)) return tdm_raise(TDM_ERR_STATE, "backward: no pending gradient");
    tdm_node *n = t->grad_fn;
    consumed(n->gout); /* read by the caller's kernel, queued in stream order: freed if done */
    n->gout = g;
    n->gout_owned = true; /* made for t alone: a later gradient adds into it in place */
    n->seed_one = false;
    hold(g);
    return TDM_OK;
}

tdm_tensor *tdm_grad_inplace_target(tdm_tensor *t, float *beta) {
    if (!t || !t->requires_grad || t->grad_fn) return NULL;
    /* a failing source is left to the tdm_grad_accumulate that follows, which reports it */
    if (!t->grad && take_source(t)) return NULL;
    if (!t->grad || !tdm_is_contiguous(t->grad) || !tdm_same_shape(t->grad, t)) return NULL;
    *beta = tdm_book(t)->grad_overwrite ? 0.0f : 1.0f;
    tdm_book(t)->grad_overwrite = false;
    return t->grad;
}

tdm_tensor *tdm_grad_overwrite_target(tdm_tensor *t) {
    if (!t || !t->requires_grad || t->grad_fn || !t->grad || !tdm_book(t)->grad_overwrite ||
        t->grad->dtype != t->dtype)
        return NULL;
    float beta;
    return tdm_grad_inplace_target(t, &beta); /* beta 0: the mark was set */
}

void tdm_grad_mark_overwrite(tdm_tensor *t) {
    if (t && t->grad) tdm_book(t)->grad_overwrite = true;
}

int tdm_grad_settle(tdm_tensor *t) {
    if (!t || !tdm_book(t)->grad_overwrite) return TDM_OK;
    tdm_book(t)->grad_overwrite = false;
    return tdm_backend_for(t->device)->fill(t->grad, 0.0);
}

int tdm_grad_accumulate_reduced(tdm_tensor *t, tdm_tensor *g) {
    if (!t || !t->requires_grad) return TDM_OK;
    if (!g) return tdm_last_status() ? tdm_last_status() : TDM_ERR_STATE;
    if (tdm_same_shape(t, g)) return tdm_grad_accumulate(t, g);
    /* sum over the broadcast dims: view t's shape left-padded with 1s to g's rank */
    tdm_tensor *r = tdm_tensor_alloc(tdm_shape_of(t), t->dtype, t->device);
    if (!r || !(g = tdm_dense(g))) return tdm_last_status();
    tdm_tensor rv = *r;
    int pad = g->ndim - t->ndim;
    rv.ndim = g->ndim;
    for (int i = 0; i < g->ndim; i++) rv.shape[i] = i < pad ? 1 : t->shape[i - pad];
    tdm_contiguous_strides(rv.ndim, rv.shape, rv.strides);
    int rc = tdm_backend_for(t->device)->sum_to(&rv, g);
    return rc ? rc : tdm_grad_accumulate(t, r);
}

/* ---- hooks ------------------------------------------------------------------------------- */

static void hook_list_free(void *hooks) {
    free(hooks);
}

/* The leaf's hook list, made on first use; NULL when out of memory. */
static hook_list *hooks_of(tdm_tensor *leaf) {
    hook_list *h = tdm_book(leaf)->hooks;
    if (!h && (h = tdm_book(leaf)->hooks = calloc(1, sizeof *h)))
        tdm_tensor_set_hooks_free(hook_list_free); /* tdm_tensor_free frees them */
    return h;
}

int tdm_register_grad_hook(tdm_tensor *leaf, tdm_grad_hook hook, void *ctx) {
    if (!leaf || !hook) return tdm_raise(TDM_ERR_ARG, "register_grad_hook: NULL argument");
    if (leaf->grad_fn) return tdm_raise(TDM_ERR_ARG, "register_grad_hook: not a leaf tensor");
    hook_list *h = hooks_of(leaf);
    if (!h) return tdm_raise(TDM_ERR_NOMEM, "register_grad_hook: out of memory");
    if (h->n == MAX_HOOKS)
        return tdm_raise(TDM_ERR_ARG, "register_grad_hook: at most %d hooks per tensor", MAX_HOOKS);
    h->fn[h->n] = hook;
    h->ctx[h->n++] = ctx;
    return TDM_OK;
}

int tdm_set_grad_source(tdm_tensor *leaf, tdm_grad_source_fn source, void *ctx) {
    if (!leaf) return tdm_raise(TDM_ERR_ARG, "set_grad_source: NULL leaf");
    if (leaf->grad_fn) return tdm_raise(TDM_ERR_ARG, "set_grad_source: not a leaf tensor");
    hook_list *h = hooks_of(leaf);
    if (!h) return tdm_raise(TDM_ERR_NOMEM, "set_grad_source: out of memory");
    h->source = source;
    h->source_ctx = ctx;
    return TDM_OK;
}

void tdm_clear_grad_hooks(tdm_tensor *leaf) {
    if (!leaf) return;
    hook_list_free(tdm_book(leaf)->hooks);
    tdm_book(leaf)->hooks = NULL;
}

static void fire_hooks(tdm_tensor *leaf) {
    hook_list *h = tdm_book(leaf)->hooks;
    for (int i = 0; h && i < h->n; i++) h->fn[i](leaf, h->ctx[i]);
}

/* ---- backward ---------------------------------------------------------------------------- */

int tdm_zero_grad(tdm_tensor *t) {
    if (!t) return tdm_raise(TDM_ERR_ARG, "zero_grad: NULL tensor");
    return t->grad ? tdm_backend_for(t->grad->device)->fill(t->grad, 0.0) : TDM_OK;
}

/* For each leaf read by nodes in [start, end), the earliest such node: after walking it in
 * reverse, the leaf's gradient is final. Leaves are chained per node through ready_next,
 * kept in a scope-allocated array of list heads. */
/* Input j of node n, counting its reads after its inputs. */
static tdm_tensor *node_read(const tdm_node *n, int j) {
    return j < n->n_in ? n->in[j] : n->reads[j - n->n_in];
}

static tdm_tensor **ready_lists(tdm_node **tape, int start, int end) {
    tdm_tensor **heads = tdm_scope_alloc(sizeof(tdm_tensor *) * (size_t)(end - start));
    if (!heads) return NULL;
    for (int i = start; i < end; i++)
        for (int j = 0; j < tape[i]->n_in + tape[i]->n_reads; j++) {
            tdm_tensor *x = node_read(tape[i], j);
            if (x && x->requires_grad && !x->grad_fn) tdm_book(x)->last_use = -1;
        }
    for (int i = start; i < end; i++)
        for (int j = 0; j < tape[i]->n_in + tape[i]->n_reads; j++) {
            tdm_tensor *x = node_read(tape[i], j);
            if (!x || !x->requires_grad || x->grad_fn || tdm_book(x)->last_use >= 0) continue;
            tdm_book(x)->last_use = i;
            tdm_book(x)->ready_next = heads[i - start];
            heads[i - start] = x;
        }
    return heads;
}

/* The one tape walker: runs the backward of every node in [stop, top] that a gradient
 * reached, from top down, each once. heads (NULL: no hooks) holds, per node from stop on,
 * the leaves whose gradient is final once that node is done; their hooks fire then. The
 * tape is looked up again at each node, since a backward may grow it (and so move it). */
static int walk(int top, int stop, tdm_tensor **heads) {
    int rc = TDM_OK;
    for (int i = top; i >= stop && rc == TDM_OK; i--) {
        int start, end;
        tdm_node *n = tdm_tape_nodes(&start, &end)[i];
        if (n->gout) {
            tdm_tensor *g = n->gout;
            bool prev = tdm_alloc_set_walk(true);
            rc = n->backward(n, g);
            tdm_alloc_set_walk(prev);
            n->gout = NULL;       /* a node runs once */
            if (!rc) consumed(g); /* else the step scope frees it */
        }
        for (tdm_tensor *x = heads ? heads[i - stop] : NULL; x && rc == TDM_OK;
             x = tdm_book(x)->ready_next) {
            /* a read leaf that no gradient reached still gets its (zero) .grad from its
             * source, as it has one without: its hooks see the same leaves either way */
            if (!x->grad) rc = take_source(x);
            if (x->grad) fire_hooks(x);
            tdm_book(x)->last_use = -1;
        }
    }
    return rc;
}

/* Starts a walk at out's node with gradient seed (owned: the walk may add into it). */
static void seed_node(tdm_tensor *out, tdm_tensor *seed, bool owned) {
    out->grad_fn->gout = seed;
    out->grad_fn->gout_owned = owned;
    out->grad_fn->seed_one = owned; /* ones when the engine made it */
    hold(seed);
}

/* ---- entry points: the whole tape from a loss, or part of it from a pipeline stage's output */

int tdm_backward(tdm_tensor *loss) {
    if (!loss) return tdm_last_status() ? tdm_last_status() : TDM_ERR_ARG;
    char b[96];
    if (tdm_numel(loss) != 1)
        return tdm_raise(TDM_ERR_SHAPE,
                         "backward: the loss must have one element, got shape %s "
                         "(reduce it, e.g. with tdm_mean_all)",
                         tdm_shape_str(tdm_shape_of(loss), b));
    if (!loss->grad_fn)
        return tdm_raise(TDM_ERR_STATE, "backward: the loss has no autograd history (no input "
                                        "requires a gradient, grad mode was off, or backward "
                                        "already ran over it)");
    int start, end;
    tdm_node **tape = tdm_tape_nodes(&start, &end);
    int li = loss->grad_fn->index;
    if (li < start || li >= end || tape[li] != loss->grad_fn)
        return tdm_raise(TDM_ERR_STATE, "backward: the loss's graph was already walked by a "
                                        "previous backward");
    tdm_tensor **heads = ready_lists(tape, start, li + 1);
    tdm_tensor *seed = tdm_full(tdm_shape_of(loss), 1.0f, loss->dtype, loss->device);
    if (!heads || !seed) return tdm_last_status();
    seed_node(loss, seed, true);
    int rc = walk(li, start, heads);
    tdm_tape_consume();
    return rc;
}

/* One thread holds several micro-batches' forwards on its tape at once (1F1B interleaves
 * them), so a pipeline stage cannot use tdm_backward, which walks and consumes the whole
 * tape: tdm_backward_from walks one micro-batch's range of the tape only, and
 * tdm_graph_release frees that range's activations as soon as its backward is done, since
 * step scopes end in stack order and 1F1B finishes micro-batches first in, first out. */

/* The seed of a backward from out: grad checked against out, or ones. */
static tdm_tensor *seed_for(tdm_tensor *out, tdm_tensor *grad) {
    char a[96], b[96], da[16], db[16];
    if (!grad) {
        if (tdm_numel(out) != 1)
            return tdm_raise_null(TDM_ERR_SHAPE,
                                  "backward_from: a gradient is needed for an output of "
                                  "shape %s (only a one-element output defaults to 1)",
                                  tdm_shape_str(tdm_shape_of(out), a));
        return tdm_full(tdm_shape_of(out), 1.0f, out->dtype, out->device);
    }
    if (!tdm_dtype_is_float(grad->dtype))
        return tdm_raise_null(TDM_ERR_DTYPE,
                              "backward_from: gradient is %s, expected a float dtype (f32, bf16 "
                              "or f16; cast to the output's %s)",
                              tdm_dtype_name(grad->dtype), tdm_dtype_name(out->dtype));
    if (!tdm_same_shape(grad, out))
        return tdm_raise_null(
            TDM_ERR_SHAPE, "backward_from: gradient of shape %s for an output of shape %s",
            tdm_shape_str(tdm_shape_of(grad), a), tdm_shape_str(tdm_shape_of(out), b));
    if (!tdm_device_equal(grad->device, out->device))
        return tdm_raise_null(TDM_ERR_DEVICE, "backward_from: gradient on %s for an output on %s",
                              tdm_device_str(grad->device, da), tdm_device_str(out->device, db));
    /* a gradient has its tensor's dtype */
    if (grad->dtype != out->dtype) return tdm_cast(grad, out->dtype);
    return tdm_contiguous(grad);
}

int tdm_backward_from(tdm_tensor *out, tdm_tensor *grad, int mark) {
    if (!out) return tdm_last_status() ? tdm_last_status() : TDM_ERR_ARG;
    if (!out->grad_fn)
        return tdm_raise(TDM_ERR_STATE, "backward_from: the output has no autograd history "
                                        "(no input required a gradient, or grad mode was off)");
    int start, end;
    tdm_node **tape = tdm_tape_nodes(&start, &end);
    int top = out->grad_fn->index;
    if (mark < 0 || top < mark || top >= end || tape[top] != out->grad_fn)
        return tdm_raise(TDM_ERR_STATE,
                         "backward_from: the output's node (tape position %d) was not recorded "
                         "on this thread at or after mark %d (tape holds %d nodes)",
                         top, mark, end);
    tdm_tensor *seed = seed_for(out, grad);
    if (!seed) return tdm_last_status();
    seed_node(out, seed, grad == NULL); /* the caller's gradient is only borrowed */
    return walk(top, mark, NULL);
}

/* Drops t's reference to its storage now; the scope later finds no storage to release. */
static void release_now(tdm_tensor *t) {
    if (!t || !tdm_book(t)->owner || !t->storage) return;
    if (t->requires_grad && !t->grad_fn) return; /* a leaf: its .grad is read later */
    tdm_storage_release(t->storage);
    t->storage = NULL;
}

void tdm_graph_release(int mark, int end) {
    int start, len;
    tdm_node **tape = tdm_tape_nodes(&start, &len);
    if (mark < 0 || end > len || mark >= end) return;
    for (int i = mark; i < end; i++) {
        tdm_node *n = tape[i];
        release_now(n->out);
        for (int j = 0; j < n->n_in; j++) release_now(n->in[j]);
        for (int j = 0; j < TDM_NODE_MAX_SAVED; j++) release_now(n->saved[j]);
    }
}
