/* The training loop of `tandem train`, the same for every task (task.h): devices (one, data
 * parallel, pipelined; several processes under mpirun), the optimizer's schedule, gradient
 * clipping and accumulation, checkpoints and resume, progress and the outputs of sink.h. */
#ifndef TANDEM_TOOLS_TRAINER_H
#define TANDEM_TOOLS_TRAINER_H

#include "task.h"
#include "train.h"

/* Trains t as the options o ask. procs: every process under mpirun (this one trains its share
 * of each global batch and prints nothing unless it is rank 0), or NULL. Returns an exit
 * status after printing any error; t stays the caller's. */
int trainer_run(const train_opts *o, task *t, tdm_group *procs);

#endif
