/* The trainer's state, shared by its files: trainer.c (the loop) and trainer_ckpt.c
 * (checkpoints, resume, and the options every process and every resume must share). */
#ifndef TANDEM_TOOLS_TRAINER_STATE_H
#define TANDEM_TOOLS_TRAINER_STATE_H

#include "progress.h"
#include "sink.h"
#include "trainer.h"

#define SYNC_STEPS     16
#define EVAL_BATCH     1000
#define ID_CAP         2048  /* bytes of train_identity's string */
#define PROCESS_ID_CAP 16384 /* bytes of train_process_identity's string */
/* values trainer_sum_over_processes sums at once: a chunk's step losses and samples, its
 * seconds and the processes' stop signals */
#define TOTALS_CAP (2 * SYNC_STEPS + 2)
/* Under mpirun the processes agree on a stop only where they read back, so chunks are cut to
 * about this many seconds of steps (at least one step): a stop signal, SIGUSR1's early warning
 * included, is obeyed within that and the step in flight, not 16 slow steps later */
#define SYNC_SECONDS 0.5

typedef struct trainer {
    const train_opts *o;
    task *task;
    tdm_device dev;
    tdm_group *g; /* under mpirun: every process, each training a share of the batch */
    bool silent;  /* a rank other than 0: prints and writes nothing */
    tdm_loader *train_l, *test_l;
    tdm_paramset *ps;
    /* how the model trains: one device, data parallel, DDP under mpirun, a pipeline, and their
     * sharded modes (tandem/strategy.h); it owns the optimizers */
    tdm_strategy *st;
    tdm_optim *opt;      /* replica 0's (the first stage's): its learning rate and step count */
    bool loss_on_caller; /* the step's loss function runs on this thread, on tr->dev */
    /* under mpirun with --tensor-parallel T the T processes of a tensor-parallel group train
     * the same rows: only the first of them counts them (samples, correct, loss sums) in the
     * totals summed over the processes; the others' stay 0 */
    bool counts;
    bool param_bf16; /* ZeRO stage 3 under DDP gathers the parameters in bf16 */
    tdm_sched sched;
    sinks out;
    progress prog;
    int64_t accum, steps_per_epoch, global_step;
    int workers; /* the loaders' workers: --workers, or its default (loader_workers) */
    /* checkpoints: the directory's lock (rank 0), the run's identity (empty: a run resumed
     * from a checkpoint written before identities), where a resumed run starts, and its
     * epoch's totals before it */
    tdm_checkpoint_lock *lock;
    char run_id[64];
    int start_epoch;
    int64_t resume_step, last_saved;
    double resume_loss_sum;
    int64_t resume_correct, resume_samples;
    bool stopped;    /* --max-steps reached, or a stop signal */
    int stop_signal; /* SIGTERM or SIGINT that stopped the run (every process agrees), or 0 */
    /* device-side records of the current chunk of steps, and their host copies */
    tdm_tensor *loss_buf; /* [SYNC_STEPS * accum] f32: each batch's mean loss */
    tdm_tensor *pred_buf; /* [SYNC_STEPS * accum * B] i64 */
    /* --cuda-graphs: a step's loss [1] and predictions [B], at fixed places (a replayed step
     * writes where the recorded one did), copied into the chunk's slots after each step */
    tdm_tensor *graph_loss, *graph_pred;
    bool graph_noted;                /* the recording's failure printed */
    float *loss_host;                /* [SYNC_STEPS * accum] */
    double *time_host, *lr_host;     /* [SYNC_STEPS] */
    int64_t *size_host;              /* [SYNC_STEPS] samples of each step */
    int64_t *pred_host, *label_host; /* [max(SYNC_STEPS * accum * B, EVAL_BATCH)] */
    int chunk_steps, micro;
    int chunk_cap;   /* steps a chunk holds: SYNC_STEPS, or fewer under mpirun (SYNC_SECONDS) */
    int stop_agreed; /* under mpirun: the stop signal some process had at the last read-back */
    int64_t chunk_samples;
    double t_last; /* when the previous step ended */
    /* the epoch so far (this process's), and the window since the last progress line (every
     * process's: win_loss sums each process's step losses) */
    double loss_sum; /* sum of each step's mean loss times its samples */
    int64_t correct, samples, steps_planned, every;
    int64_t samples_before; /* of samples: those a resumed epoch had before this process */
    double win_loss, win_t0;
    int64_t win_steps, win_samples;
    /* the allocator's peak of each device (o->devs) over the epoch's steps so far: read after
     * every step, since a pipeline resets its devices' peaks at each of its steps */
    int64_t peak[TDM_MAX_DEVICES];
    /* under mpirun, the last epoch's training seconds and seconds in collectives per process
     * ([procs] each; NULL without MPI) */
    double *rank_seconds, *rank_wait_s;
    double coll_wait0; /* tdm_collective_wait_seconds at the epoch's start */
    epoch_stats last;  /* the last finished epoch */
} trainer;

/* Under MPI, v[0..n) (n <= TOTALS_CAP) summed over the processes, in double and in rank order
 * (every process gets the same bits); every process calls it at the same steps. what names the
 * collective ("loss read-back": "the trainer's loss read-back" in a desync's message and the
 * flight recorder). 0, or EXIT_RUNTIME after printing the error. */
int trainer_sum_over_processes(trainer *tr, double *v, int n, const char *what);
/* Every process's v[0..n) (n <= TOTALS_CAP) into all[rank * n + i], exactly; without MPI the
 * one process's. what names the collective. 0, or EXIT_RUNTIME after printing the error. */
int trainer_gather_over_processes(trainer *tr, const double *v, int n, double *all,
                                  const char *what);
/* A checkpoint at the current step (rank 0 writes; every process takes part in the sums), and
 * the task's files of the model. 0 or EXIT_RUNTIME. */
int trainer_save_checkpoint(trainer *tr);
/* The task's own files of the model (tr->task->save into dir, NULL: the run's --save), on rank
 * 0: from sharded checkpoint ckpt when given (the parameters read from its shard files, so
 * nobody gathers them), else from the model, which under --shard parameters every process
 * first helps gather whole (a collective). 0 or the exit status of the failure, reported. */
int trainer_save_task(trainer *tr, const char *dir, const char *ckpt);
/* --checkpoint-dir becomes this run's: rank 0 checks it can be written, takes its lock (held
 * until the trainer ends) and refuses a fresh run into a directory holding checkpoints, or
 * with --overwrite deletes them; under mpirun every process stops when rank 0 does. 0,
 * EXIT_RUNTIME or EXIT_USAGE (in use, or an earlier run's checkpoints). */
int trainer_claim_checkpoint_dir(trainer *tr);
/* --resume: every replica's weights and optimizer, the data position, the RNG, the step count
 * and the run's identity from the newest checkpoint, after checking it is this run's; a new
 * identity otherwise. The checkpoint may come from other processes and devices: the position
 * is the epoch's global samples, which this run's loader maps to its own batch (the global
 * batch is the same: --batch-size is one of the run's options), and the epoch's totals go to
 * rank 0 whole. What the checkpoint holds must agree with this run (check_resumed: the step
 * with the data position and the optimizer's step count, the generator's seed, the epoch's
 * totals with the samples done, the epoch within --epochs). 0, EXIT_RUNTIME (a checkpoint
 * altered or not this run's, named with the field and value) or EXIT_USAGE. */
int trainer_resume(trainer *tr);
/* Under mpirun: refuses to train (EXIT_USAGE, naming each option and rank) when the processes
 * were started with different options. */
int trainer_same_options_everywhere(trainer *tr);

#endif
