/* The order of samples in an epoch: sequential, or a permutation drawn from (seed + epoch)
 * with Philox, split across ranks as PyTorch's DistributedSampler does. */
#include "data/sampler.h"

/* Philox stream of the shuffle; augmentation uses streams with the top bit set. */
#define SAMPLER_STREAM 0x53414d504c45ull /* "SAMPLE" */

int64_t tdm_sampler_count(int64_t n, int world) {
    return world > 1 ? (n + world - 1) / world : n;
}

/* Fisher-Yates from the last position down; step k draws one 64-bit word (two per Philox
 * block). The modulo bias is below n / 2^64. */
static void permutation(int64_t *perm, int64_t n, uint64_t key) {
    for (int64_t i = 0; i < n; i++) perm[i] = i;
    uint32_t w[4] = {0, 0, 0, 0};
    for (int64_t i = n - 1, k = 0; i > 0; i--, k++) {
        if ((k & 1) == 0) tdm_philox(key, (uint64_t)k >> 1, SAMPLER_STREAM, w);
        uint64_t r = (k & 1) ? ((uint64_t)w[3] << 32 | w[2]) : ((uint64_t)w[1] << 32 | w[0]);
        int64_t j = (int64_t)(r % (uint64_t)(i + 1));
        int64_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
}

static void order(int64_t *out, int64_t n, bool shuffle, uint64_t key) {
    if (shuffle) {
        permutation(out, n, key);
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = i;
    }
}

void tdm_sampler_fill(int64_t *out, int64_t *scratch, int64_t n, bool shuffle, uint64_t seed,
                      int64_t epoch, int rank, int world) {
    uint64_t key = seed + (uint64_t)epoch; /* DistributedSampler: generator seeded seed+epoch */
    if (world <= 1) {
        order(out, n, shuffle, key);
        return;
    }
    order(scratch, n, shuffle, key);
    /* padded[k] = full[k % n] (repeat from the start); rank takes padded[rank::world] */
    int64_t count = tdm_sampler_count(n, world);
    for (int64_t j = 0; j < count; j++) out[j] = scratch[(rank + j * (int64_t)world) % n];
}
