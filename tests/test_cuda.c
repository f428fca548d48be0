/* The CUDA backend's kernels against the CPU backend's.
 *
 * A table in the manner of ggml's test-backend-ops, one row per kernel (or per op): a row's
 * builder draws inputs from a seeded generator, runs its kernels forward (and backward) on
 * one device, and keeps what they wrote. The driver runs every row on cpu:0 and twice on
 * cuda:0, and compares each output and gradient of cuda:0 with cpu:0's within the row's
 * bound (relative to the CPU's value, plus a small absolute term where results cancel to ~0),
 * and the two GPU runs bit for bit (the backend is deterministic). Every kernel of backend.h
 * must have a row (checked), and a GPT's gradients have one too. Then the bad conditions: a
 * GPU that is not there, an allocation no GPU can hold. Training, DataParallel, pipelines and
 * the loader on GPUs are test_cuda_train.c's.
 *
 * Without the CUDA backend or without a GPU the test prints why and exits 77, which CTest
 * reports as skipped. (GPU throughput next to cuBLAS is bench/bench_cuda.c's.)
 *
 * bf16 and f16 (issue 37): the rows of the kernels a training step runs again with the GPU's
 * tensors in each low precision and the CPU's f32 kernels on the same values rounded to it
 * (place, settle), compared within the f32 row's bound plus one output rounding (widened).
 *
 * Over the ~800 lines a file is kept under: the builders keep every shape and variant the
 * hand-written comparisons had (about 430 lines), and the bf16 and f16 rows reuse them rather
 * than repeat them (about 150 lines of helpers and rows); training on GPUs is already apart. */
#include "attention_slack.h"
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
#include "tandem/half.h"

#include <ctype.h>
#include <stdarg.h>

static const tdm_backend *CPU, *GPU;
static tdm_device G; /* cuda:0 */

/* ---- rows, runs, what a run keeps -------------------------------------------------------- */

/* A bound on |cuda - cpu|, element-wise: atol + rtol * |cpu| (NaN must meet NaN). */
typedef struct {
    double atol, rtol;
} bound;
/* clang-format off */
#define EXACT {0, 0}
/* clang-format on */

typedef struct run run;

typedef struct {
    const char *name; /* the kernels it runs, named as in backend.h (see covered) */
    void (*build)(run *r);
    bound out, grad; /* for its outputs; for its gradients */
    /* the floating dtype of the GPU's tensors (f32 unless said): a bf16 or f16 row runs the
     * CPU's f32 kernels on the same inputs rounded to it (see place) */
    tdm_dtype dt;
} row;

/* An output or a gradient, as doubles on the host. */
typedef struct {
    char name[96];
    double *v;
    int64_t n;
    bound b;
    tdm_dtype dt;  /* bf16 or f16 where the GPU alone rounded them so (see widened) */
    double *slack; /* NULL, or per element, added to the bound (malloc'd: the run owns it) */
} kept;

/* A run of a row on one device: its builder draws inputs from rng (the same draws on every
 * device), runs be's kernels with KERNEL and keeps results with out(), grad() or keep(). */
struct run {
    const row *row;
    const tdm_backend *be;
    tdm_device dev;
    const char *on; /* the device, for messages */
    tdm_dtype dt;   /* the builder's float tensors: the row's dtype on cuda:0, f32 on cpu:0 */
    tdm_rng rng;
    char label[48]; /* the variant being built ("case 2"), prefixed to what is kept */
    kept *kept;
    int n_kept;
    char failed[256]; /* the first kernel that returned an error, and the error */
};

/* ---- what builders call ------------------------------------------------------------------ */

/* Names the variant built next, for messages: "case 2", "exp(s=0.7)". */
static void variant(run *r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->label, sizeof r->label, fmt, ap);
    va_end(ap);
}

/* A call's status: the run fails on its first error, which the driver reports. */
static void ok(run *r, int rc, const char *what) {
    if (rc != TDM_OK && !r->failed[0])
        snprintf(r->failed, sizeof r->failed, "%s %s: %s", r->label, what, tdm_last_error());
}
#define KERNEL(r, k, ...)              ok(r, (r)->be->k(__VA_ARGS__), #k)

/* A call that must fail, on every device, with an error containing substr. */
static void fails(run *r, int rc, const char *substr) {
    CHECK(rc != TDM_OK && strstr(tdm_last_error(), substr),
          "%s on %s: %s: expected an error containing \"%s\", got \"%s\"", r->row->name, r->on,
          r->label, substr, tdm_last_error());
    tdm_clear_error();
}

/* Keeps n values (malloc'd: the run owns them now) under name, to compare within b. */
static void keep_values(run *r, const char *name, double *v, int64_t n, bound b) {
    r->kept = realloc(r->kept, sizeof(kept) * (size_t)(r->n_kept + 1));
    kept *k = &r->kept[r->n_kept++];
    snprintf(k->name, sizeof k->name, "%s%s%s", r->label, r->label[0] ? " " : "", name);
    k->v = v, k->n = n, k->b = b, k->dt = TDM_F32, k->slack = NULL;
}

static bool low(tdm_dtype dt) {
    return dt == TDM_BF16 || dt == TDM_F16;
}

/* Keeps t's values as they are now (a later kernel may overwrite t). A strided t is read
 * through its backend's to_host; integers through i64; bf16 and f16 converted by half.h. */
static void keep(run *r, const char *name, const tdm_tensor *t, bound b) {
    int64_t n = t ? tdm_numel(t) : 0;
    if (t && low(t->dtype)) {
        uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(n + 1));
        double *v = calloc((size_t)(n + 1), sizeof(double));
        ok(r, r->be->to_host(h, t), name);
        for (int64_t i = 0; i < n; i++)
            v[i] = t->dtype == TDM_BF16 ? tdm_bf16_to_float(h[i]) : tdm_f16_to_float(h[i]);
        free(h);
        keep_values(r, name, v, n, b);
        /* rounded by the GPU alone in a bf16 or f16 row; by both alike in an f32 row's
         * conversions (case_half_copy), which compare exactly */
        r->kept[r->n_kept - 1].dt = r->row->dt == TDM_F32 ? TDM_F32 : t->dtype;
        return;
    }
    bool f32 = t && t->dtype == TDM_F32;
    const tdm_tensor *h = f32 || !t ? t : tdm_cast(t, TDM_I64);
    void *raw = malloc(sizeof(int64_t) * (size_t)(n + 1));
    double *v = calloc((size_t)(n + 1), sizeof(double));
    ok(r, h ? tdm_to_host(h, raw, (f32 ? 4 : 8) * (size_t)n) : TDM_ERR_STATE, name);
    for (int64_t i = 0; h && i < n; i++)
        v[i] = f32 ? ((float *)raw)[i] : (double)((int64_t *)raw)[i];
    free(raw);
    keep_values(r, name, v, n, b);
}

/* Keeps the tensors that follow, one for each word of names ("gx gw gb"), within b. */
static void keep_each(run *r, bound b, const char *names, va_list ap) {
    for (const char *p = names; *p; p += p[strcspn(p, " ")] ? strcspn(p, " ") + 1 : strlen(p)) {
        char name[32];
        snprintf(name, sizeof name, "%.*s", (int)strcspn(p, " "), p);
        keep(r, name, va_arg(ap, const tdm_tensor *), b);
    }
}

/* Outputs, within the row's out bound: out(r, "y lse", y, lse). */
static void out(run *r, const char *names, ...) {
    va_list ap;
    va_start(ap, names);
    keep_each(r, r->row->out, names, ap);
    va_end(ap);
}

/* Gradients, within the row's grad bound. */
static void grad(run *r, const char *names, ...) {
    va_list ap;
    va_start(ap, names);
    keep_each(r, r->row->grad, names, ap);
    va_end(ap);
}

/* A kernel that rounds an intermediate to the row's dtype before its last operation, as the
 * two kernels it stands for round it (their bits): the last value kept gets half an ulp of
 * scale[i] of slack (scale: the CPU's values of that intermediate's effect; NULL: the kept
 * value itself) on top of the row's bound, which allows one rounding. */
static void slack_rounding(run *r, const double *scale) {
    if (r->be != CPU || !low(r->row->dt)) return;
    kept *k = &r->kept[r->n_kept - 1];
    double u = r->row->dt == TDM_BF16 ? 0x1p-8 : 0x1p-11,
           tiny = r->row->dt == TDM_F16 ? 0x1p-25 : 0;
    k->slack = malloc(sizeof(double) * (size_t)(k->n + 1));
    for (int64_t i = 0; i < k->n; i++) k->slack[i] = u * fabs(scale ? scale[i] : k->v[i]) + tiny;
}

/* v rounded to dt (f32: itself) and back: a value the GPU's dt tensor holds exactly. */
static float rounded(float v, tdm_dtype dt) {
    return dt == TDM_BF16  ? tdm_bf16_to_float(tdm_bf16_from_float(v))
           : dt == TDM_F16 ? tdm_f16_to_float(tdm_f16_from_float(v))
                           : v;
}

/* Rounds a CPU f32 tensor's values to the row's dtype, in place (a no-op for f32 rows): the
 * CPU's copy of a value that the GPU holds in that dtype, such as a forward's output that a
 * backward reads. */
static void settle(run *r, tdm_tensor *t) {
    if (r->row->dt == TDM_F32 || t->device.type != TDM_CPU) return; /* a GPU's: in it already */
    float *p = tdm_data_ptr(t);
    for (int64_t i = 0; i < tdm_numel(t); i++) p[i] = rounded(p[i], r->row->dt);
}

/* A zeroed tensor of dtype dt on the run's device. */
static tdm_tensor *zeros_of(run *r, tdm_shape s, tdm_dtype dt) {
    tdm_tensor *t = tdm_tensor_alloc(s, dt, r->dev);
    if (t) ok(r, r->be->fill(t, 0.0), "fill");
    return t;
}

/* Host f32 values of x, rounded to the row's dtype, on the run's device in its dtype (f32
 * ones when keep32). */
static tdm_tensor *place(run *r, tdm_tensor *x, bool keep32) {
    if (!keep32) settle(r, x);
    if (keep32 || r->dt == TDM_F32) return tdm_to_device(x, r->dev);
    int64_t n = tdm_numel(x);
    const float *p = tdm_data_ptr(x);
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(n + 1));
    for (int64_t i = 0; i < n; i++)
        h[i] = r->dt == TDM_BF16 ? tdm_bf16_from_float(p[i]) : tdm_f16_from_float(p[i]);
    tdm_tensor *t = tdm_tensor_alloc(tdm_shape_of(x), r->dt, r->dev);
    if (t) ok(r, r->be->from_host(t, h), "from_host");
    free(h);
    return t;
}

/* N(mean, sd^2) draws, on the run's device in the run's dtype; randn32's stay f32 (weights,
 * statistics and losses, which mixed precision keeps in f32). */
static tdm_tensor *randn(run *r, tdm_shape s, float mean, float sd) {
    return place(r, tdm_randn(s, mean, sd, tdm_cpu(0), &r->rng), false);
}
static tdm_tensor *randn32(run *r, tdm_shape s, float mean, float sd) {
    return place(r, tdm_randn(s, mean, sd, tdm_cpu(0), &r->rng), true);
}

/* x^2 + 0.5 for x ~ N(0, 1): inputs that keep log, sqrt, powers and variances finite. */
static tdm_tensor *positive_of(run *r, tdm_shape s, bool keep32) {
    tdm_tensor *x = tdm_randn(s, 0, 1, tdm_cpu(0), &r->rng);
    float *p = tdm_data_ptr(x);
    for (int64_t i = 0; i < tdm_numel(x); i++) p[i] = p[i] * p[i] + 0.5f;
    return place(r, x, keep32);
}
static tdm_tensor *positive(run *r, tdm_shape s) {
    return positive_of(r, s, false);
}

/* Host values (f32, in the run's dtype, or i64 to be stored as dt) on the run's device. */
static tdm_tensor *from(run *r, tdm_shape s, tdm_dtype dt, const void *host) {
    tdm_tensor *t = tdm_from_data(s, dt == TDM_F32 ? TDM_F32 : TDM_I64, tdm_cpu(0), host);
    if (dt == TDM_F32) return place(r, t, false);
    return tdm_to_device(dt == TDM_I32 ? tdm_cast(t, dt) : t, r->dev);
}

/* Outputs, written by the kernels: in the run's dtype (zeros32: f32); like t: t's dtype. */
static tdm_tensor *zeros(run *r, tdm_shape s) {
    return zeros_of(r, s, r->dt);
}
static tdm_tensor *zeros32(run *r, tdm_shape s) {
    return zeros_of(r, s, TDM_F32);
}

static tdm_tensor *like(run *r, const tdm_tensor *t) {
    return zeros_of(r, tdm_shape_of(t), t->dtype);
}

/* A view of t with other geometry: a transpose, a broadcast (stride 0), every other column. */
static tdm_tensor *view(tdm_tensor *t, int nd, const int64_t *shape, const int64_t *strides) {
    return tdm_tensor_view(t, nd, shape, strides, t->offset);
}

static tdm_tensor *transposed(tdm_tensor *t) {
    return view(t, 2, (int64_t[]){t->shape[1], t->shape[0]}, (int64_t[]){1, t->shape[1]});
}

/* ---- memory, copies, random -------------------------------------------------------------- */

static void case_to_host(run *r) {
    tdm_tensor *x = randn(r, TDM_SHAPE(7, 33), 0, 1);
    out(r, "round_trip transposed", x, transposed(x));
}

/* A transposed view copied, then f32 -> i32 -> i64 -> f32, truncating as C casts do. */
static void case_copy(run *r) {
    tdm_tensor *x = randn(r, TDM_SHAPE(7, 33), 0, 1), *c = zeros(r, TDM_SHAPE(33, 7));
    tdm_tensor *f = randn(r, TDM_SHAPE(50), 0, 1000), *back = zeros(r, TDM_SHAPE(50));
    tdm_tensor *i32 = tdm_zeros(TDM_SHAPE(50), TDM_I32, r->dev);
    tdm_tensor *i64 = tdm_zeros(TDM_SHAPE(50), TDM_I64, r->dev);
    KERNEL(r, copy, c, transposed(x));
    KERNEL(r, copy, i32, f);
    KERNEL(r, copy, i64, i32);
    KERNEL(r, copy, back, i64);
    out(r, "transposed f32_to_i32 i32_to_i64 i64_to_f32", c, i32, i64, back);
}

static void case_fill(run *r) {
    tdm_tensor *z = randn(r, TDM_SHAPE(6, 8), 0, 1);
    KERNEL(r, fill, view(z, 2, (int64_t[]){6, 4}, (int64_t[]){8, 2}), 2.5);
    out(r, "every_other_column", z);
}

/* a count kept on the device: 2^40 + 2 after two steps (beyond f32's 24 bits: exact in i64),
 * compared as the f32 of its distance from 2^40 */
static void case_count_up(run *r) {
    tdm_tensor *n = zeros_of(r, TDM_SHAPE0, TDM_I64), *f = zeros32(r, TDM_SHAPE0);
    KERNEL(r, fill, n, 1099511627776.0);
    KERNEL(r, count_up, n);
    KERNEL(r, count_up, n);
    int64_t got = 0;
    ok(r, r->be->to_host(&got, n), "to_host");
    float d = (float)(got - 1099511627776LL);
    ok(r, r->be->from_host(f, &d), "from_host");
    out(r, "count", f);
    fails(r, r->be->count_up(f), "a count is one i64 element");
}

static void case_random(run *r) {
    tdm_tensor *u = zeros(r, TDM_SHAPE(1001)), *g = zeros(r, TDM_SHAPE(999));
    KERNEL(r, random, u, 0, -2, 3, 42, 5);
    KERNEL(r, random, g, 1, 1, 2, 42, 7);
    out(r, "uniform", u);
    /* through double log/cos, where CUDA's libm and glibc may differ in the last bit */
    keep(r, "normal", g, (bound){1e-6, 1e-6});
}

/* f32 to bf16 and f16 and back (copy) at the roundings' edges: ties to even, the last finite
 * values and past them, subnormals, signed zero, infinities, NaN; into a strided view; fill;
 * uniform draws (the GPU's rounded in the kernel, the CPU's f32 draws copied). Both devices
 * round with half.h's rules, so every bit agrees but the draws'. */
static void case_half_copy(run *r) {
    float v[64] = {1.0f,     1.00390625f, 1.01171875f, 1.0009765625f, 1.0029296875f,
                   65504.0f, 65519.0f,    65520.0f,    3.3895e38f,    3.4e38f,
                   6e-8f,    2.9e-8f,     3e-8f,       1e-40f,        -0.0f,
                   INFINITY, -INFINITY,   NAN,         0.1f,          -2.5f};
    for (int i = 20; i < 64; i++) v[i] = (float)(i - 40) * 37.3f + 0.013f * (float)i;
    tdm_tensor *x = tdm_to_device(tdm_from_data(TDM_SHAPE(8, 8), TDM_F32, tdm_cpu(0), v), r->dev);
    for (int k = 0; k < 2; k++) {
        tdm_dtype dt = k ? TDM_F16 : TDM_BF16;
        tdm_tensor *h = zeros_of(r, TDM_SHAPE(8, 8), dt), *back = zeros32(r, TDM_SHAPE(8, 8));
        tdm_tensor *ht = zeros_of(r, TDM_SHAPE(8, 8), dt), *u = zeros_of(r, TDM_SHAPE(999), dt);
        variant(r, "%s", tdm_dtype_name(dt));
        KERNEL(r, copy, h, x);
        KERNEL(r, copy, back, h);
        KERNEL(r, copy, ht, transposed(h)); /* a strided same-dtype copy: the bits */
        KERNEL(r, fill, view(ht, 2, (int64_t[]){8, 4}, (int64_t[]){8, 2}), 0.1);
        if (r->be == GPU) {
            KERNEL(r, random, u, 0, -2, 3, 42, 5);
        } else {
            tdm_tensor *uf = zeros32(r, TDM_SHAPE(999));
            KERNEL(r, random, uf, 0, -2, 3, 42, 5);
            KERNEL(r, copy, u, uf);
        }
        out(r, "rounded back transposed_filled", h, back, ht);
        /* the f32 draws may differ by one rounding (random's row), which rounding to dt may
         * turn into one ulp of dt: 2^-7 of the value in bf16, 2^-10 in f16 */
        keep(r, "uniform", u, (bound){1e-6, k ? 0x1p-10 : 0x1p-7});
    }
}

/* ---- element-wise ------------------------------------------------------------------------ */

/* Every unary op (powers of three exponents) on a transposed view: the strided path. */
static void case_unary(run *r) {
    const char *names[] = {"neg",  "exp",     "log",   "sqrt",  "relu",  "gelu_tanh", "gelu",
                           "tanh", "sigmoid", "add_s", "mul_s", "pow_s", "softsign"};
    _Static_assert(sizeof names / sizeof names[0] == TDM_UN_LAST + 1, "a name for every op");
    float pows[] = {2.0f, 3.0f, -1.5f};
    for (int op = TDM_UN_NEG; op <= TDM_UN_LAST; op++)
        for (int i = 0; i < (op == TDM_UN_POW_SCALAR ? 3 : 1); i++) {
            float s = op == TDM_UN_POW_SCALAR ? pows[i] : 0.7f;
            bool pos = op == TDM_UN_LOG || op == TDM_UN_SQRT || op == TDM_UN_POW_SCALAR;
            tdm_shape xs = TDM_SHAPE(40, 30);
            tdm_tensor *x = transposed(pos ? positive(r, xs) : randn(r, xs, 0, 1));
            tdm_tensor *gy = randn(r, TDM_SHAPE(30, 40), 0, 1), *y = like(r, gy), *gx = like(r, gy);
            variant(r, "%s(s=%g)", names[op], s);
            KERNEL(r, unary, op, y, x, s);
            settle(r, y); /* the backward reads the GPU's rounded y */
            KERNEL(r, unary_backward, op, gx, gy, x, y, s);
            out(r, "y", y);
            grad(r, "gx", gx);
        }
}

/* a op b with b broadcast along the rows, and c op a with c along the columns (stride 0). */
static void case_binary(run *r) {
    const char *names[] = {"add", "sub", "mul", "div"};
    int64_t sh[2] = {17, 23};
    for (int op = TDM_BIN_ADD; op <= TDM_BIN_DIV; op++) {
        tdm_tensor *a = randn(r, TDM_SHAPE(17, 23), 0, 1), *y = like(r, a), *y2 = like(r, a);
        /* mean 3: no division by ~0 */
        tdm_tensor *b = view(randn(r, TDM_SHAPE(23), 3, 1), 2, sh, (int64_t[]){0, 1});
        tdm_tensor *c = view(randn(r, TDM_SHAPE(17, 1), 3, 1), 2, sh, (int64_t[]){1, 0});
        variant(r, "%s", names[op]);
        KERNEL(r, binary, op, y, a, b);
        KERNEL(r, binary, op, y2, c, a);
        out(r, "row_broadcast column_broadcast", y, y2);
        if (r->row->dt == TDM_F32) continue;
        /* a low-precision a with an f32 operand into f32, as PyTorch promotes: one float
         * operation on the same values on both sides */
        tdm_tensor *f = randn32(r, TDM_SHAPE(17, 23), 3, 1), *yf = zeros32(r, TDM_SHAPE(17, 23));
        KERNEL(r, binary, op, yf, a, f);
        keep(r, "mixed_into_f32", yf, (bound)EXACT);
    }
}

static void case_axpy(run *r) {
    tdm_tensor *y = randn(r, TDM_SHAPE(1000), 0, 1), *x = randn(r, TDM_SHAPE(1000), 0, 1);
    KERNEL(r, axpy, y, -0.3f, x);
    out(r, "y", y);
    if (r->row->dt == TDM_F32) return;
    tdm_tensor *yf = randn32(r, TDM_SHAPE(1000), 0, 1); /* a low x into an f32 gradient */
    KERNEL(r, axpy, yf, -0.3f, x);
    keep(r, "into_f32", yf, (bound){1e-7, 1e-6});
}

/* ---- reductions -------------------------------------------------------------------------- */

/* Sum, mean and max over each dim of three shapes (long and short rows); max (exact), its
 * argmax and backward. Then a NaN wins max and ties go to the first index, in both kernels. */
static void case_reduce(run *r) {
    const char *names[] = {"sum", "mean", "max"};
    tdm_shape shapes[] = {TDM_SHAPE(5, 300, 7), TDM_SHAPE(3, 5000), TDM_SHAPE(4, 2, 9)};
    for (int si = 0; si < 3; si++)
        for (int dim = 0; dim < shapes[si].ndim; dim++) {
            tdm_shape s = shapes[si], ys = s;
            ys.d[dim] = 1;
            tdm_tensor *x = randn(r, s, 0, 1), *gy = randn(r, ys, 0, 1), *gx = like(r, x);
            tdm_tensor *am = tdm_zeros(ys, TDM_I64, r->dev);
            variant(r, "shape %d dim %d", si, dim);
            for (int op = TDM_RED_SUM; op <= TDM_RED_MAX; op++) {
                tdm_tensor *y = zeros(r, ys);
                KERNEL(r, reduce, op, y, x, dim, am);
                keep(r, names[op], y, op == TDM_RED_MAX ? (bound)EXACT : r->row->out);
            }
            KERNEL(r, max_backward, gx, gy, am, dim);
            keep(r, "argmax", am, (bound)EXACT);
            grad(r, "max_backward", gx);
        }
    float v[600];
    for (int i = 0; i < 600; i++) v[i] = (float)(i % 7);
    v[400] = NAN;
    tdm_tensor *x = from(r, TDM_SHAPE(2, 300), TDM_F32, v), *y = zeros(r, TDM_SHAPE(2));
    tdm_tensor *am = tdm_zeros(TDM_SHAPE(2), TDM_I64, r->dev);
    variant(r, "NaN and ties");
    KERNEL(r, reduce, TDM_RED_MAX, y, x, 1, am);
    keep(r, "max", y, (bound)EXACT);
    keep(r, "argmax", am, (bound)EXACT);
}

static void case_sum_to(run *r) {
    /* the last two: a bias's gradient (leading dims summed) in several row parts */
    tdm_shape xs[] = {TDM_SHAPE(4, 6, 5), TDM_SHAPE(4, 6, 5),   TDM_SHAPE(4, 6, 5),
                      TDM_SHAPE(64, 300), TDM_SHAPE(8192, 3),   TDM_SHAPE(3, 4),
                      TDM_SHAPE(2, 3, 4), TDM_SHAPE(3, 200, 70)};
    tdm_shape ys[] = {TDM_SHAPE(6, 1), TDM_SHAPE(1, 5), TDM_SHAPE(5), TDM_SHAPE(300),
                      TDM_SHAPE(1, 3), TDM_SHAPE(3, 4), TDM_SHAPE0,   TDM_SHAPE(1, 70)};
    for (int i = 0; i < 8; i++) {
        tdm_tensor *x = randn(r, xs[i], 0, 1), *y = zeros(r, ys[i]);
        variant(r, "case %d", i);
        KERNEL(r, sum_to, y, x);
        out(r, "y", y);
    }
}

static void case_softmax(run *r) {
    tdm_shape shapes[] = {TDM_SHAPE(37, 1000), TDM_SHAPE(5, 10), TDM_SHAPE(3, 4, 70)};
    for (int si = 0; si < 3; si++)
        for (int lg = 0; lg < 2; lg++) {
            tdm_tensor *x = randn(r, shapes[si], 0, 4), *gy = randn(r, shapes[si], 0, 1);
            tdm_tensor *y = like(r, x), *gx = like(r, x);
            variant(r, "%s shape %d", lg ? "log_softmax" : "softmax", si);
            KERNEL(r, softmax, y, x, lg);
            settle(r, y);
            KERNEL(r, softmax_backward, gx, gy, y, lg);
            out(r, "y", y);
            grad(r, "gx", gx);
        }
}

/* Of a transposed view, into a double on the host. */
static void case_sum_squares(run *r) {
    tdm_tensor *x = randn(r, TDM_SHAPE(123, 457), 0, 1);
    double *s = calloc(1, sizeof(double));
    KERNEL(r, sum_squares, s, transposed(x));
    keep_values(r, "sum", s, 1, r->row->out);
}

/* ---- linear algebra, indexing ------------------------------------------------------------ */

/* Each transpose of a and b, with beta 0, and with a broadcast over the batch (stride 0) and
 * c accumulated (beta 1). */
static void case_matmul(run *r) {
    int64_t B = 3, n = 37, m = 29, k = 301;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int bc = 0; bc < 2; bc++) {
                tdm_tensor *a = randn(r, ta ? TDM_SHAPE(B, k, n) : TDM_SHAPE(B, n, k), 0, 1);
                tdm_tensor *b = randn(r, tb ? TDM_SHAPE(B, m, k) : TDM_SHAPE(B, k, m), 0, 1);
                tdm_tensor *c = randn(r, TDM_SHAPE(B, n, m), 0, 1);
                if (bc)
                    a = view(a, 3, (int64_t[]){B, a->shape[1], a->shape[2]},
                             (int64_t[]){0, a->strides[1], 1});
                variant(r, "ta=%d tb=%d %s", ta, tb, bc ? "broadcast a, beta 1" : "beta 0");
                KERNEL(r, matmul, c, a, b, ta, tb, bc ? 1.0f : 0.0f);
                out(r, "c", c);
                if (r->row->dt == TDM_F32 || bc) continue;
                tdm_tensor *cf = zeros32(r, tdm_shape_of(c)); /* bf16 products kept in f32 */
                KERNEL(r, matmul, cf, a, b, ta, tb, 0.0f);
                keep(r, "c_f32", cf, (bound){1e-4, 1e-4});
            }
}

/* nn's linear with a bias (a GPU's cuBLASLt epilogue) and without, at odd sizes; a row view of
 * x (an offset that is not 256-byte aligned: cuBLASLt told the alignment it may assume). */
static void case_linear(run *r) {
    int64_t M = 37, n_out = 29, in = 301;
    tdm_tensor *x = randn(r, TDM_SHAPE(1, M + 1, in), 0, 1),
               *w = randn(r, TDM_SHAPE(1, n_out, in), 0, 1);
    tdm_tensor *b = randn(r, TDM_SHAPE(n_out), 0, 1), *y = zeros(r, TDM_SHAPE(1, M, n_out));
    tdm_tensor *y0 = zeros(r, TDM_SHAPE(1, M, n_out));
    tdm_tensor *xv = tdm_tensor_view(x, 3, (int64_t[]){1, M, in}, (int64_t[]){M * in, in, 1},
                                     x->offset + in); /* rows 1..M */
    KERNEL(r, linear, y, xv, w, b);
    KERNEL(r, linear, y0, xv, w, NULL);
    out(r, "y y_no_bias", y, y0);
}

/* A linear's weight and bias gradients (on a GPU the bias's in cuBLASLt's BGRADB epilogue):
 * gw written (beta 0) and added to (beta 1), with gb and without (the plain product), and gb
 * alone (the column sums without a product); gy's columns summed over M = 301 rows. */
static void case_linear_wgrad(run *r) {
    int64_t M = 301, n_out = 29, in = 40;
    tdm_tensor *gy = randn(r, TDM_SHAPE(1, M, n_out), 0, 1),
               *x = randn(r, TDM_SHAPE(1, M, in), 0, 1);
    tdm_tensor *gw = zeros(r, TDM_SHAPE(1, n_out, in)), *gb = zeros(r, TDM_SHAPE(n_out));
    tdm_tensor *acc = randn(r, TDM_SHAPE(1, n_out, in), 0, 1),
               *gw0 = zeros(r, TDM_SHAPE(1, n_out, in));
    tdm_tensor *gb1 = zeros(r, TDM_SHAPE(n_out)), *gb0 = zeros(r, TDM_SHAPE(n_out));
    KERNEL(r, linear_wgrad, gw, gb, gy, x, 0.0f);
    KERNEL(r, linear_wgrad, acc, gb1, gy, x, 1.0f);
    KERNEL(r, linear_wgrad, gw0, NULL, gy, x, 0.0f);
    KERNEL(r, linear_wgrad, NULL, gb0, gy, x, 0.0f);
    grad(r, "gw gb gw_added gb_again gw_alone gb_alone", gw, gb, acc, gb1, gw0, gb0);
}

/* nn's linear_gelu: 32 outputs (a GPU's cuBLASLt epilogue: the GELU's input stored with a
 * leading dimension of a multiple of 8, the GELU taken of the f32 sum, as the CPU's f32
 * reference) and 29 (linear, then the unary GELU of pre as rounded to the row's dtype: y is
 * checked on the GPU against that GELU of the GPU's pre, bit for bit, and pre against the CPU's).
 */
static void case_linear_gelu(run *r) {
    for (int i = 0; i < 2; i++) {
        int64_t M = 37, n_out = i ? 29 : 32, in = 301;
        tdm_tensor *x = randn(r, TDM_SHAPE(1, M, in), 0, 1);
        tdm_tensor *w = randn(r, TDM_SHAPE(1, n_out, in), 0, 0.1f);
        tdm_tensor *b = randn(r, TDM_SHAPE(n_out), 0, 1), *y = zeros(r, TDM_SHAPE(1, M, n_out));
        tdm_tensor *pre = zeros(r, TDM_SHAPE(1, M, n_out)), *g = zeros(r, TDM_SHAPE(1, M, n_out));
        variant(r, "%lld outputs", (long long)n_out);
        KERNEL(r, linear_gelu, y, pre, x, w, b);
        out(r, "pre", pre);
        if (!i) {
            out(r, "y", y);
            continue;
        }
        KERNEL(r, unary, TDM_UN_GELU_TANH, g, pre, 0.0f);
        size_t nb = (size_t)(M * n_out) * tdm_dtype_size(y->dtype);
        void *hy = malloc(nb), *hg = malloc(nb);
        CHECK(hy && hg && !tdm_to_host(y, hy, nb) && !tdm_to_host(g, hg, nb) && !memcmp(hy, hg, nb),
              "%s on %s: 29 outputs: y is not the unary GELU of pre", r->row->name, r->on);
        free(hy), free(hg);
    }
}

/* gpre = (gy @ w) * GELU'(pre): with 32 inputs through cuBLASLt's DGELU epilogue (the GELU'
 * of the f32 sums; the CPU rounds the product first), with 29 (no aux of a multiple of 8)
 * through the fallback, which must be the GPU's own matmul then unary_backward, bit for bit. */
static void case_linear_dgelu(run *r) {
    for (int i = 0; i < 2; i++) {
        int64_t M = 37, mid = i ? 29 : 32, n_out = 301;
        tdm_tensor *gy = randn(r, TDM_SHAPE(1, M, n_out), 0, 1);
        tdm_tensor *w = randn(r, TDM_SHAPE(1, n_out, mid), 0, 0.1f);
        tdm_tensor *pre = randn(r, TDM_SHAPE(1, M, mid), 0, 2);
        tdm_tensor *gpre = zeros(r, TDM_SHAPE(1, M, mid)), *g = zeros(r, TDM_SHAPE(1, M, mid));
        variant(r, "%lld inputs", (long long)mid);
        KERNEL(r, linear_dgelu, gpre, gy, w, pre);
        grad(r, "gpre", gpre);
        if (!i) continue;
        slack_rounding(r, NULL); /* the fallback rounds gy @ w before GELU' */
        KERNEL(r, matmul, g, gy, w, false, false, 0.0f);
        KERNEL(r, unary_backward, TDM_UN_GELU_TANH, g, g, pre, NULL, 0.0f);
        size_t nb = (size_t)(M * mid) * tdm_dtype_size(g->dtype);
        void *ha = malloc(nb), *hb = malloc(nb);
        CHECK(ha && hb && !tdm_to_host(gpre, ha, nb) && !tdm_to_host(g, hb, nb) &&
                  !memcmp(ha, hb, nb),
              "%s on %s: 29 inputs: gpre is not matmul then unary_backward", r->row->name, r->on);
        free(ha), free(hb);
    }
}

/* Along dims 0 and 1, i32 and i64 indices with repeats (index_add sums them in order: exact);
 * an index out of range is an error naming it and its position. */
static void case_index(run *r) {
    int64_t iv[6] = {3, 0, 3, 9, 1, 3}, bad[3] = {1, 2, 10};
    for (int dt = 0; dt < 2; dt++) {
        tdm_dtype idt = dt ? TDM_I64 : TDM_I32;
        tdm_tensor *idx = from(r, TDM_SHAPE(6), idt, iv), *bi = from(r, TDM_SHAPE(3), idt, bad);
        tdm_tensor *x = randn(r, TDM_SHAPE(10, 4, 3), 0, 1), *y0 = zeros(r, TDM_SHAPE(6, 4, 3));
        tdm_tensor *x2 = randn(r, TDM_SHAPE(2, 10, 5), 0, 1), *y1 = zeros(r, TDM_SHAPE(2, 6, 5));
        tdm_tensor *gx = randn(r, TDM_SHAPE(2, 10, 5), 0, 1), *yb = zeros(r, TDM_SHAPE(3, 4, 3));
        variant(r, "%s indices", dt ? "i64" : "i32");
        KERNEL(r, index_select, y0, x, 0, idx);
        KERNEL(r, index_select, y1, x2, 1, idx);
        KERNEL(r, index_add, gx, 1, idx, y1);
        out(r, "dim_0 dim_1", y0, y1);
        grad(r, "index_add", gx);
        if (r->row->dt != TDM_F32) { /* an embedding's f32 table, its gradient from a low gy */
            tdm_tensor *gf = randn32(r, TDM_SHAPE(2, 10, 5), 0, 1);
            KERNEL(r, index_add, gf, 1, idx, y1);
            keep(r, "index_add_into_f32", gf, (bound)EXACT);
        }
        /* an embedding's backward over many tokens: in chunks of rows (cuda_index.cu), their
         * sums added in another order than the CPU's row by row; ~100 N(0, 1) terms each */
        int64_t *many = malloc(sizeof(int64_t) * 1000);
        for (int i = 0; i < 1000; i++) many[i] = (i * 7) % 10;
        tdm_tensor *mi = from(r, TDM_SHAPE(1000), idt, many);
        tdm_tensor *my = randn(r, TDM_SHAPE(2, 1000, 5), 0, 1), *mg = zeros(r, TDM_SHAPE(2, 10, 5));
        free(many);
        KERNEL(r, index_add, mg, 1, mi, my);
        keep(r, "index_add_long", mg, (bound){1e-4, 1e-5});
        fails(r, r->be->index_select(yb, x, 0, bi), "index 10 (position 2)");
        fails(r, r->be->index_add(x, 0, bi, yb), "index 10 (position 2)");
    }
}

/* ---- convolution and pooling ------------------------------------------------------------- */

/* One side of a convolved or pooled plane, by PyTorch's rule (ceil mode: the last window
 * starts inside the input or its left padding). */
static int64_t out_size(int64_t n, int64_t k, int stride, int pad, int dilation, bool ceil_mode) {
    int64_t e = n + 2 * pad - dilation * (k - 1) - 1;
    int64_t o = (ceil_mode ? (e + stride - 1) / stride : e / stride) + 1;
    return ceil_mode && (o - 1) * stride >= n + pad ? o - 1 : o;
}

static void case_conv2d(run *r) {
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
        const tdm_conv2d_args *a = &cases[i].a;
        int64_t ho = out_size(cases[i].h, cases[i].kh, a->stride_h, a->pad_h, a->dilation_h, 0);
        int64_t wo = out_size(cases[i].w, cases[i].kw, a->stride_w, a->pad_w, a->dilation_w, 0);
        tdm_shape ws = TDM_SHAPE(cases[i].cout, cases[i].cin / a->groups, cases[i].kh, cases[i].kw);
        tdm_tensor *x = randn(r, TDM_SHAPE(cases[i].n, cases[i].cin, cases[i].h, cases[i].w), 0, 1);
        tdm_tensor *w = randn(r, ws, 0, 1), *b = randn(r, TDM_SHAPE(cases[i].cout), 0, 1);
        tdm_tensor *gy = randn(r, TDM_SHAPE(cases[i].n, cases[i].cout, ho, wo), 0, 1);
        tdm_tensor *y = like(r, gy), *gx = like(r, x), *gw = like(r, w), *gb = like(r, b);
        variant(r, "case %d", i);
        KERNEL(r, conv2d, y, x, w, b, a);
        KERNEL(r, conv2d_backward, gx, gw, gb, gy, x, w, a);
        out(r, "y", y);
        grad(r, "gx gw gb", gx, gw, gb);
    }
}

/* Pooling case i of x [3, 4, 11, 10]: the arguments, and the output's shape. */
static const tdm_pool2d_args *pool_case(int i, tdm_shape *ys) {
    static const tdm_pool2d_args cases[] = {
        {2, 2, 2, 2, 0, 0, 1, 1, false, true}, /* the CNN's 2x2 */
        {3, 3, 2, 2, 1, 1, 1, 1, false, true}, /* overlapping, padded */
        {3, 2, 1, 2, 1, 0, 2, 1, true, false}, /* dilation, ceil mode, no pad count */
    };
    const tdm_pool2d_args *a = &cases[i];
    *ys = TDM_SHAPE(3, 4,
                    out_size(11, a->kernel_h, a->stride_h, a->pad_h, a->dilation_h, a->ceil_mode),
                    out_size(10, a->kernel_w, a->stride_w, a->pad_w, a->dilation_w, a->ceil_mode));
    return a;
}

/* Max pooling (exact: the same scan) and average pooling, forward and backward. */
static void case_pool2d(run *r) {
    for (int i = 0; i < 3; i++) {
        tdm_shape ys;
        const tdm_pool2d_args *a = pool_case(i, &ys);
        tdm_tensor *x = randn(r, TDM_SHAPE(3, 4, 11, 10), 0, 1), *gy = randn(r, ys, 0, 1);
        tdm_tensor *y = like(r, gy), *gx = like(r, x), *idx = tdm_zeros(ys, TDM_I32, r->dev);
        tdm_tensor *ya = like(r, gy), *gxa = like(r, x);
        variant(r, "case %d", i);
        KERNEL(r, max_pool2d, y, idx, x, a);
        KERNEL(r, max_pool2d_backward, gx, gy, idx);
        KERNEL(r, avg_pool2d, ya, x, a);
        KERNEL(r, avg_pool2d_backward, gxa, gy, a);
        out(r, "max indices", y, idx);
        grad(r, "max_backward", gx);
        /* the same window sums in the same order; 1 ulp of slack for compiler contraction */
        keep(r, "avg", ya, (bound){1e-7, 1e-6});
        keep(r, "avg_backward", gxa, (bound){1e-7, 1e-6});
    }
}

/* ---- normalisation, dropout, attention --------------------------------------------------- */

/* Batch norm's inputs: x [N, C, ...] of mean 3 (where a two-pass variance matters), and
 * per-channel statistics near x's (mean 3, invstd 1) for the sync-BN kernels. */
typedef struct {
    tdm_tensor *x, *gy, *w, *mean, *invstd;
    tdm_shape c; /* [C] */
} bn_inputs;

static bn_inputs bn_draw(run *r, int si) {
    tdm_shape s = si ? TDM_SHAPE(64, 33) : TDM_SHAPE(16, 5, 7, 6);
    bn_inputs in = {.c = TDM_SHAPE(s.d[1])};
    in.x = randn(r, s, 3, 1), in.gy = randn(r, s, 0, 1), in.w = randn32(r, in.c, 1, 1);
    in.mean = randn32(r, in.c, 3, 0.1f), in.invstd = randn32(r, in.c, 1, 0.1f);
    return in;
}

static void case_batch_norm(run *r) {
    for (int si = 0; si < 2; si++)
        for (int training = 1; training >= 0; training--) {
            bn_inputs in = bn_draw(r, si);
            tdm_tensor *b = randn32(r, in.c, 0, 1), *rm = randn32(r, in.c, 0, 1),
                       *rv = positive_of(r, in.c, true);
            tdm_tensor *y = like(r, in.x), *gx = like(r, in.x), *gw = like(r, b), *gb = like(r, b);
            tdm_tensor *sm = like(r, b), *sv = like(r, b);
            variant(r, "%s shape %d", training ? "training" : "eval", si);
            KERNEL(r, batch_norm, y, sm, sv, in.x, in.w, b, rm, rv, training, 0.1f, 1e-5f);
            KERNEL(r, batch_norm_backward, gx, gw, gb, in.gy, in.x, in.w, sm, sv, training);
            out(r, "y", y);
            grad(r, "gx gw gb", gx, gw, gb);
            /* statistics in double on both sides, summed in another order: closer than y */
            bound stats = {1e-6, 1e-5};
            keep(r, "save_mean", sm, stats), keep(r, "save_invstd", sv, stats);
            keep(r, "running_mean", rm, stats), keep(r, "running_var", rv, stats);
        }
}

/* Synchronised batch norm's three kernels on one rank's share. elemt's sums are drawn like
 * sums of count N(0, 1) values, the same on both devices: only its element formula differs. */
static void case_sync_batch_norm(run *r) {
    for (int si = 0; si < 2; si++) {
        bn_inputs in = bn_draw(r, si);
        tdm_tensor *sum = like(r, in.w), *sq = like(r, in.w), *sdy = like(r, in.w);
        tdm_tensor *sdx = like(r, in.w), *gw = like(r, in.w), *gb = like(r, in.w);
        tdm_tensor *sums_dy = randn32(r, in.c, 0, 20), *sums_dy_xmu = randn32(r, in.c, 0, 20);
        tdm_tensor *gx = like(r, in.x);
        double count = (double)(tdm_numel(in.x) / in.c.d[0]);
        variant(r, "shape %d", si);
        KERNEL(r, batch_norm_stats, sum, in.x, NULL);
        KERNEL(r, batch_norm_stats, sq, in.x, in.mean);
        KERNEL(r, batch_norm_backward_reduce, sdy, sdx, gw, gb, in.gy, in.x, in.mean, in.invstd);
        KERNEL(r, batch_norm_backward_elemt, gx, in.gy, in.x, in.w, in.mean, in.invstd, sums_dy,
               sums_dy_xmu, count);
        out(r, "sum centred_squares", sum, sq);
        grad(r, "sum_dy sum_dy_xmu gw gb", sdy, sdx, gw, gb);
        keep(r, "elemt_gx", gx, (bound){1e-5, 1e-5}); /* a few float operations an element */
    }
}

/* Rows x columns: the weight and bias gradients sum over rows in chunks of 128 and columns in
 * tiles of 32 (140 rows: two chunks, the last partial; 40 columns: a partial tile); the forward
 * takes a warp a row, eight rows a block (37 rows: a last block of five), and a block a row past
 * 4096 columns (4500). Sizes are kept small: the CPU emulation runs every GPU thread. */
static void case_layer_norm(run *r) {
    int64_t shapes[4][2] = {{37, 64}, {37, 1500}, {140, 40}, {3, 4500}};
    for (int i = 0; i < 4; i++) {
        int64_t rows = shapes[i][0], cols = shapes[i][1];
        tdm_shape s = TDM_SHAPE(rows, cols), c = TDM_SHAPE(cols);
        tdm_tensor *x = randn(r, s, 2, 1), *gy = randn(r, s, 0, 1), *w = randn32(r, c, 1, 1);
        tdm_tensor *b = randn32(r, c, 0, 1), *y = like(r, x), *gx = like(r, x);
        tdm_tensor *gw = like(r, w), *gb = like(r, w), *m = zeros32(r, TDM_SHAPE(rows));
        tdm_tensor *rstd = like(r, m), *gres = randn(r, s, 0, 1), *gx2 = like(r, x);
        variant(r, "%lld rows, %lld columns", (long long)rows, (long long)cols);
        KERNEL(r, layer_norm, y, m, rstd, x, w, b, 1e-5f, NULL, NULL);
        KERNEL(r, layer_norm_backward, gx, gw, gb, gy, x, w, m, rstd, NULL);
        /* a residual stream's other gradient added as gx is written */
        KERNEL(r, layer_norm_backward, gx2, NULL, NULL, gy, x, w, m, rstd, gres);
        out(r, "y", y);
        grad(r, "gx gw gb gx+gres", gx, gw, gb, gx2);
        slack_rounding(r, r->kept[r->n_kept - 4].v); /* gx rounded before gres joins it */
        /* the residual add before the norm, its sum written beside it (gres stands for the
         * branch's output); the statistics are the sum's */
        tdm_tensor *sum = like(r, x), *ys = like(r, x), *ms = like(r, m), *rs = like(r, m);
        if (r->be == CPU && low(r->row->dt)) { /* the GPU's sum is rounded to the row's dtype
                                                * before the norm reads it, as an add's is */
            tdm_tensor *h = zeros_of(r, s, r->row->dt);
            KERNEL(r, binary, TDM_BIN_ADD, sum, x, gres);
            KERNEL(r, copy, h, sum);
            KERNEL(r, copy, sum, h);
            KERNEL(r, layer_norm, ys, ms, rs, sum, w, b, 1e-5f, NULL, NULL);
        } else {
            KERNEL(r, layer_norm, ys, ms, rs, x, w, b, 1e-5f, gres, sum);
        }
        out(r, "x+res norm(x+res)", sum, ys);
        keep(r, "mean(x+res)", ms, (bound){1e-6, 1e-5});
        keep(r, "rstd(x+res)", rs, (bound){1e-6, 1e-5});
        if (r->row->dt != TDM_F32) continue;
        /* a bf16 branch's output beside the f32 stream (autocast's c_proj) */
        tdm_tensor *res16 = zeros_of(r, s, TDM_BF16);
        KERNEL(r, copy, res16, gres);
        KERNEL(r, layer_norm, ys, ms, rs, x, w, b, 1e-5f, res16, sum);
        out(r, "x+res_bf16 norm(x+res_bf16)", sum, ys);
        /* an f32 x normalised into bf16 (tdm_layer_norm_to), its gradient from a bf16 gy: each
         * side rounds its own f32 value once (an ulp apart at most: 2^-7 of it) */
        tdm_tensor *y16 = zeros_of(r, s, TDM_BF16), *gy16 = zeros_of(r, s, TDM_BF16);
        KERNEL(r, copy, gy16, gy);
        KERNEL(r, layer_norm, y16, m, rstd, x, w, b, 1e-5f, NULL, NULL);
        KERNEL(r, layer_norm_backward, gx2, gw, gb, gy16, x, w, m, rstd, gres);
        keep(r, "y_bf16", y16, (bound){1e-5, 0x1p-7});
        grad(r, "gx_from_bf16 gw_from_bf16 gb_from_bf16", gx2, gw, gb);
        keep(r, "mean", m, (bound){1e-6, 1e-5}); /* double vs float lanes: closer than y */
        keep(r, "rstd", rstd, (bound){1e-6, 1e-5});
    }
}

/* The same with every row a block of threads (tdm_cuda_layer_norm_warps(false)), as rows past
 * 4096 columns always run */
static void case_layer_norm_blocks(run *r) {
    if (r->be != CPU) tdm_cuda_layer_norm_warps(false);
    case_layer_norm(r);
    tdm_cuda_layer_norm_warps(true);
}

static void case_dropout(run *r) {
    tdm_tensor *x = randn(r, TDM_SHAPE(3, 1001), 0, 1), *y = like(r, x), *mask = like(r, x);
    KERNEL(r, dropout, y, mask, x, 0.3f, 7, 12345, NULL);
    out(r, "mask y", mask, y);
}

/* Causal attention: rows shorter and longer (260) than a row kernel's 256 threads, a head size
 * of 3, one head, one token, several batch rows of several heads (more heads than rows and
 * fewer: cuBLAS's batches run over the longer); the last case's heads of 16 run the fused
 * kernels (cuda_flash.cu; test_cuda_flash compares them with the unfused at more sizes). Sizes are
 * kept small: the CPU emulation runs every GPU thread. In bf16 and f16 the GPU rounds P and dS to
 * the dtype before their products (cuda_attention.cu), which the CPU's f32 kernel does not: y and
 * dqkv get attention_slack's bound for that, element by element, on top of the row's. */
static void case_attention(run *r) {
    int64_t cases[5][4] = {
        {2, 9, 8, 2}, {1, 260, 8, 1}, {3, 5, 6, 2}, {1, 1, 4, 1}, {3, 40, 48, 3}};
    for (int i = 0; i < 5; i++) {
        int64_t B = cases[i][0], T = cases[i][1], C = cases[i][2];
        int nh = (int)cases[i][3];
        tdm_tensor *qkv = randn(r, TDM_SHAPE(B, T, 3 * C), 0, 1), *dqkv = like(r, qkv);
        tdm_tensor *dy = randn(r, TDM_SHAPE(B, T, C), 0, 1), *y = like(r, dy);
        tdm_tensor *lse = zeros32(r, TDM_SHAPE(B, nh, T));
        variant(r, "B=%lld T=%lld C=%lld heads=%d", (long long)B, (long long)T, (long long)C, nh);
        KERNEL(r, attention, y, lse, qkv, nh);
        KERNEL(r, attention_backward, dqkv, dy, qkv, y, lse, nh);
        out(r, "y lse", y, lse);
        grad(r, "dqkv", dqkv);
        if (low(r->row->dt) && r->dev.type == TDM_CPU) { /* the reference's run: f32 on the host */
            double *sy = malloc(sizeof(double) * (size_t)(B * T * C));
            double *slse = malloc(sizeof(double) * (size_t)(B * nh * T));
            double *sg = malloc(sizeof(double) * (size_t)(B * T * 3 * C));
            /* heads of a multiple of 16 run the fused kernels, whose D comes from y */
            attention_slack(tdm_data_ptr(qkv), tdm_data_ptr(dy), B, T, C, nh,
                            r->row->dt == TDM_BF16 ? 0x1p-8 : 0x1p-11, (C / nh) % 16 == 0, sy, slse,
                            sg);
            r->kept[r->n_kept - 3].slack = sy, r->kept[r->n_kept - 1].slack = sg;
            free(slse); /* lse is f32 on both sides, from the same f32 scores */
        }
    }
}

/* ---- losses, optimizers ------------------------------------------------------------------ */

/* Logits; weights; label smoothing; log-probabilities, with i32 and i64 targets, one of them
 * ignored. A target out of range is an error naming it and its sample. */
static void case_cross_entropy(run *r) {
    int64_t N = 33, C = 10, t[33], badt[3] = {1, 12, 2};
    for (int i = 0; i < N; i++) t[i] = (i * 7) % C;
    t[5] = -100;
    for (int v = 0; v < 4; v++) {
        bool logits = v != 3;
        float smooth = v >= 2 ? 0.1f : 0.0f;
        tdm_tensor *x = randn(r, TDM_SHAPE(N, C), 0, 1), *gl = randn32(r, TDM_SHAPE(N), 1, 1);
        tdm_tensor *w = v >= 1 ? randn32(r, TDM_SHAPE(C), 2, 1) : NULL, *gx = like(r, x);
        tdm_tensor *tg = from(r, TDM_SHAPE(N), v & 1 ? TDM_I32 : TDM_I64, t);
        tdm_tensor *loss = like(r, gl), *ws = like(r, gl), *lp = like(r, x), *lse = like(r, gl);
        tdm_tensor *gx2 = like(r, x);
        variant(r, "variant %d", v);
        if (!logits) { /* log-probabilities (the CPU softmax is not in-place) */
            KERNEL(r, softmax, lp, x, true);
            settle(r, lp);
            x = lp;
        }
        KERNEL(r, cross_entropy, loss, ws, logits ? lse : NULL, x, tg, w, -100, smooth, logits);
        /* from the forward's log-sum-exps, and recomputing them */
        KERNEL(r, cross_entropy_backward, gx, gl, x, logits ? lse : NULL, tg, w, -100, smooth,
               logits);
        KERNEL(r, cross_entropy_backward, gx2, gl, x, NULL, tg, w, -100, smooth, logits);
        out(r, "loss", loss);
        grad(r, "gx", gx);
        grad(r, "gx-recomputed-lse", gx2);
        keep(r, "wsum", ws, (bound)EXACT);
        /* the mean (the sum in variant 2) and its gradient in one pass */
        tdm_tensor *o = zeros32(r, TDM_SHAPE0), *den = zeros32(r, TDM_SHAPE0);
        tdm_tensor *gx3 = like(r, x), *lse3 = like(r, gl);
        KERNEL(r, cross_entropy_reduced, o, den, logits ? lse3 : NULL, gx3, x, tg, w, -100, smooth,
               logits, v != 2);
        out(r, "reduced", o);
        out(r, "den", den);
        grad(r, "gx-reduced", gx3);
        if (logits) out(r, "lse-reduced", lse3);
    }
    variant(r, "bad target");
    tdm_tensor *x = randn(r, TDM_SHAPE(3, C), 0, 1), *tg = from(r, TDM_SHAPE(3), TDM_I64, badt);
    fails(r, r->be->cross_entropy(zeros32(r, TDM_SHAPE(3)), NULL, NULL, x, tg, NULL, -100, 0, true),
          "target 12 (sample 1)");
}

static void case_bce_logits(run *r) {
    tdm_tensor *x = randn(r, TDM_SHAPE(500), 0, 1), *y = randn(r, TDM_SHAPE(500), 0.5f, 1);
    tdm_tensor *g = randn(r, TDM_SHAPE(500), 0, 1), *loss = like(r, x), *gx = like(r, x);
    KERNEL(r, bce_logits, loss, x, y);
    KERNEL(r, bce_logits_backward, gx, g, x, y);
    out(r, "loss", loss);
    grad(r, "gx", gx);
}

/* Three steps of plain SGD; momentum and maximize; dampening and weight decay; Nesterov. */
static void case_sgd_step(run *r) {
    for (int v = 0; v < 4; v++) {
        tdm_tensor *p = randn(r, TDM_SHAPE(3001), 0, 1), *buf = like(r, p);
        tdm_sgd_hparams h = {0.1f, v ? 0.9f : 0, 0.1f * (v == 2), 1e-2f * (v > 1), v == 3, v == 1};
        variant(r, "variant %d", v);
        for (int s = 0; s < 3; s++)
            KERNEL(r, sgd_step, p, randn(r, TDM_SHAPE(3001), 0, 1), buf, &h, s == 0);
        out(r, "p", p);
    }
}

/* Three steps of Adam; with weight decay and maximize; AdamW; AMSGrad. */
static void case_adam_step(run *r) {
    for (int v = 0; v < 4; v++) {
        tdm_tensor *p = randn(r, TDM_SHAPE(3001), 0, 1), *m = like(r, p), *sq = like(r, p);
        tdm_tensor *vmax = like(r, p);
        tdm_adam_hparams h = {1e-2f, 0.9f, 0.999f, 1e-8f, v ? 1e-2f : 0, v == 2, v == 3, v == 1};
        variant(r, "variant %d", v);
        for (int step = 1; step <= 3; step++)
            KERNEL(r, adam_step, p, randn(r, TDM_SHAPE(3001), 0, 1), m, sq, vmax, &h, step);
        out(r, "p", p);
        keep(r, "exp_avg_sq", sq, (bound){1e-9, 1e-5}); /* values ~1e-3 */
    }
}

/* A GPT-2 (2 layers, 2 heads): the loss and every parameter's gradient of one forward and
 * backward (attention, layer norm, GELU, the tied head) through the ops above. */
static void case_gpt(run *r) {
    tdm_gpt_config cfg = {.layers = 2, .heads = 2, .channels = 16, .context = 12, .vocab = 20};
    tdm_rng init = tdm_rng_make(9);
    tdm_module *m = tdm_gpt_new(&cfg, tdm_cpu(0), &init);
    if (m && r->dev.type == TDM_CUDA) { /* the CPU's initial weights */
        tdm_module *on_gpu = tdm_module_clone(m, r->dev);
        tdm_module_free(m);
        m = on_gpu;
    }
    int64_t tok[2 * 12], tgt[2 * 12];
    for (int i = 0; i < 24; i++) tok[i] = (i * 7 + 3) % 20, tgt[i] = (i * 5 + 1) % 20;
    tdm_tensor *x = from(r, TDM_SHAPE(2, 12), TDM_I64, tok);
    tdm_tensor *l =
        m ? tdm_gpt_loss(tdm_gpt_forward(m, x), from(r, TDM_SHAPE(2, 12), TDM_I64, tgt)) : NULL;
    ok(r, l ? tdm_backward(l) : TDM_ERR_STATE, "gpt");
    if (l) out(r, "loss", l), grad(r, "gradients", tdm_module_parameters(m)->flat_grad);
    tdm_module_free(m);
}

/* ---- the table --------------------------------------------------------------------------- */

/* To add a case: write a builder case_<kernel>(run *r) that draws its inputs with randn(),
 * positive() or from(), makes its outputs with zeros() or like(), runs the kernels with
 * KERNEL(r, kernel, args...) and keeps what they wrote with out() (outputs: the row's out
 * bound), grad() (gradients: its grad bound) or keep() (a bound of its own); then add a row
 * here: the kernels it runs as backend.h names them (a kernel no row names fails the
 * coverage check), the builder, and the bounds with a comment saying why they hold. */
/* clang-format off */
#define HALF_ROWS(dt, tag)                                                                         \
    {"to_host, from_host in " tag, case_to_host, EXACT, EXACT, dt},                               \
    {"unary, unary_backward in " tag, case_unary, {1e-6, 1e-5}, {1e-6, 1e-5}, dt},               \
    {"binary (and into f32) in " tag, case_binary, EXACT, EXACT, dt},                             \
    {"axpy (and into f32) in " tag, case_axpy, {1e-7, 1e-6}, EXACT, dt},                          \
    {"reduce, max_backward in " tag, case_reduce, {1e-5, 1e-6}, EXACT, dt},                       \
    {"sum_to in " tag, case_sum_to, {1e-3, 1e-5}, EXACT, dt},                                     \
    {"softmax, softmax_backward in " tag, case_softmax, {1e-6, 1e-5}, {1e-6, 1e-5}, dt},          \
    {"sum_squares of " tag, case_sum_squares, {0, 1e-12}, EXACT, dt},                             \
    {"matmul (and into f32) in " tag, case_matmul, {1e-4, 1e-4}, EXACT, dt},                      \
    {"linear in " tag, case_linear, {1e-4, 1e-4}, EXACT, dt},                                      \
    {"linear_gelu in " tag, case_linear_gelu, {1e-4, 1e-4}, EXACT, dt},                            \
    {"linear_wgrad in " tag, case_linear_wgrad, EXACT, {1e-4, 1e-4}, dt},                          \
    {"linear_dgelu in " tag, case_linear_dgelu, EXACT, {1e-4, 1e-4}, dt},                          \
    {"index_select, index_add in " tag, case_index, EXACT, EXACT, dt},                            \
    {"max_pool2d, avg_pool2d and backward in " tag, case_pool2d, EXACT, EXACT, dt},               \
    {"batch_norm, batch_norm_backward in " tag, case_batch_norm, {1e-5, 1e-5}, {1e-4, 1e-4}, dt}, \
    {"sync batch_norm kernels in " tag, case_sync_batch_norm, {1e-4, 1e-5}, {1e-4, 1e-4}, dt},    \
    {"layer_norm, layer_norm_backward in " tag, case_layer_norm, {1e-5, 1e-5}, {1e-4, 1e-4}, dt}, \
    {"dropout in " tag, case_dropout, EXACT, EXACT, dt},                                          \
    {"conv2d, conv2d_backward in " tag, case_conv2d, {1e-4, 1e-4}, {1e-4, 1e-4}, dt},             \
    {"attention, attention_backward in " tag, case_attention, {1e-5, 1e-5}, {1e-4, 1e-4}, dt},    \
    {"cross_entropy, cross_entropy_backward, cross_entropy_reduced in " tag, case_cross_entropy,  \
     {1e-6, 1e-5}, {1e-6, 1e-5}, dt},
/* clang-format on */

static const row ROWS[] = {
    /* moving and filling values: exact */
    {"to_host, from_host, mem_alloc, mem_free", case_to_host, EXACT, EXACT, TDM_F32},
    {"copy", case_copy, EXACT, EXACT, TDM_F32},
    {"fill", case_fill, EXACT, EXACT, TDM_F32},
    {"count_up", case_count_up, EXACT, EXACT, TDM_F32},
    /* Philox: the same 24-bit words. Uniform is a + (b - a) * u, rounded twice on the GPU and
     * maybe fused on the CPU (GCC contracts by default): one rounding, 1e-6 absolute */
    {"random", case_random, {1e-6, 0}, EXACT, TDM_F32},
    /* libm functions differ by a few ulp between glibc, the CPU's own expf and CUDA: 1e-5
     * relative (+1e-6 where a result cancels to ~0) */
    {"unary, unary_backward", case_unary, {1e-6, 1e-5}, {1e-6, 1e-5}, TDM_F32},
    /* one IEEE operation per element on both sides */
    {"binary", case_binary, EXACT, EXACT, TDM_F32},
    {"axpy", case_axpy, {1e-7, 1e-6}, EXACT, TDM_F32}, /* an FMA on the GPU: 1 ulp */
    /* sums in double in another order: 1e-6 relative, 1e-5 absolute for sums of up to 5000
     * N(0,1) values that cancel; max and its backward are exact */
    {"reduce, max_backward", case_reduce, {1e-5, 1e-6}, EXACT, TDM_F32},
    /* the GPU sums in double; the CPU adds [m, n] -> [1, n] row by row in float, whose error
     * grows like sqrt(m) * eps * |sum| (3.7e-4 seen for m = 8192): 1e-3 absolute */
    {"sum_to", case_sum_to, {1e-3, 1e-5}, EXACT, TDM_F32},
    /* expf differs by an ulp or two between the CPU's polynomial and CUDA: 1e-5 */
    {"softmax, softmax_backward", case_softmax, {1e-6, 1e-5}, {1e-6, 1e-5}, TDM_F32},
    /* double sums of float squares */
    {"sum_squares", case_sum_squares, {0, 1e-12}, EXACT, TDM_F32},
    /* FP32 GEMMs with k = 301 blocked differently: sums of ~17 in magnitude agree to ~1e-5
     * absolute; 1e-4 absolute + 1e-4 relative */
    {"matmul", case_matmul, {1e-4, 1e-4}, EXACT, TDM_F32},
    {"linear", case_linear, {1e-4, 1e-4}, EXACT, TDM_F32},
    {"linear_gelu", case_linear_gelu, {1e-4, 1e-4}, EXACT, TDM_F32},
    {"linear_dgelu", case_linear_dgelu, EXACT, {1e-4, 1e-4}, TDM_F32},
    /* sums of 301 N(0, 1) products (or terms) in other orders */
    {"linear_wgrad", case_linear_wgrad, EXACT, {1e-4, 1e-4}, TDM_F32},
    {"index_select, index_add", case_index, EXACT, EXACT, TDM_F32},
    /* FP32 GEMMs over up to K = 150 (forward) and N*P = 400 (weights) terms; the CPU sums
     * each plane of gb in float lanes: 1e-4 */
    {"conv2d, conv2d_backward", case_conv2d, {1e-4, 1e-4}, {1e-4, 1e-4}, TDM_F32},
    /* max pooling: the same scan, exact (average pooling keeps its own bound) */
    {"max_pool2d, max_pool2d_backward, avg_pool2d, avg_pool2d_backward", case_pool2d, EXACT, EXACT,
     TDM_F32},
    /* double statistics on both sides, summed in another order: 1e-5; the CPU sums the
     * backward's rows in float lanes, and gx cancels (mean-free): 1e-4 absolute */
    {"batch_norm, batch_norm_backward", case_batch_norm, {1e-5, 1e-5}, {1e-4, 1e-4}, TDM_F32},
    /* batch_norm's sums split around the all-reduces, in double (stats) and as the CPU's
     * float lanes (backward_reduce) */
    {"batch_norm_stats, batch_norm_backward_reduce, batch_norm_backward_elemt",
     case_sync_batch_norm,
     {1e-4, 1e-5},
     {1e-4, 1e-4},
     TDM_F32},
    /* row statistics in double vs float lanes: 1e-5; the CPU adds gw and gb in float over
     * rows, the GPU in double: 1e-4 */
    {"layer_norm, layer_norm_backward", case_layer_norm, {1e-5, 1e-5}, {1e-4, 1e-4}, TDM_F32},
    {"layer_norm, layer_norm_backward, a row a block",
     case_layer_norm_blocks,
     {1e-5, 1e-5},
     {1e-4, 1e-4},
     TDM_F32},
    {"dropout", case_dropout, EXACT, EXACT, TDM_F32}, /* the same Philox counters: bit-identical */
    /* the GPU sums each dot product and softmax in another order than BLAS */
    {"attention, attention_backward", case_attention, {1e-5, 1e-5}, {1e-4, 1e-4}, TDM_F32},
    /* log-sum-exp through different expf; expf and log1pf ulps: 1e-5 */
    {"cross_entropy, cross_entropy_backward, cross_entropy_reduced",
     case_cross_entropy,
     {1e-6, 1e-5},
     {1e-6, 1e-5},
     TDM_F32},
    {"bce_logits, bce_logits_backward", case_bce_logits, {1e-6, 1e-5}, {1e-6, 1e-5}, TDM_F32},
    {"sgd_step", case_sgd_step, {1e-6, 1e-6}, EXACT, TDM_F32}, /* a few FMAs per element per step */
    /* Adam divides by sqrt(v) + eps: ~1e-6 relative per step on the update */
    {"adam_step", case_adam_step, {1e-6, 1e-5}, EXACT, TDM_F32},
    /* the loss to 1e-5 relative; gradients through every kernel above: 1e-3 relative */
    {"gpt-2 forward and backward", case_gpt, {0, 1e-5}, {1e-5, 1e-3}, TDM_F32},
    /* f32 <-> bf16, f16 conversions on both devices (half.h's rules): bit for bit */
    {"copy, fill, random: f32 to bf16 and f16", case_half_copy, EXACT, EXACT, TDM_F32},
    /* The kernels a training step runs, in bf16 and in f16 on cuda:0 against the CPU's f32
     * kernels on the same rounded inputs: each with its f32 row's bounds, which widened() adds
     * one output rounding to for every output the GPU stored in bf16 or f16 (f32 outputs,
     * such as lse, statistics and losses, keep the f32 bound). */
    /* clang-format off */
    HALF_ROWS(TDM_BF16, "bf16")
    HALF_ROWS(TDM_F16, "f16")
    /* clang-format on */
};

/* ---- the driver -------------------------------------------------------------------------- */

/* The bound of an output the GPU stored in dt, where the CPU's f32 twin of the kernel is
 * within b of the GPU's f32 arithmetic (both run on the same rounded inputs: see place): b,
 * then one rounding to nearest of a value within b of the CPU's, which moves it by at most
 * half an ulp: 2^-8 of it in bf16 (8 significant bits), 2^-11 in f16 (11 bits), or 2^-25
 * absolute below f16's normal range. So |gpu - cpu| <= b.atol + b.rtol |cpu| + u (|cpu| (1 +
 * b.rtol) + b.atol) + tiny. */
static bound widened(bound b, tdm_dtype dt) {
    if (dt != TDM_BF16 && dt != TDM_F16) return b;
    double u = dt == TDM_BF16 ? 0x1p-8 : 0x1p-11, tiny = dt == TDM_BF16 ? 0 : 0x1p-25;
    return (bound){b.atol * (1 + u) + tiny, b.rtol + u * (1 + b.rtol)};
}

/* Elements of g (cuda) outside the bound around c (cpu); the first few printed. */
static int64_t differ(const char *row_name, const kept *c, const kept *g) {
    int64_t bad = c->n == g->n ? 0 : c->n;
    bound bd = widened(c->b, g->dt);
    for (int64_t i = 0; i < c->n && c->n == g->n; i++) {
        double a = c->v[i], b = g->v[i];
        double slack = c->slack ? c->slack[i] : 0;
        if (a == b || (a != a && b != b) || fabs(b - a) <= bd.atol + bd.rtol * fabs(a) + slack)
            continue; /* equal infinities, whose difference is NaN, are equal */
        if (bad++ < 4)
            fprintf(stderr, "  %s: %s: element %lld: cuda %.9g, cpu %.9g\n", row_name, c->name,
                    (long long)i, b, a);
    }
    return bad;
}

/* Runs w on cpu:0 and twice on cuda:0, each from the same seed (so a row's inputs do not
 * depend on its place in the table), and compares what the runs kept. */
static void run_row(const row *w) {
    run runs[3] = {{.row = w, .be = CPU, .dev = tdm_cpu(0), .on = "cpu:0", .dt = TDM_F32},
                   {.row = w, .be = GPU, .dev = G, .on = "cuda:0", .dt = w->dt},
                   {.row = w, .be = GPU, .dev = G, .on = "cuda:0", .dt = w->dt}};
    for (int i = 0; i < 3; i++) {
        runs[i].rng = tdm_rng_make(1);
        tdm_scope_begin();
        w->build(&runs[i]);
        tdm_scope_end();
        CHECK(!runs[i].failed[0], "%s on %s: %s", w->name, runs[i].on, runs[i].failed);
    }
    const run *c = &runs[0], *g = &runs[1], *g2 = &runs[2];
    CHECK(c->n_kept == g->n_kept && g->n_kept == g2->n_kept, "%s: the runs kept %d, %d and %d",
          w->name, c->n_kept, g->n_kept, g2->n_kept);
    const char *nondet = NULL;
    for (int k = 0; k < c->n_kept && k < g->n_kept && k < g2->n_kept; k++) {
        const kept *a = &c->kept[k], *b = &g->kept[k], *b2 = &g2->kept[k];
        int64_t bad = differ(w->name, a, b);
        bound bd = widened(a->b, b->dt);
        CHECK(bad == 0, "%s: %s: %lld of %lld elements differ (atol %g, rtol %g)", w->name, a->name,
              (long long)bad, (long long)a->n, bd.atol, bd.rtol);
        if (!nondet && (b->n != b2->n || memcmp(b->v, b2->v, sizeof(double) * (size_t)b->n)))
            nondet = b->name;
    }
    CHECK(!nondet, "%s: two runs on cuda:0 differ in %s (not deterministic)", w->name, nondet);
    for (int i = 0; i < 3; i++) {
        for (int k = 0; k < runs[i].n_kept; k++)
            free(runs[i].kept[k].v), free(runs[i].kept[k].slack);
        free(runs[i].kept);
    }
}

static bool word_char(char c) {
    return isalnum((unsigned char)c) || c == '_';
}

/* Whether a row runs kernel k: k is a word of the row's name. */
static bool covered(const char *k) {
    size_t n = strlen(k);
    for (size_t i = 0; i < sizeof ROWS / sizeof ROWS[0]; i++)
        for (const char *s = ROWS[i].name, *p = s; (p = strstr(p, k)); p++)
            if ((p == s || !word_char(p[-1])) && !word_char(p[n])) return true;
    return false;
}

/* The kernels of kernels.def, by name. */
static const char *const KERNELS[] = {
#define TDM_KERNEL(ret, entry, params) #entry,
#define TDM_UPLOAD(ret, entry, params)
#include "backend/kernels.def"
#undef TDM_KERNEL
#undef TDM_UPLOAD
};

/* Every kernel of kernels.def has a row (one added there without a row fails here),
 * and every row passes. Prints a line per dtype of the GPU's tensors ("rows in bf16: 17 of 17
 * passed"), which scripts/gpu-check reports. */
static void test_kernels(void) {
    for (size_t i = 0; i < sizeof KERNELS / sizeof KERNELS[0]; i++)
        CHECK(covered(KERNELS[i]), "kernel %s: no row of the table runs it", KERNELS[i]);
    const tdm_dtype dts[] = {TDM_F32, TDM_BF16, TDM_F16};
    /* TDM_TEST_CUDA_DTYPES=f32 (or bf16,f16): those dtypes' rows only, so that the emulation
     * (src/backend/cuda/emu/run) runs them in two processes at once; default every dtype */
    const char *only = getenv("TDM_TEST_CUDA_DTYPES");
    for (int k = 0; k < 3; k++) {
        if (only && !strstr(only, tdm_dtype_name(dts[k]))) continue;
        int rows = 0, passed = 0;
        for (size_t i = 0; i < sizeof ROWS / sizeof ROWS[0]; i++) {
            if (ROWS[i].dt != dts[k]) continue;
            int failed = check_failed;
            run_row(&ROWS[i]);
            rows++, passed += check_failed == failed;
        }
        printf("rows in %s: %d of %d passed\n", tdm_dtype_name(dts[k]), passed, rows);
    }
}

/* ---- bad conditions ---------------------------------------------------------------------- */

/* tdm_set_allow_tf32: an f32 product then rounds its inputs to TF32 (10 mantissa bits): within
 * 2^-10 of the magnitudes of the exact product, and not the f32 product any more; off again,
 * the f32 product bit for bit. */
static void test_tf32(void) {
    enum { N = 16, K = 96, M = 24 };
    tdm_rng rng = tdm_rng_make(41);
    tdm_scope_begin();
    tdm_tensor *a = tdm_randn(TDM_SHAPE(1, N, K), 0, 1, tdm_cpu(0), &rng);
    tdm_tensor *b = tdm_randn(TDM_SHAPE(1, K, M), 0, 1, tdm_cpu(0), &rng);
    tdm_tensor *ga = tdm_to_device(a, G), *gb = tdm_to_device(b, G);
    tdm_tensor *c[3];
    for (int i = 0; i < 3; i++) { /* f32, TF32, f32 */
        tdm_set_allow_tf32(i == 1);
        c[i] = tdm_zeros(TDM_SHAPE(1, N, M), TDM_F32, G);
        CHECK(c[i] && GPU->matmul(c[i], ga, gb, false, false, 0.0f) == TDM_OK, "matmul %d: %s", i,
              tdm_last_error());
        c[i] = tdm_to_device(c[i], tdm_cpu(0));
    }
    tdm_set_allow_tf32(false);
    const float *pa = tdm_data_ptr(a), *pb = tdm_data_ptr(b);
    int far = 0, moved = 0, back = 0;
    for (int i = 0; i < N; i++)
        for (int j = 0; j < M; j++) {
            double s = 0, mag = 0;
            for (int k = 0; k < K; k++)
                s += (double)pa[i * K + k] * pb[k * M + j],
                    mag += fabs(pa[i * K + k] * pb[k * M + j]);
            float t = ((float *)tdm_data_ptr(c[1]))[i * M + j];
            float f = ((float *)tdm_data_ptr(c[0]))[i * M + j];
            far += fabs(t - s) > 0x1p-10 * mag;
            moved += t != f;
            back += f != ((float *)tdm_data_ptr(c[2]))[i * M + j];
        }
    CHECK(far == 0 && moved > N * M / 2 && back == 0,
          "TF32: %d products beyond 2^-10 of their magnitude, %d of %d differ from f32's, %d "
          "differ after turning it off",
          far, moved, N * M, back);
    tdm_scope_end();
}

/* cuBLASLt's choice of algorithm remembered (cuda_matmul.cu): a linear of a shape no test has
 * run asks the heuristic once, and not again for that shape in other buffers; another shape
 * asks again; the remembered algorithm gives the first product's bits. */
static void test_lt_memo(void) {
    const char *e = getenv("TANDEM_CUBLASLT_EPILOGUES");
    if (e && !strcmp(e, "0")) return; /* no cuBLASLt: nothing asked */
    tdm_rng rng = tdm_rng_make(43);
    tdm_scope_begin();
    tdm_tensor *w = tdm_cast(tdm_randn(TDM_SHAPE(1, 56, 48), 0, 1, G, &rng), TDM_BF16);
    tdm_tensor *b = tdm_cast(tdm_randn(TDM_SHAPE(56), 0, 1, G, &rng), TDM_BF16);
    tdm_tensor *x[3], *y[3];
    unsigned long long calls[4] = {tdm_cuda_blaslt_heuristic_calls()};
    for (int i = 0; i < 3; i++) { /* x0, x1 = x0 again in a new buffer, then M 48 instead of 40 */
        x[i] = i == 1 ? tdm_clone(x[0])
                      : tdm_cast(tdm_randn(TDM_SHAPE(1, i ? 48 : 40, 48), 0, 1, G, &rng), TDM_BF16);
        y[i] = x[i] ? tdm_tensor_alloc(TDM_SHAPE(1, x[i]->shape[1], 56), TDM_BF16, G) : NULL;
        CHECK(w && b && y[i] && GPU->linear(y[i], x[i], w, b) == TDM_OK, "linear %d: %s", i,
              tdm_last_error());
        calls[i + 1] = tdm_cuda_blaslt_heuristic_calls();
    }
    CHECK(calls[1] == calls[0] + 1 && calls[2] == calls[1] && calls[3] == calls[2] + 1,
          "cuBLASLt's heuristic asked %llu, %llu and %llu times for a new problem, the same one "
          "again and another (1, 0, 1)",
          calls[1] - calls[0], calls[2] - calls[1], calls[3] - calls[2]);
    tdm_tensor *a = tdm_to_device(tdm_cast(y[0], TDM_F32), tdm_cpu(0));
    tdm_tensor *c = tdm_to_device(tdm_cast(y[1], TDM_F32), tdm_cpu(0));
    CHECK(a && c && !memcmp(tdm_data_ptr(a), tdm_data_ptr(c), sizeof(float) * 40 * 56),
          "the remembered algorithm's product differs from the first");
    tdm_scope_end();
}

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
    /* mixed precision keeps f32 masters: an optimizer refuses a bf16 parameter, naming it */
    tdm_tensor *p16 = tdm_tensor_alloc(TDM_SHAPE(4), TDM_BF16, G);
    tdm_tensor *g32 = tdm_zeros(TDM_SHAPE(4), TDM_F32, G);
    tdm_sgd_hparams h = {0.1f, 0, 0, 0, false, false};
    CHECK_ERROR(GPU->sgd_step(p16, g32, NULL, &h, true) != TDM_OK, "p is bf16");
    tdm_tensor_free(p16);
    tdm_tensor_free(g32);
    tdm_tensor *one = tdm_ones(TDM_SHAPE(1), TDM_F32, G);
    CHECK(one && tdm_item(one) == 1.0f, "cuda:0 still works after an OOM: %s", tdm_last_error());
    tdm_tensor_free(one);
}

int main(void) {
    /* cuBLAS and cuBLASLt, which a GPU's first use loads (not linked): found and complete where
     * the build found them, GPU or not */
    if (tdm_cuda_blas_load()) {
        fprintf(stderr, "FAIL test_cuda: %s\n", tdm_last_error());
        return 1;
    }
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
    /* the table is full: every kernel, and the loader's uploads (a GPU is not host memory) */
    CHECK(tdm_backend_check(GPU, true) == TDM_OK, "cuda table: %s", tdm_last_error());
    test_kernels();
    test_tf32();
    test_lt_memo();
    test_errors();
    return check_summary();
}
#endif
