/* The memory estimate of a training run (estimate.h).
 *
 * Parameters, gradients and optimizer state are exact: the model's parameter count from its
 * architecture, one flat buffer each (tdm_module_parameters, the optimizer's state), at the
 * allocator's size classes (tdm_memory_block_bytes). The loaders' buffers are exact too
 * (tdm_loader_memory). Activations are counted, not measured: every tensor a sample's forward
 * makes (model_count below), times a factor per model. The forward's tensors live until the
 * step's scope ends; the backward engine gives each gradient back once the nodes holding it
 * have run (src/autograd/engine.c), though a backward's temporaries and the gradients added
 * into another stay to the end: at the peak the forward is alive with a part of its gradients.
 * The factors are that ratio as measured on each model with this build (--log's peak_bytes,
 * one CPU device): 1.25 for the GPT, more where batch norm keeps its normalised input or a
 * residual sum clones a gradient.
 * Each model's row of the registry counts its own (tdm_model_cost, beside its builder in
 * src/models/), so this file knows no model. tests/test_estimate.c holds them to the measured
 * peak within 15%.
 */
#include "estimate.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "trainer_state.h" /* SYNC_STEPS */

/* What one sample's forward makes: the model's row counts it (tdm_model_cost_of). */
typedef tdm_model_cost model_count;

/* ---- per device ------------------------------------------------------------------------- */

/* Figures past 100 PB are held there, so that a sum of a device's figures stays in int64. */
#define MOST_BYTES 1e17

static int64_t bytes_of(double bytes) {
    return (int64_t)fmin(ceil(bytes), MOST_BYTES);
}

/* bytes as the allocator hands them out (one storage). */
static int64_t block(double bytes) {
    return tdm_memory_block_bytes(bytes_of(bytes));
}

static int optim_states(const train_opts *o) {
    if (strcmp(o->optimizer, "sgd") == 0) return o->momentum > 0 ? 1 : 0;
    return 2; /* adam, adamw: exp_avg, exp_avg_sq */
}

/* What one device holds of the model and of a step: all of it, or its pipeline stage's. */
typedef struct {
    double params;    /* parameters */
    double fwd;       /* forward floats per sample (units as --recompute keeps them) */
    double head;      /* logits per sample: the last stage's */
    double input;     /* floats per sample a pipeline stage receives from the one before */
    double in_flight; /* micro-batches whose forward is alive at once */
    double rows;      /* samples per micro-batch (tokens, for the GPT) */
} share;

/* Device d's share: of a pipeline cut as tdm_pipe_split cuts it (stage s of replica r is
 * device s * R + r), or of the whole model on `rows` samples. Under 1F1B stage s holds the
 * forwards of up to K - s micro-batches (its warm-up), under GPipe all M. */
static share share_of(const model_count *m, const train_opts *o, int d, double rows) {
    double units = o->recompute ? m->unit_inputs + m->unit_max : m->unit_sum;
    share sh = {(double)m->params, m->fwd + units, m->head, 0, 1, rows};
    int K = (int)o->model_split, R = o->n_devs / (K > 1 ? K : 1), first[TDM_PIPE_MAX_STAGES + 1];
    if (K <= 1 || tdm_pipe_split_params(m->layer_params, m->n_layers, K, first)) return sh;
    int st = d / R;
    sh.params = sh.fwd = 0;
    for (int i = first[st]; i < first[st + 1]; i++)
        sh.params += (double)m->layer_params[i], sh.fwd += m->layer_fwd[i];
    sh.head = st == K - 1 ? m->head : 0;
    for (int i = first[st] - 1; i >= 0 && sh.input == 0; i--) /* a flatten is a view */
        sh.input = m->layer_fwd[i];
    bool gpipe = strcmp(o->pipe_schedule, "gpipe") == 0;
    sh.in_flight = gpipe || o->micro_batches < K - st ? (double)o->micro_batches : K - st;
    sh.rows = ceil(rows / (double)o->micro_batches); /* rows: the replica's batch */
    return sh;
}

/* A step's activations on a device of share sh: the forwards in flight, and the gradients of
 * one (the factor's part beyond 1); the logits likewise; a stage's inputs in flight and the
 * gradient it sends back; the kernels' fixed scratch. */
static double activation_bytes(const model_count *m, const share *sh) {
    double fwd = sh->fwd * (sh->in_flight + m->factor - 1);
    double head = sh->head * (sh->in_flight + m->head_factor - 1);
    double input = sh->input * (sh->in_flight + 1);
    return 4 * sh->rows * (fwd + head + input) + m->fixed + 4 * m->fixed_per_param * sh->params;
}

/* Parameters, gradients and optimizer state on device d, holding sh, under ZeRO's --shard
 * stages over the ranks (every device of every process). */
static void weights(estimate_device *x, int d, const model_count *m, const share *sh,
                    const train_opts *o, int procs) {
    int ranks = o->n_devs * procs, k = optim_states(o);
    double p = sh->params, bucket = (double)(o->bucket_cap << 20);
    bool stage3 = strcmp(o->shard, "parameters") == 0;
    bool stage2 = stage3 || strcmp(o->shard, "gradients") == 0;
    bool stage1 = stage2 || strcmp(o->shard, "optimizer") == 0;
    /* the CPU devices of one process update in shards already (DataParallel's shared-memory
     * update: the state is device 0's, each replica steps its part); ZeRO 1 and 2 add nothing
     * there, ZeRO 3 shards over every rank */
    bool shared =
        procs == 1 && o->n_devs > 1 && o->devs[0].type == TDM_CPU && !stage3 && o->model_split <= 1;
    bool sharded = ranks > 1 && stage1 && !shared;
    x->params = block(4 * p);
    x->grads = block(4 * p);
    x->optim = shared && d > 0 ? 0 : k * block(4 * p); /* shared: device 0's optimizer */
    if (sharded) x->optim = k * block(4 * p / ranks);
    if (sharded && stage2) /* the shard, and buckets in flight: two, at most the model */
        x->grads = block(4 * p / ranks) + block(fmin(2 * bucket, 4 * p));
    if (sharded && stage3) x->params = block(4 * p / ranks) + block(8.0 * m->unit_params);
}

/* The loaders' buffers and the trainer's step buffers (trainer.c, make_buffers): device 0's. */
static int data_bytes(const train_opts *o, const task *t, const tdm_loader_opts *lo,
                      const tdm_loader_opts *eo, int64_t *bytes) {
    int64_t train = 0, test = 0;
    if (tdm_loader_memory(t->train, lo, &train))
        return task_error("training loader: %s", tdm_last_error());
    if (eo && tdm_loader_memory(t->test, eo, &test))
        return task_error("test loader: %s", tdm_last_error());
    int64_t rows = SYNC_STEPS * o->grad_accum * o->batch_size;
    if (rows > t->train->n) rows = t->train->n;
    *bytes = train + test + block(4.0 * SYNC_STEPS * (double)o->grad_accum) +
             (t->accuracy ? block(8.0 * (double)rows) : 0);
    return 0;
}

int estimate_make(const train_opts *o, const task *t, int procs, const tdm_loader_opts *lo,
                  const tdm_loader_opts *eo, estimate *e) {
    model_count m;
    if (tdm_model_cost_of(t->row, &t->sizes, &m))
        return task_error("--model %s: %s", o->model, tdm_last_error());
    *e = (estimate){.n_params = m.params, .n_devs = o->n_devs};
    int64_t data = 0;
    if (data_bytes(o, t, lo, eo, &data)) return EXIT_RUNTIME;
    /* the rows of a batch this process trains: the loader's (never more than the data) */
    int64_t rows = lo->batch_size, per_rank = (t->train->n + procs - 1) / procs;
    if (rows > per_rank) rows = per_rank;
    /* a pipeline's replicas (each stage of one on --tensor-parallel devices, all its rows) */
    int replicas =
        o->n_devs / (o->model_split > 1 ? (int)(o->model_split * o->tensor_parallel) : 1);
    e->samples = (rows + replicas - 1) / replicas;
    double per = (double)m.positions; /* a GPT's are counted per token */
    for (int d = 0; d < o->n_devs; d++) {
        estimate_device *x = &e->dev[d];
        /* DataParallel: device 0 takes the rows left over by the split */
        double mine = d == 0 ? (double)e->samples : (double)(rows / replicas);
        share sh = share_of(&m, o, d, mine * per);
        weights(x, d, &m, &sh, o, procs);
        x->acts = bytes_of(activation_bytes(&m, &sh));
        x->data = d == 0 ? data : 0;
        /* a pipeline's stages are clones: the model the trainer built stays on device 0,
         * with its flat gradient (the one the checkpoints and the evaluation read) */
        if (o->model_split > 1 && d == 0) x->params += 2 * block(4.0 * (double)m.params);
        x->total = x->params + x->grads + x->optim + x->acts + x->data;
    }
    if (m.unit_sum > 0) { /* device 0's activations with --recompute, for the suggestion */
        train_opts r = *o;
        r.recompute = true;
        share sh = share_of(&m, &r, 0, (double)e->samples * per);
        e->acts_recompute = bytes_of(activation_bytes(&m, &sh));
    }
    return 0;
}

/* ---- the machine's memory ----------------------------------------------------------------- */

/* The bytes this process may use: physical memory, RLIMIT_AS and the cgroup's memory.max,
 * whichever is least; *what names the one that binds. */
static double memory_limit(const char **what) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    double limit = pages > 0 && page > 0 ? (double)pages * (double)page : INFINITY;
    *what = "physical memory";
    struct rlimit rl;
    if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        (double)rl.rlim_cur < limit)
        limit = (double)rl.rlim_cur, *what = "the address-space limit (ulimit -v)";
    FILE *f = fopen("/sys/fs/cgroup/memory.max", "r");
    char buf[64] = "";
    if (f && fgets(buf, sizeof buf, f) && strncmp(buf, "max", 3) != 0) {
        double cg = strtod(buf, NULL);
        if (cg > 0 && cg < limit) limit = cg, *what = "the cgroup's memory.max";
    }
    if (f) fclose(f);
    return limit;
}

/* What the estimate leaves for everything it does not count: the binary, the threads'
 * stacks and scope arenas, the GEMM library's buffers, the dataset in memory (Fashion-MNIST
 * is 55 MB as floats), allocator classes not yet reused; and the estimate's own error
 * (tests/test_estimate.c holds it within 15% of the measured peak). A quarter of the limit
 * covers that error with room to spare; 512 MiB covers the fixed costs on a small machine. */
static double usable(double limit) {
    double margin = limit / 4 > 512.0 * (1 << 20) ? limit / 4 : 512.0 * (1 << 20);
    return limit > margin ? limit - margin : 0;
}

/* What a GPU's memory leaves for the estimate: the CUDA context, cuBLAS's workspaces and
 * NCCL's buffers (about a GiB together) and the estimate's own error, whose activation factors
 * were measured with the CPU's kernels: a tenth of the memory, at least 1 GiB. A GPU is taken
 * as the run's alone, as PyTorch takes it. */
static double gpu_usable(double total) {
    double margin = total / 10 > 1024.0 * (1 << 20) ? total / 10 : 1024.0 * (1 << 20);
    return total > margin ? total - margin : 0;
}

static void human(double bytes, char *buf, size_t cap) {
    const char *unit[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB"};
    int u = 0;
    while (bytes >= 1024 && u < 5) bytes /= 1024, u++;
    snprintf(buf, cap, u ? "%.1f %s" : "%.0f %s", bytes, unit[u]);
}

/* The sum over this process's CPU devices: they share the machine's memory. */
static double host_total(const estimate *e, const train_opts *o) {
    double sum = 0;
    for (int d = 0; d < e->n_devs; d++)
        if (o->devs[d].type == TDM_CPU) sum += (double)e->dev[d].total;
    return sum;
}

void estimate_print(const estimate *e, const train_opts *o, FILE *out) {
    static const char *const names[6] = {"parameters",  "gradients", "optimizer",
                                         "activations", "data",      "total"};
    fprintf(out, "estimate  %s: %lld parameters; %lld samples of a batch on %s\n", o->model,
            (long long)e->n_params, (long long)e->samples, o->devices);
    for (int d = 0; d < e->n_devs; d++) {
        const estimate_device *x = &e->dev[d];
        int64_t v[6] = {x->params, x->grads, x->optim, x->acts, x->data, x->total};
        char dev[16], b[32];
        fprintf(out, "memory    %-6s", tdm_device_str(o->devs[d], dev));
        for (int k = 0; k < 6; k++) {
            human((double)v[k], b, sizeof b);
            fprintf(out, "%s %s %s", k ? "," : "", names[k], b);
        }
        fprintf(out, "\n");
    }
    const char *what;
    double limit = memory_limit(&what);
    char need[32], has[32], use[32];
    human(host_total(e, o), need, sizeof need);
    human(limit, has, sizeof has);
    human(usable(limit), use, sizeof use);
    fprintf(out,
            "memory    %s in all on this process's CPU devices, of %s usable (%s: %s, less "
            "a margin of a quarter)\n",
            need, use, what, has);
    for (int d = 0; d < e->n_devs; d++) { /* a GPU holds its share alone */
        int64_t total = 0;
        char dev[16];
        if (o->devs[d].type != TDM_CUDA || tdm_device_memory_info(o->devs[d], &total, NULL))
            continue;
        human((double)e->dev[d].total, need, sizeof need);
        human(gpu_usable((double)total), use, sizeof use);
        human((double)total, has, sizeof has);
        fprintf(out, "memory    %s on %s, of %s usable (its %s, less a tenth)\n", need,
                tdm_device_str(o->devs[d], dev), use, has);
    }
}

/* The largest --batch-size whose activations and batch buffers, scaled from e's, fit in
 * `room` bytes with the rest of what e needs on the CPU devices (0 when none does). */
static int64_t batch_that_fits(const estimate *e, const train_opts *o, double room) {
    double acts = 0;
    for (int d = 0; d < e->n_devs; d++)
        if (o->devs[d].type == TDM_CPU) acts += (double)(e->dev[d].acts + e->dev[d].data);
    double rest = host_total(e, o) - acts;
    if (acts <= 0 || room <= rest) return 0;
    return (int64_t)floor((double)o->batch_size * (room - rest) / acts);
}

/* The changes that shrink what e needs, into buf: the next --shard stage, --recompute, a
 * smaller --batch-size (the largest that fits, when one does), more devices. */
static void suggest(const estimate *e, const train_opts *o, double room, char *buf, size_t cap) {
    const estimate_device *x = &e->dev[0];
    int n = 0;
    const char *stage = strcmp(o->shard, "none") == 0        ? "optimizer (ZeRO 1)"
                        : strcmp(o->shard, "optimizer") == 0 ? "gradients (ZeRO 2)"
                        : strcmp(o->shard, "gradients") == 0 ? "parameters (ZeRO 3)"
                                                             : NULL;
    char b[32], r[32];
    if (stage && o->model_split <= 1 && x->params + x->grads + x->optim > x->acts) {
        human((double)(x->params + x->grads + x->optim), b, sizeof b);
        n += snprintf(buf + n, cap - (size_t)n,
                      "--shard %s over more devices or processes (the weights, gradients and "
                      "optimizer state take %s per device); ",
                      stage, b);
    }
    human((double)x->acts, b, sizeof b);
    human((double)e->acts_recompute, r, sizeof r);
    if (!o->recompute && e->acts_recompute > 0 && e->acts_recompute < x->acts)
        n += snprintf(buf + n, cap - (size_t)n, "--recompute (activations %s instead of %s); ", r,
                      b);
    int64_t fits = batch_that_fits(e, o, room), B = o->batch_size,
            k = fits > 0 ? (B + fits - 1) / fits : 0;
    while (k > 0 && k <= B && B % k) k++; /* the fewest batches that make up the same step */
    /* a valid pair: a batch for every device, and --grad-accum within its range */
    if (fits < B && k > 0 && k <= B && B / k >= o->n_devs && k * o->grad_accum <= 4096 &&
        o->model_split <= 1)
        n += snprintf(buf + n, cap - (size_t)n,
                      "--batch-size %lld with --grad-accum %lld (the same %lld samples a step); ",
                      (long long)(B / k), (long long)(k * o->grad_accum),
                      (long long)(B * o->grad_accum));
    else if (e->samples > 1)
        n += snprintf(buf + n, cap - (size_t)n,
                      "a smaller --batch-size than %lld (activations %s on device 0); ",
                      (long long)o->batch_size, b);
    snprintf(buf + n, cap - (size_t)n,
             "more devices (--devices, or processes under mpirun), or a smaller model");
}

/* 0, or EXIT_RUNTIME naming the first GPU of the run whose share exceeds its memory. */
static int check_gpus(const estimate *e, const train_opts *o) {
    for (int d = 0; d < e->n_devs; d++) {
        int64_t total = 0;
        char dev[16], n[32], l[32], u[32], fix[1024];
        if (o->devs[d].type != TDM_CUDA) continue;
        if (tdm_device_memory_info(o->devs[d], &total, NULL))
            return task_error("--devices %s: %s", o->devices, tdm_last_error());
        double room = gpu_usable((double)total);
        if ((double)e->dev[d].total <= room) continue;
        human((double)e->dev[d].total, n, sizeof n), human((double)total, l, sizeof l);
        human(room, u, sizeof u);
        suggest(e, o, room, fix, sizeof fix);
        return task_error("--model %s (%lld parameters) with --batch-size %lld needs about %s on "
                          "%s, more than the %s it allows (its memory: %s, less a tenth for the "
                          "CUDA context, cuBLAS and NCCL); nothing was built. To fit, try: %s "
                          "(tandem train --dry-run prints the estimate)",
                          o->model, (long long)e->n_params, (long long)o->batch_size, n,
                          tdm_device_str(o->devs[d], dev), u, l, fix);
    }
    return 0;
}

int estimate_check(const estimate *e, const train_opts *o) {
    const char *what;
    double limit = memory_limit(&what), need = host_total(e, o);
    if (need <= usable(limit)) return check_gpus(e, o);
    char n[32], l[32], u[32], p[32], a[32], fix[1024];
    const estimate_device *x = &e->dev[0];
    human(need, n, sizeof n), human(limit, l, sizeof l), human(usable(limit), u, sizeof u);
    human((double)(x->params + x->grads + x->optim), p, sizeof p);
    human((double)x->acts, a, sizeof a);
    suggest(e, o, usable(limit), fix, sizeof fix);
    return task_error("--model %s (%lld parameters) with --batch-size %lld on --devices %s needs "
                      "about %s of memory (device 0: %s of weights, gradients and optimizer "
                      "state, %s of activations), more than the %s this machine allows (%s: "
                      "%s, less a quarter kept for what the estimate leaves out); nothing was "
                      "built. To fit, try: %s (tandem train --dry-run prints the estimate)",
                      o->model, (long long)e->n_params, (long long)o->batch_size, o->devices, n, p,
                      a, u, what, l, fix);
}
