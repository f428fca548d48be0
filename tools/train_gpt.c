/* `tandem train --model gpt`: the GPT-2 training loop.
 *
 * Data: an llm.c token shard (recognised by its magic) or any other file read as bytes
 * (vocabulary 256), cut into windows of context + 1 tokens, shuffled per epoch from the seed.
 * Model: tdm_gpt_new with GPT-2's initialisation, or an llm.c model file (--init-from).
 * Optimizer: AdamW with weight decay on matrices only (tdm_gpt_adamw_new), an optional cosine
 * schedule with warmup, gradient clipping and gradient accumulation (--grad-accum N: N
 * batches' gradients, each loss divided by N, add up before one step, which is then the step
 * of one batch N times larger). Several devices train through DataParallel; under mpirun
 * each process takes its share of every batch (DistributedSampler) and the gradients are
 * averaged over the processes (DDP, or DataParallel over every device of every process).
 * The trained model is written in llm.c's format (--save, and DIR/model.bin beside the
 * checkpoint of --checkpoint-dir), which `tandem sample` reads.
 */
#include "train_gpt.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "log.h"
#include "models.h"
#include "plot.h"
#include "progress.h"
#include "train.h"

#define SHARD_MAGIC 20240520

typedef struct {
    const gpt_train_opts *o;
    tdm_gpt_config cfg;
    tdm_dataset *ds;
    tdm_loader *loader;
    tdm_module *model;
    tdm_paramset *ps;
    tdm_adam_opts adam;
    tdm_optim *opt;
    tdm_dp *dp;
    tdm_ddp *ddp; /* under mpirun with one device per process */
    tdm_sched sched;
    int64_t steps, total;
    bool resumed;      /* the loader stands where the checkpoint left it: no epoch start */
    int64_t micro;     /* batches of the current step so far (gradient accumulation) */
    double micro_loss; /* their summed losses */
    run_log log;       /* --log */
    float *step_loss;  /* [total] every step's loss, for --plot */
    int64_t steps_per_epoch;
} gpt_run;

static int fail(const char *fmt, ...) {
    fflush(stdout);
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tandem train: error: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return EXIT_RUNTIME;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Whether path starts with the token shard magic (unreadable files are left to the reader). */
static bool is_token_shard(const char *path) {
    unsigned char h[4] = {0};
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    size_t n = fread(h, 1, 4, f);
    fclose(f);
    int32_t magic = (int32_t)((uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
                              (uint32_t)h[3] << 24);
    return n == 4 && magic == SHARD_MAGIC;
}

/* The model: from an llm.c file, or new with the options' sizes. */
static int make_model(gpt_run *r) {
    const gpt_train_opts *o = r->o;
    if (o->init_from) {
        r->model = tdm_gpt_load_llmc(o->init_from, o->devs[0], &r->cfg);
        if (!r->model) return fail("--init-from: %s", tdm_last_error());
        if (o->context > r->cfg.context)
            return fail("--context %lld is longer than the %d of '%s'", (long long)o->context,
                        r->cfg.context, o->init_from);
    } else {
        bool shard = is_token_shard(o->data);
        int64_t v = o->vocab ? o->vocab : shard ? 50257 : 256;
        /* llm.c pads the vocabulary to a multiple of 128 (wte rows no token reads) */
        r->cfg = (tdm_gpt_config){(int)o->layers,   (int)o->heads,
                                  (int)o->channels, (int)(o->context ? o->context : 64),
                                  (int)v,           (int)((v + 127) / 128 * 128)};
        tdm_rng rng = tdm_rng_make((uint64_t)o->seed);
        r->model = model_build_gpt(&r->cfg, o->devs[0], &rng);
        if (!r->model) return fail("model gpt: %s", tdm_last_error());
    }
    r->ps = tdm_module_parameters(r->model);
    return r->ps ? 0 : fail("model gpt: %s", tdm_last_error());
}

static int make_data(gpt_run *r) {
    const gpt_train_opts *o = r->o;
    int64_t T = o->context ? o->context : r->cfg.context;
    r->ds = is_token_shard(o->data) ? tdm_token_dataset_open(o->data, T, r->cfg.vocab)
                                    : tdm_text_dataset_open(o->data, T);
    if (!r->ds) return fail("--data: %s", tdm_last_error());
    if (r->ds->num_classes > r->cfg.vocab)
        return fail("--data '%s' holds byte tokens (vocabulary 256) but the model predicts %d",
                    o->data, r->cfg.vocab);
    tdm_loader_opts lo = tdm_loader_defaults(o->batch_size);
    if (o->procs) { /* this process's rows of every global batch */
        lo.rank = tdm_group_rank(o->procs);
        lo.world_size = tdm_group_size(o->procs);
        lo.batch_size = o->batch_size / lo.world_size;
    }
    lo.shuffle = true;
    lo.seed = (uint64_t)o->seed;
    lo.workers = (int)o->workers;
    lo.drop_last = true;                        /* every step sees a full [B, T] batch */
    if (o->n_devs == 1) lo.device = o->devs[0]; /* a GPU: pinned batches, uploaded ahead */
    r->loader = tdm_loader_new(r->ds, &lo);
    if (!r->loader) return fail("loader: %s", tdm_last_error());
    int64_t per_epoch = tdm_loader_batches(r->loader);
    if (per_epoch < 1)
        return fail("--data '%s' holds %lld windows of %lld tokens, fewer than one batch of %lld",
                    o->data, (long long)r->ds->n, (long long)T, (long long)o->batch_size);
    r->steps_per_epoch = per_epoch / o->grad_accum;
    r->total = o->epochs * r->steps_per_epoch;
    if (r->total < 1)
        return fail("--grad-accum %lld is more than the %lld batches of an epoch",
                    (long long)o->grad_accum, (long long)per_epoch);
    if (o->max_steps > 0 && o->max_steps < r->total) r->total = o->max_steps;
    return 0;
}

static tdm_optim *make_optim(tdm_paramset *ps, void *arg) {
    return tdm_gpt_adamw_new(ps, arg);
}

static int make_optimizer(gpt_run *r) {
    const gpt_train_opts *o = r->o;
    r->adam = tdm_adamw_defaults();
    r->adam.lr = (float)o->lr;
    r->adam.weight_decay = (float)o->weight_decay;
    /* one GPU per process: DataParallel, whose NCCL group spans the processes */
    bool gpu_procs = o->procs && o->devs[0].type == TDM_CUDA;
    /* rank 0's initial weights reach every process */
    if (o->procs && o->n_devs == 1 && !gpu_procs &&
        !(r->ddp = tdm_ddp_new(r->model, o->procs, NULL)))
        return fail("ddp: %s", tdm_last_error());
    if (o->n_devs > 1 || gpu_procs) {
        r->dp =
            tdm_dp_new_distributed(r->model, o->devs, o->n_devs, o->procs, make_optim, &r->adam);
        if (!r->dp || tdm_dp_set_clip_grad_norm(r->dp, (float)o->clip))
            return fail("data parallel: %s", tdm_last_error());
        r->opt = tdm_dp_optim(r->dp, 0);
    } else {
        r->opt = make_optim(r->ps, &r->adam);
    }
    if (!r->opt) return fail("optimizer: %s", tdm_last_error());
    r->sched = (tdm_sched){.kind = o->cosine ? TDM_SCHED_COSINE : TDM_SCHED_CONSTANT,
                           .base_lr = (float)o->lr,
                           .warmup = o->warmup_steps,
                           .total = r->total};
    if (o->cosine && o->warmup_steps > r->total)
        return fail("--warmup-steps %lld is more than the %lld steps of the run",
                    (long long)o->warmup_steps, (long long)r->total);
    return 0;
}

static void set_lr(gpt_run *r) {
    int n = r->dp ? tdm_dp_devices(r->dp) : 1;
    for (int i = 0; i < n; i++)
        tdm_sched_apply(&r->sched, r->dp ? tdm_dp_optim(r->dp, i) : r->opt, r->steps);
}

/* DataParallel's loss: the mean over a replica's rows, divided by the step's grad_accum
 * (*(int64_t *)arg) so that the micro-batches' gradients add up to their mean. */
static tdm_tensor *loss_fn(tdm_tensor *logits, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0;
    return tdm_mul_scalar(tdm_gpt_loss(logits, target), 1.0f / (float)*(const int64_t *)arg);
}

/* Forward and backward of batch b, micro-batch `micro` of its optimizer step: gradients add
 * up in the flat buffer (zeroed before the first), each loss scaled by 1/grad_accum so the sum
 * is the mean over the step's batches. *loss receives b's mean loss. */
static int accumulate(gpt_run *r, const tdm_batch *b, int64_t micro, float *loss) {
    if (tdm_scope_begin()) return tdm_last_status();
    tdm_tensor *x = b->x, *y = b->y; /* on the model's device already, unless a CPU model */
    if (!tdm_device_equal(x->device, r->o->devs[0]))
        x = tdm_to_device(x, r->o->devs[0]), y = tdm_to_device(y, r->o->devs[0]);
    tdm_tensor *l = tdm_gpt_loss(tdm_gpt_forward(r->model, x), y);
    int rc = l ? TDM_OK : tdm_last_status();
    if (!rc && micro == 0) rc = tdm_optim_zero_grad(r->opt);
    tdm_tensor *scaled = rc ? NULL : tdm_mul_scalar(l, 1.0f / (float)r->o->grad_accum);
    if (!rc && r->ddp) { /* gradients of all but the step's last batch stay local (no_sync) */
        tdm_ddp_set_sync(r->ddp, micro == r->o->grad_accum - 1);
        rc = tdm_ddp_backward(r->ddp, scaled);
    } else if (!rc) {
        rc = tdm_backward(scaled);
    }
    *loss = rc ? NAN : tdm_item(l);
    tdm_scope_end();
    return rc;
}

/* Feeds batch b to the current step; when it is the step's last batch (always, with several
 * devices), clips and updates. *done says whether an optimizer step was taken; *loss receives
 * the step's mean loss then. */
static int train_batch(gpt_run *r, const tdm_batch *b, bool *done, float *loss) {
    *done = false;
    float l = NAN;
    int rc;
    if (r->dp) { /* the last batch of the step averages over the devices and updates */
        int64_t k = r->o->grad_accum;
        bool last = r->micro + 1 == k;
        rc = last ? tdm_dp_step(r->dp, b->x, b->y, loss_fn, &k, &l)
                  : tdm_dp_accumulate(r->dp, b->x, b->y, loss_fn, &k, &l);
        l *= (float)k; /* the batch's own mean loss */
    } else {
        rc = accumulate(r, b, r->micro, &l);
    }
    if (rc) return rc;
    r->micro_loss = r->micro ? r->micro_loss + l : l;
    if (++r->micro < r->o->grad_accum) return TDM_OK;
    *loss = (float)(r->micro_loss / (double)r->micro);
    r->micro = 0;
    *done = true;
    if (r->dp) return TDM_OK; /* clipped and stepped by tdm_dp_step */
    if (r->o->clip > 0 && tdm_clip_grad_norm(r->ps, (float)r->o->clip, false, NULL))
        return tdm_last_status();
    return tdm_optim_step(r->opt);
}

/* DIR/model.bin (for tandem sample) and a Tandem checkpoint of the weights, optimizer and
 * loader position (for --resume). */
static int save_checkpoint(gpt_run *r) {
    const gpt_train_opts *o = r->o;
    if (!o->checkpoint_dir || !o->write_checkpoints) return 0;
    if (mkdir(o->checkpoint_dir, 0755) != 0 && errno != EEXIST)
        return fail("--checkpoint-dir '%s': %s", o->checkpoint_dir, strerror(errno));
    char path[4200];
    snprintf(path, sizeof path, "%s/model.bin", o->checkpoint_dir);
    if (tdm_gpt_save_llmc(path, r->model)) return fail("checkpoint: %s", tdm_last_error());
    tdm_train_state s = {.model = r->model, .optim = r->opt, .loader = r->loader, .step = r->steps};
    if (tdm_checkpoint_save(o->checkpoint_dir, &s, 3))
        return fail("checkpoint: %s", tdm_last_error());
    if (!o->quiet)
        printf("checkpoint %s at step %lld (model.bin for tandem sample)\n", o->checkpoint_dir,
               (long long)r->steps);
    return 0;
}

/* --resume: weights, optimizer state (every replica's) and loader position from the newest
 * checkpoint of --checkpoint-dir; none there yet starts from the beginning. */
static int resume(gpt_run *r) {
    const gpt_train_opts *o = r->o;
    char path[4200];
    int64_t step = 0;
    int found = o->resume ? tdm_checkpoint_latest(o->checkpoint_dir, path, sizeof path, &step) : 0;
    if (found < 0) return fail("--resume: %s", tdm_last_error());
    if (found == 0) return 0;
    int n = r->dp ? tdm_dp_devices(r->dp) : 1;
    for (int i = 0; i < n; i++) {
        tdm_train_state s = {.model = r->dp ? tdm_dp_replica(r->dp, i) : r->model,
                             .optim = r->dp ? tdm_dp_optim(r->dp, i) : r->opt,
                             .loader = i == 0 ? r->loader : NULL};
        if (tdm_checkpoint_load(path, &s))
            return fail("--resume from '%s': %s", path, tdm_last_error());
    }
    r->steps = step;
    r->resumed = true;
    if (!o->quiet) printf("resume    %s: step %lld\n", path, (long long)step);
    return 0;
}

static int save(gpt_run *r) {
    const gpt_train_opts *o = r->o;
    if (o->save && tdm_gpt_save_llmc(o->save, r->model))
        return fail("--save: %s", tdm_last_error());
    if (o->save && !o->quiet) printf("saved     %s (llm.c model file)\n", o->save);
    return save_checkpoint(r);
}

/* *v <- its mean over the processes (every process calls it at the same steps). */
static int mean_over_processes(tdm_group *procs, double *v) {
    float f = (float)*v;
    tdm_tensor *t = tdm_from_data(TDM_SHAPE(1), TDM_F32, tdm_cpu(0), &f);
    int rc = t ? tdm_work_wait(tdm_all_reduce(procs, t, TDM_AVG)) : tdm_last_status();
    if (!rc) rc = tdm_to_host(t, &f, sizeof f);
    tdm_tensor_free(t);
    *v = f;
    return rc;
}

/* --log's line for the step just taken and its loss for --plot. *t_prev: when the step before
 * ended (updated). Under mpirun the loss is rank 0's rows' (the printed one is everyone's). */
static void record_step(gpt_run *r, int64_t epoch, float loss, double *t_prev) {
    const gpt_train_opts *o = r->o;
    double t = now_s(), tokens = (double)(o->batch_size * r->ds->sample_shape.d[0] * o->grad_accum);
    int64_t in_epoch = (r->steps - 1) % r->steps_per_epoch + 1;
    log_step(&r->log, (int)epoch + 1, in_epoch, r->steps, loss, tdm_optim_lr(r->opt), "tok_s",
             t > *t_prev ? tokens / (t - *t_prev) : NAN);
    if (r->step_loss) r->step_loss[r->steps - 1] = loss;
    *t_prev = t;
}

/* --plot: the loss of every step so far, over the run's planned length in epochs. */
static int write_plot(gpt_run *r) {
    const gpt_train_opts *o = r->o;
    if (!o->plot_path || !r->step_loss) return 0;
    const tdm_gpt_config *c = &r->cfg;
    char title[256], sub[256];
    snprintf(title, sizeof title, "gpt on %s", o->data);
    snprintf(sub, sizeof sub, "L%d H%d C%d T%lld, batch %lld, adamw lr %g, %lld steps", c->layers,
             c->heads, c->channels, (long long)r->ds->sample_shape.d[0],
             (long long)(o->batch_size * o->grad_accum), o->lr, (long long)r->steps);
    plot_data d = {.title = title,
                   .subtitle = sub,
                   .step_loss = r->step_loss,
                   .n_steps = r->steps,
                   .steps_per_epoch = r->steps_per_epoch,
                   .total_epochs = (double)r->total / (double)r->steps_per_epoch,
                   .loss_only = true,
                   .loss_label = "next-token cross-entropy"};
    if (plot_write_svg(o->plot_path, &d) != 0)
        return fail("cannot write plot '%s': %s", o->plot_path, strerror(errno));
    return 0;
}

static int open_outputs(gpt_run *r) {
    const gpt_train_opts *o = r->o;
    if (o->plot_path) {
        r->step_loss = malloc(sizeof(float) * (size_t)r->total);
        if (!r->step_loss) return fail("--plot: out of memory for %lld steps", (long long)r->total);
        for (int64_t i = 0; i < r->total; i++) r->step_loss[i] = NAN; /* before a resume */
    }
    if (o->log_path && log_open(&r->log, o->log_path) != 0)
        return fail("cannot write log '%s': %s", o->log_path, strerror(errno));
    const tdm_gpt_config *c = &r->cfg;
    char cfg[512];
    snprintf(cfg, sizeof cfg,
             "\"model\":\"gpt\",\"layers\":%d,\"heads\":%d,\"channels\":%d,\"context\":%lld,"
             "\"vocab\":%d,\"parameters\":%lld,\"batch_size\":%lld,\"grad_accum\":%lld,"
             "\"optimizer\":\"adamw\",\"lr\":%g,\"weight_decay\":%g,\"steps\":%lld,"
             "\"devices\":%d",
             c->layers, c->heads, c->channels, (long long)r->ds->sample_shape.d[0], c->vocab,
             (long long)r->ps->total, (long long)o->batch_size, (long long)o->grad_accum, o->lr,
             o->weight_decay, (long long)r->total, o->n_devs);
    log_config(&r->log, cfg);
    return 0;
}

static int train_loop(gpt_run *r) {
    const gpt_train_opts *o = r->o;
    int64_t every = o->print_every > 0 ? o->print_every : (r->total >= 10 ? r->total / 10 : 1);
    int64_t tokens = o->batch_size * r->ds->sample_shape.d[0] * o->grad_accum; /* per step */
    double t0 = now_s(), t_last = t0, t_step = t0, loss_sum = 0;
    int64_t n_sum = 0;
    int64_t epoch = 0, batch = 0;
    if (r->resumed) tdm_loader_position(r->loader, &epoch, &batch);
    for (; r->steps < r->total; epoch++) {
        if (!r->resumed && tdm_loader_start_epoch(r->loader, epoch))
            return fail("loader: %s", tdm_last_error());
        r->resumed = false;
        tdm_batch b;
        int got;
        for (;;) {
            if (r->steps >= r->total) break;
            tdm_trace_begin("wait for data");
            got = tdm_loader_next(r->loader, &b);
            tdm_trace_end();
            if (got == 0) break;
            if (got < 0) return fail("loading a batch: %s", tdm_last_error());
            set_lr(r);
            float loss;
            bool done;
            tdm_trace_begin("step");
            int rc = train_batch(r, &b, &done, &loss);
            tdm_trace_end();
            if (rc) return fail("step %lld: %s", (long long)r->steps + 1, tdm_last_error());
            if (!done) continue;
            if (!isfinite(loss))
                return fail("step %lld: the loss is %g", (long long)r->steps + 1, loss);
            r->steps++, loss_sum += loss, n_sum++;
            record_step(r, epoch, loss, &t_step);
            if (o->checkpoint_every > 0 && r->steps % o->checkpoint_every == 0 &&
                r->steps < r->total && save_checkpoint(r))
                return EXIT_RUNTIME;
            if (r->steps % every != 0 && r->steps != r->total) continue;
            if (o->procs && mean_over_processes(o->procs, &loss_sum))
                return fail("step %lld: %s", (long long)r->steps, tdm_last_error());
            if (write_plot(r)) return EXIT_RUNTIME;
            double t = now_s(), dt = (t - t_last) / (double)n_sum;
            if (!o->quiet) {
                printf("step %lld/%lld  loss %.4f  lr %.3g  %.1f ms/step  %.0f tok/s\n",
                       (long long)r->steps, (long long)r->total, loss_sum / (double)n_sum,
                       tdm_optim_lr(r->opt), 1e3 * dt, (double)tokens / dt);
                fflush(stdout);
            }
            t_last = t, loss_sum = 0, n_sum = 0;
        }
    }
    if (!o->quiet) printf("done      %lld steps in %.1f s\n", (long long)r->steps, now_s() - t0);
    return 0;
}

static void banner(const gpt_run *r) {
    const gpt_train_opts *o = r->o;
    const tdm_gpt_config *c = &r->cfg;
    char dev[16];
    printf("model     gpt: %d layers, %d heads, %d channels, context %d, vocab %d (padded %d), "
           "%lld parameters, on %s",
           c->layers, c->heads, c->channels, c->context, c->vocab, c->padded_vocab,
           (long long)r->ps->total, tdm_device_str(o->devs[0], dev));
    for (int i = 1; i < o->n_devs; i++) printf(",%s", tdm_device_str(o->devs[i], dev));
    printf("\n");
    if (o->devs[0].type == TDM_CPU) progress_print_compute(stdout);
    printf("data      %s: %lld windows of %lld tokens; batch %lld", o->data, (long long)r->ds->n,
           (long long)r->ds->sample_shape.d[0], (long long)o->batch_size);
    if (o->grad_accum > 1) printf(" x %lld accumulated", (long long)o->grad_accum);
    printf(", %lld steps\n", (long long)r->total);
    printf("optimizer adamw lr %g, weight decay %g on matrices%s%s\n", o->lr, o->weight_decay,
           o->cosine ? ", cosine schedule" : "", o->clip > 0 ? ", gradient clipping" : "");
    fflush(stdout);
}

int gpt_train(const gpt_train_opts *o) {
    gpt_run r = {.o = o};
    int rc = make_model(&r);
    if (!rc) rc = make_data(&r);
    if (!rc) rc = make_optimizer(&r);
    if (!rc && !o->quiet) banner(&r);
    if (!rc) rc = resume(&r);
    if (!rc) rc = open_outputs(&r);
    if (!rc) rc = train_loop(&r);
    if (!rc) rc = write_plot(&r);
    if (!rc) rc = save(&r);
    if (log_close(&r.log) != 0 && rc == 0) rc = fail("writing log '%s' failed", o->log_path);
    if (!rc && !o->quiet && o->log_path) printf("log       %s\n", o->log_path);
    if (!rc && !o->quiet && o->plot_path) printf("plot      %s\n", o->plot_path);
    free(r.step_loss);
    tdm_loader_free(r.loader);
    tdm_ddp_free(r.ddp);
    if (r.dp)
        tdm_dp_free(r.dp);
    else
        tdm_optim_free(r.opt);
    tdm_dataset_free(r.ds);
    tdm_module_free(r.model);
    return rc;
}
