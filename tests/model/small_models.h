/* Small models and one packed batch for the model tests that compare two
 * ways of computing the same thing (bf16 against fp32: test_bf16.c; a GPU
 * against the CPU: tests/gpu/test_cuda_model.c), and the comparisons they
 * make. One seeded generator (rng, urand) per test file. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "moonrl/model.h"
#include "base/rng.h"

static uint64_t rng = MRL_GOLDEN64;
static inline double urand(void) { return mrl_unit53(mrl_xorshift64(&rng)); }

/* 2 layers of 64 wide, 4 query and 2 K/V heads, a vocabulary of 211: the
 * Llama and Qwen3 ones tied, Qwen2's with biases and its own lm_head. */
static inline mrl_model_config small_config(int arch) {
    mrl_model_config c;
    mrl_model_config_default(&c);
    c.arch = arch;
    c.vocab_size = 211;
    c.hidden_size = 64;
    c.intermediate_size = 160;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.max_position_embeddings = 128;
    c.tie_word_embeddings = arch != MRL_ARCH_QWEN2; /* both head layouts */
    c.initializer_range = 0.15;                   /* logits of a few units: log-probs that vary */
    if (arch == MRL_ARCH_QWEN2) c.attention_bias = 1;
    return c;
}

/* The model of c from seed, its norm weights and biases moved away from 1
 * and 0 so that they matter. */
static inline mrl_model *small_model(const mrl_model_config *c, uint64_t seed) {
    mrl_model *m = NULL;
    CHECK_OK(mrl_model_create(c, seed, &m));
    if (!m) exit(1);
    float *p = mrl_model_params(m);
    uint64_t keep = rng;
    rng = seed * 2654435761u + 1;
    for (int i = 0; i < mrl_model_num_views(m); i++) {
        mrl_param_view v;
        mrl_model_view(m, i, &v);
        if (v.ndim != 1) continue;
        float base = strstr(v.name, "bias") ? 0.0f : 1.0f;
        for (int64_t j = 0; j < v.numel; j++) p[v.offset + j] = base + (float)(0.4 * (urand() - 0.5));
    }
    rng = keep;
    return m;
}

/* A packed batch: 3 sequences, the third continuing the first (a shared
 * prompt), each one's last target -1; and random upstream gradients of the
 * log-probs, entropy and values. */
typedef struct batch {
    int32_t tokens[96], targets[96], cu[4], prefix[3];
    mrl_batch b;
    float dlp[96], dent[96], dval[96];
} batch;

static inline void make_batch(batch *x, int V) {
    static const int lens[3] = {37, 29, 19};
    int n = 0;
    for (int s = 0; s < 3; s++) {
        x->cu[s] = n;
        for (int i = 0; i < lens[s]; i++, n++) x->tokens[n] = (int32_t)(urand() * V);
    }
    x->cu[3] = n;
    for (int i = 0; i < n; i++) {
        x->targets[i] = (int32_t)(urand() * V);
        x->dlp[i] = (float)(urand() - 0.5);
        x->dent[i] = (float)(0.3 * (urand() - 0.5));
    }
    for (int i = 0; i < n; i++) x->dval[i] = (float)((i * 37 % 101) / 101.0 - 0.5); /* not from rng: the draws above stay test_bf16's */
    for (int s = 0; s < 3; s++) x->targets[x->cu[s + 1] - 1] = -1;
    x->prefix[0] = -1, x->prefix[1] = -1, x->prefix[2] = 0;
    x->b = (mrl_batch){x->tokens, x->targets, x->cu, n, 3, x->prefix};
}

/* max |a - b| (infinite where either is not finite and they differ) */
static inline double max_abs_diff(const float *a, const float *b, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = isfinite(a[i]) && isfinite(b[i]) ? fabs((double)a[i] - b[i]) : a[i] == b[i] ? 0 : INFINITY;
        if (!(e <= d)) d = e;
    }
    return d;
}

/* The largest, over the views, of ||a - b|| / ||b|| (which: its name; may be NULL). */
static inline double worst_view(const mrl_model *m, const float *a, const float *b, const char **which) {
    double worst = 0;
    for (int i = 0; i < mrl_model_num_views(m); i++) {
        mrl_param_view v;
        mrl_model_view(m, i, &v);
        double num = 0, den = 0;
        for (int64_t j = v.offset; j < v.offset + v.numel; j++) {
            double d = (double)a[j] - b[j];
            num += d * d, den += (double)b[j] * b[j];
        }
        double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        if (!(rel <= worst)) {
            worst = rel;
            if (which) *which = v.name;
        }
    }
    return worst;
}
