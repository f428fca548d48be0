/* The bf16 GEMM (src/backend/cpu/cpu_gemm_bf16.c) against tdm_cpu_sgemm of the same
 * bf16-rounded inputs, for every transpose, alpha and beta, fp32 and bf16 output, odd shapes
 * and padded leading dimensions; its primitive cache (bound, eviction, several threads at
 * once) and its errors. CTest runs it three times: as is (oneDNN's avx512_core_bf16 or AMX
 * kernels where the CPU has them), and with ONEDNN_MAX_CPU_ISA=AVX512_CORE and =AVX2, where
 * the bf16 instructions are missing and the GEMM converts to fp32 (the end of this comment).
 *
 * The bound. Both sides sum the k products in fp32 (a bf16 x bf16 product is exact in fp32),
 * in different orders. Each result is within gamma_(k+2) ~ (k + 2) * 2^-24 of the exact
 * alpha * A @ B + beta * C0, relative to |alpha| * (|A| @ |B|) + |beta| * |C0| (Higham, the
 * dot product bound, plus one rounding each for alpha's and beta's products), so they are
 * within twice that of each other: (2k + 8) * 2^-24 of it, the 8 covering the scale and the
 * sum. A bf16 output adds its own rounding, at most 2^-8 of the value (8 significant bits,
 * to nearest): 2^-8 * (|reference| + the bound above). An fp16 or bf16 accumulation would
 * exceed this by orders of magnitude at k >= 100. Without the bf16 instructions the GEMM
 * takes its fp32 path rather than oneDNN's emulation of them (the test prints which
 * implementation ran, and checks it under the two ONEDNN_MAX_CPU_ISA runs). */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_gemm_bf16.h"
#include "check.h"

static _Thread_local uint32_t rng_state = 1;

static float uniform(void) { /* [-1, 1) */
    rng_state = rng_state * 1664525u + 1013904223u;
    return (float)(rng_state >> 8) * 0x1p-23f - 1.0f;
}

/* rows x cols bf16 with row stride ld (the padding holds a marker), and its fp32 twin. */
static void fill(uint16_t *h, float *f, int64_t rows, int64_t cols, int64_t ld) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < ld; j++) {
            uint16_t v = j < cols ? tdm_bf16_from_float(uniform() * 4.0f) : 0x7FC1;
            h[r * ld + j] = v;
            f[r * ld + j] = tdm_bf16_to_float(v);
        }
}

typedef struct {
    int64_t m, n, k;
    bool ta, tb, c_bf16;
    float alpha, beta;
    int pad; /* added to every leading dimension */
} gcase;

/* Runs one case; returns the number of elements outside the bound (and of padding changed). */
static int run_case(const gcase *g, bool quiet) {
    int64_t m = g->m, n = g->n, k = g->k;
    int64_t ar = g->ta ? k : m, ac = g->ta ? m : k, br = g->tb ? n : k, bc = g->tb ? k : n;
    int64_t lda = ac + g->pad, ldb = bc + g->pad, ldc = n + g->pad;
    size_t asz = (size_t)(ar * lda), bsz = (size_t)(br * ldb), csz = (size_t)(m * ldc);
    uint16_t *a = malloc(asz * 2 + 2), *b = malloc(bsz * 2 + 2), *c16 = malloc(csz * 2 + 2);
    float *af = malloc(asz * 4 + 4), *bf = malloc(bsz * 4 + 4), *c0 = malloc(csz * 4 + 4);
    float *cref = malloc(csz * 4 + 4), *cout = malloc(csz * 4 + 4);
    int bad = 0;
    if (!a || !b || !c16 || !af || !bf || !c0 || !cref || !cout) {
        bad = 1;
        goto out;
    }
    fill(a, af, ar, ac, lda);
    fill(b, bf, br, bc, ldb);
    fill(c16, c0, m, n, ldc); /* C0 is bf16-exact, so a bf16 C holds the same values */
    if (g->beta == 0)         /* never read: NaN must not come through */
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++) {
                c0[r * ldc + j] = NAN;
                c16[r * ldc + j] = 0x7FC0;
            }
    memcpy(cref, c0, csz * 4);
    if (g->beta == 0)
        for (size_t i = 0; i < csz; i++) cref[i] = 0;
    tdm_cpu_sgemm(g->ta, g->tb, m, n, k, g->alpha, af, lda, bf, ldb, g->beta, cref, ldc);
    memcpy(cout, c0, csz * 4);
    int rc = tdm_cpu_gemm_bf16(g->ta, g->tb, m, n, k, g->alpha, a, lda, b, ldb, g->beta,
                               g->c_bf16 ? (void *)c16 : (void *)cout, g->c_bf16, ldc);
    if (rc) {
        fprintf(stderr, "FAIL gemm_bf16: %s\n", tdm_last_error());
        bad = 1;
        goto out;
    }
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < ldc; j++) {
            size_t at = (size_t)(i * ldc + j);
            float got = g->c_bf16 ? tdm_bf16_to_float(c16[at]) : cout[at];
            if (j >= n) { /* padding: untouched */
                bool same = g->c_bf16 ? c16[at] == 0x7FC1 : isnan(cout[at]);
                bad += !same;
                continue;
            }
            double mag = 0;
            for (int64_t p = 0; p < k; p++) {
                double x = g->ta ? af[p * lda + i] : af[i * lda + p];
                double y = g->tb ? bf[j * ldb + p] : bf[p * ldb + j];
                mag += fabs(x * y);
            }
            mag = fabs(g->alpha) * mag + (g->beta != 0 ? fabs(g->beta) * fabs(c0[at]) : 0);
            double tol = (2.0 * (double)k + 8) * 0x1p-24 * mag;
            if (g->c_bf16) tol += 0x1p-8 * (fabs(cref[at]) + tol);
            double err = fabs((double)got - cref[at]);
            if (!(err <= tol)) {
                if (!quiet && bad < 3)
                    fprintf(stderr,
                            "FAIL %lldx%lldx%lld ta %d tb %d %s alpha %g beta %g: C[%lld][%lld] = "
                            "%.9g, sgemm %.9g, |diff| %.3g > bound %.3g\n",
                            (long long)m, (long long)n, (long long)k, g->ta, g->tb,
                            g->c_bf16 ? "bf16" : "f32", g->alpha, g->beta, (long long)i,
                            (long long)j, got, cref[at], err, tol);
                bad++;
            }
        }
    }
out:
    free(a);
    free(b);
    free(c16);
    free(af);
    free(bf);
    free(c0);
    free(cref);
    free(cout);
    return bad;
}

static void test_products(void) {
    const int64_t shapes[][3] = {{1, 1, 1},      {7, 5, 3},      {33, 17, 65},   {64, 96, 300},
                                 {130, 70, 513}, {512, 64, 768}, {3, 200, 1000}, {2, 2, 4096}};
    const float ab[][2] = {{1, 0}, {1, 1}, {0.5f, 1}, {-1.25f, 0.75f}};
    int cases = 0, failed = 0, native = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 4; t++)
            for (int out = 0; out < 2; out++)
                for (size_t x = 0; x < sizeof ab / sizeof ab[0]; x++) {
                    gcase g = {shapes[s][0], shapes[s][1], shapes[s][2], t & 1,           t >> 1,
                               out,          ab[x][0],     ab[x][1],     (int)(s % 3) * 3};
                    cases++;
                    failed += run_case(&g, false) != 0;
                    const char *impl = tdm_cpu_gemm_bf16_impl();
                    native += strstr(impl, "bf16") || strstr(impl, "amx");
                }
    CHECK(failed == 0, "%d of %d products outside the bound (last: %s)", failed, cases,
          tdm_cpu_gemm_bf16_impl());
    printf("bf16 GEMM: %s\n", tdm_cpu_gemm_bf16_impl());
    const char *isa = getenv("ONEDNN_MAX_CPU_ISA");
    /* without the bf16 instructions (none on the CPU, or masked): the fp32 path, not oneDNN's
     * emulation of them, which is slower than it */
    if (isa && (strcmp(isa, "AVX2") == 0 || strcmp(isa, "AVX512_CORE") == 0))
        CHECK(native == 0 && strcmp(tdm_cpu_gemm_bf16_impl(), "fp32 sgemm") == 0,
              "ONEDNN_MAX_CPU_ISA=%s: %d products ran oneDNN's bf16 kernels (last %s)", isa, native,
              tdm_cpu_gemm_bf16_impl());
}

/* k = 0 scales C by beta; m or n 0 does nothing; bad sizes are refused. */
static void test_edges(void) {
    float c[6] = {1, 2, 3, 4, 5, 6};
    uint16_t a[1] = {0}, b[1] = {0};
    CHECK(tdm_cpu_gemm_bf16(false, false, 2, 3, 0, 1, a, 1, b, 3, 0.5f, c, false, 3) == TDM_OK &&
              c[0] == 0.5f && c[5] == 3.0f,
          "k 0: C = beta * C (%g %g): %s", c[0], c[5], tdm_last_error());
    CHECK(tdm_cpu_gemm_bf16(false, false, 0, 3, 4, 1, a, 4, b, 3, 0, c, false, 3) == TDM_OK &&
              c[0] == 0.5f,
          "m 0: nothing");
    CHECK_ERROR(tdm_cpu_gemm_bf16(false, false, -1, 3, 4, 1, a, 4, b, 3, 0, c, false, 3),
                "negative size m -1");
    CHECK_ERROR(tdm_cpu_gemm_bf16(true, false, 5, 3, 4, 1, a, 4, b, 3, 0, c, false, 3),
                "lda 4, ldb 3, ldc 3 below the rows' lengths 5");
}

/* The cache stays within its bound, a repeated shape reuses its entry, and an evicted shape
 * is made again with the same results. */
static void test_cache(void) {
    tdm_cpu_gemm_bf16_cache_clear();
    CHECK(tdm_cpu_gemm_bf16_cached() == 0, "cleared: %d", tdm_cpu_gemm_bf16_cached());
    gcase g = {5, 6, 7, false, true, false, 1, 0, 0};
    CHECK(run_case(&g, false) == 0, "first shape");
    /* keys that differ only in a transpose (square operands, same leading dimensions) */
    gcase sq[] = {{48, 20, 48, false, false, false, 1, 0, 0},
                  {48, 20, 48, true, false, false, 1, 0, 0},
                  {20, 48, 48, false, false, false, 1, 0, 0},
                  {20, 48, 48, false, true, false, 1, 0, 0}};
    for (int i = 0; i < 4; i++)
        CHECK(run_case(&sq[i], false) == 0, "square case %d (ta %d, tb %d)", i, sq[i].ta, sq[i].tb);
    int after_one = tdm_cpu_gemm_bf16_cached();
    CHECK(run_case(&g, false) == 0, "same shape again");
    CHECK(tdm_cpu_gemm_bf16_cached() == after_one, "a repeated shape adds no entry (%d, %d)",
          after_one, tdm_cpu_gemm_bf16_cached());
    int bad = 0;
    for (int i = 0; i < TDM_GEMM_BF16_CACHE + 10; i++) {
        gcase h = {3 + i, 4, 9, false, false, false, 1, 0, 0};
        bad += run_case(&h, false) != 0;
    }
    CHECK(bad == 0, "%d of the many shapes wrong", bad);
    CHECK(tdm_cpu_gemm_bf16_cached() <= TDM_GEMM_BF16_CACHE, "cache holds %d > %d",
          tdm_cpu_gemm_bf16_cached(), TDM_GEMM_BF16_CACHE);
    CHECK(run_case(&g, false) == 0, "the evicted first shape again");
}

/* Threads sharing the cache while it evicts: every product still right. */
static void *worker(void *arg) {
    int id = (int)(intptr_t)arg, bad = 0;
    for (int i = 0; i < 40; i++) {
        gcase g = {4 + (i * 7 + id) % 50, 8 + id, 33, i & 1, id & 1, (i >> 1) & 1, 1, 1, 1};
        bad += run_case(&g, true) != 0;
    }
    return (void *)(intptr_t)bad;
}

static void test_threads(void) {
    pthread_t t[4];
    int bad = 0;
    for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(t[i], &r);
        bad += (int)(intptr_t)r;
    }
    CHECK(bad == 0, "%d products wrong with 4 threads on the cache", bad);
    CHECK(tdm_cpu_gemm_bf16_cached() <= TDM_GEMM_BF16_CACHE, "cache holds %d",
          tdm_cpu_gemm_bf16_cached());
}

int main(void) {
    /* the fp32 path's copies come from the caching allocator: a tensor first, as in a program */
    tdm_tensor *first = tdm_zeros(TDM_SHAPE(1), TDM_F32, tdm_cpu(0));
    CHECK(first != NULL, "a first tensor: %s", tdm_last_error());
    tdm_cpu_gemm_thread_single();
    test_products();
    test_edges();
    test_cache();
    test_threads();
    tdm_cpu_gemm_bf16_cache_clear();
    tdm_tensor_free(first);
    return check_summary();
}
