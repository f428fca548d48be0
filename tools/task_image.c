/* The image task: Fashion-MNIST (or MNIST) IDX files, CIFAR's binary files or image folders,
 * their transforms, an image model of the registry (models.h), softmax cross-entropy,
 * accuracy, and an evaluation on the test split after every epoch. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "task.h"

int task_rank = -1;
const char *task_program = "tandem train";

int task_error(const char *fmt, ...) {
    fflush(stdout);
    /* one write of the whole line: under mpirun the processes share stderr, and pieces
     * written apart interleave with the other ranks' */
    char line[4096];
    int n = task_rank >= 0
                ? snprintf(line, sizeof line, "%s: error: rank %d: ", task_program, task_rank)
                : snprintf(line, sizeof line, "%s: error: ", task_program);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    n = (int)strlen(line);
    /* "...: " with an empty tdm_last_error() after it: a failure that recorded no cause
     * still says so rather than ending at the colon */
    if (n >= 2 && line[n - 2] == ':' && line[n - 1] == ' ') {
        snprintf(line + n, sizeof line - (size_t)n - 1, "(no cause was recorded)");
        n = (int)strlen(line);
    }
    line[n++] = '\n';
    if (write(STDERR_FILENO, line, (size_t)n) < 0) { /* nowhere left to say it */
    }
    return EXIT_RUNTIME;
}

/* --no-decay-1d: weight decay only on parameters of 2+ dims (biases and norms get 0), as
 * tdm_gpt_adamw_new. Takes opt (NULL passes through); frees it on failure. */
static tdm_optim *decay_matrices_only(tdm_optim *opt, const train_opts *o) {
    if (opt && o->no_decay_1d && tdm_optim_decay_matrices_only(opt, (float)o->weight_decay)) {
        tdm_optim_free(opt);
        return NULL;
    }
    return opt;
}

tdm_optim *task_default_optimizer(tdm_paramset *ps, void *arg) {
    const train_opts *o = arg;
    if (strcmp(o->optimizer, "sgd") == 0) {
        tdm_sgd_opts so = tdm_sgd_defaults((float)o->lr);
        so.momentum = (float)o->momentum;
        so.weight_decay = (float)o->weight_decay;
        so.nesterov = o->nesterov;
        return decay_matrices_only(tdm_sgd_new(ps, &so), o);
    }
    bool w = strcmp(o->optimizer, "adamw") == 0;
    tdm_adam_opts ao = w ? tdm_adamw_defaults() : tdm_adam_defaults();
    ao.lr = (float)o->lr;
    ao.weight_decay = (float)o->weight_decay;
    return decay_matrices_only(w ? tdm_adamw_new(ps, &ao) : tdm_adam_new(ps, &ao), o);
}

/* The first element of the n floats of t that is not finite, or n (-1 when t cannot be read,
 * reported as reading what). Its value into *bad. */
static int64_t first_nonfinite(const tdm_tensor *t, int64_t n, const char *what, float *bad) {
    float *v = malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (!v || tdm_to_host(t, v, sizeof(float) * (size_t)n) != TDM_OK) {
        task_error("%s: reading the weights back: %s", what,
                   v ? tdm_last_error() : "out of memory");
        free(v);
        return -1;
    }
    int64_t k = 0;
    while (k < n && isfinite(v[k])) k++;
    *bad = k < n ? v[k] : 0;
    free(v);
    return k;
}

int task_check_finite(tdm_module *m, const char *option, const char *file) {
    char what[4200];
    snprintf(what, sizeof what, "%s '%s'", option, file);
    tdm_paramset *ps = tdm_module_parameters(m); /* flattens once; the trainer reuses it */
    tdm_bufferset *bs = ps ? tdm_module_buffers(m) : NULL;
    if (!bs) return task_error("%s: %s", what, tdm_last_error());
    float bad = 0;
    int64_t k = first_nonfinite(ps->flat, ps->total, what, &bad);
    const char *kind = "parameter", *name = NULL;
    for (int i = 0; k >= 0 && k < ps->total && !name; i++)
        if (i + 1 == ps->n || ps->offsets[i + 1] > k) name = ps->names[i], k -= ps->offsets[i];
    for (int i = 0; k >= 0 && !name && i < bs->n; i++) {
        const tdm_tensor *t = bs->buffers[i];
        if (t->dtype != TDM_F32) continue;
        k = first_nonfinite(t, tdm_numel(t), what, &bad);
        if (k >= 0 && k < tdm_numel(t)) kind = "buffer", name = bs->names[i];
    }
    if (k < 0) return EXIT_RUNTIME; /* reported */
    if (!name) return 0;
    return task_error("%s: %s '%s' holds non-finite values (%g at element %lld): weights that "
                      "are not finite can be neither trained nor evaluated",
                      what, kind, name, (double)bad, (long long)k);
}

void task_free(task *t) {
    tdm_dataset_free(t->train); /* a subset before the set it is of */
    tdm_dataset_free(t->test);
    tdm_dataset_free(t->split_base); /* may be a subset of train_base */
    tdm_dataset_free(t->train_base);
    tdm_dataset_free(t->test_base);
    tdm_transform_free(t->train_tf);
    tdm_transform_free(t->test_tf);
    free(t->class_to_idx);
    tdm_module_free(t->model);
    *t = (task){0};
}

int task_open(task *t, const train_opts *o, tdm_device dev) {
    const tdm_model_info *row = tdm_model_find(o->model);
    if (!row) return task_error("--model: %s", tdm_last_error());
    return row->task == TDM_TASK_TEXT ? task_text_open(t, o, dev) : task_image_open(t, o, dev);
}

/* The channels the model takes: its row's (3 for a ResNet, 1 for the 28x28 models). */
static int64_t model_channels(const task *t) {
    return t->row->defaults.input.d[0];
}

/* Where the images come from: IDX files, CIFAR's binary files, or image folders. */
typedef enum { DATA_IDX, DATA_CIFAR, DATA_FOLDER } data_kind;

static bool is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* DIR/train and DIR/val (or DIR/test), each a folder of class folders. */
static int open_folders(task *t, const char *dir, int channels, bool skip_bad) {
    char train[4096], test[4096];
    snprintf(train, sizeof train, "%s/train", dir);
    snprintf(test, sizeof test, "%s/val", dir);
    if (!is_dir(test)) snprintf(test, sizeof test, "%s/test", dir);
    if (!is_dir(test))
        return task_error("image folders '%s': no '%s/val' or '%s/test' beside '%s' (the test "
                          "images, one folder per class as in train)",
                          dir, dir, dir, train);
    /* decoded as the model takes them: 3 channels for a ResNet (torchvision's loader), 1 for
     * the 28x28 models (the grey PNGs of Fashion-MNIST give its exact pixels) */
    tdm_image_folder_opts fo = tdm_image_folder_defaults();
    fo.channels = channels;
    fo.skip_bad = skip_bad;
    if (!(t->train = tdm_image_folder_open(train, &fo)))
        return task_error("training images: %s", tdm_last_error());
    if (!(t->test = tdm_image_folder_open(test, &fo)))
        return task_error("test images: %s", tdm_last_error());
    /* a label means a folder name: the test folders must be the same classes */
    const tdm_dataset *a = t->train, *b = t->test;
    for (int64_t k = 0; k < a->num_classes || k < b->num_classes; k++) {
        const char *x = a->ops->class_name(a, k), *y = b->ops->class_name(b, k);
        if (!x || !y || strcmp(x, y) != 0)
            return task_error("image folders '%s': class %lld is '%s' in '%s' but '%s' in '%s' "
                              "(train and test need the same class folders)",
                              dir, (long long)k, x ? x : "(none)", train, y ? y : "(none)", test);
    }
    return 0;
}

static int open_cifar(task *t, const char *spec) {
    int classes = strncmp(spec, "cifar100:", 9) == 0 ? 100 : 10;
    const char *dir = strchr(spec, ':') + 1;
    if (!(t->train = tdm_cifar_open(dir, classes, true, false)))
        return task_error("CIFAR-%d training data: %s", classes, tdm_last_error());
    if (!(t->test = tdm_cifar_open(dir, classes, false, false)))
        return task_error("CIFAR-%d test data: %s", classes, tdm_last_error());
    return 0;
}

/* The test samples --limit N keeps: N/6, at least 1 (none is asked for where N <= 0). */
static int64_t test_limit(int64_t limit) {
    return limit <= 0 ? 0 : limit / 6 > 0 ? limit / 6 : 1;
}

/* --limit N: only the images it keeps are decoded (apply_limit's prefixes). */
static int open_idx(task *t, const char *dir, int64_t limit) {
    const char *shown = dir ? dir : TDM_FASHION_MNIST_DIR;
    if (!(t->train = tdm_fashion_mnist_first(dir, true, limit)))
        return task_error("cannot load training data from '%s': %s", shown, tdm_last_error());
    if (!(t->test = tdm_fashion_mnist_first(dir, false, test_limit(limit))))
        return task_error("cannot load test data from '%s': %s", shown, tdm_last_error());
    return 0;
}

/* n evenly spaced samples of *ds (an image folder lists its classes one after the other: a
 * prefix would hold the first class only); *base keeps the whole set. */
static int keep_spread(tdm_dataset **ds, tdm_dataset **base, int64_t n) {
    if ((*ds)->n <= n) return 0;
    int64_t *idx = malloc(sizeof *idx * (size_t)n);
    if (!idx) return task_error("--limit: out of memory");
    for (int64_t k = 0; k < n; k++) idx[k] = k * (*ds)->n / n;
    *base = *ds;
    *ds = tdm_dataset_subset(*base, idx, n);
    free(idx);
    return *ds ? 0 : task_error("--limit: %s", tdm_last_error());
}

/* --limit keeps N training and N/6 test samples: the first ones of IDX and CIFAR files (their
 * classes are mixed), evenly spaced ones of image folders. */
static int apply_limit(task *t, const train_opts *o, data_kind kind) {
    if (o->limit <= 0) return 0;
    int64_t test_n = test_limit(o->limit);
    if (kind == DATA_FOLDER) {
        int rc = keep_spread(&t->train, &t->train_base, o->limit);
        return rc ? rc : keep_spread(&t->test, &t->test_base, test_n);
    }
    /* readers index samples i < n: a lower n keeps a prefix */
    if (t->train->n > o->limit) t->train->n = o->limit;
    if (t->test->n > test_n) t->test->n = test_n;
    return 0;
}

/* --validation N: N evenly spaced training samples (spread over the classes of an image
 * folder, which lists them in turn) become the test set, the others the training set, so a
 * recipe is tuned without looking at the test set. */
static int split_validation(task *t, const train_opts *o) {
    int64_t n = t->train->n, v = o->validation;
    if (v <= 0) return 0;
    if (v >= n)
        return train_usage_error("--validation %lld: the training set has only %lld samples",
                                 (long long)v, (long long)n);
    int64_t *idx = malloc(sizeof *idx * (size_t)n);
    if (!idx) return task_error("--validation: out of memory");
    /* idx[0, n - v): the training samples in order; idx[n - v, n): the held-out ones */
    int64_t a = 0, b = n - v;
    for (int64_t i = 0, k = 0; i < n; i++) {
        bool held = k < v && i == k * n / v;
        idx[held ? b++ : a++] = i;
        k += held;
    }
    tdm_dataset_free(t->test);
    t->split_base = t->train;
    t->train = tdm_dataset_subset(t->split_base, idx, n - v);
    t->test = t->train ? tdm_dataset_subset(t->split_base, idx + n - v, v) : NULL;
    free(idx);
    return t->test ? 0 : task_error("--validation: %s", tdm_last_error());
}

/* The image models that take any input and classes, "resnet18, resnet34, ...", into
 * buf (256 bytes); returns buf. */
static const char *any_input_models(char *buf) {
    size_t n = 0;
    buf[0] = '\0';
    for (int i = 0, k = 0; i < tdm_model_count(); i++) {
        const tdm_model_info *r = tdm_model_at(i);
        if (r->task == TDM_TASK_IMAGE && r->any_input && n < 256)
            n += (size_t)snprintf(buf + n, 256 - n, "%s%s", k++ ? ", " : "", r->name);
    }
    return buf;
}

/* Both splits, as --data names them. */
static int load_images(task *t, const train_opts *o, data_kind *kind) {
    const char *data = o->data;
    int rc;
    if (!strncmp(data, "cifar10:", 8) || !strncmp(data, "cifar100:", 9)) {
        *kind = DATA_CIFAR;
        rc = open_cifar(t, data);
    } else {
        const char *dir = strcmp(data, "fashion-mnist") == 0 ? NULL : data;
        struct stat st;
        if (dir && stat(dir, &st) != 0) return task_error("--data '%s': %s", dir, strerror(errno));
        char text[256];
        if (dir && !S_ISDIR(st.st_mode))
            return task_error("--data '%s' is not a directory: --model %s reads a directory "
                              "(IDX files or image folders) or cifar10:DIR; a FILE is for %s",
                              dir, o->model,
                              tdm_model_list(TDM_TASK_TEXT, " or ", text, sizeof text));
        char train[4096];
        snprintf(train, sizeof train, "%s/train", dir ? dir : "");
        *kind = dir && is_dir(train) ? DATA_FOLDER : DATA_IDX;
        rc = *kind == DATA_FOLDER ? open_folders(t, dir, (int)model_channels(t), o->skip_bad)
                                  : open_idx(t, dir, o->limit);
    }
    if (!rc) rc = apply_limit(t, o, *kind);
    return rc ? rc : split_validation(t, o);
}

/* The transform of one split: the steps of `prefix` (may be "") then those of `text` (NULL or
 * "none": nothing). *tf stays NULL when nothing is to be done. */
static int make_transform(const char *text, const char *what, const char *prefix, int64_t size,
                          tdm_transform **tf) {
    if (text && !strcmp(text, "none")) text = NULL;
    if (!text && !prefix[0]) return 0;
    char steps[2048] = "", all[2400];
    if (text) {
        tdm_transform *user = tdm_transform_parse(text, size);
        if (!user) return train_usage_error("%s: %s", what, tdm_last_error());
        tdm_transform_str(user, steps, sizeof steps);
        tdm_transform_free(user);
    }
    snprintf(all, sizeof all, "%s%s%s", prefix, prefix[0] && steps[0] ? ", " : "", steps);
    if (!(*tf = tdm_transform_parse(all, size)))
        return task_error("%s '%s': %s", what, all, tdm_last_error());
    return 0;
}

/* The training and test transforms: the options', or the data's defaults (torchvision's
 * ImageNet recipe for image folders, the CIFAR one on CIFAR for a model sized by its data (a
 * ResNet), none otherwise),
 * after a Grayscale step where the data's channels are not the model's (torchvision's
 * Grayscale(3) for grey images, and the reverse) and, for a default, a Resize where the
 * data's fixed size is not --image-size. */
static int make_transforms(task *t, const train_opts *o, data_kind kind, int64_t size) {
    bool cifar_resnet = kind == DATA_CIFAR && t->row->any_input;
    const char *train = o->transform, *eval = o->eval_transform;
    if (!train)
        train = kind == DATA_FOLDER ? "imagenet-train" : cifar_resnet ? "cifar-train" : NULL;
    if (!eval) eval = kind == DATA_FOLDER ? "imagenet-eval" : cifar_resnet ? "cifar-eval" : NULL;
    const tdm_shape *in = &t->train->sample_shape;
    int64_t want_c = model_channels(t);
    char grey[64] = "", resize[64] = "", pre[2][160];
    if (in->d[0] != want_c)
        snprintf(grey, sizeof grey, "Grayscale(num_output_channels=%lld)", (long long)want_c);
    if (kind != DATA_FOLDER && (in->d[1] != size || in->d[2] != size))
        snprintf(resize, sizeof resize, "Resize((%lld, %lld))", (long long)size, (long long)size);
    for (int k = 0; k < 2; k++) {
        bool asked = k == 0 ? o->transform != NULL : o->eval_transform != NULL;
        const char *r = asked ? "" : resize;
        snprintf(pre[k], sizeof pre[k], "%s%s%s", grey, grey[0] && r[0] ? ", " : "", r);
    }
    int rc = make_transform(train, "--transform", pre[0], size, &t->train_tf);
    return rc ? rc : make_transform(eval, "--eval-transform", pre[1], size, &t->test_tf);
}

/* The shape of a batch's images after the split's transform. */
static int image_shape(const tdm_dataset *ds, const tdm_transform *tf, const char *what,
                       tdm_shape *shape) {
    *shape = ds->sample_shape;
    if (tf && tdm_transform_output_shape(tf, ds->sample_shape, shape) != TDM_OK)
        return task_error("%s: %s", what, tdm_last_error());
    if (!tf && ds->ops->get_image)
        return task_error("%s: the images of '%s' differ in size: give transforms that end "
                          "with a crop (see --transform)",
                          what, ds->name);
    return 0;
}

/* The images the model gets must be what it takes (its row's input and at most its classes,
 * unless it takes any), and the same shape from both splits, which becomes t->sizes.input. */
static int check_shapes(task *t, const train_opts *o) {
    tdm_shape a, b;
    char sa[96], sb[96];
    if (image_shape(t->train, t->train_tf, "--transform", &a) ||
        image_shape(t->test, t->test_tf, "--eval-transform", &b))
        return EXIT_RUNTIME;
    tdm_shape_str(a, sa), tdm_shape_str(b, sb);
    if (strcmp(sa, sb) != 0)
        return task_error("the training images become %s but the test images %s: make "
                          "--transform and --eval-transform end at one size",
                          sa, sb);
    const tdm_model_opts *d = &t->row->defaults;
    if (!t->row->any_input && (tdm_shape_numel(a) != tdm_shape_numel(d->input) ||
                               t->train->num_classes > d->num_classes)) {
        char any[256];
        return task_error("--data '%s' gives %lld classes of images %s; --model %s expects %lld "
                          "classes of %s (these take any: %s)",
                          o->data, (long long)t->train->num_classes, sa, o->model,
                          (long long)d->num_classes, t->row->input, any_input_models(any));
    }
    snprintf(t->image_desc, sizeof t->image_desc, "%s", sa);
    t->sizes.input = a;
    /* a model sized by the data has its classes; the others keep theirs (10 outputs for
     * fewer classes) */
    t->sizes.num_classes = t->row->any_input ? t->train->num_classes : d->num_classes;
    return 0;
}
/* The model of t->sizes, from the seed or --init-from (weights made elsewhere, PyTorch
 * included): a model sized by its data has the data's classes, and (a ResNet) the small-image
 * stem for images whose shorter side (after the transforms: what the model gets, whatever
 * --image-size says) is 64 pixels or less. */
static int build_model(task *t, const train_opts *o) {
    tdm_rng rng = tdm_rng_make((uint64_t)o->seed);
    if (!(t->model = tdm_model_build(t->row, &t->sizes, t->dev, &rng)))
        return task_error("model %s: %s", o->model, tdm_last_error());
    if (o->init_from && tdm_weights_load(o->init_from, t->model) != TDM_OK)
        return task_error("--init-from: %s", tdm_last_error());
    return o->init_from ? task_check_finite(t->model, "--init-from", o->init_from) : 0;
}

/* An image folder's classes as torchvision's class_to_idx, {"name": k, ...}, for the
 * checkpoints; and the first few for the banner. */
static int describe_classes(task *t) {
    const tdm_dataset *ds = t->train;
    if (!ds->ops->class_name) return 0;
    size_t cap = 16, n = 0;
    for (int64_t k = 0; k < ds->num_classes; k++)
        cap += 2 * strlen(ds->ops->class_name(ds, k)) + 32;
    char *json = malloc(cap);
    if (!json) return task_error("classes: out of memory");
    n += (size_t)snprintf(json, cap, "{");
    int shown = 0;
    for (int64_t k = 0; k < ds->num_classes; k++) {
        const char *name = ds->ops->class_name(ds, k);
        n += (size_t)snprintf(json + n, cap - n, "%s\"", k ? ", " : "");
        for (const char *c = name; *c; c++) {
            if (*c == '"' || *c == '\\') json[n++] = '\\';
            json[n++] = *c;
        }
        n += (size_t)snprintf(json + n, cap - n, "\": %lld", (long long)k);
        if (k < 6)
            shown += snprintf(t->classes_desc + shown, sizeof t->classes_desc - (size_t)shown,
                              "%s%s", k ? ", " : "", name);
        else if (k == 6)
            snprintf(t->classes_desc + shown, sizeof t->classes_desc - (size_t)shown, ", ...");
    }
    snprintf(json + n, cap - n, "}");
    t->class_to_idx = json;
    return 0;
}

/* --label-smoothing of the open task: the loss callback takes no argument, and a process
 * trains one task at a time (task_image_open sets it). */
static float image_label_smoothing;

/* logits [n, classes], labels [n] -> the mean cross-entropy [] */
static tdm_tensor *image_loss(tdm_tensor *logits, const tdm_tensor *labels) {
    if (image_label_smoothing == 0) return tdm_cross_entropy(logits, labels, NULL);
    tdm_ce_opts ce = tdm_ce_defaults();
    ce.label_smoothing = image_label_smoothing;
    return tdm_cross_entropy(logits, labels, &ce);
}

int task_image_open(task *t, const train_opts *o, tdm_device dev) {
    *t = (task){.unit = "img",
                .units_per_sample = 1,
                .accuracy = true,
                .loss = image_loss,
                .optimizer = task_default_optimizer,
                .build = build_model,
                .dev = dev};
    image_label_smoothing = (float)o->label_smoothing;
    if (!(t->row = tdm_model_find(o->model)) || t->row->task != TDM_TASK_IMAGE)
        return task_error("--model %s: %s", o->model,
                          t->row ? "not an image model" : tdm_last_error());
    t->sizes = t->row->defaults;
    data_kind kind = DATA_IDX;
    int rc = load_images(t, o, &kind);
    /* the side of the model's images: asked, its own (28 for the 28x28 models), the data's
     * own, or 224 (image folders) as torchvision's recipes */
    int64_t size = o->image_size         ? o->image_size
                   : !t->row->any_input  ? t->row->defaults.input.d[2]
                   : kind == DATA_FOLDER ? 224
                   : t->train            ? t->train->sample_shape.d[2]
                                         : 0;
    if (!rc) rc = make_transforms(t, o, kind, size);
    if (!rc) rc = check_shapes(t, o);
    if (!rc) rc = describe_classes(t);
    if (!rc) tdm_model_describe(t->row, &t->sizes, t->model_desc, sizeof t->model_desc);
    snprintf(t->plot_title, sizeof t->plot_title, "%s on %s", o->model, o->data);
    int64_t skipped =
        t->train ? tdm_image_folder_skipped(t->train_base ? t->train_base : t->train) : 0;
    if (t->test) skipped += tdm_image_folder_skipped(t->test_base ? t->test_base : t->test);
    char skip[64] = "";
    if (skipped)
        snprintf(skip, sizeof skip, " (%lld unreadable files skipped)", (long long)skipped);
    if (!rc)
        snprintf(t->data_desc, sizeof t->data_desc,
                 "%lld train, %lld %s images %s of %lld classes%s", (long long)t->train->n,
                 (long long)t->test->n, o->validation ? "validation" : "test", t->image_desc,
                 (long long)t->train->num_classes, skip);
    if (!rc && (t->train_tf || t->test_tf)) {
        char a[400] = "none", b[400] = "none";
        if (t->train_tf) tdm_transform_str(t->train_tf, a, sizeof a);
        if (t->test_tf) tdm_transform_str(t->test_tf, b, sizeof b);
        snprintf(t->transform_desc, sizeof t->transform_desc, "train %s; test %s", a, b);
    }
    return rc;
}
