/* CPU causal self-attention, one (batch row, head) at a time.
 *
 * qkv [B, T, 3C] holds q, k and v side by side (llm.c's layout); head h of each is the
 * channel block [h*hs, (h+1)*hs). For one (b, h) the three are [T, hs] matrices with row
 * stride 3C, so BLAS reads them in place:
 *   forward   S = scale * Q K^T      [T, T]   (sgemm; entries above the diagonal ignored)
 *             P = causal softmax(S), lse_t = log sum_{s<=t} exp(S_ts)
 *             Y = P V                [T, hs]  (written into y's head block, row stride C)
 *   backward  P = exp(scale * Q K^T - lse)   (recomputed: nothing T x T is kept)
 *             dV = P^T dY,  dP = dY V^T,  dS = P * (dP - rowsum(P * dP))
 *             dQ = scale * dS K,  dK = scale * dS^T Q
 * Only one head's [T, T] scores (and, in backward, their gradient) exist at a time, in a
 * block from the device's caching allocator: memory grows with T^2, not with B * heads, and
 * a training step in steady state allocates nothing. The full square is multiplied even
 * though half is masked: at the sizes where attention matters BLAS on the square beats
 * scalar loops on the triangle.
 */
#pragma GCC optimize("O3")

#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_gemm_bf16.h"
#include "backend/cpu/cpu_lowp.h"
#include "backend/cpu/cpu_isa.h"
#include "backend/cpu/cpu_math.h"

#include <assert.h>
#include <math.h>

#include "tandem/half.h"

typedef struct {
    int64_t B, T, C, nh, hs;
} att_dims;

/* The dimensions of qkv. The op (autograd/ops_attention.c) refused a qkv that is not
 * [B, T, 3C] with C divisible by n_head and allocated y and lse contiguous: asserted here. */
static att_dims att_dims_of(const tdm_tensor *qkv, const tdm_tensor *y, const tdm_tensor *lse,
                            int n_head) {
    assert(qkv->ndim == 3 && qkv->shape[2] % 3 == 0 && n_head >= 1 &&
           (qkv->shape[2] / 3) % n_head == 0);
    att_dims d = {qkv->shape[0], qkv->shape[1], qkv->shape[2] / 3, n_head, 0};
    d.hs = d.C / n_head;
    assert(tdm_is_contiguous(qkv) && tdm_is_contiguous(y) && tdm_is_contiguous(lse) &&
           tdm_numel(y) == d.B * d.T * d.C && tdm_numel(lse) == d.B * d.nh * d.T);
    return d;
}

/* A scratch block of n floats from the device's cache (released with tdm_storage_release). */
static tdm_storage *scratch(int64_t n, tdm_device dev, float **p) {
    tdm_storage *s = tdm_storage_new((size_t)n * sizeof(float), dev);
    *p = s ? (float *)s->data : NULL;
    return s;
}

/* Row t of the scores: causal softmax in place (entries after t set to 0); returns lse. */
TDM_CPU_CLONES
static float softmax_row(float *s, int64_t t, int64_t T) {
    float mx = s[0];
    for (int64_t j = 1; j <= t; j++) mx = s[j] > mx ? s[j] : mx;
    float sum = 0.0f;
    for (int64_t j = 0; j <= t; j++) {
        s[j] = tdm_expf(s[j] - mx);
        sum += s[j];
    }
    float inv = 1.0f / sum;
    for (int64_t j = 0; j <= t; j++) s[j] *= inv;
    for (int64_t j = t + 1; j < T; j++) s[j] = 0.0f;
    return mx + logf(sum);
}

/* Autocast's bf16 attention (qkv, y bf16; lse f32): the products through the bf16 GEMM with
 * fp32 accumulation, the softmax in fp32 as above, and the probabilities rounded to bf16 for
 * P V, as PyTorch's CPU flash attention rounds its attention weights. */
static int attention_bf16(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv, int n_head) {
    att_dims d = att_dims_of(qkv, y, lse, n_head);
    const int64_t T = d.T, C = d.C, hs = d.hs;
    if (T == 0 || d.B == 0) return TDM_OK;
    float *S; /* S [T, T] in f32, then Pb [T, T], its rounding to bf16 */
    tdm_storage *blk = scratch(T * T + (T * T + 1) / 2, y->device, &S);
    if (!blk) return tdm_last_status();
    uint16_t *Pb = (uint16_t *)(S + T * T);
    const float scale = 1.0f / sqrtf((float)hs);
    const uint16_t *base = tdm_data_ptr(qkv);
    uint16_t *yp = tdm_data_ptr(y);
    float *lp = tdm_data_ptr(lse);
    int rc = TDM_OK;
    for (int64_t b = 0; b < d.B && !rc; b++)
        for (int64_t h = 0; h < d.nh && !rc; h++) {
            const uint16_t *q = base + b * T * 3 * C + h * hs, *k = q + C, *v = q + 2 * C;
            float *l = lp + (b * d.nh + h) * T;
            rc = tdm_cpu_gemm_bf16(false, true, T, T, hs, scale, q, 3 * C, k, 3 * C, 0.0f, S, false,
                                   T);
            if (rc) break;
            for (int64_t t = 0; t < T; t++) l[t] = softmax_row(S + t * T, t, T);
            tdm_bf16_from_f32(Pb, S, (size_t)(T * T));
            rc = tdm_cpu_gemm_bf16(false, false, T, hs, T, 1.0f, Pb, T, v, 3 * C, 0.0f,
                                   yp + b * T * C + h * hs, true, C);
        }
    tdm_storage_release(blk);
    return rc;
}

int tdm_cpu_attention(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv, int n_head) {
    if (y->dtype == TDM_BF16 && qkv->dtype == TDM_BF16 && lse->dtype == TDM_F32)
        return attention_bf16(y, lse, qkv, n_head);
    if (tdm_cpu_lowp_any(3, (const tdm_tensor *[]){y, lse, qkv}))
        return tdm_cpu_lowp_attention(y, lse, qkv, n_head);
    att_dims d = att_dims_of(qkv, y, lse, n_head);
    const int64_t T = d.T, C = d.C, hs = d.hs;
    if (T == 0 || d.B == 0) return TDM_OK;
    float *S;
    tdm_storage *blk = scratch(T * T, y->device, &S);
    if (!blk) return tdm_last_status();
    const float scale = 1.0f / sqrtf((float)hs);
    const float *base = tdm_data_ptr(qkv);
    float *yp = tdm_data_ptr(y), *lp = tdm_data_ptr(lse);
    for (int64_t b = 0; b < d.B; b++)
        for (int64_t h = 0; h < d.nh; h++) {
            const float *q = base + b * T * 3 * C + h * hs, *k = q + C, *v = q + 2 * C;
            float *l = lp + (b * d.nh + h) * T;
            /* S [T, T] = scale * Q [T, hs] @ K^T [hs, T] */
            tdm_cpu_sgemm(false, true, T, T, hs, scale, q, 3 * C, k, 3 * C, 0.0f, S, T);
            for (int64_t t = 0; t < T; t++) l[t] = softmax_row(S + t * T, t, T);
            /* Y [T, hs] = P [T, T] @ V [T, hs] */
            tdm_cpu_sgemm(false, false, T, hs, T, 1.0f, S, T, v, 3 * C, 0.0f,
                          yp + b * T * C + h * hs, C);
        }
    tdm_storage_release(blk);
    return TDM_OK;
}

/* P and dS of one (b, h) in place: P from the scores and lse; dP (in G) becomes dS / scale.
 * Rows are causal: entries after t are 0 in both. */
TDM_CPU_CLONES
static void probs_and_dscores(float *P, float *G, const float *l, int64_t T) {
    for (int64_t t = 0; t < T; t++) {
        float *p = P + t * T, *g = G + t * T;
        const float lt = l[t];
        float dot = 0.0f;
        for (int64_t j = 0; j <= t; j++) {
            p[j] = tdm_expf(p[j] - lt);
            dot += p[j] * g[j];
        }
        for (int64_t j = 0; j <= t; j++) g[j] = p[j] * (g[j] - dot);
        for (int64_t j = t + 1; j < T; j++) p[j] = g[j] = 0.0f;
    }
}

/* The backward of attention_bf16: its products in bf16 with fp32 accumulation, P and dS
 * computed in fp32 and rounded to bf16 for the products that take them. */
static int attention_backward_bf16(tdm_tensor *dqkv, const tdm_tensor *dy, const tdm_tensor *qkv,
                                   const tdm_tensor *lse, int n_head) {
    att_dims d = att_dims_of(qkv, dy, lse, n_head);
    assert(tdm_is_contiguous(dqkv) && tdm_numel(dqkv) == tdm_numel(qkv)); /* the op's alloc */
    const int64_t T = d.T, C = d.C, hs = d.hs, C3 = 3 * C;
    if (T == 0 || d.B == 0) return TDM_OK;
    float *P; /* P, G [T, T] in f32, then Pb, Gb [T, T] in bf16 */
    tdm_storage *blk = scratch(3 * T * T, dqkv->device, &P);
    if (!blk) return tdm_last_status();
    float *G = P + T * T;
    uint16_t *Pb = (uint16_t *)(G + T * T), *Gb = Pb + T * T;
    const float scale = 1.0f / sqrtf((float)hs);
    const uint16_t *base = tdm_data_ptr(qkv), *dyp = tdm_data_ptr(dy);
    const float *lp = tdm_data_ptr(lse);
    uint16_t *gbase = tdm_data_ptr(dqkv);
    int rc = TDM_OK;
    for (int64_t b = 0; b < d.B && !rc; b++)
        for (int64_t h = 0; h < d.nh && !rc; h++) {
            const uint16_t *q = base + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
            const uint16_t *g_y = dyp + b * T * C + h * hs;
            uint16_t *gq = gbase + b * T * C3 + h * hs, *gk = gq + C, *gv = gq + 2 * C;
            if ((rc = tdm_cpu_gemm_bf16(false, true, T, T, hs, scale, q, C3, k, C3, 0.0f, P, false,
                                        T)) ||
                (rc = tdm_cpu_gemm_bf16(false, true, T, T, hs, 1.0f, g_y, C, v, C3, 0.0f, G, false,
                                        T)))
                break;
            probs_and_dscores(P, G, lp + (b * d.nh + h) * T, T);
            tdm_bf16_from_f32(Pb, P, (size_t)(T * T));
            tdm_bf16_from_f32(Gb, G, (size_t)(T * T));
            if ((rc = tdm_cpu_gemm_bf16(true, false, T, hs, T, 1.0f, Pb, T, g_y, C, 0.0f, gv, true,
                                        C3)) ||
                (rc = tdm_cpu_gemm_bf16(false, false, T, hs, T, scale, Gb, T, k, C3, 0.0f, gq, true,
                                        C3)))
                break;
            rc = tdm_cpu_gemm_bf16(true, false, T, hs, T, scale, Gb, T, q, C3, 0.0f, gk, true, C3);
        }
    tdm_storage_release(blk);
    return rc;
}

int tdm_cpu_attention_backward(tdm_tensor *dqkv, const tdm_tensor *dy, const tdm_tensor *qkv,
                               const tdm_tensor *lse, int n_head) {
    if (dqkv->dtype == TDM_BF16 && dy->dtype == TDM_BF16 && qkv->dtype == TDM_BF16 &&
        lse->dtype == TDM_F32)
        return attention_backward_bf16(dqkv, dy, qkv, lse, n_head);
    if (tdm_cpu_lowp_any(4, (const tdm_tensor *[]){dqkv, dy, qkv, lse}))
        return tdm_cpu_lowp_attention_backward(dqkv, dy, qkv, lse, n_head);
    att_dims d = att_dims_of(qkv, dy, lse, n_head);
    assert(tdm_is_contiguous(dqkv) && tdm_numel(dqkv) == tdm_numel(qkv)); /* the op's alloc */
    const int64_t T = d.T, C = d.C, hs = d.hs, C3 = 3 * C;
    if (T == 0 || d.B == 0) return TDM_OK;
    float *P;
    tdm_storage *blk = scratch(2 * T * T, dqkv->device, &P);
    if (!blk) return tdm_last_status();
    float *G = P + T * T;
    const float scale = 1.0f / sqrtf((float)hs);
    const float *base = tdm_data_ptr(qkv), *dyp = tdm_data_ptr(dy), *lp = tdm_data_ptr(lse);
    float *gbase = tdm_data_ptr(dqkv);
    for (int64_t b = 0; b < d.B; b++)
        for (int64_t h = 0; h < d.nh; h++) {
            const float *q = base + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
            const float *g_y = dyp + b * T * C + h * hs;
            float *gq = gbase + b * T * C3 + h * hs, *gk = gq + C, *gv = gq + 2 * C;
            /* the forward's scaled scores again, and dP [T, T] = dY [T, hs] @ V^T */
            tdm_cpu_sgemm(false, true, T, T, hs, scale, q, C3, k, C3, 0.0f, P, T);
            tdm_cpu_sgemm(false, true, T, T, hs, 1.0f, g_y, C, v, C3, 0.0f, G, T);
            probs_and_dscores(P, G, lp + (b * d.nh + h) * T, T);
            /* dV [T, hs] = P^T [T, T] @ dY [T, hs] */
            tdm_cpu_sgemm(true, false, T, hs, T, 1.0f, P, T, g_y, C, 0.0f, gv, C3);
            /* dQ = scale * dS @ K;  dK = scale * dS^T @ Q */
            tdm_cpu_sgemm(false, false, T, hs, T, scale, G, T, k, C3, 0.0f, gq, C3);
            tdm_cpu_sgemm(true, false, T, hs, T, scale, G, T, q, C3, 0.0f, gk, C3);
        }
    tdm_storage_release(blk);
    return TDM_OK;
}
