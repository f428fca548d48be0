/* Tandem's ready-made models: networks built from the library's layers with PyTorch's
 * parameter names, so their state_dicts load in PyTorch and back. Models are a layer of their
 * own, above nn (layers) and optim (a model may bring its own optimizer setup, as the GPT's
 * parameter groups do); gpt.h is the GPT-2 of this layer.
 *
 *   mlp: nn.Sequential(Flatten, Linear(784, 256), ReLU, Linear(256, 128), ReLU,
 *                      Linear(128, 10))                        names "1.weight", "3.bias", ...
 *   cnn: nn.Sequential(Conv2d(1, 32, 3, padding=1), ReLU, MaxPool2d(2),
 *                      Conv2d(32, 64, 3, padding=1), ReLU, MaxPool2d(2),
 *                      Flatten, Linear(64*7*7, 128), ReLU, Linear(128, 10))
 *   cnn-bn: nn.Sequential(Conv2d(1, 16, 3, padding=1, bias=False), MaxPool2d(2),
 *                      BatchNorm2d(16), ReLU, Conv2d(16, 32, 3, padding=1, bias=False),
 *                      MaxPool2d(2), BatchNorm2d(32), ReLU, Flatten, Linear(32*7*7, 256), ReLU,
 *                      Linear(256, 10)): the network of `tandem train --recipe fmnist-fast`
 * All three take x [N, 1, 28, 28] (Fashion-MNIST, MNIST) and return logits [N, 10]; weights are
 * drawn as PyTorch's defaults draw them (Kaiming-uniform with a = sqrt(5)).
 *
 *   resnet18, resnet34, resnet50: torchvision.models.resnet's networks (tdm_resnet_new), with
 *   its module tree and state_dict names ("conv1.weight", "bn1.running_mean",
 *   "layer1.0.conv1.weight", "layer2.0.downsample.0.weight", "layer4.2.bn3.bias",
 *   "fc.weight"), so torchvision's weights saved as safetensors load with tdm_weights_load and
 *   tdm_weights_save's files load into torchvision's models (load_state_dict, strict).
 */
#ifndef TANDEM_MODELS_H
#define TANDEM_MODELS_H

#include "gpt.h"
#include "nn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the model registry ----------------------------------------------------------------------
 *
 * Every model `tandem` trains is one row of one table (src/models/registry.c): its name, its
 * task, the input it takes, its default sizes, its builder, its units, the count of what its
 * forward makes (for memory estimates, before building it) and a help line. The trainer's
 * help, option checks and task choice, `tandem eval` and `tandem sample` all read the table, so
 * a new model is one file (its builder, units and count) and one row. Rows live as long as the
 * program; callers never free them. */

/* What a model computes, which decides its data, loss and metrics. */
typedef enum {
    TDM_TASK_IMAGE, /* image classification: x [N, C, H, W] -> logits [N, classes] */
    TDM_TASK_TEXT,  /* language model: tokens [B, T] -> next-token logits [B, T, V] */
} tdm_model_task;

/* The sizes a builder takes (a row's defaults, changed by the caller where the data says
 * otherwise). */
typedef struct {
    tdm_shape input;     /* one sample as the model takes it: [C, H, W] for images, [T] tokens */
    int64_t num_classes; /* image classifiers' outputs */
    tdm_gpt_config gpt;  /* language models' sizes (input's T <= gpt.context) */
} tdm_model_opts;

/* The longest Sequential a cost lists layer by layer (a ResNet's: 12). */
#define TDM_MODEL_MAX_LAYERS 64

/* What a model of given sizes holds and what one sample's forward makes, counted from its
 * architecture without building it: the parameters exactly, the activations as floats. The
 * floats are per sample, or per position of a sample (a token of the GPT's windows) where
 * positions > 1. factor and head_factor turn the forward's floats into those alive at the end
 * of backward: each forward output with, for most, its gradient, so about 2; they are
 * measured per model (--log's peak_bytes on one CPU device), and tests/test_estimate.c holds
 * the estimate made from them to the measured peak within 15%. */
typedef struct {
    int64_t params;         /* the model's parameters */
    int64_t unit_params;    /* the largest unit's (a ZeRO-3 gather holds two at once) */
    double fwd;             /* floats a sample's forward makes outside the units */
    double unit_sum;        /* ... inside the units (a GPT's blocks, a ResNet's stages) */
    double unit_max;        /* ... inside the largest unit */
    double unit_inputs;     /* the units' inputs: what recomputation keeps of them */
    double head;            /* floats of the loss's input (logits) */
    double factor;          /* activations and their gradients per forward float (above) */
    double head_factor;     /* the same for the logits (softmax, its gradient); default 2 */
    double fixed;           /* bytes of kernels' scratch that do not grow with the batch */
    double fixed_per_param; /* ... and per parameter the device holds */
    int64_t positions;      /* what the floats are counted per: 1 (a sample) or T (a token) */
    /* the layers of the model's Sequential (a unit is one), where a pipeline cuts it: each
     * one's parameters and forward floats */
    int n_layers;
    int64_t layer_params[TDM_MODEL_MAX_LAYERS];
    double layer_fwd[TDM_MODEL_MAX_LAYERS];
    /* the count in progress (src/models/cost.h) */
    bool in_unit;
    double this_unit;
    int64_t mark;
} tdm_model_cost;

typedef struct tdm_model_info tdm_model_info;

/* One row of the registry. */
struct tdm_model_info {
    const char *name;    /* as --model takes it: "mlp", "resnet18", ... */
    tdm_model_task task; /* its data, loss and metrics */
    const char *input;   /* what it takes, in words, for help and errors: "1x28x28 images" */
    /* Whether the input's size and the classes may be anything (the data's): false means
     * the defaults' input (in elements) and at most their classes. */
    bool any_input;
    tdm_model_opts defaults; /* the sizes used where neither the options nor the data say */
    int variant;             /* the builder's own choice among its rows (a ResNet's depth) */
    /* A new model of o's sizes on dev, weights drawn from rng (NULL: the default generator);
     * the caller frees it with tdm_module_free. NULL and TDM_ERR_ARG naming the size for
     * sizes it cannot take, or the failing layer's error. */
    tdm_module *(*build)(const tdm_model_info *row, const tdm_model_opts *o, tdm_device dev,
                         tdm_rng *rng);
    /* m's repeated units (see tdm_model_units) when m was built from this row, up to cap of
     * them into units (borrowed from m); returns how many, 0 when m is not such a model.
     * NULL for a model without units. */
    int (*units)(tdm_module *m, tdm_module **units, int cap);
    /* Adds what a model of o's sizes holds and makes to c (tdm_model_cost_of zeroes it).
     * TDM_OK, or TDM_ERR_ARG for sizes the builder would refuse. */
    int (*count)(const tdm_model_info *row, const tdm_model_opts *o, tdm_model_cost *c);
    /* One line on the model of o's sizes into buf (cap bytes), for a run's banner: the name
     * and what the data chose ("resnet18 (10 classes; small-image stem ...)"). NULL: the name. */
    void (*describe)(const tdm_model_info *row, const tdm_model_opts *o, char *buf, size_t cap);
    const char *help; /* its architecture in a sentence or two, for --help */
};

/* The number of rows, and row i of them (0 <= i < tdm_model_count(), else NULL), in the order
 * help lists them. */
int tdm_model_count(void);
const tdm_model_info *tdm_model_at(int i);
/* The row called name, or NULL and TDM_ERR_ARG naming name and every model registered. */
const tdm_model_info *tdm_model_find(const char *name);
/* The names of the rows of task (task < 0: every row) joined by sep into buf (cap bytes, cut
 * short if too small): "mlp|cnn|gpt" with "|". Returns buf. */
char *tdm_model_list(int task, const char *sep, char *buf, size_t cap);

/* row's builder on o (NULL: row->defaults). NULL and TDM_ERR_ARG for a NULL row, else as
 * the builder fails (see tdm_model_info). */
tdm_module *tdm_model_build(const tdm_model_info *row, const tdm_model_opts *o, tdm_device dev,
                            tdm_rng *rng);
/* row's cost for o's sizes (NULL: row->defaults) into *c, counted without building anything.
 * TDM_OK, or TDM_ERR_ARG for a NULL argument or sizes the builder would refuse. */
int tdm_model_cost_of(const tdm_model_info *row, const tdm_model_opts *o, tdm_model_cost *c);
/* row's one-line description of a model of o's sizes (NULL: row->defaults) into buf (cap
 * bytes): its describe, or its name; "(no model)" for a NULL row. Returns buf. */
char *tdm_model_describe(const tdm_model_info *row, const tdm_model_opts *o, char *buf, size_t cap);

/* A new model `name` at its row's default sizes on dev (tdm_model_build), weights drawn from
 * rng (NULL: the default generator). The caller frees it with tdm_module_free. NULL and
 * TDM_ERR_ARG naming the known models for an unknown name; NULL and the builder's error
 * otherwise. */
tdm_module *tdm_model_new(const char *name, tdm_device dev, tdm_rng *rng);

/* Recomputation (tdm_module_set_recompute) of a model's repeated units, which hold most of its
 * activations: every block of a GPT (transformer.h.<l>), the four stages of a ResNet
 * (layer1..layer4: a stage's activations are recomputed from its input in backward). Their
 * activations then stay alive only while a unit is recomputed: between forward and backward
 * a GPT keeps each block's input, one [B, T, C] tensor, instead of all the block computed. The
 * gradients and the batch norms' running statistics are the same bit for bit; each unit's forward
 * runs twice. Set it before cloning (DataParallel, pipelines): clones keep it. TDM_OK, or
 * TDM_ERR_ARG for a NULL model or one with no such units (the mlp and the cnn: recompute one of
 * their layers with tdm_module_set_recompute instead). */
int tdm_model_set_recompute(tdm_module *m, bool on);
/* Those repeated units of m (a GPT's blocks, a ResNet's stages), the ones recomputation and
 * ZeRO stage 3 (tdm_ddp_set_shard_units) work by, in forward order: up to cap of them into
 * units (borrowed from m), as the units function of the row m was built from gives them (a
 * clone of a model counts as built from its row). Returns how many m has (0 for a model
 * without such units: the mlp, the cnn, any module no row built), or TDM_ERR_ARG for a NULL
 * m. */
int tdm_model_units(tdm_module *m, tdm_module **units, int cap);

/* ---- ResNet ------------------------------------------------------------------------------ */

/* torchvision's ResNet: conv1 (7x7, stride 2, padding 3, no bias), bn1, relu, maxpool (3x3,
 * stride 2, padding 1), layer1..layer4 (Sequentials of blocks "0", "1", ... with 64, 128,
 * 256, 512 planes; the first block of layer2..4 has stride 2), avgpool (adaptive, 1x1),
 * flatten, fc (Linear(512 * expansion, num_classes)).
 *   depth 18, 34: BasicBlock [2,2,2,2], [3,4,6,3]: conv1 (3x3, stride s), bn1, relu, conv2
 *                 (3x3), bn2, + shortcut, relu; expansion 1.
 *   depth 50:     Bottleneck [3,4,6,3]: conv1 (1x1), bn1, conv2 (3x3, stride s: torchvision's
 *                 "V1.5"), bn2, conv3 (1x1, 4x planes), bn3, + shortcut, relu; expansion 4.
 * The shortcut is the identity, or "downsample" (Sequential "0": Conv2d 1x1 stride s, no
 * bias; "1": BatchNorm2d) where the stride or channel count changes.
 * small_input is the common CIFAR variant (torchvision has none): conv1 is 3x3, stride 1,
 * padding 1, and there is no maxpool, for 32x32 images. Every layer it keeps has torchvision's
 * name, so its state_dict has the same keys as torchvision's (conv1.weight is [64, C, 3, 3]).
 * Initialisation as torchvision's: every conv kaiming_normal_(mode="fan_out",
 * nonlinearity="relu"), i.e. N(0, 2 / (out_channels * kh * kw)); BatchNorm weight 1, bias 0;
 * fc nn.Linear's default; with zero_init_residual the last BatchNorm of each block (bn2 or
 * bn3) starts with weight 0, so each block starts as its shortcut. */
typedef struct {
    int depth;           /* 18, 34, 50 */
    int64_t num_classes; /* fc's outputs */
    int in_channels;     /* 3 (colour) or 1 (grey); conv1's input channels */
    bool small_input;    /* the CIFAR stem: 3x3 conv1, stride 1, no maxpool */
    bool zero_init_residual;
} tdm_resnet_opts;

/* torchvision's defaults for depth: 1000 classes, 3 channels, the ImageNet stem. */
tdm_resnet_opts tdm_resnet_defaults(int depth);

/* A new ResNet on dev, weights drawn from rng (NULL: the default generator); the caller frees
 * it with tdm_module_free. Its forward takes x [N, in_channels, H, W] and returns logits
 * [N, num_classes] for any H, W (each stride-2 layer halves them, rounding up: five such in
 * the ImageNet stem, three with small_input); an input of other channels is conv1's
 * TDM_ERR_SHAPE naming its shape.
 * The model is a Sequential of named children (conv1, bn1, relu, maxpool, layer1..layer4,
 * avgpool, flatten, fc; the flatten has no parameters, so the keys are torchvision's): a
 * pipeline cuts it into stages as any Sequential, tdm_module_clone copies it (DataParallel
 * replicas), and its batch norms synchronise under a parallel context as any other. NULL and
 * TDM_ERR_ARG for a depth other than 18, 34, 50, or sizes < 1. The registry's rows resnet18,
 * resnet34 and resnet50 build it with the data's classes and channels, and small_input for
 * images of at most 64 pixels a side. */
tdm_module *tdm_resnet_new(const tdm_resnet_opts *o, tdm_device dev, tdm_rng *rng);

#ifdef __cplusplus
}
#endif
#endif
