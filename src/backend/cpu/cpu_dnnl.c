/* oneDNN's engine and the primitive caches (cpu_dnnl.h says how they behave). */
#include "backend/cpu/cpu_dnnl.h"

#ifdef TANDEM_GEMM_ONEDNN
#include <stdio.h>
#include <string.h>

static struct {
    pthread_once_t once;
    dnnl_engine_t engine;
    dnnl_status_t status;
    bool native;
} eng = {.once = PTHREAD_ONCE_INIT};

static void make_engine(void) {
    eng.status = dnnl_engine_create(&eng.engine, dnnl_cpu, 0);
    /* the ISA values nest, each holding the bits of those below it */
    dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    eng.native = (isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16;
}

dnnl_engine_t tdm_dnnl_engine(dnnl_status_t *st) {
    pthread_once(&eng.once, make_engine);
    *st = eng.status;
    return eng.status == dnnl_success ? eng.engine : NULL;
}

bool tdm_dnnl_native(void) {
    pthread_once(&eng.once, make_engine);
    return eng.native;
}

static void drop(tdm_dnnl_entry *e) {
    for (int i = 0; i < TDM_DNNL_PRIMS; i++)
        if (e->prim[i]) dnnl_primitive_destroy(e->prim[i]);
    memset(e, 0, sizeof *e);
}

/* e made afresh for key: used on success, empty on failure. */
static dnnl_status_t make(tdm_dnnl_entry *e, const void *key, size_t len, tdm_dnnl_make_fn fn) {
    drop(e);
    memcpy(e->key, key, len);
    dnnl_status_t st = fn(e);
    if (st == dnnl_success)
        e->used = true;
    else
        drop(e);
    return st;
}

tdm_dnnl_entry *tdm_dnnl_get(tdm_dnnl_cache *c, const void *key, size_t len, tdm_dnnl_make_fn fn,
                             tdm_dnnl_entry *own, dnnl_status_t *st) {
    *st = dnnl_success;
    unsigned char k[TDM_DNNL_KEY_BYTES] = {0};
    memcpy(k, key, len < sizeof k ? len : sizeof k);
    pthread_mutex_lock(&c->lock);
    tdm_dnnl_entry *hit = NULL, *empty = NULL, *lru = NULL;
    for (int i = 0; i < TDM_DNNL_CACHE; i++) {
        tdm_dnnl_entry *e = &c->e[i];
        if (!e->used) {
            if (!empty) empty = e;
        } else if (!memcmp(e->key, k, sizeof k)) {
            if (e->users == 0) { /* a busy entry is not shared (cpu_dnnl.h) */
                hit = e;
                break;
            }
        } else if (e->users == 0 && (!lru || e->last_use < lru->last_use)) {
            lru = e;
        }
    }
    tdm_dnnl_entry *victim = empty ? empty : lru;
    /* made under the lock: a primitive is made once per key, and making one is rare */
    if (!hit && victim && (*st = make(victim, k, sizeof k, fn)) == dnnl_success) hit = victim;
    if (hit) {
        hit->users++;
        hit->last_use = ++c->clock;
    }
    pthread_mutex_unlock(&c->lock);
    if (hit || *st != dnnl_success) return hit;
    memset(own, 0, sizeof *own); /* every slot pinned */
    return (*st = make(own, k, sizeof k, fn)) == dnnl_success ? own : NULL;
}

void tdm_dnnl_done(tdm_dnnl_cache *c, tdm_dnnl_entry *e, tdm_dnnl_entry *own) {
    if (!e) return;
    if (e == own) {
        drop(own);
        return;
    }
    pthread_mutex_lock(&c->lock);
    e->users--;
    pthread_mutex_unlock(&c->lock);
}

int tdm_dnnl_cached(tdm_dnnl_cache *c) {
    int n = 0;
    pthread_mutex_lock(&c->lock);
    for (int i = 0; i < TDM_DNNL_CACHE; i++) n += c->e[i].used;
    pthread_mutex_unlock(&c->lock);
    return n;
}

void tdm_dnnl_clear(tdm_dnnl_cache *c) {
    pthread_mutex_lock(&c->lock);
    for (int i = 0; i < TDM_DNNL_CACHE; i++)
        if (c->e[i].used && c->e[i].users == 0) drop(&c->e[i]);
    pthread_mutex_unlock(&c->lock);
}

dnnl_status_t tdm_dnnl_run(dnnl_primitive_t p, int n, const dnnl_exec_arg_t *args) {
    dnnl_stream_t s = NULL;
    dnnl_status_t st = eng.status;
    if (st == dnnl_success) st = dnnl_stream_create(&s, eng.engine, dnnl_stream_default_flags);
    if (st == dnnl_success) st = dnnl_primitive_execute(p, s, n, args);
    if (st == dnnl_success) st = dnnl_stream_wait(s);
    if (s) dnnl_stream_destroy(s);
    return st;
}

/* The implementation's name of a primitive descriptor, or "?". */
static const char *impl_of(const_dnnl_primitive_desc_t pd) {
    const char *impl = NULL;
    if (dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, (void *)&impl) != dnnl_success ||
        !impl)
        return "?";
    return impl;
}

dnnl_status_t tdm_dnnl_take(tdm_dnnl_entry *e, dnnl_status_t st, const_dnnl_primitive_desc_t pd) {
    const char *impl = st == dnnl_success ? impl_of(pd) : "";
    if (st == dnnl_unimplemented || (st == dnnl_success && strncmp(impl, "ref", 3) == 0)) {
        e->fallback = true;
        return dnnl_success;
    }
    if (st != dnnl_success) return st;
    snprintf(e->impl, sizeof e->impl, "oneDNN %s", impl);
    return dnnl_primitive_create(&e->prim[0], pd);
}
#endif
