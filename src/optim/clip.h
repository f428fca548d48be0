/* The two halves of tdm_clip_grad_norm, for an update split into shards (DataParallel on CPU
 * devices): each shard's sum of squares, then each shard scaled for the global norm. */
#ifndef TDM_OPTIM_CLIP_H
#define TDM_OPTIM_CLIP_H

#include "tandem/nn.h"

/* *ss = the sum of squares (in double) of gradient elements [lo, hi) of ps's flat buffer. */
int tdm_clip_sum_squares(const tdm_paramset *ps, int64_t lo, int64_t hi, double *ss);
/* Multiplies gradient elements [lo, hi) by PyTorch's factor for the global norm `norm`:
 * max_norm / (norm + 1e-6), when below 1 (NaN for a NaN norm, as in PyTorch). */
int tdm_clip_scale(tdm_paramset *ps, int64_t lo, int64_t hi, float max_norm, float norm);

/* The same for a gradient held as a tensor of its own (a ZeRO stage-2 shard, contiguous). */
int tdm_clip_sum_squares_of(const tdm_tensor *g, double *ss);
int tdm_clip_scale_of(tdm_tensor *g, float max_norm, float norm);

#endif
