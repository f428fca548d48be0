/* DataLoader throughput on Fashion-MNIST-sized samples: 60000 images [1, 28, 28] in memory,
 * batch 64, shuffled, with augmentation (normalize, random crop with padding 2, horizontal
 * flip), built by 0, 1 and 2 worker threads. The consumer does nothing, so this is the rate
 * at which the loader alone can feed a training loop.
 *
 * Output, one line per case: "tandem loader workers=<W> augment=<0|1> <batches/s> batches/s
 * <samples/s> samples/s wait=<s>" (best of 3 epochs; wait is the time next() blocked).
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "tandem/tandem.h"

enum { N = 60000, SIDE = 28, BATCH = 64, EPOCHS = 3 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Pixels in [0, 1) from an LCG (their values do not matter to the speed), labels i % 10. */
static tdm_dataset *make_dataset(void) {
    float *x = malloc((size_t)N * SIDE * SIDE * sizeof *x);
    int64_t *y = malloc((size_t)N * sizeof *y);
    if (!x || !y) return NULL;
    uint32_t s = 12345;
    for (int64_t i = 0; i < (int64_t)N * SIDE * SIDE; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)(s >> 8) / 16777216.0f;
    }
    for (int64_t i = 0; i < N; i++) y[i] = i % 10;
    tdm_dataset *ds = tdm_memory_dataset(TDM_SHAPE(1, SIDE, SIDE), N, x, y, 10);
    free(x);
    free(y);
    return ds;
}

static int run_case(tdm_dataset *ds, int workers, bool augment) {
    tdm_loader_opts o = tdm_loader_defaults(BATCH);
    o.shuffle = true;
    o.seed = 1;
    o.workers = workers;
    if (augment) {
        o.augment.normalize = true;
        o.augment.mean = 0.2860f; /* Fashion-MNIST's pixel mean and std */
        o.augment.std = 0.3530f;
        o.augment.crop_padding = 2;
        o.augment.hflip = true;
    }
    tdm_loader *l = tdm_loader_new(ds, &o);
    if (!l) return -1;
    double best = 1e30, wait_best = 0;
    int64_t batches = 0;
    for (int e = 0; e < EPOCHS; e++) {
        double w0 = tdm_loader_wait_seconds(l), t0 = now_s();
        tdm_loader_start_epoch(l, e);
        tdm_batch b;
        int rc;
        batches = 0;
        while ((rc = tdm_loader_next(l, &b)) == 1) batches++;
        double t = now_s() - t0;
        if (rc < 0) {
            tdm_loader_free(l);
            return -1;
        }
        if (t < best) {
            best = t;
            wait_best = tdm_loader_wait_seconds(l) - w0;
        }
    }
    printf("tandem loader workers=%d augment=%d %.0f batches/s %.0f samples/s wait=%.3f\n", workers,
           augment ? 1 : 0, (double)batches / best, (double)N / best, wait_best);
    tdm_loader_free(l);
    return 0;
}

int main(void) {
    tdm_dataset *ds = make_dataset();
    if (!ds) {
        fprintf(stderr, "bench_loader: %s\n", tdm_last_error());
        return 1;
    }
    if (run_case(ds, 0, false)) goto fail;
    for (int w = 0; w <= 2; w++)
        if (run_case(ds, w, true)) goto fail;
    tdm_dataset_free(ds);
    return 0;
fail:
    fprintf(stderr, "bench_loader: %s\n", tdm_last_error());
    tdm_dataset_free(ds);
    return 1;
}
