/* Process groups, backend-independent: argument checks, work handles, waiting, abort and
 * timeout. The backends (threads_group.c) only move memory and synchronise ranks. */
#include "parallel/group.h"

#include "tandem/half.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DEFAULT_TIMEOUT_S 60.0

/* Seconds since the epoch: the flight recorder's clock, comparable between hosts. */
static double wall_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

const char *tdm_coll_name(tdm_coll_kind k) {
    switch (k) {
    case TDM_COLL_ALL_REDUCE:
        return "all_reduce";
    case TDM_COLL_BROADCAST:
        return "broadcast";
    case TDM_COLL_ALL_GATHER:
        return "all_gather";
    case TDM_COLL_REDUCE_SCATTER:
        return "reduce_scatter";
    case TDM_COLL_BARRIER:
        return "barrier";
    case TDM_COLL_REDUCE:
        return "reduce";
    }
    return "?";
}

void tdm_coll_describe(const tdm_coll *c, char *buf, size_t cap) {
    char how[32] = "";
    if (c->kind == TDM_COLL_ALL_REDUCE || c->kind == TDM_COLL_REDUCE_SCATTER)
        snprintf(how, sizeof how, ", %s", c->op == TDM_AVG ? "avg" : "sum");
    else if (c->kind == TDM_COLL_REDUCE)
        snprintf(how, sizeof how, ", %s to root %d", c->op == TDM_AVG ? "avg" : "sum", c->root);
    else if (c->kind == TDM_COLL_BROADCAST)
        snprintf(how, sizeof how, ", root %d", c->root);
    if (c->kind == TDM_COLL_BARRIER)
        snprintf(buf, cap, "barrier #%lld (%s)", (long long)c->seq,
                 c->site[0] ? c->site : "unnamed");
    else
        snprintf(buf, cap, "%s #%lld (%s: %lld %s%s)", tdm_coll_name(c->kind), (long long)c->seq,
                 c->site[0] ? c->site : "unnamed", (long long)c->count, tdm_dtype_name(c->dtype),
                 how);
}

bool tdm_coll_disagree(int ra, const tdm_coll *a, int rb, const tdm_coll *b, bool numbers,
                       char *msg, size_t cap) {
    const char *what = NULL;
    if (numbers && a->seq != b->seq)
        what = "number of collectives called so far";
    else if (a->kind != b->kind)
        what = "collective";
    else if (a->count != b->count)
        what = "element count";
    else if (a->dtype != b->dtype || a->elem != b->elem)
        what = "dtype";
    else if (a->op != b->op)
        what = "reduction";
    else if (a->root != b->root)
        what = "root";
    else if (strncmp(a->site, b->site, sizeof a->site) != 0)
        what = "caller";
    if (!what) return false;
    if (ra > rb) { /* the lower rank first */
        const tdm_coll *t = a;
        int tr = ra;
        a = b, ra = rb, b = t, rb = tr;
    }
    char da[160], db[160];
    tdm_coll_describe(a, da, sizeof da);
    tdm_coll_describe(b, db, sizeof db);
    snprintf(msg, cap, "ranks disagree on the %s: rank %d is in %s while rank %d is in %s", what,
             ra, da, rb, db);
    return true;
}

void tdm_group_init(tdm_group *g, const tdm_group_ops *ops, int rank, int size, tdm_device dev) {
    g->ops = ops;
    g->rank = rank;
    g->size = size;
    g->device = dev;
    atomic_init(&g->timeout_ns, (int64_t)(DEFAULT_TIMEOUT_S * 1e9));
    pthread_mutex_init(&g->lock, NULL);
    tdm_waitq_init(&g->done_q);
    g->free_works = g->all_works = NULL;
    g->launched = 0;
    g->digest = 0;
    g->watched = NULL;
    memset(g->flight, 0, sizeof g->flight);
    g->failure[0] = '\0';
}

void tdm_group_destroy(tdm_group *g) {
    for (tdm_work *w = g->all_works, *next; w; w = next) {
        next = w->all_next;
        free(w);
    }
    g->all_works = g->free_works = NULL;
    tdm_waitq_destroy(&g->done_q);
    pthread_mutex_destroy(&g->lock);
}

int tdm_group_rank(const tdm_group *g) {
    return g ? g->rank : -1;
}

int tdm_group_size(const tdm_group *g) {
    return g ? g->size : 0;
}

tdm_device tdm_group_device(const tdm_group *g) {
    return g ? g->device : tdm_cpu(0);
}

tdm_device tdm_group_memory(const tdm_group *g) {
    return g && g->ops->device_memory ? g->device : tdm_cpu(0);
}

void tdm_group_set_timeout(tdm_group *g, double seconds) {
    if (!g || !(seconds > 0)) return;
    if (seconds > 1e9) seconds = 1e9; /* "forever", without overflowing the nanoseconds */
    atomic_store(&g->timeout_ns, (int64_t)(seconds * 1e9));
}

double tdm_group_timeout(const tdm_group *g) {
    return (double)atomic_load(&g->timeout_ns) * 1e-9;
}

void tdm_group_abort(tdm_group *g, const char *message) {
    if (g) g->ops->abort(g, message ? message : "aborted");
}

/* floats widened per step of tdm_reduce_ranks_half: two blocks on the stack, in L1 */
#define HALF_BLK 512

static void widen(float *dst, const uint16_t *src, int len, tdm_dtype dt) {
    if (dt == TDM_BF16)
        tdm_bf16_to_f32(dst, src, (size_t)len);
    else
        tdm_f16_to_f32(dst, src, (size_t)len);
}

void tdm_reduce_ranks_half(uint16_t *acc, const uint16_t *const *src, int n, int64_t off, int len,
                           bool avg, tdm_dtype dt) {
    float sum[HALF_BLK], next[HALF_BLK];
    for (int b = 0; b < len; b += HALF_BLK) {
        int l = len - b < HALF_BLK ? len - b : HALF_BLK;
        widen(sum, src[0] + off + b, l, dt);
        for (int k = 1; k < n; k++) {
            widen(next, src[k] + off + b, l, dt);
            for (int j = 0; j < l; j++) sum[j] += next[j]; /* rank order, as tdm_reduce_ranks */
        }
        if (avg) {
            float fn = (float)n;
            for (int j = 0; j < l; j++) sum[j] /= fn;
        }
        if (dt == TDM_BF16)
            tdm_bf16_from_f32(acc + b, sum, (size_t)l);
        else
            tdm_f16_from_f32(acc + b, sum, (size_t)l);
    }
}

/* ---- handles ---------------------------------------------------------------------------- */

static tdm_work *work_get(tdm_group *g) {
    pthread_mutex_lock(&g->lock);
    tdm_work *w = g->free_works;
    if (w) g->free_works = w->next;
    pthread_mutex_unlock(&g->lock);
    if (!w) {
        w = calloc(1, sizeof *w);
        if (!w) return tdm_raise_null(TDM_ERR_NOMEM, "collective: out of memory for a handle");
        pthread_mutex_lock(&g->lock);
        w->all_next = g->all_works;
        g->all_works = w;
        pthread_mutex_unlock(&g->lock);
    }
    w->group = g;
    w->next = NULL;
    w->status = TDM_OK;
    w->msg[0] = '\0';
    atomic_store_explicit(&w->done, 0, memory_order_relaxed);
    return w;
}

static void work_put(tdm_work *w) {
    tdm_group *g = w->group;
    pthread_mutex_lock(&g->lock);
    w->next = g->free_works;
    g->free_works = w;
    pthread_mutex_unlock(&g->lock);
}

void tdm_work_finish(tdm_work *w, int status, const char *msg) {
    tdm_group *g = w->group;
    pthread_mutex_lock(&g->lock);
    tdm_flight_entry *e = &g->flight[w->c.seq % TDM_FLIGHT_LEN];
    if (e->c.seq == w->c.seq) {
        e->t_end = wall_seconds();
        e->state = status == TDM_OK ? TDM_FLIGHT_DONE : TDM_FLIGHT_FAILED;
    }
    if (status != TDM_OK && !g->failure[0] && msg)
        snprintf(g->failure, sizeof g->failure, "%s", msg);
    pthread_mutex_unlock(&g->lock);
    w->status = status;
    if (msg && msg[0])
        snprintf(w->msg, sizeof w->msg, "%s", msg);
    else
        w->msg[0] = '\0';
    atomic_store(&w->done, 1);
    tdm_waitq_wake(&g->done_q);
}

/* Nanoseconds this process's threads spent in tdm_work_wait on collectives not yet done. */
static _Atomic int64_t waited_ns;

double tdm_collective_wait_seconds(void) {
    return (double)atomic_load_explicit(&waited_ns, memory_order_relaxed) * 1e-9;
}

int tdm_work_wait(tdm_work *w) {
    if (!w) {
        tdm_status s = tdm_last_status();
        return s != TDM_OK ? s : tdm_raise(TDM_ERR_ARG, "work_wait: NULL handle");
    }
    tdm_group *g = w->group;
    int64_t t0 = atomic_load_explicit(&w->done, memory_order_acquire) ? 0 : tdm_now_ns();
    if (g->ops->progress && t0) g->ops->progress(g, w);
    /* No spinning and no timeout here. After progress the collective runs on another thread
     * (the rank's communication thread, MPI's or the GPU), which may need this core; the
     * backends spin where it pays (the threads barrier) and bound every wait of their own
     * (tdm_group_set_timeout). */
    tdm_wait_until(&g->done_q, &w->done, 1, (tdm_wait_opts){0});
    if (t0) atomic_fetch_add_explicit(&waited_ns, tdm_now_ns() - t0, memory_order_relaxed);
    int status = w->status;
    if (status != TDM_OK) tdm_raise((tdm_status)status, "%s", w->msg);
    work_put(w);
    return status;
}

/* ---- collectives: checks on the calling rank, then the backend -------------------------- */

bool tdm_work_done(const tdm_work *w) {
    return atomic_load(&w->done) != 0;
}

/* The label tdm_collective_label set for this thread's next collective ("" when none). */
static _Thread_local char next_label[TDM_SITE_LEN];

void tdm_collective_label(const char *fmt, ...) {
    next_label[0] = '\0';
    if (!fmt) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(next_label, sizeof next_label, fmt, ap);
    va_end(ap);
}

uint64_t tdm_coll_digest(uint64_t digest, const tdm_coll *c) {
    int64_t f[6] = {c->kind, c->op, c->root, c->dtype, c->count, (int64_t)c->elem};
    const unsigned char *p = (const unsigned char *)f;
    uint64_t h = digest ^ 0xcbf29ce484222325ull; /* FNV-1a over the fields, then the site */
    for (size_t i = 0; i < sizeof f; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    for (const char *s = c->site; *s && s < c->site + sizeof c->site; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

void tdm_group_watch(tdm_group *g, tdm_group *watched) {
    pthread_mutex_lock(&g->lock);
    g->watched = watched;
    pthread_mutex_unlock(&g->lock);
}

bool tdm_watch_disagree(int ra, const tdm_watch *a, int rb, const tdm_watch *b, const char *during,
                        char *msg, size_t cap) {
    if (a->launched == b->launched && a->digest == b->digest) return false;
    if (ra > rb) {
        const tdm_watch *t = a;
        int tr = ra;
        a = b, ra = rb, b = t, rb = tr;
    }
    char da[160] = "none", db[160] = "none";
    if (a->launched) tdm_coll_describe(&a->last, da, sizeof da);
    if (b->launched) tdm_coll_describe(&b->last, db, sizeof db);
    bool same_last = a->launched == b->launched && !strcmp(da, db);
    snprintf(msg, cap,
             "ranks disagree on the collectives of the group this one watches, before %s: rank %d "
             "had launched %lld there, the last %s, while rank %d had launched %lld, the last "
             "%s%s",
             during, ra, (long long)a->launched, da, rb, (long long)b->launched, db,
             same_last ? " (an earlier one differs: see the ranks' flight recorders)" : "");
    return true;
}

tdm_work *tdm_group_launch(tdm_group *g, tdm_coll c) {
    tdm_work *w = work_get(g);
    if (!w) return NULL;
    if (next_label[0]) { /* else the caller's (a two-level group passes its own on) */
        memcpy(c.site, next_label, sizeof c.site);
        next_label[0] = '\0';
    }
    pthread_mutex_lock(&g->lock);
    w->watch = (tdm_watch){0};
    if (g->watched) { /* lock order: a group, then the one it watches */
        tdm_group *wg = g->watched;
        pthread_mutex_lock(&wg->lock);
        w->watch.launched = wg->launched;
        w->watch.digest = wg->digest;
        if (wg->launched) w->watch.last = wg->flight[wg->launched % TDM_FLIGHT_LEN].c;
        pthread_mutex_unlock(&wg->lock);
    }
    c.seq = ++g->launched;
    g->digest = tdm_coll_digest(g->digest, &c);
    g->flight[c.seq % TDM_FLIGHT_LEN] =
        (tdm_flight_entry){.c = c, .t_launch = wall_seconds(), .state = TDM_FLIGHT_RUNNING};
    g->flight[c.seq % TDM_FLIGHT_LEN].c.out = NULL;
    g->flight[c.seq % TDM_FLIGHT_LEN].c.in = NULL;
    pthread_mutex_unlock(&g->lock);
    w->c = c;
    if (g->ops->launch(g, w) != TDM_OK) {
        pthread_mutex_lock(&g->lock);
        g->flight[c.seq % TDM_FLIGHT_LEN].state = TDM_FLIGHT_FAILED;
        pthread_mutex_unlock(&g->lock);
        work_put(w);
        return NULL;
    }
    return w;
}

/* The address a collective reads or writes: CPU memory, or device memory for an NCCL group. */
static void *coll_ptr(const tdm_tensor *t) {
    return (char *)t->storage->data + t->offset * (int64_t)tdm_dtype_size(t->dtype);
}

/* Whether dt can be reduced: f32, or bf16 and f16 (summed in f32, tdm_reduce_ranks_half). */
static bool reducible(tdm_dtype dt) {
    return dt == TDM_F32 || dt == TDM_BF16 || dt == TDM_F16;
}

static int check_buffer(const tdm_group *g, const tdm_tensor *t, const char *op, const char *what,
                        bool reduced) {
    if (!t) return tdm_raise(TDM_ERR_ARG, "%s: %s is NULL", op, what);
    char sb[96];
    if (reduced && !reducible(t->dtype))
        return tdm_raise(TDM_ERR_DTYPE, "%s: %s must be f32, bf16 or f16, got %s %s", op, what,
                         tdm_dtype_name(t->dtype), tdm_shape_str(tdm_shape_of(t), sb));
    if (!tdm_is_contiguous(t))
        return tdm_raise(TDM_ERR_ARG, "%s: %s %s must be contiguous", op, what,
                         tdm_shape_str(tdm_shape_of(t), sb));
    if (g->ops->device_memory ? !tdm_device_equal(t->device, g->device)
                              : t->device.type != TDM_CPU) {
        char db[16], gb[16];
        return tdm_raise(TDM_ERR_DEVICE, "%s: %s is on %s; this %s group reduces %s memory", op,
                         what, tdm_device_str(t->device, db), g->ops->name,
                         g->ops->device_memory ? tdm_device_str(g->device, gb) : "CPU");
    }
    return TDM_OK;
}

static int check_op(tdm_reduce_kind op, const char *name) {
    if (op != TDM_SUM && op != TDM_AVG)
        return tdm_raise(TDM_ERR_ARG, "%s: unknown reduction %d (expected TDM_SUM or TDM_AVG)",
                         name, (int)op);
    return TDM_OK;
}

static int check_same_dtype(const tdm_tensor *out, const tdm_tensor *in, const char *op) {
    if (out->dtype == in->dtype) return TDM_OK;
    return tdm_raise(TDM_ERR_DTYPE, "%s: out is %s but in is %s", op, tdm_dtype_name(out->dtype),
                     tdm_dtype_name(in->dtype));
}

/* The collective of one in-place tensor t (all-reduce, reduce, broadcast). */
static tdm_coll in_place(tdm_coll_kind kind, tdm_reduce_kind op, int root, tdm_tensor *t) {
    void *p = coll_ptr(t);
    return (tdm_coll){.kind = kind,
                      .op = op,
                      .root = root,
                      .count = tdm_numel(t),
                      .elem = tdm_dtype_size(t->dtype),
                      .out = p,
                      .in = p,
                      .dtype = t->dtype};
}

tdm_work *tdm_all_reduce(tdm_group *g, tdm_tensor *t, tdm_reduce_kind op) {
    if (!g) return tdm_raise_null(TDM_ERR_ARG, "all_reduce: NULL group");
    if (check_buffer(g, t, "all_reduce", "tensor", true) || check_op(op, "all_reduce")) return NULL;
    return tdm_group_launch(g, in_place(TDM_COLL_ALL_REDUCE, op, 0, t));
}

tdm_work *tdm_reduce(tdm_group *g, tdm_tensor *t, int root, tdm_reduce_kind op) {
    if (!g) return tdm_raise_null(TDM_ERR_ARG, "reduce: NULL group");
    if (check_buffer(g, t, "reduce", "tensor", true) || check_op(op, "reduce")) return NULL;
    if (root < 0 || root >= g->size)
        return tdm_raise_null(TDM_ERR_ARG, "reduce: root %d out of range for %d ranks", root,
                              g->size);
    return tdm_group_launch(g, in_place(TDM_COLL_REDUCE, op, root, t));
}

tdm_work *tdm_broadcast(tdm_group *g, tdm_tensor *t, int root) {
    if (!g) return tdm_raise_null(TDM_ERR_ARG, "broadcast: NULL group");
    if (check_buffer(g, t, "broadcast", "tensor", false)) return NULL;
    if (root < 0 || root >= g->size)
        return tdm_raise_null(TDM_ERR_ARG, "broadcast: root %d out of range for %d ranks", root,
                              g->size);
    return tdm_group_launch(g, in_place(TDM_COLL_BROADCAST, TDM_SUM, root, t));
}

tdm_work *tdm_all_gather(tdm_group *g, tdm_tensor *out, const tdm_tensor *in) {
    if (!g) return tdm_raise_null(TDM_ERR_ARG, "all_gather: NULL group");
    if (check_buffer(g, out, "all_gather", "out", false) ||
        check_buffer(g, in, "all_gather", "in", false) || check_same_dtype(out, in, "all_gather"))
        return NULL;
    char so[96], si[96];
    if (tdm_numel(out) != (int64_t)g->size * tdm_numel(in))
        return tdm_raise_null(
            TDM_ERR_SHAPE, "all_gather: out %s must hold %d x in %s = %lld elements",
            tdm_shape_str(tdm_shape_of(out), so), g->size, tdm_shape_str(tdm_shape_of(in), si),
            (long long)(g->size * tdm_numel(in)));
    tdm_coll c = {.kind = TDM_COLL_ALL_GATHER,
                  .op = TDM_SUM,
                  .count = tdm_numel(in),
                  .elem = tdm_dtype_size(in->dtype),
                  .out = coll_ptr(out),
                  .in = coll_ptr(in),
                  .dtype = in->dtype};
    return tdm_group_launch(g, c);
}

tdm_work *tdm_reduce_scatter(tdm_group *g, tdm_tensor *out, const tdm_tensor *in,
                             tdm_reduce_kind op) {
    if (!g) return tdm_raise_null(TDM_ERR_ARG, "reduce_scatter: NULL group");
    if (check_buffer(g, out, "reduce_scatter", "out", true) ||
        check_buffer(g, in, "reduce_scatter", "in", true) ||
        check_same_dtype(out, in, "reduce_scatter") || check_op(op, "reduce_scatter"))
        return NULL;
    char so[96], si[96];
    if (tdm_numel(in) != (int64_t)g->size * tdm_numel(out))
        return tdm_raise_null(
            TDM_ERR_SHAPE, "reduce_scatter: in %s must hold %d x out %s = %lld elements",
            tdm_shape_str(tdm_shape_of(in), si), g->size, tdm_shape_str(tdm_shape_of(out), so),
            (long long)(g->size * tdm_numel(out)));
    tdm_coll c = {.kind = TDM_COLL_REDUCE_SCATTER,
                  .op = op,
                  .count = tdm_numel(out),
                  .elem = tdm_dtype_size(out->dtype),
                  .out = coll_ptr(out),
                  .in = coll_ptr(in),
                  .dtype = out->dtype};
    return tdm_group_launch(g, c);
}

tdm_work *tdm_barrier(tdm_group *g) {
    if (!g) return tdm_raise_null(TDM_ERR_ARG, "barrier: NULL group");
    tdm_coll c = {.kind = TDM_COLL_BARRIER, .op = TDM_SUM, .elem = 1};
    return tdm_group_launch(g, c);
}
