/* The tensor-parallel strategy: this process's devices laid out as a mesh dp x tp, each running
 * a clone of the caller's model that the caller's plan split over its tp group, on a
 * persistent thread of its own. A step gives every rank of dp row d the same rows of the batch
 * (tdm_rows_of over dp); DDP over each dp group averages the gradients; every rank steps the
 * optimizer of its own parts. The caller's model stays whole and idle: the ranks' parts are
 * gathered into it for an evaluation's weights and checkpoints (sync_model, optim_gather), and
 * scattered from it after a checkpoint was read into it (push_whole).
 *
 * Every rank's thread runs every round, the caller waiting on a condition variable: a GPT's
 * step is long next to a wake-up, and tensor parallelism needs every rank of a group in every
 * collective, the caller's thread included had it been rank 0.
 *
 * Across processes (o.procs) this process holds n ranks of the mesh (global rank = process * n
 * + i), their groups two-level when n > 1 (tdm_hier_world over this process's threads and the
 * processes). Its batch is its own dp rows' already: n / tp rows when a process holds whole tp
 * groups, else (tp groups across processes) the one row its tp group shares (rows == 1). */
#include "parallel/group.h"
#include "parallel/sync.h"
#include "backend/backend.h" /* tdm_cpu_gemm_set_threads */
#include "tandem/trace.h"
#include "parallel/strategy.h"
#include "core/core.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum {
    ROUND_HASH,
    ROUND_INIT,
    ROUND_STEP,
    ROUND_FORWARD,
    ROUND_GATHER,
    ROUND_SCATTER,
    ROUND_SHARD
} round_kind;

typedef struct tp_rank {
    struct tensor_parallel *s;
    int rank, d, t; /* rank = d tp + t (the mesh's row-major order) */
    int row;        /* its part of the batch: d, or 0 across processes */
    tdm_device dev; /* its device (across processes rank is not an index of devices) */
    pthread_t thread;
    bool started;
    tdm_module *replica; /* a whole clone until the init round splits it */
    tdm_optim *opt;
    tdm_ddp *ddp; /* over the dp group when dp > 1 */
    tdm_mesh *mesh;
    float loss;      /* the round's mean loss over the rank's rows */
    float *found;    /* and what it found on every rank of the mesh: FOUND floats each */
    tdm_tensor *out; /* a forward round's output (t == 0), kept until joined */
    int rc;
    char err[512];
} tp_rank;

typedef struct tensor_parallel {
    tdm_strategy base;
    tdm_module *model;
    int n, tp, dp; /* n: the ranks this process holds */
    int rows;      /* the dp rows this process holds: a step's batch splits into as many */
    tdm_device devices[TDM_MAX_DEVICES];
    tp_rank ranks[TDM_MAX_DEVICES];
    tdm_threads_world *world;
    tdm_hier_world *hier; /* across processes with n > 1: the ranks' two-level group */
    tdm_tp_strategy_opts o;
    tdm_optim_factory make_optim;
    void *optim_arg;
    int gemm_threads; /* restored at free */
    /* the round: the caller writes the fields below and moves `generation` under mu; each rank
     * writes its rc, err and loss and counts itself in `finished` under mu */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t generation;
    int finished;
    bool quit;
    round_kind kind;
    tdm_tensor *x, *y;
    tdm_loss_fn loss_fn;
    void *loss_arg;
    bool first, last;        /* a step's first and last micro-batch */
    bool training;           /* a forward round's mode: the caller's model's */
    tdm_optim *whole_opt;    /* ROUND_GATHER's and ROUND_SCATTER's whole optimizer, or NULL */
    bool released;           /* the caller's model's values given back (whole_release) */
    tdm_shard_kind shard_to; /* what a ROUND_SHARD asks of every rank's DDP */
    tdm_units_fn units_of;   /* ZeRO stage 3's units of a rank's split model, or NULL */
} tensor_parallel;

/* ---- the caller's whole model, held only while it is needed --------------------------------- */

/* The whole model's gradients are given back for good once the ranks have their clones (it
 * never runs backward), its values from each step until the next gather: the device that
 * holds it and rank 0's parts then holds no more than the parts while they train. */
static int whole_release(tensor_parallel *s, bool grads) {
    tdm_paramset *ps = tdm_module_parameters(s->model);
    if (!ps) return tdm_last_status();
    if (grads) {
        for (int i = 0; i < ps->n; i++) {
            tdm_tensor_free(ps->params[i]->grad);
            ps->params[i]->grad = NULL;
        }
        return tdm_storage_resize(ps->flat_grad->storage, 0);
    }
    s->released = true;
    return tdm_storage_resize(ps->flat->storage, 0);
}

/* The whole model's values back (to be overwritten by a gather). */
static int whole_hold(tensor_parallel *s) {
    tdm_paramset *ps = tdm_module_parameters(s->model);
    int rc = ps ? tdm_storage_resize(ps->flat->storage, sizeof(float) * (size_t)ps->total)
                : tdm_last_status();
    if (!rc) s->released = false;
    return rc;
}

/* The group of every rank of the mesh, from rank r's place in it. */
static tdm_group *world_group(tp_rank *r) {
    tensor_parallel *s = r->s;
    int i = (int)(r - s->ranks);
    return s->hier      ? tdm_hier_world_group(s->hier, i)
           : s->o.procs ? s->o.procs
                        : tdm_threads_world_group(s->world, i);
}

static void abort_groups(tp_rank *r, const char *why) {
    char msg[600];
    snprintf(msg, sizeof msg, "%s", why); /* aborting may raise over the error it came from */
    tdm_group_abort(world_group(r), msg);
    if (r->mesh) tdm_group_abort(tdm_mesh_group(r->mesh, "tp"), msg);
    if (r->mesh) tdm_group_abort(tdm_mesh_group(r->mesh, "dp"), msg);
}

/* The mesh, the split, the optimizer and DDP over dp: collectives over the ranks. */
static int rank_init(tp_rank *r) {
    tensor_parallel *s = r->s;
    int sizes[2] = {s->dp, s->tp};
    const char *const names[2] = {"dp", "tp"};
    if (!(r->mesh = tdm_mesh_new(world_group(r), 2, sizes, names))) return tdm_last_status();
    int rc = s->o.parallelize(r->replica, tdm_mesh_group(r->mesh, "tp"), s->o.arg);
    tdm_paramset *ps = rc ? NULL : tdm_module_parameters(r->replica);
    if (!rc && !ps) rc = tdm_last_status();
    if (!rc && !(r->opt = s->make_optim(ps, s->optim_arg))) rc = tdm_last_status();
    if (!rc && s->dp > 1 &&
        !(r->ddp = tdm_ddp_new(r->replica, tdm_mesh_group(r->mesh, "dp"), NULL)))
        rc = tdm_last_status();
    return rc;
}

/* The update after the last micro-batch's backward: clipping by the whole model's norm, the
 * step. */
static int rank_update(tp_rank *r) {
    tensor_parallel *s = r->s;
    int rc = TDM_OK;
    if (s->base.clip > 0)
        rc = tdm_tp_clip_grad_norm(
            r->replica, r->ddp, r->mesh ? tdm_mesh_group(r->mesh, "dp") : NULL, s->base.clip, NULL);
    return rc ? rc : tdm_optim_step(r->opt);
}

static int rank_step(tp_rank *r) {
    tensor_parallel *s = r->s;
    tdm_device dev = r->dev;
    int64_t b = s->x->shape[0], lo, hi;
    tdm_rows_of(b, s->rows, r->row, &lo, &hi);
    tdm_scope_begin();
    tdm_tensor *xs = tdm_to_device(tdm_slice(s->x, 0, lo, hi, 1), dev);
    tdm_tensor *ys = tdm_to_device(tdm_slice(s->y, 0, lo, hi, 1), dev);
    tdm_tensor *out = !xs || !ys ? NULL
                      : r->ddp   ? tdm_ddp_forward(r->ddp, xs)
                                 : tdm_module_forward(r->replica, xs);
    tdm_strategy_set_loss_module(r->replica);
    tdm_tensor *loss = out ? s->loss_fn(out, ys, lo, s->loss_arg) : NULL;
    tdm_strategy_set_loss_module(NULL);
    /* DDP averages over dp rows; each weighted by its share of the batch (across processes
     * the rows' batches are equal) */
    float factor = (float)((double)(hi - lo) * s->rows / (double)b);
    tdm_tensor *scaled = !loss || factor == 1.0f ? loss : tdm_mul_scalar(loss, factor);
    int rc = s->first ? tdm_optim_zero_grad(r->opt) : TDM_OK;
    if (r->ddp) tdm_ddp_set_sync(r->ddp, s->last); /* accumulating rounds keep theirs local */
    if (!rc)
        rc = !scaled  ? tdm_last_status()
             : r->ddp ? tdm_ddp_backward(r->ddp, scaled)
                      : tdm_backward(scaled);
    if (!rc && s->last) rc = rank_update(r);
    r->loss = rc ? NAN : tdm_item(loss);
    tdm_scope_end();
    return rc;
}

/* Rank r's forward of its dp row's rows (every row runs the whole batch when it has fewer
 * rows than dp has rows), without gradients, in the caller's model's mode; ranks t == 0 keep
 * their output for the caller to join (across processes every rank keeps its own). */
static int rank_forward(tp_rank *r) {
    tensor_parallel *s = r->s;
    int64_t lo = 0, hi = s->x->shape[0];
    if (hi >= s->rows) tdm_rows_of(s->x->shape[0], s->rows, r->row, &lo, &hi);
    bool prev = tdm_set_grad_enabled(false), was = r->replica->training;
    tdm_module_train(r->replica, s->training);
    tdm_scope_begin();
    tdm_tensor *xs = tdm_to_device(tdm_slice(s->x, 0, lo, hi, 1), r->replica->device);
    tdm_tensor *out = xs ? tdm_module_forward(r->replica, xs) : NULL;
    if (out && s->o.whole_output) out = s->o.whole_output(r->replica, out, s->o.arg);
    int rc = out ? TDM_OK : tdm_last_status();
    if (out && (r->t == 0 || s->o.procs)) r->out = tdm_scope_keep(out);
    tdm_scope_end();
    tdm_module_train(r->replica, was);
    tdm_set_grad_enabled(prev);
    return rc;
}

/* Each rank its part of the caller's whole model (and of whole_opt's state, of its shard
 * under ZeRO): no communication. */
static int rank_scatter(tp_rank *r) {
    tensor_parallel *s = r->s;
    int rc = tdm_tp_scatter_whole(r->replica, s->model);
    return rc || !s->whole_opt ? rc
                               : tdm_tp_scatter_state(r->replica, r->opt, s->model, s->whole_opt);
}

/* The parts into the caller's whole model and whole_opt: rank 0 writes, the other ranks of
 * dp row 0 take part in its collectives (the other rows hold the same parts). */
static int rank_gather(tp_rank *r) {
    tensor_parallel *s = r->s;
    /* ZeRO over dp: the parts' state whole first (a collective over the dp group) */
    tdm_optim *parts =
        s->whole_opt && s->base.shard != TDM_SHARD_NONE ? tdm_optim_gather(r->opt) : r->opt;
    int rc = parts ? TDM_OK : tdm_last_status();
    tdm_module *whole = r->rank > 0 ? NULL : s->model;
    if (!rc && r->d == 0) rc = tdm_tp_gather_whole(r->replica, whole);
    if (!rc && r->d == 0 && s->whole_opt)
        rc = tdm_tp_gather_state(r->replica, parts, whole, whole ? s->whole_opt : NULL);
    if (parts != r->opt) tdm_optim_free(parts);
    return rc;
}

/* Parts to whole (gather) or whole to parts; under ZeRO stage 3 the parts are made whole for
 * it (collectives over dp) and sharded again after, a scatter's values kept. */
static int rank_whole(tp_rank *r, bool gather) {
    bool params = r->s->base.shard == TDM_SHARD_PARAMETERS;
    int rc = params ? tdm_ddp_gather_params(r->ddp) : TDM_OK;
    if (!rc) rc = gather ? rank_gather(r) : rank_scatter(r);
    int back = params ? tdm_ddp_release_params(r->ddp) : TDM_OK;
    return rc ? rc : back;
}

/* This rank's DDP over dp sharding what s->shard_to names; for stage 3 its units first (the
 * caller's units_of on the rank's split model: a GPT's blocks). */
static int rank_shard(tp_rank *r) {
    tensor_parallel *s = r->s;
    if (s->shard_to == TDM_SHARD_PARAMETERS && s->units_of) {
        int rc = tdm_ddp_set_shard_units_of(r->ddp, r->replica, s->units_of);
        if (rc) return rc;
    }
    return tdm_ddp_set_shard(r->ddp, r->opt, s->shard_to);
}

/* What ROUND_HASH finds on a rank: how many of its parameters differ from dp row 0's rank in
 * its tp column, the first of them, its device (type, index). */
enum { FOUND = 4 };

/* Every rank's v[0..n) (floats on the rank's device) summed over the whole mesh: over tp, then
 * dp (the mesh's groups, NCCL's on GPUs). */
static int mesh_sum(tp_rank *r, float *v, int n) {
    tdm_tensor *t = tdm_from_data(TDM_SHAPE(n), TDM_F32, r->dev, v);
    int rc = t ? TDM_OK : tdm_last_status();
    tdm_collective_label("check_replicas: what each rank found");
    if (!rc) rc = tdm_work_wait(tdm_all_reduce(tdm_mesh_group(r->mesh, "tp"), t, TDM_SUM));
    tdm_collective_label("check_replicas: what each rank found");
    if (!rc && r->s->dp > 1)
        rc = tdm_work_wait(tdm_all_reduce(tdm_mesh_group(r->mesh, "dp"), t, TDM_SUM));
    if (!rc) rc = tdm_to_host(t, v, sizeof(float) * (size_t)n);
    tdm_tensor_free(t);
    return rc;
}

/* This rank's hashes hash[0..n) against those of dp row 0's rank in its tp column, through an
 * all-gather over dp (as 32-bit halves); *count differ, the first at *first. */
static int compare_row0(tp_rank *r, const uint64_t *hash, int n, int *count, int *first) {
    int dp = r->s->dp;
    int32_t *mine = malloc(sizeof(int32_t) * 2 * (size_t)n);
    if (!mine) return tdm_raise(TDM_ERR_NOMEM, "check_replicas: out of memory");
    for (int i = 0; i < n; i++)
        mine[2 * i] = (int32_t)(uint32_t)hash[i], mine[2 * i + 1] = (int32_t)(hash[i] >> 32);
    tdm_tensor *in = tdm_from_data(TDM_SHAPE(2 * n), TDM_I32, r->dev, mine);
    tdm_tensor *out = in ? tdm_zeros(TDM_SHAPE((int64_t)2 * n * dp), TDM_I32, r->dev) : NULL;
    int rc = out ? TDM_OK : tdm_last_status();
    tdm_collective_label("check_replicas: the parameters' hashes");
    if (!rc) rc = tdm_work_wait(tdm_all_gather(tdm_mesh_group(r->mesh, "dp"), out, in));
    int32_t *all = rc ? NULL : malloc(sizeof(int32_t) * 2 * (size_t)n * (size_t)dp);
    if (!rc && !all) rc = tdm_raise(TDM_ERR_NOMEM, "check_replicas: out of memory");
    if (!rc) rc = tdm_to_host(out, all, sizeof(int32_t) * 2 * (size_t)n * (size_t)dp);
    *count = 0, *first = -1;
    for (int i = 0; i < n && !rc; i++)
        if (all[2 * i] != mine[2 * i] || all[2 * i + 1] != mine[2 * i + 1])
            *first = *first < 0 ? i : *first, ++*count;
    free(all), free(mine);
    tdm_tensor_free(in), tdm_tensor_free(out);
    return rc;
}

/* The hashes of this rank's parameters (its parts), under ZeRO stage 3 made whole for it
 * (collectives over dp), compared with dp row 0's; then what every rank of the mesh found,
 * into r->found (every rank learns the same, in this process and the others). */
static int rank_hash(tp_rank *r) {
    tensor_parallel *s = r->s;
    tdm_paramset *ps = tdm_module_parameters(r->replica);
    int world = s->dp * s->tp;
    free(r->found);
    uint64_t *hash = ps ? malloc(sizeof *hash * (size_t)(ps->n ? ps->n : 1)) : NULL;
    r->found = hash ? calloc((size_t)world * FOUND, sizeof *r->found) : NULL;
    if (!r->found) {
        free(hash);
        return ps ? tdm_raise(TDM_ERR_NOMEM, "check_replicas: out of memory") : tdm_last_status();
    }
    bool params = s->base.shard == TDM_SHARD_PARAMETERS;
    int rc = params ? tdm_ddp_gather_params(r->ddp) : TDM_OK;
    for (int i = 0; i < ps->n && !rc; i++) rc = tdm_strategy_hash_tensor(ps->params[i], &hash[i]);
    int back = params ? tdm_ddp_release_params(r->ddp) : TDM_OK;
    rc = rc ? rc : back;
    int count = 0, first = -1;
    if (!rc && s->dp > 1) rc = compare_row0(r, hash, ps->n, &count, &first);
    free(hash);
    float *f = r->found + (size_t)r->rank * FOUND;
    f[0] = (float)count, f[1] = (float)first, f[2] = (float)r->dev.type, f[3] = (float)r->dev.index;
    return rc ? rc : mesh_sum(r, r->found, world * FOUND);
}

static int rank_round(tp_rank *r) {
    switch (r->s->kind) {
    case ROUND_HASH:
        return rank_hash(r);
    case ROUND_INIT:
        return rank_init(r);
    case ROUND_STEP:
        return rank_step(r);
    case ROUND_FORWARD:
        return rank_forward(r);
    case ROUND_GATHER:
        return rank_whole(r, true);
    case ROUND_SCATTER:
        return rank_whole(r, false);
    case ROUND_SHARD:
        return rank_shard(r);
    }
    return TDM_ERR_STATE;
}

static void *rank_main(void *arg) {
    tp_rank *r = arg;
    tensor_parallel *s = r->s;
    char track[48], dev[16];
    snprintf(track, sizeof track, "%s compute", tdm_device_str(r->dev, dev));
    tdm_trace_name_thread(track);
    if (s->o.procs) /* mpirun places the processes; the GEMM takes its share of the caller's */
        tdm_cpu_gemm_set_threads(s->gemm_threads / s->n > 1 ? s->gemm_threads / s->n : 1);
    else
        tdm_pin_rank_thread(r->rank, s->n);
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (s->generation == seen && !s->quit) pthread_cond_wait(&s->go, &s->mu);
        seen = s->generation;
        bool quit = s->quit, failed = r->rc != 0;
        pthread_mutex_unlock(&s->mu);
        if (quit) break;
        bool grad = tdm_set_grad_enabled(true);
        int rc = failed ? r->rc : rank_round(r); /* a rank that failed to start stays failed */
        tdm_set_grad_enabled(grad);
        /* the others may wait for this rank at a collective of any of its groups: they fail
         * now, not at a timeout */
        if (rc && !failed) abort_groups(r, tdm_last_error());
        pthread_mutex_lock(&s->mu);
        if (rc && !failed) snprintf(r->err, sizeof r->err, "%s", tdm_last_error());
        r->rc = rc;
        if (++s->finished == s->n) pthread_cond_signal(&s->done);
        pthread_mutex_unlock(&s->mu);
    }
    free(r->found);
    tdm_ddp_free(r->ddp);
    tdm_optim_free(r->opt);
    tdm_module_free(r->replica);
    tdm_mesh_free(r->mesh);
    tdm_thread_release(); /* the thread's arena and tape */
    return NULL;
}

/* Runs one round of kind on every rank and waits for all; the first failure, naming its
 * device and mesh coordinates. */
static int run_round(tensor_parallel *s, round_kind kind) {
    pthread_mutex_lock(&s->mu);
    s->kind = kind, s->finished = 0, s->generation++;
    pthread_cond_broadcast(&s->go);
    while (s->finished < s->n) pthread_cond_wait(&s->done, &s->mu);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < s->n; i++) {
        tp_rank *r = &s->ranks[i];
        char dev[16], proc[32] = "";
        if (s->o.procs) snprintf(proc, sizeof proc, "process %d, ", r->rank / s->n);
        if (r->rc)
            return tdm_raise(r->rc, "tensor_parallel: %s (%sdp %d, tp %d): %s",
                             tdm_device_str(s->devices[i], dev), proc, r->d, r->t, r->err);
    }
    return TDM_OK;
}

/* ---- the strategy's entries ---------------------------------------------------------------- */

static int tp_step(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                   void *loss_arg, bool first, bool last, float *loss) {
    tensor_parallel *s = (tensor_parallel *)st;
    char a[96];
    if (x->ndim < 1 || target->ndim < 1 || x->shape[0] != target->shape[0] || x->shape[0] < s->rows)
        return tdm_raise(TDM_ERR_SHAPE,
                         "tensor_parallel step: a batch %s (and its targets) cannot be split over "
                         "%d data-parallel rows",
                         tdm_shape_str(tdm_shape_of(x), a), s->rows);
    s->x = x, s->y = target, s->loss_fn = loss_fn, s->loss_arg = loss_arg;
    s->first = first, s->last = last;
    int rc = whole_release(s, false);
    if (!rc) rc = run_round(s, ROUND_STEP);
    if (loss) { /* every rank of a dp row has its row's loss: take t == 0's (or this one's) */
        double sum = 0;
        int64_t lo, hi;
        for (int d = 0; d < s->rows; d++) {
            tdm_rows_of(x->shape[0], s->rows, d, &lo, &hi);
            sum += (double)s->ranks[d * s->tp].loss * (double)(hi - lo);
        }
        *loss = rc ? NAN : (float)(sum / (double)x->shape[0]);
    }
    return rc;
}

static int tp_forward(tdm_strategy *st, tdm_tensor *x, tdm_tensor **out) {
    tensor_parallel *s = (tensor_parallel *)st;
    if (x->ndim < 1) return tdm_raise(TDM_ERR_SHAPE, "tensor_parallel forward: a 0-dim input");
    s->x = x, s->training = s->model->training;
    int rc = run_round(s, ROUND_FORWARD), rows = x->shape[0] < s->rows ? 1 : s->rows;
    tdm_tensor *parts[TDM_MAX_DEVICES];
    for (int d = 0; d < rows && !rc; d++)
        if (!(parts[d] = tdm_to_device(s->ranks[d * s->tp].out, s->devices[0])))
            rc = tdm_last_status();
    if (!rc && !(*out = tdm_concat(parts, rows, 0))) rc = tdm_last_status();
    for (int i = 0; i < s->n; i++) {
        tdm_tensor_free(s->ranks[i].out);
        s->ranks[i].out = NULL;
    }
    return rc;
}

/* ZeRO stages 1 to 3 over each dp group: every rank of a row holds its shard of its parts'
 * optimizer state, under stage 2 of their averaged gradient, under stage 3 of the parts
 * themselves (gathered by units around their forward and backward: FSDP with TP). */
static int tp_set_shard(tdm_strategy *st, tdm_shard_kind kind, tdm_units_fn units_of) {
    tensor_parallel *s = (tensor_parallel *)st;
    if (s->dp == 1) return TDM_OK; /* nobody to share with */
    s->shard_to = kind, s->units_of = units_of;
    int rc = run_round(s, ROUND_SHARD);
    if (!rc) st->shard = kind;
    return rc;
}

static int tp_set_reduce_dtype(tdm_strategy *st, tdm_dtype dt) {
    (void)st;
    if (dt == TDM_F32) return TDM_OK;
    return tdm_raise(TDM_ERR_ARG, "strategy set_reduce_dtype: tensor parallelism's data-parallel "
                                  "rows average in f32 in this process's shared memory");
}

static int tp_set_scaler(tdm_strategy *st, tdm_grad_scaler *sc) {
    (void)st;
    return sc ? tdm_raise(TDM_ERR_ARG, "strategy set_precision: fp16's loss scaling is not "
                                       "written for tensor parallelism yet; use bf16")
              : TDM_OK;
}

static void tp_set_lr(tdm_strategy *st, float lr) {
    tensor_parallel *s = (tensor_parallel *)st;
    for (int i = 0; i < s->n; i++) tdm_optim_set_lr(s->ranks[i].opt, lr);
}

static int tp_sync_model(tdm_strategy *st) {
    tensor_parallel *s = (tensor_parallel *)st;
    s->whole_opt = NULL;
    int rc = whole_hold(s);
    return rc ? rc : run_round(s, ROUND_GATHER);
}

static tdm_module *tp_replica(tdm_strategy *st, int r) {
    (void)r;
    return ((tensor_parallel *)st)->model;
}

/* Rank 0's optimizer: its learning rate and step count are every rank's. */
static tdm_optim *tp_optim(tdm_strategy *st, int r) {
    (void)r;
    return ((tensor_parallel *)st)->ranks[0].opt;
}

/* The caller's model made whole, and a whole optimizer over it holding the gathered state. */
static tdm_optim *tp_optim_gather(tdm_strategy *st) {
    tensor_parallel *s = (tensor_parallel *)st;
    tdm_paramset *ps = tdm_module_parameters(s->model);
    tdm_optim *whole = ps ? s->make_optim(ps, s->optim_arg) : NULL;
    if (!whole) return NULL;
    tdm_optim_set_lr(whole, tdm_optim_lr(s->ranks[0].opt));
    s->whole_opt = whole;
    int rc = whole_hold(s);
    if (!rc) rc = run_round(s, ROUND_GATHER);
    s->whole_opt = NULL;
    if (rc) tdm_optim_free(whole);
    return rc ? NULL : whole;
}

static int tp_push_whole(tdm_strategy *st, tdm_optim *whole) {
    tensor_parallel *s = (tensor_parallel *)st;
    if (s->released)
        return tdm_raise(TDM_ERR_STATE,
                         "strategy push_whole: the caller's model holds no weights since the "
                         "last step; tdm_strategy_sync_model before writing into it");
    s->whole_opt = whole;
    int rc = run_round(s, ROUND_SCATTER);
    s->whole_opt = NULL;
    return rc;
}

/* Every rank's parts against those of the rank of dp row 0 in its tp column, which they
 * must equal bit for bit (one initial split of one model, one averaged update a step); across
 * processes too, every process reaching the same verdict. */
static int tp_check_replicas(tdm_strategy *st, tdm_group *procs) {
    (void)procs; /* the mesh spans them */
    tensor_parallel *s = (tensor_parallel *)st;
    int rc = run_round(s, ROUND_HASH);
    const float *found = s->ranks[0].found;
    for (int g = 0; g < s->dp * s->tp && !rc; g++) {
        const float *f = found + (size_t)g * FOUND;
        if (f[0] == 0) continue;
        tdm_paramset *ps = tdm_module_parameters(s->ranks[0].replica);
        int k = (int)f[1];
        char dev[16], sb[96], proc[32] = "";
        tdm_device_str((tdm_device){(tdm_device_type)f[2], (int)f[3]}, dev);
        if (s->o.procs) snprintf(proc, sizeof proc, "process %d, ", g / s->n);
        rc = tdm_raise(TDM_ERR_STATE,
                       "the replicas differ: parameter \"%s\" %s of rank %d (%s%s, dp %d, tp "
                       "%d) is not dp row 0's (%d of %d parameters differ); the data-parallel "
                       "rows start equal and take one averaged update, so one computed "
                       "something else (a non-deterministic kernel, a fault)",
                       k >= 0 && k < ps->n ? ps->names[k] : "?",
                       k >= 0 && k < ps->n ? tdm_shape_str(tdm_shape_of(ps->params[k]), sb) : "", g,
                       proc, dev, g / s->tp, g % s->tp, (int)f[0], ps->n);
    }
    return rc;
}

static void tp_describe(tdm_strategy *st, int64_t batch, char *buf, size_t cap) {
    tensor_parallel *s = (tensor_parallel *)st;
    snprintf(buf, cap, "mesh dp %d x tp %d%s, %lld samples per tensor-parallel group per step",
             s->dp, s->tp, s->o.procs ? " over the processes" : "", (long long)(batch / s->dp));
}

static tdm_module *tp_forward_module(tdm_strategy *st, int i) {
    tensor_parallel *s = (tensor_parallel *)st;
    return i < s->n ? s->ranks[i].replica : NULL;
}

static void tp_destroy(tdm_strategy *st) {
    tensor_parallel *s = (tensor_parallel *)st;
    pthread_mutex_lock(&s->mu);
    s->quit = true;
    pthread_cond_broadcast(&s->go);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < s->n; i++) {
        if (s->ranks[i].started)
            pthread_join(s->ranks[i].thread, NULL);
        else
            tdm_module_free(s->ranks[i].replica);
    }
    tdm_hier_world_free(s->hier);
    tdm_threads_world_free(s->world);
    tdm_cpu_gemm_set_threads(s->gemm_threads);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->go);
    pthread_cond_destroy(&s->done);
    free(s);
}

static const tdm_strategy_ops tensor_parallel_ops = {
    .step = tp_step,
    .forward = tp_forward,
    .set_shard = tp_set_shard,
    .set_reduce_dtype = tp_set_reduce_dtype,
    .set_scaler = tp_set_scaler,
    .set_lr = tp_set_lr,
    .sync_model = tp_sync_model,
    .replica = tp_replica,
    .optim = tp_optim,
    .optim_gather = tp_optim_gather,
    .push_whole = tp_push_whole,
    .check_replicas = tp_check_replicas,
    .describe = tp_describe,
    .forward_module = tp_forward_module,
    .destroy = tp_destroy,
};

static int check_args(const tdm_module *model, const tdm_device *devices, int n,
                      const tdm_tp_strategy_opts *o, tdm_optim_factory make_optim) {
    char a[16];
    if (!model || !devices || !o || !o->parallelize || !make_optim)
        return tdm_raise(TDM_ERR_ARG, "strategy tensor_parallel: NULL model, devices, options, "
                                      "parallelize or optimizer factory");
    if (o->procs && (n < 1 || n > TDM_MAX_DEVICES || o->tp < 1 || (n % o->tp && o->tp % n) ||
                     (int64_t)tdm_group_size(o->procs) * n % o->tp))
        return tdm_raise(TDM_ERR_ARG,
                         "strategy tensor_parallel: across processes, %d devices a process must "
                         "hold whole tp groups of %d or a part of one (a multiple or a divisor "
                         "of it), and %d processes of them ranks a multiple of it",
                         n, o->tp, tdm_group_size(o->procs));
    if (!o->procs && (n < 1 || n > TDM_MAX_DEVICES || o->tp < 1 || n % o->tp))
        return tdm_raise(TDM_ERR_ARG,
                         "strategy tensor_parallel: %d devices are not a multiple of tp %d (at "
                         "most %d devices)",
                         n, o->tp, TDM_MAX_DEVICES);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (tdm_device_equal(devices[i], devices[j]))
                return tdm_raise(TDM_ERR_DEVICE, "strategy tensor_parallel: device %s listed twice",
                                 tdm_device_str(devices[i], a));
    return TDM_OK;
}

tdm_strategy *tdm_strategy_tensor_parallel(tdm_module *model, const tdm_device *devices, int n,
                                           const tdm_tp_strategy_opts *o,
                                           tdm_optim_factory make_optim, void *optim_arg) {
    if (check_args(model, devices, n, o, make_optim)) return NULL;
    tensor_parallel *s = calloc(1, sizeof *s);
    if (!s) return tdm_raise_null(TDM_ERR_NOMEM, "strategy tensor_parallel: out of memory");
    int world = o->procs ? tdm_group_size(o->procs) * n : n;
    int p = o->procs ? tdm_group_rank(o->procs) : 0;
    s->model = model, s->n = n, s->tp = o->tp, s->dp = world / o->tp, s->o = *o;
    s->rows = n % o->tp ? 1 : n / o->tp; /* the dp rows this process holds */
    s->make_optim = make_optim, s->optim_arg = optim_arg;
    memcpy(s->devices, devices, sizeof *devices * (size_t)n);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->go, NULL);
    pthread_cond_init(&s->done, NULL);
    s->gemm_threads = tdm_gemm_threads_for_devices(n);
    s->base = (tdm_strategy){.ops = &tensor_parallel_ops,
                             .replicas = 1,
                             .ranks = s->dp,
                             .accumulates = true,
                             .holds_parts = true};
    /* the whole model's gradients go before the clones come: one copy fewer at once */
    int rc = whole_release(s, true);
    if (!rc && (!o->procs || n > 1) && !(s->world = tdm_threads_world_new(n, devices)))
        rc = tdm_last_status();
    if (!rc && o->procs && n > 1 && !(s->hier = tdm_hier_world_new(s->world, n, o->procs)))
        rc = tdm_last_status();
    /* the clones are made here, before any rank flattens or splits its own */
    for (int i = 0; i < n && !rc; i++) {
        int g = p * n + i; /* its rank in the mesh */
        s->ranks[i] = (tp_rank){.s = s, .rank = g, .d = g / s->tp, .t = g % s->tp};
        s->ranks[i].row = s->rows > 1 ? i / s->tp : 0, s->ranks[i].dev = devices[i];
        if (!(s->ranks[i].replica = tdm_module_clone(model, devices[i]))) rc = tdm_last_status();
    }
    for (int i = 0; i < n && !rc; i++) {
        if (pthread_create(&s->ranks[i].thread, NULL, rank_main, &s->ranks[i])) {
            tdm_group_abort(world_group(&s->ranks[0]), "could not start a thread");
            rc =
                tdm_raise(TDM_ERR_NOMEM, "strategy tensor_parallel: could not start %d threads", n);
            break;
        }
        s->ranks[i].started = true;
    }
    if (!rc) rc = run_round(s, ROUND_INIT);
    if (rc) {
        char msg[600];
        snprintf(msg, sizeof msg, "%s", tdm_last_error());
        tp_destroy(&s->base);
        return tdm_raise_null(rc, "%s", msg);
    }
    return &s->base;
}
