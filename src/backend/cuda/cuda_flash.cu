/* Fused causal attention: FlashAttention-2's tiling and online softmax, forward and backward,
 * for the heads that fit (cuda_attention.cu sends the rest to its unfused path).
 *
 * No T x T scores reach memory and the tiles above the diagonal are never computed: a block
 * takes FA_BR query rows of one head and walks the key tiles up to its diagonal. bf16 and f16
 * run on the tensor cores through mma.sync with the scores and sums in registers
 * (cuda_flash_mma.cu). This file holds the dispatch, D = rowsum(dy * y) for every dtype and
 * the f32 kernels, which keep their tiles of scores, row statistics and sums in shared memory
 * (products on the CUDA cores in a register tile a thread; no TF32, as PyTorch's default).
 * Every softmax sum is f32, and P and dS are rounded to the dtype for the products that take
 * them, as the unfused path and PyTorch's flash kernels round them.
 *
 *   forward   per key tile j <= i: S = scale Q K_j^T; m' = max(m, rowmax S);
 *             P = exp(S - m'); l = l exp(m - m') + rowsum P; O = O exp(m - m') + P V_j;
 *             at the end y = O / l and lse = m + log l
 *   backward  D = rowsum(dy * y) first; then per key tile j, over query
 *             tiles i >= j: P = exp(scale Q_i K_j^T - lse), dP = dy_i V_j^T,
 *             dS = P (dP - D), dV_j += P^T dy_i, dK_j += scale dS^T Q_i; and in a second
 *             kernel per query tile i, over key tiles j <= i: dQ_i += scale dS K_j
 * FlashAttention-2 adds dQ up with atomics from the first kernel; a second kernel that
 * computes S and dP again costs two products of the seven but keeps every sum in a fixed
 * order, so a run gives the same bits every time, as the rest of the backend does. */
#include "backend/cuda/cuda_flash.cuh"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The f32 forward's S and O rows take 4 floats more, P's 8 elements: rows 64 floats apart
 * would put a column of every row in one bank, and its softmax reads a column of 16 rows */
#define FA_SLD (FA_BC + 4)
#define FA_PLD (FA_BC + 8)

/* ---- tile products ------------------------------------------------------------------------ */

/* f32 on the CUDA cores: thread t takes rows [4 (t / 8), + 4) and columns [NC (t % 8), + NC)
 * of c [64, 8 NC], its 4 x NC sums in registers over k (fa_mm's contract). */
template <int NC, bool TA, bool TB>
__device__ void fa_mm_f32(float *c, int ldc, const float *a, int lda, const float *b, int ldb,
                          int K, bool acc) {
    const int r0 = threadIdx.x / 8 * 4, c0 = threadIdx.x % 8 * NC;
    float s[4][NC];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NC; j++) s[i][j] = acc ? c[(r0 + i) * ldc + c0 + j] : 0.0f;
    for (int k = 0; k < K; k++) {
        float av[4], bv[NC];
#pragma unroll
        for (int i = 0; i < 4; i++) av[i] = TA ? a[k * lda + r0 + i] : a[(r0 + i) * lda + k];
#pragma unroll
        for (int j = 0; j < NC; j++) bv[j] = TB ? b[(c0 + j) * ldb + k] : b[k * ldb + c0 + j];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < NC; j++) s[i][j] += av[i] * bv[j];
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NC; j++) c[(r0 + i) * ldc + c0 + j] = s[i][j];
}

/* c [M, N] (f32, row-major, ldc) = op(a) op(b) (+ c where acc), from shared memory, by the
 * whole block on the CUDA cores, a register tile a thread: op(a) [M, K] is a (row-major, lda)
 * or, where TA, the transpose of a [K, M]; op(b) [K, N] likewise. M is 64; N and K are
 * multiples of 16 (N at most 128). The caller synchronises after. */
template <bool TA, bool TB>
__device__ void fa_mm(float *c, int ldc, const float *a, int lda, const float *b, int ldb, int M,
                      int N, int K, bool acc) {
    switch (N / 8) {
    case 2:
        fa_mm_f32<2, TA, TB>(c, ldc, a, lda, b, ldb, K, acc);
        break;
    case 4:
        fa_mm_f32<4, TA, TB>(c, ldc, a, lda, b, ldb, K, acc);
        break;
    case 6:
        fa_mm_f32<6, TA, TB>(c, ldc, a, lda, b, ldb, K, acc);
        break;
    case 8:
        fa_mm_f32<8, TA, TB>(c, ldc, a, lda, b, ldb, K, acc);
        break;
    case 10:
        fa_mm_f32<10, TA, TB>(c, ldc, a, lda, b, ldb, K, acc);
        break;
    case 12:
        fa_mm_f32<12, TA, TB>(c, ldc, a, lda, b, ldb, K, acc);
        break;
    case 14:
        fa_mm_f32<14, TA, TB>(c, ldc, a, lda, b, ldb, K, acc);
        break;
    default:
        fa_mm_f32<16, TA, TB>(c, ldc, a, lda, b, ldb, K, acc);
        break;
    }
}

/* ---- shared memory ------------------------------------------------------------------------ */

/* Bytes each kernel carves below (the same order and sizes). */
static size_t fa_smem_fwd(int64_t hs, int ld, size_t es) {
    return 3 * fa_round(FA_BR * ld * es) + fa_round(FA_BR * FA_SLD * 4) +
           fa_round(FA_BR * FA_PLD * es) + fa_round(FA_BR * (hs + 4) * 4) +
           2 * fa_round(FA_BR * 4) + 2 * fa_round(FA_THREADS * 4);
}
/* The backward's shared memory: the mma.sync kernels' in bf16 and f16 (cuda_flash_mma.cu),
 * the kernels below in f32. */
static size_t fa_smem_dkv(int64_t hs, int ld, size_t es) {
    if (es == 2) return fa_mma_smem_dkv(ld, es);
    return 4 * fa_round(FA_BR * ld * es) + 2 * fa_round(FA_BR * FA_BC * 4) +
           2 * fa_round(FA_BR * FA_BC * es) + 2 * fa_round(FA_BC * hs * 4) +
           2 * fa_round(FA_BR * 4);
}
static size_t fa_smem_dq(int64_t hs, int ld, size_t es) {
    if (es == 2) return fa_mma_smem_dq(ld, es);
    return 4 * fa_round(FA_BR * ld * es) + 2 * fa_round(FA_BR * FA_BC * 4) +
           fa_round(FA_BR * FA_BC * es) + fa_round(FA_BR * hs * 4) + 2 * fa_round(FA_BR * 4);
}

/* ---- forward ------------------------------------------------------------------------------ */

/* f32 (bf16 and f16: cuda_flash_mma.cu). One block: query tile i of head h of batch row b,
 * the last tiles (the most work) first. */
__global__ void fa_fwd_kernel(const float *qkv, float *y, float *lse, fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, i = nt - 1 - blockIdx.x % nt;
    const int64_t bh = blockIdx.x / nt, b = bh / g.nh, h = bh % g.nh, q0 = i * FA_BR;
    const int hs = (int)g.hs, old = hs + 4, tid = threadIdx.x; /* old: O's row in floats */
    fa_carve cv = {fa_smem, 0};
    float *Q = fa_take<float>(&cv, FA_BR * g.ld), *K = fa_take<float>(&cv, FA_BR * g.ld);
    float *V = fa_take<float>(&cv, FA_BR * g.ld);
    float *S = fa_take<float>(&cv, FA_BR * FA_SLD);
    float *P = fa_take<float>(&cv, FA_BR * FA_PLD);
    float *O = fa_take<float>(&cv, FA_BR * old), *m = fa_take<float>(&cv, FA_BR);
    float *l = fa_take<float>(&cv, FA_BR), *rmax = fa_take<float>(&cv, FA_THREADS);
    float *rsum = fa_take<float>(&cv, FA_THREADS);
    const float *head = qkv + b * g.T * 3 * g.C + h * g.hs;
    fa_load(Q, head, 3 * g.C, q0, g);
    for (int e = tid; e < FA_BR * old; e += FA_THREADS) O[e] = 0.0f;
    if (tid < FA_BR) m[tid] = -INFINITY, l[tid] = 0.0f;
    /* two threads a row of the tile, each every other key and output column (with the padded
     * rows, a warp's 16 rows fall in distinct banks but for pairs) */
    const int r = tid / 2, half = tid % 2;
    for (int64_t j = 0; j <= i; j++) {
        const int64_t k0 = j * FA_BC;
        __syncthreads(); /* the last tile's products are done with K, V and P */
        fa_load(K, head + g.C, 3 * g.C, k0, g);
        fa_load(V, head + 2 * g.C, 3 * g.C, k0, g);
        __syncthreads();
        fa_mm<false, true>(S, FA_SLD, Q, g.ld, K, g.ld, FA_BR, FA_BC, hs, false);
        __syncthreads();
        const int64_t q = q0 + r;
        float mx = -INFINITY;
        for (int c = half; c < FA_BC; c += 2) {
            const int64_t k = k0 + c;
            float s = k <= q && k < g.T ? S[r * FA_SLD + c] * g.scale : -INFINITY;
            S[r * FA_SLD + c] = s, mx = fmaxf(mx, s);
        }
        rmax[tid] = mx;
        __syncthreads();
        const float m_old = m[r], m_new = fmaxf(m_old, fmaxf(rmax[2 * r], rmax[2 * r + 1]));
        const float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
        float sum = 0.0f;
        for (int c = half; c < FA_BC; c += 2) {
            float s = S[r * FA_SLD + c], p = s == -INFINITY ? 0.0f : expf(s - m_new);
            P[r * FA_PLD + c] = p, sum += p;
        }
        for (int d = half; d < hs; d += 2) O[r * old + d] *= alpha;
        rsum[tid] = sum;
        __syncthreads(); /* every thread has read m[r] */
        if (half == 0) m[r] = m_new, l[r] = l[r] * alpha + rsum[2 * r] + rsum[2 * r + 1];
        fa_mm<false, false>(O, old, P, FA_PLD, V, g.ld, FA_BR, hs, FA_BC, true);
    }
    __syncthreads();
    float *yh = y + b * g.T * g.C + h * g.hs;
    for (int e = tid; e < FA_BR * hs; e += FA_THREADS) {
        const int rr = e / hs, d = e % hs;
        if (q0 + rr < g.T) yh[(q0 + rr) * g.C + d] = O[rr * old + d] / l[rr];
    }
    if (tid < FA_BR && q0 + tid < g.T) lse[bh * g.T + q0 + tid] = m[tid] + logf(l[tid]);
}

/* ---- backward ----------------------------------------------------------------------------- */

/* D [B, nh, T] = rowsum(dy * y) over each head's columns: a row's hs / per adjacent threads
 * take 16 bytes (per elements) each, one load of dy's and one of y's where both are 16-byte
 * aligned (vec; else the same elements one by one), and the row's first thread adds their
 * sums in thread order: a fixed order, and a warp reads whole rows. */
template <typename E>
__global__ void fa_delta_kernel(float *D, const E *dy, const E *y, fa_geom g, bool vec) {
    __shared__ float part[CU_THREADS];
    constexpr int per = sizeof(fa_vec) / sizeof(E);
    const int tpr = (int)g.hs / per, rows = CU_THREADS / tpr; /* threads a row, rows a block */
    const int lr = threadIdx.x / tpr, c = threadIdx.x % tpr;
    const int64_t n = g.B * g.nh * g.T;
    for (int64_t r0 = (int64_t)blockIdx.x * rows; r0 < n; r0 += (int64_t)gridDim.x * rows) {
        const int64_t row = r0 + lr;
        const bool mine = lr < rows && row < n;
        float s = 0.0f;
        if (mine) {
            const int64_t t = row % g.T, bh = row / g.T, b = bh / g.nh, h = bh % g.nh;
            const int64_t off = (b * g.T + t) * g.C + h * g.hs + c * per;
            fa_vec va, vw; /* 16-byte aligned, as the vector loads need */
            E *a = (E *)&va, *w = (E *)&vw;
            if (vec) {
                va = *(const fa_vec *)(dy + off);
                vw = *(const fa_vec *)(y + off);
            } else {
                for (int k = 0; k < per; k++) a[k] = dy[off + k], w[k] = y[off + k];
            }
            for (int k = 0; k < per; k++) s += cu_ld(a[k]) * cu_ld(w[k]);
        }
        part[threadIdx.x] = s;
        __syncthreads();
        if (mine && c == 0) {
            float d = 0.0f;
            for (int j = 0; j < tpr; j++) d += part[lr * tpr + j];
            D[row] = d;
        }
        __syncthreads(); /* part is rewritten next round */
    }
}

/* P = exp(scale S - lse) on and below the diagonal (0 elsewhere) and dS = P (dP - D), of query
 * tile q0 against key tile k0, by the block; P into Pt where non-NULL. */
__device__ void fa_dscores(float *Pt, float *dSt, const float *S, const float *dP,
                           const float *lse_s, const float *D_s, int64_t q0, int64_t k0,
                           fa_geom g) {
    for (int e = threadIdx.x; e < FA_BR * FA_BC; e += FA_THREADS) {
        const int r = e / FA_BC, c = e % FA_BC;
        const int64_t q = q0 + r, k = k0 + c;
        const float p = k <= q && q < g.T ? expf(S[e] * g.scale - lse_s[r]) : 0.0f;
        if (Pt) Pt[e] = p;
        dSt[e] = p * (dP[e] - D_s[r]);
    }
}

/* One block: key tile j of a head, over the query tiles from its diagonal on: dK and dV, their
 * sums in shared memory (f32; bf16 and f16: cuda_flash_mma.cu). */
__global__ void fa_dkv_kernel(float *dqkv, const float *dy, const float *qkv, const float *lse,
                              const float *D, fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, j = blockIdx.x % nt, bh = blockIdx.x / nt;
    const int64_t b = bh / g.nh, h = bh % g.nh, k0 = j * FA_BC;
    const int hs = (int)g.hs;
    fa_carve cv = {fa_smem, 0};
    float *K = fa_take<float>(&cv, FA_BR * g.ld), *V = fa_take<float>(&cv, FA_BR * g.ld);
    float *Q = fa_take<float>(&cv, FA_BR * g.ld), *dO = fa_take<float>(&cv, FA_BR * g.ld);
    float *S = fa_take<float>(&cv, FA_BR * FA_BC), *dP = fa_take<float>(&cv, FA_BR * FA_BC);
    float *P = fa_take<float>(&cv, FA_BR * FA_BC), *dS = fa_take<float>(&cv, FA_BR * FA_BC);
    float *dK = fa_take<float>(&cv, FA_BC * hs), *dV = fa_take<float>(&cv, FA_BC * hs);
    float *lse_s = fa_take<float>(&cv, FA_BR), *D_s = fa_take<float>(&cv, FA_BR);
    const int64_t row3 = 3 * g.C, off = b * g.T * row3 + h * g.hs;
    const float *head = qkv + off, *dyh = dy + b * g.T * g.C + h * g.hs;
    fa_load(K, head + g.C, row3, k0, g);
    fa_load(V, head + 2 * g.C, row3, k0, g);
    for (int e = threadIdx.x; e < FA_BC * hs; e += FA_THREADS) dK[e] = dV[e] = 0.0f;
    for (int64_t i = j; i < nt; i++) {
        const int64_t q0 = i * FA_BR;
        __syncthreads(); /* the last tile's products are done with Q, dO, P and dS */
        fa_load(Q, head, row3, q0, g);
        fa_load(dO, dyh, g.C, q0, g);
        fa_load_rows(lse_s, D_s, lse + bh * g.T, D + bh * g.T, q0, g);
        __syncthreads();
        fa_mm<false, true>(S, FA_BC, Q, g.ld, K, g.ld, FA_BR, FA_BC, hs, false);
        fa_mm<false, true>(dP, FA_BC, dO, g.ld, V, g.ld, FA_BR, FA_BC, hs, false);
        __syncthreads();
        fa_dscores(P, dS, S, dP, lse_s, D_s, q0, k0, g);
        __syncthreads();
        fa_mm<true, false>(dV, hs, P, FA_BC, dO, g.ld, FA_BC, hs, FA_BR, true);
        fa_mm<true, false>(dK, hs, dS, FA_BC, Q, g.ld, FA_BC, hs, FA_BR, true);
    }
    __syncthreads(); /* every product is done with dK and dV */
    float *gh = dqkv + off;
    for (int e = threadIdx.x; e < FA_BC * hs; e += FA_THREADS) {
        const int r = e / hs, d = e % hs;
        if (k0 + r >= g.T) continue;
        gh[(k0 + r) * row3 + g.C + d] = dK[e] * g.scale;
        gh[(k0 + r) * row3 + 2 * g.C + d] = dV[e];
    }
}

/* One block: query tile i of a head, over the key tiles up to its diagonal: dQ, its sum in
 * shared memory (as fa_dkv_kernel). */
__global__ void fa_dq_kernel(float *dqkv, const float *dy, const float *qkv, const float *lse,
                             const float *D, fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, i = nt - 1 - blockIdx.x % nt;
    const int64_t bh = blockIdx.x / nt, b = bh / g.nh, h = bh % g.nh, q0 = i * FA_BR;
    const int hs = (int)g.hs;
    fa_carve cv = {fa_smem, 0};
    float *Q = fa_take<float>(&cv, FA_BR * g.ld), *dO = fa_take<float>(&cv, FA_BR * g.ld);
    float *K = fa_take<float>(&cv, FA_BR * g.ld), *V = fa_take<float>(&cv, FA_BR * g.ld);
    float *S = fa_take<float>(&cv, FA_BR * FA_BC), *dP = fa_take<float>(&cv, FA_BR * FA_BC);
    float *dS = fa_take<float>(&cv, FA_BR * FA_BC);
    float *dQ = fa_take<float>(&cv, FA_BR * hs), *lse_s = fa_take<float>(&cv, FA_BR);
    float *D_s = fa_take<float>(&cv, FA_BR);
    const int64_t row3 = 3 * g.C, off = b * g.T * row3 + h * g.hs;
    const float *head = qkv + off;
    fa_load(Q, head, row3, q0, g);
    fa_load(dO, dy + b * g.T * g.C + h * g.hs, g.C, q0, g);
    fa_load_rows(lse_s, D_s, lse + bh * g.T, D + bh * g.T, q0, g);
    for (int e = threadIdx.x; e < FA_BR * hs; e += FA_THREADS) dQ[e] = 0.0f;
    for (int64_t j = 0; j <= i; j++) {
        const int64_t k0 = j * FA_BC;
        __syncthreads(); /* the last tile's product is done with K and dS */
        fa_load(K, head + g.C, row3, k0, g);
        fa_load(V, head + 2 * g.C, row3, k0, g);
        __syncthreads();
        fa_mm<false, true>(S, FA_BC, Q, g.ld, K, g.ld, FA_BR, FA_BC, hs, false);
        fa_mm<false, true>(dP, FA_BC, dO, g.ld, V, g.ld, FA_BR, FA_BC, hs, false);
        __syncthreads();
        fa_dscores(NULL, dS, S, dP, lse_s, D_s, q0, k0, g);
        __syncthreads();
        fa_mm<false, false>(dQ, hs, dS, FA_BC, K, g.ld, FA_BR, hs, FA_BC, true);
    }
    __syncthreads(); /* every product is done with dQ */
    float *gh = dqkv + off;
    for (int e = threadIdx.x; e < FA_BR * hs; e += FA_THREADS) {
        const int r = e / hs, d = e % hs;
        if (q0 + r < g.T) gh[(q0 + r) * row3 + d] = dQ[e] * g.scale;
    }
}

/* ---- host --------------------------------------------------------------------------------- */

static fa_geom fa_geom_of(const tdm_tensor *qkv, int n_head) {
    const int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3, hs = C / n_head;
    return fa_geom{B, T, C, n_head, hs, 1.0f / sqrtf((float)hs), (int)hs + FA_PAD};
}

/* The most shared memory a block of this device may take (the opt-in limit). */
static int fa_smem_limit(int index) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, index) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return v;
}

/* The device's compute capability's major number (0 when it cannot be read). */
static int fa_cc_major(int index) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, index) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return v;
}

/* TANDEM_FLASH_ATTENTION=0 in the environment starts it off (for measuring one path against
 * the other: scripts/gpu-check) */
static bool fa_enabled = true;
static pthread_once_t fa_env_once = PTHREAD_ONCE_INIT;

static void fa_read_env(void) {
    const char *e = getenv("TANDEM_FLASH_ATTENTION");
    if (e && !strcmp(e, "0")) __atomic_store_n(&fa_enabled, false, __ATOMIC_RELAXED);
}

extern "C" void tdm_cuda_flash_enable(bool on) {
    pthread_once(&fa_env_once, fa_read_env);
    __atomic_store_n(&fa_enabled, on, __ATOMIC_RELAXED);
}

extern "C" bool tdm_cuda_flash_fits(const tdm_tensor *qkv, int n_head) {
    pthread_once(&fa_env_once, fa_read_env);
    if (!__atomic_load_n(&fa_enabled, __ATOMIC_RELAXED)) return false;
    const fa_geom g = fa_geom_of(qkv, n_head);
    const size_t es = tdm_dtype_size(qkv->dtype);
    /* the backward's blocks take the most */
    /* bf16 and f16 products take sm_80's tensor-core instructions */
    return g.hs % 16 == 0 && g.hs <= 128 && g.B * g.nh * ((g.T + FA_BR - 1) / FA_BR) <= INT32_MAX &&
           (es == 4 || fa_cc_major(qkv->device.index) >= 8) &&
           fa_smem_dkv(g.hs, g.ld, es) <= (size_t)fa_smem_limit(qkv->device.index);
}

/* Launches kernel k with smem bytes of shared memory (over the 48 KiB a launch gets unasked). */
template <typename K> static int fa_launch_check(K *k, size_t smem, const char *what, int idx) {
    return cu_check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                    what, idx);
}

template <typename E>
static int fa_forward(cu_device *d, int idx, tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv,
                      fa_geom g) {
    if constexpr (sizeof(E) == 2) {
        return fa_mma_forward<E>(d, idx, cu_p<E>(y), cu_f(lse), cu_p<E>(qkv), g);
    } else {
        const size_t smem = fa_smem_fwd(g.hs, g.ld, sizeof(E));
        const unsigned blocks = (unsigned)(g.B * g.nh * ((g.T + FA_BR - 1) / FA_BR));
        if (fa_launch_check(fa_fwd_kernel, smem, "flash attention", idx)) return tdm_last_status();
        fa_fwd_kernel<<<blocks, FA_THREADS, smem, d->compute>>>(cu_f(qkv), cu_f(y), cu_f(lse), g);
        return cu_check_launch("flash attention", idx);
    }
}

/* The f32 backward's two kernels, their sums in shared memory. */
static int fa_backward_f32(cu_device *d, int idx, float *gq, const float *gy, const float *x,
                           const float *lse, const float *D, fa_geom g) {
    const size_t s_kv = fa_smem_dkv(g.hs, g.ld, 4), s_q = fa_smem_dq(g.hs, g.ld, 4);
    const unsigned blocks = (unsigned)(g.B * g.nh * ((g.T + FA_BR - 1) / FA_BR));
    const char *what = "flash attention_backward";
    if (fa_launch_check(fa_dkv_kernel, s_kv, what, idx)) return tdm_last_status();
    fa_dkv_kernel<<<blocks, FA_THREADS, s_kv, d->compute>>>(gq, gy, x, lse, D, g);
    if (cu_check_launch("flash attention_backward (dk, dv)", idx)) return tdm_last_status();
    if (fa_launch_check(fa_dq_kernel, s_q, what, idx)) return tdm_last_status();
    fa_dq_kernel<<<blocks, FA_THREADS, s_q, d->compute>>>(gq, gy, x, lse, D, g);
    return cu_check_launch("flash attention_backward (dq)", idx);
}

template <typename E>
static int fa_backward(cu_device *d, int idx, tdm_tensor *dqkv, const tdm_tensor *dy,
                       const tdm_tensor *qkv, const tdm_tensor *y, const tdm_tensor *lse,
                       fa_geom g) {
    tdm_storage *hold;
    float *D = (float *)cu_scratch(idx, (size_t)(g.B * g.nh * g.T) * 4, &hold);
    if (!D) return tdm_last_status();
    E *gq = cu_p<E>(dqkv);
    const E *gy = cu_p<E>(dy), *x = cu_p<E>(qkv);
    const bool vec = (uintptr_t)gy % sizeof(fa_vec) == 0 &&
                     (uintptr_t)cu_p<E>(y) % sizeof(fa_vec) == 0; /* rows keep it: fa_load */
    const int64_t rows = CU_THREADS / (g.hs / (int64_t)(sizeof(fa_vec) / sizeof(E)));
    fa_delta_kernel<E><<<cu_blocks((g.B * g.nh * g.T + rows - 1) / rows * CU_THREADS), CU_THREADS,
                         0, d->compute>>>(D, gy, cu_p<E>(y), g, vec);
    int rc = cu_check_launch("flash attention_backward (D)", idx);
    if (!rc) {
        if constexpr (sizeof(E) == 2)
            rc = fa_mma_backward<E>(d, idx, gq, gy, x, cu_f(lse), D, g);
        else
            rc = fa_backward_f32(d, idx, gq, gy, x, cu_f(lse), D, g);
    }
    tdm_storage_release(hold); /* in stream order: the kernels above run first */
    return rc;
}

/* The callers (cuda_attention.cu) checked the geometry and dtypes and that the heads fit. */
extern "C" int tdm_cuda_flash_attention(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv,
                                        int n_head) {
    cu_device *d = cu_dev_of(qkv, "flash attention");
    if (!d) return tdm_last_status();
    return CU_DISPATCH(qkv->dtype, fa_forward, d, qkv->device.index, y, lse, qkv,
                       fa_geom_of(qkv, n_head));
}

extern "C" int tdm_cuda_flash_attention_backward(tdm_tensor *dqkv, const tdm_tensor *dy,
                                                 const tdm_tensor *qkv, const tdm_tensor *y,
                                                 const tdm_tensor *lse, int n_head) {
    cu_device *d = cu_dev_of(qkv, "flash attention_backward");
    if (!d) return tdm_last_status();
    return CU_DISPATCH(qkv->dtype, fa_backward, d, qkv->device.index, dqkv, dy, qkv, y, lse,
                       fa_geom_of(qkv, n_head));
}
