/* Training on GPUs against the same training on the CPU (the kernels themselves are compared
 * one by one in test_cuda.c): a few steps of an MLP (with dropout) and a CNN (batch norm, max
 * pooling) on cuda:0 match the same steps on cpu:0 and repeat bit for bit; DataParallel over
 * one and two GPUs (NCCL) and a pipeline over two match one CPU device; the loader's uploads
 * deliver the CPU loader's batches; steady-state steps allocate no GPU memory.
 *
 * Without the CUDA backend or without a GPU the test prints why and exits 77, which CTest
 * reports as skipped. Two GPUs where there are (the CUDA emulation gives them: EMU_GPUS=2). */
#include "check.h"

#ifndef TANDEM_HAVE_CUDA
int main(void) {
    printf("SKIP test_cuda_train: this build has no CUDA backend\n");
    return 77;
}
#else

#include "backend/cuda/cuda.h"
#include "parallel/nccl_group.h"
#include "cuda_models.h"

#include <pthread.h>

static tdm_device G; /* cuda:0 */

static tdm_optim *make_optim(tdm_paramset *ps, void *adam) {
    return *(bool *)adam
               ? tdm_adam_new(ps, &(tdm_adam_opts){1e-2f, 0.9f, 0.999f, 1e-8f, 0, false, false})
               : tdm_sgd_new(ps, &(tdm_sgd_opts){.lr = 0.05f, .momentum = 0.9f});
}

/* Step s's batch on dev: inputs x [xs], targets t [B] (in the current scope). */
static void make_batch(int s, tdm_shape xs, tdm_device dev, tdm_tensor **x, tdm_tensor **t) {
    int64_t B = xs.d[0], y[64];
    tdm_rng r = tdm_rng_make(500 + (uint64_t)s);
    for (int i = 0; i < B; i++) y[i] = (i * 3 + s) % 5;
    *x = tdm_to_device(tdm_randn(xs, 0.5f, 1, tdm_cpu(0), &r), dev);
    *t = tdm_from_data(TDM_SHAPE(B), TDM_I64, dev, y);
}

/* STEPS steps of m on its device from its current weights; losses written out. Returns the
 * final parameters (flat, on the host; caller frees) or NULL. */
#define STEPS 6
static float *train(tdm_module *m, tdm_shape xs, bool adam, float *losses) {
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *o = make_optim(ps, &adam);
    int rc = o ? TDM_OK : TDM_ERR_STATE;
    for (int s = 0; s < STEPS; s++) losses[s] = NAN;
    for (int s = 0; s < STEPS && rc == TDM_OK; s++) {
        tdm_optim_zero_grad(o);
        tdm_scope_begin();
        tdm_tensor *x, *t;
        make_batch(s, xs, ps->flat->device, &x, &t);
        tdm_tensor *l = tdm_cross_entropy(tdm_module_forward(m, x), t, NULL);
        losses[s] = l ? tdm_item(l) : NAN;
        rc = l ? tdm_backward(l) : TDM_ERR_STATE;
        if (!rc) rc = tdm_optim_step(o);
        tdm_scope_end();
    }
    float *out = rc ? NULL : malloc(sizeof(float) * (size_t)ps->total);
    if (out) tdm_to_host(ps->flat, out, sizeof(float) * (size_t)ps->total);
    tdm_optim_free(o);
    return out;
}

/* The models trained here and by DataParallel, and their inputs' shapes. */
typedef struct {
    const char *name;
    tdm_module *(*make)(void);
    tdm_shape xs;
} model;

static model model_of(int i) {
    model m[2] = {{"mlp", make_mlp, TDM_SHAPE(32, 20)},
                  {"cnn", make_cnn, TDM_SHAPE(16, 1, 12, 12)}};
    return m[i];
}

/* Each loss within 1e-4 (absolute and relative) of the CPU's, and the final parameters within
 * 1e-4 + 1e-3 relative: STEPS steps compound rounding differences (and Adam divides by small
 * sqrt(v)). */
static void like_cpu(const char *what, const float *losses, const float *lc, const float *p,
                     const float *pc, int64_t n) {
    for (int s = 0; s < STEPS; s++)
        CHECK(fabsf(losses[s] - lc[s]) <= 1e-4f + 1e-4f * fabsf(lc[s]),
              "%s, step %d: loss %.7g, cpu %.7g", what, s, losses[s], lc[s]);
    int64_t bad = 0;
    for (int64_t i = 0; i < n && p && pc; i++)
        bad += !(fabsf(p[i] - pc[i]) <= 1e-4f + 1e-3f * fabsf(pc[i]));
    CHECK(p && pc && bad == 0, "%s: %lld of %lld parameters differ from the CPU's", what,
          (long long)bad, (long long)n);
}

/* Each model and optimizer, from the same weights on cpu:0 and twice on cuda:0: the CPU's
 * losses and parameters, and the same bits both times on the GPU. */
static void test_training(void) {
    for (int mi = 0; mi < 2; mi++)
        for (int adam = 0; adam < 2; adam++) {
            model md = model_of(mi);
            char what[32];
            snprintf(what, sizeof what, "%s %s on cuda:0", md.name, adam ? "adam" : "sgd");
            tdm_module *mc = md.make(), *mg = tdm_module_clone(mc, G);
            tdm_module *mg2 = tdm_module_clone(mc, G);
            CHECK(mg && mg2, "%s: clone: %s", what, tdm_last_error());
            float lc[STEPS], lg[STEPS], lg2[STEPS], *pc = NULL, *pg = NULL, *pg2 = NULL;
            if (mg && mg2) {
                tdm_module_train(mc, true), tdm_module_train(mg, true), tdm_module_train(mg2, true);
                pc = train(mc, md.xs, adam, lc), pg = train(mg, md.xs, adam, lg);
                pg2 = train(mg2, md.xs, adam, lg2);
                CHECK(pc && pg && pg2, "%s: training failed: %s", what, tdm_last_error());
                int64_t n = tdm_module_parameters(mc)->total;
                like_cpu(what, lg, lc, pg, pc, n);
                CHECK(pg && pg2 && !memcmp(pg, pg2, sizeof(float) * (size_t)n),
                      "%s: two runs differ (not deterministic)", what);
            }
            free(pc), free(pg), free(pg2);
            tdm_module_free(mc), tdm_module_free(mg), tdm_module_free(mg2);
        }
}

static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0, (void)arg;
    return tdm_cross_entropy(out, target, NULL);
}

static int dp_step(void *st, tdm_tensor *x, tdm_tensor *t, float *loss) {
    return tdm_strategy_step(st, x, t, ce_loss, NULL, loss);
}

static int pipe_step(void *pipe, tdm_tensor *x, tdm_tensor *t, float *loss) {
    return tdm_pipe_step(pipe, x, t, ce_loss, NULL, loss);
}

/* STEPS steps of step(obj) on train()'s batches (from the host); their losses written out. */
static void run_steps(const char *what, int (*step)(void *, tdm_tensor *, tdm_tensor *, float *),
                      void *obj, tdm_shape xs, float *losses) {
    for (int s = 0; s < STEPS; s++) {
        tdm_scope_begin();
        tdm_tensor *x, *t;
        make_batch(s, xs, tdm_cpu(0), &x, &t);
        losses[s] = NAN;
        int rc = step(obj, x, t, &losses[s]);
        tdm_scope_end();
        CHECK(rc == TDM_OK, "%s, step %d: %s", what, s, tdm_last_error());
    }
}

/* DataParallel over n GPUs (NCCL: bucket all-reduces, synchronised batch norm, the wrap-time
 * broadcasts; with shard, the optimizer state sharded over the GPUs, ZeRO stage 1, or also
 * the gradients, stage 2: bucket buffers and the shard's gradient in GPU memory, or also the
 * parameters, stage 3: each layer gathered by NCCL broadcasts into GPU memory) gives one
 * CPU device's parameters on the same batches, and every replica the same bits. CPU and GPU
 * replicas mixed are refused. */
static void dp_against_cpu(int n, model md, bool adam, tdm_shard_kind shard) {
    char what[80];
    snprintf(what, sizeof what, "%s %s on %d GPU(s)%s", md.name, adam ? "adam" : "sgd", n,
             shard == TDM_SHARD_PARAMETERS  ? ", sharded (stage 3)"
             : shard == TDM_SHARD_GRADIENTS ? ", sharded (stage 2)"
             : shard                        ? ", sharded"
                                            : "");
    tdm_device gpus[2] = {G, tdm_cuda(1)};
    tdm_module *mc = md.make(), *mg = tdm_module_clone(mc, G);
    tdm_module_train(mc, true);
    if (mg) tdm_module_train(mg, true); /* before the replicas are cloned from it */
    tdm_strategy *dp = mg ? tdm_strategy_data_parallel(mg, gpus, n, NULL, make_optim, &adam) : NULL;
    CHECK(dp, "%s: data_parallel: %s", what, tdm_last_error());
    if (dp && shard)
        CHECK(tdm_strategy_set_shard(dp, shard, NULL) == 0, "%s: %s", what, tdm_last_error());
    int64_t np = tdm_module_parameters(mc)->total;
    float lc[STEPS], lg[STEPS], *pc = dp ? train(mc, md.xs, adam, lc) : NULL;
    float *p[2] = {malloc(sizeof(float) * (size_t)np), malloc(sizeof(float) * (size_t)np)};
    if (dp) {
        run_steps(what, dp_step, dp, md.xs, lg);
        CHECK(tdm_strategy_gather_params(dp) == 0, "%s: %s", what, tdm_last_error()); /* stage 3 */
        for (int r = 0; r < n; r++)
            tdm_to_host(tdm_module_parameters(tdm_strategy_replica(dp, r))->flat, p[r],
                        sizeof(float) * (size_t)np);
        like_cpu(what, lg, lc, p[0], pc, np);
        if (n > 1)
            CHECK(!memcmp(p[0], p[1], sizeof(float) * (size_t)np), "%s: the replicas differ", what);
        CHECK(tdm_strategy_release_params(dp) == 0, "%s: %s", what, tdm_last_error());
        tdm_optim *whole = shard ? tdm_strategy_optim_gather(dp) : NULL;
        tdm_tensor *st[3];
        CHECK(!shard || (whole && tdm_optim_state(whole, NULL, st, 3) > 0 &&
                         tdm_numel(st[0]) == np && tdm_device_equal(st[0]->device, G)),
              "%s: the gathered state: %s", what, tdm_last_error());
        tdm_optim_free(whole);
    }
    free(pc), free(p[0]), free(p[1]);
    tdm_strategy_free(dp);
    tdm_module_free(mc), tdm_module_free(mg);
}

static void test_data_parallel(void) {
    tdm_module *mix = make_mlp(); /* on cpu:0 */
    bool sgd = false;
    tdm_device mixed[2] = {tdm_cpu(0), G};
    CHECK_ERROR(tdm_dp_new(mix, mixed, 2, make_optim, &sgd) == NULL, "mix CPU and GPU");
    tdm_module_free(mix);
    if (!tdm_nccl_available()) {
        printf("test_data_parallel: skipped (this build has no NCCL)\n");
        return;
    }
    int most = tdm_cuda_device_count() >= 2 ? 2 : 1;
    if (most < 2) printf("test_data_parallel: 2 GPUs skipped (this machine has 1)\n");
    /* with two GPUs, two replicas check all that one does and the all-reduces besides (one
     * replica alone is run only where there is one GPU: the CPU emulation is slow) */
    for (int n = most; n <= most; n++)
        for (int adam = 0; adam < 2; adam++)
            for (int mi = 0; mi < 2; mi++) dp_against_cpu(n, model_of(mi), adam, TDM_SHARD_NONE);
    dp_against_cpu(most, model_of(0), true, TDM_SHARD_OPTIMIZER);
    dp_against_cpu(most, model_of(0), false, TDM_SHARD_GRADIENTS);
    dp_against_cpu(most, model_of(0), true, TDM_SHARD_PARAMETERS);
}

/* A 2-stage pipeline over cuda:0 and cuda:1 (activations and gradients cross between the
 * GPUs), 4 micro-batches, GPipe and 1F1B: the parameters of unsplit training on the CPU. */
static void test_pipeline(void) {
    if (tdm_cuda_device_count() < 2) {
        printf("test_pipeline: skipped (needs 2 GPUs, this machine has 1)\n");
        return;
    }
    model md = model_of(0);
    bool adam = false;
    tdm_module *mc = md.make();
    tdm_module_train(mc, true);
    float lc[STEPS], *pc = train(mc, md.xs, adam, lc);
    for (int sched = 0; sched < 2; sched++) {
        const char *name = sched ? "pipeline 1F1B" : "pipeline GPipe";
        tdm_module *mp = md.make();
        tdm_module_train(mp, true);
        tdm_pipe_opts o = tdm_pipe_defaults(2, 4);
        o.schedule = (tdm_pipe_schedule)sched;
        o.devices = "cuda:0,cuda:1";
        tdm_pipe *p = tdm_pipe_new(mp, &o, make_optim, &adam);
        CHECK(p, "%s on cuda:0,cuda:1: %s", name, tdm_last_error());
        float lp[STEPS];
        if (p) {
            run_steps(name, pipe_step, p, md.xs, lp);
            CHECK(tdm_pipe_copy_to(p, mp) == TDM_OK, "%s: copy_to: %s", name, tdm_last_error());
            like_cpu(name, lp, lc, tdm_data_ptr(tdm_module_parameters(mp)->flat), pc,
                     tdm_module_parameters(mc)->total);
        }
        tdm_pipe_free(p);
        tdm_module_free(mp);
    }
    free(pc);
    tdm_module_free(mc);
}

/* The loader on cuda:0 (pinned buffers, asynchronous uploads) delivers the CPU loader's
 * batches bit for bit, the last smaller one included, with 0 and 2 workers over 2 epochs. */
static void test_loader_upload(void) {
    enum { N = 50, ROW = 12, BATCH = 8 };
    float x[N * ROW];
    int64_t y[N];
    for (int i = 0; i < N * ROW; i++) x[i] = (float)(i / ROW) + 0.01f * (float)(i % ROW);
    for (int i = 0; i < N; i++) y[i] = i % 7;
    tdm_dataset *ds = tdm_memory_dataset(TDM_SHAPE(3, 4), N, x, y, 7);
    for (int workers = 0; workers <= 2 && ds; workers += 2) {
        tdm_loader_opts o = tdm_loader_defaults(BATCH);
        o.shuffle = true, o.seed = 3, o.workers = workers;
        tdm_loader *lc = tdm_loader_new(ds, &o);
        o.device = G;
        tdm_loader *lg = tdm_loader_new(ds, &o);
        CHECK(lc && lg, "loader on cuda:0 with %d workers: %s", workers, tdm_last_error());
        for (int epoch = 0; epoch < 2 && lc && lg; epoch++) {
            tdm_loader_start_epoch(lc, epoch), tdm_loader_start_epoch(lg, epoch);
            tdm_batch bc, bg;
            int batches = 0, same = 0;
            while (tdm_loader_next(lc, &bc) == 1 && tdm_loader_next(lg, &bg) == 1) {
                float hx[BATCH * ROW];
                int64_t hy[BATCH];
                size_t nx = sizeof(float) * (size_t)(bc.size * ROW), ny = sizeof(int64_t) * bc.size;
                bool ok = bg.x->device.type == TDM_CUDA && bg.size == bc.size &&
                          !tdm_to_host(bg.x, hx, nx) && !tdm_to_host(bg.y, hy, ny);
                same += ok && !memcmp(hx, tdm_data_ptr(bc.x), nx) &&
                        !memcmp(hy, tdm_data_ptr(bc.y), ny) && !memcmp(bg.y_host, hy, ny);
                batches++;
            }
            CHECK(batches == (N + BATCH - 1) / BATCH && same == batches,
                  "%d workers, epoch %d: %d of %d uploaded batches equal the CPU's", workers, epoch,
                  same, batches);
        }
        tdm_loader_free(lc);
        tdm_loader_free(lg);
    }
    tdm_loader_opts bad = tdm_loader_defaults(BATCH);
    bad.device = tdm_cuda(7);
    CHECK_ERROR(tdm_loader_new(ds, &bad) == NULL, "cuda:7");
    tdm_dataset_free(ds);
}

/* After a warm-up step, training steps take every block from the caching allocator: no
 * cudaMalloc (which would also synchronise the device) in steady state. */
static void test_steady_state(void) {
    model md = model_of(1);
    tdm_module *c = md.make(), *m = tdm_module_clone(c, G);
    tdm_module_free(c);
    CHECK(m != NULL, "clone: %s", tdm_last_error());
    if (!m) return;
    float losses[STEPS];
    float *p = train(m, md.xs, true, losses); /* warm-up: fills the cache */
    tdm_alloc_stats before = tdm_alloc_stats_get(G);
    float *q = train(m, md.xs, true, losses);
    tdm_alloc_stats after = tdm_alloc_stats_get(G);
    CHECK(p && q, "steady-state training: %s", tdm_last_error());
    /* the second run makes a new optimizer (its moments are new blocks of sizes already
     * cached, released by the first run's optimizer) and repeats the same steps */
    CHECK(after.sys_allocs == before.sys_allocs,
          "%llu cudaMalloc calls in steady state (expected 0)",
          (unsigned long long)(after.sys_allocs - before.sys_allocs));
    free(p), free(q);
    tdm_module_free(m);
}

/* One rank of a desync: an agreed all-reduce, then collective `kind` labelled `site`. */
typedef struct {
    tdm_group *g;
    tdm_coll_kind kind;
    const char *site;
    int first, second; /* statuses */
    char msg[512];
} desync_rank;

static void *desync_main(void *arg) {
    desync_rank *d = arg;
    tdm_tensor *t = tdm_ones(TDM_SHAPE(8), TDM_F32, tdm_group_device(d->g));
    tdm_collective_label("the agreed one");
    d->first = t ? tdm_work_wait(tdm_all_reduce(d->g, t, TDM_SUM)) : -1;
    tdm_collective_label("%s", d->site);
    tdm_work *w = !t                               ? NULL
                  : d->kind == TDM_COLL_ALL_REDUCE ? tdm_all_reduce(d->g, t, TDM_SUM)
                                                   : tdm_broadcast(d->g, t, 0);
    d->second = tdm_work_wait(w);
    snprintf(d->msg, sizeof d->msg, "%s", tdm_last_error());
    tdm_tensor_free(t);
    return NULL;
}

/* Two GPUs of one NCCL world calling different collectives (a hang on real GPUs) or the same
 * one from different sites (silently mixed tensors): both fail at once, each naming both
 * sides, the GPU in the collective freed by the abort. */
static void test_nccl_desync(void) {
    if (!tdm_nccl_available() || tdm_cuda_device_count() < 2) {
        printf("test_nccl_desync: skipped (needs NCCL and 2 GPUs)\n");
        return;
    }
    struct {
        tdm_coll_kind k1;
        const char *site1, *expect;
    } cases[] = {{TDM_COLL_BROADCAST, "bucket 0",
                  "ranks disagree on the collective: rank 0 is in all_reduce #2 (bucket 0: 8 f32, "
                  "sum) while rank 1 is in broadcast #2 (bucket 0: 8 f32, root 0)"},
                 {TDM_COLL_ALL_REDUCE, "bucket 1",
                  "ranks disagree on the caller: rank 0 is in all_reduce #2 (bucket 0: 8 f32, sum) "
                  "while rank 1 is in all_reduce #2 (bucket 1: 8 f32, sum)"}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        tdm_device devs[2] = {tdm_cuda(0), tdm_cuda(1)};
        tdm_group *g[2];
        if (tdm_nccl_world_new(2, devs, g) != TDM_OK) {
            CHECK(0, "nccl world: %s", tdm_last_error());
            return;
        }
        desync_rank d[2] = {{g[0], TDM_COLL_ALL_REDUCE, "bucket 0", 0, 0, ""},
                            {g[1], cases[c].k1, cases[c].site1, 0, 0, ""}};
        pthread_t th[2];
        for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, desync_main, &d[r]);
        for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
        for (int r = 0; r < 2; r++)
            CHECK(d[r].first == TDM_OK && d[r].second == TDM_ERR_COMM &&
                      strstr(d[r].msg, cases[c].expect),
                  "case %zu, rank %d: %d, %d, %s", c, r, d[r].first, d[r].second, d[r].msg);
        for (int r = 0; r < 2; r++) tdm_nccl_group_free(g[r]);
    }
}

int main(void) {
    if (tdm_cuda_device_count() == 0) {
        printf("SKIP test_cuda_train: no GPU: %s\n", tdm_cuda_unavailable_reason());
        return 77;
    }
    G = tdm_cuda(0);
    test_training();
    test_data_parallel();
    test_pipeline();
    test_nccl_desync();
    test_loader_upload();
    test_steady_state();
    return check_summary();
}
#endif
