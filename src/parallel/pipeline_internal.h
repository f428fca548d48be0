/* The pipeline's private parts (pipeline.c runs the stages, pipeline_sync.c makes them agree
 * after backward, pipeline_state.c moves their weights and state to and from a whole model): a
 * worker per (stage, replica, tensor-parallel rank), the hand-off slots between neighbours, and the
 * pipeline itself. Not installed. */
#ifndef TDM_PARALLEL_PIPELINE_INTERNAL_H
#define TDM_PARALLEL_PIPELINE_INTERNAL_H

#include "parallel/group.h"
#include "parallel/sync.h"
#include "tandem/pipeline.h"

#include <pthread.h>

#define MAX_WORKERS (TDM_PIPE_MAX_STAGES * TDM_PIPE_MAX_REPLICAS)

typedef struct {
    struct tdm_pipe *p;
    tdm_tensor *act;  /* the stage's output for the next stage (owned by the sender's scope) */
    tdm_tensor *grad; /* its gradient from the next stage (caller-owned, on the sender) */
    tdm_wait_word act_ready, grad_ready; /* 1 once the pointer above is published */
} handoff;

typedef struct {
    int mark, end;              /* the forward's tape range */
    tdm_tensor *root;           /* where its backward starts: the output or the scaled loss */
    tdm_tensor *input, *target; /* rows taken from the caller's tensors */
} micro;

typedef struct {
    tdm_module *m;
    void *saved; /* the layer's settings at the step's start (dropout's generator) */
} impl_snap;

typedef struct worker {
    struct tdm_pipe *p;
    int stage, replica, t, idx; /* idx = (stage * R + replica) * T + t */
    tdm_device dev;
    pthread_t thread;
    bool started;
    tdm_module *mod;
    tdm_optim *opt;
    tdm_group *group;    /* this stage's replicas (of rank t), NULL with one replica */
    tdm_group *tp_group; /* this (stage, replica)'s tensor-parallel ranks, NULL without */
    tdm_bufferset *bs;
    impl_snap *snaps;
    int n_snaps;
    handoff ho[TDM_PIPE_MAX_MICRO];
    micro mb[TDM_PIPE_MAX_MICRO];
    double loss; /* last stage: the replica's share of the batch's mean loss */
    /* tie t's copies in this stage (NULL: another stage's), and its flags where this worker
     * holds the b side: its gradient is ready, the sum is made, the sum is copied */
    tdm_tensor *tie_a[TDM_PIPE_MAX_TIES], *tie_b[TDM_PIPE_MAX_TIES];
    tdm_wait_word tie_ready[TDM_PIPE_MAX_TIES], tie_summed[TDM_PIPE_MAX_TIES],
        tie_copied[TDM_PIPE_MAX_TIES];
    int rc;
    /* statistics of the last step */
    double busy_us, t_first, t_last;
    int in_flight, max_in_flight;
    int64_t peak_bytes;
} worker;

typedef enum { ROUND_INIT, ROUND_STEP, ROUND_GATHER, ROUND_STATE } round_kind;

/* What a ROUND_STATE moves between the tensor-parallel stages and whole copies of them. */
typedef enum { STATE_GATHER, STATE_SCATTER_WEIGHTS, STATE_SCATTER, STATE_SHARD } state_move;

struct tdm_pipe {
    int S, M, R, T; /* stages, micro-batches, replicas, tensor-parallel ranks */
    round_kind round;
    tdm_module *gather_into; /* ROUND_GATHER's whole model */
    /* ROUND_STATE's: each stage whole (a Sequential of its layers) and an optimizer over it */
    state_move move;
    bool sharded; /* each stage's replicas share its optimizer state (ZeRO stage 1) */
    tdm_module *whole_stage[TDM_PIPE_MAX_STAGES];
    tdm_optim *whole_opt[TDM_PIPE_MAX_STAGES];
    int (*parallelize)(tdm_module *stage, tdm_group *tp, void *arg);
    void *parallelize_arg;
    tdm_pipe_schedule sched;
    int first[TDM_PIPE_MAX_STAGES + 1];
    int n_ties;
    int tie_layer[TDM_PIPE_MAX_TIES][2];     /* sides a and b */
    char tie_name[TDM_PIPE_MAX_TIES][2][96]; /* the parameters' names in their layers */
    int n_workers;
    worker w[MAX_WORKERS];
    tdm_threads_world *rep_worlds[MAX_WORKERS]; /* (s, t)'s replicas: index s * T + t */
    tdm_threads_world *tp_worlds[MAX_WORKERS];  /* (s, r)'s ranks: index s * R + r */
    tdm_optim_factory make_optim;
    void *optim_arg;
    int gemm_threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;   /* a worker stopped its step (after a failure) */
    pthread_cond_t go;   /* a new round */
    pthread_cond_t done; /* a worker finished its round */
    uint64_t generation;
    int finished, out;
    bool quit, broken;
    tdm_wait_word failed; /* set once, under mu, after err */
    tdm_waitq handoffs;   /* where stages wait for hand-offs (and see failures) */
    int64_t spin_ns;      /* HANDOFF_SPIN_NS, or 0 when workers outnumber cores */
    char err[768];
    /* the step being run */
    tdm_tensor *x, *y;
    int64_t B;
    tdm_loss_fn loss_fn;
    void *loss_arg;
    /* fp16 (tdm_pipe_set_grad_scaler): the caller's scaler, the step's scale, and the
     * workers' inf check joined under mu (see agree_finite) */
    tdm_grad_scaler *scaler;
    float loss_scale;
    double inf_ss;
    int inf_checked;
    bool skipped;
    /* clipping (tdm_pipe_set_clip_grad_norm): the squares joined under mu as inf_ss is */
    float clip;
    double clip_ss;
    int clip_joined;
};

/* The worker of stage s, replica r, tensor-parallel rank t. */
static inline worker *at(struct tdm_pipe *p, int s, int r, int t) {
    return &p->w[(s * p->R + r) * p->T + t];
}

/* Records w's error as the pipeline's first (if it is), wakes every waiter and aborts w's
 * groups; returns rc (TDM_ERR_STATE for 0). */
/* Replica 0's stages' parts made whole in model's layers, on the stages' threads (pipeline.c;
 * tensor parallelism's half of tdm_pipe_copy_to). */
int tdm_pipe_gather(struct tdm_pipe *p, tdm_module *model);
/* Runs a ROUND_STATE of p->move on every worker (pipeline.c), each in
 * tdm_pipe_worker_state (pipeline_state.c). */
int tdm_pipe_state_round(struct tdm_pipe *p);
int tdm_pipe_worker_state(worker *w);
int tdm_pipe_fail(worker *w, int rc);
/* Waits until *flag is set; an error when the pipeline failed meanwhile. */
int tdm_pipe_wait(worker *w, const tdm_wait_word *flag);
/* Sets *flag and wakes the waiters. */
void tdm_pipe_publish(struct tdm_pipe *p, tdm_wait_word *flag);

/* ---- what the stages agree on after backward (pipeline_sync.c) ---------------------------- */

/* The ties name layers of model, parameters of those layers, of one shape (tdm_pipe_new). */
int tdm_pipe_check_ties(const tdm_module *model, const tdm_pipe_opts *o);
/* w's copies of the ties, found in its stage's parameters ps by their names (its init). */
int tdm_pipe_find_ties(worker *w, const tdm_paramset *ps);
/* Every tie w holds a side of: the gradients summed into both copies. */
int tdm_pipe_sum_ties(worker *w);
/* fp16: whether every gradient of every stage and replica is finite (every worker joins). */
int tdm_pipe_agree_finite(worker *w, bool *finite);
/* --clip: the whole model's norm joined over every worker, then w's gradient scaled (not
 * where finite is false: fp16 skips the step). */
int tdm_pipe_clip(worker *w, bool finite);

#endif
