/* The batch split's operations, as the parallel layer registered them (batch_split.h). One
 * atomic load and, once a context was ever set, one indirect call per batch-dependent layer
 * call. */
#include "nn/batch_split.h"

#include "core/hook.h"

static tdm_hook registered;

void tdm_batch_split_register(const tdm_batch_split_ops *ops) {
    tdm_hook_set(&registered, ops);
}

static const tdm_batch_split_ops *ops(void) {
    return tdm_hook_get(&registered);
}

bool tdm_batch_split_current(tdm_batch_split *out) {
    const tdm_batch_split_ops *o = ops();
    return o && o->current(out);
}

/* sum and abort are reached only through a split that current returned, so ops are set. */
int tdm_batch_split_sum(const tdm_batch_split *s, tdm_tensor *t) {
    return ops()->sum(s->group, t);
}

void tdm_batch_split_abort(const tdm_batch_split *s, const char *reason) {
    ops()->abort(s->group, reason);
}
