/* `tandem train --model gpt` and `tandem sample` end to end: a tiny GPT learns a repetitive
 * text (its loss falls), is saved in llm.c's format and read back by the library, samples are
 * reproducible from a seed, two devices train like one, a resumed run continues as if never
 * stopped, and bad options fail with the right
 * status and message. Runs the `tandem` built beside this test. */
#include "check.h"
#include "testdir.h"

static char tandem[4096];
typedef struct {
    int status;
    char *out, *err;
} result;

/* A file's first cap - 1 bytes into buf, "" when it cannot be read. */
static void slurp(const char *path, char *buf, size_t cap) {
    char *s = slurp_file(path, NULL);
    snprintf(buf, cap, "%s", s ? s : "");
    free(s);
}

/* Runs tandem with argv (NULL-terminated, argv[0] ignored), capturing stdout and stderr; the
 * result stays valid until the next run. */
static char tandem_mpirun[4096]; /* set: run() starts mpirun, whose arguments argv holds */

static result *run(const char **argv) {
    static result r;
    free(r.out);
    free(r.err);
    argv[0] = tandem_mpirun[0] ? tandem_mpirun : tandem;
    r.status = wait_status(spawn_captured(argv));
    r.out = captured("stdout");
    r.err = captured("stderr");
    return &r;
}

#define TANDEM(...) run((const char *[]){"", __VA_ARGS__, NULL})

/* The losses of the "step N/M  loss X" lines, in order; returns how many. */
static int losses(const char *out, double *v, int cap) {
    int n = 0;
    for (const char *p = strstr(out, "  loss "); p && n < cap; p = strstr(p + 1, "  loss "))
        v[n++] = strtod(p + 7, NULL);
    return n;
}

static char text_path[300], model_path[300];

static void write_text(void) {
    snprintf(text_path, sizeof text_path, "%s/fox.txt", tmpdir);
    FILE *f = fopen(text_path, "w");
    for (int i = 0; f && i < 300; i++) fputs("the quick brown fox jumps over the lazy dog.\n", f);
    if (f) fclose(f);
}

static void test_train_and_save(void) {
    snprintf(model_path, sizeof model_path, "%s/fox.bin", tmpdir);
    char log[300], plot[300];
    snprintf(log, sizeof log, "%s/gpt.jsonl", tmpdir);
    snprintf(plot, sizeof plot, "%s/gpt.svg", tmpdir);
    result *r = TANDEM("train", "--model", "gpt", "--data", text_path, "--layers", "1", "--heads",
                       "2", "--channels", "32", "--context", "16", "--batch-size", "8",
                       "--max-steps", "60", "--lr", "3e-3", "--workers", "0", "--print-every", "10",
                       "--save", model_path, "--log", log, "--plot", plot);
    CHECK(r->status == 0, "train exit %d: %s", r->status, r->err);
    double v[16];
    int n = losses(r->out, v, 16);
    CHECK(n == 6 && strstr(r->out, "step 60/60"), "progress lines: %s", r->out);
    if (n == 6) CHECK(v[5] < v[0] - 1.0, "loss %.4f -> %.4f: not learning", v[0], v[5]);
    /* --log: a config line, then one line per step with its loss and tokens per second */
    static char text[1 << 16];
    slurp(log, text, sizeof text);
    int steps = 0;
    for (const char *p = strstr(text, "\"type\":\"step\""); p;
         p = strstr(p + 1, "\"type\":\"step\""))
        steps++;
    CHECK(strstr(text, "{\"type\":\"config\",\"model\":\"gpt\"") && steps == 60 &&
              strstr(text, "\"global_step\":60,") && strstr(text, "\"tok_s\":"),
          "log %s: %d step lines", log, steps);
    slurp(plot, text, sizeof text);
    CHECK(strstr(text, "<svg") && strstr(text, "train-step") && strstr(text, "</svg>"), "plot %s",
          plot);
    tdm_gpt_config cfg;
    tdm_module *m = tdm_gpt_load_llmc(model_path, tdm_cpu(0), &cfg);
    CHECK(m && cfg.layers == 1 && cfg.heads == 2 && cfg.channels == 32 && cfg.context == 16 &&
              cfg.vocab == 256,
          "saved model: %s", tdm_last_error());
    tdm_module_free(m);
}

/* Two devices print the losses of one, plain and with the gradient clipped. AdamW ignores a
 * constant gradient scale, so the clip is low enough to bring the gradients near AdamW's eps:
 * the losses then differ from the plain run's, and show that clipping happened. */
static void test_two_devices(void) {
    const char *args[] = {"",
                          "train",
                          "--model",
                          "gpt",
                          "--data",
                          text_path,
                          "--layers",
                          "1",
                          "--channels",
                          "16",
                          "--context",
                          "8",
                          "--batch-size",
                          "6",
                          "--max-steps",
                          "8",
                          "--workers",
                          "0",
                          "--print-every",
                          "4",
                          "--devices",
                          "1",
                          NULL,
                          NULL,
                          NULL};
    double v[4][4];
    const char *devices[2] = {"1", "2"}, *clip[2] = {NULL, "1e-6"};
    for (int c = 0; c < 2; c++)
        for (int d = 0; d < 2; d++) {
            args[21] = devices[d];
            args[22] = clip[c] ? "--clip-grad" : NULL, args[23] = clip[c];
            result *r = run(args);
            int n = losses(r->out, v[2 * c + d], 4);
            CHECK(r->status == 0 && n == 2, "%s device(s), clip %s: %s", devices[d],
                  clip[c] ? clip[c] : "off", r->err);
        }
    for (int i = 0; i < 2; i++) {
        CHECK_CLOSE(v[1][i], v[0][i], 2e-4, 0);
        CHECK_CLOSE(v[3][i], v[2][i], 2e-4, 0);
    }
    CHECK(fabs(v[2][1] - v[0][1]) > 1e-3, "clipping changed nothing: loss %.5f vs %.5f", v[2][1],
          v[0][1]);
    /* --trace: the loop's spans and a track per device */
    char trace[300];
    static char json[1 << 20];
    snprintf(trace, sizeof trace, "%s/trace.json", tmpdir);
    args[21] = "2", args[22] = "--trace", args[23] = trace;
    result *r = run(args);
    slurp(trace, json, sizeof json);
    CHECK(r->status == 0 && strstr(r->out, "trace     ") && json[0] == '[' &&
              strstr(json, "\"name\":\"step\"") && strstr(json, "\"cpu:1 compute\""),
          "trace of a 2-device GPT run: %s", r->err);
}

/* Gradient accumulation: two batches of 4 per step train exactly like batches of 8. */
static void test_grad_accum(void) {
    const char *args[] = {"",
                          "train",
                          "--model",
                          "gpt",
                          "--data",
                          text_path,
                          "--layers",
                          "1",
                          "--channels",
                          "16",
                          "--context",
                          "8",
                          "--max-steps",
                          "6",
                          "--workers",
                          "0",
                          "--print-every",
                          "3",
                          "--batch-size",
                          "8",
                          NULL,
                          NULL,
                          NULL,
                          NULL,
                          NULL,
                          NULL};
    result *r = run(args);
    double whole[4], accum[4];
    int n1 = losses(r->out, whole, 4);
    CHECK(r->status == 0 && n1 == 2, "batch 8: %s", r->err);
    args[19] = "4", args[20] = "--grad-accum", args[21] = "2";
    r = run(args);
    int n2 = losses(r->out, accum, 4);
    CHECK(r->status == 0 && n2 == 2 && strstr(r->out, "batch 4 x 2 accumulated"),
          "batch 4 x 2: %s %s", r->out, r->err);
    for (int i = 0; i < n1 && i < n2; i++) CHECK_CLOSE(accum[i], whole[i], 2e-4, 0);
    /* and on two devices (DataParallel without sync until the step's last batch) */
    args[22] = "--devices", args[23] = "2";
    r = run(args);
    n2 = losses(r->out, accum, 4);
    CHECK(r->status == 0 && n2 == 2, "batch 4 x 2 on 2 devices: %s %s", r->out, r->err);
    for (int i = 0; i < n1 && i < n2; i++) CHECK_CLOSE(accum[i], whole[i], 2e-4, 0);
}

/* Stopping at step 6 with a checkpoint and resuming to step 12 prints the losses of an
 * uninterrupted run of 12 steps (weights, AdamW moments and data position restored). */
static void test_resume(void) {
    char dir[300];
    snprintf(dir, sizeof dir, "%s/ckpt", tmpdir);
#define GPT_RUN(steps, ...)                                                                        \
    TANDEM("train", "--model", "gpt", "--data", text_path, "--layers", "1", "--channels", "16",    \
           "--context", "8", "--batch-size", "4", "--max-steps", steps, "--workers", "0",          \
           "--print-every", "3", __VA_ARGS__)
    double whole[8], resumed[8];
    result *r = GPT_RUN("12", "--seed", "3");
    int n = losses(r->out, whole, 8);
    CHECK(r->status == 0 && n == 4, "uninterrupted run: %s", r->err);
    r = GPT_RUN("6", "--seed", "3", "--checkpoint-dir", dir, "--checkpoint-every", "3");
    CHECK(r->status == 0 && strstr(r->out, "checkpoint"), "first half: %s %s", r->out, r->err);
    r = GPT_RUN("12", "--seed", "3", "--checkpoint-dir", dir, "--resume");
    int m = losses(r->out, resumed, 8);
    CHECK(r->status == 0 && m == 2 && strstr(r->out, "step 6"), "resumed run: %s %s", r->out,
          r->err);
    for (int i = 0; i < m && n == 4; i++) CHECK_CLOSE(resumed[i], whole[2 + i], 1e-6, 0);
#undef GPT_RUN
}

/* The largest difference between the parameters of two llm.c model files of one config (their
 * floats after the 256-int header); INFINITY when either is missing or they differ in size. */
static double model_diff(const char *a, const char *b) {
    size_t na = 0, nb = 0;
    char *x = slurp_file(a, &na), *y = slurp_file(b, &nb);
    double d = x && y && na == nb && na > 1024 ? 0 : INFINITY;
    for (size_t i = 1024; d < INFINITY && i + 4 <= na; i += 4) {
        float u, v;
        memcpy(&u, x + i, 4), memcpy(&v, y + i, 4);
        d = fmax(d, fabs((double)u - (double)v));
    }
    free(x), free(y);
    return d;
}

/* --tensor-parallel: tp 2 (and dp 2 x tp 2) trains as one device does, loss for loss and
 * within float rounding weight for weight (the row-parallel layers add their partial products
 * in another order; AdamW's lr 3e-4 bounds what 12 steps of that can move: measured 3e-7,
 * bound 1e-5; a missing reduction moves weights by ~lr a step); its checkpoint resumes on one
 * device, and one device's on dp 2 x tp 2; a GPT too large for one capped device trains on
 * two; what it does not work with is refused. */
static void test_tensor_parallel(void) {
    char one[300], tp[300], res1[300], d1[300];
    snprintf(one, sizeof one, "%s/tp-one.bin", tmpdir),
        snprintf(tp, sizeof tp, "%s/tp2.bin", tmpdir);
    snprintf(res1, sizeof res1, "%s/tp-res1.bin", tmpdir);
    snprintf(d1, sizeof d1, "%s/tp-ck", tmpdir);
#define TP_RUN(steps, ...)                                                                         \
    TANDEM("train", "--model", "gpt", "--data", text_path, "--layers", "2", "--heads", "4",        \
           "--channels", "16", "--context", "8", "--batch-size", "4", "--max-steps", steps,        \
           "--workers", "0", "--print-every", "3", "--seed", "3", "--clip-grad", "1", __VA_ARGS__)
    double ref[4], got[4];
    result *r = TP_RUN("12", "--save", one);
    CHECK(r->status == 0 && losses(r->out, ref, 4) == 4, "one device: %s", r->err);
    r = TP_RUN("12", "--devices", "2", "--tp", "2", "--save", tp);
    int n = losses(r->out, got, 4);
    CHECK(r->status == 0 && n == 4 && strstr(r->out, "mesh dp 1 x tp 2"), "tp 2: %s %s", r->out,
          r->err);
    for (int i = 0; i < n; i++) CHECK_CLOSE(got[i], ref[i], 1e-4, 0);
    double dw = model_diff(tp, one);
    CHECK(dw <= 1e-5, "tp 2: weights off by %g after 12 steps", dw);
    /* the data-parallel rows' parts compared every 2 steps (--check-replicas): equal */
    r = TP_RUN("4", "--devices", "4", "--tp", "2", "--check-replicas", "2");
    CHECK(r->status == 0, "dp 2 x tp 2 --check-replicas 2: %s", r->err);
    /* with each block's forward run again in backward (its collectives too, on every rank) */
    r = TP_RUN("12", "--devices", "2", "--tp", "2", "--recompute", "--save", tp);
    CHECK(r->status == 0 && losses(r->out, got, 4) == 4, "tp 2 --recompute: %s", r->err);
    for (int i = 0; i < 4; i++) CHECK_CLOSE(got[i], ref[i], 1e-4, 0);
    double dwr = model_diff(tp, one);
    CHECK(dwr <= 1e-5, "tp 2 --recompute: weights off by %g after 12 steps", dwr);
    /* tp 2 stopped at step 6 resumed on one device; one device's on dp 2 x tp 2 with ZeRO
     * stage 3 (FSDP with TP: each rank its range of its parts and their state); dp 2 x tp 2
     * with ZeRO stage 2's on tp 2 (gathered) */
    const char *d3 = "--devices";
    double dr[3];
    const char *first[3][6] = {{d3, "2", "--tp", "2", NULL},
                               {d3, "1", NULL},
                               {d3, "4", "--tp", "2", "--shard", "gradients"}};
    const char *then[3][6] = {{d3, "1", NULL},
                              {d3, "4", "--tp", "2", "--shard", "parameters"},
                              {d3, "2", "--tp", "2", NULL}};
    for (int k = 0; k < 3; k++) {
        char dir[320];
        snprintf(dir, sizeof dir, "%s-%d", d1, k);
        const char *const *f = first[k], *const *t = then[k];
        r = TP_RUN("6", "--checkpoint-dir", dir, f[0], f[1], f[2], f[3], f[4], f[5]);
        CHECK(r->status == 0, "resume case %d, first half: %s", k, r->err);
        r = TP_RUN("12", "--checkpoint-dir", dir, "--resume", "--save", res1, t[0], t[1], t[2],
                   t[3], t[4], t[5]);
        n = losses(r->out, got, 4);
        CHECK(r->status == 0 && n == 2 && strstr(r->out, "step 6"), "resume case %d: %s %s", k,
              r->out, r->err);
        for (int i = 0; i < n; i++) CHECK_CLOSE(got[i], ref[2 + i], 1e-4, 0);
        dr[k] = model_diff(res1, one);
        CHECK(dr[k] <= 1e-5, "resume case %d: weights off by %g", k, dr[k]);
    }
    /* tandem eval reads a tensor-parallel run's checkpoint as any other: case 1 ended on dp 2
     * x tp 2, case 0 on one device, both at step 12 */
    char dir0[320], dir1[320], l0[64] = "", l1[64] = "";
    snprintf(dir0, sizeof dir0, "%s-0", d1), snprintf(dir1, sizeof dir1, "%s-1", d1);
    for (int k = 0; k < 2; k++) {
        r = TANDEM("eval", "--weights", k ? dir1 : dir0, "--model", "gpt", "--data", text_path,
                   "--layers", "2", "--heads", "4", "--channels", "16", "--context", "8");
        const char *at = strstr(r->out, "next-token loss ");
        CHECK(r->status == 0 && at, "tandem eval of resume case %d: %s %s", k, r->out, r->err);
        if (at) snprintf(k ? l1 : l0, 64, "%.22s", at);
    }
    CHECK(l0[0] && !strcmp(l0, l1), "tandem eval: '%s' (one device) against '%s' (dp 2 x tp 2)", l0,
          l1);
    printf("tensor parallel: weights within %.2g (tp 2), %.2g (tp 2 -> one device), %.2g (one "
           "device -> dp 2 x tp 2 ZeRO-3), %.2g (dp 2 x tp 2 ZeRO-2 -> tp 2) of one device's "
           "after 12 steps\n",
           dw, dr[0], dr[1], dr[2]);
    /* bf16 autocast on every rank's thread, the vocabulary-parallel loss in f32: one device's
     * losses to bf16's rounding */
    r = TP_RUN("6", "--precision", "bf16");
    n = losses(r->out, ref, 4);
    CHECK(r->status == 0 && n == 2, "bf16, one device: %s", r->err);
    r = TP_RUN("6", "--precision", "bf16", "--devices", "2", "--tp", "2");
    CHECK(r->status == 0 && losses(r->out, got, 4) == 2, "bf16 at tp 2: %s", r->err);
    for (int i = 0; i < n; i++) CHECK_CLOSE(got[i], ref[i], 2e-2, 0);
    /* under a cap of 8 MiB a device, a GPT that needs ~10.4 on one trains with ~6.2 on two */
    r = TANDEM("train", "--model", "gpt", "--data", text_path, "--layers", "2", "--channels", "128",
               "--context", "32", "--batch-size", "4", "--max-steps", "2", "--workers", "0",
               "--device-memory", "8M");
    CHECK(r->status == 1 && strstr(r->err, "cpu:0 is out of memory"), "one capped device: %d %s",
          r->status, r->err);
    r = TANDEM("train", "--model", "gpt", "--data", text_path, "--layers", "2", "--channels", "128",
               "--context", "32", "--batch-size", "4", "--max-steps", "2", "--workers", "0",
               "--device-memory", "8M", "--devices", "2", "--tp", "2");
    CHECK(r->status == 0, "two capped devices at tp 2: %s", r->err);
    /* and writes checkpoints there: the whole model and optimizer are gathered on the host */
    char capped[320];
    snprintf(capped, sizeof capped, "%s-capped", d1);
    r = TANDEM("train", "--model", "gpt", "--data", text_path, "--layers", "2", "--channels", "128",
               "--context", "32", "--batch-size", "4", "--max-steps", "2", "--workers", "0",
               "--device-memory", "8M", "--devices", "2", "--tp", "2", "--checkpoint-dir", capped,
               "--checkpoint-every", "1");
    CHECK(r->status == 0 && count_ckpts(capped) == 2, "checkpoints of capped devices: %d %s",
          count_ckpts(capped), r->err);
    /* and capped lower (~4 MB fit a rank's clone and split, ~6.1 MB the step), a rank runs out
     * inside a step: the error is its allocation's, named with its device and mesh place (its
     * peers, waiting in a collective, are stopped, not left to time out) */
    r = TANDEM("train", "--model", "gpt", "--data", text_path, "--layers", "2", "--channels", "128",
               "--context", "32", "--batch-size", "4", "--max-steps", "2", "--workers", "0",
               "--device-memory", "5600K", "--devices", "2", "--tp", "2");
    CHECK(r->status == 1 && strstr(r->err, "training step: tensor_parallel: cpu:") &&
              strstr(r->err, "is out of memory") && !strstr(r->err, "NULL"),
          "a rank out of memory in a step: %d %s", r->status, r->err);
    /* refused, naming why */
    const struct {
        const char *a, *b, *c, *d, *want;
    } bad[] = {
        {"--tp", "3", "--devices", "2", "--tensor-parallel 3 needs a multiple of 3 devices"},
        {"--tp", "4", "--heads", "2", "heads"},
        {"--tp", "4", "--context", "6", "--context 6 does not split into 4"},
        {"--tp", "0", NULL, NULL, "--tensor-parallel"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        r = TP_RUN("2", "--devices", "4", bad[i].a, bad[i].b, bad[i].c, bad[i].d);
        CHECK(r->status != 0 && strstr(r->err, bad[i].want), "%s %s: exit %d: %s", bad[i].a,
              bad[i].b, r->status, r->err);
    }
    r = TANDEM("train", "--model", "mlp", "--tp", "2", "--devices", "2");
    CHECK(r->status == 2 && strstr(r->err, "no tensor-parallel plan"), "mlp at tp 2: %s", r->err);
}

static void test_sample(void) {
    result *r = TANDEM("sample", "--model", model_path, "--prompt", "the quick", "--tokens", "30",
                       "--seed", "7", "--top-k", "5");
    CHECK(r->status == 0, "sample exit %d: %s", r->status, r->err);
    char first[16384];
    strcpy(first, r->out);
    CHECK(strncmp(first, "the quick", 9) == 0 && strlen(first) == 9 + 30 + 1, "sample: '%s'",
          first);
    r = TANDEM("sample", "--model", model_path, "--prompt", "the quick", "--tokens", "30", "--seed",
               "7", "--top-k", "5");
    CHECK(strcmp(first, r->out) == 0, "same seed, different text: '%s' vs '%s'", first, r->out);
    r = TANDEM("sample", "--model", tmpdir); /* a directory without model.bin */
    CHECK(r->status == 1 && strstr(r->err, "model.bin"), "missing model: %d %s", r->status, r->err);
    r = TANDEM("sample", "--prompt", "x");
    CHECK(r->status == 2 && strstr(r->err, "--model FILE is required"), "%s", r->err);
    r = TANDEM("sample", "--model", model_path, "--temperature", "0");
    CHECK(r->status == 2 && strstr(r->err, "--temperature"), "%s", r->err);
    r = TANDEM("sample", "--help");
    CHECK(r->status == 0 && strstr(r->out, "--top-k"), "sample --help");
}

/* The image trainer's options on the GPT (one trainer): --keep, the RNG in its checkpoints,
 * --limit, --schedule step; and --model-split refused with its reason. */
static void test_shared_options(void) {
    char dir[300], path[4300], log[300];
    snprintf(dir, sizeof dir, "%s/keep", tmpdir);
    snprintf(log, sizeof log, "%s/step.jsonl", tmpdir);
#define GPT(...)                                                                                   \
    TANDEM("train", "--model", "gpt", "--data", text_path, "--layers", "1", "--channels", "16",    \
           "--context", "8", "--batch-size", "4", "--workers", "0", __VA_ARGS__)
    result *r = GPT("--max-steps", "30", "--keep", "1", "--checkpoint-every", "10",
                    "--checkpoint-dir", dir, "--quiet");
    CHECK(r->status == 0 && count_ckpts(dir) == 1, "--keep 1: exit %d, %d checkpoints: %s",
          r->status, count_ckpts(dir), r->err);
    int64_t step = 0;
    CHECK(tdm_checkpoint_latest(dir, path, sizeof path, &step) == 1 && step == 30,
          "newest checkpoint: step %lld", (long long)step);
    strcat(path, "/train_state.safetensors");
    tdm_safetensors *sf = tdm_safetensors_open(path);
    CHECK(sf && tdm_safetensors_meta(sf, "rng.seed") && tdm_safetensors_meta(sf, "rng.offset"),
          "the GPT's checkpoint holds the generator: %s", sf ? path : tdm_last_error());
    tdm_safetensors_close(sf);
    r = GPT("--limit", "40", "--epochs", "2", "--schedule", "step", "--gamma", "0.5", "--log", log);
    CHECK(r->status == 0 && strstr(r->out, "40 windows") && strstr(r->out, "10 steps per epoch"),
          "--limit 40: %s %s", r->out, r->err);
    static char text[1 << 16];
    slurp(log, text, sizeof text);
    const char *e2 = strstr(text, "\"epoch\":2,\"step\":1,");
    const char *lr = e2 ? strstr(e2, "\"lr\":") : NULL;
    CHECK(lr && fabs(strtod(lr + 5, NULL) - 1.5e-4) < 1e-9, "step schedule, epoch 2: %s",
          e2 ? e2 : text);
#undef GPT
}

/* Whether two files hold the same bytes (and could be read). */
static bool same_file(const char *a, const char *b) {
    size_t na = 0, nb = 0;
    char *pa = slurp_file(a, &na), *pb = slurp_file(b, &nb);
    bool same = pa && pb && na == nb && na > 0 && memcmp(pa, pb, na) == 0;
    free(pa);
    free(pb);
    return same;
}

/* --recompute runs each block again in backward: the trained weights are the same bytes as
 * without it, on one device and on two (DataParallel's replicas recompute on their threads). */
static void test_recompute(void) {
    char path[4][300];
    const char *devices[2] = {"1", "2"};
    for (int i = 0; i < 4; i++) {
        snprintf(path[i], sizeof path[i], "%s/recompute%d.bin", tmpdir, i);
        result *r = TANDEM("train", "--model", "gpt", "--data", text_path, "--layers", "2",
                           "--channels", "16", "--context", "8", "--batch-size", "4", "--max-steps",
                           "5", "--workers", "0", "--quiet", "--devices", devices[i / 2], "--save",
                           path[i], i % 2 ? "--recompute" : NULL);
        CHECK(r->status == 0, "--devices %s%s: exit %d %s", devices[i / 2],
              i % 2 ? " --recompute" : "", r->status, r->err);
    }
    for (int d = 0; d < 2; d++)
        CHECK(same_file(path[2 * d], path[2 * d + 1]),
              "--devices %s: %s and %s (--recompute) differ", devices[d], path[2 * d],
              path[2 * d + 1]);
    /* --shard parameters on the 2 devices: model.bin beside the last (sharded) checkpoint,
     * written from its shard files, and --save, from the model gathered, are the unsharded
     * run's bytes */
    char dir[300], saved[300], bin[340], shard[400];
    snprintf(dir, sizeof dir, "%s/zero3", tmpdir);
    snprintf(saved, sizeof saved, "%s/zero3.bin", tmpdir);
    snprintf(bin, sizeof bin, "%s/model.bin", dir);
    snprintf(shard, sizeof shard, "%s/ckpt-0000000005/shard-00001-of-00002.safetensors", dir);
    result *r = TANDEM("train", "--model", "gpt", "--data", text_path, "--layers", "2",
                       "--channels", "16", "--context", "8", "--batch-size", "4", "--max-steps",
                       "5", "--workers", "0", "--quiet", "--devices", "2", "--save", saved,
                       "--shard", "parameters", "--checkpoint-dir", dir);
    CHECK(r->status == 0 && access(shard, R_OK) == 0 && same_file(bin, path[2]) &&
              same_file(saved, path[2]),
          "--shard parameters: exit %d, no %s, or %s or %s differs from %s: %s", r->status, shard,
          bin, saved, path[2], r->err);
}

static void test_errors(void) {
    result *r = TANDEM("train", "--model", "gpt");
    CHECK(r->status == 2 && strstr(r->err, "needs --data FILE"), "%d %s", r->status, r->err);
    r = TANDEM("train", "--model", "gpt", "--data", text_path, "--optimizer", "sgd");
    CHECK(r->status == 2 && strstr(r->err, "adamw"), "%d %s", r->status, r->err);
    r = TANDEM("train", "--layers", "3");
    CHECK(r->status == 2 && strstr(r->err, "--model gpt only"), "%d %s", r->status, r->err);
    r = TANDEM("train", "--model", "gpt", "--data", text_path, "--heads", "3", "--channels", "32",
               "--max-steps", "1");
    CHECK(r->status == 1 && strstr(r->err, "3 heads do not divide 32 channels"), "%d %s", r->status,
          r->err);
    r = TANDEM("train", "--model", "gpt", "--data", "/nonexistent/book.txt");
    CHECK(r->status == 1 && strstr(r->err, "/nonexistent/book.txt"), "%d %s", r->status, r->err);
    /* llm.c's Llama-3 shards (u32 tokens) are refused by their magic, never read as text */
    char llama[300];
    snprintf(llama, sizeof llama, "%s/llama3.bin", tmpdir);
    FILE *f = fopen(llama, "wb");
    int32_t header[256] = {20240801, 7, 100};
    if (f) fwrite(header, sizeof header, 1, f), fwrite(header, 400, 1, f), fclose(f);
    r = TANDEM("train", "--model", "gpt", "--data", llama);
    CHECK(r->status == 1 && strstr(r->err, "20240801"), "Llama-3 shard: %d %s", r->status, r->err);
    r = TANDEM("train", "--model", "gpt", "--data", text_path, "--init-from", text_path);
    CHECK(r->status == 1 && strstr(r->err, "wrong magic"), "%d %s", r->status, r->err);
    /* --save is written at the end: an unwritable one is refused before any step */
    r = TANDEM("train", "--model", "gpt", "--data", text_path, "--save", "/nonexistent/m.bin");
    CHECK(r->status == 1 && strstr(r->err, "'/nonexistent' is not writable") &&
              !strstr(r->out, "step "),
          "--save in a missing directory: %d %s", r->status, r->err);
    r = TANDEM("train", "--model", "gpt", "--data", text_path, "--save", tmpdir);
    CHECK(r->status == 1 && strstr(r->err, "is a directory") && !strstr(r->out, "step "),
          "--save a directory: %d %s", r->status, r->err);
    r = TANDEM("train", "--help");
    CHECK(r->status == 0 && strstr(r->out, "--channels") && strstr(r->out, "--save"), "help");
}

/* --model-split: the GPT cut into pipeline stages (its embeddings, blocks and head; the head's
 * copy of wte tied to the embeddings'): 2 stages, and with --tensor-parallel 2 in each stage
 * (3-D: 2 stages x tp 2 on 4 devices, and 2 replicas of that on 8), each with 2 micro-batches,
 * clipped at 0.5 (the norm joined over the stages), learn what one device does, loss for loss,
 * weights within 1e-5 after 12 steps (the micro-batches sum in another order); the header
 * names the layout. (3 stages, and replicas
 * without TP: tests/test_pipeline.c.) */
static void test_pipeline(void) {
    char one[300], pp[300];
    snprintf(one, sizeof one, "%s/pp-one.bin", tmpdir);
    snprintf(pp, sizeof pp, "%s/pp.bin", tmpdir);
#define PP_RUN(...)                                                                                \
    TANDEM("train", "--model", "gpt", "--data", text_path, "--layers", "3", "--heads", "4",        \
           "--channels", "16", "--context", "8", "--batch-size", "8", "--max-steps", "12",         \
           "--workers", "0", "--print-every", "3", "--seed", "3", "--clip-grad", "0.5",            \
           __VA_ARGS__)
    double ref[4], got[4];
    result *r = PP_RUN("--save", one);
    CHECK(r->status == 0 && losses(r->out, ref, 4) == 4, "one device: %s", r->err);
    const char *devs[3] = {"2", "4", "8"}, *stages[3] = {"2", "2", "2"}, *tps[3] = {"1", "2", "2"};
    /* cut by parameters: the embeddings (wte, wpe) and the head (its wte) weigh a block and a
     * quarter each */
    const char *header[3] = {"2 pipeline stages, layers 0-1 2-4, 2 micro-batches, 1f1b)",
                             "layers 0-1 2-4, 2 micro-batches, 1f1b, each stage over tp 2)",
                             "1f1b, each stage over tp 2, 2 replicas)"};
    for (int k = 0; k < 3; k++) {
        r = PP_RUN("--devices", devs[k], "--model-split", stages[k], "--micro-batches", "2", "--tp",
                   tps[k], "--save", pp);
        int n = losses(r->out, got, 4);
        CHECK(r->status == 0 && n == 4 && strstr(r->out, header[k]),
              "--model-split %s --tp %s on %s: %s %s", stages[k], tps[k], devs[k], r->out, r->err);
        for (int i = 0; i < n; i++) CHECK_CLOSE(got[i], ref[i], 1e-4, 0);
        double dw = model_diff(pp, one);
        CHECK(dw <= 1e-5, "--model-split %s on %s devices: weights off by %g after 12 steps",
              stages[k], devs[k], dw);
    }
    r = PP_RUN("--devices", "6", "--model-split", "2", "--tp", "2");
    CHECK(r->status == 2 && strstr(r->err, "--tensor-parallel 2 with --model-split needs a "
                                           "multiple of 4 devices, --devices gives 6"),
          "6 devices at pp 2 x tp 2: %d %s", r->status, r->err);
    /* checkpoints: a pipeline stopped at step 6 resumed as itself, 3-D (stages over tp 2) on
     * one device, 2 replicas sharing each stage's moments (ZeRO stage 1) as 3-D replicas
     * sharing theirs: the stages' weights and AdamW moments whole in
     * the checkpoint (the moments dropped move the weights by 2e-3; the plain pipeline's other
     * ways and replicas: test_strategy, test_resume) */
    const char *stop[3][8] = {
        {"2", "2", "1", "2", "2", "1", "none", "none"},
        {"4", "2", "2", "1", "1", "1", "none", "none"},            /* 3-D: 2 stages x tp 2 */
        {"4", "2", "1", "8", "2", "2", "optimizer", "optimizer"}}; /* ZeRO-1 over replicas */
    for (int k = 0; k < 3; k++) {
        char dir[320];
        snprintf(dir, sizeof dir, "%s/pp-ck-%d", tmpdir, k);
        const char *const *c = stop[k];
        r = PP_RUN("--devices", c[0], "--model-split", c[1], "--tp", c[2], "--micro-batches", "2",
                   "--checkpoint-dir", dir, "--max-steps", "6", "--shard", c[6]);
        CHECK(r->status == 0 &&
                  (strcmp(c[6], "optimizer") ||
                   strstr(r->out, "each pipeline stage's over its 2 replicas (ZeRO stage 1")),
              "pipeline checkpoint case %d, first half: %s %s", k, r->out, r->err);
        r = PP_RUN("--devices", c[3], "--model-split", c[4], "--tp", c[5], "--micro-batches", "2",
                   "--checkpoint-dir", dir, "--resume", "--save", pp, "--shard", c[7]);
        int n = losses(r->out, got, 4);
        CHECK(r->status == 0 && n == 2 && strstr(r->out, "step 6"),
              "pipeline checkpoint case %d: %s %s", k, r->out, r->err);
        for (int i = 0; i < n; i++) CHECK_CLOSE(got[i], ref[2 + i], 1e-4, 0);
        double dw = model_diff(pp, one);
        CHECK(dw <= 1e-5, "pipeline checkpoint case %d: weights off by %g after 12 steps", k, dw);
    }
#undef PP_RUN
}

/* --tensor-parallel under mpirun (the processes' devices form the mesh): tp 2 on 2 processes,
 * dp 2 x tp 2 with ZeRO stage 3 on 4, and on 2 processes of 2 devices dp 2 x tp 2 and tp 4
 * learn what one device does, loss for loss, weights within the threads' bound; the dp 2 x
 * tp 2 run's checkpoint resumes on tp 2; what does not fit is refused naming the option. */
static void test_tensor_parallel_mpi(const char *mpirun) {
    char one[300], tp[300], ck[300];
    snprintf(one, sizeof one, "%s/mpi-one.bin", tmpdir);
    snprintf(tp, sizeof tp, "%s/mpi-tp.bin", tmpdir);
    snprintf(ck, sizeof ck, "%s/mpi-ck", tmpdir);
#define MPI_TP(np, steps, ...)                                                                     \
    run((const char *[]){"",                                                                       \
                         "--oversubscribe",                                                        \
                         "-np",                                                                    \
                         np,                                                                       \
                         tandem,                                                                   \
                         "train",                                                                  \
                         "--model",                                                                \
                         "gpt",                                                                    \
                         "--data",                                                                 \
                         text_path,                                                                \
                         "--layers",                                                               \
                         "2",                                                                      \
                         "--heads",                                                                \
                         "4",                                                                      \
                         "--channels",                                                             \
                         "16",                                                                     \
                         "--context",                                                              \
                         "8",                                                                      \
                         "--batch-size",                                                           \
                         "4",                                                                      \
                         "--max-steps",                                                            \
                         steps,                                                                    \
                         "--workers",                                                              \
                         "0",                                                                      \
                         "--print-every",                                                          \
                         "3",                                                                      \
                         "--seed",                                                                 \
                         "3",                                                                      \
                         "--clip-grad",                                                            \
                         "1",                                                                      \
                         __VA_ARGS__,                                                              \
                         NULL})
    double ref[4], got[4];
    result *r = TP_RUN("12", "--save", one);
    CHECK(r->status == 0 && losses(r->out, ref, 4) == 4, "one device: %s", r->err);
    snprintf(tandem_mpirun, sizeof tandem_mpirun, "%s", mpirun); /* run() starts mpirun now */
    r = MPI_TP("2", "12", "--tp", "2", "--save", tp);
    int n = losses(r->out, got, 4);
    CHECK(r->status == 0 && n == 4 && strstr(r->out, "mesh dp 1 x tp 2 over the processes"),
          "mpirun -np 2 --tp 2: %s %s", r->out, r->err);
    for (int i = 0; i < n; i++) CHECK_CLOSE(got[i], ref[i], 1e-4, 0);
    double dw = model_diff(tp, one);
    CHECK(dw <= 1e-5, "mpirun -np 2 --tp 2: weights off by %g after 12 steps", dw);
    /* dp 2 x tp 2 with ZeRO stage 3 stopped at step 6, resumed on tp 2 */
    r = MPI_TP("4", "6", "--tp", "2", "--shard", "parameters", "--checkpoint-dir", ck);
    n = losses(r->out, got, 2);
    CHECK(r->status == 0 && n == 2 && strstr(r->out, "mesh dp 2 x tp 2 over the processes") &&
              strstr(r->out, "ZeRO stage 3 over the data-parallel rows"),
          "mpirun -np 4 --tp 2 --shard parameters: %s %s", r->out, r->err);
    for (int i = 0; i < n; i++) CHECK_CLOSE(got[i], ref[i], 1e-4, 0);
    r = MPI_TP("2", "12", "--tp", "2", "--checkpoint-dir", ck, "--resume", "--save", tp);
    n = losses(r->out, got, 4);
    CHECK(r->status == 0 && n == 2 && strstr(r->out, "saved on 4 processes x 1 device, now 2 x 1"),
          "resumed on mpirun -np 2 --tp 2: %s %s", r->out, r->err);
    for (int i = 0; i < n; i++) CHECK_CLOSE(got[i], ref[2 + i], 1e-4, 0);
    dw = model_diff(tp, one);
    CHECK(dw <= 1e-5, "dp 2 x tp 2 resumed on tp 2: weights off by %g after 12 steps", dw);
    /* the rows' parts compared across the processes after each step: equal */
    r = MPI_TP("4", "2", "--tp", "2", "--check-replicas", "1");
    CHECK(r->status == 0 && strstr(r->out, "mesh dp 2 x tp 2 over the processes"),
          "mpirun -np 4 --tp 2 --check-replicas 2: %s %s", r->out, r->err);
    /* two devices a process: dp 2 x tp 2, tp inside each (tp 4 across both, each tp group
     * two-level: test_tensor_parallel_two_level) */
    const char *layouts[1][2] = {{"2", "mesh dp 2 x tp 2 over the processes"}};
    for (int k = 0; k < 1; k++) {
        r = MPI_TP("2", "12", "--tp", layouts[k][0], "--devices", "cpu:0,cpu:1", "--save", tp);
        n = losses(r->out, got, 4);
        CHECK(r->status == 0 && n == 4 && strstr(r->out, layouts[k][1]),
              "mpirun -np 2 --devices cpu:0,cpu:1 --tp %s: %s %s", layouts[k][0], r->out, r->err);
        for (int i = 0; i < n; i++) CHECK_CLOSE(got[i], ref[i], 1e-4, 0);
        dw = model_diff(tp, one);
        CHECK(dw <= 1e-5, "two devices a process, tp %s: weights off by %g after 12 steps",
              layouts[k][0], dw);
    }
    /* refused */
    r = MPI_TP("3", "2", "--tp", "2");
    CHECK(r->status == 2 && strstr(r->err, "--tensor-parallel 2 needs devices a multiple of 2, "
                                           "mpirun started 3 processes of 1"),
          "-np 3 --tp 2: exit %d: %s", r->status, r->err);
    r = MPI_TP("2", "2", "--tp", "2", "--devices", "3");
    CHECK(r->status == 2 && strstr(r->err, "a multiple or a divisor of 2 devices a process"),
          "--devices 3 under mpirun: exit %d: %s", r->status, r->err);
    tandem_mpirun[0] = '\0';
}

int main(int argc, char **argv) {
    ssize_t n = readlink("/proc/self/exe", tandem, sizeof tandem - 16);
    if (n <= 0 || tmpdir_make("test_gpt_cli") != 0) {
        perror("setup");
        return 1;
    }
    tandem[n] = '\0';
    strcpy(strrchr(tandem, '/') + 1, "tandem"); /* built beside this test */
    if (argc > 1) snprintf(tandem, sizeof tandem, "%s", argv[1]);
    CHECK(access(tandem, X_OK) == 0, "no tandem binary at %s", tandem);
    write_text();
    if (argc == 4 && !strcmp(argv[2], "--mpirun")) { /* its own CTest entry */
        test_tensor_parallel_mpi(argv[3]);
        tmpdir_remove();
        return check_summary();
    }
    test_train_and_save();
    test_two_devices();
    test_grad_accum();
    test_resume();
    test_shared_options();
    test_recompute();
    test_tensor_parallel();
    test_pipeline();
    test_sample();
    test_errors();
    tmpdir_remove();
    return check_summary();
}
