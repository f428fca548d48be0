/* The trainer's outputs behind sink.h's one interface. Each output is a struct whose first
 * member is `sink` (its table of calls); a call an output does not need is NULL. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "plot.h"
#include "sink.h"
#include "task.h"

struct sink {
    const char *label; /* the closing line's name: "log", "plot", ... */
    const char *path;
    void (*config)(sink *, const char *json_fields);
    void (*step)(sink *, const step_record *);
    int (*epoch)(sink *, const epoch_stats *);
    int (*flush)(sink *);
    int (*close)(sink *); /* also frees */
};

/* ---- --log: JSON lines ----------------------------------------------------------------- */

typedef struct {
    sink base;
    run_log log;
    char rate_key[16];
} json_sink;

static void json_config(sink *s, const char *fields) {
    log_config(&((json_sink *)s)->log, fields);
}
static void json_step(sink *s, const step_record *r) {
    json_sink *j = (json_sink *)s;
    log_step(&j->log, r->epoch, r->step, r->global_step, r->loss, r->lr, j->rate_key, r->rate);
}
static int json_epoch(sink *s, const epoch_stats *e) {
    return log_epoch(&((json_sink *)s)->log, e);
}
static int json_close(sink *s) {
    int rc = log_close(&((json_sink *)s)->log);
    free(s);
    return rc;
}

static sink *json_open(const char *path, const sinks_info *info, const compare_set *cmp) {
    (void)cmp;
    json_sink *j = calloc(1, sizeof *j);
    if (!j || log_open(&j->log, path) != 0) return free(j), NULL;
    snprintf(j->rate_key, sizeof j->rate_key, "%s_s", info->unit);
    j->base = (sink){"log", path, json_config, json_step, json_epoch, NULL, json_close};
    return &j->base;
}

/* ---- --plot-compare: other runs' --log files, read once before training ------------------ */

struct compare_set {
    log_curve data[PLOT_MAX_COMPARE];
    char labels[PLOT_MAX_COMPARE][128];
    plot_curve curves[PLOT_MAX_COMPARE]; /* pointing into data and labels */
    int n;
};

static void compare_free(compare_set *c) {
    for (int i = 0; c && i < c->n; i++) log_curve_free(&c->data[i]);
    free(c);
}

const char *sinks_compare_split(char *item) {
    char *eq = access(item, F_OK) == 0 ? NULL : strrchr(item, '=');
    if (!eq) return NULL;
    *eq = '\0';
    return eq[1] ? eq + 1 : NULL;
}

/* One FILE[=LABEL] of the list into c. Returns 0 or an exit status. */
static int compare_read_one(compare_set *c, char *item) {
    if (c->n == PLOT_MAX_COMPARE)
        return train_usage_error("--plot-compare: at most %d files (one colour each)",
                                 PLOT_MAX_COMPARE);
    const char *label = sinks_compare_split(item);
    const char *base = strrchr(item, '/') ? strrchr(item, '/') + 1 : item;
    if (!label) label = base;
    if (!*item) return train_usage_error("--plot-compare: an empty file name");
    char why[256];
    if (log_read_curve(item, &c->data[c->n], why, sizeof why) != 0)
        return task_error("--plot-compare '%s': %s", item, why);
    snprintf(c->labels[c->n], sizeof c->labels[c->n], "%s", label);
    const log_curve *d = &c->data[c->n];
    c->curves[c->n] = (plot_curve){c->labels[c->n], d->wall_s, d->test_acc, d->n};
    c->n++;
    return 0;
}

/* --plot-compare FILE[=LABEL],...: every file read now, so a bad one stops the run before it
 * starts. *out stays NULL without the option. Returns 0 or an exit status. */
static int compare_read(const train_opts *o, const sinks_info *info, compare_set **out) {
    *out = NULL;
    if (!o->plot_compare) return 0;
    if (!o->plot_path)
        return train_usage_error("--plot-compare draws other runs into the chart of --plot; "
                                 "give --plot FILE.svg too");
    if (!info->accuracy)
        return train_usage_error("--plot-compare compares test accuracy, which this model "
                                 "does not measure");
    compare_set *c = calloc(1, sizeof *c);
    char *list = strdup(o->plot_compare), *save = NULL;
    int rc = c && list ? 0 : task_error("--plot-compare: %s", strerror(ENOMEM));
    for (char *item = list ? strtok_r(list, ",", &save) : NULL; !rc && item;
         item = strtok_r(NULL, ",", &save))
        rc = compare_read_one(c, item);
    free(list);
    if (!rc && c->n == 0)
        rc = train_usage_error("--plot-compare: no file in '%s'", o->plot_compare);
    if (rc) return compare_free(c), rc;
    *out = c;
    return 0;
}

/* ---- --plot: the SVG curves, redrawn at each progress line and epoch --------------------- */

typedef struct {
    sink base;
    sinks_info info;
    const compare_set *compare; /* NULL, or the set's: sinks_close frees it after the plot */
    char title[256], subtitle[320];
    float *step_loss; /* [cap] by global step - 1; NaN for steps before a resume */
    int64_t n_steps, cap;
    epoch_stats *epochs; /* [info.epochs] */
    int n_epochs;
} plot_sink;

static void plot_step(sink *s, const step_record *r) {
    plot_sink *p = (plot_sink *)s;
    if (r->global_step > p->cap) { /* doubling: a run may go on past its first plan */
        int64_t cap = r->global_step * 2;
        float *grown = realloc(p->step_loss, sizeof(float) * (size_t)cap);
        if (!grown) return; /* the curve stops; training goes on */
        p->step_loss = grown, p->cap = cap;
    }
    while (p->n_steps < r->global_step - 1) p->step_loss[p->n_steps++] = NAN;
    p->step_loss[r->global_step - 1] = (float)r->loss;
    if (p->n_steps < r->global_step) p->n_steps = r->global_step;
}

static int plot_flush(sink *s) {
    plot_sink *p = (plot_sink *)s;
    const epoch_stats *last = p->n_epochs ? &p->epochs[p->n_epochs - 1] : NULL;
    char sub[400];
    if (last && p->info.accuracy)
        snprintf(sub, sizeof sub, "%s; test accuracy %.2f%%", p->subtitle, 100 * last->test_acc);
    else
        snprintf(sub, sizeof sub, "%s", p->subtitle);
    plot_data d = {.title = p->title,
                   .subtitle = sub,
                   .step_loss = p->step_loss,
                   .n_steps = p->n_steps,
                   .steps_per_epoch = p->info.steps_per_epoch,
                   .epochs = p->epochs,
                   .n_epochs = p->n_epochs,
                   .total_epochs = (double)p->info.epochs,
                   .loss_only = !p->info.accuracy,
                   .loss_label = p->info.loss_label,
                   .compare = p->compare ? p->compare->curves : NULL,
                   .n_compare = p->compare ? p->compare->n : 0};
    return plot_write_svg(s->path, &d) != 0 ? -1 : 0;
}

static int plot_epoch(sink *s, const epoch_stats *e) {
    plot_sink *p = (plot_sink *)s;
    if (p->n_epochs < p->info.epochs) p->epochs[p->n_epochs++] = *e;
    return plot_flush(s);
}

static int plot_close(sink *s) {
    plot_sink *p = (plot_sink *)s;
    int rc = plot_flush(s);
    free(p->step_loss);
    free(p->epochs);
    free(p);
    return rc;
}

static sink *plot_open(const char *path, const sinks_info *info, const compare_set *cmp) {
    plot_sink *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->info = *info;
    p->compare = cmp;
    snprintf(p->title, sizeof p->title, "%s", info->title);
    snprintf(p->subtitle, sizeof p->subtitle, "%s", info->subtitle);
    p->epochs = calloc((size_t)info->epochs, sizeof *p->epochs);
    p->base = (sink){"plot", path, NULL, plot_step, plot_epoch, plot_flush, plot_close};
    if (!p->epochs || plot_flush(&p->base) != 0) { /* an empty plot: the path is writable */
        free(p->epochs);
        free(p);
        return NULL;
    }
    return &p->base;
}

/* ---- --tensorboard: event files ----------------------------------------------------------- */

typedef struct {
    sink base;
    tdm_tb_writer *w;
    char rate_tag[32];
    int bad; /* a failed write, reported at the next flush */
} tb_sink;

static void tb_scalar(tb_sink *t, const char *tag, int64_t step, double v) {
    if (isfinite(v) && tdm_tb_add_scalar(t->w, tag, step, v, 0) != TDM_OK) t->bad = 1;
}

static void tb_step(sink *s, const step_record *r) {
    tb_sink *t = (tb_sink *)s;
    tb_scalar(t, "train/loss", r->global_step, r->loss);
    tb_scalar(t, "train/lr", r->global_step, r->lr);
    tb_scalar(t, t->rate_tag, r->global_step, r->rate);
}

/* Epoch scalars at the epoch's number, as PyTorch examples log them. */
static int tb_epoch(sink *s, const epoch_stats *e) {
    tb_sink *t = (tb_sink *)s;
    tb_scalar(t, "epoch/train_loss", e->epoch, e->train_loss);
    tb_scalar(t, "epoch/train_acc", e->epoch, e->train_acc);
    tb_scalar(t, "epoch/test_loss", e->epoch, e->test_loss);
    tb_scalar(t, "epoch/test_acc", e->epoch, e->test_acc);
    return s->flush(s);
}

static int tb_flush(sink *s) {
    tb_sink *t = (tb_sink *)s;
    return t->bad || tdm_tb_flush(t->w) != TDM_OK ? -1 : 0;
}

static int tb_close(sink *s) {
    tb_sink *t = (tb_sink *)s;
    int rc = tdm_tb_close(t->w) != TDM_OK || t->bad ? -1 : 0;
    free(t);
    return rc;
}

static sink *tb_open(const char *dir, const sinks_info *info, const compare_set *cmp) {
    (void)cmp;
    tb_sink *t = calloc(1, sizeof *t);
    if (!t || !(t->w = tdm_tb_open(dir))) return free(t), NULL;
    snprintf(t->rate_tag, sizeof t->rate_tag, "train/%s_per_s", info->unit);
    t->base = (sink){"tensorboard", dir, NULL, tb_step, tb_epoch, tb_flush, tb_close};
    return &t->base;
}

/* ---- --trace: the Chrome trace records itself and streams to its file; this starts it,
 * writes it out at each progress line (what a kill would lose) and stops it ------------- */

static int trace_flush(sink *s) {
    (void)s;
    return tdm_trace_flush() != 0 ? -1 : 0;
}

static int trace_close(sink *s) {
    free(s);
    return tdm_trace_stop() != 0 ? -1 : 0;
}

static sink *trace_open(const char *path, const sinks_info *info, const compare_set *cmp) {
    (void)info, (void)cmp;
    sink *s = calloc(1, sizeof *s);
    if (!s || tdm_trace_start(path, 0) != 0) return free(s), NULL;
    *s = (sink){"trace", path, NULL, NULL, NULL, trace_flush, trace_close};
    return s;
}

/* ---- the set --------------------------------------------------------------------------- */

/* The output's error: the library's message when it raised one, else errno's. */
static const char *sink_error(void) {
    const char *e = tdm_last_error();
    return e && *e ? e : strerror(errno);
}

int sinks_open(sinks *s, const train_opts *o, const sinks_info *info) {
    struct {
        const char *path, *option;
        sink *(*open)(const char *, const sinks_info *, const compare_set *);
    } outs[] = {{o->trace_path, "--trace", trace_open},
                {o->log_path, "--log", json_open},
                {o->plot_path, "--plot", plot_open},
                {o->tensorboard_dir, "--tensorboard", tb_open}};
    *s = (sinks){0};
    int rc = compare_read(o, info, &s->compare);
    if (rc) return rc;
    for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++) {
        if (!outs[i].path) continue;
        tdm_clear_error();
        errno = 0;
        sink *k = outs[i].open(outs[i].path, info, s->compare);
        if (!k) {
            task_error("%s '%s' cannot be written: %s", outs[i].option, outs[i].path, sink_error());
            sinks_close(s, EXIT_RUNTIME, true);
            return EXIT_RUNTIME;
        }
        s->open[s->n++] = k;
    }
    return 0;
}

void sinks_config(sinks *s, const char *json_fields) {
    for (int i = 0; i < s->n; i++)
        if (s->open[i]->config) s->open[i]->config(s->open[i], json_fields);
}

void sinks_step(sinks *s, const step_record *r) {
    for (int i = 0; i < s->n; i++)
        if (s->open[i]->step) s->open[i]->step(s->open[i], r);
}

static int failed(const sink *k) {
    return task_error("writing %s '%s' failed: %s", k->label, k->path, sink_error());
}

int sinks_epoch(sinks *s, const epoch_stats *e) {
    for (int i = 0; i < s->n; i++)
        if (s->open[i]->epoch && s->open[i]->epoch(s->open[i], e) != 0) return failed(s->open[i]);
    return 0;
}

int sinks_flush(sinks *s) {
    for (int i = 0; i < s->n; i++)
        if (s->open[i]->flush && s->open[i]->flush(s->open[i]) != 0) return failed(s->open[i]);
    return 0;
}

int sinks_close(sinks *s, int rc, bool quiet) {
    for (int i = 0; i < s->n; i++) {
        sink *k = s->open[i];
        const char *label = k->label, *path = k->path;
        tdm_clear_error();
        errno = 0;
        if (k->close(k) != 0 && rc == 0)
            rc = task_error("writing %s '%s' failed: %s", label, path, sink_error());
        else if (rc == 0 && !quiet)
            printf("%-9s %s\n", label, path);
    }
    s->n = 0;
    compare_free(s->compare); /* after the plot's last drawing */
    s->compare = NULL;
    return rc;
}
