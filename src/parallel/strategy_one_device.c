/* The one-device strategy: the model trained in place on its device, on the caller's thread. */
#include "parallel/strategy.h"

#include "core/core.h"
#include "tandem/runtime.h"
#include "tandem/trace.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct {
    tdm_strategy base;
    tdm_module *model;
    tdm_paramset *ps;
    tdm_optim *opt;
    tdm_device dev;
    /* CUDA graphs (tdm_strategy_set_graphs): after graph_warmup eager steps the next one is
     * recorded; gx, gt: the recording's batch, refilled before each replay; gloss its loss */
    int graph_warmup;
    int64_t graph_eager, graph_replays;
    tdm_graph *graph;
    tdm_tensor *gx, *gt, *gloss;
    tdm_loss_fn rec_loss_fn; /* the recorded step's, while it records */
    void *rec_loss_arg;
    char graph_why[256]; /* the recording's failure: graphs off */
} one_device;

/* ---- CUDA graphs ------------------------------------------------------------------------ */

/* The recorded step: the gradients zeroed, forward, loss and backward of the recording's
 * batch; its loss kept out of the scope (each replay writes it). */
static int record_step(void *arg) {
    one_device *s = arg;
    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    int rc = tdm_optim_zero_grad(s->opt);
    tdm_tensor *out = rc ? NULL : tdm_module_forward(s->model, s->gx);
    tdm_tensor *l = out ? s->rec_loss_fn(out, s->gt, 0, s->rec_loss_arg) : NULL;
    rc = rc ? rc : !l ? tdm_last_status() : tdm_backward(l);
    if (!rc && !(s->gloss = tdm_scope_keep(l))) rc = tdm_last_status();
    tdm_scope_end();
    return rc;
}

/* A caller-owned tensor of t's shape and dtype on dev. */
static tdm_tensor *static_like(const tdm_tensor *t, tdm_device dev) {
    tdm_tensor *e = tdm_empty(tdm_shape_of(t), t->dtype, dev);
    return e ? tdm_scope_keep(e) : NULL;
}

/* Records the step of batch (x, target); on failure graphs go off, saying why (the step then
 * runs eagerly). TDM_OK either way unless the failure is not the recording's. */
static int graph_record(one_device *s, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                        void *loss_arg) {
    if (!(s->gx = static_like(x, s->dev)) || !(s->gt = static_like(target, s->dev)))
        return tdm_last_status();
    s->rec_loss_fn = loss_fn, s->rec_loss_arg = loss_arg;
    s->graph = tdm_graph_capture(s->dev, record_step, s);
    if (s->graph) return TDM_OK;
    snprintf(s->graph_why, sizeof s->graph_why, "%s", tdm_last_error());
    if (s->gloss) tdm_tensor_free(s->gloss);
    tdm_tensor_free(s->gx), tdm_tensor_free(s->gt);
    s->gx = s->gt = s->gloss = NULL;
    return TDM_OK;
}

/* Whether the recorded step takes batch (x, target): the same shapes and dtypes. */
static bool graph_fits(const one_device *s, const tdm_tensor *x, const tdm_tensor *target) {
    return s->graph && x->dtype == s->gx->dtype && target->dtype == s->gt->dtype &&
           tdm_same_shape(x, s->gx) && tdm_same_shape(target, s->gt);
}

static int one_clip(tdm_strategy *st);

/* The step replayed: the batch copied into the recording's, the graph, then the update. */
static int graph_replay(one_device *s, tdm_tensor *x, tdm_tensor *target, float *loss) {
    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    if (!tdm_device_equal(x->device, s->dev)) x = tdm_to_device(x, s->dev);
    if (!tdm_device_equal(target->device, s->dev)) target = tdm_to_device(target, s->dev);
    int rc = !x || !target || tdm_copy_(s->gx, x) || tdm_copy_(s->gt, target) ? tdm_last_status()
                                                                              : TDM_OK;
    tdm_trace_begin("graph replay");
    if (!rc) rc = tdm_graph_replay(s->graph);
    tdm_trace_end();
    tdm_trace_begin("optimizer");
    if (!rc) rc = one_clip(&s->base);
    if (!rc) rc = tdm_optim_step(s->opt);
    tdm_trace_end();
    if (!rc && loss) *loss = tdm_item(s->gloss);
    if (!rc) s->graph_replays++;
    tdm_scope_end();
    return rc;
}

/* Whether this step replays the graph (recording it first when its turn has come). Steps of
 * several micro-batches and fp16's scaled ones run eagerly. */
static int graph_turn(one_device *s, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                      void *loss_arg, bool first, bool last, bool *replay) {
    *replay = false;
    if (!s->graph_warmup || s->graph_why[0] || !first || !last || s->base.scaler) return TDM_OK;
    if (!s->graph && s->graph_eager++ < s->graph_warmup) return TDM_OK;
    if (!s->graph) {
        int rc = graph_record(s, x, target, loss_fn, loss_arg);
        if (rc) return rc;
    }
    *replay = graph_fits(s, x, target);
    return TDM_OK;
}

static int one_set_graphs(tdm_strategy *st, int warmup) {
    one_device *s = (one_device *)st;
    char d[16];
    if (s->dev.type != TDM_CUDA)
        return tdm_raise(TDM_ERR_DEVICE,
                         "strategy set_graphs: CUDA graphs record a GPU's step; "
                         "the model is on %s",
                         tdm_device_str(s->dev, d));
    s->graph_warmup = warmup;
    return TDM_OK;
}

static int64_t one_graph_replays(const tdm_strategy *st, const char **why) {
    const one_device *s = (const one_device *)st;
    if (why) *why = s->graph_why[0] ? s->graph_why : NULL;
    return s->graph_replays;
}

/* ---- the step ---------------------------------------------------------------------------- */

/* The step's gradients are marked stale rather than zeroed (backward then writes each one
 * instead of adding into zeros; tdm_paramset_mark_grads_stale): on a GPU too, where it saves a
 * pass over the flat gradient and a read of its zeros per parameter (under autocast each bf16
 * weight gradient is converted into its .grad rather than added). A recorded step zeroes them:
 * the marks are the host's, which a replay would not see. */
static int one_step(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                    void *loss_arg, bool first, bool last, float *loss) {
    one_device *s = (one_device *)st;
    bool replay;
    int grc = graph_turn(s, x, target, loss_fn, loss_arg, first, last, &replay);
    if (grc || replay) return grc ? grc : graph_replay(s, x, target, loss);
    if (tdm_scope_begin() != TDM_OK) return tdm_last_status();
    if (!tdm_device_equal(x->device, s->dev)) {
        x = tdm_to_device(x, s->dev);
        target = tdm_to_device(target, s->dev);
    }
    if (first) tdm_paramset_mark_grads_stale(s->ps);
    int rc = !x || !target ? tdm_last_status() : TDM_OK;
    tdm_trace_begin("forward");
    tdm_tensor *out = rc ? NULL : tdm_module_forward(s->model, x);
    tdm_tensor *l = out ? loss_fn(out, target, 0, loss_arg) : NULL;
    tdm_trace_end();
    /* fp16: the backward starts from loss * scale (tdm_grad_scaler) */
    tdm_tensor *root = l && st->scaler ? tdm_grad_scaler_scale(st->scaler, l) : l;
    tdm_trace_begin("backward");
    rc = rc ? rc : !root ? -1 : tdm_backward(root);
    if (first && tdm_paramset_settle_grads(s->ps) && !rc) rc = -1;
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

static int one_clip(tdm_strategy *st) {
    if (st->clip <= 0) return TDM_OK;
    return tdm_clip_grad_norm(((one_device *)st)->ps, st->clip, false, NULL) ? -1 : TDM_OK;
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
    one_device *s = (one_device *)st;
    tdm_graph_free(s->graph); /* waits for a replay still running */
    tdm_tensor_free(s->gx), tdm_tensor_free(s->gt), tdm_tensor_free(s->gloss);
    tdm_optim_free(s->opt);
    free(st);
}

static const tdm_strategy_ops one_device_ops = {
    .step = one_step,
    .forward = one_forward,
    .set_graphs = one_set_graphs,
    .graph_replays = one_graph_replays,
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
