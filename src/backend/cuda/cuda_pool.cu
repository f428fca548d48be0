/* CUDA 2-D max and average pooling with PyTorch's window rules, as cpu_pool.c: one output
 * (forward) or one input pixel (backward, gathering the windows that cover it) per thread, so
 * no float atomics. */
#include "backend/cuda/cuda_common.cuh"
/* after cuda_common.cuh, which includes the C headers for nvcc */
#include "backend/conv_geom.h"

#include <assert.h>

/* The contract: the op (nn/functional_pool.c) refused an input that is not 4-D and hands
 * contiguous [N, C, H, W] tensors of equal N and C. */
[[maybe_unused]] static inline bool planes_match(const tdm_tensor *a, const tdm_tensor *b) {
    return a->ndim == 4 && b->ndim == 4 && a->shape[0] == b->shape[0] &&
           a->shape[1] == b->shape[1] && tdm_is_contiguous(a) && tdm_is_contiguous(b);
}

/* One output per thread; the scan order and NaN rule of the CPU's max_plane (a NaN always
 * replaces the best so far), so indices agree exactly. */
template <typename T> __global__ void max_pool_kernel(T *y, int32_t *idx, const T *x, pool_geom g) {
    CU_LOOP(e, g.planes * g.ho * g.wo) {
        int64_t ow = e % g.wo, oh = (e / g.wo) % g.ho, pl = e / (g.wo * g.ho);
        const T *xp = x + pl * g.h * g.w;
        int64_t h0 = oh * g.sh - g.ph, h1 = h0 + (g.kh - 1) * g.dh + 1;
        if (h1 > g.h) h1 = g.h;
        while (h0 < 0) h0 += g.dh;
        int64_t w0 = ow * g.sw - g.pw, w1 = w0 + (g.kw - 1) * g.dw + 1;
        if (w1 > g.w) w1 = g.w;
        while (w0 < 0) w0 += g.dw;
        int64_t bi = h0 * g.w + w0;
        float best = -INFINITY;
        for (int64_t ih = h0; ih < h1; ih += g.dh)
            for (int64_t iw = w0; iw < w1; iw += g.dw) {
                float v = cu_ld(xp[ih * g.w + iw]);
                if (v > best || v != v) best = v, bi = ih * g.w + iw;
            }
        y[e] = cu_to<T>(best);
        idx[e] = (int32_t)bi;
    }
}

template <typename T>
static void max_pool_launch(cu_device *d, tdm_tensor *y, tdm_tensor *idx, const tdm_tensor *x,
                            pool_geom g, int64_t n) {
    max_pool_kernel<T><<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(
        cu_p<T>(y), (int32_t *)tdm_cuda_ptr(idx), cu_p<T>(x), g);
}

extern "C" int tdm_cuda_max_pool2d(tdm_tensor *y, tdm_tensor *idx, const tdm_tensor *x,
                                   const tdm_pool2d_args *args) {
    assert(planes_match(x, y) && planes_match(x, idx) && idx->dtype == TDM_I32);
    if (cu_check_float("max_pool2d", true, {x, y})) return tdm_last_status();
    cu_device *d = cu_dev_of(x, "max_pool2d");
    if (!d) return tdm_last_status();
    pool_geom g = tdm_pool_geom(x, y, args);
    int64_t n = g.planes * g.ho * g.wo;
    if (n == 0) return TDM_OK;
    CU_DISPATCH(x->dtype, max_pool_launch, d, y, idx, x, g, n);
    return cu_check_launch("max_pool2d", x->device.index);
}

/* Output rows whose window (stride s, pad p, extent ext) can contain input row i. */
__device__ __forceinline__ void out_range(int64_t i, int64_t s, int64_t p, int64_t ext, int64_t out,
                                          int64_t *lo, int64_t *hi) {
    int64_t a = i + p - ext + 1; /* o*s >= a */
    *lo = a <= 0 ? 0 : (a + s - 1) / s;
    int64_t b = (i + p) / s; /* o*s <= i + p (i + p >= 0) */
    *hi = b < out - 1 ? b : out - 1;
}

/* One thread per (image, channel) plane adds its outputs' gradients at their indices in
 * output order, exactly as the CPU loop does: overlapping windows can name one pixel several
 * times, and a fixed order keeps the sum deterministic without atomics. The kernel gets no
 * window geometry, so a thread per input pixel could not find its outputs cheaply. */
template <typename T>
__global__ void max_pool_bwd_kernel(float *gx, const T *gy, const int32_t *idx, int64_t planes,
                                    int64_t in_plane, int64_t out_plane) {
    CU_LOOP(pl, planes) {
        float *d = gx + pl * in_plane;
        const T *s = gy + pl * out_plane;
        const int32_t *ix = idx + pl * out_plane;
        for (int64_t q = 0; q < out_plane; q++)
            if (ix[q] >= 0 && ix[q] < in_plane) d[ix[q]] += cu_ld(s[q]); /* our own: trusted */
    }
}

/* Overlapping windows add several gradients into one element: a bf16 or f16 gx sums them in
 * an f32 copy and is rounded once at the end. */
template <typename T>
static int max_pool_bwd_launch(cu_device *d, tdm_tensor *gx, const tdm_tensor *gy,
                               const tdm_tensor *idx, int64_t planes) {
    int index = gx->device.index;
    int64_t nx = tdm_numel(gx);
    tdm_storage *hold = NULL;
    float *acc =
        gx->dtype == TDM_F32 ? cu_f(gx) : (float *)cu_scratch(index, sizeof(float) * nx, &hold);
    if (!acc || cu_check(cudaMemsetAsync(acc, 0, sizeof(float) * nx, d->compute),
                         "max_pool2d_backward", index)) {
        if (hold) tdm_storage_release(hold);
        return tdm_last_status();
    }
    max_pool_bwd_kernel<T><<<cu_blocks(planes), CU_THREADS, 0, d->compute>>>(
        acc, cu_p<T>(gy), (const int32_t *)tdm_cuda_ptr(idx), planes, gx->shape[2] * gx->shape[3],
        gy->shape[2] * gy->shape[3]);
    if (hold)
        cu_narrow_kernel<T><<<cu_blocks(nx), CU_THREADS, 0, d->compute>>>(cu_p<T>(gx), acc, nx);
    int rc = cu_check_launch("max_pool2d_backward", index);
    if (hold) tdm_storage_release(hold); /* in stream order: the kernels above run first */
    return rc;
}

extern "C" int tdm_cuda_max_pool2d_backward(tdm_tensor *gx, const tdm_tensor *gy,
                                            const tdm_tensor *idx) {
    assert(planes_match(gx, gy) && planes_match(gx, idx));
    if (cu_check_float("max_pool2d_backward", true, {gx, gy})) return tdm_last_status();
    cu_device *d = cu_dev_of(gx, "max_pool2d_backward");
    if (!d) return tdm_last_status();
    if (tdm_cuda_fill(gx, 0.0)) return tdm_last_status();
    int64_t planes = gx->shape[0] * gx->shape[1];
    if (planes == 0 || tdm_numel(gy) == 0) return TDM_OK;
    return CU_DISPATCH(gx->dtype, max_pool_bwd_launch, d, gx, gy, idx, planes);
}

/* The clipped window of output (oh, ow) and its divisor (cpu_pool.c avg_window). */
__device__ bool avg_window(const pool_geom &g, int64_t oh, int64_t ow, int64_t *h0, int64_t *h1,
                           int64_t *w0, int64_t *w1, float *inv) {
    int64_t hs = oh * g.sh - g.ph, ws = ow * g.sw - g.pw;
    int64_t he = hs + g.kh, we = ws + g.kw;
    if (he > g.h + g.ph) he = g.h + g.ph;
    if (we > g.w + g.pw) we = g.w + g.pw;
    int64_t pool = (he - hs) * (we - ws);
    if (hs < 0) hs = 0;
    if (ws < 0) ws = 0;
    if (he > g.h) he = g.h;
    if (we > g.w) we = g.w;
    if (hs >= he || ws >= we) return false;
    *h0 = hs, *h1 = he, *w0 = ws, *w1 = we;
    *inv = 1.0f / (float)(g.include_pad ? pool : (he - hs) * (we - ws));
    return true;
}

template <typename T> __global__ void avg_pool_kernel(T *y, const T *x, pool_geom g) {
    CU_LOOP(e, g.planes * g.ho * g.wo) {
        int64_t ow = e % g.wo, oh = (e / g.wo) % g.ho, pl = e / (g.wo * g.ho);
        const T *xp = x + pl * g.h * g.w;
        int64_t h0, h1, w0, w1;
        float inv, acc = 0.0f;
        if (avg_window(g, oh, ow, &h0, &h1, &w0, &w1, &inv)) {
            for (int64_t ih = h0; ih < h1; ih++)
                for (int64_t iw = w0; iw < w1; iw++) acc += cu_ld(xp[ih * g.w + iw]);
            acc *= inv;
        }
        y[e] = cu_to<T>(acc);
    }
}

template <typename T> __global__ void avg_pool_bwd_kernel(T *gx, const T *gy, pool_geom g) {
    CU_LOOP(e, g.planes * g.h * g.w) {
        int64_t q = e % (g.h * g.w), pl = e / (g.h * g.w);
        int64_t ih = q / g.w, iw = q % g.w, oh0, oh1, ow0, ow1;
        out_range(ih, g.sh, g.ph, g.kh, g.ho, &oh0, &oh1);
        out_range(iw, g.sw, g.pw, g.kw, g.wo, &ow0, &ow1);
        const T *gp = gy + pl * g.ho * g.wo;
        float s = 0.0f;
        for (int64_t oh = oh0; oh <= oh1; oh++)
            for (int64_t ow = ow0; ow <= ow1; ow++) {
                int64_t h0, h1, w0, w1;
                float inv;
                if (avg_window(g, oh, ow, &h0, &h1, &w0, &w1, &inv) && ih >= h0 && ih < h1 &&
                    iw >= w0 && iw < w1)
                    s += cu_ld(gp[oh * g.wo + ow]) * inv;
            }
        gx[e] = cu_to<T>(s);
    }
}

template <typename T>
static void avg_pool_launch(cu_device *d, tdm_tensor *y, const tdm_tensor *x, pool_geom g,
                            int64_t n) {
    avg_pool_kernel<T><<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_p<T>(y), cu_p<T>(x), g);
}

template <typename T>
static void avg_pool_bwd_launch(cu_device *d, tdm_tensor *gx, const tdm_tensor *gy, pool_geom g,
                                int64_t n) {
    avg_pool_bwd_kernel<T>
        <<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_p<T>(gx), cu_p<T>(gy), g);
}

extern "C" int tdm_cuda_avg_pool2d(tdm_tensor *y, const tdm_tensor *x,
                                   const tdm_pool2d_args *args) {
    assert(planes_match(x, y));
    if (cu_check_float("avg_pool2d", true, {x, y})) return tdm_last_status();
    cu_device *d = cu_dev_of(x, "avg_pool2d");
    if (!d) return tdm_last_status();
    pool_geom g = tdm_pool_geom(x, y, args);
    int64_t n = g.planes * g.ho * g.wo;
    if (n == 0) return TDM_OK;
    CU_DISPATCH(x->dtype, avg_pool_launch, d, y, x, g, n);
    return cu_check_launch("avg_pool2d", x->device.index);
}

extern "C" int tdm_cuda_avg_pool2d_backward(tdm_tensor *gx, const tdm_tensor *gy,
                                            const tdm_pool2d_args *args) {
    assert(planes_match(gx, gy));
    if (cu_check_float("avg_pool2d_backward", true, {gx, gy})) return tdm_last_status();
    cu_device *d = cu_dev_of(gx, "avg_pool2d_backward");
    if (!d) return tdm_last_status();
    pool_geom g = tdm_pool_geom(gx, gy, args);
    int64_t n = g.planes * g.h * g.w;
    if (n == 0) return TDM_OK;
    CU_DISPATCH(gx->dtype, avg_pool_bwd_launch, d, gx, gy, g, n);
    return cu_check_launch("avg_pool2d_backward", gx->device.index);
}
