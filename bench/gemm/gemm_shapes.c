/* The matrix products of the model, timed through the fast kernel table at
 * the current thread count (MOONRL_THREADS).
 *
 * 1. One linear layer's training step over T tokens: forward x W^T, input
 *    gradient dy W and weight gradient dy^T x (the same work each: a product
 *    far below the others is a slicing problem, not arithmetic).
 * 2. Decode-sized products x W^T of M = 1..256 rows against 16 different
 *    weight matrices in turn (so W comes from L3, as in a decode step over
 *    all layers): W read through OpenBLAS (which packs W on every call)
 *    against W as weight panels packed once (kernels.h, the engine's path).
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

static void training_products(const mrl_kernels *k, int64_t T, int64_t in, int64_t out, int64_t reps) {
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
    free(x), free(W), free(y), free(dx), free(dW);
}

static void decode_products(const mrl_kernels *k, int64_t in, int64_t out, int64_t reps) {
    enum { NW = 16 };
    float *W[NW], *P[NW];
    for (int i = 0; i < NW; i++) {
        W[i] = filled(out * in);
        P[i] = malloc(sizeof(float) * mrl_panels_floats(out, in));
        k->panels_pack(P[i], W[i], out, in);
    }
    float *x = filled(256 * in), *y = filled(256 * out);
    for (int64_t M = 1; M <= 256; M *= 2) {
        double best[2] = {1e30, 1e30};
        for (int64_t r = 0; r < reps; r++)
            for (int path = 0; path < 2; path++) {
                double t0 = now();
                for (int i = 0; i < NW; i++) {
                    mrl_gemm_desc d = {0, 1, M, out, in, 1.0f, x, in, path ? P[i] : W[i], in, 0.0f, y, out,
                                       .b_panels = path};
                    k->gemm_group(&d, 1);
                }
                double dt = now() - t0;
                if (dt < best[path]) best[path] = dt;
            }
        double flop = 2.0 * M * in * out * NW;
        printf("decode x W^T M=%3lld in=%lld out=%lld: W in place %.1f GFLOP/s, weight panels %.1f GFLOP/s\n",
               (long long)M, (long long)in, (long long)out, flop / best[0] * 1e-9, flop / best[1] * 1e-9);
    }
    for (int i = 0; i < NW; i++) free(W[i]), free(P[i]);
    free(x), free(y);
}

int main(int argc, char **argv) {
    int64_t T = argc > 1 ? atoll(argv[1]) : 2366, in = argc > 2 ? atoll(argv[2]) : 256,
            out = argc > 3 ? atoll(argv[3]) : 768, reps = argc > 4 ? atoll(argv[4]) : 20;
    const mrl_kernels *k = mrl_kernels_cpu_fast();
    training_products(k, T, in, out, reps);
    decode_products(k, in, out, reps);
    return 0;
}
