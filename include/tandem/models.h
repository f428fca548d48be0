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
 * Both take x [N, 1, 28, 28] (Fashion-MNIST, MNIST) and return logits [N, 10]; weights are
 * drawn as PyTorch's defaults draw them (Kaiming-uniform with a = sqrt(5)).
 */
#ifndef TANDEM_MODELS_H
#define TANDEM_MODELS_H

#include "gpt.h"
#include "nn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The names tdm_model_new knows, NULL-terminated: "mlp", "cnn". */
extern const char *const tdm_model_names[];

/* A new model `name` on dev, weights drawn from rng (NULL: the default generator). The caller
 * frees it with tdm_module_free. NULL and TDM_ERR_ARG naming the known models for an unknown
 * name; NULL and the failing layer's error when a layer cannot be made. */
tdm_module *tdm_model_new(const char *name, tdm_device dev, tdm_rng *rng);

#ifdef __cplusplus
}
#endif
#endif
