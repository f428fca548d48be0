/* The image transforms on one core: each step, and the ImageNet presets, on a 500 x 375 RGB
 * image (an average ImageNet photo), as one loader worker runs them per sample.
 *
 * Output, one line per case: "tandem transform <text> <us> us/image" (the best of 9 runs of
 * 50 samples each, the sample index changing so the random steps draw anew; the best, as
 * the machines this runs on are shared and others' work only ever adds time). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tandem/tandem.h"
#include "tandem/transforms.h"

enum { C = 3, H = 375, W = 500, REPS = 9, SAMPLES = 50 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The fewest microseconds per image of text on img; negative on an error. */
static double run_case(const char *text, const tdm_image *img, float *out) {
    tdm_transform *tf = tdm_transform_parse(text, 224);
    if (!tf) return -1.0;
    double t[REPS];
    int64_t index = 0;
    for (int r = 0; r < REPS; r++) {
        double t0 = now_s();
        for (int s = 0; s < SAMPLES; s++)
            if (tdm_transform_apply(tf, img, out, 1, 0, index++) != TDM_OK) return -1.0;
        t[r] = (now_s() - t0) / SAMPLES * 1e6;
    }
    tdm_transform_free(tf);
    qsort(t, REPS, sizeof t[0], cmp_double);
    return t[0];
}

int main(void) {
    static const char *const cases[] = {
        "Resize(256)",
        "CenterCrop(224)",
        "Resize(256),CenterCrop(224)",
        "RandomResizedCrop(224)",
        "RandomCrop(224, padding=4)",
        "RandomHorizontalFlip(p=1)",
        "ColorJitter(0.4, 0.4, 0.4)",
        "Grayscale(3)",
        "Normalize(imagenet)",
        "RandomErasing(p=1)",
        "imagenet-train",
        "imagenet-eval",
    };
    float *x = malloc((size_t)C * H * W * sizeof *x), *out = malloc((size_t)C * H * W * 4 * 4);
    if (!x || !out) return 1;
    uint32_t s = 12345;
    for (int64_t i = 0; i < (int64_t)C * H * W; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)(s >> 8) / 16777216.0f;
    }
    tdm_image img = {.c = C, .h = H, .w = W, .data = x};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        double us = run_case(cases[k], &img, out);
        if (us < 0) {
            fprintf(stderr, "bench_transforms: %s: %s\n", cases[k], tdm_last_error());
            return 1;
        }
        printf("tandem transform %s %.0f us/image\n", cases[k], us);
    }
    free(x);
    free(out);
    return 0;
}
