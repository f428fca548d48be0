/* Math ops: forward values against double-precision loops written here, gradients against
 * finite differences (broadcasting, non-contiguous inputs), the kernels the ops do not reach
 * directly (axpy, sum_to, sum_squares), and error cases.
 *
 * Longer than the ~800 lines a file is kept under, on purpose: its sections share the
 * reference loops and generators above them and each is a list of cases, one per op; split
 * it (forward values / gradients) when a section grows, not before. */
#include <stdlib.h>

#include "gradcheck.h"
#include "core/core.h"

#include "backend/backend.h"

/* ---- helpers ------------------------------------------------------------------------------ */

/* The test's own generator (independent of the library's RNG): uniform in [lo, hi). */
static uint64_t lcg_state = 88172645463325252ull;
static double urand(double lo, double hi) {
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (double)(lcg_state >> 11) * (1.0 / 9007199254740992.0);
}

static void fill_uniform(float *v, int64_t n, double lo, double hi) {
    for (int64_t i = 0; i < n; i++) v[i] = (float)urand(lo, hi);
}

/* A caller-owned f32 tensor with values from [lo, hi) drawn by urand; host copy in *host
 * (malloc'd, the caller frees) if host is not NULL. */
static tdm_tensor *make(tdm_shape s, double lo, double hi, float **host) {
    int64_t n = tdm_shape_numel(s);
    float *v = (float *)malloc((size_t)(n ? n : 1) * sizeof(float));
    fill_uniform(v, n, lo, hi);
    tdm_tensor *t = tdm_from_data(s, TDM_F32, tdm_cpu(0), v);
    if (host)
        *host = v;
    else
        free(v);
    return t;
}

/* A leaf for gradcheck with |values| in [away, 2): keeps kinks (relu) and poles (log, div)
 * farther than the finite-difference step. */
static tdm_tensor *leaf(tdm_shape s, double away, bool positive) {
    int64_t n = tdm_shape_numel(s);
    float *v = (float *)malloc((size_t)(n ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        double m = urand(away, 2.0);
        v[i] = (float)(positive || urand(0, 1) < 0.5 ? m : -m);
    }
    tdm_tensor *t = tdm_from_data(s, TDM_F32, tdm_cpu(0), v);
    free(v);
    tdm_requires_grad_(t, true);
    return t;
}

static float *host_of(const tdm_tensor *t) {
    int64_t n = tdm_numel(t);
    float *v = (float *)malloc((size_t)(n ? n : 1) * sizeof(float));
    if (tdm_to_host(t, v, (size_t)n * sizeof(float)) != 0) {
        fprintf(stderr, "to_host failed: %s\n", tdm_last_error());
        memset(v, 0, (size_t)n * sizeof(float));
    }
    return v;
}

static tdm_shape random_shape(int min_nd, int max_nd, int max_dim) {
    tdm_shape s = {0, {0}};
    s.ndim = min_nd + (int)urand(0, max_nd - min_nd + 1);
    for (int i = 0; i < s.ndim; i++) s.d[i] = 1 + (int64_t)urand(0, max_dim);
    return s;
}

static void unravel(int64_t i, tdm_shape s, int64_t *idx) {
    for (int d = s.ndim - 1; d >= 0; d--) {
        idx[d] = i % s.d[d];
        i /= s.d[d];
    }
}

/* Row-major index into a tensor of shape in for the output index idx (shape out), with in
 * right-aligned and broadcast. */
static int64_t bcast_index(const int64_t *idx, tdm_shape out, tdm_shape in) {
    int64_t r = 0;
    for (int d = 0; d < in.ndim; d++) {
        int od = d + out.ndim - in.ndim;
        r = r * in.d[d] + (in.d[d] == 1 ? 0 : idx[od]);
    }
    return r;
}

static tdm_shape bshape(tdm_shape a, tdm_shape b) {
    tdm_shape s = {a.ndim > b.ndim ? a.ndim : b.ndim, {0}};
    for (int d = 0; d < s.ndim; d++) {
        int da = d - (s.ndim - a.ndim), db = d - (s.ndim - b.ndim);
        int64_t x = da >= 0 ? a.d[da] : 1, y = db >= 0 ? b.d[db] : 1;
        s.d[d] = x == 1 ? y : x;
    }
    return s;
}

static bool shape_is(const tdm_tensor *t, tdm_shape s) {
    if (!t || t->ndim != s.ndim) return false;
    for (int i = 0; i < s.ndim; i++)
        if (t->shape[i] != s.d[i]) return false;
    return true;
}

/* ---- forward: direct, hand-computed values ---------------------------------------------- */

static void test_mul_sum_by_hand(void) {
    tdm_scope_begin();
    float av[] = {1, 2, 3, -4}, bv[] = {4, 5, 6, 0.5f};
    tdm_tensor *a = tdm_from_data(TDM_SHAPE(2, 2), TDM_F32, tdm_cpu(0), av);
    tdm_tensor *b = tdm_from_data(TDM_SHAPE(2, 2), TDM_F32, tdm_cpu(0), bv);
    tdm_requires_grad_(a, true);
    tdm_requires_grad_(b, true);
    tdm_tensor *p = tdm_mul(a, b);
    float expect_p[] = {4, 10, 18, -2};
    check_tensor_close(p, expect_p, 0, 0, "mul by hand");
    tdm_tensor *s = tdm_sum_all(p);
    CHECK(s && s->ndim == 0, "sum_all gives a scalar");
    CHECK_CLOSE(tdm_item(s), 30.0, 0, 0);
    CHECK(tdm_backward(s) == 0, "backward: %s", tdm_last_error());
    check_tensor_close(a->grad, bv, 0, 0, "d sum(a*b)/da = b");
    check_tensor_close(b->grad, av, 0, 0, "d sum(a*b)/db = a");

    /* a row vector broadcast against a column: [2,1] * [3] -> [2,3] */
    float cv[] = {2, -3}, dv[] = {1, 10, 100};
    tdm_tensor *c = tdm_from_data(TDM_SHAPE(2, 1), TDM_F32, tdm_cpu(0), cv);
    tdm_tensor *d = tdm_from_data(TDM_SHAPE(3), TDM_F32, tdm_cpu(0), dv);
    tdm_requires_grad_(c, true);
    tdm_requires_grad_(d, true);
    tdm_tensor *e = tdm_mul(c, d);
    float expect_e[] = {2, 20, 200, -3, -30, -300};
    CHECK(shape_is(e, TDM_SHAPE(2, 3)), "[2,1]*[3] is [2,3]");
    check_tensor_close(e, expect_e, 0, 0, "broadcast mul by hand");
    CHECK(tdm_backward(tdm_sum_all(e)) == 0, "backward: %s", tdm_last_error());
    float gc[] = {111, 111}, gd[] = {-1, -1, -1};
    check_tensor_close(c->grad, gc, 0, 0, "grad of the column");
    check_tensor_close(d->grad, gd, 0, 0, "grad of the row");
    tdm_scope_end();
}

/* ---- forward: binary ops against double loops ------------------------------------------- */

static double ref_binary(int op, double a, double b) {
    switch (op) {
    case 0:
        return a + b;
    case 1:
        return a - b;
    case 2:
        return a * b;
    default:
        return a / b;
    }
}

static tdm_tensor *(*const binary_fns[4])(tdm_tensor *, tdm_tensor *) = {tdm_add, tdm_sub, tdm_mul,
                                                                         tdm_div};
static const char *const binary_names[4] = {"add", "sub", "mul", "div"};

/* a op b for shapes sa, sb; when transpose_a, a is built as sa with its last two dims swapped
 * and transposed back, so the op reads a non-contiguous view. */
static void check_binary_forward(tdm_shape sa, tdm_shape sb, bool transpose_a) {
    tdm_scope_begin();
    tdm_shape so = bshape(sa, sb);
    int64_t no = tdm_shape_numel(so);
    float *av, *bv;
    tdm_tensor *a, *b = make(sb, 0.5, 2.0, &bv);
    if (transpose_a) {
        tdm_shape st = sa;
        st.d[sa.ndim - 1] = sa.d[sa.ndim - 2];
        st.d[sa.ndim - 2] = sa.d[sa.ndim - 1];
        a = tdm_transpose(make(st, -2, 2, NULL), -1, -2);
        av = host_of(a);
    } else {
        a = make(sa, -2, 2, &av);
    }
    float *expect = (float *)malloc((size_t)no * sizeof(float));
    int64_t idx[TDM_MAX_DIMS];
    for (int op = 0; op < 4; op++) {
        for (int64_t i = 0; i < no; i++) {
            unravel(i, so, idx);
            expect[i] =
                (float)ref_binary(op, av[bcast_index(idx, so, sa)], bv[bcast_index(idx, so, sb)]);
        }
        tdm_tensor *y = binary_fns[op](a, b);
        char s1[96], s2[96], what[256];
        snprintf(what, sizeof what, "%s %s %s%s", binary_names[op], tdm_shape_str(sa, s1),
                 tdm_shape_str(sb, s2), transpose_a ? " (a transposed)" : "");
        CHECK(shape_is(y, so), "%s: output shape", what);
        if (y) check_tensor_close(y, expect, 1e-6, 1e-6, what);
        /* and the other way round (b op a) for the commutative pair */
        if (op == 0 || op == 2) {
            tdm_tensor *z = binary_fns[op](b, a);
            if (z) check_tensor_close(z, expect, 1e-6, 1e-6, what);
        }
    }
    free(expect);
    free(av);
    free(bv);
    tdm_scope_end();
}

static void test_binary_forward(void) {
    check_binary_forward(TDM_SHAPE(2, 3, 4), TDM_SHAPE(2, 3, 4), false);
    check_binary_forward(TDM_SHAPE(3, 1, 4), TDM_SHAPE(5, 1), false);
    check_binary_forward(TDM_SHAPE(6, 5), TDM_SHAPE(5), false);    /* row broadcast */
    check_binary_forward(TDM_SHAPE(6, 5), TDM_SHAPE(6, 1), false); /* column broadcast */
    check_binary_forward(TDM_SHAPE(1, 7), TDM_SHAPE(3, 1), false); /* outer product */
    check_binary_forward(TDM_SHAPE(2, 3, 4), TDM_SHAPE0, false);   /* scalar */
    check_binary_forward(TDM_SHAPE(4, 5), TDM_SHAPE(4, 5), true);  /* strided a */
    check_binary_forward(TDM_SHAPE(2, 4, 3), TDM_SHAPE(3), true);  /* strided + broadcast */
    check_binary_forward(TDM_SHAPE(2, 1, 3), TDM_SHAPE(4, 1), false);
    /* large enough for the contiguous fast path to run many vector iterations */
    check_binary_forward(TDM_SHAPE(33, 129), TDM_SHAPE(129), false);
    for (int r = 0; r < 6; r++) {
        tdm_shape so = random_shape(1, 4, 4), sa = so, sb = so;
        for (int d = 0; d < so.ndim; d++) {
            if (urand(0, 1) < 0.3) sa.d[d] = 1;
            if (urand(0, 1) < 0.3) sb.d[d] = 1;
        }
        if (urand(0, 1) < 0.5 && sb.ndim > 1) { /* drop leading dims of b */
            sb.ndim--;
            memmove(sb.d, sb.d + 1, sizeof(int64_t) * (size_t)sb.ndim);
        }
        check_binary_forward(sa, sb, false);
    }
}

/* ---- forward: unary ops ----------------------------------------------------------------- */

typedef enum {
    U_NEG,
    U_EXP,
    U_LOG,
    U_SQRT,
    U_RELU,
    U_GELU_TANH,
    U_GELU_ERF,
    U_TANH,
    U_SIGMOID,
    U_ADD_S,
    U_MUL_S,
    U_POW_S,
    U_SOFTSIGN,
    U_COUNT
} uop;

static const char *const unary_names[U_COUNT] = {
    "neg",  "exp",     "log",        "sqrt",       "relu",       "gelu_tanh", "gelu_erf",
    "tanh", "sigmoid", "add_scalar", "mul_scalar", "pow_scalar", "softsign"};

static tdm_tensor *apply_unary(uop op, tdm_tensor *x, float s) {
    switch (op) {
    case U_NEG:
        return tdm_neg(x);
    case U_EXP:
        return tdm_exp(x);
    case U_LOG:
        return tdm_log(x);
    case U_SQRT:
        return tdm_sqrt(x);
    case U_RELU:
        return tdm_relu(x);
    case U_GELU_TANH:
        return tdm_gelu(x, true);
    case U_GELU_ERF:
        return tdm_gelu(x, false);
    case U_TANH:
        return tdm_tanh(x);
    case U_SIGMOID:
        return tdm_sigmoid(x);
    case U_ADD_S:
        return tdm_add_scalar(x, s);
    case U_MUL_S:
        return tdm_mul_scalar(x, s);
    case U_POW_S:
        return tdm_pow_scalar(x, s);
    case U_SOFTSIGN:
        return tdm_softsign(x);
    default:
        return NULL;
    }
}

static double ref_unary(uop op, double v, double s) {
    switch (op) {
    case U_NEG:
        return -v;
    case U_EXP:
        return exp(v);
    case U_LOG:
        return log(v);
    case U_SQRT:
        return sqrt(v);
    case U_RELU:
        return v > 0 ? v : 0;
    case U_GELU_TANH:
        return 0.5 * v * (1 + tanh(sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    case U_GELU_ERF:
        return 0.5 * v * (1 + erf(v / sqrt(2.0)));
    case U_TANH:
        return tanh(v);
    case U_SIGMOID:
        return 1 / (1 + exp(-v));
    case U_ADD_S:
        return v + s;
    case U_MUL_S:
        return v * s;
    case U_POW_S:
        return pow(v, s);
    case U_SOFTSIGN:
        return v / (1 + fabs(v));
    default:
        return NAN;
    }
}

static bool positive_domain(uop op, float s) {
    return op == U_LOG || op == U_SQRT || (op == U_POW_S && s != floorf(s));
}

static void test_unary_forward(void) {
    const float pows[] = {2, 3, 0.5f, -1, 1.5f, 0, 1, -2.5f};
    for (int op = 0; op < U_COUNT; op++) {
        int nvar = op == U_POW_S ? (int)(sizeof pows / sizeof pows[0]) : 2;
        for (int v = 0; v < nvar; v++) {
            float s = op == U_POW_S ? pows[v] : (v ? -1.75f : 0.25f);
            bool pos = positive_domain((uop)op, s);
            tdm_scope_begin();
            /* 37 x 11, transposed for odd variants: a strided input */
            bool tr = (v % 2) == 1;
            tdm_tensor *x =
                make(tr ? TDM_SHAPE(11, 37) : TDM_SHAPE(37, 11), pos ? 0.05 : -6, 6, NULL);
            if (tr) x = tdm_transpose(x, 0, 1);
            float *xv = host_of(x);
            int64_t n = tdm_numel(x);
            float *expect = (float *)malloc((size_t)n * sizeof(float));
            for (int64_t i = 0; i < n; i++) expect[i] = (float)ref_unary((uop)op, xv[i], s);
            tdm_tensor *y = apply_unary((uop)op, x, s);
            char what[96];
            snprintf(what, sizeof what, "%s (s=%g%s)", unary_names[op], s, tr ? ", strided" : "");
            CHECK(y && shape_is(y, TDM_SHAPE(37, 11)), "%s: shape", what);
            if (y) check_tensor_close(y, expect, 1e-6, 2e-6, what);
            free(xv);
            free(expect);
            tdm_scope_end();
        }
    }
    /* extremes: sigmoid and softmax-like ops must not overflow; relu propagates NaN */
    tdm_scope_begin();
    float big[] = {-200, -90, 0, 90, 200};
    tdm_tensor *x = tdm_from_data(TDM_SHAPE(5), TDM_F32, tdm_cpu(0), big);
    float sig[] = {0, (float)(1 / (1 + exp(90.0))), 0.5f, 1, 1};
    check_tensor_close(tdm_sigmoid(x), sig, 1e-30, 1e-6, "sigmoid at extremes");
    float nanv[] = {NAN, -1, 2};
    float *r = host_of(tdm_relu(tdm_from_data(TDM_SHAPE(3), TDM_F32, tdm_cpu(0), nanv)));
    CHECK(isnan(r[0]) && r[1] == 0 && r[2] == 2, "relu(NaN) is NaN, relu(-1) 0, relu(2) 2");
    free(r);
    /* exp over its whole range (the kernel's own polynomial) and at the edges */
    float wide[2001], ewide[2001];
    for (int i = 0; i <= 2000; i++) {
        wide[i] = -87.0f + 175.5f * (float)i / 2000.0f;
        ewide[i] = (float)exp((double)wide[i]);
    }
    check_tensor_close(tdm_exp(tdm_from_data(TDM_SHAPE(2001), TDM_F32, tdm_cpu(0), wide)), ewide, 0,
                       3e-7, "exp on [-87, 88.5]");
    float edge[] = {-INFINITY, -1000, 89, INFINITY, NAN, 0};
    float *ev = host_of(tdm_exp(tdm_from_data(TDM_SHAPE(6), TDM_F32, tdm_cpu(0), edge)));
    CHECK(ev[0] == 0 && ev[1] == 0 && isinf(ev[2]) && isinf(ev[3]) && isnan(ev[4]) && ev[5] == 1,
          "exp edges: %g %g %g %g %g %g", ev[0], ev[1], ev[2], ev[3], ev[4], ev[5]);
    free(ev);
    tdm_scope_end();
}

/* softsign at points whose values are exact fractions, worked out by hand: a check that does
 * not share the formula with ref_unary above. */
static void test_softsign_by_hand(void) {
    tdm_scope_begin();
    float xv[] = {-3, -1, -0.5f, 0, 0.25f, 1, 4};
    float want[] = {-0.75f, -0.5f, -1.0f / 3, 0, 0.2f, 0.5f, 0.8f};
    /* d/dx = 1 / (1 + |x|)^2, at the same points */
    float dwant[] = {1.0f / 16, 0.25f, 4.0f / 9, 1, 0.64f, 0.25f, 0.04f};
    tdm_tensor *x = tdm_from_data(TDM_SHAPE(7), TDM_F32, tdm_cpu(0), xv);
    tdm_requires_grad_(x, true);
    tdm_tensor *y = tdm_softsign(x);
    if (y) check_tensor_close(y, want, 0, 1e-7, "softsign by hand");
    CHECK(y && tdm_backward(tdm_sum_all(y)) == 0, "softsign backward: %s", tdm_last_error());
    if (y) check_tensor_close(x->grad, dwant, 0, 1e-7, "softsign gradient by hand");
    tdm_scope_end();
}

/* ---- forward: reductions ---------------------------------------------------------------- */

static void check_reductions_of(tdm_tensor *x, const char *label) {
    tdm_shape s = tdm_shape_of(x);
    float *xv = host_of(x);
    int64_t n = tdm_numel(x);
    for (int d = 0; d < s.ndim; d++) {
        int64_t outer = 1, len = s.d[d], inner = 1;
        for (int i = 0; i < d; i++) outer *= s.d[i];
        for (int i = d + 1; i < s.ndim; i++) inner *= s.d[i];
        float *es = (float *)malloc((size_t)(outer * inner) * sizeof(float));
        float *em = (float *)malloc((size_t)(outer * inner) * sizeof(float));
        float *ex = (float *)malloc((size_t)(outer * inner) * sizeof(float));
        int64_t *ea = (int64_t *)malloc((size_t)(outer * inner) * sizeof(int64_t));
        for (int64_t o = 0; o < outer; o++)
            for (int64_t j = 0; j < inner; j++) {
                double sum = 0, best = -INFINITY;
                int64_t arg = 0;
                for (int64_t k = 0; k < len; k++) {
                    double v = xv[(o * len + k) * inner + j];
                    sum += v;
                    if (v > best) best = v, arg = k;
                }
                es[o * inner + j] = (float)sum;
                em[o * inner + j] = (float)(sum / (double)len);
                ex[o * inner + j] = (float)best;
                ea[o * inner + j] = arg;
            }
        for (int keep = 0; keep < 2; keep++) {
            tdm_scope_begin();
            char what[128];
            tdm_shape rs = {0, {0}};
            for (int i = 0; i < s.ndim; i++)
                if (i != d)
                    rs.d[rs.ndim++] = s.d[i];
                else if (keep)
                    rs.d[rs.ndim++] = 1;
            int neg = d - s.ndim; /* the same dim counted from the end */
            snprintf(what, sizeof what, "sum %s dim %d keep %d", label, d, keep);
            tdm_tensor *y = tdm_sum(x, keep ? neg : d, keep);
            CHECK(shape_is(y, rs), "%s: shape", what);
            if (y) check_tensor_close(y, es, 1e-5, 1e-5, what);
            snprintf(what, sizeof what, "mean %s dim %d keep %d", label, d, keep);
            y = tdm_mean(x, d, keep);
            CHECK(shape_is(y, rs), "%s: shape", what);
            if (y) check_tensor_close(y, em, 1e-6, 1e-5, what);
            snprintf(what, sizeof what, "max %s dim %d keep %d", label, d, keep);
            tdm_tensor *am = NULL;
            y = tdm_max(x, d, keep, &am);
            CHECK(shape_is(y, rs) && shape_is(am, rs) && am->dtype == TDM_I64, "%s: shapes", what);
            if (y) check_tensor_close(y, ex, 0, 0, what);
            if (am) {
                int64_t *got = (int64_t *)malloc((size_t)(outer * inner) * sizeof(int64_t));
                tdm_to_host(am, got, (size_t)(outer * inner) * sizeof(int64_t));
                int bad = 0;
                for (int64_t i = 0; i < outer * inner; i++) bad += got[i] != ea[i];
                CHECK(bad == 0, "%s: %d wrong argmax", what, bad);
                free(got);
            }
            tdm_scope_end();
        }
        free(es);
        free(em);
        free(ex);
        free(ea);
    }
    tdm_scope_begin();
    double total = 0;
    for (int64_t i = 0; i < n; i++) total += xv[i];
    CHECK_CLOSE(tdm_item(tdm_sum_all(x)), total, 1e-5, 1e-6);
    CHECK_CLOSE(tdm_item(tdm_mean_all(x)), total / (double)n, 1e-6, 1e-6);
    tdm_scope_end();
    free(xv);
}

static void test_reductions_forward(void) {
    tdm_scope_begin();
    check_reductions_of(make(TDM_SHAPE(3, 4, 5), -3, 3, NULL), "[3,4,5]");
    /* inner > the kernel's 256-wide chunk, and a long row */
    check_reductions_of(make(TDM_SHAPE(3, 300), -3, 3, NULL), "[3,300]");
    check_reductions_of(make(TDM_SHAPE(2, 3, 700), -3, 3, NULL), "[2,3,700]");
    check_reductions_of(tdm_transpose(make(TDM_SHAPE(4, 6, 5), -3, 3, NULL), 0, 2),
                        "[5,6,4] strided");
    /* a scalar reduces to itself */
    float one = 2.5f;
    tdm_tensor *s = tdm_from_data(TDM_SHAPE0, TDM_F32, tdm_cpu(0), &one);
    CHECK_CLOSE(tdm_item(tdm_sum(s, 0, false)), 2.5, 0, 0);
    CHECK_CLOSE(tdm_item(tdm_sum_all(s)), 2.5, 0, 0);
    /* sum of many values: accumulated in double, so exact to float rounding */
    tdm_tensor *ones = tdm_full(TDM_SHAPE(1 << 20), 0.1f, TDM_F32, tdm_cpu(0));
    CHECK_CLOSE(tdm_item(tdm_sum_all(ones)), 0.1f * (double)(1 << 20), 0, 1e-6);
    /* mean_all over no elements is NaN, as in PyTorch */
    tdm_tensor *empty = tdm_zeros(TDM_SHAPE(0, 3), TDM_F32, tdm_cpu(0));
    CHECK(isnan(tdm_item(tdm_mean_all(empty))), "mean of nothing is NaN");
    CHECK_CLOSE(tdm_item(tdm_sum_all(empty)), 0, 0, 0);
    /* ties: the first maximal index, and the gradient goes there only */
    float tv[] = {1, 3, 3, 2, 5, 5};
    tdm_tensor *t = tdm_from_data(TDM_SHAPE(2, 3), TDM_F32, tdm_cpu(0), tv);
    tdm_requires_grad_(t, true);
    tdm_tensor *am = NULL;
    tdm_tensor *m = tdm_max(t, 1, false, &am);
    int64_t ai[2] = {-1, -1};
    if (am) tdm_to_host(am, ai, sizeof ai);
    CHECK(ai[0] == 1 && ai[1] == 1, "argmax of ties is the first: %lld %lld", (long long)ai[0],
          (long long)ai[1]);
    CHECK(tdm_backward(tdm_sum_all(m)) == 0, "max backward: %s", tdm_last_error());
    float gt[] = {0, 1, 0, 0, 1, 0};
    check_tensor_close(t->grad, gt, 0, 0, "max gradient goes to the first maximum");
    /* NaN is the maximum (the first one), in rows long enough for the vector lanes */
    float nv[40];
    for (int i = 0; i < 40; i++) nv[i] = (float)i;
    nv[0] = NAN;  /* row 0: NaN first */
    nv[31] = NAN; /* row 1: NaN late, after a larger value */
    nv[33] = NAN;
    tdm_tensor *nt = tdm_from_data(TDM_SHAPE(2, 20), TDM_F32, tdm_cpu(0), nv);
    int64_t na[2] = {-1, -1};
    tdm_tensor *nm = tdm_max(nt, 1, false, &am);
    float nmv[2] = {0, 0};
    if (nm && am) {
        tdm_to_host(am, na, sizeof na);
        tdm_to_host(nm, nmv, sizeof nmv);
    }
    CHECK(isnan(nmv[0]) && isnan(nmv[1]) && na[0] == 0 && na[1] == 11,
          "max with NaN: %g@%lld %g@%lld", nmv[0], (long long)na[0], nmv[1], (long long)na[1]);
    float *sm = host_of(tdm_softmax(nt, 1));
    CHECK(isnan(sm[5]) && isnan(sm[25]), "softmax of a row with NaN is NaN");
    free(sm);
    tdm_scope_end();
}

/* ---- forward: softmax ------------------------------------------------------------------- */

static void check_softmax_of(tdm_tensor *x, const char *label) {
    tdm_shape s = tdm_shape_of(x);
    float *xv = host_of(x);
    int64_t n = tdm_numel(x);
    float *ep = (float *)malloc((size_t)n * sizeof(float));
    float *el = (float *)malloc((size_t)n * sizeof(float));
    for (int d = 0; d < s.ndim; d++) {
        int64_t outer = 1, len = s.d[d], inner = 1;
        for (int i = 0; i < d; i++) outer *= s.d[i];
        for (int i = d + 1; i < s.ndim; i++) inner *= s.d[i];
        for (int64_t o = 0; o < outer; o++)
            for (int64_t j = 0; j < inner; j++) {
                double m = -INFINITY, sum = 0;
                for (int64_t k = 0; k < len; k++) m = fmax(m, xv[(o * len + k) * inner + j]);
                for (int64_t k = 0; k < len; k++) sum += exp(xv[(o * len + k) * inner + j] - m);
                for (int64_t k = 0; k < len; k++) {
                    int64_t i = (o * len + k) * inner + j;
                    ep[i] = (float)(exp(xv[i] - m) / sum);
                    el[i] = (float)(xv[i] - m - log(sum));
                }
            }
        tdm_scope_begin();
        char what[128];
        snprintf(what, sizeof what, "softmax %s dim %d", label, d);
        tdm_tensor *y = tdm_softmax(x, d);
        CHECK(shape_is(y, s), "%s: shape", what);
        if (y) check_tensor_close(y, ep, 1e-7, 1e-5, what);
        snprintf(what, sizeof what, "log_softmax %s dim %d", label, d);
        y = tdm_log_softmax(x, d - s.ndim);
        CHECK(shape_is(y, s), "%s: shape", what);
        if (y) check_tensor_close(y, el, 1e-5, 1e-5, what);
        tdm_scope_end();
    }
    free(xv);
    free(ep);
    free(el);
}

static void test_softmax_forward(void) {
    tdm_scope_begin();
    check_softmax_of(make(TDM_SHAPE(3, 4, 5), -4, 4, NULL), "[3,4,5]");
    check_softmax_of(tdm_transpose(make(TDM_SHAPE(6, 7), -4, 4, NULL), 0, 1), "[7,6] strided");
    /* large logits: no overflow thanks to the max subtraction */
    check_softmax_of(make(TDM_SHAPE(2, 9), 900, 1000, NULL), "[2,9] near 1000");
    check_softmax_of(make(TDM_SHAPE(4, 130), -30, 30, NULL), "[4,130]");
    tdm_scope_end();
}

/* ---- gradients -------------------------------------------------------------------------- */

typedef enum {
    G_BINARY,
    G_UNARY,
    G_SUM,
    G_MEAN,
    G_MAX,
    G_SUM_ALL,
    G_MEAN_ALL,
    G_SOFTMAX,
    G_LOG_SOFTMAX
} gkind;

typedef struct {
    gkind kind;
    int op;  /* binary or unary op */
    float s; /* unary scalar */
    int dim; /* reductions, softmax */
    bool keepdim;
    bool transpose; /* read in[0] through tdm_transpose(in[0], 0, 1) */
    bool self;      /* binary: in[0] op in[0] (one leaf used twice) */
} gctx;

static tdm_tensor *gfn(tdm_tensor **in, void *p) {
    const gctx *c = (const gctx *)p;
    tdm_tensor *x = c->transpose ? tdm_transpose(in[0], 0, 1) : in[0];
    switch (c->kind) {
    case G_BINARY:
        return binary_fns[c->op](x, c->self ? x : in[1]);
    case G_UNARY:
        return apply_unary((uop)c->op, x, c->s);
    case G_SUM:
        return tdm_sum(x, c->dim, c->keepdim);
    case G_MEAN:
        return tdm_mean(x, c->dim, c->keepdim);
    case G_MAX:
        return tdm_max(x, c->dim, c->keepdim, NULL);
    case G_SUM_ALL:
        return tdm_sum_all(x);
    case G_MEAN_ALL:
        return tdm_mean_all(x);
    case G_SOFTMAX:
        return tdm_softmax(x, c->dim);
    case G_LOG_SOFTMAX:
        return tdm_log_softmax(x, c->dim);
    }
    return NULL;
}

#define EPS  2e-3
#define ATOL 1e-3
#define RTOL 5e-3

static void grad_binary(int op, tdm_shape sa, tdm_shape sb, bool transpose) {
    gctx c = {.kind = G_BINARY, .op = op, .transpose = transpose};
    tdm_shape la = sa;
    if (transpose) { /* the leaf is stored transposed; the op sees sa */
        la.d[0] = sa.d[1];
        la.d[1] = sa.d[0];
    }
    tdm_tensor *in[2] = {leaf(la, 0.3, false), leaf(sb, 0.5, op == 3)};
    char s1[96], s2[96], what[256];
    snprintf(what, sizeof what, "grad %s %s %s%s", binary_names[op], tdm_shape_str(sa, s1),
             tdm_shape_str(sb, s2), transpose ? " (a transposed)" : "");
    gradcheck(what, gfn, 2, in, &c, EPS, ATOL, RTOL);
    tdm_tensor_free(in[0]);
    tdm_tensor_free(in[1]);
}

static void test_grad_binary(void) {
    for (int op = 0; op < 4; op++) {
        grad_binary(op, TDM_SHAPE(3, 4), TDM_SHAPE(3, 4), false);
        grad_binary(op, TDM_SHAPE(3, 1, 4), TDM_SHAPE(5, 1), false);
        grad_binary(op, TDM_SHAPE(5, 1), TDM_SHAPE(3, 1, 4), false);
        grad_binary(op, TDM_SHAPE(4, 3), TDM_SHAPE(3), true);
        grad_binary(op, TDM_SHAPE(2, 3), TDM_SHAPE0, false);
        tdm_shape so = random_shape(1, 3, 4), sa = so, sb = so;
        for (int d = 0; d < so.ndim; d++) {
            if (urand(0, 1) < 0.4)
                sa.d[d] = 1;
            else if (urand(0, 1) < 0.4)
                sb.d[d] = 1;
        }
        grad_binary(op, sa, sb, false);
        /* x op x: both gradients land on one leaf */
        gctx c = {.kind = G_BINARY, .op = op, .self = true};
        tdm_tensor *in[1] = {leaf(TDM_SHAPE(2, 3), 0.5, true)};
        char what[64];
        snprintf(what, sizeof what, "grad %s(x, x)", binary_names[op]);
        gradcheck(what, gfn, 1, in, &c, EPS, ATOL, RTOL);
        tdm_tensor_free(in[0]);
    }
}

static void test_grad_unary(void) {
    const float pows[] = {2, 3, 0.5f, -1, 1.5f, 0};
    for (int op = 0; op < U_COUNT; op++) {
        int nvar = op == U_POW_S ? (int)(sizeof pows / sizeof pows[0]) : 1;
        for (int v = 0; v < nvar; v++) {
            float s = op == U_POW_S ? pows[v] : -1.5f;
            for (int tr = 0; tr < 2; tr++) {
                gctx c = {.kind = G_UNARY, .op = op, .s = s, .transpose = tr};
                tdm_shape sh = random_shape(2, 3, 4);
                /* away from relu's kink and the poles of log, sqrt and negative powers */
                tdm_tensor *in[1] = {
                    leaf(sh, 0.2, positive_domain((uop)op, s) || op == U_LOG || op == U_POW_S)};
                char what[96];
                snprintf(what, sizeof what, "grad %s (s=%g%s)", unary_names[op], s,
                         tr ? ", transposed" : "");
                gradcheck(what, gfn, 1, in, &c, EPS, ATOL, RTOL);
                tdm_tensor_free(in[0]);
            }
        }
    }
}

static void test_grad_reductions(void) {
    const char *names[] = {"sum", "mean", "max"};
    for (int k = 0; k < 3; k++) {
        for (int r = 0; r < 4; r++) {
            tdm_shape sh = random_shape(2, 3, 4);
            gctx c = {.kind = (gkind)(G_SUM + k),
                      .dim = (int)urand(-sh.ndim, sh.ndim),
                      .keepdim = r % 2,
                      .transpose = r >= 2};
            tdm_tensor *in[1] = {leaf(sh, 0.0, false)};
            char what[96];
            snprintf(what, sizeof what, "grad %s dim %d keep %d%s", names[k], c.dim, c.keepdim,
                     c.transpose ? " (transposed)" : "");
            gradcheck(what, gfn, 1, in, &c, EPS, ATOL, RTOL);
            tdm_tensor_free(in[0]);
        }
    }
    for (int k = 0; k < 2; k++)
        for (int tr = 0; tr < 2; tr++) {
            gctx c = {.kind = k ? G_MEAN_ALL : G_SUM_ALL, .transpose = tr};
            tdm_tensor *in[1] = {leaf(TDM_SHAPE(3, 5), 0.0, false)};
            gradcheck(k ? "grad mean_all" : "grad sum_all", gfn, 1, in, &c, EPS, ATOL, RTOL);
            tdm_tensor_free(in[0]);
        }
}

static void test_grad_softmax(void) {
    for (int k = 0; k < 2; k++) {
        for (int d = -3; d < 3; d++) {
            gctx c = {.kind = k ? G_LOG_SOFTMAX : G_SOFTMAX, .dim = d, .transpose = d == -1};
            tdm_tensor *in[1] = {leaf(TDM_SHAPE(3, 4, 2), 0.0, false)};
            char what[96];
            snprintf(what, sizeof what, "grad %s dim %d%s", k ? "log_softmax" : "softmax", d,
                     c.transpose ? " (transposed)" : "");
            gradcheck(what, gfn, 1, in, &c, EPS, ATOL, RTOL);
            tdm_tensor_free(in[0]);
        }
    }
}

/* A chain through several ops, with a leaf reused: the engine adds the contributions. */
static tdm_tensor *chain_fn(tdm_tensor **in, void *ctx) {
    tdm_tensor *h = tdm_gelu(tdm_add(tdm_mul(in[0], in[1]), in[2]), false);
    tdm_tensor *p = tdm_softmax(tdm_div(h, tdm_add_scalar(tdm_exp(in[2]), 1.0f)), 1);
    return tdm_sub(tdm_mean(tdm_log_softmax(p, 0), 1, true), tdm_sigmoid(in[0]));
}

static void test_grad_chain(void) {
    tdm_tensor *in[3] = {leaf(TDM_SHAPE(4, 3), 0.1, false), leaf(TDM_SHAPE(3), 0.1, false),
                         leaf(TDM_SHAPE(4, 1), 0.1, false)};
    gradcheck("grad chain", chain_fn, 3, in, NULL, EPS, ATOL, RTOL);
    for (int i = 0; i < 3; i++) tdm_tensor_free(in[i]);
}

/* ---- kernels the ops reach only indirectly ---------------------------------------------- */

static void test_kernels(void) {
    const tdm_backend *be = tdm_backend_for(tdm_cpu(0));
    tdm_scope_begin();
    float *xv, *yv;
    tdm_tensor *x = make(TDM_SHAPE(2, 3, 4, 5), -1, 1, &xv);
    /* sum_to [2,3,4,5] -> [3,1,5] (a leading dim dropped) and -> [2,1,4,1] */
    tdm_tensor *y = tdm_empty(TDM_SHAPE(3, 1, 5), TDM_F32, tdm_cpu(0));
    CHECK(be->sum_to(y, x) == 0, "sum_to: %s", tdm_last_error());
    float e1[15] = {0};
    double acc1[15] = {0};
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 3; b++)
            for (int c = 0; c < 4; c++)
                for (int d = 0; d < 5; d++) acc1[b * 5 + d] += xv[((a * 3 + b) * 4 + c) * 5 + d];
    for (int i = 0; i < 15; i++) e1[i] = (float)acc1[i];
    check_tensor_close(y, e1, 1e-5, 1e-5, "sum_to [3,1,5]");
    y = tdm_empty(TDM_SHAPE(2, 1, 4, 1), TDM_F32, tdm_cpu(0));
    CHECK(be->sum_to(y, x) == 0, "sum_to: %s", tdm_last_error());
    float e2[8];
    for (int a = 0; a < 2; a++)
        for (int c = 0; c < 4; c++) {
            double s = 0;
            for (int b = 0; b < 3; b++)
                for (int d = 0; d < 5; d++) s += xv[((a * 3 + b) * 4 + c) * 5 + d];
            e2[a * 4 + c] = (float)s;
        }
    check_tensor_close(y, e2, 1e-5, 1e-5, "sum_to [2,1,4,1]");
    y = tdm_empty(TDM_SHAPE(3, 2, 5), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(be->sum_to(y, x) != 0, "sum_to");

    /* axpy and sum_squares */
    y = make(TDM_SHAPE(2, 3, 4, 5), -1, 1, &yv);
    CHECK(be->axpy(y, -0.5f, x) == 0, "axpy: %s", tdm_last_error());
    float e3[120];
    double sq = 0;
    for (int i = 0; i < 120; i++) {
        e3[i] = yv[i] + -0.5f * xv[i];
        sq += (double)xv[i] * xv[i];
    }
    check_tensor_close(y, e3, 1e-6, 1e-6, "axpy");
    double got = -1;
    CHECK(be->sum_squares(&got, x) == 0, "sum_squares: %s", tdm_last_error());
    CHECK_CLOSE(got, sq, 1e-9, 1e-9);
    CHECK(be->sum_squares(&got, tdm_transpose(x, 1, 3)) == 0, "sum_squares strided");
    CHECK_CLOSE(got, sq, 1e-9, 1e-9);
    free(xv);
    free(yv);
    tdm_scope_end();
}

/* ---- autograd bookkeeping and errors ---------------------------------------------------- */

static void test_recording(void) {
    tdm_scope_begin();
    tdm_tensor *a = make(TDM_SHAPE(3), 0, 1, NULL), *b = make(TDM_SHAPE(3), 0, 1, NULL);
    int before = tdm_tape_size();
    tdm_tensor *c = tdm_add(a, b);
    CHECK(c && !c->requires_grad && tdm_tape_size() == before,
          "no node when no input needs a gradient");
    tdm_requires_grad_(a, true);
    bool prev = tdm_set_grad_enabled(false);
    c = tdm_exp(a);
    CHECK(c && !c->requires_grad && tdm_tape_size() == before, "no node in no-grad mode");
    tdm_set_grad_enabled(prev);
    c = tdm_exp(a);
    CHECK(c && c->requires_grad && c->grad_fn && tdm_tape_size() == before + 1,
          "a node when an input needs a gradient");
    tdm_scope_end();

    /* no scope open and nothing to record: the caller owns and frees the result */
    tdm_tensor *x = make(TDM_SHAPE(4, 3), -1, 1, NULL);
    tdm_tensor *s = tdm_softmax(x, 0);
    tdm_tensor *xt = tdm_transpose(x, 0, 1);
    tdm_tensor *m = tdm_sum(xt, 1, false);
    tdm_tensor *am = NULL;
    tdm_tensor *mx = tdm_max(xt, 0, true, &am);
    CHECK(s && m && mx && am && !tdm_book(s)->owner && !tdm_book(am)->owner,
          "ops work without a scope");
    tdm_tensor_free(s);
    tdm_tensor_free(m);
    tdm_tensor_free(mx);
    tdm_tensor_free(am);
    tdm_tensor_free(xt);
    tdm_tensor_free(x);
}

static void test_errors(void) {
    tdm_scope_begin();
    tdm_tensor *a = tdm_zeros(TDM_SHAPE(3, 4), TDM_F32, tdm_cpu(0));
    tdm_tensor *b = tdm_zeros(TDM_SHAPE(5), TDM_F32, tdm_cpu(0));
    const tdm_tensor *r;
    const char *msg;

    tdm_clear_error();
    r = tdm_add(a, b);
    msg = tdm_last_error();
    CHECK(!r && tdm_last_status() == TDM_ERR_SHAPE && strstr(msg, "add") && strstr(msg, "[3, 4]") &&
              strstr(msg, "[5]"),
          "broadcast error names the op and both shapes: \"%s\"", msg);
    tdm_clear_error();
    r = tdm_mul(tdm_zeros(TDM_SHAPE(2, 3, 1), TDM_F32, tdm_cpu(0)),
                tdm_zeros(TDM_SHAPE(4, 2), TDM_F32, tdm_cpu(0)));
    msg = tdm_last_error();
    CHECK(!r && strstr(msg, "mul") && strstr(msg, "[2, 3, 1]") && strstr(msg, "[4, 2]"),
          "broadcast error: \"%s\"", msg);
    tdm_clear_error();

    tdm_tensor *ints = tdm_zeros(TDM_SHAPE(3), TDM_I32, tdm_cpu(0));
    r = tdm_exp(ints);
    CHECK(!r && tdm_last_status() == TDM_ERR_DTYPE, "exp of i32 is a dtype error");
    CHECK_ERROR(r == NULL, "i32");
    CHECK_ERROR(tdm_add(a, tdm_zeros(TDM_SHAPE(4), TDM_I64, tdm_cpu(0))) == NULL, "i64");
    CHECK_ERROR(tdm_softmax(ints, 0) == NULL, "softmax");

    /* NULL inputs: NULL back, no crash, and the first error survives a chain */
    tdm_clear_error();
    CHECK(tdm_exp(NULL) == NULL && tdm_last_status() == TDM_ERR_ARG, "exp(NULL)");
    tdm_clear_error();
    r = tdm_sum_all(tdm_relu(tdm_add(a, b)));
    msg = tdm_last_error();
    CHECK(!r && tdm_last_status() == TDM_ERR_SHAPE && strstr(msg, "add"),
          "the first error of a chain is kept: \"%s\"", msg);
    tdm_clear_error();
    tdm_tensor *am = a;
    CHECK(tdm_add(NULL, a) == NULL && tdm_sub(a, NULL) == NULL && tdm_mul(NULL, NULL) == NULL &&
              tdm_div(NULL, b) == NULL && tdm_add_scalar(NULL, 1) == NULL &&
              tdm_mul_scalar(NULL, 1) == NULL && tdm_pow_scalar(NULL, 2) == NULL &&
              tdm_neg(NULL) == NULL && tdm_log(NULL) == NULL && tdm_sqrt(NULL) == NULL &&
              tdm_gelu(NULL, true) == NULL && tdm_tanh(NULL) == NULL && tdm_sigmoid(NULL) == NULL &&
              tdm_softsign(NULL) == NULL && tdm_sum(NULL, 0, false) == NULL &&
              tdm_mean(NULL, 0, true) == NULL && tdm_max(NULL, 0, false, &am) == NULL &&
              am == NULL && tdm_mean_all(NULL) == NULL && tdm_softmax(NULL, 0) == NULL &&
              tdm_log_softmax(NULL, -1) == NULL,
          "every op returns NULL for NULL");
    tdm_clear_error();

    CHECK_ERROR(tdm_sum(a, 2, false) == NULL, "sum: dim 2");
    CHECK_ERROR(tdm_log_softmax(a, -3) == NULL, "log_softmax");
    CHECK_ERROR(tdm_max(tdm_zeros(TDM_SHAPE(2, 0), TDM_F32, tdm_cpu(0)), 1, false, NULL) == NULL,
                "max: dim 1 of [2, 0] is empty");
    tdm_scope_end();
}

int main(void) {
    test_mul_sum_by_hand();
    test_binary_forward();
    test_unary_forward();
    test_softsign_by_hand();
    test_reductions_forward();
    test_softmax_forward();
    test_kernels();
    test_grad_binary();
    test_grad_unary();
    test_grad_reductions();
    test_grad_softmax();
    test_grad_chain();
    test_recording();
    test_errors();
    return check_summary();
}
