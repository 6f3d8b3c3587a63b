/* The generation engine on a tiny random Qwen3-MoE (8 experts, top-2,
 * renormalised; 3 layers of which the middle one is dense, mlp_only_layers):
 *   - agreement: the log-probs of the tokens it samples (greedy and at
 *     temperatures, chunked prefills mixed with decodes) equal the trainer's
 *     mrl_model_forward of the same tokens within 1e-5 in fp32, with and
 *     without weight panels (bit-identical samples either way), and within
 *     bf16's bound (test_engine_bf16.c) in bf16;
 *   - greedy generation equals the argmax of the trainer's forward over the
 *     whole sequence, token by token (a naive full-recompute loop);
 *   - the routing record (mrl_engine_record_routing): every position the
 *     engine ran holds the experts the trainer's forward of the same sequence
 *     picks (chunked prefills, groups forked from one prefill, pre-emptions
 *     and recomputation, prefix-cache hits, which stay -1 as each sample's
 *     last token does); replaying it in the trainer (mrl_batch.routing)
 *     replays every other position, none differing from the trainer's own
 *     top-k, with log-probs bit-identical to no replay; requests added with
 *     recording off have no record, a short buffer is refused. */
#define REQUEST_SEED 4321
#define REQUEST_STEP 2
#include "engine_util.h"

#define LP_AGREE_BF16 0.02
/* and with the KV cache in bf16 too (the default with a bf16 model): K and V
 * rounded, which the trainer's attention does not (test_engine_bf16.c) */
#define LP_AGREE_BF16_KV16 0.1

static mrl_model *make_model(int vocab, int dtype) {
    mrl_model_config c;
    tiny_config(&c, MRL_ARCH_QWEN3_MOE, vocab);
    c.num_hidden_layers = 3;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 32;
    c.norm_topk_prob = 1;
    c.decoder_sparse_step = 1;
    c.mlp_only_layers[0] = 1u << 1; /* layer 1 dense */
    mrl_model *m = NULL;
    CHECK_OK(mrl_model_create(&c, 5, &m));
    if (!m) exit(1);
    perturb_vectors(m, 0.3); /* norm weights away from 1 (no biases) */
    float *p = mrl_model_params(m);
    for (int i = 0; i < mrl_model_num_views(m); i++) {
        mrl_param_view v;
        mrl_model_view(m, i, &v);
        if (strstr(v.name, "mlp.gate.weight")) /* decisive routing: few near-ties between experts */
            for (int64_t j = 0; j < v.numel; j++) p[v.offset + j] *= 4;
    }
    CHECK_OK(mrl_model_set_dtype(m, dtype));
    return m;
}

static mrl_engine *make_engine(mrl_model *m, int max_tokens, int pack, int kv_dtype) {
    mrl_engine *e = new_engine_kv(m, 1 << 20, max_tokens, 16, 8, pack, kv_dtype);
    if (!e) exit(1);
    return e;
}

/* Every sample of one run into a->out; returns the max |engine - trainer|. */
static double agreement(mrl_model *m, int pack, int kv_dtype, agreement_run *a) {
    mrl_engine *e = make_engine(m, 40, pack, kv_dtype); /* small step budget: chunked prefills */
    agreement_add(e, a, 96, 0, 0, NULL);
    CHECK_OK(mrl_engine_run(e));
    double max_d = agreement_compare(m, e, a, NULL);
    agreement_check_length(a);
    mrl_engine_free(e);
    return max_d;
}

static void test_agreement(void) {
    mrl_model *m = make_model(96, MRL_MODEL_FP32);
    static agreement_run packed, plain;
    double d1 = agreement(m, 1, MRL_KV_AUTO, &packed), d0 = agreement(m, 0, MRL_KV_AUTO, &plain);
    printf("qwen3_moe fp32: max |engine - trainer| log-prob %.3g (panels), %.3g (no panels)\n", d1, d0);
    CHECK(d1 <= 1e-5 && d0 <= 1e-5);
    for (int i = 0; i < NP; i++)
        for (int j = 0; j < agree_ns[i]; j++) {
            const sample_out *a = &packed.out[i][j], *b = &plain.out[i][j];
            CHECK(a->n == b->n && memcmp(a->tok, b->tok, sizeof(int32_t) * b->n) == 0);
        }
    mrl_model_free(m);
    m = make_model(96, MRL_MODEL_BF16);
    double d = agreement(m, 1, MRL_KV_FP32, &packed), d16 = agreement(m, 1, MRL_KV_AUTO, &plain);
    printf("qwen3_moe bf16: max |engine - trainer| log-prob %.3g (KV cache fp32), %.3g (bf16)\n", d, d16);
    CHECK(d <= LP_AGREE_BF16);
    CHECK(d16 <= LP_AGREE_BF16_KV16);
    mrl_model_free(m);
}

static void test_greedy_naive(void) {
    const int V = 64, G = 10;
    mrl_model *m = make_model(V, MRL_MODEL_FP32);
    mrl_engine *e = make_engine(m, 64, 1, MRL_KV_AUTO);
    int compared = greedy_vs_naive(m, e, V, G, "qwen3_moe");
    printf("qwen3_moe greedy: %d tokens equal to the trainer's argmax\n", compared);
    CHECK(compared >= 25);
    mrl_engine_free(e);
    mrl_model_free(m);
}

/* Each sample's record against the trainer's own routing of its sequence; returns the positions
 * the engine never ran (other than the last), counted in *unrun (all must be prompt positions). */
static void routing_compare(mrl_model *m, mrl_engine *e, agreement_run *a, int *unrun, int *compared) {
    const mrl_model_config *c = mrl_model_get_config(m);
    int64_t R = (int64_t)mrl_model_num_moe_layers(m) * c->num_experts_per_tok;
    CHECK(R == 2 * 2); /* layers 0 and 2 sparse, top-2 */
    for (int i = 0; i < NP; i++)
        for (int j = 0; j < agree_ns[i]; j++) {
            sample_out *s = &a->out[i][j];
            get(e, a->ids[i], j, s);
            int P = agree_lens[i], n = P + s->n;
            int64_t np = 0;
            CHECK_OK(mrl_engine_get_output_routing(e, a->ids[i], j, NULL, 0, &np));
            CHECK(np == n);
            int16_t rec[96 * 4], own[96 * 4];
            CHECK(mrl_engine_get_output_routing(e, a->ids[i], j, rec, np * R - 1, &np) == MRL_ERR_INVALID);
            CHECK_OK(mrl_engine_get_output_routing(e, a->ids[i], j, rec, np * R, &np));
            int32_t tokens[96], targets[96], cu[2] = {0, n};
            float lp[96], lp2[96];
            memcpy(tokens, a->prompts[i], sizeof(int32_t) * P);
            memcpy(tokens + P, s->tok, sizeof(int32_t) * s->n);
            for (int t = 0; t < n; t++) targets[t] = t + 1 < n ? tokens[t + 1] : -1;
            mrl_batch b = {tokens, targets, cu, n, 1};
            CHECK_OK(mrl_model_forward(m, &b, 1.0f, lp, NULL, NULL));
            CHECK_OK(mrl_model_get_routing(m, own, n * R));
            int run = 0;
            for (int t = 0; t < n; t++) {
                const int16_t *r = rec + t * R;
                if (r[0] < 0) { /* never run: the whole row -1, the last token or a cached prompt prefix */
                    for (int q = 0; q < R; q++) CHECK(r[q] == -1);
                    if (t < n - 1) {
                        CHECK(t < P - 1);
                        (*unrun)++;
                    }
                    continue;
                }
                CHECK(t < n - 1); /* the last token is never fed back */
                run++;
                (*compared)++;
                CHECK(memcmp(r, own + t * R, sizeof(int16_t) * R) == 0);
            }
            b.routing = rec; /* the trainer replays the engine's picks: the same model, the same bits */
            CHECK_OK(mrl_model_forward(m, &b, 1.0f, lp2, NULL, NULL));
            int64_t replayed = -1, differ = -1;
            mrl_model_routing_replay_stats(m, &replayed, &differ);
            CHECK(replayed == (int64_t)run * mrl_model_num_moe_layers(m) && differ == 0);
            CHECK(memcmp(lp, lp2, sizeof(float) * n) == 0);
        }
}

static void test_routing_record(void) {
    mrl_model *m = make_model(96, MRL_MODEL_FP32);
    static agreement_run a, again, tight;
    /* chunked prefills (40 tokens a step), groups, a prefix cache in blocks of 8 */
    mrl_engine *e = new_engine(m, 1 << 20, 40, 16, 8, 1);
    int id, unrun = 0, compared = 0;
    int32_t prompt[4] = {3, 1, 4, 1};
    mrl_engine_request r = request(prompt, 4, 1, 3, 0.0f, 0);
    CHECK_OK(mrl_engine_add_request(e, &r, &id)); /* recording off (the default): no record */
    CHECK_OK(mrl_engine_run(e));
    CHECK(mrl_engine_get_output_routing(e, id, 0, NULL, 0, NULL) == MRL_ERR_INVALID);
    CHECK(strstr(mrl_last_error(), "no routing record") != NULL);
    CHECK_OK(mrl_engine_reset(e));
    CHECK_OK(mrl_engine_record_routing(e, 1));
    agreement_add(e, &a, 96, 0, 0, NULL);
    CHECK_OK(mrl_engine_run(e));
    routing_compare(m, e, &a, &unrun, &compared);
    CHECK(unrun == 0);
    /* the same prompts again, no reset: their prefixes come from the cache (never run: -1) */
    agreement_add(e, &again, 96, 0, 0, NULL);
    CHECK_OK(mrl_engine_run(e));
    mrl_engine_stats st;
    mrl_engine_get_stats(e, &st);
    int unrun2 = 0;
    routing_compare(m, e, &again, &unrun2, &compared);
    printf("qwen3_moe routing record: %d positions equal to the trainer's picks; %d cached prompt positions "
           "not run (prefix hits %lld)\n", compared, unrun2, (long long)st.prefix_hit_tokens);
    CHECK(st.prefix_hit_tokens > 0 && unrun2 > 0);
    mrl_engine_free(e);
    /* a cache of 12 blocks of 8: pre-emptions, recomputed sequences */
    e = new_engine(m, 12 * 8 * 768, 40, 16, 8, 1);
    CHECK_OK(mrl_engine_record_routing(e, 1));
    agreement_add(e, &tight, 96, 0, 0, NULL);
    CHECK_OK(mrl_engine_run(e));
    mrl_engine_get_stats(e, &st);
    int unrun3 = 0, compared3 = 0;
    routing_compare(m, e, &tight, &unrun3, &compared3);
    printf("qwen3_moe routing record under %lld pre-emptions: %d positions equal\n", (long long)st.preemptions,
           compared3);
    CHECK(st.preemptions > 0 && unrun3 == 0);
    for (int i = 0; i < NP; i++) CHECK_OK(mrl_engine_release(e, tight.ids[i]));
    CHECK(mrl_engine_get_output_routing(e, tight.ids[0], 0, NULL, 0, NULL) == MRL_ERR_INVALID);
    mrl_engine_free(e);
    mrl_model_free(m);
}

int main(void) {
    test_agreement();
    test_greedy_naive();
    test_routing_record();
    CHECK_DONE();
}
