/* Tensors: geometry, the checks ops share, headers and views, and freeing. What runs a
 * kernel (creation with values, fills, copies, host transfers) is the backend layer's
 * (src/backend/tensor_values.c): core sits below the backend, whose kernels allocate through
 * core. */
#include "core/core.h"

#include <stdlib.h>
#include <string.h>

/* ---- geometry ---------------------------------------------------------------------------- */

void tdm_contiguous_strides(int ndim, const int64_t *shape, int64_t *strides) {
    uint64_t s = 1; /* unsigned: a shape not yet checked wraps instead of overflowing */
    for (int i = ndim - 1; i >= 0; i--) {
        strides[i] = (int64_t)s;
        s *= (uint64_t)shape[i];
    }
}

int64_t tdm_numel(const tdm_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

tdm_shape tdm_shape_of(const tdm_tensor *t) {
    tdm_shape s = {t->ndim, {0}};
    memcpy(s.d, t->shape, sizeof(int64_t) * (size_t)t->ndim);
    return s;
}

bool tdm_is_contiguous(const tdm_tensor *t) {
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != s) return false;
        s *= t->shape[i];
    }
    return true;
}

bool tdm_same_shape(const tdm_tensor *a, const tdm_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

void *tdm_data_ptr(const tdm_tensor *t) {
    if (!t || !t->storage || t->device.type != TDM_CPU) return NULL;
    return (char *)t->storage->data + t->offset * (int64_t)tdm_dtype_size(t->dtype);
}

int tdm_wrap_dim(int dim, int ndim, const char *op) {
    int d = dim < 0 ? dim + ndim : dim;
    if (d < 0 || d >= (ndim ? ndim : 1))
        return tdm_raise(TDM_ERR_ARG, "%s: dim %d out of range for a %d-d tensor", op, dim, ndim),
               -1;
    return d;
}

int tdm_check_f32(const tdm_tensor *t, const char *op) {
    if (t->dtype == TDM_F32) return 0;
    return tdm_raise(TDM_ERR_DTYPE, "%s: expected an f32 tensor, got %s", op,
                     tdm_dtype_name(t->dtype));
}

int tdm_check_same_device(const tdm_tensor *a, const tdm_tensor *b, const char *op) {
    if (tdm_device_equal(a->device, b->device)) return 0;
    char da[16], db[16];
    return tdm_raise(TDM_ERR_DEVICE, "%s: tensors on different devices (%s and %s)", op,
                     tdm_device_str(a->device, da), tdm_device_str(b->device, db));
}

/* ---- construction ------------------------------------------------------------------------ */

static int bad_shape(int ndim, const int64_t *d, const char *op, const char *why) {
    tdm_shape shape = {ndim, {0}};
    memcpy(shape.d, d, sizeof(int64_t) * (size_t)ndim);
    char buf[96];
    return tdm_raise(TDM_ERR_SHAPE, "%s: invalid shape %s: %s", op, tdm_shape_str(shape, buf), why);
}

/* Refuses a shape that may come from untrusted numbers (a file's header, a layout): too many
 * dims, a negative one, or more elements than an int64 counts in bytes (at 8 bytes each, so
 * the byte count fits a size_t too). */
static int check_shape(int ndim, const int64_t *d, const char *op) {
    if (ndim < 0 || ndim > TDM_MAX_DIMS)
        return tdm_raise(TDM_ERR_SHAPE, "%s: %d dims (at most %d)", op, ndim, TDM_MAX_DIMS);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (d[i] < 0) return bad_shape(ndim, d, op, "a dimension is negative");
        if (d[i] > 0 && n > INT64_MAX / 8 / d[i])
            return bad_shape(ndim, d, op, "its byte count overflows a 64-bit integer");
        n *= d[i];
    }
    return 0;
}

tdm_tensor *tdm_tensor_alloc_owned(tdm_shape shape, tdm_dtype dt, tdm_device dev,
                                   tdm_scope *owner) {
    if (check_shape(shape.ndim, shape.d, "tensor")) return NULL;
    if (!tdm_dtype_valid(dt))
        return tdm_raise_null(TDM_ERR_DTYPE,
                              "tensor: unknown dtype %d (f32, i32, i64, bf16 or f16)", (int)dt);
    tdm_storage *s = tdm_storage_new((size_t)tdm_shape_numel(shape) * tdm_dtype_size(dt), dev);
    if (!s) return NULL;
    tdm_tensor *t = tdm_tensor_header_owned(owner);
    if (!t) {
        tdm_storage_release(s);
        return NULL;
    }
    t->dtype = dt;
    t->ndim = shape.ndim;
    memcpy(t->shape, shape.d, sizeof(int64_t) * (size_t)shape.ndim);
    tdm_contiguous_strides(shape.ndim, shape.d, t->strides);
    t->device = dev;
    t->storage = s;
    return t;
}

tdm_tensor *tdm_tensor_alloc(tdm_shape shape, tdm_dtype dt, tdm_device dev) {
    return tdm_tensor_alloc_owned(shape, dt, dev, tdm_current_scope());
}

tdm_tensor *tdm_tensor_view(const tdm_tensor *base, int ndim, const int64_t *shape,
                            const int64_t *strides, int64_t offset) {
    if (check_shape(ndim, shape, "tensor_view")) return NULL;
    tdm_tensor *t = tdm_tensor_header();
    if (!t) return NULL;
    t->dtype = base->dtype;
    t->ndim = ndim;
    memcpy(t->shape, shape, sizeof(int64_t) * (size_t)ndim);
    memcpy(t->strides, strides, sizeof(int64_t) * (size_t)ndim);
    t->offset = offset;
    t->device = base->device;
    t->storage = base->storage;
    tdm_storage_retain(t->storage);
    return t;
}

static _Atomic(tdm_hooks_free_fn) hooks_free;

void tdm_tensor_set_hooks_free(tdm_hooks_free_fn fn) {
    tdm_hooks_free_fn none = NULL;
    atomic_compare_exchange_strong(&hooks_free, &none, fn);
}

void tdm_tensor_free(tdm_tensor *t) {
    if (!t) return;
    if (tdm_book(t)->owner) {
        tdm_raise(TDM_ERR_STATE, "tensor_free: tensor belongs to a scope; tdm_scope_end frees it");
        return;
    }
    if (t->grad && !tdm_book(t->grad)->owner) tdm_tensor_free(t->grad);
    if (tdm_book(t)->hooks)
        atomic_load_explicit(&hooks_free, memory_order_acquire)(tdm_book(t)->hooks);
    tdm_storage_release(t->storage);
    free(t);
}
