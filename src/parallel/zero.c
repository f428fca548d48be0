/* ZeRO stage 1 (PyTorch's ZeroRedundancyOptimizer, DeepSpeed's stage 1, llm.c's ZeRO-1):
 * an optimizer's state sharded over a process group.
 *
 * Every rank keeps the gradients and parameters whole (DDP averages the gradients as before)
 * but the optimizer state of one contiguous range of the flat buffer only, the ranges being
 * the all-reduce's chunks (tdm_chunk_of: in rank order, ceil(total / size) rounded up to 16
 * elements, the last shorter or empty). A step updates this rank's range, then each rank
 * broadcasts its range of ps->flat to the others, in place: the ranges tile the flat buffer,
 * so no padding and no copy is needed, which an all-gather of equal pieces would need
 * (a padded input and a copy out of the gathered buffer). The update of each element is the
 * unsharded optimizer's, computed once instead of on every rank, so the weights are bit for
 * bit those of the unsharded run; the state per rank is 1/size of it.
 *
 * The optimizer is below this layer and cannot call a collective: sharding hands it a hook
 * (optim/shard.h) that tdm_optim_step calls after stepping its range. Checkpoints stay one
 * file: tdm_optim_gather assembles the whole state with the same broadcasts, and
 * tdm_optim_state_load takes each rank's range of a whole one. */
#include "parallel/group.h"

#include "optim/shard.h"
#include "tandem/trace.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct {
    tdm_group *g;
    int size;
    int64_t total;    /* elements of the flat buffer */
    tdm_work **works; /* [size]: the broadcasts of one exchange, in flight together */
} zero;

/* Rank r's range of the flat buffer (the all-reduce's chunk r). */
static void range_of(const zero *z, int r, int64_t *lo, int64_t *hi) {
    tdm_chunk_of(z->total, sizeof(float), z->size, r, lo, hi);
}

/* Every rank's range of flat ([total], laid out as the flat parameter buffer) from that rank
 * to all the others, in place: one broadcast per non-empty range, all launched before the
 * first wait. On failure the group is aborted, so the other ranks stop at once instead of
 * waiting out their timeout for broadcasts this rank never launched. */
static int share_ranges(zero *z, const tdm_tensor *flat, const char *what) {
    if (z->size == 1) return TDM_OK;
    int rc = TDM_OK, launched = 0;
    for (int r = 0; r < z->size && !rc; r++, launched++) {
        int64_t lo, hi;
        range_of(z, r, &lo, &hi);
        z->works[r] = NULL;
        if (lo == hi) continue;
        tdm_tensor v = tdm_range_view(flat, lo, hi);
        tdm_collective_label("ZeRO parameters stepped by rank %d", r);
        if (!(z->works[r] = tdm_broadcast(z->g, &v, r))) rc = tdm_last_status();
    }
    for (int r = 0; r < launched; r++) {
        int w = z->works[r] ? tdm_work_wait(z->works[r]) : TDM_OK;
        if (!rc) rc = w;
    }
    if (!rc) return TDM_OK;
    char msg[600];
    snprintf(msg, sizeof msg, "%s: %s", what, tdm_last_error());
    tdm_group_abort(z->g, msg);
    return tdm_raise(rc, "%s", msg);
}

/* tdm_optim_step's hook: the other ranks' updated ranges into this rank's parameters. */
static int after_step(tdm_optim *o, void *ctx) {
    if (tdm_optim_params(o, NULL) != tdm_optim_paramset(o)->flat)
        return TDM_OK; /* ZeRO stage 3: each unit is gathered from the shards before its use */
    tdm_trace_begin("share the optimizer's shards");
    int rc = share_ranges(ctx, tdm_optim_paramset(o)->flat, "optimizer step (sharded)");
    tdm_trace_end();
    return rc;
}

static void zero_free(void *ctx) {
    zero *z = ctx;
    if (z) free(z->works);
    free(z);
}

/* ---- sharding ----------------------------------------------------------------------------- */

/* Why this rank cannot shard o over g (written into why; empty when it can). */
static int local_check(tdm_optim *o, tdm_group *g, char *why, size_t cap) {
    if (!o) {
        snprintf(why, cap, "optim_shard: optimizer is NULL");
        return TDM_ERR_ARG;
    }
    int64_t lo, hi;
    tdm_optim_shard_range(o, &lo, &hi);
    if (tdm_optim_shard_ctx(o)) {
        snprintf(why, cap,
                 "optim_shard: the optimizer is sharded already (its state covers [%lld, %lld)); "
                 "shard it once",
                 (long long)lo, (long long)hi);
        return TDM_ERR_STATE;
    }
    /* the exchange broadcasts ps->flat itself: it must be where the group's collectives are */
    const tdm_tensor *flat = tdm_optim_paramset(o)->flat;
    bool ok = g->ops->device_memory ? tdm_device_equal(flat->device, g->device)
                                    : flat->device.type == TDM_CPU;
    if (!ok) {
        char a[16], b[16];
        snprintf(why, cap,
                 "optim_shard: the parameters are on %s; this %s group exchanges %s memory",
                 tdm_device_str(flat->device, a), g->ops->name,
                 g->ops->device_memory ? tdm_device_str(g->device, b) : "CPU");
        return TDM_ERR_DEVICE;
    }
    return TDM_OK;
}

/* The collective part of tdm_optim_shard: rank 0's (parameter count, state buffers) reach
 * every rank, which compares them with its own, then the ranks add up their failures, so that
 * every rank fails when one cannot shard, and none is left waiting in a later step. */
static int agree(tdm_optim *o, tdm_group *g, int status, char *why, size_t cap) {
    int64_t mine[2] = {o ? tdm_optim_paramset(o)->total : -1,
                       o ? tdm_optim_state(o, NULL, NULL, 3) : -1};
    if (tdm_scope_begin()) return tdm_last_status();
    tdm_tensor *sig = tdm_from_data(TDM_SHAPE(2), TDM_I64, tdm_group_memory(g), mine);
    tdm_collective_label("optimizer shard: the optimizers' sizes");
    int rc = sig ? tdm_work_wait(tdm_broadcast(g, sig, 0)) : tdm_last_status();
    int64_t first[2] = {0, 0};
    if (!rc) rc = tdm_to_host(sig, first, sizeof first);
    if (!rc && !why[0] && (first[0] != mine[0] || first[1] != mine[1])) {
        snprintf(why, cap,
                 "optim_shard: rank %d's optimizer has %lld parameters and %lld state buffers, "
                 "rank 0's %lld and %lld",
                 tdm_group_rank(g), (long long)mine[0], (long long)mine[1], (long long)first[0],
                 (long long)first[1]);
        status = TDM_ERR_SHAPE;
    }
    float failed = why[0] ? 1.0f : 0.0f;
    tdm_tensor *count = rc ? NULL : tdm_full(TDM_SHAPE(1), failed, TDM_F32, tdm_group_memory(g));
    if (!rc) tdm_collective_label("optimizer shard: failures");
    if (!rc) rc = count ? tdm_work_wait(tdm_all_reduce(g, count, TDM_SUM)) : tdm_last_status();
    float total_failed = 0;
    if (!rc) rc = tdm_to_host(count, &total_failed, sizeof total_failed);
    tdm_scope_end();
    if (rc) return rc;
    if (why[0]) return tdm_raise(status, "%s", why);
    if (total_failed > 0)
        return tdm_raise(TDM_ERR_STATE,
                         "optim_shard: %.0f other rank%s of the group could not shard (see %s "
                         "error); nothing was sharded",
                         total_failed, total_failed > 1 ? "s" : "",
                         total_failed > 1 ? "their" : "its");
    return TDM_OK;
}

int tdm_optim_shard(tdm_optim *o, tdm_group *g) {
    if (!g) return tdm_raise(TDM_ERR_ARG, "optim_shard: NULL group");
    char why[400] = "";
    int status = local_check(o, g, why, sizeof why);
    int rc = agree(o, g, status, why, sizeof why);
    if (rc) return rc;
    zero *z = calloc(1, sizeof *z);
    tdm_work **works = calloc((size_t)tdm_group_size(g), sizeof *works);
    if (!z || !works) {
        free(z);
        free(works);
        tdm_group_abort(g, "optim_shard: out of memory");
        return tdm_raise(TDM_ERR_NOMEM, "optim_shard: out of memory");
    }
    *z = (zero){g, tdm_group_size(g), tdm_optim_paramset(o)->total, works};
    int64_t lo, hi;
    range_of(z, tdm_group_rank(g), &lo, &hi);
    tdm_optim_shard_hooks hooks = {after_step, zero_free, z};
    if ((rc = tdm_optim_restrict(o, lo, hi, &hooks))) { /* out of memory for the shard */
        zero_free(z);
        tdm_group_abort(g, tdm_last_error());
    }
    return rc;
}

/* ---- the whole state, for checkpoints ------------------------------------------------------ */

/* full ([total], the whole buffer) <- this rank's part (its shard, or the whole when o is not
 * sharded), then every other rank's range from its owner. */
static int assemble(zero *z, const tdm_tensor *part, int64_t lo, int64_t hi, tdm_tensor *full) {
    tdm_tensor mine = tdm_range_view(full, lo, hi);
    int rc = tdm_copy_(&mine, part);
    if (rc && z) tdm_group_abort(z->g, tdm_last_error());
    return rc || !z ? rc : share_ranges(z, full, "gathering the optimizer state");
}

int tdm_optim_state_gather(tdm_optim *o, const char **names, tdm_tensor **full, int max) {
    if (!o || !full) return tdm_raise(TDM_ERR_ARG, "optim_state_gather: NULL optimizer or output");
    const char *nm[3];
    tdm_tensor *part[3];
    int n = tdm_optim_state(o, nm, part, 3), rc = TDM_OK, made = 0;
    n = n < max ? n : max;
    int64_t lo, hi, total = tdm_optim_paramset(o)->total;
    tdm_optim_shard_range(o, &lo, &hi);
    for (; made < n && !rc; made++) {
        tdm_tensor *t = tdm_empty(TDM_SHAPE(total), TDM_F32, part[made]->device);
        full[made] = t && tdm_book(t)->owner ? tdm_scope_keep(t) : t; /* the caller's */
        rc = t ? assemble(tdm_optim_shard_ctx(o), part[made], lo, hi, t) : tdm_last_status();
        if (names) names[made] = nm[made];
    }
    if (!rc) return n;
    for (int k = 0; k < made; k++) tdm_tensor_free(full[k]), full[k] = NULL;
    return rc;
}

tdm_optim *tdm_optim_gather(tdm_optim *o) {
    if (!o) return tdm_raise_null(TDM_ERR_ARG, "optim_gather: optimizer is NULL");
    tdm_optim *whole = tdm_optim_new_like(o);
    zero *z = tdm_optim_shard_ctx(o);
    if (!whole) {
        if (z) tdm_group_abort(z->g, tdm_last_error()); /* the others would wait for this rank */
        return NULL;
    }
    tdm_tensor *part[3], *dst[3];
    int n = tdm_optim_state(o, NULL, part, 3), rc = TDM_OK;
    tdm_optim_state(whole, NULL, dst, 3);
    int64_t lo, hi;
    tdm_optim_shard_range(o, &lo, &hi);
    for (int k = 0; k < n && !rc; k++) rc = assemble(z, part[k], lo, hi, dst[k]);
    if (rc) {
        tdm_optim_free(whole);
        return NULL;
    }
    return whole;
}
