/* Tandem's 16-bit floats: bfloat16 and IEEE half (fp16) as raw uint16_t bits, converted to
 * and from float with round-to-nearest-even, bit for bit as PyTorch converts a CPU tensor
 * (tensor.to(torch.bfloat16) / .to(torch.float16)), on every CPU: the array forms use
 * AVX512_BF16 (vcvtne2ps2bf16) and F16C (vcvtps2ph) where the CPU has them, chosen at run
 * time, and give the same bits as the scalar forms everywhere.
 *
 * The rules, as PyTorch's vectorised CPU conversions apply them:
 * - bf16 <- f32: the upper 16 bits rounded to nearest, ties to even; float denormals round
 *   to bf16 denormals (not flushed); values past the largest bf16 become +-inf; every NaN
 *   becomes 0xFFFF (a quiet NaN; c10::BFloat16's scalar constructor writes 0x7FC0, its
 *   tensor conversion 0xFFFF, which is what a bf16 tensor or file from PyTorch holds).
 * - fp16 <- f32: nearest, ties to even; |x| >= 65520 becomes +-inf; results below 2^-14
 *   are fp16 subnormals (down to 2^-24; half of that and below become +-0); a NaN keeps
 *   its sign and the top 10 bits of its payload, with the quiet bit set (sign | 0x7E00 |
 *   payload >> 13).
 * - f32 <- bf16: exact (the bits shifted up). f32 <- fp16: exact; an fp16 NaN keeps sign
 *   and payload with the quiet bit set.
 * Neither direction depends on the thread's flush-to-zero mode (tdm_set_flush_denormal).
 * The conversions of one array never fail and allocate nothing; dst and src must not
 * overlap.
 */
#ifndef TANDEM_HALF_H
#define TANDEM_HALF_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One float to bf16 bits, and back (see the rules above). */
uint16_t tdm_bf16_from_float(float x);
float tdm_bf16_to_float(uint16_t h);
/* One float to fp16 bits, and back. */
uint16_t tdm_f16_from_float(float x);
float tdm_f16_to_float(uint16_t h);

/* n floats of src into n bf16 of dst (caller's buffers, not overlapping). */
void tdm_bf16_from_f32(uint16_t *dst, const float *src, size_t n);
/* n bf16 of src into n floats of dst. */
void tdm_bf16_to_f32(float *dst, const uint16_t *src, size_t n);
/* n floats of src into n fp16 of dst. */
void tdm_f16_from_f32(uint16_t *dst, const float *src, size_t n);
/* n fp16 of src into n floats of dst. */
void tdm_f16_to_f32(float *dst, const uint16_t *src, size_t n);

/* The instructions the array conversions use on this CPU, a static string: "avx512_bf16+f16c",
 * "f16c" (bf16 in portable code) or "scalar". */
const char *tdm_half_isa(void);

#ifdef __cplusplus
}
#endif
#endif
