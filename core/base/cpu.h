/* The CPU's features, probed once (core internal). Every dispatcher reads
 * this one struct: the fast kernels' instruction set (kernels/cpu/isa.c),
 * the bf16 products (kernels/cpu/gemm_bf16.c, gemm_bf16_amx.c), CRC-32C
 * (core/io/fs.c), and what `moonrl version` and `moonrl doctor` print
 * (mrl_cpu_features, mrl_cpu_has: core/runtime/runtime.c). */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_cpu_info {
    /* From the compiler's probe (__builtin_cpu_supports), which also asks
     * the OS, through XCR0, whether it saves the AVX and AVX-512 registers. */
    int sse4_2, avx, avx2, fma, f16c;
    int avx512f, avx512bw, avx512dq, avx512vl, avx512vnni, avx512bf16;
    /* CPUID.(7,0):EDX bits 22 (AMX-BF16) and 24 (AMX-TILE): the CPU has AMX. */
    int amx_bf16;
    /* AMX tiles may run here: amx_bf16, the OS saves the tile state (XCR0
     * bits 17 and 18), and Linux granted it to this process (arch_prctl
     * ARCH_REQ_XCOMP_PERM; without the grant the first tile instruction is
     * SIGILL). 0 with MOONRL_AMX=0, which turns moonrl's own tiles off
     * (A/B runs; oneDNN decides for itself): then the grant is not asked. */
    int amx_tiles;
} mrl_cpu_info;

/* The features of this CPU, filled at the first call (thread-safe). */
const mrl_cpu_info *mrl_cpu(void);

#ifdef __cplusplus
}
#endif
