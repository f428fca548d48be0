/* Writes image data sets made from Fashion-MNIST (Debian's /usr/share/datasets/fashion-mnist),
 * for tests/test_images.c and for real training runs on folders of images:
 *
 *   make_image_data OUT_DIR [--limit N] [--test-limit M] [--fashion DIR] [--photo WxH]
 *
 *   OUT_DIR/png/{train,test}/<class>/<index>.png   grey 28x28 PNG (libspng)
 *   OUT_DIR/jpeg/{train,test}/<class>/<index>.jpg  grey 28x28 JPEG, quality 95 (TurboJPEG)
 *   OUT_DIR/cifar10/data_batch_{1..5}.bin, test_batch.bin
 *       CIFAR-10's binary format: each image zero-padded to 32x32 (2 pixels each side) and
 *       replicated to 3 channels; the train split divided over the 5 batches in order
 *   OUT_DIR/bad/<class>/...  a small ImageFolder of good PNGs (two per class, classes 0-4)
 *       and malformed files: 0_T-shirt_top/empty.jpg (zero bytes), 1_Trouser/text.jpg (text),
 *       2_Pullover/badsig.png (a PNG whose signature is damaged) fail at open;
 *       3_Dress/truncated.jpg (half a JPEG) and 4_Coat/badcrc.png (IDAT's CRC
 *       flipped)
 *       open and fail to decode.
 *
 * <class> is "<label>_<name>" (0_T-shirt_top .. 9_Ankle_boot), so that the sorted folder
 * names are in label order and an ImageFolder's labels are the IDX labels; <index> is the
 * image's index in its IDX split, zero-padded to 5 digits, so that the files of a class sort
 * in IDX order. --limit N writes only the first N images of each split, --test-limit M the
 * first M of the test split (default: N).
 *
 * --photo WxH writes instead only OUT_DIR/photo/{train,test}/<class>/<index>.jpg: each image
 * enlarged (bilinear) to W x H, coloured by a different tint per channel, with mild noise,
 * as RGB JPEG at quality 90 (4:2:0, what cameras and most web photos use). Debian has no
 * photo data set; this stands in for one where the size of the files and of the pixels is
 * what matters (bench/bench_image_loader.c): at 500x375 the files come to ~43 KB (the noise
 * gives the entropy coder photo-like work; real photos of that size are often larger), where
 * a 28x28 one is 1 KB and decodes in microseconds.
 *
 * Exit status 0, or 1 with the reason on stderr.
 */
#include "tandem/tandem.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <spng.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <turbojpeg.h>
#include <unistd.h>

#define SIDE       28
#define CIFAR_SIDE 32
#define QUALITY    95

static const char *const CLASSES[10] = {"0_T-shirt_top", "1_Trouser",   "2_Pullover", "3_Dress",
                                        "4_Coat",        "5_Sandal",    "6_Shirt",    "7_Sneaker",
                                        "8_Bag",         "9_Ankle_boot"};

static int fail(const char *what, const char *path) {
    fprintf(stderr, "make_image_data: %s %s: %s\n", what, path, strerror(errno));
    return -1;
}

/* mkdir -p */
static int make_dirs(const char *path) {
    char p[4096];
    snprintf(p, sizeof p, "%s", path);
    for (char *s = p + 1;; s++) {
        if (*s != '/' && *s != '\0') continue;
        char c = *s;
        *s = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST) return fail("cannot make", p);
        if (!(*s = c)) return 0;
    }
}

static int write_file(const char *path, const void *data, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return fail("cannot create", path);
    const char *p = (const char *)data;
    while (n) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return close(fd), fail("cannot write", path);
        p += k, n -= (size_t)k;
    }
    return close(fd) == 0 ? 0 : fail("cannot close", path);
}

/* ---- encoders --------------------------------------------------------------------------- */

/* A grey 8-bit PNG of px [h, w] (malloc'd; *n its size), or NULL. */
static void *png_encode(const unsigned char *px, int w, int h, size_t *n) {
    spng_ctx *ctx = spng_ctx_new(SPNG_CTX_ENCODER);
    struct spng_ihdr ihdr = {.width = (uint32_t)w,
                             .height = (uint32_t)h,
                             .bit_depth = 8,
                             .color_type = SPNG_COLOR_TYPE_GRAYSCALE};
    int err = ctx ? spng_set_option(ctx, SPNG_ENCODE_TO_BUFFER, 1) : SPNG_EMEM;
    if (!err) err = spng_set_ihdr(ctx, &ihdr);
    if (!err) err = spng_encode_image(ctx, px, (size_t)w * h, SPNG_FMT_PNG, SPNG_ENCODE_FINALIZE);
    void *out = err ? NULL : spng_get_png_buffer(ctx, n, &err);
    if (err) fprintf(stderr, "make_image_data: PNG encoder: %s\n", spng_strerror(err));
    spng_ctx_free(ctx);
    return out;
}

/* A grey JPEG of px [h, w] at QUALITY into *buf (TurboJPEG's, reused), or -1. */
static int jpeg_encode(tjhandle tj, const unsigned char *px, int w, int h, unsigned char **buf,
                       unsigned long *n) {
    if (tjCompress2(tj, px, w, 0, h, TJPF_GRAY, buf, n, TJSAMP_GRAY, QUALITY, TJFLAG_ACCURATEDCT) ==
        0)
        return 0;
    fprintf(stderr, "make_image_data: JPEG encoder: %s\n", tjGetErrorStr2(tj));
    return -1;
}

/* ---- the three copies of a split ------------------------------------------------------- */

typedef struct {
    const char *out;
    tdm_dataset *ds;
    int64_t n;          /* images written */
    unsigned char *px;  /* [n, 28, 28] */
    unsigned char *lab; /* [n] */
} split;

/* The split's first n images as bytes (the IDX values: x * 255 is exact). */
static int split_read(split *s, bool train, const char *fashion, int64_t limit) {
    s->ds = tdm_fashion_mnist(fashion, train);
    if (!s->ds) {
        fprintf(stderr, "make_image_data: %s\n", tdm_last_error());
        return -1;
    }
    s->n = limit >= 0 && limit < s->ds->n ? limit : s->ds->n;
    s->px = (unsigned char *)malloc((size_t)s->n * SIDE * SIDE);
    s->lab = (unsigned char *)malloc((size_t)s->n);
    float x[SIDE * SIDE];
    if (!s->px || !s->lab) return fprintf(stderr, "make_image_data: out of memory\n"), -1;
    for (int64_t i = 0; i < s->n; i++) {
        int64_t y = 0;
        if (s->ds->ops->get(s->ds, i, x, &y)) return -1;
        for (int j = 0; j < SIDE * SIDE; j++)
            s->px[i * SIDE * SIDE + j] = (unsigned char)lrintf(x[j] * 255.0f);
        s->lab[i] = (unsigned char)y;
    }
    return 0;
}

/* OUT/<kind>/<name>/<class>/ for every class */
static int class_dirs(const char *out, const char *kind, const char *name) {
    char p[4096];
    for (int c = 0; c < 10; c++) {
        snprintf(p, sizeof p, "%s/%s/%s/%s", out, kind, name, CLASSES[c]);
        if (make_dirs(p)) return -1;
    }
    return 0;
}

static int write_png_split(const split *s, const char *name) {
    char p[4096];
    if (class_dirs(s->out, "png", name)) return -1;
    for (int64_t i = 0; i < s->n; i++) {
        size_t n = 0;
        void *png = png_encode(s->px + i * SIDE * SIDE, SIDE, SIDE, &n);
        snprintf(p, sizeof p, "%s/png/%s/%s/%05lld.png", s->out, name, CLASSES[s->lab[i]],
                 (long long)i);
        int rc = png ? write_file(p, png, n) : -1;
        free(png);
        if (rc) return -1;
    }
    return 0;
}

static int write_jpeg_split(const split *s, const char *name, tjhandle tj) {
    char p[4096];
    unsigned char *buf = NULL;
    unsigned long n = 0;
    int rc = class_dirs(s->out, "jpeg", name);
    for (int64_t i = 0; !rc && i < s->n; i++) {
        rc = jpeg_encode(tj, s->px + i * SIDE * SIDE, SIDE, SIDE, &buf, &n);
        snprintf(p, sizeof p, "%s/jpeg/%s/%s/%05lld.jpg", s->out, name, CLASSES[s->lab[i]],
                 (long long)i);
        if (!rc) rc = write_file(p, buf, n);
    }
    tjFree(buf);
    return rc;
}

/* A "photo" from a 28x28 grey image: bilinear (half-pixel centres, edges clamped) to w x h,
 * then per channel a tint that also varies across the image (so the chroma planes are not
 * flat) and +-10 levels of noise from a hash of (image, pixel, channel), as RGB [h, w, 3]. */
static void photo_make(const unsigned char *g, int64_t image, int w, int h, unsigned char *rgb) {
    for (int y = 0; y < h; y++) {
        float sy = ((float)y + 0.5f) * SIDE / (float)h - 0.5f;
        sy = sy < 0 ? 0 : sy;
        int y0 = (int)sy, y1 = y0 + 1 < SIDE ? y0 + 1 : SIDE - 1;
        float fy = sy - (float)y0;
        for (int x = 0; x < w; x++) {
            float sx = ((float)x + 0.5f) * SIDE / (float)w - 0.5f;
            sx = sx < 0 ? 0 : sx;
            int x0 = (int)sx, x1 = x0 + 1 < SIDE ? x0 + 1 : SIDE - 1;
            float fx = sx - (float)x0;
            float v = (1 - fy) * ((1 - fx) * g[y0 * SIDE + x0] + fx * g[y0 * SIDE + x1]) +
                      fy * ((1 - fx) * g[y1 * SIDE + x0] + fx * g[y1 * SIDE + x1]);
            float u = (float)x / (float)w, t = (float)y / (float)h;
            float c[3] = {0.85f * v + 30.0f * t, 0.6f * v + 70.0f * u,
                          0.45f * (255.0f - v) + 40.0f * (1.0f - t)};
            for (int k = 0; k < 3; k++) {
                uint32_t z = (uint32_t)(((uint64_t)image * 2654435761u) ^
                                        (uint64_t)((y * w + x) * 3 + k) * 0x9e3779b9u);
                z ^= z >> 15, z *= 0x2c1b3c6du, z ^= z >> 12, z *= 0x297a2d39u, z ^= z >> 15;
                float q = c[k] + (float)(z % 21) - 10.0f;
                rgb[((size_t)y * w + x) * 3 + k] = (unsigned char)(q < 0 ? 0 : q > 255 ? 255 : q);
            }
        }
    }
}

/* OUT/photo/<name>/<class>/<index>.jpg for every image of the split (see the header). */
static int write_photo_split(const split *s, const char *name, tjhandle tj, int w, int h,
                             size_t *bytes) {
    char p[4096];
    unsigned char *buf = NULL, *rgb = (unsigned char *)malloc((size_t)w * h * 3);
    unsigned long n = 0;
    int rc = rgb ? class_dirs(s->out, "photo", name) : -1;
    for (int64_t i = 0; !rc && i < s->n; i++) {
        photo_make(s->px + i * SIDE * SIDE, i, w, h, rgb);
        if (tjCompress2(tj, rgb, w, 0, h, TJPF_RGB, &buf, &n, TJSAMP_420, 90, 0) != 0) {
            fprintf(stderr, "make_image_data: JPEG encoder: %s\n", tjGetErrorStr2(tj));
            rc = -1;
            break;
        }
        snprintf(p, sizeof p, "%s/photo/%s/%s/%05lld.jpg", s->out, name, CLASSES[s->lab[i]],
                 (long long)i);
        rc = write_file(p, buf, n);
        *bytes += n;
    }
    tjFree(buf);
    free(rgb);
    return rc;
}

/* Images [first, last) as CIFAR-10 records: label, then R, G, B planes of 32x32. */
static int write_cifar_file(const split *s, int64_t first, int64_t last, const char *file) {
    const size_t rec = 1 + 3 * CIFAR_SIDE * CIFAR_SIDE;
    const int pad = (CIFAR_SIDE - SIDE) / 2;
    unsigned char *b = (unsigned char *)calloc((size_t)(last - first) + 1, rec);
    if (!b) return fprintf(stderr, "make_image_data: out of memory\n"), -1;
    for (int64_t i = first; i < last; i++) {
        unsigned char *r = b + (size_t)(i - first) * rec;
        r[0] = s->lab[i];
        for (int c = 0; c < 3; c++)
            for (int y = 0; y < SIDE; y++)
                memcpy(r + 1 + (size_t)c * CIFAR_SIDE * CIFAR_SIDE + (y + pad) * CIFAR_SIDE + pad,
                       s->px + i * SIDE * SIDE + y * SIDE, SIDE);
    }
    char p[4096];
    snprintf(p, sizeof p, "%s/cifar10/%s", s->out, file);
    int rc = write_file(p, b, (size_t)(last - first) * rec);
    free(b);
    return rc;
}

static int write_cifar(const split *train, const split *test) {
    char p[4096], file[32];
    snprintf(p, sizeof p, "%s/cifar10", train->out);
    if (make_dirs(p)) return -1;
    for (int k = 0; k < 5; k++) {
        snprintf(file, sizeof file, "data_batch_%d.bin", k + 1);
        if (write_cifar_file(train, train->n * k / 5, train->n * (k + 1) / 5, file)) return -1;
    }
    return write_cifar_file(test, 0, test->n, "test_batch.bin");
}

/* ---- the malformed files --------------------------------------------------------------- */

/* The offset of the first segment or chunk named by tag (2 or 4 bytes) in b, or n. */
static size_t find_tag(const unsigned char *b, size_t n, const char *tag, size_t len) {
    for (size_t i = 0; i + len <= n; i++)
        if (!memcmp(b + i, tag, len)) return i;
    return n;
}

/* OUT/bad/<class>/<name> from n bytes */
static int write_bad(const char *out, int c, const char *name, const void *b, size_t n) {
    char p[4096];
    snprintf(p, sizeof p, "%s/bad/%s/%s", out, CLASSES[c], name);
    return write_file(p, b, n);
}

/* Two good PNGs in each of classes 0-4, and one malformed file in each. */
static int write_bad_folder(const split *s, tjhandle tj) {
    char p[4096];
    int64_t first[5] = {-1, -1, -1, -1, -1};
    for (int c = 0; c < 5; c++) {
        snprintf(p, sizeof p, "%s/bad/%s", s->out, CLASSES[c]);
        if (make_dirs(p)) return -1;
        for (int64_t i = 0, k = 0; i < s->n && k < 2; i++) {
            if (s->lab[i] != c) continue;
            size_t n = 0;
            unsigned char *png = png_encode(s->px + i * SIDE * SIDE, SIDE, SIDE, &n);
            char name[32];
            snprintf(name, sizeof name, "%05lld.png", (long long)i);
            int rc = png ? write_bad(s->out, c, name, png, n) : -1;
            free(png);
            if (rc) return -1;
            if (k++ == 0) first[c] = i;
        }
        if (first[c] < 0) return fprintf(stderr, "make_image_data: no image of class %d\n", c), -1;
    }
    static const char text[] = "This is a text file, not a JPEG.\n";
    size_t n = 0;
    unsigned long jn = 0;
    unsigned char *jpeg = NULL, *png = png_encode(s->px + first[2] * SIDE * SIDE, SIDE, SIDE, &n);
    int rc = png ? 0 : -1;
    if (!rc) rc = write_bad(s->out, 0, "empty.jpg", "", 0);
    if (!rc) rc = write_bad(s->out, 1, "text.jpg", text, sizeof text - 1);
    if (!rc) png[6] = 0x00; /* the signature's 0x1a */
    if (!rc) rc = write_bad(s->out, 2, "badsig.png", png, n);
    if (!rc) rc = jpeg_encode(tj, s->px + first[3] * SIDE * SIDE, SIDE, SIDE, &jpeg, &jn);
    size_t sos = rc ? 0 : find_tag(jpeg, jn, "\xff\xda", 2); /* the entropy-coded data */
    if (!rc) rc = write_bad(s->out, 3, "truncated.jpg", jpeg, sos + (jn - sos) / 2);
    free(png);
    png = rc ? NULL : png_encode(s->px + first[4] * SIDE * SIDE, SIDE, SIDE, &n);
    /* IDAT's CRC flipped, its data intact: only the CRC check can see it */
    size_t idat = png ? find_tag(png, n, "IDAT", 4) : n, crc = n;
    if (idat >= 4 && idat < n)
        crc = idat + 4 +
              ((size_t)png[idat - 4] << 24 | (size_t)png[idat - 3] << 16 |
               (size_t)png[idat - 2] << 8 | png[idat - 1]);
    if (!rc && crc < n) png[crc] ^= 0xff;
    if (!rc) rc = crc < n ? write_bad(s->out, 4, "badcrc.png", png, n) : -1;
    free(png);
    tjFree(jpeg);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------ */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int usage(void) {
    fprintf(stderr, "usage: make_image_data OUT_DIR [--limit N] [--test-limit M] [--fashion DIR] "
                    "[--photo WxH]\n");
    return 1;
}

static int write_all(split *train, split *test) {
    tjhandle tj = tjInitCompress();
    if (!tj) return fprintf(stderr, "make_image_data: %s\n", tjGetErrorStr2(NULL)), -1;
    int rc = make_dirs(train->out);
    if (!rc) rc = write_png_split(train, "train");
    if (!rc) rc = write_png_split(test, "test");
    if (!rc) rc = write_jpeg_split(train, "train", tj);
    if (!rc) rc = write_jpeg_split(test, "test", tj);
    if (!rc) rc = write_cifar(train, test);
    if (!rc) rc = write_bad_folder(train, tj);
    tjDestroy(tj);
    return rc;
}

/* The photo folder only (--photo). */
static int write_photos(split *train, split *test, int w, int h) {
    tjhandle tj = tjInitCompress();
    if (!tj) return fprintf(stderr, "make_image_data: %s\n", tjGetErrorStr2(NULL)), -1;
    size_t bytes = 0;
    int rc = write_photo_split(train, "train", tj, w, h, &bytes);
    if (!rc) rc = write_photo_split(test, "test", tj, w, h, &bytes);
    if (!rc)
        printf("make_image_data: %dx%d RGB JPEGs, %.1f KB each on average\n", w, h,
               (double)bytes / 1024.0 / (double)(train->n + test->n));
    tjDestroy(tj);
    return rc;
}

int main(int argc, char **argv) {
    const char *out = NULL, *fashion = NULL;
    int64_t limit = -1, test_limit = 0;
    int photo_w = 0, photo_h = 0;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--limit") && a + 1 < argc)
            limit = strtoll(argv[++a], NULL, 10);
        else if (!strcmp(argv[a], "--test-limit") && a + 1 < argc)
            test_limit = strtoll(argv[++a], NULL, 10);
        else if (!strcmp(argv[a], "--fashion") && a + 1 < argc)
            fashion = argv[++a];
        else if (!strcmp(argv[a], "--photo") && a + 1 < argc) {
            if (sscanf(argv[++a], "%dx%d", &photo_w, &photo_h) != 2 || photo_w < 1 || photo_h < 1 ||
                photo_w > 4096 || photo_h > 4096)
                return usage();
        } else if (argv[a][0] != '-' && !out)
            out = argv[a];
        else
            return usage();
    }
    if (!test_limit) test_limit = limit;
    if (!out || limit == 0 || limit < -1 || test_limit < -1) return usage();
    if (strlen(out) > 3000) return fprintf(stderr, "make_image_data: OUT_DIR is too long\n"), 1;
    double t0 = now();
    split train = {.out = out}, test = {.out = out};
    int rc = split_read(&train, true, fashion, limit);
    if (!rc) rc = split_read(&test, false, fashion, test_limit);
    if (!rc)
        rc = photo_w ? write_photos(&train, &test, photo_w, photo_h) : write_all(&train, &test);
    if (!rc)
        printf("make_image_data: %lld train and %lld test images as %s in %s (%.1f s)\n",
               (long long)train.n, (long long)test.n,
               photo_w ? "photo-sized JPEGs" : "PNG, JPEG and CIFAR-10", out, now() - t0);
    for (split *s = &train; s; s = s == &train ? &test : NULL) {
        tdm_dataset_free(s->ds);
        free(s->px);
        free(s->lab);
    }
    return rc ? 1 : 0;
}
