/* Private helpers of src/io: atomic file writes, directories, checksums and checks shared by
 * the safetensors reader, the checkpoint code and the TensorBoard writer. */
#ifndef TDM_IO_INTERNAL_H
#define TDM_IO_INTERNAL_H

#include "core/core.h"
#include "tandem/io.h"

/* Opens a new temporary file beside path (same directory, so a rename is atomic) and writes
 * its name into tmp (cap bytes). Returns the descriptor, or -1 and TDM_ERR_IO naming path. */
int tdm_io_temp_open(const char *path, char *tmp, size_t cap);
/* Finishes a write started by tdm_io_temp_open: when rc is TDM_OK, flushes the file to disk,
 * renames it to path and flushes the directory; otherwise (or when any of that fails) removes
 * the temporary file. Closes fd. Returns rc or the new failure. */
int tdm_io_temp_commit(int fd, const char *tmp, const char *path, int rc);
/* Writes the n bytes at p to fd (the file being written as path), retrying short writes.
 * TDM_OK, or TDM_ERR_IO naming path and the cause. An I/O step of tdm_io_fail_nth. */
int tdm_io_write_all(int fd, const void *p, size_t n, const char *path);
/* Flushes a directory's entries (renames, creations) to disk. */
int tdm_io_fsync_dir(const char *dir);
/* Creates directory dir and its missing parents (mkdir -p; an existing one is fine). Returns
 * TDM_OK or TDM_ERR_IO "<what>: cannot create directory '<dir>': <errno's text>". */
int tdm_io_mkdir_p(const char *dir, const char *what);
/* Writes path's directory part into dir (cap bytes): "." when it has none. */
void tdm_io_dirname(const char *path, char *dir, size_t cap);

/* Fault injection, for tests of what a failing disk leaves behind: the n-th I/O step from now
 * (a write, fsync, rename, mkdir or temporary file of src/io's writers) fails with errno err
 * as if its system call had; n <= 0 turns it off. Process-wide. */
void tdm_io_fail_nth(int n, int err);
/* Counts one I/O step: true (errno set) when it is the one to fail. */
bool tdm_io_fault(void);

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of n bytes: the checksum of TFRecord
 * framing (tensorboard.c). tdm_crc32c("123456789", 9) is 0xE3069283. */
uint32_t tdm_crc32c(const void *data, size_t n);

/* Checks that tensor i of f can be read into dst (same shape; same dtype, or both float
 * dtypes, which tdm_safetensors_read converts); raises naming the file and the tensor
 * otherwise. */
int tdm_safetensors_check(const tdm_safetensors *f, int i, const tdm_tensor *dst);
/* The safetensors name of a Tandem dtype ("F32", "BF16", ...), NULL for an invalid one. */
const char *tdm_safetensors_dtype_of(tdm_dtype dt);
/* The file name f was opened as, into buf. */
int tdm_safetensors_what(const tdm_safetensors *f, char *buf, size_t cap);

/* ---- checkpoint internals shared by checkpoint.c and checkpoint_shard.c ------------------- */

/* Parameters then buffers of m, named (views, m's). *out is malloc'd (caller frees). */
int tdm_ckpt_model_tensors(tdm_module *m, tdm_named_tensor **out, int *n, const char *op);
/* Checks that f holds exactly ts[0..n) with their shapes and dtypes; TDM_ERR_FORMAT naming the
 * file and what is missing, unexpected or different. */
int tdm_ckpt_check_tensors(tdm_safetensors *f, const tdm_named_tensor *ts, int n);
/* Reads ts[0..n) from f by name (checked first with tdm_ckpt_check_tensors). */
int tdm_ckpt_read_tensors(tdm_safetensors *f, const tdm_named_tensor *ts, int n);
/* Removes a checkpoint (or temporary) directory and its files: 0, or -1 with errno. */
int tdm_ckpt_remove_dir(const char *path);
/* When this process holds the lock of checkpoint directory dir (taken under the same path),
 * checks that dir is still the directory locked, with its LOCK file: TDM_OK, or TDM_ERR_STATE
 * naming dir and what became of it (deleted or moved, replaced). TDM_OK when no lock of this
 * process was taken under that path. */
int tdm_ckpt_lock_verify(const char *dir);
/* Checks that checkpoint s->step may be written into dir (not another run's, still the
 * directory this process locked: tdm_ckpt_lock_verify), and makes its empty temporary
 * directory dir/.ckpt-<step>.tmp, whose path goes into tmp (cap bytes). */
int tdm_ckpt_prepare(const char *dir, const tdm_train_state *s, char *tmp, size_t cap);
/* Ends a save begun by tdm_ckpt_prepare: when rc is TDM_OK, flushes the temporary directory,
 * renames it into place (replacing this run's checkpoint of the step) and prunes to keep;
 * otherwise, or when that fails, removes it and leaves the old checkpoints. Returns rc or the
 * new failure. */
int tdm_ckpt_publish(const char *dir, const tdm_train_state *s, int keep, int rc);
/* Writes train_state.safetensors to path: the metadata, and with moments the optimizer's
 * "optim.<param>.<state>" tensors (an unsharded optimizer only). */
int tdm_ckpt_write_state(const char *path, const tdm_train_state *s, bool moments);

/* Reads n_bytes of tensor `name` of f from byte offset `at` within it into dst (host);
 * TDM_ERR_ARG when the tensor is missing or the range is outside it. */
int tdm_safetensors_read_bytes(tdm_safetensors *f, const char *name, uint64_t at, size_t n_bytes,
                               void *dst);
/* f's metadata entries, in the file's order: how many, and entry i's key and value (f's). */
int tdm_safetensors_meta_count(const tdm_safetensors *f);
void tdm_safetensors_meta_at(const tdm_safetensors *f, int i, const char **key, const char **val);

/* A sharded checkpoint being loaded (checkpoint_shard.c): this process's ranges read into host
 * memory, checked, before anything is changed. */
typedef struct {
    float *params;      /* [p_hi - p_lo] */
    int64_t p_lo, p_hi; /* the parameters this process takes */
    float *state[3];    /* [hi - lo] each, the optimizer's state buffers in its order */
    int n_state;
    tdm_safetensors *buffers; /* the model's buffers (running statistics) */
    tdm_named_tensor *bufs;
    int n_bufs;
} tdm_ckpt_shards;

/* Checks the sharded checkpoint at path against s (layout against the model and optimizer,
 * every shard file needed) and reads this process's ranges into sh; changes nothing. */
int tdm_ckpt_shards_read(const char *path, const tdm_train_state *s, tdm_ckpt_shards *sh);
/* Copies what tdm_ckpt_shards_read read into s's model and optimizer. */
int tdm_ckpt_shards_apply(tdm_ckpt_shards *sh, tdm_train_state *s);
void tdm_ckpt_shards_free(tdm_ckpt_shards *sh);

#endif
