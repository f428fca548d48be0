/* bench_cuda: GPU throughput for scripts/gpu-check: an n x n x n FP32 SGEMM through Tandem's
 * CUDA backend next to cuBLAS called directly on the same random operands, the causal attention
 * of GPT-2 small's shape (batch 8, context 1024, 12 heads of 64) forward and backward, fused
 * (cuda_flash.cu) and unfused (cuda_attention.cu), in f32 and bf16, and that shape's layer norm
 * (8192 rows of 768) as a bf16 step runs it, with the residual add in its kernel and before it,
 * a row a warp and a row a block, against the card's copy bandwidth; on cuda:0. Each figure is the
 * median of 5 rounds.
 *
 *   bench_cuda        (exits 77 without a GPU or without the CUDA backend) */
#include <stdio.h>
#include <stdlib.h>

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

#define ROUNDS 5

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(double *v) {
    qsort(v, ROUNDS, sizeof *v, cmp_double);
    return v[ROUNDS / 2];
}

/* Median seconds of one call of body over ROUNDS rounds of reps calls, after a warm-up call;
 * rc receives the first error. The device waited for as a whole: Tandem's streams and the one
 * cuBLAS is called on directly. */
#define TIME_MEDIAN(out, reps, rc, body)                                                           \
    do {                                                                                           \
        double t_[ROUNDS];                                                                         \
        if (!(rc)) (rc) = (body);                                                                  \
        cudaDeviceSynchronize();                                                                   \
        for (int r_ = 0; r_ < ROUNDS; r_++) {                                                      \
            double t0_ = now_s();                                                                  \
            for (int i_ = 0; i_ < (reps) && !(rc); i_++) (rc) = (body);                            \
            cudaDeviceSynchronize();                                                               \
            t_[r_] = (now_s() - t0_) / (reps);                                                     \
        }                                                                                          \
        (out) = median(t_);                                                                        \
    } while (0)

/* GFLOP/s of an n x n x n SGEMM through Tandem's backend and through cuBLAS directly. */
static void bench_matmul(int64_t n) {
    /* random operands (constant ones run a product faster than data does) */
    tdm_tensor *a = tdm_randn(TDM_SHAPE(1, n, n), 0, 1, G, NULL);
    tdm_tensor *b = tdm_randn(TDM_SHAPE(1, n, n), 0, 1, G, NULL);
    tdm_tensor *c = tdm_zeros(TDM_SHAPE(1, n, n), TDM_F32, G);
    int reps = n >= 4096 ? 4 : 20, rc = a && b && c ? 0 : -1;
    double flops = 2.0 * (double)n * (double)n * (double)n, tt = 0, tc = 0;
    TIME_MEDIAN(tt, reps, rc, GPU->matmul(c, a, b, false, false, 0));
    cublasHandle_t h;
    cublasCreate(&h);
    float *da = tdm_cuda_ptr(a), *db = tdm_cuda_ptr(b), *dc = tdm_cuda_ptr(c), one = 1, zero = 0;
    /* cuBLAS is column-major: C^T = B^T A^T, the same product on the same buffers */
    TIME_MEDIAN(tc, reps, rc,
                (int)cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)n, (int)n, (int)n, &one, db,
                                 (int)n, da, (int)n, &zero, dc, (int)n));
    if (rc)
        printf("matmul %lld: %s\n", (long long)n, tdm_last_error());
    else
        printf("matmul %lldx%lldx%lld FP32: tandem %.0f GFLOP/s, cuBLAS %.0f GFLOP/s (%.0f%%)\n",
               (long long)n, (long long)n, (long long)n, flops / tt * 1e-9, flops / tc * 1e-9,
               100.0 * tc / tt);
    cublasDestroy(h);
    tdm_tensor_free(a), tdm_tensor_free(b), tdm_tensor_free(c);
}

/* Milliseconds of attention and of attention_backward at GPT-2 small's shape in dtype dt,
 * fused or not, and their rate over the causal products' FLOPs (2 B H T^2 hs forward, the
 * half of QK^T and PV at or below the diagonal; 2.5 times that backward, FlashAttention's
 * count: the dQ kernel's recomputed products are not counted). In bf16 fused, wide: the kernels
 * whose blocks take 128 rows, two 16-row tiles a warp (tdm_cuda_flash_wide; all by default), the
 * others 64. In f32 fused, tf32x3: the products as three TF32 products on the tensor cores
 * (tdm_cuda_flash_tf32x3; the default), else on the CUDA cores. */
static void bench_attention(tdm_dtype dt, bool fused, unsigned wide, bool tf32x3) {
    const int64_t B = 8, T = 1024, C = 768, H = 12;
    tdm_tensor *q32 = tdm_randn(TDM_SHAPE(B, T, 3 * C), 0, 1, G, NULL);
    tdm_tensor *d32 = tdm_randn(TDM_SHAPE(B, T, C), 0, 1, G, NULL);
    tdm_tensor *qkv = tdm_cast(q32, dt), *dy = tdm_cast(d32, dt);
    tdm_tensor *y = tdm_tensor_alloc(TDM_SHAPE(B, T, C), dt, G);
    tdm_tensor *g = tdm_tensor_alloc(TDM_SHAPE(B, T, 3 * C), dt, G);
    tdm_tensor *lse = tdm_tensor_alloc(TDM_SHAPE(B, H, T), TDM_F32, G);
    const int reps = 4;
    double tf = 0, tb = 0;
    tdm_cuda_flash_enable(fused);
    tdm_cuda_flash_wide(wide);
    tdm_cuda_flash_tf32x3(tf32x3);
    int rc = qkv && dy && y && g && lse ? 0 : -1;
    TIME_MEDIAN(tf, reps, rc, GPU->attention(y, lse, qkv, (int)H));
    TIME_MEDIAN(tb, reps, rc, GPU->attention_backward(g, dy, qkv, y, lse, (int)H));
    tdm_cuda_flash_enable(true);
    tdm_cuda_flash_wide(TDM_CUDA_FLASH_WIDE_ALL);
    tdm_cuda_flash_tf32x3(true);
    const double f = 2.0 * (double)(B * H) * (double)(T * T) * (double)(C / H);
    char how[80] = "unfused";
    if (fused && dt == TDM_F32)
        snprintf(how, sizeof how, "fused, %s",
                 tf32x3 ? "3xTF32 on the tensor cores" : "on the CUDA cores");
    else if (fused)
        snprintf(how, sizeof how, "fused, 128-row blocks in: %s%s%s%s",
                 wide & TDM_CUDA_FLASH_WIDE_FWD ? "forward " : "",
                 wide & TDM_CUDA_FLASH_WIDE_DQ ? "dQ " : "",
                 wide & TDM_CUDA_FLASH_WIDE_DKV ? "dK/dV " : "", wide ? "" : "none");
    if (rc)
        printf("attention %s %s: %s\n", tdm_dtype_name(dt), fused ? "fused" : "unfused",
               tdm_last_error());
    else
        printf("attention B8 T1024 H12 hs64 %s %s: forward %.2f ms (%.1f TFLOP/s), backward "
               "%.2f ms (%.1f TFLOP/s)\n",
               tdm_dtype_name(dt), how, tf * 1e3, f / tf * 1e-12, tb * 1e3, 2.5 * f / tb * 1e-12);
    tdm_tensor_free(q32), tdm_tensor_free(d32), tdm_tensor_free(qkv), tdm_tensor_free(dy);
    tdm_tensor_free(y), tdm_tensor_free(g), tdm_tensor_free(lse);
}

/* GB/s of a device-to-device copy of n bytes (read and written counted): the ceiling of the
 * memory-bound kernels below. */
static double copy_bandwidth(size_t n) {
    tdm_tensor *a = tdm_zeros(TDM_SHAPE((int64_t)(n / 4)), TDM_F32, G);
    tdm_tensor *b = tdm_zeros(TDM_SHAPE((int64_t)(n / 4)), TDM_F32, G);
    double t = 0;
    int rc = a && b ? 0 : -1;
    TIME_MEDIAN(t, 4, rc, GPU->copy(b, a));
    tdm_tensor_free(a), tdm_tensor_free(b);
    return rc ? 0 : 2.0 * (double)n / t * 1e-9;
}

/* GPT-2 small's layer norm in a bf16 step (x: the f32 residual stream [8192, 768], r: a bf16
 * branch output, y: bf16): s = x + r and y = LN(s) in one kernel, and as the add then the
 * norm; the backward from a bf16 gy with the stream's gradient added (gres) and the weight and
 * bias gradients. Each against the fewest bytes it must move. */
static void bench_layer_norm(void) {
    const int64_t R = 8192, C = 768;
    tdm_tensor *x = tdm_randn(TDM_SHAPE(R, C), 0, 1, G, NULL);
    tdm_tensor *r32 = tdm_randn(TDM_SHAPE(R, C), 0, 1, G, NULL), *r = tdm_cast(r32, TDM_BF16);
    tdm_tensor *w = tdm_randn(TDM_SHAPE(C), 1, 0.1f, G, NULL);
    tdm_tensor *b = tdm_randn(TDM_SHAPE(C), 0, 0.1f, G, NULL);
    tdm_tensor *s = tdm_tensor_alloc(TDM_SHAPE(R, C), TDM_F32, G);
    tdm_tensor *y = tdm_tensor_alloc(TDM_SHAPE(R, C), TDM_BF16, G);
    tdm_tensor *m = tdm_tensor_alloc(TDM_SHAPE(R), TDM_F32, G);
    tdm_tensor *rs = tdm_tensor_alloc(TDM_SHAPE(R), TDM_F32, G);
    tdm_tensor *gx = tdm_tensor_alloc(TDM_SHAPE(R, C), TDM_F32, G);
    tdm_tensor *gw = tdm_tensor_alloc(TDM_SHAPE(C), TDM_F32, G);
    tdm_tensor *gb = tdm_tensor_alloc(TDM_SHAPE(C), TDM_F32, G);
    int rc = x && r && w && b && s && y && m && rs && gx && gw && gb ? 0 : -1;
    double n = (double)(R * C), bw = copy_bandwidth((size_t)1 << 30);
    for (int warps = 1; warps >= 0; warps--) { /* a warp a row (the default), a block a row */
        double tf = 0, tu = 0, tb = 0;
        tdm_cuda_layer_norm_warps(warps);
        TIME_MEDIAN(tf, 20, rc, GPU->layer_norm(y, m, rs, x, w, b, 1e-5f, r, s));
        TIME_MEDIAN(tu, 20, rc,
                    GPU->binary(TDM_BIN_ADD, s, x, r) ||
                        GPU->layer_norm(y, m, rs, s, w, b, 1e-5f, NULL, NULL));
        /* gy: y's buffer, gres: x's */
        TIME_MEDIAN(tb, 20, rc, GPU->layer_norm_backward(gx, gw, gb, y, s, w, m, rs, x));
        tdm_cuda_layer_norm_warps(true);
        if (rc) {
            printf("layer norm: %s\n", tdm_last_error());
            break;
        }
        /* bytes: x 4 + r 2 in, s 4 + y 2 out; unfused, s read again; backward: gy 2, s 4,
         * gres 4 in, gx 4 out */
        printf("layer norm 8192x768 (a row a %s), f32 stream, bf16 branch and output: add folded "
               "in %.1f us (%.0f GB/s), add then norm %.1f us (%.0f GB/s of the fused bytes); "
               "backward with gres, gw, gb %.1f us (%.0f GB/s); copy %.0f GB/s\n",
               warps ? "warp" : "block", tf * 1e6, 12 * n / tf * 1e-9, tu * 1e6, 12 * n / tu * 1e-9,
               tb * 1e6, 14 * n / tb * 1e-9, bw);
    }
    tdm_tensor *all[] = {x, r32, r, w, b, s, y, m, rs, gx, gw, gb};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) tdm_tensor_free(all[i]);
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
    /* bf16: every kernel's 128-row blocks, none, and all but dQ's, all but dK/dV's (the
     * backward's two kernels apart; the forward is alone in its column) */
    const unsigned all = TDM_CUDA_FLASH_WIDE_ALL;
    const unsigned wide[] = {all, 0, all & ~TDM_CUDA_FLASH_WIDE_DQ, all & ~TDM_CUDA_FLASH_WIDE_DKV};
    for (int i = 0; i < 4; i++) bench_attention(TDM_BF16, true, wide[i], true);
    bench_attention(TDM_F32, true, all, true);
    bench_attention(TDM_F32, true, all, false);
    bench_attention(TDM_BF16, false, all, true);
    bench_attention(TDM_F32, false, all, true);
    bench_layer_norm();
    return 0;
}
#endif
