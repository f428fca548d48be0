/* The instruction sets the CPU kernels are built for, chosen at run time.
 *
 * A default (portable) build runs on any x86-64 CPU, so no kernel may assume the build
 * machine's ISA. Instead:
 * - a function whose loops the compiler vectorises is marked TDM_CPU_CLONES: GCC and Clang
 *   build it for x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA) and baseline x86-64, and the
 *   dynamic loader picks one from cpuid once (an ifunc), so a call costs what it did;
 * - hand-written AVX-512 code sits between TDM_AVX512_BEGIN and TDM_AVX512_END and runs only
 *   where tdm_cpu_vector_bits() (cpu.h) says 512; hand-written AVX2 + FMA code between
 *   TDM_AVX2_BEGIN and TDM_AVX2_END, only where it says 256 or more.
 * TANDEM_NATIVE builds (-march=native) compile everything for the build machine alone. Clang
 * before 16 refuses a multi-versioned function that calls the vector helpers of cpu_simd.h
 * (it checks their vector ABI before inlining), so with it the clones are baseline only; GCC,
 * the compiler of the build, has no such limit.
 * Results agree across the variants within float rounding (FMA contracts a*b + c), not bit
 * for bit: scripts/test runs the kernel tests again as an AVX2 CPU under qemu.
 */
#ifndef TDM_CPU_ISA_H
#define TDM_CPU_ISA_H

/* Sanitizer builds take the baseline code: the loader runs an ifunc's resolver before the
 * sanitizer's runtime exists, and an instrumented resolver crashes there. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TDM_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define TDM_SANITIZED 1
#endif
#endif

#if defined(__x86_64__) && !defined(TANDEM_NATIVE) && !defined(TDM_SANITIZED) &&                   \
    !(defined(__clang__) && __clang_major__ < 16)
#define TDM_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TDM_CPU_CLONES
#endif

#if defined(__x86_64__)
#define TDM_HAVE_AVX512_CODE 1
#if defined(__clang__)
/* one string: _Pragma takes no concatenation */
/* clang-format off */
#define TDM_AVX512_BEGIN                                                                           \
    _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512dq,avx512vl,fma\"))), apply_to = function)")
/* clang-format on */
#define TDM_AVX512_END _Pragma("clang attribute pop")
/* clang-format off */
#define TDM_AVX2_BEGIN                                                                             \
    _Pragma("clang attribute push(__attribute__((target(\"avx2,fma\"))), apply_to = function)")
/* clang-format on */
#define TDM_AVX2_END _Pragma("clang attribute pop")
#else
#define TDM_AVX512_BEGIN                                                                           \
    _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512dq,avx512vl,fma\")")
#define TDM_AVX512_END _Pragma("GCC pop_options")
#define TDM_AVX2_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma\")")
#define TDM_AVX2_END   _Pragma("GCC pop_options")
#endif
#endif

#endif
