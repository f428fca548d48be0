/* What a parallel update needs of tdm_grad_scaler (grad_scaler.c), internal; the public face
 * is tandem/optim.h's scaler and tdm_ddp_unscale.
 *
 * A DataParallel step drives one scaler for replicas on threads of their own: the caller
 * takes the iteration's scale before the round (tdm_grad_scaler_begin), each replica
 * multiplies its loss by it and unscales the gradient it steps (tdm_grad_scaler_unscale_of
 * reads the scaler only), the replicas agree whether any gradient held an inf or NaN, and the
 * caller updates the scale once (tdm_grad_scaler_update_found). Whether a gradient is finite
 * is the finiteness of its sum of squares in double (tdm_clip_sum_squares_of): a float's
 * square is below 2^256, so the sum is finite exactly when every element is, and sums over
 * shards add up to the whole one's. Each check is taken before the multiplication by
 * 1/scale, as PyTorch's. */
#ifndef TDM_OPTIM_SCALER_H
#define TDM_OPTIM_SCALER_H

#include "tandem/optim.h"

/* The scale this iteration's losses are multiplied by (1 when disabled); marks s started, as
 * tdm_grad_scaler_scale does. */
float tdm_grad_scaler_begin(tdm_grad_scaler *s);
/* g *= the float nearest 1/scale, in place (nothing when that is 1 or s is disabled): the
 * multiplication of tdm_grad_scaler_unscale without its check or bookkeeping. */
int tdm_grad_scaler_unscale_of(const tdm_grad_scaler *s, tdm_tensor *g);
/* tdm_grad_scaler_unscale for an optimizer whose gradient g (what o steps from) was checked by
 * the caller, found_inf agreed over the ranks that share the step: g unscaled and o's stage
 * recorded, so tdm_grad_scaler_step and _update follow as usual. Fails as
 * tdm_grad_scaler_unscale (stages, NULLs). */
int tdm_grad_scaler_unscale_found(tdm_grad_scaler *s, tdm_optim *o, tdm_tensor *g, bool found_inf);
/* tdm_grad_scaler_update for an iteration whose check the caller made (no optimizer stage
 * needed): backoff on found_inf, else growth tracking. TDM_ERR_STATE before any begin or
 * scale. */
int tdm_grad_scaler_update_found(tdm_grad_scaler *s, bool found_inf);

#endif
