/* The GPT as a Sequential a pipeline can cut (tdm_gpt_pipeline_model): [embeddings, block 0,
 * ..., block L-1, head], copies of the GPT's layers. The head reads the token embedding again
 * (the tied LM head), so it holds a copy of wte of its own, tied to the embeddings' by a
 * tdm_pipe_tie: on different stages each copy gets the sum of both gradients (Megatron-LM's
 * tied embeddings across pipeline stages). Every op is the GPT's own forward's, in its order,
 * so the Sequential computes the GPT's logits bit for bit. Under tensor parallelism with the
 * sequence split (tdm_gpt_parallelize_stage) the embeddings hand on each rank's tokens and the
 * head gathers them after ln_f, as the GPT's own forward does. */
#include "core/core.h"
#include "models_internal.h"
#include "tandem/autograd.h"
#include "tandem/gpt.h"
#include "tandem/pipeline.h"

#include <stdlib.h>
#include <string.h>

/* m's child called name, or NULL. */
static tdm_module *child(const tdm_module *m, const char *name) {
    for (int c = 0; m && c < m->n_children; c++)
        if (!strcmp(m->child_names[c], name)) return m->children[c];
    return NULL;
}

/* The embeddings' and the head's settings: the GPT's config; with the sequence split, the
 * tensor-parallel group (set after the stage is cloned, never copied by a clone). */
typedef struct {
    tdm_gpt_config c;
    tdm_group *tp;   /* NULL: whole */
    bool seq, vocab; /* the tokens, the vocabulary split over tp (tdm_gpt_tp_plan's) */
    tdm_tensor *pad; /* the head's, vocabulary-split: 0 or -1e30 for its logits' columns */
} end_state;

/* idx [B, T] -> x [B, T, C] = wte[idx] + wpe[0..T): the GPT's first lines; with the sequence
 * split, this rank's tokens of it [B, T/n, C]. */
static tdm_tensor *embed_forward(tdm_module *m, tdm_tensor *idx) {
    const end_state *st = m->impl;
    const tdm_gpt_config *c = &st->c;
    char b[96];
    if (idx->ndim != 2 || idx->shape[1] < 1 || idx->shape[1] > c->context)
        return tdm_raise_null(TDM_ERR_SHAPE,
                              "gpt embeddings: tokens must be [B, T] with T in "
                              "[1, %d] (context), got %s",
                              c->context, tdm_shape_str(tdm_shape_of(idx), b));
    tdm_tensor *wte = m->children[0]->params[0], *wpe = m->children[1]->params[0];
    /* wpe's first T rows (gpt.c's forward) */
    tdm_tensor *tok = st->vocab ? tdm_tp_embedding(st->tp, wte, idx) : tdm_embedding(wte, idx);
    tdm_tensor *x = tdm_add(tok, tdm_slice(wpe, 0, 0, idx->shape[1], 1));
    return st->seq ? tdm_tp_seq_shard(st->tp, x, 1) : x;
}

/* x [B, T, C] -> logits [B, T, V] = ln_f(x) @ wte[:V]^T, on the head's copy of wte; with the
 * sequence split, x is this rank's tokens, gathered after ln_f; with the vocabulary split,
 * this rank's columns of the logits [B, T, Vp/n] (its rows of wte, the padding's at -1e30), as
 * the GPT's own vocabulary-parallel head gives. */
static tdm_tensor *head_forward(tdm_module *m, tdm_tensor *x) {
    const end_state *st = m->impl;
    const tdm_gpt_config *c = &st->c;
    tdm_tensor *wte = m->children[1]->params[0];
    x = tdm_module_forward(m->children[0], x);
    if (x && st->vocab) {
        x = st->seq ? tdm_tp_seq_gather(st->tp, x, 1, true) : tdm_tp_copy(st->tp, x);
        tdm_tensor *logits = tdm_linear(x, wte, NULL);
        return st->pad && logits ? tdm_add(logits, st->pad) : logits;
    }
    if (x && st->seq) x = tdm_tp_seq_gather(st->tp, x, 1, false);
    tdm_tensor *head = c->vocab == c->padded_vocab ? wte : tdm_slice(wte, 0, 0, c->vocab, 1);
    return x ? tdm_linear(x, head, NULL) : NULL;
}

static void free_impl(tdm_module *m) {
    end_state *st = m->impl;
    if (st) tdm_tensor_free(st->pad); /* a split stage's: never cloned */
    free(m->impl);
    m->impl = NULL;
}

static const tdm_module_ops embed_ops = {"GPTEmbeddings", embed_forward, free_impl};
static const tdm_module_ops head_ops = {"GPTHead", head_forward, free_impl};

/* A module of ops holding a copy of c and clones of kids[0..n) under names. */
static tdm_module *layer(const tdm_module_ops *ops, const tdm_gpt_config *c, tdm_device dev,
                         tdm_module *const *kids, const char *const *names, int n) {
    end_state *impl = malloc(sizeof *impl);
    tdm_module *m = impl ? tdm_module_new(ops, dev, impl) : NULL;
    if (!m) {
        free(impl);
        return impl ? NULL : tdm_raise_null(TDM_ERR_NOMEM, "gpt_pipeline_model: out of memory");
    }
    *impl = (end_state){*c, NULL, false, false, NULL};
    m->impl_size = sizeof *impl;
    for (int i = 0; i < n; i++) {
        tdm_module *k = tdm_module_clone(kids[i], dev);
        if (!k || tdm_module_add(m, names[i], k)) {
            tdm_module_free(k);
            tdm_module_free(m);
            return NULL;
        }
    }
    return m;
}

tdm_module *tdm_gpt_pipeline_model(const tdm_module *gpt, tdm_pipe_tie *tie) {
    const tdm_gpt_config *c = tdm_gpt_config_of(gpt);
    tdm_module *tr = c ? child(gpt, "transformer") : NULL, *h = child(tr, "h");
    tdm_module *wte = child(tr, "wte"), *wpe = child(tr, "wpe"), *ln_f = child(tr, "ln_f");
    if (!c || !h || !wte || !wpe || !ln_f || !tie)
        return tdm_raise_null(TDM_ERR_ARG, "gpt_pipeline_model: %s",
                              tie ? "not a GPT" : "NULL tie");
    int n = h->n_children + 2;
    tdm_module **kids = calloc((size_t)n, sizeof *kids);
    if (!kids) return tdm_raise_null(TDM_ERR_NOMEM, "gpt_pipeline_model: out of memory");
    bool prev = tdm_set_grad_enabled(false);
    kids[0] = layer(&embed_ops, c, gpt->device, (tdm_module *[]){wte, wpe},
                    (const char *[]){"wte", "wpe"}, 2);
    for (int l = 0; l < h->n_children && kids[l]; l++)
        kids[l + 1] = tdm_module_clone(h->children[l], gpt->device);
    if (kids[n - 2])
        kids[n - 1] = layer(&head_ops, c, gpt->device, (tdm_module *[]){ln_f, wte},
                            (const char *[]){"ln_f", "wte"}, 2);
    tdm_set_grad_enabled(prev);
    tdm_module *seq = kids[n - 1] ? tdm_sequential_new(n, kids) : NULL;
    if (!seq)
        for (int i = 0; i < n; i++) tdm_module_free(kids[i]);
    free(kids);
    if (seq) *tie = (tdm_pipe_tie){0, "wte.weight", n - 1, "wte.weight"};
    return seq;
}

int tdm_gpt_end_split(tdm_module *layer, tdm_group *tp, bool seq, bool vocab) {
    if (layer->ops != &embed_ops && layer->ops != &head_ops) return 0;
    end_state *st = layer->impl;
    bool head = layer->ops == &head_ops;
    int rc = TDM_OK;
    if (vocab) { /* its wte (a copy, for the head) split by rows as the GPT's */
        tdm_module *w = tdm_vocab_embedding_from(layer->children[head], tp);
        if (!w) return tdm_last_status();
        tdm_module_free(layer->children[head]);
        layer->children[head] = w;
        int64_t k = w->params[0]->shape[0];
        if (head)
            st->pad = tdm_gpt_padding_mask(&st->c, k, k * tdm_group_rank(tp), layer->device, &rc);
    }
    if (rc) return rc;
    st->tp = seq || vocab ? tp : NULL, st->seq = seq, st->vocab = vocab;
    return head ? 2 : 1;
}

tdm_group *tdm_gpt_stage_vocab_group(const tdm_module *stage, bool *ends) {
    const tdm_module *last =
        stage && stage->n_children ? stage->children[stage->n_children - 1] : NULL;
    *ends = last && last->ops == &head_ops;
    return *ends && ((const end_state *)last->impl)->vocab ? ((const end_state *)last->impl)->tp
                                                           : NULL;
}

/* dst's parameters from src's, in order (the same tree). */
static int copy_params(tdm_module *dst, const tdm_module *src) {
    if (dst->n_params != src->n_params || dst->n_children != src->n_children)
        return tdm_raise(TDM_ERR_SHAPE, "gpt pipeline model: a %s where the other has a %s",
                         src->ops->kind, dst->ops->kind);
    int rc = TDM_OK;
    for (int i = 0; i < dst->n_params && !rc; i++) {
        tdm_scope_begin();
        rc = tdm_copy_(dst->params[i], tdm_to_device(src->params[i], dst->params[i]->device));
        tdm_scope_end();
    }
    for (int k = 0; k < dst->n_children && !rc; k++)
        rc = copy_params(dst->children[k], src->children[k]);
    return rc;
}

/* One layer of the GPT (g) and of its Sequential (q) made equal: q from g when to_seq. */
static int copy_way(tdm_module *g, tdm_module *q, bool to_seq) {
    return to_seq ? copy_params(q, g) : copy_params(g, q);
}

/* The parameters of gpt and seq, tdm_gpt_pipeline_model's Sequential of it, made equal: seq's
 * (both copies of wte) from gpt's when to_seq, else gpt's from seq's (wte from the
 * embeddings' copy). */
static int copy_gpt(tdm_module *gpt, tdm_module *seq, bool to_seq, const char *op) {
    tdm_module *tr = tdm_gpt_config_of(gpt) ? child(gpt, "transformer") : NULL, *h = child(tr, "h");
    if (!h || !seq || seq->n_children != h->n_children + 2 ||
        strcmp(seq->children[0]->ops->kind, "GPTEmbeddings") != 0)
        return tdm_raise(TDM_ERR_ARG, "%s: not a GPT and its pipeline model", op);
    bool prev = tdm_set_grad_enabled(false);
    tdm_module *emb = seq->children[0], *head = seq->children[seq->n_children - 1];
    int rc = copy_way(child(tr, "wte"), emb->children[0], to_seq);
    if (!rc) rc = copy_way(child(tr, "wpe"), emb->children[1], to_seq);
    for (int l = 0; l < h->n_children && !rc; l++)
        rc = copy_way(h->children[l], seq->children[l + 1], to_seq);
    if (!rc) rc = copy_way(child(tr, "ln_f"), head->children[0], to_seq);
    if (!rc && to_seq) rc = copy_params(head->children[1], child(tr, "wte")); /* the tied copy */
    tdm_set_grad_enabled(prev);
    return rc;
}

int tdm_gpt_from_pipeline_model(tdm_module *gpt, const tdm_module *seq) {
    return copy_gpt(gpt, (tdm_module *)seq, false, "gpt_from_pipeline_model");
}

int tdm_gpt_to_pipeline_model(tdm_module *seq, const tdm_module *gpt) {
    return copy_gpt((tdm_module *)gpt, seq, true, "gpt_to_pipeline_model");
}
