/* The training loop of `tandem train`, for every task (task.h).
 *
 * The step loop keeps the host out of the device's way: each step's loss (and, for a task that
 * scores accuracy, its predictions) are copied into small device buffers, and the host reads
 * them back only every SYNC_STEPS steps or at a progress line or the end of the epoch: one
 * transfer per 16 steps instead of two per step on a GPU; on the CPU it costs nothing either
 * way. A non-finite loss is therefore noticed up to SYNC_STEPS-1 steps late, but reported with
 * its exact epoch and step. Under mpirun the chunks shrink to SYNC_SECONDS of steps, since the
 * processes agree on a stop only there. With several devices (DataParallel) or a pipeline the
 * replicas write losses and predictions to the host themselves.
 *
 * Gradient accumulation (--grad-accum K): an optimizer step takes K loader batches; each
 * batch's loss is divided by K so the gradients add up to their mean, devices and processes
 * exchange gradients once, at the step's last batch; a step's loss is the mean of its
 * batches'. Steps per epoch = batches per epoch / K (a remainder is not trained on).
 */
#include "trainer.h"

#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "estimate.h"
#include "straggler.h"
#include "trainer_debug.h"
#include "trainer_state.h"

static int64_t count_correct(const int64_t *pred, const int64_t *label, int64_t n) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) c += pred[i] == label[i];
    return c;
}

/* ---- setting up ------------------------------------------------------------------------- */

/* --workers, or by default 2, or 0 where every core runs a device (data parallel on as many CPU
 * devices as cores) and a batch only copies samples held in memory (no image to decode, no
 * transform): a worker then runs only by preempting a device. The MLP on cpu:0,cpu:1 (2
 * cores) is faster with the training thread building each batch of 64 than with 2 workers
 * (bench/RESULTS.md, "Issue 15: two CPU devices against one, the MLP again", "Figures behind the
 * code"). */
static int loader_workers(const trainer *tr) {
    const train_opts *o = tr->o;
    if (o->workers >= 0) return (int)o->workers;
    bool cores_taken =
        o->n_devs > 1 && o->devs[0].type == TDM_CPU && o->n_devs >= tdm_device_count(TDM_CPU);
    bool copies = !tr->task->train_tf && !tr->task->train->ops->get_image;
    return cores_taken && copies ? 0 : 2;
}

/* The loaders' options: lo for the training split, eo for the test split (when there is one). */
static void loader_opts(trainer *tr, tdm_loader_opts *lo, tdm_loader_opts *eo) {
    const train_opts *o = tr->o;
    tr->workers = loader_workers(tr);
    *lo = tdm_loader_defaults(o->batch_size);
    if (tr->g) { /* DistributedSampler: rank r's rows of each global batch are r, r+N, ... */
        /* --tensor-parallel: the processes of a tensor-parallel group share one dp row's */
        int share = train_procs_per_row(o);
        lo->rank = tdm_group_rank(tr->g) / share;
        lo->world_size = tdm_group_size(tr->g) / share;
        lo->batch_size = o->batch_size / lo->world_size;
    }
    lo->shuffle = true;
    lo->seed = (uint64_t)o->seed;
    lo->workers = tr->workers;
    lo->drop_last = tr->task->drop_last;
    lo->transform = tr->task->train_tf;
    /* one GPU: batches built in pinned memory and uploaded ahead of the step that needs them
     * (several devices and pipelines split host batches) */
    if (o->n_devs == 1 && o->model_split <= 1) lo->device = tr->dev;
    *eo = tdm_loader_defaults(EVAL_BATCH);
    eo->workers = tr->workers;
    eo->device = lo->device;
    eo->seed = lo->seed; /* a random step in the test transform draws the same every epoch */
    eo->transform = tr->task->test_tf;
}

static int make_loaders(trainer *tr) {
    const train_opts *o = tr->o;
    tdm_loader_opts lo, eo;
    loader_opts(tr, &lo, &eo);
    if (!(tr->train_l = tdm_loader_new(tr->task->train, &lo)))
        return task_error("training loader: %s", tdm_last_error());
    int64_t batches = tdm_loader_batches(tr->train_l);
    if (batches < 1)
        return task_error("--data '%s' holds %lld samples, fewer than one batch of %lld", o->data,
                          (long long)tr->task->train->n, (long long)o->batch_size);
    tr->steps_per_epoch = batches / tr->accum;
    if (tr->steps_per_epoch < 1)
        return task_error("--grad-accum %lld is more than the %lld batches of an epoch",
                          (long long)tr->accum, (long long)batches);
    if (!tr->task->test) return 0;
    if (!(tr->test_l = tdm_loader_new(tr->task->test, &eo)))
        return task_error("test loader: %s", tdm_last_error());
    return 0;
}

/* Before the model is built: what the run needs per device, printed (--dry-run) or checked
 * against this machine's memory (estimate.h). */
static int estimate_memory(trainer *tr) {
    const train_opts *o = tr->o;
    tdm_loader_opts lo, eo;
    loader_opts(tr, &lo, &eo);
    estimate e;
    int rc = estimate_make(o, tr->task, tr->g ? tdm_group_size(tr->g) : 1, &lo,
                           tr->task->test ? &eo : NULL, &e);
    if (!rc && o->dry_run && !tr->silent) estimate_print(&e, o, stdout);
    return rc || o->dry_run ? rc : estimate_check(&e, o);
}

/* The strategy (tandem/strategy.h): a pipeline for --model-split, DataParallel for several
 * devices (also one GPU per MPI process, whose NCCL group spans the processes), DDP for one CPU
 * device per process under mpirun, else the one device; each makes its optimizers. */
static int make_strategy(trainer *tr) {
    const train_opts *o = tr->o;
    task *t = tr->task;
    bool gpu_procs = tr->g && tr->dev.type == TDM_CUDA;
    /* before replicas and stages are cloned from the model: they keep it */
    if (o->recompute && tdm_model_set_recompute(t->model, true))
        return task_error("--recompute: %s", tdm_last_error());
    if (!(tr->ps = tdm_module_parameters(t->model)))
        return task_error("model %s: %s", o->model, tdm_last_error());
    const char *what = "optimizer";
    int64_t ctx = t->sizes.gpt.context; /* sequence parallelism splits every window */
    if (o->tensor_parallel > 1 && ctx % o->tensor_parallel)
        return task_error("--tensor-parallel %lld splits each window's tokens between the "
                          "devices (sequence parallelism): --context %lld does not split "
                          "into %lld",
                          (long long)o->tensor_parallel, (long long)ctx,
                          (long long)o->tensor_parallel);
    if (o->model_split > 1) {
        tdm_pipe_opts po = tdm_pipe_defaults((int)o->model_split, (int)o->micro_batches);
        po.schedule = strcmp(o->pipe_schedule, "gpipe") == 0 ? TDM_PIPE_GPIPE : TDM_PIPE_1F1B;
        po.tp = (int)o->tensor_parallel; /* 3-D: each stage split over tp devices */
        po.parallelize = t->parallelize_stage, po.parallelize_arg = t->model;
        po.replicas = o->n_devs / (int)(o->model_split * o->tensor_parallel);
        po.devices = o->devices;
        what = "pipeline";
        tdm_pipe_tie tie; /* a GPT: its embeddings' and head's copies of wte */
        tdm_module *view = t->pipeline_model ? t->pipeline_model(t->model, &tie) : NULL;
        if (t->pipeline_model && !view) return task_error("pipeline: %s", tdm_last_error());
        po.ties = view ? &tie : NULL, po.n_ties = view ? 1 : 0;
        tr->st = tdm_strategy_pipeline_view(t->model, view, t->from_pipeline_model,
                                            t->to_pipeline_model, &po, t->optimizer, (void *)o);
    } else if (o->tensor_parallel > 1) {
        tdm_tp_strategy_opts to = {.tp = (int)o->tensor_parallel,
                                   .parallelize = t->parallelize,
                                   .whole_output = t->whole_output};
        what = "--tensor-parallel";
        to.procs = tr->g; /* under mpirun: the processes' devices are the mesh's ranks */
        tr->st = tdm_strategy_tensor_parallel(t->model, o->devs, o->n_devs, &to, t->optimizer,
                                              (void *)o);
    } else if (o->n_devs > 1 || gpu_procs) {
        what = "data parallel";
        tr->st = tdm_strategy_data_parallel(t->model, o->devs, o->n_devs, tr->g, t->optimizer,
                                            (void *)o);
    } else if (tr->g) { /* rank 0's initial weights go to every process */
        tdm_ddp_opts dop = tdm_ddp_defaults();
        dop.bucket_cap_bytes = o->bucket_cap << 20;
        /* Lightning's bf16-mixed on FSDP: the gathers move bf16 (FSDP2's param_dtype) */
        tr->param_bf16 = !strcmp(o->shard, "parameters") && !strcmp(o->precision, "bf16");
        dop.param_dtype = tr->param_bf16 ? TDM_BF16 : TDM_F32;
        what = "ddp";
        tr->st = tdm_strategy_distributed(t->model, tr->g, &dop, t->optimizer, (void *)o);
    } else {
        tr->st = tdm_strategy_one_device(t->model, t->optimizer, (void *)o);
    }
    if (!tr->st) return task_error("%s: %s", what, tdm_last_error());
    if (tdm_strategy_set_clip_grad_norm(tr->st, (float)o->clip))
        return task_error("--clip-grad: %s", tdm_last_error());
    tdm_dtype dt = !strcmp(o->precision, "bf16")   ? TDM_BF16
                   : !strcmp(o->precision, "fp16") ? TDM_F16
                                                   : TDM_F32;
    if (tdm_strategy_set_precision(tr->st, dt))
        return task_error("--precision %s: %s", o->precision, tdm_last_error());
    /* two eager steps first: the optimizer's state made, the allocator's cache filled */
    if (o->cuda_graphs && tdm_strategy_set_graphs(tr->st, 2))
        return task_error("--cuda-graphs: %s", tdm_last_error());
    tr->opt = tdm_strategy_optim(tr->st, 0);
    tr->loss_on_caller = tdm_strategy_loss_on_caller(tr->st);
    return tr->opt ? 0 : task_error("optimizer: %s", tdm_last_error());
}

/* --shard optimizer|gradients|parameters: ZeRO stage 1, 2 or 3 over every device of every
 * process, before the resume, which then restores each rank's shard only (a sharded
 * checkpoint's pieces that cover it, or its range of a whole one), so that no rank ever holds
 * the whole optimizer state. The CPU devices of one process already hold the state once
 * (DataParallel's shared-memory update), except under stage 3, which shards it with the
 * parameters; one device alone has nobody to share it with. Stage 3's units are the model's blocks
 * or stages (tdm_model_units), else its layers (the children holding parameters). */
static int shard_optimizer(trainer *tr) {
    const train_opts *o = tr->o;
    tdm_shard_kind kind = strcmp(o->shard, "parameters") == 0  ? TDM_SHARD_PARAMETERS
                          : strcmp(o->shard, "gradients") == 0 ? TDM_SHARD_GRADIENTS
                          : strcmp(o->shard, "optimizer") == 0 ? TDM_SHARD_OPTIMIZER
                                                               : TDM_SHARD_NONE;
    if (kind != TDM_SHARD_NONE && tdm_strategy_set_shard(tr->st, kind, tdm_model_units))
        return task_error("--shard %s: %s", o->shard, tdm_last_error());
    /* after the sharding: stage 3 takes DataParallel's CPU devices off their shared memory.
     * DDP's, and DataParallel's across processes or GPUs; one device has nothing to reduce */
    if (strcmp(o->reduce_dtype, "fp32") != 0 && tdm_strategy_set_reduce_dtype(tr->st, TDM_BF16))
        return task_error("--reduce-dtype %s: %s", o->reduce_dtype, tdm_last_error());
    return 0;
}

static int make_schedule(trainer *tr) {
    const train_opts *o = tr->o;
    tdm_sched s = {.kind = TDM_SCHED_CONSTANT, .base_lr = (float)o->lr};
    if (strcmp(o->schedule, "step") == 0) {
        s.kind = TDM_SCHED_STEP;
        s.gamma = (float)o->gamma;
        s.step_size = o->step_size;
    } else if (strcmp(o->schedule, "cosine") == 0) {
        s.kind = TDM_SCHED_COSINE;
        s.warmup = o->warmup_steps;
        s.total = o->epochs * tr->steps_per_epoch;
        if (s.warmup > s.total)
            return train_usage_error("--warmup-steps %lld is more than the %lld steps of the run",
                                     (long long)s.warmup, (long long)s.total);
    } else if (strcmp(o->schedule, "linear") == 0) {
        s.kind = TDM_SCHED_LINEAR;
        s.warmup = o->warmup_steps;
        s.total = o->epochs * tr->steps_per_epoch;
        s.start_factor = 1.0f;
        s.end_factor = 0.0f;
        if (s.warmup >= s.total)
            return train_usage_error("--warmup-steps %lld leaves none of the %lld steps of the run "
                                     "to decay over",
                                     (long long)s.warmup, (long long)s.total);
    } else if (strcmp(o->schedule, "onecycle") == 0) {
        s.kind = TDM_SCHED_ONECYCLE; /* PyTorch's div_factor 25, final_div_factor 1e4 */
        s.total = o->epochs * tr->steps_per_epoch;
        s.pct_start = (float)o->pct_start;
    }
    /* a schedule the run's length makes invalid (an empty onecycle phase) */
    if (isnan(tdm_sched_lr(&s, 0)))
        return train_usage_error("--schedule %s: %s", o->schedule, tdm_last_error());
    tr->sched = s;
    return 0;
}

/* Buffers reused by every step and every chunk: nothing is allocated per step. A chunk holds
 * at most an epoch's samples and an evaluation batch at most the test set, so neither is sized
 * by the options alone (--batch-size 1000000 over 600 samples). */
static int make_buffers(trainer *tr) {
    const task *t = tr->task;
    int64_t slots = SYNC_STEPS * tr->accum, rows = slots * tr->o->batch_size;
    int64_t eval = t->test && t->test->n < EVAL_BATCH ? t->test->n : EVAL_BATCH;
    if (rows > t->train->n) rows = t->train->n;
    int64_t host = rows > eval ? rows : eval;
    tr->loss_buf = tdm_zeros(TDM_SHAPE(slots), TDM_F32, tr->dev);
    tr->pred_buf = tr->task->accuracy ? tdm_zeros(TDM_SHAPE(rows), TDM_I64, tr->dev) : NULL;
    tr->loss_host = malloc(sizeof(float) * (size_t)slots);
    tr->time_host = malloc(sizeof(double) * SYNC_STEPS);
    /* under mpirun the first chunk measures a step (SYNC_SECONDS) */
    tr->chunk_cap = tr->g && tdm_group_size(tr->g) > 1 ? 1 : SYNC_STEPS;
    tr->lr_host = malloc(sizeof(double) * SYNC_STEPS);
    tr->size_host = malloc(sizeof(int64_t) * SYNC_STEPS);
    tr->pred_host = malloc(sizeof(int64_t) * (size_t)host);
    tr->label_host = malloc(sizeof(int64_t) * (size_t)host);
    if (tr->o->cuda_graphs) {
        tr->graph_loss = tdm_zeros(TDM_SHAPE(1), TDM_F32, tr->dev);
        tr->graph_pred =
            tr->task->accuracy ? tdm_zeros(TDM_SHAPE(tr->o->batch_size), TDM_I64, tr->dev) : NULL;
        if (!tr->graph_loss || (tr->task->accuracy && !tr->graph_pred))
            return task_error("step buffers: %s", tdm_last_error());
    }
    if (!tr->loss_buf || (tr->task->accuracy && !tr->pred_buf))
        return task_error("step buffers: %s", tdm_last_error());
    if (!tr->loss_host || !tr->time_host || !tr->lr_host || !tr->size_host || !tr->pred_host ||
        !tr->label_host)
        return task_error("out of memory for step buffers");
    return 0;
}

/* ---- one step --------------------------------------------------------------------------- */

/* Whether s counts optimizer steps (else epochs: constant, step). */
static bool per_step(const tdm_sched *s) {
    return s->kind == TDM_SCHED_COSINE || s->kind == TDM_SCHED_LINEAR ||
           s->kind == TDM_SCHED_ONECYCLE;
}

/* The schedule's learning rate at `at` on every replica's (every stage's) optimizer. */
static void apply_lr(trainer *tr, int64_t at) {
    tdm_strategy_set_lr(tr->st, tdm_sched_lr(&tr->sched, at));
}

/* Where the current batch's loss [1] and predictions [n] go on the device: the chunk's slots,
 * or under --cuda-graphs the step's fixed places (graph_slots copies them over). */
static tdm_tensor *loss_slot(trainer *tr) {
    int64_t k = tr->chunk_steps * tr->accum + tr->micro;
    return tr->graph_loss ? tr->graph_loss : tdm_slice(tr->loss_buf, 0, k, k + 1, 1);
}
static tdm_tensor *pred_slot(trainer *tr, int64_t n) {
    int64_t off = tr->graph_pred ? 0 : tr->chunk_samples;
    return tdm_slice(tr->graph_pred ? tr->graph_pred : tr->pred_buf, 0, off, off + n, 1);
}

/* Copies a batch's loss and predictions into their device buffers (no host read). */
static int record_on_device(trainer *tr, tdm_tensor *out, tdm_tensor *loss) {
    int rc = tdm_copy_(loss_slot(tr), tdm_reshape(loss, TDM_SHAPE(1)));
    tdm_tensor *pred = NULL;
    if (!rc && tr->task->accuracy)
        rc = tdm_max(out, 1, false, &pred) ? tdm_copy_(pred_slot(tr, out->shape[0]), pred) : -1;
    return rc;
}

/* --cuda-graphs: the step's loss and n predictions from their fixed places into the chunk's
 * slots; the recording's failure, if any, said once. */
static int graph_slots(trainer *tr, int64_t n) {
    const char *why = NULL;
    tdm_strategy_graph_replays(tr->st, &why);
    if (why && !tr->graph_noted)
        fprintf(stderr, "tandem train: --cuda-graphs: %s; the steps run eagerly\n", why);
    tr->graph_noted |= why != NULL;
    int64_t k = tr->chunk_steps * tr->accum + tr->micro, off = tr->chunk_samples;
    int rc = tdm_copy_(tdm_slice(tr->loss_buf, 0, k, k + 1, 1), tr->graph_loss);
    if (!rc && tr->graph_pred)
        rc = tdm_copy_(tdm_slice(tr->pred_buf, 0, off, off + n, 1),
                       tdm_slice(tr->graph_pred, 0, 0, n, 1));
    return rc;
}

/* The step's loss, a tdm_loss_fn: the task's mean loss divided by the accumulation count. Its
 * predictions (and, on this thread, its loss) are recorded: on this thread in the chunk's device
 * buffers, read back every SYNC_STEPS steps; on the replicas' (or the last stage's) threads
 * straight into the host chunk at their rows (the step returns the loss there). */
static tdm_tensor *step_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    trainer *tr = arg;
    tdm_module *part = tr->task->loss_of ? tdm_strategy_loss_module() : NULL; /* split model */
    tdm_tensor *loss = part ? tr->task->loss_of(part, out, target) : tr->task->loss(out, target);
    tdm_tensor *pred = NULL;
    tdm_tensor *scaled =
        loss && tr->accum > 1 ? tdm_mul_scalar(loss, 1.0f / (float)tr->accum) : loss;
    if (!scaled || (!tr->task->accuracy && !tr->loss_on_caller)) return scaled;
    bool prev = tdm_set_grad_enabled(false);
    int rc;
    if (tr->loss_on_caller)
        rc = record_on_device(tr, out, loss);
    else
        rc = tdm_max(out, 1, false, &pred)
                 ? tdm_to_host(pred, tr->pred_host + tr->chunk_samples + row0,
                               sizeof(int64_t) * (size_t)out->shape[0])
                 : -1;
    tdm_set_grad_enabled(prev);
    return rc ? NULL : scaled;
}

/* Feeds batch b to the current step (the strategy's step at the step's last batch, else its
 * accumulation); *done says whether it was the step's last. */
static int train_batch(trainer *tr, const tdm_batch *b, bool *done) {
    bool last = tr->micro + 1 == tr->accum;
    float loss = NAN, *host = tr->loss_on_caller ? NULL : &loss;
    int rc = last ? tdm_strategy_step(tr->st, b->x, b->y, step_loss, tr, host)
                  : tdm_strategy_accumulate(tr->st, b->x, b->y, step_loss, tr, host);
    if (!rc && tr->graph_loss && !host) {
        tdm_scope_begin();
        rc = graph_slots(tr, b->size);
        tdm_scope_end();
    }
    if (rc) return task_error("training step: %s", tdm_last_error());
    if (host) tr->loss_host[tr->chunk_steps * tr->accum + tr->micro] = loss * (float)tr->accum;
    if (tr->task->accuracy)
        memcpy(tr->label_host + tr->chunk_samples, b->y_host, sizeof(int64_t) * (size_t)b->size);
    tr->chunk_samples += b->size;
    tr->size_host[tr->chunk_steps] = (tr->micro ? tr->size_host[tr->chunk_steps] : 0) + b->size;
    tr->micro = last ? 0 : tr->micro + 1;
    *done = last;
    return 0;
}

/* ---- the chunk, the window and the epoch ------------------------------------------------- */

/* Data parallelism pays when each device's share of a step is large next to what a step
 * spends synchronising the devices (bench/RESULTS.md, "Figures behind the code"; "DataParallel step
 * latency": the MLP, 32 MFLOP of products per device per step, gains less on 2 devices than the
 * CNN, several hundred). The first step's products on this thread are device 0's share: below the
 * threshold, say so. Against one device that has the other cores for its products
 * (tdm_gemm_threads_for_devices) the gain is smaller still (bench/RESULTS.md, "Two CPU
 * devices against one"). */
#define SMALL_DEVICE_WORK_FLOPS 100e6

static void note_small_work(trainer *tr, uint64_t flops) {
    int procs = tr->g ? tdm_group_size(tr->g) : 1, n = tr->o->n_devs * procs;
    /* tdm_gemm_flops counts the fp32 GEMM only: a bf16 run's products are not in it */
    /* a pipeline's and tensor parallelism's products all run on the devices' own threads */
    if (tr->o->model_split > 1 || tr->o->tensor_parallel > 1 || n < 2 || tr->dev.type != TDM_CPU ||
        tr->o->quiet || (double)flops >= SMALL_DEVICE_WORK_FLOPS ||
        strcmp(tr->o->precision, "fp32") != 0)
        return;
    progress_clear(&tr->prog);
    printf("note      %.0f MFLOP of matrix products per device per step: little next to the "
           "devices' synchronisation; expect well under %dx one device's speed (a larger "
           "--batch-size does better)\n",
           (double)flops / 1e6, n);
    fflush(stdout);
}

/* A progress line's window ends: its mean loss (over every process) printed, the outputs
 * flushed. Every process comes here at the same steps. */
static int end_window(trainer *tr, int64_t step, double now) {
    int procs = tr->g ? tdm_group_size(tr->g) : 1;
    double dt = now - tr->win_t0, n = (double)tr->win_steps;
    if (!tdm_stop_requested()) /* a stopping mpirun no longer reads: a write could block */
        progress_line(
            &tr->prog, step, tr->win_loss / procs / n, tdm_optim_lr(tr->opt), 1e3 * dt / n,
            dt > 0 ? (double)tr->win_samples * tr->task->units_per_sample / dt : NAN, now);
    tr->win_loss = 0, tr->win_steps = 0, tr->win_samples = 0, tr->win_t0 = now;
    return sinks_flush(&tr->out);
}

/* A process's stop signal as a count that a sum over procs processes keeps apart: SIGUSR1 1,
 * SIGINT procs + 1, SIGTERM and any other (procs + 1)^2, none 0. */
static double stop_code(int sig, int procs) {
    const double p1 = procs + 1.0;
    return sig == 0 ? 0 : sig == SIGUSR1 ? 1 : sig == SIGINT ? p1 : p1 * p1;
}

/* The most urgent signal in such a sum (SIGTERM, then SIGINT, then SIGUSR1), or 0. */
static int stop_decode(double sum, int procs) {
    const double p1 = procs + 1.0;
    return sum >= p1 * p1 ? SIGTERM : sum >= p1 ? SIGINT : sum >= 1 ? SIGUSR1 : 0;
}

/* Reads the chunk's losses and predictions back, checks them, records each step, and updates
 * the epoch's totals, the windows and the progress display. step: steps done this epoch. */
static int sync_chunk(trainer *tr, int epoch, int64_t step) {
    int k = tr->chunk_steps;
    int64_t slots = k * tr->accum;
    bool on_host = !tr->loss_on_caller; /* the replicas or stages wrote them there */
    int rc = on_host || k == 0 ? TDM_OK : tdm_scope_begin();
    if (!rc && !on_host && k)
        rc = tdm_to_host(tdm_slice(tr->loss_buf, 0, 0, slots, 1), tr->loss_host,
                         sizeof(float) * (size_t)slots);
    if (!rc && !on_host && k && tr->task->accuracy)
        rc = tdm_to_host(tdm_slice(tr->pred_buf, 0, 0, tr->chunk_samples, 1), tr->pred_host,
                         sizeof(int64_t) * (size_t)tr->chunk_samples);
    if (!on_host && k) tdm_scope_end();
    if (rc) return task_error("reading losses back: %s", tdm_last_error());
    /* each step's loss and samples over every process (the processes' shares are equal): what
     * the sinks record, the divergence check and the progress lines read, the same on every
     * process; the epoch's sums stay this process's (summed over the processes at its end).
     * One exchange a chunk: losses, samples, the chunk's seconds and the stop signals. */
    double global[TOTALS_CAP];
    for (int i = 0; i < k; i++) {
        global[i] = 0;
        for (int64_t m = 0; m < tr->accum; m++) global[i] += tr->loss_host[i * tr->accum + m];
        global[i] /= (double)tr->accum;
        global[k + i] = tr->counts ? (double)tr->size_host[i] : 0;
    }
    double local[SYNC_STEPS];
    memcpy(local, global, sizeof(double) * (size_t)k);
    int procs = tr->g ? tdm_group_size(tr->g) : 1;
    double *seconds = &global[2 * k], *stops = &global[2 * k + 1];
    *seconds = k ? tr->time_host[k - 1] - tr->t_last : 0;
    *stops = stop_code(tdm_stop_requested(), procs);
    if (procs > 1 && k && trainer_sum_over_processes(tr, global, 2 * k + 2, "loss read-back"))
        return EXIT_RUNTIME;
    tr->stop_agreed = procs > 1 && k ? stop_decode(*stops, procs) : 0;
    if (procs > 1 && k && *seconds > 0) { /* the same sum on every process: the same cap */
        double steps = SYNC_SECONDS * k * procs / *seconds;
        tr->chunk_cap = steps >= SYNC_STEPS ? SYNC_STEPS : steps < 1 ? 1 : (int)steps;
    }
    for (int i = 0; i < k; i++) {
        int64_t s = step - k + i + 1;
        double loss = global[i] / procs;
        if (!isfinite(loss))
            return task_error("the loss is %s at epoch %d, step %lld (lr %g): training "
                              "diverged; try a lower --lr",
                              isnan(loss) ? "nan" : "infinite", epoch, (long long)s,
                              tr->lr_host[i]);
        double dt = tr->time_host[i] - (i ? tr->time_host[i - 1] : tr->t_last);
        double units = global[k + i] * (double)tr->task->units_per_sample; /* every process's */
        sinks_step(&tr->out, &(step_record){epoch, s, tr->global_step - k + i + 1, loss,
                                            tr->lr_host[i], dt > 0 ? units / dt : NAN});
        if (tr->counts) tr->loss_sum += local[i] * (double)tr->size_host[i];
        tr->win_loss += global[i], tr->win_steps++, tr->win_samples += (int64_t)global[k + i];
        if ((s % tr->every == 0 || s == tr->steps_planned) && end_window(tr, s, tr->time_host[i]))
            return EXIT_RUNTIME;
    }
    if (tr->task->accuracy && tr->counts)
        tr->correct += count_correct(tr->pred_host, tr->label_host, tr->chunk_samples);
    if (tr->counts) tr->samples += tr->chunk_samples;
    if (k) tr->t_last = tr->time_host[k - 1];
    tr->chunk_steps = 0;
    tr->chunk_samples = 0;
    progress_update(&tr->prog, step, tr->loss_sum / (double)tr->samples,
                    (double)(tr->samples * tr->task->units_per_sample), tr->t_last);
    return 0;
}

/* Whether to read back after this step: a full chunk or a window's end. */
static bool sync_due(const trainer *tr, int64_t step) {
    return tr->chunk_steps >= tr->chunk_cap || step % tr->every == 0 || step >= tr->steps_planned;
}

/* The stop signal the run obeys after this step, or 0. One process looks after every step;
 * under MPI the processes agree at the steps where they all read back (synced: the read-back
 * carried every process's signal), so that every one stops at the same step, also when the
 * signal reached only some; those take the signal the others had (the most urgent of them),
 * so that every process names the same one, also when its own copy arrives late. */
static int stop_signal(trainer *tr, bool synced) {
    int sig = tdm_stop_requested();
    if (!tr->g || tdm_group_size(tr->g) == 1) return sig;
    if (!synced || !tr->stop_agreed) return 0;
    if (!sig) tdm_stop_request(tr->stop_agreed), sig = tdm_stop_requested();
    return sig;
}

/* After a step: a periodic checkpoint, or a stop (--max-steps, or SIGTERM / SIGINT) with its
 * checkpoint. Reads the chunk back first so the saved epoch totals are complete. */
static int after_step(trainer *tr, int epoch, int64_t step, bool synced) {
    const train_opts *o = tr->o;
    if (o->check_replicas > 0 && tr->global_step % o->check_replicas == 0 &&
        tdm_strategy_check_replicas(tr->st, tr->g))
        return task_error("--check-replicas: after step %lld: %s", (long long)tr->global_step,
                          tdm_last_error());
    int sig = stop_signal(tr, synced);
    bool stop = sig || (o->max_steps > 0 && tr->global_step >= o->max_steps);
    bool every = o->checkpoint_every > 0 && tr->global_step % o->checkpoint_every == 0;
    if (!stop && !every) return 0;
    if (sync_chunk(tr, epoch, step) || trainer_save_checkpoint(tr)) return EXIT_RUNTIME;
    tr->stopped = stop;
    tr->stop_signal = sig;
    return 0;
}

/* Each device's peak memory since the epoch began (tdm_memory_stats), into tr->peak: at the
 * epoch's start (start: a new peak from what is allocated now) and after every step. */
static void note_peaks(trainer *tr, bool start) {
    for (int d = 0; d < tr->o->n_devs; d++) {
        if (start) tdm_memory_reset_peak(tr->o->devs[d]);
        int64_t p = tdm_memory_stats_get(tr->o->devs[d]).peak_allocated;
        tr->peak[d] = start || p > tr->peak[d] ? p : tr->peak[d];
    }
}

/* Under mpirun, at an epoch's end, in one all-gather: tot[0..4) summed over the processes in
 * rank order, each process's training seconds of the epoch and its seconds waiting in
 * collectives into tr->rank_seconds and tr->rank_wait_s, and the process whose compute
 * (seconds less waits) is well above the median's into *straggler (-1: none): the one the
 * others wait for. */
static int epoch_over_processes(trainer *tr, double tot[4], double secs, int *straggler) {
    int procs = tdm_group_size(tr->g);
    double mine[6] = {tot[0], tot[1], tot[2],
                      tot[3], secs,   tdm_collective_wait_seconds() - tr->coll_wait0};
    double *all = malloc(sizeof *all * 6 * (size_t)procs);
    if (!tr->rank_seconds) tr->rank_seconds = calloc((size_t)procs, sizeof(double));
    if (!tr->rank_wait_s) tr->rank_wait_s = calloc((size_t)procs, sizeof(double));
    if (!all || !tr->rank_seconds || !tr->rank_wait_s) {
        free(all);
        return task_error("the processes' totals: out of memory");
    }
    int rc = trainer_gather_over_processes(tr, mine, 6, all, "epoch's totals and times");
    for (int i = 0; !rc && i < 4; i++) {
        tot[i] = 0;
        for (int r = 0; r < procs; r++) tot[i] += all[6 * r + i];
    }
    for (int r = 0; !rc && r < procs; r++)
        tr->rank_seconds[r] = all[6 * r + 4], tr->rank_wait_s[r] = all[6 * r + 5];
    *straggler = rc ? -1 : straggler_of(tr->rank_seconds, tr->rank_wait_s, procs);
    free(all);
    return rc;
}

/* Starts epoch `epoch` (from 1), after `skip` of its steps done before a resume. */
static int begin_epoch(trainer *tr, int epoch, int64_t skip) {
    const train_opts *o = tr->o;
    if (tdm_loader_start_epoch_at(tr->train_l, epoch - 1, skip * tr->accum) != TDM_OK)
        return task_error("training loader: %s", tdm_last_error());
    /* the constant and step schedules at the epoch's start (a resumed run's --lr included);
     * the others move every step */
    if (!per_step(&tr->sched)) apply_lr(tr, epoch - 1);
    tdm_module_train(tr->task->model, true);
    tr->loss_sum = skip ? tr->resume_loss_sum : 0;
    tr->correct = skip ? tr->resume_correct : 0;
    tr->samples = tr->samples_before = skip ? tr->resume_samples : 0;
    tr->steps_planned = tr->steps_per_epoch;
    if (o->max_steps > 0 && skip + o->max_steps - tr->global_step < tr->steps_planned)
        tr->steps_planned = skip + o->max_steps - tr->global_step;
    int64_t left = tr->steps_planned - skip;
    tr->every = o->print_every > 0 ? o->print_every : left >= 10 ? (left + 9) / 10 : 1;
    tr->t_last = tr->win_t0 = progress_now();
    tr->win_loss = 0, tr->win_steps = 0, tr->win_samples = 0;
    note_peaks(tr, true);
    progress_epoch_begin(&tr->prog, epoch, (int)o->epochs, tr->steps_planned, tr->t_last);
    return 0;
}

/* train_step's "the epoch's data ran out before the step": apart from every exit status, so
 * that a batch that fails to load (EXIT_RUNTIME, 1) is never taken for the end of the data */
#define DATA_ENDED (-1)

/* One step's batches: 0 after a step, DATA_ENDED when the epoch's data ran out first, or
 * EXIT_RUNTIME after printing the error (a batch that failed to load, a failed step). */
static int train_step(trainer *tr, bool first) {
    bool done = false;
    while (!done) {
        tdm_batch b;
        tdm_trace_begin("wait for data");
        int r = tdm_loader_next(tr->train_l, &b);
        tdm_trace_end();
        if (r < 0) return task_error("loading a training batch: %s", tdm_last_error());
        if (r == 0) return DATA_ENDED;
        if (tr->micro == 0 && per_step(&tr->sched)) apply_lr(tr, tr->global_step);
        tr->lr_host[tr->chunk_steps] = tdm_optim_lr(tr->opt);
        uint64_t flops = tdm_gemm_flops();
        tdm_trace_begin("step");
        int rc = train_batch(tr, &b, &done);
        tdm_trace_end();
        if (rc) return rc;
        if (first) note_small_work(tr, tdm_gemm_flops() - flops), first = false;
    }
    tr->time_host[tr->chunk_steps++] = progress_now();
    tr->global_step++;
    note_peaks(tr, false);
    return 0;
}

static int train_epoch(trainer *tr, int epoch, epoch_stats *e) {
    int64_t skip = tr->resume_step; /* steps of this epoch done before a resume */
    tr->resume_step = 0;
    if (begin_epoch(tr, epoch, skip)) return EXIT_RUNTIME;
    double wait0 = tdm_loader_wait_seconds(tr->train_l), t0 = tr->t_last;
    tr->coll_wait0 = tdm_collective_wait_seconds();
    int64_t step = skip;
    while (!tr->stopped && step < tr->steps_planned) {
        int rc = train_step(tr, step == skip && epoch == tr->start_epoch);
        if (rc == DATA_ENDED) break;
        if (rc) return rc;
        step++;
        bool synced = sync_due(tr, step);
        if (synced && sync_chunk(tr, epoch, step)) return EXIT_RUNTIME;
        if (after_step(tr, epoch, step, synced)) return EXIT_RUNTIME;
    }
    if (sync_chunk(tr, epoch, step)) return EXIT_RUNTIME;
    /* the totals, and the samples trained here: a resumed epoch's speed is this process's */
    double tot[4] = {tr->loss_sum, (double)tr->correct, (double)tr->samples,
                     (double)(tr->samples - tr->samples_before)};
    double secs = progress_now() - t0;
    int straggler = -1;
    if (tr->g && !tr->stopped && epoch_over_processes(tr, tot, secs, &straggler))
        return EXIT_RUNTIME;
    double n = tot[2], here = tot[3];
    *e = (epoch_stats){
        .epoch = epoch,
        .train_loss = n ? tot[0] / n : NAN,
        .train_acc = n && tr->task->accuracy ? tot[1] / n : NAN,
        .test_loss = NAN,
        .test_acc = NAN,
        .seconds = secs,
        .img_s = secs > 0 && here > 0 ? here * (double)tr->task->units_per_sample / secs : NAN,
        .loader_wait_s = tdm_loader_wait_seconds(tr->train_l) - wait0,
        .lr = tdm_optim_lr(tr->opt),
        .peak_bytes = tr->peak,
        .n_devices = tr->o->n_devs,
        .n_ranks = tr->g && !tr->stopped ? tdm_group_size(tr->g) : 0,
        .rank_seconds = tr->rank_seconds,
        .rank_wait_s = tr->rank_wait_s,
        .straggler = straggler};
    return 0;
}

/* The model's output for x: split over the devices when there are several (DataParallel's
 * forward), else on the first one. In the caller's scope; NULL and an error on failure. */
static tdm_tensor *model_forward(trainer *tr, tdm_tensor *x) {
    tdm_tensor *out = NULL;
    return tdm_strategy_forward(tr->st, x, &out) ? NULL : out;
}

/* The model's test logits for images x [N, C, H, W]; with --eval-flip, the mean of the logits
 * of x and of x flipped left-right (test-time augmentation). Tensors live in the caller's
 * scope; NULL and an error on failure. */
static tdm_tensor *eval_logits(trainer *tr, tdm_tensor *x) {
    tdm_tensor *out = model_forward(tr, x);
    if (!out || !tr->o->eval_flip) return out;
    if (x->ndim != 4) {
        task_error("--eval-flip: the test batch is %d-D, not images [N, C, H, W]", x->ndim);
        return NULL;
    }
    int64_t w = x->shape[3];
    tdm_tensor *rev = tdm_arange((double)(w - 1), -1.0, -1.0, TDM_I64, x->device);
    tdm_tensor *flipped = rev ? tdm_index_select(x, 3, rev) : NULL;
    tdm_tensor *out2 = flipped ? model_forward(tr, flipped) : NULL;
    return out2 ? tdm_mul_scalar(tdm_add(out, out2), 0.5f) : NULL;
}

/* Test loss and accuracy in eval mode, without autograd. */
static int evaluate(trainer *tr, epoch_stats *e) {
    double t0 = progress_now();
    /* a pipeline's trained stages back into the model that evaluates */
    if (tdm_strategy_sync_model(tr->st))
        return task_error("evaluation: the trained weights: %s", tdm_last_error());
    if (tdm_loader_start_epoch(tr->test_l, 0) != TDM_OK)
        return task_error("test loader: %s", tdm_last_error());
    tdm_module_train(tr->task->model, false);
    bool prev = tdm_set_grad_enabled(false);
    double loss_sum = 0;
    int64_t correct = 0, n = 0;
    int r, rc = 0;
    tdm_batch b;
    while (!rc && (r = tdm_loader_next(tr->test_l, &b)) != 0) {
        if (r < 0 || (rc = tdm_scope_begin()) != TDM_OK) {
            rc = -1;
            break;
        }
        tdm_tensor *x = b.x, *y = b.y, *pred = NULL;
        if (!tdm_device_equal(x->device, tr->dev)) {
            x = tdm_to_device(x, tr->dev);
            y = tdm_to_device(y, tr->dev);
        }
        tdm_tensor *out = eval_logits(tr, x);
        tdm_tensor *loss = out ? tr->task->loss(out, y) : NULL;
        float l = tdm_item(loss);
        if (!loss || isnan(l)) rc = -1;
        if (!rc && tr->task->accuracy)
            rc = tdm_max(out, 1, false, &pred)
                     ? tdm_to_host(pred, tr->pred_host, sizeof(int64_t) * (size_t)b.size)
                     : -1;
        tdm_scope_end();
        loss_sum += (double)l * (double)b.size;
        if (!rc && tr->task->accuracy) correct += count_correct(tr->pred_host, b.y_host, b.size);
        n += b.size;
    }
    tdm_set_grad_enabled(prev);
    tdm_module_train(tr->task->model, true);
    if (rc) {
        const char *why = tdm_last_error();
        return task_error("evaluation: %s", why && *why ? why : "the test loss is not a number");
    }
    e->test_loss = n ? loss_sum / (double)n : NAN;
    e->test_acc = n ? (double)correct / (double)n : NAN;
    e->eval_seconds = progress_now() - t0;
    return 0;
}

/* ---- the header, the epoch line, the run ----------------------------------------------- */

static void describe_optimizer(const train_opts *o, const task *t, char *buf, size_t cap) {
    int n = snprintf(buf, cap, "%s lr %g", o->optimizer, o->lr);
    if (strcmp(o->optimizer, "sgd") == 0 && o->momentum > 0)
        n += snprintf(buf + n, cap - (size_t)n, " momentum %g%s", o->momentum,
                      o->nesterov ? " (nesterov)" : "");
    if (o->weight_decay > 0)
        n += snprintf(buf + n, cap - (size_t)n, " weight decay %g%s", o->weight_decay,
                      t->row->task == TDM_TASK_TEXT || o->no_decay_1d ? " on matrices" : "");
    if (strcmp(o->schedule, "constant") != 0)
        n += snprintf(buf + n, cap - (size_t)n, ", %s schedule", o->schedule);
    if (o->label_smoothing > 0)
        n += snprintf(buf + n, cap - (size_t)n, ", label smoothing %g", o->label_smoothing);
    if (o->eval_flip) n += snprintf(buf + n, cap - (size_t)n, ", flip-averaged evaluation");
    if (o->clip > 0) snprintf(buf + n, cap - (size_t)n, ", gradient clipping at %g", o->clip);
}

static void print_devices(const trainer *tr) {
    const train_opts *o = tr->o;
    char dev[16];
    printf(" on %s", tdm_device_str(tr->dev, dev));
    for (int i = 1; i < o->n_devs; i++) printf(",%s", tdm_device_str(o->devs[i], dev));
    int procs = tr->g ? tdm_group_size(tr->g) : 1;
    if (procs > 1) printf(" in each of %d processes", procs);
    char how[512];
    tdm_strategy_describe(tr->st, o->batch_size, how, sizeof how);
    if (how[0]) printf(" (%s)", how);
}

/* --shard's line: rank 0's (replica 0's) optimizer state against the whole state, and under
 * --shard gradients its gradient shard against the whole gradient; under --shard parameters
 * the dtype the gathers move. */
static void print_sharding(const trainer *tr) {
    const train_opts *o = tr->o;
    tdm_strategy_memory m;
    tdm_strategy_memory_get(tr->st, &m);
    int ranks = o->n_devs * (tr->g ? tdm_group_size(tr->g) : 1);
    bool params = strcmp(o->shard, "parameters") == 0;
    bool grads = params || strcmp(o->shard, "gradients") == 0;
    if (o->model_split > 1) { /* each stage's optimizer over its replicas */
        int64_t replicas = o->n_devs / (o->model_split * o->tensor_parallel);
        printf("sharding  optimizer state: each pipeline stage's over its %lld replica%s (",
               (long long)replicas, replicas == 1 ? "" : "s");
        if (replicas > 1)
            printf("ZeRO stage 1: each device about 1/%lld of its stage's)\n", (long long)replicas);
        else
            printf("one replica: nobody to share it with)\n");
    } else if (o->tensor_parallel > 1) { /* each device its parts' state, or its shard of it */
        int64_t rows = ranks / o->tensor_parallel; /* of devices, or of processes */
        printf("sharding  optimizer state %lld bytes per device of %lld (its parts at tensor "
               "parallel %lld; %s)\n",
               (long long)m.state, (long long)m.state_whole, (long long)o->tensor_parallel,
               rows < 2 ? "one data-parallel row: nobody to share them with"
               : params ? "ZeRO stage 3 over the data-parallel rows, gradients and parts too"
               : grads  ? "ZeRO stage 2 over the data-parallel rows, gradients too"
                        : "ZeRO stage 1 over the data-parallel rows");
    } else if (tdm_strategy_state_split(tr->st)) {
        printf("sharding  optimizer state %lld bytes per rank of %lld", (long long)m.state,
               (long long)m.state_whole);
        if (grads)
            printf(", gradients%s %lld bytes per rank of %lld", params ? " and parameters" : "",
                   (long long)m.grads, (long long)m.grads_whole);
        printf(" (ZeRO stage %d over %d rank%s",
               params  ? 3
               : grads ? 2
                       : 1,
               ranks, ranks == 1 ? "" : "s");
        if (params)
            printf(tr->param_bf16 ? "; parameters gathered in bf16, as FSDP2's param_dtype"
                                  : "; parameters gathered in f32");
        printf(")\n");
    } else {
        printf("sharding  optimizer state %lld bytes, held once by %s\n", (long long)m.state_whole,
               o->n_devs > 1 ? "this process for its devices (their update is split already)"
                             : "the one device: nothing to shard");
    }
}

/* "precision bf16 (autocast, fp32 weights; native: AVX512_BF16)": the dtype of the forward's
 * products, and on a CPU whether it has bf16 instructions; without them the products convert
 * to fp32 (cpu_gemm_bf16.c), and bf16 is a little slower than fp32, which the line says once. */
static void print_precision(const trainer *tr) {
    const char *p = tr->o->precision;
    if (!strcmp(p, "fp32")) {
        printf("precision fp32\n");
        return;
    }
    printf("precision %s (autocast, fp32 weights%s", p, !strcmp(p, "fp16") ? ", loss scaling" : "");
    char how[128];
    if (tr->dev.type != TDM_CPU)
        printf(")\n");
    else if (progress_bf16_native(how, sizeof how))
        printf("; native: %s)\n", how);
    else
        printf("; emulated: %s: the products convert to fp32, so bf16 runs no faster than fp32 "
               "here)\n",
               how);
}

static void banner(const trainer *tr) {
    const train_opts *o = tr->o;
    char opt[256];
    describe_optimizer(o, tr->task, opt, sizeof opt);
    const train_recipe *r = o->recipe ? train_recipe_find(o->recipe) : NULL;
    if (r) {
        char args[1024];
        train_recipe_str(r, args, sizeof args);
        printf("recipe    %s: %s\n", r->name, args);
    }
    printf("model     %s, %lld parameters,", tr->task->model_desc, (long long)tr->ps->total);
    print_devices(tr);
    printf("\n");
    if (tr->dev.type == TDM_CPU) progress_print_compute(stdout);
    printf("data      %s: %s; batch %lld", o->data, tr->task->data_desc, (long long)o->batch_size);
    if (tr->accum > 1) printf(" x %lld accumulated", (long long)tr->accum);
    printf(", %lld steps per epoch, %d loader workers%s\n", (long long)tr->steps_per_epoch,
           tr->workers,
           tr->workers == 0 && o->workers < 0 ? " (every core runs a device: batches built "
                                                "between steps)"
                                              : "");
    if (tr->task->classes_desc[0]) printf("classes   %s\n", tr->task->classes_desc);
    if (tr->task->transform_desc[0]) printf("transform %s\n", tr->task->transform_desc);
    printf("optimizer %s\n", opt);
    print_precision(tr);
    if (strcmp(o->shard, "none") != 0) print_sharding(tr);
    fflush(stdout);
}

/* Appends "key":"v", (escaped) to buf. */
static void json_str(char *buf, size_t cap, const char *key, const char *v) {
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
    snprintf(buf + n, cap - n, "\",");
}

/* --log's first line: every option that shapes the run, and what it came to. */
static void write_config(trainer *tr) {
    const train_opts *o = tr->o;
    char f[2048] = "";
    json_str(f, sizeof f, "model", o->model);
    json_str(f, sizeof f, "data", o->data);
    json_str(f, sizeof f, "optimizer", o->optimizer);
    json_str(f, sizeof f, "schedule", o->schedule);
    json_str(f, sizeof f, "devices", o->devices);
    json_str(f, sizeof f, "denormals", o->denormals);
    json_str(f, sizeof f, "shard", o->shard);
    json_str(f, sizeof f, "precision", o->precision);
    json_str(f, sizeof f, "reduce_dtype", o->reduce_dtype);
    size_t n = strlen(f);
    snprintf(f + n, sizeof f - n,
             "\"lr\":%g,\"momentum\":%g,\"weight_decay\":%g,\"clip_grad\":%g,\"epochs\":%lld,"
             "\"batch_size\":%lld,\"grad_accum\":%lld,\"steps_per_epoch\":%lld,"
             "\"train_samples\":%lld,\"test_samples\":%lld,\"seed\":%lld,\"workers\":%lld,"
             "\"parameters\":%lld,\"pct_start\":%g,\"label_smoothing\":%g,\"nesterov\":%s,"
             "\"no_decay_1d\":%s,\"eval_flip\":%s,\"validation\":%lld,\"allow_tf32\":%s,"
             "\"cuda_graphs\":%s",
             o->lr, o->momentum, o->weight_decay, o->clip, (long long)o->epochs,
             (long long)o->batch_size, (long long)tr->accum, (long long)tr->steps_per_epoch,
             (long long)tr->task->train->n, (long long)(tr->task->test ? tr->task->test->n : 0),
             (long long)o->seed, (long long)tr->workers, (long long)tr->ps->total, o->pct_start,
             o->label_smoothing, o->nesterov ? "true" : "false", o->no_decay_1d ? "true" : "false",
             o->eval_flip ? "true" : "false", (long long)o->validation,
             o->allow_tf32 ? "true" : "false", o->cuda_graphs ? "true" : "false");
    sinks_config(&tr->out, f);
}

/* "  peak 12.3 MiB": the allocator's peak of the epoch, each device's when there are at most
 * four ("12.3 / 12.1 MiB"), else the largest. */
static void print_peaks(const epoch_stats *e) {
    int n = e->n_devices;
    int64_t most = 0;
    for (int d = 0; d < n; d++) most = e->peak_bytes[d] > most ? e->peak_bytes[d] : most;
    printf("  peak ");
    for (int d = 0; n <= 4 && d < n; d++)
        printf("%s%.1f", d ? " / " : "", (double)e->peak_bytes[d] / (1 << 20));
    if (n > 4) printf("%.1f", (double)most / (1 << 20));
    printf(" MiB%s", n > 4 ? " on the fullest device" : "");
}

static void print_epoch(const trainer *tr, const epoch_stats *e) {
    printf("epoch %d/%lld  train loss %.4f", e->epoch, (long long)tr->o->epochs, e->train_loss);
    if (tr->task->accuracy) printf(" acc %5.2f%%", 100 * e->train_acc);
    if (tr->task->test) printf("  test loss %.4f acc %5.2f%%", e->test_loss, 100 * e->test_acc);
    printf("  %.2f s", e->seconds);
    if (isnan(e->img_s)) { /* resumed after the epoch's last step: nothing trained here */
        printf("  (trained before the resume)\n");
        fflush(stdout);
        return;
    }
    printf("  %.0f %s/s  loader wait %.2f s", e->img_s, tr->task->unit, e->loader_wait_s);
    int devices = tr->o->n_devs * (tr->g ? tdm_group_size(tr->g) : 1);
    if (devices > 1) printf("  (%.0f %s/s per device)", e->img_s / devices, tr->task->unit);
    if (e->n_ranks > 1) { /* the processes' waits in collectives, and who was waited for */
        double lo = e->rank_wait_s[0], hi = lo;
        for (int r = 1; r < e->n_ranks; r++)
            lo = fmin(lo, e->rank_wait_s[r]), hi = fmax(hi, e->rank_wait_s[r]);
        printf("  collectives %.2f-%.2f s", lo, hi);
        if (e->straggler >= 0)
            printf(" (rank %d computed %.2f s, the others waited for it)", e->straggler,
                   e->rank_seconds[e->straggler] - e->rank_wait_s[e->straggler]);
    }
    print_peaks(e);
    printf("\n");
    fflush(stdout);
}

/* The outputs, with what the plot shows of the run. */
static int open_outputs(trainer *tr) {
    const train_opts *o = tr->o;
    char title[400], sub[320], opt[256];
    describe_optimizer(o, tr->task, opt, sizeof opt);
    snprintf(title, sizeof title, "%s: %s", tr->task->plot_title, opt);
    snprintf(sub, sizeof sub, "batch %lld, %lld train samples, seed %lld, %s",
             (long long)(o->batch_size * tr->accum), (long long)tr->task->train->n,
             (long long)o->seed, o->devices);
    sinks_info info = {.title = title,
                       .subtitle = sub,
                       .unit = tr->task->unit,
                       .loss_label = tr->task->loss_label,
                       .accuracy = tr->task->accuracy,
                       .steps_per_epoch = tr->steps_per_epoch,
                       .epochs = o->epochs};
    train_opts none = {0}; /* a rank other than 0 writes nothing */
    return sinks_open(&tr->out, tr->silent ? &none : o, &info);
}

static int run_epochs(trainer *tr) {
    for (int epoch = tr->start_epoch; epoch <= tr->o->epochs && !tr->stopped; epoch++) {
        epoch_stats e;
        int rc = train_epoch(tr, epoch, &e);
        if (!rc && !tr->stopped && tr->task->test) rc = evaluate(tr, &e);
        if (rc || tr->stopped) return rc;
        e.wall_s = progress_wall_s(); /* the test accuracy is known: time to accuracy */
        progress_clear(&tr->prog);
        if (!tr->silent) print_epoch(tr, &e);
        if ((rc = sinks_epoch(&tr->out, &e))) return rc;
        tr->last = e;
    }
    return 0;
}

static int run(trainer *tr) {
    const train_opts *o = tr->o;
    int rc;
    tr->last_saved = -1;
    tr->last.test_acc = NAN;
    if (tr->g && (rc = trainer_same_options_everywhere(tr))) return rc;
    /* the model is built before the checkpoint directory is claimed, so that weights that
     * cannot be trained from (--init-from) are refused before --overwrite deletes anything */
    if ((rc = estimate_memory(tr)) || o->dry_run || (rc = tr->task->build(tr->task, o))) return rc;
    /* before any work (and before the outputs, which another run may be writing): a directory
     * that cannot hold a checkpoint, or that another run uses, is found now */
    if ((rc = trainer_claim_checkpoint_dir(tr))) return rc;
    if ((rc = make_loaders(tr)) || (rc = open_outputs(tr)) || (rc = make_strategy(tr)) ||
        (rc = make_schedule(tr)) || (rc = make_buffers(tr)) || (rc = shard_optimizer(tr)) ||
        (rc = trainer_resume(tr)))
        return rc;
    if (!tr->silent && !o->quiet) banner(tr);
    write_config(tr);
    double t0 = progress_now();
    if ((rc = run_epochs(tr)) || (rc = trainer_save_checkpoint(tr))) return rc; /* the final one */
    if ((rc = trainer_save_task(tr, NULL, NULL))) return rc;
    progress_clear(&tr->prog);
    if (o->cuda_graphs && !tr->silent) /* said even with --quiet: did the graph run? */
        printf("cuda graphs: %lld of %lld steps replayed\n",
               (long long)tdm_strategy_graph_replays(tr->st, NULL), (long long)tr->global_step);
    if (tr->stop_signal) { /* said even with --quiet: the run did not finish */
        if (!tr->silent)
            printf("stopped   by %s after %lld steps%s%s\n", strsignal(tr->stop_signal),
                   (long long)tr->global_step,
                   o->checkpoint_dir ? "; continue with --resume, checkpoint in "
                                     : " (no --checkpoint-dir: nothing saved)",
                   o->checkpoint_dir ? o->checkpoint_dir : "");
        return 128 + tr->stop_signal;
    }
    if (o->quiet) return 0;
    if (tr->stopped)
        printf("stopped   after %lld steps (--max-steps)%s%s\n", (long long)tr->global_step,
               o->checkpoint_dir ? "; continue with --resume, checkpoint in " : "",
               o->checkpoint_dir ? o->checkpoint_dir : "");
    else if (tr->task->test)
        printf("done      %lld epochs in %.1f s, test accuracy %.2f%%\n", (long long)o->epochs,
               progress_now() - t0, 100 * tr->last.test_acc);
    else
        printf("done      %lld steps in %.1f s\n", (long long)tr->global_step, progress_now() - t0);
    return 0;
}

static void trainer_free(trainer *tr) {
    free(tr->rank_seconds);
    free(tr->rank_wait_s);
    tdm_loader_free(tr->train_l);
    tdm_loader_free(tr->test_l);
    tdm_strategy_free(tr->st); /* with every replica's (every stage's) optimizer */
    tdm_tensor_free(tr->loss_buf);
    tdm_tensor_free(tr->pred_buf);
    tdm_tensor_free(tr->graph_loss);
    tdm_tensor_free(tr->graph_pred);
    free(tr->loss_host);
    free(tr->time_host);
    free(tr->lr_host);
    free(tr->size_host);
    free(tr->pred_host);
    free(tr->label_host);
    tdm_checkpoint_unlock(tr->lock); /* after the last checkpoint */
}

int trainer_run(const train_opts *o, task *t, tdm_group *procs) {
    trainer tr = {.o = o, .task = t, .dev = o->devs[0], .g = procs, .accum = o->grad_accum};
    tr.silent = procs && tdm_group_rank(procs) != 0;
    tr.counts = !procs || tdm_group_rank(procs) % train_procs_per_row(o) == 0;
    progress_init(&tr.prog, stdout, o->quiet || tr.silent, t->unit);
    /* mpirun hands its ranks a pty of its own whatever the job's output is (mostly a batch
     * job's log file): plain lines there */
    if (procs) tr.prog.tty = false;
    /* with several devices this thread also runs device 0's replica */
    tdm_trace_name_thread("training loop (and devices[0] compute)");
    /* a stopping mpirun closes its ranks' stdout: a line printed then must not end the process
     * before its checkpoint (a failed write is ignored; the checkpoint is what matters) */
    if (procs) signal(SIGPIPE, SIG_IGN);
    trainer_debug dbg = {0};
    int rc = tdm_stop_on_signals() ? task_error("%s", tdm_last_error())
                                   : trainer_debug_start(&dbg, o, procs);
    if (!rc) rc = run(&tr);
    if (rc && rc < 128) trainer_debug_dump(&dbg, "the run failed");
    trainer_debug_stop(&dbg);
    progress_clear(&tr.prog);
    rc = sinks_close(&tr.out, rc, o->quiet || tr.silent);
    /* stopped by a signal: mpirun ends every process once one exits non-zero, so none exits
     * before rank 0 has written its checkpoint and closed its files */
    fflush(stdout);
    if (procs && rc > 128) tdm_collective_label("the trainer's last barrier before a stop");
    if (procs && rc > 128 && tdm_work_wait(tdm_barrier(procs)) != TDM_OK)
        rc = task_error("waiting for the other processes to stop: %s", tdm_last_error());
    trainer_free(&tr);
    return rc;
}
