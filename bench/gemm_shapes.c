/* The matrix products of one layer's training step, timed through the fast
 * kernel table (mrl_kernels_cpu_fast()->gemm): forward x W^T, input gradient
 * dy W and weight gradient dy^T x, for T tokens, at the current thread count
 * (MOONRL_THREADS). Prints GFLOP/s per product; all three do the same work, so
 * a product far below the others is a slicing problem, not arithmetic.
 *
 *   build/bench/bench_gemm_shapes [T=2366] [in=256] [out=768] [reps=20] */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "kernels.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static float *filled(int64_t n) {
    float *x = malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) x[i] = (float)((i * 7919) % 1000) * 1e-3f - 0.5f;
    return x;
}

int main(int argc, char **argv) {
    int64_t T = argc > 1 ? atoll(argv[1]) : 2366, in = argc > 2 ? atoll(argv[2]) : 256,
            out = argc > 3 ? atoll(argv[3]) : 768, reps = argc > 4 ? atoll(argv[4]) : 20;
    const mrl_kernels *k = mrl_kernels_cpu_fast();
    float *x = filled(T * in), *W = filled(out * in), *y = filled(T * out), *dx = filled(T * in), *dW = filled(out * in);
    const char *names[3] = {"forward  y = x W^T ", "backward dx = dy W  ", "weights  dW += dy^T x"};
    for (int which = 0; which < 3; which++) {
        double best = 1e30;
        for (int64_t r = 0; r < reps; r++) {
            double t0 = now();
            if (which == 0) k->gemm(0, 1, T, out, in, 1.0f, x, in, W, in, 0.0f, y, out);
            if (which == 1) k->gemm(0, 0, T, in, out, 1.0f, y, out, W, in, 0.0f, dx, in);
            if (which == 2) k->gemm(1, 0, out, in, T, 1.0f, y, out, x, in, 1.0f, dW, in);
            double dt = now() - t0;
            if (dt < best) best = dt;
        }
        printf("%s T=%lld in=%lld out=%lld: %.3f ms, %.1f GFLOP/s\n", names[which], (long long)T, (long long)in,
               (long long)out, 1e3 * best, 2.0 * T * in * out / best * 1e-9);
    }
    return 0;
}
