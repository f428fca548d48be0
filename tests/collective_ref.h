/* Collective test inputs and their serial reference, shared by the threads test
 * (test_collectives.c) and the MPI test (test_mpi.c). */
#ifndef TDM_COLLECTIVE_REF_H
#define TDM_COLLECTIVE_REF_H

#include "check.h"

/* The input of rank r at element i: a hash of (r, i, salt) in [-1, 1). */
static inline float value(int r, int64_t i, int salt) {
    uint32_t x = (uint32_t)i * 2654435761u ^ (uint32_t)(r + 1) * 40503u ^ (uint32_t)salt * 97u;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return (float)(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
}

/* What every rank must get: the inputs of ranks 0..n-1 added in that order, / n for AVG. */
static inline float reference(int n, int64_t i, int salt, tdm_reduce_kind op) {
    float s = value(0, i, salt);
    for (int k = 1; k < n; k++) s += value(k, i, salt);
    return op == TDM_AVG ? s / (float)n : s;
}

#endif
