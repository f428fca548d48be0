/* CPU kernels for cross-entropy and binary cross-entropy on logits.
 *
 * Cross-entropy is fused: one row of logits is read twice (max, then exp-sum with the
 * smoothing sums in the same pass) and never materialised as log-probabilities; the forward
 * keeps each row's log-sum-exp, so the backward writes a row of the gradient in one pass over
 * the logits, exp(x[c] - lse) being the probability, instead of keeping an [N, C] softmax
 * alive. Without the forward's lse (a caller of the kernel alone) it recomputes it: the max,
 * then the exponentials into the gradient row as they are summed, then the row scaled.
 * bf16 and f16 logits go the same way a row at a time (row_in, row_out below).
 *
 * With per-class weights w, target t and smoothing e, PyTorch's per-sample loss is
 *   loss = (1-e) * w[t] * (-logp[t]) + e/C * sum_c w[c] * (-logp[c])
 * so d loss / d logp[c] = -coef[c] with coef[c] = e/C*w[c] + (c == t)*(1-e)*w[t], and for
 * logits d loss / d x[c] = p[c] * sum_k coef[k] - coef[c].
 */
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_lowp.h"
#include "backend/cpu/cpu_isa.h"
#include "backend/cpu/cpu_simd.h"

/* Element i of a 1-D integer or float tensor with any stride (stride 0: a broadcast). */
static inline int64_t target_at(const tdm_tensor *t, int64_t i) {
    int64_t st = t->ndim ? t->strides[0] : 0;
    if (t->dtype == TDM_I32) return ((const int32_t *)tdm_data_ptr(t))[i * st];
    return ((const int64_t *)tdm_data_ptr(t))[i * st];
}
static inline float f32_at(const tdm_tensor *t, int64_t i) {
    int64_t st = t->ndim ? t->strides[0] : 0;
    return ((const float *)tdm_data_ptr(t))[i * st];
}

/* Checks every target first, so a bad batch fails before any output is written. Targets are
 * data (on a GPU they live in device memory), so unlike the shapes the op (nn/loss.c) cannot
 * check them: this check stays in the kernel, on every backend. */
static int check_targets(const tdm_tensor *target, int64_t N, int64_t C, int64_t ignore_index) {
    for (int64_t i = 0; i < N; i++) {
        int64_t t = target_at(target, i);
        if (t != ignore_index && (t < 0 || t >= C))
            return tdm_raise(TDM_ERR_ARG,
                             "cross_entropy: target %lld (sample %lld) is out of range for C = "
                             "%lld classes",
                             (long long)t, (long long)i, (long long)C);
    }
    return TDM_OK;
}

/* sum_c exp(x[c] - shift), in lanes */
TDM_CPU_CLONES
static float sum_exp(const float *x, int64_t C, float shift) {
    v8f acc = v8_set1(0), m = v8_set1(shift);
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) acc += v8_exp(v8_load(x + c) - m);
    float s = v8_hsum(acc);
    for (; c < C; c++) s += expf(x[c] - shift);
    return s;
}

/* y[c] = exp(x[c] - shift); returns their sum, added in sum_exp's order. */
TDM_CPU_CLONES
static float exp_into(float *y, const float *x, int64_t C, float shift) {
    v8f acc = v8_set1(0), m = v8_set1(shift);
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {
        v8f p = v8_exp(v8_load(x + c) - m);
        v8_store(y + c, p);
        acc += p;
    }
    float s = v8_hsum(acc);
    for (; c < C; c++) s += y[c] = expf(x[c] - shift);
    return s;
}

/* sum_c w[c] * x[c] */
TDM_CPU_CLONES
static float dot(const float *w, const float *x, int64_t C) {
    v8f acc = v8_set1(0);
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) acc += v8_load(w + c) * v8_load(x + c);
    float s = v8_hsum(acc);
    for (; c < C; c++) s += w[c] * x[c];
    return s;
}

/* Row statistics: lse (log-sum-exp; 0 for log-prob input) and, when smoothing, the weighted
 * sum of the row's -logp over classes. */
TDM_CPU_CLONES
static void ce_row(const float *x, int64_t C, const float *w, double wtotal, bool is_logits,
                   bool smooth, double *lse_out, double *smooth_out) {
    double lse = 0, sx = 0;
    if (is_logits) {
        float mx = simd_max(x, C); /* the shift keeps exp from overflowing */
        lse = mx + log((double)sum_exp(x, C, mx));
    }
    if (smooth) sx = w ? dot(w, x, C) : simd_sum(x, C);
    *lse_out = lse;
    *smooth_out = lse * wtotal - sx; /* sum_c w[c] * (lse - x[c]) */
}

/* A sample's loss from its row (target t), and the row's lse (0 for log-probabilities). */
TDM_CPU_CLONES
static float sample_loss(const float *xr, int64_t C, int64_t t, const float *w, double wtotal,
                         double e, bool is_logits, double *row_lse) {
    double sm;
    ce_row(xr, C, w, wtotal, is_logits, e > 0, row_lse, &sm);
    double l = (1 - e) * (w ? w[t] : 1.0) * (*row_lse - xr[t]);
    if (e > 0) l += e / (double)C * sm;
    return (float)l;
}

/* bf16 and f16 logits are read a row at a time: widened into buf, computed on in f32, their
 * gradient row narrowed once from f32. The bits of the f32 kernel on f32 copies, without an
 * [N, C] f32 copy of the logits and of their gradient (the widening adapter, cpu_lowp.c, would
 * make both: 1.6 GB each at GPT-2's vocabulary and 8,192 tokens). */
static bool rows_lowp(const tdm_tensor *t) {
    return tdm_cpu_lowp_any(1, &t);
}
static const float *row_in(const tdm_tensor *x, int64_t i, int64_t C, float *buf) {
    if (!rows_lowp(x)) return (const float *)tdm_data_ptr(x) + i * C;
    tdm_cpu_lowp_widen(buf, (const uint16_t *)tdm_data_ptr(x) + i * C, C, x->dtype);
    return buf;
}
static void row_out(tdm_tensor *gx, int64_t i, int64_t C, const float *row) {
    tdm_cpu_lowp_narrow((uint16_t *)tdm_data_ptr(gx) + i * C, row, C, gx->dtype);
}
/* A row's scratch where t is bf16/f16, from the device's cache (*hold, released with
 * tdm_storage_release); NULL with nothing held where t is f32. */
static float *row_buf(const tdm_tensor *t, int64_t C, tdm_storage **hold) {
    *hold = NULL;
    if (!rows_lowp(t)) return NULL;
    *hold = tdm_storage_new(sizeof(float) * (size_t)(C ? C : 1), t->device);
    return *hold ? (float *)(*hold)->data : NULL;
}

static double weight_total(const float *w, int64_t C) {
    if (!w) return (double)C;
    double s = 0;
    for (int64_t c = 0; c < C; c++) s += w[c];
    return s;
}

/* gr[c] = exp(x[c] - lse) * total - ge * w[c]: one pass over the row. */
TDM_CPU_CLONES
static void grad_row(float *gr, const float *xr, int64_t C, float lse, float total, float ge,
                     const float *w) {
    v8f vl = v8_set1(lse), vt = v8_set1(total), ve = v8_set1(ge);
    int64_t c = 0;
    for (; c + 8 <= C; c += 8)
        v8_store(gr + c, v8_exp(v8_load(xr + c) - vl) * vt - (w ? ve * v8_load(w + c) : ve));
    for (; c < C; c++) gr[c] = expf(xr[c] - lse) * total - ge * (w ? w[c] : 1.0f);
}

/* grad_row without the row's lse: the exponentials go into gr as they are summed, then gr is
 * scaled in place (a row of 50,257 classes stays in L2), one exp an element instead of two. */
TDM_CPU_CLONES
static void grad_row_recompute(float *gr, const float *xr, int64_t C, float total, float ge,
                               const float *w) {
    float sum = exp_into(gr, xr, C, simd_max(xr, C));
    v8f vt = v8_set1(total / sum), ve = v8_set1(ge);
    int64_t c = 0;
    for (; c + 8 <= C; c += 8)
        v8_store(gr + c, v8_load(gr + c) * vt - (w ? ve * v8_load(w + c) : ve));
    for (; c < C; c++) gr[c] = gr[c] * (total / sum) - ge * (w ? w[c] : 1.0f);
}

TDM_CPU_CLONES
int tdm_cpu_cross_entropy(tdm_tensor *loss, tdm_tensor *wsum, tdm_tensor *lse, const tdm_tensor *x,
                          const tdm_tensor *target, const tdm_tensor *weight, int64_t ignore_index,
                          float smoothing, bool is_logits) {
    if (tdm_cpu_lowp_any(4, (const tdm_tensor *[]){loss, wsum, lse, weight}))
        return tdm_cpu_lowp_cross_entropy(loss, wsum, lse, x, target, weight, ignore_index,
                                          smoothing, is_logits);
    int64_t N = x->shape[0], C = x->shape[1];
    int rc = check_targets(target, N, C, ignore_index);
    if (rc) return rc;
    tdm_storage *xhold;
    float *xbuf = row_buf(x, C, &xhold);
    if (rows_lowp(x) && !xbuf) return tdm_last_status();
    const float *w = weight ? (const float *)tdm_data_ptr(weight) : NULL;
    float *lp = (float *)tdm_data_ptr(loss), *wp = wsum ? (float *)tdm_data_ptr(wsum) : NULL;
    float *sp = lse && is_logits ? (float *)tdm_data_ptr(lse) : NULL;
    double e = smoothing, wtotal = weight_total(w, C);
    for (int64_t i = 0; i < N; i++) {
        int64_t t = target_at(target, i);
        if (t == ignore_index) {
            lp[i] = 0;
            if (wp) wp[i] = 0;
            continue;
        }
        double row_lse;
        lp[i] = sample_loss(row_in(x, i, C, xbuf), C, t, w, wtotal, e, is_logits, &row_lse);
        if (sp) sp[i] = (float)row_lse;
        if (wp) wp[i] = w ? w[t] : 1.0f;
    }
    tdm_storage_release(xhold);
    return TDM_OK;
}

/* Row i's gradient for an upstream g into gr (f32); lse: the row's log-sum-exp, or NULL
 * (recomputed from xr). The one body of the backward and of the reduced loss's gradient, so
 * both give the same bits. */
TDM_CPU_CLONES
static void ce_grad_row(float *gr, const float *xr, int64_t C, int64_t t, float g, const float *lse,
                        const float *w, float e, double wtotal, bool is_logits) {
    float eC = e / (float)C, wt = w ? w[t] : 1.0f;
    float ge = g * eC;
    if (is_logits) {
        /* gx[c] = g * (p[c] * sum_k coef[k] - e/C * w[c]), p[c] = exp(x[c] - lse) */
        float total = g * (float)((1 - e) * wt + eC * wtotal);
        if (lse)
            grad_row(gr, xr, C, *lse, total, ge, w);
        else
            grad_row_recompute(gr, xr, C, total, ge, w);
    } else {
        for (int64_t c = 0; c < C; c++) gr[c] = -ge * (w ? w[c] : 1.0f);
    }
    gr[t] -= g * (1 - e) * wt;
}

/* Zeros row i of gx (an ignored sample), through gbuf where gx is bf16/f16. */
static void zero_row(tdm_tensor *gx, int64_t i, int64_t C, float *gbuf) {
    float *gr = gbuf ? gbuf : (float *)tdm_data_ptr(gx) + i * C;
    for (int64_t c = 0; c < C; c++) gr[c] = 0;
    if (gbuf) row_out(gx, i, C, gr);
}

TDM_CPU_CLONES
int tdm_cpu_cross_entropy_backward(tdm_tensor *gx, const tdm_tensor *gloss, const tdm_tensor *x,
                                   const tdm_tensor *lse, const tdm_tensor *target,
                                   const tdm_tensor *weight, int64_t ignore_index, float smoothing,
                                   bool is_logits) {
    /* x and gx in one dtype (the kernel's contract) read and written a row at a time */
    if (tdm_cpu_lowp_any(3, (const tdm_tensor *[]){gloss, lse, weight}) || gx->dtype != x->dtype)
        return tdm_cpu_lowp_cross_entropy_backward(gx, gloss, x, lse, target, weight, ignore_index,
                                                   smoothing, is_logits);
    int64_t N = x->shape[0], C = x->shape[1];
    int rc = check_targets(target, N, C, ignore_index);
    if (rc) return rc;
    tdm_storage *xhold, *ghold;
    float *xbuf = row_buf(x, C, &xhold), *gbuf = row_buf(gx, C, &ghold);
    if (rows_lowp(x) && (!xbuf || !gbuf)) {
        tdm_storage_release(xhold);
        tdm_storage_release(ghold);
        return tdm_last_status();
    }
    const float *w = weight ? (const float *)tdm_data_ptr(weight) : NULL;
    double wtotal = weight_total(w, C);
    for (int64_t i = 0; i < N; i++) {
        int64_t t = target_at(target, i);
        if (t == ignore_index) {
            zero_row(gx, i, C, gbuf);
            continue;
        }
        float *gr = gbuf ? gbuf : (float *)tdm_data_ptr(gx) + i * C, li = lse ? f32_at(lse, i) : 0;
        ce_grad_row(gr, row_in(x, i, C, xbuf), C, t, f32_at(gloss, i), lse ? &li : NULL, w,
                    smoothing, wtotal, is_logits);
        if (gbuf) row_out(gx, i, C, gr);
    }
    tdm_storage_release(xhold);
    tdm_storage_release(ghold);
    return TDM_OK;
}

/* sum_i w[t_i] over the samples not ignored, in double (the reduced loss's mean denominator) */
static double weight_of_targets(const tdm_tensor *target, int64_t N, const float *w,
                                int64_t ignore_index) {
    double s = 0;
    for (int64_t i = 0; i < N; i++) {
        int64_t t = target_at(target, i);
        if (t != ignore_index) s += w ? w[t] : 1.0f;
    }
    return s;
}

/* The forward's rows, their sum, and each row's gradient for 1/den while the row is at hand. */
TDM_CPU_CLONES
int tdm_cpu_cross_entropy_reduced(tdm_tensor *out, tdm_tensor *den, tdm_tensor *lse, tdm_tensor *gx,
                                  const tdm_tensor *x, const tdm_tensor *target,
                                  const tdm_tensor *weight, int64_t ignore_index, float smoothing,
                                  bool is_logits, bool mean) {
    if (tdm_cpu_lowp_any(4, (const tdm_tensor *[]){out, den, lse, weight}) ||
        (gx && gx->dtype != x->dtype))
        return tdm_raise(TDM_ERR_DTYPE, "cross_entropy_reduced: out, den, lse and weight must "
                                        "be f32 and gx in x's dtype");
    int64_t N = x->shape[0], C = x->shape[1];
    int rc = check_targets(target, N, C, ignore_index);
    if (rc) return rc;
    tdm_storage *xhold, *ghold = NULL;
    float *xbuf = row_buf(x, C, &xhold), *gbuf = gx ? row_buf(gx, C, &ghold) : NULL;
    if (rows_lowp(x) && (!xbuf || (gx && !gbuf))) {
        tdm_storage_release(xhold);
        tdm_storage_release(ghold);
        return tdm_last_status();
    }
    const float *w = weight ? (const float *)tdm_data_ptr(weight) : NULL;
    float *sp = lse && is_logits ? (float *)tdm_data_ptr(lse) : NULL;
    double e = smoothing, wtotal = weight_total(w, C), sum = 0;
    /* the backward's upstream for each sample: the mean's d out / d loss[i] */
    float d = mean ? (float)weight_of_targets(target, N, w, ignore_index) : 1.0f, g = 1.0f / d;
    for (int64_t i = 0; i < N; i++) {
        int64_t t = target_at(target, i);
        if (t == ignore_index) {
            if (gx) zero_row(gx, i, C, gbuf);
            continue;
        }
        const float *xr = row_in(x, i, C, xbuf);
        double row_lse;
        /* the per-sample losses' f32 values, as cross_entropy's */
        sum += sample_loss(xr, C, t, w, wtotal, e, is_logits, &row_lse);
        float lf = (float)row_lse;
        if (sp) sp[i] = lf;
        if (!gx) continue;
        float *gr = gbuf ? gbuf : (float *)tdm_data_ptr(gx) + i * C;
        ce_grad_row(gr, xr, C, t, g, is_logits ? &lf : NULL, w, smoothing, wtotal, is_logits);
        if (gbuf) row_out(gx, i, C, gr);
    }
    *(float *)tdm_data_ptr(out) = mean ? (float)sum / d : (float)sum;
    *(float *)tdm_data_ptr(den) = d;
    tdm_storage_release(xhold);
    tdm_storage_release(ghold);
    return TDM_OK;
}

/* loss = max(x, 0) - x*y + log1p(exp(-|x|)): never exponentiates a positive number. */
TDM_CPU_CLONES
int tdm_cpu_bce_logits(tdm_tensor *loss, const tdm_tensor *x, const tdm_tensor *y) {
    if (tdm_cpu_lowp_any(3, (const tdm_tensor *[]){loss, x, y}))
        return tdm_cpu_lowp_bce_logits(loss, x, y);
    int64_t n = tdm_numel(x), i = 0;
    const float *xp = (const float *)tdm_data_ptr(x), *yp = (const float *)tdm_data_ptr(y);
    float *lp = (float *)tdm_data_ptr(loss);
    v8f zero = v8_set1(0);
    for (; i + 8 <= n; i += 8) {
        v8f v = v8_load(xp + i);
        v8f l = v8_max(v, zero) - v * v8_load(yp + i) + v8_log1p_unit(v8_exp(-v8_abs(v)));
        v8_store(lp + i, l);
    }
    for (; i < n; i++) {
        float v = xp[i];
        lp[i] = (v > 0 ? v : 0) - v * yp[i] + log1pf(expf(-fabsf(v)));
    }
    return TDM_OK;
}

TDM_CPU_CLONES
int tdm_cpu_bce_logits_backward(tdm_tensor *gx, const tdm_tensor *g, const tdm_tensor *x,
                                const tdm_tensor *y) {
    if (tdm_cpu_lowp_any(4, (const tdm_tensor *[]){gx, g, x, y}))
        return tdm_cpu_lowp_bce_logits_backward(gx, g, x, y);
    int64_t n = tdm_numel(x), i = 0;
    const float *xp = (const float *)tdm_data_ptr(x), *yp = (const float *)tdm_data_ptr(y);
    const float *gp = (const float *)tdm_data_ptr(g);
    float *out = (float *)tdm_data_ptr(gx);
    /* sigmoid from z = exp(-|x|): 1/(1+z) for x >= 0, z/(1+z) below, stable on both sides */
    v8f one = v8_set1(1), zero = v8_set1(0);
    for (; i + 8 <= n; i += 8) {
        v8f v = v8_load(xp + i), z = v8_exp(-v8_abs(v));
        v8f s = v8_select(v >= zero, one, z) / (one + z);
        v8_store(out + i, v8_load(gp + i) * (s - v8_load(yp + i)));
    }
    for (; i < n; i++) {
        float v = xp[i], z = expf(-fabsf(v));
        float s = v >= 0 ? 1.0f / (1.0f + z) : z / (1.0f + z);
        out[i] = gp[i] * (s - yp[i]);
    }
    return TDM_OK;
}
