/* Training progress on stdout: a bar redrawn in place on a terminal, plain lines otherwise. */
#ifndef TANDEM_TOOLS_PROGRESS_H
#define TANDEM_TOOLS_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef struct {
    FILE *out;
    bool tty;      /* redraw one line with \r; otherwise print a line every `every` steps */
    bool quiet;    /* print nothing */
    int64_t every; /* steps between plain lines (non-terminal) */
    int epoch, epochs;
    int64_t steps;     /* steps in this epoch */
    double t_start;    /* when the epoch started */
    double t_drawn;    /* when the bar was last drawn */
    int64_t last_line; /* step of the last plain line */
    bool drawn;        /* a bar is on screen and must be cleared before other output */
} progress;

/* every: steps between plain lines when out is not a terminal; 0 picks about 10 per epoch. */
void progress_init(progress *p, FILE *out, bool quiet, int64_t every);
void progress_epoch_begin(progress *p, int epoch, int epochs, int64_t steps, double now);
/* Reports that `step` steps (1-based) of the epoch are done, with the running mean loss and
 * the images processed so far in this epoch. Draws at most ~10 times a second. */
void progress_update(progress *p, int64_t step, double loss, int64_t images, double now);
/* The header's "compute" line: the CPU GEMM library and its kernel set; when that library
 * runs slower kernels than the CPU allows, a warning with the fix on stderr. */
void progress_print_compute(FILE *out);
/* Clears the bar (a terminal) so the next line starts clean. */
void progress_clear(progress *p);

/* Seconds on a monotonic clock. */
double progress_now(void);

#endif
