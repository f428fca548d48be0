/* Cutting a Sequential into pipeline stages: the split minimising the largest stage's
 * parameter count, an even split by layers, or an explicit layer -> stage map. */
#include "parallel/pipeline_split.h"
#include "core/core.h"
#include "parallel/sync.h" /* tdm_rows_of */
#include "tandem/nn.h"

#include <stdlib.h>

static int64_t count_params(const tdm_module *m) {
    int64_t n = 0;
    for (int i = 0; i < m->n_params; i++) n += tdm_numel(m->params[i]);
    for (int c = 0; c < m->n_children; c++) n += count_params(m->children[c]);
    return n;
}

/* Cuts n layers of costs c into k runs minimising the largest run's cost (dynamic
 * programming over prefix sums; n and k are small). */
static int split_min_max(const int64_t *c, int n, int k, int *first) {
    int64_t *pre = calloc((size_t)n + 1, sizeof *pre);
    int64_t *best = malloc(sizeof *best * (size_t)(k + 1) * (size_t)(n + 1));
    int *cut = malloc(sizeof *cut * (size_t)(k + 1) * (size_t)(n + 1));
    if (!pre || !best || !cut) {
        free(pre), free(best), free(cut);
        return tdm_raise(TDM_ERR_NOMEM, "pipe_split: out of memory");
    }
    for (int i = 0; i < n; i++) pre[i + 1] = pre[i] + c[i];
#define AT(a, j, i) a[(size_t)(j) * (size_t)(n + 1) + (size_t)(i)]
    for (int i = 0; i <= n; i++) AT(best, 1, i) = pre[i], AT(cut, 1, i) = 0;
    for (int j = 2; j <= k; j++)
        for (int i = j; i <= n; i++) {
            AT(best, j, i) = INT64_MAX;
            for (int q = j - 1; q < i; q++) { /* stage j-1 is layers [q, i) */
                int64_t last = pre[i] - pre[q], v = AT(best, j - 1, q);
                if (last > v) v = last;
                if (v < AT(best, j, i)) AT(best, j, i) = v, AT(cut, j, i) = q;
            }
        }
    first[k] = n;
    for (int j = k, i = n; j >= 1; j--) i = first[j - 1] = AT(cut, j, i);
#undef AT
    free(pre), free(best), free(cut);
    return TDM_OK;
}

int tdm_pipe_split(const tdm_module *seq, int k, tdm_split_by by, int *first) {
    if (!seq || !first) return tdm_raise(TDM_ERR_ARG, "pipe_split: NULL model or output");
    int n = seq->n_children;
    if (k < 1 || k > n)
        return tdm_raise(TDM_ERR_ARG,
                         "pipe_split: %d stages for a %s of %d layers (need 1 to %d: every "
                         "stage holds at least one layer)",
                         k, seq->ops->kind, n, n);
    if (by == TDM_SPLIT_LAYERS) {
        for (int s = 0; s <= k; s++) {
            int64_t lo, hi;
            tdm_rows_of(n, k, s < k ? s : k - 1, &lo, &hi);
            first[s] = (int)(s < k ? lo : hi);
        }
        return TDM_OK;
    }
    int64_t *c = malloc(sizeof *c * (size_t)n);
    if (!c) return tdm_raise(TDM_ERR_NOMEM, "pipe_split: out of memory");
    for (int i = 0; i < n; i++) c[i] = count_params(seq->children[i]);
    int rc = tdm_pipe_split_params(c, n, k, first);
    free(c);
    return rc;
}

int tdm_pipe_split_params(const int64_t *params, int n, int k, int *first) {
    if (!params || !first) return tdm_raise(TDM_ERR_ARG, "pipe_split: NULL counts or output");
    if (k < 1 || k > n)
        return tdm_raise(TDM_ERR_ARG,
                         "pipe_split: %d stages for %d layers (need 1 to %d: every stage holds "
                         "at least one layer)",
                         k, n, n);
    int64_t *c = malloc(sizeof *c * (size_t)n);
    if (!c) return tdm_raise(TDM_ERR_NOMEM, "pipe_split: out of memory");
    /* ties go to the split whose largest stage has fewer layers: parameters first, then
     * layers, as one cost */
    for (int i = 0; i < n; i++) c[i] = params[i] * (n + 1) + 1;
    int rc = split_min_max(c, n, k, first);
    free(c);
    return rc;
}

/* Stage boundaries from an explicit layer -> stage map. */
static int split_from_map(const tdm_module *seq, const int *map, int *stages, int *first) {
    int n = seq->n_children;
    if (map[0] != 0)
        return tdm_raise(TDM_ERR_ARG,
                         "pipeline: layer_stage[0] is %d, the first layer must be "
                         "on stage 0",
                         map[0]);
    first[0] = 0;
    int s = 0;
    for (int i = 1; i < n; i++) {
        if (map[i] != s && map[i] != s + 1)
            return tdm_raise(TDM_ERR_ARG,
                             "pipeline: layer_stage[%d] is %d after %d: stages must be "
                             "contiguous runs numbered 0, 1, ... in layer order",
                             i, map[i], s);
        if (map[i] == s + 1) {
            if (++s >= TDM_PIPE_MAX_STAGES) break;
            first[s] = i;
        }
    }
    if (s + 1 > TDM_PIPE_MAX_STAGES || (*stages && *stages != s + 1))
        return tdm_raise(TDM_ERR_ARG,
                         "pipeline: layer_stage gives %d stages, opts say %d (at "
                         "most %d)",
                         s + 1, *stages, TDM_PIPE_MAX_STAGES);
    *stages = s + 1;
    first[s + 1] = n;
    return TDM_OK;
}

int tdm_pipe_stage_bounds(const tdm_module *seq, const tdm_pipe_opts *o, int *stages, int *first) {
    return o->layer_stage ? split_from_map(seq, o->layer_stage, stages, first)
                          : tdm_pipe_split(seq, *stages, o->split_by, first);
}
