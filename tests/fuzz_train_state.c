/* Fuzz target for a checkpoint's train_state.safetensors, which --resume reads back: the
 * bytes become the training state of a scratch checkpoint ckpt-0000000003 whose
 * model.safetensors (Sequential(Linear(2, 2)): "0.weight" [2, 2], "0.bias" [2]) is written
 * once, then tdm_checkpoint_load restores a model, an Adam optimizer, a loader (8 samples in
 * batches of 2) and a generator from it. Any bytes must give either a state within its
 * ranges (step 3, the directory's; optimizer steps >= 0; a finite learning rate >= 0; a
 * loader epoch >= 0 at a batch start) or an error saying why, with the
 * model, optimizer and loader left as they were; never a crash, a leak or a changed file.
 *
 * Built like tests/fuzz_safetensors.c: `fuzz_train_state` (libFuzzer, -DTANDEM_FUZZ=ON) and
 * `fuzz_train_state_replay` (every build; CTest replays tests/fuzz/train_state_corpus, whose
 * seeds tests/fuzz/make_seeds.py writes).
 */
#include "fuzz_common.h"

#include <math.h>

#include "tandem/tandem.h"

static char dir[256], ckpt[300], model_file[340], state_file[340];
static char *model_bytes;
static size_t model_len;
static tdm_module *model;
static tdm_optim *opt;
static tdm_dataset *ds;
static tdm_loader *loader;
static tdm_rng rng;

static void remove_scratch(void) {
    unlink(model_file), unlink(state_file), rmdir(ckpt), rmdir(dir);
    free(model_bytes);
    tdm_loader_free(loader);
    tdm_dataset_free(ds);
    tdm_optim_free(opt);
    tdm_module_free(model);
}

/* The weights that every input is restored onto, and a memory dataset's loader. */
static void setup(void) {
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(dir, sizeof dir, "%s/tandem-fuzz-state-XXXXXX",
             access("/dev/shm", W_OK) == 0 ? "/dev/shm" : tmp);
    if (!mkdtemp(dir)) abort();
    snprintf(ckpt, sizeof ckpt, "%s/ckpt-0000000003", dir);
    snprintf(model_file, sizeof model_file, "%s/model.safetensors", ckpt);
    snprintf(state_file, sizeof state_file, "%s/train_state.safetensors", ckpt);
    if (mkdir(ckpt, 0755) != 0) abort();
    atexit(remove_scratch);
    rng = tdm_rng_make(1);
    tdm_module *layers[1] = {tdm_linear_new(2, 2, true, tdm_cpu(0), &rng)};
    model = tdm_sequential_new(1, layers);
    tdm_adam_opts ao = tdm_adam_defaults();
    opt = model ? tdm_adam_new(tdm_module_parameters(model), &ao) : NULL;
    float x[16] = {0};
    int64_t y[8] = {0, 1, 0, 1, 0, 1, 0, 1};
    ds = tdm_memory_dataset(TDM_SHAPE(2), 8, x, y, 2);
    tdm_loader_opts lo = tdm_loader_defaults(2);
    lo.workers = 0;
    loader = ds ? tdm_loader_new(ds, &lo) : NULL;
    if (!opt || !loader || tdm_weights_save(model_file, model, NULL, 0) != TDM_OK) abort();
    model_bytes = fuzz_read_all(model_file, &model_len);
}

/* Whether the restored state is one a run could have saved at step 3. The moments' values
 * are the caller's to judge (the trainer refuses non-finite ones: test_ckpt_fields). */
static bool restored_in_range(const tdm_train_state *s) {
    int64_t epoch = -1, batch = -1;
    tdm_loader_position(loader, &epoch, &batch);
    float lr = tdm_optim_lr(opt);
    return s->step == 3 && tdm_optim_steps(opt) >= 0 && isfinite(lr) && lr >= 0 && epoch >= 0 &&
           batch >= 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!*dir) setup();
    FILE *f = fopen(state_file, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0) abort();
    tdm_train_state s = {.model = model, .optim = opt, .loader = loader, .rng = &rng};
    int64_t steps = tdm_optim_steps(opt);
    int rc = tdm_checkpoint_load(ckpt, &s);
    if (rc == TDM_OK && !restored_in_range(&s)) abort(); /* accepted out of range */
    if (rc != TDM_OK && ((rc != TDM_ERR_FORMAT && rc != TDM_ERR_IO) || !*tdm_last_error() ||
                         tdm_optim_steps(opt) != steps))
        abort(); /* refused: saying why, with the optimizer as it was */
    size_t n;
    char *now = fuzz_read_all(model_file, &n);
    if (n != model_len || memcmp(now, model_bytes, n)) abort();
    free(now);
    tdm_clear_error();
    return 0;
}
