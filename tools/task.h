/* What the trainer trains: a task supplies the data, the model, the loss, the metrics and the
 * files a model is saved as; the trainer (trainer.c) owns everything else (devices, the loop,
 * schedules, clipping, accumulation, checkpoints, resume, logs, progress, MPI) and knows
 * nothing of images or text.
 *
 *   image (task_image.c): Fashion-MNIST/MNIST IDX files, CIFAR's files or image folders, an
 *     image model of the registry (models.h, TDM_TASK_IMAGE), transforms, cross-entropy,
 *     accuracy, evaluation on the test split every epoch.
 *   text (task_text.c): a text file (bytes as tokens) or llm.c token shards, a language model
 *     of the registry (TDM_TASK_TEXT: a GPT-2), next-token cross-entropy, no test split; the
 *     model is also written in llm.c's format.
 */
#ifndef TANDEM_TOOLS_TASK_H
#define TANDEM_TOOLS_TASK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/tandem.h"
#include "train.h"

typedef struct task task;

struct task {
    const char *unit;          /* what a sample is, for throughput: "img" or "tok" */
    int64_t units_per_sample;  /* 1 for an image, T for a window of T tokens */
    bool drop_last;            /* every batch full (a GPT's [B, T]); else a smaller last one */
    bool accuracy;             /* score argmax(logits [n, C], 1) against the targets [n] */
    tdm_dataset *train, *test; /* test NULL: no evaluation */
    /* what train and test are subsets of (--limit on image folders), or NULL */
    tdm_dataset *train_base, *test_base;
    /* --validation: the training set that train and test (held-out samples) both split */
    tdm_dataset *split_base;
    /* the loaders' transforms of each split's samples (transforms.h), or NULL */
    tdm_transform *train_tf, *test_tf;
    /* The model, built by build (below) once the memory estimate (estimate.h) has passed:
     * what it will be is known before, from its row of the registry (--model) and the sizes
     * the options and the data give it (sizes.input: a sample as the model takes it, [C, H, W]
     * for an image, [T] tokens for text). */
    const tdm_model_info *row;
    tdm_model_opts sizes;
    /* Builds model on dev, weights as the options ask (the costly part: a GPT of 154 GB is
     * minutes of work). Returns 0 or EXIT_RUNTIME after printing the error. */
    int (*build)(task *t, const train_opts *o);
    tdm_device dev;
    tdm_module *model; /* on dev once built (the first device's, or under --tensor-parallel a CPU
                        * device outside --devices: the host's); NULL before */
    /* The mean loss of a batch's model output against its targets (a scalar), or NULL. */
    tdm_tensor *(*loss)(tdm_tensor *out, const tdm_tensor *target);
    /* --tensor-parallel's plan (tdm_tp_strategy_opts): splits a replica over tp (NULL: the
     * model has none), and makes a split replica's output whole (NULL: it is). */
    int (*parallelize)(tdm_module *replica, tdm_group *tp, void *arg);
    tdm_tensor *(*whole_output)(tdm_module *replica, tdm_tensor *out, void *arg);
    /* --model-split for a model that is not a Sequential: a Sequential of copies of its layers
     * and its ties (tdm_gpt_pipeline_model), and the weights back from it; NULL: the model
     * is cut as it is. */
    tdm_module *(*pipeline_model)(const tdm_module *model, tdm_pipe_tie *tie);
    /* --model-split with --tensor-parallel: splits a stage of it over tp (tdm_pipe_opts; arg:
     * the whole model) */
    int (*parallelize_stage)(tdm_module *stage, tdm_group *tp, void *arg);
    int (*from_pipeline_model)(tdm_module *model, const tdm_module *view);
    int (*to_pipeline_model)(tdm_module *view, const tdm_module *model);
    /* The loss from a split replica's output (tdm_strategy_loss_module), or NULL: loss. */
    tdm_tensor *(*loss_of)(tdm_module *replica, tdm_tensor *out, const tdm_tensor *target);
    /* The optimizer over ps for the options o (a tdm_optim_factory: one per replica). */
    tdm_optim *(*optimizer)(tdm_paramset *ps, void *o);
    /* Writes the task's own files of the model (may be NULL): at each checkpoint into
     * checkpoint_dir, and at the end (checkpoint_dir NULL) to --save. With ckpt (a sharded
     * checkpoint just written) the parameters are read from it, the model's being sharded
     * (ZeRO stage 3); else from the model. Returns 0 or EXIT_RUNTIME after printing the
     * error. */
    int (*save)(const task *t, const train_opts *o, const char *checkpoint_dir, const char *ckpt);
    char model_desc[192];     /* tdm_model_describe's line */
    char data_desc[320];      /* "60000 train, 10000 test samples" */
    char plot_title[96];      /* "mlp on fashion-mnist" */
    char image_desc[96];      /* the images a batch holds: "[3, 32, 32]" */
    char transform_desc[900]; /* "train RandomCrop(32, padding=4), ...; test ..." or "" */
    char classes_desc[256];   /* an image folder's first classes: "cat, dog" or "" */
    char *class_to_idx;       /* torchvision's class_to_idx as JSON, saved with checkpoints;
                               * NULL without class names */
    const char *loss_label;   /* the plot's loss axis; NULL: cross-entropy */
};

/* Each fills t from the options: the data, and what the model will be (t->build makes it on
 * device dev). o->model must name a row of the task's kind (check_opts has checked it). Return 0,
 * or EXIT_RUNTIME / EXIT_USAGE after printing the error; task_free releases what was made either
 * way. */
int task_image_open(task *t, const train_opts *o, tdm_device dev);
int task_text_open(task *t, const train_opts *o, tdm_device dev);
/* The task of o->model's row (task_image_open or task_text_open), or EXIT_RUNTIME after an
 * error naming an unknown model. */
int task_open(task *t, const train_opts *o, tdm_device dev);
void task_free(task *t);

/* The optimizer the options ask for (sgd, adam, adamw with PyTorch's defaults): the image
 * task's, and the base of the text task's. */
tdm_optim *task_default_optimizer(tdm_paramset *ps, void *o);
/* After loading weights from file (given with option, e.g. --init-from): EXIT_RUNTIME naming
 * the first parameter or f32 buffer of m that holds a NaN or an infinity, the element and the
 * value (so that a diverging run does not blame the learning rate, and an evaluation says
 * why it has no loss), else 0. */
int task_check_finite(tdm_module *m, const char *option, const char *file);
/* Under mpirun, this process's rank (set when it joins), -1 otherwise. */
extern int task_rank;
/* The command in error messages: "tandem train" (the default) or "tandem eval". */
extern const char *task_program;
/* Prints "<task_program>: error: <message>" on stderr, one whole line ("... error: rank R:
 * <message>" under mpirun), and returns EXIT_RUNTIME. */
int task_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
