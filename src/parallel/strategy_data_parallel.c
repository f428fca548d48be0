/* The DataParallel strategy: a replica per device of this process (tdm_dp), joined with the
 * same in every other process; the replicas' threads run the loss, so it lands on the host. */
#include "parallel/strategy.h"

#include "core/core.h"
#include "parallel/dp_shard.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct {
    tdm_strategy base;
    tdm_dp *dp;
    tdm_group *processes;
    tdm_device first;
} data_parallel;

static int dp_step(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                   void *loss_arg, bool first, bool last, float *loss) {
    (void)first; /* tdm_dp counts its micro-batches itself */
    tdm_dp *dp = ((data_parallel *)st)->dp;
    if (!last) return tdm_dp_accumulate(dp, x, target, loss_fn, loss_arg, loss);
    int rc = tdm_dp_step(dp, x, target, loss_fn, loss_arg, loss);
    st->skipped = tdm_dp_step_skipped(dp);
    return rc;
}

static int dp_set_scaler(tdm_strategy *st, tdm_grad_scaler *s) {
    return tdm_dp_set_grad_scaler(((data_parallel *)st)->dp, s);
}

static int dp_forward(tdm_strategy *st, tdm_tensor *x, tdm_tensor **out) {
    return tdm_dp_forward(((data_parallel *)st)->dp, x, out);
}

/* CPU devices of one process already hold the optimizer state once (replica 0's, stepped in
 * shards) below stage 3: tdm_dp_set_shard records the kind and the state stays whole. */
static int dp_set_shard(tdm_strategy *st, tdm_shard_kind kind, tdm_units_fn units_of) {
    data_parallel *s = (data_parallel *)st;
    if (kind == TDM_SHARD_PARAMETERS && tdm_dp_set_shard_units(s->dp, units_of))
        return tdm_last_status();
    int rc = tdm_dp_set_shard(s->dp, kind);
    bool shared_memory = !s->processes && s->first.type == TDM_CPU && kind != TDM_SHARD_PARAMETERS;
    if (!rc) st->shard = kind;
    if (!rc) st->state_split = !shared_memory;
    return rc;
}

static int dp_set_reduce_dtype(tdm_strategy *st, tdm_dtype dt) {
    return tdm_dp_set_reduce_dtype(((data_parallel *)st)->dp, dt);
}

static int dp_set_clip(tdm_strategy *st) {
    return tdm_dp_set_clip_grad_norm(((data_parallel *)st)->dp, st->clip);
}

static void dp_set_lr(tdm_strategy *st, float lr) {
    tdm_dp *dp = ((data_parallel *)st)->dp;
    for (int r = 0; r < tdm_dp_devices(dp); r++)
        if (tdm_dp_optim(dp, r)) tdm_optim_set_lr(tdm_dp_optim(dp, r), lr);
}

static tdm_module *dp_replica(tdm_strategy *st, int r) {
    return tdm_dp_replica(((data_parallel *)st)->dp, r);
}

static tdm_optim *dp_optim(tdm_strategy *st, int r) {
    return tdm_dp_optim(((data_parallel *)st)->dp, r);
}

static tdm_optim *dp_optim_gather(tdm_strategy *st) {
    return tdm_dp_optim_gather(((data_parallel *)st)->dp);
}

static int dp_gather(tdm_strategy *st) {
    return tdm_dp_gather_params(((data_parallel *)st)->dp);
}

static int dp_release(tdm_strategy *st) {
    return tdm_dp_release_params(((data_parallel *)st)->dp);
}

static void dp_describe(tdm_strategy *st, int64_t batch, char *buf, size_t cap) {
    if (st->ranks > 1) /* one rank: nothing to say */
        snprintf(buf, cap, "data parallel, %lld samples per device per step",
                 (long long)(batch / st->ranks));
}

static void dp_destroy(tdm_strategy *st) {
    tdm_dp_free(((data_parallel *)st)->dp); /* with every replica's optimizer */
    free(st);
}

static const tdm_strategy_ops data_parallel_ops = {
    .step = dp_step,
    .forward = dp_forward,
    .set_shard = dp_set_shard,
    .set_reduce_dtype = dp_set_reduce_dtype,
    .set_clip = dp_set_clip,
    .set_scaler = dp_set_scaler,
    .set_lr = dp_set_lr,
    .replica = dp_replica,
    .optim = dp_optim,
    .optim_gather = dp_optim_gather,
    .gather_params = dp_gather,
    .release_params = dp_release,
    .describe = dp_describe,
    .destroy = dp_destroy,
};

tdm_strategy *tdm_strategy_data_parallel(tdm_module *model, const tdm_device *devices, int n,
                                         tdm_group *processes, tdm_optim_factory make_optim,
                                         void *optim_arg) {
    if (!devices || n < 1)
        return tdm_raise_null(TDM_ERR_ARG, "strategy data_parallel: %s",
                              devices ? "no devices" : "NULL devices");
    data_parallel *s = calloc(1, sizeof *s);
    if (!s) return tdm_raise_null(TDM_ERR_NOMEM, "strategy data_parallel: out of memory");
    s->dp = tdm_dp_new_distributed(model, devices, n, processes, make_optim, optim_arg);
    if (!s->dp) return free(s), NULL;
    s->processes = processes, s->first = devices[0];
    int procs = processes ? tdm_group_size(processes) : 1;
    s->base = (tdm_strategy){
        .ops = &data_parallel_ops, .replicas = n, .ranks = n * procs, .accumulates = true};
    return &s->base;
}
