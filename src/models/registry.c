/* The model registry (include/tandem/models.h): one row per model, defined beside its builder.
 * A new model adds its row to ROWS, in the order `tandem --help` lists the models. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "models_internal.h"

/* The rows, each defined beside its builder as tdm_row_<name>: X(name) declares it and lists
 * it in rows[]. */
#define ROWS(X) X(mlp) X(cnn) X(cnn_bn) X(resnet18) X(resnet34) X(resnet50) X(gpt)

#define DECLARE(name) extern const tdm_model_info tdm_row_##name;
#define LIST(name)    &tdm_row_##name,
ROWS(DECLARE)
static const tdm_model_info *const rows[] = {ROWS(LIST)};
#define N_ROWS (int)(sizeof rows / sizeof rows[0])

int tdm_model_count(void) {
    return N_ROWS;
}

const tdm_model_info *tdm_model_at(int i) {
    return i >= 0 && i < N_ROWS ? rows[i] : NULL;
}

char *tdm_model_list(int task, const char *sep, char *buf, size_t cap) {
    size_t n = 0;
    if (cap) buf[0] = '\0';
    for (int i = 0; i < N_ROWS && n < cap; i++) {
        if (task >= 0 && rows[i]->task != (tdm_model_task)task) continue;
        int k = snprintf(buf + n, cap - n, "%s%s", n ? sep : "", rows[i]->name);
        n += k > 0 ? (size_t)k : 0;
    }
    return buf;
}

const tdm_model_info *tdm_model_find(const char *name) {
    for (int i = 0; name && i < N_ROWS; i++)
        if (strcmp(rows[i]->name, name) == 0) return rows[i];
    char known[512];
    return tdm_raise_null(TDM_ERR_ARG, "unknown model '%s' (expected one of %s)",
                          name ? name : "(null)", tdm_model_list(-1, ", ", known, sizeof known));
}

tdm_module *tdm_model_build(const tdm_model_info *row, const tdm_model_opts *o, tdm_device dev,
                            tdm_rng *rng) {
    if (!row) return tdm_raise_null(TDM_ERR_ARG, "model_build: row is NULL");
    return row->build(row, o ? o : &row->defaults, dev, rng);
}

int tdm_model_cost_of(const tdm_model_info *row, const tdm_model_opts *o, tdm_model_cost *c) {
    if (!row || !c) return tdm_raise(TDM_ERR_ARG, "model_cost_of: %s is NULL", row ? "c" : "row");
    *c = (tdm_model_cost){.head_factor = 2, .positions = 1};
    return row->count(row, o ? o : &row->defaults, c);
}

char *tdm_model_describe(const tdm_model_info *row, const tdm_model_opts *o, char *buf,
                         size_t cap) {
    if (!row)
        snprintf(buf, cap, "(no model)");
    else if (row->describe)
        row->describe(row, o ? o : &row->defaults, buf, cap);
    else
        snprintf(buf, cap, "%s", row->name);
    return buf;
}

tdm_module *tdm_model_new(const char *name, tdm_device dev, tdm_rng *rng) {
    const tdm_model_info *row = tdm_model_find(name);
    return row ? tdm_model_build(row, NULL, dev, rng) : NULL;
}

/* ---- units: recomputation and ZeRO stage 3 ------------------------------------------------ */

int tdm_model_units(tdm_module *m, tdm_module **units, int cap) {
    if (!m) return tdm_raise(TDM_ERR_ARG, "model_units: model is NULL");
    /* each row's units function knows its own models by their modules' kinds (which clones
     * keep) and says 0 for any other */
    for (int i = 0; i < N_ROWS; i++) {
        int n = rows[i]->units ? rows[i]->units(m, units, cap) : 0;
        if (n) return n;
    }
    return 0;
}

int tdm_model_set_recompute(tdm_module *m, bool on) {
    if (!m) return tdm_raise(TDM_ERR_ARG, "model_set_recompute: model is NULL");
    int n = tdm_model_units(m, NULL, 0);
    tdm_module **units = n > 0 ? malloc(sizeof *units * (size_t)n) : NULL;
    if (n > 0 && !units) return tdm_raise(TDM_ERR_NOMEM, "model_set_recompute: out of memory");
    if (n > 0) tdm_model_units(m, units, n);
    for (int i = 0; i < n; i++) tdm_module_set_recompute(units[i], on);
    free(units);
    if (n == 0)
        return tdm_raise(TDM_ERR_ARG,
                         "model_set_recompute: this %s has no units to recompute (a GPT's blocks "
                         "and a ResNet's stages layer1..layer4 are)",
                         m->ops->kind);
    return TDM_OK;
}
