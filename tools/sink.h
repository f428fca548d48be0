/* Where the trainer's records go, behind one interface: --log (JSON lines, log.c), --plot
 * (SVG, plot.c), --tensorboard (event files, tandem/tensorboard.h) and --trace (the Chrome
 * trace of tandem/trace.h, which records itself and is only started and stopped here).
 *
 * Every output is opened by sinks_open, before the first step, so a path that cannot be
 * written fails at once rather than after the training; the runs --plot-compare draws beside
 * this one are read then too (that no output is an input was checked before: paths.h).
 * Records are buffered and written as the run goes (the log at each epoch and whenever its
 * buffer fills, the trace at each progress line and the plot redrawn there), so a kill loses
 * only the last of them; errors of buffered writes surface at the next flush or at close,
 * naming the file and errno. */
#ifndef TANDEM_TOOLS_SINK_H
#define TANDEM_TOOLS_SINK_H

#include <stdbool.h>
#include <stdint.h>

#include "log.h"
#include "train.h"

/* One optimizer step, as every sink records it. */
typedef struct {
    int epoch;           /* from 1 */
    int64_t step;        /* from 1 within the epoch */
    int64_t global_step; /* from 1 across epochs and resumes */
    double loss, lr;
    double rate; /* samples' units per second (images or tokens: sinks_info.unit) */
} step_record;

/* What the sinks show of the run; strings are copied. */
typedef struct {
    const char *title;      /* "mlp on fashion-mnist: sgd lr 0.1 momentum 0.9" */
    const char *subtitle;   /* "batch 64, 60000 train samples, seed 0, cpu:0" */
    const char *unit;       /* "img" or "tok": the rate's key is "<unit>_s" */
    const char *loss_label; /* the plot's loss axis; NULL: cross-entropy */
    bool accuracy;          /* the epochs have accuracies (the plot's second panel) */
    int64_t steps_per_epoch, epochs;
} sinks_info;

typedef struct sink sink;
typedef struct compare_set compare_set; /* --plot-compare's runs (sinks.c) */
typedef struct {
    sink *open[4]; /* the outputs asked for, in opening order */
    int n;
    compare_set *compare; /* read by sinks_open, drawn by the plot, freed by sinks_close */
} sinks;

/* One FILE[=LABEL] item of --plot-compare split in place: item becomes the FILE, and the
 * LABEL (pointing into item) is returned, or NULL when there is none. A FILE holding '=' is
 * taken whole when it exists; otherwise the text after the last '=' is the label. */
const char *sinks_compare_split(char *item);
/* Opens every output the options name (none is fine), after reading --plot-compare's files.
 * Returns 0; EXIT_USAGE for --plot-compare without --plot or without test accuracy to compare;
 * or EXIT_RUNTIME after printing which file could not be read or opened and why. What was
 * opened is closed. */
int sinks_open(sinks *s, const train_opts *o, const sinks_info *info);
/* The run's configuration as JSON members ("\"model\":\"mlp\",..."): --log's first line. */
void sinks_config(sinks *s, const char *json_fields);
void sinks_step(sinks *s, const step_record *r);
/* After each epoch: its line, its curves, and the plot redrawn. Returns 0 or EXIT_RUNTIME. */
int sinks_epoch(sinks *s, const epoch_stats *e);
/* At a progress line: buffered records written out (the plot redrawn). 0 or EXIT_RUNTIME. */
int sinks_flush(sinks *s);
/* Closes every output; prints "log       FILE" and the like unless quiet (and rc is 0).
 * Returns rc, or EXIT_RUNTIME when rc was 0 and an output failed (the error printed). */
int sinks_close(sinks *s, int rc, bool quiet);

#endif
