/* CUDA matrix products: batched row-major GEMMs on cuBLAS: SGEMM in f32 (in TF32 on the
 * tensor cores, CUBLAS_COMPUTE_32F_FAST_TF32, where tdm_allow_tf32 says so); bf16 or f16
 * operands through cublasGemmStridedBatchedEx with fp32 accumulation (CUBLAS_COMPUTE_32F), the
 * product rounded once into c's dtype (a's, or f32).
 *
 * Row-major to column-major: cuBLAS sees a row-major [r, c] matrix with row stride ld as a
 * column-major [c, r] one with the same ld, so row-major C = A B is computed as the
 * column-major C^T = B^T A^T: operands swap places and the transposes stay as they are.
 * nn's linear runs on cuBLASLt, whose epilogues add the bias as y is written, apply the GPT
 * MLP's GELU and its gradient, and sum the bias's gradient. */
#include "backend/cuda/cuda_common.cuh"
#include "tandem/runtime.h" /* tdm_allow_tf32 */

#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ---- matmul ------------------------------------------------------------------------------ */

/* Leading dimension of a [rows, cols] view with unit stride in its last dim. */
static int64_t lead(const tdm_tensor *t) {
    int64_t ld = t->strides[t->ndim - 2];
    return ld < t->shape[t->ndim - 1] ? t->shape[t->ndim - 1] : ld;
}

extern "C" int tdm_cuda_matmul(tdm_tensor *c, const tdm_tensor *a, const tdm_tensor *b, bool ta,
                               bool tb, float beta) {
    /* c [B, n, m]; a [B, n, k] or [B, k, n]; b [B, k, m] or [B, m, k] */
    if (c->ndim != 3 || a->ndim != 3 || b->ndim != 3 || !tdm_is_contiguous(c))
        return tdm_raise(TDM_ERR_SHAPE, "cuda matmul: expects 3-D operands, c contiguous");
    if (a->strides[2] != 1 || b->strides[2] != 1)
        return tdm_raise(TDM_ERR_ARG, "cuda matmul: operands need unit stride in their last dim");
    /* a and b of one dtype; c of theirs or f32 (a bf16 product kept in f32) */
    if (cu_check_float("matmul", true, {a, b}) || cu_check_float("matmul", false, {c}))
        return tdm_last_status();
    if (c->dtype != a->dtype && c->dtype != TDM_F32)
        return tdm_raise(TDM_ERR_DTYPE, "cuda matmul: a %s product into %s (c must be %s or f32)",
                         tdm_dtype_name(a->dtype), tdm_dtype_name(c->dtype),
                         tdm_dtype_name(a->dtype));
    int64_t batch = c->shape[0], n = c->shape[1], m = c->shape[2];
    int64_t k = ta ? a->shape[1] : a->shape[2];
    cu_device *d = cu_dev_of(c, "matmul");
    if (!d) return tdm_last_status();
    if (batch == 0 || n == 0 || m == 0) return TDM_OK;
    if (k == 0) return beta == 0.0f ? tdm_cuda_fill(c, 0.0) : TDM_OK; /* an empty sum */
    int64_t lda = lead(a), ldb = lead(b);
    if (n > INT_MAX || m > INT_MAX || k > INT_MAX || batch > INT_MAX || lda > INT_MAX ||
        ldb > INT_MAX)
        return tdm_raise(TDM_ERR_SHAPE, "cuda matmul: a dimension exceeds cuBLAS's int range");
    const float one = 1.0f;
    const bool tf32 = a->dtype == TDM_F32 && tdm_allow_tf32();
    if (a->dtype != TDM_F32 || tf32) {
        cudaDataType t = a->dtype == TDM_BF16  ? CUDA_R_16BF
                         : a->dtype == TDM_F16 ? CUDA_R_16F
                                               : CUDA_R_32F;
        cudaDataType ct = c->dtype == TDM_F32 ? CUDA_R_32F : t;
        cublasStatus_t st = cu_blas.cublasGemmStridedBatchedEx(
            d->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)m, (int)n,
            (int)k, &one, tdm_cuda_ptr(b), t, (int)ldb, b->strides[0], tdm_cuda_ptr(a), t, (int)lda,
            a->strides[0], &beta, tdm_cuda_ptr(c), ct, (int)m, n * m, (int)batch,
            tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        return cu_check_blas(st, "matmul (cublasGemmStridedBatchedEx)", c->device.index);
    }
    cublasStatus_t st = cu_blas.cublasSgemmStridedBatched(
        d->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)m, (int)n,
        (int)k, &one, cu_f(b), (int)ldb, b->strides[0], cu_f(a), (int)lda, a->strides[0], &beta,
        cu_f(c), (int)m, n * m, (int)batch);
    return cu_check_blas(st, "matmul (cublasSgemmStridedBatched)", c->device.index);
}

/* ---- linear: the bias in cuBLASLt's epilogue ---------------------------------------------- */

static cudaDataType blas_type(tdm_dtype dt) {
    return dt == TDM_BF16 ? CUDA_R_16BF : dt == TDM_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* The largest power of two up to 256 dividing p's address: the alignment cuBLASLt may assume. */
static uint32_t align_of(const void *p) {
    uint32_t a = 256;
    while (a > 1 && (uintptr_t)p % a) a /= 2;
    return a;
}

/* One cuBLASLt product, column-major: D [m, n] (ldd) = op(A) op(B) + beta D, where op(A) is A
 * [m, k] (lda) or, with ta, the transpose of A [k, m], and op(B) likewise B [k, n] (ldb) or the
 * transpose of B [n, k]; every matrix of the one type t, the sums f32 (TF32 where asked); then
 * the epilogue: BIAS adds bias [m] along D's rows, GELU_AUX_BIAS also stores that sum in aux
 * [m, n] (aux_ld) and writes its tanh-GELU, DGELU multiplies the product by GELU' of aux, the
 * GELU's input, BGRADB writes op(B)'s column sums over k into bias [n]. */
typedef struct {
    bool ta, tb;
    float beta;
    uint64_t m, n, k;
    const void *a, *b;
    void *d;
    int64_t lda, ldb, ldd;
    cublasLtEpilogue_t epi;
    const void *bias;
    void *aux;
    int64_t aux_ld; /* cuBLASLt's rule: a multiple of 8 (the caller's check) */
} lt_gemm;

/* TANDEM_CUBLASLT_EPILOGUES=0 in the environment turns the epilogues off: every caller of
 * lt_run takes its fallback (the plain products and separate kernels), for measuring one path
 * against the other (scripts/gpu-check). */
static bool lt_epilogues = true;
static pthread_once_t lt_env_once = PTHREAD_ONCE_INIT;

static void lt_read_env(void) {
    const char *e = getenv("TANDEM_CUBLASLT_EPILOGUES");
    if (e && !strcmp(e, "0")) lt_epilogues = false;
}

/* ---- cuBLASLt's choice of algorithm, remembered ----------------------------------------------
 * cublasLtMatmulAlgoGetHeuristic is a search on the host, and a training step would ask it the
 * same few questions every step (a GPT: about six products a layer, forward and backward), on
 * the thread that must stay ahead of the GPU: the answer (an algorithm, or none) is kept per
 * problem. A problem is everything the heuristic sees: the device, types, shapes, leading
 * dimensions, epilogue, the operands' alignments. */
typedef struct {
    int device;
    cudaDataType t;
    bool tf32, ta, tb, bias, aux;
    cublasLtEpilogue_t epi;
    uint64_t m, n, k;
    int64_t lda, ldb, ldd, aux_ld;
    uint32_t align[4];
} lt_problem;

#define LT_MEMO 256 /* problems remembered (a GPT step on 8 GPUs: about 20 each) */
static struct {
    bool used, found;
    lt_problem p;
    cublasLtMatmulAlgo_t algo;
} lt_memo[LT_MEMO];
static unsigned lt_memo_next; /* the slot the next new problem takes once all are used */
static pthread_mutex_t lt_memo_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long lt_heuristic_calls; /* tdm_cuda_blaslt_heuristic_calls */

/* The problem g poses on device index, every byte set (compared with memcmp). */
static lt_problem lt_problem_of(int index, cudaDataType t, bool tf32, const lt_gemm *g,
                                const uint32_t align[4]) {
    lt_problem p;
    memset(&p, 0, sizeof p);
    p.device = index, p.t = t, p.tf32 = tf32, p.ta = g->ta, p.tb = g->tb;
    p.bias = g->bias != NULL, p.aux = g->aux != NULL, p.epi = g->epi;
    p.m = g->m, p.n = g->n, p.k = g->k;
    p.lda = g->lda, p.ldb = g->ldb, p.ldd = g->ldd, p.aux_ld = g->aux ? g->aux_ld : 0;
    memcpy(p.align, align, sizeof p.align);
    return p;
}

/* Whether p was answered before: *found and, where one was, *algo set. */
static bool lt_memo_get(const lt_problem *p, bool *found, cublasLtMatmulAlgo_t *algo) {
    pthread_mutex_lock(&lt_memo_lock);
    bool hit = false;
    for (int i = 0; i < LT_MEMO && lt_memo[i].used && !hit; i++)
        if (!memcmp(&lt_memo[i].p, p, sizeof *p)) {
            hit = true, *found = lt_memo[i].found;
            if (*found) *algo = lt_memo[i].algo;
        }
    pthread_mutex_unlock(&lt_memo_lock);
    return hit;
}
static void lt_memo_put(const lt_problem *p, bool found, const cublasLtMatmulAlgo_t *algo) {
    pthread_mutex_lock(&lt_memo_lock);
    const unsigned i = lt_memo_next++ % LT_MEMO; /* past LT_MEMO problems, the oldest goes */
    lt_memo[i].used = true, lt_memo[i].found = found, lt_memo[i].p = *p;
    if (found) lt_memo[i].algo = *algo;
    lt_heuristic_calls++;
    pthread_mutex_unlock(&lt_memo_lock);
}

extern "C" unsigned long long tdm_cuda_blaslt_heuristic_calls(void) {
    pthread_mutex_lock(&lt_memo_lock);
    const unsigned long long n = lt_heuristic_calls;
    pthread_mutex_unlock(&lt_memo_lock);
    return n;
}

/* cuBLASLt's first algorithm for the product op on la, lb, ld (alignments al) within the
 * workspace: *found false where it has none. */
static cublasStatus_t lt_heuristic(cu_device *d, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
                                   cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld,
                                   const uint32_t al[4], bool *found, cublasLtMatmulAlgo_t *algo) {
    const uint64_t ws = CU_BLAS_WORKSPACE;
    const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t heur;
    int n = 0;
    cublasStatus_t st = cu_blas.cublasLtMatmulPreferenceCreate(&pref);
    if (!st)
        st = cu_blas.cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    for (int i = 0; i < 4 && !st; i++)
        st =
            cu_blas.cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &al[i], sizeof al[i]);
    if (!st)
        st = cu_blas.cublasLtMatmulAlgoGetHeuristic(d->lt, op, la, lb, ld, ld, pref, 1, &heur, &n);
    if (pref) cu_blas.cublasLtMatmulPreferenceDestroy(pref);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) st = CUBLAS_STATUS_SUCCESS, n = 0; /* none: an answer */
    *found = !st && n > 0;
    if (*found) *algo = heur.algo;
    return st;
}

/* g on d's compute stream (device index): CUBLAS_STATUS_NOT_SUPPORTED, nothing queued, where
 * cuBLASLt has no algorithm for it (or the epilogues are turned off). */
static cublasStatus_t lt_run(cu_device *d, int index, cudaDataType t, bool tf32, const lt_gemm *g) {
    pthread_once(&lt_env_once, lt_read_env);
    if (!lt_epilogues) return CUBLAS_STATUS_NOT_SUPPORTED;
    cublasOperation_t ta = g->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t tb = g->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    const uint32_t al[4] = {align_of(g->a), align_of(g->b), align_of(g->d), align_of(g->d)};
    const lt_problem prob = lt_problem_of(index, t, tf32, g, al);
    cublasLtMatmulAlgo_t algo;
    bool found = false;
    const bool known = lt_memo_get(&prob, &found, &algo);
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
    cublasStatus_t st = cu_blas.cublasLtMatmulDescCreate(
        &op, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (!st)
        st =
            cu_blas.cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    if (!st)
        st =
            cu_blas.cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    if (!st)
        st = cu_blas.cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &g->epi,
                                                    sizeof g->epi);
    if (!st && g->bias)
        st = cu_blas.cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g->bias,
                                                    sizeof g->bias);
    if (!st && g->aux)
        st = cu_blas.cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                    &g->aux, sizeof g->aux);
    if (!st && g->aux)
        st = cu_blas.cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                    &g->aux_ld, sizeof g->aux_ld);
    if (!st)
        st = cu_blas.cublasLtMatrixLayoutCreate(&la, t, g->ta ? g->k : g->m, g->ta ? g->m : g->k,
                                                g->lda);
    if (!st)
        st = cu_blas.cublasLtMatrixLayoutCreate(&lb, t, g->tb ? g->n : g->k, g->tb ? g->k : g->n,
                                                g->ldb);
    if (!st) st = cu_blas.cublasLtMatrixLayoutCreate(&ld, t, g->m, g->n, g->ldd);
    if (!st && !known) {
        st = lt_heuristic(d, op, la, lb, ld, al, &found, &algo);
        if (!st) lt_memo_put(&prob, found, &algo);
    }
    if (!st && !found) st = CUBLAS_STATUS_NOT_SUPPORTED;
    const float one = 1.0f;
    if (!st)
        st = cu_blas.cublasLtMatmul(d->lt, op, &one, g->a, la, g->b, lb, &g->beta, g->d, ld, g->d,
                                    ld, &algo, d->blas_workspace, CU_BLAS_WORKSPACE, d->compute);
    if (ld) cu_blas.cublasLtMatrixLayoutDestroy(ld);
    if (lb) cu_blas.cublasLtMatrixLayoutDestroy(lb);
    if (la) cu_blas.cublasLtMatrixLayoutDestroy(la);
    if (op) cu_blas.cublasLtMatmulDescDestroy(op);
    return st;
}

/* y = x w^T + b with CUBLASLT_EPILOGUE_BIAS, or with pre (not NULL) y = GELU(pre), pre = x w^T
 * + b with GELU_AUX_BIAS. y's [M, out] rows are D [out, M] = (w seen as [in, out])^T X^T
 * [in, M]: the bias runs along D's rows. */
static cublasStatus_t linear_lt(cu_device *d, tdm_tensor *y, tdm_tensor *pre, const tdm_tensor *x,
                                const tdm_tensor *w, const tdm_tensor *b) {
    uint64_t M = (uint64_t)y->shape[1], out = (uint64_t)y->shape[2], in = (uint64_t)x->shape[2];
    lt_gemm g = {};
    g.ta = true, g.m = out, g.n = M, g.k = in;
    g.a = tdm_cuda_ptr(w), g.b = tdm_cuda_ptr(x), g.d = tdm_cuda_ptr(y);
    g.lda = g.ldb = (int64_t)in, g.ldd = (int64_t)out;
    g.epi = pre ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_BIAS;
    g.bias = tdm_cuda_ptr(b);
    g.aux = pre ? tdm_cuda_ptr(pre) : NULL, g.aux_ld = (int64_t)out;
    return lt_run(d, y->device.index, blas_type(y->dtype), y->dtype == TDM_F32 && tdm_allow_tf32(),
                  &g);
}

/* The operands of linear (and linear_gelu's pre), checked: TDM_OK or an error naming op. */
static int linear_check(const char *op, const tdm_tensor *y, const tdm_tensor *x,
                        const tdm_tensor *w, const tdm_tensor *b) {
    if (cu_check_float(op, true, {y, x, w, b})) return tdm_last_status();
    if (y->ndim != 3 || x->ndim != 3 || w->ndim != 3 || b->ndim != 1 || !tdm_is_contiguous(y) ||
        !tdm_is_contiguous(x) || !tdm_is_contiguous(w) || !tdm_is_contiguous(b) ||
        y->shape[0] != 1 || x->shape[0] != 1 || w->shape[0] != 1 || x->shape[1] != y->shape[1] ||
        w->shape[1] != y->shape[2] || w->shape[2] != x->shape[2] || b->shape[0] != y->shape[2])
        return tdm_raise(TDM_ERR_SHAPE,
                         "cuda %s: expects contiguous y [1, M, out], x [1, M, in], "
                         "w [1, out, in] and b [out]",
                         op);
    return TDM_OK;
}

/* linear_lt where it runs: TDM_OK, TDM_ERR_STATE (silently: not done, nothing queued), or an
 * error of cuBLASLt's. */
static int linear_lt_run(cu_device *d, tdm_tensor *y, tdm_tensor *pre, const tdm_tensor *x,
                         const tdm_tensor *w, const tdm_tensor *b) {
    int64_t M = y->shape[1], out = y->shape[2], in = x->shape[2];
    if (in == 0 || M > INT_MAX || out > INT_MAX || in > INT_MAX) return TDM_ERR_STATE;
    cublasStatus_t st = linear_lt(d, y, pre, x, w, b);
    if (st == CUBLAS_STATUS_SUCCESS) return TDM_OK;
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) return TDM_ERR_STATE;
    return cu_check_blas(st, pre ? "linear_gelu (cublasLtMatmul)" : "linear (cublasLtMatmul)",
                         y->device.index);
}

extern "C" int tdm_cuda_linear_gelu(tdm_tensor *y, tdm_tensor *pre, const tdm_tensor *x,
                                    const tdm_tensor *w, const tdm_tensor *b) {
    if (linear_check("linear_gelu", pre, x, w, b) || linear_check("linear_gelu", y, x, w, b))
        return tdm_last_status();
    cu_device *d = cu_dev_of(y, "linear_gelu");
    if (!d) return tdm_last_status();
    if (y->shape[1] == 0 || y->shape[2] == 0) return TDM_OK;
    if (y->shape[2] % 8 == 0) { /* the GELU's input's leading dimension: cuBLASLt's rule */
        int rc = linear_lt_run(d, y, pre, x, w, b);
        if (rc != TDM_ERR_STATE) return rc;
    }
    int rc = tdm_cuda_linear(pre, x, w, b);
    return rc ? rc : tdm_cuda_unary(TDM_UN_GELU_TANH, y, pre, 0.0f);
}

extern "C" int tdm_cuda_linear(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w,
                               const tdm_tensor *b) {
    if (!b) return tdm_cuda_matmul(y, x, w, false, true, 0.0f);
    if (linear_check("linear", y, x, w, b)) return tdm_last_status();
    cu_device *d = cu_dev_of(y, "linear");
    if (!d) return tdm_last_status();
    int64_t M = y->shape[1], out = y->shape[2];
    if (M == 0 || out == 0) return TDM_OK;
    int lt = linear_lt_run(d, y, NULL, x, w, b);
    if (lt != TDM_ERR_STATE) return lt;
    /* no algorithm with the epilogue: y preloaded with b, the GEMM adding onto it */
    tdm_tensor bb = *b;
    bb.ndim = 3;
    bb.shape[0] = 1, bb.shape[1] = M, bb.shape[2] = out;
    bb.strides[0] = bb.strides[1] = 0, bb.strides[2] = 1;
    int rc = tdm_cuda_copy(y, &bb);
    return rc ? rc : tdm_cuda_matmul(y, x, w, false, true, 1.0f);
}

/* gpre [M, in] = (gy [M, out] @ w [out, in]) * GELU'(pre): column-major, D [in, M] = (w seen as
 * [in, out]) (gy seen as [out, M]), the DGELU epilogue reading pre as D's aux. */
extern "C" int tdm_cuda_linear_dgelu(tdm_tensor *gpre, const tdm_tensor *gy, const tdm_tensor *w,
                                     const tdm_tensor *pre) {
    if (cu_check_float("linear_dgelu", true, {gpre, gy, w, pre})) return tdm_last_status();
    if (gpre->ndim != 3 || gy->ndim != 3 || w->ndim != 3 || pre->ndim != 3 ||
        !tdm_is_contiguous(gpre) || !tdm_is_contiguous(gy) || !tdm_is_contiguous(w) ||
        !tdm_is_contiguous(pre) || gpre->shape[0] != 1 || gy->shape[0] != 1 || w->shape[0] != 1 ||
        gy->shape[1] != gpre->shape[1] || w->shape[1] != gy->shape[2] ||
        w->shape[2] != gpre->shape[2] || !tdm_same_shape(pre, gpre))
        return tdm_raise(TDM_ERR_SHAPE, "cuda linear_dgelu: expects contiguous gpre and pre "
                                        "[1, M, in], gy [1, M, out] and w [1, out, in]");
    cu_device *d = cu_dev_of(gpre, "linear_dgelu");
    if (!d) return tdm_last_status();
    const int64_t M = gpre->shape[1], in = gpre->shape[2], out = gy->shape[2];
    if (M == 0 || in == 0) return TDM_OK;
    if (out > 0 && in % 8 == 0 && M <= INT_MAX && in <= INT_MAX && out <= INT_MAX) {
        lt_gemm g = {};
        g.ta = false, g.m = (uint64_t)in, g.n = (uint64_t)M, g.k = (uint64_t)out;
        g.a = tdm_cuda_ptr(w), g.b = tdm_cuda_ptr(gy), g.d = tdm_cuda_ptr(gpre);
        g.lda = g.ldd = in, g.ldb = out;
        g.epi = CUBLASLT_EPILOGUE_DGELU;
        g.aux = tdm_cuda_ptr(pre), g.aux_ld = in;
        cublasStatus_t st = lt_run(d, gpre->device.index, blas_type(gpre->dtype),
                                   gpre->dtype == TDM_F32 && tdm_allow_tf32(), &g);
        if (st == CUBLAS_STATUS_SUCCESS) return TDM_OK;
        if (st != CUBLAS_STATUS_NOT_SUPPORTED)
            return cu_check_blas(st, "linear_dgelu (cublasLtMatmul)", gpre->device.index);
    }
    /* unary_backward reads each element's gy before writing its gx: in place is safe */
    int rc = tdm_cuda_matmul(gpre, gy, w, false, false, 0.0f);
    return rc ? rc : tdm_cuda_unary_backward(TDM_UN_GELU_TANH, gpre, gpre, pre, NULL, 0.0f);
}

/* gw [out, in] = beta gw + gy^T x, gb = gy's column sums: column-major, D [in, out] = (x seen
 * as [in, M]) (gy seen as [out, M])^T + beta D, the BGRADB epilogue summing op(B) = gy [M, out]
 * over k = M into gb. */
extern "C" int tdm_cuda_linear_wgrad(tdm_tensor *gw, tdm_tensor *gb, const tdm_tensor *gy,
                                     const tdm_tensor *x, float beta) {
    if (cu_check_float("linear_wgrad", true, {gy, x, gw, gb})) return tdm_last_status();
    if ((!gw && !gb) || gy->ndim != 3 || x->ndim != 3 || !tdm_is_contiguous(gy) ||
        !tdm_is_contiguous(x) || gy->shape[0] != 1 || x->shape[0] != 1 ||
        gy->shape[1] != x->shape[1] ||
        (gw && (gw->ndim != 3 || !tdm_is_contiguous(gw) || gw->shape[0] != 1 ||
                gw->shape[1] != gy->shape[2] || gw->shape[2] != x->shape[2])) ||
        (gb && (gb->ndim != 1 || !tdm_is_contiguous(gb) || gb->shape[0] != gy->shape[2])))
        return tdm_raise(TDM_ERR_SHAPE, "cuda linear_wgrad: expects contiguous gw [1, out, in], "
                                        "gb [out] (one at least), gy [1, M, out] and x [1, M, in]");
    cu_device *d = cu_dev_of(gy, "linear_wgrad");
    if (!d) return tdm_last_status();
    const int64_t M = gy->shape[1], out = gy->shape[2], in = x->shape[2];
    if (gw && gb && M > 0 && out > 0 && in > 0 && M <= INT_MAX && out <= INT_MAX && in <= INT_MAX) {
        lt_gemm g = {};
        g.ta = false, g.tb = true, g.beta = beta;
        g.m = (uint64_t)in, g.n = (uint64_t)out, g.k = (uint64_t)M;
        g.a = tdm_cuda_ptr(x), g.b = tdm_cuda_ptr(gy), g.d = tdm_cuda_ptr(gw);
        g.lda = g.ldd = in, g.ldb = out;
        g.epi = CUBLASLT_EPILOGUE_BGRADB;
        g.bias = tdm_cuda_ptr(gb);
        cublasStatus_t st = lt_run(d, gw->device.index, blas_type(gw->dtype),
                                   gw->dtype == TDM_F32 && tdm_allow_tf32(), &g);
        if (st == CUBLAS_STATUS_SUCCESS) return TDM_OK;
        if (st != CUBLAS_STATUS_NOT_SUPPORTED)
            return cu_check_blas(st, "linear_wgrad (cublasLtMatmul)", gw->device.index);
    }
    int rc = gw ? tdm_cuda_matmul(gw, gy, x, true, false, beta) : TDM_OK;
    if (rc || !gb) return rc;
    tdm_tensor gb2 = *gb, gy2 = *gy;
    gb2.ndim = 2, gb2.shape[0] = 1, gb2.shape[1] = out, gb2.strides[0] = out, gb2.strides[1] = 1;
    gy2.ndim = 2, gy2.shape[0] = M, gy2.shape[1] = out, gy2.strides[0] = out, gy2.strides[1] = 1;
    return tdm_cuda_sum_to(&gb2, &gy2);
}
