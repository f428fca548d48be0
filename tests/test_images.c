/* Images: JPEG and PNG decoding (tdm_image_decode), ImageFolder (tdm_image_folder_open) and
 * CIFAR (tdm_cifar_open), on data tests/make_image_data writes from Fashion-MNIST into a
 * temporary directory (its path is argv[1]; CMake passes it). Skipped (77) without
 * Fashion-MNIST.
 *
 * (a) decoded pixels against Pillow's for files Pillow wrote (tests/fixtures/images/ and
 *     images_fixtures.h, from gen_images.py; run even without Fashion-MNIST), against the IDX
 *     pixels they were written from (PNG exactly, JPEG within JPEG_TOLERANCE), and PIL's
 *     conversions on small PNGs written here, whose expected values are what Pillow 13 gives
 *     for the same files (see image_decode.c);
 * (b) ImageFolder's classes, labels and sample order (torchvision's), extensions, errors;
 * (c) each malformed file: at open (named, or skipped and counted) or at get_image (named);
 * (d) CIFAR-10 against the IDX pixels padded to 32x32, its errors, and CIFAR-100's labels;
 * (e) get_image from two threads at once gives the bytes one thread gets (TSan checks the
 *     rest in the sanitized build). */
#define _GNU_SOURCE
#include "check.h"
#include "fixtures/images_fixtures.h"
#include "testdir.h"

#include <errno.h>
#include <pthread.h>
#include <spng.h>
#include <stdarg.h>
#include <stdint.h>
#include <sys/stat.h>
#include <turbojpeg.h>
#include <unistd.h>
#include <zlib.h>

#define LIMIT      600 /* train images written */
#define TEST_LIMIT 100 /* test images written */
#define SIDE       28
/* Fashion-MNIST as grey JPEGs at quality 95 (make_image_data) differ from the IDX pixels by
 * at most 10/255 over the first 600 train images and 11/255 over all 60000 (the mean is under
 * 1/255): the bound is 12/255. Pillow decodes these files to the same bytes as Tandem
 * (checked by hand on all 60000 with Pillow 13 and its libjpeg-turbo 3.2). */
#define JPEG_TOLERANCE (12.0 / 255.0)

static const char *const CLASSES[10] = {"0_T-shirt_top", "1_Trouser",   "2_Pullover", "3_Dress",
                                        "4_Coat",        "5_Sandal",    "6_Shirt",    "7_Sneaker",
                                        "8_Bag",         "9_Ankle_boot"};

static tdm_dataset *idx_train; /* Fashion-MNIST train, the source of every file */

/* tmpdir/fmt... (one of 8 rotating buffers) */
static const char *tmp(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static const char *tmp(const char *fmt, ...) {
    static _Thread_local char buf[8][512];
    static _Thread_local int k;
    char *p = buf[k++ % 8], rel[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rel, sizeof rel, fmt, ap);
    va_end(ap);
    snprintf(p, 512, "%s/%s", tmpdir, rel);
    return p;
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(data, 1, n, f) == n, "cannot write %s", path);
    if (f) fclose(f);
}

static void make_dir(const char *path) {
    CHECK(mkdir(path, 0755) == 0 || errno == EEXIST, "cannot make %s", path);
}

static void link_to(const char *target, const char *path) {
    CHECK(symlink(target, path) == 0, "cannot link %s to %s", path, target);
}

/* IDX train image i as floats [28*28], and its label */
static int64_t idx_image(int64_t i, float *x) {
    int64_t y = -1;
    CHECK(idx_train->ops->get(idx_train, i, x, &y) == TDM_OK, "IDX sample %lld", (long long)i);
    return y;
}

/* Decodes a file; TDM_OK or the status (img zeroed then). */
static int decode_file(const char *path, int channels, tdm_image *img) {
    size_t n = 0;
    char *b = slurp_file(path, &n);
    int rc = tdm_image_decode(b, b ? n : 0, path, channels, img);
    free(b);
    return rc;
}

/* max |a - b| over n floats */
static double max_diff(const float *a, const float *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

/* ---- (a) decoding ------------------------------------------------------------------------- */

/* Every PNG and JPEG of the first LIMIT train images against its IDX image, as 1 and 3
 * channels (grey to 3 replicates). */
static void test_decode_fashion(void) {
    float x[SIDE * SIDE];
    int png_bad = 0, rep_bad = 0, shape_bad = 0;
    double jpeg_max = 0, jpeg_sum = 0;
    for (int64_t i = 0; i < LIMIT; i++) {
        int64_t y = idx_image(i, x);
        if (y < 0 || y > 9) continue;
        tdm_image a, b, c;
        int ra = decode_file(tmp("data/png/train/%s/%05lld.png", CLASSES[y], (long long)i), 1, &a);
        int rb = decode_file(tmp("data/png/train/%s/%05lld.png", CLASSES[y], (long long)i), 3, &b);
        int rc = decode_file(tmp("data/jpeg/train/%s/%05lld.jpg", CLASSES[y], (long long)i), 1, &c);
        CHECK(!ra && !rb && !rc, "image %lld: %s", (long long)i, tdm_last_error());
        if (ra || rb || rc) break;
        shape_bad += a.c != 1 || a.h != SIDE || a.w != SIDE || b.c != 3 || c.c != 1 ||
                     c.h != SIDE || c.w != SIDE;
        png_bad += memcmp(a.data, x, sizeof x) != 0; /* bit for bit: both are byte / 255.0f */
        for (int k = 0; k < 3; k++) rep_bad += memcmp(b.data + k * SIDE * SIDE, x, sizeof x) != 0;
        double d = max_diff(c.data, x, SIDE * SIDE);
        jpeg_max = fmax(jpeg_max, d);
        for (int j = 0; j < SIDE * SIDE; j++) jpeg_sum += fabs((double)c.data[j] - x[j]);
        free(a.data), free(b.data), free(c.data);
    }
    CHECK(shape_bad == 0, "%d images of the wrong shape", shape_bad);
    CHECK(png_bad == 0, "%d PNGs differ from their IDX image", png_bad);
    CHECK(rep_bad == 0, "%d grey-to-RGB planes differ from the grey image", rep_bad);
    CHECK(jpeg_max <= JPEG_TOLERANCE, "JPEG differs from IDX by %g (bound %g)", jpeg_max,
          JPEG_TOLERANCE);
    CHECK(jpeg_sum / (LIMIT * SIDE * SIDE) < 1.0 / 255, "mean JPEG difference %g",
          jpeg_sum / (LIMIT * SIDE * SIDE));
    printf("JPEG (quality 95) vs IDX: max |diff| %.1f/255, mean %.3f/255\n", jpeg_max * 255,
           jpeg_sum / (LIMIT * SIDE * SIDE) * 255);
}

/* A w x h PNG of `depth` bits and colour type `type` holding px in the file's own layout
 * (SPNG_FMT_RAW: 16-bit samples big-endian), with an optional palette. */
static void write_png(const char *path, int w, int h, int depth, int type, const void *px, size_t n,
                      const struct spng_plte *plte) {
    struct spng_ihdr ihdr = {.width = (uint32_t)w,
                             .height = (uint32_t)h,
                             .bit_depth = (uint8_t)depth,
                             .color_type = (uint8_t)type};
    spng_ctx *ctx = spng_ctx_new(SPNG_CTX_ENCODER);
    int err = spng_set_option(ctx, SPNG_ENCODE_TO_BUFFER, 1);
    if (!err) err = spng_set_ihdr(ctx, &ihdr);
    if (!err && plte) err = spng_set_plte(ctx, (struct spng_plte *)plte);
    if (!err) err = spng_encode_image(ctx, px, n, SPNG_FMT_RAW, SPNG_ENCODE_FINALIZE);
    size_t len = 0;
    void *buf = err ? NULL : spng_get_png_buffer(ctx, &len, &err);
    CHECK(!err && buf, "encoding %s: %s", path, spng_strerror(err));
    if (buf) write_bytes(path, buf, len);
    free(buf);
    spng_ctx_free(ctx);
}

/* Decodes path as `channels` and compares with expected bytes (planar), exactly. */
static void check_pixels(const char *path, int channels, const unsigned char *expected, int n,
                         int h, int w) {
    tdm_image img;
    int rc = decode_file(path, channels, &img);
    CHECK(rc == TDM_OK, "%s: %s", path, tdm_last_error());
    if (rc) return;
    CHECK(img.c == channels && img.h == h && img.w == w, "%s: [%lld, %lld, %lld]", path,
          (long long)img.c, (long long)img.h, (long long)img.w);
    for (int i = 0; i < n && img.c * img.h * img.w == n; i++)
        CHECK(img.data[i] == (float)expected[i] / 255.0f,
              "%s (%d channels) value %d: %g, Pillow %d", path, channels, i, img.data[i] * 255,
              expected[i]);
    free(img.data);
}

/* PIL's conversions: the expected bytes are Pillow 13's convert("L") and convert("RGB") of
 * the same files (planar). */
static void test_decode_conversions(void) {
    /* RGBA 8-bit: alpha dropped; luma (R*19595 + G*38470 + B*7471 + 0x8000) >> 16 */
    const unsigned char rgba[] = {10, 200, 30, 0, 250, 1, 128, 77, 255, 0, 0, 255, 0, 255, 0, 9};
    write_png(tmp("rgba.png"), 4, 1, 8, SPNG_COLOR_TYPE_TRUECOLOR_ALPHA, rgba, sizeof rgba, NULL);
    check_pixels(tmp("rgba.png"), 3,
                 (const unsigned char[]){10, 250, 255, 0, 200, 1, 0, 255, 30, 128, 0, 0}, 12, 1, 4);
    check_pixels(tmp("rgba.png"), 1, (const unsigned char[]){124, 90, 76, 150}, 4, 1, 4);
    /* RGB 16-bit: the high byte of each sample */
    const unsigned char rgb16[] = {0x12, 0x34, 0x80, 0xff, 0xff, 0x00,
                                   0x00, 0x80, 0x7f, 0x80, 0xab, 0xcd};
    write_png(tmp("rgb16.png"), 2, 1, 16, SPNG_COLOR_TYPE_TRUECOLOR, rgb16, sizeof rgb16, NULL);
    check_pixels(tmp("rgb16.png"), 3, (const unsigned char[]){0x12, 0x00, 0x80, 0x7f, 0xff, 0xab},
                 6, 1, 2);
    check_pixels(tmp("rgb16.png"), 1, (const unsigned char[]){110, 94}, 2, 1, 2);
    /* 2-bit grey scales by replication; grey+alpha drops alpha; 16-bit grey keeps the high
     * byte, where Pillow differs on purpose (it clips to 255: 255, 255, 255 here; see
     * image_decode.c) */
    write_png(tmp("g2.png"), 4, 1, 2, SPNG_COLOR_TYPE_GRAYSCALE, (const unsigned char[]){0x1b}, 1,
              NULL);
    check_pixels(tmp("g2.png"), 3,
                 (const unsigned char[]){0, 85, 170, 255, 0, 85, 170, 255, 0, 85, 170, 255}, 12, 1,
                 4);
    write_png(tmp("g16.png"), 3, 1, 16, SPNG_COLOR_TYPE_GRAYSCALE,
              (const unsigned char[]){0x00, 0xff, 0x80, 0x7f, 0xff, 0xff}, 6, NULL);
    check_pixels(tmp("g16.png"), 1, (const unsigned char[]){0, 0x80, 0xff}, 3, 1, 3);
    write_png(tmp("la.png"), 2, 1, 8, SPNG_COLOR_TYPE_GRAYSCALE_ALPHA,
              (const unsigned char[]){77, 0, 200, 255}, 4, NULL);
    check_pixels(tmp("la.png"), 3, (const unsigned char[]){77, 200, 77, 200, 77, 200}, 6, 1, 2);
    /* a 4-bit palette expands */
    struct spng_plte pl = {.n_entries = 3};
    pl.entries[0] = (struct spng_plte_entry){255, 0, 0, 0};
    pl.entries[1] = (struct spng_plte_entry){0, 255, 0, 0};
    pl.entries[2] = (struct spng_plte_entry){17, 34, 51, 0};
    write_png(tmp("pal.png"), 2, 1, 4, SPNG_COLOR_TYPE_INDEXED, (const unsigned char[]){0x12}, 1,
              &pl);
    check_pixels(tmp("pal.png"), 3, (const unsigned char[]){0, 17, 255, 34, 0, 51}, 6, 1, 2);
    check_pixels(tmp("pal.png"), 1, (const unsigned char[]){150, 31}, 2, 1, 2);
}

/* Pillow's own files (tests/fixtures/images/, written by gen_images.py with Pillow) against
 * Pillow's convert("RGB") and convert("L") of them, at 3 and 1 channels: every value exactly,
 * PNG and JPEG alike (4:2:0, 4:2:2, 4:4:4, grey, progressive; sizes not multiples of the
 * blocks). The JPEGs are exact although Debian's libjpeg-turbo is 2.1.5 and the one in
 * Pillow's wheel 3.2: both decode with the accurate integer IDCT (jidctint.c) and fancy
 * upsampling, and libjpeg-turbo's README ("Mathematical Compatibility") names the float IDCT
 * as the one path whose output may differ between builds and CPUs (also jidctflt.c: "may not
 * give the same results on all machines"); neither decoder uses it. Should a release change
 * the integer path or the upsampling, this names the file and the largest difference. The
 * 16-bit grey PNG holds Tandem's documented value, the high byte, where Pillow clips to 255
 * (image_decode.c, docs/FORMATS.md; the generator checks that Pillow clips). */
static void test_decode_pillow(void) {
    int files = 0, exact = 0;
    for (int k = 0; k < IMF_N_CASES; k++) {
        const imf_case *f = &imf_cases[k];
        char path[256];
        snprintf(path, sizeof path, "tests/fixtures/images/%s", f->file);
        int64_t n = (int64_t)f->h * f->w, bad = 0;
        double worst = 0;
        int decoded = 0;
        for (int ch = 3; ch >= 1; ch -= 2) {
            tdm_image img;
            int rc = decode_file(path, ch, &img);
            CHECK(rc == TDM_OK, "%s: %s", path, tdm_last_error());
            if (rc) continue;
            CHECK(img.c == ch && img.h == f->h && img.w == f->w, "%s: [%lld, %lld, %lld]", path,
                  (long long)img.c, (long long)img.h, (long long)img.w);
            decoded += img.c * img.h * img.w == ch * n;
            const unsigned char *want = ch == 3 ? f->rgb : f->l;
            for (int64_t i = 0; i < ch * n && img.c * img.h * img.w == ch * n; i++) {
                float p = (float)want[i] / 255.0f; /* ToTensor's div(255) */
                bad += img.data[i] != p;
                worst = fmax(worst, fabs((double)img.data[i] - p) * 255);
            }
            free(img.data);
        }
        CHECK(bad == 0,
              "%s (%s, Pillow mode %s): %lld values differ from Pillow %s's, by up to "
              "%.0f/255",
              f->file, f->deviation ? "Tandem's documented high byte" : "Pillow", f->pillow_mode,
              (long long)bad, IMF_PILLOW, worst);
        files++, exact += bad == 0 && decoded == 2;
    }
    printf("Pillow %s (libjpeg-turbo %s) parity: %d of %d files exact at 3 and 1 channels\n",
           IMF_PILLOW, IMF_PILLOW_LIBJPEG_TURBO, exact, files);
}

/* An RGB JPEG (4:2:0): the planes are TurboJPEG's own RGB decode de-interleaved, and one
 * channel is its luma in Pillow's fixed point. */
static void test_decode_rgb_jpeg(void) {
    enum { W = 19, H = 13 };
    unsigned char src[H * W * 3], ref[H * W * 3], *jpeg = NULL;
    unsigned long n = 0;
    for (int i = 0; i < H * W * 3; i++) src[i] = (unsigned char)((i * 37 + (i / 3) * 11) % 256);
    tjhandle c = tjInitCompress(), d = tjInitDecompress();
    CHECK(tjCompress2(c, src, W, 0, H, TJPF_RGB, &jpeg, &n, TJSAMP_420, 90, 0) == 0, "encode");
    CHECK(tjDecompress2(d, jpeg, n, ref, W, 0, H, TJPF_RGB, TJFLAG_ACCURATEDCT) == 0, "decode");
    tdm_image rgb, grey;
    int r1 = tdm_image_decode(jpeg, n, "rgb.jpg", 3, &rgb);
    int r2 = tdm_image_decode(jpeg, n, "rgb.jpg", 1, &grey);
    CHECK(!r1 && !r2, "%s", tdm_last_error());
    int bad = 0;
    for (int i = 0; !r1 && !r2 && i < H * W; i++) {
        const unsigned char *p = ref + 3 * i;
        unsigned l = (p[0] * 19595u + p[1] * 38470u + p[2] * 7471u + 0x8000u) >> 16;
        for (int k = 0; k < 3; k++) bad += rgb.data[k * H * W + i] != (float)p[k] / 255.0f;
        bad += grey.data[i] != (float)l / 255.0f;
    }
    CHECK(bad == 0 && rgb.c == 3 && rgb.h == H && rgb.w == W && grey.c == 1,
          "%d values differ from TurboJPEG's decode", bad);
    free(rgb.data), free(grey.data);
    tjFree(jpeg);
    tjDestroy(c), tjDestroy(d);
}

/* A tdm_image_want_fn that asks for the box in arg and counts its calls. */
typedef struct {
    int64_t box[4];
    int calls;
} want_box;

static void want_fixed(void *arg, int64_t h, int64_t w, int64_t box[4]) {
    want_box *b = arg;
    CHECK(box[0] == 0 && box[1] == 0 && box[2] == h && box[3] == w, "want starts from the image");
    memcpy(box, b->box, sizeof b->box);
    b->calls++;
}

/* Whether part holds rows/columns of box from the whole decode full, bit for bit. */
static bool part_matches(const tdm_image *part, const tdm_image *full, const int64_t box[4]) {
    bool whole = box[2] == full->h && box[3] == full->w;
    if (part->c != full->c || part->h != box[2] || part->w != box[3]) return false;
    if (whole ? part->full_h != 0
              : part->top != box[0] || part->left != box[1] || part->full_h != full->h ||
                    part->full_w != full->w)
        return false;
    for (int64_t c = 0; c < part->c; c++)
        for (int64_t y = 0; y < part->h; y++)
            if (memcmp(part->data + (c * part->h + y) * part->w,
                       full->data + (c * full->h + box[0] + y) * full->w + box[1],
                       sizeof(float) * (size_t)part->w))
                return false;
    return true;
}

/* tdm_image_decode_part: for every chroma subsampling libjpeg-turbo writes (4:4:4, 4:2:2,
 * 4:2:0, 4:4:0, 4:1:1), grey, and progressive, random boxes decode to the whole decode's
 * pixels there, bit for bit (at 3 channels and at 1, luma), with the part's place recorded;
 * a JPEG without its end marker and a PNG decode whole without asking. */
static void test_decode_part(void) {
    enum { W = 83, H = 61 };
    static unsigned char src[H * W * 3];
    for (int i = 0; i < H * W * 3; i++) src[i] = (unsigned char)((i * 37 + (i / 7) * 11) % 251);
    const int samp[] = {TJSAMP_444, TJSAMP_422,  TJSAMP_420, TJSAMP_440,
                        TJSAMP_411, TJSAMP_GRAY, TJSAMP_420};
    tjhandle enc = tjInitCompress();
    uint64_t rnd = 12345;
    int bad = 0, boxes = 0;
    for (size_t k = 0; k < sizeof samp / sizeof *samp; k++) {
        unsigned char *jpeg = NULL;
        unsigned long n = 0;
        int flags = k + 1 == sizeof samp / sizeof *samp ? TJFLAG_PROGRESSIVE : 0;
        CHECK(tjCompress2(enc, src, W, 0, H, TJPF_RGB, &jpeg, &n, samp[k], 85, flags) == 0,
              "encode");
        for (int ch = 1; ch <= 3; ch += 2) {
            tdm_image full;
            CHECK(tdm_image_decode(jpeg, n, "s.jpg", ch, &full) == TDM_OK, "%s", tdm_last_error());
            for (int t = 0; t < 40; t++) {
                rnd = rnd * 6364136223846793005ull + 1442695040888963407ull;
                int64_t h = 1 + (int64_t)(rnd >> 33) % H, w = 1 + (int64_t)(rnd >> 17) % W;
                want_box wb = {
                    {(int64_t)(rnd >> 40) % (H - h + 1), (int64_t)(rnd >> 9) % (W - w + 1), h, w},
                    0};
                if (t == 0) wb = (want_box){{0, 0, H, W}, 0};
                tdm_image part;
                int rc = tdm_image_decode_part(jpeg, n, "s.jpg", ch, want_fixed, &wb, &part);
                boxes++;
                bad += rc != TDM_OK || wb.calls != 1 || !part_matches(&part, &full, wb.box);
                free(part.data);
            }
            free(full.data);
        }
        if (k == 2) { /* 4:2:0: the errors */
            want_box out = {{H - 3, 0, 4, W}, 0};
            tdm_image img;
            CHECK_ERROR(tdm_image_decode_part(jpeg, n, "o.jpg", 3, want_fixed, &out, &img) ==
                            TDM_ERR_ARG,
                        "image 'o.jpg': the part asked for (top 58, left 0, 4 x 83) is not inside");
            CHECK(img.data == NULL, "a failed part leaves img empty");
            want_box top = {{0, 0, 8, 8}, 0};
            CHECK_ERROR(tdm_image_decode_part(jpeg, n / 2, "cut.jpg", 3, want_fixed, &top, &img) ==
                            TDM_ERR_FORMAT,
                        "image 'cut.jpg': JPEG: Premature end");
            CHECK(top.calls == 0, "a JPEG without its end marker decodes whole, unasked");
        }
        tjFree(jpeg);
    }
    tjDestroy(enc);
    CHECK(bad == 0, "%d of %d parts differ from the whole decode", bad, boxes);
    /* a PNG (Pillow's, tests/fixtures/images) decodes whole: want is not called */
    static unsigned char b[4096];
    FILE *f = fopen("tests/fixtures/images/rgb_13x9.png", "rb");
    size_t n = f ? fread(b, 1, sizeof b, f) : 0;
    if (f) fclose(f);
    want_box wb = {{1, 1, 2, 2}, 0};
    tdm_image img;
    CHECK(tdm_image_decode_part(b, n, "p.png", 3, want_fixed, &wb, &img) == TDM_OK &&
              wb.calls == 0 && img.h == 9 && img.w == 13 && img.full_h == 0,
          "a PNG part: %s", tdm_last_error());
    free(img.data);
    printf("decode_part: %d boxes bit for bit the whole decode's\n", boxes);
}

static void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24), p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8), p[3] = (unsigned char)v;
}

/* A PNG signature and a valid IHDR claiming w x h grey pixels, and nothing after. */
static size_t png_header(unsigned char *b, uint32_t w, uint32_t h) {
    static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    memcpy(b, sig, 8);
    put_be32(b + 8, 13);
    memcpy(b + 12, "IHDR", 4);
    put_be32(b + 16, w), put_be32(b + 20, h);
    b[24] = 8, b[25] = 0, b[26] = 0, b[27] = 0, b[28] = 0;
    put_be32(b + 29, (uint32_t)crc32(0, b + 12, 17));
    return 33;
}

static void test_decode_errors(void) {
    tdm_image img = {.data = (float *)1};
    CHECK_ERROR(tdm_image_decode("hello, world", 12, "greeting.jpg", 3, &img) == TDM_ERR_FORMAT,
                "image 'greeting.jpg': not a JPEG or PNG");
    CHECK(img.data == NULL, "a failed decode leaves img empty");
    CHECK_ERROR(tdm_image_decode("", 0, "zero.png", 3, &img) == TDM_ERR_FORMAT,
                "image 'zero.png': the file is empty");
    CHECK_ERROR(tdm_image_decode("BM\0\0\0\0", 6, "x.bmp", 3, &img), "(a BMP file?)");
    CHECK_ERROR(tdm_image_decode("\xff\xd8\xff\xe0", 4, "cut.jpg", 3, &img) == TDM_ERR_FORMAT,
                "image 'cut.jpg': JPEG: ");
    unsigned char b[64];
    size_t n = png_header(b, 65536, 1);
    CHECK_ERROR(tdm_image_decode(b, n, "wide.png", 3, &img) == TDM_ERR_FORMAT, "wide.png': PNG");
    n = png_header(b, 10000, 10000); /* 10^8 pixels: more than Pillow's MAX_IMAGE_PIXELS */
    CHECK_ERROR(tdm_image_decode(b, n, "huge.png", 3, &img) == TDM_ERR_FORMAT,
                "image 'huge.png': PNG of 10000 x 10000 pixels: too large");
    n = png_header(b, 28, 28); /* IHDR and then nothing */
    CHECK_ERROR(tdm_image_decode(b, n, "short.png", 3, &img) == TDM_ERR_FORMAT,
                "image 'short.png': PNG: ");
    b[20] ^= 1; /* IHDR's CRC no longer matches */
    CHECK_ERROR(tdm_image_decode(b, n, "crc.png", 3, &img) == TDM_ERR_FORMAT, "crc.png': PNG: ");
    CHECK_ERROR(tdm_image_decode(b, n, "x.png", 2, &img) == TDM_ERR_ARG, "channels must be 1 or 3");
    CHECK_ERROR(tdm_image_decode(NULL, 5, "x.png", 3, &img) == TDM_ERR_ARG, "bytes is NULL");
}

/* ---- (b) ImageFolder ---------------------------------------------------------------------- */

/* Sample j of ds decodes to the IDX image want[j] (exactly, or within tol) with its label. */
static void check_samples(tdm_dataset *ds, const int64_t *want, int64_t n, double tol) {
    float x[SIDE * SIDE];
    int bad_label = 0, bad_pixels = 0, failed = 0;
    for (int64_t j = 0; j < n; j++) {
        tdm_image img;
        int64_t y = -1, label = idx_image(want[j], x);
        if (ds->ops->get_image(ds, j, &img, &y)) {
            if (failed++ == 0) fprintf(stderr, "sample %lld: %s\n", (long long)j, tdm_last_error());
            continue;
        }
        bad_label += y != label;
        bad_pixels += img.c != ds->sample_shape.d[0] || img.h != SIDE || img.w != SIDE ||
                      max_diff(img.data, x, SIDE * SIDE) > tol;
        free(img.data);
    }
    CHECK(failed == 0 && bad_label == 0 && bad_pixels == 0,
          "%s: %d failed, %d wrong labels, %d wrong images", ds->name, failed, bad_label,
          bad_pixels);
}

/* The loader over a JPEG folder with a transform that starts with RandomResizedCrop decodes
 * only each crop's part (get_image_part): its batches are those of the whole images through
 * the same transform, bit for bit, in epochs 0 and 1. */
static void test_loader_parts(void) {
    tdm_dataset *ds = tdm_image_folder_open(tmp("data/jpeg/train"), NULL);
    tdm_transform *tf = tdm_transform_parse("RandomResizedCrop(20),RandomHorizontalFlip()", 0);
    CHECK(ds && tf && ds->ops->get_image_part, "%s", tdm_last_error());
    if (!ds || !tf) return;
    enum { B = 64 };
    tdm_loader_opts o = tdm_loader_defaults(B);
    o.workers = 2, o.transform = tf, o.seed = 5;
    tdm_loader *l = tdm_loader_new(ds, &o);
    CHECK(l != NULL, "%s", tdm_last_error());
    static float want[B * 3 * 20 * 20];
    int bad = 0, batches = 0;
    for (int64_t epoch = 0; l && epoch < 2; epoch++) {
        CHECK(tdm_loader_start_epoch(l, epoch) == TDM_OK, "%s", tdm_last_error());
        tdm_batch b;
        int64_t n;
        int64_t *idx = tdm_loader_indices(l, epoch, &n);
        for (int k = 0; idx && k < 2 && tdm_loader_next(l, &b) == 1; k++, batches++) {
            for (int64_t r = 0; r < b.size; r++) {
                int64_t i = idx[b.index * B + r], y;
                tdm_image img;
                bad += ds->ops->get_image(ds, i, &img, &y) ||
                       tdm_transform_apply(tf, &img, want + r * 1200, o.seed, epoch, i);
                free(img.data);
            }
            float *got = malloc(sizeof(float) * (size_t)tdm_numel(b.x));
            tdm_to_host(b.x, got, sizeof(float) * (size_t)tdm_numel(b.x));
            bad += memcmp(got, want, sizeof(float) * (size_t)(b.size * 1200)) != 0;
            free(got);
        }
        free(idx);
    }
    CHECK(bad == 0 && batches == 4, "%d of %d batches differ from whole-image decodes", bad,
          batches);
    tdm_loader_free(l);
    tdm_transform_free(tf);
    tdm_dataset_free(ds);
}

/* The PNG and JPEG folders of the first LIMIT train images: classes in order, each class's
 * files in IDX order (their zero-padded names), labels the IDX labels. */
static void test_folder_fashion(void) {
    float x[SIDE * SIDE];
    int64_t want[LIMIT], n = 0;
    for (int c = 0; c < 10; c++)
        for (int64_t i = 0; i < LIMIT; i++)
            if (idx_image(i, x) == c) want[n++] = i;
    tdm_dataset *ds = tdm_image_folder_open(tmp("data/png/train"), NULL);
    CHECK(ds != NULL, "%s", tdm_last_error());
    if (!ds) return;
    CHECK(ds->n == LIMIT && n == LIMIT && ds->num_classes == 10, "n %lld, classes %lld",
          (long long)ds->n, (long long)ds->num_classes);
    CHECK(ds->sample_shape.ndim == 3 && ds->sample_shape.d[0] == 3 && ds->sample_shape.d[1] == 0 &&
              ds->x_dtype == TDM_F32 && ds->target_shape.ndim == 0,
          "shapes");
    CHECK(!strncmp(ds->name, "imagefolder:", 12) && strstr(ds->name, "png/train"), "name %s",
          ds->name);
    for (int c = 0; c < 10; c++) {
        const char *name = ds->ops->class_name(ds, c);
        CHECK(name && !strcmp(name, CLASSES[c]), "class %d is %s", c, name ? name : "NULL");
    }
    CHECK(!ds->ops->class_name(ds, 10) && !ds->ops->class_name(ds, -1), "class out of range");
    CHECK(tdm_image_folder_skipped(ds) == 0, "nothing skipped");
    check_samples(ds, want, LIMIT, 0);
    CHECK_ERROR(ds->ops->get(ds, 0, x, &(int64_t){0}) == TDM_ERR_STATE, "images differ in size");
    tdm_image img;
    CHECK_ERROR(ds->ops->get_image(ds, LIMIT, &img, &(int64_t){0}) == TDM_ERR_ARG, "out of range");
    tdm_dataset_free(ds);
    tdm_image_folder_opts o = tdm_image_folder_defaults();
    o.channels = 1;
    ds = tdm_image_folder_open(tmp("data/jpeg/train"), &o);
    CHECK(ds && ds->n == LIMIT && ds->sample_shape.d[0] == 1, "jpeg: %s", tdm_last_error());
    if (ds) check_samples(ds, want, LIMIT, JPEG_TOLERANCE);
    tdm_dataset_free(ds);
    CHECK(tdm_image_folder_skipped(NULL) == 0 && tdm_image_folder_skipped(idx_train) == 0,
          "skipped of other datasets");
}

/* path = a copy of IDX train image i's PNG (or JPEG) */
static void copy_image(const char *path, int64_t i, bool jpeg) {
    float x[SIDE * SIDE];
    int64_t y = idx_image(i, x);
    const char *src = jpeg ? tmp("data/jpeg/train/%s/%05lld.jpg", CLASSES[y], (long long)i)
                           : tmp("data/png/train/%s/%05lld.png", CLASSES[y], (long long)i);
    size_t n = 0;
    char *b = slurp_file(src, &n);
    CHECK(b != NULL, "cannot read %s", src);
    if (b) write_bytes(path, b, n);
    free(b);
}

/* torchvision's listing rules on a folder made here: hidden and upper-case class names sort
 * by byte, extensions in any case, a PNG named .bmp is read by its content, other files are
 * not samples, and the folders below a class come in the order of sorted(os.walk()): by
 * path as a string ("a/sub-x" before "a/sub/deeper"), not depth-first. */
static void test_folder_rules(void) {
    const char *dirs[] = {"mini",         "mini/.h",           "mini/B",     "mini/a", "mini/a/sub",
                          "mini/a/sub-x", "mini/a/sub/deeper", "mini/a/suba"};
    for (size_t k = 0; k < sizeof dirs / sizeof *dirs; k++) make_dir(tmp("%s", dirs[k]));
    /* in the expected order: (path, IDX image, label) */
    const struct {
        const char *rel;
        bool jpeg;
        int label;
    } files[] = {{".h/p.png", 0, 0},    {"B/q.png", 0, 1},       {"a/m.png", 0, 2},
                 {"a/r.bmp", 0, 2},     {"a/x.PNG", 0, 2},       {"a/y.jpeg", 1, 2},
                 {"a/sub/k.png", 0, 2}, {"a/sub-x/j.png", 0, 2}, {"a/sub/deeper/h.png", 0, 2},
                 {"a/suba/i.png", 0, 2}};
    enum { N = sizeof files / sizeof *files };
    for (int k = 0; k < N; k++) copy_image(tmp("mini/%s", files[k].rel), k, files[k].jpeg);
    write_bytes(tmp("mini/a/notes.txt"), "not an image\n", 13);
    write_bytes(tmp("mini/a/Thumbs.db"), "", 0);
    write_bytes(tmp("mini/stray.png"), "", 0); /* not in a class folder: not a sample */
    tdm_dataset *ds = tdm_image_folder_open(tmp("mini/"), NULL);
    CHECK(ds && ds->n == N && ds->num_classes == 3, "mini: %s", tdm_last_error());
    for (int64_t j = 0; ds && j < N; j++) {
        tdm_image img;
        float x[SIDE * SIDE];
        int64_t y = -1;
        idx_image(j, x);
        int rc = ds->ops->get_image(ds, j, &img, &y);
        CHECK(rc == TDM_OK && y == files[j].label &&
                  max_diff(img.data, x, SIDE * SIDE) <= (files[j].jpeg ? JPEG_TOLERANCE : 0),
              "sample %lld should be %s, class %d (got class %lld): %s", (long long)j, files[j].rel,
              files[j].label, (long long)y, rc ? tdm_last_error() : "");
        if (!rc) free(img.data);
    }
    CHECK(ds && !strcmp(ds->ops->class_name(ds, 0), ".h") &&
              !strcmp(ds->ops->class_name(ds, 1), "B") && !strcmp(ds->ops->class_name(ds, 2), "a"),
          "classes sort by byte");
    tdm_dataset_free(ds);
    /* a .tif that is not a JPEG or PNG: torchvision would list it, Tandem cannot read it */
    write_bytes(tmp("mini/a/t.tif"), "II*\0", 4);
    CHECK_ERROR(tdm_image_folder_open(tmp("mini"), NULL) == NULL, "mini/a/t.tif': not a JPEG");
    tdm_image_folder_opts o = {.channels = 3, .skip_bad = true};
    ds = tdm_image_folder_open(tmp("mini"), &o);
    CHECK(ds && ds->n == N && tdm_image_folder_skipped(ds) == 1, "skip_bad: %s", tdm_last_error());
    tdm_dataset_free(ds);
}

/* A JPEG whose header lies beyond the first 8 KB read at open (a 30 KB APP1 segment, as
 * EXIF thumbnails make) opens and decodes. */
static void test_folder_long_header(void) {
    size_t n = 0;
    char *jpeg = slurp_file(tmp("data/jpeg/train/%s/00001.jpg", CLASSES[0]), &n);
    enum { APP = 30000 };
    unsigned char *b = (unsigned char *)calloc(1, n + APP + 4);
    CHECK(jpeg && b, "cannot read a JPEG");
    if (!jpeg || !b) return free(jpeg), free(b);
    memcpy(b, jpeg, 2); /* SOI, then APP1 of APP + 2 bytes (its length counts itself) */
    b[2] = 0xff, b[3] = 0xe1, b[4] = (APP + 2) >> 8, b[5] = (APP + 2) & 0xff;
    memcpy(b + 6 + APP, jpeg + 2, n - 2);
    make_dir(tmp("exif")), make_dir(tmp("exif/A"));
    write_bytes(tmp("exif/A/big.jpg"), b, n + APP + 4);
    tdm_dataset *ds = tdm_image_folder_open(tmp("exif"), NULL);
    tdm_image img = {0};
    int64_t y = -1;
    CHECK(ds && ds->n == 1 && ds->ops->get_image(ds, 0, &img, &y) == TDM_OK && img.h == SIDE,
          "a JPEG with a 30 KB APP1: %s", tdm_last_error());
    free(img.data), free(jpeg), free(b);
    tdm_dataset_free(ds);
}

static void test_folder_errors(void) {
    CHECK_ERROR(tdm_image_folder_open(tmp("nowhere"), NULL) == NULL, "nowhere: No such file");
    CHECK_ERROR(tdm_image_folder_open(tmp("rgba.png"), NULL) == NULL, "rgba.png is not a folder");
    CHECK_ERROR(tdm_image_folder_open(NULL, NULL) == NULL, "dir is NULL");
    CHECK_ERROR(tdm_image_folder_open(tmp("mini"), &(tdm_image_folder_opts){.channels = 4}) == NULL,
                "channels must be 1 or 3");
    make_dir(tmp("flat"));
    copy_image(tmp("flat/a.png"), 0, false);
    CHECK_ERROR(tdm_image_folder_open(tmp("flat"), NULL) == NULL, "flat: no class folders");
    make_dir(tmp("holes")), make_dir(tmp("holes/A")), make_dir(tmp("holes/B"));
    make_dir(tmp("holes/C"));
    copy_image(tmp("holes/B/b.png"), 0, false);
    write_bytes(tmp("holes/C/readme.txt"), "x", 1);
    CHECK_ERROR(tdm_image_folder_open(tmp("holes"), NULL) == NULL,
                "found no valid file for the classes A, C");
    make_dir(tmp("loop")), make_dir(tmp("loop/A"));
    copy_image(tmp("loop/A/a.png"), 0, false);
    link_to("..", tmp("loop/A/again"));
    CHECK_ERROR(tdm_image_folder_open(tmp("loop"), NULL) == NULL, "symbolic link loop");
}

/* ---- (c) malformed files -------------------------------------------------------------- */

/* A folder holding a good image and one bad file (links into data/bad): the open fails
 * naming the bad file and the reason. */
static void check_open_error(const char *name, const char *cls, const char *file, const char *why) {
    make_dir(tmp("%s", name)), make_dir(tmp("%s/%s", name, cls));
    link_to(tmp("data/bad/%s/%s", cls, file), tmp("%s/%s/%s", name, cls, file));
    copy_image(tmp("%s/%s/00000.png", name, cls), 0, false);
    tdm_dataset *ds = tdm_image_folder_open(tmp("%s", name), NULL);
    CHECK(ds == NULL, "%s opened", name);
    const char *e = tdm_last_error();
    CHECK(strstr(e, tmp("%s/%s/%s", name, cls, file)) && strstr(e, why),
          "the error should name %s and say \"%s\": %s", file, why, e);
    tdm_clear_error();
    tdm_dataset_free(ds);
}

static void test_bad_files(void) {
    check_open_error("bad_empty", "0_T-shirt_top", "empty.jpg", "the file is empty");
    check_open_error("bad_text", "1_Trouser", "text.jpg", "not a JPEG or PNG");
    check_open_error("bad_sig", "2_Pullover", "badsig.png", "PNG: invalid signature");
    CHECK_ERROR(tdm_image_folder_open(tmp("data/bad"), NULL) == NULL, "empty.jpg");
    tdm_image_folder_opts o = tdm_image_folder_defaults();
    o.skip_bad = true;
    tdm_dataset *ds = tdm_image_folder_open(tmp("data/bad"), &o);
    CHECK(ds && ds->n == 12 && tdm_image_folder_skipped(ds) == 3, "bad, skip_bad: %s",
          tdm_last_error());
    int ok = 0, trunc = 0, crc = 0;
    for (int64_t i = 0; ds && i < ds->n; i++) {
        tdm_image img;
        int64_t y;
        int rc = ds->ops->get_image(ds, i, &img, &y);
        const char *e = tdm_last_error();
        if (rc == TDM_OK) ok++, free(img.data);
        trunc += rc == TDM_ERR_FORMAT && strstr(e, "data/bad/3_Dress/truncated.jpg': JPEG: ") &&
                 strstr(e, "Premature end");
        crc += rc == TDM_ERR_FORMAT && strstr(e, "data/bad/4_Coat/badcrc.png': PNG: ") &&
               strstr(e, "checksum");
        tdm_clear_error();
    }
    CHECK(ok == 10 && trunc == 1 && crc == 1, "%d decoded, truncated JPEG %d, bad CRC %d", ok,
          trunc, crc);
    tdm_dataset_free(ds);
}

/* ---- (d) CIFAR ------------------------------------------------------------------------ */

/* CIFAR sample i of ds against IDX image `idx` of src zero-padded to [3, 32, 32]. */
static bool cifar_matches(tdm_dataset *ds, int64_t i, tdm_dataset *src, int64_t idx) {
    float x[3 * 32 * 32], want[SIDE * SIDE];
    int64_t y = -1, label = -1;
    if (ds->ops->get(ds, i, x, &y) || src->ops->get(src, idx, want, &label)) return false;
    bool same = y == label;
    for (int c = 0; c < 3; c++)
        for (int r = 0; r < 32; r++)
            for (int k = 0; k < 32; k++) {
                bool in = r >= 2 && r < 30 && k >= 2 && k < 30;
                same &= x[(c * 32 + r) * 32 + k] == (in ? want[(r - 2) * SIDE + k - 2] : 0.0f);
            }
    return same;
}

typedef enum { CIFAR_TRIM, CIFAR_LABEL, CIFAR_OMIT } cifar_damage;

/* A copy of data/cifar10 in tmpdir/name with one file damaged: 100 bytes short (TRIM),
 * record 17's label set to 10 (LABEL), or left out (OMIT). */
static void cifar_copy(const char *name, const char *damaged, cifar_damage how) {
    const char *files[] = {"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin",
                           "data_batch_4.bin", "data_batch_5.bin", "test_batch.bin"};
    make_dir(tmp("%s", name));
    for (int k = 0; k < 6; k++) {
        bool hit = !strcmp(damaged, files[k]);
        size_t n = 0;
        char *b = slurp_file(tmp("data/cifar10/%s", files[k]), &n);
        CHECK(b && n > 17 * 3073, "cannot read %s", files[k]);
        if (b && hit && how == CIFAR_TRIM) n -= 100;
        if (b && hit && how == CIFAR_LABEL) b[17 * 3073] = 10;
        if (b && !(hit && how == CIFAR_OMIT)) write_bytes(tmp("%s/%s", name, files[k]), b, n);
        free(b);
    }
}

static void test_cifar10(tdm_dataset *idx_test) {
    tdm_dataset *tr = tdm_cifar_open(tmp("data/cifar10"), 10, true, false);
    tdm_dataset *te = tdm_cifar_open(tmp("data/cifar10"), 10, false, false);
    CHECK(tr && te, "%s", tdm_last_error());
    if (!tr || !te) return tdm_dataset_free(tr), tdm_dataset_free(te);
    CHECK(tr->n == LIMIT && te->n == TEST_LIMIT && tr->num_classes == 10 &&
              tr->sample_shape.ndim == 3 && tr->sample_shape.d[0] == 3 &&
              tr->sample_shape.d[2] == 32 && !strcmp(tr->name, "cifar10/train") &&
              !strcmp(te->name, "cifar10/test") && tr->ops->prefetch,
          "cifar10: n %lld/%lld, name %s", (long long)tr->n, (long long)te->n, tr->name);
    int bad = 0, bad_image = 0;
    for (int64_t i = 0; i < LIMIT; i++) {
        bad += !cifar_matches(tr, i, idx_train, i) +
               (i < TEST_LIMIT && !cifar_matches(te, i, idx_test, i));
        tr->ops->prefetch(tr, i);
        tdm_image img;
        float x[3 * 32 * 32];
        int64_t y1 = -1, y2 = -2;
        if (tr->ops->get_image(tr, i, &img, &y1) || tr->ops->get(tr, i, x, &y2)) {
            bad_image++;
            continue;
        }
        bad_image += img.c != 3 || img.h != 32 || img.w != 32 || y1 != y2 ||
                     memcmp(img.data, x, sizeof x) != 0;
        free(img.data);
    }
    CHECK(bad == 0 && bad_image == 0, "%d samples differ from IDX, %d get_image from get()", bad,
          bad_image);
    tdm_dataset_free(tr), tdm_dataset_free(te);
    /* the folder the archive unpacks to is found below dir */
    make_dir(tmp("cifar_arch"));
    link_to(tmp("data/cifar10"), tmp("cifar_arch/cifar-10-batches-bin"));
    tr = tdm_cifar_open(tmp("cifar_arch"), 10, true, false);
    CHECK(tr && tr->n == LIMIT, "archive folder: %s", tdm_last_error());
    tdm_dataset_free(tr);
}

static void test_cifar10_errors(void) {
    cifar_copy("cifar_cut", "data_batch_3.bin", CIFAR_TRIM);
    CHECK_ERROR(tdm_cifar_open(tmp("cifar_cut"), 10, true, false) == NULL,
                "cifar_cut/data_batch_3.bin: 368660 bytes is not a whole number of CIFAR-10 "
                "records of 3073 bytes");
    cifar_copy("cifar_label", "data_batch_2.bin", CIFAR_LABEL);
    CHECK_ERROR(tdm_cifar_open(tmp("cifar_label"), 10, true, false) == NULL,
                "cifar_label/data_batch_2.bin: record 17 (byte offset 52241): label 10 is out of "
                "range [0, 10)");
    cifar_copy("cifar_missing", "data_batch_5.bin", CIFAR_OMIT);
    CHECK_ERROR(tdm_cifar_open(tmp("cifar_missing"), 10, true, false) == NULL,
                "cifar_missing/data_batch_5.bin: No such file");
    tdm_dataset *te = tdm_cifar_open(tmp("cifar_missing"), 10, false, false);
    CHECK(te && te->n == TEST_LIMIT, "the test split needs only test_batch.bin: %s",
          tdm_last_error());
    tdm_dataset_free(te);
    CHECK_ERROR(tdm_cifar_open(tmp("cifar_cut"), 7, true, false) == NULL,
                "classes must be 10 (CIFAR-10) or 100 (CIFAR-100), got 7");
    CHECK_ERROR(tdm_cifar_open(tmp("cifar_cut"), 10, true, true) == NULL, "only in CIFAR-100");
    CHECK_ERROR(tdm_cifar_open(NULL, 10, true, false) == NULL, "dir is NULL");
}

/* CIFAR-100 from a small file: coarse and fine labels, pixels, label range errors. */
static void test_cifar100(void) {
    enum { REC = 3074 };
    static unsigned char b[3 * REC];
    const unsigned char labels[3][2] = {{3, 45}, {19, 99}, {0, 0}};
    for (int r = 0; r < 3; r++) {
        b[r * REC] = labels[r][0], b[r * REC + 1] = labels[r][1];
        for (int j = 0; j < 3072; j++) b[r * REC + 2 + j] = (unsigned char)(j * 7 + r * 13);
    }
    make_dir(tmp("c100"));
    write_bytes(tmp("c100/train.bin"), b, sizeof b);
    tdm_dataset *fine = tdm_cifar_open(tmp("c100"), 100, true, false);
    tdm_dataset *coarse = tdm_cifar_open(tmp("c100"), 100, true, true);
    CHECK(fine && coarse, "%s", tdm_last_error());
    if (!fine || !coarse) return tdm_dataset_free(fine), tdm_dataset_free(coarse);
    CHECK(fine->n == 3 && fine->num_classes == 100 && coarse->num_classes == 20 &&
              !strcmp(fine->name, "cifar100/train") &&
              !strcmp(coarse->name, "cifar100-coarse/train"),
          "cifar100: n %lld, names %s %s", (long long)fine->n, fine->name, coarse->name);
    static float x[3072];
    for (int r = 0; r < 3; r++) {
        int64_t yf = -1, yc = -1;
        CHECK(!fine->ops->get(fine, r, x, &yf) && !coarse->ops->get(coarse, r, x, &yc), "get");
        CHECK(yf == labels[r][1] && yc == labels[r][0], "record %d: fine %lld coarse %lld", r,
              (long long)yf, (long long)yc);
        int bad = 0;
        for (int j = 0; j < 3072; j++) bad += x[j] != (float)b[r * REC + 2 + j] / 255.0f;
        CHECK(bad == 0, "record %d: %d pixels differ", r, bad);
    }
    tdm_dataset_free(fine), tdm_dataset_free(coarse);
    CHECK_ERROR(tdm_cifar_open(tmp("c100"), 100, false, false) == NULL, "c100/test.bin");
    b[REC] = 20; /* record 1's coarse label */
    write_bytes(tmp("c100/train.bin"), b, sizeof b);
    CHECK_ERROR(tdm_cifar_open(tmp("c100"), 100, true, false) == NULL,
                "c100/train.bin: record 1 (byte offset 3074): coarse label 20 is out of range");
    b[REC] = 19, b[2 * REC + 1] = 100; /* record 2's fine label */
    write_bytes(tmp("c100/train.bin"), b, sizeof b);
    CHECK_ERROR(tdm_cifar_open(tmp("c100"), 100, true, true) == NULL,
                "record 2 (byte offset 6149): fine label 100 is out of range [0, 100)");
    write_bytes(tmp("c100/train.bin"), b, REC + 1);
    CHECK_ERROR(tdm_cifar_open(tmp("c100"), 100, true, false) == NULL,
                "3075 bytes is not a whole number of CIFAR-100 records of 3074 bytes");
}

/* ---- (e) threads ------------------------------------------------------------------------- */

typedef struct {
    tdm_dataset *ds;
    float *out; /* [n, 3, 28, 28] */
    int failed;
} reader;

static void *read_all(void *arg) {
    reader *r = (reader *)arg;
    for (int64_t i = 0; i < r->ds->n; i++) {
        tdm_image img;
        int64_t y;
        if (r->ds->ops->get_image(r->ds, i, &img, &y) || img.c * img.h * img.w != 3 * SIDE * SIDE) {
            r->failed++;
            continue;
        }
        memcpy(r->out + i * 3 * SIDE * SIDE, img.data, 3 * SIDE * SIDE * sizeof(float));
        free(img.data);
    }
    return NULL;
}

/* Two threads decode every image of one dataset at once; then one thread alone. */
static void test_threads(const char *dir) {
    tdm_dataset *ds = tdm_image_folder_open(tmp("%s", dir), NULL);
    CHECK(ds != NULL, "%s", tdm_last_error());
    if (!ds) return;
    size_t bytes = (size_t)ds->n * 3 * SIDE * SIDE * sizeof(float);
    reader r[3] = {{ds, malloc(bytes), 0}, {ds, malloc(bytes), 0}, {ds, malloc(bytes), 0}};
    pthread_t t[2];
    for (int k = 0; k < 2; k++) pthread_create(&t[k], NULL, read_all, &r[k]);
    for (int k = 0; k < 2; k++) pthread_join(t[k], NULL);
    read_all(&r[2]);
    CHECK(r[0].failed + r[1].failed + r[2].failed == 0, "%s: get_image failed", dir);
    CHECK(!memcmp(r[0].out, r[2].out, bytes) && !memcmp(r[1].out, r[2].out, bytes),
          "%s: two threads at once read other bytes than one thread", dir);
    for (int k = 0; k < 3; k++) free(r[k].out);
    tdm_dataset_free(ds);
}

/* ---- main ---------------------------------------------------------------------------- */

/* make_image_data tmpdir/data --limit LIMIT --test-limit TEST_LIMIT; 0 when it worked */
static int make_data(const char *program) {
    char limit[16], test_limit[16];
    snprintf(limit, sizeof limit, "%d", LIMIT);
    snprintf(test_limit, sizeof test_limit, "%d", TEST_LIMIT);
    const char *argv[] = {program, tmp("data"), "--limit", limit, "--test-limit", test_limit, NULL};
    int st = wait_status(spawn_captured(argv));
    CHECK(st == 0, "%s exited with %d: %s", program, st, captured("stderr"));
    return st;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_images PATH/make_image_data\n");
        return 2;
    }
    test_decode_pillow(); /* committed files: runs without Fashion-MNIST */
    idx_train = tdm_fashion_mnist(NULL, true);
    tdm_dataset *idx_test = idx_train ? tdm_fashion_mnist(NULL, false) : NULL;
    if (!idx_test) {
        printf("SKIP: Fashion-MNIST is missing (%s); Debian's dataset-fashion-mnist provides "
               "it (scripts/setup)\n",
               tdm_last_error());
        tdm_dataset_free(idx_train);
        return check_failed ? 1 : 77;
    }
    if (tmpdir_make("images") || make_data(argv[1])) return check_summary() ? 1 : 1;
    test_decode_fashion();
    test_decode_conversions();
    test_decode_rgb_jpeg();
    test_decode_part();
    test_decode_errors();
    test_folder_fashion();
    test_loader_parts();
    test_folder_rules();
    test_folder_long_header();
    test_folder_errors();
    test_bad_files();
    test_cifar10(idx_test);
    test_cifar10_errors();
    test_cifar100();
    test_threads("data/png/train");
    test_threads("data/jpeg/test");
    tdm_dataset_free(idx_train);
    tdm_dataset_free(idx_test);
    tmpdir_remove();
    return check_summary();
}
