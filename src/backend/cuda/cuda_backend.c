/* The CUDA backend table: every kernel of backend.h for cuda:N devices. Designated
 * initializers: an entry a backend does not provide stays NULL, and the op that needs it
 * reports that instead of crashing. */
#include "backend/cuda/cuda.h"

void *tdm_cuda_ptr(const tdm_tensor *t) {
    if (!t || !t->storage) return NULL;
    return (char *)t->storage->data + t->offset * (int64_t)tdm_dtype_size(t->dtype);
}

const tdm_backend tdm_cuda_backend = {
    .name = "cuda",
    .mem_alloc = tdm_cuda_mem_alloc,
    .mem_free = tdm_cuda_mem_free,
    .to_host = tdm_cuda_to_host,
    .from_host = tdm_cuda_from_host,
    .pinned_alloc = tdm_cuda_host_alloc,
    .pinned_free = tdm_cuda_host_free,
    .upload_async = tdm_cuda_upload_async,
    .fence_wait = tdm_cuda_fence_wait,
    .fence_free = tdm_cuda_fence_free,
    .copy = tdm_cuda_copy,
    .fill = tdm_cuda_fill,
    .random = tdm_cuda_random,
    .unary = tdm_cuda_unary,
    .unary_backward = tdm_cuda_unary_backward,
    .binary = tdm_cuda_binary,
    .axpy = tdm_cuda_axpy,
    .reduce = tdm_cuda_reduce,
    .sum_to = tdm_cuda_sum_to,
    .max_backward = tdm_cuda_max_backward,
    .softmax = tdm_cuda_softmax,
    .softmax_backward = tdm_cuda_softmax_backward,
    .sum_squares = tdm_cuda_sum_squares,
    .matmul = tdm_cuda_matmul,
    .index_select = tdm_cuda_index_select,
    .index_add = tdm_cuda_index_add,
    .conv2d = tdm_cuda_conv2d,
    .conv2d_backward = tdm_cuda_conv2d_backward,
    .max_pool2d = tdm_cuda_max_pool2d,
    .max_pool2d_backward = tdm_cuda_max_pool2d_backward,
    .avg_pool2d = tdm_cuda_avg_pool2d,
    .avg_pool2d_backward = tdm_cuda_avg_pool2d_backward,
    .batch_norm = tdm_cuda_batch_norm,
    .batch_norm_backward = tdm_cuda_batch_norm_backward,
    .batch_norm_stats = tdm_cuda_batch_norm_stats,
    .batch_norm_backward_reduce = tdm_cuda_batch_norm_backward_reduce,
    .batch_norm_backward_elemt = tdm_cuda_batch_norm_backward_elemt,
    .layer_norm = tdm_cuda_layer_norm,
    .layer_norm_backward = tdm_cuda_layer_norm_backward,
    .dropout = tdm_cuda_dropout,
    .cross_entropy = tdm_cuda_cross_entropy,
    .cross_entropy_backward = tdm_cuda_cross_entropy_backward,
    .bce_logits = tdm_cuda_bce_logits,
    .bce_logits_backward = tdm_cuda_bce_logits_backward,
    .sgd_step = tdm_cuda_sgd_step,
    .adam_step = tdm_cuda_adam_step,
    .attention = tdm_cuda_attention,
    .attention_backward = tdm_cuda_attention_backward,
};
