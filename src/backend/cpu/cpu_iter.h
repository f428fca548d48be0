/* A strided N-d iterator shared by the CPU element-wise and reduction kernels.
 *
 * Up to EW_MAX_OPS operands are walked together over one shape, each with its own strides (0
 * for a broadcast dim). ew_init drops dims of size 1 and merges neighbouring dims that are
 * contiguous for every operand, so the walk is a loop over rows (it.rows of them, it.n
 * elements long, inner strides it.inner[k]) whose bodies are tight loops the compiler can
 * vectorise. Row offsets advance like an odometer over the outer dims.
 *
 *   ew_iter it;  ew_init(&it, ndim, shape, 3, strides);
 *   int64_t off[EW_MAX_OPS], idx[TDM_MAX_DIMS];
 *   for (int64_t r = 0; r < it.rows; r++, ew_next(&it, idx, off)) ... p[k] + off[k] ...
 */
#ifndef TDM_CPU_ITER_H
#define TDM_CPU_ITER_H

#include "backend/backend.h"

#define EW_MAX_OPS 4

typedef struct {
    int ndim; /* after merging; >= 1 */
    int nops;
    int64_t shape[TDM_MAX_DIMS];
    int64_t st[EW_MAX_OPS][TDM_MAX_DIMS];
    int64_t rows, n;           /* rows of n elements */
    int64_t inner[EW_MAX_OPS]; /* each operand's stride along a row */
} ew_iter;

static inline void ew_init(ew_iter *it, int ndim, const int64_t *shape, int nops,
                           const int64_t *const *strides) {
    int64_t sh[TDM_MAX_DIMS], st[EW_MAX_OPS][TDM_MAX_DIMS];
    int nd = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1) continue; /* its stride never matters */
        sh[nd] = shape[d];
        for (int k = 0; k < nops; k++) st[k][nd] = strides[k][d];
        nd++;
    }
    it->nops = nops;
    if (nd == 0) { /* a single element */
        it->ndim = 1;
        it->shape[0] = 1;
        for (int k = 0; k < nops; k++) it->st[k][0] = 0;
    } else {
        /* merge from the innermost dim outwards: dim d folds into the current outer-most
         * merged dim m when every operand steps over d exactly as a block of m */
        int m = TDM_MAX_DIMS - 1;
        int64_t msh[TDM_MAX_DIMS], mst[EW_MAX_OPS][TDM_MAX_DIMS];
        msh[m] = sh[nd - 1];
        for (int k = 0; k < nops; k++) mst[k][m] = st[k][nd - 1];
        for (int d = nd - 2; d >= 0; d--) {
            bool merge = true;
            for (int k = 0; k < nops; k++)
                if (st[k][d] != mst[k][m] * msh[m]) merge = false;
            if (merge) {
                msh[m] *= sh[d];
            } else {
                m--;
                msh[m] = sh[d];
                for (int k = 0; k < nops; k++) mst[k][m] = st[k][d];
            }
        }
        it->ndim = TDM_MAX_DIMS - m;
        for (int d = 0; d < it->ndim; d++) {
            it->shape[d] = msh[m + d];
            for (int k = 0; k < nops; k++) it->st[k][d] = mst[k][m + d];
        }
    }
    it->n = it->shape[it->ndim - 1];
    it->rows = 1;
    for (int d = 0; d < it->ndim - 1; d++) it->rows *= it->shape[d];
    for (int k = 0; k < nops; k++) it->inner[k] = it->st[k][it->ndim - 1];
}

static inline void ew_begin(const ew_iter *it, int64_t *idx, int64_t *off) {
    for (int d = 0; d < it->ndim; d++) idx[d] = 0;
    for (int k = 0; k < it->nops; k++) off[k] = 0;
}

/* Advances the row offsets to the next row (row-major over the outer dims). */
static inline void ew_next(const ew_iter *it, int64_t *idx, int64_t *off) {
    for (int d = it->ndim - 2; d >= 0; d--) {
        idx[d]++;
        for (int k = 0; k < it->nops; k++) off[k] += it->st[k][d];
        if (idx[d] < it->shape[d]) return;
        for (int k = 0; k < it->nops; k++) off[k] -= it->st[k][d] * it->shape[d];
        idx[d] = 0;
    }
}

static inline bool ew_same_shape(const tdm_tensor *a, const tdm_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return false;
    return true;
}

/* For a kernel's asserts: every one of the n tensors is f32 (the ops refuse other dtypes). */
static inline bool ew_all_f32(int n, const tdm_tensor *const *ts) {
    for (int i = 0; i < n; i++)
        if (ts[i]->dtype != TDM_F32) return false;
    return true;
}

/* Raises a dtype error naming the kernel unless every tensor is f32. */
static inline int ew_check_f32(const char *what, int n, const tdm_tensor *const *ts) {
    for (int i = 0; i < n; i++)
        if (ts[i]->dtype != TDM_F32)
            return tdm_raise(TDM_ERR_DTYPE, "%s: expected f32 tensors, got %s", what,
                             tdm_dtype_name(ts[i]->dtype));
    return TDM_OK;
}

/* Raises a dtype error naming the kernel unless every tensor holds floats (f32, bf16, f16). */
static inline int ew_check_float(const char *what, int n, const tdm_tensor *const *ts) {
    for (int i = 0; i < n; i++)
        if (!tdm_dtype_is_float(ts[i]->dtype))
            return tdm_raise(TDM_ERR_DTYPE, "%s: expected float tensors, got %s", what,
                             tdm_dtype_name(ts[i]->dtype));
    return TDM_OK;
}

static inline int ew_check_numel(const char *what, const tdm_tensor *a, const tdm_tensor *b) {
    if (tdm_numel(a) != tdm_numel(b)) {
        char sa[96], sb[96];
        return tdm_raise(TDM_ERR_SHAPE, "%s: sizes differ: %s vs %s", what,
                         tdm_shape_str(tdm_shape_of(a), sa), tdm_shape_str(tdm_shape_of(b), sb));
    }
    return TDM_OK;
}

/* The strides to walk t with when the walk uses ref's shape: t's own if it has that shape,
 * else (t contiguous with the same numel) ref's contiguous strides in cs. NULL if neither. */
static inline const int64_t *ew_strides_as(const tdm_tensor *t, const tdm_tensor *ref,
                                           const int64_t *cs) {
    if (ew_same_shape(t, ref)) return t->strides;
    if (tdm_is_contiguous(t) && tdm_numel(t) == tdm_numel(ref)) return cs;
    return NULL;
}

#endif
