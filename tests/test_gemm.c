/* The CPU GEMM (cpu_gemm.c): every transpose combination, padded leading dimensions, alpha and
 * beta, against a double-precision reference; and that the library it names runs the kernel
 * set this CPU allows (scripts/test runs this test again as an AVX2 CPU under qemu, where it
 * must say avx2). */
#include "check.h"

#include "backend/cpu/cpu.h"

/* c[m, n] = alpha * op(a) @ op(b) + beta * c in doubles, the same layout as tdm_cpu_sgemm */
static void gemm_ref(bool ta, bool tb, int m, int n, int k, float alpha, const float *a, int lda,
                     const float *b, int ldb, float beta, double *c, int ldc) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int p = 0; p < k; p++)
                s += (double)(ta ? a[p * lda + i] : a[i * lda + p]) *
                     (double)(tb ? b[j * ldb + p] : b[p * ldb + j]);
            /* beta 0: c is not read (BLAS's rule; a NaN there stays out) */
            c[i * ldc + j] = beta == 0.0f ? alpha * s : alpha * s + beta * c[i * ldc + j];
        }
}

/* uniform in [-1, 1) from a 32-bit LCG */
static float frand(uint32_t *s) {
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / (1 << 23) - 1.0f;
}

/* Whether check_gemm calls cpu_gemm_nt.c's kernel itself (A @ B^T only) rather than
 * tdm_cpu_sgemm. */
static bool direct_nt;

static void check_gemm(bool ta, bool tb, int m, int n, int k, float alpha, float beta) {
    int pad = 3; /* leading dimensions longer than the rows: views into wider matrices */
    int lda = (ta ? m : k) + pad, ldb = (tb ? k : n) + pad, ldc = n + pad;
    int arows = ta ? k : m, brows = tb ? n : k;
    float *a = malloc(sizeof(float) * (size_t)(arows * lda));
    float *b = malloc(sizeof(float) * (size_t)(brows * ldb));
    float *c = malloc(sizeof(float) * (size_t)(m * ldc));
    double *ref = malloc(sizeof(double) * (size_t)(m * ldc));
    uint32_t seed = (uint32_t)(m * 7 + n * 3 + k + ta * 2 + tb);
    for (int i = 0; i < arows * lda; i++) a[i] = frand(&seed);
    for (int i = 0; i < brows * ldb; i++) b[i] = frand(&seed);
    for (int i = 0; i < m * ldc; i++) /* beta 0: c must not be read */
        ref[i] = c[i] = beta == 0.0f && i % ldc < n ? NAN : frand(&seed);
    if (direct_nt)
        CHECK(tdm_cpu_sgemm_nt(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) == 0,
              "sgemm_nt %dx%dx%d: not run on a CPU with AVX-512", m, n, k);
    else
        tdm_cpu_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    gemm_ref(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, ref, ldc);
    double worst = 0, pad_moved = 0;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < ldc; j++) {
            double d = fabs(c[i * ldc + j] - ref[i * ldc + j]);
            if (isnan(d)) d = INFINITY; /* fmax would pass over a NaN */
            /* the padding is not part of c: it must be left as it was */
            if (j >= n)
                pad_moved = fmax(pad_moved, d);
            else
                worst = fmax(worst, d / (1.0 + fabs(ref[i * ldc + j])));
        }
    /* float products of k terms: rounding grows like sqrt(k) * 2^-24 */
    CHECK(worst < 1e-5 * sqrt((double)k) + 1e-6 && pad_moved == 0,
          "sgemm %c%c %dx%dx%d alpha %g beta %g: relative error %.3g, padding moved %.3g",
          ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, beta, worst, pad_moved);
    free(a), free(b), free(c), free(ref);
}

static void test_products(void) {
    /* the model shapes (MLP, CNN im2col, attention) and odd ones that leave kernel tails */
    int shapes[][3] = {{64, 256, 784}, {32, 196, 288}, {64, 64, 32}, {1, 1, 1},
                       {7, 13, 5},     {33, 17, 65},   {2, 130, 3}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 4; t++) {
            check_gemm(t & 1, t & 2, shapes[s][0], shapes[s][1], shapes[s][2], 1.0f, 0.0f);
            check_gemm(t & 1, t & 2, shapes[s][0], shapes[s][1], shapes[s][2], -0.5f, 1.0f);
        }
    check_gemm(false, false, 9, 11, 10, 2.0f, 0.25f);
    /* on one thread (a CPU device's) with AVX-512, A @ B^T with 16 to 64 rows, n >= 64 and
     * k >= 256 runs in cpu_gemm_nt.c (cpu_gemm.c, nt_pays): the MLP's first layer on 64 and
     * 32 rows; row counts that leave a part of a 16-lane vector, columns that leave a part of
     * a tile and of a 16 x 16 transpose, depths that are not a multiple of 16; beta 0 (c
     * NaN, not read), 1 and neither; and neighbours that stay with the library. Without
     * AVX-512 under an emulated CPU (scripts/test's qemu -cpu Haswell run) these shapes only
     * run the library again, as test_products did, and their double references were most of
     * that run's time: left to the native run */
    if (tdm_cpu_vector_bits() < 512 && getenv("TANDEM_TEST_EMULATED")) return;
    int threads = tdm_cpu_gemm_threads();
    tdm_cpu_gemm_set_threads(1);
    int nt[][3] = {{64, 256, 784}, {32, 256, 784}, {16, 70, 300},   {17, 65, 257},
                   {40, 64, 256},  {63, 100, 256}, {48, 1000, 256}, {8, 64, 256},
                   {65, 64, 256},  {64, 63, 256},  {64, 64, 255}};
    for (size_t s = 0; s < sizeof nt / sizeof nt[0]; s++) {
        check_gemm(false, true, nt[s][0], nt[s][1], nt[s][2], 1.0f, 0.0f);
        check_gemm(false, true, nt[s][0], nt[s][1], nt[s][2], -0.5f, 1.0f);
        check_gemm(false, true, nt[s][0], nt[s][1], nt[s][2], 2.0f, 0.25f);
    }
    /* the kernel itself, where tdm_cpu_sgemm does not call it: more than 64 rows (chunks of
     * 64), thin and shallow products, one row */
    if (tdm_cpu_vector_bits() == 512) {
        direct_nt = true;
        int direct[][3] = {{100, 70, 33}, {130, 20, 17}, {1, 1, 1}, {5, 3, 2}, {64, 10, 128}};
        for (size_t s = 0; s < sizeof direct / sizeof direct[0]; s++) {
            check_gemm(false, true, direct[s][0], direct[s][1], direct[s][2], 1.0f, 0.0f);
            check_gemm(false, true, direct[s][0], direct[s][1], direct[s][2], 0.5f, 0.25f);
        }
        direct_nt = false;
    }
    tdm_cpu_gemm_set_threads(threads);
}

static void test_kernels_named(void) {
    char d[128];
    tdm_gemm_describe(d, sizeof d);
    int bits = tdm_cpu_vector_bits();
#ifdef TANDEM_GEMM_ONEDNN
    const char *want = bits == 512 ? "avx512" : bits == 256 ? "avx2" : NULL;
    CHECK(strncmp(d, "oneDNN ", 7) == 0, "oneDNN build describes its GEMM as '%s'", d);
    /* oneDNN's JIT reads cpuid: it must run the widest kernels the CPU has */
    if (want) CHECK(strstr(d, want) != NULL, "a %d-bit CPU runs '%s'", bits, d);
    CHECK(tdm_gemm_warning() == NULL, "no warning with the CPU's own kernels: %s",
          tdm_gemm_warning());
#else
    CHECK(strncmp(d, "OpenBLAS ", 9) == 0 && strstr(d, " kernels"), "OpenBLAS build: '%s'", d);
    /* OpenBLAS's choice depends on its model table: whichever it made, a generic set on a
     * vector CPU must come with the warning, a vector set without it */
    bool generic = strstr(d, "Haswell") == NULL && strstr(d, "SkylakeX") == NULL &&
                   strstr(d, "Zen") == NULL && strstr(d, "Cooperlake") == NULL &&
                   strstr(d, "SapphireRapids") == NULL;
    if (bits && generic)
        CHECK(tdm_gemm_warning() && strstr(tdm_gemm_warning(), "OPENBLAS_CORETYPE"),
              "generic '%s' on a %d-bit CPU warns with the fix", d, bits);
#endif
    char tiny[8];
    tdm_gemm_describe(tiny, sizeof tiny);
    CHECK(strlen(tiny) == 7, "describe truncates to its buffer ('%s')", tiny);
    printf("gemm: %s (CPU vector width %d bits)\n", d, bits);
}

int main(void) {
    /* the scratch of cpu_gemm_nt.c comes from the caching allocator, which serves CPU memory
     * once the backend is up: as in a program, a tensor first */
    tdm_tensor *first = tdm_zeros(TDM_SHAPE(1), TDM_F32, tdm_cpu(0));
    CHECK(first != NULL, "a first tensor: %s", tdm_last_error());
    test_products();
    test_kernels_named();
    tdm_tensor_free(first);
    return check_summary();
}
