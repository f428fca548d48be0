/* How the layers whose result depends on the whole batch (batch norm's statistics, dropout's
 * masks drawn by row) see a batch split over replicas: which rows this thread computes, and
 * a sum over the replicas, so that each replica computes what one device would on the whole
 * batch. The parallel layer keeps the split (tdm_parallel_context_set) and its groups; nn sits
 * below it, so parallel registers these operations when a context is first set
 * (src/parallel/context.c). Until then no thread has a split. Private; not installed. */
#ifndef TDM_NN_BATCH_SPLIT_H
#define TDM_NN_BATCH_SPLIT_H

#include "core/core.h"

typedef struct {
    int64_t row0;        /* global index of this thread's first row */
    int64_t global_rows; /* rows of the whole batch over all replicas */
    int replicas;        /* replicas that reduce their statistics together (1: no reduction) */
    void *group;         /* the parallel layer's handle, for sum and abort */
} tdm_batch_split;

typedef struct {
    /* Fills *out with the calling thread's split; false when it has none. */
    bool (*current)(tdm_batch_split *out);
    /* Sums t in place over the split's replicas, every replica calling in the same order;
     * returns once the sum is in t (TDM_ERR_COMM naming the failed rank otherwise). */
    int (*sum)(void *group, tdm_tensor *t);
    /* After a local failure between two sums: fails the replicas' pending and later sums
     * with reason, so the others fail instead of waiting. */
    void (*abort)(void *group, const char *reason);
} tdm_batch_split_ops;

/* Registers ops (once; later calls are ignored). */
void tdm_batch_split_register(const tdm_batch_split_ops *ops);
/* The calling thread's split in *out, or false (no split set, or nothing registered). */
bool tdm_batch_split_current(tdm_batch_split *out);
int tdm_batch_split_sum(const tdm_batch_split *s, tdm_tensor *t);
void tdm_batch_split_abort(const tdm_batch_split *s, const char *reason);

#endif
