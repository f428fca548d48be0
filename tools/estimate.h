/* The memory a training run needs on each device, worked out from the options and the task's
 * data before the model is built: `tandem train --dry-run` prints it, and a run that cannot
 * fit in this machine's memory is refused before it starts building (issue 36). */
#ifndef TANDEM_TOOLS_ESTIMATE_H
#define TANDEM_TOOLS_ESTIMATE_H

#include <stdio.h>

#include "task.h"
#include "train.h"

/* Bytes on one device at the peak of a step, counted at the allocator's size classes. */
typedef struct {
    int64_t params, grads, optim; /* weights, their gradients, the optimizer's state */
    int64_t acts;                 /* a step's activations, their gradients, kernels' scratch */
    int64_t data;                 /* the loaders' batch buffers and the trainer's step buffers */
    int64_t total;
} estimate_device;

typedef struct {
    int64_t n_params; /* the model's parameters (elements) */
    int64_t samples;  /* samples of a batch on device 0 (min(batch, data) split over devices) */
    int n_devs;       /* devices of this process */
    int64_t acts_recompute; /* device 0's activations under --recompute (0: no units) */
    estimate_device dev[TDM_MAX_DEVICES];
} estimate;

/* What the trainer will build for t (opened, its model not yet built) under options o, with
 * procs processes (1 without mpirun) and the loaders' options lo and eo (eo NULL without a
 * test split), into *e: the model's part counted by its row of the registry
 * (tdm_model_cost_of on t->row and t->sizes). Returns 0, or EXIT_RUNTIME after printing why
 * the loaders' options are invalid or the row refused the sizes. Allocates nothing. */
int estimate_make(const train_opts *o, const task *t, int procs, const tdm_loader_opts *lo,
                  const tdm_loader_opts *eo, estimate *e);

/* Prints e to out, one line per device and part ("memory    cpu:0  parameters 1.2 MiB ..."),
 * with this machine's memory limit and each GPU's. */
void estimate_print(const estimate *e, const train_opts *o, FILE *out);

/* 0 when what e needs on the CPU devices of this process (they share this machine's memory)
 * fits under the memory the process may use (physical memory, RLIMIT_AS, the cgroup's
 * memory.max: the least), less a margin, and each GPU's share under that GPU's memory less a
 * margin; else EXIT_RUNTIME after an error naming the device, the figures and what would make
 * the run fit. */
int estimate_check(const estimate *e, const train_opts *o);

#endif
