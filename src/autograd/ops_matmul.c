/* matmul and bmm: shapes resolved here, products computed by the backend's batched GEMM.
 * Backward: dA = dC @ B^T, dB = A^T @ dC, with broadcast batch dims summed back. */
#include "autograd/ops.h"

#include <string.h>

/* t ([r, c] shared by every batch entry when broadcast, else [B, r, c]) as a [B, r, c] view
 * with unit stride in its last dim, copying only when it has none. */
static tdm_tensor *as_batched(tdm_tensor *t, int64_t batch, bool broadcast) {
    if (t->strides[t->ndim - 1] != 1 && t->shape[t->ndim - 1] != 1 && !(t = tdm_clone(t)))
        return NULL;
    int64_t r = t->shape[t->ndim - 2], c = t->shape[t->ndim - 1];
    int64_t shape[3] = {batch, r, c};
    int64_t strides[3] = {broadcast ? 0 : t->strides[0], t->strides[t->ndim - 2], 1};
    return tdm_tensor_view(t, 3, shape, strides, t->offset);
}

/* c [B, n, m] (+)= op(a) @ op(b) on 3-D batched operands. */
static int gemm(tdm_tensor *c, tdm_tensor *a, tdm_tensor *b, bool ta, bool tb, float beta) {
    return tdm_backend_for(c->device)->matmul(c, a, b, ta, tb, beta);
}

/* The saved operands are 3-D [B, n, k] and [B, k, m] (broadcast batch dims have stride 0);
 * arg.i[0..1] say whether a/b were broadcast; the output gradient arrives in the output's
 * shape and is viewed as [B, n, m]. */
static int matmul_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *a3 = n->saved[0], *b3 = n->saved[1];
    int64_t B = a3->shape[0], rows = a3->shape[1], k = a3->shape[2], m = b3->shape[2];
    int64_t gshape[3] = {B, rows, m}, gstr[3] = {rows * m, m, 1};
    tdm_tensor *g3 = tdm_tensor_view(gout, 3, gshape, gstr, gout->offset);
    if (!g3) return tdm_last_status();
    for (int side = 0; side < 2; side++) {
        if (!tdm_node_wants(n, side)) continue;
        bool bcast = n->arg.i[side] != 0;
        /* dA [B, n, k] = g @ b^T; dB [B, k, m] = a^T @ g */
        tdm_shape gs = side == 0 ? TDM_SHAPE(B, rows, k) : TDM_SHAPE(B, k, m);
        tdm_tensor *d = tdm_tensor_alloc(gs, n->in[side]->dtype, gout->device);
        if (!d) return tdm_last_status();
        int rc =
            side == 0 ? gemm(d, g3, b3, false, true, 0.0f) : gemm(d, a3, g3, true, false, 0.0f);
        if (rc) return rc;
        tdm_tensor *x = n->in[side];
        if (bcast) { /* a broadcast operand: sum its gradient over the batch */
            int64_t s2[2] = {gs.d[1], gs.d[2]};
            tdm_tensor *sum = tdm_tensor_alloc(TDM_SHAPE(1, s2[0], s2[1]), d->dtype, gout->device);
            if (!sum || tdm_backend_for(gout->device)->sum_to(sum, d)) return tdm_last_status();
            d = sum;
        }
        int64_t st[TDM_MAX_DIMS];
        tdm_contiguous_strides(x->ndim, x->shape, st);
        tdm_tensor *dv = tdm_tensor_view(d, x->ndim, x->shape, st, d->offset);
        if (!dv || (rc = tdm_grad_accumulate(x, dv))) return rc ? rc : tdm_last_status();
    }
    return TDM_OK;
}

/* Leading (batch) dims of a [..., n, k] and b [..., k, m] broadcast as in torch.matmul. A 2-D
 * operand is shared by every batch entry without a copy; other broadcasts are materialised. */
tdm_tensor *tdm_matmul(tdm_tensor *a, tdm_tensor *b) {
    if (!a || !b) return NULL;
    tdm_tensor *in[2] = {a, b};
    if (!tdm_current_scope() && !tdm_needs_record(2, in)) TDM_RETURN_SCOPED(tdm_matmul(a, b));
    char sa[96], sb[96];
#define SHAPES tdm_shape_str(tdm_shape_of(a), sa), tdm_shape_str(tdm_shape_of(b), sb)
    if (tdm_check_float(a, "matmul") || tdm_check_float(b, "matmul") ||
        tdm_check_same_device(a, b, "matmul"))
        return NULL;
    if (!(in[0] = a = tdm_autocast_arg(a, TDM_AC_LOW)) ||
        !(in[1] = b = tdm_autocast_arg(b, TDM_AC_LOW)) ||
        tdm_check_same_dtype(a, b, NULL, "matmul"))
        return NULL;
    if (a->ndim == 0 || b->ndim == 0)
        return tdm_raise_null(TDM_ERR_SHAPE, "matmul: scalar operand (%s @ %s)", SHAPES);
    /* vectors: [k] -> [1, k] for a, [k] -> [k, 1] for b, squeezed afterwards */
    if (a->ndim == 1) return tdm_squeeze(tdm_matmul(tdm_unsqueeze(a, 0), b), -2);
    if (b->ndim == 1) return tdm_squeeze(tdm_matmul(a, tdm_unsqueeze(b, 1)), -1);
    int64_t n = a->shape[a->ndim - 2], k = a->shape[a->ndim - 1], m = b->shape[b->ndim - 1];
    if (b->shape[b->ndim - 2] != k)
        return tdm_raise_null(TDM_ERR_SHAPE, "matmul: inner dims differ: %s @ %s", SHAPES);
    int nb = (a->ndim > b->ndim ? a->ndim : b->ndim) - 2;
    tdm_shape out = {nb + 2, {0}};
    int64_t batch = 1;
    bool a_full = true, b_full = true; /* batch dims equal to out's, or none at all */
    for (int i = 0; i < nb; i++) {
        int ia = i - (nb - (a->ndim - 2)), ib = i - (nb - (b->ndim - 2));
        int64_t da = ia >= 0 ? a->shape[ia] : 1, db = ib >= 0 ? b->shape[ib] : 1;
        if (da != db && da != 1 && db != 1)
            return tdm_raise_null(TDM_ERR_SHAPE, "matmul: batch dims do not broadcast: %s @ %s",
                                  SHAPES);
        out.d[i] = da > db ? da : db;
        batch *= out.d[i];
        if (a->ndim > 2 && (ia < 0 || da != out.d[i])) a_full = false;
        if (b->ndim > 2 && (ib < 0 || db != out.d[i])) b_full = false;
    }
#undef SHAPES
    out.d[nb] = n;
    out.d[nb + 1] = m;
    if (!a_full || !b_full) { /* partial broadcast: materialise both at the full batch shape */
        tdm_shape fa = out, fb = out;
        fa.d[nb + 1] = k;
        fb.d[nb] = k;
        return tdm_matmul(tdm_contiguous(tdm_expand(a, fa)), tdm_contiguous(tdm_expand(b, fb)));
    }
    bool a_bc = a->ndim == 2 && nb > 0, b_bc = b->ndim == 2 && nb > 0;
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *a3 = a->ndim == 2 ? a : tdm_reshape(a, TDM_SHAPE(batch, n, k));
    tdm_tensor *b3 = b->ndim == 2 ? b : tdm_reshape(b, TDM_SHAPE(batch, k, m));
    a3 = a3 ? as_batched(a3, batch, a_bc) : NULL;
    b3 = b3 ? as_batched(b3, batch, b_bc) : NULL;
    tdm_set_grad_enabled(prev);
    tdm_tensor *c = tdm_tensor_alloc(out, a->dtype, a->device);
    tdm_tensor *c3 =
        c ? tdm_tensor_view(c, 3, (int64_t[]){batch, n, m}, (int64_t[]){n * m, m, 1}, 0) : NULL;
    if (!a3 || !b3 || !c3 || gemm(c3, a3, b3, false, false, 0.0f)) return NULL;
    if (tdm_needs_record(2, in)) {
        tdm_node *nd = tdm_record("matmul", matmul_backward, c, 2, in);
        if (!nd) return tdm_drop_fail(c);
        nd->saved[0] = a3;
        nd->saved[1] = b3;
        nd->arg.i[0] = a_bc;
        nd->arg.i[1] = b_bc;
    }
    return c;
}

tdm_tensor *tdm_bmm(tdm_tensor *a, tdm_tensor *b) {
    if (!a || !b) return NULL;
    char sa[96], sb[96];
    if (a->ndim != 3 || b->ndim != 3 || a->shape[0] != b->shape[0])
        return tdm_raise_null(TDM_ERR_SHAPE, "bmm: expected [B, n, k] @ [B, k, m], got %s @ %s",
                              tdm_shape_str(tdm_shape_of(a), sa),
                              tdm_shape_str(tdm_shape_of(b), sb));
    return tdm_matmul(a, b);
}
