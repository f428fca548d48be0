/* Losses: values and input gradients against PyTorch fixtures for every option, gradchecks
 * of every loss and option (with non-contiguous inputs), numerical stability and errors. */
#include "fixtures/losses_fixtures.h"
#include "gradcheck.h"
#include "backend/backend.h"
#include "core/core.h"
#include "tandem/autocast.h"

/* L = sum(out * U), run backward; a scalar loss is the backward's root itself (a
 * cross-entropy's then hands on the gradient its forward wrote). */
static int backward_weighted(tdm_tensor *out, const float *u) {
    if (!out) return -1;
    if (tdm_numel(out) == 1) return tdm_backward(out);
    return tdm_backward(tdm_sum_all(tdm_mul(out, f32(tdm_shape_of(out), u))));
}

/* ---- PyTorch fixtures ---- */

static void test_ce_fixtures(void) {
    for (int k = 0; k < LF_N_CE_CASES; k++) {
        const lf_ce_case *c = &lf_ce_cases[k];
        tdm_scope_begin();
        tdm_tensor *x = f32(TDM_SHAPE(LF_N, LF_C), c->is_ce ? lf_logits : lf_logp);
        tdm_requires_grad_(x, true);
        /* odd cases use i32 targets: both index dtypes must give the same result */
        tdm_tensor *t = i64(TDM_SHAPE(LF_N), c->target);
        if (k % 2) t = tdm_cast(t, TDM_I32);
        tdm_ce_opts o = tdm_ce_defaults();
        o.reduction = (tdm_reduction)c->reduction;
        o.ignore_index = c->ignore_index;
        o.label_smoothing = c->smoothing;
        o.weight = c->use_weight ? f32(TDM_SHAPE(LF_C), lf_weight) : NULL;
        tdm_tensor *out = c->is_ce ? tdm_cross_entropy(x, t, &o) : tdm_nll_loss(x, t, &o);
        CHECK(out && tdm_numel(out) == c->n_out, "%s: output: %s", c->name, tdm_last_error());
        if (out && tdm_numel(out) == c->n_out) {
            check_tensor_close(out, c->out, 1e-5, 1e-5, c->name);
            CHECK(backward_weighted(out, lf_upstream) == 0, "%s: backward: %s", c->name,
                  tdm_last_error());
            CHECK(x->grad != NULL, "%s: no gradient", c->name);
            if (x->grad) check_tensor_close(x->grad, c->grad, 1e-6, 1e-5, c->name);
        }
        tdm_scope_end();
    }
}

/* rows wider than the kernels' 8 lanes, with every option at once */
static void test_ce_wide_fixtures(void) {
    for (int k = 0; k < 4; k++) {
        char what[64];
        snprintf(what, sizeof what, "wide ce w=%d e=%g", lf_wide_use_weight[k],
                 (double)lf_wide_smoothing[k]);
        tdm_scope_begin();
        tdm_tensor *x = f32(TDM_SHAPE(LF_NW, LF_CW), lf_logits_w);
        tdm_requires_grad_(x, true);
        tdm_ce_opts o = tdm_ce_defaults();
        o.reduction = TDM_REDUCE_NONE;
        o.label_smoothing = lf_wide_smoothing[k];
        o.weight = lf_wide_use_weight[k] ? f32(TDM_SHAPE(LF_CW), lf_weight_w) : NULL;
        tdm_tensor *out = tdm_cross_entropy(x, i64(TDM_SHAPE(LF_NW), lf_target_w), &o);
        CHECK(out != NULL, "%s: %s", what, tdm_last_error());
        if (out) {
            check_tensor_close(out, lf_wide_out[k], 1e-5, 1e-5, what);
            CHECK(backward_weighted(out, lf_upstream) == 0, "%s: %s", what, tdm_last_error());
            if (x->grad) check_tensor_close(x->grad, lf_wide_grad[k], 1e-6, 1e-5, what);
        }
        tdm_scope_end();
    }
}

static void test_pair_fixtures(void) {
    for (int k = 0; k < LF_N_PAIR_CASES; k++) {
        const lf_pair_case *c = &lf_pair_cases[k];
        tdm_scope_begin();
        tdm_shape s = TDM_SHAPE(LF_R, LF_K);
        tdm_tensor *a = f32(s, c->is_bce ? lf_bce_x : lf_mse_a);
        tdm_tensor *b = f32(s, c->is_bce ? lf_bce_y : lf_mse_b);
        tdm_requires_grad_(a, true);
        tdm_requires_grad_(b, true);
        tdm_reduction r = (tdm_reduction)c->reduction;
        tdm_tensor *out = c->is_bce ? tdm_bce_with_logits(a, b, r) : tdm_mse_loss(a, b, r);
        CHECK(out && tdm_numel(out) == c->n_out, "%s: output: %s", c->name, tdm_last_error());
        if (out && tdm_numel(out) == c->n_out) {
            check_tensor_close(out, c->out, 1e-5, 1e-5, c->name);
            CHECK(backward_weighted(out, lf_upstream2) == 0, "%s: backward: %s", c->name,
                  tdm_last_error());
            if (a->grad) check_tensor_close(a->grad, c->grad_input, 1e-6, 1e-5, c->name);
            if (b->grad) check_tensor_close(b->grad, c->grad_target, 1e-6, 1e-5, c->name);
            CHECK(a->grad && b->grad, "%s: missing gradients", c->name);
        }
        tdm_scope_end();
    }
}

/* ---- gradchecks ---- */

typedef struct {
    bool nll;
    tdm_ce_opts o;
    tdm_tensor *target;
} ce_ctx;

/* in[0] is [C, N]: the loss sees its transpose, a non-contiguous [N, C] view */
static tdm_tensor *ce_fn(tdm_tensor **in, void *p) {
    ce_ctx *c = (ce_ctx *)p;
    tdm_tensor *x = tdm_transpose(in[0], 0, 1);
    return c->nll ? tdm_nll_loss(x, c->target, &c->o) : tdm_cross_entropy(x, c->target, &c->o);
}

static void test_ce_gradcheck(void) {
    const int N = 6, C = 4;
    int64_t tv[6] = {3, -100, 0, 2, 2, 1};
    int64_t tv2[6] = {3, 1, 0, 2, 2, 1};
    float wv[4] = {0.5f, 2.0f, 1.0f, 1.5f};
    tdm_tensor *x = gradcheck_input(TDM_SHAPE(C, N), 11);
    tdm_tensor *t1 = i64(TDM_SHAPE(N), tv), *t2 = i64(TDM_SHAPE(N), tv2);
    tdm_tensor *w = f32(TDM_SHAPE(C), wv);
    char what[128];
    for (int nll = 0; nll < 2; nll++)
        for (int r = 0; r < 3; r++)
            for (int uw = 0; uw < 2; uw++)
                for (int sm = 0; sm < 2; sm++)
                    for (int ig = 0; ig < 2; ig++) {
                        if (nll && sm) continue;
                        ce_ctx c = {nll != 0, tdm_ce_defaults(), ig ? t2 : t1};
                        c.o.reduction = (tdm_reduction)r;
                        c.o.weight = uw ? w : NULL;
                        c.o.label_smoothing = sm ? 0.2f : 0.0f;
                        c.o.ignore_index = ig ? 1 : -100;
                        snprintf(what, sizeof what, "%s r=%d w=%d e=%d ignore=%lld",
                                 nll ? "nll" : "ce", r, uw, sm, (long long)c.o.ignore_index);
                        gradcheck(what, ce_fn, 1, &x, &c, 1e-3, 2e-3, 2e-3);
                    }
    tdm_tensor_free(x);
    tdm_tensor_free(t1);
    tdm_tensor_free(t2);
    tdm_tensor_free(w);

    /* C = 11: the 8-lane path and its tail, every option at once */
    int64_t tw[3] = {10, 4, 7};
    tdm_tensor *xw = gradcheck_input(TDM_SHAPE(11, 3), 12);
    tdm_rng r = tdm_rng_make(13);
    ce_ctx c = {false, tdm_ce_defaults(), i64(TDM_SHAPE(3), tw)};
    c.o.weight = tdm_rand(TDM_SHAPE(11), 0.5f, 1.5f, tdm_cpu(0), &r);
    c.o.label_smoothing = 0.3f;
    c.o.ignore_index = 4;
    gradcheck("ce C=11 weights smoothing ignore", ce_fn, 1, &xw, &c, 1e-3, 2e-3, 2e-3);
    tdm_tensor_free(xw);
    tdm_tensor_free(c.target);
    tdm_tensor_free(c.o.weight);
}

typedef struct {
    bool bce;
    tdm_reduction r;
} pair_ctx;

/* in[0] is [K, R] (used transposed), in[1] is [R, K]: one strided and one dense operand */
static tdm_tensor *pair_fn(tdm_tensor **in, void *p) {
    pair_ctx *c = (pair_ctx *)p;
    tdm_tensor *a = tdm_transpose(in[0], 0, 1);
    return c->bce ? tdm_bce_with_logits(a, in[1], c->r) : tdm_mse_loss(a, in[1], c->r);
}

static void test_pair_gradcheck(void) {
    tdm_tensor *in[2] = {gradcheck_input(TDM_SHAPE(4, 3), 21),
                         gradcheck_input(TDM_SHAPE(3, 4), 22)};
    for (int bce = 0; bce < 2; bce++)
        for (int r = 0; r < 3; r++) {
            pair_ctx c = {bce != 0, (tdm_reduction)r};
            char what[64];
            snprintf(what, sizeof what, "%s reduction %d", bce ? "bce_with_logits" : "mse", r);
            gradcheck(what, pair_fn, 2, in, &c, 1e-3, 2e-3, 2e-3);
        }
    tdm_tensor_free(in[0]);
    tdm_tensor_free(in[1]);
}

/* ---- stability, semantics ---- */

static void test_stability(void) {
    tdm_scope_begin();
    /* logits of 1e4 would overflow exp without the max shift */
    float xv[6] = {1e4f, -1e4f, 0.0f, 5e3f, 5e3f, -5e3f};
    int64_t tv[2] = {1, 0};
    tdm_tensor *x = f32(TDM_SHAPE(2, 3), xv);
    tdm_requires_grad_(x, true);
    tdm_ce_opts o = tdm_ce_defaults();
    o.reduction = TDM_REDUCE_NONE;
    tdm_tensor *l = tdm_cross_entropy(x, i64(TDM_SHAPE(2), tv), &o);
    float lv[2] = {0, 0};
    CHECK(l && tdm_to_host(l, lv, sizeof lv) == 0, "%s", tdm_last_error());
    CHECK_CLOSE(lv[0], 2e4, 1, 1e-6);
    CHECK_CLOSE(lv[1], logf(2.0f), 1e-5, 1e-5);
    CHECK(tdm_backward(tdm_sum_all(l)) == 0, "%s", tdm_last_error());
    float g[6];
    tdm_to_host(x->grad, g, sizeof g);
    for (int i = 0; i < 6; i++) CHECK(isfinite(g[i]), "grad %d = %g", i, g[i]);
    CHECK_CLOSE(g[1], -1.0, 1e-6, 0); /* softmax(x)[1] = 0, target 1 */

    /* BCE at |x| = 100: loss is exact (0 or 100), never inf, in the lanes (first 8) and in
     * the scalar tail (last 4) */
    float bx[12], by[12], bv[12];
    for (int i = 0; i < 12; i++) {
        bx[i] = i % 2 ? -100.0f : 100.0f;
        by[i] = (float)((i / 2) % 2); /* (100, 0) (-100, 0) (100, 1) (-100, 1) ... */
    }
    tdm_tensor *bl =
        tdm_bce_with_logits(f32(TDM_SHAPE(12), bx), f32(TDM_SHAPE(12), by), TDM_REDUCE_NONE);
    CHECK(bl && tdm_to_host(bl, bv, sizeof bv) == 0, "%s", tdm_last_error());
    for (int i = 0; i < 12; i++) {
        bool right = (bx[i] > 0) == (by[i] > 0.5f);
        CHECK_CLOSE(bv[i], right ? 0.0 : 100.0, 1e-4, 0);
    }

    /* every target ignored: PyTorch's mean is 0/0 = NaN, sum is 0 */
    int64_t all_ign[2] = {-100, -100};
    tdm_tensor *t = i64(TDM_SHAPE(2), all_ign);
    tdm_tensor *m = tdm_cross_entropy(x, t, NULL);
    CHECK(m && isnan(tdm_item(m)), "mean over no targets should be NaN");
    o.reduction = TDM_REDUCE_SUM;
    tdm_tensor *s = tdm_cross_entropy(x, t, &o);
    CHECK(s && tdm_item(s) == 0.0f, "sum over no targets should be 0");
    tdm_scope_end();
}

/* The backward kernel from the forward's log-sum-exps (the op's path: a row read once) and
 * recomputing them (the kernel alone) agree to rounding, rows wider than a vector and not a
 * multiple of one, with weights and smoothing; an lse one larger must scale the probabilities
 * by 1/e, so a kernel that ignored it fails. */
static void test_backward_from_lse(void) {
    enum { N = 6, C = 1003 };
    tdm_scope_begin();
    tdm_rng r = tdm_rng_make(5);
    tdm_tensor *x = tdm_randn(TDM_SHAPE(N, C), 0, 3, tdm_cpu(0), &r);
    tdm_tensor *w = tdm_rand(TDM_SHAPE(C), 0.5f, 2, tdm_cpu(0), &r);
    tdm_tensor *gl = tdm_rand(TDM_SHAPE(N), 0.5f, 1, tdm_cpu(0), &r);
    int64_t tv[N] = {0, 1002, -100, 17, 500, 8};
    tdm_tensor *tg = i64(TDM_SHAPE(N), tv), *loss = tdm_zeros(TDM_SHAPE(N), TDM_F32, tdm_cpu(0));
    tdm_tensor *lse = tdm_zeros(TDM_SHAPE(N), TDM_F32, tdm_cpu(0));
    tdm_tensor *ga = tdm_zeros(TDM_SHAPE(N, C), TDM_F32, tdm_cpu(0));
    tdm_tensor *gb = tdm_zeros(TDM_SHAPE(N, C), TDM_F32, tdm_cpu(0));
    const tdm_backend *be = tdm_backend_for(tdm_cpu(0));
    CHECK(!be->cross_entropy(loss, NULL, lse, x, tg, w, -100, 0.1f, true) &&
              !be->cross_entropy_backward(ga, gl, x, lse, tg, w, -100, 0.1f, true) &&
              !be->cross_entropy_backward(gb, gl, x, NULL, tg, w, -100, 0.1f, true),
          "cross_entropy kernels: %s", tdm_last_error());
    const float *a = tdm_data_ptr(ga), *b = tdm_data_ptr(gb), *l = tdm_data_ptr(lse);
    const float *xv = tdm_data_ptr(x);
    double worst = 0;
    for (int i = 0; i < N * C; i++) worst = fmax(worst, fabs(a[i] - b[i]));
    CHECK(worst <= 1e-6, "gradient from lse vs recomputed: %g apart", worst);
    /* lse is the row's log-sum-exp */
    double s = 0;
    for (int c = 0; c < C; c++) s += exp(xv[C + c]);
    CHECK_CLOSE(l[1], log(s), 1e-5, 1e-6);
    for (int i = 0; i < N; i++) ((float *)tdm_data_ptr(lse))[i] += 1.0f;
    be->cross_entropy_backward(ga, gl, x, lse, tg, w, -100, 0.1f, true);
    worst = 0;
    for (int i = 0; i < N * C; i++) worst = fmax(worst, fabs(a[i] - b[i]));
    CHECK(worst > 1e-3, "the backward ignored the lse it was given");
    tdm_scope_end();
}

/* No scope open: losses return caller-owned results and free their temporaries. */
/* x.grad of a cross-entropy of x (f32 or bf16 logits), the loss times k the backward's root
 * (k 0: the loss itself). After the forward, x is overwritten with ones: a backward that reads
 * the logits gives another gradient, one that hands on the forward's does not. */
static float *ce_grad_of(tdm_dtype dt, const tdm_ce_opts *o, float k, bool spoil) {
    enum { N = 7, C = 37 };
    int64_t tv[N] = {0, 36, 3, -100, 17, 8, 36};
    tdm_rng r = tdm_rng_make(21);
    tdm_scope_begin();
    tdm_tensor *x = tdm_cast(tdm_randn(TDM_SHAPE(N, C), 0, 2, tdm_cpu(0), &r), dt);
    tdm_requires_grad_(x, true);
    /* bf16 in an autocast region, as it trains: the loss f32 (outside one it is bf16, and the
     * cast after it the root) */
    if (dt == TDM_BF16) tdm_autocast_begin(TDM_BF16);
    tdm_tensor *l = tdm_cross_entropy(x, i64(TDM_SHAPE(N), tv), o);
    if (dt == TDM_BF16) tdm_autocast_end();
    if (spoil) tdm_backend_for(x->device)->fill(x, 1.0);
    int rc = tdm_backward(k ? tdm_mul_scalar(l, k) : l);
    float *g = malloc(sizeof(float) * N * C);
    tdm_tensor *gf = x->grad ? tdm_cast(x->grad, TDM_F32) : NULL;
    CHECK(!rc && gf && !tdm_to_host(gf, g, sizeof(float) * N * C), "cross_entropy backward: %s",
          tdm_last_error());
    tdm_scope_end();
    return g;
}

/* A mean or sum whose backward starts at it takes the gradient its forward wrote in the same
 * pass over the logits; the bits are those of the backward from the logits (which any other
 * upstream takes: the loss times 1 or 0.5 here), f32 and bf16, every option. */
static void test_ce_fused_gradient(void) {
    float wv[37];
    for (int c = 0; c < 37; c++) wv[c] = 0.5f + (float)(c % 5) * 0.25f;
    tdm_tensor *w = f32(TDM_SHAPE(37), wv);
    for (int k = 0; k < 8; k++) {
        tdm_dtype dt = k & 4 ? TDM_BF16 : TDM_F32;
        tdm_ce_opts o = tdm_ce_defaults();
        o.reduction = k & 1 ? TDM_REDUCE_SUM : TDM_REDUCE_MEAN;
        o.weight = k & 2 ? w : NULL;
        o.label_smoothing = k & 2 ? 0.1f : 0.0f;
        float *fused = ce_grad_of(dt, &o, 0, false), *from_x = ce_grad_of(dt, &o, 1.0f, false);
        float *half = ce_grad_of(dt, &o, 0.5f, false), *spoilt = ce_grad_of(dt, &o, 0, true);
        float *spoilt_x = ce_grad_of(dt, &o, 1.0f, true);
        int same = 0, halved = 0, kept = 0, moved = 0;
        for (int i = 0; i < 7 * 37; i++) {
            same += fused[i] == from_x[i];
            halved += half[i] == 0.5f * fused[i]; /* a power of two: exact */
            kept += spoilt[i] == fused[i];
            moved += spoilt_x[i] != fused[i];
        }
        CHECK(same == 7 * 37 && halved == 7 * 37,
              "ce %s reduction %d options %d: %d of 259 bits as the backward from the logits, "
              "%d halved with the loss",
              tdm_dtype_name(dt), (int)o.reduction, k & 2, same, halved);
        CHECK(kept == 7 * 37, "ce %s: the root's backward read the logits (%d of 259 kept)",
              tdm_dtype_name(dt), kept);
        CHECK(moved > 200, "ce %s: the backward from the logits did not read them (%d moved)",
              tdm_dtype_name(dt), moved);
        free(fused), free(from_x), free(half), free(spoilt), free(spoilt_x);
    }
    tdm_tensor_free(w);
}

static void test_no_scope(void) {
    int64_t tv[2] = {1, 0};
    float xv[6] = {1, 2, 3, 4, 5, 6};
    tdm_tensor *x = f32(TDM_SHAPE(2, 3), xv), *t = i64(TDM_SHAPE(2), tv);
    tdm_tensor *l = tdm_cross_entropy(x, t, NULL);
    CHECK(l && tdm_book(l)->owner == NULL, "cross_entropy without a scope: %s", tdm_last_error());
    double e0 = log(exp(1) + exp(2) + exp(3)) - 2, e1 = log(exp(4) + exp(5) + exp(6)) - 4;
    if (l) CHECK_CLOSE(tdm_item(l), (e0 + e1) / 2, 1e-5, 1e-5);
    tdm_tensor_free(l);
    tdm_tensor *m = tdm_mse_loss(x, x, TDM_REDUCE_MEAN);
    CHECK(m && tdm_item(m) == 0.0f, "mse of x with itself");
    tdm_tensor_free(m);
    tdm_tensor_free(x);
    tdm_tensor_free(t);
}

/* ---- errors ---- */

static void test_errors(void) {
    tdm_scope_begin();
    tdm_tensor *x = tdm_zeros(TDM_SHAPE(4, 5), TDM_F32, tdm_cpu(0));
    int64_t bad[4] = {0, 9, 1, 2}, neg[4] = {0, -3, 1, 2}, ok[4] = {0, 1, 2, 3};
    CHECK_ERROR(!tdm_cross_entropy(x, i64(TDM_SHAPE(4), bad), NULL), "target 9");
    CHECK_ERROR(!tdm_cross_entropy(x, i64(TDM_SHAPE(4), bad), NULL), "C = 5");
    CHECK_ERROR(!tdm_cross_entropy(x, i64(TDM_SHAPE(4), neg), NULL), "target -3");
    CHECK_ERROR(!tdm_nll_loss(x, i64(TDM_SHAPE(4), bad), NULL), "target 9");
    /* dtype: float targets are not class indices */
    CHECK_ERROR(!tdm_cross_entropy(x, tdm_zeros(TDM_SHAPE(4), TDM_F32, tdm_cpu(0)), NULL),
                "target must be i32 or i64");
    /* shapes name both tensors */
    CHECK_ERROR(!tdm_cross_entropy(x, i64(TDM_SHAPE(3), ok), NULL), "target [3]");
    CHECK_ERROR(!tdm_cross_entropy(x, i64(TDM_SHAPE(3), ok), NULL), "input [4, 5]");
    CHECK_ERROR(!tdm_cross_entropy(tdm_zeros(TDM_SHAPE(5), TDM_F32, tdm_cpu(0)),
                                   i64(TDM_SHAPE(4), ok), NULL),
                "input must be [N, C], got [5]");
    tdm_ce_opts o = tdm_ce_defaults();
    o.weight = tdm_ones(TDM_SHAPE(4), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(!tdm_cross_entropy(x, i64(TDM_SHAPE(4), ok), &o), "weight [4]");
    o = tdm_ce_defaults();
    o.label_smoothing = 1.5f;
    CHECK_ERROR(!tdm_cross_entropy(x, i64(TDM_SHAPE(4), ok), &o), "label_smoothing");
    o.label_smoothing = 0.1f;
    CHECK_ERROR(!tdm_nll_loss(x, i64(TDM_SHAPE(4), ok), &o), "nll_loss: label_smoothing");
    o = tdm_ce_defaults();
    o.reduction = (tdm_reduction)7;
    CHECK_ERROR(!tdm_cross_entropy(x, i64(TDM_SHAPE(4), ok), &o), "unknown reduction");
    tdm_tensor *y = tdm_zeros(TDM_SHAPE(5, 4), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(!tdm_mse_loss(x, y, TDM_REDUCE_MEAN), "mse_loss: target [5, 4]");
    CHECK_ERROR(!tdm_bce_with_logits(x, y, TDM_REDUCE_MEAN), "bce_with_logits: target [5, 4]");
    CHECK_ERROR(!tdm_mse_loss(x, tdm_zeros(TDM_SHAPE(4, 5), TDM_I64, tdm_cpu(0)), TDM_REDUCE_MEAN),
                "mse_loss");
    CHECK_ERROR(!tdm_cross_entropy(NULL, i64(TDM_SHAPE(4), ok), NULL), "cross_entropy: NULL");
    tdm_scope_end();
}

int main(void) {
    test_ce_fixtures();
    test_ce_wide_fixtures();
    test_pair_fixtures();
    test_ce_gradcheck();
    test_pair_gradcheck();
    test_stability();
    test_backward_from_lse();
    test_ce_fused_gradient();
    test_no_scope();
    test_errors();
    return check_summary();
}
