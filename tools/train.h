/* `tandem train`: the options (parsed once, from one table that also writes --help), shared by
 * the trainer (trainer.c) and the tasks it trains (task.h). */
#ifndef TANDEM_TOOLS_TRAIN_H
#define TANDEM_TOOLS_TRAIN_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "tandem/tandem.h"

/* Exit statuses of every subcommand. */
enum { EXIT_OK = 0, EXIT_RUNTIME = 1, EXIT_USAGE = 2 };

/* A named set of options (--recipe): args as on a command line, NULL-terminated. */
typedef struct {
    const char *name, *what;
    const char *args[48];
} train_recipe;

/* The recipe called name, or NULL. */
const train_recipe *train_recipe_find(const char *name);
/* r's options as one command line ("--model cnn-bn --epochs 4 ..."), quoted for a shell. */
void train_recipe_str(const train_recipe *r, char *buf, size_t cap);

/* Every option of `tandem train`, after check_opts has filled in the defaults that depend on
 * others (the optimizer's lr, the batch size). */
typedef struct {
    const char *data, *model, *optimizer, *schedule, *devices;
    const char *log_path, *plot_path, *trace_path, *tensorboard_dir;
    int64_t epochs, batch_size, workers, limit, warmup_steps, step_size, print_every, seed;
    double lr, momentum, weight_decay, gamma; /* lr, momentum: NAN until set (optimizer default) */
    bool quiet;
    const char *checkpoint_dir, *init_from;
    int64_t checkpoint_every, keep, max_steps;
    bool resume, overwrite;
    double clip;            /* the gradients' global 2-norm limit; 0: off */
    double pct_start;       /* onecycle's rising fraction: NAN until set, then 0.3 or 0 */
    double label_smoothing; /* image tasks' cross-entropy */
    bool nesterov;          /* sgd */
    bool no_decay_1d;       /* weight decay on parameters of 2+ dims only */
    bool eval_flip;         /* image tasks: test logits averaged over x and its mirror */
    int64_t validation;     /* image tasks: training samples held out as the test set; 0: off */
    const char *recipe;     /* --recipe's name, or NULL */
    int64_t grad_accum;     /* batches per optimizer step; 0 until checked, then >= 1 */
    /* images: the side images are made (0: the data's own, 224 for an image folder), and the
     * transforms of the training and test images (NULL: the data's default) */
    int64_t image_size;
    const char *transform, *eval_transform;
    bool skip_bad; /* image folders: files that do not read are skipped and counted */
    /* language models (TDM_TASK_TEXT) */
    int64_t layers, heads, channels, context, vocab;
    const char *save_path;
    double timeout;              /* seconds, under mpirun */
    const char *debug_dir;       /* the flight recorder's files (trainer_debug.h), or NULL */
    const char *device_memory;   /* --device-memory as typed, or NULL */
    int64_t device_memory_bytes; /* its bytes (0: no cap), set by the checks */
    int64_t check_replicas;      /* every N steps the replicas' weights compared; 0: never */
    int64_t model_split, micro_batches;
    /* the tp of a dp x tp mesh over --devices (under mpirun: the processes); 1: none */
    int64_t tensor_parallel;
    const char *pipe_schedule;
    const char *denormals;            /* "flush" or "keep" */
    const char *shard;                /* "none" or "optimizer" (ZeRO stage 1) */
    const char *precision;            /* "fp32", "bf16" or "fp16" once checked */
    const char *reduce_dtype;         /* DDP's gradient exchange: "fp32" or "bf16" */
    int64_t bucket_cap;               /* DDP's gradient buckets, MiB */
    bool allow_tf32;                  /* --allow-tf32: GPUs' f32 products in TF32 */
    bool cuda_graphs;                 /* --cuda-graphs: the step replayed from a CUDA graph */
    bool recompute;                   /* the GPT's blocks, a ResNet's stages */
    int64_t batch_per_device;         /* 0: --batch-size is the global batch */
    tdm_device devs[TDM_MAX_DEVICES]; /* parsed from devices */
    int n_devs;
    const char *plot_compare; /* --plot-compare: other runs' logs, FILE[=LABEL],...; or NULL */
    bool dry_run;             /* print the memory estimate and stop before building the model */
} train_opts;

/* Fills o from argv (argv[0] is "train") and checks the options together, printing a usage
 * error to stderr. Returns 0, EXIT_USAGE, or -1 for --help. Starts nothing and opens no file:
 * o points into argv. (Separate from train_main for tests/fuzz_cli.c.) */
int train_parse_args(int argc, char **argv, train_opts *o);
/* Runs `tandem train` with argv[0] == "train". Returns an exit status. */
int train_main(int argc, char **argv);
/* The man-page style help of `tandem train`. */
void train_help(FILE *out);
/* One line per option ("  --epochs N  ..."), for the top-level help. */
void train_synopsis(FILE *out);
/* The options that shape the run's results (the same for --resume and for every process
 * under mpirun) as "--name=value;" pairs, into buf. 0, or -1 when cap is too small. */
int train_identity(const train_opts *o, char *buf, size_t cap);
/* Every option that the processes of one run must share (all but those that describe one
 * process: its outputs, --workers, --timeout, --quiet) as "--name=value;" pairs, into buf:
 * what the processes compare before the first step. 0, or -1 when cap is too small. */
int train_process_identity(const train_opts *o, char *buf, size_t cap);
/* Whether identities a and b differ in an option that b (this run's) holds; if so, out (cap
 * bytes) lists each option that does: "--batch-size 64 <a_name>, 32 <b_name>; ...". */
bool train_identity_diff(const char *a, const char *b, const char *a_name, const char *b_name,
                         char *out, size_t cap);
/* Prints "tandem train: <message> (see 'tandem train --help')" and returns EXIT_USAGE. */
int train_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Under mpirun with --tensor-parallel: how many processes share one data-parallel row (the
 * processes of a tensor-parallel group wider than a process's devices), else 1 (each process
 * holds whole groups: its own rows). The loader then gives process p the rows of batch share
 * p / this of procs / this, and only the first of them counts the rows in the run's totals. */
static inline int train_procs_per_row(const train_opts *o) {
    int tp = (int)o->tensor_parallel, l = o->n_devs;
    return l % tp == 0 ? 1 : tp / l;
}

#endif
