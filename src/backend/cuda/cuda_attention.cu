/* CUDA causal self-attention (the contract is backend.h's; the CPU twin is cpu_attention.c).
 *
 * qkv [B, T, 3C] holds q, k and v side by side; head h of each is the channel block
 * [h*hs, (h+1)*hs). One block per (query or key row, head, batch row), scores of that row
 * only in shared memory, so nothing [T, T] is ever stored:
 *   forward       row t:  p_s = softmax_{s<=t}(scale q_t.k_s), y_t = sum_s p_s v_s, lse_t
 *   backward (q)  row t:  p_s again from lse_t, dp_s = dy_t.v_s, D_t = sum_s p_s dp_s,
 *                         ds_s = p_s (dp_s - D_t), dq_t = scale sum_s ds_s k_s
 *   backward (kv) row s:  the same p_ts and ds_ts for every t >= s (D_t from the q pass),
 *                         dk_s = scale sum_t ds_ts q_t, dv_s = sum_t p_ts dy_t
 * The key pass sums over the queries itself instead of adding into dk/dv from the query
 * blocks, so there are no atomics: every sum runs in a fixed order and results are the same
 * on every run. Block reductions (max, sums) use the fixed tree of cu_block_sum. */
#include "backend/cuda/cuda_common.cuh"

#include <assert.h>
#include <math.h>

#define ATT_THREADS 128
/* shared memory one block may take (the default limit without opting in) */
#define ATT_MAX_SHARED (48 * 1024)

typedef struct {
    int T, C, nh, hs;
    float scale;
} att_geom;

/* The (row, head, batch row) of this block: a 1-D grid of T * n_head * B blocks. */
__device__ __forceinline__ void att_block(const att_geom &g, int *t, int *h, int *b) {
    unsigned i = blockIdx.x;
    *t = (int)(i % (unsigned)g.T), i /= (unsigned)g.T;
    *h = (int)(i % (unsigned)g.nh), *b = (int)(i / (unsigned)g.nh);
}

/* Row t of head h of batch row b: q, k or v (part 0, 1, 2). */
__device__ __forceinline__ const float *att_row(const float *qkv, const att_geom &g, int b, int t,
                                                int h, int part) {
    return qkv + ((int64_t)b * g.T + t) * 3 * g.C + part * g.C + h * g.hs;
}

__device__ __forceinline__ float att_dot(const float *a, const float *b, int n) {
    float d = 0.0f;
    for (int c = 0; c < n; c++) d += a[c] * b[c];
    return d;
}

__global__ void att_fwd_kernel(float *y, float *lse, const float *qkv, att_geom g) {
    extern __shared__ float sm[]; /* q_t [hs], p [T] */
    __shared__ float red[ATT_THREADS];
    int t, h, b;
    att_block(g, &t, &h, &b);
    float *qs = sm, *p = sm + g.hs;
    const float *q = att_row(qkv, g, b, t, h, 0);
    for (int c = threadIdx.x; c < g.hs; c += blockDim.x) qs[c] = q[c];
    __syncthreads();
    float mx = -INFINITY;
    for (int s = threadIdx.x; s <= t; s += blockDim.x) {
        p[s] = g.scale * att_dot(qs, att_row(qkv, g, b, s, h, 1), g.hs);
        mx = cu_nanmax(mx, p[s]);
    }
    mx = cu_block_max(mx, red);
    float sum = 0.0f;
    for (int s = threadIdx.x; s <= t; s += blockDim.x) {
        p[s] = expf(p[s] - mx);
        sum += p[s];
    }
    sum = cu_block_sum(sum, red); /* its barriers also publish p */
    const float inv = 1.0f / sum;
    float *yt = y + ((int64_t)b * g.T + t) * g.C + h * g.hs;
    for (int c = threadIdx.x; c < g.hs; c += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s <= t; s++) acc += p[s] * inv * att_row(qkv, g, b, s, h, 2)[c];
        yt[c] = acc;
    }
    if (threadIdx.x == 0) lse[((int64_t)b * g.nh + h) * g.T + t] = mx + logf(sum);
}

/* dq of query row t, and D_t (the row's sum of p * dp) for the key pass. */
__global__ void att_bwd_q_kernel(float *dqkv, float *D, const float *dy, const float *qkv,
                                 const float *lse, att_geom g) {
    extern __shared__ float sm[]; /* q_t [hs], dy_t [hs], p [T], ds [T] */
    __shared__ float red[ATT_THREADS];
    int t, h, b;
    att_block(g, &t, &h, &b);
    const int64_t row = ((int64_t)b * g.nh + h) * g.T + t;
    float *qs = sm, *gs = sm + g.hs, *p = gs + g.hs, *ds = p + g.T;
    const float *q = att_row(qkv, g, b, t, h, 0),
                *gy = dy + ((int64_t)b * g.T + t) * g.C + h * g.hs;
    for (int c = threadIdx.x; c < g.hs; c += blockDim.x) qs[c] = q[c], gs[c] = gy[c];
    __syncthreads();
    const float lt = lse[row];
    float part = 0.0f;
    for (int s = threadIdx.x; s <= t; s += blockDim.x) {
        p[s] = expf(g.scale * att_dot(qs, att_row(qkv, g, b, s, h, 1), g.hs) - lt);
        ds[s] = att_dot(gs, att_row(qkv, g, b, s, h, 2), g.hs); /* dp for now */
        part += p[s] * ds[s];
    }
    const float Dt = cu_block_sum(part, red);
    for (int s = threadIdx.x; s <= t; s += blockDim.x) ds[s] = p[s] * (ds[s] - Dt);
    __syncthreads();
    float *dq = dqkv + ((int64_t)b * g.T + t) * 3 * g.C + h * g.hs;
    for (int c = threadIdx.x; c < g.hs; c += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s <= t; s++) acc += ds[s] * att_row(qkv, g, b, s, h, 1)[c];
        dq[c] = g.scale * acc;
    }
    if (threadIdx.x == 0) D[row] = Dt;
}

/* dk and dv of key row s, summed over the queries t >= s that see it. */
__global__ void att_bwd_kv_kernel(float *dqkv, const float *D, const float *dy, const float *qkv,
                                  const float *lse, att_geom g) {
    extern __shared__ float sm[]; /* k_s [hs], v_s [hs], p [T], ds [T] (indexed by t) */
    int s, h, b;
    att_block(g, &s, &h, &b);
    const int64_t rows = ((int64_t)b * g.nh + h) * g.T;
    float *ks = sm, *vs = sm + g.hs, *p = vs + g.hs, *ds = p + g.T;
    const float *k = att_row(qkv, g, b, s, h, 1), *v = att_row(qkv, g, b, s, h, 2);
    for (int c = threadIdx.x; c < g.hs; c += blockDim.x) ks[c] = k[c], vs[c] = v[c];
    __syncthreads();
    for (int t = s + threadIdx.x; t < g.T; t += blockDim.x) {
        const float *gy = dy + ((int64_t)b * g.T + t) * g.C + h * g.hs;
        p[t] = expf(g.scale * att_dot(att_row(qkv, g, b, t, h, 0), ks, g.hs) - lse[rows + t]);
        ds[t] = p[t] * (att_dot(gy, vs, g.hs) - D[rows + t]);
    }
    __syncthreads();
    float *dk = dqkv + ((int64_t)b * g.T + s) * 3 * g.C + g.C + h * g.hs, *dv = dk + g.C;
    for (int c = threadIdx.x; c < g.hs; c += blockDim.x) {
        float ak = 0.0f, av = 0.0f;
        for (int t = s; t < g.T; t++) {
            ak += ds[t] * att_row(qkv, g, b, t, h, 0)[c];
            av += p[t] * dy[((int64_t)b * g.T + t) * g.C + h * g.hs + c];
        }
        dk[c] = g.scale * ak;
        dv[c] = av;
    }
}

/* Fills g, the grid and the shared bytes a block needs for `arrays` [T] arrays beside two
 * [hs] rows. The op (autograd/ops_attention.c) refused a qkv that is not [B, T, 3C] with C
 * divisible by n_head and allocated y and lse contiguous: asserted. A context too long for
 * this kernel's shared memory is an error only the kernel knows. */
static int att_setup(const char *op, const tdm_tensor *qkv, const tdm_tensor *y,
                     const tdm_tensor *lse, int n_head, int arrays, att_geom *g, unsigned *grid,
                     size_t *shared) {
    assert(qkv->ndim == 3 && qkv->shape[2] % 3 == 0 && n_head >= 1 &&
           (qkv->shape[2] / 3) % n_head == 0);
    int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3;
    assert(tdm_is_contiguous(qkv) && tdm_is_contiguous(y) && tdm_is_contiguous(lse) &&
           tdm_numel(y) == B * T * C && tdm_numel(lse) == B * n_head * T);
    *shared = sizeof(float) * (size_t)(2 * (C / n_head) + arrays * T);
    if (*shared > ATT_MAX_SHARED || B * n_head * T > INT32_MAX)
        return tdm_raise(TDM_ERR_SHAPE,
                         "%s: context %lld with head size %lld needs %zu bytes of shared memory "
                         "per block, more than the %d this kernel takes (B %lld, heads %d)",
                         op, (long long)T, (long long)(C / n_head), *shared, ATT_MAX_SHARED,
                         (long long)B, n_head);
    *g = att_geom{(int)T, (int)C, n_head, (int)(C / n_head), 1.0f / sqrtf((float)(C / n_head))};
    *grid = (unsigned)(B * n_head * T);
    return B * T == 0 ? 1 : TDM_OK; /* 1: nothing to do */
}

extern "C" int tdm_cuda_attention(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv,
                                  int n_head) {
    att_geom g;
    unsigned grid = 0; /* set by att_setup; initialised for -O3's flow analysis */
    size_t shared = 0;
    int rc = att_setup("cuda attention", qkv, y, lse, n_head, 1, &g, &grid, &shared);
    if (rc) return rc > 0 ? TDM_OK : rc;
    cu_device *d = cu_dev_of(qkv, "attention");
    if (!d) return tdm_last_status();
    att_fwd_kernel<<<grid, ATT_THREADS, shared, d->compute>>>(cu_f(y), cu_f(lse), cu_f(qkv), g);
    return cu_check_launch("attention", qkv->device.index);
}

extern "C" int tdm_cuda_attention_backward(tdm_tensor *dqkv, const tdm_tensor *dy,
                                           const tdm_tensor *qkv, const tdm_tensor *lse,
                                           int n_head) {
    att_geom g;
    unsigned grid = 0; /* set by att_setup; initialised for -O3's flow analysis */
    size_t shared = 0;
    int rc = att_setup("cuda attention_backward", qkv, dy, lse, n_head, 2, &g, &grid, &shared);
    if (rc) return rc > 0 ? TDM_OK : rc;
    assert(tdm_is_contiguous(dqkv) && tdm_numel(dqkv) == tdm_numel(qkv)); /* the op's alloc */
    int idx = qkv->device.index;
    cu_device *d = cu_dev_of(qkv, "attention_backward");
    if (!d) return tdm_last_status();
    tdm_storage *hold;
    float *D = (float *)cu_scratch(idx, sizeof(float) * (size_t)tdm_numel(lse), &hold);
    if (!D) return tdm_last_status();
    att_bwd_q_kernel<<<grid, ATT_THREADS, shared, d->compute>>>(cu_f(dqkv), D, cu_f(dy), cu_f(qkv),
                                                                cu_f(lse), g);
    rc = cu_check_launch("attention_backward (queries)", idx);
    if (!rc)
        att_bwd_kv_kernel<<<grid, ATT_THREADS, shared, d->compute>>>(cu_f(dqkv), D, cu_f(dy),
                                                                     cu_f(qkv), cu_f(lse), g);
    if (!rc) rc = cu_check_launch("attention_backward (keys)", idx);
    tdm_storage_release(hold); /* in stream order: the kernels above run first */
    return rc;
}
