/* The random draws of the transforms: Philox words keyed by (seed, epoch, sample index, step),
 * and torchvision's get_params of RandomResizedCrop and RandomErasing on top of them.
 *
 * Philox4x32 takes a 64-bit key, a 64-bit counter and a 64-bit stream word. The key is the
 * seed, the counter the sample index, and the stream word packs
 *   bits 60-63  0x5, a tag that no other Philox user in Tandem puts there (the sampler's
 *               stream word is below 2^48, the augmentation's has bit 63 set, dropout's is 0/1)
 *   bits 52-59  the step's position in the transform
 *   bits 44-51  the block of four words within the step (256 blocks; a step draws < 30 words)
 *   bits  0-43  the epoch
 * so every (seed, epoch, index, step) has its own words, whatever the other samples and steps. */
#include <math.h>

#include "data/transforms_internal.h"

#define TF_STREAM_TAG (0x5ull << 60)

void tdm_tf_rng_init(tdm_tf_rng *r, uint64_t seed, int64_t epoch, int64_t index, int step) {
    r->seed = seed;
    r->index = (uint64_t)index;
    r->stream =
        TF_STREAM_TAG | ((uint64_t)(step & 0xff) << 52) | ((uint64_t)epoch & ((1ull << 44) - 1));
    r->block = 0;
    r->used = 4;
}

uint32_t tdm_tf_rng_u32(tdm_tf_rng *r) {
    if (r->used == 4) {
        tdm_philox(r->seed, r->index, r->stream | ((uint64_t)(r->block & 0xff) << 44), r->word);
        r->block++;
        r->used = 0;
    }
    return r->word[r->used++];
}

double tdm_tf_rng_uniform(tdm_tf_rng *r, double lo, double hi) {
    /* u in [0, 1) in steps of 2^-32: finer than torch's float32 uniform_ (2^-24) */
    double u = (double)tdm_tf_rng_u32(r) * (1.0 / 4294967296.0);
    return lo + (hi - lo) * u;
}

int64_t tdm_tf_rng_randint(tdm_tf_rng *r, int64_t n) {
    /* Lemire's multiply-shift without the rejection step: floor(u32 * n / 2^32). Each value
     * has probability 1/n within n / 2^32 (below 1e-5 for any image side), which no test
     * of an image pipeline can see, and the draw count stays fixed. */
    return (int64_t)(((uint64_t)tdm_tf_rng_u32(r) * (uint64_t)n) >> 32);
}

/* Python's int(round(x)): halves to even, as nearbyint in the default rounding mode */
static int64_t round_even(double x) {
    return (int64_t)nearbyint(x);
}

tdm_tf_box tdm_tf_rrc_params(tdm_tf_rng *r, int64_t H, int64_t W, const float scale[2],
                             const float ratio[2]) {
    double area = (double)H * (double)W;
    double lr0 = log((double)ratio[0]), lr1 = log((double)ratio[1]);
    for (int t = 0; t < 10; t++) {
        double target = area * tdm_tf_rng_uniform(r, scale[0], scale[1]);
        double aspect = exp(tdm_tf_rng_uniform(r, lr0, lr1));
        int64_t w = round_even(sqrt(target * aspect));
        int64_t h = round_even(sqrt(target / aspect));
        if (0 < w && w <= W && 0 < h && h <= H) {
            int64_t i = tdm_tf_rng_randint(r, H - h + 1);
            int64_t j = tdm_tf_rng_randint(r, W - w + 1);
            return (tdm_tf_box){i, j, h, w};
        }
    }
    /* the central crop, its aspect clamped to ratio */
    double in_ratio = (double)W / (double)H;
    int64_t w = W, h = H;
    if (in_ratio < ratio[0]) {
        h = round_even((double)w / ratio[0]);
    } else if (in_ratio > ratio[1]) {
        w = round_even((double)h * ratio[1]);
    }
    /* torchvision can round a side to 0 for a sliver of an image and then fails; keep 1 */
    if (h < 1) h = 1;
    if (w < 1) w = 1;
    return (tdm_tf_box){(H - h) / 2, (W - w) / 2, h, w};
}

bool tdm_tf_erasing_params(tdm_tf_rng *r, int64_t H, int64_t W, const float scale[2],
                           const float ratio[2], tdm_tf_box *box) {
    double area = (double)H * (double)W;
    double lr0 = log((double)ratio[0]), lr1 = log((double)ratio[1]);
    for (int t = 0; t < 10; t++) {
        double erase = area * tdm_tf_rng_uniform(r, scale[0], scale[1]);
        double aspect = exp(tdm_tf_rng_uniform(r, lr0, lr1));
        int64_t h = round_even(sqrt(erase * aspect));
        int64_t w = round_even(sqrt(erase / aspect));
        if (!(h < H && w < W)) continue;
        int64_t i = tdm_tf_rng_randint(r, H - h + 1);
        int64_t j = tdm_tf_rng_randint(r, W - w + 1);
        *box = (tdm_tf_box){i, j, h, w};
        return true;
    }
    return false;
}
