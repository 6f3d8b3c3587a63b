/* Sampling from rows of a 151,936-token vocabulary (Qwen2.5): mrl_sample_rows
 * vs a straightforward baseline in the same process (scalar expf, a full
 * sort of the vocabulary for top-p, one row after another, as a plain
 * HF-style warper chain would do on the CPU).
 * usage: bench_sample [rows] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "moonrl/engine.h"
#include "moonrl/parallel.h"
#include "engine/sample.h"

#define V 151936

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct pi {
    float p;
    int i;
} pi;

static int by_p_desc(const void *a, const void *b) {
    const pi *x = a, *y = b;
    return x->p != y->p ? (x->p > y->p ? -1 : 1) : x->i - y->i;
}

/* temperature then top-p with a full sort; draws in token-id order among
 * the kept tokens, as mrl_sample_rows does; returns the token */
static int baseline_row(const float *logits, float temp, float top_p, double u, pi *buf, float *w, char *kept) {
    float m = -INFINITY;
    for (int i = 0; i < V; i++) m = fmaxf(m, logits[i] / temp);
    double z = 0;
    for (int i = 0; i < V; i++) {
        buf[i].p = w[i] = expf(logits[i] / temp - m);
        buf[i].i = i;
        z += buf[i].p;
        kept[i] = 0;
    }
    qsort(buf, V, sizeof(pi), by_p_desc);
    double cum = 0;
    int n = 0;
    while (n < V && cum < top_p * z) {
        kept[buf[n].i] = 1;
        cum += buf[n++].p;
    }
    double zk = 0;
    for (int i = 0; i < V; i++) zk += kept[i] ? w[i] : 0;
    double target = u * zk, c = 0;
    int last = buf[0].i;
    for (int i = 0; i < V; i++)
        if (kept[i]) {
            last = i;
            if ((c += w[i]) > target) return i;
        }
    return last;
}

int main(int argc, char **argv) {
    int rows = argc > 1 ? atoi(argv[1]) : 32;
    if (rows < 1) rows = 1;
    float *logits = malloc(sizeof(float) * (size_t)rows * V);
    uint64_t k = mrl_sample_stream_key(1, 0, 0, 0);
    for (int64_t i = 0; i < (int64_t)rows * V; i++) /* a peaked, LM-like row: a few strong tokens */
        logits[i] = (float)(mrl_sample_uniform(k, i) * 8.0 - 4.0 + (i % V < 20 ? 10.0 : 0.0));
    mrl_sampling_params *params = malloc(sizeof(*params) * rows);
    uint64_t *keys = malloc(sizeof(uint64_t) * rows);
    int64_t *ctr = calloc(rows, sizeof(int64_t));
    int32_t *tok = malloc(sizeof(int32_t) * rows);
    float *lp = malloc(sizeof(float) * rows);
    for (int r = 0; r < rows; r++) {
        params[r] = (mrl_sampling_params){0.8f, 0, 0.9f, 0.0f};
        keys[r] = mrl_sample_stream_key(7, 0, r, 0);
    }
    pi *buf = malloc(sizeof(pi) * V);
    float *w = malloc(sizeof(float) * V);
    char *kept = malloc(V);
    double best_ours = 1e30, best_base = 1e30;
    int agree = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now();
        mrl_sample_rows(logits, rows, V, params, keys, ctr, tok, lp, NULL);
        double t1 = now();
        agree = 0;
        for (int r = 0; r < rows; r++)
            agree += baseline_row(logits + (int64_t)r * V, 0.8f, 0.9f, mrl_sample_uniform(keys[r], 0), buf, w, kept) == tok[r];
        double t2 = now();
        if (t1 - t0 < best_ours) best_ours = t1 - t0;
        if (t2 - t1 < best_base) best_base = t2 - t1;
    }
    printf("%d rows x %d vocab, temperature 0.8, top-p 0.9, %d threads: mrl_sample_rows %.3f ms/row, "
           "baseline %.3f ms/row, speed-up %.1fx (same token in %d of %d rows)\n",
           rows, V, mrl_parallel_threads(), best_ours * 1e3 / rows, best_base * 1e3 / rows, best_base / best_ours, agree,
           rows);
    free(logits); free(params); free(keys); free(ctr); free(tok); free(lp); free(buf); free(w); free(kept);
    return 0;
}
