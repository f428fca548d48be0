/* GPT-2 built from the library's modules (see include/tandem/gpt.h for the names and math).
 *
 * Every layer is an ordinary child module, so the flat parameter buffer, cloning for
 * replicas and checkpoints need nothing special. Forwards look their children up by
 * position at run time (never through cached pointers), which is what lets
 * tdm_module_clone copy a GPT like any other tree. The tied LM head is the token
 * embedding's own tensor, read twice by the tape: its gradient is the sum of both uses.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/ops.h"
#include "backend/backend.h"
#include "tandem/autograd.h"
#include "models_internal.h"
#include "tandem/gpt.h"
#include "tandem/parallel.h"

/* Child indices, in registration order (which is also the flat buffer's order). */
enum { TR_WTE, TR_WPE, TR_H, TR_LNF };               /* transformer.* */
enum { BL_LN1, BL_ATTN, BL_LN2, BL_MLP };            /* transformer.h.<l>.* */
enum { AT_C_ATTN, AT_C_PROJ };                       /* attn.* */
enum { MLP_C_FC, MLP_GELU, MLP_C_PROJ, MLP_N_KIDS }; /* mlp.* */

/* The GPT module's settings: its config first (tdm_gpt_config_of), then tdm_gpt_parallelize's
 * group and whether the tokens are split between the tensor-parallel layers. */
typedef struct {
    tdm_gpt_config c;
    tdm_group *tp;
    bool seq, vocab; /* tdm_gpt_tp_plan's */
    /* vocabulary-parallel: what this rank adds to its columns of the logits, 0 or -1e30 where
     * a column is padding (made once by tdm_gpt_parallelize; NULL: no padding here). A split
     * GPT is never cloned, so no copy of the settings shares it. */
    tdm_tensor *pad;
} gpt_state;

static void destroy_impl(tdm_module *m) {
    free(m->impl);
    m->impl = NULL;
}

static void destroy_gpt(tdm_module *m) {
    gpt_state *st = m->impl;
    if (st) tdm_tensor_free(st->pad);
    destroy_impl(m);
}

/* ---- forwards ---------------------------------------------------------------------------- */

/* x [B, T, C] -> [B, T, C]: qkv = c_attn(x) [B, T, 3C], causal attention, c_proj */
static tdm_tensor *attn_forward(tdm_module *m, tdm_tensor *x) {
    int heads = *(const int *)m->impl;
    tdm_tensor *qkv = tdm_module_forward(m->children[AT_C_ATTN], x);
    return tdm_module_forward(m->children[AT_C_PROJ], tdm_causal_attention(qkv, heads));
}

/* A module this file's MLP may run inside a fused op rather than through its forward: no hooks
 * or recomputation of its own. */
static bool plain(const tdm_module *k) {
    return !k->pre_hook && !k->post_hook && !k->recompute;
}

/* Whether c_fc and the GELU can run as one op (tdm_linear_gelu: on a GPU the GELU in the
 * product's epilogue): c_fc a plain Linear with a bias (not tensor-parallel's), the GELU the
 * tanh one this file makes. */
static bool fuses_gelu(const tdm_module *fc, const tdm_module *gelu) {
    return plain(fc) && plain(gelu) && !strcmp(fc->ops->kind, "Linear") && fc->n_params == 2 &&
           !strcmp(gelu->ops->kind, "GELU") && gelu->impl && *(const bool *)gelu->impl;
}

/* x [B, T, C] -> [B, T, 4C] -> GELU -> [B, T, C]; with c_proj a plain Linear too, the whole MLP
 * as one op (tdm_linear_gelu_linear: on a GPU GELU's gradient in c_proj's backward product) */
static tdm_tensor *mlp_forward(tdm_module *m, tdm_tensor *x) {
    tdm_module *fc = m->children[MLP_C_FC], *gelu = m->children[MLP_GELU];
    tdm_module *proj = m->children[MLP_C_PROJ];
    if (!fuses_gelu(fc, gelu))
        return tdm_module_forward(proj, tdm_module_forward(gelu, tdm_module_forward(fc, x)));
    if (plain(proj) && !strcmp(proj->ops->kind, "Linear"))
        return tdm_linear_gelu_linear(x, fc->params[0], fc->params[1], proj->params[0],
                                      proj->n_params > 1 ? proj->params[1] : NULL);
    x = tdm_linear_gelu(x, fc->params[0], fc->params[1]);
    return x ? tdm_module_forward(proj, x) : NULL;
}

static const tdm_module_ops seq_norm_ops; /* tensor parallelism's layer norm, below */

/* ln(x) for a product that casts it, or with r, ln(x + r) and the sum in *sum (the residual
 * add before the norm, one kernel where ln is a plain LayerNorm: tdm_add_layer_norm). Under
 * autocast in bf16 or f16, where ln is a plain LayerNorm and next (plain too) hands it to
 * first, a plain Linear (both NULL: the tied head's product), the norm writes that dtype
 * itself (tdm_layer_norm_to: the bits of the norm and then the product's cast, one pass fewer
 * each way); else ln's forward. Not where the input crosses ranks first (tensor parallelism),
 * whose collectives would then run in bf16. */
static tdm_tensor *norm_for(tdm_module *ln, const tdm_module *next, const tdm_module *first,
                            tdm_tensor *x, tdm_tensor *r, tdm_tensor **sum) {
    const bool layer = plain(ln) && ln->ops != &seq_norm_ops && !strcmp(ln->ops->kind, "LayerNorm");
    if (r && !layer) x = *sum = tdm_add(x, r), r = NULL;
    if (!x || !layer) return tdm_module_forward(ln, x);
    tdm_dtype low = tdm_autocast_dtype();
    tdm_tensor *w = ln->n_params ? ln->params[0] : NULL, *b = ln->n_params ? ln->params[1] : NULL;
    const float eps = *(const float *)ln->impl;
    if (low == TDM_F32 ||
        (next && (!plain(next) || !plain(first) || strcmp(first->ops->kind, "Linear"))))
        return r ? tdm_add_layer_norm(x, r, sum, 1, w, b, eps) : tdm_module_forward(ln, x);
    return r ? tdm_add_layer_norm_to(x, r, sum, 1, w, b, eps, low)
             : tdm_layer_norm_to(x, 1, w, b, eps, low);
}

/* Pre-LayerNorm residual block from the stream x and the last block's MLP output *pend (NULL:
 * none) not yet added to it: s = x + *pend, s2 = s + attn(ln_1(s)), *pend = mlp(ln_2(s2)),
 * returning s2. Each add runs in the norm after it (norm_for); the last block's goes to ln_f. */
static tdm_tensor *block_chain(tdm_module *m, tdm_tensor *x, tdm_tensor **pend) {
    tdm_module **k = m->children, *attn = k[BL_ATTN], *mlp = k[BL_MLP];
    tdm_tensor *r = *pend;
    *pend = NULL;
    tdm_tensor *h = norm_for(k[BL_LN1], attn, attn->children[AT_C_ATTN], x, r, &x);
    tdm_tensor *a = h ? tdm_module_forward(attn, h) : NULL;
    h = a ? norm_for(k[BL_LN2], mlp, mlp->children[MLP_C_FC], x, a, &x) : NULL;
    *pend = h ? tdm_module_forward(mlp, h) : NULL;
    return *pend ? x : NULL;
}

/* x + attn(ln_1(x)), then + mlp(ln_2(.)) */
static tdm_tensor *block_forward(tdm_module *m, tdm_tensor *x) {
    tdm_tensor *pend = NULL;
    x = block_chain(m, x, &pend);
    return x ? tdm_add(x, pend) : NULL;
}

static tdm_tensor *no_forward(tdm_module *m, tdm_tensor *x) {
    return tdm_raise_null(TDM_ERR_STATE, "%s: a container of the GPT, not called on its own",
                          m->ops->kind);
}

static const tdm_module_ops attn_ops = {"CausalSelfAttention", attn_forward, destroy_impl};
static const tdm_module_ops mlp_ops = {"MLP", mlp_forward, NULL};
static const tdm_module_ops block_ops = {"Block", block_forward, NULL};
static const tdm_module_ops dict_ops = {"ModuleDict", no_forward, NULL};

static tdm_tensor *gpt_module_forward(tdm_module *m, tdm_tensor *idx);
static const tdm_module_ops gpt_ops = {"GPT", gpt_module_forward, destroy_gpt};

/* The tied head over this rank's rows [r Vp/n, (r+1) Vp/n) of wte: its columns of the logits,
 * [B, T, Vp/n], the padding rows' (>= V) pushed to -1e30 so that no softmax counts them. x is
 * every rank's whole (the sum of the parts' input gradients), or its tokens under sequence
 * parallelism (gathered; the gradient reduce-scattered). */
static tdm_tensor *vocab_head(const gpt_state *st, tdm_tensor *x, tdm_tensor *wte) {
    x = st->seq ? tdm_tp_seq_gather(st->tp, x, 1, true) : tdm_tp_copy(st->tp, x);
    tdm_tensor *logits = tdm_linear(x, wte, NULL);
    return st->pad && logits ? tdm_add(logits, st->pad) : logits;
}

tdm_tensor *tdm_gpt_padding_mask(const tdm_gpt_config *c, int64_t k, int64_t lo, tdm_device dev,
                                 int *rc) {
    *rc = TDM_OK;
    if (lo + k <= c->vocab) return NULL;
    float *pad = malloc(sizeof *pad * (size_t)k);
    if (!pad) return *rc = tdm_raise(TDM_ERR_NOMEM, "gpt: out of memory"), NULL;
    for (int64_t j = 0; j < k; j++) pad[j] = lo + j < c->vocab ? 0.0f : -1e30f;
    tdm_tensor *mask = tdm_from_data(TDM_SHAPE(k), TDM_F32, dev, pad);
    free(pad);
    if (!mask) *rc = tdm_last_status();
    return mask ? tdm_scope_keep(mask) : NULL;
}

/* idx [B, T] -> logits [B, T, V] */
static tdm_tensor *gpt_module_forward(tdm_module *m, tdm_tensor *idx) {
    const gpt_state *st = m->impl;
    const tdm_gpt_config *c = &st->c;
    tdm_module *tr = m->children[0], *h = tr->children[TR_H];
    tdm_tensor *wte = tr->children[TR_WTE]->params[0], *wpe = tr->children[TR_WPE]->params[0];
    char b[96];
    if (idx->ndim != 2)
        return tdm_raise_null(TDM_ERR_SHAPE, "gpt: tokens must be [B, T], got %s",
                              tdm_shape_str(tdm_shape_of(idx), b));
    int64_t T = idx->shape[1];
    if (T < 1 || T > c->context)
        return tdm_raise_null(TDM_ERR_SHAPE,
                              "gpt: sequence length %lld is not in [1, %d] (context)", (long long)T,
                              c->context);
    /* x [B, T, C] = wte[idx] + wpe[0..T) (broadcast over B): the positions' rows as a slice,
     * not an embedding of arange(T), which a GPU would copy from the host every step */
    tdm_tensor *tok = st->vocab ? tdm_tp_embedding(st->tp, wte, idx) : tdm_embedding(wte, idx);
    tdm_tensor *x = tdm_add(tok, tdm_slice(wpe, 0, 0, T, 1));
    /* sequence parallelism: each rank's tokens only between the tensor-parallel layers */
    if (st->seq) x = tdm_tp_seq_shard(st->tp, x, 1);
    /* a block run as its forward would (plain: no hooks, no recomputation) hands its last add
     * to the next block's ln_1, or ln_f's, to run in the norm's kernel (pend) */
    tdm_tensor *pend = NULL;
    for (int l = 0; l < h->n_children && x; l++) {
        tdm_module *blk = h->children[l];
        if (blk->ops == &block_ops && plain(blk)) {
            x = block_chain(blk, x, &pend);
            continue;
        }
        if (pend) x = tdm_add(x, pend), pend = NULL;
        x = tdm_module_forward(blk, x);
    }
    if (!x) return NULL;
    /* the tied head below is a product of the rank's whole x */
    tdm_module *lnf = tr->children[TR_LNF];
    tdm_tensor *sum; /* the stream's last sum: the head reads only its norm */
    if (st->vocab || st->seq)
        x = tdm_module_forward(lnf, pend ? tdm_add(x, pend) : x);
    else
        x = norm_for(lnf, NULL, NULL, x, pend, &sum);
    if (st->vocab) return vocab_head(st, x, wte);
    if (st->seq) x = tdm_tp_seq_gather(st->tp, x, 1, false); /* the head runs whole everywhere */
    /* the tied head: logits = x @ wte[:V]^T (a row view: the padding rows are never read).
     * Without padding the leaf itself is used, so its gradient GEMM accumulates straight into
     * the flat gradient buffer. */
    tdm_tensor *head = c->vocab == c->padded_vocab ? wte : tdm_slice(wte, 0, 0, c->vocab, 1);
    return tdm_linear(x, head, NULL);
}

tdm_tensor *tdm_gpt_forward(tdm_module *m, const tdm_tensor *idx) {
    if (!tdm_gpt_config_of(m)) return tdm_raise_null(TDM_ERR_ARG, "gpt_forward: not a GPT module");
    return tdm_module_forward(m, (tdm_tensor *)idx);
}

tdm_tensor *tdm_gpt_loss(tdm_tensor *logits, const tdm_tensor *targets) {
    if (!logits || !targets) {
        if (tdm_last_status() == TDM_OK) tdm_raise(TDM_ERR_ARG, "gpt_loss: NULL input");
        return NULL;
    }
    char a[96], b[96];
    if (logits->ndim != 3 || targets->ndim != 2 || targets->shape[0] != logits->shape[0] ||
        targets->shape[1] != logits->shape[1])
        return tdm_raise_null(TDM_ERR_SHAPE,
                              "gpt_loss: logits %s and targets %s must be [B, T, V] "
                              "and [B, T]",
                              tdm_shape_str(tdm_shape_of(logits), a),
                              tdm_shape_str(tdm_shape_of(targets), b));
    int64_t n = logits->shape[0] * logits->shape[1];
    tdm_tensor *flat = tdm_reshape(logits, TDM_SHAPE(n, logits->shape[2]));
    tdm_tensor *tg = tdm_reshape((tdm_tensor *)targets, TDM_SHAPE(n));
    return tdm_cross_entropy(flat, tg, NULL);
}

tdm_tensor *tdm_gpt_whole_logits(tdm_module *m, tdm_tensor *logits) {
    const gpt_state *st = tdm_gpt_config_of(m) ? m->impl : NULL;
    if (!st) return tdm_raise_null(TDM_ERR_ARG, "gpt_whole_logits: not a GPT");
    if (!logits) return tdm_null_input("gpt_whole_logits");
    if (!st->vocab) return logits;
    /* every rank's columns in rank order: [B, T, Vp], then the padding cut off */
    tdm_tensor *all = tdm_tp_gather(st->tp, logits);
    return all ? tdm_slice(all, all->ndim - 1, 0, st->c.vocab, 1) : NULL;
}

tdm_tensor *tdm_gpt_loss_of(tdm_module *m, tdm_tensor *logits, const tdm_tensor *targets) {
    const gpt_state *st = tdm_gpt_config_of(m) ? m->impl : NULL;
    bool stage = false; /* or a pipeline's last stage (tdm_gpt_parallelize_stage) */
    tdm_group *vg = st ? st->tp : tdm_gpt_stage_vocab_group(m, &stage);
    if (!st && !stage) return tdm_raise_null(TDM_ERR_ARG, "gpt_loss_of: not a GPT");
    if (st ? !st->vocab : !vg) return tdm_gpt_loss(logits, targets);
    if (!logits || !targets) return tdm_null_input("gpt_loss_of");
    if (logits->ndim != 3 || targets->ndim != 2)
        return tdm_raise_null(TDM_ERR_SHAPE, "gpt_loss_of: logits must be [B, T, V/n], targets "
                                             "[B, T]");
    int64_t n = logits->shape[0] * logits->shape[1];
    return tdm_tp_cross_entropy(vg, tdm_reshape(logits, TDM_SHAPE(n, logits->shape[2])),
                                tdm_reshape((tdm_tensor *)targets, TDM_SHAPE(n)));
}

const tdm_gpt_config *tdm_gpt_config_of(const tdm_module *m) {
    return m && m->ops == &gpt_ops ? m->impl : NULL;
}

/* ---- construction ------------------------------------------------------------------------ */

static tdm_module *container(const tdm_module_ops *ops, tdm_device dev, const void *impl,
                             size_t n) {
    void *copy = NULL;
    if (n && !(copy = malloc(n))) return tdm_raise_null(TDM_ERR_NOMEM, "gpt: out of memory");
    if (n) memcpy(copy, impl, n);
    tdm_module *m = tdm_module_new(ops, dev, copy);
    if (!m) {
        free(copy);
        return NULL;
    }
    m->impl_size = n;
    return m;
}

/* Adds child under name; on failure frees child. Returns the status. */
static int add(tdm_module *parent, const char *name, tdm_module *child) {
    if (!parent || !child) {
        tdm_module_free(child);
        return tdm_last_status() ? tdm_last_status() : TDM_ERR_ARG;
    }
    int rc = tdm_module_add(parent, name, child);
    if (rc) tdm_module_free(child);
    return rc;
}

static tdm_module *linear(int64_t in, int64_t out, float std, const tdm_gpt_config *c,
                          tdm_device dev, tdm_rng *rng) {
    tdm_module *m = tdm_linear_new(in, out, true, dev, rng);
    if (m && (tdm_normal_(m->params[0], 0.0f, std, rng) || tdm_fill_(m->params[1], 0.0f))) {
        tdm_module_free(m);
        return NULL;
    }
    return m;
}

static tdm_module *block_new(const tdm_gpt_config *c, tdm_device dev, tdm_rng *rng) {
    int64_t C = c->channels;
    float std = 0.02f, proj_std = 0.02f / sqrtf(2.0f * (float)c->layers);
    tdm_module *b = container(&block_ops, dev, NULL, 0);
    tdm_module *at = container(&attn_ops, dev, &c->heads, sizeof c->heads);
    tdm_module *mlp = container(&mlp_ops, dev, NULL, 0);
    int rc = add(at, "c_attn", linear(C, 3 * C, std, c, dev, rng));
    if (!rc) rc = add(at, "c_proj", linear(C, C, proj_std, c, dev, rng));
    if (!rc) rc = add(mlp, "c_fc", linear(C, 4 * C, std, c, dev, rng));
    if (!rc) rc = add(mlp, "gelu", tdm_gelu_new(true));
    if (!rc) rc = add(mlp, "c_proj", linear(4 * C, C, proj_std, c, dev, rng));
    if (!rc) rc = add(b, "ln_1", tdm_layer_norm_new(C, 1e-5f, true, dev));
    if (!rc)
        rc = add(b, "attn", at);
    else
        tdm_module_free(at);
    if (!rc) rc = add(b, "ln_2", tdm_layer_norm_new(C, 1e-5f, true, dev));
    if (!rc)
        rc = add(b, "mlp", mlp);
    else
        tdm_module_free(mlp);
    if (rc) {
        tdm_module_free(b);
        return NULL;
    }
    return b;
}

static tdm_module *embedding(int64_t num, int64_t rows_drawn, int64_t dim, tdm_device dev,
                             tdm_rng *rng) {
    tdm_module *m = tdm_embedding_new(num, dim, dev, rng);
    if (!m) return NULL;
    tdm_tensor *w = m->params[0];
    /* N(0, 0.02) for the real rows, 0 for padding (as llm.c writes padded rows) */
    tdm_tensor *real = tdm_slice(w, 0, 0, rows_drawn, 1), *pad = NULL;
    int rc = real ? tdm_normal_(real, 0.0f, 0.02f, rng) : tdm_last_status();
    tdm_drop_temp(real, NULL);
    if (!rc && rows_drawn < num) {
        pad = tdm_slice(w, 0, rows_drawn, num, 1);
        rc = pad ? tdm_fill_(pad, 0.0f) : tdm_last_status();
        tdm_drop_temp(pad, NULL);
    }
    if (rc) {
        tdm_module_free(m);
        return NULL;
    }
    return m;
}

static int check_config(const tdm_gpt_config *c) {
    if (!c) return tdm_raise(TDM_ERR_ARG, "gpt_new: config is NULL");
    if (c->layers < 1 || c->heads < 1 || c->channels < 1 || c->context < 1 || c->vocab < 1 ||
        c->padded_vocab < 0)
        return tdm_raise(TDM_ERR_ARG,
                         "gpt_new: sizes must be positive: layers %d heads %d channels %d "
                         "context %d vocab %d padded_vocab %d",
                         c->layers, c->heads, c->channels, c->context, c->vocab, c->padded_vocab);
    if (c->channels % c->heads)
        return tdm_raise(TDM_ERR_ARG, "gpt_new: %d heads do not divide %d channels", c->heads,
                         c->channels);
    if (c->padded_vocab && c->padded_vocab < c->vocab)
        return tdm_raise(TDM_ERR_ARG, "gpt_new: padded_vocab %d is smaller than vocab %d",
                         c->padded_vocab, c->vocab);
    return TDM_OK;
}

/* The transformer.* container: wte, wpe, h.<l>, ln_f. */
static tdm_module *transformer_new(const tdm_gpt_config *c, tdm_device dev, tdm_rng *rng) {
    tdm_module *tr = container(&dict_ops, dev, NULL, 0);
    tdm_module *h = container(&dict_ops, dev, NULL, 0);
    int rc = add(tr, "wte", embedding(c->padded_vocab, c->vocab, c->channels, dev, rng));
    if (!rc) rc = add(tr, "wpe", embedding(c->context, c->context, c->channels, dev, rng));
    for (int l = 0; !rc && l < c->layers; l++) rc = add(h, NULL, block_new(c, dev, rng));
    if (!rc)
        rc = add(tr, "h", h);
    else
        tdm_module_free(h);
    if (!rc) rc = add(tr, "ln_f", tdm_layer_norm_new(c->channels, 1e-5f, true, dev));
    if (rc) {
        tdm_module_free(tr);
        return NULL;
    }
    return tr;
}

tdm_module *tdm_gpt_new(const tdm_gpt_config *cfg, tdm_device dev, tdm_rng *rng) {
    if (check_config(cfg)) return NULL;
    tdm_gpt_config c = *cfg;
    if (!c.padded_vocab) c.padded_vocab = c.vocab;
    if (!rng) rng = tdm_default_rng();
    bool prev = tdm_set_grad_enabled(false);
    gpt_state st = {c, NULL, false, false, NULL};
    tdm_module *m = container(&gpt_ops, dev, &st, sizeof st);
    int rc = add(m, "transformer", transformer_new(&c, dev, rng));
    tdm_set_grad_enabled(prev);
    if (rc) {
        tdm_module_free(m);
        return NULL;
    }
    return m;
}

/* ---- tensor parallelism ------------------------------------------------------------------- */

/* A layer norm between the split layers under sequence parallelism: it sees this rank's tokens
 * only, so its weight and bias enter through tp_copy, which sums their gradients over the
 * ranks in backward: each rank then holds the whole gradient, as without. impl: the group (not
 * owned; a copy would share it, so it cannot be cloned). */
static tdm_tensor *seq_norm_forward(tdm_module *m, tdm_tensor *x) {
    tdm_group *tp = m->impl;
    return tdm_layer_norm(x, 1, tdm_tp_copy(tp, m->params[0]), tdm_tp_copy(tp, m->params[1]),
                          1e-5f);
}

static const tdm_module_ops seq_norm_ops = {"LayerNorm", seq_norm_forward, NULL};

/* A sequence-parallel copy of layer norm ln (the GPT's: weight, bias, eps 1e-5). */
static tdm_module *seq_norm_from(const tdm_module *ln, tdm_group *tp) {
    tdm_module *m = tdm_module_new(&seq_norm_ops, ln->device, tp);
    bool grad = tdm_set_grad_enabled(false);
    int rc = m ? tdm_module_add_param(m, "weight", tdm_clone(ln->params[0])) : tdm_last_status();
    if (!rc) rc = tdm_module_add_param(m, "bias", tdm_clone(ln->params[1]));
    tdm_set_grad_enabled(grad);
    if (rc) tdm_module_free(m);
    return rc ? NULL : m;
}

/* parent's child i becomes repl (the old one freed); the error of a NULL repl otherwise. */
static int replace(tdm_module *parent, int i, tdm_module *repl) {
    if (!repl) return tdm_last_status();
    tdm_module_free(parent->children[i]);
    parent->children[i] = repl;
    return TDM_OK;
}

/* Block b (block l of a GPT with `heads` heads) split over tp: attention by heads, the MLP
 * column then row; with seq, sequence-parallel (its layers and layer norms). */
static int split_block(tdm_module *b, int l, int heads, bool seq, tdm_group *tp) {
    tdm_module *at = b->children[BL_ATTN], *mlp = b->children[BL_MLP];
    if (strcmp(at->children[AT_C_ATTN]->ops->kind, "Linear") != 0)
        return tdm_raise(TDM_ERR_STATE, "gpt_parallelize: block %d is already split", l);
    /* q, k and v of this rank's heads; their outputs' columns of the projection */
    int rc = replace(at, AT_C_ATTN, tdm_column_linear_from(at->children[AT_C_ATTN], 3, false, tp));
    if (!rc) rc = replace(at, AT_C_PROJ, tdm_row_linear_from(at->children[AT_C_PROJ], true, tp));
    if (!rc) *(int *)at->impl = heads / tdm_group_size(tp);
    if (!rc)
        rc = replace(mlp, MLP_C_FC, tdm_column_linear_from(mlp->children[MLP_C_FC], 1, false, tp));
    if (!rc)
        rc = replace(mlp, MLP_C_PROJ, tdm_row_linear_from(mlp->children[MLP_C_PROJ], true, tp));
    tdm_module *split[4] = {at->children[AT_C_ATTN], at->children[AT_C_PROJ],
                            mlp->children[MLP_C_FC], mlp->children[MLP_C_PROJ]};
    for (int k = 0; k < 4 && !rc && seq; k++)
        rc = tdm_tp_linear_set_sequence_dim(split[k], 1); /* [B, T, C]: T */
    for (int k = BL_LN1; k <= BL_LN2 && !rc && seq; k += BL_LN2 - BL_LN1)
        rc = replace(b, k, seq_norm_from(b->children[k], tp));
    return rc;
}

int tdm_gpt_parallelize_stage(tdm_module *stage, tdm_group *tp, const tdm_gpt_tp_plan *plan) {
    if (!stage || !tp || strcmp(stage->ops->kind, "Sequential") != 0)
        return tdm_raise(TDM_ERR_ARG, "gpt_parallelize_stage: %s",
                         tp ? "not a Sequential of a GPT's layers" : "NULL group");
    bool seq = plan && plan->sequence_parallel, vocab = plan && plan->vocab_parallel;
    if (stage->paramset)
        return tdm_raise(TDM_ERR_STATE, "gpt_parallelize_stage: the stage's parameters are "
                                        "already listed (tdm_module_parameters): split it before");
    int rc = TDM_OK;
    for (int i = 0; i < stage->n_children && !rc; i++) {
        tdm_module *b = stage->children[i];
        /* the embeddings and the head stay whole; with the sequence split, the embeddings
         * hand on this rank's tokens and the head's ln_f sees them */
        int end = seq || vocab ? tdm_gpt_end_split(b, tp, seq, vocab) : 0;
        if (end < 0) rc = end;
        if (end == 2 && seq) rc = replace(b, 0, seq_norm_from(b->children[0], tp));
        if (strcmp(b->ops->kind, "Block") != 0) continue;
        int heads = *(const int *)b->children[BL_ATTN]->impl, n = tdm_group_size(tp);
        int64_t C = b->children[BL_LN1]->params[0]->shape[0];
        if (heads % n || (4 * C) % n)
            return tdm_raise(TDM_ERR_ARG,
                             "gpt_parallelize_stage: %d heads do not split over %d "
                             "ranks",
                             heads, n);
        rc = split_block(b, i, heads, seq, tp);
    }
    return rc;
}

int tdm_gpt_parallelize(tdm_module *m, tdm_group *tp, const tdm_gpt_tp_plan *plan) {
    const tdm_gpt_config *c = tdm_gpt_config_of(m);
    tdm_gpt_tp_plan none = {false, false};
    if (!plan) plan = &none;
    bool sequence_parallel = plan->sequence_parallel;
    if (!c || !tp)
        return tdm_raise(TDM_ERR_ARG, "gpt_parallelize: %s", c ? "NULL group" : "not a GPT");
    if (m->paramset)
        return tdm_raise(TDM_ERR_STATE, "gpt_parallelize: the GPT's parameters are already "
                                        "listed (tdm_module_parameters): split it before");
    int n = tdm_group_size(tp);
    if (c->heads % n || (4 * (int64_t)c->channels) % n)
        return tdm_raise(TDM_ERR_ARG, "gpt_parallelize: %d heads do not split over %d ranks",
                         c->heads, n);
    if (plan->vocab_parallel && c->padded_vocab % n)
        return tdm_raise(TDM_ERR_ARG,
                         "gpt_parallelize: the %d rows of wte (padded_vocab) do not "
                         "split over %d ranks",
                         c->padded_vocab, n);
    tdm_module *h = m->children[0]->children[TR_H];
    int rc = TDM_OK;
    for (int l = 0; l < h->n_children && !rc; l++)
        rc = split_block(h->children[l], l, c->heads, sequence_parallel, tp);
    tdm_module *tr = m->children[0];
    if (!rc && sequence_parallel) rc = replace(tr, TR_LNF, seq_norm_from(tr->children[TR_LNF], tp));
    if (!rc && plan->vocab_parallel)
        rc = replace(tr, TR_WTE, tdm_vocab_embedding_from(tr->children[TR_WTE], tp));
    gpt_state *st = m->impl;
    if (!rc && plan->vocab_parallel) {
        int64_t k = c->padded_vocab / n;
        st->pad = tdm_gpt_padding_mask(c, k, k * tdm_group_rank(tp), m->device, &rc);
    }
    if (!rc) st->tp = tp, st->seq = sequence_parallel, st->vocab = plan->vocab_parallel;
    return rc;
}

/* ---- the optimizer ----------------------------------------------------------------------- */

tdm_optim *tdm_gpt_adamw_new(tdm_paramset *ps, const tdm_adam_opts *o) {
    tdm_optim *opt = tdm_adamw_new(ps, o);
    if (opt && tdm_optim_decay_matrices_only(opt, o->weight_decay)) {
        tdm_optim_free(opt);
        return NULL;
    }
    return opt;
}

/* ---- llm.c's layout ---------------------------------------------------------------------- */

#define LLMC_KINDS 16

/* llm.c's tensor `kind` of layer l (ignored for the per-model kinds 0, 1, 14, 15). */
static tdm_tensor *llmc_tensor(tdm_module *m, int kind, int l) {
    tdm_module *tr = m->children[0];
    if (kind == 0) return tr->children[TR_WTE]->params[0];
    if (kind == 1) return tr->children[TR_WPE]->params[0];
    if (kind >= 14) return tr->children[TR_LNF]->params[kind - 14];
    tdm_module *b = tr->children[TR_H]->children[l];
    tdm_module *at = b->children[BL_ATTN], *mlp = b->children[BL_MLP];
    switch (kind) {
    case 2:
    case 3:
        return b->children[BL_LN1]->params[kind - 2];
    case 4:
    case 5:
        return at->children[AT_C_ATTN]->params[kind - 4];
    case 6:
    case 7:
        return at->children[AT_C_PROJ]->params[kind - 6];
    case 8:
    case 9:
        return b->children[BL_LN2]->params[kind - 8];
    case 10:
    case 11:
        return mlp->children[MLP_C_FC]->params[kind - 10];
    default:
        return mlp->children[MLP_C_PROJ]->params[kind - 12];
    }
}

static bool per_layer(int kind) {
    return kind >= 2 && kind < 14;
}

int64_t tdm_gpt_llmc_numel(const tdm_gpt_config *c) {
    if (!c || c->layers < 1 || c->channels < 1 || c->context < 1 || c->vocab < 1) return 0;
    int64_t C = c->channels, L = c->layers, Vp = c->padded_vocab ? c->padded_vocab : c->vocab;
    /* wte, wpe, then per layer: 2 LN (4C) + qkv (3C*C + 3C) + proj (C*C + C) + fc (4C*C + 4C)
     * + fcproj (4C*C + C), then ln_f (2C); 0 past 64 bits (a hostile file's header) */
    int64_t layer, all, wpe;
    if (__builtin_mul_overflow(12 * C, C, &layer) ||
        __builtin_add_overflow(layer, 13 * C, &layer) || __builtin_mul_overflow(L, layer, &all) ||
        __builtin_mul_overflow(Vp, C, &wpe) || __builtin_add_overflow(all, wpe, &all) ||
        __builtin_mul_overflow((int64_t)c->context, C, &wpe) ||
        __builtin_add_overflow(all, wpe + 2 * C, &all))
        return 0;
    return all;
}

/* Walks llm.c's order, calling fn on each tensor with its offset in the flat array. */
static int llmc_walk(tdm_module *m, float *buf, int64_t n, bool grads, bool import) {
    const tdm_gpt_config *c = tdm_gpt_config_of(m);
    const char *op = import ? "gpt_import_llmc" : "gpt_export_llmc";
    if (!c) return tdm_raise(TDM_ERR_ARG, "%s: not a GPT module", op);
    if (((const gpt_state *)c)->tp)
        return tdm_raise(TDM_ERR_STATE,
                         "%s: a tensor-parallel GPT holds parts of its weights "
                         "(tdm_gpt_parallelize); llm.c's layout needs them whole",
                         op);
    if (!buf || n != tdm_gpt_llmc_numel(c))
        return tdm_raise(TDM_ERR_ARG, "%s: the buffer holds %lld floats, the model %lld", op,
                         (long long)n, (long long)tdm_gpt_llmc_numel(c));
    int64_t off = 0;
    for (int kind = 0; kind < LLMC_KINDS; kind++)
        for (int l = 0; l < (per_layer(kind) ? c->layers : 1); l++) {
            tdm_tensor *t = llmc_tensor(m, kind, l);
            const tdm_backend *be = tdm_backend_for(t->device);
            int64_t k = tdm_numel(t);
            int rc;
            if (import)
                rc = be->from_host(t, buf + off);
            else if (grads && !t->grad)
                rc = (memset(buf + off, 0, sizeof(float) * (size_t)k), TDM_OK);
            else
                rc = be->to_host(buf + off, grads ? t->grad : t);
            if (rc) return rc;
            off += k;
        }
    return TDM_OK;
}

int tdm_gpt_llmc_tensors(tdm_module *m, tdm_tensor **out, int cap) {
    const tdm_gpt_config *c = tdm_gpt_config_of(m);
    if (!c) return tdm_raise(TDM_ERR_ARG, "gpt_llmc_tensors: not a GPT module");
    if (((const gpt_state *)c)->tp)
        return tdm_raise(TDM_ERR_STATE, "gpt_llmc_tensors: a tensor-parallel GPT holds parts of "
                                        "its weights (tdm_gpt_parallelize)");
    int n = 0;
    for (int kind = 0; kind < LLMC_KINDS; kind++)
        for (int l = 0; l < (per_layer(kind) ? c->layers : 1); l++, n++)
            if (out && n < cap) out[n] = llmc_tensor(m, kind, l);
    return n;
}

int tdm_gpt_export_llmc(tdm_module *m, bool grads, float *out, int64_t n) {
    return llmc_walk(m, out, n, grads, false);
}

int tdm_gpt_import_llmc(tdm_module *m, const float *in, int64_t n) {
    return llmc_walk(m, (float *)in, n, false, true);
}

/* ---- the row of the registry ------------------------------------------------------------------
 */

static tdm_module *build_row(const tdm_model_info *row, const tdm_model_opts *o, tdm_device dev,
                             tdm_rng *rng) {
    (void)row;
    return tdm_gpt_new(&o->gpt, dev, rng);
}

/* The blocks transformer.h.<l> of a GPT (or of a clone of one), else 0. */
static int blocks(tdm_module *m, tdm_module **units, int cap) {
    if (!tdm_gpt_config_of(m)) return 0;
    tdm_module *h = m->children[0]->children[TR_H];
    for (int i = 0; i < h->n_children && i < cap; i++) units[i] = h->children[i];
    return h->n_children;
}

/* Per token of windows of T (the input's, else the context): the counts of tdm_gpt_new's
 * modules, each block one unit. */
static int count_row(const tdm_model_info *row, const tdm_model_opts *o, tdm_model_cost *m) {
    (void)row;
    if (check_config(&o->gpt)) return TDM_ERR_ARG;
    tdm_gpt_config g = o->gpt;
    if (!g.padded_vocab) g.padded_vocab = g.vocab;
    int64_t C = g.channels, H = g.heads, T = o->input.ndim == 1 ? o->input.d[0] : g.context;
    /* the layers of its pipeline model (tdm_gpt_pipeline_model): the embeddings, the blocks,
     * the head, each with its parameters */
    m->positions = T;
    m->params += (int64_t)g.padded_vocab * C + (int64_t)g.context * C;
    tdm_cost_out(m, (double)(3 * C)); /* wte and wpe rows, their sum */
    for (int l = 0; l < g.layers; l++) {
        m->params += 12 * C * C + 13 * C;
        tdm_cost_unit_begin(m, (double)C);
        /* ln_1, qkv, attention (and its log-sum-exp per head), c_proj, the sum; ln_2, c_fc,
         * GELU, c_proj, the sum */
        tdm_cost_out(m, (double)(C + 3 * C + C + H + C + C));
        tdm_cost_out(m, (double)(C + 4 * C + 4 * C + C + C));
        tdm_cost_unit_end(m);
    }
    /* ln_f, and the head's copy of wte that a pipeline's last stage holds: counted in that
     * layer, not in the model, which holds wte once */
    m->params += 2 * C + (int64_t)g.padded_vocab * C;
    tdm_cost_out(m, (double)C);
    m->params -= (int64_t)g.padded_vocab * C;
    m->head = g.padded_vocab;
    m->factor = 1.25;
    m->head_factor = 1.70;
    m->fixed = 8.0 * (double)T * (double)T; /* attention's backward: two T x T, a head at a time */
    return TDM_OK;
}

static void describe_row(const tdm_model_info *row, const tdm_model_opts *o, char *buf,
                         size_t cap) {
    const tdm_gpt_config *c = &o->gpt;
    snprintf(buf, cap, "%s: %d layers, %d heads, %d channels, context %d, vocab %d (padded %d)",
             row->name, c->layers, c->heads, c->channels, c->context, c->vocab,
             c->padded_vocab ? c->padded_vocab : c->vocab);
}

const tdm_model_info tdm_row_gpt = {
    .name = "gpt",
    .task = TDM_TASK_TEXT,
    .input = "windows of T tokens",
    .any_input = true,
    .defaults = {.input = TDM_SHAPE(64),
                 .gpt = {.layers = 2,
                         .heads = 4,
                         .channels = 128,
                         .context = 64,
                         .vocab = 256,
                         .padded_vocab = 256}},
    .build = build_row,
    .units = blocks,
    .count = count_row,
    .describe = describe_row,
    .help = "GPT-2 (nanoGPT's names) sized by --layers, --heads, --channels and --context, "
            "trained with AdamW (weight decay on matrices only) on --data FILE; see --save and "
            "'tandem sample'.",
};
