/* bf16 and fp16 conversions (tandem/half.h): every 16-bit value's round trip, ties to even,
 * NaN, inf and denormals by hand, PyTorch's bits for a few hundred edge values and digests of
 * its conversions of all 65536 values and of 2^18 random float patterns (fixtures:
 * tests/fixtures/gen_half.py -> half_fixtures.h), and the array forms at every instruction
 * level this CPU has against the scalar forms, bit for bit, with and without flush-to-zero. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "core/half_isa.h"
#include "fixtures/half_fixtures.h"

static uint32_t bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float flt(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static uint64_t fnv1a(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 0xCBF29CE484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001B3ull;
    return h;
}

static uint32_t xorshift32(uint32_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 17;
    *x ^= *x << 5;
    return *x;
}

static bool f16_is_nan(uint16_t h) {
    return (h & 0x7C00) == 0x7C00 && (h & 0x3FF);
}
static bool bf16_is_nan(uint16_t h) {
    return (h & 0x7F80) == 0x7F80 && (h & 0x7F);
}

/* Every bf16 and fp16 value to float and back gives itself (a NaN comes back quiet: bf16 as
 * PyTorch's 0xFFFF, fp16 with its payload and the quiet bit). */
static void test_round_trips(void) {
    int bad_bf = 0, bad_f16 = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        uint16_t b = tdm_bf16_from_float(tdm_bf16_to_float((uint16_t)h));
        uint16_t want_b = bf16_is_nan((uint16_t)h) ? 0xFFFF : (uint16_t)h;
        bad_bf += b != want_b;
        uint16_t f = tdm_f16_from_float(tdm_f16_to_float((uint16_t)h));
        uint16_t want_f = f16_is_nan((uint16_t)h) ? (uint16_t)(h | 0x200) : (uint16_t)h;
        bad_f16 += f != want_f;
        if (f16_is_nan((uint16_t)h)) bad_f16 += !isnan(tdm_f16_to_float((uint16_t)h));
    }
    CHECK(bad_bf == 0, "%d bf16 values do not survive a round trip", bad_bf);
    CHECK(bad_f16 == 0, "%d fp16 values do not survive a round trip", bad_f16);
    /* the values themselves: bf16 is float's top half; fp16 by its definition */
    CHECK(tdm_bf16_to_float(0x3F80) == 1.0f && tdm_bf16_to_float(0xC049) == -3.140625f,
          "bf16 1, -3.140625");
    CHECK(tdm_f16_to_float(0x3C00) == 1.0f && tdm_f16_to_float(0x7BFF) == 65504.0f &&
              tdm_f16_to_float(0x0001) == 0x1p-24f && tdm_f16_to_float(0x83FF) == -0x3FFp-24f &&
              tdm_f16_to_float(0x0400) == 0x1p-14f,
          "fp16 1, 65504, subnormals, smallest normal");
}

/* Ties go to the even neighbour; anything past a tie goes to the nearer. */
static void test_ties(void) {
    /* bf16: 1 + 2^-8 is half-way between 1 (0x3F80, even) and 1 + 2^-7 (0x3F81) */
    CHECK(tdm_bf16_from_float(flt(0x3F808000)) == 0x3F80, "bf16 tie down to even");
    CHECK(tdm_bf16_from_float(flt(0x3F818000)) == 0x3F82, "bf16 tie up to even");
    CHECK(tdm_bf16_from_float(flt(0x3F808001)) == 0x3F81, "bf16 past the tie");
    CHECK(tdm_bf16_from_float(flt(0x3F807FFF)) == 0x3F80, "bf16 short of the tie");
    CHECK(tdm_bf16_from_float(flt(0xBF818000)) == 0xBF82, "bf16 negative tie");
    /* fp16: 1 + 2^-11 between 1 (0x3C00) and 1 + 2^-10 */
    CHECK(tdm_f16_from_float(flt(0x3F801000)) == 0x3C00, "fp16 tie down to even");
    CHECK(tdm_f16_from_float(flt(0x3F803000)) == 0x3C02, "fp16 tie up to even");
    CHECK(tdm_f16_from_float(flt(0x3F801001)) == 0x3C01, "fp16 past the tie");
    /* fp16 subnormals, in units of 2^-24: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 0.5 + eps -> 1 */
    CHECK(tdm_f16_from_float(0x1p-25f) == 0x0000, "2^-25 ties to 0");
    CHECK(tdm_f16_from_float(0x3p-25f) == 0x0002, "1.5 units to 2");
    CHECK(tdm_f16_from_float(0x5p-25f) == 0x0002, "2.5 units to 2");
    CHECK(tdm_f16_from_float(flt(0x33000001)) == 0x0001, "just above half a unit to 1");
    CHECK(tdm_f16_from_float(-0x7FFp-25f) == 0x8400, "1023.5 units up to -2^-14, a normal");
    CHECK(tdm_f16_from_float(0x7FDp-25f) == 0x03FE, "1022.5 units to 1022");
}

static void test_specials(void) {
    CHECK(tdm_bf16_from_float(INFINITY) == 0x7F80 && tdm_bf16_from_float(-INFINITY) == 0xFF80,
          "bf16 inf");
    CHECK(tdm_bf16_from_float(flt(0x7F7FFFFF)) == 0x7F80, "FLT_MAX rounds to bf16 inf");
    CHECK(tdm_bf16_from_float(NAN) == 0xFFFF && tdm_bf16_from_float(-NAN) == 0xFFFF &&
              tdm_bf16_from_float(flt(0x7F800001)) == 0xFFFF,
          "bf16 NaN, signalling NaN: PyTorch's 0xFFFF");
    CHECK(tdm_bf16_from_float(-0.0f) == 0x8000, "bf16 -0");
    CHECK(tdm_bf16_from_float(flt(0x00400000)) == 0x0040, "a float denormal stays a bf16 one");
    CHECK(tdm_bf16_from_float(flt(0x007FFFFF)) == 0x0080, "the largest denormal rounds up");
    CHECK(tdm_bf16_from_float(flt(0x80000001)) == 0x8000, "the smallest denormal to -0");
    CHECK(tdm_f16_from_float(65504.0f) == 0x7BFF && tdm_f16_from_float(65519.99f) == 0x7BFF,
          "fp16 max");
    CHECK(tdm_f16_from_float(65520.0f) == 0x7C00 && tdm_f16_from_float(-1e30f) == 0xFC00 &&
              tdm_f16_from_float(INFINITY) == 0x7C00,
          "fp16 overflow to inf");
    CHECK(tdm_f16_from_float(NAN) == 0x7E00 && tdm_f16_from_float(flt(0xFF812345)) == 0xFE09 &&
              tdm_f16_from_float(flt(0x7F800001)) == 0x7E00,
          "fp16 NaN: sign, quiet bit, top of the payload");
    CHECK(tdm_f16_from_float(flt(0x00000001)) == 0 && tdm_f16_from_float(-1e-30f) == 0x8000,
          "fp16 underflow to signed zero");
    CHECK(bits(tdm_f16_to_float(0x7C01)) == 0x7FC02000, "fp16 signalling NaN comes back quiet");
}

/* Scalar and array forms against PyTorch's bits. */
static void test_pytorch_edges(void) {
    uint16_t bf[HALFF_NEDGE], f16[HALFF_NEDGE];
    float x[HALFF_NEDGE];
    for (int i = 0; i < HALFF_NEDGE; i++) x[i] = flt(halff_edge_in[i]);
    int bad = 0;
    for (int i = 0; i < HALFF_NEDGE; i++) {
        uint16_t b = tdm_bf16_from_float(x[i]), f = tdm_f16_from_float(x[i]);
        if ((b != halff_edge_bf16[i] || f != halff_edge_f16[i]) && bad++ < 5)
            fprintf(stderr, "FAIL %08X: bf16 %04X (torch %04X), fp16 %04X (torch %04X)\n",
                    halff_edge_in[i], b, halff_edge_bf16[i], f, halff_edge_f16[i]);
    }
    CHECK(bad == 0, "%d of %d edge values differ from PyTorch (scalar)", bad, HALFF_NEDGE);
    tdm_bf16_from_f32(bf, x, HALFF_NEDGE);
    tdm_f16_from_f32(f16, x, HALFF_NEDGE);
    CHECK(memcmp(bf, halff_edge_bf16, sizeof bf) == 0, "bf16 array (%s) differs from PyTorch",
          tdm_half_isa());
    CHECK(memcmp(f16, halff_edge_f16, sizeof f16) == 0, "fp16 array (%s) differs from PyTorch",
          tdm_half_isa());
}

/* All 65536 values to float, and 2^18 random float patterns to each format, as digests of
 * PyTorch's results. */
static void test_pytorch_digests(void) {
    static uint16_t all[65536];
    static float back[65536];
    for (uint32_t i = 0; i < 65536; i++) all[i] = (uint16_t)i;
    tdm_bf16_to_f32(back, all, 65536);
    CHECK(fnv1a(back, sizeof back) == halff_bf16_back_fnv, "bf16 -> f32 (%s) differs from PyTorch",
          tdm_half_isa());
    tdm_f16_to_f32(back, all, 65536);
    CHECK(fnv1a(back, sizeof back) == halff_f16_back_fnv, "fp16 -> f32 (%s) differs from PyTorch",
          tdm_half_isa());
    float *x = malloc(HALFF_XS_N * sizeof *x);
    uint16_t *h = malloc(HALFF_XS_N * sizeof *h);
    if (!x || !h) {
        CHECK(0, "out of memory");
        free(x);
        free(h);
        return;
    }
    uint32_t s = HALFF_XS_SEED;
    for (int i = 0; i < HALFF_XS_N; i++) x[i] = flt(xorshift32(&s));
    tdm_bf16_from_f32(h, x, HALFF_XS_N);
    CHECK(fnv1a(h, HALFF_XS_N * sizeof *h) == halff_xs_bf16_fnv,
          "f32 -> bf16 (%s) of random patterns differs from PyTorch", tdm_half_isa());
    tdm_f16_from_f32(h, x, HALFF_XS_N);
    CHECK(fnv1a(h, HALFF_XS_N * sizeof *h) == halff_xs_f16_fnv,
          "f32 -> fp16 (%s) of random patterns differs from PyTorch", tdm_half_isa());
    free(x);
    free(h);
}

/* The array forms against the scalar ones on a large sample: random patterns, then normal
 * values with a denormal or a NaN sprinkled into some blocks of 32 (the AVX512_BF16 path's
 * fallback), at lengths that leave every tail. */
static void test_arrays_vs_scalar(void) {
    enum { N = 1 << 20 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y), *yr = malloc(N * sizeof *yr);
    uint16_t *h = malloc(N * sizeof *h), *hr = malloc(N * sizeof *hr);
    if (!x || !y || !yr || !h || !hr) {
        CHECK(0, "out of memory");
        goto out;
    }
    uint32_t s = 12345;
    for (int i = 0; i < N; i++) {
        uint32_t r = xorshift32(&s);
        if (i < N / 2)
            x[i] = flt(r);
        else if (r % 97 == 0)
            x[i] = r % 2 ? flt(r & 0x807FFFFF) : flt(r | 0x7F800000); /* denormal or inf/NaN */
        else
            x[i] = (float)((int32_t)r) * 0x1p-24f;
    }
    for (int pass = 0; pass < 2; pass++) {
        size_t lens[] = {N, N - 1, 31, 33, 7, 0};
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            size_t n = lens[li];
            size_t off = pass ? N / 2 + 3 : 0; /* the sprinkled half, misaligned */
            const float *src = x + off;
            if (n > N - off) n = N - off;
            tdm_bf16_from_f32(h, src, n);
            for (size_t i = 0; i < n; i++) hr[i] = tdm_bf16_from_float(src[i]);
            CHECK(memcmp(h, hr, n * sizeof *h) == 0, "bf16 array (%s), %zu values", tdm_half_isa(),
                  n);
            tdm_f16_from_f32(h, src, n);
            for (size_t i = 0; i < n; i++) hr[i] = tdm_f16_from_float(src[i]);
            CHECK(memcmp(h, hr, n * sizeof *h) == 0, "fp16 array (%s), %zu values", tdm_half_isa(),
                  n);
            tdm_f16_to_f32(y, h, n);
            for (size_t i = 0; i < n; i++) yr[i] = tdm_f16_to_float(h[i]);
            CHECK(memcmp(y, yr, n * sizeof *y) == 0, "fp16 -> f32 array (%s), %zu values",
                  tdm_half_isa(), n);
            tdm_bf16_to_f32(y, hr, n);
            for (size_t i = 0; i < n; i++) yr[i] = tdm_bf16_to_float(hr[i]);
            CHECK(memcmp(y, yr, n * sizeof *y) == 0, "bf16 -> f32 array, %zu values", n);
        }
    }
out:
    free(x);
    free(y);
    free(yr);
    free(h);
    free(hr);
}

static void run_all(void) {
    test_round_trips();
    test_ties();
    test_specials();
    test_pytorch_edges();
    test_pytorch_digests();
    test_arrays_vs_scalar();
}

int main(void) {
    tdm_half_level best = tdm_half_level_supported();
    printf("half conversions: %s\n", tdm_half_isa());
    for (int flush = 0; flush < 2; flush++) {
        tdm_set_flush_denormal(flush);
        for (int level = 0; level <= (int)best; level++) {
            tdm_half_set_max_level((tdm_half_level)level);
            run_all();
        }
    }
    tdm_set_flush_denormal(false);
    tdm_half_set_max_level(TDM_HALF_AVX512_BF16);
    return check_summary();
}
