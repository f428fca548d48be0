/* The CPU kernels in bf16 and f16 (issue 37) against their fp32 twins.
 *
 * Every case draws its inputs in fp32, rounds them to the dtype under test, and runs the
 * kernel twice through the CPU backend's table: once on low-precision tensors (the mix a
 * mixed-precision step hands it: activations bf16 or f16, parameters, statistics and losses
 * f32 where the ops will keep them so) and once on f32 tensors holding the same rounded
 * values. The two outputs are then compared element-wise.
 *
 * The bound. Both runs compute in fp32 on the same values (bf16 and f16 widen exactly), so
 * the low-precision output differs from its twin only by its own rounding to nearest: at
 * most 2^-8 of the value in bf16 (8 significant bits), 2^-11 in f16 (11), 0 for an output
 * the caller made f32; plus half the smallest subnormal where a value is that small (2^-25 in
 * f16). Matmul through the bf16 GEMM, which sums in another order, adds the reduction-order
 * slack test_gemm_bf16 states: (2k + 8) 2^-24 of sum |a| |b|, computed per element; bf16
 * attention, which also rounds its probabilities, has its own (attention_slack). Indices (argmax,
 * max pooling's) must be equal. A second CTest entry runs the whole file with
 * ONEDNN_MAX_CPU_ISA=AVX512_CORE, where the bf16 GEMM converts to fp32.
 */
#include <stdint.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_conv_bf16.h"
#include "backend/cpu/cpu_gemm_bf16.h"
#include "attention_slack.h"
#include "check.h"
#include "tandem/half.h"

static const tdm_backend *BE;
static tdm_device D;
static tdm_dtype DT; /* the dtype under test: TDM_BF16 or TDM_F16 */

static uint32_t rng_state = 12345;
static float uniform(float a, float b) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return a + (b - a) * (float)(rng_state >> 8) * 0x1p-24f;
}

/* v rounded to dt's nearest value (as a float). */
static float round_to(float v, tdm_dtype dt) {
    if (dt == TDM_BF16) return tdm_bf16_to_float(tdm_bf16_from_float(v));
    if (dt == TDM_F16) return tdm_f16_to_float(tdm_f16_from_float(v));
    return v;
}

/* A tensor of dtype dt holding n floats (already dt's values). */
static tdm_tensor *make(tdm_shape s, tdm_dtype dt, const float *v) {
    int64_t n = tdm_shape_numel(s);
    if (dt == TDM_F32) return tdm_from_data(s, TDM_F32, D, v);
    uint16_t *h = malloc((size_t)(n ? n : 1) * sizeof *h);
    if (dt == TDM_BF16)
        tdm_bf16_from_f32(h, v, (size_t)n);
    else
        tdm_f16_from_f32(h, v, (size_t)n);
    tdm_tensor *t = tdm_from_data(s, dt, D, h);
    free(h);
    return t;
}

/* t's elements as floats, row-major (caller frees). */
static float *values(const tdm_tensor *t) {
    int64_t n = tdm_numel(t);
    float *f = malloc((size_t)(n ? n : 1) * sizeof *f);
    if (t->dtype == TDM_F32) {
        tdm_to_host(t, f, (size_t)n * sizeof *f);
        return f;
    }
    uint16_t *h = malloc((size_t)(n ? n : 1) * sizeof *h);
    tdm_to_host(t, h, (size_t)n * sizeof *h);
    if (t->dtype == TDM_BF16)
        tdm_bf16_to_f32(f, h, (size_t)n);
    else
        tdm_f16_to_f32(f, h, (size_t)n);
    free(h);
    return f;
}

/* A tensor as the low-precision run sees it (lo, dtype as asked) and its f32 twin (f). */
typedef struct {
    tdm_tensor *lo, *f;
    bool guarded; /* followed in storage by GUARD elements no kernel may write */
} pair;

#define GUARD    64
#define SENTINEL 1280.0f /* a value no kernel writes here, exact in bf16 and f16 */

/* Values drawn in [a, b), rounded to dt: lo of dtype dt, f the same values in f32. */
static pair draw(tdm_shape s, tdm_dtype dt, float a, float b) {
    int64_t n = tdm_shape_numel(s);
    float *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    for (int64_t i = 0; i < n; i++) v[i] = round_to(uniform(a, b), dt);
    pair p = {make(s, dt, v), make(s, TDM_F32, v), false};
    free(v);
    return p;
}

/* An output: lo of dtype dt, f in f32, both filled with SENTINEL (so that an element left
 * unwritten shows) and followed by GUARD more (so that a write past the end shows). */
static pair output(tdm_shape s, tdm_dtype dt) {
    int64_t n = tdm_shape_numel(s), st[TDM_MAX_DIMS];
    tdm_contiguous_strides(s.ndim, s.d, st);
    tdm_tensor *bl = tdm_full(TDM_SHAPE(n + GUARD), SENTINEL, dt, D);
    tdm_tensor *bf = tdm_full(TDM_SHAPE(n + GUARD), SENTINEL, TDM_F32, D);
    pair p = {tdm_tensor_view(bl, s.ndim, s.d, st, 0), tdm_tensor_view(bf, s.ndim, s.d, st, 0),
              true};
    return p;
}

/* The f32 twin of an existing low-precision tensor (its values exactly). */
static pair twin(tdm_tensor *lo) {
    float *v = values(lo);
    pair p = {lo, make(tdm_shape_of(lo), TDM_F32, v), false};
    free(v);
    return p;
}

/* A view of t's storage with the given geometry (the same for a pair's two tensors). */
static tdm_tensor *view(tdm_tensor *t, int ndim, const int64_t *shape, const int64_t *strides) {
    return tdm_tensor_view(t, ndim, shape, strides, t->offset);
}

/* One rounding to dt's nearest, and the half subnormal below which that is absolute. */
static double unit(tdm_dtype dt) {
    return dt == TDM_BF16 ? 0x1p-8 : dt == TDM_F16 ? 0x1p-11 : 0;
}
static double tiny(tdm_dtype dt) {
    return dt == TDM_BF16 ? 0x1p-134 : dt == TDM_F16 ? 0x1p-25 : 0;
}

/* p.lo against p.f within one rounding of p.lo's dtype plus slack[i] (NULL: none). */
static void expect(const char *what, pair p, const double *slack) {
    int64_t n = tdm_numel(p.f);
    float *g = values(p.lo), *r = values(p.f);
    double u = unit(p.lo->dtype), t = tiny(p.lo->dtype);
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        double bound = u * fabs((double)r[i]) + t + (slack ? slack[i] : 0);
        bool same_nan = isnan(g[i]) && isnan(r[i]);
        if (!same_nan && !(fabs((double)g[i] - r[i]) <= bound)) {
            if (bad < 4)
                fprintf(stderr, "FAIL %s (%s): element %lld = %.9g, fp32 twin %.9g (bound %.3g)\n",
                        what, tdm_dtype_name(p.lo->dtype), (long long)i, g[i], r[i], bound);
            bad++;
        }
    }
    CHECK(bad == 0, "%s in %s: %d of %lld elements outside the bound", what, tdm_dtype_name(DT),
          bad, (long long)n);
    free(g);
    free(r);
    if (p.guarded) {
        tdm_tensor *gv = tdm_tensor_view(p.lo, 1, (int64_t[]){GUARD}, (int64_t[]){1}, n);
        float *gf = values(gv);
        int spoilt = 0;
        for (int i = 0; i < GUARD; i++) spoilt += gf[i] != SENTINEL;
        CHECK(spoilt == 0, "%s in %s: %d elements past the output written", what,
              tdm_dtype_name(DT), spoilt);
        free(gf);
    }
}

/* Two integer tensors equal element for element (indices). */
static void expect_same_ints(const char *what, const tdm_tensor *a, const tdm_tensor *b) {
    size_t bytes = (size_t)tdm_numel(a) * tdm_dtype_size(a->dtype);
    char *ha = malloc(bytes + 1), *hb = malloc(bytes + 1);
    tdm_to_host(a, ha, bytes);
    tdm_to_host(b, hb, bytes);
    CHECK(memcmp(ha, hb, bytes) == 0, "%s in %s: indices differ", what, tdm_dtype_name(DT));
    free(ha);
    free(hb);
}

/* Both runs succeeded. */
#define RUN2(lo_call, f_call)                                                                      \
    do {                                                                                           \
        int rl_ = (lo_call);                                                                       \
        CHECK(rl_ == 0, "%s: %s", #lo_call, tdm_last_error());                                     \
        int rf_ = (f_call);                                                                        \
        CHECK(rf_ == 0, "%s: %s", #f_call, tdm_last_error());                                      \
    } while (0)

/* ---- element-wise ----------------------------------------------------------------------- */

static const char *unary_name(tdm_unary_op op) {
    static const char *names[] = {"neg",        "exp",        "log",     "sqrt",    "relu",
                                  "gelu_tanh",  "gelu_erf",   "tanh",    "sigmoid", "add_scalar",
                                  "mul_scalar", "pow_scalar", "softsign"};
    _Static_assert(sizeof names / sizeof *names == TDM_UN_LAST + 1, "a name per unary op");
    return names[op];
}

/* Every unary op forward and backward, x contiguous and transposed (strided), y in the
 * dtype under test and (mixed) in f32. */
static void test_unary(void) {
    for (int op = 0; op <= TDM_UN_LAST; op++) {
        bool pos = op == TDM_UN_LOG || op == TDM_UN_SQRT || op == TDM_UN_POW_SCALAR;
        float s = op == TDM_UN_POW_SCALAR ? 1.5f : 0.75f;
        /* 0: contiguous, 1: transposed, 2: a row longer than the element-wise kernels'
         * chunk (cpu_elementwise.c's LP_CHUNK, 512), ending in a partial chunk */
        for (int strided = 0; strided < 3; strided++) {
            tdm_scope_begin();
            tdm_shape xs = strided == 2 ? TDM_SHAPE(3, 1100) : TDM_SHAPE(7, 33);
            pair x = draw(xs, DT, pos ? 0.25f : -3.0f, 3.0f);
            if (strided == 1) { /* x^T: [33, 7] with strides [1, 33] */
                int64_t sh[2] = {33, 7}, st[2] = {1, 33};
                x.lo = view(x.lo, 2, sh, st);
                x.f = view(x.f, 2, sh, st);
            }
            char what[64];
            snprintf(what, sizeof what, "unary %s%s", unary_name(op),
                     strided == 1 ? " strided"
                     : strided    ? " long"
                                  : "");
            pair y = output(tdm_shape_of(x.f), DT), y32 = output(tdm_shape_of(x.f), TDM_F32);
            RUN2(BE->unary(op, y.lo, x.lo, s), BE->unary(op, y.f, x.f, s));
            RUN2(BE->unary(op, y32.lo, x.lo, s), BE->unary(op, y32.f, x.f, s));
            expect(what, y, NULL);
            expect(what, y32, NULL); /* f32 out: no rounding at all */
            /* backward from the low-precision forward's y, the twin reading the same values */
            pair yy = twin(y.lo), gy = draw(tdm_shape_of(x.f), DT, -2.0f, 2.0f);
            pair gx = output(tdm_shape_of(x.f), DT);
            RUN2(BE->unary_backward(op, gx.lo, gy.lo, x.lo, yy.lo, s),
                 BE->unary_backward(op, gx.f, gy.f, x.f, yy.f, s));
            snprintf(what, sizeof what, "unary_backward %s%s", unary_name(op),
                     strided == 1 ? " strided"
                     : strided    ? " long"
                                  : "");
            expect(what, gx, NULL);
            tdm_scope_end();
        }
    }
}

/* The four binary ops on same-shape, row-broadcast and column-broadcast operands, in the
 * dtype under test and in the mixes of PyTorch's type promotion. */
static void test_binary(void) {
    const tdm_dtype mixes[][3] = {/* y, a, b */
                                  {DT, DT, DT},
                                  {TDM_F32, DT, TDM_F32},
                                  {TDM_F32, TDM_F32, DT},
                                  {TDM_F32, DT, DT},
                                  {DT, TDM_F32, DT}};
    for (int op = TDM_BIN_ADD; op <= TDM_BIN_DIV; op++)
        for (int m = 0; m < 5; m++)
            for (int bc = 0; bc < 6; bc++) { /* bc 3..5: the same, rows past one chunk */
                tdm_scope_begin();
                const int64_t R = 6, L = bc < 3 ? 19 : 1111;
                pair a = draw(TDM_SHAPE(R, L), mixes[m][1], -3.0f, 3.0f);
                /* b is [6, 19], [19] expanded (row stride 0) or [6, 1] expanded (inner 0);
                 * kept away from 0 for the division */
                tdm_shape bs = bc % 3 == 0   ? TDM_SHAPE(R, L)
                               : bc % 3 == 1 ? TDM_SHAPE(L)
                                             : TDM_SHAPE(R);
                pair b = draw(bs, mixes[m][2], 0.5f, 3.0f);
                if (bc % 3) {
                    int64_t sh[2] = {R, L}, st[2] = {bc % 3 == 1 ? 0 : 1, bc % 3 == 1 ? 1 : 0};
                    b.lo = view(b.lo, 2, sh, st);
                    b.f = view(b.f, 2, sh, st);
                }
                pair y = output(TDM_SHAPE(R, L), mixes[m][0]);
                RUN2(BE->binary(op, y.lo, a.lo, b.lo), BE->binary(op, y.f, a.f, b.f));
                char what[64];
                snprintf(what, sizeof what, "binary %d (y %s, a %s, b %s, broadcast %d)", op,
                         tdm_dtype_name(mixes[m][0]), tdm_dtype_name(mixes[m][1]),
                         tdm_dtype_name(mixes[m][2]), bc);
                expect(what, y, NULL);
                tdm_scope_end();
            }
}

/* y += alpha x: y read and written (gradient accumulation), in both dtypes and a mix. */
static void test_axpy(void) {
    const tdm_dtype mixes[][2] = {{DT, DT}, {TDM_F32, DT}, {DT, TDM_F32}};
    for (int m = 0; m < 3; m++) {
        tdm_scope_begin();
        pair y = draw(TDM_SHAPE(5, 241), mixes[m][0], -2.0f, 2.0f); /* 1205: 3 chunks */
        pair x = draw(TDM_SHAPE(5, 241), mixes[m][1], -2.0f, 2.0f);
        RUN2(BE->axpy(y.lo, 0.5f, x.lo), BE->axpy(y.f, 0.5f, x.f));
        expect("axpy", y, NULL);
        tdm_scope_end();
    }
}

/* ---- reductions ------------------------------------------------------------------------- */

static void test_reduce(void) {
    for (int op = TDM_RED_SUM; op <= TDM_RED_MAX; op++)
        for (int dim = 0; dim < 3; dim++) {
            tdm_scope_begin();
            pair x = draw(TDM_SHAPE(4, 9, 6), DT, -3.0f, 3.0f);
            tdm_shape ys = tdm_shape_of(x.f);
            ys.d[dim] = 1;
            pair y = output(ys, DT);
            tdm_tensor *am_lo = tdm_zeros(ys, TDM_I64, D), *am_f = tdm_zeros(ys, TDM_I64, D);
            bool mx = op == TDM_RED_MAX;
            RUN2(BE->reduce(op, y.lo, x.lo, dim, mx ? am_lo : NULL),
                 BE->reduce(op, y.f, x.f, dim, mx ? am_f : NULL));
            expect("reduce", y, NULL);
            if (mx) {
                expect_same_ints("reduce max's argmax", am_lo, am_f);
                pair gy = draw(ys, DT, -2.0f, 2.0f), gx = output(tdm_shape_of(x.f), DT);
                RUN2(BE->max_backward(gx.lo, gy.lo, am_lo, dim),
                     BE->max_backward(gx.f, gy.f, am_f, dim));
                expect("max_backward", gx, NULL);
            }
            tdm_scope_end();
        }
    /* sum_to: [5, 12] down to [1, 12], [5, 1] and [12] */
    tdm_shape targets[] = {TDM_SHAPE(1, 12), TDM_SHAPE(5, 1), TDM_SHAPE(12)};
    for (int i = 0; i < 3; i++) {
        tdm_scope_begin();
        pair x = draw(TDM_SHAPE(5, 12), DT, -2.0f, 2.0f), y = output(targets[i], DT);
        RUN2(BE->sum_to(y.lo, x.lo), BE->sum_to(y.f, x.f));
        expect("sum_to", y, NULL);
        tdm_scope_end();
    }
}

static void test_softmax(void) {
    for (int lg = 0; lg < 2; lg++) {
        tdm_scope_begin();
        pair x = draw(TDM_SHAPE(5, 37), DT, -4.0f, 4.0f), y = output(TDM_SHAPE(5, 37), DT);
        RUN2(BE->softmax(y.lo, x.lo, lg), BE->softmax(y.f, x.f, lg));
        expect(lg ? "log_softmax" : "softmax", y, NULL);
        pair yy = twin(y.lo), gy = draw(TDM_SHAPE(5, 37), DT, -1.0f, 1.0f);
        pair gx = output(TDM_SHAPE(5, 37), DT);
        RUN2(BE->softmax_backward(gx.lo, gy.lo, yy.lo, lg),
             BE->softmax_backward(gx.f, gy.f, yy.f, lg));
        expect(lg ? "log_softmax_backward" : "softmax_backward", gx, NULL);
        tdm_scope_end();
    }
}

/* The clipping norm's sum, of a strided gradient (short rows, then rows past the kernel's
 * conversion chunk) and of a long contiguous one (odd): the same double from the same
 * values. */
static void test_sum_squares(void) {
    for (int strided = 0; strided < 3; strided++) {
        tdm_scope_begin();
        int64_t r = strided == 2 ? 601 : 9, c = strided == 2 ? 3 : 14; /* x^T: [c, r] */
        pair x = draw(strided ? TDM_SHAPE(r, c) : TDM_SHAPE(3, 701), DT, -3.0f, 3.0f);
        if (strided) {
            int64_t sh[2] = {c, r}, st[2] = {1, c};
            x.lo = view(x.lo, 2, sh, st);
            x.f = view(x.f, 2, sh, st);
        }
        double s_lo = -1, s_f = -2;
        RUN2(BE->sum_squares(&s_lo, x.lo), BE->sum_squares(&s_f, x.f));
        CHECK(s_lo == s_f, "sum_squares in %s (strided %d): %.17g, fp32 twin %.17g",
              tdm_dtype_name(DT), strided, s_lo, s_f);
        tdm_scope_end();
    }
}

/* ---- matrix products -------------------------------------------------------------------- */

/* c [B, n, m] = op(a) @ op(b) + beta c with b broadcast over the batch (stride 0): every
 * transpose, beta 0 and 1, c in the dtype under test and in f32. In bf16 this is the bf16
 * GEMM (another summation order: slack per element); in f16 the widening adapter. */
static void test_matmul(void) {
    const int64_t B = 2, n = 5, m = 7, k = 67;
    for (int t = 0; t < 4; t++)
        for (int cf = 0; cf < 2; cf++)
            for (int bt = 0; bt < 2; bt++) {
                bool ta = t & 1, tb = t & 2;
                float beta = (float)bt;
                tdm_dtype cdt = cf ? TDM_F32 : DT;
                tdm_scope_begin();
                pair a = draw(ta ? TDM_SHAPE(B, k, n) : TDM_SHAPE(B, n, k), DT, -2.0f, 2.0f);
                tdm_shape b1 = tb ? TDM_SHAPE(1, m, k) : TDM_SHAPE(1, k, m);
                pair b = draw(b1, DT, -2.0f, 2.0f);
                int64_t bsh[3] = {B, b1.d[1], b1.d[2]}, bst[3] = {0, b1.d[2], 1};
                b.lo = view(b.lo, 3, bsh, bst);
                b.f = view(b.f, 3, bsh, bst);
                pair c = draw(TDM_SHAPE(B, n, m), cdt, -2.0f, 2.0f);
                float *c0 = values(c.f), *av = values(a.f), *bv = values(b.f);
                RUN2(BE->matmul(c.lo, a.lo, b.lo, ta, tb, beta),
                     BE->matmul(c.f, a.f, b.f, ta, tb, beta));
                /* slack: (2k + 8) 2^-24 (sum_j |a_ij b_jl| + |beta c0|), then rounded */
                double *slack = malloc((size_t)(B * n * m) * sizeof *slack);
                for (int64_t bi = 0; bi < B; bi++)
                    for (int64_t i = 0; i < n; i++)
                        for (int64_t l = 0; l < m; l++) {
                            double s = 0;
                            for (int64_t j = 0; j < k; j++) {
                                double x = ta ? av[(bi * k + j) * n + i] : av[(bi * n + i) * k + j];
                                double y = tb ? bv[(bi * m + l) * k + j] : bv[(bi * k + j) * m + l];
                                s += fabs(x * y);
                            }
                            int64_t e = (bi * n + i) * m + l;
                            s += fabs(beta * c0[e]);
                            slack[e] = (2.0 * k + 8) * 0x1p-24 * s * (1 + unit(cdt));
                        }
                char what[64];
                snprintf(what, sizeof what, "matmul ta %d tb %d beta %g c %s", ta, tb, beta,
                         tdm_dtype_name(cdt));
                expect(what, c, slack);
                free(slack);
                free(c0);
                free(av);
                free(bv);
                tdm_scope_end();
            }
    if (DT == TDM_BF16) printf("bf16 matmul ran: %s\n", tdm_cpu_gemm_bf16_impl());
    /* a low-precision operand with an f32 one (widened: the fp32 GEMM on the same values) */
    for (int which = 0; which < 2; which++) {
        tdm_scope_begin();
        pair a = draw(TDM_SHAPE(1, n, k), which ? TDM_F32 : DT, -2.0f, 2.0f);
        pair b = draw(TDM_SHAPE(1, k, m), which ? DT : TDM_F32, -2.0f, 2.0f);
        pair c = output(TDM_SHAPE(1, n, m), which ? DT : TDM_F32);
        RUN2(BE->matmul(c.lo, a.lo, b.lo, false, false, 0.0f),
             BE->matmul(c.f, a.f, b.f, false, false, 0.0f));
        expect(which ? "matmul f32 a, low b" : "matmul low a, f32 b", c, NULL);
        tdm_scope_end();
    }
}

/* ---- indexing --------------------------------------------------------------------------- */

static void test_index(void) {
    tdm_scope_begin();
    int64_t iv[5] = {3, 0, 3, 6, 1};
    tdm_tensor *idx = i64(TDM_SHAPE(5), iv);
    for (int mix = 0; mix < 2; mix++) { /* y like x (bytes copied), then bf16 x into f32 y */
        pair x = draw(TDM_SHAPE(7, 10), DT, -3.0f, 3.0f);
        pair y = output(TDM_SHAPE(5, 10), mix ? TDM_F32 : DT);
        RUN2(BE->index_select(y.lo, x.lo, 0, idx), BE->index_select(y.f, x.f, 0, idx));
        expect("index_select", y, NULL);
    }
    pair gx = draw(TDM_SHAPE(7, 10), DT, -1.0f, 1.0f), gy = draw(TDM_SHAPE(5, 10), DT, -1.0f, 1.0f);
    RUN2(BE->index_add(gx.lo, 0, idx, gy.lo), BE->index_add(gx.f, 0, idx, gy.f));
    expect("index_add", gx, NULL);
    tdm_scope_end();
}

/* ---- convolution and pooling ------------------------------------------------------------ */

/* |v| of an f32 tensor, as a new f32 tensor on D. */
static tdm_tensor *absolute(const tdm_tensor *t) {
    float *v = values(t);
    for (int64_t i = 0; i < tdm_numel(t); i++) v[i] = fabsf(v[i]);
    tdm_tensor *r = make(tdm_shape_of(t), TDM_F32, v);
    free(v);
    return r;
}

/* terms * 2^-24 * (2 k + 8) of each element of m (the f32 kernel on |inputs|: the sum of its
 * terms' magnitudes), the slack of another summation order of k terms (as the bf16 GEMM's). */
static double *order_slack(const tdm_tensor *m, int64_t k) {
    float *v = values(m);
    double *s = malloc(sizeof(double) * (size_t)(tdm_numel(m) + 1));
    for (int64_t i = 0; i < tdm_numel(m); i++) s[i] = (2.0 * (double)k + 8) * 0x1p-24 * v[i];
    free(v);
    return s;
}

/* Convolution: in bf16 through oneDNN's bf16 kernels where this CPU has them
 * (cpu_conv_bf16.c), else through f32 copies; either way against the f32 twin within one
 * rounding of each output and another summation order (order_slack, from the f32 kernel on
 * the inputs' magnitudes). Geometries: stride (1, 2) with padding (1, 0) (a last column no
 * window reaches: oneDNN's right padding is negative), a padded 3x3, a 1x1 of stride 2 (a
 * ResNet's shortcut, also a negative right padding) and 2 groups. */
static void test_conv2d(void) {
    struct {
        int64_t n, c, h, w, o, k;
        tdm_conv2d_args a;
    } cases[] = {{2, 3, 9, 8, 4, 3, {1, 2, 1, 0, 1, 1, 1}},
                 {2, 8, 6, 6, 16, 3, {1, 1, 1, 1, 1, 1, 1}},
                 {2, 8, 8, 8, 4, 1, {2, 2, 0, 0, 1, 1, 1}},
                 {1, 8, 5, 7, 6, 3, {1, 1, 1, 1, 1, 1, 2}}};
    bool native = !strncmp(tdm_cpu_gemm_bf16_impl(), "oneDNN", 6); /* test_matmul ran first */
    for (int ci = 0; ci < 4; ci++)
        for (int bias = 0; bias < 2; bias++) {
            tdm_conv2d_args *a = &cases[ci].a;
            int64_t n = cases[ci].n, c = cases[ci].c, o = cases[ci].o, k = cases[ci].k;
            int64_t ho = (cases[ci].h + 2 * a->pad_h - k) / a->stride_h + 1;
            int64_t wo = (cases[ci].w + 2 * a->pad_w - k) / a->stride_w + 1;
            tdm_scope_begin();
            pair x = draw(TDM_SHAPE(n, c, cases[ci].h, cases[ci].w), DT, -2.0f, 2.0f);
            pair w = draw(TDM_SHAPE(o, c / a->groups, k, k), DT, -1.0f, 1.0f);
            pair b = bias ? draw(TDM_SHAPE(o), DT, -1.0f, 1.0f) : (pair){NULL, NULL, false};
            tdm_shape ys = TDM_SHAPE(n, o, ho, wo);
            pair y = output(ys, DT), gy = draw(ys, DT, -1.0f, 1.0f);
            tdm_tensor *ax = absolute(x.f), *aw = absolute(w.f), *ab = b.f ? absolute(b.f) : NULL;
            tdm_tensor *agy = absolute(gy.f), *my = tdm_zeros(ys, TDM_F32, D);
            tdm_tensor *mgx = tdm_zeros(tdm_shape_of(x.f), TDM_F32, D);
            tdm_tensor *mgw = tdm_zeros(tdm_shape_of(w.f), TDM_F32, D);
            tdm_tensor *mgb = tdm_zeros(TDM_SHAPE(o), TDM_F32, D);
            CHECK(BE->conv2d(my, ax, aw, ab, a) == TDM_OK &&
                      BE->conv2d_backward(mgx, mgw, mgb, agy, ax, aw, a) == TDM_OK,
                  "conv2d on the magnitudes: %s", tdm_last_error());
            RUN2(BE->conv2d(y.lo, x.lo, w.lo, b.lo, a), BE->conv2d(y.f, x.f, w.f, b.f, a));
            const char *impl = tdm_cpu_conv2d_bf16_impl();
            if (DT == TDM_BF16 && bias)
                printf("bf16 conv2d case %d ran: %s\n", ci, impl[0] ? impl : "f32 copies");
            /* every case is oneDNN's where it has bf16 kernels */
            CHECK(!(native && DT == TDM_BF16) || !strncmp(impl, "oneDNN", 6),
                  "conv2d case %d in bf16 with oneDNN's bf16 GEMM here ran '%s'", ci, impl);
            double *sy = order_slack(my, c / a->groups * k * k + 1);
            expect("conv2d", y, sy);
            pair gx = output(tdm_shape_of(x.f), DT), gw = output(tdm_shape_of(w.f), TDM_F32);
            pair gb = output(TDM_SHAPE(o), DT);
            RUN2(BE->conv2d_backward(gx.lo, gw.lo, gb.lo, gy.lo, x.lo, w.lo, a),
                 BE->conv2d_backward(gx.f, gw.f, gb.f, gy.f, x.f, w.f, a));
            double *sx = order_slack(mgx, o / a->groups * k * k),
                   *sw = order_slack(mgw, n * ho * wo);
            double *sb = order_slack(mgb, n * ho * wo);
            expect("conv2d_backward gx", gx, sx);
            expect("conv2d_backward gw", gw, sw);
            expect("conv2d_backward gb", gb, sb);
            free(sy), free(sx), free(sw), free(sb);
            tdm_scope_end();
        }
}

static void test_pool2d(void) {
    tdm_pool2d_args a = {3, 3, 2, 2, 1, 1, 1, 1, false, true}; /* 3x3, stride 2, pad 1 */
    tdm_scope_begin();
    pair x = draw(TDM_SHAPE(2, 3, 9, 8), DT, -3.0f, 3.0f);
    tdm_shape ys = TDM_SHAPE(2, 3, 5, 4);
    pair y = output(ys, DT), gy = draw(ys, DT, -1.0f, 1.0f);
    tdm_tensor *i_lo = tdm_zeros(ys, TDM_I32, D), *i_f = tdm_zeros(ys, TDM_I32, D);
    RUN2(BE->max_pool2d(y.lo, i_lo, x.lo, &a), BE->max_pool2d(y.f, i_f, x.f, &a));
    expect("max_pool2d", y, NULL);
    expect_same_ints("max_pool2d's indices", i_lo, i_f);
    pair gx = output(tdm_shape_of(x.f), DT);
    RUN2(BE->max_pool2d_backward(gx.lo, gy.lo, i_lo), BE->max_pool2d_backward(gx.f, gy.f, i_f));
    expect("max_pool2d_backward", gx, NULL);
    pair ya = output(ys, DT), gxa = output(tdm_shape_of(x.f), DT);
    RUN2(BE->avg_pool2d(ya.lo, x.lo, &a), BE->avg_pool2d(ya.f, x.f, &a));
    expect("avg_pool2d", ya, NULL);
    RUN2(BE->avg_pool2d_backward(gxa.lo, gy.lo, &a), BE->avg_pool2d_backward(gxa.f, gy.f, &a));
    expect("avg_pool2d_backward", gxa, NULL);
    tdm_scope_end();
}

/* ---- normalisation ---------------------------------------------------------------------- */

/* x, y and gx low precision; weights, statistics and running buffers f32, as the ops keep
 * them. */
static void test_batch_norm(void) {
    const int64_t C = 5;
    tdm_shape xs = TDM_SHAPE(4, C, 3, 2), cs = TDM_SHAPE(C);
    for (int training = 0; training < 2; training++) {
        tdm_scope_begin();
        pair x = draw(xs, DT, -2.0f, 3.0f), w = draw(cs, TDM_F32, 0.5f, 1.5f);
        pair b = draw(cs, TDM_F32, -0.5f, 0.5f), rm = draw(cs, TDM_F32, -0.2f, 0.2f);
        pair rv = draw(cs, TDM_F32, 0.5f, 1.5f), y = output(xs, DT);
        pair sm = output(cs, TDM_F32), si = output(cs, TDM_F32);
        RUN2(BE->batch_norm(y.lo, sm.lo, si.lo, x.lo, w.lo, b.lo, rm.lo, rv.lo, training, 0.1f,
                            1e-5f),
             BE->batch_norm(y.f, sm.f, si.f, x.f, w.f, b.f, rm.f, rv.f, training, 0.1f, 1e-5f));
        expect("batch_norm y", y, NULL);
        expect("batch_norm save_mean", sm, NULL);
        expect("batch_norm save_invstd", si, NULL);
        expect("batch_norm running_var", rv, NULL);
        pair gy = draw(xs, DT, -1.0f, 1.0f), gx = output(xs, DT);
        pair gw = output(cs, TDM_F32), gb = output(cs, TDM_F32);
        RUN2(
            BE->batch_norm_backward(gx.lo, gw.lo, gb.lo, gy.lo, x.lo, w.lo, sm.lo, si.lo, training),
            BE->batch_norm_backward(gx.f, gw.f, gb.f, gy.f, x.f, w.f, sm.f, si.f, training));
        expect("batch_norm_backward gx", gx, NULL);
        expect("batch_norm_backward gw", gw, NULL);
        expect("batch_norm_backward gb", gb, NULL);
        tdm_scope_end();
    }
    /* SyncBN's three kernels */
    tdm_scope_begin();
    pair x = draw(xs, DT, -2.0f, 3.0f), gy = draw(xs, DT, -1.0f, 1.0f);
    pair mean = draw(cs, TDM_F32, -0.5f, 0.5f), inv = draw(cs, TDM_F32, 0.5f, 1.5f);
    pair w = draw(cs, TDM_F32, 0.5f, 1.5f), s1 = output(cs, TDM_F32), s2 = output(cs, TDM_F32);
    RUN2(BE->batch_norm_stats(s1.lo, x.lo, NULL), BE->batch_norm_stats(s1.f, x.f, NULL));
    RUN2(BE->batch_norm_stats(s2.lo, x.lo, mean.lo), BE->batch_norm_stats(s2.f, x.f, mean.f));
    expect("batch_norm_stats sum", s1, NULL);
    expect("batch_norm_stats centred", s2, NULL);
    pair sd = output(cs, TDM_F32), sdx = output(cs, TDM_F32);
    pair gw = output(cs, TDM_F32), gb = output(cs, TDM_F32);
    RUN2(BE->batch_norm_backward_reduce(sd.lo, sdx.lo, gw.lo, gb.lo, gy.lo, x.lo, mean.lo, inv.lo),
         BE->batch_norm_backward_reduce(sd.f, sdx.f, gw.f, gb.f, gy.f, x.f, mean.f, inv.f));
    expect("batch_norm_backward_reduce sum_dy", sd, NULL);
    expect("batch_norm_backward_reduce sum_dy_xmu", sdx, NULL);
    expect("batch_norm_backward_reduce gw", gw, NULL);
    pair gx = output(xs, DT);
    RUN2(BE->batch_norm_backward_elemt(gx.lo, gy.lo, x.lo, w.lo, mean.lo, inv.lo, sd.lo, sdx.lo,
                                       96.0),
         BE->batch_norm_backward_elemt(gx.f, gy.f, x.f, w.f, mean.f, inv.f, sd.f, sdx.f, 96.0));
    expect("batch_norm_backward_elemt", gx, NULL);
    tdm_scope_end();
}

static void test_layer_norm(void) {
    tdm_scope_begin();
    tdm_shape xs = TDM_SHAPE(6, 48), rs = TDM_SHAPE(6), cs = TDM_SHAPE(48);
    pair x = draw(xs, DT, -2.0f, 3.0f), w = draw(cs, TDM_F32, 0.5f, 1.5f);
    pair b = draw(cs, TDM_F32, -0.5f, 0.5f), y = output(xs, DT);
    pair mean = output(rs, TDM_F32), rstd = output(rs, TDM_F32);
    RUN2(BE->layer_norm(y.lo, mean.lo, rstd.lo, x.lo, w.lo, b.lo, 1e-5f, NULL, NULL),
         BE->layer_norm(y.f, mean.f, rstd.f, x.f, w.f, b.f, 1e-5f, NULL, NULL));
    expect("layer_norm y", y, NULL);
    expect("layer_norm rstd", rstd, NULL);
    pair gy = draw(xs, DT, -1.0f, 1.0f), gx = output(xs, DT);
    pair gw = output(cs, TDM_F32), gb = output(cs, TDM_F32);
    RUN2(BE->layer_norm_backward(gx.lo, gw.lo, gb.lo, gy.lo, x.lo, w.lo, mean.lo, rstd.lo, NULL),
         BE->layer_norm_backward(gx.f, gw.f, gb.f, gy.f, x.f, w.f, mean.f, rstd.f, NULL));
    expect("layer_norm_backward gx", gx, NULL);
    expect("layer_norm_backward gw", gw, NULL);
    expect("layer_norm_backward gb", gb, NULL);
    /* gres added: gx rounded once before the add, so one more rounding of gx's size */
    pair gres = draw(xs, DT, -1.0f, 1.0f), gx2 = output(xs, DT);
    RUN2(BE->layer_norm_backward(gx2.lo, NULL, NULL, gy.lo, x.lo, w.lo, mean.lo, rstd.lo, gres.lo),
         BE->layer_norm_backward(gx2.f, NULL, NULL, gy.f, x.f, w.f, mean.f, rstd.f, gres.f));
    float *g0 = values(gx.f);
    double slack[6 * 48];
    for (int i = 0; i < 6 * 48; i++) slack[i] = unit(DT) * fabs((double)g0[i]) + tiny(DT);
    free(g0);
    expect("layer_norm_backward gx + gres", gx2, slack);
    tdm_scope_end();
}

/* ---- dropout, losses, attention --------------------------------------------------------- */

static void test_dropout(void) {
    tdm_scope_begin();
    pair x = draw(TDM_SHAPE(8, 25), DT, -2.0f, 2.0f), y = output(TDM_SHAPE(8, 25), DT);
    pair mask = output(TDM_SHAPE(8, 25), DT);
    RUN2(BE->dropout(y.lo, mask.lo, x.lo, 0.3f, 7, 11, NULL),
         BE->dropout(y.f, mask.f, x.f, 0.3f, 7, 11, NULL));
    expect("dropout y", y, NULL);
    expect("dropout mask", mask, NULL);
    tdm_scope_end();
}

/* Logits low precision, the loss f32 (the fp32 list), the logits' gradient low precision. */
static void test_losses(void) {
    const int64_t N = 6, C = 11;
    int64_t tv[6] = {3, 0, 10, -100, 5, 3};
    for (int v = 0; v < 2; v++) {
        tdm_scope_begin();
        tdm_tensor *tg = i64(TDM_SHAPE(N), tv);
        pair x = draw(TDM_SHAPE(N, C), DT, -4.0f, 4.0f);
        pair w = v ? draw(TDM_SHAPE(C), TDM_F32, 0.5f, 2.0f) : (pair){NULL, NULL, false};
        pair loss = output(TDM_SHAPE(N), TDM_F32), ws = output(TDM_SHAPE(N), TDM_F32);
        pair lse = output(TDM_SHAPE(N), TDM_F32);
        float sm = v ? 0.1f : 0.0f;
        RUN2(BE->cross_entropy(loss.lo, ws.lo, lse.lo, x.lo, tg, w.lo, -100, sm, true),
             BE->cross_entropy(loss.f, ws.f, lse.f, x.f, tg, w.f, -100, sm, true));
        expect("cross_entropy", loss, NULL);
        pair gl = draw(TDM_SHAPE(N), TDM_F32, 0.1f, 1.0f), gx = output(TDM_SHAPE(N, C), DT);
        RUN2(BE->cross_entropy_backward(gx.lo, gl.lo, x.lo, lse.lo, tg, w.lo, -100, sm, true),
             BE->cross_entropy_backward(gx.f, gl.f, x.f, lse.f, tg, w.f, -100, sm, true));
        expect("cross_entropy_backward", gx, NULL);
        pair out = output(TDM_SHAPE0, TDM_F32), den = output(TDM_SHAPE0, TDM_F32);
        pair gr = output(TDM_SHAPE(N, C), DT);
        RUN2(BE->cross_entropy_reduced(out.lo, den.lo, lse.lo, gr.lo, x.lo, tg, w.lo, -100, sm,
                                       true, v == 0),
             BE->cross_entropy_reduced(out.f, den.f, lse.f, gr.f, x.f, tg, w.f, -100, sm, true,
                                       v == 0));
        expect("cross_entropy_reduced", out, NULL);
        expect("cross_entropy_reduced gx", gr, NULL);
        tdm_scope_end();
    }
    tdm_scope_begin();
    pair x = draw(TDM_SHAPE(4, 9), DT, -4.0f, 4.0f), t = draw(TDM_SHAPE(4, 9), DT, 0.0f, 1.0f);
    pair loss = output(TDM_SHAPE(4, 9), TDM_F32), g = draw(TDM_SHAPE(4, 9), TDM_F32, -1.0f, 1.0f);
    pair gx = output(TDM_SHAPE(4, 9), DT);
    RUN2(BE->bce_logits(loss.lo, x.lo, t.lo), BE->bce_logits(loss.f, x.f, t.f));
    expect("bce_logits", loss, NULL);
    RUN2(BE->bce_logits_backward(gx.lo, g.lo, x.lo, t.lo),
         BE->bce_logits_backward(gx.f, g.f, x.f, t.f));
    expect("bce_logits_backward", gx, NULL);
    tdm_scope_end();
}

/* qkv, y and dqkv low precision; the log-sum-exp f32 (docs/MIXED_PRECISION.md, difference 2).
 * In bf16 the native path rounds P and dS too (attention_slack); in f16 the widening
 * adapter runs the f32 kernel: one rounding of each output. */
static void test_attention_at(int64_t T) {
    const int64_t B = 2, C = 16, nh = 2;
    tdm_scope_begin();
    pair qkv = draw(TDM_SHAPE(B, T, 3 * C), DT, -1.5f, 1.5f), y = output(TDM_SHAPE(B, T, C), DT);
    pair lse = output(TDM_SHAPE(B, nh, T), TDM_F32);
    pair dy = draw(TDM_SHAPE(B, T, C), DT, -1.0f, 1.0f), dqkv = output(TDM_SHAPE(B, T, 3 * C), DT);
    double *sy = NULL, *slse = NULL, *sg = NULL;
    if (DT == TDM_BF16) {
        float *vq = values(qkv.f), *vg = values(dy.f);
        sy = malloc(sizeof(double) * (size_t)(B * T * C));
        slse = malloc(sizeof(double) * (size_t)(B * nh * T));
        sg = malloc(sizeof(double) * (size_t)(B * T * 3 * C));
        attention_slack(vq, vg, B, T, C, nh, 0x1p-8, false, sy, slse, sg);
        free(vq), free(vg);
    }
    RUN2(BE->attention(y.lo, lse.lo, qkv.lo, nh), BE->attention(y.f, lse.f, qkv.f, nh));
    expect("attention y", y, sy);
    expect("attention lse", lse, slse);
    RUN2(BE->attention_backward(dqkv.lo, dy.lo, qkv.lo, y.lo, lse.lo, nh),
         BE->attention_backward(dqkv.f, dy.f, qkv.f, y.f, lse.f, nh));
    expect("attention_backward", dqkv, sg);
    free(sy), free(slse), free(sg);
    tdm_scope_end();
}

/* T 130: the kernels' causal blocks (4, uneven) in both dtypes */
static void test_attention(void) {
    test_attention_at(9);
    test_attention_at(130);
}

/* ---- what is refused -------------------------------------------------------------------- */

static void test_refusals(void) {
    tdm_scope_begin();
    /* the optimizers step fp32 only: a low-precision gradient or parameter is named */
    tdm_tensor *p = tdm_zeros(TDM_SHAPE(8), TDM_F32, D), *g = tdm_zeros(TDM_SHAPE(8), DT, D);
    tdm_tensor *m = tdm_zeros(TDM_SHAPE(8), TDM_F32, D), *v = tdm_zeros(TDM_SHAPE(8), TDM_F32, D);
    tdm_sgd_hparams sh = {.lr = 0.1f};
    tdm_adam_hparams ah = {.lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
    char expect_msg[96];
    snprintf(expect_msg, sizeof expect_msg, "grad is %s", tdm_dtype_name(DT));
    CHECK_ERROR(BE->sgd_step(p, g, NULL, &sh, true) == TDM_ERR_DTYPE, expect_msg);
    CHECK_ERROR(BE->adam_step(p, g, m, v, NULL, &ah, 1) == TDM_ERR_DTYPE, expect_msg);
    snprintf(expect_msg, sizeof expect_msg, "p is %s", tdm_dtype_name(DT));
    CHECK_ERROR(BE->sgd_step(g, p, NULL, &sh, true) == TDM_ERR_DTYPE, expect_msg);
    /* a strided low-precision output (no kernel's contract has one) is refused, not mangled */
    tdm_tensor *y = tdm_zeros(TDM_SHAPE(4, 6), DT, D), *x = tdm_zeros(TDM_SHAPE(6, 4), DT, D);
    int64_t sh2[2] = {6, 4}, st2[2] = {1, 6};
    snprintf(expect_msg, sizeof expect_msg, "cpu softmax: a %s output [6, 4] must be contiguous",
             tdm_dtype_name(DT));
    CHECK_ERROR(BE->softmax(view(y, 2, sh2, st2), x, false) == TDM_ERR_ARG, expect_msg);
    tdm_scope_end();
}

/* ---- every kernel has a case, or a reason to have none ---------------------------------- */

/* The kernels the cases above run in bf16 and f16 (a word list). */
static const char COVERED[] =
    " unary unary_backward binary axpy reduce sum_to max_backward softmax softmax_backward"
    " sum_squares matmul index_select index_add conv2d conv2d_backward max_pool2d"
    " max_pool2d_backward avg_pool2d avg_pool2d_backward batch_norm batch_norm_backward"
    " batch_norm_stats batch_norm_backward_reduce batch_norm_backward_elemt layer_norm"
    " layer_norm_backward dropout cross_entropy cross_entropy_backward cross_entropy_reduced"
    " bce_logits bce_logits_backward attention attention_backward ";
/* The kernels with none: raw memory and host transfers move bytes of any dtype, copy, fill
 * and random are cpu_memory.c's (the tensor core's tests), count_up counts in i64 only, linear
 * is copy and matmul, linear_gelu linear and unary, linear_dgelu matmul and unary_backward,
 * linear_wgrad matmul and sum_to (their cases; tdm_linear's in test_autocast), and the
 * optimizers take fp32 only (test_refusals). */
static const char EXEMPT[] = " mem_alloc mem_free to_host from_host copy fill count_up random "
                             "linear linear_gelu linear_dgelu linear_wgrad sgd_step adam_step ";

static const char *const KERNELS[] = {
#define TDM_KERNEL(ret, entry, params) #entry,
#define TDM_UPLOAD(ret, entry, params)
#include "backend/kernels.def"
#undef TDM_KERNEL
#undef TDM_UPLOAD
};

/* A kernel added to kernels.def fails here until it has a case (or is exempt, with why). */
static void test_every_kernel(void) {
    for (size_t i = 0; i < sizeof KERNELS / sizeof KERNELS[0]; i++) {
        char word[64];
        snprintf(word, sizeof word, " %s ", KERNELS[i]);
        CHECK(strstr(COVERED, word) || strstr(EXEMPT, word),
              "kernel %s: no bf16/f16 case here, and not exempt", KERNELS[i]);
    }
}

int main(void) {
    D = tdm_cpu(0);
    BE = tdm_backend_for(D);
    printf("half conversions: %s\n", tdm_half_isa());
    const tdm_dtype dts[2] = {TDM_BF16, TDM_F16};
    for (int i = 0; i < 2; i++) {
        DT = dts[i];
        test_unary();
        test_binary();
        test_axpy();
        test_reduce();
        test_softmax();
        test_sum_squares();
        test_matmul();
        test_index();
        test_conv2d();
        test_pool2d();
        test_batch_norm();
        test_layer_norm();
        test_dropout();
        test_losses();
        test_attention();
        test_refusals();
    }
    test_every_kernel();
    return check_summary();
}
