/* `tandem train --model gpt`: a GPT-2 trained on a text file (bytes as tokens) or on llm.c
 * token shards, on one CPU device or several (DataParallel), in one process or several
 * (under mpirun: DDP, or DataParallel joined over the processes). */
#ifndef TANDEM_TOOLS_TRAIN_GPT_H
#define TANDEM_TOOLS_TRAIN_GPT_H

#include <stdbool.h>
#include <stdint.h>

#include "tandem/tandem.h"

typedef struct {
    const char *data;      /* a token shard (detected by its magic) or any other file as bytes */
    tdm_group *procs;      /* under mpirun: every process (this one trains its share), or NULL */
    const char *init_from; /* an llm.c model file to start from, or NULL */
    const char *save;      /* write the trained model here (llm.c's format), or NULL */
    const char *log_path;  /* JSON lines: a config line and one per step, or NULL */
    const char *plot_path; /* the loss curve (SVG, rewritten at each progress line), or NULL */
    const char *checkpoint_dir; /* also write DIR/model.bin and a Tandem checkpoint */
    bool write_checkpoints;     /* this process writes them (rank 0 under mpirun) */
    int64_t checkpoint_every;   /* steps between checkpoints (0: only at the end) */
    bool resume;                /* continue from checkpoint_dir's newest checkpoint */
    int64_t layers, heads, channels, context, vocab; /* vocab 0: 256 for text, 50257 for shards */
    int64_t epochs, batch_size, workers, seed, warmup_steps, max_steps, print_every;
    int64_t grad_accum; /* batches per optimizer step (one device); 1: none */
    double lr, weight_decay, clip;
    bool cosine, quiet;
    const tdm_device *devs;
    int n_devs;
} gpt_train_opts;

/* Runs the training; returns an exit status (EXIT_OK, EXIT_RUNTIME) after printing errors. */
int gpt_train(const gpt_train_opts *o);

#endif
