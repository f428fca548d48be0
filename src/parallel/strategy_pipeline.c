/* The pipeline strategy: the caller's Sequential cut into stages (tdm_pipe), every stage's
 * threads running its schedule; the caller's model is evaluated once the stages' weights are
 * copied back into it. A checkpoint takes the stages' weights and optimizer state whole
 * (optim_gather) and a resume hands them back (push_whole); through a view (a GPT's
 * Sequential of copies) each state buffer crosses between the view's order and the model's
 * with the view's own copy functions, its values standing in for the weights. */
#include "parallel/strategy.h"

#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    tdm_strategy base;
    tdm_pipe *pipe;
    tdm_module *model;
    tdm_module *view; /* the Sequential the stages were cut from, or NULL: model is */
    int (*to_model)(tdm_module *model, const tdm_module *view);
    int (*to_view)(tdm_module *view, const tdm_module *model);
    tdm_optim_factory make_optim;
    void *optim_arg;
    int micro_batches, tp;
    tdm_pipe_schedule schedule;
} pipeline;

static int pipe_step(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                     void *loss_arg, bool first, bool last, float *loss) {
    (void)first, (void)last; /* strategy.c refuses accumulation: every call is a whole step */
    tdm_pipe *p = ((pipeline *)st)->pipe;
    int rc = tdm_pipe_step(p, x, target, loss_fn, loss_arg, loss);
    st->skipped = tdm_pipe_step_skipped(p);
    return rc;
}

static int pipe_set_scaler(tdm_strategy *st, tdm_grad_scaler *s) {
    return tdm_pipe_set_grad_scaler(((pipeline *)st)->pipe, s);
}

static int pipe_forward(tdm_strategy *st, tdm_tensor *x, tdm_tensor **out) {
    *out = tdm_module_forward(((pipeline *)st)->model, x);
    return *out ? TDM_OK : tdm_last_status();
}

static int pipe_set_clip(tdm_strategy *st) {
    return tdm_pipe_set_clip_grad_norm(((pipeline *)st)->pipe, st->clip > 0 ? st->clip : 0);
}

static void pipe_set_lr(tdm_strategy *st, float lr) {
    tdm_pipe_set_lr(((pipeline *)st)->pipe, lr);
}

static int pipe_sync_model(tdm_strategy *st) {
    pipeline *s = (pipeline *)st;
    int rc = tdm_pipe_copy_to(s->pipe, s->view ? s->view : s->model);
    return rc || !s->view ? rc : s->to_model(s->model, s->view);
}

static tdm_module *pipe_replica(tdm_strategy *st, int r) {
    (void)r;
    return ((pipeline *)st)->model;
}

/* The first stage's optimizer with parameters: every stage has the same settings. */
static tdm_optim *pipe_optim(tdm_strategy *st, int r) {
    (void)r;
    tdm_pipe *p = ((pipeline *)st)->pipe;
    tdm_optim *o = NULL;
    for (int s = 0; s < tdm_pipe_stages(p) && !o; s++) o = tdm_pipe_stage_optim(p, s, 0);
    return o;
}

/* Each state buffer of from (over the view's parameters, or the model's) into the same-named
 * one of to (over the other's), carried by the view's copy functions: loaded into the values of
 * from's module, copied across, read from the other's. Both modules' values are left holding
 * the last buffer: the caller puts the weights back. */
static int through_view(pipeline *s, tdm_optim *from, tdm_optim *to, bool to_model) {
    tdm_paramset *vps = tdm_module_parameters(s->view), *mps = tdm_module_parameters(s->model);
    if (!vps || !mps) return tdm_last_status();
    tdm_paramset *src = to_model ? vps : mps, *dst = to_model ? mps : vps;
    const char *fn[4], *tn[4];
    tdm_tensor *ft[4], *tt[4];
    int n = tdm_optim_state(from, fn, ft, 4), m = tdm_optim_state(to, tn, tt, 4), rc = TDM_OK;
    for (int k = 0; k < n && !rc; k++) {
        int j = 0;
        while (j < m && strcmp(tn[j], fn[k]) != 0) j++;
        if (j == m) return tdm_raise(TDM_ERR_ARG, "pipeline: the optimizer has no %s", fn[k]);
        bool prev = tdm_set_grad_enabled(false);
        tdm_scope_begin();
        rc = tdm_copy_(src->flat, tdm_to_device(ft[k], src->flat->device));
        if (!rc) rc = to_model ? s->to_model(s->model, s->view) : s->to_view(s->view, s->model);
        if (!rc) rc = tdm_copy_(tt[j], tdm_to_device(dst->flat, tt[j]->device));
        tdm_scope_end();
        tdm_set_grad_enabled(prev);
    }
    return rc ? rc : tdm_optim_set_steps(to, tdm_optim_steps(from));
}

/* A whole optimizer over the caller's model holding the stages' state (replica 0's), the
 * model holding their weights. */
static tdm_optim *pipe_optim_gather(tdm_strategy *st) {
    pipeline *s = (pipeline *)st;
    tdm_module *seq = s->view ? s->view : s->model;
    tdm_paramset *sps = tdm_module_parameters(seq), *mps = tdm_module_parameters(s->model);
    tdm_optim *whole = sps ? s->make_optim(sps, s->optim_arg) : NULL;
    tdm_optim *out = whole && s->view ? s->make_optim(mps, s->optim_arg) : whole;
    int rc = out ? tdm_pipe_state_to(s->pipe, seq, whole) : tdm_last_status();
    if (!rc && s->view) rc = through_view(s, whole, out, true);
    if (!rc) rc = pipe_sync_model(st); /* the weights, over what the view carried */
    if (out != whole) tdm_optim_free(whole);
    tdm_optim *first = pipe_optim(st, 0); /* NULL: no stage has parameters */
    if (!rc && first) tdm_optim_set_lr(out, tdm_optim_lr(first));
    if (rc) tdm_optim_free(out);
    return rc ? NULL : out;
}

/* The caller's model and whole (over it: a checkpoint's) into every stage of every replica. */
static int pipe_push_whole(tdm_strategy *st, tdm_optim *whole) {
    pipeline *s = (pipeline *)st;
    if (!s->view) {
        int rc = tdm_pipe_state_from(s->pipe, s->model, whole);
        return rc ? rc : tdm_pipe_copy_from(s->pipe, s->model);
    }
    tdm_paramset *vps = tdm_module_parameters(s->view), *mps = tdm_module_parameters(s->model);
    tdm_optim *vo = vps && mps ? s->make_optim(vps, s->optim_arg) : NULL;
    tdm_tensor *kept = vo ? tdm_clone(mps->flat) : NULL; /* the weights, while state passes */
    int rc = kept ? through_view(s, whole, vo, false) : tdm_last_status();
    bool prev = tdm_set_grad_enabled(false);
    int back = kept ? tdm_copy_(mps->flat, kept) : TDM_OK;
    tdm_set_grad_enabled(prev);
    if (!rc) rc = back ? back : s->to_view(s->view, s->model);
    if (!rc) rc = tdm_pipe_state_from(s->pipe, s->view, vo);
    if (!rc) rc = tdm_pipe_copy_from(s->pipe, s->view);
    tdm_tensor_free(kept);
    tdm_optim_free(vo);
    return rc;
}

static void pipe_describe(tdm_strategy *st, int64_t batch, char *buf, size_t cap) {
    (void)batch;
    pipeline *s = (pipeline *)st;
    int k = tdm_pipe_stages(s->pipe);
    size_t n = (size_t)snprintf(buf, cap, "%d pipeline stages, layers", k);
    for (int i = 0; i < k && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, " %d-%d", tdm_pipe_stage_first_layer(s->pipe, i),
                              tdm_pipe_stage_first_layer(s->pipe, i + 1) - 1);
    if (n < cap)
        n += (size_t)snprintf(buf + n, cap - n, ", %d micro-batches, %s", s->micro_batches,
                              s->schedule == TDM_PIPE_GPIPE ? "gpipe" : "1f1b");
    if (n < cap && s->tp > 1)
        n += (size_t)snprintf(buf + n, cap - n, ", each stage over tp %d", s->tp);
    if (n < cap && st->ranks > 1) snprintf(buf + n, cap - n, ", %d replicas", st->ranks);
}

/* Every stage of every replica (every tensor-parallel rank of it) runs its forward on a thread
 * of its own; the caller's model runs the evaluation forward. */
static tdm_module *pipe_forward_module(tdm_strategy *st, int i) {
    pipeline *s = (pipeline *)st;
    int stages = tdm_pipe_stages(s->pipe), tp = tdm_pipe_tp(s->pipe), n = stages * st->ranks * tp;
    if (i == n) return s->model;
    return i < n ? tdm_pipe_rank_module(s->pipe, i / tp % stages, i / tp / stages, i % tp) : NULL;
}

static void pipe_destroy(tdm_strategy *st) {
    tdm_pipe_free(((pipeline *)st)->pipe); /* with every stage's optimizer */
    tdm_module_free(((pipeline *)st)->view);
    free(st);
}

/* ZeRO stage 1 over each stage's replicas; the gradients and weights are not sharded. */
static int pipe_set_shard(tdm_strategy *st, tdm_shard_kind kind, tdm_units_fn units_of) {
    (void)units_of;
    if (st->ranks == 1) return TDM_OK; /* nobody to share with: nothing is sharded */
    if (kind != TDM_SHARD_OPTIMIZER)
        return tdm_raise(TDM_ERR_ARG,
                         "strategy set_shard: a pipeline's replicas share their stages' "
                         "optimizer state (ZeRO stage 1) and nothing more: %s",
                         kind == TDM_SHARD_NONE ? "a sharding is not undone"
                                                : "their gradients and weights stay whole");
    int rc = tdm_pipe_shard_optimizer(((pipeline *)st)->pipe);
    if (!rc) st->shard = kind;
    return rc;
}

/* A pipeline's replicas average their stages' gradients in f32 (tdm_pipe makes their groups). */
static int pipe_set_reduce_dtype(tdm_strategy *st, tdm_dtype dt) {
    (void)st;
    if (dt == TDM_F32) return TDM_OK;
    return tdm_raise(TDM_ERR_ARG,
                     "strategy set_reduce_dtype: a pipeline's replicas average "
                     "their gradients in f32; %s is not supported there",
                     tdm_dtype_name(dt));
}

static const tdm_strategy_ops pipeline_ops = {
    .step = pipe_step,
    .forward = pipe_forward,
    .set_reduce_dtype = pipe_set_reduce_dtype,
    .set_shard = pipe_set_shard,
    .set_clip = pipe_set_clip,
    .set_scaler = pipe_set_scaler,
    .set_lr = pipe_set_lr,
    .sync_model = pipe_sync_model,
    .replica = pipe_replica,
    .optim = pipe_optim,
    .optim_gather = pipe_optim_gather,
    .push_whole = pipe_push_whole,
    .describe = pipe_describe,
    .forward_module = pipe_forward_module,
    .destroy = pipe_destroy,
};

tdm_strategy *tdm_strategy_pipeline_view(tdm_module *model, tdm_module *view,
                                         int (*to_model)(tdm_module *model, const tdm_module *view),
                                         int (*to_view)(tdm_module *view, const tdm_module *model),
                                         const tdm_pipe_opts *o, tdm_optim_factory make_optim,
                                         void *optim_arg) {
    if (!o || !model || (view && (!to_model || !to_view))) {
        tdm_module_free(view);
        return tdm_raise_null(TDM_ERR_ARG,
                              "strategy pipeline: NULL options, model, to_model or to_view");
    }
    pipeline *s = calloc(1, sizeof *s);
    if (!s) {
        tdm_module_free(view);
        return tdm_raise_null(TDM_ERR_NOMEM, "strategy pipeline: out of memory");
    }
    if (!(s->pipe = tdm_pipe_new(view ? view : model, o, make_optim, optim_arg))) {
        tdm_module_free(view);
        return free(s), NULL;
    }
    s->model = model, s->view = view, s->to_model = to_model, s->to_view = to_view;
    s->make_optim = make_optim, s->optim_arg = optim_arg;
    s->micro_batches = o->micro_batches, s->schedule = o->schedule, s->tp = o->tp;
    /* the stages hold the model in parts: checkpoints gather them (optim_gather) */
    s->base = (tdm_strategy){.ops = &pipeline_ops,
                             .replicas = 1,
                             .ranks = o->replicas > 0 ? o->replicas : 1,
                             .holds_parts = true};
    return &s->base;
}

tdm_strategy *tdm_strategy_pipeline(tdm_module *model, const tdm_pipe_opts *o,
                                    tdm_optim_factory make_optim, void *optim_arg) {
    return tdm_strategy_pipeline_view(model, NULL, NULL, NULL, o, make_optim, optim_arg);
}
