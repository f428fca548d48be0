/* Tandem tracing: spans of work per thread, written as a Chrome trace (JSON) that Perfetto
 * and chrome://tracing show with one track per thread: each device's compute, its
 * communication, the loader, the training loop.
 *
 * Recording costs one branch while tracing is off. While on, spans go to a preallocated
 * buffer (no allocation per span); spans past its capacity are dropped and their count is
 * written in the file ("droppedSpans").
 * Span names must be string literals or otherwise outlive tdm_trace_stop.
 */
#ifndef TANDEM_TRACE_H
#define TANDEM_TRACE_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Starts recording, to be written to path by tdm_trace_stop. capacity: spans kept (0: one
 * million). Returns 0, or a negative status if tracing is already on or memory is short. */
int tdm_trace_start(const char *path, int64_t capacity);
/* Stops recording and writes the trace file. Returns 0 or a negative status naming the
 * path (the spans are discarded either way). */
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
