/* The CPU's single-precision GEMM: every matrix product of the CPU backend comes here.
 *
 * oneDNN when the build found it (TANDEM_GEMM_ONEDNN): it JIT-compiles its kernels for the
 * instruction set cpuid reports, so a CPU newer than the library still gets its AVX-512 or
 * AVX2 code. OpenBLAS otherwise: it picks a kernel set from a table of CPU models fixed when
 * it was built, and on a model it does not know it falls back to generic SSE3 kernels, several
 * times slower; tdm_gemm_warning says so, with the fix. bench/RESULTS.md has the measurements
 * behind the choice ("GEMM at the models' shapes", "Figures behind the code").
 *
 * Threads: a CPU device is one thread pinned to one core, so its products run on that core
 * alone (tdm_cpu_gemm_thread_single). oneDNN's OpenMP thread count is a per-thread setting;
 * OpenBLAS's is process-wide (tdm_gemm_threads_for_devices, parallel/spawn.c). */
#include "backend/cpu/cpu.h"
#include "tandem/tensor.h"

#include <stdio.h>
#include <string.h>
#include <strings.h> /* strcasecmp */

#ifdef TANDEM_GEMM_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#else
#include <cblas.h>
#endif

static _Thread_local uint64_t gemm_flops; /* tdm_gemm_flops */

#ifdef TANDEM_GEMM_ONEDNN
/* Products smaller than this run on the calling thread alone, whatever its OpenMP thread
 * count (one device on every core: `--devices cpu:0`). Such a product is short on one AVX-512
 * core: split over two, the fork and join and the halves' poorer blocking cost more than they
 * save. The CNN's convolutions run over a thousand products under 1 MFLOP a step: one device
 * on two cores took longer than on one core (Intel Xeon, oneDNN 2.6.3), and as long with this
 * threshold; the MLP's 4-26 MFLOP products still split, as fast as before (bench/RESULTS.md,
 * "Issue 15's figures on the Intel machine, and two fixes", "Figures behind the code"). */
#define GEMM_SPLIT_FLOPS 4e6
#endif

uint64_t tdm_gemm_flops(void) {
    return gemm_flops;
}

#ifdef TANDEM_GEMM_ONEDNN
/* A @ B^T with 16 to 64 rows of A, k >= 256 and n >= 64 (a linear layer's forward: the MLP's
 * 64 rows of 784 against 256 x 784 weights, the CNN's 64 x 3136 against 128 x 3136, a
 * data-parallel device's 32 rows) on one thread of an AVX-512 CPU runs in cpu_gemm_nt.c,
 * which reads B in place: oneDNN 2.6.3 transposes all of B into its panels on every call. On
 * the Xeon (family 6 model 207), B in cache: faster than oneDNN at those shapes, and as fast
 * at 32 rows as oneDNN computing the product transposed, which 16 and 32 rows used to take,
 * in the MLP's training step on one core too (bench/RESULTS.md, "Issue 15: A @ B^T without
 * packing B, the loader's ring"). With 8 rows, or k 128 (the MLP's last layer, the GPT's
 * 256-row products) oneDNN is as fast or faster. AVX2 CPUs keep oneDNN's (not measured). */
static bool nt_pays(bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
    return !ta && tb && m >= 16 && m <= 64 && n >= 64 && k >= 256;
}
#endif

void tdm_cpu_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                   int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
    gemm_flops += 2 * (uint64_t)m * (uint64_t)n * (uint64_t)k;
#ifdef TANDEM_GEMM_ONEDNN
    /* row-major, as cblas with CblasRowMajor; fails only on bad dimensions, which the ops
     * have checked before a kernel runs */
    int threads = omp_get_max_threads();
    bool single = threads > 1 && 2.0 * (double)m * (double)n * (double)k < GEMM_SPLIT_FLOPS;
    if (single) omp_set_num_threads(1);
    if (!(threads == 1 || single) || !nt_pays(ta, tb, m, n, k) ||
        tdm_cpu_sgemm_nt(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
        (void)dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c,
                         ldc);
    if (single) omp_set_num_threads(threads);
#else
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                (int)m, (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
#endif
}

int tdm_cpu_gemm_threads(void) {
#ifdef TANDEM_GEMM_ONEDNN
    return omp_get_max_threads();
#else
    return openblas_get_num_threads();
#endif
}

void tdm_cpu_gemm_set_threads(int n) {
#ifdef TANDEM_GEMM_ONEDNN
    omp_set_num_threads(n); /* an OpenMP setting of the calling thread only */
#else
    openblas_set_num_threads(n);
#endif
}

void tdm_cpu_gemm_thread_single(void) {
#ifdef TANDEM_GEMM_ONEDNN
    omp_set_num_threads(1);
#endif
}

int tdm_cpu_vector_bits(void) {
#if defined(__x86_64__)
    /* __builtin_cpu_supports reads cpuid's answers, which the loader has already cached, and
     * includes the OS's consent (XSAVE state enabled) */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return 512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 256;
#endif
    return 0;
}

#ifdef TANDEM_GEMM_ONEDNN
/* The kernel set oneDNN's f32 GEMM runs for the ISA it found (its sgemm has AVX-512, AVX2,
 * AVX and SSE4.1 kernels; the ISA values are bit masks, each including the ones below). */
static const char *onednn_kernels(int *bits) {
    dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    struct {
        dnnl_cpu_isa_t isa;
        const char *name;
        int bits;
    } sets[] = {{dnnl_cpu_isa_avx512_core, "avx512_core", 512},
                {dnnl_cpu_isa_avx2, "avx2", 256},
                {dnnl_cpu_isa_avx, "avx", 0},
                {dnnl_cpu_isa_sse41, "sse41", 0}};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        if (((unsigned)isa & (unsigned)sets[i].isa) == (unsigned)sets[i].isa) {
            *bits = sets[i].bits;
            return sets[i].name;
        }
    *bits = 0;
    return "generic";
}
#else
/* Whether an OpenBLAS core name is one of its AVX2 or AVX-512 kernel sets. */
static int openblas_core_bits(const char *core) {
    static const char *avx512[] = {"skylakex", "cooperlake", "sapphirerapids"};
    static const char *avx2[] = {"haswell", "zen"};
    for (size_t i = 0; i < sizeof avx512 / sizeof avx512[0]; i++)
        if (strcasecmp(core, avx512[i]) == 0) return 512;
    for (size_t i = 0; i < sizeof avx2 / sizeof avx2[0]; i++)
        if (strcasecmp(core, avx2[i]) == 0) return 256;
    return 0;
}
#endif

char *tdm_gemm_describe(char *buf, size_t cap) {
    if (!buf || cap == 0) return buf;
#ifdef TANDEM_GEMM_ONEDNN
    const dnnl_version_t *v = dnnl_version();
    int bits;
    snprintf(buf, cap, "oneDNN %d.%d.%d, %s", v->major, v->minor, v->patch, onednn_kernels(&bits));
#else
    char ver[32] = "?"; /* from "OpenBLAS 0.3.21 DYNAMIC_ARCH ..." */
    (void)sscanf(openblas_get_config(), "OpenBLAS %31s", ver);
    snprintf(buf, cap, "OpenBLAS %s, %s kernels", ver, openblas_get_corename());
#endif
    return buf;
}

const char *tdm_gemm_warning(void) {
    static _Thread_local char msg[384];
    int have = tdm_cpu_vector_bits(), runs;
    const char *isa = have == 512 ? "AVX-512" : "AVX2";
    if (have == 0) return NULL; /* nothing faster to be had */
#ifdef TANDEM_GEMM_ONEDNN
    const char *kernels = onednn_kernels(&runs);
    if (runs >= have) return NULL;
    snprintf(msg, sizeof msg,
             "oneDNN runs its %s kernels on this %s CPU (ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA "
             "set?): unset it for full speed",
             kernels, isa);
#else
    const char *core = openblas_get_corename();
    runs = openblas_core_bits(core);
    if (runs >= have) return NULL;
    snprintf(msg, sizeof msg,
             "OpenBLAS runs its %s kernels on this %s CPU (it does not know the model; GEMM "
             "several times slower): run with OPENBLAS_CORETYPE=%s, or rebuild Tandem with "
             "oneDNN (Debian libdnnl-dev, installed by scripts/setup)",
             core, isa, have == 512 ? "SkylakeX" : "Haswell");
#endif
    return msg;
}
