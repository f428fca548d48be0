/* The CUDA backend against the CPU backend.
 *
 * Every kernel of the backend table runs on the same random inputs on cpu:0 and cuda:0 and
 * the results are compared, forward and backward, with the error bound written beside each
 * check (relative to the CPU's value, plus a small absolute term where results cancel to
 * ~0). Then training: a few steps of an MLP and a CNN on cuda:0 match the same steps on
 * cpu:0, and repeat bit for bit on the GPU; a GPT's loss and gradients match too. Then the bad
 * conditions: a GPU that is not there, and an allocation no GPU can hold.
 *
 * Without the CUDA backend or without a GPU the test prints why and exits 77, which CTest
 * reports as skipped. `test_cuda --bench` prints GPU throughput for scripts/gpu-check. */
#include "check.h"

#include "backend/backend.h"

#ifndef TANDEM_HAVE_CUDA
int main(void) {
    printf("SKIP test_cuda: this build has no CUDA backend (configure with -DTANDEM_CUDA=ON "
           "where nvcc is installed)\n");
    return 77;
}
#else

#include "backend/cuda/cuda.h"
#include "parallel/nccl_group.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <time.h>

static const tdm_backend *CPU, *GPU;
static tdm_device G; /* cuda:0 */

/* The same values on the CPU (c) and on the GPU (g). */
typedef struct {
    tdm_tensor *c, *g;
} twin;

static twin twin_of(tdm_tensor *c) {
    twin t = {c, c ? tdm_to_device(c, G) : NULL};
    if (!t.g) fprintf(stderr, "twin: %s\n", tdm_last_error());
    return t;
}

/* N(mean, 1) values drawn from seed. */
static twin twin_randn(tdm_shape s, float mean, uint64_t seed) {
    tdm_rng r = tdm_rng_make(seed);
    return twin_of(tdm_randn(s, mean, 1.0f, tdm_cpu(0), &r));
}

static twin twin_empty(tdm_shape s, tdm_dtype dt) {
    twin t = {tdm_zeros(s, dt, tdm_cpu(0)), tdm_zeros(s, dt, G)};
    return t;
}

static twin twin_ints(tdm_shape s, tdm_dtype dt, const int64_t *v) {
    int64_t n = tdm_shape_numel(s);
    int32_t v32[4096];
    if (dt == TDM_I32)
        for (int64_t i = 0; i < n && i < 4096; i++) v32[i] = (int32_t)v[i];
    return twin_of(tdm_from_data(s, dt, tdm_cpu(0), dt == TDM_I32 ? (void *)v32 : (void *)v));
}

/* A view of both with the given geometry (stride 0 for broadcasts, transposes...). */
static twin twin_view(twin t, int nd, const int64_t *shape, const int64_t *strides) {
    twin v = {tdm_tensor_view(t.c, nd, shape, strides, t.c->offset),
              tdm_tensor_view(t.g, nd, shape, strides, t.g->offset)};
    return v;
}

/* Element-wise |gpu - cpu| <= atol + rtol * |cpu| (NaN must match NaN). Returns mismatches.
 * Called inside a scope, which owns the copies it makes. */
static int cmp(const char *what, twin t, double atol, double rtol) {
    if (!t.c || !t.g) {
        CHECK(false, "%s: missing tensor: %s", what, tdm_last_error());
        return 1;
    }
    int64_t n = tdm_numel(t.c);
    double *a = malloc(sizeof(double) * (size_t)(n ? n : 1));
    double *b = malloc(sizeof(double) * (size_t)(n ? n : 1));
    tdm_tensor *ca = tdm_cast(t.c, t.c->dtype == TDM_F32 ? TDM_F32 : TDM_I64);
    tdm_tensor *ga = tdm_cast(t.g, t.c->dtype == TDM_F32 ? TDM_F32 : TDM_I64);
    int bad = 0;
    if (!ca || !ga) {
        CHECK(false, "%s: cast: %s", what, tdm_last_error());
        bad = 1;
    }
    for (int side = 0; side < 2 && !bad; side++) {
        tdm_tensor *x = side ? ga : ca;
        double *out = side ? b : a;
        if (x->dtype == TDM_F32) {
            float *f = malloc(sizeof(float) * (size_t)(n ? n : 1));
            bad |= tdm_to_host(x, f, sizeof(float) * (size_t)n) != 0;
            for (int64_t i = 0; i < n && !bad; i++) out[i] = f[i];
            free(f);
        } else {
            int64_t *v = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
            bad |= tdm_to_host(x, v, sizeof(int64_t) * (size_t)n) != 0;
            for (int64_t i = 0; i < n && !bad; i++) out[i] = (double)v[i];
            free(v);
        }
        if (bad) CHECK(false, "%s: to_host: %s", what, tdm_last_error());
    }
    int mism = 0;
    for (int64_t i = 0; i < n && !bad; i++) {
        bool both_nan = a[i] != a[i] && b[i] != b[i];
        if (both_nan || fabs(b[i] - a[i]) <= atol + rtol * fabs(a[i])) continue;
        if (mism++ < 4)
            fprintf(stderr, "  %s: element %lld: cuda %.9g, cpu %.9g\n", what, (long long)i, b[i],
                    a[i]);
    }
    CHECK(!bad && mism == 0, "%s: %d of %lld elements differ (atol %g, rtol %g)", what, mism,
          (long long)n, atol, rtol);
    free(a); /* ca and ga belong to the caller's scope */
    free(b);
    return mism + bad;
}

/* Both backends returned TDM_OK. */
#define BOTH(what, call_c, call_g)                                                                 \
    do {                                                                                           \
        int rc_c_ = (call_c), rc_g_ = (call_g);                                                    \
        CHECK(rc_c_ == TDM_OK && rc_g_ == TDM_OK, "%s: cpu %d, cuda %d: %s", what, rc_c_, rc_g_,   \
              tdm_last_error());                                                                   \
    } while (0)

/* ---- memory, copies, random ------------------------------------------------------------ */

static void test_memory(void) {
    tdm_scope_begin();
    twin x = twin_randn(TDM_SHAPE(7, 33), 0, 1);
    cmp("to_device/to_host round trip (exact)", x, 0, 0);
    /* a transposed view read back through the strided gather: exact */
    int64_t sh[2] = {33, 7}, st[2] = {1, 33};
    twin xt = twin_view(x, 2, sh, st);
    twin c = twin_empty(TDM_SHAPE(33, 7), TDM_F32);
    BOTH("strided copy", CPU->copy(c.c, xt.c), GPU->copy(c.g, xt.g));
    cmp("strided copy (exact)", c, 0, 0);
    cmp("strided to_host (exact)", xt, 0, 0);
    /* dtype conversions: f32 -> i32 -> i64 -> f32 truncate exactly as C casts do */
    twin s = twin_randn(TDM_SHAPE(50), 0, 2);
    BOTH("scale", CPU->unary(TDM_UN_MUL_SCALAR, s.c, s.c, 1000.0f),
         GPU->unary(TDM_UN_MUL_SCALAR, s.g, s.g, 1000.0f));
    twin i32 = twin_empty(TDM_SHAPE(50), TDM_I32), i64 = twin_empty(TDM_SHAPE(50), TDM_I64);
    twin f = twin_empty(TDM_SHAPE(50), TDM_F32);
    BOTH("f32->i32", CPU->copy(i32.c, s.c), GPU->copy(i32.g, s.g));
    BOTH("i32->i64", CPU->copy(i64.c, i32.c), GPU->copy(i64.g, i32.g));
    BOTH("i64->f32", CPU->copy(f.c, i64.c), GPU->copy(f.g, i64.g));
    cmp("f32->i32 (exact)", i32, 0, 0);
    cmp("i64->f32 (exact)", f, 0, 0);
    /* fill of a strided view (every other column) */
    twin z = twin_randn(TDM_SHAPE(6, 8), 0, 3);
    int64_t fs[2] = {6, 4}, fst[2] = {8, 2};
    twin zv = twin_view(z, 2, fs, fst);
    BOTH("fill", CPU->fill(zv.c, 2.5), GPU->fill(zv.g, 2.5));
    cmp("strided fill (exact)", z, 0, 0);
    /* Philox: the same 24-bit words; uniform is a + (b - a) * u, rounded twice on the GPU
     * and maybe fused on the CPU (GCC contracts by default): one rounding, 1e-6 absolute.
     * Normal goes through double log/cos, where CUDA's libm and glibc may differ in the
     * last double bit: 1e-6 */
    twin u = twin_empty(TDM_SHAPE(1001), TDM_F32), g = twin_empty(TDM_SHAPE(999), TDM_F32);
    BOTH("uniform", CPU->random(u.c, 0, -2, 3, 42, 5), GPU->random(u.g, 0, -2, 3, 42, 5));
    BOTH("normal", CPU->random(g.c, 1, 1, 2, 42, 7), GPU->random(g.g, 1, 1, 2, 42, 7));
    cmp("uniform", u, 1e-6, 0);
    cmp("normal", g, 1e-6, 1e-6);
    tdm_scope_end();
}

/* ---- element-wise ------------------------------------------------------------------------ */

static void test_unary(void) {
    const char *names[] = {"neg",  "exp",  "log",     "sqrt",  "relu",  "gelu_tanh",
                           "gelu", "tanh", "sigmoid", "add_s", "mul_s", "pow_s"};
    float scalars[] = {2.0f, 3.0f, -1.5f};
    for (int op = TDM_UN_NEG; op <= TDM_UN_POW_SCALAR; op++)
        for (int si = 0; si < (op == TDM_UN_POW_SCALAR ? 3 : 1); si++) {
            tdm_scope_begin();
            float s = op == TDM_UN_POW_SCALAR ? scalars[si] : 0.7f;
            bool positive = op == TDM_UN_LOG || op == TDM_UN_SQRT || op == TDM_UN_POW_SCALAR;
            twin x0 = twin_randn(TDM_SHAPE(40, 30), 0, 10 + (uint64_t)op);
            if (positive) { /* |x| + 0.5 keeps log, sqrt and powers finite */
                twin a = twin_empty(TDM_SHAPE(40, 30), TDM_F32);
                BOTH("abs", CPU->unary(TDM_UN_POW_SCALAR, a.c, x0.c, 2.0f),
                     GPU->unary(TDM_UN_POW_SCALAR, a.g, x0.g, 2.0f));
                BOTH("shift", CPU->unary(TDM_UN_ADD_SCALAR, x0.c, a.c, 0.5f),
                     GPU->unary(TDM_UN_ADD_SCALAR, x0.g, a.g, 0.5f));
            }
            /* x is a transposed view: the strided path */
            int64_t sh[2] = {30, 40}, st[2] = {1, 30};
            twin x = twin_view(x0, 2, sh, st);
            twin y = twin_empty(TDM_SHAPE(30, 40), TDM_F32);
            twin gy = twin_randn(TDM_SHAPE(30, 40), 0, 99);
            twin gx = twin_empty(TDM_SHAPE(30, 40), TDM_F32);
            tdm_unary_op u = (tdm_unary_op)op;
            BOTH(names[op], CPU->unary(u, y.c, x.c, s), GPU->unary(u, y.g, x.g, s));
            BOTH(names[op], CPU->unary_backward(u, gx.c, gy.c, x.c, y.c, s),
                 GPU->unary_backward(u, gx.g, gy.g, x.g, y.g, s));
            char what[64];
            /* libm functions differ by a few ulp between glibc, the CPU's own expf and CUDA:
             * 1e-5 relative (+1e-6 where a result cancels to ~0) */
            snprintf(what, sizeof what, "unary %s(s=%g)", names[op], s);
            cmp(what, y, 1e-6, 1e-5);
            snprintf(what, sizeof what, "unary_backward %s(s=%g)", names[op], s);
            cmp(what, gx, 1e-6, 1e-5);
            tdm_scope_end();
        }
}

static void test_binary_axpy(void) {
    const char *names[] = {"add", "sub", "mul", "div"};
    for (int op = TDM_BIN_ADD; op <= TDM_BIN_DIV; op++) {
        tdm_scope_begin();
        twin a = twin_randn(TDM_SHAPE(17, 23), 0, 20);
        twin b0 = twin_randn(TDM_SHAPE(23), 3, 21); /* mean 3: no division by ~0 */
        twin c0 = twin_randn(TDM_SHAPE(17, 1), 3, 22);
        int64_t sh[2] = {17, 23}, row[2] = {0, 1}, col[2] = {1, 0};
        twin b = twin_view(b0, 2, sh, row), c = twin_view(c0, 2, sh, col); /* broadcasts */
        twin y1 = twin_empty(TDM_SHAPE(17, 23), TDM_F32),
             y2 = twin_empty(TDM_SHAPE(17, 23), TDM_F32);
        tdm_binary_op o = (tdm_binary_op)op;
        BOTH(names[op], CPU->binary(o, y1.c, a.c, b.c), GPU->binary(o, y1.g, a.g, b.g));
        BOTH(names[op], CPU->binary(o, y2.c, c.c, a.c), GPU->binary(o, y2.g, c.g, a.g));
        /* one IEEE operation per element on both sides: exact */
        char what[64];
        snprintf(what, sizeof what, "binary %s, row broadcast (exact)", names[op]);
        cmp(what, y1, 0, 0);
        snprintf(what, sizeof what, "binary %s, column broadcast (exact)", names[op]);
        cmp(what, y2, 0, 0);
        tdm_scope_end();
    }
    tdm_scope_begin();
    twin y = twin_randn(TDM_SHAPE(1000), 0, 23), x = twin_randn(TDM_SHAPE(1000), 0, 24);
    BOTH("axpy", CPU->axpy(y.c, -0.3f, x.c), GPU->axpy(y.g, -0.3f, x.g));
    cmp("axpy (FMA on the GPU: 1 ulp)", y, 1e-7, 1e-6);
    tdm_scope_end();
}

/* ---- reductions -------------------------------------------------------------------------- */

static void test_reduce(void) {
    tdm_shape shapes[] = {TDM_SHAPE(5, 300, 7), TDM_SHAPE(3, 5000), TDM_SHAPE(4, 2, 9)};
    for (int si = 0; si < 3; si++)
        for (int dim = 0; dim < shapes[si].ndim; dim++)
            for (int op = TDM_RED_SUM; op <= TDM_RED_MAX; op++) {
                tdm_scope_begin();
                tdm_shape s = shapes[si], ys = s;
                ys.d[dim] = 1;
                twin x = twin_randn(s, 0, 30 + (uint64_t)si);
                twin y = twin_empty(ys, TDM_F32), am = twin_empty(ys, TDM_I64);
                tdm_reduce_op r = (tdm_reduce_op)op;
                BOTH("reduce", CPU->reduce(r, y.c, x.c, dim, am.c),
                     GPU->reduce(r, y.g, x.g, dim, am.g));
                char what[80];
                /* sums in double in another order: 1e-6 relative, 1e-5 absolute for sums of
                 * up to 5000 N(0,1) values that cancel; max is exact */
                snprintf(what, sizeof what, "reduce op %d over dim %d of shape %d", op, dim, si);
                cmp(what, y, op == TDM_RED_MAX ? 0 : 1e-5, op == TDM_RED_MAX ? 0 : 1e-6);
                if (op == TDM_RED_MAX) {
                    snprintf(what, sizeof what, "argmax over dim %d of shape %d (exact)", dim, si);
                    cmp(what, am, 0, 0);
                    twin gy = twin_randn(ys, 0, 31), gx = twin_empty(s, TDM_F32);
                    BOTH("max_backward", CPU->max_backward(gx.c, gy.c, am.c, dim),
                         GPU->max_backward(gx.g, gy.g, am.g, dim));
                    cmp("max_backward (exact)", gx, 0, 0);
                }
                tdm_scope_end();
            }
    /* a NaN wins max, and ties go to the first index, in both kernels (long and short rows) */
    tdm_scope_begin();
    float v[600];
    for (int i = 0; i < 600; i++) v[i] = (float)(i % 7);
    v[400] = NAN;
    twin x = twin_of(tdm_from_data(TDM_SHAPE(2, 300), TDM_F32, tdm_cpu(0), v));
    twin y = twin_empty(TDM_SHAPE(2), TDM_F32), am = twin_empty(TDM_SHAPE(2), TDM_I64);
    BOTH("max with NaN", CPU->reduce(TDM_RED_MAX, y.c, x.c, 1, am.c),
         GPU->reduce(TDM_RED_MAX, y.g, x.g, 1, am.g));
    cmp("max with NaN and ties", y, 0, 0);
    cmp("argmax with NaN and ties (exact)", am, 0, 0);
    tdm_scope_end();
}

static void test_sum_to(void) {
    struct {
        tdm_shape x, y;
    } cases[] = {{TDM_SHAPE(4, 6, 5), TDM_SHAPE(6, 1)}, {TDM_SHAPE(4, 6, 5), TDM_SHAPE(1, 5)},
                 {TDM_SHAPE(4, 6, 5), TDM_SHAPE(5)},    {TDM_SHAPE(64, 300), TDM_SHAPE(300)},
                 {TDM_SHAPE(8192, 3), TDM_SHAPE(1, 3)}, {TDM_SHAPE(3, 4), TDM_SHAPE(3, 4)},
                 {TDM_SHAPE(2, 3, 4), TDM_SHAPE0}};
    for (int i = 0; i < 7; i++) {
        tdm_scope_begin();
        twin x = twin_randn(cases[i].x, 0, 40 + (uint64_t)i);
        twin y = twin_empty(cases[i].y, TDM_F32);
        BOTH("sum_to", CPU->sum_to(y.c, x.c), GPU->sum_to(y.g, x.g));
        char what[48];
        /* the GPU sums in double; the CPU adds [m, n] -> [1, n] row by row in float, whose
         * error grows like sqrt(m) * eps * |sum| (3.7e-4 seen for m = 8192): 1e-3 absolute */
        snprintf(what, sizeof what, "sum_to case %d", i);
        cmp(what, y, 1e-3, 1e-5);
        tdm_scope_end();
    }
}

static void test_softmax(void) {
    tdm_shape shapes[] = {TDM_SHAPE(37, 1000), TDM_SHAPE(5, 10), TDM_SHAPE(3, 4, 70)};
    for (int si = 0; si < 3; si++)
        for (int lg = 0; lg < 2; lg++) {
            tdm_scope_begin();
            twin x = twin_randn(shapes[si], 0, 50 + (uint64_t)si);
            BOTH("scale", CPU->unary(TDM_UN_MUL_SCALAR, x.c, x.c, 4.0f),
                 GPU->unary(TDM_UN_MUL_SCALAR, x.g, x.g, 4.0f));
            twin y = twin_empty(shapes[si], TDM_F32), gx = twin_empty(shapes[si], TDM_F32);
            twin gy = twin_randn(shapes[si], 0, 51);
            BOTH("softmax", CPU->softmax(y.c, x.c, lg), GPU->softmax(y.g, x.g, lg));
            BOTH("softmax_backward", CPU->softmax_backward(gx.c, gy.c, y.c, lg),
                 GPU->softmax_backward(gx.g, gy.g, y.g, lg));
            /* expf differs by an ulp or two between the CPU's polynomial and CUDA: 1e-5 */
            cmp(lg ? "log_softmax" : "softmax", y, 1e-6, 1e-5);
            cmp(lg ? "log_softmax backward" : "softmax backward", gx, 1e-6, 1e-5);
            tdm_scope_end();
        }
    tdm_scope_begin();
    twin x = twin_randn(TDM_SHAPE(123, 457), 0, 52);
    int64_t sh[2] = {457, 123}, st[2] = {1, 457};
    twin xt = twin_view(x, 2, sh, st);
    double sc = 0, sg = 0;
    BOTH("sum_squares", CPU->sum_squares(&sc, xt.c), GPU->sum_squares(&sg, xt.g));
    CHECK_CLOSE(sg, sc, 0, 1e-12); /* double sums of exact float squares: ~1e-15 apart */
    tdm_scope_end();
}

/* ---- linear algebra ---------------------------------------------------------------------- */

static void test_matmul(void) {
    int64_t B = 3, n = 37, m = 29, k = 301;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int variant = 0; variant < 2; variant++) {
                tdm_scope_begin();
                /* variant 1: a broadcast over the batch (stride 0) and c accumulated (beta 1) */
                twin a0 = twin_randn(ta ? TDM_SHAPE(B, k, n) : TDM_SHAPE(B, n, k), 0, 60);
                twin b = twin_randn(tb ? TDM_SHAPE(B, m, k) : TDM_SHAPE(B, k, m), 0, 61);
                twin a = a0;
                if (variant) {
                    int64_t sh[3] = {B, a0.c->shape[1], a0.c->shape[2]};
                    int64_t st[3] = {0, a0.c->strides[1], 1};
                    a = twin_view(a0, 3, sh, st);
                }
                twin c = twin_randn(TDM_SHAPE(B, n, m), 0, 62);
                float beta = variant ? 1.0f : 0.0f;
                BOTH("matmul", CPU->matmul(c.c, a.c, b.c, ta, tb, beta),
                     GPU->matmul(c.g, a.g, b.g, ta, tb, beta));
                char what[64];
                /* FP32 GEMMs with k = 301 blocked differently: sums of ~17 in magnitude agree
                 * to ~1e-5 absolute; 1e-4 absolute + 1e-4 relative */
                snprintf(what, sizeof what, "matmul ta=%d tb=%d %s", ta, tb,
                         variant ? "broadcast a, beta 1" : "beta 0");
                cmp(what, c, 1e-4, 1e-4);
                tdm_scope_end();
            }
}

static void test_index(void) {
    for (int dt = 0; dt < 2; dt++) {
        tdm_scope_begin();
        tdm_dtype idt = dt ? TDM_I64 : TDM_I32;
        int64_t iv[6] = {3, 0, 3, 9, 1, 3}; /* repeats: index_add must sum them in order */
        twin idx = twin_ints(TDM_SHAPE(6), idt, iv);
        twin x = twin_randn(TDM_SHAPE(10, 4, 3), 0, 70);
        twin y0 = twin_empty(TDM_SHAPE(6, 4, 3), TDM_F32);
        BOTH("index_select dim 0", CPU->index_select(y0.c, x.c, 0, idx.c),
             GPU->index_select(y0.g, x.g, 0, idx.g));
        cmp("index_select dim 0 (exact)", y0, 0, 0);
        twin x2 = twin_randn(TDM_SHAPE(2, 10, 5), 0, 71);
        twin y1 = twin_empty(TDM_SHAPE(2, 6, 5), TDM_F32);
        BOTH("index_select dim 1", CPU->index_select(y1.c, x2.c, 1, idx.c),
             GPU->index_select(y1.g, x2.g, 1, idx.g));
        cmp("index_select dim 1 (exact)", y1, 0, 0);
        twin gx = twin_randn(TDM_SHAPE(2, 10, 5), 0, 72);
        BOTH("index_add", CPU->index_add(gx.c, 1, idx.c, y1.c),
             GPU->index_add(gx.g, 1, idx.g, y1.g));
        cmp("index_add, repeated indices (same order: exact)", gx, 0, 0);
        int64_t bad[3] = {1, 2, 10};
        twin bi = twin_ints(TDM_SHAPE(3), idt, bad);
        twin yb = twin_empty(TDM_SHAPE(3, 4, 3), TDM_F32);
        CHECK_ERROR(GPU->index_select(yb.g, x.g, 0, bi.g) != TDM_OK, "index 10 (position 2)");
        CHECK_ERROR(GPU->index_add(x.g, 0, bi.g, yb.g) != TDM_OK, "index 10 (position 2)");
        tdm_scope_end();
    }
}

/* ---- convolution and pooling ------------------------------------------------------------- */

static void test_conv(void) {
    struct {
        int64_t n, cin, h, w, cout, kh, kw;
        tdm_conv2d_args a;
    } cases[] = {
        {4, 3, 12, 11, 8, 3, 3, {1, 1, 1, 1, 1, 1, 1}}, /* same padding */
        {3, 4, 13, 13, 6, 5, 5, {2, 2, 2, 2, 1, 1, 2}}, /* stride 2, groups 2 */
        {2, 8, 7, 9, 5, 1, 1, {1, 1, 0, 0, 1, 1, 1}},   /* pointwise: no im2col */
        {2, 3, 15, 14, 4, 3, 2, {1, 2, 2, 1, 2, 3, 1}}, /* dilation, uneven */
        {3, 6, 9, 9, 6, 3, 3, {1, 1, 1, 1, 1, 1, 6}},   /* depthwise */
    };
    for (int i = 0; i < 5; i++) {
        tdm_scope_begin();
        tdm_conv2d_args *a = &cases[i].a;
        int64_t ho =
            (cases[i].h + 2 * a->pad_h - a->dilation_h * (cases[i].kh - 1) - 1) / a->stride_h + 1;
        int64_t wo =
            (cases[i].w + 2 * a->pad_w - a->dilation_w * (cases[i].kw - 1) - 1) / a->stride_w + 1;
        twin x = twin_randn(TDM_SHAPE(cases[i].n, cases[i].cin, cases[i].h, cases[i].w), 0, 80);
        twin w = twin_randn(
            TDM_SHAPE(cases[i].cout, cases[i].cin / a->groups, cases[i].kh, cases[i].kw), 0, 81);
        twin b = twin_randn(TDM_SHAPE(cases[i].cout), 0, 82);
        tdm_shape ys = TDM_SHAPE(cases[i].n, cases[i].cout, ho, wo);
        twin y = twin_empty(ys, TDM_F32), gy = twin_randn(ys, 0, 83);
        twin gx = twin_empty(tdm_shape_of(x.c), TDM_F32),
             gw = twin_empty(tdm_shape_of(w.c), TDM_F32);
        twin gb = twin_empty(TDM_SHAPE(cases[i].cout), TDM_F32);
        BOTH("conv2d", CPU->conv2d(y.c, x.c, w.c, b.c, a), GPU->conv2d(y.g, x.g, w.g, b.g, a));
        BOTH("conv2d_backward", CPU->conv2d_backward(gx.c, gw.c, gb.c, gy.c, x.c, w.c, a),
             GPU->conv2d_backward(gx.g, gw.g, gb.g, gy.g, x.g, w.g, a));
        char what[64];
        /* FP32 GEMMs over up to K = 150 (forward) and N*P = 400 (weights) terms: 1e-4 */
        snprintf(what, sizeof what, "conv2d case %d", i);
        cmp(what, y, 1e-4, 1e-4);
        snprintf(what, sizeof what, "conv2d case %d gx", i);
        cmp(what, gx, 1e-4, 1e-4);
        snprintf(what, sizeof what, "conv2d case %d gw", i);
        cmp(what, gw, 1e-4, 1e-4);
        snprintf(what, sizeof what, "conv2d case %d gb", i);
        cmp(what, gb, 1e-4, 1e-4); /* the CPU sums each plane in float lanes */
        tdm_scope_end();
    }
}

static void test_pool(void) {
    tdm_pool2d_args cases[] = {
        {2, 2, 2, 2, 0, 0, 1, 1, false, true}, /* the CNN's 2x2 */
        {3, 3, 2, 2, 1, 1, 1, 1, false, true}, /* overlapping, padded */
        {3, 2, 1, 2, 1, 0, 2, 1, true, false}, /* dilation, ceil mode, no pad count */
    };
    for (int i = 0; i < 3; i++) {
        tdm_scope_begin();
        tdm_pool2d_args *a = &cases[i];
        int64_t H = 11, W = 10, ho, wo;
        /* output size with PyTorch's rule (ceil mode: the last window starts inside) */
        int64_t eh = H + 2 * a->pad_h - a->dilation_h * (a->kernel_h - 1) - 1;
        int64_t ew = W + 2 * a->pad_w - a->dilation_w * (a->kernel_w - 1) - 1;
        ho = (a->ceil_mode ? (eh + a->stride_h - 1) / a->stride_h : eh / a->stride_h) + 1;
        wo = (a->ceil_mode ? (ew + a->stride_w - 1) / a->stride_w : ew / a->stride_w) + 1;
        if (a->ceil_mode && (ho - 1) * a->stride_h >= H + a->pad_h) ho--;
        if (a->ceil_mode && (wo - 1) * a->stride_w >= W + a->pad_w) wo--;
        twin x = twin_randn(TDM_SHAPE(3, 4, H, W), 0, 90);
        tdm_shape ys = TDM_SHAPE(3, 4, ho, wo);
        twin y = twin_empty(ys, TDM_F32), idx = twin_empty(ys, TDM_I64), gy = twin_randn(ys, 0, 91);
        twin gx = twin_empty(tdm_shape_of(x.c), TDM_F32);
        BOTH("max_pool2d", CPU->max_pool2d(y.c, idx.c, x.c, a),
             GPU->max_pool2d(y.g, idx.g, x.g, a));
        BOTH("max_pool2d_backward", CPU->max_pool2d_backward(gx.c, gy.c, idx.c),
             GPU->max_pool2d_backward(gx.g, gy.g, idx.g));
        char what[64];
        /* same scan, same summation order: exact */
        snprintf(what, sizeof what, "max_pool2d case %d (exact)", i);
        cmp(what, y, 0, 0);
        snprintf(what, sizeof what, "max_pool2d case %d indices (exact)", i);
        cmp(what, idx, 0, 0);
        snprintf(what, sizeof what, "max_pool2d case %d backward (exact)", i);
        cmp(what, gx, 0, 0);
        BOTH("avg_pool2d", CPU->avg_pool2d(y.c, x.c, a), GPU->avg_pool2d(y.g, x.g, a));
        BOTH("avg_pool2d_backward", CPU->avg_pool2d_backward(gx.c, gy.c, a),
             GPU->avg_pool2d_backward(gx.g, gy.g, a));
        /* same window sums in the same order; 1 ulp slack for compiler contraction */
        snprintf(what, sizeof what, "avg_pool2d case %d", i);
        cmp(what, y, 1e-7, 1e-6);
        snprintf(what, sizeof what, "avg_pool2d case %d backward", i);
        cmp(what, gx, 1e-7, 1e-6);
        tdm_scope_end();
    }
}

/* ---- normalisation, dropout -------------------------------------------------------------- */

static void test_batch_norm(void) {
    tdm_shape shapes[] = {TDM_SHAPE(16, 5, 7, 6), TDM_SHAPE(64, 33)};
    for (int si = 0; si < 2; si++)
        for (int training = 1; training >= 0; training--) {
            tdm_scope_begin();
            tdm_shape s = shapes[si];
            int64_t C = s.d[1];
            twin x = twin_randn(s, 3, 100); /* mean 3: the two-pass variance matters */
            twin w = twin_randn(TDM_SHAPE(C), 1, 101), b = twin_randn(TDM_SHAPE(C), 0, 102);
            twin rm = twin_randn(TDM_SHAPE(C), 0, 103), rv = twin_randn(TDM_SHAPE(C), 2, 104);
            BOTH("abs", CPU->unary(TDM_UN_POW_SCALAR, rv.c, rv.c, 2.0f),
                 GPU->unary(TDM_UN_POW_SCALAR, rv.g, rv.g, 2.0f));
            twin y = twin_empty(s, TDM_F32), sm = twin_empty(TDM_SHAPE(C), TDM_F32);
            twin si_ = twin_empty(TDM_SHAPE(C), TDM_F32);
            BOTH(
                "batch_norm",
                CPU->batch_norm(y.c, sm.c, si_.c, x.c, w.c, b.c, rm.c, rv.c, training, 0.1f, 1e-5f),
                GPU->batch_norm(y.g, sm.g, si_.g, x.g, w.g, b.g, rm.g, rv.g, training, 0.1f,
                                1e-5f));
            /* double statistics on both sides, summed in another order: 1e-5 */
            cmp(training ? "batch_norm train y" : "batch_norm eval y", y, 1e-5, 1e-5);
            cmp("batch_norm save_mean", sm, 1e-6, 1e-5);
            cmp("batch_norm save_invstd", si_, 1e-6, 1e-5);
            cmp("batch_norm running_mean", rm, 1e-6, 1e-5);
            cmp("batch_norm running_var", rv, 1e-6, 1e-5);
            twin gy = twin_randn(s, 0, 105), gx = twin_empty(s, TDM_F32);
            twin gw = twin_empty(TDM_SHAPE(C), TDM_F32), gb = twin_empty(TDM_SHAPE(C), TDM_F32);
            BOTH("batch_norm_backward",
                 CPU->batch_norm_backward(gx.c, gw.c, gb.c, gy.c, x.c, w.c, sm.c, si_.c, training),
                 GPU->batch_norm_backward(gx.g, gw.g, gb.g, gy.g, x.g, w.g, sm.g, si_.g, training));
            /* the CPU sums rows in float lanes; gradients ~1e-5 apart in relative terms, and
             * gx cancels (mean-free): 1e-4 absolute */
            cmp("batch_norm_backward gx", gx, 1e-4, 1e-4);
            cmp("batch_norm_backward gw", gw, 1e-4, 1e-4);
            cmp("batch_norm_backward gb", gb, 1e-4, 1e-4);
            if (training) { /* the sync-BN kernels on this rank's share */
                twin sum = twin_empty(TDM_SHAPE(C), TDM_F32),
                     sq = twin_empty(TDM_SHAPE(C), TDM_F32);
                BOTH("batch_norm_stats", CPU->batch_norm_stats(sum.c, x.c, NULL),
                     GPU->batch_norm_stats(sum.g, x.g, NULL));
                BOTH("batch_norm_stats centred", CPU->batch_norm_stats(sq.c, x.c, sm.c),
                     GPU->batch_norm_stats(sq.g, x.g, sm.g));
                cmp("batch_norm_stats sum", sum, 1e-4, 1e-5);
                cmp("batch_norm_stats centred squares", sq, 1e-4, 1e-5);
                twin sdy = twin_empty(TDM_SHAPE(C), TDM_F32),
                     sdx = twin_empty(TDM_SHAPE(C), TDM_F32);
                BOTH("batch_norm_backward_reduce",
                     CPU->batch_norm_backward_reduce(sdy.c, sdx.c, gw.c, gb.c, gy.c, x.c, sm.c,
                                                     si_.c),
                     GPU->batch_norm_backward_reduce(sdy.g, sdx.g, gw.g, gb.g, gy.g, x.g, sm.g,
                                                     si_.g));
                cmp("batch_norm_backward_reduce sum_dy", sdy, 1e-4, 1e-4);
                cmp("batch_norm_backward_reduce sum_dy_xmu", sdx, 1e-4, 1e-4);
                cmp("batch_norm_backward_reduce gw", gw, 1e-4, 1e-4);
                double count = (double)(tdm_numel(x.c) / C);
                /* elemt from the CPU's sums on both sides: only the element formula differs */
                twin sdyc = twin_of(sdy.c), sdxc = twin_of(sdx.c);
                BOTH("batch_norm_backward_elemt",
                     CPU->batch_norm_backward_elemt(gx.c, gy.c, x.c, w.c, sm.c, si_.c, sdy.c, sdx.c,
                                                    count),
                     GPU->batch_norm_backward_elemt(gx.g, gy.g, x.g, w.g, sm.g, si_.g, sdyc.g,
                                                    sdxc.g, count));
                cmp("batch_norm_backward_elemt", gx, 1e-5, 1e-5);
            }
            tdm_scope_end();
        }
}

static void test_layer_norm_dropout(void) {
    int64_t rows = 37, cols[2] = {64, 1500};
    for (int ci = 0; ci < 2; ci++) {
        tdm_scope_begin();
        int64_t c = cols[ci];
        twin x = twin_randn(TDM_SHAPE(rows, c), 2, 110);
        twin w = twin_randn(TDM_SHAPE(c), 1, 111), b = twin_randn(TDM_SHAPE(c), 0, 112);
        twin y = twin_empty(TDM_SHAPE(rows, c), TDM_F32), m = twin_empty(TDM_SHAPE(rows), TDM_F32);
        twin r = twin_empty(TDM_SHAPE(rows), TDM_F32);
        BOTH("layer_norm", CPU->layer_norm(y.c, m.c, r.c, x.c, w.c, b.c, 1e-5f),
             GPU->layer_norm(y.g, m.g, r.g, x.g, w.g, b.g, 1e-5f));
        /* row statistics in double vs float lanes: 1e-5 */
        cmp("layer_norm y", y, 1e-5, 1e-5);
        cmp("layer_norm mean", m, 1e-6, 1e-5);
        cmp("layer_norm rstd", r, 1e-6, 1e-5);
        twin gy = twin_randn(TDM_SHAPE(rows, c), 0, 113),
             gx = twin_empty(TDM_SHAPE(rows, c), TDM_F32);
        twin gw = twin_empty(TDM_SHAPE(c), TDM_F32), gb = twin_empty(TDM_SHAPE(c), TDM_F32);
        BOTH("layer_norm_backward",
             CPU->layer_norm_backward(gx.c, gw.c, gb.c, gy.c, x.c, w.c, m.c, r.c),
             GPU->layer_norm_backward(gx.g, gw.g, gb.g, gy.g, x.g, w.g, m.g, r.g));
        /* the CPU adds gw/gb in float over rows, the GPU in double: 1e-4 */
        cmp("layer_norm_backward gx", gx, 1e-4, 1e-4);
        cmp("layer_norm_backward gw", gw, 1e-4, 1e-4);
        cmp("layer_norm_backward gb", gb, 1e-4, 1e-4);
        tdm_scope_end();
    }
    tdm_scope_begin();
    twin x = twin_randn(TDM_SHAPE(3, 1001), 0, 114);
    twin y = twin_empty(TDM_SHAPE(3, 1001), TDM_F32), mk = twin_empty(TDM_SHAPE(3, 1001), TDM_F32);
    BOTH("dropout", CPU->dropout(y.c, mk.c, x.c, 0.3f, 7, 12345),
         GPU->dropout(y.g, mk.g, x.g, 0.3f, 7, 12345));
    cmp("dropout mask (same Philox counters: bit-identical)", mk, 0, 0);
    cmp("dropout y (bit-identical)", y, 0, 0);
    tdm_scope_end();
}

/* Causal attention, forward and backward, against the CPU kernel: row lengths below and
 * above the block's 128 threads, a head size of 3, and one head. The GPU sums each dot
 * product and softmax in another order than BLAS: 1e-5 forward, 1e-4 backward. */
static void test_attention(void) {
    struct {
        int64_t B, T, C;
        int nh;
    } cases[4] = {{2, 9, 8, 2}, {1, 200, 32, 4}, {3, 5, 6, 2}, {1, 1, 4, 1}};
    for (int i = 0; i < 4; i++) {
        tdm_scope_begin();
        int64_t B = cases[i].B, T = cases[i].T, C = cases[i].C;
        int nh = cases[i].nh;
        twin qkv = twin_randn(TDM_SHAPE(B, T, 3 * C), 0, 130 + (uint64_t)i);
        twin y = twin_empty(TDM_SHAPE(B, T, C), TDM_F32),
             lse = twin_empty(TDM_SHAPE(B, nh, T), TDM_F32);
        BOTH("attention", CPU->attention(y.c, lse.c, qkv.c, nh),
             GPU->attention(y.g, lse.g, qkv.g, nh));
        cmp("attention y", y, 1e-5, 1e-5);
        cmp("attention lse", lse, 1e-5, 1e-5);
        twin dy = twin_randn(TDM_SHAPE(B, T, C), 0, 140 + (uint64_t)i);
        twin dqkv = twin_empty(TDM_SHAPE(B, T, 3 * C), TDM_F32);
        BOTH("attention_backward", CPU->attention_backward(dqkv.c, dy.c, qkv.c, lse.c, nh),
             GPU->attention_backward(dqkv.g, dy.g, qkv.g, lse.g, nh));
        cmp("attention_backward dqkv", dqkv, 1e-4, 1e-4);
        tdm_scope_end();
    }
}

/* A GPT-2 (2 layers, 2 heads) on cuda:0 against its CPU twin: the loss and every parameter
 * gradient of one forward and backward (attention, layer norm, GELU, the tied head), and a
 * second GPU run bit for bit the first. */
static float *gpt_grads(tdm_module *m, tdm_device dev, float *loss) {
    tdm_paramset *ps = tdm_module_parameters(m);
    int64_t tok[2 * 12], tgt[2 * 12];
    for (int i = 0; i < 24; i++) tok[i] = (i * 7 + 3) % 20, tgt[i] = (i * 5 + 1) % 20;
    tdm_scope_begin();
    tdm_tensor *x = tdm_to_device(tdm_from_data(TDM_SHAPE(2, 12), TDM_I64, tdm_cpu(0), tok), dev);
    tdm_tensor *y = tdm_to_device(tdm_from_data(TDM_SHAPE(2, 12), TDM_I64, tdm_cpu(0), tgt), dev);
    tdm_tensor *l = tdm_gpt_loss(tdm_gpt_forward(m, x), y);
    float *g = NULL;
    if (ps && l && tdm_backward(l) == 0 && (g = malloc(sizeof(float) * (size_t)ps->total)) &&
        tdm_to_host(ps->flat_grad, g, sizeof(float) * (size_t)ps->total) == 0)
        *loss = tdm_item(l);
    else
        CHECK(false, "gpt on %s: %s", dev.type == TDM_CUDA ? "cuda" : "cpu", tdm_last_error());
    tdm_scope_end();
    return g;
}

static void test_gpt(void) {
    tdm_gpt_config cfg = {.layers = 2, .heads = 2, .channels = 16, .context = 12, .vocab = 20};
    tdm_rng r = tdm_rng_make(9);
    tdm_module *mc = tdm_gpt_new(&cfg, tdm_cpu(0), &r);
    tdm_module *mg = mc ? tdm_module_clone(mc, G) : NULL,
               *mg2 = mc ? tdm_module_clone(mc, G) : NULL;
    CHECK(mg && mg2, "gpt: clone to cuda:0: %s", tdm_last_error());
    if (!mg || !mg2) return;
    float lc = NAN, lg = NAN, lg2 = NAN;
    float *gc = gpt_grads(mc, tdm_cpu(0), &lc), *gg = gpt_grads(mg, G, &lg);
    float *gg2 = gpt_grads(mg2, G, &lg2);
    int64_t n = tdm_module_parameters(mc)->total, bad = 0, diff2 = 0;
    CHECK(fabsf(lg - lc) <= 1e-5f * fabsf(lc), "gpt loss: cuda %.7g, cpu %.7g", lg, lc);
    for (int64_t i = 0; gc && gg && i < n; i++)
        bad += !(fabsf(gg[i] - gc[i]) <= 1e-5f + 1e-3f * fabsf(gc[i]));
    for (int64_t i = 0; gg && gg2 && i < n; i++) diff2 += gg[i] != gg2[i];
    CHECK(gc && gg && bad == 0, "gpt: %lld of %lld gradients differ from the CPU's", (long long)bad,
          (long long)n);
    CHECK(gg && gg2 && diff2 == 0 && lg == lg2, "gpt: two GPU runs differ in %lld gradients",
          (long long)diff2);
    free(gc), free(gg), free(gg2);
    tdm_module_free(mc), tdm_module_free(mg), tdm_module_free(mg2);
}

/* ---- losses, optimizers ------------------------------------------------------------------ */

static void test_losses(void) {
    int64_t N = 33, C = 10;
    int64_t t[33];
    for (int i = 0; i < N; i++) t[i] = (i * 7) % C;
    t[5] = -100; /* ignored */
    for (int variant = 0; variant < 4; variant++) {
        tdm_scope_begin();
        bool logits = variant != 3, weighted = variant >= 1;
        float smooth = variant == 2 || variant == 3 ? 0.1f : 0.0f;
        twin x = twin_randn(TDM_SHAPE(N, C), 0, 120);
        if (!logits) { /* log-probabilities (the CPU softmax is not in-place) */
            twin lp = twin_empty(TDM_SHAPE(N, C), TDM_F32);
            BOTH("log_softmax", CPU->softmax(lp.c, x.c, true), GPU->softmax(lp.g, x.g, true));
            x = lp;
        }
        twin tg = twin_ints(TDM_SHAPE(N), variant & 1 ? TDM_I32 : TDM_I64, t);
        twin w = twin_randn(TDM_SHAPE(C), 2, 121);
        const tdm_tensor *wc = weighted ? w.c : NULL, *wg = weighted ? w.g : NULL;
        twin loss = twin_empty(TDM_SHAPE(N), TDM_F32), ws = twin_empty(TDM_SHAPE(N), TDM_F32);
        BOTH("cross_entropy", CPU->cross_entropy(loss.c, ws.c, x.c, tg.c, wc, -100, smooth, logits),
             GPU->cross_entropy(loss.g, ws.g, x.g, tg.g, wg, -100, smooth, logits));
        char what[64];
        /* log-sum-exp through different expf: 1e-5 */
        snprintf(what, sizeof what, "cross_entropy variant %d", variant);
        cmp(what, loss, 1e-6, 1e-5);
        cmp("cross_entropy wsum (exact)", ws, 0, 0);
        twin gl = twin_randn(TDM_SHAPE(N), 1, 122), gx = twin_empty(TDM_SHAPE(N, C), TDM_F32);
        BOTH("cross_entropy_backward",
             CPU->cross_entropy_backward(gx.c, gl.c, x.c, tg.c, wc, -100, smooth, logits),
             GPU->cross_entropy_backward(gx.g, gl.g, x.g, tg.g, wg, -100, smooth, logits));
        snprintf(what, sizeof what, "cross_entropy_backward variant %d", variant);
        cmp(what, gx, 1e-6, 1e-5);
        tdm_scope_end();
    }
    tdm_scope_begin();
    int64_t badt[3] = {1, 12, 2};
    twin x = twin_randn(TDM_SHAPE(3, C), 0, 123), tg = twin_ints(TDM_SHAPE(3), TDM_I64, badt);
    twin loss = twin_empty(TDM_SHAPE(3), TDM_F32);
    CHECK_ERROR(GPU->cross_entropy(loss.g, NULL, x.g, tg.g, NULL, -100, 0, true) != TDM_OK,
                "target 12 (sample 1)");
    twin xb = twin_randn(TDM_SHAPE(500), 0, 124), yb = twin_randn(TDM_SHAPE(500), 0.5f, 125);
    twin lb = twin_empty(TDM_SHAPE(500), TDM_F32), gb = twin_empty(TDM_SHAPE(500), TDM_F32);
    twin g = twin_randn(TDM_SHAPE(500), 0, 126);
    BOTH("bce_logits", CPU->bce_logits(lb.c, xb.c, yb.c), GPU->bce_logits(lb.g, xb.g, yb.g));
    BOTH("bce_logits_backward", CPU->bce_logits_backward(gb.c, g.c, xb.c, yb.c),
         GPU->bce_logits_backward(gb.g, g.g, xb.g, yb.g));
    cmp("bce_logits", lb, 1e-6, 1e-5); /* expf/log1pf ulps */
    cmp("bce_logits_backward", gb, 1e-6, 1e-5);
    tdm_scope_end();
}

static void test_optim(void) {
    int64_t n = 3001;
    for (int variant = 0; variant < 4; variant++) {
        tdm_scope_begin();
        twin p = twin_randn(TDM_SHAPE(n), 0, 130), buf = twin_empty(TDM_SHAPE(n), TDM_F32);
        tdm_sgd_hparams h = {
            0.1f,         variant ? 0.9f : 0, 0.1f * (variant == 2), 1e-2f * (variant > 1),
            variant == 3, variant == 1};
        for (int s = 0; s < 3; s++) {
            twin g = twin_randn(TDM_SHAPE(n), 0, 131 + (uint64_t)s);
            BOTH("sgd_step", CPU->sgd_step(p.c, g.c, buf.c, &h, s == 0),
                 GPU->sgd_step(p.g, g.g, buf.g, &h, s == 0));
        }
        /* a few FMAs per element per step: 1e-6 */
        char what[48];
        snprintf(what, sizeof what, "sgd variant %d", variant);
        cmp(what, p, 1e-6, 1e-6);
        tdm_scope_end();
    }
    for (int variant = 0; variant < 4; variant++) {
        tdm_scope_begin();
        twin p = twin_randn(TDM_SHAPE(n), 0, 140);
        twin m = twin_empty(TDM_SHAPE(n), TDM_F32), v = twin_empty(TDM_SHAPE(n), TDM_F32);
        twin vm = twin_empty(TDM_SHAPE(n), TDM_F32);
        tdm_adam_hparams h = {1e-2f,        0.9f,         0.999f,      1e-8f, variant ? 1e-2f : 0,
                              variant == 2, variant == 3, variant == 1};
        for (int s = 1; s <= 3; s++) {
            twin g = twin_randn(TDM_SHAPE(n), 0, 141 + (uint64_t)s);
            BOTH("adam_step", CPU->adam_step(p.c, g.c, m.c, v.c, vm.c, &h, s),
                 GPU->adam_step(p.g, g.g, m.g, v.g, vm.g, &h, s));
        }
        /* Adam divides by sqrt(v) + eps: ~1e-6 relative per step on the update */
        char what[48];
        snprintf(what, sizeof what, "adam variant %d", variant);
        cmp(what, p, 1e-6, 1e-5);
        cmp("adam exp_avg_sq", v, 1e-9, 1e-5);
        tdm_scope_end();
    }
}

/* ---- training equivalence ---------------------------------------------------------------- */

static tdm_module *make_mlp(void) {
    tdm_rng r = tdm_rng_make(1);
    tdm_module *l[4] = {tdm_linear_new(20, 64, true, tdm_cpu(0), &r), tdm_relu_new(),
                        tdm_dropout_new(0.2f, &r), tdm_linear_new(64, 5, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(4, l);
}

static tdm_module *make_cnn(void) {
    tdm_rng r = tdm_rng_make(2);
    tdm_conv2d_opts c = {.pad_h = 1, .pad_w = 1};
    tdm_pool2d_opts p = {.kernel_h = 2, .kernel_w = 2};
    tdm_module *l[6] = {tdm_conv2d_new(1, 8, 3, 3, &c, false, tdm_cpu(0), &r),
                        tdm_batch_norm2d_new(8, 1e-5f, 0.1f, tdm_cpu(0)),
                        tdm_relu_new(),
                        tdm_max_pool2d_new(&p),
                        tdm_flatten_new(1, -1),
                        tdm_linear_new(8 * 6 * 6, 5, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(6, l);
}

/* STEPS steps of m on dev from its current weights; losses written out. Returns the final
 * parameters (flat, on the host; caller frees) or NULL. */
#define STEPS 6
static tdm_optim *make_optim(tdm_paramset *ps, void *adam) {
    return *(bool *)adam
               ? tdm_adam_new(ps, &(tdm_adam_opts){1e-2f, 0.9f, 0.999f, 1e-8f, 0, false, false})
               : tdm_sgd_new(ps, &(tdm_sgd_opts){.lr = 0.05f, .momentum = 0.9f});
}

/* Step s's batch on dev: inputs x [xs], targets t [B] (in the current scope). */
static void make_batch(int s, tdm_shape xs, tdm_device dev, tdm_tensor **x, tdm_tensor **t) {
    int64_t B = xs.d[0], y[64];
    tdm_rng r = tdm_rng_make(500 + (uint64_t)s);
    for (int i = 0; i < B; i++) y[i] = (i * 3 + s) % 5;
    *x = tdm_to_device(tdm_randn(xs, 0.5f, 1, tdm_cpu(0), &r), dev);
    *t = tdm_from_data(TDM_SHAPE(B), TDM_I64, dev, y);
}

static float *train(tdm_module *m, tdm_shape xs, bool adam, float *losses) {
    tdm_device dev = tdm_module_parameters(m)->flat->device;
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *o = make_optim(ps, &adam);
    if (!o) return NULL;
    for (int s = 0; s < STEPS; s++) {
        tdm_optim_zero_grad(o);
        tdm_scope_begin();
        tdm_tensor *x, *t;
        make_batch(s, xs, dev, &x, &t);
        tdm_tensor *l = tdm_cross_entropy(tdm_module_forward(m, x), t, NULL);
        losses[s] = l ? tdm_item(l) : NAN;
        int rc = l ? tdm_backward(l) : -1;
        if (!rc) rc = tdm_optim_step(o);
        tdm_scope_end();
        if (rc) {
            tdm_optim_free(o);
            return NULL;
        }
    }
    float *out = malloc(sizeof(float) * (size_t)ps->total);
    tdm_to_host(ps->flat, out, sizeof(float) * (size_t)ps->total);
    tdm_optim_free(o);
    return out;
}

static void test_training(void) {
    struct {
        const char *name;
        tdm_module *(*make)(void);
        tdm_shape xs;
    } models[] = {{"mlp", make_mlp, TDM_SHAPE(32, 20)},
                  {"cnn", make_cnn, TDM_SHAPE(16, 1, 12, 12)}};
    for (int mi = 0; mi < 2; mi++)
        for (int adam = 0; adam < 2; adam++) {
            tdm_module *mc = models[mi].make(), *mg = tdm_module_clone(mc, G);
            tdm_module *mg2 = tdm_module_clone(mc, G);
            CHECK(mg && mg2, "%s: clone to cuda:0: %s", models[mi].name, tdm_last_error());
            if (!mg || !mg2) continue;
            tdm_module_train(mc, true), tdm_module_train(mg, true), tdm_module_train(mg2, true);
            float lc[STEPS], lg[STEPS], lg2[STEPS];
            float *pc = train(mc, models[mi].xs, adam, lc);
            float *pg = train(mg, models[mi].xs, adam, lg);
            float *pg2 = train(mg2, models[mi].xs, adam, lg2);
            CHECK(pc && pg && pg2, "%s: training failed: %s", models[mi].name, tdm_last_error());
            int64_t n = tdm_module_parameters(mc)->total, bad = 0, diff2 = 0;
            for (int s = 0; s < STEPS && pc && pg; s++)
                CHECK(fabsf(lg[s] - lc[s]) <= 1e-4f + 1e-4f * fabsf(lc[s]),
                      "%s %s step %d loss: cuda %.7g, cpu %.7g", models[mi].name,
                      adam ? "adam" : "sgd", s, lg[s], lc[s]);
            /* six steps compound rounding differences (and Adam divides by small sqrt(v)):
             * 1e-3 relative + 1e-4 absolute on every parameter */
            for (int64_t i = 0; i < n && pc && pg; i++)
                bad += !(fabsf(pg[i] - pc[i]) <= 1e-4f + 1e-3f * fabsf(pc[i]));
            for (int64_t i = 0; i < n && pg && pg2; i++) diff2 += pg[i] != pg2[i];
            CHECK(bad == 0, "%s %s: %lld of %lld parameters differ from the CPU's", models[mi].name,
                  adam ? "adam" : "sgd", (long long)bad, (long long)n);
            CHECK(diff2 == 0, "%s %s: two GPU runs differ in %lld parameters (not deterministic)",
                  models[mi].name, adam ? "adam" : "sgd", (long long)diff2);
            free(pc), free(pg), free(pg2);
            tdm_module_free(mc), tdm_module_free(mg), tdm_module_free(mg2);
        }
}

static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0, (void)arg;
    return tdm_cross_entropy(out, target, NULL);
}

/* DataParallel over n GPUs (NCCL: bucket all-reduces, synchronised batch norm, the wrap-time
 * broadcasts) gives one CPU device's parameters on the same batches, within test_training's
 * bounds, and every replica the same bits. One GPU runs everywhere; two need 2 GPUs (the
 * emulation gives them: EMU_GPUS=2). CPU and GPU replicas mixed are refused. */
static void dp_against_cpu(int n, const char *name, tdm_module *(*make)(void), tdm_shape xs,
                           bool adam) {
    const char *on = adam ? "adam" : "sgd";
    tdm_device gpus[2] = {G, tdm_cuda(1)};
    tdm_module *mc = make(), *mg = tdm_module_clone(mc, G);
    tdm_module_train(mc, true);
    if (mg) tdm_module_train(mg, true); /* before the replicas are cloned from it */
    tdm_dp *dp = mg ? tdm_dp_new(mg, gpus, n, make_optim, &adam) : NULL;
    CHECK(dp, "%s: data_parallel on %d GPU(s): %s", name, n, tdm_last_error());
    if (!dp) {
        tdm_module_free(mc), tdm_module_free(mg);
        return;
    }
    float lc[STEPS];
    float *pc = train(mc, xs, adam, lc);
    for (int s = 0; s < STEPS; s++) {
        tdm_scope_begin();
        tdm_tensor *x, *t;
        make_batch(s, xs, tdm_cpu(0), &x, &t);
        float loss = NAN;
        int rc = tdm_dp_step(dp, x, t, ce_loss, NULL, &loss);
        tdm_scope_end();
        CHECK(rc == TDM_OK, "%s %s on %d GPU(s), step %d: %s", name, on, n, s, tdm_last_error());
        CHECK(fabsf(loss - lc[s]) <= 1e-4f + 1e-4f * fabsf(lc[s]),
              "%s %s step %d loss: %d GPU(s) %.7g, cpu %.7g", name, on, s, n, loss, lc[s]);
    }
    int64_t np = tdm_module_parameters(mc)->total, bad = 0, diff = 0;
    float *p[2] = {malloc(sizeof(float) * (size_t)np), malloc(sizeof(float) * (size_t)np)};
    for (int r = 0; r < n; r++)
        tdm_to_host(tdm_module_parameters(tdm_dp_replica(dp, r))->flat, p[r], sizeof(float) * np);
    for (int64_t i = 0; i < np && pc; i++) {
        bad += !(fabsf(p[0][i] - pc[i]) <= 1e-4f + 1e-3f * fabsf(pc[i]));
        diff += n > 1 && p[0][i] != p[1][i];
    }
    CHECK(pc && bad == 0, "%s %s: %lld of %lld parameters on %d GPU(s) differ from the CPU's", name,
          on, (long long)bad, (long long)np, n);
    CHECK(diff == 0, "%s %s: the replicas differ in %lld parameters", name, on, (long long)diff);
    free(pc), free(p[0]), free(p[1]);
    tdm_dp_free(dp);
    tdm_module_free(mc), tdm_module_free(mg);
}

static void test_data_parallel(void) {
    tdm_module *mix = make_mlp(); /* on cpu:0 */
    bool adam = false;
    tdm_device mixed[2] = {tdm_cpu(0), G};
    CHECK_ERROR(tdm_dp_new(mix, mixed, 2, make_optim, &adam) == NULL, "mix CPU and GPU");
    tdm_module_free(mix);
    if (!tdm_nccl_available()) {
        printf("test_data_parallel: skipped (this build has no NCCL)\n");
        return;
    }
    int most = tdm_cuda_device_count() >= 2 ? 2 : 1;
    if (most < 2) printf("test_data_parallel: 2 GPUs skipped (this machine has 1)\n");
    for (int n = 1; n <= most; n++)
        for (int a = 0; a < 2; a++) {
            dp_against_cpu(n, "mlp", make_mlp, TDM_SHAPE(32, 20), a);
            dp_against_cpu(n, "cnn", make_cnn, TDM_SHAPE(16, 1, 12, 12), a);
        }
}

/* A 2-stage pipeline over cuda:0 and cuda:1 (activations and gradients cross between the
 * GPUs), 4 micro-batches, GPipe and 1F1B: the parameters of unsplit training on the CPU. */
static void test_pipeline(void) {
    if (tdm_cuda_device_count() < 2) {
        printf("test_pipeline: skipped (needs 2 GPUs, this machine has 1)\n");
        return;
    }
    tdm_shape xs = TDM_SHAPE(32, 20);
    bool adam = false;
    for (int sched = 0; sched < 2; sched++) {
        const char *name = sched ? "1F1B" : "GPipe";
        tdm_module *mc = make_mlp(), *mp = make_mlp();
        tdm_module_train(mc, true), tdm_module_train(mp, true);
        float lc[STEPS];
        float *pc = train(mc, xs, adam, lc);
        tdm_pipe_opts o = tdm_pipe_defaults(2, 4);
        o.schedule = (tdm_pipe_schedule)sched;
        o.devices = "cuda:0,cuda:1";
        tdm_pipe *p = tdm_pipe_new(mp, &o, make_optim, &adam);
        CHECK(p, "pipeline %s on cuda:0,cuda:1: %s", name, tdm_last_error());
        for (int s = 0; s < STEPS && p; s++) {
            tdm_scope_begin();
            tdm_tensor *x, *t;
            make_batch(s, xs, tdm_cpu(0), &x, &t);
            float loss = NAN;
            int rc = tdm_pipe_step(p, x, t, ce_loss, NULL, &loss);
            tdm_scope_end();
            CHECK(rc == TDM_OK, "pipeline %s step %d: %s", name, s, tdm_last_error());
            CHECK(fabsf(loss - lc[s]) <= 1e-4f + 1e-4f * fabsf(lc[s]),
                  "pipeline %s step %d loss: GPUs %.7g, cpu %.7g", name, s, loss, lc[s]);
        }
        int64_t n = tdm_module_parameters(mc)->total, bad = 0;
        CHECK(p && tdm_pipe_copy_to(p, mp) == TDM_OK, "pipeline %s: copy_to: %s", name,
              tdm_last_error());
        const float *pp = tdm_data_ptr(tdm_module_parameters(mp)->flat);
        for (int64_t i = 0; i < n && pc && pp; i++)
            bad += !(fabsf(pp[i] - pc[i]) <= 1e-4f + 1e-3f * fabsf(pc[i]));
        CHECK(pc && pp && bad == 0, "pipeline %s: %lld of %lld parameters differ from the CPU's",
              name, (long long)bad, (long long)n);
        free(pc);
        tdm_pipe_free(p);
        tdm_module_free(mc), tdm_module_free(mp);
    }
}

/* The loader on cuda:0 (pinned buffers, asynchronous uploads) delivers the CPU loader's
 * batches bit for bit, the last smaller one included, with 0 and 2 workers over 2 epochs. */
static void test_loader_upload(void) {
    enum { N = 50, ROW = 12, BATCH = 8 };
    float x[N * ROW];
    int64_t y[N];
    for (int i = 0; i < N * ROW; i++) x[i] = (float)(i / ROW) + 0.01f * (float)(i % ROW);
    for (int i = 0; i < N; i++) y[i] = i % 7;
    tdm_dataset *ds = tdm_memory_dataset(TDM_SHAPE(3, 4), N, x, y, 7);
    for (int workers = 0; workers <= 2 && ds; workers += 2) {
        tdm_loader_opts o = tdm_loader_defaults(BATCH);
        o.shuffle = true, o.seed = 3, o.workers = workers;
        tdm_loader *lc = tdm_loader_new(ds, &o);
        o.device = G;
        tdm_loader *lg = tdm_loader_new(ds, &o);
        CHECK(lc && lg, "loader on cuda:0 with %d workers: %s", workers, tdm_last_error());
        for (int epoch = 0; epoch < 2 && lc && lg; epoch++) {
            tdm_loader_start_epoch(lc, epoch), tdm_loader_start_epoch(lg, epoch);
            tdm_batch bc, bg;
            int batches = 0, same = 0;
            while (tdm_loader_next(lc, &bc) == 1 && tdm_loader_next(lg, &bg) == 1) {
                float hx[BATCH * ROW];
                int64_t hy[BATCH];
                size_t nx = sizeof(float) * (size_t)(bc.size * ROW), ny = sizeof(int64_t) * bc.size;
                bool ok = bg.x->device.type == TDM_CUDA && bg.size == bc.size &&
                          !tdm_to_host(bg.x, hx, nx) && !tdm_to_host(bg.y, hy, ny);
                same += ok && !memcmp(hx, tdm_data_ptr(bc.x), nx) &&
                        !memcmp(hy, tdm_data_ptr(bc.y), ny) && !memcmp(bg.y_host, hy, ny);
                batches++;
            }
            CHECK(batches == (N + BATCH - 1) / BATCH && same == batches,
                  "%d workers, epoch %d: %d of %d uploaded batches equal the CPU's", workers, epoch,
                  same, batches);
        }
        tdm_loader_free(lc);
        tdm_loader_free(lg);
    }
    tdm_loader_opts bad = tdm_loader_defaults(BATCH);
    bad.device = tdm_cuda(7);
    CHECK_ERROR(tdm_loader_new(ds, &bad) == NULL, "cuda:7");
    tdm_dataset_free(ds);
}

/* After a warm-up step, training steps take every block from the caching allocator: no
 * cudaMalloc (which would also synchronise the device) in steady state. */
static void test_steady_state(void) {
    tdm_module *c = make_cnn(), *m = tdm_module_clone(c, G);
    tdm_module_free(c);
    CHECK(m != NULL, "clone: %s", tdm_last_error());
    if (!m) return;
    float losses[STEPS];
    float *p = train(m, TDM_SHAPE(16, 1, 12, 12), true, losses); /* warm-up: fills the cache */
    tdm_alloc_stats before = tdm_alloc_stats_get(G);
    float *q = train(m, TDM_SHAPE(16, 1, 12, 12), true, losses);
    tdm_alloc_stats after = tdm_alloc_stats_get(G);
    CHECK(p && q, "steady-state training: %s", tdm_last_error());
    /* the second run makes a new optimizer (its moments are new blocks of sizes already
     * cached, released by the first run's optimizer) and repeats the same steps */
    CHECK(after.sys_allocs == before.sys_allocs,
          "%llu cudaMalloc calls in steady state (expected 0)",
          (unsigned long long)(after.sys_allocs - before.sys_allocs));
    free(p), free(q);
    tdm_module_free(m);
}

/* ---- bad conditions ---------------------------------------------------------------------- */

static void test_errors(void) {
    int n = tdm_cuda_device_count();
    char desc[256];
    CHECK(tdm_device_describe(G, desc, sizeof desc) == TDM_OK && strstr(desc, "GiB"),
          "describe cuda:0: \"%s\" %s", desc, tdm_last_error());
    CHECK_ERROR(tdm_device_describe(tdm_cpu(0), desc, sizeof desc) != TDM_OK, "not a GPU");
    if (n < 8) {
        char msg[64];
        snprintf(msg, sizeof msg, "only %d GPU%s found", n, n == 1 ? "" : "s");
        CHECK_ERROR(tdm_empty(TDM_SHAPE(4), TDM_F32, tdm_cuda(7)) == NULL, msg);
        CHECK_ERROR(tdm_device_describe(tdm_cuda(7), desc, sizeof desc) != TDM_OK, msg);
    }
    /* 2^40 floats = 4 TiB: no GPU holds it; the error names the device and the size */
    CHECK_ERROR(tdm_empty(TDM_SHAPE((int64_t)1 << 40), TDM_F32, G) == NULL, "out of memory");
    tdm_tensor *ok = tdm_ones(TDM_SHAPE(1), TDM_F32, G);
    CHECK(ok && tdm_item(ok) == 1.0f, "cuda:0 still works after an OOM: %s", tdm_last_error());
    tdm_tensor_free(ok);
}

/* ---- --bench: throughput for scripts/gpu-check -------------------------------------------- */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* GFLOP/s of an n x n x n SGEMM through Tandem's backend and through cuBLAS directly. */
static void bench_matmul(int64_t n) {
    tdm_tensor *a = tdm_ones(TDM_SHAPE(1, n, n), TDM_F32, G);
    tdm_tensor *b = tdm_ones(TDM_SHAPE(1, n, n), TDM_F32, G);
    tdm_tensor *c = tdm_zeros(TDM_SHAPE(1, n, n), TDM_F32, G);
    int reps = n >= 4096 ? 20 : 100;
    double flops = 2.0 * (double)n * (double)n * (double)n * reps, t0, tt, tc;
    GPU->matmul(c, a, b, false, false, 0); /* warm-up */
    tdm_cuda_synchronize(0);
    t0 = now_s();
    for (int i = 0; i < reps; i++) GPU->matmul(c, a, b, false, false, 0);
    tdm_cuda_synchronize(0);
    tt = now_s() - t0;
    cublasHandle_t h;
    cublasCreate(&h);
    float *da, *db, *dc, one = 1, zero = 0;
    cudaMalloc((void **)&da, sizeof(float) * (size_t)(n * n));
    cudaMalloc((void **)&db, sizeof(float) * (size_t)(n * n));
    cudaMalloc((void **)&dc, sizeof(float) * (size_t)(n * n));
    cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)n, (int)n, (int)n, &one, da, (int)n, db, (int)n,
                &zero, dc, (int)n);
    cudaDeviceSynchronize();
    t0 = now_s();
    for (int i = 0; i < reps; i++)
        cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)n, (int)n, (int)n, &one, da, (int)n, db,
                    (int)n, &zero, dc, (int)n);
    cudaDeviceSynchronize();
    tc = now_s() - t0;
    printf("matmul %lldx%lldx%lld FP32: tandem %.0f GFLOP/s, cuBLAS %.0f GFLOP/s (%.0f%%)\n",
           (long long)n, (long long)n, (long long)n, flops / tt * 1e-9, flops / tc * 1e-9,
           100.0 * tc / tt);
    cudaFree(da), cudaFree(db), cudaFree(dc);
    cublasDestroy(h);
    tdm_tensor_free(a), tdm_tensor_free(b), tdm_tensor_free(c);
}

static int bench(void) {
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
        printf("device: %s, %.0f GiB\n", prop.name, (double)prop.totalGlobalMem / (1 << 30));
    bench_matmul(1024);
    bench_matmul(4096);
    return 0;
}

int main(int argc, char **argv) {
    if (tdm_cuda_device_count() == 0) {
        printf("SKIP test_cuda: no GPU: %s\n", tdm_cuda_unavailable_reason());
        return 77;
    }
    G = tdm_cuda(0);
    CPU = tdm_backend_for(tdm_cpu(0));
    GPU = tdm_backend_for(G);
    if (!GPU) {
        fprintf(stderr, "test_cuda: %s\n", tdm_last_error());
        return 1;
    }
    if (argc > 1 && !strcmp(argv[1], "--bench")) return bench();
    /* every kernel of backend.h, and the loader's uploads (a GPU is not host memory) */
    CHECK(tdm_backend_check(GPU, true) == TDM_OK, "cuda table: %s", tdm_last_error());
    test_memory();
    test_unary();
    test_binary_axpy();
    test_reduce();
    test_sum_to();
    test_softmax();
    test_matmul();
    test_index();
    test_conv();
    test_pool();
    test_batch_norm();
    test_layer_norm_dropout();
    test_attention();
    test_gpt();
    test_losses();
    test_optim();
    test_training();
    test_data_parallel();
    test_pipeline();
    test_loader_upload();
    test_steady_state();
    test_errors();
    return check_summary();
}
#endif
