/* The DDP strategy: one device per process, the model wrapped in a tdm_ddp over the processes'
 * group, stepped on the caller's thread; the ZeRO stages are tdm_ddp_set_shard's. */
#include "parallel/strategy.h"

#include "core/core.h"
#include "tandem/trace.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct {
    tdm_strategy base;
    tdm_module *model;
    tdm_group *g;
    tdm_ddp *ddp;
    tdm_optim *opt;
} distributed;

/* Under stage 2 the norm comes from the shards. */
static int ddp_clip(tdm_strategy *st) {
    if (st->clip <= 0) return TDM_OK;
    return tdm_ddp_clip_grad_norm(((distributed *)st)->ddp, st->clip, NULL) ? -1 : TDM_OK;
}

/* Batch norm over the global batch (SyncBatchNorm) through the parallel context: the rows of
 * rank r are taken as [r * b, (r + 1) * b) of the processes' batch. */
static int ddp_step(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                    void *loss_arg, bool first, bool last, float *loss) {
    distributed *s = (distributed *)st;
    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    int64_t b = x->ndim ? x->shape[0] : 0;
    int rc = first ? tdm_optim_zero_grad(s->opt) : TDM_OK;
    if (!rc)
        rc = tdm_parallel_context_set(s->g, tdm_group_rank(s->g) * b, tdm_group_size(s->g) * b);
    tdm_trace_begin("forward");
    tdm_tensor *out = rc ? NULL : tdm_ddp_forward(s->ddp, x);
    tdm_tensor *l = out ? loss_fn(out, target, 0, loss_arg) : NULL;
    tdm_trace_end();
    /* fp16: the backward starts from loss * scale (tdm_grad_scaler) */
    tdm_tensor *root = l && st->scaler ? tdm_grad_scaler_scale(st->scaler, l) : l;
    tdm_trace_begin("backward");
    tdm_ddp_set_sync(s->ddp, last); /* the step's other micro-batches keep theirs (no_sync) */
    rc = rc ? rc : !root ? -1 : tdm_ddp_backward(s->ddp, root);
    tdm_parallel_context_clear();
    tdm_trace_end();
    tdm_trace_begin("optimizer"); /* the gradients are averaged: every rank sees one inf */
    if (!rc && last && st->scaler) rc = tdm_strategy_amp_update(st, s->opt, s->ddp, ddp_clip);
    if (!rc && last && !st->scaler) rc = ddp_clip(st);
    if (!rc && last && !st->scaler) rc = tdm_optim_step(s->opt);
    tdm_trace_end();
    if (!rc && loss) *loss = tdm_item(l);
    tdm_scope_end();
    return rc;
}

/* Evaluation runs the model itself: no buffers broadcast, no gradient hooks. */
static int ddp_forward(tdm_strategy *st, tdm_tensor *x, tdm_tensor **out) {
    *out = tdm_module_forward(((distributed *)st)->model, x);
    return *out ? TDM_OK : tdm_last_status();
}

static int ddp_set_shard(tdm_strategy *st, tdm_shard_kind kind, tdm_units_fn units_of) {
    distributed *s = (distributed *)st;
    int rc = kind == TDM_SHARD_PARAMETERS && units_of
                 ? tdm_ddp_set_shard_units_of(s->ddp, s->model, units_of)
                 : TDM_OK;
    if (rc) return rc;
    rc = tdm_ddp_set_shard(s->ddp, s->opt, kind);
    if (!rc) st->shard = kind;
    if (!rc) st->state_split = true;
    return rc;
}

static void ddp_set_lr(tdm_strategy *st, float lr) {
    tdm_optim_set_lr(((distributed *)st)->opt, lr);
}

static tdm_module *ddp_replica(tdm_strategy *st, int r) {
    (void)r;
    return ((distributed *)st)->model;
}

static tdm_optim *ddp_optim(tdm_strategy *st, int r) {
    (void)r;
    return ((distributed *)st)->opt;
}

static int ddp_gather(tdm_strategy *st) {
    return tdm_ddp_gather_params(((distributed *)st)->ddp);
}

static int ddp_release(tdm_strategy *st) {
    return tdm_ddp_release_params(((distributed *)st)->ddp);
}

static void ddp_describe(tdm_strategy *st, int64_t batch, char *buf, size_t cap) {
    if (st->ranks > 1) /* one rank: nothing to say */
        snprintf(buf, cap, "data parallel, %lld samples per device per step",
                 (long long)(batch / st->ranks));
}

static void ddp_destroy(tdm_strategy *st) {
    distributed *s = (distributed *)st;
    tdm_ddp_free(s->ddp);
    tdm_optim_free(s->opt);
    free(s);
}

static int ddp_set_reduce_dtype(tdm_strategy *st, tdm_dtype dt) {
    return tdm_ddp_set_reduce_dtype(((distributed *)st)->ddp, dt);
}

static const tdm_strategy_ops distributed_ops = {
    .step = ddp_step,
    .forward = ddp_forward,
    .set_shard = ddp_set_shard,
    .set_reduce_dtype = ddp_set_reduce_dtype,
    .set_lr = ddp_set_lr,
    .replica = ddp_replica,
    .optim = ddp_optim,
    .gather_params = ddp_gather,
    .release_params = ddp_release,
    .describe = ddp_describe,
    .destroy = ddp_destroy,
};

tdm_strategy *tdm_strategy_distributed(tdm_module *model, tdm_group *g, const tdm_ddp_opts *o,
                                       tdm_optim_factory make_optim, void *optim_arg) {
    if (!model || !g || !make_optim)
        return tdm_raise_null(TDM_ERR_ARG, "strategy distributed: NULL %s",
                              !model ? "model"
                              : !g   ? "group"
                                     : "optimizer factory");
    distributed *s = calloc(1, sizeof *s);
    if (!s) return tdm_raise_null(TDM_ERR_NOMEM, "strategy distributed: out of memory");
    tdm_ddp_opts dflt = tdm_ddp_defaults();
    s->model = model, s->g = g;
    /* the wrapper first: it broadcasts rank 0's weights, which the optimizer then starts from */
    if (!(s->ddp = tdm_ddp_new(model, g, o ? o : &dflt))) return free(s), NULL;
    tdm_paramset *ps = tdm_module_parameters(model);
    if (!ps || !(s->opt = make_optim(ps, optim_arg))) {
        tdm_ddp_free(s->ddp);
        free(s);
        return NULL;
    }
    s->base = (tdm_strategy){.ops = &distributed_ops,
                             .replicas = 1,
                             .ranks = tdm_group_size(g),
                             .loss_on_caller = true,
                             .accumulates = true};
    return &s->base;
}
