/* Training progress on stdout: a bar redrawn in place on a terminal, plain lines otherwise
 * (the trainer prints those at the steps it chooses, with the mean loss since the last one). */
#ifndef TANDEM_TOOLS_PROGRESS_H
#define TANDEM_TOOLS_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef struct {
    FILE *out;
    bool tty;         /* redraw one line with \r; otherwise plain lines (progress_line) */
    bool quiet;       /* print nothing */
    const char *unit; /* what the rate counts: "img" or "tok" */
    int epoch, epochs;
    int64_t steps;  /* steps in this epoch */
    double t_start; /* when the epoch started */
    double t_drawn; /* when the bar was last drawn */
    bool drawn;     /* a bar is on screen and must be cleared before other output */
} progress;

/* unit: what a sample's rate counts ("img", "tok"); a string that outlives p. */
void progress_init(progress *p, FILE *out, bool quiet, const char *unit);
/* steps: the steps this epoch will run (fewer than an epoch's when --max-steps stops it). */
void progress_epoch_begin(progress *p, int epoch, int epochs, int64_t steps, double now);
/* On a terminal: redraws the bar for `step` steps (1-based) of the epoch done, the epoch's
 * running mean loss and `units` (images, tokens) processed so far in the epoch, at most ~10
 * times a second. Elsewhere nothing. */
void progress_update(progress *p, int64_t step, double loss, double units, double now);
/* Not on a terminal: one plain line for `step` with the mean loss of the steps since the
 * previous line, the learning rate, ms per step and units per second over those steps. */
void progress_line(progress *p, int64_t step, double loss, double lr, double ms_per_step,
                   double rate, double now);
/* The header's "compute" line: the CPU GEMM library and its kernel set; when that library
 * runs slower kernels than the CPU allows, a warning with the fix on stderr. */
void progress_print_compute(FILE *out);
/* Whether this CPU runs bf16 matrix products natively: cpuid reports AVX512_BF16 or AMX-BF16
 * (with the OS's consent) and ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) does not mask them.
 * how (cap bytes) gets what was found: "AVX512_BF16", "AVX512_BF16 and AMX", or why not. */
bool progress_bf16_native(char *how, size_t cap);
/* Clears the bar (a terminal) so the next line starts clean. */
void progress_clear(progress *p);

/* Seconds on a monotonic clock. */
double progress_now(void);
/* Seconds since this process started (the kernel's start time in /proc/self/stat, so the
 * dynamic loader's work counts too; where that is not readable, since this program was
 * loaded): the wall time of a whole run, to compare with another program's. */
double progress_wall_s(void);

#endif
