/* Tracing: spans from several threads land on their named tracks, nested spans lie inside
 * their parents, spans past the capacity are dropped and counted, the file holds the spans
 * flushed while the trace goes on, and misuse gets clear errors. */
#include "check.h"
#include "tandem/trace.h"

#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    s[fread(s, 1, (size_t)n, f)] = '\0';
    fclose(f);
    return s;
}

static int count(const char *s, const char *what) {
    int n = 0;
    for (const char *p = s; (p = strstr(p, what)); p++) n++;
    return n;
}

static void *worker(void *arg) {
    char name[32];
    snprintf(name, sizeof name, "cpu:%d compute", (int)(intptr_t)arg);
    tdm_trace_name_thread(name);
    for (int i = 0; i < 10; i++) {
        tdm_trace_begin("step");
        tdm_trace_begin("forward");
        tdm_trace_end();
        tdm_trace_end();
    }
    return NULL;
}

/* The "ts" and "dur" of the first complete event named name. */
static void event_time(const char *s, const char *name, double *ts, double *dur) {
    char key[64];
    snprintf(key, sizeof key, "\"name\":\"%s\"", name);
    const char *e = strstr(s, key);
    while (e && e > s && *e != '{') e--;
    const char *t = e ? strstr(e, "\"ts\":") : NULL, *d = e ? strstr(e, "\"dur\":") : NULL;
    *ts = t ? atof(t + 5) : NAN;
    *dur = d ? atof(d + 6) : NAN;
}

static void test_threads(const char *path) {
    CHECK(tdm_trace_start(path, 0) == 0, "start: %s", tdm_last_error());
    CHECK_ERROR(tdm_trace_start(path, 0) != 0, "already tracing");
    pthread_t t[3];
    for (intptr_t i = 0; i < 3; i++) pthread_create(&t[i], NULL, worker, (void *)i);
    for (int i = 0; i < 3; i++) pthread_join(t[i], NULL);
    tdm_trace_name_thread("main");
    double t0 = tdm_trace_now();
    usleep(2000);
    tdm_trace_span("wait for data", t0, tdm_trace_now());
    tdm_trace_begin("outer");
    usleep(500);
    tdm_trace_begin("inner");
    tdm_trace_end();
    usleep(500);
    tdm_trace_end();
    CHECK(tdm_trace_stop() == 0, "stop: %s", tdm_last_error());
    char *s = slurp(path);
    CHECK(s && s[0] == '[' && strstr(s, "\n]\n"), "trace file written, the array closed");
    if (!s) return;
    CHECK(count(s, "\"ph\":\"X\"") == 63, "63 spans, found %d", count(s, "\"ph\":\"X\""));
    CHECK(strstr(s, "\"cpu:0 compute\"") && strstr(s, "\"cpu:2 compute\"") && strstr(s, "\"main\""),
          "named tracks");
    CHECK(strstr(s, "\"droppedSpans\":0"), "nothing dropped");
    double ts, dur;
    event_time(s, "wait for data", &ts, &dur);
    CHECK(dur >= 1500 && dur < 1e6, "explicit span lasts ~2 ms (%g us)", dur);
    double ots, odur, its, idur;
    event_time(s, "outer", &ots, &odur);
    event_time(s, "inner", &its, &idur);
    CHECK(its >= ots + 400 && its + idur <= ots + odur - 400,
          "inner (%g +%g) inside outer "
          "(%g +%g)",
          its, idur, ots, odur);
    free(s);
}

static void test_capacity(const char *path) {
    CHECK(tdm_trace_start(path, 5) == 0, "start: %s", tdm_last_error());
    for (int i = 0; i < 8; i++) tdm_trace_span("x", 0, 1);
    CHECK(tdm_trace_stop() == 0, "stop");
    char *s = slurp(path);
    CHECK(s && count(s, "\"ph\":\"X\"") == 5 && strstr(s, "\"droppedSpans\":3"),
          "5 kept, 3 dropped");
    free(s);
}

/* While tracing, a flush leaves in the file every span so far, each a whole line "{...},"
 * after the opening "[": what a killed process leaves, and viewers read (trace.c). */
static void test_streaming(const char *path) {
    CHECK(tdm_trace_start(path, 0) == 0, "start: %s", tdm_last_error());
    tdm_trace_name_thread("streamed");
    for (int i = 0; i < 3; i++) tdm_trace_span("early", i, i + 1);
    CHECK(tdm_trace_flush() == 0, "flush: %s", tdm_last_error());
    char *s = slurp(path);
    CHECK(s && count(s, "\"name\":\"early\"") == 3 && strstr(s, "\"streamed\""),
          "the spans and the track's name are in the file before the end: %s", s ? s : "");
    bool whole = s && strncmp(s, "[\n", 2) == 0;
    for (char *line = s ? s + 2 : NULL; whole && *line; line = strchr(line, '\n') + 1) {
        size_t n = strcspn(line, "\n");
        whole = line[0] == '{' && n > 2 && !strncmp(line + n - 2, "},", 2) && line[n] == '\n';
    }
    CHECK(whole, "each event a whole line ending in a comma: %s", s ? s : "");
    free(s);
    CHECK(tdm_trace_stop() == 0, "stop: %s", tdm_last_error());
    CHECK_ERROR(tdm_trace_flush() != 0, "not tracing");
}

static void test_errors(void) {
    CHECK_ERROR(tdm_trace_stop() != 0, "not tracing");
    CHECK(!tdm_trace_enabled(), "off by default");
    tdm_trace_begin("ignored"); /* no effect while off */
    tdm_trace_end();
    /* the file is made at the start, so that a bad path fails before the work it traces */
    CHECK_ERROR(tdm_trace_start("/nonexistent-dir/t.json", 0) != 0,
                "cannot write /nonexistent-dir/t.json: No such file or directory");
    CHECK(!tdm_trace_enabled(), "still off");
}

int main(void) {
    char path[] = "/tmp/tandem_trace_XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    test_threads(path);
    test_capacity(path);
    test_streaming(path);
    test_errors();
    unlink(path);
    return check_summary();
}
