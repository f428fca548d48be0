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
    /* The shard kind over the ranks, units_of for stage 3 (may be NULL); on success sets
     * st->shard to the kind in effect (left TDM_SHARD_NONE where there is nothing to share)
     * and st->state_split. Called only for a kind other than st->shard. NULL: the strategy
     * cannot shard (an error). */
    int (*set_shard)(tdm_strategy *st, tdm_shard_kind kind, tdm_units_fn units_of);
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
    /* Stage 3's parameters whole, or sharded again. NULL: never sharded by parameters. */
    int (*gather_params)(tdm_strategy *st);
    int (*release_params)(tdm_strategy *st);
    /* The header line's phrase (tdm_strategy_describe). NULL: none. */
    void (*describe)(tdm_strategy *st, int64_t batch, char *buf, size_t cap);
    /* Frees everything the constructor made, the struct included. Required. */
    void (*destroy)(tdm_strategy *st);
} tdm_strategy_ops;

struct tdm_strategy {
    const tdm_strategy_ops *ops;
    int replicas;         /* of this process (tdm_strategy_replicas) */
    int ranks;            /* data-parallel ranks over every process (tdm_strategy_ranks) */
    bool loss_on_caller;  /* loss_fn runs on the caller's thread (tdm_strategy_loss_on_caller) */
    bool accumulates;     /* accepts tdm_strategy_accumulate */
    tdm_shard_kind shard; /* set by ops->set_shard */
    bool state_split;     /* set by ops->set_shard */
    float clip;           /* set by strategy.c */
    int micro;            /* micro-batches of the current step so far (strategy.c) */
};

#endif
