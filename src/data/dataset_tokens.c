/* llm.c token shards: a header of 256 little-endian int32 (magic 20240520, version 1, token
 * count, the rest unused), then the tokens as little-endian u16. The file is mapped, not
 * copied, and validated once at open (size, header, every token below vocab), so get() only
 * widens T + 1 tokens to i64. Sample i is the window starting at token i*T: x holds tokens
 * [i*T, i*T + T), y the same shifted by one, like llm.c's loader with a stride of T. */
#include "data/dataset_common.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define OP            "tdm_token_dataset_open"
#define SHARD_MAGIC   20240520
#define SHARD_VERSION 1
#define HEADER_BYTES  1024

typedef struct {
    void *map;
    size_t map_size;
    const uint8_t *tokens; /* count little-endian u16 */
    int64_t count;
    int64_t context; /* T */
} token_impl;

static inline int64_t token_at(const uint8_t *p, int64_t k) {
    return (int64_t)((uint32_t)p[2 * k] | (uint32_t)p[2 * k + 1] << 8);
}

static int token_get(const tdm_dataset *ds, int64_t i, void *x, int64_t *y) {
    int rc = tdm_ds_check_index(ds, i);
    if (rc) return rc;
    const token_impl *m = (const token_impl *)ds->impl;
    const int64_t T = m->context;
    const uint8_t *p = m->tokens + 2 * i * T;
    int64_t *restrict out = (int64_t *)x;
    for (int64_t j = 0; j < T; j++) out[j] = token_at(p, j);
    /* y is x shifted by one: reuse it and read only the one token past the window */
    memcpy(y, out + 1, (size_t)(T - 1) * sizeof(int64_t));
    y[T - 1] = token_at(p, T);
    return TDM_OK;
}

static void token_destroy(tdm_dataset *ds) {
    token_impl *m = (token_impl *)ds->impl;
    if (!m) return;
    if (m->map) munmap(m->map, m->map_size);
    free(m);
    ds->impl = NULL;
}

static const tdm_dataset_ops token_ops = {.get = token_get, .destroy = token_destroy};

static int32_t le32(const uint8_t *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                     (uint32_t)p[3] << 24);
}

/* Checks the header against the file size; *count receives the token count. */
static int check_header(const char *path, const uint8_t *h, uint64_t fsize, int64_t *count) {
    int32_t magic = le32(h), version = le32(h + 4), n = le32(h + 8);
    if (magic != SHARD_MAGIC)
        return tdm_raise(TDM_ERR_FORMAT,
                         OP ": %s: wrong magic %d at byte offset 0 (expected %d, an llm.c token "
                            "shard)",
                         path, magic, SHARD_MAGIC);
    if (version != SHARD_VERSION)
        return tdm_raise(TDM_ERR_FORMAT,
                         OP ": %s: unsupported version %d at byte offset 4 (expected %d: u16 "
                            "tokens)",
                         path, version, SHARD_VERSION);
    uint64_t want = HEADER_BYTES + 2 * (uint64_t)(n < 0 ? 0 : n);
    if (n <= 0 || want != fsize)
        return tdm_raise(TDM_ERR_FORMAT,
                         OP ": %s: token count %d at byte offset 8 disagrees with the file size: "
                            "%llu bytes, expected %llu (1024 header bytes + 2 per token)%s",
                         path, n, (unsigned long long)fsize, (unsigned long long)want,
                         fsize < want ? " (truncated)" : "");
    *count = n;
    return TDM_OK;
}

/* Every token must lie below vocab; names the first that does not. */
static int check_tokens(const char *path, const uint8_t *tok, int64_t count, int64_t vocab) {
    if (vocab > 65535) return TDM_OK; /* u16 tokens always fit */
    int64_t top = 0;
    for (int64_t k = 0; k < count; k++) { /* branch-free max: vectorises */
        int64_t t = token_at(tok, k);
        top = t > top ? t : top;
    }
    if (top < vocab) return TDM_OK;
    for (int64_t k = 0; k < count; k++) {
        if (token_at(tok, k) >= vocab)
            return tdm_raise(TDM_ERR_FORMAT,
                             OP ": %s: token %lld at byte offset %lld (token %lld) is >= vocab "
                                "%lld",
                             path, (long long)token_at(tok, k), (long long)(HEADER_BYTES + 2 * k),
                             (long long)k, (long long)vocab);
    }
    return TDM_OK;
}

/* Maps path and validates it; NULL and an error otherwise. */
static token_impl *token_load(const char *path, int64_t context, int64_t vocab) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return tdm_raise_null(TDM_ERR_IO, OP ": cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return tdm_raise_null(TDM_ERR_IO, OP ": %s is not a regular file", path);
    }
    uint64_t fsize = (uint64_t)st.st_size;
    if (fsize < HEADER_BYTES) {
        close(fd);
        return tdm_raise_null(TDM_ERR_FORMAT,
                              OP ": %s: truncated header: the file ends at byte offset %llu, a "
                                 "token shard header has %d bytes",
                              path, (unsigned long long)fsize, HEADER_BYTES);
    }
    void *map = mmap(NULL, (size_t)fsize, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    close(fd); /* the mapping keeps the file */
    if (map == MAP_FAILED)
        return tdm_raise_null(TDM_ERR_IO, OP ": %s: mmap of %llu bytes failed: %s", path,
                              (unsigned long long)fsize, strerror(err));
    const uint8_t *base = (const uint8_t *)map;
    int64_t count = 0;
    if (check_header(path, base, fsize, &count) ||
        check_tokens(path, base + HEADER_BYTES, count, vocab))
        goto fail;
    if (count - 1 < context) {
        tdm_raise(TDM_ERR_FORMAT,
                  OP ": %s: %lld tokens are too few for one window of context %lld (needs %lld)",
                  path, (long long)count, (long long)context, (long long)context + 1);
        goto fail;
    }
    token_impl *m = (token_impl *)calloc(1, sizeof *m);
    if (!m) {
        tdm_raise(TDM_ERR_NOMEM, OP ": out of memory");
        goto fail;
    }
    m->map = map;
    m->map_size = (size_t)fsize;
    m->tokens = base + HEADER_BYTES;
    m->count = count;
    m->context = context;
    return m;
fail:
    munmap(map, (size_t)fsize);
    return NULL;
}

tdm_dataset *tdm_token_dataset_open(const char *path, int64_t context, int64_t vocab) {
    if (!path) return tdm_raise_null(TDM_ERR_ARG, OP ": path is NULL");
    if (context < 1 || context > INT32_MAX)
        return tdm_raise_null(TDM_ERR_ARG, OP ": %s: context must be in [1, 2^31), got %lld", path,
                              (long long)context);
    if (vocab < 1)
        return tdm_raise_null(TDM_ERR_ARG, OP ": %s: vocab must be positive, got %lld", path,
                              (long long)vocab);
    token_impl *m = token_load(path, context, vocab);
    if (!m) return NULL;
    tdm_dataset *ds = tdm_ds_new(&token_ops, m, tdm_ds_basename(path));
    if (!ds) {
        munmap(m->map, m->map_size);
        free(m);
        return NULL;
    }
    ds->n = (m->count - 1) / context;
    ds->sample_shape = TDM_SHAPE(context);
    ds->x_dtype = TDM_I64;
    ds->target_shape = TDM_SHAPE(context);
    ds->num_classes = vocab;
    return ds;
}
