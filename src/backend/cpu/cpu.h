/* The CPU backend's kernels, one file per area; the table is in cpu_backend.c. */
#ifndef TDM_CPU_H
#define TDM_CPU_H

#include "backend/backend.h"

/* cpu_memory.c */
void *tdm_cpu_mem_alloc(int device_index, size_t nbytes);
void tdm_cpu_mem_free(int device_index, void *p, size_t nbytes);
int tdm_cpu_to_host(void *host, const tdm_tensor *t);
int tdm_cpu_from_host(tdm_tensor *t, const void *host);
int tdm_cpu_copy(tdm_tensor *dst, const tdm_tensor *src);
int tdm_cpu_fill(tdm_tensor *dst, double value);
int tdm_cpu_random(tdm_tensor *dst, int dist, float a, float b, uint64_t seed, uint64_t offset);

/* cpu_elementwise.c */
int tdm_cpu_unary(tdm_unary_op op, tdm_tensor *y, const tdm_tensor *x, float s);
int tdm_cpu_unary_backward(tdm_unary_op op, tdm_tensor *gx, const tdm_tensor *gy,
                           const tdm_tensor *x, const tdm_tensor *y, float s);
int tdm_cpu_binary(tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a, const tdm_tensor *b);
int tdm_cpu_axpy(tdm_tensor *y, float alpha, const tdm_tensor *x);

/* cpu_reduce.c */
int tdm_cpu_reduce(tdm_reduce_op op, tdm_tensor *y, const tdm_tensor *x, int dim,
                   tdm_tensor *argmax);
int tdm_cpu_sum_to(tdm_tensor *y, const tdm_tensor *x);
int tdm_cpu_max_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *argmax, int dim);
int tdm_cpu_softmax(tdm_tensor *y, const tdm_tensor *x, bool log);
int tdm_cpu_softmax_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *y, bool log);
int tdm_cpu_sum_squares(double *out, const tdm_tensor *x);

/* cpu_gemm.c: c[m, n] = alpha * op(a)[m, k] @ op(b)[k, n] + beta * c, row-major, op(x) = x^T
 * where ta/tb; lda, ldb, ldc are the row strides of a, b and c as stored */
void tdm_cpu_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                   int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
/* cpu_gemm_nt.c: c [m, n] = alpha * a [m, k] @ b [n, k]^T + beta * c on the calling thread
 * with AVX-512, b read in place (tdm_cpu_sgemm chooses it where measured faster). Nonzero,
 * nothing done, without AVX-512 or when its scratch cannot be had. */
int tdm_cpu_sgemm_nt(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                     const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
/* Threads one GEMM call may use: with oneDNN (OpenMP) a setting of the calling thread, with
 * OpenBLAS of the process. */
int tdm_cpu_gemm_threads(void);
void tdm_cpu_gemm_set_threads(int n);
/* The widest vector ISA this CPU and its OS allow: 512 (AVX-512 F/BW/DQ/VL), 256 (AVX2 with
 * FMA) or 0 (baseline x86-64). */
int tdm_cpu_vector_bits(void);
/* The calling thread is a device's: its GEMMs run on its own core alone (oneDNN; OpenBLAS's
 * process-wide count is set by tdm_gemm_threads_for_devices, parallel/group.h). */
void tdm_cpu_gemm_thread_single(void);

/* cpu_matmul.c */
int tdm_cpu_matmul(tdm_tensor *c, const tdm_tensor *a, const tdm_tensor *b, bool ta, bool tb,
                   float beta);

/* cpu_index.c */
int tdm_cpu_index_select(tdm_tensor *y, const tdm_tensor *x, int dim, const tdm_tensor *idx);
int tdm_cpu_index_add(tdm_tensor *gx, int dim, const tdm_tensor *idx, const tdm_tensor *gy);

/* cpu_conv.c */
int tdm_cpu_conv2d(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w, const tdm_tensor *b,
                   const tdm_conv2d_args *args);
int tdm_cpu_conv2d_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb, const tdm_tensor *gy,
                            const tdm_tensor *x, const tdm_tensor *w, const tdm_conv2d_args *args);

/* cpu_pool.c */
int tdm_cpu_max_pool2d(tdm_tensor *y, tdm_tensor *idx, const tdm_tensor *x,
                       const tdm_pool2d_args *args);
int tdm_cpu_max_pool2d_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *idx);
int tdm_cpu_avg_pool2d(tdm_tensor *y, const tdm_tensor *x, const tdm_pool2d_args *args);
int tdm_cpu_avg_pool2d_backward(tdm_tensor *gx, const tdm_tensor *gy, const tdm_pool2d_args *args);

/* cpu_norm.c */
int tdm_cpu_batch_norm(tdm_tensor *y, tdm_tensor *save_mean, tdm_tensor *save_invstd,
                       const tdm_tensor *x, const tdm_tensor *weight, const tdm_tensor *bias,
                       tdm_tensor *running_mean, tdm_tensor *running_var, bool training,
                       float momentum, float eps);
int tdm_cpu_batch_norm_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                const tdm_tensor *gy, const tdm_tensor *x, const tdm_tensor *weight,
                                const tdm_tensor *save_mean, const tdm_tensor *save_invstd,
                                bool training);
int tdm_cpu_batch_norm_stats(tdm_tensor *sum, const tdm_tensor *x, const tdm_tensor *center);
int tdm_cpu_batch_norm_backward_reduce(tdm_tensor *sum_dy, tdm_tensor *sum_dy_xmu, tdm_tensor *gw,
                                       tdm_tensor *gb, const tdm_tensor *gy, const tdm_tensor *x,
                                       const tdm_tensor *mean, const tdm_tensor *invstd);
int tdm_cpu_batch_norm_backward_elemt(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *x,
                                      const tdm_tensor *weight, const tdm_tensor *mean,
                                      const tdm_tensor *invstd, const tdm_tensor *sum_dy,
                                      const tdm_tensor *sum_dy_xmu, double count);
int tdm_cpu_layer_norm(tdm_tensor *y, tdm_tensor *mean, tdm_tensor *rstd, const tdm_tensor *x,
                       const tdm_tensor *weight, const tdm_tensor *bias, float eps);
int tdm_cpu_layer_norm_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                const tdm_tensor *gy, const tdm_tensor *x, const tdm_tensor *weight,
                                const tdm_tensor *mean, const tdm_tensor *rstd);
int tdm_cpu_dropout(tdm_tensor *y, tdm_tensor *mask, const tdm_tensor *x, float p, uint64_t seed,
                    uint64_t offset);

/* cpu_loss.c */
int tdm_cpu_cross_entropy(tdm_tensor *loss, tdm_tensor *wsum, const tdm_tensor *x,
                          const tdm_tensor *target, const tdm_tensor *weight, int64_t ignore_index,
                          float smoothing, bool is_logits);
int tdm_cpu_cross_entropy_backward(tdm_tensor *gx, const tdm_tensor *gloss, const tdm_tensor *x,
                                   const tdm_tensor *target, const tdm_tensor *weight,
                                   int64_t ignore_index, float smoothing, bool is_logits);
int tdm_cpu_bce_logits(tdm_tensor *loss, const tdm_tensor *x, const tdm_tensor *y);
int tdm_cpu_bce_logits_backward(tdm_tensor *gx, const tdm_tensor *g, const tdm_tensor *x,
                                const tdm_tensor *y);

/* cpu_optim.c */
int tdm_cpu_sgd_step(tdm_tensor *p, const tdm_tensor *g, tdm_tensor *buf, const tdm_sgd_hparams *h,
                     bool first);
int tdm_cpu_adam_step(tdm_tensor *p, const tdm_tensor *g, tdm_tensor *m, tdm_tensor *v,
                      tdm_tensor *vmax, const tdm_adam_hparams *h, int64_t step);

/* cpu_attention.c */
int tdm_cpu_attention(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv, int n_head);
int tdm_cpu_attention_backward(tdm_tensor *dqkv, const tdm_tensor *dy, const tdm_tensor *qkv,
                               const tdm_tensor *lse, int n_head);

#endif
