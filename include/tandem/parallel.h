/* Tandem parallelism: devices as workers, process groups with asynchronous collectives, SPMD
 * launch, DistributedDataParallel and DataParallel.
 *
 * A group is the set of ranks that train one model together. Every rank calls the same
 * collectives in the same order (SPMD). Collectives are asynchronous: each returns a work
 * handle; tdm_work_wait blocks until the result is in place. Reductions add in rank order
 * 0, 1, ..., so results are identical on every rank and on every run.
 */
#ifndef TANDEM_PARALLEL_H
#define TANDEM_PARALLEL_H

#include "nn.h"
#include "optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- devices ------------------------------------------------------------------------------ */

/* How many devices of a type this machine offers: CPU devices are cores (one device per
 * core), CUDA devices are GPUs (0 in a build without CUDA). */
int tdm_device_count(tdm_device_type type);
/* Parses a device list: "cpu:0,cpu:1", "cpu:all" (one per core), "cpu" (cpu:0), a count
 * "4" (cpu:0..cpu:3), "cuda:0,cuda:1", "cuda:all" (every GPU), or "cuda" (also "cuda:local"):
 * GPU r for the process of local rank r under mpirun or srun (OMPI_COMM_WORLD_LOCAL_RANK,
 * SLURM_LOCALID, ...; cuda:0 without a launcher).
 * Writes at most max devices; returns how many, or a negative status naming the bad entry
 * (duplicates, unknown devices and GPUs this machine lacks are errors). */
int tdm_devices_parse(const char *text, tdm_device *out, int max);

/* ---- process groups ----------------------------------------------------------------------- */

typedef enum { TDM_SUM = 0, TDM_AVG = 1 } tdm_reduce_kind;

typedef struct tdm_group tdm_group;
typedef struct tdm_work tdm_work;

int tdm_group_rank(const tdm_group *g);
int tdm_group_size(const tdm_group *g);
/* The device this rank computes on. */
tdm_device tdm_group_device(const tdm_group *g);
/* Where this group's collectives take their tensors: the rank's GPU for an NCCL group (see
 * tdm_dp_new), CPU memory (cpu:0) for the threads and MPI groups. A tensor elsewhere is an
 * error naming both devices. */
tdm_device tdm_group_memory(const tdm_group *g);

/* The reductions (all-reduce, reduce, reduce-scatter) take f32, bf16 or f16 tensors, the same
 * dtype on every rank (ranks that disagree get "ranks disagree on the dtype", naming both);
 * TDM_ERR_DTYPE for another dtype. bf16 and f16 move as 2-byte elements, half an f32's bytes,
 * and are summed in f32: the ranks' values widened, added in rank order (the two-level group
 * of tdm_dp_new_distributed: per process, then over processes), divided by the ranks for AVG,
 * and rounded once, so every rank gets the same bits. NCCL sums them its own way (its
 * rounding per step of its algorithm), the same on every rank. */

/* In-place all-reduce of a contiguous f32, bf16 or f16 tensor (same shape on every rank). */
tdm_work *tdm_all_reduce(tdm_group *g, tdm_tensor *t, tdm_reduce_kind op);
/* In-place reduce of a contiguous f32, bf16 or f16 tensor (same shape on every rank) to root:
 * root's t receives the rank-order reduction, the same bits an all-reduce gives, moving half
 * its bytes; the other ranks' t are left unspecified (a backend may keep partial sums there). */
tdm_work *tdm_reduce(tdm_group *g, tdm_tensor *t, int root, tdm_reduce_kind op);
/* Copies root's t into every other rank's t. Any dtype, contiguous. */
tdm_work *tdm_broadcast(tdm_group *g, tdm_tensor *t, int root);
/* out [size * numel(in)] receives every rank's in, in rank order. Any dtype, the same for out
 * and in. */
tdm_work *tdm_all_gather(tdm_group *g, tdm_tensor *out, const tdm_tensor *in);
/* in [size * n]: out [n] on rank r receives the reduction of chunk r over all ranks; out and in
 * of one dtype (f32, bf16 or f16). */
tdm_work *tdm_reduce_scatter(tdm_group *g, tdm_tensor *out, const tdm_tensor *in,
                             tdm_reduce_kind op);
tdm_work *tdm_barrier(tdm_group *g);
/* Waits for the collective and frees the handle. Returns TDM_OK, or TDM_ERR_COMM with a
 * message naming the rank that failed or the timeout; NULL gives the error that prevented
 * the collective from starting. */
int tdm_work_wait(tdm_work *w);
/* Seconds this process's threads have spent in tdm_work_wait on collectives that were not done
 * yet (running them on the waiting thread included), summed over threads since the process
 * started: a step's share of it is its time in communication rather than compute, and a
 * process that waits much less than its peers is the one they wait for. */
double tdm_collective_wait_seconds(void);
/* Marks this rank as failed with its message: every collective of the group, pending or
 * future, fails on every rank with "rank R failed: message". */
void tdm_group_abort(tdm_group *g, const char *message);
/* Names the next collective this thread starts, printf-style (at most 47 bytes are kept), e.g.
 * "DDP bucket 3" or "the trainer's loss read-back". The name travels in the collective's
 * fingerprint (its number on the group, the op, dtype, element count, root and this name), so
 * a rank whose collective differs from its peers' stops with a message naming both sides
 * ("rank 0 is in all_reduce #12 (DDP bucket 3: ...) while rank 1 is in broadcast #12
 * (stage-3 gather of unit 5: ...)"), and the flight recorder keeps it. It labels one
 * collective: the next tdm_all_reduce, tdm_broadcast, ... on this thread uses and clears it.
 * NULL clears it. Unnamed collectives say "unnamed". */
void tdm_collective_label(const char *fmt, ...);
/* The flight recorder: every group keeps its last 256 collectives (number, op, name, dtype,
 * element count, root, bytes, launch and end times on the wall clock, and whether each is
 * running, done or failed) and the first failure's message. Writes them to path (created or
 * replaced), one JSON object a line: the rank's (rank, size, backend, host, pid, time,
 * launched, timeout, failure), then the collectives oldest first. `tandem doctor DIR` merges
 * every rank's file. Safe while collectives run (a copy is taken under the group's lock).
 * TDM_ERR_ARG for NULLs, TDM_ERR_IO naming the path. */
int tdm_group_dump_flight(tdm_group *g, const char *path);
/* Seconds a collective waits for the other ranks before failing (default 60). */
void tdm_group_set_timeout(tdm_group *g, double seconds);

/* ---- SPMD launch (the equivalent of torch.multiprocessing.spawn, with threads) ------------ */

typedef struct {
    int rank, size;
    tdm_device device;
    tdm_group *group; /* the threads group of all ranks */
} tdm_rank_ctx;

/* Runs fn(ctx, arg) on n threads, rank r on devices[r], each thread pinned to its own cores
 * where the machine allows and with BLAS single-threaded when devices fill the cores. A rank
 * whose fn returns nonzero aborts the group, so the others fail at their next collective
 * instead of hanging. Returns TDM_OK, or the first failing rank's status with a message
 * "rank R: ...". */
int tdm_spawn(int n, const tdm_device *devices, int (*fn)(tdm_rank_ctx *ctx, void *arg), void *arg);

/* ---- MPI: one rank per process, across processes and machines ----------------------------- */

/* Whether this build of Tandem has the MPI backend (CMake option TANDEM_MPI). */
bool tdm_mpi_available(void);
/* Whether this process was started by an MPI launcher: mpirun/mpiexec (Open MPI, MPICH) or
 * Slurm's srun (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMI_RANK or PMIX_RANK is set). Works in
 * every build, so a program can choose between tdm_mpi_init and tdm_spawn. */
bool tdm_mpi_launched(void);
/* Initialises MPI and returns the group of every process of the job (MPI_COMM_WORLD): rank
 * and size from MPI, device cpu:0 of this process. The collectives are those above, with the
 * same guarantees: asynchronous (communication threads make every MPI call, so bucket
 * all-reduces overlap backward), reductions in rank order (bit-identical on every rank and
 * to the threads backend), ranks that disagree on a collective get an error. Faults: a rank
 * that fails (tdm_group_abort) makes every rank's collectives fail with "rank R failed: ...";
 * a rank that dies or hangs makes the others fail with "timed out after T s waiting for rank
 * R" after the group's timeout, 30 s by default (tdm_group_set_timeout; raise it when one
 * rank works alone for long between collectives, e.g. rank 0 evaluating). argc/argv may be
 * NULL. Calling it again returns the same group. NULL and an error when this build has no
 * MPI, when the process was not started by mpirun/srun (see tdm_mpi_launched), or when MPI
 * cannot start. The group is freed by tdm_mpi_finalize; never tdm_spawn it. */
tdm_group *tdm_mpi_init(int *argc, char ***argv);
/* Finishes the queued collectives, stops the communication threads and finalises MPI (free
 * any sub-groups first). After
 * a failure MPI is not finalised (a dead peer would make MPI_Finalize wait forever): the
 * process should then exit with a nonzero status, and mpirun ends the job. MPI cannot be
 * initialised again in this process. Does nothing without tdm_mpi_init. */
void tdm_mpi_finalize(void);

/* ---- parallel context: batch-dependent layers across replicas ----------------------------- */

/* Declares, for the calling thread, that the tensors it computes hold rows
 * [row0, row0 + b) of a global batch of global_rows rows split over the ranks of g (dim 0 of
 * every batch-shaped tensor is the row). Until tdm_parallel_context_clear, the layers whose
 * result depends on the whole batch behave as one device on the global batch would:
 *
 * - Batch norm in training mode with g of size > 1 is synchronised batch norm (PyTorch's
 *   SyncBatchNorm): each channel's mean and biased variance are those of the global batch
 *   (two all-reduces of per-channel sums, in rank order, so every rank gets the same bits),
 *   running statistics are updated with the global unbiased variance, and backward
 *   all-reduces the per-channel sums of dy and dy * (x - mean) before computing dx. It
 *   issues collectives on g: every rank must run the same batch-norm layers in the same
 *   order, forward and backward, while its context is set. The weight and bias gradients
 *   stay local (DDP reduces them with the other parameters). Eval mode is unchanged.
 * - Dropout draws element j of local row i from the Philox counter one device would use for
 *   global row row0 + i (offset + (row0 + i) * row_numel + j) and then advances the
 *   generator by global_rows * row_numel, as one device does for the whole batch. Each rank
 *   must pass its own generator, with the same state on every rank (a Dropout module holds
 *   its own copy, so replicas cloned from one model, or built with the same seed, qualify).
 *
 * DataParallel sets and clears the context itself around every replica's step. With DDP the
 * caller sets it on each rank around forward and backward:
 *   tdm_parallel_context_set(group, lo, B);
 *   loss = loss_fn(tdm_ddp_forward(ddp, x_rows_lo_to_hi), ...);
 *   tdm_ddp_backward(ddp, loss);
 *   tdm_parallel_context_clear();
 * g may be NULL (dropout matches one device; batch norm stays per rank). The group must
 * outlive the context and any tape recorded under it. Returns TDM_OK, or TDM_ERR_ARG when
 * row0 is not in [0, global_rows] (row0 == global_rows: an empty slice). */
int tdm_parallel_context_set(tdm_group *g, int64_t row0, int64_t global_rows);
/* Ends the calling thread's parallel context: layers act on the local batch alone again. */
void tdm_parallel_context_clear(void);

/* ---- DistributedDataParallel -------------------------------------------------------------- */

/* What DDP or DataParallel shards over the ranks (PyTorch's FSDP ShardingStrategy, DeepSpeed's
 * ZeRO stages); each kind shards what the one before it does, and more. */
typedef enum {
    TDM_SHARD_NONE,       /* every rank holds everything (the default; FSDP's NO_SHARD) */
    TDM_SHARD_OPTIMIZER,  /* ZeRO stage 1: the optimizer state (tdm_optim_shard) */
    TDM_SHARD_GRADIENTS,  /* ZeRO stage 2 (FSDP's SHARD_GRAD_OP): also the gradients, each
                           * rank keeping the averaged gradient of its shard only */
    TDM_SHARD_PARAMETERS, /* ZeRO stage 3 (FSDP's FULL_SHARD): also the parameters, each
                           * unit gathered around its forward and backward */
} tdm_shard_kind;

typedef struct {
    int64_t bucket_cap_bytes;       /* PyTorch's default 25 MiB */
    int64_t first_bucket_cap_bytes; /* PyTorch's default 1 MiB */
    bool find_unused_parameters;    /* false: a parameter without a gradient is an error */
    bool broadcast_buffers;         /* true: rank 0's buffers are copied at each forward */
    /* The dtype gradients travel in (PyTorch's comm hooks): TDM_F32 (the default) reduces the
     * f32 gradients as they are; TDM_BF16 (bf16_compress_hook) rounds each bucket to bf16,
     * reduces it in bf16 (the ranks' values summed in f32 in rank order, divided by the ranks
     * and rounded once: tdm_all_reduce) and widens the average back into the f32 gradients:
     * half the bytes on the wire, and a bf16 buffer of the gradient's size held beside it
     * (ZeRO stages 2 and 3 round each bucket into a buffer of its own instead, reduced to
     * the shards' owners alike). Any other dtype is an error of tdm_ddp_new naming it. */
    tdm_dtype reduce_dtype;
    /* Under ZeRO stage 3 (TDM_SHARD_PARAMETERS), the dtype the units' gathers move the
     * parameters in (FSDP2's MixedPrecisionPolicy.param_dtype): TDM_F32 (the default) as they
     * are; TDM_BF16 rounded to bf16, half the bytes, every rank's forward and backward then
     * computing with the rounded values (widened into the gathered f32 tensors, so ops that run
     * in f32 read bf16-rounded weights, as FSDP2's bf16 parameters). The shards, the optimizer
     * and tdm_ddp_gather_params stay exact f32. Ignored below stage 3; any other dtype is an
     * error of tdm_ddp_new naming it. */
    tdm_dtype param_dtype;
} tdm_ddp_opts;

tdm_ddp_opts tdm_ddp_defaults(void);

typedef struct tdm_ddp tdm_ddp;

/* Wraps this rank's replica: broadcasts rank 0's parameters and buffers, checks that every
 * rank has the same parameter names and shapes (an error naming the first difference), and
 * hangs gradient buckets on the parameters' ready hooks. Each rank steps its own optimizer
 * after tdm_ddp_backward; tdm_optim_shard (below) splits their state over the ranks. */
tdm_ddp *tdm_ddp_new(tdm_module *replica, tdm_group *g, const tdm_ddp_opts *o);
/* The replica's forward (broadcasting buffers first when asked). */
tdm_tensor *tdm_ddp_forward(tdm_ddp *d, tdm_tensor *x);
/* backward(loss), with each bucket's all-reduce (average) launched as soon as its gradients
 * are final, then waits for all of them. With sync off (PyTorch's no_sync), gradients only
 * accumulate locally; the next synced backward reduces the accumulated sum. Under ZeRO stage
 * 2 (tdm_ddp_set_shard) every backward reduces, sync or not, and adds the average into the
 * rank's shard of the gradient (DeepSpeed's accumulation: there is no whole gradient to
 * accumulate into). */
int tdm_ddp_backward(tdm_ddp *d, tdm_tensor *loss);
void tdm_ddp_set_sync(tdm_ddp *d, bool sync);
int tdm_ddp_bucket_count(const tdm_ddp *d);
/* Shards over d's group what kind names, with o this rank's optimizer over the replica's
 * parameters (tdm_module_parameters of the replica): a collective, called by every rank with
 * the same kind, between steps, after any restore of o's state (its values are kept).
 *
 * TDM_SHARD_OPTIMIZER is tdm_optim_shard(o, group) (ZeRO stage 1).
 * TDM_SHARD_GRADIENTS (ZeRO stage 2, PyTorch FSDP's SHARD_GRAD_OP) also shards the gradient:
 * the rank keeps the averaged gradient of its optimizer shard, [lo, hi) of the flat buffer
 * (tdm_optim_shard_range), and nothing more between backwards. The whole flat gradient is
 * freed (ps->flat_grad becomes NULL and parameters' .grad are NULL outside tdm_ddp_backward);
 * during backward a bucket's gradient lives in a buffer taken from the allocator when its
 * first gradient arrives, which the parameters' .grad view, and is released once the bucket
 * is averaged and its part of [lo, hi) added into the shard; backward waits for a bucket's
 * average before it launches the next but one. The average is reduce-scattered: each piece of
 * a bucket that lies in a rank's shard is reduced to that rank only (tdm_reduce, one per
 * piece), half the bytes of DDP's all-reduce. The peak gradient memory is thus the
 * shard plus a few buckets (25 MiB each by default). tdm_optim_step and tdm_optim_zero_grad then
 * read and zero the shard; clip with tdm_ddp_clip_grad_norm. With one micro-batch per step the
 * weights are bit for bit DDP's (a reduce adds in the all-reduce's order). Accumulating
 * micro-batches adds their averages instead of averaging their sum: equal to float rounding, about
 * (micro-batches + ranks) x 2^-24 of the summed magnitudes per element.
 *
 * TDM_SHARD_PARAMETERS (ZeRO stage 3, PyTorch FSDP's FULL_SHARD) also shards the parameters:
 * the rank keeps the parameters of its range [lo, hi) (which o updates from then on), and
 * the rest of the model only while a unit needs it. The units are the modules named by
 * tdm_ddp_set_shard_units (FSDP's auto_wrap_policy: a GPT's blocks, tdm_model_units), else
 * the replica's children that hold parameters; the replica's other parameters (embeddings,
 * a final norm, tied weights) form the root unit, gathered when the replica's forward starts
 * and freed when backward is done with them. A unit is gathered just before its forward and
 * freed after it, gathered again when backward reaches its output and freed when its
 * parameters' gradients are final; the next unit's gather (the previous one's in backward)
 * runs while the current one computes. The parameters' tensors stay the same objects (views
 * of the unit's memory, empty while it is freed), so read them only inside the forward,
 * or between tdm_ddp_gather_params and tdm_ddp_release_params. ps->flat holds no memory.
 * The weights are stage 2's bit for bit (a gather moves values). Only for groups whose
 * collectives reach the parameters' memory (threads, MPI: CPU devices).
 *
 * d must outlive o's steps, and the replica keeps no whole gradient for other uses (training
 * it without d). TDM_ERR_ARG for a NULL d, an optimizer of other parameters, an unknown kind,
 * or units that overlap or hold no parameters; TDM_ERR_STATE for a kind below the
 * current one (sharded stays sharded); tdm_optim_shard's errors. A rank that cannot allocate
 * its shard aborts the group, so every rank fails. Asking again for the current kind does
 * nothing. */
int tdm_ddp_set_shard(tdm_ddp *d, tdm_optim *o, tdm_shard_kind kind);
/* tdm_ddp_opts.reduce_dtype from the next backward on (TDM_F32 or TDM_BF16; between steps):
 * every rank must set the same. Local (no collective). TDM_ERR_ARG for a NULL d or another
 * dtype; TDM_ERR_NOMEM for the bf16 copy of the gradient. */
int tdm_ddp_set_reduce_dtype(tdm_ddp *d, tdm_dtype dt);
tdm_shard_kind tdm_ddp_shard(const tdm_ddp *d);
/* The units of ZeRO stage 3 (before tdm_ddp_set_shard with TDM_SHARD_PARAMETERS): n disjoint
 * modules of the replica, in the order its forward runs them (the prefetch follows it); d
 * copies the array, not the modules. TDM_ERR_STATE once the parameters are sharded. */
int tdm_ddp_set_shard_units(tdm_ddp *d, tdm_module *const *units, int n);
/* Under ZeRO stage 3, every parameter whole again in ps->flat (FSDP's summon_full_params:
 * to save, export or inspect the model, or load into it) until tdm_ddp_release_params,
 * which takes this rank's range of ps->flat back as its shard (so values loaded meanwhile
 * count) and frees the rest. Collectives, called by every rank; no-ops otherwise. A rank
 * whose gather fails aborts the group. Call tdm_ddp_gather_params before tdm_ddp_free to keep
 * the model whole after d. */
int tdm_ddp_gather_params(tdm_ddp *d);
int tdm_ddp_release_params(tdm_ddp *d);
/* torch.nn.utils.clip_grad_norm_ (2-norm) of the averaged gradient after tdm_ddp_backward:
 * tdm_clip_grad_norm on the replica's whole gradient, or under ZeRO stage 2 a collective:
 * each rank's sum of squares of its shard (in double) all-gathered and added in rank order,
 * so every rank scales its shard by the same factor, that of the whole gradient's norm (the
 * unsharded norm but for double rounding). *total_norm (may be NULL) receives the norm.
 * TDM_ERR_ARG for a NULL d or a negative max_norm; a failed exchange aborts the group. */
int tdm_ddp_clip_grad_norm(tdm_ddp *d, float max_norm, float *total_norm);
/* tdm_grad_scaler_unscale for a DDP replica's optimizer o (the one tdm_ddp_set_shard was
 * given): without sharding exactly that call; under ZeRO stages 2 and 3, a collective (PyTorch's
 * ShardedGradScaler): each rank unscales its shard of the averaged gradient, and whether any
 * element of any shard was inf or NaN before that is agreed over the group (the shards' sums
 * of squares in double, all-gathered), so every rank's tdm_grad_scaler_step then steps or
 * skips alike and tdm_grad_scaler_update backs off alike. Once per update, as
 * tdm_grad_scaler_unscale, and failing as it does; TDM_ERR_ARG for a NULL d; a failed
 * exchange aborts the group. */
int tdm_ddp_unscale(tdm_ddp *d, tdm_grad_scaler *s, tdm_optim *o);
/* *ss = the sum of squares, in double, of the whole averaged gradient after tdm_ddp_backward:
 * the replica's own, or under ZeRO stages 2 and 3 the shards' added in rank order (a
 * collective, as tdm_ddp_clip_grad_norm's). It is finite exactly when every element is: the
 * inf check of a loss scaler. TDM_ERR_ARG for NULLs; a failed exchange aborts the group. */
int tdm_ddp_grad_sum_squares(tdm_ddp *d, double *ss);
/* Under ZeRO stage 2, this rank's shard of the averaged gradient (f32 [hi - lo], owned by d)
 * and *lo its first flat element; NULL (and *lo 0) otherwise. */
tdm_tensor *tdm_ddp_shard_grad(const tdm_ddp *d, int64_t *lo);
void tdm_ddp_free(tdm_ddp *d);

/* ---- FullyShardedDataParallel: the calls above in PyTorch FSDP's words -------------------- */

/* PyTorch's FullyShardedDataParallel(module, process_group, sharding_strategy,
 * auto_wrap_policy) is a DDP whose parameters, gradients and optimizer state are sharded:
 *
 *   tdm_optim *opt = tdm_adam_new(tdm_module_parameters(model), &adamw);  // before wrapping
 *   tdm_module *blocks[64];
 *   tdm_fsdp_opts fo = tdm_fsdp_defaults();
 *   fo.units = blocks, fo.n_units = tdm_model_units(model, blocks, 64);   // auto_wrap_policy
 *   tdm_fsdp *fsdp = tdm_fsdp_wrap(model, group, opt, &fo);
 *   tdm_ddp *d = tdm_fsdp_ddp(fsdp);
 *   ... tdm_ddp_forward(d, x), tdm_ddp_backward, tdm_ddp_clip_grad_norm, tdm_optim_step as with
 *   DDP; tdm_ddp_gather_params / tdm_ddp_release_params around a save (summon_full_params);
 *   tdm_fsdp_free(fsdp).
 * A training loop that should not care which of these it runs uses a strategy instead
 * (tdm_strategy_distributed, then tdm_strategy_set_shard: tandem/strategy.h).
 *
 * Unlike PyTorch, the optimizer comes first, over the whole model's parameters: wrapping
 * shards its state in place (there is no separate flat-parameter module to build it over). */
typedef struct {
    tdm_shard_kind sharding_strategy; /* TDM_SHARD_PARAMETERS (FULL_SHARD, the default),
                                       * TDM_SHARD_GRADIENTS (SHARD_GRAD_OP), TDM_SHARD_OPTIMIZER
                                       * or TDM_SHARD_NONE (NO_SHARD) */
    tdm_module *const *units;         /* auto_wrap_policy's modules, in forward order (copied);
                                       * NULL: the model's children that hold parameters */
    int n_units;
    tdm_ddp_opts ddp; /* buckets (bucket_cap_mb), buffers, unused parameters */
} tdm_fsdp_opts;

tdm_fsdp_opts tdm_fsdp_defaults(void);
typedef struct tdm_fsdp tdm_fsdp;

/* tdm_ddp_new(model, g, &o->ddp), then tdm_ddp_set_shard_units and tdm_ddp_set_shard(opt,
 * o->sharding_strategy): collectives, called by every rank with its replica and an optimizer
 * over tdm_module_parameters(model). o NULL: the defaults. Returns the wrapper, owned by the
 * caller (tdm_fsdp_free; opt and model stay the caller's), or NULL and the error of the step
 * that failed (the same on every rank: each step either fails everywhere or aborts the
 * group). */
tdm_fsdp *tdm_fsdp_wrap(tdm_module *model, tdm_group *g, tdm_optim *opt, const tdm_fsdp_opts *o);
/* The DDP that f drives, sharded: the tdm_ddp_* calls train it (forward, backward, clipping,
 * gather and release of the parameters). Owned by f; NULL for a NULL f. */
tdm_ddp *tdm_fsdp_ddp(tdm_fsdp *f);
/* Frees f and its DDP (tdm_ddp_gather_params first keeps the model whole); opt and the model
 * stay the caller's. NULL is allowed. */
void tdm_fsdp_free(tdm_fsdp *f);

/* ---- ZeRO stage 1: the optimizer's state sharded over a group ----------------------------- */

/* PyTorch's ZeroRedundancyOptimizer (DeepSpeed's ZeRO stage 1). With DDP each rank keeps the
 * whole gradient and parameters but, once its optimizer is sharded, the optimizer state of
 * one range of the flat buffer only: 1/size of Adam's two moments (or SGD's momentum) per
 * rank. Each step updates the rank's range and shares it with the others, so every rank
 * ends the step with the same parameters, bit for bit those of the unsharded optimizer (each
 * element's update is the same; clip the whole averaged gradient before the step, as without
 * sharding):
 *
 *   tdm_ddp *d = tdm_ddp_new(model, g, NULL);
 *   tdm_optim *opt = tdm_adamw_new(tdm_module_parameters(model), &adam_opts);
 *   tdm_optim_shard(opt, g);               // after a restore, if any: the shard is kept
 *   for (...) {
 *       tdm_optim_zero_grad(opt);
 *       tdm_ddp_backward(d, loss_fn(tdm_ddp_forward(d, x)));
 *       tdm_clip_grad_norm(tdm_module_parameters(model), 1.0f, false, NULL);  // optional
 *       tdm_optim_step(opt);               // a collective over g
 *   }
 *   tdm_optim *whole = tdm_optim_gather(opt);   // every rank, at a checkpoint
 *
 * Shards are contiguous ranges of the flat buffer in rank order, ceil(total / size) elements
 * rounded up to 16 each, the last shorter (empty on a rank past the end); see
 * tdm_optim_shard_range. */

/* Shards o over g: a collective, called by every rank of g with its optimizer over the same
 * parameters (checked against rank 0's). Afterwards o keeps the state of this rank's shard
 * only, with the values it had there (so an optimizer restored from a checkpoint can be
 * sharded), and frees the whole-size buffers; tdm_optim_state returns the shard-sized
 * buffers, and tdm_optim_step updates the shard, then broadcasts each rank's range of
 * ps->flat from its owner, in place, and counts the step: every step is then a collective
 * over g, which must outlive o. The parameters (ps->flat) must be in the group's memory
 * (tdm_group_memory). A group of one rank keeps the whole state. Fails on every rank when
 * one cannot shard: TDM_ERR_ARG for a NULL optimizer or group, TDM_ERR_STATE when o is
 * sharded already, TDM_ERR_DEVICE for parameters the group cannot reach, TDM_ERR_SHAPE when
 * the ranks' parameters differ in size; o is then unchanged. */
int tdm_optim_shard(tdm_optim *o, tdm_group *g);
/* The whole state of o for a checkpoint: a collective over o's group (every rank calls it,
 * every rank gets the result). full[k] receives state buffer k (names[k] its name, as
 * tdm_optim_state gives them; names may be NULL) as a new f32 [ps->total] tensor on the
 * optimizer's device, owned by the caller (tdm_tensor_free). An unsharded optimizer's state
 * is copied without communication. Returns how many were written (at most max), or a
 * negative status (a failed exchange aborts the group, naming the cause). */
int tdm_optim_state_gather(tdm_optim *o, const char **names, tdm_tensor **full, int max);
/* A whole, unsharded copy of o: the same kind, hyper-parameters, learning rate, weight decays
 * and step count, with the whole state gathered as tdm_optim_state_gather does (a collective
 * over o's group when o is sharded; a plain copy otherwise). What a checkpoint saves:
 * tdm_checkpoint_save(..., &(tdm_train_state){.optim = whole, ...}) writes the same file as
 * the unsharded run, which resumes sharded (load into an unsharded optimizer, then
 * tdm_optim_shard; or tdm_checkpoint_load into a sharded one, which takes its range through
 * tdm_optim_state_load), on any number of ranks, or not sharded at all. Owned by the caller
 * (tdm_optim_free; it steps no group). NULL and an error on failure. */
tdm_optim *tdm_optim_gather(tdm_optim *o);

/* ---- DataParallel ------------------------------------------------------------------------ */

/* DataParallel keeps one loop in the caller and a replica per device: replica 0 runs on the
 * caller's thread (pinned to the first core while the DataParallel lives, when devices do not
 * outnumber cores), every other one on a persistent thread of its own. Every step scatters
 * the batch's rows over the devices (uneven splits included), runs forward, loss and
 * backward on every replica at once, averages gradients with the DDP buckets, and steps
 * every replica's optimizer, so replicas stay identical (CPU devices of one process split
 * the averaging and the step into shards instead: see tdm_dp_optim). Each
 * replica's step runs under a parallel context (tdm_parallel_context_set), so batch norm is
 * synchronised over the replicas and dropout draws one device's masks: the result is one
 * device's on the whole batch for those layers too, running statistics included. */
typedef struct tdm_dp tdm_dp;

/* The loss of one replica's slice: the MEAN over its rows of out [b, ...] against target,
 * which are rows [row0, row0 + b) of the global batch. Called from the replicas' threads (the
 * caller's for replica 0) at once (write only to disjoint rows of shared memory), e.g. to
 * record predictions. A step fails if the caller's thread holds recorded operations that no
 * backward has walked (replica 0's backward would walk them). */
typedef tdm_tensor *(*tdm_loss_fn)(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg);
/* Builds a replica's optimizer over its parameters (called once per device). */
typedef tdm_optim *(*tdm_optim_factory)(tdm_paramset *ps, void *arg);

/* Wraps model (which must be on devices[0] and becomes replica 0; the others are clones).
 * NULL and an error if a device is invalid, repeated, or the model cannot be cloned. */
tdm_dp *tdm_dp_new(tdm_module *model, const tdm_device *devices, int n,
                   tdm_optim_factory make_optim, void *optim_arg);
/* DataParallel over this process's devices, joined with the same DataParallel in every other
 * process of `processes` (e.g. tdm_mpi_init's group under mpirun; each process passes its own
 * devices): gradients are averaged over every device of every process through a two-level
 * group (threads inside the process, the processes' group across; sums per process first,
 * then over processes in rank order, so results are deterministic). Rank 0 of process 0's
 * parameters and buffers reach every replica at the start. tdm_dp_step then takes this
 * process's share of the global batch; with equal shares the update is one device's on the
 * whole global batch. Every process must call it, with the same model and device count, as a
 * collective; `processes` must outlive the DataParallel and must not be used by the caller
 * while a step runs. NULL processes is tdm_dp_new. */
tdm_dp *tdm_dp_new_distributed(tdm_module *model, const tdm_device *devices, int n,
                               tdm_group *processes, tdm_optim_factory make_optim, void *optim_arg);
/* One training step on the global batch x [B, ...], target [B, ...] (caller's CPU tensors).
 * Gradients are weighted by slice size, so the update equals one device's on the whole
 * batch. *loss (may be NULL) receives the batch's mean loss. B must be at least the number
 * of devices; a failing replica's error names its device. */
int tdm_dp_step(tdm_dp *dp, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn, void *loss_arg,
                float *loss);
/* Gradient accumulation (PyTorch's no_sync): forward and backward of the micro-batch
 * (x, target) on every replica, its gradients added to those of the micro-batches before it
 * since the last tdm_dp_step, with no communication and no update. The tdm_dp_step that
 * follows takes the last micro-batch, averages the summed gradients over the replicas once
 * and updates. Gradients are summed: for the mean over K micro-batches, let loss_fn divide
 * by K, as in PyTorch (*loss is then the scaled loss). Fails as tdm_dp_step does. */
int tdm_dp_accumulate(tdm_dp *dp, tdm_tensor *x, tdm_tensor *target, tdm_loss_fn loss_fn,
                      void *loss_arg, float *loss);
/* PyTorch's DataParallel forward, without gradients (evaluation, inference): the rows of x
 * [B, ...] on devices[0] split over the replicas as a step splits them, each replica's
 * forward run on its own device and thread, and the outputs joined in row order into *out
 * [B, ...] on devices[0], owned by the caller's open scope. Each replica first takes replica
 * 0's buffers (batch norm's running statistics, which every replica updates from its own
 * rows in training) and training mode, as PyTorch copies module 0 to the devices at every
 * forward, so *out is replica 0's forward of x to float rounding (the same bits where the
 * kernels do not depend on the row count). In training mode batch norm normalises each
 * replica's rows by their own statistics, as PyTorch's DataParallel does without
 * SyncBatchNorm. A batch of fewer rows than devices runs on replica 0 alone. Local to this process
 * (no collective). Between steps; not re-entrant. Fails with TDM_ERR_ARG for a NULL argument,
 * TDM_ERR_SHAPE for a 0-dim x, TDM_ERR_STATE when no scope is open, or a replica's error naming its
 * device; *out is then NULL. */
int tdm_dp_forward(tdm_dp *dp, tdm_tensor *x, tdm_tensor **out);
/* ZeRO stage 3's units of a replica, as tdm_model_units gives them: up to cap into units,
 * returning how many (0: the replica's children holding parameters) or a negative status.
 * What tdm_strategy_set_shard (tandem/strategy.h) takes to shard a DataParallel's or a DDP's
 * parameters by unit. */
typedef int (*tdm_units_fn)(tdm_module *replica, tdm_module **units, int cap);
/* tdm_ddp_set_shard_units with the units units_of finds in m, the model d wraps (counted, then
 * listed); none found leaves d's units as they are. TDM_OK, units_of's negative status, or
 * tdm_ddp_set_shard_units' errors. */
int tdm_ddp_set_shard_units_of(tdm_ddp *d, tdm_module *m, tdm_units_fn units_of);
/* DataParallel is sharded (ZeRO stages 1 to 3) through its strategy:
 * tdm_strategy_data_parallel, then tdm_strategy_set_shard, tdm_strategy_gather_params and
 * tdm_strategy_release_params, the one sharding API over every strategy (tandem/strategy.h;
 * what each stage does to the replicas is said in src/parallel/dp_shard.h). */
/* A whole, unsharded copy of the replicas' optimizer (replica 0's state and settings, the
 * shards gathered from every replica of every process: tdm_optim_gather), for a checkpoint.
 * A collective over the processes, between steps; every process gets one. Caller-owned
 * (tdm_optim_free). Without sharding it is a copy of tdm_dp_optim(dp, 0). NULL and an error
 * on failure. */
tdm_optim *tdm_dp_optim_gather(tdm_dp *dp);
/* Clips the averaged gradient to a global 2-norm of max_norm before every update, as
 * tdm_clip_grad_norm (PyTorch's clip_grad_norm_ after DDP's backward) does on one device;
 * the norm is the whole gradient's, also when the update is split into shards. 0 turns it
 * off (the default). TDM_ERR_ARG for a negative or non-finite max_norm. */
int tdm_dp_set_clip_grad_norm(tdm_dp *dp, float max_norm);
/* fp16's loss scaling in every step (PyTorch's GradScaler over DDP; s stays the caller's and
 * must outlive its use here; NULL turns it off): each replica's backward starts from its loss
 * times the scale, the averaged gradient is unscaled before clipping, a step in which any
 * element of it is inf or NaN updates no replica (the replicas agree on it, also over
 * ZeRO's shards and processes), and the scale is updated once per tdm_dp_step
 * (tdm_grad_scaler_update's rule). Accumulating rounds scale their losses alike.
 * TDM_ERR_ARG for a NULL dp. */
int tdm_dp_set_grad_scaler(tdm_dp *dp, tdm_grad_scaler *s);
/* Whether the last tdm_dp_step skipped its update (fp16 found an inf or NaN); false without a
 * scaler or for a NULL dp. */
bool tdm_dp_step_skipped(const tdm_dp *dp);
/* The dtype the replicas' gradients are averaged in (tdm_ddp_opts.reduce_dtype, on every
 * replica's DDP), between steps: TDM_BF16 halves what crosses between processes or GPUs.
 * TDM_ERR_ARG for a NULL dp, another dtype, or TDM_BF16 where every device is a CPU device of
 * this process and no stage 3 sharding: those average in shared memory, where nothing
 * crosses a wire and rounding would only lose precision. TDM_ERR_NOMEM naming the device. */
int tdm_dp_set_reduce_dtype(tdm_dp *dp, tdm_dtype dt);
/* Replica r's module and optimizer (0 <= r < devices). When every device is a CPU device of
 * this process, replicas share memory and split the update instead: each averages the
 * gradients of its shard of the parameters and steps replica 0's optimizer there, then copies
 * the shard to the others (bit for bit the all-reduce's result). Replica 0's optimizer is
 * then the only one and holds the whole state, once (save and restore that one):
 * tdm_dp_optim is NULL for the others (until ZeRO stage 3 gives each its own, see
 * tdm_strategy_set_shard). Otherwise every replica's optimizer holds the whole
 * state, or, sharded by TDM_SHARD_OPTIMIZER, its shard of it
 * (tdm_dp_optim_gather assembles the whole). */
tdm_module *tdm_dp_replica(tdm_dp *dp, int r);
tdm_optim *tdm_dp_optim(tdm_dp *dp, int r);
int tdm_dp_devices(const tdm_dp *dp);
/* Stops the threads and frees the replicas it made (not replica 0, the caller's model) and
 * the optimizers. */
void tdm_dp_free(tdm_dp *dp);

/* ---- the device mesh (PyTorch's init_device_mesh) ----------------------------------------- */

typedef struct tdm_mesh tdm_mesh;

#define TDM_MESH_MAX_DIMS 4
#define TDM_MESH_NAME_LEN 16

/* Lays the ranks of g out on ndim named dimensions of the given sizes (their product must be
 * g's size), row-major as init_device_mesh does: the last dimension varies fastest, so with
 * {"dp", "tp"} = {2, 2} ranks 0 and 1 are one tensor-parallel pair and ranks 0 and 2 one
 * data-parallel pair. A collective over g: every rank calls it with the same arguments and
 * gets its own mesh. g is a threads group (tdm_spawn's: the devices of one process), an MPI
 * group (tdm_mpi_init's: one device a process) or a two-level group (several devices a
 * process under mpirun, as DataParallel across processes makes); across processes every
 * process makes its meshes in the same order, since their groups' messages are told apart by
 * the order they were made in. Across processes each dimension's groups must hold as many
 * ranks in each of their processes (dp x tp = 2 x 2 over 2 processes of 2 devices: tp inside
 * each, dp across; 2 x 3 over 3 processes of 2: refused). GPUs in several processes are
 * refused (no NCCL groups across processes yet). NULL and an error on bad sizes or names. */
tdm_mesh *tdm_mesh_new(tdm_group *g, int ndim, const int *sizes, const char *const *names);
/* The group of the ranks that differ from this one along `dim` only (mesh["tp"] in PyTorch):
 * its rank in it is this rank's coordinate along dim. Owned by the mesh. NULL and an error
 * naming the dimensions for an unknown name. */
tdm_group *tdm_mesh_group(const tdm_mesh *m, const char *dim);
/* This rank's coordinate along dim, and the dimension's size; -1 and an error as above. */
int tdm_mesh_coord(const tdm_mesh *m, const char *dim);
int tdm_mesh_size(const tdm_mesh *m, const char *dim);
/* Frees this rank's mesh and its groups: a collective over the mesh's group (a barrier, so
 * that no rank still uses a group another frees). NULL is ignored. */
void tdm_mesh_free(tdm_mesh *m);

/* ---- tensor parallelism: one layer split over the ranks of a group ------------------------ */

/* Megatron-LM's layers (PyTorch's ColwiseParallel, RowwiseParallel): every rank of `tp` runs
 * the same forward on the same input, each with its part of the layer's matrices. Called by
 * every rank of tp (the collectives join them), from a thread with a step scope open for a
 * backward, as any op. Each returns NULL and an error on a NULL argument, a shape that does
 * not split over the ranks, or a failed collective (which fails the other ranks too). */

/* Forward x itself (a view); backward, the gradient summed over the ranks: the input of a
 * column-parallel layer, each rank's backward giving the gradient of its part only. */
tdm_tensor *tdm_tp_copy(tdm_group *tp, tdm_tensor *x);
/* Forward x summed over the ranks (a new tensor); backward, the gradient itself: the output of
 * a row-parallel layer, each rank's partial product. */
tdm_tensor *tdm_tp_reduce(tdm_group *tp, tdm_tensor *x);
/* Forward every rank's x [..., k] joined along the last dim, rank order: [..., n k]; backward,
 * this rank's slice of the gradient. */
tdm_tensor *tdm_tp_gather(tdm_group *tp, tdm_tensor *x);
/* Forward this rank's slice [r k, (r+1) k) of x's last dim (n k wide; a new tensor); backward,
 * every rank's gradient joined: the input of a row-parallel layer that was whole. */
tdm_tensor *tdm_tp_scatter(tdm_group *tp, tdm_tensor *x);

/* Sequence parallelism (Megatron-LM's second paper): between the tensor-parallel layers each
 * rank holds only its part [r S/n, (r+1) S/n) of the tokens, along dim (e.g. 1 of [B, T, C]),
 * so the layer norms, residual adds and dropout there work on 1/n of the activations.
 * tdm_tp_seq_shard: forward this rank's part, backward every rank's gradient joined (for a
 * tensor the ranks all computed, like the embeddings). tdm_tp_seq_gather: forward every rank's
 * part joined; backward, with grad_parts, the ranks' gradients summed and each rank keeping
 * its part (the input of a column-parallel layer, each rank's gradient a part of the sum),
 * else this rank's part of the gradient (a consumer that every rank runs whole, like the LM
 * head). tdm_tp_seq_reduce_scatter: forward the ranks' x summed, each keeping its part (a
 * row-parallel layer's output), backward every rank's gradient joined. The dim must split
 * over the ranks. */
tdm_tensor *tdm_tp_seq_shard(tdm_group *tp, tdm_tensor *x, int dim);
tdm_tensor *tdm_tp_seq_gather(tdm_group *tp, tdm_tensor *x, int dim, bool grad_parts);
tdm_tensor *tdm_tp_seq_reduce_scatter(tdm_group *tp, tdm_tensor *x, int dim);

/* A column-parallel Linear (in -> out, out a multiple of the ranks): rank r holds rows
 * [r out/n, (r+1) out/n) of the weight [out, in] and of the bias, and computes that part of
 * the output: [..., out/n], or the whole [..., out] with gather_output. A row-parallel Linear
 * (in a multiple of the ranks) holds columns [r in/n, (r+1) in/n) of the weight and the whole
 * bias; its input is [..., in/n] (input_is_parallel: a column-parallel layer's output) or the
 * whole [..., in], and its output [..., out] is summed over the ranks. Both draw the whole
 * layer from rng as tdm_linear_new does and keep their part: ranks given the same rng state
 * hold the parts of the same one-device layer. The parameters are named "weight" and "bias"
 * and hold the parts (shapes [out/n, in] and [out/n]; [out, in/n] and [out]). The layer keeps
 * tp, which must outlive it; it cannot be cloned (tdm_module_clone fails). */
tdm_module *tdm_column_linear_new(int64_t in, int64_t out, bool bias, bool gather_output,
                                  tdm_group *tp, tdm_device dev, tdm_rng *rng);
tdm_module *tdm_row_linear_new(int64_t in, int64_t out, bool bias, bool input_is_parallel,
                               tdm_group *tp, tdm_device dev, tdm_rng *rng);
/* The same layers made from this rank's part of an existing Linear (PyTorch's
 * parallelize_module), which stays the caller's: a model built alike on every rank, then
 * split. A column-parallel layer may see the output features as `blocks` equal blocks, each
 * split over the ranks (3 for an attention's fused q, k, v projection, so that each rank gets
 * the q, k and v of its heads); blocks > 1 leaves the output split. NULL and an error for a
 * module that is not a Linear, or sizes that do not split. */
tdm_module *tdm_column_linear_from(const tdm_module *linear, int blocks, bool gather_output,
                                   tdm_group *tp);
tdm_module *tdm_row_linear_from(const tdm_module *linear, bool input_is_parallel, tdm_group *tp);
/* Sequence parallelism for such a layer (dim >= 0; -1 turns it off): a column-parallel layer
 * then takes its input split along dim and gathers it (tdm_tp_seq_gather), a row-parallel one
 * reduce-scatters its output along dim (tdm_tp_seq_reduce_scatter) and adds its bias to its
 * part through tdm_tp_copy, so the bias's gradient is summed over the ranks in backward. A
 * layer norm between such layers sees each rank's tokens only: give it its weight and bias
 * through tdm_tp_copy too (tdm_layer_norm(x, 1, tdm_tp_copy(tp, w), tdm_tp_copy(tp, b), eps),
 * as tdm_gpt_parallelize does). Not for a layer whose output (column) or input (row) is
 * whole. TDM_OK or TDM_ERR_ARG. */
int tdm_tp_linear_set_sequence_dim(tdm_module *layer, int dim);
/* Vocabulary parallelism (Megatron's VocabParallelEmbedding and parallel cross-entropy,
 * PyTorch's loss_parallel): rank r holds rows [r k, (r+1) k) of an embedding weight [n k, C]
 * (weight is its part [k, C]), and columns [r k, (r+1) k) of the logits. tdm_tp_embedding:
 * idx's rows of the whole weight, [..., C], the same on every rank (each rank's rows summed);
 * backward, each rank's part gets its tokens' gradients. tdm_tp_cross_entropy: the mean
 * cross-entropy of logits [M, n k] against targets [M] (i32 or i64) from each rank's columns
 * logits [M, k] without gathering them (a max, a sum of exponentials and the target's logit
 * exchanged per row); the same scalar on every rank, the gradient of each part computed where
 * it lives. bf16/f16 logits are computed on in f32 without an f32 copy (the loss f32, their
 * gradient in their dtype, as the non-parallel cross-entropy under autocast). An index or
 * target outside [0, n k) is refused naming it. */
tdm_tensor *tdm_tp_embedding(tdm_group *tp, tdm_tensor *weight, const tdm_tensor *idx);
/* A module holding this rank's rows of an existing Embedding's weight (the rows must split
 * over the ranks), whose forward is tdm_tp_embedding. Cannot be cloned. NULL and an error. */
tdm_module *tdm_vocab_embedding_from(const tdm_module *embedding, tdm_group *tp);
tdm_tensor *tdm_tp_cross_entropy(tdm_group *tp, tdm_tensor *logits, const tdm_tensor *target);

/* Writes into `whole` the whole tensors the ranks' parts of `split` make: whole is a model of
 * split's structure with the unsplit layers (the model every rank built before splitting it:
 * tdm_gpt_parallelize), split a rank's model after. Every tensor-parallel layer's parts are
 * gathered over its group (a collective: every rank calls it), the other parameters copied.
 * A rank may pass whole NULL to take part without writing (one whole model for a checkpoint,
 * not one per rank); every rank that passes one gets the same whole weights. For checkpoints
 * under the unsplit names and llm.c's files. TDM_OK, or TDM_ERR_ARG/SHAPE when the two models
 * do not match, or a collective's error. */
int tdm_tp_gather_whole(tdm_module *split, tdm_module *whole);
/* The inverse, with no communication: each tensor-parallel layer of split takes its rank's
 * part of the whole one in `whole` (a checkpoint read into an unsplit model), the other
 * parameters a copy. Errors as tdm_tp_gather_whole's. */
int tdm_tp_scatter_whole(tdm_module *split, tdm_module *whole);
/* The same for an optimizer's state: so steps split's parameters (tdm_module_parameters(split)),
 * wo the whole model's, of the same kind. Gather writes every state buffer
 * (exp_avg, exp_avg_sq, momentum_buffer, ...) of wo from the ranks' parts and takes so's step
 * count (a collective over the groups as tdm_tp_gather_whole; whole and wo NULL: take part
 * only); scatter gives so its parts of wo's buffers and wo's step count (a so sharded over
 * data-parallel ranks, tdm_optim_shard, takes its range of them). TDM_ERR_ARG for NULLs or
 * optimizers of different kinds or buffers, TDM_ERR_STATE for gathering from a sharded so
 * (tdm_optim_gather it first). */
int tdm_tp_gather_state(tdm_module *split, tdm_optim *so, tdm_module *whole, tdm_optim *wo);
int tdm_tp_scatter_state(tdm_module *split, tdm_optim *so, tdm_module *whole, tdm_optim *wo);
/* clip_grad_norm_ for a split model: the norm is the whole model's (the squares of every
 * part's gradient summed over the tensor-parallel group, a collective, and those of the
 * parameters every rank holds whole counted once), and every rank scales its gradients by
 * max_norm / (norm + 1e-6) when below 1, as tdm_clip_grad_norm does on one device. ddp (may
 * be NULL) is the split model's DDP over dp, its data-parallel group: under ZeRO stages 2 and
 * 3 the rank holds only its shard of the averaged gradient (tdm_ddp_shard_grad), whose squares are
 * summed over dp first (a collective over dp too) and which is what is scaled. *total_norm (may
 * be NULL) gets the norm. TDM_ERR_ARG for a NULL split, max_norm not > 0, layers split over
 * different groups, or a sharded ddp without dp. */
/* The squares of m's gradients without any collective, for a caller that joins a norm over
 * more than one group (a pipeline's stages): *whole gets those of the parameters held whole
 * (the same on every rank of a split model), *parts those of this rank's parts of split
 * parameters (to be summed over the tensor-parallel group), each parameter once. m may hold no
 * split layer (then *parts is 0). TDM_ERR_ARG for NULLs. */
int tdm_tp_grad_squares(tdm_module *m, double *whole, double *parts);
int tdm_tp_clip_grad_norm(tdm_module *split, tdm_ddp *ddp, tdm_group *dp, float max_norm,
                          float *total_norm);

#ifdef __cplusplus
}
#endif
#endif
