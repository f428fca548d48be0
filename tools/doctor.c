/* `tandem doctor DIR`: every rank's flight recorder (flight-rank-R.jsonl, tdm_group_dump_flight)
 * merged into a diagnosis of a hang or a desync:
 *   - each rank's last completed collective and the one it is in (since when);
 *   - the first collective number whose fingerprint (op, site, size, dtype, reduction, root)
 *     differs between ranks;
 *   - the ranks that are behind: fewer collectives launched than the others, which are
 *     waiting for them (and for how long by the time of the dumps);
 *   - ranks that wrote no file (dead, or never reached).
 * The files are untrusted input: every field is checked, and a bad line is named. */
#include "doctor.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "train.h" /* EXIT_* */

#define MAX_RANKS 4096
#define RING      256 /* a file's collectives at most (TDM_FLIGHT_LEN) */
/* Seconds between two ranks' entries into one collective above which the later is named:
 * ranks in step enter within milliseconds of each other */
#define LATE_S 0.1

typedef struct {
    long long seq, count;
    char op[24], site[64], dtype[8], reduce[8], state[12];
    int root;
    double launch, end;
} entry;

typedef struct {
    bool present;
    int size;
    char backend[16], host[64], failure[512];
    long long pid, launched;
    double time, timeout;
    entry e[RING];
    int n;
} rank_file;

static int doctor_error(const char *fmt, const char *a, const char *b) {
    fprintf(stderr, "tandem doctor: error: ");
    fprintf(stderr, fmt, a, b);
    fputc('\n', stderr);
    return EXIT_RUNTIME;
}

/* Copies string member key of o into dst (cap bytes); false when missing or not a string. */
static bool get_str(json_t *o, const char *key, char *dst, size_t cap) {
    const char *s = json_string_value(json_object_get(o, key));
    if (!s) return false;
    snprintf(dst, cap, "%s", s);
    return true;
}

static bool get_num(json_t *o, const char *key, double *v) {
    json_t *j = json_object_get(o, key);
    if (!json_is_number(j)) return false;
    *v = json_number_value(j);
    return true;
}

static bool read_entry(json_t *o, entry *e) {
    double seq, count, root, launch, end;
    return get_num(o, "seq", &seq) && get_num(o, "count", &count) && get_num(o, "root", &root) &&
           get_num(o, "launch", &launch) && get_num(o, "end", &end) &&
           get_str(o, "op", e->op, sizeof e->op) && get_str(o, "site", e->site, sizeof e->site) &&
           get_str(o, "dtype", e->dtype, sizeof e->dtype) &&
           get_str(o, "reduce", e->reduce, sizeof e->reduce) &&
           get_str(o, "state", e->state, sizeof e->state) && seq >= 1 && count >= 0 &&
           (e->seq = (long long)seq, e->count = (long long)count, e->root = (int)root,
            e->launch = launch, e->end = end, true);
}

/* Reads one rank's file into the table; its rank from its first line. 0, or EXIT_RUNTIME. */
static int read_file(const char *path, rank_file *ranks, int *size) {
    FILE *f = fopen(path, "r");
    if (!f) return doctor_error("cannot read %s: %s", path, strerror(errno));
    char line[4096];
    int lineno = 0, rank = -1, rc = 0;
    rank_file *r = NULL;
    while (!rc && fgets(line, sizeof line, f)) {
        lineno++;
        json_t *o = json_loads(line, 0, NULL);
        double v;
        if (lineno == 1) {
            double sz, pid, launched, t, to;
            if (!o || !get_num(o, "rank", &v) || !get_num(o, "size", &sz) ||
                !get_num(o, "pid", &pid) || !get_num(o, "launched", &launched) ||
                !get_num(o, "time", &t) || !get_num(o, "timeout", &to) || v < 0 || sz < 1 ||
                v >= sz || sz > MAX_RANKS || (*size && (int)sz != *size)) {
                rc = doctor_error("%s: line 1 is not a flight recorder's rank line%s", path,
                                  *size ? " (or its size differs from the other files')" : "");
            } else if (ranks[(int)v].present) {
                rc = doctor_error("%s: a second file for its rank (%s)", path,
                                  "one file per rank expected");
            } else {
                rank = (int)v, *size = (int)sz, r = &ranks[rank];
                r->present = true, r->size = (int)sz, r->pid = (long long)pid;
                r->launched = (long long)launched, r->time = t, r->timeout = to;
                get_str(o, "backend", r->backend, sizeof r->backend);
                get_str(o, "host", r->host, sizeof r->host);
                get_str(o, "failure", r->failure, sizeof r->failure);
            }
        } else if (r->n < RING && o && read_entry(o, &r->e[r->n])) {
            r->n++;
        } else {
            char at[32];
            snprintf(at, sizeof at, "%d", lineno);
            rc = doctor_error("%s: line %s is not a collective's record", path, at);
        }
        json_decref(o);
    }
    fclose(f);
    if (!rc && rank < 0) rc = doctor_error("%s: empty%s", path, "");
    return rc;
}

static const entry *find(const rank_file *r, long long seq) {
    for (int i = 0; i < r->n; i++)
        if (r->e[i].seq == seq) return &r->e[i];
    return NULL;
}

static void describe(const entry *e, char *buf, size_t cap) {
    snprintf(buf, cap, "%s #%lld (%s: %lld %s, %s, root %d)", e->op, e->seq,
             e->site[0] ? e->site : "unnamed", e->count, e->dtype, e->reduce, e->root);
}

static bool same(const entry *a, const entry *b) {
    return !strcmp(a->op, b->op) && !strcmp(a->site, b->site) && a->count == b->count &&
           !strcmp(a->dtype, b->dtype) && !strcmp(a->reduce, b->reduce) && a->root == b->root;
}

/* Each rank: the last collective it completed, the one it is in, its failure. */
static void print_ranks(const rank_file *ranks, int size) {
    char d[256];
    for (int k = 0; k < size; k++) {
        const rank_file *r = &ranks[k];
        if (!r->present) {
            printf("rank %d: no file (the process died, or never wrote one)\n", k);
            continue;
        }
        printf("rank %d (%s, pid %lld): %lld collectives launched", k, r->host, r->pid,
               r->launched);
        const entry *done = NULL, *open = NULL;
        for (int i = 0; i < r->n; i++) {
            if (!strcmp(r->e[i].state, "done")) done = &r->e[i];
            if (strcmp(r->e[i].state, "done") != 0 && !open) open = &r->e[i];
        }
        if (done) describe(done, d, sizeof d), printf("; last completed %s", d);
        if (open) {
            describe(open, d, sizeof d);
            printf("; %s %s for %.1f s when written",
                   !strcmp(open->state, "failed") ? "failed in" : "in", d,
                   (open->end > 0 ? open->end : r->time) - open->launch);
        }
        printf("\n");
        if (r->failure[0]) printf("  failure: %s\n", r->failure);
    }
}

/* The first number at which two ranks' collectives differ. */
static void print_divergence(const rank_file *ranks, int size) {
    long long lo = 0, hi = -1;
    for (int k = 0; k < size; k++) {
        const rank_file *r = &ranks[k];
        if (!r->present || !r->n) continue;
        lo = r->e[0].seq > lo ? r->e[0].seq : lo;
        long long last = r->e[r->n - 1].seq;
        hi = hi < 0 || last < hi ? last : hi;
    }
    char da[256], db[256];
    for (long long s = lo; s <= hi; s++) {
        const entry *first = NULL;
        int fr = -1;
        for (int k = 0; k < size; k++) {
            const entry *e = ranks[k].present ? find(&ranks[k], s) : NULL;
            if (!e) continue;
            if (!first) {
                first = e, fr = k;
            } else if (!same(first, e)) {
                describe(first, da, sizeof da), describe(e, db, sizeof db);
                printf("first divergence: rank %d is in %s while rank %d is in %s\n", fr, da, k,
                       db);
                return;
            }
        }
    }
    if (hi >= lo) printf("no divergence: every rank's collectives #%lld to #%lld agree\n", lo, hi);
}

/* The ranks the others timed out waiting for, from their own failure messages ("timed out
 * after ... waiting for rank 1"; one forwarded from a peer, "rank 0 stopped: ...", is that
 * peer's). True when any was named. */
static bool print_waited_for(const rank_file *ranks, int size) {
    bool any = false;
    for (int k = 0; k < size; k++) {
        const char *m = ranks[k].present ? strstr(ranks[k].failure, "waiting for rank ") : NULL;
        if (!m || strstr(ranks[k].failure, " stopped: ")) continue;
        int late = atoi(m + strlen("waiting for rank "));
        const entry *open = NULL;
        for (int i = 0; i < ranks[k].n && !open; i++)
            if (strcmp(ranks[k].e[i].state, "done") != 0) open = &ranks[k].e[i];
        char d[256] = "a collective";
        if (open) describe(open, d, sizeof d);
        printf("late: rank %d, which rank %d timed out waiting for in %s\n", late, k, d);
        any = true;
    }
    return any;
}

/* The highest collective some rank completed that cannot complete before every rank entered
 * it (a broadcast's root may finish alone), and that rank in *who; 0 when none. */
static long long joined_by_all(const rank_file *ranks, int size, int *who) {
    long long best = 0;
    for (int k = 0; k < size; k++)
        for (int i = 0; ranks[k].present && i < ranks[k].n; i++) {
            const entry *e = &ranks[k].e[i];
            if (e->seq > best && !strcmp(e->state, "done") && strcmp(e->op, "broadcast") != 0)
                best = e->seq, *who = k;
        }
    return best;
}

/* The ranks behind the others: the others launched a collective they have not, and wait.
 * Each process writes its file when its own watcher wakes (SIGUSR1 reaches them apart), so a
 * rank that launched fewer is behind only if no rank has completed, with it, a collective past
 * its count: then its file is merely older. */
static void print_late(const rank_file *ranks, int size) {
    if (print_waited_for(ranks, size)) return;
    long long most = 0;
    int ahead = -1, finisher = -1;
    for (int k = 0; k < size; k++)
        if (ranks[k].present && ranks[k].launched > most) most = ranks[k].launched, ahead = k;
    long long joined = joined_by_all(ranks, size, &finisher);
    bool any = false; /* one collective apart for less than LATE_S is ranks in step */
    for (int k = 0; k < size; k++) {
        const rank_file *r = &ranks[k];
        if (!r->present || r->launched >= most) continue;
        if (r->launched < joined) {
            printf("rank %d's file is older than rank %d's: rank %d completed collective #%lld, "
                   "which rank %d had to enter\n",
                   k, finisher, finisher, joined, k);
            continue;
        }
        const entry *waited = find(&ranks[ahead], r->launched + 1);
        double for_s = waited ? ranks[ahead].time - waited->launch : -1;
        if (waited && for_s <= LATE_S && most - r->launched == 1) continue;
        printf("late: rank %d launched %lld collectives, rank %d %lld", k, r->launched, ahead,
               most);
        if (waited) {
            char d[256];
            describe(waited, d, sizeof d);
            printf("; rank %d has waited in %s for %.1f s by its dump", ahead, d, for_s);
        }
        printf("\n");
        any = true;
    }
    if (any || ahead < 0) return;
    /* every rank reached the last collective: the one that entered it last kept the others
     * waiting (a stopped or slow process; the times are each host's wall clock) */
    long long common = most; /* the last collective every rank launched */
    for (int k = 0; k < size; k++)
        if (ranks[k].present && ranks[k].launched < common) common = ranks[k].launched;
    const entry *first = NULL, *last = NULL;
    int fr = -1, lr = -1;
    for (int k = 0; k < size; k++) {
        const entry *e = ranks[k].present ? find(&ranks[k], common) : NULL;
        if (e && (!first || e->launch < first->launch)) first = e, fr = k;
        if (e && (!last || e->launch > last->launch)) last = e, lr = k;
    }
    if (first && last && last->launch - first->launch > LATE_S) {
        char d[256];
        describe(last, d, sizeof d);
        printf("late: rank %d entered %s %.1f s after rank %d, which waited for it\n", lr, d,
               last->launch - first->launch, fr);
    } else {
        printf("no rank is behind: each launched #%lld within %.2f s of the others\n", common,
               first && last ? last->launch - first->launch : 0.0);
    }
}

int doctor_main(int argc, char **argv) {
    if (argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        doctor_help(stdout);
        return EXIT_OK;
    }
    if (argc != 2) {
        fprintf(stderr, "usage: tandem doctor DIR (the --debug-dir of a run under mpirun)\n");
        return EXIT_USAGE;
    }
    DIR *dir = opendir(argv[1]);
    if (!dir) return doctor_error("cannot open %s: %s", argv[1], strerror(errno));
    /* a table for the most ranks a file may name: its pages are touched only for ranks read */
    rank_file *ranks = calloc(MAX_RANKS, sizeof *ranks);
    if (!ranks) return closedir(dir), doctor_error("out of memory%s%s", "", "");
    int size = 0, files = 0, rc = 0;
    struct dirent *de;
    while (!rc && (de = readdir(dir))) {
        size_t n = strlen(de->d_name);
        if (strncmp(de->d_name, "flight-rank-", 12) != 0 || n < 6 ||
            strcmp(de->d_name + n - 6, ".jsonl") != 0)
            continue;
        char path[8192];
        snprintf(path, sizeof path, "%s/%s", argv[1], de->d_name);
        rc = read_file(path, ranks, &size);
        files++;
    }
    closedir(dir);
    if (!rc && !files)
        rc = doctor_error("%s holds no flight-rank-R.jsonl (%s)", argv[1],
                          "written by tandem train under mpirun on failure or SIGUSR1");
    if (rc) return free(ranks), rc;
    int first = 0;
    while (!ranks[first].present) first++;
    printf("flight recorders of %d of %d ranks (%s group, timeout %.1f s)\n", files, size,
           ranks[first].backend, ranks[first].timeout);
    print_ranks(ranks, size);
    print_divergence(ranks, size);
    print_late(ranks, size);
    free(ranks);
    return EXIT_OK;
}

void doctor_help(FILE *out) {
    fprintf(out,
            "usage: tandem doctor DIR\n\n"
            "Reads every flight-rank-R.jsonl in DIR (what each process of a 'tandem train' under\n"
            "mpirun writes to its --debug-dir when its run fails or it gets SIGUSR1: its last\n"
            "256 collectives) and prints each rank's last completed collective and the one it\n"
            "is in, the first collective the ranks disagree on, the ranks that are behind and\n"
            "for how long the others waited for them, and the ranks that wrote no file.\n");
}
