/* Private helpers every op shares, the tensor ops of src/autograd/ and the layers and losses
 * of src/nn/ alike (docs/ARCHITECTURE.md, "What lives where"): NULL inputs, temporaries made
 * outside a step scope, contiguous copies for kernels, integer index arguments, broadcasting.
 * Written once here; an op file includes this header, not a copy of its own. */
#ifndef TDM_OPS_H
#define TDM_OPS_H

#include "autograd/tape.h"

/* ---- inputs and temporaries ------------------------------------------------------------- */

/* For an op handed a NULL input: raises only if no error is pending, so the first cause of a
 * failed chain survives. Returns NULL. */
static inline tdm_tensor *tdm_null_input(const char *op) {
    if (tdm_last_status() == TDM_OK) tdm_raise(TDM_ERR_ARG, "%s: NULL input", op);
    return NULL;
}

/* Same, naming the argument that was NULL ("conv2d: weight is NULL"). */
static inline tdm_tensor *tdm_null_arg(const char *op, const char *what) {
    if (tdm_last_status() == TDM_OK) tdm_raise(TDM_ERR_ARG, "%s: %s is NULL", op, what);
    return NULL;
}

/* Frees an op's temporary when no scope owns it (ops called outside a step scope), unless it
 * is keep (an input the op returned or was handed). With a scope open this does nothing. */
static inline void tdm_drop_temp(tdm_tensor *tmp, const tdm_tensor *keep) {
    if (tmp && tmp != keep && !tdm_book(tmp)->owner) tdm_tensor_free(tmp);
}

/* Frees out (see tdm_drop_temp) and returns NULL, for the failure paths after making it. */
static inline tdm_tensor *tdm_drop_fail(tdm_tensor *out) {
    tdm_drop_temp(out, NULL);
    return NULL;
}

/* t itself when contiguous, else a contiguous copy with no tape node, for kernels that need
 * one (NULL and an error on failure). */
tdm_tensor *tdm_dense(const tdm_tensor *t);

/* For an op that makes temporaries: when the caller has no scope open (so the temporaries
 * would be the caller's to free, and no history can be recorded), returns the op's result
 * computed inside a scope of its own, handing only the result to the caller. Use as
 * `if (!tdm_current_scope()) TDM_RETURN_SCOPED(tdm_op(a, b));` at the top of the op. */
#define TDM_RETURN_SCOPED(expr)                                                                    \
    do {                                                                                           \
        tdm_scope_begin();                                                                         \
        tdm_tensor *scoped_ = tdm_scope_keep(expr);                                                \
        tdm_scope_end();                                                                           \
        return scoped_;                                                                            \
    } while (0)

/* ---- checks ----------------------------------------------------------------------------- */

/* t's shape as text in buf (96 bytes), for error messages. */
static inline const char *tdm_tensor_shape_str(const tdm_tensor *t, char *buf) {
    return tdm_shape_str(tdm_shape_of(t), buf);
}

/* The broadcast shape of a and b into out; an error naming op and both shapes if none. */
int tdm_broadcast_shapes(const tdm_tensor *a, const tdm_tensor *b, tdm_shape *out, const char *op);

/* idx must be i32/i64 and on src's device; raises naming op otherwise and returns nonzero. */
int tdm_check_index(const tdm_tensor *idx, const tdm_tensor *src, const char *op);
/* An index tensor the tape may read at backward time: a caller-owned one could be freed
 * before then, so it is cloned into the current scope; a scope-owned one is returned as is. */
tdm_tensor *tdm_index_keep(const tdm_tensor *idx);

#endif
