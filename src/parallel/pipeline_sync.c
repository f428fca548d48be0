/* What a pipeline's stages agree on after backward, before they step: the gradients of tied
 * copies of one weight (tdm_pipe_tie: a GPT's token embedding on the first stage and its
 * head's copy on the last) summed into both, fp16's finiteness, and clipping's norm of the
 * whole model. The a side's stage adds the b side's gradient into its own and the b side
 * copies the sum back, each waiting on the b side's flags; the joins are counts under the
 * pipeline's mutex, which every worker reaches (a worker whose step is skipped with nothing). */
#include "parallel/pipeline_internal.h"
#include "optim/clip.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Parameter `name` ("wte.weight") of m's tree, or NULL. */
static const tdm_tensor *param_named(const tdm_module *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (!strcmp(m->param_names[i], name)) return m->params[i];
    const char *dot = strchr(name, '.');
    for (int c = 0; dot && c < m->n_children; c++)
        if (strlen(m->child_names[c]) == (size_t)(dot - name) &&
            !strncmp(m->child_names[c], name, (size_t)(dot - name)))
            return param_named(m->children[c], dot + 1);
    return NULL;
}

/* The ties name layers of model, parameters of those layers, of one shape. */
int tdm_pipe_check_ties(const tdm_module *model, const tdm_pipe_opts *o) {
    if (o->n_ties < 0 || o->n_ties > TDM_PIPE_MAX_TIES || (o->n_ties && !o->ties))
        return tdm_raise(TDM_ERR_ARG, "pipeline: %d ties (0 to %d, and a list)", o->n_ties,
                         TDM_PIPE_MAX_TIES);
    for (int t = 0; t < o->n_ties; t++) {
        const tdm_pipe_tie *e = &o->ties[t];
        const tdm_tensor *side[2] = {NULL, NULL};
        for (int k = 0; k < 2; k++) {
            int layer = k ? e->layer_b : e->layer_a;
            const char *name = k ? e->param_b : e->param_a;
            if (layer < 0 || layer >= model->n_children || !name || strlen(name) >= 96)
                return tdm_raise(TDM_ERR_ARG, "pipeline: tie %d names layer %d of %d", t, layer,
                                 model->n_children);
            if (!(side[k] = param_named(model->children[layer], name)))
                return tdm_raise(TDM_ERR_ARG, "pipeline: tie %d: layer %d (%s) has no parameter %s",
                                 t, layer, model->children[layer]->ops->kind, name);
        }
        if (e->layer_a == e->layer_b || !tdm_same_shape(side[0], side[1]))
            return tdm_raise(TDM_ERR_ARG,
                             "pipeline: tie %d: layer %d's %s and layer %d's %s are not two "
                             "copies of one shape",
                             t, e->layer_a, e->param_a, e->layer_b, e->param_b);
    }
    return TDM_OK;
}

static int stage_of_layer(const struct tdm_pipe *p, int layer) {
    int s = 0;
    while (s + 1 < p->S && p->first[s + 1] <= layer) s++;
    return s;
}

/* dst := dst + src (src on any device), in place. */
static int add_into(tdm_tensor *dst, tdm_tensor *src) {
    tdm_scope_begin();
    tdm_tensor *s = tdm_add(dst, tdm_to_device(src, dst->device));
    int rc = s ? tdm_copy_(dst, s) : tdm_last_status();
    tdm_scope_end();
    return rc;
}

static int copy_into(tdm_tensor *dst, tdm_tensor *src) {
    tdm_scope_begin();
    int rc = tdm_copy_(dst, tdm_to_device(src, dst->device));
    tdm_scope_end();
    return rc;
}

/* Every tie this worker holds a side of: the gradients summed into both copies. */
int tdm_pipe_sum_ties(worker *w) {
    struct tdm_pipe *p = w->p;
    int rc = TDM_OK;
    for (int t = 0; t < p->n_ties && !rc; t++) {
        tdm_tensor *a = w->tie_a[t], *b = w->tie_b[t];
        worker *wa = at(p, stage_of_layer(p, p->tie_layer[t][0]), w->replica, w->t);
        worker *wb = at(p, stage_of_layer(p, p->tie_layer[t][1]), w->replica, w->t);
        if (a && b) { /* both in this stage */
            rc = add_into(a->grad, b->grad);
            if (!rc) rc = copy_into(b->grad, a->grad);
        } else if (b) {
            tdm_pipe_publish(p, &w->tie_ready[t]);
            rc = tdm_pipe_wait(w, &w->tie_summed[t]);
            if (!rc) rc = copy_into(b->grad, wa->tie_a[t]->grad);
            if (!rc) tdm_pipe_publish(p, &w->tie_copied[t]);
        } else if (a) {
            rc = tdm_pipe_wait(w, &wb->tie_ready[t]);
            if (!rc) rc = add_into(a->grad, wb->tie_b[t]->grad);
            if (!rc) tdm_pipe_publish(p, &wb->tie_summed[t]);
            if (!rc)
                rc = tdm_pipe_wait(w, &wb->tie_copied[t]); /* before the replicas' all-reduce */
        }
    }
    return rc;
}

/* This worker's copies of the ties, found in its stage's parameters by their names. */
int tdm_pipe_find_ties(worker *w, const tdm_paramset *ps) {
    struct tdm_pipe *p = w->p;
    for (int t = 0; t < p->n_ties; t++)
        for (int side = 0; side < 2; side++) {
            int layer = p->tie_layer[t][side];
            if (layer < p->first[w->stage] || layer >= p->first[w->stage + 1]) continue;
            char name[128];
            snprintf(name, sizeof name, "%d.%s", layer - p->first[w->stage], p->tie_name[t][side]);
            tdm_tensor *found = NULL;
            for (int i = 0; i < ps->n && !found; i++)
                if (!strcmp(ps->names[i], name)) found = ps->params[i];
            if (!found)
                return tdm_raise(TDM_ERR_STATE, "pipeline: tie %d: no parameter %s in stage %d", t,
                                 name, w->stage);
            if (side)
                w->tie_b[t] = found;
            else
                w->tie_a[t] = found;
        }
    return TDM_OK;
}

/* mine added to *sum under mu, counted in *joined, once every worker has: *total the sum (the
 * same on every worker). An error when the pipeline failed meanwhile. */
static int join_sum(struct tdm_pipe *p, double mine, double *sum, int *joined, double *total) {
    pthread_mutex_lock(&p->mu);
    *sum += mine;
    if (++*joined == p->n_workers) pthread_cond_broadcast(&p->cv);
    while (*joined < p->n_workers && !atomic_load(&p->failed)) pthread_cond_wait(&p->cv, &p->mu);
    *total = *sum;
    bool failed = atomic_load(&p->failed);
    pthread_mutex_unlock(&p->mu);
    return failed ? tdm_raise(TDM_ERR_STATE, "stopped: another stage failed") : TDM_OK;
}

/* fp16: whether every gradient of every stage and replica is finite. Each worker adds the sum
 * of squares of its averaged gradient (before unscaling; optim/scaler.h) and waits for all the
 * others, so all agree and skip alike. The sum's order varies, its finiteness does not. */
int tdm_pipe_agree_finite(worker *w, bool *finite) {
    struct tdm_pipe *p = w->p;
    double ss = 0, total = 0;
    int rc = w->opt ? tdm_clip_sum_squares_of(w->mod->paramset->flat_grad, &ss) : TDM_OK;
    if (!rc) rc = join_sum(p, ss, &p->inf_ss, &p->inf_checked, &total);
    *finite = isfinite(total);
    return rc;
}

/* This worker's share of the squares of the whole model's gradient: replica 0's (the others
 * hold the same average), less the b side of a tie (its a side counts it), whole parameters
 * on tensor-parallel rank 0 only, every rank's parts. */
static int clip_share(worker *w, double *ss) {
    *ss = 0;
    if (w->replica || !w->opt) return TDM_OK;
    double whole = 0, parts = 0;
    int rc = tdm_tp_grad_squares(w->mod, &whole, &parts);
    for (int t = 0; t < w->p->n_ties && !rc; t++) {
        double tied = 0;
        if (w->tie_b[t]) rc = tdm_clip_sum_squares_of(w->tie_b[t]->grad, &tied);
        whole -= tied;
    }
    *ss = parts + (w->t == 0 ? whole : 0);
    return rc;
}

/* --clip: every worker's share joined under mu (every worker comes, one whose step is skipped
 * with nothing), then its gradient scaled by the whole norm's factor. */
int tdm_pipe_clip(worker *w, bool finite) {
    struct tdm_pipe *p = w->p;
    double ss = 0, total = 0;
    int rc = finite ? clip_share(w, &ss) : TDM_OK;
    if (!rc) rc = join_sum(p, ss, &p->clip_ss, &p->clip_joined, &total);
    if (rc) return rc;
    tdm_paramset *ps = w->opt ? w->mod->paramset : NULL;
    return ps && finite ? tdm_clip_scale(ps, 0, ps->total, p->clip, (float)sqrt(total)) : TDM_OK;
}
