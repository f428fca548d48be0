/* Tandem neural-network layers: functional ops, losses and modules with PyTorch's meaning.
 *
 * Functional ops and losses follow tensor.h's ownership and error rules. Modules are trees:
 * each has its own parameters and buffers (named as PyTorch names them: "weight", "bias",
 * "running_mean") and named children ("0", "1" in a Sequential), so the full names are
 * PyTorch's ("features.0.weight"). Module parameters are caller-owned tensors that the
 * module owns; tdm_module_free releases the whole tree.
 */
#ifndef TANDEM_NN_H
#define TANDEM_NN_H

#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- functional ops (differentiable) -----------------------------------------------------
 *
 * Dtypes (docs/MIXED_PRECISION.md): every op takes f32, bf16 and f16 inputs. The products
 * (tdm_linear, tdm_conv2d, tdm_causal_attention) take one dtype for all their float
 * operands (TDM_ERR_DTYPE naming both otherwise) and give it; in an autocast region
 * (autocast.h) they cast to the region's dtype first. Pooling, dropout and embedding give
 * their input's dtype; the norms too, with weight and bias of any float dtype (f32 with a
 * bf16 input is mixed precision's case) and their statistics (batch norm's running buffers
 * included, which must be f32) in f32. The losses give their input's dtype; in a region
 * they cast it to f32 first. Each computes in f32 inside and rounds its output once. */

/* x [..., in] @ w[out, in]^T + b[out] (b may be NULL) -> [..., out] */
tdm_tensor *tdm_linear(tdm_tensor *x, tdm_tensor *w, tdm_tensor *b);
/* tdm_gelu(tdm_linear(x, w, b), true) as one op (a transformer MLP's first half): on a GPU one
 * cuBLASLt product whose epilogue adds b and applies the tanh-GELU as it writes (the GELU of the
 * f32 sum, PyTorch's addmm with a GELU epilogue), its input kept for backward; on the CPU the
 * same kernels as the two ops, bit for bit. b is required (NULL: an error). */
tdm_tensor *tdm_linear_gelu(tdm_tensor *x, tdm_tensor *w, tdm_tensor *b);
/* tdm_linear(tdm_linear_gelu(x, w1, b1), w2, b2) as one op (a transformer's MLP, c_fc, GELU and
 * c_proj): the same forward, and in backward on a GPU the gradient of the GELU's input in one
 * cuBLASLt product (dY W2 with GELU' applied as it is written: its DGELU epilogue, the
 * product not rounded on its own), where the two ops write dY W2 and read it back; on the CPU
 * the same kernels as the two ops, bit for bit. b1 is required, b2 may be NULL; x, w1, w2
 * must chain ([..., in], [mid, in], [out, mid]). Returns [..., out], or NULL with the error
 * naming the operand. */
tdm_tensor *tdm_linear_gelu_linear(tdm_tensor *x, tdm_tensor *w1, tdm_tensor *b1, tdm_tensor *w2,
                                   tdm_tensor *b2);

typedef struct {
    int stride_h, stride_w; /* 0 means 1 */
    int pad_h, pad_w;
    int dilation_h, dilation_w; /* 0 means 1 */
    int groups;                 /* 0 means 1 */
} tdm_conv2d_opts;
/* x [N, Cin, H, W], w [Cout, Cin/groups, kh, kw], b [Cout] or NULL -> [N, Cout, Ho, Wo] */
tdm_tensor *tdm_conv2d(tdm_tensor *x, tdm_tensor *w, tdm_tensor *b, const tdm_conv2d_opts *o);

typedef struct {
    int kernel_h, kernel_w;
    int stride_h, stride_w; /* 0 means the kernel size, as in PyTorch */
    int pad_h, pad_w;
    int dilation_h, dilation_w; /* max pooling; 0 means 1 */
    bool ceil_mode;
    bool count_include_pad; /* average pooling; PyTorch's default is true */
} tdm_pool2d_opts;
tdm_tensor *tdm_max_pool2d(tdm_tensor *x, const tdm_pool2d_opts *o);
tdm_tensor *tdm_avg_pool2d(tdm_tensor *x, const tdm_pool2d_opts *o);
/* x [N, C, H, W] -> [N, C, out_h, out_w], PyTorch's AdaptiveAvgPool2d: output (i, j) averages
 * rows [floor(i*H/out_h), ceil((i+1)*H/out_h)) and the columns likewise (bins overlap when
 * the sizes do not divide). Equal bins, a global pool (1, 1) among them, run as avg_pool2d;
 * others as two products with bin matrices, so every backend has both. */
tdm_tensor *tdm_adaptive_avg_pool2d(tdm_tensor *x, int64_t out_h, int64_t out_w);

/* x [N, C] or [N, C, ...]. Training uses batch statistics and updates running_mean/var
 * (either may be NULL) with momentum and the unbiased variance; eval uses them. */
tdm_tensor *tdm_batch_norm(tdm_tensor *x, tdm_tensor *running_mean, tdm_tensor *running_var,
                           tdm_tensor *weight, tdm_tensor *bias, bool training, float momentum,
                           float eps);
/* Normalises over the last normalized_ndim dims; weight/bias have those dims or are NULL. */
tdm_tensor *tdm_layer_norm(tdm_tensor *x, int normalized_ndim, tdm_tensor *weight, tdm_tensor *bias,
                           float eps);
/* tdm_to_dtype(tdm_layer_norm(x, ...), dtype) as one op: the norm computed as tdm_layer_norm
 * computes it (autocast's lists included) and written in dtype, one rounding; its backward
 * reads the gradient in dtype. The bits of the two ops, one pass fewer each way: a pre-norm
 * transformer under bf16 autocast, whose products cast the norm's fp32 output to bf16.
 * TDM_ERR_DTYPE naming dtype when it is not f32, bf16 or f16; else tdm_layer_norm's errors. */
tdm_tensor *tdm_layer_norm_to(tdm_tensor *x, int normalized_ndim, tdm_tensor *weight,
                              tdm_tensor *bias, float eps, tdm_dtype dtype);
/* A pre-norm residual stream's step: *sum = x + r as tdm_add makes it, and returns the layer
 * norm of *sum as tdm_layer_norm makes it (tdm_add_layer_norm_to: as tdm_layer_norm_to, in
 * dtype), with the two ops' values, bits and gradients. Where r has x's shape, both are contiguous,
 * the sum has x's dtype and autocast does not cast it for the norm, and a scope is open (a training
 * step's), one kernel writes both, reading the stream once for the two. *sum is the caller's as the
 * result is (the scope's, or freed with tdm_tensor_free outside one); NULL with the result on
 * failure. Fails as tdm_add and tdm_layer_norm(_to) do; TDM_ERR_ARG when sum is NULL. */
tdm_tensor *tdm_add_layer_norm(tdm_tensor *x, tdm_tensor *r, tdm_tensor **sum, int normalized_ndim,
                               tdm_tensor *weight, tdm_tensor *bias, float eps);
tdm_tensor *tdm_add_layer_norm_to(tdm_tensor *x, tdm_tensor *r, tdm_tensor **sum,
                                  int normalized_ndim, tdm_tensor *weight, tdm_tensor *bias,
                                  float eps, tdm_dtype dtype);
/* Zeroes each element with probability p and scales the rest by 1/(1-p) (training only).
 * Under a parallel context (parallel.h), dim 0 is the global batch's rows and the masks are
 * those one device would draw for them. */
tdm_tensor *tdm_dropout(tdm_tensor *x, float p, bool training, tdm_rng *rng);
/* weight [num, dim] looked up by idx (any shape, i32/i64) -> [idx..., dim] */
tdm_tensor *tdm_embedding(tdm_tensor *weight, const tdm_tensor *idx);
/* Causal multi-head self-attention (GPT-2's, without dropout) as one differentiable op.
 * qkv [B, T, 3C] holds the queries, keys and values side by side along the last dim (the
 * output of one Linear(C, 3C), as in GPT-2 and llm.c); head h uses channels [h*hs, (h+1)*hs)
 * of each, hs = C / n_head. Returns y [B, T, C]: for every head, position t attends to
 * positions s <= t with softmax(q_t . k_s / sqrt(hs)), heads concatenated along C. Memory is
 * O(B*T*C) plus one head's [T, T] scores at a time: the probabilities are recomputed in
 * backward, never stored. Fails (NULL) with TDM_ERR_SHAPE when qkv is not [B, T, 3C] with C
 * divisible by n_head, TDM_ERR_DEVICE when qkv's backend has no attention kernel. */
tdm_tensor *tdm_causal_attention(tdm_tensor *qkv, int n_head);

/* ---- losses ----------------------------------------------------------------------------- */

typedef enum { TDM_REDUCE_MEAN = 0, TDM_REDUCE_SUM = 1, TDM_REDUCE_NONE = 2 } tdm_reduction;

typedef struct {
    tdm_reduction reduction; /* default mean */
    int64_t ignore_index;    /* targets equal to it add nothing; PyTorch's default is -100 */
    float label_smoothing;   /* in [0, 1] */
    tdm_tensor *weight;      /* [C] class weights, or NULL */
} tdm_ce_opts;
/* PyTorch's defaults: mean, ignore_index -100, no smoothing, no weights. */
tdm_ce_opts tdm_ce_defaults(void);

/* logits [N, C], target [N] (i32/i64) -> scalar (mean, sum) or [N] (none). o may be NULL.
 * Returns a tensor of the current scope; NULL with TDM_ERR_SHAPE, TDM_ERR_DTYPE or
 * TDM_ERR_ARG naming a bad shape, dtype, option or target. Recording a gradient, an f32 mean
 * or sum (an f32 loss, or bf16 logits under autocast) also writes the logits' gradient in the
 * forward's pass over them (llm.c's fused classifier), held until the backward: a backward
 * started at this loss hands it on without reading the logits again; any other upstream (the
 * loss scaled or summed with others first) recomputes it, to the same bits. */
tdm_tensor *tdm_cross_entropy(tdm_tensor *logits, const tdm_tensor *target, const tdm_ce_opts *o);
/* logp [N, C] log-probabilities; label_smoothing must be 0. */
tdm_tensor *tdm_nll_loss(tdm_tensor *logp, const tdm_tensor *target, const tdm_ce_opts *o);
tdm_tensor *tdm_mse_loss(tdm_tensor *input, tdm_tensor *target, tdm_reduction r);
/* Binary cross-entropy on logits, numerically stable; target has input's shape. */
tdm_tensor *tdm_bce_with_logits(tdm_tensor *input, tdm_tensor *target, tdm_reduction r);

/* ---- modules ----------------------------------------------------------------------------- */

#define TDM_MODULE_MAX_PARAMS  4
#define TDM_MODULE_MAX_BUFFERS 4

typedef struct tdm_module tdm_module;

/* Forward hooks (PyTorch's register_forward_pre_hook / register_forward_hook): pre runs just
 * before m's forward and fails it with its status; post runs on m's output and returns what
 * the caller gets instead (out itself, or a tensor made from it; NULL and an error fail it). */
typedef int (*tdm_forward_pre_hook)(tdm_module *m, void *ctx);
typedef tdm_tensor *(*tdm_forward_hook)(tdm_module *m, tdm_tensor *out, void *ctx);

typedef struct {
    const char *kind; /* "Linear", "Conv2d", ... */
    tdm_tensor *(*forward)(tdm_module *m, tdm_tensor *x);
    void (*destroy)(tdm_module *m); /* frees m->impl; parameters are freed by the caller */
} tdm_module_ops;

/* Named parameters of a whole model, in registration order, living in one flat buffer. */
typedef struct {
    int n;
    char **names;          /* full names, "0.weight" */
    tdm_tensor **params;   /* views into flat */
    tdm_tensor *flat;      /* [total] f32 */
    tdm_tensor *flat_grad; /* [total] f32; each param's .grad is the view at its offset */
    int64_t *offsets;      /* element offset of each param in flat */
    int64_t total;
} tdm_paramset;

/* Named buffers of a whole model (running statistics). Not flat: they differ in dtype. */
typedef struct {
    int n;
    char **names;
    tdm_tensor **buffers;
} tdm_bufferset;

struct tdm_module {
    const tdm_module_ops *ops;
    tdm_device device;
    bool training;
    bool recompute;                /* forward under tdm_recompute (tdm_module_set_recompute) */
    tdm_forward_pre_hook pre_hook; /* tdm_module_set_forward_hooks; not cloned */
    tdm_forward_hook post_hook;
    void *hook_ctx;
    int n_params;
    const char *param_names[TDM_MODULE_MAX_PARAMS];
    tdm_tensor *params[TDM_MODULE_MAX_PARAMS];
    int n_buffers;
    const char *buffer_names[TDM_MODULE_MAX_BUFFERS];
    tdm_tensor *buffers[TDM_MODULE_MAX_BUFFERS];
    int n_children;
    char **child_names;
    tdm_module **children;
    void *impl;               /* the layer's own settings */
    size_t impl_size;         /* bytes of impl when it is plain data (tdm_module_clone) */
    tdm_paramset *paramset;   /* made by tdm_module_parameters */
    tdm_bufferset *bufferset; /* made by tdm_module_buffers */
};

/* Layers, with PyTorch's default initialisation drawn from rng (NULL: default generator).
 * Each returns NULL and an error on bad sizes. */
tdm_module *tdm_linear_new(int64_t in, int64_t out, bool bias, tdm_device dev, tdm_rng *rng);
tdm_module *tdm_conv2d_new(int64_t in_ch, int64_t out_ch, int kernel_h, int kernel_w,
                           const tdm_conv2d_opts *o, bool bias, tdm_device dev, tdm_rng *rng);
tdm_module *tdm_max_pool2d_new(const tdm_pool2d_opts *o);
tdm_module *tdm_avg_pool2d_new(const tdm_pool2d_opts *o);
tdm_module *tdm_adaptive_avg_pool2d_new(int64_t out_h, int64_t out_w);
/* BatchNorm1d and 2d: affine weight 1, bias 0; running_mean 0, running_var 1,
 * num_batches_tracked (i64); momentum 0.1 and eps 1e-5 are PyTorch's defaults. momentum NAN
 * is PyTorch's momentum=None (a cumulative average: factor 1/num_batches_tracked). */
tdm_module *tdm_batch_norm1d_new(int64_t features, float eps, float momentum, tdm_device dev);
tdm_module *tdm_batch_norm2d_new(int64_t channels, float eps, float momentum, tdm_device dev);
/* LayerNorm over the last dim of size features (weight 1, bias 0 when affine). */
tdm_module *tdm_layer_norm_new(int64_t features, float eps, bool affine, tdm_device dev);
/* Dropout draws from a generator of its own, seeded at construction by one draw of rng (NULL:
 * the default generator), which advances by one counter; the layer never touches rng again.
 * Clones copy that state, so replicas draw the same masks (see tdm_parallel_context_set). */
tdm_module *tdm_dropout_new(float p, tdm_rng *rng);
/* Embedding: weight N(0, 1) as in PyTorch. */
tdm_module *tdm_embedding_new(int64_t num, int64_t dim, tdm_device dev, tdm_rng *rng);
tdm_module *tdm_relu_new(void);
tdm_module *tdm_gelu_new(bool tanh_approx);
tdm_module *tdm_tanh_new(void);
tdm_module *tdm_sigmoid_new(void);
tdm_module *tdm_flatten_new(int start_dim, int end_dim); /* PyTorch's defaults: 1, -1 */
/* A Sequential of n modules, taking ownership of them; children are named "0", "1", ... */
tdm_module *tdm_sequential_new(int n, tdm_module *const *mods);
/* Appends a child under name (NULL: its index). Takes ownership. */
int tdm_module_add(tdm_module *parent, const char *name, tdm_module *child);

/* Runs the module. */
tdm_tensor *tdm_module_forward(tdm_module *m, tdm_tensor *x);
/* Training (true) or evaluation mode, for m and all its children. */
void tdm_module_train(tdm_module *m, bool training);
/* Recomputation of m (torch.utils.checkpoint around m's forward): while on, m's forward with
 * grad mode on runs under tdm_recompute (autograd.h), so that none of the activations inside
 * m is kept for the backward, which runs m's forward again: memory for compute, with the same
 * gradients bit for bit (dropout replays its masks, batch norm updates its running statistics
 * once). m alone, not its children (set it on a block, a stage); a child that has it on too
 * recomputes inside m's recomputation. Clones (DataParallel's replicas, pipeline stages)
 * keep it. m's forward must meet tdm_recompute's conditions: the built-in layers and the
 * library's models do. TDM_OK, or TDM_ERR_ARG for a NULL m. */
int tdm_module_set_recompute(tdm_module *m, bool on);
/* m's forward hooks (either may be NULL; both NULL remove them), with ctx for both. One pair
 * per module: a later call replaces it. They run around m's own forward (around its
 * recomputation's first run, not its rerun in backward); clones do not get them. TDM_OK, or
 * TDM_ERR_ARG for a NULL m. */
int tdm_module_set_forward_hooks(tdm_module *m, tdm_forward_pre_hook pre, tdm_forward_hook post,
                                 void *ctx);
/* All parameters of the tree, named, moved on first call into one flat buffer (values kept)
 * with a flat gradient buffer beside it. Owned by m; later calls return the same set. All
 * parameters must be on one device. NULL and an error on failure. */
tdm_paramset *tdm_module_parameters(tdm_module *m);
/* A training loop's zero_grad without the pass that zeroes the flat gradient: every gradient
 * of ps is marked stale, and the next backward's first gradient for a parameter replaces its
 * values (a Linear's weight-gradient GEMM writes with beta 0) instead of adding to them.
 * tdm_paramset_settle_grads, after that backward and before anything reads a gradient (the
 * optimizer, clipping, a checkpoint), zeroes those no gradient reached. Zeroing the MLP's 0.94
 * MB took 6% of its step on one core. Not with DDP, whose buckets read the gradients during
 * the backward. NULL ps: nothing. */
void tdm_paramset_mark_grads_stale(tdm_paramset *ps);
/* See tdm_paramset_mark_grads_stale. TDM_OK, or the fill's error (the others still settled). */
int tdm_paramset_settle_grads(tdm_paramset *ps);
/* All buffers of the tree, named. Owned by m. */
tdm_bufferset *tdm_module_buffers(tdm_module *m);
/* The parameter or buffer with this full name, or NULL. */
tdm_tensor *tdm_module_find(tdm_module *m, const char *name);
/* A deep copy of m on dev: same layers and settings, parameters and buffers copied with
 * their values, not yet flattened; training mode kept. Used for replicas. A layer whose impl
 * is not plain data (impl_size 0 with impl set) cannot be cloned: NULL and an error. */
tdm_module *tdm_module_clone(const tdm_module *m, tdm_device dev);
/* Frees the tree, its parameters, buffers and sets. NULL is allowed. */
void tdm_module_free(tdm_module *m);

/* Base constructor for new layer kinds: a module with no parameters. impl (malloc'd, freed
 * by ops->destroy) holds the layer's settings; set m->impl_size when they are plain data so
 * the layer can be cloned. */
tdm_module *tdm_module_new(const tdm_module_ops *ops, tdm_device dev, void *impl);
/* Registers a caller-owned tensor under name (the module takes ownership). */
int tdm_module_add_param(tdm_module *m, const char *name, tdm_tensor *p);
int tdm_module_add_buffer(tdm_module *m, const char *name, tdm_tensor *b);

#ifdef __cplusplus
}
#endif
#endif
