/* `tandem train`: parses options, builds the data pipeline, model and optimizer, and runs
 * epochs of training and evaluation with progress, a JSON-lines log and an SVG plot.
 *
 * The step loop keeps the host out of the device's way: each step's loss and predictions are
 * copied into small device buffers, and the host reads them back only every SYNC_STEPS steps
 * (or at a progress line / the end of the epoch). That is one transfer per 16 steps instead
 * of two per step on a GPU; on the CPU it costs nothing either way. A non-finite loss is
 * therefore noticed up to SYNC_STEPS-1 steps late, but reported with its exact epoch and step.
 */
#include "train.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "log.h"
#include "models.h"
#include "plot.h"
#include "progress.h"
#include "tandem/tandem.h"
#include "train_gpt.h"

#define SYNC_STEPS 16
#define EVAL_BATCH 1000

/* ---- options ------------------------------------------------------------------------------ */

typedef struct {
    const char *data, *model, *optimizer, *schedule, *devices, *log_path, *plot_path, *trace_path;
    int64_t epochs, batch_size, workers, limit, warmup_steps, step_size, print_every, seed;
    double lr, momentum, weight_decay, gamma; /* lr, momentum: NAN until set (optimizer default) */
    bool quiet;
    const char *checkpoint_dir, *init_from;
    int64_t checkpoint_every, keep, max_steps;
    bool resume;
    /* --model gpt */
    int64_t layers, heads, channels, context, vocab;
    const char *save_path;
    double clip;
    double timeout; /* seconds, under mpirun */
    int64_t model_split, micro_batches;
    const char *pipe_schedule;
    const char *denormals; /* "flush" or "keep" */
    int64_t grad_accum;
    int64_t batch_per_device;         /* 0: --batch-size is the global batch */
    tdm_device devs[TDM_MAX_DEVICES]; /* parsed from devices */
    int n_devs;
} train_opts;

typedef enum { OPT_STR, OPT_INT, OPT_NUM, OPT_FLAG } opt_kind;

typedef struct {
    const char *name; /* "--epochs" */
    const char *arg;  /* metavariable in help; NULL for a flag */
    opt_kind kind;
    size_t off;    /* field in train_opts */
    double lo, hi; /* accepted range of a number */
    const char *deflt;
    const char *help;
} opt_spec;

#define F(field) offsetof(train_opts, field)
static const opt_spec specs[] = {
    {"--data", "fashion-mnist|DIR|FILE", OPT_STR, F(data), 0, 0, "fashion-mnist",
     "Training and test data. fashion-mnist reads Debian's dataset-fashion-mnist from "
     "/usr/share/datasets/fashion-mnist; DIR is a directory holding the four IDX files "
     "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
     "t10k-labels-idx1-ubyte (each raw or with .gz) of 28x28 images in 10 classes (MNIST works "
     "too). For gpt, FILE is an llm.c token shard (magic 20240520, u16 tokens) or any other "
     "file, whose bytes are the tokens (vocabulary 256): plain text trains with no tokenizer."},
    {"--model", "mlp|cnn|gpt", OPT_STR, F(model), 0, 0, "mlp",
     "The network, PyTorch's nn.Sequential layer for layer (parameter names such as "
     "\"1.weight\" match). mlp: Flatten, Linear 784-256, ReLU, Linear 256-128, ReLU, Linear "
     "128-10. cnn: Conv2d 1-32 3x3 pad 1, ReLU, MaxPool 2, Conv2d 32-64 3x3 pad 1, ReLU, "
     "MaxPool 2, Flatten, Linear 3136-128, ReLU, Linear 128-10. gpt: GPT-2 (nanoGPT's "
     "names) sized by --layers, --heads, --channels and --context, trained with AdamW "
     "(weight decay on matrices only) on --data FILE; see --save and 'tandem sample'."},
    {"--layers", "L", OPT_INT, F(layers), 1, 1024, "2", "gpt: transformer blocks."},
    {"--heads", "H", OPT_INT, F(heads), 1, 1024, "4",
     "gpt: attention heads (must divide --channels)."},
    {"--channels", "C", OPT_INT, F(channels), 1, 65536, "128", "gpt: width of the model."},
    {"--context", "T", OPT_INT, F(context), 1, 1 << 20, "64 (the file's with --init-from)",
     "gpt: tokens per training window (the longest sequence the model reads)."},
    {"--vocab", "V", OPT_INT, F(vocab), 1, 1 << 20, "256 for text, 50257 for token shards",
     "gpt: vocabulary size (padded to a multiple of 128 in the embedding, as llm.c does)."},
    {"--save", "FILE", OPT_STR, F(save_path), 0, 0, "none",
     "gpt: write the trained model as an llm.c fp32 model file (readable by llm.c's "
     "train_gpt2.c and by 'tandem sample')."},
    {"--clip-grad", "N", OPT_NUM, F(clip), 0, 1e12, "0 (off)",
     "gpt: clip the gradients' global 2-norm to N before each step (the averaged gradient's, "
     "with several devices or processes)."},
    {"--grad-accum", "N", OPT_INT, F(grad_accum), 1, 4096, "1",
     "gpt: gradient accumulation, one optimizer step per N batches: the gradients of N "
     "batches of --batch-size add up (each loss divided by N; devices and processes "
     "exchange them once, at the last), so the step is that of one batch N times larger in "
     "1/N of the memory."},
    {"--epochs", "N", OPT_INT, F(epochs), 1, 1e6, "1", "Passes over the training data."},
    {"--batch-size", "B", OPT_INT, F(batch_size), 1, 1 << 20, "64",
     "Global batch size: samples per optimizer step, summed over all devices and processes, "
     "so results do not depend on how the work is spread. The last batch of an epoch may be "
     "smaller."},
    {"--batch-per-device", "B", OPT_INT, F(batch_per_device), 1, 1 << 20, "none",
     "Samples per device per step instead, as PyTorch's batch_size under DDP: the global "
     "batch is B x devices (x processes under mpirun; with --model-split K, B per replica of "
     "the K stages). Not with --batch-size."},
    {"--optimizer", "sgd|adam|adamw", OPT_STR, F(optimizer), 0, 0, "sgd (adamw for gpt)",
     "Update rule, with PyTorch's formulas (torch.optim.SGD, Adam, AdamW; Adam's betas 0.9, "
     "0.999 and eps 1e-8)."},
    {"--lr", "LR", OPT_NUM, F(lr), 0, 1e6, "0.1 for sgd, 1e-3 for adam and adamw",
     "Base learning rate (before the schedule)."},
    {"--momentum", "M", OPT_NUM, F(momentum), 0, 0.999999, "0.9",
     "SGD momentum (PyTorch's form: b = M*b + g). sgd only."},
    {"--weight-decay", "WD", OPT_NUM, F(weight_decay), 0, 1e6, "0",
     "L2 penalty added to the gradient (sgd, adam), or decoupled decay (adamw; PyTorch's "
     "AdamW default would be 0.01)."},
    {"--schedule", "constant|step|cosine", OPT_STR, F(schedule), 0, 0, "constant",
     "Learning-rate schedule. step: multiply by --gamma every --step-size epochs (StepLR). "
     "cosine: linear warmup over --warmup-steps, then cosine decay to 0 at the last step of "
     "the last epoch (steps = epochs * steps per epoch)."},
    {"--warmup-steps", "N", OPT_INT, F(warmup_steps), 0, 1e12, "0",
     "Warmup steps of the cosine schedule."},
    {"--step-size", "E", OPT_INT, F(step_size), 1, 1e6, "1", "Epochs between decays (step)."},
    {"--gamma", "G", OPT_NUM, F(gamma), 0, 1, "0.1", "Decay factor (step)."},
    {"--seed", "S", OPT_INT, F(seed), 0, 9.007199254740992e15, "0",
     "Seed of the weight initialisation and of the data order: the same seed gives the same "
     "run."},
    {"--denormals", "flush|keep", OPT_STR, F(denormals), 0, 0, "flush",
     "flush: floats below 1.2e-38 become 0 (torch.set_flush_denormal(True)); keep: IEEE "
     "arithmetic, PyTorch's default. Each operation on a denormal takes a microcode assist: "
     "SGD's momentum of a parameter whose gradient stays 0 turns denormal after ~800 steps, "
     "and the MLP's epochs then take 1.6x as long."},
    {"--workers", "N", OPT_INT, F(workers), 0, 64, "2",
     "DataLoader worker threads building batches ahead of the training loop; 0 builds them "
     "on the training thread."},
    {"--devices", "LIST", OPT_STR, F(devices), 0, 0, "cpu:0",
     "Devices to train on: a list (cpu:0,cpu:1 or cuda:0,cuda:1), cpu:all (one device per "
     "core), cuda:all (every GPU), cuda (the GPU of this process's local rank under mpirun or "
     "srun, cuda:0 otherwise) or a count (2 means cpu:0,cpu:1). With several devices the "
     "model is replicated, each device trains on its share of every global batch, and "
     "gradients are averaged before one update (data parallelism; NCCL between GPUs), so "
     "results match one device. Under mpirun each process uses these devices for its share "
     "of the batch, and gradients are averaged over every device of every process "
     "(mpirun -np <GPUs> ... --devices cuda: one GPU per process)."},
    {"--model-split", "K", OPT_INT, F(model_split), 1, TDM_PIPE_MAX_STAGES, "1 (no split)",
     "Model parallelism: cut the model into K pipeline stages of consecutive layers (balanced "
     "by parameter count), each on its own device of --devices, which must list K devices, or "
     "K x R for R data-parallel replicas of every stage. Each batch flows through the stages "
     "in --micro-batches pieces, so the devices work at once; results match one device."},
    {"--micro-batches", "M", OPT_INT, F(micro_batches), 1, TDM_PIPE_MAX_MICRO, "4",
     "With --model-split: pieces each batch is cut into."},
    {"--pipeline", "1f1b|gpipe", OPT_STR, F(pipe_schedule), 0, 0, "1f1b",
     "With --model-split: gpipe runs every forward, then every backward (all micro-batches' "
     "activations alive at once); 1f1b alternates them (at most K alive on a stage)."},
    {"--timeout", "SECONDS", OPT_NUM, F(timeout), 0.1, 1e6, "30",
     "Under mpirun: how long a process waits for the others at a collective before it stops "
     "with an error naming the rank it waited for (a process that crashed or hangs). Raise "
     "it when one process can work alone for long between steps."},
    {"--limit", "N", OPT_INT, F(limit), 1, 1e12, "all",
     "Use only the first N training samples and the first N/6 test samples (at least 1): "
     "for quick runs and tests."},
    {"--log", "FILE", OPT_STR, F(log_path), 0, 0, "none",
     "Write one JSON object per line: a config line, a line per step (epoch, step, loss, lr, "
     "img_s, or tok_s for gpt) and a line per epoch (train_loss, train_acc, test_loss, "
     "test_acc, seconds, loader_wait_s, ...; not for gpt)."},
    {"--trace", "FILE.json", OPT_STR, F(trace_path), 0, 0, "none",
     "Write a Chrome trace (open it in Perfetto or chrome://tracing): one track per thread "
     "(the training loop, each device's compute, its communication, the loader's workers) "
     "with the spans of forward, backward, optimizer, each all-reduce and waiting for data."},
    {"--plot", "FILE.svg", OPT_STR, F(plot_path), 0, 0, "none",
     "Draw loss and accuracy curves (train and test per epoch, train loss per step) into an "
     "SVG file, rewritten after every epoch (for gpt: the loss per step, rewritten at every "
     "progress line)."},
    {"--print-every", "N", OPT_INT, F(print_every), 0, 1e12, "0",
     "When stdout is not a terminal, print a progress line every N steps (0: about ten per "
     "epoch). On a terminal a progress bar is redrawn in place instead."},
    {"--quiet", NULL, OPT_FLAG, F(quiet), 0, 0, "off",
     "No banner and no progress; only the per-epoch results and errors."},
    {"--checkpoint-dir", "DIR", OPT_STR, F(checkpoint_dir), 0, 0, "none",
     "Write checkpoints into DIR/ckpt-STEP/: model.safetensors (the weights under PyTorch's "
     "names, loadable with load_state_dict) and train_state.safetensors (optimizer moments, "
     "step counts, data position, RNG state). Each is written atomically, so a crash keeps "
     "the previous one. A final checkpoint is written when the run ends. With several "
     "devices the (identical) replicas are saved once."},
    {"--checkpoint-every", "N", OPT_INT, F(checkpoint_every), 0, 1e12, "0",
     "Also write a checkpoint every N optimizer steps (0: only the final one)."},
    {"--keep", "K", OPT_INT, F(keep), 0, 1e6, "3",
     "Keep the newest K checkpoints in the checkpoint directory (0 keeps all)."},
    {"--resume", NULL, OPT_FLAG, F(resume), 0, 0, "off",
     "Continue from the newest checkpoint in --checkpoint-dir (weights, optimizer, schedule "
     "position, data order and position), giving the same weights as a run never stopped; "
     "starts from the beginning when there is none yet. The other options must be those of "
     "the interrupted run."},
    {"--init-from", "FILE", OPT_STR, F(init_from), 0, 0, "none",
     "Start from the weights in FILE.safetensors (e.g. a PyTorch state_dict of the same "
     "nn.Sequential, or a checkpoint's model.safetensors); every name, shape and dtype must "
     "match. Ignored when --resume finds a checkpoint."},
    {"--max-steps", "N", OPT_INT, F(max_steps), 1, 1e12, "none",
     "Stop after N optimizer steps in total, counted across resumes, as if interrupted there "
     "(writing a checkpoint when --checkpoint-dir is set), without evaluating."},
};
#undef F
#define N_SPECS (int)(sizeof specs / sizeof specs[0])

static train_opts opts_defaults(void) {
    return (train_opts){.data = "fashion-mnist",
                        .model = "mlp",
                        .optimizer = NULL, /* sgd, or adamw for gpt */
                        .schedule = "constant",
                        .devices = "cpu:0",
                        .timeout = 30,
                        .model_split = 1,
                        .micro_batches = 4,
                        .pipe_schedule = "1f1b",
                        .denormals = "flush",
                        .epochs = 1,
                        .batch_size = 0, /* 64 unless --batch-per-device (check_opts) */
                        .workers = 2,
                        .limit = 0,
                        .step_size = 1,
                        .lr = NAN,
                        .momentum = NAN,
                        .gamma = 0.1,
                        .keep = 3};
}

static int usage_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tandem train: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see 'tandem train --help')\n");
    va_end(ap);
    return EXIT_USAGE;
}

/* Prints text wrapped at 80 columns with the given indent. */
static void wrap(FILE *out, const char *text, int indent) {
    int col = 0;
    const char *p = text;
    while (*p) {
        const char *w = p;
        while (*p && *p != ' ') p++;
        int len = (int)(p - w);
        if (col == 0) {
            col = fprintf(out, "%*s%.*s", indent, "", len, w);
        } else if (col + 1 + len > 80) {
            col = fprintf(out, "\n%*s%.*s", indent, "", len, w) - 1;
        } else {
            col += fprintf(out, " %.*s", len, w);
        }
        while (*p == ' ') p++;
    }
    fputc('\n', out);
}

void train_synopsis(FILE *out) {
    for (int i = 0; i < N_SPECS; i++) {
        char left[64];
        snprintf(left, sizeof left, "%s%s%s", specs[i].name, specs[i].arg ? " " : "",
                 specs[i].arg ? specs[i].arg : "");
        fprintf(out, "    %-34s default %s\n", left, specs[i].deflt);
    }
}

void train_help(FILE *out) {
    fprintf(out, "NAME\n    tandem train - train an image classifier on Fashion-MNIST, or a GPT on "
                 "text\n\n");
    fprintf(out, "SYNOPSIS\n    tandem train [OPTION]...\n\n");
    fprintf(out, "DESCRIPTION\n");
    wrap(out,
         "Trains an MLP or a small CNN with cross-entropy loss. Each epoch visits the training "
         "set once in an order shuffled from (--seed, epoch), then evaluates on the test set in "
         "eval mode without gradients, and prints train loss and accuracy, test loss and "
         "accuracy, the epoch's training time, images per second and the time the loop waited "
         "for the data loader. With --model gpt it trains a GPT-2 on --data FILE (text as bytes, "
         "or llm.c token shards) for --epochs passes or --max-steps steps, printing the mean "
         "loss, learning rate, ms per step and tokens per second; --save writes the model in "
         "llm.c's format for 'tandem sample'.",
         4);
    fprintf(out, "\nOPTIONS\n");
    for (int i = 0; i < N_SPECS; i++) {
        fprintf(out, "    %s%s%s\n", specs[i].name, specs[i].arg ? " " : "",
                specs[i].arg ? specs[i].arg : "");
        char text[1024];
        snprintf(text, sizeof text, "%s Default: %s.", specs[i].help, specs[i].deflt);
        wrap(out, text, 8);
    }
    fprintf(out, "    -h, --help\n        Show this help and exit.\n");
    fprintf(out, "\nOUTPUT\n");
    wrap(out,
         "On a terminal a progress bar shows epoch, step/steps, the running loss, images per "
         "second and the time left, redrawn in place at most ten times a second. When stdout "
         "is a file or a pipe, plain lines are printed instead (see --print-every).",
         4);
    fprintf(out, "\nEXIT STATUS\n    0  training finished\n"
                 "    1  a runtime error: unreadable data, a non-finite loss, a file that cannot "
                 "be written\n    2  a usage error: an unknown option, a missing or invalid "
                 "value\n");
    fprintf(out, "\nEXAMPLES\n");
    fprintf(out, "    tandem train --model mlp --epochs 3\n");
    fprintf(out, "    tandem train --model cnn --optimizer adam --epochs 2 --plot cnn.svg\n");
    fprintf(out, "    tandem train --model mlp --lr 0.05 --schedule cosine --warmup-steps 100 "
                 "--epochs 5 --log run.jsonl\n");
    fprintf(out, "    tandem train --data ~/mnist --limit 2000 --quiet\n");
    fprintf(out, "    tandem train --model gpt --data book.txt --layers 2 --heads 4 --channels 128 "
                 "--context 64 --batch-size 8 --save gpt.bin\n");
}

/* Parses a whole-string integer or number within [lo, hi]. */
static int parse_value(const opt_spec *s, const char *v, train_opts *o) {
    char *end;
    errno = 0;
    if (s->kind == OPT_STR) {
        if (!*v) return usage_error("%s: empty value", s->name);
        *(const char **)((char *)o + s->off) = v;
        return 0;
    }
    double x = strtod(v, &end);
    bool bad = end == v || *end || errno == ERANGE || !isfinite(x) || x < s->lo || x > s->hi;
    if (s->kind == OPT_INT) {
        long long n = strtoll(v, &end, 10);
        bad = bad || end == v || *end || errno == ERANGE;
        if (bad)
            return usage_error("%s: expected an integer in [%.0f, %.0f], got '%s'", s->name, s->lo,
                               s->hi, v);
        *(int64_t *)((char *)o + s->off) = n;
        return 0;
    }
    if (bad)
        return usage_error("%s: expected a number in [%g, %g], got '%s'", s->name, s->lo, s->hi, v);
    *(double *)((char *)o + s->off) = x;
    return 0;
}

static const opt_spec *find_spec(const char *name, size_t len) {
    for (int i = 0; i < N_SPECS; i++)
        if (strlen(specs[i].name) == len && strncmp(specs[i].name, name, len) == 0)
            return &specs[i];
    return NULL;
}

static bool one_of(const char *v, const char *const *choices) {
    for (; *choices; choices++)
        if (strcmp(v, *choices) == 0) return true;
    return false;
}

/* Checks choices and combinations once every option is known. */
static int check_opts(train_opts *o) {
    static const char *const optimizers[] = {"sgd", "adam", "adamw", NULL};
    static const char *const schedules[] = {"constant", "step", "cosine", NULL};
    bool gpt = strcmp(o->model, "gpt") == 0;
    if (!gpt && !one_of(o->model, model_names))
        return usage_error("--model: unknown model '%s' (expected mlp, cnn or gpt)", o->model);
    if (!o->optimizer) o->optimizer = gpt ? "adamw" : "sgd";
    if (gpt && strcmp(o->optimizer, "adamw") != 0)
        return usage_error("--model gpt trains with adamw (weight decay on matrices only), not "
                           "%s",
                           o->optimizer);
    if (gpt && (o->limit || strcmp(o->schedule, "step") == 0))
        return usage_error("--model gpt does not take --limit or --schedule step yet");
    if (gpt && !strcmp(o->data, "fashion-mnist"))
        return usage_error("--model gpt needs --data FILE (text, or an llm.c token shard)");
    if (!gpt && (o->layers || o->heads || o->channels || o->context || o->vocab || o->save_path ||
                 o->clip > 0 || o->grad_accum))
        return usage_error("--layers, --heads, --channels, --context, --vocab, --save, "
                           "--clip-grad and --grad-accum apply to --model gpt only");
    if (!one_of(o->optimizer, optimizers))
        return usage_error("--optimizer: unknown optimizer '%s' (expected sgd, adam or adamw)",
                           o->optimizer);
    static const char *const denormal_modes[] = {"flush", "keep", NULL};
    if (!one_of(o->denormals, denormal_modes))
        return usage_error("--denormals: unknown mode '%s' (expected flush or keep)", o->denormals);
    if (!one_of(o->schedule, schedules))
        return usage_error("--schedule: unknown schedule '%s' (expected constant, step or "
                           "cosine)",
                           o->schedule);
    bool sgd = strcmp(o->optimizer, "sgd") == 0;
    if (!sgd && !isnan(o->momentum))
        return usage_error("--momentum applies to sgd only (adam and adamw use betas 0.9, "
                           "0.999)");
    if (isnan(o->lr)) o->lr = sgd ? 0.1 : gpt ? 3e-4 : 1e-3;
    if (isnan(o->momentum)) o->momentum = sgd ? 0.9 : 0;
    if (o->warmup_steps > 0 && strcmp(o->schedule, "cosine") != 0)
        return usage_error("--warmup-steps needs --schedule cosine");
    if (!o->checkpoint_dir && (o->resume || o->checkpoint_every > 0))
        return usage_error("%s needs --checkpoint-dir",
                           o->resume ? "--resume" : "--checkpoint-every");
    o->n_devs = tdm_devices_parse(o->devices, o->devs, TDM_MAX_DEVICES);
    if (o->n_devs < 0) return usage_error("--devices: %s", tdm_last_error());
    if (o->n_devs == 0) return usage_error("--devices: no device in '%s'", o->devices);
    if (o->batch_per_device && o->batch_size)
        return usage_error("--batch-size (global) and --batch-per-device exclude each other");
    int64_t replicas = o->model_split > 1 && o->n_devs % o->model_split == 0
                           ? o->n_devs / o->model_split
                           : o->n_devs; /* a bad split is reported below */
    o->batch_size = o->batch_per_device ? o->batch_per_device * replicas
                    : o->batch_size     ? o->batch_size
                                        : 64;
    if (o->batch_size < o->n_devs)
        return usage_error("--batch-size %lld is smaller than the %d devices sharing it",
                           (long long)o->batch_size, o->n_devs);
    if (o->model_split > 1) {
        static const char *const pipes[] = {"1f1b", "gpipe", NULL};
        if (!one_of(o->pipe_schedule, pipes))
            return usage_error("--pipeline: unknown schedule '%s' (expected 1f1b or gpipe)",
                               o->pipe_schedule);
        if (gpt || o->checkpoint_dir)
            return usage_error("--model-split does not work with %s yet",
                               gpt ? "--model gpt" : "--checkpoint-dir");
        if (o->n_devs % o->model_split)
            return usage_error("--model-split %lld needs a multiple of %lld devices, --devices "
                               "gives %d",
                               (long long)o->model_split, (long long)o->model_split, o->n_devs);
        if (o->micro_batches * (o->n_devs / o->model_split) > o->batch_size)
            return usage_error("--batch-size %lld is too small for %lld micro-batches on each of "
                               "%lld replicas",
                               (long long)o->batch_size, (long long)o->micro_batches,
                               (long long)(o->n_devs / o->model_split));
    }
    return 0;
}

/* Fills o from argv (argv[0] is "train"). Returns 0, EXIT_USAGE, or -1 for --help. */
static int parse_args(int argc, char **argv, train_opts *o) {
    *o = opts_defaults();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) return -1;
        if (strncmp(a, "--", 2) != 0) return usage_error("unexpected argument '%s'", a);
        const char *eq = strchr(a, '=');
        const opt_spec *s = find_spec(a, eq ? (size_t)(eq - a) : strlen(a));
        if (!s) return usage_error("unknown option '%.*s'", eq ? (int)(eq - a) : (int)strlen(a), a);
        if (s->kind == OPT_FLAG) {
            if (eq) return usage_error("%s takes no value", s->name);
            *(bool *)((char *)o + s->off) = true;
            continue;
        }
        const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (!v) return usage_error("%s needs a value (%s)", s->name, s->arg);
        if (!eq && strncmp(v, "--", 2) == 0)
            return usage_error("%s needs a value (%s), got option '%s'", s->name, s->arg, v);
        int rc = parse_value(s, v, o);
        if (rc) return rc;
    }
    return check_opts(o);
}

/* ---- the trainer ---------------------------------------------------------------------------- */

typedef struct {
    train_opts o;
    tdm_device dev;
    tdm_dataset *train_ds, *test_ds;
    tdm_loader *train_l, *test_l;
    tdm_module *model;
    tdm_paramset *ps;
    tdm_optim *opt; /* with several devices: replica 0's (the others follow it) */
    tdm_dp *dp;     /* several devices: the replicas and their threads */
    tdm_pipe *pipe; /* --model-split: the stages (and their replicas) and their threads */
    tdm_group *g;   /* under mpirun: all processes; each trains a replica through ddp */
    tdm_ddp *ddp;
    bool silent; /* a rank other than 0: prints and writes nothing */
    tdm_sched sched;
    run_log log;
    progress prog;
    int64_t steps_per_epoch, global_step;
    /* checkpoints: where a resumed run starts, and the epoch's totals before it */
    int start_epoch;
    int64_t resume_batch, last_saved;
    double resume_loss_sum;
    int64_t resume_correct, resume_images;
    bool stopped; /* --max-steps reached */
    /* device-side records of the current chunk of steps, and their host copies */
    tdm_tensor *loss_buf; /* [SYNC_STEPS] f32 */
    tdm_tensor *pred_buf; /* [SYNC_STEPS * B] i64 */
    float *loss_host;     /* [SYNC_STEPS] */
    double *time_host, *lr_host;
    int64_t *size_host;
    int64_t *pred_host, *label_host; /* [max(SYNC_STEPS * B, EVAL_BATCH)] */
    int chunk_steps;
    int64_t chunk_images;
    double t_last; /* end of the previous step */
    /* the epoch so far */
    double loss_sum; /* sum of per-step mean loss times batch size */
    int64_t correct, images;
    /* history for the plot */
    float *step_loss; /* [cap_step_loss] */
    int64_t n_step_loss, cap_step_loss;
    epoch_stats *hist;
    int n_hist;
    char title[256], subtitle[320];
} trainer;

static int runtime_error(trainer *t, const char *fmt, ...) {
    progress_clear(&t->prog);
    fflush(stdout);
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tandem train: error: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return EXIT_RUNTIME;
}

/* Loads both splits; --limit keeps a prefix of each. */
static int load_data(trainer *t) {
    const char *dir = strcmp(t->o.data, "fashion-mnist") == 0 ? NULL : t->o.data;
    struct stat st;
    if (dir && stat(dir, &st) != 0)
        return runtime_error(t, "data directory '%s': %s", dir, strerror(errno));
    if (dir && !S_ISDIR(st.st_mode))
        return runtime_error(t, "data directory '%s' is not a directory", dir);
    const char *shown = dir ? dir : "/usr/share/datasets/fashion-mnist";
    t->train_ds = tdm_fashion_mnist(dir, true);
    if (!t->train_ds)
        return runtime_error(t, "cannot load training data from '%s': %s", shown, tdm_last_error());
    t->test_ds = tdm_fashion_mnist(dir, false);
    if (!t->test_ds)
        return runtime_error(t, "cannot load test data from '%s': %s", shown, tdm_last_error());
    if (tdm_dataset_sample_numel(t->train_ds) != 784 || t->train_ds->num_classes > 10) {
        char b[96];
        return runtime_error(t,
                             "'%s' holds %lld classes of images %s; the models expect 10 "
                             "classes of 1x28x28",
                             shown, (long long)t->train_ds->num_classes,
                             tdm_shape_str(t->train_ds->sample_shape, b));
    }
    if (t->o.limit > 0) {
        /* readers index samples i < n, so lowering n keeps a prefix of the dataset */
        int64_t test_n = t->o.limit / 6 > 0 ? t->o.limit / 6 : 1;
        if (t->train_ds->n > t->o.limit) t->train_ds->n = t->o.limit;
        if (t->test_ds->n > test_n) t->test_ds->n = test_n;
    }
    return 0;
}

static int make_loaders(trainer *t) {
    tdm_loader_opts lo = tdm_loader_defaults(t->o.batch_size);
    if (t->g) { /* DistributedSampler: rank r's rows of each global batch are r, r+N, ... */
        lo.rank = tdm_group_rank(t->g);
        lo.world_size = tdm_group_size(t->g);
        lo.batch_size = t->o.batch_size / lo.world_size;
    }
    lo.shuffle = true;
    lo.seed = (uint64_t)t->o.seed;
    lo.workers = (int)t->o.workers;
    /* one GPU: batches built in pinned memory and uploaded ahead of the step that needs them
     * (several devices and pipelines split host batches; one GPU per MPI process gets them
     * on the GPU, which its one-device DataParallel takes as they are) */
    if (t->o.n_devs == 1 && t->o.model_split <= 1) lo.device = t->dev;
    t->train_l = tdm_loader_new(t->train_ds, &lo);
    if (!t->train_l) return runtime_error(t, "training loader: %s", tdm_last_error());
    tdm_loader_opts eo = tdm_loader_defaults(EVAL_BATCH);
    eo.shuffle = false;
    eo.workers = (int)t->o.workers;
    eo.device = lo.device;
    t->test_l = tdm_loader_new(t->test_ds, &eo);
    if (!t->test_l) return runtime_error(t, "test loader: %s", tdm_last_error());
    t->steps_per_epoch = tdm_loader_batches(t->train_l);
    return 0;
}

/* The optimizer the options ask for, over ps (a tdm_optim_factory: one per replica). */
static tdm_optim *build_optimizer(tdm_paramset *ps, void *arg) {
    const train_opts *o = arg;
    if (strcmp(o->optimizer, "sgd") == 0) {
        tdm_sgd_opts so = tdm_sgd_defaults((float)o->lr);
        so.momentum = (float)o->momentum;
        so.weight_decay = (float)o->weight_decay;
        return tdm_sgd_new(ps, &so);
    }
    bool w = strcmp(o->optimizer, "adamw") == 0;
    tdm_adam_opts ao = w ? tdm_adamw_defaults() : tdm_adam_defaults();
    ao.lr = (float)o->lr;
    ao.weight_decay = (float)o->weight_decay;
    return w ? tdm_adamw_new(ps, &ao) : tdm_adam_new(ps, &ao);
}

static int make_optimizer(trainer *t) {
    const train_opts *o = &t->o;
    /* one GPU per process: DataParallel, whose NCCL group spans the processes */
    bool gpu_procs = t->g && t->dev.type == TDM_CUDA;
    /* rank 0's initial weights go to every process */
    if (t->g && o->n_devs == 1 && !gpu_procs && !(t->ddp = tdm_ddp_new(t->model, t->g, NULL)))
        return runtime_error(t, "ddp: %s", tdm_last_error());
    if (o->model_split > 1) {
        tdm_pipe_opts po = tdm_pipe_defaults((int)o->model_split, (int)o->micro_batches);
        po.schedule = strcmp(o->pipe_schedule, "gpipe") == 0 ? TDM_PIPE_GPIPE : TDM_PIPE_1F1B;
        po.replicas = o->n_devs / (int)o->model_split;
        po.devices = o->devices;
        t->pipe = tdm_pipe_new(t->model, &po, build_optimizer, &t->o);
        if (!t->pipe) return runtime_error(t, "pipeline: %s", tdm_last_error());
        /* the learning rate is read from a stage's optimizer (every stage has the same) */
        for (int s = 0; s < tdm_pipe_stages(t->pipe) && !t->opt; s++)
            t->opt = tdm_pipe_stage_optim(t->pipe, s, 0);
    } else if (o->n_devs > 1 || gpu_procs) {
        /* under mpirun: this process's devices, averaged with every other process's */
        t->dp = tdm_dp_new_distributed(t->model, o->devs, o->n_devs, t->g, build_optimizer, &t->o);
        if (!t->dp) return runtime_error(t, "data parallel: %s", tdm_last_error());
        t->opt = tdm_dp_optim(t->dp, 0);
    } else {
        t->opt = build_optimizer(t->ps, &t->o);
    }
    if (!t->opt) return runtime_error(t, "optimizer: %s", tdm_last_error());
    tdm_sched s = {.kind = TDM_SCHED_CONSTANT, .base_lr = (float)o->lr};
    if (strcmp(o->schedule, "step") == 0) {
        s.kind = TDM_SCHED_STEP;
        s.gamma = (float)o->gamma;
        s.step_size = o->step_size;
    } else if (strcmp(o->schedule, "cosine") == 0) {
        s.kind = TDM_SCHED_COSINE;
        s.warmup = o->warmup_steps;
        s.total = o->epochs * t->steps_per_epoch;
        if (s.warmup > s.total) {
            progress_clear(&t->prog);
            return usage_error("--warmup-steps %lld is more than the %lld steps of the run",
                               (long long)s.warmup, (long long)s.total);
        }
    }
    t->sched = s;
    return 0;
}

static int make_model(trainer *t) {
    tdm_rng rng = tdm_rng_make((uint64_t)t->o.seed);
    t->model = model_build(t->o.model, t->dev, &rng);
    if (!t->model) return runtime_error(t, "model %s: %s", t->o.model, tdm_last_error());
    t->ps = tdm_module_parameters(t->model);
    if (!t->ps) return runtime_error(t, "model %s: %s", t->o.model, tdm_last_error());
    return 0;
}

/* Buffers reused by every step and every chunk: nothing is allocated per step. */
static int make_buffers(trainer *t) {
    int64_t B = t->o.batch_size, chunk = SYNC_STEPS * B;
    int64_t host = chunk > EVAL_BATCH ? chunk : EVAL_BATCH;
    t->loss_buf = tdm_zeros(TDM_SHAPE(SYNC_STEPS), TDM_F32, t->dev);
    t->pred_buf = tdm_zeros(TDM_SHAPE(chunk), TDM_I64, t->dev);
    t->loss_host = malloc(sizeof(float) * SYNC_STEPS);
    t->time_host = malloc(sizeof(double) * SYNC_STEPS);
    t->lr_host = malloc(sizeof(double) * SYNC_STEPS);
    t->size_host = malloc(sizeof(int64_t) * SYNC_STEPS);
    t->pred_host = malloc(sizeof(int64_t) * (size_t)host);
    t->label_host = malloc(sizeof(int64_t) * (size_t)host);
    t->cap_step_loss = t->o.epochs * t->steps_per_epoch;
    t->step_loss = malloc(sizeof(float) * (size_t)(t->cap_step_loss + 1));
    t->hist = malloc(sizeof(epoch_stats) * (size_t)t->o.epochs);
    if (!t->loss_buf || !t->pred_buf) return runtime_error(t, "step buffers: %s", tdm_last_error());
    if (!t->loss_host || !t->time_host || !t->lr_host || !t->size_host || !t->pred_host ||
        !t->label_host || !t->step_loss || !t->hist)
        return runtime_error(t, "out of memory for step buffers");
    return 0;
}

static int64_t count_correct(const int64_t *pred, const int64_t *label, int64_t n) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) c += pred[i] == label[i];
    return c;
}

/* The schedule's learning rate at t on every replica's optimizer. */
static void apply_lr(trainer *t, int64_t at) {
    if (t->pipe) {
        tdm_pipe_set_lr(t->pipe, tdm_sched_lr(&t->sched, at));
        return;
    }
    for (int r = 0; r < (t->dp ? tdm_dp_devices(t->dp) : 1); r++)
        tdm_sched_apply(&t->sched, t->dp ? tdm_dp_optim(t->dp, r) : t->opt, at);
}

/* A replica's loss (tdm_loss_fn); its predictions go straight to the host chunk buffer at
 * the replica's rows. */
static tdm_tensor *replica_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    trainer *t = arg;
    tdm_tensor *loss = tdm_cross_entropy(out, target, NULL), *pred = NULL;
    bool prev = tdm_set_grad_enabled(false);
    int rc = loss && tdm_max(out, 1, false, &pred) ? 0 : -1;
    if (!rc)
        rc = tdm_to_host(pred, t->pred_host + t->chunk_images + row0,
                         sizeof(int64_t) * (size_t)out->shape[0]);
    tdm_set_grad_enabled(prev);
    return rc ? NULL : loss;
}

/* A data-parallel or pipelined step: the replicas (or the last stage) record losses and
 * predictions on the host. */
static int train_step_on_host(trainer *t, const tdm_batch *b) {
    float loss = NAN;
    int rc = t->dp ? tdm_dp_step(t->dp, b->x, b->y, replica_loss, t, &loss)
                   : tdm_pipe_step(t->pipe, b->x, b->y, replica_loss, t, &loss);
    if (!rc) memcpy(t->label_host + t->chunk_images, b->y_host, sizeof(int64_t) * (size_t)b->size);
    if (rc) return runtime_error(t, "training step: %s", tdm_last_error());
    t->loss_host[t->chunk_steps] = loss;
    return 0;
}

/* Data parallelism pays when each device's share of a step is large next to the ~0.1-0.2 ms
 * a step spends synchronising the devices (bench/RESULTS.md, bench_dp: the MLP, 32 MFLOP of
 * products per device per step, gains 1.2x on 2 devices; the CNN, several hundred, 1.95x). The
 * first step's products on this thread are device 0's share: below the threshold, say so. */
#define SMALL_DEVICE_WORK_FLOPS 100e6

static void note_small_work(trainer *t, uint64_t flops) {
    int procs = t->g ? tdm_group_size(t->g) : 1;
    if (t->pipe || t->o.n_devs * procs < 2 || t->dev.type != TDM_CPU || t->o.quiet ||
        (double)flops >= SMALL_DEVICE_WORK_FLOPS)
        return;
    progress_clear(&t->prog);
    printf("note      %.0f MFLOP of matrix products per device per step: little next to the "
           "devices' synchronisation; expect well under %dx (a larger --batch-size, or fewer "
           "devices, does better)\n",
           (double)flops / 1e6, t->o.n_devs * procs);
    fflush(stdout);
}

/* One optimizer step on batch b; records loss and predictions into the chunk buffers. */
static int train_step(trainer *t, const tdm_batch *b) {
    if (t->dp || t->pipe) return train_step_on_host(t, b);
    int k = t->chunk_steps;
    int64_t off = t->chunk_images, n = b->size;
    if (tdm_scope_begin() != TDM_OK) return runtime_error(t, "%s", tdm_last_error());
    tdm_tensor *x = b->x, *y = b->y;
    if (!tdm_device_equal(x->device, t->dev)) {
        x = tdm_to_device(x, t->dev);
        y = tdm_to_device(y, t->dev);
    }
    int rc = tdm_optim_zero_grad(t->opt);
    /* x [n, 1, 28, 28] -> logits [n, 10] -> loss [] */
    tdm_trace_begin("forward");
    tdm_tensor *logits = rc       ? NULL
                         : t->ddp ? tdm_ddp_forward(t->ddp, x)
                                  : tdm_module_forward(t->model, x);
    tdm_tensor *loss = tdm_cross_entropy(logits, y, NULL);
    tdm_trace_end();
    tdm_trace_begin("backward");
    rc = !loss ? -1 : t->ddp ? tdm_ddp_backward(t->ddp, loss) : tdm_backward(loss);
    tdm_trace_end();
    tdm_trace_begin("optimizer");
    if (!rc) rc = tdm_optim_step(t->opt);
    tdm_trace_end();
    if (!rc) {
        /* bookkeeping outside autograd: argmax and two device-side copies */
        bool prev = tdm_set_grad_enabled(false);
        tdm_tensor *pred = NULL;
        rc = tdm_max(logits, 1, false, &pred) ? 0 : -1;
        if (!rc) rc = tdm_copy_(tdm_slice(t->pred_buf, 0, off, off + n, 1), pred);
        if (!rc)
            rc = tdm_copy_(tdm_slice(t->loss_buf, 0, k, k + 1, 1), tdm_reshape(loss, TDM_SHAPE(1)));
        if (!rc) memcpy(t->label_host + off, b->y_host, sizeof(int64_t) * (size_t)n);
        tdm_set_grad_enabled(prev);
    }
    tdm_scope_end();
    if (rc) return runtime_error(t, "training step: %s", tdm_last_error());
    return 0;
}

/* Reads the chunk's losses and predictions back, checks them, logs each step, and updates
 * the epoch totals and the progress display. step: steps done in this epoch. */
static int sync_chunk(trainer *t, int epoch, int64_t step) {
    int k = t->chunk_steps;
    if (k == 0) return 0;
    bool on_host = t->dp || t->pipe; /* the replicas or stages wrote them there */
    int rc = on_host ? TDM_OK : tdm_scope_begin();
    if (!rc && !on_host)
        rc = tdm_to_host(tdm_slice(t->loss_buf, 0, 0, k, 1), t->loss_host, sizeof(float) * k);
    if (!rc && !on_host)
        rc = tdm_to_host(tdm_slice(t->pred_buf, 0, 0, t->chunk_images, 1), t->pred_host,
                         sizeof(int64_t) * (size_t)t->chunk_images);
    if (!on_host) tdm_scope_end();
    if (rc) return runtime_error(t, "reading losses back: %s", tdm_last_error());
    for (int i = 0; i < k; i++) {
        int64_t s = step - k + i + 1;
        double loss = t->loss_host[i];
        if (!isfinite(loss))
            return runtime_error(t,
                                 "the loss is %s at epoch %d, step %lld (lr %g): training "
                                 "diverged; try a lower --lr",
                                 isnan(loss) ? "nan" : "infinite", epoch, (long long)s,
                                 t->lr_host[i]);
        double dt = t->time_host[i] - (i ? t->time_host[i - 1] : t->t_last);
        log_step(&t->log, epoch, s, t->global_step - k + i + 1, loss, t->lr_host[i], "img_s",
                 dt > 0 ? (double)t->size_host[i] / dt : NAN);
        t->loss_sum += loss * (double)t->size_host[i];
        if (t->n_step_loss < t->cap_step_loss) t->step_loss[t->n_step_loss++] = (float)loss;
    }
    t->correct += count_correct(t->pred_host, t->label_host, t->chunk_images);
    t->images += t->chunk_images;
    t->t_last = t->time_host[k - 1];
    t->chunk_steps = 0;
    t->chunk_images = 0;
    progress_update(&t->prog, step, t->loss_sum / (double)t->images, t->images, t->t_last);
    return 0;
}

/* Whether to read back after this step: a full chunk, the end of the epoch, or a plain
 * progress line due. */
static bool sync_due(const trainer *t, int64_t step) {
    if (t->chunk_steps == SYNC_STEPS || step >= t->steps_per_epoch) return true;
    if (t->prog.tty || t->prog.quiet) return false;
    int64_t every = t->o.print_every > 0 ? t->o.print_every : (t->steps_per_epoch + 9) / 10;
    return every > 0 && step % every == 0;
}

/* Writes a checkpoint of replica 0 (the replicas are identical) at the current step, with
 * the epoch's running totals so a resumed epoch reports the same loss and accuracy. */
static int save_checkpoint(trainer *t) {
    /* under MPI rank 0 writes; every rank loads */
    if (!t->o.checkpoint_dir || t->last_saved == t->global_step || t->silent) return 0;
    char loss[64], correct[32], images[32];
    snprintf(loss, sizeof loss, "%a", t->loss_sum);
    snprintf(correct, sizeof correct, "%lld", (long long)t->correct);
    snprintf(images, sizeof images, "%lld", (long long)t->images);
    tdm_meta meta[3] = {
        {"epoch_loss_sum", loss}, {"epoch_correct", correct}, {"epoch_images", images}};
    tdm_train_state s = {.model = t->model,
                         .optim = t->opt,
                         .loader = t->train_l,
                         .rng = tdm_default_rng(),
                         .step = t->global_step,
                         .meta = meta,
                         .n_meta = 3};
    if (tdm_checkpoint_save(t->o.checkpoint_dir, &s, (int)t->o.keep) != TDM_OK)
        return runtime_error(t, "checkpoint: %s", tdm_last_error());
    t->last_saved = t->global_step;
    return 0;
}

/* After a step: a periodic checkpoint, or the stop of --max-steps (with its checkpoint).
 * Reads the chunk back first so the saved epoch totals are complete. */
static int after_step(trainer *t, int epoch, int64_t step) {
    bool stop = t->o.max_steps > 0 && t->global_step >= t->o.max_steps;
    bool every = t->o.checkpoint_every > 0 && t->global_step % t->o.checkpoint_every == 0;
    if (!stop && !every) return 0;
    if (sync_chunk(t, epoch, step) || save_checkpoint(t)) return EXIT_RUNTIME;
    t->stopped = stop;
    return 0;
}

/* Under MPI: the epoch's loss sum, correct count and images summed over the processes. */
static int reduce_totals(trainer *t) {
    float v[3] = {(float)t->loss_sum, (float)t->correct, (float)t->images};
    tdm_tensor *s = tdm_from_data(TDM_SHAPE(3), TDM_F32, tdm_cpu(0), v);
    int rc = s ? tdm_work_wait(tdm_all_reduce(t->g, s, TDM_SUM)) : tdm_last_status();
    if (!rc) rc = tdm_to_host(s, v, sizeof v);
    tdm_tensor_free(s);
    if (rc) return runtime_error(t, "reducing the epoch's metrics: %s", tdm_last_error());
    t->loss_sum = v[0], t->correct = (int64_t)v[1], t->images = (int64_t)v[2];
    return 0;
}

static int train_epoch(trainer *t, int epoch, epoch_stats *e) {
    int64_t skip = t->resume_batch; /* batches of this epoch done before a resume */
    t->resume_batch = 0;
    if (tdm_loader_start_epoch_at(t->train_l, epoch - 1, skip) != TDM_OK)
        return runtime_error(t, "training loader: %s", tdm_last_error());
    if (t->sched.kind == TDM_SCHED_STEP) apply_lr(t, epoch - 1);
    tdm_module_train(t->model, true);
    double wait0 = tdm_loader_wait_seconds(t->train_l), t0 = progress_now();
    t->loss_sum = skip ? t->resume_loss_sum : 0;
    t->correct = skip ? t->resume_correct : 0;
    t->images = skip ? t->resume_images : 0;
    t->t_last = t0;
    progress_epoch_begin(&t->prog, epoch, (int)t->o.epochs, t->steps_per_epoch, t0);
    int64_t step = skip;
    tdm_batch b;
    while (!t->stopped) {
        tdm_trace_begin("wait for data");
        int r = tdm_loader_next(t->train_l, &b);
        tdm_trace_end();
        if (r < 0) return runtime_error(t, "loading a training batch: %s", tdm_last_error());
        if (r == 0) break;
        if (t->sched.kind == TDM_SCHED_COSINE) apply_lr(t, t->global_step);
        t->lr_host[t->chunk_steps] = tdm_optim_lr(t->opt);
        t->size_host[t->chunk_steps] = b.size;
        uint64_t flops = tdm_gemm_flops();
        tdm_trace_begin("step");
        int step_rc = train_step(t, &b);
        tdm_trace_end();
        if (step_rc) return EXIT_RUNTIME;
        if (step == skip && epoch == t->start_epoch) note_small_work(t, tdm_gemm_flops() - flops);
        t->time_host[t->chunk_steps] = progress_now();
        t->chunk_steps++;
        t->chunk_images += b.size;
        step++;
        t->global_step++;
        if (sync_due(t, step) && sync_chunk(t, epoch, step)) return EXIT_RUNTIME;
        if (after_step(t, epoch, step)) return EXIT_RUNTIME;
    }
    if (sync_chunk(t, epoch, step)) return EXIT_RUNTIME;
    if (t->g && reduce_totals(t)) return EXIT_RUNTIME;
    double secs = progress_now() - t0;
    *e = (epoch_stats){.epoch = epoch,
                       .train_loss = t->images ? t->loss_sum / (double)t->images : NAN,
                       .train_acc = t->images ? (double)t->correct / (double)t->images : NAN,
                       .seconds = secs,
                       .img_s = secs > 0 ? (double)t->images / secs : NAN,
                       .loader_wait_s = tdm_loader_wait_seconds(t->train_l) - wait0,
                       .lr = tdm_optim_lr(t->opt)};
    return 0;
}

/* Test loss and accuracy in eval mode, without autograd. */
static int evaluate_all(trainer *t, epoch_stats *e);

static int evaluate(trainer *t, epoch_stats *e) {
    tdm_trace_begin("evaluate");
    /* the stages' trained weights back into the model that evaluates */
    int rc = t->pipe && tdm_pipe_copy_to(t->pipe, t->model)
                 ? runtime_error(t, "pipeline: %s", tdm_last_error())
                 : evaluate_all(t, e);
    tdm_trace_end();
    return rc;
}

static int evaluate_all(trainer *t, epoch_stats *e) {
    double t0 = progress_now();
    if (tdm_loader_start_epoch(t->test_l, 0) != TDM_OK)
        return runtime_error(t, "test loader: %s", tdm_last_error());
    tdm_ce_opts sum = tdm_ce_defaults();
    sum.reduction = TDM_REDUCE_SUM;
    tdm_module_train(t->model, false);
    bool prev = tdm_set_grad_enabled(false);
    double loss_sum = 0;
    int64_t correct = 0, n = 0;
    int r, rc = 0;
    tdm_batch b;
    while (!rc && (r = tdm_loader_next(t->test_l, &b)) != 0) {
        if (r < 0) {
            rc = -1;
            break;
        }
        if ((rc = tdm_scope_begin()) != TDM_OK) break;
        tdm_tensor *x = b.x, *y = b.y, *pred = NULL;
        if (!tdm_device_equal(x->device, t->dev)) {
            x = tdm_to_device(x, t->dev);
            y = tdm_to_device(y, t->dev);
        }
        tdm_tensor *logits = tdm_module_forward(t->model, x);
        tdm_tensor *loss = tdm_cross_entropy(logits, y, &sum);
        float l = tdm_item(loss);
        if (!loss || !tdm_max(logits, 1, false, &pred) || isnan(l)) rc = -1;
        size_t bytes = sizeof(int64_t) * (size_t)b.size;
        if (!rc) rc = tdm_to_host(pred, t->pred_host, bytes);
        if (!rc) memcpy(t->label_host, b.y_host, bytes);
        tdm_scope_end();
        loss_sum += l;
        correct += count_correct(t->pred_host, t->label_host, b.size);
        n += b.size;
    }
    tdm_set_grad_enabled(prev);
    tdm_module_train(t->model, true);
    if (rc) return runtime_error(t, "evaluation: %s", tdm_last_error());
    e->test_loss = n ? loss_sum / (double)n : NAN;
    e->test_acc = n ? (double)correct / (double)n : NAN;
    e->eval_seconds = progress_now() - t0;
    return 0;
}

/* Appends a JSON string (escaped) to buf. */
static void json_str(char *buf, size_t cap, const char *key, const char *v, bool comma) {
    size_t n = strlen(buf);
    n += (size_t)snprintf(buf + n, cap - n, "\"%s\":\"", key);
    for (; *v && n + 8 < cap; v++) {
        unsigned char c = (unsigned char)*v;
        if (c == '"' || c == '\\')
            n += (size_t)snprintf(buf + n, cap - n, "\\%c", c);
        else if (c < 0x20)
            n += (size_t)snprintf(buf + n, cap - n, "\\u%04x", c);
        else
            buf[n++] = (char)c, buf[n] = '\0';
    }
    snprintf(buf + n, cap - n, "\"%s", comma ? "," : "");
}

static void write_config(trainer *t) {
    const train_opts *o = &t->o;
    char f[2048] = "";
    json_str(f, sizeof f, "model", o->model, true);
    json_str(f, sizeof f, "data", o->data, true);
    json_str(f, sizeof f, "optimizer", o->optimizer, true);
    json_str(f, sizeof f, "schedule", o->schedule, true);
    json_str(f, sizeof f, "devices", o->devices, true);
    json_str(f, sizeof f, "denormals", o->denormals, true);
    size_t n = strlen(f);
    snprintf(f + n, sizeof f - n,
             "\"lr\":%g,\"momentum\":%g,\"weight_decay\":%g,\"epochs\":%lld,"
             "\"batch_size\":%lld,\"steps_per_epoch\":%lld,\"train_samples\":%lld,"
             "\"test_samples\":%lld,\"seed\":%lld,\"workers\":%lld,\"parameters\":%lld",
             o->lr, o->momentum, o->weight_decay, (long long)o->epochs, (long long)o->batch_size,
             (long long)t->steps_per_epoch, (long long)t->train_ds->n, (long long)t->test_ds->n,
             (long long)o->seed, (long long)o->workers, (long long)t->ps->total);
    log_config(&t->log, f);
}

static void describe_optimizer(const train_opts *o, char *buf, size_t cap) {
    int n = snprintf(buf, cap, "%s lr %g", o->optimizer, o->lr);
    if (strcmp(o->optimizer, "sgd") == 0 && o->momentum > 0)
        n += snprintf(buf + n, cap - (size_t)n, " momentum %g", o->momentum);
    if (o->weight_decay > 0)
        n += snprintf(buf + n, cap - (size_t)n, " weight decay %g", o->weight_decay);
    if (strcmp(o->schedule, "constant") != 0)
        snprintf(buf + n, cap - (size_t)n, ", %s schedule", o->schedule);
}

static void banner(trainer *t) {
    char opt[160], dev[16];
    describe_optimizer(&t->o, opt, sizeof opt);
    snprintf(t->title, sizeof t->title, "%s on %s: %s", t->o.model, t->o.data, opt);
    if (t->o.quiet) return;
    printf("model     %s, %lld parameters, on %s", t->o.model, (long long)t->ps->total,
           tdm_device_str(t->dev, dev));
    for (int i = 1; i < t->o.n_devs; i++) printf(",%s", tdm_device_str(t->o.devs[i], dev));
    int procs = t->g ? tdm_group_size(t->g) : 1;
    if (procs > 1) printf(" in each of %d processes", procs);
    if (t->pipe) {
        printf(" (%lld pipeline stages, layers", (long long)t->o.model_split);
        for (int s = 0; s < tdm_pipe_stages(t->pipe); s++)
            printf(" %d-%d", tdm_pipe_stage_first_layer(t->pipe, s),
                   tdm_pipe_stage_first_layer(t->pipe, s + 1) - 1);
        printf(", %lld micro-batches, %s)", (long long)t->o.micro_batches, t->o.pipe_schedule);
    } else if (t->o.n_devs * procs > 1)
        printf(" (data parallel, %lld samples per device per step)",
               (long long)(t->o.batch_size / (t->o.n_devs * procs)));
    printf("\n");
    if (t->dev.type == TDM_CPU) progress_print_compute(stdout);
    printf("data      %s: %lld train, %lld test samples; batch %lld, %lld steps per epoch, "
           "%lld loader workers\n",
           t->o.data, (long long)t->train_ds->n, (long long)t->test_ds->n,
           (long long)t->o.batch_size, (long long)t->steps_per_epoch, (long long)t->o.workers);
    printf("optimizer %s\n", opt);
    fflush(stdout);
}

static void print_epoch(const trainer *t, const epoch_stats *e) {
    printf("epoch %d/%lld  train loss %.4f acc %5.2f%%  test loss %.4f acc %5.2f%%  %.2f s  "
           "%.0f img/s  loader wait %.2f s",
           e->epoch, (long long)t->o.epochs, e->train_loss, 100 * e->train_acc, e->test_loss,
           100 * e->test_acc, e->seconds, e->img_s, e->loader_wait_s);
    int devices = t->o.n_devs * (t->g ? tdm_group_size(t->g) : 1);
    if (devices > 1) printf("  (%.0f img/s per device)", e->img_s / devices);
    printf("\n");
    fflush(stdout);
}

static int write_plot(trainer *t) {
    if (!t->o.plot_path) return 0;
    const epoch_stats *last = t->n_hist ? &t->hist[t->n_hist - 1] : NULL;
    snprintf(t->subtitle, sizeof t->subtitle,
             "batch %lld, %lld train samples, seed %lld, %s%s%.2f%%", (long long)t->o.batch_size,
             (long long)t->train_ds->n, (long long)t->o.seed, t->o.devices,
             last ? "; test accuracy " : "", last ? 100 * last->test_acc : 0.0);
    if (!last) t->subtitle[strlen(t->subtitle) - 5] = '\0'; /* drop the number */
    plot_data d = {.title = t->title,
                   .subtitle = t->subtitle,
                   .step_loss = t->step_loss,
                   .n_steps = t->n_step_loss,
                   .steps_per_epoch = t->steps_per_epoch,
                   .epochs = t->hist,
                   .n_epochs = t->n_hist,
                   .total_epochs = (double)t->o.epochs};
    if (plot_write_svg(t->o.plot_path, &d) != 0)
        return runtime_error(t, "cannot write plot '%s': %s", t->o.plot_path, strerror(errno));
    return 0;
}

/* --init-from: weights made elsewhere (PyTorch included), before the replicas are cloned. */
static int init_weights(trainer *t) {
    if (!t->o.init_from) return 0;
    if (tdm_weights_load(t->o.init_from, t->model) != TDM_OK)
        return runtime_error(t, "--init-from: %s", tdm_last_error());
    return 0;
}

/* Reads the trainer's own metadata of a checkpoint (the resumed epoch's totals). */
static int resume_totals(trainer *t, const char *path) {
    char v[64];
    if (tdm_checkpoint_meta(path, "epoch_loss_sum", v, sizeof v) == 1)
        t->resume_loss_sum = strtod(v, NULL);
    if (tdm_checkpoint_meta(path, "epoch_correct", v, sizeof v) == 1)
        t->resume_correct = strtoll(v, NULL, 10);
    if (tdm_checkpoint_meta(path, "epoch_images", v, sizeof v) == 1)
        t->resume_images = strtoll(v, NULL, 10);
    return 0;
}

/* --resume: restores every replica's weights and optimizer from the newest checkpoint, and
 * the data position, RNG and step count once. */
static int resume(trainer *t) {
    t->start_epoch = 1;
    if (!t->o.resume) return 0;
    char path[4096];
    int64_t step = 0;
    int found = tdm_checkpoint_latest(t->o.checkpoint_dir, path, sizeof path, &step);
    if (found < 0) return runtime_error(t, "--resume: %s", tdm_last_error());
    if (found == 0) {
        if (!t->o.quiet)
            printf("resume    no checkpoint in %s yet: starting from the beginning\n",
                   t->o.checkpoint_dir);
        return 0;
    }
    int n = t->dp ? tdm_dp_devices(t->dp) : 1;
    for (int r = 0; r < n; r++) {
        tdm_train_state s = {.model = t->dp ? tdm_dp_replica(t->dp, r) : t->model,
                             .optim = t->dp ? tdm_dp_optim(t->dp, r) : t->opt};
        if (r == 0) s.loader = t->train_l, s.rng = tdm_default_rng();
        if (tdm_checkpoint_load(path, &s) != TDM_OK)
            return runtime_error(t, "--resume from '%s': %s", path, tdm_last_error());
        if (r == 0) t->global_step = s.step;
    }
    int64_t epoch = 0, batch = 0;
    tdm_loader_position(t->train_l, &epoch, &batch);
    t->start_epoch = (int)epoch + 1;
    t->resume_batch = batch;
    t->last_saved = t->global_step;
    resume_totals(t, path);
    if (!t->o.quiet)
        printf("resume    %s: epoch %d, step %lld of the epoch, %lld steps done\n", path,
               t->start_epoch, (long long)batch, (long long)t->global_step);
    return 0;
}

static int run(trainer *t) {
    int rc;
    if (t->o.log_path && log_open(&t->log, t->o.log_path) != 0)
        return runtime_error(t, "cannot write log '%s': %s", t->o.log_path, strerror(errno));
    t->last_saved = -1;
    if ((rc = load_data(t)) || (rc = make_loaders(t)) || (rc = make_model(t)) ||
        (rc = init_weights(t)) || (rc = make_optimizer(t)) || (rc = make_buffers(t)) ||
        (rc = resume(t)))
        return rc;
    if (!t->silent) banner(t);
    write_config(t);
    if ((rc = write_plot(t))) return rc; /* fail early on an unwritable path */
    double t0 = progress_now();
    for (int epoch = t->start_epoch; epoch <= t->o.epochs && !t->stopped; epoch++) {
        epoch_stats *e = &t->hist[t->n_hist];
        if ((rc = train_epoch(t, epoch, e))) return rc;
        if (t->stopped) break;
        if ((rc = evaluate(t, e))) return rc;
        t->n_hist++;
        progress_clear(&t->prog);
        if (!t->silent) print_epoch(t, e);
        log_epoch(&t->log, e);
        if ((rc = write_plot(t))) return rc;
    }
    if ((rc = save_checkpoint(t))) return rc; /* the final one */
    if (t->stopped) {
        progress_clear(&t->prog);
        if (!t->o.quiet)
            printf("stopped   after %lld steps (--max-steps)%s%s\n", (long long)t->global_step,
                   t->o.checkpoint_dir ? "; continue with --resume, checkpoint in " : "",
                   t->o.checkpoint_dir ? t->o.checkpoint_dir : "");
        return 0;
    }
    if (!t->o.quiet && t->n_hist > 0) {
        printf("done      %lld epochs in %.1f s, test accuracy %.2f%%\n", (long long)t->o.epochs,
               progress_now() - t0, 100 * t->hist[t->n_hist - 1].test_acc);
        if (t->o.log_path) printf("log       %s\n", t->o.log_path);
        if (t->o.plot_path) printf("plot      %s\n", t->o.plot_path);
    }
    return 0;
}

static void trainer_free(trainer *t) {
    tdm_loader_free(t->train_l);
    tdm_loader_free(t->test_l);
    tdm_dataset_free(t->train_ds);
    tdm_dataset_free(t->test_ds);
    if (t->dp)
        tdm_dp_free(t->dp); /* frees every replica's optimizer */
    else if (t->pipe)
        tdm_pipe_free(t->pipe); /* and every stage's */
    else
        tdm_optim_free(t->opt);
    tdm_module_free(t->model);
    tdm_tensor_free(t->loss_buf);
    tdm_tensor_free(t->pred_buf);
    free(t->loss_host);
    free(t->time_host);
    free(t->lr_host);
    free(t->size_host);
    free(t->pred_host);
    free(t->label_host);
    free(t->step_loss);
    free(t->hist);
}

/* Started by mpirun: this process is one rank of the world; the global batch is split over
 * the ranks and only rank 0 prints and writes files. */
static int join_mpi(trainer *t, int *argc, char ***argv) {
    t->g = tdm_mpi_init(argc, argv);
    if (!t->g) return runtime_error(t, "mpi: %s", tdm_last_error());
    int n = tdm_group_size(t->g);
    tdm_group_set_timeout(t->g, t->o.timeout);
    if (t->o.batch_per_device) t->o.batch_size *= n;
    if (t->o.model_split > 1) return usage_error("--model-split does not work under mpirun yet");
    if (t->o.batch_size % n)
        return usage_error("--batch-size %lld does not split evenly over %d processes",
                           (long long)t->o.batch_size, n);
    if (t->o.batch_size / n < t->o.n_devs)
        return usage_error("--batch-size %lld gives each of %d processes fewer rows than its %d "
                           "devices",
                           (long long)t->o.batch_size, n, t->o.n_devs);
    if (tdm_group_rank(t->g) != 0) {
        t->silent = t->o.quiet = true;
        t->o.log_path = t->o.plot_path = t->o.trace_path = NULL;
    }
    return 0;
}

/* --model gpt: its own loop (train_gpt.c), from the shared options. */
static int train_gpt_main(train_opts *o) {
    tdm_group *procs = NULL;
    if (tdm_mpi_launched()) { /* as join_mpi: rank 0 alone prints and writes */
        if (!(procs = tdm_mpi_init(NULL, NULL)))
            return fprintf(stderr, "tandem train: error: mpi: %s\n", tdm_last_error()),
                   EXIT_RUNTIME;
        tdm_group_set_timeout(procs, o->timeout);
        int n = tdm_group_size(procs);
        if (o->batch_per_device) o->batch_size *= n;
        if (o->batch_size % n || o->batch_size / n < o->n_devs)
            return usage_error("--batch-size %lld does not split evenly over %d processes of %d "
                               "devices",
                               (long long)o->batch_size, n, o->n_devs);
    }
    bool rank0 = !procs || tdm_group_rank(procs) == 0;
    gpt_train_opts g = {.data = o->data,
                        .procs = procs,
                        .init_from = o->init_from,
                        .save = rank0 ? o->save_path : NULL,
                        .log_path = rank0 ? o->log_path : NULL,
                        .plot_path = rank0 ? o->plot_path : NULL,
                        .checkpoint_dir = o->checkpoint_dir,
                        .write_checkpoints = rank0,
                        .checkpoint_every = o->checkpoint_every,
                        .resume = o->resume,
                        .layers = o->layers ? o->layers : 2,
                        .heads = o->heads ? o->heads : 4,
                        .channels = o->channels ? o->channels : 128,
                        .context = o->context,
                        .vocab = o->vocab,
                        .epochs = o->epochs,
                        .batch_size = o->batch_size,
                        .workers = o->workers,
                        .seed = o->seed,
                        .warmup_steps = o->warmup_steps,
                        .max_steps = o->max_steps,
                        .print_every = o->print_every,
                        .lr = o->lr,
                        .weight_decay = o->weight_decay,
                        .clip = o->clip,
                        .grad_accum = o->grad_accum ? o->grad_accum : 1,
                        .cosine = strcmp(o->schedule, "cosine") == 0,
                        .quiet = o->quiet || !rank0,
                        .devs = o->devs,
                        .n_devs = o->n_devs};
    const char *trace = rank0 ? o->trace_path : NULL;
    if (trace && tdm_trace_start(trace, 0) != 0)
        return fprintf(stderr, "tandem train: error: trace: %s\n", tdm_last_error()), EXIT_RUNTIME;
    tdm_trace_name_thread("training loop (and devices[0] compute)");
    int rc = gpt_train(&g);
    if (trace && tdm_trace_stop() != 0 && rc == 0) {
        fprintf(stderr, "tandem train: error: %s\n", tdm_last_error());
        rc = EXIT_RUNTIME;
    } else if (trace && rc == 0 && !g.quiet) {
        printf("trace     %s\n", trace);
    }
    if (procs && !rc) tdm_mpi_finalize(); /* after a failure MPI_Finalize could wait forever */
    return rc;
}

int train_main(int argc, char **argv) {
    trainer t = {0};
    int rc = parse_args(argc, argv, &t.o);
    t.dev = t.o.devs[0];
    if (rc < 0) {
        train_help(stdout);
        return EXIT_OK;
    }
    if (rc) return rc;
    /* before any thread starts: devices, loader workers and GEMM threads inherit it */
    tdm_set_flush_denormal(strcmp(t.o.denormals, "flush") == 0);
    if (strcmp(t.o.model, "gpt") == 0) return train_gpt_main(&t.o);
    if (tdm_mpi_launched() && (rc = join_mpi(&t, &argc, &argv))) return rc;
    progress_init(&t.prog, stdout, t.o.quiet, t.o.print_every);
    if (t.o.trace_path && tdm_trace_start(t.o.trace_path, 0) != 0)
        return runtime_error(&t, "trace: %s", tdm_last_error());
    /* with several devices this thread also runs device 0's replica */
    tdm_trace_name_thread("training loop (and devices[0] compute)");
    rc = run(&t);
    if (t.o.trace_path && tdm_trace_stop() != 0 && rc == 0)
        rc = runtime_error(&t, "%s", tdm_last_error());
    else if (t.o.trace_path && rc == 0 && !t.o.quiet)
        printf("trace     %s\n", t.o.trace_path);
    if (log_close(&t.log) != 0 && rc == 0)
        rc = runtime_error(&t, "writing log '%s' failed", t.o.log_path);
    if (t.g && rc) tdm_group_abort(t.g, "its training failed"); /* the others stop too */
    tdm_ddp_free(t.ddp);
    trainer_free(&t);
    if (t.g && !rc) tdm_mpi_finalize(); /* after a failure MPI_Finalize could wait forever */
    return rc;
}
