/* Tandem input/output: safetensors files, model weights by PyTorch's names, and training
 * checkpoints that resume a run exactly.
 *
 * safetensors (https://github.com/huggingface/safetensors): an 8-byte little-endian header
 * length N, then N bytes of JSON, {"name": {"dtype": "F32", "shape": [2, 3],
 * "data_offsets": [begin, end]}, ..., "__metadata__": {"key": "value"}}, then the raw
 * little-endian data; offsets count from the first byte after the header. Files written here
 * are read by Python's `safetensors` and so by PyTorch (`load_state_dict`), and files they
 * write are read here.
 *
 * Reading never trusts the file: the header length must fit in the file, the JSON must parse
 * (duplicate names and invalid UTF-8 are rejected), every dtype must be known, every shape
 * must agree with its byte range, and the byte ranges must tile the data exactly (no overlap,
 * no gap, nothing past the end). A violation is TDM_ERR_FORMAT with a message naming the file
 * and the tensor; no allocation is larger than the file justifies. A header is at most 100 MB
 * (the reference implementation's limit) and 2^20 JSON values (about 87,000 tensors), counted
 * before it is parsed, so that refusing one costs no more than reading it.
 *
 * Writing is atomic: the data goes to a temporary file in the same directory, which is
 * flushed to disk (fsync) and renamed over the destination, and the directory is flushed
 * too. A crash at any point leaves either the old file or the new one, never a mix.
 *
 * Errors follow tensor.h: functions return TDM_OK or a negative tdm_status (NULL for
 * pointers) and tdm_last_error() says what went wrong and where.
 */
#ifndef TANDEM_IO_H
#define TANDEM_IO_H

#include "data.h"
#include "nn.h"
#include "optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- safetensors files ------------------------------------------------------------------- */

/* One tensor to write: its name (any UTF-8 text except "__metadata__"; names must be
 * distinct) and its values (any device, any strides; f32, bf16, f16, i32 or i64, written as
 * F32, BF16, F16, I32, I64). */
typedef struct {
    const char *name;
    const tdm_tensor *tensor;
} tdm_named_tensor;

/* A key/value pair of the header's "__metadata__" (both UTF-8 strings). */
typedef struct {
    const char *key;
    const char *value;
} tdm_meta;

/* Writes n tensors and n_meta metadata entries (meta may be NULL when n_meta is 0) to path,
 * atomically (see above). The data of tensor i follows that of tensor i-1, each aligned as
 * the format expects (the header is padded with spaces to a multiple of 8 bytes). Fails
 * with TDM_ERR_ARG for a NULL, repeated or reserved name, TDM_ERR_IO naming the path for a
 * file that cannot be written; path is then left as it was. */
int tdm_safetensors_save(const char *path, const tdm_named_tensor *ts, int n, const tdm_meta *meta,
                         int n_meta);

/* An opened, validated safetensors file. The header is read and checked when it is opened;
 * tensor data is read on demand. */
typedef struct tdm_safetensors tdm_safetensors;

/* Opens and validates path. Returns NULL and TDM_ERR_IO (cannot open or read) or
 * TDM_ERR_FORMAT (malformed: the message names the file and, where one is at fault, the
 * tensor). The caller closes the result with tdm_safetensors_close. */
tdm_safetensors *tdm_safetensors_open(const char *path);
/* The same from n bytes of memory (which must outlive the result; not copied). what names the
 * bytes in messages (e.g. a file name). For parsers of received data and fuzzing. */
tdm_safetensors *tdm_safetensors_open_memory(const void *data, size_t n, const char *what);
/* Releases f (and closes its file). NULL is allowed. */
void tdm_safetensors_close(tdm_safetensors *f);

/* Number of tensors in f, and the name of tensor i (0 <= i < count; owned by f; in the
 * order of their data in the file). */
int tdm_safetensors_count(const tdm_safetensors *f);
const char *tdm_safetensors_name(const tdm_safetensors *f, int i);
/* The index of the tensor called name, or -1 (no error raised). */
int tdm_safetensors_find(const tdm_safetensors *f, const char *name);
/* The safetensors dtype string of tensor i ("F32", "BF16", "I64", ...), and its shape. The
 * file may hold dtypes Tandem does not compute in (F64, U8, F8_E4M3, ...): they are valid
 * here but tdm_safetensors_read refuses them. */
const char *tdm_safetensors_dtype(const tdm_safetensors *f, int i);
tdm_shape tdm_safetensors_shape(const tdm_safetensors *f, int i);
/* The Tandem dtype of tensor i through *dt: TDM_OK for F32, BF16, F16, I32 and I64,
 * TDM_ERR_DTYPE naming the file, the tensor and its dtype otherwise. */
int tdm_safetensors_tdm_dtype(const tdm_safetensors *f, int i, tdm_dtype *dt);
/* The value of metadata key, or NULL when absent. Owned by f. */
const char *tdm_safetensors_meta(const tdm_safetensors *f, const char *key);

/* Reads tensor name into dst, which must have its shape and dtype (any device and strides);
 * between float dtypes the values are converted, as Hugging Face's loaders convert a
 * checkpoint to the model's dtype: a BF16 or F16 tensor into an f32 dst exactly, an F32 one
 * into a bf16 or f16 dst rounded to nearest even (half.h). TDM_ERR_ARG when the name is
 * absent, TDM_ERR_SHAPE / TDM_ERR_DTYPE naming both sides when the shapes differ or the
 * dtypes differ and are not both float, TDM_ERR_NOMEM, TDM_ERR_IO when the file cannot be
 * read. dst is unchanged on failure. */
int tdm_safetensors_read(tdm_safetensors *f, const char *name, tdm_tensor *dst);
/* Tensor name as a new tensor on dev (owned like any new tensor: by the open scope, or the
 * caller). NULL and an error as for tdm_safetensors_read. */
tdm_tensor *tdm_safetensors_load(tdm_safetensors *f, const char *name, tdm_device dev);

/* ---- model weights ----------------------------------------------------------------------- */

/* Saves m's parameters and buffers under their full PyTorch names ("1.weight",
 * "features.0.running_mean") with metadata {"format": "pt"} plus meta, atomically, so
 * `model.load_state_dict(safetensors.torch.load_file(path))` restores them in PyTorch. */
int tdm_weights_save(const char *path, tdm_module *m, const tdm_meta *meta, int n_meta);
/* Loads every parameter and buffer of m from path, converting float tensors of another float
 * dtype (a BF16 file into an f32 model) as tdm_safetensors_read does. Strict: a name of m
 * missing from the file, a tensor of the file that m does not have, or a shape that differs
 * or a dtype that differs and is not float on both sides is
 * TDM_ERR_FORMAT with a message listing each of them (missing, unexpected, different); m is
 * then left unchanged. Values go to m's device. */
int tdm_weights_load(const char *path, tdm_module *m);
/* Same from an opened file (e.g. a checkpoint's). */
int tdm_weights_load_from(tdm_safetensors *f, tdm_module *m);

/* ---- training checkpoints ---------------------------------------------------------------- */

/* What a checkpoint saves and restores. Each pointer may be NULL, leaving that part out. */
typedef struct {
    tdm_module *model;  /* weights: model.safetensors */
    tdm_optim *optim;   /* moments per parameter, step count, kind and learning rate */
    tdm_loader *loader; /* epoch and the samples of it consumed by every rank together */
    tdm_rng *rng;       /* a generator's seed and offset (e.g. tdm_default_rng()) */
    int64_t step;       /* optimizer steps taken in the run: the LR schedule's position */
    /* Extra string metadata of the caller, saved as "user.<key>" in train_state.safetensors
     * and read back with tdm_checkpoint_meta (ignored by tdm_checkpoint_load). */
    const tdm_meta *meta;
    int n_meta;
    /* The run's identity (a short string, e.g. from tdm_checkpoint_new_run_id), saved as
     * "run.id" in train_state.safetensors. Pruning and replacing touch only checkpoints of the
     * same identity, so runs sharing a directory cannot delete each other's. NULL: none, and
     * only checkpoints without one are touched (those written before identities existed). */
    const char *run_id;
} tdm_train_state;

/* Writes checkpoint `step` into dir (created if missing) as the directory
 * dir/ckpt-<step, 10 digits>/ holding model.safetensors (the weights, exactly as
 * tdm_weights_save writes them, so PyTorch loads them) and train_state.safetensors (the
 * optimizer's moments as "optim.<param name>.<exp_avg|exp_avg_sq|max_exp_avg_sq|
 * momentum_buffer>" tensors; positions, RNG and caller metadata in __metadata__). Both files
 * are written into a temporary directory, flushed, and the directory is renamed into place:
 * a crash leaves the previous checkpoints intact. Then all but the newest keep checkpoints
 * of this run (s->run_id) are removed (keep <= 0 keeps all); other runs' are left alone. An
 * existing ckpt-<step> of this run is replaced; one of another run is TDM_ERR_STATE naming
 * both runs, and is left as it was. A sharded optimizer (tdm_optim_shard) is TDM_ERR_STATE:
 * save the whole copy tdm_optim_gather makes on every rank, which writes the file an
 * unsharded run writes. */
int tdm_checkpoint_save(const char *dir, const tdm_train_state *s, int keep);
/* Makes dir (and its parents) if missing and checks that a checkpoint could be written there
 * (a file created and removed), so that a run finds an unusable directory at its start rather
 * than at its first save. TDM_ERR_IO naming dir and the cause (not a directory, read-only,
 * no permission). */
int tdm_checkpoint_dir_check(const char *dir);
/* The newest complete checkpoint in dir: writes its path into path (cap bytes) and its step
 * into *step (may be NULL). Returns 1 when found, 0 when dir holds none (or does not exist),
 * or a negative status. */
int tdm_checkpoint_latest(const char *dir, char *path, size_t cap, int64_t *step);
/* Restores from checkpoint directory path (as written by tdm_checkpoint_save) whatever s
 * points to: the model's weights (strictly, as tdm_weights_load), the optimizer's moments,
 * step count and learning rate (its kind and parameter names must match), the loader
 * (restarted with tdm_loader_start_epoch_at at the saved epoch and at its batch that starts
 * the saved global position: tdm_loader_global_batch_at, so that a loader of another world
 * size or batch size with a global batch that divides the position resumes where the saving
 * ranks stopped), the generator,
 * and s->step. Everything is validated before anything is changed: the step and the
 * optimizer's step count are integers >= 0, the step the one a directory named ckpt-<step>
 * is named for (the name orders the checkpoints), the learning rate a finite float >= 0, the
 * epoch >= 0 and the position a batch start of this loader's epoch; anything else is
 * TDM_ERR_FORMAT naming the file, the field and its value. A sharded optimizer
 * (tdm_optim_shard) takes its shard of the saved state (tdm_optim_state_load: no
 * communication), whatever the number of ranks that saved it. A sharded checkpoint (below:
 * layout.safetensors) is read the same way, each caller reading only the pieces of the
 * shard files that cover its range; a missing or truncated shard file, or a layout that does
 * not fit the model or optimizer, is TDM_ERR_FORMAT / TDM_ERR_IO naming the file. */
int tdm_checkpoint_load(const char *path, tdm_train_state *s);
/* The caller metadata `key` (as given in tdm_train_state.meta) of checkpoint directory path,
 * copied into out (cap bytes, truncated to fit). Returns 1 when present, 0 when absent, or a
 * negative status when the checkpoint cannot be read. */
int tdm_checkpoint_meta(const char *path, const char *key, char *out, size_t cap);

/* ---- sharded checkpoints (ZeRO): each process writes its shard ------------------------------
 *
 * A sharded checkpoint is dir/ckpt-<step>/ holding, instead of model.safetensors:
 *   shard-<rank, 5 digits>-of-<world, 5 digits>.safetensors  one per process: F32 [hi - lo]
 *       tensors "params" (elements [lo, hi) of the flat parameter buffer, tdm_paramset) and
 *       "optim.<state>" (the same range of each optimizer state buffer); __metadata__
 *       tandem.shard, shard.rank, shard.world, shard.lo, shard.hi, shard.total
 *   layout.safetensors   no tensors; __metadata__ tandem.sharded ("1"), world, total, params
 *       (their count), param.<i> ("<offset> <ndim> <d0> ... <name>", in the paramset's
 *       order), rank.<r> ("<lo> <hi>"), optim.kind, optim.states ("exp_avg,exp_avg_sq")
 *   buffers.safetensors  the model's buffers by their state_dict names
 *   train_state.safetensors  as an unsharded checkpoint's, without the "optim." tensors
 * tdm_checkpoint_load reads one on any number of processes (each reads the pieces of the
 * shard files that cover its range), and tdm_checkpoint_export makes it whole.
 *
 * A save is three steps with the caller's agreement between them (e.g. an all-reduce of the
 * failures): rank 0 tdm_checkpoint_shard_begin; every rank tdm_checkpoint_shard_write; when
 * every rank succeeded, rank 0 tdm_checkpoint_shard_finish, else tdm_checkpoint_shard_abort.
 * The checkpoint appears (a rename) only in finish; until then the old ones are intact. */

/* Rank 0: makes the empty temporary directory of checkpoint s->step in dir (checking that
 * this step's checkpoint, if any, is this run's). TDM_OK, TDM_ERR_STATE (another run's) or
 * TDM_ERR_IO naming the directory and the cause. */
int tdm_checkpoint_shard_begin(const char *dir, const tdm_train_state *s);
/* Every rank, after begin: writes its shard file (s->model's parameters and s->optim's state
 * over the optimizer's tdm_optim_shard_range) into the temporary directory. rank and world
 * name the file. TDM_ERR_IO naming the file and the cause; nothing is published. */
int tdm_checkpoint_shard_write(const char *dir, const tdm_train_state *s, int rank, int world);
/* Rank 0, when every rank's write succeeded: writes the layout (ranges: world pairs lo, hi,
 * rank by rank), the buffers and the training state, then renames the directory into place
 * and prunes as tdm_checkpoint_save does. On failure the directory is removed. */
int tdm_checkpoint_shard_finish(const char *dir, const tdm_train_state *s, const int64_t *ranges,
                                int world, int keep);
/* Rank 0, when some rank failed: removes the temporary directory of step `step`. */
void tdm_checkpoint_shard_abort(const char *dir, int64_t step);
/* Whether checkpoint directory path is a sharded one (holds layout.safetensors). */
bool tdm_checkpoint_is_sharded(const char *path);
/* Elements [lo, hi) of the flat parameter buffer saved in sharded checkpoint ckpt, read into
 * dst (f32 [hi - lo] in host memory) from the pieces of the shard files that cover them,
 * after checking the checkpoint's parameters (names, offsets, shapes) against ps: for writers
 * of other formats that stream a sharded model piece by piece instead of holding it whole
 * (tdm_gpt_save_llmc_from). TDM_ERR_ARG for a range outside [0, ps->total); TDM_ERR_FORMAT /
 * TDM_ERR_IO naming the file and the cause. */
int tdm_checkpoint_read_params(const char *ckpt, const tdm_paramset *ps, int64_t lo, int64_t hi,
                               float *dst);
/* Writes checkpoint directory ckpt (sharded or not) whole: model_path (may be NULL) as
 * model.safetensors is written (PyTorch's names; load_state_dict takes it), and state_path
 * (may be NULL) as an unsharded run's train_state.safetensors, with the moments. The whole
 * model is held in memory. Each output is written to a temporary file beside it, and both are
 * renamed over their paths only once both are complete: a failure leaves them as they were. A
 * sharded checkpoint's layout is checked on its own first (every parameter inside the data,
 * shapes that do not overflow, distinct nonempty names, the ranks' ranges tiling the data).
 * Fails with TDM_ERR_ARG naming both paths, before anything is read or written, when an output
 * lies inside ckpt, is one of its files under another name (a hard link), or both outputs are
 * one file; with TDM_ERR_IO / TDM_ERR_FORMAT naming the file, the field and the cause (a
 * missing or truncated shard, a layout field out of range). */
int tdm_checkpoint_export(const char *ckpt, const char *model_path, const char *state_path);
/* tdm_checkpoint_export with the model's f32 tensors written in dt (TDM_F32, TDM_BF16 or
 * TDM_F16, rounded to nearest even as half.h; Hugging Face's convention for a model saved in
 * bf16: integer buffers stay as they are), the state always in f32 (an optimizer's moments
 * are not the model). TDM_ERR_DTYPE naming dt for another dtype; otherwise as
 * tdm_checkpoint_export. */
int tdm_checkpoint_export_as(const char *ckpt, const char *model_path, const char *state_path,
                             tdm_dtype dt);

/* ---- one run per checkpoint directory ---------------------------------------------------- */

/* Two runs writing into one directory would interleave their checkpoints and prune each
 * other's. A run therefore holds the directory's lock while it uses it, and tags its
 * checkpoints with its identity (tdm_train_state.run_id): a new one at its start, the
 * resumed checkpoint's on a resume. */

/* The lock on a checkpoint directory, held by one holder at a time. */
typedef struct tdm_checkpoint_lock tdm_checkpoint_lock;

/* Takes the lock of checkpoint directory dir (made, with its parents, if missing) without
 * waiting: the file dir/LOCK, locked with flock(2), into which the holder writes one line
 * saying who it is: "<who> pid <pid> on host <host> since <local time>" (who: e.g.
 * "tandem train"; NULL for "a process"). The kernel releases the lock when its holder exits,
 * however it ends (kill -9 included), so a LOCK file left by a killed run does not block the
 * next; the file itself is never removed (removing it would let two processes lock two
 * different files). The lock is not passed on to programs the holder execs; a child made by
 * fork shares it until it execs or exits.
 * Once it holds the lock it removes what saves interrupted by a kill left there (temporary
 * .ckpt-<step>.tmp directories; a checkpoint moved aside as .ckpt-<step>.old goes back into
 * place if its replacement is missing). The lock holds the directory, not its path: every
 * later save of this process into the same path (as given here) first checks that the path
 * still names that directory and its LOCK file, and fails with TDM_ERR_STATE naming dir
 * if it was deleted, moved or replaced, rather than write where the lock does not hold.
 * Returns the lock, which the caller releases with tdm_checkpoint_unlock. NULL when it cannot
 * be taken: TDM_ERR_STATE "checkpoint directory '<dir>' is in use by <the holder's line>" when
 * another holder has it (another process, or another lock taken by this one); TDM_ERR_IO
 * naming dir and the cause when the directory or its LOCK file cannot be made or locked (a
 * read-only directory, a file system without locks). */
tdm_checkpoint_lock *tdm_checkpoint_lock_dir(const char *dir, const char *who);
/* Releases the lock (emptying the LOCK file's line first). NULL is allowed. */
void tdm_checkpoint_unlock(tdm_checkpoint_lock *lock);

/* Writes a new run identity into out (cap >= 17 bytes): 16 hex digits of 64 random bits from
 * /dev/urandom (from the clock and the process id where that cannot be read). TDM_OK, or
 * TDM_ERR_ARG for a NULL or short out. */
int tdm_checkpoint_new_run_id(char *out, size_t cap);
/* The run identity of checkpoint directory path (tdm_train_state.run_id), copied into out
 * (cap bytes, truncated to fit). Returns 1 when present, 0 when absent (a checkpoint written
 * without one), or a negative status when the checkpoint cannot be read. */
int tdm_checkpoint_run_id(const char *path, char *out, size_t cap);

/* The steps of dir's checkpoints (its ckpt-<step> directories), ascending, into steps (the
 * first cap of them; steps may be NULL when cap is 0). Returns how many there are (perhaps
 * more than cap), 0 when dir does not exist, or TDM_ERR_IO when it cannot be read. */
int tdm_checkpoint_list(const char *dir, int64_t *steps, int cap);
/* Deletes every checkpoint of dir, whoever wrote it (and what interrupted saves left), to
 * start a run over; other files are left. Hold dir's lock. TDM_OK, or TDM_ERR_IO naming the
 * checkpoint that could not be removed. */
int tdm_checkpoint_clear(const char *dir);

#ifdef __cplusplus
}
#endif
#endif
