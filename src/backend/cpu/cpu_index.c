/* CPU kernels for index_select and its adjoint index_add.
 *
 * x is viewed as [outer, n, inner] around dim, so a pick along dim copies one contiguous
 * run of `inner` elements per (outer, index) pair: for an embedding lookup (dim 0) that is
 * one memcpy per row.
 */
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_lowp.h"

#include <string.h>

/* idx is 1-D (or a scalar) i32/i64, possibly strided. */
static inline int64_t idx_at(const tdm_tensor *idx, int64_t i) {
    int64_t st = idx->ndim ? idx->strides[0] : 0;
    if (idx->dtype == TDM_I32) return ((const int32_t *)tdm_data_ptr(idx))[i * st];
    return ((const int64_t *)tdm_data_ptr(idx))[i * st];
}

static void around_dim(const tdm_tensor *t, int dim, int64_t *outer, int64_t *inner) {
    *outer = *inner = 1;
    for (int d = 0; d < dim; d++) *outer *= t->shape[d];
    for (int d = dim + 1; d < t->ndim; d++) *inner *= t->shape[d];
}

/* Every index must lie in [0, n): checked before anything is written. The values are data
 * (on a GPU they live in device memory), so unlike the shapes the op cannot check them: this
 * check stays in the kernel, on every backend. */
static int check_indices(const tdm_tensor *idx, int64_t k, int64_t n, int dim, const char *op) {
    for (int64_t i = 0; i < k; i++) {
        int64_t v = idx_at(idx, i);
        if (v < 0 || v >= n)
            return tdm_raise(TDM_ERR_ARG,
                             "%s: index %lld (position %lld) is out of range for dim %d of size "
                             "%lld",
                             op, (long long)v, (long long)i, dim, (long long)n);
    }
    return TDM_OK;
}

int tdm_cpu_index_select(tdm_tensor *y, const tdm_tensor *x, int dim, const tdm_tensor *idx) {
    /* a pick copies bytes, so any one dtype runs here; a conversion (bf16 x, f32 y) widens */
    if (x->dtype != y->dtype && tdm_cpu_lowp_any(2, (const tdm_tensor *[]){y, x}))
        return tdm_cpu_lowp_index_select(y, x, dim, idx);
    int64_t outer, inner, n = x->ndim ? x->shape[dim] : 1, k = tdm_numel(idx);
    around_dim(x, dim, &outer, &inner);
    int rc = check_indices(idx, k, n, dim, "index_select");
    if (rc) return rc;
    size_t es = tdm_dtype_size(x->dtype), run = (size_t)inner * es;
    const char *xp = (const char *)tdm_data_ptr(x);
    char *yp = (char *)tdm_data_ptr(y);
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < k; i++)
            memcpy(yp + (size_t)(o * k + i) * run, xp + (size_t)(o * n + idx_at(idx, i)) * run,
                   run);
    return TDM_OK;
}

int tdm_cpu_index_add(tdm_tensor *gx, int dim, const tdm_tensor *idx, const tdm_tensor *gy) {
    if (tdm_cpu_lowp_any(2, (const tdm_tensor *[]){gx, gy}))
        return tdm_cpu_lowp_index_add(gx, dim, idx, gy);
    int64_t outer, inner, n = gx->ndim ? gx->shape[dim] : 1, k = tdm_numel(idx);
    around_dim(gx, dim, &outer, &inner);
    int rc = check_indices(idx, k, n, dim, "index_add");
    if (rc) return rc;
    float *gp = (float *)tdm_data_ptr(gx);
    const float *src = (const float *)tdm_data_ptr(gy);
    /* increasing i within each outer slice: a repeated index always sums in the same order */
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < k; i++) {
            float *dst = gp + (o * n + idx_at(idx, i)) * inner;
            const float *s = src + (o * k + i) * inner;
            for (int64_t j = 0; j < inner; j++) dst[j] += s[j];
        }
    return TDM_OK;
}
