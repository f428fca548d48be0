/* The flight recorder and `tandem doctor` (issue 39): a desync between two ranks of a threads
 * group, dumped by every rank, is named by the doctor with both sides; the doctor refuses a
 * missing directory, one without files and a malformed file by name. With mpirun (the second
 * argument): a process SIGSTOPped mid-run makes the others time out and dump, and the doctor
 * names it as the late one; a killed process is named as the one without a file; SIGUSR1 makes
 * every process dump and stop at the next step with a checkpoint (sent to one process, every
 * process stops by it and exits 128 + SIGUSR1); the epoch line and the log
 * give each process's times (the straggler rule itself on given figures: no timing here).
 *   test_doctor PATH_TO_TANDEM [MPIRUN] */
#include "check.h"
#include "straggler.h"
#include "testdir.h"

#include <signal.h>
#include <sys/stat.h>
#include <stdatomic.h>
#include <time.h>

static const char *tandem;

#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})

/* Runs `tandem doctor dir`: its exit status, stdout and stderr into *out (caller frees). */
static int doctor(const char *dir, char **out) {
    pid_t pid = spawn_captured(ARGS(tandem, "doctor", dir));
    int rc = wait_status(pid);
    char *o = captured("stdout"), *e = captured("stderr");
    size_t n = strlen(o) + strlen(e) + 2;
    *out = malloc(n);
    snprintf(*out, n, "%s\n%s", o, e);
    free(o), free(e);
    return rc;
}

static void nap(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* ---- a desync in a threads group -------------------------------------------------------- */

static char dump_dir[128];

static int desync_rank(tdm_rank_ctx *ctx, void *arg) {
    (void)arg;
    tdm_tensor *t = tdm_ones(TDM_SHAPE(16), TDM_F32, ctx->device);
    for (int i = 0; i < 3; i++) { /* three that agree */
        tdm_collective_label("warm-up %d", i);
        tdm_work_wait(tdm_all_reduce(ctx->group, t, TDM_SUM));
    }
    if (ctx->rank == 0) {
        tdm_collective_label("DDP bucket 3");
        tdm_work_wait(tdm_all_reduce(ctx->group, t, TDM_AVG));
    } else {
        tdm_collective_label("stage-3 gather of unit 5");
        tdm_work_wait(tdm_broadcast(ctx->group, t, 1));
    }
    char path[256];
    snprintf(path, sizeof path, "%s/flight-rank-%d.jsonl", dump_dir, ctx->rank);
    int rc = tdm_group_dump_flight(ctx->group, path);
    tdm_tensor_free(t);
    return rc;
}

static void test_desync(void) {
    snprintf(dump_dir, sizeof dump_dir, "%s/desync", tmpdir);
    mkdir(dump_dir, 0755);
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    CHECK(tdm_spawn(2, devs, desync_rank, NULL) == 0, "spawn: %s", tdm_last_error());
    char *out;
    int rc = doctor(dump_dir, &out);
    CHECK(rc == 0 &&
              strstr(out, "first divergence: rank 0 is in all_reduce #4 (DDP bucket 3: 16 f32, "
                          "avg, root 0) while rank 1 is in broadcast #4 (stage-3 gather of unit 5: "
                          "16 f32, sum, root 1)") &&
              strstr(out, "rank 0 (") && strstr(out, "last completed all_reduce #3 (warm-up 2") &&
              strstr(out, "failure: ") && strstr(out, "ranks disagree on the collective"),
          "doctor on a desync: exit %d:\n%s", rc, out);
    free(out);
}

/* ---- bad input ---------------------------------------------------------------------------- */

static void test_bad_input(void) {
    char *out, dir[256], path[300];
    int rc = doctor("/nonexistent/tandem-doctor", &out);
    CHECK(rc == 1 && strstr(out, "cannot open /nonexistent/tandem-doctor"), "missing: %d %s", rc,
          out);
    free(out);
    snprintf(dir, sizeof dir, "%s/empty", tmpdir);
    mkdir(dir, 0755);
    rc = doctor(dir, &out);
    CHECK(rc == 1 && strstr(out, "holds no flight-rank-R.jsonl"), "empty: %d %s", rc, out);
    free(out);
    snprintf(dir, sizeof dir, "%s/bad", tmpdir);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/flight-rank-0.jsonl", dir);
    const char bad[] = "{\"flight\":1,\"rank\":0,\"size\":2,\"backend\":\"mpi\",\"host\":\"h\","
                       "\"pid\":1,\"time\":1.0,\"launched\":1,\"timeout\":30.0,\"failure\":\"\"}\n"
                       "{\"seq\":1,\"op\":\"all_reduce\"}\n";
    file_write(path, bad, sizeof bad - 1);
    rc = doctor(dir, &out);
    CHECK(rc == 1 && strstr(out, "flight-rank-0.jsonl: line 2 is not a collective's record"),
          "malformed: %d %s", rc, out);
    free(out);
    const char rank9[] = "{\"flight\":1,\"rank\":9,\"size\":2,\"pid\":1,\"time\":1.0,"
                         "\"launched\":1,\"timeout\":30.0}\n";
    file_write(path, rank9, sizeof rank9 - 1);
    rc = doctor(dir, &out);
    CHECK(rc == 1 && strstr(out, "line 1 is not a flight recorder's rank line"), "rank 9: %d %s",
          rc, out);
    free(out);
    rc = doctor("--help", &out);
    CHECK(rc == 0 && strstr(out, "usage: tandem doctor DIR"), "--help: %d %s", rc, out);
    free(out);
}

/* Two files written at different moments (SIGUSR1 wakes each process's watcher apart): rank 1
 * wrote at its 2nd collective, rank 0 at its 4th, having completed the 3rd all-gather, which
 * rank 1 had to join. Rank 1 is not behind; with rank 0 still inside the 3rd it is. */
static void write_rank(const char *dir, int rank, int launched, const char *last_state,
                       double written) {
    char path[300], text[2048];
    snprintf(path, sizeof path, "%s/flight-rank-%d.jsonl", dir, rank);
    int n = snprintf(text, sizeof text,
                     "{\"flight\":1,\"rank\":%d,\"size\":2,\"backend\":\"mpi\",\"host\":\"h\","
                     "\"pid\":%d,\"time\":%.2f,\"launched\":%d,\"timeout\":30.0}\n",
                     rank, 10 + rank, written, launched);
    for (int s = 1; s <= launched; s++)
        n += snprintf(text + n, sizeof text - (size_t)n,
                      "{\"seq\":%d,\"op\":\"all_gather\",\"site\":\"x\",\"count\":8,"
                      "\"dtype\":\"i32\",\"reduce\":\"sum\",\"root\":0,\"launch\":%d.0,"
                      "\"end\":%d.01,\"state\":\"%s\"}\n",
                      s, s, s, s < launched ? "done" : last_state);
    file_write(path, text, (size_t)n);
}

static void test_files_apart(void) {
    char dir[256], *out;
    snprintf(dir, sizeof dir, "%s/apart", tmpdir);
    mkdir(dir, 0755);
    write_rank(dir, 0, 4, "running", 4.05);
    write_rank(dir, 1, 2, "running", 2.05);
    int rc = doctor(dir, &out);
    CHECK(rc == 0 &&
              strstr(out, "rank 1's file is older than rank 0's: rank 0 completed "
                          "collective #3") &&
              strstr(out, "no rank is behind") && !strstr(out, "late:"),
          "files apart: %d\n%s", rc, out);
    free(out);
    write_rank(dir, 0, 3, "running", 5.0); /* 2 s in #3, which rank 1 has not entered */
    rc = doctor(dir, &out);
    CHECK(rc == 0 && strstr(out, "late: rank 1 launched 2 collectives, rank 0 3") &&
              !strstr(out, "is older"),
          "rank behind: %d\n%s", rc, out);
    free(out);
}

/* ---- under mpirun -------------------------------------------------------------------------- */

/* A /proc file's bytes (their size is not known ahead), with a '\0' after them, or NULL. */
static char *read_proc(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, n = 0;
    char *s = malloc(cap + 1);
    for (size_t got; s && (got = fread(s + n, 1, cap - n, f)) > 0;) {
        n += got;
        if (n == cap) {
            char *t = realloc(s, 2 * cap + 1);
            if (!t) free(s);
            s = t, cap *= 2;
        }
    }
    fclose(f);
    if (s) s[n] = '\0';
    *len = n;
    return s;
}

/* The pid of rank `rank` of the job whose command line holds `mark`, or -1. */
static pid_t rank_pid(const char *mark, int rank) {
    DIR *d = opendir("/proc");
    struct dirent *e;
    pid_t found = -1;
    char want[48];
    snprintf(want, sizeof want, "OMPI_COMM_WORLD_RANK=%d", rank);
    while (d && found < 0 && (e = readdir(d))) {
        char path[300];
        size_t n = 0;
        snprintf(path, sizeof path, "/proc/%s/cmdline", e->d_name);
        char *cmd = read_proc(path, &n);
        bool ours = false;
        for (size_t i = 0; cmd && i < n; i += strlen(cmd + i) + 1)
            ours |= strstr(cmd + i, mark) != NULL;
        ours &= cmd && strstr(cmd, "tandem") && !strstr(cmd, "mpirun");
        free(cmd);
        if (!ours) continue;
        snprintf(path, sizeof path, "/proc/%s/environ", e->d_name);
        char *env = read_proc(path, &n);
        for (size_t i = 0; env && i < n; i += strlen(env + i) + 1)
            if (!strcmp(env + i, want)) found = atoi(e->d_name);
        free(env);
    }
    if (d) closedir(d);
    return found;
}

/* Starts a long run of 2 processes writing to dir; the pid of mpirun, once rank 1 trains. */
static pid_t start_job(const char *mpirun, const char *dir, const char *timeout) {
    mkdir(dir, 0755);
    char ckpt[300];
    snprintf(ckpt, sizeof ckpt, "%s/ckpt", dir);
    pid_t pid =
        spawn_captured(ARGS(mpirun, "--oversubscribe", "-np", "2", tandem, "train", "--model",
                            "mlp", "--epochs", "100", "--batch-size", "16", "--timeout", timeout,
                            "--debug-dir", dir, "--checkpoint-dir", ckpt, "--print-every", "1"));
    /* a step line: every process trains (and has its signal handlers, installed before) */
    for (int i = 0; i < 1200; i++) {
        char *out = captured("stdout");
        bool training = strstr(out, " step ") != NULL;
        free(out);
        if (training || waitpid(pid, NULL, WNOHANG) == pid) break;
        nap(0.05);
    }
    return pid;
}

/* Waits up to 60 s for the job to end (its exit status); then kills what is left of it. */
static int wait_job(pid_t job, const char *mark) {
    for (int i = 0; i < 1200; i++) {
        int st;
        pid_t got = waitpid(job, &st, WNOHANG);
        if (got == job) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        if (got < 0) return -1; /* reaped already: it ended before it trained */
        nap(0.05);
    }
    fprintf(stderr, "the job of %s did not end: killed\n", mark);
    for (int r = 0; r < 2; r++)
        if (rank_pid(mark, r) > 0) kill(rank_pid(mark, r), SIGKILL);
    kill(job, SIGKILL);
    return wait_status(job) < 0 ? -1 : -1;
}

static void test_stopped_rank(const char *mpirun) {
    char dir[256], *out;
    snprintf(dir, sizeof dir, "%s/stopped", tmpdir);
    pid_t job = start_job(mpirun, dir, "2");
    pid_t r1 = rank_pid(dir, 1);
    CHECK(r1 > 0, "stopped: no rank 1 found");
    if (r1 > 0) kill(r1, SIGSTOP);
    nap(4.0); /* rank 0 times out after 2 s and writes its file */
    if (r1 > 0) kill(r1, SIGCONT);
    int rc = wait_job(job, dir);
    char *err = captured("stderr");
    CHECK(rc != 0 && strstr(err, "timed out after 2.0 s waiting for rank 1") &&
              strstr(err, "rank 0: flight recorder (the run failed)"),
          "stopped: mpirun exit %d:\n%s", rc, err);
    free(err);
    rc = doctor(dir, &out);
    CHECK(rc == 0 && strstr(out, "late: rank 1, which rank 0 timed out waiting for in ") &&
              strstr(out, "on rank 0: timed out after 2.0 s waiting for rank 1"),
          "doctor, stopped rank: %d\n%s", rc, out);
    free(out);
}

static void test_killed_rank(const char *mpirun) {
    char dir[256], *out;
    snprintf(dir, sizeof dir, "%s/killed", tmpdir);
    pid_t job = start_job(mpirun, dir, "2");
    pid_t r1 = rank_pid(dir, 1);
    CHECK(r1 > 0, "killed: no rank 1 found");
    if (r1 > 0) kill(r1, SIGKILL);
    wait_job(job, dir);
    int rc = doctor(dir, &out);
    CHECK(rc == 0 && strstr(out, "flight recorders of 1 of 2 ranks") &&
              strstr(out, "rank 1: no file (the process died, or never wrote one)") &&
              strstr(out, "rank 0 ("),
          "doctor, killed rank: %d\n%s", rc, out);
    free(out);
}

static void test_sigusr1(const char *mpirun) {
    char dir[256], *out;
    snprintf(dir, sizeof dir, "%s/usr1", tmpdir);
    pid_t job = start_job(mpirun, dir, "20");
    pid_t r0 = rank_pid(dir, 0), r1 = rank_pid(dir, 1);
    CHECK(r0 > 0 && r1 > 0, "usr1: ranks %d %d", (int)r0, (int)r1);
    if (r0 > 0) kill(r0, SIGUSR1);
    if (r1 > 0) kill(r1, SIGUSR1);
    int rc = wait_job(job, dir);
    char *err = captured("stderr"), *so = captured("stdout"), ckpt[300];
    snprintf(ckpt, sizeof ckpt, "%s/ckpt", dir);
    CHECK(strstr(err, "rank 0: flight recorder (SIGUSR1)") &&
              strstr(err, "rank 1: flight recorder (SIGUSR1)") &&
              strstr(so, "stopped   by User defined signal 1") && count_ckpts(ckpt) == 1,
          "usr1: mpirun exit %d, %d checkpoints:\n%s\n%s", rc, count_ckpts(ckpt), so, err);
    free(err), free(so);
    rc = doctor(dir, &out);
    CHECK(rc == 0 && strstr(out, "flight recorders of 2 of 2 ranks") &&
              strstr(out, "no divergence") && strstr(out, "no rank is behind"),
          "doctor, SIGUSR1: %d\n%s", rc, out);
    free(out);
}

/* SIGUSR1 to rank 0 alone: rank 1 stops at the same step because rank 0 had the signal, and
 * takes that signal (not SIGTERM): every process exits 128 + SIGUSR1, and so does mpirun. */
static void test_sigusr1_one(const char *mpirun) {
    char dir[256];
    snprintf(dir, sizeof dir, "%s/usr1-one", tmpdir);
    pid_t job = start_job(mpirun, dir, "20");
    pid_t r0 = rank_pid(dir, 0);
    CHECK(r0 > 0, "usr1 to rank 0: no rank 0 found");
    if (r0 > 0) kill(r0, SIGUSR1);
    int rc = wait_job(job, dir);
    char *err = captured("stderr");
    CHECK(rc == 128 + SIGUSR1 && !strstr(err, "SIGTERM"),
          "usr1 to rank 0 alone: mpirun exit %d (expected %d):\n%s", rc, 128 + SIGUSR1, err);
    free(err);
}

/* straggler_of: the process with the most compute is named when it is 20% and 0.05 s over the
 * median's, not otherwise. */
static void test_straggler_rule(void) {
    double s2[2] = {1.0, 1.0}, w2[2] = {0.1, 0.5}; /* compute 0.9 and 0.5: median 0.7 */
    CHECK(straggler_of(s2, w2, 2) == 0, "2 ranks, 0.9 vs 0.5: %d", straggler_of(s2, w2, 2));
    double s3[3] = {1.0, 1.0, 1.0}, w3[3] = {0.5, 0.5, 0.1};
    CHECK(straggler_of(s3, w3, 3) == 2, "3 ranks, rank 2 computes 0.9: %d",
          straggler_of(s3, w3, 3));
    double e[3] = {0.4, 0.4, 0.4}, z[3] = {0, 0, 0};
    CHECK(straggler_of(e, z, 3) == -1, "equal ranks: %d", straggler_of(e, z, 3));
    double small[2] = {0.13, 0.10}; /* 30% more, but 0.03 s */
    CHECK(straggler_of(small, z, 2) == -1, "0.13 vs 0.10 s: %d", straggler_of(small, z, 2));
    double near[2] = {1.15, 1.0}; /* 0.15 s more, but 7% over the median 1.075 */
    CHECK(straggler_of(near, z, 2) == -1, "1.15 vs 1.0 s: %d", straggler_of(near, z, 2));
}

/* Two processes: the epoch line gives the range of their seconds in collectives, and --log's
 * epoch lines each process's seconds, waits and the straggler (or -1). */
static void test_rank_times(const char *mpirun) {
    char dir[256], log[300];
    snprintf(dir, sizeof dir, "%s/times", tmpdir);
    mkdir(dir, 0755);
    snprintf(log, sizeof log, "%s/log.jsonl", dir);
    pid_t job = spawn_captured(ARGS(mpirun, "--oversubscribe", "-np", "2", tandem, "train",
                                    "--model", "mlp", "--limit", "4096", "--epochs", "2", "--quiet",
                                    "--debug-dir", dir, "--log", log));
    int rc = wait_job(job, dir);
    char *out = captured("stdout"), *text = slurp_file(log, NULL);
    CHECK(rc == 0 && strstr(out, "  collectives ") && strstr(out, " s  peak "),
          "rank times: exit %d:\n%s", rc, out);
    const char *ep = text ? strstr(text, "\"type\":\"epoch\"") : NULL;
    CHECK(ep && strstr(ep, "\"rank_seconds\":[") && strstr(ep, "\"rank_wait_s\":[") &&
              strstr(ep, "\"straggler\":"),
          "rank times: the log's epoch line: %s", ep ? ep : "(none)");
    free(out), free(text);
}

int main(int argc, char **argv) {
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: test_doctor PATH_TO_TANDEM [MPIRUN]\n");
        return 2;
    }
    tandem = argv[1];
    if (tmpdir_make("doctor")) return 1;
    test_desync();
    test_bad_input();
    test_files_apart();
    test_straggler_rule();
    if (argc == 3) {
        test_stopped_rank(argv[2]);
        test_killed_rank(argv[2]);
        test_sigusr1(argv[2]);
        test_sigusr1_one(argv[2]);
        test_rank_times(argv[2]);
    }
    tmpdir_remove();
    return check_summary();
}
