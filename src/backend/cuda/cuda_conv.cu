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
 * bf16 and f16 (autocast's convolutions): x, w, b, y and their gradients in the one dtype;
 * col holds it too, so the products run on the tensor cores (cublasGemmStridedBatchedEx, f32
 * accumulation) into f32 scratch: y gets its bias and is rounded once, the weight gradient
 * sums its images and chunks in f32 and is rounded once, the input gradient is gathered from
 * f32 columns and rounded once, as the f32 kernels on the same values. */
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

__global__ void add_bias_kernel(float *y, const float *b, int64_t cout, int64_t p, int64_t n) {
    CU_LOOP(e, n) y[e] += b[(e / p) % cout];
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

/* One strided-batched GEMM, named for errors. */
static int gemm(cu_device *d, int index, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                int64_t n, int64_t k, const float *a, int64_t lda, int64_t sa, const float *b,
                int64_t ldb, int64_t sb, float *c, int64_t ldc, int64_t sc, int64_t batch,
                const char *what) {
    const float one = 1.0f, zero = 0.0f;
    return cu_check_blas(cublasSgemmStridedBatched(d->blas, ta, tb, (int)m, (int)n, (int)k, &one, a,
                                                   (int)lda, sa, b, (int)ldb, sb, &zero, c,
                                                   (int)ldc, sc, (int)batch),
                         what, index);
}

/* ---- bf16 and f16 ---------------------------------------------------------------------- */

/* One strided-batched GEMM with operands of dtype t and an f32 product (f32 accumulation). */
static int gemm_low(cu_device *d, int index, cudaDataType t, cublasOperation_t ta,
                    cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void *a,
                    int64_t lda, int64_t sa, const void *b, int64_t ldb, int64_t sb, float *c,
                    int64_t ldc, int64_t sc, int64_t batch, const char *what) {
    const float one = 1.0f, zero = 0.0f;
    return cu_check_blas(cublasGemmStridedBatchedEx(d->blas, ta, tb, (int)m, (int)n, (int)k, &one,
                                                    a, t, (int)lda, sa, b, t, (int)ldb, sb, &zero,
                                                    c, CUDA_R_32F, (int)ldc, sc, (int)batch,
                                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                         what, index);
}

/* y [n] = yf (+ b of its channel), rounded once. */
template <typename T>
__global__ void bias_out_kernel(T *y, const float *yf, const T *b, int64_t cout, int64_t p,
                                int64_t n) {
    CU_LOOP(e, n) y[e] = cu_to<T>(yf[e] + (b ? cu_ld(b[(e / p) % cout]) : 0.0f));
}

template <typename T>
static int conv_low(cu_device *d, int index, const conv_geom &g, tdm_tensor *y, const tdm_tensor *x,
                    const tdm_tensor *w, const tdm_tensor *b, cudaDataType t) {
    bool pw = tdm_conv_is_pointwise(&g);
    int64_t nbmax = chunk_images(&g);
    tdm_storage *hc = NULL, *hy = NULL;
    T *col = pw ? NULL : (T *)cu_scratch(index, (size_t)(nbmax * g.k * g.p) * sizeof(T), &hc);
    float *yf = (float *)cu_scratch(index, (size_t)(nbmax * g.cout * g.p) * 4, &hy);
    int rc = (!pw && !col) || !yf ? tdm_last_status() : TDM_OK;
    for (int64_t n0 = 0; n0 < g.n && !rc; n0 += nbmax) {
        int64_t nb = g.n - n0 < nbmax ? g.n - n0 : nbmax;
        const T *src = pw ? cu_p<T>(x) + n0 * g.k * g.p : col;
        if (!pw) {
            im2col_kernel<<<cu_blocks(nb * g.k * g.p), CU_THREADS, 0, d->compute>>>(col, cu_p<T>(x),
                                                                                    g, n0, nb);
            if ((rc = cu_check_launch("conv2d im2col", index))) break;
        }
        for (int64_t gi = 0; gi < g.groups && !rc; gi++)
            rc = gemm_low(d, index, t, CUBLAS_OP_N, CUBLAS_OP_N, g.p, g.cout_g, g.k_g,
                          src + gi * g.k_g * g.p, g.p, g.k * g.p,
                          cu_p<T>(w) + gi * g.cout_g * g.k_g, g.k_g, 0, yf + gi * g.cout_g * g.p,
                          g.p, g.cout * g.p, nb, "conv2d (cublasGemmStridedBatchedEx)");
        if (rc) break;
        int64_t len = nb * g.cout * g.p;
        bias_out_kernel<T><<<cu_blocks(len), CU_THREADS, 0, d->compute>>>(
            cu_p<T>(y) + n0 * g.cout * g.p, yf, b ? cu_p<T>(b) : NULL, g.cout, g.p, len);
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
    cu_device *d = cu_dev_of(x, "conv2d");
    if (!d) return tdm_last_status();
    int index = x->device.index;
    if (g.n == 0 || g.cout == 0 || g.p == 0) return TDM_OK;
    if (g.k_g == 0) return tdm_cuda_fill(y, 0.0);
    if (x->dtype != TDM_F32) {
        if (y->dtype != x->dtype || (b && b->dtype != x->dtype))
            return tdm_raise(TDM_ERR_DTYPE, "cuda conv2d: y %s and b %s for x %s: one dtype",
                             tdm_dtype_name(y->dtype), b ? tdm_dtype_name(b->dtype) : "none",
                             tdm_dtype_name(x->dtype));
        return x->dtype == TDM_BF16 ? conv_low<__nv_bfloat16>(d, index, g, y, x, w, b, CUDA_R_16BF)
                                    : conv_low<__half>(d, index, g, y, x, w, b, CUDA_R_16F);
    }
    bool pw = tdm_conv_is_pointwise(&g);
    int64_t nbmax = chunk_images(&g);
    tdm_storage *hold = NULL;
    float *col = pw ? NULL : (float *)cu_scratch(index, (size_t)(nbmax * g.k * g.p) * 4, &hold);
    if (!pw && !col) return tdm_last_status();
    int rc = TDM_OK;
    for (int64_t n0 = 0; n0 < g.n && !rc; n0 += nbmax) {
        int64_t nb = g.n - n0 < nbmax ? g.n - n0 : nbmax;
        const float *src = pw ? cu_f(x) + n0 * g.k * g.p : col;
        if (!pw) {
            im2col_kernel<<<cu_blocks(nb * g.k * g.p), CU_THREADS, 0, d->compute>>>(col, cu_f(x), g,
                                                                                    n0, nb);
            if ((rc = cu_check_launch("conv2d im2col", index))) break;
        }
        /* y_n,g [cout_g, P] = w_g [cout_g, K_g] @ col_n,g [K_g, P] */
        for (int64_t gi = 0; gi < g.groups && !rc; gi++)
            rc = gemm(d, index, CUBLAS_OP_N, CUBLAS_OP_N, g.p, g.cout_g, g.k_g,
                      src + gi * g.k_g * g.p, g.p, g.k * g.p, cu_f(w) + gi * g.cout_g * g.k_g,
                      g.k_g, 0, cu_f(y) + n0 * g.cout * g.p + gi * g.cout_g * g.p, g.p,
                      g.cout * g.p, nb, "conv2d (cublasSgemmStridedBatched)");
    }
    if (hold) tdm_storage_release(hold);
    if (rc || !b) return rc;
    int64_t total = g.n * g.cout * g.p;
    add_bias_kernel<<<cu_blocks(total), CU_THREADS, 0, d->compute>>>(cu_f(y), cu_f(b), g.cout, g.p,
                                                                     total);
    return cu_check_launch("conv2d bias", index);
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

/* gw [len] (+)= sum over nb per-image partials tmp [nb, len], images in order. */
__global__ void sum_images_kernel(float *gw, const float *tmp, int64_t nb, int64_t len,
                                  bool accumulate) {
    CU_LOOP(j, len) {
        double s = accumulate ? gw[j] : 0.0;
        for (int64_t i = 0; i < nb; i++) s += tmp[i * len + j];
        gw[j] = (float)s;
    }
}

/* The weight and input gradients of images [n0, n0 + nb). */
static int conv_bwd_chunk(cu_device *d, int index, const conv_geom *g, int64_t n0, int64_t nb,
                          tdm_tensor *gx, tdm_tensor *gw, const tdm_tensor *gy, const tdm_tensor *x,
                          const tdm_tensor *w, float *col, float *tmp) {
    bool pw = tdm_conv_is_pointwise(g);
    const float *dy = cu_f(gy) + n0 * g->cout * g->p;
    if (gw) {
        const float *src = pw ? cu_f(x) + n0 * g->k * g->p : col;
        if (!pw) {
            im2col_kernel<<<cu_blocks(nb * g->k * g->p), CU_THREADS, 0, d->compute>>>(col, cu_f(x),
                                                                                      *g, n0, nb);
            if (cu_check_launch("conv2d_backward im2col", index)) return tdm_last_status();
        }
        /* tmp_n [cout_g, K_g] (group gi's rows) = dy_n,g [cout_g, P] @ col_n,g^T [P, K_g] */
        for (int64_t gi = 0; gi < g->groups; gi++)
            if (gemm(d, index, CUBLAS_OP_T, CUBLAS_OP_N, g->k_g, g->cout_g, g->p,
                     src + gi * g->k_g * g->p, g->p, g->k * g->p, dy + gi * g->cout_g * g->p, g->p,
                     g->cout * g->p, tmp + gi * g->cout_g * g->k_g, g->k_g, g->cout * g->k_g, nb,
                     "conv2d_backward weights"))
                return tdm_last_status();
        int64_t len = g->cout * g->k_g;
        sum_images_kernel<<<cu_blocks(len), CU_THREADS, 0, d->compute>>>(cu_f(gw), tmp, nb, len,
                                                                         n0 > 0);
        if (cu_check_launch("conv2d_backward weight sum", index)) return tdm_last_status();
    }
    if (gx) {
        /* col_n,g [K_g, P] = w_g^T [K_g, cout_g] @ dy_n,g [cout_g, P]; pointwise: into gx */
        float *dst = pw ? cu_f(gx) + n0 * g->k * g->p : col;
        for (int64_t gi = 0; gi < g->groups; gi++)
            if (gemm(d, index, CUBLAS_OP_N, CUBLAS_OP_T, g->p, g->k_g, g->cout_g,
                     dy + gi * g->cout_g * g->p, g->p, g->cout * g->p,
                     cu_f(w) + gi * g->cout_g * g->k_g, g->k_g, 0, dst + gi * g->k_g * g->p, g->p,
                     g->k * g->p, nb, "conv2d_backward input"))
                return tdm_last_status();
        if (!pw) {
            col2im_kernel<<<cu_blocks(nb * g->cin * g->h * g->w), CU_THREADS, 0, d->compute>>>(
                cu_f(gx), col, *g, n0, nb);
            if (cu_check_launch("conv2d_backward col2im", index)) return tdm_last_status();
        }
    }
    return TDM_OK;
}

/* The low-precision backward of images [n0, n0 + nb): gwf (f32, summed over chunks) and gx. */
template <typename T>
static int conv_bwd_low_chunk(cu_device *d, int index, cudaDataType t, const conv_geom *g,
                              int64_t n0, int64_t nb, tdm_tensor *gx, float *gwf,
                              const tdm_tensor *gy, const tdm_tensor *x, const tdm_tensor *w,
                              T *col, float *colf, float *tmp) {
    bool pw = tdm_conv_is_pointwise(g);
    const T *dy = cu_p<T>(gy) + n0 * g->cout * g->p;
    if (gwf) {
        const T *src = pw ? cu_p<T>(x) + n0 * g->k * g->p : col;
        if (!pw) {
            im2col_kernel<<<cu_blocks(nb * g->k * g->p), CU_THREADS, 0, d->compute>>>(
                col, cu_p<T>(x), *g, n0, nb);
            if (cu_check_launch("conv2d_backward im2col", index)) return tdm_last_status();
        }
        for (int64_t gi = 0; gi < g->groups; gi++)
            if (gemm_low(d, index, t, CUBLAS_OP_T, CUBLAS_OP_N, g->k_g, g->cout_g, g->p,
                         src + gi * g->k_g * g->p, g->p, g->k * g->p, dy + gi * g->cout_g * g->p,
                         g->p, g->cout * g->p, tmp + gi * g->cout_g * g->k_g, g->k_g,
                         g->cout * g->k_g, nb, "conv2d_backward weights"))
                return tdm_last_status();
        int64_t len = g->cout * g->k_g;
        sum_images_kernel<<<cu_blocks(len), CU_THREADS, 0, d->compute>>>(gwf, tmp, nb, len, n0 > 0);
        if (cu_check_launch("conv2d_backward weight sum", index)) return tdm_last_status();
    }
    if (gx) {
        /* colf_n,g [K_g, P] = w_g^T @ dy_n,g, in f32; pointwise: gx's images themselves */
        for (int64_t gi = 0; gi < g->groups; gi++)
            if (gemm_low(d, index, t, CUBLAS_OP_N, CUBLAS_OP_T, g->p, g->k_g, g->cout_g,
                         dy + gi * g->cout_g * g->p, g->p, g->cout * g->p,
                         cu_p<T>(w) + gi * g->cout_g * g->k_g, g->k_g, 0, colf + gi * g->k_g * g->p,
                         g->p, g->k * g->p, nb, "conv2d_backward input"))
                return tdm_last_status();
        int64_t len = nb * g->cin * g->h * g->w;
        if (pw)
            cu_narrow_kernel<T><<<cu_blocks(len), CU_THREADS, 0, d->compute>>>(
                cu_p<T>(gx) + n0 * g->k * g->p, colf, len);
        else
            col2im_kernel<<<cu_blocks(len), CU_THREADS, 0, d->compute>>>(cu_p<T>(gx), colf, *g, n0,
                                                                         nb);
        if (cu_check_launch("conv2d_backward col2im", index)) return tdm_last_status();
    }
    return TDM_OK;
}

template <typename T>
static int conv_bwd_low(cu_device *d, int index, cudaDataType t, const conv_geom &g, tdm_tensor *gx,
                        tdm_tensor *gw, const tdm_tensor *gy, const tdm_tensor *x,
                        const tdm_tensor *w) {
    int64_t nbmax = chunk_images(&g), lw = g.cout * g.k_g;
    bool pw = tdm_conv_is_pointwise(&g);
    tdm_storage *h[4] = {NULL, NULL, NULL, NULL};
    T *col =
        !pw && gw ? (T *)cu_scratch(index, (size_t)(nbmax * g.k * g.p) * sizeof(T), &h[0]) : NULL;
    float *colf = gx ? (float *)cu_scratch(index, (size_t)(nbmax * g.k * g.p) * 4, &h[1]) : NULL;
    float *tmp = gw ? (float *)cu_scratch(index, (size_t)(nbmax * lw) * 4, &h[2]) : NULL;
    float *gwf = gw ? (float *)cu_scratch(index, (size_t)lw * 4, &h[3]) : NULL;
    int rc =
        (!pw && gw && !col) || (gx && !colf) || (gw && (!tmp || !gwf)) ? tdm_last_status() : TDM_OK;
    for (int64_t n0 = 0; n0 < g.n && !rc; n0 += nbmax) {
        int64_t nb = g.n - n0 < nbmax ? g.n - n0 : nbmax;
        rc = conv_bwd_low_chunk<T>(d, index, t, &g, n0, nb, gx, gwf, gy, x, w, col, colf, tmp);
    }
    if (!rc && gw) {
        cu_narrow_kernel<T><<<cu_blocks(lw), CU_THREADS, 0, d->compute>>>(cu_p<T>(gw), gwf, lw);
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
            if (gy->dtype == TDM_BF16)
                bias_grad_kernel<<<(unsigned)g.cout, cu_row_threads(g.n * g.p), 0, d->compute>>>(
                    cu_p<__nv_bfloat16>(gb), cu_p<__nv_bfloat16>(gy), g.cout, g.p, g.n);
            else if (gy->dtype == TDM_F16)
                bias_grad_kernel<<<(unsigned)g.cout, cu_row_threads(g.n * g.p), 0, d->compute>>>(
                    cu_p<__half>(gb), cu_p<__half>(gy), g.cout, g.p, g.n);
            else
                bias_grad_kernel<<<(unsigned)g.cout, cu_row_threads(g.n * g.p), 0, d->compute>>>(
                    cu_f(gb), cu_f(gy), g.cout, g.p, g.n);
            if (cu_check_launch("conv2d_backward bias", index)) return tdm_last_status();
        }
    }
    if (g.n * g.p == 0 || g.k_g == 0 || g.cout == 0) { /* empty sums: zero gradients */
        if ((gx && tdm_cuda_fill(gx, 0.0)) || (gw && tdm_cuda_fill(gw, 0.0)))
            return tdm_last_status();
        return TDM_OK;
    }
    if (!gx && !gw) return TDM_OK;
    if (x->dtype != TDM_F32)
        return x->dtype == TDM_BF16
                   ? conv_bwd_low<__nv_bfloat16>(d, index, CUDA_R_16BF, g, gx, gw, gy, x, w)
                   : conv_bwd_low<__half>(d, index, CUDA_R_16F, g, gx, gw, gy, x, w);
    int64_t nbmax = chunk_images(&g);
    tdm_storage *hc = NULL, *ht = NULL;
    float *col = NULL, *tmp = NULL;
    if (!tdm_conv_is_pointwise(&g) &&
        !(col = (float *)cu_scratch(index, (size_t)(nbmax * g.k * g.p) * 4, &hc)))
        return tdm_last_status();
    if (gw && !(tmp = (float *)cu_scratch(index, (size_t)(nbmax * g.cout * g.k_g) * 4, &ht))) {
        if (hc) tdm_storage_release(hc);
        return tdm_last_status();
    }
    int rc = TDM_OK;
    for (int64_t n0 = 0; n0 < g.n && !rc; n0 += nbmax) {
        int64_t nb = g.n - n0 < nbmax ? g.n - n0 : nbmax;
        rc = conv_bwd_chunk(d, index, &g, n0, nb, gx, gw, gy, x, w, col, tmp);
    }
    if (hc) tdm_storage_release(hc);
    if (ht) tdm_storage_release(ht);
    return rc;
}
