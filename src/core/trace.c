/* Trace recording, streamed: each span is formatted as one Chrome trace event when it ends
 * and appended to a buffer of whole events, which is written to the file when full, at
 * tdm_trace_flush and at tdm_trace_stop. Memory is that buffer whatever the run's length,
 * and a killed process leaves every event written so far.
 *
 * The file is the trace event format's JSON array form ("[", then one event per line, each
 * followed by a comma), closed by "]" at tdm_trace_stop. The Trace Event Format document makes
 * the array form's closing "]" optional, so that a process that dies mid-trace still leaves a
 * trace: the Chrome trace viewer's importer (catapult's trace_event_importer) drops a trailing
 * comma and adds the bracket before parsing, and Perfetto's JSON importer, which takes that
 * viewer's format, accepts the same. The buffer is written only between events, so a kill
 * cuts no event in half (short of the kernel cutting a write of the buffer itself). */
#include "tandem/trace.h"

#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_TRACKS 256
#define MAX_DEPTH  16
#define OUT_CAP    (64 * 1024) /* bytes of whole events held before a write */
#define EVENT_CAP  512         /* one event's text; longer names are cut */

static struct {
    atomic_bool on;
    atomic_int writers; /* threads inside tdm_trace_span: stop waits for them */
    int64_t capacity;   /* spans written at most */
    atomic_llong used;  /* spans recorded, written or dropped */
    atomic_int tracks;
    char track_names[MAX_TRACKS][48];
    char path[1024];
    double origin;
    int fd;
    char out[OUT_CAP]; /* whole events not yet written */
    size_t out_n;
    int err; /* errno of the first failed write, 0 */
} tr = {.fd = -1};

static pthread_mutex_t tr_lock = PTHREAD_MUTEX_INITIALIZER;  /* start, stop, naming, flush */
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER; /* tr.out, tr.out_n, tr.err */

static _Thread_local int my_track = -1;
static _Thread_local int depth;
static _Thread_local const char *open_name[MAX_DEPTH];
static _Thread_local double open_t0[MAX_DEPTH];

static double clock_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

double tdm_trace_now(void) {
    return clock_us() - tr.origin;
}

bool tdm_trace_enabled(void) {
    return atomic_load_explicit(&tr.on, memory_order_relaxed);
}

static int track(void) {
    if (my_track < 0) {
        my_track = atomic_fetch_add(&tr.tracks, 1);
        if (my_track >= MAX_TRACKS) my_track = MAX_TRACKS - 1; /* shared overflow track */
    }
    return my_track;
}

/* ---- the file ------------------------------------------------------------------------- */

/* Writes the buffer out; a failure is kept in tr.err (the first) and its events dropped. */
static void out_drain(void) {
    for (size_t at = 0; at < tr.out_n && !tr.err;) {
        ssize_t w = write(tr.fd, tr.out + at, tr.out_n - at);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) tr.err = w < 0 ? errno : EIO;
        at += w > 0 ? (size_t)w : 0;
    }
    tr.out_n = 0;
}

/* Appends one whole event (n bytes) to the file's buffer. */
static void out_put(const char *event, size_t n) {
    pthread_mutex_lock(&out_lock);
    if (tr.out_n + n > OUT_CAP) out_drain();
    memcpy(tr.out + tr.out_n, event, n);
    tr.out_n += n;
    pthread_mutex_unlock(&out_lock);
}

/* s as the contents of a JSON string at p, within cap bytes (cut at a character); returns the
 * end. */
static char *put_json_str(char *p, size_t cap, const char *s) {
    char *end = p + cap;
    for (; *s && end - p > 6; s++) {
        unsigned char c = (unsigned char)*s;
        if (c < 0x20) {
            p += snprintf(p, (size_t)(end - p), "\\u%04x", c);
        } else {
            if (c == '"' || c == '\\') *p++ = '\\';
            *p++ = (char)c;
        }
    }
    return p;
}

/* A span's numbers are written without printf, which takes a microsecond for two "%.3f" on a
 * loaded machine: a span ends on the training's hot path, tens of times a step. */
static char *put_text(char *p, const char *s) {
    size_t n = strlen(s);
    memcpy(p, s, n);
    return p + n;
}

static char *put_u64(char *p, uint64_t v) {
    char digits[20];
    int n = 0;
    do digits[n++] = (char)('0' + v % 10);
    while (v /= 10);
    while (n) *p++ = digits[--n];
    return p;
}

/* v microseconds as "%.3f" would (values outside [0, 1e15], NaN included, as 0.000). */
static char *put_us(char *p, double v) {
    uint64_t ns = v >= 0 && v <= 1e15 ? (uint64_t)(v * 1000 + 0.5) : 0;
    p = put_u64(p, ns / 1000);
    *p++ = '.';
    unsigned f = (unsigned)(ns % 1000);
    *p++ = (char)('0' + f / 100);
    *p++ = (char)('0' + f / 10 % 10);
    *p++ = (char)('0' + f % 10);
    return p;
}

/* Formats one event (printf-style, the text ending "},\n") and appends it. */
static void out_event(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void out_event(const char *fmt, ...) {
    char event[EVENT_CAP];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(event, sizeof event, fmt, ap);
    va_end(ap);
    if (n > 0 && n < (int)sizeof event) out_put(event, (size_t)n);
}

/* Track t's name and place among the tracks (caller holds tr_lock, tracing is on). */
static void out_track(int t) {
    char name[sizeof tr.track_names[0] * 6];
    *put_json_str(name, sizeof name - 1, tr.track_names[t]) = '\0';
    out_event(
        "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":1,\"tid\":%d,\"args\":{\"name\":\"%s\"}},"
        "\n{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":1,\"tid\":%d,"
        "\"args\":{\"sort_index\":%d}},\n",
        t, name, t, t);
}

/* One complete event: at most 110 bytes and the name's (cut to fit EVENT_CAP). */
static void out_span(const char *name, int track, double t0, double t1) {
    char event[EVENT_CAP], *p = put_text(event, "{\"ph\":\"X\",\"pid\":1,\"tid\":");
    p = put_us(put_text(put_u64(p, (uint64_t)track), ",\"ts\":"), t0);
    p = put_us(put_text(p, ",\"dur\":"), t1 - t0);
    p = put_text(p, ",\"name\":\"");
    p = put_json_str(p, (size_t)(event + sizeof event - p) - 4, name ? name : "");
    p = put_text(p, "\"},\n");
    out_put(event, (size_t)(p - event));
}

/* ---- recording ------------------------------------------------------------------------ */

void tdm_trace_name_thread(const char *name) {
    int t = track();
    /* past MAX_TRACKS threads share the last track: naming it, they would write one name at
     * once (a long test making threads by the hundred did), so the track keeps its first */
    if (t == MAX_TRACKS - 1 && atomic_load(&tr.tracks) > MAX_TRACKS) return;
    pthread_mutex_lock(&tr_lock); /* named before start, start writes it; after, this does */
    snprintf(tr.track_names[t], sizeof tr.track_names[t], "%s", name ? name : "");
    if (tdm_trace_enabled()) out_track(t);
    pthread_mutex_unlock(&tr_lock);
}

void tdm_trace_span(const char *name, double t0, double t1) {
    if (!tdm_trace_enabled()) return;
    atomic_fetch_add(&tr.writers, 1);
    if (atomic_load(&tr.on)) { /* checked again: stop may have begun meanwhile */
        long long i = atomic_fetch_add_explicit(&tr.used, 1, memory_order_relaxed);
        if (i < tr.capacity) out_span(name, track(), t0, t1);
    }
    atomic_fetch_sub(&tr.writers, 1);
}

void tdm_trace_begin(const char *name) {
    if (!tdm_trace_enabled()) return;
    if (depth < MAX_DEPTH) {
        open_name[depth] = name;
        open_t0[depth] = tdm_trace_now();
    }
    depth++;
}

void tdm_trace_end(void) {
    if (!tdm_trace_enabled() || depth == 0) return;
    depth--;
    if (depth < MAX_DEPTH) tdm_trace_span(open_name[depth], open_t0[depth], tdm_trace_now());
}

/* ---- start, flush, stop ----------------------------------------------------------------- */

int tdm_trace_start(const char *path, int64_t capacity) {
    if (!path) return tdm_raise(TDM_ERR_ARG, "trace_start: NULL path");
    pthread_mutex_lock(&tr_lock);
    if (tdm_trace_enabled()) {
        pthread_mutex_unlock(&tr_lock);
        return tdm_raise(TDM_ERR_STATE, "trace_start: already tracing to %s", tr.path);
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        int e = errno;
        pthread_mutex_unlock(&tr_lock);
        return tdm_raise(TDM_ERR_IO, "trace: cannot write %s: %s", path, strerror(e));
    }
    snprintf(tr.path, sizeof tr.path, "%s", path);
    tr.fd = fd;
    tr.capacity = capacity > 0 ? capacity : 1000000;
    tr.out_n = 0;
    tr.err = 0;
    atomic_store(&tr.used, 0);
    tr.origin = clock_us();
    out_put("[\n", 2);
    out_event(
        "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":1,\"args\":{\"name\":\"tandem\"}},\n");
    int tracks = atomic_load(&tr.tracks);
    for (int t = 0; t < tracks && t < MAX_TRACKS; t++)
        if (tr.track_names[t][0]) out_track(t);
    atomic_store(&tr.on, true);
    pthread_mutex_unlock(&tr_lock);
    return TDM_OK;
}

/* The buffer written out; TDM_OK, or TDM_ERR_IO naming the file and the first failure. */
static int flush_locked(void) {
    pthread_mutex_lock(&out_lock);
    out_drain();
    int err = tr.err;
    pthread_mutex_unlock(&out_lock);
    return err ? tdm_raise(TDM_ERR_IO, "trace: cannot write %s: %s", tr.path, strerror(err))
               : TDM_OK;
}

int tdm_trace_flush(void) {
    pthread_mutex_lock(&tr_lock);
    int rc =
        tdm_trace_enabled() ? flush_locked() : tdm_raise(TDM_ERR_STATE, "trace_flush: not tracing");
    pthread_mutex_unlock(&tr_lock);
    return rc;
}

int tdm_trace_stop(void) {
    pthread_mutex_lock(&tr_lock);
    if (!tdm_trace_enabled()) {
        pthread_mutex_unlock(&tr_lock);
        return tdm_raise(TDM_ERR_STATE, "trace_stop: not tracing");
    }
    atomic_store(&tr.on, false);
    while (atomic_load(&tr.writers)) sched_yield();
    long long used = atomic_load(&tr.used);
    /* the last event marks the end, with the count of the spans past the capacity */
    out_event("{\"ph\":\"i\",\"s\":\"g\",\"name\":\"trace end\",\"pid\":1,\"tid\":0,\"ts\":%.3f,"
              "\"args\":{\"droppedSpans\":%lld}}\n]\n",
              tdm_trace_now(), used > tr.capacity ? used - tr.capacity : 0);
    int rc = flush_locked();
    if (close(tr.fd) != 0 && !rc)
        rc = tdm_raise(TDM_ERR_IO, "trace: cannot write %s: %s", tr.path, strerror(errno));
    tr.fd = -1;
    pthread_mutex_unlock(&tr_lock);
    return rc;
}
