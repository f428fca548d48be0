/* Gradient-norm clipping over the flat gradient buffer: one reduction and, when the norm is
 * above max_norm, one in-place scale (torch.nn.utils.clip_grad_norm_ with norm_type 2). */
#include <math.h>

#include "backend/backend.h"
#include "tandem/optim.h"

int tdm_clip_grad_norm(tdm_paramset *ps, float max_norm, bool error_if_nonfinite,
                       float *total_norm) {
    if (!ps || !ps->flat_grad)
        return tdm_raise(TDM_ERR_ARG, "clip_grad_norm: parameter set is NULL");
    if (!(max_norm >= 0))
        return tdm_raise(TDM_ERR_ARG, "clip_grad_norm: max_norm %g must be >= 0", max_norm);
    const tdm_backend *be = tdm_backend_for(ps->flat_grad->device);
    if (!be) return tdm_last_status();
    double ss = 0;
    int rc = ps->total ? be->sum_squares(&ss, ps->flat_grad) : TDM_OK;
    if (rc) return rc;
    float norm = (float)sqrt(ss);
    if (total_norm) *total_norm = norm;
    if (!isfinite(norm) && error_if_nonfinite)
        return tdm_raise(TDM_ERR_NUMERIC,
                         "clip_grad_norm: the total norm of order 2 of the gradients (%lld "
                         "elements) is %g; gradients left unchanged",
                         (long long)ps->total, norm);
    /* PyTorch: coef = max_norm / (norm + 1e-6) clamped to 1. A factor of 1 changes nothing,
     * so it is skipped; NaN (a NaN norm) propagates as in PyTorch. */
    float coef = max_norm / (norm + 1e-6f);
    if (coef >= 1.0f || !ps->total) return TDM_OK;
    return be->unary(TDM_UN_MUL_SCALAR, ps->flat_grad, ps->flat_grad, coef);
}
