/* TF32 for f32 matrix products on GPUs (torch.backends.cuda.matmul.allow_tf32): one
 * process-wide switch that the CUDA backend reads at each f32 product (cuda_matmul.cu). Off by
 * default, as in PyTorch since 1.12: TF32 keeps 10 of f32's 23 mantissa bits of each input, so
 * a run's products then agree with the CPU's to about 1e-3 rather than 1e-6. */
#include "tandem/runtime.h"

static bool allow_tf32;

void tdm_set_allow_tf32(bool on) {
    __atomic_store_n(&allow_tf32, on, __ATOMIC_RELAXED);
}

bool tdm_allow_tf32(void) {
    return __atomic_load_n(&allow_tf32, __ATOMIC_RELAXED);
}
