/* Fuzz target for the image decoder (tdm_image_decode and tdm_image_decode_part, JPEG through
 * libjpeg-turbo and PNG through libspng): any bytes must give either an image or a
 * TDM_ERR_FORMAT error naming the input, never a crash, a hang, a leak or an out-of-bounds
 * read. An accepted image has the channels asked for, a size within the decoder's limits (the
 * box asked for, for a part), and every value in [0, 1].
 *
 * Input: one byte choosing the channels (bit 0: 1 channel, else 3) and whether to decode a
 * part (bit 1; bits 2-7 place the box), then the file's bytes.
 * Built like tests/fuzz_idx.c: `fuzz_image` (libFuzzer, -DTANDEM_FUZZ=ON) and
 * `fuzz_image_replay` (every build; CTest replays tests/fuzz/image_corpus).
 */
#include "fuzz_common.h"
#include "tandem/tandem.h"

#define NAME "fuzz-input.img"

/* A box in the lower right of the image, placed by the control byte's bits 2-7. */
static void want_box(void *arg, int64_t h, int64_t w, int64_t box[4]) {
    unsigned ctl = *(const uint8_t *)arg;
    box[0] = h * ((ctl >> 2) & 7) / 8, box[1] = w * ((ctl >> 5) & 7) / 8;
    box[2] = (h - box[0] + 1) / 2, box[3] = (w - box[1] + 1) / 2;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int channels = data[0] & 1 ? 1 : 3;
    bool part = data[0] & 2;
    tdm_image img;
    int rc = tdm_image_decode_part(data + 1, size - 1, NAME, channels, part ? want_box : NULL,
                                   (void *)data, &img);
    if (rc != TDM_OK) {
        /* a rejected input must say why, as a format error naming the input */
        if (rc != TDM_ERR_FORMAT || !strstr(tdm_last_error(), NAME) || img.data) {
            fprintf(stderr, "fuzz_image: unexpected error %d: %s\n", rc, tdm_last_error());
            abort();
        }
        tdm_clear_error();
        return 0;
    }
    if (img.c != channels || img.h < 1 || img.w < 1 || img.h > 65535 || img.w > 65535) abort();
    if (img.full_h > 0) { /* a part: the box want_box named */
        int64_t box[4];
        want_box((void *)data, img.full_h, img.full_w, box);
        if (!part || img.top != box[0] || img.left != box[1] || img.h != box[2] || img.w != box[3])
            abort();
    }
    for (int64_t i = 0; i < img.c * img.h * img.w; i++)
        if (!(img.data[i] >= 0.0f && img.data[i] <= 1.0f)) abort();
    free(img.data);
    return 0;
}
