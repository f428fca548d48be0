/* JPEG and PNG files decoded into f32 [c, h, w] in [0, 1], as torchvision's default loader
 * (PIL's Image.open(f).convert("RGB"), or convert("L") for one channel) then ToTensor give them.
 *
 * JPEG goes through libjpeg-turbo's libjpeg API with its defaults (the accurate integer IDCT,
 * fancy upsampling): Pillow decodes with the same library and the same settings, so the
 * pixels are Pillow's bit for bit where both use one libjpeg-turbo release. The libjpeg API
 * rather than TurboJPEG's: it decodes a part of an image (skipped rows, cropped columns),
 * which is all a RandomResizedCrop reads (tdm_image_decode_part).
 * PNG goes through libspng, which checks every chunk's CRC and the zlib stream's Adler-32.
 *
 * What PIL's conversions do, and so what this does:
 * - grey to 3 channels replicates the grey value; RGB to 1 channel is ITU-R 601-2 luma in
 *   Pillow's fixed point, (R*19595 + G*38470 + B*7471 + 0x8000) >> 16 (Convert.c's L24,
 *   the 299/587/114 per mille weights scaled by 2^16), then /255;
 * - alpha is dropped, not composited (convert("RGB") of RGBA and LA drops it), and a tRNS
 *   chunk is ignored; palettes expand; gAMA is ignored (PIL does not apply it);
 * - 1, 2 and 4-bit grey scale to 8 bits by bit replication (0..3 -> 0, 85, 170, 255);
 * - 16-bit samples keep their high byte (v >> 8), as PIL's RGB;16B, RGBA;16B and LA;16B
 *   modes do. 16-bit grey differs: PIL opens it as mode I;16 and its conversion to L or
 *   RGB clips every value above 255 to 255, which turns most such images white; the high
 *   byte keeps the image.
 * - CMYK and YCCK JPEGs are refused (Pillow converts them with its own formula).
 *
 * Sizes are checked before anything is allocated: each side at most 65535 (JPEG's own
 * limit) and at most 89478485 pixels, Pillow's MAX_IMAGE_PIXELS, above which Pillow warns
 * of a decompression bomb. Every libjpeg warning is an error, so a truncated JPEG fails
 * instead of giving grey rows. */
#include "data/image_decode.h"
#include "core/core.h"

#include <immintrin.h>
#include <setjmp.h>
#include <spng.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h> /* after stdio.h: it uses FILE and size_t */

#define MAX_SIDE   65535
#define MAX_PIXELS 89478485
/* PNG chunks Tandem never reads (text, ICC profiles) may not claim more than this */
#define PNG_CHUNK_LIMIT (64u << 20)
#define PNG_CACHE_LIMIT (128u << 20)
/* a progressive JPEG of more scans fails (TurboJPEG's TJFLAG_LIMITSCANS limit) */
#define JPEG_MAX_SCANS 500

static const unsigned char PNG_SIG[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};

/* ---- format and size ------------------------------------------------------------------- */

/* Names a few formats PIL reads and Tandem does not, for the message. */
static const char *other_format(const unsigned char *b, size_t n) {
    if (n >= 2 && b[0] == 'B' && b[1] == 'M') return " (a BMP file?)";
    if (n >= 4 && !memcmp(b, "GIF8", 4)) return " (a GIF file?)";
    if (n >= 12 && !memcmp(b, "RIFF", 4) && !memcmp(b + 8, "WEBP", 4)) return " (a WebP file)";
    if (n >= 4 && (!memcmp(b, "II*\0", 4) || !memcmp(b, "MM\0*", 4))) return " (a TIFF file)";
    if (n >= 2 && b[0] == 'P' && b[1] >= '1' && b[1] <= '6') return " (a PNM file?)";
    return "";
}

/* The format from the magic bytes, or TDM_ERR_FORMAT saying what the bytes are not. A
 * "\x89PNG" start with a damaged rest of the signature goes to libspng, which names it. */
static int format_of(const unsigned char *b, size_t n, const char *name, tdm_image_format *f) {
    if (n >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff) return *f = TDM_IMAGE_JPEG, TDM_OK;
    if (n >= 4 && !memcmp(b, PNG_SIG, 4)) return *f = TDM_IMAGE_PNG, TDM_OK;
    if (n == 0) return tdm_raise(TDM_ERR_FORMAT, "image '%s': the file is empty (0 bytes)", name);
    char hex[3 * 8 + 1] = "";
    for (size_t i = 0; i < n && i < 8; i++) snprintf(hex + 3 * i, 4, " %02x", b[i]);
    return tdm_raise(TDM_ERR_FORMAT,
                     "image '%s': not a JPEG or PNG, the formats Tandem reads (it starts with"
                     "%s)%s",
                     name, hex, other_format(b, n));
}

static int check_size(const char *name, const char *fmt, int64_t w, int64_t h) {
    if (w < 1 || h < 1) /* a header cut before its SOF marker */
        return tdm_raise(TDM_ERR_FORMAT,
                         "image '%s': %s: the header gives no image size (the file is "
                         "truncated or damaged)",
                         name, fmt);
    if (w > MAX_SIDE || h > MAX_SIDE || w * h > MAX_PIXELS)
        return tdm_raise(TDM_ERR_FORMAT,
                         "image '%s': %s of %lld x %lld pixels: too large (at most %d per side "
                         "and %d pixels, Pillow's MAX_IMAGE_PIXELS)",
                         name, fmt, (long long)w, (long long)h, MAX_SIDE, MAX_PIXELS);
    return TDM_OK;
}

/* ---- pixels: interleaved u8 to planar f32 ------------------------------------------------ */

/* k / 255.0f for every byte k: the f32 division ToTensor's div(255) does, done once. A table
 * read instead of a division per sample: the conversion of a whole photo (3 x 500 x 375) was
 * a quarter of the image loader's time with the divisions (perf, bench_image_loader), and the
 * table gives the same floats bit for bit. Filled at load time (a constructor), before any
 * worker thread can read it. */
static float byte_to_unit[256];

__attribute__((constructor)) static void byte_to_unit_init(void) {
    for (int k = 0; k < 256; k++) byte_to_unit[k] = (float)k / 255.0f;
}

/* RGB bytes px [n, 3] -> r, g, b [n], 8 pixels a step: two overlapping 16-byte loads hold
 * 24 bytes, byte shuffles gather each channel, and vdivps divides by 255 exactly as the table
 * (IEEE division is correctly rounded). Faster than the table on a photo (Zen 3:
 * bench/RESULTS.md, "Figures behind the code"). Returns how many pixels it did (a multiple of
 * 8; the caller does the rest). */
__attribute__((target("avx2"))) static int64_t rgb_planar_avx2(const unsigned char *px, int64_t n,
                                                               float *r, float *g, float *b) {
    const __m128i lo[3] = {
        _mm_setr_epi8(0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
        _mm_setr_epi8(1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
        _mm_setr_epi8(2, 5, 8, 11, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1)};
    const __m128i hi[3] = {
        _mm_setr_epi8(-1, -1, -1, -1, -1, -1, 10, 13, -1, -1, -1, -1, -1, -1, -1, -1),
        _mm_setr_epi8(-1, -1, -1, -1, -1, 8, 11, 14, -1, -1, -1, -1, -1, -1, -1, -1),
        _mm_setr_epi8(-1, -1, -1, -1, -1, 9, 12, 15, -1, -1, -1, -1, -1, -1, -1, -1)};
    float *dst[3] = {r, g, b};
    const __m256 k255 = _mm256_set1_ps(255.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) { /* bytes 3i .. 3i + 23: inside px */
        __m128i a = _mm_loadu_si128((const __m128i *)(px + 3 * i));
        __m128i c = _mm_loadu_si128((const __m128i *)(px + 3 * i + 8));
        for (int k = 0; k < 3; k++) {
            __m128i bytes = _mm_or_si128(_mm_shuffle_epi8(a, lo[k]), _mm_shuffle_epi8(c, hi[k]));
            __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
            _mm256_storeu_ps(dst[k] + i, _mm256_div_ps(f, k255));
        }
    }
    return i;
}

static bool have_avx2;

__attribute__((constructor)) static void have_avx2_init(void) {
    have_avx2 = __builtin_cpu_supports("avx2");
}

/* px [n, fc] (fc 1 or 3) -> out [channels, plane] at columns 0..n-1 of each plane, / 255:
 * grey replicates, RGB to grey is Pillow's L24 luma. Bit for bit ToTensor's div(255). */
static void to_planar_row(const unsigned char *restrict px, int fc, int64_t n, int channels,
                          float *restrict out, int64_t plane) {
    const float *u = byte_to_unit;
    if (fc == 3 && channels == 3) {
        float *restrict r = out, *restrict g = out + plane, *restrict b = out + 2 * plane;
        int64_t i = have_avx2 ? rgb_planar_avx2(px, n, r, g, b) : 0;
        for (; i < n; i++) {
            r[i] = u[px[3 * i]];
            g[i] = u[px[3 * i + 1]];
            b[i] = u[px[3 * i + 2]];
        }
    } else if (fc == 3) {
        for (int64_t i = 0; i < n; i++) {
            const unsigned char *p = px + 3 * i;
            uint32_t l = ((uint32_t)p[0] * 19595 + (uint32_t)p[1] * 38470 + (uint32_t)p[2] * 7471 +
                          0x8000) >>
                         16;
            out[i] = u[l];
        }
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = u[px[i]];
        for (int c = 1; c < channels; c++) memcpy(out + c * plane, out, (size_t)n * sizeof(float));
    }
}

/* img becomes an uninitialised [channels, h, w] image of its own. */
static int image_alloc(tdm_image *img, int channels, int64_t h, int64_t w, const char *name) {
    size_t bytes = (size_t)(channels * h * w) * sizeof(float); /* < 2^31: sizes checked */
    float *data = (float *)malloc(bytes);
    if (!data)
        return tdm_raise(TDM_ERR_NOMEM, "image '%s': cannot allocate %zu bytes", name, bytes);
    *img = (tdm_image){.c = channels, .h = h, .w = w, .data = data};
    return TDM_OK;
}

/* A box asked for by a tdm_image_want_fn must lie in the image. */
static int image_box_check(const int64_t box[4], int64_t h, int64_t w, const char *name) {
    if (box[0] < 0 || box[1] < 0 || box[2] < 1 || box[3] < 1 || box[0] + box[2] > h ||
        box[1] + box[3] > w)
        return tdm_raise(TDM_ERR_ARG,
                         "image '%s': the part asked for (top %lld, left %lld, %lld x %lld) is "
                         "not inside the image of %lld x %lld",
                         name, (long long)box[0], (long long)box[1], (long long)box[2],
                         (long long)box[3], (long long)h, (long long)w);
    return TDM_OK;
}

/* ---- JPEG ------------------------------------------------------------------------------ */

/* libjpeg reports errors by calling error_exit, which must not return: it jumps back to the
 * decoder's setjmp. Warnings (a truncated file, corrupt data: libjpeg would go on with grey
 * rows) are errors too. The message is kept for tdm_raise. */
typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf back;
    char msg[JMSG_LENGTH_MAX];
} jpeg_err;

static void jpeg_on_error(j_common_ptr ci) {
    jpeg_err *e = (jpeg_err *)ci->err;
    ci->err->format_message(ci, e->msg);
    longjmp(e->back, 1);
}

static void jpeg_on_message(j_common_ptr ci, int level) {
    if (level < 0) jpeg_on_error(ci); /* a warning; trace messages (level >= 0) are ignored */
}

/* A progressive JPEG of absurdly many scans fails instead of taking minutes (TurboJPEG's
 * TJFLAG_LIMITSCANS limit). */
static void jpeg_on_progress(j_common_ptr ci) {
    j_decompress_ptr d = (j_decompress_ptr)ci;
    if (ci->is_decompressor && d->input_scan_number > JPEG_MAX_SCANS) {
        jpeg_err *e = (jpeg_err *)ci->err;
        snprintf(e->msg, sizeof e->msg, "more than %d scans (a damaged or hostile file)",
                 JPEG_MAX_SCANS);
        longjmp(e->back, 1);
    }
}

/* What one decode holds, freed by jpeg_finish_part whether it succeeded or not. */
typedef struct {
    struct jpeg_decompress_struct ci;
    jpeg_err err;
    struct jpeg_progress_mgr progress;
    unsigned char *row;
} jpeg_dec;

static int jpeg_fail(const jpeg_dec *d, const char *name) {
    return tdm_raise(TDM_ERR_FORMAT, "image '%s': JPEG: %s", name, d->err.msg);
}

/* Reads the header of b into d->ci (set up by the caller under its setjmp) and checks it. */
static int jpeg_read_checked(jpeg_dec *d, const unsigned char *b, size_t n, const char *name) {
    jpeg_mem_src(&d->ci, b, (unsigned long)n);
    jpeg_read_header(&d->ci, TRUE);
    if (d->ci.jpeg_color_space == JCS_CMYK || d->ci.jpeg_color_space == JCS_YCCK)
        return tdm_raise(TDM_ERR_FORMAT,
                         "image '%s': JPEG: a CMYK image; Tandem reads grey, YCbCr and RGB JPEGs",
                         name);
    return check_size(name, "JPEG", d->ci.image_width, d->ci.image_height);
}

static void jpeg_init(jpeg_dec *d) {
    memset(d, 0, sizeof *d);
    d->ci.err = jpeg_std_error(&d->err.pub);
    d->err.pub.error_exit = jpeg_on_error;
    d->err.pub.emit_message = jpeg_on_message;
    jpeg_create_decompress(&d->ci);
    d->progress.progress_monitor = jpeg_on_progress;
    d->ci.progress = &d->progress;
}

static int jpeg_probe(const unsigned char *b, size_t n, const char *name, tdm_image_info *info) {
    jpeg_dec d;
    jpeg_init(&d);
    int rc = setjmp(d.err.back) ? jpeg_fail(&d, name) : jpeg_read_checked(&d, b, n, name);
    *info =
        (tdm_image_info){.format = TDM_IMAGE_JPEG, .w = d.ci.image_width, .h = d.ci.image_height};
    jpeg_destroy_decompress(&d.ci);
    return rc;
}

/* Whether b ends with the EOI marker (trailing zero bytes allowed). Decoding a part stops
 * after its last row: a file cut short must still fail every time, whatever part is read. */
static bool jpeg_ends_whole(const unsigned char *b, size_t n) {
    while (n > 2 && b[n - 1] == 0) n--;
    return n >= 4 && b[n - 2] == 0xff && b[n - 1] == 0xd9;
}

/* The columns to decode for box columns [left, left + w) of an image w_img wide: one iMCU
 * more on each side where the image has it. libjpeg-turbo's cropped decoding upsamples the
 * chroma of the crop's outer columns as if they were the image's edge; a column one iMCU
 * inside gets the full decode's pixels bit for bit (checked against every subsampling in
 * tests/test_images.c). */
static void jpeg_columns(const jpeg_dec *d, int64_t left, int64_t w, JDIMENSION *x0,
                         JDIMENSION *cw) {
    int64_t imcu = (int64_t)d->ci.max_h_samp_factor * d->ci.min_DCT_scaled_size,
            w_img = d->ci.output_width;
    int64_t a = left - imcu > 0 ? left - imcu : 0;
    int64_t z = left + w + imcu < w_img ? left + w + imcu : w_img;
    *x0 = (JDIMENSION)a;
    *cw = (JDIMENSION)(z - a);
}

/* Decodes rows [top, top + h) and columns [left, left + w) of the started decoder d into
 * img as planar floats. Runs under the caller's setjmp. */
static int jpeg_read_box(jpeg_dec *d, int64_t top, int64_t left, int64_t h, int64_t w, int channels,
                         tdm_image *img, const char *name) {
    int fc = d->ci.output_components;
    JDIMENSION x0 = 0, cw = d->ci.output_width;
    if (left > 0 || w < (int64_t)d->ci.output_width) {
        jpeg_columns(d, left, w, &x0, &cw);
        jpeg_crop_scanline(&d->ci, &x0, &cw); /* may widen to iMCU boundaries */
    }
    int rc = image_alloc(img, channels, h, w, name);
    if (!rc && !(d->row = (unsigned char *)malloc((size_t)d->ci.output_width * (size_t)fc)))
        rc = tdm_raise(TDM_ERR_NOMEM, "image '%s': cannot allocate a row of %u pixels", name,
                       d->ci.output_width);
    if (rc) return rc;
    if (top > 0) jpeg_skip_scanlines(&d->ci, (JDIMENSION)top);
    int64_t at = left - (int64_t)x0; /* the box's first column in the decoded row */
    for (int64_t y = 0; y < h; y++) {
        JSAMPROW r = d->row;
        jpeg_read_scanlines(&d->ci, &r, 1);
        to_planar_row(d->row + at * fc, fc, w, channels, img->data + y * w, h * w);
    }
    return TDM_OK;
}

/* Grey JPEGs decode to one channel, the others to RGB (libjpeg's YCbCr conversion), with
 * libjpeg's defaults (accurate integer IDCT, fancy upsampling), as Pillow decodes. want NULL:
 * the whole image; else only the box it names (see tdm_image_decode_part). */
static int jpeg_decode(const unsigned char *b, size_t n, const char *name, int channels,
                       tdm_image_want_fn want, void *arg, tdm_image *img) {
    jpeg_dec d;
    jpeg_init(&d);
    int rc;
    if (setjmp(d.err.back)) {
        rc = jpeg_fail(&d, name);
    } else if (!(rc = jpeg_read_checked(&d, b, n, name))) {
        bool grey = d.ci.jpeg_color_space == JCS_GRAYSCALE;
        d.ci.out_color_space = grey ? JCS_GRAYSCALE : JCS_RGB;
        d.ci.dct_method = JDCT_ISLOW;
        jpeg_start_decompress(&d.ci);
        int64_t H = d.ci.output_height, W = d.ci.output_width, box[4] = {0, 0, H, W};
        if (want && jpeg_ends_whole(b, n)) want(arg, H, W, box);
        rc = image_box_check(box, H, W, name);
        if (!rc) rc = jpeg_read_box(&d, box[0], box[1], box[2], box[3], channels, img, name);
        if (!rc && (box[2] < H || box[3] < W))
            *img = (tdm_image){img->c, img->h, img->w, img->data, box[0], box[1], H, W};
        if (!rc && box[0] + box[2] == H) jpeg_finish_decompress(&d.ci); /* reads to EOI */
    }
    if (rc) {
        free(img->data);
        *img = (tdm_image){0};
    }
    free(d.row);
    jpeg_destroy_decompress(&d.ci);
    return rc;
}

/* ---- PNG ------------------------------------------------------------------------------- */

static int png_error(int err, const char *name) {
    return tdm_raise(TDM_ERR_FORMAT, "image '%s': PNG: %s%s", name, spng_strerror(err),
                     err == SPNG_IO_EOF ? " (the file is truncated)" : "");
}

/* A decoder over b with its header read and checked; NULL with an error raised. */
static spng_ctx *png_start(const unsigned char *b, size_t n, const char *name,
                           struct spng_ihdr *ihdr) {
    spng_ctx *ctx = spng_ctx_new(0);
    if (!ctx) return tdm_raise_null(TDM_ERR_NOMEM, "image '%s': PNG: out of memory", name);
    int err = spng_set_png_buffer(ctx, b, n);
    if (!err) err = spng_set_image_limits(ctx, MAX_SIDE, MAX_SIDE);
    if (!err) err = spng_set_chunk_limits(ctx, PNG_CHUNK_LIMIT, PNG_CACHE_LIMIT);
    if (!err) err = spng_get_ihdr(ctx, ihdr);
    if (err) png_error(err, name);
    if (!err && check_size(name, "PNG", ihdr->width, ihdr->height)) err = 1;
    if (err) {
        spng_ctx_free(ctx);
        return NULL;
    }
    return ctx;
}

static int png_probe(const unsigned char *b, size_t n, const char *name, tdm_image_info *info) {
    struct spng_ihdr ihdr;
    spng_ctx *ctx = png_start(b, n, name, &ihdr);
    if (!ctx) return tdm_last_status();
    spng_ctx_free(ctx);
    *info = (tdm_image_info){.format = TDM_IMAGE_PNG, .w = ihdr.width, .h = ihdr.height};
    return TDM_OK;
}

/* Every PNG decodes to RGB8 (libspng expands palettes and grey, drops alpha, ignores tRNS
 * without SPNG_DECODE_TRNS, keeps 16-bit samples' high byte); grey ones then keep one of
 * the three equal channels. */
static int png_decode(const unsigned char *b, size_t n, const char *name, int channels,
                      tdm_image *img) {
    struct spng_ihdr ihdr;
    spng_ctx *ctx = png_start(b, n, name, &ihdr);
    if (!ctx) return tdm_last_status();
    bool grey = ihdr.color_type == SPNG_COLOR_TYPE_GRAYSCALE ||
                ihdr.color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA;
    int64_t w = ihdr.width, h = ihdr.height;
    size_t len = 0;
    unsigned char *px = NULL;
    int rc = TDM_OK, err = spng_decoded_image_size(ctx, SPNG_FMT_RGB8, &len);
    if (err)
        rc = png_error(err, name);
    else if (!(px = (unsigned char *)malloc(len)))
        rc = tdm_raise(TDM_ERR_NOMEM, "image '%s': cannot allocate %zu bytes", name, len);
    else if ((err = spng_decode_image(ctx, px, len, SPNG_FMT_RGB8, 0)) != 0)
        rc = png_error(err, name);
    /* the chunks after the pixels, to IEND: libspng checks the last IDAT chunk's CRC only
     * when it reads past it, which decoding the pixels alone may not do */
    else if ((err = spng_decode_chunks(ctx)) != 0)
        rc = png_error(err, name);
    if (!rc && grey)
        for (int64_t i = 0; i < w * h; i++) px[i] = px[3 * i]; /* in place: i <= 3i */
    if (!rc) rc = image_alloc(img, channels, h, w, name);
    if (!rc) to_planar_row(px, grey ? 1 : 3, h * w, channels, img->data, h * w);
    free(px);
    spng_ctx_free(ctx);
    return rc;
}

/* ---- entry points ---------------------------------------------------------------------- */

int tdm_image_probe(const void *bytes, size_t n, const char *name, tdm_image_info *info) {
    const unsigned char *b = (const unsigned char *)bytes;
    tdm_image_format f;
    if (!name) name = "(memory)";
    if (!b && n) return tdm_raise(TDM_ERR_ARG, "image '%s': NULL bytes", name);
    int rc = format_of(b, n, name, &f);
    if (rc) return rc;
    return f == TDM_IMAGE_JPEG ? jpeg_probe(b, n, name, info) : png_probe(b, n, name, info);
}

int tdm_image_decode_part(const void *bytes, size_t n, const char *name, int channels,
                          tdm_image_want_fn want, void *arg, tdm_image *img) {
    const unsigned char *b = (const unsigned char *)bytes;
    tdm_image_format f;
    if (!name) name = "(memory)";
    if (!img) return tdm_raise(TDM_ERR_ARG, "tdm_image_decode: '%s': img is NULL", name);
    *img = (tdm_image){0};
    if (!b && n) return tdm_raise(TDM_ERR_ARG, "tdm_image_decode: '%s': bytes is NULL", name);
    if (channels != 1 && channels != 3)
        return tdm_raise(TDM_ERR_ARG, "tdm_image_decode: '%s': channels must be 1 or 3, got %d",
                         name, channels);
    int rc = format_of(b, n, name, &f);
    if (rc) return rc;
    /* PNG decodes whole: a part of it is the whole image, which want allows */
    return f == TDM_IMAGE_JPEG ? jpeg_decode(b, n, name, channels, want, arg, img)
                               : png_decode(b, n, name, channels, img);
}

int tdm_image_decode(const void *bytes, size_t n, const char *name, int channels, tdm_image *img) {
    return tdm_image_decode_part(bytes, n, name, channels, NULL, NULL, img);
}
