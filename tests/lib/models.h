/* The C tests' tiny models: two presets of the config (small_config: the model tests that
 * compare two ways of computing the same thing, bf16 against fp32 in test_bf16.c and a GPU
 * against the CPU in tests/gpu; tiny_config: the engine tests), the 1-D parameters moved
 * away from 1 and 0 so that they matter, one packed batch with upstream gradients, and the
 * comparison of two parameter buffers view by view. Draws come from the file's stream
 * (random.h). */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "random.h"
#include "moonrl/model.h"

/* The engine tests' models: 2 layers of 64, 4 query and 2 K/V heads of 16, MLP 96, logits of a
 * few units (peaked distributions, few near-ties for greedy; log-probs that vary). */
static inline void tiny_config(mrl_model_config *c, int arch, int vocab) {
    mrl_model_config_default(c);
    c->arch = arch;
    c->vocab_size = vocab;
    c->hidden_size = 64;
    c->intermediate_size = 96;
    c->num_hidden_layers = 2;
    c->num_attention_heads = 4;
    c->num_key_value_heads = 2;
    c->head_dim = 16;
    c->max_position_embeddings = 256;
    c->initializer_range = 0.15;
}

/* The same with MLP 160 and a vocabulary of 211: the Llama and Qwen3 ones tied, Qwen2's with
 * biases and its own lm_head. */
static inline mrl_model_config small_config(int arch) {
    mrl_model_config c;
    tiny_config(&c, arch, 211);
    c.intermediate_size = 160;
    c.max_position_embeddings = 128;
    c.tie_word_embeddings = arch != MRL_ARCH_QWEN2; /* both head layouts */
    if (arch == MRL_ARCH_QWEN2) c.attention_bias = 1;
    if (arch == MRL_ARCH_DEEPSEEK_V3) { /* MLA: low-rank queries, values narrower than the query heads */
        c.num_key_value_heads = c.num_attention_heads;
        c.q_lora_rank = 24, c.kv_lora_rank = 32, c.qk_nope_head_dim = 12, c.qk_rope_head_dim = 8, c.v_head_dim = 16;
        c.rope_interleave = 1, c.head_dim = 20;
    }
    return c;
}

/* The 1-D parameters (norm weights, biases) of m to 1 (0 for a bias) plus a uniform of width
 * `width`, drawn from rng. */
static inline void perturb_vectors(mrl_model *m, double width) {
    float *p = mrl_model_params(m);
    for (int i = 0; i < mrl_model_num_views(m); i++) {
        mrl_param_view v;
        mrl_model_view(m, i, &v);
        if (v.ndim != 1) continue;
        double base = strstr(v.name, "bias") ? 0.0 : 1.0;
        for (int64_t j = 0; j < v.numel; j++) p[v.offset + j] = (float)(base + width * (urand() - 0.5));
    }
}

/* The model of c from seed, its 1-D parameters perturbed by 0.4 from a stream of seed's (rng
 * is left as it was). */
static inline mrl_model *small_model(const mrl_model_config *c, uint64_t seed) {
    mrl_model *m = NULL;
    CHECK_OK(mrl_model_create(c, seed, &m));
    if (!m) exit(1);
    uint64_t keep = rng;
    rng = seed * 2654435761u + 1;
    perturb_vectors(m, 0.4);
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
