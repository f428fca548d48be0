/* Host emulation of the tensor-core instructions Tandem's kernels issue through inline PTX
 * (cuda_flash_mma.cu): mma.sync m16n8k16 (bf16, f16) and m16n8k8 (tf32), ldmatrix, and the shuffle
 * they go with (cuda_runtime.h). On a GPU these are collectives of a warp, each lane holding its
 * part of a tile in registers; here the emulation runs a block's threads one after another between
 * barriers, so each collective gathers the warp's registers through emu_warp_exchange (a barrier
 * of the block: every thread of the block must reach it, as in the flash kernels) and each lane
 * then computes its own part, in the layouts the PTX ISA documents. A kernel that put an
 * element in the wrong register gets a wrong result here as on a GPU. A kernel file includes
 * this where TDM_CUDA_EMU is defined (the emulation's cuda_runtime.h defines it) and calls these
 * in place of its PTX. */
#ifndef TDM_EMU_MMA_H
#define TDM_EMU_MMA_H

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

#ifdef __cplusplus
#include <stdio.h>
#include <stdlib.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* The element in a register's low (hi false) or high 16 bits, as float (bf16 and f16 values
 * are exact in it); inline, as the emulated products convert every element they read. */
static inline float emu_mma_f(__nv_bfloat16, uint32_t w, bool hi) {
    const uint32_t u = (hi ? w >> 16 : w & 0xffff) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
static inline float emu_mma_f(__half, uint32_t w, bool hi) {
#if defined(__F16C__)
    return _cvtsh_ss((unsigned short)(hi ? w >> 16 : w));
#else
    return tdm_f16_to_float((uint16_t)(hi ? w >> 16 : w));
#endif
}

/* PTX's mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 with d as C and D:
 * d += A B for A 16 x 16 (row-major), B 16 x 8 (column-major), each lane holding the elements
 * the PTX ISA's fragment layouts give it (g = lane / 4, t = lane % 4): A's register r the pair
 * (row g + 8 (r & 1), columns 2t + 8 (r >> 1) and one more), B's register r the pair (rows
 * 2t + 8r and one more, column g), d[i] (row g + 8 (i >> 1), column 2t + (i & 1)); a pair's
 * first element in the low 16 bits. The warp's registers are gathered with one collective
 * (emu_warp_exchange: every thread of the block must call it alike), so a kernel that put an
 * element in the wrong register gets a wrong product here as on a GPU; each lane then reads
 * the rows of A (g, g + 8: lanes 4g to 4g + 3) and columns of B (2t, 2t + 1: lanes 8t to 8t + 7)
 * its d needs. Summed in f32 in k order (a tensor core's order is its own: results agree to f32
 * rounding). */
template <typename E>
static inline void emu_mma_m16n8k16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
    const uint32_t *all = emu_warp_exchange(mine, 6);
    const int g = (int)(threadIdx.x % 32) / 4, t = (int)(threadIdx.x % 4);
    float A[2][16], B[2][16]; /* rows g and g + 8 of A; columns 2t and 2t + 1 of B */
    for (int tl = 0; tl < 4; tl++) {
        const uint32_t *la = all + (4 * g + tl) * EMU_XCHG_WORDS;
        for (int r = 0; r < 4; r++) {
            const int col = 2 * tl + 8 * (r >> 1);
            A[r & 1][col] = emu_mma_f(E(), la[r], false);
            A[r & 1][col + 1] = emu_mma_f(E(), la[r], true);
        }
        for (int j = 0; j < 2; j++) {
            const uint32_t *lb = all + (4 * (2 * t + j) + tl) * EMU_XCHG_WORDS;
            for (int r = 0; r < 2; r++) {
                const int k = 2 * tl + 8 * r;
                B[j][k] = emu_mma_f(E(), lb[4 + r], false);
                B[j][k + 1] = emu_mma_f(E(), lb[4 + r], true);
            }
        }
    }
    for (int i = 0; i < 4; i++) {
        float s = d[i];
        for (int k = 0; k < 16; k++) s += A[i >> 1][k] * B[i & 1][k];
        d[i] = s;
    }
}

/* PTX's mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 with d as C and D: d += A B for A
 * 16 x 8, B 8 x 8, one element a register (the PTX ISA's layouts: A's register r holds (row g +
 * 8 (r & 1), column t + 4 (r >> 1)), B's register r (row t + 4r, column g), d as m16n8k16's).
 * A tensor core reads 19 bits of each element (sign, exponent, 10 of the mantissa) and drops
 * the rest, truncating: so does this (the kernels' 3xTF32 split counts on it for its small
 * halves). */
static inline float emu_tf32(uint32_t w) {
    w &= 0xffffe000u;
    float f;
    __builtin_memcpy(&f, &w, 4);
    return f;
}
static inline void emu_mma_m16n8k8_tf32(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
    const uint32_t *all = emu_warp_exchange(mine, 6);
    const int g = (int)(threadIdx.x % 32) / 4, t = (int)(threadIdx.x % 4);
    float A[2][8], B[2][8]; /* rows g and g + 8 of A; columns 2t and 2t + 1 of B */
    for (int tl = 0; tl < 4; tl++) {
        const uint32_t *la = all + (4 * g + tl) * EMU_XCHG_WORDS;
        for (int r = 0; r < 4; r++) A[r & 1][tl + 4 * (r >> 1)] = emu_tf32(la[r]);
        for (int j = 0; j < 2; j++) {
            const uint32_t *lb = all + (4 * (2 * t + j) + tl) * EMU_XCHG_WORDS;
            for (int r = 0; r < 2; r++) B[j][tl + 4 * r] = emu_tf32(lb[4 + r]);
        }
    }
    for (int i = 0; i < 4; i++) {
        float s = d[i];
        for (int k = 0; k < 8; k++) s += A[i >> 1][k] * B[i & 1][k];
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
            const uint32_t *w = all + src * EMU_XCHG_WORDS;
            const uint64_t p = (uint64_t)w[0] | (uint64_t)w[1] << 32;
            e[k] = ((const uint16_t *)(uintptr_t)p)[cc];
        }
        r[i] = (uint32_t)e[0] | (uint32_t)e[1] << 16;
    }
}
#endif
#endif
