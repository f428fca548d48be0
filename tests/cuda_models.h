/* The small models the GPU training tests share (test_cuda_train.c, test_cuda_graph.c), built
 * on cpu:0 from fixed seeds: an MLP with dropout [B, 20] -> 5 and a CNN with batch norm and
 * max pooling [B, 1, 12, 12] -> 5. */
#ifndef TDM_TEST_CUDA_MODELS_H
#define TDM_TEST_CUDA_MODELS_H

#include "tandem/tandem.h"

static tdm_module *make_mlp(void) {
    tdm_rng r = tdm_rng_make(1);
    tdm_module *l[4] = {tdm_linear_new(20, 64, true, tdm_cpu(0), &r), tdm_relu_new(),
                        tdm_dropout_new(0.2f, &r), tdm_linear_new(64, 5, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(4, l);
}

static tdm_module *make_cnn(void) {
    tdm_rng r = tdm_rng_make(2);
    tdm_conv2d_opts c = {.pad_h = 1, .pad_w = 1};
    tdm_pool2d_opts p = {.kernel_h = 2, .kernel_w = 2};
    tdm_module *l[6] = {tdm_conv2d_new(1, 8, 3, 3, &c, false, tdm_cpu(0), &r),
                        tdm_batch_norm2d_new(8, 1e-5f, 0.1f, tdm_cpu(0)),
                        tdm_relu_new(),
                        tdm_max_pool2d_new(&p),
                        tdm_flatten_new(1, -1),
                        tdm_linear_new(8 * 6 * 6, 5, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(6, l);
}

#endif
