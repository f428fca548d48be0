/* The backend table: every kernel, for one kind of device, as function pointers.
 *
 * Ops (src/autograd, src/nn, src/optim) validate shapes, allocate outputs and record the
 * tape; kernels only compute. Nothing outside src/backend reads or writes tensor memory.
 * Every kernel returns TDM_OK or a negative tdm_status after tdm_raise. Unless a kernel says
 * otherwise, its float tensors are f32, bf16 or f16 in any mix (computed in fp32 inside, each
 * low-precision output rounded once; the optimizers' kernels take f32 only), contiguous, and
 * outputs are preallocated by the caller with the right shape; "accumulate" kernels add into
 * their output instead of overwriting.
 */
#ifndef TDM_BACKEND_H
#define TDM_BACKEND_H

#include "core/core.h"

typedef enum {
    TDM_UN_NEG,
    TDM_UN_EXP,
    TDM_UN_LOG,
    TDM_UN_SQRT,
    TDM_UN_RELU,
    TDM_UN_GELU_TANH,
    TDM_UN_GELU_ERF,
    TDM_UN_TANH,
    TDM_UN_SIGMOID,
    TDM_UN_ADD_SCALAR, /* x + s */
    TDM_UN_MUL_SCALAR, /* x * s */
    TDM_UN_POW_SCALAR, /* x ^ s */
    TDM_UN_SOFTSIGN,   /* x / (1 + |x|) */
} tdm_unary_op;
/* The last unary op: the kernels refuse an op past it and test_cuda walks up to it, so a new
 * op (appended to the enum) moves only this line (docs/HACKING.md, "A new element-wise op"). */
#define TDM_UN_LAST TDM_UN_SOFTSIGN

typedef enum { TDM_BIN_ADD, TDM_BIN_SUB, TDM_BIN_MUL, TDM_BIN_DIV } tdm_binary_op;

typedef enum { TDM_RED_SUM, TDM_RED_MEAN, TDM_RED_MAX } tdm_reduce_op;

typedef struct {
    int stride_h, stride_w;
    int pad_h, pad_w;
    int dilation_h, dilation_w;
    int groups;
} tdm_conv2d_args;

typedef struct {
    int kernel_h, kernel_w;
    int stride_h, stride_w;
    int pad_h, pad_w;
    int dilation_h, dilation_w; /* max pooling only */
    bool ceil_mode;
    bool count_include_pad; /* average pooling only */
} tdm_pool2d_args;

/* Hyper-parameters of one optimizer step, with PyTorch's meaning. */
typedef struct {
    float lr, momentum, dampening, weight_decay;
    bool nesterov, maximize;
} tdm_sgd_hparams;

typedef struct {
    float lr, beta1, beta2, eps, weight_decay;
    bool decoupled; /* AdamW: theta -= lr*wd*theta before the Adam update */
    bool amsgrad;
    bool maximize;
} tdm_adam_hparams;

/* One function pointer per entry of kernels.def, in its order, after the backend's name. */
typedef struct tdm_backend {
    const char *name;
#define TDM_KERNEL(ret, entry, params) ret(*entry) params;
#define TDM_UPLOAD                     TDM_KERNEL
#include "backend/kernels.def"
#undef TDM_KERNEL
#undef TDM_UPLOAD
} tdm_backend;

/* TDM_OK when be fills every TDM_KERNEL entry of kernels.def (and, with uploads, every
 * TDM_UPLOAD entry); else TDM_ERR_STATE naming the backend and the first empty entry
 * (test_tensor checks the CPU table, test_cuda the CUDA one). */
int tdm_backend_check(const tdm_backend *be, bool uploads);

/* The backend of a device (never NULL for a device that tdm_device_parse accepted and the
 * build supports; NULL with an error otherwise). */
const tdm_backend *tdm_backend_for(tdm_device dev);

/* For a random draw about to be queued on dev by the calling thread (dropout's: used counters
 * taken from rng, its own from first on): while the thread records a CUDA graph on dev
 * (tdm_graph_capture), *at is the pair of device words (seed, offset) the recorded kernel must
 * read, which each replay sets from rng as the eager step's draw would take them; otherwise
 * *at is NULL. Call it before taking the counters. TDM_OK, or TDM_ERR_STATE when the draw
 * cannot be recorded (inside a recomputed function, whose counters its first run logged; more
 * draws than a graph holds), which fails the recording. */
int tdm_graph_draw(tdm_device dev, tdm_rng *rng, uint64_t used, uint64_t first,
                   const uint64_t **at);

/* GPUs this process can use: 0 without a GPU or in a build without the CUDA backend. */
int tdm_cuda_device_count(void);

/* The CPU backend's table. */
extern const tdm_backend tdm_cpu_backend;

/* ---- the CPU, for the layers above (src/backend/cpu/cpu.h is private to the backend) ---- */

/* A block of host memory as the CPU backend's mem_alloc gives it (cpu_memory.c): 64-byte
 * aligned, and from 2 MiB up 2 MiB aligned on huge pages; free() releases it. NULL when
 * memory is short. For data readers that keep a whole file in memory (dataset_idx.c,
 * dataset_cifar.c). device_index is ignored. */
void *tdm_cpu_mem_alloc(int device_index, size_t nbytes);
/* Threads one CPU GEMM call may use (cpu_gemm.c): with oneDNN (OpenMP) a setting of the
 * calling thread, with OpenBLAS of the process. Never fail. */
int tdm_cpu_gemm_threads(void);
void tdm_cpu_gemm_set_threads(int n);
/* The calling thread is a device's: its GEMMs run on its own core alone (oneDNN; OpenBLAS's
 * process-wide count is set by tdm_gemm_threads_for_devices, parallel/group.h). */
void tdm_cpu_gemm_thread_single(void);

#endif
