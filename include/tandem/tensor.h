/* Tandem tensors: dtypes, devices, shapes, creation, views and the differentiable math ops.
 * What a program asks of the machine (device memory, the GEMM library, denormals, signals)
 * is in runtime.h.
 *
 * Ownership. Every tensor is owned by the step scope that was open on the calling thread
 * when it was created (tdm_scope_begin/end); tdm_scope_end releases all of them at once, so
 * a training step never frees intermediates one by one. A tensor created while no scope is
 * open belongs to the caller, who releases it with tdm_tensor_free. Views share their base's
 * storage (reference counted), so freeing the base before the view is safe.
 *
 * Errors. Functions returning a tensor return NULL on failure; functions returning int
 * return 0 (TDM_OK) or a negative tdm_status. Either way tdm_last_error() holds a message
 * naming the cause (op, shapes, dtypes, devices). Every op accepts NULL inputs and returns
 * NULL without overwriting the first error, so a chain of ops can be checked once at the end.
 */
#ifndef TANDEM_TENSOR_H
#define TANDEM_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_MAX_DIMS 8

/* ---- status and errors ------------------------------------------------------------------ */

typedef enum {
    TDM_OK = 0,
    TDM_ERR_ARG = -1,     /* an argument is invalid (NULL, out of range) */
    TDM_ERR_SHAPE = -2,   /* shapes do not agree */
    TDM_ERR_DTYPE = -3,   /* wrong or mixed dtypes */
    TDM_ERR_DEVICE = -4,  /* tensors on different devices, or an unknown device */
    TDM_ERR_NOMEM = -5,   /* an allocation failed */
    TDM_ERR_IO = -6,      /* a file could not be read or written */
    TDM_ERR_FORMAT = -7,  /* a file's contents are malformed */
    TDM_ERR_STATE = -8,   /* called at the wrong time (e.g. backward twice) */
    TDM_ERR_NUMERIC = -9, /* a non-finite value where a finite one is required */
    TDM_ERR_COMM = -10,   /* a collective could not complete */
} tdm_status;

/* The message of the last error raised on this thread ("" if none). Valid until the next
 * error on this thread. */
const char *tdm_last_error(void);
/* The status of the last error on this thread (TDM_OK if none). */
tdm_status tdm_last_status(void);
/* Forgets the last error on this thread. */
void tdm_clear_error(void);

/* ---- dtypes and devices ----------------------------------------------------------------- */

/* TDM_BF16 (bfloat16: fp32's exponent, 8 significant bits) and TDM_F16 (IEEE half) are the
 * low precisions of mixed-precision training (docs/MIXED_PRECISION.md); their bits convert to
 * and from fp32 as include/tandem/half.h says (round to nearest even, as PyTorch). */
typedef enum { TDM_F32 = 0, TDM_I32 = 1, TDM_I64 = 2, TDM_BF16 = 3, TDM_F16 = 4 } tdm_dtype;
/* Whether dt holds floating-point values (f32, bf16, f16). */
bool tdm_dtype_is_float(tdm_dtype dt);
/* Whether dt is one of the enum's values (a number read from elsewhere may not be). */
bool tdm_dtype_valid(tdm_dtype dt);

/* Bytes of one element: 8 (i64), 4 (f32, i32), 2 (bf16, f16). */
size_t tdm_dtype_size(tdm_dtype dt);
const char *tdm_dtype_name(tdm_dtype dt); /* "f32", "i32", "i64", "bf16", "f16" */

typedef enum { TDM_CPU = 0, TDM_CUDA = 1 } tdm_device_type;

/* A device: "cpu:N" is a logical CPU device (its own memory pool, later its own thread);
 * "cuda:N" a GPU. */
typedef struct {
    tdm_device_type type;
    int index;
} tdm_device;

static inline tdm_device tdm_cpu(int index) {
    tdm_device d = {TDM_CPU, index};
    return d;
}
static inline tdm_device tdm_cuda(int index) {
    tdm_device d = {TDM_CUDA, index};
    return d;
}
/* Devices of one type a process may use (cpu:0 .. cpu:63): the caching allocator keeps a
 * memory pool for each, and DataParallel, pipelines and --devices take at most this many. */
#define TDM_MAX_DEVICES 64

bool tdm_device_equal(tdm_device a, tdm_device b);
/* Parses "cpu", "cpu:3", "cuda:0" (syntax only: whether the GPU exists is checked when a
 * tensor is made on it). Returns TDM_OK or TDM_ERR_DEVICE naming the text. */
int tdm_device_parse(const char *text, tdm_device *out);
/* Writes "cpu:0" into buf (at least 16 bytes) and returns buf. */
char *tdm_device_str(tdm_device d, char *buf);

/* ---- shapes ----------------------------------------------------------------------------- */

typedef struct {
    int ndim;
    int64_t d[TDM_MAX_DIMS];
} tdm_shape;

/* TDM_SHAPE(2, 3) is the shape [2, 3]; TDM_SHAPE0 a scalar. */
#define TDM_SHAPE(...)                                                                             \
    ((tdm_shape){(int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), {__VA_ARGS__}})
#define TDM_SHAPE0 ((tdm_shape){0, {0}})

int64_t tdm_shape_numel(tdm_shape s);
/* Writes "[2, 3, 4]" into buf (at least 96 bytes) and returns buf. */
char *tdm_shape_str(tdm_shape s, char *buf);

/* ---- the tensor ------------------------------------------------------------------------- */

typedef struct tdm_storage tdm_storage;
typedef struct tdm_node tdm_node;
typedef struct tdm_scope tdm_scope;

/* Fields are read-only for users; change them only through the functions below. */
typedef struct tdm_tensor {
    tdm_dtype dtype;
    int ndim;
    int64_t shape[TDM_MAX_DIMS];
    int64_t strides[TDM_MAX_DIMS]; /* in elements; 0 for an expanded (broadcast) dim */
    int64_t offset;                /* in elements from the start of the storage */
    tdm_device device;
    tdm_storage *storage;
    /* autograd */
    bool requires_grad;
    struct tdm_tensor *grad; /* leaf: accumulated gradient (same owner as the tensor) */
    tdm_node *grad_fn;       /* the tape node that produced it; NULL for a leaf */
    /* the library's bookkeeping (the scope that owns it, autograd's lists): not for users */
    uint64_t internal_[6];
} tdm_tensor;

int64_t tdm_numel(const tdm_tensor *t);
tdm_shape tdm_shape_of(const tdm_tensor *t);
bool tdm_is_contiguous(const tdm_tensor *t);
/* Pointer to the first element on the CPU backend, NULL elsewhere. For kernels and tests. */
void *tdm_data_ptr(const tdm_tensor *t);

/* Releases a caller-owned tensor (and its .grad). A scope-owned tensor is released by its
 * scope: calling this on one is an error reported by tdm_last_error, not a crash. */
void tdm_tensor_free(tdm_tensor *t);

/* ---- step scopes ------------------------------------------------------------------------ */

/* Opens a scope on this thread; scopes nest. Returns TDM_OK or TDM_ERR_NOMEM. */
int tdm_scope_begin(void);
/* Releases every tensor and tape node created since the matching tdm_scope_begin. */
void tdm_scope_end(void);
/* Moves t (and its .grad) out of the current scope: the caller now owns it. */
tdm_tensor *tdm_scope_keep(tdm_tensor *t);

/* ---- random numbers --------------------------------------------------------------------- */

/* Counter-based generator (Philox4x32-10): value i of a draw depends on (seed, offset + i)
 * only, so results do not depend on threads or on how work is split. */
typedef struct {
    uint64_t seed;
    uint64_t offset; /* advanced by each draw */
} tdm_rng;

tdm_rng tdm_rng_make(uint64_t seed);
/* The process-wide default generator used when a tdm_rng* argument is NULL. */
tdm_rng *tdm_default_rng(void);
void tdm_manual_seed(uint64_t seed);
/* Four 32-bit random words for (seed, counter, stream): the raw Philox4x32-10 block. */
void tdm_philox(uint64_t seed, uint64_t counter, uint64_t stream, uint32_t out[4]);
/* A uniform float in [0, 1) from one 32-bit word (24 significant bits). */
static inline float tdm_u32_to_unit(uint32_t x) {
    return (float)(x >> 8) * (1.0f / 16777216.0f);
}

/* ---- creation --------------------------------------------------------------------------- */

/* Uninitialised memory of the given shape. */
tdm_tensor *tdm_empty(tdm_shape shape, tdm_dtype dt, tdm_device dev);
tdm_tensor *tdm_zeros(tdm_shape shape, tdm_dtype dt, tdm_device dev);
tdm_tensor *tdm_ones(tdm_shape shape, tdm_dtype dt, tdm_device dev);
tdm_tensor *tdm_full(tdm_shape shape, float value, tdm_dtype dt, tdm_device dev);
/* [start, start+step, ...) below end (above, for a negative step), like torch.arange. */
tdm_tensor *tdm_arange(double start, double end, double step, tdm_dtype dt, tdm_device dev);
/* Copies numel * dtype_size bytes from host memory (bf16 and f16 as their raw uint16_t
 * bits, half.h). */
tdm_tensor *tdm_from_data(tdm_shape shape, tdm_dtype dt, tdm_device dev, const void *host);
/* N(mean, std^2) and U[low, high) draws from rng (NULL: the default generator). The in-place
 * forms below take any float dtype: a bf16 or f16 tensor receives the f32 draw of the same
 * counters rounded once; an integer tensor is TDM_ERR_DTYPE. */
tdm_tensor *tdm_randn(tdm_shape shape, float mean, float std, tdm_device dev, tdm_rng *rng);
tdm_tensor *tdm_rand(tdm_shape shape, float low, float high, tdm_device dev, tdm_rng *rng);
/* In-place fills of an existing tensor (no autograd). */
int tdm_fill_(tdm_tensor *t, float value);
int tdm_uniform_(tdm_tensor *t, float low, float high, tdm_rng *rng);
int tdm_normal_(tdm_tensor *t, float mean, float std, tdm_rng *rng);
/* Copies src into dst (same shape; any strides; dtypes may differ: values are converted). */
int tdm_copy_(tdm_tensor *dst, const tdm_tensor *src);

/* Copies the elements, in row-major order, to host memory of at least numel*dtype_size
 * bytes. Returns TDM_OK or an error if nbytes is too small. */
int tdm_to_host(const tdm_tensor *t, void *host, size_t nbytes);
/* The value of a one-element tensor as a float (a bf16 or f16 value exactly; NAN and an
 * error otherwise). */
float tdm_item(const tdm_tensor *t);
/* Writes t's values into buf (cap bytes, cut to fit and always terminated) as
 * "tensor([0.333984, 1, ...], shape [2, 5], bf16, cpu:0)": row-major order, floats with 6
 * significant digits (a bf16 or f16 value widened exactly first), the first and last 4 of a
 * tensor of more than 8. For debugging and messages; any device (the values are copied to
 * the host). TDM_OK, TDM_ERR_ARG for a NULL argument, TDM_ERR_NOMEM. */
int tdm_tensor_format(const tdm_tensor *t, char *buf, size_t cap);
/* A copy of t on another device (differentiable). */
tdm_tensor *tdm_to_device(tdm_tensor *t, tdm_device dev);
/* A contiguous copy, or t itself if already contiguous. Differentiable. */
tdm_tensor *tdm_contiguous(tdm_tensor *t);
/* A new tensor with the same values; no autograd history. */
tdm_tensor *tdm_clone(const tdm_tensor *t);
/* A new contiguous tensor of dtype dt holding t's values converted (always a copy, also when
 * dt is t's dtype; owned like any new tensor). Floats to bf16 or f16 round to nearest even
 * as half.h says (PyTorch's bits); integers to floats go through a float. Not differentiable:
 * the result has no history. NULL when t is NULL; TDM_ERR_DTYPE naming dt when dt is not a
 * dtype of the enum. */
tdm_tensor *tdm_cast(const tdm_tensor *t, tdm_dtype dt);
/* tdm_cast recorded on the tape, PyTorch's t.to(dtype): between float dtypes (f32, bf16,
 * f16) the gradient flows back cast to t's dtype (the incoming gradient of a bf16 result is
 * widened exactly to f32; of an f32 result, rounded to bf16). A result of an integer dtype,
 * or from an integer t, has no history. Always a copy, as tdm_cast. NULL and errors as
 * tdm_cast's. */
tdm_tensor *tdm_to_dtype(tdm_tensor *t, tdm_dtype dt);

/* ---- views (share storage; differentiable) ------------------------------------------------ */

/* One dim may be -1. Views when the strides allow it, copies otherwise (like torch.reshape). */
tdm_tensor *tdm_reshape(tdm_tensor *t, tdm_shape shape);
tdm_tensor *tdm_flatten(tdm_tensor *t, int start_dim, int end_dim);
tdm_tensor *tdm_transpose(tdm_tensor *t, int dim0, int dim1);
tdm_tensor *tdm_permute(tdm_tensor *t, const int *dims);
/* Elements start, start+step, ... below end along dim (negative start/end count from the
 * end, clamped like Python slices; step >= 1). */
tdm_tensor *tdm_slice(tdm_tensor *t, int dim, int64_t start, int64_t end, int64_t step);
/* Broadcasts size-1 dims (and new leading dims) to shape; -1 keeps a dim. */
tdm_tensor *tdm_expand(tdm_tensor *t, tdm_shape shape);
tdm_tensor *tdm_unsqueeze(tdm_tensor *t, int dim);
tdm_tensor *tdm_squeeze(tdm_tensor *t, int dim);

/* ---- math ops (differentiable; broadcasting like PyTorch) --------------------------------- */

tdm_tensor *tdm_add(tdm_tensor *a, tdm_tensor *b);
tdm_tensor *tdm_sub(tdm_tensor *a, tdm_tensor *b);
tdm_tensor *tdm_mul(tdm_tensor *a, tdm_tensor *b);
tdm_tensor *tdm_div(tdm_tensor *a, tdm_tensor *b);
tdm_tensor *tdm_add_scalar(tdm_tensor *a, float s);
tdm_tensor *tdm_mul_scalar(tdm_tensor *a, float s);
tdm_tensor *tdm_pow_scalar(tdm_tensor *a, float p);
tdm_tensor *tdm_neg(tdm_tensor *a);
tdm_tensor *tdm_exp(tdm_tensor *a);
tdm_tensor *tdm_log(tdm_tensor *a);
tdm_tensor *tdm_sqrt(tdm_tensor *a);
tdm_tensor *tdm_relu(tdm_tensor *a);
tdm_tensor *tdm_gelu(tdm_tensor *a, bool tanh_approx); /* false: exact erf form */
tdm_tensor *tdm_tanh(tdm_tensor *a);
tdm_tensor *tdm_sigmoid(tdm_tensor *a);
/* x / (1 + |x|), as torch.nn.functional.softsign; gradient 1 / (1 + |x|)^2. A new tensor on
 * a's device (owned like any op's output); NULL if a is NULL or not f32. */
tdm_tensor *tdm_softsign(tdm_tensor *a);

/* Reductions. dim -1 counts from the end; keepdim keeps it with size 1. */
tdm_tensor *tdm_sum(tdm_tensor *a, int dim, bool keepdim);
tdm_tensor *tdm_mean(tdm_tensor *a, int dim, bool keepdim);
/* Max along dim; argmax (may be NULL) receives an i64 tensor of indices (not differentiable).
 * The gradient goes to the first maximal element, as in PyTorch. */
tdm_tensor *tdm_max(tdm_tensor *a, int dim, bool keepdim, tdm_tensor **argmax);
tdm_tensor *tdm_sum_all(tdm_tensor *a);  /* scalar */
tdm_tensor *tdm_mean_all(tdm_tensor *a); /* scalar */

tdm_tensor *tdm_softmax(tdm_tensor *a, int dim);
tdm_tensor *tdm_log_softmax(tdm_tensor *a, int dim);

/* Matrix products through BLAS. matmul: [..., n, k] x [..., k, m] -> [..., n, m] with the
 * batch dims broadcast; a 1-D operand is treated as a vector as in torch.matmul. */
tdm_tensor *tdm_matmul(tdm_tensor *a, tdm_tensor *b);
/* [B, n, k] x [B, k, m] -> [B, n, m] */
tdm_tensor *tdm_bmm(tdm_tensor *a, tdm_tensor *b);

/* Joining and cutting. */
tdm_tensor *tdm_concat(tdm_tensor *const *ts, int n, int dim);
/* Splits along dim into pieces of the given sizes (summing to the dim); writes n views. */
int tdm_split(tdm_tensor *t, const int64_t *sizes, int n, int dim, tdm_tensor **out);
/* Rows of src along dim picked by an integer index tensor (1-D, i32 or i64). */
tdm_tensor *tdm_index_select(tdm_tensor *src, int dim, const tdm_tensor *index);

#ifdef __cplusplus
}
#endif
#endif
