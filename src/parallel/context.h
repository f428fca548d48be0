/* Private side of the parallel context (tdm_parallel_context_set): what batch-dependent ops
 * (batch norm, dropout in src/nn/functional_norm.c) read to act as one device on the global
 * batch. */
#ifndef TDM_PARALLEL_CONTEXT_H
#define TDM_PARALLEL_CONTEXT_H

#include "tandem/parallel.h"

typedef struct {
    tdm_group *group;    /* may be NULL: rows are mapped, nothing is reduced */
    int64_t row0;        /* global index of this thread's first row */
    int64_t global_rows; /* rows of the whole batch over all ranks */
} tdm_parallel_ctx;

/* The calling thread's context, or NULL when none is set. */
const tdm_parallel_ctx *tdm_parallel_context(void);

#endif
