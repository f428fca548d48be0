/* Moving cache lines between the cores of one process: the loops of DataParallel's
 * shared-memory update (dp.c), which every step read what another core wrote and write what
 * another core read.
 *
 * Left to the hardware, a core takes such lines one miss at a time. On the 2-core Xeon (family
 * 6 model 207) writing lines that the other core had just read took five times as long as
 * writing lines of its own, less than half that with PREFETCHW 2 KiB ahead; reading lines the
 * other core had written was faster with PREFETCHT0 ahead too (bench/RESULTS.md, "Issue 15:
 * two CPU devices against one, the MLP again"). These loops ask for the lines that far ahead.
 * The results are those of the plain loops, bit for bit. */
#ifndef TDM_PARALLEL_LINES_H
#define TDM_PARALLEL_LINES_H

#include <stdint.h>

/* dst[lo..hi) = the average of src[0..n)[lo..hi), summed as tdm_reduce_ranks sums (rank
 * order, then / n: the threads all-reduce's bits). dst may be one of the sources. */
void tdm_lines_reduce(float *dst, const float *const *src, int n, int64_t lo, int64_t hi);
/* dst[0..len) = src[0..len); the buffers do not overlap. */
void tdm_lines_copy(float *dst, const float *src, int64_t len);

#endif
