/* CUDA dropout: the CPU's Philox counters (cpu_dropout.c), so masks match bit for bit. One
 * thread per element in a grid-stride loop. */
#include "backend/cuda/cuda_common.cuh"

#include <assert.h>

/* Element i owns Philox counter offset + i of stream 0 and reads word 0, as the CPU does. */
__global__ void dropout_kernel(float *y, float *mask, const float *x, float p, float keep,
                               uint64_t seed, uint64_t offset, int64_t n) {
    CU_LOOP(i, n) {
        uint32_t r[4];
        cu_philox(seed, offset + (uint64_t)i, 0, r);
        float m = cu_unit(r[0]) >= p ? keep : 0.0f;
        if (mask) mask[i] = m;
        y[i] = x[i] * m;
    }
}

extern "C" int tdm_cuda_dropout(tdm_tensor *y, tdm_tensor *mask, const tdm_tensor *x, float p,
                                uint64_t seed, uint64_t offset) {
    /* the op (nn/functional_dropout.c) makes x contiguous and allocates y and mask */
    assert(tdm_is_contiguous(x) && tdm_is_contiguous(y) && (!mask || tdm_is_contiguous(mask)));
    cu_device *d = cu_dev_of(y, "dropout");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(x);
    if (n == 0) return TDM_OK;
    float keep = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f; /* p = 1 drops everything */
    dropout_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_f(y), cu_f(mask), cu_f(x), p,
                                                                keep, seed, offset, n);
    return cu_check_launch("dropout", y->device.index);
}
