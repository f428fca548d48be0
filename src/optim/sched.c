/* Learning-rate schedules as closed forms of t (the step or epoch, from 0), so any step can
 * be computed directly (resuming from a checkpoint needs no replay). They agree with
 * torch.optim.lr_scheduler's sequences up to float rounding (PyTorch's chainable forms
 * multiply step by step):
 *
 *   CONSTANT   base
 *   STEP       base * gamma^floor(t / step_size)                        (StepLR)
 *   MULTISTEP  base * gamma^#{milestones <= t}                          (MultiStepLR)
 *   WARMUP     base * (f + (1 - f) * min(t, warmup) / warmup), f = start_factor
 *                                                         (LinearLR, end_factor 1)
 *   COSINE     t < warmup:  base * (t + 1) / warmup                     (linear warmup)
 *              t < total:   min + (base - min) * (1 + cos(pi * (t - warmup) / (total - warmup))) /
 * 2 t >= total:  min With warmup 0 this is CosineAnnealingLR(T_max=total, eta_min=min) for t <=
 * total; with a warmup it equals SequentialLR([LinearLR(1/warmup, 1, warmup-1),
 *     CosineAnnealingLR(total-warmup, min)], [warmup]). Unlike CosineAnnealingLR, the rate
 *     stays at min after total instead of rising again.
 *
 * WARMUP accepts start_factor 0 (warmup from zero), which PyTorch's LinearLR rejects.
 */
#include <math.h>

#include "core/core.h"
#include "tandem/optim.h"

static float sched_error(const char *what, const tdm_sched *s) {
    tdm_raise(TDM_ERR_ARG,
              "sched_lr: invalid schedule (kind %d): %s (step_size %lld, milestones %d, "
              "warmup %lld, total %lld, start_factor %g)",
              (int)s->kind, what, (long long)s->step_size, s->n_milestones, (long long)s->warmup,
              (long long)s->total, s->start_factor);
    return NAN;
}

static double cosine_lr(const tdm_sched *s, int64_t t) {
    double base = s->base_lr, lo = s->min_lr;
    if (t < s->warmup) return base * (double)(t + 1) / (double)s->warmup;
    if (t >= s->total) return lo;
    double x = (double)(t - s->warmup) / (double)(s->total - s->warmup);
    return lo + (base - lo) * (1.0 + cos(M_PI * x)) / 2.0;
}

float tdm_sched_lr(const tdm_sched *s, int64_t t) {
    if (!s) {
        tdm_raise(TDM_ERR_ARG, "sched_lr: schedule is NULL");
        return NAN;
    }
    if (t < 0) t = 0;
    double base = s->base_lr;
    switch (s->kind) {
    case TDM_SCHED_CONSTANT:
        return s->base_lr;
    case TDM_SCHED_STEP:
        if (s->step_size <= 0) return sched_error("step_size must be positive", s);
        return (float)(base * pow((double)s->gamma, (double)(t / s->step_size)));
    case TDM_SCHED_MULTISTEP: {
        if (s->n_milestones < 0 || s->n_milestones > 16)
            return sched_error("n_milestones must be in [0, 16]", s);
        int k = 0;
        for (int i = 0; i < s->n_milestones; i++) k += s->milestones[i] <= t;
        return (float)(base * pow((double)s->gamma, (double)k));
    }
    case TDM_SCHED_WARMUP: {
        if (s->warmup < 0 || !(s->start_factor >= 0 && s->start_factor <= 1))
            return sched_error("warmup must be >= 0 and start_factor in [0, 1]", s);
        if (s->warmup == 0 || t >= s->warmup) return s->base_lr;
        double f = s->start_factor;
        return (float)(base * (f + (1.0 - f) * (double)t / (double)s->warmup));
    }
    case TDM_SCHED_COSINE:
        if (s->warmup < 0 || s->total < s->warmup)
            return sched_error("need 0 <= warmup <= total", s);
        return (float)cosine_lr(s, t);
    }
    return sched_error("unknown kind", s);
}

void tdm_sched_apply(const tdm_sched *s, tdm_optim *o, int64_t t) {
    float lr = tdm_sched_lr(s, t);
    if (!isnan(lr)) tdm_optim_set_lr(o, lr); /* an invalid schedule leaves lr as it was */
}
