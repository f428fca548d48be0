/* The helpers every op shares (autograd/ops.h): contiguous copies for kernels, broadcasting
 * and integer index arguments. */
#include "autograd/ops.h"

tdm_tensor *tdm_dense(const tdm_tensor *t) {
    if (tdm_is_contiguous(t)) return (tdm_tensor *)t;
    tdm_tensor *c = tdm_tensor_alloc(tdm_shape_of(t), t->dtype, t->device);
    if (c && tdm_backend_for(t->device)->copy(c, t) != 0) return tdm_drop_fail(c);
    return c;
}

int tdm_broadcast_shapes(const tdm_tensor *a, const tdm_tensor *b, tdm_shape *out, const char *op) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    out->ndim = nd;
    for (int d = 0; d < nd; d++) {
        /* right-aligned: missing leading dims count as 1 */
        int da = d - (nd - a->ndim), db = d - (nd - b->ndim);
        int64_t sa = da >= 0 ? a->shape[da] : 1, sb = db >= 0 ? b->shape[db] : 1;
        if (sa != sb && sa != 1 && sb != 1) {
            char ba[96], bb[96];
            return tdm_raise(TDM_ERR_SHAPE,
                             "%s: shapes %s and %s cannot be broadcast together (dim %d: %lld vs "
                             "%lld)",
                             op, tdm_tensor_shape_str(a, ba), tdm_tensor_shape_str(b, bb), d - nd,
                             (long long)sa, (long long)sb);
        }
        out->d[d] = sa == 1 ? sb : sa;
    }
    return TDM_OK;
}

/* An index tensor the tape may read at backward time: a caller-owned one could be freed
 * before then, so it is copied into the current scope. */
tdm_tensor *tdm_index_keep(const tdm_tensor *idx) {
    if (tdm_book(idx)->owner) return (tdm_tensor *)idx;
    return tdm_clone(idx);
}

/* The checks every integer index argument shares. */
int tdm_check_index(const tdm_tensor *idx, const tdm_tensor *src, const char *op) {
    if (idx->dtype != TDM_I32 && idx->dtype != TDM_I64)
        return tdm_raise(TDM_ERR_DTYPE, "%s: index must be i32 or i64, got %s", op,
                         tdm_dtype_name(idx->dtype));
    if (!tdm_device_equal(idx->device, src->device)) {
        char d1[16], d2[16];
        return tdm_raise(TDM_ERR_DEVICE, "%s: index is on %s but the tensor is on %s", op,
                         tdm_device_str(idx->device, d1), tdm_device_str(src->device, d2));
    }
    return TDM_OK;
}

int tdm_check_float(const tdm_tensor *t, const char *op) {
    if (tdm_dtype_is_float(t->dtype)) return TDM_OK;
    return tdm_raise(TDM_ERR_DTYPE, "%s: expected a float tensor (f32, bf16 or f16), got %s", op,
                     tdm_dtype_name(t->dtype));
}

int tdm_check_same_dtype(const tdm_tensor *x, const tdm_tensor *a, const tdm_tensor *b,
                         const char *op) {
    const tdm_tensor *o = a && a->dtype != x->dtype ? a : b && b->dtype != x->dtype ? b : NULL;
    if (!o) return TDM_OK;
    return tdm_raise(TDM_ERR_DTYPE,
                     "%s: operands of dtypes %s and %s (a product takes one dtype: cast one, "
                     "or run it in an autocast region)",
                     op, tdm_dtype_name(x->dtype), tdm_dtype_name(o->dtype));
}
