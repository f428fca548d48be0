/* Private helpers shared by the dataset readers (dataset*.c): construction, the index check
 * of every get(), and whole-file reads. Not installed. */
#ifndef TDM_DATASET_COMMON_H
#define TDM_DATASET_COMMON_H

#include "core/core.h"
#include "tandem/data.h"

#include <stddef.h>

/* A zeroed dataset with ops, impl and name (truncated to fit); NULL and TDM_ERR_NOMEM (impl
 * is then left to the caller). */
tdm_dataset *tdm_ds_new(const tdm_dataset_ops *ops, void *impl, const char *name);

/* The last component of path, for dataset names. */
const char *tdm_ds_basename(const char *path);

/* Raises TDM_ERR_ARG naming the dataset and the index. */
int tdm_ds_bad_index(const tdm_dataset *ds, int64_t i);

/* The first check of every get(): one unsigned compare on the hot path. */
static inline int tdm_ds_check_index(const tdm_dataset *ds, int64_t i) {
    return (uint64_t)i < (uint64_t)ds->n ? TDM_OK : tdm_ds_bad_index(ds, i);
}

/* out[i] = p[i] / 255.0f for i < n: bit for bit ToTensor's f32 division, without dividing
 * on CPUs with FMA: q = p * RN(1/255), corrected once by the residual p - 255q (exact with
 * an FMA), is the correctly rounded quotient for every byte (test_datasets checks all 256),
 * where the product alone misses 126 of them. The divisions cost the loader more
 * (bench/RESULTS.md, "Figures behind the code"). */
void tdm_ds_bytes_to_unit(float *out, const uint8_t *p, int64_t n);

/* Reads a whole regular file into a malloc'd buffer with a NUL after the last byte (*size
 * excludes it). op names the caller in messages. Returns TDM_OK or TDM_ERR_IO/NOMEM. */
int tdm_ds_read_file(const char *path, const char *op, char **data, size_t *size);

#endif
