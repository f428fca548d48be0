/* Tandem parallel strategies: one handle for however a model is trained, one device, several
 * devices of this process (DataParallel), one device per process (DDP), a pipeline, and the
 * sharded modes of the data-parallel ones (ZeRO stages 1 to 3, FSDP), behind one set of calls.
 *
 * A training loop built on a strategy asks it for a step, an evaluation forward, the model and
 * optimizer of each replica to save or load, and a description, and never which strategy it
 * holds:
 *
 *   tdm_strategy *st = tdm_strategy_data_parallel(model, devs, n, NULL, make_optim, arg);
 *   tdm_strategy_set_clip_grad_norm(st, 1.0f);
 *   for (...) {
 *       tdm_strategy_set_lr(st, tdm_sched_lr(&sched, step));
 *       for (k = 0; k + 1 < accum; k++) tdm_strategy_accumulate(st, x[k], y[k], loss, arg, NULL);
 *       tdm_strategy_step(st, x[k], y[k], loss, arg, &mean_loss);
 *   }
 *   tdm_strategy_free(st);
 *
 * Each strategy is one file, src/parallel/strategy_NAME.c, filling in the table of calls of
 * src/parallel/strategy.h (docs/HACKING.md, "A new parallel strategy"). The lower-level
 * objects (tdm_dp, tdm_ddp, tdm_pipe) stay available for programs that want their own loop.
 *
 * Errors follow tensor.h: NULL or a negative tdm_status, with tdm_last_error() naming the cause.
 */
#ifndef TANDEM_STRATEGY_H
#define TANDEM_STRATEGY_H

#include "parallel.h"
#include "pipeline.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_strategy tdm_strategy;

/* ---- making one --------------------------------------------------------------------------- */

/* Training on the device model is on, in this thread: the optimizer is make_optim over
 * tdm_module_parameters(model). The model stays the caller's; the optimizer is the strategy's.
 * NULL and an error when the factory fails. */
tdm_strategy *tdm_strategy_one_device(tdm_module *model, tdm_optim_factory make_optim,
                                      void *optim_arg);
/* DataParallel over this process's n devices, joined with every other process of processes
 * (NULL: this process alone): tdm_dp_new_distributed's arguments and rules (a collective over
 * processes). model becomes replica 0 and stays the caller's. NULL and tdm_dp's error. */
tdm_strategy *tdm_strategy_data_parallel(tdm_module *model, const tdm_device *devices, int n,
                                         tdm_group *processes, tdm_optim_factory make_optim,
                                         void *optim_arg);
/* DDP: this process's model on its one device, gradients averaged over g (one rank per process,
 * e.g. tdm_mpi_init's group) with o's buckets (NULL: tdm_ddp_defaults). A collective over g, as
 * tdm_ddp_new is; g must outlive the strategy. model stays the caller's. NULL and the error of
 * tdm_ddp_new or of the factory. */
tdm_strategy *tdm_strategy_distributed(tdm_module *model, tdm_group *g, const tdm_ddp_opts *o,
                                       tdm_optim_factory make_optim, void *optim_arg);
/* A pipeline: tdm_pipe_new(model, o, make_optim, optim_arg). model stays the caller's and is
 * where tdm_strategy_sync_model puts the trained weights. No accumulation (the micro-batches
 * are the pipeline's) or sharding; clipping joins the stages' norms
 * (tdm_pipe_set_clip_grad_norm). The stages hold the model in parts (holds_parts):
 * tdm_strategy_optim_gather gives a whole optimizer over model (the stages' weights in model),
 * tdm_strategy_push_whole hands model and a whole optimizer back to every stage (a checkpoint
 * and its resume; stages split over tensor-parallel ranks too). NULL and tdm_pipe_new's
 * error. */
tdm_strategy *tdm_strategy_pipeline(tdm_module *model, const tdm_pipe_opts *o,
                                    tdm_optim_factory make_optim, void *optim_arg);
/* A pipeline of a model that is not a Sequential itself: view is a Sequential of copies of its
 * layers (tdm_gpt_pipeline_model, with o->ties naming its tied copies), which the stages are
 * cut from; tdm_strategy_sync_model writes the trained weights into view and then into model
 * through to_model(model, view) (tdm_gpt_from_pipeline_model), and model runs the
 * evaluation; to_view(view, model) (tdm_gpt_to_pipeline_model) is the reverse, for a resume.
 * Both copy parameter values only: optimizer state crosses through them too. The strategy
 * owns view from the call on (freed with it, or at once on an error). */
tdm_strategy *tdm_strategy_pipeline_view(tdm_module *model, tdm_module *view,
                                         int (*to_model)(tdm_module *model, const tdm_module *view),
                                         int (*to_view)(tdm_module *view, const tdm_module *model),
                                         const tdm_pipe_opts *o, tdm_optim_factory make_optim,
                                         void *optim_arg);

/* Inside a loss_fn that tdm_strategy_tensor_parallel's step calls, the rank's split model
 * whose output it got (its loss may need the model: tdm_gpt_loss_of over vocabulary-parallel
 * logits, each rank's columns); inside a pipeline's (tdm_pipe_step's), the last stage's module;
 * NULL on any other thread or outside loss_fn, where the output is the whole model's. */
tdm_module *tdm_strategy_loss_module(void);

/* Tensor parallelism composed with data parallelism over this process's n devices, laid out
 * as a mesh dp x tp (dp = n / tp; row-major as tdm_mesh_new: devices 0 .. tp-1 are one
 * tensor-parallel group, devices 0, tp, 2 tp, ... one data-parallel group). Each device gets
 * a clone of model and runs it on a thread of its own, where
 * o->parallelize splits it over its tp group (tdm_gpt_parallelize, or the caller's own plan with
 * tdm_column_linear_from and the rest) before its optimizer is made over its parts. A step
 * gives every rank of data-parallel row d the same rows of the batch (the batch split over dp
 * rows as DataParallel splits it over devices), averages the gradients over each dp group
 * (DDP) in the step's last backward, clips by the whole
 * model's norm (tdm_tp_clip_grad_norm) and steps each rank's optimizer. loss_fn runs on the
 * ranks' threads; every rank of a row gets the same loss. model stays the caller's and
 * whole, on any device: the host's (a CPU device outside devices, where tandem train puts it)
 * keeps the devices' memory for the parts, and a checkpoint's whole optimizer off them. It
 * is idle: so that its device holds no more than it needs, its gradients are given
 * back here for good (do not run its backward while the strategy lives) and its values at
 * each step; tdm_strategy_sync_model gathers the trained weights into it (they stay until the
 * next step), tdm_strategy_optim_gather also returns a whole optimizer over it, and after a
 * checkpoint is read into them (before the first step or after a sync),
 * tdm_strategy_push_whole hands both back to the ranks (a run may resume on another tp or
 * dp). tdm_strategy_replica(st, 0) is model; tdm_strategy_optim(st, 0) is the first rank's
 * optimizer of its parts (learning rate, step count). tdm_strategy_set_shard with
 * TDM_SHARD_OPTIMIZER shards each rank's optimizer state over its dp group (ZeRO stage 1;
 * nothing at dp 1), TDM_SHARD_GRADIENTS its averaged gradient too (stage 2; clipping then
 * joins the shards' norms), TDM_SHARD_PARAMETERS its parts too (stage 3, by the units
 * units_of gives on each rank's split model: FSDP with TP); bf16 gradient averaging and fp16
 * loss scaling are refused naming it. NULL and an error naming the
 * device and mesh coordinates of a rank that failed to set up.
 *
 * Across processes (o->procs, tdm_mpi_init's group): device i of process p is rank p n + i of
 * the mesh (n a multiple of tp, each process holding whole tp groups, or a divisor of it), its
 * groups MPI sub-groups, or with n > 1 groups of the two-level world over this process's
 * devices and the processes. A step's batch is then this process's dp rows' (n / tp of them;
 * every process of a tp group spanning processes gives the same rows, the loss is the row's);
 * tdm_strategy_forward runs each process's input through its row and returns the whole output on
 * every process; the gathers write the whole model and optimizer on process 0 only (the
 * others take part), and push_whole takes every process's part from its own whole model (each
 * read the checkpoint). Every process calls every entry, in the same order. */
typedef struct {
    int tp;           /* the tensor-parallel degree: n (or procs's size x n) a multiple of it */
    tdm_group *procs; /* NULL: this process's devices; else its processes (see above) */
    /* Splits replica, a whole clone of the model on its device, over tp, on the rank's thread
     * (a collective over tp). TDM_OK or an error. */
    int (*parallelize)(tdm_module *replica, tdm_group *tp, void *arg);
    /* The whole model's output from a rank's, in tdm_strategy_forward (a collective over tp:
     * every rank of a row calls it), e.g. tdm_gpt_whole_logits under vocabulary parallelism;
     * NULL: a rank's output is whole already. */
    tdm_tensor *(*whole_output)(tdm_module *replica, tdm_tensor *out, void *arg);
    void *arg;
} tdm_tp_strategy_opts;
tdm_strategy *tdm_strategy_tensor_parallel(tdm_module *model, const tdm_device *devices, int n,
                                           const tdm_tp_strategy_opts *o,
                                           tdm_optim_factory make_optim, void *optim_arg);

/* ---- settings, between steps ------------------------------------------------------------- */

/* The one sharding call of the library for every strategy (ZeRO stages, FSDP's sharding
 * strategies): shards over every data-parallel rank what kind names, as tdm_ddp_set_shard
 * describes for one rank (DataParallel runs it on every replica; src/parallel/dp_shard.h), with
 * stage 3's units taken from units_of on each replica (NULL: each replica's children holding
 * parameters). A collective over the processes; call it after any restore of the optimizers' state
 * and before tdm_strategy_step. TDM_SHARD_NONE, and any kind on one device (nobody to share with),
 * change nothing. TDM_ERR_ARG for a NULL st, an unknown kind or a pipeline asked to shard ("a
 * pipeline's stages step optimizers of their own"); the wrapper's errors otherwise (a kind below
 * the current one, failing units). */
int tdm_strategy_set_shard(tdm_strategy *st, tdm_shard_kind kind, tdm_units_fn units_of);
/* The kind in effect: the last one set, TDM_SHARD_NONE before any, on one device and for a NULL
 * st. */
tdm_shard_kind tdm_strategy_shard(const tdm_strategy *st);
/* Whether each rank holds only its shard of the optimizer state (and so writes a sharded
 * checkpoint): false without sharding, on one device, and for the CPU devices of one process
 * below stage 3, whose shared-memory update holds the state once already. */
bool tdm_strategy_state_split(const tdm_strategy *st);
/* Clips the averaged gradient to a global 2-norm of max_norm before every update
 * (clip_grad_norm_; from the shards under stage 2); 0 turns it off, the default. TDM_ERR_ARG
 * for a negative or non-finite max_norm, or for a pipeline and max_norm > 0. */
int tdm_strategy_set_clip_grad_norm(tdm_strategy *st, float max_norm);
/* The dtype the ranks' gradients are averaged in (tdm_ddp_opts.reduce_dtype: TDM_F32, the
 * default, or TDM_BF16, PyTorch's bf16_compress_hook), between steps: DDP's, and every
 * DataParallel replica's across processes or GPUs (tdm_dp_set_reduce_dtype: the CPU devices
 * of one process average in shared memory and refuse bf16, naming why). One device averages
 * nothing: accepted. TDM_ERR_ARG for a NULL st, another dtype, a pipeline (its replicas
 * average in f32) or the refusal above; TDM_ERR_NOMEM. */
int tdm_strategy_set_reduce_dtype(tdm_strategy *st, tdm_dtype dt);
/* The learning rate of every replica's (every stage's) optimizer. NaN leaves it as it was. */
void tdm_strategy_set_lr(tdm_strategy *st, float lr);
/* CUDA graphs (tdm_graph_capture, runtime.h) for the steady-state step: after `warmup` eager
 * steps (>= 1: the first steps make the optimizer's state and fill the allocator's cache), the
 * next step's zeroing of the gradients, forward, loss and backward are recorded once and
 * replayed for every later step whose batch has the recorded shapes and dtypes (another batch,
 * a last partial one, runs eagerly); the gradient clipping and the optimizer's update run
 * eagerly after the replay, so that a learning rate or step count that changes between steps
 * is read each step. The loss function runs once, at the recording: what it writes on the
 * device is written again, at the same place, by each replay (nothing it does on the host is
 * repeated). A replay gives the eager step's results bit for bit. Steps of several micro-batches
 * (tdm_strategy_accumulate) and fp16 steps (their loss scale changes) run eagerly. When the
 * recording fails (dropout in the model, a read back to the host in the loss), that step and
 * every later one run eagerly and tdm_strategy_graph_replays says why (what the failed recording
 * did on the host stays done: the random numbers a dropout drew are spent).
 * TDM_ERR_ARG for warmup < 1; TDM_ERR_DEVICE when the model is not on a GPU; TDM_ERR_STATE for a
 * strategy over several devices or processes (one GPU only, for now). */
int tdm_strategy_set_graphs(tdm_strategy *st, int warmup);
/* The steps replayed from a graph so far; *why (may be NULL) is set to the reason the recording
 * failed (the strategy's, valid until it is freed), or NULL while graphs are on or were never
 * asked for. */
int64_t tdm_strategy_graph_replays(const tdm_strategy *st, const char **why);

/* Mixed precision (docs/MIXED_PRECISION.md): dt TDM_BF16 or TDM_F16 runs every forward a step
 * runs (each replica's, each pipeline stage's, and tdm_strategy_forward's) and the loss
 * function inside an autocast region of dt (tandem/autocast.h), opened on the thread that runs
 * it: DataParallel's replica threads and a pipeline's stage threads open their own. Backward
 * runs outside any region, each op's gradient in the dtype its forward ran; parameters,
 * gradients, the gradient exchange and the optimizer stay f32. TDM_F32 turns it off (the
 * default). The regions hook the forward modules (tdm_module_set_forward_hooks, around any
 * hooks they had, FSDP's included); the strategy removes them when freed. TDM_F16 adds a
 * gradient scaler (tdm_grad_scaler_defaults) in PyTorch's order: the loss scaled before
 * backward, the averaged gradient unscaled before clipping, the step skipped and the scale
 * backed off on an inf or NaN. Every rank (each DataParallel replica, each process) checks
 * the same averaged gradient, or under ZeRO's sharding its shard, and a pipeline's stages
 * each their own, with the finding agreed over all of them, so every rank and stage skips the
 * same steps (tdm_dp_set_grad_scaler, tdm_ddp_unscale, tdm_pipe_set_grad_scaler). Between
 * steps. TDM_ERR_ARG for a NULL st; TDM_ERR_DTYPE for another dtype; TDM_ERR_NOMEM. */
int tdm_strategy_set_precision(tdm_strategy *st, tdm_dtype dt);
/* The dtype set: TDM_F32 before any, and for a NULL st. */
tdm_dtype tdm_strategy_precision(const tdm_strategy *st);
/* The fp16 gradient scaler, owned by the strategy (its state goes into checkpoints:
 * tdm_grad_scaler_get_state / _set_state); NULL unless the precision is TDM_F16. */
tdm_grad_scaler *tdm_strategy_grad_scaler(tdm_strategy *st);
/* Whether the last tdm_strategy_step skipped the optimizers' step (fp16: an inf or NaN in the
 * averaged gradient). False for a NULL st and without a scaler. */
bool tdm_strategy_step_skipped(const tdm_strategy *st);

/* ---- training and evaluation ------------------------------------------------------------- */

/* One optimizer step, its last micro-batch being x [B, ...], target [B, ...] (the caller's
 * tensors; with several devices on the host): forward, loss_fn(out, target_rows, row0, arg)
 * giving the MEAN loss of rows [row0, row0 + b) of x, backward, the gradients added to those of
 * the tdm_strategy_accumulate calls since the last step and averaged over the ranks, clipping
 * (tdm_strategy_set_clip_grad_norm), and the optimizers' step. loss_fn runs on the caller's
 * thread when tdm_strategy_loss_on_caller says so, else on the replicas' (or the last stage's)
 * threads at once. *loss (may be NULL) receives the batch's mean loss; where the loss is on the
 * caller's thread, reading it waits for the device: record it in loss_fn instead. Errors name
 * the replica, stage or device that failed. */
int tdm_strategy_step(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                      void *loss_arg, float *loss);
/* Gradient accumulation (no_sync): forward and backward of one micro-batch, its gradients
 * added to the step's, no exchange and no update; as tdm_strategy_step otherwise. loss_fn
 * divides by the micro-batch count for a mean. TDM_ERR_STATE for a pipeline. */
int tdm_strategy_accumulate(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target,
                            tdm_loss_fn loss_fn, void *loss_arg, float *loss);
/* Whether loss_fn runs on the caller's thread, its tensors on the first device (so it may
 * record into the caller's device tensors), rather than on the replicas' threads. */
bool tdm_strategy_loss_on_caller(const tdm_strategy *st);
/* The trained model's output for x [B, ...] on the first device, in evaluation as the caller
 * set the model's mode: split over the devices where there are several (tdm_dp_forward), else
 * the model's forward. Without gradients if grad mode is off. *out is owned by the caller's
 * open scope; NULL and an error on failure. Call tdm_strategy_sync_model first. */
int tdm_strategy_forward(tdm_strategy *st, tdm_tensor *x, tdm_tensor **out);
/* Brings the caller's model up to the trained weights where the strategy trains copies (a
 * pipeline's stages are copied back; the others train the model itself). TDM_OK or the copy's
 * error. */
int tdm_strategy_sync_model(tdm_strategy *st);

/* ---- state, for checkpoints --------------------------------------------------------------- */

/* How many replicas this process holds (each saves and loads its own state): DataParallel's
 * devices, else 1; 0 for a NULL st. */
int tdm_strategy_replicas(const tdm_strategy *st);
/* Replica r's model and optimizer (0 <= r < replicas), owned by the strategy but for replica
 * 0's model, the caller's. A pipeline's: the caller's model (after tdm_strategy_sync_model) and
 * the first stage's optimizer with parameters. tdm_strategy_optim is NULL for a replica that
 * steps no optimizer of its own (CPU devices of one process below stage 3: replica 0's steps
 * them all); both are NULL for r out of range. */
tdm_module *tdm_strategy_replica(tdm_strategy *st, int r);
tdm_optim *tdm_strategy_optim(tdm_strategy *st, int r);
/* A whole, unsharded copy of replica 0's optimizer, its shards gathered from every rank
 * (tdm_optim_gather, tdm_dp_optim_gather): the state a whole checkpoint saves. A collective over
 * the processes when the state is split (every process calls it, between steps); a copy
 * otherwise. Caller-owned (tdm_optim_free). NULL and an error on failure, and for a pipeline,
 * whose stages' optimizers are not one. */
tdm_optim *tdm_strategy_optim_gather(tdm_strategy *st);
/* Whether the ranks hold parts of the model (tensor parallelism): then a checkpoint is
 * written from the caller's model and tdm_strategy_optim_gather's whole optimizer, and read
 * back into the caller's model and an optimizer made over it, which tdm_strategy_push_whole
 * hands to the ranks. False for a NULL st. */
bool tdm_strategy_holds_parts(const tdm_strategy *st);
/* The caller's model and whole (an optimizer over the caller's model of the kind the
 * strategy's factory makes; NULL: the weights only) handed to the ranks holding their parts,
 * each taking its part of every tensor, after a checkpoint was read into them. Between steps.
 * TDM_OK at once for a strategy that trains the caller's model itself; TDM_ERR_ARG for a NULL
 * st; TDM_ERR_STATE when a step ran since the last tdm_strategy_sync_model (the model's
 * values were given back, see tdm_strategy_tensor_parallel); a rank's error naming it. */
int tdm_strategy_push_whole(tdm_strategy *st, tdm_optim *whole);
/* Under stage 3, every replica's parameters whole (to save or load the model) until
 * tdm_strategy_release_params shards them again, keeping what was loaded meanwhile.
 * Collectives over the processes; TDM_OK and nothing done otherwise. */
int tdm_strategy_gather_params(tdm_strategy *st);
/* Whether every data-parallel replica holds the same parameters, bit for bit, as they must
 * (one broadcast at the start, one averaged update a step): each replica's parameters are
 * hashed tensor by tensor, compared with replica 0's in this process and, when procs (the
 * processes' group, or NULL) has several ranks, with rank 0's through one all-gather (a
 * collective: every process calls it at the same step; under ZeRO stage 3 the parameters are
 * gathered for it). TDM_OK, or TDM_ERR_STATE naming the first parameter that differs, the
 * rank (and device) that holds it and how many differ, on every process alike; TDM_ERR_ARG
 * for a NULL st or a pipeline (its stages hold different parameters). Under tensor
 * parallelism each rank's parts are compared with those of dp row 0's rank in its tp column
 * (one process: procs is not used), the rank named with its device and mesh place. For
 * `tandem train --check-replicas N`: silent divergence (other data under the same path on one
 * machine, a non-deterministic kernel, a hardware fault) becomes an error. */
int tdm_strategy_check_replicas(tdm_strategy *st, tdm_group *procs);
int tdm_strategy_release_params(tdm_strategy *st);

/* ---- what it is ----------------------------------------------------------------------------- */

/* The data-parallel ranks that share each batch: devices x processes (a pipeline: its
 * replicas); 0 for a NULL st. */
int tdm_strategy_ranks(const tdm_strategy *st);

/* Bytes per rank against the unsharded whole, replica 0's: what sharding saves. */
typedef struct {
    int64_t state, state_whole;   /* optimizer state */
    int64_t params, params_whole; /* parameters kept between steps (their shard under stage 3) */
    int64_t grads, grads_whole;   /* gradients kept between steps (their shard under stage 2+) */
} tdm_strategy_memory;
/* Fills *m from replica 0's optimizer and parameters (all zero for a NULL st). */
void tdm_strategy_memory_get(tdm_strategy *st, tdm_strategy_memory *m);

/* A phrase for a run's header line, what it does with batch rows per step: "data parallel, 16
 * samples per device per step", "2 pipeline stages, layers 0-1 2-3, 4 micro-batches, 1f1b";
 * empty for one device. Writes at most cap bytes, NUL-terminated; returns buf. */
char *tdm_strategy_describe(tdm_strategy *st, int64_t batch, char *buf, size_t cap);

/* Frees what the strategy made: its wrapper, threads, replicas and optimizers (not the caller's
 * model nor the group). NULL is allowed. */
void tdm_strategy_free(tdm_strategy *st);

#ifdef __cplusplus
}
#endif
#endif
