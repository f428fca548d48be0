/* `tandem eval`: test loss and accuracy of saved weights (a .safetensors file written by
 * `tandem train --checkpoint-dir`, by tdm_weights_save, or by PyTorch for the same
 * nn.Sequential), on the test split of the data `tandem train` uses; for a GPT, the
 * next-token loss and accuracy over the windows of a text (a checkpoint of any data or tensor
 * parallel layout: they are all written whole). */
#include "eval.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tandem/tandem.h"
#include "task.h"
#include "train.h"

typedef struct {
    const char *weights, *model, *data, *eval_transform;
    int64_t limit, batch_size, image_size;
    int64_t layers, heads, channels, context, vocab; /* a GPT's, as tandem train's */
    bool batch_given;
} eval_opts;

void eval_help(FILE *out) {
    char names[256], text[64];
    tdm_model_list(TDM_TASK_IMAGE, "|", names, sizeof names);
    tdm_model_list(TDM_TASK_TEXT, "|", text, sizeof text);
    fprintf(
        out,
        "NAME\n    tandem eval - test loss and accuracy of saved weights\n\n"
        "SYNOPSIS\n    tandem eval --weights FILE [--model NAME] [--data fashion-mnist|DIR|...]\n"
        "                [--image-size S] [--eval-transform STEPS] [--limit N]\n"
        "                [--batch-size B]\n"
        "    tandem eval --weights FILE --model %s --data FILE [--layers N] [--heads N]\n"
        "                [--channels N] [--context T] [--vocab V] [--limit N] [--batch-size B]\n\n"
        "OPTIONS\n"
        "    --weights FILE\n"
        "        A .safetensors file of the model's parameters under PyTorch's names (from\n"
        "        tandem train --checkpoint-dir, or PyTorch's state_dict of the same\n"
        "        nn.Sequential), a checkpoint directory holding model.safetensors or\n"
        "        the shard files of a sharded run (--shard under mpirun), or\n"
        "        a run's --checkpoint-dir (its newest checkpoint).\n"
        "        Required.\n"
        "    --model %s|%s\n"
        "        The network the weights belong to (see tandem train --help). Default: %s.\n"
        "        For a GPT, --layers, --heads, --channels, --context and --vocab give its\n"
        "        shape as they gave it to tandem train, and --data a text or token shard:\n"
        "        the next-token loss and accuracy over its windows are printed (a\n"
        "        checkpoint of a --tensor-parallel or data-parallel run is the whole model\n"
        "        like any other).\n"
        "    --data fashion-mnist|DIR|cifar10:DIR|cifar100:DIR\n"
        "        As for tandem train; the test split is used. Default: fashion-mnist.\n"
        "    --image-size S, --eval-transform STEPS|PRESET\n"
        "        As for tandem train: the test images' size and transforms. Default: the\n"
        "        data's.\n"
        "    --limit N\n"
        "        Use the first N/6 test samples (at least 1), as tandem train --limit N does\n"
        "        (a GPT: the first N windows).\n"
        "        Default: all.\n"
        "    --batch-size B\n"
        "        Samples (a GPT: windows) per forward pass. Default: 1000 (a GPT: 8).\n\n"
        "OUTPUT\n    One line: test loss, accuracy and the number of samples.\n\n"
        "EXIT STATUS\n    0 success, 1 runtime error (unreadable or mismatched weights), 2 "
        "usage error.\n\n"
        "EXAMPLES\n"
        "    tandem train --model cnn --checkpoint-dir runs/cnn\n"
        "    tandem eval --model cnn --weights runs/cnn/ckpt-0000000938/model.safetensors\n",
        text, names, text, tdm_model_at(0)->name);
}

static int usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tandem eval: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see 'tandem eval --help')\n");
    va_end(ap);
    return EXIT_USAGE;
}

static int fail(const char *fmt, const char *a, const char *b) {
    fprintf(stderr, "tandem eval: error: ");
    fprintf(stderr, fmt, a, b);
    fputc('\n', stderr);
    return EXIT_RUNTIME;
}

static int parse_int(const char *name, const char *v, int64_t lo, int64_t *out) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end || errno == ERANGE || x < lo)
        return usage(lo == 1 ? "%s '%s': expected a positive integer"
                             : "%s '%s': expected an integer of at least 8",
                     name, v);
    *out = x;
    return 0;
}

static int parse(int argc, char **argv, eval_opts *o) {
    *o = (eval_opts){.model = tdm_model_at(0)->name, .data = "fashion-mnist", .batch_size = 1000};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) return -1;
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        static const char *const gpt[] = {"--layers", "--heads", "--channels", "--context",
                                          "--vocab"};
        int g = 0;
        while (g < 5 && strcmp(a, gpt[g]) != 0) g++;
        bool known = !strcmp(a, "--weights") || !strcmp(a, "--model") || !strcmp(a, "--data") ||
                     !strcmp(a, "--limit") || !strcmp(a, "--batch-size") ||
                     !strcmp(a, "--image-size") || !strcmp(a, "--eval-transform") || g < 5;
        if (!known) return usage("unknown option or argument '%s'", a);
        if (!v || !*v) return usage("%s needs a value", a);
        i++;
        int rc = 0;
        if (!strcmp(a, "--weights"))
            o->weights = v;
        else if (!strcmp(a, "--model"))
            o->model = v;
        else if (!strcmp(a, "--data"))
            o->data = v;
        else if (!strcmp(a, "--eval-transform"))
            o->eval_transform = v;
        else if (!strcmp(a, "--limit"))
            rc = parse_int(a, v, 1, &o->limit);
        else if (!strcmp(a, "--image-size"))
            rc = parse_int(a, v, 8, &o->image_size);
        else if (g < 5)
            rc = parse_int(
                a, v, 1,
                (int64_t *[]){&o->layers, &o->heads, &o->channels, &o->context, &o->vocab}[g]);
        else
            rc = parse_int(a, v, 1, &o->batch_size), o->batch_given = true;
        if (rc) return rc;
    }
    if (!o->weights) return usage("--weights FILE is required");
    const tdm_model_info *row = tdm_model_find(o->model);
    char names[256];
    if (!row)
        return usage("--model: unknown model '%s' (expected one of %s)", o->model,
                     tdm_model_list(-1, ", ", names, sizeof names));
    bool text = row->task == TDM_TASK_TEXT,
         shaped = o->layers || o->heads || o->channels || o->context || o->vocab;
    if (!text && shaped)
        return usage("--layers, --heads, --channels, --context and --vocab apply to --model %s",
                     tdm_model_list(TDM_TASK_TEXT, " or ", names, sizeof names));
    if (text && (o->image_size || o->eval_transform))
        return usage("--image-size and --eval-transform apply to image models, not %s", o->model);
    if (text && !strcmp(o->data, "fashion-mnist"))
        return usage("--model %s needs --data FILE (a text, or an llm.c token shard)", o->model);
    return 0;
}

/* Sum of the loss and count of correct predictions over the loader's epoch 0. 0, or -1 with
 * the reason in why (cap bytes). */
static int run_eval(tdm_module *m, tdm_loader *l, double *loss_sum, int64_t *correct, int64_t *n,
                    char *why, size_t cap) {
    tdm_ce_opts sum = tdm_ce_defaults();
    sum.reduction = TDM_REDUCE_SUM;
    tdm_module_train(m, false);
    bool prev = tdm_set_grad_enabled(false);
    int r, rc = tdm_loader_start_epoch(l, 0);
    tdm_batch b;
    if (rc) snprintf(why, cap, "%s", tdm_last_error());
    while (!rc && (r = tdm_loader_next(l, &b)) != 0) {
        if (r < 0 || tdm_scope_begin()) {
            snprintf(why, cap, "%s", tdm_last_error());
            rc = -1;
            break;
        }
        /* images: x [B, 1, 28, 28] -> logits [B, 10]; a GPT's tokens: x [B, T] -> logits
         * [B, T, V], scored as B T rows of V against the next tokens y [B, T] */
        int64_t rows = tdm_numel(b.y);
        tdm_tensor *out = tdm_module_forward(m, b.x), *pred = NULL;
        tdm_tensor *logits =
            out ? tdm_reshape(out, TDM_SHAPE(rows, out->shape[out->ndim - 1])) : NULL;
        tdm_tensor *yr = tdm_reshape(b.y, TDM_SHAPE(rows));
        tdm_tensor *ce = logits && yr ? tdm_cross_entropy(logits, yr, &sum) : NULL;
        float loss = ce ? tdm_item(ce) : NAN;
        int64_t *p = malloc(sizeof *p * (size_t)rows), *y = malloc(sizeof *y * (size_t)rows);
        size_t bytes = sizeof *p * (size_t)rows;
        if (!p || !y || !ce || !tdm_max(logits, 1, false, &pred) || tdm_to_host(pred, p, bytes) ||
            tdm_to_host(yr, y, bytes)) {
            snprintf(why, cap, "%s", !p || !y ? "out of memory" : tdm_last_error());
            rc = -1;
        } else if (isnan(loss)) { /* finite weights (task_check_finite), outputs that are not */
            snprintf(why, cap,
                     "the loss of the test samples %lld to %lld is %g: the model's outputs are "
                     "not finite",
                     (long long)*n, (long long)(*n + b.size - 1), (double)loss);
            rc = -1;
        }
        for (int64_t i = 0; !rc && i < rows; i++) *correct += p[i] == y[i];
        *loss_sum += loss;
        *n += rows;
        free(p);
        free(y);
        tdm_scope_end();
    }
    tdm_set_grad_enabled(prev);
    return rc;
}

int eval_main(int argc, char **argv) {
    eval_opts o;
    int rc = parse(argc, argv, &o);
    if (rc < 0) {
        eval_help(stdout);
        return EXIT_OK;
    }
    if (rc) return rc;
    char path[4200], ckpt[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/model.safetensors", o.weights);
    if (stat(o.weights, &st) != 0 || !S_ISDIR(st.st_mode))
        snprintf(path, sizeof path, "%s", o.weights);
    else if (stat(path, &st) != 0 && tdm_checkpoint_is_sharded(o.weights))
        snprintf(path, sizeof path, "%s", o.weights); /* a sharded checkpoint */
    else if (stat(path, &st) != 0 && tdm_checkpoint_latest(o.weights, ckpt, sizeof ckpt, NULL) == 1)
        snprintf(path, sizeof path, "%s%s", ckpt, /* a run's directory */
                 tdm_checkpoint_is_sharded(ckpt) ? "" : "/model.safetensors");
    /* the data, its test transform and the model, as tandem train makes them */
    train_opts to = {.data = o.data,
                     .model = o.model,
                     .limit = o.limit,
                     .image_size = o.image_size,
                     .transform = NULL, /* the training split is opened, never read */
                     .eval_transform = o.eval_transform,
                     .layers = o.layers,
                     .heads = o.heads,
                     .channels = o.channels,
                     .context = o.context,
                     .vocab = o.vocab};
    task t;
    task_program = "tandem eval";
    bool text = tdm_model_find(o.model)->task == TDM_TASK_TEXT;
    if ((text ? task_text_open(&t, &to, tdm_cpu(0)) : task_image_open(&t, &to, tdm_cpu(0))) ||
        t.build(&t, &to)) {
        task_free(&t);
        return EXIT_RUNTIME;
    }
    tdm_module *m = t.model;
    /* a GPT's windows of the text (it has no test split), a few at a time */
    tdm_loader_opts lo = tdm_loader_defaults(text && !o.batch_given ? 8 : o.batch_size);
    lo.transform = t.test_tf;
    tdm_loader *l = tdm_loader_new(text ? t.train : t.test, &lo);
    rc = EXIT_OK;
    if (!l) {
        rc = fail("setting up the test data of --data '%s': %s", o.data, tdm_last_error());
    } else if ((tdm_checkpoint_is_sharded(path)
                    ? tdm_checkpoint_load(path, &(tdm_train_state){.model = m})
                    : tdm_weights_load(path, m)) != TDM_OK) {
        rc = fail("--weights '%s': %s", o.weights, tdm_last_error());
    } else if (!(rc = task_check_finite(m, "--weights", path))) {
        double loss = 0;
        int64_t correct = 0, n = 0;
        char why[512];
        if (run_eval(m, l, &loss, &correct, &n, why, sizeof why))
            rc = fail("evaluation of '%s': %s", path, why);
        else
            printf("%s loss %.4f acc %5.2f%%  (%lld %s, %s, %s)\n", text ? "next-token" : "test",
                   loss / (double)n, 100.0 * (double)correct / (double)n, (long long)n,
                   text ? "tokens" : "samples", o.model, path);
    }
    tdm_loader_free(l);
    task_free(&t);
    return rc;
}
