/* tdm_strategy_check_replicas: every data-parallel replica's parameters hashed tensor by
 * tensor, compared inside the process and, through one all-gather, with rank 0's. Replicas
 * start from one broadcast and take the same averaged update, so they stay bit for bit equal;
 * a difference is a process or device that computed something else (another file under the
 * same path, a non-deterministic kernel, a fault), which training would otherwise average
 * away silently. */
#include "parallel/group.h"
#include "parallel/strategy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* FNV-1a over 8-byte words, then the tail (parallel/strategy.h). */
int tdm_strategy_hash_tensor(const tdm_tensor *t, uint64_t *h) {
    size_t n = (size_t)tdm_numel(t) * tdm_dtype_size(t->dtype);
    const unsigned char *p = tdm_data_ptr(t);
    unsigned char *copy = NULL;
    if (t->device.type != TDM_CPU) {
        if (!(copy = malloc(n ? n : 1)))
            return tdm_raise(TDM_ERR_NOMEM, "check_replicas: out of memory");
        if (tdm_to_host(t, copy, n)) return free(copy), tdm_last_status();
        p = copy;
    }
    uint64_t x = 1469598103934665603ULL;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        x = (x ^ w) * 1099511628211ULL;
    }
    for (; i < n; i++) x = (x ^ p[i]) * 1099511628211ULL;
    free(copy);
    *h = x;
    return TDM_OK;
}

/* Hashes of replica r's parameters into h[0..n); n must be replica 0's count. */
static int hash_replica(tdm_strategy *st, int r, uint64_t *h, int n) {
    tdm_module *m = tdm_strategy_replica(st, r);
    tdm_paramset *ps = m ? tdm_module_parameters(m) : NULL;
    if (!ps) return tdm_last_status();
    if (ps->n != n)
        return tdm_raise(TDM_ERR_STATE,
                         "check_replicas: replica %d has %d parameters, replica 0 %d", r, ps->n, n);
    int rc = TDM_OK;
    for (int i = 0; i < n && !rc; i++) rc = tdm_strategy_hash_tensor(ps->params[i], &h[i]);
    return rc;
}

/* The first of n hashes where a and b differ, and how many do; -1 when none. */
static int first_difference(const uint64_t *a, const uint64_t *b, int n, int *count) {
    int first = -1;
    *count = 0;
    for (int i = 0; i < n; i++)
        if (a[i] != b[i]) first = first < 0 ? i : first, ++*count;
    return first;
}

static int report(tdm_paramset *ps, int i, int count, const char *who) {
    char sb[96];
    return tdm_raise(TDM_ERR_STATE,
                     "the replicas differ: parameter \"%s\" %s of %s is not rank 0's (%d of %d "
                     "parameters differ); replicas start equal and take one averaged update, so "
                     "one computed something else (other data under the same path, a "
                     "non-deterministic kernel, a fault)",
                     ps->names[i], tdm_shape_str(tdm_shape_of(ps->params[i]), sb), who, count,
                     ps->n);
}

/* Every process's hashes of its replica 0 against rank 0's (one all-gather). */
static int check_processes(tdm_group *procs, tdm_paramset *ps, const uint64_t *mine, int reps) {
    int size = tdm_group_size(procs), n = ps->n;
    uint64_t *all = malloc(sizeof *all * (size_t)n * (size_t)size);
    int rc = all ? tdm_scope_begin() : tdm_raise(TDM_ERR_NOMEM, "check_replicas: out of memory");
    if (!rc) {
        tdm_device mem = tdm_group_memory(procs);
        tdm_tensor *in = tdm_from_data(TDM_SHAPE(n), TDM_I64, mem, mine);
        tdm_tensor *out = tdm_empty(TDM_SHAPE((int64_t)n * size), TDM_I64, mem);
        if (in && out) tdm_collective_label("the replicas' check");
        rc = in && out ? tdm_work_wait(tdm_all_gather(procs, out, in)) : tdm_last_status();
        if (!rc) rc = tdm_to_host(out, all, sizeof *all * (size_t)n * (size_t)size);
        tdm_scope_end();
    }
    for (int p = 1; p < size && !rc; p++) {
        int count, i = first_difference(all, all + (size_t)p * n, n, &count);
        char who[48];
        snprintf(who, sizeof who, reps > 1 ? "process %d's replica 0" : "rank %d", p);
        if (i >= 0) rc = report(ps, i, count, who);
    }
    free(all);
    return rc;
}

int tdm_strategy_check_replicas(tdm_strategy *st, tdm_group *procs) {
    if (!st) return tdm_raise(TDM_ERR_ARG, "check_replicas: NULL strategy");
    if (st->ops->check_replicas) return st->ops->check_replicas(st, procs);
    if (st->ops->forward_module)
        return tdm_raise(TDM_ERR_ARG, "check_replicas: a pipeline's stages hold different "
                                      "parameters; its replicas are not checked");
    tdm_paramset *ps = tdm_module_parameters(tdm_strategy_replica(st, 0));
    if (!ps) return tdm_last_status();
    int n = ps->n, reps = st->replicas;
    uint64_t *h = calloc((size_t)n * (size_t)reps + 1, sizeof *h);
    if (!h) return tdm_raise(TDM_ERR_NOMEM, "check_replicas: out of memory");
    int rc = tdm_strategy_gather_params(st); /* whole under ZeRO stage 3 (a collective) */
    for (int r = 0; r < reps && !rc; r++) rc = hash_replica(st, r, h + (size_t)r * n, n);
    int release = tdm_strategy_release_params(st);
    for (int r = 1; r < reps && !rc; r++) {
        int count, i = first_difference(h, h + (size_t)r * n, n, &count);
        char who[48], dev[16];
        snprintf(who, sizeof who, "rank %d (%s)", (procs ? tdm_group_rank(procs) : 0) * reps + r,
                 tdm_device_str(tdm_strategy_replica(st, r)->device, dev));
        if (i >= 0) rc = report(ps, i, count, who);
    }
    /* every process takes part in the exchange, also one whose own replicas differ */
    int across = procs && tdm_group_size(procs) > 1 ? check_processes(procs, ps, h, reps) : TDM_OK;
    free(h);
    return rc ? rc : release ? release : across;
}
