/* The model API without PyTorch: config parsing and its errors, the views,
 * init determinism, bad batches, memory accounting, recomputation. The
 * numbers themselves are checked against PyTorch in model_ref.py. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "moonrl/mem.h"
#include "moonrl/model.h"

static mrl_status parse(const char *text, mrl_model_config *c) {
    return mrl_model_config_parse(text, strlen(text), "config.json", c);
}

#define BASE "\"vocab_size\": 50, \"hidden_size\": 32, \"intermediate_size\": 48, \"num_hidden_layers\": 2, " \
             "\"num_attention_heads\": 4, \"num_key_value_heads\": 2"

static void test_config(void) {
    mrl_model_config c;
    CHECK_OK(parse("{\"model_type\": \"llama\", " BASE ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, "
                   "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}}", &c));
    CHECK(c.arch == MRL_ARCH_LLAMA && c.head_dim == 8 && c.rope_scaling == MRL_ROPE_LLAMA3 && c.attention_bias == 0);
    CHECK_OK(parse("{\"architectures\": [\"Qwen2ForCausalLM\"], " BASE ", \"use_sliding_window\": false, \"sliding_window\": 4096}", &c));
    CHECK(c.arch == MRL_ARCH_QWEN2 && c.attention_bias == 1);
    CHECK_OK(parse("{\"model_type\": \"qwen3\", " BASE ", \"head_dim\": 16, \"eos_token_id\": [7, 8]}", &c));
    CHECK(c.arch == MRL_ARCH_QWEN3 && c.head_dim == 16 && c.eos_token_id == 7);
    CHECK_OK(parse("{\"architectures\": [\"LlamaForSequenceClassification\"], \"model_type\": \"llama\", " BASE "}", &c));
    CHECK(c.value_head == 1);

    CHECK(parse("{\"model_type\": \"llama\", " BASE ", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}}", &c) == MRL_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(mrl_last_error(), "yarn");
    CHECK(parse("{\"model_type\": \"qwen2\", " BASE ", \"use_sliding_window\": true}", &c) == MRL_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(mrl_last_error(), "sliding");
    CHECK(parse("{\"model_type\": \"qwen3\", " BASE ", \"layer_types\": [\"full_attention\", \"sliding_attention\"]}", &c) ==
          MRL_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(mrl_last_error(), "layer_types[1]");
    CHECK_OK(parse("{\"model_type\": \"llama\", " BASE ", \"rope_parameters\": {\"rope_type\": \"llama3\", \"rope_theta\": 500000.0, "
                   "\"factor\": 32.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}}", &c));
    CHECK(c.rope_theta == 500000.0 && c.rope_scaling == MRL_ROPE_LLAMA3 && c.rope_factor == 32.0);
    CHECK(parse("{\"model_type\": \"llama\", " BASE ", \"attention_bias\": true}", &c) == MRL_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(mrl_last_error(), "attention_bias");
    CHECK(parse("{\"model_type\": \"mistral\", " BASE "}", &c) == MRL_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(mrl_last_error(), "mistral");
    CHECK(parse("{\"model_type\": \"llama\", " BASE ", \"hidden_act\": \"gelu\"}", &c) == MRL_ERR_UNSUPPORTED);
    CHECK(parse("{\"model_type\": \"llama\", \"vocab_size\": 50}", &c) == MRL_ERR_FORMAT);
    CHECK_STR_CONTAINS(mrl_last_error(), "hidden_size");
    CHECK(parse("{\"model_type\": \"llama\", " BASE ", \"num_key_value_heads\": 3}", &c) == MRL_ERR_INVALID);
    CHECK(parse("{\"model_type\": \"llama\", " BASE ", \"vocab_size\": \"big\"}", &c) == MRL_ERR_FORMAT);
    CHECK(parse("{\"model_type\": ", &c) != MRL_OK);
    CHECK(mrl_model_config_load("/nonexistent/config.json", &c) == MRL_ERR_IO);

    /* to_json and back */
    CHECK_OK(parse("{\"model_type\": \"qwen2\", " BASE ", \"tie_word_embeddings\": true, \"rope_theta\": 1000000.0}", &c));
    char buf[4096];
    size_t len = 0;
    CHECK_OK(mrl_model_config_to_json(&c, buf, sizeof buf, &len));
    CHECK(len == strlen(buf));
    CHECK_STR_CONTAINS(buf, "\"architectures\": [\"Qwen2ForCausalLM\"]");
    mrl_model_config c2;
    CHECK_OK(mrl_model_config_parse(buf, len, "roundtrip", &c2));
    CHECK(memcmp(&c, &c2, sizeof c) == 0);
    CHECK(mrl_model_config_to_json(&c, buf, 10, &len) == MRL_ERR_INVALID);
}

static void test_model(void) {
    mrl_model_config c;
    CHECK_OK(parse("{\"model_type\": \"qwen2\", " BASE ", \"moonrl_value_head\": true}", &c));
    mrl_model *m = NULL, *m2 = NULL;
    CHECK_OK(mrl_model_create(&c, 7, &m));
    CHECK_OK(mrl_model_create(&c, 7, &m2));
    if (!m || !m2) return;
    int64_t n = mrl_model_num_params(m);
    /* embed + per layer (ln1 + q,k,v (+bias) + o + ln2 + 3 mlp) + norm + lm_head + score */
    int64_t per_layer = 32 + (32 * 32 + 32) + 2 * (16 * 32 + 16) + 32 * 32 + 32 + 3 * 48 * 32;
    CHECK(n == 50 * 32 + 2 * per_layer + 32 + 50 * 32 + 32);
    CHECK(memcmp(mrl_model_params(m), mrl_model_params(m2), sizeof(float) * n) == 0);
    mrl_param_view v;
    CHECK_OK(mrl_model_view(m, 0, &v));
    CHECK(strcmp(v.name, "model.embed_tokens.weight") == 0 && v.offset == 0 && v.shape[0] == 50 && v.weight_decay);
    CHECK_OK(mrl_model_find_view(m, "model.layers.1.self_attn.k_proj.bias", &v));
    CHECK(v.ndim == 1 && v.shape[0] == 16 && !v.weight_decay);
    CHECK_OK(mrl_model_find_view(m, "model.layers.0.post_attention_layernorm.weight", &v));
    CHECK(!v.weight_decay && mrl_model_params(m)[v.offset] == 1.0f);
    CHECK_OK(mrl_model_find_view(m, "score.weight", &v));
    CHECK(v.shape[0] == 1 && v.shape[1] == 32 && v.offset + v.numel == n);
    CHECK(mrl_model_find_view(m, "model.layers.2.mlp.up_proj.weight", &v) == MRL_ERR_INVALID);
    CHECK(mrl_model_view(m, 999, &v) == MRL_ERR_INVALID);
    int64_t off = 0;
    for (int i = 0; i < mrl_model_num_views(m); i++) {
        CHECK_OK(mrl_model_view(m, i, &v));
        CHECK(v.offset == off);
        off += v.numel;
    }
    CHECK(off == n);

    /* bad batches are errors */
    int32_t tokens[6] = {1, 2, 3, 4, 5, 6}, targets[6] = {2, 3, -1, 5, 6, -1}, cu[3] = {0, 3, 6};
    float lp[6], ent[6], val[6];
    mrl_batch b = {tokens, targets, cu, 6, 2};
    CHECK(mrl_model_backward(m, lp, NULL, NULL) == MRL_ERR_INVALID);
    tokens[2] = 50;
    CHECK(mrl_model_forward(m, &b, 1.0f, lp, ent, val) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "vocabulary");
    tokens[2] = 3;
    cu[1] = 7;
    CHECK(mrl_model_forward(m, &b, 1.0f, lp, ent, val) == MRL_ERR_INVALID);
    cu[1] = 3;
    CHECK(mrl_model_forward(m, &b, 0.0f, lp, ent, val) == MRL_ERR_INVALID);
    CHECK(mrl_model_forward(m, NULL, 1.0f, lp, ent, val) == MRL_ERR_INVALID);

    /* forward, backward, recompute: same numbers, fewer activation bytes */
    mrl_mem_stats s0, s1;
    CHECK_OK(mrl_model_forward(m, &b, 1.0f, lp, ent, val));
    float dl[6] = {1, 1, 0, 1, 1, 0};
    mrl_model_zero_grad(m);
    CHECK_OK(mrl_model_backward(m, dl, NULL, dl));
    float *g1 = malloc(sizeof(float) * n);
    memcpy(g1, mrl_model_grads(m), sizeof(float) * n);
    mrl_mem_get_stats(&s0);
    CHECK(s0.current[MRL_MEM_ACTIVATIONS] >= mrl_model_activation_bytes(m, 6));
    int64_t full = mrl_model_activation_bytes(m, 1000);
    mrl_model_set_recompute(m, 1);
    CHECK(mrl_model_activation_bytes(m, 1000) < full);
    float lp2[6];
    CHECK_OK(mrl_model_forward(m, &b, 1.0f, lp2, NULL, NULL));
    mrl_model_zero_grad(m);
    CHECK_OK(mrl_model_backward(m, dl, NULL, NULL));
    mrl_mem_get_stats(&s1);
    CHECK(memcmp(lp, lp2, sizeof lp) == 0);
    CHECK(mrl_model_backward(m, dl, NULL, dl) == MRL_OK); /* dvalues fine: model has a value head */
    free(g1);
    mrl_model_free(m);
    mrl_model_free(m2);
    mrl_mem_get_stats(&s1);
    CHECK(s1.current[MRL_MEM_PARAMS] == 0 && s1.current[MRL_MEM_ACTIVATIONS] == 0 && s1.current[MRL_MEM_GRADS] == 0);
}

/* save_dir -> load_dir gives the same parameters and the same forward */
static void test_save_load(void) {
    mrl_model_config c;
    CHECK_OK(parse("{\"model_type\": \"qwen3\", " BASE ", \"head_dim\": 16, \"tie_word_embeddings\": true}", &c));
    mrl_model *m = NULL, *m2 = NULL;
    CHECK_OK(mrl_model_create(&c, 3, &m));
    if (!m) return;
    char dir[] = "/tmp/moonrl_model_test_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char sub[256];
    snprintf(sub, sizeof sub, "%s/saved", dir);
    CHECK_OK(mrl_model_save_dir(m, sub));
    CHECK_OK(mrl_model_load_dir(sub, &m2));
    if (m2) {
        CHECK(mrl_model_num_params(m2) == mrl_model_num_params(m));
        CHECK(memcmp(mrl_model_params(m), mrl_model_params(m2), sizeof(float) * mrl_model_num_params(m)) == 0);
        CHECK(memcmp(mrl_model_get_config(m), mrl_model_get_config(m2), sizeof c) == 0);
        int32_t tokens[5] = {1, 2, 3, 4, 5}, targets[5] = {2, 3, 4, 5, -1}, cu[2] = {0, 5};
        mrl_batch b = {tokens, targets, cu, 5, 1};
        float lp1[5], lp2[5];
        CHECK_OK(mrl_model_forward(m, &b, 1.0f, lp1, NULL, NULL));
        CHECK_OK(mrl_model_forward(m2, &b, 1.0f, lp2, NULL, NULL));
        CHECK(memcmp(lp1, lp2, sizeof lp1) == 0);
        mrl_model_free(m2);
        m2 = NULL;
    }
    /* a config that does not match the weights */
    char path[300];
    snprintf(path, sizeof path, "%s/config.json", sub);
    FILE *f = fopen(path, "w");
    if (f) {
        fprintf(f, "{\"model_type\": \"qwen3\", \"vocab_size\": 50, \"hidden_size\": 32, \"intermediate_size\": 40, "
                   "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16, "
                   "\"tie_word_embeddings\": true}");
        fclose(f);
    }
    CHECK(mrl_model_load_dir(sub, &m2) == MRL_ERR_FORMAT);
    CHECK_STR_CONTAINS(mrl_last_error(), "mlp.gate_proj.weight");
    CHECK(m2 == NULL);
    CHECK(mrl_model_load_dir("/nonexistent/model", &m2) != MRL_OK);
    snprintf(path, sizeof path, "rm -rf '%s'", dir);
    CHECK(system(path) == 0);
    mrl_model_free(m);
}

int main(void) {
    test_config();
    test_model();
    test_save_load();
    CHECK_DONE();
}
