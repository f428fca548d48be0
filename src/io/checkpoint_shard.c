/* Sharded checkpoints (ZeRO): each process writes its range of the flat parameter buffer and
 * of the optimizer state into its own shard file, rank 0 the layout, the buffers and the
 * training state; loading gives each process its range from whichever shard files cover it,
 * on any number of processes; export makes the whole model (and state) again. The format is
 * described in tandem/io.h. No process ever holds more than its range, but for export. */
#include "io/io_internal.h"
#include "backend/backend.h"
#include "optim/shard.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_STATE 3
#define LAYOUT    "layout.safetensors"
#define BUFFERS   "buffers.safetensors"

static void shard_path(char *out, size_t cap, const char *dir, int rank, int world) {
    snprintf(out, cap, "%s/shard-%05d-of-%05d.safetensors", dir, rank, world);
}

static void tmp_dir(char *out, size_t cap, const char *dir, int64_t step) {
    snprintf(out, cap, "%s/.ckpt-%010" PRId64 ".tmp", dir, step);
}

/* The parameters of flat range [lo, hi) this process saves or loads: a view of ps->flat, which
 * under ZeRO stages 1 and 2 holds every parameter on every rank, or under stage 3 of the
 * shard the optimizer updates (tdm_optim_params), which holds [lo, hi) itself. */
static tdm_tensor *params_of_range(tdm_paramset *ps, const tdm_optim *o, int64_t lo, int64_t hi) {
    int64_t at = 0, shape[1] = {hi - lo}, strides[1] = {1};
    const tdm_tensor *src = o ? tdm_optim_params(o, &at) : ps->flat;
    return tdm_tensor_view(src, 1, shape, strides, src->offset + lo - at);
}

/* ---- saving ------------------------------------------------------------------------------- */

int tdm_checkpoint_shard_begin(const char *dir, const tdm_train_state *s) {
    char tmp[4096];
    return tdm_ckpt_prepare(dir, s, tmp, sizeof tmp);
}

/* The save's range: the optimizer's shard (the whole buffer when it is not sharded). */
static int save_range(const tdm_train_state *s, tdm_paramset **ps, int64_t *lo, int64_t *hi) {
    if (!s || !s->model || !s->optim)
        return tdm_raise(TDM_ERR_ARG, "checkpoint_shard: needs the model and its optimizer");
    if (!(*ps = tdm_module_parameters(s->model))) return tdm_last_status();
    *lo = 0, *hi = (*ps)->total;
    return tdm_optim_shard_range(s->optim, lo, hi);
}

int tdm_checkpoint_shard_write(const char *dir, const tdm_train_state *s, int rank, int world) {
    tdm_paramset *ps = NULL;
    int64_t lo = 0, hi = 0;
    int rc = save_range(s, &ps, &lo, &hi);
    if (rc) return rc;
    char tmp[4096], path[4200], keys[MAX_STATE][80], v[6][32];
    tmp_dir(tmp, sizeof tmp, dir, s->step);
    shard_path(path, sizeof path, tmp, rank, world);
    const char *snames[MAX_STATE];
    tdm_tensor *st[MAX_STATE];
    int ns = tdm_optim_state(s->optim, snames, st, MAX_STATE);
    if ((rc = tdm_scope_begin())) return rc;
    tdm_named_tensor ts[1 + MAX_STATE] = {{"params", params_of_range(ps, s->optim, lo, hi)}};
    for (int i = 0; i < ns; i++) {
        snprintf(keys[i], sizeof keys[i], "optim.%s", snames[i]);
        ts[1 + i] = (tdm_named_tensor){keys[i], st[i]}; /* [hi - lo] once sharded */
    }
    snprintf(v[0], 32, "%d", rank), snprintf(v[1], 32, "%d", world);
    snprintf(v[2], 32, "%" PRId64, lo), snprintf(v[3], 32, "%" PRId64, hi);
    snprintf(v[4], 32, "%" PRId64, ps->total);
    tdm_meta meta[6] = {{"tandem.shard", "1"}, {"shard.rank", v[0]}, {"shard.world", v[1]},
                        {"shard.lo", v[2]},    {"shard.hi", v[3]},   {"shard.total", v[4]}};
    rc = ts[0].tensor ? tdm_safetensors_save(path, ts, 1 + ns, meta, 6) : tdm_last_status();
    tdm_scope_end();
    return rc;
}

/* layout.safetensors into directory tmp (format: tandem/io.h). */
static int write_layout(const char *tmp, const tdm_train_state *s, const int64_t *ranges,
                        int world) {
    tdm_paramset *ps = tdm_module_parameters(s->model);
    if (!ps) return tdm_last_status();
    int n_meta = 7 + ps->n + world, k = 0, rc = TDM_OK;
    tdm_meta *meta = calloc((size_t)n_meta, sizeof *meta);
    char **store = calloc((size_t)n_meta * 2, sizeof *store);
    if (!meta || !store) rc = tdm_raise(TDM_ERR_NOMEM, "checkpoint layout: out of memory");
    const char *snames[MAX_STATE];
    tdm_tensor *st[MAX_STATE];
    int ns = tdm_optim_state(s->optim, snames, st, MAX_STATE);
    char states[128] = "", num[3][32];
    for (int i = 0; i < ns; i++)
        snprintf(states + strlen(states), sizeof states - strlen(states), "%s%s", i ? "," : "",
                 snames[i]);
    snprintf(num[0], 32, "%d", world), snprintf(num[1], 32, "%" PRId64, ps->total);
    snprintf(num[2], 32, "%d", ps->n);
    if (!rc) {
        meta[k++] = (tdm_meta){"tandem.sharded", "1"}, meta[k++] = (tdm_meta){"world", num[0]};
        meta[k++] = (tdm_meta){"total", num[1]}, meta[k++] = (tdm_meta){"params", num[2]};
        meta[k++] = (tdm_meta){"optim.kind", tdm_optim_kind(s->optim)};
        meta[k++] = (tdm_meta){"optim.states", states};
    }
    for (int i = 0; !rc && i < ps->n + world; i++) {
        char key[64], val[512];
        if (i < ps->n) {
            const tdm_tensor *p = ps->params[i];
            int len = snprintf(val, sizeof val, "%" PRId64 " %d", ps->offsets[i], p->ndim);
            for (int d = 0; d < p->ndim; d++)
                len += snprintf(val + len, sizeof val - (size_t)len, " %" PRId64, p->shape[d]);
            snprintf(val + len, sizeof val - (size_t)len, " %s", ps->names[i]);
            snprintf(key, sizeof key, "param.%d", i);
        } else {
            int r = i - ps->n;
            snprintf(val, sizeof val, "%" PRId64 " %" PRId64, ranges[2 * r], ranges[2 * r + 1]);
            snprintf(key, sizeof key, "rank.%d", r);
        }
        store[2 * i] = strdup(key), store[2 * i + 1] = strdup(val);
        if (!store[2 * i] || !store[2 * i + 1])
            rc = tdm_raise(TDM_ERR_NOMEM, "checkpoint layout: out of memory");
        else
            meta[k++] = (tdm_meta){store[2 * i], store[2 * i + 1]};
    }
    char path[4200];
    snprintf(path, sizeof path, "%s/" LAYOUT, tmp);
    if (!rc) rc = tdm_safetensors_save(path, NULL, 0, meta, k);
    for (int i = 0; store && i < 2 * (ps->n + world); i++) free(store[i]);
    free(store);
    free(meta);
    return rc;
}

/* buffers.safetensors into tmp: the model's buffers, replicated on every rank. */
static int write_buffers(const char *tmp, tdm_module *m) {
    tdm_bufferset *bs = tdm_module_buffers(m);
    if (!bs) return tdm_last_status();
    tdm_named_tensor *ts = malloc(sizeof *ts * (size_t)(bs->n ? bs->n : 1));
    if (!ts) return tdm_raise(TDM_ERR_NOMEM, "checkpoint buffers: out of memory");
    for (int i = 0; i < bs->n; i++) ts[i] = (tdm_named_tensor){bs->names[i], bs->buffers[i]};
    char path[4200];
    snprintf(path, sizeof path, "%s/" BUFFERS, tmp);
    int rc = tdm_safetensors_save(path, ts, bs->n, NULL, 0);
    free(ts);
    return rc;
}

int tdm_checkpoint_shard_finish(const char *dir, const tdm_train_state *s, const int64_t *ranges,
                                int world, int keep) {
    if (!dir || !s || !s->model || !s->optim || !ranges || world < 1)
        return tdm_raise(TDM_ERR_ARG, "checkpoint_shard_finish: NULL or bad argument");
    char tmp[4096], f[4200];
    tmp_dir(tmp, sizeof tmp, dir, s->step);
    int rc = write_layout(tmp, s, ranges, world);
    if (!rc) rc = write_buffers(tmp, s->model);
    snprintf(f, sizeof f, "%s/train_state.safetensors", tmp);
    if (!rc) rc = tdm_ckpt_write_state(f, s, false);
    return tdm_ckpt_publish(dir, s, keep, rc);
}

void tdm_checkpoint_shard_abort(const char *dir, int64_t step) {
    char tmp[4096];
    tmp_dir(tmp, sizeof tmp, dir, step);
    tdm_ckpt_remove_dir(tmp);
}

/* ---- the layout --------------------------------------------------------------------------- */

typedef struct {
    char path[4200]; /* of layout.safetensors, for messages */
    char dir[4096];
    int world, n, n_states;
    int64_t total;
    char kind[32], states[MAX_STATE][32];
    char **names;
    int64_t *offsets, *lo, *hi;
    int *ndim;
    int64_t (*shape)[TDM_MAX_DIMS];
    tdm_safetensors **files; /* the shard files, opened when first needed */
} layout;

static void layout_free(layout *l) {
    for (int i = 0; l->names && i < l->n; i++) free(l->names[i]);
    for (int r = 0; l->files && r < l->world; r++) tdm_safetensors_close(l->files[r]);
    free(l->names), free(l->offsets), free(l->lo), free(l->hi), free(l->ndim), free(l->shape);
    free(l->files);
    memset(l, 0, sizeof *l);
}

static int bad_layout(const layout *l, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int bad_layout(const layout *l, const char *key, const char *fmt, ...) {
    char why[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    return tdm_raise(TDM_ERR_FORMAT, "sharded checkpoint '%s': %s %s", l->path, key, why);
}

/* The integer at *s (after any spaces) into *out, and *s past it; false when there is none or
 * it does not fit an int64. */
static bool next_int(const char **s, int64_t *out) {
    char *end;
    errno = 0;
    *out = strtoll(*s, &end, 10);
    bool ok = end != *s && errno != ERANGE;
    *s = end;
    return ok;
}

/* An integer of the layout's metadata. */
static int layout_int(tdm_safetensors *f, const layout *l, const char *key, int64_t *out) {
    const char *v = tdm_safetensors_meta(f, key);
    if (!v) return bad_layout(l, key, "is missing");
    const char *p = v;
    return !next_int(&p, out) || *p || *out < 0 ? bad_layout(l, key, "'%.40s' is not a count", v)
                                                : TDM_OK;
}

/* The checks of a parameter's geometry: its dims, their element count (int64, no overflow)
 * and its elements [offset, offset + count) inside the flat buffer [0, total). */
static int param_check(const layout *l, int i, const char *key) {
    tdm_shape sh = {l->ndim[i], {0}};
    memcpy(sh.d, l->shape[i], sizeof sh.d);
    char str[96];
    int64_t n = 1, off = l->offsets[i];
    for (int d = 0; d < sh.ndim; d++) {
        if (sh.d[d] < 0)
            return bad_layout(l, key, "shape %s has a negative dimension", tdm_shape_str(sh, str));
        if (sh.d[d] && n > INT64_MAX / sh.d[d])
            return bad_layout(l, key, "shape %s has more elements than an int64 counts",
                              tdm_shape_str(sh, str));
        n *= sh.d[d];
    }
    if (off < 0 || off > l->total || n > l->total - off)
        return bad_layout(l, key, "offset %lld + %lld elements is past total %lld", (long long)off,
                          (long long)n, (long long)l->total);
    return TDM_OK;
}

/* "param.<i>": "<offset> <ndim> <d0> ... <name>", a nonempty name. */
static int layout_param(layout *l, int i, const char *key, const char *v) {
    int64_t nd = -1;
    const char *p = v;
    bool ok = next_int(&p, &l->offsets[i]) && next_int(&p, &nd);
    if (ok && (nd < 0 || nd > TDM_MAX_DIMS))
        return bad_layout(l, key, "has %lld dims (0 to %d)", (long long)nd, TDM_MAX_DIMS);
    l->ndim[i] = (int)nd;
    for (int d = 0; ok && d < l->ndim[i]; d++) ok = next_int(&p, &l->shape[i][d]);
    while (ok && *p == ' ') p++;
    if (!ok || !*p || p[-1] != ' ') /* a space, then the name */
        return bad_layout(l, key, "'%.200s' is not '<offset> <ndim> <dims> <name>'", v);
    int rc = param_check(l, i, key);
    if (!rc && !(l->names[i] = strdup(p)))
        rc = tdm_raise(TDM_ERR_NOMEM, "sharded checkpoint: out of memory");
    return rc;
}

/* "rank.<r>": "<lo> <hi>", the range of the flat buffer rank r saved. */
static int layout_rank(layout *l, int r, const char *key, const char *v) {
    const char *p = v;
    if (!next_int(&p, &l->lo[r]) || !next_int(&p, &l->hi[r]) || *p || l->lo[r] < 0)
        return bad_layout(l, key, "'%.100s' is not '<lo> <hi>'", v);
    return TDM_OK;
}

static int layout_alloc(layout *l) {
    l->names = calloc((size_t)l->n + 1, sizeof *l->names);
    l->offsets = calloc((size_t)l->n + 1, sizeof *l->offsets);
    l->ndim = calloc((size_t)l->n + 1, sizeof *l->ndim);
    l->shape = calloc((size_t)l->n + 1, sizeof *l->shape);
    l->lo = calloc((size_t)l->world, sizeof *l->lo);
    l->hi = calloc((size_t)l->world, sizeof *l->hi);
    l->files = calloc((size_t)l->world, sizeof *l->files);
    bool ok = l->names && l->offsets && l->ndim && l->shape && l->lo && l->hi && l->files;
    for (int r = 0; ok && r < l->world; r++) l->lo[r] = -1; /* not read yet */
    return ok ? TDM_OK : tdm_raise(TDM_ERR_NOMEM, "sharded checkpoint: out of memory");
}

/* The index i of key "<prefix><i>" (decimal, no sign, no leading zero), or -1. */
static int64_t key_index(const char *key, const char *prefix) {
    size_t p = strlen(prefix);
    if (strncmp(key, prefix, p)) return -1;
    size_t digits = strspn(key + p, "0123456789");
    if (!digits || digits > 9 || key[p + digits] || (key[p] == '0' && digits > 1)) return -1;
    return strtoll(key + p, NULL, 10);
}

/* Every "param.<i>" and "rank.<r>" of the metadata, in one pass (the file's keys differ, so
 * each is read once), then each of params and world of them is there. */
static int layout_entries(tdm_safetensors *f, layout *l) {
    int rc = TDM_OK;
    for (int k = 0; !rc && k < tdm_safetensors_meta_count(f); k++) {
        const char *key, *v;
        tdm_safetensors_meta_at(f, k, &key, &v);
        int64_t i = key_index(key, "param."), r = key_index(key, "rank.");
        if (i >= l->n || r >= l->world)
            rc =
                bad_layout(l, key, "is beyond the layout's params %d and world %d", l->n, l->world);
        else if (i >= 0)
            rc = layout_param(l, (int)i, key, v);
        else if (r >= 0)
            rc = layout_rank(l, (int)r, key, v);
    }
    char key[32] = "";
    for (int i = 0; !rc && !*key && i < l->n; i++)
        if (!l->names[i]) snprintf(key, sizeof key, "param.%d", i);
    for (int r = 0; !rc && !*key && r < l->world; r++)
        if (l->lo[r] < 0) snprintf(key, sizeof key, "rank.%d", r);
    return rc || !*key ? rc : bad_layout(l, key, "is missing");
}

/* The ranks' ranges must tile [0, total) in rank order. */
static int layout_ranges(layout *l) {
    for (int r = 0; r < l->world; r++)
        if (l->lo[r] != (r ? l->hi[r - 1] : 0) || l->hi[r] < l->lo[r] ||
            (r == l->world - 1 && l->hi[r] != l->total)) {
            char key[32];
            snprintf(key, sizeof key, "rank.%d", r);
            return bad_layout(l, key,
                              "[%lld, %lld) does not continue the ranks' ranges over "
                              "[0, total %lld)",
                              (long long)l->lo[r], (long long)l->hi[r], (long long)l->total);
        }
    return TDM_OK;
}

typedef struct {
    const char *name;
    int i;
} named_index;

static int by_name(const void *a, const void *b) {
    const named_index *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : x->i - y->i;
}

/* The parameters' names must differ: export writes them as the tensors' names. */
static int layout_names_unique(const layout *l) {
    named_index *s = malloc(sizeof *s * (size_t)(l->n ? l->n : 1));
    if (!s) return tdm_raise(TDM_ERR_NOMEM, "sharded checkpoint: out of memory");
    for (int i = 0; i < l->n; i++) s[i] = (named_index){l->names[i], i};
    qsort(s, (size_t)l->n, sizeof *s, by_name);
    int rc = TDM_OK;
    for (int k = 1; !rc && k < l->n; k++)
        if (!strcmp(s[k - 1].name, s[k].name)) {
            char key[32];
            snprintf(key, sizeof key, "param.%d", s[k].i);
            rc = bad_layout(l, key, "names '%.200s' as param.%d does", s[k].name, s[k - 1].i);
        }
    free(s);
    return rc;
}

/* "optim.kind", and "optim.states": up to MAX_STATE names, separated by commas. */
static int layout_states(tdm_safetensors *f, layout *l) {
    const char *kind = tdm_safetensors_meta(f, "optim.kind");
    const char *st = tdm_safetensors_meta(f, "optim.states");
    if (!kind || !st) return bad_layout(l, "optim.kind or optim.states", "is missing");
    snprintf(l->kind, sizeof l->kind, "%s", kind);
    for (const char *p = st; *p; l->n_states++) {
        size_t len = strcspn(p, ",");
        if (l->n_states == MAX_STATE || !len || len >= sizeof l->states[0] ||
            (p[len] == ',' && !p[len + 1]))
            return bad_layout(l, "optim.states",
                              "'%.100s' is not up to %d names (of up to %d characters) "
                              "separated by commas",
                              st, MAX_STATE, (int)sizeof l->states[0] - 1);
        snprintf(l->states[l->n_states], sizeof l->states[0], "%.*s", (int)len, p);
        p += len + (p[len] == ',');
    }
    return TDM_OK;
}

/* The layout of checkpoint directory ckpt, checked on its own (export has no model to check
 * it against): every count in range, every parameter's elements inside [0, total), the ranks'
 * ranges tiling [0, total), the names nonempty and distinct. */
static int layout_read(const char *ckpt, layout *l) {
    memset(l, 0, sizeof *l);
    snprintf(l->dir, sizeof l->dir, "%s", ckpt);
    snprintf(l->path, sizeof l->path, "%s/" LAYOUT, ckpt);
    tdm_safetensors *f = tdm_safetensors_open(l->path);
    if (!f) return tdm_last_status();
    int64_t world = 0, n = 0, entries = tdm_safetensors_meta_count(f);
    int rc = layout_int(f, l, "world", &world);
    if (!rc) rc = layout_int(f, l, "total", &l->total);
    if (!rc) rc = layout_int(f, l, "params", &n);
    if (!rc && (world < 1 || world > 99999))
        rc = bad_layout(l, "world", "%lld is out of range [1, 99999]", (long long)world);
    if (!rc && n > entries - world) /* each has its entry: what is allocated, the file holds */
        rc = bad_layout(l, "params", "%lld and world %lld are more than the layout's %lld entries",
                        (long long)n, (long long)world, (long long)entries);
    if (!rc && l->total > INT64_MAX / (int64_t)sizeof(float) - 1) /* export's whole buffer */
        rc = bad_layout(l, "total", "%lld is more elements than memory holds", (long long)l->total);
    if (!rc) {
        l->world = (int)world, l->n = (int)n;
        rc = layout_alloc(l);
    }
    if (!rc) rc = layout_entries(f, l);
    if (!rc) rc = layout_ranges(l);
    if (!rc) rc = layout_names_unique(l);
    if (!rc) rc = layout_states(f, l);
    tdm_safetensors_close(f);
    if (rc) layout_free(l);
    return rc;
}

/* The layout against the model's parameters and the optimizer's state names. */
static int layout_check(const layout *l, const tdm_paramset *ps, tdm_optim *o) {
    if (l->n != ps->n || l->total != ps->total)
        return tdm_raise(TDM_ERR_FORMAT,
                         "sharded checkpoint '%s' does not match the model: %d parameters of "
                         "%lld elements in the checkpoint, %d of %lld in the model",
                         l->path, l->n, (long long)l->total, ps->n, (long long)ps->total);
    for (int i = 0; i < l->n; i++) {
        const tdm_tensor *p = ps->params[i];
        bool same = !strcmp(l->names[i], ps->names[i]) && l->offsets[i] == ps->offsets[i] &&
                    l->ndim[i] == p->ndim;
        for (int d = 0; same && d < p->ndim; d++) same = l->shape[i][d] == p->shape[d];
        if (!same)
            return tdm_raise(TDM_ERR_FORMAT,
                             "sharded checkpoint '%s' does not match the model: parameter %d is "
                             "'%.100s' at offset %lld in the checkpoint, '%.100s' at %lld (or "
                             "another shape) in the model",
                             l->path, i, l->names[i], (long long)l->offsets[i], ps->names[i],
                             (long long)ps->offsets[i]);
    }
    if (!o) return TDM_OK;
    const char *snames[MAX_STATE];
    tdm_tensor *st[MAX_STATE];
    int ns = tdm_optim_state(o, snames, st, MAX_STATE);
    bool same = ns == l->n_states && !strcmp(l->kind, tdm_optim_kind(o));
    for (int s = 0; same && s < ns; s++) same = !strcmp(l->states[s], snames[s]);
    return same ? TDM_OK
                : tdm_raise(TDM_ERR_FORMAT,
                            "sharded checkpoint '%s': the optimizer was %.20s with %d state "
                            "buffers, now %s with %d (built with other options?)",
                            l->path, l->kind, l->n_states, tdm_optim_kind(o), ns);
}

/* Whether s is the decimal v, all of it. */
static bool is_decimal(const char *s, int64_t v) {
    char *end;
    errno = 0;
    long long got = s && *s ? strtoll(s, &end, 10) : 0;
    return s && *s && !errno && !*end && got == v;
}

/* Shard file r, opened once and checked against the layout. */
static tdm_safetensors *layout_file(layout *l, int r) {
    if (l->files[r]) return l->files[r];
    char path[4300];
    shard_path(path, sizeof path, l->dir, r, l->world);
    tdm_safetensors *f = tdm_safetensors_open(path);
    if (!f) return NULL;
    const char *lo = tdm_safetensors_meta(f, "shard.lo"), *hi = tdm_safetensors_meta(f, "shard.hi");
    if (!is_decimal(lo, l->lo[r]) || !is_decimal(hi, l->hi[r])) {
        /* the message first: lo and hi are the file's, freed with it */
        tdm_raise(TDM_ERR_FORMAT,
                  "sharded checkpoint: shard file '%s' holds range [%.40s, %.40s), the layout "
                  "'%s' says [%lld, %lld)",
                  path, lo ? lo : "?", hi ? hi : "?", l->path, (long long)l->lo[r],
                  (long long)l->hi[r]);
        tdm_safetensors_close(f);
        return NULL;
    }
    return l->files[r] = f;
}

/* Shard file r, holding rank r's range of tensor `name` ("params", "optim.<state>") as F32
 * [hi - lo]; NULL and an error naming the file otherwise. */
static tdm_safetensors *layout_piece(layout *l, int r, const char *name) {
    tdm_safetensors *f = layout_file(l, r);
    if (!f) return NULL;
    int k = tdm_safetensors_find(f, name);
    tdm_shape want = TDM_SHAPE(l->hi[r] - l->lo[r]), got = {0};
    if (k >= 0) got = tdm_safetensors_shape(f, k);
    if (k >= 0 && !strcmp(tdm_safetensors_dtype(f, k), "F32") && got.ndim == 1 &&
        got.d[0] == want.d[0])
        return f;
    char what[256];
    tdm_safetensors_what(f, what, sizeof what);
    tdm_raise(TDM_ERR_FORMAT, "sharded checkpoint: shard file '%s' has no F32 [%lld] tensor '%s'",
              what, (long long)want.d[0], name);
    return NULL;
}

/* Elements [lo, hi) of tensor `name` of the whole flat buffer into dst, from the pieces of the
 * shard files that cover them. */
static int layout_read_range(layout *l, const char *name, int64_t lo, int64_t hi, float *dst) {
    for (int r = 0; r < l->world; r++) {
        int64_t a = lo > l->lo[r] ? lo : l->lo[r], b = hi < l->hi[r] ? hi : l->hi[r];
        if (a >= b) continue;
        tdm_safetensors *f = layout_piece(l, r, name);
        int rc = f ? tdm_safetensors_read_bytes(f, name, (uint64_t)(a - l->lo[r]) * sizeof(float),
                                                (size_t)(b - a) * sizeof(float), dst + (a - lo))
                   : tdm_last_status();
        if (rc) return rc;
    }
    return TDM_OK;
}

int tdm_checkpoint_read_params(const char *ckpt, const tdm_paramset *ps, int64_t lo, int64_t hi,
                               float *dst) {
    if (!ckpt || !ps || !dst || lo < 0 || lo > hi || hi > ps->total)
        return tdm_raise(TDM_ERR_ARG, "checkpoint_read_params: NULL argument or range [%lld, %lld)",
                         (long long)lo, (long long)hi);
    layout l;
    int rc = layout_read(ckpt, &l);
    if (rc) return rc;
    rc = layout_check(&l, ps, NULL);
    if (!rc) rc = layout_read_range(&l, "params", lo, hi, dst);
    layout_free(&l);
    return rc;
}

/* ---- loading ------------------------------------------------------------------------------ */

bool tdm_checkpoint_is_sharded(const char *path) {
    char f[4200];
    struct stat st;
    snprintf(f, sizeof f, "%s/" LAYOUT, path);
    return stat(f, &st) == 0;
}

/* The parameters this process loads: all of them (every rank of ZeRO 1 and 2 holds them); under
 * stage 3 its shard's, as params_of_range. */
static void params_to_load(const tdm_paramset *ps, const tdm_optim *o, int64_t *lo, int64_t *hi) {
    const tdm_tensor *own = o ? tdm_optim_params(o, lo) : NULL;
    if (!own || own == ps->flat)
        *lo = 0, *hi = ps->total;
    else
        *hi = *lo + tdm_numel(own);
}

/* The model's buffers against buffers.safetensors (opened into sh). */
static int read_buffers(const char *path, tdm_module *m, tdm_ckpt_shards *sh) {
    char f[4200];
    snprintf(f, sizeof f, "%s/" BUFFERS, path);
    tdm_bufferset *bs = tdm_module_buffers(m);
    if (!bs) return tdm_last_status();
    if (!(sh->buffers = tdm_safetensors_open(f))) return tdm_last_status();
    sh->bufs = malloc(sizeof *sh->bufs * (size_t)(bs->n ? bs->n : 1));
    if (!sh->bufs) return tdm_raise(TDM_ERR_NOMEM, "sharded checkpoint: out of memory");
    sh->n_bufs = bs->n;
    for (int i = 0; i < bs->n; i++) sh->bufs[i] = (tdm_named_tensor){bs->names[i], bs->buffers[i]};
    return tdm_ckpt_check_tensors(sh->buffers, sh->bufs, sh->n_bufs);
}

int tdm_ckpt_shards_read(const char *path, const tdm_train_state *s, tdm_ckpt_shards *sh) {
    memset(sh, 0, sizeof *sh);
    if (!s->model) return TDM_OK; /* the training state alone: train_state.safetensors */
    tdm_paramset *ps = tdm_module_parameters(s->model);
    if (!ps) return tdm_last_status();
    layout l;
    int rc = layout_read(path, &l);
    if (rc) return rc;
    rc = layout_check(&l, ps, s->optim);
    params_to_load(ps, s->optim, &sh->p_lo, &sh->p_hi);
    if (!rc && !(sh->params = malloc(sizeof(float) * (size_t)(sh->p_hi - sh->p_lo + 1))))
        rc = tdm_raise(TDM_ERR_NOMEM, "sharded checkpoint: out of memory");
    if (!rc) rc = layout_read_range(&l, "params", sh->p_lo, sh->p_hi, sh->params);
    int64_t lo = 0, hi = ps->total;
    if (!rc && s->optim) rc = tdm_optim_shard_range(s->optim, &lo, &hi);
    for (int k = 0; !rc && s->optim && k < l.n_states; k++, sh->n_state = k) {
        char name[64];
        snprintf(name, sizeof name, "optim.%s", l.states[k]);
        if (!(sh->state[k] = malloc(sizeof(float) * (size_t)(hi - lo + 1))))
            rc = tdm_raise(TDM_ERR_NOMEM, "sharded checkpoint: out of memory");
        else
            rc = layout_read_range(&l, name, lo, hi, sh->state[k]);
    }
    if (!rc) rc = read_buffers(path, s->model, sh);
    layout_free(&l);
    return rc;
}

/* host[0..n) into t ([n] f32, on any device; in the caller's scope, which frees the copy). */
static int copy_in(tdm_tensor *t, const float *host, int64_t n) {
    const tdm_backend *be = tdm_backend_for(t->device); /* any device: a CPU's or a GPU's */
    if (tdm_numel(t) != n)
        return tdm_raise(TDM_ERR_SHAPE, "sharded checkpoint: %lld values for %lld elements",
                         (long long)n, (long long)tdm_numel(t));
    return be ? be->from_host(t, host) : tdm_last_status();
}

int tdm_ckpt_shards_apply(tdm_ckpt_shards *sh, tdm_train_state *s) {
    if (!s->model) return TDM_OK;
    tdm_paramset *ps = tdm_module_parameters(s->model);
    int rc = ps ? TDM_OK : tdm_last_status();
    if (!rc) {
        tdm_tensor *dst = params_of_range(ps, s->optim, sh->p_lo, sh->p_hi);
        rc = dst ? copy_in(dst, sh->params, sh->p_hi - sh->p_lo) : tdm_last_status();
    }
    const char *snames[MAX_STATE];
    tdm_tensor *st[MAX_STATE];
    int ns = s->optim ? tdm_optim_state(s->optim, snames, st, MAX_STATE) : 0;
    for (int k = 0; !rc && k < ns && k < sh->n_state; k++)
        rc = copy_in(st[k], sh->state[k], tdm_numel(st[k]));
    if (!rc) rc = tdm_ckpt_read_tensors(sh->buffers, sh->bufs, sh->n_bufs);
    return rc;
}

void tdm_ckpt_shards_free(tdm_ckpt_shards *sh) {
    free(sh->params);
    for (int k = 0; k < MAX_STATE; k++) free(sh->state[k]);
    tdm_safetensors_close(sh->buffers);
    free(sh->bufs);
    memset(sh, 0, sizeof *sh);
}

/* ---- export: the whole model (and state) of a checkpoint ---------------------------------- */

/* from (checked as a load would) copied to `to`, which is replaced only once the copy is
 * whole (tdm_io_temp_open). */
static int copy_file(const char *from, const char *to) {
    tdm_safetensors *f = tdm_safetensors_open(from);
    if (!f) return tdm_last_status();
    tdm_safetensors_close(f);
    FILE *in = fopen(from, "rb");
    if (!in) return tdm_raise(TDM_ERR_IO, "export: cannot read '%s': %s", from, strerror(errno));
    char tmp[4400], buf[1 << 16];
    int fd = tdm_io_temp_open(to, tmp, sizeof tmp), rc = fd < 0 ? tdm_last_status() : TDM_OK;
    size_t n;
    while (!rc && (n = fread(buf, 1, sizeof buf, in)) > 0) rc = tdm_io_write_all(fd, buf, n, to);
    if (!rc && ferror(in))
        rc = tdm_raise(TDM_ERR_IO, "export: cannot read '%s': %s", from, strerror(errno));
    fclose(in);
    return fd < 0 ? rc : tdm_io_temp_commit(fd, tmp, to, rc);
}

/* path made absolute, its directory's symbolic links resolved (and the file's, when it exists),
 * into out; false when its directory cannot be resolved (writing there will fail, saying why). */
static bool path_resolved(const char *path, char *out, size_t cap) {
    char dir[4096], real[PATH_MAX];
    if (realpath(path, real)) return snprintf(out, cap, "%s", real) < (int)cap;
    tdm_io_dirname(path, dir, sizeof dir);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    return realpath(dir, real) && snprintf(out, cap, "%s/%s", real, base) < (int)cap;
}

/* Whether a and b name one file: the same resolved path, or the same device and inode. */
static bool same_file(const char *a, const char *b) {
    char ra[PATH_MAX + 256], rb[PATH_MAX + 256];
    struct stat sa, sb;
    if (path_resolved(a, ra, sizeof ra) && path_resolved(b, rb, sizeof rb) && !strcmp(ra, rb))
        return true;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

/* Refuses an output that would change the checkpoint it is made from: one inside the
 * checkpoint directory, or one that is a file of it under another name (a hard link). */
static int export_check_output(const char *ckpt, const char *out) {
    char rc_dir[PATH_MAX], ro[PATH_MAX + 256];
    if (!realpath(ckpt, rc_dir)) return TDM_OK; /* reading it fails, naming it */
    size_t n = strlen(rc_dir);
    if (path_resolved(out, ro, sizeof ro) && !strncmp(ro, rc_dir, n) &&
        (ro[n] == '/' || !ro[n] || n == 1))
        return tdm_raise(TDM_ERR_ARG,
                         "export output '%s' is inside the checkpoint directory '%s' it is made "
                         "from; write it elsewhere",
                         out, ckpt);
    struct stat so, sf;
    if (stat(out, &so) != 0) return TDM_OK; /* a new file */
    DIR *d = opendir(ckpt);
    struct dirent *e;
    int rc = TDM_OK;
    while (!rc && d && (e = readdir(d)) != NULL) {
        char f[4400];
        snprintf(f, sizeof f, "%s/%s", ckpt, e->d_name);
        if (stat(f, &sf) == 0 && S_ISREG(sf.st_mode) && sf.st_dev == so.st_dev &&
            sf.st_ino == so.st_ino)
            rc = tdm_raise(TDM_ERR_ARG,
                           "export output '%s' is the checkpoint's file '%s' under another name (a "
                           "hard link); write it elsewhere",
                           out, f);
    }
    if (d) closedir(d);
    return rc;
}

/* Both outputs checked before anything is read or written. */
static int export_check_outputs(const char *ckpt, const char *model_path, const char *state_path) {
    if (model_path && state_path && same_file(model_path, state_path))
        return tdm_raise(TDM_ERR_ARG,
                         "export outputs '%s' (the model) and '%s' (the state) are the same file",
                         model_path, state_path);
    int rc = model_path ? export_check_output(ckpt, model_path) : TDM_OK;
    return rc || !state_path ? rc : export_check_output(ckpt, state_path);
}

/* Tensors [l->n] viewing each parameter in flat (a whole [total] buffer), named names[i]. */
static int param_views(const layout *l, tdm_tensor *flat, char **names, tdm_named_tensor *ts) {
    for (int i = 0; i < l->n; i++) {
        int64_t strides[TDM_MAX_DIMS];
        tdm_contiguous_strides(l->ndim[i], l->shape[i], strides);
        tdm_tensor *v = tdm_tensor_view(flat, l->ndim[i], l->shape[i], strides, l->offsets[i]);
        if (!v) return tdm_last_status();
        ts[i] = (tdm_named_tensor){names[i], v};
    }
    return TDM_OK;
}

/* The whole flat buffer `name` as a tensor of the current scope. */
static tdm_tensor *whole(layout *l, const char *name) {
    /* the shard files checked first, so that the buffer is no larger than they justify */
    for (int r = 0; r < l->world; r++)
        if (l->hi[r] > l->lo[r] && !layout_piece(l, r, name)) return NULL;
    float *host = malloc(sizeof(float) * (size_t)(l->total + 1));
    if (!host) return tdm_raise(TDM_ERR_NOMEM, "export: out of memory"), NULL;
    int rc = layout_read_range(l, name, 0, l->total, host);
    tdm_tensor *t = rc ? NULL : tdm_from_data(TDM_SHAPE(l->total), TDM_F32, tdm_cpu(0), host);
    free(host);
    return t;
}

/* The f32 tensors of ts[0..n) replaced by their casts to dt (new tensors of the current
 * scope), as Hugging Face saves a model in another dtype: integer tensors (a batch norm's
 * count) stay as they are. */
static int cast_floats(tdm_named_tensor *ts, int n, tdm_dtype dt) {
    for (int i = 0; i < n && dt != TDM_F32; i++) {
        if (ts[i].tensor->dtype != TDM_F32) continue;
        if (!(ts[i].tensor = tdm_cast(ts[i].tensor, dt))) return tdm_last_status();
    }
    return TDM_OK;
}

/* An unsharded checkpoint's model file src rewritten to path with its f32 tensors in dt, its
 * metadata and names as they were. */
static int export_model_file(const char *src, const char *path, tdm_dtype dt) {
    tdm_safetensors *f = tdm_safetensors_open(src);
    if (!f) return tdm_last_status();
    int n = tdm_safetensors_count(f), nm = tdm_safetensors_meta_count(f), rc = TDM_OK;
    tdm_named_tensor *ts = calloc((size_t)n + 1, sizeof *ts);
    tdm_meta *meta = calloc((size_t)nm + 1, sizeof *meta);
    if (!ts || !meta) rc = tdm_raise(TDM_ERR_NOMEM, "export: out of memory");
    for (int i = 0; !rc && i < nm; i++) tdm_safetensors_meta_at(f, i, &meta[i].key, &meta[i].value);
    for (int i = 0; !rc && i < n; i++) {
        ts[i].name = tdm_safetensors_name(f, i);
        ts[i].tensor = tdm_safetensors_load(f, ts[i].name, tdm_cpu(0));
        if (!ts[i].tensor) rc = tdm_last_status();
    }
    if (!rc) rc = cast_floats(ts, n, dt);
    if (!rc) rc = tdm_safetensors_save(path, ts, n, meta, nm);
    free(ts), free(meta);
    tdm_safetensors_close(f);
    return rc;
}

/* model.safetensors as an unsharded run writes it: the parameters, then the buffers, the f32
 * ones in dt. */
static int export_model(layout *l, const char *path, tdm_dtype dt) {
    char f[4300];
    snprintf(f, sizeof f, "%s/" BUFFERS, l->dir);
    tdm_safetensors *bf = tdm_safetensors_open(f);
    if (!bf) return tdm_last_status();
    int nb = tdm_safetensors_count(bf);
    tdm_named_tensor *ts = calloc((size_t)(l->n + nb + 1), sizeof *ts);
    tdm_tensor *flat = ts ? whole(l, "params") : NULL;
    int rc = flat ? param_views(l, flat, l->names, ts) : tdm_last_status();
    for (int k = 0; !rc && k < nb; k++) {
        const char *name = tdm_safetensors_name(bf, k);
        tdm_tensor *t = tdm_safetensors_load(bf, name, tdm_cpu(0));
        rc = t ? TDM_OK : tdm_last_status();
        ts[l->n + k] = (tdm_named_tensor){name, t};
    }
    tdm_meta pt = {"format", "pt"};
    if (!rc) rc = cast_floats(ts, l->n + nb, dt);
    if (!rc) rc = tdm_safetensors_save(path, ts, l->n + nb, &pt, 1);
    free(ts);
    tdm_safetensors_close(bf);
    return rc;
}

/* train_state.safetensors as an unsharded run writes it: the moments "optim.<param>.<state>"
 * (state by state, parameter by parameter) and the sharded checkpoint's metadata in order. */
static int export_state(layout *l, const char *path) {
    char f[4300];
    snprintf(f, sizeof f, "%s/train_state.safetensors", l->dir);
    tdm_safetensors *sf = tdm_safetensors_open(f);
    if (!sf) return tdm_last_status();
    int nm = tdm_safetensors_meta_count(sf), n = l->n_states * l->n, rc = TDM_OK;
    tdm_meta *meta = calloc((size_t)nm + 1, sizeof *meta);
    tdm_named_tensor *ts = calloc((size_t)n + 1, sizeof *ts);
    char **names = calloc((size_t)n + 1, sizeof *names);
    if (!meta || !ts || !names) rc = tdm_raise(TDM_ERR_NOMEM, "export: out of memory");
    for (int i = 0; !rc && i < nm; i++)
        tdm_safetensors_meta_at(sf, i, &meta[i].key, &meta[i].value);
    for (int s = 0; !rc && s < l->n_states; s++) {
        char buf[64];
        snprintf(buf, sizeof buf, "optim.%s", l->states[s]);
        tdm_tensor *flat = whole(l, buf);
        for (int i = 0; flat && i < l->n; i++) {
            size_t len = strlen(l->names[i]) + strlen(l->states[s]) + 8;
            if ((names[s * l->n + i] = malloc(len)))
                snprintf(names[s * l->n + i], len, "optim.%s.%s", l->names[i], l->states[s]);
        }
        rc = flat ? param_views(l, flat, names + s * l->n, ts + s * l->n) : tdm_last_status();
    }
    for (int i = 0; !rc && i < n; i++)
        if (!ts[i].name) rc = tdm_raise(TDM_ERR_NOMEM, "export: out of memory");
    if (!rc) rc = tdm_safetensors_save(path, ts, n, meta, nm);
    for (int i = 0; names && i < n; i++) free(names[i]);
    free(names), free(ts), free(meta);
    tdm_safetensors_close(sf);
    return rc;
}

/* ckpt whole into model_path (its f32 tensors in dt) and state_path (either may be NULL). */
static int export_whole(const char *ckpt, const char *model_path, const char *state_path,
                        tdm_dtype dt) {
    char f[4200];
    int rc = TDM_OK;
    if (!tdm_checkpoint_is_sharded(ckpt)) { /* already whole */
        snprintf(f, sizeof f, "%s/model.safetensors", ckpt);
        if (model_path && dt == TDM_F32)
            rc = copy_file(f, model_path);
        else if (model_path && !(rc = tdm_scope_begin())) {
            rc = export_model_file(f, model_path, dt);
            tdm_scope_end();
        }
        snprintf(f, sizeof f, "%s/train_state.safetensors", ckpt);
        return rc || !state_path ? rc : copy_file(f, state_path);
    }
    layout l;
    if ((rc = layout_read(ckpt, &l))) return rc;
    if (!(rc = tdm_scope_begin())) {
        if (model_path) rc = export_model(&l, model_path, dt);
        if (!rc && state_path) rc = export_state(&l, state_path);
        tdm_scope_end();
    }
    layout_free(&l);
    return rc;
}

/* The outputs out[0..2) (NULL: none) each written under a temporary name beside it and
 * renamed over it only once both are complete, so that a failure leaves both as they were. */
static int export_staged(const char *ckpt, const char *const out[2], tdm_dtype dt) {
    char tmp[2][4400] = {"", ""}, dir[4096];
    int rc = TDM_OK;
    for (int k = 0; !rc && k < 2; k++) {
        int fd = out[k] ? tdm_io_temp_open(out[k], tmp[k], sizeof tmp[k]) : -2;
        if (fd == -1) tmp[k][0] = '\0', rc = tdm_last_status();
        if (fd >= 0) close(fd);
    }
    if (!rc) rc = export_whole(ckpt, out[0] ? tmp[0] : NULL, out[1] ? tmp[1] : NULL, dt);
    for (int k = 0; !rc && k < 2; k++) {
        if (!out[k]) continue;
        if (rename(tmp[k], out[k]) != 0)
            rc = tdm_raise(TDM_ERR_IO, "export: cannot rename '%s' to '%s': %s", tmp[k], out[k],
                           strerror(errno));
        else
            tmp[k][0] = '\0';
        tdm_io_dirname(out[k], dir, sizeof dir);
        if (!rc) rc = tdm_io_fsync_dir(dir);
    }
    for (int k = 0; k < 2; k++)
        if (tmp[k][0]) unlink(tmp[k]);
    return rc;
}

int tdm_checkpoint_export_as(const char *ckpt, const char *model_path, const char *state_path,
                             tdm_dtype dt) {
    if (!ckpt) return tdm_raise(TDM_ERR_ARG, "checkpoint_export: NULL checkpoint");
    if (!tdm_dtype_valid(dt) || !tdm_dtype_is_float(dt))
        return tdm_raise(TDM_ERR_DTYPE,
                         "checkpoint_export: the model's dtype must be f32, bf16 "
                         "or f16, not %s",
                         tdm_dtype_valid(dt) ? tdm_dtype_name(dt) : "an unknown dtype");
    int rc = export_check_outputs(ckpt, model_path, state_path);
    return rc ? rc : export_staged(ckpt, (const char *const[2]){model_path, state_path}, dt);
}

int tdm_checkpoint_export(const char *ckpt, const char *model_path, const char *state_path) {
    return tdm_checkpoint_export_as(ckpt, model_path, state_path, TDM_F32);
}
