/* IDX image and label files (MNIST, Fashion-MNIST), raw or gzipped, and Fashion-MNIST.
 *
 * Format (big-endian): a magic 0x000008NN (0x08: unsigned bytes, NN: number of dims), NN u32
 * dims, then the u8 data. Images are 0x00000803 [count, rows, cols]; labels 0x00000801
 * [count]. Both files are read into memory once and kept as u8 (47 MB for Fashion-MNIST
 * train instead of 188 MB of floats); get() converts one image to f32 / 255, like
 * torchvision's ToTensor (the values of its f32 division, so they match PyTorch bit for bit).
 *
 * Nothing is allocated on the word of a header alone: a raw file's claimed size must equal
 * its size on disk, and a gzipped file's claim must be possible for its compressed size;
 * even then the buffer starts at no more than 8x the compressed size (1 MB at least) and
 * grows, up to the claim, only as decompression delivers bytes. */
#include "data/dataset_common.h"
#include "backend/backend.h" /* tdm_cpu_mem_alloc */

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#define OP "tdm_idx_dataset_open"
/* deflate cannot compress better than about 1032:1; a claim above that is a lie */
#define GZIP_MAX_RATIO 1032u
#define GZ_INITIAL_CAP ((uint64_t)1 << 20)

/* ---- a reader over a raw or gzipped file, tracking the (decompressed) offset ------------ */

/* Gzipped files go through zlib's inflate (not gzread, which ignores whatever follows the
 * last gzip member): the reader sees where each member ends, accepts a further member (as
 * gzip -d does) and rejects anything else after the stream. */
#define GZ_IN_BYTES (1u << 17)

typedef struct {
    const char *path;
    int fd;            /* the open file */
    bool gz;           /* gzipped: inflated through zs */
    bool gz_done;      /* the last gzip member has ended, and the file with it */
    bool zs_live;      /* zs is initialised */
    z_stream zs;       /* reads from in */
    unsigned char *in; /* GZ_IN_BYTES of compressed input */
    uint64_t in_off;   /* compressed bytes read from the file */
    uint64_t fsize;    /* bytes on disk */
    uint64_t pos;      /* offset in the (decompressed) stream */
} idx_reader;

static const char *where(const idx_reader *r) {
    return r->gz ? " (decompressed)" : "";
}

static int reader_open(idx_reader *r, const char *path) {
    memset(r, 0, sizeof *r);
    r->path = path;
    r->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (r->fd < 0) return tdm_raise(TDM_ERR_IO, OP ": cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(r->fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(r->fd);
        r->fd = -1;
        return tdm_raise(TDM_ERR_IO, OP ": %s is not a regular file", path);
    }
    r->fsize = (uint64_t)st.st_size;
    unsigned char m[2] = {0, 0};
    if (pread(r->fd, m, 2, 0) == 2 && m[0] == 0x1f && m[1] == 0x8b) {
        r->gz = true;
        r->in = (unsigned char *)malloc(GZ_IN_BYTES);
        /* 16 + MAX_WBITS: a gzip wrapper, checked (header CRC when present, CRC-32, length) */
        if (!r->in || inflateInit2(&r->zs, 16 + MAX_WBITS) != Z_OK) {
            free(r->in);
            r->in = NULL;
            close(r->fd);
            r->fd = -1;
            return tdm_raise(TDM_ERR_NOMEM, OP ": %s: cannot start zlib", path);
        }
        r->zs_live = true;
    }
    return TDM_OK;
}

static void reader_close(idx_reader *r) {
    if (r->zs_live) inflateEnd(&r->zs);
    free(r->in);
    if (r->fd >= 0) close(r->fd);
    r->zs_live = false;
    r->in = NULL;
    r->fd = -1;
}

/* Tops the compressed input up to at least `need` bytes (fewer only at the end of the file).
 * Returns the bytes available, or -1 with an error raised. */
static int64_t gz_fill(idx_reader *r, unsigned need) {
    if (r->zs.avail_in >= need) return r->zs.avail_in;
    if (r->zs.avail_in && r->zs.next_in != r->in) memmove(r->in, r->zs.next_in, r->zs.avail_in);
    r->zs.next_in = r->in;
    while (r->zs.avail_in < need) {
        ssize_t k = read(r->fd, r->in + r->zs.avail_in, GZ_IN_BYTES - r->zs.avail_in);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0)
            return tdm_raise(TDM_ERR_IO, OP ": %s: read failed at byte offset %llu: %s", r->path,
                             (unsigned long long)r->in_off, strerror(errno));
        if (k == 0) break;
        r->zs.avail_in += (unsigned)k;
        r->in_off += (uint64_t)k;
    }
    return r->zs.avail_in;
}

/* Inflates up to n (<= 2^30) bytes into buf; the count, short only at the end of the last
 * gzip member, or -1 with an error raised (corrupt, truncated, or trailing non-gzip data). */
static int64_t gz_read(idx_reader *r, unsigned char *buf, uint64_t n) {
    z_stream *zs = &r->zs;
    zs->next_out = buf;
    zs->avail_out = (uInt)n;
    while (zs->avail_out && !r->gz_done) {
        int64_t have = gz_fill(r, 1);
        if (have < 0) return -1;
        if (have == 0)
            return tdm_raise(TDM_ERR_FORMAT,
                             OP ": %s: gzip stream is truncated at decompressed byte offset %llu",
                             r->path, (unsigned long long)(r->pos + (n - zs->avail_out)));
        int zr = inflate(zs, Z_NO_FLUSH);
        if (zr == Z_MEM_ERROR)
            return tdm_raise(TDM_ERR_NOMEM, OP ": %s: zlib out of memory", r->path);
        if (zr != Z_OK && zr != Z_STREAM_END && zr != Z_BUF_ERROR)
            return tdm_raise(TDM_ERR_FORMAT,
                             OP ": %s: corrupt gzip data near decompressed byte offset %llu: %s",
                             r->path, (unsigned long long)(r->pos + (n - zs->avail_out)),
                             zs->msg ? zs->msg : "invalid stream");
        if (zr != Z_STREAM_END) continue;
        /* a member ended: the file ends too, or another gzip member follows */
        have = gz_fill(r, 2);
        if (have < 0) return -1;
        if (have == 0) {
            r->gz_done = true;
        } else if (have >= 2 && zs->next_in[0] == 0x1f && zs->next_in[1] == 0x8b) {
            inflateReset(zs);
        } else {
            uint64_t at = r->in_off - zs->avail_in;
            return tdm_raise(TDM_ERR_FORMAT,
                             OP ": %s: trailing data after the gzip stream: it ends at byte "
                                "offset %llu of the file's %llu bytes, and what follows is not "
                                "another gzip member",
                             r->path, (unsigned long long)at, (unsigned long long)r->fsize);
        }
    }
    return (int64_t)(n - zs->avail_out);
}

/* Reads up to n bytes; returns the count (short only at the end of the data) or -1 with an
 * error raised (I/O error, corrupt or truncated gzip stream, data after it). */
static int64_t reader_read(idx_reader *r, void *buf, uint64_t n) {
    uint64_t got = 0;
    while (got < n) {
        uint64_t want = n - got > (1u << 30) ? (1u << 30) : n - got;
        int64_t k;
        if (r->gz) {
            k = gz_read(r, (unsigned char *)buf + got, want);
            if (k < 0) return -1;
        } else {
            k = read(r->fd, (char *)buf + got, (size_t)want);
            if (k < 0 && errno == EINTR) continue;
            if (k < 0)
                return tdm_raise(TDM_ERR_IO, OP ": %s: read failed at byte offset %llu: %s",
                                 r->path, (unsigned long long)(r->pos + got), strerror(errno));
        }
        if (k == 0) break; /* the end of the data */
        got += (uint64_t)k;
    }
    r->pos += got;
    return (int64_t)got;
}

/* ---- headers and payloads ----------------------------------------------------------------- */

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Reads the magic and ndim dims of an IDX file of u8 data; *bytes receives the product. */
static int read_header(idx_reader *r, int ndim, const char *what, uint32_t *dims, uint64_t *bytes) {
    unsigned char h[4 + 4 * 3];
    uint64_t hsize = 4 + 4 * (uint64_t)ndim;
    int64_t k = reader_read(r, h, hsize);
    if (k < 0) return tdm_last_status();
    if ((uint64_t)k < hsize)
        return tdm_raise(TDM_ERR_FORMAT,
                         OP ": %s: truncated header: the file ends at byte offset %lld%s, an IDX "
                            "%s header has %llu bytes",
                         r->path, (long long)k, where(r), what, (unsigned long long)hsize);
    uint32_t magic = be32(h), want = 0x00000800u | (uint32_t)ndim;
    if (magic != want)
        return tdm_raise(TDM_ERR_FORMAT,
                         OP ": %s: wrong magic 0x%08x at byte offset 0 (expected 0x%08x: IDX %s "
                            "of unsigned bytes)",
                         r->path, magic, want, what);
    uint64_t total = 1;
    for (int d = 0; d < ndim; d++) {
        dims[d] = be32(h + 4 + 4 * d);
        if (dims[d] == 0)
            return tdm_raise(TDM_ERR_FORMAT, OP ": %s: dimension %d at byte offset %d is zero",
                             r->path, d, 4 + 4 * d);
        if (__builtin_mul_overflow(total, (uint64_t)dims[d], &total) || total > PTRDIFF_MAX)
            return tdm_raise(TDM_ERR_FORMAT,
                             OP ": %s: dimensions in the header (byte offsets 4..%d) overflow: "
                                "their product exceeds the address space",
                             r->path, 4 + 4 * ndim - 1);
    }
    *bytes = total;
    return TDM_OK;
}

/* Rejects a claim of `bytes` data bytes after the header that the file cannot hold. */
static int check_claim(const idx_reader *r, uint64_t bytes, const char *what) {
    uint64_t end = r->pos + bytes;
    if (!r->gz && end != r->fsize) {
        if (end > r->fsize)
            return tdm_raise(TDM_ERR_FORMAT,
                             OP ": %s: truncated: the header claims %llu bytes of %s from byte "
                                "offset %llu, but the file size is %llu bytes",
                             r->path, (unsigned long long)bytes, what, (unsigned long long)r->pos,
                             (unsigned long long)r->fsize);
        return tdm_raise(TDM_ERR_FORMAT,
                         OP ": %s: the header claims %llu bytes of %s ending at byte offset %llu, "
                            "but the file size is %llu bytes (trailing data)",
                         r->path, (unsigned long long)bytes, what, (unsigned long long)end,
                         (unsigned long long)r->fsize);
    }
    if (r->gz && bytes / GZIP_MAX_RATIO > r->fsize + 1024)
        return tdm_raise(TDM_ERR_FORMAT,
                         OP ": %s: the header claims %llu bytes of %s, more than a gzip file of "
                            "%llu bytes can hold",
                         r->path, (unsigned long long)bytes, what, (unsigned long long)r->fsize);
    return TDM_OK;
}

/* Reads the first `want` of the `bytes` data bytes the header claims; when that is all of
 * them, checks the data ends there. The buffer grows with what decompression delivers, never
 * beyond the (already checked) claim. */
static uint8_t *read_payload(idx_reader *r, uint64_t bytes, uint64_t want, const char *what) {
    uint64_t start = r->pos;
    uint64_t cap = want;
    if (r->gz && cap > GZ_INITIAL_CAP) {
        uint64_t guess = r->fsize * 8 > GZ_INITIAL_CAP ? r->fsize * 8 : GZ_INITIAL_CAP;
        cap = guess < want ? guess : want;
    }
    /* 2 MiB aligned and on huge pages from 2 MiB up (the CPU backend's large blocks): a
     * batch reads 64 images at random from tens of MB, and with 4 KiB pages every image
     * missed the TLB (perf: the loader's prefetches stalled on the page walks). Figures:
     * bench/RESULTS.md, "Issue 15: two CPU devices against one, the MLP again". */
    uint8_t *buf = (uint8_t *)tdm_cpu_mem_alloc(0, (size_t)cap);
    uint64_t got = 0;
    if (!buf) goto nomem;
    for (;;) {
        int64_t k = reader_read(r, buf + got, cap - got);
        if (k < 0) goto fail;
        got += (uint64_t)k;
        if (got < cap || cap == want) break; /* end of the data, or all that is wanted */
        uint64_t ncap = cap * 2 < want ? cap * 2 : want;
        uint8_t *nbuf = (uint8_t *)realloc(buf, (size_t)ncap);
        if (!nbuf) goto nomem;
        buf = nbuf;
        cap = ncap;
    }
    if (got < want) {
        tdm_raise(TDM_ERR_FORMAT,
                  OP ": %s: truncated: the header claims %llu bytes of %s from byte offset %llu, "
                     "but the data ends at byte offset %llu%s",
                  r->path, (unsigned long long)bytes, what, (unsigned long long)start,
                  (unsigned long long)r->pos, where(r));
        goto fail;
    }
    if (want < bytes) return buf; /* a prefix: what follows is not read */
    unsigned char extra;
    int64_t k = reader_read(r, &extra, 1);
    if (k < 0) goto fail;
    if (k > 0) {
        tdm_raise(TDM_ERR_FORMAT,
                  OP ": %s: trailing data after the %llu bytes of %s the header claims, at byte "
                     "offset %llu%s",
                  r->path, (unsigned long long)bytes, what, (unsigned long long)(start + bytes),
                  where(r));
        goto fail;
    }
    return buf;
nomem:
    tdm_raise(TDM_ERR_NOMEM, OP ": %s: cannot allocate %llu bytes of %s", r->path,
              (unsigned long long)bytes, what);
fail:
    free(buf);
    return NULL;
}

/* ---- the dataset ---------------------------------------------------------------------- */

typedef struct {
    uint8_t *pixels; /* [n, rows * cols] */
    uint8_t *labels; /* [n] */
    int64_t pixels_per_image;
} idx_impl;

static int idx_get(const tdm_dataset *ds, int64_t i, void *x, int64_t *y) {
    int rc = tdm_ds_check_index(ds, i);
    if (rc) return rc;
    const idx_impl *m = (const idx_impl *)ds->impl;
    const int64_t n = m->pixels_per_image;
    tdm_ds_bytes_to_unit((float *)x, m->pixels + i * n, n);
    *y = m->labels[i];
    return TDM_OK;
}

/* Requests image i's pixels into the cache (the loader's hint, a few samples ahead). */
static void idx_prefetch(const tdm_dataset *ds, int64_t i) {
    if (i < 0 || i >= ds->n) return;
    const idx_impl *m = (const idx_impl *)ds->impl;
    const char *p = (const char *)(m->pixels + i * m->pixels_per_image);
    for (int64_t b = 0; b < m->pixels_per_image; b += 64) __builtin_prefetch(p + b);
    __builtin_prefetch(p + m->pixels_per_image - 1);
}

static void idx_free_impl(idx_impl *m) {
    if (!m) return;
    free(m->pixels);
    free(m->labels);
    free(m);
}

static void idx_destroy(tdm_dataset *ds) {
    idx_free_impl((idx_impl *)ds->impl);
    ds->impl = NULL;
}

static const tdm_dataset_ops idx_ops = {
    .get = idx_get, .destroy = idx_destroy, .prefetch = idx_prefetch};

/* Labels must lie below max_classes; num_classes becomes the largest label + 1. */
static int check_labels(const char *path, const uint8_t *labels, int64_t n, int max_classes,
                        int64_t *num_classes) {
    int top = 0;
    for (int64_t i = 0; i < n; i++) {
        if (labels[i] >= max_classes)
            return tdm_raise(TDM_ERR_FORMAT,
                             OP ": %s: label %d at byte offset %lld (sample %lld) is out of "
                                "range [0, %d)",
                             path, labels[i], (long long)(8 + i), (long long)i, max_classes);
        if (labels[i] > top) top = labels[i];
    }
    *num_classes = top + 1;
    return TDM_OK;
}

/* Reads both files (of the images, the first max_n where 0 < max_n < the count); counts are
 * compared before the (large) image payload is read. */
static idx_impl *idx_load(const char *images_path, const char *labels_path, int max_classes,
                          int64_t max_n, int64_t *n, uint32_t *rows, uint32_t *cols,
                          int64_t *num_classes) {
    idx_reader li, ii;
    uint32_t ldims[1], idims[3];
    uint64_t lbytes = 0, ibytes = 0;
    idx_impl *m = (idx_impl *)calloc(1, sizeof *m);
    if (!m) return tdm_raise_null(TDM_ERR_NOMEM, OP ": out of memory");
    if (reader_open(&li, labels_path)) goto fail_m;
    if (reader_open(&ii, images_path)) goto fail_l;
    if (read_header(&li, 1, "labels", ldims, &lbytes) ||
        read_header(&ii, 3, "images", idims, &ibytes))
        goto fail;
    if (ldims[0] != idims[0]) {
        tdm_raise(TDM_ERR_FORMAT,
                  OP ": count mismatch: %s holds %u images (byte offset 4) but %s holds %u "
                     "labels (byte offset 4)",
                  images_path, idims[0], labels_path, ldims[0]);
        goto fail;
    }
    if (check_claim(&li, lbytes, "labels") || check_claim(&ii, ibytes, "pixels")) goto fail;
    m->labels = read_payload(&li, lbytes, lbytes, "labels");
    if (!m->labels ||
        check_labels(labels_path, m->labels, (int64_t)lbytes, max_classes, num_classes))
        goto fail;
    *n = max_n > 0 && max_n < idims[0] ? max_n : idims[0];
    m->pixels = read_payload(&ii, ibytes, (uint64_t)*n * idims[1] * idims[2], "pixels");
    if (!m->pixels) goto fail;
    reader_close(&ii);
    reader_close(&li);
    m->pixels_per_image = (int64_t)idims[1] * idims[2];
    *rows = idims[1];
    *cols = idims[2];
    return m;
fail:
    reader_close(&ii);
fail_l:
    reader_close(&li);
fail_m:
    idx_free_impl(m);
    return NULL;
}

static tdm_dataset *idx_open(const char *images_path, const char *labels_path, int max_classes,
                             int64_t max_n, const char *name) {
    if (!images_path || !labels_path)
        return tdm_raise_null(TDM_ERR_ARG, OP ": images_path and labels_path must not be NULL");
    int64_t n = 0, num_classes = 0;
    uint32_t rows = 0, cols = 0;
    idx_impl *m =
        idx_load(images_path, labels_path, max_classes, max_n, &n, &rows, &cols, &num_classes);
    if (!m) return NULL;
    tdm_dataset *ds = tdm_ds_new(&idx_ops, m, name ? name : tdm_ds_basename(images_path));
    if (!ds) {
        idx_free_impl(m);
        return NULL;
    }
    ds->n = n;
    ds->sample_shape = TDM_SHAPE(1, (int64_t)rows, (int64_t)cols);
    ds->x_dtype = TDM_F32;
    ds->target_shape = TDM_SHAPE0;
    ds->num_classes = num_classes;
    return ds;
}

tdm_dataset *tdm_idx_dataset_open(const char *images_path, const char *labels_path) {
    return idx_open(images_path, labels_path, 256, 0, NULL);
}

/* ---- Fashion-MNIST ------------------------------------------------------------------------ */

/* dir/stem.gz if it exists, else dir/stem (an unpacked copy). */
static void fashion_path(char *out, size_t size, const char *dir, const char *stem) {
    snprintf(out, size, "%s/%s.gz", dir, stem);
    if (access(out, F_OK) != 0) snprintf(out, size, "%s/%s", dir, stem);
}

tdm_dataset *tdm_fashion_mnist(const char *dir, bool train) {
    return tdm_fashion_mnist_first(dir, train, 0);
}

tdm_dataset *tdm_fashion_mnist_first(const char *dir, bool train, int64_t max_samples) {
    if (!dir) dir = TDM_FASHION_MNIST_DIR;
    const char *split = train ? "train" : "t10k";
    char img[4096], lab[4096], stem[64];
    snprintf(stem, sizeof stem, "%s-images-idx3-ubyte", split);
    fashion_path(img, sizeof img, dir, stem);
    snprintf(stem, sizeof stem, "%s-labels-idx1-ubyte", split);
    fashion_path(lab, sizeof lab, dir, stem);
    tdm_dataset *ds =
        idx_open(img, lab, 10, max_samples, train ? "fashion-mnist/train" : "fashion-mnist/test");
    if (ds) ds->num_classes = 10; /* the ten classes, whatever one split happens to hold */
    return ds;
}
