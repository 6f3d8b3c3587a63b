/* The fast inner loops for AVX-512 (16 floats a vector). */
#pragma GCC target("avx512f,avx512dq,avx512vl,avx2,fma")
#ifdef __clang__ /* clang ignores the GCC pragma: the same target for every function of this file */
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512vl,avx2,fma"))), apply_to = function)
#endif
#define VW 16
#define ISA_TABLE mrl_cpu_isa_avx512
#define ISA_NAME "avx512"
#define ISA_LEVEL 2
#define ISA_LOOP(name) name##_avx512 /* the conversion loops of this set (isa.h) */
#include "isa_impl.h"
#ifdef __clang__
#pragma clang attribute pop
#endif
