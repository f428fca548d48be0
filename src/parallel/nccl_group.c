/* The NCCL process-group backend (see nccl_group.h). Without NCCL in the build every entry
 * point reports that it is missing.
 *
 * Each rank keeps a FIFO of launched collectives with one CUDA event each. Completion is
 * in launch order: tdm_work_wait (through ops->progress) polls the oldest events until its
 * own has fired, finishing every handle on the way. A poll also reads NCCL's asynchronous
 * error state, and gives up after the group's timeout: the communicator is then aborted so
 * the GPU is not left spinning in a collective whose peer died.
 *
 * Desyncs. NCCL itself does not compare the ranks' calls: a different size hangs the GPUs, an
 * equal size with another tensor silently mixes them. The ranks of one tdm_nccl_world_new
 * share this process's memory, so each launch compares its fingerprint with the collective of
 * the same number in each peer's flight recorder (a side channel to NCCL: no GPU work, no
 * message); the second of two ranks to launch finds a mismatch, posts it on the world's board,
 * and every rank, in its launch or its wait, aborts its communicator (freeing a GPU left in
 * the mismatched collective) and fails with the one message naming both sides. Ranks in
 * different processes (tdm_nccl_group_new) are compared through the parent group instead
 * (tdm_group_watch): its next collective, the trainer's read-back, carries each rank's
 * count and digest of NCCL launches and the last one, and fails naming both sides. */
#include "parallel/nccl_group.h"
#include "parallel/sync.h"

#ifndef TANDEM_HAVE_NCCL

bool tdm_nccl_available(void) {
    return false;
}

tdm_group *tdm_nccl_group_new(tdm_group *parent, tdm_device dev) {
    return tdm_raise_null(TDM_ERR_DEVICE, "nccl group: this build has no NCCL (it needs the "
                                          "CUDA backend and nccl.h/libnccl at configure time)");
}

int tdm_nccl_world_new(int n, const tdm_device *devs, tdm_group **out) {
    return tdm_raise(TDM_ERR_DEVICE, "nccl group: this build has no NCCL");
}

void tdm_nccl_group_free(tdm_group *g) {}

#else

#include "backend/cuda/cuda.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RING 64 /* collectives in flight per rank before a launch waits for the oldest */

typedef struct {
    tdm_work *w;
    cudaEvent_t ev;
} pending;

typedef struct nboard nboard;

typedef struct nrank {
    tdm_group g;       /* first member: a tdm_group * is an nrank * */
    nboard *board;     /* the world's, for ranks made by tdm_nccl_world_new; else NULL */
    tdm_group *parent; /* tdm_nccl_group_new's, which watches this group; else NULL */
    ncclComm_t comm;
    int dev;
    cudaStream_t stream; /* the device's communication stream (owned by the CUDA backend) */
    float *barrier_buf;  /* one float all-reduced by a barrier */
    pthread_mutex_t lock;
    pending ring[RING];
    int head, count;
    bool failed;
    char fail_msg[TDM_WORK_MSG - 64];
} nrank;

bool tdm_nccl_available(void) {
    return true;
}

/* The ranks of one tdm_nccl_world_new: their flight recorders are compared at each launch, and
 * the first mismatch is posted here for all. Lock order: a rank's lock, the board's, a peer
 * group's. Freed by the last rank freed. */
struct nboard {
    pthread_mutex_t lock; /* ranks[] (a freed rank leaves), msg */
    atomic_int failed, refs;
    char msg[TDM_WORK_MSG - 64];
    int n;
    nrank *ranks[];
};

/* Whether r's collective c disagrees with the same-numbered collective of a peer that has
 * launched it (the board then holds the message). Caller holds r->lock. */
static bool board_check(nrank *r, const tdm_coll *c) {
    nboard *b = r->board;
    char msg[sizeof b->msg];
    pthread_mutex_lock(&b->lock);
    for (int q = 0; q < b->n && !atomic_load(&b->failed); q++) {
        if (q == r->g.rank || !b->ranks[q]) continue;
        tdm_group *pg = &b->ranks[q]->g;
        pthread_mutex_lock(&pg->lock);
        tdm_coll peer = pg->flight[c->seq % TDM_FLIGHT_LEN].c;
        bool launched = pg->launched >= c->seq && peer.seq == c->seq;
        pthread_mutex_unlock(&pg->lock);
        if (launched && tdm_coll_disagree(r->g.rank, c, q, &peer, false, msg, sizeof msg)) {
            snprintf(b->msg, sizeof b->msg, "%s", msg);
            atomic_store(&b->failed, 1);
        }
    }
    pthread_mutex_unlock(&b->lock);
    return atomic_load(&b->failed);
}

/* Marks the rank failed (first message wins) and aborts its communicator. Caller holds lock. */
static void fail_locked(nrank *r, const char *msg) {
    if (r->failed) return;
    r->failed = true;
    snprintf(r->fail_msg, sizeof r->fail_msg, "%s", msg);
    ncclCommAbort(r->comm); /* frees the communicator; later collectives fail at once */
    r->comm = NULL;
}

/* Finishes every pending collective with the failure. Their kernels may still be on the
 * communication stream (ncclCommAbort stops them without waiting for them), and a caller may
 * free its tensor as soon as its collective has failed, the caching allocator then handing
 * the block to work on the compute stream. So the compute stream is first ordered after the
 * communication stream: nothing queued later touches the block before the failed collectives
 * are off it. (A failure to order them means the device itself failed; its error stands.)
 * Caller holds lock. */
static void fail_pending_locked(nrank *r) {
    if (r->count > 0) tdm_cuda_order_streams(r->dev, false);
    while (r->count > 0) {
        pending *p = &r->ring[r->head];
        tdm_work_finish(p->w, TDM_ERR_COMM, r->fail_msg);
        r->head = (r->head + 1) % RING;
        r->count--;
    }
}

/* Waits for the oldest pending collective; finishes it. Caller holds lock. */
static void wait_oldest_locked(nrank *r) {
    pending *p = &r->ring[r->head];
    int64_t deadline = tdm_now_ns() + (int64_t)(tdm_group_timeout(&r->g) * 1e9);
    char msg[TDM_WORK_MSG - 64];
    for (;;) {
        if (r->board && atomic_load(&r->board->failed)) { /* a desync, posted by a peer */
            fail_locked(r, r->board->msg);
            fail_pending_locked(r);
            return;
        }
        cudaError_t q = cudaEventQuery(p->ev);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) {
            cudaGetLastError();
            snprintf(msg, sizeof msg, "%s on rank %d (cuda:%d): %s", tdm_coll_name(p->w->c.kind),
                     r->g.rank, r->dev, cudaGetErrorString(q));
            fail_locked(r, msg);
            fail_pending_locked(r);
            return;
        }
        ncclResult_t ae = ncclSuccess;
        if (ncclCommGetAsyncError(r->comm, &ae) == ncclSuccess && ae != ncclSuccess &&
            ae != ncclInProgress) {
            snprintf(msg, sizeof msg, "%s on rank %d (cuda:%d): NCCL: %s",
                     tdm_coll_name(p->w->c.kind), r->g.rank, r->dev, ncclGetErrorString(ae));
            fail_locked(r, msg);
            fail_pending_locked(r);
            return;
        }
        if (tdm_now_ns() > deadline) {
            snprintf(msg, sizeof msg,
                     "%s on rank %d (cuda:%d): timed out after %.0f s waiting "
                     "for the other ranks",
                     tdm_coll_name(p->w->c.kind), r->g.rank, r->dev, tdm_group_timeout(&r->g));
            fail_locked(r, msg);
            fail_pending_locked(r);
            return;
        }
        struct timespec nap = {0, 20000}; /* 20 us: far below a collective's usual cost */
        nanosleep(&nap, NULL);
    }
    tdm_work_finish(p->w, TDM_OK, NULL);
    r->head = (r->head + 1) % RING;
    r->count--;
}

static void nccl_progress(tdm_group *g, tdm_work *w) {
    nrank *r = (nrank *)g;
    pthread_mutex_lock(&r->lock);
    while (r->count > 0 && !atomic_load_explicit(&w->done, memory_order_acquire))
        wait_oldest_locked(r);
    pthread_mutex_unlock(&r->lock);
}

static ncclRedOp_t red_op(tdm_reduce_kind k) {
    return k == TDM_AVG ? ncclAvg : ncclSum;
}

/* NCCL's type of a reduction in dtype dt. NCCL sums bf16 and f16 in f32 within each step of its
 * own algorithm and rounds between steps, so its low-precision sums can differ from the CPU
 * groups' (one rounding at the end) by a rounding per step; every rank still gets the same bits. */
static ncclDataType_t nccl_type(tdm_dtype dt) {
    return dt == TDM_BF16 ? ncclBfloat16 : dt == TDM_F16 ? ncclFloat16 : ncclFloat;
}

/* Queues one collective on the communication stream. */
static ncclResult_t enqueue(nrank *r, const tdm_coll *c) {
    size_t bytes = (size_t)c->count * c->elem;
    switch (c->kind) {
    case TDM_COLL_ALL_REDUCE:
        return ncclAllReduce(c->out, c->out, (size_t)c->count, nccl_type(c->dtype), red_op(c->op),
                             r->comm, r->stream);
    case TDM_COLL_REDUCE:
        return ncclReduce(c->out, c->out, (size_t)c->count, nccl_type(c->dtype), red_op(c->op),
                          c->root, r->comm, r->stream);
    case TDM_COLL_BROADCAST: /* any dtype: move bytes */
        return ncclBroadcast(c->out, c->out, bytes, ncclInt8, c->root, r->comm, r->stream);
    case TDM_COLL_ALL_GATHER:
        return ncclAllGather(c->in, c->out, bytes, ncclInt8, r->comm, r->stream);
    case TDM_COLL_REDUCE_SCATTER:
        return ncclReduceScatter(c->in, c->out, (size_t)c->count, nccl_type(c->dtype),
                                 red_op(c->op), r->comm, r->stream);
    case TDM_COLL_BARRIER:
        return ncclAllReduce(r->barrier_buf, r->barrier_buf, 1, ncclFloat, ncclSum, r->comm,
                             r->stream);
    }
    return ncclInvalidArgument;
}

static int nccl_launch(tdm_group *g, tdm_work *w) {
    nrank *r = (nrank *)g;
    const tdm_coll *c = &w->c;
    if (c->kind != TDM_COLL_BARRIER && c->count > 0 && !c->out)
        return tdm_raise(TDM_ERR_DEVICE,
                         "nccl %s: no device address for the tensor (group.c "
                         "must pass CUDA tensors' device pointers)",
                         tdm_coll_name(c->kind));
    pthread_mutex_lock(&r->lock);
    if (r->failed) {
        tdm_work_finish(w, TDM_ERR_COMM, r->fail_msg);
        pthread_mutex_unlock(&r->lock);
        return TDM_OK;
    }
    if (r->count == RING) wait_oldest_locked(r); /* bounded in flight */
    if (r->board && !r->failed && board_check(r, c)) {
        fail_locked(r, r->board->msg);
        fail_pending_locked(r);
    }
    int rc = TDM_OK;
    /* the collective reads what the compute stream wrote: order it after, with an event */
    if (!r->failed && tdm_cuda_order_streams(r->dev, true) != TDM_OK) rc = tdm_last_status();
    ncclResult_t nr = ncclSuccess;
    if (!rc && !r->failed && (nr = enqueue(r, c)) != ncclSuccess) {
        rc = tdm_raise(TDM_ERR_COMM, "nccl %s on rank %d (cuda:%d): %s", tdm_coll_name(c->kind),
                       g->rank, r->dev, ncclGetErrorString(nr));
        if (r->board && atomic_load(&r->board->failed)) { /* a peer's abort ended it */
            fail_locked(r, r->board->msg);
            fail_pending_locked(r);
            rc = TDM_OK; /* w fails with the message below */
        }
    }
    pending *p = &r->ring[(r->head + r->count) % RING];
    if (!rc && !r->failed && cudaEventRecord(p->ev, r->stream) != cudaSuccess) {
        cudaGetLastError();
        rc = tdm_raise(TDM_ERR_COMM, "nccl %s on rank %d: recording its event failed",
                       tdm_coll_name(c->kind), g->rank);
    }
    if (r->failed) { /* wait_oldest_locked found a failure */
        tdm_work_finish(w, TDM_ERR_COMM, r->fail_msg);
    } else if (!rc) {
        p->w = w;
        r->count++;
    }
    pthread_mutex_unlock(&r->lock);
    return rc;
}

static void nccl_abort(tdm_group *g, const char *message) {
    nrank *r = (nrank *)g;
    char msg[TDM_WORK_MSG - 64];
    snprintf(msg, sizeof msg, "rank %d failed: %s", g->rank, message);
    pthread_mutex_lock(&r->lock);
    fail_locked(r, msg);
    fail_pending_locked(r);
    pthread_mutex_unlock(&r->lock);
}

static const tdm_group_ops nccl_ops = {
    .name = "nccl",
    .device_memory = true,
    .launch = nccl_launch,
    .abort = nccl_abort,
    .progress = nccl_progress,
};

/* A rank without its communicator: streams, events, barrier buffer. */
static nrank *rank_new(int rank, int size, tdm_device dev) {
    if (dev.type != TDM_CUDA) {
        char b[16];
        return tdm_raise_null(TDM_ERR_DEVICE, "nccl group: rank %d is on %s, not a GPU", rank,
                              tdm_device_str(dev, b));
    }
    void *stream = tdm_cuda_stream(dev.index, true); /* makes the device current */
    if (!stream) return NULL;
    nrank *r = calloc(1, sizeof *r);
    if (!r) return tdm_raise_null(TDM_ERR_NOMEM, "nccl group: out of memory");
    r->dev = dev.index;
    r->stream = (cudaStream_t)stream;
    pthread_mutex_init(&r->lock, NULL);
    int made = 0;
    for (; made < RING; made++)
        if (cudaEventCreateWithFlags(&r->ring[made].ev, cudaEventDisableTiming) != cudaSuccess)
            break;
    if (made < RING || cudaMalloc((void **)&r->barrier_buf, sizeof(float)) != cudaSuccess) {
        cudaGetLastError();
        for (int i = 0; i < made; i++) cudaEventDestroy(r->ring[i].ev);
        pthread_mutex_destroy(&r->lock);
        free(r);
        return tdm_raise_null(TDM_ERR_DEVICE, "nccl group: cannot create events on cuda:%d",
                              dev.index);
    }
    tdm_group_init(&r->g, &nccl_ops, rank, size, dev);
    return r;
}

void tdm_nccl_group_free(tdm_group *g) {
    if (!g) return;
    nrank *r = (nrank *)g;
    pthread_mutex_lock(&r->lock);
    while (r->count > 0 && !r->failed) wait_oldest_locked(r);
    pthread_mutex_unlock(&r->lock);
    if (r->comm) ncclCommDestroy(r->comm);
    if (r->parent) tdm_group_watch(r->parent, NULL);
    if (r->board) {
        pthread_mutex_lock(&r->board->lock);
        r->board->ranks[r->g.rank] = NULL; /* no peer reads this rank's recorder any more */
        pthread_mutex_unlock(&r->board->lock);
        if (atomic_fetch_sub(&r->board->refs, 1) == 1) {
            pthread_mutex_destroy(&r->board->lock);
            free(r->board);
        }
    }
    for (int i = 0; i < RING; i++) cudaEventDestroy(r->ring[i].ev);
    cudaFree(r->barrier_buf);
    tdm_group_destroy(&r->g);
    pthread_mutex_destroy(&r->lock);
    free(r);
}

tdm_group *tdm_nccl_group_new(tdm_group *parent, tdm_device dev) {
    if (!parent) return tdm_raise_null(TDM_ERR_ARG, "nccl group: NULL parent group");
    int rank = tdm_group_rank(parent), size = tdm_group_size(parent);
    /* rank 0 draws the id; the parent group (threads or MPI) broadcasts its bytes */
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (rank == 0 && ncclGetUniqueId(&id) != ncclSuccess)
        memset(&id, 0, sizeof id); /* an all-zero id makes every rank's init fail below */
    tdm_tensor *t = tdm_from_data(TDM_SHAPE(sizeof id / 4), TDM_I32, tdm_cpu(0), &id);
    if (!t) return NULL;
    int rc = tdm_work_wait(tdm_broadcast(parent, t, 0));
    if (!rc) rc = tdm_to_host(t, &id, sizeof id);
    tdm_tensor_free(t);
    if (rc) return NULL;
    nrank *r = rank_new(rank, size, dev);
    if (!r) return NULL;
    ncclResult_t nr = ncclCommInitRank(&r->comm, size, id, rank);
    if (nr != ncclSuccess) {
        r->comm = NULL;
        tdm_nccl_group_free(&r->g);
        return tdm_raise_null(TDM_ERR_COMM, "nccl group: rank %d of %d on cuda:%d: %s", rank, size,
                              dev.index, ncclGetErrorString(nr));
    }
    r->parent = parent; /* its collectives carry this group's fingerprints: the side channel */
    tdm_group_watch(parent, &r->g);
    return &r->g;
}

int tdm_nccl_world_new(int n, const tdm_device *devs, tdm_group **out) {
    if (n < 1 || !devs || !out) return tdm_raise(TDM_ERR_ARG, "nccl world: bad arguments");
    ncclComm_t *comms = calloc((size_t)n, sizeof *comms);
    int *ids = calloc((size_t)n, sizeof *ids);
    nrank **ranks = calloc((size_t)n, sizeof *ranks);
    int rc = comms && ids && ranks ? TDM_OK : tdm_raise(TDM_ERR_NOMEM, "nccl world: out of memory");
    for (int i = 0; i < n && !rc; i++) {
        if (!(ranks[i] = rank_new(i, n, devs[i])))
            rc = tdm_last_status();
        else
            ids[i] = devs[i].index;
    }
    ncclResult_t nr = ncclSuccess;
    if (!rc && (nr = ncclCommInitAll(comms, n, ids)) != ncclSuccess)
        rc = tdm_raise(TDM_ERR_COMM, "nccl world of %d GPUs: %s", n, ncclGetErrorString(nr));
    nboard *b = rc ? NULL : calloc(1, sizeof *b + sizeof(nrank *) * (size_t)n);
    if (!rc && !b) rc = tdm_raise(TDM_ERR_NOMEM, "nccl world: out of memory");
    if (b) {
        pthread_mutex_init(&b->lock, NULL);
        atomic_init(&b->refs, n);
        b->n = n;
    }
    for (int i = 0; i < n; i++) {
        if (!rc) {
            ranks[i]->comm = comms[i];
            ranks[i]->board = b;
            b->ranks[i] = ranks[i];
            out[i] = &ranks[i]->g;
        } else if (ranks && ranks[i]) {
            if (comms && comms[i]) ncclCommDestroy(comms[i]);
            tdm_nccl_group_free(&ranks[i]->g);
        }
    }
    free(comms);
    free(ids);
    free(ranks);
    return rc;
}

#endif
