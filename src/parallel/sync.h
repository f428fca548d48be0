/* What the process groups share and must not have two copies of: the clock their deadlines
 * use, and the split of a buffer into per-rank chunks. The threads and MPI backends reduce
 * chunk r on rank r in rank order, which makes their results bit-identical; that holds only
 * while both split alike, so the split lives here once. */
#ifndef TDM_PARALLEL_SYNC_H
#define TDM_PARALLEL_SYNC_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* Chunks start on 64-byte boundaries: no two ranks write one cache line. */
#define TDM_CHUNK_ALIGN 64

/* CLOCK_MONOTONIC in nanoseconds. */
static inline int64_t tdm_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* [lo, hi) of chunk r when count elements of elem bytes are split over n ranks. */
static inline void tdm_chunk_of(int64_t count, size_t elem, int n, int r, int64_t *lo,
                                int64_t *hi) {
    int64_t align = TDM_CHUNK_ALIGN / (int64_t)elem > 0 ? TDM_CHUNK_ALIGN / (int64_t)elem : 1;
    int64_t per = (count + n - 1) / n;
    per = (per + align - 1) / align * align;
    *lo = (int64_t)r * per < count ? (int64_t)r * per : count;
    *hi = *lo + per < count ? *lo + per : count;
}

#endif
