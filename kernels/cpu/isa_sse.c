/* The fast inner loops for baseline x86-64 (SSE2, 4 floats a vector). */
#define VW 4
#define ISA_TABLE mrl_cpu_isa_sse
#define ISA_NAME "sse"
#define ISA_LEVEL 0
#define ISA_LOOP(name) name##_scalar /* the conversion loops of this set (isa.h) */
#include "isa_impl.h"
