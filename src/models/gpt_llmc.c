/* llm.c's model checkpoints (train_gpt2.py's write_model): 256 little-endian int32 of header
 * (magic 20240326, version, maxT, V, L, NH, C, Vp), then every parameter in llm.c's order
 * (tdm_gpt_export_llmc): version 3 as little-endian f32, version 5 (train_gpt2.cu's bf16
 * file) as little-endian bf16, the same layout otherwise. A version 5 file is widened to the
 * f32 model exactly; writing one rounds each parameter to nearest even (half.h, PyTorch's
 * bits). The reader checks the header and the file size before allocating anything, so a
 * hostile header cannot make it allocate more than the file holds. Hosts are assumed
 * little-endian with IEEE floats, as llm.c itself assumes. */
#include "io/io_internal.h"
#include "tandem/gpt.h"
#include "tandem/half.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define LLMC_MAGIC        20240326
#define LLMC_VERSION_FP32 3
#define LLMC_VERSION_BF16 5
#define HEADER_INTS       256
#define HEADER_BYTES      (HEADER_INTS * 4)
/* Sizes past these are no GPT anyone trains on a CPU, and keep every product in int64. */
#define MAX_DIM (1 << 20)

static void put_le32(uint8_t *p, int32_t v) {
    uint32_t u = (uint32_t)v;
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(u >> (8 * i));
}

static int32_t get_le32(const uint8_t *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                     (uint32_t)p[3] << 24);
}

static int write_all(int fd, const void *buf, size_t n, const char *path) {
    const char *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0)
            return tdm_raise(TDM_ERR_IO, "gpt_save_llmc: cannot write '%s': %s", path,
                             strerror(errno));
        p += w, n -= (size_t)w;
    }
    return TDM_OK;
}

/* The temporary file of path with c's header of `version` written, or -1 (raised); tmp its
 * name. */
static int open_with_header(const char *path, const tdm_gpt_config *c, int32_t version, char *tmp,
                            size_t cap) {
    uint8_t header[HEADER_BYTES] = {0};
    int32_t fields[8] = {LLMC_MAGIC, version,  c->context,  c->vocab,
                         c->layers,  c->heads, c->channels, c->padded_vocab};
    for (int i = 0; i < 8; i++) put_le32(header + 4 * i, fields[i]);
    int fd = tdm_io_temp_open(path, tmp, cap);
    if (fd >= 0 && write_all(fd, header, sizeof header, path)) {
        tdm_io_temp_commit(fd, tmp, path, TDM_ERR_IO); /* removes it; the write's error stays */
        return -1;
    }
    return fd;
}

int tdm_gpt_save_llmc_as(const char *path, tdm_module *m, tdm_dtype dt) {
    const tdm_gpt_config *c = tdm_gpt_config_of(m);
    if (!path) return tdm_raise(TDM_ERR_ARG, "gpt_save_llmc: path is NULL");
    if (!c) return tdm_raise(TDM_ERR_ARG, "gpt_save_llmc: %s: the module is not a GPT", path);
    if (dt != TDM_F32 && dt != TDM_BF16)
        return tdm_raise(TDM_ERR_DTYPE,
                         "gpt_save_llmc: %s: llm.c's files hold f32 (version 3) or bf16 "
                         "(version 5), not %s",
                         path, tdm_dtype_valid(dt) ? tdm_dtype_name(dt) : "an unknown dtype");
    int64_t n = tdm_gpt_llmc_numel(c);
    float *params = malloc(sizeof(float) * (size_t)n);
    if (!params) return tdm_raise(TDM_ERR_NOMEM, "gpt_save_llmc: %s: out of memory", path);
    int rc = tdm_gpt_export_llmc(m, false, params, n);
    uint16_t *half = !rc && dt == TDM_BF16 ? malloc(sizeof(uint16_t) * (size_t)n) : NULL;
    if (!rc && dt == TDM_BF16 && !half)
        rc = tdm_raise(TDM_ERR_NOMEM, "gpt_save_llmc: %s: out of memory", path);
    if (half) tdm_bf16_from_f32(half, params, (size_t)n);
    char tmp[4200];
    int32_t version = dt == TDM_BF16 ? LLMC_VERSION_BF16 : LLMC_VERSION_FP32;
    int fd = rc ? -1 : open_with_header(path, c, version, tmp, sizeof tmp);
    if (fd < 0) {
        free(params);
        free(half);
        return rc ? rc : tdm_last_status();
    }
    rc = half ? write_all(fd, half, sizeof(uint16_t) * (size_t)n, path)
              : write_all(fd, params, sizeof(float) * (size_t)n, path);
    free(params);
    free(half);
    return tdm_io_temp_commit(fd, tmp, path, rc);
}

int tdm_gpt_save_llmc(const char *path, tdm_module *m) {
    return tdm_gpt_save_llmc_as(path, m, TDM_F32);
}

/* The index of parameter t in ps, or -1. */
static int param_index(const tdm_paramset *ps, const tdm_tensor *t) {
    for (int i = 0; i < ps->n; i++)
        if (ps->params[i] == t) return i;
    return -1;
}

int tdm_gpt_save_llmc_from(const char *path, tdm_module *m, const char *ckpt) {
    const tdm_gpt_config *c = tdm_gpt_config_of(m);
    if (!path || !ckpt) return tdm_raise(TDM_ERR_ARG, "gpt_save_llmc: path or ckpt is NULL");
    if (!c) return tdm_raise(TDM_ERR_ARG, "gpt_save_llmc: %s: the module is not a GPT", path);
    tdm_paramset *ps = tdm_module_parameters(m);
    int n = tdm_gpt_llmc_tensors(m, NULL, 0);
    tdm_tensor **ts = ps && n > 0 ? malloc(sizeof *ts * (size_t)n) : NULL;
    if (!ts)
        return ps ? tdm_raise(TDM_ERR_NOMEM, "gpt_save_llmc: out of memory") : tdm_last_status();
    tdm_gpt_llmc_tensors(m, ts, n);
    int64_t largest = 0;
    for (int k = 0; k < n; k++) largest = tdm_numel(ts[k]) > largest ? tdm_numel(ts[k]) : largest;
    float *buf = malloc(sizeof(float) * (size_t)largest);
    char tmp[4200];
    int fd = buf ? open_with_header(path, c, LLMC_VERSION_FP32, tmp, sizeof tmp) : -1;
    int rc = !buf     ? tdm_raise(TDM_ERR_NOMEM, "gpt_save_llmc: out of memory")
             : fd < 0 ? tdm_last_status()
                      : TDM_OK;
    for (int k = 0; !rc && k < n; k++) { /* in llm.c's order: the file is written front to back */
        int i = param_index(ps, ts[k]);
        int64_t at = i < 0 ? 0 : ps->offsets[i], len = tdm_numel(ts[k]);
        rc = i < 0 ? tdm_raise(TDM_ERR_STATE, "gpt_save_llmc: a tensor is not a parameter")
                   : tdm_checkpoint_read_params(ckpt, ps, at, at + len, buf);
        if (!rc) rc = write_all(fd, buf, sizeof(float) * (size_t)len, path);
    }
    free(buf);
    free(ts);
    return fd < 0 ? rc : tdm_io_temp_commit(fd, tmp, path, rc);
}

/* The header's config and version (3 or 5), checked field by field (byte offsets name the
 * culprit). */
static int parse_header(const char *path, const uint8_t *h, tdm_gpt_config *c, int *version) {
    static const char *const names[8] = {"magic",  "version",   "max_seq_len", "vocab_size",
                                         "layers", "num_heads", "channels",    "padded_vocab_size"};
    int32_t f[8];
    for (int i = 0; i < 8; i++) f[i] = get_le32(h + 4 * i);
    if (f[0] != LLMC_MAGIC)
        return tdm_raise(TDM_ERR_FORMAT,
                         "gpt_load_llmc: %s: wrong magic %d at byte offset 0 (an llm.c model "
                         "file starts with %d)",
                         path, f[0], LLMC_MAGIC);
    if (f[1] != LLMC_VERSION_FP32 && f[1] != LLMC_VERSION_BF16)
        return tdm_raise(TDM_ERR_FORMAT,
                         "gpt_load_llmc: %s: unsupported version %d at byte offset 4 (expected "
                         "%d, fp32, or %d, bf16)",
                         path, f[1], LLMC_VERSION_FP32, LLMC_VERSION_BF16);
    *version = f[1];
    for (int i = 2; i < 8; i++)
        if (f[i] < 1 || f[i] > MAX_DIM)
            return tdm_raise(TDM_ERR_FORMAT,
                             "gpt_load_llmc: %s: %s %d at byte offset %d is not in [1, %d]", path,
                             names[i], f[i], 4 * i, MAX_DIM);
    *c = (tdm_gpt_config){.context = f[2],
                          .vocab = f[3],
                          .layers = f[4],
                          .heads = f[5],
                          .channels = f[6],
                          .padded_vocab = f[7]};
    if (c->channels % c->heads)
        return tdm_raise(TDM_ERR_FORMAT,
                         "gpt_load_llmc: %s: num_heads %d (byte offset 20) does not divide "
                         "channels %d (byte offset 24)",
                         path, c->heads, c->channels);
    if (c->padded_vocab < c->vocab)
        return tdm_raise(TDM_ERR_FORMAT,
                         "gpt_load_llmc: %s: padded_vocab_size %d (byte offset 28) is smaller "
                         "than vocab_size %d (byte offset 12)",
                         path, c->padded_vocab, c->vocab);
    return TDM_OK;
}

/* Reads exactly n bytes; a short read is a truncated file. */
static int read_exact(FILE *f, void *buf, size_t n, const char *path, long at) {
    if (fread(buf, 1, n, f) == n) return TDM_OK;
    if (ferror(f))
        return tdm_raise(TDM_ERR_IO, "gpt_load_llmc: cannot read '%s': %s", path, strerror(errno));
    return tdm_raise(TDM_ERR_FORMAT, "gpt_load_llmc: %s: truncated: the file ends before byte %ld",
                     path, at + (long)n);
}

/* Opens path, checks header and size; returns the open file positioned at the parameters, *n
 * of them, each of *es bytes (4: f32, 2: bf16). */
static FILE *open_checked(const char *path, tdm_gpt_config *c, int64_t *n, int *es) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return tdm_raise_null(TDM_ERR_IO, "gpt_load_llmc: cannot open '%s': %s", path,
                              strerror(errno));
    struct stat st;
    uint8_t h[HEADER_BYTES];
    int rc = fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)
                 ? tdm_raise(TDM_ERR_IO, "gpt_load_llmc: '%s' is not a regular file", path)
                 : TDM_OK;
    if (!rc && st.st_size < HEADER_BYTES)
        rc = tdm_raise(TDM_ERR_FORMAT,
                       "gpt_load_llmc: %s: truncated header: the file has %lld bytes, the header "
                       "%d",
                       path, (long long)st.st_size, HEADER_BYTES);
    if (!rc) rc = read_exact(f, h, sizeof h, path, 0);
    int version = 0;
    if (!rc) rc = parse_header(path, h, c, &version);
    if (!rc) {
        *n = tdm_gpt_llmc_numel(c);
        *es = version == LLMC_VERSION_BF16 ? 2 : 4;
        bool fits = *n >= 1 && *n <= (INT64_MAX - HEADER_BYTES) / 4;
        long long want = fits ? HEADER_BYTES + (long long)*es * *n : 0;
        if (!fits)
            rc = tdm_raise(TDM_ERR_FORMAT,
                           "gpt_load_llmc: %s: the header's sizes (byte offsets 8..31: %d "
                           "layers of %d channels, vocab %d, context %d) give more parameters "
                           "than a file can hold",
                           path, c->layers, c->channels, c->padded_vocab, c->context);
        else if (st.st_size != want)
            rc = tdm_raise(TDM_ERR_FORMAT,
                           "gpt_load_llmc: %s: %s: the file has %lld bytes, the header's model "
                           "(%lld parameters, %s) needs %lld",
                           path,
                           st.st_size < want ? "truncated"
                                             : "trailing bytes after the "
                                               "parameters",
                           (long long)st.st_size, (long long)*n,
                           version == LLMC_VERSION_BF16 ? "bf16, version 5" : "f32, version 3",
                           want);
    }
    if (rc) {
        fclose(f);
        return NULL;
    }
    return f;
}

int tdm_gpt_llmc_config(const char *path, tdm_gpt_config *cfg) {
    if (!path || !cfg)
        return tdm_raise(TDM_ERR_ARG, "gpt_llmc_config: %s is NULL", path ? "cfg" : "path");
    int64_t n = 0;
    int es = 0;
    FILE *f = open_checked(path, cfg, &n, &es);
    if (!f) return tdm_last_status();
    fclose(f);
    return TDM_OK;
}

tdm_module *tdm_gpt_load_llmc(const char *path, tdm_device dev, tdm_gpt_config *cfg) {
    if (!path) return tdm_raise_null(TDM_ERR_ARG, "gpt_load_llmc: path is NULL");
    tdm_gpt_config c;
    int64_t n = 0;
    int es = 0;
    FILE *f = open_checked(path, &c, &n, &es);
    if (!f) return NULL;
    float *params = malloc(sizeof(float) * (size_t)n);
    uint16_t *half = es == 2 ? malloc(sizeof(uint16_t) * (size_t)n) : NULL;
    void *raw = es == 2 ? (void *)half : (void *)params;
    int rc = params && raw ? read_exact(f, raw, (size_t)es * (size_t)n, path, HEADER_BYTES)
                           : tdm_raise(TDM_ERR_NOMEM, "gpt_load_llmc: %s: out of memory", path);
    fclose(f);
    if (!rc && half) tdm_bf16_to_f32(params, half, (size_t)n); /* exact */
    free(half);
    tdm_module *m = NULL;
    if (!rc) {
        tdm_rng rng = tdm_rng_make(0); /* the draws are overwritten by the file's values */
        m = tdm_gpt_new(&c, dev, &rng);
        if (m && tdm_gpt_import_llmc(m, params, n)) {
            tdm_module_free(m);
            m = NULL;
        }
    }
    free(params);
    if (m && cfg) *cfg = c;
    return m;
}
