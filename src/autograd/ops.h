/* Private helpers every op shares, the tensor ops of src/autograd/ and the layers and losses
 * of src/nn/ alike (docs/ARCHITECTURE.md, "What lives where"): NULL inputs, temporaries made
 * outside a step scope, contiguous copies for kernels, integer index arguments, broadcasting.
 * Written once here; an op file includes this header, not a copy of its own. */
#ifndef TDM_OPS_H
#define TDM_OPS_H

#include "autograd/tape.h"
#include "tandem/autocast.h"

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

/* A 3-D view [1, rows, cols] of a contiguous tensor holding rows*cols elements: the batch
 * form the backend's matmul takes. Lives on the stack: kernels only read the geometry. */
static inline tdm_tensor tdm_as_matrix(const tdm_tensor *t, int64_t rows, int64_t cols) {
    tdm_tensor v = *t;
    v.ndim = 3;
    v.shape[0] = 1, v.shape[1] = rows, v.shape[2] = cols;
    v.strides[0] = rows * cols, v.strides[1] = cols, v.strides[2] = 1;
    v.requires_grad = false;
    v.grad = NULL;
    v.grad_fn = NULL;
    return v;
}

/* ---- checks ----------------------------------------------------------------------------- */

/* t's shape as text in buf (96 bytes), for error messages. */
static inline const char *tdm_tensor_shape_str(const tdm_tensor *t, char *buf) {
    return tdm_shape_str(tdm_shape_of(t), buf);
}

/* The broadcast shape of a and b into out; an error naming op and both shapes if none. */
int tdm_broadcast_shapes(const tdm_tensor *a, const tdm_tensor *b, tdm_shape *out, const char *op);

/* t must be a float tensor (f32, bf16 or f16): the dtypes ops compute on. Raises
 * TDM_ERR_DTYPE naming op and t's dtype otherwise and returns nonzero. */
int tdm_check_float(const tdm_tensor *t, const char *op);
/* a and b (either may be NULL: not checked) must have x's dtype, for the products, which
 * take one dtype (PyTorch's "expected both operands to have the same dtype"; autocast is
 * what mixes an fp32 weight with a bf16 input). Raises TDM_ERR_DTYPE naming op otherwise. */
int tdm_check_same_dtype(const tdm_tensor *x, const tdm_tensor *a, const tdm_tensor *b,
                         const char *op);
/* The dtype of a binary op's result, PyTorch's type promotion among floats: the common
 * dtype when a and b agree, else f32 (bf16 + f32, f16 + f32 and bf16 + f16 all give f32). */
static inline tdm_dtype tdm_promote(tdm_dtype a, tdm_dtype b) {
    return a == b ? a : TDM_F32;
}

/* Records y = a + b (tdm_add's node, a and b broadcasting to y) for a kernel that computed
 * the sum beside something else (a layer norm of it). tdm_record's result and failures. */
tdm_node *tdm_record_add(tdm_tensor *y, tdm_tensor *a, tdm_tensor *b);

/* ---- autocast (autograd/autocast.c; include/tandem/autocast.h is the public side) -------- */

/* Which of autocast's lists an op is on (docs/MIXED_PRECISION.md, "Tandem's lists"). */
typedef enum {
    TDM_AC_LOW,      /* runs in the region's dtype: products, convolution, attention */
    TDM_AC_F32,      /* runs in fp32 on every device: the losses */
    TDM_AC_F32_CUDA, /* runs in fp32 on CUDA devices, follows its input on the CPU */
} tdm_autocast_list;
/* The tensor an op of list `list` is to compute on in place of t: t itself outside a region,
 * for a non-float t, or when t already has the dtype the list asks for; else t cast to it
 * through tdm_to_dtype (recorded on the tape, so gradients flow back to t in t's dtype). A
 * parameter (a leaf requiring grad) cast while grad mode is on is cast once per outermost
 * region and the cast reused. NULL (and the cast's error) on failure; NULL for a NULL t. */
tdm_tensor *tdm_autocast_arg(tdm_tensor *t, tdm_autocast_list list);
/* The dtype tdm_autocast_arg(t, list) would give t (t's own where it would not cast), for an
 * op whose kernel reads t's dtype and computes in the one autocast asks for without a copy. */
tdm_dtype tdm_autocast_want(const tdm_tensor *t, tdm_autocast_list list);
/* Turns the cast cache on or off for this thread (on by default); returns the previous
 * setting. tdm_recompute turns it off while its function runs, so that the function's casts
 * are its own nodes reading the parameters in both runs, whatever was cached outside. */
bool tdm_autocast_set_cache(bool enabled);

/* For an op that casts under autocast: outside any step scope its casts would be the
 * caller's to free, so in a region the op runs inside a scope of its own
 * (TDM_RETURN_SCOPED), unless it is to record history (n inputs in[]): that needs the
 * caller's scope, and the cast fails for the lack of one as the op itself would. Use as
 * `TDM_AUTOCAST_SCOPED(2, in, tdm_op(a, b));` at the top of the op. */
#define TDM_AUTOCAST_SCOPED(n, in, expr)                                                           \
    do {                                                                                           \
        if (!tdm_current_scope() && tdm_autocast_dtype() != TDM_F32 && !tdm_needs_record(n, in))   \
            TDM_RETURN_SCOPED(expr);                                                               \
    } while (0)

/* idx must be i32/i64 and on src's device; raises naming op otherwise and returns nonzero. */
int tdm_check_index(const tdm_tensor *idx, const tdm_tensor *src, const char *op);
/* An index tensor the tape may read at backward time: a caller-owned one could be freed
 * before then, so it is cloned into the current scope; a scope-owned one is returned as is. */
tdm_tensor *tdm_index_keep(const tdm_tensor *idx);

#endif
