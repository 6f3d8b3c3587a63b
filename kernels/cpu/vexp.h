/* Vector exp and the CPU's vector level, shared by the CPU kernels. Internal. */
#pragma once
#include <stdint.h>

/* 2: AVX-512F, 1: AVX2 + FMA, 0: scalar: what this CPU has, at most the cap. */
int mrl_cpu_isa_level(void);
/* Cap the level (tests and benchmarks run every path the CPU has); returns
 * the previous cap. Not thread-safe: call it between kernels. */
int mrl_cpu_isa_cap(int level);
/* "avx512", "avx2" or "scalar" for mrl_cpu_isa_level(). */
const char *mrl_cpu_isa_name(void);

/* w[i] = exp(x[i] - m) for i < n (w may be x) and their sum in double; for
 * x[i] <= m. AVX paths use a degree-6 polynomial (~1e-7 relative error) and
 * flush exp(t) to 0 below t = -87. */
double mrl_vexp_sum(float *w, const float *x, float m, int64_t n);
