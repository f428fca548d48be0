/* DistributedDataParallel: one replica per rank; gradients averaged over the group in buckets
 * that are slices of the flat gradient buffer, each all-reduced as soon as its parameters'
 * gradients are final, so communication overlaps the rest of backward.
 *
 * Buckets follow PyTorch: parameters in reverse registration order (the order backward
 * usually finishes them), the first bucket capped at 1 MiB so communication starts early,
 * the rest at 25 MiB; all-reduces are launched in bucket order on every rank, since the
 * ranks must issue collectives in the same order. Reverse registration order is a contiguous
 * range of the flat buffer for every bucket, so a bucket is a view, never a copy. Under ZeRO
 * stage 2 and 3 a bucket is a buffer of its own while in flight, reduced piece by piece to
 * the ranks whose shards hold them (a reduce-scatter of unequal pieces). With reduce_dtype
 * bf16 a bucket is rounded to bf16 before it is reduced and widened back after (launch_low). */
#include "parallel/fsdp.h"
#include "parallel/group.h"

#include "autograd/tape.h"
#include "optim/clip.h"
#include "optim/scaler.h"
#include "optim/shard.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t lo, hi;      /* element range of the flat gradient */
    int first, n_params; /* parameters first .. first + n_params - 1 */
    int pending;         /* parameters whose gradient is not final yet this backward */
    tdm_tensor view;
    tdm_tensor low; /* reduce_dtype bf16: the bucket's range of d->low, what is reduced */
    tdm_work *work;
    /* ZeRO stage 2: the bucket's gradient [hi - lo] while it is produced and reduced (the
     * parameters' .grad are views of it), NULL otherwise; caller-owned, from the allocator */
    tdm_tensor *buf;
    tdm_tensor *lbuf; /* with reduce_dtype bf16: buf rounded, what the reduces move */
    /* ZeRO stage 2: instead of the all-reduce, one reduce of each piece of the bucket that
     * lies in a rank's shard, to that rank: ranks owner0 .. owner0 + owners - 1 */
    tdm_work **works;
    int owner0, owners;
} bucket;

/* How many reduced buckets may be in flight at once under ZeRO stage 2 before backward waits
 * for the oldest: what bounds the gradient memory beyond the shard (DeepSpeed's
 * reduce_bucket_size x its overlap). One still lets a bucket's reduction overlap the next
 * one's compute; two cost the GPT of bench/RESULTS.md 20 MiB more at its peak. */
#define STAGE2_IN_FLIGHT 1

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
    /* reduce_dtype bf16: the flat gradient rounded to bf16 [ps->total], each bucket reduced
     * there and widened back into the flat gradient (caller-owned); NULL for f32 */
    tdm_tensor *low;
    /* ZeRO stage 2 (tdm_ddp_set_shard): the averaged gradient of flat elements [lo, hi), this
     * rank's optimizer shard, is all this rank keeps ([hi - lo], caller-owned); NULL before */
    tdm_tensor *shard_grad;
    int64_t lo, hi;
    tdm_shard_kind shard;
    int next_finish; /* first launched bucket not yet added into shard_grad */
    /* ZeRO stage 3: the units (tdm_ddp_set_shard_units; NULL: the replica's children) and the
     * parameters' sharding over them (fsdp.c), NULL before */
    tdm_module **units;
    int n_units;
    tdm_zero3 *fsdp;
};

tdm_ddp_opts tdm_ddp_defaults(void) {
    tdm_ddp_opts o = {25 << 20, 1 << 20, false, true, TDM_F32, TDM_F32};
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
    tdm_collective_label("DDP's parameter count");
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
        tdm_collective_label("DDP's parameter shapes");
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
    tdm_collective_label("DDP's parameter check");
    return tdm_work_wait(tdm_barrier(d->g));
}

/* ---- buckets ------------------------------------------------------------------------------ */

/* reduce_dtype bf16's copy of the flat gradient and each bucket's range of it (on), or none. */
static int low_buffer(tdm_ddp *d, bool on) {
    tdm_tensor_free(d->low);
    d->low = NULL;
    if (on && !(d->low = tdm_tensor_alloc_owned(TDM_SHAPE(d->ps->total), TDM_BF16,
                                                d->ps->flat->device, NULL)))
        return tdm_last_status();
    for (int k = 0; k < d->n_buckets; k++)
        d->buckets[k].low =
            d->low ? tdm_range_view(d->low, d->buckets[k].lo, d->buckets[k].hi) : (tdm_tensor){0};
    return TDM_OK;
}

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
        b->first = i;
        b->n_params++;
        d->slots[i] = (param_slot){d, d->n_buckets - 1, false};
    }
    for (int k = 0; k < d->n_buckets; k++)
        d->buckets[k].view = tdm_range_view(ps->flat_grad, d->buckets[k].lo, d->buckets[k].hi);
    return d->o.reduce_dtype == TDM_BF16 ? low_buffer(d, true) : TDM_OK;
}

int tdm_ddp_set_reduce_dtype(tdm_ddp *d, tdm_dtype dt) {
    if (!d) return tdm_raise(TDM_ERR_ARG, "ddp set_reduce_dtype: NULL ddp");
    if (dt != TDM_F32 && dt != TDM_BF16)
        return tdm_raise(TDM_ERR_ARG, "ddp: reduce_dtype %s (expected f32 or bf16)",
                         tdm_dtype_name(dt));
    if (dt == d->o.reduce_dtype) return TDM_OK;
    /* ZeRO stages 2 and 3 round each bucket into a buffer of its own as it launches */
    int rc = d->shard_grad ? TDM_OK : low_buffer(d, dt == TDM_BF16);
    if (rc) return rc;
    d->o.reduce_dtype = dt;
    return TDM_OK;
}

/* ---- ZeRO stage 2: bucket buffers that live while the bucket is in flight ---------------- */

/* A caller-owned view of buf ([bucket]) at element off with p's shape: a parameter's .grad
 * while its bucket is in flight. Made owned by nobody from the start, since a scope-owned
 * view kept with tdm_scope_keep would leave its scope's copy holding the buffer until the
 * step's scope ends. */
static tdm_tensor *grad_view(const tdm_tensor *buf, const tdm_tensor *p, int64_t off) {
    tdm_tensor *g = tdm_tensor_header_owned(NULL);
    if (!g) return NULL;
    g->dtype = TDM_F32;
    g->ndim = p->ndim;
    memcpy(g->shape, p->shape, sizeof g->shape);
    tdm_contiguous_strides(p->ndim, p->shape, g->strides);
    g->offset = buf->offset + off;
    g->device = buf->device;
    g->storage = buf->storage;
    tdm_storage_retain(g->storage);
    return g;
}

/* Bucket b's buffer from the allocator, zeroed (backward adds into .grad, and GEMMs write
 * into it with beta 1, as into the flat gradient), with every parameter's .grad a view of
 * it: what DDP's flat gradient is to the bucket, for as long as the bucket is in flight. */
static int bucket_take(tdm_ddp *d, bucket *b) {
    tdm_device dev = d->ps->flat->device;
    tdm_tensor *buf = tdm_tensor_alloc_owned(TDM_SHAPE(b->hi - b->lo), TDM_F32, dev, NULL);
    const tdm_backend *be = tdm_backend_for(dev);
    int rc = !buf || !be ? tdm_last_status() : be->fill(buf, 0.0);
    for (int i = b->first; !rc && i < b->first + b->n_params; i++) {
        tdm_tensor *p = d->ps->params[i];
        tdm_tensor *g = grad_view(buf, p, d->ps->offsets[i] - b->lo);
        if (!g) rc = tdm_last_status();
        tdm_tensor_free(p->grad); /* none, but for a caller's stray one */
        p->grad = g;
    }
    b->buf = buf;
    return rc;
}

/* Drops bucket b's buffer and the parameters' views of it (back to the allocator's cache). */
static void bucket_release(tdm_ddp *d, bucket *b) {
    tdm_tensor_free(b->lbuf);
    b->lbuf = NULL;
    if (!b->buf) return;
    for (int i = b->first; i < b->first + b->n_params; i++) {
        tdm_tensor_free(d->ps->params[i]->grad);
        d->ps->params[i]->grad = NULL;
    }
    tdm_tensor_free(b->buf);
    b->buf = NULL;
}

/* The gradient source of a parameter under stage 2: its bucket's buffer, taken when the first
 * gradient of the bucket arrives. */
static int on_grad_needed(tdm_tensor *param, void *ctx) {
    param_slot *s = ctx;
    bucket *b = &s->ddp->buckets[s->bucket];
    return b->buf ? TDM_OK : bucket_take(s->ddp, b);
}

/* Rank r's shard of the flat buffer: tdm_optim_shard_range's range on that rank (zero.c). */
static void shard_of(const tdm_ddp *d, int r, int64_t *lo, int64_t *hi) {
    tdm_chunk_of(d->ps->total, sizeof(float), tdm_group_size(d->g), r, lo, hi);
}

/* Stage 2's reduces of bucket b's pieces, each to the rank whose shard holds it (the same
 * order on every rank). A piece of the average lands on its owner only: a reduce moves half
 * an all-reduce's bytes. */
static int launch_reduces(tdm_ddp *d, bucket *b) {
    if (d->o.reduce_dtype == TDM_BF16) { /* the pieces move rounded, as in launch_low */
        b->lbuf = tdm_tensor_alloc_owned(tdm_shape_of(b->buf), TDM_BF16, b->buf->device, NULL);
        if (!b->lbuf) return tdm_last_status();
        int rc = tdm_backend_for(b->buf->device)->copy(b->lbuf, b->buf);
        if (rc) return rc;
    }
    for (int j = 0; j < b->owners; j++) {
        int64_t lo, hi;
        shard_of(d, b->owner0 + j, &lo, &hi);
        int64_t a = lo > b->lo ? lo : b->lo, e = hi < b->hi ? hi : b->hi;
        tdm_tensor piece = tdm_range_view(b->lbuf ? b->lbuf : b->buf, a - b->lo, e - b->lo);
        tdm_collective_label("DDP bucket %d, shard of rank %d", (int)(b - d->buckets),
                             b->owner0 + j);
        if (!(b->works[j] = tdm_reduce(d->g, &piece, b->owner0 + j, TDM_AVG)))
            return tdm_last_status();
    }
    return TDM_OK;
}

/* Whether bucket b's reduces are done. */
static bool reduces_done(const bucket *b) {
    for (int j = 0; j < b->owners; j++)
        if (b->works[j] && !tdm_work_done(b->works[j])) return false;
    return true;
}

/* Waits for bucket k's reduces, adds its part of this rank's shard, [lo, hi) of the flat
 * buffer, into shard_grad (an accumulating window sums its micro-batches' averages there) and
 * releases the buffer. The first failure is kept in launch_error. */
static void bucket_finish(tdm_ddp *d, int k) {
    bucket *b = &d->buckets[k];
    int rc = TDM_OK;
    for (int j = 0; j < b->owners; j++) {
        int w = b->works[j] ? tdm_work_wait(b->works[j]) : TDM_OK;
        b->works[j] = NULL;
        if (!rc) rc = w;
    }
    int64_t a = b->lo > d->lo ? b->lo : d->lo, e = b->hi < d->hi ? b->hi : d->hi;
    if (!rc && b->buf && a < e) {
        tdm_tensor src = tdm_range_view(b->buf, a - b->lo, e - b->lo);
        tdm_tensor dst = tdm_range_view(d->shard_grad, a - d->lo, e - d->lo);
        const tdm_backend *be = tdm_backend_for(dst.device);
        if (b->lbuf) { /* the reduced bf16 piece, widened */
            tdm_tensor low = tdm_range_view(b->lbuf, a - b->lo, e - b->lo);
            rc = be->copy(&src, &low);
        }
        if (!rc) rc = be->axpy(&dst, 1.0f, &src);
    }
    bucket_release(d, b);
    if (rc && !d->launch_error) d->launch_error = rc;
}

/* Finishes the launched buckets whose reduction is done, and the oldest ones while more than
 * STAGE2_IN_FLIGHT are in flight: the buffers beyond the shard stay a few buckets. */
static void reclaim(tdm_ddp *d) {
    while (d->next_finish < d->next_launch) {
        bool done = reduces_done(&d->buckets[d->next_finish]);
        if (!done && d->next_launch - d->next_finish <= STAGE2_IN_FLIGHT) break;
        bucket_finish(d, d->next_finish++);
    }
}

/* ---- launching ----------------------------------------------------------------------------- */

/* PyTorch's bf16_compress_hook: bucket b's gradient rounded to bf16 and all-reduced (average)
 * in bf16, which the groups sum in f32 in rank order and round once; bucket_wait takes the
 * result back into the f32 gradient. Unlike the hook, the division by the ranks happens in
 * f32 before that one rounding, not in bf16 before the sum. */
static int launch_low(tdm_ddp *d, bucket *b) {
    int rc = tdm_backend_for(b->view.device)->copy(&b->low, &b->view);
    if (!rc) tdm_collective_label("DDP bucket %d", (int)(b - d->buckets));
    if (!rc && !(b->work = tdm_all_reduce(d->g, &b->low, TDM_AVG))) rc = tdm_last_status();
    return rc;
}

/* Waits for bucket b's all-reduce and, with reduce_dtype bf16, widens its result into the f32
 * gradient. */
static int bucket_wait(tdm_ddp *d, bucket *b) {
    int rc = b->work ? tdm_work_wait(b->work) : TDM_OK;
    if (!rc && b->work && d->low) rc = tdm_backend_for(b->view.device)->copy(&b->view, &b->low);
    b->work = NULL;
    return rc;
}

/* Launches every ready bucket from the next one in order: ranks must agree on the order.
 * Under stage 2 a bucket whose parameters got no gradient (unused ones) is reduced as zeros,
 * as the flat gradient's slice would be. */
static void launch_ready(tdm_ddp *d) {
    while (d->next_launch < d->n_buckets && d->buckets[d->next_launch].pending == 0) {
        bucket *b = &d->buckets[d->next_launch++];
        int rc = TDM_OK;
        if (d->shard_grad) {
            if (!b->buf && bucket_take(d, b)) rc = tdm_last_status();
            if (!rc) rc = launch_reduces(d, b);
        } else if (d->low) {
            rc = launch_low(d, b);
        } else {
            tdm_collective_label("DDP bucket %d", (int)(b - d->buckets));
            if (!(b->work = tdm_all_reduce(d->g, &b->view, TDM_AVG))) rc = tdm_last_status();
        }
        if (rc && !d->launch_error) d->launch_error = rc;
    }
    if (d->shard_grad) reclaim(d);
}

static void on_grad_ready(tdm_tensor *param, void *ctx) {
    param_slot *s = ctx;
    tdm_ddp *d = s->ddp;
    if ((!d->sync && !d->shard_grad) || s->ready) return;
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
    d->next_finish = 0;
    d->launch_error = 0;
}

/* ---- the public API ----------------------------------------------------------------------- */

static int broadcast_state(tdm_ddp *d, bool params) {
    if (params) tdm_collective_label("DDP's parameters from rank 0");
    int rc = params ? tdm_work_wait(tdm_broadcast(d->g, d->ps->flat, 0)) : TDM_OK;
    for (int i = 0; !rc && i < d->bs->n; i++) {
        tdm_collective_label("DDP's buffer %s from rank 0", d->bs->names[i]);
        rc = tdm_work_wait(tdm_broadcast(d->g, d->bs->buffers[i], 0));
    }
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
    if (d->o.reduce_dtype != TDM_F32 && d->o.reduce_dtype != TDM_BF16) {
        tdm_dtype rd = d->o.reduce_dtype;
        free(d);
        return tdm_raise_null(TDM_ERR_ARG, "ddp: reduce_dtype %s (expected f32 or bf16)",
                              tdm_dtype_name(rd));
    }
    if (d->o.param_dtype != TDM_F32 && d->o.param_dtype != TDM_BF16) {
        tdm_dtype pd = d->o.param_dtype;
        free(d);
        return tdm_raise_null(TDM_ERR_ARG, "ddp: param_dtype %s (expected f32 or bf16)",
                              tdm_dtype_name(pd));
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

/* Stage 2's end of backward: every launched bucket finished into the shard, the buffers of
 * any others (a failed backward) dropped. */
static int finish_stage2(tdm_ddp *d, int rc) {
    while (d->next_finish < d->next_launch) bucket_finish(d, d->next_finish++);
    for (int k = 0; k < d->n_buckets; k++) bucket_release(d, &d->buckets[k]);
    return rc ? rc : d->launch_error;
}

int tdm_ddp_backward(tdm_ddp *d, tdm_tensor *loss) {
    if (!d) return tdm_raise(TDM_ERR_ARG, "ddp_backward: NULL ddp");
    reset_buckets(d);
    if (d->fsdp) tdm_zero3_backward_begin(d->fsdp);
    int rc = tdm_backward(loss);
    if (d->fsdp) {
        int f = tdm_zero3_backward_end(d->fsdp);
        if (!rc) rc = f;
    }
    if (!d->sync && !d->shard_grad) return rc;
    if (rc) {
        char msg[600];
        snprintf(msg, sizeof msg, "backward failed: %s", tdm_last_error());
        tdm_group_abort(d->g, msg);
        return d->shard_grad ? finish_stage2(d, rc) : rc;
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
    if (d->shard_grad) return finish_stage2(d, rc);
    for (int k = 0; k < d->n_buckets; k++) {
        int w = bucket_wait(d, &d->buckets[k]);
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
    for (int k = 0; d->buckets && k < d->n_buckets; k++) {
        bucket_release(d, &d->buckets[k]);
        free(d->buckets[k].works);
    }
    if (d->ps)
        for (int i = 0; i < d->ps->n; i++) tdm_clear_grad_hooks(d->ps->params[i]);
    tdm_zero3_free(d->fsdp);
    free(d->units);
    tdm_tensor_free(d->shard_grad);
    tdm_tensor_free(d->low);
    free(d->buckets);
    free(d->slots);
    free(d);
}

/* ---- sharding (ZeRO stages 1 to 3) ---------------------------------------------------------- */

/* Whether m or a module under it has a parameter. */
static bool holds_params(const tdm_module *m) {
    if (m->n_params) return true;
    for (int c = 0; c < m->n_children; c++)
        if (holds_params(m->children[c])) return true;
    return false;
}

/* Stage 2's plan of each bucket's reduces: the ranks whose shards it meets, in rank order.
 * [lo, hi) is this rank's shard as its optimizer holds it, which the plan must agree with. */
static int plan_reduces(tdm_ddp *d, int64_t lo, int64_t hi) {
    int64_t mlo, mhi;
    shard_of(d, tdm_group_rank(d->g), &mlo, &mhi);
    if (mlo != lo || mhi != hi)
        return tdm_raise(TDM_ERR_STATE,
                         "ddp_set_shard: the optimizer's shard [%lld, %lld) is not this rank's "
                         "[%lld, %lld) of the group",
                         (long long)lo, (long long)hi, (long long)mlo, (long long)mhi);
    for (int k = 0; k < d->n_buckets; k++) {
        bucket *b = &d->buckets[k];
        b->owner0 = -1, b->owners = 0;
        for (int r = 0; r < tdm_group_size(d->g); r++) {
            int64_t rlo, rhi;
            shard_of(d, r, &rlo, &rhi);
            if (rlo >= rhi || rhi <= b->lo || rlo >= b->hi) continue;
            if (b->owner0 < 0) b->owner0 = r;
            b->owners++;
        }
        free(b->works);
        if (!(b->works = calloc((size_t)b->owners + 1, sizeof *b->works)))
            return tdm_raise(TDM_ERR_NOMEM, "ddp_set_shard: out of memory");
    }
    return TDM_OK;
}

/* Stage 2 on this rank, once o is sharded to [lo, hi): the shard's gradient (carrying the
 * flat gradient's values there), the optimizer reading it, the parameters' gradients given
 * by bucket on demand, the buckets' reduces planned, and the whole flat gradient freed. On
 * failure nothing has changed (but for the plan, which is only used once sharded). */
static int shard_gradients(tdm_ddp *d, tdm_optim *o) {
    int64_t lo, hi;
    tdm_optim_shard_range(o, &lo, &hi);
    tdm_tensor *g = tdm_tensor_alloc_owned(TDM_SHAPE(hi - lo), TDM_F32, d->ps->flat->device, NULL);
    tdm_tensor part = g ? tdm_range_view(d->ps->flat_grad, lo, hi) : (tdm_tensor){0};
    int rc = !g ? tdm_last_status() : tdm_copy_(g, &part);
    if (!rc) rc = plan_reduces(d, lo, hi);
    if (!rc) rc = tdm_optim_use_grad(o, g, lo);
    for (int i = 0; !rc && i < d->ps->n; i++)
        rc = tdm_set_grad_source(d->ps->params[i], on_grad_needed, &d->slots[i]);
    if (rc) {
        for (int i = 0; i < d->ps->n; i++) tdm_set_grad_source(d->ps->params[i], NULL, NULL);
        tdm_tensor_free(g);
        return rc;
    }
    for (int i = 0; i < d->ps->n; i++) {
        tdm_tensor_free(d->ps->params[i]->grad);
        d->ps->params[i]->grad = NULL;
    }
    for (int k = 0; k < d->n_buckets; k++) d->buckets[k].view = d->buckets[k].low = (tdm_tensor){0};
    tdm_tensor_free(d->ps->flat_grad);
    d->ps->flat_grad = NULL;
    tdm_tensor_free(d->low); /* buckets round into buffers of their own from now on */
    d->low = NULL;
    d->shard_grad = g, d->lo = lo, d->hi = hi;
    return TDM_OK;
}

/* Stage 3 on this rank, once stage 2 is in place: the units (the caller's, or the replica's
 * children that hold parameters) and the parameters sharded over them. */
static int shard_parameters(tdm_ddp *d, tdm_optim *o) {
    if (d->units) {
        d->fsdp = tdm_zero3_new(d->replica, d->ps, d->g, o, d->units, d->n_units);
        return d->fsdp ? tdm_zero3_set_param_dtype(d->fsdp, d->o.param_dtype) : tdm_last_status();
    }
    tdm_module **kids = malloc(sizeof *kids * (size_t)(d->replica->n_children + 1));
    if (!kids) return tdm_raise(TDM_ERR_NOMEM, "ddp_set_shard: out of memory");
    int n = 0;
    for (int c = 0; c < d->replica->n_children; c++) {
        if (holds_params(d->replica->children[c])) kids[n++] = d->replica->children[c];
    }
    d->fsdp = tdm_zero3_new(d->replica, d->ps, d->g, o, kids, n);
    free(kids);
    return d->fsdp ? tdm_zero3_set_param_dtype(d->fsdp, d->o.param_dtype) : tdm_last_status();
}

/* Why this rank cannot take kind with o (written into why), or TDM_OK. */
static int shard_check(const tdm_ddp *d, const tdm_optim *o, tdm_shard_kind kind, char *why,
                       size_t cap) {
    if (kind < TDM_SHARD_NONE || kind > TDM_SHARD_PARAMETERS) {
        snprintf(why, cap, "ddp_set_shard: unknown kind %d", (int)kind);
        return TDM_ERR_ARG;
    }
    if (!o || tdm_optim_paramset(o) != d->ps) {
        snprintf(why, cap, "ddp_set_shard: the optimizer %s",
                 o ? "steps another model's "
                     "parameters than the DDP's replica"
                   : "is NULL");
        return TDM_ERR_ARG;
    }
    if (kind < d->shard) {
        snprintf(why, cap,
                 "ddp_set_shard: the %s sharded and stay%s so (tdm_optim_gather copies the "
                 "optimizer state whole, tdm_ddp_gather_params the parameters)",
                 tdm_shard_held(d->shard), d->shard == TDM_SHARD_OPTIMIZER ? "s" : "");
        return TDM_ERR_STATE;
    }
    return TDM_OK;
}

int tdm_ddp_set_shard(tdm_ddp *d, tdm_optim *o, tdm_shard_kind kind) {
    if (!d) return tdm_raise(TDM_ERR_ARG, "ddp_set_shard: NULL ddp");
    char why[300] = "";
    int rc = shard_check(d, o, kind, why, sizeof why);
    /* a check fails alike on every rank (same call, same model shapes: tdm_ddp_new checked) */
    if (rc) return tdm_raise(rc, "%s", why);
    if (kind == d->shard) return TDM_OK;
    if (!tdm_optim_shard_ctx(o) && (rc = tdm_optim_shard(o, d->g))) return rc; /* collective */
    d->shard = TDM_SHARD_OPTIMIZER;
    if (kind >= TDM_SHARD_GRADIENTS && !d->shard_grad && (rc = shard_gradients(d, o))) {
        /* the others are stage 2 now: they would reduce buckets this rank does not */
        tdm_group_abort(d->g, tdm_last_error());
        return rc;
    }
    d->shard = TDM_SHARD_GRADIENTS;
    if (kind == TDM_SHARD_PARAMETERS && (rc = shard_parameters(d, o))) {
        tdm_group_abort(d->g, tdm_last_error());
        return rc;
    }
    d->shard = kind;
    return TDM_OK;
}

int tdm_ddp_set_shard_units(tdm_ddp *d, tdm_module *const *units, int n) {
    if (!d || n < 0 || (n && !units))
        return tdm_raise(TDM_ERR_ARG, "ddp_set_shard_units: NULL ddp or units, or %d units", n);
    if (d->fsdp)
        return tdm_raise(TDM_ERR_STATE, "ddp_set_shard_units: the parameters are sharded "
                                        "already; name the units before");
    tdm_module **u = malloc(sizeof *u * (size_t)(n ? n : 1));
    if (!u) return tdm_raise(TDM_ERR_NOMEM, "ddp_set_shard_units: out of memory");
    if (n) memcpy(u, units, sizeof *u * (size_t)n);
    free(d->units);
    d->units = u, d->n_units = n;
    return TDM_OK;
}

int tdm_ddp_set_shard_units_of(tdm_ddp *d, tdm_module *m, tdm_units_fn units_of) {
    if (!units_of || !m) return tdm_raise(TDM_ERR_ARG, "ddp_set_shard_units_of: NULL argument");
    int n = units_of(m, NULL, 0);
    if (n <= 0) return n;
    tdm_module **units = malloc(sizeof *units * (size_t)n);
    if (!units) return tdm_raise(TDM_ERR_NOMEM, "ddp_set_shard_units_of: out of memory");
    units_of(m, units, n);
    int rc = tdm_ddp_set_shard_units(d, units, n);
    free(units);
    return rc;
}

tdm_fsdp_opts tdm_fsdp_defaults(void) {
    return (tdm_fsdp_opts){.sharding_strategy = TDM_SHARD_PARAMETERS, .ddp = tdm_ddp_defaults()};
}

/* FSDP is a DDP sharded at its making: its own type says so in a program's declarations, and
 * is where FSDP's own settings (a mixed-precision policy) will live. */
struct tdm_fsdp {
    tdm_ddp *ddp;
};

tdm_fsdp *tdm_fsdp_wrap(tdm_module *model, tdm_group *g, tdm_optim *opt, const tdm_fsdp_opts *o) {
    tdm_fsdp_opts def = tdm_fsdp_defaults();
    if (!o) o = &def;
    tdm_fsdp *f = malloc(sizeof *f);
    tdm_ddp *d = tdm_ddp_new(model, g, &o->ddp);
    int rc = d ? TDM_OK : tdm_last_status();
    if (!rc && !f) { /* local: the others would wait in set_shard */
        rc = tdm_raise(TDM_ERR_NOMEM, "fsdp wrap: out of memory");
        tdm_group_abort(g, tdm_last_error());
    }
    if (!rc && o->units && (rc = tdm_ddp_set_shard_units(d, o->units, o->n_units)))
        tdm_group_abort(g, tdm_last_error());
    if (!rc) rc = tdm_ddp_set_shard(d, opt, o->sharding_strategy);
    if (!rc) {
        f->ddp = d;
        return f;
    }
    tdm_ddp_free(d);
    free(f);
    return NULL;
}

tdm_ddp *tdm_fsdp_ddp(tdm_fsdp *f) {
    return f ? f->ddp : NULL;
}

void tdm_fsdp_free(tdm_fsdp *f) {
    if (!f) return;
    tdm_ddp_free(f->ddp);
    free(f);
}

int tdm_ddp_gather_params(tdm_ddp *d) {
    if (!d) return tdm_raise(TDM_ERR_ARG, "ddp_gather_params: NULL ddp");
    return d->fsdp ? tdm_zero3_summon(d->fsdp) : TDM_OK;
}

int tdm_ddp_release_params(tdm_ddp *d) {
    if (!d) return tdm_raise(TDM_ERR_ARG, "ddp_release_params: NULL ddp");
    return d->fsdp ? tdm_zero3_reshard(d->fsdp) : TDM_OK;
}

tdm_shard_kind tdm_ddp_shard(const tdm_ddp *d) {
    return d ? d->shard : TDM_SHARD_NONE;
}

/* The sum of squares of the whole sharded gradient: each rank's of its shard (a double, moved
 * as the 8 bytes of an i64: collectives copy bytes) all-gathered and added in rank order, so
 * every rank gets the same bits. A failed exchange aborts the group. */
static int sharded_sum_squares(tdm_ddp *d, const char *op, double *total) {
    int n = tdm_group_size(d->g);
    double ss = 0, *sums = malloc(sizeof *sums * (size_t)n);
    int rc = sums ? tdm_clip_sum_squares_of(d->shard_grad, &ss)
                  : tdm_raise(TDM_ERR_NOMEM, "%s: out of memory", op);
    if (!rc) rc = tdm_scope_begin();
    if (!rc) {
        tdm_device mem = tdm_group_memory(d->g);
        tdm_tensor *mine = tdm_from_data(TDM_SHAPE(1), TDM_I64, mem, &ss);
        tdm_tensor *all = tdm_empty(TDM_SHAPE(n), TDM_I64, mem);
        tdm_collective_label("%s's sum of squares", op);
        rc = mine && all ? tdm_work_wait(tdm_all_gather(d->g, all, mine)) : tdm_last_status();
        if (!rc) rc = tdm_to_host(all, sums, sizeof *sums * (size_t)n);
        tdm_scope_end();
    }
    *total = 0;
    for (int r = 0; !rc && r < n; r++) *total += sums[r];
    free(sums);
    if (rc) tdm_group_abort(d->g, tdm_last_error());
    return rc;
}

int tdm_ddp_clip_grad_norm(tdm_ddp *d, float max_norm, float *total_norm) {
    if (!d) return tdm_raise(TDM_ERR_ARG, "ddp_clip_grad_norm: NULL ddp");
    if (!d->shard_grad) return tdm_clip_grad_norm(d->ps, max_norm, false, total_norm);
    if (!(max_norm >= 0))
        return tdm_raise(TDM_ERR_ARG, "ddp_clip_grad_norm: max_norm %g must be >= 0", max_norm);
    double ss = 0;
    int rc = sharded_sum_squares(d, "ddp_clip_grad_norm", &ss);
    if (rc) return rc;
    float norm = (float)sqrt(ss);
    if (total_norm) *total_norm = norm;
    return tdm_clip_scale_of(d->shard_grad, max_norm, norm);
}

int tdm_ddp_grad_sum_squares(tdm_ddp *d, double *ss) {
    if (!d || !ss) return tdm_raise(TDM_ERR_ARG, "ddp_grad_sum_squares: NULL %s", d ? "ss" : "ddp");
    if (d->shard_grad) return sharded_sum_squares(d, "ddp_grad_sum_squares", ss);
    return tdm_clip_sum_squares(d->ps, 0, d->ps->total, ss);
}

int tdm_ddp_unscale(tdm_ddp *d, tdm_grad_scaler *s, tdm_optim *o) {
    if (!d) return tdm_raise(TDM_ERR_ARG, "ddp_unscale: NULL ddp");
    if (!d->shard_grad) return tdm_grad_scaler_unscale(s, o);
    double ss = 0; /* finite exactly when every element of every shard is (optim/scaler.h) */
    int rc = sharded_sum_squares(d, "ddp_unscale", &ss);
    return rc ? rc : tdm_grad_scaler_unscale_found(s, o, d->shard_grad, !isfinite(ss));
}

tdm_tensor *tdm_ddp_shard_grad(const tdm_ddp *d, int64_t *lo) {
    if (lo) *lo = d && d->shard_grad ? d->lo : 0;
    return d ? d->shard_grad : NULL;
}
