/* Fuzz target for the safetensors parser: any bytes must give either a valid file or a
 * TDM_ERR_FORMAT error, never a crash, a leak or an out-of-bounds read. For an accepted
 * input every tensor Tandem can hold is also read, which checks the offsets the parser
 * accepted against the buffer.
 *
 * Built two ways:
 *   - with clang and -DTANDEM_FUZZ=ON: a libFuzzer binary `fuzz_safetensors` (see scripts/fuzz);
 *   - always: `fuzz_safetensors_replay FILE_OR_DIR...`, a plain main() that feeds every file
 *     through the same entry point (the CTest test replays the committed corpus).
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tandem/io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

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

#ifdef FUZZ_REPLAY_MAIN
static int replay_file(const char *path) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return 1;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)n + 1);
    size_t got = buf ? fread(buf, 1, (size_t)n, fp) : 0;
    fclose(fp);
    if (!buf || got != (size_t)n) {
        free(buf);
        return 1;
    }
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    return 0;
}

int main(int argc, char **argv) {
    int files = 0, failed = 0;
    for (int a = 1; a < argc; a++) {
        struct stat st;
        if (stat(argv[a], &st) != 0) {
            fprintf(stderr, "fuzz_safetensors_replay: cannot read %s\n", argv[a]);
            return 1;
        }
        if (!S_ISDIR(st.st_mode)) {
            failed += replay_file(argv[a]);
            files++;
            continue;
        }
        DIR *d = opendir(argv[a]);
        struct dirent *e;
        while (d && (e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.') continue;
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", argv[a], e->d_name);
            failed += replay_file(p);
            files++;
        }
        if (d) closedir(d);
    }
    printf("fuzz_safetensors_replay: %d inputs replayed, %d unreadable\n", files, failed);
    return failed || files == 0;
}
#endif
