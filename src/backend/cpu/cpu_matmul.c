/* Matrix products: one GEMM (cpu_gemm.c) per batch entry; bf16 operands through the bf16 GEMM
 * (cpu_gemm_bf16.c: fp32 accumulation, an f32 or bf16 C), other low-precision mixes through
 * the widening adapter (cpu_lowp.c). */
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_gemm_bf16.h"
#include "backend/cpu/cpu_lowp.h"

/* Leading dimension of a [rows, cols] matrix view with unit stride in its last dim. */
static int64_t lead(const tdm_tensor *t) {
    int64_t ld = t->strides[t->ndim - 2];
    return ld < t->shape[t->ndim - 1] ? t->shape[t->ndim - 1] : ld;
}

/* tdm_cpu_matmul with bf16 a and b, c f32 or bf16: the batch loop of the fp32 path, each
 * product one bf16 GEMM, no widened copies (the speed of mixed precision). */
static int matmul_bf16(tdm_tensor *c, const tdm_tensor *a, const tdm_tensor *b, bool ta, bool tb,
                       float beta) {
    int64_t batch = c->shape[0], n = c->shape[1], m = c->shape[2];
    int64_t k = ta ? a->shape[1] : a->shape[2];
    if (a->strides[2] != 1 || b->strides[2] != 1)
        return tdm_raise(TDM_ERR_ARG, "cpu matmul: operands need unit stride in their last dim");
    const uint16_t *pa = tdm_data_ptr(a), *pb = tdm_data_ptr(b);
    if (batch == 0 || n == 0 || m == 0) return TDM_OK;
    if (k == 0) /* as the fp32 path: the GEMM's checks refuse empty rows' leading dims */
        return beta == 0.0f ? tdm_cpu_fill(c, 0.0) : TDM_OK;
    bool c_bf16 = c->dtype == TDM_BF16;
    char *pc = tdm_data_ptr(c);
    size_t c_bytes = (size_t)(n * m) * tdm_dtype_size(c->dtype);
    for (int64_t i = 0; i < batch; i++) {
        int rc = tdm_cpu_gemm_bf16(ta, tb, n, m, k, 1.0f, pa + i * a->strides[0], lead(a),
                                   pb + i * b->strides[0], lead(b), beta, pc + (size_t)i * c_bytes,
                                   c_bf16, m);
        if (rc) return rc;
    }
    return TDM_OK;
}

int tdm_cpu_linear(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w, const tdm_tensor *b) {
    if (b) { /* y starts as b broadcast over the rows; the GEMM adds onto it */
        tdm_tensor bb = *b;
        bb.ndim = 3;
        bb.shape[0] = 1, bb.shape[1] = y->shape[1], bb.shape[2] = y->shape[2];
        bb.strides[0] = bb.strides[1] = 0, bb.strides[2] = 1;
        int rc = tdm_cpu_copy(y, &bb);
        if (rc) return rc;
    }
    return tdm_cpu_matmul(y, x, w, false, true, b ? 1.0f : 0.0f);
}

int tdm_cpu_linear_gelu(tdm_tensor *y, tdm_tensor *pre, const tdm_tensor *x, const tdm_tensor *w,
                        const tdm_tensor *b) {
    int rc = tdm_cpu_linear(pre, x, w, b);
    return rc ? rc : tdm_cpu_unary(TDM_UN_GELU_TANH, y, pre, 0.0f);
}

/* gb from sum_to of gy seen as [M, out] into [1, out] */
int tdm_cpu_linear_wgrad(tdm_tensor *gw, tdm_tensor *gb, const tdm_tensor *gy, const tdm_tensor *x,
                         float beta) {
    int rc = gw ? tdm_cpu_matmul(gw, gy, x, true, false, beta) : TDM_OK;
    if (rc || !gb) return rc;
    tdm_tensor gb2 = *gb, gy2 = *gy;
    int64_t rows = gy->shape[1], out = gy->shape[2];
    gb2.ndim = 2, gb2.shape[0] = 1, gb2.shape[1] = out, gb2.strides[0] = out, gb2.strides[1] = 1;
    gy2.ndim = 2, gy2.shape[0] = rows, gy2.shape[1] = out, gy2.strides[0] = out;
    gy2.strides[1] = 1;
    return tdm_cpu_sum_to(&gb2, &gy2);
}

/* unary_backward reads each element's gy before writing its gx: in place is safe */
int tdm_cpu_linear_dgelu(tdm_tensor *gpre, const tdm_tensor *gy, const tdm_tensor *w,
                         const tdm_tensor *pre) {
    int rc = tdm_cpu_matmul(gpre, gy, w, false, false, 0.0f);
    return rc ? rc : tdm_cpu_unary_backward(TDM_UN_GELU_TANH, gpre, gpre, pre, NULL, 0.0f);
}

int tdm_cpu_matmul(tdm_tensor *c, const tdm_tensor *a, const tdm_tensor *b, bool ta, bool tb,
                   float beta) {
    if (tdm_cpu_lowp_any(3, (const tdm_tensor *[]){c, a, b})) {
        if (a->dtype == TDM_BF16 && b->dtype == TDM_BF16 &&
            (c->dtype == TDM_F32 || c->dtype == TDM_BF16))
            return matmul_bf16(c, a, b, ta, tb, beta);
        return tdm_cpu_lowp_matmul(c, a, b, ta, tb, beta);
    }
    /* c [B, n, m]; a [B, n, k] or [B, k, n]; b [B, k, m] or [B, m, k] */
    int64_t batch = c->shape[0], n = c->shape[1], m = c->shape[2];
    int64_t k = ta ? a->shape[1] : a->shape[2];
    if (a->strides[2] != 1 || b->strides[2] != 1)
        return tdm_raise(TDM_ERR_ARG, "cpu matmul: operands need unit stride in their last dim");
    const float *pa = tdm_data_ptr(a), *pb = tdm_data_ptr(b);
    float *pc = tdm_data_ptr(c);
    if (k == 0) /* an empty sum: BLAS rejects k = 0 leading dims, and the result is beta*c */
        return beta == 0.0f ? tdm_cpu_fill(c, 0.0) : TDM_OK;
    for (int64_t i = 0; i < batch; i++) {
        tdm_cpu_sgemm(ta, tb, n, m, k, 1.0f, pa + i * a->strides[0], lead(a),
                      pb + i * b->strides[0], lead(b), beta, pc + i * n * m, m);
    }
    return TDM_OK;
}
