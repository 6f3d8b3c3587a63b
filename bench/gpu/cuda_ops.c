/* The CUDA op table's speed (kernels/cuda): the TFLOP/s of the fp32 and
 * bf16 products and of attention forward and backward on one GPU
 * (tests/gpu/run.sh prints it; the op test, tests/kernels/test_ops.c,
 * checks the same ops' results). Exits 77 where no GPU is visible.
 *   bench_cuda_ops */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "lib/check.h"
#include "lib/random.h"
#include "kernels.h"
#include "cuda_backend.h"
#include "moonrl/device.h"
#include "moonrl/runtime.h"

static const mrl_kernels *G;
static void *stream;

static void *up(const void *h, size_t bytes) {
    void *d = NULL;
    CHECK_OK(mrl_cuda_malloc(0, bytes ? bytes : 4, &d));
    if (bytes && h) CHECK_OK(mrl_cuda_memcpy(d, h, bytes, 0, stream));
    return d;
}
static void *upf(const float *h, int64_t n) { return up(h, (size_t)n * sizeof(float)); }

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void bench(void) {
    printf("\nbenchmark (one H200-class GPU; TFLOP/s = nominal flops / time)\n");
    int64_t n = 4096;
    float *h = rnd(n * n, 1);
    void *A = upf(h, n * n), *B = upf(h, n * n), *C = up(NULL, 4 * n * n), *A16 = up(NULL, 2 * n * n),
         *B16 = up(NULL, 2 * n * n);
    free(h);
    G->f32_to_bf16(A, A16, n * n);
    G->f32_to_bf16(B, B16, n * n);
    const char *what[] = {"gemm fp32 (no TF32)", "gemm_bf16 bf16 in", "gemm_bf16 fp32 in (rounded per call)"};
    for (int mode = 0; mode < 3; mode++) {
        int reps = mode == 0 ? 5 : 20;
        double t0 = 0;
        for (int it = -1; it < reps; it++) { /* it = -1: the warm-up (cuBLASLt's first call) */
            if (it == 0) {
                CHECK_OK(mrl_cuda_ops_check());
                t0 = now();
            }
            if (mode == 0) G->gemm(0, 1, n, n, n, 1.0f, A, n, B, n, 0.0f, C, n);
            else if (mode == 1) G->gemm_bf16(0, 1, n, n, n, 1.0f, A16, 1, n, B16, 1, n, 0.0f, C, n);
            else G->gemm_bf16(0, 1, n, n, n, 1.0f, A, 0, n, B, 0, n, 0.0f, C, n);
        }
        CHECK_OK(mrl_cuda_ops_check());
        double dt = (now() - t0) / reps;
        printf("  %-40s %lldx%lldx%lld  %8.3f ms  %7.1f TFLOP/s\n", what[mode], (long long)n, (long long)n,
               (long long)n, dt * 1e3, 2.0 * n * n * n / dt / 1e12);
    }
    mrl_cuda_free(A), mrl_cuda_free(B), mrl_cuda_free(C), mrl_cuda_free(A16), mrl_cuda_free(B16);
    /* attention: 8 sequences of 1024 tokens, Qwen-like heads */
    int n_seqs = 8, len = 1024, Hq = 32, Hk = 8, hd = 128;
    int64_t T = (int64_t)n_seqs * len;
    int32_t cu[9];
    for (int s = 0; s <= n_seqs; s++) cu[s] = s * len;
    void *q, *k, *v, *o, *lse, *dq, *dk, *dv, *dcu;
    size_t bq = 4 * T * Hq * hd, bk = 4 * T * Hk * hd;
    CHECK_OK(mrl_cuda_malloc(0, bq, &q));
    CHECK_OK(mrl_cuda_malloc(0, bk, &k));
    CHECK_OK(mrl_cuda_malloc(0, bk, &v));
    CHECK_OK(mrl_cuda_malloc(0, bq, &o));
    CHECK_OK(mrl_cuda_malloc(0, 4 * T * Hq, &lse));
    CHECK_OK(mrl_cuda_malloc(0, bq, &dq));
    CHECK_OK(mrl_cuda_malloc(0, bk, &dk));
    CHECK_OK(mrl_cuda_malloc(0, bk, &dv));
    dcu = up(cu, sizeof cu);
    float *hq = rnd(T * Hq * hd, 1);
    CHECK_OK(mrl_cuda_memcpy(q, hq, bq, 0, stream));
    CHECK_OK(mrl_cuda_memcpy(o, hq, bq, 0, stream));
    CHECK_OK(mrl_cuda_memcpy(k, hq, bk, 0, stream));
    CHECK_OK(mrl_cuda_memcpy(v, hq, bk, 0, stream));
    free(hq);
    double flops = 4.0 * hd * Hq * n_seqs * (double)len * (len + 1) / 2; /* QK^T and PV, causal */
    float scale = 1.0f / sqrtf((float)hd);
    for (int pass = 0; pass < 2; pass++) {
        int reps = 3;
        G->attn_fwd(o, lse, q, k, v, dcu, NULL, n_seqs, Hq, Hk, hd, scale); /* warm, and the lse for bwd */
        CHECK_OK(mrl_cuda_ops_check());
        double t0 = now();
        for (int it = 0; it < reps; it++) {
            if (pass == 0) G->attn_fwd(o, lse, q, k, v, dcu, NULL, n_seqs, Hq, Hk, hd, scale);
            else G->attn_bwd(dq, dk, dv, o, o, lse, q, k, v, dcu, NULL, n_seqs, Hq, Hk, hd, scale);
        }
        CHECK_OK(mrl_cuda_ops_check());
        double dt = (now() - t0) / reps, f = pass ? 2.5 * flops : flops; /* the backward: 2.5x (5 products) */
        printf("  %-40s %d x %d tokens Hq=%d Hk=%d hd=%d  %8.3f ms  %7.1f TFLOP/s\n",
               pass ? "attn_bwd (fp32, recompute)" : "attn_fwd (fp32, flash)", n_seqs, len, Hq, Hk, hd, dt * 1e3,
               f / dt / 1e12);
    }
    void *dev[] = {q, k, v, o, lse, dq, dk, dv, dcu};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) mrl_cuda_free(dev[i]);
}

int main(void) {
    CHECK_OK(mrl_init());
    if (mrl_device_cuda_count() == 0) {
        printf("no CUDA device visible: skipped\n");
        return 77;
    }
    char desc[256];
    CHECK_OK(mrl_device_describe((mrl_device){MRL_DEVICE_CUDA, 0}, desc, sizeof desc));
    printf("%s\n", desc);
    G = (const mrl_kernels *)mrl_kernels_cuda();
    CHECK_OK(mrl_cuda_stream_create(0, &stream));
    mrl_cuda_ops_set_stream(stream);
    bench();
    mrl_cuda_ops_set_stream(NULL);
    mrl_cuda_ops_release();
    mrl_cuda_stream_destroy(stream);
    mrl_shutdown();
    CHECK_DONE();
}
