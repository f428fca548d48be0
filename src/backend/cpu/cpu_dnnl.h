/* oneDNN for the CPU backend's bf16 kernels: its CPU engine, and caches of primitives by key,
 * shared by the bf16 GEMM (cpu_gemm_bf16.c) and the bf16 convolution (cpu_conv_bf16.c).
 *
 * Making a primitive costs far more than running a small one, so each is made once per key
 * (shapes, layout, options) and kept: a cache is TDM_DNNL_CACHE entries under a mutex. An
 * entry is pinned (users > 0) while a thread runs it outside the lock, and is never shared by
 * two threads at once: one primitive executed on two threads gave wrong products
 * (DataParallel's replicas, same shapes), since a primitive's library-managed scratchpad is
 * its own unless oneDNN was built with DNNL_ENABLE_CONCURRENT_EXEC, which Debian's is not
 * known to be. A new key evicts the least recently used unpinned entry; when all are pinned
 * the call makes an entry for itself and drops it after. Only with TANDEM_GEMM_ONEDNN. */
#ifndef TDM_CPU_DNNL_H
#define TDM_CPU_DNNL_H

#ifdef TANDEM_GEMM_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TDM_DNNL_CACHE     64  /* entries a cache holds */
#define TDM_DNNL_KEY_BYTES 208 /* the largest key (the convolution's) */
#define TDM_DNNL_PRIMS     4   /* primitives an entry may hold (a kernel and its reorders) */

typedef struct {
    unsigned char key[TDM_DNNL_KEY_BYTES]; /* the caller's key, compared byte for byte */
    bool used;                             /* the slot holds an entry */
    bool fallback;                         /* oneDNN has no fast bf16 kernel: the caller's own */
    int users;                             /* threads running it now */
    uint64_t last_use;                     /* the cache's clock at the last lookup */
    dnnl_primitive_t prim[TDM_DNNL_PRIMS]; /* made by the make function; NULL where unused */
    dnnl_memory_desc_t md[TDM_DNNL_PRIMS]; /* layouts the make function chose to keep */
    char impl[80];                         /* "oneDNN <implementation>" */
} tdm_dnnl_entry;

typedef struct {
    pthread_mutex_t lock;
    tdm_dnnl_entry e[TDM_DNNL_CACHE];
    uint64_t clock;
} tdm_dnnl_cache;
#define TDM_DNNL_CACHE_INIT                                                                        \
    { .lock = PTHREAD_MUTEX_INITIALIZER }

/* Fills e's primitives for the key in e->key (e->fallback where oneDNN has no fast kernel).
 * Returns dnnl_success, or the status of a failure that is not "unimplemented". */
typedef dnnl_status_t (*tdm_dnnl_make_fn)(tdm_dnnl_entry *e);

/* The CPU engine, made on first use; NULL with *st its failure. */
dnnl_engine_t tdm_dnnl_engine(dnnl_status_t *st);
/* Whether oneDNN has the bf16 instructions to use (AVX512_BF16 or AMX) at the ISA it runs at
 * (the CPU's, or less under ONEDNN_MAX_CPU_ISA). Without them it emulates bf16 on AVX-512,
 * slower than converting to fp32 (bench/RESULTS.md, "the bf16 step where the time goes"). */
bool tdm_dnnl_native(void);

/* The entry for key (len bytes, at most TDM_DNNL_KEY_BYTES: zero a key struct's padding
 * before filling it), pinned, made by make if new. When every slot is pinned, own is made for
 * this call alone and returned. NULL with *st on failure (nothing is pinned then). Pass what
 * it returned to tdm_dnnl_done. */
tdm_dnnl_entry *tdm_dnnl_get(tdm_dnnl_cache *c, const void *key, size_t len, tdm_dnnl_make_fn make,
                             tdm_dnnl_entry *own, dnnl_status_t *st);
/* Unpins e (or drops own, which tdm_dnnl_get made for one call). */
void tdm_dnnl_done(tdm_dnnl_cache *c, tdm_dnnl_entry *e, tdm_dnnl_entry *own);
/* Entries c holds now; tdm_dnnl_clear drops every one not running (tests, leak checkers). */
int tdm_dnnl_cached(tdm_dnnl_cache *c);
void tdm_dnnl_clear(tdm_dnnl_cache *c);

/* Runs p on a stream of the engine with n arguments and waits for it. */
dnnl_status_t tdm_dnnl_run(dnnl_primitive_t p, int n, const dnnl_exec_arg_t *args);
/* An entry's primitive from pd, made with status st: e->fallback where oneDNN has no kernel
 * (st unimplemented) or only its reference loops (orders of magnitude slower than any other),
 * else e->prim[0] and e->impl ("oneDNN jit_bf16:avx512_core_bf16"). Returns dnnl_success
 * then, or st / the failure to make the primitive. */
dnnl_status_t tdm_dnnl_take(tdm_dnnl_entry *e, dnnl_status_t st, const_dnnl_primitive_desc_t pd);
#endif

#endif
