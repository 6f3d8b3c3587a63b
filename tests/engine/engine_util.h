/* What the engine tests (test_engine.c, test_engine_bf16.c,
 * test_engine_moe.c) share beyond tests/lib (the generator, the tiny models'
 * sizes): an engine, requests and their samples, the trainer's log-probs of a
 * sample, the agreement run (engine vs trainer over five mixed requests) and
 * the greedy run against a naive full-recompute loop. Each test has its own
 * copy of the state (static), and its requests their own seed and step:
 * define REQUEST_SEED and REQUEST_STEP before including this. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "models.h"
#include "random.h"
#include "moonrl/engine.h"
#include "moonrl/model.h"

#if !defined(REQUEST_SEED) || !defined(REQUEST_STEP)
#error "define REQUEST_SEED and REQUEST_STEP before including engine_util.h"
#endif

#define MAXG 48 /* generated tokens at most */

/* ---- engines, requests, samples --------------------------------------------------------------- */

/* pack: pack_weights (< 0: the default). NULL where it failed (a failed check). */
static inline mrl_engine *new_engine_kv(mrl_model *m, int64_t kv_bytes, int max_tokens, int max_seqs, int block,
                                        int pack, int kv_dtype) {
    mrl_engine_config c;
    mrl_engine_config_default(&c);
    c.kv_cache_bytes = kv_bytes;
    c.max_num_batched_tokens = max_tokens;
    c.max_num_seqs = max_seqs;
    c.block_size = block;
    if (pack >= 0) c.pack_weights = pack;
    c.kv_cache_dtype = kv_dtype;
    mrl_engine *e = NULL;
    CHECK_OK(mrl_engine_create(m, &c, &e));
    return e;
}

/* pack < 0: the default; the KV cache's dtype the default's (auto) */
static inline mrl_engine *new_engine(mrl_model *m, int64_t kv_bytes, int max_tokens, int max_seqs, int block, int pack) {
    return new_engine_kv(m, kv_bytes, max_tokens, max_seqs, block, pack, MRL_KV_AUTO);
}

typedef struct sample_out {
    int n, finish;
    int32_t tok[MAXG];
    float lp[MAXG];
} sample_out;

static inline void get(mrl_engine *e, int req, int j, sample_out *o) {
    const int32_t *t;
    const float *lp;
    CHECK_OK(mrl_engine_get_output(e, req, j, &t, &lp, &o->n, &o->finish));
    if (o->n > MAXG) o->n = MAXG;
    memcpy(o->tok, t, sizeof(int32_t) * o->n);
    memcpy(o->lp, lp, sizeof(float) * o->n);
}

static inline mrl_engine_request request(const int32_t *prompt, int len, int n, int max_new, float temp, int64_t index) {
    return (mrl_engine_request){.prompt = prompt, .prompt_len = len, .n = n, .max_new_tokens = max_new,
                                .params = {.temperature = temp, .top_k = 0, .top_p = 1.0f, .min_p = 0},
                                .seed = REQUEST_SEED, .step = REQUEST_STEP, .prompt_index = index};
}

/* One greedy sample of 16 tokens after `prompt`, alone in the engine. */
static inline void gen_greedy(mrl_engine *e, const int32_t *prompt, int len, sample_out *o) {
    int id;
    CHECK_OK(mrl_engine_reset(e));
    mrl_engine_request r = request(prompt, len, 1, 16, 0.0f, 0);
    CHECK_OK(mrl_engine_add_request(e, &r, &id));
    CHECK_OK(mrl_engine_run(e));
    get(e, id, 0, o);
}

/* The trainer's log-probs of `s` after `prompt` at temperature t. */
static inline void trainer_logprobs(mrl_model *m, const int32_t *prompt, int len, const sample_out *s, float t,
                                    float *out) {
    int n = len + s->n;
    int32_t tokens[256], targets[256], cu[2] = {0, n};
    float lp[256];
    memcpy(tokens, prompt, sizeof(int32_t) * len);
    memcpy(tokens + len, s->tok, sizeof(int32_t) * s->n);
    for (int i = 0; i < n; i++) targets[i] = i + 1 < n ? tokens[i + 1] : -1;
    mrl_batch b = {tokens, targets, cu, n, 1};
    CHECK_OK(mrl_model_forward(m, &b, t, lp, NULL, NULL));
    for (int i = 0; i < s->n; i++) out[i] = lp[len - 1 + i];
}

static inline void fill_prompt(int32_t *p, int len, int V, int salt) {
    for (int i = 0; i < len; i++) p[i] = (int32_t)((i * 37 + salt * 11 + 5) % V);
}

/* ---- agreement with the trainer --------------------------------------------------------------- */

/* Five requests of mixed prompt lengths: greedy and sampled, temperature != 1,
 * groups of 1 to 3; request i generates 12 + i tokens. */
enum { NP = 5 };
static const int agree_lens[NP] = {1, 5, 17, 33, 9};
static const float agree_temps[NP] = {0.0f, 0.7f, 1.3f, 1.0f, 0.0f};
static const int agree_ns[NP] = {1, 3, 2, 1, 2};

typedef struct agreement_run {
    int32_t prompts[NP][40];
    int ids[NP];
    sample_out out[NP][3]; /* out[i][j]: sample j of request i */
} agreement_run;

typedef void prompt_filler(int32_t *p, int len, int V, int salt);

/* Adds the five requests, prompt i of vocabulary V filled by `fill` (NULL:
 * fill_prompt) with salt `salt + i`; vary: top_k 20 on request 2, top_p 0.8
 * on request 3. */
static inline void agreement_add(mrl_engine *e, agreement_run *a, int V, int salt, int vary, prompt_filler *fill) {
    for (int i = 0; i < NP; i++) {
        (fill ? fill : fill_prompt)(a->prompts[i], agree_lens[i], V, i + salt);
        mrl_engine_request r = request(a->prompts[i], agree_lens[i], agree_ns[i], 12 + i, agree_temps[i], i);
        if (vary && i == 2) r.params.top_k = 20;
        if (vary && i == 3) r.params.top_p = 0.8f;
        CHECK_OK(mrl_engine_add_request(e, &r, &a->ids[i]));
    }
}

/* After the run: each sample into a->out (checked to be 12 + i tokens long),
 * its log-probs against the trainer's at the same temperature (greedy: 1).
 * Returns the max |engine - trainer| (NaN where one is NaN); *mult (NULL: not
 * wanted) the mean exp|engine - trainer| (token_mult_prob_error). */
static inline double agreement_compare(mrl_model *m, mrl_engine *e, agreement_run *a, double *mult) {
    double max_d = 0, sum = 0;
    int count = 0;
    for (int i = 0; i < NP; i++)
        for (int j = 0; j < agree_ns[i]; j++) {
            sample_out *s = &a->out[i][j];
            get(e, a->ids[i], j, s);
            CHECK(s->n == 12 + i);
            float ref[MAXG];
            trainer_logprobs(m, a->prompts[i], agree_lens[i], s, agree_temps[i] > 0 ? agree_temps[i] : 1.0f, ref);
            for (int t = 0; t < s->n; t++) {
                double d = fabs(s->lp[t] - ref[t]);
                if (!(d <= max_d)) max_d = d;
                sum += exp(d), count++;
            }
        }
    if (mult) *mult = sum / count;
    return max_d;
}

/* Every sample of the run stopped at its length. */
static inline void agreement_check_length(const agreement_run *a) {
    for (int i = 0; i < NP; i++)
        for (int j = 0; j < agree_ns[i]; j++) CHECK(a->out[i][j].finish == MRL_FINISH_LENGTH);
}

/* ---- greedy vs a naive full-recompute loop ---------------------------------------------------- */

/* argmax of the next token after seq[0..n) by the trainer's forward: one
 * forward over V copies of the sequence, copy v targeting v at its last
 * position. */
static inline int naive_next(mrl_model *m, const int32_t *seq, int n, int V, float *best_lp, float *lps) {
    int32_t *tok = malloc(sizeof(int32_t) * V * n), *tgt = malloc(sizeof(int32_t) * V * n);
    int32_t *cu = malloc(sizeof(int32_t) * (V + 1));
    float *lp = malloc(sizeof(float) * V * n);
    for (int v = 0; v < V; v++) {
        cu[v] = v * n;
        for (int i = 0; i < n; i++) {
            tok[v * n + i] = seq[i];
            tgt[v * n + i] = i + 1 < n ? -1 : v;
        }
    }
    cu[V] = V * n;
    mrl_batch b = {tok, tgt, cu, (int64_t)V * n, V};
    CHECK_OK(mrl_model_forward(m, &b, 1.0f, lp, NULL, NULL));
    int best = 0;
    for (int v = 0; v < V; v++) {
        lps[v] = lp[v * n + n - 1];
        if (lps[v] > lps[best]) best = v;
    }
    *best_lp = lps[best];
    free(tok);
    free(tgt);
    free(cu);
    free(lp);
    return best;
}

/* Three greedy requests of G tokens (prompts of vocabulary V) on e, each token
 * against naive_next; returns how many tokens were compared equal (a near-tie
 * may differ, and the rest of that sequence is then not compared). what:
 * the model, in the messages. */
static inline int greedy_vs_naive(mrl_model *m, mrl_engine *e, int V, int G, const char *what) {
    static const int plens[] = {3, 12, 21};
    int32_t prompts[3][32];
    int ids[3];
    for (int i = 0; i < 3; i++) {
        fill_prompt(prompts[i], plens[i], V, 3 * i + 1);
        mrl_engine_request r = request(prompts[i], plens[i], 1, G, 0.0f, i);
        CHECK_OK(mrl_engine_add_request(e, &r, &ids[i]));
    }
    CHECK_OK(mrl_engine_run(e));
    int compared = 0;
    for (int i = 0; i < 3; i++) {
        sample_out s;
        get(e, ids[i], 0, &s);
        CHECK(s.n == G);
        int32_t seq[64];
        memcpy(seq, prompts[i], sizeof(int32_t) * plens[i]);
        int n = plens[i];
        for (int t = 0; t < s.n; t++) {
            float best_lp, lps[64];
            int want = naive_next(m, seq, n, V, &best_lp, lps);
            if (want != s.tok[t]) {
                /* only a near-tie may differ; the rest of the sequences then diverge */
                printf("greedy %s prompt %d token %d: engine %d, naive %d (log-probs %.9g vs %.9g)\n", what, i, t,
                       s.tok[t], want, lps[s.tok[t]], best_lp);
                CHECK(best_lp - lps[s.tok[t]] < 1e-5);
                break;
            }
            CHECK_NEAR(s.lp[t], best_lp, 1e-5);
            seq[n++] = want;
            compared++;
        }
    }
    return compared;
}
