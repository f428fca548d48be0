/* Private interface of process groups: the group struct every backend embeds, the backend
 * table, work handles, and the threads world that DataParallel keeps alive across steps.
 *
 * A backend (threads_group.c, mpi_group.c, hier_group.c: threads inside MPI) embeds
 * tdm_group as the first member of its own rank struct and fills in ops. group.c checks the
 * arguments of every collective on the calling thread, fills a tdm_work with plain pointers
 * and sizes, and hands it to ops->launch; the backend runs it (on its own thread, so the
 * caller keeps computing) and completes it with tdm_work_finish, in launch order per rank.
 * Callers never see which backend they talk to. */
#ifndef TDM_PARALLEL_GROUP_H
#define TDM_PARALLEL_GROUP_H

#include "core/core.h"
#include "parallel/sync.h"
#include "tandem/parallel.h"

#include <pthread.h>
#include <stdatomic.h>

typedef enum {
    TDM_COLL_ALL_REDUCE = 0,
    TDM_COLL_BROADCAST,
    TDM_COLL_ALL_GATHER,
    TDM_COLL_REDUCE_SCATTER,
    TDM_COLL_BARRIER,
    TDM_COLL_REDUCE,
} tdm_coll_kind;

/* Name of a collective for messages ("all_reduce"). */
const char *tdm_coll_name(tdm_coll_kind k);

/* One collective as a backend sees it: raw memory, already checked on the calling rank.
 * all_reduce / broadcast / reduce: out is the tensor (in-place), in == out, count its elements.
 * all_gather: in [count] -> out [size * count]. reduce_scatter: in [size * count] -> out
 * [count]. barrier: no memory. Reductions are f32 (elem 4), bf16 or f16 (elem 2, summed in f32:
 * tdm_reduce_block); copies move count * elem bytes of any dtype. The ranks' dtypes must agree
 * (a backend checks dtype as it checks count). */
#define TDM_SITE_LEN 48 /* a collective's site label, NUL included */

typedef struct {
    tdm_coll_kind kind;
    tdm_reduce_kind op;
    int root;
    int64_t count;
    size_t elem;
    void *out;
    const void *in;
    tdm_dtype dtype;
    /* set by tdm_group_launch: the rank's count of collectives on this group so far (1 for
     * the first), and the caller's site (tdm_collective_label; "" when unnamed). Part of the
     * fingerprint the ranks compare. */
    int64_t seq;
    char site[TDM_SITE_LEN];
} tdm_coll;

/* "all_reduce #12 (DDP bucket 3: 1024 f32, sum)" for messages: c's fingerprint. */
void tdm_coll_describe(const tdm_coll *c, char *buf, size_t cap);
/* Whether rank ra's collective a and rank rb's b differ in their fingerprints (kind, size,
 * dtype, reduction, root, site, and with `numbers` their sequence numbers); if so msg holds
 * "ranks disagree on the element count: rank 0 is in all_reduce #5 (...) while rank 1 is in
 * ...", the lower rank first. */
bool tdm_coll_disagree(int ra, const tdm_coll *a, int rb, const tdm_coll *b, bool numbers,
                       char *msg, size_t cap);

/* The flight recorder: each group keeps its last TDM_FLIGHT_LEN collectives (fingerprint,
 * bytes, launch and end times, state) for tdm_group_dump_flight. */
#define TDM_FLIGHT_LEN 256

typedef enum { TDM_FLIGHT_RUNNING = 0, TDM_FLIGHT_DONE, TDM_FLIGHT_FAILED } tdm_flight_state;

typedef struct {
    tdm_coll c;             /* out and in are not kept (dangling once done) */
    double t_launch, t_end; /* seconds on CLOCK_REALTIME (comparable across hosts) */
    tdm_flight_state state;
} tdm_flight_entry;

#define TDM_WORK_MSG 512

/* Where a collective launched on a group that watches another (tdm_group_watch) found that
 * one: what it vouches for, compared between the ranks by backends that can (MPI). */
typedef struct {
    int64_t launched; /* collectives launched on the watched group so far (0: none) */
    uint64_t digest;  /* of their fingerprints, in launch order (tdm_coll_digest) */
    tdm_coll last;    /* the last of them (seq == launched; out and in NULL) */
} tdm_watch;

struct tdm_work {
    tdm_group *group;
    tdm_coll c;
    tdm_watch watch;    /* filled at launch where the group watches another */
    tdm_wait_word done; /* 1, set last by tdm_work_finish: its waiter may recycle it then */
    int status;
    char msg[TDM_WORK_MSG];
    struct tdm_work *next;     /* backend queue, or the group's free list */
    struct tdm_work *all_next; /* every handle this group allocated, freed with the group */
};

typedef struct tdm_group_ops {
    const char *name; /* "threads", "mpi", ... */
    /* Collectives take tensors in the rank's device memory (NCCL: its GPU), not CPU memory. */
    bool device_memory;
    /* Starts w (in launch order for this rank). Returns TDM_OK, or raises and returns an
     * error when the collective cannot start (w is then recycled by the caller). */
    int (*launch)(tdm_group *g, tdm_work *w);
    /* Marks this rank failed: every pending and future collective of every rank fails with
     * "rank R failed: message". */
    void (*abort)(tdm_group *g, const char *message);
    /* Optional (NULL: the waiter just sleeps): called by tdm_work_wait while w is not done.
     * The backend may run w, and the collectives launched before it, on the calling thread
     * when it has not started them, sparing two thread handoffs. */
    void (*progress)(tdm_group *g, tdm_work *w);
} tdm_group_ops;

struct tdm_group {
    const tdm_group_ops *ops;
    int rank, size;
    tdm_device device;
    _Atomic int64_t timeout_ns; /* read by the backend at each wait */
    /* handles: a free list (no malloc per collective in steady state) and their waiters */
    pthread_mutex_t lock; /* the lists, and the flight recorder */
    tdm_waitq done_q;
    tdm_work *free_works, *all_works;
    int64_t launched;                        /* collectives launched: the last one's seq */
    uint64_t digest;                         /* of their fingerprints (tdm_coll_digest) */
    tdm_group *watched;                      /* tdm_group_watch's, or NULL */
    tdm_flight_entry flight[TDM_FLIGHT_LEN]; /* seq s at s % TDM_FLIGHT_LEN */
    char failure[TDM_WORK_MSG];              /* the first failed collective's message */
};

/* Makes every collective launched on g from now on carry what `watched` (another group over
 * the same ranks, e.g. the NCCL group whose id g broadcast) has launched so far, so that a
 * backend that exchanges fingerprints (MPI) also names ranks whose collectives on `watched`
 * differ: a side channel for a group that cannot check its own (NCCL), compared at g's next
 * collective (the trainer's read-back). NULL stops it. One watched group per g. Call it from
 * the thread that launches on both, or before they are used. */
void tdm_group_watch(tdm_group *g, tdm_group *watched);
/* digest, folded with the fingerprint of c (kind, reduction, root, dtype, size, site). */
uint64_t tdm_coll_digest(uint64_t digest, const tdm_coll *c);
/* Whether two ranks' watches differ; if so msg names both ("... rank 0 had launched 12, the
 * last all_reduce #12 (...), while rank 1 had launched 12, the last ..."). `during` describes
 * the collective that carried them. */
bool tdm_watch_disagree(int ra, const tdm_watch *a, int rb, const tdm_watch *b, const char *during,
                        char *msg, size_t cap);

/* Starts collective c on g without the public entry points' checks (the caller made them):
 * how a backend built on other groups (hier_group.c) drives them. NULL and an error when it
 * cannot start. */
tdm_work *tdm_group_launch(tdm_group *g, tdm_coll c);
/* Whether w has completed (then tdm_work_wait returns at once): a poll, never a wait. */
bool tdm_work_done(const tdm_work *w);
/* Fills the generic part (timeout 60 s). The backend owns the memory. */
void tdm_group_init(tdm_group *g, const tdm_group_ops *ops, int rank, int size, tdm_device dev);
/* Frees every handle the group ever allocated (waited or not) and the sync objects. */
void tdm_group_destroy(tdm_group *g);
/* Backend side: w is complete with status (TDM_OK or TDM_ERR_COMM and msg). Wakes waiters. */
void tdm_work_finish(tdm_work *w, int status, const char *msg);
/* Timeout of this rank's group in seconds. */
double tdm_group_timeout(const tdm_group *g);

/* acc[0..len) = src[0][off..] + src[1][off..] + ... + src[n-1][off..], added in rank order
 * (then divided by n for AVG): every backend reduces with it, so every caller gets the same
 * bits for the same inputs. */
static inline void tdm_reduce_ranks(float *restrict acc, const float *const *src, int n,
                                    int64_t off, int len, bool avg) {
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

/* tdm_reduce_ranks for bf16 or f16 buffers (dt): acc[0..len) = the values of src[0..n) at
 * [off, off + len) widened to f32, added in rank order in f32 (then divided by n for AVG) and
 * rounded to dt once at the end. So a low-precision reduction is the f32 reduction of the
 * ranks' rounded values rounded once: the same bits on every rank and every backend, and no
 * rounding per step of the sum (which would lose a bf16 rank's low bits as the sum grows). */
void tdm_reduce_ranks_half(uint16_t *acc, const uint16_t *const *src, int n, int64_t off, int len,
                           bool avg, tdm_dtype dt);

/* One block of a reduction in c's dtype: tdm_reduce_ranks (f32) or tdm_reduce_ranks_half into
 * acc, which holds len elements of that dtype. The backends reduce every block through it, so
 * the dtype is tested once per block, never per element. */
static inline void tdm_reduce_block(void *acc, const void *const *src, int n, int64_t off, int len,
                                    bool avg, tdm_dtype dt) {
    if (dt == TDM_F32)
        tdm_reduce_ranks(acc, (const float *const *)src, n, off, len, avg);
    else
        tdm_reduce_ranks_half(acc, (const uint16_t *const *)src, n, off, len, avg, dt);
}

/* ---- rank threads (spawn.c) -------------------------------------------------------------- */

/* Pins the calling thread to the core of rank `rank` of n, where the machine allows; its GEMMs
 * then run on that core alone. */
void tdm_pin_rank_thread(int rank, int n);
/* A thread's affinity as it was before tdm_pin_caller_thread (a cpu_set_t's bytes). */
typedef struct {
    bool saved;
    unsigned char mask[128];
} tdm_saved_affinity;
/* tdm_pin_rank_thread for a thread that is not ours (the caller of DataParallel): its
 * affinity is saved first, for tdm_restore_thread_affinity on the same thread. */
void tdm_pin_caller_thread(int rank, int n, tdm_saved_affinity *saved);
void tdm_restore_thread_affinity(const tdm_saved_affinity *saved);
/* Makes the GEMM single-threaded while n device threads fill the cores; returns the previous
 * thread count, for tdm_cpu_gemm_set_threads once they are done. */
int tdm_gemm_threads_for_devices(int n);

/* ---- the threads world: every rank a thread of this process ------------------------------- */

typedef struct tdm_threads_world tdm_threads_world;

/* n ranks on devs[0..n-1], each with a communication thread that runs its collectives. NULL
 * and an error if n < 1 or a thread cannot start. The world outlives any number of steps. */
tdm_threads_world *tdm_threads_world_new(int n, const tdm_device *devs);
/* Rank r's group handle (owned by the world). */
tdm_group *tdm_threads_world_group(tdm_threads_world *w, int rank);
/* tdm_work_wait(tdm_barrier(g)) for a rank g of a threads world that waits at once: with no
 * collective of g's queued or running, the calling thread arrives at the world's barrier
 * itself. A launch would first hand the barrier to g's communication thread whenever a peer
 * already waits (threads_launch), a wake-up of a third thread that delayed the shared-memory
 * update of DataParallel on the 2-core VM, and as long again for the peer to see the barrier
 * pass (bench/RESULTS.md, "Issue 15: two CPU devices against one, the MLP again"). TDM_OK, or
 * TDM_ERR_COMM once the world has failed. */
int tdm_threads_barrier(tdm_group *g);
/* Fails anything still pending ("group destroyed"), joins the communication threads and frees
 * the groups and their handles. Call once no rank uses the world any more. */
void tdm_threads_world_free(tdm_threads_world *w);

/* ---- MPI ---------------------------------------------------------------------------------- */

/* Sets Open MPI's TCP eager limit and largest fragment (OMPI_MCA_btl_tcp_eager_limit,
 * OMPI_MCA_btl_tcp_max_send_size) just above max_message bytes, so that no message of that
 * size waits a round trip for the receiver (mpi_tune.c), unless the user set either in the
 * environment or an MCA parameter file. Call before MPI starts, with no other thread reading
 * the environment. Returns how many variables it set (0 or 2). */
int tdm_mpi_tune_tcp(int64_t max_message);
/* The GEMM's threads for a process that shares its machine with other ranks (the launcher's
 * local size, OMPI_COMM_WORLD_LOCAL_SIZE and the like): its share of the cores, at most those
 * its affinity allows, at least 1, as torchrun sets OMP_NUM_THREADS; without it each rank's
 * GEMM runs a thread per core and the ranks' threads fight for the cores (bench/RESULTS.md,
 * "Issue 40: tensor parallelism across processes"). Sets OMP_NUM_THREADS, and the calling
 * thread's count (a thread started later takes the default of the OpenMP runtime, which may
 * have read the environment before: give it the caller's); does nothing when the user set
 * OMP_NUM_THREADS or the rank is alone on its machine. Call before MPI starts, from the thread
 * that will compute. Returns the threads set, or 0. */
int tdm_mpi_share_cores(void);

/* A group of n of the ranks of g, an MPI group (tdm_mpi_init's, or one made here): ranks[k] is
 * g's rank that is the new group's rank k; the caller must be one of them. It runs its
 * collectives on a communication thread of its own, in launch order, under tags of its own,
 * side by side with the other groups' (threads of a process may launch on different groups in
 * any order); a failure or an abort in any group fails them all. Every process makes its
 * groups in the same order (tdm_mesh_new does): the k-th group made in each process gets the
 * same tags. The timeout is g's at the time. NULL and an error for bad ranks, a group that is
 * not MPI's, or a build without MPI. */
tdm_group *tdm_mpi_subgroup(tdm_group *g, int n, const int *ranks);
/* Reserves count group ids (tags) of g's world, the next in this process's order, for
 * tdm_mpi_subgroup_with_id; the first, or -1 and an error when they run out. */
int tdm_mpi_subgroup_ids(tdm_group *g, int count);
/* tdm_mpi_subgroup with the tags of a reserved id: the processes that share the group name the
 * same id (from their own reservations, made in the same order), whichever thread makes it. */
tdm_group *tdm_mpi_subgroup_with_id(tdm_group *g, int n, const int *ranks, int id);
/* Frees a group tdm_mpi_subgroup made, once no collective of it is pending and before
 * tdm_mpi_finalize. NULL is ignored. */
void tdm_mpi_subgroup_free(tdm_group *sub);

/* ---- the two-level world: threads inside this process, processes outside --------------- */

typedef struct tdm_hier_world tdm_hier_world;

/* One group per device thread of this process spanning every device of every process:
 * global rank = process rank * local size + local rank. Collectives run over local (this
 * process's threads world, which must outlive it) and processes (the outer group, e.g.
 * tdm_mpi_init's; only local rank 0 talks to it). NULL and an error when a thread cannot
 * start. */
tdm_hier_world *tdm_hier_world_new(tdm_threads_world *local, int local_size, tdm_group *processes);
tdm_group *tdm_hier_world_group(tdm_hier_world *w, int local_rank);
/* When g is a group of a two-level world: its rank's group in this process's threads world
 * (*local), the devices a process (*local_size) and the outer group (*processes); true. False
 * for any other group. */
bool tdm_hier_group_parts(tdm_group *g, tdm_group **local, int *local_size, tdm_group **processes);
/* Fails what is still queued, joins the threads, frees the groups. */
void tdm_hier_world_free(tdm_hier_world *w);

/* What a sharding of kind k (TDM_SHARD_OPTIMIZER or above) holds in shards, with its verb, for
 * messages: "gradients and optimizer state are". */
static inline const char *tdm_shard_held(tdm_shard_kind k) {
    return k == TDM_SHARD_PARAMETERS  ? "parameters, gradients and optimizer state are"
           : k == TDM_SHARD_GRADIENTS ? "gradients and optimizer state are"
                                      : "optimizer state is";
}

/* A stack view of elements [lo, hi) of contiguous 1-D t with no autograd fields or hooks:
 * what a collective, a copy or a kernel reads (geometry and storage) of a range of a flat
 * buffer (DDP's buckets, ZeRO's shards). Lives as long as t's storage; not to be freed. */
static inline tdm_tensor tdm_range_view(const tdm_tensor *t, int64_t lo, int64_t hi) {
    tdm_tensor v = *t;
    v.shape[0] = hi - lo;
    v.offset = t->offset + lo;
    v.grad = NULL, v.grad_fn = NULL, tdm_book(&v)->hooks = NULL;
    return v;
}

#endif
