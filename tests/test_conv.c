/* conv2d, max_pool2d, avg_pool2d: forward and backward against a direct (naive) convolution
 * written here, finite differences, PyTorch fixtures, and the argument errors. */
#include <stdlib.h>

#include "check.h"
#include "core/core.h"
#include "gradcheck.h"

#include "backend/backend.h"
#include "backend/cpu/cpu_conv.h" /* tdm_cpu_conv_set_fast_paths */
#include "fixtures/conv_fixtures.h"

/* ---- helpers ----------------------------------------------------------------------------- */

static float *host_copy(const tdm_tensor *t) {
    int64_t n = tdm_numel(t);
    float *h = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    tdm_to_host(t, h, (size_t)n * sizeof(float));
    return h;
}

static tdm_tensor *randn_leaf(tdm_shape s, uint64_t seed, bool grad) {
    tdm_rng r = tdm_rng_make(seed);
    tdm_tensor *t = tdm_randn(s, 0, 1, tdm_cpu(0), &r);
    if (grad) tdm_requires_grad_(t, true);
    return t;
}

typedef struct {
    const char *name;
    int64_t n, cin, h, w, cout, kh, kw;
    tdm_conv2d_opts o;
    bool bias;
} conv_cfg;

static int opt1(int v) {
    return v ? v : 1;
}

static int64_t out_dim(int64_t in, int64_t k, int pad, int stride, int dil) {
    return (in + 2 * pad - opt1(dil) * (k - 1) - 1) / opt1(stride) + 1;
}

/* The definition of a grouped, strided, dilated, padded convolution, in double. */
static void naive_conv(const conv_cfg *c, const float *x, const float *w, const float *b,
                       float *y) {
    int g = opt1(c->o.groups);
    int64_t ho = out_dim(c->h, c->kh, c->o.pad_h, c->o.stride_h, c->o.dilation_h);
    int64_t wo = out_dim(c->w, c->kw, c->o.pad_w, c->o.stride_w, c->o.dilation_w);
    int64_t cin_g = c->cin / g, cout_g = c->cout / g;
    for (int64_t n = 0; n < c->n; n++)
        for (int64_t co = 0; co < c->cout; co++)
            for (int64_t oh = 0; oh < ho; oh++)
                for (int64_t ow = 0; ow < wo; ow++) {
                    double acc = b ? b[co] : 0;
                    for (int64_t ci = 0; ci < cin_g; ci++) {
                        int64_t cx = (co / cout_g) * cin_g + ci;
                        for (int64_t ki = 0; ki < c->kh; ki++)
                            for (int64_t kj = 0; kj < c->kw; kj++) {
                                int64_t ih = oh * opt1(c->o.stride_h) - c->o.pad_h +
                                             ki * opt1(c->o.dilation_h);
                                int64_t iw = ow * opt1(c->o.stride_w) - c->o.pad_w +
                                             kj * opt1(c->o.dilation_w);
                                if (ih < 0 || ih >= c->h || iw < 0 || iw >= c->w) continue;
                                acc += (double)x[((n * c->cin + cx) * c->h + ih) * c->w + iw] *
                                       w[((co * cin_g + ci) * c->kh + ki) * c->kw + kj];
                            }
                    }
                    y[((n * c->cout + co) * ho + oh) * wo + ow] = (float)acc;
                }
}

/* Its adjoint: gx, gw, gb of L = sum(y * gy), in double. */
static void naive_conv_backward(const conv_cfg *c, const float *x, const float *w, const float *gy,
                                double *gx, double *gw, double *gb) {
    int g = opt1(c->o.groups);
    int64_t ho = out_dim(c->h, c->kh, c->o.pad_h, c->o.stride_h, c->o.dilation_h);
    int64_t wo = out_dim(c->w, c->kw, c->o.pad_w, c->o.stride_w, c->o.dilation_w);
    int64_t cin_g = c->cin / g, cout_g = c->cout / g;
    memset(gx, 0, sizeof(double) * (size_t)(c->n * c->cin * c->h * c->w));
    memset(gw, 0, sizeof(double) * (size_t)(c->cout * cin_g * c->kh * c->kw));
    memset(gb, 0, sizeof(double) * (size_t)c->cout);
    for (int64_t n = 0; n < c->n; n++)
        for (int64_t co = 0; co < c->cout; co++)
            for (int64_t oh = 0; oh < ho; oh++)
                for (int64_t ow = 0; ow < wo; ow++) {
                    double d = gy[((n * c->cout + co) * ho + oh) * wo + ow];
                    gb[co] += d;
                    for (int64_t ci = 0; ci < cin_g; ci++) {
                        int64_t cx = (co / cout_g) * cin_g + ci;
                        for (int64_t ki = 0; ki < c->kh; ki++)
                            for (int64_t kj = 0; kj < c->kw; kj++) {
                                int64_t ih = oh * opt1(c->o.stride_h) - c->o.pad_h +
                                             ki * opt1(c->o.dilation_h);
                                int64_t iw = ow * opt1(c->o.stride_w) - c->o.pad_w +
                                             kj * opt1(c->o.dilation_w);
                                if (ih < 0 || ih >= c->h || iw < 0 || iw >= c->w) continue;
                                int64_t xi = ((n * c->cin + cx) * c->h + ih) * c->w + iw;
                                int64_t wi = ((co * cin_g + ci) * c->kh + ki) * c->kw + kj;
                                gx[xi] += d * w[wi];
                                gw[wi] += d * x[xi];
                            }
                    }
                }
}

static void check_close_d(const tdm_tensor *t, const double *ref, double atol, double rtol,
                          const char *what) {
    int64_t n = tdm_numel(t);
    float *e = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) e[i] = (float)ref[i];
    check_tensor_close(t, e, atol, rtol, what);
    free(e);
}

/* ---- conv2d against the naive reference -------------------------------------------------- */

static const conv_cfg reference_cfgs[] = {
    {"pad1", 2, 3, 7, 6, 4, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    {"stride2", 3, 2, 9, 8, 5, 3, 2, {.stride_h = 2, .stride_w = 2, .pad_h = 1}, true},
    {"dilation2", 2, 3, 9, 10, 2, 3, 3, {.dilation_h = 2, .dilation_w = 2, .pad_w = 2}, false},
    {"groups2", 2, 4, 6, 6, 6, 3, 3, {.groups = 2, .pad_h = 1, .pad_w = 1}, false},
    {"depthwise", 2, 4, 6, 5, 4, 3, 3, {.groups = 4, .pad_h = 1, .pad_w = 1, .stride_w = 2}, true},
    {"pointwise", 3, 5, 4, 6, 3, 1, 1, {0}, true},
    {"pointwise_stride", 2, 3, 5, 5, 2, 1, 1, {.stride_h = 2, .stride_w = 2}, true},
    {"big_kernel_pad", 1, 2, 5, 5, 3, 5, 4, {.pad_h = 2, .pad_w = 3, .stride_h = 3}, true},
    /* an odd batch of small planes */
    {"batch11", 11, 16, 10, 10, 8, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    /* a plane whose column matrix exceeds the kernel's chunk: bands of 30 + 10 output rows */
    {"row_chunks",
     2,
     16,
     79,
     120,
     4,
     3,
     3,
     {.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1},
     true},
    {"row_chunks_groups",
     1,
     16,
     70,
     100,
     8,
     3,
     3,
     {.groups = 4, .dilation_h = 2, .pad_w = 1},
     false},
    /* the Fashion-MNIST CNN's second layer on a small batch (the Winograd path) */
    {"cnn_conv2", 3, 32, 14, 14, 64, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    /* Winograd F(2x2, 3x3): odd planes (partial tiles), pads 0 and 2, a plane wider than one
     * vector of tiles (19 tiles a row), and more images than one chunk holds (5 + 5 + 3) */
    {"wino_odd", 3, 8, 13, 11, 9, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    {"wino_pad0", 2, 9, 10, 9, 8, 3, 3, {0}, false},
    {"wino_pad2_asym", 2, 8, 7, 12, 10, 3, 3, {.pad_h = 2}, true},
    {"wino_wide", 2, 8, 9, 37, 8, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    {"wino_chunks", 13, 32, 14, 14, 64, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    /* rows of 1 to 8 tiles, whose stores spill into the next row (written after them) except
     * on a plane's last row; rows of 2 and 3 pixels; a plane of one tile row */
    {"wino_narrow", 3, 8, 5, 3, 8, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    {"wino_w6", 2, 8, 9, 6, 8, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    {"wino_w15", 2, 8, 4, 15, 9, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    {"wino_one_row", 2, 8, 2, 22, 8, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    {"wino_w2", 2, 8, 7, 4, 8, 3, 3, {0}, true},
    /* the first layer (one input channel): weight gradient as dot products over 9 rows of col,
     * with an odd channel count; and 12 rows (a block of 9, then 3) */
    {"cnn_conv1", 3, 1, 28, 28, 5, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    {"small_k_12", 2, 3, 9, 8, 3, 2, 2, {.pad_w = 1}, true},
};

static void test_conv_reference(const conv_cfg *c, int seed) {
    char what[128];
    int g = opt1(c->o.groups);
    tdm_scope_begin();
    tdm_tensor *x = randn_leaf(TDM_SHAPE(c->n, c->cin, c->h, c->w), 100 + seed, true);
    tdm_tensor *w = randn_leaf(TDM_SHAPE(c->cout, c->cin / g, c->kh, c->kw), 200 + seed, true);
    tdm_tensor *b = c->bias ? randn_leaf(TDM_SHAPE(c->cout), 300 + seed, true) : NULL;
    tdm_tensor *y = tdm_conv2d(x, w, b, &c->o);
    snprintf(what, sizeof what, "conv2d %s forward", c->name);
    CHECK(y != NULL, "%s: %s", what, tdm_last_error());
    if (!y) {
        tdm_scope_end();
        return;
    }
    int64_t ho = out_dim(c->h, c->kh, c->o.pad_h, c->o.stride_h, c->o.dilation_h);
    int64_t wo = out_dim(c->w, c->kw, c->o.pad_w, c->o.stride_w, c->o.dilation_w);
    CHECK(y->ndim == 4 && y->shape[0] == c->n && y->shape[1] == c->cout && y->shape[2] == ho &&
              y->shape[3] == wo,
          "%s: output shape", what);
    float *xh = host_copy(x), *wh = host_copy(w), *bh = b ? host_copy(b) : NULL;
    float *ref = malloc(sizeof(float) * (size_t)tdm_numel(y));
    naive_conv(c, xh, wh, bh, ref);
    check_tensor_close(y, ref, 1e-4, 1e-4, what);

    /* backward of L = sum(y * gy) */
    tdm_tensor *gy = randn_leaf(tdm_shape_of(y), 400 + seed, false);
    float *gyh = host_copy(gy);
    CHECK(tdm_backward(tdm_sum_all(tdm_mul(y, gy))) == 0, "%s: %s", what, tdm_last_error());
    double *gx = malloc(sizeof(double) * (size_t)tdm_numel(x));
    double *gw = malloc(sizeof(double) * (size_t)tdm_numel(w));
    double *gb = malloc(sizeof(double) * (size_t)c->cout);
    naive_conv_backward(c, xh, wh, gyh, gx, gw, gb);
    snprintf(what, sizeof what, "conv2d %s grad x", c->name);
    if (x->grad) check_close_d(x->grad, gx, 1e-3, 1e-4, what);
    snprintf(what, sizeof what, "conv2d %s grad w", c->name);
    if (w->grad) check_close_d(w->grad, gw, 1e-3, 1e-4, what);
    snprintf(what, sizeof what, "conv2d %s grad b", c->name);
    if (b && b->grad) check_close_d(b->grad, gb, 1e-3, 1e-4, what);
    CHECK(x->grad && w->grad && (!b || b->grad), "conv2d %s: gradients missing", c->name);
    free(xh), free(wh), free(bh), free(ref), free(gyh), free(gx), free(gw), free(gb);
    tdm_scope_end();
}

/* ---- the fast paths against per-image im2col, at the ResNets' shapes ---------------------- */

/* Every path the CPU takes instead of per-image im2col + GEMM (Winograd on AVX2 and AVX-512,
 * the direct convolution of one input channel on AVX-512) at ResNet-18's layer shapes (a few
 * images; the CIFAR planes 32..4, the ImageNet ones 56..7), odd planes (partial tiles) and
 * pads 0 and 2, against the same op with the fast paths off: forward, dX, dW and db. Fewer
 * channels than the real layers where the result would not change which path runs (the test
 * runs under ASan too). */
static const conv_cfg resnet_cfgs[] = {
    {"cifar_layer1", 2, 64, 32, 32, 64, 3, 3, {.pad_h = 1, .pad_w = 1}, false},
    {"cifar_layer2", 3, 128, 16, 16, 128, 3, 3, {.pad_h = 1, .pad_w = 1}, false},
    {"cifar_layer3", 2, 256, 8, 8, 256, 3, 3, {.pad_h = 1, .pad_w = 1}, false},
    {"cifar_layer4", 5, 512, 4, 4, 512, 3, 3, {.pad_h = 1, .pad_w = 1}, false},
    {"imagenet_layer1", 1, 64, 56, 56, 64, 3, 3, {.pad_h = 1, .pad_w = 1}, false},
    {"imagenet_layer4", 3, 512, 7, 7, 512, 3, 3, {.pad_h = 1, .pad_w = 1}, false},
    {"odd_15x13", 3, 24, 15, 13, 40, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    {"odd_3x5_pad0", 4, 16, 3, 5, 16, 3, 3, {0}, true},
    {"odd_9x7_pad2", 2, 16, 9, 7, 24, 3, 3, {.pad_h = 2, .pad_w = 2}, false},
    {"one_pixel", 6, 32, 1, 1, 32, 3, 3, {.pad_h = 1, .pad_w = 1}, false},
    /* the direct convolution of one input channel (AVX-512): the Fashion-MNIST CNN's first
     * layer, rows of three 16-column blocks, pads 0 and 2, channel counts that leave a
     * partial block of eight */
    {"direct_cnn_conv1", 3, 1, 28, 28, 32, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    {"direct_wide_odd", 2, 1, 5, 37, 13, 3, 3, {.pad_h = 1, .pad_w = 1}, true},
    {"direct_pad0", 2, 1, 9, 7, 5, 3, 3, {0}, true},
    {"direct_pad2_asym", 2, 1, 6, 19, 9, 3, 3, {.pad_h = 2}, false},
};

/* y, and the gradients of L = sum(y * gy), of one convolution; host copies the caller frees. */
static void conv_run(const conv_cfg *c, int seed, float **out) {
    int g = opt1(c->o.groups);
    tdm_scope_begin();
    tdm_tensor *x = randn_leaf(TDM_SHAPE(c->n, c->cin, c->h, c->w), 500 + seed, true);
    tdm_tensor *w = randn_leaf(TDM_SHAPE(c->cout, c->cin / g, c->kh, c->kw), 600 + seed, true);
    tdm_tensor *b = c->bias ? randn_leaf(TDM_SHAPE(c->cout), 700 + seed, true) : NULL;
    tdm_tensor *y = tdm_conv2d(x, w, b, &c->o);
    CHECK(y != NULL, "conv2d %s: %s", c->name, tdm_last_error());
    tdm_tensor *gy = y ? randn_leaf(tdm_shape_of(y), 800 + seed, false) : NULL;
    CHECK(y && tdm_backward(tdm_sum_all(tdm_mul(y, gy))) == 0, "conv2d %s backward: %s", c->name,
          tdm_last_error());
    out[0] = y ? host_copy(y) : NULL;
    out[1] = x->grad ? host_copy(x->grad) : NULL;
    out[2] = w->grad ? host_copy(w->grad) : NULL;
    out[3] = b && b->grad ? host_copy(b->grad) : NULL;
    tdm_scope_end();
}

static void test_fast_paths(const conv_cfg *c, int seed) {
    float *fast[4], *ref[4];
    int g = opt1(c->o.groups);
    int64_t ho = out_dim(c->h, c->kh, c->o.pad_h, c->o.stride_h, c->o.dilation_h);
    int64_t wo = out_dim(c->w, c->kw, c->o.pad_w, c->o.stride_w, c->o.dilation_w);
    int64_t n[4] = {c->n * c->cout * ho * wo, c->n * c->cin * c->h * c->w,
                    c->cout * (c->cin / g) * c->kh * c->kw, c->cout};
    const char *names[4] = {"forward", "grad x", "grad w", "grad b"};
    conv_run(c, seed, fast);
    bool prev = tdm_cpu_conv_set_fast_paths(false);
    conv_run(c, seed, ref);
    tdm_cpu_conv_set_fast_paths(prev);
    for (int k = 0; k < 4; k++) {
        if (!fast[k] || !ref[k]) {
            CHECK(k == 3 && !c->bias, "conv2d %s %s: missing", c->name, names[k]);
            continue;
        }
        /* sums of K = cin*9 (or N*P for dW) products of unit normals: error relative to the
         * largest magnitude, as a reordered float sum's */
        double scale = 0, err = 0;
        for (int64_t i = 0; i < n[k]; i++) {
            double a = ref[k][i] < 0 ? -ref[k][i] : ref[k][i];
            double d = (double)fast[k][i] - ref[k][i];
            scale = a > scale ? a : scale;
            err = (d < 0 ? -d : d) > err ? (d < 0 ? -d : d) : err;
        }
        CHECK(err <= 1e-5 * (scale > 1 ? scale : 1),
              "conv2d %s %s: fast path differs by %g (max %g)", c->name, names[k], err, scale);
    }
    for (int k = 0; k < 4; k++) free(fast[k]), free(ref[k]);
}

/* ---- gradcheck --------------------------------------------------------------------------- */

typedef struct {
    tdm_conv2d_opts o;
    bool transpose_x; /* feed x as a non-contiguous view: in[0] transposed in H and W */
} conv_gc_ctx;

static tdm_tensor *conv_gc_fn(tdm_tensor **in, void *ctx) {
    conv_gc_ctx *c = ctx;
    tdm_tensor *x = c->transpose_x ? tdm_transpose(in[0], 2, 3) : in[0];
    return tdm_conv2d(x, in[1], in[2], &c->o);
}

static void gradcheck_conv(const char *what, tdm_shape xs, tdm_shape ws, bool bias, conv_gc_ctx ctx,
                           uint64_t seed) {
    tdm_tensor *in[3] = {gradcheck_input(xs, seed), gradcheck_input(ws, seed + 1),
                         bias ? gradcheck_input(TDM_SHAPE(ws.d[0]), seed + 2) : NULL};
    /* conv is linear in each input, so a large step has no truncation error */
    gradcheck(what, conv_gc_fn, 3, in, &ctx, 0.05, 2e-3, 2e-3);
    for (int i = 0; i < 3; i++)
        if (in[i]) tdm_tensor_free(in[i]);
}

static void test_conv_gradcheck(void) {
    gradcheck_conv("conv2d basic", TDM_SHAPE(2, 3, 5, 5), TDM_SHAPE(4, 3, 3, 3), true,
                   (conv_gc_ctx){{.pad_h = 1, .pad_w = 1}, false}, 10);
    gradcheck_conv("conv2d stride 2", TDM_SHAPE(2, 2, 6, 5), TDM_SHAPE(3, 2, 3, 2), true,
                   (conv_gc_ctx){{.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1}, false},
                   20);
    gradcheck_conv("conv2d dilation 2", TDM_SHAPE(1, 2, 7, 6), TDM_SHAPE(2, 2, 3, 3), true,
                   (conv_gc_ctx){{.dilation_h = 2, .dilation_w = 2, .pad_h = 2}, false}, 30);
    gradcheck_conv("conv2d groups 2 no bias", TDM_SHAPE(2, 4, 5, 5), TDM_SHAPE(4, 2, 3, 3), false,
                   (conv_gc_ctx){{.groups = 2, .pad_h = 1, .pad_w = 1}, false}, 40);
    gradcheck_conv("conv2d 1x1", TDM_SHAPE(2, 3, 4, 4), TDM_SHAPE(5, 3, 1, 1), true,
                   (conv_gc_ctx){{0}, false}, 50);
    /* x leaf [2, 3, 6, 5] seen as its transpose [2, 3, 5, 6] */
    gradcheck_conv("conv2d strided view", TDM_SHAPE(2, 3, 6, 5), TDM_SHAPE(2, 3, 3, 3), true,
                   (conv_gc_ctx){{.stride_w = 2, .pad_h = 1}, true}, 60);
}

typedef struct {
    tdm_pool2d_opts o;
    bool is_max, transpose_x;
} pool_gc_ctx;

static tdm_tensor *pool_gc_fn(tdm_tensor **in, void *ctx) {
    pool_gc_ctx *c = ctx;
    tdm_tensor *x = c->transpose_x ? tdm_transpose(in[0], 2, 3) : in[0];
    return c->is_max ? tdm_max_pool2d(x, &c->o) : tdm_avg_pool2d(x, &c->o);
}

/* Max pooling is only piecewise linear: the input holds distinct values 0.1 apart (shuffled),
 * so a finite-difference step of 0.01 never changes which element wins. */
static tdm_tensor *spread_input(tdm_shape s, uint64_t seed) {
    int64_t n = tdm_shape_numel(s);
    float *v = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = 0.1f * (float)(i - n / 2);
    for (int64_t i = n - 1; i > 0; i--) { /* Fisher-Yates with Philox words */
        uint32_t r[4];
        tdm_philox(seed, (uint64_t)i, 0, r);
        int64_t j = (int64_t)(r[0] % (uint32_t)(i + 1));
        float t = v[i];
        v[i] = v[j], v[j] = t;
    }
    tdm_tensor *t = tdm_from_data(s, TDM_F32, tdm_cpu(0), v);
    free(v);
    tdm_requires_grad_(t, true);
    return t;
}

static void gradcheck_pool(const char *what, tdm_shape xs, pool_gc_ctx ctx, uint64_t seed) {
    tdm_tensor *x = spread_input(xs, seed);
    gradcheck(what, pool_gc_fn, 1, &x, &ctx, 0.01, 2e-3, 2e-3);
    tdm_tensor_free(x);
}

static void test_pool_gradcheck(void) {
    gradcheck_pool("max_pool2d k2", TDM_SHAPE(2, 3, 6, 7),
                   (pool_gc_ctx){{.kernel_h = 2, .kernel_w = 2}, true, false}, 1);
    gradcheck_pool("max_pool2d k2, a row no window covers", TDM_SHAPE(1, 2, 7, 6),
                   (pool_gc_ctx){{.kernel_h = 2, .kernel_w = 2}, true, false}, 4);
    /* 8x8 -> 4x4 as a 2x2 pool would give, but the windows reach past their 2x2 blocks (the
     * forward's 2x2 paths must not take it) */
    gradcheck_pool(
        "max_pool2d k3 s2 p1, a 2x2 pool's sizes", TDM_SHAPE(2, 2, 8, 8),
        (pool_gc_ctx){
            {.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1},
            true,
            false},
        5);
    gradcheck_pool("max_pool2d k3 s2 p1 ceil", TDM_SHAPE(2, 2, 8, 7),
                   (pool_gc_ctx){{.kernel_h = 3,
                                  .kernel_w = 3,
                                  .stride_h = 2,
                                  .stride_w = 2,
                                  .pad_h = 1,
                                  .pad_w = 1,
                                  .ceil_mode = true},
                                 true,
                                 false},
                   2);
    gradcheck_pool("max_pool2d dilation 2 overlapping", TDM_SHAPE(1, 2, 9, 8),
                   (pool_gc_ctx){{.kernel_h = 3,
                                  .kernel_w = 2,
                                  .stride_h = 1,
                                  .stride_w = 1,
                                  .dilation_h = 2,
                                  .pad_h = 1},
                                 true,
                                 false},
                   3);
    gradcheck_pool("max_pool2d strided view", TDM_SHAPE(2, 2, 7, 6),
                   (pool_gc_ctx){{.kernel_h = 2, .kernel_w = 3, .stride_w = 2}, true, true}, 4);
    gradcheck_pool("avg_pool2d k3 s2 p1 ceil", TDM_SHAPE(2, 2, 8, 7),
                   (pool_gc_ctx){{.kernel_h = 3,
                                  .kernel_w = 3,
                                  .stride_h = 2,
                                  .stride_w = 2,
                                  .pad_h = 1,
                                  .pad_w = 1,
                                  .ceil_mode = true,
                                  .count_include_pad = true},
                                 false,
                                 false},
                   5);
    gradcheck_pool("avg_pool2d exclude pad", TDM_SHAPE(2, 2, 7, 8),
                   (pool_gc_ctx){{.kernel_h = 2,
                                  .kernel_w = 3,
                                  .stride_h = 1,
                                  .stride_w = 2,
                                  .pad_h = 1,
                                  .pad_w = 1,
                                  .ceil_mode = true},
                                 false,
                                 false},
                   6);
    gradcheck_pool(
        "avg_pool2d strided view", TDM_SHAPE(1, 3, 6, 6),
        (pool_gc_ctx){{.kernel_h = 2, .kernel_w = 2, .count_include_pad = true}, false, true}, 7);
}

/* ---- PyTorch fixtures -------------------------------------------------------------------- */

static tdm_shape shape4(const int64_t *d, int n) {
    tdm_shape s = {n, {0}};
    for (int i = 0; i < n; i++) s.d[i] = d[i];
    return s;
}

static void test_conv_fixture(void) {
    tdm_scope_begin();
    tdm_tensor *x = tdm_from_data(shape4(conv_fx_x_shape, 4), TDM_F32, tdm_cpu(0), conv_fx_x);
    tdm_tensor *w = tdm_from_data(shape4(conv_fx_w_shape, 4), TDM_F32, tdm_cpu(0), conv_fx_w);
    tdm_tensor *b = tdm_from_data(shape4(conv_fx_b_shape, 1), TDM_F32, tdm_cpu(0), conv_fx_b);
    tdm_tensor *gy = tdm_from_data(shape4(conv_fx_gy_shape, 4), TDM_F32, tdm_cpu(0), conv_fx_gy);
    tdm_requires_grad_(x, true), tdm_requires_grad_(w, true), tdm_requires_grad_(b, true);
    tdm_conv2d_opts o = {.stride_h = 2,
                         .stride_w = 1,
                         .pad_h = 1,
                         .pad_w = 2,
                         .dilation_h = 2,
                         .dilation_w = 1,
                         .groups = 2};
    tdm_tensor *y = tdm_conv2d(x, w, b, &o);
    CHECK(y && tdm_same_shape(y, gy), "conv fixture: output shape (%s)", tdm_last_error());
    if (y && tdm_same_shape(y, gy)) {
        check_tensor_close(y, conv_fx_y, 1e-4, 1e-4, "conv fixture y");
        CHECK(tdm_backward(tdm_sum_all(tdm_mul(y, gy))) == 0, "%s", tdm_last_error());
        check_tensor_close(x->grad, conv_fx_gx, 1e-4, 1e-4, "conv fixture gx");
        check_tensor_close(w->grad, conv_fx_gw, 1e-4, 1e-4, "conv fixture gw");
        check_tensor_close(b->grad, conv_fx_gb, 1e-4, 1e-4, "conv fixture gb");
    }
    tdm_scope_end();
}

static void test_pool_fixtures(void) {
    int nf = (int)(sizeof pool_fixtures / sizeof pool_fixtures[0]);
    for (int i = 0; i < nf; i++) {
        const pool_fixture *f = &pool_fixtures[i];
        char what[96];
        tdm_scope_begin();
        tdm_tensor *x = tdm_from_data(shape4(pool_fx_x_shape, 4), TDM_F32, tdm_cpu(0), pool_fx_x);
        tdm_requires_grad_(x, true);
        tdm_pool2d_opts o = {.kernel_h = f->kernel[0],
                             .kernel_w = f->kernel[1],
                             .stride_h = f->stride[0],
                             .stride_w = f->stride[1],
                             .pad_h = f->pad[0],
                             .pad_w = f->pad[1],
                             .dilation_h = f->dilation[0],
                             .dilation_w = f->dilation[1],
                             .ceil_mode = f->ceil_mode,
                             .count_include_pad = f->count_include_pad};
        tdm_tensor *y = f->is_max ? tdm_max_pool2d(x, &o) : tdm_avg_pool2d(x, &o);
        tdm_shape ys = shape4(f->y_shape, 4);
        bool shape_ok = y && y->ndim == 4 &&
                        tdm_shape_numel(tdm_shape_of(y)) == tdm_shape_numel(ys) &&
                        y->shape[2] == ys.d[2] && y->shape[3] == ys.d[3];
        CHECK(shape_ok, "pool fixture %s: output shape (%s)", f->name, tdm_last_error());
        if (shape_ok) {
            snprintf(what, sizeof what, "pool fixture %s y", f->name);
            check_tensor_close(y, f->y, 1e-5, 1e-5, what);
            tdm_tensor *gy = tdm_from_data(ys, TDM_F32, tdm_cpu(0), f->gy);
            CHECK(tdm_backward(tdm_sum_all(tdm_mul(y, gy))) == 0, "%s", tdm_last_error());
            snprintf(what, sizeof what, "pool fixture %s gx", f->name);
            check_tensor_close(x->grad, f->gx, 1e-5, 1e-5, what);
        }
        if (shape_ok && f->idx) { /* the index output of the kernel itself */
            tdm_tensor *yk = tdm_empty(ys, TDM_F32, tdm_cpu(0));
            tdm_tensor *ik = tdm_empty(ys, TDM_I32, tdm_cpu(0));
            tdm_pool2d_args a = {o.kernel_h, o.kernel_w,   o.stride_h,   o.stride_w,  o.pad_h,
                                 o.pad_w,    o.dilation_h, o.dilation_w, o.ceil_mode, false};
            CHECK(tdm_backend_for(tdm_cpu(0))->max_pool2d(yk, ik, x, &a) == 0, "%s",
                  tdm_last_error());
            int64_t n = tdm_numel(ik), bad = 0;
            int32_t *got = malloc(sizeof(int32_t) * (size_t)n);
            tdm_to_host(ik, got, sizeof(int32_t) * (size_t)n);
            for (int64_t j = 0; j < n; j++) bad += got[j] != f->idx[j];
            CHECK(bad == 0, "pool fixture %s: %lld indices differ from PyTorch's", f->name,
                  (long long)bad);
            free(got);
        }
        tdm_scope_end();
    }
}

/* NaN propagates and wins as in PyTorch, in the 2x2 fast path and the general one. */
static void check_nan_pool(int k, int s, int p, const float *ey, const int64_t *eidx, int n) {
    tdm_scope_begin();
    tdm_tensor *x = tdm_from_data(TDM_SHAPE(1, 1, 4, 4), TDM_F32, tdm_cpu(0), pool_nan_x);
    tdm_shape ys = TDM_SHAPE(1, 1, n / 4 > 1 ? 4 : 2, n / 4 > 1 ? 4 : 2);
    tdm_tensor *y = tdm_empty(ys, TDM_F32, tdm_cpu(0)), *ik = tdm_empty(ys, TDM_I32, tdm_cpu(0));
    tdm_pool2d_args a = {k, k, s, s, p, p, 1, 1, false, false};
    CHECK(tdm_backend_for(tdm_cpu(0))->max_pool2d(y, ik, x, &a) == 0, "%s", tdm_last_error());
    float gy[16];
    int32_t gi[16];
    tdm_to_host(y, gy, sizeof(float) * (size_t)n);
    tdm_to_host(ik, gi, sizeof(int32_t) * (size_t)n);
    int bad = 0;
    for (int i = 0; i < n; i++)
        bad += gi[i] != eidx[i] || (isnan(ey[i]) ? !isnan(gy[i]) : gy[i] != ey[i]);
    CHECK(bad == 0, "max_pool2d k%d with NaN/inf: %d outputs differ from PyTorch", k, bad);
    tdm_scope_end();
}

/* The 2x2 fast path on rows of W / 2 windows (vectorised eight at a time where the CPU has
 * AVX2, a row's last 1-7 in one masked step): values, ties (small integers) and NaN/inf
 * windows against a scan in PyTorch's order. */
static void check_pool_2x2_row(int W) {
    enum { H = 6, HO = H / 2, P = 2 * 3, W_MAX = 40 };
    const int WO = W / 2;
    static float x[P * H * W_MAX], y[P * HO * W_MAX];
    static int32_t idx[P * HO * W_MAX];
    for (int i = 0; i < P * H * W; i++) x[i] = (float)((i * 7919 + i / 5) % 7) - 3;
    x[5 * W + 9] = NAN, x[W + 20] = INFINITY, x[2 * H * W + 3] = -INFINITY, x[40] = NAN;
    tdm_scope_begin();
    tdm_tensor *xt = tdm_from_data(TDM_SHAPE(2, 3, H, W), TDM_F32, tdm_cpu(0), x);
    tdm_tensor *yt = tdm_empty(TDM_SHAPE(2, 3, HO, WO), TDM_F32, tdm_cpu(0));
    tdm_tensor *it = tdm_empty(TDM_SHAPE(2, 3, HO, WO), TDM_I32, tdm_cpu(0));
    tdm_pool2d_args a = {2, 2, 2, 2, 0, 0, 1, 1, false, false};
    CHECK(tdm_backend_for(tdm_cpu(0))->max_pool2d(yt, it, xt, &a) == 0, "%s", tdm_last_error());
    tdm_to_host(yt, y, sizeof(float) * (size_t)(P * HO * WO));
    tdm_to_host(it, idx, sizeof(int32_t) * (size_t)(P * HO * WO));
    tdm_scope_end();
    int bad = 0;
    for (int p = 0; p < P; p++)
        for (int oh = 0; oh < HO; oh++)
            for (int ow = 0; ow < WO; ow++) {
                const float *pl = x + p * H * W;
                int64_t bi = 2 * oh * W + 2 * ow;
                float best = -INFINITY;
                for (int dh = 0; dh < 2; dh++)
                    for (int dw = 0; dw < 2; dw++) {
                        int64_t i = (2 * oh + dh) * W + 2 * ow + dw;
                        if (pl[i] > best || isnan(pl[i])) best = pl[i], bi = i;
                        if (isnan(best)) dh = 2, dw = 2; /* the first NaN wins */
                    }
                int o = (p * HO + oh) * WO + ow;
                bool same = isnan(best) ? isnan(y[o]) : y[o] == best;
                if (!same || idx[o] != bi) {
                    if (bad++ < 3)
                        fprintf(stderr, "2x2 pool plane %d (%d, %d): %g at %lld, want %g at %lld\n",
                                p, oh, ow, y[o], (long long)idx[o], best, (long long)bi);
                }
            }
    CHECK(bad == 0, "max_pool2d 2x2 on rows of %d windows: %d outputs differ", WO, bad);
}

static void test_pool_2x2_wide(void) {
    for (int w = 2; w <= 40; w += 2) check_pool_2x2_row(w);
}

static void test_pool_nan(void) {
    check_nan_pool(2, 2, 0, pool_nan_k2_y, pool_nan_k2_idx, 4);
    check_nan_pool(3, 1, 1, pool_nan_k3_y, pool_nan_k3_idx, 16);
}

/* ---- errors, no-scope use, no-grad ------------------------------------------------------- */

static void test_errors(void) {
    tdm_scope_begin();
    tdm_tensor *x = tdm_zeros(TDM_SHAPE(2, 3, 8, 8), TDM_F32, tdm_cpu(0));
    tdm_tensor *w = tdm_zeros(TDM_SHAPE(4, 3, 3, 3), TDM_F32, tdm_cpu(0));
    tdm_tensor *x3 = tdm_zeros(TDM_SHAPE(3, 8, 8), TDM_F32, tdm_cpu(0));
    tdm_tensor *xi = tdm_zeros(TDM_SHAPE(2, 3, 8, 8), TDM_I32, tdm_cpu(0));
    tdm_conv2d_opts none = {0};

    CHECK_ERROR(!tdm_conv2d(x3, w, NULL, &none), "conv2d: input must be 4-D");
    CHECK_ERROR(!tdm_conv2d(x, x3, NULL, &none), "[3, 8, 8]");
    tdm_tensor *w2 = tdm_zeros(TDM_SHAPE(4, 2, 3, 3), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(!tdm_conv2d(x, w2, NULL, &none), "weight [4, 2, 3, 3] with groups 1 expects 2 "
                                                 "input channels, but input [2, 3, 8, 8] has 3");
    tdm_conv2d_opts g2 = {.groups = 2};
    CHECK_ERROR(!tdm_conv2d(x, w2, NULL, &g2), "groups 2 must divide the input channels (3");
    tdm_tensor *b5 = tdm_zeros(TDM_SHAPE(5), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(!tdm_conv2d(x, w, b5, &none), "conv2d: bias must be [4]");
    tdm_tensor *wbig = tdm_zeros(TDM_SHAPE(4, 3, 9, 3), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(!tdm_conv2d(x, wbig, NULL, &none), "output size would be < 1");
    tdm_conv2d_opts dil = {.dilation_h = 4};
    CHECK_ERROR(!tdm_conv2d(x, w, NULL, &dil), "kernel height 3 (dilated to 9)");
    tdm_conv2d_opts neg = {.pad_h = -1};
    CHECK_ERROR(!tdm_conv2d(x, w, NULL, &neg), "conv2d: stride");
    CHECK_ERROR(!tdm_conv2d(xi, w, NULL, &none), "conv2d");
    CHECK_ERROR(!tdm_conv2d(NULL, w, NULL, &none), "conv2d: input is NULL");

    tdm_pool2d_opts p = {.kernel_h = 2, .kernel_w = 2};
    CHECK_ERROR(!tdm_max_pool2d(x3, &p), "max_pool2d: input must be 4-D [N, C, H, W], got "
                                         "[3, 8, 8]");
    tdm_pool2d_opts big = {.kernel_h = 9, .kernel_w = 2};
    CHECK_ERROR(!tdm_max_pool2d(x, &big), "max_pool2d: input [2, 3, 8, 8] with kernel (9, 2)");
    tdm_pool2d_opts pad = {.kernel_h = 2, .kernel_w = 2, .pad_h = 2};
    CHECK_ERROR(!tdm_avg_pool2d(x, &pad), "avg_pool2d: padding (2, 0) must be at most half");
    tdm_pool2d_opts k0 = {.kernel_h = 0, .kernel_w = 2};
    CHECK_ERROR(!tdm_avg_pool2d(x, &k0), "avg_pool2d: kernel (0, 2)");
    tdm_pool2d_opts adil = {.kernel_h = 2, .kernel_w = 2, .dilation_h = 2};
    CHECK_ERROR(!tdm_avg_pool2d(x, &adil), "avg_pool2d: dilation is for max pooling only");
    CHECK_ERROR(!tdm_max_pool2d(x, NULL), "max_pool2d: options is NULL");
    /* the indices are int32: a plane of 2^31 pixels is refused (a view: nothing allocated) */
    tdm_tensor *huge = tdm_expand(tdm_zeros(TDM_SHAPE(1, 1, 1, 1), TDM_F32, tdm_cpu(0)),
                                  TDM_SHAPE(1, 1, 65536, 32768));
    CHECK_ERROR(!tdm_max_pool2d(huge, &p), "max_pool2d: input [1, 1, 65536, 32768] has planes of "
                                           "2^31 pixels or more");

    /* a NULL input keeps the first error */
    tdm_clear_error();
    CHECK(!tdm_max_pool2d(tdm_conv2d(x3, w, NULL, &none), &p), "NULL propagates");
    CHECK_ERROR(true, "conv2d: input must be 4-D");
    tdm_scope_end();
}

/* Without a scope and without gradients the ops leave nothing behind but their output. */
static void test_no_scope(void) {
    tdm_tensor *x = tdm_randn(TDM_SHAPE(2, 3, 6, 6), 0, 1, tdm_cpu(0), NULL);
    tdm_tensor *xt = tdm_transpose(x, 2, 3); /* strided: the ops make a contiguous copy */
    tdm_tensor *w = tdm_randn(TDM_SHAPE(4, 3, 3, 3), 0, 1, tdm_cpu(0), NULL);
    size_t before = tdm_alloc_stats_get(tdm_cpu(0)).bytes_in_use;
    tdm_pool2d_opts p = {.kernel_h = 2, .kernel_w = 2};
    tdm_tensor *y1 = tdm_max_pool2d(xt, &p);
    tdm_tensor *y2 = tdm_avg_pool2d(xt, &p);
    tdm_tensor *y3 = tdm_conv2d(xt, w, NULL, NULL);
    CHECK(y1 && y2 && y3 && !tdm_book(y1)->owner && !y1->requires_grad, "no-scope ops: %s",
          tdm_last_error());
    tdm_tensor_free(y1), tdm_tensor_free(y2), tdm_tensor_free(y3);
    size_t after = tdm_alloc_stats_get(tdm_cpu(0)).bytes_in_use;
    CHECK(after == before, "no-scope ops leaked %lld bytes", (long long)(after - before));
    tdm_tensor_free(xt), tdm_tensor_free(w), tdm_tensor_free(x);

    /* grad mode off: no node even if inputs require gradients */
    tdm_scope_begin();
    tdm_tensor *xg = randn_leaf(TDM_SHAPE(1, 1, 4, 4), 9, true);
    bool prev = tdm_set_grad_enabled(false);
    int before_tape = tdm_tape_size();
    tdm_tensor *y = tdm_max_pool2d(xg, &p);
    CHECK(y && !y->requires_grad && tdm_tape_size() == before_tape, "no_grad records nothing");
    tdm_set_grad_enabled(prev);
    tdm_scope_end();
}

/* Under an emulated CPU (scripts/test's qemu -cpu Haswell run, which sets TANDEM_TEST_EMULATED)
 * the layers of more than 80 MFLOP are left to the native run: each costs half a minute to
 * minutes there, and the smaller ones take the same AVX2 code. */
static bool native_only(const conv_cfg *c) {
    double flops = 2.0 * c->n * c->cin * c->h * c->w * c->cout * c->kh * c->kw;
    return flops > 80e6 && getenv("TANDEM_TEST_EMULATED");
}

int main(void) {
    int nc = (int)(sizeof reference_cfgs / sizeof reference_cfgs[0]), left = 0;
    for (int i = 0; i < nc; i++)
        if (native_only(&reference_cfgs[i]))
            left++;
        else
            test_conv_reference(&reference_cfgs[i], i);
    int nr = (int)(sizeof resnet_cfgs / sizeof resnet_cfgs[0]);
    for (int i = 0; i < nr; i++)
        if (native_only(&resnet_cfgs[i]))
            left++;
        else
            test_fast_paths(&resnet_cfgs[i], i);
    if (left) printf("emulated CPU: %d of %d cases left to the native run\n", left, nc + nr);
    test_conv_gradcheck();
    test_pool_gradcheck();
    test_conv_fixture();
    test_pool_fixtures();
    test_pool_nan();
    test_pool_2x2_wide();
    test_errors();
    test_no_scope();
    return check_summary();
}
