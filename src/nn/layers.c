/* The layers of nn.h: constructors with PyTorch's default initialisation, and forwards that
 * call the functional ops.
 *
 * Initialisation (torch/nn/modules/linear.py, conv.py, sparse.py):
 *   Linear, Conv2d  weight: kaiming_uniform_(a=sqrt(5)), i.e. gain sqrt(2/(1+5)), bound
 *                   gain*sqrt(3/fan_in) = 1/sqrt(fan_in); bias: U(-1/sqrt(fan_in), ...).
 *                   fan_in = in (Linear), in_ch/groups*kh*kw (Conv2d).
 *   Embedding       weight N(0, 1).
 *   BatchNorm, LayerNorm  weight 1, bias 0; running_mean 0, running_var 1.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "tandem/autograd.h"
#include "tandem/nn.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static void destroy_impl(tdm_module *m) {
    free(m->impl);
    m->impl = NULL;
}

/* A caller-owned tensor even when a step scope is open (modules own their tensors). */
static tdm_tensor *owned(tdm_tensor *t) {
    return t && tdm_book(t)->owner ? tdm_scope_keep(t) : t;
}

static tdm_tensor *uniform_param(tdm_shape s, float bound, tdm_device dev, tdm_rng *rng) {
    tdm_tensor *t = owned(tdm_empty(s, TDM_F32, dev));
    if (t && tdm_uniform_(t, -bound, bound, rng)) {
        tdm_tensor_free(t);
        return NULL;
    }
    return t;
}

static tdm_tensor *const_tensor(tdm_shape s, float v, tdm_dtype dt, tdm_device dev) {
    return owned(tdm_full(s, v, dt, dev));
}

/* A module whose settings (impl, copied) are n bytes at settings; NULL on failure. */
static tdm_module *new_with_impl(const tdm_module_ops *ops, tdm_device dev, const void *settings,
                                 size_t n) {
    void *impl = NULL;
    if (n) {
        impl = malloc(n);
        if (!impl) return tdm_raise_null(TDM_ERR_NOMEM, "%s: out of memory", ops->kind);
        memcpy(impl, settings, n);
    }
    tdm_module *m = tdm_module_new(ops, dev, impl);
    if (!m)
        free(impl);
    else
        m->impl_size = n;
    return m;
}

/* Registers the tensors (NULL entries of names end the list); frees m on failure. */
static tdm_module *with_params(tdm_module *m, const char *const *names, tdm_tensor **ts, int n,
                               bool buffers) {
    int rc = m ? TDM_OK : TDM_ERR_ARG;
    for (int i = 0; i < n; i++) {
        if (!rc)
            rc = buffers ? tdm_module_add_buffer(m, names[i], ts[i])
                         : tdm_module_add_param(m, names[i], ts[i]);
        if (rc) tdm_tensor_free(ts[i]); /* not registered: still ours */
    }
    if (rc) {
        tdm_module_free(m);
        return NULL;
    }
    return m;
}

/* ---- Linear ----------------------------------------------------------------------------- */

static tdm_tensor *linear_forward(tdm_module *m, tdm_tensor *x) {
    return tdm_linear(x, m->params[0], m->n_params > 1 ? m->params[1] : NULL);
}

static const tdm_module_ops linear_ops = {"Linear", linear_forward, NULL};

tdm_module *tdm_linear_new(int64_t in, int64_t out, bool bias, tdm_device dev, tdm_rng *rng) {
    if (in <= 0 || out <= 0)
        return tdm_raise_null(TDM_ERR_ARG, "Linear: sizes must be positive, got in %lld out %lld",
                              (long long)in, (long long)out);
    float bound = 1.0f / sqrtf((float)in);
    tdm_tensor *ts[2] = {uniform_param(TDM_SHAPE(out, in), bound, dev, rng), NULL};
    if (bias) ts[1] = uniform_param(TDM_SHAPE(out), bound, dev, rng);
    static const char *const names[] = {"weight", "bias"};
    return with_params(tdm_module_new(&linear_ops, dev, NULL), names, ts, bias ? 2 : 1, false);
}

/* ---- Conv2d ----------------------------------------------------------------------------- */

static tdm_tensor *conv2d_forward(tdm_module *m, tdm_tensor *x) {
    return tdm_conv2d(x, m->params[0], m->n_params > 1 ? m->params[1] : NULL, m->impl);
}

static const tdm_module_ops conv2d_ops = {"Conv2d", conv2d_forward, destroy_impl};

tdm_module *tdm_conv2d_new(int64_t in_ch, int64_t out_ch, int kernel_h, int kernel_w,
                           const tdm_conv2d_opts *o, bool bias, tdm_device dev, tdm_rng *rng) {
    tdm_conv2d_opts opts = {0};
    if (o) opts = *o;
    int groups = opts.groups ? opts.groups : 1;
    if (in_ch <= 0 || out_ch <= 0 || kernel_h <= 0 || kernel_w <= 0 || groups < 0 ||
        in_ch % groups || out_ch % groups || opts.stride_h < 0 || opts.stride_w < 0 ||
        opts.pad_h < 0 || opts.pad_w < 0 || opts.dilation_h < 0 || opts.dilation_w < 0)
        return tdm_raise_null(TDM_ERR_ARG,
                              "Conv2d: invalid sizes: in_ch %lld out_ch %lld kernel %dx%d "
                              "groups %d stride %dx%d pad %dx%d dilation %dx%d (channels must "
                              "divide by groups, sizes positive)",
                              (long long)in_ch, (long long)out_ch, kernel_h, kernel_w, groups,
                              opts.stride_h, opts.stride_w, opts.pad_h, opts.pad_w, opts.dilation_h,
                              opts.dilation_w);
    int64_t fan_in = in_ch / groups * kernel_h * kernel_w;
    float bound = 1.0f / sqrtf((float)fan_in);
    tdm_tensor *ts[2] = {
        uniform_param(TDM_SHAPE(out_ch, in_ch / groups, kernel_h, kernel_w), bound, dev, rng),
        NULL};
    if (bias) ts[1] = uniform_param(TDM_SHAPE(out_ch), bound, dev, rng);
    static const char *const names[] = {"weight", "bias"};
    return with_params(new_with_impl(&conv2d_ops, dev, &opts, sizeof opts), names, ts, bias ? 2 : 1,
                       false);
}

/* ---- pooling ---------------------------------------------------------------------------- */

static tdm_tensor *max_pool_forward(tdm_module *m, tdm_tensor *x) {
    return tdm_max_pool2d(x, m->impl);
}
static tdm_tensor *avg_pool_forward(tdm_module *m, tdm_tensor *x) {
    return tdm_avg_pool2d(x, m->impl);
}
static const tdm_module_ops max_pool_ops = {"MaxPool2d", max_pool_forward, destroy_impl};
static const tdm_module_ops avg_pool_ops = {"AvgPool2d", avg_pool_forward, destroy_impl};

static tdm_module *pool_new(const tdm_module_ops *ops, const tdm_pool2d_opts *o) {
    if (!o) return tdm_raise_null(TDM_ERR_ARG, "%s: options are NULL", ops->kind);
    if (o->kernel_h <= 0 || o->kernel_w <= 0 || o->stride_h < 0 || o->stride_w < 0 ||
        o->pad_h < 0 || o->pad_w < 0 || o->dilation_h < 0 || o->dilation_w < 0)
        return tdm_raise_null(TDM_ERR_ARG,
                              "%s: invalid kernel %dx%d stride %dx%d pad %dx%d dilation %dx%d",
                              ops->kind, o->kernel_h, o->kernel_w, o->stride_h, o->stride_w,
                              o->pad_h, o->pad_w, o->dilation_h, o->dilation_w);
    return new_with_impl(ops, tdm_cpu(0), o, sizeof *o);
}

tdm_module *tdm_max_pool2d_new(const tdm_pool2d_opts *o) {
    return pool_new(&max_pool_ops, o);
}
tdm_module *tdm_avg_pool2d_new(const tdm_pool2d_opts *o) {
    return pool_new(&avg_pool_ops, o);
}

static tdm_tensor *adaptive_avg_pool_forward(tdm_module *m, tdm_tensor *x) {
    const int64_t *out = m->impl;
    return tdm_adaptive_avg_pool2d(x, out[0], out[1]);
}
static const tdm_module_ops adaptive_avg_pool_ops = {"AdaptiveAvgPool2d", adaptive_avg_pool_forward,
                                                     destroy_impl};

tdm_module *tdm_adaptive_avg_pool2d_new(int64_t out_h, int64_t out_w) {
    if (out_h < 1 || out_w < 1)
        return tdm_raise_null(TDM_ERR_ARG,
                              "AdaptiveAvgPool2d: output size (%lld, %lld) must be "
                              "positive",
                              (long long)out_h, (long long)out_w);
    int64_t out[2] = {out_h, out_w};
    return new_with_impl(&adaptive_avg_pool_ops, tdm_cpu(0), out, sizeof out);
}

/* ---- BatchNorm -------------------------------------------------------------------------- */

typedef struct {
    float eps, momentum; /* momentum NAN: cumulative average (PyTorch's momentum=None) */
    int min_ndim, max_ndim;
} batch_norm_impl;

/* num_batches_tracked += 1 on its device (no read back: a GPU's step keeps going, and can be
 * recorded in a CUDA graph). Kept in the buffer, not on the host, so that a loaded
 * checkpoint's count carries on. TDM_OK or an error. */
static int bump_batches(tdm_tensor *nbt) {
    const tdm_backend *be = tdm_backend_for(nbt->device);
    return be ? be->count_up(nbt) : tdm_last_status();
}

static tdm_tensor *batch_norm_forward(tdm_module *m, tdm_tensor *x) {
    const batch_norm_impl *bn = m->impl;
    if (x->ndim < bn->min_ndim || x->ndim > bn->max_ndim) {
        char s[96];
        return tdm_raise_null(TDM_ERR_SHAPE, "%s: expected a %dD%s input, got %s", m->ops->kind,
                              bn->min_ndim, bn->max_ndim > bn->min_ndim ? " or 3D" : "",
                              tdm_shape_str(tdm_shape_of(x), s));
    }
    float momentum = bn->momentum;
    if (m->training && !tdm_recomputing()) { /* counted once, by the first forward */
        int64_t n = 0;
        if (bump_batches(m->buffers[2])) return NULL;
        /* a cumulative average (momentum NAN) needs the count on the host */
        if (isnan(momentum) && tdm_to_host(m->buffers[2], &n, sizeof n)) return NULL;
        if (isnan(momentum)) momentum = 1.0f / (float)n;
    }
    return tdm_batch_norm(x, m->buffers[0], m->buffers[1], m->params[0], m->params[1], m->training,
                          momentum, bn->eps);
}

static const tdm_module_ops bn1d_ops = {"BatchNorm1d", batch_norm_forward, destroy_impl};
static const tdm_module_ops bn2d_ops = {"BatchNorm2d", batch_norm_forward, destroy_impl};

static tdm_module *batch_norm_new(const tdm_module_ops *ops, int64_t c, float eps, float momentum,
                                  tdm_device dev, int min_ndim, int max_ndim) {
    if (c <= 0 || !(eps >= 0) || momentum < 0 || momentum > 1)
        return tdm_raise_null(TDM_ERR_ARG,
                              "%s: invalid features %lld, eps %g or momentum %g (in [0, 1], or "
                              "NAN for a cumulative average)",
                              ops->kind, (long long)c, eps, momentum);
    batch_norm_impl impl = {eps, momentum, min_ndim, max_ndim};
    tdm_module *m = new_with_impl(ops, dev, &impl, sizeof impl);
    tdm_tensor *ps[2] = {const_tensor(TDM_SHAPE(c), 1, TDM_F32, dev),
                         const_tensor(TDM_SHAPE(c), 0, TDM_F32, dev)};
    tdm_tensor *bs[3] = {const_tensor(TDM_SHAPE(c), 0, TDM_F32, dev),
                         const_tensor(TDM_SHAPE(c), 1, TDM_F32, dev),
                         const_tensor(TDM_SHAPE0, 0, TDM_I64, dev)};
    static const char *const pn[] = {"weight", "bias"};
    static const char *const bn[] = {"running_mean", "running_var", "num_batches_tracked"};
    m = with_params(m, pn, ps, 2, false);
    if (!m) {
        for (int i = 0; i < 3; i++) tdm_tensor_free(bs[i]);
        return NULL;
    }
    return with_params(m, bn, bs, 3, true);
}

tdm_module *tdm_batch_norm1d_new(int64_t features, float eps, float momentum, tdm_device dev) {
    return batch_norm_new(&bn1d_ops, features, eps, momentum, dev, 2, 3);
}
tdm_module *tdm_batch_norm2d_new(int64_t channels, float eps, float momentum, tdm_device dev) {
    return batch_norm_new(&bn2d_ops, channels, eps, momentum, dev, 4, 4);
}

/* ---- LayerNorm -------------------------------------------------------------------------- */

static tdm_tensor *layer_norm_forward(tdm_module *m, tdm_tensor *x) {
    const float *eps = m->impl;
    return tdm_layer_norm(x, 1, m->n_params ? m->params[0] : NULL,
                          m->n_params ? m->params[1] : NULL, *eps);
}

static const tdm_module_ops layer_norm_ops = {"LayerNorm", layer_norm_forward, destroy_impl};

tdm_module *tdm_layer_norm_new(int64_t features, float eps, bool affine, tdm_device dev) {
    if (features <= 0 || !(eps >= 0))
        return tdm_raise_null(TDM_ERR_ARG, "LayerNorm: invalid features %lld or eps %g",
                              (long long)features, eps);
    tdm_module *m = new_with_impl(&layer_norm_ops, dev, &eps, sizeof eps);
    if (!affine) return m;
    tdm_tensor *ps[2] = {const_tensor(TDM_SHAPE(features), 1, TDM_F32, dev),
                         const_tensor(TDM_SHAPE(features), 0, TDM_F32, dev)};
    static const char *const pn[] = {"weight", "bias"};
    return with_params(m, pn, ps, 2, false);
}

/* ---- Dropout ---------------------------------------------------------------------------- */

/* The layer owns its generator state (a value, not a pointer): a clone copies it, so
 * DataParallel replicas each advance their own copy, identically, instead of racing on one
 * shared generator. */
typedef struct {
    float p;
    tdm_rng rng;
} dropout_impl;

static tdm_tensor *dropout_forward(tdm_module *m, tdm_tensor *x) {
    dropout_impl *d = m->impl;
    return tdm_dropout(x, d->p, m->training, &d->rng);
}

static const tdm_module_ops dropout_ops = {"Dropout", dropout_forward, destroy_impl};

tdm_module *tdm_dropout_new(float p, tdm_rng *rng) {
    if (!(p >= 0 && p <= 1))
        return tdm_raise_null(TDM_ERR_ARG, "Dropout: probability %g is not in [0, 1]", p);
    /* A stream of its own, seeded by one draw of the caller's generator (which moves on by
     * one counter): two layers made from one generator never share masks. */
    if (!rng) rng = tdm_default_rng();
    uint32_t r[4];
    tdm_philox(rng->seed, rng->offset++, 0, r);
    dropout_impl d = {p, tdm_rng_make((uint64_t)r[0] | (uint64_t)r[1] << 32)};
    return new_with_impl(&dropout_ops, tdm_cpu(0), &d, sizeof d);
}

/* ---- Embedding -------------------------------------------------------------------------- */

static tdm_tensor *embedding_forward(tdm_module *m, tdm_tensor *x) {
    return tdm_embedding(m->params[0], x);
}

static const tdm_module_ops embedding_ops = {"Embedding", embedding_forward, NULL};

tdm_module *tdm_embedding_new(int64_t num, int64_t dim, tdm_device dev, tdm_rng *rng) {
    if (num <= 0 || dim <= 0)
        return tdm_raise_null(TDM_ERR_ARG, "Embedding: sizes must be positive, got %lld x %lld",
                              (long long)num, (long long)dim);
    tdm_tensor *w = owned(tdm_empty(TDM_SHAPE(num, dim), TDM_F32, dev));
    if (w && tdm_normal_(w, 0, 1, rng)) {
        tdm_tensor_free(w);
        w = NULL;
    }
    static const char *const names[] = {"weight"};
    return with_params(tdm_module_new(&embedding_ops, dev, NULL), names, &w, 1, false);
}

/* ---- activations and Flatten ------------------------------------------------------------ */

static tdm_tensor *relu_forward(tdm_module *m, tdm_tensor *x) {
    return tdm_relu(x);
}
static tdm_tensor *gelu_forward(tdm_module *m, tdm_tensor *x) {
    return tdm_gelu(x, *(const bool *)m->impl);
}
static tdm_tensor *tanh_forward(tdm_module *m, tdm_tensor *x) {
    return tdm_tanh(x);
}
static tdm_tensor *sigmoid_forward(tdm_module *m, tdm_tensor *x) {
    return tdm_sigmoid(x);
}
static tdm_tensor *flatten_forward(tdm_module *m, tdm_tensor *x) {
    const int *dims = m->impl;
    return tdm_flatten(x, dims[0], dims[1]);
}

static const tdm_module_ops relu_ops = {"ReLU", relu_forward, NULL};
static const tdm_module_ops gelu_ops = {"GELU", gelu_forward, destroy_impl};
static const tdm_module_ops tanh_ops = {"Tanh", tanh_forward, NULL};
static const tdm_module_ops sigmoid_ops = {"Sigmoid", sigmoid_forward, NULL};
static const tdm_module_ops flatten_ops = {"Flatten", flatten_forward, destroy_impl};

tdm_module *tdm_relu_new(void) {
    return tdm_module_new(&relu_ops, tdm_cpu(0), NULL);
}
tdm_module *tdm_gelu_new(bool tanh_approx) {
    return new_with_impl(&gelu_ops, tdm_cpu(0), &tanh_approx, sizeof tanh_approx);
}
tdm_module *tdm_tanh_new(void) {
    return tdm_module_new(&tanh_ops, tdm_cpu(0), NULL);
}
tdm_module *tdm_sigmoid_new(void) {
    return tdm_module_new(&sigmoid_ops, tdm_cpu(0), NULL);
}
tdm_module *tdm_flatten_new(int start_dim, int end_dim) {
    int dims[2] = {start_dim, end_dim};
    return new_with_impl(&flatten_ops, tdm_cpu(0), dims, sizeof dims);
}

/* ---- Sequential ------------------------------------------------------------------------- */

static bool is_kind(const tdm_module *m, const char *kind) {
    return strcmp(m->ops->kind, kind) == 0;
}

/* A ReLU followed by a MaxPool2d runs as the pooling, then the ReLU: the ReLU is monotonic,
 * so max(relu(x)) == relu(max(x)) bit for bit, and so are the gradients (when a window's
 * maximum is positive both orders pick the same first maximum; otherwise both give 0). The
 * ReLU then reads and writes a quarter of the elements (2x2 pooling), and no full-size ReLU
 * output is made: ~6% of the CNN's step. */
static tdm_tensor *sequential_forward(tdm_module *m, tdm_tensor *x) {
    for (int i = 0; i < m->n_children && x; i++) {
        tdm_module *c = m->children[i];
        if (i + 1 < m->n_children && is_kind(c, "ReLU") && is_kind(m->children[i + 1], "MaxPool2d"))
            x = tdm_module_forward(c, tdm_module_forward(m->children[++i], x));
        else
            x = tdm_module_forward(c, x);
    }
    return x;
}

static const tdm_module_ops sequential_ops = {"Sequential", sequential_forward, NULL};

tdm_module *tdm_sequential_new(int n, tdm_module *const *mods) {
    bool bad = n < 0 || (n > 0 && !mods);
    for (int i = 0; !bad && i < n; i++) bad = !mods[i];
    tdm_module *m = NULL;
    if (!bad) {
        /* Its device is that of its first child with parameters (cpu:0 if none). */
        tdm_device dev = tdm_cpu(0);
        for (int i = n - 1; i >= 0; i--)
            if (mods[i]->n_params) dev = mods[i]->device;
        m = tdm_module_new(&sequential_ops, dev, NULL);
    }
    int added = 0, first_null = 0;
    while (bad && mods && first_null < n && mods[first_null]) first_null++;
    while (m && added < n && tdm_module_add(m, NULL, mods[added]) == TDM_OK) added++;
    if (m && added == n) return m;
    /* Failure (a NULL child from a failed constructor, or no memory): free everything we were
     * given, keeping the first error. */
    if (tdm_last_status() == TDM_OK)
        tdm_raise(TDM_ERR_ARG, "Sequential: invalid children (n %d, child %d is NULL)", n,
                  first_null);
    for (int i = added; i < n && mods; i++) tdm_module_free(mods[i]);
    tdm_module_free(m);
    return NULL;
}
