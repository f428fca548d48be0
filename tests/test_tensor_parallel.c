/* Tensor parallelism (issue 40) over the threads group: each differentiable collective's
 * forward and backward against its definition (exact: the sums are of values a float holds,
 * in rank order as the collectives add), and Megatron's MLP (a column-parallel Linear, ReLU, a
 * row-parallel Linear, after a Linear every rank holds) on 2 and 4 ranks against the one-device
 * MLP after steps of AdamW, with the hidden layer split and gathered. */
#include "check.h"

#include <pthread.h>

#define MAX_RANKS 4
#define ROWS      3
#define K         2 /* columns of a part in the gather and scatter cases */

/* ---- the collectives ---------------------------------------------------------------------- */

typedef struct {
    int n;
    int status[MAX_RANKS];
    char msg[MAX_RANKS][256];
    /* per rank: copy's x.grad [ROWS*4]; reduce's y [ROWS*4] and x.grad; gather's y
     * [ROWS*K*n] and x.grad [ROWS*K]; scatter's y [ROWS*K] and x.grad [ROWS*K*n] */
    float copy_grad[MAX_RANKS][ROWS * 4];
    float reduce_y[MAX_RANKS][ROWS * 4], reduce_grad[MAX_RANKS][ROWS * 4];
    float gather_y[MAX_RANKS][ROWS * K * MAX_RANKS], gather_grad[MAX_RANKS][ROWS * K];
    float scatter_y[MAX_RANKS][ROWS * K], scatter_grad[MAX_RANKS][ROWS * K * MAX_RANKS];
} ops_shared;

static float copy_w(int r, int i) {
    return 0.1f * (float)(i + 1) * (float)(r + 1);
}

/* sum(y * w) backward from a scalar: d/dy = w */
static int backward_weighted(tdm_tensor *y, const float *w) {
    tdm_tensor *wt = tdm_from_data(tdm_shape_of(y), TDM_F32, tdm_cpu(0), w);
    tdm_tensor *loss = wt ? tdm_sum_all(tdm_mul(y, wt)) : NULL;
    return loss ? tdm_backward(loss) : tdm_last_status();
}

static int grad_to(tdm_tensor *x, float *out, size_t n) {
    return x->grad ? tdm_to_host(x->grad, out, sizeof(float) * n) : TDM_ERR_STATE;
}

/* A caller-owned leaf that requires a gradient, made before the step scope opens. */
static tdm_tensor *leaf(tdm_shape sh, const float *v) {
    tdm_tensor *t = f32(sh, v);
    if (t) tdm_requires_grad_(t, true);
    return t;
}

static int ops_rank(tdm_rank_ctx *ctx, void *arg) {
    ops_shared *sh = arg;
    tdm_group *g = ctx->group;
    int r = ctx->rank, n = ctx->size, rc = 0, m = ROWS * K * n;
    float a[ROWS * 4], b[ROWS * 4], c[ROWS * K], d[ROWS * K * MAX_RANKS];
    float wa[ROWS * 4], wb[ROWS * 4], wc[ROWS * K * MAX_RANKS], wd[ROWS * K * MAX_RANKS];
    for (int i = 0; i < ROWS * 4; i++) {
        a[i] = 0.5f * (float)(i + 1), wa[i] = copy_w(r, i);   /* copy: x alike, loss not */
        b[i] = (float)(i + 10 * r), wb[i] = 0.25f * (float)i; /* reduce: x each its own */
    }
    /* gather: rank r's x holds 100 r + i, the loss weighs y's element e by e; scatter: x holds
     * i everywhere, rank r's loss weighs its part by r + 1 */
    for (int i = 0; i < ROWS * K; i++) c[i] = (float)(100 * r + i);
    for (int i = 0; i < m; i++) d[i] = (float)i, wc[i] = (float)i, wd[i] = (float)(r + 1);
    tdm_tensor *xa = leaf(TDM_SHAPE(ROWS, 4), a), *xb = leaf(TDM_SHAPE(ROWS, 4), b);
    tdm_tensor *xc = leaf(TDM_SHAPE(ROWS, K), c), *xd = leaf(TDM_SHAPE(ROWS, K * n), d);
    if (!xa || !xb || !xc || !xd) rc = tdm_last_status();
    tdm_scope_begin();
    if (!rc) rc = backward_weighted(tdm_tp_copy(g, xa), wa);
    if (!rc) rc = grad_to(xa, sh->copy_grad[r], ROWS * 4);
    tdm_tensor *y = rc ? NULL : tdm_tp_reduce(g, xb);
    if (!rc) rc = y ? tdm_to_host(y, sh->reduce_y[r], sizeof sh->reduce_y[r]) : tdm_last_status();
    if (!rc) rc = backward_weighted(y, wb);
    if (!rc) rc = grad_to(xb, sh->reduce_grad[r], ROWS * 4);
    y = rc ? NULL : tdm_tp_gather(g, xc);
    if (!rc) rc = y ? tdm_to_host(y, sh->gather_y[r], sizeof(float) * (size_t)m) : -1;
    if (!rc) rc = backward_weighted(y, wc);
    if (!rc) rc = grad_to(xc, sh->gather_grad[r], ROWS * K);
    y = rc ? NULL : tdm_tp_scatter(g, xd);
    if (!rc) rc = y ? tdm_to_host(y, sh->scatter_y[r], sizeof sh->scatter_y[r]) : -1;
    if (!rc) rc = backward_weighted(y, wd);
    if (!rc) rc = grad_to(xd, sh->scatter_grad[r], (size_t)m);
    if (rc) snprintf(sh->msg[r], sizeof sh->msg[r], "%s", tdm_last_error());
    sh->status[r] = rc;
    tdm_scope_end();
    tdm_tensor_free(xa), tdm_tensor_free(xb), tdm_tensor_free(xc), tdm_tensor_free(xd);
    return rc;
}

static void test_ops(int n) {
    ops_shared sh = {.n = n};
    tdm_device devs[MAX_RANKS] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
    int rc = tdm_spawn(n, devs, ops_rank, &sh);
    CHECK(rc == TDM_OK, "%d ranks: %s", n, tdm_last_error());
    if (rc) return;
    int wrong[4] = {0};
    for (int r = 0; r < n; r++) {
        for (int i = 0; i < ROWS * 4; i++) {
            float sum = 0, xs = 0;
            for (int q = 0; q < n; q++) sum += copy_w(q, i), xs += (float)(i + 10 * q);
            wrong[0] += sh.copy_grad[r][i] != sum; /* copy: the weights summed over the ranks */
            wrong[1] += sh.reduce_y[r][i] != xs || sh.reduce_grad[r][i] != 0.25f * (float)i;
        }
        for (int row = 0; row < ROWS; row++)
            for (int c = 0; c < K * n; c++) { /* gather: rank c / K's column c % K */
                int e = row * K * n + c, q = c / K, j = c % K;
                wrong[2] += sh.gather_y[r][e] != (float)(100 * q + row * K + j);
                if (q == r) wrong[2] += sh.gather_grad[r][row * K + j] != (float)e;
                /* scatter: the gradient of column c came from rank c / K, weight q + 1 */
                wrong[3] += sh.scatter_grad[r][e] != (float)(q + 1);
                if (q == r) wrong[3] += sh.scatter_y[r][row * K + j] != (float)e;
            }
    }
    const char *names[4] = {"tp_copy", "tp_reduce", "tp_gather", "tp_scatter"};
    for (int k = 0; k < 4; k++)
        CHECK(wrong[k] == 0, "%s on %d ranks: %d values differ from the definition", names[k], n,
              wrong[k]);
}

/* ---- Megatron's MLP against one device ---------------------------------------------------- */

/* A Linear every rank holds whole before the tensor-parallel pair, so that the pair's input
 * needs its gradient (the column-parallel layer's tp_copy sums it over the ranks); the pair
 * either keeps the hidden layer split (Megatron's MLP) or gathers it and scatters it again. */

#define IN    8
#define HID   16
#define OUT   6
#define BATCH 5
#define STEPS 5

typedef struct {
    int n;
    bool gathered; /* the column-parallel layer gathers its output, the row-parallel scatters */
    float ref_w0[IN * IN], ref_w1[HID * IN], ref_b1[HID], ref_w2[OUT * HID], ref_b2[OUT],
        ref_loss[STEPS];
    float dw[MAX_RANKS], dloss[MAX_RANKS]; /* each rank's largest difference from the reference */
    int status[MAX_RANKS];
    char msg[MAX_RANKS][256];
} mlp_shared;

static tdm_optim *adamw(tdm_module *m) {
    tdm_adam_opts o = tdm_adamw_defaults();
    return tdm_adamw_new(tdm_module_parameters(m), &o);
}

/* STEPS steps of m on batches drawn from seed 11; each step's loss into loss[]. */
static int train_mlp(tdm_module *m, float *loss) {
    tdm_optim *opt = adamw(m);
    tdm_rng r = tdm_rng_make(11);
    int rc = opt ? 0 : tdm_last_status();
    for (int s = 0; s < STEPS && !rc; s++) {
        tdm_scope_begin();
        tdm_tensor *x = tdm_randn(TDM_SHAPE(BATCH, IN), 0, 1, tdm_cpu(0), &r);
        tdm_tensor *t = tdm_randn(TDM_SHAPE(BATCH, OUT), 0, 1, tdm_cpu(0), &r);
        tdm_tensor *l = tdm_mse_loss(tdm_module_forward(m, x), t, TDM_REDUCE_MEAN);
        rc = l ? tdm_optim_zero_grad(opt) : tdm_last_status();
        if (!rc) rc = tdm_backward(l);
        if (!rc) rc = tdm_optim_step(opt);
        if (!rc) loss[s] = tdm_item(l);
        tdm_scope_end();
    }
    tdm_optim_free(opt);
    return rc;
}

static tdm_module *mlp(tdm_module *zeroth, tdm_module *first, tdm_module *second) {
    return tdm_sequential_new(4, (tdm_module *[]){zeroth, first, tdm_relu_new(), second});
}

static float max_diff(const float *a, const float *b, int n) {
    float d = 0;
    for (int i = 0; i < n; i++) d = fmaxf(d, fabsf(a[i] - b[i]));
    return d;
}

static int mlp_rank(tdm_rank_ctx *ctx, void *arg) {
    mlp_shared *sh = arg;
    int r = ctx->rank, n = ctx->size, h = HID / n;
    tdm_rng rng = tdm_rng_make(7);
    tdm_module *l0 = tdm_linear_new(IN, IN, false, tdm_cpu(0), &rng);
    tdm_module *col =
        tdm_column_linear_new(IN, HID, true, sh->gathered, ctx->group, tdm_cpu(0), &rng);
    tdm_module *row =
        tdm_row_linear_new(HID, OUT, true, !sh->gathered, ctx->group, tdm_cpu(0), &rng);
    tdm_module *m = l0 && col && row ? mlp(l0, col, row) : NULL;
    float loss[STEPS], w0[IN * IN], w1[HID * IN], b1[HID], w2[OUT * HID], b2[OUT];
    int rc = m ? train_mlp(m, loss) : tdm_last_status();
    if (!rc) rc = tdm_to_host(l0->params[0], w0, sizeof w0);
    if (!rc) rc = tdm_to_host(col->params[0], w1, sizeof(float) * (size_t)(h * IN));
    if (!rc) rc = tdm_to_host(col->params[1], b1, sizeof(float) * (size_t)h);
    if (!rc) rc = tdm_to_host(row->params[0], w2, sizeof(float) * (size_t)(OUT * h));
    if (!rc) rc = tdm_to_host(row->params[1], b2, sizeof b2);
    if (!rc) {
        /* this rank's rows of the first weight and bias, columns of the second */
        float d = fmaxf(max_diff(w1, sh->ref_w1 + r * h * IN, h * IN),
                        max_diff(b1, sh->ref_b1 + r * h, h));
        for (int o = 0; o < OUT; o++)
            d = fmaxf(d, max_diff(w2 + o * h, sh->ref_w2 + o * HID + r * h, h));
        d = fmaxf(d, max_diff(w0, sh->ref_w0, IN * IN));
        sh->dw[r] = fmaxf(d, max_diff(b2, sh->ref_b2, OUT));
        sh->dloss[r] = max_diff(loss, sh->ref_loss, STEPS);
    }
    if (rc) snprintf(sh->msg[r], sizeof sh->msg[r], "%s", tdm_last_error());
    sh->status[r] = rc;
    if (!m) tdm_module_free(l0), tdm_module_free(col), tdm_module_free(row);
    tdm_module_free(m);
    return rc;
}

/* Bound: the row-parallel layer adds n partial products of HID/n terms where one device's
 * GEMM adds HID terms in its own order: outputs differ by a few float roundings (~1e-7 of
 * their size, which is about 1), and the losses, gradients and AdamW's normalised updates by
 * as much relatively; STEPS updates of lr 1e-3 then move a weight by at most ~1e-9 more. A
 * wrong gradient (a missing all-reduce, a part of the wrong rank) moves it by ~lr: 1e-3. */
#define MLP_BOUND 1e-6f

static void test_mlp(int n, bool gathered) {
    mlp_shared sh = {.n = n, .gathered = gathered};
    tdm_rng rng = tdm_rng_make(7);
    tdm_module *l0 = tdm_linear_new(IN, IN, false, tdm_cpu(0), &rng);
    tdm_module *l1 = tdm_linear_new(IN, HID, true, tdm_cpu(0), &rng);
    tdm_module *l2 = tdm_linear_new(HID, OUT, true, tdm_cpu(0), &rng);
    tdm_module *ref = mlp(l0, l1, l2);
    int rc = train_mlp(ref, sh.ref_loss);
    CHECK(rc == 0, "one device: %s", tdm_last_error());
    tdm_to_host(l0->params[0], sh.ref_w0, sizeof sh.ref_w0);
    tdm_to_host(l1->params[0], sh.ref_w1, sizeof sh.ref_w1);
    tdm_to_host(l1->params[1], sh.ref_b1, sizeof sh.ref_b1);
    tdm_to_host(l2->params[0], sh.ref_w2, sizeof sh.ref_w2);
    tdm_to_host(l2->params[1], sh.ref_b2, sizeof sh.ref_b2);
    tdm_module_free(ref);
    tdm_device devs[MAX_RANKS] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
    rc = tdm_spawn(n, devs, mlp_rank, &sh);
    CHECK(rc == TDM_OK, "MLP on %d ranks: %s", n, tdm_last_error());
    for (int r = 0; !rc && r < n; r++) {
        CHECK(sh.dw[r] <= MLP_BOUND && sh.dloss[r] <= MLP_BOUND,
              "MLP%s on %d ranks, rank %d: weights off by %g, losses by %g (bound %g)",
              gathered ? " (gathered)" : "", n, r, sh.dw[r], sh.dloss[r], MLP_BOUND);
        printf("MLP%s, tensor-parallel over %d ranks, rank %d: weights within %.3g, losses "
               "within %.3g of one device after %d AdamW steps\n",
               gathered ? " (gathered)" : "", n, r, sh.dw[r], sh.dloss[r], STEPS);
    }
}

/* ---- bad arguments ------------------------------------------------------------------------ */

static int bad_rank(tdm_rank_ctx *ctx, void *arg) {
    int *wrong = arg;
    tdm_rng rng = tdm_rng_make(1);
    tdm_module *m = tdm_column_linear_new(4, 5, true, false, ctx->group, tdm_cpu(0), &rng);
    if (m || !strstr(tdm_last_error(), "output features 5 do not split over 2 ranks"))
        wrong[ctx->rank]++;
    tdm_module_free(m);
    m = tdm_row_linear_new(3, 4, true, true, ctx->group, tdm_cpu(0), &rng);
    if (m || !strstr(tdm_last_error(), "input features 3 do not split over 2 ranks"))
        wrong[ctx->rank]++;
    tdm_module_free(m);
    m = tdm_row_linear_new(4, 4, true, true, ctx->group, tdm_cpu(0), &rng);
    tdm_module *c = m ? tdm_module_clone(m, tdm_cpu(1)) : NULL;
    if (!m || c) wrong[ctx->rank]++; /* a clone would share the group */
    tdm_module_free(c);
    tdm_module_free(m);
    return 0;
}

static void test_bad_arguments(void) {
    CHECK_ERROR(tdm_tp_copy(NULL, NULL) == NULL, "tp_copy: NULL group");
    CHECK_ERROR(tdm_column_linear_new(4, 4, true, false, NULL, tdm_cpu(0), NULL) == NULL,
                "column_linear_new: NULL group");
    int wrong[2] = {0};
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    CHECK(tdm_spawn(2, devs, bad_rank, wrong) == TDM_OK, "%s", tdm_last_error());
    CHECK(wrong[0] == 0 && wrong[1] == 0, "bad sizes or a clone: %d, %d wrong", wrong[0], wrong[1]);
}

int main(void) {
    test_bad_arguments();
    for (int n = 2; n <= MAX_RANKS; n++) test_ops(n);
    for (int gathered = 0; gathered < 2; gathered++) {
        test_mlp(2, gathered);
        test_mlp(4, gathered);
    }
    return check_summary();
}
