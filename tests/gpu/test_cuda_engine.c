/* The generation engine on a GPU (its model moved there, mrl_model_set_device)
 * against the same engine on the CPU, from the same weights:
 *   - GRPO-style groups (one prompt prefilled once, forked into samples),
 *     a repeated prompt (the prefix cache), chunked prefill, nucleus and
 *     top-k sampling with per-sample seeds, a greedy request with
 *     top_logprobs: the same tokens (fp32: everywhere; bf16: up to a
 *     near-tie, where the CPU's two best log-probs are within TIE_BF16),
 *     the same log-probs within the bounds below;
 *   - a KV cache too small for the round: pre-emption and recomputation on
 *     the device give the tokens of the roomy run;
 *   - decode steps replayed as CUDA graphs: the bits of the same engine
 *     without them;
 *   - zero-copy: an optimizer step on the GPU model is seen by its engine's
 *     next round with no copy, as on the CPU; and the engine's log-probs are
 *     the trainer's forward of the same tokens on the GPU (what RL relies on);
 *   - the refusals: a background run, following a weight store, host
 *     weights for a GPU engine, a step after the model moved away.
 * Skips (exit 77) where no GPU is visible (the emulated one of tests/gpu/emu:
 * the cuda_engine_emu test). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "models.h"
#include "moonrl/device.h"
#include "moonrl/engine.h"
#include "moonrl/optim.h"
#include "moonrl/runtime.h"

/* fp32: sums in other orders (cuBLASLt, the kernels' trees): ~100 ulps of
 * log-probs of size ~5. bf16: the two sides' activations round to
 * neighbouring bf16 values now and then (tests/model/test_bf16.c), moving a
 * log-prob by up to a few 1e-2; where two tokens are closer than that, the
 * greedy choice may differ, and the samples part ways from there. */
#define LP_FP32 2e-4
#define LP_BF16 0.06
#define TIE_BF16 0.06

static const mrl_device GPU = {MRL_DEVICE_CUDA, 0};

enum { N_REQ = 5, MAX_NEW = 20 };

typedef struct round_out {
    int n_req, n[N_REQ];
    int32_t tok[N_REQ][4][MAX_NEW];
    float lp[N_REQ][4][MAX_NEW];
    int len[N_REQ][4];
    int32_t top_ids[MAX_NEW][5];
    float top_lp[MAX_NEW][5];
    mrl_engine_stats stats;
} round_out;

static int32_t prompts[4][24];
static const int prompt_lens[4] = {13, 21, 5, 9};

/* One round: prompts 0..2 as groups of 4 samples (0 twice: its second
 * group hits the prefix cache), prompt 3 greedy with top_logprobs. */
static void run_round(mrl_engine *e, int64_t step, round_out *o) {
    memset(o, 0, sizeof *o);
    CHECK_OK(mrl_engine_reset(e));
    static const int which[N_REQ] = {0, 1, 2, 0, 3};
    int ids[N_REQ];
    for (int r = 0; r < N_REQ; r++) {
        int p = which[r], greedy = p == 3;
        mrl_engine_request q = {.prompt = prompts[p], .prompt_len = prompt_lens[p], .n = greedy ? 1 : 4,
                                .max_new_tokens = MAX_NEW, .seed = 1234, .step = step, .prompt_index = r,
                                .top_logprobs = greedy ? 5 : 0};
        q.params = greedy ? (mrl_sampling_params){0, 0, 1, 0}
                          : (mrl_sampling_params){0.9f, r == 1 ? 30 : 0, r == 2 ? 0.85f : 1.0f, 0};
        CHECK_OK(mrl_engine_add_request(e, &q, &ids[r]));
        o->n[r] = q.n;
    }
    o->n_req = N_REQ;
    CHECK_OK(mrl_engine_run(e));
    for (int r = 0; r < N_REQ; r++)
        for (int j = 0; j < o->n[r]; j++) {
            const int32_t *t;
            const float *lp;
            int n = 0;
            CHECK_OK(mrl_engine_get_output(e, ids[r], j, &t, &lp, &n, NULL));
            o->len[r][j] = n;
            memcpy(o->tok[r][j], t, sizeof(int32_t) * n);
            memcpy(o->lp[r][j], lp, sizeof(float) * n);
        }
    const int32_t *ti;
    const float *tl;
    int top = 0;
    CHECK_OK(mrl_engine_get_output_top_logprobs(e, ids[N_REQ - 1], 0, &ti, &tl, &top));
    CHECK(top == 5);
    for (int i = 0; i < o->len[N_REQ - 1][0] && top == 5; i++) {
        memcpy(o->top_ids[i], ti + i * 5, sizeof(int32_t) * 5);
        memcpy(o->top_lp[i], tl + i * 5, sizeof(float) * 5);
    }
    mrl_engine_get_stats(e, &o->stats);
}

/* g against c: tokens the same (bf16: until a near-tie of c's greedy choice, or
 * the first difference of a sampled one), log-probs of the common tokens within tol */
static void compare_rounds(const char *what, const round_out *g, const round_out *c, int bf16) {
    double worst = 0, top_worst = 0;
    int same = 0, total = 0, splits = 0;
    for (int r = 0; r < c->n_req; r++)
        for (int j = 0; j < c->n[r]; j++) {
            int n = c->len[r][j] < g->len[r][j] ? c->len[r][j] : g->len[r][j], i = 0;
            while (i < n && g->tok[r][j][i] == c->tok[r][j][i]) i++;
            total += c->len[r][j], same += i;
            for (int t = 0; t < i; t++) {
                double d = fabs((double)g->lp[r][j][t] - c->lp[r][j][t]);
                if (!(d <= worst)) worst = d;
            }
            if (i == c->len[r][j] && i == g->len[r][j]) continue;
            splits++;
            int greedy = r == c->n_req - 1;
            if (!bf16) {
                fprintf(stderr, "%s: request %d sample %d: token %d differs (%d on the GPU, %d on the CPU)\n", what, r,
                        j, i, i < g->len[r][j] ? g->tok[r][j][i] : -1, i < c->len[r][j] ? c->tok[r][j][i] : -1);
                CHECK(0);
            } else if (greedy && i < c->len[r][j]) { /* a near-tie of the CPU's two best */
                double gap = c->top_lp[i][0] - c->top_lp[i][1];
                printf("  %s: greedy request parts at token %d, the CPU's two best %.3g apart\n", what, i, gap);
                CHECK(gap <= TIE_BF16);
            }
        }
    for (int i = 0; i < c->len[c->n_req - 1][0] && (!bf16 || splits == 0); i++)
        for (int k = 0; k < 5; k++) {
            CHECK(g->top_ids[i][k] == c->top_ids[i][k] || bf16);
            double d = fabs((double)g->top_lp[i][k] - c->top_lp[i][k]);
            if (g->top_ids[i][k] == c->top_ids[i][k] && !(d <= top_worst)) top_worst = d;
        }
    printf("  %s: %d of %d tokens the same (%d samples part), max |d logprob| %.3g, top_logprobs %.3g\n", what,
           same, total, splits, worst, top_worst);
    CHECK(worst <= (bf16 ? LP_BF16 : LP_FP32));
    CHECK(top_worst <= (bf16 ? LP_BF16 : LP_FP32));
    if (bf16) CHECK(same >= total / 2); /* parting now and then, not everywhere */
}

/* The engine's log-probs of request 0's first sample against the model's forward of its tokens. */
static void engine_vs_trainer(mrl_model *m, const round_out *o, double tol) {
    int n = o->len[0][0], P = prompt_lens[0], T = P + n;
    int32_t tokens[64], targets[64], cu[2] = {0, T};
    for (int i = 0; i < P; i++) tokens[i] = prompts[0][i];
    for (int i = 0; i < n; i++) tokens[P + i] = o->tok[0][0][i];
    for (int i = 0; i < T; i++) targets[i] = i + 1 < T ? tokens[i + 1] : -1;
    mrl_batch b = {tokens, targets, cu, T, 1, NULL};
    float lp[64];
    CHECK_OK(mrl_model_forward(m, &b, 0.9f, lp, NULL, NULL));
    double worst = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs((double)lp[P - 1 + i] - o->lp[0][0][i]);
        if (!(d <= worst)) worst = d;
    }
    printf("  engine vs trainer forward on the GPU: max |d logprob| %.3g over %d tokens\n", worst, n);
    CHECK(worst <= tol);
}

static void case_engine(int arch, int bf16) {
    printf("arch %d, %s:\n", arch, bf16 ? "bf16" : "fp32");
    mrl_model_config cfg = small_config(arch);
    mrl_model *c = small_model(&cfg, 21 + arch), *g = small_model(&cfg, 21 + arch);
    if (bf16) {
        CHECK_OK(mrl_model_set_dtype(c, MRL_MODEL_BF16));
        CHECK_OK(mrl_model_set_dtype(g, MRL_MODEL_BF16));
    }
    CHECK_OK(mrl_model_set_device(g, GPU));
    mrl_engine_config ec;
    mrl_engine_config_default(&ec);
    ec.kv_cache_bytes = 1 << 20;
    ec.block_size = 8;
    ec.max_num_seqs = 16;
    ec.max_num_batched_tokens = 32; /* prompts prefilled in chunks */
    mrl_engine *ce = NULL, *ge = NULL;
    CHECK_OK(mrl_engine_create(c, &ec, &ce));
    CHECK_OK(mrl_engine_create(g, &ec, &ge));
    if (!ce || !ge) exit(1);
    static round_out oc, og, tight;
    run_round(ce, 0, &oc);
    run_round(ge, 0, &og);
    CHECK(og.stats.prefix_hit_tokens > 0 && og.stats.forks > 0);
    printf("  decode steps as CUDA graphs: %lld launches, %lld captures, of %lld steps\n",
           (long long)og.stats.graph_launches, (long long)og.stats.graph_captures, (long long)og.stats.steps);
    CHECK(og.stats.graph_captures > 0 && og.stats.graph_launches > og.stats.graph_captures);
    CHECK(oc.stats.graph_launches == 0);
    /* the same engine without graphs: the same kernels launched one by one, the same bits */
    {
        mrl_engine_config plain = ec;
        plain.cuda_graphs = 0;
        mrl_engine *pe = NULL;
        static round_out op;
        CHECK_OK(mrl_engine_create(g, &plain, &pe));
        if (pe) {
            run_round(pe, 0, &op);
            CHECK(op.stats.graph_launches == 0);
            CHECK(memcmp(op.tok, og.tok, sizeof op.tok) == 0 && memcmp(op.lp, og.lp, sizeof op.lp) == 0);
            mrl_engine_free(pe);
        }
    }
    CHECK(og.stats.prefix_hit_tokens == oc.stats.prefix_hit_tokens && og.stats.forks == oc.stats.forks);
    compare_rounds("round 1", &og, &oc, bf16);
    engine_vs_trainer(g, &og, bf16 ? LP_BF16 : LP_FP32);

    /* a cache of 12 blocks of 8 tokens: the 17 sequences pre-empt each other */
    mrl_engine_config small = ec;
    small.kv_cache_bytes = 12 * mrl_model_get_config(g)->num_hidden_layers * 2 * 8 * cfg.num_key_value_heads *
                           cfg.head_dim * (int64_t)sizeof(float);
    if (arch == MRL_ARCH_DEEPSEEK_V3) /* (the latent cache: a row of kv_lora_rank + qk_rope_head_dim a token) */
        small.kv_cache_bytes = 12 * cfg.num_hidden_layers * 8 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) *
                               (int64_t)sizeof(float);
    mrl_engine *te = NULL;
    CHECK_OK(mrl_engine_create(g, &small, &te));
    if (te) {
        run_round(te, 0, &tight);
        printf("  tight cache: %lld pre-emptions\n", (long long)tight.stats.preemptions);
        CHECK(tight.stats.preemptions > 0);
        compare_rounds("pre-empted on the GPU vs the roomy CPU run", &tight, &oc, bf16);
        mrl_engine_free(te);
    }

    /* one AdamW step on both models from the same gradients: the engines read the new weights */
    int64_t n = mrl_model_num_params(c);
    float *grad = mrl_model_grads(c);
    for (int64_t i = 0; i < n; i++) grad[i] = (float)(urand() - 0.5) * 1e-2f;
    CHECK_OK(mrl_device_memcpy(mrl_model_grads(g), grad, sizeof(float) * n));
    mrl_adamw_config ac = {.lr = 2e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0};
    mrl_adamw *oa = NULL, *ob = NULL;
    CHECK_OK(mrl_adamw_create(mrl_model_params(c), mrl_model_grads(c), n, &ac, &oa));
    CHECK_OK(mrl_adamw_create(mrl_model_params(g), mrl_model_grads(g), n, &ac, &ob));
    CHECK_OK(mrl_adamw_step(oa, -1));
    CHECK_OK(mrl_adamw_step(ob, -1));
    mrl_model_weights_changed(c);
    mrl_model_weights_changed(g);
    static round_out oc2, og2;
    run_round(ce, 1, &oc2);
    run_round(ge, 1, &og2);
    compare_rounds("round 2, after the step", &og2, &oc2, bf16);
    CHECK(og2.stats.graph_launches > og.stats.graph_launches); /* the graphs read the new weights in place */
    int moved = 0;
    for (int i = 0; i < og2.len[4][0] && i < og.len[4][0]; i++) moved += og2.lp[4][0][i] != og.lp[4][0][i];
    CHECK(moved > 0); /* the new weights, read in place */
    engine_vs_trainer(g, &og2, bf16 ? LP_BF16 : LP_FP32);
    mrl_adamw_free(oa);
    mrl_adamw_free(ob);

    /* refusals */
    CHECK(mrl_engine_run_async(ge, 1) == MRL_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(mrl_last_error(), "GPU");
    CHECK(mrl_engine_attach_params(ge, mrl_model_params(c), n) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "host memory");
    mrl_weight_store *ws = NULL;
    if (mrl_weight_store_create(NULL, n, 1, &ws) == MRL_OK) {
        CHECK(mrl_engine_follow(ge, ws, 0) == MRL_ERR_UNSUPPORTED);
        mrl_weight_store_free(ws);
    }
    /* a capture that fails (on the emulated GPU, made to: EMU_SPOIL_CAPTURE): the steps run without graphs */
    char what[160];
    mrl_device_describe(GPU, what, sizeof what);
    if (strstr(what, "CPU emulation")) {
        setenv("EMU_SPOIL_CAPTURE", "1", 1);
        mrl_engine *fe = NULL;
        static round_out of;
        CHECK_OK(mrl_engine_create(g, &ec, &fe));
        if (fe) {
            run_round(fe, 1, &of);
            printf("  captures made to fail: %lld failed, %lld launched\n", (long long)of.stats.graph_failures,
                   (long long)of.stats.graph_launches);
            CHECK(of.stats.graph_failures > 0 && of.stats.graph_launches == 0);
            CHECK(memcmp(of.tok, og2.tok, sizeof of.tok) == 0 && memcmp(of.lp, og2.lp, sizeof of.lp) == 0);
            mrl_engine_free(fe);
        }
        unsetenv("EMU_SPOIL_CAPTURE");
    }
    /* the CPU model moved to the GPU under its engine: the engine says so instead of reading freed memory */
    CHECK_OK(mrl_model_set_device(c, GPU));
    CHECK(mrl_engine_step(ce, NULL) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "make a new engine");
    mrl_engine_free(ce);
    mrl_engine_free(ge);
    mrl_model_free(c);
    mrl_model_free(g);
}

int main(void) {
    rng = MRL_GOLDEN64; /* the stream its tolerances were set on */
    if (mrl_device_cuda_count() < 1) {
        printf("no CUDA device visible: skipped\n");
        return 77;
    }
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < 24; i++) prompts[p][i] = (int32_t)(urand() * 211);
    case_engine(MRL_ARCH_LLAMA, 0);
    case_engine(MRL_ARCH_QWEN3, 1);
    case_engine(MRL_ARCH_DEEPSEEK_V3, 0); /* multi-head latent attention over the latent cache */
    mrl_shutdown();
    CHECK_DONE();
}
