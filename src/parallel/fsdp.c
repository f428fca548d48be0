/* ZeRO stage 3 (PyTorch's FSDP FULL_SHARD, DeepSpeed's stage 3): the parameters sharded too.
 *
 * Each rank keeps the parameters of its shard of the flat buffer, the same range [lo, hi) as
 * its optimizer state and gradient under stages 1 and 2 (tdm_chunk_of), so the optimizer,
 * the gradient buckets and the checkpoints are stage 2's unchanged, and the weights bit for
 * bit stage 2's: a gather only moves values. The rest of the model lives in units, each a
 * module the caller names (a GPT's blocks) plus the root unit of the parameters outside
 * them (embeddings, final norm). A unit has a storage of its own that its parameters point
 * into, with memory only while gathered (tdm_storage_resize), so the autograd graph's
 * references to the parameters stay valid while the memory comes and goes.
 *
 * Forward: the root's pre-hook gathers the root unit (kept until backward is done with it)
 * and starts the first unit's gather; each unit's pre-hook waits for its own gather and starts
 * the next one's, so a unit's gather overlaps the compute before it; its post-hook frees it
 * and, with grad mode on, puts an identity node on its output. Backward reaches that node
 * before any of the unit's own nodes (they are behind it on the tape): it gathers the unit
 * again and starts the previous one's. A unit is freed again once every one of its
 * parameters' gradient-ready hooks has fired, since then no node left reads it.
 *
 * A gather is one broadcast per rank whose range meets the unit, each owner first copying its
 * part from its shard: units are contiguous runs of the flat buffer, so a unit is mostly one
 * owner's, and no padding or copy out of a gathered buffer is needed. Collectives go in the
 * same order on every rank: forward and backward walk the units in the same order, and the
 * gathers are launched from the hooks, on the thread that launches DDP's reductions.
 *
 * With a param_dtype of bf16 (FSDP2's MixedPrecisionPolicy), the hooks' gathers move the
 * parameters rounded to bf16 (each owner rounds its part into a bf16 buffer of the unit's,
 * with memory only while gathering; every rank widens the whole gathered buffer back into the
 * unit's f32 one): half the bytes, and every rank computes with the same rounded values in
 * forward and backward, as FSDP2's bf16 parameters. The shards, the optimizer and a summoned
 * model (checkpoints, exports) stay exact f32. */
#include "parallel/fsdp.h"

#include "autograd/tape.h"
#include "optim/shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { UNIT_FREE, UNIT_GATHERING, UNIT_READY } unit_state;

typedef struct {
    int64_t lo, hi, at; /* flat elements [lo, hi), at element `at` of the unit's buffer */
} run;

typedef struct unit {
    struct tdm_zero3 *f;
    int index;     /* in f->units, or -1 for the root unit */
    tdm_module *m; /* NULL for the root unit */
    char name[96];
    run *runs;
    int n_runs, n_params;
    int64_t numel;
    tdm_tensor *buf;    /* [numel] on the unit's storage: memory only while gathered */
    tdm_tensor *low;    /* [numel] bf16 on a storage of its own: memory only while gathering */
    tdm_dtype gathered; /* the dtype of the gather in flight or done (f32 or bf16) */
    int pending;        /* this backward: parameters whose gradient is not final yet */
    unit_state state;
    tdm_work **works; /* [n_runs * size]: one gather's broadcasts */
    int n_works;
} unit;

struct tdm_zero3 {
    tdm_module *root;
    tdm_paramset *ps;
    tdm_group *g;
    int rank, size;
    int64_t lo, hi;    /* this rank's shard of the flat buffer */
    tdm_tensor *shard; /* [hi - lo]: the parameters this rank keeps; its optimizer updates them */
    unit *units;       /* [n_units + 1]: the caller's, in forward order, then the root unit */
    int n_units;
    int *unit_of; /* [ps->n]: each parameter's unit */
    bool summoned;
    int error;             /* first failure of a gather in a hook, since tdm_zero3_backward_begin */
    tdm_dtype param_dtype; /* the dtype the hooks' gathers move: f32, or bf16 (fsdp.h) */
};

static unit *root_unit(tdm_zero3 *f) {
    return &f->units[f->n_units];
}

/* ---- gathering and freeing ------------------------------------------------------------------ */

static int gather_failed(unit *u, int rc) {
    char msg[600];
    snprintf(msg, sizeof msg, "gathering the parameters of %s: %s", u->name, tdm_last_error());
    tdm_group_abort(u->f->g, msg);
    if (!u->f->error) u->f->error = rc;
    return tdm_raise(rc, "%s", msg);
}

/* Starts gathering u in dt (f32, or bf16 through u->low: memory from the allocator, this
 * rank's part copied from its shard, one broadcast per owner); nothing when u is not free. */
static int gather_start(unit *u, tdm_dtype dt) {
    tdm_zero3 *f = u->f;
    if (u->state != UNIT_FREE || !u->numel) return TDM_OK;
    bool low = dt == TDM_BF16;
    int rc = tdm_storage_resize(u->buf->storage, sizeof(float) * (size_t)u->numel);
    if (!rc && low) rc = tdm_storage_resize(u->low->storage, 2 * (size_t)u->numel);
    if (rc) return gather_failed(u, rc);
    u->state = UNIT_GATHERING;
    u->gathered = low ? TDM_BF16 : TDM_F32;
    u->n_works = 0;
    for (int j = 0; j < u->n_runs && !rc; j++) {
        const run *ru = &u->runs[j];
        for (int r = 0; r < f->size && !rc; r++) {
            int64_t rlo, rhi;
            tdm_chunk_of(f->ps->total, sizeof(float), f->size, r, &rlo, &rhi);
            int64_t a = ru->lo > rlo ? ru->lo : rlo, e = ru->hi < rhi ? ru->hi : rhi;
            if (a >= e) continue;
            tdm_tensor v =
                tdm_range_view(low ? u->low : u->buf, ru->at + a - ru->lo, ru->at + e - ru->lo);
            if (r == f->rank) {
                tdm_tensor mine = tdm_range_view(f->shard, a - f->lo, e - f->lo);
                rc = tdm_copy_(&v, &mine);
            }
            if (!rc && f->size > 1)
                tdm_collective_label("stage-3 gather of unit %d from rank %d", u->index, r);
            tdm_work *w = rc || f->size == 1 ? NULL : tdm_broadcast(f->g, &v, r);
            if (w)
                u->works[u->n_works++] = w;
            else if (!rc && f->size > 1)
                rc = tdm_last_status();
        }
    }
    return rc ? gather_failed(u, rc) : TDM_OK;
}

/* Waits for u's gather (started here in dt when it was not); a bf16 one is widened into the
 * f32 buffer. A failure to start was reported already; the broadcasts it did launch are still
 * waited for (they write into u). */
static int gather_wait(unit *u, tdm_dtype dt) {
    int started = gather_start(u, dt), rc = TDM_OK;
    if (u->state != UNIT_GATHERING) return started;
    for (int k = 0; k < u->n_works; k++) {
        int w = tdm_work_wait(u->works[k]);
        if (!rc) rc = w;
    }
    u->n_works = 0;
    u->state = UNIT_READY;
    if (u->gathered == TDM_BF16) {
        tdm_tensor all = tdm_range_view(u->buf, 0, u->numel),
                   from = tdm_range_view(u->low, 0, u->numel);
        if (!rc && !started) rc = tdm_copy_(&all, &from);
        tdm_storage_resize(u->low->storage, 0);
    }
    return started ? started : rc ? gather_failed(u, rc) : TDM_OK;
}

/* u's memory back to the allocator (after its gather is done: broadcasts write into it). */
static void unit_free(unit *u) {
    if (u->state == UNIT_FREE || !u->buf) return;
    if (u->state == UNIT_GATHERING) gather_wait(u, u->gathered);
    tdm_storage_resize(u->buf->storage, 0);
    u->state = UNIT_FREE;
}

/* ---- the hooks ------------------------------------------------------------------------------ */

static int root_pre(tdm_module *m, void *ctx) {
    tdm_zero3 *f = ctx;
    if (f->summoned) return TDM_OK;
    int rc = gather_start(root_unit(f), f->param_dtype);
    if (!rc && f->n_units)
        rc = gather_start(&f->units[0], f->param_dtype); /* overlaps the embeddings */
    return rc ? rc : gather_wait(root_unit(f), f->param_dtype);
}

/* The root unit stays gathered for the backward (its parameters are read at both ends of
 * the forward); freed here only when no backward follows. */
static tdm_tensor *root_post(tdm_module *m, tdm_tensor *out, void *ctx) {
    tdm_zero3 *f = ctx;
    if (!f->summoned && !tdm_grad_enabled()) unit_free(root_unit(f));
    return out;
}

static int unit_pre(tdm_module *m, void *ctx) {
    unit *u = ctx;
    tdm_zero3 *f = u->f;
    if (f->summoned) return TDM_OK;
    int rc = gather_start(u, f->param_dtype);
    if (!rc && u->index + 1 < f->n_units)
        rc = gather_start(&f->units[u->index + 1], f->param_dtype);
    return rc ? rc : gather_wait(u, f->param_dtype);
}

/* Backward of a unit's identity node: the unit gathered again before its own nodes run,
 * the previous unit's gather started. */
static int unit_backward(tdm_node *n, tdm_tensor *gout) {
    unit *u = n->ctx;
    tdm_zero3 *f = u->f;
    int rc = TDM_OK;
    if (!f->summoned) {
        rc = gather_start(u, f->param_dtype);
        if (!rc && u->index > 0) rc = gather_start(&f->units[u->index - 1], f->param_dtype);
        if (!rc) rc = gather_wait(u, f->param_dtype);
    }
    return rc ? rc : tdm_grad_accumulate(n->in[0], gout);
}

static tdm_tensor *unit_post(tdm_module *m, tdm_tensor *out, void *ctx) {
    unit *u = ctx;
    if (u->f->summoned) return out;
    unit_free(u);
    if (!tdm_grad_enabled() || !out->requires_grad) return out;
    tdm_tensor *y = tdm_tensor_view(out, out->ndim, out->shape, out->strides, out->offset);
    tdm_node *n = y ? tdm_record("fsdp_unit", unit_backward, y, 1, &out) : NULL;
    if (!n) return NULL;
    n->ctx = u;
    return y;
}

/* A parameter's gradient is final: no node left reads it; its unit goes when all are. */
static void on_grad_ready(tdm_tensor *param, void *ctx) {
    unit *u = ctx;
    if (!u->f->summoned && --u->pending == 0) unit_free(u);
}

void tdm_zero3_backward_begin(tdm_zero3 *f) {
    for (int k = 0; k <= f->n_units; k++) f->units[k].pending = f->units[k].n_params;
    f->error = 0;
}

int tdm_zero3_backward_end(tdm_zero3 *f) {
    if (!f->summoned)
        for (int k = 0; k <= f->n_units; k++) unit_free(&f->units[k]);
    return f->error;
}

/* ---- building the units --------------------------------------------------------------------- */

/* Marks the parameters of m's subtree as unit k's; an error when one is another unit's. */
static int mark_subtree(tdm_zero3 *f, const tdm_module *m, int k) {
    for (int j = 0; j < m->n_params; j++) {
        int i = 0;
        while (i < f->ps->n && f->ps->params[i] != m->params[j]) i++;
        if (i == f->ps->n) continue; /* not the root's (cannot happen for a subtree) */
        if (f->unit_of[i] != f->n_units)
            return tdm_raise(TDM_ERR_ARG,
                             "ddp_set_shard: parameter '%s' is in two units (%d and %d): "
                             "the units must be disjoint subtrees of the model",
                             f->ps->names[i], f->unit_of[i], k);
        f->unit_of[i] = k;
    }
    for (int c = 0; c < m->n_children; c++) {
        int rc = mark_subtree(f, m->children[c], k);
        if (rc) return rc;
    }
    return TDM_OK;
}

/* Unit k's runs of consecutive parameters, its name and its buffer holding its parameters'
 * current values (copied from ps->flat). */
static int unit_make(tdm_zero3 *f, int k, tdm_module *m) {
    unit *u = &f->units[k];
    tdm_paramset *ps = f->ps;
    *u = (unit){.f = f, .index = k < f->n_units ? k : -1, .m = m};
    if (!(u->runs = calloc((size_t)ps->n + 1, sizeof *u->runs)))
        return tdm_raise(TDM_ERR_NOMEM, "ddp_set_shard: out of memory");
    for (int i = 0; i < ps->n; i++) {
        if (f->unit_of[i] != k) continue;
        int64_t lo = ps->offsets[i], hi = lo + tdm_numel(ps->params[i]);
        run *last = u->n_runs ? &u->runs[u->n_runs - 1] : NULL;
        if (last && last->hi == lo)
            last->hi = hi;
        else
            u->runs[u->n_runs++] = (run){lo, hi, u->numel};
        u->numel += hi - lo;
        if (!u->n_params++) { /* named after the first parameter's module: "transformer.h.0" */
            const char *dot = strrchr(ps->names[i], '.');
            int len = dot ? (int)(dot - ps->names[i]) : 0;
            snprintf(u->name, sizeof u->name, "%s%.*s", m ? "unit " : "the root's parameters",
                     m ? len : 0, ps->names[i]);
        }
    }
    if (m && !u->numel)
        return tdm_raise(TDM_ERR_ARG, "ddp_set_shard: unit %d (a %s) holds no parameters", k,
                         m->ops->kind);
    if (!(u->works = calloc((size_t)u->n_runs * (size_t)f->size + 1, sizeof *u->works)))
        return tdm_raise(TDM_ERR_NOMEM, "ddp_set_shard: out of memory");
    u->buf =
        tdm_tensor_alloc_owned(TDM_SHAPE(u->numel ? u->numel : 1), TDM_F32, ps->flat->device, NULL);
    u->low = u->buf ? tdm_tensor_alloc_owned(TDM_SHAPE(u->numel ? u->numel : 1), TDM_BF16,
                                             ps->flat->device, NULL)
                    : NULL;
    if (!u->buf || !u->low) return tdm_last_status();
    tdm_storage_resize(u->low->storage, 0); /* memory only while gathering in bf16 */
    int rc = TDM_OK;
    for (int j = 0; j < u->n_runs && !rc; j++) {
        tdm_tensor dst =
            tdm_range_view(u->buf, u->runs[j].at, u->runs[j].at + u->runs[j].hi - u->runs[j].lo);
        tdm_tensor src = tdm_range_view(ps->flat, u->runs[j].lo, u->runs[j].hi);
        rc = tdm_copy_(&dst, &src);
    }
    u->state = UNIT_READY;
    return rc;
}

/* Parameter i's tensor onto storage s at element off (its autograd identity unchanged). */
static void repoint(tdm_tensor *p, tdm_storage *s, int64_t off) {
    tdm_storage_retain(s);
    tdm_storage_release(p->storage);
    p->storage = s;
    p->offset = off;
}

/* Every parameter a view of its unit's buffer (to_units) or of ps->flat. */
static void repoint_all(tdm_zero3 *f, bool to_units) {
    tdm_paramset *ps = f->ps;
    for (int i = 0; i < ps->n; i++) {
        unit *u = &f->units[f->unit_of[i]];
        int j = 0;
        while (u->runs[j].hi <= ps->offsets[i]) j++;
        int64_t off = u->buf->offset + u->runs[j].at + ps->offsets[i] - u->runs[j].lo;
        if (to_units)
            repoint(ps->params[i], u->buf->storage, off);
        else
            repoint(ps->params[i], ps->flat->storage, ps->flat->offset + ps->offsets[i]);
    }
}

static void units_free(tdm_zero3 *f) {
    for (int k = 0; f->units && k <= f->n_units; k++) {
        free(f->units[k].runs);
        free(f->units[k].works);
        tdm_tensor_free(f->units[k].buf);
        tdm_tensor_free(f->units[k].low);
    }
    free(f->units);
    free(f->unit_of);
    tdm_tensor_free(f->shard);
    free(f);
}

/* The hooks: forward around root and every unit, gradient-ready on every parameter. */
static int hooks_set(tdm_zero3 *f, tdm_module *const *units) {
    int rc = tdm_module_set_forward_hooks(f->root, root_pre, root_post, f);
    for (int k = 0; k < f->n_units && !rc; k++)
        rc = tdm_module_set_forward_hooks(units[k], unit_pre, unit_post, &f->units[k]);
    for (int i = 0; i < f->ps->n && !rc; i++)
        rc = tdm_register_grad_hook(f->ps->params[i], on_grad_ready, &f->units[f->unit_of[i]]);
    return rc;
}

tdm_zero3 *tdm_zero3_new(tdm_module *root, tdm_paramset *ps, tdm_group *g, tdm_optim *o,
                         tdm_module *const *units, int n) {
    if (n < 0 || (n && !units)) return tdm_raise_null(TDM_ERR_ARG, "ddp_set_shard: %d units", n);
    tdm_zero3 *f = calloc(1, sizeof *f);
    if (!f) return tdm_raise_null(TDM_ERR_NOMEM, "ddp_set_shard: out of memory");
    *f = (tdm_zero3){.root = root, .ps = ps, .g = g, .rank = tdm_group_rank(g)};
    f->size = tdm_group_size(g);
    f->n_units = n;
    tdm_optim_shard_range(o, &f->lo, &f->hi);
    f->units = calloc((size_t)n + 1, sizeof *f->units);
    f->unit_of = malloc(sizeof *f->unit_of * (size_t)(ps->n + 1));
    int rc =
        f->units && f->unit_of ? TDM_OK : tdm_raise(TDM_ERR_NOMEM, "ddp_set_shard: out of memory");
    for (int i = 0; !rc && i < ps->n; i++) f->unit_of[i] = n; /* the root's until marked */
    for (int k = 0; k < n && !rc; k++)
        rc = units[k] && units[k] != root ? mark_subtree(f, units[k], k)
                                          : tdm_raise(TDM_ERR_ARG, "ddp_set_shard: unit %d is %s",
                                                      k, units[k] ? "the model itself" : "NULL");
    for (int k = 0; k <= n && !rc; k++) rc = unit_make(f, k, k < n ? units[k] : NULL);
    f->shard =
        rc ? NULL
           : tdm_tensor_alloc_owned(TDM_SHAPE(f->hi - f->lo + 1), TDM_F32, ps->flat->device, NULL);
    if (!rc && !f->shard) rc = tdm_last_status();
    if (!rc) {
        f->shard->shape[0] = f->hi - f->lo; /* allocated one more: an empty shard is legal */
        tdm_tensor mine = tdm_range_view(ps->flat, f->lo, f->hi);
        rc = tdm_copy_(f->shard, &mine);
    }
    if (!rc) rc = tdm_optim_use_params(o, f->shard, f->lo);
    if (!rc) rc = hooks_set(f, units);
    if (rc) {
        tdm_zero3_free(f);
        return NULL;
    }
    repoint_all(f, true);
    tdm_storage_resize(ps->flat->storage, 0);
    for (int k = 0; k <= n; k++) unit_free(&f->units[k]);
    return f;
}

/* ---- the whole model, for checkpoints and exports ------------------------------------------ */

int tdm_zero3_summon(tdm_zero3 *f) {
    if (f->summoned) return TDM_OK;
    tdm_paramset *ps = f->ps;
    int rc = tdm_storage_resize(ps->flat->storage, sizeof(float) * (size_t)ps->total);
    for (int k = 0; k <= f->n_units && !rc; k++) {
        unit *u = &f->units[k];
        if (u->state != UNIT_FREE && u->gathered != TDM_F32) unit_free(u); /* exact values */
        rc = gather_wait(u, TDM_F32);
        for (int j = 0; j < u->n_runs && !rc; j++) {
            tdm_tensor dst = tdm_range_view(ps->flat, u->runs[j].lo, u->runs[j].hi);
            tdm_tensor src = tdm_range_view(u->buf, u->runs[j].at,
                                            u->runs[j].at + u->runs[j].hi - u->runs[j].lo);
            rc = tdm_copy_(&dst, &src);
        }
        unit_free(u);
    }
    if (rc) {
        tdm_storage_resize(ps->flat->storage, 0);
        return rc;
    }
    repoint_all(f, false);
    f->summoned = true;
    return TDM_OK;
}

int tdm_zero3_reshard(tdm_zero3 *f) {
    if (!f->summoned) return TDM_OK;
    tdm_tensor mine = tdm_range_view(f->ps->flat, f->lo, f->hi);
    int rc = tdm_copy_(f->shard, &mine); /* a checkpoint loaded while whole takes effect */
    repoint_all(f, true);
    tdm_storage_resize(f->ps->flat->storage, 0);
    f->summoned = false;
    return rc;
}

int tdm_zero3_set_param_dtype(tdm_zero3 *f, tdm_dtype dt) {
    if (dt != TDM_F32 && dt != TDM_BF16)
        return tdm_raise(TDM_ERR_DTYPE, "ddp: param_dtype %s (expected f32 or bf16)",
                         tdm_dtype_name(dt));
    f->param_dtype = dt;
    return TDM_OK;
}

int tdm_zero3_unit_count(const tdm_zero3 *f) {
    return f ? f->n_units : 0;
}

void tdm_zero3_free(tdm_zero3 *f) {
    if (!f) return;
    tdm_module_set_forward_hooks(f->root, NULL, NULL, NULL);
    for (int k = 0; k < f->n_units; k++)
        if (f->units[k].m) tdm_module_set_forward_hooks(f->units[k].m, NULL, NULL, NULL);
    for (int k = 0; k <= f->n_units && f->units; k++) unit_free(&f->units[k]);
    units_free(f);
}
