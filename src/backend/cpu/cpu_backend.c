/* The CPU backend table: every kernel of backend.h for cpu:N devices. */
#include "backend/cpu/cpu.h"

/* tdm_cpu_<entry> for every kernel of backend.h's list: a missing kernel fails the build.
 * The upload entries stay NULL: a CPU device is host memory. */
#define CPU_ENTRY(e) .e = tdm_cpu_##e,
const tdm_backend tdm_cpu_backend = {.name = "cpu", TDM_BACKEND_KERNELS(CPU_ENTRY)};
