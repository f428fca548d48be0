/* A host emulation of the parts of the CUDA runtime that Tandem's CUDA backend uses, so that
 * its kernels can run (slowly, on one CPU thread) where no GPU is: src/backend/cuda/emu/run
 * builds the backend against it and runs tests/test_cuda. Not a CUDA implementation: only
 * what the backend calls, with the same semantics on one in-order "stream". */
#ifndef TDM_EMU_CUDA_RUNTIME_H
#define TDM_EMU_CUDA_RUNTIME_H
/* Kernel files test it where a GPU instruction has no C++ form (inline PTX: emu_mma.h) */
#define TDM_CUDA_EMU 1

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    cudaSuccess = 0,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidValue = 1,
    cudaErrorNotReady = 600,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
} cudaError_t;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr {
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
};
typedef struct emu_stream *cudaStream_t;
typedef struct emu_event *cudaEvent_t;
typedef struct emu_graph *cudaGraph_t;
typedef struct emu_graph *cudaGraphExec_t;
enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2
};
enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2
};
enum cudaMemcpyKind {
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3
};
enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2
};
struct cudaPointerAttributes {
    enum cudaMemoryType type;
};
struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    int major, minor;
};
#define cudaStreamNonBlocking  1
#define cudaEventDisableTiming 2
#define cudaHostAllocPortable  1

cudaError_t cudaGetDeviceCount(int *n);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDevice(int *d);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b);
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k,
                            cudaStream_t st);
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st);
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p);
/* sm_90's 227 KiB a block may opt in to */
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int device);
cudaError_t emu_func_set_attribute(const void *kernel, enum cudaFuncAttribute a, int value);
/* Stream capture: from cudaStreamBeginCapture to cudaStreamEndCapture the calling thread's
 * work on that stream (launches, async copies and fills, cuBLAS calls on a handle bound to
 * it) is recorded, not run; cudaGraphLaunch runs the record in order. As on a GPU, waiting
 * for the capturing stream, or an async copy from pageable host memory on it, fails with
 * cudaErrorStreamCaptureUnsupported and invalidates the capture (cudaStreamEndCapture then
 * fails with cudaErrorStreamCaptureInvalidated); stricter than a GPU, so is a synchronous
 * cudaMemcpy from the capturing thread (on a GPU it would run at once, outside the graph,
 * reading what the recorded work has not written). */
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e);
cudaError_t cudaGraphDestroy(cudaGraph_t g);

#ifdef __cplusplus
}

/* ---- device side: kernels are plain functions run by emu_launch ---- */
#include <functional>

struct dim3 {
    unsigned x, y, z;
};
extern dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__      static /* one block runs at a time on one thread */
#define __align__(n)    alignas(n)
#define __launch_bounds__(...)
void __syncthreads(void);
/* The vector types the f32 kernels load in one instruction (aligned as on a GPU, where a
 * misaligned one faults; AddressSanitizer does not check alignment, UBSan does). */
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
static inline float2 make_float2(float x, float y) {
    return float2{x, y};
}
/* A warp's collective (emu.cpp): this thread's n words (n <= EMU_XCHG_WORDS) in, every lane's
 * out, as all[lane * EMU_XCHG_WORDS + i], valid until this thread's next collective. A barrier
 * of the block underneath (the emulation's threads run one after another), so every thread of
 * the block must take part, as in Tandem's kernels that use one, and the block is whole warps
 * (aborts otherwise). */
#define EMU_XCHG_WORDS 8
const uint32_t *emu_warp_exchange(const uint32_t *words, int n);
/* __syncwarp: the warp's lanes' shared-memory writes seen by all of them after it. A barrier of
 * the block here, as the collectives below: every thread of the block must reach it. */
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    (void)mask;
    __syncthreads();
}
/* __shfl_xor_sync of a float over the whole warp (mask and width as CUDA's; all 32 lanes). */
static inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32) {
    (void)mask, (void)width;
    uint32_t u;
    __builtin_memcpy(&u, &v, 4);
    const uint32_t *all = emu_warp_exchange(&u, 1);
    __builtin_memcpy(&v, &all[((threadIdx.x % 32) ^ (unsigned)lane_mask) * EMU_XCHG_WORDS], 4);
    return v;
}
/* The same of a double (two words). */
static inline double __shfl_xor_sync(unsigned mask, double v, int lane_mask, int width = 32) {
    (void)mask, (void)width;
    uint32_t u[2];
    __builtin_memcpy(u, &v, 8);
    const uint32_t *all = emu_warp_exchange(u, 2);
    __builtin_memcpy(&v, &all[((threadIdx.x % 32) ^ (unsigned)lane_mask) * EMU_XCHG_WORDS], 8);
    return v;
}
/* cp.async (emu.cpp): n bytes from src to dst (bytes 0: zeros) when this thread next waits
 * for the copy's group: emu_cp_async_wait(keep) lands every copy but those of the keep groups
 * committed last and those not committed (keep -1: every copy, cp.async.wait_all). So a kernel
 * that reads a tile before waiting for it reads what was there before, as it may on a GPU; a
 * thread that ends with a copy not waited for aborts. */
void emu_cp_async(void *dst, const void *src, int n, int bytes);
void emu_cp_async_commit(void);
void emu_cp_async_wait(int keep);
/* Runs body for every thread of every block; shmem bytes of dynamic shared memory (extern
 * __shared__, at emu_dynamic_shared, 128-byte aligned) are allocated for the launch, exactly
 * sized, so that AddressSanitizer sees an access past them. Over 48 KiB, kernel (the launched
 * function) must have been given as much with cudaFuncSetAttribute, as on a GPU. A launch on
 * a stream this thread is capturing is recorded instead (body keeps copies of the arguments).
 * name: the kernel's, for EMU_CENSUS (emu.cpp). */
void emu_launch(long long grid, long long block, const std::function<void()> &body,
                size_t shmem = 0, const void *kernel = 0, cudaStream_t stream = 0,
                const char *name = 0);
/* A launch's body: kernel (a generic lambda calling it) on the arguments as they are now,
 * copied (a launch evaluates its arguments once; a recorded one keeps their values). */
template <typename F, typename... A> std::function<void()> emu_bind(F kernel, A... args) {
    return [=]() { kernel(args...); };
}
template <typename T> cudaError_t cudaFuncSetAttribute(T *kernel, cudaFuncAttribute a, int value) {
    return emu_func_set_attribute((const void *)kernel, a, value);
}
extern void *emu_dynamic_shared;

template <typename T> cudaError_t cudaMalloc(T **p, size_t n) {
    return cudaMalloc((void **)p, n);
}
template <typename T> cudaError_t cudaMallocHost(T **p, size_t n) {
    return cudaMallocHost((void **)p, n);
}
template <typename T> cudaError_t cudaHostAlloc(T **p, size_t n, unsigned f) {
    return cudaHostAlloc((void **)p, n, f);
}
static inline uint32_t __umulhi(uint32_t a, uint32_t b) {
    return (uint32_t)(((uint64_t)a * b) >> 32);
}
static inline float __int_as_float(int i) {
    float f;
    __builtin_memcpy(&f, &i, 4);
    return f;
}
/* never contracted with a product that made an operand (a GPU's rule): the operands rounded */
static inline float __fadd_rn(float a, float b) {
    volatile float x = a, y = b;
    return x + y;
}
static inline float __fmul_rn(float a, float b) {
    volatile float r = a * b;
    return r;
}
static inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v) {
    unsigned long long old = *p;
    if (v < old) *p = v;
    return old;
}
#endif

#endif
