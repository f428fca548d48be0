/* Fuzz target for the llm.c model file reader (tdm_gpt_load_llmc): any bytes must give either
 * a GPT or a TDM_ERR_FORMAT error naming the file, never a crash, a leak, an overflow or an
 * allocation the file cannot justify. An accepted file must be one whose size is exactly the
 * header's model (4 bytes a parameter for version 3, 2 for version 5, bf16), and the model's
 * parameters, exported in llm.c's order, must be the file's values again (widened from bf16).
 *
 * Input: the file, written to a memfd the reader opens by path.
 * Built like tests/fuzz_safetensors.c: `fuzz_llmc` (libFuzzer, -DTANDEM_FUZZ=ON) and
 * `fuzz_llmc_replay` (every build; CTest replays tests/fuzz/llmc_corpus and the fixture).
 */
#include "fuzz_common.h"
#include "tandem/gpt.h"
#include "tandem/half.h"
#include "tandem/tandem.h"

static fuzz_file model_file = {.fd = -1};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file_write(&model_file, data, size);
    tdm_gpt_config c;
    tdm_module *m = tdm_gpt_load_llmc(path, tdm_cpu(0), &c);
    if (!m) {
        const char *e = tdm_last_error();
        if (tdm_last_status() != TDM_ERR_FORMAT || !strstr(e, path)) {
            fprintf(stderr, "fuzz_llmc: unexpected error %d: %s\n", tdm_last_status(), e);
            abort();
        }
        tdm_clear_error();
        return 0;
    }
    int64_t n = tdm_gpt_llmc_numel(&c);
    int32_t version;
    memcpy(&version, data + 4, 4);
    uint64_t es = version == 5 ? 2 : 4; /* version 5: bf16 */
    if (n < 1 || (version != 3 && version != 5) || 1024 + es * (uint64_t)n != size) abort();
    float *p = (float *)malloc((size_t)n * sizeof(float));
    float *want = (float *)malloc((size_t)n * sizeof(float));
    if (!p || !want || tdm_gpt_export_llmc(m, false, p, n) != TDM_OK) abort();
    if (es == 2)
        tdm_bf16_to_f32(want, (const uint16_t *)(data + 1024), (size_t)n);
    else
        memcpy(want, data + 1024, (size_t)n * sizeof(float));
    if (memcmp(p, want, (size_t)n * sizeof(float)) != 0) abort();
    free(p);
    free(want);
    tdm_module_free(m);
    tdm_clear_error();
    return 0;
}
