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
 *   LINEAR     t < warmup:  base * (t + 1) / warmup                     (linear warmup)
 *              t >= warmup: base * (sf + (ef - sf) * min(t - warmup, n) / n), n = total - warmup,
 *                           sf = start_factor, ef = end_factor
 *              With warmup 0 this is LinearLR(sf, ef, total_iters=total); with a warmup,
 *              SequentialLR([LinearLR(1/warmup, 1, warmup-1), LinearLR(sf, ef, n)], [warmup]).
 *   ONECYCLE   OneCycleLR(max_lr=base, total_steps=total, pct_start, anneal_strategy,
 *              div_factor d, final_div_factor f, three_phase=False):
 *              init = base / d, lo = init / f, e1 = pct_start * total - 1, e2 = total - 1;
 *              t <= e1: anneal(init, base, t / e1)
 *              else:    anneal(base, lo, (t - e1) / (e2 - e1)), t clamped to total - 1
 *              anneal cos: end + (start - end) / 2 * (1 + cos(pi * p));
 *              linear: start + (end - start) * p. (PyTorch raises past total; here the
 *              rate stays at lo.)
 *
 * WARMUP accepts start_factor 0 (warmup from zero), which PyTorch's LinearLR rejects.
 */
#include <math.h>

#include "core/core.h"
#include "tandem/optim.h"

static float sched_error(const char *what, const tdm_sched *s) {
    tdm_raise(TDM_ERR_ARG,
              "sched_lr: invalid schedule (kind %d): %s (step_size %lld, milestones %d, "
              "warmup %lld, total %lld, start_factor %g, end_factor %g, pct_start %g)",
              (int)s->kind, what, (long long)s->step_size, s->n_milestones, (long long)s->warmup,
              (long long)s->total, s->start_factor, s->end_factor, s->pct_start);
    return NAN;
}

static double cosine_lr(const tdm_sched *s, int64_t t) {
    double base = s->base_lr, lo = s->min_lr;
    if (t < s->warmup) return base * (double)(t + 1) / (double)s->warmup;
    if (t >= s->total) return lo;
    double x = (double)(t - s->warmup) / (double)(s->total - s->warmup);
    return lo + (base - lo) * (1.0 + cos(M_PI * x)) / 2.0;
}

static double linear_lr(const tdm_sched *s, int64_t t) {
    if (t < s->warmup) return s->base_lr * (double)(t + 1) / (double)s->warmup;
    int64_t n = s->total - s->warmup, k = t - s->warmup < n ? t - s->warmup : n;
    double sf = s->start_factor, ef = s->end_factor;
    return s->base_lr * (sf + (ef - sf) * (double)k / (double)n);
}

static double onecycle_anneal(const tdm_sched *s, double start, double end, double p) {
    if (s->linear_anneal) return (end - start) * p + start;
    return end + (start - end) / 2.0 * (cos(M_PI * p) + 1.0);
}

/* Phase boundaries in double as PyTorch computes them (float(pct_start * total) - 1), so a
 * step on a boundary falls on the same side. */
static double onecycle_lr(const tdm_sched *s, int64_t t) {
    double d = s->div_factor > 0 ? s->div_factor : 25.0;
    double f = s->final_div_factor > 0 ? s->final_div_factor : 1e4;
    double base = s->base_lr, init = base / d, lo = init / f;
    double e1 = (double)s->pct_start * (double)s->total - 1.0, e2 = (double)(s->total - 1);
    double x = (double)(t < s->total ? t : s->total - 1);
    if (x <= e1) return onecycle_anneal(s, init, base, x / e1);
    return onecycle_anneal(s, base, lo, (x - e1) / (e2 - e1));
}

static float onecycle_checked(const tdm_sched *s, int64_t t) {
    if (s->total <= 0 || !(s->pct_start >= 0 && s->pct_start <= 1))
        return sched_error("ONECYCLE needs total > 0 and pct_start in [0, 1]", s);
    if (!(s->div_factor >= 0) || !(s->final_div_factor >= 0))
        return sched_error("ONECYCLE needs div_factor, final_div_factor >= 0 (0: default)", s);
    /* PyTorch divides by the phase lengths too (ZeroDivisionError): a first phase ending at
     * step 0, or a second phase of no length */
    double e1 = (double)s->pct_start * (double)s->total - 1.0;
    if (e1 == 0.0 || e1 == (double)(s->total - 1))
        return sched_error("ONECYCLE: pct_start * total must not be 1 or total (empty phase)", s);
    return (float)onecycle_lr(s, t);
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
    case TDM_SCHED_LINEAR:
        if (s->warmup < 0 || s->total <= s->warmup)
            return sched_error("LINEAR needs 0 <= warmup < total", s);
        if (!(s->start_factor > 0 && s->start_factor <= 1) ||
            !(s->end_factor >= 0 && s->end_factor <= 1))
            return sched_error("LINEAR needs start_factor in (0, 1], end_factor in [0, 1]", s);
        return (float)linear_lr(s, t);
    case TDM_SCHED_ONECYCLE:
        return onecycle_checked(s, t);
    }
    return sched_error("unknown kind", s);
}

void tdm_sched_apply(const tdm_sched *s, tdm_optim *o, int64_t t) {
    float lr = tdm_sched_lr(s, t);
    if (!isnan(lr)) tdm_optim_set_lr(o, lr); /* an invalid schedule leaves lr as it was */
}
