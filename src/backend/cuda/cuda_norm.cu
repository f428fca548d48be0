/* CUDA batch norm (plain and synchronised) and layer norm.
 *
 * Batch norm: one block per channel walks that channel's N*S values (x [N, C, S]),
 * reducing in double with a fixed tree, then writes the channel's outputs: statistics and
 * normalisation in one launch, no scratch, no atomics. Layer norm: one block per row for
 * the row statistics and gx; the weight and bias gradients are column sums over rows, one
 * thread per column adding rows in order (deterministic, no atomics).
 *
 * x, y and their gradients may be f32, bf16 or f16 (one dtype per call); weights, biases,
 * statistics, running buffers and their gradients stay f32, as PyTorch's mixed precision
 * keeps them: sums in double as for f32, each low-precision output rounded once. */
#include "backend/cuda/cuda_common.cuh"

#include <assert.h>

#include <math.h>
#include <type_traits>

/* x [N, C, S]: N = shape[0], C = shape[1], S = every further dim (1 for [N, C]). */
static void bn_dims(const tdm_tensor *x, int64_t *n, int64_t *c, int64_t *s) {
    *n = x->shape[0];
    *c = x->ndim > 1 ? x->shape[1] : 1;
    int64_t nc = *n * *c;
    *s = nc > 0 ? tdm_numel(x) / nc : 1;
}

/* Offset of value e (0 <= e < N*S) of channel c. */
__device__ __forceinline__ int64_t bn_at(int64_t e, int64_t c, int64_t C, int64_t S) {
    return ((e / S) * C + c) * S + e % S;
}

template <typename T> struct bn_args {
    T *y;
    float *save_mean, *save_invstd, *running_mean, *running_var;
    const T *x;
    const float *w, *b;
    int64_t N, C, S;
    bool training;
    float momentum, eps;
};

template <typename T> __global__ void bn_fwd_kernel(bn_args<T> a) {
    __shared__ double sh[CU_THREADS];
    int64_t c = blockIdx.x, M = a.N * a.S;
    double mean, var;
    if (a.training) { /* two passes, as the CPU: stable for large means */
        double s = 0;
        for (int64_t e = threadIdx.x; e < M; e += blockDim.x)
            s += cu_ld(a.x[bn_at(e, c, a.C, a.S)]);
        mean = cu_block_sum(s, sh) / (double)M;
        float mf = (float)mean;
        double q = 0;
        for (int64_t e = threadIdx.x; e < M; e += blockDim.x) {
            float dv = cu_ld(a.x[bn_at(e, c, a.C, a.S)]) - mf;
            q += (double)dv * dv;
        }
        var = cu_block_sum(q, sh) / (double)M;
    } else {
        mean = a.running_mean[c], var = a.running_var[c];
    }
    float invstd = (float)(1.0 / sqrt(var + (double)a.eps)), mu = (float)mean;
    float scale = invstd * (a.w ? a.w[c] : 1.0f);
    float shift = (a.b ? a.b[c] : 0.0f) - mu * scale;
    if (threadIdx.x == 0) {
        if (a.save_mean) a.save_mean[c] = mu;
        if (a.save_invstd) a.save_invstd[c] = invstd;
        float m1 = 1 - a.momentum;
        if (a.training && a.running_mean)
            a.running_mean[c] = m1 * a.running_mean[c] + a.momentum * mu;
        /* PyTorch tracks the unbiased variance while normalising with the biased one */
        if (a.training && a.running_var)
            a.running_var[c] =
                m1 * a.running_var[c] + a.momentum * (float)(var * (double)M / (double)(M - 1));
    }
    for (int64_t e = threadIdx.x; e < M; e += blockDim.x) {
        int64_t o = bn_at(e, c, a.C, a.S);
        a.y[o] = cu_to<T>(cu_ld(a.x[o]) * scale + shift);
    }
}

template <typename T>
static void bn_fwd_launch(cu_device *d, tdm_tensor *y, tdm_tensor *save_mean,
                          tdm_tensor *save_invstd, const tdm_tensor *x, const tdm_tensor *weight,
                          const tdm_tensor *bias, tdm_tensor *running_mean, tdm_tensor *running_var,
                          bool training, float momentum, float eps) {
    bn_args<T> a;
    bn_dims(x, &a.N, &a.C, &a.S);
    a.y = cu_p<T>(y), a.save_mean = cu_f(save_mean), a.save_invstd = cu_f(save_invstd);
    a.running_mean = cu_f(running_mean), a.running_var = cu_f(running_var);
    a.x = cu_p<T>(x), a.w = cu_f(weight), a.b = cu_f(bias);
    a.training = training, a.momentum = momentum, a.eps = eps;
    bn_fwd_kernel<T><<<(unsigned)a.C, cu_row_threads(a.N * a.S), 0, d->compute>>>(a);
}

/* x and its same-shaped companions of one floating dtype, the per-channel tensors f32. */
static int bn_check(const char *op, std::initializer_list<const tdm_tensor *> like_x,
                    std::initializer_list<const tdm_tensor *> per_channel) {
    if (cu_check_float(op, true, like_x)) return tdm_last_status();
    for (const tdm_tensor *t : per_channel)
        if (t && t->dtype != TDM_F32)
            return tdm_raise(TDM_ERR_DTYPE,
                             "cuda %s: weights, biases and statistics must be f32, got %s", op,
                             tdm_dtype_name(t->dtype));
    return TDM_OK;
}

extern "C" int tdm_cuda_batch_norm(tdm_tensor *y, tdm_tensor *save_mean, tdm_tensor *save_invstd,
                                   const tdm_tensor *x, const tdm_tensor *weight,
                                   const tdm_tensor *bias, tdm_tensor *running_mean,
                                   tdm_tensor *running_var, bool training, float momentum,
                                   float eps) {
    int64_t N, C, S;
    bn_dims(x, &N, &C, &S);
    assert(!training || N * S > 1); /* the op refused fewer values (nn/functional_norm.c) */
    assert(training || (running_mean && running_var)); /* and eval without running stats */
    if (bn_check("batch_norm", {x, y},
                 {save_mean, save_invstd, weight, bias, running_mean, running_var}))
        return tdm_last_status();
    cu_device *d = cu_dev_of(x, "batch_norm");
    if (!d) return tdm_last_status();
    if (C == 0 || C > INT32_MAX) return TDM_OK;
    CU_DISPATCH(x->dtype, bn_fwd_launch, d, y, save_mean, save_invstd, x, weight, bias,
                running_mean, running_var, training, momentum, eps);
    return cu_check_launch("batch_norm", x->device.index);
}

/* sum of g and of g * (x - mean[c]) over channel c, in double; every thread gets both. */
template <typename T>
__device__ void bn_grad_sums(const T *g, const T *x, float mu, int64_t c, int64_t C, int64_t S,
                             int64_t M, double *sg, double *sgx) {
    __shared__ double sh[CU_THREADS];
    double s1 = 0, s2 = 0;
    for (int64_t e = threadIdx.x; e < M; e += blockDim.x) {
        int64_t o = bn_at(e, c, C, S);
        float gv = cu_ld(g[o]);
        s1 += gv;
        s2 += (double)gv * (cu_ld(x[o]) - mu);
    }
    *sg = cu_block_sum(s1, sh);
    *sgx = cu_block_sum(s2, sh);
}

template <typename T> struct bn_bwd_args {
    T *gx;
    float *gw, *gb;
    const T *gy, *x;
    const float *w, *mean, *invstd;
    int64_t N, C, S;
    bool training;
};

template <typename T> __global__ void bn_bwd_kernel(bn_bwd_args<T> a) {
    int64_t c = blockIdx.x, M = a.N * a.S;
    float inv = a.invstd[c], mu = a.mean[c], scale = inv * (a.w ? a.w[c] : 1.0f);
    double sg = 0, sgx = 0;
    if (a.gw || a.gb || (a.gx && a.training))
        bn_grad_sums(a.gy, a.x, mu, c, a.C, a.S, M, &sg, &sgx);
    if (threadIdx.x == 0) {
        if (a.gb) a.gb[c] = (float)sg;
        if (a.gw) a.gw[c] = (float)(sgx * inv);
    }
    if (!a.gx) return;
    /* training: gx = w*invstd * (gy - mean(gy) - xhat * mean(gy * xhat)) */
    float mg = (float)(sg / (double)M), k = (float)(sgx / (double)M) * inv * inv;
    for (int64_t e = threadIdx.x; e < M; e += blockDim.x) {
        int64_t o = bn_at(e, c, a.C, a.S);
        float g = cu_ld(a.gy[o]);
        a.gx[o] = cu_to<T>(a.training ? (g - mg - (cu_ld(a.x[o]) - mu) * k) * scale : g * scale);
    }
}

template <typename T>
static void bn_bwd_launch(cu_device *d, tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                          const tdm_tensor *gy, const tdm_tensor *x, const tdm_tensor *weight,
                          const tdm_tensor *save_mean, const tdm_tensor *save_invstd,
                          bool training) {
    bn_bwd_args<T> a;
    bn_dims(x, &a.N, &a.C, &a.S);
    a.gx = cu_p<T>(gx), a.gw = cu_f(gw), a.gb = cu_f(gb);
    a.gy = cu_p<T>(gy), a.x = cu_p<T>(x), a.w = cu_f(weight);
    a.mean = cu_f(save_mean), a.invstd = cu_f(save_invstd), a.training = training;
    bn_bwd_kernel<T><<<(unsigned)a.C, cu_row_threads(a.N * a.S), 0, d->compute>>>(a);
}

extern "C" int tdm_cuda_batch_norm_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                            const tdm_tensor *gy, const tdm_tensor *x,
                                            const tdm_tensor *weight, const tdm_tensor *save_mean,
                                            const tdm_tensor *save_invstd, bool training) {
    int64_t N, C, S;
    bn_dims(x, &N, &C, &S);
    if (bn_check("batch_norm_backward", {x, gx, gy}, {gw, gb, weight, save_mean, save_invstd}))
        return tdm_last_status();
    cu_device *d = cu_dev_of(x, "batch_norm_backward");
    if (!d) return tdm_last_status();
    if (C == 0 || C > INT32_MAX) return TDM_OK;
    CU_DISPATCH(x->dtype, bn_bwd_launch, d, gx, gw, gb, gy, x, weight, save_mean, save_invstd,
                training);
    return cu_check_launch("batch_norm_backward", x->device.index);
}

/* ---- synchronised batch norm: this rank's share ------------------------------------------ */

template <typename T>
__global__ void bn_stats_kernel(float *sum, const T *x, const float *center, int64_t C, int64_t S,
                                int64_t M) {
    __shared__ double sh[CU_THREADS];
    int64_t c = blockIdx.x;
    float ctr = center ? center[c] : 0.0f;
    double s = 0;
    for (int64_t e = threadIdx.x; e < M; e += blockDim.x) {
        float v = cu_ld(x[bn_at(e, c, C, S)]);
        if (center) {
            float dv = v - ctr;
            s += (double)dv * dv;
        } else {
            s += v;
        }
    }
    s = cu_block_sum(s, sh);
    if (threadIdx.x == 0) sum[c] = (float)s;
}

template <typename T>
static void bn_stats_launch(cu_device *d, tdm_tensor *sum, const tdm_tensor *x,
                            const tdm_tensor *center, int64_t C, int64_t S, int64_t M) {
    bn_stats_kernel<T><<<(unsigned)C, cu_row_threads(M), 0, d->compute>>>(cu_f(sum), cu_p<T>(x),
                                                                          cu_f(center), C, S, M);
}

extern "C" int tdm_cuda_batch_norm_stats(tdm_tensor *sum, const tdm_tensor *x,
                                         const tdm_tensor *center) {
    int64_t N, C, S;
    bn_dims(x, &N, &C, &S);
    if (bn_check("batch_norm_stats", {x}, {sum, center})) return tdm_last_status();
    cu_device *d = cu_dev_of(x, "batch_norm_stats");
    if (!d) return tdm_last_status();
    if (C == 0 || C > INT32_MAX) return TDM_OK;
    CU_DISPATCH(x->dtype, bn_stats_launch, d, sum, x, center, C, S, N * S);
    return cu_check_launch("batch_norm_stats", x->device.index);
}

template <typename T>
__global__ void bn_reduce_kernel(float *sdy, float *sdx, float *gw, float *gb, const T *g,
                                 const T *x, const float *mean, const float *invstd, int64_t C,
                                 int64_t S, int64_t M) {
    int64_t c = blockIdx.x;
    double sg, sgx;
    bn_grad_sums(g, x, mean[c], c, C, S, M, &sg, &sgx);
    if (threadIdx.x == 0) {
        sdy[c] = (float)sg;
        sdx[c] = (float)sgx;
        if (gb) gb[c] = (float)sg;
        if (gw) gw[c] = (float)(sgx * invstd[c]);
    }
}

template <typename T>
static void bn_reduce_launch(cu_device *d, tdm_tensor *sum_dy, tdm_tensor *sum_dy_xmu,
                             tdm_tensor *gw, tdm_tensor *gb, const tdm_tensor *gy,
                             const tdm_tensor *x, const tdm_tensor *mean, const tdm_tensor *invstd,
                             int64_t C, int64_t S, int64_t M) {
    bn_reduce_kernel<T><<<(unsigned)C, cu_row_threads(M), 0, d->compute>>>(
        cu_f(sum_dy), cu_f(sum_dy_xmu), cu_f(gw), cu_f(gb), cu_p<T>(gy), cu_p<T>(x), cu_f(mean),
        cu_f(invstd), C, S, M);
}

extern "C" int tdm_cuda_batch_norm_backward_reduce(tdm_tensor *sum_dy, tdm_tensor *sum_dy_xmu,
                                                   tdm_tensor *gw, tdm_tensor *gb,
                                                   const tdm_tensor *gy, const tdm_tensor *x,
                                                   const tdm_tensor *mean,
                                                   const tdm_tensor *invstd) {
    int64_t N, C, S;
    bn_dims(x, &N, &C, &S);
    if (bn_check("batch_norm_backward_reduce", {x, gy}, {sum_dy, sum_dy_xmu, gw, gb, mean, invstd}))
        return tdm_last_status();
    cu_device *d = cu_dev_of(x, "batch_norm_backward_reduce");
    if (!d) return tdm_last_status();
    if (C == 0 || C > INT32_MAX) return TDM_OK;
    CU_DISPATCH(x->dtype, bn_reduce_launch, d, sum_dy, sum_dy_xmu, gw, gb, gy, x, mean, invstd, C,
                S, N * S);
    return cu_check_launch("batch_norm_backward_reduce", x->device.index);
}

template <typename T>
__global__ void bn_elemt_kernel(T *gx, const T *g, const T *x, const float *w, const float *mean,
                                const float *invstd, const float *sdy, const float *sdx,
                                double count, int64_t C, int64_t S, int64_t n) {
    CU_LOOP(i, n) {
        int64_t c = (i / S) % C;
        float inv = invstd[c];
        float mg = (float)((double)sdy[c] / count);
        float k = (float)((double)sdx[c] / count) * inv * inv;
        gx[i] =
            cu_to<T>((cu_ld(g[i]) - mg - (cu_ld(x[i]) - mean[c]) * k) * (inv * (w ? w[c] : 1.0f)));
    }
}

template <typename T>
static void bn_elemt_launch(cu_device *d, tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *x,
                            const tdm_tensor *weight, const tdm_tensor *mean,
                            const tdm_tensor *invstd, const tdm_tensor *sum_dy,
                            const tdm_tensor *sum_dy_xmu, double count, int64_t C, int64_t S,
                            int64_t n) {
    bn_elemt_kernel<T><<<cu_blocks(n), CU_THREADS, 0, d->compute>>>(
        cu_p<T>(gx), cu_p<T>(gy), cu_p<T>(x), cu_f(weight), cu_f(mean), cu_f(invstd), cu_f(sum_dy),
        cu_f(sum_dy_xmu), count, C, S, n);
}

extern "C" int tdm_cuda_batch_norm_backward_elemt(tdm_tensor *gx, const tdm_tensor *gy,
                                                  const tdm_tensor *x, const tdm_tensor *weight,
                                                  const tdm_tensor *mean, const tdm_tensor *invstd,
                                                  const tdm_tensor *sum_dy,
                                                  const tdm_tensor *sum_dy_xmu, double count) {
    int64_t N, C, S;
    bn_dims(x, &N, &C, &S);
    if (bn_check("batch_norm_backward_elemt", {x, gx, gy},
                 {weight, mean, invstd, sum_dy, sum_dy_xmu}))
        return tdm_last_status();
    cu_device *d = cu_dev_of(x, "batch_norm_backward_elemt");
    if (!d) return tdm_last_status();
    int64_t n = tdm_numel(x);
    if (n == 0) return TDM_OK;
    CU_DISPATCH(x->dtype, bn_elemt_launch, d, gx, gy, x, weight, mean, invstd, sum_dy, sum_dy_xmu,
                count, C, S, n);
    return cu_check_launch("batch_norm_backward_elemt", x->device.index);
}

/* ---- layer norm: x [rows, cols] ---------------------------------------------------------- */
/* y (forward) and gy (backward) may have another dtype than x, gx and gres: a norm whose output
 * the next product takes in bf16 writes it so (tdm_layer_norm_to), its one rounding */

/* Rows of up to LN_WARP_COLS columns take a warp each (eight rows a block, no barrier: the
 * row's sums by shuffles), wider ones a block each (the sums through shared memory), as every
 * row does after tdm_cuda_layer_norm_warps(false) (bench_cuda times the two). */
#define LN_WARP_COLS 4096
#define LN_WARP_ROWS 8
static bool ln_warps = true; /* tdm_cuda_layer_norm_warps */

extern "C" void tdm_cuda_layer_norm_warps(bool on) {
    __atomic_store_n(&ln_warps, on, __ATOMIC_RELAXED);
}
static bool ln_by_warp(int64_t cols) {
    return cols <= LN_WARP_COLS && __atomic_load_n(&ln_warps, __ATOMIC_RELAXED);
}

/* The sum of v over the threads of a row: a warp's lanes by an xor butterfly, every lane
 * getting the same bits (each pair is added in both orders, and addition commutes), or the
 * block's (cu_block_sum). Every thread of the block calls it: the emulation's shuffle is a
 * barrier of the block. */
template <bool WARP> __device__ __forceinline__ double ln_row_sum(double v, double *sh) {
    if constexpr (WARP) {
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    } else {
        return cu_block_sum(v, sh);
    }
}

/* With res, the row is x + res rounded to x's dtype (the add kernel's bits), written to sum as
 * the first pass reads it; the later passes read sum, each thread only the elements it wrote.
 * A warp past the last row (WARP) takes part in the shuffles and touches no memory. */
template <typename TX, typename TY, typename TR, bool WARP>
__global__ void ln_fwd_kernel(TY *y, float *mean, float *rstd, const TX *x, const float *w,
                              const float *b, const TR *res, TX *sum, int64_t rows, int64_t cols,
                              float eps) {
    __shared__ double sh[WARP ? 1 : CU_THREADS];
    const int64_t r = WARP ? blockIdx.x * (int64_t)LN_WARP_ROWS + threadIdx.x / 32 : blockIdx.x;
    const int t = WARP ? threadIdx.x % 32 : threadIdx.x, nt = WARP ? 32 : blockDim.x;
    const int64_t n = r < rows ? cols : 0, row = n ? r : 0; /* n: the elements this thread has */
    const TX *xr = x + row * cols;
    TY *yr = y + row * cols;
    double s = 0;
    if (res) {
        const TR *rr = res + row * cols;
        TX *sr = sum + row * cols;
        for (int64_t c = t; c < n; c += nt) {
            const TX v = cu_to<TX>(cu_ld(xr[c]) + cu_ld(rr[c]));
            sr[c] = v;
            s += cu_ld(v);
        }
        xr = sr;
    } else {
        for (int64_t c = t; c < n; c += nt) s += cu_ld(xr[c]);
    }
    float m = (float)(ln_row_sum<WARP>(s, sh) / (double)cols);
    double q = 0;
    for (int64_t c = t; c < n; c += nt) {
        float dv = cu_ld(xr[c]) - m;
        q += (double)dv * dv;
    }
    double var = ln_row_sum<WARP>(q, sh) / (double)cols; /* biased, as PyTorch */
    float inv = (float)(1.0 / sqrt(var + (double)eps));
    if (t == 0 && n) mean[r] = m, rstd[r] = inv;
    for (int64_t c = t; c < n; c += nt)
        yr[c] = cu_to<TY>((cu_ld(xr[c]) - m) * inv * (w ? w[c] : 1.0f) + (b ? b[c] : 0.0f));
}

/* the arguments of tdm_cuda_layer_norm, as the dtypes are picked */
struct ln_fwd_args {
    tdm_tensor *y, *mean, *rstd, *sum;
    const tdm_tensor *x, *weight, *bias, *res;
    int64_t rows, cols;
    float eps;
};

template <typename TX, typename TY, typename TR>
static void ln_fwd_launch(cu_device *d, const ln_fwd_args &a) {
    const TR *res = a.res ? cu_p<TR>(a.res) : nullptr;
    TX *sum = a.res ? cu_p<TX>(a.sum) : nullptr;
    if (ln_by_warp(a.cols))
        ln_fwd_kernel<TX, TY, TR, true>
            <<<(unsigned)((a.rows + LN_WARP_ROWS - 1) / LN_WARP_ROWS), 32 * LN_WARP_ROWS, 0,
               d->compute>>>(cu_p<TY>(a.y), cu_f(a.mean), cu_f(a.rstd), cu_p<TX>(a.x),
                             cu_f(a.weight), cu_f(a.bias), res, sum, a.rows, a.cols, a.eps);
    else
        ln_fwd_kernel<TX, TY, TR, false>
            <<<(unsigned)a.rows, cu_row_threads(a.cols), 0, d->compute>>>(
                cu_p<TY>(a.y), cu_f(a.mean), cu_f(a.rstd), cu_p<TX>(a.x), cu_f(a.weight),
                cu_f(a.bias), res, sum, a.rows, a.cols, a.eps);
}
/* x's dtype chosen (CU_DISPATCH), then y's, then res's: x's own, or bf16/f16 beside f32 x */
template <typename TX, typename TY>
static void ln_fwd_pick_res(cu_device *d, const ln_fwd_args &a) {
    const tdm_dtype rt = a.res ? a.res->dtype : a.x->dtype;
    if constexpr (std::is_same<TX, float>::value) { /* only f32 x takes another res dtype */
        if (rt == TDM_BF16) return ln_fwd_launch<TX, TY, __nv_bfloat16>(d, a);
        if (rt == TDM_F16) return ln_fwd_launch<TX, TY, __half>(d, a);
    }
    ln_fwd_launch<TX, TY, TX>(d, a);
}
template <typename TX> static void ln_fwd_pick_y(cu_device *d, const ln_fwd_args &a) {
    a.y->dtype == TDM_BF16  ? ln_fwd_pick_res<TX, __nv_bfloat16>(d, a)
    : a.y->dtype == TDM_F16 ? ln_fwd_pick_res<TX, __half>(d, a)
                            : ln_fwd_pick_res<TX, float>(d, a);
}

extern "C" int tdm_cuda_layer_norm(tdm_tensor *y, tdm_tensor *mean, tdm_tensor *rstd,
                                   const tdm_tensor *x, const tdm_tensor *weight,
                                   const tdm_tensor *bias, float eps, const tdm_tensor *res,
                                   tdm_tensor *sum) {
    int64_t rows = tdm_numel(mean), cols = rows ? tdm_numel(x) / rows : 0;
    if (bn_check("layer_norm", {x, sum}, {mean, rstd, weight, bias}) ||
        cu_check_float("layer_norm", false, {y, res}))
        return tdm_last_status();
    if (res && (!sum || (res->dtype != x->dtype && x->dtype != TDM_F32)))
        return tdm_raise(TDM_ERR_DTYPE,
                         "cuda layer_norm: a %s residual beside %s x (it must be x's dtype, or "
                         "bf16/f16 beside f32), or no sum for it",
                         tdm_dtype_name(res->dtype), tdm_dtype_name(x->dtype));
    cu_device *d = cu_dev_of(x, "layer_norm");
    if (!d) return tdm_last_status();
    if (rows == 0 || cols == 0) return TDM_OK;
    if (rows > INT32_MAX) return tdm_raise(TDM_ERR_SHAPE, "cuda layer_norm: too many rows");
    const ln_fwd_args a = {y, mean, rstd, sum, x, weight, bias, res, rows, cols, eps};
    CU_DISPATCH(x->dtype, ln_fwd_pick_y, d, a);
    return cu_check_launch("layer_norm", x->device.index);
}

/* gx = rstd * (d - mean(d) - xhat * mean(d * xhat)) with d = gy * w, a row a warp or a block
 * (as the forward); with gres, gres + that (rounded first: an add kernel's bits; __fadd_rn: no
 * multiply-add). */
template <typename T, typename TG, bool WARP>
__global__ void ln_bwd_kernel(T *gx, const TG *g, const T *x, const float *w, const float *mean,
                              const float *rstd, const T *gres, int64_t rows, int64_t cols) {
    __shared__ double sh[WARP ? 1 : CU_THREADS];
    const int64_t r = WARP ? blockIdx.x * (int64_t)LN_WARP_ROWS + threadIdx.x / 32 : blockIdx.x;
    const int t = WARP ? threadIdx.x % 32 : threadIdx.x, nt = WARP ? 32 : blockDim.x;
    const int64_t n = r < rows ? cols : 0, row = n ? r : 0; /* n: the elements this thread has */
    const TG *gr = g + row * cols;
    const T *xr = x + row * cols;
    const float m = mean[row], inv = rstd[row];
    double sd = 0, sdx = 0;
    for (int64_t c = t; c < n; c += nt) {
        float h = (cu_ld(xr[c]) - m) * inv, dv = cu_ld(gr[c]) * (w ? w[c] : 1.0f);
        sd += dv;
        sdx += (double)dv * h;
    }
    float md = (float)(ln_row_sum<WARP>(sd, sh) / (double)cols);
    float mdx = (float)(ln_row_sum<WARP>(sdx, sh) / (double)cols);
    for (int64_t c = t; c < n; c += nt) {
        float h = (cu_ld(xr[c]) - m) * inv, dv = cu_ld(gr[c]) * (w ? w[c] : 1.0f);
        T v = cu_to<T>(inv * (dv - md - h * mdx));
        gx[row * cols + c] = gres ? cu_to<T>(__fadd_rn(cu_ld(gres[row * cols + c]), cu_ld(v))) : v;
    }
}

/* gw[c] = sum_r gy[r, c] * xhat[r, c], gb[c] = sum_r gy[r, c], in two passes, so that a few
 * hundred columns over thousands of rows (a GPT's [B*T, C]) fill the GPU: one thread a column
 * over all rows kept 768 threads busy and took a fifth of a GPT step on an H200.
 * Pass 1: a block per (column tile, row chunk), LN_TX x LN_TY threads; thread (tx, ty) sums
 * rows ty, ty + LN_TY, ... of its chunk; the LN_TY sums of a column are added in ty order.
 * Pass 2: one thread a column adds the chunks' sums in chunk order. A fixed order throughout:
 * the same result on every run. */
#define LN_TX         32
#define LN_TY         8
#define LN_MAX_CHUNKS 1024

template <typename T, typename TG>
__global__ void ln_wb_partial_kernel(double *pw, double *pb, const TG *g, const T *x,
                                     const float *mean, const float *rstd, int64_t rows,
                                     int64_t cols, int64_t chunk_rows, int64_t tiles) {
    __shared__ double sw[LN_TY][LN_TX], sb[LN_TY][LN_TX];
    const int tx = threadIdx.x % LN_TX, ty = threadIdx.x / LN_TX;
    const int64_t chunk = blockIdx.x / tiles, c = (blockIdx.x % tiles) * LN_TX + tx;
    const int64_t r0 = chunk * chunk_rows;
    const int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    double w = 0, b = 0;
    if (c < cols)
        for (int64_t r = r0 + ty; r < r1; r += LN_TY) {
            float gv = cu_ld(g[r * cols + c]);
            w += (double)gv * ((cu_ld(x[r * cols + c]) - mean[r]) * rstd[r]);
            b += gv;
        }
    sw[ty][tx] = w, sb[ty][tx] = b;
    __syncthreads();
    if (ty == 0 && c < cols) {
        for (int y = 1; y < LN_TY; y++) w += sw[y][tx], b += sb[y][tx];
        pw[chunk * cols + c] = w, pb[chunk * cols + c] = b;
    }
}

__global__ void ln_wb_sum_kernel(float *gw, float *gb, const double *pw, const double *pb,
                                 int64_t chunks, int64_t cols) {
    CU_LOOP(c, cols) {
        double w = 0, b = 0;
        for (int64_t k = 0; k < chunks; k++) w += pw[k * cols + c], b += pb[k * cols + c];
        if (gw) gw[c] = (float)w;
        if (gb) gb[c] = (float)b;
    }
}

template <typename T, typename TG>
static int ln_wb(cu_device *d, int index, float *gw, float *gb, const tdm_tensor *gy,
                 const tdm_tensor *x, const tdm_tensor *mean, const tdm_tensor *rstd, int64_t rows,
                 int64_t cols) {
    int64_t chunk_rows = 16 * LN_TY; /* 16 rows a thread: enough blocks for a few hundred columns */
    if ((rows + chunk_rows - 1) / chunk_rows > LN_MAX_CHUNKS)
        chunk_rows = (rows + LN_MAX_CHUNKS - 1) / LN_MAX_CHUNKS;
    int64_t chunks = (rows + chunk_rows - 1) / chunk_rows, tiles = (cols + LN_TX - 1) / LN_TX;
    if (tiles * chunks > INT32_MAX)
        return tdm_raise(TDM_ERR_SHAPE, "cuda layer_norm: too many columns");
    tdm_storage *hold;
    double *pw = (double *)cu_scratch(index, sizeof(double) * 2 * (size_t)(chunks * cols), &hold);
    if (!pw) return tdm_last_status();
    double *pb = pw + chunks * cols;
    ln_wb_partial_kernel<T, TG><<<(unsigned)(tiles * chunks), LN_TX * LN_TY, 0, d->compute>>>(
        pw, pb, cu_p<TG>(gy), cu_p<T>(x), cu_f(mean), cu_f(rstd), rows, cols, chunk_rows, tiles);
    int rc = cu_check_launch("layer_norm_backward (weight, bias: rows)", index);
    if (!rc) {
        ln_wb_sum_kernel<<<cu_blocks(cols), CU_THREADS, 0, d->compute>>>(gw, gb, pw, pb, chunks,
                                                                         cols);
        rc = cu_check_launch("layer_norm_backward (weight, bias: chunks)", index);
    }
    tdm_storage_release(hold); /* in stream order: the kernels above run first */
    return rc;
}

template <typename T, typename TG>
static int ln_bwd_launch(cu_device *d, tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                         const tdm_tensor *gy, const tdm_tensor *x, const tdm_tensor *weight,
                         const tdm_tensor *mean, const tdm_tensor *rstd, const tdm_tensor *gres,
                         int64_t rows, int64_t cols) {
    const T *gr = gres ? cu_p<T>(gres) : NULL;
    if (gx && ln_by_warp(cols))
        ln_bwd_kernel<T, TG, true>
            <<<(unsigned)((rows + LN_WARP_ROWS - 1) / LN_WARP_ROWS), 32 * LN_WARP_ROWS, 0,
               d->compute>>>(cu_p<T>(gx), cu_p<TG>(gy), cu_p<T>(x), cu_f(weight), cu_f(mean),
                             cu_f(rstd), gr, rows, cols);
    else if (gx)
        ln_bwd_kernel<T, TG, false><<<(unsigned)rows, cu_row_threads(cols), 0, d->compute>>>(
            cu_p<T>(gx), cu_p<TG>(gy), cu_p<T>(x), cu_f(weight), cu_f(mean), cu_f(rstd), gr, rows,
            cols);
    int rc = gx ? cu_check_launch("layer_norm_backward", x->device.index) : TDM_OK;
    if (!rc && (gw || gb))
        rc = ln_wb<T, TG>(d, x->device.index, cu_f(gw), cu_f(gb), gy, x, mean, rstd, rows, cols);
    return rc;
}
/* x's dtype chosen (CU_DISPATCH), then gy's */
template <typename T>
static int ln_bwd_pick_g(cu_device *d, tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                         const tdm_tensor *gy, const tdm_tensor *x, const tdm_tensor *weight,
                         const tdm_tensor *mean, const tdm_tensor *rstd, const tdm_tensor *gres,
                         int64_t rows, int64_t cols) {
    return gy->dtype == TDM_BF16  ? ln_bwd_launch<T, __nv_bfloat16>(d, gx, gw, gb, gy, x, weight,
                                                                   mean, rstd, gres, rows, cols)
           : gy->dtype == TDM_F16 ? ln_bwd_launch<T, __half>(d, gx, gw, gb, gy, x, weight, mean,
                                                             rstd, gres, rows, cols)
                                  : ln_bwd_launch<T, float>(d, gx, gw, gb, gy, x, weight, mean,
                                                            rstd, gres, rows, cols);
}

extern "C" int tdm_cuda_layer_norm_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                            const tdm_tensor *gy, const tdm_tensor *x,
                                            const tdm_tensor *weight, const tdm_tensor *mean,
                                            const tdm_tensor *rstd, const tdm_tensor *gres) {
    int64_t rows = tdm_numel(mean), cols = rows ? tdm_numel(x) / rows : 0;
    if (bn_check("layer_norm_backward", {x, gx, gres}, {gw, gb, weight, mean, rstd}) ||
        cu_check_float("layer_norm_backward", false, {gy}))
        return tdm_last_status();
    if (gres && (!gx || gres == gx || tdm_numel(gres) != tdm_numel(x) || !tdm_is_contiguous(gres)))
        return tdm_raise(TDM_ERR_ARG, "cuda layer_norm_backward: gres must be contiguous, of x's "
                                      "size, with a gx other than it");
    cu_device *d = cu_dev_of(x, "layer_norm_backward");
    if (!d) return tdm_last_status();
    if (cols == 0) return TDM_OK;
    if (rows == 0) { /* an empty sum: zero gradients, as the CPU's memset */
        if ((gw && tdm_cuda_fill(gw, 0.0)) || (gb && tdm_cuda_fill(gb, 0.0)))
            return tdm_last_status();
        return TDM_OK;
    }
    if (rows > INT32_MAX) return tdm_raise(TDM_ERR_SHAPE, "cuda layer_norm: too many rows");
    return CU_DISPATCH(x->dtype, ln_bwd_pick_g, d, gx, gw, gb, gy, x, weight, mean, rstd, gres,
                       rows, cols);
}
