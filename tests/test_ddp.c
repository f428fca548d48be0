/* DDP and DataParallel: N replicas on N CPU devices end with the parameters of one device
 * trained on the same global batches (uneven splits, several bucket sizes, gradient
 * accumulation without sync), stay identical to each other, and fail clearly when the
 * replicas differ or a parameter gets no gradient. ZeRO stage 1 (the optimizer state sharded
 * over the ranks) ends with the unsharded run's parameters and state bit for bit, and its
 * checkpoints resume on another number of ranks, sharded or not. With batch norm and dropout under
 * the parallel context (DataParallel sets it), replicas match one device too, running statistics
 * included: synchronised batch norm is checked against one device's on the concatenated
 * batch, and dropout against one device's masks for the same global rows.
 *
 * Tolerance: the replicas sum their slices' gradients in another order than one device
 * summing the whole batch, so results differ by float32 rounding, amplified a little by a
 * few optimizer steps: 1e-5 absolute + 1e-4 relative on parameters of order 0.1-1. The same
 * tolerance holds with batch norm (its statistics are summed per rank, then over ranks) and
 * running statistics: the observed error is well under 1% of it. */
#include "check.h"

#include <stdlib.h>

#include "ddp_common.h"
#include "tandem/half.h"
#include "testdir.h"

static tdm_optim *make_sgd(tdm_paramset *ps, void *arg) {
    tdm_sgd_opts o = tdm_sgd_defaults(0.1f);
    o.momentum = 0.9f;
    return tdm_sgd_new(ps, &o);
}

static tdm_optim *make_adam(tdm_paramset *ps, void *arg) {
    tdm_adam_opts o = tdm_adam_defaults();
    o.lr = 0.01f;
    return tdm_adam_new(ps, &o);
}

/* One device, whole batches (accumulate of them per step, each loss divided by accumulate),
 * the gradient clipped to a norm of clip when clip > 0: the reference parameters. */
static float *reference(tdm_optim_factory make, int accumulate, float clip) {
    tdm_module *m = make_mlp(1, HID);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *opt = make(ps, NULL);
    float x[B * IN];
    int64_t y[B];
    for (int s = 0; s < STEPS; s++) {
        tdm_optim_zero_grad(opt);
        for (int a = 0; a < accumulate; a++) {
            batch_of(s * 10 + a, x, y);
            tdm_scope_begin();
            tdm_tensor *l = tdm_cross_entropy(
                tdm_module_forward(m, tdm_from_data(TDM_SHAPE(B, IN), TDM_F32, tdm_cpu(0), x)),
                tdm_from_data(TDM_SHAPE(B), TDM_I64, tdm_cpu(0), y), NULL);
            tdm_backward(tdm_mul_scalar(l, 1.0f / (float)accumulate));
            tdm_scope_end();
        }
        float norm = 0;
        if (clip > 0) tdm_clip_grad_norm(ps, clip, false, &norm);
        CHECK(clip == 0 || norm > clip, "step %d: norm %g below the clip %g: clipping untested", s,
              norm, clip);
        tdm_optim_step(opt);
    }
    return take_weights(m, ps, opt);
}

static int compare(const float *got, const float *want, int64_t n, const char *what) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!(fabsf(got[i] - want[i]) <= 1e-5f + 1e-4f * fabsf(want[i]))) {
            if (bad++ < 3)
                fprintf(stderr, "%s: parameter %lld = %.8g, one device %.8g\n", what, (long long)i,
                        got[i], want[i]);
        }
    return bad;
}

/* ---- DDP under tdm_spawn ------------------------------------------------------------------ */

typedef struct {
    tdm_optim_factory make;
    int accumulate;     /* micro-batches per step, the first ones without sync */
    int64_t bucket_cap; /* bytes */
    const float *want;
    int bad[8];       /* per rank: parameters off the reference */
    float *params[8]; /* per rank: final parameters */
    int64_t total;
} ddp_case;

static int ddp_rank(tdm_rank_ctx *ctx, void *arg) {
    ddp_case *c = arg;
    int n = ctx->size, r = ctx->rank;
    tdm_module *m = make_mlp(1 + (uint64_t)r, HID); /* rank 0's weights are broadcast */
    tdm_ddp_opts o = tdm_ddp_defaults();
    o.bucket_cap_bytes = o.first_bucket_cap_bytes = c->bucket_cap;
    tdm_ddp *d = tdm_ddp_new(m, ctx->group, &o);
    if (!d) return tdm_last_status();
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *opt = c->make(ps, NULL);
    int64_t lo = r * (B / n) + (r < B % n ? r : B % n), hi = lo + B / n + (r < B % n);
    float x[B * IN];
    int64_t y[B];
    int rc = 0;
    for (int s = 0; s < STEPS && !rc; s++) {
        tdm_optim_zero_grad(opt);
        for (int a = 0; a < c->accumulate && !rc; a++) {
            batch_of(s * 10 + a, x, y);
            tdm_ddp_set_sync(d, a == c->accumulate - 1);
            tdm_scope_begin();
            tdm_tensor *xs =
                tdm_from_data(TDM_SHAPE(hi - lo, IN), TDM_F32, tdm_cpu(0), x + lo * IN);
            tdm_tensor *ys = tdm_from_data(TDM_SHAPE(hi - lo), TDM_I64, tdm_cpu(0), y + lo);
            tdm_tensor *l = tdm_cross_entropy(tdm_ddp_forward(d, xs), ys, NULL);
            float w = (float)((double)(hi - lo) * n / B / c->accumulate);
            rc = tdm_ddp_backward(d, tdm_mul_scalar(l, w));
            tdm_scope_end();
        }
        if (!rc) rc = tdm_optim_step(opt);
    }
    if (r == 0) c->total = ps->total;
    c->params[r] = malloc(sizeof(float) * (size_t)ps->total);
    tdm_to_host(ps->flat, c->params[r], sizeof(float) * (size_t)ps->total);
    c->bad[r] = compare(c->params[r], c->want, ps->total, "ddp");
    tdm_optim_free(opt);
    tdm_ddp_free(d);
    tdm_module_free(m);
    return rc;
}

static void test_ddp_equivalence(void) {
    struct {
        tdm_optim_factory make;
        const char *name;
        int acc;
        int64_t cap;
    } cases[] = {{make_sgd, "sgd", 1, 25 << 20},
                 {make_adam, "adam", 1, 25 << 20},
                 {make_sgd, "sgd, 64-byte buckets", 1, 64},
                 {make_sgd, "sgd, no_sync x2", 2, 25 << 20}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        float *want = reference(cases[k].make, cases[k].acc, 0);
        for (int n = 1; n <= 4; n++) {
            ddp_case c = {cases[k].make, cases[k].acc, cases[k].cap, want, {0}, {0}, 0};
            tdm_device devs[4] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
            int rc = tdm_spawn(n, devs, ddp_rank, &c);
            CHECK(rc == 0, "ddp %s on %d ranks: %s", cases[k].name, n, tdm_last_error());
            for (int r = 0; r < n; r++) {
                CHECK(c.bad[r] == 0, "ddp %s, %d ranks, rank %d: %d parameters off one device",
                      cases[k].name, n, r, c.bad[r]);
                CHECK(c.params[r] &&
                          memcmp(c.params[r], c.params[0], sizeof(float) * (size_t)c.total) == 0,
                      "ddp %s, %d ranks: rank %d differs from rank 0", cases[k].name, n, r);
            }
            for (int r = 0; r < n; r++) free(c.params[r]);
        }
        free(want);
    }
}

/* ---- reduce_dtype bf16 --------------------------------------------------------------------- */

typedef struct {
    int64_t cap, total;
    bool set_after;    /* bf16 through tdm_ddp_set_reduce_dtype after an f32 DDP is made */
    float *local[4];   /* per rank: its own gradient of the batch (sync off) */
    float *reduced[4]; /* per rank: the gradient DDP reduced in bf16 */
    float *stage2[4];  /* per rank: its ZeRO stage 2 shard of the same, at shard_lo[r] */
    float *stage3[4];  /* the same under ZeRO stage 3 (the parameters gathered per unit) */
    int64_t shard_lo[4], shard_n[4];
} bf16_case;

/* This rank's rows of batch 0 forward and backward through d, loss weighted as ddp_rank does;
 * the gradient (whole, or the stage 2 shard) copied to *out. */
static int bf16_pass(tdm_ddp *d, tdm_module *m, tdm_optim *opt, int r, int n, float **out) {
    float x[B * IN];
    int64_t y[B];
    batch_of(0, x, y);
    int64_t lo = r * (B / n) + (r < B % n ? r : B % n), hi = lo + B / n + (r < B % n);
    tdm_optim_zero_grad(opt);
    tdm_scope_begin();
    tdm_tensor *xs = tdm_from_data(TDM_SHAPE(hi - lo, IN), TDM_F32, tdm_cpu(0), x + lo * IN);
    tdm_tensor *ys = tdm_from_data(TDM_SHAPE(hi - lo), TDM_I64, tdm_cpu(0), y + lo);
    tdm_tensor *l = tdm_cross_entropy(tdm_ddp_forward(d, xs), ys, NULL);
    int rc = tdm_ddp_backward(d, tdm_mul_scalar(l, (float)((double)(hi - lo) * n / B)));
    tdm_scope_end();
    int64_t g0;
    tdm_tensor *shard = tdm_ddp_shard_grad(d, &g0);
    tdm_tensor *g = shard ? shard : tdm_module_parameters(m)->flat_grad;
    *out = malloc(sizeof(float) * (size_t)tdm_numel(g));
    if (!rc) rc = tdm_to_host(g, *out, sizeof(float) * (size_t)tdm_numel(g));
    return rc;
}

static int bf16_rank(tdm_rank_ctx *ctx, void *arg) {
    bf16_case *c = arg;
    int n = ctx->size, r = ctx->rank;
    tdm_module *m = make_mlp(1 + (uint64_t)r, HID);
    tdm_ddp_opts o = tdm_ddp_defaults();
    o.bucket_cap_bytes = o.first_bucket_cap_bytes = c->cap;
    o.reduce_dtype = c->set_after ? TDM_F32 : TDM_BF16;
    tdm_ddp *d = tdm_ddp_new(m, ctx->group, &o);
    if (!d) return tdm_last_status();
    if (c->set_after && tdm_ddp_set_reduce_dtype(d, TDM_BF16)) return tdm_last_status();
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *opt = make_sgd(ps, NULL);
    if (r == 0) c->total = ps->total; /* one writer: the ranks run at once */
    tdm_ddp_set_sync(d, false);
    int rc = bf16_pass(d, m, opt, r, n, &c->local[r]);
    tdm_ddp_set_sync(d, true);
    if (!rc) rc = bf16_pass(d, m, opt, r, n, &c->reduced[r]);
    if (!rc) rc = tdm_ddp_set_shard(d, opt, TDM_SHARD_GRADIENTS);
    if (!rc) rc = bf16_pass(d, m, opt, r, n, &c->stage2[r]);
    if (!rc) rc = tdm_ddp_set_shard(d, opt, TDM_SHARD_PARAMETERS);
    if (!rc) rc = bf16_pass(d, m, opt, r, n, &c->stage3[r]);
    tdm_tensor *shard = tdm_ddp_shard_grad(d, &c->shard_lo[r]);
    c->shard_n[r] = shard ? tdm_numel(shard) : 0;
    tdm_optim_free(opt);
    tdm_ddp_free(d);
    tdm_module_free(m);
    return rc;
}

/* tdm_ddp_new's errors for reduce_dtype f16 and for param_dtype f16, into arg (char [2][256]),
 * and tdm_ddp_set_reduce_dtype's for i64 into the third. */
static int f16_rank(tdm_rank_ctx *ctx, void *arg) {
    char(*msg)[256] = arg;
    tdm_module *m = make_mlp(1, HID);
    for (int k = 0; k < 2; k++) {
        tdm_ddp_opts o = tdm_ddp_defaults();
        if (k)
            o.param_dtype = TDM_F16;
        else
            o.reduce_dtype = TDM_F16;
        tdm_ddp *d = tdm_ddp_new(m, ctx->group, &o);
        snprintf(msg[k], 256, "%s", d ? "accepted" : tdm_last_error());
        tdm_ddp_free(d);
    }
    tdm_ddp *d = tdm_ddp_new(m, ctx->group, NULL);
    int rc = d ? tdm_ddp_set_reduce_dtype(d, TDM_I64) : -1;
    snprintf(msg[2], 256, "%s", rc ? tdm_last_error() : "accepted");
    tdm_ddp_free(d);
    tdm_module_free(m);
    return 0;
}

/* reduce_dtype bf16 (PyTorch's bf16_compress_hook): every rank's gradient is the ranks' own
 * gradients rounded to bf16, summed in f32 in rank order, divided by the ranks and rounded
 * once, bit for bit, on every rank and in ZeRO stage 2's and 3's shards; and it lies within 2^-7 of
 * the mean magnitude of the ranks' gradients from the f32 reduction (two bf16 roundings of at most
 * 2^-8 relative each, one of each gradient, one of the mean, plus f32's). */
static void test_ddp_reduce_bf16(void) {
    const int64_t caps[2] = {64, 25 << 20};
    tdm_device devs[3] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2)};
    for (int n = 1; n <= 3; n++)
        for (int k = 0; k < 3; k++) { /* the third: bf16 set after an f32 DDP was made */
            bf16_case c = {.cap = caps[k % 2], .set_after = k == 2};
            int rc = tdm_spawn(n, devs, bf16_rank, &c);
            CHECK(rc == 0, "ddp bf16 on %d ranks: %s", n, tdm_last_error());
            int64_t off = 0, rounded = 0, covered = 0;
            for (int64_t i = 0; !rc && i < c.total; i++) {
                float sum = 0, f32 = 0, mag = 0;
                for (int r = 0; r < n; r++) {
                    float g = c.local[r][i];
                    float gb = tdm_bf16_to_float(tdm_bf16_from_float(g));
                    sum = r ? sum + gb : gb;
                    f32 = r ? f32 + g : g;
                    mag += fabsf(g);
                }
                float want = tdm_bf16_to_float(tdm_bf16_from_float(sum / (float)n));
                f32 /= (float)n;
                for (int r = 0; r < n; r++) {
                    off += memcmp(&c.reduced[r][i], &want, 4) != 0;
                    int64_t j = i - c.shard_lo[r];
                    if (j >= 0 && j < c.shard_n[r]) {
                        off += memcmp(&c.stage2[r][j], &want, 4) != 0;
                        off += memcmp(&c.stage3[r][j], &want, 4) != 0;
                        covered++;
                    }
                }
                CHECK(fabsf(want - f32) <= 0x1p-7f * 1.0001f * mag / (float)n,
                      "element %lld: bf16 reduce %.9g, f32 %.9g", (long long)i, want, f32);
                rounded += want != f32;
            }
            CHECK(off == 0, "ddp bf16, %d ranks, buckets of %lld bytes%s: %lld elements off", n,
                  (long long)caps[k % 2], c.set_after ? ", set after" : "", (long long)off);
            CHECK(rc || covered == c.total, "stage 2 shards cover %lld of %lld", (long long)covered,
                  (long long)c.total);
            CHECK(rc || rounded > c.total / 2, "only %lld of %lld elements differ from f32",
                  (long long)rounded, (long long)c.total);
            for (int r = 0; r < n; r++)
                free(c.local[r]), free(c.reduced[r]), free(c.stage2[r]), free(c.stage3[r]);
        }
    char msg[3][256] = {"", "", ""};
    CHECK(tdm_spawn(1, devs, f16_rank, msg) == TDM_OK, "spawn: %s", tdm_last_error());
    CHECK(strstr(msg[0], "ddp: reduce_dtype f16 (expected f32 or bf16)"), "f16: %s", msg[0]);
    CHECK(strstr(msg[1], "ddp: param_dtype f16 (expected f32 or bf16)"), "param f16: %s", msg[1]);
    CHECK(strstr(msg[2], "ddp: reduce_dtype i64 (expected f32 or bf16)"), "set i64: %s", msg[2]);
}

/* ---- DDP errors --------------------------------------------------------------------------- */

static int mismatched_rank(tdm_rank_ctx *ctx, void *arg) {
    tdm_module *m = make_mlp(1, ctx->rank == 1 ? HID + 1 : HID);
    tdm_ddp *d = tdm_ddp_new(m, ctx->group, NULL);
    int rc = d ? 0 : tdm_last_status();
    tdm_ddp_free(d);
    tdm_module_free(m);
    return rc;
}

static int unused_rank(tdm_rank_ctx *ctx, void *arg) {
    bool *find_unused = arg;
    tdm_module *m = make_mlp(1, HID);
    tdm_ddp_opts o = tdm_ddp_defaults();
    o.find_unused_parameters = *find_unused;
    tdm_ddp *d = tdm_ddp_new(m, ctx->group, &o);
    if (!d) return tdm_last_status();
    tdm_scope_begin();
    /* only the first layer takes part: "2.weight" and "2.bias" get no gradient */
    tdm_module *first = m->children[0];
    tdm_tensor *h = tdm_module_forward(first, tdm_ones(TDM_SHAPE(2, IN), TDM_F32, tdm_cpu(0)));
    int rc = tdm_ddp_backward(d, tdm_sum_all(h));
    tdm_scope_end();
    tdm_ddp_free(d);
    tdm_module_free(m);
    return rc;
}

static void test_ddp_errors(void) {
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    CHECK_ERROR(tdm_spawn(2, devs, mismatched_rank, NULL) != 0,
                "parameter \"0.weight\" has shape [9, 6] on rank 1 but [8, 6] on rank 0");
    bool find = false;
    CHECK_ERROR(tdm_spawn(2, devs, unused_rank, &find) != 0, "2.weight, 2.bias");
    find = true;
    CHECK(tdm_spawn(2, devs, unused_rank, &find) == 0, "find_unused_parameters: %s",
          tdm_last_error());
}

/* ---- ZeRO stage 1: the optimizer state sharded over the group ----------------------------- */

/* Adam with weight decay and amsgrad: three state buffers. */
static tdm_optim *make_adam_zero(tdm_paramset *ps, void *arg) {
    tdm_adam_opts o = tdm_adam_defaults();
    o.lr = 0.01f;
    o.weight_decay = 0.05f;
    o.amsgrad = true;
    return tdm_adam_new(ps, &o);
}

/* SGD with nesterov momentum and per-parameter weight decays, whose runs of equal decay cross
 * the shards' boundaries. */
static tdm_optim *make_sgd_zero(tdm_paramset *ps, void *arg) {
    tdm_sgd_opts o = tdm_sgd_defaults(0.1f);
    o.momentum = 0.9f;
    o.nesterov = true;
    tdm_optim *opt = tdm_sgd_new(ps, &o);
    const float wd[4] = {1e-3f, 0, 1e-3f, 0}; /* 0.weight, 0.bias, 2.weight, 2.bias */
    if (opt && ps->n == 4 && tdm_optim_set_weight_decays(opt, wd)) tdm_optim_free(opt), opt = NULL;
    return opt;
}

#define ZERO_CLIP 0.05f /* well below the gradients' norm: every step clips */

/* How a rank of a ZeRO case starts: from scratch, or from the checkpoint at path (loaded
 * into the unsharded optimizer, then sharded; or sharded first, then loaded). */
typedef enum { FROM_SCRATCH, LOAD_THEN_SHARD, SHARD_THEN_LOAD } zero_start;

typedef struct {
    tdm_optim_factory make;
    bool shard;
    bool grads;         /* ZeRO stage 2 (tdm_ddp_set_shard) rather than stage 1 */
    bool stage3;        /* ZeRO stage 3 (with grads) */
    int micro;          /* micro-batches per step (0: 2, the first without sync) */
    bool no_clip;       /* no gradient clipping */
    int64_t bucket_cap; /* DDP's bucket caps in bytes (0: the defaults, one bucket here) */
    zero_start start;
    const char *ckpt;     /* the checkpoint to start from, or to write (rank 0) after the steps */
    int first_batch;      /* batches s * 10 + a for s from here */
    float *params[4];     /* per rank: the parameters after the steps */
    float *state[4][3];   /* per rank: the whole state, gathered */
    int n_state;          /* state buffers */
    int64_t lo[4], hi[4]; /* per rank: its shard */
    int64_t numel[4];     /* per rank: elements of each of its state buffers */
    int64_t total, steps; /* the flat buffer's elements; rank 0's optimizer steps */
} zero_case;

/* STEPS steps of DDP: c->micro micro-batches each (all but the last without sync), the
 * averaged gradient clipped (under stage 2 from the shards' norms), then the (maybe sharded)
 * optimizer's step. */
static int zero_steps(const zero_case *c, tdm_ddp *d, tdm_optim *opt, int n, int r) {
    int64_t lo = r * (B / n) + (r < B % n ? r : B % n), hi = lo + B / n + (r < B % n);
    float x[B * IN];
    int64_t y[B];
    int rc = 0, micro = c->micro ? c->micro : 2;
    for (int s = c->first_batch; s < c->first_batch + STEPS && !rc; s++) {
        tdm_optim_zero_grad(opt);
        for (int a = 0; a < micro && !rc; a++) {
            batch_of(s * 10 + a, x, y);
            tdm_ddp_set_sync(d, a == micro - 1);
            tdm_scope_begin();
            tdm_tensor *xs =
                tdm_from_data(TDM_SHAPE(hi - lo, IN), TDM_F32, tdm_cpu(0), x + lo * IN);
            tdm_tensor *ys = tdm_from_data(TDM_SHAPE(hi - lo), TDM_I64, tdm_cpu(0), y + lo);
            tdm_tensor *l = tdm_cross_entropy(tdm_ddp_forward(d, xs), ys, NULL);
            float w = (float)((double)(hi - lo) * n / B / micro);
            rc = tdm_ddp_backward(d, tdm_mul_scalar(l, w));
            tdm_scope_end();
        }
        if (!rc && !c->no_clip) rc = tdm_ddp_clip_grad_norm(d, ZERO_CLIP, NULL);
        if (!rc) rc = tdm_optim_step(opt);
    }
    return rc;
}

/* What a rank ends with: parameters, shard, state sizes and the gathered whole state (and,
 * on rank 0 when asked, a checkpoint of the whole copy, which every rank helps gather). */
static int zero_record(zero_case *c, tdm_ddp *d, tdm_module *m, tdm_optim *opt, int r) {
    tdm_paramset *ps = tdm_module_parameters(m);
    c->params[r] = malloc(sizeof(float) * (size_t)ps->total);
    int rc = tdm_ddp_gather_params(d); /* stage 3: the whole model again, in ps->flat */
    if (!rc) rc = tdm_to_host(ps->flat, c->params[r], sizeof(float) * (size_t)ps->total);
    if (!rc) rc = tdm_ddp_release_params(d);
    if (rc) return rc;
    tdm_optim_shard_range(opt, &c->lo[r], &c->hi[r]);
    tdm_tensor *st[3], *whole[3];
    int n = tdm_optim_state(opt, NULL, st, 3);
    c->numel[r] = n ? tdm_numel(st[0]) : 0;
    for (int k = 1; k < n; k++)
        if (tdm_numel(st[k]) != c->numel[r]) c->numel[r] = -1;
    int got = tdm_optim_state_gather(opt, NULL, whole, 3);
    if (got != n) return got < 0 ? got : TDM_ERR_STATE;
    for (int k = 0; k < n; k++) {
        c->state[r][k] = malloc(sizeof(float) * (size_t)ps->total);
        tdm_to_host(whole[k], c->state[r][k], sizeof(float) * (size_t)ps->total);
        tdm_tensor_free(whole[k]);
    }
    if (r == 0) c->n_state = n, c->total = ps->total, c->steps = tdm_optim_steps(opt);
    if (!c->ckpt || c->start != FROM_SCRATCH) return TDM_OK;
    tdm_optim *copy = tdm_optim_gather(opt);
    tdm_train_state s = {.model = m, .optim = copy, .step = tdm_optim_steps(opt)};
    rc = !copy ? tdm_last_status() : r == 0 ? tdm_checkpoint_save(c->ckpt, &s, 0) : TDM_OK;
    tdm_optim_free(copy);
    return rc;
}

static int zero_rank(tdm_rank_ctx *ctx, void *arg) {
    zero_case *c = arg;
    int r = ctx->rank, rc = 0;
    tdm_module *m = make_mlp(1 + (uint64_t)r, HID); /* rank 0's weights are broadcast */
    tdm_ddp_opts o = tdm_ddp_defaults();
    if (c->bucket_cap) o.bucket_cap_bytes = o.first_bucket_cap_bytes = c->bucket_cap;
    tdm_ddp *d = tdm_ddp_new(m, ctx->group, &o);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *opt = d ? c->make(ps, NULL) : NULL;
    tdm_train_state s = {.model = m, .optim = opt};
    tdm_shard_kind kind = c->stage3  ? TDM_SHARD_PARAMETERS
                          : c->grads ? TDM_SHARD_GRADIENTS
                                     : TDM_SHARD_OPTIMIZER;
    if (!opt) rc = tdm_last_status();
    if (!rc && c->shard && c->start != LOAD_THEN_SHARD) rc = tdm_ddp_set_shard(d, opt, kind);
    /* stage 3 loads into the whole model, summoned */
    if (!rc && c->start == SHARD_THEN_LOAD) rc = tdm_ddp_gather_params(d);
    if (!rc && c->start != FROM_SCRATCH) rc = tdm_checkpoint_load(c->ckpt, &s);
    if (!rc && c->start == SHARD_THEN_LOAD) rc = tdm_ddp_release_params(d);
    if (!rc && c->shard && c->start == LOAD_THEN_SHARD) rc = tdm_ddp_set_shard(d, opt, kind);
    if (!rc && c->grads && (ps->flat_grad || !tdm_ddp_shard_grad(d, NULL)))
        rc = TDM_ERR_STATE; /* stage 2 kept the whole flat gradient */
    if (!rc) rc = zero_steps(c, d, opt, ctx->size, r);
    if (!rc) rc = zero_record(c, d, m, opt, r);
    tdm_optim_free(opt);
    tdm_ddp_free(d);
    tdm_module_free(m);
    return rc;
}

static void zero_case_free(zero_case *c) {
    for (int r = 0; r < 4; r++) {
        free(c->params[r]);
        for (int k = 0; k < 3; k++) free(c->state[r][k]);
    }
}

/* Each rank's shard is tdm_chunk_of's (ceil(total / n) rounded up to 16, in rank order), its
 * state buffers that size, and the shards tile the flat buffer. */
static void check_shards(const zero_case *c, int n, const char *what) {
    int64_t per = ((c->total + n - 1) / n + 15) / 16 * 16, at = 0;
    for (int r = 0; r < n; r++) {
        int64_t lo = r * per < c->total ? r * per : c->total;
        int64_t hi = lo + per < c->total ? lo + per : c->total;
        CHECK(c->lo[r] == lo && c->hi[r] == hi && c->numel[r] == hi - lo,
              "%s, %d ranks: rank %d's shard [%lld, %lld) with %lld state elements, expected "
              "[%lld, %lld)",
              what, n, r, (long long)c->lo[r], (long long)c->hi[r], (long long)c->numel[r],
              (long long)lo, (long long)hi);
        at += c->numel[r];
    }
    CHECK(at == c->total, "%s, %d ranks: the shards hold %lld elements of %lld", what, n,
          (long long)at, (long long)c->total);
}

/* Whether every rank of c ends with want's rank-0 parameters and whole state, bit for bit. */
static void check_same(const zero_case *c, const zero_case *want, int n, const char *what) {
    size_t bytes = sizeof(float) * (size_t)want->total;
    for (int r = 0; r < n; r++) {
        CHECK(c->params[r] && memcmp(c->params[r], want->params[0], bytes) == 0,
              "%s, %d ranks: rank %d's parameters differ from the unsharded run's", what, n, r);
        for (int k = 0; k < want->n_state; k++)
            CHECK(c->state[r][k] && memcmp(c->state[r][k], want->state[0][k], bytes) == 0,
                  "%s, %d ranks: rank %d's gathered state %d differs from the unsharded one", what,
                  n, r, k);
    }
    CHECK(c->steps == want->steps, "%s: %lld steps counted, unsharded %lld", what,
          (long long)c->steps, (long long)want->steps);
}

/* Sharded DDP on 2, 3 and 4 ranks (the 4th's shard empty) ends with the unsharded run's
 * parameters and state, bit for bit, with accumulation and clipping; a sharded run's
 * checkpoint (saved on 2 ranks) resumes on 3, sharded before or after the load, as the
 * unsharded optimizer does. */
static void test_zero(void) {
    tdm_optim_factory makes[2] = {make_adam_zero, make_sgd_zero};
    const char *names[2] = {"adam (weight decay, amsgrad)", "sgd (nesterov, param groups)"};
    tdm_device devs[4] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
    char ckpt[200];
    snprintf(ckpt, sizeof ckpt, "%s/zero", tmpdir);
    for (int k = 0; k < 2; k++) {
        for (int n = 2; n <= 4; n++) {
            zero_case plain = {.make = makes[k]};
            zero_case sharded = {.make = makes[k], .shard = true, .ckpt = n == 2 ? ckpt : NULL};
            CHECK(tdm_spawn(n, devs, zero_rank, &plain) == 0, "%s: %s", names[k], tdm_last_error());
            CHECK(tdm_spawn(n, devs, zero_rank, &sharded) == 0, "sharded %s on %d ranks: %s",
                  names[k], n, tdm_last_error());
            check_shards(&sharded, n, names[k]);
            check_same(&sharded, &plain, n, names[k]);
            zero_case_free(&plain);
            zero_case_free(&sharded);
        }
        /* saved by 2 sharded ranks: 3 ranks continue, unsharded and sharded both ways */
        char path[300] = "";
        CHECK(tdm_checkpoint_latest(ckpt, path, sizeof path, NULL) == 1,
              "the sharded run's checkpoint: %s", tdm_last_error());
        zero_case resumed[4] = {
            {.make = makes[k], .start = LOAD_THEN_SHARD, .ckpt = path, .first_batch = 10},
            {.make = makes[k],
             .shard = true,
             .start = LOAD_THEN_SHARD,
             .ckpt = path,
             .first_batch = 10},
            {.make = makes[k],
             .shard = true,
             .start = SHARD_THEN_LOAD,
             .ckpt = path,
             .first_batch = 10},
            {.make = makes[k],
             .shard = true,
             .grads = true,
             .stage3 = true,
             .micro = 1,
             .start = SHARD_THEN_LOAD,
             .ckpt = path,
             .first_batch = 10}};
        for (int i = 0; i < 4; i++)
            CHECK(tdm_spawn(3, devs, zero_rank, &resumed[i]) == 0, "%s resumed (%d): %s", names[k],
                  i, tdm_last_error());
        CHECK(resumed[0].steps == 2 * STEPS, "%s: the resumed optimizer took %lld steps", names[k],
              (long long)resumed[0].steps);
        check_same(&resumed[1], &resumed[0], 3, "loaded, then sharded");
        check_same(&resumed[2], &resumed[0], 3, "sharded, then loaded");
        CHECK(resumed[3].steps == resumed[0].steps, "stage 3, loaded while gathered: %lld steps",
              (long long)resumed[3].steps);
        for (int i = 0; i < 4; i++) zero_case_free(&resumed[i]);
        tdm_checkpoint_clear(ckpt);
    }
}

/* ---- ZeRO stage 2: the gradients sharded too ----------------------------------------------- */

/* Whether every rank of c ends with want's rank-0 parameters and whole state to float
 * rounding (the tolerance of compare, above). */
static void check_close(const zero_case *c, const zero_case *want, int n, const char *what) {
    for (int r = 0; r < n; r++) {
        CHECK(c->params[r] && compare(c->params[r], want->params[0], want->total, what) == 0,
              "%s, %d ranks: rank %d's parameters are off the unsharded run's", what, n, r);
        for (int k = 0; k < want->n_state; k++)
            CHECK(c->state[r][k] &&
                      compare(c->state[r][k], want->state[0][k], want->total, what) == 0,
                  "%s, %d ranks: rank %d's gathered state %d is off the unsharded one", what, n, r,
                  k);
    }
}

/* Stage 2 on 2, 3 and 4 ranks, with buckets of 16 floats (4 buckets across the shards'
 * boundaries), against unsharded DDP with the same buckets: bit for bit with one micro-batch
 * a step, clipped or not (the clip's global norm is the shards' sums of squares added); with
 * 2 micro-batches, each one's average added into the shard, to float rounding. */
static void test_zero2(void) {
    tdm_optim_factory makes[2] = {make_adam_zero, make_sgd_zero};
    const char *names[2] = {"stage 2, adam (weight decay, amsgrad)",
                            "stage 2, sgd (nesterov, param groups)"};
    tdm_device devs[4] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
    struct {
        int micro;
        bool no_clip, exact;
    } runs[3] = {{1, true, true}, {1, false, true}, {3, false, false}};
    for (int k = 0; k < 2; k++)
        for (int n = 2; n <= 4; n++)
            for (int i = 0; i < 3; i++) {
                zero_case plain = {.make = makes[k],
                                   .micro = runs[i].micro,
                                   .no_clip = runs[i].no_clip,
                                   .bucket_cap = 64};
                zero_case sharded = plain, stage3 = plain;
                sharded.shard = sharded.grads = true;
                stage3.shard = stage3.grads = stage3.stage3 = true;
                CHECK(tdm_spawn(n, devs, zero_rank, &plain) == 0, "%s: %s", names[k],
                      tdm_last_error());
                CHECK(tdm_spawn(n, devs, zero_rank, &sharded) == 0, "%s on %d ranks: %s", names[k],
                      n, tdm_last_error());
                CHECK(tdm_spawn(n, devs, zero_rank, &stage3) == 0, "%s, stage 3 on %d ranks: %s",
                      names[k], n, tdm_last_error());
                char what[160];
                snprintf(what, sizeof what, "%s, %d micro-batch(es)%s", names[k], runs[i].micro,
                         runs[i].no_clip ? "" : ", clipped");
                check_shards(&sharded, n, what);
                check_shards(&stage3, n, what);
                if (runs[i].exact)
                    check_same(&sharded, &plain, n, what);
                else
                    check_close(&sharded, &plain, n, what);
                /* stage 3 only moves stage 2's values: the same bits in every case */
                check_same(&stage3, &sharded, n, what);
                zero_case_free(&plain);
                zero_case_free(&sharded);
                zero_case_free(&stage3);
            }
}

/* ---- ZeRO stage 2's memory ------------------------------------------------------------------ */

#define MEM_LAYERS 8
#define MEM_WIDTH  128
#define MEM_BUCKET (MEM_WIDTH * (MEM_WIDTH + 1) * 4) /* one layer a bucket */

typedef struct {
    tdm_shard_kind kind;
    int64_t between[2], peak[2]; /* per rank: allocated between steps, peak during one */
    int64_t total, shard[2];     /* floats: the flat buffer's, each rank's shard's */
} mem_case;

/* A deep, narrow MLP on the rank's own device (its own allocator pool) under DDP with one
 * layer per bucket and plain SGD (no state: only the gradients differ between stages): what
 * the device holds between two steps, and its peak during the second. */
static int mem_rank(tdm_rank_ctx *ctx, void *arg) {
    mem_case *c = arg;
    int r = ctx->rank, rc = 0;
    tdm_rng g = tdm_rng_make(7);
    tdm_module *l[2 * MEM_LAYERS];
    for (int i = 0; i < MEM_LAYERS; i++) {
        l[2 * i] = tdm_linear_new(MEM_WIDTH, MEM_WIDTH, true, ctx->device, &g);
        l[2 * i + 1] = tdm_relu_new();
    }
    tdm_module *m = tdm_sequential_new(2 * MEM_LAYERS, l);
    tdm_ddp_opts o = tdm_ddp_defaults();
    o.bucket_cap_bytes = o.first_bucket_cap_bytes = MEM_BUCKET;
    tdm_ddp *d = tdm_ddp_new(m, ctx->group, &o);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_sgd_opts so = tdm_sgd_defaults(0.01f);
    tdm_optim *opt = d ? tdm_sgd_new(ps, &so) : NULL;
    if (!opt) rc = tdm_last_status();
    if (!rc) rc = tdm_ddp_set_shard(d, opt, c->kind);
    int64_t lo = 0, hi = 0;
    tdm_optim_shard_range(opt, &lo, &hi);
    c->shard[r] = hi - lo;
    for (int s = 0; s < 2 && !rc; s++) {
        if (s == 1) {
            c->between[r] = tdm_memory_stats_get(ctx->device).allocated;
            tdm_memory_reset_peak(ctx->device);
        }
        tdm_optim_zero_grad(opt);
        tdm_scope_begin();
        tdm_rng xr = tdm_rng_make(11 + (uint64_t)r);
        tdm_tensor *x = tdm_randn(TDM_SHAPE(4, MEM_WIDTH), 0, 1, ctx->device, &xr);
        rc = tdm_ddp_backward(d, tdm_mean_all(tdm_ddp_forward(d, x)));
        tdm_scope_end();
        if (!rc) rc = tdm_optim_step(opt);
    }
    c->peak[r] = tdm_memory_stats_get(ctx->device).peak_allocated;
    if (r == 0) c->total = ps->total;
    tdm_optim_free(opt);
    tdm_ddp_free(d);
    tdm_module_free(m);
    return rc;
}

/* Under stage 2 a rank holds between steps its shard of the gradient instead of the whole
 * (about total * (1 - 1/size) floats less than stage 1), and at its peak during a step at
 * most a few buckets beyond stage 1's peak less that difference. */
static void test_zero2_memory(void) {
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    mem_case one = {.kind = TDM_SHARD_OPTIMIZER}, two = {.kind = TDM_SHARD_GRADIENTS},
             three = {.kind = TDM_SHARD_PARAMETERS};
    CHECK(tdm_spawn(2, devs, mem_rank, &one) == 0, "stage 1: %s", tdm_last_error());
    CHECK(tdm_spawn(2, devs, mem_rank, &two) == 0, "stage 2: %s", tdm_last_error());
    CHECK(tdm_spawn(2, devs, mem_rank, &three) == 0, "stage 3: %s", tdm_last_error());
    for (int r = 0; r < 2; r++) {
        int64_t saved = (one.total - two.shard[r]) * 4; /* the gradient outside the shard */
        int64_t drop = one.between[r] - two.between[r];
        CHECK(drop >= saved * 9 / 10 && drop <= saved * 5 / 4 + 4096, /* + size classes */
              "rank %d: stage 2 holds %lld bytes between steps, stage 1 %lld: expected %lld "
              "less (the gradient outside the shard of %lld of %lld floats)",
              r, (long long)two.between[r], (long long)one.between[r], (long long)saved,
              (long long)two.shard[r], (long long)one.total);
        int64_t grad_peak = two.peak[r] - (one.peak[r] - one.total * 4); /* beyond the rest */
        int64_t bound = two.shard[r] * 4 + 4 * (int64_t)MEM_BUCKET;
        CHECK(grad_peak <= bound,
              "rank %d: stage 2's gradients peak at %lld bytes (shard %lld + buckets), above "
              "%lld; stage 1's whole gradient is %lld",
              r, (long long)grad_peak, (long long)two.shard[r] * 4, (long long)bound,
              (long long)one.total * 4);
        CHECK(two.peak[r] < one.peak[r], "rank %d: stage 2 peaks at %lld, stage 1 at %lld", r,
              (long long)two.peak[r], (long long)one.peak[r]);
        /* stage 3 holds the parameters outside its shard only while a unit (a layer) needs
         * them: between steps none, at its peak two layers (the current and the next) */
        drop = two.between[r] - three.between[r];
        CHECK(drop >= saved * 9 / 10 && drop <= saved * 5 / 4 + 4096,
              "rank %d: stage 3 holds %lld bytes between steps, stage 2 %lld: expected %lld less "
              "(the parameters outside the shard)",
              r, (long long)three.between[r], (long long)two.between[r], (long long)saved);
        int64_t layer = MEM_WIDTH * (MEM_WIDTH + 1) * 4;
        CHECK(three.peak[r] <= two.peak[r] - saved + 3 * layer * 5 / 4,
              "rank %d: stage 3 peaks at %lld bytes, stage 2 at %lld: expected at most %lld less "
              "than that, plus two or three layers of %lld",
              r, (long long)three.peak[r], (long long)two.peak[r], (long long)saved,
              (long long)layer);
    }
}

/* ---- ZeRO stage 3 on a GPT: blocks as units, the root unit, recomputation ------------------ */

typedef struct {
    bool stage3, recompute;
    tdm_dtype amp;         /* forward and loss in an autocast region of this dtype (f32: none) */
    tdm_dtype param_dtype; /* stage 3's gathers (tdm_ddp_opts.param_dtype) */
    bool round_ref;        /* the reference of param_dtype bf16: forwards and backwards run with
                            * the parameters rounded to bf16, the f32 masters put back after */
    float *params[3];      /* per rank: the parameters after the steps, gathered */
    float eval_sum[3];     /* per rank: the sum of the logits of a forward without autograd */
    int units;             /* rank 0's stage-3 units */
    int64_t total;
} gpt_case;

#define GPT_STEPS 3
#define GPT_B     2 /* rows per rank */
#define GPT_T     8

/* Rank r's tokens and targets of step s. */
static void gpt_batch(int s, int r, int64_t *x, int64_t *y) {
    for (int i = 0; i < GPT_B * GPT_T; i++) {
        x[i] = (s * 7 + r * 3 + i * 5) % 24;
        y[i] = (s * 11 + r * 5 + i * 3 + 1) % 24;
    }
}

/* The sum of rank r's logits for step 0's tokens, without autograd (the units gathered and
 * freed by the forward alone). */
static int gpt_eval(tdm_module *m, int r, float *sum) {
    int64_t x[GPT_B * GPT_T], y[GPT_B * GPT_T];
    gpt_batch(0, r, x, y);
    bool prev = tdm_set_grad_enabled(false);
    tdm_scope_begin();
    tdm_tensor *logits =
        tdm_gpt_forward(m, tdm_from_data(TDM_SHAPE(GPT_B, GPT_T), TDM_I64, tdm_cpu(0), x));
    int rc = logits ? TDM_OK : tdm_last_status();
    *sum = logits ? tdm_item(tdm_sum_all(logits)) : NAN;
    tdm_scope_end();
    tdm_set_grad_enabled(prev);
    return rc;
}

/* t's values from host floats. */
static int put(tdm_tensor *t, const float *v) {
    tdm_tensor *h = tdm_from_data(tdm_shape_of(t), TDM_F32, tdm_cpu(0), v);
    int rc = h ? tdm_copy_(t, h) : tdm_last_status();
    tdm_tensor_free(h);
    return rc;
}

/* round_ref: the whole model's parameters (ps->flat, stage 2's) rounded to bf16, the f32
 * values kept in *saved (malloc'd); or, with *saved set, put back and freed. */
static int gpt_round(tdm_paramset *ps, float **saved) {
    size_t bytes = sizeof(float) * (size_t)ps->total;
    if (*saved) {
        int rc = put(ps->flat, *saved);
        free(*saved);
        *saved = NULL;
        return rc;
    }
    float *v = *saved = malloc(bytes), *w = malloc(bytes);
    int rc = tdm_to_host(ps->flat, v, bytes);
    for (int64_t i = 0; i < ps->total; i++) w[i] = tdm_bf16_to_float(tdm_bf16_from_float(v[i]));
    if (!rc) rc = put(ps->flat, w);
    free(w);
    return rc;
}

static int gpt_steps(gpt_case *c, tdm_ddp *d, tdm_module *m, tdm_optim *opt, int r) {
    int rc = 0;
    float *saved = NULL;
    tdm_paramset *ps = tdm_module_parameters(m);
    for (int s = 0; s < GPT_STEPS && !rc; s++) {
        int64_t x[GPT_B * GPT_T], y[GPT_B * GPT_T];
        gpt_batch(s, r, x, y);
        tdm_optim_zero_grad(opt);
        if (c->round_ref) rc = gpt_round(ps, &saved);
        tdm_scope_begin();
        tdm_tensor *xs = tdm_from_data(TDM_SHAPE(GPT_B, GPT_T), TDM_I64, tdm_cpu(0), x);
        tdm_tensor *ys = tdm_from_data(TDM_SHAPE(GPT_B, GPT_T), TDM_I64, tdm_cpu(0), y);
        if (!rc && c->amp != TDM_F32) rc = tdm_autocast_begin(c->amp);
        tdm_tensor *l = rc ? NULL : tdm_gpt_loss(tdm_ddp_forward(d, xs), ys);
        if (!rc && c->amp != TDM_F32) rc = tdm_autocast_end();
        if (!rc) rc = tdm_ddp_backward(d, l);
        tdm_scope_end();
        if (c->round_ref && saved && gpt_round(ps, &saved) && !rc) rc = tdm_last_status();
        if (!rc) rc = tdm_ddp_clip_grad_norm(d, 0.5f, NULL);
        if (!rc) rc = tdm_optim_step(opt);
        if (!rc && s == 0 && c->round_ref) rc = gpt_round(ps, &saved);
        if (!rc && s == 0) rc = gpt_eval(m, r, &c->eval_sum[r]);
        if (!rc && s == 0 && c->round_ref) rc = gpt_round(ps, &saved);
    }
    free(saved);
    return rc;
}

static int gpt_rank(tdm_rank_ctx *ctx, void *arg) {
    gpt_case *c = arg;
    int r = ctx->rank, rc = 0;
    tdm_gpt_config cfg = {.layers = 3, .heads = 2, .channels = 16, .context = GPT_T, .vocab = 24};
    tdm_rng init = tdm_rng_make(5);
    tdm_module *m = tdm_gpt_new(&cfg, tdm_cpu(0), &init);
    if (c->recompute) tdm_model_set_recompute(m, true);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_adam_opts ao = tdm_adamw_defaults();
    ao.lr = 0.01f;
    tdm_optim *opt = tdm_adam_new(ps, &ao);
    tdm_module *units[8];
    /* stage 3 through FSDP's constructor, stage 2 through DDP's calls */
    tdm_fsdp_opts fo = tdm_fsdp_defaults();
    fo.ddp.bucket_cap_bytes = fo.ddp.first_bucket_cap_bytes = 1024; /* across units, shards */
    fo.ddp.param_dtype = c->param_dtype;
    fo.units = units, fo.n_units = tdm_model_units(m, units, 8);
    tdm_fsdp *f = opt && c->stage3 ? tdm_fsdp_wrap(m, ctx->group, opt, &fo) : NULL;
    tdm_ddp *d = !opt ? NULL : c->stage3 ? tdm_fsdp_ddp(f) : tdm_ddp_new(m, ctx->group, &fo.ddp);
    if (!d) rc = tdm_last_status();
    if (!rc && !c->stage3) rc = tdm_ddp_set_shard(d, opt, TDM_SHARD_GRADIENTS);
    if (!rc) rc = gpt_steps(c, d, m, opt, r);
    c->params[r] = malloc(sizeof(float) * (size_t)ps->total);
    if (!rc) rc = tdm_ddp_gather_params(d);
    if (!rc) rc = tdm_to_host(ps->flat, c->params[r], sizeof(float) * (size_t)ps->total);
    if (!rc) rc = tdm_ddp_release_params(d);
    if (r == 0) c->total = ps->total, c->units = fo.n_units;
    tdm_optim_free(opt);
    if (f)
        tdm_fsdp_free(f); /* and its DDP */
    else
        tdm_ddp_free(d);
    tdm_module_free(m);
    return rc;
}

/* Whether every rank of c ends with want's parameters and evaluation, bit for bit. */
static void gpt_same(const gpt_case *c, const gpt_case *want, int n, const char *what) {
    for (int r = 0; r < n; r++) {
        CHECK(c->params[r] && want->params[r] &&
                  memcmp(c->params[r], want->params[r], sizeof(float) * (size_t)want->total) == 0,
              "%s, %d ranks: rank %d's parameters differ", what, n, r);
        CHECK(c->eval_sum[r] == want->eval_sum[r] && !isnan(c->eval_sum[r]),
              "%s, %d ranks: rank %d's logits sum to %.9g, expected %.9g", what, n, r,
              c->eval_sum[r], want->eval_sum[r]);
    }
}

/* A GPT under stage 3 (its 3 blocks the units; embeddings, the tied head and the final norm
 * the root unit) ends with stage 2's weights bit for bit on 2 and 3 ranks, with AdamW and
 * clipping, its blocks recomputed or not; a forward without autograd between steps gives
 * the same logits. */
static void test_zero3_gpt(void) {
    tdm_device devs[3] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2)};
    for (int n = 2; n <= 3; n++)
        for (int rec = 0; rec < 2; rec++) {
            gpt_case two = {.recompute = rec}, three = {.stage3 = true, .recompute = rec};
            CHECK(tdm_spawn(n, devs, gpt_rank, &two) == 0, "gpt, stage 2: %s", tdm_last_error());
            CHECK(tdm_spawn(n, devs, gpt_rank, &three) == 0, "gpt, stage 3 on %d ranks: %s", n,
                  tdm_last_error());
            CHECK(three.units == 3, "the GPT has %d units, expected its 3 blocks", three.units);
            gpt_same(&three, &two, n, rec ? "gpt, stage 3, recomputed" : "gpt, stage 3");
            for (int r = 0; r < 3; r++) free(two.params[r]), free(three.params[r]);
        }
}

/* Stage 3 gathering the parameters in bf16 (FSDP2's param_dtype), under bf16 autocast: every
 * rank's forward and backward compute with the parameters rounded to bf16, the optimizer
 * steps the f32 masters, so it ends bit for bit where stage 2 ends when each step rounds the
 * whole model before its forward and puts the f32 values back before the update (its layer
 * norms' and embeddings' weights included, which autocast alone leaves f32); and not where
 * stage 3's f32 gathers end. */
static void test_zero3_param_bf16(void) {
    tdm_device devs[3] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2)};
    for (int n = 2; n <= 3; n++) {
        gpt_case ref = {.amp = TDM_BF16, .round_ref = true},
                 low = {.stage3 = true, .amp = TDM_BF16, .param_dtype = TDM_BF16},
                 f32 = {.stage3 = true, .amp = TDM_BF16};
        CHECK(tdm_spawn(n, devs, gpt_rank, &ref) == 0, "reference: %s", tdm_last_error());
        CHECK(tdm_spawn(n, devs, gpt_rank, &low) == 0, "bf16 gathers on %d ranks: %s", n,
              tdm_last_error());
        CHECK(tdm_spawn(n, devs, gpt_rank, &f32) == 0, "f32 gathers: %s", tdm_last_error());
        gpt_same(&low, &ref, n, "gpt, stage 3 gathering bf16");
        CHECK(low.params[0] && f32.params[0] &&
                  memcmp(low.params[0], f32.params[0], sizeof(float) * (size_t)low.total) != 0,
              "%d ranks: bf16 gathers end where f32 gathers do: nothing was rounded", n);
        for (int r = 0; r < 3; r++) free(ref.params[r]), free(low.params[r]), free(f32.params[r]);
    }
}

/* ---- ZeRO errors ---------------------------------------------------------------------------- */

typedef enum { SHARD_TWICE, SHARD_NULL_ON_1, SHARD_SIZES_DIFFER, SAVE_SHARDED } zero_fault;

typedef struct {
    zero_fault fault;
    int rc[2];
    char err[2][400];
} zero_err_case;

/* Every rank records its own failure: the spawn itself succeeds, so both are seen. */
static int zero_err_rank(tdm_rank_ctx *ctx, void *arg) {
    zero_err_case *c = arg;
    int r = ctx->rank;
    tdm_module *m = make_mlp(1, c->fault == SHARD_SIZES_DIFFER && r == 1 ? HID + 1 : HID);
    tdm_optim *opt = make_adam_zero(tdm_module_parameters(m), NULL);
    int rc = tdm_optim_shard(c->fault == SHARD_NULL_ON_1 && r == 1 ? NULL : opt, ctx->group);
    if (!rc && c->fault == SHARD_TWICE) rc = tdm_optim_shard(opt, ctx->group);
    if (!rc && c->fault == SAVE_SHARDED) {
        char dir[200];
        snprintf(dir, sizeof dir, "%s/sharded-%d", tmpdir, r);
        rc = tdm_checkpoint_save(dir, &(tdm_train_state){.model = m, .optim = opt}, 0);
    }
    c->rc[r] = rc;
    snprintf(c->err[r], sizeof c->err[r], "%s", rc ? tdm_last_error() : "");
    tdm_optim_free(opt);
    tdm_module_free(m);
    return 0;
}

static void expect_zero_fault(zero_fault f, const char *want0, const char *want1) {
    zero_err_case c = {.fault = f};
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    CHECK(tdm_spawn(2, devs, zero_err_rank, &c) == 0, "fault %d: %s", f, tdm_last_error());
    CHECK(c.rc[0] && strstr(c.err[0], want0), "fault %d, rank 0: %d \"%s\", expected \"%s\"", f,
          c.rc[0], c.err[0], want0);
    CHECK(c.rc[1] && strstr(c.err[1], want1), "fault %d, rank 1: %d \"%s\", expected \"%s\"", f,
          c.rc[1], c.err[1], want1);
}

/* Stage 3's misuses on 2 ranks, each failing alike on both with its cause: units that overlap,
 * the model itself or a layer without parameters as a unit (case 0, 1, 2: one spawn each,
 * since a failed sharding aborts the group); once sharded (case 3), units named too late, a
 * lower kind, and saving the model whole without gathering it first (then it works). */
typedef struct {
    int c;
    char err[2][4][300];
} zero3_err_case;

static void note(zero3_err_case *c, int r, int k, int rc, const char *ok) {
    snprintf(c->err[r][k], 300, "%s", rc ? tdm_last_error() : ok);
}

static int zero3_err_rank(tdm_rank_ctx *ctx, void *arg) {
    zero3_err_case *c = arg;
    int r = ctx->rank;
    tdm_module *m = make_mlp(1, HID);
    tdm_optim *opt = make_adam_zero(tdm_module_parameters(m), NULL);
    tdm_module *units[3][2] = {{m->children[0], m->children[0]}, {m}, {m->children[1]}};
    tdm_fsdp_opts fo = tdm_fsdp_defaults();
    fo.units = units[0], fo.n_units = 2;
    /* case 0 through FSDP's constructor, which fails as the calls it makes do */
    tdm_fsdp *f = c->c ? NULL : tdm_fsdp_wrap(m, ctx->group, opt, &fo);
    tdm_ddp *d = c->c ? tdm_ddp_new(m, ctx->group, NULL) : tdm_fsdp_ddp(f);
    int rc = !c->c      ? (d ? TDM_OK : tdm_last_status())
             : c->c < 3 ? tdm_ddp_set_shard_units(d, units[c->c], 1)
                        : TDM_OK;
    if (!rc && c->c) rc = tdm_ddp_set_shard(d, opt, TDM_SHARD_PARAMETERS);
    if (c->c < 3) note(c, r, 0, rc, "no error");
    if (c->c == 3) {
        char path[200];
        snprintf(path, sizeof path, "%s/zero3-%d.safetensors", tmpdir, r);
        note(c, r, 0, tdm_ddp_set_shard_units(d, m->children, 1), "no error");
        note(c, r, 1, tdm_ddp_set_shard(d, opt, TDM_SHARD_GRADIENTS), "no error");
        note(c, r, 2, tdm_weights_save(path, m, NULL, 0), "no error");
        if (!rc) rc = tdm_ddp_gather_params(d);
        if (!rc) rc = tdm_weights_save(path, m, NULL, 0);
        if (!rc) rc = tdm_ddp_release_params(d);
        note(c, r, 3, rc, "saved whole");
    }
    tdm_optim_free(opt);
    if (f)
        tdm_fsdp_free(f); /* and its DDP */
    else
        tdm_ddp_free(d);
    tdm_module_free(m);
    return 0;
}

static void test_zero3_errors(void) {
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    const char *want[4][4] = {
        {"parameter '0.weight' is in two units (0 and 1)"},
        {"unit 0 is the model itself"},
        {"unit 0 (a ReLU) holds no parameters"},
        {"the parameters are sharded already; name the units before",
         "the parameters, gradients and optimizer state are sharded and stay so",
         "parameter '0.weight' holds no memory: the parameters are sharded (ZeRO stage 3); "
         "gather them first (tdm_ddp_gather_params)",
         "saved whole"}};
    for (int i = 0; i < 4; i++) {
        zero3_err_case c = {.c = i};
        CHECK(tdm_spawn(2, devs, zero3_err_rank, &c) == 0, "stage 3 misuse %d: %s", i,
              tdm_last_error());
        for (int k = 0; k < 4 && want[i][k]; k++)
            for (int r = 0; r < 2; r++)
                CHECK(strstr(c.err[r][k], want[i][k]),
                      "stage 3 misuse %d.%d, rank %d: \"%s\", expected \"%s\"", i, k, r,
                      c.err[r][k], want[i][k]);
    }
}

/* Sharding twice, a rank that cannot shard (every rank fails, none waits), a sharded state
 * saved as it is, loading a whole state of the wrong name or size, an unknown kind, and
 * DataParallel on one process's CPU devices under stages 1 and 2 (which hold the state once
 * already: the flag changes nothing). */
static void test_zero_errors(void) {
    expect_zero_fault(SHARD_TWICE, "optim_shard: the optimizer is sharded already",
                      "optim_shard: the optimizer is sharded already");
    expect_zero_fault(SHARD_NULL_ON_1, "1 other rank of the group could not shard",
                      "optim_shard: optimizer is NULL");
    expect_zero_fault(
        SHARD_SIZES_DIFFER, "1 other rank of the group could not shard",
        "rank 1's optimizer has 93 parameters and 3 state buffers, rank 0's 83 and 3");
    expect_zero_fault(SAVE_SHARDED,
                      "checkpoint_save: the optimizer is sharded (its state covers "
                      "[0, 48) of 83 elements)",
                      "[48, 83) of 83 elements); save its whole copy from tdm_optim_gather");
    tdm_module *m = make_mlp(1, HID);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *opt = make_adam_zero(ps, NULL);
    CHECK_ERROR(tdm_optim_shard(opt, NULL) != 0, "optim_shard: NULL group");
    tdm_tensor *whole = tdm_zeros(TDM_SHAPE(ps->total), TDM_F32, tdm_cpu(0));
    tdm_tensor *small = tdm_zeros(TDM_SHAPE(ps->total - 1), TDM_F32, tdm_cpu(0));
    CHECK(tdm_optim_state_load(opt, "exp_avg_sq", whole) == 0, "%s", tdm_last_error());
    CHECK_ERROR(tdm_optim_state_load(opt, "momentum_buffer", whole) != 0,
                "this adam optimizer has no state 'momentum_buffer'");
    CHECK_ERROR(tdm_optim_state_load(opt, "exp_avg", small) != 0,
                "'exp_avg' must be f32 [83] (the whole flat buffer), got f32 [82]");
    tdm_tensor_free(whole);
    tdm_tensor_free(small);
    tdm_optim_free(opt);
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    tdm_strategy *dp = tdm_strategy_data_parallel(m, devs, 2, NULL, make_adam_zero, NULL);
    CHECK(dp, "dp_new: %s", tdm_last_error());
    if (!dp) return;
    CHECK_ERROR(tdm_strategy_set_shard(dp, (tdm_shard_kind)7, NULL) != 0, "unknown kind 7");
    CHECK(tdm_strategy_set_shard(dp, TDM_SHARD_OPTIMIZER, NULL) == 0 &&
              tdm_strategy_shard(dp) == TDM_SHARD_OPTIMIZER,
          "one process's CPU devices accept --shard optimizer: %s", tdm_last_error());
    int64_t lo = -1, hi = -1;
    tdm_optim_shard_range(tdm_strategy_optim(dp, 0), &lo, &hi);
    CHECK(lo == 0 && hi == ps->total, "replica 0 keeps the whole state: [%lld, %lld)",
          (long long)lo, (long long)hi);
    CHECK_ERROR(tdm_strategy_set_shard(dp, TDM_SHARD_NONE, NULL) != 0, "is sharded and stays so");
    CHECK(tdm_strategy_set_shard(dp, TDM_SHARD_GRADIENTS, NULL) == 0 &&
              tdm_strategy_shard(dp) == TDM_SHARD_GRADIENTS,
          "one process's CPU devices accept --shard gradients: %s", tdm_last_error());
    CHECK_ERROR(tdm_strategy_set_shard(dp, TDM_SHARD_OPTIMIZER, NULL) != 0,
                "the gradients and optimizer state are sharded and stay so");
    tdm_optim *copy = tdm_strategy_optim_gather(dp);
    tdm_tensor *st[3];
    CHECK(copy && tdm_optim_state(copy, NULL, st, 3) == 3 && tdm_numel(st[2]) == ps->total,
          "dp_optim_gather: %s", tdm_last_error());
    tdm_optim_free(copy);
    tdm_strategy_free(dp);
    tdm_module_free(m);
}

/* ---- DataParallel ------------------------------------------------------------------------- */

static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    return tdm_cross_entropy(out, target, NULL);
}

/* The loss of one micro-batch of a step of *(int *)arg micro-batches. */
static tdm_tensor *ce_loss_accum(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    return tdm_mul_scalar(tdm_cross_entropy(out, target, NULL), 1.0f / (float)*(int *)arg);
}

/* DataParallel on 1-4 devices against one device: plain steps, gradient accumulation
 * (tdm_dp_accumulate), and clipping to a norm well below the gradients' (every step clips),
 * with both optimizers; on 2-4 devices also sharded by ZeRO stage 3 after the first step (the
 * replicas leave the shared-memory update, taking replica 0's optimizer state). */
static void test_data_parallel(void) {
    tdm_optim_factory makes[2] = {make_sgd, make_adam};
    struct {
        int accumulate;
        float clip;
    } modes[3] = {{1, 0}, {3, 0}, {2, 0.05f}};
    for (int k = 0; k < 2; k++)
        for (int md = 0; md < 3; md++) {
            int acc = modes[md].accumulate;
            float *want = reference(makes[k], acc, modes[md].clip);
            for (int run = 1; run <= 7; run++) {
                int n = run <= 4 ? run : run - 3;
                bool stage3 = run > 4;
                tdm_module *m = make_mlp(1, HID);
                tdm_device devs[4] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
                tdm_strategy *dp = tdm_strategy_data_parallel(m, devs, n, NULL, makes[k], NULL);
                CHECK(dp, "dp_new on %d devices: %s", n, tdm_last_error());
                if (!dp) continue;
                CHECK(tdm_strategy_set_clip_grad_norm(dp, modes[md].clip) == 0, "%s",
                      tdm_last_error());
                float x[B * IN], loss = NAN;
                int64_t y[B];
                for (int s = 0; s < STEPS; s++)
                    for (int a = 0; a < acc; a++) {
                        if (stage3 && s == 1 && a == 0) {
                            /* replica 0's optimizer is the only one until then: the others
                             * take its state and learning rate (set apart for a moment) */
                            tdm_optim *o0 = tdm_strategy_optim(dp, 0);
                            float lr = tdm_optim_lr(o0);
                            CHECK(!tdm_strategy_optim(dp, 1),
                                  "replica 1 has an optimizer of its own");
                            tdm_optim_set_lr(o0, 0.77f);
                            CHECK(tdm_strategy_set_shard(dp, TDM_SHARD_PARAMETERS, NULL) == 0,
                                  "dp stage 3 on %d devices: %s", n, tdm_last_error());
                            for (int r = 0; r < n; r++) {
                                tdm_optim *o = tdm_strategy_optim(dp, r);
                                CHECK(o && tdm_optim_lr(o) == 0.77f, "replica %d's optimizer", r);
                                tdm_optim_set_lr(o, lr);
                            }
                        }
                        batch_of(s * 10 + a, x, y);
                        tdm_scope_begin();
                        tdm_tensor *tx = tdm_from_data(TDM_SHAPE(B, IN), TDM_F32, tdm_cpu(0), x);
                        tdm_tensor *ty = tdm_from_data(TDM_SHAPE(B), TDM_I64, tdm_cpu(0), y);
                        int rc =
                            a + 1 < acc
                                ? tdm_strategy_accumulate(dp, tx, ty, ce_loss_accum, &acc, &loss)
                                : tdm_strategy_step(dp, tx, ty, ce_loss_accum, &acc, &loss);
                        tdm_scope_end();
                        CHECK(rc == 0 && isfinite(loss), "dp step: %s", tdm_last_error());
                    }
                CHECK(tdm_strategy_gather_params(dp) == 0, "%s", tdm_last_error());
                for (int r = 0; r < n; r++) {
                    tdm_paramset *ps = tdm_module_parameters(tdm_strategy_replica(dp, r));
                    float *p = malloc(sizeof(float) * (size_t)ps->total);
                    tdm_to_host(ps->flat, p, sizeof(float) * (size_t)ps->total);
                    CHECK(compare(p, want, ps->total, "dp") == 0,
                          "dp optimizer %d, accumulate %d, clip %g, %d devices%s: replica %d "
                          "matches one device",
                          k, acc, modes[md].clip, n, stage3 ? ", stage 3" : "", r);
                    free(p);
                }
                CHECK(tdm_strategy_release_params(dp) == 0, "%s", tdm_last_error());
                tdm_strategy_free(dp);
                tdm_module_free(m);
            }
            free(want);
        }
    tdm_module *m = make_mlp(1, HID);
    tdm_device twice[2] = {tdm_cpu(0), tdm_cpu(0)};
    CHECK_ERROR(tdm_dp_new(m, twice, 2, make_sgd, NULL) == NULL, "cpu:0 listed twice");
    tdm_device other[1] = {tdm_cpu(1)};
    CHECK_ERROR(tdm_dp_new(m, other, 1, make_sgd, NULL) == NULL, "the model is on cpu:0");
    tdm_dp *dp = tdm_dp_new(m, twice, 1, make_sgd, NULL);
    CHECK_ERROR(tdm_dp_set_clip_grad_norm(dp, -1.0f) != 0, "max_norm -1 must be >= 0");
    CHECK_ERROR(tdm_dp_accumulate(dp, NULL, NULL, ce_loss, NULL, NULL) != 0,
                "data_parallel accumulate: NULL argument");
    tdm_dp_free(dp);
    tdm_module_free(m);
}

/* DataParallel's reduce_dtype: refused where its CPU devices share memory (naming why);
 * under stage 3, where the replicas' DDPs reduce-scatter, bf16 moves their gradients rounded:
 * the weights leave the f32 run's (not bit for bit) and stay near one device's. */
static void test_data_parallel_reduce_bf16(void) {
    float *want = reference(make_sgd, 1, 0);
    float *got[2] = {NULL, NULL};
    int64_t total = 0;
    for (int low = 0; low < 2; low++) {
        tdm_module *m = make_mlp(1, HID);
        tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
        tdm_strategy *dp = tdm_strategy_data_parallel(m, devs, 2, NULL, make_sgd, NULL);
        CHECK_ERROR(tdm_strategy_set_reduce_dtype(dp, TDM_BF16) != 0,
                    "the CPU devices of one process average theirs in shared memory");
        CHECK(tdm_strategy_set_reduce_dtype(dp, TDM_F32) == 0, "f32: %s", tdm_last_error());
        CHECK(tdm_strategy_set_shard(dp, TDM_SHARD_PARAMETERS, NULL) == 0, "stage 3: %s",
              tdm_last_error());
        CHECK(tdm_strategy_set_reduce_dtype(dp, low ? TDM_BF16 : TDM_F32) == 0, "stage 3: %s",
              tdm_last_error());
        float x[B * IN], loss = NAN;
        int64_t y[B];
        int acc = 1;
        for (int s = 0; s < STEPS; s++) {
            batch_of(s * 10, x, y);
            tdm_scope_begin();
            tdm_tensor *tx = tdm_from_data(TDM_SHAPE(B, IN), TDM_F32, tdm_cpu(0), x);
            tdm_tensor *ty = tdm_from_data(TDM_SHAPE(B), TDM_I64, tdm_cpu(0), y);
            CHECK(tdm_strategy_step(dp, tx, ty, ce_loss_accum, &acc, &loss) == 0, "step: %s",
                  tdm_last_error());
            tdm_scope_end();
        }
        CHECK(tdm_strategy_gather_params(dp) == 0, "%s", tdm_last_error());
        tdm_paramset *ps = tdm_module_parameters(tdm_strategy_replica(dp, 0));
        total = ps->total;
        got[low] = malloc(sizeof(float) * (size_t)total);
        tdm_to_host(ps->flat, got[low], sizeof(float) * (size_t)total);
        CHECK(tdm_strategy_release_params(dp) == 0, "%s", tdm_last_error());
        tdm_strategy_free(dp);
        tdm_module_free(m);
    }
    int64_t moved = 0;
    double worst = 0;
    for (int64_t i = 0; i < total; i++) {
        moved += got[0][i] != got[1][i];
        worst = fmax(worst, fabs((double)got[1][i] - want[i]));
    }
    CHECK(compare(got[0], want, total, "dp stage 3 f32") == 0, "f32 reduce: not one device's");
    CHECK(moved > total / 4, "bf16 reduce moved %lld of %lld weights from the f32 run's",
          (long long)moved, (long long)total);
    /* SGD lr 0.1 for STEPS steps on gradients rounded to 2^-8 of their size (~1) */
    CHECK(worst < 1e-2, "bf16 reduce: a weight %.3g from one device's", worst);
    free(got[0]), free(got[1]), free(want);
}

/* ---- batch norm and dropout across devices ------------------------------------------------ */

#define CH      2 /* CNN input [B, CH, HW, HW] */
#define HW      6
#define MAX_ROW (CH * HW * HW)

typedef struct {
    const char *name;
    tdm_module *(*make)(uint64_t seed);
    tdm_shape row; /* one sample's shape */
} bn_model;

/* No bias before batch norm (as usual): its exact gradient is 0, and Adam would turn the
 * rounding noise left in it into full-size steps of either sign, on any number of devices. */
static tdm_module *make_bn_mlp(uint64_t seed) {
    tdm_rng r = tdm_rng_make(seed);
    tdm_module *l[5] = {tdm_linear_new(IN, HID, false, tdm_cpu(0), &r),
                        tdm_batch_norm1d_new(HID, 1e-5f, 0.1f, tdm_cpu(0)), tdm_relu_new(),
                        tdm_dropout_new(0.3f, &r), tdm_linear_new(HID, OUT, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(5, l);
}

static tdm_module *make_bn_cnn(uint64_t seed) {
    tdm_rng r = tdm_rng_make(seed);
    tdm_conv2d_opts c = {.pad_h = 1, .pad_w = 1};
    tdm_pool2d_opts p = {.kernel_h = 2, .kernel_w = 2};
    tdm_module *l[6] = {tdm_conv2d_new(CH, 4, 3, 3, &c, false, tdm_cpu(0), &r),
                        tdm_batch_norm2d_new(4, 1e-5f, 0.1f, tdm_cpu(0)),
                        tdm_relu_new(),
                        tdm_max_pool2d_new(&p),
                        tdm_flatten_new(1, -1),
                        tdm_linear_new(4 * (HW / 2) * (HW / 2), OUT, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(6, l);
}

static int64_t row_numel(const bn_model *bm) {
    int64_t n = 1;
    for (int i = 0; i < bm->row.ndim; i++) n *= bm->row.d[i];
    return n;
}

static tdm_shape rows_shape(const bn_model *bm, int64_t rows) {
    tdm_shape s = {bm->row.ndim + 1, {rows}};
    for (int i = 0; i < bm->row.ndim; i++) s.d[i + 1] = bm->row.d[i];
    return s;
}

/* Step s's global batch for bm: x [B, row...] (mean 0.5 so batch norm has a mean to remove). */
static void bn_batch_of(const bn_model *bm, int s, float *x, int64_t *y) {
    tdm_rng r = tdm_rng_make(200 + (uint64_t)s);
    tdm_scope_begin();
    tdm_to_host(tdm_randn(rows_shape(bm, B), 0.5f, 1, tdm_cpu(0), &r), x,
                sizeof(float) * (size_t)(B * row_numel(bm)));
    tdm_scope_end();
    for (int i = 0; i < B; i++) y[i] = (i * 5 + s) % OUT;
}

/* Parameters, then every buffer (running statistics, batch counts), as floats. */
static float *state_of(tdm_module *m, int64_t *n) {
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_bufferset *bs = tdm_module_buffers(m);
    int64_t total = ps->total;
    for (int i = 0; i < bs->n; i++) total += tdm_numel(bs->buffers[i]);
    float *v = malloc(sizeof(float) * (size_t)total);
    tdm_to_host(ps->flat, v, sizeof(float) * (size_t)ps->total);
    int64_t at = ps->total;
    for (int i = 0; i < bs->n; i++) {
        tdm_tensor *t = bs->buffers[i];
        if (t->dtype == TDM_F32)
            tdm_to_host(t, v + at, sizeof(float) * (size_t)tdm_numel(t));
        else /* num_batches_tracked */
            v[at] = tdm_item(t);
        at += tdm_numel(t);
    }
    *n = total;
    return v;
}

static float *bn_reference(const bn_model *bm, tdm_optim_factory make, int64_t *n) {
    tdm_module *m = bm->make(1);
    tdm_optim *opt = make(tdm_module_parameters(m), NULL);
    float x[B * MAX_ROW];
    int64_t y[B];
    for (int s = 0; s < STEPS; s++) {
        bn_batch_of(bm, s, x, y);
        tdm_optim_zero_grad(opt);
        tdm_scope_begin();
        tdm_tensor *l = tdm_cross_entropy(
            tdm_module_forward(m, tdm_from_data(rows_shape(bm, B), TDM_F32, tdm_cpu(0), x)),
            tdm_from_data(TDM_SHAPE(B), TDM_I64, tdm_cpu(0), y), NULL);
        tdm_backward(l);
        tdm_scope_end();
        tdm_optim_step(opt);
    }
    float *v = state_of(m, n);
    tdm_optim_free(opt);
    tdm_module_free(m);
    return v;
}

/* DataParallel with batch norm (synchronised over the replicas) and dropout (masks of the
 * global rows) ends where one device does: parameters and running statistics. */
static void test_data_parallel_bn_dropout(void) {
    bn_model models[2] = {
        {"Linear-BatchNorm1d-ReLU-Dropout-Linear", make_bn_mlp, TDM_SHAPE(IN)},
        {"Conv-BatchNorm2d-ReLU-MaxPool-Linear", make_bn_cnn, TDM_SHAPE(CH, HW, HW)}};
    tdm_optim_factory makes[2] = {make_sgd, make_adam};
    const char *opt_names[2] = {"sgd", "adam"};
    for (int mi = 0; mi < 2; mi++)
        for (int k = 0; k < 2; k++) {
            const bn_model *bm = &models[mi];
            int64_t n_want = 0;
            float *want = bn_reference(bm, makes[k], &n_want);
            for (int n = 1; n <= 4; n++) {
                tdm_module *m = bm->make(1);
                tdm_device devs[4] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
                tdm_dp *dp = tdm_dp_new(m, devs, n, makes[k], NULL);
                CHECK(dp, "dp_new on %d devices: %s", n, tdm_last_error());
                if (!dp) {
                    tdm_module_free(m);
                    continue;
                }
                float x[B * MAX_ROW], loss = NAN;
                int64_t y[B];
                for (int s = 0; s < STEPS; s++) {
                    bn_batch_of(bm, s, x, y);
                    tdm_scope_begin();
                    int rc = tdm_dp_step(
                        dp, tdm_from_data(rows_shape(bm, B), TDM_F32, tdm_cpu(0), x),
                        tdm_from_data(TDM_SHAPE(B), TDM_I64, tdm_cpu(0), y), ce_loss, NULL, &loss);
                    tdm_scope_end();
                    CHECK(rc == 0 && isfinite(loss), "dp %s step: %s", bm->name, tdm_last_error());
                }
                float *first = NULL;
                for (int r = 0; r < n; r++) {
                    int64_t got_n = 0;
                    float *got = state_of(tdm_dp_replica(dp, r), &got_n);
                    CHECK(got_n == n_want && compare(got, want, got_n, bm->name) == 0,
                          "dp %s, %s, %d devices: replica %d's parameters and buffers match one "
                          "device",
                          bm->name, opt_names[k], n, r);
                    if (r == 0)
                        first = got;
                    else {
                        CHECK(memcmp(got, first, sizeof(float) * (size_t)got_n) == 0,
                              "dp %s, %d devices: replica %d differs from replica 0", bm->name, n,
                              r);
                        free(got);
                    }
                }
                free(first);
                tdm_dp_free(dp);
                tdm_module_free(m);
            }
            free(want);
        }
}

/* tdm_dp_forward in eval mode gives replica 0's own forward of the whole batch (rows split
 * over 1-4 devices, also unevenly), keeps every replica's training mode, and runs a batch of
 * fewer rows than devices on replica 0. */
static void test_data_parallel_forward(void) {
    bn_model bm = {"Conv-BatchNorm2d-ReLU-MaxPool-Linear", make_bn_cnn, TDM_SHAPE(CH, HW, HW)};
    float x[B * MAX_ROW];
    int64_t y[B];
    for (int n = 1; n <= 4; n++) {
        tdm_module *m = bm.make(1);
        tdm_device devs[4] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
        tdm_dp *dp = tdm_dp_new(m, devs, n, make_sgd, NULL);
        CHECK(dp, "dp_new on %d devices: %s", n, tdm_last_error());
        if (!dp) {
            tdm_module_free(m);
            continue;
        }
        for (int s = 0; s < 2; s++) { /* running statistics away from their start */
            bn_batch_of(&bm, s, x, y);
            tdm_scope_begin();
            tdm_dp_step(dp, tdm_from_data(rows_shape(&bm, B), TDM_F32, tdm_cpu(0), x),
                        tdm_from_data(TDM_SHAPE(B), TDM_I64, tdm_cpu(0), y), ce_loss, NULL, NULL);
            tdm_scope_end();
        }
        tdm_module_train(m, false);
        bn_batch_of(&bm, 7, x, y);
        for (int64_t rows = B; rows >= B - 3 && rows > 0; rows -= 3) {
            float want[B * OUT], got[B * OUT];
            tdm_scope_begin();
            tdm_tensor *xs = tdm_from_data(rows_shape(&bm, rows), TDM_F32, tdm_cpu(0), x), *out;
            tdm_to_host(tdm_module_forward(m, xs), want, sizeof(float) * (size_t)(rows * OUT));
            int rc = tdm_dp_forward(dp, xs, &out);
            CHECK(rc == 0 && out && out->shape[0] == rows && out->shape[1] == OUT,
                  "dp_forward, %d devices, %lld rows: %s", n, (long long)rows, tdm_last_error());
            if (!rc) tdm_to_host(out, got, sizeof(float) * (size_t)(rows * OUT));
            tdm_scope_end();
            CHECK(!rc && compare(got, want, rows * OUT, "dp_forward") == 0,
                  "dp_forward on %d devices, %lld rows, equals replica 0's forward", n,
                  (long long)rows);
        }
        for (int r = 1; r < n; r++)
            CHECK(tdm_dp_replica(dp, r)->training, "replica %d keeps its training mode", r);
        tdm_scope_begin();
        tdm_tensor *one = tdm_from_data(rows_shape(&bm, 1), TDM_F32, tdm_cpu(0), x), *out = NULL;
        CHECK(tdm_dp_forward(dp, one, &out) == 0 && out && out->shape[0] == 1,
              "dp_forward of 1 row on %d devices: %s", n, tdm_last_error());
        tdm_scope_end();
        CHECK_ERROR(tdm_dp_forward(dp, NULL, &out) != 0, "NULL argument");
        tdm_dp_free(dp);
        tdm_module_free(m);
    }
}

/* ---- synchronised batch norm against one device on the concatenated batch ---------------- */

#define SB_N 5 /* rows: 3 on rank 0, 2 on rank 1 */
#define SB_C 3
#define SB_S 4 /* [N, C, 2, 2] */

typedef struct {
    int ndim; /* 2: [N, C]; 4: [N, C, 2, 2] */
    float x[SB_N * SB_C * SB_S], gy[SB_N * SB_C * SB_S], w[SB_C], b[SB_C];
    /* results: rows of y and gx at their global place; gw, gb, running stats per rank */
    float y[SB_N * SB_C * SB_S], gx[SB_N * SB_C * SB_S];
    float gw[2][SB_C], gb[2][SB_C], rm[2][SB_C], rv[2][SB_C];
} sbn_case;

static tdm_shape sbn_shape(const sbn_case *c, int64_t rows) {
    return c->ndim == 2 ? TDM_SHAPE(rows, SB_C) : TDM_SHAPE(rows, SB_C, 2, 2);
}

/* Batch norm of rows [lo, hi) with gradient gy; results stored into c at rank slot r. */
static int sbn_run(sbn_case *c, int r, int64_t lo, int64_t hi) {
    int64_t row = c->ndim == 2 ? SB_C : SB_C * SB_S, n = (hi - lo) * row;
    tdm_scope_begin();
    tdm_tensor *x = tdm_from_data(sbn_shape(c, hi - lo), TDM_F32, tdm_cpu(0), c->x + lo * row);
    tdm_tensor *gy = tdm_from_data(sbn_shape(c, hi - lo), TDM_F32, tdm_cpu(0), c->gy + lo * row);
    tdm_tensor *w = tdm_from_data(TDM_SHAPE(SB_C), TDM_F32, tdm_cpu(0), c->w);
    tdm_tensor *b = tdm_from_data(TDM_SHAPE(SB_C), TDM_F32, tdm_cpu(0), c->b);
    tdm_tensor *rm = tdm_full(TDM_SHAPE(SB_C), 0, TDM_F32, tdm_cpu(0));
    tdm_tensor *rv = tdm_full(TDM_SHAPE(SB_C), 1, TDM_F32, tdm_cpu(0));
    tdm_requires_grad_(x, true);
    tdm_requires_grad_(w, true);
    tdm_requires_grad_(b, true);
    tdm_tensor *y = tdm_batch_norm(x, rm, rv, w, b, true, 0.1f, 1e-5f);
    int rc = y ? tdm_backward(tdm_sum_all(tdm_mul(y, gy))) : tdm_last_status();
    if (!rc) {
        tdm_to_host(y, c->y + lo * row, sizeof(float) * (size_t)n);
        if (n) tdm_to_host(x->grad, c->gx + lo * row, sizeof(float) * (size_t)n);
        tdm_to_host(w->grad, c->gw[r], sizeof c->gw[r]);
        tdm_to_host(b->grad, c->gb[r], sizeof c->gb[r]);
        tdm_to_host(rm, c->rm[r], sizeof c->rm[r]);
        tdm_to_host(rv, c->rv[r], sizeof c->rv[r]);
    }
    tdm_scope_end();
    return rc;
}

static int sbn_rank(tdm_rank_ctx *ctx, void *arg) {
    sbn_case *c = arg;
    int64_t lo = ctx->rank ? 3 : 0, hi = ctx->rank ? SB_N : 3;
    int rc = tdm_parallel_context_set(ctx->group, lo, SB_N);
    if (!rc) rc = sbn_run(c, ctx->rank, lo, hi);
    tdm_parallel_context_clear();
    return rc;
}

static void test_sync_batch_norm_values(void) {
    for (int ndim = 2; ndim <= 4; ndim += 2) {
        sbn_case c = {.ndim = ndim}, one;
        tdm_rng r = tdm_rng_make(31 + (uint64_t)ndim);
        tdm_scope_begin();
        tdm_to_host(tdm_randn(TDM_SHAPE(SB_N * SB_C * SB_S), 2, 3, tdm_cpu(0), &r), c.x,
                    sizeof c.x);
        tdm_to_host(tdm_randn(TDM_SHAPE(SB_N * SB_C * SB_S), 0, 1, tdm_cpu(0), &r), c.gy,
                    sizeof c.gy);
        tdm_to_host(tdm_rand(TDM_SHAPE(SB_C), 0.5f, 1.5f, tdm_cpu(0), &r), c.w, sizeof c.w);
        tdm_to_host(tdm_randn(TDM_SHAPE(SB_C), 0, 1, tdm_cpu(0), &r), c.b, sizeof c.b);
        tdm_scope_end();
        one = c;
        CHECK(sbn_run(&one, 0, 0, SB_N) == 0, "one-device batch norm: %s", tdm_last_error());
        tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
        CHECK(tdm_spawn(2, devs, sbn_rank, &c) == 0, "sync batch norm: %s", tdm_last_error());
        int64_t n = SB_N * SB_C * (ndim == 2 ? 1 : SB_S);
        float gw[SB_C], gb[SB_C];
        for (int k = 0; k < SB_C; k++) { /* DDP sums (averages) the ranks' local gradients */
            gw[k] = c.gw[0][k] + c.gw[1][k];
            gb[k] = c.gb[0][k] + c.gb[1][k];
        }
        CHECK(compare(c.y, one.y, n, "sync bn y") == 0, "%dD sync batch norm output", ndim);
        CHECK(compare(c.gx, one.gx, n, "sync bn gx") == 0, "%dD sync batch norm dx", ndim);
        CHECK(compare(gw, one.gw[0], SB_C, "sync bn gw") == 0, "%dD weight gradient", ndim);
        CHECK(compare(gb, one.gb[0], SB_C, "sync bn gb") == 0, "%dD bias gradient", ndim);
        for (int rk = 0; rk < 2; rk++) {
            CHECK(compare(c.rm[rk], one.rm[0], SB_C, "running_mean") == 0 &&
                      compare(c.rv[rk], one.rv[0], SB_C, "running_var") == 0,
                  "%dD running statistics of rank %d", ndim, rk);
        }
    }
}

/* Rank 0 holds one row, rank 1 none: one value per channel over the group. */
static int sbn_tiny_rank(tdm_rank_ctx *ctx, void *arg) {
    int rc = tdm_parallel_context_set(ctx->group, ctx->rank, 1);
    tdm_scope_begin();
    tdm_tensor *x = tdm_ones(TDM_SHAPE(1 - ctx->rank, 3), TDM_F32, tdm_cpu(0));
    if (!rc && !tdm_batch_norm(x, NULL, NULL, NULL, NULL, true, 0.1f, 1e-5f))
        rc = tdm_last_status();
    tdm_scope_end();
    tdm_parallel_context_clear();
    return rc;
}

/* One row per rank is enough when the group has more than one value per channel. */
static int sbn_one_row_rank(tdm_rank_ctx *ctx, void *arg) {
    int rc = tdm_parallel_context_set(ctx->group, ctx->rank, 2);
    tdm_scope_begin();
    tdm_tensor *x = tdm_full(TDM_SHAPE(1, 3), (float)ctx->rank, TDM_F32, tdm_cpu(0));
    tdm_tensor *y = rc ? NULL : tdm_batch_norm(x, NULL, NULL, NULL, NULL, true, 0.1f, 0);
    float v[3] = {0};
    if (y) tdm_to_host(y, v, sizeof v);
    if (!rc && !y) rc = tdm_last_status();
    /* values 0 and 1: mean 0.5, biased variance 0.25, so -1 on rank 0 and +1 on rank 1 */
    float want = ctx->rank ? 1.0f : -1.0f;
    if (!rc && fabsf(v[0] - want) > 1e-5f) {
        fprintf(stderr, "rank %d: y %g, want %g\n", ctx->rank, v[0], want);
        rc = TDM_ERR_ARG;
    }
    tdm_scope_end();
    tdm_parallel_context_clear();
    return rc;
}

static void test_sync_batch_norm_edges(void) {
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    CHECK(tdm_spawn(2, devs, sbn_one_row_rank, NULL) == 0, "one row per rank: %s",
          tdm_last_error());
    CHECK_ERROR(tdm_spawn(2, devs, sbn_tiny_rank, NULL) != 0,
                "batch_norm: expected more than 1 value per channel when training, got 1 over "
                "2 ranks");
    CHECK_ERROR(tdm_parallel_context_set(NULL, 6, 5) != 0,
                "parallel_context_set: row0 6 is not in [0, global_rows 5]");
}

/* Dropout under a context draws the masks of its global rows and advances the generator by
 * the whole batch. */
static void test_dropout_rows(void) {
    tdm_rng whole_rng = tdm_rng_make(9), part_rng = tdm_rng_make(9);
    tdm_scope_begin();
    float whole[10 * 5], part[4 * 5];
    tdm_to_host(
        tdm_dropout(tdm_ones(TDM_SHAPE(10, 5), TDM_F32, tdm_cpu(0)), 0.5f, true, &whole_rng), whole,
        sizeof whole);
    CHECK(tdm_parallel_context_set(NULL, 3, 10) == 0, "%s", tdm_last_error());
    tdm_tensor *y =
        tdm_dropout(tdm_ones(TDM_SHAPE(4, 5), TDM_F32, tdm_cpu(0)), 0.5f, true, &part_rng);
    CHECK(y && tdm_to_host(y, part, sizeof part) == 0, "dropout under a context: %s",
          tdm_last_error());
    CHECK(y && memcmp(part, whole + 3 * 5, sizeof part) == 0,
          "rows 3..6 under a context get one device's masks for those rows");
    CHECK(part_rng.offset == whole_rng.offset, "the generator advanced by %llu, one device by %llu",
          (unsigned long long)part_rng.offset, (unsigned long long)whole_rng.offset);
    CHECK(tdm_parallel_context_set(NULL, 8, 10) == 0, "%s", tdm_last_error());
    CHECK_ERROR(!tdm_dropout(tdm_ones(TDM_SHAPE(4, 5), TDM_F32, tdm_cpu(0)), 0.5f, true, &part_rng),
                "dropout: input [4, 5] has 4 rows from global row 8, past the parallel "
                "context's 10 rows");
    tdm_parallel_context_clear();
    tdm_scope_end();
    /* two Dropout layers made from one generator draw different masks */
    tdm_rng r = tdm_rng_make(4);
    tdm_module *d1 = tdm_dropout_new(0.5f, &r), *d2 = tdm_dropout_new(0.5f, &r);
    tdm_scope_begin();
    tdm_tensor *x = tdm_ones(TDM_SHAPE(64), TDM_F32, tdm_cpu(0));
    float m1[64], m2[64];
    tdm_to_host(tdm_module_forward(d1, x), m1, sizeof m1);
    tdm_to_host(tdm_module_forward(d2, x), m2, sizeof m2);
    CHECK(memcmp(m1, m2, sizeof m1) != 0, "two Dropout layers from one generator share masks");
    tdm_scope_end();
    tdm_module_free(d1);
    tdm_module_free(d2);
}

int main(void) {
    if (tmpdir_make("test_ddp") != 0) return 1;
    test_ddp_equivalence();
    test_ddp_reduce_bf16();
    test_ddp_errors();
    test_zero();
    test_zero2();
    test_zero2_memory();
    test_zero3_gpt();
    test_zero3_param_bf16();
    test_data_parallel_reduce_bf16();
    test_zero3_errors();
    test_zero_errors();
    test_data_parallel();
    test_dropout_rows();
    test_sync_batch_norm_values();
    test_sync_batch_norm_edges();
    test_data_parallel_bn_dropout();
    test_data_parallel_forward();
    tmpdir_remove();
    return check_summary();
}
