/* Differentiable 2-D convolution (NCHW): argument checks, output shapes as PyTorch computes
 * them, and the tape nodes. The arithmetic is in the backend's kernels (cpu_conv.c,
 * cuda_conv.cu); pooling is functional_pool.c. */
#include "tandem/nn.h"

#include <stdint.h>
#include <stdlib.h>

#include "autograd/ops.h"

static tdm_conv2d_args conv_args(const tdm_conv2d_opts *o) {
    tdm_conv2d_opts d = {0};
    if (!o) o = &d;
    tdm_conv2d_args a = {
        .stride_h = o->stride_h ? o->stride_h : 1,
        .stride_w = o->stride_w ? o->stride_w : 1,
        .pad_h = o->pad_h,
        .pad_w = o->pad_w,
        .dilation_h = o->dilation_h ? o->dilation_h : 1,
        .dilation_w = o->dilation_w ? o->dilation_w : 1,
        .groups = o->groups ? o->groups : 1,
    };
    return a;
}

/* Ho = (H + 2*pad - dilation*(k-1) - 1) / stride + 1, with the error PyTorch gives when the
 * (dilated) kernel does not fit the padded input. */
static int conv_out_size(const char *op, const char *dim, int64_t in, int64_t k, int pad,
                         int stride, int dil, int64_t *out) {
    int64_t span = (int64_t)dil * (k - 1) + 1, padded = in + 2 * (int64_t)pad;
    if (span > padded)
        return tdm_raise(TDM_ERR_SHAPE,
                         "%s: kernel %s %lld (dilated to %lld) is larger than the padded input "
                         "%s %lld: output size would be < 1",
                         op, dim, (long long)k, (long long)span, dim, (long long)padded);
    *out = (padded - span) / stride + 1;
    return TDM_OK;
}

static int conv_check(const tdm_tensor *x, const tdm_tensor *w, const tdm_tensor *b,
                      const tdm_conv2d_args *a, int64_t *ho, int64_t *wo) {
    const char *op = "conv2d";
    char sx[96], sw[96], sb[96];
    tdm_shape_str(tdm_shape_of(x), sx);
    tdm_shape_str(tdm_shape_of(w), sw);
    if (tdm_check_float(x, op) || tdm_check_float(w, op) || (b && tdm_check_float(b, op)) ||
        tdm_check_same_device(x, w, op) || (b && tdm_check_same_device(x, b, op)) ||
        tdm_check_same_dtype(x, w, b, op))
        return tdm_last_status();
    if (x->ndim != 4)
        return tdm_raise(TDM_ERR_SHAPE, "conv2d: input must be 4-D [N, C, H, W], got %s", sx);
    if (w->ndim != 4)
        return tdm_raise(TDM_ERR_SHAPE,
                         "conv2d: weight must be 4-D [Cout, Cin/groups, kh, kw], "
                         "got %s",
                         sw);
    if (a->stride_h < 1 || a->stride_w < 1 || a->pad_h < 0 || a->pad_w < 0 || a->dilation_h < 1 ||
        a->dilation_w < 1 || a->groups < 1)
        return tdm_raise(TDM_ERR_ARG,
                         "conv2d: stride (%d, %d), padding (%d, %d), dilation "
                         "(%d, %d) and groups %d must be positive (padding >= 0)",
                         a->stride_h, a->stride_w, a->pad_h, a->pad_w, a->dilation_h, a->dilation_w,
                         a->groups);
    int64_t cin = x->shape[1], cout = w->shape[0];
    if (cin % a->groups || cout % a->groups)
        return tdm_raise(TDM_ERR_SHAPE,
                         "conv2d: groups %d must divide the input channels (%lld, "
                         "input %s) and output channels (%lld, weight %s)",
                         a->groups, (long long)cin, sx, (long long)cout, sw);
    if (w->shape[1] * a->groups != cin)
        return tdm_raise(TDM_ERR_SHAPE,
                         "conv2d: weight %s with groups %d expects %lld input "
                         "channels, but input %s has %lld",
                         sw, a->groups, (long long)(w->shape[1] * a->groups), sx, (long long)cin);
    if (b && (b->ndim != 1 || b->shape[0] != cout))
        return tdm_raise(TDM_ERR_SHAPE, "conv2d: bias must be [%lld] for weight %s, got %s",
                         (long long)cout, sw, tdm_shape_str(tdm_shape_of(b), sb));
    if (conv_out_size(op, "height", x->shape[2], w->shape[2], a->pad_h, a->stride_h, a->dilation_h,
                      ho) ||
        conv_out_size(op, "width", x->shape[3], w->shape[3], a->pad_w, a->stride_w, a->dilation_w,
                      wo))
        return tdm_last_status();
    return TDM_OK;
}

/* in: x [N, Cin, H, W], w, b (or NULL); ctx: tdm_conv2d_args */
static int conv2d_backward(tdm_node *n, tdm_tensor *gy) {
    tdm_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    const tdm_conv2d_args *a = n->ctx;
    tdm_tensor *gx = NULL, *gw = NULL, *gb = NULL;
    if (tdm_node_wants(n, 0) && !(gx = tdm_tensor_alloc(tdm_shape_of(x), x->dtype, x->device)))
        return tdm_last_status();
    if (tdm_node_wants(n, 1) && !(gw = tdm_tensor_alloc(tdm_shape_of(w), w->dtype, w->device)))
        return tdm_last_status();
    if (tdm_node_wants(n, 2) && !(gb = tdm_tensor_alloc(tdm_shape_of(b), b->dtype, b->device)))
        return tdm_last_status();
    int rc = tdm_backend_for(x->device)->conv2d_backward(gx, gw, gb, gy, x, w, a);
    if (rc) return rc;
    if (gx && (rc = tdm_grad_accumulate(x, gx))) return rc;
    if (gw && (rc = tdm_grad_accumulate(w, gw))) return rc;
    if (gb && (rc = tdm_grad_accumulate(b, gb))) return rc;
    return TDM_OK;
}

tdm_tensor *tdm_conv2d(tdm_tensor *x, tdm_tensor *w, tdm_tensor *b, const tdm_conv2d_opts *o) {
    if (!x || !w) return tdm_null_arg("conv2d", x ? "weight" : "input");
    tdm_tensor *in0[3] = {x, w, b};
    TDM_AUTOCAST_SCOPED(3, in0, tdm_conv2d(x, w, b, o));
    tdm_autocast_list l = TDM_AC_LOW; /* PyTorch's lower-precision list, on both devices */
    if (!(x = tdm_autocast_arg(x, l)) || !(w = tdm_autocast_arg(w, l))) return NULL;
    if (b && !(b = tdm_autocast_arg(b, l))) return NULL;
    tdm_conv2d_args a = conv_args(o);
    int64_t ho = 0, wo = 0;
    if (conv_check(x, w, b, &a, &ho, &wo)) return NULL;
    const tdm_backend *be = tdm_backend_for(x->device);
    if (!be) return NULL;
    /* kernels want dense memory; tdm_contiguous is a no-op for dense tensors and keeps the
     * gradient flowing to a strided view */
    tdm_tensor *xc = tdm_contiguous(x), *wc = tdm_contiguous(w), *bc = b ? tdm_contiguous(b) : NULL;
    tdm_tensor *y = NULL;
    if (xc && wc && (!b || bc))
        y = tdm_tensor_alloc(TDM_SHAPE(x->shape[0], w->shape[0], ho, wo), x->dtype, x->device);
    tdm_tensor *in[3] = {xc, wc, bc};
    bool ok = y && be->conv2d(y, xc, wc, bc, &a) == TDM_OK;
    bool record = ok && tdm_needs_record(3, in);
    if (record) {
        tdm_node *n = tdm_record("conv2d", conv2d_backward, y, 3, in);
        tdm_conv2d_args *ctx = n ? tdm_scope_alloc(sizeof *ctx) : NULL;
        if (ctx) {
            *ctx = a;
            n->ctx = ctx;
        }
        ok = ctx != NULL;
    }
    if (!record || !ok) tdm_drop_temp(xc, x), tdm_drop_temp(wc, w), tdm_drop_temp(bc, b);
    return ok ? y : tdm_drop_fail(y);
}
