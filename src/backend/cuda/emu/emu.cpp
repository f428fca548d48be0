/* The host emulation behind cuda_runtime.h and cublas_v2.h in this directory.
 *
 * A launch runs its blocks one after another on the calling thread. The threads of a block
 * are coroutines run in rounds: each runs until its next __syncthreads or its end, so a
 * barrier holds exactly as on a GPU, and __shared__ arrays (statics) are shared by the block.
 * Thread 0 runs first as a coroutine: when it ends without a barrier, no thread of the block
 * may reach one (a barrier is every thread's or undefined), so the others run as plain calls,
 * without the context switches that most kernels, which have no barrier, do not need; one of
 * them reaching a barrier after all is reported and aborts. Streams and events are in order by
 * construction; device memory is host memory, so AddressSanitizer sees a kernel's
 * out-of-bounds access. Invalid launch
 * configurations (empty grid, more than 1024 threads, a block size that is not a power of two
 * where the reductions need one is the caller's check) fail as on a GPU, through
 * cudaGetLastError.
 * Several host threads (DataParallel's replicas, one per emulated GPU) may launch: launches
 * then take turns (one lock), and the current device and last error are per thread, as in
 * CUDA. Stream capture (cudaStreamBeginCapture ... cudaGraphLaunch) records the capturing
 * thread's work on the captured stream as closures and runs them in order on launch. */
#include "cuda_runtime.h"
#include "cublas_v2.h"
#include "cublasLt.h"
#include "tandem/half.h"

#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

dim3 threadIdx, blockIdx, blockDim, gridDim;

static thread_local cudaError_t last_error = cudaSuccess;
static thread_local int current_device = 0;
static std::mutex emu_mu; /* launches (the globals above and below) and the pinned set */
static std::set<const void *> pinned;
static std::map<const void *, int> smem_allowed; /* cudaFuncSetAttribute's, per kernel */
#define SMEM_DEFAULT (48 * 1024)
#define SMEM_OPTIN   (227 * 1024) /* sm_90's */

#define MAX_BLOCK 1024
/* a coroutine's stack: the kernels' frames take a few KiB, ASan's redzones included */
#define STACK_SIZE (32 * 1024)

/* ---- coroutines ---------------------------------------------------------------------------
 * emu_switch saves the registers a call preserves (the x86-64 System V ABI's callee-saved ones)
 * on the stack it leaves and the stack pointer in *save, and returns on the other stack to
 * where that one called emu_switch: both sides are in a call, so that is all their state.
 * (ucontext's swapcontext also saves and restores the signal mask, a system call a switch, and
 * ASan's interceptor of it clears the shadow of the whole stack it enters: most of a barrier's
 * cost here, bench/RESULTS.md.) AddressSanitizer is told of each switch
 * (__sanitizer_start_switch_fiber), so that it knows which stack a frame is on. */
#if !defined(__x86_64__)
#error "the emulation's coroutine switch (emu_switch) is written for x86-64"
#endif
extern "C" void emu_switch(void **save, void *to);
asm(".text\n"
    ".globl emu_switch\n"
    ".hidden emu_switch\n"
    ".type emu_switch, @function\n"
    "emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size emu_switch, .-emu_switch\n");

static void *sched_sp, *thread_sp[MAX_BLOCK];
static char *stacks[MAX_BLOCK];
static bool finished[MAX_BLOCK];
static const std::function<void()> *body_now;
static bool plain_calls; /* the block's threads after thread 0 run as calls: no barrier */
static const void *sched_bottom; /* the scheduler's stack, as ASan gave it at the last switch */
static size_t sched_size;

#if defined(__SANITIZE_ADDRESS__)
#define SWITCH_START(fake, bottom, size) __sanitizer_start_switch_fiber(fake, bottom, size)
#define SWITCH_END(fake, bottom, size)   __sanitizer_finish_switch_fiber(fake, bottom, size)
#else
#define SWITCH_START(fake, bottom, size) ((void)(fake), (void)(bottom), (void)(size))
#define SWITCH_END(fake, bottom, size)   ((void)(fake), (void)(bottom), (void)(size))
#endif

/* The scheduler runs thread t until its next barrier or its end. */
static void resume(int t) {
    void *fake = NULL;
    SWITCH_START(&fake, stacks[t], STACK_SIZE);
    emu_switch(&sched_sp, thread_sp[t]);
    SWITCH_END(fake, NULL, NULL);
}

/* Thread t gives the scheduler back its turn, to run on from here at its next. */
static void yield(int t) {
    void *fake = NULL;
    SWITCH_START(&fake, sched_bottom, sched_size);
    emu_switch(&thread_sp[t], sched_sp);
    SWITCH_END(fake, &sched_bottom, &sched_size);
}

/* cp.async, late: a thread's copies wait in its list until it waits for their group, and land
 * then (src read then: a kernel's inputs do not change while it runs). group: the commits
 * before the copy's, so the copies since the last commit have group == cp_committed[t]. */
struct emu_cp {
    void *dst;
    const void *src;
    int n, bytes;
    long group;
};
static std::vector<emu_cp> cp_pending[MAX_BLOCK];
static long cp_committed[MAX_BLOCK];

void emu_cp_async(void *dst, const void *src, int n, int bytes) {
    const unsigned t = threadIdx.x;
    cp_pending[t].push_back(emu_cp{dst, src, n, bytes, cp_committed[t]});
}
void emu_cp_async_commit(void) {
    cp_committed[threadIdx.x]++;
}
void emu_cp_async_wait(int keep) {
    const unsigned t = threadIdx.x;
    std::vector<emu_cp> &q = cp_pending[t];
    size_t kept = 0;
    for (size_t i = 0; i < q.size(); i++) {
        const emu_cp c = q[i];
        if (keep >= 0 && c.group >= cp_committed[t] - keep) { /* newer, or not committed */
            q[kept++] = c;
            continue;
        }
        if (c.bytes)
            memcpy(c.dst, c.src, (size_t)c.n);
        else
            memset(c.dst, 0, (size_t)c.n);
    }
    q.resize(kept);
}
/* A thread that ends with copies it never waited for loaded what nothing reads. */
static void cp_check_done(void) {
    const unsigned t = threadIdx.x;
    if (cp_pending[t].empty()) return;
    fprintf(stderr, "emu: thread %u of block %u ended with %zu cp.async copies never waited for\n",
            t, blockIdx.x, cp_pending[t].size());
    abort();
}

/* A coroutine's first frame: the kernel's body, then back to the scheduler for good. It never
 * returns, so it has no local whose address is taken: ASan's poison around such a local would
 * stay on the stack that the next block's thread t starts on. */
static void coroutine(void) {
    SWITCH_END(NULL, &sched_bottom, &sched_size);
    (*body_now)();
    cp_check_done();
    finished[threadIdx.x] = true;
    SWITCH_START(NULL, sched_bottom, sched_size); /* NULL: this stack's frames are done */
    emu_switch(&thread_sp[threadIdx.x], sched_sp);
    abort(); /* a finished coroutine is not resumed */
}

void __syncthreads(void) {
    if (plain_calls) {
        fprintf(stderr,
                "emu: thread %u of block %u reached __syncthreads, which thread 0 of its "
                "block never did (undefined on a GPU)\n",
                threadIdx.x, blockIdx.x);
        abort();
    }
    yield((int)threadIdx.x);
}

void *emu_dynamic_shared;

/* Warp collectives: a thread puts its words in one of two buffers, by the parity of its
 * collectives so far, and waits at a barrier; every thread of the block has put its words when
 * the barrier lets the first one on. A thread reads the buffer before its next collective,
 * which writes the other one, so one barrier a collective is enough, and the buffer itself is
 * what the threads read (no copy). */
static uint32_t xchg[2][MAX_BLOCK][EMU_XCHG_WORDS];
static unsigned xchg_count[MAX_BLOCK];

const uint32_t *emu_warp_exchange(const uint32_t *words, int n) {
    const unsigned t = threadIdx.x, buf = xchg_count[t]++ % 2, base = t - t % 32;
    if (n > EMU_XCHG_WORDS || base + 32 > blockDim.x) {
        fprintf(stderr, "emu: a warp collective of %d words in a block of %u threads (at most %d "
                "words, whole warps)\n", n, blockDim.x, EMU_XCHG_WORDS);
        abort();
    }
    for (int i = 0; i < n; i++) xchg[buf][t][i] = words[i];
    __syncthreads();
    return xchg[buf][base];
}

/* Thread t's coroutine, at the start of the body: a stack whose first switch to it returns
 * into coroutine() as if called (the ABI's alignment: 8 past a multiple of 16 at its entry),
 * the six registers emu_switch restores zero. */
static void start(int t) {
    if (!stacks[t] && posix_memalign((void **)&stacks[t], 16, STACK_SIZE)) abort();
    void **sp = (void **)(stacks[t] + STACK_SIZE) - 8;
#if defined(__SANITIZE_ADDRESS__)
    __asan_unpoison_memory_region(sp, 8 * sizeof(void *));
#endif
    memset(sp, 0, 8 * sizeof(void *));
    sp[6] = (void *)coroutine;
    thread_sp[t] = sp;
    finished[t] = false;
    xchg_count[t] = 0;
}

/* ---- stream capture: a graph is the work recorded, in order ----------------------------- */

struct emu_graph {
    std::vector<std::function<void()>> ops;
};
static thread_local emu_graph *capture; /* what this thread records, or NULL */
static thread_local cudaStream_t capture_stream;
static thread_local bool capture_invalid;

/* Whether op, queued on s, was recorded (s is the stream this thread captures) rather than
 * left to run now. */
static bool recorded(cudaStream_t s, const std::function<void()> &op) {
    if (!capture || s != capture_stream) return false;
    capture->ops.push_back(op);
    return true;
}

/* A call that cannot be captured: it fails and so will the capture, as on a GPU. */
static cudaError_t not_capturable(void) {
    capture_invalid = true;
    last_error = cudaErrorStreamCaptureUnsupported;
    return cudaErrorStreamCaptureUnsupported;
}

/* ---- EMU_CENSUS=FILE: what the GPU was asked to do, written to FILE at exit ----------------
 * Per kernel (by its name in the launch), cuBLAS entry and copy: the calls made and, for a
 * kernel, the threads launched; for a product, its multiply-adds; for a copy or a fill, its
 * bytes. Counted when the work runs (a graph's recorded work at each replay). Which kernels a
 * step launches, and how often, is the same on a GPU: a way to see what a change removed. */
struct census_row {
    long long calls;
    double amount;
};
static std::map<std::string, census_row> *census;
static std::mutex census_mu;

static void census_write(void) {
    FILE *f = fopen(getenv("EMU_CENSUS"), "w");
    if (!f) return;
    for (auto &r : *census)
        fprintf(f, "%lld\t%.0f\t%s\n", r.second.calls, r.second.amount, r.first.c_str());
    fclose(f);
}

static void census_add(const char *name, double amount) {
    static bool on = getenv("EMU_CENSUS") != NULL;
    if (!on || !name) return;
    std::lock_guard<std::mutex> g(census_mu);
    if (!census) {
        census = new std::map<std::string, census_row>;
        atexit(census_write);
    }
    census_row &r = (*census)[name];
    r.calls++;
    r.amount += amount;
}

static bool is_pinned(const void *p) {
    std::lock_guard<std::mutex> g(emu_mu);
    return pinned.count(p) > 0;
}

void emu_launch(long long grid, long long block, const std::function<void()> &body, size_t shmem,
                const void *kernel, cudaStream_t stream, const char *name) {
    if (capture && stream == capture_stream) {
        std::function<void()> copy = body;
        capture->ops.push_back(
            [=]() { emu_launch(grid, block, copy, shmem, kernel, (cudaStream_t)0, name); });
        return;
    }
    std::lock_guard<std::mutex> turn(emu_mu);
    size_t allowed = SMEM_DEFAULT;
    if (kernel && smem_allowed.count(kernel)) allowed = (size_t)smem_allowed[kernel];
    if (grid < 1 || grid > 2147483647LL || block < 1 || block > MAX_BLOCK || shmem > allowed) {
        fprintf(stderr, "emu: invalid launch configuration <<<%lld, %lld, %zu>>>%s\n", grid, block,
                shmem,
                shmem > allowed ? " (more shared memory than cudaFuncSetAttribute gave)" : "");
        last_error = cudaErrorInvalidValue;
        return;
    }
    census_add(name, (double)grid * block);
    free(emu_dynamic_shared);
    emu_dynamic_shared = NULL;
    if (shmem && posix_memalign(&emu_dynamic_shared, 128, shmem)) abort();
    body_now = &body;
    gridDim = {(unsigned)grid, 1, 1};
    blockDim = {(unsigned)block, 1, 1};
    for (long long b = 0; b < grid; b++) {
        blockIdx = {(unsigned)b, 0, 0};
        start(0);
        threadIdx = {0, 0, 0};
        resume(0);
        if (finished[0]) { /* no barrier in this block */
            plain_calls = true;
            for (int t = 1; t < block; t++) {
                threadIdx = {(unsigned)t, 0, 0};
                body();
                cp_check_done();
            }
            plain_calls = false;
            continue;
        }
        for (int t = 1; t < block; t++) start(t);
        /* the first round from thread 1: thread 0 waits at its first barrier already */
        for (int first = 1, any = 1; any; first = 0) {
            any = 0;
            for (int t = first; t < block; t++) {
                if (finished[t]) continue;
                any = 1;
                threadIdx = {(unsigned)t, 0, 0};
                resume(t);
            }
        }
    }
}

/* ---- runtime ----------------------------------------------------------------------------- */

extern "C" {

cudaError_t cudaGetDeviceCount(int *n) {
    const char *e = getenv("EMU_GPUS");
    *n = e ? atoi(e) : 1;
    return cudaSuccess;
}
const char *cudaGetErrorString(cudaError_t e) {
    return e == cudaSuccess                 ? "no error"
           : e == cudaErrorMemoryAllocation ? "out of memory"
                                            : "emulated error";
}
cudaError_t cudaGetLastError(void) {
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}
cudaError_t cudaSetDevice(int d) {
    current_device = d;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d) {
    *d = current_device;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d) {
    snprintf(p->name, sizeof p->name, "host emulation");
    p->totalGlobalMem = (size_t)80 << 30;
    p->major = 9, p->minor = 0;
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    *s = (cudaStream_t)malloc(1);
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    return capture && s == capture_stream ? not_capturable() : cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
    return capture ? not_capturable() : cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    *e = (cudaEvent_t)malloc(1);
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    free(e);
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    return cudaSuccess;
}
cudaError_t cudaMalloc(void **p, size_t n) {
    /* a "GPU" of 64 GiB: larger requests fail as cudaMalloc does */
    if (n > ((size_t)64 << 30) || !(*p = malloc(n))) {
        last_error = cudaErrorMemoryAllocation;
        return cudaErrorMemoryAllocation;
    }
    memset(*p, 0xa5, n); /* garbage, as fresh device memory is: kernels must not rely on 0 */
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
    free(p);
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t n) {
    if (!(*p = malloc(n))) return cudaErrorMemoryAllocation;
    std::lock_guard<std::mutex> g(emu_mu);
    pinned.insert(*p);
    return cudaSuccess;
}
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags) {
    return cudaMallocHost(p, n);
}
cudaError_t cudaFreeHost(void *p) {
    std::lock_guard<std::mutex> g(emu_mu);
    pinned.erase(p);
    free(p);
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b) {
    *free_b = *total_b = (size_t)64 << 30;
    return cudaSuccess;
}
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k) {
    if (capture) return not_capturable(); /* stricter than a GPU: see cuda_runtime.h */
    memmove(d, s, n);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k,
                            cudaStream_t st) {
    if (capture && st == capture_stream &&
        ((k == cudaMemcpyHostToDevice && !is_pinned(s)) ||
         (k == cudaMemcpyDeviceToHost && !is_pinned(d))))
        return not_capturable(); /* a graph's copy with the host is from pinned memory */
    auto run = [=]() {
        census_add(k == cudaMemcpyDeviceToDevice ? "cudaMemcpyAsync device to device"
                                                 : "cudaMemcpyAsync with the host",
                   (double)n);
        memmove(d, s, n);
    };
    if (!recorded(st, run)) run();
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st) {
    auto run = [=]() {
        census_add("cudaMemsetAsync", (double)n);
        memset(d, v, n);
    };
    if (!recorded(st, run)) run();
    return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode) {
    if (capture) return last_error = cudaErrorInvalidValue;
    capture = new emu_graph;
    capture_stream = s;
    capture_invalid = false;
    return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
    if (!capture || s != capture_stream) return last_error = cudaErrorInvalidValue;
    *g = capture_invalid ? NULL : capture;
    if (capture_invalid) delete capture;
    capture = NULL;
    return *g ? cudaSuccess : (last_error = cudaErrorStreamCaptureInvalidated);
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *status) {
    *status = !capture || s != capture_stream ? cudaStreamCaptureStatusNone
              : capture_invalid               ? cudaStreamCaptureStatusInvalidated
                                              : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags) {
    *e = new emu_graph(*g);
    return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
    if (capture && s == capture_stream) return not_capturable(); /* not needed here */
    for (auto &op : e->ops) op();
    return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
    delete e;
    return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
    delete g;
    return cudaSuccess;
}
/* A block's shared memory: sm_90's (SMEM_OPTIN), or EMU_SMEM_OPTIN bytes (another GPU's, for a
 * test: sm_86 and sm_89 give 101376) */
static int emu_smem_optin(void) {
    const char *e = getenv("EMU_SMEM_OPTIN");
    return e ? atoi(e) : SMEM_OPTIN;
}
/* sm_90, or EMU_CC_MAJOR.EMU_CC_MINOR (minor 0 unset): another GPU's choices, for a test */
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int device) {
    const char *cc = getenv("EMU_CC_MAJOR"), *minor = getenv("EMU_CC_MINOR");
    *v = a == cudaDevAttrMaxSharedMemoryPerBlockOptin ? emu_smem_optin()
         : a == cudaDevAttrComputeCapabilityMajor     ? (cc ? atoi(cc) : 9)
         : a == cudaDevAttrComputeCapabilityMinor     ? (minor ? atoi(minor) : 0)
                                                      : 0;
    return cudaSuccess;
}
cudaError_t emu_func_set_attribute(const void *kernel, enum cudaFuncAttribute a, int value) {
    if (a != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
        value > emu_smem_optin()) {
        last_error = cudaErrorInvalidValue;
        return cudaErrorInvalidValue;
    }
    std::lock_guard<std::mutex> g(emu_mu);
    smem_allowed[kernel] = value;
    return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
    std::lock_guard<std::mutex> g(emu_mu);
    a->type = pinned.count(p) ? cudaMemoryTypeHost : cudaMemoryTypeUnregistered;
    return cudaSuccess;
}

/* ---- cuBLAS ------------------------------------------------------------------------------ */

struct emu_blas {
    cudaStream_t stream; /* cublasSetStream's: a capture of it records the products */
};

cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = new emu_blas{};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *workspace, size_t bytes) {
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m) {
    return CUBLAS_STATUS_SUCCESS;
}

/* Element i of a GemmEx operand of type t, as a float (exact for all three types). */
static float ex_load(const void *p, cudaDataType t, long long i) {
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return t == CUDA_R_16BF ? tdm_bf16_to_float(h) : tdm_f16_to_float(h);
}

static void ex_store(void *p, cudaDataType t, long long i, float v) {
    if (t == CUDA_R_32F)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = t == CUDA_R_16BF ? tdm_bf16_from_float(v) : tdm_f16_from_float(v);
}

/* v rounded to TF32: 13 of f32's 23 mantissa bits dropped, to nearest, ties away from zero
 * (infinities and NaN as they are). */
static float tf32(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
    memcpy(&v, &u, 4);
    return v;
}

/* op(X)'s rows as floats (TF32-rounded where tf), row r's k elements contiguous: element (r, l)
 * of op(X) at p[r rs + l ls]. */
static std::vector<float> ex_panel(const void *p, cudaDataType t, long long rows, long long k,
                                   long long rs, long long ls, bool tf) {
    std::vector<float> v((size_t)(rows * k));
    for (long long r = 0; r < rows; r++)
        for (long long l = 0; l < k; l++) {
            const float x = ex_load(p, t, r * rs + l * ls);
            v[(size_t)(r * k + l)] = tf ? tf32(x) : x;
        }
    return v;
}

/* s[i + j m] = the sum over l of op(A)(i, l) op(B)(l, j) in double, in l order, for A and B
 * column-major (cuBLAS's), op the transpose where ta or tb; the operands' elements as floats,
 * TF32-rounded where tf. Both read into contiguous rows first: the same sums as reading them in
 * place, without a conversion and two strided loads a multiply-add. */
static std::vector<double> ex_products(const void *A, const void *B, cudaDataType t, long long m,
                                       long long n, long long k, bool ta, long long lda, bool tb,
                                       long long ldb, bool tf) {
    const std::vector<float> a = ex_panel(A, t, m, k, ta ? lda : 1, ta ? 1 : lda, tf);
    const std::vector<float> b = ex_panel(B, t, n, k, tb ? 1 : ldb, tb ? ldb : 1, tf);
    std::vector<double> s((size_t)(m * n));
    for (long long j = 0; j < n; j++)
        for (long long i = 0; i < m; i++) {
            const float *x = &a[(size_t)(i * k)], *y = &b[(size_t)(j * k)];
            double acc = 0;
            for (long long l = 0; l < k; l++) acc += (double)x[l] * y[l];
            s[(size_t)(i + j * m)] = acc;
        }
    return s;
}

/* C = alpha op(A) op(B) + beta C, column-major, with cuBLAS's argument checks. */
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float *alpha, const float *a, int lda, long long sa,
                                         const float *b, int ldb, long long sb, const float *beta,
                                         float *c, int ldc, long long sc, int batch) {
    int arows = ta == CUBLAS_OP_N ? m : k, brows = tb == CUBLAS_OP_N ? k : n;
    if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < (arows > 1 ? arows : 1) ||
        ldb < (brows > 1 ? brows : 1) || ldc < (m > 1 ? m : 1)) {
        fprintf(stderr, "emu cublas: invalid gemm m=%d n=%d k=%d lda=%d ldb=%d ldc=%d\n", m, n, k,
                lda, ldb, ldc);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    const float al = *alpha, be = *beta; /* read at the call, as cuBLAS's host pointers are */
    auto run = [=]() {
        census_add("cublasSgemm(StridedBatched)", (double)m * n * k * batch);
        for (int p = 0; p < batch; p++) {
            const std::vector<double> s = ex_products(a + p * sa, b + p * sb, CUDA_R_32F, m, n, k,
                                                      ta != CUBLAS_OP_N, lda, tb != CUBLAS_OP_N,
                                                      ldb, false);
            float *C = c + p * sc;
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    float r = (float)(al * s[i + (size_t)j * m]);
                    C[i + (long long)j * ldc] = be == 0.0f ? r : r + be * C[i + (long long)j * ldc];
                }
        }
    };
    if (!recorded(h->stream, run)) run();
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *a, int lda,
                           const float *b, int ldb, const float *beta, float *c, int ldc) {
    return cublasSgemmStridedBatched(h, ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc,
                                     0, 1);
}

static bool ex_type(cudaDataType t) {
    return t == CUDA_R_32F || t == CUDA_R_16BF || t == CUDA_R_16F;
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta,
                                          cublasOperation_t tb, int m, int n, int k,
                                          const void *alpha, const void *a, cudaDataType at,
                                          int lda, long long sa, const void *b, cudaDataType bt,
                                          int ldb, long long sb, const void *beta, void *c,
                                          cudaDataType ct, int ldc, long long sc, int batch,
                                          cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    int arows = ta == CUBLAS_OP_N ? m : k, brows = tb == CUBLAS_OP_N ? k : n;
    if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < (arows > 1 ? arows : 1) ||
        ldb < (brows > 1 ? brows : 1) || ldc < (m > 1 ? m : 1)) {
        fprintf(stderr, "emu cublas: invalid gemmEx m=%d n=%d k=%d lda=%d ldb=%d ldc=%d\n", m, n, k,
                lda, ldb, ldc);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    /* cuBLAS's table for CUBLAS_COMPUTE_32F: A and B alike, C alike or f32 */
    const bool fast = compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    if ((compute != CUBLAS_COMPUTE_32F && !fast) || at != bt || !ex_type(at) || !ex_type(ct) ||
        (ct != at && ct != CUDA_R_32F) || (fast && at != CUDA_R_32F)) {
        fprintf(stderr, "emu cublas: gemmEx types A %d B %d C %d compute %d not supported\n",
                (int)at, (int)bt, (int)ct, (int)compute);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    const float al = *(const float *)alpha, be = *(const float *)beta;
    auto run = [=]() {
        census_add("cublasGemmStridedBatchedEx", (double)m * n * k * batch);
        const size_t es = at == CUDA_R_32F ? 4 : 2, cs = ct == CUDA_R_32F ? 4 : 2;
        for (int p = 0; p < batch; p++) {
            const std::vector<double> s =
                ex_products((const char *)a + p * sa * es, (const char *)b + p * sb * es, at, m,
                            n, k, ta != CUBLAS_OP_N, lda, tb != CUBLAS_OP_N, ldb, fast);
            void *C = (char *)c + p * sc * cs;
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    const long long ci = i + (long long)j * ldc;
                    const float r = (float)(al * s[i + (size_t)j * m]);
                    ex_store(C, ct, ci, be == 0.0f ? r : r + be * ex_load(C, ct, ci));
                }
        }
    };
    if (!recorded(h->stream, run)) run();
    return CUBLAS_STATUS_SUCCESS;
}

/* ---- cuBLASLt ---------------------------------------------------------------------------- */

struct emu_lt {
    int unused;
};
struct emu_lt_desc {
    cublasComputeType_t compute;
    cublasOperation_t ta, tb;
    int epilogue;
    const void *bias;
    void *aux; /* GELU_AUX_BIAS's: the GELU's input, aux_ld apart */
    int64_t aux_ld;
};
struct emu_lt_layout {
    cudaDataType type;
    uint64_t rows, cols;
    int64_t ld;
};
struct emu_lt_pref {
    size_t workspace;
};

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
    *h = new emu_lt{};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
    if (scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
    *d = new emu_lt_desc{compute, CUBLAS_OP_N, CUBLAS_OP_N, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL,
                         0};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
    delete d;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t a, const void *buf,
                                              size_t size) {
    switch (a) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
        if (size != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        (a == CUBLASLT_MATMUL_DESC_TRANSA ? d->ta : d->tb) = *(const cublasOperation_t *)buf;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
        if (size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        d->epilogue = (int)*(const uint32_t *)buf;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
        if (size != sizeof(void *)) return CUBLAS_STATUS_INVALID_VALUE;
        d->bias = *(const void *const *)buf;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
        if (size != sizeof(void *)) return CUBLAS_STATUS_INVALID_VALUE;
        d->aux = *(void *const *)buf;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
        if (size != sizeof(int64_t)) return CUBLAS_STATUS_INVALID_VALUE;
        d->aux_ld = *(const int64_t *)buf;
        return CUBLAS_STATUS_SUCCESS;
    default:
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
    if (ld < (int64_t)(rows > 1 ? rows : 1)) return CUBLAS_STATUS_INVALID_VALUE;
    *l = new emu_lt_layout{type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
    delete l;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
    *p = new emu_lt_pref{0};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
    delete p;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t a,
                                                    const void *buf, size_t size) {
    if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES && size == sizeof(uint64_t)) {
        p->workspace = (size_t)(*(const uint64_t *)buf);
        return CUBLAS_STATUS_SUCCESS;
    }
    /* the alignments the algorithm may assume: a power of two, at most 256 */
    uint32_t align = size == sizeof(uint32_t) ? *(const uint32_t *)buf : 0;
    bool ok = a >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES &&
              a <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES && align && align <= 256 &&
              !(align & (align - 1));
    return ok ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

/* Whether cublasLtMatmul runs this product: one type throughout, the shapes agreeing, an
 * epilogue of none, a bias with its vector, or a bias and GELU with the GELU's input stored. */
static bool lt_runs(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                    cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d) {
    const bool fast = op->compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    uint64_t m = op->ta == CUBLAS_OP_N ? a->rows : a->cols,
             k = op->ta == CUBLAS_OP_N ? a->cols : a->rows;
    uint64_t kb = op->tb == CUBLAS_OP_N ? b->rows : b->cols,
             n = op->tb == CUBLAS_OP_N ? b->cols : b->rows;
    return (op->compute == CUBLAS_COMPUTE_32F || fast) && ex_type(a->type) && b->type == a->type &&
           c->type == a->type && d->type == a->type && (!fast || a->type == CUDA_R_32F) &&
           k == kb && d->rows == m && d->cols == n && c->rows == m && c->cols == n &&
           c->ld == d->ld &&
           (op->epilogue == CUBLASLT_EPILOGUE_DEFAULT ||
            (op->epilogue == CUBLASLT_EPILOGUE_BIAS && op->bias) ||
            /* the GELU's input: ld a multiple of 8, at least D's rows */
            (op->epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS && op->bias && op->aux &&
             op->aux_ld % 8 == 0 && op->aux_ld >= (int64_t)m) ||
            (op->epilogue == CUBLASLT_EPILOGUE_DGELU && op->aux && op->aux_ld % 8 == 0 &&
             op->aux_ld >= (int64_t)m) ||
            (op->epilogue == CUBLASLT_EPILOGUE_BGRADB && op->bias));
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int *count) {
    if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
    census_add("cublasLtMatmulAlgoGetHeuristic", 1);
    *count = 0;
    if (!lt_runs(op, a, b, c, d)) return CUBLAS_STATUS_NOT_SUPPORTED;
    memset(&results[0], 0, sizeof results[0]);
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *count = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t a, const void *B,
                              cublasLtMatrixLayout_t b, const void *beta, const void *C,
                              cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t *algo, void *workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
    if (!algo || !lt_runs(op, a, b, c, d)) return CUBLAS_STATUS_NOT_SUPPORTED;
    const float al = *(const float *)alpha, be = *(const float *)beta;
    const bool fast = op->compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    const bool ta = op->ta != CUBLAS_OP_N, tb = op->tb != CUBLAS_OP_N;
    const long long m = (long long)d->rows, n = (long long)d->cols;
    const long long k = (long long)(ta ? a->rows : a->cols), lda = a->ld, ldb = b->ld;
    const long long ldc = c->ld, ldd = d->ld;
    const cudaDataType t = d->type;
    const bool dgelu = op->epilogue == CUBLASLT_EPILOGUE_DGELU;
    void *bgrad = op->epilogue == CUBLASLT_EPILOGUE_BGRADB ? (void *)op->bias : NULL;
    const void *bias =
        op->epilogue != CUBLASLT_EPILOGUE_DEFAULT && !dgelu && !bgrad ? op->bias : NULL;
    void *aux = op->epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || dgelu ? op->aux : NULL;
    const long long aux_ld = op->aux_ld;
    const char *what = bgrad   ? "cublasLtMatmul, BGRADB"
                       : dgelu ? "cublasLtMatmul, DGELU"
                       : aux   ? "cublasLtMatmul, GELU_AUX_BIAS"
                       : bias  ? "cublasLtMatmul, BIAS"
                               : "cublasLtMatmul";
    auto run = [=]() {
        census_add(what, (double)m * n * k);
        const std::vector<double> s = ex_products(A, B, t, m, n, k, ta, lda, tb, ldb, fast);
        for (long long j = 0; j < n; j++)
            for (long long i = 0; i < m; i++) {
                /* alpha AB + beta C + bias in f32 (the epilogue's), then D's type */
                float r = (float)(al * s[(size_t)(i + j * m)]);
                if (be != 0.0f) r += be * ex_load(C, t, i + j * ldc);
                if (bias) r += ex_load(bias, t, i);
                if (dgelu) { /* the f32 sum times GELU' of the GELU's input */
                    float v = ex_load(aux, t, i + j * aux_ld), v2 = v * v;
                    float th = tanhf(0.7978845608f * (v + 0.044715f * v2 * v));
                    r *= 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * 0.7978845608f *
                                                  (1.0f + 3.0f * 0.044715f * v2);
                } else if (aux) { /* tanh-GELU of the f32 sum, its input kept in aux */
                    ex_store(aux, t, i + j * aux_ld, r);
                    r = 0.5f * r * (1.0f + tanhf(0.7978845608f * (r + 0.044715f * r * r * r)));
                }
                ex_store(D, t, i + j * ldd, r);
            }
        for (long long j = 0; bgrad && j < n; j++) { /* op(B)'s column j summed over k */
            double s = 0;
            for (long long l = 0; l < k; l++) s += ex_load(B, t, tb ? j + l * ldb : l + j * ldb);
            ex_store(bgrad, t, j, (float)s);
        }
    };
    if (!recorded(stream, run)) run();
    return CUBLAS_STATUS_SUCCESS;
}
}
