/* Optimizers: SGD, Adam and AdamW over a model's flat parameter buffer.
 *
 * The state (momentum buffer; first and second moments, AMSGrad's maximum) is one flat
 * tensor per kind, the size of the parameter buffer, allocated when the optimizer is made,
 * so a step allocates nothing and is a single kernel call over the flat buffers. The update
 * formulas are PyTorch's; see src/backend/cpu/cpu_optim.c.
 *
 * A sharded optimizer (ZeRO stage 1, src/parallel/zero.c through optim/shard.h) keeps the
 * state of one contiguous range [lo, hi) of the flat buffer, steps that range, and leaves
 * the rest of the parameters to the hook that shares the ranks' ranges.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "optim/shard.h"

typedef enum { OPT_SGD, OPT_ADAM } opt_kind;

struct tdm_optim {
    opt_kind kind;
    tdm_paramset *ps;
    const tdm_backend *be;
    tdm_sgd_hparams sgd;
    tdm_adam_hparams adam;
    tdm_tensor *state[3]; /* SGD: momentum buffer; Adam: exp_avg, exp_avg_sq, max_exp_avg_sq */
    int64_t steps;
    float *wd; /* [ps->n] per-parameter weight decay (param groups), or NULL: one for all */
    /* The flat elements the state covers, state[k] element i being flat element lo + i:
     * [0, ps->total), or a shard's range once sharded (then `shard` holds its hooks). */
    int64_t lo, hi;
    bool sharded;
    tdm_optim_shard_hooks shard;
    /* The gradient a step reads: ps->flat_grad (grad_lo 0), or under ZeRO stage 2 the rank's
     * shard of it ([hi - lo] elements, grad_lo = lo; tdm_optim_use_grad), not owned. */
    tdm_tensor *grad;
    int64_t grad_lo;
    /* The parameters a step updates: ps->flat (params_lo 0), or under ZeRO stage 3 the rank's
     * shard of them (tdm_optim_use_params), not owned. */
    tdm_tensor *params;
    int64_t params_lo;
};

static const char *const sgd_names[] = {"momentum_buffer"};
static const char *const adam_names[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};

/* PyTorch's name of state buffer k. */
static const char *state_name(const tdm_optim *o, int k) {
    return o->kind == OPT_SGD ? sgd_names[0] : adam_names[k];
}

tdm_sgd_opts tdm_sgd_defaults(float lr) {
    tdm_sgd_opts o = {.lr = lr};
    return o;
}

tdm_adam_opts tdm_adam_defaults(void) {
    tdm_adam_opts o = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
    return o;
}

tdm_adam_opts tdm_adamw_defaults(void) {
    tdm_adam_opts o = tdm_adam_defaults();
    o.weight_decay = 1e-2f;
    return o;
}

/* A zeroed caller-owned state buffer of n elements on ps->flat's device. */
static tdm_tensor *state_buffer(const tdm_paramset *ps, int64_t n) {
    tdm_tensor *t = tdm_zeros(TDM_SHAPE(n), TDM_F32, ps->flat->device);
    return t && tdm_book(t)->owner ? tdm_scope_keep(t) : t;
}

static int check_paramset(const tdm_paramset *ps, const char *op) {
    /* tdm_module_parameters(m) failing (out of memory) hands NULL on: its error is the cause */
    if (!ps && tdm_last_status() != TDM_OK) return tdm_last_status();
    if (!ps || !ps->flat || !ps->flat_grad)
        return tdm_raise(TDM_ERR_ARG, "%s: parameter set is NULL (see tdm_module_parameters)", op);
    return TDM_OK;
}

static tdm_optim *optim_new(opt_kind kind, tdm_paramset *ps, int n_state, const char *op) {
    tdm_optim *o = calloc(1, sizeof *o);
    if (!o) return tdm_raise_null(TDM_ERR_NOMEM, "%s: out of memory", op);
    o->kind = kind;
    o->ps = ps;
    o->lo = 0, o->hi = ps->total;
    o->be = tdm_backend_for(ps->flat->device);
    for (int i = 0; i < n_state && o->be; i++)
        if (!(o->state[i] = state_buffer(ps, ps->total))) break;
    if (!o->be || (n_state && !o->state[n_state - 1])) {
        tdm_optim_free(o);
        return NULL;
    }
    return o;
}

tdm_optim *tdm_sgd_new(tdm_paramset *ps, const tdm_sgd_opts *so) {
    if (check_paramset(ps, "sgd")) return NULL;
    if (!so) return tdm_raise_null(TDM_ERR_ARG, "sgd: options are NULL (see tdm_sgd_defaults)");
    /* PyTorch's checks and wording (torch/optim/sgd.py). */
    if (!(so->lr >= 0))
        return tdm_raise_null(TDM_ERR_ARG, "sgd: invalid learning rate: %g", so->lr);
    if (!(so->momentum >= 0))
        return tdm_raise_null(TDM_ERR_ARG, "sgd: invalid momentum value: %g", so->momentum);
    if (!(so->weight_decay >= 0))
        return tdm_raise_null(TDM_ERR_ARG, "sgd: invalid weight_decay value: %g", so->weight_decay);
    if (!isfinite(so->dampening))
        return tdm_raise_null(TDM_ERR_ARG, "sgd: invalid dampening value: %g", so->dampening);
    if (so->nesterov && (so->momentum <= 0 || so->dampening != 0))
        return tdm_raise_null(TDM_ERR_ARG,
                              "sgd: nesterov momentum requires a momentum and zero dampening "
                              "(momentum %g, dampening %g)",
                              so->momentum, so->dampening);
    tdm_optim *o = optim_new(OPT_SGD, ps, so->momentum != 0 ? 1 : 0, "sgd");
    if (!o) return NULL;
    o->sgd = (tdm_sgd_hparams){so->lr,           so->momentum, so->dampening,
                               so->weight_decay, so->nesterov, so->maximize};
    return o;
}

static tdm_optim *adam_new(tdm_paramset *ps, const tdm_adam_opts *ao, bool decoupled,
                           const char *op) {
    if (check_paramset(ps, op)) return NULL;
    if (!ao)
        return tdm_raise_null(TDM_ERR_ARG, "%s: options are NULL (see tdm_%s_defaults)", op, op);
    /* PyTorch's checks and wording (torch/optim/adam.py). */
    if (!(ao->lr >= 0))
        return tdm_raise_null(TDM_ERR_ARG, "%s: invalid learning rate: %g", op, ao->lr);
    if (!(ao->eps >= 0))
        return tdm_raise_null(TDM_ERR_ARG, "%s: invalid epsilon value: %g", op, ao->eps);
    if (!(ao->beta1 >= 0 && ao->beta1 < 1))
        return tdm_raise_null(TDM_ERR_ARG, "%s: invalid beta parameter at index 0: %g", op,
                              ao->beta1);
    if (!(ao->beta2 >= 0 && ao->beta2 < 1))
        return tdm_raise_null(TDM_ERR_ARG, "%s: invalid beta parameter at index 1: %g", op,
                              ao->beta2);
    if (!(ao->weight_decay >= 0))
        return tdm_raise_null(TDM_ERR_ARG, "%s: invalid weight_decay value: %g", op,
                              ao->weight_decay);
    tdm_optim *o = optim_new(OPT_ADAM, ps, ao->amsgrad ? 3 : 2, op);
    if (!o) return NULL;
    o->adam = (tdm_adam_hparams){ao->lr,           ao->beta1, ao->beta2,   ao->eps,
                                 ao->weight_decay, decoupled, ao->amsgrad, ao->maximize};
    return o;
}

tdm_optim *tdm_adam_new(tdm_paramset *ps, const tdm_adam_opts *o) {
    return adam_new(ps, o, false, "adam");
}

tdm_optim *tdm_adamw_new(tdm_paramset *ps, const tdm_adam_opts *o) {
    return adam_new(ps, o, true, "adamw");
}

/* A stack view of elements [off, off + n) of a 1-D tensor (kernels and copies read only its
 * geometry); no bookkeeping of its own, so it must not outlive the call it is made for. */
static tdm_tensor flat_range(const tdm_tensor *flat, int64_t off, int64_t n) {
    tdm_tensor v = *flat;
    v.shape[0] = n;
    v.offset = flat->offset + off * flat->strides[0];
    return v;
}

/* Updates elements [lo, hi) of the flat buffers, within the state's [o->lo, o->hi): one
 * kernel call per run of consecutive parameters sharing a weight decay (one run when all
 * share it), each still one fused pass over its slice. params and grad hold flat elements
 * from params_lo and grad_lo on: ps->flat and ps->flat_grad (from 0), ZeRO's buffers
 * (tdm_optim_use_params, tdm_optim_use_grad: see step_own), or tdm_optim_step_range_on's.
 * Does not count the step. */
static int step_slice(tdm_optim *o, int64_t lo, int64_t hi, const tdm_tensor *params,
                      int64_t params_lo, const tdm_tensor *grad, int64_t grad_lo) {
    const tdm_paramset *ps = o->ps;
    for (int i = 0, j; i < ps->n; i = j) {
        for (j = i + 1; j < ps->n && (!o->wd || o->wd[j] == o->wd[i]);) j++;
        int64_t a = ps->offsets[i] > lo ? ps->offsets[i] : lo;
        int64_t b = ps->offsets[j] < hi ? ps->offsets[j] : hi;
        if (a >= b) continue;
        tdm_tensor p = flat_range(params, a - params_lo, b - a);
        tdm_tensor g = flat_range(grad, a - grad_lo, b - a);
        tdm_tensor st[3];
        for (int k = 0; k < 3; k++)
            if (o->state[k]) st[k] = flat_range(o->state[k], a - o->lo, b - a);
        int rc;
        if (o->kind == OPT_SGD) {
            tdm_sgd_hparams h = o->sgd;
            if (o->wd) h.weight_decay = o->wd[i];
            rc = o->be->sgd_step(&p, &g, o->state[0] ? &st[0] : NULL, &h, o->steps == 0);
        } else {
            tdm_adam_hparams h = o->adam;
            if (o->wd) h.weight_decay = o->wd[i];
            rc = o->be->adam_step(&p, &g, &st[0], &st[1], o->state[2] ? &st[2] : NULL, &h,
                                  o->steps + 1);
        }
        if (rc) return rc;
    }
    return TDM_OK;
}

/* step_slice on the optimizer's own buffers. */
static int step_own(tdm_optim *o, int64_t lo, int64_t hi) {
    return step_slice(o, lo, hi, o->params ? o->params : o->ps->flat, o->params_lo,
                      o->grad ? o->grad : o->ps->flat_grad, o->grad_lo);
}

int tdm_optim_set_weight_decays(tdm_optim *o, const float *wd) {
    if (!o) return tdm_raise(TDM_ERR_ARG, "optim_set_weight_decays: optimizer is NULL");
    if (!wd) {
        free(o->wd);
        o->wd = NULL;
        return TDM_OK;
    }
    for (int i = 0; i < o->ps->n; i++)
        if (!(wd[i] >= 0))
            return tdm_raise(TDM_ERR_ARG,
                             "optim_set_weight_decays: invalid weight_decay value %g for %s", wd[i],
                             o->ps->names[i]);
    size_t count = o->ps->n > 0 ? (size_t)o->ps->n : 1;
    float *copy = malloc(sizeof(float) * count);
    if (!copy) return tdm_raise(TDM_ERR_NOMEM, "optim_set_weight_decays: out of memory");
    for (int i = 0; i < o->ps->n; i++) copy[i] = wd[i];
    free(o->wd);
    o->wd = copy;
    return TDM_OK;
}

int tdm_optim_decay_matrices_only(tdm_optim *o, float wd) {
    if (!o) return tdm_raise(TDM_ERR_ARG, "optim_decay_matrices_only: optimizer is NULL");
    const tdm_paramset *ps = o->ps;
    float *per = malloc(sizeof(float) * (size_t)(ps->n > 0 ? ps->n : 1));
    if (!per) return tdm_raise(TDM_ERR_NOMEM, "optim_decay_matrices_only: out of memory");
    for (int i = 0; i < ps->n; i++) per[i] = ps->params[i]->ndim >= 2 ? wd : 0.0f;
    int rc = tdm_optim_set_weight_decays(o, per);
    free(per);
    return rc;
}

int tdm_optim_step(tdm_optim *o) {
    if (!o) return tdm_raise(TDM_ERR_ARG, "optim_step: optimizer is NULL");
    int rc = step_own(o, o->lo, o->hi);
    /* sharded: the other ranks' ranges come from them (parallel/zero.c) */
    if (!rc && o->sharded) rc = o->shard.after_step(o, o->shard.ctx);
    if (!rc) o->steps++;
    return rc;
}

int tdm_optim_step_range(tdm_optim *o, int64_t lo, int64_t hi) {
    if (!o) return tdm_raise(TDM_ERR_ARG, "optim_step_range: optimizer is NULL");
    if (lo < o->lo || lo > hi || hi > o->hi)
        return tdm_raise(TDM_ERR_ARG, "optim_step_range: [%lld, %lld) is not within [%lld, %lld)%s",
                         (long long)lo, (long long)hi, (long long)o->lo, (long long)o->hi,
                         o->sharded ? ", the range of this rank's shard" : "");
    return step_own(o, lo, hi);
}

int tdm_optim_step_range_on(tdm_optim *o, int64_t lo, int64_t hi, const tdm_tensor *flat,
                            const tdm_tensor *flat_grad) {
    if (!o || !flat || !flat_grad)
        return tdm_raise(TDM_ERR_ARG, "optim_step_range_on: NULL argument");
    if (o->sharded || lo < 0 || lo > hi || hi > o->ps->total)
        return tdm_raise(TDM_ERR_ARG,
                         "optim_step_range_on: [%lld, %lld) is not within [0, %lld) of an "
                         "unsharded optimizer",
                         (long long)lo, (long long)hi, (long long)o->ps->total);
    for (int k = 0; k < 2; k++) {
        const tdm_tensor *t = k ? flat_grad : flat;
        if (tdm_numel(t) != o->ps->total || !tdm_is_contiguous(t))
            return tdm_raise(TDM_ERR_SHAPE,
                             "optim_step_range_on: the %s have %lld elements, the parameter set "
                             "%lld",
                             k ? "gradients" : "parameters", (long long)tdm_numel(t),
                             (long long)o->ps->total);
    }
    return step_slice(o, lo, hi, flat, 0, flat_grad, 0);
}

int tdm_optim_zero_grad(tdm_optim *o) {
    if (!o) return tdm_raise(TDM_ERR_ARG, "optim_zero_grad: optimizer is NULL");
    return o->be->fill(o->grad ? o->grad : o->ps->flat_grad, 0.0);
}

float tdm_optim_lr(const tdm_optim *o) {
    if (!o) return NAN;
    return o->kind == OPT_SGD ? o->sgd.lr : o->adam.lr;
}

void tdm_optim_set_lr(tdm_optim *o, float lr) {
    if (!o) return;
    if (o->kind == OPT_SGD)
        o->sgd.lr = lr;
    else
        o->adam.lr = lr;
}

int64_t tdm_optim_steps(const tdm_optim *o) {
    return o ? o->steps : 0;
}

int tdm_optim_set_steps(tdm_optim *o, int64_t steps) {
    if (!o) return tdm_raise(TDM_ERR_ARG, "optim_set_steps: NULL optimizer");
    /* a count below 0 would be taken as 0 by a first step's test and move Adam's bias
     * correction: refused, not ignored */
    if (steps < 0)
        return tdm_raise(TDM_ERR_ARG, "optim_set_steps: step count %lld is negative",
                         (long long)steps);
    o->steps = steps;
    return TDM_OK;
}

const char *tdm_optim_kind(const tdm_optim *o) {
    if (!o) return "";
    return o->kind == OPT_SGD ? "sgd" : o->adam.decoupled ? "adamw" : "adam";
}

int tdm_optim_state(tdm_optim *o, const char **names, tdm_tensor **tensors, int max) {
    if (!o) return 0;
    int n = 0;
    for (int i = 0; i < 3 && n < max; i++) {
        if (!o->state[i]) continue;
        if (names) names[n] = state_name(o, i);
        if (tensors) tensors[n] = o->state[i];
        n++;
    }
    return n;
}

int tdm_optim_shard_range(const tdm_optim *o, int64_t *lo, int64_t *hi) {
    if (!o) return tdm_raise(TDM_ERR_ARG, "optim_shard_range: optimizer is NULL");
    if (lo) *lo = o->lo;
    if (hi) *hi = o->hi;
    return TDM_OK;
}

int tdm_optim_state_load(tdm_optim *o, const char *name, const tdm_tensor *full) {
    if (!o || !name || !full)
        return tdm_raise(TDM_ERR_ARG, "optim_state_load: NULL optimizer, name or tensor");
    int k = 0;
    while (k < 3 && !(o->state[k] && strcmp(state_name(o, k), name) == 0)) k++;
    if (k == 3)
        return tdm_raise(TDM_ERR_ARG, "optim_state_load: this %s optimizer has no state '%s'",
                         tdm_optim_kind(o), name);
    char sb[96];
    if (full->dtype != TDM_F32 || full->ndim != 1 || full->shape[0] != o->ps->total)
        return tdm_raise(TDM_ERR_SHAPE,
                         "optim_state_load: '%s' must be f32 [%lld] (the whole flat buffer), "
                         "got %s %s",
                         name, (long long)o->ps->total, tdm_dtype_name(full->dtype),
                         tdm_shape_str(tdm_shape_of(full), sb));
    tdm_tensor part = flat_range(full, o->lo, o->hi - o->lo);
    return tdm_copy_(o->state[k], &part);
}

/* ---- sharding (optim/shard.h) ------------------------------------------------------------ */

int tdm_optim_restrict(tdm_optim *o, int64_t lo, int64_t hi, const tdm_optim_shard_hooks *hooks) {
    if (!o || !hooks || !hooks->after_step)
        return tdm_raise(TDM_ERR_ARG, "optim_shard: NULL optimizer or hooks");
    if (o->sharded)
        return tdm_raise(TDM_ERR_STATE,
                         "optim_shard: the optimizer is sharded already (its state covers "
                         "[%lld, %lld) of %lld); shard it once",
                         (long long)o->lo, (long long)o->hi, (long long)o->ps->total);
    if (lo < 0 || lo > hi || hi > o->ps->total)
        return tdm_raise(TDM_ERR_ARG, "optim_shard: [%lld, %lld) is not within [0, %lld)",
                         (long long)lo, (long long)hi, (long long)o->ps->total);
    tdm_tensor *part[3] = {NULL, NULL, NULL};
    int rc = TDM_OK;
    for (int k = 0; k < 3 && !rc; k++) {
        if (!o->state[k]) continue;
        tdm_tensor src = flat_range(o->state[k], lo, hi - lo);
        part[k] = state_buffer(o->ps, hi - lo);
        rc = part[k] ? tdm_copy_(part[k], &src) : tdm_last_status();
    }
    for (int k = 0; k < 3; k++) { /* keep the full buffers, or the shard's copies */
        tdm_tensor *drop = rc ? part[k] : o->state[k];
        tdm_tensor_free(drop);
        if (!rc) o->state[k] = part[k];
    }
    if (rc) return rc;
    o->lo = lo, o->hi = hi;
    o->sharded = true;
    o->shard = *hooks;
    return TDM_OK;
}

/* Whether t, holding flat elements [lo, lo + numel(t)), covers o's range: TDM_OK, or an error
 * of op's naming what t is. */
static int covers(const tdm_optim *o, const tdm_tensor *t, int64_t lo, const char *op,
                  const char *what) {
    if (!o || !t) return tdm_raise(TDM_ERR_ARG, "%s: NULL optimizer or %s", op, what);
    if (t->ndim == 1 && lo <= o->lo && lo + t->shape[0] >= o->hi) return TDM_OK;
    return tdm_raise(TDM_ERR_SHAPE,
                     "%s: %s of %lld elements from %lld do not cover the optimizer's range "
                     "[%lld, %lld)",
                     op, what, (long long)tdm_numel(t), (long long)lo, (long long)o->lo,
                     (long long)o->hi);
}

int tdm_optim_use_grad(tdm_optim *o, tdm_tensor *grad, int64_t lo) {
    int rc = covers(o, grad, lo, "optim_use_grad", "gradient");
    if (!rc) o->grad = grad, o->grad_lo = lo;
    return rc;
}

int tdm_optim_use_params(tdm_optim *o, tdm_tensor *params, int64_t lo) {
    int rc = covers(o, params, lo, "optim_use_params", "parameters");
    if (!rc) o->params = params, o->params_lo = lo;
    return rc;
}

tdm_tensor *tdm_optim_params(const tdm_optim *o, int64_t *lo) {
    if (lo) *lo = o && o->params ? o->params_lo : 0;
    return !o ? NULL : o->params ? o->params : o->ps->flat;
}

tdm_tensor *tdm_optim_grad(const tdm_optim *o, int64_t *lo) {
    if (lo) *lo = o && o->grad ? o->grad_lo : 0;
    return !o ? NULL : o->grad ? o->grad : o->ps->flat_grad;
}

void *tdm_optim_shard_ctx(const tdm_optim *o) {
    return o && o->sharded ? o->shard.ctx : NULL;
}

tdm_paramset *tdm_optim_paramset(const tdm_optim *o) {
    return o ? o->ps : NULL;
}

tdm_optim *tdm_optim_new_like(const tdm_optim *o) {
    if (!o) return tdm_raise_null(TDM_ERR_ARG, "optim_new_like: optimizer is NULL");
    tdm_optim *c = calloc(1, sizeof *c);
    if (!c) return tdm_raise_null(TDM_ERR_NOMEM, "optim_new_like: out of memory");
    *c = *o; /* kind, hyper-parameters, learning rate, steps; the pointers are replaced */
    c->wd = NULL;
    c->lo = 0, c->hi = o->ps->total;
    c->sharded = false;
    c->shard = (tdm_optim_shard_hooks){0};
    c->grad = NULL, c->grad_lo = 0; /* a copy for a checkpoint: it never steps */
    c->params = NULL, c->params_lo = 0;
    for (int k = 0; k < 3; k++) c->state[k] = NULL;
    bool ok = !o->wd || tdm_optim_set_weight_decays(c, o->wd) == TDM_OK;
    for (int k = 0; k < 3 && ok; k++)
        if (o->state[k]) ok = (c->state[k] = state_buffer(o->ps, o->ps->total)) != NULL;
    if (!ok) {
        tdm_optim_free(c);
        return NULL;
    }
    return c;
}

void tdm_optim_free(tdm_optim *o) {
    if (!o) return;
    for (int i = 0; i < 3; i++) tdm_tensor_free(o->state[i]);
    if (o->sharded && o->shard.free) o->shard.free(o->shard.ctx);
    free(o->wd);
    free(o);
}
