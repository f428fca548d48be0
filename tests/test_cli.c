/* The `tandem` command end to end: help, usage errors, runtime errors, and short real training
 * runs whose log, plot and accuracy are checked.
 *
 *   test_cli PATH_TO_TANDEM [PATH_TO_MLP_TUTORIAL]
 *
 * CTest passes the built binaries' paths. Runs need Debian's dataset-fashion-mnist. */
#define _GNU_SOURCE /* memmem */
#include <stdarg.h>
#include <sys/stat.h>

#include "check.h"
#include "testdir.h"

static const char *tandem_path;
typedef struct {
    int status; /* exit status, or -1 if the process did not exit normally (a crash) */
    char *out, *err;
} result;

/* A file's contents, "" when it cannot be read. */
static char *slurp(const char *path) {
    char *s = slurp_file(path, NULL);
    return s ? s : calloc(1, 1);
}

/* Runs argv (NULL-terminated) with stdout and stderr captured. */
static result run(const char *const *argv) {
    result r = {wait_status(spawn_captured(argv)), NULL, NULL};
    r.out = captured("stdout");
    r.err = captured("stderr");
    return r;
}

static void result_free(result *r) {
    free(r->out);
    free(r->err);
}

/* tandem ARGS... */
#define TANDEM(...) run((const char *const[]){tandem_path, __VA_ARGS__, NULL})

/* The number after "key": in a JSON line, NAN for null or a missing key. */
static double json_num(const char *line, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(line, pat);
    if (!p) return NAN;
    p += strlen(pat);
    char *end;
    double v = strtod(p, &end);
    return end == p ? NAN : v;
}

/* A line looks like one JSON object: braces at both ends, balanced quotes, no NaN text. */
static bool json_line_ok(const char *line, size_t n) {
    if (n < 2 || line[0] != '{' || line[n - 1] != '}') return false;
    int quotes = 0;
    for (size_t i = 0; i < n; i++) quotes += line[i] == '"' && (i == 0 || line[i - 1] != '\\');
    static const char *const bad[] = {":nan", ":-nan", ":inf", ":-inf", ":NaN"};
    for (int i = 0; i < 5; i++)
        if (memmem(line, n, bad[i], strlen(bad[i]))) return false;
    return quotes % 2 == 0;
}

static void test_help(void) {
    result r = run((const char *const[]){tandem_path, "--help", NULL});
    CHECK(r.status == 0, "tandem --help exit %d", r.status);
    CHECK(strstr(r.out, "train") && strstr(r.out, "devices"), "top-level help: %s", r.out);
    result_free(&r);

    r = TANDEM("train", "--help");
    CHECK(r.status == 0, "tandem train --help exit %d: %s", r.status, r.err);
    static const char *const options[] = {
        "--data",        "--model",    "--epochs",       "--batch-size", "--optimizer",
        "--lr",          "--momentum", "--weight-decay", "--schedule",   "--warmup-steps",
        "--seed",        "--workers",  "--devices",      "--limit",      "--log",
        "--plot",        "--quiet",    "SYNOPSIS",       "EXAMPLES",     "Default: 64",
        "fashion-mnist", "cosine"};
    for (size_t i = 0; i < sizeof options / sizeof options[0]; i++)
        CHECK(strstr(r.out, options[i]) != NULL, "train --help does not mention %s", options[i]);
    result_free(&r);

    r = TANDEM("devices");
    CHECK(r.status == 0 && strstr(r.out, "cpu:0"), "devices exit %d: %s", r.status, r.out);
    /* the GEMM library each CPU device runs, named as tdm_gemm_describe names it */
    char gemm[128];
    tdm_gemm_describe(gemm, sizeof gemm);
    CHECK(strstr(r.out, gemm) != NULL, "devices should name the GEMM '%s': %s", gemm, r.out);
    result_free(&r);
}

/* A usage error: exit 2, one line on stderr containing `want`. */
static void expect_usage(const char *want, const char *const *argv) {
    result r = run(argv);
    CHECK(r.status == 2, "%s: exit %d, expected 2 (stderr: %s)", want, r.status, r.err);
    CHECK(strstr(r.err, want) != NULL, "stderr should name \"%s\": %s", want, r.err);
    char *nl = strchr(r.err, '\n');
    CHECK(nl && nl[1] == '\0', "usage error should be one line: %s", r.err);
    result_free(&r);
}

static void test_usage_errors(void) {
    const char *t = tandem_path;
    expect_usage("--bogus", (const char *const[]){t, "train", "--bogus", NULL});
    expect_usage("--bogus", (const char *const[]){t, "train", "--bogus=3", NULL});
    expect_usage("--epochs", (const char *const[]){t, "train", "--epochs", NULL});
    expect_usage("'abc'", (const char *const[]){t, "train", "--epochs", "abc", NULL});
    expect_usage("--epochs", (const char *const[]){t, "train", "--epochs", "0", NULL});
    expect_usage("--lr", (const char *const[]){t, "train", "--lr", "-1", NULL});
    expect_usage("--denormals", (const char *const[]){t, "train", "--denormals", "fast", NULL});
    expect_usage("--device-memory: '2X' is not a size",
                 (const char *const[]){t, "train", "--device-memory", "2X", NULL});
    expect_usage("--device-memory: '0.5' is not a size",
                 (const char *const[]){t, "train", "--device-memory", "0.5", NULL});
    expect_usage("--batch-size", (const char *const[]){t, "train", "--batch-size", "1e", NULL});
    expect_usage("resnet", (const char *const[]){t, "train", "--model", "resnet", NULL});
    expect_usage("rmsprop", (const char *const[]){t, "train", "--optimizer", "rmsprop", NULL});
    expect_usage("--momentum", (const char *const[]){t, "train", "--optimizer", "adam",
                                                     "--momentum", "0.5", NULL});
    expect_usage("--log", (const char *const[]){t, "train", "--log", "--quiet", NULL});
    expect_usage("cpu:0", (const char *const[]){t, "train", "--devices", "cpu:0,cpu:0", NULL});
    expect_usage("smaller than the 3 devices",
                 (const char *const[]){t, "train", "--devices", "3", "--batch-size", "2", NULL});
    expect_usage("gpu:0", (const char *const[]){t, "train", "--devices", "gpu:0", NULL});
    expect_usage("exclude each other", (const char *const[]){t, "train", "--batch-size", "64",
                                                             "--batch-per-device", "32", NULL});
    expect_usage("multiple of 2 devices",
                 (const char *const[]){t, "train", "--model-split", "2", "--devices", "3", NULL});
    expect_usage("'zigzag'", (const char *const[]){t, "train", "--model-split", "2", "--devices",
                                                   "2", "--pipeline", "zigzag", NULL});
    expect_usage("too small for 8 micro-batches",
                 (const char *const[]){t, "train", "--model-split", "2", "--devices", "2",
                                       "--micro-batches", "8", "--batch-size", "4", NULL});
    expect_usage("--shard: unknown kind 'all'",
                 (const char *const[]){t, "train", "--shard", "all", NULL});
    expect_usage("--shard gradients with --model-split: a pipeline's replicas share their "
                 "stages' optimizer state (--shard optimizer, ZeRO stage 1)",
                 (const char *const[]){t, "train", "--shard", "gradients", "--model-split", "2",
                                       "--devices", "2", NULL});
    expect_usage("--check-replicas compares data-parallel replicas",
                 (const char *const[]){t, "train", "--check-replicas", "5", "--model-split", "2",
                                       "--devices", "2", NULL});
    expect_usage("no such units",
                 (const char *const[]){t, "train", "--model", "cnn", "--recompute", NULL});
    expect_usage("stray", (const char *const[]){t, "train", "stray", NULL});
    expect_usage("frobnicate", (const char *const[]){t, "frobnicate", NULL});
}

static void test_runtime_errors(void) {
    char missing[300];
    snprintf(missing, sizeof missing, "%s/no-such-dir", tmpdir);
    result r = TANDEM("train", "--data", missing, "--limit", "100");
    CHECK(r.status == 1, "missing data dir: exit %d (stderr %s)", r.status, r.err);
    CHECK(strstr(r.err, missing) != NULL, "error should name %s: %s", missing, r.err);
    result_free(&r);

    /* a directory that exists but holds no IDX files */
    r = TANDEM("train", "--data", tmpdir, "--limit", "100");
    CHECK(r.status == 1, "empty data dir: exit %d (stderr %s)", r.status, r.err);
    CHECK(strstr(r.err, tmpdir) != NULL, "error should name %s: %s", tmpdir, r.err);
    result_free(&r);

    /* a device capped below what the MLP and its batches take, then above */
    r = TANDEM("train", "--limit", "256", "--epochs", "1", "--device-memory", "2M");
    CHECK(r.status == 1 && strstr(r.err, "cpu:0 is out of memory: tried to allocate") &&
              strstr(r.err, "of its 2.00 MiB limit") && strstr(r.err, "--device-memory"),
          "capped at 2M: exit %d, %s", r.status, r.err);
    result_free(&r);
    r = TANDEM("train", "--limit", "256", "--epochs", "1", "--quiet", "--device-memory", "64M");
    CHECK(r.status == 0, "capped at 64M: exit %d, %s", r.status, r.err);
    result_free(&r);

    /* an unwritable log */
    r = TANDEM("train", "--limit", "100", "--log", "/nonexistent-dir/x.jsonl");
    CHECK(r.status == 1 && strstr(r.err, "/nonexistent-dir/x.jsonl"), "bad log: exit %d %s",
          r.status, r.err);
    result_free(&r);

    /* a full disk (/dev/full: every write fails with ENOSPC): the log's failure names the
     * file and the errno at the first epoch, not after the run; the trace's at its end */
    if (access("/dev/full", W_OK) == 0) {
        r = TANDEM("train", "--limit", "256", "--epochs", "3", "--log", "/dev/full");
        CHECK(r.status == 1 && strstr(r.err, "'/dev/full'") &&
                  strstr(r.err, "No space left on device") && !strstr(r.out, "epoch 2/"),
              "--log on a full disk: exit %d %s", r.status, r.err);
        result_free(&r);
        r = TANDEM("train", "--limit", "256", "--epochs", "1", "--trace", "/dev/full");
        CHECK(r.status == 1 && strstr(r.err, "/dev/full: No space left on device"),
              "--trace on a full disk: exit %d %s", r.status, r.err);
        result_free(&r);
    }

    /* a checkpoint directory that is a file: refused before any training */
    char file[300];
    snprintf(file, sizeof file, "%s/a-file", tmpdir);
    FILE *f = fopen(file, "w");
    if (f) fclose(f);
    r = TANDEM("train", "--limit", "100", "--checkpoint-dir", file);
    CHECK(r.status == 1 && strstr(r.err, file) && !strstr(r.out, "epoch "),
          "checkpoint dir that is a file: exit %d %s %s", r.status, r.err, r.out);
    result_free(&r);

    /* a learning rate that makes the loss overflow: stopped with the epoch and step named */
    r = TANDEM("train", "--limit", "640", "--lr", "1e6", "--quiet");
    CHECK(r.status == 1, "diverging run: exit %d (stdout %s, stderr %s)", r.status, r.out, r.err);
    CHECK(strstr(r.err, "epoch 1, step") != NULL, "divergence error: %s", r.err);
    result_free(&r);
}

/* The "peak_bytes":[...] array of an epoch line: how many entries, each > 0 (else -1). */
static int peak_entries(const char *line) {
    const char *p = strstr(line, "\"peak_bytes\":[");
    if (!p) return -1;
    int n = 0;
    for (p += strlen("\"peak_bytes\":["); *p != ']'; p += *p == ',', n++) {
        char *end;
        if (strtoll(p, &end, 10) <= 0 || end == p) return -1;
        p = end;
    }
    return n;
}

static void check_log(const char *path, int epochs, int steps_per_epoch) {
    char *log = slurp(path);
    int steps = 0, n_epochs = 0, bad = 0;
    double first_loss = NAN, last_loss = NAN, last_acc = NAN;
    for (char *line = log, *nl; *line; line = nl + 1) {
        nl = strchr(line, '\n');
        CHECK(nl != NULL, "log ends without a newline");
        if (!nl) break;
        size_t n = (size_t)(nl - line);
        *nl = '\0';
        if (!json_line_ok(line, n)) {
            if (bad++ < 3) CHECK(false, "log line is not a JSON object: %s", line);
            continue;
        }
        if (strstr(line, "\"type\":\"step\"")) {
            steps++;
            CHECK(json_num(line, "epoch") >= 1 && json_num(line, "step") >= 1 &&
                      isfinite(json_num(line, "loss")) && json_num(line, "lr") > 0 &&
                      json_num(line, "img_s") > 0,
                  "step line: %s", line);
        } else if (strstr(line, "\"type\":\"epoch\"")) {
            n_epochs++;
            static const char *const keys[] = {"epoch",        "train_loss", "train_acc",
                                               "test_loss",    "test_acc",   "seconds",
                                               "loader_wait_s"};
            for (int k = 0; k < 7; k++)
                CHECK(isfinite(json_num(line, keys[k])), "epoch line lacks %s: %s", keys[k], line);
            CHECK(peak_entries(line) == 1, "epoch line's peak_bytes, one device: %s", line);
            if (n_epochs == 1) first_loss = json_num(line, "train_loss");
            last_loss = json_num(line, "train_loss");
            last_acc = json_num(line, "test_acc");
        } else {
            CHECK(strstr(line, "\"type\":\"config\"") != NULL, "unknown line: %s", line);
        }
    }
    CHECK(steps == epochs * steps_per_epoch, "%d step lines, expected %d", steps,
          epochs * steps_per_epoch);
    CHECK(n_epochs == epochs, "%d epoch lines, expected %d", n_epochs, epochs);
    CHECK(last_loss < first_loss, "train loss did not fall: %g -> %g", first_loss, last_loss);
    CHECK(last_acc > 0.6, "test accuracy %g after %d epochs", last_acc, epochs);
    free(log);
}

static void check_svg(const char *path) {
    char *svg = slurp(path);
    size_t n = strlen(svg);
    CHECK(strncmp(svg, "<svg", 4) == 0, "svg starts with %.20s", svg);
    CHECK(n > 8 && strstr(svg + n - 8, "</svg>"), "svg does not end with </svg>");
    CHECK(strstr(svg, "class=\"train\"") && strstr(svg, "class=\"test\"") &&
              strstr(svg, "class=\"train-step\""),
          "svg lacks the train, test or per-step curves");
    CHECK(strstr(svg, "Loss") && strstr(svg, "Accuracy") && strstr(svg, "epoch"),
          "svg lacks panel titles or axis labels");
    /* every element opened is closed: count "<" of open tags against "/>" and "</" */
    int opens = 0, closes = 0;
    for (const char *p = svg; *p; p++) {
        if (p[0] == '<' && p[1] != '/') opens++;
        if ((p[0] == '/' && p[1] == '>') || (p[0] == '<' && p[1] == '/')) closes++;
    }
    CHECK(opens == closes, "svg: %d elements opened, %d closed", opens, closes);
    free(svg);
}

static void test_mlp_run(void) {
    char log[300], plot[300];
    snprintf(log, sizeof log, "%s/run.jsonl", tmpdir);
    snprintf(plot, sizeof plot, "%s/run.svg", tmpdir);
    result r = TANDEM("train", "--limit", "2000", "--epochs", "2", "--model", "mlp", "--log", log,
                      "--plot", plot);
    CHECK(r.status == 0, "mlp run: exit %d, stderr: %s", r.status, r.err);
    CHECK(strstr(r.out, "epoch 2/2") && strstr(r.out, "test loss") && strstr(r.out, "img/s") &&
              strstr(r.out, "loader wait") && strstr(r.out, " MiB\n"),
          "mlp run output: %s", r.out);
    result_free(&r);
    check_log(log, 2, 32); /* ceil(2000 / 64) steps */
    check_svg(plot);
}

static void test_cnn_run(void) {
    result r = TANDEM("train", "--limit", "500", "--epochs", "1", "--model", "cnn", "--optimizer",
                      "adam", "--workers", "0", "--quiet");
    CHECK(r.status == 0, "cnn run: exit %d, stderr: %s", r.status, r.err);
    CHECK(strstr(r.out, "epoch 1/1") && !strstr(r.out, "step "), "cnn --quiet output: %s", r.out);
    result_free(&r);
}

/* The train loss printed after an epoch, or NAN. */
static double epoch_train_loss(const char *out) {
    const char *p = strstr(out, "train loss ");
    return p ? strtod(p + strlen("train loss "), NULL) : NAN;
}

/* Data parallelism over 3 CPU devices (the batch of 64 splits 22/21/21) learns what one
 * device learns: the same printed train loss, and per-device throughput is reported. */
static void test_devices_run(void) {
    result one = TANDEM("train", "--limit", "1000", "--model", "mlp", "--quiet");
    char trace[300], log[300];
    snprintf(trace, sizeof trace, "%s/trace.json", tmpdir);
    snprintf(log, sizeof log, "%s/three.jsonl", tmpdir);
    /* the replicas compared every step (--check-replicas): equal, the run unchanged */
    result three =
        TANDEM("train", "--limit", "1000", "--model", "mlp", "--quiet", "--devices",
               "cpu:0,cpu:1,cpu:2", "--trace", trace, "--log", log, "--check-replicas", "1");
    CHECK(one.status == 0 && three.status == 0, "device runs: exit %d and %d: %s", one.status,
          three.status, three.err);
    double l1 = epoch_train_loss(one.out), l3 = epoch_train_loss(three.out);
    CHECK(fabs(l1 - l3) <= 2e-4, "train loss on 1 device %.4f, on 3 devices %.4f", l1, l3);
    CHECK(strstr(three.out, "per device"), "3-device output: %s", three.out);
    /* each replica's memory is its own device's pool: a peak for each, printed and logged */
    char *text = slurp(log), *epoch = strstr(text, "\"type\":\"epoch\"");
    CHECK(epoch && peak_entries(epoch) == 3 && strstr(three.out, "peak ") &&
              strstr(three.out, " / ") && strstr(three.out, " MiB"),
          "3 devices' peaks: %s\n%s", epoch ? epoch : text, three.out);
    free(text);
    /* 32 per device on 2 devices is the default global batch of 64 */
    result per = TANDEM("train", "--limit", "1000", "--model", "mlp", "--quiet", "--devices", "2",
                        "--batch-per-device", "32");
    double lp = epoch_train_loss(per.out);
    CHECK(per.status == 0 && fabs(l1 - lp) <= 2e-4,
          "--batch-per-device 32 on 2 devices: %.4f vs %.4f", lp, l1);
    result_free(&per);
    /* the header's note when a device's share of a step is small: the MLP's 32 rows per
     * device, not its 256 (an 8x larger share), nor one device, nor --quiet */
    result small = TANDEM("train", "--limit", "640", "--model", "mlp", "--devices", "2");
    result big = TANDEM("train", "--limit", "640", "--model", "mlp", "--devices", "2",
                        "--batch-size", "512");
    result single = TANDEM("train", "--limit", "640", "--model", "mlp");
    CHECK(small.status == 0 && strstr(small.out, "\nnote      ") &&
              strstr(small.out, "MFLOP of matrix products per device per step") &&
              strstr(small.out, "expect well under 2x one device's speed"),
          "2 devices x 32 rows: no note: %s", small.out);
    /* the loader's workers: 2 by default, 0 where the devices take every core (Fashion-MNIST's
     * batches only copy bytes in memory), what --workers says whatever the devices */
    bool all_cores = tdm_device_count(TDM_CPU) == 2;
    CHECK(strstr(single.out, ", 2 loader workers\n") &&
              strstr(small.out, all_cores ? ", 0 loader workers (every core runs a device"
                                          : ", 2 loader workers\n"),
          "default workers (%d cores): %s\n%s", tdm_device_count(TDM_CPU), single.out, small.out);
    result one_worker =
        TANDEM("train", "--limit", "640", "--model", "mlp", "--devices", "2", "--workers", "1");
    CHECK(one_worker.status == 0 && strstr(one_worker.out, ", 1 loader workers\n"),
          "--workers 1: %s", one_worker.out);
    result_free(&one_worker);
    CHECK(big.status == 0 && !strstr(big.out, "\nnote ") && single.status == 0 &&
              !strstr(single.out, "\nnote ") && !strstr(three.out, "note "),
          "a note where none is due: %s\n%s", big.out, single.out);
    result_free(&small), result_free(&big), result_free(&single);
    /* the trace: a track per device and per communication thread, each step's spans (CPU
     * devices reduce and step a shard each after backward: see sharded_update in dp.c) */
    char *tr = slurp(trace);
    CHECK(tr && tr[0] == '[' && strstr(tr, "\"cpu:2 compute\"") &&
              strstr(tr, "\"name\":\"reduce shard\"") && strstr(tr, "\"name\":\"backward") &&
              strstr(tr, "\"name\":\"wait for data\"") && strstr(tr, "\"name\":\"optimizer\""),
          "trace %s lacks tracks or spans", trace);
    free(tr);
    result_free(&one);
    result_free(&three);
}

/* --model-split: the MLP cut into 2 pipeline stages (and 2 x 2 with replicas) learns what
 * one device learns; the same loss to float rounding (gradients summed per micro-batch). */
static void test_model_split(void) {
    result one = TANDEM("train", "--limit", "1000", "--model", "mlp", "--quiet");
    result two = TANDEM("train", "--limit", "1000", "--model", "mlp", "--quiet", "--devices", "2",
                        "--model-split", "2", "--pipeline", "gpipe", "--micro-batches", "3");
    result four = TANDEM("train", "--limit", "1000", "--model", "mlp", "--quiet", "--devices", "4",
                         "--model-split", "2");
    double l1 = epoch_train_loss(one.out), l2 = epoch_train_loss(two.out),
           l4 = epoch_train_loss(four.out);
    CHECK(two.status == 0 && fabs(l1 - l2) <= 2e-4,
          "train loss on 1 device %.4f, in 2 stages %.4f (exit %d: %s)", l1, l2, two.status,
          two.err);
    CHECK(four.status == 0 && fabs(l1 - l4) <= 2e-4,
          "train loss on 1 device %.4f, 2 stages x 2 replicas %.4f (exit %d: %s)", l1, l4,
          four.status, four.err);
    result_free(&one);
    result_free(&two);
    result_free(&four);
}

static void test_schedules(void) {
    char log[300];
    snprintf(log, sizeof log, "%s/cos.jsonl", tmpdir);
    result r = TANDEM("train", "--limit", "640", "--epochs", "2", "--schedule", "cosine",
                      "--warmup-steps", "5", "--optimizer", "adamw", "--log", log, "--quiet");
    CHECK(r.status == 0, "cosine run: exit %d, stderr: %s", r.status, r.err);
    result_free(&r);
    /* 10 steps per epoch: lr rises over 5 warmup steps, then decays towards 0 at step 20 */
    char *text = slurp(log);
    double lr[21] = {0};
    int k = 0;
    for (char *p = strstr(text, "\"type\":\"step\""); p && k < 21;
         p = strstr(p + 1, "\"type\":\"step\""))
        lr[k++] = json_num(p, "lr");
    CHECK(k == 20, "%d step lines, expected 20", k);
    CHECK_CLOSE(lr[0], 1e-3 / 5, 1e-9, 1e-4);
    CHECK_CLOSE(lr[4], 1e-3, 1e-9, 1e-4);
    CHECK(lr[10] < lr[5] && lr[19] < lr[10] && lr[19] > 0, "cosine lr %g %g %g", lr[5], lr[10],
          lr[19]);
    free(text);
}

/* The values of `key` in the step lines of a --log, at most max; returns how many. */
static int log_steps(const char *log, const char *key, double *v, int max) {
    char *text = slurp(log);
    int k = 0;
    for (char *p = strstr(text, "\"type\":\"step\""); p && k < max;
         p = strstr(p + 1, "\"type\":\"step\""))
        v[k++] = json_num(p, key);
    free(text);
    return k;
}

/* A --limit 640 mlp run of 2 epochs (20 steps of 64) logged to tmpdir/<name>.jsonl, with
 * extra options; its step losses into loss[20] when not NULL. Returns the exit status. */
static int logged_run(const char *name, const char *const *extra, double *loss) {
    char log[300];
    snprintf(log, sizeof log, "%s/%s.jsonl", tmpdir, name);
    const char *argv[24] = {tandem_path, "train",   "--limit", "640", "--epochs",
                            "2",         "--quiet", "--log",   log};
    int n = 9;
    for (int i = 0; extra[i] && n < 23; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    result r = run(argv);
    CHECK(r.status == 0, "%s run: exit %d, stderr: %s", name, r.status, r.err);
    int status = r.status;
    result_free(&r);
    if (loss) CHECK(log_steps(log, "loss", loss, 20) == 20, "%s: 20 step lines", name);
    return status;
}

/* --schedule onecycle and linear: the logged lr of every step is tdm_sched_lr's (the log
 * keeps 7 digits), and the config line records --pct-start. */
static void test_new_schedules(void) {
    const char *oc[] = {"--schedule", "onecycle", "--pct-start", "0.25", NULL};
    const char *li[] = {"--schedule", "linear", "--warmup-steps", "4", NULL};
    tdm_sched s_oc = {.kind = TDM_SCHED_ONECYCLE, .base_lr = 0.1f, .total = 20, .pct_start = 0.25f};
    tdm_sched s_li = {.kind = TDM_SCHED_LINEAR,
                      .base_lr = 0.1f,
                      .warmup = 4,
                      .total = 20,
                      .start_factor = 1,
                      .end_factor = 0};
    const struct {
        const char *name, *const *extra;
        const tdm_sched *s;
    } cases[] = {{"onecycle", oc, &s_oc}, {"linear", li, &s_li}};
    for (int c = 0; c < 2; c++) {
        if (logged_run(cases[c].name, cases[c].extra, NULL)) continue;
        char log[300];
        snprintf(log, sizeof log, "%s/%s.jsonl", tmpdir, cases[c].name);
        double lr[21];
        int k = log_steps(log, "lr", lr, 21), bad = 0;
        CHECK(k == 20, "%s: %d step lines, expected 20", cases[c].name, k);
        for (int t = 0; t < k; t++) {
            double want = tdm_sched_lr(cases[c].s, t);
            if (!(fabs(lr[t] - want) <= 1e-12 + 1e-6 * want)) {
                if (bad++ < 3)
                    fprintf(stderr, "FAIL %s step %d: lr %.9g, tdm_sched_lr %.9g\n", cases[c].name,
                            t, lr[t], want);
            }
        }
        CHECK(bad == 0, "%s: %d step lrs differ from tdm_sched_lr", cases[c].name, bad);
    }
    char log[300];
    snprintf(log, sizeof log, "%s/onecycle.jsonl", tmpdir);
    char *text = slurp(log);
    CHECK(strstr(text, "\"schedule\":\"onecycle\"") && strstr(text, "\"pct_start\":0.25"),
          "onecycle config line: %.300s", text);
    free(text);
    const char *t = tandem_path;
    expect_usage("--pct-start applies to --schedule onecycle only",
                 (const char *const[]){t, "train", "--pct-start", "0.5", NULL});
    expect_usage(
        "onecycle rises over --pct-start",
        (const char *const[]){t, "train", "--schedule", "onecycle", "--warmup-steps", "3", NULL});
}

/* --label-smoothing, --nesterov and --no-decay-1d each change the run (same seed, same
 * data), are recorded in the config line, and are refused where they do not apply. */
static void test_training_extras(void) {
    double base[20], ls[20], nest[20], wd[20], wd1[20];
    int rc = logged_run("plain", (const char *[]){"--seed", "1", NULL}, base);
    rc |=
        logged_run("smooth", (const char *[]){"--seed", "1", "--label-smoothing", "0.1", NULL}, ls);
    rc |= logged_run("nesterov", (const char *[]){"--seed", "1", "--nesterov", NULL}, nest);
    rc |= logged_run("wd", (const char *[]){"--seed", "1", "--weight-decay", "0.05", NULL}, wd);
    rc |= logged_run(
        "wd1", (const char *[]){"--seed", "1", "--weight-decay", "0.05", "--no-decay-1d", NULL},
        wd1);
    if (rc) return;
    /* smoothing changes the loss from the first step; the others from the second update on */
    CHECK(ls[0] != base[0], "label smoothing: first loss %g unchanged", ls[0]);
    CHECK(nest[2] != base[2] && nest[0] == base[0], "nesterov: losses %g %g vs %g %g", nest[0],
          nest[2], base[0], base[2]);
    CHECK(wd1[19] != wd[19] && wd1[0] == wd[0], "no-decay-1d: last loss %g vs %g", wd1[19], wd[19]);
    char log[300];
    snprintf(log, sizeof log, "%s/smooth.jsonl", tmpdir);
    char *text = slurp(log);
    CHECK(strstr(text, "\"label_smoothing\":0.1,") != NULL, "config: %.300s", text);
    free(text);
    snprintf(log, sizeof log, "%s/wd1.jsonl", tmpdir);
    text = slurp(log);
    CHECK(strstr(text, "\"no_decay_1d\":true") != NULL, "config: %.300s", text);
    free(text);
    snprintf(log, sizeof log, "%s/nesterov.jsonl", tmpdir);
    text = slurp(log);
    CHECK(strstr(text, "\"nesterov\":true") != NULL, "config: %.300s", text);
    free(text);
    const char *t = tandem_path;
    expect_usage("has no label smoothing",
                 (const char *const[]){t, "train", "--model", "gpt", "--data", "x.txt",
                                       "--label-smoothing", "0.1", NULL});
    expect_usage("--nesterov needs --optimizer sgd with --momentum > 0",
                 (const char *const[]){t, "train", "--optimizer", "adam", "--nesterov", NULL});
    expect_usage("--nesterov needs --optimizer sgd with --momentum > 0",
                 (const char *const[]){t, "train", "--momentum", "0", "--nesterov", NULL});
    expect_usage("it needs --weight-decay > 0",
                 (const char *const[]){t, "train", "--no-decay-1d", NULL});
}

/* The value of `key` in a --log's epoch line. */
static double log_epoch(const char *log, const char *key) {
    char *text = slurp(log);
    char *p = strstr(text, "\"type\":\"epoch\"");
    double v = p ? json_num(p, key) : NAN;
    free(text);
    return v;
}

/* --eval-flip: training is untouched (the same train loss), the test loss is that of the
 * flip-averaged logits (another value), the config line says so; refused for gpt. */
static void test_eval_flip(void) {
    const char *plain[] = {"--seed", "2", NULL};
    const char *flip[] = {"--seed", "2", "--eval-flip", NULL};
    if (logged_run("noflip", plain, NULL) || logged_run("flip", flip, NULL)) return;
    char a[300], b[300];
    snprintf(a, sizeof a, "%s/noflip.jsonl", tmpdir);
    snprintf(b, sizeof b, "%s/flip.jsonl", tmpdir);
    CHECK(log_epoch(a, "train_loss") == log_epoch(b, "train_loss"), "train loss %g vs %g",
          log_epoch(a, "train_loss"), log_epoch(b, "train_loss"));
    double ta = log_epoch(a, "test_loss"), tb = log_epoch(b, "test_loss");
    CHECK(isfinite(tb) && tb != ta, "test loss with --eval-flip %g, without %g", tb, ta);
    char *text = slurp(b);
    CHECK(strstr(text, "\"eval_flip\":true") != NULL, "config: %.300s", text);
    free(text);
    expect_usage("--eval-flip mirrors test images",
                 (const char *const[]){tandem_path, "train", "--model", "gpt", "--data", "x.txt",
                                       "--eval-flip", NULL});
}

/* --validation N: N evenly spaced training samples are the test set, the rest the training
 * set (header and log say so); refused for gpt and for N >= the training set. */
static void test_validation(void) {
    char log[300];
    snprintf(log, sizeof log, "%s/val.jsonl", tmpdir);
    result r = TANDEM("train", "--limit", "3000", "--validation", "600", "--log", log);
    CHECK(r.status == 0 && strstr(r.out, "2400 train, 600 validation images"),
          "--validation run: exit %d: %s%s", r.status, r.out, r.err);
    result_free(&r);
    char *text = slurp(log);
    CHECK(strstr(text, "\"train_samples\":2400,\"test_samples\":600,") &&
              strstr(text, "\"validation\":600"),
          "config: %.500s", text);
    free(text);
    /* the held-out samples are training samples: evaluated, they differ from the test set's */
    double val_loss = log_epoch(log, "test_loss");
    snprintf(log, sizeof log, "%s/noval.jsonl", tmpdir);
    r = TANDEM("train", "--limit", "3000", "--log", log, "--quiet");
    CHECK(r.status == 0 && isfinite(val_loss) && log_epoch(log, "test_loss") != val_loss,
          "validation loss %g, test loss %g", val_loss, log_epoch(log, "test_loss"));
    result_free(&r);
    const char *t = tandem_path;
    expect_usage(
        "--validation 3000: the training set has only 3000 samples",
        (const char *const[]){t, "train", "--limit", "3000", "--validation", "3000", NULL});
    expect_usage("--model gpt has no test split",
                 (const char *const[]){t, "train", "--model", "gpt", "--data", "x.txt",
                                       "--validation", "10", NULL});
}

/* --recipe: its options are printed and applied, the command line's override them; an
 * unknown name is refused with the known ones. */
static void test_recipe(void) {
    char log[300];
    snprintf(log, sizeof log, "%s/recipe.jsonl", tmpdir);
    result r = TANDEM("train", "--recipe", "fmnist-fast", "--epochs", "1", "--limit", "600",
                      "--devices", "cpu:0", "--log", log);
    CHECK(r.status == 0 && strstr(r.out, "recipe    fmnist-fast: --data fashion-mnist --model "
                                         "cnn-bn --devices 'cpu:0,cpu:1' --epochs 4"),
          "--recipe run: exit %d: %s%s", r.status, r.out, r.err);
    result_free(&r);
    char *text = slurp(log);
    CHECK(strstr(text, "\"model\":\"cnn-bn\"") && strstr(text, "\"devices\":\"cpu:0\"") &&
              strstr(text, "\"epochs\":1,\"batch_size\":256,") &&
              strstr(text, "\"label_smoothing\":0.1,\"nesterov\":true") &&
              strstr(text, "\"eval_flip\":true"),
          "config: %.600s", text);
    free(text);
    expect_usage("unknown recipe 'fast' (known: fmnist-fast)",
                 (const char *const[]){tandem_path, "train", "--recipe", "fast", NULL});
}

/* Options that used to be the GPT's alone, now the one trainer's: gradient accumulation (2
 * batches of 32 are one step of 64: the same losses, on 1 and 2 devices) and clipping (a low
 * limit changes the run; 2 devices clip their averaged gradient as 1 device clips its own). */
static void test_accumulate_and_clip(void) {
#define RUN(...) TANDEM("train", "--limit", "640", "--model", "mlp", "--quiet", __VA_ARGS__)
    result whole = RUN("--batch-size", "64");
    result acc = RUN("--batch-size", "32", "--grad-accum", "2");
    result acc2 = RUN("--batch-size", "32", "--grad-accum", "2", "--devices", "2");
    double lw = epoch_train_loss(whole.out), la = epoch_train_loss(acc.out);
    double la2 = epoch_train_loss(acc2.out);
    CHECK(whole.status == 0 && acc.status == 0 && acc2.status == 0, "exit %d %d %d: %s%s",
          whole.status, acc.status, acc2.status, acc.err, acc2.err);
    CHECK(fabs(lw - la) <= 2e-4 && fabs(lw - la2) <= 2e-4,
          "train loss of batch 64 %.4f, 32 x 2 accumulated %.4f, on 2 devices %.4f", lw, la, la2);
    result clip = RUN("--batch-size", "64", "--clip-grad", "0.05");
    result clip2 = RUN("--batch-size", "64", "--clip-grad", "0.05", "--devices", "2");
    double lc = epoch_train_loss(clip.out), lc2 = epoch_train_loss(clip2.out);
    CHECK(clip.status == 0 && fabs(lc - lw) > 1e-2, "clipping changed nothing: %.4f vs %.4f", lc,
          lw);
    CHECK(clip2.status == 0 && fabs(lc - lc2) <= 2e-4, "clipped on 1 device %.4f, on 2 %.4f", lc,
          lc2);
    result split = RUN("--devices", "2", "--model-split", "2", "--grad-accum", "2");
    CHECK(split.status == 2 && strstr(split.err, "--micro-batches"), "split + accum: %d %s",
          split.status, split.err);
    result *all[] = {&whole, &acc, &acc2, &clip, &clip2, &split};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) result_free(all[i]);
#undef RUN
}

/* The value of "scalar TAG STEP VALUE WALL_TIME" in tensorboard_read.py's output, or NAN. */
static double tb_scalar(const char *seen, const char *tag, long long step) {
    char want[160];
    snprintf(want, sizeof want, "scalar %s %lld ", tag, step);
    const char *p = strstr(seen, want);
    return p ? strtod(p + strlen(want), NULL) : NAN;
}

/* --tensorboard DIR, read back by the tensorboard package's own reader (python SCRIPT, i.e.
 * tests/tensorboard_read.py in the venv of scripts/setup): each step's loss and lr and each
 * epoch's test accuracy are those of --log. Returns 77 (skipped) without that python. */
static int test_tensorboard_run(const char *python, const char *script) {
    if (access(python, X_OK) != 0) {
        fprintf(stderr, "skipped: no %s (scripts/setup makes the venv)\n", python);
        return 77;
    }
    char dir[300], log[300];
    snprintf(dir, sizeof dir, "%s/tb", tmpdir);
    snprintf(log, sizeof log, "%s/tb.jsonl", tmpdir);
    result r = TANDEM("train", "--limit", "320", "--epochs", "2", "--quiet", "--log", log,
                      "--tensorboard", dir);
    CHECK(r.status == 0, "train --tensorboard: exit %d: %s", r.status, r.err);
    result_free(&r);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "%s %s %s/events.out.tfevents.* > %s/tb.txt", python, script, dir,
             tmpdir);
    CHECK(system(cmd) == 0, "%s failed", cmd);
    snprintf(cmd, sizeof cmd, "%s/tb.txt", tmpdir);
    char *seen = slurp(cmd), *text = slurp(log);
    int steps = 0, epochs = 0;
    for (char *p = strstr(text, "\"type\":\"step\""); p; p = strstr(p + 1, "\"type\":\"step\"")) {
        double v = tb_scalar(seen, "train/loss", (long long)json_num(p, "global_step"));
        steps += !isnan(v);
        CHECK_CLOSE(v, json_num(p, "loss"), 0, 1e-6); /* --log writes 7 digits */
    }
    for (char *p = strstr(text, "\"type\":\"epoch\""); p; p = strstr(p + 1, "\"type\":\"epoch\"")) {
        double v = tb_scalar(seen, "epoch/test_acc", (long long)json_num(p, "epoch"));
        epochs += !isnan(v);
        CHECK_CLOSE(v, json_num(p, "test_acc"), 0, 1e-6);
    }
    CHECK(steps == 10 && epochs == 2 && strstr(seen, "scalar train/lr 10 0.100000001 ") &&
              strstr(seen, "scalar train/img_per_s 10 "),
          "TensorBoard read %d steps, %d epochs: %.300s", steps, epochs, seen);
    free(seen);
    free(text);
    return check_summary();
}

static void test_tutorial(const char *path) {
    result r = run((const char *const[]){path, "300", "2", NULL});
    CHECK(r.status == 0, "mlp_tutorial: exit %d, stderr: %s", r.status, r.err);
    CHECK(strstr(r.out, "Epoch 2") && strstr(r.out, "Accuracy:") && strstr(r.out, "Done!"),
          "mlp_tutorial output: %s", r.out);
    result_free(&r);
}

/* mpirun -np 2 tandem train: two processes learn what one does (the global batch is split,
 * gradients averaged), only rank 0 prints, and a batch that does not split is refused. */
static void test_mpi_run(const char *mpirun) {
    char log1[300], log2[300];
    snprintf(log1, sizeof log1, "%s/one.jsonl", tmpdir);
    snprintf(log2, sizeof log2, "%s/two.jsonl", tmpdir);
    result one = TANDEM("train", "--limit", "1280", "--model", "mlp", "--quiet", "--log", log1);
    result two = run((const char *const[]){mpirun, "--oversubscribe", "-np", "2", tandem_path,
                                           "train", "--limit", "1280", "--model", "mlp", "--quiet",
                                           "--log", log2, "--check-replicas", "3", NULL});
    CHECK(one.status == 0 && two.status == 0, "mpi run: exit %d and %d: %s", one.status, two.status,
          two.err);
    double l1 = epoch_train_loss(one.out), l2 = epoch_train_loss(two.out);
    CHECK(fabs(l1 - l2) <= 2e-4, "train loss in 1 process %.4f, in 2 processes %.4f", l1, l2);
    /* --log's step losses are the global batch's, as one process's (not rank 0's half) */
    {
        char *j1 = slurp(log1), *j2 = slurp(log2);
        const char *p1 = strstr(j1, "\"step\":5,"), *p2 = strstr(j2, "\"step\":5,");
        p1 = p1 ? strstr(p1, "\"loss\":") : NULL, p2 = p2 ? strstr(p2, "\"loss\":") : NULL;
        double s1 = p1 ? strtod(p1 + 7, NULL) : NAN, s2 = p2 ? strtod(p2 + 7, NULL) : NAN;
        CHECK(fabs(s1 - s2) <= 1e-5, "step 5's logged loss: 1 process %.6f, 2 processes %.6f", s1,
              s2);
        free(j1), free(j2);
    }
    const char *first = strstr(two.out, "train loss");
    CHECK(first && !strstr(first + 1, "train loss"), "only rank 0 prints: %s", two.out);
    /* two devices in each of two processes: the two-level group */
    result four = run((const char *const[]){
        mpirun, "--oversubscribe", "-np", "2", tandem_path, "train", "--limit", "1280", "--model",
        "mlp", "--quiet", "--devices", "2", "--timeout", "20", "--batch-per-device", "16", NULL});
    double l4 = epoch_train_loss(four.out);
    CHECK(four.status == 0 && fabs(l1 - l4) <= 2e-4,
          "train loss in 1 process %.4f, on 2 processes x 2 devices of 16 rows %.4f (exit %d: %s)",
          l1, l4, four.status, four.err);
    /* processes started with different options stop before training, naming them; --shard,
     * --lr and --max-steps may change on a resume but not between processes (another rate
     * diverges silently, other step counts desynchronise the collectives) */
    const char *const odd_cases[][3] = {
        {"--momentum", "0.5", "different options: --momentum 0.9 on rank 0, 0.5 on rank 1"},
        {"--shard", "optimizer", "different options: --shard none on rank 0, optimizer on rank 1"},
        {"--lr", "0.05", "different options: --lr 0.1 on rank 0, 0.05 on rank 1"},
        {"--max-steps", "3", "different options: --max-steps 0 on rank 0, 3 on rank 1"}};
    for (size_t k = 0; k < sizeof odd_cases / sizeof odd_cases[0]; k++) {
        result odd = run((const char *const[]){mpirun,          "--oversubscribe",
                                               "-np",           "1",
                                               tandem_path,     "train",
                                               "--limit",       "1280",
                                               "--quiet",       ":",
                                               "-np",           "1",
                                               tandem_path,     "train",
                                               "--limit",       "1280",
                                               "--quiet",       odd_cases[k][0],
                                               odd_cases[k][1], NULL});
        CHECK(odd.status != 0 && strstr(odd.err, odd_cases[k][2]),
              "processes with different %s: exit %d: %s", odd_cases[k][0], odd.status, odd.err);
        result_free(&odd);
    }
    result_free(&one);
    result_free(&two);
    result_free(&four);
    /* a GPT on text (bytes as tokens): the printed loss is the global batch's, the same in
     * 1 process and in 2 processes of 2 devices; these shard the parameters (ZeRO stage 3),
     * and rank 0's model.bin beside the checkpoint, read from the 4 shard files, is the --save
     * file written from the model gathered at the end */
    char text[300], ckdir[300], bin[340], saved[300];
    snprintf(ckdir, sizeof ckdir, "%s/gpt-zero3", tmpdir);
    snprintf(bin, sizeof bin, "%s/model.bin", ckdir);
    snprintf(saved, sizeof saved, "%s/gpt-zero3.bin", tmpdir);
    snprintf(text, sizeof text, "%s/text.txt", tmpdir);
    FILE *f = fopen(text, "w");
    for (int i = 0; f && i < 200; i++) fprintf(f, "line %d of a small text to learn from\n", i);
    if (f) fclose(f);
    const char *gpt[] = {"train", "--model",     "gpt", "--data",        text, "--batch-size",
                         "8",     "--max-steps", "6",   "--print-every", "6",  "--layers",
                         "1",     "--channels",  "32",  "--heads",       "2",  "--context",
                         "16"};
    result g1 =
        run((const char *const[]){tandem_path, gpt[0],  gpt[1],  gpt[2],  gpt[3],  gpt[4],  gpt[5],
                                  gpt[6],      gpt[7],  gpt[8],  gpt[9],  gpt[10], gpt[11], gpt[12],
                                  gpt[13],     gpt[14], gpt[15], gpt[16], gpt[17], gpt[18], NULL});
    result g2 = run((const char *const[]){mpirun,
                                          "--oversubscribe",
                                          "-np",
                                          "2",
                                          tandem_path,
                                          gpt[0],
                                          gpt[1],
                                          gpt[2],
                                          gpt[3],
                                          gpt[4],
                                          gpt[5],
                                          gpt[6],
                                          gpt[7],
                                          gpt[8],
                                          gpt[9],
                                          gpt[10],
                                          gpt[11],
                                          gpt[12],
                                          gpt[13],
                                          gpt[14],
                                          gpt[15],
                                          gpt[16],
                                          gpt[17],
                                          gpt[18],
                                          "--devices",
                                          "2",
                                          "--shard",
                                          "parameters",
                                          "--save",
                                          saved,
                                          "--checkpoint-dir",
                                          ckdir,
                                          NULL});
    const char *p1 = strstr(g1.out, "step 6/6  loss "), *p2 = strstr(g2.out, "step 6/6  loss ");
    double a = p1 ? strtod(p1 + 15, NULL) : NAN, b = p2 ? strtod(p2 + 15, NULL) : NAN;
    CHECK(g1.status == 0 && g2.status == 0 && fabs(a - b) <= 1e-3,
          "gpt loss after 6 steps: 1 process %.4f, 2 processes x 2 devices %.4f (exit %d, %d: "
          "%s)",
          a, b, g1.status, g2.status, g2.err);
    size_t nb = 0, ns = 0;
    char *fb = slurp_file(bin, &nb), *fs = slurp_file(saved, &ns);
    CHECK(fb && fs && nb == ns && nb > 1024 && memcmp(fb, fs, nb) == 0,
          "stage 3 under mpirun: %s (from the shards) and %s (gathered) differ or are missing", bin,
          saved);
    free(fb), free(fs);
    result_free(&g1);
    result_free(&g2);
    result bad = run((const char *const[]){mpirun, "--oversubscribe", "-np", "2", tandem_path,
                                           "train", "--limit", "640", "--batch-size", "63", NULL});
    CHECK(bad.status != 0 && strstr(bad.err, "does not split evenly over 2 processes"),
          "odd batch under mpirun: exit %d: %s", bad.status, bad.err);
    result_free(&bad);
    /* a diverging run: each process's error is one whole line naming its rank */
    result nan = run((const char *const[]){mpirun, "--oversubscribe", "-np", "2", tandem_path,
                                           "train", "--limit", "640", "--lr", "1e5", NULL});
    const char *line = strstr(nan.err, "tandem train: error: rank ");
    const char *eol = line ? strchr(line, '\n') : NULL;
    const char *why = line ? strstr(line, "training diverged") : NULL;
    CHECK(nan.status != 0 && why && eol && why < eol, "a diverging run under mpirun: exit %d: %s",
          nan.status, nan.err);
    result_free(&nan);
}

/* ---- wall-clock time and --plot-compare (issue 20: time to accuracy) ------------------- */

/* Writes text to tmpdir/name; the path into path (300 bytes). */
static void write_tmp(const char *name, const char *text, char *path) {
    snprintf(path, 300, "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL, "cannot write %s", path);
    if (f) fputs(text, f), fclose(f);
}

/* The epoch lines' wall_s: finite, rising, and at least the seconds of the epochs so far
 * (training and evaluation: the process also loaded the data before them). */
static void check_wall_s(const char *log, int epochs) {
    char *text = slurp(log);
    int n = 0;
    double prev = 0, spent = 0;
    for (char *p = strstr(text, "\"type\":\"epoch\""); p; p = strstr(p + 1, "\"type\":\"epoch\"")) {
        double w = json_num(p, "wall_s");
        spent += json_num(p, "seconds") + json_num(p, "eval_seconds");
        CHECK(isfinite(w) && w > prev, "epoch %d: wall_s %g after %g", n + 1, w, prev);
        CHECK(w >= spent, "epoch %d: wall_s %g < the epochs' %g s so far", n + 1, w, spent);
        prev = w, n++;
    }
    CHECK(n == epochs, "%d epoch lines with wall_s, expected %d", n, epochs);
    free(text);
}

/* The wall-time panel's series labelled label: its data-points and its dots (-1: absent). */
static int wall_points(const char *svg, const char *label, int *dots) {
    char pat[200];
    snprintf(pat, sizeof pat, "<g class=\"wall\" data-label=\"%s\" data-points=\"", label);
    const char *g = strstr(svg, pat), *end = g ? strstr(g, "</g>") : NULL;
    *dots = 0;
    if (!g || !end) return -1;
    for (const char *c = strstr(g, "<circle"); c && c < end; c = strstr(c + 1, "<circle"))
        (*dots)++;
    return atoi(g + strlen(pat));
}

/* A PyTorch-side log as bench/torch_recipe.py writes it (json.dumps: a space after ':'), with
 * lines that must be skipped: a config line, a step line, an epoch line without wall_s. */
static const char torch_log[] =
    "{\"type\": \"config\", \"model\": \"cnn-bn\"}\n"
    "{\"type\": \"step\", \"epoch\": 1, \"loss\": 0.5, \"wall_s\": 1.0}\n"
    "{\"type\": \"epoch\", \"epoch\": 1, \"test_acc\": 0.71, \"seconds\": 1.5, \"wall_s\": 2.5}\n"
    "{\"type\": \"epoch\", \"epoch\": 2, \"test_acc\": 0.78, \"seconds\": 1.5, \"wall_s\": 4.25}\n"
    "{\"type\": \"epoch\", \"epoch\": 3, \"test_acc\": null, \"seconds\": 1.5, \"wall_s\": 5.0}\n"
    "{\"type\": \"epoch\", \"epoch\": 3, \"test_acc\": 0.8, \"seconds\": 1.5}\n"
    "{\"type\":\"epoch\",\"epoch\":3,\"test_acc\":0.8125,\"seconds\":1.5,\"wall_s\":6}\n";

/* --log's wall_s and the plot's third panel, with another run drawn beside this one. */
static void test_wall_time_plot(void) {
    char log[300], plot[300], cmp[300], spec[320];
    snprintf(log, sizeof log, "%s/wall.jsonl", tmpdir);
    snprintf(plot, sizeof plot, "%s/wall.svg", tmpdir);
    write_tmp("torch.jsonl", torch_log, cmp);
    snprintf(spec, sizeof spec, "%s=PyTorch & co", cmp);
    result r = TANDEM("train", "--limit", "640", "--epochs", "3", "--quiet", "--log", log, "--plot",
                      plot, "--plot-compare", spec);
    CHECK(r.status == 0, "--plot-compare run: exit %d, stderr: %s", r.status, r.err);
    result_free(&r);
    check_wall_s(log, 3);
    char *svg = slurp(plot);
    int dots, n = wall_points(svg, "tandem", &dots);
    CHECK(strstr(svg, "Test accuracy vs wall-clock time") && strstr(svg, "seconds since"),
          "svg lacks the wall-time panel's title or axis");
    CHECK(n == 3 && dots == 3, "this run's wall-time series: %d points, %d dots", n, dots);
    n = wall_points(svg, "PyTorch &amp; co", &dots);
    CHECK(n == 3 && dots == 3, "the compared run: %d points, %d dots (3 usable lines)", n, dots);
    CHECK(strstr(svg, ">PyTorch &amp; co</text>") && strstr(svg, ">tandem</text>"),
          "the legend lacks a run's label");
    free(svg);
    check_svg(plot);

    /* without =LABEL the label is the file's base name */
    r = TANDEM("train", "--limit", "320", "--quiet", "--plot", plot, "--plot-compare", cmp);
    CHECK(r.status == 0, "--plot-compare without a label: exit %d, stderr: %s", r.status, r.err);
    result_free(&r);
    svg = slurp(plot);
    CHECK(wall_points(svg, "torch.jsonl", &dots) == 3 && dots == 3,
          "the compared run is not labelled torch.jsonl");
    free(svg);
}

/* --plot-compare's errors: each names the file and the cause, before any training. */
static void expect_compare_error(const char *file, const char *cause) {
    char plot[300];
    snprintf(plot, sizeof plot, "%s/err.svg", tmpdir);
    result r = TANDEM("train", "--limit", "100", "--plot", plot, "--plot-compare", file);
    CHECK(r.status == 1, "--plot-compare %s: exit %d, expected 1 (stderr %s)", file, r.status,
          r.err);
    CHECK(strstr(r.err, file) && strstr(r.err, cause), "error should name %s and '%s': %s", file,
          cause, r.err);
    CHECK(!strstr(r.out, "epoch 1/"), "--plot-compare %s: trained before failing: %s", file, r.out);
    result_free(&r);
}

static void test_plot_compare_errors(void) {
    char missing[300], empty[300], pct[300];
    snprintf(missing, sizeof missing, "%s/no-such.jsonl", tmpdir);
    expect_compare_error(missing, "cannot be read: No such file or directory");
    write_tmp("no-epochs.jsonl",
              "{\"type\":\"config\",\"model\":\"mlp\"}\n{\"type\":\"step\",\"loss\":1}\n", empty);
    expect_compare_error(empty, "no epoch line with test_acc and wall_s");
    write_tmp("percent.jsonl", "{\"type\":\"epoch\",\"test_acc\":91.5,\"wall_s\":3}\n", pct);
    expect_compare_error(pct, "line 1: test_acc 91.5 must be a fraction");
    expect_usage(
        "--plot-compare draws other runs into the chart of --plot",
        (const char *const[]){tandem_path, "train", "--limit", "100", "--plot-compare", pct, NULL});

    result r = TANDEM("train", "--help");
    CHECK(strstr(r.out, "--plot-compare") && strstr(r.out, "wall-clock") && strstr(r.out, "wall_s"),
          "train --help should describe --plot-compare, the wall-clock panel and wall_s");
    result_free(&r);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_cli PATH_TO_TANDEM [PATH_TO_MLP_TUTORIAL | --mpirun MPIRUN | "
                        "--tensorboard PYTHON SCRIPT]\n");
        return 2;
    }
    tandem_path = argv[1];
    if (tmpdir_make("test_cli") != 0) return 1;
    if (argc == 5 && strcmp(argv[2], "--tensorboard") == 0) {
        int rc = test_tensorboard_run(argv[3], argv[4]);
        tmpdir_remove();
        return rc;
    }
    if (argc == 4 && strcmp(argv[2], "--mpirun") == 0) {
        test_mpi_run(argv[3]);
    } else {
        test_help();
        test_usage_errors();
        test_runtime_errors();
        test_mlp_run();
        test_cnn_run();
        test_devices_run();
        test_model_split();
        test_schedules();
        test_new_schedules();
        test_training_extras();
        test_eval_flip();
        test_validation();
        test_recipe();
        test_accumulate_and_clip();
        test_wall_time_plot();
        test_plot_compare_errors();
        if (argc > 2) test_tutorial(argv[2]);
    }
    tmpdir_remove();
    return check_summary();
}
