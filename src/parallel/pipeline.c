/* Pipelines: a Sequential cut into stages, one persistent pinned thread per (stage, replica,
 * tensor-parallel rank), the batch cut into micro-batches that flow through the stages at once.
 * With tensor parallelism (tdm_pipe_opts.tp) each (stage, replica) is tp threads, each with
 * its clone of the stage split over their group; rank t of a stage exchanges activations with
 * rank t of its neighbours only, so the schedule is the same on every rank.
 *
 * Each thread owns its stage's clone of the layers, its flat parameters and its optimizer,
 * and records its micro-batches' forwards on its own tape. Activations cross to the next
 * stage through hand-off slots (a pointer and a flag per micro-batch, under one mutex): the
 * next stage copies them onto its device with tdm_device_recv, whose backward copies the
 * gradient back into the slot for the sending stage to resume its backward with
 * tdm_backward_from. A micro-batch's activations are released as soon as its backward ends
 * (tdm_graph_release), which is what lets 1F1B hold at most stages-s micro-batches on stage s.
 *
 * A failing stage marks the pipeline failed and aborts its replica group: every other thread
 * stops at its next wait or collective, and a failed thread keeps its tensors until every
 * thread has stopped, since the neighbours may still be copying them.
 *
 * After the schedule, before the replicas average their gradients, the stages agree on what
 * spans them (pipeline_sync.c): tied copies' gradients, fp16's finiteness, clipping's norm. */
#include "parallel/pipeline_internal.h"
#include "parallel/pipeline_split.h"
#include "parallel/strategy.h" /* tdm_strategy_set_loss_module */
#include "backend/backend.h"   /* tdm_cpu_gemm_set_threads */
#include "optim/scaler.h"
#include "tandem/autograd.h"
#include "tandem/pipeline.h"
#include "tandem/trace.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Nanoseconds a stage spins for its neighbour's hand-off before it sleeps (when the workers
 * fit the cores): the hand-off usually comes within microseconds, sooner than a futex wake-up
 * on this VM (bench/RESULTS.md, "Figures behind the code"). */
#define HANDOFF_SPIN_NS 50000

/* "F 3" / "B 3": trace span names must outlive the trace, so they are static. */
static char span_names[2][TDM_PIPE_MAX_MICRO][8];
static pthread_once_t names_once = PTHREAD_ONCE_INIT;

static void names_init(void) {
    for (int k = 0; k < TDM_PIPE_MAX_MICRO; k++) {
        snprintf(span_names[0][k], sizeof span_names[0][k], "F %d", k);
        snprintf(span_names[1][k], sizeof span_names[1][k], "B %d", k);
    }
}

/* ---- rows ------------------------------------------------------------------------------- */

/* Global rows [*row0, *row0 + *rows) of micro-batch k of replica r. */
static void micro_rows(const struct tdm_pipe *p, int r, int k, int64_t *row0, int64_t *rows) {
    int64_t rlo, rhi, lo, hi;
    tdm_rows_of(p->B, p->R, r, &rlo, &rhi);
    tdm_rows_of(rhi - rlo, p->M, k, &lo, &hi);
    *row0 = rlo + lo;
    *rows = hi - lo;
}

/* ---- failures and waits ------------------------------------------------------------------- */

/* Records this worker's error as the pipeline's first (if it is) and wakes every waiter. */
int tdm_pipe_fail(worker *w, int rc) {
    struct tdm_pipe *p = w->p;
    char dev[16];
    pthread_mutex_lock(&p->mu);
    if (!atomic_load(&p->failed)) {
        snprintf(p->err, sizeof p->err, "pipeline: stage %d, replica %d (%s): %s", w->stage,
                 w->replica, tdm_device_str(w->dev, dev), tdm_last_error());
        atomic_store(&p->failed, 1);
    }
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    tdm_waitq_wake(&p->handoffs);
    char why[512]; /* peers in a collective: an abort may raise over the error */
    snprintf(why, sizeof why, "%s", tdm_last_error());
    if (w->group) tdm_group_abort(w->group, why);
    if (w->tp_group) tdm_group_abort(w->tp_group, why);
    return rc ? rc : TDM_ERR_STATE;
}

/* Waits until *flag is set (the pointer published before it is then visible); an error when
 * the pipeline failed meanwhile, even if the flag came too. */
int tdm_pipe_wait(worker *w, const tdm_wait_word *flag) {
    struct tdm_pipe *p = w->p;
    tdm_wait_until(&p->handoffs, flag, 1,
                   (tdm_wait_opts){.spin_ns = p->spin_ns, .stop = &p->failed});
    if (atomic_load(&p->failed)) return tdm_raise(TDM_ERR_STATE, "stopped: another stage failed");
    return TDM_OK;
}

void tdm_pipe_publish(struct tdm_pipe *p, tdm_wait_word *flag) {
    atomic_store(flag, 1);
    tdm_waitq_wake(&p->handoffs);
}

/* tdm_device_recv's sink: the next stage hands the gradient of our output back. */
static void grad_sink(tdm_tensor *grad, void *arg) {
    handoff *h = arg;
    h->grad = grad;
    tdm_pipe_publish(h->p, &h->grad_ready);
}

/* ---- one micro-batch ---------------------------------------------------------------------- */

/* Drops a tensor's memory before the step scope ends (its header stays in the scope). */
static void release_early(tdm_tensor *t) {
    if (t && tdm_book(t)->owner && t->storage) {
        tdm_storage_release(t->storage);
        t->storage = NULL;
    }
}

/* Rows [row0, row0 + rows) of the caller's t on dev: a view when t is there already. */
static tdm_tensor *rows_on(tdm_tensor *t, int64_t row0, int64_t rows, tdm_device dev) {
    bool prev = tdm_set_grad_enabled(false); /* never record on the caller's tensors */
    tdm_tensor *s = tdm_slice(t, 0, row0, row0 + rows, 1);
    if (s && !tdm_device_equal(s->device, dev)) s = tdm_to_device(s, dev);
    tdm_set_grad_enabled(prev);
    return s;
}

static void restore_impls(worker *w) {
    for (int i = 0; i < w->n_snaps; i++)
        memcpy(w->snaps[i].m->impl, w->snaps[i].saved, w->snaps[i].m->impl_size);
}

/* The last stage's root: the micro-batch's mean loss weighted by its share of the batch. */
static tdm_tensor *loss_root(worker *w, micro *m, tdm_tensor *out, int64_t row0, int64_t rows) {
    struct tdm_pipe *p = w->p;
    m->target = rows_on(p->y, row0, rows, w->dev);
    /* the loss may need the stage (vocabulary-split logits: tdm_strategy_loss_module) */
    tdm_strategy_set_loss_module(w->mod);
    tdm_tensor *loss = m->target ? p->loss_fn(out, m->target, row0, p->loss_arg) : NULL;
    tdm_strategy_set_loss_module(NULL);
    if (!loss) return NULL;
    double share = (double)rows / (double)p->B;
    w->loss += (double)tdm_item(loss) * share;
    return tdm_mul_scalar(loss, (float)(share * p->loss_scale)); /* fp16: times the scale */
}

static tdm_tensor *stage_input(worker *w, micro *m, int k, int64_t row0, int64_t rows) {
    if (w->stage == 0) return m->input = rows_on(w->p->x, row0, rows, w->dev);
    handoff *h = &at(w->p, w->stage - 1, w->replica, w->t)->ho[k]; /* the previous stage's */
    return tdm_device_recv(h->act, w->dev, grad_sink, h);
}

static int run_forward(worker *w, int k) {
    struct tdm_pipe *p = w->p;
    micro *m = &w->mb[k];
    int64_t row0, rows;
    micro_rows(p, w->replica, k, &row0, &rows);
    if (w->stage > 0 && tdm_pipe_wait(w, &at(p, w->stage - 1, w->replica, w->t)->ho[k].act_ready))
        return tdm_last_status();
    double t0 = tdm_trace_now();
    restore_impls(w); /* every micro-batch starts from the step's layer state */
    tdm_parallel_context_set(NULL, row0, p->B); /* dropout keyed by global rows */
    m->mark = tdm_tape_size();
    tdm_tensor *out = tdm_module_forward(w->mod, stage_input(w, m, k, row0, rows));
    bool last = w->stage == p->S - 1;
    m->root = last && out ? loss_root(w, m, out, row0, rows) : out;
    m->end = tdm_tape_size();
    tdm_parallel_context_clear();
    if (!m->root) return tdm_last_status();
    if (!last) {
        w->ho[k].act = out;
        tdm_pipe_publish(p, &w->ho[k].act_ready);
    }
    double t1 = tdm_trace_now();
    tdm_trace_span(span_names[0][k], t0, t1);
    w->busy_us += t1 - t0;
    if (w->t_first < 0) w->t_first = t0;
    if (++w->in_flight > w->max_in_flight) w->max_in_flight = w->in_flight;
    return TDM_OK;
}

static int run_backward(worker *w, int k) {
    struct tdm_pipe *p = w->p;
    micro *m = &w->mb[k];
    /* an output without history (parameter-free layers on raw input) gets no gradient */
    bool wants = w->stage < p->S - 1 && m->root->requires_grad;
    if (wants && tdm_pipe_wait(w, &w->ho[k].grad_ready)) return tdm_last_status();
    tdm_tensor *g = wants ? w->ho[k].grad : NULL;
    w->ho[k].grad = NULL;
    double t0 = tdm_trace_now();
    int rc = TDM_OK;
    if (m->root->grad_fn) {
        tdm_scope_begin(); /* the backward's temporaries die with it */
        rc = tdm_backward_from(m->root, g, m->mark);
        tdm_scope_end();
    }
    tdm_tensor_free(g);
    tdm_graph_release(m->mark, m->end);
    release_early(m->input);
    release_early(m->target);
    double t1 = tdm_trace_now();
    tdm_trace_span(span_names[1][k], t0, t1);
    w->busy_us += t1 - t0;
    w->t_last = t1;
    w->in_flight--;
    return rc;
}

/* ---- schedules ---------------------------------------------------------------------------- */

/* Stage s's order of work: k >= 0 is micro-batch k's forward, -(k + 1) its backward. */
static int schedule_of(tdm_pipe_schedule sched, int S, int M, int s, int *ops) {
    int n = 0;
    if (sched == TDM_PIPE_GPIPE) {
        for (int k = 0; k < M; k++) ops[n++] = k;
        for (int k = M - 1; k >= 0; k--) ops[n++] = -(k + 1); /* last in, first out */
        return n;
    }
    int warm = S - 1 - s < M ? S - 1 - s : M; /* fills the pipeline below this stage */
    for (int k = 0; k < warm; k++) ops[n++] = k;
    for (int i = 0; i < M - warm; i++) {
        ops[n++] = warm + i;
        ops[n++] = -(i + 1);
    }
    for (int k = M - warm; k < M; k++) ops[n++] = -(k + 1);
    return n;
}

static int run_schedule(worker *w) {
    struct tdm_pipe *p = w->p;
    int ops[2 * TDM_PIPE_MAX_MICRO];
    int n = schedule_of(p->sched, p->S, p->M, w->stage, ops), rc = TDM_OK;
    for (int i = 0; i < n && !rc; i++)
        rc = ops[i] >= 0 ? run_forward(w, ops[i]) : run_backward(w, -ops[i] - 1);
    return rc;
}

/* ---- one step of one worker --------------------------------------------------------------- */

static int sync_replicas(worker *w, bool buffers) {
    int rc = TDM_OK;
    if (!w->group) return rc;
    if (buffers) {
        for (int i = 0; !rc && i < w->bs->n; i++) {
            tdm_collective_label("stage %d's buffer %d from replica 0", w->stage, i);
            rc = tdm_work_wait(tdm_broadcast(w->group, w->bs->buffers[i], 0));
        }
        return rc;
    }
    tdm_trace_begin("all-reduce gradients");
    if (w->opt) {
        tdm_collective_label("stage %d's gradients", w->stage);
        rc = tdm_work_wait(tdm_all_reduce(w->group, w->mod->paramset->flat_grad, TDM_SUM));
    }
    tdm_trace_end();
    return rc;
}

/* The update of a worker's stage: fp16 unscales its gradient and steps only when every
 * worker's gradients are finite; clipping comes between. */
static int stage_update(worker *w) {
    bool finite = true;
    int rc = w->p->scaler ? tdm_pipe_agree_finite(w, &finite) : TDM_OK;
    if (!rc && w->opt && finite && w->p->scaler)
        rc = tdm_grad_scaler_unscale_of(w->p->scaler, w->mod->paramset->flat_grad);
    if (!rc && w->p->clip > 0) rc = tdm_pipe_clip(w, finite);
    if (!rc && w->opt && finite) {
        tdm_trace_begin("optimizer");
        rc = tdm_optim_step(w->opt);
        tdm_trace_end();
    }
    return rc;
}

static void step_begin(worker *w) {
    w->loss = 0;
    w->busy_us = 0;
    w->t_first = w->t_last = -1;
    w->in_flight = w->max_in_flight = 0;
    memset(w->mb, 0, sizeof w->mb);
    for (int i = 0; i < w->n_snaps; i++)
        memcpy(w->snaps[i].saved, w->snaps[i].m->impl, w->snaps[i].m->impl_size);
    tdm_alloc_reset_peak(w->dev);
}

static int worker_step(worker *w) {
    struct tdm_pipe *p = w->p;
    step_begin(w);
    size_t base = tdm_alloc_stats_get(w->dev).bytes_in_use;
    int rc = sync_replicas(w, true);
    if (!rc && w->opt) rc = tdm_optim_zero_grad(w->opt);
    tdm_scope_begin();
    if (!rc) rc = run_schedule(w);
    if (!rc) rc = tdm_pipe_sum_ties(w);
    if (!rc) rc = sync_replicas(w, false);
    if (!rc) rc = stage_update(w);
    w->peak_bytes = (int64_t)(tdm_alloc_stats_get(w->dev).peak_in_use - base);
    if (rc) tdm_pipe_fail(w, rc);
    pthread_mutex_lock(&p->mu);
    p->out++;
    pthread_cond_broadcast(&p->cv);
    /* after a failure the neighbours may still read our activations or write our slots */
    while (atomic_load(&p->failed) && p->out < p->n_workers) pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    for (int k = 0; k < p->M; k++) tdm_tensor_free(w->ho[k].grad); /* left by a failure */
    tdm_scope_end();
    return rc;
}

/* ---- worker threads ----------------------------------------------------------------------- */

static int collect_snaps(worker *w, tdm_module *m) {
    for (int c = 0; c < m->n_children; c++)
        if (collect_snaps(w, m->children[c])) return tdm_last_status();
    if (!m->impl || !m->impl_size) return TDM_OK;
    impl_snap *s = realloc(w->snaps, sizeof *s * (size_t)(w->n_snaps + 1));
    if (!s) return tdm_raise(TDM_ERR_NOMEM, "pipeline: out of memory");
    w->snaps = s;
    s[w->n_snaps] = (impl_snap){m, malloc(m->impl_size)};
    if (!s[w->n_snaps].saved) return tdm_raise(TDM_ERR_NOMEM, "pipeline: out of memory");
    w->n_snaps++;
    return TDM_OK;
}

static int worker_init(worker *w) {
    struct tdm_pipe *p = w->p;
    char name[64], dev[16];
    snprintf(name, sizeof name, "stage %d replica %d (%s)", w->stage, w->replica,
             tdm_device_str(w->dev, dev));
    tdm_trace_name_thread(name);
    tdm_pin_rank_thread(w->idx, p->n_workers);
    /* the stage split over its tensor-parallel ranks (a collective: they all run this) */
    if (w->tp_group && p->parallelize(w->mod, w->tp_group, p->parallelize_arg))
        return tdm_last_status();
    tdm_paramset *ps = tdm_module_parameters(w->mod);
    w->bs = ps ? tdm_module_buffers(w->mod) : NULL;
    if (!w->bs) return tdm_last_status();
    if (ps->total > 0 && !(w->opt = p->make_optim(ps, p->optim_arg)))
        return tdm_last_status() ? tdm_last_status() : TDM_ERR_ARG;
    if (tdm_pipe_find_ties(w, ps)) return tdm_last_status();
    return collect_snaps(w, w->mod);
}

/* Replica 0's parts of its stage made whole in p->gather_into's layers (rank 0 writes). */
static int worker_gather(worker *w) {
    struct tdm_pipe *p = w->p;
    int rc = TDM_OK;
    for (int i = p->first[w->stage]; i < p->first[w->stage + 1] && !rc && w->replica == 0; i++)
        rc = tdm_tp_gather_whole(w->mod->children[i - p->first[w->stage]],
                                 w->t == 0 ? p->gather_into->children[i] : NULL);
    if (rc) tdm_pipe_fail(w, rc);
    return rc;
}

static void *worker_main(void *arg) {
    worker *w = arg;
    struct tdm_pipe *p = w->p;
    int rc = worker_init(w);
    if (rc) tdm_pipe_fail(w, rc);
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        w->rc = rc;
        if (++p->finished == p->n_workers) pthread_cond_signal(&p->done);
        while (!p->quit && p->generation == seen) pthread_cond_wait(&p->go, &p->mu);
        seen = p->generation;
        bool quit = p->quit;
        pthread_mutex_unlock(&p->mu);
        if (quit) break;
        rc = p->round == ROUND_GATHER  ? worker_gather(w)
             : p->round == ROUND_STATE ? tdm_pipe_worker_state(w)
                                       : worker_step(w);
    }
    tdm_optim_free(w->opt);
    w->opt = NULL;
    tdm_thread_release();
    return NULL;
}

/* Starts a round on every worker (a step or a gather; the init's starts with the threads) and
 * waits for all of them. */
static int run_round(struct tdm_pipe *p, round_kind kind) {
    pthread_mutex_lock(&p->mu);
    p->round = kind;
    if (kind == ROUND_GATHER || kind == ROUND_STATE) {
        p->finished = p->out = 0;
        p->generation++;
        pthread_cond_broadcast(&p->go);
    } else if (kind == ROUND_STEP) {
        /* the slots are cleared while every worker is idle: a stage that starts early must
         * not find its neighbour's flags of the last step */
        for (int i = 0; i < p->n_workers; i++)
            for (int k = 0; k < p->M; k++) {
                handoff *h = &p->w[i].ho[k];
                h->p = p, h->act = h->grad = NULL;
                atomic_store_explicit(&h->act_ready, 0, memory_order_relaxed);
                atomic_store_explicit(&h->grad_ready, 0, memory_order_relaxed);
            }
        for (int i = 0; i < p->n_workers; i++)
            for (int t = 0; t < p->n_ties; t++) {
                atomic_store_explicit(&p->w[i].tie_ready[t], 0, memory_order_relaxed);
                atomic_store_explicit(&p->w[i].tie_summed[t], 0, memory_order_relaxed);
                atomic_store_explicit(&p->w[i].tie_copied[t], 0, memory_order_relaxed);
            }
        p->finished = p->out = 0;
        p->inf_ss = 0, p->inf_checked = 0;
        p->clip_ss = 0, p->clip_joined = 0;
        p->loss_scale = p->scaler ? tdm_grad_scaler_begin(p->scaler) : 1.0f;
        p->generation++;
        pthread_cond_broadcast(&p->go);
    }
    while (p->finished < p->n_workers) pthread_cond_wait(&p->done, &p->mu);
    bool failed = atomic_load(&p->failed);
    int rc = failed ? tdm_raise(TDM_ERR_STATE, "%s", p->err) : TDM_OK;
    if (failed) p->broken = true;
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* ---- construction ------------------------------------------------------------------------- */

tdm_pipe_opts tdm_pipe_defaults(int stages, int micro_batches) {
    tdm_pipe_opts o = {.stages = stages,
                       .micro_batches = micro_batches,
                       .schedule = TDM_PIPE_1F1B,
                       .replicas = 1,
                       .split_by = TDM_SPLIT_PARAMS};
    return o;
}

double tdm_pipe_ideal_bubble(int stages, int micro_batches) {
    if (stages < 1 || micro_batches < 1) return NAN;
    return (double)(stages - 1) / (double)(micro_batches + stages - 1);
}

static int check_opts(const tdm_module *model, const tdm_pipe_opts *o, int *S, int *R) {
    if (!model || !o) return tdm_raise(TDM_ERR_ARG, "pipeline: NULL model or options");
    if (strcmp(model->ops->kind, "Sequential") != 0 || model->n_children < 1)
        return tdm_raise(TDM_ERR_ARG,
                         "pipeline: the model must be a non-empty Sequential, got "
                         "a %s of %d children",
                         model->ops->kind, model->n_children);
    *S = o->stages;
    *R = o->replicas ? o->replicas : 1;
    if (!o->layer_stage && (*S < 1 || *S > TDM_PIPE_MAX_STAGES))
        return tdm_raise(TDM_ERR_ARG, "pipeline: %d stages (1 to %d)", *S, TDM_PIPE_MAX_STAGES);
    if (o->micro_batches < 1 || o->micro_batches > TDM_PIPE_MAX_MICRO)
        return tdm_raise(TDM_ERR_ARG, "pipeline: %d micro-batches (1 to %d)", o->micro_batches,
                         TDM_PIPE_MAX_MICRO);
    if (*R < 1 || *R > TDM_PIPE_MAX_REPLICAS)
        return tdm_raise(TDM_ERR_ARG, "pipeline: %d replicas (1 to %d)", *R, TDM_PIPE_MAX_REPLICAS);
    if (o->schedule != TDM_PIPE_GPIPE && o->schedule != TDM_PIPE_1F1B)
        return tdm_raise(TDM_ERR_ARG, "pipeline: unknown schedule %d", (int)o->schedule);
    return TDM_OK;
}

/* The S*R*T devices: parsed from the list, or cpu:0 .. cpu:S*R*T-1. */
static int pipe_devices(const tdm_pipe_opts *o, int S, int R, int T, tdm_device *devs) {
    int want = S * R * T;
    if (!o->devices) {
        if (want > TDM_MAX_DEVICES)
            return tdm_raise(TDM_ERR_ARG, "pipeline: %d devices needed, at most %d", want,
                             TDM_MAX_DEVICES);
        for (int i = 0; i < want; i++) devs[i] = tdm_cpu(i);
        return TDM_OK;
    }
    int n = tdm_devices_parse(o->devices, devs, TDM_MAX_DEVICES);
    if (n < 0) {
        char why[512]; /* the message is rewritten by the raise that quotes it */
        snprintf(why, sizeof why, "%s", tdm_last_error());
        return tdm_raise(tdm_last_status(), "pipeline: devices \"%s\": %s", o->devices, why);
    }
    if (n != want)
        return tdm_raise(TDM_ERR_DEVICE,
                         "pipeline: devices \"%s\" lists %d devices, %d stages x %d replicas "
                         "x %d tensor-parallel ranks need %d",
                         o->devices, n, S, R, T, want);
    return TDM_OK;
}

/* Stage s's layers, cloned onto dev, as a Sequential of their own. */
static tdm_module *clone_stage(const tdm_module *model, int lo, int hi, tdm_device dev) {
    tdm_module *kids[256];
    if (hi - lo > 256)
        return tdm_raise_null(TDM_ERR_ARG, "pipeline: a stage of %d layers (at most 256)", hi - lo);
    bool prev = tdm_set_grad_enabled(false);
    int n = 0;
    for (; n < hi - lo; n++)
        if (!(kids[n] = tdm_module_clone(model->children[lo + n], dev))) break;
    tdm_set_grad_enabled(prev);
    if (n < hi - lo) {
        while (n--) tdm_module_free(kids[n]);
        return NULL;
    }
    return tdm_sequential_new(n, kids);
}

/* The threads worlds of the replicas of each (stage, rank) and of the ranks of each (stage,
 * replica). */
static int make_worlds(struct tdm_pipe *p, const tdm_device *devs) {
    tdm_device d[TDM_MAX_DEVICES];
    for (int s = 0; s < p->S; s++) {
        for (int t = 0; t < p->T && p->R > 1; t++) {
            for (int r = 0; r < p->R; r++) d[r] = devs[(s * p->R + r) * p->T + t];
            if (!(p->rep_worlds[s * p->T + t] = tdm_threads_world_new(p->R, d)))
                return tdm_last_status();
        }
        for (int r = 0; r < p->R && p->T > 1; r++)
            if (!(p->tp_worlds[s * p->R + r] =
                      tdm_threads_world_new(p->T, devs + (s * p->R + r) * p->T)))
                return tdm_last_status();
    }
    return TDM_OK;
}

static int build_workers(struct tdm_pipe *p, const tdm_module *model, const tdm_device *devs) {
    p->n_workers = p->S * p->R * p->T;
    int rc = make_worlds(p, devs);
    for (int i = 0; i < p->n_workers && !rc; i++) {
        int s = i / (p->R * p->T), r = i / p->T % p->R, t = i % p->T;
        worker *w = &p->w[i];
        *w = (worker){.p = p, .stage = s, .replica = r, .t = t, .idx = i, .dev = devs[i]};
        if (p->R > 1) w->group = tdm_threads_world_group(p->rep_worlds[s * p->T + t], r);
        if (p->T > 1) w->tp_group = tdm_threads_world_group(p->tp_worlds[s * p->R + r], t);
        w->mod = clone_stage(model, p->first[s], p->first[s + 1], devs[i]);
        if (!w->mod) {
            char d[16], why[512];
            snprintf(why, sizeof why, "%s", tdm_last_error());
            return tdm_raise(tdm_last_status(), "pipeline: stage %d on %s: %s", s,
                             tdm_device_str(devs[i], d), why);
        }
    }
    return rc;
}

static int start_threads(struct tdm_pipe *p) {
    p->spin_ns = tdm_spin_budget(p->n_workers, HANDOFF_SPIN_NS);
    p->gemm_threads = tdm_gemm_threads_for_devices(p->n_workers);
    for (int i = 0; i < p->n_workers; i++) {
        if (pthread_create(&p->w[i].thread, NULL, worker_main, &p->w[i]))
            return tdm_raise(TDM_ERR_NOMEM, "pipeline: cannot start the thread of stage %d",
                             p->w[i].stage);
        p->w[i].started = true;
    }
    return run_round(p, ROUND_INIT); /* each worker's init ends with a finished round */
}

tdm_pipe *tdm_pipe_new(tdm_module *model, const tdm_pipe_opts *o, tdm_optim_factory make_optim,
                       void *optim_arg) {
    int S = 0, R = 0, T = o && o->tp > 1 ? o->tp : 1;
    tdm_device devs[TDM_MAX_DEVICES];
    if (check_opts(model, o, &S, &R)) return NULL;
    if (T > 1 && !o->parallelize)
        return tdm_raise_null(TDM_ERR_ARG,
                              "pipeline: tensor parallelism %d without a "
                              "parallelize function",
                              T);
    if (!make_optim) return tdm_raise_null(TDM_ERR_ARG, "pipeline: NULL optimizer factory");
    int first[TDM_PIPE_MAX_STAGES + 2];
    int rc = tdm_pipe_stage_bounds(model, o, &S, first);
    if (!rc && S * R * T > MAX_WORKERS)
        rc = tdm_raise(TDM_ERR_ARG,
                       "pipeline: %d stages x %d replicas x %d tensor-parallel ranks: "
                       "more than %d threads",
                       S, R, T, MAX_WORKERS);
    if (rc || pipe_devices(o, S, R, T, devs) || tdm_pipe_check_ties(model, o)) return NULL;
    struct tdm_pipe *p = calloc(1, sizeof *p);
    if (!p) return tdm_raise_null(TDM_ERR_NOMEM, "pipeline: out of memory");
    *p = (struct tdm_pipe){.S = S,
                           .M = o->micro_batches,
                           .R = R,
                           .T = T,
                           .parallelize = o->parallelize,
                           .parallelize_arg = o->parallelize_arg,
                           .sched = o->schedule,
                           .make_optim = make_optim,
                           .optim_arg = optim_arg};
    memcpy(p->first, first, sizeof(int) * (size_t)(S + 1));
    p->n_ties = o->n_ties;
    for (int t = 0; t < o->n_ties; t++) {
        p->tie_layer[t][0] = o->ties[t].layer_a, p->tie_layer[t][1] = o->ties[t].layer_b;
        snprintf(p->tie_name[t][0], sizeof p->tie_name[t][0], "%s", o->ties[t].param_a);
        snprintf(p->tie_name[t][1], sizeof p->tie_name[t][1], "%s", o->ties[t].param_b);
    }
    pthread_once(&names_once, names_init);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    tdm_waitq_init(&p->handoffs);
    rc = build_workers(p, model, devs);
    if (!rc) rc = start_threads(p);
    if (rc) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", tdm_last_error());
        tdm_pipe_free(p);
        return tdm_raise_null((tdm_status)rc, "%s", msg);
    }
    return p;
}

/* ---- steps -------------------------------------------------------------------------------- */

static int check_batch(const struct tdm_pipe *p, const tdm_tensor *x, const tdm_tensor *y) {
    char a[96], b[96];
    if (x->ndim < 1 || y->ndim < 1 || x->shape[0] != y->shape[0])
        return tdm_raise(TDM_ERR_SHAPE,
                         "pipeline step: input %s and target %s differ in batch "
                         "size",
                         tdm_shape_str(tdm_shape_of(x), a), tdm_shape_str(tdm_shape_of(y), b));
    int64_t need = (int64_t)p->M * p->R;
    if (x->shape[0] < need)
        return tdm_raise(TDM_ERR_SHAPE,
                         "pipeline step: a batch of %lld rows cannot be cut into %d "
                         "micro-batches on each of %d replicas (at least %lld rows needed)",
                         (long long)x->shape[0], p->M, p->R, (long long)need);
    return TDM_OK;
}

int tdm_pipe_step(tdm_pipe *p, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                  void *loss_arg, float *loss) {
    if (loss) *loss = NAN;
    if (!p || !x || !target || !loss_fn)
        return tdm_raise(TDM_ERR_ARG, "pipeline step: NULL argument");
    if (p->broken)
        return tdm_raise(TDM_ERR_STATE, "pipeline step: a previous step failed inside a stage; "
                                        "the stages' state is lost (build a new pipeline)");
    if (check_batch(p, x, target)) return tdm_last_status();
    p->x = x, p->y = target, p->B = x->shape[0];
    p->loss_fn = loss_fn, p->loss_arg = loss_arg;
    int rc = run_round(p, ROUND_STEP);
    p->skipped = !rc && p->scaler && !isfinite(p->inf_ss);
    if (!rc && p->scaler) rc = tdm_grad_scaler_update_found(p->scaler, p->skipped);
    if (!rc && loss) {
        double sum = 0;
        for (int r = 0; r < p->R; r++) sum += at(p, p->S - 1, r, 0)->loss;
        *loss = (float)sum;
    }
    return rc;
}

/* ---- results ------------------------------------------------------------------------------ */

int tdm_pipe_state_round(struct tdm_pipe *p) {
    return run_round(p, ROUND_STATE);
}

int tdm_pipe_gather(struct tdm_pipe *p, tdm_module *model) {
    p->gather_into = model;
    int rc = run_round(p, ROUND_GATHER);
    p->gather_into = NULL;
    return rc;
}

static worker *worker_at(const tdm_pipe *p, int s, int r) {
    return p && s >= 0 && s < p->S && r >= 0 && r < p->R ? at((tdm_pipe *)p, s, r, 0) : NULL;
}

tdm_module *tdm_pipe_rank_module(tdm_pipe *p, int s, int r, int t) {
    worker *w = worker_at(p, s, r);
    return w && t >= 0 && t < p->T ? at(p, s, r, t)->mod : NULL;
}

int tdm_pipe_tp(const tdm_pipe *p) {
    return p ? p->T : 0;
}

tdm_module *tdm_pipe_stage_module(tdm_pipe *p, int s, int r) {
    worker *w = worker_at(p, s, r);
    return w ? w->mod : NULL;
}

tdm_optim *tdm_pipe_stage_optim(tdm_pipe *p, int s, int r) {
    worker *w = worker_at(p, s, r);
    return w ? w->opt : NULL;
}

int tdm_pipe_set_grad_scaler(tdm_pipe *p, tdm_grad_scaler *s) {
    if (!p) return tdm_raise(TDM_ERR_ARG, "pipe_set_grad_scaler: NULL pipeline");
    p->scaler = s;
    p->skipped = false;
    return TDM_OK;
}

bool tdm_pipe_step_skipped(const tdm_pipe *p) {
    return p && p->skipped;
}

int tdm_pipe_set_clip_grad_norm(tdm_pipe *p, float max_norm) {
    if (!p || !(max_norm >= 0) || !isfinite(max_norm))
        return tdm_raise(TDM_ERR_ARG, "pipe_set_clip_grad_norm: %s", p ? "a bad max_norm" : "NULL");
    p->clip = max_norm;
    return TDM_OK;
}

void tdm_pipe_set_lr(tdm_pipe *p, float lr) {
    for (int i = 0; p && i < p->n_workers; i++)
        if (p->w[i].opt) tdm_optim_set_lr(p->w[i].opt, lr);
}

int tdm_pipe_stage_first_layer(const tdm_pipe *p, int s) {
    return p && s >= 0 && s <= p->S ? p->first[s] : -1;
}

int tdm_pipe_stages(const tdm_pipe *p) {
    return p ? p->S : 0;
}

void tdm_pipe_get_stats(const tdm_pipe *p, tdm_pipe_stats *st) {
    if (!st) return;
    memset(st, 0, sizeof *st);
    if (!p || p->w[0].t_first < 0 || p->generation == 0) return;
    double t0 = INFINITY, t1 = -INFINITY, busy = 0;
    for (int i = 0; i < p->n_workers; i++) {
        const worker *w = &p->w[i];
        if (w->t_first < t0) t0 = w->t_first;
        if (w->t_last > t1) t1 = w->t_last;
        busy += w->busy_us;
        if (w->replica || w->t) continue; /* replica 0's rank 0 */
        st->busy_us[w->stage] = w->busy_us;
        st->max_in_flight[w->stage] = w->max_in_flight;
        st->peak_bytes[w->stage] = w->peak_bytes;
    }
    st->step_us = t1 - t0;
    st->bubble = st->step_us > 0 ? 1.0 - busy / ((double)p->n_workers * st->step_us) : 0;
}

void tdm_pipe_free(tdm_pipe *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->quit = true;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_workers; i++)
        if (p->w[i].started) pthread_join(p->w[i].thread, NULL);
    if (p->n_workers && p->w[0].started) tdm_cpu_gemm_set_threads(p->gemm_threads);
    for (int i = 0; i < p->n_workers; i++) {
        worker *w = &p->w[i];
        for (int j = 0; j < w->n_snaps; j++) free(w->snaps[j].saved);
        free(w->snaps);
        tdm_module_free(w->mod);
    }
    for (int i = 0; i < MAX_WORKERS; i++) {
        tdm_threads_world_free(p->rep_worlds[i]);
        tdm_threads_world_free(p->tp_worlds[i]);
    }
    pthread_cond_destroy(&p->cv);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    tdm_waitq_destroy(&p->handoffs);
    pthread_mutex_destroy(&p->mu);
    free(p);
}
