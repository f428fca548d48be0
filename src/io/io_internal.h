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

/* Checks that tensor i of f can be read into dst (same shape and dtype); raises naming the
 * file and the tensor otherwise. */
int tdm_safetensors_check(const tdm_safetensors *f, int i, const tdm_tensor *dst);
/* The file name f was opened as, into buf. */
int tdm_safetensors_what(const tdm_safetensors *f, char *buf, size_t cap);

#endif
