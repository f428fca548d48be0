/* tdm_grad_scaler against torch.amp.GradScaler (fixtures: tests/fixtures/gen_grad_scaler.py ->
 * grad_scaler_fixtures.h): 50 Adam steps with overflowing losses and injected infs and NaNs,
 * growth interval 3, a checkpoint round trip at step GSF_CKPT; then the scaled loss's
 * backward, the stage errors and the options' checks. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "fixtures/grad_scaler_fixtures.h"

/* A module holding the fixture's Linear(4, 3) parameters (weight, bias), no forward. */
static const tdm_module_ops holder_ops = {"Holder", NULL, NULL};

static tdm_module *make_holder(void) {
    tdm_module *m = tdm_module_new(&holder_ops, tdm_cpu(0), NULL);
    tdm_module_add_param(m, "weight", f32(TDM_SHAPE(3, 4), gsf_init));
    tdm_module_add_param(m, "bias", f32(TDM_SHAPE(3), gsf_init + 12));
    return m;
}

static void set_flat(tdm_tensor *flat, const float *v) {
    tdm_tensor *src = f32(tdm_shape_of(flat), v);
    tdm_copy_(flat, src);
    tdm_tensor_free(src);
}

/* Element-wise identical values (NaN equal to NaN, inf's sign kept); returns mismatches. */
static int count_unequal(const tdm_tensor *t, const float *want, int n, const char *what) {
    float got[GSF_NP];
    if (n > GSF_NP || tdm_to_host(t, got, (size_t)n * sizeof(float))) return n;
    int bad = 0;
    for (int i = 0; i < n; i++) {
        bool same = isnan(want[i]) ? isnan(got[i]) : got[i] == want[i];
        if (!same && bad++ < 3)
            fprintf(stderr, "FAIL %s: element %d = %.9g, expected %.9g\n", what, i, got[i],
                    want[i]);
    }
    return bad;
}

static tdm_grad_scaler *new_scaler(void) {
    tdm_grad_scaler_opts so = tdm_grad_scaler_defaults();
    so.growth_interval = GSF_GROWTH_INTERVAL;
    return tdm_grad_scaler_new(&so);
}

/* One step of the fixture's: scale, gradients as backward left them, unscale (explicit or in
 * step), step, update; every recorded value compared. Returns mismatches. */
static int replay_step(tdm_grad_scaler *s, tdm_optim *o, tdm_paramset *ps, int k) {
    const gsf_step *r = &gsf_steps[k];
    int bad = 0;
    tdm_tensor *loss = f32(TDM_SHAPE0, &r->loss);
    tdm_tensor *scaled = tdm_grad_scaler_scale(s, loss);
    float sl = NAN;
    if (!scaled || tdm_to_host(scaled, &sl, sizeof sl)) bad++;
    bool same_loss = isnan(r->scaled_loss) ? isnan(sl) : sl == r->scaled_loss;
    bad += !same_loss;
    bad += tdm_grad_scaler_get_scale(s) != r->scale_used;
    if (scaled != loss) tdm_tensor_free(scaled);
    tdm_tensor_free(loss);

    set_flat(ps->flat_grad, r->grad_in);
    if (r->explicit_unscale) bad += tdm_grad_scaler_unscale(s, o) != TDM_OK;
    bool stepped = !r->stepped;
    bad += tdm_grad_scaler_step(s, o, &stepped) != TDM_OK;
    bad += stepped != r->stepped;
    bad += tdm_grad_scaler_found_inf(s, o) != !r->stepped;
    char what[64];
    snprintf(what, sizeof what, "unscaled gradients of step %d", k);
    bad += count_unequal(ps->flat_grad, r->grad_out, GSF_NP, what);
    bad += tdm_grad_scaler_update(s) != TDM_OK;
    tdm_grad_scaler_state st;
    bad += tdm_grad_scaler_get_state(s, &st) != TDM_OK;
    bad += st.scale != r->scale || st.growth_tracker != r->growth_tracker;
    snprintf(what, sizeof what, "parameters after step %d", k);
    /* Tandem's fused Adam against PyTorch's, as tests/test_optim.c bounds it */
    bad += check_tensor_close(ps->flat, r->params, 2e-6, 2e-5, what) != 0;
    if (bad)
        fprintf(stderr,
                "step %d: scaled loss %.9g (want %.9g), stepped %d (want %d), scale %g "
                "tracker %d (want %g %d): %s\n",
                k, sl, r->scaled_loss, stepped, r->stepped, st.scale, st.growth_tracker, r->scale,
                r->growth_tracker, tdm_last_error());
    return bad;
}

static void test_against_pytorch(void) {
    tdm_module *m = make_holder();
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_adam_opts ao = tdm_adam_defaults();
    ao.lr = GSF_LR;
    tdm_optim *o = ps ? tdm_adam_new(ps, &ao) : NULL;
    tdm_grad_scaler *s = new_scaler();
    CHECK(ps && o && s, "%s", tdm_last_error());
    if (!ps || !o || !s) return;
    int bad_steps = 0, stepped = 0;
    for (int k = 0; k < GSF_STEPS; k++) {
        if (k == GSF_CKPT) { /* a resume: a new scaler from the saved state */
            tdm_grad_scaler_state st;
            CHECK(tdm_grad_scaler_get_state(s, &st) == TDM_OK, "%s", tdm_last_error());
            tdm_grad_scaler_free(s);
            s = new_scaler();
            CHECK(tdm_grad_scaler_set_state(s, &st) == TDM_OK, "%s", tdm_last_error());
        }
        bad_steps += replay_step(s, o, ps, k) != 0;
        stepped += gsf_steps[k].stepped;
    }
    CHECK(bad_steps == 0, "%d of %d steps differ from PyTorch's GradScaler", bad_steps, GSF_STEPS);
    /* a skipped step is not counted: Adam's bias correction sees only the steps taken */
    CHECK(tdm_optim_steps(o) == stepped, "optimizer steps %lld, expected %d",
          (long long)tdm_optim_steps(o), stepped);
    CHECK(stepped < GSF_STEPS && stepped > GSF_STEPS / 2, "the fixture skips some steps (%d)",
          stepped);
    tdm_grad_scaler_free(s);
    tdm_optim_free(o);
    tdm_module_free(m);
}

/* The scaled loss's backward: every gradient multiplied by the scale. */
static void test_scaled_backward(void) {
    tdm_scope_begin();
    float xv[3] = {1.5f, -2.0f, 0.25f};
    tdm_tensor *x = f32(TDM_SHAPE(3), xv);
    x->requires_grad = true;
    tdm_grad_scaler *s = tdm_grad_scaler_new(NULL);
    tdm_tensor *loss = tdm_sum_all(tdm_mul(x, x));
    tdm_tensor *scaled = tdm_grad_scaler_scale(s, loss);
    CHECK(scaled && tdm_backward(scaled) == TDM_OK, "%s", tdm_last_error());
    float want[3] = {2 * 1.5f * 65536, 2 * -2.0f * 65536, 2 * 0.25f * 65536};
    check_tensor_close(x->grad, want, 0, 0, "gradient of the scaled loss");
    tdm_grad_scaler_free(s);
    tdm_scope_end();
}

/* PyTorch's stage errors, and a disabled scaler that only steps. */
static void test_stages(void) {
    tdm_module *m = make_holder();
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *o = tdm_sgd_new(ps, &(tdm_sgd_opts){.lr = 0.1f});
    tdm_grad_scaler *s = tdm_grad_scaler_new(NULL);
    CHECK_ERROR(tdm_grad_scaler_unscale(s, o) == TDM_ERR_STATE, "before tdm_grad_scaler_scale");
    CHECK_ERROR(tdm_grad_scaler_update(s) == TDM_ERR_STATE, "before tdm_grad_scaler_scale");
    tdm_tensor *one = tdm_ones(TDM_SHAPE0, TDM_F32, tdm_cpu(0));
    tdm_tensor *scaled = tdm_grad_scaler_scale(s, one);
    CHECK_ERROR(tdm_grad_scaler_update(s) == TDM_ERR_STATE, "no inf checks recorded");
    CHECK(tdm_grad_scaler_unscale(s, o) == TDM_OK, "%s", tdm_last_error());
    CHECK_ERROR(tdm_grad_scaler_unscale(s, o) == TDM_ERR_STATE, "already called");
    CHECK(tdm_grad_scaler_step(s, o, NULL) == TDM_OK, "%s", tdm_last_error());
    CHECK_ERROR(tdm_grad_scaler_step(s, o, NULL) == TDM_ERR_STATE, "already called");
    CHECK_ERROR(tdm_grad_scaler_unscale(s, o) == TDM_ERR_STATE, "after tdm_grad_scaler_step");
    CHECK(tdm_grad_scaler_update(s) == TDM_OK, "%s", tdm_last_error());
    CHECK(tdm_grad_scaler_unscale(s, o) == TDM_OK, "a new iteration: %s", tdm_last_error());
    CHECK(tdm_grad_scaler_update_to(s, 8.0f) == TDM_OK, "%s", tdm_last_error());
    CHECK(tdm_grad_scaler_get_scale(s) == 8.0f, "update_to: %g", tdm_grad_scaler_get_scale(s));
    CHECK_ERROR(tdm_grad_scaler_update_to(s, 0.0f) == TDM_ERR_ARG, "new scale 0");
    tdm_tensor_free(scaled);

    tdm_grad_scaler_opts off = tdm_grad_scaler_defaults();
    off.enabled = false;
    tdm_grad_scaler *d = tdm_grad_scaler_new(&off);
    CHECK(tdm_grad_scaler_scale(d, one) == one, "disabled: scale returns the loss");
    CHECK(tdm_grad_scaler_get_scale(d) == 1.0f, "disabled: scale 1");
    bool stepped = false;
    int64_t before = tdm_optim_steps(o);
    CHECK(tdm_grad_scaler_step(d, o, &stepped) == TDM_OK && stepped &&
              tdm_optim_steps(o) == before + 1,
          "disabled: step steps: %s", tdm_last_error());
    CHECK(tdm_grad_scaler_update(d) == TDM_OK, "disabled: update does nothing");
    tdm_grad_scaler_free(d);
    tdm_tensor_free(one);
    tdm_grad_scaler_free(s);
    tdm_optim_free(o);
    tdm_module_free(m);
}

static void test_options(void) {
    tdm_grad_scaler_opts so = tdm_grad_scaler_defaults();
    CHECK(so.init_scale == 65536.0f && so.growth_factor == 2.0 && so.backoff_factor == 0.5 &&
              so.growth_interval == 2000 && so.enabled,
          "PyTorch's defaults");
    so.growth_factor = 1.0;
    CHECK_ERROR(tdm_grad_scaler_new(&so) == NULL, "growth_factor 1 must be > 1");
    so = tdm_grad_scaler_defaults();
    so.backoff_factor = 1.0;
    CHECK_ERROR(tdm_grad_scaler_new(&so) == NULL, "backoff_factor 1 must be in (0, 1)");
    so = tdm_grad_scaler_defaults();
    so.growth_interval = 0;
    CHECK_ERROR(tdm_grad_scaler_new(&so) == NULL, "growth_interval 0");
    so = tdm_grad_scaler_defaults();
    so.init_scale = INFINITY;
    CHECK_ERROR(tdm_grad_scaler_new(&so) == NULL, "init_scale inf");

    tdm_grad_scaler *s = new_scaler();
    tdm_grad_scaler_state st = {.scale = 4.0f, .growth_tracker = 2};
    CHECK(tdm_grad_scaler_set_state(s, &st) == TDM_OK, "%s", tdm_last_error());
    CHECK(tdm_grad_scaler_get_scale(s) == 4.0f, "loaded scale before the first scale()");
    st.growth_tracker = GSF_GROWTH_INTERVAL;
    CHECK_ERROR(tdm_grad_scaler_set_state(s, &st) == TDM_ERR_ARG, "growth tracker 3");
    st = (tdm_grad_scaler_state){.scale = NAN};
    CHECK_ERROR(tdm_grad_scaler_set_state(s, &st) == TDM_ERR_ARG, "scale nan");
    CHECK(tdm_grad_scaler_get_scale(s) == 4.0f, "a refused state leaves the scaler as it was");
    tdm_grad_scaler_free(s);
}

/* A growth that would overflow the float scale keeps it (and restarts the count), as
 * _amp_update_scale_ does. */
static void test_growth_overflow(void) {
    tdm_module *m = make_holder();
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *o = tdm_sgd_new(ps, &(tdm_sgd_opts){.lr = 0.1f});
    tdm_grad_scaler *s = new_scaler();
    tdm_grad_scaler_state st = {.scale = 0x1p127f, .growth_tracker = GSF_GROWTH_INTERVAL - 1};
    CHECK(tdm_grad_scaler_set_state(s, &st) == TDM_OK, "%s", tdm_last_error());
    tdm_tensor *one = tdm_ones(TDM_SHAPE0, TDM_F32, tdm_cpu(0));
    tdm_tensor *scaled = tdm_grad_scaler_scale(s, one);
    tdm_optim_zero_grad(o);
    bool stepped = false;
    CHECK(tdm_grad_scaler_step(s, o, &stepped) == TDM_OK && stepped, "%s", tdm_last_error());
    CHECK(tdm_grad_scaler_update(s) == TDM_OK, "%s", tdm_last_error());
    CHECK(tdm_grad_scaler_get_state(s, &st) == TDM_OK && st.scale == 0x1p127f &&
              st.growth_tracker == 0,
          "scale %g tracker %d after a growth past FLT_MAX", st.scale, (int)st.growth_tracker);
    tdm_tensor_free(scaled);
    tdm_tensor_free(one);
    tdm_grad_scaler_free(s);
    tdm_optim_free(o);
    tdm_module_free(m);
}

int main(void) {
    test_against_pytorch();
    test_scaled_backward();
    test_stages();
    test_options();
    test_growth_overflow();
    return check_summary();
}
