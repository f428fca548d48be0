/* Private autograd interface: tape nodes, recording and gradient accumulation (the helpers
 * ops share besides are in autograd/ops.h).
 *
 * An op's forward computes its output with backend kernels, then, if tdm_needs_record says
 * so, calls tdm_record to append a node holding its inputs, saved tensors and arguments.
 * The node's backward receives the gradient of the output (same shape) and hands each
 * input's gradient to tdm_grad_accumulate. Neither the gradient it received nor one it handed
 * on may be kept beyond the call: the engine gives a gradient's memory back once the nodes
 * holding it have run (engine.c).
 */
#ifndef TDM_TAPE_H
#define TDM_TAPE_H

#include "tandem/autograd.h"
#include "backend/backend.h"

#define TDM_NODE_MAX_IN    5
#define TDM_NODE_MAX_SAVED 6

typedef int (*tdm_backward_fn)(tdm_node *n, tdm_tensor *gout);

struct tdm_node {
    const char *name; /* op name, for errors and traces */
    tdm_backward_fn backward;
    tdm_tensor *out;
    tdm_tensor *gout; /* gradient of out accumulated so far (NULL: none reached it) */
    bool gout_owned;  /* gout belongs to this node and may be added into in place */
    /* gout is the backward's seed of ones, unchanged: the walk starts at this node with a
     * unit gradient (a loss may have written its input's gradient for it in the forward) */
    bool seed_one;
    int n_in;
    tdm_tensor *in[TDM_NODE_MAX_IN];
    tdm_tensor *saved[TDM_NODE_MAX_SAVED];
    union {
        float f[8];
        int64_t i[8];
    } arg, arg2;   /* op arguments (dims, scalars, flags) */
    void *ctx;     /* larger op arguments, allocated with tdm_scope_alloc */
    int32_t index; /* position on the tape */
    /* leaves the backward gives gradients to besides in[] (a recomputation's parameters,
     * autograd/recompute.c): gradient-ready hooks count them as read by this node */
    tdm_tensor **reads;
    int n_reads;
};

/* True if an op with these inputs must record a node: grad mode on and some input
 * requires a gradient. NULL entries are skipped. */
bool tdm_needs_record(int n_in, tdm_tensor *const *in);
/* Appends a node for out (sets out->requires_grad and out->grad_fn). Returns the node, to
 * which the op adds saved tensors and arguments, or NULL on failure: no scope is open, or out
 * of memory. out is the op's either way: on failure it drops it as on any other
 * (tdm_drop_fail frees it when no scope owns it). */
tdm_node *tdm_record(const char *name, tdm_backward_fn backward, tdm_tensor *out, int n_in,
                     tdm_tensor *const *in);
/* Whether input i of the node needs a gradient. */
static inline bool tdm_node_wants(const tdm_node *n, int i) {
    return n->in[i] && n->in[i]->requires_grad;
}
/* Adds g (shape of t) into t's gradient: a leaf's .grad or its producer node's gout. May
 * keep a reference to g instead of copying, so g must stay unmodified afterwards; once that
 * node has run, g's memory may be given back (engine.c). */
int tdm_grad_accumulate(tdm_tensor *t, tdm_tensor *g);
/* tdm_grad_accumulate for a gradient an op made before the walk for t alone (a loss's forward
 * writing its input's gradient): its memory goes back once consumed, as one made during it. */
int tdm_grad_accumulate_made(tdm_tensor *t, tdm_tensor *g);
/* The gradient t's other consumers have given it so far, when t is an op's output (not a
 * leaf) and one has: dense, of t's shape and dtype; else NULL. A backward whose kernel can add
 * it to the gradient it computes for t (one pass where the kernel's output and an add took
 * two: a pre-norm residual stream's layer norm) hands the sum to tdm_grad_replace instead of
 * tdm_grad_accumulate. The pending gradient must not be modified. */
tdm_tensor *tdm_grad_pending(tdm_tensor *t);
/* Makes g (t's shape and dtype: tdm_grad_pending(t) plus the caller's contribution, made for
 * t alone) t's gradient so far, in place of the pending one; a later gradient is added into g
 * in place. TDM_OK, or TDM_ERR_STATE when t has no pending gradient. */
int tdm_grad_replace(tdm_tensor *t, tdm_tensor *g);
/* The leaf's own gradient buffer when a backward may add into it directly (t is a leaf with
 * a contiguous .grad of its shape, e.g. a parameter's view of the flat gradient), else NULL.
 * Kernels that can accumulate (a GEMM with beta 1) then skip a temporary and an add. *beta
 * is what the kernel multiplies the buffer by: 1, or 0 when it is stale
 * (tdm_grad_mark_overwrite), which the call then clears. */
tdm_tensor *tdm_grad_inplace_target(tdm_tensor *t, float *beta);
/* The leaf t's own .grad when it holds stale values (tdm_grad_mark_overwrite) and is a
 * contiguous tensor of t's shape and dtype, for a kernel that writes t's whole gradient there
 * (nothing to accumulate after: the mark is cleared, so the kernel must write it); else NULL,
 * and nothing changes. */
tdm_tensor *tdm_grad_overwrite_target(tdm_tensor *t);
/* The leaf t's .grad (if any) holds stale values: the next gradient accumulated into it
 * replaces them instead of adding to them, as if it had been zeroed, without the pass that
 * zeroes it. Whoever marks a leaf calls tdm_grad_settle after the backward, before anything
 * reads the gradient. */
void tdm_grad_mark_overwrite(tdm_tensor *t);
/* Zeroes t's .grad if it is still marked stale (no gradient reached t) and clears the mark.
 * TDM_OK or the fill's error. */
int tdm_grad_settle(tdm_tensor *t);
/* Where a leaf's .grad comes from when it has none: called as the first gradient of a
 * backward reaches the leaf (and for a leaf the tape read that no gradient reached, before
 * its gradient-ready hooks), it sets leaf->grad to a zeroed contiguous f32 tensor of the
 * leaf's shape that the caller keeps alive (DDP under ZeRO stage 2: a view of a bucket's
 * buffer, taken from the allocator only while the bucket is in flight). Returns TDM_OK or an
 * error, which fails the backward. */
typedef int (*tdm_grad_source_fn)(tdm_tensor *leaf, void *ctx);
/* Sets leaf's gradient source (NULL: none, .grad is allocated whole as usual). Cleared with
 * the hooks (tdm_clear_grad_hooks). TDM_ERR_ARG for a NULL or non-leaf tensor. */
int tdm_set_grad_source(tdm_tensor *leaf, tdm_grad_source_fn source, void *ctx);
/* Sums g down to t's shape (the reverse of broadcasting) and accumulates it. */
int tdm_grad_accumulate_reduced(tdm_tensor *t, tdm_tensor *g);

/* The thread's tape (src/autograd/tape.c), truncated by the scopes as they end. */
int tdm_tape_push(tdm_node *n);
/* Nodes [*start, *end) not yet walked by a backward. */
tdm_node **tdm_tape_nodes(int *start, int *end);
/* Marks every node recorded so far as walked. */
void tdm_tape_consume(void);

#endif
