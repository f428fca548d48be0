/* bf16 and f16 collectives of one rank against a serial reference, shared by the threads test
 * (test_collectives.c) and the MPI test (test_mpi.c). Rank r's input is value(r, i, salt)
 * rounded to the dtype; a reduction must give, bit for bit on every rank, those rounded values
 * widened to f32, added in the group's order in f32 (/ size for AVG) and rounded once. */
#ifndef TDM_COLLECTIVE_LOWP_H
#define TDM_COLLECTIVE_LOWP_H

#include "collective_ref.h"
#include "tandem/half.h"

static inline uint16_t lowp_round(float x, tdm_dtype dt) {
    return dt == TDM_BF16 ? tdm_bf16_from_float(x) : tdm_f16_from_float(x);
}

static inline float lowp_widen(uint16_t h, tdm_dtype dt) {
    return dt == TDM_BF16 ? tdm_bf16_to_float(h) : tdm_f16_to_float(h);
}

static inline uint16_t lowp_value(int r, int64_t i, int salt, tdm_dtype dt) {
    return lowp_round(value(r, i, salt), dt);
}

/* The reduction of n ranks' rounded inputs at element i, in groups of `per` ranks: each
 * group's ranks added in order, then the groups' sums in order (per == n: plain rank order;
 * per == devices of a process: the two-level group's order), in f32, rounded once. */
static inline uint16_t lowp_reference(int n, int per, int64_t i, int salt, tdm_reduce_kind op,
                                      tdm_dtype dt) {
    float s = 0;
    for (int p = 0; p < n / per; p++) {
        float sp = lowp_widen(lowp_value(p * per, i, salt, dt), dt);
        for (int l = 1; l < per; l++) sp += lowp_widen(lowp_value(p * per + l, i, salt, dt), dt);
        s = p ? s + sp : sp;
    }
    return lowp_round(op == TDM_AVG ? s / (float)n : s, dt);
}

static inline tdm_tensor *lowp_filled(tdm_device dev, tdm_dtype dt, int r, int64_t m, int salt) {
    tdm_tensor *t = tdm_empty(TDM_SHAPE(m), dt, dev);
    uint16_t *p = tdm_data_ptr(t);
    for (int64_t i = 0; i < m; i++) p[i] = lowp_value(r, i, salt, dt);
    return t;
}

typedef struct {
    int64_t wrong; /* elements that differ in any bit, over every collective */
    char err[256]; /* the first collective that failed, with its error */
} lowp_result;

/* Waits for w; false, with the first failure recorded in res, if it failed. */
static inline bool lowp_wait(tdm_work *w, const char *what, tdm_dtype dt, int64_t m,
                             lowp_result *res) {
    if (tdm_work_wait(w) == TDM_OK) return true;
    if (!res->err[0])
        snprintf(res->err, sizeof res->err, "%s %s of %lld elements: %s", tdm_dtype_name(dt), what,
                 (long long)m, tdm_last_error());
    return false;
}

/* Every collective in dt of rank r of g (per ranks to a process, see lowp_reference) on m
 * elements, tensors in the calling scope on dev; the count of wrong elements and the first
 * failure go to res. */
static inline void lowp_ops(tdm_group *g, tdm_device dev, int per, tdm_dtype dt, int64_t m,
                            int salt, lowp_result *res) {
    int r = tdm_group_rank(g), n = tdm_group_size(g);
    for (int o = TDM_SUM; o <= TDM_AVG; o++) {
        tdm_reduce_kind op = (tdm_reduce_kind)o;
        tdm_tensor *t = lowp_filled(dev, dt, r, m, salt + o);
        if (!lowp_wait(tdm_all_reduce(g, t, op), "all_reduce", dt, m, res)) return;
        const uint16_t *p = tdm_data_ptr(t);
        for (int64_t i = 0; i < m; i++)
            res->wrong += p[i] != lowp_reference(n, per, i, salt + o, op, dt);
        int to = (int)((m + 1 + o) % n);
        t = lowp_filled(dev, dt, r, m, salt + 2 + o);
        if (!lowp_wait(tdm_reduce(g, t, to, op), "reduce", dt, m, res)) return;
        p = tdm_data_ptr(t);
        for (int64_t i = 0; r == to && i < m; i++) /* the others' values are not specified */
            res->wrong += p[i] != lowp_reference(n, per, i, salt + 2 + o, op, dt);
        tdm_tensor *big = lowp_filled(dev, dt, r, n * m, salt + 4 + o);
        tdm_tensor *part = tdm_zeros(TDM_SHAPE(m), dt, dev);
        if (!lowp_wait(tdm_reduce_scatter(g, part, big, op), "reduce_scatter", dt, m, res)) return;
        p = tdm_data_ptr(part);
        for (int64_t i = 0; i < m; i++)
            res->wrong += p[i] != lowp_reference(n, per, r * m + i, salt + 4 + o, op, dt);
    }
    int root = (int)(m % n);
    tdm_tensor *b = lowp_filled(dev, dt, r, m, salt + 6);
    if (!lowp_wait(tdm_broadcast(g, b, root), "broadcast", dt, m, res)) return;
    const uint16_t *pb = tdm_data_ptr(b);
    for (int64_t i = 0; i < m; i++) res->wrong += pb[i] != lowp_value(root, i, salt + 6, dt);
    tdm_tensor *in = lowp_filled(dev, dt, r, m, salt + 7);
    tdm_tensor *out = tdm_zeros(TDM_SHAPE(n * m), dt, dev);
    if (!lowp_wait(tdm_all_gather(g, out, in), "all_gather", dt, m, res)) return;
    const uint16_t *po = tdm_data_ptr(out);
    for (int k = 0; k < n; k++)
        for (int64_t i = 0; i < m; i++)
            res->wrong += po[k * m + i] != lowp_value(k, i, salt + 7, dt);
}

#endif
