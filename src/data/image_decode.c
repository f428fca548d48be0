/* JPEG and PNG files decoded into f32 [c, h, w] in [0, 1], as torchvision's default loader
 * (PIL's Image.open(f).convert("RGB"), or convert("L") for one channel) then ToTensor give them.
 *
 * JPEG goes through libjpeg-turbo's TurboJPEG API with libjpeg's defaults (the accurate
 * integer IDCT, fancy upsampling): Pillow decodes with the same library and the same
 * settings, so the pixels are Pillow's bit for bit where both use one libjpeg-turbo release.
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
 * of a decompression bomb. Every libjpeg warning is an error (TJFLAG_STOPONWARNING), so a
 * truncated JPEG fails instead of giving grey rows. */
#include "data/image_decode.h"
#include "core/core.h"

#include <spng.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <turbojpeg.h>

#define MAX_SIDE   65535
#define MAX_PIXELS 89478485
/* PNG chunks Tandem never reads (text, ICC profiles) may not claim more than this */
#define PNG_CHUNK_LIMIT (64u << 20)
#define PNG_CACHE_LIMIT (128u << 20)
/* accurate IDCT (libjpeg's and PIL's default, named for clarity); warnings fail; a
 * progressive JPEG of absurdly many scans fails instead of taking minutes */
#define JPEG_FLAGS (TJFLAG_ACCURATEDCT | TJFLAG_STOPONWARNING | TJFLAG_LIMITSCANS)

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
    if (w < 1 || h < 1) /* TurboJPEG's reading of a header cut before its SOF marker */
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

/* px [h*w, fc] (fc 1 or 3) -> out [channels, h*w] / 255: grey replicates, RGB to grey is
 * Pillow's L24 luma. Bit for bit ToTensor's div(255). */
static void to_planar(const unsigned char *restrict px, int fc, int64_t hw, int channels,
                      float *restrict out) {
    const float *u = byte_to_unit;
    if (fc == 3 && channels == 3) {
        float *restrict r = out, *restrict g = out + hw, *restrict b = out + 2 * hw;
        for (int64_t i = 0; i < hw; i++) {
            r[i] = u[px[3 * i]];
            g[i] = u[px[3 * i + 1]];
            b[i] = u[px[3 * i + 2]];
        }
    } else if (fc == 3) {
        for (int64_t i = 0; i < hw; i++) {
            const unsigned char *p = px + 3 * i;
            uint32_t l = ((uint32_t)p[0] * 19595 + (uint32_t)p[1] * 38470 + (uint32_t)p[2] * 7471 +
                          0x8000) >>
                         16;
            out[i] = u[l];
        }
    } else {
        for (int64_t i = 0; i < hw; i++) out[i] = u[px[i]];
        for (int c = 1; c < channels; c++) memcpy(out + c * hw, out, (size_t)hw * sizeof(float));
    }
}

/* Fills img with [channels, h, w] from px [h, w, fc]. */
static int image_fill(tdm_image *img, const unsigned char *px, int fc, int64_t h, int64_t w,
                      int channels, const char *name) {
    size_t bytes = (size_t)(channels * h * w) * sizeof(float); /* < 2^31: sizes checked */
    float *data = (float *)malloc(bytes);
    if (!data)
        return tdm_raise(TDM_ERR_NOMEM, "image '%s': cannot allocate %zu bytes", name, bytes);
    to_planar(px, fc, h * w, channels, data);
    *img = (tdm_image){.c = channels, .h = h, .w = w, .data = data};
    return TDM_OK;
}

/* ---- JPEG ------------------------------------------------------------------------------ */

static int jpeg_error(tjhandle tj, const char *name) {
    return tdm_raise(TDM_ERR_FORMAT, "image '%s': JPEG: %s", name, tjGetErrorStr2(tj));
}

/* The header: size and colour space (TJCS_*), checked. */
static int jpeg_header(tjhandle tj, const unsigned char *b, size_t n, const char *name, int *w,
                       int *h, int *cs) {
    int sub = 0;
    if (tjDecompressHeader3(tj, b, (unsigned long)n, w, h, &sub, cs) != 0)
        return jpeg_error(tj, name);
    if (*cs == TJCS_CMYK || *cs == TJCS_YCCK)
        return tdm_raise(TDM_ERR_FORMAT,
                         "image '%s': JPEG: a CMYK image; Tandem reads grey, YCbCr and RGB JPEGs",
                         name);
    return check_size(name, "JPEG", *w, *h);
}

static tjhandle jpeg_start(const char *name) {
    tjhandle tj = tjInitDecompress();
    if (!tj)
        tdm_raise(TDM_ERR_NOMEM, "image '%s': JPEG: cannot start the decoder: %s", name,
                  tjGetErrorStr2(NULL));
    return tj;
}

static int jpeg_probe(const unsigned char *b, size_t n, const char *name, tdm_image_info *info) {
    tjhandle tj = jpeg_start(name);
    if (!tj) return tdm_last_status();
    int w = 0, h = 0, cs = 0;
    int rc = jpeg_header(tj, b, n, name, &w, &h, &cs);
    tjDestroy(tj);
    *info = (tdm_image_info){.format = TDM_IMAGE_JPEG, .w = w, .h = h};
    return rc;
}

/* Grey JPEGs decode to one channel, the others to RGB (libjpeg's YCbCr conversion). */
static int jpeg_decode(const unsigned char *b, size_t n, const char *name, int channels,
                       tdm_image *img) {
    tjhandle tj = jpeg_start(name);
    if (!tj) return tdm_last_status();
    int w = 0, h = 0, cs = 0;
    unsigned char *px = NULL;
    int rc = jpeg_header(tj, b, n, name, &w, &h, &cs);
    int fc = cs == TJCS_GRAY ? 1 : 3;
    if (!rc && !(px = (unsigned char *)malloc((size_t)w * (size_t)h * (size_t)fc)))
        rc = tdm_raise(TDM_ERR_NOMEM, "image '%s': cannot allocate %d x %d pixels", name, w, h);
    if (!rc && tjDecompress2(tj, b, (unsigned long)n, px, w, 0, h, fc == 1 ? TJPF_GRAY : TJPF_RGB,
                             JPEG_FLAGS) != 0)
        rc = jpeg_error(tj, name);
    if (!rc) rc = image_fill(img, px, fc, h, w, channels, name);
    free(px);
    tjDestroy(tj);
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
    if (!rc) rc = image_fill(img, px, grey ? 1 : 3, h, w, channels, name);
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

int tdm_image_decode(const void *bytes, size_t n, const char *name, int channels, tdm_image *img) {
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
    return f == TDM_IMAGE_JPEG ? jpeg_decode(b, n, name, channels, img)
                               : png_decode(b, n, name, channels, img);
}
