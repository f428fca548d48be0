/* The trainer's flight recorder files (trainer_debug.h). */
#include "trainer_debug.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

void trainer_debug_dump(trainer_debug *d, const char *why) {
    if (!d->g) return;
    if (tdm_group_dump_flight(d->g, d->path))
        fprintf(stderr, "tandem train: rank %d: flight recorder not written (%s): %s\n",
                tdm_group_rank(d->g), why, tdm_last_error());
    else
        fprintf(stderr,
                "tandem train: rank %d: flight recorder (%s) in %s; tandem doctor reads "
                "every rank's\n",
                tdm_group_rank(d->g), why, d->path);
    fflush(stderr);
}

static void *watch(void *arg) {
    trainer_debug *d = arg;
    while (!atomic_load(&d->quit))
        if (tdm_stop_wait_dump(0.2)) {
            int sig = tdm_stop_requested();
            trainer_debug_dump(d, sig == SIGUSR1  ? "SIGUSR1"
                                  : sig == SIGINT ? "SIGINT"
                                                  : "SIGTERM");
        }
    return NULL;
}

int trainer_debug_start(trainer_debug *d, const train_opts *o, tdm_group *g) {
    memset(d, 0, sizeof *d);
    if (!g) return 0;
    /* without a directory given: the checkpoints', else one a job under /tmp (the job's id
     * from the launcher, so that every process of it writes into the same) */
    char tmp[256];
    const char *job = getenv("SLURM_JOB_ID") ? getenv("SLURM_JOB_ID") : getenv("PMIX_NAMESPACE");
    snprintf(tmp, sizeof tmp, "/tmp/tandem-debug-%s", job ? job : "mpirun");
    for (char *c = tmp + 5; *c; c++) *c = *c == '/' ? '_' : *c;
    const char *dir = o->debug_dir ? o->debug_dir : o->checkpoint_dir ? o->checkpoint_dir : tmp;
    if (dir == tmp) mkdir(tmp, 0755); /* EEXIST: another process's, or a last run's */
    struct stat st;
    if (o->debug_dir && (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))) {
        fprintf(stderr, "tandem train: error: --debug-dir %s: not a directory\n", dir);
        return EXIT_RUNTIME;
    }
    d->g = g;
    snprintf(d->path, sizeof d->path, "%s/flight-rank-%d.jsonl", dir, tdm_group_rank(g));
    atomic_init(&d->quit, false);
    d->started = pthread_create(&d->thread, NULL, watch, d) == 0;
    if (!d->started) fprintf(stderr, "tandem train: no SIGUSR1 watcher (pthread_create failed)\n");
    return 0;
}

void trainer_debug_stop(trainer_debug *d) {
    if (!d->started) return;
    atomic_store(&d->quit, true);
    pthread_join(d->thread, NULL);
    d->started = false;
}
