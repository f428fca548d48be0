/* Fuzz target for the CSV reader (tdm_csv_dataset_open): any bytes must give either a
 * dataset or an error naming the file (TDM_ERR_FORMAT; TDM_ERR_ARG for a label column the
 * rows do not have), never a crash, a leak or an out-of-bounds read. An accepted file is
 * read back whole: finite features and labels below num_classes.
 *
 * Input: one byte choosing the header flag (bit 0) and the label column (bits 1-3: -4..3),
 * then the file itself, written to a memfd the reader opens by path.
 * Built like tests/fuzz_safetensors.c: `fuzz_csv` (libFuzzer, -DTANDEM_FUZZ=ON) and
 * `fuzz_csv_replay` (every build; CTest replays tests/fuzz/csv_corpus).
 */
#include "fuzz_common.h" /* first: it defines _GNU_SOURCE */

#include <math.h>

#include "tandem/tandem.h"

static fuzz_file csv_file = {.fd = -1};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    bool header = data[0] & 1;
    int label_column = (int)((data[0] >> 1) & 7) - 4;
    const char *path = fuzz_file_write(&csv_file, data + 1, size - 1);
    tdm_dataset *ds = tdm_csv_dataset_open(path, label_column, header);
    if (!ds) {
        const char *e = tdm_last_error();
        tdm_status st = tdm_last_status();
        if (!strstr(e, path) ||
            !(st == TDM_ERR_FORMAT || (st == TDM_ERR_ARG && strstr(e, "label_column")))) {
            fprintf(stderr, "fuzz_csv: unexpected error %d: %s\n", st, e);
            abort();
        }
        tdm_clear_error();
        return 0;
    }
    int64_t k = tdm_dataset_sample_numel(ds);
    if (ds->n < 1 || k < 1 || ds->num_classes < 1) abort();
    float *x = (float *)malloc((size_t)k * sizeof(float));
    if (!x) abort();
    for (int64_t i = 0; i < ds->n; i++) {
        int64_t y = -1;
        if (ds->ops->get(ds, i, x, &y) != TDM_OK) abort();
        if (y < 0 || y >= ds->num_classes) abort();
        for (int64_t j = 0; j < k; j++)
            if (!isfinite(x[j])) abort();
    }
    free(x);
    tdm_dataset_free(ds);
    tdm_clear_error();
    return 0;
}
