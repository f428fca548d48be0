/* Model weights by PyTorch's names, and training checkpoints.
 *
 * A checkpoint is a directory DIR/ckpt-<step>/ with two safetensors files:
 *   model.safetensors        the state_dict (parameters and buffers), metadata {"format":"pt"}
 *   train_state.safetensors  "optim.<param>.<state>" tensors (PyTorch's state names) and, in
 *                            __metadata__, everything else as decimal or hex-float strings:
 *                            tandem.checkpoint (format version), step, optim.kind, optim.steps,
 *                            optim.lr, loader.epoch, loader.global_sample (samples of the
 *                            epoch done by every rank together: the position on any number
 *                            of ranks; loader.sample, rank 0's, and loader.batch beside it
 *                            for older readers), rng.seed,
 *                            rng.offset, run.id (the run's identity, when it has one), and the
 *                            caller's entries prefixed "user.".
 * Both are written into DIR/.ckpt-<step>.tmp, flushed, and that directory is renamed into
 * place, so a checkpoint either exists whole or not at all. Values are stored bit for bit
 * (floats as hex), so a resumed run continues exactly.
 *
 * Pruning and replacing touch only checkpoints whose run.id is the saving run's, so that no
 * run deletes another's (one directory is meant for one run at a time: ckpt_lock.c).
 *
 * Loading validates everything (names, shapes, dtypes, kinds, numbers) before changing
 * anything, so a bad checkpoint leaves the model and the optimizer as they were.
 *
 * A sharded run's checkpoint (layout.safetensors and one shard file per process instead of
 * model.safetensors and the moments) is written and read by checkpoint_shard.c, through the
 * same temporary directory, rename and pruning (tdm_ckpt_prepare / tdm_ckpt_publish).
 */
#include "io/io_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CKPT_VERSION "1"
#define MAX_STATE    3
#define MAX_META     64

/* ---- the model's named tensors ------------------------------------------------------------- */

/* Parameters then buffers of m, named. *out is malloc'd (caller frees). */
int tdm_ckpt_model_tensors(tdm_module *m, tdm_named_tensor **out, int *n, const char *op) {
    if (!m) return tdm_raise(TDM_ERR_ARG, "%s: model is NULL", op);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_bufferset *bs = ps ? tdm_module_buffers(m) : NULL;
    if (!bs) return tdm_last_status();
    for (int i = 0; i < ps->n; i++)
        if (!ps->params[i]->storage->data)
            return tdm_raise(TDM_ERR_STATE,
                             "%s: parameter '%s' holds no memory: the parameters are sharded "
                             "(ZeRO stage 3); gather them first (tdm_ddp_gather_params)",
                             op, ps->names[i]);
    *n = ps->n + bs->n;
    *out = malloc(sizeof **out * (size_t)(*n ? *n : 1));
    if (!*out) return tdm_raise(TDM_ERR_NOMEM, "%s: out of memory", op);
    for (int i = 0; i < ps->n; i++) (*out)[i] = (tdm_named_tensor){ps->names[i], ps->params[i]};
    for (int i = 0; i < bs->n; i++)
        (*out)[ps->n + i] = (tdm_named_tensor){bs->names[i], bs->buffers[i]};
    return TDM_OK;
}

int tdm_weights_save(const char *path, tdm_module *m, const tdm_meta *meta, int n_meta) {
    if (n_meta < 0 || n_meta > MAX_META - 1 || (n_meta && !meta))
        return tdm_raise(TDM_ERR_ARG, "weights_save: %d metadata entries (0 to %d)", n_meta,
                         MAX_META - 1);
    tdm_named_tensor *ts;
    int n, rc = tdm_ckpt_model_tensors(m, &ts, &n, "weights_save");
    if (rc) return rc;
    tdm_meta all[MAX_META] = {{"format", "pt"}};
    for (int i = 0; i < n_meta; i++) all[i + 1] = meta[i];
    rc = tdm_safetensors_save(path, ts, n, all, n_meta + 1);
    free(ts);
    return rc;
}

/* Appends ", text" (or text) to a message, noting once that it was cut short. */
static void append(char *msg, size_t cap, int *count, const char *fmt, const char *a, const char *b,
                   const char *c) {
    size_t len = strlen(msg);
    if (++*count > 8 || len + 8 >= cap) {
        if (*count == 9 && len + 8 < cap) snprintf(msg + len, cap - len, ", ...");
        return;
    }
    if (*count > 1) len += (size_t)snprintf(msg + len, cap - len, ", ");
    snprintf(msg + len, cap - len, fmt, a, b, c);
}

/* Checks that f holds exactly m's tensors with their shapes and dtypes. */
int tdm_ckpt_check_tensors(tdm_safetensors *f, const tdm_named_tensor *ts, int n) {
    char missing[300] = "", extra[300] = "", diff[400] = "";
    int n_missing = 0, n_extra = 0, n_diff = 0;
    for (int i = 0; i < n; i++) {
        int k = tdm_safetensors_find(f, ts[i].name);
        if (k < 0) {
            append(missing, sizeof missing, &n_missing, "%s%s%s", ts[i].name, "", "");
            continue;
        }
        if (tdm_safetensors_check(f, k, ts[i].tensor) == TDM_OK) continue;
        char a[96], b[96];
        tdm_safetensors_shape(f, k);
        tdm_shape_str(tdm_safetensors_shape(f, k), a);
        snprintf(a + strlen(a), sizeof a - strlen(a), " %s", tdm_safetensors_dtype(f, k));
        tdm_shape_str(tdm_shape_of(ts[i].tensor), b);
        const char *dn = tdm_safetensors_dtype_of(ts[i].tensor->dtype);
        snprintf(b + strlen(b), sizeof b - strlen(b), " %s", dn ? dn : "?");
        append(diff, sizeof diff, &n_diff, "%s (file %s, model %s)", ts[i].name, a, b);
    }
    for (int k = 0; k < tdm_safetensors_count(f); k++) {
        const char *name = tdm_safetensors_name(f, k);
        bool found = false;
        for (int i = 0; i < n && !found; i++) found = strcmp(ts[i].name, name) == 0;
        if (!found) append(extra, sizeof extra, &n_extra, "%s%s%s", name, "", "");
    }
    tdm_clear_error();
    if (!n_missing && !n_extra && !n_diff) return TDM_OK;
    char what[256];
    tdm_safetensors_what(f, what, sizeof what);
    return tdm_raise(TDM_ERR_FORMAT,
                     "load_weights '%s' does not match the model:%s%s%s%s%s%s%s%s%s", what,
                     n_missing ? " missing: " : "", missing,
                     n_missing && (n_extra || n_diff) ? ";" : "", n_extra ? " unexpected: " : "",
                     extra, n_extra && n_diff ? ";" : "", n_diff ? " different: " : "", diff, "");
}

int tdm_ckpt_read_tensors(tdm_safetensors *f, const tdm_named_tensor *ts, int n) {
    int rc = TDM_OK;
    for (int i = 0; i < n && !rc; i++)
        rc = tdm_safetensors_read(f, ts[i].name, (tdm_tensor *)ts[i].tensor);
    return rc;
}

int tdm_weights_load_from(tdm_safetensors *f, tdm_module *m) {
    if (!f) return tdm_raise(TDM_ERR_ARG, "weights_load: file is NULL");
    tdm_named_tensor *ts;
    int n, rc = tdm_ckpt_model_tensors(m, &ts, &n, "weights_load");
    if (rc) return rc;
    rc = tdm_ckpt_check_tensors(f, ts, n);
    if (!rc) rc = tdm_ckpt_read_tensors(f, ts, n);
    free(ts);
    return rc;
}

int tdm_weights_load(const char *path, tdm_module *m) {
    tdm_safetensors *f = tdm_safetensors_open(path);
    if (!f) return tdm_last_status();
    int rc = tdm_weights_load_from(f, m);
    tdm_safetensors_close(f);
    return rc;
}

/* ---- optimizer state as per-parameter views ------------------------------------------------ */

typedef struct {
    int n;               /* tensors */
    tdm_named_tensor *t; /* views into the optimizer's flat buffers, in the current scope */
    char **names;
    /* A sharded optimizer (ZeRO stage 1) being loaded: the views are into whole-size buffers
     * of the current scope, whose shard tdm_optim_state_load then takes. */
    int n_whole;
    tdm_tensor *whole[MAX_STATE];
    const char *whole_names[MAX_STATE];
} optim_views;

static void views_free(optim_views *v) {
    for (int i = 0; i < v->n; i++) free(v->names[i]);
    free(v->names);
    free(v->t);
}

/* "optim.<param>.<state>" views of every state buffer (call inside a scope). A sharded
 * optimizer holds part of each buffer: it is saved through its whole copy (tdm_optim_gather,
 * a collective, which a writer on one rank cannot run) and loaded through whole-size buffers
 * of which it keeps its shard. */
static int optim_views_make(tdm_optim *o, tdm_module *m, optim_views *v, bool loading) {
    memset(v, 0, sizeof *v);
    tdm_paramset *ps = tdm_module_parameters(m);
    if (!ps) return tdm_last_status();
    const char *snames[MAX_STATE];
    tdm_tensor *st[MAX_STATE];
    int ns = tdm_optim_state(o, snames, st, MAX_STATE);
    int64_t lo = 0, hi = ps->total;
    tdm_optim_shard_range(o, &lo, &hi);
    if (hi - lo != ps->total && !loading)
        return tdm_raise(TDM_ERR_STATE,
                         "checkpoint_save: the optimizer is sharded (its state covers [%lld, %lld) "
                         "of %lld elements); save its whole copy from tdm_optim_gather",
                         (long long)lo, (long long)hi, (long long)ps->total);
    for (int s = 0; s < ns && hi - lo != ps->total; s++) {
        if (!(st[s] = tdm_empty(TDM_SHAPE(ps->total), TDM_F32, st[s]->device)))
            return tdm_last_status();
        v->whole[s] = st[s], v->whole_names[s] = snames[s], v->n_whole = s + 1;
    }
    size_t total = (size_t)ns * (size_t)ps->n;
    v->t = calloc(total ? total : 1, sizeof *v->t);
    v->names = calloc(total ? total : 1, sizeof *v->names);
    if (!v->t || !v->names) return tdm_raise(TDM_ERR_NOMEM, "checkpoint: out of memory");
    for (int s = 0; s < ns; s++) {
        if (st[s]->ndim != 1 || st[s]->shape[0] != ps->total)
            return tdm_raise(TDM_ERR_STATE,
                             "checkpoint: optimizer state '%s' has %lld elements, "
                             "the model %lld parameters",
                             snames[s], (long long)tdm_numel(st[s]), (long long)ps->total);
        for (int i = 0; i < ps->n; i++) {
            const tdm_tensor *p = ps->params[i];
            int64_t strides[TDM_MAX_DIMS];
            tdm_contiguous_strides(p->ndim, p->shape, strides);
            size_t len = strlen(ps->names[i]) + strlen(snames[s]) + 8;
            char *name = malloc(len);
            tdm_tensor *view =
                tdm_tensor_view(st[s], p->ndim, p->shape, strides, st[s]->offset + ps->offsets[i]);
            if (!name || !view) {
                free(name);
                return tdm_last_status() ? tdm_last_status()
                                         : tdm_raise(TDM_ERR_NOMEM, "checkpoint: out of memory");
            }
            snprintf(name, len, "optim.%s.%s", ps->names[i], snames[s]);
            v->names[v->n] = name;
            v->t[v->n++] = (tdm_named_tensor){name, view};
        }
    }
    return TDM_OK;
}

/* ---- metadata ----------------------------------------------------------------------------- */

typedef struct {
    int n;
    tdm_meta m[MAX_META];
    char store[MAX_META][48];
} meta_list;

static void meta_add(meta_list *l, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void meta_add(meta_list *l, const char *key, const char *fmt, ...) {
    if (l->n >= MAX_META) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l->store[l->n], sizeof l->store[l->n], fmt, ap);
    va_end(ap);
    l->m[l->n] = (tdm_meta){key, l->store[l->n]};
    l->n++;
}

static int state_meta(const tdm_train_state *s, meta_list *l, char (*ukeys)[128]) {
    l->n = 0;
    meta_add(l, "tandem.checkpoint", "%s", CKPT_VERSION);
    meta_add(l, "step", "%" PRId64, s->step);
    if (s->optim) {
        meta_add(l, "optim.kind", "%s", tdm_optim_kind(s->optim));
        meta_add(l, "optim.steps", "%" PRId64, tdm_optim_steps(s->optim));
        meta_add(l, "optim.lr", "%a", (double)tdm_optim_lr(s->optim));
    }
    if (s->loader) {
        int64_t epoch, batch;
        if (tdm_loader_position(s->loader, &epoch, &batch)) return tdm_last_status();
        meta_add(l, "loader.epoch", "%" PRId64, epoch);
        meta_add(l, "loader.global_sample", "%" PRId64, tdm_loader_global_samples_done(s->loader));
        meta_add(l, "loader.sample", "%" PRId64, tdm_loader_samples_done(s->loader));
        meta_add(l, "loader.batch", "%" PRId64, batch);
    }
    if (s->rng) {
        meta_add(l, "rng.seed", "%" PRIu64, s->rng->seed);
        meta_add(l, "rng.offset", "%" PRIu64, s->rng->offset);
    }
    if (s->run_id) l->m[l->n++] = (tdm_meta){"run.id", s->run_id};
    if (s->n_meta < 0 || (s->n_meta && !s->meta) || l->n + s->n_meta > MAX_META)
        return tdm_raise(TDM_ERR_ARG, "checkpoint_save: %d caller metadata entries (at most %d)",
                         s->n_meta, MAX_META - l->n);
    for (int i = 0; i < s->n_meta; i++) {
        if (!s->meta[i].key || !s->meta[i].value)
            return tdm_raise(TDM_ERR_ARG, "checkpoint_save: metadata entry %d is NULL", i);
        snprintf(ukeys[i], 128, "user.%s", s->meta[i].key);
        l->m[l->n++] = (tdm_meta){ukeys[i], s->meta[i].value};
    }
    return TDM_OK;
}

/* ---- saving ------------------------------------------------------------------------------- */

/* Removes a checkpoint (or temporary) directory: its files, then itself. 0, or -1 with errno
 * set when the directory is still there. */
int tdm_ckpt_remove_dir(const char *path) {
    DIR *d = opendir(path);
    if (d) {
        struct dirent *e;
        char f[4096];
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
            snprintf(f, sizeof f, "%s/%s", path, e->d_name);
            unlink(f);
        }
        closedir(d);
    }
    return rmdir(path) == 0 || errno == ENOENT ? 0 : -1;
}

/* The step of a "ckpt-<digits>" name, or -1. */
static int64_t ckpt_step(const char *name) {
    if (strncmp(name, "ckpt-", 5) != 0 || !name[5]) return -1;
    int64_t v = 0;
    for (const char *p = name + 5; *p; p++) {
        if (*p < '0' || *p > '9' || v > (INT64_MAX - 9) / 10) return -1;
        v = v * 10 + (*p - '0');
    }
    return v;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* The steps of dir's checkpoints, sorted; *n receives the count. Caller frees. */
static int64_t *list_ckpts(const char *dir, int *n) {
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return NULL;
    int cap = 16;
    int64_t *steps = malloc(sizeof *steps * (size_t)cap);
    struct dirent *e;
    while (steps && (e = readdir(d)) != NULL) {
        int64_t s = ckpt_step(e->d_name);
        if (s < 0) continue;
        if (*n == cap) {
            int64_t *g = realloc(steps, sizeof *steps * (size_t)(cap *= 2));
            if (!g) break;
            steps = g;
        }
        steps[(*n)++] = s;
    }
    closedir(d);
    if (steps) qsort(steps, (size_t)*n, sizeof *steps, cmp_i64);
    return steps;
}

/* Whether checkpoint directory path belongs to run (NULL: to no run, as checkpoints written
 * without an identity): 1 or 0, with the checkpoint's identity copied into id (cap bytes;
 * "none" when it has none); -1 when it cannot be read (no error is left raised). */
static int run_matches(const char *path, const char *run, char *id, size_t cap) {
    char f[4200];
    snprintf(f, sizeof f, "%s/train_state.safetensors", path);
    tdm_safetensors *sf = tdm_safetensors_open(f);
    if (!sf) {
        tdm_clear_error();
        snprintf(id, cap, "(unreadable)");
        return -1;
    }
    const char *v = tdm_safetensors_meta(sf, "run.id");
    snprintf(id, cap, "%s", v ? v : "none");
    int mine = run ? v && strcmp(v, run) == 0 : !v;
    tdm_safetensors_close(sf);
    return mine;
}

/* Removes all but the newest keep checkpoints of run from dir; other runs' (and unreadable
 * ones, which may be anyone's) stay. */
static void prune(const char *dir, int keep, const char *run) {
    int n;
    int64_t *steps = list_ckpts(dir, &n);
    char p[4096], id[64];
    for (int i = n - 1, mine = 0; steps && keep > 0 && i >= 0; i--) {
        snprintf(p, sizeof p, "%s/ckpt-%010" PRId64, dir, steps[i]);
        if (run_matches(p, run, id, sizeof id) == 1 && ++mine > keep) tdm_ckpt_remove_dir(p);
    }
    free(steps);
    tdm_io_fsync_dir(dir);
}

int tdm_ckpt_write_state(const char *path, const tdm_train_state *s, bool moments) {
    char ukeys[MAX_META][128];
    meta_list meta;
    int rc = state_meta(s, &meta, ukeys);
    if (rc) return rc;
    optim_views v = {0};
    if ((rc = tdm_scope_begin())) return rc;
    if (s->optim && moments)
        rc = s->model ? optim_views_make(s->optim, s->model, &v, false)
                      : tdm_raise(TDM_ERR_ARG, "checkpoint_save: an optimizer needs "
                                               "its model (parameter names)");
    if (!rc) rc = tdm_safetensors_save(path, v.t, v.n, meta.m, meta.n);
    views_free(&v);
    tdm_scope_end();
    return rc;
}

int tdm_checkpoint_dir_check(const char *dir) {
    if (!dir) return tdm_raise(TDM_ERR_ARG, "checkpoint directory: NULL");
    int rc = tdm_io_mkdir_p(dir, "checkpoint");
    if (rc) return rc;
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/.tandem-probe-%ld", dir, (long)getpid());
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0)
        return tdm_raise(TDM_ERR_IO, "checkpoint directory '%s' cannot be written: %s", dir,
                         strerror(errno));
    close(fd);
    unlink(probe);
    return TDM_OK;
}

int tdm_ckpt_prepare(const char *dir, const tdm_train_state *s, char *tmp, size_t cap) {
    if (!dir || !s) return tdm_raise(TDM_ERR_ARG, "checkpoint_save: NULL directory or state");
    if (s->step < 0)
        return tdm_raise(TDM_ERR_ARG, "checkpoint_save: step %lld is negative", (long long)s->step);
    /* before the mkdir, which would make a new directory under a path the lock no longer holds */
    int rc = tdm_ckpt_lock_verify(dir);
    if (!rc) rc = tdm_io_mkdir_p(dir, "checkpoint");
    if (rc) return rc;
    char final[4096];
    snprintf(tmp, cap, "%s/.ckpt-%010" PRId64 ".tmp", dir, s->step);
    snprintf(final, sizeof final, "%s/ckpt-%010" PRId64, dir, s->step);
    /* a checkpoint of this step written by another run is not ours to replace */
    char other[64];
    struct stat st;
    if (stat(final, &st) == 0 && run_matches(final, s->run_id, other, sizeof other) == 0)
        return tdm_raise(TDM_ERR_STATE,
                         "checkpoint_save: '%s' belongs to run %s, not to this run (%s): "
                         "left as it is",
                         final, other, s->run_id ? s->run_id : "none");
    tdm_ckpt_remove_dir(tmp); /* left by a crashed save */
    if (tdm_io_fault() || mkdir(tmp, 0755) != 0)
        return tdm_raise(TDM_ERR_IO, "checkpoint: cannot create '%s': %s", tmp, strerror(errno));
    return TDM_OK;
}

int tdm_ckpt_publish(const char *dir, const tdm_train_state *s, int keep, int rc) {
    char tmp[4096], final[4096], old[4096];
    snprintf(tmp, sizeof tmp, "%s/.ckpt-%010" PRId64 ".tmp", dir, s->step);
    snprintf(final, sizeof final, "%s/ckpt-%010" PRId64, dir, s->step);
    snprintf(old, sizeof old, "%s/.ckpt-%010" PRId64 ".old", dir, s->step);
    if (!rc) rc = tdm_io_fsync_dir(tmp);
    /* an existing checkpoint of this step is moved aside, then replaced */
    bool moved = !rc && rename(final, old) == 0;
    if (!rc && (tdm_io_fault() || rename(tmp, final) != 0))
        rc = tdm_raise(TDM_ERR_IO, "checkpoint: cannot rename '%s' to '%s': %s", tmp, final,
                       strerror(errno));
    if (rc) {
        tdm_ckpt_remove_dir(tmp);
        if (moved) rename(old, final);
        return rc;
    }
    if (moved) tdm_ckpt_remove_dir(old);
    rc = tdm_io_fsync_dir(dir);
    if (!rc) prune(dir, keep, s->run_id);
    return rc;
}

int tdm_checkpoint_save(const char *dir, const tdm_train_state *s, int keep) {
    char tmp[4096], f[4200];
    int rc = tdm_ckpt_prepare(dir, s, tmp, sizeof tmp);
    if (rc) return rc;
    if (s->model) {
        snprintf(f, sizeof f, "%s/model.safetensors", tmp);
        rc = tdm_weights_save(f, s->model, NULL, 0);
    }
    snprintf(f, sizeof f, "%s/train_state.safetensors", tmp);
    if (!rc) rc = tdm_ckpt_write_state(f, s, true);
    return tdm_ckpt_publish(dir, s, keep, rc);
}

int tdm_checkpoint_list(const char *dir, int64_t *steps, int cap) {
    if (!dir || cap < 0 || (cap && !steps))
        return tdm_raise(TDM_ERR_ARG, "checkpoint_list: NULL argument");
    struct stat st;
    if (stat(dir, &st) != 0 && errno == ENOENT) return 0;
    int n;
    int64_t *all = list_ckpts(dir, &n);
    if (!all)
        return tdm_raise(TDM_ERR_IO, "checkpoint: cannot list '%s': %s", dir, strerror(errno));
    for (int i = 0; i < n && i < cap; i++) steps[i] = all[i];
    free(all);
    return n;
}

int tdm_checkpoint_clear(const char *dir) {
    if (!dir) return tdm_raise(TDM_ERR_ARG, "checkpoint_clear: NULL directory");
    DIR *d = opendir(dir);
    if (!d)
        return errno == ENOENT ? TDM_OK
                               : tdm_raise(TDM_ERR_IO, "checkpoint: cannot list '%s': %s", dir,
                                           strerror(errno));
    int rc = TDM_OK;
    struct dirent *e;
    char p[4200];
    while (!rc && (e = readdir(d)) != NULL) {
        const char *name = e->d_name, *dot = strrchr(name, '.');
        bool temp = strncmp(name, ".ckpt-", 6) == 0 && dot &&
                    (strcmp(dot, ".tmp") == 0 || strcmp(dot, ".old") == 0);
        if (ckpt_step(name) < 0 && !temp) continue;
        snprintf(p, sizeof p, "%s/%s", dir, name);
        if (tdm_ckpt_remove_dir(p) != 0)
            rc = tdm_raise(TDM_ERR_IO, "checkpoint: cannot remove '%s': %s", p, strerror(errno));
    }
    closedir(d);
    return rc ? rc : tdm_io_fsync_dir(dir);
}

int tdm_checkpoint_latest(const char *dir, char *path, size_t cap, int64_t *step) {
    if (!dir || !path || cap == 0)
        return tdm_raise(TDM_ERR_ARG, "checkpoint_latest: NULL argument");
    struct stat st;
    if (stat(dir, &st) != 0)
        return errno == ENOENT ? 0
                               : tdm_raise(TDM_ERR_IO,
                                           "checkpoint: cannot read "
                                           "'%s': %s",
                                           dir, strerror(errno));
    int n;
    int64_t *steps = list_ckpts(dir, &n);
    if (!steps)
        return tdm_raise(TDM_ERR_IO, "checkpoint: cannot list '%s': %s", dir, strerror(errno));
    int found = n > 0;
    if (found) {
        snprintf(path, cap, "%s/ckpt-%010" PRId64, dir, steps[n - 1]);
        if (step) *step = steps[n - 1];
    }
    free(steps);
    return found;
}

/* ---- loading ------------------------------------------------------------------------------ */

/* Metadata key of f as an integer (hex floats for "%a" values go through parse_float). */
static int meta_i64(tdm_safetensors *f, const char *key, int64_t *out, bool required) {
    const char *v = tdm_safetensors_meta(f, key);
    char what[256];
    tdm_safetensors_what(f, what, sizeof what);
    if (!v)
        return required ? tdm_raise(TDM_ERR_FORMAT, "checkpoint '%s': metadata '%s' is missing",
                                    what, key)
                        : 1;
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end || errno == ERANGE)
        return tdm_raise(TDM_ERR_FORMAT, "checkpoint '%s': metadata %s = '%.40s' is not an integer",
                         what, key, v);
    *out = x;
    return TDM_OK;
}

static int meta_u64(tdm_safetensors *f, const char *key, uint64_t *out) {
    const char *v = tdm_safetensors_meta(f, key);
    char what[256];
    tdm_safetensors_what(f, what, sizeof what);
    char *end;
    errno = 0;
    unsigned long long x = v ? strtoull(v, &end, 10) : 0;
    if (!v || end == v || *end || errno == ERANGE || v[0] == '-')
        return tdm_raise(TDM_ERR_FORMAT, "checkpoint '%s': metadata %s is %s%.40s%s", what, key,
                         v ? "'" : "missing", v ? v : "", v ? "', not an unsigned integer" : "");
    *out = x;
    return TDM_OK;
}

typedef struct {
    int64_t step, optim_steps, epoch, batch;
    double lr;
    uint64_t seed, offset;
} parsed_state;

/* The saved data position as a batch of loader, into p. From the global position (samples of
 * the epoch over every rank), so that a run resumes on another number of ranks or another
 * split of the same global batch; older files hold rank 0's samples (read right on as many
 * ranks as saved them) or, older still, its batches. */
static int check_position(tdm_safetensors *f, const tdm_loader *loader, const char *what,
                          parsed_state *p) {
    bool global = tdm_safetensors_meta(f, "loader.global_sample") != NULL;
    const char *key = global                                     ? "loader.global_sample"
                      : tdm_safetensors_meta(f, "loader.sample") ? "loader.sample"
                                                                 : NULL;
    int64_t sample = -1;
    int rc = meta_i64(f, "loader.epoch", &p->epoch, true);
    if (!rc && p->epoch < 0)
        return tdm_raise(TDM_ERR_FORMAT, "checkpoint '%s': loader.epoch %lld is negative", what,
                         (long long)p->epoch);
    if (!rc && !key) rc = meta_i64(f, "loader.batch", &p->batch, true);
    if (!rc && key && !(rc = meta_i64(f, key, &sample, true))) {
        rc = global ? tdm_loader_global_batch_at(loader, sample, &p->batch)
                    : tdm_loader_batch_at(loader, sample, &p->batch);
        if (rc) {
            char why[320]; /* the message is rewritten: copied out first */
            snprintf(why, sizeof why, "%s", tdm_last_error());
            return tdm_raise(TDM_ERR_FORMAT, "checkpoint '%s': %s: %s (another batch size?)", what,
                             key, why);
        }
    }
    if (!rc && (p->batch < 0 || p->batch > tdm_loader_batches(loader)))
        return tdm_raise(TDM_ERR_FORMAT,
                         "checkpoint '%s': loader.batch %lld does not fit this loader's %lld "
                         "batches per epoch (another batch size or dataset?)",
                         what, (long long)p->batch, (long long)tdm_loader_batches(loader));
    return rc;
}

/* The step a checkpoint directory's name gives ("ckpt-<digits>", by which
 * tdm_checkpoint_latest orders them), or -1 for another name. */
static int64_t dir_step(const char *path) {
    char name[4096];
    snprintf(name, sizeof name, "%s", path);
    for (size_t n = strlen(name); n > 1 && name[n - 1] == '/'; n--) name[n - 1] = '\0';
    const char *base = strrchr(name, '/');
    return ckpt_step(base ? base + 1 : name);
}

/* The step, checked: a count of steps, and the one its directory is named for (a step
 * other than the name's would make the next save and resume pick the wrong checkpoint). */
static int check_step(tdm_safetensors *f, const char *path, const char *what, parsed_state *p) {
    int rc = meta_i64(f, "step", &p->step, true);
    int64_t named = dir_step(path);
    if (!rc && p->step < 0)
        return tdm_raise(TDM_ERR_FORMAT, "checkpoint '%s': step %lld is negative", what,
                         (long long)p->step);
    if (!rc && named >= 0 && p->step != named)
        return tdm_raise(TDM_ERR_FORMAT,
                         "checkpoint '%s': step %lld, but its directory is named for step %lld "
                         "(renamed, or the file altered?)",
                         what, (long long)p->step, (long long)named);
    return rc;
}

/* A state tensor of the file whose shape or dtype does not fit the optimizer's: a bad file
 * (TDM_ERR_FORMAT), with tdm_safetensors_check's message naming both sides. */
static int check_state_tensor(tdm_safetensors *f, int k, const tdm_tensor *t) {
    if (tdm_safetensors_check(f, k, t) == TDM_OK) return TDM_OK;
    char msg[600];
    snprintf(msg, sizeof msg, "%s", tdm_last_error());
    return tdm_raise(TDM_ERR_FORMAT, "%s", msg);
}

/* Checks the state file against s and parses its numbers; changes nothing. */
static int check_state(tdm_safetensors *f, const char *path, const tdm_train_state *s,
                       const optim_views *v, parsed_state *p) {
    char what[256];
    tdm_safetensors_what(f, what, sizeof what);
    const char *ver = tdm_safetensors_meta(f, "tandem.checkpoint");
    if (!ver || strcmp(ver, CKPT_VERSION) != 0)
        return tdm_raise(TDM_ERR_FORMAT, "checkpoint '%s': format version %s%.20s%s, expected %s",
                         what, ver ? "'" : "(missing)", ver ? ver : "", ver ? "'" : "",
                         CKPT_VERSION);
    int rc = check_step(f, path, what, p);
    if (!rc && s->optim) {
        const char *kind = tdm_safetensors_meta(f, "optim.kind");
        if (!kind)
            return tdm_raise(TDM_ERR_FORMAT, "checkpoint '%s' holds no optimizer state", what);
        if (strcmp(kind, tdm_optim_kind(s->optim)) != 0)
            return tdm_raise(TDM_ERR_FORMAT, "checkpoint '%s': the optimizer was %.20s, now %s",
                             what, kind, tdm_optim_kind(s->optim));
        rc = meta_i64(f, "optim.steps", &p->optim_steps, true);
        if (!rc && p->optim_steps < 0)
            return tdm_raise(TDM_ERR_FORMAT, "checkpoint '%s': optim.steps %lld is negative", what,
                             (long long)p->optim_steps);
        const char *lr = tdm_safetensors_meta(f, "optim.lr");
        char *end = NULL;
        p->lr = lr ? strtod(lr, &end) : 0;
        if (!rc && (!lr || end == lr || *end))
            return tdm_raise(TDM_ERR_FORMAT, "checkpoint '%s': metadata optim.lr is %s%.40s%s",
                             what, lr ? "'" : "missing", lr ? lr : "", lr ? "', not a number" : "");
        if (!rc && !(isfinite(p->lr) && p->lr >= 0 && p->lr <= FLT_MAX))
            return tdm_raise(TDM_ERR_FORMAT,
                             "checkpoint '%s': optim.lr %s is not a learning rate (a finite "
                             "float >= 0)",
                             what, lr);
        for (int i = 0; !rc && i < v->n; i++) {
            int k = tdm_safetensors_find(f, v->t[i].name);
            rc = k < 0 ? tdm_raise(TDM_ERR_FORMAT,
                                   "checkpoint '%s': optimizer state '%s' is "
                                   "missing (was the optimizer built with other "
                                   "options, e.g. momentum or amsgrad?)",
                                   what, v->t[i].name)
                       : check_state_tensor(f, k, v->t[i].tensor);
        }
        if (!rc && tdm_safetensors_count(f) != v->n)
            return tdm_raise(TDM_ERR_FORMAT,
                             "checkpoint '%s' holds %d optimizer tensors, the "
                             "optimizer has %d",
                             what, tdm_safetensors_count(f), v->n);
    }
    if (!rc && s->loader) rc = check_position(f, s->loader, what, p);
    if (!rc && s->rng) rc = meta_u64(f, "rng.seed", &p->seed);
    if (!rc && s->rng) rc = meta_u64(f, "rng.offset", &p->offset);
    return rc;
}

static int apply_state(tdm_safetensors *f, tdm_train_state *s, const optim_views *v,
                       const parsed_state *p) {
    int rc = TDM_OK;
    if (s->optim) {
        rc = tdm_ckpt_read_tensors(f, v->t, v->n);
        for (int k = 0; k < v->n_whole && !rc; k++) /* a sharded optimizer's part */
            rc = tdm_optim_state_load(s->optim, v->whole_names[k], v->whole[k]);
        if (!rc) rc = tdm_optim_set_steps(s->optim, p->optim_steps);
        if (rc) return rc;
        tdm_optim_set_lr(s->optim, (float)p->lr);
    }
    if (s->loader && (rc = tdm_loader_start_epoch_at(s->loader, p->epoch, p->batch))) return rc;
    if (s->rng) {
        s->rng->seed = p->seed;
        s->rng->offset = p->offset;
    }
    s->step = p->step;
    return TDM_OK;
}

int tdm_checkpoint_load(const char *path, tdm_train_state *s) {
    if (!path || !s) return tdm_raise(TDM_ERR_ARG, "checkpoint_load: NULL path or state");
    if (s->optim && !s->model)
        return tdm_raise(TDM_ERR_ARG, "checkpoint_load: an optimizer needs its model");
    char f[4200];
    tdm_safetensors *wf = NULL, *sf = NULL;
    tdm_named_tensor *ts = NULL;
    int n = 0, rc = TDM_OK;
    optim_views v = {0};
    parsed_state p = {0};
    if ((rc = tdm_scope_begin())) return rc;
    tdm_ckpt_shards sh = {0};
    bool sharded = tdm_checkpoint_is_sharded(path);
    if (sharded)
        rc = tdm_ckpt_shards_read(path, s, &sh);
    else if (s->model) {
        snprintf(f, sizeof f, "%s/model.safetensors", path);
        rc = (wf = tdm_safetensors_open(f))
                 ? tdm_ckpt_model_tensors(s->model, &ts, &n, "checkpoint_load")
                 : tdm_last_status();
        if (!rc) rc = tdm_ckpt_check_tensors(wf, ts, n);
    }
    snprintf(f, sizeof f, "%s/train_state.safetensors", path);
    if (!rc) rc = (sf = tdm_safetensors_open(f)) ? TDM_OK : tdm_last_status();
    if (!rc && s->optim && !sharded) rc = optim_views_make(s->optim, s->model, &v, true);
    if (!rc) rc = check_state(sf, path, s, &v, &p);
    /* everything checked: now change things */
    if (!rc && sharded) rc = tdm_ckpt_shards_apply(&sh, s);
    if (!rc && s->model && !sharded) rc = tdm_ckpt_read_tensors(wf, ts, n);
    if (!rc) rc = apply_state(sf, s, &v, &p);
    tdm_ckpt_shards_free(&sh);
    views_free(&v);
    tdm_scope_end();
    free(ts);
    tdm_safetensors_close(wf);
    tdm_safetensors_close(sf);
    return rc;
}

/* The metadata key of checkpoint path's training state into out: 1, 0 when absent, or an
 * error. */
static int state_meta_get(const char *path, const char *k, char *out, size_t cap) {
    char f[4200];
    snprintf(f, sizeof f, "%s/train_state.safetensors", path);
    tdm_safetensors *sf = tdm_safetensors_open(f);
    if (!sf) return tdm_last_status();
    const char *v = tdm_safetensors_meta(sf, k);
    if (v) snprintf(out, cap, "%s", v);
    tdm_safetensors_close(sf);
    return v ? 1 : 0;
}

int tdm_checkpoint_meta(const char *path, const char *key, char *out, size_t cap) {
    if (!path || !key || !out || cap == 0)
        return tdm_raise(TDM_ERR_ARG, "checkpoint_meta: NULL argument");
    char k[256];
    snprintf(k, sizeof k, "user.%s", key);
    return state_meta_get(path, k, out, cap);
}

int tdm_checkpoint_run_id(const char *path, char *out, size_t cap) {
    if (!path || !out || cap == 0)
        return tdm_raise(TDM_ERR_ARG, "checkpoint_run_id: NULL argument");
    return state_meta_get(path, "run.id", out, cap);
}
