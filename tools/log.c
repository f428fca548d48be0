/* JSON-lines training log. Steps are written from a buffered FILE (one fprintf each, no
 * flush), so logging every step costs microseconds; each epoch line is flushed so a reader
 * following the file (tail -f, a plotting script) sees whole epochs promptly. */
#include "log.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

int log_open(run_log *l, const char *path) {
    l->f = fopen(path, "w");
    return l->f ? 0 : -1;
}

/* A JSON number, or null for NaN and infinities. */
static void num(FILE *f, const char *key, double v, const char *sep) {
    if (isfinite(v))
        fprintf(f, "\"%s\":%.7g%s", key, v, sep);
    else
        fprintf(f, "\"%s\":null%s", key, sep);
}

void log_config(run_log *l, const char *fields) {
    if (!l->f) return;
    fprintf(l->f, "{\"type\":\"config\",%s}\n", fields);
}

void log_step(run_log *l, int epoch, int64_t step, int64_t global_step, double loss, double lr,
              const char *rate_key, double rate) {
    if (!l->f) return;
    fprintf(l->f, "{\"type\":\"step\",\"epoch\":%d,\"step\":%lld,\"global_step\":%lld,", epoch,
            (long long)step, (long long)global_step);
    num(l->f, "loss", loss, ",");
    num(l->f, "lr", lr, ",");
    num(l->f, rate_key, rate, "}\n");
}

/* Records the errno of the first failed write (fflush repeats the write the buffer could not
 * make, so its errno is the disk's); -1 once one has failed. */
static int check(run_log *l) {
    if (!l->failed && (fflush(l->f) != 0 || ferror(l->f))) l->failed = errno ? errno : EIO;
    return l->failed ? -1 : 0;
}

int log_epoch(run_log *l, const epoch_stats *e) {
    if (!l->f) return 0;
    fprintf(l->f, "{\"type\":\"epoch\",\"epoch\":%d,", e->epoch);
    num(l->f, "train_loss", e->train_loss, ",");
    num(l->f, "train_acc", e->train_acc, ",");
    num(l->f, "test_loss", e->test_loss, ",");
    num(l->f, "test_acc", e->test_acc, ",");
    num(l->f, "seconds", e->seconds, ",");
    num(l->f, "eval_seconds", e->eval_seconds, ",");
    num(l->f, "wall_s", e->wall_s, ",");
    num(l->f, "img_s", e->img_s, ",");
    num(l->f, "loader_wait_s", e->loader_wait_s, ",");
    num(l->f, "lr", e->lr, ",");
    for (int k = 0; k < 2 && e->n_ranks > 0; k++) {
        const double *v = k ? e->rank_wait_s : e->rank_seconds;
        fprintf(l->f, "\"%s\":[", k ? "rank_wait_s" : "rank_seconds");
        for (int r = 0; r < e->n_ranks; r++) fprintf(l->f, "%s%.4f", r ? "," : "", v[r]);
        fprintf(l->f, "],");
    }
    if (e->n_ranks > 0) fprintf(l->f, "\"straggler\":%d,", e->straggler);
    fprintf(l->f, "\"peak_bytes\":[");
    for (int d = 0; d < e->n_devices; d++)
        fprintf(l->f, "%s%lld", d ? "," : "", (long long)e->peak_bytes[d]);
    fprintf(l->f, "]}\n");
    return check(l);
}

int log_close(run_log *l) {
    if (!l->f) return 0;
    int bad = check(l);
    if (fclose(l->f) != 0 && !l->failed) l->failed = errno, bad = -1;
    l->f = NULL;
    errno = l->failed;
    return bad;
}

/* ---- reading epoch lines back (--plot-compare) ------------------------------------------- */

/* Where the value of member `key` starts in a one-line JSON object, or NULL. Not a JSON
 * parser: the lines read are flat objects of numbers and plain strings, written by this file
 * or by Python's json.dumps (which puts a space after ':'), so a key is a quoted name followed
 * by a colon. */
static const char *member(const char *line, const char *key) {
    size_t n = strlen(key);
    for (const char *p = line; (p = strchr(p, '"')) != NULL; p++) {
        if (strncmp(p + 1, key, n) != 0 || p[1 + n] != '"') continue;
        const char *q = p + 2 + n;
        while (*q == ' ' || *q == '\t') q++;
        if (*q != ':') continue;
        for (q++; *q == ' ' || *q == '\t';) q++;
        return q;
    }
    return NULL;
}

/* The number of member key, or NAN when it is missing, null or not a number. */
static double member_num(const char *line, const char *key) {
    const char *v = member(line, key);
    char *end;
    double x = v ? strtod(v, &end) : NAN;
    return v && end != v ? x : NAN;
}

static bool is_epoch_line(const char *line) {
    const char *v = member(line, "type");
    return v && strncmp(v, "\"epoch\"", 7) == 0;
}

static int curve_add(log_curve *c, int *cap, double wall_s, double acc) {
    if (c->n == *cap) {
        int grown = *cap ? 2 * *cap : 16;
        double *w = realloc(c->wall_s, sizeof(double) * (size_t)grown);
        if (w) c->wall_s = w;
        double *a = w ? realloc(c->test_acc, sizeof(double) * (size_t)grown) : NULL;
        if (!a) return -1;
        c->test_acc = a, *cap = grown;
    }
    c->wall_s[c->n] = wall_s, c->test_acc[c->n++] = acc;
    return 0;
}

/* One line's point: 1 added, 0 skipped, -1 with why. */
static int read_point(const char *line, long lineno, log_curve *c, int *cap, char *why,
                      size_t whycap) {
    if (!is_epoch_line(line)) return 0;
    double w = member_num(line, "wall_s"), a = member_num(line, "test_acc");
    if (!isfinite(w) || !isfinite(a)) return 0;
    if (a < 0 || a > 1 || w < 0) {
        /* a percentage for a fraction would draw a curve off the chart: say so instead */
        snprintf(why, whycap,
                 "line %ld: test_acc %g must be a fraction in [0, 1] and wall_s %g "
                 "at least 0",
                 lineno, a, w);
        return -1;
    }
    if (curve_add(c, cap, w, a) != 0) {
        snprintf(why, whycap, "%s", strerror(ENOMEM));
        return -1;
    }
    return 1;
}

int log_read_curve(const char *path, log_curve *c, char *why, size_t cap) {
    *c = (log_curve){0};
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(why, cap, "cannot be read: %s", strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t len = 0;
    int rc = 0, points_cap = 0;
    for (long lineno = 1; rc == 0 && getline(&line, &len, f) != -1; lineno++)
        if (read_point(line, lineno, c, &points_cap, why, cap) < 0) rc = -1;
    if (rc == 0 && ferror(f)) rc = -1, snprintf(why, cap, "%s", strerror(errno ? errno : EIO));
    free(line);
    fclose(f);
    if (rc == 0 && c->n == 0) {
        snprintf(why, cap,
                 "no epoch line with test_acc and wall_s (expected JSON lines such "
                 "as --log writes: {\"type\":\"epoch\", \"test_acc\":0.9, \"wall_s\":12.5})");
        rc = -1;
    }
    if (rc) log_curve_free(c);
    return rc;
}

void log_curve_free(log_curve *c) {
    free(c->wall_s);
    free(c->test_acc);
    *c = (log_curve){0};
}
