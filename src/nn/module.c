/* Modules: a tree of layers with named parameters, buffers and children.
 *
 * tdm_module_parameters moves every parameter of the tree into one flat buffer (and gives each
 * one a gradient view into a second flat buffer), so the optimizer, DDP's buckets and
 * checkpoints each walk a single contiguous block (DESIGN.md, decision 5). A parameter keeps
 * its tensor header: only its storage, offset and strides change, so pointers the user holds
 * stay valid.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/tape.h"
#include "tandem/nn.h"

/* Tensors the module keeps must be caller-owned even when a step scope is open: a
 * scope-owned one is replaced by a caller-owned header (tdm_scope_keep) for the same data. */
static tdm_tensor *own(tdm_tensor *t) {
    return t && tdm_book(t)->owner ? tdm_scope_keep(t) : t;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* ---- construction ----------------------------------------------------------------------- */

tdm_module *tdm_module_new(const tdm_module_ops *ops, tdm_device dev, void *impl) {
    if (!ops) return tdm_raise_null(TDM_ERR_ARG, "module_new: ops is NULL");
    tdm_module *m = calloc(1, sizeof *m);
    if (!m) return tdm_raise_null(TDM_ERR_NOMEM, "module_new: out of memory for a %s", ops->kind);
    m->ops = ops;
    m->device = dev;
    m->training = true;
    m->impl = impl;
    return m;
}

/* Whether name is already a parameter, buffer or child of m. */
static bool name_taken(const tdm_module *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (!strcmp(m->param_names[i], name)) return true;
    for (int i = 0; i < m->n_buffers; i++)
        if (!strcmp(m->buffer_names[i], name)) return true;
    for (int i = 0; i < m->n_children; i++)
        if (!strcmp(m->child_names[i], name)) return true;
    return false;
}

/* Shared checks of add_param / add_buffer / add (child). */
static int check_add(const tdm_module *m, const char *what, const char *name) {
    if (!m) return tdm_raise(TDM_ERR_ARG, "module_add_%s: module is NULL", what);
    if (!name || !*name || strchr(name, '.'))
        return tdm_raise(TDM_ERR_ARG, "module_add_%s: invalid name \"%s\" (empty or with '.')",
                         what, name ? name : "(null)");
    if (name_taken(m, name))
        return tdm_raise(TDM_ERR_ARG, "module_add_%s: %s already has a member named \"%s\"", what,
                         m->ops->kind, name);
    if (m->paramset)
        return tdm_raise(TDM_ERR_STATE,
                         "module_add_%s: cannot add \"%s\" to %s after module_parameters made "
                         "its flat buffer",
                         what, name, m->ops->kind);
    return TDM_OK;
}

int tdm_module_add_param(tdm_module *m, const char *name, tdm_tensor *p) {
    if (!p) {
        if (tdm_last_status() == TDM_OK)
            tdm_raise(TDM_ERR_ARG, "module_add_param: tensor \"%s\" is NULL", name ? name : "");
        return tdm_last_status();
    }
    if (check_add(m, "param", name)) return tdm_last_status();
    if (m->n_params == TDM_MODULE_MAX_PARAMS)
        return tdm_raise(TDM_ERR_ARG, "module_add_param: %s already has %d parameters",
                         m->ops->kind, TDM_MODULE_MAX_PARAMS);
    if (tdm_check_f32(p, "module_add_param")) return tdm_last_status();
    char *nm = dup_str(name);
    if (!nm) return tdm_raise(TDM_ERR_NOMEM, "module_add_param: out of memory");
    if (!(p = own(p)) || tdm_requires_grad_(p, true)) {
        free(nm);
        return tdm_last_status();
    }
    m->param_names[m->n_params] = nm;
    m->params[m->n_params++] = p;
    return TDM_OK;
}

int tdm_module_add_buffer(tdm_module *m, const char *name, tdm_tensor *b) {
    if (!b) {
        if (tdm_last_status() == TDM_OK)
            tdm_raise(TDM_ERR_ARG, "module_add_buffer: tensor \"%s\" is NULL", name ? name : "");
        return tdm_last_status();
    }
    if (check_add(m, "buffer", name)) return tdm_last_status();
    if (m->n_buffers == TDM_MODULE_MAX_BUFFERS)
        return tdm_raise(TDM_ERR_ARG, "module_add_buffer: %s already has %d buffers", m->ops->kind,
                         TDM_MODULE_MAX_BUFFERS);
    if (m->bufferset)
        return tdm_raise(TDM_ERR_STATE, "module_add_buffer: %s's buffers were already listed",
                         m->ops->kind);
    char *nm = dup_str(name);
    if (!nm) return tdm_raise(TDM_ERR_NOMEM, "module_add_buffer: out of memory");
    if (!(b = own(b))) {
        free(nm);
        return tdm_last_status();
    }
    m->buffer_names[m->n_buffers] = nm;
    m->buffers[m->n_buffers++] = b;
    return TDM_OK;
}

int tdm_module_add(tdm_module *parent, const char *name, tdm_module *child) {
    if (!child) {
        if (tdm_last_status() == TDM_OK) tdm_raise(TDM_ERR_ARG, "module_add: child is NULL");
        return tdm_last_status();
    }
    char idx[24];
    if (!name && parent) snprintf(idx, sizeof idx, "%d", parent->n_children);
    if (check_add(parent, "child", name ? name : idx)) return tdm_last_status();
    if (child == parent)
        return tdm_raise(TDM_ERR_ARG, "module_add: a %s cannot be its own child",
                         parent->ops->kind);
    char *nm = dup_str(name ? name : idx);
    char **names = realloc(parent->child_names, (size_t)(parent->n_children + 1) * sizeof *names);
    if (names) parent->child_names = names;
    tdm_module **kids = realloc(parent->children, (size_t)(parent->n_children + 1) * sizeof *kids);
    if (kids) parent->children = kids;
    if (!nm || !names || !kids) {
        free(nm);
        return tdm_raise(TDM_ERR_NOMEM, "module_add: out of memory");
    }
    parent->child_names[parent->n_children] = nm;
    parent->children[parent->n_children++] = child;
    return TDM_OK;
}

/* ---- running ---------------------------------------------------------------------------- */

/* m's own forward, as tdm_recompute runs it (there, m->recompute must not apply again). */
static tdm_tensor *forward_of(void *m, tdm_tensor *x) {
    return ((tdm_module *)m)->ops->forward(m, x);
}

tdm_tensor *tdm_module_forward(tdm_module *m, tdm_tensor *x) {
    if (!m) return tdm_raise_null(TDM_ERR_ARG, "module_forward: module is NULL");
    if (!x) {
        if (tdm_last_status() == TDM_OK)
            tdm_raise(TDM_ERR_ARG, "module_forward: %s got a NULL input", m->ops->kind);
        return NULL;
    }
    if (!m->ops->forward)
        return tdm_raise_null(TDM_ERR_STATE, "module_forward: %s has no forward", m->ops->kind);
    int rc = m->pre_hook ? m->pre_hook(m, m->hook_ctx) : TDM_OK;
    if (rc) return NULL;
    tdm_tensor *y = m->recompute && tdm_grad_enabled() ? tdm_recompute(forward_of, m, x)
                                                       : m->ops->forward(m, x);
    return m->post_hook && y ? m->post_hook(m, y, m->hook_ctx) : y;
}

int tdm_module_set_forward_hooks(tdm_module *m, tdm_forward_pre_hook pre, tdm_forward_hook post,
                                 void *ctx) {
    if (!m) return tdm_raise(TDM_ERR_ARG, "module_set_forward_hooks: module is NULL");
    m->pre_hook = pre, m->post_hook = post, m->hook_ctx = ctx;
    return TDM_OK;
}

int tdm_module_set_recompute(tdm_module *m, bool on) {
    if (!m) return tdm_raise(TDM_ERR_ARG, "module_set_recompute: module is NULL");
    m->recompute = on;
    return TDM_OK;
}

void tdm_module_train(tdm_module *m, bool training) {
    if (!m) return;
    m->training = training;
    for (int i = 0; i < m->n_children; i++) tdm_module_train(m->children[i], training);
}

/* ---- walking the tree ------------------------------------------------------------------- */

typedef struct {
    int n, cap;
    char **names;
    tdm_tensor **ts;
} named_list;

static void list_free(named_list *l) {
    for (int i = 0; i < l->n; i++) free(l->names[i]);
    free(l->names);
    free(l->ts);
    memset(l, 0, sizeof *l);
}

static int list_push(named_list *l, const char *prefix, const char *name, tdm_tensor *t) {
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 16;
        char **nn = realloc(l->names, (size_t)cap * sizeof *nn);
        if (nn) l->names = nn;
        tdm_tensor **tt = realloc(l->ts, (size_t)cap * sizeof *tt);
        if (tt) l->ts = tt;
        if (!nn || !tt) return tdm_raise(TDM_ERR_NOMEM, "module: out of memory listing names");
        l->cap = cap;
    }
    size_t n = strlen(prefix) + strlen(name) + 1;
    char *full = malloc(n);
    if (!full) return tdm_raise(TDM_ERR_NOMEM, "module: out of memory listing names");
    snprintf(full, n, "%s%s", prefix, name);
    l->names[l->n] = full;
    l->ts[l->n++] = t;
    return TDM_OK;
}

static bool list_has(const named_list *l, const tdm_tensor *t) {
    for (int i = 0; i < l->n; i++)
        if (l->ts[i] == t) return true;
    return false;
}

/* Appends the parameters (buffers when !params) of m's tree under prefix, in registration
 * order, depth first: a module's own members before its children's, as PyTorch lists them.
 * A tensor registered twice (shared weights) is listed once, under its first name. */
static int collect(const tdm_module *m, const char *prefix, bool params, named_list *l) {
    int n = params ? m->n_params : m->n_buffers;
    for (int i = 0; i < n; i++) {
        tdm_tensor *t = params ? m->params[i] : m->buffers[i];
        const char *nm = params ? m->param_names[i] : m->buffer_names[i];
        if (!list_has(l, t) && list_push(l, prefix, nm, t)) return tdm_last_status();
    }
    for (int c = 0; c < m->n_children; c++) {
        size_t len = strlen(prefix) + strlen(m->child_names[c]) + 2;
        char *sub = malloc(len);
        if (!sub) return tdm_raise(TDM_ERR_NOMEM, "module: out of memory listing names");
        snprintf(sub, len, "%s%s.", prefix, m->child_names[c]);
        int rc = collect(m->children[c], sub, params, l);
        free(sub);
        if (rc) return rc;
    }
    return TDM_OK;
}

/* A descendant that already owns a flat buffer: its parameters cannot move again. */
static const tdm_module *flattened_child(const tdm_module *m) {
    for (int c = 0; c < m->n_children; c++) {
        const tdm_module *k = m->children[c];
        if (k->paramset) return k;
        if ((k = flattened_child(k))) return k;
    }
    return NULL;
}

/* ---- the flat parameter buffer ---------------------------------------------------------- */

static void paramset_free(tdm_paramset *ps) {
    if (!ps) return;
    for (int i = 0; ps->names && i < ps->n; i++) free(ps->names[i]);
    free(ps->names);
    free(ps->params);
    free(ps->offsets);
    tdm_tensor_free(ps->flat);
    tdm_tensor_free(ps->flat_grad);
    free(ps);
}

/* A stack view of flat's elements [off, off + numel(p)) with p's shape, contiguous. Kernels
 * only read a tensor's geometry, so no header or reference is needed for a temporary. */
static tdm_tensor flat_view(const tdm_tensor *flat, const tdm_tensor *p, int64_t off) {
    tdm_tensor v = *flat;
    v.ndim = p->ndim;
    memcpy(v.shape, p->shape, sizeof v.shape);
    tdm_contiguous_strides(p->ndim, p->shape, v.strides);
    v.offset = flat->offset + off;
    v.requires_grad = false;
    v.grad = NULL;
    v.grad_fn = NULL;
    memset(v.internal_, 0, sizeof v.internal_); /* owned by nobody, on no list */
    return v;
}

/* Moves p's values into flat at off and makes p a view there; gives p a gradient view into
 * flat_grad (carrying over any gradient it had). */
static int rebind(tdm_tensor *p, tdm_tensor *flat, tdm_tensor *flat_grad, int64_t off,
                  const tdm_backend *be) {
    tdm_tensor dst = flat_view(flat, p, off);
    if (be->copy(&dst, p)) return tdm_last_status();
    tdm_tensor *g =
        tdm_tensor_view(flat_grad, p->ndim, p->shape, dst.strides, flat_grad->offset + off);
    if (!(g = own(g))) return tdm_last_status();
    if (p->grad) {
        tdm_tensor gdst = flat_view(flat_grad, p, off);
        if (be->copy(&gdst, p->grad)) {
            tdm_tensor_free(g);
            return tdm_last_status();
        }
        tdm_tensor_free(p->grad);
    }
    p->grad = g;
    tdm_storage_retain(flat->storage);
    tdm_storage_release(p->storage);
    p->storage = flat->storage;
    p->offset = dst.offset;
    memcpy(p->strides, dst.strides, sizeof p->strides);
    return TDM_OK;
}

/* Checks dtype and device of the listed parameters; returns the device through *dev. */
static int check_params(const named_list *l, tdm_device fallback, tdm_device *dev) {
    *dev = l->n ? l->ts[0]->device : fallback;
    for (int i = 0; i < l->n; i++) {
        const tdm_tensor *p = l->ts[i];
        char a[16], b[16];
        if (p->dtype != TDM_F32)
            return tdm_raise(TDM_ERR_DTYPE, "module_parameters: %s is %s, parameters must be f32",
                             l->names[i], tdm_dtype_name(p->dtype));
        if (!tdm_device_equal(p->device, *dev))
            return tdm_raise(TDM_ERR_DEVICE,
                             "module_parameters: %s is on %s but %s is on %s; all parameters "
                             "must be on one device",
                             l->names[i], tdm_device_str(p->device, a), l->names[0],
                             tdm_device_str(*dev, b));
    }
    return TDM_OK;
}

static tdm_paramset *build_paramset(tdm_module *m, named_list *l) {
    tdm_device dev;
    if (check_params(l, m->device, &dev)) return NULL;
    const tdm_backend *be = tdm_backend_for(dev);
    if (!be) return NULL;
    tdm_paramset *ps = calloc(1, sizeof *ps);
    int64_t *offs = calloc((size_t)l->n + 1, sizeof *offs);
    if (!ps || !offs) {
        free(ps);
        free(offs);
        return tdm_raise_null(TDM_ERR_NOMEM, "module_parameters: out of memory");
    }
    for (int i = 0; i < l->n; i++) offs[i + 1] = offs[i] + tdm_numel(l->ts[i]);
    ps->n = l->n;
    ps->offsets = offs;
    ps->total = offs[l->n];
    ps->flat = own(tdm_tensor_alloc(TDM_SHAPE(ps->total), TDM_F32, dev));
    ps->flat_grad = own(tdm_tensor_alloc(TDM_SHAPE(ps->total), TDM_F32, dev));
    if (!ps->flat || !ps->flat_grad || be->fill(ps->flat_grad, 0.0)) goto fail;
    for (int i = 0; i < l->n; i++)
        if (rebind(l->ts[i], ps->flat, ps->flat_grad, offs[i], be)) goto fail;
    /* The set takes the list's arrays. */
    ps->names = l->names;
    ps->params = l->ts;
    memset(l, 0, sizeof *l);
    return ps;
fail:
    /* Parameters already rebound keep a reference to the new storage: still valid. */
    paramset_free(ps);
    return NULL;
}

tdm_paramset *tdm_module_parameters(tdm_module *m) {
    if (!m) return tdm_raise_null(TDM_ERR_ARG, "module_parameters: module is NULL");
    if (m->paramset) return m->paramset;
    const tdm_module *k = flattened_child(m);
    if (k)
        return tdm_raise_null(TDM_ERR_STATE,
                              "module_parameters: a child %s of this %s already has its own "
                              "flat buffer; call module_parameters on the root only",
                              k->ops->kind, m->ops->kind);
    named_list l = {0};
    if (collect(m, "", true, &l)) {
        list_free(&l);
        return NULL;
    }
    m->paramset = build_paramset(m, &l);
    list_free(&l);
    return m->paramset;
}

void tdm_paramset_mark_grads_stale(tdm_paramset *ps) {
    for (int i = 0; ps && i < ps->n; i++) tdm_grad_mark_overwrite(ps->params[i]);
}

int tdm_paramset_settle_grads(tdm_paramset *ps) {
    int rc = TDM_OK;
    for (int i = 0; ps && i < ps->n; i++) {
        int z = tdm_grad_settle(ps->params[i]);
        rc = rc ? rc : z;
    }
    return rc;
}

tdm_bufferset *tdm_module_buffers(tdm_module *m) {
    if (!m) return tdm_raise_null(TDM_ERR_ARG, "module_buffers: module is NULL");
    if (m->bufferset) return m->bufferset;
    named_list l = {0};
    tdm_bufferset *bs = calloc(1, sizeof *bs);
    if (!bs) return tdm_raise_null(TDM_ERR_NOMEM, "module_buffers: out of memory");
    if (collect(m, "", false, &l)) {
        list_free(&l);
        free(bs);
        return NULL;
    }
    bs->n = l.n;
    bs->names = l.names;
    bs->buffers = l.ts;
    m->bufferset = bs;
    return bs;
}

tdm_tensor *tdm_module_find(tdm_module *m, const char *name) {
    if (!m || !name) return NULL;
    for (int i = 0; i < m->n_params; i++)
        if (!strcmp(m->param_names[i], name)) return m->params[i];
    for (int i = 0; i < m->n_buffers; i++)
        if (!strcmp(m->buffer_names[i], name)) return m->buffers[i];
    const char *dot = strchr(name, '.');
    if (!dot) return NULL;
    size_t len = (size_t)(dot - name);
    for (int c = 0; c < m->n_children; c++)
        if (strlen(m->child_names[c]) == len && !strncmp(m->child_names[c], name, len))
            return tdm_module_find(m->children[c], dot + 1);
    return NULL;
}

/* ---- cloning ---------------------------------------------------------------------------- */

/* A caller-owned copy of t's values on dev (called with grad mode off: no history). */
static tdm_tensor *copy_to(const tdm_tensor *t, tdm_device dev) {
    return tdm_scope_keep(tdm_to_device((tdm_tensor *)t, dev));
}

static int clone_tensors(tdm_module *c, const tdm_module *m, tdm_device dev) {
    int rc = TDM_OK;
    for (int i = 0; !rc && i < m->n_params; i++)
        rc = tdm_module_add_param(c, m->param_names[i], copy_to(m->params[i], dev));
    for (int i = 0; !rc && i < m->n_buffers; i++)
        rc = tdm_module_add_buffer(c, m->buffer_names[i], copy_to(m->buffers[i], dev));
    return rc;
}

tdm_module *tdm_module_clone(const tdm_module *m, tdm_device dev) {
    if (!m) return tdm_raise_null(TDM_ERR_ARG, "module_clone: NULL module");
    if (m->impl && !m->impl_size)
        return tdm_raise_null(TDM_ERR_ARG, "module_clone: a %s's settings are not plain data",
                              m->ops->kind);
    void *impl = m->impl_size ? malloc(m->impl_size) : NULL;
    if (m->impl_size && !impl) return tdm_raise_null(TDM_ERR_NOMEM, "module_clone: out of memory");
    if (impl) memcpy(impl, m->impl, m->impl_size);
    tdm_module *c = tdm_module_new(m->ops, dev, impl);
    if (!c) {
        free(impl);
        return NULL;
    }
    c->impl_size = m->impl_size;
    c->training = m->training;
    c->recompute = m->recompute;
    bool prev = tdm_set_grad_enabled(false);
    int rc = clone_tensors(c, m, dev);
    for (int i = 0; !rc && i < m->n_children; i++) {
        tdm_module *child = tdm_module_clone(m->children[i], dev);
        rc = child ? tdm_module_add(c, m->child_names[i], child) : tdm_last_status();
        if (rc && child) tdm_module_free(child);
    }
    tdm_set_grad_enabled(prev);
    if (rc) {
        tdm_module_free(c);
        return NULL;
    }
    return c;
}

/* ---- freeing ---------------------------------------------------------------------------- */

void tdm_module_free(tdm_module *m) {
    if (!m) return;
    for (int c = 0; c < m->n_children; c++) {
        tdm_module_free(m->children[c]);
        free(m->child_names[c]);
    }
    free(m->children);
    free(m->child_names);
    if (m->ops && m->ops->destroy) m->ops->destroy(m);
    for (int i = 0; i < m->n_params; i++) {
        tdm_tensor_free(m->params[i]);
        free((char *)m->param_names[i]);
    }
    for (int i = 0; i < m->n_buffers; i++) {
        tdm_tensor_free(m->buffers[i]);
        free((char *)m->buffer_names[i]);
    }
    paramset_free(m->paramset);
    if (m->bufferset) {
        for (int i = 0; i < m->bufferset->n; i++) free(m->bufferset->names[i]);
        free(m->bufferset->names);
        free(m->bufferset->buffers);
        free(m->bufferset);
    }
    free(m);
}
