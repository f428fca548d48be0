/* Tandem's runtime: what a program asks of the machine rather than of a tensor. The devices'
 * descriptions and memory (the caching allocator's figures), the CPU matrix-product library,
 * denormal flushing, TF32 and CUDA graphs on GPUs, and stopping on SIGTERM. Same error conventions
 * as tensor.h: int functions return TDM_OK or a negative tdm_status with tdm_last_error() naming
 * the cause.
 */
#ifndef TANDEM_RUNTIME_H
#define TANDEM_RUNTIME_H

#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- devices ---------------------------------------------------------------------------- */

/* Describes a GPU for listings ("NVIDIA H100 80GB HBM3, 79.2 GiB, sm_90") into buf of cap
 * bytes. TDM_OK, or TDM_ERR_DEVICE when d is not a GPU this process can use (the message
 * says why: no CUDA in this build, no GPU, fewer GPUs). */
int tdm_device_describe(tdm_device d, char *buf, size_t cap);
/* The memory of device d in bytes: *total its capacity, *avail what is free now (a GPU's, as
 * cudaMemGetInfo says; a CPU device's, the machine's physical memory and what the kernel
 * counts available). Either pointer may be NULL. TDM_OK, or TDM_ERR_DEVICE as
 * tdm_device_describe. */
int tdm_device_memory_info(tdm_device d, int64_t *total, int64_t *avail);

/* ---- CPU matrix products and floating point -------------------------------------------- */

/* The library behind CPU matrix products and the kernel set it runs on this CPU, for listings
 * and logs: "oneDNN 2.6.3, avx512_core" or "OpenBLAS 0.3.21, SkylakeX kernels". Writes at most
 * cap bytes into buf (always terminated) and returns buf. */
char *tdm_gemm_describe(char *buf, size_t cap);
/* Floating-point operations (2 m n k each) of the CPU matrix products the calling thread has
 * run since it started: the bulk of a training step's work, for telling how much work a
 * device gets (tandem train's data-parallel note). Never fails. */
uint64_t tdm_gemm_flops(void);
/* NULL when that library runs the fastest kernels this CPU allows; otherwise one line that
 * says what it runs instead and how to fix it (stored per thread, valid until the next call). */
const char *tdm_gemm_warning(void);
/* Flushes denormal floats (below 1.18e-38) to zero in the calling thread's arithmetic, or
 * stops (torch.set_flush_denormal). Threads it creates afterwards, the devices' among them,
 * start with the same setting. Off by default, as in PyTorch; `tandem train` turns it on
 * (--denormals): a denormal costs a microcode assist per operation. Returns false where the
 * CPU has no such mode (then nothing changed). */
bool tdm_set_flush_denormal(bool on);
/* Whether the calling thread flushes denormals. */
bool tdm_flush_denormal(void);
/* Lets f32 matrix products on GPUs run in TF32 (torch.backends.cuda.matmul.allow_tf32 = on):
 * each input rounded to 10 mantissa bits, the product on the tensor cores with f32
 * accumulation, several times f32's speed on an Ampere or later GPU. Off by default, as in
 * PyTorch; process-wide, read at each product (set it between steps, not during one). Only
 * matmul's f32 products change: attention, convolutions and every CPU device keep f32.
 * tandem train: --allow-tf32. */
void tdm_set_allow_tf32(bool on);
/* Whether f32 matrix products on GPUs may run in TF32. */
bool tdm_allow_tf32(void);

/* ---- CUDA graphs ------------------------------------------------------------------------ */

/* A GPU's work recorded once and launched again as one CUDA graph (PyTorch's
 * torch.cuda.CUDAGraph): a training step of hundreds of kernels costs one launch. */
typedef struct tdm_graph tdm_graph;
/* Calls fn(arg) on this thread once, recording the work it queues on GPU dev, without running
 * it: tdm_graph_replay runs it. A replay reads and writes the very tensors the recording did:
 * refill its inputs in place between replays (tdm_copy_), keep the tensors it writes that you
 * read (a loss) alive, and read them after a replay. The blocks the recording allocated or
 * freed on dev are the graph's until tdm_graph_free, never handed to other work. Shapes, every
 * kernel's arguments (a learning rate passed by value) and the tensors' addresses are fixed,
 * but for dropout's random draws: each replay takes their counters from the tdm_rng each was
 * given, in the recorded order, as the eager calls would (so the generators must outlive the
 * graph), and the recording gives back the counters it took. Returns the graph (the caller's:
 * tdm_graph_free), or NULL and an error: TDM_ERR_DEVICE when dev is not a GPU; fn's own error;
 * TDM_ERR_STATE for work that cannot be recorded, named with the reason ("a random fill on
 * cuda:0 cannot be recorded in a CUDA graph: ..."; so are dropout inside a recomputed
 * function, reads back to the host such as tdm_item, copies from host memory, and gradient
 * clipping's sum). Nothing recorded has run. */
tdm_graph *tdm_graph_capture(tdm_device dev, int (*fn)(void *arg), void *arg);
/* Queues the recorded work once more on its GPU, then checks the user indices the recording
 * checked (an embedding's, a cross-entropy's targets), waiting for the GPU when there are any.
 * TDM_OK; TDM_ERR_ARG naming an out-of-range index as the op would; TDM_ERR_DEVICE. */
int tdm_graph_replay(tdm_graph *g);
/* Waits for g's GPU, then frees g and gives its blocks back to the device's cache (a block
 * still held by a tensor goes back when that is freed). NULL is ignored. */
void tdm_graph_free(tdm_graph *g);

/* ---- memory figures -------------------------------------------------------------------- */

/* Memory of one device as Tandem's caching allocator sees it, in bytes, for this process
 * (PyTorch's torch.cuda.memory_allocated, max_memory_allocated and memory_reserved). Every
 * device, cpu:N included, has a pool of its own, so the figures are per logical device. */
typedef struct {
    /* held by live tensors on the device (parameters, gradients, optimizer state, batches,
     * activations), each storage counted at its size class: 256-byte granules up to 4 KiB,
     * then at most 25% above the request. Not counted: tensor headers and tape nodes (the
     * threads' scope arenas), and the GEMM library's own workspace. */
    int64_t allocated;
    /* the most `allocated` has been since the process began or tdm_memory_reset_peak(d) */
    int64_t peak_allocated;
    /* allocated plus the freed blocks the pool keeps for reuse: what the process holds from
     * the system (or the GPU) for this device */
    int64_t reserved;
    /* tdm_device_set_memory_limit's cap on `reserved`; 0: none */
    int64_t limit;
} tdm_memory_stats;
/* The device's figures now. Thread-safe (one lock per device); cheap enough for every step.
 * A device outside cpu:0..63 and cuda:0..63: all zero, and TDM_ERR_DEVICE in tdm_last_error. */
tdm_memory_stats tdm_memory_stats_get(tdm_device d);
/* Starts a new peak: peak_allocated becomes allocated now (torch.cuda.reset_peak_memory_stats).
 * The peak is the device's, not the caller's: a reset is seen by every reader (a pipeline
 * resets each stage's device at each of its steps). Out-of-range devices are ignored. */
void tdm_memory_reset_peak(tdm_device d);
/* Caps device d's pool at `bytes` held from the system (tensors' blocks plus the cached ones;
 * 0: no cap, the default), as a GPU's memory caps it: a CPU device then runs out where a GPU
 * of that size would (torch.cuda.set_per_process_memory_fraction, for any device). A new
 * block that would pass the cap first makes the pool give its cached blocks back; if it still
 * does not fit, the allocation fails with TDM_ERR_NOMEM and "cpu:1 is out of memory: tried to
 * allocate 64.00 MiB with 3.95 GiB of its 4.00 GiB limit in use by tensors ...". Blocks already
 * held are kept when the cap is lowered below them. TDM_ERR_DEVICE for a device outside
 * cpu:0..63 and cuda:0..63, TDM_ERR_ARG for bytes < 0. */
int tdm_device_set_memory_limit(tdm_device d, int64_t bytes);
/* The bytes a storage of nbytes takes in the caching allocator (its size class), as `allocated`
 * counts them: what an estimate of a device's memory must add up. nbytes < 0 gives 0; a size
 * beyond the largest class gives nbytes itself (the allocator refuses it). */
int64_t tdm_memory_block_bytes(int64_t nbytes);
/* ---- stopping on a signal --------------------------------------------------------------- */

/* Preemption: from now on SIGTERM and SIGINT are recorded instead of ending the process, so
 * a training loop can poll tdm_stop_requested between steps, save a checkpoint and return
 * (Slurm, Kubernetes and torchrun stop jobs with SIGTERM). Once one has arrived, both get
 * their default action back: a second signal ends the process at once. SIGUSR1, a
 * launcher's early warning (`srun --signal=USR1@120`), is recorded as a stop as well, keeps
 * its handler, and each one also wakes tdm_stop_wait_dump. Process-wide; call it once, early,
 * from the main thread, which Linux hands such signals and which gets the handler's own stack
 * (sigaltstack). TDM_ERR_IO when the handlers cannot be installed. */
int tdm_stop_on_signals(void);
/* Waits up to timeout_s seconds for a SIGTERM, SIGINT or SIGUSR1 since tdm_stop_on_signals;
 * true when one came (one call per signal). For a thread that writes diagnostics at once (the
 * trainer's flight recorder) while the others may be stuck in a collective. False at once
 * before tdm_stop_on_signals. */
bool tdm_stop_wait_dump(double timeout_s);
/* The first SIGTERM, SIGINT or SIGUSR1 recorded since tdm_stop_on_signals (or
 * tdm_stop_request's signal), 0 when none: cheap enough to call every step. Never fails. */
int tdm_stop_requested(void);
/* Records a stop as if signal sig (SIGTERM when <= 0) had arrived: what another rank's stop
 * becomes in this process, and what tests call. The first request wins. */
void tdm_stop_request(int sig);

#ifdef __cplusplus
}
#endif
#endif
