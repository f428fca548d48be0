/* Private to src/data: what a JPEG's or PNG's header says, read without decoding the pixels
 * (tdm_image_folder_open checks every file this way; tdm_image_decode, data.h, decodes). */
#ifndef TDM_IMAGE_DECODE_H
#define TDM_IMAGE_DECODE_H

#include "tandem/data.h"

#include <stddef.h>

/* Enough of a file's first bytes for the header of nearly every JPEG (its SOF marker comes
 * after the APPn segments, EXIF among them, which are rarely larger) and of every PNG (IHDR
 * ends at byte 33). Probing a longer prefix, or the whole file, is never wrong. */
#define TDM_IMAGE_PROBE_BYTES 8192

typedef enum { TDM_IMAGE_JPEG = 1, TDM_IMAGE_PNG = 2 } tdm_image_format;

typedef struct {
    tdm_image_format format;
    int64_t w, h;
} tdm_image_info;

/* Reads the header at the start of bytes (a prefix of a file, or all of it): the format from
 * the magic bytes, the size, and whether Tandem decodes it (size limits, colour space).
 * TDM_OK, or TDM_ERR_FORMAT naming name and the reason (the decoder's own words). */
int tdm_image_probe(const void *bytes, size_t n, const char *name, tdm_image_info *info);

#endif
