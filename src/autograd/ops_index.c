/* index_select: rows of src along dim picked by an integer index; its backward scatters the
 * gradient back with index_add (repeated indices sum, in a fixed order). */
#include "autograd/ops.h"

static int index_select_backward(tdm_node *n, tdm_tensor *gout) {
    tdm_tensor *src = n->in[0], *idx = n->saved[0];
    int dim = (int)n->arg.i[0];
    tdm_tensor *g = tdm_contiguous(gout);
    tdm_tensor *gx = tdm_zeros(tdm_shape_of(src), src->dtype, src->device);
    if (!g || !gx) return tdm_last_status();
    int rc = tdm_backend_for(src->device)->index_add(gx, dim, idx, g);
    if (rc) return rc;
    return tdm_grad_accumulate(src, gx);
}

tdm_tensor *tdm_index_select(tdm_tensor *src, int dim, const tdm_tensor *index) {
    if (!src || !index) return tdm_null_input("index_select");
    if (src->ndim == 0)
        return tdm_raise_null(TDM_ERR_SHAPE, "index_select: src must have at least 1 dim, got []");
    int d = tdm_wrap_dim(dim, src->ndim, "index_select");
    if (d < 0) return NULL;
    if (tdm_check_index(index, src, "index_select")) return NULL;
    if (index->ndim > 1) {
        char b[96];
        return tdm_raise_null(TDM_ERR_SHAPE, "index_select: index must be 1-D, got shape %s",
                              tdm_shape_str(tdm_shape_of(index), b));
    }
    const tdm_backend *be = tdm_backend_for(src->device);
    if (!be) return NULL;
    tdm_tensor *x = tdm_contiguous(src);
    if (!x) return NULL;
    tdm_shape ys = tdm_shape_of(x);
    ys.d[d] = tdm_numel(index);
    tdm_tensor *y = tdm_tensor_alloc(ys, x->dtype, x->device);
    if (!y || be->index_select(y, x, d, index)) {
        tdm_drop_temp(y, NULL);
        tdm_drop_temp(x, src);
        return NULL;
    }
    tdm_tensor *in[1] = {x};
    if (tdm_dtype_is_float(x->dtype) && tdm_needs_record(1, in)) {
        tdm_tensor *keep = tdm_index_keep(index);
        if (!keep) return NULL;
        tdm_node *nd = tdm_record("index_select", index_select_backward, y, 1, in);
        if (!nd) return tdm_drop_fail(y);
        nd->saved[0] = keep;
        nd->arg.i[0] = d;
    }
    tdm_drop_temp(x, src);
    return y;
}
