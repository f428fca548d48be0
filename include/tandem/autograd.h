/* Tandem autograd: a define-by-run tape per thread.
 *
 * While gradients are enabled, every op whose inputs require gradients appends a node to the
 * calling thread's tape. tdm_backward(loss) walks the tape in reverse from the loss and
 * accumulates gradients into the .grad of every leaf that requires them. The tape lives in
 * the current step scope and is released by tdm_scope_end.
 */
#ifndef TANDEM_AUTOGRAD_H
#define TANDEM_AUTOGRAD_H

#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Marks a leaf tensor as needing a gradient (f32 only). Returns TDM_OK or an error. */
int tdm_requires_grad_(tdm_tensor *t, bool requires_grad);

/* Backpropagates from a one-element f32 tensor. Gradients add into each leaf's .grad
 * (allocated, zero-filled, on first use with the leaf's owner), so several backward calls
 * accumulate. Nodes recorded before the previous backward on this thread are not walked
 * again. Fails with TDM_ERR_SHAPE for a loss with more than one element, TDM_ERR_STATE if
 * the loss has no history. */
int tdm_backward(tdm_tensor *loss);

/* Gradient mode for this thread (no-grad for evaluation). Returns the previous mode. */
bool tdm_set_grad_enabled(bool enabled);
bool tdm_grad_enabled(void);

/* Sets t.grad to zero (if it has one). */
int tdm_zero_grad(tdm_tensor *t);

/* Called during tdm_backward the moment a leaf's gradient for this backward is final (no
 * remaining tape node reads the leaf). DDP launches bucket all-reduces from it. */
typedef void (*tdm_grad_hook)(tdm_tensor *leaf, void *ctx);
/* Registers a hook on a leaf (up to 4 per leaf). Returns TDM_OK or an error. */
int tdm_register_grad_hook(tdm_tensor *leaf, tdm_grad_hook hook, void *ctx);
/* Removes every hook of a leaf. */
void tdm_clear_grad_hooks(tdm_tensor *leaf);

/* Number of nodes on this thread's tape (for tests and debugging). */
int tdm_tape_size(void);

#ifdef __cplusplus
}
#endif
#endif
