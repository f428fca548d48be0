/* Autocast (include/tandem/autocast.h): the thread's stack of regions and its cast cache.
 *
 * Ops ask tdm_autocast_arg for each float input at their entry (autograd/ops.h), so an op
 * then runs as it would on inputs of that dtype outside a region: the casts are ordinary
 * tdm_to_dtype nodes, the op's node saves the cast tensors, and its backward runs in the
 * dtype its forward ran without knowing about autocast.
 *
 * The cache holds, for each parameter cast in the outermost region, the cast and the tape
 * node that made it. A cast is only good while its node is still on the part of the tape no
 * backward has walked: after a backward its gradient would no longer reach the parameter,
 * and after its step scope ends the tensor is gone (the scope truncates the tape with it).
 * So a lookup checks the node against the tape, and a stale entry is replaced.
 *
 * The cache is a fixed array in the thread's state, not heap memory: a region begun every
 * step then costs the system allocator nothing (test_steady_state's rule) and a thread that
 * ends leaves nothing behind. A region casting more parameters than it holds casts the rest
 * each time they are used: correct, only slower.
 */
#include "tandem/autocast.h"

#include "autograd/ops.h"

typedef struct {
    const tdm_tensor *src; /* the parameter */
    tdm_tensor *cast;
    tdm_node *node; /* the cast's to_dtype node, at tape position index */
    int index;
} cast_entry;

/* The parameters a region caches: a GPT-2 small has 148 parameter tensors. */
#define CACHE_MAX 512

typedef struct {
    int depth;
    tdm_dtype stack[TDM_AUTOCAST_MAX_DEPTH];
    cast_entry cache[CACHE_MAX];
    int n;
    int64_t casts;
    bool cache_off;
} autocast_state;

static _Thread_local autocast_state ac;

int tdm_autocast_begin(tdm_dtype dt) {
    if (!tdm_dtype_valid(dt) || !tdm_dtype_is_float(dt))
        return tdm_raise(TDM_ERR_DTYPE,
                         "autocast_begin: dtype %s is not a float dtype (bf16, "
                         "f16, or f32 to turn autocast off inside)",
                         tdm_dtype_valid(dt) ? tdm_dtype_name(dt) : "(unknown)");
    if (ac.depth == TDM_AUTOCAST_MAX_DEPTH)
        return tdm_raise(TDM_ERR_STATE, "autocast_begin: %d regions already open on this thread",
                         TDM_AUTOCAST_MAX_DEPTH);
    ac.stack[ac.depth++] = dt;
    return TDM_OK;
}

int tdm_autocast_end(void) {
    if (ac.depth == 0)
        return tdm_raise(TDM_ERR_STATE, "autocast_end: no autocast region is open on this thread");
    if (--ac.depth == 0) ac.n = 0;
    return TDM_OK;
}

tdm_dtype tdm_autocast_dtype(void) {
    return ac.depth ? ac.stack[ac.depth - 1] : TDM_F32;
}

bool tdm_autocast_set_cache(bool enabled) {
    bool prev = !ac.cache_off;
    ac.cache_off = !enabled;
    return prev;
}

int64_t tdm_autocast_cast_count(void) {
    return ac.casts;
}

/* The entry of src cast to dt whose cast is still usable, or NULL (stale entries are left
 * for cache_put to overwrite). */
static cast_entry *cache_find(const tdm_tensor *src, tdm_dtype dt) {
    int start, end;
    tdm_node **tape = tdm_tape_nodes(&start, &end);
    for (int i = 0; i < ac.n; i++) {
        cast_entry *e = &ac.cache[i];
        if (e->src != src || e->index < start || e->index >= end || tape[e->index] != e->node)
            continue;
        if (e->node->out == e->cast && e->node->in[0] == src && e->cast->dtype == dt) return e;
    }
    return NULL;
}

/* Remembers cast (made by a node on the tape) as src's cast. Best effort: with the cache
 * full, the next op simply casts again. */
static void cache_put(const tdm_tensor *src, tdm_tensor *cast) {
    int start, end;
    tdm_node **tape = tdm_tape_nodes(&start, &end);
    cast_entry *slot = NULL;
    for (int i = 0; i < ac.n && !slot; i++) { /* reuse a stale entry of the same parameter */
        cast_entry *e = &ac.cache[i];
        bool live = e->index >= start && e->index < end && tape[e->index] == e->node;
        if (e->src == src && (!live || e->cast->dtype == cast->dtype)) slot = e;
    }
    if (!slot) {
        if (ac.n == CACHE_MAX) return;
        slot = &ac.cache[ac.n++];
    }
    *slot = (cast_entry){src, cast, cast->grad_fn, cast->grad_fn->index};
}

tdm_dtype tdm_autocast_want(const tdm_tensor *t, tdm_autocast_list list) {
    if (ac.depth == 0 || !tdm_dtype_is_float(t->dtype)) return t->dtype;
    tdm_dtype region = ac.stack[ac.depth - 1];
    if (region == TDM_F32) return t->dtype; /* a disabled region */
    if (list == TDM_AC_F32_CUDA && t->device.type != TDM_CUDA) return t->dtype;
    return list == TDM_AC_LOW ? region : TDM_F32;
}

tdm_tensor *tdm_autocast_arg(tdm_tensor *t, tdm_autocast_list list) {
    if (!t) return t;
    tdm_dtype want = tdm_autocast_want(t, list);
    if (t->dtype == want) return t;
    /* PyTorch caches the casts of fp32 leaves that require grad (the parameters) */
    bool cacheable = list == TDM_AC_LOW && !ac.cache_off && !t->grad_fn && tdm_needs_record(1, &t);
    if (cacheable) {
        cast_entry *e = cache_find(t, want);
        if (e) return e->cast;
    }
    tdm_tensor *c = tdm_to_dtype(t, want);
    if (!c) return NULL;
    ac.casts++;
    if (cacheable && c->grad_fn) cache_put(t, c);
    return c;
}
