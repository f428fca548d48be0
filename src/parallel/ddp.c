/* DistributedDataParallel: one replica per rank; gradients averaged over the group in buckets
 * that are slices of the flat gradient buffer, each all-reduced as soon as its parameters'
 * gradients are final, so communication overlaps the rest of backward.
 *
 * Buckets follow PyTorch: parameters in reverse registration order (the order backward
 * usually finishes them), the first bucket capped at 1 MiB so communication starts early,
 * the rest at 25 MiB; all-reduces are launched in bucket order on every rank, since the
 * ranks must issue collectives in the same order. Reverse registration order is a contiguous
 * range of the flat buffer for every bucket, so a bucket is a view, never a copy. */
#include "tandem/parallel.h"

#include "autograd/tape.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t lo, hi; /* element range of the flat gradient */
    int n_params;
    int pending; /* parameters whose gradient is not final yet this backward */
    tdm_tensor view;
    tdm_work *work;
} bucket;

typedef struct {
    struct tdm_ddp *ddp;
    int bucket;
    bool ready;
} param_slot;

struct tdm_ddp {
    tdm_module *replica;
    tdm_paramset *ps;
    tdm_bufferset *bs;
    tdm_group *g;
    tdm_ddp_opts o;
    int n_buckets, next_launch;
    bucket *buckets;
    param_slot *slots;
    bool sync;
    int launch_error; /* first failure to launch a collective during backward */
};

tdm_ddp_opts tdm_ddp_defaults(void) {
    tdm_ddp_opts o = {25 << 20, 1 << 20, false, true};
    return o;
}

/* ---- checks at wrap time ----------------------------------------------------------------- */

static uint64_t hash_name(const char *s) { /* FNV-1a */
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

#define SIG_PER_PARAM (2 + TDM_MAX_DIMS)

/* Rank 0's parameter signature (count, then name hash, ndim, dims per parameter) is
 * broadcast; a rank that differs names the first difference and aborts the group, so every
 * rank fails at the final barrier-like all-reduce. */
static int check_same_params(tdm_ddp *d) {
    tdm_paramset *ps = d->ps;
    int rank = tdm_group_rank(d->g);
    tdm_tensor *count = tdm_full(TDM_SHAPE(1), (float)ps->n, TDM_I64, tdm_group_memory(d->g));
    int rc = tdm_work_wait(tdm_broadcast(d->g, count, 0));
    int64_t n0 = 0;
    if (!rc) tdm_to_host(count, &n0, sizeof n0);
    tdm_tensor_free(count);
    if (rc) return rc;
    char msg[512] = "";
    if (n0 != ps->n) {
        snprintf(msg, sizeof msg, "ddp: rank %d has %d parameters, rank 0 has %lld", rank, ps->n,
                 (long long)n0);
    } else {
        int64_t *sig = calloc((size_t)ps->n * SIG_PER_PARAM + 1, sizeof *sig);
        if (!sig) return tdm_raise(TDM_ERR_NOMEM, "ddp: out of memory");
        for (int i = 0; i < ps->n; i++) {
            int64_t *s = sig + (size_t)i * SIG_PER_PARAM;
            s[0] = (int64_t)hash_name(ps->names[i]);
            s[1] = ps->params[i]->ndim;
            memcpy(s + 2, ps->params[i]->shape, sizeof(int64_t) * TDM_MAX_DIMS);
        }
        tdm_tensor *t = tdm_from_data(TDM_SHAPE((int64_t)ps->n * SIG_PER_PARAM), TDM_I64,
                                      tdm_group_memory(d->g), sig);
        rc = t ? tdm_work_wait(tdm_broadcast(d->g, t, 0)) : tdm_last_status();
        int64_t *sig0 = malloc(sizeof *sig0 * ((size_t)ps->n * SIG_PER_PARAM + 1));
        if (!rc && sig0) tdm_to_host(t, sig0, sizeof *sig0 * (size_t)ps->n * SIG_PER_PARAM);
        for (int i = 0; !rc && sig0 && i < ps->n && !msg[0]; i++) {
            const int64_t *a = sig + (size_t)i * SIG_PER_PARAM,
                          *b = sig0 + (size_t)i * SIG_PER_PARAM;
            char s0[96], s1[96];
            tdm_shape sa = {(int)a[1], {0}}, sb = {(int)b[1], {0}};
            memcpy(sa.d, a + 2, sizeof sa.d);
            memcpy(sb.d, b + 2, sizeof sb.d);
            if (a[0] != b[0])
                snprintf(msg, sizeof msg,
                         "ddp: parameter %d is \"%s\" on rank %d but has another "
                         "name on rank 0",
                         i, ps->names[i], rank);
            else if (memcmp(a, b, sizeof *a * SIG_PER_PARAM))
                snprintf(msg, sizeof msg,
                         "ddp: parameter \"%s\" has shape %s on rank %d but %s on "
                         "rank 0",
                         ps->names[i], tdm_shape_str(sa, s0), rank, tdm_shape_str(sb, s1));
        }
        free(sig);
        free(sig0);
        tdm_tensor_free(t);
        if (rc) return rc;
    }
    if (msg[0]) {
        tdm_group_abort(d->g, msg);
        return tdm_raise(TDM_ERR_SHAPE, "%s", msg);
    }
    /* every rank learns whether some other rank differed */
    return tdm_work_wait(tdm_barrier(d->g));
}

/* ---- buckets ------------------------------------------------------------------------------ */

static int make_buckets(tdm_ddp *d) {
    tdm_paramset *ps = d->ps;
    d->buckets = calloc((size_t)ps->n + 1, sizeof *d->buckets);
    d->slots = calloc((size_t)ps->n + 1, sizeof *d->slots);
    if (!d->buckets || !d->slots) return tdm_raise(TDM_ERR_NOMEM, "ddp: out of memory");
    int64_t cap = d->o.first_bucket_cap_bytes / 4;
    bucket *b = NULL;
    for (int i = ps->n - 1; i >= 0; i--) {
        int64_t lo = ps->offsets[i], hi = lo + tdm_numel(ps->params[i]);
        if (!b || (b->hi - b->lo) + (hi - lo) > cap) {
            if (b) cap = d->o.bucket_cap_bytes / 4;
            b = &d->buckets[d->n_buckets++];
            b->hi = hi;
        }
        b->lo = lo;
        b->n_params++;
        d->slots[i] = (param_slot){d, d->n_buckets - 1, false};
    }
    for (int k = 0; k < d->n_buckets; k++) {
        bucket *bk = &d->buckets[k];
        bk->view = *ps->flat_grad;
        bk->view.shape[0] = bk->hi - bk->lo;
        bk->view.offset = ps->flat_grad->offset + bk->lo;
        bk->view.grad = NULL, bk->view.grad_fn = NULL, tdm_book(&bk->view)->hooks = NULL;
    }
    return TDM_OK;
}

/* Launches every ready bucket from the next one in order: ranks must agree on the order. */
static void launch_ready(tdm_ddp *d) {
    while (d->next_launch < d->n_buckets && d->buckets[d->next_launch].pending == 0) {
        bucket *b = &d->buckets[d->next_launch++];
        b->work = tdm_all_reduce(d->g, &b->view, TDM_AVG);
        if (!b->work && !d->launch_error) d->launch_error = tdm_last_status();
    }
}

static void on_grad_ready(tdm_tensor *param, void *ctx) {
    param_slot *s = ctx;
    tdm_ddp *d = s->ddp;
    if (!d->sync || s->ready) return;
    s->ready = true;
    d->buckets[s->bucket].pending--;
    launch_ready(d);
}

static void reset_buckets(tdm_ddp *d) {
    for (int k = 0; k < d->n_buckets; k++) {
        d->buckets[k].pending = d->buckets[k].n_params;
        d->buckets[k].work = NULL;
    }
    for (int i = 0; i < d->ps->n; i++) d->slots[i].ready = false;
    d->next_launch = 0;
    d->launch_error = 0;
}

/* ---- the public API ----------------------------------------------------------------------- */

static int broadcast_state(tdm_ddp *d, bool params) {
    int rc = params ? tdm_work_wait(tdm_broadcast(d->g, d->ps->flat, 0)) : TDM_OK;
    for (int i = 0; !rc && i < d->bs->n; i++)
        rc = tdm_work_wait(tdm_broadcast(d->g, d->bs->buffers[i], 0));
    return rc;
}

tdm_ddp *tdm_ddp_new(tdm_module *replica, tdm_group *g, const tdm_ddp_opts *o) {
    if (!replica || !g) return tdm_raise_null(TDM_ERR_ARG, "ddp: NULL replica or group");
    tdm_ddp *d = calloc(1, sizeof *d);
    if (!d) return tdm_raise_null(TDM_ERR_NOMEM, "ddp: out of memory");
    d->replica = replica;
    d->g = g;
    d->o = o ? *o : tdm_ddp_defaults();
    d->sync = true;
    if (d->o.bucket_cap_bytes < 4 || d->o.first_bucket_cap_bytes < 4) {
        free(d);
        return tdm_raise_null(TDM_ERR_ARG, "ddp: bucket caps must be at least 4 bytes");
    }
    d->ps = tdm_module_parameters(replica);
    d->bs = d->ps ? tdm_module_buffers(replica) : NULL;
    int rc = d->bs ? TDM_OK : tdm_last_status();
    if (!rc) rc = check_same_params(d);
    if (!rc) rc = broadcast_state(d, true);
    if (!rc) rc = make_buckets(d);
    for (int i = 0; !rc && i < d->ps->n; i++)
        rc = tdm_register_grad_hook(d->ps->params[i], on_grad_ready, &d->slots[i]);
    if (rc) {
        tdm_ddp_free(d);
        return NULL;
    }
    return d;
}

tdm_tensor *tdm_ddp_forward(tdm_ddp *d, tdm_tensor *x) {
    if (!d) return tdm_raise_null(TDM_ERR_ARG, "ddp_forward: NULL ddp");
    if (d->o.broadcast_buffers && d->bs->n && broadcast_state(d, false)) return NULL;
    return tdm_module_forward(d->replica, x);
}

/* Names of the parameters whose hook did not fire, for the unused-parameter error. */
static void unused_names(const tdm_ddp *d, char *buf, size_t size) {
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < d->ps->n && at + 4 < size; i++)
        if (!d->slots[i].ready)
            at += (size_t)snprintf(buf + at, size - at, "%s%s", at ? ", " : "", d->ps->names[i]);
}

int tdm_ddp_backward(tdm_ddp *d, tdm_tensor *loss) {
    if (!d) return tdm_raise(TDM_ERR_ARG, "ddp_backward: NULL ddp");
    reset_buckets(d);
    int rc = tdm_backward(loss);
    if (!d->sync) return rc;
    if (rc) {
        char msg[600];
        snprintf(msg, sizeof msg, "backward failed: %s", tdm_last_error());
        tdm_group_abort(d->g, msg);
        return rc;
    }
    if (d->next_launch < d->n_buckets) { /* some parameter got no gradient */
        char names[400];
        unused_names(d, names, sizeof names);
        if (!d->o.find_unused_parameters) {
            char msg[600];
            snprintf(msg, sizeof msg,
                     "ddp: parameters got no gradient in this backward: %s "
                     "(set find_unused_parameters to reduce them as zeros)",
                     names);
            tdm_group_abort(d->g, msg);
            rc = tdm_raise(TDM_ERR_STATE, "%s", msg);
        }
        for (int i = 0; i < d->ps->n; i++)
            if (!d->slots[i].ready) on_grad_ready(d->ps->params[i], &d->slots[i]);
    }
    for (int k = 0; k < d->n_buckets; k++) {
        int w = d->buckets[k].work ? tdm_work_wait(d->buckets[k].work) : TDM_OK;
        d->buckets[k].work = NULL;
        if (!rc) rc = w;
    }
    return rc ? rc : d->launch_error;
}

void tdm_ddp_set_sync(tdm_ddp *d, bool sync) {
    if (d) d->sync = sync;
}

int tdm_ddp_bucket_count(const tdm_ddp *d) {
    return d ? d->n_buckets : 0;
}

void tdm_ddp_free(tdm_ddp *d) {
    if (!d) return;
    if (d->ps)
        for (int i = 0; i < d->ps->n; i++) tdm_clear_grad_hooks(d->ps->params[i]);
    free(d->buckets);
    free(d->slots);
    free(d);
}
