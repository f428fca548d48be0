/* Fused causal attention: FlashAttention-2's tiling and online softmax, forward and backward,
 * for the heads that fit (cuda_attention.cu sends the rest to its unfused path).
 *
 * No T x T scores reach memory and the tiles above the diagonal are never computed: a block
 * takes FA_BR query rows of one head and walks the key tiles up to its diagonal. The bf16 and
 * f16 forward (fa_fwd_mma_kernel) splits the rows over its warps and keeps the scores, the
 * running row maxima and sums and the output rows in registers, its products on the tensor
 * cores through mma.sync (whose fragment layouts are documented); the f32 forward and the
 * backward keep those tiles in shared memory, their products on the tensor cores in bf16 and
 * f16 through WMMA (16 x 16 x 16 with f32 accumulation) and on the CUDA cores in f32 (no TF32,
 * as PyTorch's default). Every softmax sum is f32, and P and dS are rounded to the dtype for
 * the products that take them, as the unfused path and PyTorch's flash kernels round them.
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
#include "backend/cuda/cuda_common.cuh"

#include <assert.h>
#include <math.h>
#include <mma.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

#define FA_BR      64  /* query rows a block */
#define FA_BC      64  /* keys a tile (= FA_BR: every row of a block sees a key in each tile) */
#define FA_THREADS 128 /* four warps; in a product, warp w takes every fourth 16 x 16 tile */
#define FA_PAD     8   /* elements after each row of Q, K, V, dy in shared memory (banks) */
/* The forward's S and O rows take 4 floats more, P's 8 elements: rows 64 floats apart would
 * put a column of every row in one bank, and its softmax reads a column of 16 rows at once */
#define FA_SLD (FA_BC + 4)
#define FA_PLD (FA_BC + 8)
/* The mma.sync kernels take exponentials base 2 (one multiply-add and the GPU's exp2 a score,
 * as FlashAttention-2): the scores scaled by scale log2(e), their maxima in those units, lse
 * (natural) converted on the way in and out. */
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2   0.6931471805599453f

typedef struct {
    int64_t B, T, C, nh, hs;
    float scale;
    int ld; /* elements a row of the Q, K, V and dy tiles take in shared memory */
} fa_geom;

/* ---- tile products ------------------------------------------------------------------------ */

template <bool T> struct fa_layout { typedef nvcuda::wmma::row_major type; };
template <> struct fa_layout<true> { typedef nvcuda::wmma::col_major type; };

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
 * whole block: op(a) [M, K] is a (row-major, lda) or, where TA, the transpose of a [K, M];
 * op(b) [K, N] likewise. M is 64; N and K are multiples of 16 (N at most 128). The caller
 * synchronises after. */
template <typename E, bool TA, bool TB>
__device__ void fa_mm(float *c, int ldc, const E *a, int lda, const E *b, int ldb, int M, int N,
                      int K, bool acc) {
    if constexpr (sizeof(E) == 4) { /* f32: the CUDA cores, a register tile a thread */
        const float *af = (const float *)a, *bf = (const float *)b;
        switch (N / 8) {
        case 2:
            fa_mm_f32<2, TA, TB>(c, ldc, af, lda, bf, ldb, K, acc);
            break;
        case 4:
            fa_mm_f32<4, TA, TB>(c, ldc, af, lda, bf, ldb, K, acc);
            break;
        case 6:
            fa_mm_f32<6, TA, TB>(c, ldc, af, lda, bf, ldb, K, acc);
            break;
        case 8:
            fa_mm_f32<8, TA, TB>(c, ldc, af, lda, bf, ldb, K, acc);
            break;
        case 10:
            fa_mm_f32<10, TA, TB>(c, ldc, af, lda, bf, ldb, K, acc);
            break;
        case 12:
            fa_mm_f32<12, TA, TB>(c, ldc, af, lda, bf, ldb, K, acc);
            break;
        case 14:
            fa_mm_f32<14, TA, TB>(c, ldc, af, lda, bf, ldb, K, acc);
            break;
        default:
            fa_mm_f32<16, TA, TB>(c, ldc, af, lda, bf, ldb, K, acc);
            break;
        }
    } else { /* bf16, f16: the tensor cores */
        using namespace nvcuda;
        const int tn = N / 16, tiles = M / 16 * tn;
        for (int t = threadIdx.x / 32; t < tiles; t += FA_THREADS / 32) {
            const int tm = t / tn, tc = t % tn;
            float *ct = c + tm * 16 * ldc + tc * 16;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> f;
            if (acc)
                wmma::load_matrix_sync(f, ct, ldc, wmma::mem_row_major);
            else
                wmma::fill_fragment(f, 0.0f);
            for (int k = 0; k < K; k += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, E, typename fa_layout<TA>::type> fa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, E, typename fa_layout<TB>::type> fb;
                wmma::load_matrix_sync(fa, TA ? a + k * lda + tm * 16 : a + tm * 16 * lda + k, lda);
                wmma::load_matrix_sync(fb, TB ? b + tc * 16 * ldb + k : b + k * ldb + tc * 16, ldb);
                wmma::mma_sync(f, fa, fb, f);
            }
            wmma::store_matrix_sync(ct, f, ldc, wmma::mem_row_major);
        }
    }
}

/* ---- shared memory ------------------------------------------------------------------------ */

/* Carves a block's shared memory into aligned regions (WMMA wants 32-byte aligned tiles). */
typedef struct {
    char *base;
    size_t used;
} fa_carve;

__host__ __device__ inline size_t fa_round(size_t n) {
    return (n + 127) & ~(size_t)127;
}
template <typename X> __device__ inline X *fa_take(fa_carve *c, size_t n) {
    X *p = (X *)(c->base + c->used);
    c->used += fa_round(n * sizeof(X));
    return p;
}

/* Bytes each kernel carves below (the same order and sizes). */
static size_t fa_smem_fwd(int64_t hs, int ld, size_t es) {
    return 3 * fa_round(FA_BR * ld * es) + fa_round(FA_BR * FA_SLD * 4) +
           fa_round(FA_BR * FA_PLD * es) + fa_round(FA_BR * (hs + 4) * 4) +
           2 * fa_round(FA_BR * 4) + 2 * fa_round(FA_THREADS * 4);
}
/* Heads whose backward runs on mma.sync with its sums in registers (fa_dkv_mma_kernel): HT =
 * hs / 16, or 0 (the WMMA or f32 kernels, sums in shared memory: f32, and heads over 64, whose
 * registers would not hold S^T, dP^T, dK and dV). */
static int fa_frag_tiles(int64_t hs, size_t es) {
    return es == 2 && hs <= 64 ? (int)(hs / 16) : 0;
}
static size_t fa_smem_dkv(int64_t hs, int ld, size_t es) {
    if (fa_frag_tiles(hs, es)) return 4 * fa_round(FA_BR * ld * es) + 2 * fa_round(FA_BR * 4);
    return 4 * fa_round(FA_BR * ld * es) + 2 * fa_round(FA_BR * FA_BC * 4) +
           2 * fa_round(FA_BR * FA_BC * es) + 2 * fa_round(FA_BC * hs * 4) +
           2 * fa_round(FA_BR * 4);
}
static size_t fa_smem_dq(int64_t hs, int ld, size_t es) {
    if (fa_frag_tiles(hs, es)) return 2 * fa_round(FA_BR * ld * es);
    return 4 * fa_round(FA_BR * ld * es) + 2 * fa_round(FA_BR * FA_BC * 4) +
           fa_round(FA_BR * FA_BC * es) + fa_round(FA_BR * hs * 4) + 2 * fa_round(FA_BR * 4);
}

/* 16 bytes moved as one (a 128-bit load and store on a GPU) */
struct __align__(16) fa_vec {
    uint32_t w[4];
};

/* rows [r0, r0 + FA_BR) of one head's q (part 0), k (1) or v (2) in qkv (or of dy, y: part 0
 * with a row of C) into tile [FA_BR, ld]; rows past T as zeros. 16 bytes a thread at a time
 * where the rows allow it (a head's row is a multiple of 16 bytes; src and row_len keep that
 * alignment: the tile's rows, ld apart, always do), else an element at a time. */
template <typename E>
__device__ void fa_load(E *tile, const E *src, int64_t row_len, int64_t r0, fa_geom g) {
    constexpr int per = sizeof(fa_vec) / sizeof(E);
    if ((uintptr_t)src % sizeof(fa_vec) == 0 && row_len % per == 0) {
        const int vecs = (int)g.hs / per; /* a row's */
        for (int e = threadIdx.x; e < FA_BR * vecs; e += FA_THREADS) {
            const int r = e / vecs, c = e % vecs;
            fa_vec v = {};
            if (r0 + r < g.T) v = *(const fa_vec *)(src + (r0 + r) * row_len + c * per);
            *(fa_vec *)(tile + r * g.ld + c * per) = v;
        }
        return;
    }
    for (int e = threadIdx.x; e < FA_BR * g.hs; e += FA_THREADS) {
        const int r = e / (int)g.hs, d = e % (int)g.hs;
        tile[r * g.ld + d] = r0 + r < g.T ? src[(r0 + r) * row_len + d] : cu_to<E>(0.0f);
    }
}

/* ---- forward ------------------------------------------------------------------------------ */

/* f32 (bf16 and f16 take fa_fwd_mma_kernel). One block: query tile i of head h of batch row b,
 * the last tiles (the most work) first. */
__global__ void fa_fwd_kernel(const float *qkv, float *y, float *lse, fa_geom g) {
    typedef float E;
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, i = nt - 1 - blockIdx.x % nt;
    const int64_t bh = blockIdx.x / nt, b = bh / g.nh, h = bh % g.nh, q0 = i * FA_BR;
    const int hs = (int)g.hs, old = hs + 4, tid = threadIdx.x; /* old: O's row in floats */
    fa_carve cv = {fa_smem, 0};
    E *Q = fa_take<E>(&cv, FA_BR * g.ld), *K = fa_take<E>(&cv, FA_BR * g.ld);
    E *V = fa_take<E>(&cv, FA_BR * g.ld);
    float *S = fa_take<float>(&cv, FA_BR * FA_SLD);
    E *P = fa_take<E>(&cv, FA_BR * FA_PLD);
    float *O = fa_take<float>(&cv, FA_BR * old), *m = fa_take<float>(&cv, FA_BR);
    float *l = fa_take<float>(&cv, FA_BR), *rmax = fa_take<float>(&cv, FA_THREADS);
    float *rsum = fa_take<float>(&cv, FA_THREADS);
    const E *head = qkv + b * g.T * 3 * g.C + h * g.hs;
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
        fa_mm<E, false, true>(S, FA_SLD, Q, g.ld, K, g.ld, FA_BR, FA_BC, hs, false);
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
            P[r * FA_PLD + c] = cu_to<E>(p), sum += p;
        }
        for (int d = half; d < hs; d += 2) O[r * old + d] *= alpha;
        rsum[tid] = sum;
        __syncthreads(); /* every thread has read m[r] */
        if (half == 0) m[r] = m_new, l[r] = l[r] * alpha + rsum[2 * r] + rsum[2 * r + 1];
        fa_mm<E, false, false>(O, old, P, FA_PLD, V, g.ld, FA_BR, hs, FA_BC, true);
    }
    __syncthreads();
    E *yh = y + b * g.T * g.C + h * g.hs;
    for (int e = tid; e < FA_BR * hs; e += FA_THREADS) {
        const int rr = e / hs, d = e % hs;
        if (q0 + rr < g.T) yh[(q0 + rr) * g.C + d] = cu_to<E>(O[rr * old + d] / l[rr]);
    }
    if (tid < FA_BR && q0 + tid < g.T) lse[bh * g.T + q0 + tid] = m[tid] + logf(l[tid]);
}

/* ---- forward in bf16 and f16: mma.sync, the softmax in registers ------------------------- */

/* PTX's m16n8k16 product, d += A B, with the fragment layouts the PTX ISA gives (g = lane / 4,
 * t = lane % 4): A [16, 16] row-major, register r the pair (row g + 8 (r & 1), columns
 * 2t + 8 (r >> 1), + 1); B [16, 8] column-major, register r the pair (rows 2t + 8r, + 1;
 * column g); d[i] at (row g + 8 (i >> 1), column 2t + (i & 1)). Unlike WMMA's, these layouts
 * are documented, so a thread knows which rows its sums belong to and the softmax runs on
 * them in registers. The emulation (emu/mma.h) gathers the warp's registers to do the same. */
template <typename E>
__device__ __forceinline__ void fa_mma(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#ifdef TDM_EMU_MMA_H
    emu_mma_m16n8k16<E>(d, a, b0, b1);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap(); /* unreachable: tdm_cuda_flash_fits declines bf16 and f16 before sm_80 */
#else
    if constexpr (std::is_same<E, __nv_bfloat16>::value)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/* Two adjacent elements of a shared-memory tile as one register (p even: 4-byte aligned). */
template <typename E> __device__ __forceinline__ uint32_t fa_u32(const E *p) {
    return *(const uint32_t *)p;
}
/* Two elements at any places as one register, the first in the low half. */
template <typename E> __device__ __forceinline__ uint32_t fa_pair(E lo, E hi) {
    uint16_t l, h;
    memcpy(&l, &lo, 2);
    memcpy(&h, &hi, 2);
    return (uint32_t)l | (uint32_t)h << 16;
}

/* One block: query tile i of head h of batch row b (the last tiles first), as fa_fwd_kernel,
 * with FlashAttention-2's split of the work: warp w owns query rows [16w, 16w + 16) of the
 * 64 and does all of their work, so no barrier but K and V's loads a tile. Q's fragments stay
 * in registers (HT = hs / 16 of them), and so do S, P and O: a thread holds rows g and g + 8
 * of its warp's 16 (two columns of every 8), its quad (the 4 lanes of one g) the rest of those
 * rows: a row's maximum over a tile takes two shuffles, its sum only one pair at the end (each
 * lane keeps its part of l, rescaled with the row). P becomes the next product's A operand in
 * place (the accumulator's layout of two 8-key tiles is A's of one 16-key tile). Only K and V
 * pass through shared memory: 3 tiles of 64 x (hs + 8), against fa_fwd_kernel's S, P and O. */
template <typename E, int HT>
__global__ void fa_fwd_mma_kernel(const E *qkv, E *y, float *lse, fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, i = nt - 1 - blockIdx.x % nt;
    const int64_t bh = blockIdx.x / nt, b = bh / g.nh, h = bh % g.nh, q0 = i * FA_BR;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, gr = lane / 4, tq = lane % 4;
    const float sl = g.scale * FA_LOG2E;
    fa_carve cv = {fa_smem, 0};
    E *Q = fa_take<E>(&cv, FA_BR * g.ld), *K = fa_take<E>(&cv, FA_BR * g.ld);
    E *V = fa_take<E>(&cv, FA_BR * g.ld);
    const E *head = qkv + b * g.T * 3 * g.C + h * g.hs;
    fa_load(Q, head, 3 * g.C, q0, g);
    __syncthreads();
    uint32_t qa[HT][4];
    const E *qr = Q + (w * 16 + gr) * g.ld + 2 * tq;
#pragma unroll
    for (int kk = 0; kk < HT; kk++) {
        qa[kk][0] = fa_u32(qr + kk * 16), qa[kk][1] = fa_u32(qr + 8 * g.ld + kk * 16);
        qa[kk][2] = fa_u32(qr + kk * 16 + 8), qa[kk][3] = fa_u32(qr + 8 * g.ld + kk * 16 + 8);
    }
    const int64_t row[2] = {q0 + w * 16 + gr, q0 + w * 16 + gr + 8};
    float o[2 * HT][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    for (int64_t j = 0; j <= i; j++) {
        const int64_t k0 = j * FA_BC;
        __syncthreads(); /* every warp is done with the last tile's K and V */
        fa_load(K, head + g.C, 3 * g.C, k0, g);
        fa_load(V, head + 2 * g.C, 3 * g.C, k0, g);
        __syncthreads();
        float s[FA_BC / 8][4] = {}; /* S = Q K^T: 8 tiles of 8 keys */
#pragma unroll
        for (int n = 0; n < FA_BC / 8; n++) {
            const E *kr = K + (n * 8 + gr) * g.ld + 2 * tq;
#pragma unroll
            for (int kk = 0; kk < HT; kk++)
                fa_mma<E>(s[n], qa[kk], fa_u32(kr + kk * 16), fa_u32(kr + kk * 16 + 8));
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < FA_BC / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int64_t k = k0 + n * 8 + 2 * tq + (e & 1);
                const float v = k <= row[e >> 1] && k < g.T ? s[n][e] * sl : -INFINITY;
                s[n][e] = v, mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) { /* key 0 of the tile is at or below every row's diagonal
                                       * (rows past T included): the maximum is finite */
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m_new = fmaxf(m[r], mx[r]);
            alpha[r] = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - m_new);
            m[r] = m_new, l[r] *= alpha[r];
        }
        uint32_t pa[FA_BC / 16][4]; /* P in the dtype, as the product's A: 4 tiles of 16 keys */
#pragma unroll
        for (int n = 0; n < FA_BC / 8; n++) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                p[e] = s[n][e] == -INFINITY ? 0.0f : exp2f(s[n][e] - m[e >> 1]);
                l[e >> 1] += p[e];
            }
            pa[n / 2][2 * (n % 2)] = fa_pair(cu_to<E>(p[0]), cu_to<E>(p[1]));
            pa[n / 2][2 * (n % 2) + 1] = fa_pair(cu_to<E>(p[2]), cu_to<E>(p[3]));
        }
#pragma unroll
        for (int d = 0; d < 2 * HT; d++) { /* O = O alpha + P V: 2 HT tiles of 8 columns */
            o[d][0] *= alpha[0], o[d][1] *= alpha[0], o[d][2] *= alpha[1], o[d][3] *= alpha[1];
            const E *vc = V + 2 * tq * g.ld + d * 8 + gr; /* B (key, column): V's rows */
#pragma unroll
            for (int kk = 0; kk < FA_BC / 16; kk++) {
                const E *v = vc + kk * 16 * g.ld;
                fa_mma<E>(o[d], pa[kk], fa_pair(v[0], v[g.ld]), fa_pair(v[8 * g.ld], v[9 * g.ld]));
            }
        }
    }
    E *yh = y + b * g.T * g.C + h * g.hs;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        if (row[r] >= g.T) continue;
        E *yr = yh + row[r] * g.C + 2 * tq;
#pragma unroll
        for (int d = 0; d < 2 * HT; d++)
            yr[d * 8] = cu_to<E>(o[d][2 * r] / l[r]),
                   yr[d * 8 + 1] = cu_to<E>(o[d][2 * r + 1] / l[r]);
        if (tq == 0) lse[bh * g.T + row[r]] = m[r] * FA_LN2 + logf(l[r]);
    }
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

/* Query tile i's rows' lse and D into shared memory (rows past T: lse +inf, so that P is 0). */
__device__ inline void fa_load_rows(float *lse_s, float *D_s, const float *lse, const float *D,
                                    int64_t q0, fa_geom g) {
    if (threadIdx.x < FA_BR) {
        const int64_t q = q0 + threadIdx.x;
        lse_s[threadIdx.x] = q < g.T ? lse[q] : INFINITY;
        D_s[threadIdx.x] = q < g.T ? D[q] : 0.0f;
    }
}

/* P = exp(scale S - lse) on and below the diagonal (0 elsewhere) and dS = P (dP - D), of query
 * tile q0 against key tile k0, by the block; P into Pt where non-NULL. */
template <typename E>
__device__ void fa_dscores(E *Pt, E *dSt, const float *S, const float *dP, const float *lse_s,
                           const float *D_s, int64_t q0, int64_t k0, fa_geom g) {
    for (int e = threadIdx.x; e < FA_BR * FA_BC; e += FA_THREADS) {
        const int r = e / FA_BC, c = e % FA_BC;
        const int64_t q = q0 + r, k = k0 + c;
        const float p = k <= q && q < g.T ? expf(S[e] * g.scale - lse_s[r]) : 0.0f;
        if (Pt) Pt[e] = cu_to<E>(p);
        dSt[e] = cu_to<E>(p * (dP[e] - D_s[r]));
    }
}

/* One block: key tile j of a head, over the query tiles from its diagonal on: dK and dV, their
 * sums in shared memory (f32, and bf16 and f16 heads over 64: fa_frag_tiles). */
template <typename E>
__global__ void fa_dkv_kernel(E *dqkv, const E *dy, const E *qkv, const float *lse, const float *D,
                              fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, j = blockIdx.x % nt, bh = blockIdx.x / nt;
    const int64_t b = bh / g.nh, h = bh % g.nh, k0 = j * FA_BC;
    const int hs = (int)g.hs;
    fa_carve cv = {fa_smem, 0};
    E *K = fa_take<E>(&cv, FA_BR * g.ld), *V = fa_take<E>(&cv, FA_BR * g.ld);
    E *Q = fa_take<E>(&cv, FA_BR * g.ld), *dO = fa_take<E>(&cv, FA_BR * g.ld);
    float *S = fa_take<float>(&cv, FA_BR * FA_BC), *dP = fa_take<float>(&cv, FA_BR * FA_BC);
    E *P = fa_take<E>(&cv, FA_BR * FA_BC), *dS = fa_take<E>(&cv, FA_BR * FA_BC);
    float *dK = fa_take<float>(&cv, FA_BC * hs), *dV = fa_take<float>(&cv, FA_BC * hs);
    float *lse_s = fa_take<float>(&cv, FA_BR), *D_s = fa_take<float>(&cv, FA_BR);
    const int64_t row3 = 3 * g.C, off = b * g.T * row3 + h * g.hs;
    const E *head = qkv + off, *dyh = dy + b * g.T * g.C + h * g.hs;
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
        fa_mm<E, false, true>(S, FA_BC, Q, g.ld, K, g.ld, FA_BR, FA_BC, hs, false);
        fa_mm<E, false, true>(dP, FA_BC, dO, g.ld, V, g.ld, FA_BR, FA_BC, hs, false);
        __syncthreads();
        fa_dscores(P, dS, S, dP, lse_s, D_s, q0, k0, g);
        __syncthreads();
        fa_mm<E, true, false>(dV, hs, P, FA_BC, dO, g.ld, FA_BC, hs, FA_BR, true);
        fa_mm<E, true, false>(dK, hs, dS, FA_BC, Q, g.ld, FA_BC, hs, FA_BR, true);
    }
    __syncthreads(); /* every product is done with dK and dV */
    E *gh = dqkv + off;
    for (int e = threadIdx.x; e < FA_BC * hs; e += FA_THREADS) {
        const int r = e / hs, d = e % hs;
        if (k0 + r >= g.T) continue;
        gh[(k0 + r) * row3 + g.C + d] = cu_to<E>(dK[e] * g.scale);
        gh[(k0 + r) * row3 + 2 * g.C + d] = cu_to<E>(dV[e]);
    }
}

/* One block: query tile i of a head, over the key tiles up to its diagonal: dQ, its sum in
 * shared memory (as fa_dkv_kernel). */
template <typename E>
__global__ void fa_dq_kernel(E *dqkv, const E *dy, const E *qkv, const float *lse, const float *D,
                             fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, i = nt - 1 - blockIdx.x % nt;
    const int64_t bh = blockIdx.x / nt, b = bh / g.nh, h = bh % g.nh, q0 = i * FA_BR;
    const int hs = (int)g.hs;
    fa_carve cv = {fa_smem, 0};
    E *Q = fa_take<E>(&cv, FA_BR * g.ld), *dO = fa_take<E>(&cv, FA_BR * g.ld);
    E *K = fa_take<E>(&cv, FA_BR * g.ld), *V = fa_take<E>(&cv, FA_BR * g.ld);
    float *S = fa_take<float>(&cv, FA_BR * FA_BC), *dP = fa_take<float>(&cv, FA_BR * FA_BC);
    E *dS = fa_take<E>(&cv, FA_BR * FA_BC);
    float *dQ = fa_take<float>(&cv, FA_BR * hs), *lse_s = fa_take<float>(&cv, FA_BR);
    float *D_s = fa_take<float>(&cv, FA_BR);
    const int64_t row3 = 3 * g.C, off = b * g.T * row3 + h * g.hs;
    const E *head = qkv + off;
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
        fa_mm<E, false, true>(S, FA_BC, Q, g.ld, K, g.ld, FA_BR, FA_BC, hs, false);
        fa_mm<E, false, true>(dP, FA_BC, dO, g.ld, V, g.ld, FA_BR, FA_BC, hs, false);
        __syncthreads();
        fa_dscores<E>(NULL, dS, S, dP, lse_s, D_s, q0, k0, g);
        __syncthreads();
        fa_mm<E, false, false>(dQ, hs, dS, FA_BC, K, g.ld, FA_BR, hs, FA_BC, true);
    }
    __syncthreads(); /* every product is done with dQ */
    E *gh = dqkv + off;
    for (int e = threadIdx.x; e < FA_BR * hs; e += FA_THREADS) {
        const int r = e / hs, d = e % hs;
        if (q0 + r < g.T) gh[(q0 + r) * row3 + d] = cu_to<E>(dQ[e] * g.scale);
    }
}

/* ---- backward in bf16 and f16, heads up to 64: mma.sync, the scores in registers ----------- */

/* A [16, 16 HT] strip of rows r0.. of a shared-memory tile as HT A fragments (fa_mma). */
template <typename E, int HT>
__device__ __forceinline__ void fa_frag_a(uint32_t a[HT][4], const E *tile, int r0, int ld) {
    const int lane = threadIdx.x % 32;
    const E *p = tile + (r0 + lane / 4) * ld + 2 * (lane % 4);
#pragma unroll
    for (int kk = 0; kk < HT; kk++) {
        a[kk][0] = fa_u32(p + kk * 16), a[kk][1] = fa_u32(p + 8 * ld + kk * 16);
        a[kk][2] = fa_u32(p + kk * 16 + 8), a[kk][3] = fa_u32(p + 8 * ld + kk * 16 + 8);
    }
}

/* c [16, 64] = a b^T: a the warp's strip (HT A fragments), b the 64 rows of a shared-memory tile
 * (row n of b is column n of the product). */
template <typename E, int HT>
__device__ __forceinline__ void fa_mm_rows(float c[FA_BC / 8][4], const uint32_t a[HT][4],
                                           const E *b, int ld) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < FA_BC / 8; n++) {
        c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
        const E *br = b + (n * 8 + lane / 4) * ld + 2 * (lane % 4);
#pragma unroll
        for (int kk = 0; kk < HT; kk++)
            fa_mma<E>(c[n], a[kk], fa_u32(br + kk * 16), fa_u32(br + kk * 16 + 8));
    }
}

/* c [16, 16 HT] += a b: a [16, 64] as a product's accumulators (rounded to E: its layout of two
 * 8-column tiles is A's of one 16-column tile), b [64, 16 HT] a shared-memory tile. */
template <typename E, int HT>
__device__ __forceinline__ void fa_mm_acc(float c[2 * HT][4], const float a[FA_BC / 8][4],
                                          const E *b, int ld) {
    const int lane = threadIdx.x % 32;
    uint32_t pa[FA_BC / 16][4];
#pragma unroll
    for (int n = 0; n < FA_BC / 8; n++) {
        pa[n / 2][2 * (n % 2)] = fa_pair(cu_to<E>(a[n][0]), cu_to<E>(a[n][1]));
        pa[n / 2][2 * (n % 2) + 1] = fa_pair(cu_to<E>(a[n][2]), cu_to<E>(a[n][3]));
    }
#pragma unroll
    for (int d = 0; d < 2 * HT; d++) {
        const E *bc = b + 2 * (lane % 4) * ld + d * 8 + lane / 4;
#pragma unroll
        for (int kk = 0; kk < FA_BC / 16; kk++) {
            const E *v = bc + kk * 16 * ld;
            fa_mma<E>(c[d], pa[kk], fa_pair(v[0], v[ld]), fa_pair(v[8 * ld], v[9 * ld]));
        }
    }
}

/* The warp's rows of a [*, 16 HT] result (rows r0 + g and + 8 of its strip) times scale into
 * out (row stride rs; rows from `first`, those at or past T left out). */
template <typename E, int HT>
__device__ __forceinline__ void fa_store_rows(E *out, int64_t rs, const float c[2 * HT][4],
                                              int64_t first, float scale, int64_t T) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t row = first + lane / 4 + 8 * r;
        if (row >= T) continue;
        E *o = out + row * rs + 2 * (lane % 4);
#pragma unroll
        for (int d = 0; d < 2 * HT; d++)
            o[d * 8] = cu_to<E>(c[d][2 * r] * scale),
                  o[d * 8 + 1] = cu_to<E>(c[d][2 * r + 1] * scale);
    }
}

/* One block: key tile j of a head, over the query tiles from its diagonal on, as fa_dkv_kernel;
 * warp w owns keys [16w, 16w + 16) and keeps S^T, dP^T, dS^T, P^T and its dK and dV rows in
 * registers: S^T = K Q^T and dP^T = V dy^T for its keys against the 64 queries, then
 * dV += P^T dy and dK += dS^T Q. Only Q, dy and their rows' lse and D pass through shared
 * memory, loaded once a query tile by the block. */
template <typename E, int HT>
__global__ void fa_dkv_mma_kernel(E *dqkv, const E *dy, const E *qkv, const float *lse,
                                  const float *D, fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, j = blockIdx.x % nt, bh = blockIdx.x / nt;
    const int64_t b = bh / g.nh, h = bh % g.nh, k0 = j * FA_BC;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, tq = lane % 4;
    const float sl = g.scale * FA_LOG2E;
    fa_carve cv = {fa_smem, 0};
    E *K = fa_take<E>(&cv, FA_BR * g.ld), *V = fa_take<E>(&cv, FA_BR * g.ld);
    E *Q = fa_take<E>(&cv, FA_BR * g.ld), *dO = fa_take<E>(&cv, FA_BR * g.ld);
    float *lse_s = fa_take<float>(&cv, FA_BR), *D_s = fa_take<float>(&cv, FA_BR);
    const int64_t row3 = 3 * g.C, off = b * g.T * row3 + h * g.hs;
    const E *head = qkv + off, *dyh = dy + b * g.T * g.C + h * g.hs;
    fa_load(K, head + g.C, row3, k0, g);
    fa_load(V, head + 2 * g.C, row3, k0, g);
    float dK[2 * HT][4] = {}, dV[2 * HT][4] = {};
    const int64_t key[2] = {k0 + w * 16 + lane / 4, k0 + w * 16 + lane / 4 + 8};
    for (int64_t i = j; i < nt; i++) {
        const int64_t q0 = i * FA_BR;
        __syncthreads(); /* every warp is done with the last tile's Q, dy, lse and D */
        fa_load(Q, head, row3, q0, g);
        fa_load(dO, dyh, g.C, q0, g);
        fa_load_rows(lse_s, D_s, lse + bh * g.T, D + bh * g.T, q0, g);
        __syncthreads();
        float s[FA_BC / 8][4], dp[FA_BC / 8][4];
        {
            uint32_t a[HT][4];
            fa_frag_a<E, HT>(a, K, w * 16, g.ld);
            fa_mm_rows<E, HT>(s, a, Q, g.ld);
            fa_frag_a<E, HT>(a, V, w * 16, g.ld);
            fa_mm_rows<E, HT>(dp, a, dO, g.ld);
        }
#pragma unroll
        for (int n = 0; n < FA_BC / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) { /* P^T and dS^T: key row e >> 1, query column */
                const int c = n * 8 + 2 * tq + (e & 1);
                const int64_t q = q0 + c;
                const float p =
                    key[e >> 1] <= q && q < g.T ? exp2f(s[n][e] * sl - lse_s[c] * FA_LOG2E) : 0.0f;
                s[n][e] = p, dp[n][e] = p * (dp[n][e] - D_s[c]);
            }
        fa_mm_acc<E, HT>(dV, s, dO, g.ld);
        fa_mm_acc<E, HT>(dK, dp, Q, g.ld);
    }
    E *gh = dqkv + off;
    fa_store_rows<E, HT>(gh + g.C, row3, dK, k0 + w * 16, g.scale, g.T);
    fa_store_rows<E, HT>(gh + 2 * g.C, row3, dV, k0 + w * 16, 1.0f, g.T);
}

/* One block: query tile i of a head, over the key tiles up to its diagonal, as fa_dq_kernel;
 * warp w owns queries [16w, 16w + 16): its Q and dy rows as fragments, their lse and D in
 * registers, S, dP and dS in registers, dQ += dS K. Only K and V pass through shared memory. */
template <typename E, int HT>
__global__ void fa_dq_mma_kernel(E *dqkv, const E *dy, const E *qkv, const float *lse,
                                 const float *D, fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    const int64_t nt = (g.T + FA_BR - 1) / FA_BR, i = nt - 1 - blockIdx.x % nt;
    const int64_t bh = blockIdx.x / nt, b = bh / g.nh, h = bh % g.nh, q0 = i * FA_BR;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, tq = lane % 4;
    const float sl = g.scale * FA_LOG2E;
    fa_carve cv = {fa_smem, 0};
    E *K = fa_take<E>(&cv, FA_BR * g.ld), *V = fa_take<E>(&cv, FA_BR * g.ld);
    const int64_t row3 = 3 * g.C, off = b * g.T * row3 + h * g.hs;
    const E *head = qkv + off;
    fa_load(K, head, row3, q0, g); /* Q and dy, through the K and V tiles */
    fa_load(V, dy + b * g.T * g.C + h * g.hs, g.C, q0, g);
    __syncthreads();
    uint32_t qa[HT][4], da[HT][4];
    fa_frag_a<E, HT>(qa, K, w * 16, g.ld);
    fa_frag_a<E, HT>(da, V, w * 16, g.ld);
    const int64_t q[2] = {q0 + w * 16 + lane / 4, q0 + w * 16 + lane / 4 + 8};
    float lse_r[2], D_r[2], dQ[2 * HT][4] = {};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lse_r[r] = q[r] < g.T ? lse[bh * g.T + q[r]] * FA_LOG2E : 0.0f; /* base 2 */
        D_r[r] = q[r] < g.T ? D[bh * g.T + q[r]] : 0.0f;
    }
    for (int64_t j = 0; j <= i; j++) {
        const int64_t k0 = j * FA_BC;
        __syncthreads(); /* every warp is done with the last tile's K and V (or Q and dy) */
        fa_load(K, head + g.C, row3, k0, g);
        fa_load(V, head + 2 * g.C, row3, k0, g);
        __syncthreads();
        float s[FA_BC / 8][4], dp[FA_BC / 8][4];
        fa_mm_rows<E, HT>(s, qa, K, g.ld);
        fa_mm_rows<E, HT>(dp, da, V, g.ld);
#pragma unroll
        for (int n = 0; n < FA_BC / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) { /* dS: query row e >> 1, key column */
                const int64_t k = k0 + n * 8 + 2 * tq + (e & 1), qr = q[e >> 1];
                const float p = k <= qr && qr < g.T ? exp2f(s[n][e] * sl - lse_r[e >> 1]) : 0.0f;
                dp[n][e] = p * (dp[n][e] - D_r[e >> 1]);
            }
        fa_mm_acc<E, HT>(dQ, dp, K, g.ld);
    }
    fa_store_rows<E, HT>(dqkv + off, row3, dQ, q0 + w * 16, g.scale, g.T);
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

/* bf16 and f16: the mma.sync kernel for heads of 16 HT. */
template <typename E, int HT>
static int fa_forward_mma(cu_device *d, int idx, tdm_tensor *y, tdm_tensor *lse,
                          const tdm_tensor *qkv, fa_geom g, unsigned blocks) {
    const size_t smem = 3 * fa_round(FA_BR * g.ld * sizeof(E));
    if (fa_launch_check(fa_fwd_mma_kernel<E, HT>, smem, "flash attention", idx))
        return tdm_last_status();
    fa_fwd_mma_kernel<E, HT>
        <<<blocks, FA_THREADS, smem, d->compute>>>(cu_p<E>(qkv), cu_p<E>(y), cu_f(lse), g);
    return cu_check_launch("flash attention", idx);
}

template <typename E>
static int fa_forward(cu_device *d, int idx, tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv,
                      fa_geom g) {
    const unsigned blocks = (unsigned)(g.B * g.nh * ((g.T + FA_BR - 1) / FA_BR));
    if constexpr (sizeof(E) == 2) {
        switch (g.hs / 16) { /* tdm_cuda_flash_fits: hs a multiple of 16 up to 128 */
        case 1:
            return fa_forward_mma<E, 1>(d, idx, y, lse, qkv, g, blocks);
        case 2:
            return fa_forward_mma<E, 2>(d, idx, y, lse, qkv, g, blocks);
        case 3:
            return fa_forward_mma<E, 3>(d, idx, y, lse, qkv, g, blocks);
        case 4:
            return fa_forward_mma<E, 4>(d, idx, y, lse, qkv, g, blocks);
        case 5:
            return fa_forward_mma<E, 5>(d, idx, y, lse, qkv, g, blocks);
        case 6:
            return fa_forward_mma<E, 6>(d, idx, y, lse, qkv, g, blocks);
        case 7:
            return fa_forward_mma<E, 7>(d, idx, y, lse, qkv, g, blocks);
        default:
            return fa_forward_mma<E, 8>(d, idx, y, lse, qkv, g, blocks);
        }
    } else {
        const size_t smem = fa_smem_fwd(g.hs, g.ld, sizeof(E));
        if (fa_launch_check(fa_fwd_kernel, smem, "flash attention", idx)) return tdm_last_status();
        fa_fwd_kernel<<<blocks, FA_THREADS, smem, d->compute>>>(cu_f(qkv), cu_f(y), cu_f(lse), g);
        return cu_check_launch("flash attention", idx);
    }
}

/* The backward's two kernels: on mma.sync for bf16 and f16 heads of 16 HT (HT > 0), else the
 * shared-memory ones. */
template <typename E, int HT>
static int fa_backward_kernels(cu_device *d, int idx, E *gq, const E *gy, const E *x,
                               const float *lse, const float *D, fa_geom g) {
    const size_t s_kv = fa_smem_dkv(g.hs, g.ld, sizeof(E)), s_q = fa_smem_dq(g.hs, g.ld, sizeof(E));
    const unsigned blocks = (unsigned)(g.B * g.nh * ((g.T + FA_BR - 1) / FA_BR));
    const char *what = "flash attention_backward";
    int rc;
    if constexpr (HT > 0 && sizeof(E) == 2) {
        if ((rc = fa_launch_check(fa_dkv_mma_kernel<E, HT>, s_kv, what, idx))) return rc;
        fa_dkv_mma_kernel<E, HT><<<blocks, FA_THREADS, s_kv, d->compute>>>(gq, gy, x, lse, D, g);
        if ((rc = cu_check_launch("flash attention_backward (dk, dv)", idx))) return rc;
        if ((rc = fa_launch_check(fa_dq_mma_kernel<E, HT>, s_q, what, idx))) return rc;
        fa_dq_mma_kernel<E, HT><<<blocks, FA_THREADS, s_q, d->compute>>>(gq, gy, x, lse, D, g);
    } else {
        if ((rc = fa_launch_check(fa_dkv_kernel<E>, s_kv, what, idx))) return rc;
        fa_dkv_kernel<E><<<blocks, FA_THREADS, s_kv, d->compute>>>(gq, gy, x, lse, D, g);
        if ((rc = cu_check_launch("flash attention_backward (dk, dv)", idx))) return rc;
        if ((rc = fa_launch_check(fa_dq_kernel<E>, s_q, what, idx))) return rc;
        fa_dq_kernel<E><<<blocks, FA_THREADS, s_q, d->compute>>>(gq, gy, x, lse, D, g);
    }
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
        switch (fa_frag_tiles(g.hs, sizeof(E))) {
        case 1:
            rc = fa_backward_kernels<E, 1>(d, idx, gq, gy, x, cu_f(lse), D, g);
            break;
        case 2:
            rc = fa_backward_kernels<E, 2>(d, idx, gq, gy, x, cu_f(lse), D, g);
            break;
        case 3:
            rc = fa_backward_kernels<E, 3>(d, idx, gq, gy, x, cu_f(lse), D, g);
            break;
        case 4:
            rc = fa_backward_kernels<E, 4>(d, idx, gq, gy, x, cu_f(lse), D, g);
            break;
        default:
            rc = fa_backward_kernels<E, 0>(d, idx, gq, gy, x, cu_f(lse), D, g);
        }
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
