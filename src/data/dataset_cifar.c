/* CIFAR-10 and CIFAR-100 in their binary format (the "binary version" archives of
 * https://www.cs.toronto.edu/~kriz/cifar.html).
 *
 * A file is a run of fixed-size records, with no header:
 *   CIFAR-10:  label (1 byte, < 10), then 3072 pixel bytes             = 3073 bytes
 *   CIFAR-100: coarse label (< 20), fine label (< 100), then 3072 bytes = 3074 bytes
 * The pixels are the R plane, then G, then B, each 32 x 32 row-major: already [3, 32, 32].
 * Train is data_batch_1.bin .. data_batch_5.bin (CIFAR-10) or train.bin (CIFAR-100), test is
 * test_batch.bin or test.bin, read in that order. The records stay in memory as bytes (150 MB
 * for either train split, a quarter of its floats); get() converts one to f32 / 255. */
#include "data/dataset_common.h"
#include "backend/backend.h" /* tdm_cpu_mem_alloc */

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define OP           "tdm_cifar_open"
#define CIFAR_PIXELS 3072 /* [3, 32, 32] */
#define MAX_FILES    5

typedef struct {
    uint8_t *records; /* [n, record] */
    int64_t record;   /* bytes per record: 3073 or 3074 */
    int label_at;     /* the label's byte in a record (CIFAR-100: 0 coarse, 1 fine) */
    int pixels_at;    /* the first pixel's byte */
} cifar_impl;

static const uint8_t *cifar_record(const tdm_dataset *ds, int64_t i) {
    const cifar_impl *m = (const cifar_impl *)ds->impl;
    return m->records + i * m->record;
}

/* x [3, 32, 32] = pixel / 255 (ToTensor's values bit for bit) */
static void cifar_pixels(const tdm_dataset *ds, int64_t i, float *out, int64_t *y) {
    const cifar_impl *m = (const cifar_impl *)ds->impl;
    const uint8_t *rec = cifar_record(ds, i);
    tdm_ds_bytes_to_unit(out, rec + m->pixels_at, CIFAR_PIXELS);
    *y = rec[m->label_at];
}

static int cifar_get(const tdm_dataset *ds, int64_t i, void *x, int64_t *y) {
    int rc = tdm_ds_check_index(ds, i);
    if (rc) return rc;
    cifar_pixels(ds, i, (float *)x, y);
    return TDM_OK;
}

/* The same sample as a tdm_image, for a loader that runs transforms on every dataset. */
static int cifar_get_image(const tdm_dataset *ds, int64_t i, tdm_image *img, int64_t *y) {
    int rc = tdm_ds_check_index(ds, i);
    if (rc) return rc;
    float *data = (float *)malloc(CIFAR_PIXELS * sizeof(float));
    if (!data) return tdm_raise(TDM_ERR_NOMEM, "dataset %s: out of memory", ds->name);
    cifar_pixels(ds, i, data, y);
    *img = (tdm_image){.c = 3, .h = 32, .w = 32, .data = data};
    return TDM_OK;
}

/* Requests record i into the cache (the loader's hint, a few samples ahead). */
static void cifar_prefetch(const tdm_dataset *ds, int64_t i) {
    if (i < 0 || i >= ds->n) return;
    const cifar_impl *m = (const cifar_impl *)ds->impl;
    const char *p = (const char *)cifar_record(ds, i);
    for (int64_t b = 0; b < m->record; b += 64) __builtin_prefetch(p + b);
    __builtin_prefetch(p + m->record - 1);
}

static void cifar_destroy(tdm_dataset *ds) {
    cifar_impl *m = (cifar_impl *)ds->impl;
    if (m) free(m->records);
    free(m);
    ds->impl = NULL;
}

static const tdm_dataset_ops cifar_ops = {.get = cifar_get,
                                          .destroy = cifar_destroy,
                                          .prefetch = cifar_prefetch,
                                          .get_image = cifar_get_image};

/* ---- reading ----------------------------------------------------------------------------- */

typedef struct {
    char path[MAX_FILES][4096];
    int64_t bytes[MAX_FILES];
    int count;
} cifar_files;

/* The split's file names, in order. */
static int split_names(int classes, bool train, const char *names[MAX_FILES]) {
    static const char *const c10_train[] = {"data_batch_1.bin", "data_batch_2.bin",
                                            "data_batch_3.bin", "data_batch_4.bin",
                                            "data_batch_5.bin"};
    if (classes == 100) return names[0] = train ? "train.bin" : "test.bin", 1;
    if (!train) return names[0] = "test_batch.bin", 1;
    for (int k = 0; k < 5; k++) names[k] = c10_train[k];
    return 5;
}

/* dir/name into buf; false when it does not fit */
static bool path_join(char *buf, size_t size, const char *dir, const char *name) {
    int k = snprintf(buf, size, "%s/%s", dir, name);
    return k >= 0 && (size_t)k < size;
}

/* dir itself, or the folder the archive unpacks to (cifar-10-batches-bin, cifar-100-binary)
 * when dir holds that instead of the files. */
static const char *split_dir(const char *dir, int classes, const char *first, char *buf,
                             size_t size) {
    char probe[4096];
    if (path_join(probe, sizeof probe, dir, first) && access(probe, F_OK) == 0) return dir;
    const char *archive = classes == 10 ? "cifar-10-batches-bin" : "cifar-100-binary";
    if (path_join(buf, size, dir, archive) && path_join(probe, sizeof probe, buf, first) &&
        access(probe, F_OK) == 0)
        return buf;
    return dir;
}

/* Finds the split's files and checks each holds a whole, nonzero number of records. */
static int files_find(const char *dir, int classes, bool train, int64_t record, cifar_files *f) {
    const char *names[MAX_FILES];
    char sub[4096];
    f->count = split_names(classes, train, names);
    const char *d = split_dir(dir, classes, names[0], sub, sizeof sub);
    for (int k = 0; k < f->count; k++) {
        struct stat st;
        if (!path_join(f->path[k], sizeof f->path[k], d, names[k]))
            return tdm_raise(TDM_ERR_ARG, OP ": the path %s/%s is too long", d, names[k]);
        if (stat(f->path[k], &st) != 0)
            return tdm_raise(TDM_ERR_IO, OP ": cannot open %s: %s (CIFAR-%d %s needs %s%s)",
                             f->path[k], strerror(errno), classes, train ? "train" : "test",
                             names[0], f->count > 1 ? " .. data_batch_5.bin" : "");
        if (!S_ISREG(st.st_mode))
            return tdm_raise(TDM_ERR_IO, OP ": %s is not a regular file", f->path[k]);
        if (st.st_size == 0 || st.st_size % record != 0)
            return tdm_raise(TDM_ERR_FORMAT,
                             OP ": %s: %lld bytes is not a whole number of CIFAR-%d records of "
                                "%lld bytes (truncated, or not CIFAR-%d?)",
                             f->path[k], (long long)st.st_size, classes, (long long)record,
                             classes);
        f->bytes[k] = st.st_size;
    }
    return TDM_OK;
}

/* Reads exactly n bytes of path into buf. */
static int read_exact(const char *path, uint8_t *buf, int64_t n) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return tdm_raise(TDM_ERR_IO, OP ": cannot open %s: %s", path, strerror(errno));
    int64_t got = 0;
    while (got < n) {
        ssize_t k = read(fd, buf + got, (size_t)(n - got));
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            int err = k < 0 ? errno : 0;
            close(fd);
            return tdm_raise(TDM_ERR_IO, OP ": %s: read failed at byte offset %lld: %s", path,
                             (long long)got, err ? strerror(err) : "the file shrank");
        }
        got += k;
    }
    close(fd);
    return TDM_OK;
}

/* Every label byte of the records of one file must lie in range (CIFAR-100: both). */
static int check_labels(const char *path, const uint8_t *rec, int64_t n, int64_t record,
                        int classes) {
    for (int64_t r = 0; r < n; r++, rec += record) {
        int nl = classes == 100 ? 2 : 1;
        for (int b = 0; b < nl; b++) {
            int limit = classes == 100 && b == 0 ? 20 : classes;
            if (rec[b] < limit) continue;
            return tdm_raise(TDM_ERR_FORMAT,
                             OP ": %s: record %lld (byte offset %lld): %slabel %d is out of "
                                "range [0, %d)",
                             path, (long long)r, (long long)(r * record + b),
                             classes == 100 ? (b == 0 ? "coarse " : "fine ") : "", rec[b], limit);
        }
    }
    return TDM_OK;
}

/* All the split's records, one file after the other, in one buffer. */
static int load_records(const cifar_files *f, int64_t record, int classes, cifar_impl *m,
                        int64_t *n) {
    int64_t total = 0;
    for (int k = 0; k < f->count; k++) total += f->bytes[k];
    m->records = (uint8_t *)tdm_cpu_mem_alloc(0, (size_t)total); /* huge pages: see IDX's */
    if (!m->records)
        return tdm_raise(TDM_ERR_NOMEM, OP ": cannot allocate %lld bytes", (long long)total);
    int64_t at = 0;
    for (int k = 0; k < f->count; k++) {
        if (read_exact(f->path[k], m->records + at, f->bytes[k]) ||
            check_labels(f->path[k], m->records + at, f->bytes[k] / record, record, classes))
            return tdm_last_status();
        at += f->bytes[k];
    }
    *n = total / record;
    return TDM_OK;
}

tdm_dataset *tdm_cifar_open(const char *dir, int classes, bool train, bool coarse) {
    if (!dir) return tdm_raise_null(TDM_ERR_ARG, OP ": dir is NULL");
    if (classes != 10 && classes != 100)
        return tdm_raise_null(TDM_ERR_ARG,
                              OP ": %s: classes must be 10 (CIFAR-10) or 100 (CIFAR-100), got %d",
                              dir, classes);
    if (coarse && classes != 100)
        return tdm_raise_null(TDM_ERR_ARG, OP ": %s: coarse labels exist only in CIFAR-100", dir);
    const int64_t record = CIFAR_PIXELS + (classes == 100 ? 2 : 1);
    cifar_impl *m = (cifar_impl *)calloc(1, sizeof *m);
    cifar_files *files = (cifar_files *)malloc(sizeof *files); /* 20 KB of paths */
    if (!m || !files) {
        free(m);
        free(files);
        return tdm_raise_null(TDM_ERR_NOMEM, OP ": out of memory");
    }
    m->record = record;
    m->pixels_at = classes == 100 ? 2 : 1;
    m->label_at = classes == 100 && !coarse ? 1 : 0;
    int64_t n = 0;
    int rc = files_find(dir, classes, train, record, files);
    if (!rc) rc = load_records(files, record, classes, m, &n);
    free(files);
    char name[64];
    snprintf(name, sizeof name, "cifar%d%s/%s", classes, coarse ? "-coarse" : "",
             train ? "train" : "test");
    tdm_dataset *ds = rc ? NULL : tdm_ds_new(&cifar_ops, m, name);
    if (!ds) {
        free(m->records);
        free(m);
        return NULL;
    }
    ds->n = n;
    ds->sample_shape = TDM_SHAPE(3, 32, 32);
    ds->x_dtype = TDM_F32;
    ds->target_shape = TDM_SHAPE0;
    ds->num_classes = coarse ? 20 : classes;
    return ds;
}
