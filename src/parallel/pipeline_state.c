/* A pipeline's whole state against one model: the stages' weights into it (tdm_pipe_copy_to)
 * and from it (tdm_pipe_copy_from), their optimizers' state into one whole optimizer over it
 * and back (tdm_pipe_state_to, tdm_pipe_state_from), which is what a checkpoint holds. A
 * stage's parameters are its layers', in the model's order, so its flat buffers are one slice
 * of the whole model's: state moves slice by slice, with no per-tensor bookkeeping. */
#include "parallel/group.h" /* tdm_range_view */
#include "parallel/pipeline_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Copies src's parameters and buffers into dst (a stage's clone and the original layer, either
 * way; op names the call in errors). */
static int copy_layer(tdm_module *dst, const tdm_module *src, int layer, const char *op) {
    if (dst->n_params != src->n_params || dst->n_buffers != src->n_buffers ||
        dst->n_children != src->n_children)
        return tdm_raise(TDM_ERR_SHAPE, "%s: layer %d (%s) differs from the pipeline's %s", op,
                         layer, dst->ops->kind, src->ops->kind);
    int rc = TDM_OK;
    for (int i = 0; !rc && i < dst->n_params + dst->n_buffers; i++) {
        tdm_tensor *d = i < dst->n_params ? dst->params[i] : dst->buffers[i - dst->n_params];
        tdm_tensor *s = i < src->n_params ? src->params[i] : src->buffers[i - src->n_params];
        char a[96], b[96];
        if (!tdm_same_shape(d, s))
            return tdm_raise(TDM_ERR_SHAPE, "%s: layer %d has a tensor %s, the pipeline's is %s",
                             op, layer, tdm_shape_str(tdm_shape_of(d), a),
                             tdm_shape_str(tdm_shape_of(s), b));
        tdm_scope_begin();
        rc = tdm_copy_(d, tdm_to_device(s, d->device));
        tdm_scope_end();
    }
    for (int c = 0; !rc && c < dst->n_children; c++)
        rc = copy_layer(dst->children[c], src->children[c], layer, op);
    return rc;
}

int tdm_pipe_copy_to(tdm_pipe *p, tdm_module *model) {
    if (!p || !model) return tdm_raise(TDM_ERR_ARG, "pipe_copy_to: NULL argument");
    if (model->n_children != p->first[p->S])
        return tdm_raise(TDM_ERR_SHAPE, "pipe_copy_to: the model has %d layers, the pipeline %d",
                         model->n_children, p->first[p->S]);
    if (p->T > 1) return tdm_pipe_gather(p, model); /* the parts made whole on their threads */
    bool prev = tdm_set_grad_enabled(false);
    int rc = TDM_OK;
    for (int s = 0; s < p->S && !rc; s++)
        for (int i = p->first[s]; i < p->first[s + 1] && !rc; i++)
            rc = copy_layer(model->children[i], at(p, s, 0, 0)->mod->children[i - p->first[s]], i,
                            "pipe_copy_to");
    tdm_set_grad_enabled(prev);
    return rc;
}

static int split_stages(tdm_pipe *p, tdm_module *model, tdm_optim *whole, state_move move);

int tdm_pipe_copy_from(tdm_pipe *p, const tdm_module *model) {
    if (!p || !model) return tdm_raise(TDM_ERR_ARG, "pipe_copy_from: NULL argument");
    if (model->n_children != p->first[p->S])
        return tdm_raise(TDM_ERR_SHAPE, "pipe_copy_from: the model has %d layers, the pipeline %d",
                         model->n_children, p->first[p->S]);
    if (p->T > 1) return split_stages(p, (tdm_module *)model, NULL, STATE_SCATTER_WEIGHTS);
    bool prev = tdm_set_grad_enabled(false);
    int rc = TDM_OK;
    for (int s = 0; s < p->S && !rc; s++)
        for (int r = 0; r < p->R && !rc; r++)
            for (int i = p->first[s]; i < p->first[s + 1] && !rc; i++)
                rc = copy_layer(at(p, s, r, 0)->mod->children[i - p->first[s]], model->children[i],
                                i, "pipe_copy_from");
    tdm_set_grad_enabled(prev);
    return rc;
}

/* Stage s's parameters are elements [off[s], off[s + 1]) of the model's flat buffer. */
static int stage_offsets(tdm_pipe *p, const tdm_paramset *whole, int64_t *off, const char *op) {
    off[0] = 0;
    for (int s = 0; s < p->S; s++) {
        tdm_paramset *ps = tdm_module_parameters(at(p, s, 0, 0)->mod);
        if (!ps) return tdm_last_status();
        off[s + 1] = off[s] + ps->total;
    }
    if (off[p->S] != whole->total)
        return tdm_raise(TDM_ERR_SHAPE, "%s: the stages hold %lld parameters, the model %lld", op,
                         (long long)off[p->S], (long long)whole->total);
    return TDM_OK;
}

/* Stage optimizer so's state into (to_whole) or from its slice [lo, hi) of whole's. */
static int move_stage_state(tdm_optim *so, tdm_optim *whole, int64_t lo, int64_t hi, bool to_whole,
                            const char *op) {
    const char *sn[4], *wn[4];
    tdm_tensor *st[4], *wt[4];
    int n = tdm_optim_state(so, sn, st, 4), m = tdm_optim_state(whole, wn, wt, 4);
    if (n != m || strcmp(tdm_optim_kind(so), tdm_optim_kind(whole)) != 0)
        return tdm_raise(TDM_ERR_ARG, "%s: a stage's %s and a whole %s optimizer", op,
                         tdm_optim_kind(so), tdm_optim_kind(whole));
    int rc = TDM_OK;
    for (int k = 0; k < n && !rc; k++) {
        int j = 0;
        while (j < m && strcmp(wn[j], sn[k]) != 0) j++;
        if (j == m) return tdm_raise(TDM_ERR_ARG, "%s: the whole optimizer has no %s", op, sn[k]);
        tdm_tensor v = tdm_range_view(wt[j], lo, hi);
        tdm_scope_begin();
        rc = to_whole ? tdm_copy_(&v, tdm_to_device(st[k], v.device))
                      : tdm_copy_(st[k], tdm_to_device(&v, st[k]->device));
        tdm_scope_end();
    }
    if (!rc)
        rc = to_whole ? tdm_optim_set_steps(whole, tdm_optim_steps(so))
                      : tdm_optim_set_steps(so, tdm_optim_steps(whole));
    return rc;
}

/* Every stage's optimizer state (replica 0's, or into every replica's) to or from whole's;
 * stages split over tensor-parallel ranks through whole copies of them (split_stages). */
static int move_state(tdm_pipe *p, tdm_module *model, tdm_optim *whole, bool to_whole) {
    const char *op = to_whole ? "pipe_state_to" : "pipe_state_from";
    if (!p || !model || !whole) return tdm_raise(TDM_ERR_ARG, "%s: NULL argument", op);
    if (p->T > 1 || p->sharded)
        return split_stages(p, model, whole, to_whole ? STATE_GATHER : STATE_SCATTER);

    tdm_paramset *ps = tdm_module_parameters(model);
    int64_t off[TDM_PIPE_MAX_STAGES + 1];
    int rc = ps ? stage_offsets(p, ps, off, op) : tdm_last_status();
    bool prev = tdm_set_grad_enabled(false);
    for (int s = 0; s < p->S && !rc; s++)
        for (int r = 0; r < (to_whole ? 1 : p->R) && !rc; r++) {
            tdm_optim *so = at(p, s, r, 0)->opt;
            if (so) rc = move_stage_state(so, whole, off[s], off[s + 1], to_whole, op);
        }
    tdm_set_grad_enabled(prev);
    return rc;
}

/* ---- stages split over tensor-parallel ranks (3-D) ---------------------------------------- */

/* Stage s of model whole: a Sequential of copies of its layers, on the model's device. */
static tdm_module *whole_stage(tdm_pipe *p, const tdm_module *model, int s) {
    int n = p->first[s + 1] - p->first[s];
    tdm_module **kids = calloc((size_t)n, sizeof *kids);
    if (!kids) return tdm_raise_null(TDM_ERR_NOMEM, "pipeline: out of memory");
    for (int i = 0; i < n; i++)
        if (!(kids[i] = tdm_module_clone(model->children[p->first[s] + i], model->device))) {
            while (i--) tdm_module_free(kids[i]);
            free(kids);
            return NULL;
        }
    tdm_module *seq = tdm_sequential_new(n, kids);
    free(kids);
    return seq;
}

/* Moves weights or state between the ranks' parts and model (and whole, an optimizer over
 * it) through a whole copy of each stage: gathering, the ranks make the copy's state whole on
 * their threads (a collective over each stage's ranks), then it is read into whole's slice;
 * scattering, the copy takes model's layers (and whole's slice) and every rank of every
 * replica takes its part of it. */
static int split_stages(tdm_pipe *p, tdm_module *model, tdm_optim *whole, state_move move) {
    const char *op = move == STATE_GATHER            ? "pipe_state_to"
                     : move == STATE_SCATTER_WEIGHTS ? "pipe_copy_from"
                                                     : "pipe_state_from";
    tdm_paramset *ps = tdm_module_parameters(model);
    int64_t off[TDM_PIPE_MAX_STAGES + 1] = {0};
    int rc = ps ? TDM_OK : tdm_last_status();
    for (int s = 0; s < p->S && !rc; s++) {
        tdm_paramset *sp = (p->whole_stage[s] = whole_stage(p, model, s))
                               ? tdm_module_parameters(p->whole_stage[s])
                               : NULL;
        if (!sp) rc = tdm_last_status();
        off[s + 1] = off[s] + (sp ? sp->total : 0);
        if (!rc && whole && sp->total && !(p->whole_opt[s] = p->make_optim(sp, p->optim_arg)))
            rc = tdm_last_status();
    }
    if (!rc && off[p->S] != ps->total)
        rc = tdm_raise(TDM_ERR_SHAPE, "%s: the stages hold %lld parameters, the model %lld", op,
                       (long long)off[p->S], (long long)ps->total);
    bool prev = tdm_set_grad_enabled(false);
    for (int s = 0; s < p->S && !rc && move == STATE_SCATTER; s++)
        if (p->whole_opt[s])
            rc = move_stage_state(p->whole_opt[s], whole, off[s], off[s + 1], false, op);
    p->move = move;
    if (!rc) rc = tdm_pipe_state_round(p);
    for (int s = 0; s < p->S && !rc && move == STATE_GATHER; s++)
        if (p->whole_opt[s])
            rc = move_stage_state(p->whole_opt[s], whole, off[s], off[s + 1], true, op);
    tdm_set_grad_enabled(prev);
    for (int s = 0; s < p->S; s++) {
        tdm_optim_free(p->whole_opt[s]);
        tdm_module_free(p->whole_stage[s]);
        p->whole_opt[s] = NULL, p->whole_stage[s] = NULL;
    }
    return rc;
}

/* A worker's part of a round of the stages' state: replica 0's ranks gather their stage's
 * state into its whole copy (rank 0's; a sharded optimizer made whole first, a collective over
 * the replicas), or every rank of every replica takes its part of the copy's weights or state
 * (a sharded optimizer its range), or shards its optimizer over its replicas. */
int tdm_pipe_worker_state(worker *w) {
    tdm_pipe *p = w->p;
    tdm_module *whole = p->whole_stage[w->stage];
    tdm_optim *wo = p->whole_opt[w->stage];
    int rc = TDM_OK;
    if (p->move == STATE_GATHER && w->opt) {
        tdm_optim *so = p->sharded && w->group ? tdm_optim_gather(w->opt) : w->opt;
        if (!so) rc = tdm_last_status();
        if (!rc && w->replica == 0)
            rc = tdm_tp_gather_state(w->mod, so, w->t == 0 ? whole : NULL, w->t == 0 ? wo : NULL);
        if (so != w->opt) tdm_optim_free(so);
    } else if (p->move == STATE_SHARD && w->opt && w->group)
        rc = tdm_optim_shard(w->opt, w->group);
    else if (p->move == STATE_SCATTER_WEIGHTS)
        rc = tdm_tp_scatter_whole(w->mod, whole);
    else if (p->move == STATE_SCATTER && w->opt)
        rc = tdm_tp_scatter_state(w->mod, w->opt, whole, wo);
    if (rc) tdm_pipe_fail(w, rc);
    return rc;
}

int tdm_pipe_shard_optimizer(tdm_pipe *p) {
    if (!p) return tdm_raise(TDM_ERR_ARG, "pipe_shard_optimizer: NULL pipeline");
    if (p->sharded || p->R == 1) return TDM_OK;
    p->move = STATE_SHARD;
    int rc = tdm_pipe_state_round(p);
    if (!rc) p->sharded = true;
    return rc;
}

int tdm_pipe_state_to(tdm_pipe *p, tdm_module *model, tdm_optim *whole) {
    return move_state(p, model, whole, true);
}

int tdm_pipe_state_from(tdm_pipe *p, tdm_module *model, tdm_optim *whole) {
    return move_state(p, model, whole, false);
}
