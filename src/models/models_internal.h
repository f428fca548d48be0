/* What the model files share inside the models layer: the counting steps of their rows'
 * tdm_model_cost functions (cost.c). Each file defines its rows as tdm_row_<name>, which
 * registry.c declares and lists. */
#ifndef TANDEM_MODELS_INTERNAL_H
#define TANDEM_MODELS_INTERNAL_H

#include "tandem/models.h"

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

/* ---- the GPT's pipeline model (gpt_pipeline.c) ---------------------------------------------- */

/* What a vocabulary-split head adds to its columns of the logits, those of rows [lo, lo + k)
 * of wte: 0, or -1e30 where a row is padding (>= c->vocab); NULL (*rc 0) where none is. Kept
 * out of any step's scope: the caller frees it (gpt.c). */
tdm_tensor *tdm_gpt_padding_mask(const tdm_gpt_config *c, int64_t k, int64_t lo, tdm_device dev,
                                 int *rc);

/* Splits layer, tdm_gpt_pipeline_model's embeddings (1 returned) or head (2; its ln_f is the
 * caller's to make sequence-parallel), over tp: the tokens it hands on or takes (seq), its wte
 * by rows (vocab); 0 for any other layer, or an error (negative). */
int tdm_gpt_end_split(tdm_module *layer, tdm_group *tp, bool seq, bool vocab);
/* Whether stage (a pipeline's stage module) ends with the GPT's head (*ends), and the group its
 * vocabulary is split over, or NULL. */
tdm_group *tdm_gpt_stage_vocab_group(const tdm_module *stage, bool *ends);

#endif
