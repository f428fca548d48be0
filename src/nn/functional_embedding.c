/* Functional embedding: rows of a weight table looked up by an integer index of any shape,
 * composed of index_select (whose backward scatters the gradient back) and a reshape. */
#include "tandem/nn.h"

#include "autograd/ops.h"

tdm_tensor *tdm_embedding(tdm_tensor *weight, const tdm_tensor *idx) {
    if (!weight || !idx) return tdm_null_input("embedding");
    char b1[96];
    if (tdm_check_float(weight, "embedding")) return NULL;
    if (weight->ndim != 2)
        return tdm_raise_null(TDM_ERR_SHAPE, "embedding: weight must be [num, dim], got %s",
                              tdm_shape_str(tdm_shape_of(weight), b1));
    if (tdm_check_index(idx, weight, "embedding")) return NULL;
    if (idx->ndim + 1 > TDM_MAX_DIMS)
        return tdm_raise_null(TDM_ERR_SHAPE, "embedding: index %s has too many dims",
                              tdm_shape_str(tdm_shape_of(idx), b1));
    /* index_select wants a 1-D index: flatten (copying only a strided one) */
    const tdm_tensor *ci = idx;
    if (!tdm_is_contiguous(idx)) {
        tdm_tensor *c = tdm_empty(tdm_shape_of(idx), idx->dtype, idx->device);
        if (!c || tdm_copy_(c, idx)) return NULL;
        ci = c;
    }
    int64_t k = tdm_numel(ci), one = 1;
    tdm_tensor *flat = tdm_tensor_view(ci, 1, &k, &one, ci->offset);
    if (!flat) return NULL;
    tdm_tensor *rows = tdm_index_select(weight, 0, flat); /* [k, dim] */
    tdm_drop_temp(flat, NULL);
    if (ci != idx) tdm_drop_temp((tdm_tensor *)ci, NULL);
    if (!rows) return NULL;
    tdm_shape os = tdm_shape_of(idx);
    os.d[os.ndim++] = weight->shape[1];
    tdm_tensor *out = tdm_reshape(rows, os); /* a view: shares rows' storage */
    tdm_drop_temp(rows, out);
    return out;
}
