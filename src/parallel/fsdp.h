/* ZeRO stage 3 inside DDP (ddp.c): the parameters sharded by unit, gathered around each
 * unit's forward and backward (fsdp.c). Internal; the public face is tdm_ddp_set_shard with
 * TDM_SHARD_PARAMETERS, tdm_ddp_set_shard_units and tdm_ddp_gather_params in tandem/parallel.h. */
#ifndef TDM_PARALLEL_FSDP_H
#define TDM_PARALLEL_FSDP_H

#include "parallel/group.h"
#include "tandem/nn.h"
#include "tandem/optim.h"

typedef struct tdm_zero3 tdm_zero3;

/* Shards root's parameters (ps, every rank holding them whole and equal) over g: this rank
 * keeps elements [lo, hi) of the flat buffer, o's shard, which o updates from now on
 * (tdm_optim_use_params); each of units (n, disjoint subtrees of root; forward order) and the
 * root's remaining parameters get a storage of their own, empty but while gathered, and
 * ps->flat's is emptied. Forward hooks on root and the units gather and free them. Local (no
 * collective). NULL and an error (nothing changed) for overlapping or empty units, or out of
 * memory. */
tdm_zero3 *tdm_zero3_new(tdm_module *root, tdm_paramset *ps, tdm_group *g, tdm_optim *o,
                         tdm_module *const *units, int n);
/* Around one backward (tdm_ddp_backward): begin counts each unit's parameters whose
 * gradient is still to come; end frees whatever is still gathered and returns the first
 * failure of a gather since begin. */
void tdm_zero3_backward_begin(tdm_zero3 *f);
int tdm_zero3_backward_end(tdm_zero3 *f);
/* Every parameter whole in ps->flat (params its views again), until tdm_zero3_reshard, which
 * takes this rank's range of ps->flat back into its shard and frees the rest: FSDP's
 * summon_full_params. Collective. */
int tdm_zero3_summon(tdm_zero3 *f);
int tdm_zero3_reshard(tdm_zero3 *f);
int tdm_zero3_unit_count(const tdm_zero3 *f);
/* The dtype the forward and backward gathers move the parameters in: TDM_F32 (the default),
 * or TDM_BF16 (rounded, as FSDP2's param_dtype; fsdp.c). Between steps. TDM_ERR_DTYPE for
 * another dtype. */
int tdm_zero3_set_param_dtype(tdm_zero3 *f, tdm_dtype dt);
/* Removes the hooks; the parameters stay where they are (whole when summoned). */
void tdm_zero3_free(tdm_zero3 *f);

#endif
