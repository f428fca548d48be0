/* Fuzz target for the transform text (tdm_transform_parse), what --transform and
 * --eval-transform hand it: any text gives a transform or an error pointing into the text
 * (TDM_ERR_ARG, or TDM_ERR_SHAPE for sizes that cannot work), never a crash or a leak. An
 * accepted transform is printed (tdm_transform_str) and read back to the same text, and run
 * on a small image when its output size is fixed: the output shape it promised, finite pixels.
 *
 * Input: the text itself (its first NUL ends it).
 * Built like tests/fuzz_safetensors.c: `fuzz_transform` (libFuzzer, -DTANDEM_FUZZ=ON) and
 * `fuzz_transform_replay` (every build; CTest replays tests/fuzz/transform_corpus).
 */
#include "fuzz_common.h" /* first: it defines _GNU_SOURCE */

#include <math.h>

#include "tandem/tandem.h"

/* Runs tf on an image of [c, h, w] with a gradient of values, checking what it promised. */
static void run_on(const tdm_transform *tf, int64_t c, int64_t h, int64_t w) {
    tdm_shape out;
    if (tdm_transform_output_shape(tf, TDM_SHAPE(c, h, w), &out) != TDM_OK) {
        tdm_clear_error(); /* e.g. a crop larger than the padded image */
        return;
    }
    if (out.ndim != 3 || out.d[0] < 1 || out.d[1] < 1 || out.d[2] < 1) abort();
    if (out.d[1] > TDM_TRANSFORM_MAX_SIDE || out.d[2] > TDM_TRANSFORM_MAX_SIDE) abort();
    int64_t n = tdm_shape_numel(out);
    if (n > (1 << 22)) return; /* a large Resize the text asked for: slow, not wrong */
    float *in = malloc(sizeof(float) * (size_t)(c * h * w)), *o = malloc(sizeof(float) * (size_t)n);
    if (!in || !o) abort();
    for (int64_t i = 0; i < c * h * w; i++) in[i] = (float)(i % 97) / 96.0f;
    tdm_image img = {.c = c, .h = h, .w = w, .data = in};
    if (tdm_transform_apply(tf, &img, o, 7, 1, 3) == TDM_OK) {
        for (int64_t i = 0; i < n; i++)
            if (!isfinite(o[i])) abort();
    } else {
        tdm_clear_error();
    }
    free(in);
    free(o);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char text[512];
    size_t n = size < sizeof text - 1 ? size : sizeof text - 1;
    memcpy(text, data, n);
    text[n] = '\0';
    tdm_transform *tf = tdm_transform_parse(text, 24);
    if (!tf) {
        tdm_status st = tdm_last_status();
        if (st != TDM_ERR_ARG && st != TDM_ERR_SHAPE) {
            fprintf(stderr, "fuzz_transform: unexpected error %d: %s\n", st, tdm_last_error());
            abort();
        }
        tdm_clear_error();
        return 0;
    }
    char a[2048], b[2048];
    tdm_transform_str(tf, a, sizeof a);
    tdm_transform *again = tdm_transform_parse(a, 24);
    if (!again) {
        fprintf(stderr, "fuzz_transform: '%s' printed as '%s', which does not parse: %s\n", text, a,
                tdm_last_error());
        abort();
    }
    tdm_transform_str(again, b, sizeof b);
    if (strcmp(a, b) != 0) abort();
    tdm_transform_free(again);
    run_on(tf, 3, 20, 27);
    run_on(tf, 1, 9, 5);
    tdm_transform_free(tf);
    tdm_clear_error();
    return 0;
}
