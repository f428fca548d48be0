/* The parallel context: a thread-local note of which rows of the global batch this thread
 * computes, and over which group. Thread-local because DataParallel runs every replica on
 * its own thread of one process, each with different rows.
 *
 * The layers that read it (src/nn/functional_{norm,dropout}.c) sit below this
 * layer, so they see it as a batch split (nn/batch_split.h) whose operations this file
 * registers the first time a context is set; before that no thread has one. */
#include "nn/batch_split.h"
#include "tandem/parallel.h"

static _Thread_local tdm_batch_split current;
static _Thread_local bool active;

static bool split_current(tdm_batch_split *out) {
    if (active) *out = current;
    return active;
}

static int split_sum(void *group, tdm_tensor *t) {
    tdm_collective_label("batch norm statistics");
    return tdm_work_wait(tdm_all_reduce(group, t, TDM_SUM));
}

static void split_abort(void *group, const char *reason) {
    tdm_group_abort(group, reason);
}

static const tdm_batch_split_ops split_ops = {split_current, split_sum, split_abort};

int tdm_parallel_context_set(tdm_group *g, int64_t row0, int64_t global_rows) {
    /* row0 == global_rows: this rank's slice is empty (an uneven split at the end) */
    if (row0 < 0 || global_rows < row0)
        return tdm_raise(TDM_ERR_ARG,
                         "parallel_context_set: row0 %lld is not in [0, global_rows %lld]",
                         (long long)row0, (long long)global_rows);
    tdm_batch_split_register(&split_ops);
    /* no group, or a group of one: rows are mapped, nothing is reduced */
    current = (tdm_batch_split){row0, global_rows, g ? tdm_group_size(g) : 1, g};
    active = true;
    return TDM_OK;
}

void tdm_parallel_context_clear(void) {
    active = false;
    current = (tdm_batch_split){0};
}
