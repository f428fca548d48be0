/* --plot FILE.svg: training curves as a standalone SVG (no dependencies): two panels, loss and
 * accuracy, with train and test per epoch and the per-step train loss as a faint line. */
#ifndef TANDEM_TOOLS_PLOT_H
#define TANDEM_TOOLS_PLOT_H

#include <stdint.h>

#include "log.h"

typedef struct {
    const char *title;      /* "mlp on fashion-mnist" */
    const char *subtitle;   /* "sgd lr 0.1 momentum 0.9, batch 64" */
    const float *step_loss; /* [n_steps] train loss of every step so far */
    int64_t n_steps;
    int64_t steps_per_epoch;
    const epoch_stats *epochs; /* [n_epochs] finished epochs */
    int n_epochs;
    int total_epochs; /* the x axis spans [0, total_epochs] */
} plot_data;

/* Writes the SVG to path (replacing it). Returns 0, or -1 with errno set. */
int plot_write_svg(const char *path, const plot_data *d);

#endif
