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

/* Marks a leaf tensor as needing a gradient. Returns TDM_OK, TDM_ERR_ARG for NULL,
 * TDM_ERR_DTYPE for a tensor that is not f32, bf16 or f16, TDM_ERR_STATE for a non-leaf.
 *
 * Dtypes of gradients, as in PyTorch: a tensor's gradient has the tensor's dtype (a bf16
 * leaf's .grad is bf16, an f32 parameter's f32 even when a bf16 op used it through a cast:
 * tdm_to_dtype and autocast.h). Each op's backward computes in the dtypes its forward ran
 * in, and a gradient reaching a tensor in another dtype (a bf16 + f32 add's, going to its
 * bf16 input) is cast to the tensor's dtype once, before it is added. */
int tdm_requires_grad_(tdm_tensor *t, bool requires_grad);

/* Backpropagates from a one-element float tensor (seeded with 1 in its dtype). Gradients add
 * into each leaf's .grad
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

/* ---- recomputation (torch.utils.checkpoint) ------------------------------------------------ */

/* What tdm_recompute runs: the output of a function of x (NULL and an error on failure). */
typedef tdm_tensor *(*tdm_recompute_fn)(void *arg, tdm_tensor *x);

/* Trades compute for memory, as torch.utils.checkpoint.checkpoint does: returns fn(arg, x)
 * but keeps none of the tensors fn makes on the way (they are freed before this returns),
 * only x and the output, and records one tape node. When a backward reaches that node, fn
 * runs again on x, its graph is walked with the output's gradient, and what it made is freed
 * again. The second run draws the random numbers of the first (every draw from a tdm_rng
 * inside fn, dropout's masks among them, is logged by the first run and replayed), and
 * batch norm leaves its running statistics alone (see tdm_recomputing). So the gradients,
 * x's included, are those of calling fn directly, bit for bit: the same kernels in the same
 * order. In an autocast region (autocast.h) the second run runs in the dtype the first ran
 * in, and both run with the cast cache off, so each of fn's casts is a node of its own (the
 * same as calling fn directly with the cache off). Parameters' gradient-ready hooks (DDP's
 * buckets) fire once each, when the node's backward is done. Nests: fn may call
 * tdm_recompute itself. Per thread, like the tape.
 *
 * fn must build the same graph every time it runs on x: the same ops on the same tensors,
 * with nothing it reads (through arg: parameters, other tensors, the parallel context)
 * changed between the forward and the backward, and any tensor it reads besides x kept
 * alive until then. Other side effects happen twice unless fn skips them while
 * tdm_recomputing() is true.
 *
 * With grad mode off this is fn(arg, x). The output is owned by the current scope, as any
 * op's. NULL and an error: fn's own when it fails, TDM_ERR_ARG for a NULL fn, TDM_ERR_STATE
 * without an open step scope. A second run that does not match the first (another output
 * shape, another count of random draws) fails the backward with TDM_ERR_STATE. */
tdm_tensor *tdm_recompute(tdm_recompute_fn fn, void *arg, tdm_tensor *x);

/* Whether the calling thread is running a function again for a tdm_recompute node's backward:
 * layers with side effects beyond their output check it (batch norm's running statistics). */
bool tdm_recomputing(void);

/* ---- differentiable copies between threads' graphs ---------------------------------------- */

/* Receives a gradient computed on another thread: grad is caller-owned (the callee owns it
 * from now on and frees it with tdm_tensor_free) and lives on the device of the tensor that
 * was sent. Called from the receiving thread, inside its backward. */
typedef void (*tdm_grad_sink)(tdm_tensor *grad, void *arg);

/* The receiving half of a copy between devices whose graphs are recorded on different
 * threads. Returns a copy of src (another thread's tensor, which must stay alive and
 * unchanged during the call) on dev, owned by the calling thread's current scope (one must
 * be open). If src requires a gradient and grad mode is on, the copy is recorded on this
 * thread's tape: when a backward reaches it, dL/d(copy) is copied back to src's device and
 * handed to sink(grad, arg) (sink may be NULL: the gradient is dropped). The sending thread
 * then continues the backward with tdm_backward_from(src, grad, its mark). src's graph is
 * never touched from this thread, so the two threads need no lock beyond the hand-off of
 * src and of grad. NULL and an error if src is NULL, no scope is open, or the copy fails. */
tdm_tensor *tdm_device_recv(tdm_tensor *src, tdm_device dev, tdm_grad_sink sink, void *arg);

/* Backpropagates from out, a tensor recorded on this thread's tape at or after position
 * mark (tdm_tape_size() before its forward began), seeded with grad (out's shape, a float
 * dtype, cast to out's if another, on out's device; NULL means 1 for a one-element out). Walks only
 * the nodes in [mark, out's node], so the forwards of other micro-batches recorded on the same tape
 * are left for their own backward, in any order. Gradients accumulate into leaves' .grad as
 * tdm_backward does; gradient-ready hooks do not fire. grad is borrowed: keep it until this
 * returns. Returns TDM_OK, TDM_ERR_STATE if out has no history or was not recorded after mark on
 * this thread, TDM_ERR_SHAPE/DEVICE for a grad that does not match out, TDM_ERR_DTYPE for an
 * integer one. */
int tdm_backward_from(tdm_tensor *out, tdm_tensor *grad, int mark);

/* Releases, now instead of at the end of the step scope, the memory of the tensors held by
 * the nodes recorded at tape positions [mark, end): their outputs, inputs and saved tensors,
 * except leaves that require gradients and caller-owned tensors (parameters). Their headers
 * stay in the scope with no storage. Call it after the backward over those nodes, when every
 * scope-owned tensor they hold was made after mark (true of a micro-batch's forward) and
 * nothing else reads them: a pipeline stage keeps only in-flight micro-batches' activations
 * this way although scopes end in stack order. Invalid ranges are ignored. */
void tdm_graph_release(int mark, int end);

#ifdef __cplusplus
}
#endif
#endif
