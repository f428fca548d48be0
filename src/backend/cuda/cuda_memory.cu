/* CUDA devices, streams and memory: per-GPU state created on first use, raw blocks for the
 * caching allocator, host transfers, strided copies with dtype conversion, fills and
 * Philox random fills (the same counters as the CPU backend, so cuda:0 and cpu:0 draw the
 * same numbers from the same generator state). */
#include "backend/cuda/cuda_common.cuh"

#include <assert.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define MAX_GPUS 64 /* the allocator's pools per device type (src/core/alloc.c MAX_POOLS) */

static cu_device devices[MAX_GPUS];
static bool device_ready[MAX_GPUS];
static pthread_mutex_t devices_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t count_once = PTHREAD_ONCE_INIT;
static int gpu_count;
static char no_gpu_reason[160];

static void count_gpus(void) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        snprintf(no_gpu_reason, sizeof no_gpu_reason, "no CUDA GPU found (cudaGetDeviceCount: %s)",
                 cudaGetErrorString(err));
        cudaGetLastError(); /* clear the sticky-free error so later calls start clean */
        n = 0;
    } else if (n == 0) {
        snprintf(no_gpu_reason, sizeof no_gpu_reason, "no CUDA GPU found");
    }
    gpu_count = n > MAX_GPUS ? MAX_GPUS : n;
}

extern "C" int tdm_cuda_device_count(void) {
    pthread_once(&count_once, count_gpus);
    return gpu_count;
}

extern "C" const char *tdm_cuda_unavailable_reason(void) {
    pthread_once(&count_once, count_gpus);
    return no_gpu_reason;
}

extern "C" int tdm_cuda_describe(int index, char *buf, size_t cap) {
    struct cudaDeviceProp p;
    if (!cu_dev(index, "describe") ||
        cu_check(cudaGetDeviceProperties(&p, index), "describe", index))
        return tdm_last_status();
    snprintf(buf, cap, "%s, %.1f GiB, sm_%d%d", p.name, (double)p.totalGlobalMem / (1 << 30),
             p.major, p.minor);
    return TDM_OK;
}

extern "C" int tdm_cuda_memory(int index, int64_t *total, int64_t *avail) {
    size_t free_b = 0, total_b = 0;
    if (!cu_dev(index, "memory") || cu_check(cudaMemGetInfo(&free_b, &total_b), "memory", index))
        return tdm_last_status();
    *total = (int64_t)total_b;
    *avail = (int64_t)free_b;
    return TDM_OK;
}

int cu_check(cudaError_t err, const char *what, int index) {
    if (err == cudaSuccess) return TDM_OK;
    cudaGetLastError(); /* a non-sticky error must not fail the next, unrelated launch */
    return tdm_raise(TDM_ERR_DEVICE, "%s on cuda:%d: %s", what, index, cudaGetErrorString(err));
}

int cu_check_launch(const char *what, int index) {
    return cu_check(cudaGetLastError(), what, index);
}

int cu_check_blas(cublasStatus_t st, const char *what, int index) {
    if (st == CUBLAS_STATUS_SUCCESS) return TDM_OK;
    return tdm_raise(TDM_ERR_DEVICE, "%s on cuda:%d: cuBLAS status %d", what, index, (int)st);
}

/* Creates streams, the ordering event, the cuBLAS handle and the bad-index words. */
static int device_init(cu_device *d, int index) {
    pthread_mutex_init(&d->order_lock, NULL);
    if (cu_check(cudaStreamCreateWithFlags(&d->compute, cudaStreamNonBlocking),
                 "creating the compute stream", index) ||
        cu_check(cudaStreamCreateWithFlags(&d->comm, cudaStreamNonBlocking),
                 "creating the communication stream", index) ||
        cu_check(cudaStreamCreateWithFlags(&d->upload, cudaStreamNonBlocking),
                 "creating the upload stream", index) ||
        cu_check(cudaEventCreateWithFlags(&d->order, cudaEventDisableTiming), "creating an event",
                 index) ||
        cu_check(cudaMalloc(&d->bad_dev, sizeof *d->bad_dev), "allocating a flag", index) ||
        cu_check(cudaMallocHost(&d->bad_host, sizeof *d->bad_host), "allocating a pinned flag",
                 index))
        return tdm_last_status();
    /* a workspace of cuBLAS's own, so that a product recorded in a graph allocates nothing */
    if (cu_blas_load() ||
        cu_check(cudaMalloc(&d->blas_workspace, CU_BLAS_WORKSPACE), "allocating cuBLAS's workspace",
                 index) ||
        cu_check_blas(cu_blas.cublasCreate(&d->blas), "creating the cuBLAS handle", index) ||
        cu_check_blas(cu_blas.cublasSetStream(d->blas, d->compute), "binding cuBLAS to its stream",
                      index) ||
        cu_check_blas(cu_blas.cublasSetWorkspace(d->blas, d->blas_workspace, CU_BLAS_WORKSPACE),
                      "giving cuBLAS its workspace", index) ||
        cu_check_blas(cu_blas.cublasLtCreate(&d->lt), "creating the cuBLASLt handle", index))
        return tdm_last_status();
    /* plain FP32 GEMMs (no TF32), as PyTorch does by default: results comparable to the CPU */
    return cu_check_blas(cu_blas.cublasSetMathMode(d->blas, CUBLAS_DEFAULT_MATH),
                         "setting FP32 math", index);
}

cu_device *cu_dev(int index, const char *what) {
    int n = tdm_cuda_device_count();
    if (index < 0 || index >= n) {
        if (n == 0)
            return (cu_device *)tdm_raise_null(TDM_ERR_DEVICE, "%s: cuda:%d asked for but %s", what,
                                               index, no_gpu_reason);
        return (cu_device *)tdm_raise_null(TDM_ERR_DEVICE,
                                           "%s: cuda:%d asked for but only %d GPU%s found", what,
                                           index, n, n == 1 ? "" : "s");
    }
    /* the current device is per thread, and NCCL, cuBLAS or the caller may change it: ask the
     * runtime each time (a thread-local read) rather than trusting a cache of our own */
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != index)
        if (cu_check(cudaSetDevice(index), what, index)) return NULL;
    if (__atomic_load_n(&device_ready[index], __ATOMIC_ACQUIRE)) return &devices[index];
    pthread_mutex_lock(&devices_lock);
    int rc = TDM_OK;
    if (!device_ready[index]) {
        rc = device_init(&devices[index], index);
        if (rc == TDM_OK) __atomic_store_n(&device_ready[index], true, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&devices_lock);
    return rc == TDM_OK ? &devices[index] : NULL;
}

extern "C" void *tdm_cuda_stream(int index, bool comm) {
    cu_device *d = cu_dev(index, "cuda stream");
    return d ? (void *)(comm ? d->comm : d->compute) : NULL;
}

extern "C" int tdm_cuda_order_streams(int index, bool comm_waits_compute) {
    cu_device *d = cu_dev(index, "ordering streams");
    if (!d) return tdm_last_status();
    cudaStream_t from = comm_waits_compute ? d->compute : d->comm;
    cudaStream_t to = comm_waits_compute ? d->comm : d->compute;
    /* one event suffices: cudaStreamWaitEvent captures the event's state at the call */
    pthread_mutex_lock(&d->order_lock);
    int rc = cu_check(cudaEventRecord(d->order, from), "recording an event", index);
    if (!rc) rc = cu_check(cudaStreamWaitEvent(to, d->order, 0), "waiting for an event", index);
    pthread_mutex_unlock(&d->order_lock);
    return rc;
}

extern "C" int tdm_cuda_synchronize(int index) {
    cu_device *d = cu_dev(index, "synchronize");
    if (!d) return tdm_last_status();
    if (cu_check(cudaStreamSynchronize(d->compute), "synchronize", index)) return -1;
    return cu_check(cudaStreamSynchronize(d->comm), "synchronize", index);
}

/* ---- memory ------------------------------------------------------------------------------ */

extern "C" void *tdm_cuda_mem_alloc(int index, size_t nbytes) {
    if (!cu_dev(index, "alloc")) return NULL;
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, nbytes ? nbytes : 256);
    if (err == cudaErrorMemoryAllocation) {
        /* the cache may hold enough free blocks of other sizes: give them back, retry once */
        cudaGetLastError();
        tdm_device dev = {TDM_CUDA, index};
        tdm_alloc_empty_cache(dev);
        err = cudaMalloc(&p, nbytes ? nbytes : 256);
    }
    if (err != cudaSuccess) {
        cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        cudaGetLastError();
        return tdm_raise_null(TDM_ERR_NOMEM,
                              "cuda:%d: out of memory allocating %zu bytes (%s; %zu MiB free of "
                              "%zu MiB)",
                              index, nbytes, cudaGetErrorString(err), free_b >> 20, total_b >> 20);
    }
    return p;
}

extern "C" void tdm_cuda_mem_free(int index, void *p, size_t nbytes) {
    if (!p || !cu_dev(index, "free")) return;
    /* cudaFree waits for the device: only tdm_alloc_empty_cache gets here, never a step */
    cudaFree(p);
}

void *cu_scratch(int index, size_t nbytes, tdm_storage **hold) {
    tdm_device dev = {TDM_CUDA, index};
    *hold = tdm_storage_new(nbytes, dev);
    return tdm_cuda_storage_ptr(*hold);
}

int cu_bad_reset(cu_device *d, int index) {
    return cu_check(cudaMemsetAsync(d->bad_dev, 0xff, sizeof *d->bad_dev, d->compute),
                    "resetting the index flag", index);
}

int cu_bad_read(cu_device *d, int index, long long *pos) {
    if (cu_check(cudaMemcpyAsync(d->bad_host, d->bad_dev, sizeof *d->bad_host,
                                 cudaMemcpyDeviceToHost, d->compute),
                 "reading the index flag", index) ||
        cu_check(cudaStreamSynchronize(d->compute), "waiting for the index check", index))
        return tdm_last_status();
    *pos = *d->bad_host == ~0ull ? -1 : (long long)*d->bad_host;
    return TDM_OK;
}

int64_t cu_index_value(const void *idx, bool i64, int64_t stride, int64_t i) {
    int64_t v64 = 0;
    int32_t v32 = 0;
    const char *p = (const char *)idx + i * stride * (i64 ? 8 : 4);
    if (cudaMemcpy(i64 ? (void *)&v64 : (void *)&v32, p, i64 ? 8 : 4, cudaMemcpyDeviceToHost) !=
        cudaSuccess)
        cudaGetLastError();
    return i64 ? v64 : v32;
}

int64_t cu_index_to_host(const tdm_tensor *idx, int64_t i) {
    return cu_index_value(tdm_cuda_ptr(idx), idx->dtype == TDM_I64, idx->ndim ? idx->strides[0] : 0,
                          i);
}

/* ---- copies, fills ----------------------------------------------------------------------- */

__device__ __forceinline__ double cu_load(const void *p, tdm_dtype dt, int64_t i) {
    if (dt == TDM_F32) return ((const float *)p)[i];
    if (dt == TDM_I32) return ((const int32_t *)p)[i];
    if (dt == TDM_BF16) return cu_ld(((const __nv_bfloat16 *)p)[i]);
    if (dt == TDM_F16) return cu_ld(((const __half *)p)[i]);
    return (double)((const int64_t *)p)[i];
}

/* bf16 and f16 through a float, as the CPU's store (and PyTorch) converts a double. */
__device__ __forceinline__ void cu_store(void *p, tdm_dtype dt, int64_t i, double v) {
    if (dt == TDM_F32)
        ((float *)p)[i] = (float)v;
    else if (dt == TDM_I32)
        ((int32_t *)p)[i] = (int32_t)v;
    else if (dt == TDM_BF16)
        ((__nv_bfloat16 *)p)[i] = cu_to<__nv_bfloat16>((float)v);
    else if (dt == TDM_F16)
        ((__half *)p)[i] = cu_to<__half>((float)v);
    else
        ((int64_t *)p)[i] = (int64_t)v;
}

/* dst[i] = src[i] for row-major i; a same-dtype copy moves the bits (i64 through double
 * would lose values above 2^53); to bf16 or f16 rounds once (from f32) to nearest even. */
__global__ void copy_kernel(void *dst, cu_view dv, tdm_dtype dt, const void *src, cu_view sv,
                            tdm_dtype st, int64_t n) {
    CU_LOOP(i, n) {
        int64_t o = cu_offset(dv, i), s = cu_offset(sv, i);
        if (dt == st && dt == TDM_I64)
            ((int64_t *)dst)[o] = ((const int64_t *)src)[s];
        else if (dt == st && (dt == TDM_BF16 || dt == TDM_F16))
            ((uint16_t *)dst)[o] = ((const uint16_t *)src)[s];
        else if (dt == st)
            ((int32_t *)dst)[o] = ((const int32_t *)src)[s]; /* f32 and i32: 4-byte words */
        else
            cu_store(dst, dt, o, cu_load(src, st, s));
    }
}

/* Four elements moved as one aligned word (16 bytes of f32, 8 of bf16 or f16). */
template <typename E> struct alignas(4 * sizeof(E)) cu_vec4 { E v[4]; };

/* dst[i] = src[i] rounded once to D, four at a time: the casts around autocast's products are
 * contiguous, and the element-by-element copy_kernel moved them at a third of the memory's
 * speed (bench/RESULTS.md, "GPU check ... mixed precision"). */
template <typename D, typename S>
__global__ void convert4_kernel(cu_vec4<D> *dst, const cu_vec4<S> *src, int64_t n4) {
    CU_LOOP(i, n4) {
        const cu_vec4<S> a = src[i];
        cu_vec4<D> b;
        for (int k = 0; k < 4; k++) b.v[k] = cu_to<D>(cu_ld(a.v[k]));
        dst[i] = b;
    }
}

template <typename D, typename S> __global__ void convert_kernel(D *dst, const S *src, int64_t n) {
    CU_LOOP(i, n) dst[i] = cu_to<D>(cu_ld(src[i]));
}

/* A contiguous float-to-float conversion: whole words where both ends are aligned to them,
 * the rest (a tail of under 4, or all of a misaligned view) one element a thread. */
template <typename D> struct cu_convert {
    template <typename S> static void run(cu_device *d, void *dst, const void *src, int64_t n) {
        int64_t n4 = ((uintptr_t)dst % sizeof(cu_vec4<D>) || (uintptr_t)src % sizeof(cu_vec4<S>))
                         ? 0
                         : n / 4;
        if (n4)
            convert4_kernel<D, S><<<cu_blocks(n4), CU_THREADS, 0, d->compute>>>(
                (cu_vec4<D> *)dst, (const cu_vec4<S> *)src, n4);
        if (n > 4 * n4)
            convert_kernel<D, S><<<cu_blocks(n - 4 * n4), CU_THREADS, 0, d->compute>>>(
                (D *)dst + 4 * n4, (const S *)src + 4 * n4, n - 4 * n4);
    }
};

template <typename D>
static void convert_launch(cu_device *d, void *dst, const void *src, tdm_dtype st, int64_t n) {
    CU_DISPATCH(st, cu_convert<D>::template run, d, dst, src, n);
}

/* Copies between any two CUDA tensors of one device (and equal numel). */
static int strided_copy(cu_device *d, int index, void *dst, cu_view dv, tdm_dtype dt,
                        const void *src, cu_view sv, tdm_dtype st, int64_t n) {
    if (n == 0) return TDM_OK;
    copy_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(dst, dv, dt, src, sv, st, n);
    return cu_check_launch("copy", index);
}

extern "C" int tdm_cuda_copy(tdm_tensor *dst, const tdm_tensor *src) {
    /* host <-> GPU through the transfer kernels (CPU memory is one address space) */
    bool same_layout = dst->dtype == src->dtype && tdm_numel(dst) == tdm_numel(src);
    if (src->device.type == TDM_CPU && dst->device.type == TDM_CUDA && same_layout &&
        tdm_is_contiguous(src))
        return tdm_cuda_from_host(dst, tdm_data_ptr(src));
    if (dst->device.type == TDM_CPU && src->device.type == TDM_CUDA && same_layout &&
        tdm_is_contiguous(dst))
        return tdm_cuda_to_host(tdm_data_ptr(dst), src);
    if (dst->device.type != TDM_CUDA || src->device.type != TDM_CUDA ||
        dst->device.index != src->device.index) {
        char a[16], b[16];
        return tdm_raise(TDM_ERR_DEVICE,
                         "cuda copy: %s to %s is not supported (GPU to GPU copies need both on one "
                         "GPU; host copies need contiguous host memory of the same dtype)",
                         tdm_device_str(src->device, a), tdm_device_str(dst->device, b));
    }
    cu_device *d = cu_dev_of(dst, "copy");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(dst);
    if (n != tdm_numel(src))
        return tdm_raise(TDM_ERR_SHAPE, "cuda copy: %lld elements into %lld",
                         (long long)tdm_numel(src), (long long)n);
    if (n == 0) return TDM_OK;
    if (dst->dtype == src->dtype && tdm_is_contiguous(dst) && tdm_is_contiguous(src))
        return cu_check(cudaMemcpyAsync(tdm_cuda_ptr(dst), tdm_cuda_ptr(src),
                                        (size_t)n * tdm_dtype_size(dst->dtype),
                                        cudaMemcpyDeviceToDevice, d->compute),
                        "copy", dst->device.index);
    if (tdm_dtype_is_float(dst->dtype) && tdm_dtype_is_float(src->dtype) &&
        tdm_is_contiguous(dst) && tdm_is_contiguous(src)) {
        CU_DISPATCH(dst->dtype, convert_launch, d, tdm_cuda_ptr(dst), tdm_cuda_ptr(src), src->dtype,
                    n);
        return cu_check_launch("copy", dst->device.index);
    }
    /* views of different shapes but equal numel walk their own shapes in row-major order */
    return strided_copy(d, dst->device.index, tdm_cuda_ptr(dst), cu_view_of(dst), dst->dtype,
                        tdm_cuda_ptr(src), cu_view_of(src), src->dtype, n);
}

/* Whether host memory is pinned (page-locked or registered): such a copy stays in flight
 * after cudaMemcpyAsync returns, so the caller's buffer must outlive it. */
static bool is_pinned(const void *host) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, host) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeHost;
}

extern "C" int tdm_cuda_to_host(void *host, const tdm_tensor *t) {
    cu_device *d = cu_dev_of(t, "to_host");
    if (!d) return tdm_last_status();
    if (d->capture)
        return cu_not_capturable(t->device.index, "a read back to the host (tdm_item, tdm_to_host)",
                                 "it waits for work the graph has only recorded");
    int index = t->device.index;
    int64_t n = tdm_numel(t);
    size_t bytes = (size_t)n * tdm_dtype_size(t->dtype);
    if (n == 0) return TDM_OK;
    tdm_storage *hold = NULL;
    const void *src = tdm_cuda_ptr(t);
    if (!tdm_is_contiguous(t)) { /* gather on the GPU first: one transfer, not n */
        void *tmp = cu_scratch(index, bytes, &hold);
        if (!tmp) return tdm_last_status();
        cu_view cv = {1, {n}, {1}};
        if (strided_copy(d, index, tmp, cv, t->dtype, src, cu_view_of(t), t->dtype, n)) {
            tdm_storage_release(hold);
            return tdm_last_status();
        }
        src = tmp;
    }
    int rc = cu_check(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, d->compute),
                      "to_host", index);
    if (!rc) rc = cu_check(cudaStreamSynchronize(d->compute), "to_host", index);
    if (hold) tdm_storage_release(hold);
    return rc;
}

extern "C" int tdm_cuda_from_host(tdm_tensor *t, const void *host) {
    cu_device *d = cu_dev_of(t, "from_host");
    if (!d) return tdm_last_status();
    if (d->capture)
        return cu_not_capturable(
            t->device.index, "a copy from host memory",
            "a replay would copy the host's bytes of the recording, not of its own step");
    int index = t->device.index;
    int64_t n = tdm_numel(t);
    size_t bytes = (size_t)n * tdm_dtype_size(t->dtype);
    if (n == 0) return TDM_OK;
    tdm_storage *hold = NULL;
    void *dst = tdm_cuda_ptr(t);
    bool strided = !tdm_is_contiguous(t);
    if (strided && !(dst = cu_scratch(index, bytes, &hold))) return tdm_last_status();
    /* from pageable memory cudaMemcpyAsync returns once the data is staged, so the caller
     * may reuse its buffer; from pinned memory it does not, so that case waits */
    int rc = cu_check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, d->compute),
                      "from_host", index);
    if (!rc && strided) {
        cu_view cv = {1, {n}, {1}};
        rc = strided_copy(d, index, tdm_cuda_ptr(t), cu_view_of(t), t->dtype, dst, cv, t->dtype, n);
    }
    if (!rc && is_pinned(host))
        rc = cu_check(cudaStreamSynchronize(d->compute), "from_host", index);
    if (hold) tdm_storage_release(hold);
    return rc;
}

extern "C" void *tdm_cuda_pinned_alloc(size_t nbytes) {
    void *p = NULL;
    cudaError_t err = cudaHostAlloc(&p, nbytes ? nbytes : 1, cudaHostAllocPortable);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return tdm_raise_null(TDM_ERR_NOMEM, "cuda: cannot pin %zu bytes of host memory: %s",
                              nbytes, cudaGetErrorString(err));
    }
    return p;
}

extern "C" void tdm_cuda_pinned_free(void *p) {
    if (p) cudaFreeHost(p);
}

extern "C" int tdm_cuda_upload_async(tdm_tensor *t, const void *pinned, void **fence) {
    cu_device *d = cu_dev_of(t, "upload");
    if (!d) return tdm_last_status();
    int idx = t->device.index;
    if (!tdm_is_contiguous(t))
        return tdm_raise(TDM_ERR_ARG, "cuda upload: the tensor must be contiguous");
    size_t bytes = (size_t)tdm_numel(t) * tdm_dtype_size(t->dtype);
    cudaEvent_t *ev = (cudaEvent_t *)fence;
    if (!*ev && cu_check(cudaEventCreateWithFlags(ev, cudaEventDisableTiming), "upload", idx))
        return tdm_last_status();
    /* after the compute stream's work so far (the last batch in t may still be read), then
     * the copy on the upload stream, overlapping what the compute stream runs meanwhile */
    cudaStream_t up = d->upload;
    pthread_mutex_lock(&d->order_lock);
    int rc = cu_check(cudaEventRecord(d->order, d->compute), "upload", idx);
    if (!rc) rc = cu_check(cudaStreamWaitEvent(up, d->order, 0), "upload", idx);
    pthread_mutex_unlock(&d->order_lock);
    if (!rc && bytes)
        rc = cu_check(cudaMemcpyAsync(tdm_cuda_ptr(t), pinned, bytes, cudaMemcpyHostToDevice, up),
                      "upload", idx);
    if (!rc) rc = cu_check(cudaEventRecord(*ev, up), "upload", idx);
    /* kernels queued from now on read the new batch */
    if (!rc) rc = cu_check(cudaStreamWaitEvent(d->compute, *ev, 0), "upload", idx);
    return rc;
}

extern "C" int tdm_cuda_fence_wait(void *fence) {
    cudaError_t err = fence ? cudaEventSynchronize((cudaEvent_t)fence) : cudaSuccess;
    if (err == cudaSuccess) return TDM_OK;
    cudaGetLastError();
    return tdm_raise(TDM_ERR_DEVICE, "waiting for a batch's upload to the GPU: %s",
                     cudaGetErrorString(err));
}

extern "C" void tdm_cuda_fence_free(void *fence) {
    if (fence) cudaEventDestroy((cudaEvent_t)fence);
}

__global__ void fill_kernel(void *dst, cu_view v, tdm_dtype dt, double value, int64_t n) {
    CU_LOOP(i, n) cu_store(dst, dt, cu_offset(v, i), value);
}

__global__ void count_up_kernel(int64_t *n) {
    if (threadIdx.x == 0) ++*n;
}

extern "C" int tdm_cuda_count_up(tdm_tensor *n) {
    if (n->dtype != TDM_I64 || tdm_numel(n) != 1)
        return tdm_raise(TDM_ERR_ARG, "cuda count_up: a count is one i64 element");
    cu_device *d = cu_dev_of(n, "count_up");
    if (!d) return tdm_last_status();
    count_up_kernel<<<1, 32, 0, d->compute>>>((int64_t *)tdm_cuda_ptr(n));
    return cu_check_launch("count_up", n->device.index);
}

extern "C" int tdm_cuda_fill(tdm_tensor *dst, double value) {
    cu_device *d = cu_dev_of(dst, "fill");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(dst);
    if (n == 0) return TDM_OK;
    if (value == 0.0 && tdm_is_contiguous(dst))
        return cu_check(cudaMemsetAsync(tdm_cuda_ptr(dst), 0,
                                        (size_t)n * tdm_dtype_size(dst->dtype), d->compute),
                        "fill", dst->device.index);
    fill_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(tdm_cuda_ptr(dst), cu_view_of(dst),
                                                             dst->dtype, value, n);
    return cu_check_launch("fill", dst->device.index);
}

/* Element k (row-major): uniform from word k % 4 of Philox block (offset + k) / 4 of stream
 * 0; normal by Box-Muller on word pair k % 2 of block (offset + k) / 2 of stream 1, in
 * double as on the CPU (see tdm_cpu_random). */
template <typename T>
__global__ void random_kernel(T *dst, cu_view v, int dist, float a, float b, uint64_t seed,
                              uint64_t offset, int64_t n) {
    CU_LOOP(k, n) {
        uint64_t c = offset + (uint64_t)k;
        uint32_t w[4];
        float r;
        if (dist == 0) {
            cu_philox(seed, c / 4, 0, w);
            /* no FMA contraction: the CPU rounds the product, then the sum */
            r = __fadd_rn(a, __fmul_rn(b - a, cu_unit(w[c % 4])));
        } else {
            cu_philox(seed, c / 2, 1, w);
            const uint32_t *p = &w[2 * (c % 2)];
            double u1 = ((double)p[0] + 1.0) / 4294967296.0;
            double u2 = (double)p[1] / 4294967296.0;
            r = (float)(a + b * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
        }
        dst[cu_offset(v, k)] = cu_to<T>(r); /* bf16, f16: the f32 draw rounded once */
    }
}

template <typename T>
static void random_launch(cu_device *d, tdm_tensor *dst, int dist, float a, float b, uint64_t seed,
                          uint64_t offset, int64_t n) {
    random_kernel<T><<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_p<T>(dst), cu_view_of(dst),
                                                                  dist, a, b, seed, offset, n);
}

extern "C" int tdm_cuda_random(tdm_tensor *dst, int dist, float a, float b, uint64_t seed,
                               uint64_t offset) {
    cu_device *d = cu_dev_of(dst, "random");
    if (!d) return tdm_last_status();
    if (d->capture)
        return cu_not_capturable(dst->device.index, "a random fill",
                                 "each replay would draw the same numbers");
    assert(tdm_dtype_is_float(dst->dtype)); /* uniform_ and normal_ refused other dtypes */
    int64_t n = tdm_numel(dst);
    if (n == 0) return TDM_OK;
    CU_DISPATCH(dst->dtype, random_launch, d, dst, dist, a, b, seed, offset, n);
    return cu_check_launch("random", dst->device.index);
}
