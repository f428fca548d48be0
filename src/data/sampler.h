/* Private to src/data: the sample order of an epoch and per-sample augmentation. */
#ifndef TDM_DATA_SAMPLER_H
#define TDM_DATA_SAMPLER_H

#include "tandem/data.h"

/* Samples one rank sees per epoch: n, or ceil(n / world) with DistributedSampler padding. */
int64_t tdm_sampler_count(int64_t n, int world);

/* Writes the order of epoch into out [tdm_sampler_count(n, world)]: 0..n-1, or a Philox
 * Fisher-Yates permutation keyed by seed + epoch when shuffle; with world > 1 the list is
 * padded by repeating from its start and rank takes every world-th entry from rank on.
 * scratch [n] is needed when world > 1 (may be NULL otherwise). */
void tdm_sampler_fill(int64_t *out, int64_t *scratch, int64_t n, bool shuffle, uint64_t seed,
                      int64_t epoch, int rank, int world);

/* Whether a changes samples at all. */
bool tdm_augment_active(const tdm_augment *a);
/* Checks a against the dataset's samples, of shape `shape` in a batch (after the loader's
 * transform): f32, and [C, H, W] for crop and flip; raises naming what is wrong. */
int tdm_augment_check(const tdm_augment *a, const tdm_dataset *ds, tdm_shape shape);
/* Applies a in place to one sample x of shape s (f32): random crop, flip, then normalize, as
 * torchvision's RandomCrop(padding), RandomHorizontalFlip and Normalize. The random draws
 * depend on (seed, epoch, index) only, so the result does not depend on the worker. */
void tdm_augment_apply(const tdm_augment *a, float *x, tdm_shape s, uint64_t seed, int64_t epoch,
                       int64_t index);

#endif
