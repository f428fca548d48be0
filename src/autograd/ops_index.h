/* Private helpers shared by the ops that take integer indices or targets (index_select,
 * embedding, the losses). */
#ifndef TDM_OPS_INDEX_H
#define TDM_OPS_INDEX_H

#include "autograd/tape.h"

/* idx must be i32/i64 and on src's device; raises naming op otherwise and returns nonzero. */
int tdm_check_index(const tdm_tensor *idx, const tdm_tensor *src, const char *op);
/* An index tensor the tape may read at backward time: a caller-owned one could be freed
 * before then, so it is cloned into the current scope; a scope-owned one is returned as is. */
tdm_tensor *tdm_index_keep(const tdm_tensor *idx);

/* Frees an op's temporary when no scope owns it (ops called outside a step scope), unless it
 * is keep (an input the op returned or was handed). With a scope open this does nothing. */
static inline void tdm_drop_temp(tdm_tensor *tmp, const tdm_tensor *keep) {
    if (tmp && tmp != keep && !tmp->owner) tdm_tensor_free(tmp);
}

/* For an op handed a NULL input: raises only if no error is pending, so the first cause of a
 * failed chain survives. Returns NULL. */
static inline tdm_tensor *tdm_null_input(const char *op) {
    if (tdm_last_status() == TDM_OK) tdm_raise(TDM_ERR_ARG, "%s: NULL input", op);
    return NULL;
}

#endif
