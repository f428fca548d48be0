/* Every field `tandem train --resume` and `tandem eval` read back from a checkpoint is checked
 * before use: a short run's train_state.safetensors is rewritten through the library with one
 * field altered, and the resume must stop with an error naming the file, the field and the
 * value, leaving the checkpoint as it was. Weights holding NaN make `tandem eval` name the
 * parameter.
 *
 *   test_ckpt_fields PATH_TO_TANDEM
 *
 * Needs Debian's dataset-fashion-mnist (skipped without it). */
#include <sys/stat.h>

#include "check.h"
#include "io/io_internal.h"
#include "testdir.h"

static const char *tandem;

/* tandem ARGS... with the output captured: the exit status. */
#define TANDEM(...) wait_status(spawn_captured((const char *const[]){tandem, __VA_ARGS__, NULL}))
/* A run of 19 steps an epoch (600 samples in batches of 32) */
#define RUN_OPTS "--limit", "600", "--batch-size", "32", "--epochs", "2", "--quiet"

/* The tensors of an opened file, loaded into the current scope, with its metadata. */
typedef struct {
    tdm_safetensors *f;
    int n, n_meta;
    tdm_named_tensor t[64];
    tdm_meta meta[64];
} contents;

static int contents_read(const char *path, contents *c) {
    memset(c, 0, sizeof *c);
    if (!(c->f = tdm_safetensors_open(path))) return -1;
    c->n = tdm_safetensors_count(c->f);
    c->n_meta = tdm_safetensors_meta_count(c->f);
    if (c->n > 64 || c->n_meta > 63) return -1;
    for (int i = 0; i < c->n; i++) {
        c->t[i].name = tdm_safetensors_name(c->f, i);
        if (!(c->t[i].tensor = tdm_safetensors_load(c->f, c->t[i].name, tdm_cpu(0)))) return -1;
    }
    for (int i = 0; i < c->n_meta; i++)
        tdm_safetensors_meta_at(c->f, i, &c->meta[i].key, &c->meta[i].value);
    return 0;
}

/* Rewrites safetensors file path with metadata key set to value (NULL: removed). 0 or -1. */
static int set_meta(const char *path, const char *key, const char *value) {
    contents c;
    int rc = tdm_scope_begin() ? -1 : contents_read(path, &c);
    int k = 0;
    while (!rc && k < c.n_meta && strcmp(c.meta[k].key, key) != 0) k++;
    if (!rc && k == c.n_meta && value) c.n_meta++; /* a new key */
    if (!rc && value) c.meta[k] = (tdm_meta){key, value};
    if (!rc && !value && k < c.n_meta) c.meta[k] = c.meta[--c.n_meta];
    if (!rc) rc = tdm_safetensors_save(path, c.t, c.n, c.meta, c.n_meta);
    tdm_safetensors_close(c.f);
    tdm_scope_end();
    if (rc) fprintf(stderr, "rewriting %s: %s\n", path, tdm_last_error());
    return rc ? -1 : 0;
}

/* Writes src's tensors to dst with element 1 of tensor name set to value. 0 or -1. */
static int poison(const char *src, const char *dst, const char *name, float value) {
    contents c;
    int rc = tdm_scope_begin() ? -1 : contents_read(src, &c), found = 0;
    for (int i = 0; !rc && i < c.n; i++) {
        if (strcmp(c.t[i].name, name) != 0) continue;
        tdm_tensor *t = (tdm_tensor *)c.t[i].tensor;
        int64_t n = tdm_numel(t);
        float *v = malloc(sizeof(float) * (size_t)n);
        rc = v && n > 1 && !tdm_to_host(t, v, sizeof(float) * (size_t)n) ? 0 : -1;
        if (!rc) v[1] = value, found = 1;
        if (!rc)
            rc = (c.t[i].tensor = tdm_from_data(tdm_shape_of(t), TDM_F32, tdm_cpu(0), v)) ? 0 : -1;
        free(v);
    }
    if (!rc && found) rc = tdm_safetensors_save(dst, c.t, c.n, c.meta, c.n_meta);
    tdm_safetensors_close(c.f);
    tdm_scope_end();
    return rc || !found ? -1 : 0;
}

/* The error line names the file, the field and the value, and ends with something. */
static void check_message(const char *what, const char *err, const char *file, const char *field,
                          const char *value) {
    CHECK(strstr(err, file), "%s: names the file %s: %s", what, file, err);
    CHECK(strstr(err, field), "%s: names %s: %s", what, field, err);
    CHECK(strstr(err, value), "%s: names the value %s: %s", what, value, err);
    CHECK(!strstr(err, "Sanitizer"), "%s: under a sanitizer: %s", what, err);
    size_t n = strlen(err);
    CHECK(n > 2 && strcmp(err + n - 2, ":\n") != 0 && strcmp(err + n - 3, ": \n") != 0,
          "%s: the message ends at a colon: %s", what, err);
}

/* Removes the checkpoints of dir other than keep (a name): what a resume that should have
 * been refused wrote, so that the next case resumes from keep again. */
static void remove_others(const char *dir, const char *keep) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char cmd[800];
    while (d && (e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "ckpt-", 5) != 0 || strcmp(e->d_name, keep) == 0) continue;
        snprintf(cmd, sizeof cmd, "rm -rf '%s/%s'", dir, e->d_name);
        CHECK(system(cmd) == 0, "%s", cmd);
    }
    if (d) closedir(d);
}

typedef struct {
    const char *field, *value;
    const char *field2, *value2; /* a second field changed first (NULL: none) */
    /* NULL: field is metadata of train_state.safetensors; else field is a tensor of this file,
     * whose element 1 becomes value */
    const char *file;
} tamper;
#define ONE(field, value)                                                                          \
    { field, value, NULL, NULL, NULL }
#define TENSOR(file, name, value)                                                                  \
    { name, value, NULL, NULL, file }

/* A checkpoint's two files as the run wrote them: each case starts from them. */
typedef struct {
    char *state, *model;
    size_t state_len, model_len;
} pristine;

static int pristine_read(const char *ckpt, pristine *p) {
    char f[400];
    snprintf(f, sizeof f, "%s/train_state.safetensors", ckpt);
    p->state = slurp_file(f, &p->state_len);
    snprintf(f, sizeof f, "%s/model.safetensors", ckpt);
    p->model = slurp_file(f, &p->model_len);
    return p->state && p->model ? 0 : -1;
}

/* Writes the files of ckpt back as p holds them. 0 or -1. */
static int restore(const char *ckpt, const pristine *p) {
    char ts[400], model[400];
    snprintf(ts, sizeof ts, "%s/train_state.safetensors", ckpt);
    snprintf(model, sizeof model, "%s/model.safetensors", ckpt);
    return file_write(ts, p->state, p->state_len) && file_write(model, p->model, p->model_len) ? 0
                                                                                               : -1;
}

/* Rewrites the files of ckpt from p as t says. 0 or -1. */
static int apply(const char *ckpt, const tamper *t, const pristine *p) {
    char ts[400], file[400];
    snprintf(ts, sizeof ts, "%s/train_state.safetensors", ckpt);
    if (restore(ckpt, p)) return -1;
    if (t->file) {
        snprintf(file, sizeof file, "%s/%s", ckpt, t->file);
        return poison(file, file, t->field, strtof(t->value, NULL));
    }
    return (t->field2 && set_meta(ts, t->field2, t->value2)) || set_meta(ts, t->field, t->value);
}

/* ckpt (of dir) tampered as t says from p: --resume refuses it, naming the file, the field
 * and the value, and leaves both files as they were. extra: 5 entries, options of the run
 * then NULLs. */
static void resume_refused(const char *dir, const char *ckpt, const tamper *t, const pristine *p,
                           const char *const *extra) {
    char ts[400], model[400];
    snprintf(ts, sizeof ts, "%s/train_state.safetensors", ckpt);
    snprintf(model, sizeof model, "%s/model.safetensors", ckpt);
    if (apply(ckpt, t, p)) {
        CHECK(false, "tampering %s", t->field);
        return;
    }
    size_t ts_len = 0, model_len = 0;
    char *ts_bytes = slurp_file(ts, &ts_len), *model_bytes = slurp_file(model, &model_len);
    int rc = TANDEM("train", RUN_OPTS, "--max-steps", "6", "--checkpoint-dir", dir, "--resume",
                    extra[0], extra[1], extra[2], extra[3], extra[4]);
    char *err = captured("stderr"), what[200];
    snprintf(what, sizeof what, "%s = '%s'", t->field, t->value);
    CHECK(rc == 1, "%s: exit status %d, expected 1: %s", what, rc, err);
    check_message(what, err, t->file ? t->file : "train_state.safetensors", t->field, t->value);
    CHECK(count_ckpts(dir) == 1, "%s: %d checkpoints after the refused resume", what,
          count_ckpts(dir));
    CHECK(file_holds(ts, ts_bytes, ts_len) && file_holds(model, model_bytes, model_len),
          "%s: the checkpoint's files were changed", what);
    remove_others(dir, strrchr(ckpt, '/') + 1);
    free(err);
    free(ts_bytes);
    free(model_bytes);
}

/* A run stopped after 3 steps, each field of its train_state altered in turn. */
static void tampered_fields(void) {
    static const tamper cases[] = {
        ONE("step", "-5"), /* was taken: the next save went before the newest checkpoint */
        ONE("step", "9223372036854775807"), /* was taken: overflow after an epoch */
        ONE("step", "4"),                   /* not the directory's step */
        ONE("optim.steps", "-1"),           /* was ignored, the count left at 0 */
        ONE("optim.steps", "2"),
        ONE("optim.lr", "nan"),
        ONE("optim.lr", "-0x1p-3"),
        ONE("loader.epoch", "-1"),
        ONE("loader.epoch", "1"),
        ONE("loader.epoch", "4611686018427387904"),
        ONE("loader.global_sample", "97"),
        ONE("rng.seed", "5"),
        ONE("user.epoch_rank_totals", "0x1p+3 97 96;"), /* more correct than samples */
        ONE("user.epoch_rank_totals", "nan 8 96;"),
        ONE("user.epoch_rank_totals", "0x1p+3 8 9600;"),
        ONE("user.run.layout", "0x0"),
        /* totals of another number of processes: the sums over them are read instead */
        {"user.epoch_correct", "97", "user.epoch_rank_totals", "0x1p+2 4 48;0x1p+2 4 48;", NULL},
        {"user.epoch_images", "-1", "user.epoch_rank_totals", "0x1p+2 4 48;0x1p+2 4 48;", NULL},
        {"user.epoch_loss_sum", "x", "user.epoch_rank_totals", "0x1p+2 4 48;0x1p+2 4 48;", NULL},
        TENSOR("train_state.safetensors", "optim.3.bias.momentum_buffer", "nan"),
        TENSOR("train_state.safetensors", "optim.5.weight.momentum_buffer", "inf"),
        TENSOR("model.safetensors", "1.bias", "nan"),
    };
    char dir[300], ckpt[400], ts[500];
    snprintf(dir, sizeof dir, "%s/fields", tmpdir);
    snprintf(ckpt, sizeof ckpt, "%s/ckpt-0000000003", dir);
    snprintf(ts, sizeof ts, "%s/train_state.safetensors", ckpt);
    int rc = TANDEM("train", RUN_OPTS, "--max-steps", "3", "--checkpoint-dir", dir);
    CHECK(rc == 0, "training 3 steps: %d", rc);
    pristine p = {0};
    if (rc || pristine_read(ckpt, &p)) return free(p.state), free(p.model);
    const char *none[5] = {NULL};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        resume_refused(dir, ckpt, &cases[i], &p, none);

    /* a step the directory's name agrees with, that the data position does not */
    char moved[400];
    snprintf(moved, sizeof moved, "%s/ckpt-0000000022", dir);
    CHECK(rename(ckpt, moved) == 0, "renaming %s", ckpt);
    resume_refused(dir, moved, &(tamper)ONE("step", "22"), &p, none);
    CHECK(rename(moved, ckpt) == 0, "renaming %s back", moved);

    /* the untouched checkpoint resumes, and one without the totals of two processes */
    static const char *const absent[] = {"user.epoch_loss_sum", "user.epoch_correct",
                                         "user.epoch_images", "user.epoch_rank_totals", NULL};
    for (int round = 0; round < 2; round++) {
        remove_others(dir, "ckpt-0000000003");
        CHECK(restore(ckpt, &p) == 0, "restoring %s", ckpt);
        for (int i = 0; round == 1 && absent[i]; i++)
            CHECK(set_meta(ts, absent[i], NULL) == 0, "removing %s", absent[i]);
        rc = TANDEM("train", RUN_OPTS, "--max-steps", "6", "--checkpoint-dir", dir, "--resume");
        char *err = captured("stderr");
        CHECK(rc == 0, "resuming the untouched checkpoint (round %d): %d: %s", round, rc, err);
        free(err);
    }
    free(p.state), free(p.model);
}

/* Under --grad-accum 2 a position inside an optimizer step is refused, and Adam's negative
 * second moment; a finished run continued with fewer --epochs is told how many to give. */
static void position_and_epochs(void) {
    char dir[300], ckpt[400];
    snprintf(dir, sizeof dir, "%s/accum", tmpdir);
    snprintf(ckpt, sizeof ckpt, "%s/ckpt-0000000003", dir);
    const char *opts[5] = {"--grad-accum", "2", "--optimizer", "adam", NULL};
    int rc = TANDEM("train", RUN_OPTS, "--max-steps", "3", "--checkpoint-dir", dir, opts[0],
                    opts[1], opts[2], opts[3]);
    CHECK(rc == 0, "training 3 steps of 2 batches: %d", rc);
    pristine p = {0};
    if (!rc && !pristine_read(ckpt, &p)) {
        /* batch 5: inside step 3 */
        resume_refused(dir, ckpt, &(tamper)ONE("loader.global_sample", "160"), &p, opts);
        /* a second moment below 0 (its square root is taken) */
        resume_refused(dir, ckpt,
                       &(tamper)TENSOR("train_state.safetensors", "optim.3.bias.exp_avg_sq", "-1"),
                       &p, opts);
    }
    free(p.state), free(p.model);

    snprintf(dir, sizeof dir, "%s/epochs", tmpdir);
    rc = TANDEM("train", RUN_OPTS, "--checkpoint-dir", dir);
    CHECK(rc == 0, "training 2 epochs: %d", rc);
    rc = TANDEM("train", "--limit", "600", "--batch-size", "32", "--epochs", "1", "--quiet",
                "--checkpoint-dir", dir, "--resume");
    char *err = captured("stderr");
    CHECK(rc == 2 && strstr(err, "--epochs 1") && strstr(err, "--epochs 2 or more"),
          "a 2-epoch run resumed with --epochs 1: %d: %s", rc, err);
    free(err);
}

/* tandem eval on weights holding a NaN names the parameter (it printed "evaluation: "). */
static void eval_nan(void) {
    char model[400], bad[400];
    snprintf(model, sizeof model, "%s/epochs/ckpt-0000000038/model.safetensors", tmpdir);
    snprintf(bad, sizeof bad, "%s/nan.safetensors", tmpdir);
    CHECK(poison(model, bad, "3.bias", NAN) == 0, "writing %s: %s", bad, tdm_last_error());
    int rc = TANDEM("eval", "--weights", bad, "--limit", "600");
    char *err = captured("stderr");
    CHECK(rc == 1 && !strstr(err, "Sanitizer"), "eval of NaN weights: exit %d: %s", rc, err);
    CHECK(strstr(err, "'3.bias'") && strstr(err, "nan") && strstr(err, bad),
          "names the file, the parameter and the value: %s", err);
    size_t n = strlen(err);
    CHECK(n > 3 && strcmp(err + n - 3, ": \n") != 0, "ends at a colon: %s", err);
    free(err);
    rc = TANDEM("eval", "--weights", model, "--limit", "600");
    err = captured("stderr");
    CHECK(rc == 0, "eval of the good weights: %d: %s", rc, err);
    free(err);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_ckpt_fields PATH_TO_TANDEM\n");
        return 2;
    }
    tandem = argv[1];
    if (access("/usr/share/datasets/fashion-mnist", R_OK) != 0) {
        printf("skipped: dataset-fashion-mnist is not installed\n");
        return 77;
    }
    if (tmpdir_make("ckpt_fields") != 0) return 1;
    tampered_fields();
    position_and_epochs();
    eval_nan();
    tmpdir_remove();
    return check_summary();
}
