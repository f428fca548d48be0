/* The text task: a language model of the registry (models.h, TDM_TASK_TEXT: a GPT-2) trained
 * on next-token prediction.
 *
 * Data: an llm.c token shard (recognised by its magic) or any other file read as bytes
 * (vocabulary 256), cut into windows of context + 1 tokens. Model: the row's builder
 * (tdm_gpt_new: GPT-2's initialisation from the seed), or an llm.c model file (--init-from).
 * Optimizer: AdamW with weight decay on matrices only (tdm_gpt_adamw_new). The model is also
 * written in llm.c's format (--save, and DIR/model.bin beside each checkpoint), which `tandem
 * sample` and llm.c's train_gpt2.c read. There is no test split: the trainer evaluates nothing. */
#include <errno.h>
#include <libgen.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "task.h"

#define SHARD_MAGIC        20240520
#define LLAMA3_SHARD_MAGIC 20240801 /* llm.c's u32 token shards: the reader refuses them */

/* Whether path starts with an llm.c token shard magic (unreadable files are left to the
 * reader): such a file is never read as text, whether or not its version is supported. */
static bool is_token_shard(const char *path) {
    unsigned char h[4] = {0};
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    size_t n = fread(h, 1, 4, f);
    fclose(f);
    uint32_t magic =
        (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
    return n == 4 && (magic == SHARD_MAGIC || magic == LLAMA3_SHARD_MAGIC);
}

/* The model's config: an llm.c file's header (its parameters are read by build_gpt), or the
 * options' sizes, the row's defaults d where an option is not given. */
static int gpt_config(const train_opts *o, const tdm_gpt_config *d, tdm_gpt_config *cfg) {
    if (o->init_from) {
        if (tdm_gpt_llmc_config(o->init_from, cfg))
            return task_error("--init-from: %s", tdm_last_error());
        if (o->context > cfg->context)
            return task_error("--context %lld is longer than the %d of '%s'", (long long)o->context,
                              cfg->context, o->init_from);
        return 0;
    }
    int64_t v = o->vocab ? o->vocab : is_token_shard(o->data) ? 50257 : d->vocab;
    /* llm.c pads the vocabulary to a multiple of 128 (wte rows no token reads) */
    *cfg = (tdm_gpt_config){.layers = (int)(o->layers ? o->layers : d->layers),
                            .heads = (int)(o->heads ? o->heads : d->heads),
                            .channels = (int)(o->channels ? o->channels : d->channels),
                            .context = (int)(o->context ? o->context : d->context),
                            .vocab = (int)v,
                            .padded_vocab = (int)((v + 127) / 128 * 128)};
    return 0;
}

/* The model of t->sizes: from the llm.c file, or new from the seed. */
static int build_gpt(task *t, const train_opts *o) {
    if (o->init_from) {
        if (!(t->model = tdm_gpt_load_llmc(o->init_from, t->dev, NULL)))
            return task_error("--init-from: %s", tdm_last_error());
        return task_check_finite(t->model, "--init-from", o->init_from);
    }
    tdm_rng rng = tdm_rng_make((uint64_t)o->seed);
    if (!(t->model = tdm_model_build(t->row, &t->sizes, t->dev, &rng)))
        return task_error("model %s: %s", o->model, tdm_last_error());
    return 0;
}

/* Windows of T + 1 tokens (T = --context, or the model's); --limit keeps the first N. */
static int open_text(task *t, const train_opts *o, const tdm_gpt_config *cfg) {
    int64_t T = o->context ? o->context : cfg->context;
    t->train = is_token_shard(o->data) ? tdm_token_dataset_open(o->data, T, cfg->vocab)
                                       : tdm_text_dataset_open(o->data, T);
    if (!t->train) return task_error("--data: %s", tdm_last_error());
    if (t->train->num_classes > cfg->vocab)
        return task_error("--data '%s' holds byte tokens (vocabulary 256) but the model "
                          "predicts %d",
                          o->data, cfg->vocab);
    if (o->limit > 0 && t->train->n > o->limit) t->train->n = o->limit;
    t->units_per_sample = T;
    t->sizes.input = TDM_SHAPE(T);
    return 0;
}

static tdm_optim *gpt_optimizer(tdm_paramset *ps, void *arg) {
    const train_opts *o = arg;
    tdm_adam_opts a = tdm_adamw_defaults();
    a.lr = (float)o->lr;
    a.weight_decay = (float)o->weight_decay;
    return tdm_gpt_adamw_new(ps, &a);
}

/* --tensor-parallel: Megatron's plan for the GPT with sequence parallelism (the layer norms
 * and residual adds on each device's tokens only) and, where the padded vocabulary splits over
 * the devices, vocabulary parallelism (each device its rows of the embedding and its columns of
 * the logits: the loss from the parts, tdm_gpt_loss_of; evaluation gathers them). */
static int split_gpt(tdm_module *replica, tdm_group *tp, void *arg) {
    (void)arg;
    const tdm_gpt_config *c = tdm_gpt_config_of(replica);
    int vp = c ? (c->padded_vocab ? c->padded_vocab : c->vocab) : 0;
    tdm_gpt_tp_plan plan = {.sequence_parallel = true,
                            .vocab_parallel = vp % tdm_group_size(tp) == 0};
    return tdm_gpt_parallelize(replica, tp, &plan);
}

/* A pipeline stage's blocks over the devices of its tensor-parallel group, the tokens split
 * between them and, where the padded vocabulary splits, the ends' wte copies by rows (the last
 * stage's loss from its columns: tdm_gpt_loss_of). arg: the whole GPT the stages came from. */
static int split_stage(tdm_module *stage, tdm_group *tp, void *arg) {
    const tdm_gpt_config *c = tdm_gpt_config_of(arg);
    int vp = c ? (c->padded_vocab ? c->padded_vocab : c->vocab) : 0;
    tdm_gpt_tp_plan plan = {.sequence_parallel = true,
                            .vocab_parallel = vp % tdm_group_size(tp) == 0};
    return tdm_gpt_parallelize_stage(stage, tp, &plan);
}

static tdm_tensor *whole_logits(tdm_module *replica, tdm_tensor *out, void *arg) {
    (void)arg;
    return tdm_gpt_whole_logits(replica, out);
}

/* DIR/model.bin beside a checkpoint (for tandem sample), or --save at the end. */
static int save_llmc(const task *t, const train_opts *o, const char *checkpoint_dir,
                     const char *ckpt) {
    char path[4200];
    if (checkpoint_dir)
        snprintf(path, sizeof path, "%s/model.bin", checkpoint_dir);
    else if (o->save_path)
        snprintf(path, sizeof path, "%s", o->save_path);
    else
        return 0;
    if (ckpt ? tdm_gpt_save_llmc_from(path, t->model, ckpt) : tdm_gpt_save_llmc(path, t->model))
        return task_error("%s: %s", checkpoint_dir ? "checkpoint" : "--save", tdm_last_error());
    if (!checkpoint_dir && !o->quiet) printf("saved     %s (llm.c model file)\n", path);
    return 0;
}

/* --save is written when training ends: a path that cannot be written (a directory, a
 * directory that is missing or read-only) is refused before the first step. */
static int check_save_path(const char *path) {
    struct stat st;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    const char *d = dirname(dir);
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
        return task_error("--save '%s' is a directory; give a file name", path);
    if (access(d, W_OK | X_OK) != 0)
        return task_error("--save '%s': its directory '%s' is not writable: %s", path, d,
                          strerror(errno));
    return 0;
}

int task_text_open(task *t, const train_opts *o, tdm_device dev) {
    *t = (task){.unit = "tok",
                .drop_last = true, /* every step sees a full [B, T] batch */
                .loss = tdm_gpt_loss,
                .optimizer = gpt_optimizer,
                .save = save_llmc,
                .parallelize = split_gpt,
                .whole_output = whole_logits,
                .pipeline_model = tdm_gpt_pipeline_model,
                .parallelize_stage = split_stage,
                .from_pipeline_model = tdm_gpt_from_pipeline_model,
                .to_pipeline_model = tdm_gpt_to_pipeline_model,
                .loss_of = tdm_gpt_loss_of,
                .loss_label = "next-token cross-entropy",
                .build = build_gpt,
                .dev = dev};
    if (!(t->row = tdm_model_find(o->model)) || t->row->task != TDM_TASK_TEXT)
        return task_error("--model %s: %s", o->model,
                          t->row ? "not a language model" : tdm_last_error());
    if (o->save_path && check_save_path(o->save_path)) return EXIT_RUNTIME;
    t->sizes = t->row->defaults;
    int rc = gpt_config(o, &t->row->defaults.gpt, &t->sizes.gpt);
    if (!rc) rc = open_text(t, o, &t->sizes.gpt);
    if (rc) return rc;
    tdm_model_describe(t->row, &t->sizes, t->model_desc, sizeof t->model_desc);
    snprintf(t->data_desc, sizeof t->data_desc, "%lld windows of %lld tokens",
             (long long)t->train->n, (long long)t->units_per_sample);
    snprintf(t->plot_title, sizeof t->plot_title, "%s on %s", o->model, o->data);
    return 0;
}
