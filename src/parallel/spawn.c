/* SPMD launch with threads (torch.multiprocessing.spawn's role): one thread per rank, all in
 * one threads group. A rank whose function fails aborts the group, so its peers fail at their
 * next collective instead of waiting for it forever. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT, pthread_setaffinity_np */
#include "parallel/group.h"

#include "backend/backend.h" /* the GEMM's threads */

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    pthread_mutex_t lock;
    int first_rank; /* -1 until a rank fails */
    int first_status;
    char first_msg[1024];
} spawn_state;

typedef struct {
    tdm_rank_ctx ctx;
    int (*fn)(tdm_rank_ctx *ctx, void *arg);
    void *arg;
    int cpu; /* core to pin to, -1: leave it to the scheduler */
    spawn_state *st;
} rank_arg;

static void pin_to(int cpu) {
    tdm_cpu_gemm_thread_single(); /* a device's thread: its GEMMs run on its own core */
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    /* a container may forbid it: then the scheduler places the rank, which still works */
    (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *rank_main(void *p) {
    rank_arg *a = p;
    pin_to(a->cpu);
    int rc = a->fn(&a->ctx, a->arg);
    if (rc != 0) {
        char msg[900];
        if (tdm_last_error()[0])
            snprintf(msg, sizeof msg, "%s", tdm_last_error());
        else
            snprintf(msg, sizeof msg, "returned status %d", rc);
        /* recorded before the abort: the peers' errors it causes come later */
        spawn_state *st = a->st;
        pthread_mutex_lock(&st->lock);
        if (st->first_rank < 0) {
            st->first_rank = a->ctx.rank;
            st->first_status = rc;
            snprintf(st->first_msg, sizeof st->first_msg, "rank %d: %s", a->ctx.rank, msg);
        }
        pthread_mutex_unlock(&st->lock);
        tdm_group_abort(a->ctx.group, msg);
    }
    tdm_thread_release(); /* the thread-local arena would leak with the thread */
    return NULL;
}

/* The n-th core this process may run on, for rank r; -1 when ranks outnumber cores. */
static int core_for_rank(int r, int n) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return -1;
    int cores = CPU_COUNT(&set);
    if (cores < 1 || n > cores) return -1;
    for (int c = 0, seen = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set) && seen++ == r % cores) return c;
    return -1;
}

void tdm_pin_rank_thread(int rank, int n) {
    pin_to(core_for_rank(rank, n));
}

_Static_assert(sizeof(cpu_set_t) <= sizeof(((tdm_saved_affinity *)0)->mask),
               "tdm_saved_affinity too small for a cpu_set_t");

void tdm_pin_caller_thread(int rank, int n, tdm_saved_affinity *saved) {
    saved->saved = false;
    int cpu = core_for_rank(rank, n);
    cpu_set_t prev;
    if (cpu < 0 || pthread_getaffinity_np(pthread_self(), sizeof prev, &prev) != 0) return;
    memcpy(saved->mask, &prev, sizeof prev);
    saved->saved = true;
    pin_to(cpu);
}

void tdm_restore_thread_affinity(const tdm_saved_affinity *saved) {
    cpu_set_t prev;
    if (!saved->saved) return;
    memcpy(&prev, saved->mask, sizeof prev);
    (void)pthread_setaffinity_np(pthread_self(), sizeof prev, &prev);
}

int tdm_gemm_threads_for_devices(int n) {
    int prev = tdm_cpu_gemm_threads();
    /* devices that fill the cores each make their own GEMM calls: library threads would only
     * fight them for the same cores */
    if (n >= tdm_device_count(TDM_CPU)) tdm_cpu_gemm_set_threads(1);
    return prev;
}

int tdm_spawn(int n, const tdm_device *devices, int (*fn)(tdm_rank_ctx *ctx, void *arg),
              void *arg) {
    if (n < 1) return tdm_raise(TDM_ERR_ARG, "spawn: %d ranks (need at least 1)", n);
    if (!devices || !fn) return tdm_raise(TDM_ERR_ARG, "spawn: NULL devices or function");
    tdm_threads_world *w = tdm_threads_world_new(n, devices);
    rank_arg *args = calloc((size_t)n, sizeof *args);
    pthread_t *threads = calloc((size_t)n, sizeof *threads);
    if (!w || !args || !threads) {
        tdm_threads_world_free(w);
        free(args);
        free(threads);
        return tdm_last_status() ? tdm_last_status()
                                 : tdm_raise(TDM_ERR_NOMEM, "spawn: out of memory for %d ranks", n);
    }
    spawn_state st = {.first_rank = -1};
    pthread_mutex_init(&st.lock, NULL);
    int gemm_threads = tdm_gemm_threads_for_devices(n);
    int started = 0, err = 0;
    for (int r = 0; r < n; r++) {
        args[r] = (rank_arg){
            {r, n, devices[r], tdm_threads_world_group(w, r)}, fn, arg, core_for_rank(r, n), &st};
        err = pthread_create(&threads[r], NULL, rank_main, &args[r]);
        if (err) break;
        started++;
    }
    if (err) {
        /* the ranks already running fail at their next collective instead of hanging */
        tdm_group_abort(tdm_threads_world_group(w, started), "its thread could not start");
    }
    for (int r = 0; r < started; r++) pthread_join(threads[r], NULL);
    tdm_cpu_gemm_set_threads(gemm_threads);
    tdm_threads_world_free(w);
    free(args);
    free(threads);
    pthread_mutex_destroy(&st.lock);
    if (err)
        return tdm_raise(TDM_ERR_NOMEM, "spawn: cannot start the thread of rank %d (%s)", started,
                         strerror(err));
    if (st.first_rank >= 0) return tdm_raise((tdm_status)st.first_status, "%s", st.first_msg);
    return TDM_OK;
}
