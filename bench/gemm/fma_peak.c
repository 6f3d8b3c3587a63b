/* The CPU's fp32 FMA peak for one thread, 512-bit vs 256-bit vectors: 24
 * independent chains of vfmadd231ps (no loads), so only the FMA units'
 * throughput limits. On this machine both widths give the same flops: a
 * 512-bit FMA costs two 256-bit ones, and an AVX-512 sgemm cannot beat
 * OpenBLAS's AVX2 kernels by more than their distance to this peak.
 * usage: bench_fma_peak [million iterations] */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

#define F(w, r) "vfmadd231ps %%" w "30, %%" w "31, %%" w #r "\n\t"
#define BODY(w)                                                                                          \
    F(w, 0) F(w, 1) F(w, 2) F(w, 3) F(w, 4) F(w, 5) F(w, 6) F(w, 7) F(w, 8) F(w, 9) F(w, 10) F(w, 11)    \
        F(w, 12) F(w, 13) F(w, 14) F(w, 15) F(w, 16) F(w, 17) F(w, 18) F(w, 19) F(w, 20) F(w, 21)        \
            F(w, 22) F(w, 23)
/* every register the body writes (so the compiler keeps nothing there) */
#define CLOBBERS                                                                                         \
    "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",  \
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20",        \
        "xmm21", "xmm22", "xmm23"

__attribute__((target("avx512f"))) static double zmm(long n) {
    double t = now();
    for (long i = 0; i < n; i++) __asm__ volatile(BODY("zmm")::: CLOBBERS);
    return n * 24 * 32.0 / (now() - t) / 1e9;
}

__attribute__((target("avx512f"))) static double ymm(long n) {
    double t = now();
    for (long i = 0; i < n; i++) __asm__ volatile(BODY("ymm")::: CLOBBERS);
    return n * 24 * 16.0 / (now() - t) / 1e9;
}

int main(int argc, char **argv) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f")) {
        fprintf(stderr, "bench_fma_peak: this CPU has no AVX-512\n");
        return 0;
    }
    long n = (argc > 1 ? atol(argv[1]) : 100) * 1000000L;
    double z = 0, y = 0;
    for (int r = 0; r < 3; r++) { /* best of 3, alternating */
        double a = zmm(n), b = ymm(n);
        z = a > z ? a : z, y = b > y ? b : y;
    }
    printf("fp32 FMA peak, 1 thread: 512-bit %.1f GFLOP/s, 256-bit %.1f GFLOP/s (ratio %.2f)\n", z, y, z / y);
    return 0;
}
