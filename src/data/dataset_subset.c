/* A dataset of some of another's samples, by index (PyTorch's torch.utils.data.Subset): a
 * --limit that keeps every class of an image folder, a validation split. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/dataset_common.h"

typedef struct {
    tdm_dataset_ops ops; /* the base's, forwarded: get_image only where the base has one */
    tdm_dataset *base;   /* borrowed */
    int64_t *indices;    /* [n] into base */
} subset_impl;

static const tdm_dataset *base_of(const tdm_dataset *ds, int64_t *i) {
    const subset_impl *s = ds->impl;
    *i = s->indices[*i];
    return s->base;
}

static int subset_get(const tdm_dataset *ds, int64_t i, void *x, int64_t *y) {
    int rc = tdm_ds_check_index(ds, i);
    if (rc) return rc;
    const tdm_dataset *b = base_of(ds, &i);
    return b->ops->get(b, i, x, y);
}

static int subset_get_image(const tdm_dataset *ds, int64_t i, tdm_image *img, int64_t *y) {
    int rc = tdm_ds_check_index(ds, i);
    if (rc) return rc;
    const tdm_dataset *b = base_of(ds, &i);
    return b->ops->get_image(b, i, img, y);
}

static int subset_get_image_part(const tdm_dataset *ds, int64_t i, tdm_image_want_fn want,
                                 void *arg, tdm_image *img, int64_t *y) {
    int rc = tdm_ds_check_index(ds, i);
    if (rc) return rc;
    const tdm_dataset *b = base_of(ds, &i);
    return b->ops->get_image_part(b, i, want, arg, img, y);
}

static void subset_prefetch(const tdm_dataset *ds, int64_t i) {
    if ((uint64_t)i >= (uint64_t)ds->n) return;
    const tdm_dataset *b = base_of(ds, &i);
    b->ops->prefetch(b, i);
}

static const char *subset_class_name(const tdm_dataset *ds, int64_t k) {
    const subset_impl *s = ds->impl;
    return s->base->ops->class_name(s->base, k);
}

static void subset_destroy(tdm_dataset *ds) {
    subset_impl *s = ds->impl;
    if (s) free(s->indices);
    free(s);
    ds->impl = NULL;
}

tdm_dataset *tdm_dataset_subset(tdm_dataset *base, const int64_t *indices, int64_t n) {
    if (!base || !base->ops || (!indices && n > 0) || n < 1)
        return tdm_raise_null(TDM_ERR_ARG, "dataset_subset: %s",
                              !base ? "NULL dataset" : "no indices (n must be >= 1)");
    for (int64_t k = 0; k < n; k++)
        if (indices[k] < 0 || indices[k] >= base->n)
            return tdm_raise_null(TDM_ERR_ARG,
                                  "dataset_subset: index %lld (entry %lld) is not a sample of "
                                  "'%s' ([0, %lld))",
                                  (long long)indices[k], (long long)k, base->name,
                                  (long long)base->n);
    subset_impl *s = calloc(1, sizeof *s);
    int64_t *idx = malloc(sizeof *idx * (size_t)n);
    char name[128]; /* tdm_ds_new keeps what fits of it */
    snprintf(name, sizeof name, "%.40s[%lld of %lld]", base->name, (long long)n,
             (long long)base->n);
    tdm_dataset *ds = s && idx ? tdm_ds_new(&s->ops, s, name) : NULL;
    if (!ds) {
        free(s);
        free(idx);
        return tdm_raise_null(TDM_ERR_NOMEM, "dataset_subset: out of memory for %lld indices",
                              (long long)n);
    }
    memcpy(idx, indices, sizeof *idx * (size_t)n);
    s->base = base, s->indices = idx;
    s->ops = (tdm_dataset_ops){
        .get = base->ops->get ? subset_get : NULL,
        .destroy = subset_destroy,
        .prefetch = base->ops->prefetch ? subset_prefetch : NULL,
        .get_image = base->ops->get_image ? subset_get_image : NULL,
        .get_image_part = base->ops->get_image_part ? subset_get_image_part : NULL,
        .class_name = base->ops->class_name ? subset_class_name : NULL,
    };
    ds->n = n;
    ds->sample_shape = base->sample_shape;
    ds->x_dtype = base->x_dtype;
    ds->target_shape = base->target_shape;
    ds->num_classes = base->num_classes;
    return ds;
}
