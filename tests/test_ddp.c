/* DDP and DataParallel: N replicas on N CPU devices end with the parameters of one device
 * trained on the same global batches (uneven splits, several bucket sizes, gradient
 * accumulation without sync), stay identical to each other, and fail clearly when the
 * replicas differ or a parameter gets no gradient.
 *
 * Tolerance: the replicas sum their slices' gradients in another order than one device
 * summing the whole batch, so results differ by float32 rounding, amplified a little by a
 * few optimizer steps: 1e-5 absolute + 1e-4 relative on parameters of order 0.1-1. */
#include "check.h"

#include <stdlib.h>

#define B 10     /* global batch: not divisible by 3 or 4 */
#define IN 6
#define HID 8
#define OUT 3
#define STEPS 3

static tdm_module *make_mlp(uint64_t seed, int64_t hidden) {
    tdm_rng r = tdm_rng_make(seed);
    tdm_module *l[3] = {tdm_linear_new(IN, hidden, true, tdm_cpu(0), &r), tdm_relu_new(),
                        tdm_linear_new(hidden, OUT, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(3, l);
}

/* Step s's global batch, the same for every rank and for the reference. */
static void batch_of(int s, float *x, int64_t *y) {
    tdm_rng r = tdm_rng_make(100 + (uint64_t)s);
    tdm_scope_begin();
    tdm_to_host(tdm_randn(TDM_SHAPE(B, IN), 0, 1, tdm_cpu(0), &r), x, sizeof(float) * B * IN);
    tdm_scope_end();
    for (int i = 0; i < B; i++) y[i] = (i * 7 + s) % OUT;
}

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

/* One device, whole batches: the reference parameters. */
static float *reference(tdm_optim_factory make, int accumulate) {
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
        tdm_optim_step(opt);
    }
    float *p = malloc(sizeof(float) * (size_t)ps->total);
    tdm_to_host(ps->flat, p, sizeof(float) * (size_t)ps->total);
    tdm_optim_free(opt);
    tdm_module_free(m);
    return p;
}

static int compare(const float *got, const float *want, int64_t n, const char *what) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!(fabsf(got[i] - want[i]) <= 1e-5f + 1e-4f * fabsf(want[i]))) {
            if (bad++ < 3)
                fprintf(stderr, "%s: parameter %lld = %.8g, one device %.8g\n", what,
                        (long long)i, got[i], want[i]);
        }
    return bad;
}

/* ---- DDP under tdm_spawn ------------------------------------------------------------------ */

typedef struct {
    tdm_optim_factory make;
    int accumulate;       /* micro-batches per step, the first ones without sync */
    int64_t bucket_cap;   /* bytes */
    const float *want;
    int bad[8];           /* per rank: parameters off the reference */
    float *params[8];     /* per rank: final parameters */
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
            tdm_tensor *xs = tdm_from_data(TDM_SHAPE(hi - lo, IN), TDM_F32, tdm_cpu(0), x + lo * IN);
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
    struct { tdm_optim_factory make; const char *name; int acc; int64_t cap; } cases[] = {
        {make_sgd, "sgd", 1, 25 << 20}, {make_adam, "adam", 1, 25 << 20},
        {make_sgd, "sgd, 64-byte buckets", 1, 64}, {make_sgd, "sgd, no_sync x2", 2, 25 << 20}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        float *want = reference(cases[k].make, cases[k].acc);
        for (int n = 1; n <= 4; n++) {
            ddp_case c = {cases[k].make, cases[k].acc, cases[k].cap, want, {0}, {0}, 0};
            tdm_device devs[4] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
            int rc = tdm_spawn(n, devs, ddp_rank, &c);
            CHECK(rc == 0, "ddp %s on %d ranks: %s", cases[k].name, n, tdm_last_error());
            for (int r = 0; r < n; r++) {
                CHECK(c.bad[r] == 0, "ddp %s, %d ranks, rank %d: %d parameters off one device",
                      cases[k].name, n, r, c.bad[r]);
                CHECK(c.params[r] && memcmp(c.params[r], c.params[0],
                                            sizeof(float) * (size_t)c.total) == 0,
                      "ddp %s, %d ranks: rank %d differs from rank 0", cases[k].name, n, r);
            }
            for (int r = 0; r < n; r++) free(c.params[r]);
        }
        free(want);
    }
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

/* ---- DataParallel ------------------------------------------------------------------------- */

static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    return tdm_cross_entropy(out, target, NULL);
}

static void test_data_parallel(void) {
    tdm_optim_factory makes[2] = {make_sgd, make_adam};
    for (int k = 0; k < 2; k++) {
        float *want = reference(makes[k], 1);
        for (int n = 1; n <= 4; n++) {
            tdm_module *m = make_mlp(1, HID);
            tdm_device devs[4] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
            tdm_dp *dp = tdm_dp_new(m, devs, n, makes[k], NULL);
            CHECK(dp, "dp_new on %d devices: %s", n, tdm_last_error());
            if (!dp) continue;
            float x[B * IN], loss = NAN;
            int64_t y[B];
            for (int s = 0; s < STEPS; s++) {
                batch_of(s * 10, x, y);
                tdm_scope_begin();
                int rc = tdm_dp_step(dp, tdm_from_data(TDM_SHAPE(B, IN), TDM_F32, tdm_cpu(0), x),
                                     tdm_from_data(TDM_SHAPE(B), TDM_I64, tdm_cpu(0), y), ce_loss,
                                     NULL, &loss);
                tdm_scope_end();
                CHECK(rc == 0 && isfinite(loss), "dp step: %s", tdm_last_error());
            }
            for (int r = 0; r < n; r++) {
                tdm_paramset *ps = tdm_module_parameters(tdm_dp_replica(dp, r));
                float *p = malloc(sizeof(float) * (size_t)ps->total);
                tdm_to_host(ps->flat, p, sizeof(float) * (size_t)ps->total);
                CHECK(compare(p, want, ps->total, "dp") == 0, "dp optimizer %d, %d devices, "
                      "replica %d matches one device", k, n, r);
                free(p);
            }
            tdm_dp_free(dp);
            tdm_module_free(m);
        }
        free(want);
    }
    tdm_module *m = make_mlp(1, HID);
    tdm_device twice[2] = {tdm_cpu(0), tdm_cpu(0)};
    CHECK_ERROR(tdm_dp_new(m, twice, 2, make_sgd, NULL) == NULL, "cpu:0 listed twice");
    tdm_device other[1] = {tdm_cpu(1)};
    CHECK_ERROR(tdm_dp_new(m, other, 1, make_sgd, NULL) == NULL, "the model is on cpu:0");
    tdm_module_free(m);
}

int main(void) {
    test_ddp_equivalence();
    test_ddp_errors();
    test_data_parallel();
    return check_summary();
}
