/* `tandem export` on checkpoints it must not trust, and outputs that must not damage them
 * (issue 36): a sharded checkpoint's layout.safetensors tampered with (a parameter's offset
 * past the data, a shape whose element count overflows, names repeated or empty, counts out of
 * range) is refused naming the field and its value; an output inside the checkpoint, a hard
 * link to one of its files and both outputs on one path are refused naming both paths; a
 * header of more JSON values than the reader's limit is refused naming the limit. Each exits 1
 * and leaves every file of the checkpoint, and an output already there, as it was.
 *
 *   test_export PATH_TO_TANDEM
 *
 * Trains on Debian's dataset-fashion-mnist (skipped, 77, without it). */
#define _GNU_SOURCE
#include <sys/stat.h>

#include "check.h"
#include "testdir.h"
#include "io/io_internal.h"

static const char *tandem;
static char sharded[300], whole[300]; /* the checkpoints: ckpt-0000000002 of each run */

/* A directory's files and their bytes, to compare before and after a command. */
typedef struct {
    int n;
    char name[16][256];
    char *bytes[16];
    size_t len[16];
} snapshot;

static snapshot snap(const char *dir) {
    snapshot s = {0};
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL && s.n < 16) {
        char p[400];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(p, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        snprintf(s.name[s.n], sizeof s.name[0], "%s", e->d_name);
        s.bytes[s.n] = slurp_file(p, &s.len[s.n]);
        s.n++;
    }
    if (d) closedir(d);
    return s;
}

/* Whether b has the files of a with the same bytes, and no other. */
static bool snap_same(const snapshot *a, const snapshot *b) {
    if (a->n != b->n) return false;
    for (int i = 0; i < a->n; i++) {
        int j = 0;
        while (j < b->n && strcmp(a->name[i], b->name[j])) j++;
        if (j == b->n || !a->bytes[i] || !b->bytes[j] || a->len[i] != b->len[j] ||
            memcmp(a->bytes[i], b->bytes[j], a->len[i]))
            return false;
    }
    return true;
}

static void snap_free(snapshot *s) {
    for (int i = 0; i < s->n; i++) free(s->bytes[i]);
}

/* tandem export ARGS...: the exit status, stderr into *err (the caller frees). */
static int export_run(const char *ckpt, const char *out, const char *state_out, char **err) {
    const char *argv[] = {tandem, "export", ckpt, out, state_out, NULL};
    int rc = wait_status(spawn_captured(argv));
    *err = captured("stderr");
    return rc;
}

/* Runs export, which must exit 1 saying want, with the checkpoint directory ckpt and the file
 * `keep` (an output already there; may be NULL) unchanged. */
static void refused(const char *what, const char *ckpt, const char *out, const char *state_out,
                    const char *keep, const char *want) {
    snapshot before = snap(ckpt);
    char *kept = keep ? slurp_file(keep, NULL) : NULL;
    char *err;
    int rc = export_run(ckpt, out, state_out, &err);
    snapshot after = snap(ckpt);
    char *now = keep ? slurp_file(keep, NULL) : NULL;
    CHECK(rc == 1 && strstr(err, want), "%s: exit %d, stderr '%s', expected '%s'", what, rc, err,
          want);
    CHECK(before.n > 0 && snap_same(&before, &after), "%s: the checkpoint %s changed", what, ckpt);
    CHECK(!keep || (kept && now && !strcmp(kept, now)), "%s: the output %s changed", what, keep);
    free(err), free(kept), free(now);
    snap_free(&before), snap_free(&after);
}

/* Runs `tandem train ARGS... --checkpoint-dir tmpdir/name` for 2 steps; its checkpoint into
 * ckpt. */
static bool train(const char *name, const char *shard, char *ckpt, size_t cap) {
    char dir[200];
    snprintf(dir, sizeof dir, "%s/%s", tmpdir, name);
    const char *argv[] = {tandem,    "train",     "--model",     "mlp",     "--optimizer",
                          "adam",    "--devices", "cpu:0,cpu:1", "--shard", shard,
                          "--limit", "256",       "--max-steps", "2",       "--checkpoint-dir",
                          dir,       "--quiet",   NULL};
    int rc = wait_status(spawn_captured(argv));
    char *err = captured("stderr");
    CHECK(rc == 0, "tandem train --shard %s: exit %d: %s", shard, rc, err);
    free(err);
    snprintf(ckpt, cap, "%s/ckpt-0000000002", dir);
    return rc == 0;
}

/* ---- a tampered layout -------------------------------------------------------------------- */

/* The sharded checkpoint's layout.safetensors rewritten (with the library's writer) with key's
 * value replaced, or added. */
static void layout_write(const char *orig, const char *key, const char *value) {
    tdm_safetensors *f = tdm_safetensors_open(orig);
    CHECK(f, "opening %s: %s", orig, tdm_last_error());
    if (!f) return;
    int n = tdm_safetensors_meta_count(f), k = 0;
    tdm_meta *meta = calloc((size_t)n + 1, sizeof *meta);
    for (int i = 0; i < n; i++) {
        tdm_safetensors_meta_at(f, i, &meta[i].key, &meta[i].value);
        if (!strcmp(meta[i].key, key)) meta[i].value = value, k = 1;
    }
    if (!k) meta[n++] = (tdm_meta){key, value};
    char path[400];
    snprintf(path, sizeof path, "%s/layout.safetensors", sharded);
    CHECK(tdm_safetensors_save(path, NULL, 0, meta, n) == TDM_OK, "writing %s: %s", path,
          tdm_last_error());
    free(meta);
    tdm_safetensors_close(f);
}

/* The MLP's layout (784-256-128-10, 235146 parameters in 6 tensors, 2 ranks), each case one
 * field changed: refused naming the field and the value, the checkpoint and the state output
 * already there unchanged, the model output not written. */
static void test_tampered_layouts(void) {
    static const struct {
        const char *key, *value, *want;
    } cases[] = {
        {"param.1", "9000000000000000000 1 256 1.bias",
         "layout.safetensors': param.1 offset 9000000000000000000 + 256 elements is past total "
         "235146"},
        {"param.1", "100000000 1 256 1.bias", "param.1 offset 100000000 + 256 elements is past"},
        {"param.5", "235137 1 10 5.bias", "param.5 offset 235137 + 10 elements is past total"},
        {"param.4", "-5 2 10 128 5.weight", "param.4 offset -5 + 1280 elements is past total"},
        {"param.0", "0 2 4294967296 4294967296 1.weight",
         "param.0 shape [4294967296, 4294967296] has more elements than an int64 counts"},
        {"param.2", "200960 9 1 1 1 1 1 1 1 1 1 3.weight", "param.2 has 9 dims (0 to 8)"},
        {"param.2", "200960 2 128 -256 3.weight", "param.2 shape [128, -256] has a negative"},
        {"param.3", "233728 1 128 1.bias", "param.3 names '1.bias' as param.1 does"},
        {"param.3", "233728 1 128 ", "param.3 '233728 1 128 ' is not '<offset> <ndim>"},
        {"param.3", "233728 1 99999999999999999999 3.bias", "param.3 '233728 1 9999"},
        {"param.9", "0 1 1 extra", "param.9 is beyond the layout's params 6 and world 2"},
        {"params", "1000000", "params 1000000 and world 2 are more than the layout's"},
        {"params", "7", "param.6 is missing"},
        {"world", "0", "world 0 is out of range [1, 99999]"},
        {"total", "4611686018427387904", "total 4611686018427387904 is more elements than"},
        {"rank.1", "117584 235147", "rank.1 [117584, 235147) does not continue"},
        {"optim.states", "exp_avg,exp_avg_sq,a,b", "optim.states 'exp_avg,exp_avg_sq,a,b' is not"},
        /* the model exports, the state does not: neither output is written */
        {"optim.states", "exp_avg,nothing", "has no F32 [117584] tensor 'optim.nothing'"},
    };
    char layout[400], orig[300], out[300], keep[300];
    snprintf(layout, sizeof layout, "%s/layout.safetensors", sharded);
    snprintf(orig, sizeof orig, "%s/layout.orig", tmpdir);
    snprintf(out, sizeof out, "%s/tampered-model.safetensors", tmpdir);
    snprintf(keep, sizeof keep, "%s/kept-state.safetensors", tmpdir);
    size_t n = 0;
    char *bytes = slurp_file(layout, &n);
    FILE *f = fopen(orig, "wb"), *k = fopen(keep, "wb");
    CHECK(bytes && f && k && fwrite(bytes, 1, n, f) == n && fputs("kept", k) >= 0, "copying %s",
          layout);
    if (f) fclose(f);
    if (k) fclose(k);
    tdm_safetensors *lf = tdm_safetensors_open(orig);
    const char *total = lf ? tdm_safetensors_meta(lf, "total") : NULL;
    CHECK(total && !strcmp(total, "235146"),
          "the MLP's layout has total %s, not 235146 (update "
          "the cases)",
          total ? total : "(none)");
    tdm_safetensors_close(lf);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char what[200];
        snprintf(what, sizeof what, "layout %s '%s'", cases[i].key, cases[i].value);
        layout_write(orig, cases[i].key, cases[i].value);
        refused(what, sharded, out, keep, keep, cases[i].want);
        CHECK(access(out, F_OK) != 0, "%s: left %s", what, out);
    }
    f = fopen(layout, "wb"); /* the layout as the run wrote it */
    CHECK(f && fwrite(bytes, 1, n, f) == n && fclose(f) == 0, "restoring %s", layout);
    free(bytes);
}

/* ---- outputs that would change the checkpoint ------------------------------------------- */

static void test_outputs(void) {
    char out[400], other[400], link_path[400], want[900];
    snprintf(out, sizeof out, "%s/model.safetensors", whole);
    snprintf(want, sizeof want, "export output '%s' is inside the checkpoint directory '%s'", out,
             whole);
    refused("export onto the checkpoint's model", whole, out, NULL, NULL, want);
    snprintf(out, sizeof out, "%s/../ckpt-0000000002/train_state.safetensors", whole);
    snprintf(other, sizeof other, "%s/state.safetensors", tmpdir);
    refused("the state output onto the checkpoint's", whole, other, out, NULL,
            "is inside the checkpoint directory");
    CHECK(access(other, F_OK) != 0, "a refused export left %s", other);
    snprintf(out, sizeof out, "%s/shard-00000-of-00002.safetensors", sharded);
    snprintf(want, sizeof want, "export output '%s' is inside the checkpoint directory '%s'", out,
             sharded);
    refused("export onto a shard file", sharded, out, NULL, NULL, want);
    snprintf(out, sizeof out, "%s/both.safetensors", tmpdir);
    snprintf(other, sizeof other, "%s/./both.safetensors", tmpdir);
    snprintf(want, sizeof want, "export outputs '%s' (the model) and '%s' (the state) are the same",
             out, other);
    refused("both outputs one file", sharded, out, other, NULL, want);
    CHECK(access(out, F_OK) != 0, "a refused export left %s", out);
    /* a hard link elsewhere to a checkpoint file */
    snprintf(out, sizeof out, "%s/model.safetensors", whole);
    snprintf(link_path, sizeof link_path, "%s/linked.safetensors", tmpdir);
    CHECK(link(out, link_path) == 0, "link %s %s", out, link_path);
    snprintf(want, sizeof want, "export output '%s' is the checkpoint's file '%s'", link_path, out);
    refused("export onto a hard link", whole, link_path, NULL, NULL, want);
    unlink(link_path);
}

/* A header of more than 2^20 JSON values (an array of zeros) is refused before it is parsed. */
static void test_header_limit(void) {
    char dir[300], path[400], out[400];
    snprintf(dir, sizeof dir, "%s/big_header", tmpdir);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    snprintf(out, sizeof out, "%s/big.safetensors", tmpdir);
    CHECK(mkdir(dir, 0755) == 0, "mkdir %s", dir);
    size_t values = (1u << 20) + 8, len = 8 + 2 * values; /* {"a":[0,0,...,0]} */
    char *h = malloc(len + 8);
    uint64_t hlen = len;
    memcpy(h, &hlen, 8);
    memcpy(h + 8, "{\"a\":[", 6);
    for (size_t i = 0; i < values - 1; i++) memcpy(h + 14 + 2 * i, "0,", 2);
    memcpy(h + 14 + 2 * (values - 1), "0]}", 3);
    memset(h + 17 + 2 * (values - 1), ' ', len + 8 - (17 + 2 * (values - 1)));
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(h, 1, len + 8, f) == len + 8 && fclose(f) == 0, "writing %s", path);
    free(h);
    refused("a header of 2^20 values", dir, out, NULL, NULL,
            "header holds more than 1048576 JSON values (the limit");
}

/* What export is for, still: a sharded checkpoint made whole, an unsharded one copied. */
static void test_exports(void) {
    char out[300], state[300], model[400];
    snprintf(out, sizeof out, "%s/model.safetensors", tmpdir);
    snprintf(state, sizeof state, "%s/state.safetensors", tmpdir);
    char *err;
    int rc = export_run(sharded, out, state, &err);
    tdm_safetensors *f = tdm_safetensors_open(out), *s = tdm_safetensors_open(state);
    CHECK(rc == 0 && f && tdm_safetensors_count(f) == 6 && s && tdm_safetensors_count(s) == 12,
          "export of the sharded checkpoint: exit %d, %s", rc, err);
    tdm_safetensors_close(f), tdm_safetensors_close(s);
    free(err);
    rc = export_run(whole, out, NULL, &err);
    snprintf(model, sizeof model, "%s/model.safetensors", whole);
    size_t na = 0, nb = 0;
    char *a = slurp_file(model, &na), *b = slurp_file(out, &nb);
    CHECK(rc == 0 && a && b && na == nb && !memcmp(a, b, na),
          "export of the unsharded checkpoint: exit %d, %s, or not its model's bytes", rc, err);
    free(a), free(b), free(err);
}

/* tandem export with dtype option opt (one argument, or two when val is not NULL) of ckpt into
 * out (and state into state_out, may be NULL): the exit status, stderr into *err. */
static int export_dtype_run(const char *opt, const char *val, const char *ckpt, const char *out,
                            const char *state_out, char **err) {
    const char *argv[8] = {tandem, "export", opt}, **a = argv + 3;
    if (val) *a++ = val;
    *a++ = ckpt, *a++ = out, *a++ = state_out, *a = NULL;
    int rc = wait_status(spawn_captured(argv));
    *err = captured("stderr");
    return rc;
}

/* Whether the file at got holds the f32 file ref's tensors, the float ones as dt (rounded to
 * nearest even: tdm_cast's bits, themselves PyTorch's, test_half_io) and the others as they
 * are. */
static bool holds_cast(const char *ref, const char *got, tdm_dtype dt, const char *dt_name) {
    tdm_safetensors *r = tdm_safetensors_open(ref), *g = tdm_safetensors_open(got);
    bool ok = r && g && tdm_safetensors_count(r) == tdm_safetensors_count(g) &&
              tdm_safetensors_count(r) > 0;
    tdm_scope_begin();
    for (int i = 0; ok && i < tdm_safetensors_count(r); i++) {
        const char *name = tdm_safetensors_name(r, i);
        tdm_tensor *a = tdm_safetensors_load(r, name, tdm_cpu(0));
        tdm_tensor *b = tdm_safetensors_load(g, name, tdm_cpu(0));
        bool fl = a && a->dtype == TDM_F32;
        tdm_tensor *want = fl ? tdm_cast(a, dt) : a;
        int k = tdm_safetensors_find(g, name);
        ok = want && b && b->dtype == want->dtype && tdm_numel(b) == tdm_numel(want) &&
             (!fl || strcmp(tdm_safetensors_dtype(g, k), dt_name) == 0);
        size_t n = ok ? (size_t)tdm_numel(b) * tdm_dtype_size(b->dtype) : 0;
        char *x = malloc(n + 1), *y = malloc(n + 1);
        ok = ok && !tdm_to_host(want, x, n) && !tdm_to_host(b, y, n) && !memcmp(x, y, n);
        free(x), free(y);
    }
    tdm_scope_end();
    tdm_safetensors_close(r), tdm_safetensors_close(g);
    return ok;
}

/* --dtype bf16|f16: the model's float tensors rounded to that dtype, its integer ones and the
 * training state as they were; a dtype it does not write is a usage error. */
static void test_export_dtypes(void) {
    char ref[300], out[300], state[300], ref_state[300];
    snprintf(ref, sizeof ref, "%s/ref.safetensors", tmpdir);
    snprintf(ref_state, sizeof ref_state, "%s/ref_state.safetensors", tmpdir);
    snprintf(out, sizeof out, "%s/half.safetensors", tmpdir);
    snprintf(state, sizeof state, "%s/half_state.safetensors", tmpdir);
    const char *ckpts[2] = {sharded, whole};
    for (int c = 0; c < 2; c++) {
        char *err;
        int rc = export_run(ckpts[c], ref, ref_state, &err);
        CHECK(rc == 0, "f32 export of %s: exit %d, %s", ckpts[c], rc, err);
        free(err);
        rc = export_dtype_run("--dtype", "bf16", ckpts[c], out, state, &err);
        CHECK(rc == 0 && holds_cast(ref, out, TDM_BF16, "BF16"),
              "--dtype bf16 of %s: exit %d, %s, or not the f32 model rounded", ckpts[c], rc, err);
        size_t na = 0, nb = 0;
        char *a = slurp_file(ref_state, &na), *b = slurp_file(state, &nb);
        CHECK(a && b && na == nb && !memcmp(a, b, na), "--dtype leaves the state f32");
        free(a), free(b), free(err);
        rc = export_dtype_run("--dtype=f16", NULL, ckpts[c], out, NULL, &err);
        CHECK(rc == 0 && holds_cast(ref, out, TDM_F16, "F16"), "--dtype=f16 of %s: exit %d, %s",
              ckpts[c], rc, err);
        free(err);
        rc = export_dtype_run("--dtype", "f32", ckpts[c], out, NULL, &err);
        a = slurp_file(ref, &na), b = slurp_file(out, &nb);
        CHECK(rc == 0 && a && b && na == nb && !memcmp(a, b, na), "--dtype f32 is the default");
        free(a), free(b), free(err);
    }
    char *err;
    int rc = export_dtype_run("--dtype", "f64", whole, out, NULL, &err);
    CHECK(rc == 2 && strstr(err, "--dtype 'f64': expected f32, bf16 or f16"),
          "--dtype f64: exit %d, %s", rc, err);
    free(err);
    const char *argv[] = {tandem, "export", "--dtype", NULL};
    rc = wait_status(spawn_captured(argv));
    err = captured("stderr");
    CHECK(rc == 2 && strstr(err, "--dtype needs a value"), "--dtype alone: exit %d, %s", rc, err);
    free(err);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_export PATH_TO_TANDEM\n");
        return 2;
    }
    tandem = argv[1];
    if (access("/usr/share/datasets/fashion-mnist", R_OK) != 0) {
        printf("skipped: Debian's dataset-fashion-mnist is not installed\n");
        return 77;
    }
    if (tmpdir_make("test_export") != 0) return 1;
    if (train("sharded", "parameters", sharded, sizeof sharded) &&
        train("whole", "none", whole, sizeof whole)) {
        test_tampered_layouts();
        test_outputs();
        test_header_limit();
        test_exports();
        test_export_dtypes();
    }
    tmpdir_remove();
    return check_summary();
}
