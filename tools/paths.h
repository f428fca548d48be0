/* The rule every command applies to the files it is given, before any work: no output may
 * be an input, and no two outputs the same file.
 *
 * An output "is" an input when it is the same file (st_dev and st_ino, through symlinks and
 * hard links), when it lies inside an input directory (the real path of the output, or of its
 * nearest existing parent, is under the input's real path), or when an input lies inside an
 * output directory (a --checkpoint-dir or --tensorboard DIR, which the run fills and prunes).
 * Paths that do not exist yet are compared by the real path of their nearest existing parent
 * followed by the rest as written, so "d/../x" style names of missing directories and bind
 * mounts that show one directory under two paths are not seen through. */
#ifndef TANDEM_TOOLS_PATHS_H
#define TANDEM_TOOLS_PATHS_H

#include <stdbool.h>
#include <stddef.h>

typedef struct {
    const char *option; /* as the user typed it: "--log", "--data"; named in the message */
    const char *path;   /* as given; NULL: the option was not given, the entry is skipped */
    bool output;
    bool dir; /* an output directory, whose files the run makes and deletes */
    /* an input that output directories may hold: --resume's checkpoint, inside
     * --checkpoint-dir by design (and beside --tensorboard's files in a run's directory) */
    bool may_be_held;
} path_use;

/* Checks uses[0, n) against each other. Returns 0, or -1 with why (cap bytes) saying which
 * output is which input, naming both options and both paths as given ("--log 'd/x' is inside
 * the --data directory 'd'; no output may be written among the inputs"). Inputs that do not
 * exist are skipped: their readers say so. */
int paths_check(const path_use *uses, int n, char *why, size_t cap);

#endif
