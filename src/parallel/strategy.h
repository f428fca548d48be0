/* The table of calls behind tdm_strategy (tandem/strategy.h). A strategy is one file,
 * src/parallel/strategy_NAME.c: a struct whose first member is a tdm_strategy, a static const
 * tdm_strategy_ops naming its functions, and a public constructor that allocates the struct,
 * sets base.ops and the fields below, and returns &s->base. strategy.c checks the arguments of
 * every public call, then calls the entry with the strategy (cast it back to the file's struct).
 *
 * An entry that is NULL means "nothing to do" or "not supported", as its comment says. */
#ifndef TDM_PARALLEL_STRATEGY_H
#define TDM_PARALLEL_STRATEGY_H

#include "tandem/strategy.h"

typedef struct tdm_strategy_ops {
    /* One micro-batch: forward, loss_fn, backward; when last, also the exchange of gradients,
     * clipping at st->clip and the optimizers' step. first: the step's first micro-batch
     * (gradients start from zero). Required. */
    int (*step)(tdm_strategy *st, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                void *loss_arg, bool first, bool last, float *loss);
    /* Evaluation forward of x into *out (caller's scope). Required. */
    int (*forward)(tdm_strategy *st, tdm_tensor *x, tdm_tensor **out);
    /* CUDA graphs after warmup eager steps (tdm_strategy_set_graphs; checked >= 1); NULL: the
     * strategy records none. */
    int (*set_graphs)(tdm_strategy *st, int warmup);
    /* The steps replayed so far, *why the recording's failure (tdm_strategy_graph_replays). */
    int64_t (*graph_replays)(const tdm_strategy *st, const char **why);
    /* The shard kind over the ranks, units_of for stage 3 (may be NULL); on success sets
     * st->shard to the kind in effect (left TDM_SHARD_NONE where there is nothing to share)
     * and st->state_split. Called only for a kind other than st->shard. NULL: the strategy
     * cannot shard (an error). */
    int (*set_shard)(tdm_strategy *st, tdm_shard_kind kind, tdm_units_fn units_of);
    /* The dtype gradients are averaged in (tdm_ddp_opts.reduce_dtype), already checked to be
     * f32 or bf16. NULL: nothing is averaged (one device), so any dtype is accepted. */
    int (*set_reduce_dtype)(tdm_strategy *st, tdm_dtype dt);
    /* The clipping norm changed to st->clip (already checked). NULL: read st->clip per step. */
    int (*set_clip)(tdm_strategy *st);
    /* Every replica's (stage's) learning rate. Required. */
    void (*set_lr)(tdm_strategy *st, float lr);
    /* The caller's model brought up to the trained weights. NULL: it is the trained one. */
    int (*sync_model)(tdm_strategy *st);
    /* Replica r's model and optimizer, 0 <= r < st->replicas. Required. */
    tdm_module *(*replica)(tdm_strategy *st, int r);
    tdm_optim *(*optim)(tdm_strategy *st, int r);
    /* A whole copy of replica 0's optimizer. NULL: tdm_optim_gather of ops->optim(st, 0). */
    tdm_optim *(*optim_gather)(tdm_strategy *st);
    /* The caller's model and whole (an optimizer over the caller's model, or NULL), read from
     * a checkpoint, handed to the ranks that hold their parts. NULL: the strategy trains the
     * caller's model and tdm_strategy_optim's state themselves (nothing to hand over). */
    int (*push_whole)(tdm_strategy *st, tdm_optim *whole);
    /* Stage 3's parameters whole, or sharded again. NULL: never sharded by parameters. */
    int (*gather_params)(tdm_strategy *st);
    int (*release_params)(tdm_strategy *st);
    /* fp16's loss scaler s (NULL: none), for a strategy whose own threads run the update: it
     * scales the losses, agrees on infs, skips alike, updates s once per step and sets
     * st->skipped. NULL: the step drives st->scaler itself on the caller's thread
     * (loss_on_caller; tdm_strategy_amp_update). */
    int (*set_scaler)(tdm_strategy *st, tdm_grad_scaler *s);
    /* tdm_strategy_check_replicas for a strategy whose replicas are not
     * tdm_strategy_replica's (tensor parallelism's ranks). NULL: the generic check. */
    int (*check_replicas)(tdm_strategy *st, tdm_group *procs);
    /* The header line's phrase (tdm_strategy_describe). NULL: none. */
    void (*describe)(tdm_strategy *st, int64_t batch, char *buf, size_t cap);
    /* The i-th module whose forward a step runs, on whichever thread runs it (i from 0 until
     * NULL): where mixed precision hooks its autocast region (strategy_amp.c). NULL: the
     * replicas, tdm_strategy_replica(st, 0 .. replicas - 1). */
    tdm_module *(*forward_module)(tdm_strategy *st, int i);
    /* Frees everything the constructor made, the struct included. Required. */
    void (*destroy)(tdm_strategy *st);
} tdm_strategy_ops;

struct tdm_strategy {
    const tdm_strategy_ops *ops;
    int replicas;         /* of this process (tdm_strategy_replicas) */
    int ranks;            /* data-parallel ranks over every process (tdm_strategy_ranks) */
    bool loss_on_caller;  /* loss_fn runs on the caller's thread (tdm_strategy_loss_on_caller) */
    bool accumulates;     /* accepts tdm_strategy_accumulate */
    bool holds_parts;     /* ranks hold parts of the model (tdm_strategy_holds_parts) */
    tdm_shard_kind shard; /* set by ops->set_shard */
    bool state_split;     /* set by ops->set_shard */
    float clip;           /* set by strategy.c */
    int micro;            /* micro-batches of the current step so far (strategy.c) */
    /* Mixed precision (strategy_amp.c): the autocast dtype of every forward and loss, TDM_F32
     * for none; the fp16 loss scaler (NULL otherwise), which the steps of one_device and
     * distributed drive, and ops->set_scaler hands to the others; the caller's loss function,
     * which amp_loss wraps in a region. */
    tdm_dtype precision;
    tdm_grad_scaler *scaler;
    bool skipped; /* the last step's update was skipped (an inf or NaN, fp16) */
    tdm_loss_fn user_loss;
    void *user_arg;
    struct amp_hook *hooks; /* one per forward module while precision is not TDM_F32 */
    int n_hooks;
};

/* 64 bits of contiguous t's bytes (FNV-1a; a device tensor is copied to the host): equal
 * tensors hash equal, a flipped bit changes the hash (strategy_check.c). */
int tdm_strategy_hash_tensor(const tdm_tensor *t, uint64_t *h);

/* The module tdm_strategy_loss_module returns on this thread (NULL clears it). */
void tdm_strategy_set_loss_module(tdm_module *m);

/* ---- mixed precision, for strategy.c and the strategies' steps (strategy_amp.c) ---------- */

/* Installs (dt not TDM_F32) or removes the autocast hooks on every forward module of st,
 * chained after any hooks those modules had (FSDP's). TDM_OK or TDM_ERR_NOMEM. */
int tdm_strategy_amp_hooks(tdm_strategy *st, tdm_dtype dt);
/* The loss function the strategies' steps call in place of the caller's: st->user_loss inside
 * an autocast region of st->precision on the calling thread; its arg is st. */
tdm_tensor *tdm_strategy_amp_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg);
/* The fp16 update of a step, PyTorch's order: unscale o's gradients (averaged already, so
 * every rank finds the same inf; through ddp where there is one, which agrees on it over the
 * shards of ZeRO stages 2 and 3), clip with clip_fn (NULL: none), step unless an inf or NaN
 * was found, update the scale. Sets st->skipped. The first error. */
int tdm_strategy_amp_update(tdm_strategy *st, tdm_optim *o, tdm_ddp *ddp,
                            int (*clip_fn)(tdm_strategy *st));
/* Removes the hooks and frees the scaler (tdm_strategy_free, before ops->destroy). */
void tdm_strategy_amp_free(tdm_strategy *st);

#endif
