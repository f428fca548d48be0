/* The CPU backend table: every kernel of kernels.def for cpu:N devices. */
#include "backend/cpu/cpu.h"

/* tdm_cpu_<entry> for every kernel of kernels.def: a missing kernel fails the link. The
 * upload entries stay NULL: a CPU device is host memory. */
const tdm_backend tdm_cpu_backend = {
    .name = "cpu",
#define TDM_KERNEL(ret, entry, params) .entry = tdm_cpu_##entry,
#define TDM_UPLOAD(ret, entry, params)
#include "backend/kernels.def"
#undef TDM_KERNEL
#undef TDM_UPLOAD
};
