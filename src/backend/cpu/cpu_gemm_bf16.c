/* bf16 GEMM through oneDNN's matmul primitive (cpu_gemm_bf16.h says what it computes).
 *
 * Debian 12's oneDNN 2.6.3 has bf16 matmul kernels for avx512_core_bf16 and AMX and emulates
 * bf16 on avx512_core; its BLAS-like API has no bf16 GEMM, so the primitive is the way in. A
 * primitive is made for one shape, layout (strides from the transposes and leading
 * dimensions), alpha (oneDNN's output scale), beta (a sum post-op; none for beta 0, so that
 * C's old values are never read) and output dtype, and making one costs far more than a small
 * product, so they are cached:
 *
 *   TDM_GEMM_BF16_CACHE entries in one array under a mutex, looked up by key; an entry is
 *   pinned (users > 0) while a thread runs it outside the lock, and a new key evicts the
 *   least recently used unpinned entry (when all are pinned, the call makes a primitive for
 *   itself and frees it after).
 *
 * Where oneDNN offers no bf16 kernel (AVX2 CPUs: it refuses, or gives its reference loops,
 * which are orders of magnitude slower) or only its emulation of the bf16 instructions
 * (AVX-512 without AVX512_BF16: slower than fp32), the entry remembers that and the call
 * converts A and B to fp32 and runs tdm_cpu_sgemm: the same fp32 accumulation, another
 * summation order. */
#include "backend/cpu/cpu_gemm_bf16.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "tandem/half.h"

#ifdef TANDEM_GEMM_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl_debug.h>
#endif

static _Thread_local char last_impl[96];

const char *tdm_cpu_gemm_bf16_impl(void) {
    return last_impl;
}

/* ---- the fp32 fallback ---- */

/* rows x cols bf16 with row stride ld into a dense fp32 matrix (row stride cols) in a block
 * of the CPU device's caching allocator (a step's products reuse the same blocks, with none
 * of the page faults of fresh memory); NULL when out of memory. */
static tdm_storage *widen(const uint16_t *x, int64_t rows, int64_t cols, int64_t ld) {
    tdm_storage *s =
        tdm_storage_new((size_t)(rows * cols > 0 ? rows * cols : 1) * sizeof(float), tdm_cpu(0));
    if (!s) return NULL;
    for (int64_t r = 0; r < rows; r++)
        tdm_bf16_to_f32((float *)s->data + r * cols, x + r * ld, (size_t)cols);
    return s;
}

static int gemm_via_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                          const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb,
                          float beta, void *c, bool c_bf16, int64_t ldc) {
    int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
    tdm_storage *as = widen(a, ar, ac, lda), *bs = widen(b, br, bc, ldb), *cs = NULL;
    int rc = TDM_OK;
    if (c_bf16) { /* beta 0: C's old values are not read; zeros keep the copy defined */
        cs = beta != 0 ? widen(c, m, n, ldc)
                       : tdm_storage_new((size_t)(m * n > 0 ? m * n : 1) * 4, tdm_cpu(0));
        if (cs && beta == 0) memset(cs->data, 0, (size_t)(m * n) * 4);
    }
    if (!as || !bs || (c_bf16 && !cs)) {
        rc = tdm_raise(TDM_ERR_NOMEM,
                       "gemm_bf16: no memory for the fp32 copies (%lld x %lld x %lld)",
                       (long long)m, (long long)n, (long long)k);
        goto out;
    }
    const float *af = as->data, *bf = bs->data;
    if (c_bf16) {
        float *cf = cs->data;
        tdm_cpu_sgemm(ta, tb, m, n, k, alpha, af, ac, bf, bc, beta, cf, n);
        for (int64_t r = 0; r < m; r++)
            tdm_bf16_from_f32((uint16_t *)c + r * ldc, cf + r * n, (size_t)n);
    } else {
        tdm_cpu_sgemm(ta, tb, m, n, k, alpha, af, ac, bf, bc, beta, c, ldc);
    }
    snprintf(last_impl, sizeof last_impl, "fp32 sgemm");
out:
    if (as) tdm_storage_release(as);
    if (bs) tdm_storage_release(bs);
    if (cs) tdm_storage_release(cs);
    return rc;
}

#ifdef TANDEM_GEMM_ONEDNN
/* ---- oneDNN primitives and their cache ---- */

typedef struct {
    bool ta, tb, c_bf16;
    int64_t m, n, k, lda, ldb, ldc;
    float alpha, beta;
} gemm_key;

typedef struct {
    gemm_key key;
    bool used;             /* the slot holds an entry */
    bool fallback;         /* oneDNN has no bf16 kernel for this: convert and sgemm */
    dnnl_primitive_t prim; /* NULL with fallback */
    int users;             /* threads running prim now */
    uint64_t last_use;     /* the cache's clock at the last lookup */
    char impl[80];
} gemm_entry;

static struct {
    pthread_mutex_t lock;
    gemm_entry e[TDM_GEMM_BF16_CACHE];
    uint64_t clock;
    dnnl_engine_t engine;
    dnnl_status_t engine_status;
    /* oneDNN has the bf16 instructions to use (AVX512_BF16 or AMX). Without them its bf16
     * matmul emulates them on AVX-512, slower than converting to fp32 and running the fp32
     * GEMM (bench/RESULTS.md, "the bf16 step where the time goes"), so every entry falls
     * back to that. */
    bool native;
} cache = {.lock = PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t engine_once = PTHREAD_ONCE_INIT;

static void make_engine(void) {
    cache.engine_status = dnnl_engine_create(&cache.engine, dnnl_cpu, 0);
    /* the ISA oneDNN will use (the CPU's, or less under ONEDNN_MAX_CPU_ISA): the ISA values
     * nest, each holding the bits of those below it */
    dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    cache.native = (isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16;
}

static bool key_eq(const gemm_key *x, const gemm_key *y) {
    return x->ta == y->ta && x->tb == y->tb && x->c_bf16 == y->c_bf16 && x->m == y->m &&
           x->n == y->n && x->k == y->k && x->lda == y->lda && x->ldb == y->ldb &&
           x->ldc == y->ldc && memcmp(&x->alpha, &y->alpha, sizeof x->alpha) == 0 &&
           memcmp(&x->beta, &y->beta, sizeof x->beta) == 0;
}

/* A 2-D memory descriptor of rows x cols with the given strides. */
static dnnl_status_t md2(dnnl_memory_desc_t *md, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                         dnnl_data_type_t dt) {
    dnnl_dims_t dims = {rows, cols}, strides = {rs, cs};
    return dnnl_memory_desc_init_by_strides(md, 2, dims, dt, strides);
}

/* e's primitive for its key, or e->fallback when oneDNN has no bf16 kernel for it. Returns
 * dnnl_success either way, or the status of a failure that is not "unimplemented". */
static dnnl_status_t make_primitive(gemm_entry *e) {
    const gemm_key *q = &e->key;
    dnnl_memory_desc_t a_md, b_md, c_md;
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    e->prim = NULL;
    e->fallback = !cache.native;
    if (e->fallback) return dnnl_success;
    dnnl_status_t st = md2(&a_md, q->m, q->k, q->ta ? 1 : q->lda, q->ta ? q->lda : 1, dnnl_bf16);
    if (st == dnnl_success)
        st = md2(&b_md, q->k, q->n, q->tb ? 1 : q->ldb, q->tb ? q->ldb : 1, dnnl_bf16);
    if (st == dnnl_success)
        st = md2(&c_md, q->m, q->n, q->ldc, 1, q->c_bf16 ? dnnl_bf16 : dnnl_f32);
    if (st == dnnl_success) st = dnnl_matmul_desc_init(&desc, &a_md, &b_md, NULL, &c_md);
    if (st == dnnl_success) st = dnnl_primitive_attr_create(&attr);
    if (st == dnnl_success && q->alpha != 1.0f)
        st = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &q->alpha);
    if (st == dnnl_success && q->beta != 0.0f) {
        st = dnnl_post_ops_create(&po);
        if (st == dnnl_success) st = dnnl_post_ops_append_sum(po, q->beta);
        if (st == dnnl_success) st = dnnl_primitive_attr_set_post_ops(attr, po);
    }
    if (st == dnnl_success) st = dnnl_primitive_desc_create(&pd, &desc, attr, cache.engine, NULL);
    const char *impl = NULL;
    if (st == dnnl_success)
        st = dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, (void *)&impl);
    if (st == dnnl_unimplemented || (st == dnnl_success && impl && strncmp(impl, "ref", 3) == 0)) {
        e->fallback = true;
        st = dnnl_success;
    } else if (st == dnnl_success) {
        snprintf(e->impl, sizeof e->impl, "oneDNN %s", impl ? impl : "?");
        st = dnnl_primitive_create(&e->prim, pd);
    }
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (po) dnnl_post_ops_destroy(po);
    if (attr) dnnl_primitive_attr_destroy(attr);
    return st;
}

static void drop(gemm_entry *e) {
    if (e->prim) dnnl_primitive_destroy(e->prim);
    memset(e, 0, sizeof *e);
}

/* The cached entry for q, pinned, or the slot a new one goes in (made under the lock: a
 * primitive is made once per key, and making one is rare). NULL when every slot is pinned:
 * then *own is filled for this call alone. */
static gemm_entry *lookup(const gemm_key *q, gemm_entry *own, dnnl_status_t *st) {
    *st = dnnl_success;
    pthread_mutex_lock(&cache.lock);
    gemm_entry *hit = NULL, *empty = NULL, *lru = NULL;
    for (int i = 0; i < TDM_GEMM_BF16_CACHE; i++) {
        gemm_entry *e = &cache.e[i];
        if (!e->used) {
            if (!empty) empty = e;
        } else if (key_eq(&e->key, q)) {
            /* a busy entry is not shared: the second thread gets an entry of its own for the
             * key. One primitive executed on two threads at once gave wrong products
             * (DataParallel's replicas, same shapes): a primitive's library-managed scratchpad
             * is its own, shared by concurrent executions unless oneDNN was built with
             * DNNL_ENABLE_CONCURRENT_EXEC, which Debian's is not known to be */
            if (e->users == 0) {
                hit = e;
                break;
            }
        } else if (e->users == 0 && (!lru || e->last_use < lru->last_use)) {
            lru = e;
        }
    }
    gemm_entry *victim = empty ? empty : lru;
    if (!hit && victim) {
        drop(victim);
        victim->key = *q;
        *st = make_primitive(victim);
        if (*st == dnnl_success) {
            victim->used = true;
            hit = victim;
        } else {
            drop(victim);
        }
    }
    if (hit) {
        hit->users++;
        hit->last_use = ++cache.clock;
    }
    pthread_mutex_unlock(&cache.lock);
    if (!hit && *st == dnnl_success) { /* every slot pinned */
        memset(own, 0, sizeof *own);
        own->key = *q;
        *st = make_primitive(own);
    }
    return hit;
}

static void unpin(gemm_entry *e) {
    pthread_mutex_lock(&cache.lock);
    e->users--;
    pthread_mutex_unlock(&cache.lock);
}

int tdm_cpu_gemm_bf16_cached(void) {
    int n = 0;
    pthread_mutex_lock(&cache.lock);
    for (int i = 0; i < TDM_GEMM_BF16_CACHE; i++) n += cache.e[i].used;
    pthread_mutex_unlock(&cache.lock);
    return n;
}

void tdm_cpu_gemm_bf16_cache_clear(void) {
    pthread_mutex_lock(&cache.lock);
    for (int i = 0; i < TDM_GEMM_BF16_CACHE; i++)
        if (cache.e[i].used && cache.e[i].users == 0) drop(&cache.e[i]);
    pthread_mutex_unlock(&cache.lock);
}

static dnnl_status_t run_primitive(const gemm_entry *e, const uint16_t *a, const uint16_t *b,
                                   void *c) {
    const gemm_key *q = &e->key;
    dnnl_memory_desc_t a_md, b_md, c_md;
    dnnl_memory_t am = NULL, bm = NULL, cm = NULL;
    dnnl_stream_t s = NULL;
    dnnl_status_t st = md2(&a_md, q->m, q->k, q->ta ? 1 : q->lda, q->ta ? q->lda : 1, dnnl_bf16);
    if (st == dnnl_success)
        st = md2(&b_md, q->k, q->n, q->tb ? 1 : q->ldb, q->tb ? q->ldb : 1, dnnl_bf16);
    if (st == dnnl_success)
        st = md2(&c_md, q->m, q->n, q->ldc, 1, q->c_bf16 ? dnnl_bf16 : dnnl_f32);
    /* oneDNN takes the handles as void *; it only reads A and B */
    if (st == dnnl_success) st = dnnl_memory_create(&am, &a_md, cache.engine, (void *)(uintptr_t)a);
    if (st == dnnl_success) st = dnnl_memory_create(&bm, &b_md, cache.engine, (void *)(uintptr_t)b);
    if (st == dnnl_success) st = dnnl_memory_create(&cm, &c_md, cache.engine, c);
    if (st == dnnl_success) st = dnnl_stream_create(&s, cache.engine, dnnl_stream_default_flags);
    if (st == dnnl_success) {
        dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
        st = dnnl_primitive_execute(e->prim, s, 3, args);
        if (st == dnnl_success) st = dnnl_stream_wait(s);
    }
    if (s) dnnl_stream_destroy(s);
    if (am) dnnl_memory_destroy(am);
    if (bm) dnnl_memory_destroy(bm);
    if (cm) dnnl_memory_destroy(cm);
    return st;
}
#endif

static void scale_c(int64_t m, int64_t n, float beta, void *c, bool c_bf16, int64_t ldc) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            if (c_bf16) {
                uint16_t *p = (uint16_t *)c + i * ldc + j;
                *p = tdm_bf16_from_float(beta == 0 ? 0.0f : beta * tdm_bf16_to_float(*p));
            } else {
                float *p = (float *)c + i * ldc + j;
                *p = beta == 0 ? 0.0f : beta * *p;
            }
        }
    snprintf(last_impl, sizeof last_impl, "scale");
}

static int check_dims(bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                      int64_t ldc) {
    if (m < 0 || n < 0 || k < 0)
        return tdm_raise(TDM_ERR_ARG, "gemm_bf16: negative size m %lld, n %lld, k %lld",
                         (long long)m, (long long)n, (long long)k);
    int64_t arow = ta ? m : k, brow = tb ? k : n;
    if (lda < (arow > 1 ? arow : 1) || ldb < (brow > 1 ? brow : 1) || ldc < (n > 1 ? n : 1))
        return tdm_raise(TDM_ERR_ARG,
                         "gemm_bf16: leading dimensions lda %lld, ldb %lld, ldc %lld below the "
                         "rows' lengths %lld, %lld, %lld (m %lld, n %lld, k %lld, ta %d, tb %d)",
                         (long long)lda, (long long)ldb, (long long)ldc, (long long)arow,
                         (long long)brow, (long long)n, (long long)m, (long long)n, (long long)k,
                         ta, tb);
    return TDM_OK;
}

int tdm_cpu_gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                      const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, float beta,
                      void *c, bool c_bf16, int64_t ldc) {
    int rc = check_dims(ta, tb, m, n, k, lda, ldb, ldc);
    if (rc) return rc;
    if (m == 0 || n == 0) return TDM_OK;
    if (k == 0) { /* no products: C = beta * C (0 for beta 0, whatever C held), as BLAS */
        scale_c(m, n, beta, c, c_bf16, ldc);
        return TDM_OK;
    }
#ifdef TANDEM_GEMM_ONEDNN
    pthread_once(&engine_once, make_engine);
    if (cache.engine_status != dnnl_success)
        return tdm_raise(TDM_ERR_STATE, "gemm_bf16: oneDNN's CPU engine: %s",
                         dnnl_status2str(cache.engine_status));
    gemm_key q = {ta, tb, c_bf16, m, n, k, lda, ldb, ldc, alpha, beta};
    gemm_entry own, *e;
    dnnl_status_t st;
    e = lookup(&q, &own, &st);
    gemm_entry *run = e ? e : &own;
    if (st == dnnl_success && !run->fallback) {
        st = run_primitive(run, a, b, c);
        snprintf(last_impl, sizeof last_impl, "%s", run->impl);
    }
    bool fallback = st == dnnl_success && run->fallback;
    if (e)
        unpin(e);
    else
        drop(&own);
    if (st != dnnl_success)
        return tdm_raise(TDM_ERR_STATE,
                         "gemm_bf16: oneDNN's matmul (m %lld, n %lld, k %lld, ta %d, tb %d, %s "
                         "out): %s",
                         (long long)m, (long long)n, (long long)k, ta, tb, c_bf16 ? "bf16" : "f32",
                         dnnl_status2str(st));
    if (!fallback) return TDM_OK;
#endif
    return gemm_via_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, c_bf16, ldc);
}

#ifndef TANDEM_GEMM_ONEDNN
int tdm_cpu_gemm_bf16_cached(void) {
    return 0;
}

void tdm_cpu_gemm_bf16_cache_clear(void) {}
#endif
