/* Tensors: construction, geometry, creation helpers, host transfer and freeing. Memory is
 * reached only through the backend of the tensor's device. */
#include "backend/backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- geometry ---------------------------------------------------------------------------- */

void tdm_contiguous_strides(int ndim, const int64_t *shape, int64_t *strides) {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        strides[i] = s;
        s *= shape[i];
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

static int check_shape(tdm_shape shape, const char *op) {
    char buf[96];
    if (shape.ndim < 0 || shape.ndim > TDM_MAX_DIMS)
        return tdm_raise(TDM_ERR_SHAPE, "%s: %d dims (at most %d)", op, shape.ndim, TDM_MAX_DIMS);
    int64_t n = 1;
    for (int i = 0; i < shape.ndim; i++) {
        if (shape.d[i] < 0 || (shape.d[i] > 0 && n > INT64_MAX / 8 / shape.d[i]))
            return tdm_raise(TDM_ERR_SHAPE, "%s: invalid shape %s", op, tdm_shape_str(shape, buf));
        n *= shape.d[i];
    }
    return 0;
}

tdm_tensor *tdm_tensor_alloc_owned(tdm_shape shape, tdm_dtype dt, tdm_device dev,
                                   tdm_scope *owner) {
    if (check_shape(shape, "tensor")) return NULL;
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
    if (t->owner) {
        tdm_raise(TDM_ERR_STATE, "tensor_free: tensor belongs to a scope; tdm_scope_end frees it");
        return;
    }
    if (t->grad && !t->grad->owner) tdm_tensor_free(t->grad);
    if (t->hooks) atomic_load_explicit(&hooks_free, memory_order_acquire)(t->hooks);
    tdm_storage_release(t->storage);
    free(t);
}

/* ---- creation ---------------------------------------------------------------------------- */

static const tdm_backend *backend_of(const tdm_tensor *t) {
    return tdm_backend_for(t->device);
}

tdm_tensor *tdm_empty(tdm_shape shape, tdm_dtype dt, tdm_device dev) {
    if (!tdm_backend_for(dev)) return NULL;
    return tdm_tensor_alloc(shape, dt, dev);
}

tdm_tensor *tdm_full(tdm_shape shape, float value, tdm_dtype dt, tdm_device dev) {
    tdm_tensor *t = tdm_empty(shape, dt, dev);
    if (t && backend_of(t)->fill(t, value) != 0) return NULL;
    return t;
}

tdm_tensor *tdm_zeros(tdm_shape shape, tdm_dtype dt, tdm_device dev) {
    return tdm_full(shape, 0.0f, dt, dev);
}

tdm_tensor *tdm_ones(tdm_shape shape, tdm_dtype dt, tdm_device dev) {
    return tdm_full(shape, 1.0f, dt, dev);
}

tdm_tensor *tdm_from_data(tdm_shape shape, tdm_dtype dt, tdm_device dev, const void *host) {
    if (!host) return tdm_raise_null(TDM_ERR_ARG, "from_data: NULL host pointer");
    tdm_tensor *t = tdm_empty(shape, dt, dev);
    if (t && backend_of(t)->from_host(t, host) != 0) return NULL;
    return t;
}

tdm_tensor *tdm_arange(double start, double end, double step, tdm_dtype dt, tdm_device dev) {
    if (step == 0 || !isfinite(start) || !isfinite(end) || !isfinite(step))
        return tdm_raise_null(TDM_ERR_ARG, "arange: invalid range (%g, %g, step %g)", start, end,
                              step);
    double count = ceil((end - start) / step);
    int64_t n = count > 0 ? (int64_t)count : 0;
    tdm_tensor *t = tdm_empty(TDM_SHAPE(n), dt, dev);
    if (!t) return NULL;
    /* Built on the host once: arange is for setup, not for a step's hot path. */
    size_t es = tdm_dtype_size(dt);
    void *h = malloc((size_t)n * es + 1);
    if (!h) return tdm_raise_null(TDM_ERR_NOMEM, "arange: out of memory");
    for (int64_t i = 0; i < n; i++) {
        double v = start + (double)i * step;
        if (dt == TDM_F32)
            ((float *)h)[i] = (float)v;
        else if (dt == TDM_I32)
            ((int32_t *)h)[i] = (int32_t)v;
        else
            ((int64_t *)h)[i] = (int64_t)v;
    }
    int rc = backend_of(t)->from_host(t, h);
    free(h);
    return rc ? NULL : t;
}

static int draw(tdm_tensor *t, int dist, float a, float b, tdm_rng *rng) {
    if (!t) return tdm_last_status();
    if (tdm_check_f32(t, dist ? "normal_" : "uniform_")) return TDM_ERR_DTYPE;
    if (!rng) rng = tdm_default_rng();
    int rc = backend_of(t)->random(t, dist, a, b, rng->seed, rng->offset);
    /* each element consumes one counter; round up so draws never overlap */
    rng->offset += (uint64_t)tdm_numel(t) + 4;
    return rc;
}

int tdm_uniform_(tdm_tensor *t, float low, float high, tdm_rng *rng) {
    return draw(t, 0, low, high, rng);
}

int tdm_normal_(tdm_tensor *t, float mean, float std, tdm_rng *rng) {
    return draw(t, 1, mean, std, rng);
}

tdm_tensor *tdm_randn(tdm_shape shape, float mean, float std, tdm_device dev, tdm_rng *rng) {
    tdm_tensor *t = tdm_empty(shape, TDM_F32, dev);
    return t && draw(t, 1, mean, std, rng) == 0 ? t : NULL;
}

tdm_tensor *tdm_rand(tdm_shape shape, float low, float high, tdm_device dev, tdm_rng *rng) {
    tdm_tensor *t = tdm_empty(shape, TDM_F32, dev);
    return t && draw(t, 0, low, high, rng) == 0 ? t : NULL;
}

int tdm_fill_(tdm_tensor *t, float value) {
    if (!t) return tdm_raise(TDM_ERR_ARG, "fill_: NULL tensor");
    return backend_of(t)->fill(t, value);
}

int tdm_copy_(tdm_tensor *dst, const tdm_tensor *src) {
    if (!dst || !src) return tdm_raise(TDM_ERR_ARG, "copy_: NULL tensor");
    char a[96], b[96];
    if (!tdm_same_shape(dst, src))
        return tdm_raise(TDM_ERR_SHAPE, "copy_: shapes differ (dst %s, src %s)",
                         tdm_shape_str(tdm_shape_of(dst), a), tdm_shape_str(tdm_shape_of(src), b));
    if (tdm_check_same_device(dst, src, "copy_")) return TDM_ERR_DEVICE;
    return backend_of(dst)->copy(dst, src);
}

int tdm_to_host(const tdm_tensor *t, void *host, size_t nbytes) {
    if (!t || !host) return tdm_raise(TDM_ERR_ARG, "to_host: NULL argument");
    size_t need = (size_t)tdm_numel(t) * tdm_dtype_size(t->dtype);
    if (nbytes < need)
        return tdm_raise(TDM_ERR_ARG, "to_host: buffer of %zu bytes, tensor needs %zu", nbytes,
                         need);
    return backend_of(t)->to_host(host, t);
}

float tdm_item(const tdm_tensor *t) {
    if (!t) return NAN;
    if (tdm_numel(t) != 1) {
        char b[96];
        tdm_raise(TDM_ERR_SHAPE, "item: tensor of shape %s has more than one element",
                  tdm_shape_str(tdm_shape_of(t), b));
        return NAN;
    }
    if (t->dtype == TDM_F32) {
        float v;
        return backend_of(t)->to_host(&v, t) ? NAN : v;
    }
    int64_t v64 = 0;
    int32_t v32 = 0;
    if (backend_of(t)->to_host(t->dtype == TDM_I64 ? (void *)&v64 : (void *)&v32, t)) return NAN;
    return t->dtype == TDM_I64 ? (float)v64 : (float)v32;
}

tdm_tensor *tdm_clone(const tdm_tensor *t) {
    if (!t) return NULL;
    tdm_tensor *c = tdm_tensor_alloc(tdm_shape_of(t), t->dtype, t->device);
    return c && backend_of(c)->copy(c, t) == 0 ? c : NULL;
}

tdm_tensor *tdm_cast(const tdm_tensor *t, tdm_dtype dt) {
    if (!t) return NULL;
    tdm_tensor *c = tdm_tensor_alloc(tdm_shape_of(t), dt, t->device);
    return c && backend_of(c)->copy(c, t) == 0 ? c : NULL;
}
