/* GPT-2: causal attention (against a naive reference and finite differences), a whole block's
 * gradients, the PyTorch fixture (logits, loss, every gradient, 10 AdamW steps with weight
 * decay on matrices only), weight tying, cloning, llm.c's checkpoint files (round trip and
 * every malformed case), and byte-level text data. */
#include "gradcheck.h"
#include "tandem/half.h"
#include "testdir.h"

#include "core/core.h" /* tdm_alloc_stats_get */

#include "fixtures/gpt_fixtures.h"
#include "fixtures/llmc_fixtures.h"

#include <unistd.h>

/* ---- attention ------------------------------------------------------------------------- */

/* y [B, T, C] from qkv [B, T, 3C] in double, straight from the definition. */
static void attention_reference(const float *qkv, double *y, int B, int T, int C, int nh) {
    int hs = C / nh;
    double *p = malloc(sizeof(double) * (size_t)T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < nh; h++)
            for (int t = 0; t < T; t++) {
                const float *q = qkv + ((size_t)b * T + t) * 3 * C + h * hs;
                double mx = -INFINITY, sum = 0;
                for (int s = 0; s <= t; s++) {
                    const float *k = qkv + ((size_t)b * T + s) * 3 * C + C + h * hs;
                    double d = 0;
                    for (int i = 0; i < hs; i++) d += (double)q[i] * k[i];
                    p[s] = d / sqrt((double)hs);
                    mx = p[s] > mx ? p[s] : mx;
                }
                for (int s = 0; s <= t; s++) sum += (p[s] = exp(p[s] - mx));
                for (int i = 0; i < hs; i++) {
                    double acc = 0;
                    for (int s = 0; s <= t; s++)
                        acc += p[s] / sum * qkv[((size_t)b * T + s) * 3 * C + 2 * C + h * hs + i];
                    y[((size_t)b * T + t) * C + h * hs + i] = acc;
                }
            }
    free(p);
}

typedef struct {
    int B, T, nh, hs;
} att_case;

static const att_case att_cases[] = {
    {1, 1, 1, 4}, {2, 5, 2, 3}, {1, 8, 4, 2}, {2, 7, 1, 8}, {1, 16, 2, 4}};

static void test_attention_forward(void) {
    for (size_t k = 0; k < sizeof att_cases / sizeof att_cases[0]; k++) {
        att_case c = att_cases[k];
        int C = c.nh * c.hs;
        int64_t n = (int64_t)c.B * c.T * 3 * C, ny = (int64_t)c.B * c.T * C;
        tdm_scope_begin();
        tdm_rng r = tdm_rng_make(7 + k);
        tdm_tensor *qkv = tdm_randn(TDM_SHAPE(c.B, c.T, 3 * C), 0, 1.5f, tdm_cpu(0), &r);
        tdm_tensor *y = tdm_causal_attention(qkv, c.nh);
        CHECK(y && y->ndim == 3 && y->shape[2] == C, "case %zu: %s", k, tdm_last_error());
        float *hq = malloc(sizeof(float) * (size_t)n);
        double *ref = malloc(sizeof(double) * (size_t)ny);
        float *exp_y = malloc(sizeof(float) * (size_t)ny);
        tdm_to_host(qkv, hq, sizeof(float) * (size_t)n);
        attention_reference(hq, ref, c.B, c.T, C, c.nh);
        for (int64_t i = 0; i < ny; i++) exp_y[i] = (float)ref[i];
        char what[64];
        snprintf(what, sizeof what, "attention B%d T%d nh%d hs%d", c.B, c.T, c.nh, c.hs);
        if (y) check_tensor_close(y, exp_y, 1e-5, 1e-4, what);
        free(hq);
        free(ref);
        free(exp_y);
        tdm_scope_end();
    }
}

/* The gradient of sum(y * dy) with respect to qkv in double, from the definition: per (b, h),
 * P the causal softmax, dV = P^T dY, dS = P * (dY V^T - rowsum(P * dY V^T)), dQ = dS K / sqrt(hs),
 * dK = dS^T Q / sqrt(hs). */
static void attention_grad_reference(const float *qkv, const float *dy, double *g, int B, int T,
                                     int C, int nh) {
    int hs = C / nh;
    double sc = 1.0 / sqrt((double)hs);
    double *P = malloc(sizeof(double) * (size_t)T * T),
           *dS = malloc(sizeof(double) * (size_t)T * T);
#define QKV(b, t, which, i) ((double)qkv[((size_t)(b)*T + (t)) * 3 * C + (which)*C + (i)])
#define DY(b, t, i)         ((double)dy[((size_t)(b)*T + (t)) * C + (i)])
#define G(b, t, which, i)   g[((size_t)(b)*T + (t)) * 3 * C + (which)*C + (i)]
    for (size_t i = 0; i < (size_t)B * T * 3 * C; i++) g[i] = 0;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < nh; h++) {
            int o = h * hs;
            for (int t = 0; t < T; t++) {
                double mx = -INFINITY, sum = 0, dot = 0;
                for (int s = 0; s <= t; s++) {
                    double d = 0;
                    for (int i = 0; i < hs; i++) d += QKV(b, t, 0, o + i) * QKV(b, s, 1, o + i);
                    P[t * T + s] = d * sc;
                    mx = fmax(mx, P[t * T + s]);
                }
                for (int s = 0; s <= t; s++) sum += (P[t * T + s] = exp(P[t * T + s] - mx));
                for (int s = 0; s <= t; s++) {
                    double dp = 0;
                    for (int i = 0; i < hs; i++) dp += DY(b, t, o + i) * QKV(b, s, 2, o + i);
                    P[t * T + s] /= sum;
                    dS[t * T + s] = dp;
                    dot += P[t * T + s] * dp;
                }
                for (int s = 0; s <= t; s++) dS[t * T + s] = P[t * T + s] * (dS[t * T + s] - dot);
            }
            for (int t = 0; t < T; t++)
                for (int s = 0; s <= t; s++)
                    for (int i = 0; i < hs; i++) {
                        G(b, s, 2, o + i) += P[t * T + s] * DY(b, t, o + i);
                        G(b, t, 0, o + i) += sc * dS[t * T + s] * QKV(b, s, 1, o + i);
                        G(b, s, 1, o + i) += sc * dS[t * T + s] * QKV(b, t, 0, o + i);
                    }
        }
#undef QKV
#undef DY
#undef G
    free(P), free(dS);
}

/* Long sequences, where the kernels multiply causal blocks only (4 row blocks from T 128 on,
 * uneven where 4 does not divide T): y and the gradient of qkv against the definition. */
static void test_attention_blocks(void) {
    const att_case cases[] = {{2, 130, 2, 8}, {1, 257, 1, 16}, {1, 128, 4, 4}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        att_case c = cases[k];
        int C = c.nh * c.hs;
        size_t n = (size_t)c.B * c.T * 3 * C, ny = (size_t)c.B * c.T * C;
        tdm_scope_begin();
        tdm_rng r = tdm_rng_make(70 + k);
        tdm_tensor *qkv = tdm_randn(TDM_SHAPE(c.B, c.T, 3 * C), 0, 1.5f, tdm_cpu(0), &r);
        tdm_tensor *dy = tdm_randn(TDM_SHAPE(c.B, c.T, C), 0, 1, tdm_cpu(0), &r);
        tdm_requires_grad_(qkv, true);
        tdm_tensor *y = tdm_causal_attention(qkv, c.nh);
        int rc = y ? tdm_backward(tdm_sum_all(tdm_mul(y, dy))) : -1;
        char what[64];
        snprintf(what, sizeof what, "attention blocks B%d T%d nh%d hs%d", c.B, c.T, c.nh, c.hs);
        CHECK(rc == 0 && qkv->grad, "%s: %s", what, tdm_last_error());
        float *hq = malloc(sizeof(float) * n), *hd = malloc(sizeof(float) * ny);
        float *want = malloc(sizeof(float) * n);
        double *ref = malloc(sizeof(double) * n);
        tdm_to_host(qkv, hq, sizeof(float) * n);
        tdm_to_host(dy, hd, sizeof(float) * ny);
        attention_reference(hq, ref, c.B, c.T, C, c.nh);
        for (size_t i = 0; i < ny; i++) want[i] = (float)ref[i];
        if (y) check_tensor_close(y, want, 1e-5, 1e-4, what);
        attention_grad_reference(hq, hd, ref, c.B, c.T, C, c.nh);
        for (size_t i = 0; i < n; i++) want[i] = (float)ref[i];
        if (!rc && qkv->grad) check_tensor_close(qkv->grad, want, 1e-4, 1e-3, what);
        free(hq), free(hd), free(want), free(ref);
        tdm_scope_end();
    }
}

static tdm_tensor *attention_fn(tdm_tensor **in, void *ctx) {
    return tdm_causal_attention(in[0], *(int *)ctx);
}

/* qkv seen through a transpose: the op must accept strided inputs */
static tdm_tensor *attention_strided_fn(tdm_tensor **in, void *ctx) {
    return tdm_causal_attention(tdm_transpose(in[0], 0, 1), *(int *)ctx);
}

static void test_attention_gradcheck(void) {
    for (size_t k = 0; k < sizeof att_cases / sizeof att_cases[0]; k++) {
        att_case c = att_cases[k];
        tdm_tensor *qkv = gradcheck_input(TDM_SHAPE(c.B, c.T, 3 * c.nh * c.hs), 100 + k);
        char what[64];
        snprintf(what, sizeof what, "attention grad B%d T%d nh%d hs%d", c.B, c.T, c.nh, c.hs);
        gradcheck(what, attention_fn, 1, &qkv, &c.nh, 1e-2, 2e-3, 1e-2);
        tdm_tensor_free(qkv);
    }
    int nh = 2;
    tdm_tensor *qkv = gradcheck_input(TDM_SHAPE(5, 2, 12), 150); /* [T, B, 3C] */
    gradcheck("attention grad strided", attention_strided_fn, 1, &qkv, &nh, 1e-2, 2e-3, 1e-2);
    tdm_tensor_free(qkv);
}

static void test_attention_errors(void) {
    tdm_scope_begin();
    tdm_tensor *bad = tdm_zeros(TDM_SHAPE(2, 3, 10), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(!tdm_causal_attention(bad, 1), "must be [B, T, 3C]");
    tdm_tensor *odd = tdm_zeros(TDM_SHAPE(2, 3, 12), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(!tdm_causal_attention(odd, 3), "do not split into 3 heads");
    CHECK_ERROR(!tdm_causal_attention(odd, 0), "do not split into 0 heads");
    tdm_tensor *ints = tdm_zeros(TDM_SHAPE(2, 3, 12), TDM_I64, tdm_cpu(0));
    CHECK_ERROR(!tdm_causal_attention(ints, 1), "causal_attention");
    CHECK_ERROR(!tdm_causal_attention(NULL, 1), "NULL input");
    tdm_scope_end();
}

/* ---- a whole block ---------------------------------------------------------------------- */

static tdm_module *block0(tdm_module *gpt) {
    return gpt->children[0]->children[2]->children[0]; /* transformer.h.0 */
}

static tdm_tensor *block_fn(tdm_tensor **in, void *ctx) {
    return tdm_module_forward(block0(ctx), in[0]);
}

static void test_block_gradcheck(void) {
    tdm_gpt_config cfg = {.layers = 1, .heads = 2, .channels = 6, .context = 5, .vocab = 7};
    tdm_rng r = tdm_rng_make(3);
    tdm_module *m = tdm_gpt_new(&cfg, tdm_cpu(0), &r);
    CHECK(m != NULL, "gpt_new: %s", tdm_last_error());
    if (!m) return;
    /* larger weights than GPT-2's 0.02, so every path of the block matters */
    tdm_module *b = block0(m);
    const char *names[4] = {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                            "ln_1.weight"};
    tdm_tensor *in[5] = {gradcheck_input(TDM_SHAPE(2, 5, 6), 11)};
    for (int i = 0; i < 4; i++) {
        in[i + 1] = tdm_module_find(b, names[i]);
        tdm_normal_(in[i + 1], i == 3 ? 1.0f : 0.0f, 0.4f, &r);
    }
    gradcheck("block grad (x, c_attn, c_proj, c_fc, ln_1)", block_fn, 5, in, m, 1e-2, 3e-3, 1e-2);
    tdm_tensor_free(in[0]);
    tdm_module_free(m);
}

/* The whole model by finite differences, for the embeddings: the token embedding is read
 * twice (lookup and tied head), so its gradient is checked as the sum of both uses. No
 * padding here (V == Vp): the head then uses the leaf itself, not a row view. */
static tdm_tensor *gpt_fn(tdm_tensor **in, void *ctx) {
    const int64_t idx[6] = {1, 4, 0, 2, 2, 3};
    return tdm_gpt_forward(ctx, tdm_from_data(TDM_SHAPE(2, 3), TDM_I64, tdm_cpu(0), idx));
}

static void test_model_gradcheck(void) {
    tdm_gpt_config cfg = {.layers = 1, .heads = 2, .channels = 4, .context = 3, .vocab = 5};
    tdm_rng r = tdm_rng_make(5);
    tdm_module *m = tdm_gpt_new(&cfg, tdm_cpu(0), &r);
    CHECK(m != NULL, "gpt_new: %s", tdm_last_error());
    if (!m) return;
    tdm_tensor *in[2] = {tdm_module_find(m, "transformer.wte.weight"),
                         tdm_module_find(m, "transformer.wpe.weight")};
    for (int i = 0; i < 2; i++) tdm_normal_(in[i], 0.0f, 0.5f, &r);
    gradcheck("gpt grad (wte: lookup + tied head, wpe)", gpt_fn, 2, in, m, 1e-2, 3e-3, 1e-2);
    tdm_module_free(m);
}

/* ---- the PyTorch fixture ------------------------------------------------------------------ */

static tdm_module *fixture_model(void) {
    tdm_gpt_config cfg = {GF_L, GF_NH, GF_C, GF_MAXT, GF_V, GF_VP};
    tdm_module *m = tdm_gpt_new(&cfg, tdm_cpu(0), NULL);
    if (!m || !tdm_module_parameters(m) ||
        tdm_gpt_import_llmc(m, gf_params, sizeof gf_params / sizeof(float))) {
        CHECK(false, "fixture model: %s", tdm_last_error());
        tdm_module_free(m);
        return NULL;
    }
    return m;
}

static tdm_tensor *tokens(const int64_t *v) {
    return tdm_from_data(TDM_SHAPE(GF_B, GF_T), TDM_I64, tdm_cpu(0), v);
}

static void test_fixture_gradients(void) {
    tdm_module *m = fixture_model();
    if (!m) return;
    tdm_scope_begin();
    tdm_tensor *logits = tdm_gpt_forward(m, tokens(gf_idx));
    tdm_tensor *loss = tdm_gpt_loss(logits, tokens(gf_tgt));
    CHECK(loss != NULL, "forward: %s", tdm_last_error());
    if (loss) {
        check_tensor_close(logits, gf_logits, 1e-5, 1e-4, "gpt logits");
        CHECK_CLOSE(tdm_item(loss), gf_loss, 1e-6, 1e-5);
        CHECK(tdm_backward(loss) == TDM_OK, "backward: %s", tdm_last_error());
        enum { N = sizeof gf_grads / sizeof(float) };
        float *g = malloc(sizeof(float) * N);
        CHECK(tdm_gpt_export_llmc(m, true, g, N) == TDM_OK, "%s", tdm_last_error());
        int bad = 0;
        for (int i = 0; i < N; i++)
            if (!(fabs(g[i] - gf_grads[i]) <= 1e-6 + 1e-3 * fabs(gf_grads[i]))) {
                if (bad++ < 5)
                    fprintf(stderr, "gradient %d (llm.c order): %.9g, expected %.9g\n", i, g[i],
                            gf_grads[i]);
            }
        CHECK(bad == 0, "%d of %d gradients differ from PyTorch's", bad, N);
        free(g);
    }
    tdm_scope_end();
    tdm_module_free(m);
}

static void test_fixture_adamw(void) {
    tdm_module *m = fixture_model();
    if (!m) return;
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_adam_opts ao = tdm_adamw_defaults();
    ao.lr = GF_LR, ao.beta1 = GF_BETA1, ao.beta2 = GF_BETA2, ao.eps = GF_EPS;
    ao.weight_decay = GF_WD;
    tdm_optim *opt = tdm_gpt_adamw_new(ps, &ao);
    CHECK(opt != NULL, "gpt_adamw_new: %s", tdm_last_error());
    for (int s = 0; opt && s < GF_STEPS; s++) {
        tdm_scope_begin();
        tdm_optim_zero_grad(opt);
        const int64_t *x = gf_step_idx + s * GF_B * GF_T, *y = gf_step_tgt + s * GF_B * GF_T;
        tdm_tensor *loss = tdm_gpt_loss(tdm_gpt_forward(m, tokens(x)), tokens(y));
        float l = tdm_item(loss);
        CHECK(loss && tdm_backward(loss) == TDM_OK && tdm_optim_step(opt) == TDM_OK, "step %d: %s",
              s, tdm_last_error());
        CHECK_CLOSE(l, gf_step_losses[s], 1e-5, 1e-5);
        tdm_scope_end();
    }
    enum { N = sizeof gf_params_after / sizeof(float) };
    float *p = malloc(sizeof(float) * N);
    tdm_gpt_export_llmc(m, false, p, N);
    int bad = 0;
    /* The key biases are left out: softmax ignores a constant added to a row of scores, so
     * their gradient is exactly 0 and both sides hold only rounding noise, which Adam's
     * m / sqrt(v) turns into steps of +-lr. Everything else must agree. */
    const int64_t C = GF_C, kb = GF_VP * C + GF_MAXT * C + 2 * GF_L * C + GF_L * 3 * C * C;
    int skipped = 0;
    for (int i = 0; i < N; i++) {
        int64_t j = i - kb; /* inside the stacked qkvb [L, 3C]: keys are [C, 2C) of a layer */
        if (j >= 0 && j < GF_L * 3 * C && j % (3 * C) >= C && j % (3 * C) < 2 * C) {
            skipped++;
            continue;
        }
        if (!(fabs(p[i] - gf_params_after[i]) <= 1e-6 + 1e-5 * fabs(gf_params_after[i]))) {
            if (bad++ < 5)
                fprintf(stderr, "weight %d (llm.c order): %.9g, expected %.9g\n", i, p[i],
                        gf_params_after[i]);
        }
    }
    CHECK(skipped == GF_L * GF_C, "skipped %d key biases", skipped);
    CHECK(bad == 0, "%d weights differ from PyTorch's after %d AdamW steps", bad, GF_STEPS);
    free(p);
    tdm_optim_free(opt);
    tdm_module_free(m);
}

/* One tensor, two uses: listed once, under the embedding's name; clones compute the same. */
static void test_tying_and_clone(void) {
    tdm_module *m = fixture_model();
    if (!m) return;
    tdm_paramset *ps = tdm_module_parameters(m);
    CHECK(ps->n == 4 + 12 * GF_L, "%d parameters, expected %d", ps->n, 4 + 12 * GF_L);
    CHECK(!strcmp(ps->names[0], "transformer.wte.weight"), "first is %s", ps->names[0]);
    CHECK(!strcmp(ps->names[ps->n - 1], "transformer.ln_f.bias"), "last is %s",
          ps->names[ps->n - 1]);
    CHECK(ps->total == tdm_gpt_llmc_numel(tdm_gpt_config_of(m)), "total %lld",
          (long long)ps->total);
    CHECK(tdm_module_find(m, "transformer.h.1.attn.c_attn.weight") != NULL, "nanoGPT names");
    tdm_module *c = tdm_module_clone(m, tdm_cpu(0));
    CHECK(c && tdm_gpt_config_of(c) != NULL, "clone: %s", tdm_last_error());
    if (c) {
        tdm_scope_begin();
        bool prev = tdm_set_grad_enabled(false);
        tdm_tensor *a = tdm_gpt_forward(m, tokens(gf_idx)), *b = tdm_gpt_forward(c, tokens(gf_idx));
        float ha[GF_B * GF_T * GF_V];
        CHECK(a && b && tdm_to_host(a, ha, sizeof ha) == 0, "%s", tdm_last_error());
        if (b) check_tensor_close(b, ha, 0, 0, "clone logits");
        tdm_set_grad_enabled(prev);
        tdm_scope_end();
    }
    tdm_module_free(c);
    tdm_scope_begin();
    tdm_tensor *long_seq = tdm_zeros(TDM_SHAPE(1, GF_MAXT + 1), TDM_I64, tdm_cpu(0));
    CHECK_ERROR(!tdm_gpt_forward(m, long_seq), "context");
    tdm_tensor *bad_tok = tdm_full(TDM_SHAPE(1, 2), GF_VP, TDM_I64, tdm_cpu(0));
    CHECK_ERROR(!tdm_gpt_forward(m, bad_tok), "index");
    tdm_scope_end();
    tdm_module_free(m);
    tdm_gpt_config bad = {.layers = 1, .heads = 3, .channels = 8, .context = 4, .vocab = 5};
    CHECK_ERROR(!tdm_gpt_new(&bad, tdm_cpu(0), NULL), "3 heads do not divide 8 channels");
    bad.heads = 2, bad.padded_vocab = 4;
    CHECK_ERROR(!tdm_gpt_new(&bad, tdm_cpu(0), NULL), "padded_vocab 4 is smaller than vocab 5");
}

/* Warm training steps take every block from the caching allocator (the attention scratch
 * included), and the weights file holds the tied tensor once. */
static void test_steady_state_and_weights_file(void) {
    tdm_module *m = fixture_model();
    if (!m) return;
    tdm_adam_opts ao = tdm_adamw_defaults();
    tdm_optim *opt = tdm_gpt_adamw_new(tdm_module_parameters(m), &ao);
    uint64_t before = 0;
    for (int s = 0; s < 6; s++) {
        if (s == 3) before = tdm_alloc_stats_get(tdm_cpu(0)).sys_allocs;
        tdm_scope_begin();
        tdm_optim_zero_grad(opt);
        tdm_tensor *loss = tdm_gpt_loss(tdm_gpt_forward(m, tokens(gf_idx)), tokens(gf_tgt));
        CHECK(loss && tdm_backward(loss) == 0 && tdm_optim_step(opt) == 0, "%s", tdm_last_error());
        tdm_scope_end();
    }
    uint64_t after = tdm_alloc_stats_get(tdm_cpu(0)).sys_allocs;
    CHECK(after == before, "%llu system allocations in 3 warm steps",
          (unsigned long long)(after - before));
    char path[256];
    snprintf(path, sizeof path, "%s/gpt.safetensors", tmpdir);
    CHECK(tdm_weights_save(path, m, NULL, 0) == 0, "%s", tdm_last_error());
    tdm_safetensors *f = tdm_safetensors_open(path);
    CHECK(f && tdm_safetensors_count(f) == 4 + 12 * GF_L &&
              tdm_safetensors_find(f, "transformer.wte.weight") >= 0 &&
              tdm_safetensors_find(f, "lm_head.weight") < 0,
          "weights file: %s", tdm_last_error());
    tdm_safetensors_close(f);
    tdm_optim_free(opt);
    tdm_module_free(m);
}

/* ---- llm.c files ------------------------------------------------------------------------ */

static size_t read_bytes(const char *path, unsigned char **out) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    *out = malloc((size_t)n + 4);
    size_t got = fread(*out, 1, (size_t)n, f);
    fclose(f);
    return got;
}

static void write_bytes(const char *path, const unsigned char *b, size_t n) {
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(b, 1, n, f);
        fclose(f);
    }
}

static void test_llmc_round_trip(void) {
    tdm_gpt_config cfg;
    tdm_module *m = tdm_gpt_load_llmc(LF_PATH, tdm_cpu(0), &cfg);
    CHECK(m != NULL, "load %s: %s", LF_PATH, tdm_last_error());
    if (!m) return;
    CHECK(cfg.context == LF_MAXT && cfg.vocab == LF_V && cfg.layers == LF_L && cfg.heads == LF_NH &&
              cfg.channels == LF_C && cfg.padded_vocab == LF_VP,
          "config %d %d %d %d %d %d", cfg.context, cfg.vocab, cfg.layers, cfg.heads, cfg.channels,
          cfg.padded_vocab);
    float *p = malloc(sizeof(float) * LF_N);
    CHECK(tdm_gpt_export_llmc(m, false, p, LF_N) == 0, "%s", tdm_last_error());
    CHECK(memcmp(p, lf_params, sizeof(float) * LF_N) == 0, "values differ from the file's");
    /* the qkv weight of layer 1 is where llm.c's order says (a spot check of the mapping) */
    tdm_tensor *qkvw1 = tdm_module_find(m, "transformer.h.1.attn.c_attn.weight");
    int64_t off = LF_VP * LF_C + LF_MAXT * LF_C + 2 * LF_L * LF_C + 3 * LF_C * LF_C;
    float *all = malloc(sizeof(float) * 3 * LF_C * LF_C);
    tdm_to_host(qkvw1, all, sizeof(float) * 3 * LF_C * LF_C);
    CHECK(all[0] == lf_params[off] && all[5] == lf_params[off + 5], "qkvw of layer 1");
    free(all);
    char out[256];
    snprintf(out, sizeof out, "%s/saved.bin", tmpdir);
    CHECK(tdm_gpt_save_llmc(out, m) == TDM_OK, "save: %s", tdm_last_error());
    unsigned char *a = NULL, *b = NULL;
    size_t na = read_bytes(LF_PATH, &a), nb = read_bytes(out, &b);
    CHECK(na == nb && na > 0 && memcmp(a, b, na) == 0,
          "saved file (%zu bytes) differs from the "
          "original (%zu bytes)",
          nb, na);
    free(a);
    free(b);
    free(p);
    tdm_module_free(m);
}

/* llm.c's bf16 file (version 5, written by gen_half_files.py with PyTorch's bf16 of the
 * version 3 fixture's values) loads to the v3 values rounded to bf16, and Tandem writes the
 * same file byte for byte from the v3 model. */
#define LF_V5_PATH "tests/fixtures/llmc/tiny_gpt2_v5.bin"
static void test_llmc_v5(void) {
    tdm_gpt_config cfg = {0};
    CHECK(tdm_gpt_llmc_config(LF_V5_PATH, &cfg) == TDM_OK && cfg.layers == LF_L &&
              cfg.padded_vocab == LF_VP,
          "v5 config: %s", tdm_last_error());
    tdm_module *m5 = tdm_gpt_load_llmc(LF_V5_PATH, tdm_cpu(0), &cfg);
    CHECK(m5 != NULL, "load %s: %s", LF_V5_PATH, tdm_last_error());
    float *p = malloc(sizeof(float) * LF_N), *want = malloc(sizeof(float) * LF_N);
    for (int i = 0; i < LF_N; i++) want[i] = tdm_bf16_to_float(tdm_bf16_from_float(lf_params[i]));
    CHECK(m5 && tdm_gpt_export_llmc(m5, false, p, LF_N) == 0 &&
              memcmp(p, want, sizeof(float) * LF_N) == 0,
          "v5 weights are the v3 weights rounded to bf16");
    CHECK(memcmp(want, lf_params, sizeof(float) * LF_N) != 0, "the rounding changed some");
    tdm_module *m3 = tdm_gpt_load_llmc(LF_PATH, tdm_cpu(0), NULL);
    char out[256];
    snprintf(out, sizeof out, "%s/saved_v5.bin", tmpdir);
    CHECK(m3 && tdm_gpt_save_llmc_as(out, m3, TDM_BF16) == TDM_OK, "save v5: %s", tdm_last_error());
    unsigned char *a = NULL, *b = NULL;
    size_t na = read_bytes(LF_V5_PATH, &a), nb = read_bytes(out, &b);
    CHECK(na == 1024 + 2 * LF_N && na == nb && memcmp(a, b, na) == 0,
          "the v5 file written (%zu bytes) is PyTorch's (%zu bytes)", nb, na);
    snprintf(out, sizeof out, "%s/saved_f32.bin", tmpdir);
    free(a);
    free(b);
    CHECK(m3 && tdm_gpt_save_llmc_as(out, m3, TDM_F32) == TDM_OK, "%s", tdm_last_error());
    na = read_bytes(LF_PATH, &a), nb = read_bytes(out, &b);
    CHECK(na == nb && memcmp(a, b, na) == 0, "TDM_F32 writes version 3");
    CHECK_ERROR(tdm_gpt_save_llmc_as(out, m3, TDM_F16) == TDM_ERR_DTYPE,
                "llm.c's files hold f32 (version 3) or bf16 (version 5), not f16");
    free(a);
    free(b);
    free(p);
    free(want);
    tdm_module_free(m3);
    tdm_module_free(m5);
}

/* Writes a copy of the fixture file with int32 field `field` set to v (or cut to size n when
 * field < 0) and checks that loading it fails with a message holding the path and want. */
static void check_bad(const char *name, int field, int32_t v, long size, const char *want) {
    unsigned char *b = NULL;
    size_t n = read_bytes(LF_PATH, &b);
    char path[256];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    if (field >= 0) memcpy(b + 4 * field, &v, 4);
    if (size >= 0) {
        if ((size_t)size > n) memset(b + n, 0, (size_t)size - n);
        n = (size_t)size;
    }
    write_bytes(path, b, n);
    free(b);
    tdm_module *m = tdm_gpt_load_llmc(path, tdm_cpu(0), NULL);
    CHECK(!m && strstr(tdm_last_error(), path) && strstr(tdm_last_error(), want), "%s: got \"%s\"",
          name, tdm_last_error());
    CHECK(tdm_last_status() == TDM_ERR_FORMAT, "%s: status %d", name, tdm_last_status());
    tdm_clear_error();
    tdm_module_free(m);
}

static void test_llmc_errors(void) {
    long full = 1024 + 4L * LF_N;
    check_bad("magic.bin", 0, 20240520, -1, "wrong magic 20240520 at byte offset 0");
    /* version 5 holds 2 bytes a parameter: the f32 file labelled 5 has twice the bytes */
    check_bad("bf16.bin", 1, 5, -1, "trailing bytes after the parameters");
    check_bad("bf16_short.bin", 1, 5, -1, "(1920 parameters, bf16, version 5) needs 4864");
    check_bad("version.bin", 1, 2, -1, "unsupported version 2 at byte offset 4");
    check_bad("version4.bin", 1, 4, -1, "unsupported version 4 at byte offset 4 (expected 3");
    check_bad("layers.bin", 4, 0, -1, "layers 0 at byte offset 16");
    check_bad("heads.bin", 5, 3, -1, "num_heads 3 (byte offset 20) does not divide channels 8");
    check_bad("padded.bin", 7, LF_V - 1, -1, "padded_vocab_size 9 (byte offset 28) is smaller");
    check_bad("huge.bin", 6, 1 << 30, -1, "channels 1073741824 at byte offset 24");
    check_bad("truncated.bin", -1, 0, full - 4, "truncated");
    check_bad("trailing.bin", -1, 0, full + 4, "trailing bytes");
    check_bad("header.bin", -1, 0, 100, "truncated header");
    check_bad("empty.bin", -1, 0, 0, "truncated header");
    CHECK_ERROR(!tdm_gpt_load_llmc("/nonexistent/model.bin", tdm_cpu(0), NULL),
                "cannot open '/nonexistent/model.bin'");
    tdm_module *lin = tdm_linear_new(2, 2, true, tdm_cpu(0), NULL);
    CHECK_ERROR(tdm_gpt_save_llmc("/tmp/x.bin", lin) != 0, "not a GPT");
    tdm_module_free(lin);
    tdm_gpt_config cfg = {.layers = 1, .heads = 1, .channels = 4, .context = 2, .vocab = 3};
    tdm_module *m = tdm_gpt_new(&cfg, tdm_cpu(0), NULL);
    CHECK_ERROR(tdm_gpt_save_llmc("/nonexistent/dir/m.bin", m) != 0, "/nonexistent/dir/m.bin");
    float x[4];
    CHECK_ERROR(tdm_gpt_import_llmc(m, x, 4) != 0, "the buffer holds 4 floats");
    tdm_module_free(m);
}

/* ---- data and the optimizer's groups ------------------------------------------------------ */

static void test_text_dataset(void) {
    char path[256];
    snprintf(path, sizeof path, "%s/text.txt", tmpdir);
    const char *text = "hello, GPT\n\xc3\xa9!";
    write_bytes(path, (const unsigned char *)text, strlen(text));
    tdm_dataset *ds = tdm_text_dataset_open(path, 4);
    CHECK(ds && ds->n == (int64_t)(strlen(text) - 1) / 4 && ds->num_classes == 256, "%s",
          tdm_last_error());
    if (ds) {
        int64_t x[4], y[4];
        CHECK(ds->ops->get(ds, 2, x, y) == 0, "get");
        CHECK(x[0] == 'P' && x[3] == 0xc3 && y[0] == 'T' && y[3] == 0xa9, "window 2: %lld %lld",
              (long long)x[0], (long long)y[3]);
        CHECK_ERROR(ds->ops->get(ds, ds->n, x, y) != 0, "index");
    }
    tdm_dataset_free(ds);
    CHECK_ERROR(!tdm_text_dataset_open(path, 64), "too few for one window of context 64");
    CHECK_ERROR(!tdm_text_dataset_open("/nonexistent.txt", 4), "/nonexistent.txt");
}

static void test_weight_decay_groups(void) {
    tdm_module *lin = tdm_linear_new(3, 2, true, tdm_cpu(0), NULL);
    tdm_paramset *ps = tdm_module_parameters(lin);
    tdm_adam_opts ao = tdm_adamw_defaults();
    ao.lr = 0.5f, ao.weight_decay = 0.2f;
    tdm_optim *o = tdm_gpt_adamw_new(ps, &ao);
    float w0[6], b0[2], w1[6], b1[2];
    tdm_to_host(ps->params[0], w0, sizeof w0);
    tdm_to_host(ps->params[1], b0, sizeof b0);
    tdm_optim_zero_grad(o); /* zero gradients: only weight decay moves anything */
    CHECK(tdm_optim_step(o) == 0, "%s", tdm_last_error());
    tdm_to_host(ps->params[0], w1, sizeof w1);
    tdm_to_host(ps->params[1], b1, sizeof b1);
    for (int i = 0; i < 6; i++) CHECK_CLOSE(w1[i], w0[i] * (1 - 0.5 * 0.2), 1e-7, 1e-6);
    for (int i = 0; i < 2; i++) CHECK(b1[i] == b0[i], "bias %d decayed", i);
    float bad[2] = {0.1f, -1.0f};
    CHECK_ERROR(tdm_optim_set_weight_decays(o, bad) != 0, "invalid weight_decay value -1 for bias");
    tdm_optim_free(o);
    tdm_module_free(lin);
}

int main(void) {
    if (tmpdir_make("test_gpt") != 0) return 1;
    test_attention_forward();
    test_attention_blocks();
    test_attention_gradcheck();
    test_attention_errors();
    test_block_gradcheck();
    test_model_gradcheck();
    test_fixture_gradients();
    test_fixture_adamw();
    test_tying_and_clone();
    test_steady_state_and_weights_file();
    test_llmc_round_trip();
    test_llmc_v5();
    test_llmc_errors();
    test_text_dataset();
    test_weight_decay_groups();
    tmpdir_remove();
    return check_summary();
}
