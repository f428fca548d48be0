/* What the process groups and the device threads share and must not have two copies of: the
 * clock their deadlines use, the split of a buffer into per-rank chunks, and the one way a
 * thread waits for another.
 *
 * The threads and MPI backends reduce chunk r on rank r in rank order, which makes their
 * results bit-identical; that holds only while both split alike, so the split lives here once.
 *
 * Waiting (tdm_wait_until): every wait between the threads of a process watches a word that
 * only grows (a generation, a count of arrivals, a ready flag) for a target value. A waiter
 * spins for a bounded time first, because on this VM a futex wake-up costs tens of
 * microseconds (bench/RESULTS.md, "Figures behind the code") while the awaited thread is usually
 * microseconds away; then it sleeps, optionally until a deadline that the caller turns into
 * an error naming who is missing. Spinning pays only while every spinning thread has a core of
 * its own (tdm_spin_budget): a spinner sharing a core with the thread it waits for steals that
 * thread's time. */
#ifndef TDM_PARALLEL_SYNC_H
#define TDM_PARALLEL_SYNC_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* Chunks start on 64-byte boundaries: no two ranks write one cache line. */
#define TDM_CHUNK_ALIGN 64

/* CLOCK_MONOTONIC in nanoseconds. */
static inline int64_t tdm_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* [lo, hi) of chunk r when count elements of elem bytes are split over n ranks. */
static inline void tdm_chunk_of(int64_t count, size_t elem, int n, int r, int64_t *lo,
                                int64_t *hi) {
    int64_t align = TDM_CHUNK_ALIGN / (int64_t)elem > 0 ? TDM_CHUNK_ALIGN / (int64_t)elem : 1;
    int64_t per = (count + n - 1) / n;
    per = (per + align - 1) / align * align;
    *lo = (int64_t)r * per < count ? (int64_t)r * per : count;
    *hi = *lo + per < count ? *lo + per : count;
}

/* Rows [lo, hi) of part i when b rows are split over n parts: the first b % n parts get one
 * more row. DataParallel splits a batch over its replicas this way and a pipeline splits it
 * over its replicas and micro-batches alike, so that both compute on the rows one device
 * would, in the same groups. */
static inline void tdm_rows_of(int64_t b, int n, int i, int64_t *lo, int64_t *hi) {
    int64_t base = b / n, extra = b % n;
    *lo = i * base + (i < extra ? i : extra);
    *hi = *lo + base + (i < extra ? 1 : 0);
}

/* ---- waiting: spin a bounded time, then sleep ------------------------------------------------ */

/* One round of a spin-wait (lets the sibling hyperthread run). */
static inline void tdm_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* A word a waiter watches: it only grows, so "reached the target" cannot be missed between two
 * looks (64 bits: a generation counter never wraps). Whoever moves it stores it (seq_cst, the
 * default of atomic_store and atomic_fetch_add) and then calls tdm_waitq_wake; everything it
 * wrote before the store is visible to the waiter that sees the new value. */
typedef _Atomic uint64_t tdm_wait_word;

/* Where waiters of one or more words sleep. `sleepers` lets a writer skip the lock and the
 * broadcast when nobody sleeps, which is the common case while waiters spin. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cond; /* on CLOCK_MONOTONIC, like tdm_now_ns */
    atomic_int sleepers;
} tdm_waitq;

typedef struct {
    int64_t spin_ns;           /* spin this long before sleeping: tdm_spin_budget, or 0 */
    int64_t timeout_ns;        /* give up this long after the wait began; 0: never */
    const tdm_wait_word *stop; /* a failure flag: non-zero ends the wait; NULL: none */
} tdm_wait_opts;

typedef enum {
    TDM_WAIT_READY,   /* the word reached the target (checked before stop: a wait that
                         completed counts even if a failure followed) */
    TDM_WAIT_STOPPED, /* *stop became non-zero first */
    TDM_WAIT_TIMEOUT, /* neither, within timeout_ns: the caller names who is late */
} tdm_wait_result;

void tdm_waitq_init(tdm_waitq *q);
void tdm_waitq_destroy(tdm_waitq *q);
/* Wakes every sleeper of q, after a watched word (or a stop flag) was stored. */
void tdm_waitq_wake(tdm_waitq *q);
/* Waits until *word >= target, *o.stop != 0 or the timeout, spinning up to o.spin_ns and then
 * sleeping on q. Returns at once, without reading the clock, when the word is there already. */
tdm_wait_result tdm_wait_until(tdm_waitq *q, const tdm_wait_word *word, uint64_t target,
                               tdm_wait_opts o);
/* spin_ns when `threads` spinning threads do not outnumber the cores, else 0. */
int64_t tdm_spin_budget(int threads, int64_t spin_ns);

#endif
