/* The fast inner loops for AVX2 + FMA (8 floats a vector). */
#pragma GCC target("avx2,fma")
#ifdef __clang__ /* clang ignores the GCC pragma: the same target for every function of this file */
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#endif
#define VW 8
#define ISA_TABLE mrl_cpu_isa_avx2
#define ISA_NAME "avx2"
#define ISA_LEVEL 1
#define ISA_LOOP(name) name##_avx2 /* the conversion loops of this set (isa.h) */
#include "isa_impl.h"
#ifdef __clang__
#pragma clang attribute pop
#endif
