/* The fast inner loops for AVX-512 (16 floats a vector). */
#pragma GCC target("avx512f,avx512dq,avx512vl,avx2,fma")
#define VW 16
#define ISA_TABLE mrl_cpu_isa_avx512
#define ISA_NAME "avx512"
#define ISA_LEVEL 2
#define ISA_LOOP(name) name##_avx512 /* the conversion loops of this set (isa.h) */
#include "isa_impl.h"
