/* Tandem TensorBoard logging: scalars written as TensorBoard event files, what PyTorch's
 * torch.utils.tensorboard.SummaryWriter.add_scalar writes, read by `tensorboard --logdir DIR`.
 *
 *     tdm_tb_writer *tb = tdm_tb_open("runs/mlp");
 *     if (!tb) fprintf(stderr, "%s\n", tdm_last_error());
 *     tdm_tb_add_scalar(tb, "loss/train", step, loss, 0);   // 0: wall time now
 *     ...
 *     if (tdm_tb_close(tb)) fprintf(stderr, "%s\n", tdm_last_error());
 *
 * The file is DIR/events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n>, PyTorch's name
 * (n counts the writers this process opened, so two writers never share a file). It is a
 * sequence of TFRecords, each holding one serialized tensorflow.Event protobuf: the first says
 * file_version "brain.Event:2", each later one a step, a wall time and one Summary value
 * (tag, simple_value). The encoding is written by hand (src/io/tensorboard.c says how); no
 * protobuf library is needed.
 *
 * Writes are buffered: events reach the file at tdm_tb_flush, tdm_tb_close, or when the
 * buffer fills, so TensorBoard, which reads the file while it grows, shows them then. The
 * first event is flushed at open, so the run appears as soon as it starts.
 *
 * A writer is used by one thread at a time. Errors follow tensor.h: functions return TDM_OK or
 * a negative tdm_status (NULL for pointers) and tdm_last_error() names the file and the cause.
 */
#ifndef TANDEM_TENSORBOARD_H
#define TANDEM_TENSORBOARD_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_tb_writer tdm_tb_writer;

/* Creates directory dir (and its missing parents) when it does not exist, creates a new event
 * file in it and writes the file_version event. Returns a writer owned by the caller (release
 * it with tdm_tb_close), or NULL with TDM_ERR_ARG for a NULL or empty dir, TDM_ERR_IO naming
 * the directory or file and the system's reason (errno's text) when either cannot be created
 * or written, TDM_ERR_NOMEM when memory is short. */
tdm_tb_writer *tdm_tb_open(const char *dir);

/* Appends one scalar: tag (the chart's name, e.g. "loss/train"; UTF-8; not kept after the
 * call), step (the x axis), value (stored as a 32-bit float, as TensorBoard's simple_value
 * is; NaN and infinities pass through) and wall_time (seconds since the Unix epoch; 0 means
 * now). Returns TDM_OK, TDM_ERR_ARG for a NULL writer or a NULL, empty or non-UTF-8 tag
 * (nothing is written then), or TDM_ERR_IO naming the file and errno's text when the write
 * fails; once a write has failed, every later call fails with that first error (the file
 * would have a hole). */
int tdm_tb_add_scalar(tdm_tb_writer *w, const char *tag, int64_t step, double value,
                      double wall_time);

/* Pushes the buffered events to the file (not to disk: no fsync), so TensorBoard sees them.
 * Returns TDM_OK, TDM_ERR_ARG for a NULL writer, or TDM_ERR_IO naming the file and errno's
 * text for this or an earlier failed write. */
int tdm_tb_flush(tdm_tb_writer *w);

/* Flushes and closes the file and frees w (NULL is allowed: TDM_OK). Returns TDM_OK when every
 * event since open reached the file, or TDM_ERR_IO naming the file and errno's text of the
 * first write that failed; w is freed either way. */
int tdm_tb_close(tdm_tb_writer *w);

/* The event file's path, owned by w (valid until tdm_tb_close); NULL for a NULL writer. */
const char *tdm_tb_path(const tdm_tb_writer *w);

#ifdef __cplusplus
}
#endif
#endif
