/* safetensors and checkpoints: files written by PyTorch load with its outputs, Tandem's files
 * load back bit for bit (and into PyTorch when torch is installed), malformed files give
 * clear errors, strict loading names every mismatch, a checkpoint resumes training exactly,
 * a save killed at any moment leaves the previous checkpoint loadable, a checkpoint
 * directory's lock has one holder at a time, and runs sharing a directory prune only their
 * own checkpoints. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "testdir.h"
#include "fixtures/safetensors_fixtures.h"
#include "tandem/io.h"

#define FIX "tests/fixtures/"

static char *tmp_path(const char *name) {
    static char buf[4][512];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, 512, "%s/%s", tmpdir, name);
    return p;
}

/* Sequential(Conv2d(1, 2, 3, padding=1), BatchNorm2d(2), ReLU, Flatten, Linear(32, out)) */
static tdm_module *small_model(int64_t out, uint64_t seed) {
    tdm_rng rng = tdm_rng_make(seed);
    tdm_conv2d_opts same = {.pad_h = 1, .pad_w = 1};
    tdm_module *layers[5] = {tdm_conv2d_new(1, 2, 3, 3, &same, true, tdm_cpu(0), &rng),
                             tdm_batch_norm2d_new(2, 1e-5f, 0.1f, tdm_cpu(0)), tdm_relu_new(),
                             tdm_flatten_new(1, -1),
                             tdm_linear_new(32, out, true, tdm_cpu(0), &rng)};
    return tdm_sequential_new(5, layers);
}

static tdm_tensor *forward_eval(tdm_module *m, const float *x) {
    tdm_module_train(m, false);
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *xt = tdm_from_data(TDM_SHAPE(3, 1, 4, 4), TDM_F32, tdm_cpu(0), x);
    tdm_tensor *y = tdm_module_forward(m, xt);
    tdm_set_grad_enabled(prev);
    tdm_module_train(m, true);
    return y;
}

/* Bitwise equality of two tensors' contents. */
static bool same_bits(const tdm_tensor *a, const tdm_tensor *b) {
    size_t n = (size_t)tdm_numel(a) * tdm_dtype_size(a->dtype);
    if (a->dtype != b->dtype || tdm_numel(a) != tdm_numel(b)) return false;
    char *x = malloc(n + 1), *y = malloc(n + 1);
    bool eq = !tdm_to_host(a, x, n) && !tdm_to_host(b, y, n) && memcmp(x, y, n) == 0;
    free(x);
    free(y);
    return eq;
}

static bool models_equal(tdm_module *a, tdm_module *b) {
    tdm_paramset *pa = tdm_module_parameters(a), *pb = tdm_module_parameters(b);
    tdm_bufferset *ba = tdm_module_buffers(a), *bb = tdm_module_buffers(b);
    if (!same_bits(pa->flat, pb->flat) || ba->n != bb->n) return false;
    for (int i = 0; i < ba->n; i++)
        if (!same_bits(ba->buffers[i], bb->buffers[i])) return false;
    return true;
}

static int count_files(const char *dir, const char *containing) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) n += strstr(e->d_name, containing) != NULL;
    if (d) closedir(d);
    return n;
}

/* ---- PyTorch's files ----------------------------------------------------------------------- */

static void test_torch_file(void) {
    tdm_module *m = small_model(3, 1);
    int rc = tdm_weights_load(FIX "safetensors/torch_model.safetensors", m);
    CHECK(rc == TDM_OK, "loading PyTorch's state_dict: %s", tdm_last_error());
    tdm_scope_begin();
    tdm_tensor *y = forward_eval(m, st_x);
    CHECK(y && check_tensor_close(y, st_y, 1e-5, 1e-5, "torch model outputs") == 0,
          "outputs differ from PyTorch's");
    tdm_scope_end();
    tdm_tensor *nbt = tdm_module_find(m, "1.num_batches_tracked");
    CHECK(nbt && nbt->dtype == TDM_I64 && tdm_item(nbt) == 7, "num_batches_tracked restored");

    /* the reverse: Tandem writes it, Tandem and PyTorch read it back */
    CHECK(tdm_weights_save(tmp_path("w.safetensors"), m, NULL, 0) == TDM_OK, "save: %s",
          tdm_last_error());
    tdm_module *m2 = small_model(3, 99);
    CHECK(!models_equal(m, m2), "different seeds differ");
    CHECK(tdm_weights_load(tmp_path("w.safetensors"), m2) == TDM_OK, "reload: %s",
          tdm_last_error());
    CHECK(models_equal(m, m2), "a saved model loads back bit for bit");
    tdm_safetensors *f = tdm_safetensors_open(tmp_path("w.safetensors"));
    CHECK(f && tdm_safetensors_count(f) == 9, "9 tensors: %s", tdm_last_error());
    CHECK(f && strcmp(tdm_safetensors_meta(f, "format"), "pt") == 0, "format pt metadata");
    int k = tdm_safetensors_find(f, "1.num_batches_tracked");
    CHECK(k >= 0 && strcmp(tdm_safetensors_dtype(f, k), "I64") == 0 &&
              tdm_safetensors_shape(f, k).ndim == 0,
          "num_batches_tracked is an I64 scalar");
    tdm_safetensors_close(f);
    CHECK(count_files(tmpdir, ".tmp") == 0, "no temporary file is left");
    tdm_module_free(m);
    tdm_module_free(m2);
}

/* The same state_dict saved by PyTorch in bf16 (Hugging Face's bf16 checkpoints) loads into
 * the f32 model, each float widened exactly: the f32 file's values rounded to bf16. */
static void test_torch_bf16_file(void) {
    tdm_module *m = small_model(3, 1), *h = small_model(3, 2);
    CHECK(tdm_weights_load(FIX "safetensors/torch_model.safetensors", m) == TDM_OK, "%s",
          tdm_last_error());
    CHECK(tdm_weights_load(FIX "safetensors/half_model.safetensors", h) == TDM_OK,
          "loading PyTorch's bf16 state_dict into an f32 model: %s", tdm_last_error());
    tdm_scope_begin();
    tdm_paramset *pm = tdm_module_parameters(m), *ph = tdm_module_parameters(h);
    tdm_tensor *rounded = tdm_cast(tdm_cast(pm->flat, TDM_BF16), TDM_F32);
    CHECK(ph->flat->dtype == TDM_F32 && same_bits(rounded, ph->flat),
          "the parameters are the f32 file's rounded to bf16");
    CHECK(!same_bits(pm->flat, ph->flat), "and the rounding did change some");
    tdm_bufferset *bm = tdm_module_buffers(m), *bh = tdm_module_buffers(h);
    for (int i = 0; i < bm->n; i++) {
        tdm_tensor *b = bm->buffers[i];
        tdm_tensor *want = b->dtype == TDM_F32 ? tdm_cast(tdm_cast(b, TDM_BF16), TDM_F32) : b;
        CHECK(same_bits(want, bh->buffers[i]), "buffer %d (%s)", i, tdm_dtype_name(b->dtype));
    }
    tdm_scope_end();
    tdm_tensor *nbt = tdm_module_find(h, "1.num_batches_tracked");
    CHECK(nbt && nbt->dtype == TDM_I64 && tdm_item(nbt) == 7, "the I64 buffer is as it was");
    tdm_module_free(m);
    tdm_module_free(h);
}

/* A model trained here, written here, checked by PyTorch when torch is installed. */
static void test_torch_reads_ours(void) {
    tdm_module *m = small_model(3, 5);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_sgd_opts so = tdm_sgd_defaults(0.1f);
    tdm_optim *opt = tdm_sgd_new(ps, &so);
    int64_t labels[3] = {0, 2, 1};
    for (int step = 0; step < 3; step++) { /* moves weights and BatchNorm statistics */
        tdm_scope_begin();
        tdm_optim_zero_grad(opt);
        tdm_tensor *x = tdm_from_data(TDM_SHAPE(3, 1, 4, 4), TDM_F32, tdm_cpu(0), st_x);
        tdm_tensor *t = tdm_from_data(TDM_SHAPE(3), TDM_I64, tdm_cpu(0), labels);
        tdm_backward(tdm_cross_entropy(tdm_module_forward(m, x), t, NULL));
        tdm_optim_step(opt);
        tdm_scope_end();
    }
    mkdir(tmp_path("torch"), 0755);
    char model_path[600], io_path[600];
    snprintf(model_path, sizeof model_path, "%s/model.safetensors", tmp_path("torch"));
    snprintf(io_path, sizeof io_path, "%s/io.safetensors", tmp_path("torch"));
    CHECK(tdm_weights_save(model_path, m, NULL, 0) == TDM_OK, "%s", tdm_last_error());
    tdm_scope_begin();
    tdm_tensor *x = tdm_from_data(TDM_SHAPE(3, 1, 4, 4), TDM_F32, tdm_cpu(0), st_x);
    tdm_tensor *y = forward_eval(m, st_x);
    tdm_named_tensor io[2] = {{"x", x}, {"y", y}};
    CHECK(tdm_safetensors_save(io_path, io, 2, NULL, 0) == TDM_OK, "%s", tdm_last_error());
    tdm_scope_end();
    if (system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
        printf("skip: PyTorch is not installed; the committed fixture covers the other way\n");
    } else {
        char cmd[800];
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 " FIX "gen_safetensors.py --verify %s",
                 tmp_path("torch"));
        CHECK(system(cmd) == 0, "PyTorch loads Tandem's file and computes the same outputs");
    }
    tdm_optim_free(opt);
    tdm_module_free(m);
}

static void test_dtypes(void) {
    tdm_safetensors *f = tdm_safetensors_open(FIX "safetensors/dtypes.safetensors");
    CHECK(f != NULL, "%s", tdm_last_error());
    if (!f) return;
    CHECK(tdm_safetensors_count(f) == 7, "7 tensors");
    CHECK(strcmp(tdm_safetensors_meta(f, "note"), "\xc3\xbc"
                                                  "n\xc3\xaf"
                                                  "code") == 0,
          "UTF-8 metadata");
    CHECK(tdm_safetensors_meta(f, "absent") == NULL, "absent metadata is NULL");
    tdm_scope_begin();
    tdm_tensor *f32 = tdm_safetensors_load(f, "f32", tdm_cpu(0));
    float e32[6] = {0, 0.25f, 0.5f, 0.75f, 1, 1.25f};
    CHECK(f32 && f32->ndim == 2 && check_tensor_close(f32, e32, 0, 0, "f32") == 0, "f32 values");
    tdm_tensor *i32 = tdm_safetensors_load(f, "i32", tdm_cpu(0));
    int32_t v32[3] = {0};
    CHECK(i32 && !tdm_to_host(i32, v32, sizeof v32) && v32[0] == -1 && v32[2] == 2147483647,
          "i32 values");
    tdm_tensor *i64 = tdm_safetensors_load(f, "i64", tdm_cpu(0));
    int64_t v64[2] = {0};
    CHECK(i64 && !tdm_to_host(i64, v64, sizeof v64) && v64[0] == -(INT64_C(1) << 40) && v64[1] == 5,
          "i64 values");
    tdm_tensor *sc = tdm_safetensors_load(f, "scalar", tdm_cpu(0));
    CHECK(sc && sc->ndim == 0 && tdm_item(sc) == 2.5f, "a scalar");
    tdm_tensor *em = tdm_safetensors_load(f, "empty", tdm_cpu(0));
    CHECK(em && tdm_numel(em) == 0 && em->shape[1] == 4, "an empty tensor");
    /* PyTorch's F16 and BF16 ones (issue 37): Tandem's dtypes, the values exact */
    tdm_tensor *h16 = tdm_safetensors_load(f, "f16", tdm_cpu(0));
    tdm_tensor *b16 = tdm_safetensors_load(f, "bf16", tdm_cpu(0));
    uint16_t hv[3] = {0}, bv[2] = {0};
    CHECK(h16 && h16->dtype == TDM_F16 && !tdm_to_host(h16, hv, sizeof hv) && hv[0] == 0x3C00 &&
              hv[2] == 0x3C00,
          "f16 ones: %s", tdm_last_error());
    CHECK(b16 && b16->dtype == TDM_BF16 && !tdm_to_host(b16, bv, sizeof bv) && bv[0] == 0x3F80 &&
              bv[1] == 0x3F80,
          "bf16 ones");
    CHECK_ERROR(!tdm_safetensors_load(f, "nope", tdm_cpu(0)), "no tensor named 'nope'");
    tdm_tensor *wrong = tdm_zeros(TDM_SHAPE(3, 2), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(tdm_safetensors_read(f, "f32", wrong) == TDM_ERR_SHAPE,
                "shape [2, 3], expected [3, 2]");
    tdm_tensor *wrong_dt = tdm_zeros(TDM_SHAPE(3), TDM_I64, tdm_cpu(0));
    CHECK_ERROR(tdm_safetensors_read(f, "i32", wrong_dt) == TDM_ERR_DTYPE, "is I32, expected I64");
    /* a strided destination receives the values in row-major order */
    tdm_tensor *dst = tdm_zeros(TDM_SHAPE(3, 2), TDM_F32, tdm_cpu(0));
    CHECK(tdm_safetensors_read(f, "f32", tdm_transpose(dst, 0, 1)) == TDM_OK, "%s",
          tdm_last_error());
    float et[6] = {0, 0.75f, 0.25f, 1, 0.5f, 1.25f};
    CHECK(check_tensor_close(dst, et, 0, 0, "strided read") == 0, "strided read");
    tdm_scope_end();
    tdm_safetensors_close(f);
}

/* ---- malformed files ----------------------------------------------------------------------- */

static void test_bad_files(void) {
    for (size_t i = 0; i < sizeof st_bad / sizeof st_bad[0]; i++) {
        char path[300];
        snprintf(path, sizeof path, FIX "safetensors_bad/%s", st_bad[i].file);
        tdm_safetensors *f = tdm_safetensors_open(path);
        CHECK(!f && tdm_last_status() == TDM_ERR_FORMAT, "%s must be refused (status %d)",
              st_bad[i].file, tdm_last_status());
        CHECK(strstr(tdm_last_error(), st_bad[i].error) && strstr(tdm_last_error(), path),
              "%s: expected an error naming the file and containing \"%s\", got \"%s\"",
              st_bad[i].file, st_bad[i].error, tdm_last_error());
        tdm_safetensors_close(f);
        tdm_clear_error();
    }
    CHECK_ERROR(!tdm_safetensors_open(tmp_path("does-not-exist")), "cannot open");
    CHECK_ERROR(!tdm_safetensors_open(tmpdir), "not a regular file");
    /* the same checks on memory, which names what it was given */
    CHECK_ERROR(!tdm_safetensors_open_memory("\x02\0\0\0\0\0\0\0[]", 10, "buf"),
                "safetensors 'buf': the header is not a JSON object");
}

static void test_save_errors(void) {
    tdm_scope_begin();
    tdm_tensor *a = tdm_zeros(TDM_SHAPE(2), TDM_F32, tdm_cpu(0));
    tdm_named_tensor dup[2] = {{"a", a}, {"a", a}};
    CHECK_ERROR(tdm_safetensors_save(tmp_path("x.safetensors"), dup, 2, NULL, 0),
                "'a' is used twice");
    tdm_named_tensor res[1] = {{"__metadata__", a}};
    CHECK_ERROR(tdm_safetensors_save(tmp_path("x.safetensors"), res, 1, NULL, 0), "reserved");
    tdm_named_tensor bad[1] = {{"\xff", a}};
    CHECK_ERROR(tdm_safetensors_save(tmp_path("x.safetensors"), bad, 1, NULL, 0), "UTF-8");
    CHECK_ERROR(tdm_safetensors_save("/nonexistent-dir/x.safetensors", dup, 1, NULL, 0),
                "/nonexistent-dir/x.safetensors");
    CHECK(access(tmp_path("x.safetensors"), F_OK) != 0, "nothing written on failure");
    CHECK(count_files(tmpdir, ".tmp") == 0, "no temporary file is left");
    tdm_scope_end();
}

/* ---- strict loading --------------------------------------------------------------------- */

static void test_strict(void) {
    const char *path = FIX "safetensors/torch_model.safetensors";
    tdm_module *wide = small_model(4, 1);
    tdm_tensor *before = tdm_clone(tdm_module_parameters(wide)->flat);
    CHECK_ERROR(tdm_weights_load(path, wide),
                "different: 4.weight (file [3, 32] F32, model [4, 32] F32), 4.bias");
    CHECK(same_bits(before, tdm_module_parameters(wide)->flat), "a failed load changes nothing");
    tdm_tensor_free(before);
    tdm_module_free(wide);

    tdm_rng rng = tdm_rng_make(1);
    tdm_conv2d_opts same = {.pad_h = 1, .pad_w = 1};
    tdm_module *conv_only[1] = {tdm_conv2d_new(1, 2, 3, 3, &same, true, tdm_cpu(0), &rng)};
    tdm_module *fewer = tdm_sequential_new(1, conv_only);
    CHECK_ERROR(tdm_weights_load(path, fewer),
                "unexpected: 1.num_batches_tracked, 1.bias, 1.running_mean");
    tdm_module_free(fewer);

    tdm_module *more = small_model(3, 1);
    tdm_module_add(more, "head", tdm_linear_new(3, 2, true, tdm_cpu(0), &rng));
    CHECK_ERROR(tdm_weights_load(path, more), "missing: head.weight, head.bias");
    tdm_module_free(more);
}

/* ---- training checkpoints --------------------------------------------------------------- */

typedef struct {
    tdm_module *m;
    tdm_optim *opt;
    tdm_dataset *ds;
    tdm_loader *l;
    int64_t step;
} run_state;

static tdm_dataset *toy_data(void) {
    enum { N = 40 };
    float x[N * 16];
    int64_t y[N];
    tdm_rng r = tdm_rng_make(11);
    tdm_tensor *t = tdm_rand(TDM_SHAPE(N * 16), -1, 1, tdm_cpu(0), &r);
    tdm_to_host(t, x, sizeof x);
    tdm_tensor_free(t);
    for (int i = 0; i < N; i++) y[i] = i % 3;
    return tdm_memory_dataset(TDM_SHAPE(1, 4, 4), N, x, y, 3);
}

static run_state run_new(bool adam, int workers) {
    run_state s = {.m = small_model(3, 3), .ds = toy_data()};
    tdm_paramset *ps = tdm_module_parameters(s.m);
    if (adam) {
        tdm_adam_opts ao = tdm_adamw_defaults();
        ao.amsgrad = true;
        s.opt = tdm_adamw_new(ps, &ao);
    } else {
        tdm_sgd_opts so = tdm_sgd_defaults(0.05f);
        so.momentum = 0.9f;
        s.opt = tdm_sgd_new(ps, &so);
    }
    tdm_loader_opts lo = tdm_loader_defaults(6); /* 7 batches, the last of 4 */
    lo.shuffle = true;
    lo.seed = 5;
    lo.workers = workers;
    s.l = tdm_loader_new(s.ds, &lo);
    tdm_loader_start_epoch(s.l, 0);
    return s;
}

static void run_free(run_state *s) {
    tdm_loader_free(s->l);
    tdm_dataset_free(s->ds);
    tdm_optim_free(s->opt);
    tdm_module_free(s->m);
}

/* n steps, moving to the next epoch at the end of one; dropout draws from the default rng. */
static void run_steps(run_state *s, int n) {
    for (int i = 0; i < n; i++) {
        tdm_batch b;
        if (tdm_loader_next(s->l, &b) == 0) {
            int64_t e;
            tdm_loader_position(s->l, &e, NULL);
            tdm_loader_start_epoch(s->l, e + 1);
            tdm_loader_next(s->l, &b);
        }
        tdm_scope_begin();
        tdm_optim_zero_grad(s->opt);
        tdm_tensor *x = tdm_dropout(b.x, 0.1f, true, NULL);
        tdm_backward(tdm_cross_entropy(tdm_module_forward(s->m, x), b.y, NULL));
        tdm_optim_set_lr(s->opt, tdm_optim_lr(s->opt) * 0.99f);
        tdm_optim_step(s->opt);
        tdm_scope_end();
        s->step++;
    }
}

static tdm_train_state state_of(run_state *s) {
    return (tdm_train_state){
        .model = s->m, .optim = s->opt, .loader = s->l, .rng = tdm_default_rng(), .step = s->step};
}

static void test_exact_resume(bool adam) {
    const char *dir = tmp_path(adam ? "ckpt_adam" : "ckpt_sgd");
    tdm_manual_seed(42);
    run_state a = run_new(adam, 2);
    run_steps(&a, 9); /* into the second epoch */
    tdm_train_state st = state_of(&a);
    tdm_meta meta[1] = {{"note", "hello"}};
    st.meta = meta, st.n_meta = 1;
    CHECK(tdm_checkpoint_save(dir, &st, 2) == TDM_OK, "save: %s", tdm_last_error());
    run_steps(&a, 8); /* the uninterrupted run */

    tdm_manual_seed(7); /* a different generator state: the checkpoint must restore it */
    run_state b = run_new(adam, 0);
    char path[600];
    int64_t step = -1;
    CHECK(tdm_checkpoint_latest(dir, path, sizeof path, &step) == 1 && step == 9,
          "latest is step 9 (got %lld)", (long long)step);
    tdm_train_state sb = state_of(&b);
    CHECK(tdm_checkpoint_load(path, &sb) == TDM_OK, "load: %s", tdm_last_error());
    b.step = sb.step;
    CHECK(b.step == 9 && tdm_optim_steps(b.opt) == 9, "step counts restored");
    int64_t e, k;
    tdm_loader_position(b.l, &e, &k);
    CHECK(e == 1 && k == 2, "loader at epoch 1 batch 2 (got %lld, %lld)", (long long)e,
          (long long)k);
    CHECK(tdm_loader_samples_done(b.l) == 12, "12 samples of epoch 1 done (got %lld)",
          (long long)tdm_loader_samples_done(b.l));
    char note[16];
    CHECK(tdm_checkpoint_meta(path, "note", note, sizeof note) == 1 && !strcmp(note, "hello"),
          "caller metadata");
    CHECK(tdm_checkpoint_meta(path, "other", note, sizeof note) == 0, "absent caller metadata");
    run_steps(&b, 8);
    CHECK(models_equal(a.m, b.m), "%s: resumed run is bit-identical", adam ? "adamw" : "sgd");
    const char *names[3];
    tdm_tensor *sa[3], *sb2[3];
    int n = tdm_optim_state(a.opt, names, sa, 3);
    CHECK(n == (adam ? 3 : 1) && tdm_optim_state(b.opt, NULL, sb2, 3) == n, "state count");
    for (int i = 0; i < n; i++) CHECK(same_bits(sa[i], sb2[i]), "%s identical", names[i]);
    run_free(&a);
    run_free(&b);
}

static void test_checkpoint_errors(void) {
    const char *dir = tmp_path("ckpt_keep");
    run_state s = run_new(true, 0);
    for (int i = 1; i <= 5; i++) {
        run_steps(&s, 1);
        tdm_train_state st = state_of(&s);
        CHECK(tdm_checkpoint_save(dir, &st, 2) == TDM_OK, "save %d: %s", i, tdm_last_error());
    }
    CHECK(count_files(dir, "ckpt-") == 2, "keep 2 leaves 2 checkpoints (found %d)",
          count_files(dir, "ckpt-"));
    char path[600];
    int64_t step;
    CHECK(tdm_checkpoint_latest(dir, path, sizeof path, &step) == 1 && step == 5, "latest 5");
    CHECK(tdm_checkpoint_latest(tmp_path("none"), path, sizeof path, &step) == 0, "no dir: 0");

    run_state sgd = run_new(false, 0);
    tdm_train_state st = state_of(&sgd);
    CHECK_ERROR(tdm_checkpoint_load(path, &st), "the optimizer was adamw, now sgd");
    /* the position is stored in samples (30 after 5 batches of 6): batches of 10 resume at
     * batch 3; the end of an epoch whose last batch is smaller (40 = 6 * 6 + 4) is found */
    tdm_loader_opts lo = tdm_loader_defaults(10);
    tdm_loader *ten = tdm_loader_new(s.ds, &lo);
    tdm_loader_start_epoch(ten, 0);
    tdm_train_state st10 = {.loader = ten};
    int64_t k = -1;
    CHECK(tdm_checkpoint_load(path, &st10) == TDM_OK, "load into batches of 10: %s",
          tdm_last_error());
    tdm_loader_position(ten, NULL, &k);
    CHECK(k == 3, "sample 30 is batch 3 of 10 (got %lld)", (long long)k);
    CHECK(tdm_loader_batch_at(s.l, 40, &k) == TDM_OK && k == 7, "the epoch's end is batch 7");
    CHECK_ERROR(tdm_loader_batch_at(ten, 35, &k), "sample 35 is not the start of a batch of 10");
    tdm_loader_free(ten);
    /* another batch size whose batches do not start at the saved sample */
    lo = tdm_loader_defaults(40);
    tdm_loader *big = tdm_loader_new(s.ds, &lo);
    tdm_loader_start_epoch(big, 0);
    tdm_train_state sl = {.loader = big};
    run_state s2 = run_new(true, 0);
    tdm_train_state sm = state_of(&s2);
    sm.loader = big;
    tdm_tensor *before = tdm_clone(tdm_module_parameters(s2.m)->flat);
    CHECK_ERROR(tdm_checkpoint_load(path, &sm),
                "global sample 30 is not the start of a global batch of 40");
    CHECK(same_bits(before, tdm_module_parameters(s2.m)->flat), "a failed load changes nothing");
    CHECK_ERROR(tdm_checkpoint_load(tmp_path("none"), &sl), "cannot open");
    tdm_tensor_free(before);
    tdm_loader_free(big);
    run_free(&s2);
    run_free(&sgd);
    run_free(&s);
}

/* A loader of `world` ranks (this one rank) over ds, batches of b, shuffled as run_new's. */
static tdm_loader *rank_loader(tdm_dataset *ds, int64_t b, int rank, int world) {
    tdm_loader_opts lo = tdm_loader_defaults(b);
    lo.shuffle = true;
    lo.seed = 5;
    lo.rank = rank;
    lo.world_size = world;
    return tdm_loader_new(ds, &lo);
}

/* The data position is global (samples of the epoch over every rank): rank 0 of 2 ranks saves
 * at batch 4 of batches of 3 (global 24 of 40), and a loader of any world size whose global
 * batch divides 24 resumes at the same global batch; the end of an epoch whose last global
 * batch is smaller (and padded on 3 ranks) is the end on any number of ranks; a global batch
 * that does not divide the position is refused naming both. */
static void test_other_world(void) {
    const char *dir = tmp_path("ckpt_world");
    tdm_dataset *ds = toy_data();
    tdm_loader *two = rank_loader(ds, 3, 0, 2);
    tdm_loader_start_epoch_at(two, 1, 4);
    tdm_train_state st = {.loader = two, .step = 4};
    CHECK(tdm_checkpoint_save(dir, &st, 0) == TDM_OK, "save on 2 ranks: %s", tdm_last_error());
    char path[600];
    CHECK(tdm_checkpoint_latest(dir, path, sizeof path, NULL) == 1, "saved");
    const int64_t b[3] = {6, 2, 4}, at[3] = {4, 4, 3};
    const int world[3] = {1, 3, 2};
    for (int i = 0; i < 3; i++) { /* 1 x 6 and 3 x 2: global batch 6; 2 x 4: 8 */
        tdm_loader *l = rank_loader(ds, b[i], world[i] - 1, world[i]);
        tdm_train_state sl = {.loader = l};
        int64_t e = -1, k = -1;
        CHECK(tdm_checkpoint_load(path, &sl) == TDM_OK && !tdm_loader_position(l, &e, &k) &&
                  e == 1 && k == at[i] && tdm_loader_global_samples_done(l) == 24,
              "world %d: epoch %lld batch %lld (%s)", world[i], (long long)e, (long long)k,
              tdm_last_error());
        tdm_loader_free(l);
    }
    tdm_loader *nine = rank_loader(ds, 3, 2, 3);
    tdm_train_state s9 = {.loader = nine};
    CHECK_ERROR(tdm_checkpoint_load(path, &s9),
                "global sample 24 is not the start of a global batch of 9 (3 on each of 3 ranks");
    /* the end: 40 samples on 3 ranks of 2 (7 batches, 42 with the padding) */
    tdm_loader *three = rank_loader(ds, 2, 0, 3);
    tdm_loader_start_epoch_at(three, 2, tdm_loader_batches(three));
    st.loader = three, st.step = 5;
    CHECK(
        tdm_loader_global_samples_done(three) == 40 && tdm_checkpoint_save(dir, &st, 0) == TDM_OK &&
            tdm_checkpoint_latest(dir, path, sizeof path, NULL) == 1,
        "the end on 3 ranks is sample 40 (%lld)", (long long)tdm_loader_global_samples_done(three));
    tdm_loader *one = rank_loader(ds, 6, 0, 1);
    tdm_train_state s1 = {.loader = one};
    int64_t k = -1;
    CHECK(tdm_checkpoint_load(path, &s1) == TDM_OK && !tdm_loader_position(one, NULL, &k) &&
              k == tdm_loader_batches(one) && k == 7,
          "the end on 1 rank: batch %lld", (long long)k);
    tdm_loader_free(one);
    tdm_loader_free(three);
    tdm_loader_free(nine);
    tdm_loader_free(two);
    tdm_dataset_free(ds);
}

/* A child saves checkpoints in a loop, each with every weight equal to its step; it is killed
 * at a random moment, often in the middle of a write. The newest checkpoint left must load and
 * hold its step's weights. */
/* Kills a child that writes checkpoints in a loop at a moment drawn from a printed seed
 * (TANDEM_TEST_SEED=S replays), once it has written its first, so that the moment falls
 * among the later saves however slow the machine (a sanitizer build, other tests): the
 * newest checkpoint left must load and hold its own step's weights. */
static void test_crash(void) {
    const char *dir = tmp_path("ckpt_crash");
    const char *given = getenv("TANDEM_TEST_SEED");
    unsigned seed = given ? (unsigned)strtoul(given, NULL, 10) : (unsigned)time(NULL);
    printf("crash moments: TANDEM_TEST_SEED=%u\n", seed);
    srand(seed);
    int rounds = 6, ok = 0;
    for (int r = 0; r < rounds; r++) {
        int saved[2];
        if (pipe(saved) != 0) break;
        pid_t pid = fork();
        if (pid == 0) {
            close(saved[0]);
            tdm_rng rng = tdm_rng_make(1);
            tdm_module *m = tdm_linear_new(512, 512, true, tdm_cpu(0), &rng);
            tdm_paramset *ps = tdm_module_parameters(m);
            for (int64_t step = (int64_t)r * 100000 + 1;; step++) {
                tdm_fill_(ps->flat, (float)step);
                tdm_train_state st = {.model = m, .step = step};
                if (tdm_checkpoint_save(dir, &st, 3)) _exit(3);
                if (saved[1] >= 0 && write(saved[1], "s", 1) == 1) close(saved[1]), saved[1] = -1;
            }
        }
        close(saved[1]);
        struct pollfd first = {.fd = saved[0], .events = POLLIN};
        bool started = poll(&first, 1, 60000) == 1; /* the first checkpoint is down */
        close(saved[0]);
        struct timespec ts = {0, (long)(rand() % 60) * 1000000L};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        char path[600];
        int64_t step = 0;
        CHECK(started && tdm_checkpoint_latest(dir, path, sizeof path, &step) == 1,
              "round %d: no checkpoint after the child's first save", r);
        if (!started || step == 0) continue;
        tdm_rng rng = tdm_rng_make(2);
        tdm_module *m = tdm_linear_new(512, 512, true, tdm_cpu(0), &rng);
        tdm_train_state st = {.model = m};
        int rc = tdm_checkpoint_load(path, &st);
        CHECK(rc == TDM_OK, "round %d: the newest checkpoint loads: %s", r, tdm_last_error());
        tdm_scope_begin();
        float w = tdm_item(tdm_slice(tdm_module_parameters(m)->flat, 0, 7, 8, 1));
        tdm_scope_end();
        CHECK(st.step == step && w == (float)step, "round %d: checkpoint %lld holds its weights", r,
              (long long)step);
        ok += rc == TDM_OK;
        tdm_module_free(m);
    }
    CHECK(ok == rounds, "%d of %d rounds found a checkpoint that loads", ok, rounds);
}

/* src/io's fault injection (io/io_internal.h): the n-th write, fsync, rename or mkdir fails */
void tdm_io_fail_nth(int n, int err);

static void remove_tree(const char *path) {
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    CHECK(system(cmd) == 0, "rm -rf %s", path);
}

/* A disk that fails (ENOSPC) at each I/O step of a checkpoint write in turn: the save reports
 * the file and the errno, leaves no temporary file, and the newest checkpoint in the directory
 * loads and is one of the two whole ones (the old, or the new when only a step after its
 * rename failed); the old one is not pruned away by a failed save (--keep 1). */
static void test_disk_full(void) {
    const char *dir = tmp_path("ckpt_full");
    run_state s = run_new(true, 0);
    run_steps(&s, 1);
    tdm_train_state st = state_of(&s);
    CHECK(tdm_checkpoint_save(dir, &st, 1) == TDM_OK, "first save: %s", tdm_last_error());
    run_steps(&s, 1);
    st = state_of(&s);
    int n = 1, failed = 0;
    for (; n < 400; n++) {
        tdm_io_fail_nth(n, ENOSPC);
        int rc = tdm_checkpoint_save(dir, &st, 1);
        tdm_io_fail_nth(0, 0);
        if (rc == TDM_OK) break; /* n is past the save's last step */
        failed++;
        CHECK(strstr(tdm_last_error(), "No space left on device") && strstr(tdm_last_error(), dir),
              "step %d: the error names the directory and the errno: %s", n, tdm_last_error());
        CHECK(count_files(dir, "tmp") == 0, "step %d: no temporary file is left", n);
        char path[600];
        int64_t step = -1;
        run_state r = run_new(true, 0);
        tdm_train_state sr = state_of(&r);
        CHECK(tdm_checkpoint_latest(dir, path, sizeof path, &step) == 1 &&
                  (step == 1 || step == 2) && tdm_checkpoint_load(path, &sr) == TDM_OK,
              "step %d: the newest checkpoint (%lld) loads: %s", n, (long long)step,
              tdm_last_error());
        run_free(&r);
        if (step == 2) { /* the new one is whole: start the next round from the old again */
            char old[600];
            snprintf(old, sizeof old, "%s/ckpt-0000000002", dir);
            CHECK(count_files(dir, "ckpt-") >= 1, "step %d: a checkpoint is left", n);
            remove_tree(old);
            CHECK(tdm_checkpoint_latest(dir, path, sizeof path, &step) == 1 && step == 1,
                  "step %d: the step-1 checkpoint is still there (keep 1 pruned it early)", n);
        }
    }
    CHECK(failed >= 5 && n < 400, "the save has several I/O steps, each failed once (%d)", failed);
    run_free(&s);
}

/* The directory lock: one holder at a time (another lock of this process, a child process),
 * its holder named in the refusal, released by tdm_checkpoint_unlock and by the holder's
 * death (a LOCK file left by kill -9 does not block), and an unusable directory named. */
static void test_lock(void) {
    const char *dir = tmp_path("locked/sub"), *lock_file = tmp_path("locked/sub/LOCK");
    tdm_checkpoint_lock *l = tdm_checkpoint_lock_dir(dir, "test holder");
    CHECK(l != NULL, "lock a new directory: %s", tdm_last_error());
    char me[64];
    snprintf(me, sizeof me, "test holder pid %ld on host ", (long)getpid());
    char *text = slurp_file(lock_file, NULL);
    CHECK(text && strncmp(text, me, strlen(me)) == 0 && strstr(text, " since "),
          "LOCK names its holder: '%s'", text ? text : "(none)");
    free(text);
    char expect[200];
    snprintf(expect, sizeof expect, "is in use by %s", me);
    CHECK_ERROR(!tdm_checkpoint_lock_dir(dir, "second") && tdm_last_status() == TDM_ERR_STATE,
                expect);
    /* another process is refused too */
    pid_t pid = fork();
    if (pid == 0) {
        tdm_checkpoint_lock *c = tdm_checkpoint_lock_dir(dir, "child");
        _exit(!c && strstr(tdm_last_error(), "in use by test holder") ? 0 : 1);
    }
    CHECK(wait_status(pid) == 0, "another process cannot take the lock");
    tdm_checkpoint_unlock(l);
    text = slurp_file(lock_file, NULL);
    CHECK(text && !text[0], "an unheld LOCK names nobody: '%s'", text ? text : "(no file)");
    free(text);
    l = tdm_checkpoint_lock_dir(dir, NULL);
    CHECK(l != NULL, "taken again after unlock: %s", tdm_last_error());
    tdm_checkpoint_unlock(l);
    tdm_checkpoint_unlock(NULL);

    /* a holder killed with -9 leaves its LOCK file, which blocks nobody */
    int ready[2];
    CHECK(pipe(ready) == 0, "pipe");
    pid = fork();
    if (pid == 0) {
        close(ready[0]);
        tdm_checkpoint_lock *c = tdm_checkpoint_lock_dir(dir, "doomed");
        if (write(ready[1], c ? "y" : "n", 1) != 1) _exit(1);
        for (;;) pause();
    }
    close(ready[1]);
    char took = 0;
    CHECK(read(ready[0], &took, 1) == 1 && took == 'y', "the child took the lock");
    close(ready[0]);
    CHECK(!tdm_checkpoint_lock_dir(dir, NULL), "held by the child");
    tdm_clear_error();
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    text = slurp_file(lock_file, NULL);
    CHECK(text && strstr(text, "doomed pid "), "the killed holder's line stays: '%s'",
          text ? text : "(none)");
    free(text);
    l = tdm_checkpoint_lock_dir(dir, "next");
    CHECK(l != NULL, "a killed holder's lock is free: %s", tdm_last_error());
    tdm_checkpoint_unlock(l);

    /* a directory that cannot be one */
    const char *file = tmp_path("lock-a-file");
    FILE *f = fopen(file, "w");
    if (f) fclose(f);
    CHECK_ERROR(!tdm_checkpoint_lock_dir(file, NULL) && tdm_last_status() == TDM_ERR_IO, file);
    CHECK_ERROR(!tdm_checkpoint_lock_dir(NULL, NULL), "NULL directory");
}

/* Saves a checkpoint of the small model at step for run (NULL: no identity), keeping keep. */
static int save_for(const char *dir, tdm_module *m, int64_t step, const char *run, int keep) {
    tdm_train_state st = {.model = m, .step = step, .run_id = run};
    return tdm_checkpoint_save(dir, &st, keep);
}

/* Run identities: each checkpoint records its run's; pruning and replacing touch only the
 * saving run's checkpoints; listing and clearing a directory. */
static void test_run_ids(void) {
    char a[17], b[17], id[64];
    CHECK(tdm_checkpoint_new_run_id(a, sizeof a) == TDM_OK &&
              tdm_checkpoint_new_run_id(b, sizeof b) == TDM_OK,
          "new run ids: %s", tdm_last_error());
    CHECK(strlen(a) == 16 && strspn(a, "0123456789abcdef") == 16 && strcmp(a, b) != 0,
          "16 hex digits, new each time: %s %s", a, b);
    CHECK_ERROR(tdm_checkpoint_new_run_id(id, 16), "needs 17 bytes");

    const char *dir = tmp_path("ckpt_runs");
    tdm_module *m = small_model(3, 1);
    /* run a keeps 2, run b keeps 1, a checkpoint without identity keeps 1: interleaved */
    int rc = save_for(dir, m, 1, a, 2) || save_for(dir, m, 2, a, 2) || save_for(dir, m, 10, b, 1) ||
             save_for(dir, m, 5, NULL, 1) || save_for(dir, m, 3, a, 2) ||
             save_for(dir, m, 4, a, 2) || save_for(dir, m, 11, b, 1);
    CHECK(rc == 0, "saves: %s", tdm_last_error());
    int64_t steps[8] = {0};
    int n = tdm_checkpoint_list(dir, steps, 8);
    CHECK(n == 4 && steps[0] == 3 && steps[1] == 4 && steps[2] == 5 && steps[3] == 11,
          "each run pruned its own only: %d checkpoints, steps %lld %lld %lld %lld", n,
          (long long)steps[0], (long long)steps[1], (long long)steps[2], (long long)steps[3]);
    CHECK(tdm_checkpoint_list(dir, steps, 1) == 4 && steps[0] == 3, "a short list");
    CHECK(tdm_checkpoint_list(tmp_path("no-such-dir"), NULL, 0) == 0, "no directory: none");
    char path[600];
    snprintf(path, sizeof path, "%s/ckpt-0000000003", dir);
    CHECK(tdm_checkpoint_run_id(path, id, sizeof id) == 1 && strcmp(id, a) == 0,
          "ckpt 3 is run a's: %s", id);
    snprintf(path, sizeof path, "%s/ckpt-0000000005", dir);
    CHECK(tdm_checkpoint_run_id(path, id, sizeof id) == 0, "ckpt 5 has no identity");
    CHECK(tdm_checkpoint_run_id(tmp_path("none"), id, sizeof id) < 0, "no checkpoint: an error");
    tdm_clear_error();
    /* run b may not replace run a's step 3 */
    char expect[100];
    snprintf(expect, sizeof expect, "belongs to run %s, not to this run (%s)", a, b);
    CHECK_ERROR(save_for(dir, m, 3, b, 1) == TDM_ERR_STATE, expect);
    snprintf(path, sizeof path, "%s/ckpt-0000000003", dir);
    CHECK(tdm_checkpoint_run_id(path, id, sizeof id) == 1 && strcmp(id, a) == 0 &&
              tdm_checkpoint_list(dir, NULL, 0) == 4,
          "run a's checkpoint is left as it was");
    CHECK(save_for(dir, m, 3, a, 0) == TDM_OK, "run a replaces its own: %s", tdm_last_error());

    /* clearing: every checkpoint and what crashed saves left; other files stay */
    char tmp[600], other[600];
    snprintf(tmp, sizeof tmp, "%s/.ckpt-0000000009.tmp", dir);
    snprintf(other, sizeof other, "%s/notes.txt", dir);
    mkdir(tmp, 0755);
    FILE *f = fopen(other, "w");
    if (f) fclose(f);
    CHECK(tdm_checkpoint_clear(dir) == TDM_OK, "clear: %s", tdm_last_error());
    CHECK(tdm_checkpoint_list(dir, NULL, 0) == 0 && access(tmp, F_OK) != 0 &&
              access(other, F_OK) == 0,
          "cleared the checkpoints, kept other files");
    tdm_module_free(m);
}

/* Whether files a and b hold the same bytes. */
static bool same_bytes(const char *a, const char *b) {
    size_t na = 0, nb = 0;
    char *x = slurp_file(a, &na), *y = slurp_file(b, &nb);
    bool eq = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return eq;
}

/* The sharded format on one process (rank 0 of 1, the optimizer's range the whole buffer): it
 * resumes bit for bit as a whole checkpoint does; its export is the whole checkpoint's files
 * byte for byte; a model the layout does not fit and a missing shard are refused, naming the
 * file, with the model unchanged. (Several processes: test_resume_mpi.) */
static void test_sharded(void) {
    const char *whole = tmp_path("sh_whole"), *dir = tmp_path("sh_sharded");
    tdm_manual_seed(42);
    run_state a = run_new(true, 0);
    run_steps(&a, 9);
    tdm_train_state st = state_of(&a);
    int64_t range[2] = {0, tdm_module_parameters(a.m)->total};
    CHECK(tdm_checkpoint_save(whole, &st, 0) == TDM_OK, "save: %s", tdm_last_error());
    CHECK(tdm_checkpoint_shard_begin(dir, &st) == TDM_OK &&
              tdm_checkpoint_shard_write(dir, &st, 0, 1) == TDM_OK &&
              tdm_checkpoint_shard_finish(dir, &st, range, 1, 0) == TDM_OK,
          "sharded save: %s", tdm_last_error());
    char ck[600], w[700], out[720];
    snprintf(ck, sizeof ck, "%s/ckpt-0000000009", dir);
    for (int f = 0; f < 2; f++) {
        const char *name = f ? "train_state.safetensors" : "model.safetensors";
        snprintf(w, sizeof w, "%s/ckpt-0000000009/%s", whole, name);
        snprintf(out, sizeof out, "%s/exported-%s", tmpdir, name);
        CHECK(tdm_checkpoint_export(ck, f ? NULL : out, f ? out : NULL) == TDM_OK &&
                  same_bytes(w, out),
              "export of the sharded checkpoint: %s is not the whole one's (%s)", name,
              tdm_last_error());
    }
    /* a range of the parameters read back from the shards; misuses named */
    tdm_paramset *ps = tdm_module_parameters(a.m);
    float got[8], *want = tdm_data_ptr(ps->flat);
    CHECK(tdm_checkpoint_read_params(ck, ps, 3, 11, got) == TDM_OK &&
              memcmp(got, want + 3, sizeof got) == 0,
          "read_params [3, 11): %s", tdm_last_error());
    CHECK_ERROR(tdm_checkpoint_read_params(ck, ps, 5, ps->total + 1, got) != TDM_OK,
                "checkpoint_read_params: NULL argument or range [5,");
    tdm_rng rng = tdm_rng_make(1);
    tdm_gpt_config cfg = {.layers = 1, .heads = 1, .channels = 4, .context = 4, .vocab = 8};
    tdm_module *gpt = tdm_gpt_new(&cfg, tdm_cpu(0), &rng);
    snprintf(out, sizeof out, "%s/other.bin", tmpdir);
    CHECK_ERROR(tdm_gpt_save_llmc_from(out, gpt, ck) != TDM_OK, "does not match the model");
    CHECK(access(out, F_OK) != 0, "a failed llm.c save left %s", out);
    tdm_module_free(gpt);
    run_steps(&a, 5);
    tdm_manual_seed(7);
    run_state b = run_new(true, 0);
    tdm_train_state sb = state_of(&b);
    CHECK(tdm_checkpoint_load(ck, &sb) == TDM_OK, "sharded load: %s", tdm_last_error());
    b.step = sb.step;
    run_steps(&b, 5);
    CHECK(models_equal(a.m, b.m), "resumed from a sharded checkpoint: not bit-identical");
    run_state c = run_new(true, 0), other = {.m = small_model(4, 3)};
    tdm_train_state so = {.model = other.m};
    CHECK(tdm_checkpoint_load(ck, &so) == TDM_ERR_FORMAT &&
              strstr(tdm_last_error(), "layout.safetensors' does not match the model"),
          "another model: %s", tdm_last_error());
    snprintf(w, sizeof w, "%s/shard-00000-of-00001.safetensors", ck);
    snprintf(out, sizeof out, "%s.away", w);
    CHECK(rename(w, out) == 0, "moving the shard away");
    tdm_train_state sc = state_of(&c);
    CHECK(tdm_checkpoint_load(ck, &sc) != TDM_OK && strstr(tdm_last_error(), w) && sc.step == 0 &&
              tdm_optim_steps(c.opt) == 0,
          "a missing shard: %s", tdm_last_error());
    rename(out, w);
    tdm_module_free(other.m);
    run_free(&a);
    run_free(&b);
    run_free(&c);
}

int main(void) {
    if (tmpdir_make("test_ckpt") != 0) return 1;
    test_torch_file();
    test_torch_bf16_file();
    test_torch_reads_ours();
    test_dtypes();
    test_bad_files();
    test_save_errors();
    test_strict();
    test_exact_resume(false);
    test_exact_resume(true);
    test_checkpoint_errors();
    test_other_world();
    test_crash();
    test_disk_full();
    test_lock();
    test_run_ids();
    test_sharded();
    tmpdir_remove();
    return check_summary();
}
