/* cuBLAS and cuBLASLt, loaded when a GPU is first used rather than when the program starts.
 *
 * libcublasLt's initialisers took most of a `tandem` process's start (a tenth of a second of
 * CPU and 26,000 page faults for `tandem --help`, bench/RESULTS.md), paid by every command of a
 * build with the CUDA backend, GPU or not; and a program linked to them does not start at all
 * on a machine without them. So the backend calls them through cu_blas, a table of the
 * functions it uses, which cu_blas_load fills with dlopen and dlsym on the first device's
 * start. Each field has the type of the function it points to, from the toolkit's headers, so
 * a call through it is checked as a direct one; the emulation fills it with its own functions
 * (no library to load). */
#include "backend/cuda/cuda_common.cuh"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

cu_blas_api cu_blas;

#define CU_STR(x)  #x
#define CU_XSTR(x) CU_STR(x)

#ifdef TDM_CUDA_EMU
static int blas_loaded(void) {
#define CU_BLAS_TAKE(f) cu_blas.f = &f;
    CU_BLAS_FUNCTIONS(CU_BLAS_TAKE)
    CU_BLAS_TAKE(cublasGemmStridedBatchedEx)
    return TDM_OK;
}
#else
/* The build's major versions (libcublas.so.13 and libcublasLt.so.13 for CUDA 13), found as the
 * dynamic loader finds libraries, else in the toolkit the build used (TANDEM_CUDA_LIBDIR). */
static void *blas_open(const char *name, char *why, size_t cap) {
    void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
#ifdef TANDEM_CUDA_LIBDIR
    if (!h) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s", TANDEM_CUDA_LIBDIR, name);
        h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    }
#endif
    if (!h) snprintf(why, cap, "%s", dlerror());
    return h;
}

/* cu_blas.f from the library its name says (cublasLt... from libcublasLt, hl; the rest hb) */
#define CU_BLAS_FIND(f)                                                                            \
    if (!(cu_blas.f =                                                                              \
              (decltype(cu_blas.f))dlsym(strncmp(#f, "cublasLt", 8) ? hb : hl, CU_XSTR(f))))       \
        return tdm_raise(TDM_ERR_DEVICE,                                                           \
                         "cuBLAS was loaded but has no %s: a toolkit older than the one Tandem "   \
                         "was built with?",                                                        \
                         CU_XSTR(f));

static int blas_loaded(void) {
    char why[512] = "";
    const char *blas = "libcublas.so." CU_XSTR(CUBLAS_VER_MAJOR);
    const char *lt = "libcublasLt.so." CU_XSTR(CUBLAS_VER_MAJOR);
    void *hb = blas_open(blas, why, sizeof why), *hl = hb ? blas_open(lt, why, sizeof why) : NULL;
    if (!hl)
        return tdm_raise(TDM_ERR_DEVICE,
                         "cuBLAS could not be loaded (%s); install the CUDA toolkit's cuBLAS "
                         "(%s and %s) or put its directory on LD_LIBRARY_PATH",
                         why, blas, lt);
    CU_BLAS_FUNCTIONS(CU_BLAS_FIND)
    CU_BLAS_FIND(cublasGemmStridedBatchedEx)
    return TDM_OK;
}
#endif

static pthread_once_t blas_once = PTHREAD_ONCE_INIT;
static int blas_status;
static char blas_error[512];

static void blas_load_once(void) {
    blas_status = blas_loaded();
    if (blas_status) snprintf(blas_error, sizeof blas_error, "%s", tdm_last_error());
}

int cu_blas_load(void) {
    pthread_once(&blas_once, blas_load_once);
    return blas_status ? tdm_raise((tdm_status)blas_status, "%s", blas_error) : TDM_OK;
}

extern "C" int tdm_cuda_blas_load(void) {
    return cu_blas_load();
}
