/* DataParallel: one replica per device, driven by the caller's single loop. Replica 0 runs
 * on the caller's thread, every other one on a persistent thread of its own. A round hands
 * each thread its rows of the batch; the replicas run forward, loss and a DDP backward
 * (bucketed all-reduces over the threads group) and step their own optimizer, or, for CPU
 * devices of one process, split the reduction and the step into shards (sharded_update;
 * ZeRO stage 3 leaves it for DDP's buckets: leave_shared_update).
 * Either way every replica ends the step with the same parameters, bit for bit. A round of
 * tdm_dp_accumulate stops after backward: its gradients stay local and add up until the
 * tdm_dp_step that closes the window. Two other rounds run a collective of the optimizers on
 * every replica at once: sharding their state over all replicas (ZeRO stage 1, zero.c), and
 * gathering it whole for a checkpoint.
 *
 * Running replica 0 on the caller spares a thread handoff each way per step and puts the
 * caller's core to work instead of asleep; with as many devices as cores, every core then
 * runs exactly one replica. */
#include "parallel/group.h"
#include "parallel/lines.h"
#include "parallel/sync.h"
#include "backend/backend.h" /* tdm_cpu_gemm_set_threads */
#include "parallel/nccl_group.h"
#include "tandem/trace.h"
#include "autograd/tape.h"
#include "optim/clip.h"
#include "optim/scaler.h"
#include "optim/shard.h" /* tdm_optim_step_range_on */
#include "parallel/dp_shard.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* What a round does on every replica: a training step (or accumulation), an evaluation
 * forward, one of the optimizers' collectives (tdm_dp_set_shard, tdm_dp_optim_gather), stage
 * 3's gather or release, or a change of the reduce dtype (on each replica's thread, since it
 * allocates on its device). */
typedef enum {
    ROUND_STEP,
    ROUND_SHARD,
    ROUND_GATHER,
    ROUND_FORWARD,
    ROUND_GATHER_PARAMS,
    ROUND_RELEASE_PARAMS,
    ROUND_REDUCE_DTYPE,
} round_task;

/* Nanoseconds the caller spins for the other replicas after its own: they finish within
 * microseconds of it (same work after the same all-reduce), sooner than a futex wake-up. */
#define DONE_SPIN_NS 50000
/* Nanoseconds a replica thread spins for the next step before it sleeps: the caller starts
 * the next step within microseconds of the last (one batch from the loader), and waking a
 * sleeping thread costs it a tenth or more of an MLP step on the 2-core VM (bench/RESULTS.md,
 * "Figures behind the code"). Between epochs
 * (evaluation) the thread soon sleeps. */
#define NEXT_SPIN_NS 200000

typedef struct {
    struct tdm_dp *dp;
    int rank;
    pthread_t thread;
    tdm_module *replica;
    tdm_optim *opt;
    tdm_paramset *ps;
    tdm_ddp *ddp;
    float loss;      /* this round's mean loss over the replica's rows */
    tdm_tensor *out; /* a forward round's output for its rows, caller-owned until gathered */
    double shard_ss; /* sum of squares of the shard's averaged gradient (clipping) */
    double inf_ss;   /* the same before unscaling (a loss scaler's inf check) */
    int rc;
    char err[512];
} replica;

struct tdm_dp {
    int n;
    tdm_device devices[TDM_MAX_DEVICES];
    replica reps[TDM_MAX_DEVICES];
    tdm_threads_world *world;
    tdm_hier_world *hier; /* every device of every process (tdm_dp_new_distributed), or NULL */
    tdm_group *nccl[TDM_MAX_DEVICES]; /* GPUs: replica r's NCCL group (see make_nccl), or NULLs */
    bool sharded;                     /* CPU devices in one process: see sharded_update */
    tdm_shard_kind shard;             /* what tdm_dp_set_shard asked for */
    round_task task;                  /* what the round being run does */
    tdm_shard_kind shard_to;          /* what a ROUND_SHARD asks of every replica */
    tdm_dtype reduce_to;              /* what a ROUND_REDUCE_DTYPE asks of every replica */
    tdm_units_fn units_of;            /* ZeRO stage 3's units of a replica, or NULL */
    tdm_optim *gathered;              /* ROUND_GATHER's result, replica 0's */
    float clip;                       /* max gradient norm before each update, or 0 */
    tdm_grad_scaler *scaler;          /* fp16's loss scaler (the caller's), or NULL */
    float loss_scale;                 /* the round's scale, taken from it by the caller */
    bool skipped;                     /* the last update found an inf or NaN and did not step */
    int64_t window;                   /* micro-batches accumulated since the last update */
    int gemm_threads;                 /* restored at free */
    /* the caller runs replica 0 pinned to its core: unpinned, the scheduler pulled it onto
     * replica 1's core whenever replica 1 woke it (CNN steps took twice as long) */
    pthread_t caller;
    tdm_saved_affinity caller_affinity;
    tdm_module *model;
    tdm_optim_factory make_optim;
    void *optim_arg;
    /* The round being run: the caller writes the fields below, then moves `generation`; a
     * replica thread writes its rc and err, then counts itself in `finished`. Each side reads
     * the other's writes only after seeing the word move (tdm_wait_until), so no lock. */
    tdm_wait_word generation; /* rounds started (tdm_dp_free's quit is one more) */
    tdm_wait_word finished;   /* replicas 1..n-1 done with the round */
    tdm_waitq go, done;       /* where replicas wait for a round, the caller for its end */
    int64_t next_spin_ns, done_spin_ns; /* NEXT_SPIN_NS, DONE_SPIN_NS or 0 (tdm_spin_budget) */
    bool quit;
    tdm_tensor *x, *y;
    bool update; /* the round ends with the update (tdm_dp_step), or only accumulates */
    bool zero;   /* the round starts a window: gradients are zeroed first */
    /* a forward round's training mode, module 0's as the round began: replica 0 (the model)
     * puts its own mode back at its round's end, while the others may still read it */
    bool forward_training;
    tdm_loss_fn loss_fn;
    void *loss_arg;
};

/* ---- per-replica work --------------------------------------------------------------------- */

/* Replica r's group: this process's devices, or every device of every process. */
static tdm_group *rank_group(tdm_dp *dp, int r) {
    if (dp->nccl[0]) return dp->nccl[r];
    return dp->hier ? tdm_hier_world_group(dp->hier, r) : tdm_threads_world_group(dp->world, r);
}

static int replica_init(replica *r) {
    tdm_dp *dp = r->dp;
    tdm_group *g = rank_group(dp, r->rank);
    if (!g) return tdm_last_status();
    if (r->rank > 0) tdm_pin_rank_thread(r->rank, dp->n);
    tdm_paramset *ps = r->ps = tdm_module_parameters(r->replica);
    /* sharing memory, replica 0's optimizer steps every shard: the others need none */
    bool needs_optim = !(dp->sharded && r->rank > 0);
    r->opt = ps && needs_optim ? dp->make_optim(ps, dp->optim_arg) : NULL;
    if (!ps || (needs_optim && !r->opt)) {
        tdm_group_abort(g, tdm_last_error());
        return tdm_last_status() ? tdm_last_status() : TDM_ERR_ARG;
    }
    r->ddp = tdm_ddp_new(r->replica, g, NULL);
    if (r->ddp && dp->sharded) tdm_ddp_set_sync(r->ddp, false); /* sharded_update reduces */
    return r->ddp ? TDM_OK : tdm_last_status();
}

/* Gradient clipping of a sharded update: the global norm is the square root of the shards'
 * sums of squares, added in rank order after a barrier, so every replica scales its shard by
 * the same factor (the norm of the whole averaged gradient, as on one device). */
static int clip_shard(replica *r, int64_t lo, int64_t hi) {
    tdm_dp *dp = r->dp;
    int rc = tdm_clip_sum_squares(r->ps, lo, hi, &r->shard_ss);
    if (!rc) rc = tdm_threads_barrier(rank_group(dp, r->rank));
    if (rc) return rc;
    double ss = 0;
    for (int k = 0; k < dp->n; k++) ss += dp->reps[k].shard_ss;
    return tdm_clip_scale(r->ps, lo, hi, dp->clip, (float)sqrt(ss));
}

/* fp16 in a sharded update: replica r checks its shard of the averaged gradient, and after a
 * barrier every replica adds all shards' sums in rank order (optim/scaler.h: finite exactly
 * when every element is), so all find the same; then it unscales its shard. */
static int unscale_shard(replica *r, int64_t lo, int64_t hi, bool *found_inf) {
    tdm_dp *dp = r->dp;
    int rc = tdm_clip_sum_squares(r->ps, lo, hi, &r->inf_ss);
    if (!rc) rc = tdm_threads_barrier(rank_group(dp, r->rank));
    if (rc) return rc;
    double ss = 0;
    for (int k = 0; k < dp->n; k++) ss += dp->reps[k].inf_ss;
    *found_inf = !isfinite(ss);
    if (r->rank == 0) dp->skipped = *found_inf;
    tdm_tensor g = tdm_range_view(r->ps->flat_grad, lo, hi);
    return *found_inf ? TDM_OK : tdm_grad_scaler_unscale_of(dp->scaler, &g);
}

/* The update, split over the replicas when the devices share memory (CPU devices of one
 * process). Replica r takes shard r of the flat buffers: it averages every replica's gradient
 * there into its own gradient, steps its own parameters there with replica 0's optimizer
 * state, and copies them into every other replica. Each core so writes lines of its own but
 * for the copies (core 1 stepping replica 0's shard, lines core 0 had read in its forward,
 * took longer than core 0 on the MLP: bench/RESULTS.md, "Issue 15: two CPU devices against
 * one, the MLP again"); replica 0's gradient outside its shard stays its
 * own, unaveraged. Each element is reduced once and stepped once, where an all-reduce followed by
 * n optimizer steps reduces it n times (once per destination) and steps it n times: on the
 * MLP that is most of a step's time outside the GEMMs. The sums are the threads all-reduce's
 * (rank order, then / n), so the result is bit for bit the unsharded one, and replica 0's
 * optimizer keeps the whole state (what a checkpoint saves); the shard of its state that
 * replica r steps is only ever touched by r's core. The other replicas' optimizers stay
 * unused. */
static int sharded_update(replica *r) {
    tdm_dp *dp = r->dp;
    int n = dp->n;
    int rc = tdm_threads_barrier(rank_group(dp, r->rank)); /* every gradient final */
    if (rc) return rc;
    int64_t lo, hi; /* the all-reduce's chunks, and ZeRO's shards (zero.c) */
    tdm_chunk_of(r->ps->total, sizeof(float), n, r->rank, &lo, &hi);
    const float *grads[TDM_MAX_DEVICES];
    for (int k = 0; k < n; k++) grads[k] = tdm_data_ptr(dp->reps[k].ps->flat_grad);
    tdm_trace_begin("reduce shard");
    tdm_lines_reduce(tdm_data_ptr(r->ps->flat_grad), grads, n, lo, hi);
    tdm_trace_end();
    bool found_inf = false;
    if (dp->scaler && (rc = unscale_shard(r, lo, hi, &found_inf))) return rc;
    if (found_inf) return TDM_OK; /* every replica found it: none steps */
    if (dp->clip > 0 && (rc = clip_shard(r, lo, hi))) return rc;
    tdm_trace_begin("step shard");
    rc = tdm_optim_step_range_on(dp->reps[0].opt, lo, hi, r->ps->flat, r->ps->flat_grad);
    tdm_trace_end();
    tdm_trace_begin("copy shard");
    const float *mine = (const float *)tdm_data_ptr(r->ps->flat) + lo;
    for (int k = 0; !rc && k < n; k++)
        if (k != r->rank)
            tdm_lines_copy((float *)tdm_data_ptr(dp->reps[k].ps->flat) + lo, mine, hi - lo);
    tdm_trace_end();
    return rc;
}

/* The update of an unsharded replica: its gradient is the all-reduced average, the same bits
 * on every replica, so clipping gives every replica the same factor. */
static int replica_update(replica *r) {
    tdm_dp *dp = r->dp;
    if (dp->scaler) { /* fp16: the same check on every replica (a collective under stage 2) */
        double ss = 0;
        int64_t lo;
        tdm_tensor *shard = tdm_ddp_shard_grad(r->ddp, &lo);
        int rc = tdm_ddp_grad_sum_squares(r->ddp, &ss);
        if (!rc) rc = tdm_grad_scaler_unscale_of(dp->scaler, shard ? shard : r->ps->flat_grad);
        if (rc) return rc;
        if (r->rank == 0) dp->skipped = !isfinite(ss);
        if (!isfinite(ss)) return TDM_OK;
    }
    /* under ZeRO stage 2 the norm is taken from every replica's shard (a collective) */
    if (dp->clip > 0 && tdm_ddp_clip_grad_norm(r->ddp, dp->clip, NULL)) return tdm_last_status();
    return tdm_optim_step(r->opt);
}

static int replica_step(replica *r) {
    tdm_dp *dp = r->dp;
    tdm_device dev = dp->devices[r->rank];
    int64_t b = dp->x->shape[0], lo, hi;
    tdm_rows_of(b, dp->n, r->rank, &lo, &hi);
    /* batch norm (synchronised) and dropout (global rows' masks) act as on one device */
    tdm_parallel_context_set(rank_group(dp, r->rank), lo, b);
    tdm_scope_begin();
    tdm_tensor *xs = tdm_to_device(tdm_slice(dp->x, 0, lo, hi, 1), dev);
    tdm_tensor *ys = tdm_to_device(tdm_slice(dp->y, 0, lo, hi, 1), dev);
    tdm_trace_begin("forward");
    tdm_tensor *loss = dp->loss_fn(tdm_ddp_forward(r->ddp, xs), ys, lo, dp->loss_arg);
    tdm_trace_end();
    /* DDP averages over n replicas; weighting each by its share of the batch makes the
     * average the gradient of the whole batch's mean loss; fp16 multiplies by the scale too.
     * A factor of 1 (an even split, no scale) leaves the loss the backward's root, where a
     * cross-entropy hands on the gradient its forward wrote (nn/loss.c). */
    float factor = (float)((double)(hi - lo) * dp->n / (double)b * dp->loss_scale);
    tdm_tensor *scaled = factor == 1.0f ? loss : tdm_mul_scalar(loss, factor);
    /* Sharing memory, a window's gradients are marked stale instead of zeroed, and what the
     * backward did not reach is zeroed after it: zeroing the MLP's 0.94 MB, half of it lines
     * the other core had read in the update, took a tenth of a step (bench/RESULTS.md,
     * "Issue 15: two CPU devices against one, the MLP again"). */
    bool mark = dp->zero && dp->sharded;
    if (mark) tdm_paramset_mark_grads_stale(r->ps);
    int rc = !dp->zero || mark ? TDM_OK
             : r->opt          ? tdm_optim_zero_grad(r->opt)
                               : tdm_backend_for(dev)->fill(r->ps->flat_grad, 0.0);
    bool sync = dp->update && !dp->sharded; /* accumulating rounds keep gradients local */
    if (!dp->sharded) tdm_ddp_set_sync(r->ddp, sync);
    tdm_trace_begin(sync ? "backward (buckets all-reduced as they fill)" : "backward");
    if (!rc) rc = scaled ? tdm_ddp_backward(r->ddp, scaled) : tdm_last_status();
    tdm_trace_end();
    if (mark) {
        int z = tdm_paramset_settle_grads(r->ps); /* also after a failed backward */
        rc = rc ? rc : z;
    }
    tdm_parallel_context_clear();
    if (dp->update) {
        tdm_trace_begin("optimizer");
        if (!rc) rc = dp->sharded ? sharded_update(r) : replica_update(r);
        tdm_trace_end();
    }
    r->loss = rc ? NAN : tdm_item(loss);
    tdm_scope_end();
    /* the others may wait for this replica at a collective: they fail now, not at timeout */
    if (rc) tdm_group_abort(rank_group(dp, r->rank), tdm_last_error());
    return rc;
}

/* Replica r (r > 0) takes replica 0's buffers: batch norm's running statistics, which each
 * replica updates from its own rows during training. On the caller's thread before a forward
 * round, since replica 0's forward in training mode updates them. */
static int copy_buffers(replica *r) {
    tdm_bufferset *mine = tdm_module_buffers(r->replica), *first = tdm_module_buffers(r->dp->model);
    if (!mine || !first) return tdm_last_status();
    int rc = TDM_OK;
    for (int i = 0; !rc && i < mine->n; i++) {
        tdm_tensor *b = tdm_to_device(first->buffers[i], r->replica->device);
        rc = b ? tdm_copy_(mine->buffers[i], b) : tdm_last_status();
    }
    return rc;
}

/* Replica r's rows of a tdm_dp_forward, without gradients, as module 0 would run them: with
 * its buffers and training mode (PyTorch's DataParallel replicates module 0 at every
 * forward). The output outlives the round (caller-owned) for tdm_dp_forward to gather. */
static int replica_forward(replica *r) {
    tdm_dp *dp = r->dp;
    int64_t lo = 0, hi = dp->x->shape[0];
    if (hi >= dp->n) tdm_rows_of(dp->x->shape[0], dp->n, r->rank, &lo, &hi);
    bool prev = tdm_set_grad_enabled(false), was = r->replica->training;
    int rc = tdm_scope_begin();
    if (rc) {
        tdm_set_grad_enabled(prev);
        return rc;
    }
    if (r->rank > 0) tdm_module_train(r->replica, dp->forward_training);
    tdm_trace_begin("forward");
    tdm_tensor *xs = tdm_to_device(tdm_slice(dp->x, 0, lo, hi, 1), r->replica->device);
    tdm_tensor *out = xs ? tdm_module_forward(r->replica, xs) : NULL;
    tdm_trace_end();
    r->out = out ? tdm_scope_keep(out) : NULL;
    if (!out) rc = tdm_last_status();
    tdm_scope_end();
    tdm_module_train(r->replica, was);
    tdm_set_grad_enabled(prev);
    return rc;
}

/* Replica r's sharding; for ZeRO stage 3 its units first (dp->units_of on its own modules). */
static int replica_shard(replica *r) {
    tdm_dp *dp = r->dp;
    if (dp->shard_to == TDM_SHARD_PARAMETERS && dp->units_of) {
        int rc = tdm_ddp_set_shard_units_of(r->ddp, r->replica, dp->units_of);
        if (rc) return rc;
    }
    return tdm_ddp_set_shard(r->ddp, r->opt, dp->shard_to);
}

/* Replica r's part of a round: a step, or its optimizer's share of a collective. Those
 * fail on every rank alike (tdm_optim_shard agrees first; a failed exchange aborts the
 * group), so nobody is left waiting. */
static int replica_round(replica *r) {
    tdm_dp *dp = r->dp;
    if (dp->task == ROUND_STEP) return replica_step(r);
    if (dp->task == ROUND_FORWARD) return replica_forward(r);
    if (dp->task == ROUND_SHARD) return replica_shard(r);
    if (dp->task == ROUND_GATHER_PARAMS) return tdm_ddp_gather_params(r->ddp);
    if (dp->task == ROUND_RELEASE_PARAMS) return tdm_ddp_release_params(r->ddp);
    if (dp->task == ROUND_REDUCE_DTYPE) return tdm_ddp_set_reduce_dtype(r->ddp, dp->reduce_to);
    tdm_optim *whole = tdm_optim_gather(r->opt); /* every replica takes part; 0's is kept */
    if (r->rank == 0)
        dp->gathered = whole;
    else
        tdm_optim_free(whole);
    return whole ? TDM_OK : tdm_last_status();
}

static void *replica_main(void *arg) {
    replica *r = arg;
    tdm_dp *dp = r->dp;
    char track[48], dev[16];
    snprintf(track, sizeof track, "%s compute", tdm_device_str(dp->devices[r->rank], dev));
    tdm_trace_name_thread(track);
    uint64_t seen = 0;
    int rc = replica_init(r);
    for (;;) {
        r->rc = rc;
        if (rc) snprintf(r->err, sizeof r->err, "%s", tdm_last_error());
        if (atomic_fetch_add(&dp->finished, 1) == (uint64_t)dp->n - 2) tdm_waitq_wake(&dp->done);
        tdm_wait_until(&dp->go, &dp->generation, seen + 1,
                       (tdm_wait_opts){.spin_ns = dp->next_spin_ns});
        seen = atomic_load(&dp->generation);
        if (dp->quit) break;
        rc = r->rc ? r->rc : replica_round(r); /* a replica that failed to start stays failed */
    }
    tdm_ddp_free(r->ddp);
    tdm_optim_free(r->opt);
    tdm_thread_release(); /* the thread's arena and tape */
    return NULL;
}

/* Replica 0's part of a round, on the caller's thread (whose grad mode may be off). */
static void run_caller_replica(tdm_dp *dp, bool init) {
    replica *r = &dp->reps[0];
    bool prev = tdm_set_grad_enabled(true);
    r->rc = init ? replica_init(r) : replica_round(r);
    tdm_set_grad_enabled(prev);
    if (r->rc) snprintf(r->err, sizeof r->err, "%s", tdm_last_error());
    if (init && r->rc) tdm_group_abort(rank_group(dp, 0), r->err);
}

/* Waits until every replica has finished the current round; returns the first failure. */
static int wait_round(tdm_dp *dp) {
    tdm_wait_until(&dp->done, &dp->finished, (uint64_t)dp->n - 1,
                   (tdm_wait_opts){.spin_ns = dp->done_spin_ns});
    int rc = TDM_OK;
    for (int i = 0; i < dp->n && !rc; i++)
        if (dp->reps[i].rc) {
            rc = dp->reps[i].rc;
            tdm_raise(rc, "data_parallel: device %d: %s", i, dp->reps[i].err);
        }
    return rc;
}

/* ---- the public API ----------------------------------------------------------------------- */

static int check_devices(const tdm_module *model, const tdm_device *devices, int n) {
    char a[16], b[16];
    if (n < 1 || n > TDM_MAX_DEVICES)
        return tdm_raise(TDM_ERR_ARG, "data_parallel: %d devices (1 to %d)", n, TDM_MAX_DEVICES);
    if (!tdm_device_equal(model->device, devices[0]))
        return tdm_raise(TDM_ERR_DEVICE, "data_parallel: the model is on %s, devices[0] is %s",
                         tdm_device_str(model->device, a), tdm_device_str(devices[0], b));
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (tdm_device_equal(devices[i], devices[j]))
                return tdm_raise(TDM_ERR_DEVICE, "data_parallel: device %s listed twice",
                                 tdm_device_str(devices[i], a));
    return TDM_OK;
}

/* GPUs reduce in device memory over NCCL: the GPUs of this process get one communicator each,
 * made together (one GPU alone too: DDP's wrap-time broadcasts need a group that takes device
 * memory); one GPU per process joins the processes' communicator (its id broadcast over the
 * MPI group). Several GPUs per process under MPI would need a communicator
 * across every GPU of every process: refused for now. CPU and GPU replicas cannot be mixed. */
static int make_nccl(tdm_dp *dp, tdm_group *processes) {
    int n = dp->n, gpus = 0;
    for (int r = 0; r < n; r++) gpus += dp->devices[r].type == TDM_CUDA;
    char a[16], b[16];
    if (gpus && gpus < n)
        return tdm_raise(TDM_ERR_DEVICE,
                         "data_parallel: devices %s and %s mix CPU and GPU; every replica must be "
                         "on the same kind of device",
                         tdm_device_str(dp->devices[0], a), tdm_device_str(dp->devices[n - 1], b));
    if (!gpus) return TDM_OK;
    if (processes && n > 1)
        return tdm_raise(TDM_ERR_DEVICE,
                         "data_parallel: %d GPUs in each of several processes is not supported; "
                         "run one process per GPU (mpirun -np <GPUs> ... --devices cuda)",
                         n);
    if (!processes) return tdm_nccl_world_new(n, dp->devices, dp->nccl);
    dp->nccl[0] = tdm_nccl_group_new(processes, dp->devices[0]);
    return dp->nccl[0] ? TDM_OK : tdm_last_status();
}

tdm_dp *tdm_dp_new(tdm_module *model, const tdm_device *devices, int n,
                   tdm_optim_factory make_optim, void *optim_arg) {
    return tdm_dp_new_distributed(model, devices, n, NULL, make_optim, optim_arg);
}

tdm_dp *tdm_dp_new_distributed(tdm_module *model, const tdm_device *devices, int n,
                               tdm_group *processes, tdm_optim_factory make_optim,
                               void *optim_arg) {
    if (!model || !devices || !make_optim)
        return tdm_raise_null(TDM_ERR_ARG, "data_parallel: NULL model, devices or factory");
    if (check_devices(model, devices, n)) return NULL;
    tdm_dp *dp = calloc(1, sizeof *dp);
    if (!dp) return tdm_raise_null(TDM_ERR_NOMEM, "data_parallel: out of memory");
    dp->n = n;
    memcpy(dp->devices, devices, sizeof *devices * (size_t)n);
    dp->model = model;
    dp->make_optim = make_optim;
    dp->optim_arg = optim_arg;
    tdm_waitq_init(&dp->go);
    tdm_waitq_init(&dp->done);
    atomic_init(&dp->generation, 0);
    atomic_init(&dp->finished, 0);
    dp->next_spin_ns = tdm_spin_budget(n, NEXT_SPIN_NS);
    dp->done_spin_ns = tdm_spin_budget(n, DONE_SPIN_NS);
    dp->sharded = n > 1 && !processes;
    for (int r = 0; r < n; r++) dp->sharded &= devices[r].type == TDM_CPU;
    if (!(dp->world = tdm_threads_world_new(n, devices)) || make_nccl(dp, processes) ||
        (processes && !dp->nccl[0] && !(dp->hier = tdm_hier_world_new(dp->world, n, processes)))) {
        tdm_threads_world_free(dp->world);
        free(dp);
        return NULL;
    }
    dp->gemm_threads = tdm_gemm_threads_for_devices(n);
    /* replicas are cloned here, before any thread flattens the model's parameters */
    for (int r = 0; r < n; r++) {
        dp->reps[r] = (replica){.dp = dp, .rank = r};
        dp->reps[r].replica = r ? tdm_module_clone(model, devices[r]) : model;
        if (!dp->reps[r].replica) {
            dp->n = r; /* frees the clones made so far */
            tdm_dp_free(dp);
            return NULL;
        }
    }
    int started = 1;
    for (; started < n; started++) {
        if (pthread_create(&dp->reps[started].thread, NULL, replica_main, &dp->reps[started]))
            break;
    }
    if (started < n) { /* the started ones are stuck at their first collective: abort it */
        tdm_group_abort(rank_group(dp, 0), "could not start a thread");
        tdm_dp_free(dp);
        return tdm_raise_null(TDM_ERR_NOMEM, "data_parallel: could not start %d threads", n);
    }
    dp->caller = pthread_self();
    if (n > 1) tdm_pin_caller_thread(0, n, &dp->caller_affinity);
    run_caller_replica(dp, true); /* with the others: tdm_ddp_new is collective */
    if (wait_round(dp)) {
        tdm_dp_free(dp);
        return NULL;
    }
    return dp;
}

/* Runs one round of `task` on every replica (replica 0 on this thread) and waits for all of
 * them; returns the first failure, naming its device. */
static int run_task(tdm_dp *dp, round_task task) {
    dp->task = task;
    atomic_store(&dp->finished, 0);
    atomic_fetch_add(&dp->generation, 1);
    tdm_waitq_wake(&dp->go);
    run_caller_replica(dp, false);
    int rc = wait_round(dp);
    dp->task = ROUND_STEP;
    return rc;
}

/* One round on every replica: forward and backward of (x, target), then the update when
 * `update` (tdm_dp_step), else only the gradients' accumulation (tdm_dp_accumulate). */
static int run_round(tdm_dp *dp, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                     void *loss_arg, float *loss, bool update, const char *op) {
    if (!dp || !x || !target || !loss_fn) return tdm_raise(TDM_ERR_ARG, "%s: NULL argument", op);
    char a[96], b[96];
    if (x->ndim < 1 || target->ndim < 1 || x->shape[0] != target->shape[0])
        return tdm_raise(TDM_ERR_SHAPE, "%s: input %s and target %s differ in batch size", op,
                         tdm_shape_str(tdm_shape_of(x), a), tdm_shape_str(tdm_shape_of(target), b));
    if (x->shape[0] < dp->n)
        return tdm_raise(TDM_ERR_SHAPE, "%s: a batch of %lld rows cannot be split over %d devices",
                         op, (long long)x->shape[0], dp->n);
    int start, end;
    tdm_tape_nodes(&start, &end);
    if (start < end) /* replica 0's backward would walk them and mark them done */
        return tdm_raise(TDM_ERR_STATE,
                         "%s: this thread has %d recorded operations that no backward has "
                         "walked yet; replica 0 runs on the caller's thread, so step outside "
                         "that graph (or with grad off)",
                         op, end - start);
    dp->x = x, dp->y = target, dp->loss_fn = loss_fn, dp->loss_arg = loss_arg;
    dp->update = update, dp->zero = dp->window == 0, dp->skipped = false;
    dp->loss_scale = dp->scaler ? tdm_grad_scaler_begin(dp->scaler) : 1.0f;
    int rc = run_task(dp, ROUND_STEP);
    dp->window = update || rc ? 0 : dp->window + 1; /* after a failure, start afresh */
    if (!rc && update && dp->scaler) rc = tdm_grad_scaler_update_found(dp->scaler, dp->skipped);
    /* each replica took a shard of one step: count it once */
    if (!rc && update && dp->sharded && !dp->skipped) {
        tdm_optim_set_steps(dp->reps[0].opt, tdm_optim_steps(dp->reps[0].opt) + 1);
    }
    if (loss) {
        double sum = 0;
        int64_t lo, hi;
        for (int i = 0; i < dp->n; i++) {
            tdm_rows_of(x->shape[0], dp->n, i, &lo, &hi);
            sum += (double)dp->reps[i].loss * (double)(hi - lo);
        }
        *loss = rc ? NAN : (float)(sum / (double)x->shape[0]);
    }
    return rc;
}

int tdm_dp_step(tdm_dp *dp, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn, void *loss_arg,
                float *loss) {
    return run_round(dp, x, target, loss_fn, loss_arg, loss, true, "data_parallel step");
}

int tdm_dp_accumulate(tdm_dp *dp, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                      void *loss_arg, float *loss) {
    return run_round(dp, x, target, loss_fn, loss_arg, loss, false, "data_parallel accumulate");
}

/* The replicas' outputs joined in row order on devices[0], in the current scope. */
static tdm_tensor *gather_outputs(tdm_dp *dp) {
    tdm_tensor *parts[TDM_MAX_DEVICES];
    int n = dp->x->shape[0] < dp->n ? 1 : dp->n; /* every replica ran the whole batch */
    for (int r = 0; r < n; r++)
        if (!(parts[r] = tdm_to_device(dp->reps[r].out, dp->devices[0]))) return NULL;
    return tdm_concat(parts, n, 0);
}

int tdm_dp_forward(tdm_dp *dp, tdm_tensor *x, tdm_tensor **out) {
    if (!dp || !x || !out) return tdm_raise(TDM_ERR_ARG, "data_parallel forward: NULL argument");
    *out = NULL;
    if (x->ndim < 1) return tdm_raise(TDM_ERR_SHAPE, "data_parallel forward: a 0-dim input");
    bool prev = tdm_set_grad_enabled(false);
    /* too few rows to split: module 0 alone (under ZeRO stage 3 every replica runs the whole
     * batch, since its units' gathers are collectives, and module 0's output is kept) */
    if (x->shape[0] < dp->n && dp->shard != TDM_SHARD_PARAMETERS) {
        *out = tdm_module_forward(dp->model, x);
        tdm_set_grad_enabled(prev);
        return *out ? TDM_OK : tdm_last_status();
    }
    dp->x = x;
    dp->forward_training = dp->model->training;
    int rc = TDM_OK;
    for (int r = 1; r < dp->n && !rc; r++) rc = copy_buffers(&dp->reps[r]);
    if (!rc) rc = run_task(dp, ROUND_FORWARD);
    if (!rc && !(*out = gather_outputs(dp))) rc = tdm_last_status();
    for (int r = 0; r < dp->n; r++) {
        tdm_tensor_free(dp->reps[r].out);
        dp->reps[r].out = NULL;
    }
    tdm_set_grad_enabled(prev);
    return rc;
}

int tdm_dp_set_grad_scaler(tdm_dp *dp, tdm_grad_scaler *s) {
    if (!dp) return tdm_raise(TDM_ERR_ARG, "data_parallel set_grad_scaler: NULL data parallel");
    dp->scaler = s;
    dp->skipped = false;
    return TDM_OK;
}

bool tdm_dp_step_skipped(const tdm_dp *dp) {
    return dp && dp->skipped;
}

int tdm_dp_set_clip_grad_norm(tdm_dp *dp, float max_norm) {
    if (!dp) return tdm_raise(TDM_ERR_ARG, "data_parallel clip_grad_norm: NULL data parallel");
    if (!(max_norm >= 0) || !isfinite(max_norm))
        return tdm_raise(TDM_ERR_ARG, "data_parallel clip_grad_norm: max_norm %g must be >= 0",
                         max_norm);
    dp->clip = max_norm;
    return TDM_OK;
}

/* ZeRO stage 3 over CPU devices of one process leaves the shared-memory update (its point is
 * that no replica holds the whole model, where sharded_update reads every replica's whole
 * gradient and writes every replica's parameters): each replica's DDP then reduces over the
 * threads group and each optimizer steps its own shard. Until now replica 0's optimizer was
 * the only one, so every other replica gets one now, with its state, learning rate and step
 * count (the replicas are idle: made on the caller's thread, as the clones were). */
static int leave_shared_update(tdm_dp *dp) {
    tdm_optim *o0 = dp->reps[0].opt;
    const char *names[4];
    tdm_tensor *state[4];
    int k = tdm_optim_state(o0, names, state, 4), rc = tdm_scope_begin();
    if (rc) return rc;
    for (int r = 1; r < dp->n && !rc; r++) {
        tdm_optim *o = dp->make_optim(dp->reps[r].ps, dp->optim_arg);
        if (!o) rc = tdm_last_status();
        for (int i = 0; i < k && !rc; i++) {
            tdm_tensor *there = tdm_to_device(state[i], dp->devices[r]);
            rc = there ? tdm_optim_state_load(o, names[i], there) : tdm_last_status();
        }
        if (!rc) {
            tdm_optim_set_lr(o, tdm_optim_lr(o0));
            tdm_optim_set_steps(o, tdm_optim_steps(o0));
        }
        if (rc)
            tdm_optim_free(o);
        else
            dp->reps[r].opt = o;
    }
    tdm_scope_end(); /* the copies */
    if (!rc) {
        dp->sharded = false;
        return TDM_OK;
    }
    for (int r = 1; r < dp->n; r++) tdm_optim_free(dp->reps[r].opt), dp->reps[r].opt = NULL;
    return rc;
}

int tdm_dp_set_shard(tdm_dp *dp, tdm_shard_kind kind) {
    if (!dp) return tdm_raise(TDM_ERR_ARG, "data_parallel set_shard: NULL data parallel");
    if (kind < TDM_SHARD_NONE || kind > TDM_SHARD_PARAMETERS)
        return tdm_raise(TDM_ERR_ARG, "data_parallel set_shard: unknown kind %d", (int)kind);
    if (kind == dp->shard) return TDM_OK;
    if (kind < dp->shard) {
        return tdm_raise(TDM_ERR_STATE,
                         "data_parallel set_shard: the %s sharded and stay%s so "
                         "(tdm_dp_optim_gather copies the optimizer state whole)",
                         tdm_shard_held(dp->shard), dp->shard == TDM_SHARD_OPTIMIZER ? "s" : "");
    }
    /* replicas sharing memory already hold the state once: replica 0's, stepped in shards */
    dp->shard_to = kind;
    int rc = kind == TDM_SHARD_PARAMETERS && dp->sharded ? leave_shared_update(dp) : TDM_OK;
    if (!rc && !dp->sharded) rc = run_task(dp, ROUND_SHARD);
    if (!rc) dp->shard = kind;
    return rc;
}

int tdm_dp_set_reduce_dtype(tdm_dp *dp, tdm_dtype dt) {
    if (!dp) return tdm_raise(TDM_ERR_ARG, "data_parallel set_reduce_dtype: NULL data parallel");
    if (dt != TDM_F32 && dt != TDM_BF16)
        return tdm_raise(TDM_ERR_ARG, "data_parallel: reduce_dtype %s (expected f32 or bf16)",
                         tdm_dtype_name(dt));
    if (dp->sharded && dt != TDM_F32)
        return tdm_raise(TDM_ERR_ARG,
                         "data_parallel: reduce_dtype %s applies to gradients that cross between "
                         "processes or GPUs; the CPU devices of one process average theirs in "
                         "shared memory, in f32",
                         tdm_dtype_name(dt));
    dp->reduce_to = dt;
    return run_task(dp, ROUND_REDUCE_DTYPE); /* on each replica's thread: its device's memory */
}

int tdm_dp_set_shard_units(tdm_dp *dp, tdm_units_fn units_of) {
    if (!dp) return tdm_raise(TDM_ERR_ARG, "data_parallel set_shard_units: NULL data parallel");
    if (dp->shard == TDM_SHARD_PARAMETERS)
        return tdm_raise(TDM_ERR_STATE, "data_parallel set_shard_units: the parameters are "
                                        "sharded already; name the units before");
    dp->units_of = units_of;
    return TDM_OK;
}

int tdm_dp_gather_params(tdm_dp *dp) {
    if (!dp) return tdm_raise(TDM_ERR_ARG, "data_parallel gather_params: NULL data parallel");
    return dp->shard == TDM_SHARD_PARAMETERS ? run_task(dp, ROUND_GATHER_PARAMS) : TDM_OK;
}

int tdm_dp_release_params(tdm_dp *dp) {
    if (!dp) return tdm_raise(TDM_ERR_ARG, "data_parallel release_params: NULL data parallel");
    return dp->shard == TDM_SHARD_PARAMETERS ? run_task(dp, ROUND_RELEASE_PARAMS) : TDM_OK;
}

tdm_shard_kind tdm_dp_shard(const tdm_dp *dp) {
    return dp ? dp->shard : TDM_SHARD_NONE;
}

tdm_optim *tdm_dp_optim_gather(tdm_dp *dp) {
    if (!dp) return tdm_raise_null(TDM_ERR_ARG, "data_parallel optim_gather: NULL data parallel");
    /* unsharded, or one process's replicas sharing memory: replica 0 holds the whole state */
    if (dp->sharded || dp->shard == TDM_SHARD_NONE) return tdm_optim_gather(dp->reps[0].opt);
    dp->gathered = NULL;
    int rc = run_task(dp, ROUND_GATHER);
    tdm_optim *whole = dp->gathered;
    dp->gathered = NULL;
    if (rc) {
        tdm_optim_free(whole);
        return NULL;
    }
    return whole;
}

tdm_module *tdm_dp_replica(tdm_dp *dp, int r) {
    return dp && r >= 0 && r < dp->n ? dp->reps[r].replica : NULL;
}

tdm_optim *tdm_dp_optim(tdm_dp *dp, int r) {
    return dp && r >= 0 && r < dp->n ? dp->reps[r].opt : NULL;
}

int tdm_dp_devices(const tdm_dp *dp) {
    return dp ? dp->n : 0;
}

void tdm_dp_free(tdm_dp *dp) {
    if (!dp) return;
    dp->quit = true;
    atomic_fetch_add(&dp->generation, 1);
    tdm_waitq_wake(&dp->go);
    for (int i = 1; i < dp->n; i++)
        if (dp->reps[i].thread) pthread_join(dp->reps[i].thread, NULL);
    tdm_ddp_free(dp->reps[0].ddp); /* replica 0's, made on the caller's thread */
    tdm_optim_free(dp->reps[0].opt);
    if (pthread_equal(dp->caller, pthread_self()))
        tdm_restore_thread_affinity(&dp->caller_affinity);
    for (int i = 1; i < dp->n; i++) tdm_module_free(dp->reps[i].replica);
    for (int i = 0; i < TDM_MAX_DEVICES; i++) tdm_nccl_group_free(dp->nccl[i]); /* NULLs ignored */
    tdm_hier_world_free(dp->hier); /* its threads wait on the threads world's groups */
    tdm_threads_world_free(dp->world);
    tdm_cpu_gemm_set_threads(dp->gemm_threads);
    tdm_waitq_destroy(&dp->go);
    tdm_waitq_destroy(&dp->done);
    free(dp);
}
