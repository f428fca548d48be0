/* CUDA graphs (tdm_graph_capture, tdm_strategy_set_graphs) on a GPU: a recording runs
 * nothing until replayed; a replayed training step gives the eager step's losses and
 * parameters bit for bit (with a learning rate that changes each step, a batch of another
 * shape between replays, batch norm's running statistics, dropout's masks, a GPT in f32 and
 * under bf16 autocast: the fused attention, the residual adds in the layer norms); the blocks a
 * recording used are never handed to other work; a replay checks the indices the recording
 * checked; what cannot be recorded (a read back to the host, dropout inside a recomputed
 * module) is refused naming why, and the strategy then steps eagerly, as a run without graphs
 * would; CPU devices and strategies over several devices are refused.
 *
 * Without the CUDA backend or a GPU the test prints why and exits 77 (CTest: skipped). The
 * CUDA emulation runs it (src/backend/cuda/emu/run). */
#include "check.h"

#ifndef TANDEM_HAVE_CUDA
int main(void) {
    printf("SKIP test_cuda_graph: this build has no CUDA backend\n");
    return 77;
}
#else

#include "backend/cuda/cuda.h"
#include "cuda_models.h"

static tdm_device G; /* cuda:0 */

/* ---- the recording itself --------------------------------------------------------------- */

typedef struct {
    tdm_tensor *t, *idx, *logits;
    void *scratch; /* the address of a block the recording freed */
    bool read_back;
} rec_args;

/* Fills t with 3, frees a scratch tensor, checks idx as a cross-entropy's targets; with
 * read_back also reads a value back to the host (not recordable). */
static int record_fill(void *arg) {
    rec_args *a = arg;
    tdm_scope_begin();
    tdm_tensor *tmp = tdm_zeros(TDM_SHAPE(4096), TDM_F32, G); /* freed by the scope's end */
    a->scratch = tmp ? tdm_cuda_ptr(tmp) : NULL;
    int rc = !tmp || tdm_fill_(a->t, 3.0f) ? tdm_last_status() : TDM_OK;
    tdm_tensor *l = rc ? NULL : tdm_cross_entropy(a->logits, a->idx, NULL);
    if (!rc && !l) rc = tdm_last_status();
    if (!rc && a->read_back && isnan(tdm_item(tdm_slice(a->t, 0, 0, 1, 1)))) rc = tdm_last_status();
    tdm_scope_end();
    return rc;
}

static float first_value(const tdm_tensor *t) {
    float v = NAN;
    tdm_to_host(tdm_slice((tdm_tensor *)t, 0, 0, 1, 1), &v, sizeof v);
    return v;
}

static void test_capture(void) {
    tdm_tensor *t = tdm_scope_keep(tdm_zeros(TDM_SHAPE(8), TDM_F32, G));
    int64_t good[3] = {0, 4, 2}, bad[3] = {0, 4, 9};
    tdm_tensor *idx = tdm_scope_keep(tdm_from_data(TDM_SHAPE(3), TDM_I64, G, good));
    tdm_tensor *logits = tdm_scope_keep(tdm_zeros(TDM_SHAPE(3, 5), TDM_F32, G));
    rec_args a = {t, idx, logits, NULL, false};
    tdm_graph *g = tdm_graph_capture(G, record_fill, &a);
    CHECK(g, "capture: %s", tdm_last_error());
    /* nothing ran: t is still zero until the replay */
    CHECK(first_value(t) == 0.0f, "the recording ran its fill (t[0] = %g)", first_value(t));
    CHECK(tdm_graph_replay(g) == TDM_OK, "replay: %s", tdm_last_error());
    CHECK(first_value(t) == 3.0f, "the replay did not fill t (t[0] = %g)", first_value(t));
    /* the recording's freed block is the graph's: another allocation of its size is not it */
    tdm_scope_begin();
    tdm_tensor *other = tdm_empty(TDM_SHAPE(4096), TDM_F32, G);
    CHECK(other && a.scratch && tdm_cuda_ptr(other) != a.scratch,
          "the graph's block %p was handed out again", a.scratch);
    tdm_scope_end();
    /* a replay checks the targets the recording checked, naming the bad one */
    tdm_scope_begin();
    tdm_copy_(idx, tdm_from_data(TDM_SHAPE(3), TDM_I64, G, bad));
    tdm_scope_end();
    int rc = tdm_graph_replay(g);
    CHECK(rc == TDM_ERR_ARG && strstr(tdm_last_error(), "target 9 (sample 2)"),
          "a replay with target 9 of 5 classes: %d, %s", rc, tdm_last_error());
    tdm_graph_free(g);
    /* freed, its blocks are everyone's again */
    tdm_scope_begin();
    tdm_tensor *again = tdm_empty(TDM_SHAPE(4096), TDM_F32, G);
    CHECK(again && tdm_cuda_ptr(again) == a.scratch, "the freed graph's block did not come back");
    tdm_scope_end();

    /* a read back to the host inside: refused, naming it, and nothing recorded is kept */
    a.read_back = true;
    g = tdm_graph_capture(G, record_fill, &a);
    CHECK(!g && strstr(tdm_last_error(), "read back to the host") &&
              strstr(tdm_last_error(), "cannot be recorded in a CUDA graph"),
          "a host read in a recording: %s", tdm_last_error());
    tdm_graph_free(g);
    /* the recording ended with the refusal: the stream runs work again */
    CHECK(tdm_fill_(t, 5.0f) == TDM_OK && first_value(t) == 5.0f, "after a refused recording: %s",
          tdm_last_error());
    CHECK(!tdm_graph_capture(tdm_cpu(0), record_fill, &a) &&
              strstr(tdm_last_error(), "graphs are CUDA's"),
          "a CPU device: %s", tdm_last_error());
    tdm_tensor_free(t), tdm_tensor_free(idx), tdm_tensor_free(logits);
}

/* ---- training steps replayed ------------------------------------------------------------ */

/* cuda_models.h's MLP without its dropout */
static tdm_module *make_plain_mlp(void) {
    tdm_rng r = tdm_rng_make(1);
    tdm_module *l[3] = {tdm_linear_new(20, 64, true, tdm_cpu(0), &r), tdm_relu_new(),
                        tdm_linear_new(64, 5, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(3, l);
}

static tdm_optim *make_adamw(tdm_paramset *ps, void *arg) {
    (void)arg;
    return tdm_adamw_new(ps, &(tdm_adam_opts){1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f, false, false});
}

static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0, (void)arg;
    return tdm_cross_entropy(out, target, NULL);
}

static tdm_tensor *gpt_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0, (void)arg;
    return tdm_gpt_loss(out, target);
}

#define STEPS 7
#define SHORT 4 /* this step's batch is smaller: it runs eagerly between replays */

/* A model stepped: what makes it, its batch's shape, and the precision of its steps (the
 * strategy's autocast region: f32 for none). */
typedef struct {
    const char *name;
    tdm_module *(*make)(void);
    tdm_shape xs;
    tdm_dtype precision;
} model_case;

/* A GPT of 2 layers, 2 heads of 16 (the fused attention), context 16, vocabulary 64: every
 * residual add in a layer norm's kernel, its MLP one op */
static tdm_module *make_gpt(void) {
    tdm_rng r = tdm_rng_make(9);
    const tdm_gpt_config c = {.layers = 2, .heads = 2, .channels = 32, .context = 16, .vocab = 64};
    return tdm_gpt_new(&c, tdm_cpu(0), &r);
}

/* Batch s of mc, on the host: random inputs and class targets, or (a GPT's [B, T]) tokens
 * and the next ones. */
static void batch_of(const model_case *mc, int s, tdm_tensor **x, tdm_tensor **t) {
    tdm_shape bs = mc->xs;
    bs.d[0] = s == SHORT ? mc->xs.d[0] / 2 : mc->xs.d[0];
    int64_t y[128];
    if (mc->make == make_gpt) {
        int64_t idx[128];
        for (int i = 0; i < bs.d[0] * bs.d[1]; i++)
            idx[i] = (i * 7 + s * 13 + i / 5) % 64, y[i] = (idx[i] * 3 + 1) % 64;
        *x = tdm_from_data(bs, TDM_I64, tdm_cpu(0), idx);
        *t = tdm_from_data(bs, TDM_I64, tdm_cpu(0), y);
        return;
    }
    for (int i = 0; i < bs.d[0]; i++) y[i] = (i * 3 + s) % 5;
    tdm_rng r = tdm_rng_make(500 + (uint64_t)s);
    *x = tdm_randn(bs, 0.5f, 1, tdm_cpu(0), &r);
    *t = tdm_from_data(TDM_SHAPE(bs.d[0]), TDM_I64, tdm_cpu(0), y);
}

/* STEPS steps of mc on cuda:0 through the one-device strategy, with graphs after warmup
 * eager steps (0: none), the learning rate changed each step and gradients clipped; losses and
 * the final parameters (host, caller frees) written out; *replays, *why the strategy's. */
static float *run(const model_case *mc, int warmup, float *losses, int64_t *replays,
                  const char **why) {
    tdm_module *m0 = mc->make(), *m = tdm_module_clone(m0, G);
    tdm_module_free(m0);
    tdm_module_train(m, true);
    tdm_strategy *st = tdm_strategy_one_device(m, make_adamw, NULL);
    int rc = st ? TDM_OK : tdm_last_status();
    if (!rc) rc = tdm_strategy_set_clip_grad_norm(st, 1.0f);
    if (!rc && mc->precision != TDM_F32) rc = tdm_strategy_set_precision(st, mc->precision);
    if (!rc && warmup) rc = tdm_strategy_set_graphs(st, warmup);
    tdm_loss_fn loss = mc->make == make_gpt ? gpt_loss : ce_loss;
    for (int s = 0; s < STEPS && !rc; s++) {
        tdm_scope_begin();
        tdm_tensor *x, *t;
        batch_of(mc, s, &x, &t);
        tdm_strategy_set_lr(st, 0.01f / (float)(1 + s));
        rc = tdm_strategy_step(st, x, t, loss, NULL, &losses[s]);
        tdm_scope_end();
    }
    tdm_paramset *ps = tdm_module_parameters(m);
    float *p = rc ? NULL : malloc(sizeof(float) * (size_t)ps->total);
    CHECK(p, "training: %s", tdm_last_error());
    if (p) tdm_to_host(ps->flat, p, sizeof(float) * (size_t)ps->total);
    *replays = tdm_strategy_graph_replays(st, why);
    static char why_copy[256]; /* the strategy's note outlives it here */
    if (*why) snprintf(why_copy, sizeof why_copy, "%s", *why), *why = why_copy;
    tdm_strategy_free(st);
    tdm_module_free(m);
    return p;
}

/* cuda_models.h's MLP, its dropout recomputed in backward (its masks from the first run's
 * log, which a graph cannot replay) */
static tdm_module *make_recomputed_mlp(void) {
    tdm_module *m = make_mlp();
    if (m && tdm_module_set_recompute(m, true)) tdm_module_free(m), m = NULL;
    return m;
}

static void test_steps(void) {
    const model_case models[] = {{"mlp", make_plain_mlp, TDM_SHAPE(32, 20), TDM_F32},
                                 {"cnn", make_cnn, TDM_SHAPE(16, 1, 12, 12), TDM_F32},
                                 {"mlp with dropout", make_mlp, TDM_SHAPE(32, 20), TDM_F32},
                                 {"gpt", make_gpt, TDM_SHAPE(4, 16), TDM_F32},
                                 {"gpt in bf16", make_gpt, TDM_SHAPE(4, 16), TDM_BF16}};
    for (size_t i = 0; i < sizeof models / sizeof *models; i++) {
        float le[STEPS], lg[STEPS];
        int64_t re, rg, n;
        const char *why;
        float *pe = run(&models[i], 0, le, &re, &why);
        float *pg = run(&models[i], 2, lg, &rg, &why);
        tdm_module *m = models[i].make();
        n = tdm_module_parameters(m)->total;
        tdm_module_free(m);
        /* steps 0 and 1 eager, 2 recorded and replayed, SHORT eager, the rest replayed */
        CHECK(rg == STEPS - 3 && !why, "%s: %lld steps replayed (%s)", models[i].name,
              (long long)rg, why ? why : "no failure");
        CHECK(!memcmp(le, lg, sizeof le), "%s: the replayed steps' losses differ from eager's",
              models[i].name);
        for (int s = 0; s < STEPS; s++)
            CHECK(le[s] == lg[s], "%s step %d: loss %.9g replayed, %.9g eager", models[i].name, s,
                  lg[s], le[s]);
        CHECK(pe && pg && !memcmp(pe, pg, sizeof(float) * (size_t)n),
              "%s: the parameters after replayed steps differ from eager's", models[i].name);
        free(pe), free(pg);
    }
    /* dropout in a recomputed module cannot be recorded: said, and every step runs eagerly,
     * with the masks of a run without graphs (the refused recording gave its draws back) */
    float le[STEPS], lg[STEPS];
    int64_t re, rg;
    const char *why;
    const model_case rec = {"recomputed mlp", make_recomputed_mlp, TDM_SHAPE(32, 20), TDM_F32};
    float *pe = run(&rec, 0, le, &re, &why);
    float *pg = run(&rec, 1, lg, &rg, &why);
    CHECK(pg && rg == 0 && why && strstr(why, "random draw in a recomputed function"),
          "dropout recomputed: %lld replays, %s", (long long)rg, why ? why : "no reason");
    CHECK(pe && pg && !memcmp(le, lg, sizeof le) &&
              !memcmp(pe, pg, sizeof(float) * (size_t)(20 * 64 + 64 + 64 * 5 + 5)),
          "dropout recomputed: the eager steps after the refusal differ from a run without "
          "graphs");
    free(pe), free(pg);
}

static void test_refused(void) {
    tdm_module *mc = make_plain_mlp();
    tdm_strategy *st = tdm_strategy_one_device(mc, make_adamw, NULL);
    CHECK(st && tdm_strategy_set_graphs(st, 2) == TDM_ERR_DEVICE &&
              strstr(tdm_last_error(), "on cpu:0"),
          "graphs on cpu:0: %s", tdm_last_error());
    tdm_strategy_free(st);
    tdm_module *mg = tdm_module_clone(mc, G);
    st = tdm_strategy_one_device(mg, make_adamw, NULL);
    CHECK(st && tdm_strategy_set_graphs(st, 0) == TDM_ERR_ARG, "0 warm-up steps: %s",
          tdm_last_error());
    tdm_strategy_free(st);
    tdm_device gpus[1] = {G};
    st = tdm_strategy_data_parallel(mg, gpus, 1, NULL, make_adamw, NULL);
    CHECK(st && tdm_strategy_set_graphs(st, 2) == TDM_ERR_STATE &&
              strstr(tdm_last_error(), "one GPU's step"),
          "DataParallel: %s", tdm_last_error());
    tdm_strategy_free(st);
    tdm_module_free(mc), tdm_module_free(mg);
}

int main(void) {
    if (tdm_cuda_device_count() == 0) {
        printf("SKIP test_cuda_graph: no GPU: %s\n", tdm_cuda_unavailable_reason());
        return 77;
    }
    G = tdm_cuda(0);
    test_capture();
    test_steps();
    test_refused();
    return check_summary();
}
#endif
