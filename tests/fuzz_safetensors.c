/* Fuzz target for the safetensors parser: any bytes must give either a valid file or a
 * TDM_ERR_FORMAT error, never a crash, a leak or an out-of-bounds read. For an accepted
 * input every tensor Tandem can hold is also read, which checks the offsets the parser
 * accepted against the buffer.
 *
 * Built two ways:
 *   - with clang and -DTANDEM_FUZZ=ON: a libFuzzer binary `fuzz_safetensors` (see scripts/fuzz);
 *   - always: `fuzz_safetensors_replay FILE_OR_DIR...`, a plain main() (fuzz_common.h) that
 *     feeds every file through the same entry point (the CTest test replays the corpus).
 */
#include "fuzz_common.h"
#include "tandem/io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    tdm_safetensors *f =
        tdm_safetensors_open_memory(size ? data : (const uint8_t *)"", size, "fuzz");
    if (!f) {
        /* a rejected input must say why, as a format error */
        if (tdm_last_status() != TDM_ERR_FORMAT || !strstr(tdm_last_error(), "fuzz")) abort();
        tdm_clear_error();
        return 0;
    }
    tdm_scope_begin();
    for (int i = 0; i < tdm_safetensors_count(f); i++) {
        tdm_dtype dt;
        const char *name = tdm_safetensors_name(f, i);
        if (!name || !tdm_safetensors_dtype(f, i)) abort();
        if (tdm_safetensors_tdm_dtype(f, i, &dt) == TDM_OK &&
            !tdm_safetensors_load(f, name, tdm_cpu(0)))
            abort(); /* a validated tensor must read */
    }
    tdm_scope_end();
    tdm_safetensors_close(f);
    tdm_clear_error();
    return 0;
}
