/* Where a pipeline cuts its Sequential into stages (pipeline_split.c): by parameter count, by
 * layer count (tdm_pipe_split, public) or from an explicit layer -> stage map. Apart from the
 * runner (pipeline.c): it is arithmetic over the model's layers and knows nothing of threads,
 * hand-offs or schedules. */
#ifndef TDM_PARALLEL_PIPELINE_SPLIT_H
#define TDM_PARALLEL_PIPELINE_SPLIT_H

#include "tandem/pipeline.h"

/* The stage boundaries of opts o for seq: from o->layer_stage when it is given (then
 * *stages, if not 0, must agree with it and receives its count), else tdm_pipe_split into
 * *stages stages by o->split_by. first has room for TDM_PIPE_MAX_STAGES + 2 entries; on
 * return first[s] is stage s's first layer and first[*stages] the number of layers. */
int tdm_pipe_stage_bounds(const tdm_module *seq, const tdm_pipe_opts *o, int *stages, int *first);

#endif
