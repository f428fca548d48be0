/* Optimizers, LR schedules and gradient clipping against PyTorch 1.13
 * (fixtures: tests/fixtures/gen_optim.py -> optim_fixtures.h). */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "optim/shard.h" /* tdm_optim_step_range_on */
#include "fixtures/optim_fixtures.h"
#include "fixtures/sched_fixtures.h"

/* A module holding the fixture's two parameters ([5, 6] and [7]), no forward. */
static const tdm_module_ops holder_ops = {"Holder", NULL, NULL};

static tdm_module *make_holder(void) {
    tdm_module *m = tdm_module_new(&holder_ops, tdm_cpu(0), NULL);
    tdm_tensor *a =
        tdm_from_data(TDM_SHAPE(optf_shape0[0], optf_shape0[1]), TDM_F32, tdm_cpu(0), optf_init);
    tdm_tensor *b = tdm_from_data(TDM_SHAPE(optf_shape1[0]), TDM_F32, tdm_cpu(0), optf_init + 30);
    tdm_module_add_param(m, "a", a);
    tdm_module_add_param(m, "b", b);
    return m;
}

/* Copies host values into a flat buffer. */
static void set_flat(tdm_tensor *flat, const float *v) {
    tdm_tensor *src = tdm_from_data(tdm_shape_of(flat), TDM_F32, flat->device, v);
    tdm_copy_(flat, src);
    tdm_tensor_free(src);
}

static tdm_optim *make_optim(tdm_paramset *ps, const optf_case *c) {
    if (c->kind == 0) {
        tdm_sgd_opts o = tdm_sgd_defaults(c->lr);
        o.momentum = c->momentum;
        o.dampening = c->dampening;
        o.weight_decay = c->weight_decay;
        o.nesterov = c->nesterov;
        o.maximize = c->maximize;
        return tdm_sgd_new(ps, &o);
    }
    tdm_adam_opts o = c->kind == 1 ? tdm_adam_defaults() : tdm_adamw_defaults();
    o.lr = c->lr;
    o.beta1 = c->beta1;
    o.beta2 = c->beta2;
    o.eps = c->eps;
    o.weight_decay = c->weight_decay;
    o.amsgrad = c->amsgrad;
    o.maximize = c->maximize;
    return c->kind == 1 ? tdm_adam_new(ps, &o) : tdm_adamw_new(ps, &o);
}

/* Ten steps with the fixture's gradients; every parameter checked after every step, both
 * through the flat buffer and through the parameter views. */
static void test_trajectories(void) {
    for (int ci = 0; ci < OPTF_NCASES; ci++) {
        const optf_case *c = &optf_cases[ci];
        tdm_module *m = make_holder();
        tdm_paramset *ps = tdm_module_parameters(m);
        CHECK(ps && ps->total == OPTF_NP, "%s: paramset: %s", c->name, tdm_last_error());
        if (!ps) continue;
        tdm_optim *o = make_optim(ps, c);
        CHECK(o != NULL, "%s: %s", c->name, tdm_last_error());
        if (!o) {
            tdm_module_free(m);
            continue;
        }
        int bad_steps = 0;
        for (int k = 0; k < OPTF_STEPS; k++) {
            set_flat(ps->flat_grad, optf_grads[k]);
            CHECK(tdm_optim_step(o) == TDM_OK, "%s step %d: %s", c->name, k, tdm_last_error());
            char what[96];
            snprintf(what, sizeof what, "%s after step %d", c->name, k + 1);
            bad_steps += check_tensor_close(ps->flat, c->expected[k], 2e-6, 2e-5, what) != 0;
        }
        CHECK(bad_steps == 0, "%s: %d steps differ from PyTorch", c->name, bad_steps);
        CHECK(tdm_optim_steps(o) == OPTF_STEPS, "%s: steps %lld", c->name,
              (long long)tdm_optim_steps(o));
        /* the views see the flat buffer's values */
        check_tensor_close(ps->params[1], c->expected[OPTF_STEPS - 1] + 30, 2e-6, 2e-5,
                           "param view b after the last step");
        tdm_optim_free(o);
        tdm_module_free(m);
    }
}

static void test_zero_grad_and_lr(void) {
    tdm_module *m = make_holder();
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *o = tdm_sgd_new(ps, &(tdm_sgd_opts){.lr = 0.5f});
    CHECK_CLOSE(tdm_optim_lr(o), 0.5, 0, 0);
    tdm_optim_set_lr(o, 0.25f);
    CHECK_CLOSE(tdm_optim_lr(o), 0.25, 0, 0);
    /* a plain SGD step with the new rate: p = p0 - 0.25 * g */
    set_flat(ps->flat_grad, optf_grads[0]);
    tdm_optim_step(o);
    float expect[OPTF_NP];
    for (int i = 0; i < OPTF_NP; i++) expect[i] = optf_init[i] - 0.25f * optf_grads[0][i];
    check_tensor_close(ps->flat, expect, 1e-6, 1e-6, "sgd step after set_lr");
    CHECK(tdm_optim_zero_grad(o) == TDM_OK, "%s", tdm_last_error());
    float zeros[OPTF_NP] = {0};
    check_tensor_close(ps->flat_grad, zeros, 0, 0, "flat_grad after zero_grad");
    check_tensor_close(ps->params[0]->grad, zeros, 0, 0, "a.grad after zero_grad");
    /* a schedule drives the optimizer's rate */
    tdm_sched s = {.kind = TDM_SCHED_STEP, .base_lr = 1.0f, .gamma = 0.1f, .step_size = 2};
    tdm_sched_apply(&s, o, 5);
    CHECK_CLOSE(tdm_optim_lr(o), 0.01, 1e-9, 1e-6);
    tdm_optim_free(o);
    tdm_module_free(m);
}

/* OneCycleLR and LinearLR-after-warmup against PyTorch at every step (relative 1e-6) */
static void test_onecycle_linear(void) {
    for (int ci = 0; ci < SCHEDF_NCASES; ci++) {
        const schedf_case *c = &schedf_cases[ci];
        int bad = 0;
        for (int t = 0; t < c->n; t++) {
            float lr = tdm_sched_lr(&c->s, t);
            if (!(fabs(lr - c->lr[t]) <= 1e-12 + 1e-6 * fabs(c->lr[t]))) {
                if (bad < 3)
                    fprintf(stderr, "FAIL sched %s t=%d: %.9g, torch %.9g\n", c->name, t, lr,
                            c->lr[t]);
                bad++;
            }
        }
        CHECK(bad == 0, "schedule %s: %d values differ from PyTorch", c->name, bad);
    }
    /* past total, ONECYCLE stays at its final rate (PyTorch raises) */
    const tdm_sched *oc = &schedf_cases[0].s;
    CHECK_CLOSE(tdm_sched_lr(oc, oc->total + 5), schedf_cases[0].lr[oc->total - 1], 0, 1e-6);
    /* defaults: div_factor 0 -> 25, final_div_factor 0 -> 1e4 */
    tdm_sched dflt = {.kind = TDM_SCHED_ONECYCLE, .base_lr = 0.1f, .total = 20, .pct_start = 0.3f};
    for (int t = 0; t < 20; t++) CHECK_CLOSE(tdm_sched_lr(&dflt, t), tdm_sched_lr(oc, t), 0, 1e-7);
    tdm_sched bad1 = {.kind = TDM_SCHED_ONECYCLE, .base_lr = 0.1f, .total = 4, .pct_start = 0.25f};
    CHECK_ERROR(isnan(tdm_sched_lr(&bad1, 0)), "empty phase");
    tdm_sched bad2 = {.kind = TDM_SCHED_ONECYCLE, .base_lr = 0.1f, .total = 0, .pct_start = 0.3f};
    CHECK_ERROR(isnan(tdm_sched_lr(&bad2, 0)), "total > 0");
    tdm_sched bad3 = {.kind = TDM_SCHED_LINEAR, .base_lr = 0.1f, .total = 10, .end_factor = 0};
    CHECK_ERROR(isnan(tdm_sched_lr(&bad3, 0)), "start_factor in (0, 1]");
    tdm_sched bad4 = {
        .kind = TDM_SCHED_LINEAR, .base_lr = 0.1f, .warmup = 10, .total = 10, .start_factor = 1};
    CHECK_ERROR(isnan(tdm_sched_lr(&bad4, 0)), "warmup < total");
}

static void test_schedules(void) {
    for (int si = 0; si < OPTF_NSCHEDS; si++) {
        const optf_sched_case *c = &optf_scheds[si];
        int bad = 0;
        for (int t = 0; t < c->n; t++) {
            float lr = tdm_sched_lr(&c->s, t);
            if (!(fabs(lr - c->lr[t]) <= 1e-9 + 2e-6 * fabs(c->lr[t]))) {
                if (bad < 3)
                    fprintf(stderr, "FAIL sched %s t=%d: %.9g, torch %.9g\n", c->name, t, lr,
                            c->lr[t]);
                bad++;
            }
        }
        CHECK(bad == 0, "schedule %s: %d values differ from PyTorch", c->name, bad);
    }
    /* cosine stays at min_lr after total (where CosineAnnealingLR would rise again) */
    tdm_sched cos = {
        .kind = TDM_SCHED_COSINE, .base_lr = 0.1f, .warmup = 2, .total = 10, .min_lr = 0.003f};
    CHECK_CLOSE(tdm_sched_lr(&cos, 10), 0.003, 1e-9, 0);
    CHECK_CLOSE(tdm_sched_lr(&cos, 17), 0.003, 1e-9, 0);
    tdm_sched cst = {.kind = TDM_SCHED_CONSTANT, .base_lr = 0.7f};
    CHECK_CLOSE(tdm_sched_lr(&cst, 123), 0.7f, 0, 0);
    /* invalid schedules: NAN and an error; apply leaves the rate alone */
    tdm_sched bad = {.kind = TDM_SCHED_STEP, .base_lr = 0.1f, .gamma = 0.5f, .step_size = 0};
    CHECK_ERROR(isnan(tdm_sched_lr(&bad, 3)), "step_size");
    tdm_sched badc = {.kind = TDM_SCHED_COSINE, .base_lr = 0.1f, .warmup = 5, .total = 3};
    CHECK_ERROR(isnan(tdm_sched_lr(&badc, 0)), "warmup <= total");
    tdm_module *m = make_holder();
    tdm_optim *o = tdm_sgd_new(tdm_module_parameters(m), &(tdm_sgd_opts){.lr = 0.5f});
    tdm_sched_apply(&bad, o, 1);
    tdm_clear_error();
    CHECK_CLOSE(tdm_optim_lr(o), 0.5, 0, 0);
    tdm_optim_free(o);
    tdm_module_free(m);
}

/* Decay on matrices only: with zero gradients, SGD (lr 1, decay 0.5) halves a Linear's
 * weight and leaves its bias, where one decay for all would halve both. */
static void test_decay_matrices_only(void) {
    tdm_rng rng = tdm_rng_make(3);
    tdm_module *m = tdm_linear_new(3, 2, true, tdm_cpu(0), &rng);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *o = tdm_sgd_new(ps, &(tdm_sgd_opts){.lr = 1.0f});
    CHECK(o && tdm_optim_decay_matrices_only(o, 0.5f) == TDM_OK, "%s", tdm_last_error());
    float before[8], after[8];
    tdm_to_host(ps->flat, before, sizeof before);
    tdm_optim_zero_grad(o);
    tdm_optim_step(o);
    tdm_to_host(ps->flat, after, sizeof after);
    int bad = 0;
    for (int i = 0; i < 8; i++) /* weight [2, 3] first, then bias [2] */
        bad += after[i] != (i < 6 ? before[i] - 0.5f * before[i] : before[i]);
    CHECK(bad == 0, "%d parameters not decayed as their dims say", bad);
    CHECK_ERROR(tdm_optim_decay_matrices_only(o, -1.0f) == TDM_ERR_ARG, "invalid weight_decay");
    CHECK_ERROR(tdm_optim_decay_matrices_only(NULL, 0.1f) == TDM_ERR_ARG, "optimizer is NULL");
    tdm_optim_free(o);
    tdm_module_free(m);
}

static void test_clip(void) {
    tdm_module *m = make_holder();
    tdm_paramset *ps = tdm_module_parameters(m);
    for (int k = 0; k < 2; k++) {
        const optf_clip_case *c = &optf_clips[k];
        set_flat(ps->flat_grad, optf_clip_grad);
        float norm = -1;
        CHECK(tdm_clip_grad_norm(ps, c->max_norm, true, &norm) == TDM_OK, "%s", tdm_last_error());
        CHECK_CLOSE(norm, c->norm, 0, 1e-6);
        check_tensor_close(ps->flat_grad, c->clipped, 1e-7, 1e-6, "clipped gradients");
    }
    /* a non-finite norm: an error, gradients unchanged */
    float g[OPTF_NP];
    memcpy(g, optf_clip_grad, sizeof g);
    g[3] = INFINITY;
    set_flat(ps->flat_grad, g);
    float norm = 0;
    CHECK_ERROR(tdm_clip_grad_norm(ps, 1.0f, true, &norm) == TDM_ERR_NUMERIC, "inf");
    CHECK(isinf(norm), "norm %g", norm);
    float after[OPTF_NP];
    tdm_to_host(ps->flat_grad, after, sizeof after);
    CHECK(memcmp(after, g, sizeof g) == 0, "gradients changed after a non-finite norm");
    /* without the error, PyTorch's factor max_norm/(inf + 1e-6) = 0 zeroes the finite ones */
    CHECK(tdm_clip_grad_norm(ps, 1.0f, false, &norm) == TDM_OK, "%s", tdm_last_error());
    float got[OPTF_NP];
    tdm_to_host(ps->flat_grad, got, sizeof got);
    CHECK(got[0] == 0 && got[OPTF_NP - 1] == 0 && isnan(got[3]), "%g %g %g", got[0],
          got[OPTF_NP - 1], got[3]);
    CHECK_ERROR(tdm_clip_grad_norm(ps, -1.0f, false, NULL) != TDM_OK, "max_norm");
    CHECK_ERROR(tdm_clip_grad_norm(NULL, 1.0f, false, NULL) != TDM_OK, "clip_grad_norm");
    tdm_module_free(m);
}

static void test_errors(void) {
    tdm_module *m = make_holder();
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_sgd_opts so = tdm_sgd_defaults(-0.1f);
    CHECK_ERROR(tdm_sgd_new(ps, &so) == NULL, "invalid learning rate: -0.1");
    so = tdm_sgd_defaults(0.1f);
    so.nesterov = true;
    CHECK_ERROR(tdm_sgd_new(ps, &so) == NULL, "nesterov momentum requires a momentum");
    so.momentum = 0.9f;
    so.dampening = 0.1f;
    CHECK_ERROR(tdm_sgd_new(ps, &so) == NULL, "zero dampening");
    so = tdm_sgd_defaults(0.1f);
    so.momentum = -1;
    CHECK_ERROR(tdm_sgd_new(ps, &so) == NULL, "invalid momentum");
    tdm_adam_opts ao = tdm_adam_defaults();
    ao.lr = -1e-3f;
    CHECK_ERROR(tdm_adam_new(ps, &ao) == NULL, "adam: invalid learning rate");
    ao = tdm_adamw_defaults();
    ao.beta1 = 1.0f;
    CHECK_ERROR(tdm_adamw_new(ps, &ao) == NULL, "adamw: invalid beta parameter at index 0");
    ao = tdm_adam_defaults();
    ao.beta2 = -0.5f;
    CHECK_ERROR(tdm_adam_new(ps, &ao) == NULL, "index 1");
    ao = tdm_adam_defaults();
    ao.eps = -1;
    CHECK_ERROR(tdm_adam_new(ps, &ao) == NULL, "epsilon");
    ao = tdm_adam_defaults();
    CHECK_ERROR(tdm_adam_new(NULL, &ao) == NULL, "parameter set is NULL");
    CHECK_ERROR(tdm_adam_new(ps, NULL) == NULL, "options are NULL");
    CHECK_ERROR(tdm_optim_step(NULL) != TDM_OK, "optimizer is NULL");
    /* defaults are PyTorch's */
    tdm_adam_opts d = tdm_adam_defaults(), dw = tdm_adamw_defaults();
    CHECK(d.lr == 1e-3f && d.beta1 == 0.9f && d.beta2 == 0.999f && d.eps == 1e-8f &&
              d.weight_decay == 0 && !d.amsgrad,
          "adam defaults");
    CHECK(dw.weight_decay == 1e-2f && dw.lr == 1e-3f, "adamw defaults");
    tdm_module_free(m);
}

/* tdm_optim_step_range_on (DataParallel's replicas each step their shard of their own
 * parameters with replica 0's optimizer): two ranges stepped on other buffers give the
 * optimizer's own whole step there, bit for bit, twice (Adam's state carried), and leave its
 * own buffers alone; buffers of another size and ranges outside are refused. */
static void test_step_range_on(void) {
    tdm_module *ma = make_holder(), *mb = make_holder();
    tdm_paramset *pa = tdm_module_parameters(ma), *pb = tdm_module_parameters(mb);
    int64_t n = pa->total;
    tdm_adam_opts o = tdm_adam_defaults();
    o.weight_decay = 0.01f;
    tdm_optim *a = tdm_adam_new(pa, &o), *b = tdm_adam_new(pb, &o);
    float g[64], init[64];
    for (int64_t i = 0; i < n; i++) g[i] = 0.01f * (float)(i - 17);
    memcpy(init, tdm_data_ptr(pb->flat), sizeof(float) * (size_t)n);
    tdm_tensor *p = tdm_from_data(TDM_SHAPE(n), TDM_F32, tdm_cpu(0), init);
    tdm_tensor *gr = tdm_from_data(TDM_SHAPE(n), TDM_F32, tdm_cpu(0), g);
    set_flat(pa->flat_grad, g);
    tdm_fill_(pb->flat_grad, 5.0f); /* b's own gradient must not be read */
    for (int step = 0; step < 2; step++) {
        CHECK(tdm_optim_step(a) == 0, "step: %s", tdm_last_error());
        CHECK(tdm_optim_step_range_on(b, 0, 20, p, gr) == 0 &&
                  tdm_optim_step_range_on(b, 20, n, p, gr) == 0,
              "step_range_on: %s", tdm_last_error());
        tdm_optim_set_steps(b, tdm_optim_steps(b) + 1); /* a whole step, counted by the caller */
        CHECK(memcmp(tdm_data_ptr(p), tdm_data_ptr(pa->flat), sizeof(float) * (size_t)n) == 0,
              "step %d: the ranges stepped on other buffers differ from the whole step", step);
    }
    CHECK(memcmp(tdm_data_ptr(pb->flat), init, sizeof(float) * (size_t)n) == 0,
          "step_range_on wrote the optimizer's own parameters");
    tdm_tensor *short_g = tdm_zeros(TDM_SHAPE(n - 1), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(tdm_optim_step_range_on(b, 0, 5, p, short_g) == TDM_ERR_SHAPE,
                "the gradients have 36 elements, the parameter set 37");
    CHECK_ERROR(tdm_optim_step_range_on(b, 30, n + 1, p, gr) == TDM_ERR_ARG,
                "[30, 38) is not within [0, 37)");
    tdm_tensor_free(short_g), tdm_tensor_free(p), tdm_tensor_free(gr);
    tdm_optim_free(a), tdm_optim_free(b);
    tdm_module_free(ma), tdm_module_free(mb);
}

int main(void) {
    test_trajectories();
    test_step_range_on();
    test_zero_grad_and_lr();
    test_schedules();
    test_onecycle_linear();
    test_decay_matrices_only();
    test_clip();
    test_errors();
    return check_summary();
}
