/* torchvision's ResNet-18, -34 and -50 (include/tandem/models.h), built from nn's layers with
 * torchvision's module tree, so every parameter and buffer has its state_dict name.
 *
 * The blocks are modules of their own kinds ("BasicBlock", "Bottleneck"): a forward of a few
 * lines over children registered under torchvision's attribute names; the network is a
 * Sequential of named children, so that a pipeline can cut it into stages. They keep no settings
 * (impl NULL: the strides live in the convolutions), so tdm_module_clone copies them as any layer,
 * and everything they compute is nn's ops, so they run on every backend and under DataParallel's
 * synchronised batch norm unchanged.
 * Below the builder: the rows resnet18, resnet34 and resnet50 of the registry, their units
 * (the stages) and their count.
 */
#include <math.h>
#include <stdio.h>

#include "core/core.h"
#include "models_internal.h"

/* ---- layers as torchvision makes them ------------------------------------------------------ */

/* Conv2d k x k, padding k / 2, no bias, weight kaiming_normal_(mode="fan_out",
 * nonlinearity="relu"): N(0, 2 / (out * k * k)). */
static tdm_module *conv(int64_t in, int64_t out, int k, int stride, tdm_device dev, tdm_rng *rng) {
    tdm_conv2d_opts o = {.stride_h = stride, .stride_w = stride, .pad_h = k / 2, .pad_w = k / 2};
    tdm_module *m = tdm_conv2d_new(in, out, k, k, &o, false, dev, rng);
    if (m && tdm_normal_(m->params[0], 0, sqrtf(2.0f / (float)(out * k * k)), rng)) {
        tdm_module_free(m);
        return NULL;
    }
    return m;
}

static tdm_module *bn(int64_t channels, tdm_device dev) {
    return tdm_batch_norm2d_new(channels, 1e-5f, 0.1f, dev);
}

typedef struct {
    const char *name;
    tdm_module *m;
} child;

/* m with the n children added under their names; on any failure (m or a child NULL, from a
 * constructor that failed and left its error) frees m and every child not yet added. */
static tdm_module *with_children(tdm_module *m, int n, const child *kids) {
    int i = 0;
    while (m && i < n && tdm_module_add(m, kids[i].name, kids[i].m) == TDM_OK) i++;
    if (m && i == n) return m;
    for (; i < n; i++) tdm_module_free(kids[i].m);
    tdm_module_free(m);
    return NULL;
}

/* ---- blocks --------------------------------------------------------------------------------- */

/* Children in registration order (torchvision's): conv1, bn1, conv2, bn2, [conv3, bn3],
 * [downsample]. */
enum { CONV1, BN1, CONV2, BN2, CONV3, BN3 };

static tdm_tensor *fwd(tdm_module *m, tdm_tensor *x) {
    return tdm_module_forward(m, x);
}

/* The shortcut: child `at` (downsample) when the block has one, else x itself. */
static tdm_tensor *shortcut(tdm_module *m, int at, tdm_tensor *x) {
    return m->n_children > at ? fwd(m->children[at], x) : x;
}

/* x [N, Cin, H, W] -> [N, planes, H/s, W/s]:
 *   relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)) */
static tdm_tensor *basic_forward(tdm_module *m, tdm_tensor *x) {
    tdm_module **c = m->children;
    tdm_tensor *y = tdm_relu(fwd(c[BN1], fwd(c[CONV1], x)));
    y = fwd(c[BN2], fwd(c[CONV2], y));
    return tdm_relu(tdm_add(y, shortcut(m, BN2 + 1, x)));
}

/* x [N, Cin, H, W] -> [N, planes, H, W] -> [N, planes, H/s, W/s] -> [N, 4 planes, H/s, W/s]:
 *   relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + shortcut(x)) */
static tdm_tensor *bottleneck_forward(tdm_module *m, tdm_tensor *x) {
    tdm_module **c = m->children;
    tdm_tensor *y = tdm_relu(fwd(c[BN1], fwd(c[CONV1], x)));
    y = tdm_relu(fwd(c[BN2], fwd(c[CONV2], y)));
    y = fwd(c[BN3], fwd(c[CONV3], y));
    return tdm_relu(tdm_add(y, shortcut(m, BN3 + 1, x)));
}

static const tdm_module_ops basic_ops = {"BasicBlock", basic_forward, NULL};
static const tdm_module_ops bottleneck_ops = {"Bottleneck", bottleneck_forward, NULL};

typedef struct {
    bool bottleneck; /* Bottleneck (expansion 4) or BasicBlock (1) */
    bool zero_init_residual;
    tdm_device dev;
    tdm_rng *rng;
} block_kind;

static int64_t expansion(const block_kind *k) {
    return k->bottleneck ? 4 : 1;
}

/* Sequential("0": Conv2d 1x1 stride s, "1": BatchNorm2d) onto the block's output shape. */
static tdm_module *downsample(int64_t in, int64_t out, int stride, const block_kind *k) {
    tdm_module *l[2] = {conv(in, out, 1, stride, k->dev, k->rng), bn(out, k->dev)};
    if (l[0] && l[1]) return tdm_sequential_new(2, l);
    tdm_module_free(l[0]);
    tdm_module_free(l[1]);
    return NULL;
}

/* One block: in channels -> planes * expansion, stride on its 3x3 conv. */
static tdm_module *block_new(int64_t in, int64_t planes, int stride, const block_kind *k) {
    int64_t out = planes * expansion(k);
    child c[7];
    int n = 0;
    if (k->bottleneck) {
        c[n++] = (child){"conv1", conv(in, planes, 1, 1, k->dev, k->rng)};
        c[n++] = (child){"bn1", bn(planes, k->dev)};
        c[n++] = (child){"conv2", conv(planes, planes, 3, stride, k->dev, k->rng)};
        c[n++] = (child){"bn2", bn(planes, k->dev)};
        c[n++] = (child){"conv3", conv(planes, out, 1, 1, k->dev, k->rng)};
        c[n++] = (child){"bn3", bn(out, k->dev)};
    } else {
        c[n++] = (child){"conv1", conv(in, planes, 3, stride, k->dev, k->rng)};
        c[n++] = (child){"bn1", bn(planes, k->dev)};
        c[n++] = (child){"conv2", conv(planes, planes, 3, 1, k->dev, k->rng)};
        c[n++] = (child){"bn2", bn(planes, k->dev)};
    }
    tdm_module *last_bn = c[n - 1].m;
    if (last_bn && k->zero_init_residual && tdm_fill_(last_bn->params[0], 0.0f)) {
        for (int i = 0; i < n; i++) tdm_module_free(c[i].m);
        return NULL;
    }
    if (stride != 1 || in != out) c[n++] = (child){"downsample", downsample(in, out, stride, k)};
    const tdm_module_ops *ops = k->bottleneck ? &bottleneck_ops : &basic_ops;
    return with_children(tdm_module_new(ops, k->dev, NULL), n, c);
}

/* layerN: Sequential of `blocks` blocks "0", "1", ...; the first takes *in channels and the
 * stride, the others keep planes * expansion channels. Updates *in. */
static tdm_module *layer_new(int64_t *in, int64_t planes, int blocks, int stride,
                             const block_kind *k) {
    tdm_module *l[6] = {0};
    for (int b = 0; b < blocks; b++) {
        l[b] = block_new(*in, planes, b == 0 ? stride : 1, k);
        *in = planes * expansion(k);
        if (l[b]) continue;
        for (int j = 0; j < b; j++) tdm_module_free(l[j]);
        return NULL;
    }
    return tdm_sequential_new(blocks, l);
}

/* ---- the network ---------------------------------------------------------------------------- */

tdm_resnet_opts tdm_resnet_defaults(int depth) {
    tdm_resnet_opts o = {.depth = depth, .num_classes = 1000, .in_channels = 3};
    return o;
}

/* conv1, bn1, relu, maxpool (not with small_input): the stem, into c; returns the count. */
static int stem(const tdm_resnet_opts *o, tdm_device dev, tdm_rng *rng, child *c) {
    int n = 0;
    if (o->small_input) {
        c[n++] = (child){"conv1", conv(o->in_channels, 64, 3, 1, dev, rng)};
    } else {
        c[n++] = (child){"conv1", conv(o->in_channels, 64, 7, 2, dev, rng)};
    }
    c[n++] = (child){"bn1", bn(64, dev)};
    c[n++] = (child){"relu", tdm_relu_new()};
    if (!o->small_input) {
        tdm_pool2d_opts p = {
            .kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1};
        c[n++] = (child){"maxpool", tdm_max_pool2d_new(&p)};
    }
    return n;
}

tdm_module *tdm_resnet_new(const tdm_resnet_opts *o, tdm_device dev, tdm_rng *rng) {
    if (!o) return tdm_raise_null(TDM_ERR_ARG, "resnet_new: options are NULL");
    static const int blocks[2][4] = {{2, 2, 2, 2}, {3, 4, 6, 3}};
    if (o->depth != 18 && o->depth != 34 && o->depth != 50)
        return tdm_raise_null(TDM_ERR_ARG, "resnet_new: depth %d is not one of 18, 34, 50",
                              o->depth);
    if (o->num_classes < 1 || o->in_channels < 1)
        return tdm_raise_null(TDM_ERR_ARG,
                              "resnet_new: num_classes %lld and in_channels %d must be positive",
                              (long long)o->num_classes, o->in_channels);
    block_kind k = {o->depth == 50, o->zero_init_residual, dev, rng};
    const int *nb = blocks[o->depth != 18];
    child c[12];
    int n = stem(o, dev, rng, c);
    int64_t in = 64;
    static const char *const layers[4] = {"layer1", "layer2", "layer3", "layer4"};
    for (int i = 0; i < 4; i++)
        c[n++] = (child){layers[i], layer_new(&in, 64 << i, nb[i], i ? 2 : 1, &k)};
    c[n++] = (child){"avgpool", tdm_adaptive_avg_pool2d_new(1, 1)};
    c[n++] = (child){"flatten", tdm_flatten_new(1, -1)}; /* torch.flatten in its forward */
    c[n++] = (child){"fc", tdm_linear_new(in, o->num_classes, true, dev, rng)};
    /* x [N, C, H, W] -> conv1, bn1, relu -> [N, 64, H/2, W/2] -> maxpool -> [N, 64, H/4, W/4]
     *   -> layer1..4 -> [N, 512 e, H/32, W/32] -> avgpool -> [N, 512 e, 1, 1] -> flatten
     *   -> fc -> [N, classes]   (e = expansion; small_input: no /2 in conv1, no maxpool).
     * A Sequential of named children (the flatten has no parameters: torchvision's keys), so
     * that a pipeline can cut it into stages as any Sequential */
    return with_children(tdm_sequential_new(0, NULL), n, c);
}

/* ---- the rows of the registry -----------------------------------------------------------------
 */

/* The stem the rows ask for: the small-image one for images of at most 64 pixels a side (what
 * the model gets, after the transforms). */
static bool small_images(const tdm_model_opts *o) {
    int64_t h = o->input.d[1], w = o->input.d[2];
    return (h < w ? h : w) <= 64;
}

/* 0 when o's input is [C, H, W] with sizes >= 1 and there is a class, else TDM_ERR_ARG. */
static int check_sizes(const tdm_model_info *row, const tdm_model_opts *o) {
    char b[96];
    bool ok = o->input.ndim == 3 && o->num_classes >= 1;
    for (int i = 0; ok && i < 3; i++) ok = o->input.d[i] >= 1;
    return ok ? TDM_OK
              : tdm_raise(TDM_ERR_ARG, "model %s takes %s and at least 1 class, not %s of %lld",
                          row->name, row->input, tdm_shape_str(o->input, b),
                          (long long)o->num_classes);
}

static tdm_module *build_row(const tdm_model_info *row, const tdm_model_opts *o, tdm_device dev,
                             tdm_rng *rng) {
    if (check_sizes(row, o)) return NULL;
    tdm_resnet_opts ro = tdm_resnet_defaults(row->variant);
    ro.num_classes = o->num_classes;
    ro.in_channels = (int)o->input.d[0];
    ro.small_input = small_images(o);
    return tdm_resnet_new(&ro, dev, rng);
}

/* A stage: layerN, a Sequential of blocks (known by their kinds, which clones keep). */
static bool is_stage(const tdm_module *m) {
    return m->n_children > 0 &&
           (m->children[0]->ops == &basic_ops || m->children[0]->ops == &bottleneck_ops);
}

static int stages(tdm_module *m, tdm_module **units, int cap) {
    int n = 0;
    for (int i = 0; i < m->n_children; i++) {
        if (!is_stage(m->children[i])) continue;
        if (n < cap) units[n] = m->children[i];
        n++;
    }
    return n;
}

/* A block (block_new) from [*c, *h, *w]. */
static void count_block(tdm_model_cost *m, bool bottleneck, int64_t planes, int64_t stride,
                        int64_t *c, int64_t *h, int64_t *w) {
    int64_t cin = *c, cout = bottleneck ? 4 * planes : planes, h0 = *h, w0 = *w;
    if (bottleneck) {
        tdm_cost_conv(m, cin, planes, 1, 1, false, h, w), tdm_cost_batch_norm(m, planes, *h, *w);
        tdm_cost_out(m, (double)(planes * *h * *w));
        tdm_cost_conv(m, planes, planes, 3, stride, false, h, w);
        tdm_cost_batch_norm(m, planes, *h, *w);
        tdm_cost_out(m, (double)(planes * *h * *w));
        tdm_cost_conv(m, planes, cout, 1, 1, false, h, w), tdm_cost_batch_norm(m, cout, *h, *w);
    } else {
        tdm_cost_conv(m, cin, planes, 3, stride, false, h, w);
        tdm_cost_batch_norm(m, planes, *h, *w);
        tdm_cost_out(m, (double)(planes * *h * *w));
        tdm_cost_conv(m, planes, planes, 3, 1, false, h, w);
        tdm_cost_batch_norm(m, planes, *h, *w);
    }
    if (stride != 1 || cin != cout) { /* downsample: Conv2d 1x1 stride s, BatchNorm2d */
        tdm_cost_conv(m, cin, cout, 1, stride, false, &h0, &w0);
        tdm_cost_batch_norm(m, cout, h0, w0);
    }
    tdm_cost_out(m, (double)(2 * cout * *h * *w)); /* the sum and its ReLU */
    *c = cout;
}

/* The network as tdm_resnet_new builds it, child by child. */
static int count_row(const tdm_model_info *row, const tdm_model_opts *o, tdm_model_cost *m) {
    if (check_sizes(row, o)) return TDM_ERR_ARG;
    static const int blocks[2][4] = {{2, 2, 2, 2}, {3, 4, 6, 3}};
    const int *nb = blocks[row->variant != 18];
    bool bottleneck = row->variant == 50, small = small_images(o);
    int64_t c = o->input.d[0], h = o->input.d[1], w = o->input.d[2];
    tdm_cost_conv(m, c, 64, small ? 3 : 7, small ? 1 : 2, false, &h, &w);
    tdm_cost_batch_norm(m, 64, h, w), tdm_cost_out(m, (double)(64 * h * w));
    if (!small) { /* max-pool 3x3 stride 2 padding 1 */
        h = (h - 1) / 2 + 1, w = (w - 1) / 2 + 1;
        tdm_cost_out(m, (double)(64 * h * w));
    }
    c = 64;
    for (int s = 0; s < 4; s++) {
        tdm_cost_unit_begin(m, (double)(c * h * w));
        for (int b = 0; b < nb[s]; b++)
            count_block(m, bottleneck, 64 << s, b == 0 && s > 0 ? 2 : 1, &c, &h, &w);
        tdm_cost_unit_end(m);
    }
    /* avgpool, flatten, fc */
    tdm_cost_out(m, (double)c), tdm_cost_out(m, 0), tdm_cost_linear(m, c, o->num_classes);
    m->head = (double)o->num_classes;
    m->factor = 1.87;
    /* each convolution's backward makes its weight gradient before adding it into the flat
     * gradient, and it too lives until the step ends: the parameters once more */
    m->fixed_per_param = 1;
    return TDM_OK;
}

static void describe_row(const tdm_model_info *row, const tdm_model_opts *o, char *buf,
                         size_t cap) {
    snprintf(buf, cap, "%s (%lld classes%s)", row->name, (long long)o->num_classes,
             small_images(o) ? "; small-image stem: 3x3 conv, no max-pool" : "");
}

#define RESNET18_HELP                                                                              \
    "torchvision's ResNet-18 (state_dict names such as layer1.0.conv1.weight), with as many "      \
    "outputs as the data has classes, on 3-channel images (grey ones are copied to 3 channels); "  \
    "for images of at most 64 pixels the stem is a 3x3 convolution without max-pool (the CIFAR "   \
    "variant)."
#define RESNET_ROW(nm, depth, text)                                                                \
    {                                                                                              \
        .name = nm, .task = TDM_TASK_IMAGE, .input = "3xHxW images", .any_input = true,            \
        .defaults = {.input = TDM_SHAPE(3, 224, 224), .num_classes = 1000}, .variant = depth,      \
        .build = build_row, .units = stages, .count = count_row, .describe = describe_row,         \
        .help = text                                                                               \
    }

const tdm_model_info tdm_row_resnet18 = RESNET_ROW("resnet18", 18, RESNET18_HELP);
const tdm_model_info tdm_row_resnet34 = RESNET_ROW("resnet34", 34,
                                                   "torchvision's ResNet-34: as the ResNet-18 "
                                                   "above, with [3, 4, 6, 3] blocks.");
const tdm_model_info tdm_row_resnet50 = RESNET_ROW("resnet50", 50,
                                                   "torchvision's ResNet-50: as the ResNet-18 "
                                                   "above, with [3, 4, 6, 3] Bottleneck blocks "
                                                   "(4x wider outputs).");
