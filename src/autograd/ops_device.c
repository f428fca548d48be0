/* Differentiable copies between devices whose graphs live on different threads.
 *
 * tdm_to_device records one node whose backward copies the gradient back; that works while
 * both devices' ops are on one thread's tape. A pipeline runs each stage on its own thread,
 * each with its own tape, so the copy is cut in two: the receiver records a node with no
 * inputs (tdm_device_recv) whose backward copies dL/dy back to the sender's device and hands
 * it over; the sender resumes its own backward from the tensor it sent (tdm_backward_from).
 * Neither thread ever touches the other's nodes.
 *
 * The sender's side, tdm_backward_from and tdm_graph_release, walks and frees part of a tape:
 * it lives with the backward engine (engine.c). */
#include "autograd/ops.h"

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
    if (!src) return tdm_null_input("device_recv");
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
    if (!c) return tdm_drop_fail(y);
    *c = (recv_ctx){sink, arg, src->device};
    n->ctx = c;
    return y;
}
