/* The memory estimate of `tandem train` (tools/estimate.c, issue 36): --dry-run's total per
 * device against the peak a short real run reports in its --log (peak_bytes), within 15%, for
 * the MLP, the CNN, a ResNet, a GPT (with --recompute too), DataParallel over two CPU devices,
 * ZeRO stage 3 and a two-stage pipeline; a model too big for
 * this machine refused before it is built, naming the figures and what would make it fit; and
 * buffers sized by the data, not by --batch-size alone.
 *
 *   test_estimate PATH_TO_TANDEM
 *
 * Needs Debian's dataset-fashion-mnist (skipped without it). */
#include <sys/resource.h>
#include <sys/stat.h>

#include "check.h"
#include "testdir.h"

static const char *tandem_path;

/* Runs tandem with args (NULL-terminated, after "train"); its exit status. */
static int run_train(const char *const *args) {
    const char *argv[64] = {tandem_path, "train"};
    int n = 2;
    for (int i = 0; args[i] && n < 62; i++) argv[n++] = args[i];
    argv[n] = NULL;
    return wait_status(spawn_captured(argv));
}

/* The "total N UNIT" figures of --dry-run's device lines, in bytes, into total[]; their
 * count. */
static int dry_run_totals(const char *out, double *total, int cap) {
    int n = 0;
    for (const char *p = strstr(out, "total "); p && n < cap; p = strstr(p + 1, "total ")) {
        double v;
        char unit[8];
        if (sscanf(p, "total %lf %7s", &v, unit) != 2) continue;
        double scale = !strncmp(unit, "KiB", 3)   ? 1024.0
                       : !strncmp(unit, "MiB", 3) ? 1048576.0
                       : !strncmp(unit, "GiB", 3) ? 1073741824.0
                                                  : 1.0;
        total[n++] = v * scale;
    }
    return n;
}

/* The peak_bytes of the first epoch line of the log at path, into peak[]; their count. */
static int log_peaks(const char *path, double *peak, int cap) {
    char *log = slurp_file(path, NULL);
    const char *p = log ? strstr(log, "\"type\":\"epoch\"") : NULL;
    p = p ? strstr(p, "\"peak_bytes\":[") : NULL;
    int n = 0;
    for (p = p ? p + 14 : NULL; p && *p && *p != ']' && n < cap; n++) {
        char *end;
        peak[n] = strtod(p, &end);
        if (end == p) break;
        p = *end == ',' ? end + 1 : end;
    }
    free(log);
    return n;
}

/* --dry-run, then the run itself with --log: each device's estimate within 15% of its peak. */
static void check_estimate(const char *what, const char *const *args) {
    const char *argv[64];
    int n = 0;
    for (; args[n]; n++) argv[n] = args[n];
    argv[n] = "--dry-run", argv[n + 1] = NULL;
    int rc = run_train(argv);
    char *out = captured("stdout"), *err = captured("stderr");
    double est[8] = {0}, peak[8] = {0};
    int ne = dry_run_totals(out, est, 8);
    CHECK(rc == 0 && ne > 0, "%s: --dry-run exits %d with %d totals: %s%s", what, rc, ne, out, err);
    CHECK(!strstr(out, "epoch"), "%s: --dry-run trained: %s", what, out);
    free(out), free(err);
    char log[200];
    snprintf(log, sizeof log, "%s/run.jsonl", tmpdir);
    argv[n] = "--log", argv[n + 1] = log, argv[n + 2] = "--quiet", argv[n + 3] = NULL;
    rc = run_train(argv);
    int np = log_peaks(log, peak, 8);
    CHECK(rc == 0 && np == ne, "%s: the run exits %d with %d peaks for %d estimates", what, rc, np,
          ne);
    for (int d = 0; d < np && d < ne; d++) {
        double ratio = est[d] / peak[d];
        printf("%-34s device %d: estimate %8.1f MiB, peak %8.1f MiB (%+.1f%%)\n", what, d,
               est[d] / 1048576, peak[d] / 1048576, 100 * (ratio - 1));
        CHECK(ratio > 0.85 && ratio < 1.15, "%s, device %d: estimate %.0f bytes, peak %.0f", what,
              d, est[d], peak[d]);
    }
    remove(log);
}

static void test_models(const char *text) {
    check_estimate("mlp", (const char *const[]){"--model", "mlp", "--limit", "640", NULL});
    check_estimate("cnn", (const char *const[]){"--model", "cnn", "--batch-size", "128", "--limit",
                                                "384", NULL});
    check_estimate(
        "resnet18 on fashion-mnist",
        (const char *const[]){"--model", "resnet18", "--batch-size", "16", "--limit", "32", NULL});
    check_estimate("gpt", (const char *const[]){"--model", "gpt", "--data", text, "--layers", "2",
                                                "--channels", "64", "--context", "32",
                                                "--batch-size", "8", "--limit", "24", NULL});
    check_estimate("gpt --recompute",
                   (const char *const[]){"--model", "gpt", "--data", text, "--layers", "4",
                                         "--channels", "64", "--context", "32", "--batch-size", "8",
                                         "--limit", "24", "--recompute", NULL});
    check_estimate("cnn on cpu:0,cpu:1",
                   (const char *const[]){"--model", "cnn", "--devices", "cpu:0,cpu:1",
                                         "--batch-size", "256", "--limit", "512", NULL});
    check_estimate("cnn pipeline of 2 stages",
                   (const char *const[]){"--model", "cnn", "--devices", "cpu:0,cpu:1",
                                         "--model-split", "2", "--batch-size", "256", "--limit",
                                         "512", NULL});
    check_estimate("gpt --shard parameters on 2 devices",
                   (const char *const[]){"--model", "gpt", "--data", text, "--devices",
                                         "cpu:0,cpu:1", "--shard", "parameters", "--batch-size",
                                         "8", "--limit", "24", NULL});
}

/* A sanitizer's shadow memory needs terabytes of address space: no limit can be set there. */
#if defined(__SANITIZE_ADDRESS__)
#define AS_LIMIT false
#else
#define AS_LIMIT true
#endif

/* Runs tandem train with args under an 8 GiB address-space limit (the child inherits it);
 * its exit status, and its stderr into *err (the caller frees it). */
static int run_limited(const char *const *args, char **err) {
    struct rlimit old, lim;
    getrlimit(RLIMIT_AS, &old);
    lim = old;
    lim.rlim_cur = 8ull << 30;
    if (old.rlim_max != RLIM_INFINITY && old.rlim_max < lim.rlim_cur) lim.rlim_cur = old.rlim_max;
    if (AS_LIMIT) setrlimit(RLIMIT_AS, &lim);
    int rc = run_train(args);
    setrlimit(RLIMIT_AS, &old);
    *err = captured("stderr");
    return rc;
}

/* Runs that cannot fit are refused before anything is built (a build would fail on its first
 * large allocation naming no figure, or without a limit grow into the OOM killer), with the
 * figures and the options that shrink them; --log is not even created. A GPT of 94 billion
 * parameters: its weights; a ResNet-50 on 224-pixel images in batches of 60000: its
 * activations, and the batch that would fit. */
static void test_too_big(const char *text) {
    char log[200], *err = NULL;
    snprintf(log, sizeof log, "%s/big.jsonl", tmpdir);
    int rc = run_limited((const char *const[]){"--model", "gpt", "--data", text, "--layers", "48",
                                               "--channels", "12800", "--heads", "8", "--log", log,
                                               NULL},
                         &err);
    CHECK(rc == 1, "too big: exit %d, stderr %s", rc, err);
    static const char *const want[] = {"94383948800 parameters",
                                       "TiB",
                                       AS_LIMIT ? "address-space limit" : "this machine allows",
                                       "nothing was built",
                                       "--shard optimizer",
                                       "--recompute (activations",
                                       "smaller --batch-size",
                                       "more devices"};
    for (int i = 0; i < 8; i++)
        CHECK(strstr(err, want[i]) != NULL, "too big: no '%s' in: %s", want[i], err);
    struct stat st;
    CHECK(stat(log, &st) != 0, "too big: --log '%s' was created", log);
    free(err);
    rc = run_limited((const char *const[]){"--model", "resnet50", "--image-size", "224",
                                           "--batch-size", "60000", "--log", log, NULL},
                     &err);
    CHECK(rc == 1 && strstr(err, "nothing was built") && strstr(err, "--recompute (activations") &&
              strstr(err, "with --grad-accum") && strstr(err, "(the same 60000 samples a step)"),
          "batch too big: exit %d, stderr %s", rc, err);
    CHECK(stat(log, &st) != 0, "batch too big: --log '%s' was created", log);
    free(err);
}

/* --batch-size 1000000 over 600 samples: the loaders' and the trainer's buffers hold the 600
 * (and the test split's 100), not a million rows each (12.5 GB before). */
static void test_batch_beyond_data(void) {
    char log[200];
    snprintf(log, sizeof log, "%s/huge.jsonl", tmpdir);
    int rc = run_train((const char *const[]){"--model", "mlp", "--batch-size", "1000000", "--limit",
                                             "600", "--log", log, "--quiet", NULL});
    double peak[2] = {0};
    int np = log_peaks(log, peak, 2);
    CHECK(rc == 0 && np == 1, "batch beyond data: exit %d, %d peaks", rc, np);
    CHECK(peak[0] > 0 && peak[0] < 64.0 * 1048576, "batch beyond data: peak %.0f bytes", peak[0]);
    rc = run_train((const char *const[]){"--model", "mlp", "--batch-size", "1000000", "--limit",
                                         "600", "--dry-run", NULL});
    char *out = captured("stdout");
    double est[2] = {0};
    CHECK(rc == 0 && dry_run_totals(out, est, 2) == 1 && est[0] < 64.0 * 1048576,
          "batch beyond data: --dry-run exit %d: %s", rc, out);
    free(out);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_estimate PATH_TO_TANDEM\n");
        return 2;
    }
    tandem_path = argv[1];
    struct stat st;
    if (stat("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", &st) != 0) {
        printf("skipped: Debian's dataset-fashion-mnist is not installed\n");
        return 77;
    }
    if (tmpdir_make("test_estimate") != 0) return 1;
    char text[200];
    snprintf(text, sizeof text, "%s/book.txt", tmpdir);
    FILE *f = fopen(text, "w");
    for (int i = 0; f && i < 4000; i++) fprintf(f, "the cat sat on the mat %d times. ", i);
    if (f) fclose(f);
    test_models(text);
    test_too_big(text);
    test_batch_beyond_data();
    tmpdir_remove();
    return check_summary();
}
