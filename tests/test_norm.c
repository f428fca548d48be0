/* Batch norm, layer norm, dropout, index_select and embedding: PyTorch fixtures (outputs,
 * running statistics over three training steps, gradients), gradchecks of every op with
 * non-contiguous inputs, dropout's determinism, and error messages. */
#include "gradcheck.h"
#include "core/core.h"

#include "fixtures/norm_fixtures.h"

static int backward_weighted(tdm_tensor *out, const float *u) {
    if (!out) return -1;
    return tdm_backward(tdm_sum_all(tdm_mul(out, f32(tdm_shape_of(out), u))));
}

static void check_grad(const tdm_tensor *t, const float *expected, const char *what) {
    CHECK(t->grad != NULL, "%s: no gradient", what);
    if (t->grad) check_tensor_close(t->grad, expected, 1e-5, 1e-4, what);
}

/* ---- fixtures ---- */

static void test_batch_norm_fixtures(void) {
    for (int k = 0; k < NF_N_BN_CASES; k++) {
        const nf_bn_case *c = &nf_bn_cases[k];
        char what[96];
        tdm_scope_begin();
        tdm_tensor *w = f32(TDM_SHAPE(c->C), c->weight), *b = f32(TDM_SHAPE(c->C), c->bias);
        tdm_requires_grad_(w, true);
        tdm_requires_grad_(b, true);
        tdm_tensor *rm = tdm_zeros(TDM_SHAPE(c->C), TDM_F32, tdm_cpu(0));
        tdm_tensor *rv = tdm_ones(TDM_SHAPE(c->C), TDM_F32, tdm_cpu(0));
        tdm_tensor *x = NULL, *y = NULL;
        for (int step = 0; step < 3; step++) {
            x = f32(c->shape, c->x[step]);
            tdm_requires_grad_(x, true);
            y = tdm_batch_norm(x, rm, rv, w, b, true, NF_MOMENTUM, NF_EPS);
            CHECK(y != NULL, "%s step %d: %s", c->name, step, tdm_last_error());
            if (!y) break;
            snprintf(what, sizeof what, "%s step %d output", c->name, step);
            check_tensor_close(y, c->y[step], 1e-5, 1e-4, what);
            snprintf(what, sizeof what, "%s step %d running_mean", c->name, step);
            check_tensor_close(rm, c->rm[step], 1e-6, 1e-5, what);
            snprintf(what, sizeof what, "%s step %d running_var", c->name, step);
            check_tensor_close(rv, c->rv[step], 1e-6, 1e-5, what);
        }
        if (y) {
            CHECK(backward_weighted(y, c->u) == 0, "%s: %s", c->name, tdm_last_error());
            snprintf(what, sizeof what, "%s train grad x", c->name);
            check_grad(x, c->gx, what);
            snprintf(what, sizeof what, "%s train grad weight", c->name);
            check_grad(w, c->gw, what);
            snprintf(what, sizeof what, "%s train grad bias", c->name);
            check_grad(b, c->gb, what);
        }
        /* eval: running statistics, which must not change */
        tdm_zero_grad(w);
        tdm_zero_grad(b);
        float rm_before[8], rv_before[8];
        tdm_to_host(rm, rm_before, sizeof(float) * (size_t)c->C);
        tdm_to_host(rv, rv_before, sizeof(float) * (size_t)c->C);
        tdm_tensor *xe = f32(c->shape, c->xe);
        tdm_requires_grad_(xe, true);
        tdm_tensor *ye = tdm_batch_norm(xe, rm, rv, w, b, false, NF_MOMENTUM, NF_EPS);
        CHECK(ye != NULL, "%s eval: %s", c->name, tdm_last_error());
        if (ye) {
            snprintf(what, sizeof what, "%s eval output", c->name);
            check_tensor_close(ye, c->ye, 1e-5, 1e-4, what);
            check_tensor_close(rm, rm_before, 0, 0, "eval keeps running_mean");
            check_tensor_close(rv, rv_before, 0, 0, "eval keeps running_var");
            CHECK(backward_weighted(ye, c->u) == 0, "%s: %s", c->name, tdm_last_error());
            snprintf(what, sizeof what, "%s eval grad x", c->name);
            check_grad(xe, c->gxe, what);
            snprintf(what, sizeof what, "%s eval grad weight", c->name);
            check_grad(w, c->gwe, what);
            snprintf(what, sizeof what, "%s eval grad bias", c->name);
            check_grad(b, c->gbe, what);
        }
        tdm_scope_end();
    }
}

static void test_layer_norm_fixtures(void) {
    for (int k = 0; k < NF_N_LN_CASES; k++) {
        const nf_ln_case *c = &nf_ln_cases[k];
        char what[96];
        tdm_scope_begin();
        tdm_tensor *x = f32(c->shape, c->x), *w = NULL, *b = NULL;
        tdm_requires_grad_(x, true);
        if (c->w) {
            tdm_shape ns = {c->nd, {0}};
            for (int i = 0; i < c->nd; i++) ns.d[i] = c->shape.d[c->shape.ndim - c->nd + i];
            w = f32(ns, c->w);
            b = f32(ns, c->b);
            tdm_requires_grad_(w, true);
            tdm_requires_grad_(b, true);
        }
        tdm_tensor *y = tdm_layer_norm(x, c->nd, w, b, NF_EPS);
        CHECK(y != NULL, "%s: %s", c->name, tdm_last_error());
        if (y) {
            snprintf(what, sizeof what, "%s output", c->name);
            check_tensor_close(y, c->y, 1e-5, 1e-4, what);
            CHECK(backward_weighted(y, c->u) == 0, "%s: %s", c->name, tdm_last_error());
            snprintf(what, sizeof what, "%s grad x", c->name);
            check_grad(x, c->gx, what);
            if (w) {
                snprintf(what, sizeof what, "%s grad weight", c->name);
                check_grad(w, c->gw, what);
                snprintf(what, sizeof what, "%s grad bias", c->name);
                check_grad(b, c->gb, what);
            }
        }
        tdm_scope_end();
    }
}

/* ---- gradchecks ---- */

typedef struct {
    bool training, affine;
    tdm_tensor *rm, *rv;
} bn_ctx;

/* in[0] is x with dims 0 and 1 swapped ([C, N, ...]): batch norm sees a strided [N, C, ...] */
static tdm_tensor *bn_fn(tdm_tensor **in, void *p) {
    bn_ctx *c = (bn_ctx *)p;
    tdm_tensor *x = tdm_transpose(in[0], 0, 1);
    return tdm_batch_norm(x, c->rm, c->rv, c->affine ? in[1] : NULL, c->affine ? in[2] : NULL,
                          c->training, 0.1f, 1e-5f);
}

static void test_batch_norm_gradcheck(void) {
    tdm_shape shapes[2] = {TDM_SHAPE(3, 5), TDM_SHAPE(3, 2, 2, 3)}; /* [C, N, ...] */
    for (int s = 0; s < 2; s++)
        for (int mode = 0; mode < 3; mode++) { /* train+affine, train plain, eval+affine */
            bn_ctx c = {mode < 2, mode != 1, NULL, NULL};
            tdm_rng r = tdm_rng_make(77);
            c.rm = tdm_randn(TDM_SHAPE(3), 0, 1, tdm_cpu(0), &r);
            c.rv = tdm_rand(TDM_SHAPE(3), 0.5f, 2.0f, tdm_cpu(0), &r);
            tdm_tensor *in[3] = {gradcheck_input(shapes[s], 31 + s),
                                 gradcheck_input(TDM_SHAPE(3), 41),
                                 gradcheck_input(TDM_SHAPE(3), 42)};
            char what[64];
            snprintf(what, sizeof what, "batch_norm %dd mode %d", shapes[s].ndim, mode);
            gradcheck(what, bn_fn, c.affine ? 3 : 1, in, &c, 1e-2, 2e-3, 1e-2);
            for (int i = 0; i < 3; i++) tdm_tensor_free(in[i]);
            tdm_tensor_free(c.rm);
            tdm_tensor_free(c.rv);
        }
}

typedef struct {
    int nd;
    bool affine;
} ln_ctx;

/* in[0] is [D, ..., R] and used with its first and last dims swapped: layer norm over a strided
 * last dim */
static tdm_tensor *ln_fn(tdm_tensor **in, void *p) {
    ln_ctx *c = (ln_ctx *)p;
    tdm_tensor *x = tdm_transpose(in[0], 0, in[0]->ndim - 1);
    return tdm_layer_norm(x, c->nd, c->affine ? in[1] : NULL, c->affine ? in[2] : NULL, 1e-5f);
}

static void test_layer_norm_gradcheck(void) {
    for (int affine = 0; affine < 2; affine++) {
        ln_ctx c = {1, affine != 0};
        tdm_tensor *in[3] = {gradcheck_input(TDM_SHAPE(4, 6), 51),
                             gradcheck_input(TDM_SHAPE(4), 52), gradcheck_input(TDM_SHAPE(4), 53)};
        gradcheck(affine ? "layer_norm affine" : "layer_norm", ln_fn, affine ? 3 : 1, in, &c, 1e-2,
                  2e-3, 1e-2);
        for (int i = 0; i < 3; i++) tdm_tensor_free(in[i]);
    }
    /* two normalised dims: x [2, 3, 4] seen as the transpose of [4, 3, 2] -> weight [3, 4] */
    ln_ctx c = {2, true};
    tdm_tensor *in[3] = {gradcheck_input(TDM_SHAPE(4, 3, 2), 54),
                         gradcheck_input(TDM_SHAPE(3, 4), 55),
                         gradcheck_input(TDM_SHAPE(3, 4), 56)};
    gradcheck("layer_norm 2 dims", ln_fn, 3, in, &c, 1e-2, 2e-3, 1e-2);
    for (int i = 0; i < 3; i++) tdm_tensor_free(in[i]);
}

/* h + layer_norm(h) for h = s x, an op's output as a residual stream is (a leaf's gradient goes
 * to its .grad): the add's gradient reaches h before the norm's backward runs, which adds it
 * to the gradient it writes (the kernel's gres). s: *(float *)p, 2 where NULL. */
static tdm_tensor *ln_residual_fn(tdm_tensor **in, void *p) {
    tdm_tensor *h = tdm_mul_scalar(in[0], p ? *(float *)p : 2.0f);
    return tdm_add(h, tdm_layer_norm(h, 1, in[1], in[2], 1e-5f));
}

/* That gradient against the add it replaces, bit for bit: u + the norm's gradient alone, for
 * sum(u * (h + layer_norm(h))), h = 1 x. In f32 and bf16 (the kernel's widened path), with
 * and without the affine parameters. */
static void test_layer_norm_residual(void) {
    tdm_tensor *in[3] = {gradcheck_input(TDM_SHAPE(5, 8), 57), gradcheck_input(TDM_SHAPE(8), 58),
                         gradcheck_input(TDM_SHAPE(8), 59)};
    gradcheck("h + layer_norm(h)", ln_residual_fn, 3, in, NULL, 1e-2, 2e-3, 1e-2);
    for (int i = 0; i < 3; i++) tdm_tensor_free(in[i]);
    const tdm_dtype dts[2] = {TDM_F32, TDM_BF16};
    for (int k = 0; k < 4; k++) {
        tdm_dtype dt = dts[k / 2];
        bool affine = k % 2;
        tdm_scope_begin();
        tdm_rng r = tdm_rng_make(71);
        tdm_tensor *v = tdm_randn(TDM_SHAPE(6, 20), 0, 1, tdm_cpu(0), &r);
        tdm_tensor *u = tdm_cast(tdm_randn(TDM_SHAPE(6, 20), 0, 1, tdm_cpu(0), &r), dt);
        tdm_tensor *w = affine ? tdm_randn(TDM_SHAPE(20), 1, 0.5f, tdm_cpu(0), &r) : NULL;
        tdm_tensor *b = affine ? tdm_randn(TDM_SHAPE(20), 0, 0.5f, tdm_cpu(0), &r) : NULL;
        if (w && dt != TDM_F32) w = tdm_cast(w, dt), b = tdm_cast(b, dt);
        tdm_tensor *alone = tdm_cast(v, dt), *fused = tdm_cast(v, dt);
        tdm_requires_grad_(alone, true);
        tdm_requires_grad_(fused, true);
        float one = 1.0f;
        tdm_tensor *h = tdm_mul_scalar(alone, one);
        int rc = tdm_backward(tdm_sum_all(tdm_mul(tdm_layer_norm(h, 1, w, b, 1e-5f), u)));
        tdm_tensor *z = ln_residual_fn((tdm_tensor *[]){fused, w, b}, &one);
        rc = rc ? rc : tdm_backward(tdm_sum_all(tdm_mul(z, u)));
        CHECK(rc == TDM_OK && alone->grad && fused->grad, "h + layer_norm(h) in %s: %s",
              tdm_dtype_name(dt), tdm_last_error());
        if (rc == TDM_OK && alone->grad && fused->grad) {
            tdm_tensor *want = tdm_add(u, alone->grad);
            CHECK(want && !memcmp(tdm_data_ptr(want), tdm_data_ptr(fused->grad),
                                  tdm_numel(want) * tdm_dtype_size(dt)),
                  "h + layer_norm(h) in %s%s: x's gradient is not u + the norm's alone, bit for "
                  "bit",
                  tdm_dtype_name(dt), affine ? ", affine" : "");
        }
        tdm_scope_end();
    }
}

/* A pre-norm block's two uses of the stream: y = layer_norm(x + r) and s = x + r, s read again
 * by a later add (whose gradient reaches s first: the norm's backward folds it in) */
static tdm_tensor *add_ln_fn(tdm_tensor **in, void *p) {
    (void)p;
    tdm_tensor *s = NULL, *y = tdm_add_layer_norm(in[0], in[1], &s, 1, in[2], in[3], 1e-5f);
    return y ? tdm_add(s, tdm_mul_scalar(y, 1.5f)) : NULL;
}

/* What one run of tdm_add_layer_norm (or tdm_add and the norm) gives, as bytes: s, y and the
 * gradients of x, r, w and b from sum(f32(s) u + f32(y) v). */
typedef struct {
    tdm_tensor *t[6];
} aln_out;

typedef struct {
    tdm_dtype x, r, to; /* to: the norm's dtype (_to), or x's where keep */
    bool keep, affine;
    int r_kind; /* 0: r of x's shape; 1: broadcast [20]; 2: a transposed (strided) view */
} aln_case;

static bool aln_run(const aln_case *c, bool fused, aln_out *o) {
    tdm_rng g = tdm_rng_make(91);
    tdm_device cpu = tdm_cpu(0);
    tdm_tensor *x = tdm_cast(tdm_randn(TDM_SHAPE(6, 20), 0.5f, 2, cpu, &g), c->x);
    tdm_tensor *r = tdm_cast(c->r_kind == 1   ? tdm_randn(TDM_SHAPE(20), 0, 1, cpu, &g)
                             : c->r_kind == 2 ? tdm_randn(TDM_SHAPE(20, 6), 0, 1, cpu, &g)
                                              : tdm_randn(TDM_SHAPE(6, 20), 0, 1, cpu, &g),
                             c->r);
    tdm_tensor *w = tdm_randn(TDM_SHAPE(20), 1, 0.5f, cpu, &g);
    tdm_tensor *b = tdm_randn(TDM_SHAPE(20), 0, 0.5f, cpu, &g);
    tdm_tensor *u = tdm_randn(TDM_SHAPE(6, 20), 0, 1, cpu, &g);
    tdm_tensor *v = tdm_randn(TDM_SHAPE(6, 20), 0, 1, cpu, &g);
    tdm_tensor *leaves[4] = {x, r, w, b};
    for (int i = 0; i < 4; i++) tdm_requires_grad_(leaves[i], true);
    tdm_tensor *rv = c->r_kind == 2 ? tdm_transpose(r, 0, 1) : r;
    tdm_tensor *wa = c->affine ? w : NULL, *ba = c->affine ? b : NULL, *s = NULL, *y;
    if (fused)
        y = c->keep ? tdm_add_layer_norm(x, rv, &s, 1, wa, ba, 1e-5f)
                    : tdm_add_layer_norm_to(x, rv, &s, 1, wa, ba, 1e-5f, c->to);
    else
        s = tdm_add(x, rv), y = c->keep ? tdm_layer_norm(s, 1, wa, ba, 1e-5f)
                                        : tdm_layer_norm_to(s, 1, wa, ba, 1e-5f, c->to);
    if (!y || !s) return false;
    tdm_tensor *l = tdm_add(tdm_sum_all(tdm_mul(tdm_to_dtype(s, TDM_F32), u)),
                            tdm_sum_all(tdm_mul(tdm_to_dtype(y, TDM_F32), v)));
    if (!l || tdm_backward(l)) return false;
    o->t[0] = s, o->t[1] = y;
    for (int i = 0; i < 4; i++) o->t[2 + i] = leaves[i]->grad;
    return true;
}

/* tdm_add_layer_norm(_to) against tdm_add and then the norm, bit for bit: s, y and every
 * gradient, where one kernel runs (r of x's shape in x's dtype, or bf16/f16 beside f32 x; the
 * norm in the stream's dtype or bf16) and where the two ops run (r broadcast or strided, a
 * sum in another dtype than x's); and its gradients against finite differences. */
static void test_add_layer_norm(void) {
    tdm_tensor *in[4] = {gradcheck_input(TDM_SHAPE(5, 8), 61), gradcheck_input(TDM_SHAPE(5, 8), 62),
                         gradcheck_input(TDM_SHAPE(8), 63), gradcheck_input(TDM_SHAPE(8), 64)};
    gradcheck("add_layer_norm", add_ln_fn, 4, in, NULL, 1e-2, 2e-3, 1e-2);
    for (int i = 0; i < 4; i++) tdm_tensor_free(in[i]);
    const aln_case cases[] = {
        {TDM_F32, TDM_F32, TDM_F32, true, true, 0},    {TDM_F32, TDM_F32, TDM_F32, true, false, 0},
        {TDM_F32, TDM_BF16, TDM_F32, true, true, 0},   {TDM_F32, TDM_F16, TDM_F32, true, true, 0},
        {TDM_BF16, TDM_BF16, TDM_F32, true, true, 0},  {TDM_F16, TDM_F16, TDM_F32, true, false, 0},
        {TDM_F32, TDM_BF16, TDM_BF16, false, true, 0}, {TDM_F32, TDM_F32, TDM_F16, false, true, 0},
        {TDM_F32, TDM_F32, TDM_F32, true, true, 1},    {TDM_F32, TDM_F32, TDM_F32, true, true, 2},
        {TDM_BF16, TDM_F32, TDM_F32, true, true, 0},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        const aln_case *c = &cases[k];
        char what[96];
        snprintf(what, sizeof what, "add_layer_norm%s x %s, r %s%s%s%s", c->keep ? "" : "_to",
                 tdm_dtype_name(c->x), tdm_dtype_name(c->r),
                 c->r_kind == 1   ? " [20]"
                 : c->r_kind == 2 ? " strided"
                                  : "",
                 c->keep ? "" : " to ", c->keep ? "" : tdm_dtype_name(c->to));
        tdm_scope_begin();
        aln_out o[2];
        bool ok = aln_run(c, true, &o[0]) && aln_run(c, false, &o[1]);
        CHECK(ok, "%s: %s", what, tdm_last_error());
        static const char *names[6] = {
            "s", "y", "x's gradient", "r's gradient", "w's gradient", "b's gradient"};
        for (int i = 0; ok && i < 6; i++) {
            const tdm_tensor *a = o[0].t[i], *e = o[1].t[i];
            if (!c->affine && i >= 4) {
                CHECK(!a && !e, "%s: %s without affine parameters", what, names[i]);
                continue;
            }
            CHECK(a && e && a->dtype == e->dtype && tdm_same_shape(a, e) &&
                      !memcmp(tdm_data_ptr(a), tdm_data_ptr(e),
                              (size_t)tdm_numel(e) * tdm_dtype_size(e->dtype)),
                  "%s: %s is not the two ops', bit for bit", what, names[i]);
        }
        tdm_scope_end();
    }
    /* outside a scope the two ops run; s and y are the caller's */
    tdm_tensor *x = tdm_ones(TDM_SHAPE(2, 3), TDM_F32, tdm_cpu(0)), *s = NULL;
    tdm_tensor *y = tdm_add_layer_norm(x, x, &s, 1, NULL, NULL, 1e-5f);
    CHECK(y && s && !tdm_book(y)->owner && !tdm_book(s)->owner,
          "add_layer_norm without a scope: %s", tdm_last_error());
    float two[6] = {2, 2, 2, 2, 2, 2}, zero[6] = {0};
    if (y && s) {
        check_tensor_close(s, two, 0, 0, "add_layer_norm's sum without a scope");
        check_tensor_close(y, zero, 0, 0, "add_layer_norm without a scope");
    }
    tdm_tensor_free(y);
    tdm_tensor_free(s);
    tdm_tensor_free(x);
}

/* tdm_layer_norm_to against tdm_to_dtype(tdm_layer_norm(...)), bit for bit: the output in bf16
 * and f16 from an f32 x, and the gradients of x, the weight and the bias from a gradient in
 * that dtype; a dtype that is not a float refused naming it. */
static void test_layer_norm_to(void) {
    const tdm_dtype dts[2] = {TDM_BF16, TDM_F16};
    for (int k = 0; k < 2; k++) {
        tdm_scope_begin();
        tdm_rng r = tdm_rng_make(81);
        tdm_tensor *v = tdm_randn(TDM_SHAPE(2, 5, 24), 0.5f, 2, tdm_cpu(0), &r);
        tdm_tensor *u = tdm_cast(tdm_randn(TDM_SHAPE(2, 5, 24), 0, 1, tdm_cpu(0), &r), dts[k]);
        tdm_tensor *in[2][3];
        for (int j = 0; j < 2; j++) {
            in[j][0] = tdm_cast(v, TDM_F32);
            tdm_rng rw = tdm_rng_make(82);
            in[j][1] = tdm_randn(TDM_SHAPE(24), 1, 0.5f, tdm_cpu(0), &rw);
            in[j][2] = tdm_randn(TDM_SHAPE(24), 0, 0.5f, tdm_cpu(0), &rw);
            for (int i = 0; i < 3; i++) tdm_requires_grad_(in[j][i], true);
        }
        /* each forward and its backward in turn: a backward stops where an earlier one walked */
        tdm_tensor *y[2];
        bool ok = true;
        for (int j = 0; ok && j < 2; j++) {
            y[j] = j ? tdm_to_dtype(tdm_layer_norm(in[1][0], 1, in[1][1], in[1][2], 1e-5f), dts[k])
                     : tdm_layer_norm_to(in[0][0], 1, in[0][1], in[0][2], 1e-5f, dts[k]);
            ok = y[j] && y[j]->dtype == dts[k] &&
                 tdm_backward(tdm_sum_all(tdm_to_dtype(tdm_mul(y[j], u), TDM_F32))) == TDM_OK;
        }
        CHECK(ok, "layer_norm_to %s: %s", tdm_dtype_name(dts[k]), tdm_last_error());
        if (ok) {
            CHECK(in[0][0] != in[1][0] && in[0][0]->grad != in[1][0]->grad,
                  "layer_norm_to: the two runs share a leaf");
            CHECK(!memcmp(tdm_data_ptr(y[0]), tdm_data_ptr(y[1]), 2 * 5 * 24 * 2),
                  "layer_norm_to %s: the output is not the norm's cast, bit for bit",
                  tdm_dtype_name(dts[k]));
            for (int i = 0; i < 3; i++)
                CHECK(in[0][i]->grad && in[1][i]->grad &&
                          !memcmp(tdm_data_ptr(in[0][i]->grad), tdm_data_ptr(in[1][i]->grad),
                                  sizeof(float) * (size_t)tdm_numel(in[0][i])),
                      "layer_norm_to %s: gradient %d is not the two ops', bit for bit",
                      tdm_dtype_name(dts[k]), i);
        }
        tdm_scope_end(); /* the leaves and their gradients with it */
    }
    tdm_tensor *x = tdm_zeros(TDM_SHAPE(2, 3), TDM_F32, tdm_cpu(0));
    CHECK(!tdm_layer_norm_to(x, 1, NULL, NULL, 1e-5f, TDM_I32) &&
              strstr(tdm_last_error(), "dtype i32 is not a float dtype"),
          "layer_norm_to into i32: %s", tdm_last_error());
    tdm_tensor_free(x);
}

/* The rng is re-made inside the fn so that every finite-difference evaluation draws the same
 * mask as the analytic pass. */
static tdm_tensor *dropout_fn(tdm_tensor **in, void *p) {
    tdm_rng r = tdm_rng_make(99);
    return tdm_dropout(tdm_transpose(in[0], 0, 1), *(float *)p, true, &r);
}

static void test_dropout_gradcheck(void) {
    float p = 0.4f;
    tdm_tensor *x = gradcheck_input(TDM_SHAPE(5, 6), 61);
    gradcheck("dropout", dropout_fn, 1, &x, &p, 1e-3, 1e-3, 1e-3);
    tdm_tensor_free(x);
}

typedef struct {
    int dim;
    tdm_tensor *idx;
} idx_ctx;

/* in[0] is [4, 5, 3] and used as its [3, 5, 4] transpose */
static tdm_tensor *index_fn(tdm_tensor **in, void *p) {
    idx_ctx *c = (idx_ctx *)p;
    return tdm_index_select(tdm_transpose(in[0], 0, 2), c->dim, c->idx);
}

static tdm_tensor *embedding_fn(tdm_tensor **in, void *p) {
    return tdm_embedding(in[0], ((idx_ctx *)p)->idx);
}

static void test_index_gradcheck(void) {
    int64_t iv[6] = {2, 0, 2, 2, 1, 0}; /* repeated indices must sum their gradients */
    tdm_tensor *x = gradcheck_input(TDM_SHAPE(4, 5, 3), 71);
    for (int dim = -1; dim < 3; dim++) {
        idx_ctx c = {dim, i64(TDM_SHAPE(6), iv)};
        if (dim == 1) { /* i32 indices too */
            tdm_tensor *i32 = tdm_cast(c.idx, TDM_I32);
            tdm_tensor_free(c.idx);
            c.idx = i32;
        }
        char what[64];
        snprintf(what, sizeof what, "index_select dim %d", dim);
        gradcheck(what, index_fn, 1, &x, &c, 1e-3, 1e-3, 1e-3);
        tdm_tensor_free(c.idx);
    }
    tdm_tensor_free(x);

    int64_t ev[6] = {1, 3, 1, 0, 3, 3};
    tdm_tensor *w = gradcheck_input(TDM_SHAPE(5, 3), 72);
    idx_ctx c = {0, i64(TDM_SHAPE(2, 3), ev)};
    gradcheck("embedding [2, 3] index", embedding_fn, 1, &w, &c, 1e-3, 1e-3, 1e-3);
    /* a strided index: the transpose of [3, 2] */
    tdm_tensor *it = tdm_transpose(c.idx, 0, 1);
    idx_ctx c2 = {0, it};
    gradcheck("embedding strided index", embedding_fn, 1, &w, &c2, 1e-3, 1e-3, 1e-3);
    tdm_tensor_free(it);
    tdm_tensor_free(c.idx);
    tdm_tensor_free(w);
}

/* ---- values: index_select, embedding, dropout ---- */

static void test_index_values(void) {
    tdm_scope_begin();
    tdm_tensor *x = tdm_arange(0, 12, 1, TDM_F32, tdm_cpu(0));
    x = tdm_reshape(x, TDM_SHAPE(3, 4));
    int64_t iv[3] = {3, 0, 3};
    tdm_tensor *y = tdm_index_select(x, 1, i64(TDM_SHAPE(3), iv));
    float e1[9] = {3, 0, 3, 7, 4, 7, 11, 8, 11};
    CHECK(y && y->shape[0] == 3 && y->shape[1] == 3, "index_select shape");
    if (y) check_tensor_close(y, e1, 0, 0, "index_select dim 1");
    /* embedding of a [2, 2] index gives [2, 2, 4] */
    int64_t ev[4] = {2, 0, 1, 2};
    tdm_tensor *e = tdm_embedding(x, i64(TDM_SHAPE(2, 2), ev));
    float e2[16] = {8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
    CHECK(e && e->ndim == 3 && e->shape[0] == 2 && e->shape[1] == 2 && e->shape[2] == 4,
          "embedding shape");
    if (e) check_tensor_close(e, e2, 0, 0, "embedding");
    tdm_scope_end();
}

static void test_dropout_values(void) {
    tdm_scope_begin();
    const int n = 20000;
    const float p = 0.3f;
    tdm_tensor *x = tdm_ones(TDM_SHAPE(n), TDM_F32, tdm_cpu(0));
    tdm_rng r = tdm_rng_make(5);
    tdm_tensor *y = tdm_dropout(x, p, true, &r);
    CHECK(y != NULL, "%s", tdm_last_error());
    CHECK(r.offset == (uint64_t)n, "offset advanced by numel: %llu", (unsigned long long)r.offset);
    float *v = malloc(sizeof(float) * n);
    tdm_to_host(y, v, sizeof(float) * n);
    int zeros = 0, bad = 0;
    for (int i = 0; i < n; i++) {
        if (v[i] == 0)
            zeros++;
        else if (fabsf(v[i] - 1.0f / (1.0f - p)) > 1e-6f)
            bad++;
    }
    CHECK(bad == 0, "%d kept values are not 1/(1-p)", bad);
    /* binomial(20000, 0.3): sd ~65, so 6000 +- 400 is > 6 sd */
    CHECK(zeros > 5600 && zeros < 6400, "dropped %d of %d at p = %g", zeros, n, p);

    /* element i uses counter offset + i: two halves drawn in sequence equal one whole draw */
    tdm_rng a = tdm_rng_make(8), b = tdm_rng_make(8);
    tdm_tensor *whole = tdm_dropout(tdm_ones(TDM_SHAPE(64), TDM_F32, tdm_cpu(0)), 0.5f, true, &a);
    tdm_tensor *h1 = tdm_dropout(tdm_ones(TDM_SHAPE(40), TDM_F32, tdm_cpu(0)), 0.5f, true, &b);
    tdm_tensor *h2 = tdm_dropout(tdm_ones(TDM_SHAPE(4, 6), TDM_F32, tdm_cpu(0)), 0.5f, true, &b);
    float wv[64], hv[64];
    tdm_to_host(whole, wv, sizeof wv);
    tdm_to_host(h1, hv, 40 * sizeof(float));
    tdm_to_host(h2, hv + 40, 24 * sizeof(float));
    CHECK(memcmp(wv, hv, sizeof wv) == 0, "split draws differ from one draw");
    /* a second draw from the same rng is a different mask */
    tdm_tensor *again = tdm_dropout(tdm_ones(TDM_SHAPE(64), TDM_F32, tdm_cpu(0)), 0.5f, true, &a);
    float av[64];
    tdm_to_host(again, av, sizeof av);
    CHECK(memcmp(wv, av, sizeof wv) != 0, "consecutive masks repeat");

    /* eval and p = 0 return the input itself; p = 1 zeroes everything */
    CHECK(tdm_dropout(x, p, false, &r) == x, "eval dropout must return its input");
    CHECK(tdm_dropout(x, 0.0f, true, &r) == x, "p = 0 must return its input");
    tdm_tensor *z = tdm_dropout(x, 1.0f, true, &r);
    CHECK(z && tdm_item(tdm_sum_all(z)) == 0.0f, "p = 1 must zero everything");
    /* NULL rng: the default generator advances */
    uint64_t before = tdm_default_rng()->offset;
    CHECK(tdm_dropout(x, p, true, NULL) != NULL, "%s", tdm_last_error());
    CHECK(tdm_default_rng()->offset == before + (uint64_t)n, "default rng offset");
    free(v);
    tdm_scope_end();
}

/* Ops outside a scope: results are caller-owned and nothing else is left behind. */
static void test_no_scope(void) {
    float xv[6] = {1, 2, 3, 4, 5, 6};
    tdm_tensor *x = f32(TDM_SHAPE(2, 3), xv);
    tdm_tensor *rm = tdm_zeros(TDM_SHAPE(3), TDM_F32, tdm_cpu(0));
    tdm_tensor *rv = tdm_ones(TDM_SHAPE(3), TDM_F32, tdm_cpu(0));
    tdm_tensor *y = tdm_batch_norm(x, rm, rv, NULL, NULL, true, 0.1f, 1e-5f);
    float e[6] = {-1, -1, -1, 1, 1, 1};
    CHECK(y && !tdm_book(y)->owner, "batch_norm without a scope: %s", tdm_last_error());
    if (y) check_tensor_close(y, e, 1e-4, 0, "batch_norm no scope");
    tdm_tensor *l = tdm_layer_norm(x, 1, NULL, NULL, 1e-5f);
    CHECK(l && !tdm_book(l)->owner, "layer_norm without a scope: %s", tdm_last_error());
    int64_t iv[2] = {1, 1};
    tdm_tensor *idx = i64(TDM_SHAPE(2), iv);
    tdm_tensor *em = tdm_embedding(x, idx);
    float ee[6] = {4, 5, 6, 4, 5, 6};
    CHECK(em && !tdm_book(em)->owner, "embedding without a scope: %s", tdm_last_error());
    tdm_tensor_free(idx); /* the result shares the weight's values, not the index */
    if (em) check_tensor_close(em, ee, 0, 0, "embedding no scope");
    tdm_tensor *d = tdm_dropout(x, 0.5f, true, NULL);
    CHECK(d && !tdm_book(d)->owner, "dropout without a scope: %s", tdm_last_error());
    tdm_tensor_free(d);
    tdm_tensor_free(em);
    tdm_tensor_free(l);
    tdm_tensor_free(y);
    tdm_tensor_free(rm);
    tdm_tensor_free(rv);
    tdm_tensor_free(x);
}

/* ---- errors ---- */

static void test_errors(void) {
    tdm_scope_begin();
    tdm_device cpu = tdm_cpu(0);
    tdm_tensor *x = tdm_zeros(TDM_SHAPE(4, 3), TDM_F32, cpu);
    tdm_tensor *c3 = tdm_ones(TDM_SHAPE(3), TDM_F32, cpu),
               *c5 = tdm_ones(TDM_SHAPE(5), TDM_F32, cpu);
    CHECK_ERROR(!tdm_batch_norm(x, NULL, NULL, c5, c3, true, 0.1f, 1e-5f),
                "batch_norm: weight has shape [5], expected [3] for input [4, 3]");
    CHECK_ERROR(!tdm_batch_norm(x, c5, c3, NULL, NULL, true, 0.1f, 1e-5f), "running_mean");
    CHECK_ERROR(!tdm_batch_norm(c3, NULL, NULL, NULL, NULL, true, 0.1f, 1e-5f),
                "batch_norm: input must be [N, C] or [N, C, ...], got [3]");
    CHECK_ERROR(!tdm_batch_norm(tdm_zeros(TDM_SHAPE(1, 3), TDM_F32, cpu), NULL, NULL, NULL, NULL,
                                true, 0.1f, 1e-5f),
                "more than 1 value per channel when training, got input [1, 3]");
    CHECK_ERROR(!tdm_batch_norm(x, NULL, NULL, NULL, NULL, false, 0.1f, 1e-5f),
                "eval mode needs running_mean");
    CHECK_ERROR(!tdm_batch_norm(tdm_zeros(TDM_SHAPE(4, 3), TDM_I64, cpu), NULL, NULL, NULL, NULL,
                                true, 0.1f, 1e-5f),
                "batch_norm");
    CHECK_ERROR(!tdm_layer_norm(x, 0, NULL, NULL, 1e-5f), "normalized_ndim 0 is not in [1, 2]");
    CHECK_ERROR(!tdm_layer_norm(x, 1, c5, NULL, 1e-5f),
                "layer_norm: weight has shape [5], expected [3]");
    tdm_tensor *sum = c3;
    CHECK_ERROR(!tdm_add_layer_norm(x, x, NULL, 1, NULL, NULL, 1e-5f),
                "add_layer_norm: sum is NULL");
    CHECK_ERROR(!tdm_add_layer_norm(x, NULL, &sum, 1, NULL, NULL, 1e-5f) && !sum, "add_layer_norm");
    CHECK_ERROR(!tdm_add_layer_norm(x, c5, &sum, 1, NULL, NULL, 1e-5f) && !sum, "add");
    CHECK_ERROR(!tdm_add_layer_norm(x, x, &sum, 1, c5, NULL, 1e-5f) && !sum,
                "layer_norm: weight has shape [5], expected [3]");
    CHECK_ERROR(!tdm_add_layer_norm_to(x, x, &sum, 1, NULL, NULL, 1e-5f, TDM_I32) && !sum,
                "add_layer_norm_to: dtype i32 is not a float dtype");
    CHECK_ERROR(!tdm_dropout(x, 1.5f, true, NULL), "dropout: p must be in [0, 1], got 1.5");
    int64_t bad[2] = {1, 7};
    CHECK_ERROR(!tdm_index_select(x, 0, i64(TDM_SHAPE(2), bad)),
                "index 7 (position 1) is out of range for dim 0 of size 4");
    int64_t neg[1] = {-1};
    CHECK_ERROR(!tdm_index_select(x, 1, i64(TDM_SHAPE(1), neg)), "index -1");
    CHECK_ERROR(!tdm_index_select(x, 0, tdm_zeros(TDM_SHAPE(2), TDM_F32, cpu)),
                "index_select: index must be i32 or i64, got f32");
    CHECK_ERROR(!tdm_index_select(x, 0, tdm_zeros(TDM_SHAPE(2, 2), TDM_I64, cpu)),
                "index_select: index must be 1-D, got shape [2, 2]");
    CHECK_ERROR(!tdm_index_select(x, 2, i64(TDM_SHAPE(1), neg)), "index_select");
    CHECK_ERROR(!tdm_embedding(c3, i64(TDM_SHAPE(1), neg)), "embedding: weight must be [num, dim]");
    CHECK_ERROR(!tdm_embedding(x, i64(TDM_SHAPE(2), bad)), "index 7");
    CHECK_ERROR(!tdm_embedding(x, tdm_zeros(TDM_SHAPE(2), TDM_F32, cpu)),
                "embedding: index must be i32 or i64");
    tdm_scope_end();
}

int main(void) {
    test_batch_norm_fixtures();
    test_layer_norm_fixtures();
    test_batch_norm_gradcheck();
    test_layer_norm_gradcheck();
    test_layer_norm_residual();
    test_layer_norm_to();
    test_add_layer_norm();
    test_dropout_gradcheck();
    test_index_gradcheck();
    test_index_values();
    test_dropout_values();
    test_no_scope();
    test_errors();
    return check_summary();
}
