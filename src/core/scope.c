/* Step scopes: every tensor header, tape node and op context created inside a scope comes
 * from this thread's arena and is released at once by tdm_scope_end. The arena keeps its
 * chunks, so a steady-state step allocates nothing from the system. The tape (the nodes
 * recorded by autograd, src/autograd/tape.c) is part of the scope too: ending a scope
 * truncates it, through the tdm_scope_tape autograd registers. */
#include "core/core.h"
#include "core/hook.h"

#include <stdlib.h>
#include <string.h>

#define CHUNK_BYTES (256 * 1024)
#define MAX_DEPTH   64

typedef struct chunk {
    struct chunk *next;
    size_t size, used;
    _Alignas(64) unsigned char mem[];
} chunk;

struct tdm_scope {
    chunk *mark_chunk; /* arena position at begin */
    size_t mark_used;
    int tape_start;
    tdm_tensor *tensors; /* owned tensors, linked through their tdm_book(t)->next */
};

typedef struct {
    chunk *head, *cur; /* chunk list; cur is the one being filled */
    tdm_scope scopes[MAX_DEPTH];
    int depth;
} thread_state;

static _Thread_local thread_state ts;
static tdm_hook tape_hook;

void tdm_scope_set_tape(const tdm_scope_tape *tape) {
    tdm_hook_set(&tape_hook, tape);
}

/* The registered tape, or NULL while no node was ever recorded (every tape is empty). */
static const tdm_scope_tape *registered_tape(void) {
    return tdm_hook_get(&tape_hook);
}

static void *arena_alloc(size_t n) {
    n = (n + 15) & ~(size_t)15;
    while (ts.cur && ts.cur->used + n > ts.cur->size) ts.cur = ts.cur->next;
    if (!ts.cur) {
        size_t size = n > CHUNK_BYTES ? n : CHUNK_BYTES;
        chunk *c = malloc(sizeof(chunk) + size);
        if (!c) return NULL;
        tdm_alloc_count_sys();
        c->next = NULL;
        c->size = size;
        c->used = 0;
        /* append, so chunks are reused in order after a reset */
        chunk **tail = &ts.head;
        while (*tail) tail = &(*tail)->next;
        *tail = c;
        ts.cur = c;
    }
    void *p = ts.cur->mem + ts.cur->used;
    ts.cur->used += n;
    memset(p, 0, n);
    return p;
}

static tdm_scope *current(void) {
    return ts.depth ? &ts.scopes[ts.depth - 1] : NULL;
}

int tdm_scope_begin(void) {
    if (ts.depth == MAX_DEPTH)
        return tdm_raise(TDM_ERR_STATE, "scope: more than %d nested scopes", MAX_DEPTH);
    tdm_scope *s = &ts.scopes[ts.depth++];
    s->mark_chunk = ts.cur;
    s->mark_used = ts.cur ? ts.cur->used : 0;
    const tdm_scope_tape *tp = registered_tape();
    s->tape_start = tp ? tp->mark() : 0;
    s->tensors = NULL;
    return TDM_OK;
}

void tdm_scope_end(void) {
    tdm_scope *s = current();
    if (!s) return;
    for (tdm_tensor *t = s->tensors, *next; t; t = next) {
        next = tdm_book(t)->next;
        tdm_storage_release(t->storage);
        if (tdm_book(t)->heap_header) free(t);
    }
    const tdm_scope_tape *tp = registered_tape();
    if (tp) tp->truncate(s->tape_start);
    /* rewind the arena: chunks after the mark become empty */
    chunk *c = s->mark_chunk ? s->mark_chunk : ts.head;
    if (c) c->used = s->mark_chunk ? s->mark_used : 0;
    for (chunk *n = c ? c->next : NULL; n; n = n->next) n->used = 0;
    ts.cur = c;
    ts.depth--;
}

void *tdm_scope_alloc(size_t n) {
    if (!current()) {
        void *p = calloc(1, n);
        return p ? p : tdm_raise_null(TDM_ERR_NOMEM, "scope: out of memory for %zu bytes", n);
    }
    void *p = arena_alloc(n);
    return p ? p : tdm_raise_null(TDM_ERR_NOMEM, "scope: out of memory for %zu bytes", n);
}

tdm_tensor *tdm_tensor_header(void) {
    tdm_scope *s = current();
    tdm_tensor *t = s ? arena_alloc(sizeof *t) : calloc(1, sizeof *t);
    if (!t) return tdm_raise_null(TDM_ERR_NOMEM, "tensor: out of memory for a header");
    tdm_book(t)->owner = s;
    tdm_book(t)->last_use = -1;
    if (s) {
        tdm_book(t)->next = s->tensors;
        s->tensors = t;
    }
    return t;
}

tdm_tensor *tdm_tensor_header_owned(tdm_scope *owner) {
    if (owner == current()) return tdm_tensor_header();
    tdm_tensor *t = calloc(1, sizeof *t);
    if (!t) return tdm_raise_null(TDM_ERR_NOMEM, "tensor: out of memory for a header");
    tdm_book(t)->last_use = -1;
    tdm_book(t)->owner = owner;
    if (owner) { /* an outer scope: its arena is closed, so the header lives on the heap */
        tdm_book(t)->heap_header = true;
        tdm_book(t)->next = owner->tensors;
        owner->tensors = t;
    }
    return t;
}

tdm_tensor *tdm_scope_keep(tdm_tensor *t) {
    if (!t) return NULL;
    if (!tdm_book(t)->owner) return t;
    tdm_tensor *k = calloc(1, sizeof *k);
    if (!k) return tdm_raise_null(TDM_ERR_NOMEM, "scope: out of memory keeping a tensor");
    *k = *t;
    tdm_book(k)->owner = NULL;
    tdm_book(k)->next = NULL;
    k->grad_fn = NULL; /* the history dies with the scope */
    k->grad = NULL;
    tdm_book(k)->hooks = NULL;
    tdm_book(k)->last_use = -1;
    tdm_storage_retain(k->storage);
    if (t->grad) k->grad = tdm_scope_keep(t->grad);
    return k;
}

tdm_scope *tdm_current_scope(void) {
    return current();
}

void tdm_thread_release(void) {
    while (ts.depth) tdm_scope_end();
    for (chunk *c = ts.head, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    ts.head = ts.cur = NULL;
    const tdm_scope_tape *tp = registered_tape();
    if (tp) tp->release();
}
