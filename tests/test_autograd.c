/* Autograd: the engine (accumulation, hooks, no-grad, errors) and gradient checks of the
 * shape ops and matmul. */
#include "gradcheck.h"

#define CPU tdm_cpu(0)

/* ---- gradient checks of shape ops and matmul ------------------------------------------------ */

static tdm_tensor *f_transpose_reshape(tdm_tensor **in, void *ctx) {
    return tdm_reshape(tdm_transpose(in[0], 0, 2), TDM_SHAPE(4, -1));
}
static tdm_tensor *f_permute_slice(tdm_tensor **in, void *ctx) {
    int p[3] = {2, 0, 1};
    return tdm_slice(tdm_permute(in[0], p), 1, 1, 3, 1);
}
static tdm_tensor *f_strided_slice(tdm_tensor **in, void *ctx) {
    return tdm_slice(tdm_slice(in[0], 2, 0, 4, 2), 0, -1, 2, 1);
}
static tdm_tensor *f_expand(tdm_tensor **in, void *ctx) {
    return tdm_expand(tdm_slice(in[0], 1, 0, 1, 1), TDM_SHAPE(3, 2, 3, 4));
}
static tdm_tensor *f_concat_split(tdm_tensor **in, void *ctx) {
    tdm_tensor *parts[2];
    tdm_split(in[0], (int64_t[]){1, 2}, 2, 1, parts);
    tdm_tensor *ts[3] = {parts[1], tdm_transpose(in[1], 0, 1), parts[0]};
    return tdm_concat(ts, 3, 1);
}
static tdm_tensor *f_squeeze(tdm_tensor **in, void *ctx) {
    return tdm_squeeze(tdm_unsqueeze(tdm_flatten(in[0], 0, 1), 0), 0);
}
static tdm_tensor *f_matmul(tdm_tensor **in, void *ctx) {
    return tdm_matmul(in[0], in[1]);
}
static tdm_tensor *f_matmul_t(tdm_tensor **in, void *ctx) {
    return tdm_matmul(tdm_transpose(in[0], -1, -2), tdm_transpose(in[1], -1, -2));
}

static void test_gradchecks(void) {
    tdm_tensor *x = gradcheck_input(TDM_SHAPE(2, 3, 4), 1);
    tdm_tensor *y = gradcheck_input(TDM_SHAPE(2, 4), 2);
    gradcheck("transpose+reshape", f_transpose_reshape, 1, &x, NULL, 1e-2, 1e-3, 1e-3);
    gradcheck("permute+slice", f_permute_slice, 1, &x, NULL, 1e-2, 1e-3, 1e-3);
    gradcheck("strided slice", f_strided_slice, 1, &x, NULL, 1e-2, 1e-3, 1e-3);
    gradcheck("expand", f_expand, 1, &x, NULL, 1e-2, 1e-3, 1e-3);
    gradcheck("squeeze/unsqueeze/flatten", f_squeeze, 1, &x, NULL, 1e-2, 1e-3, 1e-3);
    tdm_tensor *cs[2] = {gradcheck_input(TDM_SHAPE(4, 3), 3), y};
    gradcheck("concat+split", f_concat_split, 2, cs, NULL, 1e-2, 1e-3, 1e-3);

    struct {
        tdm_shape a, b;
        const char *what;
        gradcheck_fn fn;
    } mm[] = {
        {TDM_SHAPE(3, 4), TDM_SHAPE(4, 5), "matmul 2d", f_matmul},
        {TDM_SHAPE(2, 3, 4), TDM_SHAPE(2, 4, 5), "matmul batched", f_matmul},
        {TDM_SHAPE(2, 2, 3, 4), TDM_SHAPE(4, 5), "matmul broadcast b", f_matmul},
        {TDM_SHAPE(3, 4), TDM_SHAPE(2, 4, 5), "matmul broadcast a", f_matmul},
        {TDM_SHAPE(2, 1, 3, 4), TDM_SHAPE(3, 4, 2), "matmul partial broadcast", f_matmul},
        {TDM_SHAPE(4), TDM_SHAPE(4, 5), "matmul vector a", f_matmul},
        {TDM_SHAPE(2, 3, 4), TDM_SHAPE(4), "matmul vector b", f_matmul},
        {TDM_SHAPE(2, 4, 3), TDM_SHAPE(2, 5, 4), "matmul transposed views", f_matmul_t},
    };
    for (size_t i = 0; i < sizeof mm / sizeof mm[0]; i++) {
        tdm_tensor *in[2] = {gradcheck_input(mm[i].a, 10 + i), gradcheck_input(mm[i].b, 20 + i)};
        gradcheck(mm[i].what, mm[i].fn, 2, in, NULL, 1e-2, 2e-3, 2e-3);
        tdm_tensor_free(in[0]);
        tdm_tensor_free(in[1]);
    }
    tdm_tensor_free(x);
    tdm_tensor_free(y);
    tdm_tensor_free(cs[0]);
}

/* matmul forward against a double-precision loop, with broadcast batch dims. */
static void test_matmul_values(void) {
    tdm_scope_begin();
    tdm_rng r = tdm_rng_make(5);
    tdm_tensor *a = tdm_randn(TDM_SHAPE(3, 5, 7), 0, 1, CPU, &r);
    tdm_tensor *b = tdm_randn(TDM_SHAPE(7, 4), 0, 1, CPU, &r);
    tdm_tensor *c = tdm_matmul(a, b);
    float av[105], bv[28], want[60];
    tdm_to_host(a, av, sizeof av);
    tdm_to_host(b, bv, sizeof bv);
    for (int i = 0; i < 3; i++)
        for (int n = 0; n < 5; n++)
            for (int m = 0; m < 4; m++) {
                double s = 0;
                for (int k = 0; k < 7; k++) s += (double)av[i * 35 + n * 7 + k] * bv[k * 4 + m];
                want[i * 20 + n * 4 + m] = (float)s;
            }
    CHECK(c && c->ndim == 3 && c->shape[2] == 4, "matmul output shape");
    check_tensor_close(c, want, 1e-5, 1e-5, "matmul values");
    CHECK_ERROR(tdm_matmul(a, a) == NULL, "inner dims differ: [3, 5, 7] @ [3, 5, 7]");
    CHECK_ERROR(tdm_matmul(a, tdm_cast(b, TDM_I32)) == NULL,
                "expected a float tensor (f32, bf16 or f16), got i32");
    CHECK_ERROR(tdm_bmm(b, b) == NULL, "bmm: expected [B, n, k]");
    tdm_scope_end();
}

/* ---- the engine -------------------------------------------------------------------------- */

typedef struct {
    int calls;
    float grad0; /* the gradient's first element when the hook fired */
    int order[4], n;
} hook_log;

static void on_ready(tdm_tensor *leaf, void *ctx) {
    hook_log *h = ctx;
    float g[1];
    tdm_to_host(tdm_slice(tdm_flatten(leaf->grad, 0, -1), 0, 0, 1, 1), g, sizeof g);
    h->grad0 = g[0];
    h->calls++;
}

static void test_engine(void) {
    tdm_tensor *w = tdm_full(TDM_SHAPE(2, 2), 1.0f, TDM_F32, CPU);
    tdm_tensor *v = tdm_full(TDM_SHAPE(2), 3.0f, TDM_F32, CPU);
    tdm_requires_grad_(w, true);
    tdm_requires_grad_(v, true);
    hook_log hw = {0}, hv = {0};
    tdm_register_grad_hook(w, on_ready, &hw);
    tdm_register_grad_hook(v, on_ready, &hv);

    /* L = sum(w @ v) + sum(w): dL/dw[i][j] = v[j] + 1 = 4; dL/dv[j] = sum_i w[i][j] = 2 */
    for (int step = 0; step < 2; step++) {
        tdm_scope_begin();
        tdm_tensor *l = tdm_add(tdm_sum_all(tdm_matmul(w, v)), tdm_sum_all(w));
        CHECK(tdm_backward(l) == 0, "backward: %s", tdm_last_error());
        CHECK_ERROR(tdm_backward(l) != 0, "already walked");
        tdm_scope_end();
    }
    float g4[4] = {8, 8, 8, 8}, g2[2] = {4, 4};
    check_tensor_close(w->grad, g4, 0, 1e-6, "two backward calls accumulate into w.grad");
    check_tensor_close(v->grad, g2, 0, 1e-6, "two backward calls accumulate into v.grad");
    CHECK(hw.calls == 2 && hv.calls == 2, "a hook fires once per backward (%d, %d)", hw.calls,
          hv.calls);
    CHECK(hw.grad0 == 8, "the hook sees w's final gradient (got %g)", hw.grad0);

    tdm_zero_grad(w);
    float z4[4] = {0};
    check_tensor_close(w->grad, z4, 0, 0, "zero_grad");

    /* no-grad: nothing recorded, no gradient */
    tdm_scope_begin();
    int before = tdm_tape_size();
    bool prev = tdm_set_grad_enabled(false);
    tdm_tensor *l = tdm_sum_all(tdm_matmul(w, v));
    tdm_set_grad_enabled(prev);
    CHECK(tdm_tape_size() == before && !l->requires_grad, "no-grad records nothing");
    CHECK_ERROR(tdm_backward(l) != 0, "no autograd history");
    CHECK_ERROR(tdm_backward(tdm_matmul(w, w)) != 0, "must have one element, got shape [2, 2]");
    tdm_scope_end();
    CHECK(tdm_tape_size() == 0, "the scope end clears the tape");

    /* recording needs a scope: each kind of op fails, naming it, and frees its output once
     * (ASan: a double free here was the output freed by the tape and again by the op) */
    CHECK_ERROR(tdm_matmul(w, v) == NULL, "needs an open step scope");
    CHECK_ERROR(tdm_relu(w) == NULL, "needs an open step scope");
    CHECK_ERROR(tdm_sum_all(w) == NULL, "needs an open step scope");
    CHECK_ERROR(tdm_softmax(w, 1) == NULL, "needs an open step scope");
    tdm_tensor *img = tdm_ones(TDM_SHAPE(1, 1, 2, 2), TDM_F32, CPU);
    tdm_tensor *k = tdm_ones(TDM_SHAPE(1, 1, 1, 1), TDM_F32, CPU);
    tdm_requires_grad_(img, true);
    tdm_pool2d_opts p2 = {.kernel_h = 2, .kernel_w = 2};
    CHECK_ERROR(tdm_conv2d(img, k, NULL, NULL) == NULL, "conv2d: recording");
    CHECK_ERROR(tdm_max_pool2d(img, &p2) == NULL, "max_pool2d: recording");
    CHECK_ERROR(tdm_avg_pool2d(img, &p2) == NULL, "avg_pool2d: recording");
    tdm_tensor_free(img);
    tdm_tensor_free(k);
    CHECK_ERROR(tdm_requires_grad_(tdm_scope_keep(NULL), true) != 0, "NULL tensor");
    tdm_tensor *iv = tdm_zeros(TDM_SHAPE(2), TDM_I64, CPU);
    CHECK_ERROR(tdm_requires_grad_(iv, true) != 0, "only float tensors (f32, bf16, f16)");
    tdm_tensor_free(iv);
    tdm_tensor_free(w);
    tdm_tensor_free(v);
}

/* A leaf used by two ops gets both contributions; the same gradient tensor reaching two
 * inputs (x + x) is not added into in place. */
static void test_shared_gradients(void) {
    tdm_tensor *x = gradcheck_input(TDM_SHAPE(3), 3);
    tdm_scope_begin();
    tdm_tensor *y = tdm_add(x, x);             /* dy/dx = 2 */
    tdm_tensor *z = tdm_add(tdm_mul(y, y), y); /* dz/dy = 2y + 1 */
    tdm_backward(tdm_sum_all(z));
    float xv[3], gv[3], want[3];
    tdm_to_host(x, xv, sizeof xv);
    tdm_to_host(x->grad, gv, sizeof gv);
    for (int i = 0; i < 3; i++) want[i] = 2 * (2 * 2 * xv[i] + 1);
    check_tensor_close(x->grad, want, 1e-5, 1e-5, "diamond graph gradient");
    tdm_scope_end();
    tdm_tensor_free(x);
}

/* The engine gives a gradient's memory back once the nodes holding it have run: a chain of 16
 * tanh of a 1 MiB tensor keeps 16 forward outputs (tanh saves its output) but, walking back,
 * about two of its gradients at a time, where keeping them to the scope's end held all 16.
 * Between the tanh, an add of 0 passes its gradient on unchanged (two nodes hold it in turn):
 * not given back too early, the chain's gradient stays right (ASan poisons the blocks given
 * back; test_shared_gradients' diamond too). */
static void test_gradients_freed(void) {
    const int64_t n = 256 * 1024, depth = 16; /* 1 MiB of floats */
    tdm_tensor *x = gradcheck_input(TDM_SHAPE(n), 5);
    tdm_scope_begin();
    tdm_tensor *y = x;
    for (int i = 0; i < depth; i++) y = tdm_tanh(tdm_add_scalar(y, 0.0f));
    tdm_tensor *l = tdm_sum_all(y);
    tdm_memory_stats before = tdm_memory_stats_get(CPU);
    tdm_memory_reset_peak(CPU);
    CHECK(tdm_backward(l) == 0, "backward: %s", tdm_last_error());
    tdm_memory_stats after = tdm_memory_stats_get(CPU);
    int64_t grown = after.peak_allocated - before.allocated, mib = 4 * n;
    CHECK(grown < 6 * mib, "backward of %lld tanh grew the memory by %.1f MiB (at most 6 expected)",
          (long long)depth, (double)grown / mib);
    /* d/dx of tanh composed 16 times */
    float *xv = malloc(sizeof(float) * (size_t)n), *gv = malloc(sizeof(float) * (size_t)n);
    tdm_to_host(x, xv, sizeof(float) * (size_t)n);
    tdm_to_host(x->grad, gv, sizeof(float) * (size_t)n);
    int bad = 0;
    for (int64_t i = 0; i < n; i += 997) {
        double v = xv[i], d = 1;
        for (int k = 0; k < depth; k++) v = tanh(v), d *= 1 - v * v;
        bad += fabs(gv[i] - d) > 1e-5 + 1e-4 * fabs(d);
    }
    CHECK(bad == 0, "%d gradients of the chain wrong", bad);
    free(xv), free(gv);
    tdm_scope_end();
    tdm_tensor_free(x);
}

/* sum(linear(x) * gy) (bias_too) or sum((x @ w^T) * gy), whose backward writes the gradient of
 * w through the GEMM's inplace target (the flat buffer) and of the bias through an add. */
static int linear_backward_of(tdm_module *m, bool bias_too, uint64_t seed) {
    tdm_rng r = tdm_rng_make(seed);
    tdm_scope_begin();
    tdm_tensor *x = tdm_randn(TDM_SHAPE(5, 4), 0, 1, CPU, &r);
    tdm_tensor *w = tdm_module_find(m, "weight");
    tdm_tensor *y = bias_too ? tdm_module_forward(m, x) : tdm_matmul(x, tdm_transpose(w, 0, 1));
    tdm_tensor *gy = tdm_randn(TDM_SHAPE(5, 3), 0, 1, CPU, &r);
    int rc = tdm_backward(tdm_sum_all(tdm_mul(y, gy)));
    tdm_scope_end();
    return rc;
}

/* tdm_paramset_mark_grads_stale: a gradient marked stale is replaced by the next backward, as
 * if zeroed (the GEMM writes with beta 0, the bias's add becomes a copy); unmarked ones still
 * accumulate; one the backward does not reach is zeroed by tdm_paramset_settle_grads, which
 * leaves reached ones alone. */
static void test_grad_overwrite(void) {
    tdm_rng rng = tdm_rng_make(3);
    tdm_module *m = tdm_linear_new(4, 3, true, CPU, &rng);
    tdm_paramset *ps = tdm_module_parameters(m);
    if (!ps) return;
    int64_t n = ps->total;
    float fresh[15], now[15];
    tdm_fill_(ps->flat_grad, 0.0);
    CHECK(linear_backward_of(m, true, 9) == 0, "backward: %s", tdm_last_error());
    memcpy(fresh, tdm_data_ptr(ps->flat_grad), sizeof(float) * (size_t)n);
    tdm_fill_(ps->flat_grad, 7.0); /* stale values the marked backward must not add to */
    tdm_paramset_mark_grads_stale(ps);
    CHECK(linear_backward_of(m, true, 9) == 0, "marked backward: %s", tdm_last_error());
    CHECK(tdm_paramset_settle_grads(ps) == 0, "settle: %s", tdm_last_error());
    memcpy(now, tdm_data_ptr(ps->flat_grad), sizeof(float) * (size_t)n);
    CHECK(memcmp(now, fresh, sizeof(float) * (size_t)n) == 0,
          "a marked gradient is not the fresh one (weight[0] %g, want %g; bias[0] %g, want %g)",
          (double)now[0], (double)fresh[0], (double)now[12], (double)fresh[12]);
    CHECK(linear_backward_of(m, true, 9) == 0, "unmarked backward: %s", tdm_last_error());
    const float *g = tdm_data_ptr(ps->flat_grad);
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad += g[i] != fresh[i] + fresh[i];
    CHECK(bad == 0, "an unmarked gradient does not accumulate: %d of %lld differ", bad,
          (long long)n);
    tdm_fill_(ps->flat_grad, 7.0);
    tdm_paramset_mark_grads_stale(ps);
    CHECK(linear_backward_of(m, false, 9) == 0, "backward without the bias: %s", tdm_last_error());
    CHECK(tdm_paramset_settle_grads(ps) == 0, "settle: %s", tdm_last_error());
    CHECK(memcmp(g, fresh, sizeof(float) * 12) == 0 && g[12] == 0 && g[13] == 0 && g[14] == 0,
          "settle: weight %g (want %g), bias %g %g %g (want zeros)", (double)g[0], (double)fresh[0],
          (double)g[12], (double)g[13], (double)g[14]);
    tdm_paramset_mark_grads_stale(NULL);
    CHECK(tdm_paramset_settle_grads(NULL) == TDM_OK, "settle of no set");
    tdm_module_free(m);
}

int main(void) {
    test_gradchecks();
    test_grad_overwrite();
    test_matmul_values();
    test_engine();
    test_shared_gradients();
    test_gradients_freed();
    return check_summary();
}
