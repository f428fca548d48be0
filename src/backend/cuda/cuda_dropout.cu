/* CUDA dropout: the CPU's Philox counters (cpu_dropout.c), so masks match bit for bit. One
 * thread per element in a grid-stride loop. x and y may be f32, bf16 or f16 (y = x * mask in
 * f32, rounded once); the mask is f32 or x's dtype. */
#include "backend/cuda/cuda_common.cuh"

#include <assert.h>

/* Element i owns Philox counter offset + i of stream 0 and reads word 0, as the CPU does; at
 * (a draw recorded in a graph): the seed and offset read from the device when it runs. */
template <typename T, typename TM>
__global__ void dropout_kernel(T *y, TM *mask, const T *x, float p, float keep, uint64_t seed,
                               uint64_t offset, const uint64_t *at, int64_t n) {
    if (at) seed = at[0], offset = at[1];
    CU_LOOP(i, n) {
        uint32_t r[4];
        cu_philox(seed, offset + (uint64_t)i, 0, r);
        float m = cu_unit(r[0]) >= p ? keep : 0.0f;
        if (mask) mask[i] = cu_to<TM>(m);
        y[i] = cu_to<T>(cu_ld(x[i]) * m);
    }
}

template <typename T>
static void dropout_launch(cu_device *d, tdm_tensor *y, tdm_tensor *mask, const tdm_tensor *x,
                           float p, float keep, uint64_t seed, uint64_t offset, const uint64_t *at,
                           int64_t n) {
    if (mask && mask->dtype != TDM_F32)
        dropout_kernel<T, T><<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(
            cu_p<T>(y), cu_p<T>(mask), cu_p<T>(x), p, keep, seed, offset, at, n);
    else
        dropout_kernel<T, float><<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(
            cu_p<T>(y), cu_f(mask), cu_p<T>(x), p, keep, seed, offset, at, n);
}

extern "C" int tdm_cuda_dropout(tdm_tensor *y, tdm_tensor *mask, const tdm_tensor *x, float p,
                                uint64_t seed, uint64_t offset, const uint64_t *at) {
    /* the op (nn/functional_dropout.c) makes x contiguous and allocates y and mask */
    assert(tdm_is_contiguous(x) && tdm_is_contiguous(y) && (!mask || tdm_is_contiguous(mask)));
    if (cu_check_float("dropout", true, {x, y})) return tdm_last_status();
    if (mask && mask->dtype != TDM_F32 && mask->dtype != x->dtype)
        return tdm_raise(TDM_ERR_DTYPE, "cuda dropout: a %s mask for %s x (f32 or x's dtype)",
                         tdm_dtype_name(mask->dtype), tdm_dtype_name(x->dtype));
    cu_device *d = cu_dev_of(y, "dropout");
    if (!d) return tdm_last_status();
    if (d->capture && !at) /* a draw the op did not give its graph words (graph_draw) */
        return cu_not_capturable(y->device.index, "dropout",
                                 "each replay would drop the same elements");
    int64_t n = tdm_numel(x);
    if (n == 0) return TDM_OK;
    float keep = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f; /* p = 1 drops everything */
    CU_DISPATCH(x->dtype, dropout_launch, d, y, mask, x, p, keep, seed, offset, at, n);
    return cu_check_launch("dropout", y->device.index);
}
