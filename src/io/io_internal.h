/* Private helpers of src/io: atomic file writes and checks shared by the safetensors reader
 * and the checkpoint code. */
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
/* Writes path's directory part into dir (cap bytes): "." when it has none. */
void tdm_io_dirname(const char *path, char *dir, size_t cap);

/* Checks that tensor i of f can be read into dst (same shape and dtype); raises naming the
 * file and the tensor otherwise. */
int tdm_safetensors_check(const tdm_safetensors *f, int i, const tdm_tensor *dst);
/* The file name f was opened as, into buf. */
int tdm_safetensors_what(const tdm_safetensors *f, char *buf, size_t cap);

#endif
