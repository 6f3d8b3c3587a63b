/* The generation engine against the trainer's forward, on tiny random models
 * (Llama with GQA and llama3 RoPE scaling, Qwen2 with q/k/v biases, Qwen3
 * with q/k norms; every bias and norm weight randomised):
 *   - agreement: the engine's log-probs of its samples equal
 *     mrl_model_forward's log-probs of the same tokens (targets = the
 *     generated tokens, same temperature) within 1e-5, over mixed-length
 *     prompts, greedy and sampled, temperature != 1; with the fast kernels,
 *     and with the reference kernels behind a table that counts its calls:
 *     every op the engine runs (paged attention, the K/V write, sampling,
 *     rows, products, panels) goes through the model's table;
 *   - greedy generation equals a naive loop that recomputes the whole
 *     sequence with mrl_model_forward each token and takes the argmax;
 *   - determinism: a group of 8 equals 8 single requests (first_sample),
 *     alone or among other requests, with a roomy cache or one so small that
 *     sequences are pre-empted and recomputed, small or large step budgets;
 *   - stop ids, EOS, max tokens, caller stops;
 *   - zero copy: writing the model's parameter buffer changes the next
 *     generation with no reload; attach_params reads another buffer;
 *   - errors: bad requests, a stop request; reset drops unfinished requests;
 *   - limits: a KV cache or a step's activations larger than physical
 *     memory and out-of-range sizes are refused before allocating; a huge
 *     max_model_len costs nothing; generating allocates no gradients;
 *   - swap_params mid-generation: to a bit-identical copy (the old buffer
 *     then poisoned with NaN) gives bit-identical samples; to other weights,
 *     the tokens before the swap are the old weights', after it the
 *     trainer's log-probs under the new ones (K/V kept, not recomputed),
 *     pack_weights 0 and 1 agree;
 *   - run_async + wait: bit-identical to mrl_engine_run with 1 or 2 threads
 *     while the caller trains another model (its results bit-identical to
 *     training alone); busy calls refused; stop requests, a failing run's
 *     message on the caller's thread, free while running; a thread's own
 *     thread count and the process-wide one are independent. */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>
#define REQUEST_SEED 1234
#define REQUEST_STEP 3
#include "engine_util.h"
#include "moonrl/loop.h"
#include "moonrl/mem.h"
#include "moonrl/model.h"
#include "base/parallel.h"
#include "moonrl/status.h"
#include "model/layer.h"

#define MAXS 64  /* samples per run at most */

static mrl_model *make_model(int arch, int vocab) {
    mrl_model_config c;
    tiny_config(&c, arch, vocab);
    if (arch == MRL_ARCH_LLAMA) {
        c.rope_scaling = MRL_ROPE_LLAMA3;
        c.rope_original_max_position_embeddings = 32;
    }
    if (arch == MRL_ARCH_QWEN2) c.attention_bias = 1;
    mrl_model *m = NULL;
    CHECK_OK(mrl_model_create(&c, 7 + arch, &m));
    if (!m) return NULL;
    perturb_vectors(m, 0.3);
    return m;
}

static mrl_engine *make_engine(mrl_model *m, int64_t kv_bytes, int max_tokens, int max_seqs, int block) {
    return new_engine(m, kv_bytes, max_tokens, max_seqs, block, -1);
}

/* ---- agreement with the trainer -------------------------------------------------------------- */

/* The reference table, each op of the engine's counted. */
enum { OP_GATHER, OP_GEMM, OP_GROUP, OP_NORM, OP_ROPE, OP_SWIGLU, OP_BIAS, OP_PACK, OP_KV, OP_WS, OP_PAGED, OP_SAMPLE, N_OPS };
static const char *op_names[N_OPS] = {"gather_rows", "gemm", "gemm_group", "rmsnorm_fwd", "rope", "swiglu_fwd",
                                      "bias_add", "panels_pack", "paged_kv_write", "paged_attn_workspace",
                                      "paged_attn", "sample"};
static int64_t op_calls[N_OPS];
static mrl_kernels counting;
#define R_ mrl_kernels_cpu_reference()
static void c_gather(float *o, const float *s, const int32_t *i, int64_t n, int64_t D) {
    op_calls[OP_GATHER]++, R_->gather_rows(o, s, i, n, D);
}
static void c_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float al, const float *A, int64_t lda,
                   const float *B, int64_t ldb, float be, float *C, int64_t ldc) {
    op_calls[OP_GEMM]++, R_->gemm(ta, tb, M, N, K, al, A, lda, B, ldb, be, C, ldc);
}
static void c_group(const mrl_gemm_desc *g, int n) { op_calls[OP_GROUP]++, R_->gemm_group(g, n); }
static void c_norm(float *o, float *r, const float *x, const float *w, int64_t T, int D, float eps) {
    op_calls[OP_NORM]++, R_->rmsnorm_fwd(o, r, x, w, T, D, eps);
}
static void c_rope(float *x, const int32_t *p, const float *c, const float *s, int64_t T, int H, int hd, int inv) {
    op_calls[OP_ROPE]++, R_->rope(x, p, c, s, T, H, hd, inv);
}
static void c_swiglu(float *o, const float *g, const float *u, int64_t n) { op_calls[OP_SWIGLU]++, R_->swiglu_fwd(o, g, u, n); }
static void c_bias(float *y, const float *b, int64_t T, int64_t N) { op_calls[OP_BIAS]++, R_->bias_add(y, b, T, N); }
static void c_pack(float *P, const float *W, int64_t N, int64_t K) { op_calls[OP_PACK]++, R_->panels_pack(P, W, N, K); }
static void c_kv(float *kc, float *vc, const float *k, const float *v, const int32_t *s, int64_t T, int Hk, int hd,
                 int bs) {
    op_calls[OP_KV]++, R_->paged_kv_write(kc, vc, k, v, s, T, Hk, hd, bs);
}
static int64_t c_ws(const mrl_paged_attn *a) { return op_calls[OP_WS]++, R_->paged_attn_workspace(a); }
static mrl_status c_paged(const mrl_paged_attn *a) { return op_calls[OP_PAGED]++, R_->paged_attn(a); }
static mrl_status c_sample(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *p,
                           const double *u, int32_t *t, float *lp, float *lpp) {
    return op_calls[OP_SAMPLE]++, R_->sample(rows, n, V, p, u, t, lp, lpp);
}
#undef R_

static const mrl_kernels *counting_reference(void) {
    counting = *mrl_kernels_cpu_reference();
    counting.name = "counting reference";
    counting.gather_rows = c_gather, counting.gemm = c_gemm, counting.gemm_group = c_group;
    counting.rmsnorm_fwd = c_norm, counting.rope = c_rope, counting.swiglu_fwd = c_swiglu, counting.bias_add = c_bias;
    counting.panels_pack = c_pack, counting.paged_kv_write = c_kv, counting.paged_attn_workspace = c_ws;
    counting.paged_attn = c_paged, counting.sample = c_sample;
    return &counting;
}

/* k: the model's table (NULL: the default, fast) */
static void test_agreement(int arch, const mrl_kernels *k) {
    const int V = 96;
    mrl_model *m = make_model(arch, V);
    if (m && k) mrl_model_use_kernels(m, k);
    mrl_engine *e = make_engine(m, 1 << 20, 40, 16, 8); /* small step budget: chunked prefills */
    if (!m || !e) return;
    agreement_run a;
    agreement_add(e, &a, V, arch, 1, NULL);
    memset(op_calls, 0, sizeof op_calls);
    CHECK_OK(mrl_engine_run(e));
    if (k == &counting) /* every op of the engine's through the model's table (bias_add: qwen2 only) */
        for (int op = 0; op < N_OPS; op++) {
            if (op == OP_BIAS && arch != MRL_ARCH_QWEN2) continue;
            if (!op_calls[op]) fprintf(stderr, "arch %d: the engine did not call the table's %s\n", arch, op_names[op]);
            CHECK(op_calls[op] > 0);
        }
    double max_d = agreement_compare(m, e, &a, NULL);
    agreement_check_length(&a);
    printf("arch %d, %s kernels: max |engine - trainer| log-prob %.3g\n", arch, k ? k->name : "fast", max_d);
    CHECK(max_d <= 1e-5);
    mrl_engine_free(e);
    mrl_model_free(m);
}

/* ---- greedy vs a naive full-recompute loop --------------------------------------------------- */

static void test_greedy_naive(int arch) {
    const int V = 64, G = 10;
    mrl_model *m = make_model(arch, V);
    mrl_engine *e = make_engine(m, 1 << 20, 64, 8, 16);
    if (!m || !e) return;
    char what[16];
    snprintf(what, sizeof what, "arch %d", arch);
    CHECK(greedy_vs_naive(m, e, V, G, what) >= 25);
    mrl_engine_free(e);
    mrl_model_free(m);
}

/* ---- determinism across batch composition, budget and pre-emption --------------------------- */

static void run_group(mrl_model *m, int64_t kv, int budget, int max_seqs, int split, int others, sample_out *out,
                      int64_t *preempted) {
    const int V = 96;
    mrl_engine *e = make_engine(m, kv, budget, max_seqs, 4);
    if (!e) return;
    int32_t prompt[24], other[5][30];
    fill_prompt(prompt, 24, V, 99);
    int ids[8], oid;
    for (int k = 0; k < others; k++) { /* unrelated requests sharing the batches */
        fill_prompt(other[k], 7 + 5 * k, V, k);
        mrl_engine_request r = request(other[k], 7 + 5 * k, 1 + k % 2, 20, 0.9f, 10 + k);
        CHECK_OK(mrl_engine_add_request(e, &r, &oid));
    }
    if (split) {
        for (int j = 0; j < 8; j++) {
            mrl_engine_request r = request(prompt, 24, 1, 30, 1.1f, 0);
            r.params.top_p = 0.95f;
            r.first_sample = j;
            CHECK_OK(mrl_engine_add_request(e, &r, &ids[j]));
        }
    } else {
        mrl_engine_request r = request(prompt, 24, 8, 30, 1.1f, 0);
        r.params.top_p = 0.95f;
        CHECK_OK(mrl_engine_add_request(e, &r, &ids[0]));
    }
    CHECK_OK(mrl_engine_run(e));
    for (int j = 0; j < 8; j++) get(e, split ? ids[j] : ids[0], split ? 0 : j, &out[j]);
    mrl_engine_stats st;
    mrl_engine_get_stats(e, &st);
    *preempted = st.preemptions;
    CHECK(st.generated_tokens > 0 && st.kv_blocks_used == 0);
    mrl_engine_free(e);
}

static void test_determinism(void) {
    mrl_model *m = make_model(MRL_ARCH_QWEN3, 96);
    if (!m) return;
    sample_out base[8], other[8];
    int64_t pre = 0;
    run_group(m, 1 << 20, 256, 64, 0, 0, base, &pre);
    /* block of 4 tokens: 2 layers * 2 heads * 16 * 4 * 2 (K,V) * 4 bytes = 2 KiB; 24 blocks only */
    int64_t tiny = 24 * 2048;
    struct { int64_t kv; int budget, seqs, split, others; } cases[] = {
        {1 << 20, 256, 64, 1, 0}, {1 << 20, 16, 64, 0, 3}, {1 << 20, 7, 3, 1, 5},
        {tiny, 64, 64, 0, 0}, {tiny, 32, 64, 1, 4}, {tiny, 9, 5, 0, 2},
    };
    int64_t total_pre = 0;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        run_group(m, cases[c].kv, cases[c].budget, cases[c].seqs, cases[c].split, cases[c].others, other, &pre);
        total_pre += pre;
        for (int j = 0; j < 8; j++) {
            CHECK(other[j].n == base[j].n);
            int same = other[j].n == base[j].n && memcmp(other[j].tok, base[j].tok, sizeof(int32_t) * base[j].n) == 0;
            if (!same) printf("determinism: case %zu sample %d differs\n", c, j);
            CHECK(same);
            for (int t = 0; same && t < base[j].n; t++) CHECK_NEAR(other[j].lp[t], base[j].lp[t], 1e-5);
        }
    }
    printf("determinism: %lld pre-emptions in the small-cache cases\n", (long long)total_pre);
    CHECK(total_pre > 0);
    /* the 8 samples are not all the same */
    int distinct = 0;
    for (int j = 1; j < 8; j++) distinct += memcmp(base[j].tok, base[0].tok, sizeof(int32_t) * base[0].n) != 0;
    CHECK(distinct > 0);
    mrl_model_free(m);
}

/* ---- stop conditions ------------------------------------------------------------------------ */

static void test_stops(void) {
    const int V = 64;
    mrl_model *m = make_model(MRL_ARCH_LLAMA, V);
    mrl_engine *e = make_engine(m, 1 << 20, 64, 8, 16);
    if (!m || !e) return;
    int32_t prompt[6];
    fill_prompt(prompt, 6, V, 5);
    int id;
    mrl_engine_request r = request(prompt, 6, 1, 20, 0.8f, 0);
    CHECK_OK(mrl_engine_add_request(e, &r, &id));
    CHECK_OK(mrl_engine_run(e));
    sample_out full;
    get(e, id, 0, &full);
    CHECK(full.n == 20 && full.finish == MRL_FINISH_LENGTH);
    int32_t stop = full.tok[4];
    int first = 0;
    while (full.tok[first] != stop) first++;
    for (int kind = 0; kind < 3; kind++) {
        CHECK_OK(mrl_engine_reset(e));
        mrl_engine_request q = r;
        if (kind == 0) q.eos_ids = &stop, q.n_eos = 1;
        if (kind == 1) q.stop_ids = &stop, q.n_stop = 1;
        if (kind == 2) q.max_new_tokens = 7;
        CHECK_OK(mrl_engine_add_request(e, &q, &id));
        CHECK_OK(mrl_engine_run(e));
        sample_out s;
        get(e, id, 0, &s);
        int want_n = kind == 2 ? 7 : first + 1;
        int want_f = kind == 0 ? MRL_FINISH_EOS : kind == 1 ? MRL_FINISH_STOP : MRL_FINISH_LENGTH;
        CHECK(s.n == want_n && s.finish == want_f);
        CHECK(memcmp(s.tok, full.tok, sizeof(int32_t) * (s.n < full.n ? s.n : full.n)) == 0);
    }
    /* a caller stop between steps */
    CHECK_OK(mrl_engine_reset(e));
    CHECK_OK(mrl_engine_add_request(e, &r, &id));
    int unfinished = 0;
    for (int k = 0; k < 4; k++) CHECK_OK(mrl_engine_step(e, &unfinished));
    CHECK(unfinished == 1);
    CHECK_OK(mrl_engine_stop_sample(e, id, 0));
    CHECK_OK(mrl_engine_run(e));
    sample_out s;
    get(e, id, 0, &s);
    CHECK(s.finish == MRL_FINISH_CALLER && s.n >= 1 && s.n < 20);
    CHECK(memcmp(s.tok, full.tok, sizeof(int32_t) * s.n) == 0);
    mrl_engine_free(e);
    mrl_model_free(m);
}

/* ---- zero copy ------------------------------------------------------------------------------ */

static void test_zero_copy(void) {
    const int V = 64;
    mrl_model *m = make_model(MRL_ARCH_QWEN2, V);
    mrl_engine *e = make_engine(m, 1 << 20, 64, 8, 16);
    if (!m || !e) return;
    int32_t prompt[10];
    fill_prompt(prompt, 10, V, 2);
    sample_out a, b, c, d;
    gen_greedy(e, prompt, 10, &a);
    /* an "optimizer step": change every weight in place */
    float *p = mrl_model_params(m);
    int64_t n = mrl_model_num_params(m);
    float *saved = malloc(sizeof(float) * n);
    memcpy(saved, p, sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) p[i] += (float)(0.2 * (urand() - 0.5));
    mrl_model_weights_changed(m); /* (as an optimizer step says so: the next round packs the panels again) */
    gen_greedy(e, prompt, 10, &b);
    CHECK(memcmp(a.tok, b.tok, sizeof(int32_t) * 16) != 0 || memcmp(a.lp, b.lp, sizeof(float) * 16) != 0);
    float ref[MAXG];
    trainer_logprobs(m, prompt, 10, &b, 1.0f, ref);
    for (int t = 0; t < b.n; t++) CHECK_NEAR(b.lp[t], ref[t], 1e-5);
    /* another buffer: the old weights */
    CHECK_OK(mrl_engine_attach_params(e, saved, n));
    gen_greedy(e, prompt, 10, &c);
    CHECK(memcmp(a.tok, c.tok, sizeof(int32_t) * 16) == 0 && memcmp(a.lp, c.lp, sizeof(float) * 16) == 0);
    CHECK(mrl_engine_attach_params(e, saved, n - 1) == MRL_ERR_INVALID);
    CHECK_OK(mrl_engine_attach_params(e, NULL, 0));
    gen_greedy(e, prompt, 10, &d);
    CHECK(memcmp(b.tok, d.tok, sizeof(int32_t) * 16) == 0 && memcmp(b.lp, d.lp, sizeof(float) * 16) == 0);
    free(saved);
    mrl_engine_free(e);
    mrl_model_free(m);
}

/* ---- errors --------------------------------------------------------------------------------- */

static void test_errors(void) {
    const int V = 64;
    mrl_model *m = make_model(MRL_ARCH_LLAMA, V);
    mrl_engine *e = make_engine(m, 64 * 1024, 64, 8, 16);
    if (!m || !e) return;
    mrl_engine_config c;
    mrl_engine_config_default(&c);
    c.block_size = 0;
    mrl_engine *bad = NULL;
    CHECK(mrl_engine_create(m, &c, &bad) == MRL_ERR_INVALID && bad == NULL);
    CHECK(mrl_engine_create(NULL, &c, &bad) == MRL_ERR_INVALID);
    int32_t prompt[300];
    fill_prompt(prompt, 300, V, 0);
    int id;
    mrl_engine_request r = request(prompt, 5, 1, 8, 1.0f, 0);
    prompt[2] = V;
    CHECK(mrl_engine_add_request(e, &r, &id) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "vocabulary");
    prompt[2] = 3;
    r.prompt_len = 300; /* over max_position_embeddings 256 */
    CHECK(mrl_engine_add_request(e, &r, &id) == MRL_ERR_INVALID);
    r.prompt_len = 5;
    r.params.top_p = 0;
    CHECK(mrl_engine_add_request(e, &r, &id) == MRL_ERR_INVALID);
    r.params.top_p = 1;
    int32_t bad_eos = -4;
    r.eos_ids = &bad_eos, r.n_eos = 1;
    CHECK(mrl_engine_add_request(e, &r, &id) == MRL_ERR_INVALID);
    r.n_eos = 0;
    r.max_new_tokens = 200; /* 64 KiB of cache: 8 blocks of 16 tokens at most */
    CHECK(mrl_engine_add_request(e, &r, &id) == MRL_ERR_INVALID);
    r.max_new_tokens = 8;
    CHECK_OK(mrl_engine_add_request(e, &r, &id));
    CHECK_OK(mrl_engine_step(e, NULL));
    CHECK_OK(mrl_engine_reset(e)); /* drops the unfinished request */
    CHECK(mrl_engine_num_unfinished(e) == 0);
    CHECK_OK(mrl_engine_add_request(e, &r, &id));
    CHECK(id == 0);
    mrl_request_stop(-2, "test");
    CHECK(mrl_engine_run(e) == MRL_ERR_STOPPED);
    mrl_clear_stop();
    CHECK_OK(mrl_engine_run(e));
    CHECK(mrl_engine_num_unfinished(e) == 0);
    CHECK(mrl_engine_get_output(e, id + 5, 0, NULL, NULL, NULL, NULL) == MRL_ERR_INVALID);
    CHECK_OK(mrl_engine_reset(e));
    mrl_engine_free(e);
    mrl_model_free(m);
}

/* ---- limits: every size is checked before it sizes an allocation -------------------------------- */

static mrl_status create_with(mrl_model *m, const mrl_engine_config *c) {
    mrl_engine *e = (mrl_engine *)1;
    mrl_status st = mrl_engine_create(m, c, &e);
    CHECK(st == MRL_OK || e == NULL);
    mrl_engine_free(st == MRL_OK ? e : NULL);
    return st;
}

static void test_limits(void) {
    mrl_model *m = make_model(MRL_ARCH_LLAMA, 64);
    if (!m) return;
    int64_t phys = (int64_t)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGE_SIZE);
    mrl_engine_config c;
    mrl_mem_stats s0, s1;
    char want[160];
    /* a KV cache larger than the machine: refused before allocating, naming both sizes */
    mrl_engine_config_default(&c);
    c.kv_cache_bytes = 2 * phys;
    mrl_mem_reset_peak();
    mrl_mem_get_stats(&s0);
    CHECK(create_with(m, &c) == MRL_ERR_INVALID);
    snprintf(want, sizeof want, "kv_cache_bytes = %lld", (long long)(2 * phys));
    CHECK_STR_CONTAINS(mrl_last_error(), want);
    snprintf(want, sizeof want, "physical memory (%lld bytes", (long long)phys);
    CHECK_STR_CONTAINS(mrl_last_error(), want);
    mrl_mem_get_stats(&s1);
    CHECK(s1.total_peak == s0.total);
    c.kv_cache_bytes = 0;
    CHECK(create_with(m, &c) == MRL_ERR_INVALID);
    /* each field out of its range, by name */
    struct { int *field; int value; const char *text; } bad[] = {
        {&c.block_size, 0, "block_size = 0 (must be in 1..4096)"},
        {&c.block_size, 8192, "block_size = 8192"},
        {&c.max_num_seqs, 0, "max_num_seqs = 0"},
        {&c.max_num_seqs, (1 << 20) + 1, "max_num_seqs = 1048577 (must be in 1..1048576)"},
        {&c.max_num_batched_tokens, -5, "max_num_batched_tokens = -5"},
        {&c.max_num_batched_tokens, (1 << 24) + 1, "max_num_batched_tokens = 16777217"},
        {&c.max_model_len, 1, "max_model_len = 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        mrl_engine_config_default(&c);
        *bad[i].field = bad[i].value;
        CHECK(create_with(m, &c) == MRL_ERR_INVALID);
        CHECK_STR_CONTAINS(mrl_last_error(), bad[i].text);
    }
    /* a max_model_len far beyond what the cache holds: RoPE tables for what it holds only */
    mrl_engine_config_default(&c);
    c.kv_cache_bytes = 64 * 1024;
    c.max_model_len = 1 << 24;
    mrl_mem_reset_peak();
    mrl_mem_get_stats(&s0);
    CHECK_OK(create_with(m, &c));
    mrl_mem_get_stats(&s1);
    CHECK(s1.peak[MRL_MEM_OTHER] - s0.current[MRL_MEM_OTHER] < (1 << 20));
    mrl_model_free(m);
    /* a step's activations larger than the machine (max_num_batched_tokens rows of a wide model) */
    mrl_model_config mc;
    mrl_model_config_default(&mc);
    mc.vocab_size = 16;
    mc.hidden_size = 1 << 16;
    mc.intermediate_size = 16;
    mc.num_hidden_layers = 1;
    mc.num_attention_heads = mc.num_key_value_heads = 1;
    mc.head_dim = 2;
    CHECK_OK(mrl_model_create(&mc, 1, &m));
    if (!m) return;
    mrl_engine_config_default(&c);
    c.max_num_batched_tokens = 1 << 24; /* [T, D] floats alone: 4 TiB */
    mrl_mem_reset_peak();
    mrl_mem_get_stats(&s0);
    CHECK(create_with(m, &c) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "max_num_batched_tokens = 16777216");
    CHECK_STR_CONTAINS(mrl_last_error(), "physical memory");
    mrl_mem_get_stats(&s1);
    CHECK(s1.total_peak == s0.total);
    mrl_model_free(m);
}

/* Generation never creates the gradient buffer (nor does a forward). */
static void test_no_grads(void) {
    mrl_mem_stats s0, s1;
    mrl_mem_get_stats(&s0);
    const int V = 64;
    mrl_model *m = make_model(MRL_ARCH_QWEN3, V);
    mrl_engine *e = m ? make_engine(m, 256 * 1024, 64, 8, 16) : NULL;
    if (!e) {
        mrl_model_free(m);
        return;
    }
    int32_t prompt[12];
    fill_prompt(prompt, 12, V, 1);
    mrl_engine_request r = request(prompt, 12, 4, 10, 1.0f, 0);
    int id;
    CHECK_OK(mrl_engine_add_request(e, &r, &id));
    CHECK_OK(mrl_engine_run(e));
    int32_t cu[2] = {0, 12};
    mrl_batch b = {prompt, NULL, cu, 12, 1};
    float lp[12];
    CHECK_OK(mrl_model_forward(m, &b, 1.0f, lp, NULL, NULL));
    mrl_mem_get_stats(&s1);
    CHECK(s1.current[MRL_MEM_GRADS] == s0.current[MRL_MEM_GRADS] && s1.peak[MRL_MEM_GRADS] == s0.peak[MRL_MEM_GRADS]);
    mrl_engine_free(e);
    mrl_model_free(m);
}

/* ---- in-flight weight update (swap_params) ---------------------------------------------------- */

#define SWAP_G 16 /* tokens per sample */

/* The swap tests' requests: a greedy prompt and a sampled group of 2. */
static const int swap_lens[2] = {10, 7}, swap_ns[2] = {1, 2};

static mrl_engine *engine_packed(mrl_model *m, int pack) { return new_engine(m, 1 << 20, 64, 16, 8, pack); }

/* The swap requests on the model's weights, `swap` (NULL: none) read from
 * step `at` on; after the swap `poison` (NULL: none) is filled with NaN.
 * out[3]: the three samples; *prefill: prefill tokens of the whole run. */
static void swap_run(mrl_model *m, int pack, const float *swap, int at, float *poison, sample_out *out,
                     int64_t *prefill) {
    const int V = mrl_model_get_config(m)->vocab_size;
    int64_t n = mrl_model_num_params(m);
    mrl_engine *e = engine_packed(m, pack);
    if (!e) return;
    int32_t prompts[2][16];
    int ids[2];
    for (int i = 0; i < 2; i++) {
        fill_prompt(prompts[i], swap_lens[i], V, 4 + i);
        mrl_engine_request r = request(prompts[i], swap_lens[i], swap_ns[i], SWAP_G, i ? 0.8f : 0.0f, i);
        CHECK_OK(mrl_engine_add_request(e, &r, &ids[i]));
    }
    for (int k = 0; k < at; k++) CHECK_OK(mrl_engine_step(e, NULL));
    if (swap) {
        CHECK_OK(mrl_engine_swap_params(e, swap, n));
        CHECK(mrl_engine_num_unfinished(e) == 3); /* nothing dropped */
    }
    if (poison)
        for (int64_t i = 0; i < n; i++) poison[i] = NAN;
    CHECK_OK(mrl_engine_run(e));
    get(e, ids[0], 0, &out[0]);
    get(e, ids[1], 0, &out[1]);
    get(e, ids[1], 1, &out[2]);
    mrl_engine_stats st;
    mrl_engine_get_stats(e, &st);
    *prefill = st.prefill_tokens;
    mrl_engine_free(e);
}

static int same_sample(const sample_out *a, const sample_out *b) {
    return a->n == b->n && memcmp(a->tok, b->tok, sizeof(int32_t) * a->n) == 0 &&
           memcmp(a->lp, b->lp, sizeof(float) * a->n) == 0;
}

/* Swapping to a bit-identical copy, then poisoning the old buffer: the
 * outputs are bit-identical (nothing reads the old buffer any more). */
static void test_swap_same(int pack) {
    mrl_model *m = make_model(MRL_ARCH_QWEN3, 96);
    if (!m) return;
    float *p = mrl_model_params(m);
    int64_t n = mrl_model_num_params(m), pre;
    float *copy = malloc(sizeof(float) * n);
    memcpy(copy, p, sizeof(float) * n);
    sample_out ref[3], got[3];
    swap_run(m, pack, NULL, 0, NULL, ref, &pre);
    swap_run(m, pack, copy, 5, p, got, &pre);
    for (int j = 0; j < 3; j++) CHECK(ref[j].n == SWAP_G && same_sample(&ref[j], &got[j]));
    memcpy(p, copy, sizeof(float) * n); /* and back: swap to the model's own buffer, poison the copy */
    swap_run(m, pack, copy, 3, NULL, got, &pre);
    for (int j = 0; j < 3; j++) CHECK(same_sample(&ref[j], &got[j]));
    free(copy);
    mrl_model_free(m);
}

/* The trainer's log-probs of sample s under the weights `w` (copied into the model for the call). */
static void logprobs_under(mrl_model *m, const float *w, const int32_t *prompt, int len, const sample_out *s,
                           float t, float *out) {
    float *p = mrl_model_params(m);
    int64_t n = mrl_model_num_params(m);
    float *saved = malloc(sizeof(float) * n);
    memcpy(saved, p, sizeof(float) * n);
    memcpy(p, w, sizeof(float) * n);
    trainer_logprobs(m, prompt, len, s, t, out);
    memcpy(p, saved, sizeof(float) * n);
    free(saved);
}

/* Swapping to other weights mid-generation. B = A with the rows of lm_head
 * reversed: the layers are A's, so the K/V computed under A before the swap
 * are also B's, and the trainer's forward under A (tokens before the swap)
 * and under B (after) is an exact reference; greedy picks V-1-(A's pick) at
 * the first step after the swap. C = A plus noise everywhere: the K/V kept
 * from A are not C's, so the samples differ from a full recompute under C;
 * pack_weights 0 and 1 agree. In both cases nothing is recomputed. */
static void test_swap_other(void) {
    const int V = 96, at = 6; /* step 1 prefills and samples token 0: `at` tokens before the swap */
    mrl_model *m = make_model(MRL_ARCH_LLAMA, V);
    if (!m) return;
    float *p = mrl_model_params(m);
    int64_t n = mrl_model_num_params(m), pre_a, pre;
    mrl_param_view head;
    CHECK_OK(mrl_model_find_view(m, "lm_head.weight", &head)); /* untied: the embedding stays A's */
    float *b = malloc(sizeof(float) * n), *c = malloc(sizeof(float) * n);
    memcpy(b, p, sizeof(float) * n);
    int64_t D = head.numel / V;
    for (int v = 0; v < V; v++) memcpy(b + head.offset + v * D, p + head.offset + (V - 1 - v) * D, sizeof(float) * D);
    for (int64_t i = 0; i < n; i++) c[i] = p[i] + (float)(0.2 * (urand() - 0.5));
    int32_t prompts[2][16];
    for (int i = 0; i < 2; i++) fill_prompt(prompts[i], swap_lens[i], V, 4 + i);
    const int which[3] = {0, 1, 1};
    const float temp[3] = {1.0f, 0.8f, 0.8f};
    sample_out a[3], s[3], s0[3];
    for (int pack = 0; pack < 2; pack++) {
        swap_run(m, pack, NULL, 0, NULL, a, &pre_a); /* A only */
        CHECK(pre_a == swap_lens[0] + swap_lens[1]); /* the group's prompt once */
        swap_run(m, pack, b, at, NULL, s, &pre);
        CHECK(pre == pre_a); /* the K/V before the swap were kept, not recomputed */
        CHECK(s[0].tok[at] == V - 1 - a[0].tok[at]);
        CHECK_NEAR(s[0].lp[at], a[0].lp[at], 1e-5); /* the same logits, permuted */
        for (int j = 0; j < 3; j++) {
            CHECK(s[j].n == SWAP_G && memcmp(s[j].tok, a[j].tok, sizeof(int32_t) * at) == 0);
            CHECK(memcmp(s[j].lp, a[j].lp, sizeof(float) * at) == 0);
            float ra[MAXG], rb[MAXG];
            logprobs_under(m, p, prompts[which[j]], swap_lens[which[j]], &s[j], temp[j], ra);
            logprobs_under(m, b, prompts[which[j]], swap_lens[which[j]], &s[j], temp[j], rb);
            for (int t = 0; t < s[j].n; t++) CHECK_NEAR(s[j].lp[t], t < at ? ra[t] : rb[t], 1e-5);
        }
    }
    double kept = 0; /* C: the K/V from A make a difference */
    for (int pack = 0; pack < 2; pack++) {
        swap_run(m, pack, c, at, NULL, pack ? s : s0, &pre);
        CHECK(pre == pre_a);
    }
    for (int j = 0; j < 3; j++) {
        CHECK(s[j].n == s0[j].n && memcmp(s[j].tok, s0[j].tok, sizeof(int32_t) * s[j].n) == 0);
        for (int t = 0; t < s[j].n; t++) CHECK_NEAR(s[j].lp[t], s0[j].lp[t], 1e-5);
        CHECK(memcmp(s[j].tok, a[j].tok, sizeof(int32_t) * at) == 0);
        float rc[MAXG];
        logprobs_under(m, c, prompts[which[j]], swap_lens[which[j]], &s[j], temp[j], rc);
        for (int t = at; t < s[j].n; t++) kept = fmax(kept, fabs(s[j].lp[t] - rc[t]));
    }
    printf("swap to C: max |engine - full recompute under C| after the swap %.3g\n", kept);
    CHECK(kept > 1e-3);
    /* errors */
    mrl_engine *e = engine_packed(m, 1);
    if (e) {
        CHECK(mrl_engine_swap_params(e, b, n - 1) == MRL_ERR_INVALID);
        CHECK_STR_CONTAINS(mrl_last_error(), "swap_params: buffer of");
        CHECK(mrl_engine_swap_params(e, b, n + 1) == MRL_ERR_INVALID);
        CHECK_OK(mrl_engine_swap_params(e, NULL, 0));
    }
    CHECK(mrl_engine_swap_params(NULL, b, n) == MRL_ERR_INVALID);
    mrl_engine_free(e);
    free(b);
    free(c);
    mrl_model_free(m);
}

/* ---- background generation (run_async) --------------------------------------------------------- */

typedef struct count_probe {
    pthread_barrier_t *bar;
    int seen[3];
} count_probe;

static void *probe_counts(void *arg) {
    count_probe *c = arg;
    mrl_parallel_set_thread_threads(3);
    c->seen[0] = mrl_parallel_threads();
    pthread_barrier_wait(c->bar); /* main sets the process-wide count */
    pthread_barrier_wait(c->bar);
    c->seen[1] = mrl_parallel_threads();
    mrl_parallel_set_thread_threads(0);
    c->seen[2] = mrl_parallel_threads();
    return NULL;
}

/* A thread's own count and the process-wide one do not touch each other. */
static void test_thread_counts(void) {
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    count_probe c = {&bar, {0, 0, 0}};
    mrl_parallel_set_threads(2);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, probe_counts, &c) == 0);
    pthread_barrier_wait(&bar);
    CHECK(mrl_parallel_threads() == 2); /* not the thread's 3 */
    mrl_parallel_set_threads(1);
    pthread_barrier_wait(&bar);
    pthread_join(t, NULL);
    CHECK(c.seen[0] == 3 && c.seen[1] == 3 && c.seen[2] == 1);
    CHECK(mrl_parallel_threads() == 1);
    mrl_parallel_set_threads(0);
    pthread_barrier_destroy(&bar);
}

#define ASYNC_REQS 4
#define ASYNC_G 40
static const int async_lens[ASYNC_REQS] = {5, 17, 9, 22}, async_ns[ASYNC_REQS] = {8, 1, 4, 3}; /* 16 samples */

static void add_async_requests(mrl_engine *e, int32_t prompts[ASYNC_REQS][24], int *ids) {
    static const float temps[ASYNC_REQS] = {1.0f, 0.0f, 0.7f, 1.2f};
    for (int i = 0; i < ASYNC_REQS; i++) {
        fill_prompt(prompts[i], async_lens[i], 96, 20 + i);
        mrl_engine_request r = request(prompts[i], async_lens[i], async_ns[i], ASYNC_G, temps[i], i);
        if (i == 3) r.params.top_p = 0.9f;
        CHECK_OK(mrl_engine_add_request(e, &r, &ids[i]));
    }
}

/* Every sample of the async requests, in order; returns how many. */
static int get_async(mrl_engine *e, const int *ids, sample_out *out) {
    int k = 0;
    for (int i = 0; i < ASYNC_REQS; i++)
        for (int j = 0; j < async_ns[i]; j++) get(e, ids[i], j, &out[k++]);
    return k;
}

/* A training step's worth of work on another model: log-probs and gradients. */
static void train_work(mrl_model *t, float *lp, float *grads) {
    int32_t tokens[96], targets[96], cu[3] = {0, 40, 96};
    for (int i = 0; i < 96; i++) tokens[i] = (i * 13 + 7) % 96;
    for (int i = 0; i < 96; i++) targets[i] = i + 1 == 40 || i + 1 == 96 ? -1 : tokens[i + 1];
    mrl_batch b = {tokens, targets, cu, 96, 2};
    float dlp[96];
    for (int i = 0; i < 96; i++) dlp[i] = -1.0f / 96;
    mrl_model_zero_grad(t);
    CHECK_OK(mrl_model_forward(t, &b, 1.0f, lp, NULL, NULL));
    CHECK_OK(mrl_model_backward(t, dlp, NULL, NULL));
    memcpy(grads, mrl_model_grads(t), sizeof(float) * mrl_model_num_params(t));
}

static void test_async(void) {
    mrl_model *m = make_model(MRL_ARCH_QWEN2, 96), *t = make_model(MRL_ARCH_LLAMA, 96);
    mrl_engine *e = m ? make_engine(m, 1 << 20, 64, 16, 8) : NULL;
    if (!m || !t || !e) return;
    int32_t prompts[ASYNC_REQS][24];
    int ids[ASYNC_REQS], id;
    sample_out ref[16], got[16];
    add_async_requests(e, prompts, ids);
    CHECK_OK(mrl_engine_run(e));
    int ns = get_async(e, ids, ref);
    /* the training work's reference, the engine idle */
    int64_t tn = mrl_model_num_params(t);
    float lp_ref[96], lp[96], *g_ref = malloc(sizeof(float) * tn), *g = malloc(sizeof(float) * tn);
    train_work(t, lp_ref, g_ref);
    int main_threads = mrl_parallel_threads();
    for (int threads = 1; threads <= 2; threads++) {
        CHECK_OK(mrl_engine_reset(e));
        add_async_requests(e, prompts, ids);
        CHECK(!mrl_engine_running(e));
        CHECK_OK(mrl_engine_run_async(e, threads));
        CHECK(mrl_engine_running(e));
        CHECK(mrl_parallel_threads() == main_threads);
        /* every call that touches the state is refused */
        mrl_engine_request r = request(prompts[0], 5, 1, 4, 1.0f, 0);
        mrl_status busy[9] = {
            mrl_engine_add_request(e, &r, &id), mrl_engine_step(e, NULL), mrl_engine_run(e), mrl_engine_reset(e),
            mrl_engine_attach_params(e, NULL, 0), mrl_engine_swap_params(e, NULL, 0),
            mrl_engine_stop_sample(e, ids[0], 0), mrl_engine_get_output(e, ids[0], 0, NULL, NULL, NULL, NULL),
            mrl_engine_run_async(e, 1)};
        for (int k = 0; k < 9; k++) CHECK(busy[k] == MRL_ERR_INVALID);
        CHECK_STR_CONTAINS(mrl_last_error(), "engine busy: a background run is in progress (mrl_engine_wait first)");
        /* the main thread trains meanwhile, with its own thread count (changed: not the engine's) */
        if (threads == 2) mrl_parallel_set_threads(1);
        int iters = 0, overlapped = 0;
        mrl_engine_stats st0;
        mrl_engine_get_stats(e, &st0);
        do {
            overlapped += mrl_engine_num_unfinished(e) > 0;
            train_work(t, lp, g);
            CHECK(memcmp(lp, lp_ref, sizeof lp) == 0 && memcmp(g, g_ref, sizeof(float) * tn) == 0);
            mrl_engine_stats st;
            mrl_engine_get_stats(e, &st); /* the published copy */
            CHECK(st.generated_tokens - st0.generated_tokens <= ns * ASYNC_G);
        } while (++iters < 200 && mrl_engine_num_unfinished(e) > 0);
        printf("async threads %d: %d training steps, %d while generating\n", threads, iters, overlapped);
        CHECK(mrl_parallel_threads() == (threads == 2 ? 1 : main_threads));
        mrl_parallel_set_threads(0);
        CHECK(overlapped >= 1);
        CHECK_OK(mrl_engine_wait(e));
        CHECK(!mrl_engine_running(e));
        CHECK(get_async(e, ids, got) == ns);
        for (int j = 0; j < ns; j++) CHECK(ref[j].n == ASYNC_G && same_sample(&ref[j], &got[j]));
    }
    /* a stop request ends the run with MRL_ERR_STOPPED; the requests stay queued */
    CHECK_OK(mrl_engine_reset(e));
    add_async_requests(e, prompts, ids);
    mrl_request_stop(-2, "test");
    CHECK_OK(mrl_engine_run_async(e, 1));
    CHECK(mrl_engine_wait(e) == MRL_ERR_STOPPED);
    CHECK_STR_CONTAINS(mrl_last_error(), "stop requested (test)");
    mrl_clear_stop();
    CHECK_OK(mrl_engine_run_async(e, 2)); /* stopped mid-run this time, then finished */
    mrl_engine_stats st;
    do mrl_engine_get_stats(e, &st);
    while (st.steps < 2 && mrl_engine_num_unfinished(e) > 0);
    mrl_request_stop(-2, "test");
    mrl_status stopped = mrl_engine_wait(e);
    mrl_clear_stop();
    CHECK(stopped == MRL_ERR_STOPPED || stopped == MRL_OK); /* OK only if it finished first */
    if (stopped == MRL_ERR_STOPPED) CHECK(mrl_engine_num_unfinished(e) > 0);
    CHECK_OK(mrl_engine_run(e));
    CHECK(get_async(e, ids, got) == ns);
    for (int j = 0; j < ns; j++) CHECK(same_sample(&ref[j], &got[j]));
    /* a failing run: its message reaches the caller's thread */
    float *nan_w = malloc(sizeof(float) * mrl_model_num_params(m));
    for (int64_t i = 0; i < mrl_model_num_params(m); i++) nan_w[i] = NAN;
    CHECK_OK(mrl_engine_reset(e));
    CHECK_OK(mrl_engine_swap_params(e, nan_w, mrl_model_num_params(m)));
    add_async_requests(e, prompts, ids);
    CHECK_OK(mrl_engine_run_async(e, 1));
    mrl_clear_error();
    CHECK(mrl_engine_wait(e) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "NaN");
    CHECK_OK(mrl_engine_attach_params(e, NULL, 0));
    /* bad calls */
    CHECK(mrl_engine_run_async(e, 0) == MRL_ERR_INVALID);
    CHECK(mrl_engine_run_async(NULL, 1) == MRL_ERR_INVALID);
    CHECK(mrl_engine_wait(e) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "no background run");
    CHECK(mrl_engine_wait(NULL) == MRL_ERR_INVALID);
    CHECK(!mrl_engine_running(NULL));
    /* free while running waits for the run */
    add_async_requests(e, prompts, ids);
    CHECK_OK(mrl_engine_run_async(e, 2));
    mrl_engine_free(e);
    free(nan_w);
    free(g_ref);
    free(g);
    mrl_model_free(t);
    mrl_model_free(m);
}

/* An engine that runs for a whole job (a stream of batches, a server): a
 * background run paused again and again (mrl_engine_pause) while requests
 * are added and finished ones read and released gives the tokens of one
 * run of the same requests (log-probs within float rounding: other rows
 * share the steps); released requests are gone. */
static void test_pause_release(void) {
    mrl_model *m = make_model(MRL_ARCH_QWEN3, 96);
    if (!m) return;
    int32_t pa[9], pb[6];
    fill_prompt(pa, 9, 96, 5);
    fill_prompt(pb, 6, 96, 6);
    mrl_engine_request ra = request(pa, 9, 2, 24, 1.0f, 0), rb = request(pb, 6, 3, 20, 1.0f, 1);
    sample_out ref[5], got[5];
    int ia, ib;
    mrl_engine *e = make_engine(m, 1 << 20, 64, 8, 4);
    CHECK_OK(mrl_engine_add_request(e, &ra, &ia));
    CHECK_OK(mrl_engine_add_request(e, &rb, &ib));
    CHECK_OK(mrl_engine_run(e));
    for (int j = 0; j < 5; j++) get(e, j < 2 ? ia : ib, j < 2 ? j : j - 2, &ref[j]);
    mrl_engine_free(e);

    e = make_engine(m, 1 << 20, 64, 8, 4);
    CHECK_OK(mrl_engine_add_request(e, &ra, &ia));
    int pauses = 0, added = 0;
    while (mrl_engine_num_unfinished(e) > 0) {
        CHECK_OK(mrl_engine_run_async(e, 1));
        CHECK(mrl_engine_request_done(e, ia) == -1); /* busy: the thread owns the state */
        usleep(1000); /* a step or a few on the thread, or none */
        mrl_engine_pause(e);
        CHECK_OK(mrl_engine_wait(e));
        pauses++;
        CHECK_OK(mrl_engine_step(e, NULL)); /* and one here: progress however the thread was scheduled */
        if (!added) { /* while A runs */
            CHECK_OK(mrl_engine_add_request(e, &rb, &ib));
            CHECK(mrl_engine_request_done(e, ib) == 0);
            CHECK(mrl_engine_release(e, ib) != MRL_OK); /* not finished */
            added = 1;
        }
        if (pauses > 200) break;
    }
    CHECK(pauses >= 1 && mrl_engine_num_unfinished(e) == 0);
    CHECK(mrl_engine_request_done(e, ia) == 1 && mrl_engine_request_done(e, ib) == 1);
    CHECK(mrl_engine_request_done(e, ib + 1) == -1);
    for (int j = 0; j < 5; j++) {
        get(e, j < 2 ? ia : ib, j < 2 ? j : j - 2, &got[j]);
        CHECK(got[j].n == ref[j].n && memcmp(got[j].tok, ref[j].tok, sizeof(int32_t) * ref[j].n) == 0);
        for (int k = 0; k < got[j].n; k++) CHECK(fabsf(got[j].lp[k] - ref[j].lp[k]) < 1e-4f);
    }
    CHECK_OK(mrl_engine_release(e, ia));
    CHECK(mrl_engine_get_output(e, ia, 0, NULL, NULL, NULL, NULL) != MRL_OK); /* released */
    CHECK(mrl_engine_release(e, ia) != MRL_OK);
    get(e, ib, 2, &got[4]); /* the other request untouched */
    CHECK(got[4].n == ref[4].n);
    /* a request added after the others finished runs on the same engine, no reset */
    int ic;
    CHECK_OK(mrl_engine_add_request(e, &ra, &ic));
    CHECK(ic > ib);
    CHECK_OK(mrl_engine_run(e));
    get(e, ic, 1, &got[0]);
    CHECK(got[0].n == ref[1].n && memcmp(got[0].tok, ref[1].tok, sizeof(int32_t) * ref[1].n) == 0);
    mrl_engine_pause(e); /* no run in progress: nothing happens */
    CHECK(mrl_engine_wait(e) != MRL_OK);
    mrl_engine_free(e);
    mrl_model_free(m);
}

int main(void) {
    for (int arch = 0; arch < 3; arch++) test_agreement(arch, NULL);
    for (int arch = 0; arch < 3; arch++) test_agreement(arch, counting_reference());
    for (int arch = 0; arch < 3; arch++) test_greedy_naive(arch);
    test_determinism();
    test_stops();
    test_zero_copy();
    test_errors();
    test_limits();
    test_no_grads();
    test_swap_same(1);
    test_swap_same(0);
    test_swap_other();
    test_thread_counts();
    test_async();
    test_pause_release();
    CHECK_DONE();
}
