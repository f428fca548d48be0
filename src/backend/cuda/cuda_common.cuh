/* Private helpers shared by the CUDA kernels (C++ for nvcc; not installed).
 *
 * The C headers come in with C linkage. core.h shows C++ no C11 atomic: tdm_storage's layout
 * (its count is one) is C's alone, and a storage's memory is reached through
 * tdm_cuda_storage_ptr. */
#ifndef TDM_CUDA_COMMON_CUH
#define TDM_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <initializer_list>
#include <pthread.h>
#include <stdint.h>

extern "C" {
#include "backend/backend.h"
}
#include "backend/cuda/cuda.h"

/* Threads per block of the element-wise kernels, and per row of the row kernels. */
#define CU_THREADS 256
/* Bytes of cuBLAS's workspace (cu_device.blas_workspace): what cuBLAS advises on sm_90 */
#define CU_BLAS_WORKSPACE ((size_t)32 << 20)

/* One device's state: its streams, cuBLAS handle, and a pinned word through which kernels
 * report the first bad user index (-1: none). */
typedef struct {
    cudaStream_t compute, comm;
    cudaStream_t upload;        /* the loader's host-to-device copies (tdm_cuda_upload_async) */
    cudaEvent_t order;          /* reused by tdm_cuda_order_streams (recorded, then waited on) */
    pthread_mutex_t order_lock; /* makes that record + wait one step for concurrent callers */
    cublasHandle_t blas;
    cublasLtHandle_t lt;          /* cuBLASLt's, for the bias epilogue (tdm_cuda_linear) */
    unsigned long long *bad_dev;  /* first bad position (atomicMin; all ones: none) */
    unsigned long long *bad_host; /* pinned copy read after a stream sync */
    void *blas_workspace;         /* cuBLAS's and cuBLASLt's: a captured product's too */
    struct cu_graph *capture;     /* the graph being recorded on compute, or NULL */
} cu_device;

/* An index check recorded in a graph, run again on each launch (cu_check_indices). */
typedef struct {
    const char *op;
    const void *idx;
    bool i64, use_ignore;
    int64_t stride, n;
    int dim;
} cu_graph_check;

#define CU_GRAPH_CHECKS 64
#define CU_GRAPH_DRAWS  64
/* A recorded step (cuda_graph.cu): the executable graph, its index checks, each with its own
 * bad-position word (a launch reads them all at once), and its random draws' (seed, offset)
 * words, which a launch sets first. */
typedef struct cu_graph {
    cudaGraphExec_t exec;
    unsigned long long *bad_dev, *bad_host; /* CU_GRAPH_CHECKS words; bad_host pinned */
    cu_graph_check checks[CU_GRAPH_CHECKS];
    int n_checks;
    uint64_t *draw_dev, *draw_host; /* CU_GRAPH_DRAWS pairs; draw_host pinned */
    cudaEvent_t draws_copied;       /* the last launch's copy out of draw_host is done */
    int n_draws;
} cu_graph;
/* Raises TDM_ERR_STATE: op, on d (index), cannot be recorded in a graph (why: what a replay
 * would get wrong). */
int cu_not_capturable(int index, const char *op, const char *why);

/* The state of GPU index, current on this thread. NULL and an error naming what for. */
cu_device *cu_dev(int index, const char *what);
/* The state of t's device (cu_dev of its index). */
static inline cu_device *cu_dev_of(const tdm_tensor *t, const char *what) {
    return cu_dev(t->device.index, what);
}
/* Raises TDM_ERR_DEVICE naming the kernel and device when the last launch (or err) failed. */
int cu_check(cudaError_t err, const char *what, int index);
int cu_check_launch(const char *what, int index);
int cu_check_blas(cublasStatus_t st, const char *what, int index);

/* The cuBLAS and cuBLASLt functions the backend calls, through cu_blas (cuda_blas.cu: loaded on
 * a device's first start, so that a program that never uses a GPU never loads them). */
#define CU_BLAS_FUNCTIONS(X)                                                                       \
    X(cublasCreate)                                                                                \
    X(cublasSetStream)                                                                             \
    X(cublasSetWorkspace)                                                                          \
    X(cublasSetMathMode)                                                                           \
    X(cublasSgemmStridedBatched)                                                                   \
    X(cublasLtCreate)                                                                              \
    X(cublasLtMatmul)                                                                              \
    X(cublasLtMatmulAlgoGetHeuristic)                                                              \
    X(cublasLtMatmulDescCreate)                                                                    \
    X(cublasLtMatmulDescDestroy)                                                                   \
    X(cublasLtMatmulDescSetAttribute)                                                              \
    X(cublasLtMatmulPreferenceCreate)                                                              \
    X(cublasLtMatmulPreferenceDestroy)                                                             \
    X(cublasLtMatmulPreferenceSetAttribute)                                                        \
    X(cublasLtMatrixLayoutCreate)                                                                  \
    X(cublasLtMatrixLayoutDestroy)
/* and cublasGemmStridedBatchedEx, whose C++ overload (a cudaDataType compute type) leaves
 * decltype no single function: the C one's type */
typedef cublasStatus_t (*cu_gemm_ex_fn)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int,
                                        int, int, const void *, const void *, cudaDataType, int,
                                        long long, const void *, cudaDataType, int, long long,
                                        const void *, void *, cudaDataType, int, long long, int,
                                        cublasComputeType_t, cublasGemmAlgo_t);
#define CU_BLAS_FIELD(f) decltype(&::f) f; /* ::f: the function, before the field hides it */
typedef struct {
    CU_BLAS_FUNCTIONS(CU_BLAS_FIELD)
    cu_gemm_ex_fn cublasGemmStridedBatchedEx;
} cu_blas_api;
extern cu_blas_api cu_blas;
/* Fills cu_blas once (later calls give the first's result): 0, or TDM_ERR_DEVICE naming the
 * library or function that could not be found. */
int cu_blas_load(void);
/* Device scratch of nbytes from the caching allocator, in compute-stream order: released
 * right after the kernels that use it are queued (later kernels of the same stream reuse it
 * only after those have run). NULL and an error on failure. */
void *cu_scratch(int index, size_t nbytes, tdm_storage **hold);
/* Resets the bad-index word (queued on the compute stream). */
int cu_bad_reset(cu_device *d, int index);
/* Waits for the compute stream and gives the first bad position (-1 if none). A kernel
 * reports position i with atomicMin(bad_dev, i): the minimum does not depend on the order
 * the threads run in, so the reported position is deterministic. */
int cu_bad_read(cu_device *d, int index, long long *pos);
/* Element i of a 1-D integer tensor (i32/i64, any stride; 0-D: a scalar), on the device. */
__device__ __forceinline__ int64_t cu_index_at(const void *p, bool i64, int64_t stride, int64_t i) {
    return i64 ? ((const int64_t *)p)[i * stride] : (int64_t)((const int32_t *)p)[i * stride];
}
/* Element i of such a tensor read back to the host (for an error message; waits). */
int64_t cu_index_to_host(const tdm_tensor *idx, int64_t i);
/* Element i of the index array at p (i32 or i64, stride elements apart), read back. */
int64_t cu_index_value(const void *p, bool i64, int64_t stride, int64_t i);
/* The error of index v at position pos out of [0, n) in op (use_ignore: a cross-entropy's
 * target): TDM_ERR_ARG. */
int cu_index_error(const char *op, long long v, long long pos, int dim, int64_t n, bool use_ignore);
/* Checks the first k indices of idx (i32/i64) against [0, n) before a kernel writes anything
 * (cuda_index.cu), skipping the value ignore where use_ignore (a cross-entropy's
 * ignore_index). Waits for the compute stream: the error, naming op, the index, its position
 * and dim, must reach the caller of this op. While d records a graph the check is recorded
 * with it and read on each launch (graph_launch) instead. */
int cu_check_indices(cu_device *d, const tdm_tensor *idx, int64_t k, int64_t n, int dim,
                     const char *op, bool use_ignore, int64_t ignore);

/* Threads for one block per row of n elements: a power of two (the block reductions halve),
 * small rows do not leave most of a 256-thread block idle. */
static inline int cu_row_threads(int64_t n) {
    int t = 32;
    while (t < CU_THREADS && t < n) t *= 2;
    return t;
}

/* t as [outer, n, inner] around dim (reductions, indexing). */
static inline void cu_split_dim(const tdm_tensor *t, int dim, int64_t *outer, int64_t *n,
                                int64_t *inner) {
    *outer = *inner = 1;
    for (int d = 0; d < dim; d++) *outer *= t->shape[d];
    for (int d = dim + 1; d < t->ndim; d++) *inner *= t->shape[d];
    *n = t->ndim ? t->shape[dim] : 1;
}

/* Grid for a grid-stride loop over n elements. */
static inline unsigned cu_blocks(int64_t n) {
    int64_t b = (n + CU_THREADS - 1) / CU_THREADS;
    if (b < 1) b = 1;
    return (unsigned)(b > (1 << 20) ? (1 << 20) : b);
}

/* Element pointers (kernels take them typed). */
static inline float *cu_f(const tdm_tensor *t) {
    return t ? (float *)tdm_cuda_ptr(t) : NULL;
}

/* ---- element types: f32, bf16 (__nv_bfloat16), f16 (__half) ----------------------------
 *
 * Kernels that take floating-point tensors are templates over the element type: they load
 * each element to float with cu_ld, compute in float, and round each output once with
 * cu_to<T> (round to nearest even; for float both are the identity, so the f32
 * instantiation is the code it was). The host picks the instantiation once per call from the
 * tensor's dtype (CU_DISPATCH). */
__device__ __forceinline__ float cu_ld(float v) {
    return v;
}
__device__ __forceinline__ float cu_ld(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
__device__ __forceinline__ float cu_ld(__half v) {
    return __half2float(v);
}
template <typename T> __device__ __forceinline__ T cu_to(float v);
template <> __device__ __forceinline__ float cu_to<float>(float v) {
    return v;
}
template <> __device__ __forceinline__ __nv_bfloat16 cu_to<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half cu_to<__half>(float v) {
    return __float2half_rn(v);
}

/* A tensor's elements as T (NULL for NULL); the caller dispatched on its dtype. */
template <typename T> static inline T *cu_p(const tdm_tensor *t) {
    return t ? (T *)tdm_cuda_ptr(t) : NULL;
}

/* fn<T>(args...) for T the element type of floating-point dtype dt (f32 for any other: the
 * caller checked it with cu_check_float). */
#define CU_DISPATCH(dt, fn, ...)                                                                   \
    ((dt) == TDM_BF16  ? fn<__nv_bfloat16>(__VA_ARGS__)                                            \
     : (dt) == TDM_F16 ? fn<__half>(__VA_ARGS__)                                                   \
                       : fn<float>(__VA_ARGS__))

/* TDM_ERR_DTYPE naming the kernel unless every non-NULL tensor of ts is f32, bf16 or f16 and,
 * where same, all of the first one's dtype: cu_check_float("softmax", true, {y, x}). */
static inline int cu_check_float(const char *op, bool same,
                                 std::initializer_list<const tdm_tensor *> ts) {
    const tdm_tensor *first = *ts.begin();
    int i = 0;
    for (const tdm_tensor *t : ts) {
        if (t && (!tdm_dtype_is_float(t->dtype) || (same && first && t->dtype != first->dtype)))
            return tdm_raise(TDM_ERR_DTYPE, "cuda %s: operand %d is %s, expected %s", op, i,
                             tdm_dtype_name(t->dtype),
                             same && first && tdm_dtype_is_float(first->dtype)
                                 ? tdm_dtype_name(first->dtype)
                                 : "f32, bf16 or f16");
        i++;
    }
    return TDM_OK;
}

/* dst[i] = src[i] rounded to T: a low-precision output summed in an f32 copy, rounded once. */
template <typename T> __global__ void cu_narrow_kernel(T *dst, const float *src, int64_t n);

/* A tensor's geometry by value, for kernels that walk any strides: element i (row-major
 * over shape) lives at offset cu_offset(v, i). Contiguous tensors collapse to one dim so
 * the offset is i itself. */
typedef struct {
    int ndim;
    int64_t shape[TDM_MAX_DIMS];
    int64_t stride[TDM_MAX_DIMS];
} cu_view;

static inline cu_view cu_view_of(const tdm_tensor *t) {
    cu_view v;
    if (tdm_is_contiguous(t)) {
        v.ndim = 1;
        v.shape[0] = tdm_numel(t);
        v.stride[0] = 1;
        return v;
    }
    v.ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++) v.shape[d] = t->shape[d], v.stride[d] = t->strides[d];
    return v;
}

__device__ __forceinline__ int64_t cu_offset(const cu_view &v, int64_t i) {
    if (v.ndim == 1) return i * v.stride[0];
    int64_t off = 0;
    for (int d = v.ndim - 1; d >= 0; d--) {
        int64_t s = v.shape[d];
        off += (i % s) * v.stride[d];
        i /= s;
    }
    return off;
}

#define CU_LOOP(i, n)                                                                              \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                      \
         i += (int64_t)blockDim.x * gridDim.x)

template <typename T> __global__ void cu_narrow_kernel(T *dst, const float *src, int64_t n) {
    CU_LOOP(i, n) dst[i] = cu_to<T>(src[i]);
}

/* ---- block reductions (fixed tree order: deterministic for a given block size) ---------- */

/* Sum of v over the block; every thread gets the result. sh holds blockDim.x values. */
template <typename T> __device__ T cu_block_sum(T v, T *sh) {
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] += sh[t + s];
        __syncthreads();
    }
    T r = sh[0];
    __syncthreads(); /* sh may be reused right after */
    return r;
}

/* Max of v over the block, NaN if any v is NaN (a NaN row softmaxes to NaN, as in PyTorch);
 * every thread gets it. */
__device__ __forceinline__ float cu_nanmax(float a, float b) {
    return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}
__device__ __forceinline__ float cu_block_max(float v, float *sh) {
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] = cu_nanmax(sh[t], sh[t + s]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

/* ---- Philox4x32-10, bit-identical to src/core/rng.c ------------------------------------- */

__device__ __forceinline__ void cu_philox(uint64_t seed, uint64_t counter, uint64_t stream,
                                          uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32);
    uint32_t c2 = (uint32_t)stream, c3 = (uint32_t)(stream >> 32);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint32_t lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
        uint32_t lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
        uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* tdm_u32_to_unit: 24 significant bits, exact in float. */
__device__ __forceinline__ float cu_unit(uint32_t x) {
    return (float)(x >> 8) * (1.0f / 16777216.0f);
}

#endif
