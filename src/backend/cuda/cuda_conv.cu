/* CUDA 2-D convolution (im2col + cuBLAS strided-batched GEMM; the row-major to column-major
 * swap of operands is explained in cuda_matmul.cu).
 *
 * Convolution works on chunks of images: im2col writes col [nb, K, P] (K = Cin*kh*kw rows
 * ordered (c, ki, kj), P = Ho*Wo output pixels), and one strided-batched GEMM per group
 * multiplies it with the weights straight into the NCHW output. Backward reverses it: the
 * weight gradient is a batched GEMM per image summed over images in order (no atomics), the
 * input gradient a batched GEMM into col followed by a gather (col2im) where each input
 * pixel adds the columns that read it in a fixed order. A 1x1, stride-1, unpadded
 * convolution skips im2col: the image is its own col.
 *
 * One code for f32, bf16 and f16 (autocast's convolutions), x, w, b, y and their gradients in
 * one dtype: col holds it too, and the products (cublasGemmStridedBatchedEx, f32 accumulation;
 * bf16 and f16 on the tensor cores) go into f32, which for f32 is the output itself and for
 * the low dtypes scratch, rounded once after: y with its bias, the weight gradient summed over
 * images and chunks, the input gradient gathered from its columns. */
#include "backend/cuda/cuda_common.cuh"
/* after cuda_common.cuh, which includes the C headers for nvcc */
#include "backend/conv_geom.h"

#include <assert.h>
#include <limits.h>
#include <math.h>

#define COL_BUDGET_BYTES ((size_t)256 << 20) /* col scratch per chunk of images */

/* ---- convolution ------------------------------------------------------------------------- */

/* col [nb, K, P] of images [n0, n0 + nb): zero where the window leaves the image. */
template <typename T>
__global__ void im2col_kernel(T *col, const T *x, conv_geom g, int64_t n0, int64_t nb) {
    CU_LOOP(e, nb * g.k * g.p) {
        int64_t p = e % g.p, kk = (e / g.p) % g.k, img = n0 + e / (g.p * g.k);
        int64_t j = kk % g.kw, i = (kk / g.kw) % g.kh, c = kk / (g.kw * g.kh);
        int64_t oh = p / g.wo, ow = p % g.wo;
        int64_t ih = oh * g.sh - g.ph + i * g.dh, iw = ow * g.sw - g.pw + j * g.dw;
        bool in = ih >= 0 && ih < g.h && iw >= 0 && iw < g.w;
        col[e] = in ? x[((img * g.cin + c) * g.h + ih) * g.w + iw] : cu_to<T>(0.0f);
    }
}

/* gx of images [n0, n0 + nb) from their col gradients: each input pixel adds, in (ki, kj)
 * order, the column entries that read it. Overwrites gx. */
template <typename T>
__global__ void col2im_kernel(T *gx, const float *col, conv_geom g, int64_t n0, int64_t nb) {
    CU_LOOP(e, nb * g.cin * g.h * g.w) {
        int64_t iw = e % g.w, ih = (e / g.w) % g.h, c = (e / (g.w * g.h)) % g.cin;
        int64_t img = e / (g.w * g.h * g.cin); /* within the chunk */
        const float *cb = col + img * g.k * g.p;
        float s = 0.0f;
        for (int64_t i = 0; i < g.kh; i++) {
            int64_t th = ih + g.ph - i * g.dh; /* = oh * sh */
            if (th < 0 || th % g.sh) continue;
            int64_t oh = th / g.sh;
            if (oh >= g.ho) continue;
            for (int64_t j = 0; j < g.kw; j++) {
                int64_t tw = iw + g.pw - j * g.dw;
                if (tw < 0 || tw % g.sw) continue;
                int64_t ow = tw / g.sw;
                if (ow >= g.wo) continue;
                s += cb[((c * g.kh + i) * g.kw + j) * g.p + oh * g.wo + ow];
            }
        }
        gx[((n0 + img) * g.cin + c) * g.h * g.w + ih * g.w + iw] = cu_to<T>(s);
    }
}

/* Images per chunk so that col stays within the budget (at least one). */
static int64_t chunk_images(const conv_geom *g) {
    size_t per = (size_t)g->k * (size_t)g->p * sizeof(float);
    int64_t nb = per ? (int64_t)(COL_BUDGET_BYTES / per) : g->n;
    return nb < 1 ? 1 : nb > g->n ? g->n : nb;
}

/* The op (nn/functional_conv.c) refused inputs that are not 4-D or whose channels do not
 * split into the groups, and made x and w contiguous: asserted. What only this kernel limits
 * (cuBLAS's int sizes) is an error. */
static int check_conv(const char *op, const tdm_tensor *x, const tdm_tensor *w,
                      const conv_geom *g) {
    assert(x->ndim == 4 && w->ndim == 4 && tdm_is_contiguous(x) && tdm_is_contiguous(w));
    assert(g->cin % g->groups == 0 && g->cout % g->groups == 0 && w->shape[1] == g->cin_g);
    /* one dtype for every tensor of the call (autocast casts them all) */
    if (!tdm_dtype_is_float(x->dtype) || w->dtype != x->dtype)
        return tdm_raise(TDM_ERR_DTYPE, "cuda %s: x %s and w %s: expected one of f32, bf16, f16",
                         op, tdm_dtype_name(x->dtype), tdm_dtype_name(w->dtype));
    if (g->k_g > INT_MAX || g->p > INT_MAX || g->cout_g > INT_MAX || g->n > INT_MAX)
        return tdm_raise(TDM_ERR_SHAPE, "cuda %s: sizes exceed cuBLAS's int range", op);
    return TDM_OK;
}

/* One strided-batched GEMM of operands of dtype t into an f32 product (f32 accumulation; f32
 * operands run cuBLAS's FP32 kernels, without TF32), named for errors. */
static int gemm(cu_device *d, int index, cudaDataType t, cublasOperation_t ta, cublasOperation_t tb,
                int64_t m, int64_t n, int64_t k, const void *a, int64_t lda, int64_t sa,
                const void *b, int64_t ldb, int64_t sb, float *c, int64_t ldc, int64_t sc,
                int64_t batch, const char *what) {
    const float one = 1.0f, zero = 0.0f;
    return cu_check_blas(cu_blas.cublasGemmStridedBatchedEx(
                             d->blas, ta, tb, (int)m, (int)n, (int)k, &one, a, t, (int)lda, sa, b,
                             t, (int)ldb, sb, &zero, c, CUDA_R_32F, (int)ldc, sc, (int)batch,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                         what, index);
}

/* y [n] = yf (+ b of its channel), rounded once; yf may be y itself (f32). */
template <typename T>
__global__ void bias_out_kernel(T *y, const float *yf, const T *b, int64_t cout, int64_t p,
                                int64_t n) {
    CU_LOOP(e, n) y[e] = cu_to<T>(yf[e] + (b ? cu_ld(b[(e / p) % cout]) : 0.0f));
}

/* An f32 buffer that is the tensor's own memory for f32, else none (the caller's scratch). */
template <typename T> static float *as_f32(const tdm_tensor *t, int64_t off) {
    return t && t->dtype == TDM_F32 ? (float *)(void *)cu_p<T>(t) + off : NULL;
}

/* y = conv(x, w) + b in T: the products into y itself (f32) or f32 scratch, the bias added and
 * the result rounded in one pass after them. */
template <typename T>
static int conv_fwd(cu_device *d, int index, cudaDataType t, const conv_geom &g, tdm_tensor *y,
                    const tdm_tensor *x, const tdm_tensor *w, const tdm_tensor *b) {
    bool pw = tdm_conv_is_pointwise(&g), f32 = y->dtype == TDM_F32;
    int64_t nbmax = chunk_images(&g);
    tdm_storage *hc = NULL, *hy = NULL;
    T *col = pw ? NULL : (T *)cu_scratch(index, (size_t)(nbmax * g.k * g.p) * sizeof(T), &hc);
    float *yf = f32 ? NULL : (float *)cu_scratch(index, (size_t)(nbmax * g.cout * g.p) * 4, &hy);
    int rc = (!pw && !col) || (!f32 && !yf) ? tdm_last_status() : TDM_OK;
    for (int64_t n0 = 0; n0 < g.n && !rc; n0 += nbmax) {
        int64_t nb = g.n - n0 < nbmax ? g.n - n0 : nbmax;
        const T *src = pw ? cu_p<T>(x) + n0 * g.k * g.p : col;
        float *out = f32 ? as_f32<T>(y, n0 * g.cout * g.p) : yf;
        if (!pw) {
            im2col_kernel<<<cu_blocks(nb * g.k * g.p), CU_THREADS, 0, d->compute>>>(col, cu_p<T>(x),
                                                                                    g, n0, nb);
            if ((rc = cu_check_launch("conv2d im2col", index))) break;
        }
        /* y_n,g [cout_g, P] = w_g [cout_g, K_g] @ col_n,g [K_g, P] */
        for (int64_t gi = 0; gi < g.groups && !rc; gi++)
            rc = gemm(d, index, t, CUBLAS_OP_N, CUBLAS_OP_N, g.p, g.cout_g, g.k_g,
                      src + gi * g.k_g * g.p, g.p, g.k * g.p, cu_p<T>(w) + gi * g.cout_g * g.k_g,
                      g.k_g, 0, out + gi * g.cout_g * g.p, g.p, g.cout * g.p, nb,
                      "conv2d (cublasGemmStridedBatchedEx)");
        if (rc || (f32 && !b)) continue;
        int64_t len = nb * g.cout * g.p;
        bias_out_kernel<T><<<cu_blocks(len), CU_THREADS, 0, d->compute>>>(
            cu_p<T>(y) + n0 * g.cout * g.p, out, b ? cu_p<T>(b) : NULL, g.cout, g.p, len);
        rc = cu_check_launch("conv2d bias", index);
    }
    if (hc) tdm_storage_release(hc);
    if (hy) tdm_storage_release(hy);
    return rc;
}

extern "C" int tdm_cuda_conv2d(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w,
                               const tdm_tensor *b, const tdm_conv2d_args *args) {
    conv_geom g = tdm_conv_geom(x, w, y->shape[2], y->shape[3], args);
    if (check_conv("conv2d", x, w, &g)) return tdm_last_status();
    if (cu_check_float("conv2d", true, {x, y, b})) return tdm_last_status();
    cu_device *d = cu_dev_of(x, "conv2d");
    if (!d) return tdm_last_status();
    int index = x->device.index;
    if (g.n == 0 || g.cout == 0 || g.p == 0) return TDM_OK;
    if (g.k_g == 0) return tdm_cuda_fill(y, 0.0);
    return x->dtype == TDM_BF16  ? conv_fwd<__nv_bfloat16>(d, index, CUDA_R_16BF, g, y, x, w, b)
           : x->dtype == TDM_F16 ? conv_fwd<__half>(d, index, CUDA_R_16F, g, y, x, w, b)
                                 : conv_fwd<float>(d, index, CUDA_R_32F, g, y, x, w, b);
}

/* gb[co] = sum over images and pixels of gy: one block per output channel. */
template <typename T>
__global__ void bias_grad_kernel(T *gb, const T *gy, int64_t cout, int64_t p, int64_t n) {
    __shared__ double sh[CU_THREADS];
    int64_t co = blockIdx.x, m = n * p;
    double s = 0;
    for (int64_t e = threadIdx.x; e < m; e += blockDim.x)
        s += cu_ld(gy[((e / p) * cout + co) * p + e % p]);
    s = cu_block_sum(s, sh);
    if (threadIdx.x == 0) gb[co] = cu_to<T>((float)s);
}

template <typename T>
static void bias_grad_launch(cu_device *d, const conv_geom &g, tdm_tensor *gb,
                             const tdm_tensor *gy) {
    bias_grad_kernel<T><<<(unsigned)g.cout, cu_row_threads(g.n * g.p), 0, d->compute>>>(
        cu_p<T>(gb), cu_p<T>(gy), g.cout, g.p, g.n);
}

/* gw [len] (+)= sum over nb per-image partials tmp [nb, len], images in order. */
__global__ void sum_images_kernel(float *gw, const float *tmp, int64_t nb, int64_t len,
                                  bool accumulate) {
    CU_LOOP(j, len) {
        double s = accumulate ? gw[j] : 0.0;
        for (int64_t i = 0; i < nb; i++) s += tmp[i * len + j];
        gw[j] = (float)s;
    }
}

/* Scratch of the backward: col (the im2col columns, in T), colf (the input gradient's columns,
 * f32: col itself for f32), tmp (per-image weight gradients) and gwf (the weight gradient
 * summed over chunks, f32: gw itself for f32). */
template <typename T> struct bwd_bufs {
    T *col;
    float *colf, *tmp, *gwf;
};

/* The weight and input gradients of images [n0, n0 + nb). */
template <typename T>
static int conv_bwd_chunk(cu_device *d, int index, cudaDataType t, const conv_geom *g, int64_t n0,
                          int64_t nb, tdm_tensor *gx, bool want_gw, const tdm_tensor *gy,
                          const tdm_tensor *x, const tdm_tensor *w, bwd_bufs<T> s) {
    bool pw = tdm_conv_is_pointwise(g), f32 = gy->dtype == TDM_F32;
    const T *dy = cu_p<T>(gy) + n0 * g->cout * g->p;
    if (want_gw) {
        const T *src = pw ? cu_p<T>(x) + n0 * g->k * g->p : s.col;
        if (!pw) {
            im2col_kernel<<<cu_blocks(nb * g->k * g->p), CU_THREADS, 0, d->compute>>>(
                s.col, cu_p<T>(x), *g, n0, nb);
            if (cu_check_launch("conv2d_backward im2col", index)) return tdm_last_status();
        }
        /* tmp_n [cout_g, K_g] (group gi's rows) = dy_n,g [cout_g, P] @ col_n,g^T [P, K_g] */
        for (int64_t gi = 0; gi < g->groups; gi++)
            if (gemm(d, index, t, CUBLAS_OP_T, CUBLAS_OP_N, g->k_g, g->cout_g, g->p,
                     src + gi * g->k_g * g->p, g->p, g->k * g->p, dy + gi * g->cout_g * g->p, g->p,
                     g->cout * g->p, s.tmp + gi * g->cout_g * g->k_g, g->k_g, g->cout * g->k_g, nb,
                     "conv2d_backward weights"))
                return tdm_last_status();
        int64_t len = g->cout * g->k_g;
        sum_images_kernel<<<cu_blocks(len), CU_THREADS, 0, d->compute>>>(s.gwf, s.tmp, nb, len,
                                                                         n0 > 0);
        if (cu_check_launch("conv2d_backward weight sum", index)) return tdm_last_status();
    }
    if (gx) {
        /* col_n,g [K_g, P] = w_g^T [K_g, cout_g] @ dy_n,g [cout_g, P]; pointwise: gx's images
         * (f32: into gx itself) */
        float *dst = pw && f32 ? as_f32<T>(gx, n0 * g->k * g->p) : s.colf;
        for (int64_t gi = 0; gi < g->groups; gi++)
            if (gemm(d, index, t, CUBLAS_OP_N, CUBLAS_OP_T, g->p, g->k_g, g->cout_g,
                     dy + gi * g->cout_g * g->p, g->p, g->cout * g->p,
                     cu_p<T>(w) + gi * g->cout_g * g->k_g, g->k_g, 0, dst + gi * g->k_g * g->p,
                     g->p, g->k * g->p, nb, "conv2d_backward input"))
                return tdm_last_status();
        int64_t len = nb * g->cin * g->h * g->w;
        if (pw && !f32)
            cu_narrow_kernel<T><<<cu_blocks(len), CU_THREADS, 0, d->compute>>>(
                cu_p<T>(gx) + n0 * g->k * g->p, dst, len);
        else if (!pw)
            col2im_kernel<<<cu_blocks(len), CU_THREADS, 0, d->compute>>>(cu_p<T>(gx), dst, *g, n0,
                                                                         nb);
        if (cu_check_launch("conv2d_backward col2im", index)) return tdm_last_status();
    }
    return TDM_OK;
}

template <typename T>
static int conv_bwd(cu_device *d, int index, cudaDataType t, const conv_geom &g, tdm_tensor *gx,
                    tdm_tensor *gw, const tdm_tensor *gy, const tdm_tensor *x,
                    const tdm_tensor *w) {
    int64_t nbmax = chunk_images(&g), lw = g.cout * g.k_g, cols = nbmax * g.k * g.p;
    bool pw = tdm_conv_is_pointwise(&g), f32 = gy->dtype == TDM_F32;
    tdm_storage *h[4] = {NULL, NULL, NULL, NULL};
    bwd_bufs<T> s = {NULL, NULL, NULL, as_f32<T>(gw, 0)};
    bool need_col = !pw && (gw || (gx && f32)); /* f32: the input gradient's columns too */
    if (need_col) s.col = (T *)cu_scratch(index, (size_t)cols * sizeof(T), &h[0]);
    if (gx && !f32)
        s.colf = (float *)cu_scratch(index, (size_t)cols * 4, &h[1]);
    else if (gx && !pw)
        s.colf = (float *)(void *)s.col;
    if (gw) s.tmp = (float *)cu_scratch(index, (size_t)(nbmax * lw) * 4, &h[2]);
    if (gw && !f32) s.gwf = (float *)cu_scratch(index, (size_t)lw * 4, &h[3]);
    int rc = (need_col && !s.col) || (gx && !f32 && !s.colf) || (gw && (!s.tmp || !s.gwf))
                 ? tdm_last_status()
                 : TDM_OK;
    for (int64_t n0 = 0; n0 < g.n && !rc; n0 += nbmax) {
        int64_t nb = g.n - n0 < nbmax ? g.n - n0 : nbmax;
        rc = conv_bwd_chunk<T>(d, index, t, &g, n0, nb, gx, gw != NULL, gy, x, w, s);
    }
    if (!rc && gw && !f32) { /* the f32 sum rounded once */
        cu_narrow_kernel<T><<<cu_blocks(lw), CU_THREADS, 0, d->compute>>>(cu_p<T>(gw), s.gwf, lw);
        rc = cu_check_launch("conv2d_backward weights", index);
    }
    for (int i = 0; i < 4; i++)
        if (h[i]) tdm_storage_release(h[i]);
    return rc;
}

extern "C" int tdm_cuda_conv2d_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                        const tdm_tensor *gy, const tdm_tensor *x,
                                        const tdm_tensor *w, const tdm_conv2d_args *args) {
    conv_geom g = tdm_conv_geom(x, w, gy->shape[2], gy->shape[3], args);
    if (check_conv("conv2d_backward", x, w, &g)) return tdm_last_status();
    if (cu_check_float("conv2d_backward", true, {x, gy, gx, gw, gb})) return tdm_last_status();
    cu_device *d = cu_dev_of(x, "conv2d_backward");
    if (!d) return tdm_last_status();
    int index = x->device.index;
    if (gb) {
        if (g.n * g.p == 0 || g.cout > INT32_MAX) {
            if (tdm_cuda_fill(gb, 0.0)) return tdm_last_status();
        } else if (g.cout > 0) {
            CU_DISPATCH(gy->dtype, bias_grad_launch, d, g, gb, gy);
            if (cu_check_launch("conv2d_backward bias", index)) return tdm_last_status();
        }
    }
    if (g.n * g.p == 0 || g.k_g == 0 || g.cout == 0) { /* empty sums: zero gradients */
        if ((gx && tdm_cuda_fill(gx, 0.0)) || (gw && tdm_cuda_fill(gw, 0.0)))
            return tdm_last_status();
        return TDM_OK;
    }
    if (!gx && !gw) return TDM_OK;
    return x->dtype == TDM_BF16
               ? conv_bwd<__nv_bfloat16>(d, index, CUDA_R_16BF, g, gx, gw, gy, x, w)
           : x->dtype == TDM_F16 ? conv_bwd<__half>(d, index, CUDA_R_16F, g, gx, gw, gy, x, w)
                                 : conv_bwd<float>(d, index, CUDA_R_32F, g, gx, gw, gy, x, w);
}
