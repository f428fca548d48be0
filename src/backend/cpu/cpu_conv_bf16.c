/* bf16 convolution through oneDNN's convolution primitives (cpu_conv_bf16.h says what it
 * computes and when it answers "not here").
 *
 * A forward, backward-data or backward-weights primitive is made per geometry and output dtype
 * and cached (cpu_dnnl.h), with the memory layouts oneDNN chooses for it: its fast bf16 kernels
 * (jit_bf16:avx512_core_bf16 and its 1x1 twin) read and write blocked layouts, not NCHW, and on
 * plain NCHW it falls back to an im2col GEMM at half their speed (bench/RESULTS.md, "the bf16
 * convolution"). So each call reorders its two inputs into the chosen layouts and its output
 * back, with reorder primitives cached in the same entry, as PyTorch's CPU autocast does for
 * NCHW tensors; the blocked copies live in the device's caching allocator for the call. */
#include "backend/cpu/cpu_conv_bf16.h"

#include <stdio.h>
#include <string.h>

#include "backend/conv_geom.h"
#include "backend/cpu/cpu_dnnl.h"

static _Thread_local char last_impl[96];

const char *tdm_cpu_conv2d_bf16_impl(void) {
    return last_impl;
}

#ifdef TANDEM_GEMM_ONEDNN
#include <oneapi/dnnl/dnnl_debug.h>

enum { FWD, BWD_DATA, BWD_WEIGHTS };

/* A primitive's key. Its two inputs and its output, in the order run() takes them:
 *   FWD          x (src), w (weights)      -> y (dst), with b
 *   BWD_DATA     gy (diff_dst), w          -> gx (diff_src)
 *   BWD_WEIGHTS  x (src), gy (diff_dst)    -> gw (diff_weights), with gb */
typedef struct {
    int kind;
    int out_dt, bias_dt; /* dnnl_data_type_t of the output and of b or gb (undef: none) */
    conv_geom g;
} conv_key;
_Static_assert(sizeof(conv_key) <= TDM_DNNL_KEY_BYTES, "conv_key fits a cache key");

static tdm_dnnl_cache cache = TDM_DNNL_CACHE_INIT;

/* x's, w's and y's descriptors (and b's), NCHW and OIHW (GOIHW with groups), or oneDNN's
 * choice (format any) for a primitive to pick its layouts; each in the dtype key q gives it. */
static dnnl_status_t conv_mds(const conv_key *q, bool any, dnnl_memory_desc_t *x,
                              dnnl_memory_desc_t *w, dnnl_memory_desc_t *y, dnnl_memory_desc_t *b) {
    const conv_geom *g = &q->g;
    dnnl_data_type_t xt = q->kind == BWD_DATA ? q->out_dt : dnnl_bf16;
    dnnl_data_type_t wt = q->kind == BWD_WEIGHTS ? q->out_dt : dnnl_bf16;
    dnnl_data_type_t yt = q->kind == FWD ? q->out_dt : dnnl_bf16;
    dnnl_dims_t xd = {g->n, g->cin, g->h, g->w}, yd = {g->n, g->cout, g->ho, g->wo};
    dnnl_dims_t wd = {g->groups, g->cout_g, g->cin_g, g->kh, g->kw}, bd = {g->cout};
    bool grouped = g->groups > 1;
    dnnl_status_t st =
        dnnl_memory_desc_init_by_tag(x, 4, xd, xt, any ? dnnl_format_tag_any : dnnl_nchw);
    if (st == dnnl_success)
        st = dnnl_memory_desc_init_by_tag(w, grouped ? 5 : 4, grouped ? wd : wd + 1, wt,
                                          any       ? dnnl_format_tag_any
                                          : grouped ? dnnl_goihw
                                                    : dnnl_oihw);
    if (st == dnnl_success)
        st = dnnl_memory_desc_init_by_tag(y, 4, yd, yt, any ? dnnl_format_tag_any : dnnl_nchw);
    if (st == dnnl_success && q->bias_dt != dnnl_data_type_undef)
        st = dnnl_memory_desc_init_by_tag(b, 1, bd, q->bias_dt, dnnl_a);
    return st;
}

/* The primitive descriptor of q (fwd: its forward's, the hint a backward one needs). The
 * right padding is what the output size leaves: negative where a last row or column of x is
 * reached by no window, which oneDNN takes (test_kernels_lowp's first case). */
static dnnl_status_t conv_pd(const conv_key *q, dnnl_engine_t engine, dnnl_primitive_desc_t fwd,
                             dnnl_primitive_desc_t *pd) {
    const conv_geom *g = &q->g;
    int64_t rh = (g->ho - 1) * g->sh + (g->kh - 1) * g->dh + 1 - g->h - g->ph;
    int64_t rw = (g->wo - 1) * g->sw + (g->kw - 1) * g->dw + 1 - g->w - g->pw;
    dnnl_dims_t s = {g->sh, g->sw}, d = {g->dh - 1, g->dw - 1}, l = {g->ph, g->pw}, r = {rh, rw};
    conv_key fq = *q;
    if (!fwd) fq.kind = FWD, fq.out_dt = dnnl_bf16; /* the hint: a bf16 forward */
    const conv_key *k = fwd ? q : &fq;
    dnnl_memory_desc_t x, w, y, b;
    dnnl_status_t st = conv_mds(k, true, &x, &w, &y, &b);
    const dnnl_memory_desc_t *bp = k->bias_dt != dnnl_data_type_undef ? &b : NULL;
    dnnl_convolution_desc_t cd;
    if (st == dnnl_success && k->kind == FWD)
        st = dnnl_dilated_convolution_forward_desc_init(
            &cd, dnnl_forward_training, dnnl_convolution_direct, &x, &w, bp, &y, s, d, l, r);
    else if (st == dnnl_success && k->kind == BWD_DATA)
        st = dnnl_dilated_convolution_backward_data_desc_init(&cd, dnnl_convolution_direct, &x, &w,
                                                              &y, s, d, l, r);
    else if (st == dnnl_success)
        st = dnnl_dilated_convolution_backward_weights_desc_init(&cd, dnnl_convolution_direct, &x,
                                                                 &w, bp, &y, s, d, l, r);
    if (st == dnnl_success) st = dnnl_primitive_desc_create(pd, &cd, NULL, engine, fwd);
    return st;
}

/* The layout the primitive chose for run()'s operand i (0, 1: inputs, 2: output). */
static const dnnl_memory_desc_t *chosen(const_dnnl_primitive_desc_t pd, int kind, int i) {
    static const dnnl_query_t q[3][3] = {
        {dnnl_query_src_md, dnnl_query_weights_md, dnnl_query_dst_md},
        {dnnl_query_diff_dst_md, dnnl_query_weights_md, dnnl_query_diff_src_md},
        {dnnl_query_src_md, dnnl_query_diff_dst_md, dnnl_query_diff_weights_md}};
    return dnnl_primitive_desc_query_md(pd, q[kind][i], 0);
}

/* run()'s three operands' plain descriptors, in its order (see conv_key). */
static dnnl_status_t plain_mds(const conv_key *q, dnnl_memory_desc_t *md, dnnl_memory_desc_t *b) {
    dnnl_memory_desc_t x, w, y;
    dnnl_status_t st = conv_mds(q, false, &x, &w, &y, b);
    md[0] = q->kind == BWD_DATA ? y : x;
    md[1] = q->kind == BWD_WEIGHTS ? y : w;
    md[2] = q->kind == FWD ? y : q->kind == BWD_DATA ? x : w;
    return st;
}

/* A reorder primitive from one layout to another in *p, or none where they are the same. */
static dnnl_status_t reorder(dnnl_engine_t engine, const dnnl_memory_desc_t *from,
                             const dnnl_memory_desc_t *to, dnnl_primitive_t *p) {
    if (dnnl_memory_desc_equal(from, to)) return dnnl_success;
    dnnl_primitive_desc_t pd;
    dnnl_status_t st = dnnl_reorder_primitive_desc_create(&pd, from, engine, to, engine, NULL);
    if (st != dnnl_success) return st;
    st = dnnl_primitive_create(p, pd);
    dnnl_primitive_desc_destroy(pd);
    return st;
}

/* e: prim[0] the convolution, prim[1], prim[2] the inputs' reorders into md[0], md[1] (its
 * layouts), prim[3] the output's from md[2]; or e->fallback. */
static dnnl_status_t make_conv(tdm_dnnl_entry *e) {
    conv_key q;
    memcpy(&q, e->key, sizeof q);
    e->fallback = !tdm_dnnl_native();
    if (e->fallback) return dnnl_success;
    dnnl_status_t st;
    dnnl_engine_t engine = tdm_dnnl_engine(&st);
    dnnl_primitive_desc_t fwd = NULL, pd = NULL;
    if (st == dnnl_success && q.kind != FWD) st = conv_pd(&q, engine, NULL, &fwd);
    if (st == dnnl_success) st = conv_pd(&q, engine, fwd, &pd);
    st = tdm_dnnl_take(e, st, pd);
    if (st == dnnl_success && !e->fallback) {
        dnnl_memory_desc_t plain[3], b;
        for (int i = 0; i < 3; i++) e->md[i] = *chosen(pd, q.kind, i);
        st = plain_mds(&q, plain, &b);
        if (st == dnnl_success) st = reorder(engine, &plain[0], &e->md[0], &e->prim[1]);
        if (st == dnnl_success) st = reorder(engine, &plain[1], &e->md[1], &e->prim[2]);
        if (st == dnnl_success) st = reorder(engine, &e->md[2], &plain[2], &e->prim[3]);
    }
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (fwd) dnnl_primitive_desc_destroy(fwd);
    return st;
}

/* Memory for operand i: the caller's data in its plain layout (*user), and where the primitive
 * reads or writes it (*mem: the same, or a copy in the chosen layout in *buf). */
static dnnl_status_t operand(const tdm_dnnl_entry *e, int i, const dnnl_memory_desc_t *plain,
                             void *data, tdm_device dev, dnnl_memory_t *user, dnnl_memory_t *mem,
                             tdm_storage **buf) {
    dnnl_status_t st;
    dnnl_engine_t engine = tdm_dnnl_engine(&st);
    if (st == dnnl_success) st = dnnl_memory_create(user, plain, engine, data);
    if (st != dnnl_success || !e->prim[i == 2 ? 3 : 1 + i]) {
        *mem = *user;
        return st;
    }
    size_t bytes = dnnl_memory_desc_get_size(&e->md[i]);
    if (!(*buf = tdm_storage_new(bytes ? bytes : 1, dev))) return dnnl_out_of_memory;
    return dnnl_memory_create(mem, &e->md[i], engine, (*buf)->data);
}

static dnnl_status_t reorder_run(dnnl_primitive_t p, dnnl_memory_t from, dnnl_memory_t to) {
    dnnl_exec_arg_t args[] = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
    return tdm_dnnl_run(p, 2, args);
}

/* Runs e on a, b -> c (and the bias or its gradient), the caller's plain tensors. */
static dnnl_status_t run(const tdm_dnnl_entry *e, const conv_key *q, const void *a, const void *b,
                         void *c, void *bias, tdm_device dev) {
    static const int arg[3][4] = {
        {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST, DNNL_ARG_BIAS},
        {DNNL_ARG_DIFF_DST, DNNL_ARG_WEIGHTS, DNNL_ARG_DIFF_SRC, 0},
        {DNNL_ARG_SRC, DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_WEIGHTS, DNNL_ARG_DIFF_BIAS}};
    dnnl_memory_desc_t plain[3], bmd;
    dnnl_memory_t user[4] = {0}, mem[3] = {0};
    tdm_storage *buf[3] = {0};
    void *data[3] = {(void *)(uintptr_t)a, (void *)(uintptr_t)b, c}; /* oneDNN reads a, b */
    dnnl_status_t st;
    dnnl_engine_t engine = tdm_dnnl_engine(&st);
    if (st == dnnl_success) st = plain_mds(q, plain, &bmd);
    for (int i = 0; i < 3 && st == dnnl_success; i++)
        st = operand(e, i, &plain[i], data[i], dev, &user[i], &mem[i], &buf[i]);
    for (int i = 0; i < 2 && st == dnnl_success; i++)
        if (mem[i] != user[i]) st = reorder_run(e->prim[1 + i], user[i], mem[i]);
    bool with_bias = bias && q->bias_dt != dnnl_data_type_undef;
    if (st == dnnl_success && with_bias) st = dnnl_memory_create(&user[3], &bmd, engine, bias);
    if (st == dnnl_success) {
        dnnl_exec_arg_t args[4] = {{arg[q->kind][0], mem[0]},
                                   {arg[q->kind][1], mem[1]},
                                   {arg[q->kind][2], mem[2]},
                                   {arg[q->kind][3], user[3]}};
        st = tdm_dnnl_run(e->prim[0], with_bias ? 4 : 3, args);
    }
    if (st == dnnl_success && mem[2] != user[2]) st = reorder_run(e->prim[3], mem[2], user[2]);
    for (int i = 0; i < 3; i++) {
        if (mem[i] && mem[i] != user[i]) dnnl_memory_destroy(mem[i]);
        if (buf[i]) tdm_storage_release(buf[i]);
    }
    for (int i = 0; i < 4; i++)
        if (user[i]) dnnl_memory_destroy(user[i]);
    return st;
}

/* oneDNN's dtype of an output or bias tensor it takes (bf16, f32; undef for NULL), or -1. */
static int out_type(const tdm_tensor *t) {
    if (!t) return dnnl_data_type_undef;
    if (!tdm_is_contiguous(t)) return -1;
    return t->dtype == TDM_BF16 ? dnnl_bf16 : t->dtype == TDM_F32 ? dnnl_f32 : -1;
}

static bool bf16_input(const tdm_tensor *t) {
    return t && t->dtype == TDM_BF16 && tdm_is_contiguous(t);
}

/* The error of oneDNN's status st for the primitive of q. */
static int conv_error(const conv_key *q, dnnl_status_t st) {
    static const char *const what[] = {"forward", "backward data", "backward weights"};
    const conv_geom *g = &q->g;
    if (st == dnnl_out_of_memory)
        return tdm_raise(TDM_ERR_NOMEM, "conv2d bf16: no memory for the blocked copies");
    return tdm_raise(TDM_ERR_STATE,
                     "conv2d bf16: oneDNN's %s convolution (x [%lld, %lld, %lld, %lld], "
                     "w [%lld, %lld, %lld, %lld]): %s",
                     what[q->kind], (long long)g->n, (long long)g->cin, (long long)g->h,
                     (long long)g->w, (long long)g->cout, (long long)g->cin_g, (long long)g->kh,
                     (long long)g->kw, dnnl_status2str(st));
}

/* q's entry, pinned (tdm_dnnl_done), or NULL: *rc NOT_HERE (oneDNN has no fast kernel for it:
 * no bf16 instructions, or only its reference loops) or an error. */
static tdm_dnnl_entry *conv_entry(const conv_key *q, tdm_dnnl_entry *own, int *rc) {
    dnnl_status_t st;
    *rc = TDM_CPU_CONV_BF16_NOT_HERE;
    if (!tdm_dnnl_native() || !tdm_dnnl_engine(&st)) return NULL;
    tdm_dnnl_entry *e = tdm_dnnl_get(&cache, q, sizeof *q, make_conv, own, &st);
    if (!e) *rc = conv_error(q, st);
    if (!e || !e->fallback) return e;
    tdm_dnnl_done(&cache, e, own);
    return NULL;
}

/* Runs the primitive of q on a, b -> c (bias: b or gb), or answers NOT_HERE. */
static int conv_call(const conv_key *q, const void *a, const void *b, void *c, void *bias,
                     tdm_device dev) {
    tdm_dnnl_entry own;
    int rc;
    tdm_dnnl_entry *e = conv_entry(q, &own, &rc);
    if (!e) return rc;
    dnnl_status_t st = run(e, q, a, b, c, bias, dev);
    snprintf(last_impl, sizeof last_impl, "%s", e->impl);
    tdm_dnnl_done(&cache, e, &own);
    return st == dnnl_success ? TDM_OK : conv_error(q, st);
}

static conv_key key_of(int kind, const tdm_tensor *x, const tdm_tensor *w, int64_t ho, int64_t wo,
                       const tdm_conv2d_args *args, int out_dt, int bias_dt) {
    conv_key q;
    memset(&q, 0, sizeof q); /* padding too: keys compare byte for byte */
    q.kind = kind, q.out_dt = out_dt, q.bias_dt = bias_dt;
    q.g = tdm_conv_geom(x, w, ho, wo, args);
    return q;
}
#endif

int tdm_cpu_conv2d_bf16(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w,
                        const tdm_tensor *b, const tdm_conv2d_args *args) {
    last_impl[0] = 0;
#ifdef TANDEM_GEMM_ONEDNN
    int yt = out_type(y), bt = out_type(b);
    if (!bf16_input(x) || !bf16_input(w) || yt < 0 || yt == dnnl_data_type_undef || bt < 0)
        return TDM_CPU_CONV_BF16_NOT_HERE;
    if (tdm_numel(y) == 0 || tdm_numel(x) == 0) return TDM_CPU_CONV_BF16_NOT_HERE;
    conv_key q = key_of(FWD, x, w, y->shape[2], y->shape[3], args, yt, bt);
    return conv_call(&q, tdm_data_ptr(x), tdm_data_ptr(w), tdm_data_ptr(y),
                     b ? tdm_data_ptr(b) : NULL, x->device);
#else
    (void)y, (void)x, (void)w, (void)b, (void)args;
    return TDM_CPU_CONV_BF16_NOT_HERE;
#endif
}

int tdm_cpu_conv2d_backward_bf16(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                 const tdm_tensor *gy, const tdm_tensor *x, const tdm_tensor *w,
                                 const tdm_conv2d_args *args) {
    last_impl[0] = 0;
#ifdef TANDEM_GEMM_ONEDNN
    int xt = out_type(gx), wt = out_type(gw), bt = out_type(gb);
    if (!bf16_input(gy) || !bf16_input(x) || !bf16_input(w) || xt < 0 || wt < 0 || bt < 0 ||
        (gb && !gw) || tdm_numel(gy) == 0 || tdm_numel(x) == 0)
        return TDM_CPU_CONV_BF16_NOT_HERE;
    /* both primitives made (or found) before either writes: NOT_HERE leaves nothing written */
    conv_key qd =
        key_of(BWD_DATA, x, w, gy->shape[2], gy->shape[3], args, xt, dnnl_data_type_undef);
    conv_key qw = key_of(BWD_WEIGHTS, x, w, gy->shape[2], gy->shape[3], args, wt, bt);
    for (int k = 0; k < 2; k++) {
        tdm_dnnl_entry own, *e;
        int rc;
        if ((k ? gw : gx) && !(e = conv_entry(k ? &qw : &qd, &own, &rc))) return rc;
        if (k ? gw : gx) tdm_dnnl_done(&cache, e, &own);
    }
    int rc =
        gx ? conv_call(&qd, tdm_data_ptr(gy), tdm_data_ptr(w), tdm_data_ptr(gx), NULL, x->device)
           : TDM_OK;
    if (!rc && gw)
        rc = conv_call(&qw, tdm_data_ptr(x), tdm_data_ptr(gy), tdm_data_ptr(gw),
                       gb ? tdm_data_ptr(gb) : NULL, x->device);
    return rc;
#else
    (void)gx, (void)gw, (void)gb, (void)gy, (void)x, (void)w, (void)args;
    return TDM_CPU_CONV_BF16_NOT_HERE;
#endif
}
