/* What the `tandem` command writes, and where it refuses to (issue 36):
 *   - no output may be an input: each refused before any work with status 2, the message
 *     naming both options and the path, and the input's bytes unchanged;
 *   - --trace is opened before the first step, and streamed: a run killed with -9 leaves the
 *     events it had produced, as a trace the viewers read;
 *   - a checkpoint directory deleted or replaced under a run stops it at its next save;
 *   - what a killed save left in a checkpoint directory is removed by its next holder.
 *
 *   test_outputs PATH_TO_TANDEM
 *
 * The runs read a copy of Debian's dataset-fashion-mnist (skipped, 77, without it). */
#include <signal.h>
#include <sys/stat.h>
#include <time.h>

#include "check.h"
#include "testdir.h"

#define FMNIST "/usr/share/datasets/fashion-mnist"

static const char *tandem;
static char data[300]; /* tmpdir/data: a copy of the four files */
static const char *const idx_files[] = {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                                        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"};

#define ARGS(...) ((const char *const[]){tandem, __VA_ARGS__, NULL})

static int run(const char *const *argv) {
    return wait_status(spawn_captured(argv));
}

/* The copy of the data set byte for byte, and nothing added beside it. */
static bool data_intact(void) {
    bool ok = true;
    for (int i = 0; i < 4; i++) {
        char orig[300], copy[400];
        snprintf(orig, sizeof orig, "%s/%s", FMNIST, idx_files[i]);
        snprintf(copy, sizeof copy, "%s/%s", data, idx_files[i]);
        size_t n = 0;
        char *s = slurp_file(orig, &n);
        ok = ok && s && file_holds(copy, s, n);
        free(s);
    }
    DIR *d = opendir(data);
    int entries = 0;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) entries += e->d_name[0] != '.';
    if (d) closedir(d);
    return ok && entries == 4;
}

/* tmpdir/data made anew: after a failed case, so that the next ones start from the data. */
static bool copy_data(void) {
    char cmd[400];
    snprintf(data, sizeof data, "%s/data", tmpdir);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", data);
    if (system(cmd) != 0 || mkdir(data, 0755) != 0) return false;
    for (int i = 0; i < 4; i++) {
        char orig[300], copy[400];
        snprintf(orig, sizeof orig, "%s/%s", FMNIST, idx_files[i]);
        snprintf(copy, sizeof copy, "%s/%s", data, idx_files[i]);
        size_t n = 0;
        char *s = slurp_file(orig, &n);
        bool ok = s && file_write(copy, s, n);
        free(s);
        if (!ok) return false;
    }
    return true;
}

/* A run refused before any work: status 2, stderr holding want, the data set untouched. */
static void refused(const char *what, const char *const *argv, const char *want) {
    int rc = run(argv);
    char *err = captured("stderr"), *out = captured("stdout");
    bool intact = data_intact();
    CHECK(rc == 2 && strstr(err, want) && !strstr(out, "step ") && intact,
          "%s: exit %d, data intact %d, expected 2 and \"%s\", got: %s%s", what, rc, intact, want,
          err, out);
    free(err), free(out);
    if (!intact && !copy_data()) fprintf(stderr, "cannot copy the data again\n");
}

/* ---- no output may be an input --------------------------------------------------------- */

static void outputs_on_data(void) {
    char p[400], want[1200];
    snprintf(p, sizeof p, "%s/t10k-labels-idx1-ubyte.gz", data);
    snprintf(want, sizeof want, "--log '%s' is inside the --data directory '%s'", p, data);
    refused("--log on an IDX file of --data",
            ARGS("train", "--data", data, "--max-steps", "2", "--log", p), want);
    snprintf(want, sizeof want, "--checkpoint-dir '%s' is the --data directory '%s'", data, data);
    refused("--checkpoint-dir the data directory",
            ARGS("train", "--data", data, "--max-steps", "2", "--checkpoint-dir", data), want);
    snprintf(want, sizeof want, "--tensorboard '%s' holds the --data directory '%s'", tmpdir, data);
    refused("--tensorboard around the data",
            ARGS("train", "--data", data, "--max-steps", "2", "--tensorboard", tmpdir), want);
    /* through a symlink: the file it points to is what would be written */
    char link[300];
    snprintf(link, sizeof link, "%s/labels-link", tmpdir);
    snprintf(p, sizeof p, "%s/train-labels-idx1-ubyte.gz", data);
    CHECK(symlink(p, link) == 0, "symlink %s", link);
    snprintf(want, sizeof want, "--trace '%s' is inside the --data directory '%s'", link, data);
    refused("--trace through a symlink to the data",
            ARGS("train", "--data", data, "--max-steps", "2", "--trace", link), want);
    /* cifar10:DIR reads DIR */
    char spec[400];
    snprintf(spec, sizeof spec, "cifar10:%s", data);
    snprintf(p, sizeof p, "%s/run.jsonl", data);
    snprintf(want, sizeof want, "--log '%s' is inside the --data directory '%s'", p, data);
    refused("--log into cifar10:DIR",
            ARGS("train", "--data", spec, "--model", "resnet18", "--max-steps", "2", "--log", p),
            want);
}

/* The default --data fashion-mnist is Debian's directory, checked without writing there. */
static void default_data(void) {
    const char *p = FMNIST "/tandem-test-outputs.jsonl";
    refused("--log into the default data directory", ARGS("train", "--max-steps", "2", "--log", p),
            "--log '" FMNIST "/tandem-test-outputs.jsonl' is inside the --data directory '" FMNIST
            "'");
    CHECK(access(p, F_OK) != 0, "%s was written", p);
    unlink(p);
}

/* --model gpt: --save over the text it trains on. */
static void gpt_save_on_data(void) {
    char book[300], text[4096], want[1000];
    snprintf(book, sizeof book, "%s/book.txt", tmpdir);
    for (size_t i = 0; i < sizeof text; i++) text[i] = "the quick brown fox. "[i % 21];
    CHECK(file_write(book, text, sizeof text), "writing %s", book);
    snprintf(want, sizeof want, "--save '%s' is the --data file '%s'", book, book);
    refused("--save over the gpt's --data",
            ARGS("train", "--model", "gpt", "--data", book, "--layers", "1", "--heads", "2",
                 "--channels", "32", "--context", "16", "--max-steps", "2", "--save", book),
            want);
    CHECK(file_holds(book, text, sizeof text), "%s changed", book);
}

/* Checkpoints and the weights and logs made from them. */
static void outputs_on_checkpoints(void) {
    char dir[300], ckpt[400], w[500], state[500], want[2000];
    snprintf(dir, sizeof dir, "%s/run", tmpdir);
    int rc = run(ARGS("train", "--data", data, "--max-steps", "2", "--checkpoint-dir", dir));
    CHECK(rc == 0, "a run making a checkpoint: exit %d", rc);
    snprintf(ckpt, sizeof ckpt, "%s/ckpt-0000000002", dir);
    snprintf(w, sizeof w, "%s/model.safetensors", ckpt);
    snprintf(state, sizeof state, "%s/train_state.safetensors", ckpt);
    size_t nw = 0, ns = 0;
    char *wb = slurp_file(w, &nw), *sb = slurp_file(state, &ns);
    CHECK(wb && sb, "the checkpoint %s", ckpt);
    if (!wb || !sb) return free(wb), free(sb);

    snprintf(want, sizeof want, "--log '%s' is the --init-from file '%s'", w, w);
    refused("--log over --init-from",
            ARGS("train", "--data", data, "--max-steps", "2", "--init-from", w, "--log", w), want);
    snprintf(want, sizeof want, "--plot '%s' is inside the --resume directory '%s'", state, ckpt);
    refused("--plot into --resume's checkpoint",
            ARGS("train", "--data", data, "--max-steps", "4", "--checkpoint-dir", dir, "--resume",
                 "--plot", state),
            want);
    /* --overwrite would delete the weights it starts from */
    snprintf(want, sizeof want, "--checkpoint-dir '%s' holds the --init-from file '%s'", dir, w);
    refused("--checkpoint-dir holding --init-from",
            ARGS("train", "--data", data, "--max-steps", "2", "--init-from", w, "--checkpoint-dir",
                 dir, "--overwrite"),
            want);
    /* export onto the checkpoint's own files: tdm_checkpoint_export refuses it (test_export) */
    CHECK(file_holds(w, wb, nw) && file_holds(state, sb, ns), "the checkpoint %s changed", ckpt);
    free(wb), free(sb);
    /* what is not refused: a run's outputs beside its checkpoints, which it resumes */
    char log[400];
    snprintf(log, sizeof log, "%s/run.jsonl", dir);
    rc = run(ARGS("train", "--data", data, "--max-steps", "3", "--checkpoint-dir", dir, "--resume",
                  "--tensorboard", dir, "--log", log));
    char *err = captured("stderr");
    CHECK(rc == 0, "--tensorboard and --log in the --checkpoint-dir it resumes: exit %d, %s", rc,
          err);
    free(err);
}

/* --plot over a run it compares with, given as FILE=LABEL; two outputs in one file. */
static void outputs_on_outputs(void) {
    char other[300], spec[400], want[1000], same[400];
    snprintf(other, sizeof other, "%s/other.jsonl", tmpdir);
    const char *line = "{\"type\":\"epoch\",\"epoch\":1,\"test_acc\":0.8,\"wall_s\":3}\n";
    CHECK(file_write(other, line, strlen(line)), "writing %s", other);
    snprintf(spec, sizeof spec, "%s=theirs", other);
    snprintf(want, sizeof want, "--plot '%s' is the --plot-compare file '%s'", other, other);
    refused(
        "--plot over a --plot-compare file",
        ARGS("train", "--data", data, "--max-steps", "2", "--plot", other, "--plot-compare", spec),
        want);
    CHECK(file_holds(other, line, strlen(line)), "%s changed", other);
    snprintf(same, sizeof same, "%s/./other.jsonl", tmpdir);
    snprintf(want, sizeof want, "--log '%s' and --trace '%s' are the same file", other, same);
    refused("--log and --trace in one file",
            ARGS("train", "--data", data, "--max-steps", "2", "--log", other, "--trace", same),
            want);
}

/* ---- --trace: checked up front, streamed --------------------------------------------------- */

/* Waits (up to 60 s) until the captured stdout holds text; false when pid ended first. */
static bool wait_for_output(pid_t pid, const char *text) {
    for (int i = 0; i < 12000; i++) {
        char *out = captured("stdout");
        bool seen = strstr(out, text) != NULL;
        free(out);
        if (seen || waitpid(pid, NULL, WNOHANG) == pid) return seen;
        nanosleep(&(struct timespec){0, 5000000}, NULL);
    }
    return false;
}

static void trace_checked_first(void) {
    int rc = run(
        ARGS("train", "--data", data, "--max-steps", "2", "--trace", "/nonexistent-dir/t.json"));
    char *err = captured("stderr"), *out = captured("stdout");
    CHECK(rc == 1 && strstr(err, "--trace '/nonexistent-dir/t.json' cannot be written") &&
              !strstr(out, "step ") && !strstr(out, "stopped"),
          "--trace into a missing directory, before training: exit %d, %s%s", rc, err, out);
    free(err), free(out);
}

/* A run killed with -9 leaves the spans of its steps so far, "[" then whole events. */
static void trace_survives_kill(void) {
    char trace[300];
    snprintf(trace, sizeof trace, "%s/killed.json", tmpdir);
    pid_t pid = spawn_captured(ARGS("train", "--data", data, "--batch-size", "32", "--print-every",
                                    "1", "--trace", trace));
    bool training = wait_for_output(pid, "step 3/");
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    CHECK(training, "the run to kill trains");
    char *s = slurp_file(trace, NULL);
    int steps = 0;
    for (const char *p = s; p && (p = strstr(p, "\"name\":\"step\"")); p++) steps++;
    bool whole = s && strncmp(s, "[\n", 2) == 0;
    for (char *l = s ? s + 2 : NULL; whole && *l; l = strchr(l, '\n') + 1) {
        size_t n = strcspn(l, "\n");
        whole = l[0] == '{' && n > 2 && !strncmp(l + n - 2, "},", 2) && l[n] == '\n';
    }
    CHECK(steps >= 1 && whole && strstr(s, "\"training loop"),
          "the killed run's trace holds %d step spans, whole events: %d, %.300s", steps, whole,
          s ? s : "(no file)");
    free(s);
}

/* ---- the checkpoint directory's lock ------------------------------------------------------- */

/* Waits (up to 60 s) for path to exist; false when pid ended first. */
static bool wait_for_file(pid_t pid, const char *path) {
    for (int i = 0; i < 12000; i++) {
        if (access(path, F_OK) == 0) return true;
        if (waitpid(pid, NULL, WNOHANG) == pid) return false;
        nanosleep(&(struct timespec){0, 5000000}, NULL);
    }
    return false;
}

/* The checkpoint directory moved away (and, replaced, another made at its path) just after
 * the run's checkpoint at step 400: its save at 800 stops it, naming the directory. */
static void lock_lost(bool replaced) {
    char dir[300], moved[320], first[400], want[600];
    snprintf(dir, sizeof dir, "%s/held-%d", tmpdir, (int)replaced);
    snprintf(moved, sizeof moved, "%s.moved", dir);
    snprintf(first, sizeof first, "%s/ckpt-0000000400", dir);
    pid_t pid =
        spawn_captured(ARGS("train", "--data", data, "--batch-size", "32", "--max-steps", "1200",
                            "--checkpoint-every", "400", "--keep", "0", "--checkpoint-dir", dir));
    bool saved = wait_for_file(pid, first);
    kill(pid, SIGSTOP); /* while it trains towards step 800: no save under way */
    CHECK(saved && rename(dir, moved) == 0 && (!replaced || mkdir(dir, 0755) == 0),
          "moving %s after its checkpoint at step 400", dir);
    kill(pid, SIGCONT);
    int rc = wait_status(pid);
    char *err = captured("stderr");
    snprintf(want, sizeof want, "checkpoint directory '%s' %s since this process locked it", dir,
             replaced ? "was replaced by another directory" : "was deleted or moved");
    CHECK(rc == 1 && strstr(err, want), "%s: exit %d, expected 1 and \"%s\", got %s",
          replaced ? "replaced" : "moved", rc, want, err);
    CHECK(replaced ? count_ckpts(dir) == 0 : access(dir, F_OK) != 0,
          "the run wrote into '%s' after losing it", dir);
    free(err);
}

/* A save killed midway leaves .ckpt-<step>.tmp (and a file written atomically beside the
 * checkpoints, its .tmp-XXXXXX), and one killed while replacing a checkpoint leaves it moved
 * aside as .ckpt-<step>.old: the next run holding the directory removes the first two and puts
 * the last back (resuming from it). */
static void leftovers_removed(void) {
    char dir[300], p[400], q[500];
    snprintf(dir, sizeof dir, "%s/leftovers", tmpdir);
    int rc = run(ARGS("train", "--data", data, "--max-steps", "2", "--checkpoint-dir", dir));
    snprintf(p, sizeof p, "%s/.ckpt-0000000009.tmp", dir);
    snprintf(q, sizeof q, "%s/junk.safetensors", p);
    CHECK(rc == 0 && mkdir(p, 0755) == 0 && file_write(q, "x", 1), "making %s", p);
    char temp[400], probe[400];
    snprintf(temp, sizeof temp, "%s/model.bin.tmp-Ab12Cd", dir);
    snprintf(probe, sizeof probe, "%s/.tandem-probe-12345", dir);
    CHECK(file_write(temp, "x", 1) && file_write(probe, "", 0), "making %s", temp);
    snprintf(p, sizeof p, "%s/ckpt-0000000002", dir);
    snprintf(q, sizeof q, "%s/.ckpt-0000000002.old", dir);
    CHECK(rename(p, q) == 0, "moving %s aside", p);
    rc =
        run(ARGS("train", "--data", data, "--max-steps", "3", "--checkpoint-dir", dir, "--resume"));
    char *out = captured("stdout");
    int left = 0;
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) left += !strncmp(e->d_name, ".ckpt-", 6);
    if (d) closedir(d);
    CHECK(access(temp, F_OK) != 0 && access(probe, F_OK) != 0, "%s or %s left", temp, probe);
    CHECK(rc == 0 && left == 0 && access(p, F_OK) == 0 && strstr(out, "2 steps done"),
          "leftovers: exit %d, %d left, %s restored: %d, %s", rc, left, p, access(p, F_OK) == 0,
          out);
    free(out);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: test_outputs PATH_TO_TANDEM\n");
        return 2;
    }
    tandem = argv[1];
    char probe[300];
    snprintf(probe, sizeof probe, "%s/%s", FMNIST, idx_files[0]);
    if (access(probe, R_OK) != 0) {
        fprintf(stderr, "skipped: no Fashion-MNIST in %s\n", FMNIST);
        return 77;
    }
    if (tmpdir_make("outputs") != 0 || !copy_data()) return 1;
    outputs_on_data();
    default_data();
    gpt_save_on_data();
    outputs_on_checkpoints();
    outputs_on_outputs();
    trace_checked_first();
    trace_survives_kill();
    lock_lost(false);
    lock_lost(true);
    leftovers_removed();
    tmpdir_remove();
    return check_summary();
}
