/* The flight recorder of a run under mpirun (tdm_group_dump_flight on the processes' group):
 * each process writes DIR/flight-rank-R.jsonl, DIR being --debug-dir (default: the checkpoint
 * directory, else /tmp/tandem-debug-JOB, JOB the launcher's job id), when its run fails and
 * whenever SIGUSR1, SIGTERM or SIGINT arrives; a watcher thread waits for the signals, so a process
 * stuck in a collective (mpirun stops the others when one dies, and kills them a second later)
 * still writes its file. `tandem doctor DIR` merges the files. */
#ifndef TANDEM_TOOLS_TRAINER_DEBUG_H
#define TANDEM_TOOLS_TRAINER_DEBUG_H

#include "train.h"

#include <pthread.h>
#include <stdatomic.h>

typedef struct {
    tdm_group *g;
    char path[4096]; /* DIR/flight-rank-R.jsonl */
    pthread_t thread;
    bool started;
    atomic_bool quit;
} trainer_debug;

/* Starts the SIGUSR1 watcher of g (nothing without a group: d stays inert). 0, or EXIT_RUNTIME
 * after printing why (a --debug-dir that is not a directory). Call after tdm_stop_on_signals. */
int trainer_debug_start(trainer_debug *d, const train_opts *o, tdm_group *g);
/* Writes the flight recorder now, saying where on stderr with why ("the run failed"). */
void trainer_debug_dump(trainer_debug *d, const char *why);
/* Stops and joins the watcher. */
void trainer_debug_stop(trainer_debug *d);

#endif
