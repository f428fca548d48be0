/* DataParallel's sharding (ZeRO stages 1 to 3), internal: the public face is
 * tdm_strategy_set_shard, tdm_strategy_gather_params and tdm_strategy_release_params on a
 * tdm_strategy_data_parallel (tandem/strategy.h), the library's one sharding API; DDP's
 * per-rank calls (tdm_ddp_set_shard, ...) are what these run on every replica. */
#ifndef TDM_PARALLEL_DP_SHARD_H
#define TDM_PARALLEL_DP_SHARD_H

#include "tandem/parallel.h"

/* Shards the replicas' state over every device of every process (tdm_dp_new_distributed's
 * global group, or the GPUs' NCCL group). With TDM_SHARD_OPTIMIZER each replica's optimizer
 * keeps its shard of the state (tdm_optim_shard over the replicas' group) and, after the
 * gradients are averaged and clipped as before, steps its shard and shares it: the results
 * are bit for bit the unsharded ones. TDM_SHARD_GRADIENTS (ZeRO stage 2) also keeps only
 * each replica's shard of the averaged gradient (tdm_ddp_set_shard on every replica's DDP):
 * clipping takes the global norm from the shards, tdm_dp_accumulate adds each micro-batch's
 * average into the shard (equal to the unsharded sum's average to float rounding; a step
 * without accumulation is bit for bit the unsharded one). A collective over the processes
 * (every process calls it, between steps); call it after restoring the optimizers' state,
 * if any (their values are kept). CPU devices of one process already hold the optimizer
 * state once (replica 0's, stepped in shards: see tdm_dp_optim) and reduce each shard of the
 * gradients once, reading every replica's whole gradient in shared memory, so there the call
 * records the kind and changes nothing. Asking again for the current kind
 * does nothing. TDM_SHARD_PARAMETERS (ZeRO stage 3) runs tdm_ddp_set_shard's on every
 * replica (over the threads group, the two-level group, or NCCL), with the units
 * tdm_dp_set_shard_units names; the parameters are then whole only between
 * tdm_dp_gather_params and tdm_dp_release_params. CPU devices of one process then leave their
 * shared-memory update: every replica's optimizer first takes replica 0's state and learning
 * rate, then keeps its shard, and gradients are averaged by DDP's buckets (the weights are
 * still bit for bit the unsharded ones without accumulation). Fails with TDM_ERR_ARG for a
 * NULL dp or an unknown kind; TDM_ERR_STATE for a kind below
 * the current one (a sharded state stays sharded: tdm_dp_optim_gather copies it whole); a
 * replica that cannot shard fails the call on every process (naming its device). */
int tdm_dp_set_shard(tdm_dp *dp, tdm_shard_kind kind);
/* The units each replica shards its parameters by (tdm_ddp_set_shard_units, from units_of on
 * that replica), before tdm_dp_set_shard with TDM_SHARD_PARAMETERS; NULL: DDP's default.
 * TDM_ERR_STATE once the parameters are sharded. */
int tdm_dp_set_shard_units(tdm_dp *dp, tdm_units_fn units_of);
/* Under ZeRO stage 3, every replica's parameters whole (tdm_ddp_gather_params) until
 * tdm_dp_release_params: to save or load the model (tdm_dp_replica(dp, 0)) whole. Rounds on
 * every replica and collectives over the processes: every process calls them. No-ops
 * otherwise. */
int tdm_dp_gather_params(tdm_dp *dp);
int tdm_dp_release_params(tdm_dp *dp);
tdm_shard_kind tdm_dp_shard(const tdm_dp *dp);

#endif
