/* The CUDA backend's kernels and device plumbing, one .cu file per area, named as the CPU's
 * (cuda_<area>.cu beside cpu_<area>.c, the sections of kernels.def); the table is in
 * cuda_backend.c. Plain C declarations: the .cu files define them with C linkage.
 *
 * Execution model: each GPU has a compute stream (every kernel, copy and cuBLAS call of the
 * backend) and a communication stream (NCCL). Kernels return as soon as the work is queued;
 * only to_host, sum_squares and the kernels that must report a bad user index to the caller
 * (index_select, index_add, cross_entropy and its backward) wait for their stream. Indices
 * that our own forward kernels produced (argmax, max-pool indices) are trusted: an
 * out-of-range one is skipped, not reported. Nothing calls cudaDeviceSynchronize in a training
 * step. Memory blocks come from the caching allocator (src/core/alloc.c) and are reused in
 * compute-stream order, which is safe because every kernel of a device runs on that one stream.
 *
 * Dtypes (issue 37): the kernels a training step runs take f32, bf16 or f16 tensors, computing
 * in f32 and rounding each output once (cuda_common.cuh, cu_ld/cu_to); one dtype per call for
 * the data operands, except binary (any mix, into the caller's y), axpy and index_add (a low
 * gradient into an f32 one) and matmul (bf16 or f16 products into f32 too, cublasGemmEx with
 * fp32 compute). Weights, biases, statistics, lse and losses stay f32 (conv2d's take the
 * call's one dtype: autocast casts its bias too). bce_logits and the optimizers are f32 only
 * and refuse the rest with TDM_ERR_DTYPE naming it. */
#ifndef TDM_CUDA_H
#define TDM_CUDA_H

#include "backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The CUDA backend's table. */
extern const tdm_backend tdm_cuda_backend;

/* ---- cuda_memory.cu: devices and streams ------------------------------------------------- */

/* GPUs the CUDA runtime sees (0 without a driver or a GPU; never an error). Cached. */
int tdm_cuda_device_count(void);
/* Loads cuBLAS and cuBLASLt (cuda_blas.cu; a device's first start does it): 0, or
 * TDM_ERR_DEVICE naming the library or function missing. Needs no GPU. */
int tdm_cuda_blas_load(void);
/* "name, memory GiB, sm_XY" of GPU index into buf (tdm_device_describe). */
int tdm_cuda_describe(int index, char *buf, size_t cap);
/* GPU index's memory: *total and *avail (cudaMemGetInfo) in bytes (tdm_device_memory_info). */
int tdm_cuda_memory(int index, int64_t *total, int64_t *avail);
/* Why there is no GPU ("no CUDA driver", "no GPU found", ...) or "" when there is one. */
const char *tdm_cuda_unavailable_reason(void);
/* The compute (comm = false) or communication stream of GPU index, as a cudaStream_t,
 * created on first use and made current on the calling thread. NULL and an error if the
 * device cannot be used. */
void *tdm_cuda_stream(int index, bool comm);
/* Makes the communication stream of GPU index wait for the work queued so far on its compute
 * stream (comm_waits_compute) or the other way round: events, never a host wait. */
int tdm_cuda_order_streams(int index, bool comm_waits_compute);
/* Waits for everything queued on GPU index's streams (tests and benchmarks only). */
int tdm_cuda_synchronize(int index);
/* Device address of a tensor's first element (tdm_data_ptr gives NULL off the CPU). */
void *tdm_cuda_ptr(const tdm_tensor *t);
/* A storage's memory (NULL for NULL): C, because the .cu files do not see tdm_storage's
 * layout (core.h keeps it, with its C11 atomic, from C++). */
void *tdm_cuda_storage_ptr(const tdm_storage *s);

/* tdm_cuda_<entry> for every entry of kernels.def, uploads included, defined in the
 * cuda_<area>.cu its section names. The uploads: pinned_alloc is cudaHostAlloc (portable to
 * every GPU: the loader's batch buffers, copied from asynchronously); upload_async,
 * fence_wait and fence_free run on the GPU's upload stream, ordered with events. */
/* ---- cuda_flash.cu: fused causal attention, for the heads it fits ------------------------ */

/* Whether tdm_cuda_flash_attention(_backward) takes qkv [B, T, 3C] in n_head heads (a head
 * size a multiple of 16 up to 128, the blocks' shared memory within the GPU's) and is
 * enabled; cuda_attention.cu's unfused kernels take the rest. */
bool tdm_cuda_flash_fits(const tdm_tensor *qkv, int n_head);
/* The contracts of attention and attention_backward (kernels.def); the caller checked the
 * geometry and dtypes and that the heads fit. The backward reads y, the forward's output. */
int tdm_cuda_flash_attention(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv, int n_head);
int tdm_cuda_flash_attention_backward(tdm_tensor *dqkv, const tdm_tensor *dy, const tdm_tensor *qkv,
                                      const tdm_tensor *y, const tdm_tensor *lse, int n_head);
/* Sends every head to the unfused path (off) or the ones that fit to the fused one (on, the
 * default; TANDEM_FLASH_ATTENTION=0 in the environment starts it off): tests and
 * scripts/gpu-check compare the two. Not to be called with attention kernels in flight. */
void tdm_cuda_flash_enable(bool on);
/* The bf16/f16 fused attention's kernels whose blocks take 128 rows (queries, or keys in dK and
 * dV), two 16-row tiles a warp, for heads up to 64: an OR of the TDM_CUDA_FLASH_WIDE_ bits
 * (all, the default: each fragment a warp reads from shared memory feeds two products); the
 * others take 64 rows, one tile a warp, as wider heads always do. The same bits either way:
 * test_cuda_flash checks all against none, bench_cuda times them kernel by kernel. Not to be
 * called with attention kernels in flight. */
#define TDM_CUDA_FLASH_WIDE_FWD 1u
#define TDM_CUDA_FLASH_WIDE_DQ  2u
#define TDM_CUDA_FLASH_WIDE_DKV 4u
#define TDM_CUDA_FLASH_WIDE_ALL 7u
void tdm_cuda_flash_wide(unsigned kernels);
/* The f32 fused attention's products on the tensor cores as three TF32 products each (on, the
 * default, on sm_80, sm_90 and sm_100 for heads up to 64: the arithmetic of PyTorch's
 * memory-efficient attention in f32, about 22 of f32's 24 bits a product, every sum in f32), or on
 * the CUDA cores in f32 (off, as other GPUs, whose TF32 is no faster than f32 or missing, and wider
 * heads always run; TANDEM_FLASH_TF32X3=0 in the environment starts it off). test_cuda_flash checks
 * both against the unfused path, bench_cuda times both. Not to be called with attention kernels in
 * flight. */
void tdm_cuda_flash_tf32x3(bool on);
/* Layer norms of up to 4096 columns a row a warp (on, the default) or a row a block (off), as
 * wider rows always run: bench_cuda times the two. Not to be called with norms in flight. */
void tdm_cuda_layer_norm_warps(bool on);
/* Times cuBLASLt's heuristic was asked for an algorithm since the start: once for each problem
 * (device, types, shapes, epilogue, alignments), whose answer cuda_matmul.cu keeps for the
 * products after it (the last 256 problems). For tests. */
unsigned long long tdm_cuda_blaslt_heuristic_calls(void);

#define TDM_KERNEL(ret, entry, params) ret tdm_cuda_##entry params;
#define TDM_UPLOAD                     TDM_KERNEL
#include "backend/kernels.def"
#undef TDM_KERNEL
#undef TDM_UPLOAD

#ifdef __cplusplus
}
#endif

#endif
