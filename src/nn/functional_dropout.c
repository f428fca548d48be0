/* Differentiable dropout: argument checks, the Philox counters each element draws (the same
 * on one device and split over a data-parallel batch), the kernel call and the tape node.
 * The mask is drawn by the backend's kernels (cpu_dropout.c, cuda_dropout.cu). */
#include "autograd/ops.h"
#include "nn/batch_split.h"
#include "tandem/nn.h"

/* in: x; saved: mask (0 or 1/(1-p)) */
static int dropout_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *x = n->in[0], *mask = n->saved[0];
    tdm_tensor *gx = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (!gx) return tdm_last_status();
    int rc = tdm_backend_for(x->device)->binary(TDM_BIN_MUL, gx, gout, mask);
    return rc ? rc : tdm_grad_accumulate(x, gx);
}

tdm_tensor *tdm_dropout(tdm_tensor *x, float p, bool training, tdm_rng *rng) {
    if (!x) return tdm_null_input("dropout");
    if (tdm_check_float(x, "dropout")) return NULL;
    if (!(p >= 0.0f && p <= 1.0f))
        return tdm_raise_null(TDM_ERR_ARG, "dropout: p must be in [0, 1], got %g", (double)p);
    if (!training || p == 0.0f) return x;
    const tdm_backend *be = tdm_backend_for(x->device);
    if (!be) return NULL;
    if (!rng) rng = tdm_default_rng();
    tdm_tensor *xc = tdm_contiguous(x);
    if (!xc) return NULL;
    tdm_tensor *y = tdm_tensor_alloc(tdm_shape_of(xc), x->dtype, x->device);
    /* the mask stays f32 in every dtype: 1/(1-p) is rarely a bf16 value */
    tdm_tensor *mask = tdm_tensor_alloc(tdm_shape_of(xc), TDM_F32, x->device);
    if (!y || !mask) return NULL;
    uint64_t first = 0, used = (uint64_t)tdm_numel(xc); /* first: this rank's counter */
    tdm_batch_split split, *pc = tdm_batch_split_current(&split) ? &split : NULL;
    if (pc && xc->ndim >= 1) {
        /* rows [row0, row0 + b) of the global batch: the counters one device would give
         * them, and the whole batch's worth consumed, so every rank's generator moves on
         * exactly as one device's does */
        int64_t b = xc->shape[0], row_numel = b ? tdm_numel(xc) / b : 0;
        if (pc->row0 + b > pc->global_rows) {
            char s1[96];
            return tdm_raise_null(TDM_ERR_SHAPE,
                                  "dropout: input %s has %lld rows from global row %lld, past "
                                  "the parallel context's %lld rows",
                                  tdm_shape_str(tdm_shape_of(xc), s1), (long long)b,
                                  (long long)pc->row0, (long long)pc->global_rows);
        }
        first = (uint64_t)(pc->row0 * row_numel);
        used = (uint64_t)(pc->global_rows * row_numel);
    }
    /* recorded in a CUDA graph: the kernel reads the counters each replay sets */
    const uint64_t *at;
    if (tdm_graph_draw(x->device, rng, used, first, &at)) return NULL;
    /* the next draw starts after this one's counters, so masks never repeat; a recomputation
     * (tdm_recompute) gets this draw's counters again instead */
    uint64_t start = tdm_rng_take(rng, used) + first;
    if (be->dropout(y, mask, xc, p, rng->seed, start, at)) return NULL;
    tdm_tensor *in[1] = {xc};
    if (tdm_needs_record(1, in)) {
        tdm_node *n = tdm_record("dropout", dropout_backward, y, 1, in);
        if (!n) return tdm_drop_fail(y);
        n->saved[0] = mask;
    } else {
        tdm_drop_temp(mask, NULL);
    }
    tdm_drop_temp(xc, x);
    return y;
}
