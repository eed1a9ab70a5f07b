// The instruction-set features the kernels are compiled for, as QS_* macros that are 1 or 0: the one place that
// reads the compiler's feature macros. Each CPU variant's library is built with its own flags
// (qwenserve/config/cpu_variants.py), so each macro says what that variant's CPUs have; a source tests
// `#if QS_X86_AVX2` and never `__AVX2__` itself, so the meaning of a feature class
// (such as "AVX2 comes with FMA and F16C") is decided here once for every op family.
//
// x86 kernels live under arch/x86/; an ARM port adds its QS_ARM_* macros (NEON, dotprod, i8mm) below and its
// kernels under arch/arm/.
#pragma once

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
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
