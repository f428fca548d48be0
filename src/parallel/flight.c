/* The flight recorder's file (tdm_group_dump_flight): one JSON object a line, the rank's own
 * line first, then its last collectives oldest first, for `tandem doctor` to merge. */
#include "parallel/group.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* s as a JSON string's contents (quotes, backslashes and control bytes escaped). */
static void put_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch < 0x20)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
    fputc('"', f);
}

static const char *state_name(tdm_flight_state s) {
    return s == TDM_FLIGHT_DONE ? "done" : s == TDM_FLIGHT_FAILED ? "failed" : "running";
}

static void put_entry(FILE *f, const tdm_flight_entry *e) {
    const tdm_coll *c = &e->c;
    fprintf(f, "{\"seq\":%lld,\"op\":\"%s\",\"site\":", (long long)c->seq, tdm_coll_name(c->kind));
    put_json_string(f, c->site);
    fprintf(f,
            ",\"count\":%lld,\"dtype\":\"%s\",\"root\":%d,\"reduce\":\"%s\",\"bytes\":%lld,"
            "\"launch\":%.6f,\"end\":%.6f,\"state\":\"%s\"}\n",
            (long long)c->count, tdm_dtype_name(c->dtype), c->root,
            c->op == TDM_AVG ? "avg" : "sum", (long long)(c->count * (int64_t)c->elem), e->t_launch,
            e->t_end, state_name(e->state));
}

int tdm_group_dump_flight(tdm_group *g, const char *path) {
    if (!g || !path)
        return tdm_raise(TDM_ERR_ARG, "group_dump_flight: NULL %s", g ? "path" : "group");
    FILE *f = fopen(path, "w");
    if (!f)
        return tdm_raise(TDM_ERR_IO, "group_dump_flight: cannot write %s: %s", path,
                         strerror(errno));
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    tdm_flight_entry *ring = malloc(sizeof g->flight);
    if (!ring) {
        fclose(f);
        return tdm_raise(TDM_ERR_NOMEM, "group_dump_flight: out of memory");
    }
    pthread_mutex_lock(&g->lock); /* a copy of the ring, not written while the file is */
    memcpy(ring, g->flight, sizeof g->flight);
    int64_t launched = g->launched;
    char failure[TDM_WORK_MSG];
    memcpy(failure, g->failure, sizeof failure);
    pthread_mutex_unlock(&g->lock);
    fprintf(f, "{\"flight\":1,\"rank\":%d,\"size\":%d,\"backend\":\"%s\",\"host\":", g->rank,
            g->size, g->ops->name);
    put_json_string(f, host);
    fprintf(f, ",\"pid\":%d,\"time\":%.6f,\"launched\":%lld,\"timeout\":%.3f,\"failure\":",
            (int)getpid(), (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9, (long long)launched,
            tdm_group_timeout(g));
    put_json_string(f, failure);
    fputs("}\n", f);
    int64_t first = launched - TDM_FLIGHT_LEN + 1 > 1 ? launched - TDM_FLIGHT_LEN + 1 : 1;
    for (int64_t s = first; s <= launched; s++) {
        const tdm_flight_entry *e = &ring[s % TDM_FLIGHT_LEN];
        if (e->c.seq == s) put_entry(f, e);
    }
    free(ring);
    bool bad = ferror(f) != 0;
    if (fclose(f) != 0 || bad)
        return tdm_raise(TDM_ERR_IO, "group_dump_flight: writing %s failed", path);
    return TDM_OK;
}
