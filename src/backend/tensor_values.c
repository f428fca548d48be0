/* The functions of tensor.h that run a kernel of the tensor's device: creation with values,
 * fills, random draws, copies and host transfers. They are the backend layer's, above core
 * (which makes headers, views and storage), so that core never calls up into the table. */
#include "backend/backend.h"
#include "tandem/half.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
        else if (dt == TDM_BF16) /* the float value rounded once, as torch.arange's */
            ((uint16_t *)h)[i] = tdm_bf16_from_float((float)v);
        else if (dt == TDM_F16)
            ((uint16_t *)h)[i] = tdm_f16_from_float((float)v);
        else
            ((int64_t *)h)[i] = (int64_t)v;
    }
    int rc = backend_of(t)->from_host(t, h);
    free(h);
    return rc ? NULL : t;
}

static int draw(tdm_tensor *t, int dist, float a, float b, tdm_rng *rng) {
    if (!t) return tdm_last_status();
    if (!tdm_dtype_is_float(t->dtype))
        return tdm_raise(TDM_ERR_DTYPE, "%s: expected a floating-point tensor, got %s",
                         dist ? "normal_" : "uniform_", tdm_dtype_name(t->dtype));
    if (!rng) rng = tdm_default_rng();
    /* each element consumes one counter; round up so draws never overlap */
    uint64_t first = tdm_rng_take(rng, (uint64_t)tdm_numel(t) + 4);
    return backend_of(t)->random(t, dist, a, b, rng->seed, first);
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
    if (t->dtype == TDM_BF16 || t->dtype == TDM_F16) {
        uint16_t h;
        if (backend_of(t)->to_host(&h, t)) return NAN;
        return t->dtype == TDM_BF16 ? tdm_bf16_to_float(h) : tdm_f16_to_float(h);
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
    if (!tdm_dtype_valid(dt))
        return tdm_raise_null(TDM_ERR_DTYPE, "cast: unknown dtype %d (from %s)", (int)dt,
                              tdm_dtype_name(t->dtype));
    tdm_tensor *c = tdm_tensor_alloc(tdm_shape_of(t), dt, t->device);
    return c && backend_of(c)->copy(c, t) == 0 ? c : NULL;
}

/* Element i of host elements of float dtype dt as a float (bf16 and f16 widened exactly). */
static float host_float(const void *h, tdm_dtype dt, int64_t i) {
    if (dt == TDM_BF16) return tdm_bf16_to_float(((const uint16_t *)h)[i]);
    if (dt == TDM_F16) return tdm_f16_to_float(((const uint16_t *)h)[i]);
    return ((const float *)h)[i];
}

int tdm_tensor_format(const tdm_tensor *t, char *buf, size_t cap) {
    if (!t || !buf || !cap) return tdm_raise(TDM_ERR_ARG, "tensor_format: NULL argument");
    int64_t n = tdm_numel(t);
    size_t bytes = (size_t)n * tdm_dtype_size(t->dtype);
    void *h = malloc(bytes ? bytes : 1);
    if (!h) return tdm_raise(TDM_ERR_NOMEM, "tensor_format: out of memory for %zu bytes", bytes);
    int rc = backend_of(t)->to_host(h, t);
    size_t at = 0;
#define PUT(...)                                                                                   \
    (at += (size_t)snprintf(at < cap ? buf + at : NULL, at < cap ? cap - at : 0, __VA_ARGS__))
    PUT("tensor([");
    for (int64_t i = 0; !rc && i < n; i++) {
        if (n > 8 && i == 4) { /* a long tensor shows its two ends, as PyTorch summarises */
            PUT(", ...");
            i = n - 4;
        }
        const char *sep = i ? ", " : "";
        if (tdm_dtype_is_float(t->dtype))
            PUT("%s%.6g", sep, (double)host_float(h, t->dtype, i));
        else
            PUT("%s%lld", sep,
                t->dtype == TDM_I64 ? (long long)((const int64_t *)h)[i]
                                    : (long long)((const int32_t *)h)[i]);
    }
    char shape[96], dev[16];
    PUT("], shape %s, %s, %s)", tdm_shape_str(tdm_shape_of(t), shape), tdm_dtype_name(t->dtype),
        tdm_device_str(t->device, dev));
#undef PUT
    if (at >= cap) buf[cap - 1] = '\0';
    free(h);
    return rc;
}
