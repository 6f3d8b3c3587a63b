/* The model API without PyTorch: config parsing and its errors, the views,
 * init determinism, bad batches, memory accounting, recomputation, loading
 * (shapes checked before allocating, the tolerated differences), saving
 * (sharded, in bounded memory), the
 * gradient buffer created on first use, gradient windows and sharded
 * parameters (ZeRO-2 and 3: the same numbers as the whole model). The
 * numbers themselves are checked against PyTorch in model_ref.py. */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "moonrl/dtype.h"
#include "moonrl/mem.h"
#include "moonrl/model.h"
#include "moonrl/safetensors.h"

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
    /* every token id an integer within the vocabulary ([1.5] and [1e12] once loaded as token 0) */
    const char *bad_ids[][2] = { { "\"eos_token_id\": [1.5]", "\"eos_token_id\"[0] must be a token id, an integer in 0..49" },
                                 { "\"eos_token_id\": [1e12]", "\"eos_token_id\"[0]" },
                                 { "\"eos_token_id\": [7, 1000000000000]", "\"eos_token_id\"[1] must be" },
                                 { "\"eos_token_id\": [7, 50]", "\"eos_token_id\"[1] must be" },
                                 { "\"eos_token_id\": -2", "\"eos_token_id\" must be a token id" },
                                 { "\"eos_token_id\": [-1]", "\"eos_token_id\"[0] must be a token id" },
                                 { "\"eos_token_id\": \"2\"", "\"eos_token_id\" must be" },
                                 { "\"bos_token_id\": 50", "\"bos_token_id\" must be a token id, an integer in 0..49 (vocab_size 50)" } };
    for (size_t i = 0; i < sizeof bad_ids / sizeof bad_ids[0]; i++) {
        char text[512];
        snprintf(text, sizeof text, "{\"model_type\": \"llama\", " BASE ", %s}", bad_ids[i][0]);
        CHECK(parse(text, &c) == MRL_ERR_FORMAT);
        CHECK_STR_CONTAINS(mrl_last_error(), bad_ids[i][1]);
    }
    CHECK_OK(parse("{\"model_type\": \"llama\", " BASE ", \"bos_token_id\": 0, \"eos_token_id\": 49}", &c));
    CHECK(c.bos_token_id == 0 && c.eos_token_id == 49);
    CHECK_OK(parse("{\"model_type\": \"llama\", " BASE ", \"bos_token_id\": null, \"eos_token_id\": []}", &c));
    CHECK(c.bos_token_id == -1 && c.eos_token_id == -1);
    CHECK_OK(parse("{\"model_type\": \"llama\", " BASE ", \"bos_token_id\": -1, \"eos_token_id\": -1}", &c)); /* none */
    CHECK(c.bos_token_id == -1 && c.eos_token_id == -1);
    CHECK_OK(parse("{\"architectures\": [\"LlamaForSequenceClassification\"], \"model_type\": \"llama\", " BASE "}", &c));
    CHECK(c.value_head == 1);

    CHECK(parse("{\"model_type\": \"llama\", " BASE ", \"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 4.0}}", &c) == MRL_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(mrl_last_error(), "'dynamic'");
    CHECK(parse("{\"model_type\": \"llama\", " BASE ", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}}", &c) == MRL_ERR_FORMAT);
    CHECK_STR_CONTAINS(mrl_last_error(), "original_max_position_embeddings");
    CHECK_OK(parse("{\"model_type\": \"llama\", " BASE ", \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, "
                   "\"original_max_position_embeddings\": 8}}", &c));
    CHECK(c.rope_scaling == MRL_ROPE_YARN && c.rope_factor == 4.0 && c.rope_beta_fast == 32 && c.rope_beta_slow == 1 &&
          c.rope_truncate == 1 && fabs(c.rope_attention_factor - (0.1 * log(4.0) + 1)) < 1e-15);
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
    CHECK_STR_CONTAINS(mrl_last_error(), "is not supported (llama, qwen2, qwen3, qwen3_moe, deepseek_v3)");
    /* the architecture from the class alone: the longest stem (Qwen3Moe, not Qwen3) */
    CHECK(parse("{\"architectures\": [\"Qwen3MoeForCausalLM\"], " BASE ", \"num_experts\": 4, \"num_experts_per_tok\": 2, "
                "\"moe_intermediate_size\": 16}", &c) == MRL_OK && c.arch == MRL_ARCH_QWEN3_MOE);
    CHECK(parse("{\"architectures\": [\"Qwen3ForCausalLM\"], " BASE "}", &c) == MRL_OK && c.arch == MRL_ARCH_QWEN3);
    /* the one table of names */
    CHECK(strcmp(mrl_model_arch_names(MRL_ARCH_QWEN3_MOE)->model_type, "qwen3_moe") == 0);
    CHECK(strcmp(mrl_model_arch_names(MRL_ARCH_QWEN3_MOE)->hf_class, "Qwen3Moe") == 0);
    CHECK(strcmp(mrl_model_arch_names(MRL_ARCH_QWEN3_MOE)->gguf, "qwen3moe") == 0);
    CHECK(mrl_model_arch_names(MRL_ARCH_COUNT) == NULL && mrl_model_arch_names(-1) == NULL);
    mrl_model_config bad_arch = c; /* the qwen3 config just parsed */
    bad_arch.arch = 7;
    CHECK(mrl_model_config_validate(&bad_arch) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "arch = 7 (0 llama, 1 qwen2, 2 qwen3, 3 qwen3_moe, 4 deepseek_v3)");
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

static int exists(const char *dir, const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (f) fclose(f);
    return f != NULL;
}

/* The number N of dir's model-0000K-of-0000N.safetensors files, each K there
 * (0: none, -1: a K missing or more than one N). */
static int shard_count(const char *dir) {
    int found = 0;
    for (int n = 1; n < 100; n++) {
        char name[64];
        snprintf(name, sizeof name, "model-00001-of-%05d.safetensors", n);
        if (!exists(dir, name)) continue;
        if (found) return -1;
        found = n;
        for (int k = 2; k <= n; k++) {
            snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", k, n);
            if (!exists(dir, name)) return -1;
        }
    }
    return found;
}

/* save_dir_sharded past the shard limit: Hugging Face's file names and
 * index, the shards filled in view order, the weights read back bit-exact
 * through the index; a later save of another layout into the same
 * directory leaves none of the earlier one's files. */
static void test_save_sharded(void) {
    mrl_model_config c;
    CHECK_OK(parse("{\"model_type\": \"llama\", " BASE "}", &c));
    mrl_model *m = NULL, *m2 = NULL;
    CHECK_OK(mrl_model_create(&c, 11, &m));
    if (!m) return;
    char dir[] = "/tmp/moonrl_model_shards_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    int64_t bytes = 4 * mrl_model_num_params(m);
    CHECK_OK(mrl_model_save_dir_sharded(m, dir, bytes / 4)); /* 4 or 5 shards: a tensor does not split */
    int n = shard_count(dir);
    CHECK(n >= 3);
    CHECK(exists(dir, "model.safetensors.index.json") && !exists(dir, "model.safetensors") && exists(dir, "config.json"));
    char path[300], *index = NULL;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL);
    if (f) {
        index = calloc(1, 1 << 16);
        CHECK(fread(index, 1, (1 << 16) - 1, f) > 0);
        fclose(f);
    }
    if (index) { /* each view's shard, as the index names it: view (state-dict) order never goes back */
        int last = 1;
        for (int i = 0; i < mrl_model_num_views(m); i++) {
            mrl_param_view v;
            char key[160];
            CHECK_OK(mrl_model_view(m, i, &v));
            snprintf(key, sizeof key, "\"%s\": \"model-", v.name);
            const char *at = strstr(index, key);
            int k = 0, of = 0;
            CHECK(at && sscanf(at + strlen(key), "%5d-of-%5d.safetensors\"", &k, &of) == 2 && of == n);
            CHECK(k >= last && k <= last + 1);
            last = k;
        }
        CHECK(last == n);
        free(index);
    }
    mrl_st *st = NULL;
    CHECK_OK(mrl_st_open(dir, &st));
    if (st) {
        CHECK(mrl_st_count(st) == mrl_model_num_views(m));
        CHECK(strcmp(mrl_st_metadata(st, "format"), "pt") == 0);
        mrl_st_close(st);
    }
    CHECK_OK(mrl_model_load_dir(dir, &m2));
    if (m2) {
        CHECK(memcmp(mrl_model_params(m), mrl_model_params(m2), (size_t)bytes) == 0);
        mrl_model_free(m2);
        m2 = NULL;
    }
    /* the same directory again: one file, then 2 shards; nothing of before stays */
    CHECK_OK(mrl_model_save_dir(m, dir));
    CHECK(shard_count(dir) == 0 && exists(dir, "model.safetensors") && !exists(dir, "model.safetensors.index.json"));
    CHECK_OK(mrl_model_save_dir_sharded(m, dir, bytes - 1)); /* all but the head in the first */
    CHECK(shard_count(dir) == 2 && !exists(dir, "model.safetensors"));
    CHECK_OK(mrl_model_load_dir(dir, &m2));
    if (m2) CHECK(memcmp(mrl_model_params(m), mrl_model_params(m2), (size_t)bytes) == 0);
    mrl_model_free(m2);
    CHECK(mrl_model_save_dir_sharded(m, dir, -1) == MRL_ERR_INVALID);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    mrl_model_free(m);
}

/* Saving streams from the parameters: the resident peak grows by far less
 * than the model's fp32 size (a version that gathers the model into one
 * buffer first, as a GPU model's save once did, grows by all of it). */
static void test_save_memory(void) {
    mrl_model_config c;
    CHECK_OK(parse("{\"model_type\": \"llama\", \"vocab_size\": 4096, \"hidden_size\": 256, \"intermediate_size\": 1024, "
                   "\"num_hidden_layers\": 4, \"num_attention_heads\": 4}", &c));
    mrl_model *m = NULL;
    CHECK_OK(mrl_model_create(&c, 2, &m));
    if (!m) return;
    int64_t bytes = 4 * mrl_model_num_params(m); /* ~24 MB */
    char dir[] = "/tmp/moonrl_model_mem_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    mrl_mem_reset_rss_peak();
    int64_t before = mrl_mem_rss_peak();
    CHECK_OK(mrl_model_save_dir_sharded(m, dir, 4 << 20));
    int64_t grew = mrl_mem_rss_peak() - before;
    CHECK(before > 0 && grew < bytes / 4);
    if (!(grew < bytes / 4))
        fprintf(stderr, "saving a model of %lld bytes raised the resident peak by %lld\n", (long long)bytes, (long long)grew);
    CHECK(shard_count(dir) >= 5);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    mrl_model_free(m);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* A config.json far larger than its weights: the shapes are checked against
 * the file before anything is allocated, so the error comes at once and
 * the memory peak stays small (no parameter or gradient buffer). */
static void test_load_checks_before_alloc(void) {
    mrl_model_config c;
    CHECK_OK(parse("{\"model_type\": \"llama\", " BASE "}", &c));
    mrl_model *m = NULL, *m2 = NULL;
    CHECK_OK(mrl_model_create(&c, 5, &m));
    if (!m) return;
    char dir[] = "/tmp/moonrl_model_big_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char cfg[300];
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    CHECK_OK(mrl_model_save_dir(m, dir));
    /* 0.5 GB of parameters (and as much of gradients) before the fix */
    const char *big = "{\"model_type\": \"llama\", \"vocab_size\": 50, \"hidden_size\": 1024, "
                      "\"intermediate_size\": 4096, \"num_hidden_layers\": 8, \"num_attention_heads\": 8}";
    /* every size at its bound: petabytes */
    const char *huge = "{\"model_type\": \"llama\", \"vocab_size\": 16777216, \"hidden_size\": 65536, "
                       "\"intermediate_size\": 262144, \"num_hidden_layers\": 1024, \"num_attention_heads\": 64}";
    const char *texts[2] = {big, huge}, *want[2] = {"[50, 32], the config implies [50, 1024]",
                                                    "[50, 32], the config implies [16777216, 65536]"};
    for (int k = 0; k < 2; k++) {
        write_text(cfg, texts[k]);
        mrl_mem_stats s0, s1;
        mrl_mem_reset_peak();
        mrl_mem_get_stats(&s0);
        CHECK(mrl_model_load_dir(dir, &m2) == MRL_ERR_FORMAT && m2 == NULL);
        CHECK_STR_CONTAINS(mrl_last_error(), "'model.embed_tokens.weight'");
        CHECK_STR_CONTAINS(mrl_last_error(), want[k]);
        mrl_mem_get_stats(&s1);
        CHECK(s1.total_peak - s0.total < (8 << 20)); /* the views' table only */
        CHECK(s1.peak[MRL_MEM_PARAMS] == s0.current[MRL_MEM_PARAMS] && s1.peak[MRL_MEM_GRADS] == s0.current[MRL_MEM_GRADS]);
        CHECK(s1.total == s0.total);
    }
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    mrl_model_free(m);
}

/* model.safetensors of m's views, except `skip`, plus an extra tensor
 * `extra` of shape [d0] or [d0, d1] (d1 0; NULL: none) holding the first parameters. */
static void write_weights(mrl_model *m, const char *dir, const char *skip, const char *extra, int64_t d0, int64_t d1) {
    mrl_st_writer *w = NULL;
    CHECK_OK(mrl_st_writer_create(&w));
    if (!w) return;
    for (int i = 0; i < mrl_model_num_views(m); i++) {
        mrl_param_view v;
        mrl_model_view(m, i, &v);
        if (skip && strcmp(v.name, skip) == 0) continue;
        CHECK_OK(mrl_st_writer_add(w, v.name, MRL_DTYPE_F32, v.ndim, v.shape, mrl_model_params(m) + v.offset));
    }
    int64_t shape[2] = {d0, d1};
    if (extra) CHECK_OK(mrl_st_writer_add(w, extra, MRL_DTYPE_F32, d1 ? 2 : 1, shape, mrl_model_params(m)));
    char path[300];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK_OK(mrl_st_writer_write(w, path));
    mrl_st_writer_free(w);
}

static float *view_of(mrl_model *m, const char *name, int64_t *numel) {
    mrl_param_view v = {0};
    CHECK_OK(mrl_model_find_view(m, name, &v));
    *numel = v.numel;
    return mrl_model_params(m) + v.offset;
}

/* The tolerated differences between a checkpoint and the config (io.c) still load;
 * the others are errors naming the tensor. */
static void test_load_tolerated(void) {
    char dir[] = "/tmp/moonrl_model_tol_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    mrl_model_config c;
    mrl_model *m = NULL, *m2 = NULL;
    int64_t n = 0, n2 = 0;
    /* tied: a stored lm_head.weight and rotary inv_freq buffers are ignored */
    CHECK_OK(parse("{\"model_type\": \"llama\", " BASE ", \"tie_word_embeddings\": true}", &c));
    CHECK_OK(mrl_model_create(&c, 11, &m));
    if (!m) return;
    CHECK_OK(mrl_model_save_dir(m, dir));
    const char *ignored[2] = {"lm_head.weight", "model.layers.1.self_attn.rotary_emb.inv_freq"};
    for (int k = 0; k < 2; k++) {
        write_weights(m, dir, NULL, ignored[k], k ? 4 : 50, k ? 0 : 32);
        CHECK_OK(mrl_model_load_dir(dir, &m2));
        if (m2) CHECK(memcmp(mrl_model_params(m), mrl_model_params(m2), sizeof(float) * mrl_model_num_params(m)) == 0);
        mrl_model_free(m2);
        m2 = NULL;
    }
    write_weights(m, dir, NULL, "model.layers.0.mlp.extra.weight", 4, 0); /* anything else is an error */
    CHECK(mrl_model_load_dir(dir, &m2) == MRL_ERR_UNSUPPORTED && m2 == NULL);
    CHECK_STR_CONTAINS(mrl_last_error(), "'model.layers.0.mlp.extra.weight' has no place");
    write_weights(m, dir, "model.layers.1.mlp.up_proj.weight", NULL, 0, 0);
    CHECK(mrl_model_load_dir(dir, &m2) == MRL_ERR_FORMAT && m2 == NULL);
    CHECK_STR_CONTAINS(mrl_last_error(), "'model.layers.1.mlp.up_proj.weight' is missing");
    mrl_model_free(m);
    m = NULL;
    /* a value-head model (ForSequenceClassification, untied) */
    CHECK_OK(parse("{\"model_type\": \"qwen2\", " BASE ", \"moonrl_value_head\": true}", &c));
    CHECK_OK(mrl_model_create(&c, 12, &m));
    if (!m) return;
    CHECK_OK(mrl_model_save_dir(m, dir));
    write_weights(m, dir, "score.weight", NULL, 0, 0); /* a policy turned critic: the documented init */
    CHECK_OK(mrl_model_load_dir(dir, &m2));
    if (m2) {
        float *s2 = view_of(m2, "score.weight", &n2), *e = view_of(m, "model.embed_tokens.weight", &n);
        double sq = 0;
        for (int64_t i = 0; i < n2; i++) sq += (double)s2[i] * s2[i];
        CHECK(sq > 0 && sq < 1);
        CHECK(memcmp(e, view_of(m2, "model.embed_tokens.weight", &n2), sizeof(float) * n) == 0);
        mrl_model_free(m2);
        m2 = NULL;
    }
    write_weights(m, dir, "lm_head.weight", NULL, 0, 0); /* no lm_head: a copy of the embedding */
    CHECK_OK(mrl_model_load_dir(dir, &m2));
    if (m2) {
        float *e = view_of(m2, "model.embed_tokens.weight", &n), *h = view_of(m2, "lm_head.weight", &n2);
        CHECK(n == n2 && memcmp(e, h, sizeof(float) * n) == 0);
        float *s = view_of(m, "score.weight", &n), *s2 = view_of(m2, "score.weight", &n2);
        CHECK(memcmp(s, s2, sizeof(float) * n) == 0);
        mrl_model_free(m2);
    }
    mrl_model_free(m);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

/* The gradient buffer exists only once asked for (mrl_model_grads) or
 * written (backward): creating, loading and running forwards allocate none. */
static void test_lazy_grads(void) {
    mrl_model_config c;
    CHECK_OK(parse("{\"model_type\": \"qwen3\", " BASE ", \"head_dim\": 16}", &c));
    mrl_mem_stats s0, s1;
    mrl_mem_get_stats(&s0);
    mrl_model *m = NULL, *m2 = NULL;
    CHECK_OK(mrl_model_create(&c, 9, &m));
    if (!m) return;
    char dir[] = "/tmp/moonrl_model_grads_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    CHECK_OK(mrl_model_save_dir(m, dir));
    CHECK_OK(mrl_model_load_dir(dir, &m2));
    int32_t tokens[5] = {1, 2, 3, 4, 5}, targets[5] = {2, 3, 4, 5, -1}, cu[2] = {0, 5};
    mrl_batch b = {tokens, targets, cu, 5, 1};
    float lp[5], dl[5] = {1, 1, 1, 1, 0};
    CHECK_OK(mrl_model_forward(m, &b, 1.0f, lp, NULL, NULL));
    if (m2) CHECK_OK(mrl_model_forward(m2, &b, 1.0f, lp, NULL, NULL));
    mrl_model_zero_grad(m);
    mrl_mem_get_stats(&s1);
    CHECK(s1.current[MRL_MEM_GRADS] == s0.current[MRL_MEM_GRADS]); /* none yet */
    CHECK(s1.peak[MRL_MEM_GRADS] == s0.peak[MRL_MEM_GRADS]);
    int64_t n = mrl_model_num_params(m), bytes = (int64_t)sizeof(float) * n;
    CHECK_OK(mrl_model_backward(m, dl, NULL, NULL)); /* creates them */
    mrl_mem_get_stats(&s1);
    CHECK(s1.current[MRL_MEM_GRADS] - s0.current[MRL_MEM_GRADS] == bytes);
    float *g = mrl_model_grads(m);
    double sq = 0;
    for (int64_t i = 0; g && i < n; i++) sq += (double)g[i] * g[i];
    CHECK(g && sq > 0);
    if (m2) {
        float *g2 = mrl_model_grads(m2); /* asked for: created, zeroed */
        int zero = g2 != NULL;
        for (int64_t i = 0; g2 && i < n; i++) zero &= g2[i] == 0;
        CHECK(zero);
        CHECK(mrl_model_grads(m2) == g2);
        mrl_mem_get_stats(&s1);
        CHECK(s1.current[MRL_MEM_GRADS] - s0.current[MRL_MEM_GRADS] == 2 * bytes);
        /* the same gradients whichever came first, the buffer or the backward */
        CHECK_OK(mrl_model_forward(m2, &b, 1.0f, lp, NULL, NULL));
        CHECK_OK(mrl_model_backward(m2, dl, NULL, NULL));
        CHECK(g && g2 && memcmp(g, g2, bytes) == 0);
    }
    mrl_model_free(m);
    mrl_model_free(m2);
    mrl_mem_get_stats(&s1);
    CHECK(s1.current[MRL_MEM_GRADS] == s0.current[MRL_MEM_GRADS]);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

/* The gradient hook: ranges in descending order that cover the buffer once, each already
 * final when reported (its values then equal those after the whole backward). */
typedef struct hook_log {
    const float *grads;
    float *snap; /* the range's values when it was reported */
    int64_t n, next_end;
    int calls, bad_order;
} hook_log;

static void record_range(void *ctx, int64_t offset, int64_t count) {
    hook_log *h = ctx;
    if (offset + count != h->next_end || count < 0) h->bad_order++;
    h->next_end = offset;
    memcpy(h->snap + offset, h->grads + offset, sizeof(float) * (size_t)count);
    h->calls++;
}

static void test_grad_hook(void) {
    const char *configs[] = {"{\"model_type\": \"qwen2\", " BASE ", \"moonrl_value_head\": true}",
                             "{\"model_type\": \"qwen3\", " BASE ", \"head_dim\": 16, \"tie_word_embeddings\": true}"};
    for (int k = 0; k < 2; k++) {
        mrl_model_config c;
        CHECK_OK(parse(configs[k], &c));
        mrl_model *m = NULL;
        CHECK_OK(mrl_model_create(&c, 11, &m));
        int64_t n = mrl_model_num_params(m);
        hook_log h = {mrl_model_grads(m), calloc((size_t)n, sizeof(float)), n, n, 0, 0};
        int32_t tokens[6] = {1, 2, 3, 4, 5, 6}, targets[6] = {2, 3, -1, 5, 6, -1}, cu[3] = {0, 3, 6};
        float lp[6], dl[6] = {1, -1, 0, 0.5f, 1, 0};
        mrl_batch b = {tokens, targets, cu, 6, 2};
        mrl_model_set_grad_hook(m, record_range, &h);
        CHECK_OK(mrl_model_forward(m, &b, 1.0f, lp, NULL, NULL));
        CHECK_OK(mrl_model_backward(m, dl, dl, NULL));
        CHECK(h.calls == c.num_hidden_layers + 2);
        CHECK(h.bad_order == 0 && h.next_end == 0);
        CHECK(memcmp(h.snap, mrl_model_grads(m), sizeof(float) * (size_t)n) == 0);
        mrl_model_set_grad_hook(m, NULL, NULL); /* off: no more calls */
        CHECK_OK(mrl_model_forward(m, &b, 1.0f, lp, NULL, NULL));
        CHECK_OK(mrl_model_backward(m, dl, NULL, NULL));
        CHECK(h.calls == c.num_hidden_layers + 2);
        free(h.snap);
        mrl_model_free(m);
    }
}

/* Sharded parameters against the whole model. The "gather" copies the requested range from the
 * whole model's parameters (what the other ranks' shards would bring) and checks it is waited for
 * only once started; the gradient windows are ranges of an outside buffer. Log-probs, entropy,
 * values and gradients must be the whole model's bit for bit, in fp32 and bf16, with and without
 * recomputation; the memory of the parameters stays the shard and a few parts; saving writes
 * the whole model's file; a read outside what is gathered faults. */
typedef struct fake_gather {
    const float *whole;
    int64_t started_lo[8], started_hi[8];
    int n_started, bad;
    int64_t peak;
} fake_gather;

static mrl_status fg_start(void *ctx, float *params, int64_t offset, int64_t count) {
    fake_gather *g = ctx;
    if (g->n_started == 8) {
        g->bad++;
        return MRL_ERR_INVALID;
    }
    memcpy(params + offset, g->whole + offset, sizeof(float) * (size_t)count);
    g->started_lo[g->n_started] = offset, g->started_hi[g->n_started] = offset + count;
    g->n_started++;
    mrl_mem_stats s;
    mrl_mem_get_stats(&s);
    if (s.current[MRL_MEM_PARAMS] > g->peak) g->peak = s.current[MRL_MEM_PARAMS];
    return MRL_OK;
}

static mrl_status fg_wait(void *ctx, float *params, int64_t offset, int64_t count) {
    (void)params;
    fake_gather *g = ctx;
    for (int i = 0; i < g->n_started; i++)
        if (g->started_lo[i] == offset && g->started_hi[i] == offset + count) {
            g->started_lo[i] = g->started_lo[--g->n_started], g->started_hi[i] = g->started_hi[g->n_started];
            return MRL_OK;
        }
    g->bad++;
    return MRL_ERR_INVALID;
}

typedef struct outside_grads {
    float *g;
    int lent, returned;
} outside_grads;

static float *og_acquire(void *ctx, int64_t offset, int64_t count) {
    outside_grads *o = ctx;
    o->lent++;
    for (int64_t i = 0; i < count; i++) o->g[offset + i] = 0; /* lent zeroed */
    return o->g + offset;
}

static void og_ready(void *ctx, int64_t offset, int64_t count) {
    (void)offset, (void)count;
    ((outside_grads *)ctx)->returned++;
}

#define BASE8 "\"vocab_size\": 50, \"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 8, " \
              "\"num_attention_heads\": 4, \"num_key_value_heads\": 2"

/* Bytes this process has read (/proc/self/io's rchar); -1 where absent. */
static int64_t rchar(void) {
    FILE *f = fopen("/proc/self/io", "r");
    if (!f) return -1;
    char line[128];
    long long v = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "rchar: %lld", &v) == 1) break;
    fclose(f);
    return v;
}

static void test_sharded(void) {
    /* (BASE's layer count replaced: 8 layers, so that a part is small against the whole) */
    const char *configs[] = {"{\"model_type\": \"qwen2\", " BASE8 ", \"moonrl_value_head\": true}",
                             "{\"model_type\": \"qwen3\", " BASE8 ", \"head_dim\": 16, \"tie_word_embeddings\": true}"};
    for (int k = 0; k < 2; k++)
        for (int dtype = 0; dtype < 2; dtype++)
            for (int recompute = 0; recompute < 2; recompute++) {
                mrl_model_config c;
                CHECK_OK(parse(configs[k], &c));
                mrl_model *made = NULL, *m = NULL, *sh = NULL;
                CHECK_OK(mrl_model_create(&c, 21 + k, &made));
                char dir[] = "/tmp/moonrl_model_shard_XXXXXX", out[300], cmd[700];
                CHECK(mkdtemp(dir) != NULL);
                CHECK_OK(mrl_model_save_dir(made, dir));
                mrl_model_free(made);
                CHECK_OK(mrl_model_load_dir(dir, &m));
                mrl_mem_stats s0;
                mrl_mem_get_stats(&s0);
                int64_t read0 = rchar();
                CHECK_OK(mrl_model_load_dir_shard(dir, 3, 3, 1, 0, &sh)); /* the middle third */
                /* by range: about a third of the file's bytes read, not all of them */
                snprintf(out, sizeof out, "%s/model.safetensors", dir);
                FILE *f = fopen(out, "rb");
                int64_t file_bytes = 0;
                if (f) {
                    fseek(f, 0, SEEK_END);
                    file_bytes = ftell(f);
                    fclose(f);
                }
                CHECK(read0 >= 0 && rchar() - read0 < file_bytes / 2 && file_bytes > 0);
                if (!m || !sh) return;
                int64_t n = mrl_model_num_params(m), off = -1, cnt = -1;
                CHECK(mrl_model_shard(sh, &off, &cnt) == 1 && mrl_model_shard(m, NULL, NULL) == 0);
                CHECK(off > 0 && cnt > 0 && off + cnt < n);
                mrl_mem_stats s1;
                mrl_mem_get_stats(&s1);
                int64_t held = s1.current[MRL_MEM_PARAMS] - s0.current[MRL_MEM_PARAMS];
                CHECK(held >= 4 * cnt && held <= 4 * cnt + 2 * 4096); /* the shard, read by range, and its pages */
                const float *whole = mrl_model_params(m);
                CHECK(memcmp(mrl_model_params(sh) + off, whole + off, sizeof(float) * (size_t)cnt) == 0);
                /* without its gathers the forward is refused, naming them */
                int32_t tokens[7] = {1, 2, 3, 4, 5, 6, 7}, targets[7] = {2, 3, -1, 5, 6, 7, -1}, cu[3] = {0, 3, 7};
                mrl_batch b = {tokens, targets, cu, 7, 2};
                float lp[2][7], ent[2][7], val[2][7], dl[7] = {1, -1, 0, 0.5f, 1, 0.25f, 0};
                int vh = k == 0;
                CHECK(mrl_model_forward(sh, &b, 1.0f, lp[1], ent[1], vh ? val[1] : NULL) == MRL_ERR_INVALID);
                CHECK(strstr(mrl_last_error(), "mrl_model_set_param_gather") != NULL);
                fake_gather fg = {.whole = whole};
                CHECK_OK(mrl_model_set_param_gather(sh, fg_start, fg_wait, &fg, 1));
                float *g_whole = calloc((size_t)n, sizeof(float));
                outside_grads og = {g_whole ? calloc((size_t)n, sizeof(float)) : NULL, 0, 0};
                mrl_model_set_grad_windows(sh, og_acquire, &og);
                mrl_model_set_grad_hook(sh, og_ready, &og);
                CHECK(mrl_model_grads(sh) == NULL && strstr(mrl_last_error(), "gradient windows") != NULL);
                for (int i = 0; i < 2; i++) {
                    mrl_model *x = i ? sh : m;
                    CHECK_OK(mrl_model_set_dtype(x, dtype ? MRL_MODEL_BF16 : MRL_MODEL_FP32));
                    mrl_model_set_recompute(x, recompute);
                    for (int rep = 0; rep < 2; rep++) { /* twice: the windows and gathers come again */
                        mrl_model_zero_grad(x);
                        CHECK_OK(mrl_model_forward(x, &b, 1.0f, lp[i], ent[i], vh ? val[i] : NULL));
                        CHECK_OK(mrl_model_backward(x, dl, dl, vh ? dl : NULL));
                        if (i == 1 && og.g) memcpy(g_whole, og.g, sizeof(float) * (size_t)n);
                    }
                }
                CHECK(fg.bad == 0 && fg.n_started == 0);
                CHECK(og.lent == og.returned && og.lent == 2 * (c.num_hidden_layers + 2));
                CHECK(memcmp(lp[0], lp[1], sizeof lp[0]) == 0 && memcmp(ent[0], ent[1], sizeof ent[0]) == 0);
                if (vh) CHECK(memcmp(val[0], val[1], sizeof val[0]) == 0);
                float *gm = mrl_model_grads(m);
                int64_t differ = 0;
                for (int64_t j = 0; gm && g_whole && j < n; j++) differ += gm[j] != g_whole[j];
                CHECK(differ == 0);
                /* the parameters' memory: the shard and at most three parts at a time (the one in
                 * use, the next, a tied head's embedding), each part the embedding, a layer or the
                 * norm and head, every one rounded out to whole pages */
                int64_t part = 0, start = 0;
                for (int i = 0, nv = mrl_model_num_views(m); i <= nv; i++) {
                    mrl_param_view v = {.offset = n};
                    if (i < nv) mrl_model_view(m, i, &v);
                    if (i == nv || strstr(v.name, "input_layernorm.weight") || strcmp(v.name, "model.norm.weight") == 0) {
                        if (v.offset - start > part) part = v.offset - start;
                        start = v.offset;
                    }
                }
                int64_t bound = 4 * cnt + 3 * (4 * part + 2 * 4096);
                CHECK(bound < 4 * n);
                /* in bf16: the parts' copies too, and the whole model's copies (2 bytes a parameter) */
                if (dtype) bound += 3 * (2 * part + 2 * 4096) + 2 * n;
                CHECK(fg.peak - s0.current[MRL_MEM_PARAMS] <= bound);
                /* saving gathers view by view: the whole model's bytes */
                snprintf(out, sizeof out, "%s/saved", dir);
                CHECK_OK(mrl_model_save_dir_sharded(sh, out, MRL_MODEL_MAX_SHARD_BYTES));
                snprintf(cmd, sizeof cmd, "%s/saved2", dir);
                CHECK_OK(mrl_model_save_dir(m, cmd));
                snprintf(cmd, sizeof cmd, "cmp -s '%s/saved/model.safetensors' '%s/saved2/model.safetensors'", dir, dir);
                CHECK(system(cmd) == 0);
                CHECK(fg.n_started == 0);
                /* read again from a directory: the saved one holds the same shard */
                CHECK_OK(mrl_model_read_shard(sh, out));
                CHECK(memcmp(mrl_model_params(sh) + off, whole + off, sizeof(float) * (size_t)cnt) == 0);
                /* bf16: the engine's compute copy, made part by part through the gathers: the bf16
                 * copies of the matrices and the head, the fp32 tensors outside them, no more */
                if (dtype) {
                    mrl_model_copy *cp = NULL;
                    CHECK(mrl_model_copy_create(m, 0, &cp) == MRL_ERR_INVALID); /* (whole parameters: none) */
                    mrl_mem_get_stats(&s1);
                    CHECK_OK(mrl_model_copy_create(sh, 0, &cp));
                    CHECK_OK(mrl_model_copy_refresh(cp));
                    CHECK(fg.bad == 0 && fg.n_started == 0);
                    const uint16_t *w16 = mrl_model_copy_bf16(cp);
                    const float *f32 = mrl_model_copy_params(cp);
                    int64_t kept = 0, bad16 = 0, bad32 = 0;
                    for (int i = 0, nv = mrl_model_num_views(m); cp && i < nv; i++) {
                        mrl_param_view v;
                        mrl_model_view(m, i, &v);
                        if (strcmp(v.name, "score.weight") == 0) continue; /* (the engine reads no value head) */
                        if (v.ndim == 2 && !strstr(v.name, "embed_tokens")) { /* a matrix: bf16 */
                            for (int64_t j = 0; j < v.numel; j++)
                                bad16 += w16[v.offset + j] != mrl_f32_to_bf16(whole[v.offset + j]);
                        } else { /* fp32 (the embedding, norms, biases) */
                            bad32 += memcmp(f32 + v.offset, whole + v.offset, sizeof(float) * (size_t)v.numel) != 0;
                            kept += v.numel;
                        }
                    }
                    CHECK(bad16 == 0 && bad32 == 0);
                    mrl_mem_stats s2;
                    mrl_mem_get_stats(&s2);
                    int64_t bytes = mrl_model_copy_bytes(cp);
                    CHECK(bytes == s2.current[MRL_MEM_PARAMS] - s1.current[MRL_MEM_PARAMS]);
                    CHECK(bytes <= 2 * n + 4 * kept + 2 * 4096 * (int64_t)(4 * c.num_hidden_layers + 4));
                    CHECK(bytes < 3 * n); /* against 4n for a whole fp32 copy */
                    /* a matrix is not there in fp32: a read faults */
                    mrl_param_view q;
                    CHECK_OK(mrl_model_find_view(m, "model.layers.3.self_attn.q_proj.weight", &q));
                    fflush(NULL);
                    pid_t p2 = fork();
                    if (p2 == 0) {
                        volatile float x = f32[q.offset + q.numel / 2];
                        (void)x;
                        _exit(0);
                    }
                    int st2 = 0;
                    waitpid(p2, &st2, 0);
                    CHECK((WIFSIGNALED(st2) && WTERMSIG(st2) == SIGSEGV) || (WIFEXITED(st2) && WEXITSTATUS(st2) != 0));
                    mrl_model_copy_free(cp);
                }
                /* outside the shard and what is gathered there is no memory: a read faults */
                fflush(NULL);
                pid_t pid = fork();
                if (pid == 0) {
                    volatile float x = mrl_model_params(sh)[0];
                    (void)x;
                    _exit(0);
                }
                int status = 0;
                waitpid(pid, &status, 0);
                /* a fault: SIGSEGV (under ASan its report and a failing exit) */
                CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV) ||
                      (WIFEXITED(status) && WEXITSTATUS(status) != 0));
                free(og.g);
                free(g_whole);
                mrl_model_free(m);
                mrl_model_free(sh);
                mrl_mem_get_stats(&s1);
                CHECK(s1.current[MRL_MEM_PARAMS] == s0.current[MRL_MEM_PARAMS] - 4 * n); /* (m's buffer gone too) */
                snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
                CHECK(system(cmd) == 0);
            }
}

int main(void) {
    test_config();
    test_model();
    test_save_load();
    test_save_sharded();
    test_save_memory();
    test_load_checks_before_alloc();
    test_load_tolerated();
    test_lazy_grads();
    test_grad_hook();
    test_sharded();
    CHECK_DONE();
}
