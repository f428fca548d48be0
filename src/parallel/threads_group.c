/* The threads backend: every rank is a thread of this process, so collectives read and write
 * each other's tensors directly (this is the CPU collectives backend: it touches tensor
 * memory, like a kernel).
 *
 * Each rank has a communication thread that runs its collectives in launch order, so
 * tdm_all_reduce returns at once and the rank keeps computing. A collective is three steps:
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

#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Spin rounds (~65 cycles each) before a barrier or an idle worker sleeps. 0: spinning
 * threads that share a core with a pinned device thread stalled DataParallel steps for whole
 * 4 ms scheduler ticks on the 2-core VM (median step 4 ms vs 70 us without), while a condvar
 * round trip costs ~6 us there. */
#define SPINS 0
/* floats per reduction block: the accumulator (8 KiB) stays in L1 */
#define RED_BLK 2048
/* bytes per copy block: the source block stays in L2 while it goes to every rank */
#define COPY_BLK (64 * 1024)
/* chunk boundaries are multiples of this many bytes, so ranks never write one cache line */
#define CHUNK_ALIGN 64

typedef struct trank {
    tdm_group g; /* first member: a tdm_group * is a trank * */
    tdm_threads_world *w;
    pthread_t thread;
    bool started;
    /* launch queue, FIFO */
    pthread_mutex_t qlock;
    pthread_cond_t qcond;
    tdm_work *head, *tail;
    atomic_int queued; /* queue length, for the spinning worker */
    bool stop;
    /* this rank's current collective, read by peers between its two barriers */
    tdm_coll slot;
    atomic_ulong arrivals; /* barriers reached: names the missing rank on a timeout */
    void **peer;           /* n pointers of scratch: the peers' buffers of one collective */
} trank;

struct tdm_threads_world {
    int n;
    trank *ranks;
    /* generation-counted barrier */
    atomic_uint arrived;
    atomic_ulong gen;
    pthread_mutex_t lock; /* sleepers of the barrier, and the failure record */
    pthread_cond_t cond;
    /* failure: fail_msg is written once, before failed is set (release) */
    atomic_int failed;
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
        atomic_store_explicit(&w->failed, 1, memory_order_release);
    }
    pthread_cond_broadcast(&w->cond);
}

static bool has_failed(tdm_threads_world *w) {
    return atomic_load_explicit(&w->failed, memory_order_acquire) != 0;
}

static void threads_abort(tdm_group *g, const char *message) {
    tdm_threads_world *w = ((trank *)g)->w;
    pthread_mutex_lock(&w->lock);
    fail_locked(w, "rank %d failed: %s", g->rank, message);
    pthread_mutex_unlock(&w->lock);
}

static void spin_round(int i) {
    if (i % 64 == 63)
        sched_yield(); /* ranks may outnumber cores */
    else
        tdm_cpu_relax();
}

static struct timespec deadline_after(double seconds) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    double s = (double)t.tv_sec + t.tv_nsec * 1e-9 + seconds;
    t.tv_sec = (time_t)s;
    t.tv_nsec = (long)((s - (double)t.tv_sec) * 1e9);
    if (t.tv_nsec >= 1000000000L) t.tv_nsec = 999999999L;
    return t;
}

/* Called with lock held once my wait ran out: names the first rank that has not reached the
 * barrier I am waiting at. */
static void fail_timeout_locked(trank *me, unsigned long my_count) {
    tdm_threads_world *w = me->w;
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
}

/* Waits until every rank has arrived. 0, or -1 once the world has failed. */
static int world_barrier(trank *me) {
    tdm_threads_world *w = me->w;
    unsigned long my_count = atomic_fetch_add(&me->arrivals, 1) + 1;
    /* gen cannot move before I arrive, so this is the generation I wait to see change */
    unsigned long gen = atomic_load_explicit(&w->gen, memory_order_acquire);
    if (has_failed(w)) return -1;
    if (atomic_fetch_add_explicit(&w->arrived, 1, memory_order_acq_rel) == (unsigned)w->n - 1) {
        atomic_store_explicit(&w->arrived, 0, memory_order_relaxed);
        pthread_mutex_lock(&w->lock);
        atomic_store_explicit(&w->gen, gen + 1, memory_order_release);
        pthread_cond_broadcast(&w->cond);
        pthread_mutex_unlock(&w->lock);
        return 0;
    }
    for (int i = 0; i < SPINS; i++) {
        if (atomic_load_explicit(&w->gen, memory_order_acquire) != gen) return 0;
        if (has_failed(w)) return -1;
        spin_round(i);
    }
    struct timespec until = deadline_after(tdm_group_timeout(&me->g));
    pthread_mutex_lock(&w->lock);
    while (atomic_load_explicit(&w->gen, memory_order_acquire) == gen && !has_failed(w)) {
        if (pthread_cond_timedwait(&w->cond, &w->lock, &until) == ETIMEDOUT &&
            atomic_load_explicit(&w->gen, memory_order_acquire) == gen)
            fail_timeout_locked(me, my_count);
    }
    int rc = atomic_load_explicit(&w->gen, memory_order_acquire) != gen ? 0 : -1;
    pthread_mutex_unlock(&w->lock);
    return rc;
}

/* ---- the data movement ---------------------------------------------------------------------- */

/* [lo, hi) of chunk r when count elements of elem bytes are split over n ranks. */
static void chunk_of(int64_t count, size_t elem, int n, int r, int64_t *lo, int64_t *hi) {
    int64_t align = CHUNK_ALIGN / (int64_t)elem > 0 ? CHUNK_ALIGN / (int64_t)elem : 1;
    int64_t per = (count + n - 1) / n;
    per = (per + align - 1) / align * align;
    *lo = (int64_t)r * per < count ? (int64_t)r * per : count;
    *hi = *lo + per < count ? *lo + per : count;
}

/* acc[0..len) = src[0][off..] + src[1][off..] + ... + src[n-1][off..], added in rank order
 * (then divided by n for AVG), so every caller gets the same bits for the same inputs. */
static void reduce_block(float *restrict acc, float *const *src, int n, int64_t off, int len,
                         bool avg) {
    const float *s0 = src[0] + off;
    if (n == 1) {
        for (int j = 0; j < len; j++) acc[j] = s0[j];
    } else {
        const float *s1 = src[1] + off;
        for (int j = 0; j < len; j++) acc[j] = s0[j] + s1[j];
    }
    for (int k = 2; k < n; k++) {
        const float *sk = src[k] + off;
        for (int j = 0; j < len; j++) acc[j] += sk[j];
    }
    if (avg) {
        float fn = (float)n;
        for (int j = 0; j < len; j++) acc[j] /= fn;
    }
}

/* Sums chunk r over every rank's buffer and writes it into every rank's buffer. */
static int run_all_reduce(trank *me) {
    tdm_threads_world *w = me->w;
    int n = w->n;
    float **bufs = (float **)me->peer;
    for (int k = 0; k < n; k++) bufs[k] = (float *)w->ranks[k].slot.out;
    int64_t lo, hi;
    chunk_of(me->slot.count, 4, n, me->g.rank, &lo, &hi);
    float acc[RED_BLK];
    bool avg = me->slot.op == TDM_AVG;
    for (int64_t off = lo; off < hi; off += RED_BLK) {
        if (has_failed(w)) return -1; /* stop touching peers' memory at once */
        int len = (int)(hi - off < RED_BLK ? hi - off : RED_BLK);
        reduce_block(acc, bufs, n, off, len, avg);
        for (int k = 0; k < n; k++) memcpy(bufs[k] + off, acc, (size_t)len * 4);
    }
    return 0;
}

/* out of rank r [count] = sum over ranks k of chunk r of in_k [n * count]. */
static int run_reduce_scatter(trank *me) {
    tdm_threads_world *w = me->w;
    int n = w->n, r = me->g.rank;
    int64_t count = me->slot.count;
    float **ins = (float **)me->peer;
    for (int k = 0; k < n; k++) ins[k] = (float *)w->ranks[k].slot.in + (int64_t)r * count;
    float *out = (float *)me->slot.out;
    float acc[RED_BLK];
    bool avg = me->slot.op == TDM_AVG;
    for (int64_t off = 0; off < count; off += RED_BLK) {
        if (has_failed(w)) return -1;
        int len = (int)(count - off < RED_BLK ? count - off : RED_BLK);
        reduce_block(acc, ins, n, off, len, avg);
        memcpy(out + off, acc, (size_t)len * 4);
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
    chunk_of(me->slot.count * (int64_t)me->slot.elem, 1, n, me->g.rank, &lo, &hi);
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

/* Every rank must call the same collective with the same sizes: compares with rank 0's. */
static int check_slots(trank *me) {
    tdm_threads_world *w = me->w;
    const tdm_coll *c0 = &w->ranks[0].slot;
    for (int k = 1; k < w->n; k++) {
        const tdm_coll *ck = &w->ranks[k].slot;
        const char *what = NULL;
        if (ck->kind != c0->kind)
            what = "collective";
        else if (ck->count != c0->count)
            what = "element count";
        else if (ck->elem != c0->elem)
            what = "dtype size";
        else if (ck->op != c0->op)
            what = "reduction";
        else if (ck->root != c0->root)
            what = "root";
        if (!what) continue;
        pthread_mutex_lock(&w->lock);
        fail_locked(w,
                    "ranks disagree on the %s: rank 0 called %s (%lld elements, root %d, op %d), "
                    "rank %d called %s (%lld elements, root %d, op %d)",
                    what, tdm_coll_name(c0->kind), (long long)c0->count, c0->root, (int)c0->op, k,
                    tdm_coll_name(ck->kind), (long long)ck->count, ck->root, (int)ck->op);
        pthread_mutex_unlock(&w->lock);
        return -1;
    }
    return 0;
}

/* Runs one collective on rank me. TDM_OK, or TDM_ERR_COMM with msg. */
static int run(trank *me, const tdm_coll *c, char *msg) {
    tdm_threads_world *w = me->w;
    int rc = -1;
    if (!has_failed(w)) {
        me->slot = *c;
        rc = world_barrier(me);
        if (!rc && c->kind != TDM_COLL_BARRIER) {
            rc = check_slots(me);
            if (!rc) {
                switch (c->kind) {
                case TDM_COLL_ALL_REDUCE:
                    rc = run_all_reduce(me);
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
                    break;
                }
            }
            if (!rc) rc = world_barrier(me);
        }
    }
    if (!rc) return TDM_OK;
    snprintf(msg, TDM_WORK_MSG, "%s on rank %d: %s", tdm_coll_name(c->kind), me->g.rank,
             w->fail_msg);
    return TDM_ERR_COMM;
}

/* ---- communication threads -------------------------------------------------------------- */

/* The next queued collective, or NULL once the world is being freed and the queue is empty. */
static tdm_work *dequeue(trank *me) {
    for (int i = 0; i < SPINS && atomic_load_explicit(&me->queued, memory_order_relaxed) == 0; i++)
        spin_round(i);
    pthread_mutex_lock(&me->qlock);
    while (!me->head && !me->stop) pthread_cond_wait(&me->qcond, &me->qlock);
    tdm_work *wk = me->head;
    if (wk) {
        me->head = wk->next;
        if (!me->head) me->tail = NULL;
        atomic_fetch_sub_explicit(&me->queued, 1, memory_order_relaxed);
    }
    pthread_mutex_unlock(&me->qlock);
    return wk;
}

static void *comm_main(void *arg) {
    trank *me = arg;
    char msg[TDM_WORK_MSG];
    for (tdm_work *wk; (wk = dequeue(me));) {
        msg[0] = '\0';
        int status = run(me, &wk->c, msg);
        tdm_work_finish(wk, status, msg);
    }
    return NULL;
}

static int threads_launch(tdm_group *g, tdm_work *wk) {
    trank *me = (trank *)g;
    pthread_mutex_lock(&me->qlock);
    if (me->tail)
        me->tail->next = wk;
    else
        me->head = wk;
    me->tail = wk;
    atomic_fetch_add_explicit(&me->queued, 1, memory_order_relaxed);
    pthread_cond_signal(&me->qcond);
    pthread_mutex_unlock(&me->qlock);
    return TDM_OK;
}

static const tdm_group_ops threads_ops = {
    .name = "threads",
    .launch = threads_launch,
    .abort = threads_abort,
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
    atomic_init(&w->arrived, 0);
    atomic_init(&w->gen, 0);
    atomic_init(&w->failed, 0);
    pthread_mutex_init(&w->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* timeouts immune to clock changes */
    pthread_cond_init(&w->cond, &ca);
    pthread_condattr_destroy(&ca);
    for (int r = 0; r < n; r++) {
        trank *t = &ranks[r];
        t->peer = calloc((size_t)n, sizeof(void *));
        tdm_group_init(&t->g, &threads_ops, r, n, devs[r]);
        t->w = w;
        pthread_mutex_init(&t->qlock, NULL);
        pthread_cond_init(&t->qcond, NULL);
        atomic_init(&t->queued, 0);
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
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
    free(w->ranks);
    free(w);
}
