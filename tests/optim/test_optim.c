/* AdamW: mrl_adamw_step (the fast table's op) against
 * mrl_adamw_step_reference (the reference's) bit for bit, results
 * independent of the thread count (each instruction set's loop against the
 * scalar one: tests/kernels/test_ops.c), the no-decay mask, state save /
 * resume, gradient norm and clipping, and bad arguments. */
#include <stdlib.h>
#include <string.h>
#include "moonrl/optim.h"
#include "moonrl/parallel.h"
#include "moonrl/status.h"
#include "check.h"
#include "random.h"

enum { N = 300007 }; /* odd size: exercises the vector tails and block edges */

static const mrl_adamw_config cfg = {1e-3, 0.9, 0.999, 1e-8, 0.1};
static const int64_t mask[] = {10, 100, 5000, 3, 4999, 2, 299000, 1007};

/* Run `steps` steps on a copy of p0 with per-step grads; returns params. */
static float *run(const float *p0, float *const *g, int steps, int threads, int reference) {
    mrl_parallel_set_threads(threads);
    float *p = malloc(N * sizeof *p), *grad = malloc(N * sizeof *grad);
    memcpy(p, p0, N * sizeof *p);
    mrl_adamw *opt;
    CHECK_OK(mrl_adamw_create(p, grad, N, &cfg, &opt));
    CHECK_OK(mrl_adamw_set_no_decay(opt, mask, 4));
    for (int s = 0; s < steps; s++) {
        memcpy(grad, g[s], N * sizeof *grad);
        double norm;
        CHECK_OK(mrl_grad_clip_norm(grad, N, 50.0, &norm));
        CHECK_OK(reference ? mrl_adamw_step_reference(opt, 1e-3 * (s + 1)) : mrl_adamw_step(opt, 1e-3 * (s + 1)));
    }
    CHECK(mrl_adamw_steps(opt) == steps);
    mrl_adamw_free(opt);
    free(grad);
    mrl_parallel_set_threads(0);
    return p;
}

static void test_fast_vs_reference(void) {
    float *p0 = urnd(N, 1.0f), *g[4];
    for (int s = 0; s < 4; s++) g[s] = urnd(N, 0.1f);
    float *ref = run(p0, g, 4, 1, 1);
    int threads[] = {1, 2, 3, 7};
    for (int k = 0; k < 4; k++) {
        float *fast = run(p0, g, 4, threads[k], 0);
        CHECK(memcmp(fast, ref, N * sizeof(float)) == 0);
        free(fast);
    }
    free(ref); free(p0);
    for (int s = 0; s < 4; s++) free(g[s]);
}

/* The offload's pipeline (mrl_offload: here on host buffers, its copies memmoves) steps in
 * chunks: any chunk size gives the bits of whole steps, the no-decay ranges crossing chunk
 * edges; the master weights start as the parameters, and a pull takes them again. */
static void test_offload_chunks(void) {
    float *p0 = urnd(N, 1.0f), *g[4];
    for (int s = 0; s < 4; s++) g[s] = urnd(N, 0.1f);
    float *ref = run(p0, g, 4, 1, 0);
    int64_t chunks[] = {7, 4099, 100000, N, 2 * N};
    float *p = malloc(N * sizeof *p), *grad = malloc(N * sizeof *grad);
    for (int c = 0; c < 5; c++) {
        memcpy(p, p0, N * sizeof *p);
        mrl_offload *o = NULL;
        CHECK_OK(mrl_offload_create(p, grad, N, &cfg, chunks[c], &o));
        if (!o) break;
        CHECK_OK(mrl_adamw_set_no_decay(mrl_offload_adamw(o), mask, 4));
        memset(p, 0, N * sizeof *p); /* the master weights are the offload's: pulled back below */
        CHECK_OK(mrl_offload_pull(o));
        memcpy(p, p0, N * sizeof *p);
        CHECK_OK(mrl_offload_pull(o));
        for (int s = 0; s < 4; s++) {
            memcpy(grad, g[s], N * sizeof *grad);
            double norm;
            CHECK_OK(mrl_grad_clip_norm(grad, N, 50.0, &norm));
            CHECK_OK(mrl_offload_step(o, 1e-3 * (s + 1)));
        }
        CHECK(mrl_adamw_steps(mrl_offload_adamw(o)) == 4);
        CHECK(memcmp(p, ref, N * sizeof(float)) == 0);
        mrl_offload_free(o);
    }
    mrl_offload *o = NULL;
    CHECK(mrl_offload_create(p, grad, N, &cfg, 0, &o) == MRL_ERR_INVALID && o == NULL);
    free(p); free(grad); free(ref); free(p0);
    for (int s = 0; s < 4; s++) free(g[s]);
}

/* One step by hand in double: decay applies outside the mask only. */
static void test_semantics(void) {
    float p[8] = {1, -2, 3, -4, 0.5f, 6, -7, 8}, g[8] = {0.1f, 0.2f, -0.3f, 0.4f, 0, -0.6f, 0.7f, 1e-3f};
    float p0[8];
    memcpy(p0, p, sizeof p);
    mrl_adamw *opt;
    mrl_adamw_config c = {0.01, 0.8, 0.9, 1e-6, 0.5};
    CHECK_OK(mrl_adamw_create(p, g, 8, &c, &opt));
    int64_t nd[] = {2, 3};
    CHECK_OK(mrl_adamw_set_no_decay(opt, nd, 1));
    CHECK_OK(mrl_adamw_step(opt, -1));
    for (int i = 0; i < 8; i++) {
        int decay = i < 2 || i >= 5;
        double m = 0.2 * g[i], v = 0.1 * (double)g[i] * g[i];
        double want = p0[i] * (decay ? 1 - 0.01 * 0.5 : 1) - 0.01 / 0.2 * m / (sqrt(v) / sqrt(0.1) + 1e-6);
        CHECK_NEAR(p[i], want, 1e-6 * fabs(want) + 1e-7);
    }
    mrl_adamw_free(opt);
}

static void test_state_resume(void) {
    int64_t n = 1000;
    float *p0 = urnd(n, 1), *ga = urnd(n, 1), *pa = malloc(n * 4), *pb = malloc(n * 4);
    memcpy(pa, p0, n * 4);
    memcpy(pb, p0, n * 4);
    mrl_adamw *a, *b;
    CHECK_OK(mrl_adamw_create(pa, ga, n, &cfg, &a));
    CHECK_OK(mrl_adamw_create(pb, ga, n, &cfg, &b));
    for (int s = 0; s < 3; s++) CHECK_OK(mrl_adamw_step(a, -1));
    mrl_adamw_state st;
    CHECK_OK(mrl_adamw_get_state(a, &st));
    CHECK(st.n == n && st.step == 3 && st.bytes == n * 8);
    memcpy(pb, pa, n * 4);
    CHECK_OK(mrl_adamw_load_state(b, st.m, st.v, st.n, st.step));
    for (int s = 0; s < 2; s++) {
        CHECK_OK(mrl_adamw_step(a, -1));
        CHECK_OK(mrl_adamw_step(b, -1));
    }
    CHECK(memcmp(pa, pb, n * 4) == 0);
    CHECK(mrl_adamw_load_state(b, st.m, st.v, n - 1, 1) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "999");
    mrl_adamw_free(a);
    mrl_adamw_free(b);
    free(p0); free(ga); free(pa); free(pb);
}

static void test_grad_helpers(void) {
    float *g = urnd(N, 1);
    double want = 0;
    for (int i = 0; i < N; i++) want += (double)g[i] * g[i];
    want = sqrt(want);
    double norm[3];
    int threads[] = {1, 2, 5};
    for (int k = 0; k < 3; k++) {
        mrl_parallel_set_threads(threads[k]);
        CHECK_OK(mrl_grad_norm(g, N, &norm[k]));
    }
    mrl_parallel_set_threads(0);
    CHECK(norm[0] == norm[1] && norm[1] == norm[2]);
    CHECK_NEAR(norm[0], want, 1e-12 * want);
    float g0 = g[5];
    double pre;
    CHECK_OK(mrl_grad_clip_norm(g, N, 1.0, &pre));
    CHECK(pre == norm[0]);
    float coef = 1.0f / ((float)pre + 1e-6f);
    CHECK(g[5] == g0 * coef);
    double post;
    CHECK_OK(mrl_grad_norm(g, N, &post));
    CHECK_NEAR(post, 1.0, 1e-5);
    CHECK_OK(mrl_grad_clip_norm(g, N, 10.0, &pre)); /* under the limit: unchanged */
    CHECK(g[5] == g0 * coef);
    CHECK_OK(mrl_grad_scale(g, N, 0.5f));
    CHECK(g[5] == g0 * coef * 0.5f);
    CHECK_OK(mrl_grad_zero(g, N));
    CHECK(g[0] == 0 && g[N - 1] == 0);
    free(g);
}

static void test_bad_arguments(void) {
    float p[4] = {0}, g[4] = {0};
    mrl_adamw *opt = (mrl_adamw *)1;
    CHECK(mrl_adamw_create(NULL, g, 4, &cfg, &opt) == MRL_ERR_INVALID && opt == NULL);
    CHECK(mrl_adamw_create(p, g, 0, &cfg, &opt) == MRL_ERR_INVALID);
    mrl_adamw_config bad = cfg;
    bad.beta1 = 1.0;
    CHECK(mrl_adamw_create(p, g, 4, &bad, &opt) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "beta1");
    bad = cfg;
    bad.eps = NAN;
    CHECK(mrl_adamw_create(p, g, 4, &bad, &opt) == MRL_ERR_INVALID);
    CHECK_OK(mrl_adamw_create(p, g, 4, &cfg, &opt));
    int64_t r1[] = {2, 3};
    CHECK(mrl_adamw_set_no_decay(opt, r1, 1) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "offset 2, count 3");
    int64_t r2[] = {-1, 1};
    CHECK(mrl_adamw_set_no_decay(opt, r2, 1) == MRL_ERR_INVALID);
    CHECK(mrl_adamw_step(opt, INFINITY) == MRL_ERR_INVALID);
    CHECK(mrl_adamw_steps(opt) == 0);
    CHECK(mrl_adamw_step(NULL, 1) == MRL_ERR_INVALID);
    CHECK(mrl_grad_clip_norm(g, 4, 0.0, NULL) == MRL_ERR_INVALID);
    CHECK(mrl_grad_norm(NULL, 4, NULL) == MRL_ERR_INVALID);
    CHECK(mrl_grad_scale(NULL, 4, 1) == MRL_ERR_INVALID);
    mrl_adamw_free(opt);
}

int main(void) {
    test_fast_vs_reference();
    test_semantics();
    test_offload_chunks();
    test_state_resume();
    test_grad_helpers();
    test_bad_arguments();
    CHECK_DONE();
}
