/* Loss scaling (torch.amp.GradScaler) over Tandem's optimizers.
 *
 * PyTorch keeps the scale as a one-element float32 tensor and the growth tracker as an int32
 * one; here they are a float and an int32_t with the same arithmetic:
 *
 *   unscale   found_inf = any gradient not finite (checked before the multiplication);
 *             g *= inv_scale, inv_scale = (float)(1 / (double)scale)
 *   update    found_inf: scale = (float)(scale * backoff), tracker = 0
 *             else:      tracker + 1 == interval ? (scale = (float)(scale * growth) if that
 *                        is finite; tracker = 0) : tracker += 1
 *
 * (grad_scaler.py's unscale_, and _amp_update_scale_ in aten's AmpGradScalerKernels.cpp,
 * whose factors are doubles multiplied with the float scale.) Each optimizer goes through
 * PyTorch's stages READY -> UNSCALED -> STEPPED once per update.
 *
 * The check for infs is the backend's sum of squares, accumulated in double: a float's
 * square is below 2^256, so the sum of any buffer that fits in memory is finite exactly when
 * every element is, and the check costs one read of the gradient on any device.
 */
#include <math.h>
#include <stdlib.h>

#include "backend/backend.h"
#include "optim/scaler.h"
#include "optim/shard.h"
#include "tandem/autograd.h"

typedef enum { STAGE_READY, STAGE_UNSCALED, STAGE_STEPPED } stage;

typedef struct {
    const tdm_optim *o; /* NULL: a free slot */
    stage stage;
    bool found_inf;
} optim_state;

struct tdm_grad_scaler {
    tdm_grad_scaler_opts opts;
    bool started; /* a scale call has fixed the scale (PyTorch's lazy _lazy_init_scale_...) */
    float scale;
    int32_t tracker;
    optim_state per[TDM_GRAD_SCALER_MAX_OPTIMS];
};

tdm_grad_scaler_opts tdm_grad_scaler_defaults(void) {
    tdm_grad_scaler_opts o = {.init_scale = 65536.0f,
                              .growth_factor = 2.0,
                              .backoff_factor = 0.5,
                              .growth_interval = 2000,
                              .enabled = true};
    return o;
}

static int check_opts(const tdm_grad_scaler_opts *o) {
    if (!(o->growth_factor > 1.0) || !isfinite(o->growth_factor))
        return tdm_raise(TDM_ERR_ARG, "grad_scaler: growth_factor %g must be > 1 and finite",
                         o->growth_factor);
    if (!(o->backoff_factor > 0.0 && o->backoff_factor < 1.0))
        return tdm_raise(TDM_ERR_ARG, "grad_scaler: backoff_factor %g must be in (0, 1)",
                         o->backoff_factor);
    if (o->growth_interval < 1 || o->growth_interval > INT32_MAX)
        return tdm_raise(TDM_ERR_ARG, "grad_scaler: growth_interval %lld must be in [1, 2^31)",
                         (long long)o->growth_interval);
    if (!(o->init_scale > 0.0f) || !isfinite(o->init_scale))
        return tdm_raise(TDM_ERR_ARG, "grad_scaler: init_scale %g must be > 0 and finite",
                         o->init_scale);
    return TDM_OK;
}

tdm_grad_scaler *tdm_grad_scaler_new(const tdm_grad_scaler_opts *o) {
    tdm_grad_scaler_opts opts = o ? *o : tdm_grad_scaler_defaults();
    if (opts.enabled && check_opts(&opts)) return NULL;
    tdm_grad_scaler *s = calloc(1, sizeof *s);
    if (!s) {
        tdm_raise(TDM_ERR_NOMEM, "grad_scaler: out of memory");
        return NULL;
    }
    s->opts = opts;
    s->scale = opts.init_scale;
    return s;
}

void tdm_grad_scaler_free(tdm_grad_scaler *s) {
    free(s);
}

/* PyTorch's _check_scale_growth_tracker: the scale exists once scale() has run. */
static int check_started(const tdm_grad_scaler *s, const char *op) {
    if (!s) return tdm_raise(TDM_ERR_ARG, "grad_scaler_%s: scaler is NULL", op);
    if (!s->started)
        return tdm_raise(TDM_ERR_STATE,
                         "grad_scaler_%s: called before tdm_grad_scaler_scale (scale the loss "
                         "before backward in every iteration)",
                         op);
    return TDM_OK;
}

/* o's slot, made on first use; NULL and an error when all are taken. */
static optim_state *slot_of(tdm_grad_scaler *s, const tdm_optim *o, const char *op) {
    optim_state *free_slot = NULL;
    for (int i = 0; i < TDM_GRAD_SCALER_MAX_OPTIMS; i++) {
        if (s->per[i].o == o) return &s->per[i];
        if (!s->per[i].o && !free_slot) free_slot = &s->per[i];
    }
    if (!free_slot) {
        tdm_raise(TDM_ERR_ARG, "grad_scaler_%s: more than %d optimizers between two updates", op,
                  TDM_GRAD_SCALER_MAX_OPTIMS);
        return NULL;
    }
    *free_slot = (optim_state){.o = o, .stage = STAGE_READY};
    return free_slot;
}

float tdm_grad_scaler_begin(tdm_grad_scaler *s) {
    if (!s->opts.enabled) return 1.0f;
    s->started = true;
    return s->scale;
}

tdm_tensor *tdm_grad_scaler_scale(tdm_grad_scaler *s, tdm_tensor *loss) {
    if (!s || !loss) {
        tdm_raise(TDM_ERR_ARG, "grad_scaler_scale: %s is NULL", s ? "loss" : "scaler");
        return NULL;
    }
    if (!s->opts.enabled) return loss;
    return tdm_mul_scalar(loss, tdm_grad_scaler_begin(s));
}

/* Whether any element of g is inf or NaN, into *found. */
static int has_non_finite(const tdm_tensor *g, bool *found) {
    double ss = 0;
    *found = false;
    if (tdm_numel(g) == 0) return TDM_OK;
    const tdm_backend *be = tdm_backend_for(g->device);
    if (!be) return tdm_last_status();
    int rc = be->sum_squares(&ss, g);
    *found = !isfinite(ss);
    return rc;
}

/* tdm_grad_scaler_unscale's preconditions on s and o (disabled: none). */
static int check_unscale(tdm_grad_scaler *s, const tdm_optim *o) {
    if (s && !s->opts.enabled) return TDM_OK;
    int rc = check_started(s, "unscale");
    if (rc) return rc;
    if (!o) return tdm_raise(TDM_ERR_ARG, "grad_scaler_unscale: optimizer is NULL");
    optim_state *st = slot_of(s, o, "unscale");
    if (!st) return tdm_last_status();
    if (st->stage == STAGE_UNSCALED)
        return tdm_raise(TDM_ERR_STATE, "grad_scaler_unscale: already called on this optimizer "
                                        "since the last tdm_grad_scaler_update");
    if (st->stage == STAGE_STEPPED)
        return tdm_raise(TDM_ERR_STATE, "grad_scaler_unscale: called after tdm_grad_scaler_step "
                                        "(unscale before stepping, update after)");
    return TDM_OK;
}

int tdm_grad_scaler_unscale_of(const tdm_grad_scaler *s, tdm_tensor *g) {
    float inv_scale = (float)(1.0 / (double)s->scale);
    /* PyTorch skips the multiplication by exactly 1: the values are the same either way */
    if (!s->opts.enabled || inv_scale == 1.0f || tdm_numel(g) == 0) return TDM_OK;
    return tdm_backend_for(g->device)->unary(TDM_UN_MUL_SCALAR, g, g, inv_scale);
}

/* o's stage once its gradient was unscaled and checked (found_inf agreed where sharded). */
static int record_unscaled(tdm_grad_scaler *s, const tdm_optim *o, bool found_inf, const char *op) {
    optim_state *st = slot_of(s, o, op);
    if (!st) return tdm_last_status();
    st->found_inf = found_inf;
    st->stage = STAGE_UNSCALED;
    return TDM_OK;
}

static int unscale_grads(tdm_grad_scaler *s, tdm_optim *o) {
    tdm_paramset *ps = tdm_optim_paramset(o);
    int64_t lo;
    tdm_tensor *g = tdm_optim_grad(o, &lo);
    if (!ps || !g || g != ps->flat_grad)
        return tdm_raise(TDM_ERR_STATE,
                         "grad_scaler_unscale: the optimizer's gradient is sharded over the "
                         "ranks (ZeRO stage 2): unscale it with tdm_ddp_unscale");
    int rc = tdm_paramset_settle_grads(ps);
    if (rc) return rc;
    bool found;
    rc = has_non_finite(g, &found);
    if (!rc) rc = tdm_grad_scaler_unscale_of(s, g);
    return rc ? rc : record_unscaled(s, o, found, "unscale");
}

int tdm_grad_scaler_unscale_found(tdm_grad_scaler *s, tdm_optim *o, tdm_tensor *g, bool found_inf) {
    int rc = check_unscale(s, o);
    if (!rc && s->opts.enabled) rc = tdm_grad_scaler_unscale_of(s, g);
    if (!rc && s->opts.enabled) rc = record_unscaled(s, o, found_inf, "unscale");
    return rc;
}

int tdm_grad_scaler_unscale(tdm_grad_scaler *s, tdm_optim *o) {
    int rc = check_unscale(s, o);
    return rc || !s->opts.enabled ? rc : unscale_grads(s, o);
}

int tdm_grad_scaler_step(tdm_grad_scaler *s, tdm_optim *o, bool *stepped) {
    if (stepped) *stepped = false;
    if (s && !s->opts.enabled) {
        int rc =
            o ? tdm_optim_step(o) : tdm_raise(TDM_ERR_ARG, "grad_scaler_step: optimizer is NULL");
        if (stepped) *stepped = rc == TDM_OK;
        return rc;
    }
    int rc = check_started(s, "step");
    if (rc) return rc;
    if (!o) return tdm_raise(TDM_ERR_ARG, "grad_scaler_step: optimizer is NULL");
    optim_state *st = slot_of(s, o, "step");
    if (!st) return tdm_last_status();
    if (st->stage == STAGE_STEPPED)
        return tdm_raise(TDM_ERR_STATE, "grad_scaler_step: already called on this optimizer "
                                        "since the last tdm_grad_scaler_update");
    if (st->stage == STAGE_READY && (rc = unscale_grads(s, o))) return rc;
    if (!st->found_inf) {
        rc = tdm_optim_step(o);
        if (rc) return rc;
        if (stepped) *stepped = true;
    }
    st->stage = STAGE_STEPPED;
    return TDM_OK;
}

/* Back to READY for every optimizer (PyTorch's fresh per-optimizer states). */
static void reset_stages(tdm_grad_scaler *s) {
    for (int i = 0; i < TDM_GRAD_SCALER_MAX_OPTIMS; i++) s->per[i] = (optim_state){0};
}

int tdm_grad_scaler_update(tdm_grad_scaler *s) {
    if (s && !s->opts.enabled) return TDM_OK;
    int rc = check_started(s, "update");
    if (rc) return rc;
    bool checked = false, found_inf = false;
    for (int i = 0; i < TDM_GRAD_SCALER_MAX_OPTIMS; i++) {
        if (!s->per[i].o || s->per[i].stage == STAGE_READY) continue;
        checked = true;
        found_inf |= s->per[i].found_inf;
    }
    if (!checked)
        return tdm_raise(TDM_ERR_STATE, "grad_scaler_update: no optimizer was unscaled or "
                                        "stepped since the last update (no inf checks recorded)");
    return tdm_grad_scaler_update_found(s, found_inf);
}

int tdm_grad_scaler_update_found(tdm_grad_scaler *s, bool found_inf) {
    if (s && !s->opts.enabled) return TDM_OK;
    int rc = check_started(s, "update");
    if (rc) return rc;
    if (found_inf) {
        s->scale = (float)((double)s->scale * s->opts.backoff_factor);
        s->tracker = 0;
    } else if ((int64_t)s->tracker + 1 == s->opts.growth_interval) {
        float grown = (float)((double)s->scale * s->opts.growth_factor);
        if (isfinite(grown)) s->scale = grown;
        s->tracker = 0;
    } else {
        s->tracker++;
    }
    reset_stages(s);
    return TDM_OK;
}

int tdm_grad_scaler_update_to(tdm_grad_scaler *s, float new_scale) {
    if (s && !s->opts.enabled) return TDM_OK;
    int rc = check_started(s, "update_to");
    if (rc) return rc;
    if (!(new_scale > 0.0f) || !isfinite(new_scale))
        return tdm_raise(TDM_ERR_ARG, "grad_scaler_update_to: new scale %g must be > 0 and finite",
                         new_scale);
    s->scale = new_scale;
    reset_stages(s);
    return TDM_OK;
}

float tdm_grad_scaler_get_scale(const tdm_grad_scaler *s) {
    if (!s) return NAN;
    return s->opts.enabled ? s->scale : 1.0f;
}

bool tdm_grad_scaler_found_inf(const tdm_grad_scaler *s, const tdm_optim *o) {
    if (!s || !o) return false;
    for (int i = 0; i < TDM_GRAD_SCALER_MAX_OPTIMS; i++)
        if (s->per[i].o == o) return s->per[i].stage == STAGE_STEPPED && s->per[i].found_inf;
    return false;
}

tdm_grad_scaler_opts tdm_grad_scaler_options(const tdm_grad_scaler *s) {
    return s ? s->opts : tdm_grad_scaler_defaults();
}

int tdm_grad_scaler_get_state(const tdm_grad_scaler *s, tdm_grad_scaler_state *st) {
    if (!s || !st)
        return tdm_raise(TDM_ERR_ARG, "grad_scaler_get_state: %s is NULL", s ? "state" : "scaler");
    st->scale = s->scale;
    st->growth_tracker = s->tracker;
    return TDM_OK;
}

int tdm_grad_scaler_set_state(tdm_grad_scaler *s, const tdm_grad_scaler_state *st) {
    if (!s || !st)
        return tdm_raise(TDM_ERR_ARG, "grad_scaler_set_state: %s is NULL", s ? "state" : "scaler");
    if (!s->opts.enabled) return TDM_OK;
    if (!(st->scale > 0.0f) || !isfinite(st->scale))
        return tdm_raise(TDM_ERR_ARG, "grad_scaler_set_state: scale %g must be > 0 and finite",
                         st->scale);
    if (st->growth_tracker < 0 || st->growth_tracker >= s->opts.growth_interval)
        return tdm_raise(TDM_ERR_ARG,
                         "grad_scaler_set_state: growth tracker %d must be in [0, %lld) (the "
                         "growth interval)",
                         (int)st->growth_tracker, (long long)s->opts.growth_interval);
    s->scale = st->scale;
    s->tracker = st->growth_tracker;
    return TDM_OK;
}
