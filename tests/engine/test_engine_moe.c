/* The generation engine on a tiny random Qwen3-MoE (8 experts, top-2,
 * renormalised; 3 layers of which the middle one is dense, mlp_only_layers):
 *   - agreement: the log-probs of the tokens it samples (greedy and at
 *     temperatures, chunked prefills mixed with decodes) equal the trainer's
 *     mrl_model_forward of the same tokens within 1e-5 in fp32, with and
 *     without weight panels (bit-identical samples either way), and within
 *     bf16's bound (test_engine_bf16.c) in bf16;
 *   - greedy generation equals the argmax of the trainer's forward over the
 *     whole sequence, token by token (a naive full-recompute loop). */
#define REQUEST_SEED 4321
#define REQUEST_STEP 2
#include "engine_util.h"

#define LP_AGREE_BF16 0.02

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
    randomise_vectors(m); /* norm weights away from 1 (no biases) */
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

static mrl_engine *make_engine(mrl_model *m, int max_tokens, int pack) {
    mrl_engine *e = new_engine(m, 1 << 20, max_tokens, 16, 8, pack);
    if (!e) exit(1);
    return e;
}

/* Every sample of one run into a->out; returns the max |engine - trainer|. */
static double agreement(mrl_model *m, int pack, agreement_run *a) {
    mrl_engine *e = make_engine(m, 40, pack); /* small step budget: chunked prefills */
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
    double d1 = agreement(m, 1, &packed), d0 = agreement(m, 0, &plain);
    printf("qwen3_moe fp32: max |engine - trainer| log-prob %.3g (panels), %.3g (no panels)\n", d1, d0);
    CHECK(d1 <= 1e-5 && d0 <= 1e-5);
    for (int i = 0; i < NP; i++)
        for (int j = 0; j < agree_ns[i]; j++) {
            const sample_out *a = &packed.out[i][j], *b = &plain.out[i][j];
            CHECK(a->n == b->n && memcmp(a->tok, b->tok, sizeof(int32_t) * b->n) == 0);
        }
    mrl_model_free(m);
    m = make_model(96, MRL_MODEL_BF16);
    double d = agreement(m, 1, &packed);
    printf("qwen3_moe bf16: max |engine - trainer| log-prob %.3g\n", d);
    CHECK(d <= LP_AGREE_BF16);
    mrl_model_free(m);
}

static void test_greedy_naive(void) {
    const int V = 64, G = 10;
    mrl_model *m = make_model(V, MRL_MODEL_FP32);
    mrl_engine *e = make_engine(m, 64, 1);
    int compared = greedy_vs_naive(m, e, V, G, "qwen3_moe");
    printf("qwen3_moe greedy: %d tokens equal to the trainer's argmax\n", compared);
    CHECK(compared >= 25);
    mrl_engine_free(e);
    mrl_model_free(m);
}

int main(void) {
    test_agreement();
    test_greedy_naive();
    CHECK_DONE();
}
