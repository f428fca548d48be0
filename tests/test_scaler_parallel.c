/* fp16's loss scaler across replicas: DataParallel on 2 and 3 CPU devices (the update split
 * into shards in shared memory), DataParallel across processes under ZeRO stage 2, and DDP
 * ranks under ZeRO stages 2 and 3, each in f16 through tdm_strategy_* only, end with the
 * parameters, skipped steps and scale of one device in f16 on the same global batches.
 *
 * The overflow is confined to one shard: at OVERFLOW_STEP the last replica's loss adds
 * BIG x sum(its last bias), so that bias's gradient alone is inf after scaling (2^16 x BIG
 * is over f32's range) and every other element stays finite. The last bias is the last
 * element range of the flat buffer, so it lies in the last replica's shard: a replica that
 * checked only its own shard (or only its own gradient) would step where one device skips,
 * and its parameters would leave the reference by a learning rate times a gradient (1e-3 and
 * up), far over the bound below.
 *
 * Bound: each replica's f16 weight gradient is rounded (2^-12 relative, 11 significant bits)
 * before the fp32 average, where one device rounds the whole batch's sum once, so a
 * gradient differs by up to ~2^-11 of its size; over STEPS steps of SGD with momentum 0.9 at
 * LR, a parameter differs by LR x (1 + 1.9 + 2.71 + 3.44) x 2^-11 x |g|, 5e-4 |g| at most;
 * |g| stays below 1 here. Measured: printed by the test. */
#include "check.h"

#include "ddp_common.h"
#include "tandem/pipeline.h"

#define F16_SPLIT_BOUND 5e-4f
#define OVERFLOW_STEP   1
#define NSTEPS          4
#define LR              0.1f
#define BIG             1e35f /* x 65536 = 6.6e39: over f32's 3.4e38 */

/* Who adds the overflowing term: the module whose last bias it reads, and the rows after
 * which its rows end (the last replica's end at B; a DDP rank's at its local batch). Under
 * ZeRO stage 3 the bias is whole only inside forward and backward, so there the whole loss
 * is multiplied by BIG instead (every gradient overflows; a skipped step leaves the
 * parameters as the reference's skip does, whatever overflowed). */
typedef struct {
    int step;
    tdm_module *last;
    int child; /* last's child holding the bias: 2 in the whole MLP, 0 in a pipeline's stage */
    int64_t end;
    bool whole;
} inf_arg;

static tdm_tensor *inf_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    inf_arg *a = arg;
    tdm_tensor *l = tdm_cross_entropy(out, target, NULL);
    if (!l || a->step != OVERFLOW_STEP || !a->last || row0 + out->shape[0] != a->end) return l;
    if (a->whole) return tdm_mul_scalar(l, BIG);
    tdm_tensor *bias = a->last->children[a->child]->params[1]; /* Linear(HID, OUT)'s */
    return tdm_add(l, tdm_mul_scalar(tdm_sum_all(bias), BIG));
}

static tdm_optim *make_sgd(tdm_paramset *ps, void *arg) {
    (void)arg;
    tdm_sgd_opts o = tdm_sgd_defaults(LR);
    o.momentum = 0.9f;
    return tdm_sgd_new(ps, &o);
}

typedef struct {
    float params[256];
    int64_t n;
    bool skipped[NSTEPS];
    float scale;
    int32_t tracker;
} outcome;

/* NSTEPS steps of rows [lo, hi) of each global batch through st in f16; a->last set by the
 * caller (NULL: nobody overflows). */
static int train(tdm_strategy *st, tdm_module *m, inf_arg *a, int64_t lo, int64_t hi, outcome *o) {
    int rc = tdm_strategy_set_precision(st, TDM_F16);
    float x[B * IN];
    int64_t y[B];
    for (a->step = 0; a->step < NSTEPS && !rc; a->step++) {
        batch_of(a->step, x, y);
        tdm_scope_begin();
        tdm_tensor *xs = tdm_from_data(TDM_SHAPE(hi - lo, IN), TDM_F32, tdm_cpu(0), x + lo * IN);
        tdm_tensor *ys = tdm_from_data(TDM_SHAPE(hi - lo), TDM_I64, tdm_cpu(0), y + lo);
        rc = tdm_strategy_step(st, xs, ys, inf_loss, a, NULL);
        o->skipped[a->step] = tdm_strategy_step_skipped(st);
        tdm_scope_end();
    }
    tdm_grad_scaler_state s = {0};
    if (!rc) rc = tdm_grad_scaler_get_state(tdm_strategy_grad_scaler(st), &s);
    o->scale = s.scale, o->tracker = s.growth_tracker;
    if (!rc) rc = tdm_strategy_sync_model(st);
    if (!rc) rc = tdm_strategy_gather_params(st); /* whole under ZeRO stage 3 */
    tdm_paramset *ps = tdm_module_parameters(m);
    o->n = ps && ps->total <= 256 ? ps->total : -1;
    if (o->n > 0) tdm_to_host(ps->flat, o->params, sizeof(float) * (size_t)o->n);
    return rc;
}

/* The reference: one device in f16, the whole batch, the same overflow. */
static void one_device(outcome *o) {
    tdm_module *m = make_mlp(1, HID);
    tdm_strategy *st = tdm_strategy_one_device(m, make_sgd, NULL);
    inf_arg a = {.last = m, .child = 2, .end = B};
    CHECK(st && train(st, m, &a, 0, B, o) == 0, "one device: %s", tdm_last_error());
    tdm_strategy_free(st);
    tdm_module_free(m);
}

/* got against the one-device run: the same skipped steps and scale, parameters within the
 * bound; returns the largest parameter difference. */
static float check_outcome(const outcome *got, const outcome *want, const char *what) {
    CHECK(got->n == want->n && got->n > 0, "%s: %lld parameters, one device %lld", what,
          (long long)got->n, (long long)want->n);
    for (int s = 0; s < NSTEPS; s++)
        CHECK(got->skipped[s] == want->skipped[s], "%s: step %d %s, one device's %s", what, s,
              got->skipped[s] ? "skipped" : "stepped", want->skipped[s] ? "skipped" : "stepped");
    CHECK(got->scale == want->scale && got->tracker == want->tracker,
          "%s: scale %g tracker %d, one device %g %d", what, got->scale, got->tracker, want->scale,
          want->tracker);
    float d = 0;
    for (int64_t i = 0; i < got->n && got->n == want->n; i++)
        d = fmaxf(d, fabsf(got->params[i] - want->params[i]));
    d = isnan(d) ? INFINITY : d;
    CHECK(d <= F16_SPLIT_BOUND, "%s: parameters %g off one device's", what, d);
    fprintf(stderr, "  %s: parameters within %g of one device's\n", what, d);
    return d;
}

static void test_data_parallel(const outcome *want) {
    tdm_device devs[3] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2)};
    for (int n = 2; n <= 3; n++) {
        tdm_module *m = make_mlp(1, HID);
        tdm_strategy *st = tdm_strategy_data_parallel(m, devs, n, NULL, make_sgd, NULL);
        inf_arg a = {.last = st ? tdm_strategy_replica(st, n - 1) : NULL, .child = 2, .end = B};
        outcome got = {0};
        char what[64];
        snprintf(what, sizeof what, "data parallel on %d devices", n);
        CHECK(st && train(st, m, &a, 0, B, &got) == 0, "%s: %s", what, tdm_last_error());
        check_outcome(&got, want, what);
        tdm_strategy_free(st);
        tdm_module_free(m);
    }
}

/* Rank r of a spawn: a DDP strategy, or DataParallel with this rank's device as a process's
 * (the update unsharded, every replica checking the averaged gradient), sharded at `kind`. */
typedef struct {
    bool data_parallel;
    tdm_shard_kind kind;
    outcome got[2];
} rank_case;

static int rank_main(tdm_rank_ctx *ctx, void *arg) {
    rank_case *c = arg;
    int r = ctx->rank, n = tdm_group_size(ctx->group);
    tdm_device cpu0 = tdm_cpu(0); /* each process's first device, as under mpirun */
    tdm_module *m = make_mlp(1, HID);
    tdm_strategy *st = c->data_parallel
                           ? tdm_strategy_data_parallel(m, &cpu0, 1, ctx->group, make_sgd, NULL)
                           : tdm_strategy_distributed(m, ctx->group, NULL, make_sgd, NULL);
    if (!st) return tdm_module_free(m), tdm_last_status();
    int rc = tdm_strategy_set_shard(st, c->kind, NULL);
    int64_t lo = (int64_t)r * B / n, hi = (int64_t)(r + 1) * B / n;
    inf_arg a = {.last = r == n - 1 ? m : NULL,
                 .child = 2,
                 .end = hi - lo, /* the loss sees this process's rows only */
                 .whole = c->kind == TDM_SHARD_PARAMETERS};
    if (!rc) rc = train(st, m, &a, lo, hi, &c->got[r]);
    tdm_strategy_free(st);
    tdm_module_free(m);
    return rc;
}

static void test_ranks(const outcome *want) {
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    struct {
        bool dp;
        tdm_shard_kind kind;
        const char *what;
    } runs[] = {{false, TDM_SHARD_GRADIENTS, "ddp, ZeRO stage 2"},
                {false, TDM_SHARD_PARAMETERS, "ddp, ZeRO stage 3"},
                {true, TDM_SHARD_NONE, "data parallel over processes"},
                {true, TDM_SHARD_GRADIENTS, "data parallel over processes, ZeRO stage 2"}};
    for (size_t k = 0; k < sizeof runs / sizeof runs[0]; k++) {
        rank_case c = {.data_parallel = runs[k].dp, .kind = runs[k].kind};
        CHECK(tdm_spawn(2, devs, rank_main, &c) == 0, "%s: %s", runs[k].what, tdm_last_error());
        for (int r = 0; r < 2; r++) {
            char what[96];
            snprintf(what, sizeof what, "%s, rank %d", runs[k].what, r);
            check_outcome(&c.got[r], want, what);
        }
    }
}

/* The raw pipelines' reference: one device in f32, by hand, with a scaler and the overflow. */
static void one_device_f32(outcome *o) {
    tdm_module *m = make_mlp(1, HID);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *opt = make_sgd(ps, NULL);
    tdm_grad_scaler *gs = tdm_grad_scaler_new(NULL);
    inf_arg a = {.last = m, .child = 2, .end = B};
    float x[B * IN];
    int64_t y[B];
    int rc = TDM_OK;
    for (a.step = 0; a.step < NSTEPS && !rc; a.step++) {
        batch_of(a.step, x, y);
        rc = tdm_optim_zero_grad(opt);
        tdm_scope_begin();
        tdm_tensor *xs = tdm_from_data(TDM_SHAPE(B, IN), TDM_F32, tdm_cpu(0), x);
        tdm_tensor *ys = tdm_from_data(TDM_SHAPE(B), TDM_I64, tdm_cpu(0), y);
        tdm_tensor *l = inf_loss(tdm_module_forward(m, xs), ys, 0, &a);
        if (!rc) rc = tdm_backward(tdm_grad_scaler_scale(gs, l));
        tdm_scope_end();
        bool stepped = false;
        if (!rc) rc = tdm_grad_scaler_step(gs, opt, &stepped);
        if (!rc) rc = tdm_grad_scaler_update(gs);
        o->skipped[a.step] = !stepped;
    }
    CHECK(rc == 0, "one device, f32: %s", tdm_last_error());
    tdm_grad_scaler_state st = {0};
    tdm_grad_scaler_get_state(gs, &st);
    o->scale = st.scale, o->tracker = st.growth_tracker;
    o->n = ps->total;
    tdm_to_host(ps->flat, o->params, sizeof(float) * (size_t)o->n);
    tdm_grad_scaler_free(gs);
    tdm_optim_free(opt);
    tdm_module_free(m);
}

/* A pipeline (tdm_pipe) of two stages, one or two replicas, two micro-batches, in f32 with a
 * scaler: the overflow is in the last stage's bias alone, so the first stage's gradient is
 * finite and it must skip only because the others found the inf. */
static void test_pipe(const outcome *want, int replicas) {
    tdm_module *m = make_mlp(1, HID);
    tdm_pipe_opts po = tdm_pipe_defaults(2, 2);
    po.split_by = TDM_SPLIT_LAYERS; /* [Linear, ReLU] [Linear] */
    po.replicas = replicas;
    tdm_pipe *p = tdm_pipe_new(m, &po, make_sgd, NULL);
    tdm_grad_scaler *gs = tdm_grad_scaler_new(NULL);
    char what[64];
    snprintf(what, sizeof what, "pipeline, 2 stages x %d replica(s)", replicas);
    CHECK(p && gs && tdm_pipe_set_grad_scaler(p, gs) == 0, "%s: %s", what, tdm_last_error());
    inf_arg a = {
        .last = p ? tdm_pipe_stage_module(p, 1, replicas - 1) : NULL, .child = 0, .end = B};
    outcome got = {0};
    float x[B * IN];
    int64_t y[B];
    int rc = p && gs ? TDM_OK : TDM_ERR_ARG;
    for (a.step = 0; a.step < NSTEPS && !rc; a.step++) {
        batch_of(a.step, x, y);
        tdm_scope_begin();
        tdm_tensor *xs = tdm_from_data(TDM_SHAPE(B, IN), TDM_F32, tdm_cpu(0), x);
        tdm_tensor *ys = tdm_from_data(TDM_SHAPE(B), TDM_I64, tdm_cpu(0), y);
        rc = tdm_pipe_step(p, xs, ys, inf_loss, &a, NULL);
        got.skipped[a.step] = tdm_pipe_step_skipped(p);
        tdm_scope_end();
    }
    CHECK(rc == 0, "%s: %s", what, tdm_last_error());
    tdm_grad_scaler_state st = {0};
    if (!rc) rc = tdm_grad_scaler_get_state(gs, &st);
    got.scale = st.scale, got.tracker = st.growth_tracker;
    if (!rc) rc = tdm_pipe_copy_to(p, m);
    tdm_paramset *ps = rc ? NULL : tdm_module_parameters(m);
    got.n = ps ? ps->total : 0;
    if (ps) tdm_to_host(ps->flat, got.params, sizeof(float) * (size_t)got.n);
    check_outcome(&got, want, what);
    tdm_pipe_free(p);
    tdm_grad_scaler_free(gs);
    tdm_module_free(m);
}

/* The pipeline strategy in f16 (every gradient overflows at OVERFLOW_STEP): the strategy's
 * scaler reaches the stages and its skips and scale are one device's. */
static void test_pipeline_strategy(const outcome *want) {
    tdm_module *m = make_mlp(1, HID);
    tdm_pipe_opts po = tdm_pipe_defaults(2, 2);
    po.split_by = TDM_SPLIT_LAYERS;
    tdm_strategy *st = tdm_strategy_pipeline(m, &po, make_sgd, NULL);
    inf_arg a = {.whole = true, .last = m, .end = B};
    outcome got = {0};
    CHECK(st && train(st, m, &a, 0, B, &got) == 0, "pipeline strategy: %s", tdm_last_error());
    check_outcome(&got, want, "pipeline strategy, f16");
    tdm_strategy_free(st);
    tdm_module_free(m);
}

int main(void) {
    outcome want = {0};
    one_device(&want);
    CHECK(!want.skipped[0] && want.skipped[OVERFLOW_STEP] && !want.skipped[NSTEPS - 1] &&
              want.scale == 32768.0f && want.tracker == NSTEPS - OVERFLOW_STEP - 1,
          "one device: the overflowing step alone skipped, the scale backed off once (%g, %d)",
          want.scale, want.tracker);
    test_data_parallel(&want);
    test_ranks(&want);
    test_pipeline_strategy(&want);
    outcome want32 = {0};
    one_device_f32(&want32);
    CHECK(want32.skipped[OVERFLOW_STEP] && !want32.skipped[0], "one device, f32: skipped %d %d",
          want32.skipped[0], want32.skipped[OVERFLOW_STEP]);
    test_pipe(&want32, 1);
    test_pipe(&want32, 2);
    return check_summary();
}
