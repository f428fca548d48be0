/* The fused attention on mma.sync (sm_80 on): FlashAttention-2's kernels, the scores and sums
 * in registers, in bf16 and f16 for heads of 16 to 128, and in f32 for heads up to 64 with each
 * product as three TF32 products (fa_kind; cuda_flash.cu dispatches here and holds the f32
 * kernels on the CUDA cores, whose tiles live in shared memory).
 *
 * PTX's m16n8k16 product has documented fragment layouts (WMMA's are not), so a thread knows
 * which rows and columns its accumulators hold: with g = lane / 4 and t = lane % 4, A [16, 16]
 * row-major gives register r the pair (row g + 8 (r & 1), columns 2t + 8 (r >> 1), + 1); B
 * [16, 8] column-major register r the pair (rows 2t + 8r, + 1; column g); the accumulator d[i]
 * sits at (row g + 8 (i >> 1), column 2t + (i & 1)); a pair's first element in the low half.
 * So each warp owns 16 rows of the block's 64 (at heads up to 64, two tiles of 16 of the
 * block's 128: each fragment it reads from shared memory feeds both, FlashAttention-2's forward
 * tiling at those heads) and does all of their work: the softmax, the masks and the rescales
 * run on registers, a row's maximum takes two shuffles in its quad (the 4 lanes of one g), and
 * an accumulator tile pair becomes the next product's A operand in place (two 8-column tiles
 * are one 16-column A tile). Tiles come from shared memory through ldmatrix (.trans for the
 * operands whose rows are the product's k), and the next tile of K and V (or Q and dy) loads
 * with cp.async while the warps work on this one: one barrier a tile. Exponentials are base 2
 * (one multiply-add and exp2 a score, as FlashAttention-2): scores scaled by scale log2(e),
 * maxima in those units, lse (natural) converted in and out. Only the diagonal tiles (and a
 * last, partial one) need the causal and length masks.
 *
 *   forward   warp rows of query tile i, key tiles j <= i: S, m, P, l, O as cuda_flash.cu
 *   dK, dV    warp rows of key tile j, query tiles i >= j: S^T = K Q^T, dP^T = V dy^T,
 *             P^T, dS^T = P^T (dP^T - D), dV += P^T dy, dK += dS^T Q
 *   dQ        warp rows of query tile i, key tiles j <= i: S, dP, dS, dQ += dS K
 * The emulation (emu/emu_mma.h) runs mma.sync, ldmatrix and the shuffles as collectives of the
 * block (emu_warp_exchange), so every thread of a block reaches each of them. */
#include "backend/cuda/cuda_flash.cuh"

#include <math.h>
#include <string.h>
#include <type_traits>
#ifdef TDM_CUDA_EMU
#include "emu_mma.h"
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800 && !defined(TDM_CUDA_EMU)
#define FA_NO_MMA 1 /* tdm_cuda_flash_fits declines bf16 and f16 before sm_80 */
#endif

/* ---- the warp's instructions ------------------------------------------------------------- */

/* What an element type asks of the products. bf16 and f16: one m16n8k16 a product. f32: three
 * m16n8k8 in TF32 ("3xTF32", CUTLASS's OpMultiplyAddFastF32, the arithmetic of PyTorch's
 * memory-efficient attention in f32 from sm_80): each operand split as x = big + small, two
 * TF32 values (11 significant bits each), and a b taken as big_a big_b + big_a small_b +
 * small_a big_b, about 22 of f32's 24 bits a product, summed in f32. KS: the products' k steps
 * a 16-column tile of a head takes (32 bytes of a row either way); A: registers an A fragment
 * holds (f32: big, then small); B: registers of a B fragment (f32: big, then small). */
template <typename E> struct fa_kind {
    static constexpr bool tf32 = sizeof(E) == 4;
    static constexpr int KS = tf32 ? 2 : 1, A = tf32 ? 8 : 4, B = tf32 ? 4 : 2;
};

__device__ __forceinline__ uint32_t fa_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
__device__ __forceinline__ float fa_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* x as big + small, CUTLASS's FastF32 split: big x truncated to TF32 (its 13 low bits cleared),
 * small the rest (exact in f32) with half a TF32 ulp added to its bits, so that the tensor core,
 * which truncates an f32 operand to TF32 as it reads it (the emulation does the same), takes it
 * rounded to nearest: three instructions a register, and big + small keep 22 of x's 24 bits. */
__device__ __forceinline__ void fa_split(uint32_t x, uint32_t &big, uint32_t &small) {
    big = x & 0xffffe000u;
    small = fa_bits(fa_float(x) - fa_float(big)) + 0x1000u;
}

/* d += A B, m16n8k8 in TF32, f32 accumulation (PTX's layouts: A's register r holds (row g + 8
 * (r & 1), column t + 4 (r >> 1)), B's register r (row t + 4r, column g), d as m16n8k16's). */
__device__ __forceinline__ void fa_mma_tf32(float d[4], const uint32_t a[4], uint32_t b0,
                                            uint32_t b1) {
#if defined(TDM_CUDA_EMU)
    emu_mma_m16n8k8_tf32(d, a, b0, b1);
#elif defined(FA_NO_MMA)
    __trap();
#else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/* d += A B, m16n8k16, f32 accumulation (the layouts at the top). */
template <typename E>
__device__ __forceinline__ void fa_mma16(float d[4], const uint32_t a[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(TDM_CUDA_EMU)
    emu_mma_m16n8k16<E>(d, a, b0, b1);
#elif defined(FA_NO_MMA)
    __trap();
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

/* d += A B for one k step (fa_kind): m16n8k16, or in f32 the three TF32 products, the small
 * terms first. */
template <typename E>
__device__ __forceinline__ void fa_mma(float d[4], const uint32_t *a, const uint32_t *b) {
    if constexpr (fa_kind<E>::tf32) {
        fa_mma_tf32(d, a + 4, b[0], b[1]);
        fa_mma_tf32(d, a, b[2], b[3]);
        fa_mma_tf32(d, a, b[0], b[1]);
    } else {
        fa_mma16<E>(d, a, b[0], b[1]);
    }
}

/* Four 8 x 8 tiles of 2-byte elements from shared memory: lane l gives row l % 8 of tile l / 8
 * (16-byte aligned); register i gets tile i's pair (row g, columns 2t, + 1), or with TRANS its
 * pair (rows 2t, + 1; column g): an A or B register of fa_mma either way. */
template <bool TRANS> __device__ __forceinline__ void fa_ldsm(uint32_t r[4], const void *row) {
#if defined(TDM_CUDA_EMU)
    emu_ldmatrix_x4(r, row, TRANS);
#elif defined(FA_NO_MMA)
    __trap();
#else
    const unsigned a = (unsigned)__cvta_generic_to_shared(row);
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
#endif
}

/* Two floats rounded to E as one register, lo in the low half. */
template <typename E> __device__ __forceinline__ uint32_t fa_pack(float lo, float hi) {
#if defined(TDM_CUDA_EMU)
    E l = cu_to<E>(lo), h = cu_to<E>(hi);
    uint16_t a, b;
    memcpy(&a, &l, 2);
    memcpy(&b, &h, 2);
    return (uint32_t)a | (uint32_t)b << 16;
#else
    uint32_t u;
    if constexpr (std::is_same<E, __nv_bfloat16>::value) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        memcpy(&u, &v, 4);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        memcpy(&u, &v, 4);
    }
    return u;
#endif
}

/* ---- tiles ---------------------------------------------------------------------------------- */

/* The A fragments of rows [r0, r0 + 16) of a tile, 16 HT columns (HT KS k steps; the tile's
 * rows ld elements apart). ldmatrix moves 2-byte halves: an f32 row's 8 columns of a k step
 * are its 16 halves, and register i of the four then holds (row g + 8 (i & 1), column t + 4
 * (i >> 1)): TF32's A layout. */
template <typename E, int HT>
__device__ __forceinline__ void fa_frag_a(uint32_t a[HT * fa_kind<E>::KS][fa_kind<E>::A],
                                          const E *tile, int r0, int ld) {
    const int lane = threadIdx.x % 32, m = lane / 8, r = lane % 8;
    const char *row = (const char *)(tile + (r0 + (m & 1) * 8 + r) * ld) + (m >> 1) * 16;
#pragma unroll
    for (int kk = 0; kk < HT * fa_kind<E>::KS; kk++) {
        if constexpr (fa_kind<E>::tf32) {
            uint32_t x[4];
            fa_ldsm<false>(x, row + kk * 32);
#pragma unroll
            for (int i = 0; i < 4; i++) fa_split(x[i], a[kk][i], a[kk][4 + i]);
        } else {
            fa_ldsm<false>(a[kk], row + kk * 32);
        }
    }
}

/* c[t] [16, 8 NB] = a[t] b^T for the warp's MT tiles of 16 rows: a[t] their A fragments (HT
 * 16-column tiles each), b 8 NB rows of a tile (row n of b is column n of c[t]). Each B
 * fragment is read from shared memory (and in f32 split) once for the MT tiles: with two, half
 * the reads a product. */
template <typename E, int HT, int NB, int MT>
__device__ __forceinline__ void fa_mm_rows(float c[MT][NB][4],
                                           const uint32_t a[MT][HT * fa_kind<E>::KS][fa_kind<E>::A],
                                           const E *b, int ld) {
    const int lane = threadIdx.x % 32, m = lane / 8, r = lane % 8;
#pragma unroll
    for (int t = 0; t < MT; t++)
#pragma unroll
        for (int n = 0; n < NB; n++) c[t][n][0] = c[t][n][1] = c[t][n][2] = c[t][n][3] = 0.0f;
#pragma unroll
    for (int n = 0; n < NB; n += 2)
#pragma unroll
        for (int kk = 0; kk < HT * fa_kind<E>::KS; kk++) {
            uint32_t bb[4], b0[fa_kind<E>::B], b1[fa_kind<E>::B]; /* columns n and n + 1's */
            fa_ldsm<false>(bb, (const char *)(b + ((n + (m >> 1)) * 8 + r) * ld) + kk * 32 +
                                   (m & 1) * 16);
            if constexpr (fa_kind<E>::tf32) {
                fa_split(bb[0], b0[0], b0[2]), fa_split(bb[1], b0[1], b0[3]);
                fa_split(bb[2], b1[0], b1[2]), fa_split(bb[3], b1[1], b1[3]);
            } else {
                b0[0] = bb[0], b0[1] = bb[1], b1[0] = bb[2], b1[1] = bb[3];
            }
#pragma unroll
            for (int t = 0; t < MT; t++) {
                fa_mma<E>(c[t][n], a[t][kk], b0);
                fa_mma<E>(c[t][n + 1], a[t][kk], b1);
            }
        }
}

/* fa_mm_acc in f32: c[t] [16, 16 HT] += a[t] b, a[t] [16, 8 NB] as accumulators, one k step
 * an accumulator tile. A thread's accumulators hold columns 2t and 2t + 1 where TF32's A layout
 * wants t and t + 4: the step's 8 keys are taken in the order 0, 2, 4, 6, 1, 3, 5, 7 (a sum's
 * order is free), so the registers serve as they are, and B's rows (k) are read in that order
 * too, a float at a time (ldmatrix cannot transpose 4-byte elements; with rows hs + 4 floats
 * apart, keys 2t and 2t' are 8 (t - t') apart mod 32: the warp's reads fall in distinct banks). */
template <int HT, int NB, int MT>
__device__ __forceinline__ void fa_mm_acc_tf32(float c[MT][2 * HT][4], const float a[MT][NB][4],
                                               const float *b, int ld) {
    const int lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
#pragma unroll
    for (int kk = 0; kk < NB; kk++) {
        uint32_t pa[MT][8];
#pragma unroll
        for (int t = 0; t < MT; t++) {
            fa_split(fa_bits(a[t][kk][0]), pa[t][0], pa[t][4]);
            fa_split(fa_bits(a[t][kk][2]), pa[t][1], pa[t][5]);
            fa_split(fa_bits(a[t][kk][1]), pa[t][2], pa[t][6]);
            fa_split(fa_bits(a[t][kk][3]), pa[t][3], pa[t][7]);
        }
        const float *k0 = b + (kk * 8 + 2 * tq) * ld + g, *k1 = k0 + ld; /* keys 2t, 2t + 1 */
#pragma unroll
        for (int d = 0; d < 2 * HT; d++) {
            uint32_t bv[4];
            fa_split(fa_bits(k0[d * 8]), bv[0], bv[2]);
            fa_split(fa_bits(k1[d * 8]), bv[1], bv[3]);
#pragma unroll
            for (int t = 0; t < MT; t++) fa_mma<float>(c[t][d], pa[t], bv);
        }
    }
}

/* c[t] [16, 16 HT] += a[t] b for the warp's MT tiles of 16 rows: a[t] [16, 8 NB] as
 * accumulators (rounded to E into A fragments in place), b [8 NB, 16 HT] rows of a tile, each
 * B fragment read once for the MT tiles. */
template <typename E, int HT, int NB, int MT>
__device__ __forceinline__ void fa_mm_acc(float c[MT][2 * HT][4], const float a[MT][NB][4],
                                          const E *b, int ld) {
    if constexpr (fa_kind<E>::tf32) {
        fa_mm_acc_tf32<HT, NB, MT>(c, a, b, ld);
    } else {
        const int lane = threadIdx.x % 32, m = lane / 8, r = lane % 8;
        uint32_t pa[MT][NB / 2][4];
#pragma unroll
        for (int t = 0; t < MT; t++)
#pragma unroll
            for (int n = 0; n < NB; n++) {
                pa[t][n / 2][2 * (n % 2)] = fa_pack<E>(a[t][n][0], a[t][n][1]);
                pa[t][n / 2][2 * (n % 2) + 1] = fa_pack<E>(a[t][n][2], a[t][n][3]);
            }
#pragma unroll
        for (int d = 0; d < 2 * HT; d += 2)
#pragma unroll
            for (int kk = 0; kk < NB / 2; kk++) {
                uint32_t bb[4]; /* columns d and d + 1's B registers, b's rows their k */
                fa_ldsm<true>(bb, b + (kk * 16 + (m & 1) * 8 + r) * ld + (d + (m >> 1)) * 8);
#pragma unroll
                for (int t = 0; t < MT; t++) {
                    fa_mma<E>(c[t][d], pa[t][kk], bb);
                    fa_mma<E>(c[t][d + 1], pa[t][kk], bb + 2);
                }
            }
    }
}

/* The warp's rows of a [16, 16 HT] result times scale into out (row stride rs), the warp's first
 * row being `first`; rows at or past T left out. */
template <typename E, int HT>
__device__ __forceinline__ void fa_store_rows(E *out, int64_t rs, const float c[2 * HT][4],
                                              int64_t first, float scale, int64_t T) {
    const int lane = threadIdx.x % 32;
    const bool pairs = (uintptr_t)out % (2 * sizeof(E)) == 0 && rs % 2 == 0; /* one store */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t row = first + lane / 4 + 8 * r;
        if (row >= T) continue;
        E *o = out + row * rs + 2 * (lane % 4);
#pragma unroll
        for (int d = 0; d < 2 * HT; d++) {
            const float lo = c[d][2 * r] * scale, hi = c[d][2 * r + 1] * scale;
            if (pairs) {
                if constexpr (fa_kind<E>::tf32)
                    *(float2 *)(o + d * 8) = make_float2(lo, hi);
                else
                    *(uint32_t *)(o + d * 8) = fa_pack<E>(lo, hi);
            } else {
                o[d * 8] = cu_to<E>(lo);
                o[d * 8 + 1] = cu_to<E>(hi);
            }
        }
    }
}

/* Key tiles from 0 to the one holding row `end` - 1, or T - 1 if that comes first. */
__device__ __forceinline__ int64_t fa_key_tiles(int64_t end, fa_geom g) {
    const int64_t to_T = (g.T + FA_BC - 1) / FA_BC, to_end = (end + FA_BC - 1) / FA_BC;
    return to_T < to_end ? to_T : to_end;
}

/* ---- forward ------------------------------------------------------------------------------ */

/* One block: query tile i (64 MT rows) of head h of batch row b, the last tiles (the most work)
 * first; warp w owns rows [16 MT w, 16 MT (w + 1)) of it. With MT 2 the block's rows reach into
 * two key tiles on the diagonal: the second is past every row of warps 0 and 1, which run it
 * masked (P is 0 and the rescale 1: their sums do not move) rather than leave the collective
 * instructions the emulation runs a block at a time. */
template <typename E, int HT, int MT>
__global__ void __launch_bounds__(FA_THREADS)
    fa_fwd_mma_kernel(const E *qkv, E *y, float *lse, fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    constexpr int BR = FA_BC * MT;
    const int64_t nt = (g.T + BR - 1) / BR, i = nt - 1 - blockIdx.x % nt;
    const int64_t bh = blockIdx.x / nt, b = bh / g.nh, h = bh % g.nh, q0 = i * BR;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, tq = lane % 4;
    const int64_t r0 = q0 + w * 16 * MT; /* the warp's first row */
    const float sl = g.scale * FA_LOG2E;
    fa_carve cv = {fa_smem, 0};
    /* K and V twice: tile j + 1 loads into one pair while the warps work on the other */
    E *Q = fa_take<E>(&cv, BR * g.ld), *K0 = fa_take<E>(&cv, FA_BC * g.ld);
    E *V0 = fa_take<E>(&cv, FA_BC * g.ld), *K1 = fa_take<E>(&cv, FA_BC * g.ld);
    E *V1 = fa_take<E>(&cv, FA_BC * g.ld);
    const int64_t rl = 3 * g.C;
    const E *head = qkv + b * g.T * rl + h * g.hs;
    /* the key tiles up to the block's last row or T */
    const int64_t nk = fa_key_tiles(q0 + BR, g);
    /* the first K and V tiles on their way while Q loads */
    fa_load_async(K0, head + g.C, rl, 0, FA_BC, g);
    fa_load_async(V0, head + 2 * g.C, rl, 0, FA_BC, g);
    fa_commit_loads();
    fa_load(Q, head, rl, q0, BR, g);
    __syncthreads();
    uint32_t qa[MT][HT * fa_kind<E>::KS][fa_kind<E>::A];
    int64_t row[MT][2];
    float o[MT][2 * HT][4] = {}, m[MT][2], l[MT][2];
#pragma unroll
    for (int t = 0; t < MT; t++) {
        fa_frag_a<E, HT>(qa[t], Q, (int)(r0 - q0) + 16 * t, g.ld);
        row[t][0] = r0 + 16 * t + lane / 4, row[t][1] = row[t][0] + 8;
        m[t][0] = m[t][1] = -INFINITY, l[t][0] = l[t][1] = 0.0f;
    }
    for (int64_t j = 0; j < nk; j++) {
        const int64_t k0 = j * FA_BC;
        fa_wait_loads();
        __syncthreads();        /* tile j is in; every warp is done with tile j - 1's buffers */
        const bool odd = j & 1; /* tile j in K1 and V1 */
        if (j + 1 < nk) {
            fa_load_async(odd ? K0 : K1, head + g.C, rl, k0 + FA_BC, FA_BC, g);
            fa_load_async(odd ? V0 : V1, head + 2 * g.C, rl, k0 + FA_BC, FA_BC, g);
            fa_commit_loads();
        }
        /* keys past one of the warp's rows or T: the diagonal tiles and a last, partial one */
        const bool edge = k0 + FA_BC - 1 > r0 || k0 + FA_BC > g.T;
        float s[MT][FA_BC / 8][4];
        fa_mm_rows<E, HT, FA_BC / 8, MT>(s, qa, odd ? K1 : K0, g.ld);
#pragma unroll
        for (int t = 0; t < MT; t++) {
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int n = 0; n < FA_BC / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float v = s[t][n][e] * sl;
                    if (edge) {
                        const int64_t k = k0 + n * 8 + 2 * tq + (e & 1);
                        if (k > row[t][e >> 1] || k >= g.T) v = -INFINITY;
                    }
                    s[t][n][e] = v, mx[e >> 1] = fmaxf(mx[e >> 1], v);
                }
            float alpha[2];
#pragma unroll
            for (int r = 0; r < 2; r++) alpha[r] = fa_rescale<4>(mx[r], m[t][r], l[t][r]);
#pragma unroll
            for (int n = 0; n < FA_BC / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) { /* P (masked scores give 0); l sums it unrounded */
                    s[t][n][e] = exp2f(s[t][n][e] - m[t][e >> 1]);
                    l[t][e >> 1] += s[t][n][e];
                }
#pragma unroll
            for (int d = 0; d < 2 * HT; d++) {
                o[t][d][0] *= alpha[0], o[t][d][1] *= alpha[0];
                o[t][d][2] *= alpha[1], o[t][d][3] *= alpha[1];
            }
        }
        fa_mm_acc<E, HT, FA_BC / 8, MT>(o, s, odd ? V1 : V0, g.ld);
    }
#pragma unroll
    for (int t = 0; t < MT; t++) {
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            l[t][r] = fa_row_sum<4>(l[t][r]);
            inv[r] = 1.0f / l[t][r];
            if (tq == 0 && row[t][r] < g.T)
                lse[bh * g.T + row[t][r]] = m[t][r] * FA_LN2 + logf(l[t][r]);
        }
#pragma unroll
        for (int d = 0; d < 2 * HT; d++) {
            o[t][d][0] *= inv[0], o[t][d][1] *= inv[0];
            o[t][d][2] *= inv[1], o[t][d][3] *= inv[1];
        }
        fa_store_rows<E, HT>(y + b * g.T * g.C + h * g.hs, g.C, o[t], r0 + 16 * t, 1.0f, g.T);
    }
}

/* ---- backward ----------------------------------------------------------------------------- */

/* One block: key tile j (64 MT keys) of a head, over the query tiles from its first key on;
 * warp w owns keys [16 MT w, 16 MT (w + 1)): dK and dV. With MT 2 the first query tile is
 * before every key of warps 2 and 3, which run it masked (P and dS are 0). */
template <typename E, int HT, int MT>
__global__ void __launch_bounds__(FA_THREADS)
    fa_dkv_mma_kernel(E *dqkv, const E *dy, const E *qkv, const float *lse, const float *D,
                      fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    constexpr int BK = FA_BC * MT, QC = 32 / MT; /* keys a block; queries a step */
    const int64_t nk = (g.T + BK - 1) / BK, j = blockIdx.x % nk, bh = blockIdx.x / nk;
    const int64_t b = bh / g.nh, h = bh % g.nh, k0 = j * BK, nq = (g.T + FA_BR - 1) / FA_BR;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, tq = lane % 4;
    const int64_t i0 = k0 / FA_BR, kw = k0 + w * 16 * MT; /* the warp's first key */
    const float sl = g.scale * FA_LOG2E;
    fa_carve cv = {fa_smem, 0};
    E *K = fa_take<E>(&cv, BK * g.ld), *V = fa_take<E>(&cv, BK * g.ld);
    /* Q, dy and the rows' lse and D twice: tile i + 1 loads into one set while the warps work
     * on the other (set u at base u) */
    E *Q0 = fa_take<E>(&cv, FA_BR * g.ld), *dO0 = fa_take<E>(&cv, FA_BR * g.ld);
    float *lse0 = fa_take<float>(&cv, FA_BR), *D0 = fa_take<float>(&cv, FA_BR);
    const size_t set = cv.used - ((char *)Q0 - fa_smem); /* bytes a set takes */
    auto at = [&](auto *p, int u) { return (decltype(p))((char *)p + u * set); };
    const int64_t rl = 3 * g.C, off = b * g.T * rl + h * g.hs;
    const E *head = qkv + off, *dyh = dy + b * g.T * g.C + h * g.hs;
    const float *lh = lse + bh * g.T, *Dh = D + bh * g.T;
    /* query tile i into buffer u: Q, dy, and its rows' lse and D (0 past T: masked below) */
    auto load = [&](int64_t i, int u) {
        fa_load_async(at(Q0, u), head, rl, i * FA_BR, FA_BR, g);
        fa_load_async(at(dO0, u), dyh, g.C, i * FA_BR, FA_BR, g);
        if (threadIdx.x < FA_BR) {
            const int64_t q = i * FA_BR + threadIdx.x;
            fa_cp<4>(at(lse0, u) + threadIdx.x, q < g.T ? lh + q : lh, q < g.T ? 4 : 0);
            fa_cp<4>(at(D0, u) + threadIdx.x, q < g.T ? Dh + q : Dh, q < g.T ? 4 : 0);
        }
        fa_commit_loads();
    };
    load(i0, 0); /* on its way while K and V load */
    fa_load(K, head + g.C, rl, k0, BK, g);
    fa_load(V, head + 2 * g.C, rl, k0, BK, g);
    float dK[MT][2 * HT][4] = {}, dV[MT][2 * HT][4] = {};
    int64_t key[MT][2];
#pragma unroll
    for (int t = 0; t < MT; t++) key[t][0] = kw + 16 * t + lane / 4, key[t][1] = key[t][0] + 8;
    for (int64_t i = i0; i < nq; i++) {
        const int64_t q0 = i * FA_BR;
        const int u = (int)((i - i0) & 1);
        fa_wait_loads();
        __syncthreads(); /* tile i is in; every warp is done with tile i - 1's buffers */
        if (i + 1 < nq) load(i + 1, u ^ 1);
        const E *Q = at(Q0, u), *dO = at(dO0, u);
        const float *lse_s = at(lse0, u), *D_s = at(D0, u);
        /* queries before one of the warp's keys, or past T: the diagonal tiles and a last one */
        const bool edge = q0 < kw + 16 * MT - 1 || q0 + FA_BR > g.T;
#pragma unroll 1
        for (int c0 = 0; c0 < FA_BR; c0 += QC) { /* QC queries at a time: fewer registers */
            float s[MT][QC / 8][4], dp[MT][QC / 8][4];
            {
                uint32_t a[MT][HT * fa_kind<E>::KS][fa_kind<E>::A];
#pragma unroll
                for (int t = 0; t < MT; t++)
                    fa_frag_a<E, HT>(a[t], K, (int)(kw - k0) + 16 * t, g.ld);
                fa_mm_rows<E, HT, QC / 8, MT>(s, a, Q + c0 * g.ld, g.ld);
#pragma unroll
                for (int t = 0; t < MT; t++)
                    fa_frag_a<E, HT>(a[t], V, (int)(kw - k0) + 16 * t, g.ld);
                fa_mm_rows<E, HT, QC / 8, MT>(dp, a, dO + c0 * g.ld, g.ld);
            }
#pragma unroll
            for (int t = 0; t < MT; t++)
#pragma unroll
                for (int n = 0; n < QC / 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) { /* P^T and dS^T: key row e >> 1, query c */
                        const int c = c0 + n * 8 + 2 * tq + (e & 1);
                        const int64_t q = q0 + c;
                        float p = exp2f(s[t][n][e] * sl - lse_s[c] * FA_LOG2E);
                        if (edge && (key[t][e >> 1] > q || q >= g.T)) p = 0.0f;
                        s[t][n][e] = p, dp[t][n][e] = p * (dp[t][n][e] - D_s[c]);
                    }
            fa_mm_acc<E, HT, QC / 8, MT>(dV, s, dO + c0 * g.ld, g.ld);
            fa_mm_acc<E, HT, QC / 8, MT>(dK, dp, Q + c0 * g.ld, g.ld);
        }
    }
    E *gh = dqkv + off;
#pragma unroll
    for (int t = 0; t < MT; t++) {
        fa_store_rows<E, HT>(gh + g.C, rl, dK[t], kw + 16 * t, g.scale, g.T);
        fa_store_rows<E, HT>(gh + 2 * g.C, rl, dV[t], kw + 16 * t, 1.0f, g.T);
    }
}

/* One block: query tile i (64 MT rows) of a head, over the key tiles up to its last row; warp w
 * owns queries [16 MT w, 16 MT (w + 1)): dQ. As the forward, warps whose rows a key tile is past
 * run it masked (dS is 0). */
template <typename E, int HT, int MT>
__global__ void __launch_bounds__(FA_THREADS)
    fa_dq_mma_kernel(E *dqkv, const E *dy, const E *qkv, const float *lse, const float *D,
                     fa_geom g) {
    extern __shared__ __align__(128) char fa_smem[];
    constexpr int BR = FA_BC * MT, KC = MT == 1 ? 32 : 16; /* keys a step: KC / 8 columns */
    const int64_t nt = (g.T + BR - 1) / BR, i = nt - 1 - blockIdx.x % nt;
    const int64_t bh = blockIdx.x / nt, b = bh / g.nh, h = bh % g.nh, q0 = i * BR;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, tq = lane % 4;
    const int64_t r0 = q0 + w * 16 * MT; /* the warp's first row */
    const float sl = g.scale * FA_LOG2E;
    fa_carve cv = {fa_smem, 0};
    /* K and V twice: tile j + 1 loads into one pair while the warps work on the other; Q and dy
     * pass through the second pair where they fit in it (MT 1), else through their own */
    E *K0 = fa_take<E>(&cv, FA_BC * g.ld), *V0 = fa_take<E>(&cv, FA_BC * g.ld);
    E *K1 = fa_take<E>(&cv, FA_BC * g.ld), *V1 = fa_take<E>(&cv, FA_BC * g.ld);
    E *Qs = MT == 1 ? K1 : fa_take<E>(&cv, BR * g.ld),
      *dOs = MT == 1 ? V1 : fa_take<E>(&cv, BR * g.ld);
    const int64_t rl = 3 * g.C, off = b * g.T * rl + h * g.hs, nk = fa_key_tiles(q0 + BR, g);
    const E *head = qkv + off;
    fa_load_async(K0, head + g.C, rl, 0, FA_BC, g); /* on their way while Q and dy load */
    fa_load_async(V0, head + 2 * g.C, rl, 0, FA_BC, g);
    fa_commit_loads();
    fa_load(Qs, head, rl, q0, BR, g);
    fa_load(dOs, dy + b * g.T * g.C + h * g.hs, g.C, q0, BR, g);
    __syncthreads();
    uint32_t qa[MT][HT * fa_kind<E>::KS][fa_kind<E>::A], da[MT][HT * fa_kind<E>::KS][fa_kind<E>::A];
    int64_t q[MT][2];
    float lse_r[MT][2], D_r[MT][2], dQ[MT][2 * HT][4] = {};
#pragma unroll
    for (int t = 0; t < MT; t++) {
        fa_frag_a<E, HT>(qa[t], Qs, (int)(r0 - q0) + 16 * t, g.ld);
        fa_frag_a<E, HT>(da[t], dOs, (int)(r0 - q0) + 16 * t, g.ld);
#pragma unroll
        for (int r = 0; r < 2; r++) { /* rows past T: lse +inf, so P is 0 */
            q[t][r] = r0 + 16 * t + lane / 4 + 8 * r;
            lse_r[t][r] = q[t][r] < g.T ? lse[bh * g.T + q[t][r]] * FA_LOG2E : INFINITY;
            D_r[t][r] = q[t][r] < g.T ? D[bh * g.T + q[t][r]] : 0.0f;
        }
    }
    for (int64_t j = 0; j < nk; j++) {
        const int64_t k0 = j * FA_BC;
        fa_wait_loads();
        __syncthreads(); /* tile j is in; every warp is done with tile j - 1's (or Q and dy) */
        const bool odd = j & 1; /* tile j in K1 and V1 */
        if (j + 1 < nk) {
            fa_load_async(odd ? K0 : K1, head + g.C, rl, k0 + FA_BC, FA_BC, g);
            fa_load_async(odd ? V0 : V1, head + 2 * g.C, rl, k0 + FA_BC, FA_BC, g);
            fa_commit_loads();
        }
        const E *K = odd ? K1 : K0, *V = odd ? V1 : V0;
        const bool edge = k0 + FA_BC - 1 > r0; /* keys past one of the warp's rows */
#pragma unroll 1
        for (int c0 = 0; c0 < FA_BC; c0 += KC) { /* KC keys at a time: fewer registers */
            float s[MT][KC / 8][4], dp[MT][KC / 8][4];
            fa_mm_rows<E, HT, KC / 8, MT>(s, qa, K + c0 * g.ld, g.ld);
            fa_mm_rows<E, HT, KC / 8, MT>(dp, da, V + c0 * g.ld, g.ld);
#pragma unroll
            for (int t = 0; t < MT; t++)
#pragma unroll
                for (int n = 0; n < KC / 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) { /* dS: query row e >> 1, key column */
                        float p = exp2f(s[t][n][e] * sl - lse_r[t][e >> 1]);
                        if (edge && k0 + c0 + n * 8 + 2 * tq + (e & 1) > q[t][e >> 1]) p = 0.0f;
                        dp[t][n][e] = p * (dp[t][n][e] - D_r[t][e >> 1]);
                    }
            fa_mm_acc<E, HT, KC / 8, MT>(dQ, dp, K + c0 * g.ld, g.ld);
        }
    }
#pragma unroll
    for (int t = 0; t < MT; t++)
        fa_store_rows<E, HT>(dqkv + off, rl, dQ[t], r0 + 16 * t, g.scale, g.T);
}

/* ---- host --------------------------------------------------------------------------------- */

/* The warps take two tiles of 16 rows (blocks of 128 queries, or keys in dK and dV: the
 * forward as FlashAttention-2's at heads of 64) where heads are up to FA_WIDE_HT 16s: each
 * fragment read from shared memory feeds twice the products (ldmatrix's reads a product: the
 * forward's and dQ's halved, dK and dV's 5/8 -> 1/2), each Q and dy tile loaded into dK and
 * dV's blocks serves twice the keys. Wider heads would spill the second tile's accumulators
 * (sm_90 at heads of 64: 255, 237 and 222 registers for the forward, dK dV and dQ, no spills). */
#define FA_WIDE_HT 4
static unsigned fa_wide = TDM_CUDA_FLASH_WIDE_ALL; /* tdm_cuda_flash_wide */

extern "C" void tdm_cuda_flash_wide(unsigned kernels) {
    __atomic_store_n(&fa_wide, kernels, __ATOMIC_RELAXED);
}
/* f32 always 1: its split fragments take twice bf16's registers */
int fa_mma_tiles(int64_t hs, size_t es, unsigned kernel) {
    return es == 2 && hs / 16 <= FA_WIDE_HT &&
                   (__atomic_load_n(&fa_wide, __ATOMIC_RELAXED) & kernel)
               ? 2
               : 1;
}

size_t fa_mma_smem_fwd(fa_geom g, size_t es) { /* Q, and K and V twice */
    const size_t tile = fa_round(FA_BC * g.ld * es);
    return fa_mma_tiles(g.hs, es, TDM_CUDA_FLASH_WIDE_FWD) * tile + 4 * tile;
}
size_t fa_mma_smem_dkv(fa_geom g, size_t es) { /* K, V and two sets of Q, dy, lse, D */
    const size_t tile = fa_round(FA_BC * g.ld * es);
    return 2 * fa_mma_tiles(g.hs, es, TDM_CUDA_FLASH_WIDE_DKV) * tile + 4 * tile +
           4 * fa_round(FA_BR * 4);
}
size_t fa_mma_smem_dq(fa_geom g, size_t es) { /* K and V twice, and Q and dy past MT 1 */
    const size_t tile = fa_round(FA_BC * g.ld * es);
    const int mt = fa_mma_tiles(g.hs, es, TDM_CUDA_FLASH_WIDE_DQ);
    return 4 * tile + (mt > 1 ? 2 * mt * tile : 0);
}

/* Launches kernel k with smem bytes of shared memory (over the 48 KiB a launch gets unasked). */
template <typename K> static int fa_allow(K *k, size_t smem, const char *what, int idx) {
    return cu_check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                    what, idx);
}

/* f(std::integral_constant<int, MT>) for the tiles a warp of kernel (a TDM_CUDA_FLASH_WIDE_
 * bit) takes. */
template <typename E, int HT, typename F> static int fa_by_tiles(int64_t hs, unsigned kernel, F f) {
    if constexpr (HT <= FA_WIDE_HT && !fa_kind<E>::tf32)
        if (fa_mma_tiles(hs, sizeof(E), kernel) == 2) return f(std::integral_constant<int, 2>());
    return f(std::integral_constant<int, 1>());
}

/* f(std::integral_constant<int, HT>) for heads of 16 HT: 1 to 8, in f32 1 to 4. */
template <typename E, typename F> static int fa_by_head(int64_t hs, F f) {
    switch (hs / 16) {
    case 1:
        return f(std::integral_constant<int, 1>());
    case 2:
        return f(std::integral_constant<int, 2>());
    case 3:
        return f(std::integral_constant<int, 3>());
    }
    if constexpr (fa_kind<E>::tf32) {
        return f(std::integral_constant<int, 4>());
    } else {
        switch (hs / 16) {
        case 4:
            return f(std::integral_constant<int, 4>());
        case 5:
            return f(std::integral_constant<int, 5>());
        case 6:
            return f(std::integral_constant<int, 6>());
        case 7:
            return f(std::integral_constant<int, 7>());
        default:
            return f(std::integral_constant<int, 8>());
        }
    }
}

template <typename E, int HT>
static int fa_forward_ht(cu_device *d, int idx, E *y, float *lse, const E *qkv, fa_geom g) {
    const size_t smem = fa_mma_smem_fwd(g, sizeof(E));
    return fa_by_tiles<E, HT>(g.hs, TDM_CUDA_FLASH_WIDE_FWD, [&](auto mt) -> int {
        constexpr int MT = decltype(mt)::value, BR = FA_BC * MT;
        const unsigned blocks = (unsigned)(g.B * g.nh * ((g.T + BR - 1) / BR));
        if (fa_allow(fa_fwd_mma_kernel<E, HT, MT>, smem, "flash attention", idx))
            return tdm_last_status();
        fa_fwd_mma_kernel<E, HT, MT><<<blocks, FA_THREADS, smem, d->compute>>>(qkv, y, lse, g);
        return cu_check_launch("flash attention", idx);
    });
}

template <typename E>
int fa_mma_forward(cu_device *d, int idx, E *y, float *lse, const E *qkv, fa_geom g) {
    return fa_by_head<E>(g.hs, [&](auto ht) -> int {
        return fa_forward_ht<E, decltype(ht)::value>(d, idx, y, lse, qkv, g);
    });
}

template <typename E, int HT>
static int fa_backward_ht(cu_device *d, int idx, E *gq, const E *gy, const E *x, const float *lse,
                          const float *D, fa_geom g) {
    const size_t s_kv = fa_mma_smem_dkv(g, sizeof(E)), s_q = fa_mma_smem_dq(g, sizeof(E));
    const char *what = "flash attention_backward";
    int rc = fa_by_tiles<E, HT>(g.hs, TDM_CUDA_FLASH_WIDE_DKV, [&](auto mt) -> int {
        constexpr int MT = decltype(mt)::value, BK = FA_BC * MT;
        const unsigned blocks = (unsigned)(g.B * g.nh * ((g.T + BK - 1) / BK));
        if (fa_allow(fa_dkv_mma_kernel<E, HT, MT>, s_kv, what, idx)) return tdm_last_status();
        fa_dkv_mma_kernel<E, HT, MT>
            <<<blocks, FA_THREADS, s_kv, d->compute>>>(gq, gy, x, lse, D, g);
        return cu_check_launch("flash attention_backward (dk, dv)", idx);
    });
    if (rc) return rc;
    return fa_by_tiles<E, HT>(g.hs, TDM_CUDA_FLASH_WIDE_DQ, [&](auto mt) -> int {
        constexpr int MT = decltype(mt)::value, BR = FA_BC * MT;
        const unsigned blocks = (unsigned)(g.B * g.nh * ((g.T + BR - 1) / BR));
        if (fa_allow(fa_dq_mma_kernel<E, HT, MT>, s_q, what, idx)) return tdm_last_status();
        fa_dq_mma_kernel<E, HT, MT><<<blocks, FA_THREADS, s_q, d->compute>>>(gq, gy, x, lse, D, g);
        return cu_check_launch("flash attention_backward (dq)", idx);
    });
}

template <typename E>
int fa_mma_backward(cu_device *d, int idx, E *dqkv, const E *dy, const E *qkv, const float *lse,
                    const float *D, fa_geom g) {
    return fa_by_head<E>(g.hs, [&](auto ht) -> int {
        return fa_backward_ht<E, decltype(ht)::value>(d, idx, dqkv, dy, qkv, lse, D, g);
    });
}

template int fa_mma_forward<__nv_bfloat16>(cu_device *, int, __nv_bfloat16 *, float *,
                                           const __nv_bfloat16 *, fa_geom);
template int fa_mma_forward<__half>(cu_device *, int, __half *, float *, const __half *, fa_geom);
template int fa_mma_backward<__nv_bfloat16>(cu_device *, int, __nv_bfloat16 *,
                                            const __nv_bfloat16 *, const __nv_bfloat16 *,
                                            const float *, const float *, fa_geom);
template int fa_mma_backward<__half>(cu_device *, int, __half *, const __half *, const __half *,
                                     const float *, const float *, fa_geom);
template int fa_mma_forward<float>(cu_device *, int, float *, float *, const float *, fa_geom);
template int fa_mma_backward<float>(cu_device *, int, float *, const float *, const float *,
                                    const float *, const float *, fa_geom);
