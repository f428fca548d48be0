/* Differentiable copies between devices whose graphs live on different threads, and the
 * tape walks a pipeline stage needs.
 *
 * tdm_to_device records one node whose backward copies the gradient back; that works while
 * both devices' ops are on one thread's tape. A pipeline runs each stage on its own thread,
 * each with its own tape, so the copy is cut in two: the receiver records a node with no
 * inputs (tdm_device_recv) whose backward copies dL/dy back to the sender's device and hands
 * it over; the sender resumes its own backward from the tensor it sent (tdm_backward_from).
 * Neither thread ever touches the other's nodes.
 *
 * One thread holds several micro-batches' forwards on its tape at once (1F1B interleaves
 * them), so tdm_backward, which walks and consumes the whole tape, does not fit:
 * tdm_backward_from walks one micro-batch's range of the tape only, and tdm_graph_release
 * frees that range's activations as soon as its backward is done, since step scopes end in
 * stack order and 1F1B finishes micro-batches in first-in-first-out order. */
#include "autograd/tape.h"

typedef struct {
    tdm_grad_sink sink;
    void *arg;
    tdm_device src_device;
} recv_ctx;

/* dL/dy goes back to the sender's device as a caller-owned tensor for the sink. */
static int recv_backward(tdm_node *n, tdm_tensor *gout) {
    const recv_ctx *c = n->ctx;
    if (!c->sink) return TDM_OK;
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *g = tdm_scope_keep(tdm_to_device(gout, c->src_device));
    tdm_set_grad_enabled(prev);
    if (!g) return tdm_last_status();
    c->sink(g, c->arg);
    return TDM_OK;
}

tdm_tensor *tdm_device_recv(tdm_tensor *src, tdm_device dev, tdm_grad_sink sink, void *arg) {
    if (!src) {
        if (tdm_last_status() == TDM_OK) tdm_raise(TDM_ERR_ARG, "device_recv: NULL input");
        return NULL;
    }
    if (!tdm_current_scope())
        return tdm_raise_null(TDM_ERR_STATE, "device_recv: needs an open step scope on the "
                                             "receiving thread (tdm_scope_begin)");
    /* a plain copy: recording tdm_to_device's node would put src, another thread's tensor,
     * on this thread's tape */
    bool grad = tdm_set_grad_enabled(false);
    tdm_tensor *y = tdm_to_device(src, dev);
    tdm_set_grad_enabled(grad);
    if (!y || !grad || !src->requires_grad) return y;
    tdm_node *n = tdm_record("device_recv", recv_backward, y, 0, NULL);
    recv_ctx *c = n ? tdm_scope_alloc(sizeof *c) : NULL;
    if (!c) return NULL;
    *c = (recv_ctx){sink, arg, src->device};
    n->ctx = c;
    return y;
}

/* The seed of a backward from out: grad checked against out, or ones. */
static tdm_tensor *seed_for(tdm_tensor *out, tdm_tensor *grad) {
    char a[96], b[96], da[16], db[16];
    if (!grad) {
        if (tdm_numel(out) != 1)
            return tdm_raise_null(TDM_ERR_SHAPE,
                                  "backward_from: a gradient is needed for an output of "
                                  "shape %s (only a one-element output defaults to 1)",
                                  tdm_shape_str(tdm_shape_of(out), a));
        return tdm_full(tdm_shape_of(out), 1.0f, TDM_F32, out->device);
    }
    if (grad->dtype != TDM_F32)
        return tdm_raise_null(TDM_ERR_DTYPE, "backward_from: gradient is %s, expected f32",
                              tdm_dtype_name(grad->dtype));
    if (!tdm_same_shape(grad, out))
        return tdm_raise_null(
            TDM_ERR_SHAPE, "backward_from: gradient of shape %s for an output of shape %s",
            tdm_shape_str(tdm_shape_of(grad), a), tdm_shape_str(tdm_shape_of(out), b));
    if (!tdm_device_equal(grad->device, out->device))
        return tdm_raise_null(TDM_ERR_DEVICE, "backward_from: gradient on %s for an output on %s",
                              tdm_device_str(grad->device, da), tdm_device_str(out->device, db));
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
    out->grad_fn->gout = seed;
    out->grad_fn->gout_owned = grad == NULL; /* the caller's gradient is only borrowed */
    int rc = TDM_OK;
    for (int i = top; i >= mark && rc == TDM_OK; i--) {
        tape = tdm_tape_nodes(&start, &end); /* a backward may grow (move) the tape */
        tdm_node *n = tape[i];
        if (n->gout) {
            rc = n->backward(n, n->gout);
            n->gout = NULL; /* the step scope frees it; a node runs once */
        }
    }
    return rc;
}

/* Drops t's reference to its storage now; the scope later finds no storage to release. */
static void release_now(tdm_tensor *t) {
    if (!t || !t->owner || !t->storage) return;
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
