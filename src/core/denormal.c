/* Flushing denormal floats to zero (torch.set_flush_denormal): the MXCSR's FTZ and DAZ bits.
 *
 * Why it matters: SGD's momentum buffer of a parameter whose gradient stays zero (a dead
 * ReLU unit) decays by 0.9 a step and is denormal after ~800 steps; every operation on a
 * denormal then takes a microcode assist, and the MLP's epochs took much longer from its
 * second epoch on (bench/RESULTS.md, "Figures behind the code"). MXCSR is per thread and a new
 * thread starts with its creator's, so setting it before devices, loader workers and GEMM threads
 * start covers them all. */
#include "tandem/tensor.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>

#define MXCSR_FTZ 0x8000 /* results below FLT_MIN become 0 */
#define MXCSR_DAZ 0x0040 /* denormal inputs read as 0 */

bool tdm_set_flush_denormal(bool on) {
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(on ? csr | MXCSR_FTZ | MXCSR_DAZ : csr & ~(unsigned int)(MXCSR_FTZ | MXCSR_DAZ));
    return true;
}

bool tdm_flush_denormal(void) {
    return (_mm_getcsr() & (MXCSR_FTZ | MXCSR_DAZ)) == (MXCSR_FTZ | MXCSR_DAZ);
}
#else
bool tdm_set_flush_denormal(bool on) {
    return !on; /* not supported here: only "off" is what the caller asked for */
}

bool tdm_flush_denormal(void) {
    return false;
}
#endif
