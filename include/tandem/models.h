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

/* The names tdm_model_new knows, NULL-terminated: "mlp", "cnn", "cnn-bn". */
extern const char *const tdm_model_names[];

/* A new model `name` on dev, weights drawn from rng (NULL: the default generator). The caller
 * frees it with tdm_module_free. NULL and TDM_ERR_ARG naming the known models for an unknown
 * name; NULL and the failing layer's error when a layer cannot be made. */
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
 * units (borrowed from m). Returns how many m has (0 for a model without such units: the mlp,
 * the cnn), or TDM_ERR_ARG for a NULL m. */
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
 * TDM_ERR_ARG for a depth other than 18, 34, 50, or sizes < 1. Not listed in tdm_model_names:
 * tdm_model_new takes no class or channel count, and a ResNet needs the dataset's. */
tdm_module *tdm_resnet_new(const tdm_resnet_opts *o, tdm_device dev, tdm_rng *rng);

#ifdef __cplusplus
}
#endif
#endif
