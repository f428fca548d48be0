/* JSON-lines training log. Steps are written from a buffered FILE (one fprintf each, no
 * flush), so logging every step costs microseconds; each epoch line is flushed so a reader
 * following the file (tail -f, a plotting script) sees whole epochs promptly. */
#include "log.h"

#include <errno.h>
#include <math.h>

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
    num(l->f, "img_s", e->img_s, ",");
    num(l->f, "loader_wait_s", e->loader_wait_s, ",");
    num(l->f, "lr", e->lr, ",");
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
