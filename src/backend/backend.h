/* The backend table: every kernel, for one kind of device, as function pointers.
 *
 * Ops (src/autograd, src/nn, src/optim) validate shapes, allocate outputs and record the
 * tape; kernels only compute. Nothing outside src/backend reads or writes tensor memory.
 * Every kernel returns TDM_OK or a negative tdm_status after tdm_raise. Unless a kernel says
 * otherwise, its tensors are f32 and contiguous and outputs are preallocated by the caller
 * with the right shape; "accumulate" kernels add into their output instead of overwriting.
 */
#ifndef TDM_BACKEND_H
#define TDM_BACKEND_H

#include "core/core.h"

typedef enum {
    TDM_UN_NEG,
    TDM_UN_EXP,
    TDM_UN_LOG,
    TDM_UN_SQRT,
    TDM_UN_RELU,
    TDM_UN_GELU_TANH,
    TDM_UN_GELU_ERF,
    TDM_UN_TANH,
    TDM_UN_SIGMOID,
    TDM_UN_ADD_SCALAR, /* x + s */
    TDM_UN_MUL_SCALAR, /* x * s */
    TDM_UN_POW_SCALAR, /* x ^ s */
    TDM_UN_SOFTSIGN,   /* x / (1 + |x|) */
} tdm_unary_op;
/* The last unary op: the kernels refuse an op past it and test_cuda walks up to it, so a new
 * op (appended to the enum) moves only this line (docs/HACKING.md, "A new element-wise op"). */
#define TDM_UN_LAST TDM_UN_SOFTSIGN

typedef enum { TDM_BIN_ADD, TDM_BIN_SUB, TDM_BIN_MUL, TDM_BIN_DIV } tdm_binary_op;

typedef enum { TDM_RED_SUM, TDM_RED_MEAN, TDM_RED_MAX } tdm_reduce_op;

typedef struct {
    int stride_h, stride_w;
    int pad_h, pad_w;
    int dilation_h, dilation_w;
    int groups;
} tdm_conv2d_args;

typedef struct {
    int kernel_h, kernel_w;
    int stride_h, stride_w;
    int pad_h, pad_w;
    int dilation_h, dilation_w; /* max pooling only */
    bool ceil_mode;
    bool count_include_pad; /* average pooling only */
} tdm_pool2d_args;

/* Hyper-parameters of one optimizer step, with PyTorch's meaning. */
typedef struct {
    float lr, momentum, dampening, weight_decay;
    bool nesterov, maximize;
} tdm_sgd_hparams;

typedef struct {
    float lr, beta1, beta2, eps, weight_decay;
    bool decoupled; /* AdamW: theta -= lr*wd*theta before the Adam update */
    bool amsgrad;
    bool maximize;
} tdm_adam_hparams;

typedef struct tdm_backend {
    const char *name;

    /* ---- memory: raw blocks for the caching allocator; host<->device copies ---- */
    void *(*mem_alloc)(int device_index, size_t nbytes);
    void (*mem_free)(int device_index, void *p, size_t nbytes);
    /* Host memory to/from a tensor's elements in row-major order (t may be strided). */
    int (*to_host)(void *host, const tdm_tensor *t);
    int (*from_host)(tdm_tensor *t, const void *host);
    /* Optional (NULL where the device is host memory): the loader's asynchronous uploads.
     * pinned_alloc/free: page-locked host memory (NULL and an error on failure).
     * upload_async: queues a copy of contiguous t's bytes from pinned host memory, after the
     * device's work queued so far (which may still read t's old contents), and orders the
     * work queued afterwards after the copy; the host does not wait. *fence (made on first
     * use, reused after) completes with the copy: fence_wait blocks the host until then
     * (before the pinned buffer is rewritten), fence_free frees it (NULL ignored). */
    void *(*pinned_alloc)(size_t nbytes);
    void (*pinned_free)(void *p);
    int (*upload_async)(tdm_tensor *t, const void *pinned, void **fence);
    int (*fence_wait)(void *fence);
    void (*fence_free)(void *fence);

    /* ---- element-wise ---- */
    /* dst = src for any strides, converting dtype (f32/i32/i64). Same shape. */
    int (*copy)(tdm_tensor *dst, const tdm_tensor *src);
    int (*fill)(tdm_tensor *dst, double value); /* any dtype, any strides */
    /* Philox draws: dist 0 uniform [a, b), 1 normal (mean a, std b). Element i (row-major)
     * uses counter (offset + i) of seed, so results do not depend on threading. */
    int (*random)(tdm_tensor *dst, int dist, float a, float b, uint64_t seed, uint64_t offset);
    /* y = op(x, s); x may be strided, y contiguous; y == x allowed when x is contiguous. */
    int (*unary)(tdm_unary_op op, tdm_tensor *y, const tdm_tensor *x, float s);
    /* gx = gy * op'(x) (y = op(x) given too, for ops whose derivative is cheaper from y). */
    int (*unary_backward)(tdm_unary_op op, tdm_tensor *gx, const tdm_tensor *gy,
                          const tdm_tensor *x, const tdm_tensor *y, float s);
    /* y = a op b; a and b are views already expanded to y's shape (stride 0 where
     * broadcast), any strides; y contiguous. */
    int (*binary)(tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a, const tdm_tensor *b);
    /* y += alpha * x, same shape, both contiguous (gradient accumulation). */
    int (*axpy)(tdm_tensor *y, float alpha, const tdm_tensor *x);

    /* ---- reductions ---- */
    /* y = op over dim of x (x contiguous [outer, n, inner], y [outer, inner] contiguous);
     * for MAX, argmax (i64, shape of y) may receive the first maximal index, or be NULL. */
    int (*reduce)(tdm_reduce_op op, tdm_tensor *y, const tdm_tensor *x, int dim,
                  tdm_tensor *argmax);
    /* y = x summed down to y's shape (y's shape broadcasts to x's; same ndim, size-1 dims
     * summed over). x contiguous. Fixed summation order. */
    int (*sum_to)(tdm_tensor *y, const tdm_tensor *x);
    /* gx (zeroed by the kernel, shape of x) gets gy at argmax along dim. */
    int (*max_backward)(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *argmax, int dim);
    /* (log-)softmax over the last dim of a contiguous tensor. */
    int (*softmax)(tdm_tensor *y, const tdm_tensor *x, bool log);
    int (*softmax_backward)(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *y, bool log);
    /* out (one element, f64 on the host) = sum of x^2, for gradient-norm clipping. */
    int (*sum_squares)(double *out, const tdm_tensor *x);

    /* ---- linear algebra ---- */
    /* c[i] = op(a[i]) @ op(b[i]) + beta * c[i] for i < batch. a is [B, n, k] (or [B, k, n]
     * when ta), b is [B, k, m] (or [B, m, k] when tb), c is [B, n, m] contiguous. a and b may
     * have batch stride 0 (broadcast) and must have unit stride in their last dim. */
    int (*matmul)(tdm_tensor *c, const tdm_tensor *a, const tdm_tensor *b, bool ta, bool tb,
                  float beta);

    /* ---- indexing ---- */
    /* y = x picked along dim by idx (1-D i32/i64); x contiguous. Out-of-range indices are an
     * error naming the index. */
    int (*index_select)(tdm_tensor *y, const tdm_tensor *x, int dim, const tdm_tensor *idx);
    /* gx[.., idx[i], ..] += gy[.., i, ..] in increasing i (deterministic). Accumulates. */
    int (*index_add)(tdm_tensor *gx, int dim, const tdm_tensor *idx, const tdm_tensor *gy);

    /* ---- convolution and pooling (NCHW) ---- */
    /* y [N, Cout, Ho, Wo] = conv(x [N, Cin, H, W], w [Cout, Cin/groups, kh, kw]) + b (b may be
     * NULL). */
    int (*conv2d)(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w, const tdm_tensor *b,
                  const tdm_conv2d_args *args);
    /* Gradients for whichever of gx, gw, gb is non-NULL (overwritten, not accumulated). */
    int (*conv2d_backward)(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb, const tdm_tensor *gy,
                           const tdm_tensor *x, const tdm_tensor *w, const tdm_conv2d_args *args);
    /* idx (i32, shape of y: half an i64's traffic, and the op refuses planes of 2^31 pixels)
     * receives the flat h*W+w index of each maximum in its plane. */
    int (*max_pool2d)(tdm_tensor *y, tdm_tensor *idx, const tdm_tensor *x,
                      const tdm_pool2d_args *args);
    int (*max_pool2d_backward)(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *idx);
    int (*avg_pool2d)(tdm_tensor *y, const tdm_tensor *x, const tdm_pool2d_args *args);
    int (*avg_pool2d_backward)(tdm_tensor *gx, const tdm_tensor *gy, const tdm_pool2d_args *args);

    /* ---- normalisation and dropout ---- */
    /* x [N, C, S] (S = spatial size, 1 for BatchNorm1d on [N, C]). Training: normalises with
     * the batch statistics, writes save_mean/save_invstd [C], and updates running_mean/var
     * (may be NULL) with momentum and the unbiased variance, as PyTorch does. Eval: uses
     * running statistics. weight/bias [C] may be NULL. */
    int (*batch_norm)(tdm_tensor *y, tdm_tensor *save_mean, tdm_tensor *save_invstd,
                      const tdm_tensor *x, const tdm_tensor *weight, const tdm_tensor *bias,
                      tdm_tensor *running_mean, tdm_tensor *running_var, bool training,
                      float momentum, float eps);
    /* Gradients for whichever of gx, gw, gb is non-NULL; training selects whether the batch
     * statistics depend on x. save_* are the batch stats (training) or running stats turned
     * into mean/invstd (eval). */
    int (*batch_norm_backward)(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb, const tdm_tensor *gy,
                               const tdm_tensor *x, const tdm_tensor *weight,
                               const tdm_tensor *save_mean, const tdm_tensor *save_invstd,
                               bool training);
    /* Synchronised batch norm in three kernels around the collectives (PyTorch's SyncBN
     * split; x [N, C, S] as above, this rank's rows only; per-channel tensors [C], possibly
     * views into one buffer that is all-reduced). The forward normalises with the batch_norm
     * kernel in eval mode, given the global mean and biased variance as "running" stats.
     * stats: sum[c] = sum of x over channel c when center is NULL, else the sum of
     * (x - center[c])^2 (accumulated in double). */
    int (*batch_norm_stats)(tdm_tensor *sum, const tdm_tensor *x, const tdm_tensor *center);
    /* sum_dy[c] = sum of gy, sum_dy_xmu[c] = sum of gy * (x - mean[c]) over this rank's
     * values; gb = sum_dy and gw = sum_dy_xmu * invstd (either may be NULL). */
    int (*batch_norm_backward_reduce)(tdm_tensor *sum_dy, tdm_tensor *sum_dy_xmu, tdm_tensor *gw,
                                      tdm_tensor *gb, const tdm_tensor *gy, const tdm_tensor *x,
                                      const tdm_tensor *mean, const tdm_tensor *invstd);
    /* gx = w*invstd * (gy - sum_dy/count - (x - mean) * invstd^2 * sum_dy_xmu/count), the
     * sums being over every rank's values (count of them per channel); weight may be NULL. */
    int (*batch_norm_backward_elemt)(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *x,
                                     const tdm_tensor *weight, const tdm_tensor *mean,
                                     const tdm_tensor *invstd, const tdm_tensor *sum_dy,
                                     const tdm_tensor *sum_dy_xmu, double count);
    /* Normalises each row of x [rows, cols]; mean/rstd [rows]; weight/bias [cols] or NULL. */
    int (*layer_norm)(tdm_tensor *y, tdm_tensor *mean, tdm_tensor *rstd, const tdm_tensor *x,
                      const tdm_tensor *weight, const tdm_tensor *bias, float eps);
    int (*layer_norm_backward)(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb, const tdm_tensor *gy,
                               const tdm_tensor *x, const tdm_tensor *weight,
                               const tdm_tensor *mean, const tdm_tensor *rstd);
    /* mask = (u >= p) / (1 - p) from Philox (seed, offset + i); y = x * mask. */
    int (*dropout)(tdm_tensor *y, tdm_tensor *mask, const tdm_tensor *x, float p, uint64_t seed,
                   uint64_t offset);

    /* ---- losses ---- */
    /* Per-sample cross-entropy. x [N, C] holds logits (is_logits) or log-probabilities;
     * target [N] (i32/i64); weight [C] or NULL. loss[i] = (1-e)*w[t]*(-logp[t]) +
     * e/C * sum_c w[c]*(-logp[c]); wsum[i] = w[t] (the mean's denominator term). Both are 0
     * where target == ignore_index. A target outside [0, C) is an error naming it. */
    int (*cross_entropy)(tdm_tensor *loss, tdm_tensor *wsum, const tdm_tensor *x,
                         const tdm_tensor *target, const tdm_tensor *weight, int64_t ignore_index,
                         float smoothing, bool is_logits);
    /* gx = d(sum_i gloss[i] * loss[i]) / dx. */
    int (*cross_entropy_backward)(tdm_tensor *gx, const tdm_tensor *gloss, const tdm_tensor *x,
                                  const tdm_tensor *target, const tdm_tensor *weight,
                                  int64_t ignore_index, float smoothing, bool is_logits);
    /* loss = max(x,0) - x*y + log1p(exp(-|x|)), element-wise; gx = g * (sigmoid(x) - y). */
    int (*bce_logits)(tdm_tensor *loss, const tdm_tensor *x, const tdm_tensor *y);
    int (*bce_logits_backward)(tdm_tensor *gx, const tdm_tensor *g, const tdm_tensor *x,
                               const tdm_tensor *y);

    /* ---- optimizers: one fused pass over flat f32 buffers ---- */
    /* buf: momentum buffer (NULL when momentum == 0); first: the first step (buf = g). */
    int (*sgd_step)(tdm_tensor *p, const tdm_tensor *g, tdm_tensor *buf, const tdm_sgd_hparams *h,
                    bool first);
    /* m, v: moments; vmax: AMSGrad's running max (NULL unless amsgrad); step counts from 1. */
    int (*adam_step)(tdm_tensor *p, const tdm_tensor *g, tdm_tensor *m, tdm_tensor *v,
                     tdm_tensor *vmax, const tdm_adam_hparams *h, int64_t step);

    /* ---- attention (appended; a backend may leave these NULL: the op then fails) ---- */
    /* Causal self-attention of qkv [B, T, 3C] (q, k, v side by side along the last dim, head
     * h owning channels [h*hs, (h+1)*hs) of each, hs = C / n_head, as llm.c lays them out):
     * y [B, T, C] with y[b, t, head h] = sum_{s <= t} softmax_s(q_t . k_s / sqrt(hs)) v_s;
     * lse [B, n_head, T] receives each row's log-sum-exp of the scaled scores, so backward
     * recomputes the probabilities without storing them (no [B, n_head, T, T] tensor). */
    int (*attention)(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv, int n_head);
    /* dqkv [B, T, 3C] (overwritten) from dy [B, T, C], the forward's qkv and lse. */
    int (*attention_backward)(tdm_tensor *dqkv, const tdm_tensor *dy, const tdm_tensor *qkv,
                              const tdm_tensor *lse, int n_head);
} tdm_backend;

/* Every entry of tdm_backend after its name, listed once: a backend must fill each of
 * TDM_BACKEND_KERNELS; TDM_BACKEND_UPLOADS only where the device is not host memory.
 * backend.c asserts at compile time that the lists cover the struct, so an entry added to
 * the struct and not here fails the build, and tdm_backend_check names an entry a table
 * leaves empty (test_tensor checks the CPU table, test_cuda the CUDA one). */
/* clang-format off */
#define TDM_BACKEND_KERNELS(X)                                                                     \
    X(mem_alloc) X(mem_free) X(to_host) X(from_host) X(copy) X(fill) X(random) X(unary)            \
    X(unary_backward) X(binary) X(axpy) X(reduce) X(sum_to) X(max_backward) X(softmax)             \
    X(softmax_backward) X(sum_squares) X(matmul) X(index_select) X(index_add) X(conv2d)            \
    X(conv2d_backward) X(max_pool2d) X(max_pool2d_backward) X(avg_pool2d)                          \
    X(avg_pool2d_backward) X(batch_norm) X(batch_norm_backward) X(batch_norm_stats)                \
    X(batch_norm_backward_reduce) X(batch_norm_backward_elemt) X(layer_norm)                       \
    X(layer_norm_backward) X(dropout) X(cross_entropy) X(cross_entropy_backward) X(bce_logits)     \
    X(bce_logits_backward) X(sgd_step) X(adam_step) X(attention) X(attention_backward)
#define TDM_BACKEND_UPLOADS(X)                                                                     \
    X(pinned_alloc) X(pinned_free) X(upload_async) X(fence_wait) X(fence_free)
/* clang-format on */

/* TDM_OK when be fills every kernel entry (and, with uploads, every upload entry); else
 * TDM_ERR_STATE naming the backend and the first empty entry. */
int tdm_backend_check(const tdm_backend *be, bool uploads);

/* The backend of a device (never NULL for a device that tdm_device_parse accepted and the
 * build supports; NULL with an error otherwise). */
const tdm_backend *tdm_backend_for(tdm_device dev);

/* GPUs this process can use: 0 without a GPU or in a build without the CUDA backend. */
int tdm_cuda_device_count(void);

/* The CPU backend's table. */
extern const tdm_backend tdm_cpu_backend;

#endif
