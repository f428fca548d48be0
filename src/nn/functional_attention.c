/* Functional causal self-attention as one tape node: qkv [B, T, 3C] -> y [B, T, C]. A layer
 * of a network, so it lives in nn/ (docs/ARCHITECTURE.md, "What lives where").
 *
 * One node instead of the eight of the textbook form (split, three reshapes, matmul, mask,
 * softmax, matmul) means no [B, heads, T, T] tensor is ever stored: the node saves qkv and
 * the per-row log-sum-exp [B, heads, T], and backward recomputes the probabilities one head
 * at a time (see the backend's attention kernels).
 */
#include "tandem/nn.h"

#include "autograd/ops.h"

/* in: qkv; out: y; saved: lse; arg.i[0]: heads */
static int attention_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *qkv = n->in[0];
    const tdm_backend *be = tdm_backend_for(qkv->device);
    tdm_tensor *gy = tdm_contiguous(gout);
    tdm_tensor *gqkv = tdm_tensor_alloc(tdm_shape_of(qkv), qkv->dtype, qkv->device);
    if (!gy || !gqkv) return tdm_last_status();
    int rc = be->attention_backward(gqkv, gy, qkv, n->out, n->saved[0], (int)n->arg.i[0]);
    return rc ? rc : tdm_grad_accumulate(qkv, gqkv);
}

static int check_attention(const tdm_tensor *qkv, int n_head, const tdm_backend **be) {
    char b[96];
    if (tdm_check_float(qkv, "causal_attention")) return tdm_last_status();
    if (qkv->ndim != 3 || qkv->shape[2] % 3 != 0)
        return tdm_raise(TDM_ERR_SHAPE,
                         "causal_attention: qkv must be [B, T, 3C] (q, k, v side by side), got %s",
                         tdm_shape_str(tdm_shape_of(qkv), b));
    int64_t C = qkv->shape[2] / 3;
    if (n_head < 1 || C % n_head != 0 || C == 0)
        return tdm_raise(TDM_ERR_SHAPE,
                         "causal_attention: %lld channels (qkv %s) do not split into %d heads",
                         (long long)C, tdm_shape_str(tdm_shape_of(qkv), b), n_head);
    if (!(*be = tdm_backend_for(qkv->device))) return tdm_last_status();
    if (!(*be)->attention || !(*be)->attention_backward)
        return tdm_raise(TDM_ERR_DEVICE, "causal_attention: the %s backend has no attention kernel",
                         (*be)->name);
    return TDM_OK;
}

tdm_tensor *tdm_causal_attention(tdm_tensor *qkv, int n_head) {
    if (!qkv) return tdm_null_input("causal_attention");
    TDM_AUTOCAST_SCOPED(1, &qkv, tdm_causal_attention(qkv, n_head));
    if (tdm_check_float(qkv, "causal_attention") || !(qkv = tdm_autocast_arg(qkv, TDM_AC_LOW)))
        return NULL;
    const tdm_backend *be = NULL;
    if (check_attention(qkv, n_head, &be)) return NULL;
    tdm_tensor *x = tdm_contiguous(qkv);
    if (!x) return NULL;
    int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2] / 3;
    tdm_tensor *y = tdm_tensor_alloc(TDM_SHAPE(B, T, C), x->dtype, x->device);
    /* the log-sum-exp stays f32 in every dtype, as PyTorch's flash kernels keep it */
    tdm_tensor *lse = tdm_tensor_alloc(TDM_SHAPE(B, n_head, T), TDM_F32, x->device);
    if (!y || !lse || be->attention(y, lse, x, n_head)) {
        tdm_drop_temp(y, NULL);
        tdm_drop_temp(lse, NULL);
        tdm_drop_temp(x, qkv);
        return NULL;
    }
    tdm_tensor *in[1] = {x};
    if (tdm_needs_record(1, in)) {
        tdm_node *n = tdm_record("causal_attention", attention_backward, y, 1, in);
        if (!n) return tdm_drop_fail(y);
        n->saved[0] = lse;
        n->arg.i[0] = n_head;
    } else {
        tdm_drop_temp(lse, NULL);
        tdm_drop_temp(x, qkv);
    }
    return y;
}
