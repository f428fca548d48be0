/* tdm_strategy: one device, DataParallel over two CPU devices, DDP over two ranks of a threads
 * group and a pipeline of two stages, each driven only through tdm_strategy_* calls, end with
 * the parameters of the same training written out by hand on one device (forward, backward,
 * accumulation over two micro-batches, clipping, the optimizer's step). Then what the trainer
 * reads from a strategy: where the loss runs, the description, the replicas' state, sharding
 * (the state split, the memory figures) and the errors of calls a strategy refuses. Mixed
 * precision: one device, DataParallel and DDP in bf16 (forward and loss in a bf16 region on
 * every replica's thread) against a hand-written bf16 loop, within BF16_SPLIT_BOUND; fp16's
 * loss scaler skipping an overflowing step, on one device and agreed by two DDP ranks (every
 * other strategy and ZeRO stage: test_scaler_parallel.c).
 *
 * Tolerance as test_pipeline.c's: the devices sum gradients in another order than one GEMM
 * over the whole batch (float32 rounding over a few SGD steps with momentum), 1e-5 absolute +
 * 1e-4 relative; a missed micro-batch, a lost clip or a wrong loss weight is 1e-3 and up. */
#include "check.h"
#include "tandem/autocast.h"

#define B         16 /* rows per micro-batch, even over 2 devices */
#define IN        64
#define HID       64
#define OUT       4
#define STEPS     3
#define ACCUM     2
#define CLIP      0.05f
#define MAXP      16384
#define LR        0.5f
#define AMP_STEPS STEPS
#define AMP_LR    0.05f
/* bf16 runs (AMP_STEPS steps at AMP_LR) on 2 devices or ranks against one: each half-batch's
 * weight gradient leaves its bf16 product rounded (2^-9 relative) before the fp32 average, where
 * one device rounds the whole sum once, so a gradient differs by up to ~2^-8 of its size and a
 * parameter by AMP_LR x (1 + 1.9 + 2.71, momentum 0.9) x 2^-8 x |g| = 1.1e-3 |g| after 3 steps.
 * Measured here: 5.7e-5. Replicas whose bf16 products raced (one oneDNN primitive run by two
 * threads at once) were 1.2e-3 to 5.9e-3 off, so the bound is set between the two. */
#define BF16_SPLIT_BOUND 4e-4f

/* Linear, BatchNorm1d, ReLU, Linear, Tanh, Linear: a Sequential a pipeline can cut, with a
 * layer whose result depends on the whole batch (batch norm over the global batch is what the
 * data-parallel strategies must give, and a pipeline of one micro-batch). */
static tdm_module *make_model(uint64_t seed) {
    tdm_rng r = tdm_rng_make(seed);
    tdm_module *l[6] = {tdm_linear_new(IN, HID, true, tdm_cpu(0), &r),
                        tdm_batch_norm1d_new(HID, 1e-5f, 0.1f, tdm_cpu(0)),
                        tdm_relu_new(),
                        tdm_linear_new(HID, HID, true, tdm_cpu(0), &r),
                        tdm_tanh_new(),
                        tdm_linear_new(HID, OUT, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(6, l);
}

static tdm_optim *make_sgd(tdm_paramset *ps, void *arg) {
    (void)arg;
    tdm_sgd_opts o = tdm_sgd_defaults(0.9f); /* every step sets LR */
    o.momentum = 0.9f;
    return tdm_sgd_new(ps, &o);
}

/* The mean cross-entropy of the rows, divided by the micro-batches of a step (arg: their
 * count, NULL for 1). */
static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0;
    tdm_tensor *l = tdm_cross_entropy(out, target, NULL);
    int k = arg ? *(int *)arg : 1;
    return l && k > 1 ? tdm_mul_scalar(l, 1.0f / (float)k) : l;
}

/* Micro-batch k of step s, rows [lo, hi) of it, in the caller's scope. */
static void batch_of(int s, int k, int64_t lo, int64_t hi, tdm_tensor **x, tdm_tensor **y) {
    tdm_rng r = tdm_rng_make(100 + (uint64_t)(s * 10 + k));
    tdm_tensor *xa = tdm_randn(TDM_SHAPE(B, IN), 0, 1, tdm_cpu(0), &r);
    int64_t t[B];
    for (int64_t i = 0; i < B; i++) t[i] = (i * 7 + s + k) % OUT;
    *x = tdm_contiguous(tdm_slice(xa, 0, lo, hi, 1));
    *y = tdm_from_data(TDM_SHAPE(hi - lo), TDM_I64, tdm_cpu(0), t + lo);
}

static int64_t params_of(tdm_module *m, float *out) {
    tdm_paramset *ps = tdm_module_parameters(m);
    if (!ps || ps->total > MAXP || tdm_to_host(ps->flat, out, sizeof(float) * (size_t)ps->total))
        return -1;
    return ps->total;
}

static int compare(const float *got, const float *want, int64_t n, const char *what) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!(fabsf(got[i] - want[i]) <= 1e-5f + 1e-4f * fabsf(want[i]))) {
            if (bad++ < 3)
                fprintf(stderr, "  %s: parameter element %lld is %.9g, by hand %.9g\n", what,
                        (long long)i, got[i], want[i]);
        }
    return bad;
}

/* The reference: micro-batches micro per step (each loss divided by micro), clipped at clip
 * (0: off), on one device, written out. */
static int64_t by_hand(int micro, float clip, float *want) {
    tdm_module *m = make_model(1);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *o = make_sgd(ps, NULL);
    for (int s = 0; s < STEPS; s++) {
        tdm_optim_set_lr(o, LR);
        tdm_optim_zero_grad(o);
        for (int k = 0; k < micro; k++) {
            tdm_scope_begin();
            tdm_tensor *x, *y;
            batch_of(s, k, 0, B, &x, &y);
            tdm_backward(ce_loss(tdm_module_forward(m, x), y, 0, &micro));
            tdm_scope_end();
        }
        if (clip > 0) tdm_clip_grad_norm(ps, clip, false, NULL);
        tdm_optim_step(o);
    }
    int64_t n = params_of(m, want);
    tdm_optim_free(o);
    tdm_module_free(m);
    return n;
}

/* STEPS steps of ACCUM micro-batches (rows [lo, hi) of each) through st only. */
static int train(tdm_strategy *st, int micro, int64_t lo, int64_t hi) {
    int rc = TDM_OK;
    for (int s = 0; s < STEPS && !rc; s++) {
        tdm_strategy_set_lr(st, LR);
        for (int k = 0; k < micro && !rc; k++) {
            tdm_scope_begin();
            tdm_tensor *x, *y;
            batch_of(s, k, lo, hi, &x, &y);
            rc = k + 1 < micro ? tdm_strategy_accumulate(st, x, y, ce_loss, &micro, NULL)
                               : tdm_strategy_step(st, x, y, ce_loss, &micro, NULL);
            tdm_scope_end();
        }
    }
    return rc;
}

static void test_one_device_and_data_parallel(const float *want, int64_t n) {
    float got[MAXP];
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    for (int which = 0; which < 2; which++) {
        const char *name = which ? "data parallel" : "one device";
        tdm_module *m = make_model(1);
        tdm_strategy *st = which ? tdm_strategy_data_parallel(m, devs, 2, NULL, make_sgd, NULL)
                                 : tdm_strategy_one_device(m, make_sgd, NULL);
        CHECK(st != NULL, "%s: %s", name, tdm_last_error());
        if (!st) continue;
        CHECK(tdm_strategy_set_clip_grad_norm(st, CLIP) == 0, "%s", tdm_last_error());
        CHECK(train(st, ACCUM, 0, B) == 0, "%s: %s", name, tdm_last_error());
        CHECK(params_of(tdm_strategy_replica(st, 0), got) == n, "%s", name);
        CHECK(compare(got, want, n, name) == 0, "%s: parameters off the hand-written loop", name);
        CHECK(tdm_strategy_replicas(st) == 1 + which, "%s", name);
        CHECK(tdm_strategy_ranks(st) == 1 + which, "%s", name);
        CHECK(tdm_strategy_loss_on_caller(st) == !which, "%s", name);
        CHECK(tdm_strategy_replica(st, 0) == m && tdm_strategy_replica(st, 2) == NULL, "%s", name);
        /* the CPU devices of one process: replica 0's optimizer steps them all */
        CHECK(tdm_strategy_optim(st, 0) != NULL && tdm_strategy_optim(st, 1) == NULL, "%s", name);
        char d[128];
        tdm_strategy_describe(st, B, d, sizeof d);
        CHECK(strcmp(d, which ? "data parallel, 8 samples per device per step" : "") == 0,
              "%s: '%s'", name, d);
        /* evaluation: the trained model's output, split over the devices or not */
        tdm_scope_begin();
        tdm_tensor *x, *y, *out = NULL;
        batch_of(9, 0, 0, B, &x, &y);
        tdm_module_train(m, false);
        CHECK(tdm_strategy_forward(st, x, &out) == 0 && out, "%s: %s", name, tdm_last_error());
        tdm_tensor *ref = tdm_module_forward(m, x);
        float a[B * OUT], b[B * OUT];
        if (out && ref && !tdm_to_host(out, a, sizeof a) && !tdm_to_host(ref, b, sizeof b))
            CHECK(compare(a, b, B * OUT, name) == 0, "%s: forward", name);
        tdm_scope_end();
        tdm_strategy_free(st);
        tdm_module_free(m);
    }
}

typedef struct {
    const float *want;
    int64_t n;
    int bad[2];
    bool split[2];
    int64_t gathered[2]; /* elements of the whole state tdm_strategy_optim_gather gave */
    tdm_strategy_memory mem[2];
} ddp_case;

/* Rank r of 2 trains its half of every micro-batch, then shards (ZeRO stage 2) and trains on. */
static int ddp_rank(tdm_rank_ctx *ctx, void *arg) {
    ddp_case *c = arg;
    int r = ctx->rank;
    tdm_module *m = make_model(1 + (uint64_t)r); /* rank 0's weights are broadcast */
    tdm_strategy *st = tdm_strategy_distributed(m, ctx->group, NULL, make_sgd, NULL);
    if (!st) return tdm_module_free(m), tdm_last_status();
    int rc = tdm_strategy_set_clip_grad_norm(st, CLIP);
    int64_t lo = r * B / 2, hi = lo + B / 2;
    if (!rc) rc = train(st, ACCUM, lo, hi);
    float got[MAXP];
    if (!rc && params_of(m, got) == c->n) c->bad[r] = compare(got, c->want, c->n, "ddp");
    if (!rc) rc = tdm_strategy_set_shard(st, TDM_SHARD_GRADIENTS, NULL);
    c->split[r] = tdm_strategy_state_split(st) && tdm_strategy_shard(st) == TDM_SHARD_GRADIENTS;
    tdm_strategy_memory_get(st, &c->mem[r]);
    tdm_optim *whole = rc ? NULL : tdm_strategy_optim_gather(st); /* a collective */
    tdm_tensor *state[2];
    if (whole && tdm_optim_state(whole, NULL, state, 2) == 1) c->gathered[r] = tdm_numel(state[0]);
    tdm_optim_free(whole);
    tdm_strategy_free(st);
    tdm_module_free(m);
    return rc;
}

static void test_distributed(const float *want, int64_t n) {
    ddp_case c = {.want = want, .n = n, .bad = {-1, -1}};
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    CHECK(tdm_spawn(2, devs, ddp_rank, &c) == 0, "%s", tdm_last_error());
    CHECK(c.bad[0] == 0 && c.bad[1] == 0, "ddp: %d and %d parameters off the hand-written loop",
          c.bad[0], c.bad[1]);
    CHECK(c.split[0] && c.split[1], "ddp: stage 2 not in effect");
    /* SGD with momentum: one state buffer; each rank keeps about half of it and of the grads */
    for (int r = 0; r < 2; r++) {
        CHECK(c.mem[r].state_whole == 4 * n && c.mem[r].grads_whole == 4 * n, "rank %d", r);
        CHECK(c.mem[r].state > 0 && c.mem[r].state < c.mem[r].state_whole, "rank %d: %lld", r,
              (long long)c.mem[r].state);
        CHECK(c.mem[r].grads == c.mem[r].state, "rank %d: grads %lld", r,
              (long long)c.mem[r].grads);
        CHECK(c.mem[r].params == 4 * n, "rank %d: parameters stay whole below stage 3", r);
    }
    CHECK(c.mem[0].state + c.mem[1].state == 4 * n, "the shards cover the state once");
    CHECK(c.gathered[0] == n && c.gathered[1] == n, "optim_gather: %lld and %lld elements of %lld",
          (long long)c.gathered[0], (long long)c.gathered[1], (long long)n);
}

static void test_pipeline(const float *want, int64_t n) {
    tdm_module *m = make_model(1);
    tdm_pipe_opts po = tdm_pipe_defaults(2, 1); /* batch norm sees the whole batch */
    po.split_by = TDM_SPLIT_LAYERS;
    tdm_strategy *st = tdm_strategy_pipeline(m, &po, make_sgd, NULL);
    CHECK(st != NULL, "pipeline: %s", tdm_last_error());
    if (!st) return tdm_module_free(m);
    CHECK(!tdm_strategy_loss_on_caller(st), "the last stage's thread runs the loss");
    CHECK(train(st, 1, 0, B) == 0, "pipeline: %s", tdm_last_error());
    float got[MAXP];
    CHECK(tdm_strategy_sync_model(st) == 0, "%s", tdm_last_error());
    CHECK(params_of(m, got) == n && compare(got, want, n, "pipeline") == 0,
          "pipeline: the model's parameters after sync_model are not the hand-written loop's");
    char d[128];
    tdm_strategy_describe(st, B, d, sizeof d);
    CHECK(strcmp(d, "2 pipeline stages, layers 0-2 3-5, 1 micro-batches, 1f1b") == 0, "'%s'", d);
    CHECK(tdm_strategy_optim(st, 0) != NULL && tdm_optim_lr(tdm_strategy_optim(st, 0)) == LR,
          "the first stage's optimizer");
    /* what a pipeline refuses, by name */
    tdm_scope_begin();
    tdm_tensor *x, *y;
    batch_of(0, 0, 0, B, &x, &y);
    CHECK_ERROR(tdm_strategy_accumulate(st, x, y, ce_loss, NULL, NULL) != 0, "pipeline");
    tdm_scope_end();
    CHECK(tdm_strategy_set_clip_grad_norm(st, 1.0f) == 0, "a pipeline clips: %s", tdm_last_error());
    CHECK(tdm_strategy_set_clip_grad_norm(st, 0) == 0, "0 is off: %s", tdm_last_error());
    /* one replica: nobody to share its state with */
    CHECK(tdm_strategy_set_shard(st, TDM_SHARD_OPTIMIZER, NULL) == 0 &&
              tdm_strategy_shard(st) == TDM_SHARD_NONE,
          "one replica shards nothing: %s", tdm_last_error());
    /* a checkpoint's way: the stages' weights and momentum whole (optim_gather), handed to a
     * pipeline of another model (push_whole, the model given m's values first), which then
     * trains as this one does, bit for bit */
    tdm_optim *whole = tdm_strategy_optim_gather(st);
    CHECK(whole && tdm_optim_steps(whole) == STEPS, "optim_gather: %s", tdm_last_error());
    tdm_module *m2 = make_model(2);
    tdm_strategy *st2 = tdm_strategy_pipeline(m2, &po, make_sgd, NULL);
    tdm_paramset *ps = tdm_module_parameters(m), *ps2 = tdm_module_parameters(m2);
    tdm_bufferset *bs = tdm_module_buffers(m), *bs2 = tdm_module_buffers(m2);
    int rc = st2 && whole ? tdm_copy_(ps2->flat, ps->flat) : TDM_ERR_STATE;
    for (int i = 0; i < bs->n && !rc; i++) rc = tdm_copy_(bs2->buffers[i], bs->buffers[i]);
    CHECK(!rc && tdm_strategy_push_whole(st2, whole) == 0, "push_whole: %s", tdm_last_error());
    CHECK(train(st, 1, 0, B) == 0 && train(st2, 1, 0, B) == 0, "%s", tdm_last_error());
    float got2[MAXP];
    CHECK(tdm_strategy_sync_model(st) == 0 && tdm_strategy_sync_model(st2) == 0, "sync");
    CHECK(params_of(m, got) == n && params_of(m2, got2) == n &&
              memcmp(got, got2, sizeof(float) * (size_t)n) == 0,
          "a pipeline given another's weights and state trains otherwise");
    tdm_optim_free(whole);
    tdm_strategy_free(st2);
    tdm_module_free(m2);
    tdm_strategy_free(st);
    tdm_module_free(m);
}

/* m's parameters and buffers into m2 (a model of the same layers). */
static int copy_model(tdm_module *m2, tdm_module *m) {
    tdm_paramset *ps = tdm_module_parameters(m), *ps2 = tdm_module_parameters(m2);
    tdm_bufferset *bs = tdm_module_buffers(m), *bs2 = tdm_module_buffers(m2);
    int rc = tdm_copy_(ps2->flat, ps->flat);
    for (int i = 0; i < bs->n && !rc; i++) rc = tdm_copy_(bs2->buffers[i], bs->buffers[i]);
    return rc;
}

/* ZeRO stage 1 over a pipeline's replicas (2 stages x 2 replicas, each stage's momentum
 * shared by its two replicas) trains as the unsharded pipeline does, bit for bit; its state
 * gathered whole (a checkpoint's) and handed to an unsharded pipeline, and the unsharded one's
 * to a sharded pipeline, each then steps as the one it came from. */
static void test_pipeline_sharded(int64_t n) {
    tdm_pipe_opts po = tdm_pipe_defaults(2, 1);
    po.split_by = TDM_SPLIT_LAYERS, po.replicas = 2;
    tdm_module *m[2];
    tdm_strategy *st[2];
    float got[2][MAXP];
    for (int k = 0; k < 2; k++) {
        m[k] = make_model(1);
        st[k] = tdm_strategy_pipeline(m[k], &po, make_sgd, NULL);
        CHECK(st[k] && (!k || (tdm_strategy_set_shard(st[k], TDM_SHARD_OPTIMIZER, NULL) == 0 &&
                               tdm_strategy_shard(st[k]) == TDM_SHARD_OPTIMIZER)),
              "pipeline of 2 replicas, sharded %d: %s", k, tdm_last_error());
        if (!st[k]) return;
        CHECK(train(st[k], 1, 0, B) == 0 && tdm_strategy_sync_model(st[k]) == 0, "%s",
              tdm_last_error());
        CHECK(params_of(m[k], got[k]) == n, "parameters");
    }
    CHECK(memcmp(got[0], got[1], sizeof(float) * (size_t)n) == 0,
          "ZeRO stage 1 over the replicas trains otherwise than the unsharded pipeline");
    tdm_tensor *mom[2];
    for (int k = 0; k < 2; k++) tdm_optim_state(tdm_strategy_optim(st[k], 0), NULL, &mom[k], 1);
    CHECK(tdm_numel(mom[1]) < tdm_numel(mom[0]), "the first stage's momentum: %lld of %lld",
          (long long)tdm_numel(mom[1]), (long long)tdm_numel(mom[0]));
    CHECK_ERROR(tdm_strategy_set_shard(st[1], TDM_SHARD_GRADIENTS, NULL) != 0, "stay whole");
    /* each one's state whole into a pipeline of the other kind, which then steps as it does */
    for (int k = 0; k < 2; k++) {
        tdm_optim *whole = tdm_strategy_optim_gather(st[k]);
        tdm_module *m2 = make_model(2);
        tdm_strategy *st2 = tdm_strategy_pipeline(m2, &po, make_sgd, NULL);
        int rc = whole && st2 ? copy_model(m2, m[k]) : TDM_ERR_STATE;
        if (!rc && !k) rc = tdm_strategy_set_shard(st2, TDM_SHARD_OPTIMIZER, NULL);
        if (!rc) rc = tdm_strategy_push_whole(st2, whole);
        if (!rc) rc = train(st[k], 1, 0, B) || train(st2, 1, 0, B);
        if (!rc) rc = tdm_strategy_sync_model(st[k]) || tdm_strategy_sync_model(st2);
        float again[MAXP];
        CHECK(!rc && params_of(m[k], got[k]) == n && params_of(m2, again) == n &&
                  memcmp(got[k], again, sizeof(float) * (size_t)n) == 0,
              "sharded %d: the state handed to a pipeline %ssharded trains otherwise (%s)", k,
              k ? "un" : "", tdm_last_error());
        tdm_optim_free(whole);
        tdm_strategy_free(st2);
        tdm_module_free(m2);
    }
    for (int k = 0; k < 2; k++) tdm_strategy_free(st[k]), tdm_module_free(m[k]);
}

static void test_one_device_settings(void) {
    tdm_module *m = make_model(1);
    tdm_strategy *st = tdm_strategy_one_device(m, make_sgd, NULL);
    /* nobody to share with: any kind is accepted and nothing is sharded */
    CHECK(tdm_strategy_set_shard(st, TDM_SHARD_PARAMETERS, NULL) == 0, "%s", tdm_last_error());
    CHECK(tdm_strategy_shard(st) == TDM_SHARD_NONE && !tdm_strategy_state_split(st), "sharded");
    CHECK(tdm_strategy_gather_params(st) == 0 && tdm_strategy_release_params(st) == 0, "no-ops");
    tdm_strategy_memory mem;
    tdm_strategy_memory_get(st, &mem);
    int64_t whole = 4 * tdm_module_parameters(m)->total;
    CHECK(mem.state == whole && mem.state_whole == whole && mem.grads == whole &&
              mem.params == whole,
          "one device holds everything whole");
    tdm_strategy_set_lr(st, 0.25f);
    CHECK(tdm_optim_lr(tdm_strategy_optim(st, 0)) == 0.25f, "set_lr");
    tdm_strategy_set_lr(st, NAN);
    CHECK(tdm_optim_lr(tdm_strategy_optim(st, 0)) == 0.25f, "NaN leaves the rate");
    CHECK_ERROR(tdm_strategy_set_clip_grad_norm(st, -1.0f) != 0, "max_norm -1");
    CHECK_ERROR(tdm_strategy_set_shard(st, (tdm_shard_kind)7, NULL) != 0, "unknown kind 7");
    CHECK_ERROR(tdm_strategy_step(st, NULL, NULL, ce_loss, NULL, NULL) != 0, "NULL batch");
    CHECK_ERROR(tdm_strategy_one_device(NULL, make_sgd, NULL) == NULL, "NULL model");
    CHECK_ERROR(tdm_strategy_data_parallel(m, NULL, 2, NULL, make_sgd, NULL) == NULL,
                "NULL devices");
    tdm_strategy_free(st);
    tdm_strategy_free(NULL);
    tdm_module_free(m);
}

/* ---- bf16: every strategy runs each replica's forward and loss in an autocast region ---- */

/* What the bf16 loss saw on the thread that ran it: its input's dtype (the last Linear's
 * output: bf16 under autocast, f32 without) and the thread's autocast dtype, per replica
 * (row0 0 or B / 2). */
typedef struct {
    _Atomic int out_dtype[2], region[2], calls;
} amp_seen;

static tdm_tensor *amp_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    amp_seen *seen = arg;
    int r = row0 > 0;
    if (out) seen->out_dtype[r] = (int)out->dtype;
    seen->region[r] = (int)tdm_autocast_dtype();
    seen->calls++;
    return tdm_cross_entropy(out, target, NULL);
}

/* The reference: the one-device loop of by_hand(1, 0) with forward and loss inside a bf16
 * region, backward outside. */
static int64_t by_hand_bf16(int steps, float *want) {
    tdm_module *m = make_model(1);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *o = make_sgd(ps, NULL);
    for (int s = 0; s < steps; s++) {
        tdm_optim_set_lr(o, AMP_LR);
        tdm_optim_zero_grad(o);
        tdm_scope_begin();
        tdm_tensor *x, *y;
        batch_of(s, 0, 0, B, &x, &y);
        tdm_autocast_begin(TDM_BF16);
        tdm_tensor *l = tdm_cross_entropy(tdm_module_forward(m, x), y, NULL);
        tdm_autocast_end();
        tdm_backward(l);
        tdm_scope_end();
        tdm_optim_step(o);
    }
    int64_t n = params_of(m, want);
    tdm_optim_free(o);
    tdm_module_free(m);
    return n;
}

/* Largest |got - want| over n parameters. */
static float max_diff(const float *got, const float *want, int64_t n) {
    float d = 0;
    for (int64_t i = 0; i < n; i++) d = fmaxf(d, fabsf(got[i] - want[i]));
    return isnan(d) ? INFINITY : d;
}

static int train_amp(tdm_strategy *st, int steps, amp_seen *seen, int64_t lo, int64_t hi) {
    int rc = TDM_OK;
    for (int s = 0; s < steps && !rc; s++) {
        tdm_strategy_set_lr(st, AMP_LR);
        tdm_scope_begin();
        tdm_tensor *x, *y;
        batch_of(s, 0, lo, hi, &x, &y);
        rc = tdm_strategy_step(st, x, y, amp_loss, seen, NULL);
        tdm_scope_end();
    }
    return rc;
}

/* One device and DataParallel over 2 CPU devices in bf16 against by_hand_bf16. */
static void test_bf16_one_device_and_data_parallel(const float *want, int64_t n) {
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    /* DataParallel three times: a race between the replicas' products shows in some runs */
    for (int run = 0; run < 4; run++) {
        int which = run > 0;
        const char *name = which ? "bf16 data parallel" : "bf16 one device";
        tdm_module *m = make_model(1);
        tdm_strategy *st = which ? tdm_strategy_data_parallel(m, devs, 2, NULL, make_sgd, NULL)
                                 : tdm_strategy_one_device(m, make_sgd, NULL);
        CHECK(st && tdm_strategy_set_precision(st, TDM_BF16) == 0, "%s: %s", name,
              tdm_last_error());
        if (!st) continue;
        CHECK(tdm_strategy_precision(st) == TDM_BF16 && !tdm_strategy_grad_scaler(st), "%s", name);
        amp_seen seen = {{-1, -1}, {-1, -1}, 0};
        CHECK(train_amp(st, AMP_STEPS, &seen, 0, B) == 0, "%s: %s", name, tdm_last_error());
        for (int r = 0; r <= which; r++) {
            CHECK(seen.out_dtype[r] == TDM_BF16, "%s: replica %d's forward gave %s", name, r,
                  seen.out_dtype[r] < 0 ? "nothing" : tdm_dtype_name(seen.out_dtype[r]));
            CHECK(seen.region[r] == TDM_BF16, "%s: replica %d's loss ran outside a region", name,
                  r);
        }
        CHECK(tdm_autocast_dtype() == TDM_F32, "%s: a region left open on the caller", name);
        float got[MAXP];
        CHECK(params_of(m, got) == n, "%s", name);
        float d = max_diff(got, want, n);
        CHECK(d <= (which ? BF16_SPLIT_BOUND : 0), "%s: parameters %g off the hand-written loop",
              name, d);
        if (run < 2) fprintf(stderr, "  %s: parameters within %g of the bf16 loop\n", name, d);
        CHECK(tdm_strategy_set_precision(st, TDM_F32) == 0, "%s: back to fp32", name);
        seen.out_dtype[0] = -1;
        CHECK(train_amp(st, AMP_STEPS, &seen, 0, B) == 0 && seen.out_dtype[0] == TDM_F32,
              "%s: fp32 again after set_precision(TDM_F32)", name);
        tdm_strategy_free(st);
        CHECK(m->pre_hook == NULL && m->post_hook == NULL, "%s: hooks left on the model", name);
        tdm_module_free(m);
    }
}

/* A pipeline of two stages in bf16: each stage's thread opens its region (the last stage's
 * output, which the loss gets, is bf16), and it still learns what the bf16 loop does. */
static void test_bf16_pipeline(const float *want, int64_t n) {
    tdm_module *m = make_model(1);
    tdm_pipe_opts po = tdm_pipe_defaults(2, 1);
    po.split_by = TDM_SPLIT_LAYERS;
    tdm_strategy *st = tdm_strategy_pipeline(m, &po, make_sgd, NULL);
    CHECK(st && tdm_strategy_set_precision(st, TDM_BF16) == 0, "bf16 pipeline: %s",
          tdm_last_error());
    if (!st) return tdm_module_free(m);
    amp_seen seen = {{-1, -1}, {-1, -1}, 0};
    CHECK(train_amp(st, AMP_STEPS, &seen, 0, B) == 0, "bf16 pipeline: %s", tdm_last_error());
    CHECK(seen.out_dtype[0] == TDM_BF16 && seen.region[0] == TDM_BF16,
          "bf16 pipeline: the last stage gave %s, its loss in region %d",
          seen.out_dtype[0] < 0 ? "nothing" : tdm_dtype_name(seen.out_dtype[0]), seen.region[0]);
    float got[MAXP];
    CHECK(tdm_strategy_sync_model(st) == 0 && params_of(m, got) == n, "%s", tdm_last_error());
    float d = max_diff(got, want, n);
    CHECK(d <= BF16_SPLIT_BOUND, "bf16 pipeline: parameters %g off the bf16 loop", d);
    tdm_strategy_free(st);
    tdm_module_free(m);
}

typedef struct {
    const float *want;
    int64_t n;
    float diff[2];
    amp_seen seen[2];
} ddp_amp_case;

/* Rank r of 2 trains its half of every batch in bf16 (DDP over a threads group). */
static int ddp_bf16_rank(tdm_rank_ctx *ctx, void *arg) {
    ddp_amp_case *c = arg;
    int r = ctx->rank;
    tdm_module *m = make_model(1 + (uint64_t)r); /* rank 0's weights are broadcast */
    tdm_strategy *st = tdm_strategy_distributed(m, ctx->group, NULL, make_sgd, NULL);
    if (!st) return tdm_module_free(m), tdm_last_status();
    int rc = tdm_strategy_set_precision(st, TDM_BF16);
    int64_t lo = r * B / 2, hi = lo + B / 2;
    c->seen[r] = (amp_seen){{-1, -1}, {-1, -1}, 0};
    if (!rc) rc = train_amp(st, AMP_STEPS, &c->seen[r], lo, hi);
    float got[MAXP];
    if (!rc && params_of(m, got) == c->n) c->diff[r] = max_diff(got, c->want, c->n);
    tdm_strategy_free(st);
    tdm_module_free(m);
    return rc;
}

static void test_bf16_distributed(const float *want, int64_t n) {
    ddp_amp_case c = {.want = want, .n = n, .diff = {INFINITY, INFINITY}};
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    CHECK(tdm_spawn(2, devs, ddp_bf16_rank, &c) == 0, "%s", tdm_last_error());
    for (int r = 0; r < 2; r++) {
        /* each rank's rows start at row0 0 of its own batch */
        CHECK(c.seen[r].out_dtype[0] == TDM_BF16 && c.seen[r].region[0] == TDM_BF16,
              "bf16 ddp: rank %d's forward or loss ran outside a bf16 region", r);
        CHECK(c.diff[r] <= BF16_SPLIT_BOUND, "bf16 ddp: rank %d's parameters %g off", r, c.diff[r]);
    }
    fprintf(stderr, "  bf16 ddp: parameters within %g and %g of the bf16 loop\n", c.diff[0],
            c.diff[1]);
}

/* ---- fp16: the loss scaler in the step ------------------------------------------------- */

/* Cross-entropy, multiplied by 1e30 on the rows of arg's rank (-1: none) at step arg's step:
 * times the scale it overflows f32, so that rank's gradient is inf or NaN. */
typedef struct {
    int step, overflow_step, overflow_rank, rank;
} f16_arg;

static tdm_tensor *f16_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0;
    f16_arg *a = arg;
    tdm_tensor *l = tdm_cross_entropy(out, target, NULL);
    bool blow = a->step == a->overflow_step && a->rank == a->overflow_rank;
    return l && blow ? tdm_mul_scalar(l, 1e30f) : l;
}

/* Steps 0..steps-1 on rows [lo, hi); skipped[s] says which the strategy skipped. */
static int train_f16(tdm_strategy *st, f16_arg *a, int steps, int64_t lo, int64_t hi,
                     bool *skipped) {
    int rc = TDM_OK;
    for (a->step = 0; a->step < steps && !rc; a->step++) {
        tdm_strategy_set_lr(st, AMP_LR);
        tdm_scope_begin();
        tdm_tensor *x, *y;
        batch_of(a->step, 0, lo, hi, &x, &y);
        rc = tdm_strategy_step(st, x, y, f16_loss, a, NULL);
        skipped[a->step] = tdm_strategy_step_skipped(st);
        tdm_scope_end();
    }
    return rc;
}

/* One device in f16: step 1 overflows and is skipped (parameters unchanged, the scale halved),
 * the others step; the scaler's state goes to a new strategy and back unchanged. */
static void test_f16_one_device(void) {
    tdm_module *m = make_model(1);
    tdm_strategy *st = tdm_strategy_one_device(m, make_sgd, NULL);
    CHECK(st && tdm_strategy_set_precision(st, TDM_F16) == 0, "f16: %s", tdm_last_error());
    if (!st) return tdm_module_free(m);
    tdm_grad_scaler *gs = tdm_strategy_grad_scaler(st);
    CHECK(gs && tdm_grad_scaler_get_scale(gs) == 65536.0f, "f16: a scaler at 65536");
    f16_arg a = {.overflow_step = 1, .overflow_rank = 0};
    bool skipped[3] = {true, false, true};
    float before[MAXP], after[MAXP];
    int64_t n = params_of(m, before);
    CHECK(train_f16(st, &a, 1, 0, B, skipped) == 0, "f16: %s", tdm_last_error());
    params_of(m, before);
    a.step = 1; /* the overflowing step alone, then one more */
    tdm_scope_begin();
    tdm_tensor *x, *y;
    batch_of(1, 0, 0, B, &x, &y);
    CHECK(tdm_strategy_step(st, x, y, f16_loss, &a, NULL) == 0, "f16: %s", tdm_last_error());
    skipped[1] = tdm_strategy_step_skipped(st);
    tdm_scope_end();
    CHECK(params_of(m, after) == n && max_diff(after, before, n) == 0,
          "f16: the overflowing step changed the parameters");
    CHECK(!skipped[0] && skipped[1], "f16: skipped %d %d, expected 0 1", skipped[0], skipped[1]);
    CHECK(tdm_grad_scaler_get_scale(gs) == 32768.0f, "f16: scale %g after the inf, not 32768",
          tdm_grad_scaler_get_scale(gs));
    a.overflow_step = -1;
    CHECK(train_f16(st, &a, 2, 0, B, skipped) == 0 && !skipped[0] && !skipped[1], "f16: %s",
          tdm_last_error());
    tdm_grad_scaler_state s0, s1;
    CHECK(tdm_grad_scaler_get_state(gs, &s0) == 0 && s0.scale == 32768.0f && s0.growth_tracker == 2,
          "f16: state %g, %d; expected 32768, 2", s0.scale, s0.growth_tracker);
    /* the state a checkpoint keeps, into another strategy */
    tdm_module *m2 = make_model(2);
    tdm_strategy *st2 = tdm_strategy_one_device(m2, make_sgd, NULL);
    CHECK(st2 && tdm_strategy_set_precision(st2, TDM_F16) == 0, "%s", tdm_last_error());
    tdm_grad_scaler *gs2 = tdm_strategy_grad_scaler(st2);
    CHECK(gs2 && tdm_grad_scaler_set_state(gs2, &s0) == 0, "%s", tdm_last_error());
    CHECK(tdm_grad_scaler_get_state(gs2, &s1) == 0 && s1.scale == s0.scale &&
              s1.growth_tracker == s0.growth_tracker,
          "f16: the scaler's state did not round-trip");
    /* bf16 needs no scaler; f32 none either */
    CHECK(tdm_strategy_set_precision(st2, TDM_BF16) == 0 && !tdm_strategy_grad_scaler(st2),
          "bf16 keeps no scaler");
    CHECK_ERROR(tdm_strategy_set_precision(st2, TDM_I64) != 0, "dtype i64 is not f32, bf16 or f16");
    CHECK(tdm_strategy_precision(st2) == TDM_BF16, "a refused precision changes nothing");
    tdm_strategy_free(st2);
    tdm_module_free(m2);
    tdm_strategy_free(st);
    tdm_module_free(m);
}

typedef struct {
    bool skipped[2][3];
    float scale[2];
    float params[2][MAXP];
    int64_t n[2];
} ddp_f16_case;

/* Rank r of 2 in f16; rank 1 alone overflows at step 1. */
static int ddp_f16_rank(tdm_rank_ctx *ctx, void *arg) {
    ddp_f16_case *c = arg;
    int r = ctx->rank;
    tdm_module *m = make_model(1);
    tdm_strategy *st = tdm_strategy_distributed(m, ctx->group, NULL, make_sgd, NULL);
    if (!st) return tdm_module_free(m), tdm_last_status();
    int rc = tdm_strategy_set_precision(st, TDM_F16);
    f16_arg a = {.overflow_step = 1, .overflow_rank = 1, .rank = r};
    int64_t lo = r * B / 2, hi = lo + B / 2;
    if (!rc) rc = train_f16(st, &a, 3, lo, hi, c->skipped[r]);
    c->scale[r] = tdm_grad_scaler_get_scale(tdm_strategy_grad_scaler(st));
    c->n[r] = params_of(m, c->params[r]);
    tdm_strategy_free(st);
    tdm_module_free(m);
    return rc;
}

/* The inf of one rank reaches the other through the averaged gradient: both skip step 1, both
 * back off, and their parameters stay equal. */
static void test_f16_distributed(void) {
    static ddp_f16_case c;
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    CHECK(tdm_spawn(2, devs, ddp_f16_rank, &c) == 0, "%s", tdm_last_error());
    for (int r = 0; r < 2; r++) {
        CHECK(!c.skipped[r][0] && c.skipped[r][1] && !c.skipped[r][2],
              "f16 ddp: rank %d skipped %d %d %d, expected 0 1 0", r, c.skipped[r][0],
              c.skipped[r][1], c.skipped[r][2]);
        CHECK(c.scale[r] == 32768.0f, "f16 ddp: rank %d's scale %g", r, c.scale[r]);
    }
    CHECK(c.n[0] > 0 && c.n[0] == c.n[1] && max_diff(c.params[0], c.params[1], c.n[0]) == 0,
          "f16 ddp: the ranks' parameters differ");
}

/* ---- replicas that agree --------------------------------------------------------------- */

/* Flips the lowest bit of element 0 of parameter i of m (a CPU model). */
static void flip_bit(tdm_module *m, int i) {
    tdm_paramset *ps = tdm_module_parameters(m);
    uint32_t *w = tdm_data_ptr(ps->params[i]);
    w[0] ^= 1u;
}

typedef struct {
    int rc[2];
    char msg[2][512];
} check_case;

/* Rank r of 2 (DDP): a step, a check that passes, rank 1's first weight changed by one bit,
 * a check that fails on both ranks. */
static int check_rank(tdm_rank_ctx *ctx, void *arg) {
    check_case *c = arg;
    int r = ctx->rank;
    tdm_module *m = make_model(1);
    tdm_strategy *st = tdm_strategy_distributed(m, ctx->group, NULL, make_sgd, NULL);
    int rc = st ? train(st, 1, r * B / 2, (r + 1) * B / 2) : tdm_last_status();
    if (!rc) rc = tdm_strategy_check_replicas(st, ctx->group);
    if (!rc && r == 1) flip_bit(m, 0);
    c->rc[r] = rc ? rc : tdm_strategy_check_replicas(st, ctx->group);
    snprintf(c->msg[r], sizeof c->msg[r], "%s", tdm_last_error());
    tdm_strategy_free(st);
    tdm_module_free(m);
    return 0;
}

/* tdm_strategy_check_replicas: equal replicas pass, one flipped bit is named (parameter,
 * rank, device) in DataParallel and on both DDP ranks; a pipeline is refused. */
static void test_check_replicas(void) {
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    tdm_module *m = make_model(1);
    tdm_strategy *st = tdm_strategy_data_parallel(m, devs, 2, NULL, make_sgd, NULL);
    CHECK(st && train(st, 1, 0, B) == 0 && tdm_strategy_check_replicas(st, NULL) == 0,
          "data parallel, equal replicas: %s", tdm_last_error());
    if (st) flip_bit(tdm_strategy_replica(st, 1), 7); /* the last Linear's bias */
    CHECK_ERROR(st && tdm_strategy_check_replicas(st, NULL) == TDM_ERR_STATE,
                "the replicas differ: parameter \"5.bias\" [4] of rank 1 (cpu:1) is not rank 0's "
                "(1 of 8 parameters differ)");
    tdm_strategy_free(st);
    tdm_module_free(m);
    static check_case c;
    CHECK(tdm_spawn(2, devs, check_rank, &c) == 0, "%s", tdm_last_error());
    for (int r = 0; r < 2; r++)
        CHECK(c.rc[r] == TDM_ERR_STATE &&
                  strstr(c.msg[r], "parameter \"0.weight\" [64, 64] of rank 1 is not rank 0's (1 "
                                   "of 8 parameters differ)"),
              "ddp rank %d: %d %s", r, c.rc[r], c.msg[r]);
    m = make_model(1);
    tdm_pipe_opts po = tdm_pipe_defaults(2, 1);
    po.split_by = TDM_SPLIT_LAYERS;
    st = tdm_strategy_pipeline(m, &po, make_sgd, NULL);
    CHECK_ERROR(st && tdm_strategy_check_replicas(st, NULL) == TDM_ERR_ARG,
                "a pipeline's stages hold different parameters");
    tdm_strategy_free(st);
    tdm_module_free(m);
}

int main(void) {
    float want[MAXP], want1[MAXP];
    int64_t n = by_hand(ACCUM, CLIP, want), n1 = by_hand(1, 0, want1);
    CHECK(n > 0 && n == n1, "the reference");
    test_one_device_and_data_parallel(want, n);
    test_distributed(want, n);
    test_pipeline(want1, n1);
    test_pipeline_sharded(n1);
    test_one_device_settings();
    float want_bf16[MAXP];
    CHECK(by_hand_bf16(AMP_STEPS, want_bf16) == n1, "the bf16 reference");
    test_bf16_one_device_and_data_parallel(want_bf16, n1);
    test_bf16_distributed(want_bf16, n1);
    test_bf16_pipeline(want_bf16, n1);
    test_f16_one_device();
    test_f16_distributed();
    test_check_replicas();
    return check_summary();
}
