/* Tensor parallelism (issue 40) over the threads group: each differentiable collective's
 * forward and backward against its definition (exact: the sums are of values a float holds,
 * in rank order as the collectives add), and Megatron's MLP (a column-parallel Linear, ReLU, a
 * row-parallel Linear, after a Linear every rank holds) on 2 and 4 ranks against the one-device
 * MLP after steps of AdamW, with the hidden layer split and gathered, and on a dp 2 x tp 2 device
 * mesh with DDP over its data-parallel groups. */
#include "check.h"
#include "parallel/group.h" /* a mesh group's backend, for the GPU case */
#include "tandem/gpt.h"
#include "tandem/strategy.h"

#include <pthread.h>
#include <stdlib.h>

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

static float max_diff(const float *a, const float *b, int n) {
    float d = 0;
    for (int i = 0; i < n; i++) d = fmaxf(d, fabsf(a[i] - b[i]));
    return d;
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

/* The sequence-parallel collectives along dim 1 of [2, S, 3], S = 2 n (2 tokens a rank), each
 * against its definition: shard (backward: join), gather with the gradients summed or each
 * rank's own, reduce-scatter (backward: join). e is an element's index in the whole tensor. */
#define SB 2
#define SC 3
static int seq_ops_rank(tdm_rank_ctx *ctx, void *arg) {
    int *wrong = arg, r = ctx->rank, n = ctx->size, S = 2 * n, whole = SB * S * SC;
    float v[SB * 2 * MAX_RANKS * SC], w[SB * 2 * MAX_RANKS * SC], got[SB * 2 * MAX_RANKS * SC];
    float part[SB * 2 * SC];
    for (int e = 0; e < whole; e++) v[e] = (float)e, w[e] = (float)e;
    for (int e = 0; e < SB * 2 * SC; e++) part[e] = (float)(100 * r + e);
    tdm_tensor *x[4] = {leaf(TDM_SHAPE(SB, S, SC), v), leaf(TDM_SHAPE(SB, 2, SC), part),
                        leaf(TDM_SHAPE(SB, 2, SC), part), leaf(TDM_SHAPE(SB, S, SC), v)};
    tdm_scope_begin();
    for (int k = 0; k < 4; k++) {
        tdm_tensor *y = k == 0  ? tdm_tp_seq_shard(ctx->group, x[0], 1)
                        : k < 3 ? tdm_tp_seq_gather(ctx->group, x[k], 1, k == 1)
                                : tdm_tp_seq_reduce_scatter(ctx->group, x[3], 1);
        int64_t m = y ? tdm_numel(y) : 0;
        float wy[SB * 2 * MAX_RANKS * SC]; /* shard, reduce-scatter: weights r + 1 */
        for (int e = 0; e < m; e++) wy[e] = k == 0 || k == 3 ? (float)(r + 1) : w[e];
        if (!y || tdm_to_host(y, got, sizeof(float) * (size_t)m) || backward_weighted(y, wy)) {
            wrong[r] += 100;
            continue;
        }
        for (int b = 0; b < SB; b++)
            for (int t = 0; t < S; t++)
                for (int c = 0; c < SC; c++) {
                    int e = (b * S + t) * SC + c, q = t / 2, j = t % 2, pe = (b * 2 + j) * SC + c;
                    if (k == 0 && q == r) wrong[r] += got[pe] != (float)e; /* its tokens */
                    if (k == 1 || k == 2) wrong[r] += got[e] != (float)(100 * q + pe);
                    /* reduce-scatter: x is v on every rank, so its part is n v */
                    if (k == 3 && q == r) wrong[r] += got[pe] != (float)(n * e);
                }
    }
    /* the gradients */
    float g[SB * 2 * MAX_RANKS * SC];
    for (int k = 0; k < 4; k++) {
        int64_t m = tdm_numel(x[k]);
        if (!x[k]->grad || tdm_to_host(x[k]->grad, g, sizeof(float) * (size_t)m)) {
            wrong[r] += 100;
            continue;
        }
        for (int e = 0; e < m; e++) {
            int t = k == 0 || k == 3 ? (e / SC) % S : r * 2 + (e / SC) % 2,
                b = e / SC / (k % 3 ? 2 : S);
            int we = (b * S + t) * SC + e % SC; /* the element's index in the whole */
            float want = k == 0 || k == 3 ? (float)(t / 2 + 1) /* joined: token t's owner's r + 1 */
                         : k == 1         ? (float)(n * we)    /* every rank's e, summed */
                                          : (float)we;                 /* its own part of e */
            wrong[r] += g[e] != want;
        }
    }
    tdm_scope_end();
    for (int k = 0; k < 4; k++) tdm_tensor_free(x[k]);
    return 0;
}

static void test_seq_ops(int n) {
    int wrong[MAX_RANKS] = {0};
    tdm_device devs[MAX_RANKS] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
    CHECK(tdm_spawn(n, devs, seq_ops_rank, wrong) == TDM_OK, "%s", tdm_last_error());
    for (int r = 0; r < n; r++)
        CHECK(wrong[r] == 0, "sequence-parallel ops on %d ranks, rank %d: %d values wrong", n, r,
              wrong[r]);
}

/* ---- vocabulary parallelism against the whole vocabulary on one device -------------------- */

#define VM 5  /* rows of logits */
#define VV 12 /* the vocabulary */
#define VC 4  /* embedding channels */

typedef struct {
    float logits[VM * VV], ref_loss, ref_grad[VM * VV]; /* cross-entropy on one device */
    float emb_w[VV * VC], ref_emb[2 * 3 * VC], ref_emb_grad[VV * VC];
    int64_t target[VM], tokens[2 * 3];
    float dloss[MAX_RANKS], dgrad[MAX_RANKS], demb[MAX_RANKS];
    tdm_dtype dt; /* the logits' */
} vocab_shared;

/* the columns [r k, (r+1) k) of m [rows, VV] (or rows [r k, (r+1) k) of [VV, cols]) */
static void part_cols(const float *m, int rows, int k, int r, float *out) {
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < k; j++) out[i * k + j] = m[i * VV + r * k + j];
}

static int vocab_rank(tdm_rank_ctx *ctx, void *arg) {
    vocab_shared *sh = arg;
    int r = ctx->rank, k = VV / ctx->size;
    float lp[VM * VV], wp[VV * VC], g[VM * VV], y[2 * 3 * VC];
    part_cols(sh->logits, VM, k, r, lp);
    memcpy(wp, sh->emb_w + r * k * VC, sizeof(float) * (size_t)(k * VC));
    tdm_tensor *l = f32(TDM_SHAPE(VM, k), lp), *w = leaf(TDM_SHAPE(k, VC), wp);
    if (l && sh->dt != TDM_F32) { /* bf16 logits, the values the reference had */
        tdm_tensor *low = tdm_cast(l, sh->dt);
        tdm_tensor_free(l);
        l = low;
    }
    if (l) tdm_requires_grad_(l, true);
    int rc = l && w ? 0 : tdm_last_status();
    tdm_scope_begin();
    tdm_tensor *loss =
        rc ? NULL : tdm_tp_cross_entropy(ctx->group, l, i64(TDM_SHAPE(VM), sh->target));
    if (!rc) rc = loss ? tdm_backward(loss) : tdm_last_status();
    if (!rc && (!l->grad || l->grad->dtype != sh->dt))
        rc = tdm_raise(TDM_ERR_DTYPE, "the logits' gradient is missing or not in their dtype");
    tdm_tensor *g32 = rc ? NULL : tdm_to_dtype(l->grad, TDM_F32);
    if (!rc) rc = g32 ? tdm_to_host(g32, g, sizeof(float) * VM * (size_t)k) : tdm_last_status();
    if (!rc) {
        float want[VM * VV];
        part_cols(sh->ref_grad, VM, k, r, want);
        sh->dloss[r] = fabsf(tdm_item(loss) - sh->ref_loss);
        sh->dgrad[r] = max_diff(g, want, VM * k);
    }
    /* the embedding: the loss weighs output element e by e */
    tdm_tensor *e = rc ? NULL : tdm_tp_embedding(ctx->group, w, i64(TDM_SHAPE(2, 3), sh->tokens));
    float we[2 * 3 * VC];
    for (int i = 0; i < 2 * 3 * VC; i++) we[i] = (float)i;
    if (!rc) rc = e ? tdm_to_host(e, y, sizeof y) : tdm_last_status();
    if (!rc) rc = backward_weighted(e, we);
    if (!rc) rc = grad_to(w, g, (size_t)(k * VC));
    if (!rc)
        sh->demb[r] = fmaxf(max_diff(y, sh->ref_emb, 2 * 3 * VC),
                            max_diff(g, sh->ref_emb_grad + r * k * VC, k * VC));
    tdm_scope_end();
    tdm_tensor_free(l), tdm_tensor_free(w);
    return rc;
}

/* Bound: the loss adds the ranks' sums of exponentials in another order than one device's
 * row; a few float roundings of values ~1. The embedding is exact: each output row is one
 * rank's row plus zeros. bf16 logits (dt) are read as they are, in f32 inside: the reference
 * takes the same values in f32, and the gradient, rounded to bf16 once, is within 2^-8 of it. */
static void test_vocab(int n, tdm_dtype dt) {
    vocab_shared sh = {.dt = dt};
    tdm_rng rng = tdm_rng_make(21);
    tdm_tensor *l = tdm_randn(TDM_SHAPE(VM, VV), 0, 2, tdm_cpu(0), &rng);
    if (dt != TDM_F32) { /* the reference on the low-precision values */
        tdm_tensor *low = tdm_cast(l, dt), *back = low ? tdm_cast(low, TDM_F32) : NULL;
        tdm_tensor_free(l), tdm_tensor_free(low);
        l = back;
    }
    tdm_tensor *w = tdm_randn(TDM_SHAPE(VV, VC), 0, 1, tdm_cpu(0), &rng);
    for (int i = 0; i < VM; i++) sh.target[i] = (i * 5 + 3) % VV;
    for (int i = 0; i < 6; i++) sh.tokens[i] = (i * 7 + 1) % VV;
    tdm_requires_grad_(l, true), tdm_requires_grad_(w, true);
    tdm_scope_begin();
    tdm_tensor *loss = tdm_cross_entropy(l, i64(TDM_SHAPE(VM), sh.target), NULL);
    tdm_backward(loss);
    sh.ref_loss = tdm_item(loss);
    tdm_tensor *e = tdm_embedding(w, i64(TDM_SHAPE(2, 3), sh.tokens));
    float we[2 * 3 * VC];
    for (int i = 0; i < 2 * 3 * VC; i++) we[i] = (float)i;
    tdm_to_host(e, sh.ref_emb, sizeof sh.ref_emb);
    backward_weighted(e, we);
    tdm_scope_end();
    tdm_to_host(l, sh.logits, sizeof sh.logits),
        tdm_to_host(l->grad, sh.ref_grad, sizeof sh.ref_grad);
    tdm_to_host(w, sh.emb_w, sizeof sh.emb_w),
        tdm_to_host(w->grad, sh.ref_emb_grad, sizeof sh.ref_emb_grad);
    tdm_tensor_free(l), tdm_tensor_free(w);
    tdm_device devs[MAX_RANKS] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
    int rc = tdm_spawn(n, devs, vocab_rank, &sh);
    CHECK(rc == TDM_OK, "vocabulary over %d ranks: %s", n, tdm_last_error());
    for (int r = 0; !rc && r < n; r++)
        CHECK(sh.dloss[r] <= 1e-6f && sh.dgrad[r] <= (dt == TDM_F32 ? 1e-6f : 0x1p-8f) &&
                  sh.demb[r] == 0,
              "vocabulary over %d ranks in %s, rank %d: loss off by %g, its gradient by %g, the "
              "embedding by %g",
              n, tdm_dtype_name(dt), r, sh.dloss[r], sh.dgrad[r], sh.demb[r]);
}

/* ---- Megatron's MLP against one device ---------------------------------------------------- */

/* A Linear every rank holds whole before the tensor-parallel pair, so that the pair's input
 * needs its gradient (the column-parallel layer's tp_copy sums it over the ranks); the pair
 * either keeps the hidden layer split (Megatron's MLP) or gathers it and scatters it again. */

#define IN    8
#define HID   16
#define OUT   6
#define BATCH 6 /* rows of the global batch: 3 for each of 2 data-parallel ranks */
#define STEPS 5

typedef struct {
    int n;
    bool gathered; /* the column-parallel layer gathers its output, the row-parallel scatters */
    int dp_size;   /* > 1: a dp x tp mesh, DDP over dp */
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

/* STEPS steps of m on batches of BATCH rows drawn from seed 11; each step's loss (over the
 * whole batch) into loss[]. With DDP over dp (NULL: none), this rank trains on its rows
 * [lo, lo + BATCH / size) and the loss is the ranks' average. */
static int train_mlp(tdm_module *m, tdm_ddp *d, tdm_group *dp, float *loss) {
    tdm_optim *opt = adamw(m);
    tdm_rng r = tdm_rng_make(11);
    int rc = opt ? 0 : tdm_last_status();
    int64_t rows = dp ? BATCH / tdm_group_size(dp) : BATCH, lo = dp ? rows * tdm_group_rank(dp) : 0;
    for (int s = 0; s < STEPS && !rc; s++) {
        tdm_scope_begin();
        tdm_tensor *x = tdm_randn(TDM_SHAPE(BATCH, IN), 0, 1, tdm_cpu(0), &r);
        tdm_tensor *t = tdm_randn(TDM_SHAPE(BATCH, OUT), 0, 1, tdm_cpu(0), &r);
        x = tdm_slice(x, 0, lo, lo + rows, 1), t = tdm_slice(t, 0, lo, lo + rows, 1);
        tdm_tensor *y = d ? tdm_ddp_forward(d, x) : tdm_module_forward(m, x);
        tdm_tensor *l = tdm_mse_loss(y, t, TDM_REDUCE_MEAN);
        rc = l ? tdm_optim_zero_grad(opt) : tdm_last_status();
        if (!rc) rc = d ? tdm_ddp_backward(d, l) : tdm_backward(l);
        if (!rc) rc = tdm_optim_step(opt);
        tdm_tensor *avg = rc ? NULL : tdm_clone(l);
        if (avg && dp) rc = tdm_work_wait(tdm_all_reduce(dp, avg, TDM_AVG));
        if (!rc) loss[s] = avg ? tdm_item(avg) : NAN;
        tdm_scope_end();
    }
    tdm_optim_free(opt);
    return rc;
}

static tdm_module *mlp(tdm_module *zeroth, tdm_module *first, tdm_module *second) {
    return tdm_sequential_new(4, (tdm_module *[]){zeroth, first, tdm_relu_new(), second});
}

/* This rank's MLP over tp, trained (with DDP over dp where dp is not NULL), compared with the
 * one-device reference; t: its rank in tp. */
static int mlp_parts(mlp_shared *sh, tdm_group *tp, tdm_group *dp, int r) {
    int t = tdm_group_rank(tp), h = HID / tdm_group_size(tp);
    tdm_rng rng = tdm_rng_make(7);
    tdm_module *l0 = tdm_linear_new(IN, IN, false, tdm_cpu(0), &rng);
    tdm_module *col = tdm_column_linear_new(IN, HID, true, sh->gathered, tp, tdm_cpu(0), &rng);
    tdm_module *row = tdm_row_linear_new(HID, OUT, true, !sh->gathered, tp, tdm_cpu(0), &rng);
    tdm_module *m = l0 && col && row ? mlp(l0, col, row) : NULL;
    if (!m) tdm_module_free(l0), tdm_module_free(col), tdm_module_free(row);
    float loss[STEPS], w0[IN * IN], w1[HID * IN], b1[HID], w2[OUT * HID], b2[OUT];
    tdm_ddp *d = m && dp ? tdm_ddp_new(m, dp, NULL) : NULL;
    int rc = !m || (dp && !d) ? tdm_last_status() : train_mlp(m, d, dp, loss);
    tdm_ddp_free(d);
    if (!rc) rc = tdm_to_host(l0->params[0], w0, sizeof w0);
    if (!rc) rc = tdm_to_host(col->params[0], w1, sizeof(float) * (size_t)(h * IN));
    if (!rc) rc = tdm_to_host(col->params[1], b1, sizeof(float) * (size_t)h);
    if (!rc) rc = tdm_to_host(row->params[0], w2, sizeof(float) * (size_t)(OUT * h));
    if (!rc) rc = tdm_to_host(row->params[1], b2, sizeof b2);
    if (!rc) {
        /* its rows of the first weight and bias, its columns of the second */
        float dw = fmaxf(max_diff(w1, sh->ref_w1 + t * h * IN, h * IN),
                         max_diff(b1, sh->ref_b1 + t * h, h));
        for (int o = 0; o < OUT; o++)
            dw = fmaxf(dw, max_diff(w2 + o * h, sh->ref_w2 + o * HID + t * h, h));
        dw = fmaxf(dw, max_diff(w0, sh->ref_w0, IN * IN));
        sh->dw[r] = fmaxf(dw, max_diff(b2, sh->ref_b2, OUT));
        sh->dloss[r] = max_diff(loss, sh->ref_loss, STEPS);
    }
    tdm_module_free(m);
    return rc;
}

static int mlp_rank(tdm_rank_ctx *ctx, void *arg) {
    mlp_shared *sh = arg;
    int rc;
    if (sh->dp_size > 1) { /* dp x tp: the mesh's groups */
        int sizes[2] = {sh->dp_size, ctx->size / sh->dp_size};
        tdm_mesh *mesh = tdm_mesh_new(ctx->group, 2, sizes, (const char *[]){"dp", "tp"});
        rc = mesh ? mlp_parts(sh, tdm_mesh_group(mesh, "tp"), tdm_mesh_group(mesh, "dp"), ctx->rank)
                  : tdm_last_status();
        tdm_mesh_free(mesh);
    } else {
        rc = mlp_parts(sh, ctx->group, NULL, ctx->rank);
    }
    if (rc) snprintf(sh->msg[ctx->rank], sizeof sh->msg[ctx->rank], "%s", tdm_last_error());
    sh->status[ctx->rank] = rc;
    return rc;
}

/* Bound: the row-parallel layer adds n partial products of HID/n terms where one device's
 * GEMM adds HID terms in its own order: outputs differ by a few float roundings (~1e-7 of
 * their size, which is about 1), and the losses, gradients and AdamW's normalised updates by
 * as much relatively; STEPS updates of lr 1e-3 then move a weight by at most ~1e-9 more. A
 * wrong gradient (a missing all-reduce, a part of the wrong rank) moves it by ~lr: 1e-3. */
#define MLP_BOUND 1e-6f

/* The one-device MLP trained, its losses and weights into sh's references. */
static int mlp_reference(mlp_shared *sh) {
    tdm_rng rng = tdm_rng_make(7);
    tdm_module *l0 = tdm_linear_new(IN, IN, false, tdm_cpu(0), &rng);
    tdm_module *l1 = tdm_linear_new(IN, HID, true, tdm_cpu(0), &rng);
    tdm_module *l2 = tdm_linear_new(HID, OUT, true, tdm_cpu(0), &rng);
    tdm_module *ref = mlp(l0, l1, l2);
    int rc = train_mlp(ref, NULL, NULL, sh->ref_loss);
    if (!rc) rc = tdm_to_host(l0->params[0], sh->ref_w0, sizeof sh->ref_w0);
    if (!rc) rc = tdm_to_host(l1->params[0], sh->ref_w1, sizeof sh->ref_w1);
    if (!rc) rc = tdm_to_host(l1->params[1], sh->ref_b1, sizeof sh->ref_b1);
    if (!rc) rc = tdm_to_host(l2->params[0], sh->ref_w2, sizeof sh->ref_w2);
    if (!rc) rc = tdm_to_host(l2->params[1], sh->ref_b2, sizeof sh->ref_b2);
    tdm_module_free(ref);
    return rc;
}

static void test_mlp(int n, bool gathered, int dp_size) {
    mlp_shared sh = {.n = n, .gathered = gathered, .dp_size = dp_size};
    int rc = mlp_reference(&sh);
    CHECK(rc == 0, "one device: %s", tdm_last_error());
    tdm_device devs[MAX_RANKS] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
    rc = tdm_spawn(n, devs, mlp_rank, &sh);
    CHECK(rc == TDM_OK, "MLP on %d ranks: %s", n, tdm_last_error());
    for (int r = 0; !rc && r < n; r++) {
        CHECK(sh.dw[r] <= MLP_BOUND && sh.dloss[r] <= MLP_BOUND,
              "MLP%s on %d ranks (dp %d), rank %d: weights off by %g, losses by %g (bound %g)",
              gathered ? " (gathered)" : "", n, dp_size, r, sh.dw[r], sh.dloss[r], MLP_BOUND);
        printf("MLP%s, dp %d x tp %d, rank %d: weights within %.3g, losses within %.3g of one "
               "device after %d AdamW steps\n",
               gathered ? " (gathered)" : "", dp_size, n / dp_size, r, sh.dw[r], sh.dloss[r],
               STEPS);
    }
}

/* ---- the GPT, split by tdm_gpt_parallelize ------------------------------------------------ */

#define G_STEPS 3
#define G_B     2
#define G_T     8

static const tdm_gpt_config GCFG = {
    .layers = 2, .heads = 4, .channels = 32, .context = G_T, .vocab = 50, .padded_vocab = 64};

typedef struct {
    tdm_module *ref; /* the one-device GPT after G_STEPS */
    bool seq;        /* sequence parallelism too */
    bool vocab;      /* vocabulary parallelism too */
    bool llmc_refused[MAX_RANKS];
    float dwhole[MAX_RANKS]; /* tdm_tp_gather_whole's model against the reference */
    float ref_loss[G_STEPS], dw[MAX_RANKS], dloss[MAX_RANKS];
    char msg[MAX_RANKS][256];
} gpt_shared;

/* G_STEPS steps of AdamW on tokens from a fixed sequence; each step's loss into loss[]. */
static int train_gpt(tdm_module *m, float *loss) {
    tdm_adam_opts o = tdm_adamw_defaults();
    tdm_optim *opt = tdm_gpt_adamw_new(tdm_module_parameters(m), &o);
    int rc = opt ? 0 : tdm_last_status();
    uint32_t lcg = 13;
    for (int s = 0; s < G_STEPS && !rc; s++) {
        int64_t tok[2][G_B * G_T];
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < G_B * G_T; i++)
                lcg = lcg * 1664525u + 1013904223u, tok[k][i] = (lcg >> 8) % GCFG.vocab;
        tdm_scope_begin();
        tdm_tensor *idx = i64(TDM_SHAPE(G_B, G_T), tok[0]), *tg = i64(TDM_SHAPE(G_B, G_T), tok[1]);
        tdm_tensor *l = tdm_gpt_loss_of(m, tdm_gpt_forward(m, idx), tg);
        rc = l ? tdm_optim_zero_grad(opt) : tdm_last_status();
        if (!rc) rc = tdm_backward(l);
        if (!rc) rc = tdm_optim_step(opt);
        if (!rc) loss[s] = tdm_item(l);
        tdm_scope_end();
    }
    tdm_optim_free(opt);
    return rc;
}

/* The largest difference between rank r's part `p` (named `name`, of n ranks) and the part of
 * the reference's tensor `ref` that tdm_gpt_parallelize's plan gives it; written here from
 * the plan, not from the library's slicing. */
static float part_diff(const char *name, tdm_tensor *p, tdm_tensor *ref, int n, int r) {
    /* (a vocabulary-parallel wte's rows are split as c_fc's) */
    int64_t rows = ref->shape[0], cols = ref->ndim > 1 ? ref->shape[1] : 1;
    float *a = malloc(sizeof(float) * (size_t)tdm_numel(p)),
          *b = malloc(sizeof(float) * (size_t)(rows * cols));
    tdm_to_host(p, a, sizeof(float) * (size_t)tdm_numel(p));
    tdm_to_host(ref, b, sizeof(float) * (size_t)(rows * cols));
    bool qkv = strstr(name, "attn.c_attn."), fc = strstr(name, "mlp.c_fc.");
    fc = fc || (tdm_numel(p) < rows * cols && !strcmp(name, "transformer.wte.weight"));
    bool proj = strstr(name, "c_proj.weight");
    int blocks = qkv ? 3 : 1;
    int64_t pr = qkv || fc ? rows / n : rows, pc = proj ? cols / n : cols, bk = rows / blocks;
    float d = tdm_numel(p) == pr * pc ? 0 : INFINITY;
    for (int64_t i = 0; i < pr && d < INFINITY; i++) {
        /* row i of the part: block i / (bk / n), its (i % (bk / n))-th row of rank r's share */
        int64_t src = qkv || fc ? (i / (bk / n)) * bk + r * (bk / n) + i % (bk / n) : i;
        for (int64_t j = 0; j < pc; j++)
            d = fmaxf(d, fabsf(a[i * pc + j] - b[src * cols + (proj ? r * pc : 0) + j]));
    }
    free(a), free(b);
    return d;
}

static int gpt_rank(tdm_rank_ctx *ctx, void *arg) {
    gpt_shared *sh = arg;
    int r = ctx->rank;
    tdm_rng rng = tdm_rng_make(5);
    tdm_module *m = tdm_gpt_new(&GCFG, tdm_cpu(0), &rng);
    float loss[G_STEPS];
    tdm_gpt_tp_plan plan = {sh->seq, sh->vocab};
    int rc = m ? tdm_gpt_parallelize(m, ctx->group, &plan) : tdm_last_status();
    if (!rc) rc = train_gpt(m, loss);
    if (!rc) {
        tdm_paramset *ps = tdm_module_parameters(m), *ref = tdm_module_parameters(sh->ref);
        for (int i = 0; i < ps->n; i++) { /* the same names, in the same order */
            bool same = i < ref->n && !strcmp(ps->names[i], ref->names[i]);
            sh->dw[r] = fmaxf(sh->dw[r], same ? part_diff(ps->names[i], ps->params[i],
                                                          ref->params[i], ctx->size, r)
                                              : INFINITY);
        }
        sh->dloss[r] = max_diff(loss, sh->ref_loss, G_STEPS);
    }
    /* the parts made whole again, in a whole GPT of the same config: the reference's weights */
    tdm_rng own = tdm_rng_make(99); /* not the shared default generator: ranks run at once */
    tdm_module *whole = rc ? NULL : tdm_gpt_new(&GCFG, tdm_cpu(0), &own);
    if (whole) rc = tdm_tp_gather_whole(m, whole);
    if (!rc && whole) {
        tdm_paramset *pw = tdm_module_parameters(whole), *ref = tdm_module_parameters(sh->ref);
        float *a = malloc(sizeof(float) * (size_t)pw->total),
              *b = malloc(sizeof(float) * (size_t)ref->total);
        tdm_to_host(pw->flat, a, sizeof(float) * (size_t)pw->total);
        tdm_to_host(ref->flat, b, sizeof(float) * (size_t)ref->total);
        sh->dwhole[r] = pw->total == ref->total ? max_diff(a, b, (int)pw->total) : INFINITY;
        free(a), free(b);
    }
    tdm_module_free(whole);
    if (rc) snprintf(sh->msg[r], sizeof sh->msg[r], "%s", tdm_last_error());
    float one;
    sh->llmc_refused[r] = m && tdm_gpt_export_llmc(m, false, &one, 1) != TDM_OK &&
                          strstr(tdm_last_error(), "a tensor-parallel GPT holds parts");
    tdm_module_free(m);
    return rc;
}

/* Bound: the heads are split whole, so attention computes the same sums, and only the two
 * row-parallel projections of each block add partial products in another order: MLP_BOUND,
 * except for the key bias (in c_attn.bias). Its true gradient is 0 (adding a constant to every
 * key shifts all of a query's scores alike, which softmax ignores), so what backward gives it
 * is rounding, ~1e-10, different in every order of summation, and AdamW scales it by
 * lr / eps = 1e5 into updates of ~1e-5 a step: 3 steps, 3e-5 (measured: up to 5.7e-6). A
 * missing or doubled reduction moves weights by ~lr, 1e-3. */
#define GPT_BOUND 3e-5f
static void test_gpt(void) {
    gpt_shared sh = {0};
    tdm_rng rng = tdm_rng_make(5);
    sh.ref = tdm_gpt_new(&GCFG, tdm_cpu(0), &rng);
    CHECK(sh.ref && train_gpt(sh.ref, sh.ref_loss) == 0, "one device: %s", tdm_last_error());
    tdm_device devs[MAX_RANKS] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
    /* tp 2 and 4; with sequence parallelism; with the vocabulary split; both */
    for (int k = 0; sh.ref && k < 7; k++) {
        int n = k % 2 ? 4 : 2;
        sh.seq = k == 2 || k == 3 || k == 6, sh.vocab = k >= 4;
        memset(sh.dw, 0, sizeof sh.dw);
        for (int r = 0; r < MAX_RANKS; r++) sh.dwhole[r] = INFINITY;
        int rc = tdm_spawn(n, devs, gpt_rank, &sh);
        CHECK(rc == TDM_OK, "GPT over %d ranks: %s", n, tdm_last_error());
        for (int r = 0; !rc && r < n; r++) {
            CHECK(sh.llmc_refused[r], "a split GPT, rank %d: written in llm.c's layout", r);
            CHECK(sh.dwhole[r] <= GPT_BOUND,
                  "GPT over %d ranks, rank %d: the parts made whole "
                  "differ from one device's by %g",
                  n, r, sh.dwhole[r]);
            CHECK(sh.dw[r] <= GPT_BOUND && sh.dloss[r] <= MLP_BOUND,
                  "GPT over %d ranks%s%s, rank %d: weights off by %g, losses by %g", n,
                  sh.seq ? " (sequence-parallel)" : "", sh.vocab ? " (vocabulary-parallel)" : "", r,
                  sh.dw[r], sh.dloss[r]);
            printf("GPT (2 layers, 4 heads, 32 channels), tp %d%s%s, rank %d: weights within "
                   "%.3g, losses within %.3g of one device after %d AdamW steps\n",
                   n, sh.seq ? ", sequence-parallel" : "", sh.vocab ? ", vocabulary-parallel" : "",
                   r, sh.dw[r], sh.dloss[r], G_STEPS);
        }
    }
    tdm_module_free(sh.ref);
    /* refused: heads that do not split, a GPT already listed or split */
    tdm_module *m = tdm_gpt_new(&GCFG, tdm_cpu(0), NULL);
    CHECK_ERROR(tdm_gpt_parallelize(m, NULL, NULL) != TDM_OK, "gpt_parallelize: NULL group");
    tdm_module *relu = tdm_relu_new();
    CHECK_ERROR(tdm_gpt_parallelize(relu, NULL, NULL) != TDM_OK, "not a GPT");
    tdm_module_free(relu);
    tdm_module_free(m);
}

/* ---- the strategy: tdm_strategy_tensor_parallel against one device ------------------------ */

#define S_B     4 /* global batch: 2 rows a data-parallel row at dp 2 */
#define S_STEPS 3 /* the second accumulates 2 micro-batches */
#define S_CLIP  0.5f

static int split_gpt(tdm_module *m, tdm_group *tp, void *arg) {
    return tdm_gpt_parallelize(m, tp, arg);
}

static tdm_optim *gpt_adamw(tdm_paramset *ps, void *arg) {
    (void)arg;
    tdm_adam_opts o = tdm_adamw_defaults();
    o.lr = 1e-3f;
    return tdm_gpt_adamw_new(ps, &o);
}

static tdm_tensor *whole_gpt(tdm_module *m, tdm_tensor *out, void *arg) {
    (void)arg;
    return tdm_gpt_whole_logits(m, out);
}

/* The mean loss of the rows, divided by the micro-batches (*(int *)arg); from the rank's
 * columns of the logits under vocabulary parallelism. */
static tdm_tensor *gpt_loss_fn(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0;
    tdm_module *part = tdm_strategy_loss_module();
    tdm_tensor *l = part ? tdm_gpt_loss_of(part, out, target) : tdm_gpt_loss(out, target);
    int k = *(int *)arg;
    return k > 1 && l ? tdm_mul_scalar(l, 1.0f / (float)k) : l;
}

/* S_STEPS steps of st on tokens from a fixed sequence (the same for every strategy), each
 * step's loss into loss[]. */
static int strategy_steps(tdm_strategy *st, int first, int steps, float *loss) {
    uint32_t lcg = 29;
    int rc = TDM_OK;
    for (int s = 0; s < first + steps && !rc; s++) {
        int micro = s == 1 ? 2 : 1;
        float sum = 0;
        for (int k = 0; k < micro && !rc; k++) {
            int64_t tok[2][S_B * G_T];
            for (int j = 0; j < 2; j++)
                for (int i = 0; i < S_B * G_T; i++)
                    lcg = lcg * 1664525u + 1013904223u, tok[j][i] = (lcg >> 8) % GCFG.vocab;
            if (s < first) continue; /* the same draws as a run from step 0 */
            tdm_scope_begin();
            tdm_tensor *x = i64(TDM_SHAPE(S_B, G_T), tok[0]), *y = i64(TDM_SHAPE(S_B, G_T), tok[1]);
            float l = NAN;
            rc = k + 1 < micro ? tdm_strategy_accumulate(st, x, y, gpt_loss_fn, &micro, &l)
                               : tdm_strategy_step(st, x, y, gpt_loss_fn, &micro, &l);
            sum += l;
            tdm_scope_end();
        }
        if (s >= first) loss[s - first] = sum;
    }
    return rc;
}

static float flat_diff(tdm_tensor *a, tdm_tensor *b) {
    int64_t n = tdm_numel(a);
    if (n != tdm_numel(b)) return INFINITY;
    float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n);
    tdm_to_host(a, x, sizeof(float) * (size_t)n);
    tdm_to_host(b, y, sizeof(float) * (size_t)n);
    float d = max_diff(x, y, (int)n);
    free(x), free(y);
    return d;
}

/* The largest difference between the state buffers of two optimizers over the same layout. */
static float state_diff(tdm_optim *a, tdm_optim *b) {
    const char *na[4], *nb[4];
    tdm_tensor *ta[4], *tb[4];
    int n = tdm_optim_state(a, na, ta, 4), m = tdm_optim_state(b, nb, tb, 4);
    float d = n == m && n > 0 && tdm_optim_steps(a) == tdm_optim_steps(b) ? 0 : INFINITY;
    for (int k = 0; k < n && k < m; k++) d = fmaxf(d, flat_diff(ta[k], tb[k]));
    return d;
}

/* n devices at tp 2, clipping at S_CLIP; sharded over dp when zero is 1 (the optimizer
 * state, ZeRO stage 1) or 2 (the averaged gradient too). */
static tdm_device_type strategy_on = TDM_CPU; /* --gpu: the strategy's devices are GPUs */

static tdm_strategy *tp_strategy(tdm_module *m, int n, int zero, tdm_gpt_tp_plan *plan) {
    tdm_device devs[MAX_RANKS];
    for (int i = 0; i < MAX_RANKS; i++) devs[i] = (tdm_device){strategy_on, i};
    tdm_tp_strategy_opts o = {
        .tp = 2, .parallelize = split_gpt, .whole_output = whole_gpt, .arg = plan};
    tdm_strategy *st = tdm_strategy_tensor_parallel(m, devs, n, &o, gpt_adamw, NULL);
    if (st && (tdm_strategy_set_clip_grad_norm(st, S_CLIP) ||
               (zero && tdm_strategy_set_shard(st, (tdm_shard_kind)zero, tdm_model_units)))) {
        tdm_strategy_free(st);
        return NULL;
    }
    return st;
}

/* dp 1 x tp 2 and dp 2 x tp 2 (sequence-parallel) against one device: every step's loss, the
 * weights made whole and the optimizer state gathered; then that state handed to another
 * layout (dp 2 x tp 2 -> tp 2, tp 2 -> dp 2 x tp 2: a resume) and one more step on both.
 * Cases ks[0 .. nk) of the five below. */
static void test_strategy(const int *ks, int nk) {
    /* one device: after S_STEPS (ref), and one step more (later) */
    tdm_rng rng = tdm_rng_make(5), rng2 = tdm_rng_make(5);
    tdm_module *ref = tdm_gpt_new(&GCFG, tdm_cpu(0), &rng);
    tdm_module *later = tdm_gpt_new(&GCFG, tdm_cpu(0), &rng2);
    tdm_strategy *one = ref ? tdm_strategy_one_device(ref, gpt_adamw, NULL) : NULL;
    tdm_strategy *one2 = later ? tdm_strategy_one_device(later, gpt_adamw, NULL) : NULL;
    float ref_loss[S_STEPS] = {0}, more[S_STEPS + 1] = {0}, last_ref;
    int rc = one && one2 ? tdm_strategy_set_clip_grad_norm(one, S_CLIP) : tdm_last_status();
    if (!rc) rc = tdm_strategy_set_clip_grad_norm(one2, S_CLIP);
    if (!rc) rc = strategy_steps(one, 0, S_STEPS, ref_loss);
    if (!rc) rc = strategy_steps(one2, 0, S_STEPS + 1, more);
    last_ref = more[S_STEPS];
    CHECK(rc == TDM_OK, "one device: %s", tdm_last_error());
    /* dp 1 x tp 2 (resumed on dp 2 x tp 2 with ZeRO stage 1), dp 2 x tp 2 (resumed on tp 2),
     * dp 2 x tp 2 with ZeRO stages 1, 2 and 3 (FSDP with TP; each resumed on tp 2) */
    for (int c = 0; !rc && c < nk; c++) {
        int k = ks[c], n = k ? 4 : 2, zero = k >= 2 ? k - 1 : 0;
        tdm_gpt_tp_plan plan = {true, k == 1}; /* dp 2 x tp 2 with the vocabulary split too */
        tdm_rng r2 = tdm_rng_make(5);
        tdm_module *m = tdm_gpt_new(&GCFG, tdm_cpu(0), &r2);
        tdm_strategy *st = m ? tp_strategy(m, n, zero, &plan) : NULL;
        /* rank 0's parts are over half the model (the layer norms and embeddings are whole);
         * their state sharded over dp 2 is under half */
        int64_t lo = 0, hi = 0, half = m ? tdm_module_parameters(m)->total / 2 : 0;
        if (st) tdm_optim_shard_range(tdm_strategy_optim(st, 0), &lo, &hi);
        CHECK(st && (zero ? hi - lo < half : hi - lo > half) &&
                  tdm_strategy_shard(st) == (tdm_shard_kind)zero,
              "dp %d x tp 2: rank 0 holds the state of %lld elements (the model has %lld)", n / 2,
              (long long)(hi - lo), (long long)(2 * half));
        float loss[S_STEPS];
        int got = st ? strategy_steps(st, 0, S_STEPS, loss) : tdm_last_status();
        /* the caller's model gave its values back at the first step: nothing to push yet */
        CHECK(got || (tdm_strategy_push_whole(st, NULL) == TDM_ERR_STATE &&
                      strstr(tdm_last_error(), "holds no weights since the last step")),
              "push_whole after a step: %s", tdm_last_error());
        tdm_optim *whole = got ? NULL : tdm_strategy_optim_gather(st);
        CHECK(whole != NULL, "dp %d x tp 2: %s", n / 2, tdm_last_error());
        char how[128];
        tdm_strategy_describe(st, S_B, how, sizeof how);
        CHECK(strstr(how, n == 4 ? "mesh dp 2 x tp 2" : "mesh dp 1 x tp 2"), "describe: %s", how);
        float dl = whole ? max_diff(loss, ref_loss, S_STEPS) : INFINITY;
        float dw = whole
                       ? flat_diff(tdm_module_parameters(m)->flat, tdm_module_parameters(ref)->flat)
                       : INFINITY;
        float ds = whole ? state_diff(whole, tdm_strategy_optim(one, 0)) : INFINITY;
        CHECK(dl <= MLP_BOUND * 10 && dw <= GPT_BOUND && ds <= GPT_BOUND,
              "dp %d x tp 2 (ZeRO %d) against one device: losses off by %g, weights %g, state %g",
              n / 2, zero, dl, dw, ds);
        printf("strategy dp %d x tp 2%s (sequence-parallel%s, clip %g, a step of 2 "
               "micro-batches): losses within %.3g, weights %.3g, optimizer state %.3g of one "
               "device after %d steps\n",
               n / 2, zero ? (const char *[]){"", " ZeRO-1", " ZeRO-2", " ZeRO-3"}[zero] : "",
               k == 1 ? ", vocabulary-parallel" : "", (double)S_CLIP, dl, dw, ds, S_STEPS);
        /* the evaluation forward: whole logits [B, T, V] joined from the rows (the vocabulary's
         * columns gathered first at k == 1), one device's within float rounding */
        float dout = INFINITY;
        if (whole) {
            int64_t tok[S_B * G_T];
            for (int i = 0; i < S_B * G_T; i++) tok[i] = (i * 7) % GCFG.vocab;
            bool grad = tdm_set_grad_enabled(false);
            tdm_scope_begin();
            tdm_tensor *x = i64(TDM_SHAPE(S_B, G_T), tok), *out = NULL;
            tdm_tensor *want = tdm_module_forward(ref, x);
            if (tdm_strategy_forward(st, x, &out) == TDM_OK && want &&
                tdm_numel(out) == (int64_t)S_B * G_T * GCFG.vocab)
                dout = flat_diff(out, want);
            tdm_scope_end();
            tdm_set_grad_enabled(grad);
        }
        CHECK(dout <= 1e-4f, "dp %d x tp 2: the evaluation forward's logits off by %g (%s)", n / 2,
              dout, tdm_last_error());
        /* the whole model and state handed to the other layout, on a model of other weights */
        tdm_rng r3 = tdm_rng_make(77);
        tdm_module *m2 = whole ? tdm_gpt_new(&GCFG, tdm_cpu(0), &r3) : NULL;
        tdm_strategy *st2 = m2 ? tp_strategy(m2, 6 - n, k == 0, &plan) : NULL;
        tdm_optim *o2 = st2 ? gpt_adamw(tdm_module_parameters(m2), NULL) : NULL;
        const char *names[4];
        tdm_tensor *state[4];
        int ns = o2 ? tdm_optim_state(whole, names, state, 4) : 0;
        got = o2 ? tdm_copy_(tdm_module_parameters(m2)->flat, tdm_module_parameters(m)->flat) : -1;
        for (int i = 0; !got && i < ns; i++) got = tdm_optim_state_load(o2, names[i], state[i]);
        if (!got) got = tdm_optim_set_steps(o2, tdm_optim_steps(whole));
        if (!got) got = tdm_strategy_push_whole(st2, o2);
        float next[1];
        if (!got) got = strategy_steps(st2, S_STEPS, 1, next);
        if (!got) got = tdm_strategy_sync_model(st2);
        float dn =
            got ? INFINITY
                : flat_diff(tdm_module_parameters(m2)->flat, tdm_module_parameters(later)->flat);
        CHECK(dn <= GPT_BOUND * 2 && fabsf(next[0] - last_ref) <= MLP_BOUND * 10,
              "resumed on dp %d x tp 2: %s; weights off by %g after one more step", (6 - n) / 2,
              got ? tdm_last_error() : "ran", dn);
        printf("resumed from dp %d x tp 2%s on dp %d x tp 2%s: weights within %.3g of one "
               "device one step later\n",
               n / 2, zero ? (const char *[]){"", " ZeRO-1", " ZeRO-2", " ZeRO-3"}[zero] : "",
               (6 - n) / 2, k == 0 ? " ZeRO-1" : "", dn);
        tdm_optim_free(o2);
        tdm_strategy_free(st2);
        tdm_module_free(m2);
        tdm_optim_free(whole);
        tdm_strategy_free(st);
        tdm_module_free(m);
    }
    tdm_strategy_free(one), tdm_strategy_free(one2);
    tdm_module_free(ref), tdm_module_free(later);
    /* refused: devices that are not a multiple of tp, no plan */
    tdm_module *m = tdm_gpt_new(&GCFG, tdm_cpu(0), NULL);
    tdm_device devs[3] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2)};
    tdm_tp_strategy_opts o = {.tp = 2, .parallelize = split_gpt};
    CHECK(!tdm_strategy_tensor_parallel(m, devs, 3, &o, gpt_adamw, NULL) &&
              strstr(tdm_last_error(), "3 devices are not a multiple of tp 2"),
          "3 devices at tp 2: %s", tdm_last_error());
    o.parallelize = NULL;
    CHECK_ERROR(!tdm_strategy_tensor_parallel(m, devs, 2, &o, gpt_adamw, NULL), "parallelize");
    tdm_module_free(m);
}

/* A step's loss that also flips a bit of the first weight of the ranks of dp row 1 (their parts
 * of wte), once: the rows' replicas then differ. Bit 16 of the mantissa, not the lowest: the
 * step's update follows the flip, and a weight much smaller than its update can round a
 * 1-ulp difference away (it did on an AVX2 CPU under TSan). */
static tdm_tensor *flipping_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    tdm_module *part = tdm_strategy_loss_module();
    if (part && row0 > 0) {
        uint32_t *w = tdm_data_ptr(tdm_module_parameters(part)->params[0]);
        w[0] ^= 1u << 16;
    }
    return gpt_loss_fn(out, target, row0, arg);
}

/* A step and tdm_strategy_check_replicas (its status returned: the rows equal), then a step
 * whose loss is flip and the check again (*checked: its status, or the step's failure). */
static int check_flipped(tdm_strategy *st, tdm_group *procs, tdm_loss_fn flip, int *checked) {
    float l[1];
    int rc = strategy_steps(st, 0, 1, l);
    if (!rc) rc = tdm_strategy_check_replicas(st, procs);
    int64_t tok[S_B * G_T];
    for (int i = 0; i < S_B * G_T; i++) tok[i] = (i * 5) % GCFG.vocab;
    int one = 1;
    tdm_scope_begin();
    tdm_tensor *x = i64(TDM_SHAPE(S_B, G_T), tok);
    int stepped = rc ? rc : tdm_strategy_step(st, x, x, flip, &one, l);
    tdm_scope_end();
    *checked = stepped ? stepped : tdm_strategy_check_replicas(st, procs);
    return rc;
}

/* tdm_strategy_check_replicas over a dp 2 x tp 2 mesh: equal rows pass (also under ZeRO stage
 * 3, the parts gathered for it), a flipped bit in row 1 is named with the rank's place. */
static void test_check_replicas(void) {
    for (int zero = 0; zero <= 3; zero += 3) {
        tdm_gpt_tp_plan plan = {true, false};
        tdm_rng rng = tdm_rng_make(5);
        tdm_module *m = tdm_gpt_new(&GCFG, tdm_cpu(0), &rng);
        tdm_strategy *st = m ? tp_strategy(m, 4, zero, &plan) : NULL;
        int checked = 0,
            rc = st ? check_flipped(st, NULL, flipping_loss, &checked) : tdm_last_status();
        CHECK(rc == TDM_OK, "ZeRO %d, equal rows: %s", zero, tdm_last_error());
        /* (under stage 3 the flip lands in a unit's gathered copy, which the update replaces:
         * only the equal case is checked there) */
        CHECK(zero == 3 ||
                  (!rc && checked == TDM_ERR_STATE &&
                   strstr(tdm_last_error(), "parameter \"transformer.wte.weight\" [64, 32] of "
                                            "rank 2 (cpu:2, dp 1, tp 0) is not dp row 0's")),
              "ZeRO %d, a flipped bit: step %d, check %d: %s", zero, rc, checked, tdm_last_error());
        tdm_strategy_free(st);
        tdm_module_free(m);
    }
}

/* Across processes: the loss of the process whose rank is flip_process flips a bit of its
 * part's first parameter. */
static int flip_process = -1, my_process = -1;

static tdm_tensor *flip_on_process(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    tdm_module *part = tdm_strategy_loss_module();
    if (part && my_process == flip_process) {
        uint32_t *w = tdm_data_ptr(tdm_module_parameters(part)->params[0]);
        w[0] ^= 1u << 16;
    }
    return gpt_loss_fn(out, target, row0, arg);
}

/* tdm_strategy_check_replicas over dp 2 x tp 2 across 4 processes: equal rows pass; a bit
 * flipped on process 2 is named, with its place, by every process (each then stops alike). */
static void check_replicas_across(tdm_group *world) {
    my_process = tdm_group_rank(world), flip_process = 2;
    tdm_gpt_tp_plan plan = {true, false};
    tdm_rng rng = tdm_rng_make(5);
    tdm_module *m = tdm_gpt_new(&GCFG, tdm_cpu(0), &rng);
    tdm_tp_strategy_opts o = {
        .tp = 2, .procs = world, .parallelize = split_gpt, .whole_output = whole_gpt, .arg = &plan};
    tdm_device dev = tdm_cpu(0);
    tdm_strategy *st = m ? tdm_strategy_tensor_parallel(m, &dev, 1, &o, gpt_adamw, NULL) : NULL;
    int checked = 0,
        rc = st ? check_flipped(st, world, flip_on_process, &checked) : tdm_last_status();
    CHECK(rc == TDM_OK, "process %d, equal rows: %s", my_process, tdm_last_error());
    CHECK(!rc && checked == TDM_ERR_STATE &&
              strstr(tdm_last_error(), "parameter \"transformer.wte.weight\" [64, 32] of rank 2 "
                                       "(process 2, cpu:0, dp 1, tp 0) is not dp row 0's"),
          "process %d, a bit flipped on process 2: step %d, check %d: %s", my_process, rc, checked,
          tdm_last_error());
    printf("check_replicas across processes, process %d: %s\n", my_process,
           checked ? "named rank 2" : "missed it");
    tdm_strategy_free(st);
    tdm_module_free(m);
}

/* ---- the mesh ----------------------------------------------------------------------------- */

/* 4 ranks as dp 2 x tp 2: coordinates row-major, each group summing its own ranks only. */
static int mesh_rank(tdm_rank_ctx *ctx, void *arg) {
    int *wrong = arg, r = ctx->rank;
    tdm_mesh *m = tdm_mesh_new(ctx->group, 2, (int[]){2, 2}, (const char *[]){"dp", "tp"});
    if (!m) return tdm_last_status();
    tdm_group *tp = tdm_mesh_group(m, "tp"), *dp = tdm_mesh_group(m, "dp");
    wrong[r] += tdm_mesh_coord(m, "dp") != r / 2 || tdm_mesh_coord(m, "tp") != r % 2;
    wrong[r] += tdm_mesh_size(m, "dp") != 2 || tdm_group_size(tp) != 2;
    wrong[r] += tdm_group_rank(tp) != r % 2 || tdm_group_rank(dp) != r / 2;
    float sums[2];
    for (int k = 0; k < 2; k++) {
        tdm_tensor *t = tdm_full(TDM_SHAPE(1), (float)r, TDM_F32, tdm_cpu(0));
        wrong[r] += tdm_work_wait(tdm_all_reduce(k ? dp : tp, t, TDM_SUM)) != TDM_OK;
        sums[k] = tdm_item(t);
        tdm_tensor_free(t);
    }
    /* tp pairs {0, 1}, {2, 3}; dp pairs {0, 2}, {1, 3} */
    wrong[r] += sums[0] != (float)(4 * (r / 2) + 1) || sums[1] != (float)(2 * (r % 2) + 2);
    wrong[r] += tdm_mesh_group(m, "pp") != NULL || !strstr(tdm_last_error(), "(it has dp, tp)");
    tdm_mesh_free(m);
    wrong[r] += tdm_mesh_new(ctx->group, 2, (int[]){2, 3}, (const char *[]){"dp", "tp"}) != NULL ||
                !strstr(tdm_last_error(), "the dimensions make 6 ranks, the group has 4");
    return 0;
}

static void test_mesh(void) {
    int wrong[4] = {0};
    tdm_device devs[4] = {tdm_cpu(0), tdm_cpu(1), tdm_cpu(2), tdm_cpu(3)};
    CHECK(tdm_spawn(4, devs, mesh_rank, wrong) == TDM_OK, "%s", tdm_last_error());
    for (int r = 0; r < 4; r++) CHECK(wrong[r] == 0, "mesh, rank %d: %d wrong", r, wrong[r]);
}

/* ---- a rank that fails inside a tensor-parallel layer ------------------------------------- */

/* Rank 1 gives up before its row-parallel layer's reduction (as a rank whose data ran out
 * would); rank 0, waiting in that reduction, fails naming it instead of hanging. */
static int dies_rank(tdm_rank_ctx *ctx, void *arg) {
    char(*msg)[256] = arg;
    tdm_rng rng = tdm_rng_make(3);
    tdm_module *row = tdm_row_linear_new(4, 2, true, true, ctx->group, tdm_cpu(0), &rng);
    int rc = row ? 0 : tdm_last_status();
    tdm_scope_begin();
    if (!rc && ctx->rank == 1) {
        tdm_group_abort(ctx->group, "its data ran out");
        rc = TDM_ERR_STATE;
    } else if (!rc) {
        tdm_tensor *y = tdm_module_forward(row, tdm_ones(TDM_SHAPE(3, 2), TDM_F32, tdm_cpu(0)));
        rc = y ? 0 : tdm_last_status();
    }
    snprintf(msg[ctx->rank], sizeof msg[ctx->rank], "%s", rc ? tdm_last_error() : "no error");
    tdm_scope_end();
    tdm_module_free(row);
    return rc;
}

static void test_rank_dies(void) {
    char msg[2][256] = {"", ""};
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    CHECK(tdm_spawn(2, devs, dies_rank, msg) != TDM_OK, "a rank failed, yet the spawn passed");
    CHECK(strstr(msg[0], "all_reduce on rank 0: rank 1 failed: its data ran out") != NULL,
          "rank 0 in the reduction: %s", msg[0]);
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
    /* a target or token outside the whole vocabulary is named: 2 ranks of 3 logits, [0, 6); of
     * 2 embedding rows, [0, 4) */
    tdm_scope_begin();
    tdm_tensor *l = tdm_zeros(TDM_SHAPE(2, 3), TDM_F32, tdm_cpu(0));
    if (tdm_tp_cross_entropy(ctx->group, l, i64(TDM_SHAPE(2), (int64_t[]){1, 6})) ||
        !strstr(tdm_last_error(), "index 6 of element 1 is outside [0, 6)"))
        wrong[ctx->rank]++;
    if (tdm_tp_embedding(ctx->group, l, i64(TDM_SHAPE(1), (int64_t[]){-1})) ||
        !strstr(tdm_last_error(), "tp_embedding: index -1 of element 0 is outside [0, 4)"))
        wrong[ctx->rank]++;
    tdm_scope_end();
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

/* ---- on GPUs: `test_tensor_parallel --gpu` -------------------------------------------------- */

/* A mesh of GPU ranks hands out NCCL groups (collectives on the GPUs' memory; on the emulation
 * a threads group would seem to work as well, its memory being the host's). */
static int gpu_mesh_rank(tdm_rank_ctx *ctx, void *arg) {
    int *wrong = arg;
    tdm_mesh *m = tdm_mesh_new(ctx->group, 2, (int[]){2, 2}, (const char *[]){"dp", "tp"});
    if (!m) return tdm_last_status();
    for (int d = 0; d < 2; d++)
        wrong[ctx->rank] += strcmp(tdm_mesh_group(m, d ? "tp" : "dp")->ops->name, "nccl") != 0;
    tdm_mesh_free(m);
    return 0;
}

static void test_gpu_mesh(void) {
    int wrong[4] = {0};
    tdm_device devs[4] = {tdm_cuda(0), tdm_cuda(1), tdm_cuda(2), tdm_cuda(3)};
    CHECK(tdm_spawn(4, devs, gpu_mesh_rank, wrong) == TDM_OK, "%s", tdm_last_error());
    for (int r = 0; r < 4; r++) CHECK(wrong[r] == 0, "GPU mesh, rank %d: not NCCL groups", r);
}

/* ---- across processes: `mpirun -np 4 test_tensor_parallel --mpi` --------------------------- */

/* The GPT split over tp (an MPI group; r: this process's rank in the world) trained and compared
 * with gs's one-device reference within the threads' bounds. */
static void gpt_over(tdm_group *tp, int r, gpt_shared *gs) {
    int t = tdm_group_rank(tp), n = tdm_group_size(tp);
    /* this rank's entries only: a process's other device threads run beside it */
    gs->dw[t] = 0, gs->dloss[t] = 0, gs->dwhole[t] = INFINITY;
    tdm_rank_ctx ctx = {.rank = t, .size = n, .device = tdm_cpu(0), .group = tp};
    CHECK(gpt_rank(&ctx, gs) == 0, "GPT tp %d over MPI, rank %d: %s", n, r, gs->msg[t]);
    CHECK(gs->dw[t] <= GPT_BOUND && gs->dloss[t] <= MLP_BOUND && gs->dwhole[t] <= GPT_BOUND,
          "GPT tp %d over MPI, rank %d: weights off by %g, losses by %g, gathered by %g", n, r,
          gs->dw[t], gs->dloss[t], gs->dwhole[t]);
    printf("GPT, tp %d over MPI (sequence- and vocabulary-parallel), rank %d: weights within "
           "%.3g, losses within %.3g of one device\n",
           n, r, gs->dw[t], gs->dloss[t]);
}

/* One device a process, the mesh's groups MPI sub-groups: the mesh's coordinates and sums; the
 * MLP at dp 2 x tp 2 (DDP over dp) and the GPT at tp 2 (each dp row training the whole batch)
 * and tp 4 with the sequence and the vocabulary split, against one device within the threads'
 * bounds. */
static void test_across_processes(tdm_group *world) {
    int r = tdm_group_rank(world), wrong[4] = {0};
    tdm_rank_ctx ctx = {.rank = r, .size = 4, .device = tdm_cpu(0), .group = world};
    CHECK(mesh_rank(&ctx, wrong) == 0 && wrong[r] == 0, "mesh over MPI, rank %d: %d wrong (%s)", r,
          wrong[r], tdm_last_error());
    mlp_shared ms = {.n = 4, .dp_size = 2};
    CHECK(mlp_reference(&ms) == 0, "one device: %s", tdm_last_error());
    CHECK(mlp_rank(&ctx, &ms) == 0, "MLP over MPI, rank %d: %s", r, ms.msg[r]);
    CHECK(ms.dw[r] <= MLP_BOUND && ms.dloss[r] <= MLP_BOUND,
          "MLP dp 2 x tp 2 over MPI, rank %d: weights off by %g, losses by %g", r, ms.dw[r],
          ms.dloss[r]);
    printf("MLP, dp 2 x tp 2 over MPI, rank %d: weights within %.3g, losses within %.3g\n", r,
           ms.dw[r], ms.dloss[r]);
    /* the GPT over each dp row's tp pair */
    gpt_shared gs = {.seq = true, .vocab = true};
    tdm_rng rng = tdm_rng_make(5);
    gs.ref = tdm_gpt_new(&GCFG, tdm_cpu(0), &rng);
    CHECK(gs.ref && train_gpt(gs.ref, gs.ref_loss) == 0, "one device: %s", tdm_last_error());
    tdm_mesh *mesh = tdm_mesh_new(world, 2, (int[]){2, 2}, (const char *[]){"dp", "tp"});
    CHECK(mesh != NULL, "mesh over MPI: %s", tdm_last_error());
    if (mesh) gpt_over(tdm_mesh_group(mesh, "tp"), r, &gs);
    tdm_mesh_free(mesh);
    gpt_over(world, r, &gs); /* and over all four processes: tp 4 */
    tdm_module_free(gs.ref);
    check_replicas_across(world);
}

/* ---- two devices a process: `mpirun -np 2 test_tensor_parallel --mpi` ---------------------- */

typedef struct {
    tdm_group *g; /* this device's group of the two-level world */
    int *wrong;   /* [4], by global rank */
    mlp_shared *ms;
    gpt_shared *gs;
    /* what the thread found, checked by the main thread (CHECK is not thread-safe) */
    char err[256];
    float gpt[2][3]; /* the GPT at tp 2, tp 4: weights, losses, gathered weights off by */
} level_arg;

/* The GPT split over the tp groups of a mesh {dp, tp} over the two-level group: ranks of one
 * process (tp 2 inside each, dp across) or of both (tp 4: each tp group two-level itself). */
static int gpt_over_mesh(level_arg *a, int dp, int tp, float *found) {
    tdm_mesh *mesh = tdm_mesh_new(a->g, 2, (int[]){dp, tp}, (const char *[]){"dp", "tp"});
    if (!mesh) return tdm_last_status();
    tdm_group *g = tdm_mesh_group(mesh, "tp");
    int t = tdm_group_rank(g); /* this rank's entries only: the other device thread runs beside */
    gpt_shared *gs = a->gs;
    gs->dw[t] = 0, gs->dloss[t] = 0, gs->dwhole[t] = INFINITY;
    tdm_rank_ctx ctx = {.rank = t, .size = tp, .device = tdm_cpu(0), .group = g};
    int rc = gpt_rank(&ctx, gs);
    if (rc) snprintf(a->err, sizeof a->err, "GPT tp %d: %s", tp, gs->msg[t]);
    found[0] = gs->dw[t], found[1] = gs->dloss[t], found[2] = gs->dwhole[t];
    tdm_mesh_free(mesh);
    return rc;
}

static void *level_main(void *arg) {
    level_arg *a = arg;
    int r = tdm_group_rank(a->g);
    tdm_rank_ctx ctx = {.rank = r, .size = 4, .device = tdm_cpu(0), .group = a->g};
    /* dp groups across the processes, one per device thread, launched side by side */
    if (mesh_rank(&ctx, a->wrong))
        snprintf(a->err, sizeof a->err, "mesh: %s", tdm_last_error());
    else if (mlp_rank(&ctx, a->ms))
        snprintf(a->err, sizeof a->err, "MLP: %s", a->ms->msg[r]);
    else if (!gpt_over_mesh(a, 2, 2, a->gpt[0]) && !gpt_over_mesh(a, 1, 4, a->gpt[1])) {
    } else if (!a->err[0])
        snprintf(a->err, sizeof a->err, "GPT: %s", tdm_last_error());
    tdm_thread_release();
    return NULL;
}

/* Two CPU devices a process (the two-level group): the mesh's coordinates and sums with its
 * dp groups across the processes (MPI sub-groups driven by both device threads at once), the
 * MLP at dp 2 x tp 2 with DDP over them, and the GPT at tp 2 inside each process and at tp 4
 * across both (a two-level group per tp group), against one device within the threads'
 * bounds. A layout whose groups split unevenly over the processes is refused. */
static void test_two_level(tdm_group *world) {
    enum { L = 2 };
    int p = tdm_group_rank(world), wrong[4] = {0};
    tdm_device devs[L] = {tdm_cpu(0), tdm_cpu(1)};
    tdm_threads_world *tw = tdm_threads_world_new(L, devs);
    tdm_hier_world *hw = tw ? tdm_hier_world_new(tw, L, world) : NULL;
    CHECK(hw, "two-level world: %s", tdm_last_error());
    mlp_shared ms = {.n = 4, .dp_size = 2};
    gpt_shared gs = {.seq = true, .vocab = true};
    tdm_rng rng = tdm_rng_make(5);
    gs.ref = tdm_gpt_new(&GCFG, tdm_cpu(0), &rng);
    CHECK(gs.ref && train_gpt(gs.ref, gs.ref_loss) == 0 && mlp_reference(&ms) == 0,
          "one device: %s", tdm_last_error());
    level_arg a[L];
    pthread_t th[L];
    for (int l = 0; hw && l < L; l++) {
        a[l] = (level_arg){.g = tdm_hier_world_group(hw, l), .wrong = wrong, .ms = &ms, .gs = &gs};
        pthread_create(&th[l], NULL, level_main, &a[l]);
    }
    for (int l = 0; hw && l < L; l++) {
        pthread_join(th[l], NULL);
        int r = p * L + l;
        CHECK(!a[l].err[0] && wrong[r] == 0, "two devices a process, rank %d: %s (%d wrong)", r,
              a[l].err, wrong[r]);
        CHECK(ms.dw[r] <= MLP_BOUND && ms.dloss[r] <= MLP_BOUND,
              "MLP dp 2 x tp 2, two devices a process, rank %d: weights off by %g, losses by %g", r,
              ms.dw[r], ms.dloss[r]);
        for (int k = 0; k < 2; k++)
            CHECK(a[l].gpt[k][0] <= GPT_BOUND && a[l].gpt[k][1] <= MLP_BOUND &&
                      a[l].gpt[k][2] <= GPT_BOUND,
                  "GPT tp %d, two devices a process, rank %d: weights off by %g, losses by %g, "
                  "gathered by %g",
                  2 << k, r, a[l].gpt[k][0], a[l].gpt[k][1], a[l].gpt[k][2]);
        printf("two devices a process, rank %d: MLP dp 2 x tp 2 weights within %.3g; GPT tp 2 "
               "within %.3g, tp 4 within %.3g of one device\n",
               r, ms.dw[r], a[l].gpt[0][0], a[l].gpt[1][0]);
    }
    tdm_hier_world_free(hw);
    tdm_threads_world_free(tw);
    tdm_module_free(gs.ref);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--gpu")) { /* the emulation's run, scripts/gpu-check */
        int gpus = tdm_device_count(TDM_CUDA);
        if (gpus < 4) {
            printf("test_tensor_parallel --gpu: skipped, %d GPUs (it needs 4)\n", gpus);
            return 77;
        }
        /* over the mesh's NCCL groups: dp 2 x tp 2 with the vocabulary split (resumed on tp 2
         * with ZeRO stage 1), and with ZeRO stage 3 (resumed on tp 2) */
        test_gpu_mesh();
        strategy_on = TDM_CUDA;
        test_strategy((const int[]){1, 4}, 2);
        return check_summary();
    }
    if (argc > 1 && !strcmp(argv[1], "--mpi")) {
        tdm_group *world = tdm_mpi_init(&argc, &argv);
        int np = world ? tdm_group_size(world) : 0;
        CHECK(np == 2 || np == 4,
              "--mpi runs under mpirun -np 4 (one device a process) or 2 "
              "(two): %s",
              world ? "another size" : tdm_last_error());
        if (np == 4) test_across_processes(world);
        if (np == 2) test_two_level(world);
        if (world) tdm_mpi_finalize();
        return check_summary();
    }
    test_bad_arguments();
    test_mesh();
    test_rank_dies();
    for (int n = 2; n <= MAX_RANKS; n++)
        test_ops(n), test_seq_ops(n), test_vocab(n, TDM_F32), test_vocab(n, TDM_BF16);
    for (int gathered = 0; gathered < 2; gathered++) {
        test_mlp(2, gathered, 1);
        test_mlp(4, gathered, 1);
    }
    test_mlp(4, false, 2); /* dp 2 x tp 2: DDP over the mesh's dp groups */
    test_gpt();
    test_strategy((const int[]){0, 1, 2, 3, 4}, 5);
    test_check_replicas();
    return check_summary();
}
