/* CUDA element-wise kernels: unary ops and their derivatives, binary ops on broadcast views
 * (stride 0) and axpy.
 *
 * One thread per output element in a grid-stride loop; strided operands are addressed with
 * cu_offset (a contiguous operand collapses to offset i). The operator switch is uniform
 * across a launch, so it costs no divergence. */
#include "backend/cuda/cuda_common.cuh"

/* after cuda_common.cuh, which includes the C headers for nvcc */
#include "backend/unary_math.h"

#include <assert.h>

static int check_f32(const char *op, const tdm_tensor *t) {
    if (t && t->dtype != TDM_F32)
        return tdm_raise(TDM_ERR_DTYPE, "cuda %s: f32 tensors only, got %s", op,
                         tdm_dtype_name(t->dtype));
    return TDM_OK;
}

/* ---- unary ------------------------------------------------------------------------------- */

__device__ __forceinline__ float sigmoidf_(float v) {
    return 1.0f / (1.0f + expf(-v));
}

__device__ float unary_fwd(tdm_unary_op op, float v, float s) {
    switch (op) {
    case TDM_UN_NEG:
        return -v;
    case TDM_UN_EXP:
        return expf(v);
    case TDM_UN_LOG:
        return logf(v);
    case TDM_UN_SQRT:
        return sqrtf(v);
    case TDM_UN_RELU:
        return v <= 0.0f ? 0.0f : v; /* NaN propagates, as torch.relu */
    case TDM_UN_GELU_TANH:
        return v * sigmoidf_(2.0f * TDM_GELU_BETA * (v + TDM_GELU_KAPPA * v * v * v));
    case TDM_UN_GELU_ERF:
        return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case TDM_UN_TANH:
        return tanhf(v);
    case TDM_UN_SIGMOID:
        return sigmoidf_(v);
    case TDM_UN_ADD_SCALAR:
        return v + s;
    case TDM_UN_MUL_SCALAR:
        return v * s;
    case TDM_UN_POW_SCALAR:
        if (s == 2.0f) return v * v;
        if (s == 1.0f) return v;
        if (s == 0.5f) return sqrtf(v);
        if (s == -1.0f) return 1.0f / v;
        return powf(v, s);
    case TDM_UN_SOFTSIGN:
        return v / (1.0f + fabsf(v));
    }
    return 0.0f;
}

__global__ void unary_kernel(tdm_unary_op op, float *y, const float *x, cu_view xv, float s,
                             int64_t n) {
    CU_LOOP(i, n) y[i] = unary_fwd(op, x[cu_offset(xv, i)], s);
}

extern "C" int tdm_cuda_unary(tdm_unary_op op, tdm_tensor *y, const tdm_tensor *x, float s) {
    if (op < TDM_UN_NEG || op > TDM_UN_LAST)
        return tdm_raise(TDM_ERR_ARG, "cuda unary: unknown op %d", (int)op);
    int64_t n = tdm_numel(y);
    /* the op refused a tensor that is not f32 and allocated y contiguous like x */
    assert(y->dtype == TDM_F32 && x->dtype == TDM_F32 && n == tdm_numel(x) && tdm_is_contiguous(y));
    cu_device *d = cu_dev_of(y, "unary");
    if (!d) return tdm_last_status();
    if (n == 0) return TDM_OK;
    unary_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(op, cu_f(y), cu_f(x), cu_view_of(x),
                                                              s, n);
    return cu_check_launch("unary", y->device.index);
}

__device__ float unary_grad(tdm_unary_op op, float g, float v, float o, float s) {
    switch (op) {
    case TDM_UN_NEG:
        return -g;
    case TDM_UN_EXP:
        return g * o;
    case TDM_UN_LOG:
        return g / v;
    case TDM_UN_SQRT:
        return g / (2.0f * o);
    case TDM_UN_RELU:
        return v > 0.0f ? g : 0.0f;
    case TDM_UN_GELU_TANH: {
        float x2 = v * v;
        float t = tanhf(TDM_GELU_BETA * (v + TDM_GELU_KAPPA * x2 * v));
        return g * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * TDM_GELU_BETA *
                                            (1.0f + 3.0f * TDM_GELU_KAPPA * x2));
    }
    case TDM_UN_GELU_ERF: {
        float cdf = 0.5f * (1.0f + erff(v * 0.70710678118654752f));
        float pdf = expf(-0.5f * v * v) * 0.3989422804014327f;
        return g * (cdf + v * pdf);
    }
    case TDM_UN_TANH:
        return g * (1.0f - o * o);
    case TDM_UN_SIGMOID:
        return g * o * (1.0f - o);
    case TDM_UN_ADD_SCALAR:
        return g;
    case TDM_UN_MUL_SCALAR:
        return g * s;
    case TDM_UN_POW_SCALAR:
        if (s == 0.0f) return 0.0f; /* PyTorch: 0 even at v == 0 */
        if (s == 2.0f) return g * 2.0f * v;
        if (s == 1.0f) return g;
        return g * s * powf(v, s - 1.0f);
    case TDM_UN_SOFTSIGN:
        return g / ((1.0f + fabsf(v)) * (1.0f + fabsf(v)));
    }
    return 0.0f;
}

/* saved is x or y (whichever the derivative reads) or gy itself when it reads neither. */
__global__ void unary_bwd_kernel(tdm_unary_op op, float *gx, const float *gy, cu_view gv,
                                 const float *saved, cu_view sv, bool saved_is_y, float s,
                                 int64_t n) {
    CU_LOOP(i, n) {
        float g = gy[cu_offset(gv, i)], t = saved[cu_offset(sv, i)];
        gx[i] = unary_grad(op, g, saved_is_y ? 0.0f : t, saved_is_y ? t : 0.0f, s);
    }
}

/* An operand with gx's numel: contiguous (any shape), or strided with gx's shape. */
static bool walkable(const tdm_tensor *t, const tdm_tensor *gx) {
    if (tdm_numel(t) != tdm_numel(gx)) return false;
    return tdm_is_contiguous(t) || tdm_same_shape(t, gx);
}

extern "C" int tdm_cuda_unary_backward(tdm_unary_op op, tdm_tensor *gx, const tdm_tensor *gy,
                                       const tdm_tensor *x, const tdm_tensor *y, float s) {
    if (op < TDM_UN_NEG || op > TDM_UN_LAST)
        return tdm_raise(TDM_ERR_ARG, "cuda unary_backward: unknown op %d", (int)op);
    char need = tdm_unary_bwd_needs(op);
    const tdm_tensor *saved = need == 'x' ? x : need == 'y' ? y : gy;
    if (!saved)
        return tdm_raise(TDM_ERR_ARG, "cuda unary_backward: op %d needs its saved %c", (int)op,
                         need);
    if (check_f32("unary_backward", gx) || check_f32("unary_backward", gy) ||
        check_f32("unary_backward", saved))
        return tdm_last_status();
    if (!tdm_is_contiguous(gx) || !walkable(gy, gx) || !walkable(saved, gx))
        return tdm_raise(TDM_ERR_SHAPE, "cuda unary_backward: gx must be contiguous and a "
                                        "strided operand must have gx's shape");
    cu_device *d = cu_dev_of(gx, "unary_backward");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(gx);
    if (n == 0) return TDM_OK;
    unary_bwd_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(
        op, cu_f(gx), cu_f(gy), cu_view_of(gy), cu_f(saved), cu_view_of(saved), need == 'y', s, n);
    return cu_check_launch("unary_backward", gx->device.index);
}

/* ---- binary, axpy ------------------------------------------------------------------------ */

__global__ void binary_kernel(tdm_binary_op op, float *y, const float *a, cu_view av,
                              const float *b, cu_view bv, int64_t n) {
    CU_LOOP(i, n) {
        float u = a[cu_offset(av, i)], v = b[cu_offset(bv, i)];
        float r = op == TDM_BIN_ADD   ? u + v
                  : op == TDM_BIN_SUB ? u - v
                  : op == TDM_BIN_MUL ? u * v
                                      : u / v;
        y[i] = r;
    }
}

extern "C" int tdm_cuda_binary(tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a,
                               const tdm_tensor *b) {
    if (op < TDM_BIN_ADD || op > TDM_BIN_DIV)
        return tdm_raise(TDM_ERR_ARG, "cuda binary: unknown op %d", (int)op);
    /* the op refused operands that are not f32 or do not broadcast, and expanded them */
    assert(y->dtype == TDM_F32 && a->dtype == TDM_F32 && b->dtype == TDM_F32);
    assert(tdm_is_contiguous(y) && tdm_same_shape(y, a) && tdm_same_shape(y, b));
    cu_device *d = cu_dev_of(y, "binary");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(y);
    if (n == 0) return TDM_OK;
    binary_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(op, cu_f(y), cu_f(a), cu_view_of(a),
                                                               cu_f(b), cu_view_of(b), n);
    return cu_check_launch("binary", y->device.index);
}

__global__ void axpy_kernel(float *y, float alpha, const float *x, int64_t n) {
    CU_LOOP(i, n) y[i] += alpha * x[i];
}

extern "C" int tdm_cuda_axpy(tdm_tensor *y, float alpha, const tdm_tensor *x) {
    if (check_f32("axpy", y) || check_f32("axpy", x)) return tdm_last_status();
    if (tdm_numel(y) != tdm_numel(x) || !tdm_is_contiguous(y) || !tdm_is_contiguous(x))
        return tdm_raise(TDM_ERR_ARG, "cuda axpy: y and x must be contiguous of one size");
    cu_device *d = cu_dev_of(y, "axpy");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(y);
    if (n == 0) return TDM_OK;
    axpy_kernel<<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_f(y), alpha, cu_f(x), n);
    return cu_check_launch("axpy", y->device.index);
}
