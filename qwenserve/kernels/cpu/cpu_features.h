// The instruction-set features the kernels are compiled for, as QS_* macros that are 1 or 0: the one place that
// reads the compiler's feature macros. Each CPU variant's library is built with its own flags
// (qwenserve/config/cpu_variants.py), so each macro says what that variant's CPUs have; a source tests
// `#if QS_X86_AVX2` and never `__AVX2__` itself, so the meaning of a feature class
// (such as "AVX2 comes with FMA and F16C") is decided here once for every op family.
//
// x86 kernels live under arch/x86/, ARM (aarch64) kernels under arch/arm/.
#pragma once

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

// fp16 <-> fp32 conversion instructions
#if defined(__F16C__)
#define QS_X86_F16C 1
#else
#define QS_X86_F16C 0
#endif

// AVX2 with FMA and F16C: every AVX2 CPU has all three and every variant with AVX2 turns them on together
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QS_X86_AVX2 1
#else
#define QS_X86_AVX2 0
#endif

// AVX-512 foundation: the 16-wide float loads and the wide decode attention
#if defined(__AVX512F__)
#define QS_X86_AVX512F 1
#else
#define QS_X86_AVX512F 0
#endif

// AVX-512 with the byte and word ops (BW), on top of the AVX2 class: the 512-bit ggml kernels
#if QS_X86_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define QS_X86_AVX512BW 1
#else
#define QS_X86_AVX512BW 0
#endif

// AVX512-VNNI (u8 x s8 dot products into int32) on top of the AVX512BW class: the ggml tile kernels
#if QS_X86_AVX512BW && defined(__AVX512VNNI__)
#define QS_X86_AVX512_VNNI 1
#else
#define QS_X86_AVX512_VNNI 0
#endif

// the same dot products on 256-bit vectors: AVX512-VNNI with VL, or AVX-VNNI (CPUs without AVX-512)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QS_X86_AVX512_VNNI_VL 1
#else
#define QS_X86_AVX512_VNNI_VL 0
#endif
#if defined(__AVXVNNI__)
#define QS_X86_AVX_VNNI 1
#else
#define QS_X86_AVX_VNNI 0
#endif

// AVX512-BF16 (bf16 pair dot products): prefill attention
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define QS_X86_AVX512_BF16 1
#else
#define QS_X86_AVX512_BF16 0
#endif

// AMX int8 and bf16 tiles (Sapphire Rapids and later Xeons, all of which have AVX512-BF16): the builds for such CPUs
// carry the AMX kernels with their instructions enabled per function (arch/x86/amx_tiles.h, amx_bf16_tiles.h), and
// run them only where CPUID and the OS allow, so the variant still runs on AVX512-BF16 CPUs without AMX (Zen 4, Zen 5)
#if QS_X86_AVX512_VNNI && QS_X86_AVX512_BF16 && defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)
#define QS_X86_AMX_BUILD 1
#else
#define QS_X86_AMX_BUILD 0
#endif

// AArch64 Advanced SIMD (NEON), which every aarch64 CPU has, with its fp16 <-> fp32 conversions: the ARM ggml
// kernels (arch/arm/), whose integer dot products fall back to widening multiplies without dotprod
#if defined(__aarch64__) && defined(__ARM_NEON)
#define QS_ARM_NEON 1
#else
#define QS_ARM_NEON 0
#endif

// the int8 dot product instructions (sdot: 4 s8 x s8 products into each int32 lane; Armv8.2 and later, e.g.
// Cortex-A76, Neoverse N1, Apple M1)
#if QS_ARM_NEON && defined(__ARM_FEATURE_DOTPROD)
#define QS_ARM_DOTPROD 1
#else
#define QS_ARM_DOTPROD 0
#endif

// the int8 matrix multiply instructions (smmla: a 2x8 by 8x2 s8 product into a 2x2 int32 tile; Armv8.6, e.g.
// Neoverse V1 / N2, Graviton3, Apple M2): the ARM ggml tile kernels for many activation rows
#if QS_ARM_NEON && defined(__ARM_FEATURE_MATMUL_INT8)
#define QS_ARM_I8MM 1
#else
#define QS_ARM_I8MM 0
#endif
