/* Process-wide runtime: version, build features, initialisation. */
#pragma once
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "0.1.0" */
const char *mrl_version(void);
/* Git revision the library was built from ("unknown" outside git). */
const char *mrl_git_revision(void);
/* Space-separated backends that can run the model (today "cpu"); whether CUDA
 * code is built in: mrl_device_cuda_built (moonrl/device.h). */
const char *mrl_backends(void);
/* CPU features detected at run time: "avx2 fma avx512f ..." */
const char *mrl_cpu_features(void);
/* Instruction sets the CPU kernels are built for ("avx512 avx2 sse"), and the
 * one in use on this CPU ("avx512"). */
const char *mrl_kernel_isas_built(void);
const char *mrl_kernel_isa(void);
/* 1 when the running CPU has the named feature ("avx2", "avx512f", ...). */
int mrl_cpu_has(const char *feature);
/* The bf16 matrix-product path this CPU gets ("onednn (avx512_core_bf16) +
 * avx512_bf16 (few rows)", ...), or "none" where it has no fast bf16
 * (neither AVX512-BF16 nor AMX): then products stay fp32. */
const char *mrl_bf16_products(void);
/* The library of the fp32 matrix products and its kernels ("OpenBLAS
 * Cooperlake"; "oneDNN (avx512_core); OpenBLAS's Prescott kernels are below
 * this CPU's avx512" where OpenBLAS does not know the CPU; MOONRL_FP32_GEMM
 * = openblas | onednn | auto overrides the choice). */
const char *mrl_fp32_products(void);
/* This process's id (for messages and events). */
int mrl_process_id(void);
/* Initialise the runtime (idempotent): logging level, threads, the event loop. */
mrl_status mrl_init(void);
void mrl_shutdown(void);

#ifdef __cplusplus
}
#endif
