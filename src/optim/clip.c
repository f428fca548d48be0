/* Gradient-norm clipping over the flat gradient buffer: one reduction and, when the norm is
 * above max_norm, one in-place scale (torch.nn.utils.clip_grad_norm_ with norm_type 2). */
#include "optim/clip.h"

#include <math.h>

#include "backend/backend.h"
#include "tandem/optim.h"

/* A stack view of gradient elements [lo, hi) (kernels read only the geometry). */
static tdm_tensor grad_range(const tdm_paramset *ps, int64_t lo, int64_t hi) {
    tdm_tensor v = *ps->flat_grad;
    v.shape[0] = hi - lo;
    v.offset = ps->flat_grad->offset + lo;
    return v;
}

int tdm_clip_sum_squares_of(const tdm_tensor *g, double *ss) {
    *ss = 0;
    if (tdm_numel(g) == 0) return TDM_OK;
    const tdm_backend *be = tdm_backend_for(g->device);
    return be ? be->sum_squares(ss, g) : tdm_last_status();
}

int tdm_clip_scale_of(tdm_tensor *g, float max_norm, float norm) {
    /* PyTorch: coef = max_norm / (norm + 1e-6) clamped to 1. A factor of 1 changes nothing,
     * so it is skipped; NaN (a NaN norm) propagates as in PyTorch. */
    float coef = max_norm / (norm + 1e-6f);
    if (coef >= 1.0f || tdm_numel(g) == 0) return TDM_OK;
    const tdm_backend *be = tdm_backend_for(g->device);
    return be ? be->unary(TDM_UN_MUL_SCALAR, g, g, coef) : tdm_last_status();
}

int tdm_clip_sum_squares(const tdm_paramset *ps, int64_t lo, int64_t hi, double *ss) {
    tdm_tensor g = grad_range(ps, lo, hi > lo ? hi : lo);
    return tdm_clip_sum_squares_of(&g, ss);
}

int tdm_clip_scale(tdm_paramset *ps, int64_t lo, int64_t hi, float max_norm, float norm) {
    tdm_tensor g = grad_range(ps, lo, hi > lo ? hi : lo);
    return tdm_clip_scale_of(&g, max_norm, norm);
}

int tdm_clip_grad_norm(tdm_paramset *ps, float max_norm, bool error_if_nonfinite,
                       float *total_norm) {
    if (!ps) return tdm_raise(TDM_ERR_ARG, "clip_grad_norm: parameter set is NULL");
    if (!ps->flat_grad)
        return tdm_raise(TDM_ERR_STATE,
                         "clip_grad_norm: the gradient is sharded over the ranks (ZeRO stage 2): "
                         "clip with tdm_ddp_clip_grad_norm");
    if (!(max_norm >= 0))
        return tdm_raise(TDM_ERR_ARG, "clip_grad_norm: max_norm %g must be >= 0", max_norm);
    double ss;
    int rc = tdm_clip_sum_squares(ps, 0, ps->total, &ss);
    if (rc) return rc;
    float norm = (float)sqrt(ss);
    if (total_norm) *total_norm = norm;
    if (!isfinite(norm) && error_if_nonfinite)
        return tdm_raise(TDM_ERR_NUMERIC,
                         "clip_grad_norm: the total norm of order 2 of the gradients (%lld "
                         "elements) is %g; gradients left unchanged",
                         (long long)ps->total, norm);
    return tdm_clip_scale(ps, 0, ps->total, max_norm, norm);
}
