/* Fuzz target for the llm.c token shard reader (tdm_token_dataset_open): any bytes must give
 * either a dataset or a TDM_ERR_FORMAT error naming the file, never a crash, a leak or an
 * out-of-bounds read of the mapping. An accepted shard is read back whole: every window, its
 * tokens below vocab, and y equal to x shifted by one.
 *
 * Input: one byte for the context (1 + byte), one for the vocabulary (an entry of `vocabs`),
 * then the shard itself, written to a memfd the reader maps by path.
 * Built like tests/fuzz_safetensors.c: `fuzz_tokens` (libFuzzer, -DTANDEM_FUZZ=ON) and
 * `fuzz_tokens_replay` (every build; CTest replays tests/fuzz/tokens_corpus).
 */
#include "fuzz_common.h"
#include "tandem/tandem.h"

static fuzz_file shard = {.fd = -1};
static const int64_t vocabs[8] = {1, 2, 10, 256, 1000, 50257, 65535, 65536};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    int64_t context = 1 + data[0], vocab = vocabs[data[1] % 8];
    const char *path = fuzz_file_write(&shard, data + 2, size - 2);
    tdm_dataset *ds = tdm_token_dataset_open(path, context, vocab);
    if (!ds) {
        const char *e = tdm_last_error();
        if (tdm_last_status() != TDM_ERR_FORMAT || !strstr(e, path)) {
            fprintf(stderr, "fuzz_tokens: unexpected error %d: %s\n", tdm_last_status(), e);
            abort();
        }
        tdm_clear_error();
        return 0;
    }
    if (ds->n < 1 || ds->num_classes != vocab || tdm_dataset_sample_numel(ds) != context) abort();
    int64_t *x = (int64_t *)malloc((size_t)context * sizeof(int64_t));
    int64_t *y = (int64_t *)malloc((size_t)context * sizeof(int64_t));
    if (!x || !y) abort();
    for (int64_t i = 0; i < ds->n; i++) {
        if (ds->ops->get(ds, i, x, y) != TDM_OK) abort();
        for (int64_t j = 0; j < context; j++) {
            if (x[j] < 0 || x[j] >= vocab || y[j] < 0 || y[j] >= vocab) abort();
            if (j + 1 < context && y[j] != x[j + 1]) abort();
        }
    }
    free(x);
    free(y);
    tdm_dataset_free(ds);
    tdm_clear_error();
    return 0;
}
