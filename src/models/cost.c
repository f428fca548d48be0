/* The steps of a model's count (src/models/models_internal.h, tdm_model_cost). */
#include "models_internal.h"

/* A layer of the Sequential ends: its parameters are those counted since the last. */
static void layer_end(tdm_model_cost *c, double floats) {
    if (c->n_layers < TDM_MODEL_MAX_LAYERS) {
        c->layer_params[c->n_layers] = c->params - c->mark;
        c->layer_fwd[c->n_layers++] = floats;
    }
    c->mark = c->params;
}

void tdm_cost_out(tdm_model_cost *c, double floats) {
    if (c->in_unit) {
        c->this_unit += floats, c->unit_sum += floats;
        return;
    }
    c->fwd += floats;
    layer_end(c, floats);
}

void tdm_cost_unit_begin(tdm_model_cost *c, double input) {
    c->in_unit = true, c->this_unit = 0;
    c->unit_inputs += input;
}

void tdm_cost_unit_end(tdm_model_cost *c) {
    c->in_unit = false;
    if (c->this_unit > c->unit_max) c->unit_max = c->this_unit;
    if (c->params - c->mark > c->unit_params) c->unit_params = c->params - c->mark;
    layer_end(c, c->this_unit);
}

void tdm_cost_conv(tdm_model_cost *c, int64_t cin, int64_t cout, int64_t k, int64_t stride,
                   bool bias, int64_t *h, int64_t *w) {
    *h = (*h + 2 * (k / 2) - k) / stride + 1;
    *w = (*w + 2 * (k / 2) - k) / stride + 1;
    c->params += cout * cin * k * k + (bias ? cout : 0);
    tdm_cost_out(c, (double)(cout * *h * *w));
}

void tdm_cost_linear(tdm_model_cost *c, int64_t in, int64_t out) {
    c->params += in * out + out;
    tdm_cost_out(c, (double)out);
}

void tdm_cost_batch_norm(tdm_model_cost *c, int64_t ch, int64_t h, int64_t w) {
    c->params += 2 * ch;
    tdm_cost_out(c, (double)(ch * h * w));
}
