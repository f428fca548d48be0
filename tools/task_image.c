/* The image task: Fashion-MNIST (or MNIST) IDX files, the mlp or cnn of models.h, softmax
 * cross-entropy, accuracy, and an evaluation on the test split after every epoch. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "task.h"

int task_rank = -1;

int task_error(const char *fmt, ...) {
    fflush(stdout);
    /* one write of the whole line: under mpirun the processes share stderr, and pieces
     * written apart interleave with the other ranks' */
    char line[4096];
    int n = task_rank >= 0
                ? snprintf(line, sizeof line, "tandem train: error: rank %d: ", task_rank)
                : snprintf(line, sizeof line, "tandem train: error: ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    n = (int)strlen(line);
    line[n++] = '\n';
    if (write(STDERR_FILENO, line, (size_t)n) < 0) { /* nowhere left to say it */
    }
    return EXIT_RUNTIME;
}

tdm_optim *task_default_optimizer(tdm_paramset *ps, void *arg) {
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

int task_check_finite(tdm_module *m, const char *file) {
    tdm_paramset *ps = tdm_module_parameters(m); /* flattens once; the trainer reuses it */
    float *v = ps ? malloc(sizeof(float) * (size_t)ps->total) : NULL;
    if (!v || tdm_to_host(ps->flat, v, sizeof(float) * (size_t)ps->total) != TDM_OK) {
        free(v);
        return task_error("--init-from: reading the weights back: %s", tdm_last_error());
    }
    int bad = -1;
    for (int i = 0; i < ps->n && bad < 0; i++) {
        int64_t end = i + 1 < ps->n ? ps->offsets[i + 1] : ps->total;
        for (int64_t j = ps->offsets[i]; j < end && bad < 0; j++)
            if (!isfinite(v[j])) bad = i;
    }
    free(v);
    if (bad < 0) return 0;
    return task_error("--init-from '%s': '%s' holds non-finite values (nan or inf): these "
                      "weights cannot be trained from",
                      file, ps->names[bad]);
}

void task_free(task *t) {
    tdm_dataset_free(t->train);
    tdm_dataset_free(t->test);
    tdm_module_free(t->model);
    *t = (task){0};
}

/* Both splits; --limit keeps the first N training and N/6 test samples. */
static int load_images(task *t, const train_opts *o) {
    const char *dir = strcmp(o->data, "fashion-mnist") == 0 ? NULL : o->data;
    struct stat st;
    if (dir && stat(dir, &st) != 0)
        return task_error("data directory '%s': %s", dir, strerror(errno));
    if (dir && !S_ISDIR(st.st_mode))
        return task_error("data directory '%s' is not a directory", dir);
    const char *shown = dir ? dir : "/usr/share/datasets/fashion-mnist";
    if (!(t->train = tdm_fashion_mnist(dir, true)))
        return task_error("cannot load training data from '%s': %s", shown, tdm_last_error());
    if (!(t->test = tdm_fashion_mnist(dir, false)))
        return task_error("cannot load test data from '%s': %s", shown, tdm_last_error());
    if (tdm_dataset_sample_numel(t->train) != 784 || t->train->num_classes > 10) {
        char b[96];
        return task_error("'%s' holds %lld classes of images %s; the models expect 10 classes "
                          "of 1x28x28",
                          shown, (long long)t->train->num_classes,
                          tdm_shape_str(t->train->sample_shape, b));
    }
    if (o->limit > 0) { /* readers index samples i < n: a lower n keeps a prefix */
        int64_t test_n = o->limit / 6 > 0 ? o->limit / 6 : 1;
        if (t->train->n > o->limit) t->train->n = o->limit;
        if (t->test->n > test_n) t->test->n = test_n;
    }
    return 0;
}

/* The model, from the seed or --init-from (weights made elsewhere, PyTorch included). */
static int build_model(task *t, const train_opts *o, tdm_device dev) {
    tdm_rng rng = tdm_rng_make((uint64_t)o->seed);
    if (!(t->model = tdm_model_new(o->model, dev, &rng)))
        return task_error("model %s: %s", o->model, tdm_last_error());
    if (o->init_from && tdm_weights_load(o->init_from, t->model) != TDM_OK)
        return task_error("--init-from: %s", tdm_last_error());
    return o->init_from ? task_check_finite(t->model, o->init_from) : 0;
}

/* logits [n, 10], labels [n] -> the mean cross-entropy [] */
static tdm_tensor *image_loss(tdm_tensor *logits, const tdm_tensor *labels) {
    return tdm_cross_entropy(logits, labels, NULL);
}

int task_image_open(task *t, const train_opts *o, tdm_device dev) {
    *t = (task){.unit = "img",
                .units_per_sample = 1,
                .accuracy = true,
                .loss = image_loss,
                .optimizer = task_default_optimizer};
    int rc = load_images(t, o);
    if (!rc) rc = build_model(t, o, dev);
    snprintf(t->model_desc, sizeof t->model_desc, "%s", o->model);
    snprintf(t->plot_title, sizeof t->plot_title, "%s on %s", o->model, o->data);
    if (!rc)
        snprintf(t->data_desc, sizeof t->data_desc, "%lld train, %lld test samples",
                 (long long)t->train->n, (long long)t->test->n);
    return rc;
}
