/* Tandem model and pipeline parallelism: a Sequential cut into stages on different devices,
 * each stage run by its own pinned thread, the batch cut into micro-batches that flow through
 * the stages at once (GPipe or 1F1B), optionally with every stage replicated for data
 * parallelism (a 2-D layout: stages x replicas).
 *
 * Two layers of API:
 * - tdm_pipe_*: the whole thing. Build once from a model, then one call per training step.
 * - Building blocks for other schedules, in autograd.h (they are tape operations, which the
 *   pipeline uses): a differentiable copy between devices whose graphs live on different
 *   threads (tdm_device_recv, tdm_backward_from) and the early release of a finished
 *   micro-batch's activations (tdm_graph_release). tdm_to_device (tensor.h) is the
 *   differentiable copy for a graph that stays on one thread.
 *
 * Activations cross between stages in their own dtype: a stage whose output is bf16 or f16
 * (under autocast, or a cast of its own) sends 2-byte elements, and the gradient of that
 * output comes back in the same dtype; the receiving stage's first op sees the low dtype.
 *
 * Errors follow tensor.h: NULL or a negative tdm_status, with tdm_last_error() naming the
 * cause (stage, device, micro-batch, sizes).
 */
#ifndef TANDEM_PIPELINE_H
#define TANDEM_PIPELINE_H

#include "autograd.h"
#include "parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- splitting a Sequential into stages ---------------------------------------------------- */

typedef enum {
    TDM_SPLIT_PARAMS = 0, /* contiguous stages with the largest stage's parameter count the
                             smallest possible (a proxy for compute in MLPs and transformers) */
    TDM_SPLIT_LAYERS = 1, /* n / k layers per stage, the first n % k stages one more */
} tdm_split_by;

/* Cuts the n children of seq into k contiguous non-empty stages: first[s] is the index of
 * stage s's first layer, first[k] == n (first has room for k + 1 entries). Returns TDM_OK, or
 * TDM_ERR_ARG when k < 1 or k > n ("3 stages for a Sequential of 2 layers"). */
int tdm_pipe_split(const tdm_module *seq, int k, tdm_split_by by, int *first);
/* The cut tdm_pipe_split makes by TDM_SPLIT_PARAMS for n layers whose parameter counts are
 * params[0..n): what a pipeline's stages will hold, known before the model is built (a memory
 * estimate). first as tdm_pipe_split's; same errors. */
int tdm_pipe_split_params(const int64_t *params, int n, int k, int *first);

/* ---- the pipeline -------------------------------------------------------------------------- */

#define TDM_PIPE_MAX_STAGES   16
#define TDM_PIPE_MAX_REPLICAS 16
#define TDM_PIPE_MAX_MICRO    64
#define TDM_PIPE_MAX_TIES     4

/* Two layers' copies of one weight (a language model's token embedding, which its head reads
 * again: Megatron-LM's tied embeddings across stages): parameter param_a of layer layer_a
 * and param_b of layer_b (names within the layer, "wte.weight"), of one shape. After each
 * step's backward the two gradients are summed into both copies (the sum is made by layer_a's
 * stage and copied to layer_b's), so both take the same update and stay equal bit for bit,
 * as one tensor read twice would be. The two copies must start equal. */
typedef struct {
    int layer_a;
    const char *param_a;
    int layer_b;
    const char *param_b;
} tdm_pipe_tie;

typedef enum {
    TDM_PIPE_GPIPE = 0, /* all forwards, then all backwards (last micro-batch first):
                           every micro-batch's activations are alive at once */
    TDM_PIPE_1F1B = 1,  /* PipeDream-Flush: stage s runs min(stages-1-s, M) forwards, then
                           alternates one forward and one backward: at most stages-s
                           micro-batches alive on stage s */
} tdm_pipe_schedule;

typedef struct {
    int stages;        /* K >= 1; 0 with layer_stage set: taken from the map */
    int micro_batches; /* M >= 1: the batch (each replica's share) is cut into M row ranges */
    tdm_pipe_schedule schedule;
    int replicas; /* data-parallel replicas of every stage (0 means 1) */
    /* devices[s * replicas + r] runs stage s of replica r; all distinct. A list as
     * tdm_devices_parse reads it ("cpu:0,cpu:1", "4"); NULL: cpu:0 .. cpu:K*R-1. */
    const char *devices;
    /* Optional explicit placement: layer_stage[i] is the stage of layer i (n entries,
     * starting at 0, each stage a contiguous run, rising by 0 or 1). Layer i then runs on
     * devices[layer_stage[i] * replicas + r]. NULL: an even split by split_by. */
    const int *layer_stage;
    tdm_split_by split_by;
    const tdm_pipe_tie *ties; /* n_ties (at most TDM_PIPE_MAX_TIES) tied copies, or NULL */
    int n_ties;
    /* Tensor parallelism inside each stage (3-D parallelism, 0 or 1: none): every (stage,
     * replica) runs on tp devices, devices[(s * replicas + r) * tp + t] its rank t, each with a
     * clone of the stage that parallelize(stage, group, parallelize_arg) splits over their
     * group (tdm_gpt_parallelize_stage) on its own thread before its optimizer is made. The
     * ranks of a stage hand activations to the same rank of the next; every rank of the last
     * stage computes the loss; replicas average over the ranks of the same stage and t. */
    int tp;
    int (*parallelize)(tdm_module *stage, tdm_group *tp, void *arg);
    void *parallelize_arg;
} tdm_pipe_opts;

/* K stages, M micro-batches, 1F1B, one replica, devices cpu:0.., split by parameters. */
tdm_pipe_opts tdm_pipe_defaults(int stages, int micro_batches);

typedef struct tdm_pipe tdm_pipe;

/* Splits model (a Sequential whose layers can be cloned; it is left unchanged and stays the
 * caller's) into stages, clones each stage's layers onto its devices, and starts one pinned
 * thread per (stage, replica) that flattens its stage's parameters and builds its optimizer
 * with make_optim(ps, optim_arg) (a stage without parameters gets none). NULL and an error
 * naming the cause: not a Sequential, more stages than layers, a bad or repeated device, a
 * device count that is not stages x replicas, a layer that cannot be cloned, a bad map, a
 * failing factory, a tie naming a layer or parameter that is not there or copies of two
 * shapes. */
tdm_pipe *tdm_pipe_new(tdm_module *model, const tdm_pipe_opts *o, tdm_optim_factory make_optim,
                       void *optim_arg);

/* One training step on x [B, ...], target [B, ...] (the caller's tensors on any device; read
 * during the call only): rows are split over the replicas as DataParallel splits them (the
 * first B % R take one more), each replica's rows into M micro-batches the same way; every
 * stage runs its schedule, gradients accumulate over micro-batches with each micro-batch's
 * mean loss weighted by rows/B, so the accumulated gradient is that of the whole batch's
 * mean loss; replicas of a stage sum their gradients (rank-ordered all-reduce); then every
 * stage steps its optimizer once. loss_fn(out, target_rows, row0, loss_arg) gives the MEAN
 * loss of a micro-batch (row0 its first global row); it runs on the last stage's threads,
 * on its device. *loss (may be NULL) receives the batch's mean loss.
 *
 * Layers that depend on the batch behave as follows. Dropout draws exactly the masks of
 * the unsplit batch (each micro-batch runs under a parallel context keyed by global rows,
 * and every layer's state is reset to the step's start before each micro-batch's forward).
 * Batch norm normalises each micro-batch with its own statistics and updates its running
 * statistics once per micro-batch, as torch's Pipe does (deferred_batch_norm=False); with
 * replicas, replica 0's buffers are broadcast at the start of every step (DDP's
 * broadcast_buffers). Errors: B not split into at least one row per micro-batch and
 * replica, batch sizes of x and target that differ, or a failure in a stage (its message
 * names the stage, replica and device). After a failure inside a stage the pipeline stays
 * failed: later steps return TDM_ERR_STATE. */
int tdm_pipe_step(tdm_pipe *p, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                  void *loss_arg, float *loss);

/* Copies the trained parameters and buffers (replica 0's) back into model, the Sequential
 * the pipeline was built from (or one with the same layers), e.g. to evaluate or save it;
 * under tensor parallelism the stages' parts gathered whole (tdm_tp_gather_whole, on the
 * stages' threads). Returns TDM_OK or TDM_ERR_SHAPE naming the first layer that does not
 * match. */
int tdm_pipe_copy_to(tdm_pipe *p, tdm_module *model);
/* The reverse, e.g. after a checkpoint was read into model: every stage of every replica
 * takes its layers' parameters and buffers from model (under tensor parallelism each rank its
 * parts, through a whole copy of the stage). TDM_ERR_SHAPE as above. */
int tdm_pipe_copy_from(tdm_pipe *p, const tdm_module *model);
/* The stages' optimizer state (replica 0's: the replicas step alike) into whole, an optimizer
 * of the same kind over model's parameters (model as tdm_pipe_copy_to's; its flat buffer holds
 * the stages' parameters one stage after another), and its step count: what a checkpoint of
 * the pipeline saves. tdm_pipe_state_from is the reverse, into every replica's stages (a
 * resume). Under tensor parallelism the ranks' parts go through a whole copy of each stage and
 * an optimizer over it (tdm_tp_gather_state, a collective on the stages' threads;
 * tdm_tp_scatter_state). TDM_ERR_ARG for another kind of optimizer, TDM_ERR_SHAPE when the
 * parameters do not add up. */
int tdm_pipe_state_to(tdm_pipe *p, tdm_module *model, tdm_optim *whole);
/* ZeRO stage 1 over the replicas: the R replicas of each stage (of each tensor-parallel rank)
 * share its optimizer's state (tdm_optim_shard over their group), each holding about 1/R of
 * it and updating that range of the stage's parameters, which it then broadcasts; the
 * gradients and the parameters stay whole, and every step gives what the unsharded pipeline
 * gives, bit for bit. tdm_pipe_state_to and _from gather and scatter the shards. Between
 * steps; nothing to do with one replica. TDM_OK, or tdm_optim_shard's error (the replicas'
 * memory must be shared: CPU devices). */
int tdm_pipe_shard_optimizer(tdm_pipe *p);
int tdm_pipe_state_from(tdm_pipe *p, tdm_module *model, tdm_optim *whole);

/* Stage s of replica r: its Sequential (children named "0", "1", ... locally, on the
 * stage's device) and its optimizer (NULL for a stage without parameters); owned by the
 * pipeline. Under tensor parallelism, tensor-parallel rank 0's (its parts). NULL for an index
 * out of range. Do not use them while a step runs. */
tdm_module *tdm_pipe_stage_module(tdm_pipe *p, int s, int r);
/* Tensor-parallel rank t's module of stage s of replica r (t == 0: tdm_pipe_stage_module's);
 * NULL out of range. */
tdm_module *tdm_pipe_rank_module(tdm_pipe *p, int s, int r, int t);
/* The tensor-parallel ranks of each (stage, replica): tdm_pipe_opts.tp, or 1. */
int tdm_pipe_tp(const tdm_pipe *p);
tdm_optim *tdm_pipe_stage_optim(tdm_pipe *p, int s, int r);
/* fp16's loss scaling in every step (PyTorch's GradScaler over a pipeline; s stays the
 * caller's and must outlive its use here; NULL turns it off): the last stage's losses are
 * multiplied by the scale, every stage's gradient (summed over its replicas) is checked and
 * unscaled, a step in which any stage's or replica's gradient holds an inf or NaN updates no
 * stage, and the scale is updated once per tdm_pipe_step (tdm_grad_scaler_update's rule).
 * TDM_ERR_ARG for a NULL p. */
int tdm_pipe_set_grad_scaler(tdm_pipe *p, tdm_grad_scaler *s);
/* Whether the last tdm_pipe_step skipped its update (fp16 found an inf or NaN); false without
 * a scaler or for a NULL p. */
bool tdm_pipe_step_skipped(const tdm_pipe *p);
/* clip_grad_norm_ in every step (0: off, the default): after the replicas have averaged their
 * gradients (and fp16's have been unscaled), the whole model's gradient norm is joined over
 * the stages (each tied weight and, under tensor parallelism, each whole parameter counted
 * once, every part's squares summed), and every stage scales its gradients by max_norm /
 * (norm + 1e-6) when below 1, as one device's tdm_clip_grad_norm does. TDM_ERR_ARG for a NULL
 * p or a max_norm that is negative or not finite. */
int tdm_pipe_set_clip_grad_norm(tdm_pipe *p, float max_norm);
/* Sets the learning rate of every stage's optimizer (a schedule's tdm_sched_lr per step). */
void tdm_pipe_set_lr(tdm_pipe *p, float lr);
/* The index of stage s's first layer in the original Sequential (s == stages: its length). */
int tdm_pipe_stage_first_layer(const tdm_pipe *p, int s);
int tdm_pipe_stages(const tdm_pipe *p);

/* What the last step did, from the spans the stages recorded (the same times as the trace's
 * "F k" / "B k" spans). */
typedef struct {
    double step_us;                          /* first forward start to last backward end */
    double busy_us[TDM_PIPE_MAX_STAGES];     /* replica 0's forward + backward time */
    double bubble;                           /* 1 - sum(busy) / (stages*replicas*step_us) */
    int max_in_flight[TDM_PIPE_MAX_STAGES];  /* most micro-batches alive at once */
    int64_t peak_bytes[TDM_PIPE_MAX_STAGES]; /* replica 0's device: allocator peak during
                                                the step minus what it held at its start */
} tdm_pipe_stats;
/* Fills *st (zeros before the first step). */
void tdm_pipe_get_stats(const tdm_pipe *p, tdm_pipe_stats *st);
/* The bubble of a perfectly balanced pipeline: (stages - 1) / (M + stages - 1). */
double tdm_pipe_ideal_bubble(int stages, int micro_batches);

/* Stops the threads and frees the stages (not the model given to tdm_pipe_new). NULL is
 * allowed. */
void tdm_pipe_free(tdm_pipe *p);

#ifdef __cplusplus
}
#endif
#endif
