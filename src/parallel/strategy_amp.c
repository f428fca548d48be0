/* Mixed precision for every strategy (tdm_strategy_set_precision): each forward module's
 * forward and the loss run inside an autocast region on the thread that runs them, through
 * forward hooks and a wrapped loss function, so that DataParallel's replica threads and a
 * pipeline's stage threads open their own regions (autocast is per thread). Backward runs
 * outside any region and follows the dtypes the forward recorded, as PyTorch's.
 *
 * fp16 adds a tdm_grad_scaler, driven by the steps that run their update on the caller's
 * thread (one device, DDP): scale -> backward -> unscale -> clip -> step -> update. */
#include "parallel/strategy.h"

#include "core/core.h"
#include "tandem/autocast.h"

#include <stdlib.h>

/* One forward module's hooks: ours around those it had before (FSDP's root hooks). */
struct amp_hook {
    tdm_module *m;
    tdm_forward_pre_hook prev_pre;
    tdm_forward_hook prev_post;
    void *prev_ctx;
    tdm_dtype dt;
};

/* Regions the pre hook opened on this thread that no post hook closed yet. A forward that
 * fails skips its post hook; the next pre hook on the thread closes that region first, so
 * a failed step leaves at most one region open, never a growing stack of them. */
static _Thread_local int open_regions;

static int amp_pre(tdm_module *m, void *ctx) {
    struct amp_hook *h = ctx;
    while (open_regions > 0 && tdm_autocast_end() == TDM_OK) open_regions--;
    int rc = tdm_autocast_begin(h->dt);
    if (rc) return rc;
    open_regions++;
    rc = h->prev_pre ? h->prev_pre(m, h->prev_ctx) : TDM_OK;
    if (rc && tdm_autocast_end() == TDM_OK) open_regions--;
    return rc;
}

static tdm_tensor *amp_post(tdm_module *m, tdm_tensor *out, void *ctx) {
    struct amp_hook *h = ctx;
    tdm_tensor *y = h->prev_post ? h->prev_post(m, out, h->prev_ctx) : out;
    if (open_regions > 0 && tdm_autocast_end() == TDM_OK) open_regions--;
    return y;
}

static tdm_module *forward_module(tdm_strategy *st, int i) {
    if (st->ops->forward_module) return st->ops->forward_module(st, i);
    return i < st->replicas ? st->ops->replica(st, i) : NULL;
}

static void remove_hooks(tdm_strategy *st) {
    for (int k = 0; k < st->n_hooks; k++) {
        struct amp_hook *h = &st->hooks[k];
        if (h->m && h->m->pre_hook == amp_pre && h->m->hook_ctx == h)
            tdm_module_set_forward_hooks(h->m, h->prev_pre, h->prev_post, h->prev_ctx);
    }
    free(st->hooks);
    st->hooks = NULL, st->n_hooks = 0;
}

int tdm_strategy_amp_hooks(tdm_strategy *st, tdm_dtype dt) {
    remove_hooks(st);
    if (dt == TDM_F32) return TDM_OK;
    int n = 0;
    while (forward_module(st, n)) n++;
    st->hooks = calloc((size_t)(n > 0 ? n : 1), sizeof *st->hooks);
    if (!st->hooks) return tdm_raise(TDM_ERR_NOMEM, "strategy set_precision: out of memory");
    for (int k = 0; k < n; k++) {
        tdm_module *m = forward_module(st, k);
        st->hooks[k] = (struct amp_hook){m, m->pre_hook, m->post_hook, m->hook_ctx, dt};
        tdm_module_set_forward_hooks(m, amp_pre, amp_post, &st->hooks[k]);
    }
    st->n_hooks = n;
    return TDM_OK;
}

tdm_tensor *tdm_strategy_amp_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    tdm_strategy *st = arg;
    if (st->precision == TDM_F32) return st->user_loss(out, target, row0, st->user_arg);
    if (tdm_autocast_begin(st->precision)) return NULL;
    tdm_tensor *l = st->user_loss(out, target, row0, st->user_arg);
    tdm_autocast_end();
    return l;
}

int tdm_strategy_amp_update(tdm_strategy *st, tdm_optim *o, tdm_ddp *ddp,
                            int (*clip_fn)(tdm_strategy *st)) {
    /* the gradients were averaged over the ranks before this (DDP's all-reduce): an inf or
     * NaN on any rank is one in the average on every rank (a sum with an inf or NaN in it is
     * not finite), so every rank skips the same steps and keeps the same scale */
    int rc = ddp ? tdm_ddp_unscale(ddp, st->scaler, o) : tdm_grad_scaler_unscale(st->scaler, o);
    if (!rc && clip_fn) rc = clip_fn(st);
    bool stepped = false;
    if (!rc) rc = tdm_grad_scaler_step(st->scaler, o, &stepped);
    if (!rc) rc = tdm_grad_scaler_update(st->scaler);
    st->skipped = !rc && !stepped;
    return rc;
}

void tdm_strategy_amp_free(tdm_strategy *st) {
    remove_hooks(st);
    tdm_grad_scaler_free(st->scaler);
    st->scaler = NULL;
}
