/* safetensors: reading with full validation, writing atomically.
 *
 * The layout: u64 little-endian header length N, N bytes of JSON, then the data; each tensor's
 * "data_offsets" [begin, end) count from the first data byte. The header is parsed with
 * jansson (duplicate keys rejected, UTF-8 checked by the parser) and then every claim in it is
 * checked against the file before anything is allocated from it: a header length past the
 * end or of too many JSON values to parse cheaply, a shape whose byte size overflows or disagrees
 * with its offsets, ranges that overlap, leave a gap or run past the data. The rules are those of
 * the reference implementation (huggingface/safetensors, `validate`): sorted by offsets, the ranges
 * tile the data exactly.
 *
 * Tensor data is read on demand with pread (files) or memcpy (memory), into a host buffer of
 * the tensor's validated size, then handed to the destination's backend.
 */
#include "io/io_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/backend.h"
#include "tandem/half.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this reader copies it as is"
#endif

/* The reference implementation's limit: a larger header is refused before reading it. */
#define MAX_HEADER_BYTES (100u << 20)
/* jansson's tree costs up to ~300 bytes a JSON value (an empty object; a tensor's entry is ~12
 * values, ~2 KB), so a 100 MB header of tiny tensors or empty objects would take 2 to 10 GB to
 * parse before any of it is checked. Values are counted first, without building anything, and a
 * header of more than this many is refused: at most ~300 MB to parse. It is ~87,000 tensors
 * (or ~500,000 metadata entries), far more than any file Tandem writes (GPT-2 XL's training
 * state has 1,160 tensors; a llm.c-scale header is ~100 KB, ~10,000 values) or a published
 * model's single file holds (a few thousand tensors). */
#define MAX_HEADER_VALUES (1u << 20)

/* ---- dtypes ------------------------------------------------------------------------------ */

typedef struct {
    const char *name;
    int bytes;
    int tdm; /* tdm_dtype, or -1 when Tandem does not compute in it */
} st_dtype;

static const st_dtype dtypes[] = {
    {"F32", 4, TDM_F32}, {"I32", 4, TDM_I32}, {"I64", 8, TDM_I64}, {"BOOL", 1, -1},
    {"U8", 1, -1},       {"I8", 1, -1},       {"F8_E5M2", 1, -1},  {"F8_E4M3", 1, -1},
    {"I16", 2, -1},      {"U16", 2, -1},      {"F16", 2, TDM_F16}, {"BF16", 2, TDM_BF16},
    {"U32", 4, -1},      {"F64", 8, -1},      {"U64", 8, -1},
};
#define N_DTYPES (int)(sizeof dtypes / sizeof dtypes[0])

static int dtype_find(const char *s) {
    for (int i = 0; i < N_DTYPES; i++)
        if (strcmp(dtypes[i].name, s) == 0) return i;
    return -1;
}

const char *tdm_safetensors_dtype_of(tdm_dtype dt) {
    for (int i = 0; i < N_DTYPES; i++)
        if (dtypes[i].tdm >= 0 && dtypes[i].tdm == (int)dt) return dtypes[i].name;
    return NULL;
}
#define st_name_of tdm_safetensors_dtype_of

/* ---- the opened file ---------------------------------------------------------------------- */

typedef struct {
    char *name;
    int dtype; /* index into dtypes */
    int ndim;
    int64_t shape[TDM_MAX_DIMS];
    uint64_t begin, end; /* within the data */
} entry;

struct tdm_safetensors {
    char what[256];
    int fd;                   /* -1: memory */
    const unsigned char *mem; /* the whole buffer (memory) */
    uint64_t data_start, data_len;
    int n;
    entry *e;
    int n_meta;
    char **meta_key, **meta_val;
};

void tdm_safetensors_close(tdm_safetensors *f) {
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    for (int i = 0; i < f->n; i++) free(f->e[i].name);
    free(f->e);
    for (int i = 0; i < f->n_meta; i++) {
        free(f->meta_key[i]);
        free(f->meta_val[i]);
    }
    free(f->meta_key);
    free(f->meta_val);
    free(f);
}

/* Reads n bytes at offset off of the file (from its start). */
static int read_at(const tdm_safetensors *f, uint64_t off, void *dst, size_t n) {
    if (f->fd < 0) {
        memcpy(dst, f->mem + off, n);
        return TDM_OK;
    }
    size_t done = 0;
    while (done < n) {
        ssize_t r = pread(f->fd, (char *)dst + done, n - done, (off_t)(off + done));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0)
            return tdm_raise(TDM_ERR_IO,
                             "safetensors '%s': cannot read %zu bytes at offset %llu: %s", f->what,
                             n, (unsigned long long)(off + done),
                             r < 0 ? strerror(errno) : "the file is shorter than when opened");
        done += (size_t)r;
    }
    return TDM_OK;
}

/* ---- header validation ------------------------------------------------------------------- */

#define FMT_ERR(f, ...) tdm_raise(TDM_ERR_FORMAT, __VA_ARGS__)

/* A JSON integer in [0, INT64_MAX] into *out. */
static bool get_count(const json_t *v, int64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (int64_t)json_integer_value(v);
    return true;
}

/* Fills e from the JSON object info of tensor `name`. */
static int parse_entry(tdm_safetensors *f, const char *name, const json_t *info, entry *e) {
    if (!json_is_object(info))
        return FMT_ERR(f,
                       "safetensors '%s': tensor '%.200s': expected an object with dtype, "
                       "shape and data_offsets",
                       f->what, name);
    const json_t *dt = json_object_get(info, "dtype"), *shape = json_object_get(info, "shape"),
                 *offs = json_object_get(info, "data_offsets");
    if (!dt || !json_is_string(dt))
        return FMT_ERR(f, "safetensors '%s': tensor '%.200s': %s dtype", f->what, name,
                       dt ? "non-string" : "missing");
    e->dtype = dtype_find(json_string_value(dt));
    if (e->dtype < 0)
        return FMT_ERR(f, "safetensors '%s': tensor '%.200s': unknown dtype '%.40s'", f->what, name,
                       json_string_value(dt));
    if (!shape || !json_is_array(shape))
        return FMT_ERR(f, "safetensors '%s': tensor '%.200s': %s shape", f->what, name,
                       shape ? "non-array" : "missing");
    size_t nd = json_array_size(shape);
    if (nd > TDM_MAX_DIMS)
        return FMT_ERR(f,
                       "safetensors '%s': tensor '%.200s' has %zu dims; Tandem supports at "
                       "most %d",
                       f->what, name, nd, TDM_MAX_DIMS);
    e->ndim = (int)nd;
    /* bytes = numel * dtype size, refused when it overflows */
    uint64_t bytes = (uint64_t)dtypes[e->dtype].bytes;
    bool overflow = false;
    for (size_t i = 0; i < nd; i++) {
        if (!get_count(json_array_get(shape, i), &e->shape[i]))
            return FMT_ERR(f,
                           "safetensors '%s': tensor '%.200s': shape entry %zu is not a "
                           "non-negative integer",
                           f->what, name, i);
        uint64_t d = (uint64_t)e->shape[i];
        if (d != 0 && bytes > UINT64_MAX / d) overflow = true;
        bytes = overflow ? 0 : bytes * d;
    }
    int64_t b, en;
    if (!offs || !json_is_array(offs) || json_array_size(offs) != 2 ||
        !get_count(json_array_get(offs, 0), &b) || !get_count(json_array_get(offs, 1), &en))
        return FMT_ERR(f,
                       "safetensors '%s': tensor '%.200s': data_offsets must be [begin, end] "
                       "of non-negative integers",
                       f->what, name);
    e->begin = (uint64_t)b;
    e->end = (uint64_t)en;
    if (e->end < e->begin)
        return FMT_ERR(f,
                       "safetensors '%s': tensor '%.200s': data_offsets [%llu, %llu] end "
                       "before they begin",
                       f->what, name, (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end > f->data_len)
        return FMT_ERR(f,
                       "safetensors '%s': tensor '%.200s': data_offsets [%llu, %llu] run past "
                       "the %llu bytes of data",
                       f->what, name, (unsigned long long)e->begin, (unsigned long long)e->end,
                       (unsigned long long)f->data_len);
    if (overflow || bytes != e->end - e->begin) {
        char s[96];
        tdm_shape sh = {e->ndim, {0}};
        memcpy(sh.d, e->shape, sizeof e->shape);
        if (overflow)
            return FMT_ERR(f, "safetensors '%s': tensor '%.200s': shape %s of %s is too large",
                           f->what, name, tdm_shape_str(sh, s), dtypes[e->dtype].name);
        return FMT_ERR(f,
                       "safetensors '%s': tensor '%.200s': shape %s of %s needs %llu bytes, "
                       "data_offsets [%llu, %llu] hold %llu",
                       f->what, name, tdm_shape_str(sh, s), dtypes[e->dtype].name,
                       (unsigned long long)bytes, (unsigned long long)e->begin,
                       (unsigned long long)e->end, (unsigned long long)(e->end - e->begin));
    }
    if (!(e->name = strdup(name)))
        return tdm_raise(TDM_ERR_NOMEM, "safetensors '%s': out of memory", f->what);
    return TDM_OK;
}

static int parse_metadata(tdm_safetensors *f, const json_t *meta) {
    if (!json_is_object(meta))
        return FMT_ERR(f, "safetensors '%s': __metadata__ must be an object of strings", f->what);
    size_t n = json_object_size(meta);
    f->meta_key = calloc(n ? n : 1, sizeof *f->meta_key);
    f->meta_val = calloc(n ? n : 1, sizeof *f->meta_val);
    if (!f->meta_key || !f->meta_val)
        return tdm_raise(TDM_ERR_NOMEM, "safetensors '%s': out of memory", f->what);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)meta, k, v) {
        if (!json_is_string(v))
            return FMT_ERR(f, "safetensors '%s': __metadata__ value of '%.200s' is not a string",
                           f->what, k);
        f->meta_key[f->n_meta] = strdup(k);
        f->meta_val[f->n_meta] = strdup(json_string_value(v));
        f->n_meta++;
        if (!f->meta_key[f->n_meta - 1] || !f->meta_val[f->n_meta - 1])
            return tdm_raise(TDM_ERR_NOMEM, "safetensors '%s': out of memory", f->what);
    }
    return TDM_OK;
}

static int by_offsets(const void *a, const void *b) {
    const entry *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* Sorted by offsets, the ranges must tile [0, data_len) exactly. */
static int check_tiling(tdm_safetensors *f) {
    qsort(f->e, (size_t)f->n, sizeof *f->e, by_offsets);
    uint64_t at = 0;
    for (int i = 0; i < f->n; i++) {
        const entry *e = &f->e[i];
        if (e->begin < at)
            return FMT_ERR(f,
                           "safetensors '%s': tensors '%.200s' and '%.200s' overlap (bytes "
                           "[%llu, %llu) and [%llu, %llu))",
                           f->what, f->e[i - 1].name, e->name,
                           (unsigned long long)f->e[i - 1].begin, (unsigned long long)at,
                           (unsigned long long)e->begin, (unsigned long long)e->end);
        if (e->begin > at)
            return FMT_ERR(f,
                           "safetensors '%s': data bytes [%llu, %llu) before tensor '%.200s' "
                           "belong to no tensor",
                           f->what, (unsigned long long)at, (unsigned long long)e->begin, e->name);
        at = e->end;
    }
    if (at != f->data_len)
        return FMT_ERR(f,
                       "safetensors '%s': data bytes [%llu, %llu) at the end belong to no "
                       "tensor",
                       f->what, (unsigned long long)at, (unsigned long long)f->data_len);
    return TDM_OK;
}

/* An upper bound on the JSON values of text[0..len) (each but the first follows a ',', ':', '['
 * or '{' outside strings), counted without allocating; stops once past limit. */
static size_t json_values_bound(const char *text, size_t len, size_t limit) {
    size_t n = 1;
    bool in_string = false;
    for (size_t i = 0; i < len && n <= limit; i++) {
        char c = text[i];
        if (in_string && c == '\\')
            i++; /* the escaped character */
        else if (in_string)
            in_string = c != '"';
        else
            in_string = c == '"', n += c == ',' || c == ':' || c == '[' || c == '{';
    }
    return n;
}

static int parse_header(tdm_safetensors *f, const char *text, size_t len) {
    if (json_values_bound(text, len, MAX_HEADER_VALUES) > MAX_HEADER_VALUES)
        return FMT_ERR(f,
                       "safetensors '%s': the %zu-byte header holds more than %u JSON values "
                       "(the limit: about 87,000 tensors)",
                       f->what, len, MAX_HEADER_VALUES);
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return FMT_ERR(f, "safetensors '%s': the header is not valid JSON: %s (header byte %d)",
                       f->what, jerr.text, jerr.position);
    int rc = TDM_OK;
    if (!json_is_object(root)) {
        rc = FMT_ERR(f, "safetensors '%s': the header is not a JSON object", f->what);
        goto done;
    }
    size_t n = json_object_size(root);
    f->e = calloc(n ? n : 1, sizeof *f->e); /* n <= header bytes / 2: justified by the file */
    if (!f->e) {
        rc =
            tdm_raise(TDM_ERR_NOMEM, "safetensors '%s': out of memory for %zu entries", f->what, n);
        goto done;
    }
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v) {
        if (strcmp(k, "__metadata__") == 0)
            rc = parse_metadata(f, v);
        else if ((rc = parse_entry(f, k, v, &f->e[f->n])) == TDM_OK)
            f->n++;
        if (rc) goto done;
    }
    rc = check_tiling(f);
done:
    json_decref(root);
    return rc;
}

/* Validates the layout of a file or buffer of size bytes whose first 8 bytes are hdr8. */
static int check_header_length(tdm_safetensors *f, const unsigned char *hdr8, uint64_t size,
                               uint64_t *hlen) {
    if (size < 8)
        return FMT_ERR(f, "safetensors '%s': %llu bytes, too short for the 8-byte header length",
                       f->what, (unsigned long long)size);
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--) h = h << 8 | hdr8[i];
    if (h > size - 8)
        return FMT_ERR(f,
                       "safetensors '%s': header length %llu is larger than the %llu bytes "
                       "after it (truncated file?)",
                       f->what, (unsigned long long)h, (unsigned long long)(size - 8));
    if (h > MAX_HEADER_BYTES)
        return FMT_ERR(f, "safetensors '%s': header length %llu exceeds the %u-byte limit", f->what,
                       (unsigned long long)h, MAX_HEADER_BYTES);
    if (h < 2)
        return FMT_ERR(f, "safetensors '%s': header length %llu is too short for a JSON object",
                       f->what, (unsigned long long)h);
    *hlen = h;
    f->data_start = 8 + h;
    f->data_len = size - 8 - h;
    return TDM_OK;
}

static tdm_safetensors *new_file(const char *what) {
    tdm_safetensors *f = calloc(1, sizeof *f);
    if (!f) return tdm_raise_null(TDM_ERR_NOMEM, "safetensors: out of memory");
    f->fd = -1;
    snprintf(f->what, sizeof f->what, "%s", what ? what : "(memory)");
    return f;
}

tdm_safetensors *tdm_safetensors_open_memory(const void *data, size_t n, const char *what) {
    if (!data && n) return tdm_raise_null(TDM_ERR_ARG, "safetensors_open_memory: NULL data");
    tdm_safetensors *f = new_file(what);
    if (!f) return NULL;
    f->mem = data;
    uint64_t hlen = 0;
    if (check_header_length(f, data, n, &hlen) ||
        parse_header(f, (const char *)f->mem + 8, (size_t)hlen)) {
        tdm_safetensors_close(f);
        return NULL;
    }
    return f;
}

tdm_safetensors *tdm_safetensors_open(const char *path) {
    if (!path) return tdm_raise_null(TDM_ERR_ARG, "safetensors_open: NULL path");
    tdm_safetensors *f = new_file(path);
    if (!f) return NULL;
    struct stat st;
    unsigned char hdr8[8];
    uint64_t hlen = 0;
    char *text = NULL;
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0 || fstat(f->fd, &st) != 0) {
        tdm_raise(TDM_ERR_IO, "safetensors '%s': cannot open: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        tdm_raise(TDM_ERR_IO, "safetensors '%s': not a regular file", path);
        goto fail;
    }
    uint64_t size = (uint64_t)st.st_size;
    if ((size >= 8 && read_at(f, 0, hdr8, 8)) || check_header_length(f, hdr8, size, &hlen))
        goto fail;
    /* hlen <= the file's size and MAX_HEADER_BYTES: the allocation is justified */
    if (!(text = malloc((size_t)hlen))) {
        tdm_raise(TDM_ERR_NOMEM, "safetensors '%s': out of memory for a %llu-byte header", path,
                  (unsigned long long)hlen);
        goto fail;
    }
    if (read_at(f, 8, text, (size_t)hlen) || parse_header(f, text, (size_t)hlen)) goto fail;
    free(text);
    return f;
fail:
    free(text);
    tdm_safetensors_close(f);
    return NULL;
}

/* ---- queries ----------------------------------------------------------------------------- */

int tdm_safetensors_count(const tdm_safetensors *f) {
    return f ? f->n : 0;
}

const char *tdm_safetensors_name(const tdm_safetensors *f, int i) {
    return f && i >= 0 && i < f->n ? f->e[i].name : NULL;
}

int tdm_safetensors_find(const tdm_safetensors *f, const char *name) {
    if (!f || !name) return -1;
    for (int i = 0; i < f->n; i++)
        if (strcmp(f->e[i].name, name) == 0) return i;
    return -1;
}

const char *tdm_safetensors_dtype(const tdm_safetensors *f, int i) {
    return f && i >= 0 && i < f->n ? dtypes[f->e[i].dtype].name : NULL;
}

tdm_shape tdm_safetensors_shape(const tdm_safetensors *f, int i) {
    tdm_shape s = {0, {0}};
    if (!f || i < 0 || i >= f->n) return s;
    s.ndim = f->e[i].ndim;
    memcpy(s.d, f->e[i].shape, sizeof s.d);
    return s;
}

int tdm_safetensors_tdm_dtype(const tdm_safetensors *f, int i, tdm_dtype *dt) {
    if (!f || i < 0 || i >= f->n || !dt)
        return tdm_raise(TDM_ERR_ARG, "safetensors_tdm_dtype: no tensor %d", i);
    int t = dtypes[f->e[i].dtype].tdm;
    if (t < 0)
        return tdm_raise(TDM_ERR_DTYPE,
                         "safetensors '%s': tensor '%.200s' is %s; Tandem reads F32, BF16, F16, "
                         "I32 and I64",
                         f->what, f->e[i].name, dtypes[f->e[i].dtype].name);
    *dt = (tdm_dtype)t;
    return TDM_OK;
}

const char *tdm_safetensors_meta(const tdm_safetensors *f, const char *key) {
    if (!f || !key) return NULL;
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_key[i], key) == 0) return f->meta_val[i];
    return NULL;
}

int tdm_safetensors_what(const tdm_safetensors *f, char *buf, size_t cap) {
    return snprintf(buf, cap, "%s", f ? f->what : "");
}

/* ---- reading tensors --------------------------------------------------------------------- */

int tdm_safetensors_check(const tdm_safetensors *f, int i, const tdm_tensor *dst) {
    tdm_dtype dt = TDM_F32; /* set by tdm_safetensors_tdm_dtype (GCC cannot tell) */
    int rc = tdm_safetensors_tdm_dtype(f, i, &dt);
    if (rc) return rc;
    char a[96], b[96];
    tdm_shape s = tdm_safetensors_shape(f, i);
    if (s.ndim != dst->ndim || memcmp(s.d, dst->shape, sizeof(int64_t) * (size_t)s.ndim) != 0)
        return tdm_raise(TDM_ERR_SHAPE,
                         "safetensors '%s': tensor '%.200s' has shape %s, expected %s", f->what,
                         f->e[i].name, tdm_shape_str(s, a), tdm_shape_str(tdm_shape_of(dst), b));
    if (dt != dst->dtype && !(tdm_dtype_is_float(dt) && tdm_dtype_is_float(dst->dtype)))
        return tdm_raise(TDM_ERR_DTYPE, "safetensors '%s': tensor '%.200s' is %s, expected %s",
                         f->what, f->e[i].name, dtypes[f->e[i].dtype].name,
                         st_name_of(dst->dtype) ? st_name_of(dst->dtype) : "?");
    return TDM_OK;
}

/* Replaces *host, n bytes of `from` values, with a new buffer of the same values as `to` (two
 * float dtypes), rounding to nearest even where `to` is narrower (half.h). */
static int convert_host(void **host, tdm_dtype from, tdm_dtype to, size_t n, const char *what,
                        const char *name) {
    size_t count = n / tdm_dtype_size(from);
    float *f32 = from == TDM_F32 ? *host : malloc(count * sizeof(float));
    void *out = to == TDM_F32 ? (void *)f32 : malloc(count * tdm_dtype_size(to));
    if (!f32 || !out) {
        if (f32 != *host) free(f32);
        return tdm_raise(TDM_ERR_NOMEM,
                         "safetensors '%s': out of memory converting tensor '%.200s' to %s", what,
                         name, tdm_dtype_name(to));
    }
    if (from == TDM_BF16) tdm_bf16_to_f32(f32, *host, count);
    if (from == TDM_F16) tdm_f16_to_f32(f32, *host, count);
    if (to == TDM_BF16) tdm_bf16_from_f32(out, f32, count);
    if (to == TDM_F16) tdm_f16_from_f32(out, f32, count);
    if (f32 != *host && f32 != out) free(f32);
    if (out != *host) free(*host);
    *host = out;
    return TDM_OK;
}

int tdm_safetensors_read(tdm_safetensors *f, const char *name, tdm_tensor *dst) {
    if (!f || !name || !dst) return tdm_raise(TDM_ERR_ARG, "safetensors_read: NULL argument");
    int i = tdm_safetensors_find(f, name);
    if (i < 0)
        return tdm_raise(TDM_ERR_ARG, "safetensors '%s': no tensor named '%.200s'", f->what, name);
    int rc = tdm_safetensors_check(f, i, dst);
    if (rc) return rc;
    const entry *e = &f->e[i];
    size_t n = (size_t)(e->end - e->begin);
    if (n == 0) return TDM_OK;
    const tdm_backend *be = tdm_backend_for(dst->device);
    if (!be) return tdm_last_status();
    void *host = malloc(n); /* n was checked against the file's size */
    if (!host)
        return tdm_raise(TDM_ERR_NOMEM,
                         "safetensors '%s': out of memory for tensor '%.200s' (%zu "
                         "bytes)",
                         f->what, name, n);
    rc = read_at(f, f->data_start + e->begin, host, n);
    tdm_dtype from = (tdm_dtype)dtypes[e->dtype].tdm;
    if (!rc && from != dst->dtype) rc = convert_host(&host, from, dst->dtype, n, f->what, name);
    if (!rc) rc = be->from_host(dst, host);
    free(host);
    return rc;
}

tdm_tensor *tdm_safetensors_load(tdm_safetensors *f, const char *name, tdm_device dev) {
    if (!f || !name) return tdm_raise_null(TDM_ERR_ARG, "safetensors_load: NULL argument");
    int i = tdm_safetensors_find(f, name);
    if (i < 0)
        return tdm_raise_null(TDM_ERR_ARG, "safetensors '%s': no tensor named '%.200s'", f->what,
                              name);
    tdm_dtype dt = TDM_F32; /* set by tdm_safetensors_tdm_dtype (GCC cannot tell) */
    if (tdm_safetensors_tdm_dtype(f, i, &dt)) return NULL;
    tdm_tensor *t = tdm_empty(tdm_safetensors_shape(f, i), dt, dev);
    if (!t) return NULL;
    if (tdm_safetensors_read(f, name, t)) {
        if (!tdm_book(t)->owner) tdm_tensor_free(t);
        return NULL;
    }
    return t;
}

/* ---- writing ----------------------------------------------------------------------------- */

static int check_inputs(const tdm_named_tensor *ts, int n, const tdm_meta *meta, int n_meta,
                        const char *path) {
    if (n < 0 || (n > 0 && !ts) || n_meta < 0 || (n_meta > 0 && !meta))
        return tdm_raise(TDM_ERR_ARG, "safetensors_save '%s': NULL or negative tensor list", path);
    for (int i = 0; i < n; i++) {
        if (!ts[i].name || !ts[i].tensor)
            return tdm_raise(TDM_ERR_ARG, "safetensors_save '%s': entry %d has a NULL %s", path, i,
                             ts[i].name ? "tensor" : "name");
        if (strcmp(ts[i].name, "__metadata__") == 0)
            return tdm_raise(TDM_ERR_ARG, "safetensors_save '%s': '__metadata__' is reserved",
                             path);
        if (!st_name_of(ts[i].tensor->dtype))
            return tdm_raise(TDM_ERR_DTYPE,
                             "safetensors_save '%s': tensor '%.200s' has an "
                             "unknown dtype",
                             path, ts[i].name);
        for (int j = 0; j < i; j++)
            if (strcmp(ts[i].name, ts[j].name) == 0)
                return tdm_raise(TDM_ERR_ARG,
                                 "safetensors_save '%s': tensor name '%.200s' is "
                                 "used twice",
                                 path, ts[i].name);
    }
    for (int i = 0; i < n_meta; i++)
        if (!meta[i].key || !meta[i].value)
            return tdm_raise(TDM_ERR_ARG, "safetensors_save '%s': metadata entry %d is NULL", path,
                             i);
    return TDM_OK;
}

/* The header JSON, padded with spaces to a multiple of 8 bytes; *len receives its length.
 * The caller frees. */
static char *build_header(const tdm_named_tensor *ts, int n, const tdm_meta *meta, int n_meta,
                          const char *path, size_t *len) {
    json_t *root = json_object();
    json_t *m = n_meta ? json_object() : NULL;
    bool ok = root && (!n_meta || m);
    for (int i = 0; ok && i < n_meta; i++) {
        json_t *v = json_string(meta[i].value);
        ok = v && json_object_set_new(m, meta[i].key, v) == 0;
        if (!ok)
            tdm_raise(TDM_ERR_ARG,
                      "safetensors_save '%s': metadata '%.200s' is not valid "
                      "UTF-8",
                      path, meta[i].key);
    }
    if (ok && m) ok = json_object_set_new(root, "__metadata__", m) == 0, m = NULL;
    uint64_t off = 0;
    for (int i = 0; ok && i < n; i++) {
        const tdm_tensor *t = ts[i].tensor;
        json_t *shape = json_array();
        for (int d = 0; shape && d < t->ndim; d++)
            json_array_append_new(shape, json_integer(t->shape[d]));
        uint64_t bytes = (uint64_t)tdm_numel(t) * tdm_dtype_size(t->dtype);
        json_t *info = json_pack("{s:s, s:o, s:[I, I]}", "dtype", st_name_of(t->dtype), "shape",
                                 shape, "data_offsets", (json_int_t)off, (json_int_t)(off + bytes));
        off += bytes;
        ok = info && json_object_set_new(root, ts[i].name, info) == 0;
        if (!ok)
            tdm_raise(TDM_ERR_ARG,
                      "safetensors_save '%s': tensor name '%.200s' is not "
                      "valid UTF-8",
                      path, ts[i].name);
    }
    json_decref(m);
    char *text = ok ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (!text) {
        if (ok) tdm_raise(TDM_ERR_NOMEM, "safetensors_save '%s': out of memory", path);
        return NULL;
    }
    size_t l = strlen(text), padded = (l + 7) / 8 * 8;
    char *out = realloc(text, padded + 1);
    if (!out) {
        free(text);
        tdm_raise(TDM_ERR_NOMEM, "safetensors_save '%s': out of memory", path);
        return NULL;
    }
    memset(out + l, ' ', padded - l);
    out[padded] = '\0';
    *len = padded;
    return out;
}

int tdm_io_write_all(int fd, const void *p, size_t n, const char *path) {
    size_t done = 0;
    while (done < n) {
        ssize_t w = tdm_io_fault() ? -1 : write(fd, (const char *)p + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return tdm_raise(TDM_ERR_IO, "cannot write '%s': %s", path, strerror(errno));
        done += (size_t)w;
    }
    return TDM_OK;
}

/* Writes the tensors' bytes one after the other through a buffer as large as the largest. */
static int write_data(int fd, const tdm_named_tensor *ts, int n, const char *path) {
    size_t cap = 0;
    for (int i = 0; i < n; i++) {
        size_t b = (size_t)tdm_numel(ts[i].tensor) * tdm_dtype_size(ts[i].tensor->dtype);
        if (b > cap) cap = b;
    }
    void *buf = cap ? malloc(cap) : NULL;
    if (cap && !buf)
        return tdm_raise(TDM_ERR_NOMEM, "safetensors_save '%s': out of memory (%zu bytes)", path,
                         cap);
    int rc = TDM_OK;
    for (int i = 0; i < n && !rc; i++) {
        size_t b = (size_t)tdm_numel(ts[i].tensor) * tdm_dtype_size(ts[i].tensor->dtype);
        if (b == 0) continue;
        rc = tdm_to_host(ts[i].tensor, buf, b);
        if (!rc) rc = tdm_io_write_all(fd, buf, b, path);
    }
    free(buf);
    return rc;
}

int tdm_safetensors_save(const char *path, const tdm_named_tensor *ts, int n, const tdm_meta *meta,
                         int n_meta) {
    if (!path) return tdm_raise(TDM_ERR_ARG, "safetensors_save: NULL path");
    int rc = check_inputs(ts, n, meta, n_meta, path);
    if (rc) return rc;
    /* 8-byte dtypes first, then 4-byte, then 2-byte ones (each group in the caller's order),
     * as the reference writer orders by alignment, so every tensor's data is aligned to its
     * element size */
    tdm_named_tensor *sorted = malloc(sizeof *sorted * (size_t)(n ? n : 1));
    if (!sorted) return tdm_raise(TDM_ERR_NOMEM, "safetensors_save '%s': out of memory", path);
    int k = 0;
    for (size_t size = 8; size >= 2; size /= 2)
        for (int i = 0; i < n; i++)
            if (tdm_dtype_size(ts[i].tensor->dtype) == size) sorted[k++] = ts[i];
    ts = sorted;
    size_t hlen = 0;
    char *header = build_header(ts, n, meta, n_meta, path, &hlen);
    if (!header) {
        free(sorted);
        return tdm_last_status() ? tdm_last_status() : TDM_ERR_NOMEM;
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    char tmp[4096];
    int fd = tdm_io_temp_open(path, tmp, sizeof tmp);
    if (fd < 0) {
        free(header);
        free(sorted);
        return tdm_last_status();
    }
    rc = tdm_io_write_all(fd, len8, 8, path);
    if (!rc) rc = tdm_io_write_all(fd, header, hlen, path);
    if (!rc) rc = write_data(fd, ts, n, path);
    free(header);
    free(sorted);
    return tdm_io_temp_commit(fd, tmp, path, rc);
}

int tdm_safetensors_read_bytes(tdm_safetensors *f, const char *name, uint64_t at, size_t n_bytes,
                               void *dst) {
    int i = tdm_safetensors_find(f, name);
    if (i < 0)
        return tdm_raise(TDM_ERR_ARG, "safetensors '%s': no tensor named '%.200s'", f->what, name);
    const entry *e = &f->e[i];
    if (at > e->end - e->begin || n_bytes > e->end - e->begin - at)
        return tdm_raise(TDM_ERR_ARG, "safetensors '%s': bytes [%llu, %llu) are outside '%.200s'",
                         f->what, (unsigned long long)at, (unsigned long long)(at + n_bytes), name);
    return n_bytes ? read_at(f, f->data_start + e->begin + at, dst, n_bytes) : TDM_OK;
}

int tdm_safetensors_meta_count(const tdm_safetensors *f) {
    return f->n_meta;
}

void tdm_safetensors_meta_at(const tdm_safetensors *f, int i, const char **key, const char **val) {
    *key = f->meta_key[i], *val = f->meta_val[i];
}
