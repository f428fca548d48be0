/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
 * counter-based generator, so draw i of a tensor is a pure function of (seed, offset + i). */
#include "core/core.h"

#include <stdlib.h>
#include <string.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

static inline void mulhilo(uint32_t a, uint32_t b, uint32_t *hi, uint32_t *lo) {
    uint64_t p = (uint64_t)a * b;
    *hi = (uint32_t)(p >> 32);
    *lo = (uint32_t)p;
}

void tdm_philox(uint64_t seed, uint64_t counter, uint64_t stream, uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32);
    uint32_t c2 = (uint32_t)stream, c3 = (uint32_t)(stream >> 32);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint32_t hi0, lo0, hi1, lo1;
        mulhilo(PHILOX_M0, c0, &hi0, &lo0);
        mulhilo(PHILOX_M1, c2, &hi1, &lo1);
        uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

tdm_rng tdm_rng_make(uint64_t seed) {
    tdm_rng r = {seed, 0};
    return r;
}

static tdm_rng default_rng = {0x5eed, 0};

tdm_rng *tdm_default_rng(void) {
    return &default_rng;
}

void tdm_manual_seed(uint64_t seed) {
    default_rng = tdm_rng_make(seed);
}

/* ---- draws through the thread's log (core.h) ----------------------------------------------- */

static _Thread_local tdm_rng_log *rng_log;

static void log_append(tdm_rng_log *log, uint64_t v) {
    if (log->n == log->cap) {
        int cap = log->cap ? 2 * log->cap : 16;
        uint64_t *p = log->heap ? realloc(log->offsets, sizeof *p * (size_t)cap)
                                : malloc(sizeof *p * (size_t)cap);
        if (!p) {
            log->failed = true;
            return;
        }
        if (!log->heap && log->n) memcpy(p, log->offsets, sizeof *p * (size_t)log->n);
        log->offsets = p;
        log->cap = cap;
        log->heap = true;
    }
    log->offsets[log->n++] = v;
}

/* A draw's first counter through log and the logs below it (NULL: the generator itself). */
static uint64_t take(tdm_rng_log *log, tdm_rng *rng, uint64_t n) {
    if (!log) {
        uint64_t first = rng->offset;
        rng->offset += n;
        return first;
    }
    if (log->replay) {
        if (log->next < log->n) return log->offsets[log->next++];
        log->failed = true; /* the caller reports it; the draw itself still gets counters */
        return take(log->parent, rng, n);
    }
    uint64_t first = take(log->parent, rng, n);
    log_append(log, first);
    return first;
}

uint64_t tdm_rng_take(tdm_rng *rng, uint64_t n) {
    return take(rng_log, rng, n);
}

void tdm_rng_log_push(tdm_rng_log *log) {
    log->parent = rng_log;
    rng_log = log;
}

void tdm_rng_log_pop(tdm_rng_log *log) {
    rng_log = log->parent;
}

bool tdm_rng_logging(void) {
    return rng_log != NULL;
}
