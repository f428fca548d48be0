/* Cache-line movement between cores: see lines.h. Every loop goes a block of four 64-byte
 * lines (64 floats) at a time and asks for the lines AHEAD floats further on. */
#include "parallel/lines.h"
#include "parallel/group.h" /* tdm_reduce_ranks */

#include <string.h>

#define AHEAD 512 /* floats: 2 KiB */
#define BLOCK 64  /* floats: four lines */

/* Asks for the line of p[i] (PREFETCHT0), or for it in writable state (PREFETCHW, a NOP on
 * the x86-64 CPUs that lack it), with i clamped to the buffer's last element. A hint: it
 * never faults. */
static inline void want(const float *p, int64_t i, int64_t len, int write) {
    const float *q = p + (i < len ? i : len - 1);
#if defined(__x86_64__)
    if (write) {
        __asm__ volatile("prefetchw %0" ::"m"(*(const char *)q));
        return;
    }
#endif
    if (write) /* a constant argument each (clang requires one) */
        __builtin_prefetch(q, 1, 3);
    else
        __builtin_prefetch(q, 0, 3);
}

void tdm_lines_reduce(float *dst, const float *const *src, int n, int64_t lo, int64_t hi) {
    float acc[BLOCK];
    int64_t off = lo;
    for (; off + BLOCK <= hi; off += BLOCK) { /* constant sizes: inlined vector moves */
        for (int l = 0; l < BLOCK; l += 16) {
            for (int k = 0; k < n; k++) want(src[k], off + AHEAD + l, hi, 0);
            want(dst, off + AHEAD + l, hi, 1);
        }
        tdm_reduce_ranks(acc, src, n, off, BLOCK, true);
        memcpy(dst + off, acc, sizeof acc);
    }
    tdm_reduce_ranks(acc, src, n, off, (int)(hi - off), true);
    memcpy(dst + off, acc, sizeof(float) * (size_t)(hi - off));
}

void tdm_lines_copy(float *dst, const float *src, int64_t len) {
    int64_t off = 0;
    for (; off + BLOCK <= len; off += BLOCK) {
        for (int l = 0; l < BLOCK; l += 16) want(dst, off + AHEAD + l, len, 1);
        memcpy(dst + off, src + off, BLOCK * sizeof(float));
    }
    memcpy(dst + off, src + off, sizeof(float) * (size_t)(len - off));
}
