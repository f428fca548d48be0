/* --log FILE: one JSON object per line, for scripts and plots. Lines:
 *   {"type":"config", "model":.., "optimizer":.., "lr":.., "batch_size":.., ...}
 *   {"type":"step", "epoch":1, "step":12, "global_step":12, "loss":.., "lr":.., "img_s":..}
 *     (a GPT's step lines have "tok_s", tokens per second, instead of "img_s")
 *   {"type":"epoch", "epoch":1, "train_loss":.., "train_acc":.., "test_loss":.., "test_acc":..,
 *    "seconds":.., "eval_seconds":.., "wall_s":.., "img_s":.., "loader_wait_s":.., "lr":..,
 *    "peak_bytes":[..]}
 * Steps count from 1 within an epoch; accuracies are fractions in [0, 1]; a non-finite number
 * is written as null (JSON has no NaN). peak_bytes has one integer per device of --devices, in
 * that order: the most bytes of tensors the device's memory pool held at once during the
 * epoch's training steps (tdm_memory_stats.peak_allocated; under mpirun, rank 0's devices).
 * wall_s is the seconds from the process's start to the end of the epoch's evaluation, when
 * its test accuracy is known: time to accuracy, start-up and data loading included (a resumed
 * run counts from its own start). */
#ifndef TANDEM_TOOLS_LOG_H
#define TANDEM_TOOLS_LOG_H

#include <stdint.h>
#include <stdio.h>

/* What one epoch measured; shared by the log, the plot and the console. */
typedef struct {
    int epoch; /* from 1 */
    double train_loss, train_acc, test_loss, test_acc;
    double seconds;      /* training steps only */
    double eval_seconds; /* the test pass */
    double wall_s;       /* since the process started, after the test pass (progress_wall_s) */
    double img_s;
    double loader_wait_s; /* time the training loop spent waiting for batches */
    double lr;            /* at the end of the epoch */
    /* each device's allocator peak during the epoch's training, n_devices of them: borrowed
     * from the trainer, valid during the sinks_epoch call only (copies keep a stale pointer) */
    const int64_t *peak_bytes;
    int n_devices;
    /* under mpirun, each process's training seconds and seconds waiting in collectives
     * (n_ranks of each, borrowed as peak_bytes; 0 and NULL otherwise), and the process
     * whose compute (the difference) is well above the median's, or -1 */
    int n_ranks;
    const double *rank_seconds, *rank_wait_s;
    int straggler;
} epoch_stats;

typedef struct {
    FILE *f;    /* NULL: logging off, every call is a no-op */
    int failed; /* errno of the first write that failed (a full disk), 0 while none has */
} run_log;

/* Opens path for writing (truncating it). Returns 0, or -1 with errno set. */
int log_open(run_log *l, const char *path);
/* A config line; fields is preformatted JSON members ("\"model\":\"mlp\",..."). */
void log_config(run_log *l, const char *fields);
/* rate_key names the throughput: "img_s" (images per second) or "tok_s" (tokens). */
void log_step(run_log *l, int epoch, int64_t step, int64_t global_step, double loss, double lr,
              const char *rate_key, double rate);
/* An epoch line, flushed. Returns 0, or -1 with errno set once a write has failed. */
int log_epoch(run_log *l, const epoch_stats *e);
/* Test accuracy against wall time, as read back from a --log file. */
typedef struct {
    double *wall_s, *test_acc; /* [n] in the file's order */
    int n;
} log_curve;

/* Reads the epoch lines of a --log file, or of any script that writes the same JSON lines
 * (bench/torch_recipe.py): "type":"epoch" with numbers "test_acc" (a fraction) and "wall_s".
 * Other lines, and epoch lines where either is missing or null, are skipped. Returns 0, or -1
 * with why (cap bytes) saying what is wrong: the file does not read, a value is out of range
 * (naming the line), or no line was usable. */
int log_read_curve(const char *path, log_curve *c, char *why, size_t cap);
void log_curve_free(log_curve *c);

/* Flushes and closes. Returns 0, or -1 with errno set (the first failure's) if a write failed
 * (a full disk). */
int log_close(run_log *l);

#endif
