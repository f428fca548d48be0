/* --plot FILE.svg: training curves as a standalone SVG (no dependencies): three panels, loss and
 * accuracy against epochs, with train and test per epoch and the per-step train loss as a
 * faint line, and test accuracy against the wall-clock seconds since the process started, with
 * other runs' curves (--plot-compare) beside this one's; or (loss_only, a GPT) the loss panel
 * alone. */
#ifndef TANDEM_TOOLS_PLOT_H
#define TANDEM_TOOLS_PLOT_H

#include <stdbool.h>
#include <stdint.h>

#include "log.h"

/* Another run's test accuracy against wall time, drawn beside this run's. */
typedef struct {
    const char *label;          /* in the legend: "PyTorch" */
    const double *wall_s, *acc; /* [n]: seconds since that process started, fractions */
    int n;
} plot_curve;

typedef struct {
    const char *title;      /* "mlp on fashion-mnist" */
    const char *subtitle;   /* "sgd lr 0.1 momentum 0.9, batch 64" */
    const float *step_loss; /* [n_steps] train loss of every step so far */
    int64_t n_steps;
    int64_t steps_per_epoch;
    const epoch_stats *epochs; /* [n_epochs] finished epochs */
    int n_epochs;
    double total_epochs;       /* the x axis spans [0, total_epochs] */
    bool loss_only;            /* no accuracy panel (a language model) */
    const char *loss_label;    /* the loss axis's title; NULL: "cross-entropy loss" */
    const plot_curve *compare; /* [n_compare] other runs, in the wall-time panel */
    int n_compare;
} plot_data;

/* The colours other runs are drawn in, one each: as many runs as these at most. */
#define PLOT_MAX_COMPARE 6

/* Writes the SVG to path (replacing it). Returns 0, or -1 with errno set. */
int plot_write_svg(const char *path, const plot_data *d);

#endif
