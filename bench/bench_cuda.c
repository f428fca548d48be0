/* bench_cuda: GPU throughput for scripts/gpu-check: an n x n x n FP32 SGEMM through Tandem's
 * CUDA backend next to cuBLAS called directly, on cuda:0.
 *
 *   bench_cuda        (exits 77 without a GPU or without the CUDA backend) */
#include <stdio.h>

#include "backend/backend.h"

#ifndef TANDEM_HAVE_CUDA
int main(void) {
    printf("bench_cuda: this build has no CUDA backend\n");
    return 77;
}
#else

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <time.h>

#include "backend/cuda/cuda.h"

static const tdm_backend *GPU;
static tdm_device G; /* cuda:0 */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* GFLOP/s of an n x n x n SGEMM through Tandem's backend and through cuBLAS directly. */
static void bench_matmul(int64_t n) {
    tdm_tensor *a = tdm_ones(TDM_SHAPE(1, n, n), TDM_F32, G);
    tdm_tensor *b = tdm_ones(TDM_SHAPE(1, n, n), TDM_F32, G);
    tdm_tensor *c = tdm_zeros(TDM_SHAPE(1, n, n), TDM_F32, G);
    int reps = n >= 4096 ? 20 : 100;
    double flops = 2.0 * (double)n * (double)n * (double)n * reps, t0, tt, tc;
    GPU->matmul(c, a, b, false, false, 0); /* warm-up */
    tdm_cuda_synchronize(0);
    t0 = now_s();
    for (int i = 0; i < reps; i++) GPU->matmul(c, a, b, false, false, 0);
    tdm_cuda_synchronize(0);
    tt = now_s() - t0;
    cublasHandle_t h;
    cublasCreate(&h);
    float *da, *db, *dc, one = 1, zero = 0;
    cudaMalloc((void **)&da, sizeof(float) * (size_t)(n * n));
    cudaMalloc((void **)&db, sizeof(float) * (size_t)(n * n));
    cudaMalloc((void **)&dc, sizeof(float) * (size_t)(n * n));
    cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)n, (int)n, (int)n, &one, da, (int)n, db, (int)n,
                &zero, dc, (int)n);
    cudaDeviceSynchronize();
    t0 = now_s();
    for (int i = 0; i < reps; i++)
        cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)n, (int)n, (int)n, &one, da, (int)n, db,
                    (int)n, &zero, dc, (int)n);
    cudaDeviceSynchronize();
    tc = now_s() - t0;
    printf("matmul %lldx%lldx%lld FP32: tandem %.0f GFLOP/s, cuBLAS %.0f GFLOP/s (%.0f%%)\n",
           (long long)n, (long long)n, (long long)n, flops / tt * 1e-9, flops / tc * 1e-9,
           100.0 * tc / tt);
    cudaFree(da), cudaFree(db), cudaFree(dc);
    cublasDestroy(h);
    tdm_tensor_free(a), tdm_tensor_free(b), tdm_tensor_free(c);
}

int main(void) {
    if (tdm_cuda_device_count() == 0) {
        printf("bench_cuda: no GPU: %s\n", tdm_cuda_unavailable_reason());
        return 77;
    }
    G = tdm_cuda(0);
    if (!(GPU = tdm_backend_for(G))) {
        fprintf(stderr, "bench_cuda: %s\n", tdm_last_error());
        return 1;
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
        printf("device: %s, %.0f GiB\n", prop.name, (double)prop.totalGlobalMem / (1 << 30));
    bench_matmul(1024);
    bench_matmul(4096);
    return 0;
}
#endif
