/* CPU element-wise kernels: unary ops and their derivatives, binary ops with broadcasting
 * (inputs arrive as stride-0 views), and axpy for gradient accumulation.
 *
 * Every kernel walks its operands with one strided iterator (ew_iter): dims of size 1 are
 * dropped and adjacent dims that are contiguous for every operand are merged, so a
 * contiguous tensor becomes one long row, [N, C] + [C] becomes N rows of C with the second
 * operand's row stride 0, and [N, C] * [N, 1] becomes N rows with an inner stride of 0. The
 * inner loops are specialised for unit and zero strides so that the compiler vectorises
 * them; the operator switch sits outside the element loop.
 *
 * bf16 and f16 operands (issue 37) take the same row functions: each row is cut into chunks
 * of LP_CHUNK elements, a low-precision operand's chunk is widened into a stack buffer
 * (half.h's vectorised conversions; a strided one gathered, a broadcast one a single
 * element), the row function computes in fp32, and a low-precision output's chunk is rounded
 * once on its way out. So every op keeps one formula, the buffers stay in L1, no temporary
 * tensor is allocated (cpu_lowp.c's adapter would widen whole tensors), and f32 operands in
 * a mix are read in place. The dtype test is made once per call; the fp32 path is as it was.
 */
#include <assert.h>
#include <math.h>

#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_lowp.h"
#include "backend/unary_math.h"
#include "backend/cpu/cpu_isa.h"
#include "backend/cpu/cpu_iter.h"
#include "backend/cpu/cpu_math.h"
#include "tandem/half.h"

/* ---- bf16 and f16 rows ------------------------------------------------------------------ */

/* Elements converted at a time: three buffers of them sit on the stack, in L1. */
#define LP_CHUNK 512

/* n elements of a row of a tensor's data (base: its first element, dtype dt) from element off
 * with stride s, as floats: an f32 row in place, a bf16 or f16 one widened into buf (stride
 * 1; a broadcast row, s == 0, as its one element). *so receives the stride to read it with. */
static const float *lp_row_in(float *buf, const void *base, tdm_dtype dt, int64_t off, int64_t s,
                              int64_t n, int64_t *so) {
    if (dt == TDM_F32) {
        *so = s;
        return (const float *)base + off;
    }
    const uint16_t *p = (const uint16_t *)base + off;
    *so = s == 0 ? 0 : 1;
    if (s == 0 || s == 1) {
        size_t m = s == 0 ? 1 : (size_t)n;
        if (dt == TDM_BF16)
            tdm_bf16_to_f32(buf, p, m);
        else
            tdm_f16_to_f32(buf, p, m);
    } else {
        for (int64_t i = 0; i < n; i++)
            buf[i] = dt == TDM_BF16 ? tdm_bf16_to_float(p[i * s]) : tdm_f16_to_float(p[i * s]);
    }
    return buf;
}

/* Where a row function writes the outputs from element off of a contiguous output: in place
 * for f32, else buf, which lp_row_out_end rounds into the output (n elements). */
static float *lp_row_out(float *buf, void *base, tdm_dtype dt, int64_t off) {
    return dt == TDM_F32 ? (float *)base + off : buf;
}
static void lp_row_out_end(void *base, tdm_dtype dt, int64_t off, const float *buf, int64_t n) {
    if (dt == TDM_BF16)
        tdm_bf16_from_f32((uint16_t *)base + off, buf, (size_t)n);
    else if (dt == TDM_F16)
        tdm_f16_from_f32((uint16_t *)base + off, buf, (size_t)n);
}

/* ---- unary forward ---------------------------------------------------------------------- */

/* y[i] = EXPR(v) with v = x[i * sx]; a unit-stride copy of the loop lets it vectorise. */
#define UNARY_ROW(EXPR)                                                                            \
    do {                                                                                           \
        if (sx == 1) {                                                                             \
            for (int64_t i = 0; i < n; i++) {                                                      \
                const float v = x[i];                                                              \
                y[i] = (EXPR);                                                                     \
            }                                                                                      \
        } else {                                                                                   \
            for (int64_t i = 0; i < n; i++) {                                                      \
                const float v = x[i * sx];                                                         \
                y[i] = (EXPR);                                                                     \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* One row: y [n] contiguous, x [n] with stride sx. */
TDM_CPU_CLONES
static void unary_row(tdm_unary_op op, float *y, const float *x, int64_t sx, int64_t n, float s) {
    switch (op) {
    case TDM_UN_NEG:
        UNARY_ROW(-v);
        break;
    case TDM_UN_EXP:
        UNARY_ROW(tdm_expf(v));
        break;
    case TDM_UN_LOG:
        UNARY_ROW(logf(v));
        break;
    case TDM_UN_SQRT:
        UNARY_ROW(sqrtf(v));
        break;
    /* written so that NaN propagates, as torch.relu does */
    case TDM_UN_RELU:
        UNARY_ROW(v <= 0.0f ? 0.0f : v);
        break;
    case TDM_UN_GELU_TANH:
        /* 0.5 v (1 + tanh(u)) = v sigmoid(2u): the same value without a libm call */
        UNARY_ROW(v * tdm_sigmoidf(2.0f * TDM_GELU_BETA * (v + TDM_GELU_KAPPA * v * v * v)));
        break;
    case TDM_UN_GELU_ERF:
        UNARY_ROW(0.5f * v * (1.0f + erff(v * (float)M_SQRT1_2)));
        break;
    case TDM_UN_TANH:
        UNARY_ROW(tanhf(v));
        break;
    case TDM_UN_SIGMOID:
        UNARY_ROW(tdm_sigmoidf(v));
        break;
    case TDM_UN_ADD_SCALAR:
        UNARY_ROW(v + s);
        break;
    case TDM_UN_MUL_SCALAR:
        UNARY_ROW(v * s);
        break;
    case TDM_UN_POW_SCALAR:
        /* common exponents without powf: exact and several times faster */
        if (s == 2.0f)
            UNARY_ROW(v * v);
        else if (s == 1.0f)
            UNARY_ROW(v);
        else if (s == 0.5f)
            UNARY_ROW(sqrtf(v));
        else if (s == -1.0f)
            UNARY_ROW(1.0f / v);
        else
            UNARY_ROW(powf(v, s));
        break;
    case TDM_UN_SOFTSIGN:
        UNARY_ROW(v / (1.0f + fabsf(v)));
        break;
    }
}

/* tdm_cpu_unary with a bf16 or f16 x or y: the strided path's walk, chunked. */
static void unary_lowp(tdm_unary_op op, tdm_tensor *y, const tdm_tensor *x, float s) {
    int64_t cs[TDM_MAX_DIMS], off[EW_MAX_OPS], idx[TDM_MAX_DIMS];
    tdm_contiguous_strides(x->ndim, x->shape, cs);
    const int64_t *st[2] = {cs, x->strides};
    ew_iter it;
    ew_init(&it, x->ndim, x->shape, 2, st);
    ew_begin(&it, idx, off);
    void *yb = tdm_data_ptr(y);
    const void *xb = tdm_data_ptr(x);
    float xbuf[LP_CHUNK], ybuf[LP_CHUNK];
    for (int64_t r = 0; r < it.rows; r++, ew_next(&it, idx, off))
        for (int64_t c = 0; c < it.n; c += LP_CHUNK) {
            int64_t len = it.n - c < LP_CHUNK ? it.n - c : LP_CHUNK, sx;
            const float *xr =
                lp_row_in(xbuf, xb, x->dtype, off[1] + c * it.inner[1], it.inner[1], len, &sx);
            float *yr = lp_row_out(ybuf, yb, y->dtype, off[0] + c);
            unary_row(op, yr, xr, sx, len, s);
            lp_row_out_end(yb, y->dtype, off[0] + c, yr, len);
        }
}

static bool unary_op_valid(tdm_unary_op op) {
    return op >= TDM_UN_NEG && op <= TDM_UN_LAST;
}

int tdm_cpu_unary(tdm_unary_op op, tdm_tensor *y, const tdm_tensor *x, float s) {
    if (!unary_op_valid(op)) return tdm_raise(TDM_ERR_ARG, "cpu unary: unknown op %d", (int)op);
    /* the op refused a tensor that is not a float and allocated y with x's numel */
    assert(tdm_dtype_is_float(y->dtype) && tdm_dtype_is_float(x->dtype) &&
           tdm_numel(y) == tdm_numel(x));
    int64_t numel = tdm_numel(y);
    if (numel == 0) return TDM_OK;
    if (tdm_cpu_lowp_any(2, (const tdm_tensor *[]){y, x})) {
        unary_lowp(op, y, x, s);
        return TDM_OK;
    }
    float *yp = (float *)tdm_data_ptr(y);
    const float *xp = (const float *)tdm_data_ptr(x);
    if (tdm_is_contiguous(x)) {
        unary_row(op, yp, xp, 1, numel, s);
        return TDM_OK;
    }
    /* x strided: walk x's shape; y is contiguous, so its row-major order is the walk's */
    int64_t cs[TDM_MAX_DIMS], off[EW_MAX_OPS], idx[TDM_MAX_DIMS];
    tdm_contiguous_strides(x->ndim, x->shape, cs);
    const int64_t *st[2] = {cs, x->strides};
    ew_iter it;
    ew_init(&it, x->ndim, x->shape, 2, st);
    ew_begin(&it, idx, off);
    for (int64_t r = 0; r < it.rows; r++, ew_next(&it, idx, off))
        unary_row(op, yp + off[0], xp + off[1], it.inner[1], it.n, s);
    return TDM_OK;
}

/* ---- unary backward --------------------------------------------------------------------- */

/* gx[i] = EXPR with g = gy[i], v = x[i] (BWD_X), o = y[i] (BWD_Y) or neither (BWD_G). */
#define BWD_G(EXPR)                                                                                \
    do {                                                                                           \
        if (sg == 1) {                                                                             \
            for (int64_t i = 0; i < n; i++) {                                                      \
                const float g = gy[i];                                                             \
                gx[i] = (EXPR);                                                                    \
            }                                                                                      \
        } else {                                                                                   \
            for (int64_t i = 0; i < n; i++) {                                                      \
                const float g = gy[i * sg];                                                        \
                gx[i] = (EXPR);                                                                    \
            }                                                                                      \
        }                                                                                          \
    } while (0)

#define BWD_X(EXPR)                                                                                \
    do {                                                                                           \
        if (sg == 1 && sx == 1) {                                                                  \
            for (int64_t i = 0; i < n; i++) {                                                      \
                const float g = gy[i], v = x[i];                                                   \
                gx[i] = (EXPR);                                                                    \
            }                                                                                      \
        } else {                                                                                   \
            for (int64_t i = 0; i < n; i++) {                                                      \
                const float g = gy[i * sg], v = x[i * sx];                                         \
                gx[i] = (EXPR);                                                                    \
            }                                                                                      \
        }                                                                                          \
    } while (0)

#define BWD_Y(EXPR)                                                                                \
    do {                                                                                           \
        if (sg == 1 && sy == 1) {                                                                  \
            for (int64_t i = 0; i < n; i++) {                                                      \
                const float g = gy[i], o = y[i];                                                   \
                gx[i] = (EXPR);                                                                    \
            }                                                                                      \
        } else {                                                                                   \
            for (int64_t i = 0; i < n; i++) {                                                      \
                const float g = gy[i * sg], o = y[i * sy];                                         \
                gx[i] = (EXPR);                                                                    \
            }                                                                                      \
        }                                                                                          \
    } while (0)

static inline float gelu_tanh_grad(float v) {
    /* PyTorch's GeluBackward (tanh approximation) */
    float x2 = v * v;
    float t =
        2.0f * tdm_sigmoidf(2.0f * TDM_GELU_BETA * (v + TDM_GELU_KAPPA * x2 * v)) - 1.0f; /* tanh */
    float left = 0.5f * v, right = 1.0f + t;
    return 0.5f * right +
           left * (1.0f - t * t) * TDM_GELU_BETA * (1.0f + 3.0f * TDM_GELU_KAPPA * x2);
}

static inline float gelu_erf_grad(float v) {
    /* Phi(v) + v * phi(v); the constant is 1/sqrt(2*pi) */
    float cdf = 0.5f * (1.0f + erff(v * (float)M_SQRT1_2));
    float pdf = expf(-0.5f * v * v) * 0.3989422804014327f;
    return cdf + v * pdf;
}

static inline float pow_grad(float v, float s) {
    /* d/dv v^s = s * v^(s-1); PyTorch returns 0 for s == 0 (even at v == 0) */
    if (s == 0.0f) return 0.0f;
    if (s == 2.0f) return 2.0f * v;
    if (s == 1.0f) return 1.0f;
    return s * powf(v, s - 1.0f);
}

/* One row: gx [n] contiguous; gy, x, y with strides sg, sx, sy. */
TDM_CPU_CLONES
static void unary_bwd_row(tdm_unary_op op, float *gx, const float *gy, int64_t sg, const float *x,
                          int64_t sx, const float *y, int64_t sy, int64_t n, float s) {
    switch (op) {
    case TDM_UN_NEG:
        BWD_G(-g);
        break;
    case TDM_UN_EXP:
        BWD_Y(g * o);
        break;
    case TDM_UN_LOG:
        BWD_X(g / v);
        break;
    case TDM_UN_SQRT:
        BWD_Y(g / (2.0f * o));
        break;
    case TDM_UN_RELU:
        BWD_X(v > 0.0f ? g : 0.0f);
        break;
    case TDM_UN_GELU_TANH:
        BWD_X(g * gelu_tanh_grad(v));
        break;
    case TDM_UN_GELU_ERF:
        BWD_X(g * gelu_erf_grad(v));
        break;
    case TDM_UN_TANH:
        BWD_Y(g * (1.0f - o * o));
        break;
    case TDM_UN_SIGMOID:
        BWD_Y(g * o * (1.0f - o));
        break;
    case TDM_UN_ADD_SCALAR:
        BWD_G(g);
        break;
    case TDM_UN_MUL_SCALAR:
        BWD_G(g * s);
        break;
    case TDM_UN_POW_SCALAR:
        BWD_X(g * pow_grad(v, s));
        break;
    case TDM_UN_SOFTSIGN:
        /* from x, not y: 1 - |y| loses the small gradient's digits for large |x| */
        BWD_X(g / ((1.0f + fabsf(v)) * (1.0f + fabsf(v))));
        break;
    }
}

/* tdm_cpu_unary_backward with a bf16 or f16 operand: its walk (strides st over gx's shape),
 * chunked; saved is x or y as need says, or NULL. */
static void unary_bwd_lowp(tdm_unary_op op, tdm_tensor *gx, const tdm_tensor *gy,
                           const tdm_tensor *saved, char need, const int64_t *const *st, float s) {
    ew_iter it;
    int64_t off[EW_MAX_OPS], idx[TDM_MAX_DIMS];
    ew_init(&it, gx->ndim, gx->shape, 3, st);
    ew_begin(&it, idx, off);
    void *gxb = tdm_data_ptr(gx);
    const void *gyb = tdm_data_ptr(gy), *sb = saved ? tdm_data_ptr(saved) : NULL;
    float gbuf[LP_CHUNK], sbuf[LP_CHUNK], obuf[LP_CHUNK];
    for (int64_t r = 0; r < it.rows; r++, ew_next(&it, idx, off))
        for (int64_t c = 0; c < it.n; c += LP_CHUNK) {
            int64_t len = it.n - c < LP_CHUNK ? it.n - c : LP_CHUNK, sg, ss = 0;
            const float *g =
                lp_row_in(gbuf, gyb, gy->dtype, off[1] + c * it.inner[1], it.inner[1], len, &sg);
            const float *v = saved ? lp_row_in(sbuf, sb, saved->dtype, off[2] + c * it.inner[2],
                                               it.inner[2], len, &ss)
                                   : g;
            float *o = lp_row_out(obuf, gxb, gx->dtype, off[0] + c);
            unary_bwd_row(op, o, g, sg, need == 'x' ? v : g, ss, need == 'y' ? v : g, ss, len, s);
            lp_row_out_end(gxb, gx->dtype, off[0] + c, o, len);
        }
}

/* gx contiguous; gy, x, y any strides with gx's numel (the one the op does not need may be
 * NULL). */
int tdm_cpu_unary_backward(tdm_unary_op op, tdm_tensor *gx, const tdm_tensor *gy,
                           const tdm_tensor *x, const tdm_tensor *y, float s) {
    if (!unary_op_valid(op))
        return tdm_raise(TDM_ERR_ARG, "cpu unary_backward: unknown op %d", (int)op);
    char need = tdm_unary_bwd_needs(op);
    const tdm_tensor *saved = need == 'x' ? x : need == 'y' ? y : NULL;
    if (need && !saved)
        return tdm_raise(TDM_ERR_ARG, "cpu unary_backward: op %d needs its saved %c", (int)op,
                         need);
    /* f32 operands, or float ones of which one at least is bf16 or f16 */
    bool lowp = tdm_cpu_lowp_any(3, (const tdm_tensor *[]){gx, gy, saved});
    if ((lowp ? ew_check_float("cpu unary_backward", 2, (const tdm_tensor *[]){gx, gy})
              : ew_check_f32("cpu unary_backward", 2, (const tdm_tensor *[]){gx, gy})) ||
        ew_check_numel("cpu unary_backward", gx, gy))
        return tdm_last_status();
    if (saved && ((lowp ? ew_check_float("cpu unary_backward", 1, &saved)
                        : ew_check_f32("cpu unary_backward", 1, &saved)) ||
                  ew_check_numel("cpu unary_backward", gx, saved)))
        return tdm_last_status();
    int64_t numel = tdm_numel(gx);
    if (numel == 0) return TDM_OK;
    if (lowp) {
        int64_t cs[TDM_MAX_DIMS];
        tdm_contiguous_strides(gx->ndim, gx->shape, cs);
        const int64_t *st[3] = {cs, ew_strides_as(gy, gx, cs),
                                saved ? ew_strides_as(saved, gx, cs) : cs};
        if (!st[1] || !st[2])
            return tdm_raise(TDM_ERR_SHAPE, "cpu unary_backward: a strided operand must have "
                                            "gx's shape");
        unary_bwd_lowp(op, gx, gy, saved, need, st, s);
        return TDM_OK;
    }

    float *gxp = (float *)tdm_data_ptr(gx);
    const float *gyp = (const float *)tdm_data_ptr(gy);
    const float *sp = saved ? (const float *)tdm_data_ptr(saved) : gyp;
    const float *xp = need == 'x' ? sp : gyp, *yp = need == 'y' ? sp : gyp;
    if (tdm_is_contiguous(gy) && (!saved || tdm_is_contiguous(saved))) {
        unary_bwd_row(op, gxp, gyp, 1, xp, 1, yp, 1, numel, s);
        return TDM_OK;
    }
    /* walk gx's shape; a strided operand must have that shape, a contiguous one only its
     * numel */
    int64_t cs[TDM_MAX_DIMS], off[EW_MAX_OPS], idx[TDM_MAX_DIMS];
    tdm_contiguous_strides(gx->ndim, gx->shape, cs);
    const int64_t *st[3] = {cs, ew_strides_as(gy, gx, cs),
                            saved ? ew_strides_as(saved, gx, cs) : cs};
    if (!st[1] || !st[2])
        return tdm_raise(TDM_ERR_SHAPE, "cpu unary_backward: a strided operand must have gx's "
                                        "shape");
    ew_iter it;
    ew_init(&it, gx->ndim, gx->shape, 3, st);
    ew_begin(&it, idx, off);
    for (int64_t r = 0; r < it.rows; r++, ew_next(&it, idx, off)) {
        const float *sr = sp + off[2];
        unary_bwd_row(op, gxp + off[0], gyp + off[1], it.inner[1], need == 'x' ? sr : gyp,
                      it.inner[2], need == 'y' ? sr : gyp, it.inner[2], it.n, s);
    }
    return TDM_OK;
}

/* ---- binary ----------------------------------------------------------------------------- */

/* y[i] = a[i*sa] OP b[i*sb], with the unit and zero stride cases spelled out so that each
 * vectorises: same-shape ([N] op [N]), row broadcast ([N, C] op [C]: the inner stride of b
 * is 1 and its row stride 0) and column broadcast ([N, C] op [N, 1]: inner stride 0). */
#define BINARY_ROW(OP)                                                                             \
    do {                                                                                           \
        if (sa == 1 && sb == 1) {                                                                  \
            for (int64_t i = 0; i < n; i++) y[i] = a[i] OP b[i];                                   \
        } else if (sa == 1 && sb == 0) {                                                           \
            const float bv = b[0];                                                                 \
            for (int64_t i = 0; i < n; i++) y[i] = a[i] OP bv;                                     \
        } else if (sa == 0 && sb == 1) {                                                           \
            const float av = a[0];                                                                 \
            for (int64_t i = 0; i < n; i++) y[i] = av OP b[i];                                     \
        } else {                                                                                   \
            for (int64_t i = 0; i < n; i++) y[i] = a[i * sa] OP b[i * sb];                         \
        }                                                                                          \
    } while (0)

TDM_CPU_CLONES
static void binary_row(tdm_binary_op op, float *y, const float *a, int64_t sa, const float *b,
                       int64_t sb, int64_t n) {
    switch (op) {
    case TDM_BIN_ADD:
        BINARY_ROW(+);
        break;
    case TDM_BIN_SUB:
        BINARY_ROW(-);
        break;
    case TDM_BIN_MUL:
        BINARY_ROW(*);
        break;
    case TDM_BIN_DIV:
        BINARY_ROW(/);
        break;
    }
}

/* tdm_cpu_binary with a bf16 or f16 operand: the strided path's walk, chunked. */
static void binary_lowp(tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a, const tdm_tensor *b) {
    int64_t cs[TDM_MAX_DIMS], off[EW_MAX_OPS], idx[TDM_MAX_DIMS];
    tdm_contiguous_strides(y->ndim, y->shape, cs);
    const int64_t *st[3] = {cs, a->strides, b->strides};
    ew_iter it;
    ew_init(&it, y->ndim, y->shape, 3, st);
    ew_begin(&it, idx, off);
    void *yb = tdm_data_ptr(y);
    const void *ab = tdm_data_ptr(a), *bb = tdm_data_ptr(b);
    float abuf[LP_CHUNK], bbuf[LP_CHUNK], ybuf[LP_CHUNK];
    for (int64_t r = 0; r < it.rows; r++, ew_next(&it, idx, off))
        for (int64_t c = 0; c < it.n; c += LP_CHUNK) {
            int64_t len = it.n - c < LP_CHUNK ? it.n - c : LP_CHUNK, sa, sb;
            const float *ar =
                lp_row_in(abuf, ab, a->dtype, off[1] + c * it.inner[1], it.inner[1], len, &sa);
            const float *br =
                lp_row_in(bbuf, bb, b->dtype, off[2] + c * it.inner[2], it.inner[2], len, &sb);
            float *yr = lp_row_out(ybuf, yb, y->dtype, off[0] + c);
            binary_row(op, yr, ar, sa, br, sb, len);
            lp_row_out_end(yb, y->dtype, off[0] + c, yr, len);
        }
}

int tdm_cpu_binary(tdm_binary_op op, tdm_tensor *y, const tdm_tensor *a, const tdm_tensor *b) {
    if (op < TDM_BIN_ADD || op > TDM_BIN_DIV)
        return tdm_raise(TDM_ERR_ARG, "cpu binary: unknown op %d", (int)op);
    /* the op refused operands that are not floats or do not broadcast, and expanded them;
     * their dtypes may differ (type promotion: the op chose y's) */
    assert(tdm_dtype_is_float(y->dtype) && tdm_dtype_is_float(a->dtype) &&
           tdm_dtype_is_float(b->dtype) && ew_same_shape(y, a) && ew_same_shape(y, b));
    int64_t numel = tdm_numel(y);
    if (numel == 0) return TDM_OK;
    if (tdm_cpu_lowp_any(3, (const tdm_tensor *[]){y, a, b})) {
        binary_lowp(op, y, a, b);
        return TDM_OK;
    }
    float *yp = (float *)tdm_data_ptr(y);
    const float *ap = (const float *)tdm_data_ptr(a), *bp = (const float *)tdm_data_ptr(b);
    if (tdm_is_contiguous(a) && tdm_is_contiguous(b)) {
        binary_row(op, yp, ap, 1, bp, 1, numel); /* the common same-shape case */
        return TDM_OK;
    }
    int64_t cs[TDM_MAX_DIMS];
    tdm_contiguous_strides(y->ndim, y->shape, cs);
    int64_t off[EW_MAX_OPS], idx[TDM_MAX_DIMS];
    const int64_t *st[3] = {cs, a->strides, b->strides};
    ew_iter it;
    ew_init(&it, y->ndim, y->shape, 3, st);
    ew_begin(&it, idx, off);
    for (int64_t r = 0; r < it.rows; r++, ew_next(&it, idx, off))
        binary_row(op, yp + off[0], ap + off[1], it.inner[1], bp + off[2], it.inner[2], it.n);
    return TDM_OK;
}

/* ---- axpy ------------------------------------------------------------------------------- */

/* y[0..n) += alpha * x[0..n): the loop of both paths */
TDM_CPU_CLONES
static void axpy_row(float *y, float alpha, const float *x, int64_t n) {
    if (alpha == 1.0f) {
        for (int64_t i = 0; i < n; i++) y[i] += x[i];
    } else {
        for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
    }
}

int tdm_cpu_axpy(tdm_tensor *y, float alpha, const tdm_tensor *x) {
    bool lowp = tdm_cpu_lowp_any(2, (const tdm_tensor *[]){y, x});
    if ((lowp ? ew_check_float("cpu axpy", 2, (const tdm_tensor *[]){y, x})
              : ew_check_f32("cpu axpy", 2, (const tdm_tensor *[]){y, x})) ||
        ew_check_numel("cpu axpy", y, x))
        return tdm_last_status();
    if (!tdm_is_contiguous(y) || !tdm_is_contiguous(x))
        return tdm_raise(TDM_ERR_ARG, "cpu axpy: y and x must be contiguous");
    int64_t n = tdm_numel(y);
    if (n == 0) return TDM_OK;
    if (!lowp) {
        axpy_row((float *)tdm_data_ptr(y), alpha, (const float *)tdm_data_ptr(x), n);
        return TDM_OK;
    }
    /* a bf16 or f16 y is read, added to in fp32 and rounded once, a chunk at a time */
    void *yb = tdm_data_ptr(y);
    const void *xb = tdm_data_ptr(x);
    float ybuf[LP_CHUNK], xbuf[LP_CHUNK];
    for (int64_t c = 0; c < n; c += LP_CHUNK) {
        int64_t len = n - c < LP_CHUNK ? n - c : LP_CHUNK, unit;
        float *yr = (float *)lp_row_in(ybuf, yb, y->dtype, c, 1, len, &unit);
        axpy_row(yr, alpha, lp_row_in(xbuf, xb, x->dtype, c, 1, len, &unit), len);
        lp_row_out_end(yb, y->dtype, c, yr, len);
    }
    return TDM_OK;
}
