/* Model builders for `tandem train`: the same nn.Sequential stacks as the PyTorch baselines,
 * so parameter names ("1.weight") and initialisation match PyTorch's. */
#ifndef TANDEM_TOOLS_MODELS_H
#define TANDEM_TOOLS_MODELS_H

#include "tandem/tandem.h"

/* The names accepted by --model, NULL-terminated. */
extern const char *const model_names[];

/* Builds model `name` on dev with weights drawn from rng. NULL and an error (tdm_last_error)
 * for an unknown name or a failed layer. */
tdm_module *model_build(const char *name, tdm_device dev, tdm_rng *rng);
/* A GPT-2 of the given sizes with GPT-2's initialisation (the "gpt" model, whose sizes come
 * from --layers, --heads, --channels and --context). NULL and an error for invalid sizes. */
tdm_module *model_build_gpt(const tdm_gpt_config *cfg, tdm_device dev, tdm_rng *rng);

#endif
