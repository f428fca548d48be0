/* Differentiable 2-D max, average and adaptive average pooling (NCHW): argument checks,
 * output shapes as PyTorch computes them, and the tape nodes. The arithmetic is in the
 * backend's kernels (cpu_pool.c, cuda_pool.cu); adaptive pooling is two matrix products. */
#include "tandem/nn.h"

#include <stdint.h>
#include <stdlib.h>

#include "autograd/ops.h"

static tdm_pool2d_args pool_args(const tdm_pool2d_opts *o) {
    tdm_pool2d_args a = {
        .kernel_h = o->kernel_h,
        .kernel_w = o->kernel_w,
        .stride_h = o->stride_h ? o->stride_h : o->kernel_h,
        .stride_w = o->stride_w ? o->stride_w : o->kernel_w,
        .pad_h = o->pad_h,
        .pad_w = o->pad_w,
        .dilation_h = o->dilation_h ? o->dilation_h : 1,
        .dilation_w = o->dilation_w ? o->dilation_w : 1,
        .ceil_mode = o->ceil_mode,
        .count_include_pad = o->count_include_pad,
    };
    return a;
}

/* PyTorch's pooling_output_shape: floor or ceil division, and in ceil mode the last window
 * must start inside the input or its left padding. */
static int64_t pool_out_size(int64_t in, int64_t k, int64_t pad, int64_t stride, int64_t dil,
                             bool ceil_mode) {
    int64_t num = in + 2 * pad - dil * (k - 1) - 1 + (ceil_mode ? stride - 1 : 0);
    int64_t q = num >= 0 ? num / stride : -((-num + stride - 1) / stride); /* floor */
    int64_t out = q + 1;
    if (ceil_mode && (out - 1) * stride >= in + pad) out--;
    return out;
}

static int pool_check(const char *op, const tdm_tensor *x, const tdm_pool2d_args *a, bool is_max,
                      int64_t *ho, int64_t *wo) {
    char sx[96];
    tdm_shape_str(tdm_shape_of(x), sx);
    if (tdm_check_float(x, op)) return tdm_last_status();
    if (x->ndim != 4)
        return tdm_raise(TDM_ERR_SHAPE, "%s: input must be 4-D [N, C, H, W], got %s", op, sx);
    if (a->kernel_h < 1 || a->kernel_w < 1 || a->stride_h < 1 || a->stride_w < 1 || a->pad_h < 0 ||
        a->pad_w < 0 || a->dilation_h < 1 || a->dilation_w < 1)
        return tdm_raise(TDM_ERR_ARG,
                         "%s: kernel (%d, %d), stride (%d, %d) and dilation (%d, %d) "
                         "must be positive and padding (%d, %d) >= 0",
                         op, a->kernel_h, a->kernel_w, a->stride_h, a->stride_w, a->dilation_h,
                         a->dilation_w, a->pad_h, a->pad_w);
    if (!is_max && (a->dilation_h != 1 || a->dilation_w != 1))
        return tdm_raise(TDM_ERR_ARG, "%s: dilation is for max pooling only, got (%d, %d)", op,
                         a->dilation_h, a->dilation_w);
    if (is_max && x->shape[2] * x->shape[3] > INT32_MAX) /* the indices are int32 */
        return tdm_raise(TDM_ERR_SHAPE, "%s: input %s has planes of 2^31 pixels or more", op, sx);
    /* PyTorch: padding at most half the (dilated, for max) kernel, so no window is all pad */
    int64_t eh = is_max ? (int64_t)(a->kernel_h - 1) * a->dilation_h + 1 : a->kernel_h;
    int64_t ew = is_max ? (int64_t)(a->kernel_w - 1) * a->dilation_w + 1 : a->kernel_w;
    if (a->pad_h > eh / 2 || a->pad_w > ew / 2)
        return tdm_raise(TDM_ERR_ARG,
                         "%s: padding (%d, %d) must be at most half the kernel "
                         "size (%lld, %lld)",
                         op, a->pad_h, a->pad_w, (long long)eh, (long long)ew);
    *ho =
        pool_out_size(x->shape[2], a->kernel_h, a->pad_h, a->stride_h, a->dilation_h, a->ceil_mode);
    *wo =
        pool_out_size(x->shape[3], a->kernel_w, a->pad_w, a->stride_w, a->dilation_w, a->ceil_mode);
    if (*ho < 1 || *wo < 1)
        return tdm_raise(TDM_ERR_SHAPE,
                         "%s: input %s with kernel (%d, %d), stride (%d, %d), "
                         "padding (%d, %d) gives output size %lldx%lld (< 1)",
                         op, sx, a->kernel_h, a->kernel_w, a->stride_h, a->stride_w, a->pad_h,
                         a->pad_w, (long long)*ho, (long long)*wo);
    return TDM_OK;
}

/* in: x; saved[0]: indices (i32, shape of y) */
static int max_pool2d_backward(tdm_node *n, tdm_tensor *gy) {
    tdm_tensor *x = n->in[0];
    tdm_tensor *gx = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (!gx) return tdm_last_status();
    int rc = tdm_backend_for(x->device)->max_pool2d_backward(gx, gy, n->saved[0]);
    return rc ? rc : tdm_grad_accumulate(x, gx);
}

/* in: x; ctx: tdm_pool2d_args */
static int avg_pool2d_backward(tdm_node *n, tdm_tensor *gy) {
    tdm_tensor *x = n->in[0];
    tdm_tensor *gx = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device);
    if (!gx) return tdm_last_status();
    int rc = tdm_backend_for(x->device)->avg_pool2d_backward(gx, gy, n->ctx);
    return rc ? rc : tdm_grad_accumulate(x, gx);
}

static tdm_tensor *pool2d(const char *op, tdm_tensor *x, const tdm_pool2d_opts *o, bool is_max) {
    if (!x || !o) return tdm_null_arg(op, x ? "options" : "input");
    tdm_pool2d_args a = pool_args(o);
    int64_t ho = 0, wo = 0;
    if (pool_check(op, x, &a, is_max, &ho, &wo)) return NULL;
    const tdm_backend *be = tdm_backend_for(x->device);
    if (!be) return NULL;
    tdm_shape ys = TDM_SHAPE(x->shape[0], x->shape[1], ho, wo);
    tdm_tensor *xc = tdm_contiguous(x);
    tdm_tensor *y = xc ? tdm_tensor_alloc(ys, x->dtype, x->device) : NULL;
    tdm_tensor *idx = y && is_max ? tdm_tensor_alloc(ys, TDM_I32, x->device) : NULL;
    bool ok = y && (!is_max || idx) &&
              (is_max ? be->max_pool2d(y, idx, xc, &a) : be->avg_pool2d(y, xc, &a)) == TDM_OK;
    bool record = ok && tdm_needs_record(1, &xc);
    if (record) {
        tdm_node *n = tdm_record(op, is_max ? max_pool2d_backward : avg_pool2d_backward, y, 1, &xc);
        tdm_pool2d_args *ctx = n ? tdm_scope_alloc(sizeof *ctx) : NULL;
        if (ctx) {
            *ctx = a;
            n->ctx = ctx;
            n->saved[0] = idx;
        }
        ok = ctx != NULL;
    }
    if (!record || !ok) tdm_drop_temp(xc, x), tdm_drop_temp(idx, NULL);
    return ok ? y : tdm_drop_fail(y);
}

tdm_tensor *tdm_max_pool2d(tdm_tensor *x, const tdm_pool2d_opts *o) {
    return pool2d("max_pool2d", x, o, true);
}

tdm_tensor *tdm_avg_pool2d(tdm_tensor *x, const tdm_pool2d_opts *o) {
    return pool2d("avg_pool2d", x, o, false);
}

/* ---- adaptive average pooling ------------------------------------------------------------- */

/* P [out, in] as a host array: row i averages input positions [floor(i*in/out),
 * ceil((i+1)*in/out)), PyTorch's bins (they overlap when in % out != 0). */
static float *bin_matrix(int64_t in, int64_t out) {
    float *p = calloc((size_t)(in * out), sizeof *p);
    for (int64_t i = 0; p && i < out; i++) {
        int64_t lo = i * in / out, hi = ((i + 1) * in + out - 1) / out;
        for (int64_t j = lo; j < hi; j++) p[i * in + j] = 1.0f / (float)(hi - lo);
    }
    return p;
}

/* y = Ph [oh, H] @ x [N, C, H, W] @ Pw^T [W, ow]: the bins of any size, as two products,
 * in f32 whatever x's dtype (a bin's weight such as 1/3 is no bf16 value; PyTorch's kernel
 * computes in f32 too) with autocast off, the result in x's dtype. */
static tdm_tensor *adaptive_by_matmul(tdm_tensor *x, int64_t oh, int64_t ow) {
    if (x->dtype != TDM_F32) {
        tdm_tensor *xf = tdm_to_dtype(x, TDM_F32), *y = xf ? adaptive_by_matmul(xf, oh, ow) : NULL;
        return y ? tdm_to_dtype(y, x->dtype) : NULL;
    }
    if (tdm_autocast_dtype() != TDM_F32) {
        if (tdm_autocast_begin(TDM_F32)) return NULL;
        tdm_tensor *y = adaptive_by_matmul(x, oh, ow);
        tdm_autocast_end();
        return y;
    }
    int64_t h = x->shape[2], w = x->shape[3];
    float *ph = bin_matrix(h, oh), *pw = bin_matrix(w, ow);
    tdm_tensor *y = NULL;
    if (!ph || !pw) {
        tdm_raise(TDM_ERR_NOMEM, "adaptive_avg_pool2d: out of memory for the bin matrices");
    } else {
        tdm_tensor *tph = tdm_from_data(TDM_SHAPE(oh, h), TDM_F32, x->device, ph);
        tdm_tensor *tpw = tdm_from_data(TDM_SHAPE(ow, w), TDM_F32, x->device, pw);
        y = tdm_matmul(tdm_matmul(tph, x), tdm_transpose(tpw, 0, 1));
    }
    free(ph);
    free(pw);
    return y;
}

tdm_tensor *tdm_adaptive_avg_pool2d(tdm_tensor *x, int64_t out_h, int64_t out_w) {
    if (!x) return tdm_null_input("adaptive_avg_pool2d");
    char sx[96];
    if (tdm_check_float(x, "adaptive_avg_pool2d")) return NULL;
    if (x->ndim != 4)
        return tdm_raise_null(TDM_ERR_SHAPE,
                              "adaptive_avg_pool2d: input must be 4-D [N, C, H, W], got %s",
                              tdm_tensor_shape_str(x, sx));
    if (out_h < 1 || out_w < 1)
        return tdm_raise_null(TDM_ERR_ARG,
                              "adaptive_avg_pool2d: output size (%lld, %lld) must be positive",
                              (long long)out_h, (long long)out_w);
    int64_t h = x->shape[2], w = x->shape[3];
    if (h < 1 || w < 1)
        return tdm_raise_null(TDM_ERR_SHAPE, "adaptive_avg_pool2d: input %s has no pixels",
                              tdm_tensor_shape_str(x, sx));
    /* Equal bins (always for a global pool, (1, 1)) are a plain average pooling: one pass
     * over x in one kernel, which every backend has. */
    if (h % out_h == 0 && w % out_w == 0 && h / out_h <= INT32_MAX && w / out_w <= INT32_MAX) {
        tdm_pool2d_opts o = {.kernel_h = (int)(h / out_h), .kernel_w = (int)(w / out_w)};
        return tdm_avg_pool2d(x, &o);
    }
    if (!tdm_current_scope()) TDM_RETURN_SCOPED(adaptive_by_matmul(x, out_h, out_w));
    return adaptive_by_matmul(x, out_h, out_w);
}
