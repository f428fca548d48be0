/* Tensors: creation, views sharing storage, host transfer, RNG, scopes and the caching
 * allocator, and the errors bad arguments get. */
#include "check.h"
#include "core/core.h"
#include "backend/backend.h"

#include <pthread.h>

static void test_creation(void) {
    tdm_scope_begin();
    tdm_tensor *z = tdm_zeros(TDM_SHAPE(2, 3), TDM_F32, tdm_cpu(0));
    tdm_tensor *f = tdm_full(TDM_SHAPE(4), 2.5f, TDM_F32, tdm_cpu(0));
    tdm_tensor *r = tdm_arange(0, 5, 1, TDM_I64, tdm_cpu(0));
    tdm_tensor *rf = tdm_arange(1, 0, -0.25, TDM_F32, tdm_cpu(0));
    CHECK(z && z->ndim == 2 && tdm_numel(z) == 6 && tdm_is_contiguous(z), "zeros shape");
    float zf[6] = {0}, ff[4] = {2.5f, 2.5f, 2.5f, 2.5f}, rff[4] = {1, 0.75f, 0.5f, 0.25f};
    check_tensor_close(z, zf, 0, 0, "zeros");
    check_tensor_close(f, ff, 0, 0, "full");
    check_tensor_close(rf, rff, 0, 0, "arange negative step");
    int64_t rv[5];
    CHECK(tdm_to_host(r, rv, sizeof rv) == 0 && rv[0] == 0 && rv[4] == 4 && r->dtype == TDM_I64,
          "arange i64");
    CHECK(tdm_item(tdm_slice(r, 0, 3, 4, 1)) == 3.0f, "item of a slice");
    float host[6] = {1, 2, 3, 4, 5, 6};
    tdm_tensor *h = tdm_from_data(TDM_SHAPE(3, 2), TDM_F32, tdm_cpu(0), host);
    check_tensor_close(h, host, 0, 0, "from_data");
    tdm_tensor *i32 = tdm_cast(h, TDM_I32);
    int32_t iv[6];
    tdm_to_host(i32, iv, sizeof iv);
    CHECK(iv[5] == 6 && i32->dtype == TDM_I32, "cast to i32");
    tdm_scope_end();
}

static void test_views(void) {
    tdm_scope_begin();
    float v[24];
    for (int i = 0; i < 24; i++) v[i] = (float)i;
    tdm_tensor *x = tdm_from_data(TDM_SHAPE(2, 3, 4), TDM_F32, tdm_cpu(0), v);
    tdm_tensor *t = tdm_transpose(x, 0, 2); /* [4, 3, 2] */
    CHECK(t->storage == x->storage && !tdm_is_contiguous(t), "transpose is a view");
    float tv[24];
    tdm_to_host(t, tv, sizeof tv);
    CHECK(tv[1] == 12 && tv[2] == 4 && tv[6] == 1, "transposed element order (%g %g %g)", tv[1],
          tv[2], tv[6]);
    int perm[3] = {1, 2, 0};
    tdm_tensor *p = tdm_permute(x, perm); /* [3, 4, 2] */
    CHECK(p->shape[0] == 3 && p->shape[1] == 4 && p->shape[2] == 2, "permute shape");
    float pv[24];
    tdm_to_host(p, pv, sizeof pv);
    CHECK(pv[1] == 12 && pv[2] == 1, "permute order");
    tdm_tensor *r = tdm_reshape(x, TDM_SHAPE(6, -1));
    CHECK(r && r->shape[1] == 4 && r->storage == x->storage, "reshape is a view");
    /* a transposed tensor cannot be viewed flat: reshape copies */
    tdm_tensor *rt = tdm_reshape(t, TDM_SHAPE(24));
    float rtv[24];
    tdm_to_host(rt, rtv, sizeof rtv);
    CHECK(rt->storage != x->storage && memcmp(rtv, tv, sizeof tv) == 0, "reshape of transpose");
    /* a slice of the middle dim can be merged with the last without a copy */
    tdm_tensor *s = tdm_slice(x, 2, 1, 3, 1); /* [2, 3, 2] */
    tdm_tensor *sv = tdm_reshape(tdm_slice(x, 0, 1, 2, 1), TDM_SHAPE(12));
    CHECK(sv && sv->storage == x->storage && sv->offset == 12, "reshape of an outer slice views");
    float svv[8];
    tdm_to_host(tdm_slice(s, 1, 0, 3, 2), svv, sizeof svv);
    CHECK(svv[0] == 1 && svv[1] == 2 && svv[2] == 9 && svv[3] == 10, "strided slice");
    tdm_tensor *neg = tdm_slice(x, 1, -2, 100, 1);
    CHECK(neg->shape[1] == 2 && neg->offset == 4, "negative start, clamped end");
    tdm_tensor *e = tdm_expand(tdm_slice(x, 1, 0, 1, 1), TDM_SHAPE(5, 2, 3, 4));
    CHECK(e && e->strides[0] == 0 && e->strides[2] == 0 && e->shape[2] == 3, "expand strides");
    tdm_tensor *u = tdm_unsqueeze(x, 1);
    CHECK(u->ndim == 4 && u->shape[1] == 1 && tdm_squeeze(u, 1)->ndim == 3, "unsqueeze/squeeze");
    tdm_tensor *fl = tdm_flatten(x, 1, -1);
    CHECK(fl->ndim == 2 && fl->shape[1] == 12, "flatten");
    tdm_tensor *parts[3];
    CHECK(tdm_split(x, (int64_t[]){1, 2, 1}, 3, 2, parts) == 0 && parts[1]->shape[2] == 2, "split");
    tdm_tensor *cat = tdm_concat(parts, 3, 2);
    float cv[24];
    tdm_to_host(cat, cv, sizeof cv);
    CHECK(memcmp(cv, v, sizeof v) == 0, "concat of split gives the input back");
    /* writing through a view changes the base */
    tdm_fill_(tdm_slice(x, 0, 0, 1, 1), -1);
    float xv[24];
    tdm_to_host(x, xv, sizeof xv);
    CHECK(xv[0] == -1 && xv[11] == -1 && xv[12] == 12, "fill through a view");
    tdm_scope_end();
}

static void test_errors(void) {
    tdm_scope_begin();
    tdm_tensor *x = tdm_zeros(TDM_SHAPE(2, 3), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(tdm_reshape(x, TDM_SHAPE(4, 2)) == NULL, "cannot view [2, 3]");
    CHECK_ERROR(tdm_transpose(x, 0, 2) == NULL, "dim 2 out of range");
    CHECK_ERROR(tdm_expand(x, TDM_SHAPE(2, 4)) == NULL, "cannot expand [2, 3] to [2, 4]");
    CHECK_ERROR(tdm_concat((tdm_tensor *[]){x, tdm_zeros(TDM_SHAPE(3, 3), TDM_F32, tdm_cpu(0))}, 2,
                           1) == NULL,
                "tensor 1 has shape [3, 3]");
    CHECK_ERROR(isnan(tdm_item(x)), "more than one element");
    float small[2];
    CHECK_ERROR(tdm_to_host(x, small, sizeof small) != 0, "buffer of 8 bytes");
    CHECK_ERROR(tdm_zeros(TDM_SHAPE(2, -3), TDM_F32, tdm_cpu(0)) == NULL, "invalid shape [2, -3]");
    tdm_device d;
    CHECK_ERROR(tdm_device_parse("tpu:0", &d) != 0, "unknown device \"tpu:0\"");
    int gpus = tdm_device_count(TDM_CUDA); /* a GPU beyond the last one is refused */
    CHECK_ERROR(tdm_empty(TDM_SHAPE(2), TDM_F32, (tdm_device){TDM_CUDA, gpus}) == NULL,
                gpus ? "GPU" : "CUDA");
    CHECK(tdm_device_parse("cpu:3", &d) == 0 && d.index == 3 && d.type == TDM_CPU, "parse cpu:3");
    CHECK(tdm_reshape(NULL, TDM_SHAPE(1)) == NULL, "NULL input gives NULL");
    CHECK_ERROR((tdm_tensor_free(x), true), "belongs to a scope");
    tdm_scope_end();
}

static void test_rng(void) {
    tdm_scope_begin();
    tdm_rng a = tdm_rng_make(7), b = tdm_rng_make(7);
    tdm_tensor *x = tdm_randn(TDM_SHAPE(1000), 0, 1, tdm_cpu(0), &a);
    tdm_tensor *y = tdm_randn(TDM_SHAPE(1000), 0, 1, tdm_cpu(0), &b);
    tdm_tensor *z = tdm_randn(TDM_SHAPE(1000), 0, 1, tdm_cpu(0), &a);
    static float xv[1000], yv[1000], zv[1000];
    tdm_to_host(x, xv, sizeof xv);
    tdm_to_host(y, yv, sizeof yv);
    tdm_to_host(z, zv, sizeof zv);
    CHECK(memcmp(xv, yv, sizeof xv) == 0, "same seed, same draws");
    CHECK(memcmp(xv, zv, sizeof xv) != 0, "the offset advances between draws");
    double m = 0, v = 0;
    for (int i = 0; i < 1000; i++) m += xv[i];
    m /= 1000;
    for (int i = 0; i < 1000; i++) v += (xv[i] - m) * (xv[i] - m);
    v /= 999;
    CHECK(fabs(m) < 0.1 && fabs(v - 1) < 0.15, "normal moments mean %g var %g", m, v);
    /* a draw into a strided view takes element i's value from counter i, whatever the layout */
    tdm_rng c = tdm_rng_make(9), d = tdm_rng_make(9);
    tdm_tensor *u = tdm_rand(TDM_SHAPE(6), -1, 1, tdm_cpu(0), &c);
    tdm_tensor *big = tdm_zeros(TDM_SHAPE(6, 2), TDM_F32, tdm_cpu(0));
    tdm_uniform_(tdm_slice(big, 1, 0, 1, 1), -1, 1, &d);
    float uv[6], bv[12];
    tdm_to_host(u, uv, sizeof uv);
    tdm_to_host(big, bv, sizeof bv);
    bool same = true;
    for (int i = 0; i < 6; i++) same = same && uv[i] == bv[2 * i] && bv[2 * i + 1] == 0;
    CHECK(same, "uniform into a strided view");
    tdm_scope_end();
}

/* A steady-state loop of scopes allocates nothing from the system after the first round. */
static void test_allocator(void) {
    tdm_device dev = tdm_cpu(0);
    uint64_t before = 0;
    for (int it = 0; it < 5; it++) {
        if (it == 2) before = tdm_alloc_stats_get(dev).sys_allocs;
        tdm_scope_begin();
        for (int j = 0; j < 50; j++) {
            tdm_tensor *a = tdm_ones(TDM_SHAPE(64, 100 + j), TDM_F32, dev);
            tdm_tensor *b = tdm_transpose(a, 0, 1);
            tdm_contiguous(b);
        }
        tdm_scope_end();
    }
    tdm_alloc_stats st = tdm_alloc_stats_get(dev);
    CHECK(st.sys_allocs == before, "system allocations in steady state: %llu -> %llu",
          (unsigned long long)before, (unsigned long long)st.sys_allocs);
    CHECK(st.bytes_cached > 0, "blocks are cached after the scope ends");
    /* caller-owned tensors survive scopes; views keep storage alive after the base is freed */
    tdm_tensor *keep = tdm_ones(TDM_SHAPE(3), TDM_F32, dev);
    tdm_scope_begin();
    tdm_tensor *view = tdm_slice(keep, 0, 1, 3, 1);
    tdm_tensor *kept = tdm_scope_keep(tdm_mul_scalar(view, 2));
    tdm_scope_end();
    tdm_tensor_free(keep);
    float kv[2];
    CHECK(kept && tdm_to_host(kept, kv, sizeof kv) == 0 && kv[0] == 2 && kv[1] == 2,
          "scope_keep survives the scope");
    tdm_tensor_free(kept);
}

static void *denormal_probe(void *arg) {
    volatile float tiny = 1e-38f; /* below FLT_MIN: a product with it is denormal */
    *(float *)arg = tiny * 0.5f;
    return NULL;
}

/* tdm_set_flush_denormal: the calling thread's arithmetic, and threads it creates later */
static void test_flush_denormal(void) {
    bool was = tdm_flush_denormal();
    float here, there;
    pthread_t th;
    if (!tdm_set_flush_denormal(true)) {
        CHECK(!tdm_flush_denormal(), "an unsupported flush reports itself off");
        return;
    }
    CHECK(tdm_flush_denormal(), "flush on");
    denormal_probe(&here);
    pthread_create(&th, NULL, denormal_probe, &there);
    pthread_join(th, NULL);
    CHECK(here == 0.0f && there == 0.0f, "denormal results flush to 0: %g here, %g in a new thread",
          here, there);
    tdm_set_flush_denormal(false);
    denormal_probe(&here);
    CHECK(!tdm_flush_denormal() && here > 0.0f, "flush off: 1e-38 * 0.5 = %g", here);
    tdm_set_flush_denormal(was);
}

/* The CPU table fills every kernel of backend.h; a table with an empty entry is named. */
static void test_backend_table(void) {
    CHECK(tdm_backend_check(&tdm_cpu_backend, false) == TDM_OK, "cpu table: %s", tdm_last_error());
    tdm_backend holey = tdm_cpu_backend;
    holey.layer_norm_backward = NULL;
    CHECK_ERROR(tdm_backend_check(&holey, false) != TDM_OK, "backend cpu: no kernel for "
                                                            "layer_norm_backward");
    /* the CPU is host memory: it has no upload entries, and a check that wants them says so */
    CHECK_ERROR(tdm_backend_check(&tdm_cpu_backend, true) != TDM_OK, "pinned_alloc");
}

int main(void) {
    test_flush_denormal();
    test_backend_table();
    test_creation();
    test_views();
    test_errors();
    test_rng();
    test_allocator();
    return check_summary();
}
