/* CPU memory kernels: raw blocks, host transfer, strided copy with dtype conversion, fill,
 * and Philox random fills. */
#include "backend/cpu/cpu.h"
#include "tandem/half.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define HUGE_THRESHOLD (2u << 20)

void *tdm_cpu_mem_alloc(int device_index, size_t nbytes) {
    /* Large blocks are 2 MiB aligned and asked for huge pages: first touch of 4 KiB pages
     * costs far more on this kind of VM than with huge pages (bench/RESULTS.md, "Figures behind the
     * code"). */
    size_t align = nbytes >= HUGE_THRESHOLD ? HUGE_THRESHOLD : 64;
    size_t size = (nbytes + align - 1) / align * align;
    void *p = aligned_alloc(align, size ? size : align);
    if (p && nbytes >= HUGE_THRESHOLD) madvise(p, size, MADV_HUGEPAGE);
    return p;
}

void tdm_cpu_mem_free(int device_index, void *p, size_t nbytes) {
    free(p);
}

/* Visits every element of t in row-major order, calling body with the element offset. */
#define FOR_EACH_OFFSET(t, off, body)                                                              \
    do {                                                                                           \
        int64_t idx_[TDM_MAX_DIMS] = {0};                                                          \
        int64_t n_ = tdm_numel(t), off = 0;                                                        \
        int nd_ = (t)->ndim;                                                                       \
        for (int64_t i_ = 0; i_ < n_; i_++) {                                                      \
            body;                                                                                  \
            for (int d_ = nd_ - 1; d_ >= 0; d_--) {                                                \
                off += (t)->strides[d_];                                                           \
                if (++idx_[d_] < (t)->shape[d_]) break;                                            \
                off -= (t)->strides[d_] * (t)->shape[d_];                                          \
                idx_[d_] = 0;                                                                      \
            }                                                                                      \
        }                                                                                          \
    } while (0)

static inline double load(const void *base, tdm_dtype dt, int64_t i) {
    switch (dt) {
    case TDM_F32:
        return ((const float *)base)[i];
    case TDM_I32:
        return ((const int32_t *)base)[i];
    case TDM_I64:
        return (double)((const int64_t *)base)[i];
    case TDM_BF16:
        return tdm_bf16_to_float(((const uint16_t *)base)[i]);
    case TDM_F16:
        return tdm_f16_to_float(((const uint16_t *)base)[i]);
    }
    return 0;
}

static inline void store(void *base, tdm_dtype dt, int64_t i, double v) {
    switch (dt) {
    case TDM_F32:
        ((float *)base)[i] = (float)v;
        break;
    case TDM_I32:
        ((int32_t *)base)[i] = (int32_t)v;
        break;
    case TDM_I64:
        ((int64_t *)base)[i] = (int64_t)v;
        break;
    case TDM_BF16: /* through a float, as PyTorch converts a double */
        ((uint16_t *)base)[i] = tdm_bf16_from_float((float)v);
        break;
    case TDM_F16:
        ((uint16_t *)base)[i] = tdm_f16_from_float((float)v);
        break;
    }
}

/* Converts n contiguous elements between f32 and bf16/f16 with half.h's vectorised arrays;
 * false when the pair is not one of those four. */
/* f32 to or from bf16 or f16: the pairs convert_half converts. */
static bool half_pair(tdm_dtype dd, tdm_dtype sd) {
    return (sd == TDM_F32 && (dd == TDM_BF16 || dd == TDM_F16)) ||
           (dd == TDM_F32 && (sd == TDM_BF16 || sd == TDM_F16));
}

static bool convert_half(void *d, tdm_dtype dd, const void *s, tdm_dtype sd, size_t n) {
    if (sd == TDM_F32 && dd == TDM_BF16)
        tdm_bf16_from_f32(d, s, n);
    else if (sd == TDM_F32 && dd == TDM_F16)
        tdm_f16_from_f32(d, s, n);
    else if (sd == TDM_BF16 && dd == TDM_F32)
        tdm_bf16_to_f32(d, s, n);
    else if (sd == TDM_F16 && dd == TDM_F32)
        tdm_f16_to_f32(d, s, n);
    else
        return false;
    return true;
}

int tdm_cpu_copy(tdm_tensor *dst, const tdm_tensor *src) {
    void *d = tdm_data_ptr(dst);
    const void *s = tdm_data_ptr(src);
    bool contiguous = tdm_is_contiguous(dst) && tdm_is_contiguous(src);
    if (dst->dtype == src->dtype && contiguous) {
        memmove(d, s, (size_t)tdm_numel(dst) * tdm_dtype_size(dst->dtype));
        return TDM_OK;
    }
    /* the casts of mixed precision: one pass, no double round trip (src and dst are distinct
     * tensors of different element sizes, so they cannot overlap as the conversions need) */
    if (contiguous && convert_half(d, dst->dtype, s, src->dtype, (size_t)tdm_numel(dst)))
        return TDM_OK;
    /* rows of src's innermost dim contiguous, dst contiguous: a row at a time, copied or
     * converted whole (linear's bias broadcast over the rows, under autocast, every step). A
     * conversion wants distinct storages; an f32 copy within one storage kept this path
     * before the conversions came, and keeps it. */
    bool same = dst->dtype == src->dtype;
    if (tdm_is_contiguous(dst) && src->ndim >= 1 && src->strides[src->ndim - 1] == 1 &&
        (dst->storage != src->storage || (same && dst->dtype == TDM_F32)) &&
        (same || half_pair(dst->dtype, src->dtype))) {
        int64_t row = src->shape[src->ndim - 1], k = 0;
        size_t des = tdm_dtype_size(dst->dtype), ses = tdm_dtype_size(src->dtype);
        tdm_tensor outer = *src;
        outer.ndim--;
        if (row > 0 && tdm_numel(src) > 0)
            FOR_EACH_OFFSET(&outer, off, {
                char *o = (char *)d + k * (int64_t)des;
                const char *in = (const char *)s + off * (int64_t)ses;
                if (same)
                    memcpy(o, in, (size_t)row * des);
                else
                    convert_half(o, dst->dtype, in, src->dtype, (size_t)row);
                k += row;
            });
        return TDM_OK;
    }
    /* one side contiguous and the storages distinct: one walk of the other side, converting
     * element by element, with no buffer (linear's broadcast bias under autocast comes here
     * every step, and a step allocates nothing from the system) */
    int64_t n = tdm_numel(src);
    if (n == 0) return TDM_OK;
    int64_t k = 0;
    if (dst->storage != src->storage && tdm_is_contiguous(dst)) {
        FOR_EACH_OFFSET(src, off, store(d, dst->dtype, k++, load(s, src->dtype, off)));
        return TDM_OK;
    }
    if (dst->storage != src->storage && tdm_is_contiguous(src)) {
        FOR_EACH_OFFSET(dst, off, store(d, dst->dtype, off, load(s, src->dtype, k++)));
        return TDM_OK;
    }
    /* general case (both strided, or one storage): through a buffer, so an overlap reads
     * every element before any is written */
    double *tmp = malloc((size_t)n * sizeof(double));
    if (!tmp) return tdm_raise(TDM_ERR_NOMEM, "copy: out of memory");
    FOR_EACH_OFFSET(src, off, tmp[k++] = load(s, src->dtype, off));
    k = 0;
    FOR_EACH_OFFSET(dst, off, store(d, dst->dtype, off, tmp[k++]));
    free(tmp);
    return TDM_OK;
}

int tdm_cpu_to_host(void *host, const tdm_tensor *t) {
    size_t es = tdm_dtype_size(t->dtype);
    if (tdm_is_contiguous(t)) {
        memcpy(host, tdm_data_ptr(t), (size_t)tdm_numel(t) * es);
        return TDM_OK;
    }
    const char *s = tdm_data_ptr(t);
    char *o = host;
    int64_t k = 0;
    FOR_EACH_OFFSET(t, off, {
        memcpy(o + k * (int64_t)es, s + off * (int64_t)es, es);
        k++;
    });
    return TDM_OK;
}

int tdm_cpu_from_host(tdm_tensor *t, const void *host) {
    size_t es = tdm_dtype_size(t->dtype);
    if (tdm_is_contiguous(t)) {
        memcpy(tdm_data_ptr(t), host, (size_t)tdm_numel(t) * es);
        return TDM_OK;
    }
    char *d = tdm_data_ptr(t);
    const char *in = host;
    int64_t k = 0;
    FOR_EACH_OFFSET(t, off, {
        memcpy(d + off * (int64_t)es, in + k * (int64_t)es, es);
        k++;
    });
    return TDM_OK;
}

int tdm_cpu_count_up(tdm_tensor *n) {
    if (n->dtype != TDM_I64 || tdm_numel(n) != 1)
        return tdm_raise(TDM_ERR_ARG, "count_up: a count is one i64 element");
    ++*(int64_t *)tdm_data_ptr(n);
    return TDM_OK;
}

int tdm_cpu_fill(tdm_tensor *dst, double value) {
    void *d = tdm_data_ptr(dst);
    int64_t n = tdm_numel(dst);
    if (tdm_is_contiguous(dst) && dst->dtype == TDM_F32) {
        float v = (float)value, *o = d;
        if (v == 0.0f)
            memset(o, 0, (size_t)n * sizeof(float));
        else
            for (int64_t i = 0; i < n; i++) o[i] = v;
        return TDM_OK;
    }
    if (tdm_is_contiguous(dst) && tdm_dtype_size(dst->dtype) == 2) { /* bf16, f16: one rounding */
        float v = (float)value;
        uint16_t h = dst->dtype == TDM_BF16 ? tdm_bf16_from_float(v) : tdm_f16_from_float(v),
                 *o = d;
        for (int64_t i = 0; i < n; i++) o[i] = h;
        return TDM_OK;
    }
    FOR_EACH_OFFSET(dst, off, store(d, dst->dtype, off, value));
    return TDM_OK;
}

/* Element k of t's row-major order into d[offset of k] (t gives only the geometry): uniform
 * from word (c % 4) of Philox block c / 4, normal from Box-Muller on the word pair (c % 2) of
 * block c / 2, where c = offset + k. */
static void philox_fill(float *d, const tdm_tensor *t, int dist, float a, float b, uint64_t seed,
                        uint64_t offset) {
    uint32_t w[4];
    uint64_t block = UINT64_MAX;
    int64_t k = 0;
    FOR_EACH_OFFSET(t, off, {
        uint64_t c = offset + (uint64_t)k++;
        if (dist == 0) {
            if (c / 4 != block) tdm_philox(seed, block = c / 4, 0, w);
            d[off] = a + (b - a) * tdm_u32_to_unit(w[c % 4]);
        } else {
            if (c / 2 != block) tdm_philox(seed, block = c / 2, 1, w);
            uint32_t *p = &w[2 * (c % 2)];
            double u1 = ((double)p[0] + 1.0) / 4294967296.0; /* (0, 1]: log is finite */
            double u2 = (double)p[1] / 4294967296.0;
            d[off] = (float)(a + b * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
        }
    });
}

int tdm_cpu_random(tdm_tensor *dst, int dist, float a, float b, uint64_t seed, uint64_t offset) {
    if (dst->dtype == TDM_F32) {
        philox_fill(tdm_data_ptr(dst), dst, dist, a, b, seed, offset);
        return TDM_OK;
    }
    /* bf16, f16: the f32 draw of the same counters, rounded once, as PyTorch draws a
     * low-precision tensor through its float accumulate type */
    int64_t n = tdm_numel(dst);
    float *tmp = malloc((size_t)(n ? n : 1) * sizeof(float));
    if (!tmp)
        return tdm_raise(TDM_ERR_NOMEM, "random: out of memory for %lld floats", (long long)n);
    tdm_tensor flat = *dst;
    tdm_contiguous_strides(flat.ndim, flat.shape, flat.strides);
    philox_fill(tmp, &flat, dist, a, b, seed, offset);
    void *d = tdm_data_ptr(dst);
    if (!tdm_is_contiguous(dst) || !convert_half(d, dst->dtype, tmp, TDM_F32, (size_t)n)) {
        int64_t k = 0;
        FOR_EACH_OFFSET(dst, off, store(d, dst->dtype, off, tmp[k++]));
    }
    free(tmp);
    return TDM_OK;
}
