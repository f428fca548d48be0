/* The CPU's bf16 convolution (issue 37): bf16 inputs, fp32 accumulation, through oneDNN's
 * convolution primitives on a CPU with bf16 instructions (AVX512_BF16 or AMX), as PyTorch's
 * CPU autocast runs conv2d. Elsewhere, or for arguments these entries do not take, they
 * answer TDM_CPU_CONV_BF16_NOT_HERE and the caller runs the widening adapter (cpu_lowp.c:
 * the f32 kernels on f32 copies), which rounds the same products in another order. */
#ifndef TDM_CPU_CONV_BF16_H
#define TDM_CPU_CONV_BF16_H

#include "backend/backend.h"

/* Not taken (no oneDNN, no bf16 instructions, other dtypes, a geometry oneDNN refuses):
 * nothing was written. */
#define TDM_CPU_CONV_BF16_NOT_HERE 1

/* y [N, Cout, Ho, Wo] = conv(x, w) + b for x and w bf16, b bf16, f32 or NULL, y bf16 or f32,
 * all contiguous; the arguments the op checked. TDM_OK, TDM_CPU_CONV_BF16_NOT_HERE, or
 * TDM_ERR_NOMEM / TDM_ERR_STATE (oneDNN failed to run a primitive it made) naming the layer's
 * shape. */
int tdm_cpu_conv2d_bf16(tdm_tensor *y, const tdm_tensor *x, const tdm_tensor *w,
                        const tdm_tensor *b, const tdm_conv2d_args *args);
/* Its backward: gx (bf16 or f32) from gy and w, gw (bf16 or f32) and gb (bf16, f32, or NULL)
 * from x and gy, each of gx and gw NULL when not wanted (gb needs gw), all overwritten; gy, x
 * and w bf16. The same returns; NOT_HERE is answered before anything is written. */
int tdm_cpu_conv2d_backward_bf16(tdm_tensor *gx, tdm_tensor *gw, tdm_tensor *gb,
                                 const tdm_tensor *gy, const tdm_tensor *x, const tdm_tensor *w,
                                 const tdm_conv2d_args *args);
/* What the calling thread's last call ran: "oneDNN <implementation>", or "" (not taken). */
const char *tdm_cpu_conv2d_bf16_impl(void);

#endif
