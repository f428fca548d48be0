/* Tandem tracing: spans of work per thread, written as a Chrome trace (JSON) that Perfetto
 * and chrome://tracing show with one track per thread: each device's compute, its
 * communication, the loader, the training loop.
 *
 * Recording costs one branch while tracing is off. While on, each span is formatted as it ends
 * and streamed to the file through a fixed buffer (no allocation per span, memory bounded
 * however long the run): a process killed mid-run leaves the events written so far, which
 * the viewers read (the JSON array form, whose closing bracket may be missing). Spans past the
 * capacity are dropped, and their count is written at the end ("droppedSpans").
 */
#ifndef TANDEM_TRACE_H
#define TANDEM_TRACE_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Starts recording into the file at path, created or emptied now, so that a path that cannot
 * be written fails here, before the work it would trace. capacity: spans written at most
 * (0: one million). Returns 0, or a negative status: TDM_ERR_STATE if tracing is already on,
 * TDM_ERR_IO naming the path and the cause if it cannot be opened for writing. */
int tdm_trace_start(const char *path, int64_t capacity);
/* Writes the spans recorded so far to the file (they are otherwise written in blocks of
 * 64 KiB), so that a kill loses none of them. Returns 0, or TDM_ERR_IO naming the path and
 * the first write that failed (a full disk), or TDM_ERR_STATE when tracing is off. */
int tdm_trace_flush(void);
/* Stops recording, writes the spans not yet written and the end of the trace, and closes the
 * file. Returns 0, or a negative status naming the path when a write failed, now or at an
 * earlier flush (TDM_ERR_IO), or when tracing is off (TDM_ERR_STATE). */
int tdm_trace_stop(void);
bool tdm_trace_enabled(void);

/* Names the calling thread's track ("cpu:1 compute"); a thread without a name is shown as
 * "thread N". The name is copied. */
void tdm_trace_name_thread(const char *name);

/* Microseconds on the trace's clock. */
double tdm_trace_now(void);
/* Opens a span on the calling thread; spans nest up to 16 deep. */
void tdm_trace_begin(const char *name);
/* Closes the innermost open span of the calling thread. */
void tdm_trace_end(void);
/* Records a finished span [t0, t1) (from tdm_trace_now) on the calling thread's track. */
void tdm_trace_span(const char *name, double t0, double t1);

#ifdef __cplusplus
}
#endif
#endif
