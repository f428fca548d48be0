/* The thread's tape: the nodes recorded so far, in order. Nodes live in the step scope's
 * arena, so the tape belongs to the scopes as well: a scope truncates it when it ends. Core
 * owns the scopes and sits below autograd, so autograd hands it the tape's three scope
 * operations (tdm_scope_set_tape) when the first node is recorded; before that every tape
 * is empty and a scope has nothing to truncate. */
#include "autograd/tape.h"

#include <stdlib.h>

typedef struct {
    tdm_node **nodes;
    int len, cap, consumed; /* nodes [0, consumed) were walked by a backward */
} tape;

static _Thread_local tape tp;

static int tape_mark(void) {
    return tp.len;
}

/* A scope that began at mark ends: its nodes go with its arena. */
static void tape_truncate(int mark) {
    tp.len = mark;
    if (tp.consumed > tp.len) tp.consumed = tp.len;
}

static void tape_release(void) {
    free(tp.nodes);
    tp = (tape){0};
}

static const tdm_scope_tape scope_tape = {tape_mark, tape_truncate, tape_release};

/* Grows the tape (doubling); the first growth also registers it with the scopes. */
static int tape_grow(void) {
    tdm_scope_set_tape(&scope_tape);
    int cap = tp.cap ? tp.cap * 2 : 1024;
    tdm_node **nodes = realloc(tp.nodes, (size_t)cap * sizeof *nodes);
    if (!nodes) return tdm_raise(TDM_ERR_NOMEM, "autograd: out of memory growing the tape");
    tdm_alloc_count_sys();
    tp.nodes = nodes;
    tp.cap = cap;
    return TDM_OK;
}

int tdm_tape_push(tdm_node *n) {
    if (tp.len == tp.cap) {
        int rc = tape_grow();
        if (rc) return rc;
    }
    n->index = tp.len;
    tp.nodes[tp.len++] = n;
    return TDM_OK;
}

tdm_node **tdm_tape_nodes(int *start, int *end) {
    *start = tp.consumed;
    *end = tp.len;
    return tp.nodes;
}

void tdm_tape_consume(void) {
    tp.consumed = tp.len;
}

int tdm_tape_size(void) {
    return tp.len;
}
