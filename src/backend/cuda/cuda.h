/* The CUDA backend's kernels and device plumbing, one .cu file per area; the table is in
 * cuda_backend.c. Plain C declarations: the .cu files define them with C linkage.
 *
 * Execution model: each GPU has a compute stream (every kernel, copy and cuBLAS call of the
 * backend) and a communication stream (NCCL). Kernels return as soon as the work is queued;
 * only to_host, sum_squares and the kernels that must report a bad user index to the caller
 * (index_select, index_add, cross_entropy and its backward) wait for their stream. Indices
 * that our own forward kernels produced (argmax, max-pool indices) are trusted: an
 * out-of-range one is skipped, not reported. Nothing calls cudaDeviceSynchronize in a training
 * step. Memory blocks come from the caching allocator (src/core/alloc.c) and are reused in
 * compute-stream order, which is safe because every kernel of a device runs on that one stream. */
#ifndef TDM_CUDA_H
#define TDM_CUDA_H

#include "backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The CUDA backend's table. */
extern const tdm_backend tdm_cuda_backend;

/* ---- cuda_memory.cu: devices, streams, memory, copies, fills, random -------------------- */

/* GPUs the CUDA runtime sees (0 without a driver or a GPU; never an error). Cached. */
int tdm_cuda_device_count(void);
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

/* Page-locked host memory (cudaHostAlloc, portable to every GPU) for the loader's batch
 * buffers: copies from it to a GPU run asynchronously. NULL and an error on failure. */
void *tdm_cuda_pinned_alloc(size_t nbytes);
void tdm_cuda_pinned_free(void *p);
/* The backend table's upload_async, fence_wait and fence_free (see backend.h): the copy runs
 * on the GPU's upload stream, ordered with events. */
int tdm_cuda_upload_async(tdm_tensor *t, const void *pinned, void **fence);
int tdm_cuda_fence_wait(void *fence);
void tdm_cuda_fence_free(void *fence);

void *tdm_cuda_mem_alloc(int device_index, size_t nbytes);
void tdm_cuda_mem_free(int device_index, void *p, size_t nbytes);
int tdm_cuda_to_host(void *host, const tdm_tensor *t);
int tdm_cuda_from_host(tdm_tensor *t, const void *host);
int tdm_cuda_copy(tdm_tensor *dst, const tdm_tensor *src);
int tdm_cuda_fill(tdm_tensor *dst, double value);
int tdm_cuda_random(tdm_tensor *dst, int dist, float a, float b, uint64_t seed, uint64_t offset);

/* ---- cuda_elementwise.cu ----------------------------------------------------------------- */
int tdm_cuda_unary(tdm_unary_op op, tdm_tensor *y, const tdm_tensor *x, float s);
int tdm_cuda_unary_backward(tdm_unary_op op, tdm_tensor *gx, const tdm_tensor *gy,
                            const tdm_tensor *x, const tdm_tensor *y, float s);
int tdm_cuda_binary(tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a, const tdm_tensor *b);
int tdm_cuda_axpy(tdm_tensor *y, float alpha, const tdm_tensor *x);
int tdm_cuda_dropout(tdm_tensor *y, tdm_tensor *mask, const tdm_tensor *x, float p, uint64_t seed,
                     uint64_t offset);
int tdm_cuda_bce_logits(tdm_tensor *loss, const tdm_tensor *x, const tdm_tensor *y);
int tdm_cuda_bce_logits_backward(tdm_tensor *gx, const tdm_tensor *g, const tdm_tensor *x,
                                 const tdm_tensor *y);
int tdm_cuda_sgd_step(tdm_tensor *p, const tdm_tensor *g, tdm_tensor *buf, const tdm_sgd_hparams *h,
                      bool first);
int tdm_cuda_adam_step(tdm_tensor *p, const tdm_tensor *g, tdm_tensor *m, tdm_tensor *v,
                       tdm_tensor *vmax, const tdm_adam_hparams *h, int64_t step);

/* ---- cuda_reduce.cu ---------------------------------------------------------------------- */
int tdm_cuda_reduce(tdm_reduce_op op, tdm_tensor *y, const tdm_tensor *x, int dim,
                    tdm_tensor *argmax);
int tdm_cuda_sum_to(tdm_tensor *y, const tdm_tensor *x);
int tdm_cuda_max_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *argmax, int dim);
int tdm_cuda_softmax(tdm_tensor *y, const tdm_tensor *x, bool log);
int tdm_cuda_softmax_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *y, bool log);
int tdm_cuda_sum_squares(double *out, const tdm_tensor *x);
int tdm_cuda_index_select(tdm_tensor *y, const tdm_tensor *x, int dim, const tdm_tensor *idx);
int tdm_cuda_index_add(tdm_tensor *gx, int dim, const tdm_tensor *idx, const tdm_tensor *gy);
int tdm_cuda_cross_entropy(tdm_tensor *loss, tdm_tensor *wsum, const tdm_tensor *x,
                           const tdm_tensor *target, const tdm_tensor *weight, int64_t ignore_index,
                           float smoothing, bool is_logits);
int tdm_cuda_cross_entropy_backward(tdm_tensor *gx, const tdm_tensor *gloss, const tdm_tensor *x,
                                    const tdm_tensor *target, const tdm_tensor *weight,
                                    int64_t ignore_index, float smoothing, bool is_logits);

/* ---- cuda_norm.cu ------------------------------------------------------------------------ */
int tdm_cuda_batch_norm(tdm_tensor *y, tdm_tensor *save_mean, tdm_tensor *save_invstd,
                        const tdm_tensor *x, const tdm_tensor *weight, const tdm_tensor *bias,
                        tdm_tensor *running_mean, tdm_tensor *running_var, bool training,
                        float momentum, float eps);
int tdm_cuda_batch_norm_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                 const tdm_tensor *gy, const tdm_tensor *x,
                                 const tdm_tensor *weight, const tdm_tensor *save_mean,
                                 const tdm_tensor *save_invstd, bool training);
int tdm_cuda_batch_norm_stats(tdm_tensor *sum, const tdm_tensor *x, const tdm_tensor *center);
int tdm_cuda_batch_norm_backward_reduce(tdm_tensor *sum_dy, tdm_tensor *sum_dy_xmu, tdm_tensor *gw,
                                        tdm_tensor *gb, const tdm_tensor *gy, const tdm_tensor *x,
                                        const tdm_tensor *mean, const tdm_tensor *invstd);
int tdm_cuda_batch_norm_backward_elemt(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *x,
                                       const tdm_tensor *weight, const tdm_tensor *mean,
                                       const tdm_tensor *invstd, const tdm_tensor *sum_dy,
                                       const tdm_tensor *sum_dy_xmu, double count);
int tdm_cuda_layer_norm(tdm_tensor *y, tdm_tensor *mean, tdm_tensor *rstd, const tdm_tensor *x,
                        const tdm_tensor *weight, const tdm_tensor *bias, float eps);
int tdm_cuda_layer_norm_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                 const tdm_tensor *gy, const tdm_tensor *x,
                                 const tdm_tensor *weight, const tdm_tensor *mean,
                                 const tdm_tensor *rstd);

/* ---- cuda_conv.cu: cuBLAS matmul, im2col convolution, pooling ---------------------------- */
int tdm_cuda_matmul(tdm_tensor *c, const tdm_tensor *a, const tdm_tensor *b, bool ta, bool tb,
                    float beta);
int tdm_cuda_conv2d(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w, const tdm_tensor *b,
                    const tdm_conv2d_args *args);
int tdm_cuda_conv2d_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb, const tdm_tensor *gy,
                             const tdm_tensor *x, const tdm_tensor *w, const tdm_conv2d_args *args);
int tdm_cuda_max_pool2d(tdm_tensor *y, tdm_tensor *idx, const tdm_tensor *x,
                        const tdm_pool2d_args *args);
int tdm_cuda_max_pool2d_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *idx);
int tdm_cuda_avg_pool2d(tdm_tensor *y, const tdm_tensor *x, const tdm_pool2d_args *args);
int tdm_cuda_avg_pool2d_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_pool2d_args *args);

/* ---- cuda_attention.cu: causal self-attention, one block per row ------------------------- */
int tdm_cuda_attention(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv, int n_head);
int tdm_cuda_attention_backward(tdm_tensor *dqkv, const tdm_tensor *dy, const tdm_tensor *qkv,
                                const tdm_tensor *lse, int n_head);

#ifdef __cplusplus
}
#endif

#endif
