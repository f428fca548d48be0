/* What the model files share inside the models layer: the rows they register
 * (registry.c lists them) and the counting steps of their tdm_model_cost functions (cost.c). */
#ifndef TANDEM_MODELS_INTERNAL_H
#define TANDEM_MODELS_INTERNAL_H

#include "tandem/models.h"

/* The rows, each defined beside its builder. */
extern const tdm_model_info tdm_row_mlp, tdm_row_cnn, tdm_row_cnn_bn;
extern const tdm_model_info tdm_row_resnet18, tdm_row_resnet34, tdm_row_resnet50;
extern const tdm_model_info tdm_row_gpt;

/* ---- counting a forward layer by layer (tdm_model_cost) --------------------------------------
 * A count walks the model's forward in order: each output outside a unit is a layer of the
 * model's Sequential (where a pipeline cuts it); the outputs between tdm_cost_unit_begin and
 * tdm_cost_unit_end are one unit (a layer too). Floats are per sample (or position). */

/* An output of `floats`: a layer of its own outside a unit. */
void tdm_cost_out(tdm_model_cost *c, double floats);
/* A unit starts (its input: `input` floats, what recomputation keeps) and ends. */
void tdm_cost_unit_begin(tdm_model_cost *c, double input);
void tdm_cost_unit_end(tdm_model_cost *c);
/* A Conv2d k x k, padding k / 2, on [cin, *h, *w]: its parameters and output; *h, *w become
 * the output's size. */
void tdm_cost_conv(tdm_model_cost *c, int64_t cin, int64_t cout, int64_t k, int64_t stride,
                   bool bias, int64_t *h, int64_t *w);
/* A Linear in -> out with bias. */
void tdm_cost_linear(tdm_model_cost *c, int64_t in, int64_t out);
/* A BatchNorm2d of ch channels on [ch, h, w]. */
void tdm_cost_batch_norm(tdm_model_cost *c, int64_t ch, int64_t h, int64_t w);

#endif
