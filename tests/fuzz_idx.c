/* Fuzz target for the IDX reader (tdm_idx_dataset_open), raw and gzipped files alike: any
 * bytes must give either a dataset or a TDM_ERR_FORMAT error naming one of the two files,
 * never a crash, a hang, a leak or an out-of-bounds read. An accepted pair is read back whole:
 * every sample, its pixels in [0, 1] and its label below num_classes.
 *
 * Input: a little-endian u16 n, then the labels file (the next n bytes, fewer if the input
 * ends), then the images file (the rest). Each is written to a memfd the reader opens by path.
 * Built like tests/fuzz_safetensors.c: `fuzz_idx` (libFuzzer, -DTANDEM_FUZZ=ON) and
 * `fuzz_idx_replay` (every build; CTest replays tests/fuzz/idx_corpus).
 */
#include "fuzz_common.h"
#include "tandem/tandem.h"

static fuzz_file labels_file = {.fd = -1}, images_file = {.fd = -1};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    size_t nl = (size_t)data[0] | (size_t)data[1] << 8;
    data += 2, size -= 2;
    if (nl > size) nl = size;
    const char *lab = fuzz_file_write(&labels_file, data, nl);
    const char *img = fuzz_file_write(&images_file, data + nl, size - nl);
    tdm_dataset *ds = tdm_idx_dataset_open(img, lab);
    if (!ds) {
        /* a rejected input must say why, as a format error naming the file at fault */
        const char *e = tdm_last_error();
        if (tdm_last_status() != TDM_ERR_FORMAT || (!strstr(e, img) && !strstr(e, lab))) {
            fprintf(stderr, "fuzz_idx: unexpected error %d: %s\n", tdm_last_status(), e);
            abort();
        }
        tdm_clear_error();
        return 0;
    }
    int64_t k = tdm_dataset_sample_numel(ds);
    if (ds->n < 1 || k < 1 || ds->num_classes < 1 || ds->num_classes > 256) abort();
    float *x = (float *)malloc((size_t)k * sizeof(float));
    if (!x) abort();
    for (int64_t i = 0; i < ds->n; i++) {
        int64_t y = -1;
        if (ds->ops->get(ds, i, x, &y) != TDM_OK) abort();
        if (y < 0 || y >= ds->num_classes) abort();
        for (int64_t j = 0; j < k; j++)
            if (!(x[j] >= 0.0f && x[j] <= 1.0f)) abort();
        if (ds->ops->prefetch) ds->ops->prefetch(ds, i);
    }
    free(x);
    tdm_dataset_free(ds);
    tdm_clear_error();
    return 0;
}
