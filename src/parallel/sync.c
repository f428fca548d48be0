/* The one waiter (sync.h): a bounded spin, then a sleep on a condition variable, with an
 * optional failure flag and timeout. */
#include "parallel/sync.h"
#include "tandem/parallel.h" /* tdm_device_count */

#include <errno.h>

/* Spin rounds between two looks at the clock: a pause is ~40-140 cycles and a clock read
 * costs a few pauses (bench/RESULTS.md, "Figures behind the code"), so the budget is overrun by at
 * most a few microseconds. */
#define CLOCK_EVERY 16

void tdm_waitq_init(tdm_waitq *q) {
    pthread_mutex_init(&q->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* deadlines immune to clock changes */
    pthread_cond_init(&q->cond, &ca);
    pthread_condattr_destroy(&ca);
    atomic_init(&q->sleepers, 0);
}

void tdm_waitq_destroy(tdm_waitq *q) {
    pthread_cond_destroy(&q->cond);
    pthread_mutex_destroy(&q->mu);
}

/* The writer stored its word (seq_cst), then reads sleepers (seq_cst); a sleeper adds itself
 * to sleepers (seq_cst), then reads the word (seq_cst). In the single order of those four,
 * either the writer sees the sleeper and wakes it under the lock (which the sleeper holds
 * until it is inside pthread_cond_wait), or the sleeper sees the new word and never sleeps. */
void tdm_waitq_wake(tdm_waitq *q) {
    if (atomic_load(&q->sleepers) == 0) return;
    pthread_mutex_lock(&q->mu);
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->mu);
}

/* -1: not yet; else the result. `order` is acquire while spinning, seq_cst while sleeping
 * (see tdm_waitq_wake). */
static int look(const tdm_wait_word *word, uint64_t target, const tdm_wait_word *stop,
                memory_order order) {
    if (atomic_load_explicit(word, order) >= target) return TDM_WAIT_READY;
    if (stop && atomic_load_explicit(stop, order) != 0) return TDM_WAIT_STOPPED;
    return -1;
}

/* Spins until the word or stop moves, or the clock passes `until`. */
static int spin(const tdm_wait_word *word, uint64_t target, const tdm_wait_word *stop,
                int64_t until) {
    for (int i = 1;; i++) {
        int r = look(word, target, stop, memory_order_acquire);
        if (r >= 0) return r;
        tdm_cpu_relax();
        if (i % CLOCK_EVERY == 0 && tdm_now_ns() >= until) return -1;
    }
}

static struct timespec timespec_of(int64_t ns) {
    return (struct timespec){(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
}

/* Sleeps on q until the word or stop moves, or CLOCK_MONOTONIC passes deadline (0: never). */
static int sleep_on(tdm_waitq *q, const tdm_wait_word *word, uint64_t target,
                    const tdm_wait_word *stop, int64_t deadline) {
    struct timespec until = timespec_of(deadline);
    pthread_mutex_lock(&q->mu);
    atomic_fetch_add(&q->sleepers, 1);
    int r;
    while ((r = look(word, target, stop, memory_order_seq_cst)) < 0) {
        if (!deadline) {
            pthread_cond_wait(&q->cond, &q->mu);
        } else if (pthread_cond_timedwait(&q->cond, &q->mu, &until) == ETIMEDOUT) {
            r = look(word, target, stop, memory_order_seq_cst);
            if (r < 0) r = TDM_WAIT_TIMEOUT;
            break;
        }
    }
    atomic_fetch_sub(&q->sleepers, 1);
    pthread_mutex_unlock(&q->mu);
    return r;
}

tdm_wait_result tdm_wait_until(tdm_waitq *q, const tdm_wait_word *word, uint64_t target,
                               tdm_wait_opts o) {
    int r = look(word, target, o.stop, memory_order_acquire);
    if (r >= 0) return (tdm_wait_result)r;
    int64_t t0 = tdm_now_ns(), deadline = o.timeout_ns > 0 ? t0 + o.timeout_ns : 0;
    if (o.spin_ns > 0) {
        int64_t until = t0 + o.spin_ns;
        if (deadline && deadline < until) until = deadline;
        if ((r = spin(word, target, o.stop, until)) >= 0) return (tdm_wait_result)r;
    }
    return (tdm_wait_result)sleep_on(q, word, target, o.stop, deadline);
}

int64_t tdm_spin_budget(int threads, int64_t spin_ns) {
    return threads <= tdm_device_count(TDM_CPU) ? spin_ns : 0;
}
