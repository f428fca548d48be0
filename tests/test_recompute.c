/* Recomputation (tdm_recompute, tdm_module_set_recompute, tdm_model_set_recompute) and the
 * memory figures that show what it saves (tdm_memory_stats_get).
 *
 * Recomputation must change nothing but memory and time: every case runs the same steps
 * with and without it and compares the losses, every gradient and the batch norms' running
 * statistics bit for bit (memcmp), on one device, under DataParallel (2 devices: replica
 * threads, synchronised batch norm) and under DDP over threads (gradient-ready hooks launch
 * the all-reduces). Dropout's masks are replayed; hooks fire once, after the last gradient. */
#include "backend/backend.h" /* tdm_cpu_gemm_set_threads */
#include "check.h"

/* ---- helpers ---------------------------------------------------------------------------- */

/* A host copy of t's values (the caller frees it). */
static float *host_copy(const tdm_tensor *t) {
    size_t n = sizeof(float) * (size_t)tdm_numel(t);
    float *p = malloc(n);
    if (p && tdm_to_host(t, p, n)) memset(p, 0xff, n);
    return p;
}

/* Whether n floats of a and b have the same bits. */
static bool same_bits(const float *a, const float *b, int64_t n) {
    return a && b && memcmp(a, b, sizeof(float) * (size_t)n) == 0;
}

/* Every buffer of m (running statistics, num_batches_tracked) as bytes, concatenated. */
static unsigned char *buffers_of(tdm_module *m, size_t *len) {
    tdm_bufferset *bs = tdm_module_buffers(m);
    size_t n = 0;
    for (int i = 0; bs && i < bs->n; i++)
        n += (size_t)tdm_numel(bs->buffers[i]) * tdm_dtype_size(bs->buffers[i]->dtype);
    unsigned char *p = malloc(n ? n : 1), *at = p;
    for (int i = 0; p && bs && i < bs->n; i++) {
        size_t k = (size_t)tdm_numel(bs->buffers[i]) * tdm_dtype_size(bs->buffers[i]->dtype);
        tdm_to_host(bs->buffers[i], at, k);
        at += k;
    }
    *len = n;
    return p;
}

/* What a run leaves to compare. */
typedef struct {
    float loss[2];
    float *grad, *weights; /* the flat buffers after the run */
    float *out;            /* a forward's output after the run, n_out values */
    int64_t n_out;
    unsigned char *buffers;
    size_t buffers_len;
    int64_t n, peak; /* parameters; peak bytes above what was allocated before the steps */
} run_result;

static void result_free(run_result *r) {
    free(r->out);
    free(r->grad);
    free(r->weights);
    free(r->buffers);
}

/* The two runs agree bit for bit. */
static void check_same(const run_result *a, const run_result *b, const char *what) {
    CHECK(memcmp(a->loss, b->loss, sizeof a->loss) == 0, "%s: losses %.9g %.9g vs %.9g %.9g", what,
          a->loss[0], a->loss[1], b->loss[0], b->loss[1]);
    CHECK(a->n == b->n && (!a->grad || same_bits(a->grad, b->grad, a->n)), "%s: gradients differ",
          what);
    CHECK(!a->weights || same_bits(a->weights, b->weights, a->n), "%s: weights differ", what);
    CHECK(a->n_out == b->n_out && (!a->out || same_bits(a->out, b->out, a->n_out)),
          "%s: outputs differ", what);
    CHECK(a->buffers_len == b->buffers_len &&
              (!a->buffers_len || memcmp(a->buffers, b->buffers, a->buffers_len) == 0),
          "%s: running statistics differ", what);
}

/* ---- the memory figures ----------------------------------------------------------------- */

static void test_memory_stats(void) {
    tdm_device d = tdm_cpu(5); /* a pool nothing else uses */
    tdm_memory_stats s0 = tdm_memory_stats_get(d);
    tdm_tensor *mib = tdm_empty(TDM_SHAPE(1 << 18), TDM_F32, d); /* 1 MiB: a size class */
    tdm_tensor *odd = tdm_empty(TDM_SHAPE(250), TDM_F32, d);     /* 1000 B: 4 granules */
    tdm_memory_stats s1 = tdm_memory_stats_get(d);
    CHECK(s1.allocated == s0.allocated + (1 << 20) + 1024, "allocated %lld -> %lld",
          (long long)s0.allocated, (long long)s1.allocated);
    CHECK(s1.peak_allocated == s1.allocated && s1.reserved >= s1.allocated,
          "peak %lld reserved %lld for %lld allocated", (long long)s1.peak_allocated,
          (long long)s1.reserved, (long long)s1.allocated);
    tdm_tensor_free(mib);
    tdm_tensor_free(odd);
    tdm_memory_stats s2 = tdm_memory_stats_get(d);
    CHECK(s2.allocated == s0.allocated && s2.peak_allocated == s1.allocated &&
              s2.reserved == s1.reserved,
          "after freeing: allocated %lld peak %lld reserved %lld (the blocks stay cached)",
          (long long)s2.allocated, (long long)s2.peak_allocated, (long long)s2.reserved);
    tdm_memory_reset_peak(d);
    tdm_memory_stats s3 = tdm_memory_stats_get(d);
    CHECK(s3.peak_allocated == s0.allocated, "peak after a reset %lld, allocated %lld",
          (long long)s3.peak_allocated, (long long)s0.allocated);
    tdm_memory_stats bad = tdm_memory_stats_get(tdm_cpu(TDM_MAX_DEVICES));
    CHECK(bad.allocated == 0 && bad.reserved == 0 && tdm_last_status() == TDM_ERR_DEVICE &&
              strstr(tdm_last_error(), "cpu:64"),
          "an out-of-range device: %s", tdm_last_error());
    tdm_clear_error();
}

/* ---- the GPT: its blocks recomputed ----------------------------------------------------- */

#define GB 4
#define GT 16
static const tdm_gpt_config gpt_cfg = {
    .layers = 3, .heads = 2, .channels = 32, .context = GT, .vocab = 64};

/* Tokens of batch s: inputs and next-token targets [GB, GT]. */
static void gpt_batch(int s, int64_t *idx, int64_t *tgt) {
    for (int i = 0; i < GB * GT; i++) {
        idx[i] = (i * 7 + s * 13 + i / 5) % gpt_cfg.vocab;
        tgt[i] = (idx[i] * 3 + 1) % gpt_cfg.vocab;
    }
}

/* A GPT from seed 7 (NULL and an error on failure; no CHECK: DDP's ranks call it too). */
static tdm_module *gpt_model(bool recompute) {
    tdm_rng r = tdm_rng_make(7);
    tdm_module *m = tdm_gpt_new(&gpt_cfg, tdm_cpu(0), &r);
    if (m && recompute && tdm_model_set_recompute(m, true)) {
        tdm_module_free(m);
        return NULL;
    }
    return m;
}

/* Two forward and backward passes (the gradients add up) on one device. */
static run_result gpt_steps(bool recompute) {
    run_result r = {0};
    tdm_module *m = gpt_model(recompute);
    CHECK(m != NULL, "gpt: %s", tdm_last_error());
    tdm_paramset *ps = tdm_module_parameters(m);
    int64_t idx[GB * GT], tgt[GB * GT];
    int64_t base = tdm_memory_stats_get(tdm_cpu(0)).allocated;
    tdm_memory_reset_peak(tdm_cpu(0));
    for (int s = 0; s < 2; s++) {
        gpt_batch(s, idx, tgt);
        tdm_scope_begin();
        tdm_tensor *loss = tdm_gpt_loss(tdm_gpt_forward(m, i64(TDM_SHAPE(GB, GT), idx)),
                                        i64(TDM_SHAPE(GB, GT), tgt));
        CHECK(loss && tdm_backward(loss) == TDM_OK, "gpt step %d: %s", s, tdm_last_error());
        r.loss[s] = tdm_item(loss);
        tdm_scope_end();
    }
    r.peak = tdm_memory_stats_get(tdm_cpu(0)).peak_allocated - base;
    r.n = ps->total;
    r.grad = host_copy(ps->flat_grad);
    tdm_module_free(m);
    return r;
}

static void test_gpt(void) {
    run_result plain = gpt_steps(false), rec = gpt_steps(true);
    check_same(&plain, &rec, "gpt, one device");
    /* the blocks' activations are gone: only their inputs stay between forward and backward */
    CHECK(rec.peak < plain.peak * 3 / 4, "activation peak %lld with recomputation, %lld without",
          (long long)rec.peak, (long long)plain.peak);
    result_free(&plain);
    result_free(&rec);
    tdm_module *mlp = tdm_model_new("mlp", tdm_cpu(0), NULL);
    CHECK_ERROR(tdm_model_set_recompute(mlp, true) != TDM_OK, "no units to recompute");
    tdm_module_free(mlp);
}

/* ---- dropout replayed --------------------------------------------------------------------- */

/* Linear, [Linear, ReLU, Dropout, Linear, Dropout] (recomputed when asked), Linear. */
static tdm_module *dropout_model(bool recompute) {
    tdm_rng r = tdm_rng_make(3);
    tdm_module *in[5] = {tdm_linear_new(8, 16, true, tdm_cpu(0), &r), tdm_relu_new(),
                         tdm_dropout_new(0.3f, &r), tdm_linear_new(16, 8, true, tdm_cpu(0), &r),
                         tdm_dropout_new(0.2f, &r)};
    tdm_module *block = tdm_sequential_new(5, in);
    tdm_module_set_recompute(block, recompute);
    tdm_module *out[3] = {tdm_linear_new(6, 8, true, tdm_cpu(0), &r), block,
                          tdm_linear_new(8, 3, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(3, out);
}

/* Two steps (new masks each), then a forward without gradients: the dropout generators must
 * have moved as without recomputation, so its output matches too (in weights). */
static run_result dropout_steps(bool recompute) {
    run_result r = {0};
    tdm_module *m = dropout_model(recompute);
    tdm_paramset *ps = tdm_module_parameters(m);
    float x[10 * 6];
    int64_t y[10];
    for (int s = 0; s < 2; s++) {
        for (int i = 0; i < 60; i++) x[i] = sinf((float)(i * (s + 1)));
        for (int i = 0; i < 10; i++) y[i] = (i + s) % 3;
        tdm_scope_begin();
        tdm_tensor *loss = tdm_cross_entropy(tdm_module_forward(m, f32(TDM_SHAPE(10, 6), x)),
                                             i64(TDM_SHAPE(10), y), NULL);
        CHECK(loss && tdm_backward(loss) == TDM_OK, "dropout step %d: %s", s, tdm_last_error());
        r.loss[s] = tdm_item(loss);
        tdm_scope_end();
    }
    tdm_scope_begin();
    bool prev = tdm_set_grad_enabled(false);
    r.out = host_copy(tdm_module_forward(m, f32(TDM_SHAPE(10, 6), x)));
    r.n_out = 10 * 3;
    tdm_set_grad_enabled(prev);
    tdm_scope_end();
    r.n = ps->total;
    r.grad = host_copy(ps->flat_grad);
    tdm_module_free(m);
    return r;
}

static void test_dropout(void) {
    run_result plain = dropout_steps(false), rec = dropout_steps(true);
    check_same(&plain, &rec, "dropout");
    result_free(&plain);
    result_free(&rec);
}

/* ---- the ResNet: its stages recomputed, batch norm in training mode ----------------------- */

#define RB 4

static tdm_module *drawn; /* freed by main */

/* A ResNet-18 with 5 classes and the CIFAR stem, as drawn from seed 11: a copy of one made
 * once (drawing 11 M weights takes longer than the steps). */
static tdm_module *resnet_model(bool recompute) {
    if (!drawn) {
        tdm_resnet_opts o = tdm_resnet_defaults(18);
        o.num_classes = 5;
        o.small_input = true;
        tdm_rng r = tdm_rng_make(11);
        drawn = tdm_resnet_new(&o, tdm_cpu(0), &r);
    }
    tdm_module *m = drawn ? tdm_module_clone(drawn, tdm_cpu(0)) : NULL;
    CHECK(m && (!recompute || tdm_model_set_recompute(m, true) == TDM_OK), "resnet: %s",
          tdm_last_error());
    return m;
}

static void resnet_batch(int s, float *x, int64_t *y) {
    for (int i = 0; i < RB * 3 * 8 * 8; i++) x[i] = cosf((float)(i % 97) * 0.3f + (float)s);
    for (int i = 0; i < RB; i++) y[i] = (i * 2 + s) % 5;
}

static run_result resnet_steps(bool recompute) {
    run_result r = {0};
    tdm_module *m = resnet_model(recompute);
    tdm_paramset *ps = tdm_module_parameters(m);
    float x[RB * 3 * 8 * 8];
    int64_t y[RB];
    for (int s = 0; s < 2; s++) {
        resnet_batch(s, x, y);
        tdm_scope_begin();
        tdm_tensor *out = tdm_module_forward(m, f32(TDM_SHAPE(RB, 3, 8, 8), x));
        tdm_tensor *loss = tdm_cross_entropy(out, i64(TDM_SHAPE(RB), y), NULL);
        CHECK(loss && tdm_backward(loss) == TDM_OK, "resnet step %d: %s", s, tdm_last_error());
        r.loss[s] = tdm_item(loss);
        tdm_scope_end();
    }
    r.n = ps->total;
    r.grad = host_copy(ps->flat_grad);
    r.buffers = buffers_of(m, &r.buffers_len);
    tdm_module_free(m);
    return r;
}

static void test_resnet(void) {
    run_result plain = resnet_steps(false), rec = resnet_steps(true);
    check_same(&plain, &rec, "resnet, one device");
    result_free(&plain);
    result_free(&rec);
}

/* ---- DataParallel: 2 replicas on their threads ------------------------------------------ */

static tdm_optim *make_sgd(tdm_paramset *ps, void *arg) {
    (void)arg;
    tdm_sgd_opts o = tdm_sgd_defaults(0.05f);
    o.momentum = 0.9f;
    return tdm_sgd_new(ps, &o);
}

static tdm_tensor *gpt_loss_fn(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    return tdm_gpt_loss(out, target);
}

static tdm_tensor *ce_loss_fn(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    return tdm_cross_entropy(out, target, NULL);
}

/* Two DataParallel steps over cpu:0 and cpu:1: the weights and buffers after them. */
static run_result dp_steps(bool gpt, bool recompute) {
    run_result r = {0};
    tdm_module *m = gpt ? gpt_model(recompute) : resnet_model(recompute);
    CHECK(m != NULL, "model: %s", tdm_last_error());
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    tdm_dp *dp = tdm_dp_new(m, devs, 2, make_sgd, NULL);
    CHECK(dp != NULL, "dp_new: %s", tdm_last_error());
    for (int s = 0; dp && s < 2; s++) {
        float x[RB * 3 * 8 * 8];
        int64_t idx[GB * GT], tgt[GB * GT];
        tdm_tensor *in, *target;
        if (gpt) {
            gpt_batch(s, idx, tgt);
            in = i64(TDM_SHAPE(GB, GT), idx);
            target = i64(TDM_SHAPE(GB, GT), tgt);
        } else {
            resnet_batch(s, x, tgt);
            in = f32(TDM_SHAPE(RB, 3, 8, 8), x);
            target = i64(TDM_SHAPE(RB), tgt);
        }
        int rc = tdm_dp_step(dp, in, target, gpt ? gpt_loss_fn : ce_loss_fn, NULL, &r.loss[s]);
        CHECK(rc == TDM_OK, "dp step %d: %s", s, tdm_last_error());
        tdm_tensor_free(in);
        tdm_tensor_free(target);
    }
    tdm_paramset *ps = tdm_module_parameters(m);
    r.n = ps->total;
    r.weights = host_copy(ps->flat);
    r.buffers = buffers_of(m, &r.buffers_len);
    tdm_dp_free(dp);
    tdm_module_free(m);
    return r;
}

static void test_data_parallel(void) {
    for (int gpt = 0; gpt < 2; gpt++) {
        run_result plain = dp_steps(gpt, false), rec = dp_steps(gpt, true);
        check_same(&plain, &rec, gpt ? "gpt, DataParallel" : "resnet, DataParallel");
        result_free(&plain);
        result_free(&rec);
    }
}

/* ---- DDP over threads: the all-reduces launched from gradient-ready hooks ---------------- */

typedef struct {
    bool recompute;
    float *grad[2]; /* each rank's averaged gradient */
    int64_t n;
} ddp_run;

static int ddp_rank(tdm_rank_ctx *ctx, void *arg) {
    ddp_run *run = arg;
    tdm_module *m = gpt_model(run->recompute);
    tdm_ddp *ddp = m ? tdm_ddp_new(m, ctx->group, NULL) : NULL;
    if (!ddp) {
        tdm_module_free(m);
        return tdm_last_status();
    }
    int64_t idx[GB * GT], tgt[GB * GT], half = GB / 2 * GT;
    gpt_batch(0, idx, tgt);
    tdm_scope_begin();
    tdm_tensor *x = i64(TDM_SHAPE(GB / 2, GT), idx + ctx->rank * half);
    tdm_tensor *y = i64(TDM_SHAPE(GB / 2, GT), tgt + ctx->rank * half);
    int rc = tdm_ddp_backward(ddp, tdm_gpt_loss(tdm_ddp_forward(ddp, x), y));
    tdm_scope_end();
    tdm_paramset *ps = tdm_module_parameters(m);
    if (ctx->rank == 0) run->n = ps->total;
    run->grad[ctx->rank] = host_copy(ps->flat_grad);
    tdm_ddp_free(ddp);
    tdm_module_free(m);
    return rc;
}

static void test_ddp(void) {
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    ddp_run plain = {false, {0}, 0}, rec = {true, {0}, 0};
    CHECK(tdm_spawn(2, devs, ddp_rank, &plain) == TDM_OK, "ddp: %s", tdm_last_error());
    CHECK(tdm_spawn(2, devs, ddp_rank, &rec) == TDM_OK, "ddp, recomputed: %s", tdm_last_error());
    for (int r = 0; r < 2; r++) {
        CHECK(same_bits(plain.grad[r], rec.grad[r], plain.n),
              "ddp rank %d: gradients differ with recomputation", r);
        free(plain.grad[r]);
        free(rec.grad[r]);
    }
}

/* ---- the function API: hooks, a parameter read inside and after, nesting ---------------- */

typedef struct {
    tdm_tensor *w;
    tdm_rng rng;
    int calls;  /* for the mismatch case */
    bool nest;  /* run the inner function under a recomputation of its own */
    bool shift; /* the mismatch case: another shape on the second call */
} fn_arg;

/* relu(dropout(x) @ w): dropout draws from the argument's generator */
static tdm_tensor *inner_fn(void *p, tdm_tensor *x) {
    fn_arg *a = p;
    tdm_tensor *y = tdm_relu(tdm_matmul(tdm_dropout(x, 0.25f, true, &a->rng), a->w));
    return a->shift && a->calls++ ? tdm_slice(y, 1, 0, 2, 1) : y;
}

/* x + inner(x), the inner part recomputed on its own when nesting */
static tdm_tensor *outer_fn(void *p, tdm_tensor *x) {
    fn_arg *a = p;
    return tdm_add(x, a->nest ? tdm_recompute(inner_fn, a, x) : inner_fn(a, x));
}

typedef struct {
    int fired;
    float seen[16]; /* w's gradient when its hook fired */
} hook_log;

static void on_ready(tdm_tensor *leaf, void *ctx) {
    hook_log *h = ctx;
    h->fired++;
    tdm_to_host(leaf->grad, h->seen, sizeof h->seen);
}

/* mode 0: direct; 1: recomputed; 2: recomputed with the inner part recomputed inside.
 * h = 2a feeds the function and, after it, an add (two uses of h); w is read inside the
 * function and again by the last matmul. The gradients of a and w, and when w's hook fired. */
static void fn_grads(int mode, float *ga, float *gw, hook_log *h) {
    float av[12], wv[16];
    for (int i = 0; i < 12; i++) av[i] = 0.1f * (float)(i % 5) - 0.2f;
    for (int i = 0; i < 16; i++) wv[i] = 0.05f * (float)((i * 7) % 11) - 0.25f;
    tdm_tensor *a = f32(TDM_SHAPE(3, 4), av), *w = f32(TDM_SHAPE(4, 4), wv);
    tdm_requires_grad_(a, true);
    tdm_requires_grad_(w, true);
    tdm_register_grad_hook(w, on_ready, h);
    fn_arg arg = {.w = w, .rng = tdm_rng_make(5), .nest = mode == 2};
    tdm_scope_begin();
    tdm_tensor *x = tdm_mul_scalar(a, 2.0f);
    tdm_tensor *f = mode ? tdm_recompute(outer_fn, &arg, x) : outer_fn(&arg, x);
    tdm_tensor *z = tdm_matmul(tdm_add(x, f), w);
    CHECK(tdm_backward(tdm_sum_all(tdm_mul(z, z))) == TDM_OK, "fn mode %d: %s", mode,
          tdm_last_error());
    tdm_scope_end();
    tdm_to_host(a->grad, ga, sizeof(float) * 12);
    tdm_to_host(w->grad, gw, sizeof(float) * 16);
    tdm_tensor_free(a);
    tdm_tensor_free(w);
}

static void test_function(void) {
    float ga[3][12], gw[3][16];
    hook_log h[3] = {0};
    for (int mode = 0; mode < 3; mode++) {
        fn_grads(mode, ga[mode], gw[mode], &h[mode]);
        CHECK(h[mode].fired == 1 && same_bits(h[mode].seen, gw[mode], 16),
              "mode %d: w's hook fired %d times, %s", mode, h[mode].fired,
              "the last one before its gradient was final");
    }
    for (int mode = 1; mode < 3; mode++)
        CHECK(same_bits(ga[0], ga[mode], 12) && same_bits(gw[0], gw[mode], 16),
              "mode %d: gradients differ from the direct run's", mode);

    /* a second run that differs from the first fails the backward, naming both shapes */
    float wv[8] = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f, 0.8f};
    tdm_tensor *w = f32(TDM_SHAPE(2, 4), wv);
    tdm_requires_grad_(w, true);
    fn_arg arg = {.w = w, .rng = tdm_rng_make(5), .shift = true};
    tdm_scope_begin();
    tdm_tensor *y = tdm_recompute(inner_fn, &arg, tdm_ones(TDM_SHAPE(3, 2), TDM_F32, tdm_cpu(0)));
    CHECK_ERROR(tdm_backward(tdm_sum_all(y)) != TDM_OK, "returned [3, 4] in forward but [3, 2]");
    tdm_scope_end();
    tdm_tensor_free(w);
    CHECK_ERROR(tdm_recompute(inner_fn, &arg, NULL) == NULL, "recompute: NULL input");
}

int main(void) {
    /* bits are compared, not speed: one GEMM thread keeps the test quick on a busy machine
     * and clean under ThreadSanitizer, which cannot see into OpenMP's threads */
    tdm_cpu_gemm_set_threads(1);
    test_memory_stats();
    test_function();
    test_gpt();
    test_dropout();
    test_resnet();
    test_data_parallel();
    test_ddp();
    tdm_module_free(drawn);
    return check_summary();
}
