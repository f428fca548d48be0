/* Trace recording: a preallocated array of spans filled with an atomic index, and a
 * thread-local stack of open spans; tdm_trace_stop writes the Chrome trace event format
 * ("X" complete events, "M" thread names). */
#include "tandem/trace.h"

#include "core/core.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_TRACKS 256
#define MAX_DEPTH  16

typedef struct {
    const char *name;
    int track;
    double t0, t1;
} span;

static struct {
    atomic_bool on;
    atomic_int writers; /* threads inside tdm_trace_span: stop waits for them */
    span *spans;
    int64_t capacity;
    atomic_llong used;
    atomic_int tracks;
    char track_names[MAX_TRACKS][48];
    char path[1024];
    double origin;
} tr;

static pthread_mutex_t tr_lock = PTHREAD_MUTEX_INITIALIZER;

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

void tdm_trace_name_thread(const char *name) {
    int t = track();
    /* past MAX_TRACKS threads share the last track: naming it, they would write one name at
     * once (a long test making threads by the hundred did), so the track keeps its first */
    if (t == MAX_TRACKS - 1 && atomic_load(&tr.tracks) > MAX_TRACKS) return;
    snprintf(tr.track_names[t], sizeof tr.track_names[t], "%s", name ? name : "");
}

void tdm_trace_span(const char *name, double t0, double t1) {
    if (!tdm_trace_enabled()) return;
    atomic_fetch_add(&tr.writers, 1);
    if (atomic_load(&tr.on)) { /* checked again: stop may have begun meanwhile */
        long long i = atomic_fetch_add_explicit(&tr.used, 1, memory_order_relaxed);
        if (i < tr.capacity) tr.spans[i] = (span){name, track(), t0, t1};
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

int tdm_trace_start(const char *path, int64_t capacity) {
    if (!path) return tdm_raise(TDM_ERR_ARG, "trace_start: NULL path");
    pthread_mutex_lock(&tr_lock);
    if (tdm_trace_enabled()) {
        pthread_mutex_unlock(&tr_lock);
        return tdm_raise(TDM_ERR_STATE, "trace_start: already tracing to %s", tr.path);
    }
    tr.capacity = capacity > 0 ? capacity : 1000000;
    tr.spans = malloc(sizeof(span) * (size_t)tr.capacity);
    if (!tr.spans) {
        pthread_mutex_unlock(&tr_lock);
        return tdm_raise(TDM_ERR_NOMEM, "trace_start: no memory for %lld spans",
                         (long long)tr.capacity);
    }
    snprintf(tr.path, sizeof tr.path, "%s", path);
    atomic_store(&tr.used, 0);
    tr.origin = clock_us();
    atomic_store(&tr.on, true);
    pthread_mutex_unlock(&tr_lock);
    return TDM_OK;
}

/* JSON string contents: quotes, backslashes and control characters escaped. */
static void put_str(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fputc('\\', f);
        if ((unsigned char)*s < 0x20)
            fprintf(f, "\\u%04x", *s);
        else
            fputc(*s, f);
    }
}

static int write_trace(FILE *f, int64_t n, int64_t dropped) {
    fprintf(f, "{\"displayTimeUnit\":\"ms\",\"droppedSpans\":%lld,\"traceEvents\":[\n",
            (long long)dropped);
    int tracks = atomic_load(&tr.tracks);
    for (int t = 0; t < tracks && t < MAX_TRACKS; t++) {
        fprintf(f,
                "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":1,\"tid\":%d,\"args\":{\"name\":\"",
                t);
        if (tr.track_names[t][0])
            put_str(f, tr.track_names[t]);
        else
            fprintf(f, "thread %d", t);
        fprintf(f,
                "\"}},\n{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":1,\"tid\":%d,"
                "\"args\":{\"sort_index\":%d}},\n",
                t, t);
    }
    for (int64_t i = 0; i < n; i++) {
        const span *s = &tr.spans[i];
        fprintf(f, "{\"ph\":\"X\",\"pid\":1,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,\"name\":\"",
                s->track, s->t0, s->t1 - s->t0);
        put_str(f, s->name);
        fprintf(f, "\"},\n");
    }
    fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":1,\"args\":{\"name\":\"tandem\"}}"
               "\n]}\n");
    return ferror(f) ? -1 : 0;
}

int tdm_trace_stop(void) {
    pthread_mutex_lock(&tr_lock);
    if (!tdm_trace_enabled()) {
        pthread_mutex_unlock(&tr_lock);
        return tdm_raise(TDM_ERR_STATE, "trace_stop: not tracing");
    }
    atomic_store(&tr.on, false);
    while (atomic_load(&tr.writers)) sched_yield();
    int64_t used = atomic_load(&tr.used), n = used < tr.capacity ? used : tr.capacity;
    FILE *f = fopen(tr.path, "w");
    int rc = !f || write_trace(f, n, used - n) != 0, err = rc ? errno : 0;
    if (f && fclose(f) != 0 && !rc) rc = 1, err = errno; /* the buffer's last write */
    free(tr.spans);
    tr.spans = NULL;
    pthread_mutex_unlock(&tr_lock);
    if (rc)
        return tdm_raise(TDM_ERR_IO, "trace: cannot write %s: %s", tr.path,
                         strerror(err ? err : EIO));
    return TDM_OK;
}
