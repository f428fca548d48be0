/* The model registry (include/tandem/models.h): every row, at a small size, builds, counts its
 * parameters as the built model holds them (the memory estimate's count, layer by layer where
 * a pipeline cuts it), finds its units on the model and on a clone, trains a step, saves a
 * checkpoint that a fresh model of the row loads, and evaluates to the same outputs; and the
 * lookups fail naming what is wrong. Then the `tandem` command reads the table: its help
 * lists every row, and `tandem train --dry-run` takes every row's name (the image models on
 * Fashion-MNIST when Debian's copy is installed). A new row is covered without touching this
 * file.
 *
 *   test_models PATH_TO_TANDEM */
#include <sys/stat.h>

#include "check.h"
#include "testdir.h"

/* The row's sizes made small: a few classes of 16x16 images for a model sized by its data, a
 * one-block GPT on windows of 8 of 32 tokens. */
static tdm_model_opts small_sizes(const tdm_model_info *row) {
    tdm_model_opts o = row->defaults;
    if (row->task == TDM_TASK_TEXT) {
        o.gpt = (tdm_gpt_config){
            .layers = 1, .heads = 2, .channels = 16, .context = 8, .vocab = 32, .padded_vocab = 32};
        o.input = TDM_SHAPE(8);
    } else if (row->any_input) {
        o.input = TDM_SHAPE(o.input.d[0], 16, 16);
        o.num_classes = 3;
    }
    return o;
}

/* A batch of 2 for the row: images and labels, or tokens and the next ones. */
static void make_batch(const tdm_model_info *row, const tdm_model_opts *o, tdm_rng *rng,
                       tdm_tensor **x, tdm_tensor **y) {
    if (row->task == TDM_TASK_TEXT) {
        int64_t T = o->input.d[0], tok[2 * 9];
        for (int i = 0; i < 2 * 9; i++) tok[i] = (i * 7 + 3) % o->gpt.vocab;
        int64_t in[16], next[16];
        for (int b = 0; b < 2; b++)
            for (int t = 0; t < T; t++)
                in[b * T + t] = tok[b * 9 + t], next[b * T + t] = tok[b * 9 + t + 1];
        *x = i64(TDM_SHAPE(2, T), in);
        *y = i64(TDM_SHAPE(2, T), next);
        return;
    }
    const tdm_shape *s = &o->input;
    *x = tdm_randn(TDM_SHAPE(2, s->d[0], s->d[1], s->d[2]), 0, 1, tdm_cpu(0), rng);
    int64_t labels[2] = {0, o->num_classes - 1};
    *y = i64(TDM_SHAPE(2), labels);
}

static tdm_tensor *loss_of(const tdm_model_info *row, tdm_tensor *out, const tdm_tensor *y) {
    return row->task == TDM_TASK_TEXT ? tdm_gpt_loss(out, y) : tdm_cross_entropy(out, y, NULL);
}

/* Parameters of m's subtree, counted from its modules (not from a paramset, which would
 * flatten them anew). */
static int64_t subtree_params(const tdm_module *m) {
    int64_t n = 0;
    for (int i = 0; i < m->n_params; i++) n += m->params[i] ? tdm_numel(m->params[i]) : 0;
    for (int i = 0; i < m->n_children; i++) n += subtree_params(m->children[i]);
    return n;
}

/* The estimate's count against the model: all parameters, and for a Sequential (what a
 * pipeline cuts) one counted layer per child with that child's parameters. */
static void check_cost(const tdm_model_info *row, const tdm_model_opts *o, tdm_module *m,
                       tdm_paramset *ps, int n_units) {
    tdm_model_cost c;
    CHECK(tdm_model_cost_of(row, o, &c) == TDM_OK, "%s: cost: %s", row->name, tdm_last_error());
    CHECK(c.params == ps->total, "%s: the estimate counts %lld parameters, the model has %lld",
          row->name, (long long)c.params, (long long)ps->total);
    CHECK(c.factor > 0 && c.head > 0 && c.positions >= 1, "%s: factor %g head %g positions %lld",
          row->name, c.factor, c.head, (long long)c.positions);
    CHECK((c.unit_sum > 0) == (n_units > 0), "%s: counted unit floats %g, %d units", row->name,
          c.unit_sum, n_units);
    if (strcmp(m->ops->kind, "Sequential") != 0) return;
    CHECK(c.n_layers == m->n_children, "%s: %d layers counted, %d children", row->name, c.n_layers,
          m->n_children);
    for (int i = 0; i < c.n_layers && i < m->n_children; i++)
        CHECK(c.layer_params[i] == subtree_params(m->children[i]),
              "%s: layer %d (%s) counted with %lld parameters, has %lld", row->name, i,
              m->child_names[i], (long long)c.layer_params[i],
              (long long)subtree_params(m->children[i]));
}

/* The row's units on m and on a clone of m (DataParallel's replicas), the same count. */
static int check_units(const tdm_model_info *row, tdm_module *m) {
    tdm_module *units[64];
    int n = tdm_model_units(m, units, 64);
    CHECK(n >= 0 && (n > 0) == (row->units != NULL), "%s: %d units", row->name, n);
    tdm_module *c = tdm_module_clone(m, tdm_cpu(0));
    CHECK(c && tdm_model_units(c, units, 64) == n, "%s: a clone has %d units, the model %d",
          row->name, c ? tdm_model_units(c, units, 64) : -1, n);
    tdm_module_free(c);
    return n;
}

/* Forward, loss, backward and an SGD step in a scope: the loss, NAN on failure. */
static float train_step(const tdm_model_info *row, tdm_module *m, tdm_optim *opt, tdm_tensor *x,
                        tdm_tensor *y) {
    tdm_scope_begin();
    tdm_module_train(m, true);
    tdm_tensor *l = loss_of(row, tdm_module_forward(m, x), y);
    float v = l ? tdm_item(l) : NAN;
    if (!l || tdm_optim_zero_grad(opt) || tdm_backward(l) || tdm_optim_step(opt)) v = NAN;
    tdm_scope_end();
    return v;
}

/* m's outputs on x in eval mode without gradients, copied to host (caller frees); *n their
 * count. */
static float *evaluate(tdm_module *m, tdm_tensor *x, int64_t *n) {
    tdm_module_train(m, false);
    bool prev = tdm_set_grad_enabled(false);
    tdm_scope_begin();
    tdm_tensor *out = tdm_module_forward(m, x);
    *n = out ? tdm_numel(out) : 0;
    float *v = out ? malloc(sizeof(float) * (size_t)*n) : NULL;
    if (v && tdm_to_host(out, v, sizeof(float) * (size_t)*n)) free(v), v = NULL;
    tdm_scope_end();
    tdm_set_grad_enabled(prev);
    return v;
}

static void test_row(const tdm_model_info *row) {
    tdm_model_opts o = small_sizes(row);
    tdm_rng rng = tdm_rng_make(1);
    tdm_module *m = tdm_model_build(row, &o, tdm_cpu(0), &rng);
    CHECK(m != NULL, "%s: build: %s", row->name, tdm_last_error());
    tdm_paramset *ps = m ? tdm_module_parameters(m) : NULL;
    if (!ps) {
        tdm_module_free(m);
        return;
    }
    check_cost(row, &o, m, ps, check_units(row, m));

    tdm_tensor *x, *y;
    make_batch(row, &o, &rng, &x, &y);
    float *before = malloc(sizeof(float) * (size_t)ps->total);
    float *after = malloc(sizeof(float) * (size_t)ps->total);
    tdm_to_host(ps->flat, before, sizeof(float) * (size_t)ps->total);
    tdm_sgd_opts so = tdm_sgd_defaults(0.1f);
    tdm_optim *opt = tdm_sgd_new(ps, &so);
    float loss = opt ? train_step(row, m, opt, x, y) : NAN;
    tdm_to_host(ps->flat, after, sizeof(float) * (size_t)ps->total);
    CHECK(isfinite(loss) && memcmp(before, after, sizeof(float) * (size_t)ps->total) != 0,
          "%s: a step: loss %g, %s", row->name, (double)loss, tdm_last_error());

    /* a checkpoint of the trained model, loaded into a fresh one of other weights */
    char dir[128], ckpt[256];
    snprintf(dir, sizeof dir, "%s/%s", tmpdir, row->name);
    int rc = tdm_checkpoint_save(dir, &(tdm_train_state){.model = m, .optim = opt, .step = 1}, 0);
    CHECK(rc == TDM_OK && tdm_checkpoint_latest(dir, ckpt, sizeof ckpt, NULL) == 1,
          "%s: checkpoint: %s", row->name, tdm_last_error());
    tdm_rng other = tdm_rng_make(2);
    tdm_module *m2 = tdm_model_build(row, &o, tdm_cpu(0), &other);
    CHECK(m2 && tdm_checkpoint_load(ckpt, &(tdm_train_state){.model = m2}) == TDM_OK,
          "%s: loading %s: %s", row->name, ckpt, tdm_last_error());

    int64_t n1 = 0, n2 = 0;
    float *a = evaluate(m, x, &n1), *b = m2 ? evaluate(m2, x, &n2) : NULL;
    int64_t want = row->task == TDM_TASK_TEXT ? 2 * o.input.d[0] * o.gpt.vocab : 2 * o.num_classes;
    CHECK(a && b && n1 == want && n2 == n1 && memcmp(a, b, sizeof(float) * (size_t)n1) == 0,
          "%s: the loaded model evaluates %lld outputs, the trained one %lld (want %lld), "
          "equal: %d",
          row->name, (long long)n2, (long long)n1, (long long)want,
          a && b && n1 == n2 && !memcmp(a, b, sizeof(float) * (size_t)n1));
    bool finite = a != NULL;
    for (int64_t i = 0; a && i < n1; i++) finite = finite && isfinite(a[i]);
    CHECK(finite, "%s: outputs not finite", row->name);
    free(a), free(b), free(before), free(after);
    tdm_optim_free(opt);
    tdm_module_free(m2);
    tdm_module_free(m);
    tdm_tensor_free(x);
    tdm_tensor_free(y);
}

/* Names unique and found, each row complete; lookups and bad sizes fail naming the cause. */
static void test_table(void) {
    int n = tdm_model_count();
    CHECK(n >= 7, "%d rows", n);
    for (int i = 0; i < n; i++) {
        const tdm_model_info *r = tdm_model_at(i);
        CHECK(r && tdm_model_find(r->name) == r, "row %d", i);
        CHECK(r->build && r->count && r->help && r->help[0] && r->input, "%s: incomplete", r->name);
        for (int j = 0; j < i; j++)
            CHECK(strcmp(tdm_model_at(j)->name, r->name) != 0, "%s twice", r->name);
    }
    CHECK(tdm_model_at(n) == NULL && tdm_model_at(-1) == NULL, "rows past the end");
    char all[512];
    tdm_model_list(-1, ", ", all, sizeof all);
    CHECK_ERROR(tdm_model_find("resnet19") == NULL, all);
    tdm_clear_error();
    tdm_model_find("resnet19");
    CHECK(strstr(tdm_last_error(), "'resnet19'") != NULL, "%s", tdm_last_error());
    tdm_clear_error();
    const tdm_model_info *first = tdm_model_at(0);
    tdm_model_opts big = first->defaults;
    big.input = TDM_SHAPE(3, 40, 40);
    if (!first->any_input)
        CHECK_ERROR(tdm_model_build(first, &big, tdm_cpu(0), NULL) == NULL, "[3, 40, 40]");
    CHECK_ERROR(tdm_model_new("nope", tdm_cpu(0), NULL) == NULL, "unknown model 'nope'");
}

/* Runs tandem with args (NULL-terminated); its exit status, its stdout and stderr into *out
 * and *err (the caller frees them). */
static int run(const char *tandem, const char *const *args, char **out, char **err) {
    const char *argv[32] = {tandem};
    int n = 1;
    for (int i = 0; args[i] && n < 31; i++) argv[n++] = args[i];
    argv[n] = NULL;
    int rc = wait_status(spawn_captured(argv));
    *out = captured("stdout"), *err = captured("stderr");
    return rc;
}

/* s with every run of spaces and newlines made one space (help text is wrapped). */
static char *squeeze(char *s) {
    char *w = s;
    for (const char *r = s; *r; r++)
        if (!(*r == ' ' || *r == '\n') || (w > s && w[-1] != ' ')) *w++ = *r == '\n' ? ' ' : *r;
    *w = '\0';
    return s;
}

/* Every row in `tandem --help`, `tandem train --help` (with its help line's start) and
 * `tandem eval --help`; an unknown --model names them all. */
static void test_help(const char *tandem) {
    char *top, *train, *ev, *err;
    run(tandem, (const char *[]){"--help", NULL}, &top, &err), free(err);
    run(tandem, (const char *[]){"train", "--help", NULL}, &train, &err), free(err);
    run(tandem, (const char *[]){"eval", "--help", NULL}, &ev, &err), free(err);
    for (int i = 0; i < tdm_model_count(); i++) {
        const tdm_model_info *r = tdm_model_at(i);
        char line[64], start[48];
        snprintf(line, sizeof line, "\n    %s ", r->name);
        snprintf(start, sizeof start, "%s (%s):", r->name, r->input);
        CHECK(strstr(top, line), "tandem --help does not list %s", r->name);
        CHECK(strstr(squeeze(train), start), "tandem train --help does not describe %s", r->name);
        CHECK(strstr(ev, r->name) != NULL, "tandem eval --help does not list %s", r->name);
    }
    free(top), free(train), free(ev);
    char *out;
    int rc = run(tandem, (const char *[]){"train", "--model", "resnet19", NULL}, &out, &err);
    char all[512];
    tdm_model_list(-1, ", ", all, sizeof all);
    CHECK(rc == 2 && strstr(err, "'resnet19'") && strstr(err, all), "%d %s", rc, err);
    free(out), free(err);
}

/* `tandem train --model NAME --dry-run` for every row: the options' checks and the task's
 * choice come from the row, and the estimate is made from its count. */
static void test_dry_runs(const char *tandem) {
#ifdef __SANITIZE_ADDRESS__
    /* seven trainer processes reading Fashion-MNIST, the longest test under ASan: not there
     * (test_estimate's dry runs are) */
    (void)tandem;
    printf("skipped the dry runs under ASan\n");
    return;
#endif
    struct stat st;
    bool fmnist = stat(TDM_FASHION_MNIST_DIR, &st) == 0;
    char text[128];
    snprintf(text, sizeof text, "%s/book.txt", tmpdir);
    const char *words = "the quick brown fox jumps over the lazy dog. ";
    FILE *f = fopen(text, "w");
    for (int i = 0; f && i < 64; i++) fputs(words, f);
    if (f) fclose(f);
    for (int i = 0; i < tdm_model_count(); i++) {
        const tdm_model_info *r = tdm_model_at(i);
        bool lm = r->task == TDM_TASK_TEXT;
        if (!lm && !fmnist) continue;
        char *out, *err, want[96];
        int rc =
            run(tandem,
                (const char *[]){"train", "--model", r->name, "--data", lm ? text : "fashion-mnist",
                                 "--limit", "64", "--dry-run", NULL},
                &out, &err);
        snprintf(want, sizeof want, "estimate  %s: ", r->name);
        CHECK(rc == 0 && strstr(out, want), "--model %s --dry-run: %d %s", r->name, rc, err);
        free(out), free(err);
    }
    if (!fmnist) printf("skipped the image models' dry runs: no %s\n", TDM_FASHION_MNIST_DIR);
}

int main(int argc, char **argv) {
    if (tmpdir_make("models")) return 1;
    test_table();
    for (int i = 0; i < tdm_model_count(); i++) test_row(tdm_model_at(i));
    if (argc > 1) {
        test_help(argv[1]);
        test_dry_runs(argv[1]);
    }
    tmpdir_remove();
    return check_summary();
}
