/* The geometry of a 2-D convolution and of a pooling window, read off the tensors and the op's
 * arguments with PyTorch's defaults (stride 0 means 1 for a convolution and the kernel size
 * for pooling, dilation 0 means 1, groups 0 means 1). The CPU and the CUDA kernels both take
 * it from here, so the two backends cannot disagree on a shape. */
#ifndef TDM_BACKEND_CONV_GEOM_H
#define TDM_BACKEND_CONV_GEOM_H

#include "backend/backend.h"

typedef struct {
    int64_t n, cin, h, w; /* input */
    int64_t cout, kh, kw; /* weight [cout, cin/groups, kh, kw] */
    int64_t ho, wo, p;    /* output plane, p = ho * wo */
    int64_t sh, sw, ph, pw, dh, dw;
    int64_t groups, cin_g, cout_g;
    int64_t k, k_g; /* rows of an im2col matrix: cin * kh * kw, and per group */
} conv_geom;

/* x [N, Cin, H, W], w [Cout, Cin/groups, kh, kw], output plane ho x wo (fixed by the op) */
static inline conv_geom tdm_conv_geom(const tdm_tensor *x, const tdm_tensor *w, int64_t ho,
                                      int64_t wo, const tdm_conv2d_args *a) {
    conv_geom g;
    g.n = x->shape[0], g.cin = x->shape[1], g.h = x->shape[2], g.w = x->shape[3];
    g.cout = w->shape[0], g.kh = w->shape[2], g.kw = w->shape[3];
    g.ho = ho, g.wo = wo, g.p = ho * wo;
    g.sh = a->stride_h > 0 ? a->stride_h : 1, g.sw = a->stride_w > 0 ? a->stride_w : 1;
    g.ph = a->pad_h, g.pw = a->pad_w;
    g.dh = a->dilation_h > 0 ? a->dilation_h : 1, g.dw = a->dilation_w > 0 ? a->dilation_w : 1;
    g.groups = a->groups > 0 ? a->groups : 1;
    g.cin_g = g.cin / g.groups, g.cout_g = g.cout / g.groups;
    g.k = g.cin * g.kh * g.kw, g.k_g = g.cin_g * g.kh * g.kw;
    return g;
}

/* 1x1, stride 1, no padding: the image itself is its im2col matrix. */
static inline bool tdm_conv_is_pointwise(const conv_geom *g) {
    return g->kh == 1 && g->kw == 1 && g->sh == 1 && g->sw == 1 && g->ph == 0 && g->pw == 0;
}

typedef struct {
    int64_t planes, h, w, ho, wo; /* planes = N * C */
    int64_t kh, kw, sh, sw, ph, pw, dh, dw;
    bool include_pad; /* average pooling: padding counts in the divisor */
} pool_geom;

/* x [N, C, H, W] pooled into y [N, C, Ho, Wo] */
static inline pool_geom tdm_pool_geom(const tdm_tensor *x, const tdm_tensor *y,
                                      const tdm_pool2d_args *a) {
    pool_geom g;
    g.planes = x->shape[0] * x->shape[1], g.h = x->shape[2], g.w = x->shape[3];
    g.ho = y->shape[2], g.wo = y->shape[3];
    g.kh = a->kernel_h, g.kw = a->kernel_w;
    g.sh = a->stride_h > 0 ? a->stride_h : g.kh, g.sw = a->stride_w > 0 ? a->stride_w : g.kw;
    g.ph = a->pad_h, g.pw = a->pad_w;
    g.dh = a->dilation_h > 0 ? a->dilation_h : 1, g.dw = a->dilation_w > 0 ? a->dilation_w : 1;
    g.include_pad = a->count_include_pad;
    return g;
}

#endif
