/* Host emulation of the part of CUDA's mma.h (WMMA: a warp's 16 x 16 x 16 tensor-core
 * products) that Tandem's kernels use.
 *
 * On a GPU a fragment is spread over the warp's 32 threads, each holding some of its elements
 * in an order CUDA leaves unspecified, and every load, store and product is a collective of
 * the warp. Here the warp's last thread holds the whole tile and does the whole of each
 * operation; the others skip them (the emulation runs a block's threads one after another
 * between barriers, so a tile that each thread loaded, added to and stored back would be added
 * to 32 times; the last thread runs after the others, as the warp's collective store is after
 * its loads). A kernel that is correct on a GPU (one whose threads read a stored tile only
 * after a barrier, and which touches a fragment's elements only uniformly, as `x[i] *= s`
 * over all of num_elements) gets the same results here. Products are exact (bf16 and f16 products
 * are exact in f32) and summed in f32 in k order; a tensor core sums in an order of its own, so
 * results agree to f32 rounding. */
#ifndef TDM_EMU_MMA_H
#define TDM_EMU_MMA_H

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

#ifdef __cplusplus
#include <stdio.h>
#include <stdlib.h>
#include <type_traits>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

static inline float emu_f(float v) {
    return v;
}
static inline float emu_f(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
static inline float emu_f(__half v) {
    return __half2float(v);
}

/* WMMA's rules for a tile in memory: 256-bit aligned, rows (or columns) a multiple of 16 bytes
 * apart; a GPU's result is undefined otherwise, here it aborts. */
static inline void emu_check(const void *p, unsigned ldm, size_t elem) {
    if ((size_t)p % 32 || ldm * elem % 16) {
        fprintf(stderr,
                "emu wmma: a tile at %p with ldm %u (elements of %zu bytes) breaks WMMA's "
                "alignment rules\n",
                p, ldm, elem);
        abort();
    }
}

/* Whether this thread does the warp's WMMA operations (see the top). */
static inline bool emu_lane_works(void) {
    return threadIdx.x % 32 == 31 || threadIdx.x == blockDim.x - 1;
}

/* rows x cols of each use: A is m x k, B is k x n, the accumulator m x n */
template <typename Use, int M, int N, int K> struct emu_dims;
template <int M, int N, int K> struct emu_dims<matrix_a, M, N, K> {
    enum { rows = M, cols = K };
};
template <int M, int N, int K> struct emu_dims<matrix_b, M, N, K> {
    enum { rows = K, cols = N };
};
template <int M, int N, int K> struct emu_dims<accumulator, M, N, K> {
    enum { rows = M, cols = N };
};

/* The whole tile, row-major, as float (bf16 and f16 values are exact in it). */
template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
    enum { rows = emu_dims<Use, M, N, K>::rows, cols = emu_dims<Use, M, N, K>::cols };
    enum { num_elements = rows * cols };
    float x[num_elements];
};

template <typename Use, int M, int N, int K, typename T, typename L>
static inline void fill_fragment(fragment<Use, M, N, K, T, L> &f, float v) {
    for (int i = 0; i < f.num_elements; i++) f.x[i] = v;
}

/* A or B from memory in the fragment's layout (ldm elements between rows, or columns). */
template <typename Use, int M, int N, int K, typename T, typename L, typename E>
static inline void load_matrix_sync(fragment<Use, M, N, K, T, L> &f, const E *p, unsigned ldm) {
    const bool row = std::is_same<L, row_major>::value;
    emu_check(p, ldm, sizeof(E));
    if (!emu_lane_works()) return;
    for (int r = 0; r < f.rows; r++)
        for (int c = 0; c < f.cols; c++)
            f.x[r * f.cols + c] = emu_f(row ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r]);
}

/* The accumulator from or to memory in the layout given. */
template <int M, int N, int K>
static inline void load_matrix_sync(fragment<accumulator, M, N, K, float> &f, const float *p,
                                    unsigned ldm, layout_t l) {
    emu_check(p, ldm, 4);
    if (!emu_lane_works()) return;
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++)
            f.x[r * N + c] = l == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}
template <int M, int N, int K>
static inline void store_matrix_sync(float *p, const fragment<accumulator, M, N, K, float> &f,
                                     unsigned ldm, layout_t l) {
    emu_check(p, ldm, 4);
    if (!emu_lane_works()) return;
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++)
            (l == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r]) = f.x[r * N + c];
}

/* d = a b + c (d may be c). */
template <int M, int N, int K, typename T, typename LA, typename LB>
static inline void mma_sync(fragment<accumulator, M, N, K, float> &d,
                            const fragment<matrix_a, M, N, K, T, LA> &a,
                            const fragment<matrix_b, M, N, K, T, LB> &b,
                            const fragment<accumulator, M, N, K, float> &c) {
    if (!emu_lane_works()) return;
    float out[M * N];
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float s = c.x[i * N + j];
            for (int l = 0; l < K; l++) s += a.x[i * K + l] * b.x[l * N + j];
            out[i * N + j] = s;
        }
    for (int i = 0; i < M * N; i++) d.x[i] = out[i];
}

} // namespace wmma
} // namespace nvcuda

/* PTX's mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 with d as C and D:
 * d += A B for A 16 x 16 (row-major), B 16 x 8 (column-major), each lane holding the elements
 * the PTX ISA's fragment layouts give it (g = lane / 4, t = lane % 4): A's register r the pair
 * (row g + 8 (r & 1), columns 2t + 8 (r >> 1) and one more), B's register r the pair (rows
 * 2t + 8r and one more, column g), d[i] (row g + 8 (i >> 1), column 2t + (i & 1)); a pair's
 * first element in the low 16 bits. The warp's registers are gathered with one collective
 * (emu_warp_exchange: every thread of the block must call it alike), so a kernel that put an
 * element in the wrong register gets a wrong product here as on a GPU. Summed in f32 in k
 * order (a tensor core's order is its own: results agree to f32 rounding). */
template <typename E>
static inline void emu_mma_m16n8k16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
    const uint32_t *all = emu_warp_exchange(mine, 6);
    float A[16][16], B[16][8];
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane / 4, t = lane % 4;
        for (int r = 0; r < 6; r++) {
            const uint32_t w = all[lane * 6 + r];
            E lo, hi;
            const uint16_t l16 = (uint16_t)w, h16 = (uint16_t)(w >> 16);
            __builtin_memcpy(&lo, &l16, 2);
            __builtin_memcpy(&hi, &h16, 2);
            if (r < 4) {
                const int row = g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
                A[row][col] = nvcuda::wmma::emu_f(lo), A[row][col + 1] = nvcuda::wmma::emu_f(hi);
            } else {
                const int k = 2 * t + 8 * (r - 4);
                B[k][g] = nvcuda::wmma::emu_f(lo), B[k + 1][g] = nvcuda::wmma::emu_f(hi);
            }
        }
    }
    const int g = (int)(threadIdx.x % 32) / 4, t = (int)(threadIdx.x % 4);
    for (int i = 0; i < 4; i++) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        float s = d[i];
        for (int k = 0; k < 16; k++) s += A[row][k] * B[k][col];
        d[i] = s;
    }
}

/* PTX's ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives the address of row l % 8
 * of matrix l / 8 (8 elements of 2 bytes, 16-byte aligned: aborts otherwise, as WMMA's rules
 * here); register i of lane l gets matrix i's pair (row l / 4, columns 2 (l % 4), + 1), or with
 * trans its pair (rows 2 (l % 4), + 1; column l / 4). One collective, as emu_mma_m16n8k16. */
static inline void emu_ldmatrix_x4(uint32_t r[4], const void *row, bool trans) {
    if ((uintptr_t)row % 16) {
        fprintf(stderr, "emu ldmatrix: a row at %p is not 16-byte aligned\n", row);
        abort();
    }
    const uint64_t a = (uint64_t)(uintptr_t)row;
    const uint32_t mine[2] = {(uint32_t)a, (uint32_t)(a >> 32)};
    const uint32_t *all = emu_warp_exchange(mine, 2);
    const int l = (int)(threadIdx.x % 32);
    for (int i = 0; i < 4; i++) {
        uint16_t e[2];
        for (int k = 0; k < 2; k++) {
            const int rr = trans ? 2 * (l % 4) + k : l / 4, cc = trans ? l / 4 : 2 * (l % 4) + k;
            const int src = i * 8 + rr;
            const uint64_t p = (uint64_t)all[src * 2] | (uint64_t)all[src * 2 + 1] << 32;
            e[k] = ((const uint16_t *)(uintptr_t)p)[cc];
        }
        r[i] = (uint32_t)e[0] | (uint32_t)e[1] << 16;
    }
}
#endif
#endif
