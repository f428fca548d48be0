/* bf16 GEMM through oneDNN's matmul primitive (cpu_gemm_bf16.h says what it computes).
 *
 * Debian 12's oneDNN 2.6.3 has bf16 matmul kernels for avx512_core_bf16 and AMX and emulates
 * bf16 on avx512_core; its BLAS-like API has no bf16 GEMM, so the primitive is the way in. A
 * primitive is made for one shape, layout (strides from the transposes and leading
 * dimensions), alpha (oneDNN's output scale), beta (a sum post-op; none for beta 0, so that
 * C's old values are never read) and output dtype, and cached by them (cpu_dnnl.h).
 *
 * Where oneDNN offers no bf16 kernel (AVX2 CPUs: it refuses, or gives its reference loops,
 * which are orders of magnitude slower) or only its emulation of the bf16 instructions
 * (AVX-512 without AVX512_BF16: slower than fp32), the entry remembers that and the call
 * converts A and B to fp32 and runs tdm_cpu_sgemm: the same fp32 accumulation, another
 * summation order. */
#include "backend/cpu/cpu_gemm_bf16.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_dnnl.h"
#include "tandem/half.h"

#ifdef TANDEM_GEMM_ONEDNN
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
/* ---- oneDNN primitives, cached by key (cpu_dnnl.h) ---- */

typedef struct {
    bool ta, tb, c_bf16;
    int64_t m, n, k, lda, ldb, ldc;
    float alpha, beta;
} gemm_key;

_Static_assert(sizeof(gemm_key) <= TDM_DNNL_KEY_BYTES, "gemm_key fits a cache key");
_Static_assert(TDM_GEMM_BF16_CACHE == TDM_DNNL_CACHE, "the header's count is the cache's");
static tdm_dnnl_cache cache = TDM_DNNL_CACHE_INIT;

/* A 2-D memory descriptor of rows x cols with the given strides. */
static dnnl_status_t md2(dnnl_memory_desc_t *md, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                         dnnl_data_type_t dt) {
    dnnl_dims_t dims = {rows, cols}, strides = {rs, cs};
    return dnnl_memory_desc_init_by_strides(md, 2, dims, dt, strides);
}

/* A, B and C's descriptors for key q: md[0..2] of an entry. */
static dnnl_status_t gemm_mds(const gemm_key *q, dnnl_memory_desc_t *md) {
    dnnl_status_t st = md2(&md[0], q->m, q->k, q->ta ? 1 : q->lda, q->ta ? q->lda : 1, dnnl_bf16);
    if (st == dnnl_success)
        st = md2(&md[1], q->k, q->n, q->tb ? 1 : q->ldb, q->tb ? q->ldb : 1, dnnl_bf16);
    if (st == dnnl_success)
        st = md2(&md[2], q->m, q->n, q->ldc, 1, q->c_bf16 ? dnnl_bf16 : dnnl_f32);
    return st;
}

/* e's matmul for its key (prim[0]), or e->fallback when oneDNN has no bf16 kernel for it. */
static dnnl_status_t make_gemm(tdm_dnnl_entry *e) {
    gemm_key q;
    memcpy(&q, e->key, sizeof q);
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    e->fallback = !tdm_dnnl_native();
    if (e->fallback) return dnnl_success;
    dnnl_status_t st = gemm_mds(&q, e->md), est;
    dnnl_engine_t engine = tdm_dnnl_engine(&est);
    if (st == dnnl_success) st = est;
    if (st == dnnl_success)
        st = dnnl_matmul_desc_init(&desc, &e->md[0], &e->md[1], NULL, &e->md[2]);
    if (st == dnnl_success) st = dnnl_primitive_attr_create(&attr);
    if (st == dnnl_success && q.alpha != 1.0f)
        st = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &q.alpha);
    if (st == dnnl_success && q.beta != 0.0f) {
        st = dnnl_post_ops_create(&po);
        if (st == dnnl_success) st = dnnl_post_ops_append_sum(po, q.beta);
        if (st == dnnl_success) st = dnnl_primitive_attr_set_post_ops(attr, po);
    }
    if (st == dnnl_success) st = dnnl_primitive_desc_create(&pd, &desc, attr, engine, NULL);
    st = tdm_dnnl_take(e, st, pd);
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (po) dnnl_post_ops_destroy(po);
    if (attr) dnnl_primitive_attr_destroy(attr);
    return st;
}

int tdm_cpu_gemm_bf16_cached(void) {
    return tdm_dnnl_cached(&cache);
}

void tdm_cpu_gemm_bf16_cache_clear(void) {
    tdm_dnnl_clear(&cache);
}

static dnnl_status_t run_gemm(const tdm_dnnl_entry *e, const uint16_t *a, const uint16_t *b,
                              void *c) {
    dnnl_memory_t am = NULL, bm = NULL, cm = NULL;
    dnnl_status_t st;
    dnnl_engine_t engine = tdm_dnnl_engine(&st);
    /* oneDNN takes the handles as void *; it only reads A and B */
    if (st == dnnl_success) st = dnnl_memory_create(&am, &e->md[0], engine, (void *)(uintptr_t)a);
    if (st == dnnl_success) st = dnnl_memory_create(&bm, &e->md[1], engine, (void *)(uintptr_t)b);
    if (st == dnnl_success) st = dnnl_memory_create(&cm, &e->md[2], engine, c);
    if (st == dnnl_success) {
        dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
        st = tdm_dnnl_run(e->prim[0], 3, args);
    }
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
    dnnl_status_t st;
    if (!tdm_dnnl_engine(&st))
        return tdm_raise(TDM_ERR_STATE, "gemm_bf16: oneDNN's CPU engine: %s", dnnl_status2str(st));
    gemm_key q;
    memset(&q, 0, sizeof q); /* padding too: keys compare byte for byte */
    q.ta = ta, q.tb = tb, q.c_bf16 = c_bf16, q.m = m, q.n = n, q.k = k;
    q.lda = lda, q.ldb = ldb, q.ldc = ldc, q.alpha = alpha, q.beta = beta;
    tdm_dnnl_entry own, *e = tdm_dnnl_get(&cache, &q, sizeof q, make_gemm, &own, &st);
    if (e && !e->fallback) {
        st = run_gemm(e, a, b, c);
        snprintf(last_impl, sizeof last_impl, "%s", e->impl);
    }
    bool fallback = e && e->fallback;
    tdm_dnnl_done(&cache, e, &own);
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
