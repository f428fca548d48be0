/* tdm_strategy's public calls (tandem/strategy.h): the arguments checked once, the micro-batch
 * count kept, then the strategy's own entry (parallel/strategy.h). The strategies themselves
 * are the strategy_*.c files. */
#include "parallel/strategy.h"

#include "core/core.h"

#include <math.h>
#include <stdio.h>

static int run_micro(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                     void *loss_arg, bool last, float *loss, const char *what) {
    if (!st || !x || !target || !loss_fn)
        return tdm_raise(TDM_ERR_ARG, "strategy %s: NULL %s", what,
                         !st        ? "strategy"
                         : !loss_fn ? "loss function"
                                    : "batch");
    if (!last && !st->accumulates)
        return tdm_raise(TDM_ERR_STATE,
                         "strategy accumulate: a pipeline accumulates its micro-batches itself "
                         "(one tdm_strategy_step per batch)");
    st->user_loss = loss_fn, st->user_arg = loss_arg;
    int rc = st->ops->step(st, x, target, tdm_strategy_amp_loss, st, st->micro == 0, last, loss);
    st->micro = last || rc ? 0 : st->micro + 1;
    return rc;
}

int tdm_strategy_step(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                      void *loss_arg, float *loss) {
    return run_micro(st, x, target, loss_fn, loss_arg, true, loss, "step");
}

int tdm_strategy_accumulate(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target,
                            tdm_loss_fn loss_fn, void *loss_arg, float *loss) {
    return run_micro(st, x, target, loss_fn, loss_arg, false, loss, "accumulate");
}

bool tdm_strategy_loss_on_caller(const tdm_strategy *st) {
    return st && st->loss_on_caller;
}

int tdm_strategy_forward(tdm_strategy *st, tdm_tensor *x, tdm_tensor **out) {
    if (out) *out = NULL;
    if (!st || !x || !out)
        return tdm_raise(TDM_ERR_ARG, "strategy forward: NULL %s",
                         !st  ? "strategy"
                         : !x ? "input"
                              : "output");
    return st->ops->forward(st, x, out);
}

int tdm_strategy_sync_model(tdm_strategy *st) {
    if (!st) return tdm_raise(TDM_ERR_ARG, "strategy sync_model: NULL strategy");
    return st->ops->sync_model ? st->ops->sync_model(st) : TDM_OK;
}

int tdm_strategy_set_shard(tdm_strategy *st, tdm_shard_kind kind, tdm_units_fn units_of) {
    if (!st) return tdm_raise(TDM_ERR_ARG, "strategy set_shard: NULL strategy");
    if (kind < TDM_SHARD_NONE || kind > TDM_SHARD_PARAMETERS)
        return tdm_raise(TDM_ERR_ARG, "strategy set_shard: unknown kind %d", (int)kind);
    if (kind == st->shard) return TDM_OK;
    if (!st->ops->set_shard)
        return tdm_raise(TDM_ERR_ARG, "strategy set_shard: a pipeline's stages step optimizers "
                                      "of their own, which are not sharded");
    int rc = st->ops->set_shard(st, kind, units_of);
    /* FSDP hooks the root module: ours go around its new ones */
    if (!rc && st->precision != TDM_F32) rc = tdm_strategy_amp_hooks(st, st->precision);
    return rc;
}

tdm_shard_kind tdm_strategy_shard(const tdm_strategy *st) {
    return st ? st->shard : TDM_SHARD_NONE;
}

bool tdm_strategy_state_split(const tdm_strategy *st) {
    return st && st->state_split;
}

int tdm_strategy_set_clip_grad_norm(tdm_strategy *st, float max_norm) {
    if (!st) return tdm_raise(TDM_ERR_ARG, "strategy clip_grad_norm: NULL strategy");
    if (!(max_norm >= 0) || !isfinite(max_norm))
        return tdm_raise(TDM_ERR_ARG, "strategy clip_grad_norm: max_norm %g must be >= 0",
                         max_norm);
    float before = st->clip;
    st->clip = max_norm;
    int rc = st->ops->set_clip ? st->ops->set_clip(st) : TDM_OK;
    if (rc) st->clip = before;
    return rc;
}

int tdm_strategy_set_reduce_dtype(tdm_strategy *st, tdm_dtype dt) {
    if (!st) return tdm_raise(TDM_ERR_ARG, "strategy set_reduce_dtype: NULL strategy");
    if (dt != TDM_F32 && dt != TDM_BF16)
        return tdm_raise(TDM_ERR_ARG, "strategy set_reduce_dtype: %s (expected f32 or bf16)",
                         tdm_dtype_name(dt));
    return st->ops->set_reduce_dtype ? st->ops->set_reduce_dtype(st, dt) : TDM_OK;
}

int tdm_strategy_set_graphs(tdm_strategy *st, int warmup) {
    if (!st) return tdm_raise(TDM_ERR_ARG, "strategy set_graphs: NULL strategy");
    if (warmup < 1)
        return tdm_raise(TDM_ERR_ARG, "strategy set_graphs: %d warm-up steps (at least 1)", warmup);
    if (!st->ops->set_graphs)
        return tdm_raise(TDM_ERR_STATE,
                         "strategy set_graphs: CUDA graphs record one GPU's step, not a step over "
                         "%d devices or processes (not yet)",
                         st->ranks > st->replicas ? st->ranks : st->replicas);
    return st->ops->set_graphs(st, warmup);
}

int64_t tdm_strategy_graph_replays(const tdm_strategy *st, const char **why) {
    if (why) *why = NULL;
    return st && st->ops->graph_replays ? st->ops->graph_replays(st, why) : 0;
}

void tdm_strategy_set_lr(tdm_strategy *st, float lr) {
    if (st && !isnan(lr)) st->ops->set_lr(st, lr);
}

int tdm_strategy_replicas(const tdm_strategy *st) {
    return st ? st->replicas : 0;
}

tdm_module *tdm_strategy_replica(tdm_strategy *st, int r) {
    return st && r >= 0 && r < st->replicas ? st->ops->replica(st, r) : NULL;
}

tdm_optim *tdm_strategy_optim(tdm_strategy *st, int r) {
    return st && r >= 0 && r < st->replicas ? st->ops->optim(st, r) : NULL;
}

tdm_optim *tdm_strategy_optim_gather(tdm_strategy *st) {
    if (!st) return tdm_raise_null(TDM_ERR_ARG, "strategy optim_gather: NULL strategy");
    return st->ops->optim_gather ? st->ops->optim_gather(st)
                                 : tdm_optim_gather(st->ops->optim(st, 0));
}

static _Thread_local tdm_module *loss_module;

tdm_module *tdm_strategy_loss_module(void) {
    return loss_module;
}

void tdm_strategy_set_loss_module(tdm_module *m) {
    loss_module = m;
}

bool tdm_strategy_holds_parts(const tdm_strategy *st) {
    return st && st->holds_parts;
}

int tdm_strategy_push_whole(tdm_strategy *st, tdm_optim *whole) {
    if (!st) return tdm_raise(TDM_ERR_ARG, "strategy push_whole: NULL strategy");
    return st->ops->push_whole ? st->ops->push_whole(st, whole) : TDM_OK;
}

int tdm_strategy_gather_params(tdm_strategy *st) {
    if (!st) return tdm_raise(TDM_ERR_ARG, "strategy gather_params: NULL strategy");
    bool sharded = st->shard == TDM_SHARD_PARAMETERS && st->ops->gather_params;
    return sharded ? st->ops->gather_params(st) : TDM_OK;
}

int tdm_strategy_release_params(tdm_strategy *st) {
    if (!st) return tdm_raise(TDM_ERR_ARG, "strategy release_params: NULL strategy");
    bool sharded = st->shard == TDM_SHARD_PARAMETERS && st->ops->release_params;
    return sharded ? st->ops->release_params(st) : TDM_OK;
}

int tdm_strategy_ranks(const tdm_strategy *st) {
    return st ? st->ranks : 0;
}

void tdm_strategy_memory_get(tdm_strategy *st, tdm_strategy_memory *m) {
    *m = (tdm_strategy_memory){0};
    tdm_module *model = tdm_strategy_replica(st, 0);
    tdm_optim *o = tdm_strategy_optim(st, 0);
    tdm_paramset *ps = model ? tdm_module_parameters(model) : NULL;
    if (!ps || !o) return;
    tdm_tensor *state[4];
    int n = tdm_optim_state(o, NULL, state, 4);
    for (int k = 0; k < n; k++) m->state += tdm_numel(state[k]) * 4;
    int64_t lo = 0, hi = ps->total, whole = ps->total * 4;
    if (st->state_split) tdm_optim_shard_range(o, &lo, &hi);
    m->state_whole = (int64_t)(n > 0 ? n : 0) * whole;
    m->params_whole = m->grads_whole = whole;
    bool split = st->state_split;
    m->grads = split && st->shard >= TDM_SHARD_GRADIENTS ? (hi - lo) * 4 : whole;
    m->params = split && st->shard >= TDM_SHARD_PARAMETERS ? (hi - lo) * 4 : whole;
}

char *tdm_strategy_describe(tdm_strategy *st, int64_t batch, char *buf, size_t cap) {
    if (!buf || cap == 0) return buf;
    buf[0] = '\0';
    if (st && st->ops->describe) st->ops->describe(st, batch, buf, cap);
    return buf;
}

int tdm_strategy_set_precision(tdm_strategy *st, tdm_dtype dt) {
    if (!st) return tdm_raise(TDM_ERR_ARG, "strategy set_precision: NULL strategy");
    if (dt != TDM_F32 && dt != TDM_BF16 && dt != TDM_F16)
        return tdm_raise(TDM_ERR_DTYPE, "strategy set_precision: dtype %s is not f32, bf16 or f16",
                         tdm_dtype_name(dt));
    if (dt == TDM_F16 && !st->scaler && !(st->scaler = tdm_grad_scaler_new(NULL)))
        return tdm_last_status();
    int rc = tdm_strategy_amp_hooks(st, dt);
    if (!rc && st->ops->set_scaler) rc = st->ops->set_scaler(st, dt == TDM_F16 ? st->scaler : NULL);
    if (rc) return rc;
    if (dt != TDM_F16) tdm_grad_scaler_free(st->scaler), st->scaler = NULL;
    st->precision = dt;
    return TDM_OK;
}

tdm_dtype tdm_strategy_precision(const tdm_strategy *st) {
    return st ? st->precision : TDM_F32;
}

tdm_grad_scaler *tdm_strategy_grad_scaler(tdm_strategy *st) {
    return st ? st->scaler : NULL;
}

bool tdm_strategy_step_skipped(const tdm_strategy *st) {
    return st && st->skipped;
}

void tdm_strategy_free(tdm_strategy *st) {
    if (!st) return;
    tdm_strategy_amp_free(st);
    st->ops->destroy(st);
}
