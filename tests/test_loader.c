/* The DataLoader, samplers and augmentation, on datasets defined here: sample i holds
 * [i, i+0.5, i+1, ...] (or i*1000 + j for i64 tokens) and target (i + j) % 10; a dataset can
 * sleep per sample (to make the workers the bottleneck) or fail at one index. */
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "check.h"
#include "core/core.h" /* tdm_raise: the test dataset reports errors as a real one does */
#include "tandem/transforms.h"

typedef struct {
    int64_t fail_at;  /* get() fails on this index (-1: never) */
    int sleep_us;     /* per sample */
    bool quiet_fail;  /* fail without raising a message */
    atomic_long gets; /* calls to get() */
} test_impl;

static int test_get(const tdm_dataset *ds, int64_t i, void *x, int64_t *y) {
    test_impl *t = ds->impl;
    atomic_fetch_add(&t->gets, 1);
    if (i == t->fail_at) {
        if (t->quiet_fail) return -1;
        return tdm_raise(TDM_ERR_FORMAT, "test: record %lld is corrupt", (long long)i);
    }
    if (t->sleep_us) {
        struct timespec ts = {0, (long)t->sleep_us * 1000L};
        nanosleep(&ts, NULL);
    }
    int64_t m = tdm_shape_numel(ds->sample_shape);
    if (ds->x_dtype == TDM_F32) {
        float *f = x;
        for (int64_t j = 0; j < m; j++) f[j] = (float)i + 0.5f * (float)j;
    } else {
        int64_t *q = x;
        for (int64_t j = 0; j < m; j++) q[j] = i * 1000 + j;
    }
    int64_t tn = tdm_shape_numel(ds->target_shape);
    for (int64_t j = 0; j < tn; j++) y[j] = (i + j) % 10;
    return 0;
}

static const tdm_dataset_ops test_ops = {.get = test_get, .destroy = NULL};

/* Images of three sizes, [1, 4 + i % 3, 5 + i % 2], pixel j = i + 0.5 j (an image folder's
 * kind: get_image only); get_image fails on fail_at. */
static int sized_get_image(const tdm_dataset *ds, int64_t i, tdm_image *img, int64_t *y) {
    test_impl *t = ds->impl;
    if (i == t->fail_at)
        return tdm_raise(TDM_ERR_FORMAT, "image 'x/%lld.png': bad CRC", (long long)i);
    *img = (tdm_image){.c = 1, .h = 4 + i % 3, .w = 5 + i % 2};
    img->data = malloc(sizeof(float) * (size_t)(img->h * img->w));
    for (int64_t j = 0; j < img->h * img->w; j++) img->data[j] = (float)i + 0.5f * (float)j;
    *y = i % 10;
    return 0;
}

static const tdm_dataset_ops sized_ops = {.get_image = sized_get_image};

static tdm_dataset make_ds(test_impl *impl, const char *name, int64_t n, tdm_shape sample) {
    tdm_dataset ds;
    memset(&ds, 0, sizeof ds);
    memset(impl, 0, sizeof *impl);
    impl->fail_at = -1;
    ds.ops = &test_ops;
    ds.n = n;
    ds.sample_shape = sample;
    ds.x_dtype = TDM_F32;
    ds.target_shape = TDM_SHAPE0;
    ds.num_classes = 10;
    snprintf(ds.name, sizeof ds.name, "%s", name);
    ds.impl = impl;
    return ds;
}

/* ---- one epoch, gathered -------------------------------------------------------------- */

typedef struct {
    int64_t nsamples, nbatches;
    float *x;   /* [nsamples, sample_numel] */
    int64_t *y; /* [nsamples, target_numel] */
    int64_t sizes[512];
} epoch_data;

static void epoch_free(epoch_data *e) {
    free(e->x);
    free(e->y);
    memset(e, 0, sizeof *e);
}

/* Runs epoch to its end; returns the status of the last next() (0 at a clean end). */
static int run_epoch(tdm_loader *l, const tdm_dataset *ds, int64_t epoch, epoch_data *e) {
    memset(e, 0, sizeof *e);
    int64_t m = tdm_shape_numel(ds->sample_shape), tn = tdm_shape_numel(ds->target_shape);
    int64_t cap = tdm_loader_batches(l) * 1024 + 1;
    e->x = calloc((size_t)(cap * m), sizeof(float));
    e->y = calloc((size_t)(cap * (tn ? tn : 1)), sizeof(int64_t));
    if (tdm_loader_start_epoch(l, epoch) != 0) return -100;
    tdm_batch b;
    int rc;
    while ((rc = tdm_loader_next(l, &b)) == 1) {
        CHECK(b.index == e->nbatches, "batch %lld arrived as number %lld", (long long)b.index,
              (long long)e->nbatches);
        CHECK(b.x->shape[0] == b.size && b.y->shape[0] == b.size,
              "x rows %lld, y rows %lld, "
              "size %lld",
              (long long)b.x->shape[0], (long long)b.y->shape[0], (long long)b.size);
        CHECK(b.x->ndim == ds->sample_shape.ndim + 1 && b.y->ndim == ds->target_shape.ndim + 1,
              "batch dims %d and %d", b.x->ndim, b.y->ndim);
        CHECK(b.y->dtype == TDM_I64 && b.x->dtype == ds->x_dtype, "batch dtypes");
        if (e->nsamples + b.size > cap || e->nbatches >= 512) break;
        if (ds->x_dtype == TDM_F32)
            tdm_to_host(b.x, e->x + e->nsamples * m, (size_t)(b.size * m) * sizeof(float));
        tdm_to_host(b.y, e->y + e->nsamples * tn, (size_t)(b.size * tn) * sizeof(int64_t));
        CHECK(memcmp(b.y_host, e->y + e->nsamples * tn, (size_t)(b.size * tn) * sizeof(int64_t)) ==
                  0,
              "batch %lld: y_host differs from y", (long long)b.index);
        e->sizes[e->nbatches++] = b.size;
        e->nsamples += b.size;
    }
    return rc;
}

/* The sample index each row of an unaugmented f32 epoch came from (x[0] == i). */
static int64_t row_index(const epoch_data *e, int64_t m, int64_t r) {
    return (int64_t)e->x[r * m];
}

/* ---- invalid options ---------------------------------------------------------------------- */

static void test_invalid_options(void) {
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "tiny", 10, TDM_SHAPE(4));
    tdm_dataset img = make_ds(&impl, "img", 10, TDM_SHAPE(1, 4, 4));

    tdm_loader_opts o = tdm_loader_defaults(0);
    CHECK_ERROR(tdm_loader_new(&ds, &o) == NULL, "batch_size must be >= 1 (got 0)");
    o = tdm_loader_defaults(4);
    o.world_size = 2;
    o.rank = 2;
    CHECK_ERROR(tdm_loader_new(&ds, &o) == NULL, "rank 2 is not in [0, world_size 2)");
    o.rank = -1;
    CHECK_ERROR(tdm_loader_new(&ds, &o) == NULL, "rank -1");
    o = tdm_loader_defaults(4);
    o.world_size = 0;
    CHECK_ERROR(tdm_loader_new(&ds, &o) == NULL, "world_size must be >= 1");
    o = tdm_loader_defaults(4);
    o.workers = -1;
    CHECK_ERROR(tdm_loader_new(&ds, &o) == NULL, "workers must be in");
    o.workers = 2;
    o.prefetch = 0;
    CHECK_ERROR(tdm_loader_new(&ds, &o) == NULL, "prefetch must be >= 1");
    o = tdm_loader_defaults(4);
    o.augment.crop_padding = 2;
    CHECK_ERROR(tdm_loader_new(&ds, &o) == NULL, "dataset 'tiny' has samples [4]");
    o.augment.crop_padding = -1;
    CHECK_ERROR(tdm_loader_new(&img, &o) == NULL, "crop_padding -1 is negative");
    o = tdm_loader_defaults(4);
    o.augment.normalize = true;
    o.augment.std = 0.0f;
    CHECK_ERROR(tdm_loader_new(&img, &o) == NULL, "std > 0");
    o = tdm_loader_defaults(4);
    CHECK_ERROR(tdm_loader_new(NULL, &o) == NULL, "NULL dataset");
    tdm_dataset empty = make_ds(&impl, "empty", 0, TDM_SHAPE(4));
    CHECK_ERROR(tdm_loader_new(&empty, &o) == NULL, "dataset 'empty' has 0 samples");
    tdm_dataset tokens = make_ds(&impl, "tok", 10, TDM_SHAPE(4));
    tokens.x_dtype = TDM_I64;
    o.augment.normalize = true;
    CHECK_ERROR(tdm_loader_new(&tokens, &o) == NULL, "needs f32 samples; dataset 'tok' has i64");

    o = tdm_loader_defaults(4);
    o.workers = 2;
    tdm_loader *l = tdm_loader_new(&ds, &o);
    CHECK(l != NULL, "valid options refused: %s", tdm_last_error());
    tdm_batch b;
    CHECK_ERROR(tdm_loader_next(l, &b) < 0, "call tdm_loader_start_epoch first");
    CHECK_ERROR(tdm_loader_start_epoch(l, -1) != 0, "epoch -1 is negative");
    int64_t n;
    CHECK_ERROR(tdm_loader_indices(l, -2, &n) == NULL, "epoch -2 is negative");
    tdm_loader_free(l);
    tdm_loader_free(NULL);
    CHECK(tdm_loader_wait_seconds(NULL) == 0.0 && tdm_loader_batches(NULL) == 0, "NULL loader");
}

/* ---- order ------------------------------------------------------------------------------ */

/* Sequential: every sample once, in order, with a last smaller batch. */
static void test_sequential(int workers) {
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "seq", 103, TDM_SHAPE(3));
    tdm_loader_opts o = tdm_loader_defaults(10);
    o.workers = workers;
    tdm_loader *l = tdm_loader_new(&ds, &o);
    CHECK(l && tdm_loader_batches(l) == 11, "batches %lld", (long long)tdm_loader_batches(l));
    for (int64_t ep = 0; ep < 2; ep++) {
        epoch_data e;
        int rc = run_epoch(l, &ds, ep, &e);
        CHECK(rc == 0 && e.nbatches == 11 && e.nsamples == 103 && e.sizes[10] == 3,
              "workers %d: rc %d, %lld batches, %lld samples, last %lld", workers, rc,
              (long long)e.nbatches, (long long)e.nsamples, (long long)e.sizes[10]);
        int bad = 0;
        for (int64_t r = 0; r < e.nsamples; r++) {
            bad +=
                row_index(&e, 3, r) != r || e.x[r * 3 + 2] != (float)r + 1.0f || e.y[r] != r % 10;
        }
        CHECK(bad == 0, "workers %d: %d rows out of order or wrong", workers, bad);
        epoch_free(&e);
        tdm_batch b;
        CHECK(tdm_loader_next(l, &b) == 0, "next after the end of the epoch");
    }
    tdm_loader_free(l);
}

/* Random: a permutation per epoch, the same for the same epoch, reported by loader_indices. */
static void test_shuffle(int workers) {
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "shuf", 103, TDM_SHAPE(2));
    tdm_loader_opts o = tdm_loader_defaults(8);
    o.shuffle = true;
    o.seed = 7;
    o.workers = workers;
    tdm_loader *l = tdm_loader_new(&ds, &o);
    int64_t order[3][103];
    for (int run = 0; run < 3; run++) {
        int64_t ep = run == 1 ? 1 : 0; /* epochs 0, 1, then 0 again */
        epoch_data e;
        CHECK(run_epoch(l, &ds, ep, &e) == 0 && e.nsamples == 103, "shuffled epoch");
        int seen[103] = {0};
        int64_t n_idx;
        int64_t *idx = tdm_loader_indices(l, ep, &n_idx);
        CHECK(idx && n_idx == 103, "indices count %lld", (long long)n_idx);
        int mismatch = 0;
        for (int64_t r = 0; r < e.nsamples && r < 103; r++) {
            int64_t i = row_index(&e, 2, r);
            order[run][r] = i;
            if (i >= 0 && i < 103) seen[i]++;
            mismatch += idx && idx[r] != i;
            mismatch += e.y[r] != i % 10;
        }
        free(idx);
        int once = 0;
        for (int i = 0; i < 103; i++) once += seen[i] == 1;
        CHECK(once == 103, "workers %d epoch %lld: %d of 103 samples seen exactly once", workers,
              (long long)ep, once);
        CHECK(mismatch == 0, "%d rows differ from loader_indices", mismatch);
        epoch_free(&e);
    }
    int in_place = 0, diff01 = 0, diff02 = 0;
    for (int i = 0; i < 103; i++) {
        in_place += order[0][i] == i;
        diff01 += order[0][i] != order[1][i];
        diff02 += order[0][i] != order[2][i];
    }
    CHECK(in_place < 20, "a shuffled epoch left %d of 103 in place", in_place);
    CHECK(diff01 > 50, "epochs 0 and 1 differ in %d positions only", diff01);
    CHECK(diff02 == 0, "epoch 0 run twice differs in %d positions", diff02);
    tdm_loader_free(l);
}

/* DistributedSampler: ceil(n / world) per rank, padding repeats the start of the shuffled
 * list, rank r takes padded[r::world], and every rank shuffles the same way. */
static void test_distributed(void) {
    int64_t sizes[3] = {1, 7, 103};
    for (int si = 0; si < 3; si++) {
        int64_t n = sizes[si];
        test_impl impl;
        tdm_dataset ds = make_ds(&impl, "dist", n, TDM_SHAPE(1));
        for (int shuffle = 0; shuffle < 2; shuffle++) {
            tdm_loader_opts o = tdm_loader_defaults(4);
            o.shuffle = shuffle;
            o.seed = 11;
            tdm_loader *l1 = tdm_loader_new(&ds, &o);
            int64_t n1;
            int64_t *full = tdm_loader_indices(l1, 3, &n1);
            tdm_loader_free(l1);
            for (int world = 1; world <= 4; world++) {
                int64_t per = (n + world - 1) / world, total = per * world;
                int64_t *padded = calloc((size_t)total, sizeof *padded);
                int bad = 0;
                for (int r = 0; r < world; r++) {
                    o.world_size = world;
                    o.rank = r;
                    o.workers = r % 2; /* the loader's batches must follow its indices too */
                    tdm_loader *l = tdm_loader_new(&ds, &o);
                    int64_t cnt;
                    int64_t *idx = tdm_loader_indices(l, 3, &cnt);
                    CHECK(cnt == per && tdm_loader_batches(l) == (per + 3) / 4,
                          "n %lld world %d: %lld per rank, %lld batches", (long long)n, world,
                          (long long)cnt, (long long)tdm_loader_batches(l));
                    for (int64_t j = 0; j < cnt && j < per; j++) padded[r + j * world] = idx[j];
                    epoch_data e;
                    CHECK(run_epoch(l, &ds, 3, &e) == 0 && e.nsamples == per, "rank epoch");
                    for (int64_t j = 0; j < e.nsamples && j < cnt; j++)
                        bad += row_index(&e, 1, j) != idx[j];
                    epoch_free(&e);
                    free(idx);
                    tdm_loader_free(l);
                }
                CHECK(bad == 0, "n %lld world %d: batches differ from indices", (long long)n,
                      world);
                /* the union of the ranks is the world-1 order followed by its start */
                int mismatch = 0;
                for (int64_t k = 0; k < total; k++) mismatch += padded[k] != full[k % n];
                int *seen = calloc((size_t)n, sizeof *seen);
                for (int64_t k = 0; k < total; k++) seen[padded[k]]++;
                int64_t covered = 0, extra = 0;
                for (int64_t i = 0; i < n; i++) {
                    covered += seen[i] > 0;
                    extra += seen[i] - 1;
                }
                CHECK(mismatch == 0 && covered == n && extra == total - n,
                      "n %lld world %d shuffle %d: %d mismatches, %lld covered, %lld padded",
                      (long long)n, world, shuffle, mismatch, (long long)covered, (long long)extra);
                free(seen);
                free(padded);
            }
            free(full);
        }
    }
}

static void test_drop_last(void) {
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "drop", 103, TDM_SHAPE(2));
    for (int workers = 0; workers <= 2; workers += 2) {
        tdm_loader_opts o = tdm_loader_defaults(10);
        o.workers = workers;
        o.drop_last = true;
        tdm_loader *l = tdm_loader_new(&ds, &o);
        epoch_data e;
        CHECK(tdm_loader_batches(l) == 10, "drop_last batches %lld",
              (long long)tdm_loader_batches(l));
        CHECK(run_epoch(l, &ds, 0, &e) == 0 && e.nbatches == 10 && e.nsamples == 100 &&
                  e.sizes[9] == 10,
              "drop_last epoch: %lld batches %lld samples", (long long)e.nbatches,
              (long long)e.nsamples);
        epoch_free(&e);
        tdm_loader_free(l);
    }
    /* fewer samples than a batch */
    tdm_dataset small = make_ds(&impl, "small", 5, TDM_SHAPE(2));
    tdm_loader_opts o = tdm_loader_defaults(10);
    o.drop_last = true;
    o.workers = 1;
    tdm_loader *l = tdm_loader_new(&small, &o);
    epoch_data e;
    CHECK(tdm_loader_batches(l) == 0 && run_epoch(l, &small, 0, &e) == 0 && e.nbatches == 0,
          "5 samples, batch 10, drop_last: %lld batches", (long long)tdm_loader_batches(l));
    epoch_free(&e);
    tdm_loader_free(l);
    o.drop_last = false;
    l = tdm_loader_new(&small, &o);
    CHECK(run_epoch(l, &small, 0, &e) == 0 && e.nbatches == 1 && e.sizes[0] == 5,
          "5 samples, batch 10: %lld batches", (long long)e.nbatches);
    epoch_free(&e);
    tdm_loader_free(l);
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Global batch k of `world` ranks (rank r's batch k, r = 0..world-1) against positions
 * [k*G, (k+1)*G) of the one-rank order `full` (n samples), padded to a multiple of world by
 * repeating its start: as sorted lists. Returns the mismatches; *padded counts positions past
 * n (DistributedSampler's repeats) in the batch. */
static int global_batch_mismatches(int64_t *const *idx, int64_t per, int world, int64_t b,
                                   int64_t k, const int64_t *full, int64_t n, int64_t *padded) {
    int64_t got[64], want[64], m = 0, w = 0;
    for (int r = 0; r < world; r++)
        for (int64_t j = k * b; j < (k + 1) * b && j < per; j++) got[m++] = idx[r][j];
    *padded = 0;
    for (int64_t p = k * b * world; p < (k + 1) * b * world && p < per * world; p++) {
        want[w++] = full[p % n];
        *padded += p >= n;
    }
    if (m != w) return 1000;
    qsort(got, (size_t)m, sizeof *got, cmp_i64);
    qsort(want, (size_t)w, sizeof *want, cmp_i64);
    int bad = 0;
    for (int64_t i = 0; i < m; i++) bad += got[i] != want[i];
    return bad;
}

/* What resuming on another number of ranks relies on: with a fixed global batch G = 12 split
 * over 1-4 ranks, an epoch has the same number of batches, global batch k holds positions
 * [kG, (k+1)G) of the one-rank order (the last, without drop_last, also world - n mod world
 * padding repeats when world does not divide n; drop_last drops a batch that would hold
 * them), and the global position of batch k is the same, mapping back to batch k on any
 * world. */
static void test_global_batches(void) {
    const int64_t sizes[4] = {95, 96, 100, 103}, G = 12;
    for (int si = 0; si < 4; si++)
        for (int drop = 0; drop < 2; drop++) {
            int64_t n = sizes[si];
            test_impl impl;
            tdm_dataset ds = make_ds(&impl, "global", n, TDM_SHAPE(1));
            tdm_loader_opts o = tdm_loader_defaults(G);
            o.shuffle = true, o.seed = 9, o.drop_last = drop;
            tdm_loader *one = tdm_loader_new(&ds, &o);
            int64_t n1, nb = tdm_loader_batches(one), *full = tdm_loader_indices(one, 2, &n1);
            CHECK(nb == (drop ? n / G : (n + G - 1) / G), "n %lld: %lld batches", (long long)n,
                  (long long)nb);
            for (int world = 1; world <= 4; world++) {
                tdm_loader *l[4];
                int64_t *idx[4], per = 0;
                for (int r = 0; r < world; r++) {
                    o.batch_size = G / world, o.rank = r, o.world_size = world;
                    l[r] = tdm_loader_new(&ds, &o);
                    idx[r] = tdm_loader_indices(l[r], 2, &per);
                }
                int bad = 0;
                int64_t pad = 0, pads = 0;
                for (int64_t k = 0; k < nb; k++, pads += pad)
                    bad += global_batch_mismatches(idx, per, world, G / world, k, full, n, &pad);
                int64_t expect = drop ? 0 : (world - n % world) % world;
                CHECK(tdm_loader_batches(l[0]) == nb && bad == 0 && pads == expect,
                      "n %lld drop_last %d world %d: %lld batches (%lld), %d mismatches, %lld "
                      "padded (%lld)",
                      (long long)n, drop, world, (long long)tdm_loader_batches(l[0]), (long long)nb,
                      bad, (long long)pads, (long long)expect);
                for (int64_t k = 0; k <= nb; k++) {
                    int64_t g, back = -1;
                    tdm_loader_start_epoch_at(l[world - 1], 2, k);
                    tdm_loader_start_epoch_at(one, 2, k);
                    g = tdm_loader_global_samples_done(l[world - 1]);
                    CHECK(g == tdm_loader_global_samples_done(one) &&
                              tdm_loader_global_batch_at(one, g, &back) == TDM_OK && back == k,
                          "world %d batch %lld: global sample %lld, back at %lld", world,
                          (long long)k, (long long)g, (long long)back);
                }
                for (int r = 0; r < world; r++) free(idx[r]), tdm_loader_free(l[r]);
            }
            int64_t k;
            CHECK_ERROR(tdm_loader_global_batch_at(one, 6, &k), "global sample 6 is not the start");
            free(full);
            tdm_loader_free(one);
        }
}

/* ---- augmentation and determinism -------------------------------------------------------- */

static tdm_loader_opts augmented(int workers, int prefetch) {
    tdm_loader_opts o = tdm_loader_defaults(8);
    o.shuffle = true;
    o.seed = 3;
    o.workers = workers;
    o.prefetch = prefetch;
    o.augment.normalize = true;
    o.augment.mean = 0.5f;
    o.augment.std = 2.0f;
    o.augment.crop_padding = 2;
    o.augment.hflip = true;
    return o;
}

/* Bit-identical x and y for 0, 1 and 4 workers, epoch by epoch. */
static void test_workers_identical(void) {
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "img", 50, TDM_SHAPE(2, 6, 5));
    int cfg[4][2] = {{0, 1}, {1, 2}, {4, 2}, {4, 1}};
    epoch_data ref[2];
    for (int c = 0; c < 4; c++) {
        tdm_loader_opts o = augmented(cfg[c][0], cfg[c][1]);
        tdm_loader *l = tdm_loader_new(&ds, &o);
        for (int ep = 0; ep < 2; ep++) {
            epoch_data e;
            CHECK(run_epoch(l, &ds, ep, &e) == 0 && e.nsamples == 50 && e.sizes[6] == 2,
                  "augmented epoch: %lld samples", (long long)e.nsamples);
            if (c == 0) {
                ref[ep] = e;
                continue;
            }
            CHECK(memcmp(e.x, ref[ep].x, 50 * 60 * sizeof(float)) == 0 &&
                      memcmp(e.y, ref[ep].y, 50 * sizeof(int64_t)) == 0,
                  "workers %d prefetch %d epoch %d: batches differ from workers 0", cfg[c][0],
                  cfg[c][1], ep);
            epoch_free(&e);
        }
        tdm_loader_free(l);
    }
    CHECK(memcmp(ref[0].x, ref[1].x, 50 * 60 * sizeof(float)) != 0, "epochs 0 and 1 equal");
    epoch_free(&ref[0]);
    epoch_free(&ref[1]);
}

/* Each augmented sample equals crop-then-flip-then-normalize of the original for one of the
 * (2p+1)^2 * 2 choices, computed here directly; the choices vary across samples. */
static void test_augment_reference(void) {
    enum { C = 2, H = 6, W = 5, P = 2, N = 64 };
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "img", N, TDM_SHAPE(C, H, W));
    tdm_loader_opts o = augmented(2, 2);
    o.shuffle = false;
    o.batch_size = 16;
    tdm_loader *l = tdm_loader_new(&ds, &o);
    epoch_data e;
    CHECK(run_epoch(l, &ds, 4, &e) == 0 && e.nsamples == N, "augmented epoch");
    int used[2 * P + 1][2 * P + 1][2] = {{{0}}};
    int unmatched = 0;
    for (int i = 0; i < N; i++) {
        const float *got = e.x + i * C * H * W;
        int found = 0;
        for (int dy = -P; dy <= P && !found; dy++)
            for (int dx = -P; dx <= P && !found; dx++)
                for (int flip = 0; flip < 2 && !found; flip++) {
                    int same = 1;
                    for (int c = 0; c < C; c++)
                        for (int y = 0; y < H; y++)
                            for (int x = 0; x < W; x++) {
                                int sx = (flip ? W - 1 - x : x) + dx, sy = y + dy;
                                float v = 0.0f;
                                if (sy >= 0 && sy < H && sx >= 0 && sx < W)
                                    v = (float)i + 0.5f * (float)((c * H + sy) * W + sx);
                                float want = (v - 0.5f) / 2.0f;
                                same &= got[(c * H + y) * W + x] == want;
                            }
                    if (same) {
                        found = 1;
                        used[dy + P][dx + P][flip]++;
                    }
                }
        unmatched += !found;
    }
    int kinds = 0, flips = 0;
    for (int a = 0; a < 2 * P + 1; a++)
        for (int b = 0; b < 2 * P + 1; b++) {
            kinds += (used[a][b][0] > 0) + (used[a][b][1] > 0);
            flips += used[a][b][1];
        }
    CHECK(unmatched == 0, "%d of %d samples match no crop/flip/normalize", unmatched, N);
    CHECK(kinds >= 15 && flips > 8 && flips < N - 8, "%d distinct transforms, %d flips", kinds,
          flips);
    epoch_free(&e);
    tdm_loader_free(l);

    /* normalize alone works on non-image samples */
    tdm_dataset flat = make_ds(&impl, "flat", 9, TDM_SHAPE(7));
    tdm_loader_opts on = tdm_loader_defaults(4);
    on.augment.normalize = true;
    on.augment.mean = 1.0f;
    on.augment.std = 4.0f;
    l = tdm_loader_new(&flat, &on);
    CHECK(l && run_epoch(l, &flat, 0, &e) == 0 && e.nsamples == 9, "normalize flat");
    int bad = 0;
    for (int i = 0; i < 9; i++)
        for (int j = 0; j < 7; j++)
            bad += e.x[i * 7 + j] != ((float)i + 0.5f * (float)j - 1.0f) / 4.0f;
    CHECK(bad == 0, "%d normalized values wrong", bad);
    epoch_free(&e);
    tdm_loader_free(l);
}

/* ---- epochs restarted, failures, waiting, ownership -------------------------------------- */

static int epochs_equal(const epoch_data *a, const epoch_data *b, int64_t m) {
    return a->nsamples == b->nsamples &&
           memcmp(a->x, b->x, (size_t)(a->nsamples * m) * sizeof(float)) == 0 &&
           memcmp(a->y, b->y, (size_t)a->nsamples * sizeof(int64_t)) == 0;
}

static void test_restart(void) {
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "slow", 103, TDM_SHAPE(2, 4, 4));
    tdm_loader_opts o = augmented(0, 1);
    epoch_data ref0, ref1;
    tdm_loader *l = tdm_loader_new(&ds, &o);
    run_epoch(l, &ds, 0, &ref0);
    run_epoch(l, &ds, 1, &ref1);
    tdm_loader_free(l);

    impl.sleep_us = 100;
    for (int workers = 0; workers <= 3; workers += 3) {
        o = augmented(workers, 2);
        l = tdm_loader_new(&ds, &o);
        tdm_batch b;
        tdm_loader_start_epoch(l, 0);
        for (int k = 0; k < 3; k++) CHECK(tdm_loader_next(l, &b) == 1, "partial epoch");
        epoch_data e;
        CHECK(run_epoch(l, &ds, 0, &e) == 0 && epochs_equal(&e, &ref0, 32),
              "workers %d: epoch 0 restarted after 3 batches differs", workers);
        epoch_free(&e);
        tdm_loader_start_epoch(l, 1);
        CHECK(tdm_loader_next(l, &b) == 1, "partial epoch 1");
        tdm_loader_start_epoch(l, 5); /* started and left at once */
        CHECK(run_epoch(l, &ds, 1, &e) == 0 && epochs_equal(&e, &ref1, 32),
              "workers %d: epoch 1 restarted differs", workers);
        epoch_free(&e);
        tdm_loader_start_epoch(l, 2);
        CHECK(tdm_loader_next(l, &b) == 1, "partial epoch 2");
        tdm_loader_free(l); /* joins the workers mid-epoch */
    }
    epoch_free(&ref0);
    epoch_free(&ref1);
}

static void test_failing_get(void) {
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "broken-set", 50, TDM_SHAPE(3));
    impl.fail_at = 37;
    for (int c = 0; c < 3; c++) {
        tdm_loader_opts o = tdm_loader_defaults(8);
        o.workers = c == 0 ? 0 : 2;
        o.shuffle = c == 2;
        tdm_loader *l = tdm_loader_new(&ds, &o);
        for (int attempt = 0; attempt < 2; attempt++) {
            epoch_data e;
            int rc = run_epoch(l, &ds, 0, &e);
            CHECK(rc == TDM_ERR_FORMAT, "case %d: next returned %d", c, rc);
            const char *msg = tdm_last_error();
            CHECK(strstr(msg, "sample 37 of dataset 'broken-set'") &&
                      strstr(msg, "record 37 is corrupt"),
                  "case %d: message \"%s\"", c, msg);
            int64_t good = 0;
            for (int64_t r = 0; r < e.nsamples; r++) good += row_index(&e, 3, r) != 37;
            CHECK(good == e.nsamples && e.nsamples % 8 == 0, "case %d: %lld rows before the error",
                  c, (long long)e.nsamples);
            tdm_batch b;
            tdm_clear_error();
            CHECK_ERROR(tdm_loader_next(l, &b) == TDM_ERR_FORMAT, "sample 37"); /* sticky */
            epoch_free(&e);
        }
        tdm_loader_free(l);
    }
    impl.quiet_fail = true;
    tdm_loader_opts o = tdm_loader_defaults(8);
    o.workers = 1;
    tdm_loader *l = tdm_loader_new(&ds, &o);
    epoch_data e;
    CHECK(run_epoch(l, &ds, 0, &e) < 0, "a silent get() failure was not reported");
    CHECK(strstr(tdm_last_error(), "sample 37") && strstr(tdm_last_error(), "get() returned"),
          "message \"%s\"", tdm_last_error());
    tdm_clear_error();
    epoch_free(&e);
    tdm_loader_free(l);
}

/* Workers slower than the caller: the caller blocks, and that time is counted. */
static void test_wait_time(void) {
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "sleepy", 32, TDM_SHAPE(4));
    impl.sleep_us = 1000;
    for (int workers = 0; workers <= 2; workers++) {
        tdm_loader_opts o = tdm_loader_defaults(8);
        o.workers = workers;
        tdm_loader *l = tdm_loader_new(&ds, &o);
        CHECK(tdm_loader_wait_seconds(l) == 0.0, "wait before any batch");
        epoch_data e;
        run_epoch(l, &ds, 0, &e);
        epoch_free(&e);
        double w1 = tdm_loader_wait_seconds(l);
        run_epoch(l, &ds, 1, &e);
        epoch_free(&e);
        double w2 = tdm_loader_wait_seconds(l);
        CHECK(w1 > 0.0 && w2 >= w1, "workers %d: waited %g then %g s", workers, w1, w2);
        CHECK(atomic_load(&impl.gets) >= 64, "every sample loaded");
        atomic_store(&impl.gets, 0);
        tdm_loader_free(l);
    }
}

/* Token samples (i64 x, a [T] target) with workers. */
static void test_tokens(void) {
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "tokens", 21, TDM_SHAPE(5));
    ds.x_dtype = TDM_I64;
    ds.target_shape = TDM_SHAPE(5);
    tdm_loader_opts o = tdm_loader_defaults(4);
    o.workers = 2;
    tdm_loader *l = tdm_loader_new(&ds, &o);
    tdm_loader_start_epoch(l, 0);
    tdm_batch b;
    int bad = 0, rows = 0;
    while (tdm_loader_next(l, &b) == 1) {
        int64_t x[20], y[20];
        CHECK(b.x->shape[1] == 5 && b.y->shape[1] == 5, "token batch shapes");
        tdm_to_host(b.x, x, sizeof x);
        tdm_to_host(b.y, y, sizeof y);
        for (int64_t r = 0; r < b.size; r++, rows++)
            for (int j = 0; j < 5; j++)
                bad += x[r * 5 + j] != rows * 1000 + j || y[r * 5 + j] != (rows + j) % 10;
    }
    CHECK(bad == 0 && rows == 21, "token batches: %d wrong, %d rows", bad, rows);
    tdm_loader_free(l);
}

/* A loader made inside a step scope keeps its batches after the scope ends. */
static void test_scope_independent(void) {
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "scoped", 10, TDM_SHAPE(2));
    tdm_scope_begin();
    tdm_loader_opts o = tdm_loader_defaults(4);
    o.workers = 1;
    tdm_loader *l = tdm_loader_new(&ds, &o);
    tdm_loader_start_epoch(l, 0);
    tdm_batch b;
    tdm_loader_next(l, &b);
    tdm_scope_end();
    float x[8];
    CHECK(tdm_to_host(b.x, x, sizeof x) == 0 && x[2] == 1.0f, "batch after scope end");
    for (int e = 0; e < 3; e++) {
        tdm_scope_begin();
        tdm_loader_start_epoch(l, e);
        int k = 0;
        while (tdm_loader_next(l, &b) == 1) {
            tdm_tensor *s = tdm_sum_all(b.x); /* scope-owned work on the batch */
            CHECK(s != NULL, "sum of a batch");
            k++;
        }
        CHECK(k == 3 && b.x->shape[0] == 2, "epoch %d in a scope: %d batches", e, k);
        tdm_scope_end();
    }
    tdm_loader_free(l);
}

/* Steady state: an epoch after the first allocates no tensor memory, and the batches come
 * from the same few preallocated buffers: slots of the ring, and the view of a last, smaller
 * batch. n samples of side x side floats in batches of 8 from 2 workers with prefetch 2. */
static void check_steady(int64_t n, int64_t side, int want_slots) {
    test_impl impl;
    tdm_dataset ds = make_ds(&impl, "steady", n, TDM_SHAPE(1, side, side));
    tdm_loader_opts o = augmented(2, 2);
    tdm_loader *l = tdm_loader_new(&ds, &o);
    tdm_batch b;
    tdm_loader_start_epoch(l, 0);
    while (tdm_loader_next(l, &b) == 1) {
    }
    tdm_alloc_stats s0 = tdm_alloc_stats_get(tdm_cpu(0));
    const tdm_tensor *seen[64];
    int nseen = 0;
    for (int e = 1; e < 4; e++) {
        tdm_loader_start_epoch(l, e);
        while (tdm_loader_next(l, &b) == 1) {
            int k = 0;
            while (k < nseen && seen[k] != b.x) k++;
            if (k == nseen && nseen < 64) seen[nseen++] = b.x;
        }
    }
    tdm_alloc_stats s1 = tdm_alloc_stats_get(tdm_cpu(0));
    CHECK(s1.sys_allocs == s0.sys_allocs && s1.bytes_in_use == s0.bytes_in_use,
          "epochs allocated: sys_allocs %llu -> %llu, in use %zu -> %zu",
          (unsigned long long)s0.sys_allocs, (unsigned long long)s1.sys_allocs, s0.bytes_in_use,
          s1.bytes_in_use);
    CHECK(nseen == want_slots + 1,
          "%lldx%lld samples: batches came from %d distinct tensors, "
          "not %d slots and the last batch's view",
          (long long)side, (long long)side, nseen, want_slots);
    tdm_loader_free(l);
}

static void test_no_alloc_per_batch(void) {
    /* batches of 2 KiB: a ring of 16 slots (loader.c, ring_slots: a worker woken less often) */
    check_steady(203, 8, 16);
    /* batches of 1.1 MiB: 3 would fit in 4 MiB, fewer than the 4 asked for (2 workers x 2) */
    check_steady(61, 188, 4);
}

/* ---- transforms ----------------------------------------------------------------------------- */

/* Every row of an epoch of l over ds is the transform of its sample under (seed, epoch, index),
 * whichever worker built it. */
static void check_transformed(const char *what, tdm_dataset *ds, const tdm_transform *tf,
                              int workers) {
    tdm_loader_opts o = tdm_loader_defaults(4);
    o.workers = workers, o.shuffle = true, o.seed = 11, o.transform = tf;
    tdm_loader *l = tdm_loader_new(ds, &o);
    CHECK(l != NULL, "%s: loader_new: %s", what, tdm_last_error());
    if (!l) return;
    int64_t n = 0, *order = tdm_loader_indices(l, 2, &n), rows = 0;
    CHECK(tdm_loader_start_epoch(l, 2) == TDM_OK, "%s: start_epoch", what);
    tdm_batch b;
    float want[64], got[4 * 64], raw[64];
    while (tdm_loader_next(l, &b) == 1) {
        CHECK(b.x->ndim == 4 && b.x->shape[1] == 1 && b.x->shape[2] == 3 && b.x->shape[3] == 3,
              "%s: batch x has %d dims, [.., %lld, %lld, %lld]", what, b.x->ndim,
              (long long)b.x->shape[1], (long long)b.x->shape[2], (long long)b.x->shape[3]);
        tdm_to_host(b.x, got, sizeof(float) * (size_t)(b.size * 9));
        for (int64_t r = 0; r < b.size; r++, rows++) {
            int64_t i = order[rows], y;
            tdm_image img = {.c = 1, .h = 4, .w = 6, .data = raw};
            if (ds->ops->get_image)
                ds->ops->get_image(ds, i, &img, &y);
            else
                ds->ops->get(ds, i, raw, &y);
            tdm_transform_apply(tf, &img, want, 11, 2, i);
            if (ds->ops->get_image) free(img.data);
            CHECK(memcmp(want, got + r * 9, sizeof want[0] * 9) == 0 && b.y_host[r] == i % 10,
                  "%s (%d workers): row %lld (sample %lld) is not its transform", what, workers,
                  (long long)rows, (long long)i);
        }
    }
    CHECK(rows == n && n == ds->n, "%s: %lld rows of %lld", what, (long long)rows, (long long)n);
    free(order);
    tdm_loader_free(l);
}

/* A transform turns a dataset's samples, of one size or of many (get_image), into the
 * batch's; without one, images of many sizes are refused, and a file that does not decode
 * is named. */
static void test_transform(void) {
    test_impl impl;
    tdm_dataset fixed = make_ds(&impl, "fixed", 21, TDM_SHAPE(1, 4, 6));
    tdm_transform *tf = tdm_transform_parse("RandomCrop(3, padding=1),RandomHorizontalFlip()", 0);
    CHECK(tf != NULL, "parse: %s", tdm_last_error());
    for (int w = 0; tf && w <= 2; w += 2) check_transformed("fixed size", &fixed, tf, w);
    tdm_transform_free(tf);
    test_impl simpl;
    tdm_dataset sized = make_ds(&simpl, "sized", 19, TDM_SHAPE(1, 0, 0));
    sized.ops = &sized_ops;
    tdm_loader_opts o = tdm_loader_defaults(4);
    CHECK_ERROR(tdm_loader_new(&sized, &o) == NULL, "differ in size");
    tf = tdm_transform_parse("RandomHorizontalFlip()", 0);
    o.transform = tf;
    CHECK_ERROR(tdm_loader_new(&sized, &o) == NULL, "dataset 'sized'"); /* size still varies */
    tdm_transform_free(tf);
    tf = tdm_transform_parse("Resize(5),CenterCrop(3)", 0);
    for (int w = 0; w <= 2; w += 2) check_transformed("sizes differ", &sized, tf, w);
    simpl.fail_at = 7;
    o.transform = tf, o.workers = 2;
    tdm_loader *l = tdm_loader_new(&sized, &o);
    epoch_data e;
    CHECK(l && run_epoch(l, &sized, 0, &e) == TDM_ERR_FORMAT &&
              strstr(tdm_last_error(), "sample 7 of dataset 'sized'") &&
              strstr(tdm_last_error(), "image 'x/7.png': bad CRC"),
          "a failed decode: %s", tdm_last_error());
    tdm_clear_error();
    epoch_free(&e);
    tdm_loader_free(l);
    tdm_transform_free(tf);
}

/* tdm_dataset_subset reads the base's samples at its indices, and refuses one outside it. */
static void test_subset(void) {
    test_impl impl;
    tdm_dataset base = make_ds(&impl, "base", 50, TDM_SHAPE(2));
    int64_t idx[3] = {49, 5, 7}, y;
    tdm_dataset *sub = tdm_dataset_subset(&base, idx, 3);
    CHECK(sub && sub->n == 3 && sub->num_classes == 10 && sub->sample_shape.d[0] == 2, "subset: %s",
          tdm_last_error());
    float x[2];
    for (int k = 0; sub && k < 3; k++)
        CHECK(sub->ops->get(sub, k, x, &y) == 0 && x[0] == (float)idx[k] && y == idx[k] % 10,
              "subset sample %d is %g, label %lld", k, (double)x[0], (long long)y);
    CHECK_ERROR(sub && sub->ops->get(sub, 3, x, &y) != 0, "index 3 out of range");
    tdm_dataset_free(sub);
    idx[1] = 50;
    CHECK_ERROR(tdm_dataset_subset(&base, idx, 3) == NULL, "index 50 (entry 1)");
}

int main(void) {
    test_invalid_options();
    for (int w = 0; w <= 3; w++) {
        test_sequential(w);
        test_shuffle(w);
    }
    test_distributed();
    test_drop_last();
    test_global_batches();
    test_workers_identical();
    test_augment_reference();
    test_restart();
    test_failing_get();
    test_wait_time();
    test_tokens();
    test_scope_independent();
    test_no_alloc_per_batch();
    test_transform();
    test_subset();
    return check_summary();
}
