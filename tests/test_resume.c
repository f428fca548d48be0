/* Exact resume through the `tandem` command: a run of 2N steps and a run stopped after N steps
 * then resumed for N more end with byte-identical checkpoints (weights and training state),
 * for the MLP with SGD and the CNN with Adam and a cosine schedule, on 1 and 2 devices. Also:
 * keeping the last K checkpoints, `tandem eval` on a checkpoint, --init-from, killing the
 * trainer at random moments while it writes checkpoints, that the stop handler runs on a
 * stack of its own, and one run at a time per checkpoint directory (a second refused, fresh
 * runs needing --resume or --overwrite). Under mpirun (--mpirun), SIGTERM through mpirun and
 * --shard optimizer: its checkpoints are the unsharded run's byte for byte, and resume with
 * or without it; and resharding: runs stopped on one layout of processes x devices and
 * resumed on another end as the run never stopped (the same steps, data position and
 * counters, the weights within a stated float bound: RESHARD_REL).
 *
 *   test_resume PATH_TO_TANDEM [--signals | --resumes]   (the signal and lock cases, or the
 *                                                        rest; both without either)
 *
 * Needs Debian's dataset-fashion-mnist (skipped without it). */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>

#include "check.h"
#include "testdir.h"

static const char *tandem;
/* Starts tandem with args (NULL-terminated), its output captured (testdir.h). */
static pid_t start(const char *const *args) {
    const char *argv[64] = {tandem};
    for (int i = 0; args[i] && i < 62; i++) argv[i + 1] = args[i];
    return spawn_captured(argv);
}

/* Runs tandem to completion; returns its exit status (-1 for a crash). */
static int run(const char *const *args) {
    return wait_status(start(args));
}

/* Whether two checkpoint files are byte for byte the same, but for the identities of their
 * runs (two runs, by design: "run.id" in train_state.safetensors, 16 hex digits each). */
static bool same_file(const char *a, const char *b) {
    size_t na = 0, nb = 0;
    char *x = slurp_file(a, &na), *y = slurp_file(b, &nb);
    const char *key = "\"run.id\":\"";
    char *ix = x ? memmem(x, na, key, strlen(key)) : NULL;
    char *iy = y ? memmem(y, nb, key, strlen(key)) : NULL;
    if (ix && iy && na == nb && ix - x == iy - y) memcpy(iy, ix, strlen(key) + 16);
    bool eq = x && y && na == nb && na > 0 && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return eq;
}

#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})
#define COMMON    "--limit", "256", "--batch-size", "64", "--epochs", "3", "--quiet"

/* The last "test loss X acc Y%" of a trainer's or eval's output. */
static void last_test(const char *out, char *buf, size_t cap) {
    const char *p = NULL, *q = out;
    while ((q = strstr(q, "test loss ")) != NULL) p = q++;
    buf[0] = '\0';
    if (p) snprintf(buf, cap, "%.*s", (int)(strchr(p, '%') ? strchr(p, '%') - p : 0), p);
}

static bool same_ckpt(const char *a, const char *b, int64_t step);

/* A run of 12 steps against the same run stopped after 6 and resumed: the same checkpoint,
 * byte for byte, and tandem eval of it gives the run's last test result. The stopped run
 * shards with --shard `shard` (stage 3 over one process's CPU devices writes one shard file a
 * device, which tandem export makes the unsharded run's files, bit for bit). Both cut the
 * model into `split` pipeline stages (the stages' weights and optimizer state gathered whole
 * into the checkpoint and handed back on resume). */
static void exact_resume(const char *model, const char *devices, bool adam, const char *shard,
                         const char *split) {
    char a[300], b[300], fa[400];
    snprintf(a, sizeof a, "%s/%s-%s-%s-full", tmpdir, model, devices, split);
    snprintf(b, sizeof b, "%s/%s-%s-%s-split", tmpdir, model, devices, split);
    const char *opt = adam ? "adam" : "sgd", *sched = adam ? "cosine" : "constant";
    /* 12 steps (4 per epoch); checkpoints at 4, 8 and 12, of which 2 are kept */
    int rc = run(ARGS("train", "--model", model, "--devices", devices, "--optimizer", opt,
                      "--schedule", sched, COMMON, "--checkpoint-dir", a, "--checkpoint-every", "4",
                      "--keep", "2", "--model-split", split));
    char *err = captured("stderr");
    CHECK(rc == 0, "%s on %s: the full run failed (%d): %s", model, devices, rc, err);
    free(err);
    char *out = captured("stdout"), full_test[128];
    last_test(out, full_test, sizeof full_test);
    free(out);
    CHECK(count_ckpts(a) == 2, "--keep 2 leaves 2 checkpoints, found %d", count_ckpts(a));
    /* stopped after 6 steps, in the middle of epoch 2, then resumed (other worker count) */
    rc = run(ARGS("train", "--model", model, "--devices", devices, "--optimizer", opt, "--schedule",
                  sched, COMMON, "--checkpoint-dir", b, "--max-steps", "6", "--shard", shard,
                  "--model-split", split));
    CHECK(rc == 0, "%s on %s: the first half failed (%d)", model, devices, rc);
    rc = run(ARGS("train", "--model", model, "--devices", devices, "--optimizer", opt, "--schedule",
                  sched, COMMON, "--checkpoint-dir", b, "--resume", "--workers", "0", "--shard",
                  shard, "--model-split", split));
    err = captured("stderr");
    CHECK(rc == 0, "%s on %s, --shard %s: the resumed half failed (%d): %s", model, devices, shard,
          rc, err);
    free(err);
    CHECK(same_ckpt(a, b, 12),
          "%s on %s (%s, --shard %s): the resumed run's checkpoint differs from the full run's",
          model, devices, opt, shard);
    /* tandem eval on the final checkpoint reproduces the trainer's last test result */
    snprintf(fa, sizeof fa, "%s/ckpt-0000000012", a);
    rc = run(ARGS("eval", "--model", model, "--weights", fa, "--limit", "256"));
    out = captured("stdout");
    char eval_test[128];
    last_test(out, eval_test, sizeof eval_test);
    CHECK(rc == 0 && full_test[0] && strcmp(full_test, eval_test) == 0,
          "eval gives '%s', training gave '%s'", eval_test, full_test);
    free(out);
    /* and on the run's --checkpoint-dir: its newest checkpoint */
    rc = run(ARGS("eval", "--model", model, "--weights", a, "--limit", "256"));
    out = captured("stdout");
    last_test(out, eval_test, sizeof eval_test);
    CHECK(rc == 0 && strcmp(full_test, eval_test) == 0, "eval of the run's directory gives '%s'",
          eval_test);
    free(out);
    /* --resume of the finished run trains nothing: its epoch line has no speed to show */
    rc = run(ARGS("train", "--model", model, "--devices", devices, "--optimizer", opt, "--schedule",
                  sched, COMMON, "--checkpoint-dir", a, "--resume"));
    out = captured("stdout");
    CHECK(rc == 0 && strstr(out, "(trained before the resume)") && !strstr(out, "img/s"),
          "resuming a finished run: %d %s", rc, out);
    free(out);
}

static void init_from(void) {
    char w[400];
    snprintf(w, sizeof w, "%s/mlp-cpu:0-1-full/ckpt-0000000012/model.safetensors", tmpdir);
    CHECK(run(ARGS("train", "--model", "mlp", COMMON, "--epochs", "1", "--init-from", w)) == 0,
          "--init-from a checkpoint's weights");
    CHECK(run(ARGS("train", "--model", "cnn", COMMON, "--init-from", w)) == 1,
          "--init-from weights of another model fails");
    char *err = captured("stderr");
    CHECK(strstr(err, "--init-from") && strstr(err, "missing: 0.weight"),
          "names what is missing: %s", err);
    free(err);
    /* weights holding a NaN are named at the start, not blamed on the learning rate later */
    char nan_w[400];
    snprintf(nan_w, sizeof nan_w, "%s/nan.safetensors", tmpdir);
    tdm_rng rng = tdm_rng_make(1);
    tdm_module *m = tdm_model_new("mlp", tdm_cpu(0), &rng);
    tdm_paramset *ps = m ? tdm_module_parameters(m) : NULL;
    if (ps) ((float *)tdm_data_ptr(ps->flat))[ps->offsets[2] + 5] = NAN; /* in "3.weight" */
    CHECK(ps && tdm_weights_save(nan_w, m, NULL, 0) == TDM_OK, "NaN weights: %s", tdm_last_error());
    tdm_module_free(m);
    int nrc = run(ARGS("train", "--model", "mlp", COMMON, "--init-from", nan_w));
    char *nerr = captured("stderr");
    CHECK(nrc == 1 && strstr(nerr, "'3.weight' holds non-finite values") && !strstr(nerr, "--lr"),
          "NaN --init-from: %d %s", nrc, nerr);
    free(nerr);
    CHECK(run(ARGS("train", COMMON, "--init-from", "/nonexistent.safetensors")) == 1,
          "--init-from a missing file");
    CHECK(run(ARGS("train", COMMON, "--resume")) == 2, "--resume needs --checkpoint-dir");
    CHECK(run(ARGS("eval", "--model", "mlp")) == 2, "eval needs --weights");
    char *e2 = captured("stderr");
    CHECK(strstr(e2, "--weights"), "says --weights is required: %s", e2);
    free(e2);
}

/* Kills the trainer at random moments of a run that checkpoints every step; each time the
 * newest checkpoint must resume. The moments come from seed_moments. */
static void kill_during_checkpoint(void) {
    char dir[300];
    snprintf(dir, sizeof dir, "%s/killed", tmpdir);
    for (int round = 0; round < 3; round++) {
        pid_t pid = start(ARGS("train", "--model", "mlp", "--limit", "4096", "--batch-size", "16",
                               "--epochs", "1", "--quiet", "--checkpoint-dir", dir,
                               "--checkpoint-every", "1", "--keep", "2", "--resume"));
        struct timespec ts = {0, (long)(150 + rand() % 250) * 1000000L};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    int rc = run(ARGS("train", "--model", "mlp", "--limit", "4096", "--batch-size", "16",
                      "--epochs", "1", "--checkpoint-dir", dir, "--resume", "--max-steps", "257"));
    char *err = captured("stderr"), *out = captured("stdout");
    CHECK(rc == 0, "resuming after kills failed (%d): %s", rc, err);
    CHECK(strstr(out, "resume    ") != NULL || count_ckpts(dir) == 0, "resumed: %s", out);
    free(err);
    free(out);
}

/* A resume checks the options that shape the run (train_identity): another --batch-size or
 * --seed is refused with both values named; a new --lr is taken (and logged). */
static void checked_resume(void) {
    char dir[300], log[300];
    snprintf(dir, sizeof dir, "%s/checked", tmpdir);
    snprintf(log, sizeof log, "%s/checked.jsonl", tmpdir);
    CHECK(run(ARGS("train", COMMON, "--checkpoint-dir", dir, "--max-steps", "2")) == 0,
          "first part");
    int rc = run(ARGS("train", COMMON, "--checkpoint-dir", dir, "--resume", "--batch-size", "32",
                      "--seed", "3"));
    char *err = captured("stderr");
    CHECK(rc == 2 && strstr(err, "--batch-size 64 in the checkpoint, 32 now") &&
              strstr(err, "--seed 0 in the checkpoint, 3 now") &&
              strstr(err, "--batch-size is the global batch"),
          "resume with other options: %d %s", rc, err);
    free(err);
    rc = run(
        ARGS("train", COMMON, "--checkpoint-dir", dir, "--resume", "--lr", "0.05", "--log", log));
    size_t n = 0;
    char *text = slurp_file(log, &n);
    const char *step3 = text ? strstr(text, "\"global_step\":3,") : NULL;
    CHECK(rc == 0 && step3 && strstr(step3, "\"lr\":0.05,"), "--lr on resume: %d %s", rc,
          step3 ? step3 : "(no step 3)");
    free(text);
}

/* Starts `[launcher...] tandem args...` (launcher: NULL, or mpirun and its options). */
static pid_t start_with(const char *const *launcher, const char *const *args) {
    const char *argv[64];
    int n = 0;
    for (int i = 0; launcher && launcher[i]; i++) argv[n++] = launcher[i];
    argv[n++] = tandem;
    for (int i = 0; args[i] && n < 63; i++) argv[n++] = args[i];
    argv[n] = NULL;
    char out[200]; /* gone before the child starts: wait_for_steps must not see the last run's */
    snprintf(out, sizeof out, "%s/stdout", tmpdir);
    unlink(out);
    return spawn_captured(argv);
}

/* Waits (up to 60 s) until the captured stdout shows a step line: the trainer is training. */
/* Waits (up to a minute) for pid's captured output (`which`, in tmpdir: "stdout") to hold
 * `what`; false if pid ends first or it never does. */
static bool wait_for_output(pid_t pid, const char *which, const char *what) {
    for (int i = 0; i < 12000; i++) {
        char *out = captured(which);
        bool seen = strstr(out, what) != NULL;
        free(out);
        if (seen || waitpid(pid, NULL, WNOHANG) == pid) return seen;
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    return false;
}

static bool wait_for_steps(pid_t pid) {
    return wait_for_output(pid, "stdout", "  step ");
}

/* SIGTERM at a moment drawn from the seed, once the run is training: it stops with a
 * checkpoint and status 143, and --resume then ends with the checkpoint of a run never
 * stopped, byte for byte. launcher: NULL, or mpirun (the signal reaches every process through
 * it; they agree on one step). */
static void sigterm_resume(const char *const *launcher, const char *name, const char *const *opts) {
    char a[300], b[300], fa[400], fb[400];
    snprintf(a, sizeof a, "%s/term-%s-full", tmpdir, name);
    snprintf(b, sizeof b, "%s/term-%s-split", tmpdir, name);
    const char *args[40];
    int n = 0;
    for (int i = 0; opts[i]; i++) args[n++] = opts[i];
    /* a line a step shows the run has started; under mpirun fewer, since a stopping mpirun
     * stops reading its processes' output and a full pipe would hold rank 0 up */
    args[n++] = "--print-every", args[n++] = launcher ? "32" : "1", args[n++] = "--checkpoint-dir";
    args[n++] = a, args[n] = NULL;
    int rc = wait_status(start_with(launcher, args));
    CHECK(rc == 0, "%s: the full run failed (%d)", name, rc);
    args[n - 1] = b;
    pid_t pid = start_with(launcher, args);
    bool training = wait_for_steps(pid);
    struct timespec ts = {0, (long)(rand() % 100) * 1000000L};
    nanosleep(&ts, NULL);
    kill(pid, SIGTERM);
    rc = wait_status(pid);
    char *out = captured("stdout"), *err = captured("stderr");
    /* under mpirun the ranks exit 143 and mpirun itself 1; a stopping mpirun may no longer
     * pass on what rank 0 prints */
    CHECK(training && rc == (launcher ? 1 : 143) && (launcher || strstr(out, "stopped   by ")) &&
              count_ckpts(b) == 1,
          "%s: SIGTERM: exit %d, %d checkpoints, output ends %s, stderr %s", name, rc,
          count_ckpts(b), strlen(out) > 300 ? out + strlen(out) - 300 : out, err);
    free(out);
    free(err);
    args[n++] = "--resume", args[n] = NULL;
    rc = wait_status(start_with(launcher, args));
    CHECK(rc == 0, "%s: the resumed run failed (%d)", name, rc);
    char path[400];
    int64_t last = 0;
    CHECK(tdm_checkpoint_latest(a, path, sizeof path, &last) == 1, "%s: no final checkpoint", name);
    for (int f = 0; f < 2; f++) {
        const char *file = f ? "train_state.safetensors" : "model.safetensors";
        snprintf(fa, sizeof fa, "%s/ckpt-%010lld/%s", a, (long long)last, file);
        snprintf(fb, sizeof fb, "%s/ckpt-%010lld/%s", b, (long long)last, file);
        CHECK(same_file(fa, fb), "%s: %s after SIGTERM and --resume differs from the full run's",
              name, file);
    }
}

#if defined(__x86_64__)
/* Sends sig to the calling thread while its stack pointer is sp, as oneDNN's JIT GEMM kernels
 * run: they point rsp into a workspace they malloc'd. The signal is delivered as the syscall
 * returns, with rsp still there. */
static void signal_self_on_stack(char *sp, int sig) {
    long pid = getpid(), tid = syscall(SYS_gettid), nr = SYS_tgkill;
    __asm__ volatile("mov %%rsp, %%r12\n\t"
                     "mov %[sp], %%rsp\n\t"
                     "syscall\n\t"
                     "mov %%r12, %%rsp"
                     : "+a"(nr)
                     : "D"(pid), "S"(tid), "d"((long)sig), [sp] "r"(sp)
                     : "rcx", "r11", "r12", "memory");
}
#endif

/* A SIGTERM that arrives while a GEMM kernel runs on a heap workspace (see above) must not
 * write its signal frame below that stack pointer: the frame (some 3 KiB with the vector
 * registers) landed on malloc's chunk headers there, and the trainer died of "corrupted size
 * vs. prev_size" instead of saving its checkpoint. In a child, so that the signal's
 * disposition and the stop flag stay this process's own. */
static void handler_stack(void) {
#if defined(__x86_64__)
    pid_t pid = fork();
    if (pid == 0) {
        enum { SIZE = 1 << 17, BELOW = 1 << 16 };
        unsigned char *buf = malloc(SIZE);
        if (!buf || tdm_stop_on_signals() != TDM_OK) _exit(3);
        memset(buf, 0xa5, SIZE);
        signal_self_on_stack((char *)buf + BELOW, SIGTERM);
        int clobbered = 0;
        for (int i = 0; i < BELOW; i++) clobbered += buf[i] != 0xa5;
        _exit(tdm_stop_requested() != SIGTERM ? 2 : clobbered ? 1 : 0);
    }
    int rc = wait_status(pid);
    CHECK(rc == 0, "the stop handler ran on the interrupted code's stack (%d: %s)", rc,
          rc == 1   ? "bytes below it were overwritten"
          : rc == 2 ? "no stop recorded"
                    : "no handler");
#endif
}

/* The seed of the moments of the kill and signal tests, printed (TANDEM_TEST_SEED=S replays). */
static void seed_moments(void) {
    const char *given = getenv("TANDEM_TEST_SEED");
    unsigned seed = given ? (unsigned)strtoul(given, NULL, 10) : (unsigned)time(NULL);
    printf("moments of the kills and signals: TANDEM_TEST_SEED=%u\n", seed);
    srand(seed);
}

#define SIG_MLP "--model", "mlp", "--limit", "8192", "--batch-size", "16", "--workers", "1"

/* Under mpirun, a stop late in the last epoch (--max-steps 901 of 1024; a SIGTERM lands there
 * only now and then): the resumed processes continue their own epoch totals, so that the
 * final checkpoint's are the full run's bit for bit (a sum of the two processes' sums, saved
 * and taken up by rank 0, was rounded elsewhere: 0x1.9d53a2p+13 for 0x1.9d53a4p+13). After
 * sigterm_resume's full run. */
static void mpi_stop_late(const char *const *mpi) {
    char a[300], b[300], fa[400], fb[400];
    snprintf(a, sizeof a, "%s/term-mpi-full", tmpdir);
    snprintf(b, sizeof b, "%s/late-mpi-split", tmpdir);
    int rc = wait_status(start_with(mpi, ARGS("train", SIG_MLP, "--epochs", "2", "--timeout", "20",
                                              "--checkpoint-dir", b, "--max-steps", "901")));
    CHECK(rc == 0 && count_ckpts(b) == 1, "mpi --max-steps 901: exit %d", rc);
    rc = wait_status(start_with(mpi, ARGS("train", SIG_MLP, "--epochs", "2", "--timeout", "20",
                                          "--checkpoint-dir", b, "--resume")));
    CHECK(rc == 0, "mpi: resumed after --max-steps 901: exit %d", rc);
    for (int f = 0; f < 2; f++) {
        const char *file = f ? "train_state.safetensors" : "model.safetensors";
        snprintf(fa, sizeof fa, "%s/ckpt-%010d/%s", a, 1024, file);
        snprintf(fb, sizeof fb, "%s/ckpt-%010d/%s", b, 1024, file);
        CHECK(same_file(fa, fb), "mpi: %s after --max-steps 901 and --resume differs", file);
    }
}

static void sigterm_all(const char *mpirun) {
    char text[300];
    snprintf(text, sizeof text, "%s/term.txt", tmpdir);
    FILE *f = fopen(text, "w");
    for (int i = 0; f && i < 400; i++) fprintf(f, "line %d of a small text to learn from\n", i);
    if (f) fclose(f);
    if (mpirun) {
        const char *const mpi[] = {mpirun, "--oversubscribe", "-np", "2", NULL};
        sigterm_resume(mpi, "mpi", ARGS("train", SIG_MLP, "--epochs", "2", "--timeout", "20"));
        mpi_stop_late(mpi);
        /* a directory in use: rank 0 cannot take it, and every rank stops (none waits for it) */
        char dir[300];
        snprintf(dir, sizeof dir, "%s/mpi-locked", tmpdir);
        tdm_checkpoint_lock *held = tdm_checkpoint_lock_dir(dir, "test_resume");
        int rc = wait_status(
            start_with(mpi, ARGS("train", COMMON, "--timeout", "20", "--checkpoint-dir", dir)));
        char *err = captured("stderr");
        CHECK(held && rc == 2 && strstr(err, "is in use by test_resume pid ") &&
                  count_ckpts(dir) == 0,
              "mpirun into a directory in use: exit %d, %s", rc, err);
        free(err);
        tdm_checkpoint_unlock(held);
        return;
    }
    sigterm_resume(NULL, "mlp", ARGS("train", SIG_MLP));
    sigterm_resume(NULL, "mlp-2-devices", ARGS("train", SIG_MLP, "--devices", "2"));
    /* four epochs: one (484 steps of 0.1 ms on an Intel Xeon) could end before the signal */
    sigterm_resume(NULL, "gpt",
                   ARGS("train", "--model", "gpt", "--data", text, "--layers", "1", "--channels",
                        "16", "--context", "8", "--batch-size", "4", "--workers", "0", "--epochs",
                        "4"));
}

/* The path of checkpoint step's model.safetensors (state false) or train_state.safetensors
 * in dir, into out: a sharded checkpoint's made whole first by tdm_checkpoint_export (the
 * files tandem export writes) beside dir, so that it compares with an unsharded run's. */
static void whole_file(const char *dir, int64_t step, bool state, char *out, size_t cap) {
    char ckpt[400], layout[440];
    snprintf(ckpt, sizeof ckpt, "%s/ckpt-%010lld", dir, (long long)step);
    snprintf(layout, sizeof layout, "%s/layout.safetensors", ckpt);
    snprintf(out, cap, "%s/%s", ckpt, state ? "train_state.safetensors" : "model.safetensors");
    if (access(layout, F_OK) != 0) return;
    snprintf(out, cap, "%s.whole-%lld-%s.safetensors", dir, (long long)step,
             state ? "state" : "model");
    CHECK(tdm_checkpoint_export(ckpt, state ? NULL : out, state ? out : NULL) == TDM_OK,
          "export of the sharded checkpoint %s: %s", ckpt, tdm_last_error());
}

/* Whether the checkpoints of step `step` in dirs a and b are the same, byte for byte (but for
 * their runs' identities): the weights and the training state (a sharded one's made whole). */
static bool same_ckpt(const char *a, const char *b, int64_t step) {
    bool same = true;
    for (int f = 0; f < 2; f++) {
        char fa[400], fb[400];
        whole_file(a, step, f, fa, sizeof fa);
        whole_file(b, step, f, fb, sizeof fb);
        same = same && same_file(fa, fb);
    }
    return same;
}

/* ---- resharding: a run resumed on other processes or devices ------------------------------- */

/* The bound on the weights and optimizer moments of a run stopped on one layout (processes x
 * devices) and resumed on another, against the run never stopped, after the 2-5 steps these
 * tests take after the resume: max |resumed - uninterrupted| over each tensor at most
 * RESHARD_REL times the tensor's largest |value|. Those steps reduce the same global batch in
 * another order (a rank-ordered sum of per-rank means, or one GEMM over the batch), so each
 * gradient element differs by a few float32 ulps (eps 1.2e-7) and each step adds a rounding of
 * the weight; momentum and Adam's moments carry the differences on. Observed in these resumes:
 * 3.1e-7 at most (3-4 ulps). Larger jumps come where a ReLU's input sits at its kink or Adam
 * divides by a gradient near 0: a 1-process and a 2-process run of all 6 steps of ZERO_RUN
 * differ by 2.7e-5. A step on other data moves the weights by about 1e-2 of the largest value
 * (two runs on other data: 0.1-0.3), so the bound, 1e-4, is 300x what these resumes show,
 * some 4x a whole run on another count, and 100x below one wrong batch. */
#define RESHARD_REL 1e-4

/* Over the f32 tensors of safetensors files fa and fb (the same names and shapes): the largest
 * max|a - b| / max|a| of a tensor, and through *worst_abs the largest |a - b|; -1 when the files
 * differ in names or shapes, or cannot be read. */
static double max_rel_diff(const char *fa, const char *fb, double *worst_abs) {
    tdm_safetensors *a = tdm_safetensors_open(fa), *b = tdm_safetensors_open(fb);
    double worst = a && b && tdm_safetensors_count(a) == tdm_safetensors_count(b) ? 0 : -1;
    *worst_abs = 0;
    for (int i = 0; worst >= 0 && i < tdm_safetensors_count(a); i++) {
        const char *name = tdm_safetensors_name(a, i);
        tdm_dtype dt;
        if (tdm_safetensors_tdm_dtype(a, i, &dt) || dt != TDM_F32) continue;
        tdm_tensor *x = tdm_safetensors_load(a, name, tdm_cpu(0));
        tdm_tensor *y = tdm_safetensors_load(b, name, tdm_cpu(0));
        bool same = x && y && x->ndim == y->ndim &&
                    !memcmp(x->shape, y->shape, sizeof(int64_t) * (size_t)x->ndim);
        int64_t n = same ? tdm_numel(x) : -1;
        float *px = n >= 0 ? malloc(sizeof(float) * (size_t)(2 * n + 1)) : NULL;
        float *py = px ? px + n : NULL;
        if (!px || tdm_to_host(x, px, sizeof(float) * (size_t)n) ||
            tdm_to_host(y, py, sizeof(float) * (size_t)n))
            worst = -1;
        double d = 0, m = 0;
        for (int64_t j = 0; worst >= 0 && j < n; j++) {
            d = fmax(d, fabs((double)px[j] - (double)py[j]));
            m = fmax(m, fabs((double)px[j]));
        }
        if (worst >= 0) worst = fmax(worst, m > 0 ? d / m : d > 0 ? INFINITY : 0);
        *worst_abs = fmax(*worst_abs, d);
        free(px);
        tdm_tensor_free(x);
        tdm_tensor_free(y);
    }
    tdm_safetensors_close(a);
    tdm_safetensors_close(b);
    return worst;
}

/* Whether the positions and counters of two train_state files are the same (the step, the
 * optimizer's steps and learning rate, the data position, the RNG); else what differs, in why. */
static bool same_counters(const char *fa, const char *fb, char *why, size_t cap) {
    static const char *const keys[] = {
        "step",         "optim.steps", "optim.lr",  "loader.epoch", "loader.global_sample",
        "loader.batch", "rng.seed",    "rng.offset"};
    tdm_safetensors *a = tdm_safetensors_open(fa), *b = tdm_safetensors_open(fb);
    snprintf(why, cap, "%s", a && b ? "" : tdm_last_error());
    for (size_t i = 0; a && b && i < sizeof keys / sizeof keys[0] && !why[0]; i++) {
        const char *va = tdm_safetensors_meta(a, keys[i]), *vb = tdm_safetensors_meta(b, keys[i]);
        if (!va || !vb || strcmp(va, vb) != 0)
            snprintf(why, cap, "%s %s against %s", keys[i], va ? va : "(none)", vb ? vb : "(none)");
    }
    tdm_safetensors_close(a);
    tdm_safetensors_close(b);
    return !why[0];
}

/* The step records of a --log file: at[g] = epoch * 1000 + step of global step g (0: none,
 * g < cap); returns how many records there are. */
static int logged_steps(const char *log, int *at, int cap) {
    char *text = slurp_file(log, NULL), *p = text;
    int n = 0, e, k, g;
    memset(at, 0, sizeof(int) * (size_t)cap);
    while (p && (p = strstr(p, "{\"type\":\"step\",")) != NULL) {
        if (sscanf(p, "{\"type\":\"step\",\"epoch\":%d,\"step\":%d,\"global_step\":%d,", &e, &k,
                   &g) == 3 &&
            g >= 0 && g < cap)
            at[g] = e * 1000 + k, n++;
        p++;
    }
    free(text);
    return n;
}

/* The train_loss and train_acc that a --log file records for epoch e; false when it has none. */
static bool logged_epoch(const char *log, int e, double *loss, double *acc) {
    char *text = slurp_file(log, NULL), key[64];
    snprintf(key, sizeof key, "{\"type\":\"epoch\",\"epoch\":%d,", e);
    const char *p = text ? strstr(text, key) : NULL;
    bool got = p && sscanf(p + strlen(key), "\"train_loss\":%lf,\"train_acc\":%lf", loss, acc) == 2;
    free(text);
    return got;
}

/* A run stopped after `stop` steps and resumed on another layout (dir, its resumed part's log)
 * against the run never stopped (ref, its log): the same last step, counters and data position
 * (exactly), weights and optimizer moments within RESHARD_REL, the resumed part taking exactly
 * the steps after `stop`, each at the epoch and step of the epoch the uninterrupted run had
 * there, and the same epoch lines (loss to float rounding, accuracy exactly). */
static void check_resharded(const char *name, const char *ref, const char *ref_log, const char *dir,
                            const char *log, int stop) {
    char path[400], fa[440], fb[440], why[200];
    int64_t last = -1, last_ref = -2;
    tdm_checkpoint_latest(ref, path, sizeof path, &last_ref);
    tdm_checkpoint_latest(dir, path, sizeof path, &last);
    CHECK(last == last_ref, "%s: the last checkpoint is at step %lld, the uninterrupted run's %lld",
          name, (long long)last, (long long)last_ref);
    whole_file(ref, last_ref, true, fa, sizeof fa);
    whole_file(dir, last_ref, true, fb, sizeof fb);
    CHECK(same_counters(fa, fb, why, sizeof why), "%s: %s", name, why);
    double opt_abs, w_abs, opt = max_rel_diff(fa, fb, &opt_abs);
    whole_file(ref, last_ref, false, fa, sizeof fa);
    whole_file(dir, last_ref, false, fb, sizeof fb);
    double w = max_rel_diff(fa, fb, &w_abs);
    printf("%s: max |diff| weights %.3g (%.3g of a tensor's largest), optimizer state %.3g "
           "(%.3g)\n",
           name, w_abs, w, opt_abs, opt);
    CHECK(w >= 0 && w <= RESHARD_REL && opt >= 0 && opt <= RESHARD_REL,
          "%s: weights differ by %.3g of a tensor's largest value, the optimizer state by %.3g "
          "(bound %g)",
          name, w, opt, RESHARD_REL);
    int at[64], at_ref[64], n = logged_steps(log, at, 64), bad = 0;
    logged_steps(ref_log, at_ref, 64);
    for (int g = 1; g < 64; g++) bad += at[g] != (g > stop && g <= last_ref ? at_ref[g] : 0);
    CHECK(n == last_ref - stop && bad == 0,
          "%s: the resumed run took %d steps (%lld expected), %d at another place", name, n,
          (long long)last_ref - stop, bad);
    for (int e = 1; e < 10; e++) {
        double loss, acc, loss_ref, acc_ref;
        if (!logged_epoch(log, e, &loss, &acc)) continue;
        CHECK(logged_epoch(ref_log, e, &loss_ref, &acc_ref) &&
                  fabs(loss - loss_ref) <= 1e-5 * loss_ref && acc == acc_ref,
              "%s: epoch %d: train loss %.7g acc %.7g, uninterrupted %.7g %.7g", name, e, loss, acc,
              loss_ref, acc_ref);
    }
}

#define ZERO_RUN                                                                                   \
    "train", "--limit", "288", "--batch-size", "48", "--epochs", "2", "--optimizer", "adam",       \
        "--weight-decay", "0.01", "--grad-accum", "2", "--clip-grad", "0.5", "--workers", "1",     \
        "--timeout", "20"

/* A checkpoint of 2 processes from before the global data position (its "run.layout" renamed
 * in place: the header keeps its length) resumes on 2 processes only: one is refused, naming
 * both counts. From zero_resume's copy of a sharded run stopped at step 2 (dir "<half>-old"). */
static void older_checkpoint(const char *half) {
    char path[400];
    snprintf(path, sizeof path, "%s-old/ckpt-0000000002/train_state.safetensors", half);
    size_t n = 0;
    char *bytes = slurp_file(path, &n);
    char *key = bytes ? memmem(bytes, n, "\"user.run.layout\"", 17) : NULL;
    FILE *f = key ? fopen(path, "wb") : NULL;
    if (key) key[15] = 'X';
    CHECK(f && fwrite(bytes, 1, n, f) == n && fclose(f) == 0, "rewriting %s", path);
    free(bytes);
    snprintf(path, sizeof path, "%s-old", half);
    int rc = wait_status(
        start_with(NULL, ARGS(ZERO_RUN, "--checkpoint-dir", path, "--quiet", "--resume")));
    char *err = captured("stderr");
    CHECK(rc == 2 && strstr(err, "this checkpoint was written by 2 processes before tandem saved "
                                 "the data position over every process; it resumes only on 2 "
                                 "(mpirun -np 2), not on 1"),
          "an older checkpoint of 2 processes resumed on 1: exit %d, %s", rc, err);
    free(err);
}

#define RESHARD_RUN                                                                                \
    "train", "--limit", "300", "--batch-size", "48", "--epochs", "2", "--workers", "1",            \
        "--timeout", "20"

/* One process (no mpirun) stopped in the middle of epoch 2 (step 9 of 14: 7 an epoch, the last
 * of 12 samples, 4 on each of 3 processes), resumed on 3 processes: as the uninterrupted
 * one-process run. SGD with momentum. */
static void reshard_one_to_three(const char *const np[4][5]) {
    char full[300], full_log[320], dir[300], log[320];
    snprintf(full, sizeof full, "%s/reshard-1-full", tmpdir);
    snprintf(full_log, sizeof full_log, "%s.jsonl", full);
    snprintf(dir, sizeof dir, "%s/reshard-1", tmpdir);
    snprintf(log, sizeof log, "%s.jsonl", dir);
    int rc = wait_status(start_with(
        NULL, ARGS(RESHARD_RUN, "--checkpoint-dir", full, "--quiet", "--log", full_log)));
    int rc2 = wait_status(start_with(
        NULL, ARGS(RESHARD_RUN, "--checkpoint-dir", dir, "--quiet", "--max-steps", "9")));
    int rc3 = wait_status(
        start_with(np[3], ARGS(RESHARD_RUN, "--checkpoint-dir", dir, "--resume", "--log", log)));
    char *out = captured("stdout"), *err = captured("stderr");
    CHECK(rc == 0 && rc2 == 0 && rc3 == 0 &&
              strstr(out, "epoch 2, step 2 of the epoch, 9 steps done; saved on 1 process x 1 "
                          "device, now 3 x 1"),
          "1 process stopped at step 9, resumed on 3: exit %d, %d and %d: %s%s", rc, rc2, rc3, out,
          err);
    free(out);
    free(err);
    check_resharded("1 process -> 3", full, full_log, dir, log, 9);
}

/* 2 processes x 2 devices stopped at the end of epoch 1 (step 3: the global position is the
 * epoch's end), resumed on 3 processes of one device: as the uninterrupted 2 x 2 run (dp_plain,
 * its log dp_log). */
static void reshard_dp(const char *const np[4][5], const char *dp_plain, const char *dp_log) {
    char dir[300], log[320];
    snprintf(dir, sizeof dir, "%s/reshard-2x2", tmpdir);
    snprintf(log, sizeof log, "%s.jsonl", dir);
    int rc = wait_status(start_with(np[2], ARGS(ZERO_RUN, "--devices", "2", "--checkpoint-dir", dir,
                                                "--quiet", "--max-steps", "3")));
    int rc2 = wait_status(
        start_with(np[3], ARGS(ZERO_RUN, "--checkpoint-dir", dir, "--resume", "--log", log)));
    char *out = captured("stdout"), *err = captured("stderr");
    CHECK(rc == 0 && rc2 == 0 &&
              strstr(out, "epoch 1, step 3 of the epoch, 3 steps done; saved on 2 processes x 2 "
                          "devices, now 3 x 1"),
          "2 x 2 stopped at step 3, resumed on 3: exit %d and %d: %s%s", rc, rc2, out, err);
    free(out);
    free(err);
    check_resharded("2 processes x 2 devices -> 3", dp_plain, dp_log, dir, log, 3);
}

/* --shard parameters (ZeRO stage 3) under mpirun -np 2 (plain: the unsharded run with one batch
 * a step, its log plain_log): its checkpoints are the unsharded run's byte for byte, its model
 * whole in tandem export; stopped at step 5, it resumes on 3 processes (the layout of each
 * rank's parameters read from the two shard files) as the uninterrupted run. */
static void zero3_runs(const char *const np[4][5], const char *plain, const char *plain_log) {
    char sharded[300], half[300], log[320], ckpt[400], exported[440], want[400];
    snprintf(sharded, sizeof sharded, "%s/zero3-sharded", tmpdir);
    snprintf(half, sizeof half, "%s/zero3-half", tmpdir);
    snprintf(log, sizeof log, "%s.jsonl", half);
    int rc = wait_status(start_with(np[2], ARGS(ZERO_RUN, "--grad-accum", "1", "--checkpoint-dir",
                                                sharded, "--shard", "parameters")));
    char *out = captured("stdout");
    CHECK(rc == 0 &&
              strstr(out, "gradients and parameters 470336 bytes per rank of 940584 (ZeRO "
                          "stage 3 over 2 ranks; parameters gathered in f32)") &&
              same_ckpt(plain, sharded, 12),
          "--shard parameters: exit %d, no stage 3 line, or a checkpoint differs from "
          "unsharded: %s",
          rc, out);
    free(out);
    snprintf(ckpt, sizeof ckpt, "%s/ckpt-0000000012", sharded);
    snprintf(exported, sizeof exported, "%s.exported.safetensors", sharded);
    snprintf(want, sizeof want, "%s/ckpt-0000000012/model.safetensors", plain);
    rc = run(ARGS("export", ckpt, exported));
    CHECK(rc == 0 && same_file(exported, want), "tandem export %s: exit %d, or not %s", ckpt, rc,
          want);
    rc = wait_status(
        start_with(np[2], ARGS(ZERO_RUN, "--grad-accum", "1", "--checkpoint-dir", half, "--quiet",
                               "--shard", "parameters", "--max-steps", "5")));
    int rc2 =
        wait_status(start_with(np[3], ARGS(ZERO_RUN, "--grad-accum", "1", "--checkpoint-dir", half,
                                           "--shard", "parameters", "--resume", "--log", log)));
    out = captured("stdout");
    CHECK(rc == 0 && rc2 == 0 && strstr(out, "saved on 2 processes x 1 device, now 3 x 1") != NULL,
          "--shard parameters stopped at step 5 on 2 processes, resumed on 3: exit %d and %d: %s",
          rc, rc2, out);
    free(out);
    check_resharded("stage 3, 2 processes -> 3", plain, plain_log, half, log, 5);
    /* in bf16, the gathers move bf16 (FSDP2's param_dtype), and with --reduce-dtype bf16 the
     * gradients too (test_ddp checks the values) */
    snprintf(half, sizeof half, "%s/zero3-bf16", tmpdir);
    rc = wait_status(start_with(np[2], ARGS(ZERO_RUN, "--grad-accum", "1", "--checkpoint-dir", half,
                                            "--shard", "parameters", "--precision", "bf16",
                                            "--reduce-dtype", "bf16", "--max-steps", "2")));
    out = captured("stdout");
    CHECK(rc == 0 && strstr(out, "(ZeRO stage 3 over 2 ranks; parameters gathered in bf16, as "
                                 "FSDP2's param_dtype)"),
          "--shard parameters --precision bf16 under mpirun: exit %d, or no bf16 gathers: %s", rc,
          out);
    free(out);
}

/* --shard gradients (ZeRO stage 2) under mpirun -np 2, DDP (one device a process) and
 * DataParallel (two: 4 ranks on the two-level group): with one batch a step its checkpoints
 * are the unsharded run's byte for byte (weights and gathered optimizer state); with
 * --grad-accum 2 (each batch's average added into the shard) it trains to the end. Each
 * reports its shard of the gradients. 12 steps of 48 samples. Then stage 3: DDP's
 * (zero3_runs), and DataParallel's, whose one file is the unsharded run's byte for byte. */
static void zero2_runs(const char *const np[4][5]) {
    const char *const *np2 = np[2];
    for (int devs = 1; devs <= 2; devs++) {
        char plain[300], plain_log[320], sharded[300], accum[300], want[160];
        const char *dv = devs == 1 ? "1" : "2";
        snprintf(plain, sizeof plain, "%s/zero2-plain-%d", tmpdir, devs);
        snprintf(plain_log, sizeof plain_log, "%s.jsonl", plain);
        snprintf(sharded, sizeof sharded, "%s/zero2-sharded-%d", tmpdir, devs);
        snprintf(accum, sizeof accum, "%s/zero2-accum-%d", tmpdir, devs);
        int rc = wait_status(
            start_with(np2, ARGS(ZERO_RUN, "--grad-accum", "1", "--devices", dv, "--checkpoint-dir",
                                 plain, "--quiet", "--log", plain_log)));
        int rc2 =
            wait_status(start_with(np2, ARGS(ZERO_RUN, "--grad-accum", "1", "--devices", dv,
                                             "--checkpoint-dir", sharded, "--shard", "gradients")));
        char *out = captured("stdout"), *err = captured("stderr");
        snprintf(want, sizeof want,
                 "gradients %d bytes per rank of 940584 (ZeRO stage 2 over %d "
                 "ranks)",
                 devs == 1 ? 470336 : 235200, 2 * devs);
        CHECK(rc == 0 && rc2 == 0 && strstr(out, want) && same_ckpt(plain, sharded, 12),
              "%d process x %d devices, --shard gradients: exit %d and %d, no \"%s\", or a "
              "checkpoint differs from unsharded: %s\n%s",
              2, devs, rc, rc2, want, out, err);
        free(out), free(err);
        rc = wait_status(start_with(np2, ARGS(ZERO_RUN, "--devices", dv, "--checkpoint-dir", accum,
                                              "--quiet", "--shard", "gradients")));
        CHECK(rc == 0, "2 processes x %d devices, --shard gradients --grad-accum 2: exit %d", devs,
              rc);
        if (devs == 1) {
            zero3_runs(np, plain, plain_log);
            continue;
        }
        /* stage 3 over the 4 replicas of DataParallel across processes, a shard file each,
         * stopped at step 5 and resumed (each replica reading its pieces): as the unsharded
         * run, byte for byte */
        char stage3[300];
        snprintf(stage3, sizeof stage3, "%s/zero3-dp", tmpdir);
        rc = wait_status(start_with(np2, ARGS(ZERO_RUN, "--grad-accum", "1", "--devices", "2",
                                              "--checkpoint-dir", stage3, "--shard", "parameters",
                                              "--quiet", "--max-steps", "5")));
        int rc3 = wait_status(
            start_with(np2, ARGS(ZERO_RUN, "--grad-accum", "1", "--devices", "2",
                                 "--checkpoint-dir", stage3, "--shard", "parameters", "--resume")));
        out = captured("stdout");
        CHECK(rc == 0 && rc3 == 0 &&
                  strstr(out, "(ZeRO stage 3 over 4 ranks; parameters gathered in f32)") &&
                  same_ckpt(plain, stage3, 12),
              "2 processes x 2 devices, --shard parameters stopped at step 5 and resumed: exit %d "
              "and %d, or the last checkpoint differs from the uninterrupted run's: %s",
              rc, rc3, out);
        free(out);
        /* DataParallel across processes averages in bf16 when asked (its replicas' DDPs) */
        char low[300];
        snprintf(low, sizeof low, "%s/dp-bf16", tmpdir);
        int rc4 = wait_status(start_with(np2, ARGS(ZERO_RUN, "--grad-accum", "1", "--devices", "2",
                                                   "--checkpoint-dir", low, "--quiet",
                                                   "--reduce-dtype", "bf16", "--max-steps", "2")));
        CHECK(rc4 == 0, "2 processes x 2 devices, --reduce-dtype bf16: exit %d", rc4);
    }
}

/* `tandem eval --weights dir` of a broken sharded checkpoint (mlp, or model): exits 1 and says
 * want on stderr. */
static void eval_refuses(const char *dir, const char *model, const char *want, const char *what) {
    int rc = run(ARGS("eval", "--weights", dir, "--model", model, "--limit", "48"));
    char *err = captured("stderr");
    CHECK(rc == 1 && strstr(err, want), "eval of a sharded checkpoint with %s: exit %d, %s", what,
          rc, err);
    free(err);
}

/* A sharded checkpoint (2 processes, step 2, copies "<half>-bad" and "<half>-fail"): a missing
 * and a truncated shard file, and a layout that is not the model's, are refused naming the
 * file; a save where rank 1 cannot write its shard leaves no new checkpoint, every process
 * saying which rank failed. */
static void sharded_failures(const char *half, const char *const np2[5]) {
    char ckpt[400], shard[460], cmd[1500], want[520];
    snprintf(ckpt, sizeof ckpt, "%s-bad/ckpt-0000000002", half);
    snprintf(shard, sizeof shard, "%s/shard-00001-of-00002.safetensors", ckpt);
    int rc = run(ARGS("eval", "--weights", ckpt, "--limit", "48"));
    CHECK(rc == 0, "eval of a sharded checkpoint: exit %d", rc);
    eval_refuses(ckpt, "cnn", "does not match the model", "another model");
    snprintf(cmd, sizeof cmd, "mv '%s' '%s.away'", shard, shard);
    CHECK(system(cmd) == 0, "%s", cmd);
    snprintf(want, sizeof want, "%s", shard);
    eval_refuses(ckpt, "mlp", want, "a missing shard");
    snprintf(cmd, sizeof cmd, "mv '%s.away' '%s' && truncate -s -100 '%s'", shard, shard, shard);
    CHECK(system(cmd) == 0, "%s", cmd);
    eval_refuses(ckpt, "mlp", want, "a truncated shard");
    char dir[400], tmp[460];
    snprintf(dir, sizeof dir, "%s-fail", half);
    setenv("TANDEM_TEST_FAIL_SHARD_RANK", "1", 1);
    rc = wait_status(start_with(np2, ARGS(ZERO_RUN, "--checkpoint-dir", dir, "--quiet", "--shard",
                                          "optimizer", "--resume", "--max-steps", "4")));
    unsetenv("TANDEM_TEST_FAIL_SHARD_RANK");
    char *err = captured("stderr");
    snprintf(tmp, sizeof tmp, "%s/.ckpt-0000000004.tmp", dir);
    CHECK(rc == 1 && tdm_checkpoint_list(dir, NULL, 0) == 1 && access(tmp, F_OK) != 0 &&
              strstr(err, "rank 1: checkpoint: injected failure") &&
              strstr(err, "rank 0: checkpoint at step 4: 1 process failed (rank 1: writing "
                          "shard-00001-of-00002.safetensors); no checkpoint was written"),
          "a save where rank 1 fails: exit %d, %d checkpoints, stderr %s", rc,
          tdm_checkpoint_list(dir, NULL, 0), err);
    free(err);
}

/* --shard optimizer (ZeRO stage 1) under mpirun, one device per process (DDP) and two
 * (DataParallel): its checkpoints are the unsharded run's byte for byte (the weights, and the
 * state gathered from the shards); a sharded checkpoint resumes
 * unsharded and an unsharded one sharded, ending as the uninterrupted run; a sharded one
 * resumes on 1 and on 3 processes. 2 epochs of 3 steps (2 batches each). */
static void zero_resume(const char *mpirun) {
    const char *const np[4][5] = {{0},
                                  {mpirun, "--oversubscribe", "-np", "1", NULL},
                                  {mpirun, "--oversubscribe", "-np", "2", NULL},
                                  {mpirun, "--oversubscribe", "-np", "3", NULL}};
    char plain[300], plain_log[320], sharded[300], half[2][300], cmd[1400];
    snprintf(plain, sizeof plain, "%s/zero-plain", tmpdir);
    snprintf(plain_log, sizeof plain_log, "%s.jsonl", plain);
    snprintf(sharded, sizeof sharded, "%s/zero-sharded", tmpdir);
    int rc = wait_status(start_with(
        np[2], ARGS(ZERO_RUN, "--checkpoint-dir", plain, "--quiet", "--log", plain_log)));
    CHECK(rc == 0, "unsharded mpi run: exit %d", rc);
    rc = wait_status(start_with(np[2], ARGS(ZERO_RUN, "--checkpoint-dir", sharded, "--shard",
                                            "optimizer", "--print-every", "3")));
    char *out = captured("stdout");
    CHECK(rc == 0 && strstr(out, "sharding  optimizer state 940672 bytes per rank of 1881168 "
                                 "(ZeRO stage 1 over 2 ranks)"),
          "sharded mpi run: exit %d, output %s", rc, out);
    free(out);
    CHECK(same_ckpt(plain, sharded, 6), "--shard optimizer: a checkpoint differs from unsharded");
    /* 2 devices in each process (DataParallel on the two-level group): sharded over all 4 */
    char dp_plain[300], dp_log[320], dp_sharded[300];
    snprintf(dp_plain, sizeof dp_plain, "%s/zero-dp-plain", tmpdir);
    snprintf(dp_log, sizeof dp_log, "%s.jsonl", dp_plain);
    snprintf(dp_sharded, sizeof dp_sharded, "%s/zero-dp-sharded", tmpdir);
    rc = wait_status(start_with(np[2], ARGS(ZERO_RUN, "--devices", "2", "--checkpoint-dir",
                                            dp_plain, "--quiet", "--log", dp_log)));
    int rc2 = wait_status(start_with(np[2], ARGS(ZERO_RUN, "--devices", "2", "--checkpoint-dir",
                                                 dp_sharded, "--shard", "optimizer")));
    out = captured("stdout");
    CHECK(rc == 0 && rc2 == 0 &&
              strstr(out, "sharding  optimizer state 470400 bytes per rank of 1881168 "
                          "(ZeRO stage 1 over 4 ranks)") &&
              same_ckpt(dp_plain, dp_sharded, 6),
          "2 processes x 2 devices, --shard optimizer: exit %d and %d, or a checkpoint differs "
          "from unsharded: %s",
          rc, rc2, out);
    free(out);
    /* stopped after 2 steps: sharded, then resumed unsharded; and the other way round */
    for (int i = 0; i < 2; i++) {
        snprintf(half[i], sizeof half[i], "%s/zero-half-%d", tmpdir, i);
        const char *first = i ? "none" : "optimizer", *then = i ? "optimizer" : "none";
        rc = wait_status(start_with(np[2], ARGS(ZERO_RUN, "--checkpoint-dir", half[i], "--quiet",
                                                "--shard", first, "--max-steps", "2")));
        if (i == 0) { /* copies for the resumes on 1 and 3 processes */
            snprintf(cmd, sizeof cmd,
                     "for p in np1 np2 np3 old bad fail; do cp -r '%s' '%s'-$p; done", half[0],
                     half[0]);
            CHECK(rc == 0 && system(cmd) == 0, "a sharded run stopped at step 2: exit %d", rc);
        }
        rc = wait_status(start_with(np[2], ARGS(ZERO_RUN, "--checkpoint-dir", half[i], "--quiet",
                                                "--shard", then, "--resume")));
        CHECK(rc == 0 && same_ckpt(plain, half[i], 6),
              "--shard %s stopped, resumed with --shard %s: exit %d, or the last checkpoint "
              "differs from the uninterrupted run's",
              first, then, rc);
    }
    /* on another number of processes, from the sharded checkpoint at step 2 (mid-epoch 1):
     * unsharded on 1, sharded on 3; each continues as the uninterrupted run */
    for (int p = 1; p <= 3; p++) {
        char dir[320], log[340], name[64];
        snprintf(dir, sizeof dir, "%s-np%d", half[0], p);
        snprintf(log, sizeof log, "%s.jsonl", dir);
        snprintf(name, sizeof name, "2 processes sharded -> %d %s", p,
                 p == 1 ? "unsharded" : "sharded");
        rc = wait_status(
            start_with(np[p], ARGS(ZERO_RUN, "--checkpoint-dir", dir, "--shard",
                                   p == 1 ? "none" : "optimizer", "--resume", "--log", log)));
        char *said = captured("stdout"), *err = captured("stderr");
        CHECK(rc == 0 && strstr(said, p == 2 ? "epoch 1, step 2 of the epoch, 2 steps done\n"
                                             : "epoch 1, step 2 of the epoch, 2 steps done; "
                                               "saved on 2 processes x 1 device, now "),
              "%s: exit %d: %s%s", name, rc, said, err);
        free(said);
        free(err);
        check_resharded(name, plain, plain_log, dir, log, 2);
        if (p != 2) continue;
        CHECK(same_ckpt(plain, dir, 6), "%s: not the uninterrupted run's", name);
        /* tandem export: the model.safetensors of the unsharded run, bit for bit */
        char ckpt[400], exported[440], want[400];
        snprintf(ckpt, sizeof ckpt, "%s/ckpt-0000000006", dir);
        snprintf(exported, sizeof exported, "%s.exported.safetensors", dir);
        snprintf(want, sizeof want, "%s/ckpt-0000000006/model.safetensors", plain);
        rc = run(ARGS("export", ckpt, exported));
        CHECK(rc == 0 && same_file(exported, want), "tandem export %s: exit %d, or not %s", ckpt,
              rc, want);
    }
    sharded_failures(half[0], np[2]);
    older_checkpoint(half[0]);
    reshard_dp(np, dp_plain, dp_log);
    reshard_one_to_three(np);
    zero2_runs(np);
}

/* Whether every checkpoint of dir has one run identity (written into id), and how many. */
static bool one_run(const char *dir, char *id, size_t cap, int *n) {
    int64_t steps[64];
    *n = tdm_checkpoint_list(dir, steps, 64);
    bool same = *n > 0;
    id[0] = '\0';
    for (int i = 0; i < *n && i < 64 && same; i++) {
        char path[400], this[64] = "";
        snprintf(path, sizeof path, "%s/ckpt-%010lld", dir, (long long)steps[i]);
        same = tdm_checkpoint_run_id(path, this, sizeof this) == 1 && (!i || !strcmp(this, id));
        snprintf(id, cap, "%s", this);
    }
    return same;
}

#define LONG_RUN(dir)                                                                              \
    "train", SIG_MLP, "--epochs", "100", "--print-every", "1", "--checkpoint-every", "20",         \
        "--keep", "2", "--checkpoint-dir", dir

/* A checkpoint directory belongs to one run at a time: a second run is refused naming the
 * holder and changes nothing; a fresh run into a directory with checkpoints is refused until
 * --resume or --overwrite; pruning leaves another run's checkpoint alone; and a run killed
 * with -9 leaves a LOCK file that blocks nobody. */
static void one_run_per_dir(void) {
    char dir[300], other[300], id[64], id2[64], expect[600], path[400];
    snprintf(dir, sizeof dir, "%s/shared", tmpdir);
    snprintf(other, sizeof other, "%s/other", tmpdir);
    pid_t a = start_with(NULL, ARGS(LONG_RUN(dir)));
    CHECK(wait_for_steps(a), "the first run trains");
    /* its output kept apart: each run below captures into tmpdir/stdout anew */
    char out_path[300], first_path[300];
    snprintf(out_path, sizeof out_path, "%s/stdout", tmpdir);
    snprintf(first_path, sizeof first_path, "%s/stdout.first", tmpdir);
    CHECK(rename(out_path, first_path) == 0, "keeping the first run's output: %s", strerror(errno));
    snprintf(expect, sizeof expect,
             "checkpoint directory '%s' is in use by tandem train pid %d on host ", dir, (int)a);
    /* (--max-steps: should one get in, it ends soon) */
    const char *const *second[] = {ARGS(LONG_RUN(dir), "--max-steps", "5"),
                                   ARGS(LONG_RUN(dir), "--resume", "--max-steps", "5"),
                                   ARGS("train", COMMON, "--checkpoint-dir", dir, "--overwrite")};
    for (int i = 0; i < 3; i++) {
        int rc = wait_status(start_with(NULL, second[i]));
        char *err = captured("stderr"), *out = captured("stdout");
        CHECK(rc == 2 && strstr(err, expect) && !strstr(out, "step "),
              "second run %d into a directory in use: exit %d, stderr %s", i, rc, err);
        free(err);
        free(out);
    }
    /* past its first checkpoint (step 20), so that its stop saves a second: the refused runs
     * above may all be done before it gets there */
    CHECK(wait_for_output(a, "stdout.first", "  step 21/"), "the first run reaches step 21");
    kill(a, SIGTERM);
    int rc = wait_status(a), n = 0;
    CHECK(rc == 143 && one_run(dir, id, sizeof id, &n) && n == 2,
          "the first run ends as it would alone: exit %d, %d checkpoints of one run %s", rc, n, id);
    int64_t last = 0;
    CHECK(tdm_checkpoint_latest(dir, path, sizeof path, &last) == 1, "a checkpoint");

    /* a fresh run into it: refused, listing the checkpoints and the two ways on */
    rc = run(ARGS("train", COMMON, "--checkpoint-dir", dir));
    char *err = captured("stderr");
    snprintf(expect, sizeof expect, "ckpt-%010lld; the newest at step %lld", (long long)last,
             (long long)last);
    CHECK(rc == 2 && strstr(err, "already holds 2 checkpoints of an earlier run") &&
              strstr(err, expect) && strstr(err, "--resume") && strstr(err, "--overwrite"),
          "a fresh run into a used directory: exit %d, %s", rc, err);
    free(err);
    int64_t now = 0;
    CHECK(tdm_checkpoint_latest(dir, path, sizeof path, &now) == 1 && now == last &&
              one_run(dir, id2, sizeof id2, &n) && n == 2 && !strcmp(id, id2),
          "the refused run changed nothing");

    /* --resume continues it, under its identity; pruning spares another run's checkpoint */
    CHECK(run(ARGS("train", SIG_MLP, "--checkpoint-dir", other, "--max-steps", "1", "--quiet")) ==
              0,
          "another run");
    char cmd[800];
    snprintf(cmd, sizeof cmd, "cp -r '%s/ckpt-0000000001' '%s/'", other, dir);
    CHECK(system(cmd) == 0, "%s", cmd);
    char max[32];
    snprintf(max, sizeof max, "%lld", (long long)last + 6);
    rc = run(ARGS(LONG_RUN(dir), "--resume", "--max-steps", max, "--checkpoint-every", "1"));
    char *out = captured("stdout");
    snprintf(path, sizeof path, "%s/ckpt-0000000001", dir);
    CHECK(rc == 0 && strstr(out, "resume    ") && count_ckpts(dir) == 3 &&
              tdm_checkpoint_run_id(path, id2, sizeof id2) == 1 && strcmp(id, id2) != 0,
          "resumed with another run's checkpoint beside: exit %d, %d checkpoints", rc,
          count_ckpts(dir));
    free(out);
    CHECK(tdm_checkpoint_latest(dir, path, sizeof path, &now) == 1 && now == last + 6 &&
              tdm_checkpoint_run_id(path, id2, sizeof id2) == 1 && !strcmp(id, id2),
          "the resumed run keeps its identity: step %lld, run %s (was %s)", (long long)now, id2,
          id);

    /* --overwrite starts over: only the new run's checkpoints are left */
    rc = run(ARGS("train", COMMON, "--checkpoint-dir", dir, "--overwrite"));
    CHECK(rc == 0 && one_run(dir, id2, sizeof id2, &n) && n == 1 && strcmp(id, id2) != 0 &&
              tdm_checkpoint_latest(dir, path, sizeof path, &now) == 1 && now == 12,
          "--overwrite: exit %d, %d checkpoints of run %s, newest %lld", rc, n, id2,
          (long long)now);
    CHECK(run(ARGS("train", COMMON, "--checkpoint-dir", dir, "--overwrite", "--resume")) == 2,
          "--overwrite and --resume exclude each other");
    CHECK(run(ARGS("train", COMMON, "--overwrite")) == 2, "--overwrite needs --checkpoint-dir");

    /* a run killed with -9 leaves LOCK naming it; the next run is not blocked */
    char killed[300], lock[400];
    snprintf(killed, sizeof killed, "%s/killed9", tmpdir);
    snprintf(lock, sizeof lock, "%s/LOCK", killed);
    pid_t k = start_with(NULL, ARGS(LONG_RUN(killed)));
    CHECK(wait_for_steps(k), "the run to kill trains");
    kill(k, SIGKILL);
    waitpid(k, NULL, 0);
    char *text = slurp_file(lock, NULL);
    snprintf(expect, sizeof expect, "tandem train pid %d on host ", (int)k);
    CHECK(text && strstr(text, expect), "the killed run's LOCK stays: %s", text ? text : "(none)");
    free(text);
    rc = run(ARGS(LONG_RUN(killed), "--resume", "--max-steps", "25"));
    err = captured("stderr");
    CHECK(rc == 0, "a stale LOCK blocks nobody: exit %d, %s", rc, err);
    free(err);
}

int main(int argc, char **argv) {
    bool half = argc == 3 && (!strcmp(argv[2], "--signals") || !strcmp(argv[2], "--resumes"));
    if (argc != 2 && !half && !(argc == 4 && strcmp(argv[2], "--mpirun") == 0)) {
        fprintf(stderr,
                "usage: test_resume PATH_TO_TANDEM [--signals | --resumes | --mpirun MPIRUN]\n");
        return 2;
    }
    tandem = argv[1];
    handler_stack();
    if (access("/usr/share/datasets/fashion-mnist", R_OK) != 0) {
        printf("skipped: dataset-fashion-mnist is not installed\n");
        return 77; /* CTest's SKIP_RETURN_CODE: not a pass */
    }
    if (tmpdir_make("test_resume") != 0) return 1;
    seed_moments();
    if (argc == 4) { /* test_resume_mpi: SIGTERM through mpirun, and --shard optimizer */
        sigterm_all(argv[3]);
        zero_resume(argv[3]);
        tmpdir_remove();
        return check_summary();
    }
    /* CTest runs the two halves as two tests, side by side */
    const char *part = argc == 3 ? argv[2] : "all";
    if (strcmp(part, "--resumes") != 0) {
        sigterm_all(NULL);
        one_run_per_dir();
    }
    if (strcmp(part, "--signals") != 0) {
        exact_resume("mlp", "cpu:0", false, "none", "1");
        exact_resume("mlp", "cpu:0,cpu:1", false, "parameters", "1");
        exact_resume("mlp", "cpu:0,cpu:1", true, "none", "2"); /* a pipeline */
        exact_resume("cnn", "cpu:0", true, "none", "1");
        exact_resume("cnn", "cpu:0,cpu:1", true, "none", "1");
        init_from();
        checked_resume();
        kill_during_checkpoint();
    }
    tmpdir_remove();
    return check_summary();
}
