/* Fuzz target for `tandem train`'s command-line parser (train_parse_args, tools/train.c): any
 * argv must give options, --help or a usage error (EXIT_USAGE, printed to stderr), never a
 * crash, a leak or an out-of-bounds read. Accepted options must hold together: devices
 * parsed, a batch no smaller than them, a run identity that formats and equals itself.
 *
 * Input: the arguments after "train", separated by NUL bytes.
 * Built like tests/fuzz_safetensors.c: `fuzz_cli` (libFuzzer, -DTANDEM_FUZZ=ON) and
 * `fuzz_cli_replay` (every build; CTest replays tests/fuzz/cli_corpus). It links the
 * trainer's objects (the tandem_tools library), not only the Tandem library.
 */
#include "fuzz_common.h" /* first: it defines _GNU_SOURCE */

#include <math.h>

#include "train.h"

#define MAX_ARGS 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = (char *)malloc(size + 1);
    if (!text) abort();
    memcpy(text, data, size);
    text[size] = '\0';
    char *argv[MAX_ARGS + 2] = {"train"};
    int argc = 1;
    for (size_t at = 0; at < size && argc <= MAX_ARGS; at += strlen(text + at) + 1)
        argv[argc++] = text + at;
    argv[argc] = NULL;
    train_opts o;
    int rc = train_parse_args(argc, argv, &o);
    if (rc != 0 && rc != -1 && rc != EXIT_USAGE) abort();
    if (rc == 0) {
        if (o.n_devs < 1 || o.n_devs > TDM_MAX_DEVICES || o.batch_size < o.n_devs ||
            o.grad_accum < 1 || !o.optimizer || !isfinite(o.lr) || !isfinite(o.momentum))
            abort();
        static char id[16384], diff[256];
        if (train_identity(&o, id, sizeof id) != 0) abort();
        if (train_identity_diff(id, id, "a", "b", diff, sizeof diff)) abort();
    }
    tdm_clear_error();
    free(text);
    return 0;
}
