/* CUDA reductions: sum/mean/max over one dim, sum_to (un-broadcasting), the max gradient,
 * (log-)softmax and the sum of squares.
 *
 * Determinism: no float atomics. A long row is reduced by one block with a fixed tree
 * (cu_block_sum), otherwise one thread owns an output and adds in index order; sums
 * accumulate in double as on the CPU. The summation order differs from the CPU's, so results
 * agree to rounding (about 1e-6 relative), but each run on a GPU gives the same bits. Every
 * kernel here takes f32, bf16 or f16 (one dtype per call, the arithmetic as for f32, each
 * output rounded once); argmax is i64 and sum_squares gives a double whatever x is. */
#include "backend/cuda/cuda_common.cuh"

#include <assert.h>
#include <math.h>

/* v beats best if larger, or if it is the first NaN (max propagates NaN, as PyTorch). */
__device__ __forceinline__ bool max_beats(float v, float best) {
    return v > best || (v != v && best == best);
}

/* ---- reduce over one dim: x [outer, n, inner] -> y [outer, inner] ------------------------ */

/* One thread per output, k = 0..n-1 in order: exact CPU semantics for max and argmax. */
template <typename T>
__global__ void reduce_cols_kernel(tdm_reduce_op op, T *y, int64_t *am, const T *x, int64_t outer,
                                   int64_t n, int64_t inner, double scale) {
    CU_LOOP(e, outer * inner) {
        int64_t o = e / inner, j = e % inner;
        const T *p = x + o * n * inner + j;
        if (op == TDM_RED_MAX) {
            float best = cu_ld(p[0]);
            int64_t arg = 0;
            for (int64_t k = 1; k < n; k++) {
                float v = cu_ld(p[k * inner]);
                if (max_beats(v, best)) best = v, arg = k;
            }
            y[e] = cu_to<T>(best);
            if (am) am[e] = arg;
        } else {
            double s = 0;
            for (int64_t k = 0; k < n; k++) s += cu_ld(p[k * inner]);
            y[e] = cu_to<T>((float)(s * scale));
        }
    }
}

/* One block per row (inner == 1, long rows). */
template <typename T>
__global__ void reduce_rows_kernel(tdm_reduce_op op, T *y, int64_t *am, const T *x, int64_t n,
                                   double scale) {
    __shared__ double shd[CU_THREADS];
    __shared__ float shv[CU_THREADS];
    __shared__ int64_t shi[CU_THREADS];
    const T *row = x + (int64_t)blockIdx.x * n;
    int t = threadIdx.x;
    if (op != TDM_RED_MAX) {
        double s = 0;
        for (int64_t k = t; k < n; k += blockDim.x) s += cu_ld(row[k]);
        s = cu_block_sum(s, shd);
        if (t == 0) y[blockIdx.x] = cu_to<T>((float)(s * scale));
        return;
    }
    /* each thread scans k = t, t + B, ... keeping its first best; pairs then combine keeping
     * the NaN or the larger value, and the lower index on a tie: the first max overall */
    float best = -INFINITY;
    int64_t arg = n;
    for (int64_t k = t; k < n; k += blockDim.x) {
        float v = cu_ld(row[k]);
        if (arg == n || max_beats(v, best)) best = v, arg = k;
    }
    shv[t] = best;
    shi[t] = arg;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) {
            float a = shv[t], b = shv[t + s];
            int64_t ia = shi[t], ib = shi[t + s];
            bool take_b = ib < n && (ia == n || max_beats(b, a) ||
                                     (ib < ia && (a == b || (a != a && b != b))));
            if (take_b) shv[t] = b, shi[t] = ib;
        }
        __syncthreads();
    }
    if (t == 0) {
        y[blockIdx.x] = cu_to<T>(shv[0]);
        if (am) am[blockIdx.x] = shi[0];
    }
}

template <typename T>
static void reduce_launch(cu_device *d, tdm_reduce_op op, tdm_tensor *y, int64_t *am,
                          const tdm_tensor *x, int64_t outer, int64_t n, int64_t inner,
                          double scale) {
    if (inner == 1 && n >= 256 && outer <= INT32_MAX)
        reduce_rows_kernel<T><<<(unsigned)outer, CU_THREADS, 0, d->compute>>>(op, cu_p<T>(y), am,
                                                                              cu_p<T>(x), n, scale);
    else
        reduce_cols_kernel<T><<<cu_blocks(outer * inner), CU_THREADS, 0, d->compute>>>(
            op, cu_p<T>(y), am, cu_p<T>(x), outer, n, inner, scale);
}

extern "C" int tdm_cuda_reduce(tdm_reduce_op op, tdm_tensor *y, const tdm_tensor *x, int dim,
                               tdm_tensor *argmax) {
    if (op < TDM_RED_SUM || op > TDM_RED_MAX)
        return tdm_raise(TDM_ERR_ARG, "cuda reduce: unknown op %d", (int)op);
    /* the op (autograd/ops_math.c) refused a dim out of range and a max over an empty dim;
     * it hands x contiguous and allocates y (and argmax) for it, y of x's dtype */
    assert(tdm_is_contiguous(x) && tdm_is_contiguous(y));
    if (cu_check_float("reduce", true, {y, x})) return tdm_last_status();
    assert(x->ndim == 0 || (dim >= 0 && dim < x->ndim));
    int64_t outer, n, inner;
    cu_split_dim(x, dim, &outer, &n, &inner);
    assert(tdm_numel(y) == outer * inner);
    assert(op != TDM_RED_MAX || n > 0 || outer * inner == 0);
    assert(op != TDM_RED_MAX || !argmax ||
           (argmax->dtype == TDM_I64 && tdm_is_contiguous(argmax) &&
            tdm_numel(argmax) == outer * inner));
    cu_device *d = cu_dev_of(x, "reduce");
    if (!d) return tdm_last_status();
    if (outer * inner == 0) return TDM_OK;
    double scale = op == TDM_RED_MEAN ? (n ? 1.0 / (double)n : NAN) : 1.0;
    int64_t *am = op == TDM_RED_MAX && argmax ? (int64_t *)tdm_cuda_ptr(argmax) : NULL;
    CU_DISPATCH(x->dtype, reduce_launch, d, op, y, am, x, outer, n, inner, scale);
    return cu_check_launch("reduce", x->device.index);
}

/* ---- sum_to ------------------------------------------------------------------------------ */

/* x's dims split into kept ones (y's dims, in order) and summed ones; strides are x's. */
typedef struct {
    int nk, nr;
    int64_t kshape[TDM_MAX_DIMS], kstride[TDM_MAX_DIMS];
    int64_t rshape[TDM_MAX_DIMS], rstride[TDM_MAX_DIMS];
    int64_t count; /* elements summed per output */
} sum_plan;

__device__ __forceinline__ int64_t plan_off(int n, const int64_t *shape, const int64_t *stride,
                                            int64_t i) {
    int64_t off = 0;
    for (int d = n - 1; d >= 0; d--) {
        off += (i % shape[d]) * stride[d];
        i /= shape[d];
    }
    return off;
}

template <typename T>
__global__ void sum_to_thread_kernel(T *y, const T *x, sum_plan p, int64_t ny) {
    CU_LOOP(j, ny) {
        const T *base = x + plan_off(p.nk, p.kshape, p.kstride, j);
        double s = 0;
        for (int64_t r = 0; r < p.count; r++)
            s += cu_ld(base[plan_off(p.nr, p.rshape, p.rstride, r)]);
        y[j] = cu_to<T>((float)s);
    }
}

template <typename T> __global__ void sum_to_block_kernel(T *y, const T *x, sum_plan p) {
    __shared__ double sh[CU_THREADS];
    const T *base = x + plan_off(p.nk, p.kshape, p.kstride, blockIdx.x);
    double s = 0;
    for (int64_t r = threadIdx.x; r < p.count; r += blockDim.x)
        s += cu_ld(base[plan_off(p.nr, p.rshape, p.rstride, r)]);
    s = cu_block_sum(s, sh);
    if (threadIdx.x == 0) y[blockIdx.x] = cu_to<T>((float)s);
}

/* x [count, ny] summed over its rows (a bias's gradient: the leading dims summed away), in
 * two passes with a fixed order: block (bx, by) sums rows by, by + S, ... of 32 columns, its
 * 8 warps' rows apart and then in warp order, into part [S, ny]; then each column adds its S
 * parts in order. A warp reads 32 adjacent columns of a row (the block-per-column kernel read
 * one element of each row a thread: a third of the memory's speed). */
#define ROWS_WARPS 8
template <typename T>
__global__ void sum_rows_part_kernel(double *part, const T *x, int64_t count, int64_t ny,
                                     int64_t cols) {
    __shared__ double sh[ROWS_WARPS][32];
    /* block (bx, by) of a [S, cols] grid, thread (lane, warp) of [ROWS_WARPS, 32] */
    const int64_t bx = blockIdx.x % cols, by = blockIdx.x / cols, S = gridDim.x / cols;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t col = bx * 32 + lane;
    double s = 0;
    if (col < ny)
        for (int64_t r = by + warp * S; r < count; r += ROWS_WARPS * S) s += cu_ld(x[r * ny + col]);
    sh[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && col < ny) {
        for (int w = 1; w < ROWS_WARPS; w++) s += sh[w][lane];
        part[by * ny + col] = s;
    }
}

template <typename T>
__global__ void sum_rows_fold_kernel(T *y, const double *part, int64_t S, int64_t ny) {
    CU_LOOP(j, ny) {
        double s = 0;
        for (int64_t k = 0; k < S; k++) s += part[k * ny + j];
        y[j] = cu_to<T>((float)s);
    }
}

template <typename T>
static int sum_rows_launch(cu_device *d, tdm_tensor *y, const tdm_tensor *x, int64_t count,
                           int64_t ny) {
    const int index = x->device.index;
    const int64_t cols = (ny + 31) / 32;
    /* about 4 blocks a multiprocessor of an H100 (132), each at least 64 rows */
    int64_t S = (528 + cols - 1) / cols, most = count / 64;
    S = S > most ? most : S;
    S = S < 1 ? 1 : S;
    tdm_storage *hold;
    double *part = (double *)cu_scratch(index, sizeof(double) * (size_t)(S * ny), &hold);
    if (!part) return tdm_last_status();
    sum_rows_part_kernel<T><<<(unsigned)(cols * S), 32 * ROWS_WARPS, 0, d->compute>>>(
        part, cu_p<T>(x), count, ny, cols);
    sum_rows_fold_kernel<T><<<cu_blocks(ny), CU_THREADS, 0, d->compute>>>(cu_p<T>(y), part, S, ny);
    tdm_storage_release(hold); /* in stream order: the kernels above run first */
    return cu_check_launch("sum_to", index);
}

template <typename T>
static void sum_to_launch(cu_device *d, tdm_tensor *y, const tdm_tensor *x, sum_plan p,
                          int64_t ny) {
    if (p.count >= 4096 && ny <= 4096)
        sum_to_block_kernel<T>
            <<<(unsigned)ny, CU_THREADS, 0, d->compute>>>(cu_p<T>(y), cu_p<T>(x), p);
    else
        sum_to_thread_kernel<T>
            <<<cu_blocks(ny), CU_THREADS, 0, d->compute>>>(cu_p<T>(y), cu_p<T>(x), p, ny);
}

extern "C" int tdm_cuda_sum_to(tdm_tensor *y, const tdm_tensor *x) {
    if (cu_check_float("sum_to", true, {y, x})) return tdm_last_status();
    if (!tdm_is_contiguous(x) || !tdm_is_contiguous(y))
        return tdm_raise(TDM_ERR_ARG, "cuda sum_to: x and y must be contiguous");
    int nd = x->ndim, lead = x->ndim - y->ndim;
    int64_t xst[TDM_MAX_DIMS];
    tdm_contiguous_strides(nd, x->shape, xst);
    sum_plan p;
    p.nk = p.nr = 0;
    p.count = 1;
    bool ok = lead >= 0;
    for (int d = 0; ok && d < nd; d++) {
        int64_t yd = d < lead ? 1 : y->shape[d - lead];
        if (d >= lead && yd == x->shape[d]) {
            p.kshape[p.nk] = x->shape[d], p.kstride[p.nk++] = xst[d];
        } else if (yd == 1) {
            p.rshape[p.nr] = x->shape[d], p.rstride[p.nr++] = xst[d];
            p.count *= x->shape[d];
        } else {
            ok = false;
        }
    }
    if (!ok) {
        char sx[96], sy[96];
        return tdm_raise(TDM_ERR_SHAPE, "cuda sum_to: %s does not broadcast to %s",
                         tdm_shape_str(tdm_shape_of(y), sy), tdm_shape_str(tdm_shape_of(x), sx));
    }
    cu_device *d = cu_dev_of(x, "sum_to");
    if (!d) return tdm_last_status();
    int64_t ny = tdm_numel(y);
    if (ny == 0) return TDM_OK;
    /* only leading dims summed (y is x's trailing dims, after dims of 1): x is [count, ny] */
    int kept = nd;
    while (kept > lead && y->shape[kept - 1 - lead] == x->shape[kept - 1]) kept--;
    bool rows = p.count > 1 && ny > 1;
    for (int dd = lead; rows && dd < kept; dd++) rows = y->shape[dd - lead] == 1;
    if (rows) return CU_DISPATCH(x->dtype, sum_rows_launch, d, y, x, p.count, ny);
    if (p.nk == 0) p.nk = 1, p.kshape[0] = 1, p.kstride[0] = 0; /* a scalar result */
    if (p.nr == 0) p.nr = 1, p.rshape[0] = 1, p.rstride[0] = 0; /* nothing summed: a copy */
    CU_DISPATCH(x->dtype, sum_to_launch, d, y, x, p, ny);
    return cu_check_launch("sum_to", x->device.index);
}

/* ---- max backward ------------------------------------------------------------------------ */

template <typename T>
__global__ void max_bwd_kernel(T *gx, const T *gy, const int64_t *am, int64_t outer, int64_t n,
                               int64_t inner) {
    CU_LOOP(e, outer * inner) {
        int64_t o = e / inner, j = e % inner, k = am[e];
        if (k >= 0 && k < n) gx[(o * n + k) * inner + j] = gy[e]; /* our own argmax: trusted */
    }
}

template <typename T>
static void max_bwd_launch(cu_device *d, tdm_tensor *gx, const tdm_tensor *gy,
                           const tdm_tensor *argmax, int64_t outer, int64_t n, int64_t inner) {
    max_bwd_kernel<T><<<cu_blocks(outer * inner), CU_THREADS, 0, d->compute>>>(
        cu_p<T>(gx), cu_p<T>(gy), (const int64_t *)tdm_cuda_ptr(argmax), outer, n, inner);
}

extern "C" int tdm_cuda_max_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *argmax,
                                     int dim) {
    /* the forward op checked dim; its backward hands the forward's argmax and dense tensors */
    assert(argmax->dtype == TDM_I64 && tdm_is_contiguous(gx) && tdm_is_contiguous(gy) &&
           tdm_is_contiguous(argmax));
    assert(gx->ndim == 0 || (dim >= 0 && dim < gx->ndim));
    if (cu_check_float("max_backward", true, {gx, gy})) return tdm_last_status();
    int64_t outer, n, inner;
    cu_split_dim(gx, dim, &outer, &n, &inner);
    assert(tdm_numel(gy) == outer * inner && tdm_numel(argmax) == outer * inner);
    cu_device *d = cu_dev_of(gx, "max_backward");
    if (!d) return tdm_last_status();
    if (tdm_cuda_fill(gx, 0.0)) return tdm_last_status();
    if (outer * inner == 0) return TDM_OK;
    CU_DISPATCH(gx->dtype, max_bwd_launch, d, gx, gy, argmax, outer, n, inner);
    return cu_check_launch("max_backward", gx->device.index);
}

/* ---- softmax over the last dim: one block per row ---------------------------------------- */

template <typename T> __global__ void softmax_kernel(T *y, const T *x, int64_t n, bool is_log) {
    __shared__ float shf[CU_THREADS];
    __shared__ double shd[CU_THREADS];
    const T *xr = x + (int64_t)blockIdx.x * n;
    T *yr = y + (int64_t)blockIdx.x * n;
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = cu_nanmax(m, cu_ld(xr[i]));
    m = cu_block_max(m, shf); /* NaN anywhere: the row is NaN */
    double s = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += expf(cu_ld(xr[i]) - m);
    s = cu_block_sum(s, shd);
    if (is_log) {
        float ls = (float)log(s);
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
            yr[i] = cu_to<T>((cu_ld(xr[i]) - m) - ls);
    } else {
        float inv = (float)(1.0 / s);
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
            yr[i] = cu_to<T>(expf(cu_ld(xr[i]) - m) * inv);
    }
}

template <typename T>
static void softmax_launch(cu_device *d, tdm_tensor *y, const tdm_tensor *x, int64_t n,
                           int64_t rows, bool is_log) {
    softmax_kernel<T>
        <<<(unsigned)rows, cu_row_threads(n), 0, d->compute>>>(cu_p<T>(y), cu_p<T>(x), n, is_log);
}

/* softmax: gx = y * (gy - sum(gy * y)); log-softmax: gx = gy - exp(y) * sum(gy). */
template <typename T>
__global__ void softmax_bwd_kernel(T *gx, const T *gy, const T *y, int64_t n, bool is_log) {
    __shared__ double shd[CU_THREADS];
    int64_t base = (int64_t)blockIdx.x * n;
    double s = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        s +=
            is_log ? (double)cu_ld(gy[base + i]) : (double)cu_ld(gy[base + i]) * cu_ld(y[base + i]);
    float dot = (float)cu_block_sum(s, shd);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float g = cu_ld(gy[base + i]), o = cu_ld(y[base + i]);
        gx[base + i] = cu_to<T>(is_log ? g - expf(o) * dot : o * (g - dot));
    }
}

template <typename T>
static void softmax_bwd_launch(cu_device *d, tdm_tensor *gx, const tdm_tensor *gy,
                               const tdm_tensor *y, int64_t n, int64_t rows, bool is_log) {
    softmax_bwd_kernel<T><<<(unsigned)rows, cu_row_threads(n), 0, d->compute>>>(
        cu_p<T>(gx), cu_p<T>(gy), cu_p<T>(y), n, is_log);
}

/* The contract: one floating dtype, contiguous, one shape (c may be NULL). */
[[maybe_unused]] static inline bool softmax_args_ok(const tdm_tensor *a, const tdm_tensor *b,
                                                    const tdm_tensor *c) {
    const tdm_tensor *ts[3] = {a, b, c};
    for (int i = 0; i < 3 && ts[i]; i++)
        if (!tdm_dtype_is_float(ts[i]->dtype) || ts[i]->dtype != a->dtype ||
            !tdm_is_contiguous(ts[i]) || !tdm_same_shape(ts[i], a))
            return false;
    return true;
}

extern "C" int tdm_cuda_softmax(tdm_tensor *y, const tdm_tensor *x, bool is_log) {
    assert(softmax_args_ok(y, x, NULL));
    cu_device *d = cu_dev_of(x, "softmax");
    if (!d) return tdm_last_status();
    int64_t n = x->ndim ? x->shape[x->ndim - 1] : 1, numel = tdm_numel(x);
    if (numel == 0) return TDM_OK;
    if (numel / n > INT32_MAX) return tdm_raise(TDM_ERR_SHAPE, "cuda softmax: too many rows");
    CU_DISPATCH(x->dtype, softmax_launch, d, y, x, n, numel / n, is_log);
    return cu_check_launch("softmax", x->device.index);
}

extern "C" int tdm_cuda_softmax_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *y,
                                         bool is_log) {
    assert(softmax_args_ok(gx, gy, y));
    cu_device *d = cu_dev_of(gx, "softmax_backward");
    if (!d) return tdm_last_status();
    int64_t n = gx->ndim ? gx->shape[gx->ndim - 1] : 1, numel = tdm_numel(gx);
    if (numel == 0) return TDM_OK;
    if (numel / n > INT32_MAX) return tdm_raise(TDM_ERR_SHAPE, "cuda softmax: too many rows");
    CU_DISPATCH(gx->dtype, softmax_bwd_launch, d, gx, gy, y, n, numel / n, is_log);
    return cu_check_launch("softmax_backward", gx->device.index);
}

/* ---- sum of squares: fixed grid of partial sums, then one block adds them in order ------- */

#define SSQ_BLOCKS 256

template <typename T>
__global__ void ssq_partial_kernel(double *part, const T *x, cu_view v, int64_t n) {
    __shared__ double sh[CU_THREADS];
    double s = 0;
    CU_LOOP(i, n) {
        double a = cu_ld(x[cu_offset(v, i)]);
        s += a * a;
    }
    s = cu_block_sum(s, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

template <typename T>
static void ssq_launch(cu_device *d, unsigned blocks, double *part, const tdm_tensor *x,
                       int64_t n) {
    ssq_partial_kernel<T>
        <<<blocks, CU_THREADS, 0, d->compute>>>(part, cu_p<T>(x), cu_view_of(x), n);
}

__global__ void ssq_final_kernel(double *part, int nparts) {
    __shared__ double sh[CU_THREADS];
    double s = 0;
    for (int i = threadIdx.x; i < nparts; i += blockDim.x) s += part[i];
    s = cu_block_sum(s, sh);
    if (threadIdx.x == 0) part[0] = s;
}

extern "C" int tdm_cuda_sum_squares(double *out, const tdm_tensor *x) {
    if (cu_check_float("sum_squares", true, {x})) return tdm_last_status();
    *out = 0;
    cu_device *d = cu_dev_of(x, "sum_squares");
    if (!d) return tdm_last_status();
    if (d->capture)
        return cu_not_capturable(x->device.index, "sum_squares (gradient clipping)",
                                 "it reads the sum back to the host");
    int64_t n = tdm_numel(x);
    if (n == 0) return TDM_OK;
    tdm_storage *hold;
    double *part = (double *)cu_scratch(x->device.index, SSQ_BLOCKS * sizeof(double), &hold);
    if (!part) return tdm_last_status();
    unsigned blocks = cu_blocks(n) < SSQ_BLOCKS ? cu_blocks(n) : SSQ_BLOCKS;
    CU_DISPATCH(x->dtype, ssq_launch, d, blocks, part, x, n);
    ssq_final_kernel<<<1, CU_THREADS, 0, d->compute>>>(part, (int)blocks);
    int rc = cu_check_launch("sum_squares", x->device.index);
    if (!rc)
        rc =
            cu_check(cudaMemcpyAsync(out, part, sizeof(double), cudaMemcpyDeviceToHost, d->compute),
                     "sum_squares", x->device.index);
    if (!rc) rc = cu_check(cudaStreamSynchronize(d->compute), "sum_squares", x->device.index);
    tdm_storage_release(hold);
    return rc;
}
