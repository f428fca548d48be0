/* The parallel context: a thread-local note of which rows of the global batch this thread
 * computes, and over which group. Thread-local because DataParallel runs every replica on
 * its own thread of one process, each with different rows. */
#include "parallel/context.h"

#include "core/core.h"

static _Thread_local tdm_parallel_ctx current;
static _Thread_local bool active;

int tdm_parallel_context_set(tdm_group *g, int64_t row0, int64_t global_rows) {
    /* row0 == global_rows: this rank's slice is empty (an uneven split at the end) */
    if (row0 < 0 || global_rows < row0)
        return tdm_raise(TDM_ERR_ARG,
                         "parallel_context_set: row0 %lld is not in [0, global_rows %lld]",
                         (long long)row0, (long long)global_rows);
    current = (tdm_parallel_ctx){g, row0, global_rows};
    active = true;
    return TDM_OK;
}

void tdm_parallel_context_clear(void) {
    active = false;
    current = (tdm_parallel_ctx){0};
}

const tdm_parallel_ctx *tdm_parallel_context(void) {
    return active ? &current : NULL;
}
