/* Fuzz target for a sharded checkpoint's layout.safetensors, which `tandem export` reads with
 * no model to check it against: the bytes become the layout of a scratch checkpoint whose
 * other files (the shard files of 1 and of 2 ranks, the buffers, the training state: a model
 * of "0.weight" [3, 3] and "0.bias" [3], 12 elements) are made once, then
 * tdm_checkpoint_export writes its model and state into scratch outputs. Any bytes must give
 * either two readable outputs or an error saying why (TDM_ERR_FORMAT, _IO or _ARG), never a
 * crash, a leak, an out-of-bounds read, a changed checkpoint file or a temporary file left.
 *
 * Built like tests/fuzz_safetensors.c: `fuzz_layout` (libFuzzer, -DTANDEM_FUZZ=ON) and
 * `fuzz_layout_replay` (every build; CTest replays tests/fuzz/layout_corpus, whose seeds
 * tests/fuzz/make_seeds.py writes).
 */
#include "fuzz_common.h"
#include "tandem/io.h"

#define TOTAL     12
#define MAX_FILES 6

static char dir[256], ckpt[300], layout[340], out_model[340], out_state[340];
static char files[MAX_FILES][400]; /* the checkpoint's files but the layout, and their bytes */
static char *bytes[MAX_FILES];
static size_t lens[MAX_FILES];
static int n_files;

static void save(const char *name, const tdm_named_tensor *ts, int n, const tdm_meta *meta,
                 int n_meta) {
    snprintf(files[n_files], sizeof files[0], "%s/%s", ckpt, name);
    if (tdm_safetensors_save(files[n_files], ts, n, meta, n_meta) != TDM_OK) abort();
    bytes[n_files] = fuzz_read_all(files[n_files], &lens[n_files]);
    n_files++;
}

/* Shard file r of world: its range [lo, hi) of "params" and of Adam's two states. */
static void make_shard(int r, int world, int64_t lo, int64_t hi) {
    float v[TOTAL];
    for (int i = 0; i < TOTAL; i++) v[i] = (float)i + 0.5f;
    tdm_tensor *t = tdm_from_data(TDM_SHAPE(hi - lo), TDM_F32, tdm_cpu(0), v + lo);
    tdm_named_tensor ts[3] = {{"params", t}, {"optim.exp_avg", t}, {"optim.exp_avg_sq", t}};
    char l[24], h[24], name[64];
    snprintf(l, sizeof l, "%lld", (long long)lo), snprintf(h, sizeof h, "%lld", (long long)hi);
    snprintf(name, sizeof name, "shard-%05d-of-%05d.safetensors", r, world);
    tdm_meta meta[2] = {{"shard.lo", l}, {"shard.hi", h}};
    save(name, ts, 3, meta, 2);
}

static void remove_scratch(void) {
    unlink(out_model), unlink(out_state), unlink(layout);
    for (int i = 0; i < n_files; i++) unlink(files[i]), free(bytes[i]);
    rmdir(ckpt), rmdir(dir);
}

/* The scratch checkpoint, in memory (/dev/shm) where there is one: export flushes each file. */
static void setup(void) {
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(dir, sizeof dir, "%s/tandem-fuzz-layout-XXXXXX",
             access("/dev/shm", W_OK) == 0 ? "/dev/shm" : tmp);
    if (!mkdtemp(dir)) abort();
    snprintf(ckpt, sizeof ckpt, "%s/ckpt", dir);
    snprintf(layout, sizeof layout, "%s/layout.safetensors", ckpt);
    snprintf(out_model, sizeof out_model, "%s/model.safetensors", dir);
    snprintf(out_state, sizeof out_state, "%s/state.safetensors", dir);
    if (mkdir(ckpt, 0755) != 0) abort();
    atexit(remove_scratch);
    tdm_scope_begin();
    make_shard(0, 1, 0, TOTAL);
    make_shard(0, 2, 0, 5);
    make_shard(1, 2, 5, TOTAL);
    float mean[3] = {0.1f, 0.2f, 0.3f};
    tdm_named_tensor buf = {"1.running_mean",
                            tdm_from_data(TDM_SHAPE(3), TDM_F32, tdm_cpu(0), mean)};
    save("buffers.safetensors", &buf, 1, NULL, 0);
    tdm_meta state[2] = {{"step", "3"}, {"optim.kind", "adam"}};
    save("train_state.safetensors", NULL, 0, state, 2);
    tdm_scope_end();
}

/* The entries of the outputs' directory: the checkpoint directory and the outputs only. */
static int entries(void) {
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    while (d && (e = readdir(d)) != NULL) n += e->d_name[0] != '.';
    if (d) closedir(d);
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!*dir) setup();
    FILE *f = fopen(layout, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0) abort();
    int rc = tdm_checkpoint_export(ckpt, out_model, out_state);
    if (rc == TDM_OK) {
        tdm_safetensors *m = tdm_safetensors_open(out_model), *s = tdm_safetensors_open(out_state);
        if (!m || !s || entries() != 3) abort(); /* exported: both outputs read back */
        tdm_safetensors_close(m), tdm_safetensors_close(s);
    } else if ((rc != TDM_ERR_FORMAT && rc != TDM_ERR_IO && rc != TDM_ERR_ARG) ||
               !*tdm_last_error() || entries() != 1) {
        abort(); /* refused: saying why, with nothing written */
    }
    for (int i = 0; i < n_files; i++) { /* the checkpoint as it was */
        size_t n;
        char *now = fuzz_read_all(files[i], &n);
        if (n != lens[i] || memcmp(now, bytes[i], n)) abort();
        free(now);
    }
    unlink(out_model), unlink(out_state);
    tdm_clear_error();
    return 0;
}
