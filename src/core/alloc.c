/* The caching allocator: one pool per device. Freed blocks are kept in size classes and
 * handed out again, so a training step in steady state never calls the system allocator
 * (and never pays first-touch page faults again: bench/RESULTS.md, "Figures behind the code").
 *
 * Size classes: 256-byte granules up to 4 KiB, then four classes per power of two (at most
 * 25% waste). A block keeps its storage header, so a cache hit allocates nothing. */
#include "core/core.h"
#include "core/hook.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Under AddressSanitizer a cached CPU block is poisoned until it is handed out again, so that
 * a read of memory given back early (the backward engine frees gradients as they are
 * consumed) is reported, not served from a reused block. */
#if defined(__SANITIZE_ADDRESS__)
#define TDM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TDM_ASAN 1
#endif
#endif
#ifdef TDM_ASAN
#include <sanitizer/asan_interface.h>
#define POISON(s, n)   ASAN_POISON_MEMORY_REGION((s), (n))
#define UNPOISON(s, n) ASAN_UNPOISON_MEMORY_REGION((s), (n))
#else
#define POISON(s, n)   ((void)(s), (void)(n))
#define UNPOISON(s, n) ((void)(s), (void)(n))
#endif

#define N_CLASSES 256

typedef struct {
    pthread_mutex_t lock;
    tdm_storage *free_list[N_CLASSES]; /* cached blocks, linked through cached.next */
    tdm_storage *spare; /* headers without a block (tdm_storage_resize), for the next one */
    tdm_alloc_stats stats;
    size_t limit; /* tdm_device_set_memory_limit's cap on in use + cached; 0: none */
} pool;

static pool pools[2][TDM_MAX_DEVICES];

/* A graph's blocks (core.h, tdm_alloc_capture_begin). live: its blocks held by storages now
 * (the free ones are in free_list); closed: its graph freed, the last live block frees it. Under
 * the lock of dev's pool. */
struct tdm_graph_pool {
    tdm_device dev;
    tdm_storage *free_list[N_CLASSES];
    size_t live;
    bool closed;
};
static _Thread_local tdm_graph_pool *capturing; /* this thread's capture, or NULL */
static _Thread_local bool walk_tag;             /* tdm_alloc_set_walk */
static pthread_once_t pools_once = PTHREAD_ONCE_INIT;
static atomic_ullong extra_sys_allocs;
static tdm_hook device_memory;

/* A block: its storage header and, while cached, the link to the next free block. */
typedef struct cached {
    tdm_storage s;
    struct cached *next;
} cached;

static void pools_init(void) {
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < TDM_MAX_DEVICES; i++) pthread_mutex_init(&pools[t][i].lock, NULL);
}

void tdm_alloc_set_device_memory(const tdm_device_memory *mem) {
    tdm_hook_set(&device_memory, mem);
}

static const tdm_device_memory *memory(void) {
    return tdm_hook_get(&device_memory);
}

static pool *pool_of(tdm_device dev) {
    pthread_once(&pools_once, pools_init);
    if (dev.index < 0 || dev.index >= TDM_MAX_DEVICES) return NULL;
    return &pools[dev.type == TDM_CUDA][dev.index];
}

/* Class index and rounded size for a request of n bytes. */
static int size_class(size_t n, size_t *rounded) {
    if (n <= 4096) {
        size_t g = (n + 255) / 256;
        if (g == 0) g = 1;
        *rounded = g * 256;
        return (int)g - 1; /* 0..15 */
    }
    int k = 63 - __builtin_clzll((unsigned long long)(n - 1)); /* 2^k < n <= 2^(k+1) */
    size_t base = (size_t)1 << k, step = base / 4;
    size_t q = (n - base + step - 1) / step; /* 1..4 */
    *rounded = base + q * step;
    return 16 + (k - 12) * 4 + (int)(q - 1);
}

/* Gives every cached block of p back to the system. Caller holds p->lock. */
static void empty_locked(pool *p, tdm_device dev) {
    const tdm_device_memory *mem = memory();
    for (int c = 0; c < N_CLASSES && mem; c++) {
        cached *b = (cached *)p->free_list[c];
        while (b) {
            cached *next = b->next;
            if (dev.type == TDM_CPU) UNPOISON(b->s.data, b->s.nbytes);
            mem->free(dev, b->s.data, b->s.nbytes);
            p->stats.bytes_cached -= b->s.nbytes;
            free(b);
            b = next;
        }
        p->free_list[c] = NULL;
    }
}

/* "3.50 GiB" */
static const char *bytes_str(double b, char *buf, size_t cap) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    for (; b >= 1024 && i < 4; i++) b /= 1024;
    snprintf(buf, cap, i ? "%.2f %s" : "%.0f %s", b, u[i]);
    return buf;
}

/* Whether a new block of `rounded` bytes fits p's limit, once the cached blocks are given back
 * if need be (PyTorch's allocator frees its cache and retries before it reports an OOM); if
 * not, raises the out-of-memory error naming the device, the request, the use and the limit.
 * Caller holds p->lock. */
static bool within_limit(pool *p, tdm_device dev, size_t rounded) {
    if (!p->limit || p->stats.bytes_in_use + p->stats.bytes_cached + rounded <= p->limit)
        return true;
    size_t freed = p->stats.bytes_cached;
    empty_locked(p, dev);
    if (p->stats.bytes_in_use + rounded <= p->limit) return true;
    char d[16], a[24], u[24], l[24], f[24];
    tdm_raise(TDM_ERR_NOMEM,
              "%s is out of memory: tried to allocate %s with %s of its %s limit in use by "
              "tensors (%s of cached blocks given back first); the limit is "
              "tdm_device_set_memory_limit's (tandem train --device-memory)",
              tdm_device_str(dev, d), bytes_str((double)rounded, a, sizeof a),
              bytes_str((double)p->stats.bytes_in_use, u, sizeof u),
              bytes_str((double)p->limit, l, sizeof l), bytes_str((double)freed, f, sizeof f));
    return false;
}

tdm_storage *tdm_storage_new(size_t nbytes, tdm_device dev) {
    pool *p = pool_of(dev);
    if (!p) return tdm_raise_null(TDM_ERR_DEVICE, "alloc: device index %d out of range", dev.index);
    size_t rounded;
    int c = size_class(nbytes, &rounded);
    if (c >= N_CLASSES)
        return tdm_raise_null(TDM_ERR_NOMEM, "alloc: %zu bytes is too large", nbytes);
    tdm_graph_pool *gp = capturing && tdm_device_equal(capturing->dev, dev) ? capturing : NULL;
    pthread_mutex_lock(&p->lock);
    cached *b = gp ? (cached *)gp->free_list[c] : NULL; /* the capture's own first */
    if (b) gp->free_list[c] = (tdm_storage *)b->next;
    if (!b && (b = (cached *)p->free_list[c])) p->free_list[c] = (tdm_storage *)b->next;
    if (b) {
        p->stats.bytes_cached -= rounded;
    } else if (!within_limit(p, dev, rounded)) {
        pthread_mutex_unlock(&p->lock);
        return NULL;
    }
    p->stats.bytes_in_use += rounded;
    if (p->stats.bytes_in_use > p->stats.peak_in_use) p->stats.peak_in_use = p->stats.bytes_in_use;
    if (!b) p->stats.sys_allocs++;
    if (gp) gp->live++;
    pthread_mutex_unlock(&p->lock);
    if (!b) {
        const tdm_device_memory *mem = memory();
        b = mem ? malloc(sizeof *b) : NULL;
        void *data = b ? mem->alloc(dev, rounded) : NULL;
        if (!data) {
            free(b);
            pthread_mutex_lock(&p->lock);
            p->stats.bytes_in_use -= rounded;
            if (gp) gp->live--;
            pthread_mutex_unlock(&p->lock);
            return tdm_raise_null(TDM_ERR_NOMEM, "alloc: out of memory for %zu bytes", rounded);
        }
        b->s.data = data;
        b->s.nbytes = rounded;
        b->s.device = dev;
    } else if (dev.type == TDM_CPU)
        UNPOISON(b->s.data, b->s.nbytes);
    atomic_init(&b->s.refcount, 1);
    b->s.walk_born = walk_tag;
    b->s.grad_holders = 0;
    b->s.graph_pool = gp;
    return &b->s;
}

bool tdm_alloc_set_walk(bool on) {
    bool prev = walk_tag;
    walk_tag = on;
    return prev;
}

void tdm_storage_retain(tdm_storage *s) {
    atomic_fetch_add_explicit(&s->refcount, 1, memory_order_relaxed);
}

void tdm_storage_release(tdm_storage *s) {
    if (!s || atomic_fetch_sub_explicit(&s->refcount, 1, memory_order_acq_rel) != 1) return;
    pool *p = pool_of(s->device);
    if (!s->data) { /* emptied by tdm_storage_resize: its header is kept for the next one */
        pthread_mutex_lock(&p->lock);
        ((cached *)s)->next = (cached *)p->spare;
        p->spare = s;
        pthread_mutex_unlock(&p->lock);
        return;
    }
    size_t rounded;
    int c = size_class(s->nbytes, &rounded);
    cached *b = (cached *)s;
    if (s->device.type == TDM_CPU) POISON(s->data, s->nbytes);
    pthread_mutex_lock(&p->lock);
    tdm_graph_pool *gp = s->graph_pool, *done = NULL;
    if (!gp && capturing && tdm_device_equal(capturing->dev, s->device))
        gp = s->graph_pool = capturing, gp->live++; /* the capture may have used it: the graph's */
    if (gp && gp->closed) { /* its graph is gone: the block is everyone's again */
        s->graph_pool = NULL;
        if (--gp->live == 0) done = gp;
        gp = NULL;
    }
    tdm_storage **list = gp ? gp->free_list : p->free_list;
    b->next = (cached *)list[c];
    list[c] = s;
    if (gp) gp->live--;
    p->stats.bytes_in_use -= rounded;
    p->stats.bytes_cached += rounded;
    pthread_mutex_unlock(&p->lock);
    free(done);
}

int tdm_alloc_capture_begin(tdm_device dev) {
    char d[16];
    if (!pool_of(dev))
        return tdm_raise(TDM_ERR_DEVICE, "graph capture: device %s has no memory pool",
                         tdm_device_str(dev, d));
    if (capturing)
        return tdm_raise(TDM_ERR_STATE, "graph capture on %s: this thread captures already",
                         tdm_device_str(dev, d));
    if (!(capturing = calloc(1, sizeof *capturing)))
        return tdm_raise(TDM_ERR_NOMEM, "graph capture: out of memory");
    capturing->dev = dev;
    return TDM_OK;
}

tdm_graph_pool *tdm_alloc_capture_end(void) {
    tdm_graph_pool *gp = capturing;
    capturing = NULL;
    return gp;
}

void tdm_alloc_graph_pool_free(tdm_graph_pool *gp) {
    if (!gp) return;
    pool *p = pool_of(gp->dev);
    pthread_mutex_lock(&p->lock);
    for (int c = 0; c < N_CLASSES; c++)
        while (gp->free_list[c]) {
            cached *b = (cached *)gp->free_list[c];
            gp->free_list[c] = (tdm_storage *)b->next;
            b->s.graph_pool = NULL;
            b->next = (cached *)p->free_list[c];
            p->free_list[c] = &b->s;
        }
    gp->closed = true;
    bool done = gp->live == 0;
    pthread_mutex_unlock(&p->lock);
    if (done) free(gp);
}

/* Resizing moves blocks between headers: a storage keeps its header (tensors point at it)
 * while its block goes to the cache under a spare header, and back. */
int tdm_storage_resize(tdm_storage *s, size_t nbytes) {
    if (!s) return tdm_raise(TDM_ERR_ARG, "storage_resize: NULL storage");
    if ((nbytes == 0) == (s->data == NULL)) return TDM_OK;
    if (nbytes) { /* an empty s takes a block; the block's header becomes a spare */
        cached *b = (cached *)tdm_storage_new(nbytes, s->device);
        if (!b) return tdm_last_status();
        s->data = b->s.data, s->nbytes = b->s.nbytes, s->graph_pool = b->s.graph_pool;
        pool *p = pool_of(s->device);
        pthread_mutex_lock(&p->lock);
        b->next = (cached *)p->spare;
        p->spare = &b->s;
        pthread_mutex_unlock(&p->lock);
        return TDM_OK;
    }
    pool *p = pool_of(s->device);
    pthread_mutex_lock(&p->lock);
    cached *h = (cached *)p->spare;
    if (h) p->spare = (tdm_storage *)h->next;
    pthread_mutex_unlock(&p->lock);
    if (!h && !(h = malloc(sizeof *h)))
        return tdm_raise(TDM_ERR_NOMEM, "storage_resize: out of memory for a block header");
    h->s.data = s->data, h->s.nbytes = s->nbytes, h->s.device = s->device;
    h->s.graph_pool = s->graph_pool;
    atomic_init(&h->s.refcount, 1);
    s->data = NULL, s->nbytes = 0, s->graph_pool = NULL;
    tdm_storage_release(&h->s); /* the block, now h's, back to the cache */
    return TDM_OK;
}

tdm_alloc_stats tdm_alloc_stats_get(tdm_device dev) {
    tdm_alloc_stats st = {0};
    pool *p = pool_of(dev);
    if (!p) return st;
    pthread_mutex_lock(&p->lock);
    st = p->stats;
    pthread_mutex_unlock(&p->lock);
    st.sys_allocs += atomic_load(&extra_sys_allocs);
    return st;
}

void tdm_alloc_reset_peak(tdm_device dev) {
    pool *p = pool_of(dev);
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    p->stats.peak_in_use = p->stats.bytes_in_use;
    pthread_mutex_unlock(&p->lock);
}

void tdm_alloc_empty_cache(tdm_device dev) {
    pool *p = pool_of(dev);
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    empty_locked(p, dev);
    while (p->spare) {
        cached *h = (cached *)p->spare;
        p->spare = (tdm_storage *)h->next;
        free(h);
    }
    pthread_mutex_unlock(&p->lock);
}

int tdm_device_set_memory_limit(tdm_device d, int64_t bytes) {
    pool *p = pool_of(d);
    char b[16];
    if (!p)
        return tdm_raise(TDM_ERR_DEVICE, "device_set_memory_limit: %s has no memory pool",
                         tdm_device_str(d, b));
    if (bytes < 0)
        return tdm_raise(TDM_ERR_ARG, "device_set_memory_limit: %lld bytes for %s (0: no limit)",
                         (long long)bytes, tdm_device_str(d, b));
    pthread_mutex_lock(&p->lock);
    p->limit = (size_t)bytes;
    pthread_mutex_unlock(&p->lock);
    return TDM_OK;
}

void tdm_alloc_count_sys(void) {
    atomic_fetch_add(&extra_sys_allocs, 1);
}

/* ---- the public view (tensor.h) ----------------------------------------------------------- */

tdm_memory_stats tdm_memory_stats_get(tdm_device d) {
    tdm_memory_stats m = {0};
    if (!pool_of(d)) {
        char b[16];
        tdm_raise(TDM_ERR_DEVICE, "memory_stats_get: device %s has no memory pool (index 0..%d)",
                  tdm_device_str(d, b), TDM_MAX_DEVICES - 1);
        return m;
    }
    tdm_alloc_stats s = tdm_alloc_stats_get(d);
    m.allocated = (int64_t)s.bytes_in_use;
    m.peak_allocated = (int64_t)s.peak_in_use;
    m.reserved = (int64_t)(s.bytes_in_use + s.bytes_cached);
    pool *p = pool_of(d);
    pthread_mutex_lock(&p->lock);
    m.limit = (int64_t)p->limit;
    pthread_mutex_unlock(&p->lock);
    return m;
}

void tdm_memory_reset_peak(tdm_device d) {
    tdm_alloc_reset_peak(d);
}

int64_t tdm_memory_block_bytes(int64_t nbytes) {
    if (nbytes < 0) return 0;
    size_t rounded;
    return size_class((size_t)nbytes, &rounded) < N_CLASSES ? (int64_t)rounded : nbytes;
}
