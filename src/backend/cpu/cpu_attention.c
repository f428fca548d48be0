/* CPU causal self-attention, one (batch row, head) at a time.
 *
 * qkv [B, T, 3C] holds q, k and v side by side (llm.c's layout); head h of each is the
 * channel block [h*hs, (h+1)*hs). For one (b, h) the three are [T, hs] matrices with row
 * stride 3C, so the GEMMs read them in place:
 *   forward   S = scale * Q K^T      [T, T]
 *             P = causal softmax(S), lse_t = log sum_{s<=t} exp(S_ts)
 *             Y = P V                [T, hs]  (written into y's head block, row stride C)
 *   backward  P = exp(scale * Q K^T - lse)   (recomputed: nothing T x T is kept)
 *             dV = P^T dY,  dP = dY V^T,  dS = P * (dP - rowsum(P * dP))
 *             dQ = scale * dS K,  dK = scale * dS^T Q
 * Causal blocks: the rows are cut into att_blocks(T) row blocks, and row block i multiplies
 * only the keys before its end (S's blocks on and below the diagonal: 5/8 of the square with
 * 4 blocks); dK and dV are then taken per key block from the rows at and after it, so every
 * output is one GEMM's result, rounded once. Inside a diagonal block the entries above the
 * diagonal are set to 0. Only one head's [T, T] scores (and, in backward, their gradient)
 * exist at a time, in a block from the device's caching allocator: memory grows with T^2, not
 * with B * heads, and a training step in steady state allocates nothing.
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

/* Row blocks of the causal products: 4 from T = 128 on (the bf16 GEMM's primitives are
 * cached per shape, and each block brings its own shapes: a few blocks take most of the
 * saving, 5/8 of the square against 1/2 at the limit), one below. */
static int att_blocks(int64_t T) {
    return T >= 128 ? 4 : 1;
}

/* Rows [*r0, *r1) of block i of n. */
static void att_block(int64_t T, int n, int i, int64_t *r0, int64_t *r1) {
    *r0 = T * i / n, *r1 = T * (i + 1) / n;
}

/* Row t of the scores, n entries computed: causal softmax in place (entries after t, up to
 * n, set to 0); returns lse. */
TDM_CPU_CLONES
static float softmax_row(float *s, int64_t t, int64_t n) {
    float mx = s[0];
    for (int64_t j = 1; j <= t; j++) mx = s[j] > mx ? s[j] : mx;
    float sum = 0.0f;
    for (int64_t j = 0; j <= t; j++) {
        s[j] = tdm_expf(s[j] - mx);
        sum += s[j];
    }
    float inv = 1.0f / sum;
    for (int64_t j = 0; j <= t; j++) s[j] *= inv;
    for (int64_t j = t + 1; j < n; j++) s[j] = 0.0f;
    return mx + logf(sum);
}

/* Autocast's bf16 attention (qkv, y bf16; lse f32): the products through the bf16 GEMM with
 * fp32 accumulation, the softmax in fp32 as above, and the probabilities rounded to bf16 for
 * P V, as PyTorch's CPU flash attention rounds its attention weights. */
static int attention_bf16(tdm_tensor *y, tdm_tensor *lse, const tdm_tensor *qkv, int n_head) {
    att_dims d = att_dims_of(qkv, y, lse, n_head);
    const int64_t T = d.T, C = d.C, hs = d.hs, C3 = 3 * C;
    if (T == 0 || d.B == 0) return TDM_OK;
    float *S; /* S [T, T] in f32, then Pb [T, T], its rounding to bf16 */
    tdm_storage *blk = scratch(T * T + (T * T + 1) / 2, y->device, &S);
    if (!blk) return tdm_last_status();
    uint16_t *Pb = (uint16_t *)(S + T * T);
    const float scale = 1.0f / sqrtf((float)hs);
    const uint16_t *base = tdm_data_ptr(qkv);
    uint16_t *yp = tdm_data_ptr(y);
    float *lp = tdm_data_ptr(lse);
    const int nb = att_blocks(T);
    int rc = TDM_OK;
    for (int64_t b = 0; b < d.B && !rc; b++)
        for (int64_t h = 0; h < d.nh && !rc; h++) {
            const uint16_t *q = base + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
            float *l = lp + (b * d.nh + h) * T;
            for (int i = 0; i < nb && !rc; i++) {
                int64_t r0, r1; /* rows [r0, r1) attend to keys [0, r1) */
                att_block(T, nb, i, &r0, &r1);
                rc = tdm_cpu_gemm_bf16(false, true, r1 - r0, r1, hs, scale, q + r0 * C3, C3, k, C3,
                                       0.0f, S + r0 * T, false, T);
                if (rc) break;
                for (int64_t t = r0; t < r1; t++) {
                    l[t] = softmax_row(S + t * T, t, r1);
                    tdm_bf16_from_f32(Pb + t * T, S + t * T, (size_t)r1);
                }
                rc = tdm_cpu_gemm_bf16(false, false, r1 - r0, hs, r1, 1.0f, Pb + r0 * T, T, v, C3,
                                       0.0f, yp + (b * T + r0) * C + h * hs, true, C);
            }
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
    const int64_t T = d.T, C = d.C, hs = d.hs, C3 = 3 * C;
    if (T == 0 || d.B == 0) return TDM_OK;
    float *S;
    tdm_storage *blk = scratch(T * T, y->device, &S);
    if (!blk) return tdm_last_status();
    const float scale = 1.0f / sqrtf((float)hs);
    const float *base = tdm_data_ptr(qkv);
    float *yp = tdm_data_ptr(y), *lp = tdm_data_ptr(lse);
    const int nb = att_blocks(T);
    for (int64_t b = 0; b < d.B; b++)
        for (int64_t h = 0; h < d.nh; h++) {
            const float *q = base + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
            float *l = lp + (b * d.nh + h) * T;
            for (int i = 0; i < nb; i++) {
                int64_t r0, r1;
                att_block(T, nb, i, &r0, &r1);
                /* S [r0:r1, :r1] = scale * Q [r0:r1, hs] @ K^T [hs, :r1] */
                tdm_cpu_sgemm(false, true, r1 - r0, r1, hs, scale, q + r0 * C3, C3, k, C3, 0.0f,
                              S + r0 * T, T);
                for (int64_t t = r0; t < r1; t++) l[t] = softmax_row(S + t * T, t, r1);
                /* Y [r0:r1, hs] = P [r0:r1, :r1] @ V [:r1, hs] */
                tdm_cpu_sgemm(false, false, r1 - r0, hs, r1, 1.0f, S + r0 * T, T, v, C3, 0.0f,
                              yp + (b * T + r0) * C + h * hs, C);
            }
        }
    tdm_storage_release(blk);
    return TDM_OK;
}

/* Rows [t0, t1) of P and dS of one (b, h) in place, n entries each, row stride T: P from the
 * scores and lse; dP (in G) becomes dS / scale. Rows are causal: entries after t are 0 in
 * both. */
TDM_CPU_CLONES
static void probs_and_dscores(float *P, float *G, const float *l, int64_t t0, int64_t t1, int64_t n,
                              int64_t T) {
    for (int64_t t = t0; t < t1; t++) {
        float *p = P + t * T, *g = G + t * T;
        const float lt = l[t];
        float dot = 0.0f;
        for (int64_t j = 0; j <= t; j++) {
            p[j] = tdm_expf(p[j] - lt);
            dot += p[j] * g[j];
        }
        for (int64_t j = 0; j <= t; j++) g[j] = p[j] * (g[j] - dot);
        for (int64_t j = t + 1; j < n; j++) p[j] = g[j] = 0.0f;
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
    const int nb = att_blocks(T);
    int rc = TDM_OK;
    for (int64_t b = 0; b < d.B && !rc; b++)
        for (int64_t h = 0; h < d.nh && !rc; h++) {
            const uint16_t *q = base + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
            const uint16_t *g_y = dyp + b * T * C + h * hs;
            uint16_t *gq = gbase + b * T * C3 + h * hs, *gk = gq + C, *gv = gq + 2 * C;
            for (int i = 0; i < nb && !rc; i++) { /* P, dS and dQ by row block */
                int64_t r0, r1, m;
                att_block(T, nb, i, &r0, &r1);
                m = r1 - r0;
                if ((rc = tdm_cpu_gemm_bf16(false, true, m, r1, hs, scale, q + r0 * C3, C3, k, C3,
                                            0.0f, P + r0 * T, false, T)) ||
                    (rc = tdm_cpu_gemm_bf16(false, true, m, r1, hs, 1.0f, g_y + r0 * C, C, v, C3,
                                            0.0f, G + r0 * T, false, T)))
                    break;
                probs_and_dscores(P, G, lp + (b * d.nh + h) * T, r0, r1, r1, T);
                for (int64_t t = r0; t < r1; t++) {
                    tdm_bf16_from_f32(Pb + t * T, P + t * T, (size_t)r1);
                    tdm_bf16_from_f32(Gb + t * T, G + t * T, (size_t)r1);
                }
                rc = tdm_cpu_gemm_bf16(false, false, m, hs, r1, scale, Gb + r0 * T, T, k, C3, 0.0f,
                                       gq + r0 * C3, true, C3);
            }
            for (int j = 0; j < nb && !rc; j++) { /* dV and dK by key block, from rows c0.. */
                int64_t c0, c1;
                att_block(T, nb, j, &c0, &c1);
                const int64_t off = c0 * T + c0;
                if ((rc = tdm_cpu_gemm_bf16(true, false, c1 - c0, hs, T - c0, 1.0f, Pb + off, T,
                                            g_y + c0 * C, C, 0.0f, gv + c0 * C3, true, C3)))
                    break;
                rc = tdm_cpu_gemm_bf16(true, false, c1 - c0, hs, T - c0, scale, Gb + off, T,
                                       q + c0 * C3, C3, 0.0f, gk + c0 * C3, true, C3);
            }
        }
    tdm_storage_release(blk);
    return rc;
}

int tdm_cpu_attention_backward(tdm_tensor *dqkv, const tdm_tensor *dy, const tdm_tensor *qkv,
                               const tdm_tensor *y, const tdm_tensor *lse, int n_head) {
    (void)y; /* D comes from the probabilities computed here (probs_and_dscores) */
    if (dqkv->dtype == TDM_BF16 && dy->dtype == TDM_BF16 && qkv->dtype == TDM_BF16 &&
        lse->dtype == TDM_F32)
        return attention_backward_bf16(dqkv, dy, qkv, lse, n_head);
    if (tdm_cpu_lowp_any(4, (const tdm_tensor *[]){dqkv, dy, qkv, lse}))
        return tdm_cpu_lowp_attention_backward(dqkv, dy, qkv, y, lse, n_head);
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
    const int nb = att_blocks(T);
    for (int64_t b = 0; b < d.B; b++)
        for (int64_t h = 0; h < d.nh; h++) {
            const float *q = base + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
            const float *g_y = dyp + b * T * C + h * hs;
            float *gq = gbase + b * T * C3 + h * hs, *gk = gq + C, *gv = gq + 2 * C;
            for (int i = 0; i < nb; i++) {
                int64_t r0, r1;
                att_block(T, nb, i, &r0, &r1);
                /* the forward's scaled scores again, and dP = dY V^T, rows [r0, r1) */
                tdm_cpu_sgemm(false, true, r1 - r0, r1, hs, scale, q + r0 * C3, C3, k, C3, 0.0f,
                              P + r0 * T, T);
                tdm_cpu_sgemm(false, true, r1 - r0, r1, hs, 1.0f, g_y + r0 * C, C, v, C3, 0.0f,
                              G + r0 * T, T);
                probs_and_dscores(P, G, lp + (b * d.nh + h) * T, r0, r1, r1, T);
                /* dQ [r0:r1] = scale * dS [r0:r1, :r1] @ K [:r1] */
                tdm_cpu_sgemm(false, false, r1 - r0, hs, r1, scale, G + r0 * T, T, k, C3, 0.0f,
                              gq + r0 * C3, C3);
            }
            for (int j = 0; j < nb; j++) {
                int64_t c0, c1;
                att_block(T, nb, j, &c0, &c1);
                /* dV [c0:c1] = P [c0:, c0:c1]^T @ dY [c0:];  dK = scale * dS^T @ Q, alike */
                tdm_cpu_sgemm(true, false, c1 - c0, hs, T - c0, 1.0f, P + c0 * T + c0, T,
                              g_y + c0 * C, C, 0.0f, gv + c0 * C3, C3);
                tdm_cpu_sgemm(true, false, c1 - c0, hs, T - c0, scale, G + c0 * T + c0, T,
                              q + c0 * C3, C3, 0.0f, gk + c0 * C3, C3);
            }
        }
    tdm_storage_release(blk);
    return TDM_OK;
}
