/* Tandem optimizers, learning-rate schedules and gradient clipping, with PyTorch's exact
 * update formulas. An optimizer works on a model's tdm_paramset: one fused pass over the flat
 * parameter and gradient buffers per step.
 */
#ifndef TANDEM_OPTIM_H
#define TANDEM_OPTIM_H

#include "nn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float lr;
    float momentum;
    float dampening;
    float weight_decay;
    bool nesterov; /* needs momentum > 0 and dampening == 0, as in PyTorch */
    bool maximize;
} tdm_sgd_opts;

typedef struct {
    float lr;           /* PyTorch's default 1e-3 */
    float beta1, beta2; /* 0.9, 0.999 */
    float eps;          /* 1e-8 */
    float weight_decay; /* Adam 0 (L2 added to the gradient); AdamW 1e-2 (decoupled) */
    bool amsgrad;
    bool maximize;
} tdm_adam_opts;

tdm_sgd_opts tdm_sgd_defaults(float lr);
tdm_adam_opts tdm_adam_defaults(void);
tdm_adam_opts tdm_adamw_defaults(void);

typedef struct tdm_optim tdm_optim;

/* Optimizers over ps (which must outlive them). NULL and an error for invalid options (a
 * negative lr, nesterov without momentum, betas outside [0, 1)). */
tdm_optim *tdm_sgd_new(tdm_paramset *ps, const tdm_sgd_opts *o);
tdm_optim *tdm_adam_new(tdm_paramset *ps, const tdm_adam_opts *o);
tdm_optim *tdm_adamw_new(tdm_paramset *ps, const tdm_adam_opts *o);

/* Per-parameter weight decay: wd[i] (>= 0) replaces the options' weight_decay for parameter
 * i of the set (ps->n values, copied), as PyTorch's parameter groups that differ only in
 * weight_decay (e.g. decay on matrices only, see tdm_gpt_adamw_new). NULL goes back to one
 * value for all. The step stays one fused kernel call per run of consecutive parameters with
 * the same decay. Fails with TDM_ERR_ARG (naming the parameter) for a negative value. */
int tdm_optim_set_weight_decays(tdm_optim *o, const float *wd);
/* Weight decay wd on the parameters of 2 or more dims only, 0 on the others (biases,
 * norms' scales): the parameter groups of GPT-2's and most recipes' AdamW, through
 * tdm_optim_set_weight_decays. TDM_ERR_ARG for a NULL optimizer or a negative wd,
 * TDM_ERR_NOMEM. */
int tdm_optim_decay_matrices_only(tdm_optim *o, float wd);
/* One update from the gradients in ps->flat_grad (under ZeRO stage 2, tdm_ddp_set_shard: the
 * rank's shard of the averaged gradient, ps->flat_grad being gone). Returns TDM_OK or an
 * error. A sharded
 * optimizer (tdm_optim_shard) updates its shard, then shares it with the group's other ranks
 * and takes theirs, so every rank ends with all of ps->flat updated: a collective, called
 * by every rank of the group in the same order as its other collectives. */
int tdm_optim_step(tdm_optim *o);
/* Elements [lo, hi) of one update, without counting it: threads may update disjoint ranges
 * of one optimizer at once (a sharded step); afterwards one of them calls
 * tdm_optim_set_steps(o, tdm_optim_steps(o) + 1). TDM_ERR_ARG for a range outside the
 * flat buffers (for a sharded optimizer: outside its shard; nothing is shared). */
int tdm_optim_step_range(tdm_optim *o, int64_t lo, int64_t hi);
/* Zeroes the gradient a step reads: ps->flat_grad, or under ZeRO stage 2 the rank's shard. */
int tdm_optim_zero_grad(tdm_optim *o);
float tdm_optim_lr(const tdm_optim *o);
void tdm_optim_set_lr(tdm_optim *o, float lr);
/* Steps taken so far. */
int64_t tdm_optim_steps(const tdm_optim *o);
/* Sets the step count (restoring a checkpoint: it drives Adam's bias correction and SGD's
 * first-step momentum). TDM_ERR_ARG for a NULL optimizer or a negative count, leaving the
 * count as it was. */
int tdm_optim_set_steps(tdm_optim *o, int64_t steps);
/* "sgd", "adam" or "adamw". */
const char *tdm_optim_kind(const tdm_optim *o);
/* The optimizer's state buffers with PyTorch's state names: "momentum_buffer" (SGD with
 * momentum), "exp_avg", "exp_avg_sq" and "max_exp_avg_sq" (Adam, AdamW; the last with
 * amsgrad). Each is flat [ps->total] f32 in parameter order, owned by the optimizer (read
 * and write them to save and restore its state). A sharded optimizer (tdm_optim_shard,
 * parallel.h) holds only its shard: each buffer is [hi - lo], element i being flat element
 * lo + i of tdm_optim_shard_range (tdm_optim_state_gather assembles the whole). Writes at
 * most max; returns how many. */
int tdm_optim_state(tdm_optim *o, const char **names, tdm_tensor **tensors, int max);
/* The flat elements [*lo, *hi) whose state o holds and whose update it computes: the whole
 * buffer [0, ps->total) for an unsharded optimizer, this rank's shard for a sharded one (an
 * empty range, lo == hi, for a rank past the end). lo or hi may be NULL. TDM_ERR_ARG for a
 * NULL optimizer. */
int tdm_optim_shard_range(const tdm_optim *o, int64_t *lo, int64_t *hi);
/* Loads state buffer `name` (as tdm_optim_state names it) from full, the whole flat buffer's
 * values (f32 [ps->total], on the optimizer's device, e.g. read from a checkpoint): o copies
 * elements [lo, hi) of tdm_optim_shard_range, so every rank of a sharded optimizer takes its
 * own range with no communication; an unsharded one takes all. full stays the caller's.
 * TDM_ERR_ARG for a name o has not, TDM_ERR_SHAPE for another size or dtype,
 * TDM_ERR_DEVICE for another device. */
int tdm_optim_state_load(tdm_optim *o, const char *name, const tdm_tensor *full);
/* Frees the state (a sharded optimizer's shard and its bookkeeping too); not the paramset. */
void tdm_optim_free(tdm_optim *o);

/* ---- learning-rate schedules ----------------------------------------------------------- */

typedef enum {
    TDM_SCHED_CONSTANT,
    TDM_SCHED_STEP,      /* lr = base * gamma^(floor(epoch / step_size)) */
    TDM_SCHED_MULTISTEP, /* lr = base * gamma^(number of milestones <= epoch) */
    TDM_SCHED_COSINE,    /* linear warmup over warmup steps, then cosine to min_lr at total */
    TDM_SCHED_WARMUP,    /* linear from base*start_factor to base over warmup steps */
    TDM_SCHED_ONECYCLE,  /* PyTorch's OneCycleLR (two phases), max_lr = base_lr */
    TDM_SCHED_LINEAR,    /* linear warmup over warmup steps, then LinearLR to total */
} tdm_sched_kind;

typedef struct {
    tdm_sched_kind kind;
    float base_lr;
    float gamma;       /* STEP, MULTISTEP */
    int64_t step_size; /* STEP */
    int n_milestones;  /* MULTISTEP */
    int64_t milestones[16];
    int64_t warmup;     /* COSINE, WARMUP */
    int64_t total;      /* COSINE: steps until min_lr */
    float min_lr;       /* COSINE */
    float start_factor; /* WARMUP: PyTorch's LinearLR default 1/3; LINEAR: in (0, 1] */
    float end_factor;   /* LINEAR: in [0, 1] */
    /* ONECYCLE: the rate rises from base/div_factor to base over the first
     * pct_start * total steps, then falls to base/div_factor/final_div_factor at step
     * total - 1 (PyTorch's defaults: pct_start 0.3, div_factor 25, final_div_factor 1e4;
     * here div_factor 0 and final_div_factor 0 mean those defaults, pct_start is taken as
     * given). linear_anneal: anneal_strategy 'linear' instead of 'cos'. */
    float pct_start;
    float div_factor;
    float final_div_factor;
    bool linear_anneal;
} tdm_sched;

/* The learning rate at step t (t counts from 0), following PyTorch's StepLR, MultiStepLR,
 * LinearLR, CosineAnnealingLR and OneCycleLR closed forms (src/optim/sched.c gives each
 * formula). Takes a schedule the caller owns; an invalid one (a field out of range) returns
 * NAN and sets TDM_ERR_ARG naming the field. */
float tdm_sched_lr(const tdm_sched *s, int64_t t);
/* Sets o's learning rate to tdm_sched_lr(s, t). */
void tdm_sched_apply(const tdm_sched *s, tdm_optim *o, int64_t t);

/* ---- gradient clipping ------------------------------------------------------------------ */

/* Scales ps's gradients so their global 2-norm is at most max_norm (PyTorch's
 * clip_grad_norm_: factor max_norm/(norm+1e-6) clamped to 1). Returns the norm before
 * clipping through *total_norm. A non-finite norm is TDM_ERR_NUMERIC when error_if_nonfinite,
 * and gradients are then left unchanged. */
int tdm_clip_grad_norm(tdm_paramset *ps, float max_norm, bool error_if_nonfinite,
                       float *total_norm);

/* ---- loss scaling for fp16 training (torch.amp.GradScaler) ------------------------------ */

/* A gradient scaler with torch.amp.GradScaler's behaviour, step for step: the loss is
 * multiplied by the scale before backward so that small fp16 gradients do not flush to zero;
 * before the optimizer steps, the gradients are multiplied by 1/scale and checked; a step
 * whose gradients hold an inf or a NaN is skipped and the scale multiplied by
 * backoff_factor; after growth_interval steps in a row without one, the scale is multiplied
 * by growth_factor (kept only if finite). A training step is
 *
 *     loss = tdm_grad_scaler_scale(s, loss); tdm_backward(loss);
 *     tdm_grad_scaler_unscale(s, o);     (optional: before clipping the true gradients)
 *     tdm_grad_scaler_step(s, o, &stepped); tdm_grad_scaler_update(s);
 *
 * One scaler may serve several optimizers (up to TDM_GRAD_SCALER_MAX_OPTIMS between two
 * updates), each unscaled and stepped once per update, as PyTorch's per-optimizer stages.
 * The scaler reads the whole gradient an optimizer steps from: a ZeRO stage 2 optimizer
 * (its gradient sharded over the ranks, found infs differing) is refused here and unscaled
 * with tdm_ddp_unscale (tandem/parallel.h), which agrees on infs over the ranks. */
typedef struct tdm_grad_scaler tdm_grad_scaler;

#define TDM_GRAD_SCALER_MAX_OPTIMS 8

typedef struct {
    float init_scale;        /* 65536 (2^16) */
    double growth_factor;    /* 2.0; must be > 1 */
    double backoff_factor;   /* 0.5; must be in (0, 1) */
    int64_t growth_interval; /* 2000; must be >= 1 */
    bool enabled;            /* false: scale returns the loss, step just steps (PyTorch's
                                enabled=False) */
} tdm_grad_scaler_opts;

/* The state a checkpoint keeps: PyTorch's state_dict()["scale"] and ["_growth_tracker"]. */
typedef struct {
    float scale;
    int32_t growth_tracker; /* successful steps since the last growth or backoff */
} tdm_grad_scaler_state;

/* PyTorch's defaults (above), enabled. */
tdm_grad_scaler_opts tdm_grad_scaler_defaults(void);
/* A new scaler, caller-owned (tdm_grad_scaler_free). NULL (defaults) or options the caller
 * keeps. NULL and TDM_ERR_ARG naming the option for growth_factor <= 1, backoff_factor
 * outside (0, 1), growth_interval < 1 or a non-finite or non-positive init_scale (PyTorch
 * asserts the first two); TDM_ERR_NOMEM. */
tdm_grad_scaler *tdm_grad_scaler_new(const tdm_grad_scaler_opts *o);
/* loss * scale (an op recorded on the tape like tdm_mul_scalar: its backward multiplies the
 * incoming gradient by the scale), a new tensor owned as any op's output. The first call
 * fixes the scale at init_scale (or the loaded state's) as PyTorch's lazy init does.
 * Disabled: returns loss itself. NULL and an error for a NULL scaler or loss. */
tdm_tensor *tdm_grad_scaler_scale(tdm_grad_scaler *s, tdm_tensor *loss);
/* Divides o's gradients in place by the scale (a multiplication by the float nearest
 * 1/scale, as PyTorch) and records whether any of them, as they were before, was inf or
 * NaN. Settles stale gradients first (tdm_paramset_settle_grads). Once per optimizer
 * between updates: TDM_ERR_STATE when called again, or after tdm_grad_scaler_step, or before
 * any tdm_grad_scaler_scale; TDM_ERR_STATE for a ZeRO stage 2 optimizer (tdm_ddp_unscale
 * unscales it); TDM_ERR_ARG for
 * NULLs or a ninth optimizer. Disabled: TDM_OK, nothing done. */
int tdm_grad_scaler_unscale(tdm_grad_scaler *s, tdm_optim *o);
/* Unscales o's gradients if tdm_grad_scaler_unscale has not, then calls tdm_optim_step(o)
 * unless they held an inf or a NaN. *stepped (may be NULL) says which. TDM_ERR_STATE when
 * called twice for o between updates or before any scale; the optimizer's or the unscale's
 * error otherwise. Disabled: tdm_optim_step(o). */
int tdm_grad_scaler_step(tdm_grad_scaler *s, tdm_optim *o, bool *stepped);
/* Ends the iteration: the scale backs off if any optimizer stepped since the last update
 * found an inf or NaN, else the growth tracker counts the step and the scale grows after
 * growth_interval of them (PyTorch's _amp_update_scale_); every optimizer's stage is reset.
 * TDM_ERR_STATE when no optimizer was unscaled or stepped since the last update ("no inf
 * checks were recorded") or before any scale. Disabled: TDM_OK. */
int tdm_grad_scaler_update(tdm_grad_scaler *s);
/* update(new_scale) of PyTorch: sets the scale to new_scale (> 0, finite, else TDM_ERR_ARG),
 * leaves the growth tracker alone and resets the optimizers' stages. TDM_ERR_STATE before
 * any scale. */
int tdm_grad_scaler_update_to(tdm_grad_scaler *s, float new_scale);
/* The current scale (init_scale or the loaded state's before the first scale; 1 when
 * disabled, as PyTorch's get_scale). NULL: NAN. */
float tdm_grad_scaler_get_scale(const tdm_grad_scaler *s);
/* Whether the last tdm_grad_scaler_step on o skipped the optimizer's step (false when o was
 * not stepped since the last update). */
bool tdm_grad_scaler_found_inf(const tdm_grad_scaler *s, const tdm_optim *o);
/* The options s was made with (growth factor and the rest), to save next to the state. */
tdm_grad_scaler_opts tdm_grad_scaler_options(const tdm_grad_scaler *s);
/* The checkpoint state into *st: the scale and growth tracker as they are now (before the
 * first scale: the initial ones, as PyTorch's state_dict). TDM_ERR_ARG for NULLs. */
int tdm_grad_scaler_get_state(const tdm_grad_scaler *s, tdm_grad_scaler_state *st);
/* Restores a checkpoint's state: scale (> 0; inf or NaN refused) and growth tracker (>= 0,
 * below growth_interval), TDM_ERR_ARG naming the field otherwise, s unchanged. Allowed at
 * any time, as PyTorch's load_state_dict; a disabled scaler ignores it (TDM_OK). */
int tdm_grad_scaler_set_state(tdm_grad_scaler *s, const tdm_grad_scaler_state *st);
/* Frees s (not the optimizers). NULL: nothing. */
void tdm_grad_scaler_free(tdm_grad_scaler *s);

#ifdef __cplusplus
}
#endif
#endif
