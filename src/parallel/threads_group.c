/* The threads backend: every rank is a thread of this process, so collectives read and write
 * each other's tensors directly (this is the CPU collectives backend: it touches tensor
 * memory, like a kernel).
 *
 * Each rank's collectives run in launch order, one at a time, on one of two threads:
 *   - the thread that waits for it (tdm_work_wait), when nobody has started it: the common
 *     case when ranks fill the cores (DDP waits for its last bucket right after launching it),
 *     and it spares the two thread handoffs (launch -> communication thread -> waiter) that
 *     cost more than a small all-reduce itself;
 *   - the rank's communication thread, so tdm_all_reduce returns at once and the rank keeps
 *     computing. It starts at launch when cores are to spare (overlap is then free), and
 *     otherwise as soon as a peer waits for this rank at a barrier: a collective progresses
 *     as soon as any rank waits for it, whatever the others do meanwhile.
 * A collective is three steps:
 *   1. rendezvous: each rank publishes its buffers (a tdm_coll) and waits at the barrier;
 *   2. work: rank r handles chunk r of the data for every rank;
 *   3. barrier: nobody returns (and lets its caller touch the buffer) while a peer may still
 *      read or write it.
 * All-reduce is reduce-scatter + all-gather fused: rank r sums chunk r over all ranks'
 * buffers in rank order 0..N-1 and writes the sum straight into every rank's chunk r. Each
 * rank reads S and writes S bytes for an S-byte tensor (the bandwidth-optimal amount), and the
 * result is bit-identical on every rank and every run whatever the size. Broadcast and
 * all-gather split the copying the same way; reduce-scatter pulls.
 *
 * Failure: the world has one failure record (first writer wins). A rank's abort or a barrier
 * that times out sets it and wakes every sleeper; from then on every collective of every
 * rank fails at once with that message. */
#include "parallel/group.h"
#include "parallel/sync.h"
#include "tandem/trace.h"

#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Nanoseconds a rank spins at a barrier before it sleeps, when ranks do not outnumber cores.
 * Bounded, with no sched_yield: unbounded spinning threads that shared a core with a pinned
 * device thread stalled DataParallel steps for whole scheduler ticks on the 2-core VM.
 * The budget covers the usual skew between ranks, which is shorter than a sleeping rank's
 * wake-up (both measured: bench/RESULTS.md, "Figures behind the code"). */
#define BARRIER_SPIN_NS 50000
/* floats per reduction block: the accumulator (8 KiB) stays in L1 */
#define RED_BLK 2048
/* bytes per copy block: the source block stays in L2 while it goes to every rank */
#define COPY_BLK (64 * 1024)
/* chunk boundaries are multiples of this many bytes, so ranks never write one cache line */

typedef struct trank {
    tdm_group g; /* first member: a tdm_group * is a trank * */
    tdm_threads_world *w;
    pthread_t thread;
    bool started;
    /* launch queue, FIFO, and who runs it: everything under qlock */
    pthread_mutex_t qlock;
    pthread_cond_t qcond; /* wakes the communication thread */
    tdm_work *head, *tail;
    bool busy; /* one of this rank's collectives is running (communication thread or inline) */
    bool kick; /* the communication thread should run the queue: a peer waits for this rank */
    bool stop;
    /* this rank's current collective, read by peers between its two barriers */
    tdm_coll slot;
    atomic_ulong arrivals; /* barriers reached: names the missing rank on a timeout */
    void **peer;           /* n pointers of scratch: the peers' buffers of one collective */
} trank;

struct tdm_threads_world {
    int n;
    trank *ranks;
    bool eager;      /* cores to spare: communication threads start each collective at launch */
    int64_t spin_ns; /* BARRIER_SPIN_NS, or 0 when ranks outnumber cores */
    /* generation-counted barrier: the last arriver moves gen, the others wait for it on q */
    atomic_uint arrived;
    tdm_wait_word gen;
    tdm_waitq q;
    atomic_int touching; /* ranks in a collective's data movement (run_work) */
    /* failure: fail_msg is written once, under lock, before failed is set */
    pthread_mutex_t lock;
    tdm_wait_word failed;
    char fail_msg[TDM_WORK_MSG - 64]; /* room for the "op on rank R: " prefix */
};

/* ---- failure and the barrier ---------------------------------------------------------------- */

/* Records the failure (the first one wins) and wakes every sleeping rank. Caller holds lock. */
static void fail_locked(tdm_threads_world *w, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void fail_locked(tdm_threads_world *w, const char *fmt, ...) {
    if (!atomic_load_explicit(&w->failed, memory_order_relaxed)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(w->fail_msg, sizeof w->fail_msg, fmt, ap);
        va_end(ap);
        atomic_store(&w->failed, 1);
    }
    tdm_waitq_wake(&w->q);
}

/* seq_cst, as run_work's count of the ranks at work: see there */
static bool has_failed(tdm_threads_world *w) {
    return atomic_load(&w->failed) != 0;
}

static void threads_abort(tdm_group *g, const char *message) {
    tdm_threads_world *w = ((trank *)g)->w;
    pthread_mutex_lock(&w->lock);
    fail_locked(w, "rank %d failed: %s", g->rank, message);
    pthread_mutex_unlock(&w->lock);
    /* as a failing collective does (run_work): a caller that gives up without waiting for
     * its collectives may free their tensors once this returns */
    while (atomic_load(&w->touching) > 0) sched_yield();
}

/* Once my wait at the barrier of generation gen ran out: fails the world naming the first
 * rank that has not reached it (unless it completed meanwhile). */
static void fail_timeout(trank *me, unsigned long my_count, uint64_t gen) {
    tdm_threads_world *w = me->w;
    pthread_mutex_lock(&w->lock);
    if (atomic_load(&w->gen) != gen) {
        pthread_mutex_unlock(&w->lock);
        return;
    }
    int missing = -1;
    for (int k = 0; k < w->n && missing < 0; k++)
        if (atomic_load(&w->ranks[k].arrivals) < my_count) missing = k;
    double s = tdm_group_timeout(&me->g);
    char secs[32];
    snprintf(secs, sizeof secs, s >= 0.1 ? "%.1f" : "%.3g", s);
    if (missing >= 0)
        fail_locked(w, "timed out after %s s waiting for rank %d", secs, missing);
    else
        fail_locked(w, "timed out after %s s at a barrier", secs);
    pthread_mutex_unlock(&w->lock);
}

/* Launches are lazy when cores are scarce: a rank that has not reached the barrier I wait at
 * but holds queued collectives that nobody runs gets its communication thread started. */
static void kick_absent(trank *me, unsigned long my_count) {
    tdm_threads_world *w = me->w;
    for (int k = 0; k < w->n; k++) {
        trank *t = &w->ranks[k];
        if (t == me || atomic_load(&t->arrivals) >= my_count) continue;
        pthread_mutex_lock(&t->qlock);
        if (t->head && !t->kick) {
            t->kick = true;
            if (!t->busy) pthread_cond_signal(&t->qcond);
        }
        pthread_mutex_unlock(&t->qlock);
    }
}

/* Waits until every rank has arrived. 0, or -1 once the world has failed. */
static int world_barrier(trank *me) {
    tdm_threads_world *w = me->w;
    unsigned long my_count = atomic_fetch_add(&me->arrivals, 1) + 1;
    /* gen cannot move before I arrive, so this is the generation I wait to see change */
    uint64_t gen = atomic_load_explicit(&w->gen, memory_order_acquire);
    if (has_failed(w)) return -1;
    /* seq_cst: a launch that misses this arrival is seen by kick_absent (both hold qlock) */
    if (atomic_fetch_add(&w->arrived, 1) == (unsigned)w->n - 1) {
        atomic_store_explicit(&w->arrived, 0, memory_order_relaxed);
        atomic_store(&w->gen, gen + 1);
        tdm_waitq_wake(&w->q);
        return 0;
    }
    kick_absent(me, my_count);
    tdm_wait_opts o = {.spin_ns = w->spin_ns,
                       .timeout_ns = atomic_load_explicit(&me->g.timeout_ns, memory_order_relaxed),
                       .stop = &w->failed};
    tdm_wait_result r = tdm_wait_until(&w->q, &w->gen, gen + 1, o);
    if (r == TDM_WAIT_TIMEOUT) fail_timeout(me, my_count, gen);
    return atomic_load_explicit(&w->gen, memory_order_acquire) != gen ? 0 : -1;
}

/* ---- the data movement ---------------------------------------------------------------------- */

/* Sums chunk r over every rank's buffer and writes it into every rank's buffer (all-reduce),
 * or into the root's only (reduce). bf16 and f16 are summed in f32 (tdm_reduce_block). */
static int run_all_reduce(trank *me, bool to_root) {
    tdm_threads_world *w = me->w;
    int n = w->n, root = me->slot.root;
    size_t elem = me->slot.elem;
    char **bufs = (char **)me->peer;
    for (int k = 0; k < n; k++) bufs[k] = w->ranks[k].slot.out;
    int64_t lo, hi;
    tdm_chunk_of(me->slot.count, elem, n, me->g.rank, &lo, &hi);
    float acc[RED_BLK]; /* RED_BLK elements of the dtype, at most 4 bytes each */
    bool avg = me->slot.op == TDM_AVG;
    for (int64_t off = lo; off < hi; off += RED_BLK) {
        if (has_failed(w)) return -1; /* stop touching peers' memory at once */
        int len = (int)(hi - off < RED_BLK ? hi - off : RED_BLK);
        tdm_reduce_block(acc, (const void *const *)bufs, n, off, len, avg, me->slot.dtype);
        for (int k = to_root ? root : 0; k < (to_root ? root + 1 : n); k++)
            memcpy(bufs[k] + off * (int64_t)elem, acc, (size_t)len * elem);
    }
    return 0;
}

/* out of rank r [count] = sum over ranks k of chunk r of in_k [n * count]. */
static int run_reduce_scatter(trank *me) {
    tdm_threads_world *w = me->w;
    int n = w->n, r = me->g.rank;
    int64_t count = me->slot.count;
    size_t elem = me->slot.elem;
    const char **ins = (const char **)me->peer;
    for (int k = 0; k < n; k++)
        ins[k] = (const char *)w->ranks[k].slot.in + (int64_t)r * count * (int64_t)elem;
    char *out = me->slot.out;
    float acc[RED_BLK];
    bool avg = me->slot.op == TDM_AVG;
    for (int64_t off = 0; off < count; off += RED_BLK) {
        if (has_failed(w)) return -1;
        int len = (int)(count - off < RED_BLK ? count - off : RED_BLK);
        tdm_reduce_block(acc, (const void *const *)ins, n, off, len, avg, me->slot.dtype);
        memcpy(out + off * (int64_t)elem, acc, (size_t)len * elem);
    }
    return 0;
}

/* Copies [lo, hi) bytes of src to every rank's destination (dst[k] + lo), skipping the
 * ones that are src itself, one L2-sized block at a time. */
static int copy_to_all(tdm_threads_world *w, char *const *dst, const char *src, int64_t lo,
                       int64_t hi) {
    for (int64_t off = lo; off < hi; off += COPY_BLK) {
        if (has_failed(w)) return -1;
        size_t len = (size_t)(hi - off < COPY_BLK ? hi - off : COPY_BLK);
        for (int k = 0; k < w->n; k++)
            if (dst[k] && dst[k] + off != src + off) memcpy(dst[k] + off, src + off, len);
    }
    return 0;
}

/* Rank r copies byte chunk r of root's tensor into every other rank's. */
static int run_broadcast(trank *me) {
    tdm_threads_world *w = me->w;
    int n = w->n, root = me->slot.root;
    char **dst = (char **)me->peer;
    for (int k = 0; k < n; k++) dst[k] = k == root ? NULL : (char *)w->ranks[k].slot.out;
    int64_t lo, hi;
    tdm_chunk_of(me->slot.count * (int64_t)me->slot.elem, 1, n, me->g.rank, &lo, &hi);
    return copy_to_all(w, dst, (const char *)w->ranks[root].slot.out, lo, hi);
}

/* Rank r copies its in into slot r of every rank's out. */
static int run_all_gather(trank *me) {
    tdm_threads_world *w = me->w;
    int n = w->n;
    int64_t bytes = me->slot.count * (int64_t)me->slot.elem;
    char **dst = (char **)me->peer;
    for (int k = 0; k < n; k++) dst[k] = (char *)w->ranks[k].slot.out + me->g.rank * bytes;
    return copy_to_all(w, dst, (const char *)me->slot.in, 0, bytes);
}

/* Every rank must call the same collective as rank 0 (tdm_coll_disagree; the numbers agree
 * by construction). */
static int check_slots(trank *me) {
    tdm_threads_world *w = me->w;
    char msg[TDM_WORK_MSG - 64];
    for (int k = 1; k < w->n; k++) {
        if (!tdm_coll_disagree(0, &w->ranks[0].slot, k, &w->ranks[k].slot, false, msg, sizeof msg))
            continue;
        pthread_mutex_lock(&w->lock);
        fail_locked(w, "%s", msg);
        pthread_mutex_unlock(&w->lock);
        return -1;
    }
    return 0;
}

/* The data movement of c, between the two barriers: rank me reads and writes its peers'
 * tensors. A failure (a peer's abort, a timeout) lets each rank stop at its next block and
 * return, and its caller may then free its tensor while a peer is still inside a block that
 * writes into it. So the ranks at work are counted, and a rank that fails returns only once
 * none is left: each block is short and checks the failure first. The count and the failure
 * are both seq_cst: a rank that sees no failure after counting itself in is seen by the one
 * that fails, which then waits for it. */
static int run_work(trank *me, const tdm_coll *c) {
    tdm_threads_world *w = me->w;
    int rc = -1;
    atomic_fetch_add(&w->touching, 1);
    switch (c->kind) {
    case TDM_COLL_ALL_REDUCE:
    case TDM_COLL_REDUCE:
        rc = run_all_reduce(me, c->kind == TDM_COLL_REDUCE);
        break;
    case TDM_COLL_BROADCAST:
        rc = run_broadcast(me);
        break;
    case TDM_COLL_ALL_GATHER:
        rc = run_all_gather(me);
        break;
    case TDM_COLL_REDUCE_SCATTER:
        rc = run_reduce_scatter(me);
        break;
    case TDM_COLL_BARRIER:
        rc = 0;
        break;
    }
    atomic_fetch_sub(&w->touching, 1);
    return rc;
}

/* Runs one collective on rank me. TDM_OK, or TDM_ERR_COMM with msg. */
static int run(trank *me, const tdm_coll *c, char *msg) {
    tdm_threads_world *w = me->w;
    int rc = -1;
    bool in_place = c->kind == TDM_COLL_ALL_REDUCE || c->kind == TDM_COLL_BROADCAST ||
                    c->kind == TDM_COLL_REDUCE;
    if (w->n == 1 && (in_place || c->kind == TDM_COLL_BARRIER)) {
        rc = has_failed(w) ? -1 : 0; /* one rank: x / 1 is x, so there is nothing to do */
    } else if (!has_failed(w)) {
        me->slot = *c;
        rc = world_barrier(me);
        if (!rc && c->kind != TDM_COLL_BARRIER) {
            rc = check_slots(me);
            if (!rc) rc = run_work(me, c);
            if (!rc) rc = world_barrier(me);
        }
    }
    if (!rc) return TDM_OK;
    while (atomic_load(&w->touching) > 0) sched_yield(); /* see run_work */
    snprintf(msg, TDM_WORK_MSG, "%s on rank %d: %s", tdm_coll_name(c->kind), me->g.rank,
             w->fail_msg);
    return TDM_ERR_COMM;
}

/* ---- who runs a rank's queue: its communication thread, or the thread that waits ---------- */

static void run_one(trank *me, tdm_work *wk) {
    char msg[TDM_WORK_MSG];
    msg[0] = '\0';
    tdm_trace_begin(tdm_coll_name(wk->c.kind));
    int status = run(me, &wk->c, msg);
    tdm_trace_end();
    tdm_work_finish(wk, status, msg);
}

/* Takes the head of the queue to run it (caller holds qlock, the queue is not empty and
 * nobody else runs one of this rank's collectives). */
static tdm_work *take_locked(trank *me) {
    tdm_work *wk = me->head;
    me->head = wk->next;
    if (!me->head) me->tail = NULL;
    me->busy = true;
    return wk;
}

/* After a collective: hands the rest of the queue to the communication thread if a peer
 * waits for it or the world is being freed. Caller holds qlock. */
static void release_locked(trank *me) {
    me->busy = false;
    if (!me->head)
        me->kick = false;
    else if (me->kick || me->stop)
        pthread_cond_signal(&me->qcond);
}

static void *comm_main(void *arg) {
    trank *me = arg;
    char track[48];
    snprintf(track, sizeof track, "rank %d communication", me->g.rank);
    tdm_trace_name_thread(track);
    pthread_mutex_lock(&me->qlock);
    for (;;) {
        while (!(me->head && !me->busy && (me->kick || me->stop)) && !(me->stop && !me->head))
            pthread_cond_wait(&me->qcond, &me->qlock);
        if (!me->head) break; /* stopping, and nothing is left */
        tdm_work *wk = take_locked(me);
        pthread_mutex_unlock(&me->qlock);
        run_one(me, wk);
        pthread_mutex_lock(&me->qlock);
        release_locked(me);
    }
    pthread_mutex_unlock(&me->qlock);
    return NULL;
}

static bool queued_locked(const trank *me, const tdm_work *wk) {
    for (const tdm_work *q = me->head; q; q = q->next)
        if (q == wk) return true;
    return false;
}

/* tdm_work_wait's hook: runs wk, and the collectives queued before it, on the waiting thread
 * unless the communication thread already runs one of them; then it is told to go on. */
static void threads_progress(tdm_group *g, tdm_work *wk) {
    trank *me = (trank *)g;
    pthread_mutex_lock(&me->qlock);
    while (queued_locked(me, wk)) {
        if (me->busy) {
            me->kick = true; /* whoever runs now hands the queue on when done */
            break;
        }
        tdm_work *q = take_locked(me);
        pthread_mutex_unlock(&me->qlock);
        run_one(me, q); /* wk may be finished (and then recycled) from here on */
        pthread_mutex_lock(&me->qlock);
        release_locked(me);
        if (q == wk) break;
    }
    pthread_mutex_unlock(&me->qlock);
}

static int threads_launch(tdm_group *g, tdm_work *wk) {
    trank *me = (trank *)g;
    tdm_threads_world *w = me->w;
    if (w->n == 1) { /* nothing to wait for: done before the caller sees the handle */
        run_one(me, wk);
        return TDM_OK;
    }
    pthread_mutex_lock(&me->qlock);
    if (me->tail)
        me->tail->next = wk;
    else
        me->head = wk;
    me->tail = wk;
    /* seq_cst load: see world_barrier. A peer already waiting needs this collective now. */
    if (w->eager || atomic_load(&w->arrived) > 0) {
        me->kick = true;
        if (!me->busy) pthread_cond_signal(&me->qcond);
    }
    pthread_mutex_unlock(&me->qlock);
    return TDM_OK;
}

int tdm_threads_barrier(tdm_group *g) {
    trank *me = (trank *)g;
    pthread_mutex_lock(&me->qlock);
    bool idle = !me->head && !me->busy;
    me->busy |= idle; /* the communication thread leaves the rank alone meanwhile */
    pthread_mutex_unlock(&me->qlock);
    if (!idle) return tdm_work_wait(tdm_barrier(g)); /* after what is queued, in order */
    char msg[TDM_WORK_MSG];
    tdm_trace_begin("barrier");
    int rc = run(me, &(tdm_coll){.kind = TDM_COLL_BARRIER}, msg);
    tdm_trace_end();
    pthread_mutex_lock(&me->qlock);
    release_locked(me);
    pthread_mutex_unlock(&me->qlock);
    return rc ? tdm_raise(rc, "%s", msg) : TDM_OK;
}

static const tdm_group_ops threads_ops = {
    .name = "threads",
    .launch = threads_launch,
    .abort = threads_abort,
    .progress = threads_progress,
};

/* ---- the world ------------------------------------------------------------------------------ */

tdm_threads_world *tdm_threads_world_new(int n, const tdm_device *devs) {
    if (n < 1) return tdm_raise_null(TDM_ERR_ARG, "threads group: %d ranks (need at least 1)", n);
    if (!devs) return tdm_raise_null(TDM_ERR_ARG, "threads group: NULL device list");
    tdm_threads_world *w = calloc(1, sizeof *w);
    trank *ranks = calloc((size_t)n, sizeof *ranks);
    if (!w || !ranks) {
        free(w);
        free(ranks);
        return tdm_raise_null(TDM_ERR_NOMEM, "threads group: out of memory for %d ranks", n);
    }
    w->n = n;
    w->ranks = ranks;
    int cores = tdm_device_count(TDM_CPU);
    w->eager = 2 * n <= cores;
    w->spin_ns = tdm_spin_budget(n, BARRIER_SPIN_NS);
    atomic_init(&w->arrived, 0);
    atomic_init(&w->gen, 0);
    atomic_init(&w->failed, 0);
    atomic_init(&w->touching, 0);
    pthread_mutex_init(&w->lock, NULL);
    tdm_waitq_init(&w->q);
    for (int r = 0; r < n; r++) {
        trank *t = &ranks[r];
        t->peer = calloc((size_t)n, sizeof(void *));
        tdm_group_init(&t->g, &threads_ops, r, n, devs[r]);
        t->w = w;
        pthread_mutex_init(&t->qlock, NULL);
        pthread_cond_init(&t->qcond, NULL);
        atomic_init(&t->arrivals, 0);
    }
    for (int r = 0; r < n; r++) {
        int e =
            ranks[r].peer ? pthread_create(&ranks[r].thread, NULL, comm_main, &ranks[r]) : ENOMEM;
        if (e) {
            tdm_threads_world_free(w);
            return tdm_raise_null(TDM_ERR_NOMEM,
                                  "threads group: cannot start the communication thread of "
                                  "rank %d (%s)",
                                  r, strerror(e));
        }
        ranks[r].started = true;
    }
    return w;
}

tdm_group *tdm_threads_world_group(tdm_threads_world *w, int rank) {
    if (!w || rank < 0 || rank >= w->n)
        return tdm_raise_null(TDM_ERR_ARG, "threads group: rank %d out of range", rank);
    return &w->ranks[rank].g;
}

void tdm_threads_world_free(tdm_threads_world *w) {
    if (!w) return;
    /* anything still queued or waiting at a barrier fails instead of blocking the join */
    pthread_mutex_lock(&w->lock);
    fail_locked(w, "group destroyed");
    pthread_mutex_unlock(&w->lock);
    for (int r = 0; r < w->n; r++) {
        trank *t = &w->ranks[r];
        pthread_mutex_lock(&t->qlock);
        t->stop = true;
        pthread_cond_signal(&t->qcond);
        pthread_mutex_unlock(&t->qlock);
    }
    for (int r = 0; r < w->n; r++) {
        trank *t = &w->ranks[r];
        if (t->started) pthread_join(t->thread, NULL);
        pthread_cond_destroy(&t->qcond);
        pthread_mutex_destroy(&t->qlock);
        tdm_group_destroy(&t->g);
        free(t->peer);
    }
    tdm_waitq_destroy(&w->q);
    pthread_mutex_destroy(&w->lock);
    free(w->ranks);
    free(w);
}
