/* Numeric CSV: one sample per line, comma-separated f32 features and one integer label
 * (column label_column, negative from the end), an optional header line. The file is parsed
 * once into a dense [n, F] f32 array; blank lines are skipped, "\r\n" endings accepted.
 * Errors name the file, the line and the column (both 1-based). See docs/FORMATS.md. */
#include "data/dataset_common.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OP        "tdm_csv_dataset_open"
#define FIELD_MAX 63 /* longest numeric field accepted */

typedef struct {
    float *x;   /* [n, features] */
    int64_t *y; /* [n] */
    int64_t features;
} csv_impl;

static int csv_get(const tdm_dataset *ds, int64_t i, void *x, int64_t *y) {
    int rc = tdm_ds_check_index(ds, i);
    if (rc) return rc;
    const csv_impl *m = (const csv_impl *)ds->impl;
    memcpy(x, m->x + i * m->features, (size_t)m->features * sizeof(float));
    *y = m->y[i];
    return TDM_OK;
}

static void csv_free_impl(csv_impl *m) {
    if (!m) return;
    free(m->x);
    free(m->y);
    free(m);
}

static void csv_destroy(tdm_dataset *ds) {
    csv_free_impl((csv_impl *)ds->impl);
    ds->impl = NULL;
}

static const tdm_dataset_ops csv_ops = {.get = csv_get, .destroy = csv_destroy};

/* ---- parsing ------------------------------------------------------------------------------ */

typedef struct {
    const char *path;
    int64_t line;      /* 1-based line number */
    int64_t ncols;     /* fields per line, from the first data line; 0 before it */
    int64_t label_col; /* resolved, in [0, ncols) */
    int label_column;  /* as given */
    csv_impl *m;
    int64_t n, cap; /* rows parsed, rows allocated */
    int64_t max_label;
} csv_parser;

static bool is_blank(char c) {
    return c == ' ' || c == '\t';
}

/* Copies the field [b, e) trimmed of blanks into out (NUL-terminated); false if too long. */
static bool field_text(const char *b, const char *e, char *out) {
    while (b < e && is_blank(*b)) b++;
    while (e > b && is_blank(e[-1])) e--;
    if (e - b > FIELD_MAX) return false;
    memcpy(out, b, (size_t)(e - b));
    out[e - b] = '\0';
    return true;
}

static int bad_field(const csv_parser *p, int64_t col, const char *text, const char *what) {
    return tdm_raise(TDM_ERR_FORMAT, OP ": %s: line %lld, column %lld: '%s' is not %s", p->path,
                     (long long)p->line, (long long)col + 1, text, what);
}

static int parse_feature(const csv_parser *p, int64_t col, const char *b, const char *e,
                         float *out) {
    char buf[FIELD_MAX + 1], *end = NULL;
    if (!field_text(b, e, buf)) return bad_field(p, col, "(a field too long)", "a number");
    errno = 0;
    double v = strtod(buf, &end);
    if (buf[0] == '\0' || *end != '\0') return bad_field(p, col, buf, "a number");
    if (!isfinite(v) || fabs(v) > 3.4028234663852886e38)
        return bad_field(p, col, buf, "a finite f32 number");
    *out = (float)v;
    return TDM_OK;
}

static int parse_label(csv_parser *p, int64_t col, const char *b, const char *e, int64_t *out) {
    char buf[FIELD_MAX + 1], *end = NULL;
    if (!field_text(b, e, buf)) return bad_field(p, col, "(a field too long)", "an integer label");
    errno = 0;
    long long v = strtoll(buf, &end, 10);
    if (buf[0] == '\0' || *end != '\0' || errno == ERANGE)
        return bad_field(p, col, buf, "an integer label");
    if (v < 0 || v >= INT32_MAX)
        return tdm_raise(TDM_ERR_FORMAT,
                         OP ": %s: line %lld, column %lld: label %lld is out of range [0, 2^31)",
                         p->path, (long long)p->line, (long long)col + 1, v);
    *out = v;
    if (v > p->max_label) p->max_label = v;
    return TDM_OK;
}

static int64_t count_fields(const char *b, const char *e) {
    int64_t n = 1;
    for (const char *c = b; c < e; c++) n += *c == ',';
    return n;
}

/* The first data line fixes the column count and resolves the label column. */
static int first_row(csv_parser *p, int64_t ncols) {
    if (ncols < 2)
        return tdm_raise(TDM_ERR_FORMAT,
                         OP ": %s: line %lld has %lld field(s); need at least one feature and a "
                            "label",
                         p->path, (long long)p->line, (long long)ncols);
    int64_t lc = p->label_column < 0 ? ncols + p->label_column : p->label_column;
    if (lc < 0 || lc >= ncols)
        return tdm_raise(TDM_ERR_ARG, OP ": %s: label_column %d is out of range for %lld columns",
                         p->path, p->label_column, (long long)ncols);
    p->ncols = ncols;
    p->label_col = lc;
    p->m->features = ncols - 1;
    return TDM_OK;
}

/* Room for one more row; doubles the arrays (bounded by the rows the file really has). */
static int reserve_row(csv_parser *p) {
    if (p->n < p->cap) return TDM_OK;
    int64_t cap = p->cap ? 2 * p->cap : 64;
    float *x = (float *)realloc(p->m->x, (size_t)cap * (size_t)p->m->features * sizeof(float));
    if (x) p->m->x = x;
    int64_t *y = x ? (int64_t *)realloc(p->m->y, (size_t)cap * sizeof(int64_t)) : NULL;
    if (!y)
        return tdm_raise(TDM_ERR_NOMEM, OP ": %s: cannot grow to %lld rows", p->path,
                         (long long)cap);
    p->m->y = y;
    p->cap = cap;
    return TDM_OK;
}

/* Parses one data line [b, e) (no newline). */
static int parse_row(csv_parser *p, const char *b, const char *e) {
    int64_t ncols = count_fields(b, e);
    if (!p->ncols && first_row(p, ncols)) return tdm_last_status();
    if (ncols != p->ncols)
        return tdm_raise(TDM_ERR_FORMAT,
                         OP ": %s: line %lld has %lld fields, expected %lld like the first data "
                            "line (ragged rows)",
                         p->path, (long long)p->line, (long long)ncols, (long long)p->ncols);
    if (reserve_row(p)) return tdm_last_status();
    float *x = p->m->x + p->n * p->m->features;
    const char *f = b;
    for (int64_t col = 0; col < ncols; col++) {
        const char *fe = memchr(f, ',', (size_t)(e - f));
        if (!fe) fe = e;
        int rc = col == p->label_col ? parse_label(p, col, f, fe, &p->m->y[p->n])
                                     : parse_feature(p, col, f, fe, x++);
        if (rc) return rc;
        f = fe + 1;
    }
    p->n++;
    return TDM_OK;
}

static bool blank_line(const char *b, const char *e) {
    while (b < e && (is_blank(*b) || *b == '\r')) b++;
    return b == e;
}

static int parse_text(csv_parser *p, const char *text, size_t size, bool header) {
    const char *c = text, *end = text + size;
    for (p->line = 1; c < end; p->line++) {
        const char *nl = memchr(c, '\n', (size_t)(end - c));
        const char *le = nl ? nl : end;
        const char *e = le > c && le[-1] == '\r' ? le - 1 : le;
        if (memchr(c, '\0', (size_t)(e - c)))
            return tdm_raise(TDM_ERR_FORMAT, OP ": %s: line %lld contains a NUL byte (binary?)",
                             p->path, (long long)p->line);
        if (!(header && p->line == 1) && !blank_line(c, e) && parse_row(p, c, e))
            return tdm_last_status();
        c = nl ? nl + 1 : end;
    }
    if (p->n == 0)
        return tdm_raise(TDM_ERR_FORMAT, OP ": %s: no data rows%s", p->path,
                         header ? " after the header line" : "");
    return TDM_OK;
}

tdm_dataset *tdm_csv_dataset_open(const char *path, int label_column, bool header) {
    if (!path) return tdm_raise_null(TDM_ERR_ARG, OP ": path is NULL");
    char *text = NULL;
    size_t size = 0;
    if (tdm_ds_read_file(path, OP, &text, &size)) return NULL;
    csv_parser p = {.path = path, .label_column = label_column};
    p.m = (csv_impl *)calloc(1, sizeof *p.m);
    int rc =
        p.m ? parse_text(&p, text, size, header) : tdm_raise(TDM_ERR_NOMEM, OP ": out of memory");
    free(text);
    tdm_dataset *ds = rc ? NULL : tdm_ds_new(&csv_ops, p.m, tdm_ds_basename(path));
    if (!ds) {
        csv_free_impl(p.m);
        return NULL;
    }
    ds->n = p.n;
    ds->sample_shape = TDM_SHAPE(p.m->features);
    ds->x_dtype = TDM_F32;
    ds->target_shape = TDM_SHAPE0;
    ds->num_classes = p.max_label + 1;
    return ds;
}
