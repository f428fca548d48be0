/* CPU kernels for batch norm and layer norm.
 *
 * Statistics are summed in float lanes within one row or (n, c) plane and in double across
 * them: a batch-norm channel can sum millions of values, and pure float accumulation would
 * drift visibly from PyTorch's running statistics. Loops visit
 * memory in storage order; batch norm works on blocks of channels so that a [N, C] input
 * (S = 1) is still read row by row instead of with stride C.
 */
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_lowp.h"
#include "backend/cpu/cpu_isa.h"
#include "backend/cpu/cpu_simd.h"

#include <assert.h>

#define BN_BLOCK 64 /* channels whose accumulators live on the stack at once */

static inline const float *cf(const tdm_tensor *t) {
    return t ? (const float *)tdm_data_ptr(t) : NULL;
}
static inline float *mf(tdm_tensor *t) {
    return t ? (float *)tdm_data_ptr(t) : NULL;
}

/* x [N, C, S]: N = shape[0], C = shape[1], S = every further dim (1 for [N, C]). */
static void bn_dims(const tdm_tensor *x, int64_t *n, int64_t *c, int64_t *s) {
    *n = x->shape[0];
    *c = x->ndim > 1 ? x->shape[1] : 1;
    int64_t nc = *n * *c;
    *s = nc > 0 ? tdm_numel(x) / nc : 1;
}

/* Biased mean and variance of channels [c0, c0+nb) (two passes: stable for large means). */
TDM_CPU_CLONES
static void bn_block_stats(const float *x, int64_t N, int64_t C, int64_t S, int64_t c0, int nb,
                           double *mean, double *var) {
    double m = (double)N * (double)S;
    for (int j = 0; j < nb; j++) mean[j] = var[j] = 0;
    for (int64_t n = 0; n < N; n++)
        for (int j = 0; j < nb; j++) {
            mean[j] += simd_sum(x + (n * C + c0 + j) * S, S);
        }
    for (int j = 0; j < nb; j++) mean[j] /= m;
    for (int64_t n = 0; n < N; n++)
        for (int j = 0; j < nb; j++) {
            var[j] += simd_sq_dev_f64(x + (n * C + c0 + j) * S, S, (float)mean[j]);
        }
    for (int j = 0; j < nb; j++) var[j] /= m;
}

/* y = x * a[c] + b[c] over channels [c0, c0+nb). */
TDM_CPU_CLONES
static void bn_block_affine(float *y, const float *x, int64_t N, int64_t C, int64_t S, int64_t c0,
                            int nb, const float *a, const float *b) {
    for (int64_t n = 0; n < N; n++)
        for (int j = 0; j < nb; j++) {
            int64_t base = (n * C + c0 + j) * S;
            simd_affine(y + base, x + base, S, a[j], b[j]);
        }
}

int tdm_cpu_batch_norm(tdm_tensor *y, tdm_tensor *save_mean, tdm_tensor *save_invstd,
                       const tdm_tensor *x, const tdm_tensor *weight, const tdm_tensor *bias,
                       tdm_tensor *running_mean, tdm_tensor *running_var, bool training,
                       float momentum, float eps) {
    if (tdm_cpu_lowp_any(8, (const tdm_tensor *[]){y, save_mean, save_invstd, x, weight, bias,
                                                   running_mean, running_var}))
        return tdm_cpu_lowp_batch_norm(y, save_mean, save_invstd, x, weight, bias, running_mean,
                                       running_var, training, momentum, eps);
    int64_t N, C, S;
    bn_dims(x, &N, &C, &S);
    int64_t M = N * S;          /* values per channel */
    assert(!training || M > 1); /* the op refused fewer values (nn/functional_norm.c) */
    assert(training || (running_mean && running_var)); /* and eval without running stats */
    const float *xp = cf(x), *w = cf(weight), *b = cf(bias);
    float *yp = mf(y), *sm = mf(save_mean), *si = mf(save_invstd);
    float *rm = mf(running_mean), *rv = mf(running_var);
    double mean[BN_BLOCK], var[BN_BLOCK];
    float a[BN_BLOCK], sh[BN_BLOCK];
    for (int64_t c0 = 0; c0 < C; c0 += BN_BLOCK) {
        int nb = (int)(C - c0 < BN_BLOCK ? C - c0 : BN_BLOCK);
        if (training) {
            bn_block_stats(xp, N, C, S, c0, nb, mean, var);
        } else {
            for (int j = 0; j < nb; j++) mean[j] = rm[c0 + j], var[j] = rv[c0 + j];
        }
        for (int j = 0; j < nb; j++) {
            int64_t c = c0 + j;
            float invstd = (float)(1.0 / sqrt(var[j] + (double)eps));
            float mu = (float)mean[j];
            if (sm) sm[c] = mu;
            if (si) si[c] = invstd;
            a[j] = invstd * (w ? w[c] : 1.0f);
            sh[j] = (b ? b[c] : 0.0f) - mu * a[j];
            if (training && rm) rm[c] = (1 - momentum) * rm[c] + momentum * mu;
            /* PyTorch tracks the unbiased variance while normalising with the biased one */
            if (training && rv)
                rv[c] = (1 - momentum) * rv[c] +
                        momentum * (float)(var[j] * (double)M / (double)(M - 1));
        }
        bn_block_affine(yp, xp, N, C, S, c0, nb, a, sh);
    }
    return TDM_OK;
}

/* *sg = sum g[i], *sgx = sum g[i] * (x[i] - mu) */
TDM_CPU_CLONES
static void sum_g_gdev(const float *g, const float *x, int64_t n, float mu, float *sg, float *sgx) {
    v8f a1 = v8_set1(0), a2 = v8_set1(0), m = v8_set1(mu);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f gv = v8_load(g + i);
        a1 += gv;
        a2 += gv * (v8_load(x + i) - m);
    }
    float s1 = v8_hsum(a1), s2 = v8_hsum(a2);
    for (; i < n; i++) {
        s1 += g[i];
        s2 += g[i] * (x[i] - mu);
    }
    *sg = s1;
    *sgx = s2;
}

/* gx[i] = (g[i] - mg - (x[i] - mu) * k) * scale: the normalisation's Jacobian applied to g */
TDM_CPU_CLONES
static void centred_grad(float *gx, const float *g, const float *x, int64_t n, float mu, float mg,
                         float k, float scale) {
    v8f vm = v8_set1(mu), vg = v8_set1(mg), vk = v8_set1(k), vs = v8_set1(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        v8_store(gx + i, (v8_load(g + i) - vg - (v8_load(x + i) - vm) * vk) * vs);
    for (; i < n; i++) gx[i] = (g[i] - mg - (x[i] - mu) * k) * scale;
}

/* For channels [c0, c0 + nb): sg = sum of g, sgx = sum of g * (x - mean), in double, in a
 * fixed order (both batch-norm backward kernels need them). */
TDM_CPU_CLONES
static void channel_grad_sums(const float *g, const float *xp, const float *mean, int64_t N,
                              int64_t C, int64_t S, int64_t c0, int nb, double *sg, double *sgx) {
    for (int j = 0; j < nb; j++) sg[j] = sgx[j] = 0;
    for (int64_t n = 0; n < N; n++)
        for (int j = 0; j < nb; j++) {
            int64_t base = (n * C + c0 + j) * S;
            float a1, a2;
            sum_g_gdev(g + base, xp + base, S, mean[c0 + j], &a1, &a2);
            sg[j] += a1;
            sgx[j] += a2;
        }
}

int tdm_cpu_batch_norm_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                const tdm_tensor *gy, const tdm_tensor *x, const tdm_tensor *weight,
                                const tdm_tensor *save_mean, const tdm_tensor *save_invstd,
                                bool training) {
    if (tdm_cpu_lowp_any(8,
                         (const tdm_tensor *[]){gx, gw, gb, gy, x, weight, save_mean, save_invstd}))
        return tdm_cpu_lowp_batch_norm_backward(gx, gw, gb, gy, x, weight, save_mean, save_invstd,
                                                training);
    int64_t N, C, S;
    bn_dims(x, &N, &C, &S);
    double M = (double)N * (double)S;
    const float *xp = cf(x), *g = cf(gy), *w = cf(weight), *sm = cf(save_mean),
                *si = cf(save_invstd);
    float *gxp = mf(gx), *gwp = mf(gw), *gbp = mf(gb);
    double sg[BN_BLOCK], sgx[BN_BLOCK]; /* sum gy, sum gy * (x - mean) */
    for (int64_t c0 = 0; c0 < C; c0 += BN_BLOCK) {
        int nb = (int)(C - c0 < BN_BLOCK ? C - c0 : BN_BLOCK);
        bool need_sums = gwp || gbp || (gxp && training);
        if (need_sums)
            channel_grad_sums(g, xp, sm, N, C, S, c0, nb, sg, sgx);
        else
            for (int j = 0; j < nb; j++) sg[j] = sgx[j] = 0;
        for (int j = 0; j < nb; j++) {
            int64_t c = c0 + j;
            if (gbp) gbp[c] = (float)sg[j];
            if (gwp) gwp[c] = (float)(sgx[j] * si[c]);
        }
        if (!gxp) continue;
        /* training: gx = w*invstd * (gy - mean(gy) - xhat * mean(gy * xhat)) */
        for (int64_t n = 0; n < N; n++)
            for (int j = 0; j < nb; j++) {
                int64_t c = c0 + j, base = (n * C + c) * S;
                float inv = si[c], scale = inv * (w ? w[c] : 1.0f), mu = sm[c];
                if (training) {
                    float mg = (float)(sg[j] / M);
                    float k = (float)(sgx[j] / M) * inv * inv;
                    centred_grad(gxp + base, g + base, xp + base, S, mu, mg, k, scale);
                } else {
                    simd_affine(gxp + base, g + base, S, scale, 0.0f);
                }
            }
    }
    return TDM_OK;
}

/* ---- synchronised batch norm: this rank's share of the statistics ---- */

TDM_CPU_CLONES
int tdm_cpu_batch_norm_stats(tdm_tensor *sum, const tdm_tensor *x, const tdm_tensor *center) {
    if (tdm_cpu_lowp_any(3, (const tdm_tensor *[]){sum, x, center}))
        return tdm_cpu_lowp_batch_norm_stats(sum, x, center);
    int64_t N, C, S;
    bn_dims(x, &N, &C, &S);
    const float *xp = cf(x), *ctr = cf(center);
    float *out = mf(sum);
    double acc[BN_BLOCK];
    for (int64_t c0 = 0; c0 < C; c0 += BN_BLOCK) {
        int nb = (int)(C - c0 < BN_BLOCK ? C - c0 : BN_BLOCK);
        for (int j = 0; j < nb; j++) acc[j] = 0;
        for (int64_t n = 0; n < N; n++)
            for (int j = 0; j < nb; j++) {
                const float *p = xp + (n * C + c0 + j) * S;
                acc[j] += ctr ? simd_sq_dev_f64(p, S, ctr[c0 + j]) : simd_sum(p, S);
            }
        for (int j = 0; j < nb; j++) out[c0 + j] = (float)acc[j];
    }
    return TDM_OK;
}

TDM_CPU_CLONES
int tdm_cpu_batch_norm_backward_reduce(tdm_tensor *sum_dy, tdm_tensor *sum_dy_xmu, tdm_tensor *gw,
                                       tdm_tensor *gb, const tdm_tensor *gy, const tdm_tensor *x,
                                       const tdm_tensor *mean, const tdm_tensor *invstd) {
    if (tdm_cpu_lowp_any(8,
                         (const tdm_tensor *[]){sum_dy, sum_dy_xmu, gw, gb, gy, x, mean, invstd}))
        return tdm_cpu_lowp_batch_norm_backward_reduce(sum_dy, sum_dy_xmu, gw, gb, gy, x, mean,
                                                       invstd);
    int64_t N, C, S;
    bn_dims(x, &N, &C, &S);
    const float *xp = cf(x), *g = cf(gy), *sm = cf(mean), *si = cf(invstd);
    float *sdy = mf(sum_dy), *sdx = mf(sum_dy_xmu), *gwp = mf(gw), *gbp = mf(gb);
    double sg[BN_BLOCK], sgx[BN_BLOCK];
    for (int64_t c0 = 0; c0 < C; c0 += BN_BLOCK) {
        int nb = (int)(C - c0 < BN_BLOCK ? C - c0 : BN_BLOCK);
        channel_grad_sums(g, xp, sm, N, C, S, c0, nb, sg, sgx);
        for (int j = 0; j < nb; j++) {
            int64_t c = c0 + j;
            sdy[c] = (float)sg[j];
            sdx[c] = (float)sgx[j];
            if (gbp) gbp[c] = (float)sg[j];
            if (gwp) gwp[c] = (float)(sgx[j] * si[c]);
        }
    }
    return TDM_OK;
}

TDM_CPU_CLONES
int tdm_cpu_batch_norm_backward_elemt(tdm_tensor *gx, const tdm_tensor *gy, const tdm_tensor *x,
                                      const tdm_tensor *weight, const tdm_tensor *mean,
                                      const tdm_tensor *invstd, const tdm_tensor *sum_dy,
                                      const tdm_tensor *sum_dy_xmu, double count) {
    if (tdm_cpu_lowp_any(
            8, (const tdm_tensor *[]){gx, gy, x, weight, mean, invstd, sum_dy, sum_dy_xmu}))
        return tdm_cpu_lowp_batch_norm_backward_elemt(gx, gy, x, weight, mean, invstd, sum_dy,
                                                      sum_dy_xmu, count);
    int64_t N, C, S;
    bn_dims(x, &N, &C, &S);
    const float *xp = cf(x), *g = cf(gy), *w = cf(weight), *sm = cf(mean), *si = cf(invstd),
                *sdy = cf(sum_dy), *sdx = cf(sum_dy_xmu);
    float *gxp = mf(gx);
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < C; c++) {
            int64_t base = (n * C + c) * S;
            float inv = si[c];
            float mg = (float)((double)sdy[c] / count);
            float k = (float)((double)sdx[c] / count) * inv * inv;
            centred_grad(gxp + base, g + base, xp + base, S, sm[c], mg, k, inv * (w ? w[c] : 1.0f));
        }
    return TDM_OK;
}

/* ---- layer norm: rows of x [rows, cols]; rows = numel(mean) ---- */

/* s = x + res over a row of n elements, returning simd_sum(s) with simd_sum's order (the bits of
 * an add kernel and then the norm's first pass, in one pass): res f32, or bf16/f16 widened into
 * s first (exactly; the f32 sum is the same either way round) */
static inline float residual_row_add(float *s, const float *x, const tdm_tensor *res, int64_t at,
                                     int64_t n) {
    const float *r = s;
    if (res->dtype == TDM_F32)
        r = cf(res) + at;
    else
        tdm_cpu_lowp_widen(s, (const uint16_t *)tdm_data_ptr(res) + at, n, res->dtype);
    v8f a0 = v8_set1(0), a1 = v8_set1(0);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v8f u = v8_load(x + i) + v8_load(r + i), v = v8_load(x + i + 8) + v8_load(r + i + 8);
        v8_store(s + i, u);
        v8_store(s + i + 8, v);
        a0 += u;
        a1 += v;
    }
    for (; i + 8 <= n; i += 8) {
        v8f u = v8_load(x + i) + v8_load(r + i);
        v8_store(s + i, u);
        a0 += u;
    }
    float sum = v8_hsum(a0 + a1);
    for (; i < n; i++) sum += (s[i] = x[i] + r[i]);
    return sum;
}

TDM_CPU_CLONES
int tdm_cpu_layer_norm(tdm_tensor *y, tdm_tensor *mean, tdm_tensor *rstd, const tdm_tensor *x,
                       const tdm_tensor *weight, const tdm_tensor *bias, float eps,
                       const tdm_tensor *res, tdm_tensor *sum) {
    if (res && x->dtype != TDM_F32) { /* the sum rounded to bf16/f16 first, then its norm */
        int rc = tdm_cpu_binary(TDM_BIN_ADD, sum, x, res);
        return rc ? rc : tdm_cpu_layer_norm(y, mean, rstd, sum, weight, bias, eps, NULL, NULL);
    }
    if (tdm_cpu_lowp_any(6, (const tdm_tensor *[]){y, mean, rstd, x, weight, bias}))
        return tdm_cpu_lowp_layer_norm(y, mean, rstd, x, weight, bias, eps, res, sum);
    int64_t rows = tdm_numel(mean), cols = rows ? tdm_numel(x) / rows : 0;
    const float *xp = cf(x), *w = cf(weight), *b = cf(bias);
    float *yp = mf(y), *mp = mf(mean), *rp = mf(rstd), *sp = res ? mf(sum) : NULL;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = xp + r * cols;
        float *yr = yp + r * cols;
        float total;
        if (sp) { /* the row's sum, normalised while it is in cache */
            total = residual_row_add(sp + r * cols, xr, res, r * cols, cols);
            xr = sp + r * cols;
        } else {
            total = simd_sum(xr, cols);
        }
        float m = (float)((double)total / (double)cols);
        double var = simd_sq_dev_f64(xr, cols, m) / (double)cols; /* biased, as PyTorch */
        float inv = (float)(1.0 / sqrt(var + (double)eps));
        mp[r] = m;
        rp[r] = inv;
        if (!w && !b) {
            simd_affine(yr, xr, cols, inv, -m * inv);
            continue;
        }
        v8f vm = v8_set1(m), vi = v8_set1(inv), one = v8_set1(1), zero = v8_set1(0);
        int64_t c = 0;
        for (; c + 8 <= cols; c += 8) {
            v8f h = (v8_load(xr + c) - vm) * vi;
            v8_store(yr + c, h * (w ? v8_load(w + c) : one) + (b ? v8_load(b + c) : zero));
        }
        for (; c < cols; c++) yr[c] = (xr[c] - m) * inv * (w ? w[c] : 1.0f) + (b ? b[c] : 0.0f);
    }
    return TDM_OK;
}

/* One row of the layer-norm backward: gx = rstd * (d - mean(d) - xhat * mean(d * xhat)) with
 * d = gy * w, plus gres's row when given (added after, as an add kernel would: no multiply-add
 * across the two); gw += gy * xhat and gb += gy. */
TDM_CPU_CLONES
static void layer_norm_row_backward(float *gx, float *gw, float *gb, const float *g, const float *x,
                                    const float *w, const float *gres, int64_t n, float m,
                                    float inv) {
    v8f vm = v8_set1(m), vi = v8_set1(inv), one = v8_set1(1);
    v8f ad = v8_set1(0), adx = v8_set1(0);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        v8f gv = v8_load(g + c), h = (v8_load(x + c) - vm) * vi;
        v8f d = gv * (w ? v8_load(w + c) : one);
        ad += d;
        adx += d * h;
        if (gw) v8_store(gw + c, v8_load(gw + c) + gv * h);
        if (gb) v8_store(gb + c, v8_load(gb + c) + gv);
    }
    float sd = v8_hsum(ad), sdx = v8_hsum(adx);
    for (int64_t k = c; k < n; k++) {
        float h = (x[k] - m) * inv, d = g[k] * (w ? w[k] : 1.0f);
        sd += d;
        sdx += d * h;
        if (gw) gw[k] += g[k] * h;
        if (gb) gb[k] += g[k];
    }
    if (!gx) return;
    float md = sd / (float)n, mdx = sdx / (float)n;
    v8f vmd = v8_set1(md), vmdx = v8_set1(mdx);
    for (c = 0; c + 8 <= n; c += 8) {
        v8f h = (v8_load(x + c) - vm) * vi;
        v8f d = v8_load(g + c) * (w ? v8_load(w + c) : one);
        v8_store(gx + c, vi * (d - vmd - h * vmdx));
    }
    for (; c < n; c++) {
        float h = (x[c] - m) * inv, d = g[c] * (w ? w[c] : 1.0f);
        gx[c] = inv * (d - md - h * mdx);
    }
    if (gres)
        for (c = 0; c < n; c++) gx[c] = gres[c] + gx[c];
}

TDM_CPU_CLONES
int tdm_cpu_layer_norm_backward(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                const tdm_tensor *gy, const tdm_tensor *x, const tdm_tensor *weight,
                                const tdm_tensor *mean, const tdm_tensor *rstd,
                                const tdm_tensor *gres) {
    if (gres && (!gx || gres == gx || tdm_numel(gres) != tdm_numel(x) || !tdm_is_contiguous(gres) ||
                 gres->dtype != gx->dtype))
        return tdm_raise(TDM_ERR_ARG, "cpu layer_norm_backward: gres must be contiguous, of x's "
                                      "size and gx's dtype, with a gx other than it");
    if (tdm_cpu_lowp_any(9, (const tdm_tensor *[]){gx, gw, gb, gy, x, weight, mean, rstd, gres}))
        return tdm_cpu_lowp_layer_norm_backward(gx, gw, gb, gy, x, weight, mean, rstd, gres);
    int64_t rows = tdm_numel(mean), cols = rows ? tdm_numel(x) / rows : 0;
    const float *xp = cf(x), *g = cf(gy), *w = cf(weight), *mp = cf(mean), *rp = cf(rstd);
    const float *gr = cf(gres);
    float *gxp = mf(gx), *gwp = mf(gw), *gbp = mf(gb);
    if (gwp) memset(gwp, 0, sizeof(float) * (size_t)cols);
    if (gbp) memset(gbp, 0, sizeof(float) * (size_t)cols);
    for (int64_t r = 0; r < rows; r++)
        layer_norm_row_backward(gxp ? gxp + r * cols : NULL, gwp, gbp, g + r * cols, xp + r * cols,
                                w, gr ? gr + r * cols : NULL, cols, mp[r], rp[r]);
    return TDM_OK;
}
