/* CUDA 2-D convolution (im2col + cuBLAS strided-batched GEMM; the row-major to column-major
 * swap of operands is explained in cuda_matmul.cu).
 *
 * Convolution works on chunks of images: im2col writes col [nb, K, P] (K = Cin*kh*kw rows
 * ordered (c, ki, kj), P = Ho*Wo output pixels), and one strided-batched GEMM per group
 * multiplies it with the weights straight into the NCHW output. Backward reverses it: the
 * weight gradient is a batched GEMM per image summed over images in order (no atomics), the
 * input gradient a batched GEMM into col followed by a gather (col2im) where each input
 * pixel adds the columns that read it in a fixed order. A 1x1, stride-1, unpadded
 * convolution skips im2col: the image is its own col. */
#include "backend/cuda/cuda_common.cuh"
/* after cuda_common.cuh, which includes the C headers for nvcc */
#include "backend/conv_geom.h"

#include <assert.h>
#include <limits.h>
#include <math.h>

#define COL_BUDGET_BYTES ((size_t)256 << 20) /* col scratch per chunk of images */

/* ---- convolution ------------------------------------------------------------------------- */

/* col [nb, K, P] of images [n0, n0 + nb): zero where the window leaves the image. */
__global__ void im2col_kernel(float *col, const float *x, conv_geom g, int64_t n0, int64_t nb) {
    CU_LOOP(e, nb * g.k * g.p) {
        int64_t p = e % g.p, kk = (e / g.p) % g.k, img = n0 + e / (g.p * g.k);
        int64_t j = kk % g.kw, i = (kk / g.kw) % g.kh, c = kk / (g.kw * g.kh);
        int64_t oh = p / g.wo, ow = p % g.wo;
        int64_t ih = oh * g.sh - g.ph + i * g.dh, iw = ow * g.sw - g.pw + j * g.dw;
        bool in = ih >= 0 && ih < g.h && iw >= 0 && iw < g.w;
        col[e] = in ? x[((img * g.cin + c) * g.h + ih) * g.w + iw] : 0.0f;
    }
}

/* gx of images [n0, n0 + nb) from their col gradients: each input pixel adds, in (ki, kj)
 * order, the column entries that read it. Overwrites gx. */
__global__ void col2im_kernel(float *gx, const float *col, conv_geom g, int64_t n0, int64_t nb) {
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
        gx[((n0 + img) * g.cin + c) * g.h * g.w + ih * g.w + iw] = s;
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
    /* bf16 and f16 convolutions are not written yet (issue 37): refused, not misread */
    if (x->dtype != TDM_F32 || w->dtype != TDM_F32)
        return tdm_raise(TDM_ERR_DTYPE,
                         "cuda %s: x %s and w %s: only f32 convolutions exist on "
                         "CUDA so far",
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

extern "C" int tdm_cuda_conv2d(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w,
                               const tdm_tensor *b, const tdm_conv2d_args *args) {
    conv_geom g = tdm_conv_geom(x, w, y->shape[2], y->shape[3], args);
    if (check_conv("conv2d", x, w, &g)) return tdm_last_status();
    cu_device *d = cu_dev_of(x, "conv2d");
    if (!d) return tdm_last_status();
    int index = x->device.index;
    if (g.n == 0 || g.cout == 0 || g.p == 0) return TDM_OK;
    if (g.k_g == 0) return tdm_cuda_fill(y, 0.0);
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
__global__ void bias_grad_kernel(float *gb, const float *gy, int64_t cout, int64_t p, int64_t n) {
    __shared__ double sh[CU_THREADS];
    int64_t co = blockIdx.x, m = n * p;
    double s = 0;
    for (int64_t e = threadIdx.x; e < m; e += blockDim.x)
        s += gy[((e / p) * cout + co) * p + e % p];
    s = cu_block_sum(s, sh);
    if (threadIdx.x == 0) gb[co] = (float)s;
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

extern "C" int tdm_cuda_conv2d_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                        const tdm_tensor *gy, const tdm_tensor *x,
                                        const tdm_tensor *w, const tdm_conv2d_args *args) {
    conv_geom g = tdm_conv_geom(x, w, gy->shape[2], gy->shape[3], args);
    if (check_conv("conv2d_backward", x, w, &g)) return tdm_last_status();
    cu_device *d = cu_dev_of(x, "conv2d_backward");
    if (!d) return tdm_last_status();
    int index = x->device.index;
    if (gb) {
        if (g.n * g.p == 0 || g.cout > INT32_MAX) {
            if (tdm_cuda_fill(gb, 0.0)) return tdm_last_status();
        } else if (g.cout > 0) {
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
