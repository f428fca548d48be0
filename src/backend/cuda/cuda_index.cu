/* CUDA indexing: index_select and its gradient index_add, and the check of user indices that
 * they and the cross-entropy (cuda_loss.cu) run before writing anything.
 *
 * Determinism: in index_add one thread owns a column of gx and adds gy's rows in increasing
 * i, as the CPU does, or, for a long index, of a chunk of them (index_add_part_kernel): no
 * float atomics. index_select moves any dtype's bits; index_add takes
 * gy in f32, bf16 or f16 and gx in gy's dtype or f32, summing in f32 (a low-precision gx
 * through an f32 copy, so that each of its elements is rounded once). */
#include "backend/cuda/cuda_common.cuh"

#include <assert.h>

/* Records the first position whose index is outside [0, n) (ignore: exempt value). */
__global__ void check_index_kernel(unsigned long long *bad, const void *idx, bool i64,
                                   int64_t stride, int64_t k, int64_t n, bool use_ignore,
                                   int64_t ignore) {
    CU_LOOP(i, k) {
        int64_t v = cu_index_at(idx, i64, stride, i);
        if (use_ignore && v == ignore) continue;
        if (v < 0 || v >= n) atomicMin(bad, (unsigned long long)i);
    }
}

/* Checks every index before anything is written (as the CPU does). Waits for the stream:
 * the error must reach the caller of this op, not a later one. The values live in device
 * memory, so unlike their dtype and shape (checked by the op) only the kernel can check
 * them: this check stays here. */
int cu_check_indices(cu_device *d, const tdm_tensor *idx, int64_t k, int64_t n, int dim,
                     const char *op, bool use_ignore, int64_t ignore) {
    int index = idx->device.index;
    assert(idx->dtype == TDM_I32 || idx->dtype == TDM_I64); /* the op refused other dtypes */
    if (k == 0) return TDM_OK;
    bool i64 = idx->dtype == TDM_I64;
    int64_t stride = idx->ndim ? idx->strides[0] : 0;
    cu_graph *g = d->capture;
    if (g && g->n_checks == CU_GRAPH_CHECKS)
        return tdm_raise(TDM_ERR_STATE, "%s on cuda:%d: more than %d index checks in one graph", op,
                         index, CU_GRAPH_CHECKS);
    /* recording: the check gets its own word, read when the graph is launched */
    unsigned long long *bad = g ? g->bad_dev + g->n_checks : d->bad_dev;
    if (cu_check(cudaMemsetAsync(bad, 0xff, sizeof *bad, d->compute), "resetting the index flag",
                 index))
        return tdm_last_status();
    check_index_kernel<<<cu_blocks(k), CU_THREADS, 0, d->compute>>>(
        bad, tdm_cuda_ptr(idx), i64, stride, k, n, use_ignore, ignore);
    if (cu_check_launch(op, index)) return tdm_last_status();
    if (g) {
        g->checks[g->n_checks++] =
            (cu_graph_check){op, tdm_cuda_ptr(idx), i64, use_ignore, stride, n, dim};
        return TDM_OK;
    }
    long long pos;
    if (cu_bad_read(d, index, &pos)) return tdm_last_status();
    if (pos < 0) return TDM_OK;
    return cu_index_error(op, (long long)cu_index_to_host(idx, pos), pos, dim, n, use_ignore);
}

int cu_index_error(const char *op, long long v, long long pos, int dim, int64_t n,
                   bool use_ignore) {
    if (use_ignore)
        return tdm_raise(TDM_ERR_ARG,
                         "%s: target %lld (sample %lld) is out of range for C = %lld classes", op,
                         v, pos, (long long)n);
    return tdm_raise(TDM_ERR_ARG,
                     "%s: index %lld (position %lld) is out of range for dim %d of size %lld", op,
                     v, pos, dim, (long long)n);
}

/* y [outer, k, inner] = x [outer, n, inner] picked by idx; es-byte elements. */
template <typename T>
__global__ void index_select_kernel(T *y, const T *x, const void *idx, bool i64, int64_t ist,
                                    int64_t outer, int64_t k, int64_t n, int64_t inner) {
    CU_LOOP(e, outer * k * inner) {
        int64_t j = e % inner, i = (e / inner) % k, o = e / (inner * k);
        y[e] = x[(o * n + cu_index_at(idx, i64, ist, i)) * inner + j];
    }
}

extern "C" int tdm_cuda_index_select(tdm_tensor *y, const tdm_tensor *x, int dim,
                                     const tdm_tensor *idx) {
    assert(tdm_is_contiguous(x) && tdm_is_contiguous(y) && x->dtype == y->dtype); /* the op's */
    int64_t outer, n, inner, k = tdm_numel(idx);
    cu_split_dim(x, dim, &outer, &n, &inner);
    cu_device *d = cu_dev_of(x, "index_select");
    if (!d) return tdm_last_status();
    if (cu_check_indices(d, idx, k, n, dim, "index_select", false, 0)) return tdm_last_status();
    int64_t total = outer * k * inner;
    if (total == 0) return TDM_OK;
    bool i64 = idx->dtype == TDM_I64;
    int64_t ist = idx->ndim ? idx->strides[0] : 0;
    const void *ip = tdm_cuda_ptr(idx);
    if (tdm_dtype_size(x->dtype) == 2) /* bf16, f16: the bits */
        index_select_kernel<uint16_t><<<cu_blocks(total), CU_THREADS, 0, d->compute>>>(
            (uint16_t *)tdm_cuda_ptr(y), (const uint16_t *)tdm_cuda_ptr(x), ip, i64, ist, outer, k,
            n, inner);
    else if (tdm_dtype_size(x->dtype) == 8)
        index_select_kernel<int64_t><<<cu_blocks(total), CU_THREADS, 0, d->compute>>>(
            (int64_t *)tdm_cuda_ptr(y), (const int64_t *)tdm_cuda_ptr(x), ip, i64, ist, outer, k, n,
            inner);
    else
        index_select_kernel<int32_t><<<cu_blocks(total), CU_THREADS, 0, d->compute>>>(
            (int32_t *)tdm_cuda_ptr(y), (const int32_t *)tdm_cuda_ptr(x), ip, i64, ist, outer, k, n,
            inner);
    return cu_check_launch("index_select", x->device.index);
}

/* One thread per (o, j) column adds gy's k rows in increasing i: a repeated index sums in
 * the same order on every run, with no atomics. */
template <typename T>
__global__ void index_add_kernel(float *gx, const T *gy, const void *idx, bool i64, int64_t ist,
                                 int64_t outer, int64_t k, int64_t n, int64_t inner) {
    CU_LOOP(e, outer * inner) {
        int64_t o = e / inner, j = e % inner;
        for (int64_t i = 0; i < k; i++)
            gx[(o * n + cu_index_at(idx, i64, ist, i)) * inner + j] +=
                cu_ld(gy[(o * k + i) * inner + j]);
    }
}

/* A long index (an embedding's backward over every token of a batch) in chunks of
 * INDEX_ADD_ROWS, each chunk's sums into its own zeroed copy of gx (thread (c, o, j) owns column
 * j of chunk c's), then each element of gx adds its chunks' in chunk order: a fixed order,
 * and parallel over the chunks, where one thread a column looped over every row (bench/
 * RESULTS.md, "GPU check ... mixed precision"). At most INDEX_ADD_PART_BYTES of copies: a
 * large table takes fewer, longer chunks. */
#define INDEX_ADD_ROWS       256
#define INDEX_ADD_PART_BYTES (64ll << 20)
template <typename T>
__global__ void index_add_part_kernel(float *part, const T *gy, const void *idx, bool i64,
                                      int64_t ist, int64_t outer, int64_t k, int64_t n,
                                      int64_t inner, int64_t chunks, int64_t rows) {
    CU_LOOP(e, chunks * outer * inner) {
        const int64_t c = e / (outer * inner), o = e / inner % outer, j = e % inner;
        float *dst = part + c * outer * n * inner;
        for (int64_t r = 0; r < n; r++) dst[(o * n + r) * inner + j] = 0.0f;
        const int64_t end = (c + 1) * rows < k ? (c + 1) * rows : k;
        for (int64_t i = c * rows; i < end; i++)
            dst[(o * n + cu_index_at(idx, i64, ist, i)) * inner + j] +=
                cu_ld(gy[(o * k + i) * inner + j]);
    }
}

__global__ void index_add_fold_kernel(float *gx, const float *part, int64_t chunks, int64_t m) {
    CU_LOOP(e, m) {
        float s = gx[e];
        for (int64_t c = 0; c < chunks; c++) s += part[c * m + e];
        gx[e] = s;
    }
}

/* A low-precision gx into its f32 copy (cu_narrow_kernel takes it back). */
template <typename T> __global__ void widen_kernel(float *dst, const T *src, int64_t n) {
    CU_LOOP(i, n) dst[i] = cu_ld(src[i]);
}

template <typename T>
static int index_add_launch(cu_device *d, tdm_tensor *gx, const tdm_tensor *idx,
                            const tdm_tensor *gy, int64_t outer, int64_t k, int64_t n,
                            int64_t inner) {
    int index = gx->device.index;
    int64_t nx = tdm_numel(gx);
    tdm_storage *hold = NULL;
    float *acc =
        gx->dtype == TDM_F32 ? cu_f(gx) : (float *)cu_scratch(index, sizeof(float) * nx, &hold);
    if (!acc) return tdm_last_status();
    if (hold) widen_kernel<T><<<cu_blocks(nx), CU_THREADS, 0, d->compute>>>(acc, cu_p<T>(gx), nx);
    const bool i64 = idx->dtype == TDM_I64;
    const int64_t ist = idx->ndim ? idx->strides[0] : 0, most = INDEX_ADD_PART_BYTES / (4 * nx);
    int64_t chunks = (k + INDEX_ADD_ROWS - 1) / INDEX_ADD_ROWS;
    chunks = chunks > most ? most : chunks;
    tdm_storage *phold = NULL;
    float *part = NULL;
    if (chunks > 1 &&
        !(part = (float *)cu_scratch(index, sizeof(float) * (size_t)(chunks * nx), &phold)))
        tdm_clear_error(); /* no memory for the copies: the one-pass kernel needs none */
    if (part) {
        const int64_t rows = (k + chunks - 1) / chunks;
        index_add_part_kernel<T><<<cu_blocks(chunks * outer * inner), CU_THREADS, 0, d->compute>>>(
            part, cu_p<T>(gy), tdm_cuda_ptr(idx), i64, ist, outer, k, n, inner, chunks, rows);
        index_add_fold_kernel<<<cu_blocks(nx), CU_THREADS, 0, d->compute>>>(acc, part, chunks, nx);
        tdm_storage_release(phold); /* in stream order: the kernels above run first */
    } else {
        index_add_kernel<T><<<cu_blocks(outer * inner), CU_THREADS, 0, d->compute>>>(
            acc, cu_p<T>(gy), tdm_cuda_ptr(idx), i64, ist, outer, k, n, inner);
    }
    if (hold)
        cu_narrow_kernel<T><<<cu_blocks(nx), CU_THREADS, 0, d->compute>>>(cu_p<T>(gx), acc, nx);
    int rc = cu_check_launch("index_add", index);
    if (hold) tdm_storage_release(hold); /* in stream order: the kernels above run first */
    return rc;
}

extern "C" int tdm_cuda_index_add(tdm_tensor *gx, int dim, const tdm_tensor *idx,
                                  const tdm_tensor *gy) {
    assert(tdm_is_contiguous(gx) && tdm_is_contiguous(gy)); /* index_select's backward's */
    if (cu_check_float("index_add", false, {gx, gy})) return tdm_last_status();
    if (gx->dtype != gy->dtype && gx->dtype != TDM_F32)
        return tdm_raise(TDM_ERR_DTYPE, "cuda index_add: gy %s into gx %s (gx must be %s or f32)",
                         tdm_dtype_name(gy->dtype), tdm_dtype_name(gx->dtype),
                         tdm_dtype_name(gy->dtype));
    int64_t outer, n, inner, k = tdm_numel(idx);
    cu_split_dim(gx, dim, &outer, &n, &inner);
    cu_device *d = cu_dev_of(gx, "index_add");
    if (!d) return tdm_last_status();
    if (cu_check_indices(d, idx, k, n, dim, "index_add", false, 0)) return tdm_last_status();
    if (outer * inner == 0 || k == 0) return TDM_OK;
    return CU_DISPATCH(gy->dtype, index_add_launch, d, gx, idx, gy, outer, k, n, inner);
}
