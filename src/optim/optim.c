/* Optimizers: SGD, Adam and AdamW over a model's flat parameter buffer.
 *
 * The state (momentum buffer; first and second moments, AMSGrad's maximum) is one flat
 * tensor per kind, the size of the parameter buffer, allocated when the optimizer is made,
 * so a step allocates nothing and is a single kernel call over the flat buffers. The update
 * formulas are PyTorch's; see src/backend/cpu/cpu_optim.c.
 */
#include <math.h>
#include <stdlib.h>

#include "backend/backend.h"
#include "tandem/optim.h"

typedef enum { OPT_SGD, OPT_ADAM } opt_kind;

struct tdm_optim {
    opt_kind kind;
    tdm_paramset *ps;
    const tdm_backend *be;
    tdm_sgd_hparams sgd;
    tdm_adam_hparams adam;
    tdm_tensor *state[3]; /* SGD: momentum buffer; Adam: exp_avg, exp_avg_sq, max_exp_avg_sq */
    int64_t steps;
};

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

/* A zeroed caller-owned state buffer like ps->flat. */
static tdm_tensor *state_buffer(const tdm_paramset *ps) {
    tdm_tensor *t = tdm_zeros(TDM_SHAPE(ps->total), TDM_F32, ps->flat->device);
    return t && t->owner ? tdm_scope_keep(t) : t;
}

static int check_paramset(const tdm_paramset *ps, const char *op) {
    if (!ps || !ps->flat || !ps->flat_grad)
        return tdm_raise(TDM_ERR_ARG, "%s: parameter set is NULL (see tdm_module_parameters)", op);
    return TDM_OK;
}

static tdm_optim *optim_new(opt_kind kind, tdm_paramset *ps, int n_state, const char *op) {
    tdm_optim *o = calloc(1, sizeof *o);
    if (!o) return tdm_raise_null(TDM_ERR_NOMEM, "%s: out of memory", op);
    o->kind = kind;
    o->ps = ps;
    o->be = tdm_backend_for(ps->flat->device);
    for (int i = 0; i < n_state && o->be; i++)
        if (!(o->state[i] = state_buffer(ps))) break;
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

int tdm_optim_step(tdm_optim *o) {
    if (!o) return tdm_raise(TDM_ERR_ARG, "optim_step: optimizer is NULL");
    tdm_paramset *ps = o->ps;
    int rc;
    if (o->kind == OPT_SGD)
        rc = o->be->sgd_step(ps->flat, ps->flat_grad, o->state[0], &o->sgd, o->steps == 0);
    else
        rc = o->be->adam_step(ps->flat, ps->flat_grad, o->state[0], o->state[1], o->state[2],
                              &o->adam, o->steps + 1);
    if (rc) return rc;
    o->steps++;
    return TDM_OK;
}

int tdm_optim_zero_grad(tdm_optim *o) {
    if (!o) return tdm_raise(TDM_ERR_ARG, "optim_zero_grad: optimizer is NULL");
    return o->be->fill(o->ps->flat_grad, 0.0);
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

void tdm_optim_set_steps(tdm_optim *o, int64_t steps) {
    if (o && steps >= 0) o->steps = steps;
}

const char *tdm_optim_kind(const tdm_optim *o) {
    if (!o) return "";
    return o->kind == OPT_SGD ? "sgd" : o->adam.decoupled ? "adamw" : "adam";
}

int tdm_optim_state(tdm_optim *o, const char **names, tdm_tensor **tensors, int max) {
    static const char *const sgd[] = {"momentum_buffer"};
    static const char *const adam[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    if (!o) return 0;
    int n = 0;
    for (int i = 0; i < 3 && n < max; i++) {
        if (!o->state[i]) continue;
        if (names) names[n] = o->kind == OPT_SGD ? sgd[0] : adam[i];
        if (tensors) tensors[n] = o->state[i];
        n++;
    }
    return n;
}

void tdm_optim_free(tdm_optim *o) {
    if (!o) return;
    for (int i = 0; i < 3; i++) tdm_tensor_free(o->state[i]);
    free(o);
}
