/* --plot FILE.svg: training curves as a standalone SVG (no dependencies): two panels, loss and
 * accuracy, with train and test per epoch and the per-step train loss as a faint line; or
 * (loss_only, a GPT) the loss panel alone. */
#ifndef TANDEM_TOOLS_PLOT_H
#define TANDEM_TOOLS_PLOT_H

#include <stdbool.h>
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
    double total_epochs;    /* the x axis spans [0, total_epochs] */
    bool loss_only;         /* no accuracy panel (a language model) */
    const char *loss_label; /* the loss axis's title; NULL: "cross-entropy loss" */
} plot_data;

/* Writes the SVG to path (replacing it). Returns 0, or -1 with errno set. */
int plot_write_svg(const char *path, const plot_data *d);

#endif
