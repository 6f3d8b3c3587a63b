/* Which library computes the fp32 matrix products (internal; fast.c's gemm
 * slots and the reports call it). OpenBLAS is the default, measured the
 * fastest fp32 path where it runs kernels of the CPU's instruction set
 * (bench/RESULTS.md). But Debian's OpenBLAS 0.3.21 does not know every CPU
 * it meets: on an Intel family 6 model 207 it silently falls back to its
 * SSE3 "Prescott" kernels, several times slower than the right ones
 * (bench/RESULTS.md, "fp32 products"). oneDNN picks its kernels from the CPU's own
 * feature bits at run time, so where OpenBLAS reports kernels below the
 * CPU's instruction set (older than AVX2 on an AVX2 CPU, older than AVX-512
 * on an AVX-512 one), the products go to oneDNN's fp32 matmul (where it is
 * built in). Its AVX2 "Haswell" kernels on AVX-512 CPUs (what
 * OPENBLAS_CORETYPE=Haswell gives) ran below oneDNN on a Zen 4, whose
 * 512-bit FMA has the throughput of two 256-bit ones, and far below on a
 * Zen 5, whose units are 512 bits wide (bench/RESULTS.md, "fp32 products").
 *
 * Results: OpenBLAS's do not depend on the thread count (fast.c cuts each
 * product into slices by its shape and the core count, never the thread
 * count: a slice's bits are not the whole call's). oneDNN takes
 * each product whole on its own threads: called on slices from inside our
 * parallel region, its results moved in the last bits with the thread that
 * ran them; whole, they came out the same bits run after run and at 1 and 2
 * threads (tests/kernels/test_ops.c checks the first; the second is not
 * promised by oneDNN).
 *
 * MOONRL_FP32_GEMM=openblas|onednn|auto overrides the rule (auto: the rule;
 * onednn where it is not built in: a warning, and OpenBLAS). */
#pragma once

typedef enum mrl_f32_path { MRL_F32_OPENBLAS = 0, MRL_F32_ONEDNN = 1 } mrl_f32_path;

/* The instruction-set level of an OpenBLAS x86 core name (what
 * openblas_get_corename() says; case-insensitive): 3 AVX-512, 2 AVX2, 1 AVX,
 * 0 older or generic kernels; -1 a name not known here. */
int mrl_openblas_core_level(const char *core);
/* The rule: given OpenBLAS's core name, the CPU's kernel level (2 AVX-512,
 * 1 AVX2, 0 SSE: mrl_cpu_isa_level) and whether oneDNN's fp32 product can
 * run, the path to take. */
mrl_f32_path mrl_cpu_f32_rule(const char *core, int cpu_level, int have_onednn);
/* The path in use (decided once, on first use: the environment, else the rule). */
mrl_f32_path mrl_cpu_f32_path(void);
/* Take `path` from now on (tests): 0, or -1 when it cannot run here. Not
 * thread-safe: call it between products. */
int mrl_cpu_f32_force_path(mrl_f32_path path);
/* For reports: "OpenBLAS Cooperlake", "oneDNN (avx512_core); OpenBLAS's
 * Prescott kernels are below this CPU's avx512", "OpenBLAS Haswell (below
 * this CPU's avx512)". */
const char *mrl_cpu_f32_path_name(void);
/* OpenBLAS's core name, or "unknown". */
const char *mrl_openblas_core(void);
