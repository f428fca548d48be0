/* CUDA element-wise kernels: unary ops and their derivatives, binary ops on broadcast views
 * (stride 0) and axpy, in f32, bf16 and f16 (float arithmetic, each output rounded once;
 * binary's and axpy's operands may mix dtypes, the output's being the caller's).
 *
 * One thread per output element in a grid-stride loop; strided operands are addressed with
 * cu_offset (a contiguous operand collapses to offset i). The operator switch is uniform
 * across a launch, so it costs no divergence. */
#include "backend/cuda/cuda_common.cuh"

/* after cuda_common.cuh, which includes the C headers for nvcc */
#include "backend/unary_math.h"

#include <assert.h>

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

template <typename T>
__global__ void unary_kernel(tdm_unary_op op, T *y, const T *x, cu_view xv, float s, int64_t n) {
    CU_LOOP(i, n) y[i] = cu_to<T>(unary_fwd(op, cu_ld(x[cu_offset(xv, i)]), s));
}

template <typename T>
static void unary_launch(cu_device *d, tdm_unary_op op, tdm_tensor *y, const tdm_tensor *x, float s,
                         int64_t n) {
    unary_kernel<T><<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(op, cu_p<T>(y), cu_p<T>(x),
                                                                 cu_view_of(x), s, n);
}

extern "C" int tdm_cuda_unary(tdm_unary_op op, tdm_tensor *y, const tdm_tensor *x, float s) {
    if (op < TDM_UN_NEG || op > TDM_UN_LAST)
        return tdm_raise(TDM_ERR_ARG, "cuda unary: unknown op %d", (int)op);
    int64_t n = tdm_numel(y);
    /* the op allocated y contiguous like x, of x's dtype */
    assert(n == tdm_numel(x) && tdm_is_contiguous(y));
    if (cu_check_float("unary", true, {y, x})) return tdm_last_status();
    cu_device *d = cu_dev_of(y, "unary");
    if (!d) return tdm_last_status();
    if (n == 0) return TDM_OK;
    CU_DISPATCH(y->dtype, unary_launch, d, op, y, x, s, n);
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
template <typename T>
__global__ void unary_bwd_kernel(tdm_unary_op op, T *gx, const T *gy, cu_view gv, const T *saved,
                                 cu_view sv, bool saved_is_y, float s, int64_t n) {
    CU_LOOP(i, n) {
        float g = cu_ld(gy[cu_offset(gv, i)]), t = cu_ld(saved[cu_offset(sv, i)]);
        gx[i] = cu_to<T>(unary_grad(op, g, saved_is_y ? 0.0f : t, saved_is_y ? t : 0.0f, s));
    }
}

template <typename T>
static void unary_bwd_launch(cu_device *d, tdm_unary_op op, tdm_tensor *gx, const tdm_tensor *gy,
                             const tdm_tensor *saved, bool saved_is_y, float s, int64_t n) {
    unary_bwd_kernel<T><<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(
        op, cu_p<T>(gx), cu_p<T>(gy), cu_view_of(gy), cu_p<T>(saved), cu_view_of(saved), saved_is_y,
        s, n);
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
    if (cu_check_float("unary_backward", true, {gx, gy, saved})) return tdm_last_status();
    if (!tdm_is_contiguous(gx) || !walkable(gy, gx) || !walkable(saved, gx))
        return tdm_raise(TDM_ERR_SHAPE, "cuda unary_backward: gx must be contiguous and a "
                                        "strided operand must have gx's shape");
    cu_device *d = cu_dev_of(gx, "unary_backward");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(gx);
    if (n == 0) return TDM_OK;
    CU_DISPATCH(gx->dtype, unary_bwd_launch, d, op, gx, gy, saved, need == 'y', s, n);
    return cu_check_launch("unary_backward", gx->device.index);
}

/* ---- binary, axpy ------------------------------------------------------------------------ */

template <typename TY, typename TA, typename TB>
__global__ void binary_kernel(tdm_binary_op op, TY *y, const TA *a, cu_view av, const TB *b,
                              cu_view bv, int64_t n) {
    CU_LOOP(i, n) {
        float u = cu_ld(a[cu_offset(av, i)]), v = cu_ld(b[cu_offset(bv, i)]);
        float r = op == TDM_BIN_ADD   ? u + v
                  : op == TDM_BIN_SUB ? u - v
                  : op == TDM_BIN_MUL ? u * v
                                      : u / v;
        y[i] = cu_to<TY>(r);
    }
}

/* The three dtypes picked one after another: y's, then a's, then b's (27 instantiations of a
 * few lines; any mix is one pass, as PyTorch's promotion computes bf16 + f32 in f32). */
template <typename TY, typename TA, typename TB>
static void binary_launch(cu_device *d, tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a,
                          const tdm_tensor *b, int64_t n) {
    binary_kernel<TY, TA, TB><<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(
        op, cu_p<TY>(y), cu_p<TA>(a), cu_view_of(a), cu_p<TB>(b), cu_view_of(b), n);
}
template <typename TY, typename TA>
static void binary_pick_b(cu_device *d, tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a,
                          const tdm_tensor *b, int64_t n) {
    b->dtype == TDM_BF16  ? binary_launch<TY, TA, __nv_bfloat16>(d, op, y, a, b, n)
    : b->dtype == TDM_F16 ? binary_launch<TY, TA, __half>(d, op, y, a, b, n)
                          : binary_launch<TY, TA, float>(d, op, y, a, b, n);
}
template <typename TY>
static void binary_pick_a(cu_device *d, tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a,
                          const tdm_tensor *b, int64_t n) {
    a->dtype == TDM_BF16  ? binary_pick_b<TY, __nv_bfloat16>(d, op, y, a, b, n)
    : a->dtype == TDM_F16 ? binary_pick_b<TY, __half>(d, op, y, a, b, n)
                          : binary_pick_b<TY, float>(d, op, y, a, b, n);
}

extern "C" int tdm_cuda_binary(tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a,
                               const tdm_tensor *b) {
    if (op < TDM_BIN_ADD || op > TDM_BIN_DIV)
        return tdm_raise(TDM_ERR_ARG, "cuda binary: unknown op %d", (int)op);
    /* the op refused operands that do not broadcast, expanded them and chose y's dtype */
    assert(tdm_is_contiguous(y) && tdm_same_shape(y, a) && tdm_same_shape(y, b));
    if (cu_check_float("binary", false, {y, a, b})) return tdm_last_status();
    cu_device *d = cu_dev_of(y, "binary");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(y);
    if (n == 0) return TDM_OK;
    CU_DISPATCH(y->dtype, binary_pick_a, d, op, y, a, b, n);
    return cu_check_launch("binary", y->device.index);
}

template <typename TY, typename TX>
__global__ void axpy_kernel(TY *y, float alpha, const TX *x, int64_t n) {
    CU_LOOP(i, n) y[i] = cu_to<TY>(cu_ld(y[i]) + alpha * cu_ld(x[i]));
}

/* y's dtype, then x's (an f32 gradient may take a bf16 one: a gradient of a cast's input). */
template <typename TY, typename TX>
static void axpy_launch(cu_device *d, tdm_tensor *y, float alpha, const tdm_tensor *x, int64_t n) {
    axpy_kernel<TY, TX>
        <<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(cu_p<TY>(y), alpha, cu_p<TX>(x), n);
}
template <typename TY>
static void axpy_pick_x(cu_device *d, tdm_tensor *y, float alpha, const tdm_tensor *x, int64_t n) {
    x->dtype == TDM_BF16  ? axpy_launch<TY, __nv_bfloat16>(d, y, alpha, x, n)
    : x->dtype == TDM_F16 ? axpy_launch<TY, __half>(d, y, alpha, x, n)
                          : axpy_launch<TY, float>(d, y, alpha, x, n);
}

extern "C" int tdm_cuda_axpy(tdm_tensor *y, float alpha, const tdm_tensor *x) {
    if (cu_check_float("axpy", false, {y, x})) return tdm_last_status();
    if (tdm_numel(y) != tdm_numel(x) || !tdm_is_contiguous(y) || !tdm_is_contiguous(x))
        return tdm_raise(TDM_ERR_ARG, "cuda axpy: y and x must be contiguous of one size");
    cu_device *d = cu_dev_of(y, "axpy");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(y);
    if (n == 0) return TDM_OK;
    CU_DISPATCH(y->dtype, axpy_pick_x, d, y, alpha, x, n);
    return cu_check_launch("axpy", y->device.index);
}
