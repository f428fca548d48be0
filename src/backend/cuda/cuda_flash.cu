/* Fused causal attention: FlashAttention-2's tiling and online softmax, forward and backward,
 * for the heads that fit (cuda_attention.cu sends the rest to its unfused path).
 *
 * No T x T scores reach memory and the tiles above the diagonal are never computed: a block
 * takes FA_BR query rows of one head and walks the key tiles up to its diagonal, each of its
 * four warps owning 16 of the rows and all of their work. bf16 and f16 run on the tensor cores
 * through mma.sync (cuda_flash_mma.cu; there the blocks take 128 rows, 32 a warp, where heads
 * are up to 64), and so does f32 on sm_80, sm_90 and sm_100 at heads up to 64, each product as
 * three TF32 products (PyTorch's memory-efficient attention's fp32 arithmetic;
 * tdm_cuda_flash_tf32x3). This file holds the dispatch, D = rowsum(dy * y) for every dtype and the
 * f32 kernels for the rest, whose products run on the CUDA cores in f32: the scores, the row
 * statistics and the sums sit in registers, a tile of P (or dS) goes through the warp's own rows of
 * shared memory to become the next product's operand, and every shared-memory read of the products
 * is conflict-free (fa32_dot, fa32_acc). Every softmax
 * sum is f32, and in bf16 and f16 P and dS are rounded to the dtype for the products that take
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
 * order, so a run gives the same bits every time, as the rest of the backend does.
 * Exponentials are base 2 (scores scaled by scale log2(e), lse converted in and out). */
#include "backend/cuda/cuda_flash.cuh"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

/* ---- the f32 products: the CUDA cores, a register tile a thread ----------------------------
 * Warp w owns rows [16w, 16w + 16) of the block's 64; lane 8 tr + tc holds rows tr + 4i (i < 4)
 * of them. The Q, K, V and dy tiles' rows are hs + 4 floats apart (4 more than a multiple of
 * 8): 4 consecutive rows' float4 at one k (A's rows, one i) or 8 rows' (B's, one j) then fall in
 * distinct banks. P and dS rows are 8 more than a multiple of 32 apart (FA_PLD32, FA_PLD32_HALF):
 * the warp's stores of 4 rows of 8 consecutive columns and its float4 loads of 4 rows at one k
 * fall in distinct banks too. */
#define FA_PLD32      (FA_BC + 8)
#define FA_PLD32_HALF (FA_BC / 2 + 8)

/* c[i][j] = sum over k < K of a[(tr + 4i) ld + k] b[(tc + 8j) ld + k] (K a multiple of 4): a at
 * the warp's first row, b at the first of 8 NJ rows (column tc + 8j of c is row tc + 8j of b). */
template <int NJ>
__device__ __forceinline__ void fa32_dot(float c[4][NJ], const float *a, const float *b, int ld,
                                         int K) {
    const int lane = threadIdx.x % 32, tr = lane / 8, tc = lane % 8;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++) c[i][j] = 0.0f;
    for (int k = 0; k < K; k += 4) {
        float4 av[4], bv[NJ];
#pragma unroll
        for (int i = 0; i < 4; i++) av[i] = *(const float4 *)(a + (tr + 4 * i) * ld + k);
#pragma unroll
        for (int j = 0; j < NJ; j++) bv[j] = *(const float4 *)(b + (tc + 8 * j) * ld + k);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                float v = c[i][j];
                v = fmaf(av[i].x, bv[j].x, v);
                v = fmaf(av[i].y, bv[j].y, v);
                v = fmaf(av[i].z, bv[j].z, v);
                c[i][j] = fmaf(av[i].w, bv[j].w, v);
            }
    }
}

/* Element e (0 to 3, known when unrolled) of v. */
__device__ __forceinline__ float fa32_at(float4 v, int e) {
    return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

/* c[i][2n + e] += sum over k < K of p[(tr + 4i) ldp + k] b[k ld + 2tc + 16n + e] (n < NC / 2,
 * e < 2; K a multiple of 4): p at the warp's first row of P or dS, b at the first of K rows of a
 * tile (the product's k), whose columns a thread reads in pairs. */
template <int NC>
__device__ __forceinline__ void fa32_acc(float c[4][NC], const float *p, int ldp, const float *b,
                                         int ld, int K) {
    const int lane = threadIdx.x % 32, tr = lane / 8, tc = lane % 8;
    for (int k = 0; k < K; k += 4) {
        float4 pv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) pv[i] = *(const float4 *)(p + (tr + 4 * i) * ldp + k);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float *br = b + (k + e) * ld + 2 * tc;
#pragma unroll
            for (int n = 0; n < NC / 2; n++) {
                const float2 bv = *(const float2 *)(br + 16 * n);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    c[i][2 * n] = fmaf(fa32_at(pv[i], e), bv.x, c[i][2 * n]);
                    c[i][2 * n + 1] = fmaf(fa32_at(pv[i], e), bv.y, c[i][2 * n + 1]);
                }
            }
        }
    }
}

/* The thread's elements of c [16, 8 NJ] (rows tr + 4i, columns tc + 8j) into the warp's rows of a
 * P or dS tile at p (row stride ldp). */
template <int NJ>
__device__ __forceinline__ void fa32_put(float *p, int ldp, const float c[4][NJ]) {
    const int lane = threadIdx.x % 32, tr = lane / 8, tc = lane % 8;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++) p[(tr + 4 * i) * ldp + tc + 8 * j] = c[i][j];
}

/* The thread's elements of c [16, 8 NC] (fa32_acc's layout) times scale into out (row stride
 * rs), the warp's first row being `first`; rows at or past T left out. */
template <int NC>
__device__ __forceinline__ void fa32_store(float *out, int64_t rs, const float c[4][NC],
                                           int64_t first, float scale, int64_t T) {
    const int lane = threadIdx.x % 32, tr = lane / 8, tc = lane % 8;
    const bool pairs = (uintptr_t)out % 8 == 0 && rs % 2 == 0; /* 8-byte stores */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int64_t row = first + tr + 4 * i;
        if (row >= T) continue;
        float *o = out + row * rs + 2 * tc;
#pragma unroll
        for (int n = 0; n < NC / 2; n++) {
            const float lo = c[i][2 * n] * scale, hi = c[i][2 * n + 1] * scale;
            if (pairs) {
                *(float2 *)(o + 16 * n) = make_float2(lo, hi);
            } else {
                o[16 * n] = lo;
                o[16 * n + 1] = hi;
            }
        }
    }
}

/* ---- shared memory ------------------------------------------------------------------------ */

/* Bytes each kernel carves below (the same order and sizes): the f32 kernels' here, the
 * mma.sync kernels' (mma: bf16, f16 and f32 as 3xTF32) in cuda_flash_mma.cu. */
static size_t fa_smem_fwd(fa_geom g, size_t es, bool mma) {
    if (mma) return fa_mma_smem_fwd(g, es);
    return 3 * fa_round(FA_BR * g.ld * 4) + fa_round(FA_BR * FA_PLD32 * 4);
}
static size_t fa_smem_dkv(fa_geom g, size_t es, bool mma) {
    if (mma) return fa_mma_smem_dkv(g, es);
    return 4 * fa_round(FA_BR * g.ld * 4) + 2 * fa_round(FA_BR * 4) +
           2 * fa_round(FA_BR * FA_PLD32_HALF * 4);
}
static size_t fa_smem_dq(fa_geom g, size_t es, bool mma) {
    if (mma) return fa_mma_smem_dq(g, es);
    return 4 * fa_round(FA_BR * g.ld * 4) + fa_round(FA_BR * FA_PLD32 * 4);
}

/* ---- forward ------------------------------------------------------------------------------ */

/* f32, heads of 8 NC. One block: query tile i of head h of batch row b, the last tiles (the
 * most work) first. One K and one V buffer, each refilled without waiting as soon as every warp
 * is done with it (K_j+1 after S, V_j+1 after O += P V_j): a load overlaps half a tile's work,
 * in no more shared memory. */
template <int NC>
__global__ void __launch_bounds__(FA_THREADS)
    fa_fwd_kernel(const float *qkv, float *y, float *lse, fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, i = nt - 1 - blockIdx.x % nt;
    const int64_t bh = blockIdx.x / nt, b = bh / g.nh, h = bh % g.nh, q0 = i * FA_BR;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, tr = lane / 8, tc = lane % 8;
    const float sl = g.scale * FA_LOG2E;
    fa_carve cv = {fa_smem, 0};
    float *Q = fa_take<float>(&cv, FA_BR * g.ld), *K = fa_take<float>(&cv, FA_BR * g.ld);
    float *V = fa_take<float>(&cv, FA_BR * g.ld);
    float *P = fa_take<float>(&cv, FA_BR * FA_PLD32) + w * 16 * FA_PLD32; /* the warp's rows */
    const int64_t rl = 3 * g.C;
    const float *head = qkv + b * g.T * rl + h * g.hs, *Qw = Q + w * 16 * g.ld;
    fa_load_async(K, head + g.C, rl, 0, FA_BC, g); /* on their way while Q loads */
    fa_commit_loads();
    fa_load_async(V, head + 2 * g.C, rl, 0, FA_BC, g);
    fa_commit_loads();
    fa_load(Q, head, rl, q0, FA_BR, g);
    int64_t row[4];
    float o[4][NC] = {}, m[4], l[4];
#pragma unroll
    for (int r = 0; r < 4; r++) row[r] = q0 + w * 16 + tr + 4 * r, m[r] = -INFINITY, l[r] = 0.0f;
    for (int64_t j = 0; j <= i; j++) {
        const int64_t k0 = j * FA_BC;
        fa_wait_loads_but<1>(); /* K_j (V_j, committed after it, may be on its way) */
        __syncthreads();
        float s[4][FA_BC / 8], mx[4];
        fa32_dot<FA_BC / 8>(s, Qw, K, g.ld, (int)g.hs);
        __syncthreads(); /* every warp is done with K_j */
        if (j < i) fa_load_async(K, head + g.C, rl, k0 + FA_BC, FA_BC, g);
        fa_commit_loads(); /* (empty after the last tile: the groups keep their count) */
#pragma unroll
        for (int r = 0; r < 4; r++) {
            mx[r] = -INFINITY;
#pragma unroll
            for (int c = 0; c < FA_BC / 8; c++) {
                float v = s[r][c] * sl;
                const int64_t k = k0 + tc + 8 * c; /* the diagonal tile has keys past a row or T */
                if (j == i && (k > row[r] || k >= g.T)) v = -INFINITY;
                s[r][c] = v, mx[r] = fmaxf(mx[r], v);
            }
        }
        float alpha[4];
#pragma unroll
        for (int r = 0; r < 4; r++) { /* a row's columns across 8 lanes */
            alpha[r] = fa_rescale<8>(mx[r], m[r], l[r]);
#pragma unroll
            for (int c = 0; c < FA_BC / 8; c++) { /* P (masked scores give 0) */
                s[r][c] = exp2f(s[r][c] - m[r]);
                l[r] += s[r][c];
            }
#pragma unroll
            for (int d = 0; d < NC; d++) o[r][d] *= alpha[r];
        }
        fa32_put<FA_BC / 8>(P, FA_PLD32, s);
        fa_wait_loads_but<1>(); /* V_j (K_j+1 may be on its way) */
        __syncthreads();        /* V_j, and the warp's P, are in */
        fa32_acc<NC>(o, P, FA_PLD32, V, g.ld, FA_BC);
        __syncthreads(); /* every warp is done with V_j */
        if (j < i) fa_load_async(V, head + 2 * g.C, rl, k0 + FA_BC, FA_BC, g);
        fa_commit_loads();
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        l[r] = fa_row_sum<8>(l[r]);
        if (tc == 0 && row[r] < g.T) lse[bh * g.T + row[r]] = m[r] * FA_LN2 + logf(l[r]);
        const float inv = 1.0f / l[r];
#pragma unroll
        for (int d = 0; d < NC; d++) o[r][d] *= inv;
    }
    fa32_store<NC>(y + b * g.T * g.C + h * g.hs, g.C, o, q0 + w * 16, 1.0f, g.T);
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

/* f32. One block: key tile j of a head, over the query tiles from its diagonal on, 32 queries
 * at a time; warp w owns keys [16w, 16w + 16): dK and dV in registers. Once every warp is done
 * with a half of the tile's queries, that half of the next tile's Q, dy, lse and D loads without
 * waiting, while the warps work on the other half. */
template <int NC>
__global__ void __launch_bounds__(FA_THREADS)
    fa_dkv_kernel(float *dqkv, const float *dy, const float *qkv, const float *lse, const float *D,
                  fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, j = blockIdx.x % nt, bh = blockIdx.x / nt;
    const int64_t b = bh / g.nh, h = bh % g.nh, k0 = j * FA_BC;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, tr = lane / 8, tc = lane % 8;
    const int hs = (int)g.hs;
    const float sl = g.scale * FA_LOG2E;
    fa_carve cv = {fa_smem, 0};
    float *K = fa_take<float>(&cv, FA_BR * g.ld), *V = fa_take<float>(&cv, FA_BR * g.ld);
    float *Q = fa_take<float>(&cv, FA_BR * g.ld), *dO = fa_take<float>(&cv, FA_BR * g.ld);
    float *lse_s = fa_take<float>(&cv, FA_BR), *D_s = fa_take<float>(&cv, FA_BR);
    float *P = fa_take<float>(&cv, FA_BR * FA_PLD32_HALF) + w * 16 * FA_PLD32_HALF;
    float *dS = fa_take<float>(&cv, FA_BR * FA_PLD32_HALF) + w * 16 * FA_PLD32_HALF;
    const int64_t rl = 3 * g.C, off = b * g.T * rl + h * g.hs;
    const float *head = qkv + off, *dyh = dy + b * g.T * g.C + h * g.hs;
    const float *Kw = K + w * 16 * g.ld, *Vw = V + w * 16 * g.ld;
    const float *lh = lse + bh * g.T, *Dh = D + bh * g.T;
    /* half u (queries [32u, 32u + 32)) of query tile i: Q, dy, and its rows' lse and D (0 past
     * T: masked below), as one group of loads */
    auto load_half = [&](int64_t i, int u) {
        const int64_t r0 = i * FA_BR + u * (FA_BR / 2);
        fa_load_async(Q + u * (FA_BR / 2) * g.ld, head, rl, r0, FA_BR / 2, g);
        fa_load_async(dO + u * (FA_BR / 2) * g.ld, dyh, g.C, r0, FA_BR / 2, g);
        if (threadIdx.x < FA_BR / 2) {
            const int64_t q = r0 + threadIdx.x;
            const int c = u * (FA_BR / 2) + threadIdx.x;
            fa_cp<4>(lse_s + c, q < g.T ? lh + q : lh, q < g.T ? 4 : 0);
            fa_cp<4>(D_s + c, q < g.T ? Dh + q : Dh, q < g.T ? 4 : 0);
        }
        fa_commit_loads();
    };
    load_half(j, 0); /* on their way while K and V load */
    load_half(j, 1);
    fa_load(K, head + g.C, rl, k0, FA_BR, g);
    fa_load(V, head + 2 * g.C, rl, k0, FA_BR, g);
    int64_t key[4];
    float dK[4][NC] = {}, dV[4][NC] = {};
#pragma unroll
    for (int r = 0; r < 4; r++) key[r] = k0 + w * 16 + tr + 4 * r;
    for (int64_t i = j; i < nt; i++) {
        const int64_t q0 = i * FA_BR;
        /* the diagonal tile, and a last one with queries past T, take the masks */
        const bool edge = i == j || q0 + FA_BR > g.T;
#pragma unroll 1
        for (int u = 0; u < 2; u++) {
            const int c0 = u * (FA_BC / 2);
            fa_wait_loads_but<1>(); /* this half's (the other's may be on its way) */
            __syncthreads();
            float s[4][FA_BC / 16], dp[4][FA_BC / 16]; /* P^T and dS^T: key rows, query columns */
            fa32_dot<FA_BC / 16>(s, Kw, Q + c0 * g.ld, g.ld, hs);
            fa32_dot<FA_BC / 16>(dp, Vw, dO + c0 * g.ld, g.ld, hs);
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int c = 0; c < FA_BC / 16; c++) {
                    const int qc = c0 + tc + 8 * c;
                    const int64_t q = q0 + qc;
                    float p = exp2f(s[r][c] * sl - lse_s[qc] * FA_LOG2E);
                    if (edge && (key[r] > q || q >= g.T)) p = 0.0f;
                    s[r][c] = p, dp[r][c] = p * (dp[r][c] - D_s[qc]);
                }
            fa32_put<FA_BC / 16>(P, FA_PLD32_HALF, s);
            fa32_put<FA_BC / 16>(dS, FA_PLD32_HALF, dp);
            __syncwarp(); /* the warp's P^T and dS^T are in */
            fa32_acc<NC>(dV, P, FA_PLD32_HALF, dO + c0 * g.ld, g.ld, FA_BC / 2);
            fa32_acc<NC>(dK, dS, FA_PLD32_HALF, Q + c0 * g.ld, g.ld, FA_BC / 2);
            __syncthreads(); /* every warp is done with this half, and with its P^T and dS^T */
            if (i + 1 < nt)
                load_half(i + 1, u);
            else
                fa_commit_loads(); /* an empty group: the count stays */
        }
    }
    float *gh = dqkv + off;
    fa32_store<NC>(gh + g.C, rl, dK, k0 + w * 16, g.scale, g.T);
    fa32_store<NC>(gh + 2 * g.C, rl, dV, k0 + w * 16, 1.0f, g.T);
}

/* f32. One block: query tile i of a head, over the key tiles up to its diagonal; warp w owns
 * queries [16w, 16w + 16): dQ in registers. As the forward, V_j+1 loads once dP is done with
 * V_j, and K_j+1 once dQ is done with K_j, without waiting. */
template <int NC>
__global__ void __launch_bounds__(FA_THREADS)
    fa_dq_kernel(float *dqkv, const float *dy, const float *qkv, const float *lse, const float *D,
                 fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, i = nt - 1 - blockIdx.x % nt;
    const int64_t bh = blockIdx.x / nt, b = bh / g.nh, h = bh % g.nh, q0 = i * FA_BR;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, tr = lane / 8, tc = lane % 8;
    const int hs = (int)g.hs;
    const float sl = g.scale * FA_LOG2E;
    fa_carve cv = {fa_smem, 0};
    float *Q = fa_take<float>(&cv, FA_BR * g.ld), *dO = fa_take<float>(&cv, FA_BR * g.ld);
    float *K = fa_take<float>(&cv, FA_BR * g.ld), *V = fa_take<float>(&cv, FA_BR * g.ld);
    float *dS = fa_take<float>(&cv, FA_BR * FA_PLD32) + w * 16 * FA_PLD32;
    const int64_t rl = 3 * g.C, off = b * g.T * rl + h * g.hs;
    const float *head = qkv + off, *Qw = Q + w * 16 * g.ld, *dOw = dO + w * 16 * g.ld;
    fa_load_async(V, head + 2 * g.C, rl, 0, FA_BC, g); /* on their way while Q and dy load */
    fa_commit_loads();
    fa_load_async(K, head + g.C, rl, 0, FA_BC, g);
    fa_commit_loads();
    fa_load(Q, head, rl, q0, FA_BR, g);
    fa_load(dO, dy + b * g.T * g.C + h * g.hs, g.C, q0, FA_BR, g);
    int64_t q[4];
    float lse_r[4], D_r[4], dQ[4][NC] = {};
#pragma unroll
    for (int r = 0; r < 4; r++) { /* rows past T: lse +inf, so P is 0 */
        q[r] = q0 + w * 16 + tr + 4 * r;
        lse_r[r] = q[r] < g.T ? lse[bh * g.T + q[r]] * FA_LOG2E : INFINITY;
        D_r[r] = q[r] < g.T ? D[bh * g.T + q[r]] : 0.0f;
    }
    for (int64_t j = 0; j <= i; j++) {
        const int64_t k0 = j * FA_BC;
        float s[4][FA_BC / 8], dp[4][FA_BC / 8];
        fa_wait_loads_but<1>(); /* V_j (K_j, committed after it, may be on its way) */
        __syncthreads();
        fa32_dot<FA_BC / 8>(dp, dOw, V, g.ld, hs);
        fa_wait_loads(); /* K_j */
        __syncthreads(); /* K_j is in; every warp is done with V_j */
        if (j < i) fa_load_async(V, head + 2 * g.C, rl, k0 + FA_BC, FA_BC, g);
        fa_commit_loads(); /* (empty after the last tile: the groups keep their count) */
        fa32_dot<FA_BC / 8>(s, Qw, K, g.ld, hs);
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int c = 0; c < FA_BC / 8; c++) { /* dS: query row r, key column */
                float p = exp2f(s[r][c] * sl - lse_r[r]);
                if (j == i && k0 + tc + 8 * c > q[r]) p = 0.0f;
                dp[r][c] = p * (dp[r][c] - D_r[r]);
            }
        fa32_put<FA_BC / 8>(dS, FA_PLD32, dp);
        __syncwarp(); /* the warp's dS is in (the next tile's is written after a barrier) */
        fa32_acc<NC>(dQ, dS, FA_PLD32, K, g.ld, FA_BC);
        __syncthreads(); /* every warp is done with K_j */
        if (j < i) fa_load_async(K, head + g.C, rl, k0 + FA_BC, FA_BC, g);
        fa_commit_loads();
    }
    fa32_store<NC>(dqkv + off, rl, dQ, q0 + w * 16, g.scale, g.T);
}

/* ---- host --------------------------------------------------------------------------------- */

/* The geometry; tiles' rows ld elements apart: bf16 and f16 rows 16 bytes past a multiple of
 * 16 elements (ldmatrix's aligned rows), f32 rows 4 floats more than the head (banks: above). */
static fa_geom fa_geom_of(const tdm_tensor *qkv, int n_head) {
    const int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3, hs = C / n_head;
    const int ld = (int)hs + (qkv->dtype == TDM_F32 ? 4 : FA_PAD);
    return fa_geom{B, T, C, n_head, hs, 1.0f / sqrtf((float)hs), ld};
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

/* The device's compute capability as 10 major + minor (0 when it cannot be read). */
static int fa_cc(int index) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return 10 * major + minor;
}

/* Whether three TF32 products beat one f32 product on the CUDA cores: on the data-center parts,
 * whose tensor cores run TF32 7-8 times as fast as their CUDA cores run f32 (sm_80 A100, sm_90
 * H100 and H200, sm_100 B200); not where TF32 is no faster than f32 (sm_86 and sm_89, NVIDIA's
 * GA102 and AD102 whitepapers; sm_120) or not known to be (sm_87 Orin). */
static bool fa_tf32_fast(int cc) {
    return cc == 80 || cc == 90 || (cc >= 100 && cc < 110);
}

/* TANDEM_FLASH_ATTENTION=0 in the environment starts it off, TANDEM_FLASH_TF32X3=0 the f32
 * products on the tensor cores (for measuring one path against the other: scripts/gpu-check) */
static bool fa_enabled = true, fa_tf32x3 = true;
static pthread_once_t fa_env_once = PTHREAD_ONCE_INIT;

static void fa_read_env(void) {
    const char *e = getenv("TANDEM_FLASH_ATTENTION");
    if (e && !strcmp(e, "0")) __atomic_store_n(&fa_enabled, false, __ATOMIC_RELAXED);
    e = getenv("TANDEM_FLASH_TF32X3");
    if (e && !strcmp(e, "0")) __atomic_store_n(&fa_tf32x3, false, __ATOMIC_RELAXED);
}

extern "C" void tdm_cuda_flash_enable(bool on) {
    pthread_once(&fa_env_once, fa_read_env);
    __atomic_store_n(&fa_enabled, on, __ATOMIC_RELAXED);
}

extern "C" void tdm_cuda_flash_tf32x3(bool on) {
    pthread_once(&fa_env_once, fa_read_env);
    __atomic_store_n(&fa_tf32x3, on, __ATOMIC_RELAXED);
}

/* Whether heads of g on device `index` run on the mma.sync kernels: bf16 and f16 always
 * (tdm_cuda_flash_fits declines them before sm_80), f32 heads up to 64 (wider ones would spill
 * the split fragments) while tdm_cuda_flash_tf32x3 is on, where TF32 is fast (fa_tf32_fast) and
 * the blocks' shared memory fits (the dK/dV kernel's 103 KB at heads of 64; the CUDA cores'
 * kernels take 89 KB). */
static bool fa_on_mma(fa_geom g, size_t es, int index) {
    pthread_once(&fa_env_once, fa_read_env);
    if (es == 2) return true;
    if (!__atomic_load_n(&fa_tf32x3, __ATOMIC_RELAXED) || g.hs > 64 || !fa_tf32_fast(fa_cc(index)))
        return false;
    const size_t limit = (size_t)fa_smem_limit(index);
    return fa_mma_smem_fwd(g, 4) <= limit && fa_mma_smem_dkv(g, 4) <= limit &&
           fa_mma_smem_dq(g, 4) <= limit;
}

extern "C" bool tdm_cuda_flash_fits(const tdm_tensor *qkv, int n_head) {
    pthread_once(&fa_env_once, fa_read_env);
    if (!__atomic_load_n(&fa_enabled, __ATOMIC_RELAXED)) return false;
    const fa_geom g = fa_geom_of(qkv, n_head);
    const size_t es = tdm_dtype_size(qkv->dtype);
    if (g.hs % 16 || g.hs > 128 || g.B * g.nh * ((g.T + FA_BR - 1) / FA_BR) > INT32_MAX)
        return false;
    /* bf16 and f16 products take sm_80's tensor-core instructions */
    if (es == 2 && fa_cc(qkv->device.index) < 80) return false;
    const size_t limit = (size_t)fa_smem_limit(qkv->device.index);
    const bool mma = fa_on_mma(g, es, qkv->device.index);
    return fa_smem_fwd(g, es, mma) <= limit && fa_smem_dkv(g, es, mma) <= limit &&
           fa_smem_dq(g, es, mma) <= limit;
}

/* Launches kernel k with smem bytes of shared memory (over the 48 KiB a launch gets unasked). */
template <typename K> static int fa_launch_check(K *k, size_t smem, const char *what, int idx) {
    return cu_check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                    what, idx);
}

/* f(std::integral_constant<int, NC>) for the f32 kernels' columns a thread, NC = hs / 8 (heads
 * of 16 to 128, a multiple of 16: tdm_cuda_flash_fits). */
template <typename F> static int fa32_by_head(int64_t hs, F f) {
    switch (hs / 16) {
    case 1:
        return f(std::integral_constant<int, 2>());
    case 2:
        return f(std::integral_constant<int, 4>());
    case 3:
        return f(std::integral_constant<int, 6>());
    case 4:
        return f(std::integral_constant<int, 8>());
    case 5:
        return f(std::integral_constant<int, 10>());
    case 6:
        return f(std::integral_constant<int, 12>());
    case 7:
        return f(std::integral_constant<int, 14>());
    default:
        return f(std::integral_constant<int, 16>());
    }
}

/* The f32 forward on the CUDA cores. */
static int fa_forward_f32(cu_device *d, int idx, float *y, float *lse, const float *qkv,
                          fa_geom g) {
    const size_t smem = fa_smem_fwd(g, 4, false);
    const unsigned blocks = (unsigned)(g.B * g.nh * ((g.T + FA_BR - 1) / FA_BR));
    return fa32_by_head(g.hs, [&](auto nc) -> int {
        constexpr int NC = decltype(nc)::value;
        if (fa_launch_check(fa_fwd_kernel<NC>, smem, "flash attention", idx))
            return tdm_last_status();
        fa_fwd_kernel<NC><<<blocks, FA_THREADS, smem, d->compute>>>(qkv, y, lse, g);
        return cu_check_launch("flash attention", idx);
    });
}

template <typename E>
static int fa_forward(cu_device *d, int idx, tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv,
                      fa_geom g) {
    if constexpr (sizeof(E) == 4)
        if (!fa_on_mma(g, 4, idx)) return fa_forward_f32(d, idx, cu_f(y), cu_f(lse), cu_f(qkv), g);
    return fa_mma_forward<E>(d, idx, cu_p<E>(y), cu_f(lse), cu_p<E>(qkv), g);
}

/* The f32 backward's two kernels. */
static int fa_backward_f32(cu_device *d, int idx, float *gq, const float *gy, const float *x,
                           const float *lse, const float *D, fa_geom g) {
    const size_t s_kv = fa_smem_dkv(g, 4, false), s_q = fa_smem_dq(g, 4, false);
    const unsigned blocks = (unsigned)(g.B * g.nh * ((g.T + FA_BR - 1) / FA_BR));
    const char *what = "flash attention_backward";
    return fa32_by_head(g.hs, [&](auto nc) -> int {
        constexpr int NC = decltype(nc)::value;
        if (fa_launch_check(fa_dkv_kernel<NC>, s_kv, what, idx)) return tdm_last_status();
        fa_dkv_kernel<NC><<<blocks, FA_THREADS, s_kv, d->compute>>>(gq, gy, x, lse, D, g);
        if (cu_check_launch("flash attention_backward (dk, dv)", idx)) return tdm_last_status();
        if (fa_launch_check(fa_dq_kernel<NC>, s_q, what, idx)) return tdm_last_status();
        fa_dq_kernel<NC><<<blocks, FA_THREADS, s_q, d->compute>>>(gq, gy, x, lse, D, g);
        return cu_check_launch("flash attention_backward (dq)", idx);
    });
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
        if (sizeof(E) == 2 || fa_on_mma(g, 4, idx))
            rc = fa_mma_backward<E>(d, idx, gq, gy, x, cu_f(lse), D, g);
        else if constexpr (sizeof(E) == 4)
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
