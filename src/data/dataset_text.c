/* Raw text as byte-level tokens (vocabulary 256): any file trains a GPT with no tokenizer.
 * Token k is byte k of the file; sample i is the window of T + 1 bytes starting at i*T
 * (x = bytes [i*T, i*T + T), y = the same shifted by one), the token shards' windows. */
#include "data/dataset_common.h"

#include <stdlib.h>
#include <string.h>

#define OP "tdm_text_dataset_open"

typedef struct {
    unsigned char *bytes;
    size_t size;
    int64_t context; /* T */
} text_impl;

static int text_get(const tdm_dataset *ds, int64_t i, void *x, int64_t *y) {
    int rc = tdm_ds_check_index(ds, i);
    if (rc) return rc;
    const text_impl *m = (const text_impl *)ds->impl;
    const int64_t T = m->context;
    const unsigned char *p = m->bytes + i * T;
    int64_t *restrict out = (int64_t *)x;
    for (int64_t j = 0; j < T; j++) out[j] = p[j];
    for (int64_t j = 0; j < T; j++) y[j] = p[j + 1];
    return TDM_OK;
}

static void text_destroy(tdm_dataset *ds) {
    text_impl *m = (text_impl *)ds->impl;
    if (m) free(m->bytes);
    free(m);
    ds->impl = NULL;
}

static const tdm_dataset_ops text_ops = {.get = text_get, .destroy = text_destroy};

tdm_dataset *tdm_text_dataset_open(const char *path, int64_t context) {
    if (!path) return tdm_raise_null(TDM_ERR_ARG, OP ": path is NULL");
    if (context < 1 || context > INT32_MAX)
        return tdm_raise_null(TDM_ERR_ARG, OP ": %s: context must be in [1, 2^31), got %lld", path,
                              (long long)context);
    char *data = NULL;
    size_t size = 0;
    if (tdm_ds_read_file(path, OP, &data, &size)) return NULL;
    if (size < (size_t)context + 1) {
        free(data);
        return tdm_raise_null(TDM_ERR_FORMAT,
                              OP ": %s: %zu bytes are too few for one window of context %lld "
                                 "(needs %lld)",
                              path, size, (long long)context, (long long)context + 1);
    }
    text_impl *m = (text_impl *)calloc(1, sizeof *m);
    tdm_dataset *ds = m ? tdm_ds_new(&text_ops, m, tdm_ds_basename(path)) : NULL;
    if (!ds) {
        free(m);
        free(data);
        return m ? NULL : tdm_raise_null(TDM_ERR_NOMEM, OP ": out of memory");
    }
    m->bytes = (unsigned char *)data;
    m->size = size;
    m->context = context;
    ds->n = (int64_t)(size - 1) / context;
    ds->sample_shape = TDM_SHAPE(context);
    ds->x_dtype = TDM_I64;
    ds->target_shape = TDM_SHAPE(context);
    ds->num_classes = 256;
    return ds;
}
