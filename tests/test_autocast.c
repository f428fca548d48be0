/* Autocast (include/tandem/autocast.h) and the ops in bf16 and f16.
 *
 * Against PyTorch (tests/fixtures/gen_autocast.py, torch.autocast("cpu", bfloat16)): three
 * chains replayed op by op with the same fp32 inputs and weights; every intermediate's dtype
 * equal exactly, values and fp32 gradients within the bounds below. Then the cast cache
 * (counted with tdm_autocast_cast_count and on the tape), nesting, the disabled region, the
 * per-thread state, the dtypes ops give outside a region, backward in bf16 against the fp32
 * twin on the same (bf16-rounded) values, and the ops that read low-precision inputs as they are
 * (cross-entropy's logits, the residual add folded into a layer norm) against the casts' bits.
 *
 * Bounds. bf16 keeps 8 significant bits: one rounding is at most 2^-9 of the value, one ulp
 * 2^-8 of it. Tandem and PyTorch compute each op in fp32 inside and round its output once,
 * but PyTorch rounds a Linear's product before adding the bias on some paths
 * (docs/MIXED_PRECISION.md, "Where Tandem will differ" 1) and its CPU flash attention rounds
 * the probabilities to bf16 before the second product, so an output may differ by an ulp or
 * two, and a difference in one op's output carries on through the ops after it. Forward
 * values are held within 4 ulps of the tensor's largest magnitude (2^-6 of max |ref|) plus
 * 2^-7 of the element; gradients, which add up such products once more, within 2^-5 of the
 * largest magnitude of the gradient. A mix-up of dtypes (an op run in fp32 where PyTorch ran
 * bf16, or the reverse) shows first in the dtypes, which must match exactly.
 */
#include <pthread.h>

#include "autograd/ops.h"
#include "check.h"
#include "fixtures/autocast_fixtures.h"

#define CPU tdm_cpu(0)

static const double FWD_MAX = 1.0 / 64, FWD_REL = 1.0 / 128, GRAD_MAX = 1.0 / 32;

/* The device the chains run on: cpu:0, then cuda:0 where there is one. */
static tdm_device DEV = {TDM_CPU, 0};

/* t (a caller-owned CPU tensor) moved to DEV. */
static tdm_tensor *on_dev(tdm_tensor *t) {
    if (!t || DEV.type == TDM_CPU) return t;
    tdm_tensor *d = tdm_to_device(t, DEV);
    tdm_tensor_free(t);
    return d;
}

/* A caller-owned f32 leaf on DEV that requires a gradient. */
static tdm_tensor *leaf(tdm_shape s, const float *v) {
    tdm_tensor *t = on_dev(f32(s, v));
    tdm_requires_grad_(t, true);
    return t;
}

static float max_abs(const float *v, int n) {
    float m = 0;
    for (int i = 0; i < n; i++) m = fabsf(v[i]) > m ? fabsf(v[i]) : m;
    return m;
}

/* t (any float dtype) against ref within max_k of max |ref| plus rel of each element. */
static void check_close(const tdm_tensor *t, const float *ref, int n, double max_k, double rel,
                        const char *what) {
    CHECK(t && tdm_numel(t) == n, "%s: %lld elements, expected %d", what,
          t ? (long long)tdm_numel(t) : -1LL, n);
    if (!t || tdm_numel(t) != n) return;
    tdm_tensor *w = tdm_cast(t, TDM_F32);
    check_tensor_close(w, ref, max_k * max_abs(ref, n), rel, what);
    if (!tdm_book(w)->owner) tdm_tensor_free(w);
}

/* The intermediate `name` of a chain: its dtype exactly, its values within the bound. */
static void check_value(const ac_value *vals, int nvals, const char *name, const tdm_tensor *t) {
    for (int i = 0; i < nvals; i++) {
        if (strcmp(vals[i].name, name)) continue;
        CHECK(t && (int)t->dtype == vals[i].dtype, "%s: dtype %s, PyTorch's %s", name,
              t ? tdm_dtype_name(t->dtype) : "(null)", tdm_dtype_name((tdm_dtype)vals[i].dtype));
        check_close(t, vals[i].v, vals[i].n, FWD_MAX, FWD_REL, name);
        return;
    }
    CHECK(0, "no fixture value %s", name);
}
#define VALUE(chain, name, t)                                                                      \
    check_value(chain##_values, (int)(sizeof chain##_values / sizeof *chain##_values), name, t)

/* A leaf's .grad: f32 (parameters' gradients stay f32) and PyTorch's values. */
static void check_grad(const tdm_tensor *p, const float *ref, int n, const char *what) {
    CHECK(p->grad && p->grad->dtype == TDM_F32, "%s: .grad %s, expected f32", what,
          p->grad ? tdm_dtype_name(p->grad->dtype) : "missing");
    if (p->grad) check_close(p->grad, ref, n, GRAD_MAX, 0, what);
}

static void free_all(tdm_tensor **ts, int n) {
    for (int i = 0; i < n; i++) tdm_tensor_free(ts[i]);
}

static void test_mlp_chain(void) {
    tdm_tensor *x = leaf(TDM_SHAPE(6, 8), mlp_x), *w1 = leaf(TDM_SHAPE(16, 8), mlp_fc1_weight),
               *b1 = leaf(TDM_SHAPE(16), mlp_fc1_bias),
               *w2 = leaf(TDM_SHAPE(8, 16), mlp_fc2_weight), *b2 = leaf(TDM_SHAPE(8), mlp_fc2_bias),
               *lw = leaf(TDM_SHAPE(8), mlp_ln_weight), *lb = leaf(TDM_SHAPE(8), mlp_ln_bias),
               *w3 = leaf(TDM_SHAPE(5, 8), mlp_head_weight),
               *b3 = leaf(TDM_SHAPE(5), mlp_head_bias), *tg = on_dev(i64(TDM_SHAPE(6), mlp_target));
    tdm_scope_begin();
    CHECK(tdm_autocast_begin(TDM_BF16) == TDM_OK, "begin: %s", tdm_last_error());
    tdm_tensor *h1 = tdm_linear(x, w1, b1), *g = tdm_gelu(h1, false), *h2 = tdm_linear(g, w2, b2);
    tdm_tensor *r = tdm_add(h2, x), *n = tdm_layer_norm(r, 1, lw, lb, 1e-5f);
    tdm_tensor *logits = tdm_linear(n, w3, b3), *loss = tdm_cross_entropy(logits, tg, NULL);
    CHECK(tdm_autocast_end() == TDM_OK, "end: %s", tdm_last_error());
    VALUE(mlp, "h1", h1);
    VALUE(mlp, "gelu", g);
    VALUE(mlp, "h2", h2);
    VALUE(mlp, "residual", r);
    VALUE(mlp, "ln", n);
    VALUE(mlp, "logits", logits);
    VALUE(mlp, "loss", loss);
    CHECK(tdm_backward(loss) == TDM_OK, "backward: %s", tdm_last_error());
    check_grad(x, mlp_gx, 48, "mlp x.grad");
    check_grad(w1, mlp_gfc1_weight, 128, "fc1.weight.grad");
    check_grad(b1, mlp_gfc1_bias, 16, "fc1.bias.grad");
    check_grad(w2, mlp_gfc2_weight, 128, "fc2.weight.grad");
    check_grad(b2, mlp_gfc2_bias, 8, "fc2.bias.grad");
    check_grad(lw, mlp_gln_weight, 8, "ln.weight.grad");
    check_grad(lb, mlp_gln_bias, 8, "ln.bias.grad");
    check_grad(w3, mlp_ghead_weight, 40, "head.weight.grad");
    check_grad(b3, mlp_ghead_bias, 5, "head.bias.grad");
    tdm_scope_end();
    free_all((tdm_tensor *[]){x, w1, b1, w2, b2, lw, lb, w3, b3, tg}, 10);
}

static void test_conv_chain(void) {
    tdm_tensor *img = leaf(TDM_SHAPE(2, 3, 6, 6), conv_img),
               *cw = leaf(TDM_SHAPE(4, 3, 3, 3), conv_conv_weight),
               *cb = leaf(TDM_SHAPE(4), conv_conv_bias),
               *fw = leaf(TDM_SHAPE(3, 36), conv_fc_weight), *fb = leaf(TDM_SHAPE(3), conv_fc_bias),
               *tg = i64(TDM_SHAPE(2), conv_target);
    tdm_scope_begin();
    tdm_autocast_begin(TDM_BF16);
    tdm_conv2d_opts co = {.pad_h = 1, .pad_w = 1};
    tdm_pool2d_opts po = {.kernel_h = 2, .kernel_w = 2};
    tdm_tensor *c = tdm_conv2d(img, cw, cb, &co), *a = tdm_relu(c), *p = tdm_max_pool2d(a, &po);
    tdm_tensor *o = tdm_linear(tdm_reshape(p, TDM_SHAPE(2, 36)), fw, fb);
    tdm_tensor *loss = tdm_cross_entropy(o, tg, NULL);
    tdm_autocast_end();
    VALUE(conv, "conv", c);
    VALUE(conv, "relu", a);
    VALUE(conv, "pool", p);
    VALUE(conv, "fc", o);
    VALUE(conv, "loss", loss);
    CHECK(tdm_backward(loss) == TDM_OK, "backward: %s", tdm_last_error());
    check_grad(img, conv_gimg, 216, "img.grad");
    check_grad(cw, conv_gconv_weight, 108, "conv.weight.grad");
    check_grad(cb, conv_gconv_bias, 4, "conv.bias.grad");
    check_grad(fw, conv_gfc_weight, 108, "fc.weight.grad");
    check_grad(fb, conv_gfc_bias, 3, "fc.bias.grad");
    tdm_scope_end();
    free_all((tdm_tensor *[]){img, cw, cb, fw, fb, tg}, 6);
}

static void test_attention_chain(void) {
    tdm_tensor *x = leaf(TDM_SHAPE(2, 4, 8), attn_x), *qw = leaf(TDM_SHAPE(24, 8), attn_qkv_weight),
               *qb = leaf(TDM_SHAPE(24), attn_qkv_bias),
               *pw = leaf(TDM_SHAPE(8, 8), attn_proj_weight),
               *pb = leaf(TDM_SHAPE(8), attn_proj_bias),
               *u = on_dev(f32(TDM_SHAPE(2, 4, 8), attn_u));
    tdm_scope_begin();
    tdm_autocast_begin(TDM_BF16);
    tdm_tensor *qkv = tdm_linear(x, qw, qb), *y = tdm_causal_attention(qkv, 2);
    tdm_tensor *out = tdm_linear(y, pw, pb), *loss = tdm_sum_all(tdm_mul(out, u));
    tdm_autocast_end();
    VALUE(attn, "qkv", qkv);
    VALUE(attn, "attention", y);
    VALUE(attn, "proj", out);
    VALUE(attn, "loss", loss);
    CHECK(tdm_backward(loss) == TDM_OK, "backward: %s", tdm_last_error());
    check_grad(x, attn_gx, 64, "attn x.grad");
    check_grad(qw, attn_gqkv_weight, 192, "qkv.weight.grad");
    check_grad(qb, attn_gqkv_bias, 24, "qkv.bias.grad");
    check_grad(pw, attn_gproj_weight, 64, "proj.weight.grad");
    check_grad(pb, attn_gproj_bias, 8, "proj.bias.grad");
    tdm_scope_end();
    free_all((tdm_tensor *[]){x, qw, qb, pw, pb, u}, 6);
}

/* to_dtype nodes on the unwalked tape whose input is t. */
static int casts_on_tape(const tdm_tensor *t) {
    int start, end, k = 0;
    tdm_node **tape = tdm_tape_nodes(&start, &end);
    for (int i = start; i < end; i++)
        k += !strcmp(tape[i]->name, "to_dtype") && tape[i]->in[0] == t;
    return k;
}

/* A parameter used twice in a region is cast once; its gradient is both uses', in f32. A
 * backward, a new region or a new scope make the cast again. */
static void test_cast_cache(void) {
    float xv[6] = {1, -2, 0.5f, 3, 0.25f, -1}, wv[6] = {0.5f, 1, -1, 2, 0.125f, 0.75f};
    tdm_tensor *x = f32(TDM_SHAPE(3, 2), xv), *w = leaf(TDM_SHAPE(3, 2), wv);
    tdm_scope_begin();
    tdm_autocast_begin(TDM_BF16);
    int64_t c0 = tdm_autocast_cast_count();
    tdm_tensor *y1 = tdm_linear(x, w, NULL), *y2 = tdm_linear(x, w, NULL);
    /* x is no parameter: cast each time (2); w once (1) */
    CHECK(tdm_autocast_cast_count() - c0 == 3, "casts: %lld, expected 3",
          (long long)(tdm_autocast_cast_count() - c0));
    CHECK(casts_on_tape(w) == 1, "w cast %d times on the tape, expected once", casts_on_tape(w));
    CHECK(y1->dtype == TDM_BF16 && y2->dtype == TDM_BF16, "linear in a region gives bf16");
    tdm_tensor *loss = tdm_sum_all(tdm_add(y1, y2));
    CHECK(tdm_backward(loss) == TDM_OK, "backward: %s", tdm_last_error());
    /* d/dw sum(2 x w^T): each row twice the column sums of x (1.75, 0), exact in bf16 */
    float gw[6] = {3.5f, 0, 3.5f, 0, 3.5f, 0};
    CHECK(w->grad && w->grad->dtype == TDM_F32, "w.grad is f32");
    check_tensor_close(w->grad, gw, 0, 0, "w.grad from both uses");
    /* the backward walked the cast: the next use casts again */
    int64_t c1 = tdm_autocast_cast_count();
    tdm_linear(w, w, NULL);
    CHECK(tdm_autocast_cast_count() - c1 == 1, "after backward: %lld casts, expected 1",
          (long long)(tdm_autocast_cast_count() - c1));
    tdm_autocast_end();
    /* a new region: a new cache */
    tdm_autocast_begin(TDM_BF16);
    int64_t c2 = tdm_autocast_cast_count();
    tdm_linear(x, w, NULL);
    CHECK(tdm_autocast_cast_count() - c2 == 2, "new region: %lld casts, expected 2",
          (long long)(tdm_autocast_cast_count() - c2));
    tdm_scope_end();
    /* the scope that held the cast ended: the cache must not hand it out */
    tdm_scope_begin();
    int64_t c3 = tdm_autocast_cast_count();
    tdm_tensor *y3 = tdm_linear(x, w, NULL);
    CHECK(tdm_autocast_cast_count() - c3 == 2 && y3 && y3->dtype == TDM_BF16,
          "new scope: %lld casts, expected 2", (long long)(tdm_autocast_cast_count() - c3));
    /* with grad mode off nothing is cached (no node to know the cast by) */
    bool prev = tdm_set_grad_enabled(false);
    int64_t c4 = tdm_autocast_cast_count();
    tdm_linear(x, w, NULL);
    tdm_linear(x, w, NULL);
    CHECK(tdm_autocast_cast_count() - c4 == 4, "no grad: %lld casts, expected 4",
          (long long)(tdm_autocast_cast_count() - c4));
    tdm_set_grad_enabled(prev);
    tdm_autocast_end();
    tdm_scope_end();
    tdm_tensor_free(x);
    tdm_tensor_free(w);
}

static void test_nesting(void) {
    float v[4] = {1, 2, 3, 4}, bv[2] = {0.5f, -1};
    int64_t cv[2] = {1, 0};
    tdm_tensor *a = f32(TDM_SHAPE(2, 2), v), *bias = f32(TDM_SHAPE(2), bv),
               *c = i64(TDM_SHAPE(2), cv);
    tdm_scope_begin();
    CHECK(tdm_autocast_dtype() == TDM_F32, "outside: f32");
    tdm_autocast_begin(TDM_BF16);
    CHECK(tdm_autocast_dtype() == TDM_BF16, "in a bf16 region");
    tdm_autocast_begin(TDM_F32); /* torch.autocast(enabled=False) */
    CHECK(tdm_autocast_dtype() == TDM_F32, "disabled inside");
    tdm_tensor *m = tdm_matmul(a, a);
    CHECK(m && m->dtype == TDM_F32, "matmul in a disabled region stays f32");
    tdm_autocast_begin(TDM_F16);
    m = tdm_matmul(a, a);
    CHECK(m && m->dtype == TDM_F16, "matmul in an f16 region inside: f16");
    tdm_autocast_end();
    tdm_autocast_end();
    m = tdm_matmul(a, a);
    CHECK(tdm_autocast_dtype() == TDM_BF16 && m && m->dtype == TDM_BF16, "back in bf16");
    tdm_tensor *e = tdm_exp(a), *s = tdm_softmax(m, -1);
    CHECK(e && e->dtype == TDM_F32 && s && s->dtype == TDM_BF16,
          "on the CPU exp and softmax follow their input");
    CHECK(tdm_autocast_end() == TDM_OK, "end");
    CHECK(tdm_autocast_dtype() == TDM_F32, "outside again");
    CHECK_ERROR(tdm_autocast_end() != TDM_OK, "autocast_end: no autocast region is open");
    CHECK_ERROR(tdm_autocast_begin(TDM_I64) != TDM_OK, "dtype i64 is not a float dtype");
    for (int i = 0; i < TDM_AUTOCAST_MAX_DEPTH; i++) tdm_autocast_begin(TDM_BF16);
    CHECK_ERROR(tdm_autocast_begin(TDM_BF16) != TDM_OK, "regions already open");
    for (int i = 0; i < TDM_AUTOCAST_MAX_DEPTH; i++) tdm_autocast_end();
    CHECK(tdm_autocast_dtype() == TDM_F32, "all closed");
    tdm_scope_end();
    /* no scope open: a result without history comes back, one with history fails as it
     * does outside a region */
    tdm_autocast_begin(TDM_BF16);
    tdm_tensor *p = tdm_matmul(a, a), *q = tdm_linear(a, a, bias),
               *r = tdm_cross_entropy(q, c, NULL);
    CHECK(p && p->dtype == TDM_BF16 && !tdm_book(p)->owner, "no scope: a caller-owned bf16 result");
    CHECK(q && q->dtype == TDM_BF16 && !tdm_book(q)->owner, "no scope: linear's bf16 result");
    CHECK(r && r->dtype == TDM_F32 && !tdm_book(r)->owner, "no scope: the loss in f32");
    tdm_tensor_free(p);
    tdm_tensor_free(q);
    tdm_tensor_free(r);
    tdm_requires_grad_(a, true);
    CHECK_ERROR(tdm_matmul(a, a) == NULL, "needs an open step scope");
    tdm_autocast_end();
    tdm_tensor_free(a);
    tdm_tensor_free(bias);
    tdm_tensor_free(c);
}

/* ---- recomputation: the second run in the dtypes of the first ---- */

static tdm_tensor *two_linears(void *arg, tdm_tensor *x) {
    tdm_tensor **w = arg;
    return tdm_gelu(tdm_linear(tdm_gelu(tdm_linear(x, w[0], NULL), false), w[0], NULL), false);
}

/* The gradients of sum(two_linears(x) * 1) made in a bf16 region, through tdm_recompute or
 * directly, the backward after the region ended; into gw. Returns the output's dtype. */
static tdm_dtype recompute_grads(bool recompute, const float *xv, const float *wv, float *gw) {
    tdm_tensor *x = f32(TDM_SHAPE(4, 4), xv), *w = leaf(TDM_SHAPE(4, 4), wv);
    tdm_scope_begin();
    tdm_autocast_begin(TDM_BF16);
    /* the function's casts are not cached (each use of w its own cast, as in tdm_recompute):
     * the direct run does the same, so the roundings are the same */
    bool cache = tdm_autocast_set_cache(false);
    tdm_tensor *y = recompute ? tdm_recompute(two_linears, &w, x) : two_linears(&w, x);
    tdm_autocast_set_cache(cache);
    tdm_tensor *loss = tdm_sum_all(tdm_mul_scalar(y, 1.0f));
    tdm_autocast_end();
    tdm_dtype dt = y ? y->dtype : TDM_I32;
    CHECK(loss && tdm_backward(loss) == TDM_OK, "backward: %s", tdm_last_error());
    if (w->grad) tdm_to_host(w->grad, gw, 16 * sizeof(float));
    tdm_scope_end();
    tdm_tensor_free(x);
    tdm_tensor_free(w);
    return dt;
}

static void test_recompute(void) {
    float xv[16], wv[16], g0[16] = {0}, g1[16] = {0};
    for (int i = 0; i < 16; i++) {
        xv[i] = (float)((i * 7) % 11 - 5) / 4.0f;
        wv[i] = (float)((i * 5) % 13 - 6) / 8.0f;
    }
    CHECK(recompute_grads(false, xv, wv, g0) == TDM_BF16, "direct: bf16 output");
    CHECK(recompute_grads(true, xv, wv, g1) == TDM_BF16, "recomputed: bf16 output");
    /* the same kernels in the same dtypes: the same bits */
    tdm_tensor *t = f32(TDM_SHAPE(16), g1);
    check_tensor_close(t, g0, 0, 0, "recomputed gradient = direct");
    tdm_tensor_free(t);
}

/* ---- per thread ---- */

typedef struct {
    tdm_dtype seen, out, own;
} thread_view;

static void *other_thread(void *arg) {
    thread_view *v = arg;
    float d[4] = {1, 2, 3, 4};
    v->seen = tdm_autocast_dtype();
    tdm_scope_begin();
    tdm_tensor *a = tdm_from_data(TDM_SHAPE(2, 2), TDM_F32, CPU, d);
    tdm_tensor *m = tdm_matmul(a, a);
    v->out = m ? m->dtype : TDM_I32;
    tdm_autocast_begin(TDM_F16);
    v->own = tdm_autocast_dtype();
    tdm_autocast_end();
    tdm_scope_end();
    tdm_thread_release();
    return NULL;
}

static void test_threads(void) {
    tdm_autocast_begin(TDM_BF16);
    thread_view v = {TDM_I32, TDM_I32, TDM_I32};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, other_thread, &v) == 0, "pthread_create");
    pthread_join(th, NULL);
    CHECK(v.seen == TDM_F32, "another thread sees no region: %s", tdm_dtype_name(v.seen));
    CHECK(v.out == TDM_F32, "its matmul runs in f32: %s", tdm_dtype_name(v.out));
    CHECK(v.own == TDM_F16, "its own region: %s", tdm_dtype_name(v.own));
    CHECK(tdm_autocast_dtype() == TDM_BF16, "this thread's region is untouched");
    tdm_autocast_end();
}

/* ---- the dtypes ops give outside a region ---- */

static tdm_tensor *as(tdm_dtype dt, tdm_shape s, const float *v) {
    tdm_tensor *f = f32(s, v), *t = tdm_cast(f, dt);
    tdm_tensor_free(f);
    return t;
}

static void test_follow_and_promote(void) {
    float v[6] = {0.5f, -1, 2, 0.25f, -3, 1.5f}, lw[3] = {1, 0.5f, 2};
    int64_t tv[2] = {2, 0};
    tdm_tensor *bf = as(TDM_BF16, TDM_SHAPE(2, 3), v), *hf = as(TDM_F16, TDM_SHAPE(2, 3), v),
               *fp = f32(TDM_SHAPE(2, 3), v), *w = leaf(TDM_SHAPE(3), lw),
               *tg = i64(TDM_SHAPE(2), tv);
    tdm_requires_grad_(bf, true);
    tdm_requires_grad_(fp, true);
    tdm_scope_begin();
    CHECK(tdm_add(bf, fp)->dtype == TDM_F32, "bf16 + f32 -> f32");
    CHECK(tdm_mul(bf, hf)->dtype == TDM_F32, "bf16 * f16 -> f32");
    CHECK(tdm_sub(bf, bf)->dtype == TDM_BF16, "bf16 - bf16 -> bf16");
    CHECK(tdm_relu(hf)->dtype == TDM_F16, "relu follows f16");
    CHECK(tdm_sum(bf, 1, false)->dtype == TDM_BF16, "sum follows bf16");
    CHECK(tdm_concat((tdm_tensor *[]){bf, fp}, 2, 0)->dtype == TDM_F32, "cat promotes");
    tdm_tensor *ln = tdm_layer_norm(bf, 1, w, NULL, 1e-5f);
    CHECK(ln && ln->dtype == TDM_BF16, "layer_norm of bf16 with f32 weight: bf16");
    CHECK_ERROR(tdm_linear(bf, fp, NULL) == NULL, "linear: operands of dtypes bf16 and f32");
    tdm_tensor *ce = tdm_cross_entropy(hf, tg, NULL);
    CHECK(ce && ce->dtype == TDM_F16, "cross_entropy of f16 logits outside a region: f16");
    tdm_ce_opts none = tdm_ce_defaults();
    none.reduction = TDM_REDUCE_NONE;
    ce = tdm_cross_entropy(bf, tg, &none);
    CHECK(ce && ce->dtype == TDM_BF16 && ce->ndim == 1, "per-sample bf16 losses");
    /* gradients have their tensor's dtype: bf16's through the f32 add, f32's through bf16 */
    tdm_tensor *loss = tdm_sum_all(tdm_add(tdm_mul(tdm_add(bf, fp), ln), fp));
    CHECK(loss && loss->dtype == TDM_F32, "loss f32");
    CHECK(tdm_backward(loss) == TDM_OK, "backward: %s", tdm_last_error());
    CHECK(bf->grad && bf->grad->dtype == TDM_BF16, "bf16 leaf gets a bf16 .grad");
    CHECK(fp->grad && fp->grad->dtype == TDM_F32, "f32 leaf gets an f32 .grad");
    CHECK(w->grad && w->grad->dtype == TDM_F32, "f32 norm weight gets an f32 .grad");
    tdm_scope_end();
    tdm_tensor_free(bf);
    tdm_tensor_free(hf);
    tdm_tensor_free(fp);
    tdm_tensor_free(w);
    tdm_tensor_free(tg);
}

/* ---- backward in bf16 against the fp32 twin ---- */

typedef tdm_tensor *(*op_fn)(tdm_tensor *x, tdm_tensor *p);

static tdm_tensor *op_linear(tdm_tensor *x, tdm_tensor *p) {
    return tdm_linear(x, p, NULL);
}
static tdm_tensor *op_gelu(tdm_tensor *x, tdm_tensor *p) {
    return tdm_mul(tdm_gelu(x, true), p);
}
static tdm_tensor *op_softmax(tdm_tensor *x, tdm_tensor *p) {
    return tdm_mul(tdm_log_softmax(tdm_mul(x, p), -1), p);
}
static tdm_tensor *op_layer_norm(tdm_tensor *x, tdm_tensor *p) {
    return tdm_layer_norm(tdm_mul(x, p), 1, NULL, NULL, 1e-5f);
}
static tdm_tensor *op_attention(tdm_tensor *x, tdm_tensor *p) {
    tdm_tensor *qkv = tdm_concat((tdm_tensor *[]){tdm_matmul(x, p), x, p}, 3, 1); /* [4, 12] */
    return tdm_causal_attention(tdm_reshape(qkv, TDM_SHAPE(1, 4, 12)), 2);
}
static tdm_tensor *op_conv(tdm_tensor *x, tdm_tensor *p) {
    tdm_conv2d_opts o = {.pad_h = 1, .pad_w = 1};
    return tdm_conv2d(tdm_reshape(x, TDM_SHAPE(1, 1, 4, 4)), tdm_reshape(p, TDM_SHAPE(1, 1, 4, 4)),
                      NULL, &o);
}

/* sum(op(x, p) * u) with x, p in dt (bf16-rounded values either way); the gradients of x and p
 * into gx, gp as floats. */
static void grads_in(op_fn op, tdm_dtype dt, const float *xv, const float *pv, float *gx, float *gp,
                     float *u_seed) {
    tdm_tensor *x = as(dt, TDM_SHAPE(4, 4), xv), *p = as(dt, TDM_SHAPE(4, 4), pv);
    tdm_requires_grad_(x, true);
    tdm_requires_grad_(p, true);
    tdm_scope_begin();
    tdm_tensor *y = op(x, p);
    tdm_tensor *u = y ? tdm_full(tdm_shape_of(y), 0, TDM_F32, CPU) : NULL;
    if (u) { /* a fixed upstream gradient with distinct values */
        float uv[64];
        for (int i = 0; i < tdm_numel(u) && i < 64; i++) uv[i] = u_seed[i % 16] + 0.01f * i;
        tdm_copy_(u, tdm_from_data(tdm_shape_of(u), TDM_F32, CPU, uv));
    }
    tdm_tensor *loss = u ? tdm_sum_all(tdm_mul(y, u)) : NULL;
    CHECK(loss && tdm_backward(loss) == TDM_OK, "backward in %s: %s", tdm_dtype_name(dt),
          tdm_last_error());
    CHECK(y && y->dtype == dt, "output in %s", tdm_dtype_name(dt));
    CHECK(x->grad && x->grad->dtype == dt && p->grad && p->grad->dtype == dt, "gradients in %s",
          tdm_dtype_name(dt));
    tdm_tensor *a = x->grad ? tdm_cast(x->grad, TDM_F32) : NULL;
    tdm_tensor *b = p->grad ? tdm_cast(p->grad, TDM_F32) : NULL;
    if (a) tdm_to_host(a, gx, 16 * sizeof(float));
    if (b) tdm_to_host(b, gp, 16 * sizeof(float));
    tdm_scope_end();
    tdm_tensor_free(x);
    tdm_tensor_free(p);
}

static void test_backward_vs_fp32(void) {
    struct {
        const char *name;
        op_fn fn;
    } ops[] = {{"linear", op_linear},       {"gelu", op_gelu},
               {"log_softmax", op_softmax}, {"layer_norm", op_layer_norm},
               {"attention", op_attention}, {"conv2d", op_conv}};
    float xv[16], pv[16], us[16];
    for (int i = 0; i < 16; i++) {
        /* bf16 values (8 significant bits), so both twins start from the same numbers */
        xv[i] = (float)((i * 37) % 23 - 11) / 8.0f;
        pv[i] = (float)((i * 53) % 19 - 9) / 16.0f;
        us[i] = (float)((i * 29) % 13 - 6) / 4.0f;
    }
    for (size_t k = 0; k < sizeof ops / sizeof *ops; k++) {
        float gx32[16], gp32[16], gx16[16], gp16[16];
        grads_in(ops[k].fn, TDM_F32, xv, pv, gx32, gp32, us);
        grads_in(ops[k].fn, TDM_BF16, xv, pv, gx16, gp16, us);
        char what[64];
        snprintf(what, sizeof what, "%s: bf16 grad x", ops[k].name);
        tdm_tensor *a = f32(TDM_SHAPE(16), gx16), *b = f32(TDM_SHAPE(16), gp16);
        check_close(a, gx32, 16, GRAD_MAX, 1.0 / 64, what);
        snprintf(what, sizeof what, "%s: bf16 grad p", ops[k].name);
        check_close(b, gp32, 16, GRAD_MAX, 1.0 / 64, what);
        tdm_tensor_free(a);
        tdm_tensor_free(b);
    }
}

/* a and b (same shape and dtype, any device) hold the same bits. */
static bool same_bits(tdm_tensor *a, tdm_tensor *b) {
    if (!a || !b || a->dtype != b->dtype || tdm_numel(a) != tdm_numel(b)) return false;
    tdm_tensor *ca = tdm_to_device(a, CPU), *cb = tdm_to_device(b, CPU);
    bool same =
        ca && cb &&
        !memcmp(tdm_data_ptr(ca), tdm_data_ptr(cb), tdm_numel(a) * tdm_dtype_size(a->dtype));
    if (ca != a) tdm_tensor_free(ca);
    if (cb != b) tdm_tensor_free(cb);
    return same;
}

/* Cross-entropy in a region reads bf16/f16 logits as they are (no f32 copy on the tape): the
 * loss and the logits' gradient must be the bits of PyTorch's way, the logits cast to f32 and
 * the f32 gradient cast back; with class weights, smoothing and an ignored sample so every
 * term of the kernels is in play. */
static void test_loss_reads_lowp(tdm_dtype dt) {
    enum { N = 5, C = 7 };
    float v[N * C], cw[C];
    for (int i = 0; i < N * C; i++) v[i] = (float)((i * 37) % 23 - 11) / 3.0f;
    for (int c = 0; c < C; c++) cw[c] = 0.5f + 0.25f * (float)c;
    int64_t tv[N] = {3, -100, 0, 6, 2};
    tdm_tensor *xa = on_dev(as(dt, TDM_SHAPE(N, C), v)), *xb = on_dev(as(dt, TDM_SHAPE(N, C), v)),
               *w = on_dev(f32(TDM_SHAPE(C), cw)), *tg = on_dev(i64(TDM_SHAPE(N), tv));
    tdm_requires_grad_(xa, true);
    tdm_requires_grad_(xb, true);
    tdm_ce_opts o = tdm_ce_defaults();
    o.weight = w;
    o.label_smoothing = 0.1f;
    const char *dn = tdm_dtype_name(dt);
    tdm_scope_begin();
    tdm_autocast_begin(dt);
    int64_t c0 = tdm_autocast_cast_count();
    tdm_tensor *la = tdm_cross_entropy(xa, tg, &o);
    CHECK(tdm_autocast_cast_count() == c0 && casts_on_tape(xa) == 0,
          "%s cross_entropy in a region made an f32 copy of the logits", dn);
    tdm_autocast_end();
    CHECK(la && la->dtype == TDM_F32, "%s logits in a region: the loss in f32 (%s)", dn,
          tdm_last_error());
    CHECK(tdm_backward(la) == TDM_OK, "backward: %s", tdm_last_error());
    /* the reference after the first backward: a backward stops where an earlier one walked */
    tdm_tensor *lb = tdm_cross_entropy(tdm_to_dtype(xb, TDM_F32), tg, &o);
    CHECK(tdm_backward(lb) == TDM_OK, "backward: %s", tdm_last_error());
    CHECK(same_bits(la, lb), "%s: the loss differs from the cast's", dn);
    CHECK(xa->grad && xa->grad->dtype == dt, "%s logits get a %s .grad", dn, dn);
    CHECK(same_bits(xa->grad, xb->grad), "%s: the logits' gradient differs from the cast's", dn);
    tdm_scope_end();
    free_all((tdm_tensor *[]){xa, xb, w, tg}, 4);
}

/* A pre-norm block's residual add and norm in a region, as the GPT runs them: the f32 stream
 * x plus a linear's dt output, normalised into dt (tdm_add_layer_norm_to, one kernel), against
 * tdm_add then tdm_layer_norm_to on twin leaves: the sum, the norm and every leaf's gradient
 * bit for bit. */
static void test_add_norm_in_region(tdm_dtype dt) {
    enum { N = 6, C = 40 };
    float v[N * C], wv[C * C], gv[C];
    for (int i = 0; i < N * C; i++) v[i] = (float)((i * 29) % 31 - 15) / 7.0f;
    for (int i = 0; i < C * C; i++) wv[i] = (float)((i * 13) % 17 - 8) / 40.0f;
    for (int c = 0; c < C; c++) gv[c] = 1.0f + (float)(c % 5) / 8.0f;
    tdm_tensor *l[2][4];
    for (int k = 0; k < 2; k++) /* the stream, the linear's weight, the norm's weight and bias */
        l[k][0] = leaf(TDM_SHAPE(N, C), v), l[k][1] = leaf(TDM_SHAPE(C, C), wv),
        l[k][2] = leaf(TDM_SHAPE(C), gv), l[k][3] = leaf(TDM_SHAPE(C), v);
    const char *dn = tdm_dtype_name(dt);
    tdm_scope_begin();
    tdm_tensor *s[2], *y[2];
    for (int k = 0; k < 2; k++) {
        tdm_tensor **t = l[k];
        tdm_autocast_begin(dt);
        tdm_tensor *r = tdm_linear(t[0], t[1], NULL);
        if (k == 0) {
            y[k] = tdm_add_layer_norm_to(t[0], r, &s[k], 1, t[2], t[3], 1e-5f, dt);
        } else {
            s[k] = tdm_add(t[0], r);
            y[k] = tdm_layer_norm_to(s[k], 1, t[2], t[3], 1e-5f, dt);
        }
        tdm_tensor *loss = y[k] ? tdm_add(tdm_sum_all(tdm_mul(tdm_to_dtype(y[k], TDM_F32), t[0])),
                                          tdm_sum_all(tdm_mul(s[k], s[k])))
                                : NULL;
        tdm_autocast_end();
        CHECK(loss && tdm_backward(loss) == TDM_OK, "%s add and norm: %s", dn, tdm_last_error());
    }
    CHECK(y[0] && y[0]->dtype == dt && s[0] && s[0]->dtype == TDM_F32,
          "%s add_layer_norm_to in a region: the sum f32, the norm %s", dn, dn);
    CHECK(same_bits(s[0], s[1]) && same_bits(y[0], y[1]),
          "%s add_layer_norm_to in a region: the sum or the norm differs from the two ops'", dn);
    for (int i = 0; i < 4; i++)
        CHECK(same_bits(l[0][i]->grad, l[1][i]->grad),
              "%s add_layer_norm_to in a region: leaf %d's gradient differs from the two ops'", dn,
              i);
    tdm_scope_end();
    for (int k = 0; k < 2; k++) free_all(l[k], 4);
}

/* On a CUDA device the fp32 list is longer (autocast.h); conv2d is on the lower-precision list
 * there as on the CPU. */
static void test_cuda_lists(void) {
    float v[36];
    for (int i = 0; i < 36; i++) v[i] = (float)(i % 7 - 3) / 4.0f;
    tdm_tensor *x = on_dev(f32(TDM_SHAPE(4, 6), v)), *w = leaf(TDM_SHAPE(6, 6), v),
               *lw = leaf(TDM_SHAPE(6), v), *img = on_dev(f32(TDM_SHAPE(1, 1, 4, 6), v)),
               *k = leaf(TDM_SHAPE(1, 1, 2, 2), v);
    tdm_scope_begin();
    tdm_autocast_begin(TDM_BF16);
    tdm_tensor *h = tdm_linear(x, w, NULL);
    CHECK(h && h->dtype == TDM_BF16, "cuda: linear in bf16");
    struct {
        const char *name;
        tdm_tensor *t;
        tdm_dtype want;
    } rows[] = {
        {"softmax", tdm_softmax(h, -1), TDM_F32},
        {"log_softmax", tdm_log_softmax(h, -1), TDM_F32},
        {"layer_norm", tdm_layer_norm(h, 1, lw, NULL, 1e-5f), TDM_F32},
        {"exp", tdm_exp(h), TDM_F32},
        {"log", tdm_log(tdm_exp(h)), TDM_F32},
        {"pow_scalar", tdm_pow_scalar(h, 2), TDM_F32},
        {"sum", tdm_sum(h, 1, false), TDM_F32},
        {"sum_all", tdm_sum_all(h), TDM_F32},
        {"mean (follows)", tdm_mean(h, 1, false), TDM_BF16},
        {"relu (follows)", tdm_relu(h), TDM_BF16},
        {"conv2d", tdm_conv2d(img, k, NULL, NULL), TDM_BF16},
    };
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++)
        CHECK(rows[i].t && rows[i].t->dtype == rows[i].want, "cuda %s: %s, expected %s (%s)",
              rows[i].name, rows[i].t ? tdm_dtype_name(rows[i].t->dtype) : "NULL",
              tdm_dtype_name(rows[i].want), tdm_last_error());
    tdm_tensor *loss = tdm_add(tdm_sum_all(rows[2].t), tdm_sum_all(rows[10].t));
    tdm_autocast_end();
    CHECK(loss && tdm_backward(loss) == TDM_OK, "cuda backward: %s", tdm_last_error());
    CHECK(w->grad && w->grad->dtype == TDM_F32 && lw->grad && lw->grad->dtype == TDM_F32 &&
              k->grad && k->grad->dtype == TDM_F32,
          "cuda: the parameters' gradients in f32");
    tdm_scope_end();
    free_all((tdm_tensor *[]){x, w, lw, img, k}, 5);
}

int main(void) {
    test_mlp_chain();
    test_conv_chain();
    test_attention_chain();
    test_cast_cache();
    test_nesting();
    test_threads();
    test_recompute();
    test_follow_and_promote();
    test_backward_vs_fp32();
    test_loss_reads_lowp(TDM_BF16);
    test_loss_reads_lowp(TDM_F16);
    test_add_norm_in_region(TDM_BF16);
    if (tdm_device_count(TDM_CUDA) > 0) {
        DEV = tdm_cuda(0);
        test_loss_reads_lowp(TDM_BF16);
        test_loss_reads_lowp(TDM_F16);
        test_add_norm_in_region(TDM_BF16);
        test_add_norm_in_region(TDM_F16);
        test_mlp_chain();
        test_attention_chain();
        test_cuda_lists();
    } else {
        printf("SKIP the chains and lists on cuda:0: no GPU in this build or machine\n");
    }
    return check_summary();
}
