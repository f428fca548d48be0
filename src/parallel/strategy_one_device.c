/* The one-device strategy: the model trained in place on its device, on the caller's thread. */
#include "parallel/strategy.h"

#include "core/core.h"
#include "tandem/trace.h"

#include <stdlib.h>

typedef struct {
    tdm_strategy base;
    tdm_module *model;
    tdm_paramset *ps;
    tdm_optim *opt;
    tdm_device dev;
} one_device;

static int one_clip(tdm_strategy *st) {
    if (st->clip <= 0) return TDM_OK;
    return tdm_clip_grad_norm(((one_device *)st)->ps, st->clip, false, NULL) ? -1 : TDM_OK;
}

/* A CPU device marks the step's gradients stale rather than zeroing them (backward then writes
 * each one instead of adding into zeros; tdm_paramset_mark_grads_stale). A GPU zeroes them. */
static int one_step(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                    void *loss_arg, bool first, bool last, float *loss) {
    one_device *s = (one_device *)st;
    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    if (!tdm_device_equal(x->device, s->dev)) {
        x = tdm_to_device(x, s->dev);
        target = tdm_to_device(target, s->dev);
    }
    bool mark = first && s->dev.type == TDM_CPU;
    if (mark) tdm_paramset_mark_grads_stale(s->ps);
    int rc = first && !mark ? tdm_optim_zero_grad(s->opt) : TDM_OK;
    if (!rc && (!x || !target)) rc = tdm_last_status();
    tdm_trace_begin("forward");
    tdm_tensor *out = rc ? NULL : tdm_module_forward(s->model, x);
    tdm_tensor *l = out ? loss_fn(out, target, 0, loss_arg) : NULL;
    tdm_trace_end();
    /* fp16: the backward starts from loss * scale (tdm_grad_scaler) */
    tdm_tensor *root = l && st->scaler ? tdm_grad_scaler_scale(st->scaler, l) : l;
    tdm_trace_begin("backward");
    rc = rc ? rc : !root ? -1 : tdm_backward(root);
    if (mark && tdm_paramset_settle_grads(s->ps) && !rc) rc = -1;
    tdm_trace_end();
    tdm_trace_begin("optimizer");
    if (!rc && last && st->scaler) rc = tdm_strategy_amp_update(st, s->opt, NULL, one_clip);
    if (!rc && last && !st->scaler) rc = one_clip(st);
    if (!rc && last && !st->scaler) rc = tdm_optim_step(s->opt);
    tdm_trace_end();
    if (!rc && loss) *loss = tdm_item(l);
    tdm_scope_end();
    return rc;
}

static int one_forward(tdm_strategy *st, tdm_tensor *x, tdm_tensor **out) {
    *out = tdm_module_forward(((one_device *)st)->model, x);
    return *out ? TDM_OK : tdm_last_status();
}

static void one_set_lr(tdm_strategy *st, float lr) {
    tdm_optim_set_lr(((one_device *)st)->opt, lr);
}

static tdm_module *one_replica(tdm_strategy *st, int r) {
    (void)r;
    return ((one_device *)st)->model;
}

static tdm_optim *one_optim(tdm_strategy *st, int r) {
    (void)r;
    return ((one_device *)st)->opt;
}

/* Sharding over one rank: nothing to share, nothing changes (the kind stays none). */
static int one_set_shard(tdm_strategy *st, tdm_shard_kind kind, tdm_units_fn units_of) {
    (void)st, (void)kind, (void)units_of;
    return TDM_OK;
}

static void one_destroy(tdm_strategy *st) {
    tdm_optim_free(((one_device *)st)->opt);
    free(st);
}

static const tdm_strategy_ops one_device_ops = {
    .step = one_step,
    .forward = one_forward,
    .set_shard = one_set_shard,
    .set_lr = one_set_lr,
    .replica = one_replica,
    .optim = one_optim,
    .destroy = one_destroy,
};

tdm_strategy *tdm_strategy_one_device(tdm_module *model, tdm_optim_factory make_optim,
                                      void *optim_arg) {
    if (!model || !make_optim)
        return tdm_raise_null(TDM_ERR_ARG, "strategy one_device: NULL %s",
                              model ? "optimizer factory" : "model");
    tdm_paramset *ps = tdm_module_parameters(model);
    if (!ps) return NULL;
    one_device *s = calloc(1, sizeof *s);
    if (!s) return tdm_raise_null(TDM_ERR_NOMEM, "strategy one_device: out of memory");
    if (!(s->opt = make_optim(ps, optim_arg))) return free(s), NULL;
    s->base = (tdm_strategy){.ops = &one_device_ops,
                             .replicas = 1,
                             .ranks = 1,
                             .loss_on_caller = true,
                             .accumulates = true};
    s->model = model, s->ps = ps, s->dev = ps->flat ? ps->flat->device : tdm_cpu(0);
    return &s->base;
}
