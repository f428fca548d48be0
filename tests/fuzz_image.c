/* Fuzz target for the image decoder (tdm_image_decode, JPEG through TurboJPEG and PNG through
 * libspng): any bytes must give either an image or a TDM_ERR_FORMAT error naming the input,
 * never a crash, a hang, a leak or an out-of-bounds read. An accepted image has the channels
 * asked for, a size within the decoder's limits, and every value in [0, 1].
 *
 * Input: one byte choosing the channels (bit 0: 1 channel, else 3), then the file's bytes.
 * Built like tests/fuzz_idx.c: `fuzz_image` (libFuzzer, -DTANDEM_FUZZ=ON) and
 * `fuzz_image_replay` (every build; CTest replays tests/fuzz/image_corpus).
 */
#include "fuzz_common.h"
#include "tandem/tandem.h"

#define NAME "fuzz-input.img"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int channels = data[0] & 1 ? 1 : 3;
    tdm_image img;
    int rc = tdm_image_decode(data + 1, size - 1, NAME, channels, &img);
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
    for (int64_t i = 0; i < img.c * img.h * img.w; i++)
        if (!(img.data[i] >= 0.0f && img.data[i] <= 1.0f)) abort();
    free(img.data);
    return 0;
}
