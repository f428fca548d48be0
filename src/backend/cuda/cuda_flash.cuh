/* What the fused attention's two files share (not installed): the tiling, the shared-memory
 * carving and tile loads, and the entry points of the bf16/f16 kernels on mma.sync
 * (cuda_flash_mma.cu) that cuda_flash.cu dispatches to. */
#ifndef TDM_CUDA_FLASH_CUH
#define TDM_CUDA_FLASH_CUH

#include "backend/cuda/cuda_common.cuh"

#include <string.h>

#define FA_BR      64  /* query (or key) rows a block (the mma.sync kernels: 64 or 128) */
#define FA_BC      64  /* keys a tile (= FA_BR: every row of a block sees a key in each tile) */
#define FA_THREADS 128 /* four warps */
#define FA_PAD     8   /* bf16/f16 elements after each row of Q, K, V, dy in shared memory */
#define FA_LOG2E   1.4426950408889634f /* the kernels' exponentials are base 2 */
#define FA_LN2     0.6931471805599453f

typedef struct {
    int64_t B, T, C, nh, hs;
    float scale;
    int ld; /* elements a row of the Q, K, V and dy tiles take in shared memory */
} fa_geom;

/* ---- shared memory ------------------------------------------------------------------------ */

/* Carves a block's shared memory into aligned regions (WMMA wants 32-byte aligned tiles,
 * ldmatrix 16-byte aligned rows). */
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

/* 16 bytes moved as one (a 128-bit load and store on a GPU) */
struct __align__(16) fa_vec {
    uint32_t w[4];
};

/* rows [r0, r0 + rows) of one head's q (part 0), k (1) or v (2) in qkv (or of dy, y: part 0
 * with a row of C) into tile [rows, ld]; rows past T as zeros. 16 bytes a thread at a time
 * where the rows allow it (a head's row is a multiple of 16 bytes; src and row_len keep that
 * alignment: the tile's rows, ld apart, always do), else an element at a time. */
template <typename E>
__device__ void fa_load(E *tile, const E *src, int64_t row_len, int64_t r0, int rows, fa_geom g) {
    constexpr int per = sizeof(fa_vec) / sizeof(E);
    if ((uintptr_t)src % sizeof(fa_vec) == 0 && row_len % per == 0) {
        const int vecs = (int)g.hs / per; /* a row's */
        for (int e = threadIdx.x; e < rows * vecs; e += FA_THREADS) {
            const int r = e / vecs, c = e % vecs;
            fa_vec v = {};
            if (r0 + r < g.T) v = *(const fa_vec *)(src + (r0 + r) * row_len + c * per);
            *(fa_vec *)(tile + r * g.ld + c * per) = v;
        }
        return;
    }
    for (int e = threadIdx.x; e < rows * g.hs; e += FA_THREADS) {
        const int r = e / (int)g.hs, d = e % (int)g.hs;
        tile[r * g.ld + d] = r0 + r < g.T ? src[(r0 + r) * row_len + d] : cu_to<E>(0.0f);
    }
}

/* ---- loads without waiting: cp.async from sm_80 on (before it a plain copy) ---------------- */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800 && !defined(TDM_CUDA_EMU)
#define FA_NO_ASYNC 1
#endif

/* N bytes (N 4 or 16; bytes N, or 0 for zeros) from global src to shared dst, N-byte aligned,
 * without waiting: fa_wait_loads waits for this thread's. The emulation's land when the thread
 * waits for them, as they may on a GPU (emu_cp_async). */
template <int N> __device__ __forceinline__ void fa_cp(void *dst, const void *src, int bytes) {
#if defined(TDM_CUDA_EMU)
    emu_cp_async(dst, src, N, bytes);
#elif defined(FA_NO_ASYNC)
    if (bytes)
        memcpy(dst, src, N);
    else
        memset(dst, 0, N);
#else
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    if constexpr (N == 16) /* past L1, as the tiles are read once a block */
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(bytes)
                     : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(bytes)
                     : "memory");
#endif
}
/* Marks this thread's loads since the last commit as one group. */
__device__ __forceinline__ void fa_commit_loads(void) {
#if defined(TDM_CUDA_EMU)
    emu_cp_async_commit();
#elif !defined(FA_NO_ASYNC)
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
/* Waits for this thread's loads: all of them (fa_wait_loads), or those of every group but the N
 * committed last (fa_wait_loads_but). Other threads' loads are theirs: a barrier after the wait
 * makes a tile whole for the block. */
__device__ __forceinline__ void fa_wait_loads(void) {
#if defined(TDM_CUDA_EMU)
    emu_cp_async_wait(-1);
#elif !defined(FA_NO_ASYNC)
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void fa_wait_loads_but(void) {
#if defined(TDM_CUDA_EMU)
    emu_cp_async_wait(N);
#elif !defined(FA_NO_ASYNC)
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

/* As fa_load, but without waiting where the rows allow 16-byte copies. */
template <typename E>
__device__ void fa_load_async(E *tile, const E *src, int64_t row_len, int64_t r0, int rows,
                              fa_geom g) {
    constexpr int per = sizeof(fa_vec) / sizeof(E);
    if ((uintptr_t)src % sizeof(fa_vec) || row_len % per) {
        fa_load(tile, src, row_len, r0, rows, g);
        return;
    }
    const int vecs = (int)g.hs / per;
    for (int e = threadIdx.x; e < rows * vecs; e += FA_THREADS) {
        const int r = e / vecs, c = e % vecs;
        const bool in = r0 + r < g.T;
        fa_cp<16>(tile + r * g.ld + c * per, in ? src + (r0 + r) * row_len + c * per : src,
                  in ? 16 : 0);
    }
}

/* ---- the online softmax, a row's scores across LANES adjacent lanes (xor 1, 2, ...; loops of
 * a constant count, unrolled by nvcc) ---------------------------------------------------------- */

/* v summed over the row's lanes; each of them gets the same bits (a pair is added both ways) */
template <int LANES> __device__ __forceinline__ float fa_row_sum(float v) {
    for (int o = 1; o < LANES; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* One key tile's step for a row whose tile maximum (over this lane's scores, base 2) is mx: m
 * moves to the row's new maximum and l is rescaled; returns the factor O is rescaled by (0 at
 * the first tile, where m is -inf). The first tile's maximum is finite (key 0 is at or below
 * every row's diagonal, rows past T included); a later one's may be -inf (a tile past all of a
 * warp's rows, which the mma.sync forward's 128-row blocks run masked): m stays, alpha is 1. */
template <int LANES> __device__ __forceinline__ float fa_rescale(float mx, float &m, float &l) {
    for (int o = 1; o < LANES; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_new = fmaxf(m, mx), alpha = exp2f(m - m_new);
    m = m_new, l *= alpha;
    return alpha;
}

/* ---- the kernels on mma.sync (cuda_flash_mma.cu; sm_80 on): bf16, f16, f32 as 3xTF32 -------- */

/* Tiles of 16 rows (queries, or keys in dK and dV) each warp of mma.sync kernel `kernel` (a
 * TDM_CUDA_FLASH_WIDE_ bit) takes for heads of hs in elements of es bytes: in bf16 and f16 2
 * up to heads of 64 while tdm_cuda_flash_wide has its bit (blocks of 128 rows), else 1 (64). */
int fa_mma_tiles(int64_t hs, size_t es, unsigned kernel);
/* Shared memory the mma.sync kernels take (cudaFuncSetAttribute's limit must allow it). */
size_t fa_mma_smem_fwd(fa_geom g, size_t es);
size_t fa_mma_smem_dkv(fa_geom g, size_t es);
size_t fa_mma_smem_dq(fa_geom g, size_t es);

/* y [B, T, C] and lse [B, nh, T] from qkv, heads of 16 to 128 (a multiple of 16; f32, whose
 * products are 3xTF32 (cuda_flash_mma.cu's fa_kind), 16 to 64), on d's compute stream (index
 * idx, for errors). Returns 0 or the launch's error, raised. */
template <typename E>
int fa_mma_forward(cu_device *d, int idx, E *y, float *lse, const E *qkv, fa_geom g);
/* dqkv (every element written) from dy, qkv, lse and D = rowsum(dy * y), the forward's heads. */
template <typename E>
int fa_mma_backward(cu_device *d, int idx, E *dqkv, const E *dy, const E *qkv, const float *lse,
                    const float *D, fa_geom g);

#endif
