/* The scheduler driving the full loop with a fake model that really uses the
 * paged KV cache: each step it writes (token, position) of the batch's tokens
 * into their slots with the fast table's paged_kv_write, and the logits of a token are a
 * hash of the whole context READ BACK through the block table. So a wrong
 * slot, block table, copy-on-write, prefix-cache hit or recomputation changes
 * the tokens. Every configuration (token budget, max sequences, a cache so
 * small that sequences are pre-empted, prefix caching on/off, requests
 * joining at different steps) must give exactly the tokens and log-probs of
 * a plain per-sample generation loop. */
#include <stdlib.h>
#include "check.h"
#include "moonrl/status.h"
#include "engine/kv_cache.h"
#include "engine/sample.h"
#include "engine/scheduler.h"
#include "kernels.h"
#include "base/rng.h"

#define V 48
#define EOS 1
#define STOP_TOK 2
#define MAX_REQ 16
#define MAX_MODEL_LEN 96

static uint64_t mix(uint64_t x) { return mrl_mix64(x); }

/* logits of the next token after context tokens[0..n) */
static void fake_logits(const int32_t *tokens, int n, float *row) {
    uint64_t h = 12345;
    for (int i = 0; i < n; i++) h = mix(h ^ (uint64_t)tokens[i]);
    for (int v = 0; v < V; v++) row[v] = (float)((mix(h ^ (uint64_t)v) >> 40) * (4.0 / 16777216.0));
    row[EOS] -= 1.0f; /* EOS and the stop token now and then: long and short samples */
    row[STOP_TOK] -= 1.0f;
}

typedef struct req_spec {
    int32_t prompt[64];
    int prompt_len, n, max_new;
    mrl_sampling_params params;
    int join_step;
} req_spec;

static req_spec reqs[MAX_REQ];
static int n_reqs;

/* expected[r][j]: the plain loop's tokens and log-probs */
static int32_t exp_tok[MAX_REQ][8][MAX_MODEL_LEN];
static float exp_lp[MAX_REQ][8][MAX_MODEL_LEN];
static int exp_n[MAX_REQ][8], exp_finish[MAX_REQ][8];

static const int32_t eos_ids[1] = {EOS}, stop_ids[1] = {STOP_TOK};

static void reference(void) {
    float row[V];
    for (int r = 0; r < n_reqs; r++)
        for (int j = 0; j < reqs[r].n; j++) {
            int32_t toks[MAX_MODEL_LEN];
            int n = reqs[r].prompt_len, out = 0;
            memcpy(toks, reqs[r].prompt, sizeof(int32_t) * n);
            uint64_t key = mrl_sample_stream_key(7, 3, r, j);
            int max_new = reqs[r].max_new < MAX_MODEL_LEN - n ? reqs[r].max_new : MAX_MODEL_LEN - n;
            exp_finish[r][j] = 0;
            while (!exp_finish[r][j]) {
                fake_logits(toks, n, row);
                int32_t t;
                float lp, lpp;
                CHECK_OK(mrl_sample_row(NULL, row, V, &reqs[r].params, mrl_sample_uniform(key, out), &t, &lp, &lpp));
                toks[n++] = t;
                exp_tok[r][j][out] = t;
                exp_lp[r][j][out++] = lp;
                if (t == EOS) exp_finish[r][j] = MRL_FINISH_EOS;
                else if (t == STOP_TOK) exp_finish[r][j] = MRL_FINISH_STOP;
                else if (out >= max_new) exp_finish[r][j] = MRL_FINISH_LENGTH;
            }
            exp_n[r][j] = out;
        }
}

/* The fake model's forward: write K = token, V = position into the slots,
 * then compute each needed logits row from the context read back. */
static void fake_forward(mrl_kv_cache *kv, const mrl_sched_batch *b, float *logits) {
    int bs = mrl_kv_cache_block_size(kv), nblk = mrl_kv_cache_num_blocks(kv);
    float *K = mrl_kv_cache_k(kv, 0), *Vc = mrl_kv_cache_v(kv, 0);
    float *kn = malloc(sizeof(float) * (b->n_tokens + 1)), *vn = malloc(sizeof(float) * (b->n_tokens + 1));
    int ok = b->query_start[0] == 0 && b->query_start[b->n_seqs] == b->n_tokens;
    for (int t = 0; t < b->n_tokens; t++) {
        kn[t] = (float)b->token_ids[t];
        vn[t] = (float)b->positions[t];
        int i = b->seq_index[t], pos = b->positions[t];
        const int32_t *table = b->block_tables + (int64_t)i * b->max_blocks_per_seq;
        ok &= i >= 0 && i < b->n_seqs && t >= b->query_start[i] && t < b->query_start[i + 1];
        ok &= pos == b->seq_lens[i] - (b->query_start[i + 1] - t);
        ok &= b->slot_mapping[t] == table[pos / bs] * bs + pos % bs;
    }
    CHECK(ok);
    const mrl_kernels *k = mrl_kernels_cpu_fast();
    k->paged_kv_write(K, Vc, kn, vn, b->slot_mapping, b->n_tokens, 1, 1, bs);
    /* real paged attention over the step, with q = 0 (uniform weights): the
     * output of a token at position p is the mean of positions 0..p */
    float *q = calloc((size_t)b->n_tokens + 1, sizeof(float)), *out = calloc((size_t)b->n_tokens + 1, sizeof(float));
    mrl_paged_attn args;
    CHECK_OK(mrl_sched_attn_args(b, kv, 0, 1, q, out, &args));
    CHECK_OK(k->paged_attn(&args));
    int mean_ok = 1;
    for (int t = 0; t < b->n_tokens; t++) mean_ok &= fabsf(out[t] - b->positions[t] * 0.5f) <= 1e-4f * (1 + b->positions[t]);
    CHECK(mean_ok);
    free(q);
    free(out);
    int32_t ctx[MAX_MODEL_LEN];
    for (int r = 0; r < b->n_logits; r++) {
        int t = b->logits_indices[r], i = b->seq_index[t], len = b->positions[t] + 1;
        const int32_t *table = b->block_tables + (int64_t)i * b->max_blocks_per_seq;
        int good = t == b->query_start[i + 1] - 1 && len == b->seq_lens[i] && len <= MAX_MODEL_LEN;
        for (int c = 0; good && c < len; c++) {
            int blk = table[c / bs];
            good &= blk >= 0 && blk < nblk && Vc[blk * bs + c % bs] == (float)c;
            ctx[c] = (int32_t)K[blk * bs + c % bs];
        }
        CHECK(good);
        if (!good)
            fprintf(stderr, "logits row %d: token %d of seq %d, len %d, seq_len %d, query end %d\n", r, t, i, len,
                    b->seq_lens[i], b->query_start[i + 1]);
        fake_logits(ctx, good ? len : 0, logits + (int64_t)r * V);
    }
    free(kn);
    free(vn);
}

typedef struct run_cfg {
    int budget, max_seqs, n_blocks, block_size, prefix;
    int stop_req; /* request whose sample 0 the caller stops after 3 tokens (-1: none) */
} run_cfg;

static void run(run_cfg rc, mrl_sched_stats *stats_out) {
    mrl_kv_cache_config kc = {.n_layers = 1, .n_kv_heads = 1, .head_dim = 1, .block_size = rc.block_size,
                              .prefix_caching = rc.prefix};
    kc.budget_bytes = (int64_t)rc.n_blocks * rc.block_size * 2 * sizeof(float);
    mrl_kv_cache *kv = NULL;
    mrl_sched *s = NULL;
    CHECK_OK(mrl_kv_cache_create(&kc, &kv));
    mrl_sched_config sc = {.max_num_seqs = rc.max_seqs, .max_num_batched_tokens = rc.budget,
                           .max_model_len = MAX_MODEL_LEN, .vocab_size = V};
    CHECK_OK(mrl_sched_create(&sc, kv, &s));
    if (!s) return;
    float *logits = malloc(sizeof(float) * V * (rc.max_seqs + 1));
    int added = 0, step = 0, ids[MAX_REQ];
    for (;;) {
        while (added < n_reqs && (reqs[added].join_step <= step || !mrl_sched_has_unfinished(s))) {
            mrl_sched_request r = {.prompt = reqs[added].prompt, .prompt_len = reqs[added].prompt_len, .n = reqs[added].n,
                                   .max_new_tokens = reqs[added].max_new, .eos_ids = eos_ids, .n_eos = 1,
                                   .stop_ids = stop_ids, .n_stop = 1, .params = reqs[added].params, .seed = 7,
                                   .step = 3, .prompt_index = added};
            CHECK_OK(mrl_sched_add(s, &r, &ids[added]));
            CHECK(ids[added] == added);
            added++;
        }
        if (!mrl_sched_has_unfinished(s)) break;
        const mrl_sched_batch *b;
        CHECK_OK(mrl_sched_schedule(s, &b));
        CHECK(b->n_tokens <= rc.budget && b->n_seqs <= rc.max_seqs);
        if (b->n_tokens == 0) { /* only when the caller's stop finished the last unfinished sample */
            CHECK(!mrl_sched_has_unfinished(s));
            CHECK_OK(mrl_sched_update(s, NULL));
            if (mrl_sched_has_unfinished(s)) break; /* a stall would be a bug: stop here */
            step++;
            continue;
        }
        if (step > 100000) break;
        fake_forward(kv, b, logits);
        CHECK_OK(mrl_sched_update(s, logits));
        if (rc.stop_req >= 0 && rc.stop_req < added) {
            int n;
            CHECK_OK(mrl_sched_output(s, rc.stop_req, 0, NULL, NULL, NULL, &n, NULL));
            if (n >= 3) CHECK_OK(mrl_sched_stop(s, rc.stop_req, 0));
        }
        step++;
    }
    int all_same = 1;
    for (int r = 0; r < n_reqs; r++)
        for (int j = 0; j < reqs[r].n; j++) {
            const int32_t *tok;
            const float *lp;
            int n, fin;
            CHECK_OK(mrl_sched_output(s, r, j, &tok, &lp, NULL, &n, &fin));
            if (r == rc.stop_req && j == 0 && exp_n[r][j] > 3) {
                CHECK(fin == MRL_FINISH_CALLER);
                CHECK(n >= 3 && n <= exp_n[r][j]);
                if (n > exp_n[r][j]) n = exp_n[r][j];
                for (int t = 0; t < n; t++) all_same &= tok[t] == exp_tok[r][j][t];
                continue;
            }
            all_same &= n == exp_n[r][j] && fin == exp_finish[r][j];
            for (int t = 0; t < n && t < exp_n[r][j]; t++)
                all_same &= tok[t] == exp_tok[r][j][t] && lp[t] == exp_lp[r][j][t];
        }
    CHECK(all_same);
    if (!all_same)
        fprintf(stderr, "run budget=%d max_seqs=%d blocks=%d bs=%d prefix=%d: outputs differ\n", rc.budget,
                rc.max_seqs, rc.n_blocks, rc.block_size, rc.prefix);
    mrl_sched_get_stats(s, stats_out);
    if (getenv("VERBOSE"))
        printf("budget %3d max_seqs %2d blocks %3d bs %d prefix %d: steps %lld prefill %lld decode %lld prefix hits %lld "
               "preemptions %lld forks %lld generated %lld\n",
               rc.budget, rc.max_seqs, rc.n_blocks, rc.block_size, rc.prefix, (long long)stats_out->steps,
               (long long)stats_out->prefill_tokens, (long long)stats_out->decode_tokens,
               (long long)stats_out->prefix_hit_tokens, (long long)stats_out->preemptions, (long long)stats_out->forks,
               (long long)stats_out->generated_tokens);
    mrl_kv_cache_stats ks;
    mrl_kv_cache_get_stats(kv, &ks);
    CHECK(ks.num_seqs == 0 && ks.free_blocks == ks.num_blocks); /* everything released */
    CHECK(stats_out->running == 0 && stats_out->waiting == 0);
    mrl_sched_destroy(s);
    mrl_kv_cache_destroy(kv);
    free(logits);
}

static void make_requests(void) {
    uint64_t r = 99;
    int32_t system[20];
    for (int i = 0; i < 20; i++) system[i] = 3 + (int)(mix(i + 500) % (V - 3));
    n_reqs = 12;
    for (int q = 0; q < n_reqs; q++) {
        req_spec *x = &reqs[q];
        r = mix(r);
        int shared = q % 3 != 2 ? 12 + q % 2 * 8 : 0; /* a common system prompt */
        x->prompt_len = shared + 1 + (int)(r % 30);
        for (int i = 0; i < x->prompt_len; i++)
            x->prompt[i] = i < shared ? system[i] : 3 + (int)(mix(r + i) % (V - 3));
        x->n = q % 4 == 1 ? 4 : (q == 6 ? 8 : 1);
        x->max_new = 1 + (int)(mix(r + 77) % 40);
        x->params = (mrl_sampling_params){q % 5 == 4 ? 0.0f : 0.7f + 0.2f * (q % 3), q % 3 == 0 ? 10 : 0,
                                          q % 4 == 2 ? 0.9f : 1.0f, q % 6 == 5 ? 0.1f : 0.0f};
        x->join_step = (int)(mix(r + 5) % 40);
    }
}

static void test_group_prefill_once(void) {
    /* one GRPO group of 8 over a 37-token prompt: the prompt runs once */
    req_spec saved[MAX_REQ];
    int saved_n = n_reqs;
    memcpy(saved, reqs, sizeof reqs);
    n_reqs = 1;
    reqs[0].n = 8;
    reqs[0].prompt_len = 37;
    reqs[0].max_new = 20;
    reqs[0].join_step = 0;
    reference();
    mrl_sched_stats st;
    run((run_cfg){512, 16, 200, 16, 0, -1}, &st);
    CHECK(st.prefill_tokens == 37);
    CHECK(st.forks == 7);
    CHECK(st.preemptions == 0);
    /* chunked: a budget of 10 tokens per step still prefills 37 once */
    run((run_cfg){10, 16, 200, 16, 0, -1}, &st);
    CHECK(st.prefill_tokens == 37);
    memcpy(reqs, saved, sizeof reqs);
    n_reqs = saved_n;
}

static void test_bad_input(void) {
    mrl_kv_cache_config kc = {.n_layers = 1, .n_kv_heads = 1, .head_dim = 1, .block_size = 4, .budget_bytes = 8 * 4 * 2 * 4};
    mrl_kv_cache *kv;
    mrl_sched *s;
    CHECK_OK(mrl_kv_cache_create(&kc, &kv));
    mrl_sched_config sc = {.max_num_seqs = 4, .max_num_batched_tokens = 16, .max_model_len = 64, .vocab_size = V};
    CHECK_OK(mrl_sched_create(&sc, kv, &s));
    int32_t p[40] = {5, 6, 7};
    int id;
    mrl_sched_request r = {.prompt = p, .prompt_len = 3, .n = 1, .max_new_tokens = 4, .params = {1, 0, 1, 0}};
    r.prompt_len = 0;
    CHECK(mrl_sched_add(s, &r, &id) == MRL_ERR_INVALID);
    r.prompt_len = 3;
    p[1] = V;
    CHECK(mrl_sched_add(s, &r, &id) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "outside the vocabulary");
    p[1] = 6;
    r.n = 0;
    CHECK(mrl_sched_add(s, &r, &id) == MRL_ERR_INVALID);
    r.n = 1;
    r.prompt_len = 40; /* 40 + 4 tokens need 11 blocks of 4: the cache has 8 */
    CHECK(mrl_sched_add(s, &r, &id) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "the cache has 8");
    r.prompt_len = 3;
    r.params.top_p = 2;
    CHECK(mrl_sched_add(s, &r, &id) == MRL_ERR_INVALID);
    r.params.top_p = 1;
    CHECK(mrl_sched_update(s, NULL) == MRL_ERR_INVALID);
    CHECK_OK(mrl_sched_add(s, &r, &id));
    const mrl_sched_batch *b;
    CHECK_OK(mrl_sched_schedule(s, &b));
    CHECK(mrl_sched_schedule(s, &b) == MRL_ERR_INVALID);
    CHECK(b->n_logits == 1 && b->n_tokens == 3 && b->n_prefill_tokens == 3);
    CHECK(mrl_sched_update(s, NULL) == MRL_ERR_INVALID);
    CHECK(mrl_sched_stop(s, 0, 1) == MRL_ERR_INVALID);
    CHECK(mrl_sched_output(s, 3, 0, NULL, NULL, NULL, NULL, NULL) == MRL_ERR_INVALID);
    mrl_sched_destroy(s); /* mid-run: frees its sequences */
    mrl_kv_cache_stats ks;
    mrl_kv_cache_get_stats(kv, &ks);
    CHECK(ks.num_seqs == 0);
    mrl_kv_cache_destroy(kv);
    sc.max_num_batched_tokens = 0;
    CHECK(mrl_sched_create(&sc, kv, &s) == MRL_ERR_INVALID);
}

int main(void) {
    make_requests();
    reference();
    mrl_sched_stats st;
    /* ample everything */
    run((run_cfg){256, 32, 400, 16, 0, -1}, &st);
    CHECK(st.preemptions == 0);
    int64_t prefill_ample = st.prefill_tokens;
    /* prefix caching: the shared system prompt is found */
    run((run_cfg){256, 32, 400, 4, 1, -1}, &st);
    CHECK(st.prefix_hit_tokens > 0);
    CHECK(st.prefill_tokens + st.prefix_hit_tokens == prefill_ample);
    /* small budgets: chunked prefill, few tokens per step */
    run((run_cfg){7, 32, 400, 4, 0, -1}, &st);
    run((run_cfg){1, 3, 400, 4, 1, -1}, &st);
    run((run_cfg){33, 5, 400, 8, 1, -1}, &st);
    /* a tiny cache: sequences are pre-empted and recomputed */
    run((run_cfg){64, 16, 34, 4, 0, -1}, &st);
    CHECK(st.preemptions > 0);
    run((run_cfg){64, 16, 34, 4, 1, -1}, &st);
    CHECK(st.preemptions > 0);
    run((run_cfg){20, 12, 18, 8, 1, -1}, &st);
    CHECK(st.preemptions > 0);
    run((run_cfg){5, 2, 32, 3, 1, -1}, &st);
    /* the caller stops a sample (a stop string) */
    run((run_cfg){64, 16, 400, 4, 1, 4}, &st);
    run((run_cfg){64, 16, 34, 4, 1, 1}, &st);
    /* requests joining at other steps */
    for (int q = 0; q < n_reqs; q++) reqs[q].join_step = (q * 7) % 11;
    run((run_cfg){48, 8, 60, 4, 1, -1}, &st);
    /* a random sweep: block sizes 1..16, budgets down to 1 token, 1..16
     * sequences, caches from barely one sequence up, prefix caching on/off */
    uint64_t r = 2026;
    for (int k = 0; k < 24; k++) {
        r = mix(r);
        int bs = (int[]){1, 2, 3, 4, 5, 8, 16}[r % 7];
        int need = (MAX_MODEL_LEN + bs - 1) / bs; /* the longest sequence alone */
        run_cfg rc = {1 + (int)(mix(r + 1) % 64), 1 + (int)(mix(r + 2) % 16), need + (int)(mix(r + 3) % (3 * need)), bs,
                      (int)(mix(r + 4) % 2), k % 3 == 0 ? (int)(mix(r + 5) % n_reqs) : -1};
        for (int q = 0; q < n_reqs; q++) reqs[q].join_step = (int)(mix(r + 10 + q) % 30);
        run(rc, &st);
    }
    test_group_prefill_once();
    test_bad_input();
    CHECK_DONE();
}
