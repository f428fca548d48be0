/* Tandem autocast: mixed precision with PyTorch's torch.autocast semantics
 * (docs/MIXED_PRECISION.md has the lists op by op and where Tandem differs).
 *
 * Between tdm_autocast_begin(TDM_BF16) and tdm_autocast_end() on one thread:
 *   - the ops of the lower-precision list (tdm_matmul, tdm_bmm, tdm_linear, tdm_conv2d,
 *     tdm_causal_attention) cast their float inputs to the region's dtype and run there;
 *   - the ops of the fp32 list cast them to f32: the losses (tdm_cross_entropy,
 *     tdm_nll_loss, tdm_mse_loss, tdm_bce_with_logits) on every device, and on CUDA devices
 *     only tdm_softmax, tdm_log_softmax, tdm_layer_norm, tdm_exp, tdm_log, tdm_pow_scalar,
 *     tdm_sum and tdm_sum_all (on the CPU these follow their input, as PyTorch's CPU lists);
 *   - every other op runs in its inputs' dtype (binary ops promote: bf16 + f32 gives f32).
 * The casts are tape nodes (tdm_to_dtype), so gradients flow back through them: an f32
 * parameter used by a bf16 product gets an f32 .grad, and each op's backward runs in the
 * dtype its forward ran. A parameter (a leaf that requires a gradient) is cast once per
 * outermost region while grad mode is on and the cast reused by every op of the region that
 * wants it in that dtype (PyTorch's cast cache); the cache empties at the outermost
 * tdm_autocast_end. A cached cast belongs to the step scope it was made in and to the tape:
 * it is made again if that scope has ended or a backward has walked it since.
 *
 * The state is per thread, like the tape and grad mode: a region on one thread changes
 * nothing on another. DataParallel runs each replica's step on a worker thread of its own,
 * so a region must be begun inside the step the replica runs (the trainer does so in each
 * replica's step), not around tdm_dp_step on the caller's thread.
 */
#ifndef TANDEM_AUTOCAST_H
#define TANDEM_AUTOCAST_H

#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The deepest nesting of regions on one thread. */
#define TDM_AUTOCAST_MAX_DEPTH 32

/* Opens a region on the calling thread in which the lower-precision ops run in dt: TDM_BF16
 * or TDM_F16; TDM_F32 opens a region with autocast off inside (torch.autocast(enabled=False)
 * within another region). Regions nest; each begin needs its tdm_autocast_end. Returns
 * TDM_OK, TDM_ERR_DTYPE naming dt when it is not a float dtype, or TDM_ERR_STATE when
 * TDM_AUTOCAST_MAX_DEPTH regions are already open. */
int tdm_autocast_begin(tdm_dtype dt);

/* Closes the innermost region of the calling thread; closing the outermost one empties the
 * cast cache (the casts themselves stay alive until their step scope ends). Returns TDM_OK
 * or TDM_ERR_STATE when no region is open. */
int tdm_autocast_end(void);

/* The dtype the lower-precision ops run in on this thread now: the innermost region's,
 * TDM_F32 outside any region or in a disabled one. */
tdm_dtype tdm_autocast_dtype(void);

/* How many casts autocast has made on this thread since it started (cache hits excluded):
 * for tests of the cast cache and for debugging. */
int64_t tdm_autocast_cast_count(void);

#ifdef __cplusplus
}
#endif

#endif
