/* Every CUDA op against the CPU reference on fresh random inputs, and the
 * device/stream/memory layer. Skips (exit 77) where no GPU is visible. */
#include <stdlib.h>
#include "moonrl/device.h"
#include "moonrl/runtime.h"
#include "cuda_backend.h"
#include "check.h"

static float frand(unsigned *state) {
    *state = *state * 1664525u + 1013904223u;
    return ((*state >> 8) / 16777216.0f) * 2.0f - 1.0f;
}

/* the CPU reference of RMSNorm, in double */
static void rmsnorm_reference(float *out, const float *x, const float *w, int rows, int dim, float eps) {
    for (int r = 0; r < rows; r++) {
        double ss = 0;
        for (int i = 0; i < dim; i++) ss += (double)x[r * dim + i] * x[r * dim + i];
        double scale = 1.0 / sqrt(ss / dim + eps);
        for (int i = 0; i < dim; i++) out[r * dim + i] = (float)(x[r * dim + i] * scale * w[i]);
    }
}

static void test_rmsnorm(int rows, int dim, unsigned seed) {
    size_t n = (size_t)rows * dim;
    float *x = malloc(n * 4), *w = malloc(dim * 4), *want = malloc(n * 4), *got = malloc(n * 4);
    for (size_t i = 0; i < n; i++) x[i] = frand(&seed) * 3;
    for (int i = 0; i < dim; i++) w[i] = 1 + frand(&seed) * 0.5f;
    rmsnorm_reference(want, x, w, rows, dim, 1e-6f);

    mrl_device gpu = {MRL_DEVICE_CUDA, 0}, cpu = {MRL_DEVICE_CPU, 0};
    mrl_buffer dx, dw, dout, drms, hx, hw, hout;
    CHECK_OK(mrl_buffer_alloc(gpu, n * 4, MRL_MEM_ACTIVATIONS, &dx));
    CHECK_OK(mrl_buffer_alloc(gpu, dim * 4, MRL_MEM_PARAMS, &dw));
    CHECK_OK(mrl_buffer_alloc(gpu, n * 4, MRL_MEM_ACTIVATIONS, &dout));
    CHECK_OK(mrl_buffer_alloc(gpu, rows * 4, MRL_MEM_ACTIVATIONS, &drms));
    hx = (mrl_buffer){x, n * 4, cpu, MRL_MEM_OTHER};
    hw = (mrl_buffer){w, dim * 4, cpu, MRL_MEM_OTHER};
    hout = (mrl_buffer){got, n * 4, cpu, MRL_MEM_OTHER};
    mrl_stream *s;
    CHECK_OK(mrl_stream_create(gpu, &s));
    CHECK_OK(mrl_buffer_copy(&dx, 0, &hx, 0, n * 4, s));
    CHECK_OK(mrl_buffer_copy(&dw, 0, &hw, 0, dim * 4, s));
    CHECK_OK(mrl_stream_sync(s));
    CHECK_OK(mrl_cuda_rmsnorm_forward(dout.data, drms.data, dx.data, dw.data, rows, dim, 1e-6f, NULL));
    CHECK_OK(mrl_buffer_copy(&hout, 0, &dout, 0, n * 4, NULL));
    double max_err = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs(got[i] - want[i]) / (fabs(want[i]) + 1e-3);
        if (e > max_err) max_err = e;
    }
    printf("rmsnorm rows=%d dim=%d: max relative error %.3g\n", rows, dim, max_err);
    CHECK(max_err < 1e-5);
    mrl_stream_destroy(s);
    mrl_buffer_free(&dx);
    mrl_buffer_free(&dw);
    mrl_buffer_free(&dout);
    mrl_buffer_free(&drms);
    free(x), free(w), free(want), free(got);
}

int main(void) {
    CHECK_OK(mrl_init());
    if (mrl_device_cuda_count() == 0) {
        printf("no CUDA device visible: skipped\n");
        return 77;
    }
    char desc[256];
    mrl_device gpu = {MRL_DEVICE_CUDA, 0};
    CHECK_OK(mrl_device_describe(gpu, desc, sizeof desc));
    printf("%s\n", desc);
    unsigned seed = 12345;
    test_rmsnorm(1, 1, seed++);
    test_rmsnorm(7, 33, seed++);
    test_rmsnorm(64, 896, seed++);
    test_rmsnorm(300, 4096, seed++);
    test_rmsnorm(5, 20000, seed++);
    /* bad arguments are errors, not launches */
    CHECK(mrl_cuda_rmsnorm_forward(NULL, NULL, NULL, NULL, 0, 8, 1e-6f, NULL) == MRL_ERR_INVALID);
    mrl_shutdown();
    CHECK_DONE();
}
