/* Datasets: the parts every reader shares (construction, index checks, whole-file reads),
 * the in-memory dataset, and the generic free/numel entry points. */
#include "data/dataset_common.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

tdm_dataset *tdm_ds_new(const tdm_dataset_ops *ops, void *impl, const char *name) {
    tdm_dataset *ds = (tdm_dataset *)calloc(1, sizeof *ds);
    if (!ds) return tdm_raise_null(TDM_ERR_NOMEM, "dataset %s: out of memory", name);
    ds->ops = ops;
    ds->impl = impl;
    snprintf(ds->name, sizeof ds->name, "%s", name);
    return ds;
}

const char *tdm_ds_basename(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash && slash[1] ? slash + 1 : path;
}

int tdm_ds_bad_index(const tdm_dataset *ds, int64_t i) {
    return tdm_raise(TDM_ERR_ARG, "dataset %s: index %lld out of range [0, %lld)", ds->name,
                     (long long)i, (long long)ds->n);
}

/* With FMA: q = p * RN(1/255) corrected once by the exact residual p - 255q. Where a CPU
 * lacks FMA, fmaf is a library call per element: those divide. */
__attribute__((target("avx2,fma"))) static void
bytes_to_unit_fma(float *restrict out, const uint8_t *restrict p, int64_t n) {
    const float r = 1.0f / 255.0f;
    for (int64_t i = 0; i < n; i++) {
        float x = (float)p[i], q = x * r;
        out[i] = __builtin_fmaf(__builtin_fmaf(-q, 255.0f, x), r, q);
    }
}

static bool have_fma;

__attribute__((constructor)) static void have_fma_init(void) {
    have_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

void tdm_ds_bytes_to_unit(float *restrict out, const uint8_t *restrict p, int64_t n) {
    if (have_fma) {
        bytes_to_unit_fma(out, p, n);
        return;
    }
    for (int64_t i = 0; i < n; i++) out[i] = (float)p[i] / 255.0f;
}

int tdm_ds_read_file(const char *path, const char *op, char **data, size_t *size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return tdm_raise(TDM_ERR_IO, "%s: cannot open %s: %s", op, path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return tdm_raise(TDM_ERR_IO, "%s: %s is not a regular file", op, path);
    }
    size_t n = (size_t)st.st_size;
    char *buf = (char *)malloc(n + 1);
    if (!buf) {
        close(fd);
        return tdm_raise(TDM_ERR_NOMEM, "%s: %s: cannot allocate %zu bytes", op, path, n + 1);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(fd, buf + got, n - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            /* the file shrank under us, or a read error */
            int err = k < 0 ? errno : 0;
            free(buf);
            close(fd);
            return tdm_raise(TDM_ERR_IO, "%s: %s: read failed at byte offset %zu: %s", op, path,
                             got, err ? strerror(err) : "unexpected end of file");
        }
        got += (size_t)k;
    }
    close(fd);
    buf[n] = '\0';
    *data = buf;
    *size = n;
    return TDM_OK;
}

int64_t tdm_dataset_sample_numel(const tdm_dataset *ds) {
    if (!ds) {
        tdm_raise(TDM_ERR_ARG, "tdm_dataset_sample_numel: dataset is NULL");
        return 0;
    }
    return tdm_shape_numel(ds->sample_shape);
}

/* Frees a dataset made by one of the tdm_* constructors (or any malloc'd tdm_dataset whose
 * destroy frees only impl). */
void tdm_dataset_free(tdm_dataset *ds) {
    if (!ds) return;
    if (ds->ops && ds->ops->destroy) ds->ops->destroy(ds);
    free(ds);
}

/* ---- the memory dataset ------------------------------------------------------------------ */

typedef struct {
    float *x;   /* [n, numel] */
    int64_t *y; /* [n] */
    int64_t numel;
} memory_impl;

static int memory_get(const tdm_dataset *ds, int64_t i, void *x, int64_t *y) {
    int rc = tdm_ds_check_index(ds, i);
    if (rc) return rc;
    const memory_impl *m = (const memory_impl *)ds->impl;
    memcpy(x, m->x + i * m->numel, (size_t)m->numel * sizeof(float));
    *y = m->y[i];
    return TDM_OK;
}

static void memory_destroy(tdm_dataset *ds) {
    memory_impl *m = (memory_impl *)ds->impl;
    if (!m) return;
    free(m->x);
    free(m->y);
    free(m);
    ds->impl = NULL;
}

static const tdm_dataset_ops memory_ops = {.get = memory_get, .destroy = memory_destroy};

static int memory_check_args(tdm_shape s, int64_t n, const float *x, const int64_t *y,
                             int64_t num_classes, int64_t *numel) {
    const char *op = "tdm_memory_dataset";
    char buf[96];
    if (!x || !y) return tdm_raise(TDM_ERR_ARG, "%s: x and y must not be NULL", op);
    if (n <= 0) return tdm_raise(TDM_ERR_ARG, "%s: n must be positive, got %lld", op, (long long)n);
    if (num_classes <= 0)
        return tdm_raise(TDM_ERR_ARG, "%s: num_classes must be positive, got %lld", op,
                         (long long)num_classes);
    if (s.ndim < 0 || s.ndim > TDM_MAX_DIMS)
        return tdm_raise(TDM_ERR_ARG, "%s: sample shape has %d dims (at most %d)", op, s.ndim,
                         TDM_MAX_DIMS);
    uint64_t e = 1;
    for (int d = 0; d < s.ndim; d++) {
        if (s.d[d] <= 0 || __builtin_mul_overflow(e, (uint64_t)s.d[d], &e))
            return tdm_raise(TDM_ERR_ARG, "%s: invalid sample shape %s", op, tdm_shape_str(s, buf));
    }
    uint64_t bytes;
    if (__builtin_mul_overflow(e, (uint64_t)n, &bytes) ||
        __builtin_mul_overflow(bytes, (uint64_t)sizeof(float), &bytes) || bytes > PTRDIFF_MAX)
        return tdm_raise(TDM_ERR_ARG, "%s: %lld samples of shape %s overflow", op, (long long)n,
                         tdm_shape_str(s, buf));
    for (int64_t i = 0; i < n; i++) {
        if (y[i] < 0 || y[i] >= num_classes)
            return tdm_raise(TDM_ERR_ARG, "%s: label y[%lld] = %lld out of range [0, %lld)", op,
                             (long long)i, (long long)y[i], (long long)num_classes);
    }
    *numel = (int64_t)e;
    return TDM_OK;
}

tdm_dataset *tdm_memory_dataset(tdm_shape sample_shape, int64_t n, const float *x, const int64_t *y,
                                int64_t num_classes) {
    int64_t numel = 0;
    if (memory_check_args(sample_shape, n, x, y, num_classes, &numel)) return NULL;
    memory_impl *m = (memory_impl *)calloc(1, sizeof *m);
    size_t xbytes = (size_t)n * (size_t)numel * sizeof(float);
    if (m) {
        m->x = (float *)malloc(xbytes);
        m->y = (int64_t *)malloc((size_t)n * sizeof(int64_t));
    }
    if (!m || !m->x || !m->y) {
        if (m) free(m->x), free(m->y);
        free(m);
        return tdm_raise_null(TDM_ERR_NOMEM, "tdm_memory_dataset: cannot allocate %zu bytes",
                              xbytes);
    }
    memcpy(m->x, x, xbytes);
    memcpy(m->y, y, (size_t)n * sizeof(int64_t));
    m->numel = numel;
    tdm_dataset *ds = tdm_ds_new(&memory_ops, m, "memory");
    if (!ds) {
        free(m->x), free(m->y), free(m);
        return NULL;
    }
    ds->n = n;
    ds->sample_shape = sample_shape;
    ds->x_dtype = TDM_F32;
    ds->target_shape = TDM_SHAPE0;
    ds->num_classes = num_classes;
    return ds;
}
