/* The two-level process group: several devices per process (a threads world inside) and
 * several processes (an outer group, MPI, across). Global rank = process * L + local rank
 * for L devices per process.
 *
 * Every collective is composed of the inner and outer ones: an all-reduce sums over this
 * process's threads, local rank 0 sums the processes' partial sums over the outer group, then
 * broadcasts the result to its threads. The sum is therefore taken per process first, then
 * over processes in rank order: a fixed order, so results are the same every run and on
 * every rank (though not bit-equal to a flat rank-order sum). Only local rank 0 talks to the
 * outer group, so its collectives are issued from one thread in one order.
 *
 * bf16 and f16 reductions are widened to f32 on each rank, reduced as f32 above and rounded
 * once at the end (run_half): the sum of the ranks' rounded values in this order, rounded
 * once, as the flat backends give in theirs; the data then moves as f32 (twice the bytes of
 * the flat backends' low-precision reductions).
 *
 * Each rank runs its collectives on a thread of its own, in launch order, so DDP's bucket
 * all-reduces proceed while backward goes on, as with the flat backends. */
#include "parallel/group.h"

#include "tandem/half.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    tdm_group g; /* first member: a tdm_group * is an hrank * */
    struct tdm_hier_world *w;
    int local_rank;
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    tdm_work *head, *tail; /* launched, not yet run (FIFO) */
    bool stop;
    void *tmp; /* scratch of all_gather and reduce_scatter */
    size_t tmp_bytes;
} hrank;

struct tdm_hier_world {
    int nl, np, p; /* devices per process, processes, this process */
    tdm_threads_world *local;
    tdm_group *outer;
    hrank *ranks;
};

/* ---- composing the inner and outer collectives --------------------------------------------- */

/* Runs c on sub-group g and waits; on failure copies the error into msg. */
static int sub(tdm_group *g, tdm_coll c, char *msg) {
    int rc = tdm_work_wait(tdm_group_launch(g, c));
    if (rc) snprintf(msg, TDM_WORK_MSG, "%s", tdm_last_error());
    return rc;
}

/* The site of the collective this rank's thread runs (run): its parts carry it. */
static _Thread_local const char *running_site;

/* A collective of the inner or outer group (its reductions f32: run_half widens), named as
 * the collective it is a part of. */
static tdm_coll coll(tdm_coll_kind kind, tdm_reduce_kind op, int root, int64_t count, tdm_dtype dt,
                     void *out, const void *in) {
    tdm_coll c = {.kind = kind,
                  .op = op,
                  .root = root,
                  .count = count,
                  .elem = tdm_dtype_size(dt),
                  .out = out,
                  .in = in,
                  .dtype = dt};
    if (running_site) snprintf(c.site, sizeof c.site, "%s", running_site);
    return c;
}

static tdm_group *inner(hrank *h) {
    return tdm_threads_world_group(h->w->local, h->local_rank);
}

/* buf [count] f32 on every rank of every process <- the sum (or mean) over all of them. */
static int all_reduce(hrank *h, float *buf, int64_t count, tdm_reduce_kind op, char *msg) {
    tdm_hier_world *w = h->w;
    if (w->np == 1)
        return sub(inner(h), coll(TDM_COLL_ALL_REDUCE, op, 0, count, TDM_F32, buf, buf), msg);
    int rc = sub(inner(h), coll(TDM_COLL_ALL_REDUCE, TDM_SUM, 0, count, TDM_F32, buf, buf), msg);
    if (!rc && h->local_rank == 0) {
        rc = sub(w->outer, coll(TDM_COLL_ALL_REDUCE, TDM_SUM, 0, count, TDM_F32, buf, buf), msg);
        if (!rc && op == TDM_AVG) {
            float n = (float)h->g.size;
            for (int64_t i = 0; i < count; i++) buf[i] /= n;
        }
    }
    if (!rc)
        rc = sub(inner(h), coll(TDM_COLL_BROADCAST, TDM_SUM, 0, count, TDM_F32, buf, buf), msg);
    return rc;
}

/* buf [count] f32 on root <- the sum (or mean) over every rank, the bits all_reduce gives:
 * summed inside each process to its local rank 0, across to the root's process, then handed
 * to the root inside it. Other ranks' buf may keep partial sums. */
static int reduce(hrank *h, float *buf, int64_t count, tdm_reduce_kind op, int root, char *msg) {
    tdm_hier_world *w = h->w;
    int rp = root / w->nl, rl = root % w->nl;
    if (w->np == 1)
        return sub(inner(h), coll(TDM_COLL_REDUCE, op, rl, count, TDM_F32, buf, buf), msg);
    int rc = sub(inner(h), coll(TDM_COLL_REDUCE, TDM_SUM, 0, count, TDM_F32, buf, buf), msg);
    if (!rc && h->local_rank == 0) {
        rc = sub(w->outer, coll(TDM_COLL_REDUCE, TDM_SUM, rp, count, TDM_F32, buf, buf), msg);
        if (!rc && op == TDM_AVG && w->p == rp) {
            float n = (float)h->g.size;
            for (int64_t i = 0; i < count; i++) buf[i] /= n;
        }
    }
    if (!rc && w->p == rp && rl != 0)
        rc = sub(inner(h), coll(TDM_COLL_BROADCAST, TDM_SUM, 0, count, TDM_F32, buf, buf), msg);
    return rc;
}

/* Root's buf to everyone: inside the root's process first, then across, then inside. */
static int broadcast(hrank *h, void *buf, int64_t count, tdm_dtype dt, int root, char *msg) {
    tdm_hier_world *w = h->w;
    int rp = root / w->nl, rl = root % w->nl;
    int rc = TDM_OK;
    if (w->p == rp)
        rc = sub(inner(h), coll(TDM_COLL_BROADCAST, TDM_SUM, rl, count, dt, buf, buf), msg);
    if (!rc && h->local_rank == 0 && w->np > 1)
        rc = sub(w->outer, coll(TDM_COLL_BROADCAST, TDM_SUM, rp, count, dt, buf, buf), msg);
    if (!rc && w->p != rp)
        rc = sub(inner(h), coll(TDM_COLL_BROADCAST, TDM_SUM, 0, count, dt, buf, buf), msg);
    return rc;
}

static int barrier(hrank *h, char *msg) {
    tdm_coll b = coll(TDM_COLL_BARRIER, TDM_SUM, 0, 0, TDM_F32, NULL, NULL);
    b.elem = 1; /* as tdm_barrier's: ranks compare their barriers' headers */
    int rc = sub(inner(h), b, msg);
    if (!rc && h->local_rank == 0 && h->w->np > 1) rc = sub(h->w->outer, b, msg);
    if (!rc) rc = sub(inner(h), b, msg);
    return rc;
}

static void *scratch(hrank *h, size_t bytes, char *msg) {
    if (bytes > h->tmp_bytes || !h->tmp) {
        bytes = bytes ? bytes : 1;
        void *p = realloc(h->tmp, bytes);
        if (!p) {
            snprintf(msg, TDM_WORK_MSG, "out of memory for %zu bytes of scratch", bytes);
            return NULL;
        }
        h->tmp = p, h->tmp_bytes = bytes;
    }
    return h->tmp;
}

/* out [size * count] <- every rank's in [count], in global rank order. */
static int all_gather(hrank *h, const tdm_coll *c, char *msg) {
    tdm_hier_world *w = h->w;
    size_t piece = (size_t)c->count * c->elem, mine = piece * (size_t)w->nl;
    char *out = c->out, *local_part = out + mine * (size_t)w->p;
    int rc = sub(inner(h),
                 coll(TDM_COLL_ALL_GATHER, TDM_SUM, 0, c->count, c->dtype, local_part, c->in), msg);
    if (rc || w->np == 1) return rc;
    if (h->local_rank == 0) {
        /* the outer group's input may not alias its output */
        void *tmp = scratch(h, mine, msg);
        if (!tmp) return TDM_ERR_NOMEM;
        memcpy(tmp, local_part, mine);
        rc = sub(w->outer,
                 coll(TDM_COLL_ALL_GATHER, TDM_SUM, 0, c->count * w->nl, c->dtype, out, tmp), msg);
    }
    int64_t total = c->count * (int64_t)h->g.size;
    if (!rc)
        rc = sub(inner(h), coll(TDM_COLL_BROADCAST, TDM_SUM, 0, total, c->dtype, out, out), msg);
    return rc;
}

/* out [count] <- chunk (global rank) of the reduction of every rank's in [size * count]. */
static int reduce_scatter(hrank *h, const tdm_coll *c, char *msg) {
    int64_t total = c->count * (int64_t)h->g.size;
    float *tmp = scratch(h, (size_t)total * 4, msg);
    if (!tmp) return TDM_ERR_NOMEM;
    memcpy(tmp, c->in, (size_t)total * 4);
    int rc = all_reduce(h, tmp, total, c->op, msg);
    if (!rc) memcpy(c->out, tmp + c->count * h->g.rank, (size_t)c->count * 4);
    return rc;
}

/* A bf16 or f16 all-reduce, reduce or reduce-scatter: c's input widened to f32 in the scratch,
 * reduced there as f32 and rounded once into c's output. */
static int run_half(hrank *h, const tdm_coll *c, char *msg) {
    bool scatter = c->kind == TDM_COLL_REDUCE_SCATTER;
    int64_t total = scatter ? c->count * (int64_t)h->g.size : c->count;
    float *tmp = scratch(h, (size_t)total * 4, msg);
    if (!tmp) return TDM_ERR_NOMEM;
    bool bf = c->dtype == TDM_BF16;
    (bf ? tdm_bf16_to_f32 : tdm_f16_to_f32)(tmp, c->in, (size_t)total);
    int rc = c->kind == TDM_COLL_REDUCE ? reduce(h, tmp, total, c->op, c->root, msg)
                                        : all_reduce(h, tmp, total, c->op, msg);
    const float *mine = tmp + (scatter ? c->count * h->g.rank : 0);
    if (!rc) (bf ? tdm_bf16_from_f32 : tdm_f16_from_f32)(c->out, mine, (size_t)c->count);
    return rc;
}

static int run(hrank *h, const tdm_coll *c, char *msg) {
    running_site = c->site;
    bool reduction = c->kind == TDM_COLL_ALL_REDUCE || c->kind == TDM_COLL_REDUCE ||
                     c->kind == TDM_COLL_REDUCE_SCATTER;
    if (reduction && c->dtype != TDM_F32) return run_half(h, c, msg);
    switch (c->kind) {
    case TDM_COLL_ALL_REDUCE:
        return all_reduce(h, c->out, c->count, c->op, msg);
    case TDM_COLL_BROADCAST:
        return broadcast(h, c->out, c->count, c->dtype, c->root, msg);
    case TDM_COLL_ALL_GATHER:
        return all_gather(h, c, msg);
    case TDM_COLL_REDUCE_SCATTER:
        return reduce_scatter(h, c, msg);
    case TDM_COLL_BARRIER:
        return barrier(h, msg);
    case TDM_COLL_REDUCE:
        return reduce(h, c->out, c->count, c->op, c->root, msg);
    }
    snprintf(msg, TDM_WORK_MSG, "unknown collective %d", (int)c->kind);
    return TDM_ERR_ARG;
}

/* ---- each rank's thread ---------------------------------------------------------------------- */

static void *rank_main(void *arg) {
    hrank *h = arg;
    char msg[TDM_WORK_MSG];
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (!h->head && !h->stop) pthread_cond_wait(&h->cv, &h->mu);
        tdm_work *wk = h->head;
        if (!wk) break; /* stopping, queue empty */
        h->head = wk->next;
        if (!h->head) h->tail = NULL;
        bool stop = h->stop;
        pthread_mutex_unlock(&h->mu);
        msg[0] = '\0';
        int rc = stop ? TDM_ERR_COMM : run(h, &wk->c, msg);
        if (stop) snprintf(msg, sizeof msg, "group destroyed with the collective pending");
        /* local rank 0 may have failed across processes: its threads must not wait for it */
        if (rc && !stop) tdm_group_abort(inner(h), msg);
        tdm_work_finish(wk, rc ? TDM_ERR_COMM : TDM_OK, msg);
        pthread_mutex_lock(&h->mu);
    }
    pthread_mutex_unlock(&h->mu);
    tdm_thread_release();
    return NULL;
}

static int hier_launch(tdm_group *g, tdm_work *wk) {
    hrank *h = (hrank *)g;
    pthread_mutex_lock(&h->mu);
    if (h->stop) {
        pthread_mutex_unlock(&h->mu);
        return tdm_raise(TDM_ERR_COMM, "%s: group destroyed", tdm_coll_name(wk->c.kind));
    }
    wk->next = NULL;
    if (h->tail)
        h->tail->next = wk;
    else
        h->head = wk;
    h->tail = wk;
    pthread_cond_signal(&h->cv);
    pthread_mutex_unlock(&h->mu);
    return TDM_OK;
}

/* The failure reaches this process's threads through the inner group and the other processes
 * through the outer one; their pending collectives then fail, and so do this rank's. */
static void hier_abort(tdm_group *g, const char *message) {
    hrank *h = (hrank *)g;
    char msg[TDM_WORK_MSG];
    snprintf(msg, sizeof msg, "rank %d (device %d of process %d): %.400s", g->rank, h->local_rank,
             h->w->p, message);
    tdm_group_abort(inner(h), msg);
    if (h->w->np > 1) tdm_group_abort(h->w->outer, msg);
}

static const tdm_group_ops hier_ops = {
    .name = "threads+mpi", .launch = hier_launch, .abort = hier_abort};

/* ---- the world ------------------------------------------------------------------------------- */

tdm_hier_world *tdm_hier_world_new(tdm_threads_world *local, int local_size, tdm_group *processes) {
    if (!local || !processes || local_size < 1)
        return tdm_raise_null(TDM_ERR_ARG, "two-level group: NULL world or %d devices", local_size);
    tdm_hier_world *w = calloc(1, sizeof *w);
    hrank *ranks = calloc((size_t)local_size, sizeof *ranks);
    if (!w || !ranks) {
        free(w);
        free(ranks);
        return tdm_raise_null(TDM_ERR_NOMEM, "two-level group: out of memory");
    }
    *w = (tdm_hier_world){
        local_size, tdm_group_size(processes), tdm_group_rank(processes), local, processes, ranks};
    for (int l = 0; l < local_size; l++) {
        hrank *h = &ranks[l];
        h->w = w;
        h->local_rank = l;
        tdm_group_init(&h->g, &hier_ops, w->p * local_size + l, w->np * local_size,
                       tdm_group_device(tdm_threads_world_group(local, l)));
        pthread_mutex_init(&h->mu, NULL);
        pthread_cond_init(&h->cv, NULL);
        int e = pthread_create(&h->thread, NULL, rank_main, h);
        h->started = e == 0;
        if (e) {
            tdm_hier_world_free(w);
            return tdm_raise_null(TDM_ERR_NOMEM,
                                  "two-level group: cannot start the thread of device %d (%s)", l,
                                  strerror(e));
        }
    }
    return w;
}

tdm_group *tdm_hier_world_group(tdm_hier_world *w, int local_rank) {
    if (!w || local_rank < 0 || local_rank >= w->nl)
        return tdm_raise_null(TDM_ERR_ARG, "two-level group: no device %d", local_rank);
    return &w->ranks[local_rank].g;
}

bool tdm_hier_group_parts(tdm_group *g, tdm_group **local, int *local_size, tdm_group **processes) {
    if (!g || g->ops != &hier_ops) return false;
    hrank *h = (hrank *)g;
    *local = inner(h);
    *local_size = h->w->nl;
    *processes = h->w->outer;
    return true;
}

void tdm_hier_world_free(tdm_hier_world *w) {
    if (!w) return;
    for (int l = 0; l < w->nl; l++) {
        hrank *h = &w->ranks[l];
        if (!h->w) continue; /* never initialised (a thread failed to start before it) */
        pthread_mutex_lock(&h->mu);
        h->stop = true;
        pthread_cond_signal(&h->cv);
        pthread_mutex_unlock(&h->mu);
        if (h->started) pthread_join(h->thread, NULL);
        pthread_cond_destroy(&h->cv);
        pthread_mutex_destroy(&h->mu);
        tdm_group_destroy(&h->g);
        free(h->tmp);
    }
    free(w->ranks);
    free(w);
}
