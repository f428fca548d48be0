/* Private core interface: errors, storage, tensor construction, the caching allocator.
 * Shared by every layer of the library; not installed. */
#ifndef TDM_CORE_H
#define TDM_CORE_H

#include "tandem/runtime.h"
#include "tandem/tensor.h"

/* ---- errors ----------------------------------------------------------------------------- */

/* Records a printf-style message for tdm_last_error and returns status (so callers can write
 * `return tdm_raise(TDM_ERR_SHAPE, "...")`). */
int tdm_raise(tdm_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Same, returning NULL, for functions that return pointers. */
void *tdm_raise_null(tdm_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- a tensor's bookkeeping -------------------------------------------------------------- */

/* What the library keeps in tdm_tensor's opaque internal_ bytes. */
typedef struct {
    tdm_scope *owner;       /* NULL: owned by the caller */
    bool heap_header;       /* scope-owned, but the header was malloc'd */
    bool grad_overwrite;    /* autograd: the leaf's .grad is stale: the next gradient replaces
                             * it (tdm_grad_mark_overwrite) */
    tdm_tensor *next;       /* owner's list */
    tdm_tensor *ready_next; /* autograd: leaves whose gradient is final together */
    int32_t last_use;       /* autograd: first tape index that reads this leaf */
    void *hooks;            /* autograd: gradient-ready hooks */
} tdm_tensor_book;

#ifdef __cplusplus
static_assert(sizeof(tdm_tensor_book) <= sizeof(((tdm_tensor *)0)->internal_),
              "tdm_tensor_book outgrew tdm_tensor.internal_");
#else
_Static_assert(sizeof(tdm_tensor_book) <= sizeof(((tdm_tensor *)0)->internal_),
               "tdm_tensor_book outgrew tdm_tensor.internal_");
#endif

/* t's bookkeeping (a view copied by value carries its source's, as the fields did). */
static inline tdm_tensor_book *tdm_book(const tdm_tensor *t) {
    return (tdm_tensor_book *)(void *)t->internal_;
}

/* ---- storage and the caching allocator -------------------------------------------------- */

/* A storage's layout is C's alone: its count is a C11 atomic, which C++ cannot parse (the
 * CUDA kernels are C++ for nvcc, whose host compiler is GCC). C++ code holds storages by
 * pointer only and reaches their memory through a C function (tdm_cuda_storage_ptr). */
#ifndef __cplusplus
#include <stdatomic.h>

struct tdm_storage {
    void *data;
    size_t nbytes; /* capacity of the block */
    tdm_device device;
    atomic_int refcount;
    /* The backward engine's (engine.c): made while a node's backward ran (tdm_alloc_set_walk),
     * and how many nodes hold a gradient on it; such a storage's memory goes back to the
     * cache when its last holder has run. One thread's walk touches these: plain fields. */
    bool walk_born;
    int grad_holders;
    /* the CUDA graph whose block this is (tdm_alloc_capture_begin), or NULL: its block goes
     * back to that graph's pool, never to the cache other work draws from */
    struct tdm_graph_pool *graph_pool;
};
#endif

/* Storages made on this thread from now on are marked made during a backward walk (on) or
 * not; returns the previous setting. The engine's, around each node's backward. */
bool tdm_alloc_set_walk(bool on);

/* A block of at least nbytes on dev from the device's cache (malloc only on a miss).
 * Refcount starts at 1. NULL and TDM_ERR_NOMEM on failure. */
tdm_storage *tdm_storage_new(size_t nbytes, tdm_device dev);
void tdm_storage_retain(tdm_storage *s);
/* Drops a reference; the block returns to the cache at zero. */
void tdm_storage_release(tdm_storage *s);
/* FSDP's storage resize: nbytes 0 gives s's block back to the cache and leaves s without
 * memory (data NULL; every tensor on s keeps its header and geometry); nbytes > 0 gives an
 * empty s a block of at least nbytes from the cache (contents undefined). A no-op when s is
 * already in that state. TDM_ERR_NOMEM (s stays empty) or TDM_ERR_ARG when a non-empty s is
 * asked for another size. */
int tdm_storage_resize(tdm_storage *s, size_t nbytes);

typedef struct {
    size_t bytes_in_use; /* held by live storages */
    size_t bytes_cached; /* free blocks kept for reuse */
    size_t peak_in_use;
    uint64_t sys_allocs; /* calls into the system allocator (blocks and arena chunks) */
} tdm_alloc_stats;
/* Statistics of one device's pool. */
tdm_alloc_stats tdm_alloc_stats_get(tdm_device dev);
void tdm_alloc_reset_peak(tdm_device dev);
/* Returns every cached block of dev to the system. */
void tdm_alloc_empty_cache(tdm_device dev);
/* Counts a system allocation made outside the pools (arenas) in the statistics. */
void tdm_alloc_count_sys(void);

/* A CUDA graph's private pool (PyTorch's graph pool). A replay writes into the blocks the
 * captured work used, so from tdm_alloc_capture_begin(dev) to tdm_alloc_capture_end every
 * block this thread takes or gives back on dev becomes the graph's: the graph's blocks freed
 * are handed out again only to the capture (in capture order, as a replay reuses them), and
 * after it to no one, until tdm_alloc_graph_pool_free gives them back to dev's cache (blocks
 * still held then go back when released). Other threads and devices are not affected.
 * capture_begin: TDM_ERR_STATE while this thread captures already, TDM_ERR_NOMEM. */
typedef struct tdm_graph_pool tdm_graph_pool;
int tdm_alloc_capture_begin(tdm_device dev);
/* Ends this thread's capture: the pool, owned by the caller (NULL when none was begun). */
tdm_graph_pool *tdm_alloc_capture_end(void);
/* Gives the pool's free blocks back to its device's cache; the caller has waited for the
 * work that used them. NULL is ignored. */
void tdm_alloc_graph_pool_free(tdm_graph_pool *gp);

/* Raw device memory under the pools: a block on a miss, returned by tdm_alloc_empty_cache.
 * It comes from the device's backend, whose kernels allocate through these pools and so sit
 * above them: the backend layer registers it as the library loads (src/backend/backend.c),
 * once; later calls are ignored. alloc returns NULL when it cannot (an error raised or not). */
typedef struct {
    void *(*alloc)(tdm_device dev, size_t nbytes);
    void (*free)(tdm_device dev, void *p, size_t nbytes);
} tdm_device_memory;
void tdm_alloc_set_device_memory(const tdm_device_memory *mem);

/* ---- random draws, logged and replayed --------------------------------------------------- */

/* The first of n counters of a draw from rng, which moves past them. Every draw from a
 * tdm_rng (random fills, dropout) takes its counters here, so that a thread's draws can be
 * logged and replayed (below). Never fails. */
uint64_t tdm_rng_take(tdm_rng *rng, uint64_t n);

/* A record of the calling thread's draws: how autograd's recomputation (tdm_recompute) runs
 * a function again with the random numbers of its first run (dropout's masks). Recording,
 * each draw's first counter is appended to offsets (grown on the heap past cap: heap is then
 * set and the owner frees offsets); replaying, each draw gets the next logged counter back and
 * no generator moves. A log pushed while another is in force takes its counters from that
 * one: a function recomputed inside a recomputed function records what its parent replays. */
typedef struct tdm_rng_log {
    uint64_t *offsets;
    int n, cap;
    int next; /* replaying: the next logged draw */
    bool replay;
    bool heap;   /* offsets was reallocated on the heap: the owner frees it */
    bool failed; /* out of memory recording, or more draws replayed than were logged */
    struct tdm_rng_log *parent; /* the log in force when this one was pushed */
} tdm_rng_log;
/* Puts log in force on the calling thread (its parent: the one in force before). */
void tdm_rng_log_push(tdm_rng_log *log);
/* Puts log's parent back in force; log must be the one in force. */
void tdm_rng_log_pop(tdm_rng_log *log);
/* Whether a log is in force on the calling thread (a recomputed function, or its first run). */
bool tdm_rng_logging(void);

/* ---- tensors ---------------------------------------------------------------------------- */

/* A tensor header with the current scope as owner (or the caller if none), no storage. */
tdm_tensor *tdm_tensor_header(void);
/* A header owned by owner (a scope, or NULL for the caller), e.g. a leaf's gradient. */
tdm_tensor *tdm_tensor_header_owned(tdm_scope *owner);
/* A contiguous tensor of shape with fresh storage; contents uninitialised. */
tdm_tensor *tdm_tensor_alloc(tdm_shape shape, tdm_dtype dt, tdm_device dev);
/* Same, owned by owner (see tdm_tensor_header_owned). */
tdm_tensor *tdm_tensor_alloc_owned(tdm_shape shape, tdm_dtype dt, tdm_device dev, tdm_scope *owner);
/* A view of base: shares base's storage with the given geometry. */
tdm_tensor *tdm_tensor_view(const tdm_tensor *base, int ndim, const int64_t *shape,
                            const int64_t *strides, int64_t offset);
/* Fills strides for a contiguous row-major layout. */
void tdm_contiguous_strides(int ndim, const int64_t *shape, int64_t *strides);
bool tdm_same_shape(const tdm_tensor *a, const tdm_tensor *b);

/* Normalises dim against ndim (negative counts from the end). -1 and an error if invalid. */
int tdm_wrap_dim(int dim, int ndim, const char *op);

/* Checks shared by every op. Each raises a message naming op and returns nonzero. */
int tdm_check_f32(const tdm_tensor *t, const char *op);
int tdm_check_same_device(const tdm_tensor *a, const tdm_tensor *b, const char *op);

/* Allocates n bytes that live as long as the current scope (or malloc'd when none is open:
 * then the caller frees). Zeroed. For tape nodes and op contexts. */
void *tdm_scope_alloc(size_t n);
/* The innermost open scope of this thread (NULL if none). */
tdm_scope *tdm_current_scope(void);
/* Ends this thread's open scopes and frees its arena and tape: a thread that used scopes
 * (a rank of tdm_spawn, a DataParallel worker) calls it before it exits. */
void tdm_thread_release(void);

/* ---- hooks autograd registers ----------------------------------------------------------------
 *
 * Core is the bottom layer, but two things it owns hold autograd's state: a tensor's
 * gradient-ready hooks and the tape recorded inside a scope. Autograd registers a function
 * for each when it first makes such state, so before that there is nothing to call and core
 * runs without it. Each is set once (later calls are ignored) and read with one atomic load;
 * a call is one indirect call per freed tensor with hooks or per scope, never per element.
 * (The allocator's device memory, above, is registered the same way by the backend.) */

/* Frees a tensor's gradient-ready hooks (tdm_book(t)->hooks) when tdm_tensor_free frees it.
 * Registered by autograd as it makes a tensor's first hook (src/autograd/engine.c). */
typedef void (*tdm_hooks_free_fn)(void *hooks);
void tdm_tensor_set_hooks_free(tdm_hooks_free_fn fn);

/* The calling thread's autograd tape as step scopes see it: a scope marks the tape's length
 * when it begins and truncates the tape to that mark when it ends (its nodes live in the
 * scope's arena); tdm_thread_release frees the thread's tape. Registered by autograd at its
 * first node (src/autograd/tape.c): until then every thread's tape is empty, so a scope that
 * began without it marks 0. */
typedef struct {
    int (*mark)(void);
    void (*truncate)(int mark);
    void (*release)(void);
} tdm_scope_tape;
void tdm_scope_set_tape(const tdm_scope_tape *tape);

#endif
