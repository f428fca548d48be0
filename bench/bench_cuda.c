/* bench_cuda: GPU throughput for scripts/gpu-check: an n x n x n FP32 SGEMM through Tandem's
 * CUDA backend next to cuBLAS called directly, and the causal attention of GPT-2 small's shape
 * (batch 8, context 1024, 12 heads of 64) forward and backward, fused (cuda_flash.cu) and
 * unfused (cuda_attention.cu), in f32 and bf16, on cuda:0.
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

/* Milliseconds of attention and of attention_backward at GPT-2 small's shape in dtype dt,
 * fused or not, and their rate over the causal products' FLOPs (2 B H T^2 hs forward, the
 * half of QK^T and PV at or below the diagonal; 2.5 times that backward, FlashAttention's
 * count: the dQ kernel's recomputed products are not counted). */
static void bench_attention(tdm_dtype dt, bool fused) {
    const int64_t B = 8, T = 1024, C = 768, H = 12;
    tdm_tensor *q32 = tdm_randn(TDM_SHAPE(B, T, 3 * C), 0, 1, G, NULL);
    tdm_tensor *d32 = tdm_randn(TDM_SHAPE(B, T, C), 0, 1, G, NULL);
    tdm_tensor *qkv = tdm_cast(q32, dt), *dy = tdm_cast(d32, dt);
    tdm_tensor *y = tdm_tensor_alloc(TDM_SHAPE(B, T, C), dt, G);
    tdm_tensor *g = tdm_tensor_alloc(TDM_SHAPE(B, T, 3 * C), dt, G);
    tdm_tensor *lse = tdm_tensor_alloc(TDM_SHAPE(B, H, T), TDM_F32, G);
    const int reps = 10;
    double t0, tf = 0, tb = 0;
    tdm_cuda_flash_enable(fused);
    int rc = qkv && dy && y && g && lse ? GPU->attention(y, lse, qkv, (int)H) : -1; /* warm-up */
    if (!rc) rc = GPU->attention_backward(g, dy, qkv, y, lse, (int)H);
    tdm_cuda_synchronize(0);
    t0 = now_s();
    for (int i = 0; i < reps && !rc; i++) rc = GPU->attention(y, lse, qkv, (int)H);
    tdm_cuda_synchronize(0);
    tf = (now_s() - t0) / reps;
    t0 = now_s();
    for (int i = 0; i < reps && !rc; i++) rc = GPU->attention_backward(g, dy, qkv, y, lse, (int)H);
    tdm_cuda_synchronize(0);
    tb = (now_s() - t0) / reps;
    tdm_cuda_flash_enable(true);
    const double f = 2.0 * (double)(B * H) * (double)(T * T) * (double)(C / H);
    if (rc)
        printf("attention %s %s: %s\n", tdm_dtype_name(dt), fused ? "fused" : "unfused",
               tdm_last_error());
    else
        printf("attention B8 T1024 H12 hs64 %s %s: forward %.2f ms (%.1f TFLOP/s), backward "
               "%.2f ms (%.1f TFLOP/s)\n",
               tdm_dtype_name(dt), fused ? "fused" : "unfused", tf * 1e3, f / tf * 1e-12, tb * 1e3,
               2.5 * f / tb * 1e-12);
    tdm_tensor_free(q32), tdm_tensor_free(d32), tdm_tensor_free(qkv), tdm_tensor_free(dy);
    tdm_tensor_free(y), tdm_tensor_free(g), tdm_tensor_free(lse);
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
    for (int fused = 1; fused >= 0; fused--) {
        bench_attention(TDM_BF16, fused);
        bench_attention(TDM_F32, fused);
    }
    return 0;
}
#endif
