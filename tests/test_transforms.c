/* Image transforms (transforms.h): torchvision's pixels for fixed parameters (fixtures from
 * tests/fixtures/gen_transforms.py), the random steps' draws (ranges, rates, determinism, the
 * same from two threads), the text (every step, presets, round trips, errors with their
 * position) and the output shapes. */
#include <pthread.h>

#include "check.h"
#include "data/transforms_internal.h"

#include "fixtures/transforms_fixtures.h"

#define FIXTURE_ATOL 1e-5

/* The fixtures' input: ((3 i^2 + 17 y + 5 i y + 31 c) mod 97) / 96 (gen_transforms.py). */
static float *tf_input(int64_t c, int64_t h, int64_t w) {
    float *x = malloc((size_t)(c * h * w) * sizeof *x);
    for (int64_t k = 0; k < c; k++)
        for (int64_t y = 0; y < h; y++)
            for (int64_t i = 0; i < w; i++)
                x[(k * h + y) * w + i] =
                    (float)((3 * i * i + 17 * y + 5 * i * y + 31 * k) % 97) / 96.0f;
    return x;
}

/* ---- fixtures ---- */

/* Runs case f's kernel on x [f->in] into out; TDM_OK or an error. */
static int run_op(const tff_case *f, float *x, float *out) {
    int64_t c = f->in[0], h = f->in[1], w = f->in[2], n = c * h * w;
    const int64_t *a = f->a;
    if (!strcmp(f->op, "resized_crop"))
        return tdm_tf_resample(x, c, h, w, (tdm_tf_box){a[0], a[1], a[2], a[3]}, a[4], a[5],
                               (tdm_tf_box){0, 0, a[4], a[5]}, out);
    if (!strcmp(f->op, "crop_pad")) {
        tdm_tf_crop(x, c, h, w, (tdm_tf_box){a[1] - a[0], a[2] - a[0], a[3], a[4]}, out);
        return TDM_OK;
    }
    if (!strcmp(f->op, "hflip")) {
        tdm_tf_hflip(x, c, h, w, out);
        return TDM_OK;
    }
    memcpy(out, x, (size_t)n * sizeof(float)); /* the rest work in place */
    if (!strcmp(f->op, "brightness"))
        tdm_tf_brightness(out, c, h, w, f->f[0]);
    else if (!strcmp(f->op, "contrast"))
        tdm_tf_contrast(out, c, h, w, f->f[0]);
    else if (!strcmp(f->op, "saturation"))
        tdm_tf_saturation(out, c, h, w, f->f[0]);
    else if (!strcmp(f->op, "erase"))
        tdm_tf_erase(out, c, h, w, (tdm_tf_box){a[0], a[1], a[2], a[3]}, f->f[0]);
    else
        return TDM_ERR_ARG;
    return TDM_OK;
}

/* Runs case f through the public API (its text) or its kernel; the largest difference from
 * torchvision's output, or INFINITY when it did not run. */
static double run_fixture(const tff_case *f) {
    int64_t n = f->out[0] * f->out[1] * f->out[2];
    float *x = tf_input(f->in[0], f->in[1], f->in[2]), *out = calloc((size_t)n, sizeof *out);
    int st = TDM_ERR_ARG;
    if (f->text) {
        tdm_transform *tf = tdm_transform_parse(f->text, 0);
        tdm_shape s = TDM_SHAPE0;
        tdm_image img = {.c = f->in[0], .h = f->in[1], .w = f->in[2], .data = x};
        if (tf &&
            tdm_transform_output_shape(tf, TDM_SHAPE(f->in[0], f->in[1], f->in[2]), &s) == TDM_OK &&
            s.d[0] == f->out[0] && s.d[1] == f->out[1] && s.d[2] == f->out[2])
            st = tdm_transform_apply(tf, &img, out, 1, 0, 0);
        tdm_transform_free(tf);
    } else {
        st = run_op(f, x, out);
    }
    double worst = st == TDM_OK ? 0.0 : INFINITY;
    for (int64_t i = 0; i < n && st == TDM_OK; i++)
        if (fabs((double)out[i] - (double)f->y[i]) > worst)
            worst = fabs((double)out[i] - (double)f->y[i]);
    free(x);
    free(out);
    return worst;
}

static void test_fixtures(void) {
    double all = 0.0;
    for (int k = 0; k < TFF_N_CASES; k++) {
        const tff_case *f = &tff_cases[k];
        double worst = run_fixture(f);
        CHECK(worst <= FIXTURE_ATOL, "%s on [%lld, %lld, %lld]: max |diff| %g (%s)", f->name,
              (long long)f->in[0], (long long)f->in[1], (long long)f->in[2], worst,
              tdm_last_error());
        if (worst > all) all = worst;
    }
    printf("fixtures: %d torchvision cases, max |diff| %.3g (tolerance %g)\n", TFF_N_CASES, all,
           FIXTURE_ATOL);
}

/* ---- the draws of the random steps ---- */

static void test_rrc_params(void) {
    const float scale[2] = {0.08f, 1.0f}, ratio[2] = {3.0f / 4.0f, 4.0f / 3.0f};
    int64_t H = 120, W = 160, bad = 0, small = 0, large = 0;
    for (int64_t i = 0; i < 2000; i++) {
        tdm_tf_rng g;
        tdm_tf_rng_init(&g, 7, 0, i, 0);
        tdm_tf_box b = tdm_tf_rrc_params(&g, H, W, scale, ratio);
        double frac = (double)(b.h * b.w) / (double)(H * W), aspect = (double)b.w / (double)b.h;
        /* rounding the sides to pixels moves area and aspect a little outside their ranges */
        if (b.top < 0 || b.left < 0 || b.top + b.h > H || b.left + b.w > W || frac < 0.07 ||
            frac > 1.0 || aspect < 0.75 * 0.9 || aspect > 4.0 / 3.0 * 1.1)
            bad++;
        small += frac < 0.2;
        large += frac > 0.7;
    }
    CHECK(bad == 0, "%lld of 2000 RandomResizedCrop boxes outside the image, scale or ratio",
          (long long)bad);
    /* area uniform in [0.08, 1] (less the boxes that do not fit): both ends are common */
    CHECK(small > 150 && large > 150, "areas not spread over scale: %lld below 0.2, %lld above 0.7",
          (long long)small, (long long)large);
    /* the fallback: no box of aspect in [2, 3] fits a square: the central crop of aspect 2 */
    tdm_tf_rng g;
    tdm_tf_rng_init(&g, 7, 0, 0, 0);
    const float wide[2] = {2.0f, 3.0f}, most[2] = {0.9f, 1.0f};
    tdm_tf_box b = tdm_tf_rrc_params(&g, 10, 10, most, wide);
    CHECK(b.top == 2 && b.left == 0 && b.h == 5 && b.w == 10,
          "fallback box (%lld, %lld, %lld, %lld)", (long long)b.top, (long long)b.left,
          (long long)b.h, (long long)b.w);
}

/* Applies text to x [c, h, w] with the draws of (seed, epoch, index) into out. */
static int apply_text(const char *text, const float *x, int64_t c, int64_t h, int64_t w, float *out,
                      uint64_t seed, int64_t epoch, int64_t index) {
    tdm_transform *tf = tdm_transform_parse(text, 0);
    if (!tf) return -1;
    tdm_image img = {.c = c, .h = h, .w = w, .data = (float *)x};
    int st = tdm_transform_apply(tf, &img, out, seed, epoch, index);
    tdm_transform_free(tf);
    return st;
}

/* How many of 2000 samples text flips: a row [0, 1] comes out as [1, 0]. */
static int count_flips(const char *text) {
    const float x[2] = {0.0f, 1.0f};
    int flips = 0;
    for (int64_t i = 0; i < 2000; i++) {
        float out[2] = {-1, -1};
        if (apply_text(text, x, 1, 1, 2, out, 3, 1, i) != TDM_OK) return -1;
        flips += out[0] == 1.0f && out[1] == 0.0f;
    }
    return flips;
}

static void test_flip_rate(void) {
    int half = count_flips("RandomHorizontalFlip()");
    /* binomial(2000, 1/2): sd 22; 100 is 4.5 sd */
    CHECK(half > 900 && half < 1100, "RandomHorizontalFlip() flipped %d of 2000", half);
    CHECK(count_flips("RandomHorizontalFlip(p=0)") == 0, "p=0 flipped");
    CHECK(count_flips("RandomHorizontalFlip(p=1)") == 2000, "p=1 did not always flip");
    int some = count_flips("RandomHorizontalFlip(0.1)");
    CHECK(some > 120 && some < 280, "RandomHorizontalFlip(0.1) flipped %d of 2000", some);
}

static void test_erasing(void) {
    enum { S = 20 };
    float x[S * S], out[S * S];
    for (int i = 0; i < S * S; i++) x[i] = 1.0f;
    int erased = 0, bad = 0;
    for (int64_t i = 0; i < 2000; i++) {
        if (apply_text("RandomErasing()", x, 1, S, S, out, 5, 0, i) != TDM_OK) {
            bad++;
            continue;
        }
        /* the zeros form one rectangle of area in about scale (0.02, 0.33) */
        int zeros = 0, y0 = S, y1 = -1, x0 = S, x1 = -1;
        for (int y = 0; y < S; y++)
            for (int k = 0; k < S; k++)
                if (out[y * S + k] == 0.0f) {
                    zeros++;
                    y0 = y < y0 ? y : y0, y1 = y > y1 ? y : y1;
                    x0 = k < x0 ? k : x0, x1 = k > x1 ? k : x1;
                }
        if (zeros == 0) continue;
        erased++;
        bad += zeros != (y1 - y0 + 1) * (x1 - x0 + 1) || zeros > 0.45 * S * S;
    }
    CHECK(bad == 0, "%d erasures failed or were not one rectangle within scale", bad);
    CHECK(erased > 900 && erased < 1100, "RandomErasing() erased %d of 2000", erased);
}

static void test_random_crop_offsets(void) {
    enum { S = 8, P = 2 };
    float x[S * S], out[S * S];
    for (int i = 0; i < S * S; i++) x[i] = (float)(i + 1);
    int seen[2 * P + 1][2 * P + 1] = {{0}}, bad = 0;
    for (int64_t i = 0; i < 2000; i++) {
        if (apply_text("RandomCrop(8, padding=2)", x, 1, S, S, out, 9, 2, i) != TDM_OK) {
            bad++;
            continue;
        }
        /* the offset from where pixel (0, 0) landed, or where the output's first pixel came
         * from when (0, 0) was cropped off */
        int dy = 99, dx = 99;
        for (int k = 0; k < S * S; k++)
            if (out[k] != 0.0f) {
                int src = (int)out[k] - 1;
                dy = src / S - k / S, dx = src % S - k % S;
                break;
            }
        if (dy < -P || dy > P || dx < -P || dx > P) {
            bad++;
            continue;
        }
        seen[dy + P][dx + P]++;
    }
    int least = 2000;
    for (int a = 0; a <= 2 * P; a++)
        for (int b = 0; b <= 2 * P; b++) least = seen[a][b] < least ? seen[a][b] : least;
    CHECK(bad == 0, "%d RandomCrop outputs with no offset in [-2, 2]", bad);
    /* 25 offsets, 80 each on average (sd 8.8) */
    CHECK(least > 40, "an offset of RandomCrop(8, padding=2) came %d times in 2000", least);
}

/* The factor ColorJitter drew, seen on an image it scales: [lo, hi] over 500 samples. */
static void jitter_range(const char *text, const float *x, int64_t c, int64_t n, int which,
                         double *lo, double *hi) {
    *lo = INFINITY, *hi = -INFINITY;
    for (int64_t i = 0; i < 500; i++) {
        float out[6];
        if (apply_text(text, x, c, 1, n, out, 11, 0, i) != TDM_OK) return;
        double f = which == 0   ? out[0] / x[0]                      /* brightness */
                   : which == 1 ? (out[1] - out[0]) / (x[1] - x[0])  /* contrast */
                                : (out[0] - out[4]) / (x[0] - x[4]); /* saturation: r - b */
        *lo = f < *lo ? f : *lo, *hi = f > *hi ? f : *hi;
    }
}

static void test_color_jitter(void) {
    double lo, hi;
    const float grey[2] = {0.5f, 0.5f}, pair[2] = {0.25f, 0.75f};
    jitter_range("ColorJitter(brightness=0.4)", grey, 1, 2, 0, &lo, &hi);
    CHECK(lo >= 0.6 - 1e-6 && lo < 0.65 && hi <= 1.4 + 1e-6 && hi > 1.35,
          "brightness factors in [%g, %g], expected [0.6, 1.4]", lo, hi);
    jitter_range("ColorJitter(contrast=0.5)", pair, 1, 2, 1, &lo, &hi);
    CHECK(lo >= 0.5 - 1e-6 && lo < 0.55 && hi <= 1.5 + 1e-6 && hi > 1.45,
          "contrast factors in [%g, %g], expected [0.5, 1.5]", lo, hi);
    /* pixel 0 (0.2, 0.5, 0.8): the blend with its grey scales r - b by the factor */
    const float rgb[6] = {0.2f, 0.5f, 0.5f, 0.5f, 0.8f, 0.5f};
    jitter_range("ColorJitter(saturation=0.3)", rgb, 3, 2, 2, &lo, &hi);
    CHECK(lo >= 0.7 - 1e-5 && lo < 0.75 && hi <= 1.3 + 1e-5 && hi > 1.25,
          "saturation factors in [%g, %g], expected [0.7, 1.3]", lo, hi);
}

/* ---- determinism ---- */

enum { DC = 3, DH = 40, DW = 50, DO = 24, DN = 64 };
static const char *const det_text = "RandomResizedCrop(24),RandomHorizontalFlip(),"
                                    "ColorJitter(0.4,0.4,0.4),Normalize(imagenet),RandomErasing()";

static float *det_outputs(int64_t first, int64_t step) {
    float *x = tf_input(DC, DH, DW), *out = calloc((size_t)DN * DC * DO * DO, sizeof(float));
    tdm_transform *tf = tdm_transform_parse(det_text, 0);
    tdm_image img = {.c = DC, .h = DH, .w = DW, .data = x};
    for (int64_t i = first; tf && i < DN; i += step)
        if (tdm_transform_apply(tf, &img, out + i * DC * DO * DO, 42, 3, i) != TDM_OK) break;
    tdm_transform_free(tf);
    free(x);
    return out;
}

typedef struct {
    int64_t first;
    float *out;
} det_job;

static void *det_thread(void *arg) {
    det_job *j = arg;
    j->out = det_outputs(j->first, 2);
    return NULL;
}

static void test_determinism(void) {
    size_t one = (size_t)DC * DO * DO;
    float *serial = det_outputs(0, 1);
    /* two threads, each every other sample, at once */
    det_job jobs[2] = {{0, NULL}, {1, NULL}};
    pthread_t th[2];
    for (int t = 0; t < 2; t++) pthread_create(&th[t], NULL, det_thread, &jobs[t]);
    for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
    int differ = 0, same_as_next = 0;
    for (int64_t i = 0; i < DN; i++) {
        differ += memcmp(serial + i * one, jobs[i % 2].out + i * one, one * sizeof(float)) != 0;
        if (i + 1 < DN) same_as_next += !memcmp(serial + i * one, serial + (i + 1) * one, one * 4);
    }
    CHECK(differ == 0, "%d of %d samples differ between one thread and two", differ, DN);
    CHECK(same_as_next == 0, "%d samples equal the next one: the index is not in the draws",
          same_as_next);
    /* another epoch, another seed: other draws */
    float *x = tf_input(DC, DH, DW), *o = malloc(one * sizeof(float));
    CHECK(apply_text(det_text, x, DC, DH, DW, o, 42, 3, 5) == TDM_OK &&
              !memcmp(o, serial + 5 * one, one * sizeof(float)),
          "sample 5 again is not the same");
    CHECK(apply_text(det_text, x, DC, DH, DW, o, 42, 4, 5) == TDM_OK &&
              memcmp(o, serial + 5 * one, one * sizeof(float)),
          "epoch 4 drew what epoch 3 drew");
    CHECK(apply_text(det_text, x, DC, DH, DW, o, 43, 3, 5) == TDM_OK &&
              memcmp(o, serial + 5 * one, one * sizeof(float)),
          "seed 43 drew what seed 42 drew");
    /* a step appended leaves the draws of the steps before it as they were */
    float *a = malloc(one * sizeof(float)), *b = malloc(one * sizeof(float));
    CHECK(apply_text("RandomResizedCrop(24)", x, DC, DH, DW, a, 42, 3, 5) == TDM_OK &&
              apply_text("RandomResizedCrop(24),RandomHorizontalFlip(p=0)", x, DC, DH, DW, b, 42, 3,
                         5) == TDM_OK &&
              !memcmp(a, b, one * sizeof(float)),
          "appending a step changed the crop");
    free(a), free(b), free(o), free(x), free(serial), free(jobs[0].out), free(jobs[1].out);
}

/* ---- text ---- */

static bool steps_equal(const tdm_transform_step *a, const tdm_transform_step *b) {
    bool eq = a->kind == b->kind && a->size[0] == b->size[0] && a->size[1] == b->size[1] &&
              a->padding == b->padding && a->p == b->p && a->brightness == b->brightness &&
              a->contrast == b->contrast && a->saturation == b->saturation &&
              a->channels == b->channels && a->value == b->value;
    for (int k = 0; k < 2; k++) eq = eq && a->scale[k] == b->scale[k] && a->ratio[k] == b->ratio[k];
    for (int k = 0; k < 3; k++) eq = eq && a->mean[k] == b->mean[k] && a->std[k] == b->std[k];
    return eq;
}

/* text parses, prints, and the print reads back to the same steps and the same print;
 * returns the parsed transform (or NULL) for more checks. */
static tdm_transform *round_trip(const char *text, int64_t image_size) {
    char s1[512], s2[512];
    tdm_transform *a = tdm_transform_parse(text, image_size);
    CHECK(a != NULL, "\"%s\" did not parse: %s", text, tdm_last_error());
    if (!a) return NULL;
    tdm_transform_str(a, s1, sizeof s1);
    tdm_transform *b = tdm_transform_parse(s1, 0);
    CHECK(b != NULL, "\"%s\" (the print of \"%s\") did not parse: %s", s1, text, tdm_last_error());
    if (!b) return a;
    tdm_transform_str(b, s2, sizeof s2);
    bool same = a->n == b->n && !strcmp(s1, s2);
    for (int i = 0; same && i < a->n; i++) same = steps_equal(&a->steps[i], &b->steps[i]);
    CHECK(same, "\"%s\" printed \"%s\", which reads back as \"%s\"", text, s1, s2);
    tdm_transform_free(b);
    return a;
}

static void check_print(const char *text, int64_t image_size, const char *want) {
    char buf[512];
    tdm_transform *tf = round_trip(text, image_size);
    if (tf) tdm_transform_str(tf, buf, sizeof buf);
    CHECK(tf && !strcmp(buf, want), "\"%s\" printed \"%s\", expected \"%s\"", text, tf ? buf : "",
          want);
    tdm_transform_free(tf);
}

static void test_parse_steps(void) {
    check_print("RandomCrop(32,padding=4),RandomHorizontalFlip()", 0,
                "RandomCrop(32, padding=4), RandomHorizontalFlip(p=0.5)");
    check_print(" CenterCrop( 28 ) , Resize( [20] ) ", 0, "CenterCrop(28), Resize(20)");
    check_print("Resize((32, 48)),CenterCrop(size=(16, 24))", 0,
                "Resize((32, 48)), CenterCrop((16, 24))");
    check_print("RandomResizedCrop(224)", 0,
                "RandomResizedCrop(224, scale=(0.08, 1.0), ratio=(0.75, 1.3333334))");
    check_print("Normalize(mean=[0.5, 0.5, 0.5], std=(0.25,))", 0,
                "Normalize(mean=(0.5,), std=(0.25,))");
    check_print("Normalize(cifar10), Normalize(fmnist)", 0,
                "Normalize(cifar10), Normalize(fmnist)");
    check_print("ColorJitter()", 0, "ColorJitter()");

    tdm_transform *tf =
        round_trip("RandomResizedCrop((200, 100), scale=(0.25, 0.9), ratio=(0.5, 2))", 0);
    const tdm_transform_step *s = tf ? &tf->steps[0] : NULL;
    CHECK(s && s->kind == TDM_TF_RANDOM_RESIZED_CROP && s->size[0] == 200 && s->size[1] == 100 &&
              s->scale[0] == 0.25f && s->scale[1] == 0.9f && s->ratio[0] == 0.5f &&
              s->ratio[1] == 2.0f,
          "RandomResizedCrop's arguments not read");
    tdm_transform_free(tf);
    tf = round_trip("ColorJitter(0.4, contrast=0.3, saturation=0.2, hue=0), Grayscale(3)", 0);
    CHECK(tf && tf->n == 2 && tf->steps[0].brightness == 0.4f && tf->steps[0].contrast == 0.3f &&
              tf->steps[0].saturation == 0.2f && tf->steps[1].channels == 3,
          "ColorJitter's or Grayscale's arguments not read");
    tdm_transform_free(tf);
    tf = round_trip("Normalize(mean=(0.1, 0.2, 0.3), std=[0.4, 0.5, 0.6])", 0);
    CHECK(tf && tf->steps[0].mean[2] == 0.3f && tf->steps[0].std[1] == 0.5f,
          "Normalize's lists not read");
    tdm_transform_free(tf);
    tf = round_trip("RandomErasing(p=0.25, scale=(0.1, 0.2), ratio=(0.5, 2), value=-1)", 0);
    CHECK(tf && tf->steps[0].p == 0.25f && tf->steps[0].scale[1] == 0.2f &&
              tf->steps[0].ratio[0] == 0.5f && tf->steps[0].value == -1.0f,
          "RandomErasing's arguments not read");
    tdm_transform_free(tf);
    tf = round_trip("RandomHorizontalFlip(0.3), RandomCrop(size=(30, 20))", 0);
    CHECK(tf && tf->steps[0].p == 0.3f && tf->steps[1].size[0] == 30 &&
              tf->steps[1].size[1] == 20 && tf->steps[1].padding == 0,
          "RandomHorizontalFlip's p or RandomCrop's size not read");
    tdm_transform_free(tf);
}

static void test_presets(void) {
    int n = 0;
    for (; tdm_transform_presets[n]; n++) {
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)strcspn(tdm_transform_presets[n], ":"),
                 tdm_transform_presets[n]);
        CHECK(strchr(tdm_transform_presets[n], ':'), "preset \"%s\" has no description",
              tdm_transform_presets[n]);
        tdm_transform_free(round_trip(name, 224));
    }
    CHECK(n >= 5, "%d presets", n);
    check_print("imagenet-train", 224,
                "RandomResizedCrop(224, scale=(0.08, 1.0), ratio=(0.75, 1.3333334)), "
                "RandomHorizontalFlip(p=0.5), Normalize(imagenet)");
    check_print(" imagenet-eval ", 224, "Resize(256), CenterCrop(224), Normalize(imagenet)");
    check_print("imagenet-eval", 160, "Resize(182), CenterCrop(160), Normalize(imagenet)");
    check_print("cifar-train", 32,
                "RandomCrop(32, padding=4), RandomHorizontalFlip(p=0.5), "
                "Normalize(cifar10)");
    check_print("cifar-eval", 0, "Normalize(cifar10)");
    check_print("none", 0, "none");
    CHECK_ERROR(tdm_transform_parse("imagenet-train", 0) == NULL, "needs an image size");
}

static void test_parse_errors(void) {
    static const struct {
        const char *text, *want;
    } bad[] = {
        {"Foo(1)", "not \"Foo\" at character 1 "},
        {"Resize 32", "expected '(' after Resize at character 8 "},
        {"RandomCrop(32, padding=x)", "expected padding as an integer >= 0 at character 24 "},
        {"RandomCrop(32, padding=-1)", "expected padding as an integer >= 0 at character 24 "},
        {"Resize(-3)", "expected a size: an integer >= 1 or (h, w) at character 8 "},
        {"Resize(1.5)", "expected a size: an integer >= 1 or (h, w) at character 8 "},
        {"CenterCrop(0)", "expected a size: an integer >= 1 or (h, w) at character 12 "},
        {"Normalize((0.5,), (0,))", "expected std > 0 at character 19 "},
        {"Normalize(0.5)", "Normalize needs mean and std, or imagenet, cifar10 or fmnist at "
                           "character 14 "},
        {"Normalize(imagenett)", "expected mean numbers or imagenet, cifar10 or fmnist at "
                                 "character 11 "},
        {"RandomCrop(32", "expected ',' or ')' in RandomCrop(...) at character 14 "},
        {"Resize(32) x", "expected ',' between steps at character 12 "},
        {"RandomCrop(32, pad=4)", "RandomCrop has no argument pad at character 16 "},
        {"RandomCrop(32, size=4)", "size is given twice at character 16 "},
        {"RandomHorizontalFlip(0.5, 2)", "RandomHorizontalFlip takes at most 1 arguments at "
                                         "character 27 "},
        {"RandomHorizontalFlip(p=1.5)", "expected a number in [0, 1] for p at character 24 "},
        {"RandomResizedCrop(224, scale=(0.5))", "expected (lo, hi) with 0 <= lo <= hi for scale "
                                                "at character 30 "},
        {"RandomResizedCrop(224, scale=(0.5, 1, 2, 3))", "at most 3 numbers in a tuple at "
                                                         "character 42 "},
        {"ColorJitter(hue=0.1)", "hue is not supported"},
        {"Grayscale(2)", "expected num_output_channels 1 or 3 at character 11 "},
        {"Resize(abc)", "expected a size"},
        {"Resize(1e999)", "expected a number at character 8 "},
        {"ToTensor()", "leave ToTensor() out"},
        {"", "expected steps or a preset"},
        {"Resize(32),,", "not \"\" at character 12 "},
        /* the checks of tdm_transform_new behind the parser */
        {"RandomResizedCrop(8, scale=(0, 1))", "transform step 0 (RandomResizedCrop): scale"},
        {"Resize(1600070807884)", "transform step 0 (Resize): size (1600070807884, 0) or "
                                  "padding 0 is more than 65535"},
        {"RandomCrop(8, padding=70000)", "padding 70000 is more than 65535"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tdm_transform *tf = tdm_transform_parse(bad[i].text, 32);
        CHECK(tf == NULL && tdm_last_status() == TDM_ERR_ARG &&
                  strstr(tdm_last_error(), bad[i].want),
              "\"%s\": expected an error containing \"%s\", got \"%s\"", bad[i].text, bad[i].want,
              tf ? "(parsed)" : tdm_last_error());
        tdm_transform_free(tf);
        tdm_clear_error();
    }
}

static void test_new_errors(void) {
    tdm_transform_step s = tdm_transform_defaults(TDM_TF_RESIZE);
    CHECK_ERROR(tdm_transform_new(1, &s) == NULL, "transform step 0 (Resize): size (0, 0)");
    tdm_transform_step two[2] = {tdm_transform_defaults(TDM_TF_RANDOM_HFLIP),
                                 tdm_transform_defaults(TDM_TF_RANDOM_ERASING)};
    two[1].p = 2.0f;
    CHECK_ERROR(tdm_transform_new(2, two) == NULL, "transform step 1 (RandomErasing): p 2");
    s = tdm_transform_defaults(TDM_TF_NORMALIZE);
    s.std[2] = 0.0f;
    CHECK_ERROR(tdm_transform_new(1, &s) == NULL, "channel 2 has mean 0, std 0");
    s = tdm_transform_defaults(TDM_TF_RANDOM_CROP);
    s.size[0] = 8, s.padding = -1;
    CHECK_ERROR(tdm_transform_new(1, &s) == NULL, "padding -1 is negative");
    s = tdm_transform_defaults(TDM_TF_RANDOM_ERASING);
    s.ratio[0] = 0.0f;
    CHECK_ERROR(tdm_transform_new(1, &s) == NULL, "ratio (0, 3.3)");
    s = tdm_transform_defaults(TDM_TF_CENTER_CROP);
    s.size[0] = 12; /* size[1] 0: a square, as torchvision's int size */
    tdm_transform *tf = tdm_transform_new(1, &s);
    CHECK(tf && tf->steps[0].size[1] == 12, "CenterCrop(12) given as size {12, 0}: %s",
          tdm_last_error());
    tdm_transform_free(tf);
}

/* ---- output shapes ---- */

static void check_shape(const char *text, tdm_shape in, tdm_shape want) {
    char a[96], b[96], c[96];
    tdm_transform *tf = tdm_transform_parse(text, 0);
    tdm_shape out = TDM_SHAPE0;
    int st = tf ? tdm_transform_output_shape(tf, in, &out) : -1;
    CHECK(st == TDM_OK && out.ndim == 3 && out.d[0] == want.d[0] && out.d[1] == want.d[1] &&
              out.d[2] == want.d[2],
          "\"%s\" on %s: %s, expected %s (%s)", text, tdm_shape_str(in, a), tdm_shape_str(out, b),
          tdm_shape_str(want, c), tdm_last_error());
    tdm_transform_free(tf);
}

static void check_shape_error(const char *text, tdm_shape in, const char *want) {
    tdm_transform *tf = tdm_transform_parse(text, 0);
    tdm_shape out;
    CHECK(tf != NULL, "\"%s\": %s", text, tdm_last_error());
    if (tf) CHECK_ERROR(tdm_transform_output_shape(tf, in, &out) == TDM_ERR_SHAPE, want);
    tdm_transform_free(tf);
}

static void test_output_shape(void) {
    check_shape("Resize(256),CenterCrop(224)", TDM_SHAPE(3, 0, 0), TDM_SHAPE(3, 224, 224));
    check_shape("Resize(256)", TDM_SHAPE(3, 100, 200), TDM_SHAPE(3, 256, 512));
    check_shape("Resize(256)", TDM_SHAPE(3, 300, 200), TDM_SHAPE(3, 384, 256));
    check_shape("Resize((32, 48))", TDM_SHAPE(3, 0, 0), TDM_SHAPE(3, 32, 48));
    check_shape("RandomResizedCrop(24),Grayscale()", TDM_SHAPE(3, 0, 0), TDM_SHAPE(1, 24, 24));
    check_shape("Grayscale(3),RandomCrop(28, padding=4)", TDM_SHAPE(1, 28, 28),
                TDM_SHAPE(3, 28, 28));
    check_shape("none", TDM_SHAPE(1, 28, 28), TDM_SHAPE(1, 28, 28));
    check_shape("CenterCrop((10, 20)),Resize(5)", TDM_SHAPE(3, 0, 0), TDM_SHAPE(3, 5, 10));
    check_shape_error("Resize(256)", TDM_SHAPE(3, 0, 0),
                      "end it with CenterCrop, RandomResizedCrop");
    check_shape_error("none", TDM_SHAPE(3, 0, 0), "images of shape [3, 0, 0]");
    check_shape_error("RandomCrop(32, padding=2)", TDM_SHAPE(3, 20, 20),
                      "crop 32x32 is larger than the image 20x20 padded by 2");
    check_shape_error("Normalize(imagenet)", TDM_SHAPE(4, 8, 8), "1 or 3 channels, not 4");
    /* a short side of 38632 makes a 9x5 image's long side 69537: over the largest side */
    check_shape_error("Resize(38632)", TDM_SHAPE(1, 9, 5),
                      "transform step 0 (Resize): an image of 9x5 would become 69537x38632, a "
                      "side over 65535");
    check_shape("Resize(38632)", TDM_SHAPE(1, 20, 27), TDM_SHAPE(1, 38632, 52153));
    /* the same check when the size is only known from the image (the fuzzer found it) */
    tdm_transform *thin = tdm_transform_parse("Resize(38632),CenterCrop(8)", 0);
    float px[9 * 5] = {0}, po[8 * 8];
    tdm_image one = {.c = 1, .h = 9, .w = 5, .data = px};
    CHECK_ERROR(thin && tdm_transform_apply(thin, &one, po, 0, 0, 0) == TDM_ERR_SHAPE,
                "would become 69537x38632");
    tdm_transform_free(thin);
    /* the same check when the size is only known from the image */
    tdm_transform *tf = tdm_transform_parse("RandomCrop(32, padding=2)", 0);
    float x[3 * 20 * 20] = {0}, out[3 * 32 * 32];
    tdm_image img = {.c = 3, .h = 20, .w = 20, .data = x};
    CHECK_ERROR(tf && tdm_transform_apply(tf, &img, out, 0, 0, 0) == TDM_ERR_SHAPE,
                "larger than the image 20x20");
    tdm_transform_free(tf);
}

/* img's box {top, left, h, w} copied out as a part of it (tdm_image_decode_part's result). */
static tdm_image part_of(const tdm_image *img, const int64_t box[4]) {
    tdm_image p = {.c = img->c,
                   .h = box[2],
                   .w = box[3],
                   .top = box[0],
                   .left = box[1],
                   .full_h = img->h,
                   .full_w = img->w};
    p.data = malloc(sizeof(float) * (size_t)(p.c * p.h * p.w));
    for (int64_t c = 0; c < p.c; c++)
        for (int64_t y = 0; y < p.h; y++)
            memcpy(p.data + (c * p.h + y) * p.w,
                   img->data + (c * img->h + box[0] + y) * img->w + box[1],
                   sizeof(float) * (size_t)p.w);
    return p;
}

/* A transform that starts with a crop, given only the part tdm_transform_source_box names,
 * writes what it writes from the whole image, bit for bit; a part that does not hold the crop,
 * or a transform that needs the whole image, is an error. */
static void test_source_box(void) {
    enum { C = 3, H = 75, W = 100 };
    static float x[C * H * W], whole[3 * 64 * 64], from_part[3 * 64 * 64];
    for (int i = 0; i < C * H * W; i++) x[i] = (float)((i * 7919) % 1000) / 1000.0f;
    tdm_image img = {.c = C, .h = H, .w = W, .data = x};
    const char *texts[] = {"RandomResizedCrop(64),RandomHorizontalFlip(),Normalize(imagenet)",
                           "RandomResizedCrop(48, scale=(0.5, 1), ratio=(1, 1))",
                           "CenterCrop(40),Normalize(imagenet)"};
    int bad = 0, smaller = 0;
    for (size_t t = 0; t < sizeof texts / sizeof *texts; t++) {
        tdm_transform *tf = tdm_transform_parse(texts[t], 0);
        CHECK(tf != NULL, "%s: %s", texts[t], tdm_last_error());
        tdm_shape out;
        CHECK(tdm_transform_output_shape(tf, TDM_SHAPE(C, H, W), &out) == TDM_OK, "shape");
        size_t bytes = sizeof(float) * (size_t)tdm_shape_numel(out);
        for (int64_t index = 0; index < 50; index++) {
            int64_t box[4];
            tdm_transform_source_box(tf, H, W, 7, 3, index, box);
            smaller += box[2] * box[3] < H * W;
            tdm_image p = part_of(&img, box);
            int r1 = tdm_transform_apply(tf, &img, whole, 7, 3, index);
            int r2 = tdm_transform_apply(tf, &p, from_part, 7, 3, index);
            bad += r1 || r2 || memcmp(whole, from_part, bytes);
            if (index == 0 && t == 0) { /* the part for another draw does not hold this one */
                tdm_transform_source_box(tf, H, W, 7, 3, 1, box);
                free(p.data);
                p = part_of(&img, box);
                if (box[2] < H || box[3] < W)
                    CHECK_ERROR(tdm_transform_apply(tf, &p, from_part, 7, 3, 0) == TDM_ERR_ARG,
                                "its crop is not inside the part of the image given");
            }
            free(p.data);
        }
        tdm_transform_free(tf);
    }
    CHECK(bad == 0 && smaller >= 100, "%d outputs differ from the whole image's (%d parts)", bad,
          smaller);
    tdm_transform *rs = tdm_transform_parse("Resize(32),CenterCrop(32)", 0);
    int64_t box[4];
    tdm_transform_source_box(rs, H, W, 0, 0, 0, box);
    CHECK(box[0] == 0 && box[1] == 0 && box[2] == H && box[3] == W, "Resize reads it all");
    int64_t half[4] = {0, 0, H / 2, W};
    tdm_image p = part_of(&img, half);
    CHECK_ERROR(tdm_transform_apply(rs, &p, whole, 0, 0, 0) == TDM_ERR_ARG,
                "transform step 0 (Resize) needs the whole image");
    free(p.data);
    tdm_transform_free(rs);
}

int main(void) {
    test_fixtures();
    test_rrc_params();
    test_flip_rate();
    test_erasing();
    test_random_crop_offsets();
    test_color_jitter();
    test_determinism();
    test_parse_steps();
    test_presets();
    test_parse_errors();
    test_new_errors();
    test_output_shape();
    test_source_box();
    return check_summary();
}
