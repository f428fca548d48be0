/* What optimizer-state sharding (ZeRO stage 1, src/parallel/zero.c) needs of an optimizer.
 *
 * optim is below parallel in the layer map (docs/ARCHITECTURE.md), so an optimizer cannot call
 * a collective itself. Sharding therefore registers a hook with it: after stepping its own
 * range, tdm_optim_step calls after_step, which brings every rank's range of the parameters
 * up to date over the group. Everything here is internal; the public face is
 * tdm_optim_shard & co in tandem/parallel.h and tdm_optim_shard_range in tandem/optim.h. */
#ifndef TDM_OPTIM_SHARD_H
#define TDM_OPTIM_SHARD_H

#include "tandem/optim.h"

typedef struct {
    /* Called by tdm_optim_step after the optimizer stepped its range [lo, hi), before it
     * counts the step: every rank's updated range of the flat parameters shared. */
    int (*after_step)(tdm_optim *o, void *ctx);
    void (*free)(void *ctx); /* with the optimizer */
    void *ctx;
} tdm_optim_shard_hooks;

/* Keeps the state of flat elements [lo, hi) only: each state buffer is replaced by a copy of
 * its current values there (so a restored optimizer can be sharded), the full-size ones freed.
 * From then on tdm_optim_step steps [lo, hi) and calls hooks->after_step. TDM_ERR_STATE when o
 * is sharded already, TDM_ERR_ARG for a range outside the flat buffer; o is then unchanged and
 * the hooks' ctx stays the caller's. */
int tdm_optim_restrict(tdm_optim *o, int64_t lo, int64_t hi, const tdm_optim_shard_hooks *hooks);
/* ZeRO stage 2: steps read their gradient from grad, which holds flat elements
 * [lo, lo + numel(grad)) and must cover o's range (the caller keeps it alive as long as o
 * steps), instead of ps->flat_grad; tdm_optim_zero_grad zeroes it. TDM_ERR_SHAPE when it does
 * not cover the range. */
int tdm_optim_use_grad(tdm_optim *o, tdm_tensor *grad, int64_t lo);
/* ZeRO stage 3: steps update params, which holds flat elements [lo, lo + numel(params)) and
 * must cover o's range (the caller keeps it alive as long as o steps), instead of ps->flat.
 * TDM_ERR_SHAPE when it does not cover the range. */
int tdm_optim_use_params(tdm_optim *o, tdm_tensor *params, int64_t lo);
/* tdm_optim_step_range on other buffers than ps->flat and ps->flat_grad: flat and flat_grad,
 * contiguous and laid out as those (the whole of them). A data-parallel replica steps its
 * shard of its own parameters with replica 0's optimizer state, from the average it reduced
 * into its own gradient. Does not count the step. TDM_ERR_ARG for a range outside the
 * parameters or a sharded optimizer, TDM_ERR_SHAPE for a buffer of another size. */
int tdm_optim_step_range_on(tdm_optim *o, int64_t lo, int64_t hi, const tdm_tensor *flat,
                            const tdm_tensor *flat_grad);
/* The parameters a step updates (ps->flat, or tdm_optim_use_params's), *lo their first
 * element. */
tdm_tensor *tdm_optim_params(const tdm_optim *o, int64_t *lo);
/* The gradient a step reads (ps->flat_grad, or tdm_optim_use_grad's), *lo its first element. */
tdm_tensor *tdm_optim_grad(const tdm_optim *o, int64_t *lo);
/* The ctx given to tdm_optim_restrict, or NULL for an unsharded optimizer. */
void *tdm_optim_shard_ctx(const tdm_optim *o);
/* The parameter set o updates. */
tdm_paramset *tdm_optim_paramset(const tdm_optim *o);
/* A new, unsharded optimizer like o: same kind, hyper-parameters, learning rate, per-parameter
 * weight decays and step count, with zeroed full-size state buffers of the same names (to be
 * filled by a gather). Caller-owned (tdm_optim_free); NULL and an error when out of memory. */
tdm_optim *tdm_optim_new_like(const tdm_optim *o);

#endif
