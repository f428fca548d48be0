/* Matrix products: one GEMM (cpu_gemm.c) per batch entry. */
#include "backend/cpu/cpu.h"

/* Leading dimension of a [rows, cols] matrix view with unit stride in its last dim. */
static int64_t lead(const tdm_tensor *t) {
    int64_t ld = t->strides[t->ndim - 2];
    return ld < t->shape[t->ndim - 1] ? t->shape[t->ndim - 1] : ld;
}

int tdm_cpu_matmul(tdm_tensor *c, const tdm_tensor *a, const tdm_tensor *b, bool ta, bool tb,
                   float beta) {
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
