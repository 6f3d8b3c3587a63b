/* The model config: defaults, config.json parsing (with clear errors for
 * what moonrl does not support), validation, and writing it back as a
 * config.json that Transformers loads. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include "io/json.h"
#include "io/write.h"
#include "moonrl/model.h"
#include "base/error.h"
#include "layer.h"

void mrl_model_config_default(mrl_model_config *c) {
    memset(c, 0, sizeof *c);
    c->arch = MRL_ARCH_LLAMA;
    c->vocab_size = 256;
    c->hidden_size = 64;
    c->intermediate_size = 128;
    c->num_hidden_layers = 2;
    c->num_attention_heads = 4;
    c->num_key_value_heads = 4;
    c->head_dim = 0; /* hidden_size / num_attention_heads */
    c->max_position_embeddings = 2048;
    c->bos_token_id = -1;
    c->eos_token_id = -1;
    c->rms_norm_eps = 1e-6;
    c->rope_theta = 10000.0;
    c->rope_factor = 8.0;
    c->rope_low_freq_factor = 1.0;
    c->rope_high_freq_factor = 4.0;
    c->rope_original_max_position_embeddings = 8192;
    c->initializer_range = 0.02;
}

/* The architectures, in mrl_model_arch order: the one table of their names. */
static const mrl_arch_names arch_table[MRL_ARCH_COUNT] = {
    {"llama", "Llama", "llama"},
    {"qwen2", "Qwen2", "qwen2"},
    {"qwen3", "Qwen3", "qwen3"},
    {"qwen3_moe", "Qwen3Moe", "qwen3moe"},
    {"deepseek_v3", "DeepseekV3", "deepseek2"},
};

const mrl_arch_names *mrl_model_arch_names(int arch) {
    return arch >= 0 && arch < MRL_ARCH_COUNT ? &arch_table[arch] : NULL;
}

/* "llama, qwen2, qwen3, qwen3_moe" (numbered: "0 llama, 1 qwen2, ...") into list, for messages. */
enum { ARCH_LIST = 128 };
static const char *arch_list(char list[ARCH_LIST], int numbered) {
    size_t used = 0;
    list[0] = 0;
    for (int i = 0; i < MRL_ARCH_COUNT; i++) {
        const char *sep = i ? ", " : "", *name = arch_table[i].model_type;
        if (numbered) used += (size_t)snprintf(list + used, ARCH_LIST - used, "%s%d %s", sep, i, name);
        else used += (size_t)snprintf(list + used, ARCH_LIST - used, "%s%s", sep, name);
    }
    return list;
}

int mrl_model_layer_is_moe(const mrl_model_config *c, int l) {
    if (!c || c->num_experts <= 0 || l < 0 || l >= 1024) return 0;
    if (c->mlp_only_layers[l / 64] >> (l % 64) & 1) return 0;
    if (c->arch == MRL_ARCH_DEEPSEEK_V3) return l >= c->first_k_dense_replace;
    int step = c->decoder_sparse_step > 0 ? c->decoder_sparse_step : 1;
    return (l + 1) % step == 0;
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* An integer member: 1 found, 0 absent or null, -1 present with another type. */
static int get_int(const mrl_json *o, const char *key, int *out) {
    mrl_json *v = mrl_json_get(o, key);
    if (!v || v->type == MRL_JSON_NULL) return 0;
    if (v->type != MRL_JSON_NUMBER || !v->is_integer || v->integer < -2147483647LL || v->integer > 2147483647LL)
        return -1;
    *out = (int)v->integer;
    return 1;
}

/* A token id member: one id, or a list of them (Transformers' eos_token_id), each an integer within
 * the vocabulary ([1.5] and [1e12] once loaded as token 0); *first gets the first, -1 when absent.
 * A lone -1 is absent too: the config moonrl.model gives Lua says so, and model.new takes it back. */
static mrl_status token_ids(const mrl_json *o, const char *key, const char *source, int vocab, int *first) {
    const mrl_json *v = mrl_json_get(o, key);
    if (!v || v->type == MRL_JSON_NULL || (v->type == MRL_JSON_NUMBER && v->is_integer && v->integer == -1)) return MRL_OK;
    int list = v->type == MRL_JSON_ARRAY;
    size_t n = list ? v->length : 1;
    for (size_t i = 0; i < n; i++) {
        const mrl_json *id = list ? v->items[i] : v;
        if (id->type != MRL_JSON_NUMBER || !id->is_integer || id->integer < 0 || id->integer >= vocab) {
            char at[32] = "";
            if (list) snprintf(at, sizeof at, "[%zu]", i);
            return mrl_set_error(MRL_ERR_FORMAT, "%s: \"%s\"%s must be a token id, an integer in 0..%d (vocab_size %d)",
                                 source, key, at, vocab - 1, vocab);
        }
        if (i == 0) *first = (int)id->integer;
    }
    return MRL_OK;
}

static int get_num(const mrl_json *o, const char *key, double *out) {
    mrl_json *v = mrl_json_get(o, key);
    if (!v || v->type == MRL_JSON_NULL) return 0;
    if (v->type != MRL_JSON_NUMBER) return -1;
    *out = v->number;
    return 1;
}

static int get_bool(const mrl_json *o, const char *key, int *out) {
    mrl_json *v = mrl_json_get(o, key);
    if (!v || v->type == MRL_JSON_NULL) return 0;
    if (v->type != MRL_JSON_BOOL) return -1;
    *out = v->number != 0;
    return 1;
}

#define WANT(kind, key, ptr, required)                                                                      \
    do {                                                                                                    \
        int r_ = get_##kind(root, key, ptr);                                                                \
        if (r_ < 0) {                                                                                       \
            st = mrl_set_error(MRL_ERR_FORMAT, "%s: \"%s\" must be a%s", source, key,                       \
                               #kind[0] == 'i' ? "n integer" : #kind[0] == 'n' ? " number" : " boolean");   \
            goto done;                                                                                      \
        }                                                                                                   \
        if (r_ == 0 && (required)) {                                                                        \
            st = mrl_set_error(MRL_ERR_FORMAT, "%s: missing \"%s\"", source, key);                          \
            goto done;                                                                                      \
        }                                                                                                   \
    } while (0)

/* yarn's attention factor when config.json gives none, as Transformers infers it */
static double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * log(scale) + 1.0; }
static double yarn_attention_factor(const mrl_model_config *c) {
    if (c->rope_mscale != 0 && c->rope_mscale_all_dim != 0)
        return yarn_mscale(c->rope_factor, c->rope_mscale) / yarn_mscale(c->rope_factor, c->rope_mscale_all_dim);
    return yarn_mscale(c->rope_factor, 1);
}

float mrl_model_attn_scale(const mrl_model_config *c) {
    if (!mrl_model_is_mla(c)) return 1.0f / sqrtf((float)c->head_dim);
    double s = 1.0 / sqrt((double)(c->qk_nope_head_dim + c->qk_rope_head_dim));
    if (c->rope_scaling == MRL_ROPE_YARN && c->rope_mscale_all_dim != 0) {
        double m = yarn_mscale(c->rope_factor, c->rope_mscale_all_dim);
        s = s * m * m;
    }
    return (float)s;
}

static mrl_status parse_rope_scaling(const mrl_json *rs, const char *source, mrl_model_config *c) {
    if (!rs || rs->type == MRL_JSON_NULL) return MRL_OK;
    if (rs->type != MRL_JSON_OBJECT) return mrl_set_error(MRL_ERR_FORMAT, "%s: \"rope_scaling\" must be an object", source);
    const char *type = mrl_json_get_string(rs, "rope_type");
    if (!type) type = mrl_json_get_string(rs, "type");
    if (!type) return mrl_set_error(MRL_ERR_FORMAT, "%s: rope_scaling has no \"rope_type\"", source);
    if (strcmp(type, "default") == 0) return MRL_OK;
    const mrl_json *root = rs;
    mrl_status st = MRL_OK;
    if (strcmp(type, "yarn") == 0) { /* Transformers' _compute_yarn_parameters */
        c->rope_scaling = MRL_ROPE_YARN;
        c->rope_factor = 0, c->rope_beta_fast = 32, c->rope_beta_slow = 1, c->rope_truncate = 1;
        c->rope_mscale = c->rope_mscale_all_dim = 0;
        WANT(int, "original_max_position_embeddings", &c->rope_original_max_position_embeddings, 1);
        WANT(num, "factor", &c->rope_factor, 0);
        WANT(num, "beta_fast", &c->rope_beta_fast, 0);
        WANT(num, "beta_slow", &c->rope_beta_slow, 0);
        WANT(num, "mscale", &c->rope_mscale, 0);
        WANT(num, "mscale_all_dim", &c->rope_mscale_all_dim, 0);
        WANT(bool, "truncate", &c->rope_truncate, 0);
        double af = 0;
        WANT(num, "attention_factor", &af, 0);
        if (c->rope_original_max_position_embeddings <= 0)
            return mrl_set_error(MRL_ERR_INVALID, "%s: rope_scaling yarn needs original_max_position_embeddings > 0", source);
        if (c->rope_factor == 0) /* (DeepSeek-V3's way: the ratio of the lengths) */
            c->rope_factor = (double)c->max_position_embeddings / c->rope_original_max_position_embeddings;
        if (!(c->rope_factor > 0) || !(c->rope_beta_fast > 0) || !(c->rope_beta_slow > 0) || !(af >= 0))
            return mrl_set_error(MRL_ERR_INVALID, "%s: rope_scaling yarn needs factor, beta_fast, beta_slow > 0 and "
                                 "attention_factor >= 0", source);
        c->rope_attention_factor_given = af > 0;
        c->rope_attention_factor = af > 0 ? af : yarn_attention_factor(c);
        return MRL_OK;
    }
    if (strcmp(type, "llama3") != 0)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: rope_scaling type '%s' is not supported (llama3 or yarn)", source,
                             type);
    c->rope_scaling = MRL_ROPE_LLAMA3;
    WANT(num, "factor", &c->rope_factor, 1);
    WANT(num, "low_freq_factor", &c->rope_low_freq_factor, 1);
    WANT(num, "high_freq_factor", &c->rope_high_freq_factor, 1);
    WANT(int, "original_max_position_embeddings", &c->rope_original_max_position_embeddings, 1);
    if (!(c->rope_factor > 0) || !(c->rope_low_freq_factor > 0) || !(c->rope_high_freq_factor > c->rope_low_freq_factor) ||
        c->rope_original_max_position_embeddings <= 0)
        st = mrl_set_error(MRL_ERR_INVALID, "%s: rope_scaling llama3 needs factor > 0, high_freq_factor > low_freq_factor > 0, "
                           "original_max_position_embeddings > 0", source);
done:
    return st;
}

mrl_status mrl_model_config_parse(const char *json, size_t len, const char *source, mrl_model_config *c) {
    if (!json || !c) return mrl_set_error(MRL_ERR_INVALID, "model config: NULL argument");
    if (!source) source = "config";
    mrl_json_doc *doc = NULL;
    mrl_status st = mrl_json_parse(json, len, source, &doc);
    if (st) return st;
    const mrl_json *root = mrl_json_root(doc);
    mrl_model_config_default(c);
    if (root->type != MRL_JSON_OBJECT) {
        st = mrl_set_error(MRL_ERR_FORMAT, "%s: not a JSON object", source);
        goto done;
    }
    const char *mt = mrl_json_get_string(root, "model_type");
    const mrl_json *archs = mrl_json_get(root, "architectures");
    const char *arch0 = archs && archs->type == MRL_JSON_ARRAY && archs->length > 0 && archs->items[0]->type == MRL_JSON_STRING
                            ? archs->items[0]->string : NULL;
    if (!mt) { /* the architecture whose class stem is the longest prefix of the class: Qwen3Moe before Qwen3 */
        size_t best = 0;
        for (int i = 0; arch0 && i < MRL_ARCH_COUNT; i++) {
            size_t n = strlen(arch_table[i].hf_class);
            if (n > best && strncmp(arch0, arch_table[i].hf_class, n) == 0) mt = arch_table[i].model_type, best = n;
        }
        if (!mt) {
            st = mrl_set_error(MRL_ERR_FORMAT, "%s: no \"model_type\"", source);
            goto done;
        }
    }
    if (strcmp(mt, "kimi_k2") == 0) mt = "deepseek_v3"; /* (Kimi K2: DeepseekV3ForCausalLM, written back as such) */
    int found = 0;
    for (int i = 0; i < MRL_ARCH_COUNT; i++)
        if (strcmp(mt, arch_table[i].model_type) == 0) c->arch = i, found = 1;
    if (!found) {
        char list[ARCH_LIST];
        st = mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: model_type '%s' is not supported (%s)", source, mt, arch_list(list, 0));
        goto done;
    }
    if (arch0) {
        if (ends_with(arch0, "ForSequenceClassification")) c->value_head = 1;
        else if (!ends_with(arch0, "ForCausalLM")) {
            st = mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: architecture '%s' is not supported", source, arch0);
            goto done;
        }
    }
    WANT(int, "vocab_size", &c->vocab_size, 1);
    WANT(int, "hidden_size", &c->hidden_size, 1);
    WANT(int, "intermediate_size", &c->intermediate_size, 1);
    WANT(int, "num_hidden_layers", &c->num_hidden_layers, 1);
    WANT(int, "num_attention_heads", &c->num_attention_heads, 1);
    c->num_key_value_heads = c->num_attention_heads;
    WANT(int, "num_key_value_heads", &c->num_key_value_heads, 0);
    WANT(int, "head_dim", &c->head_dim, 0);
    WANT(int, "max_position_embeddings", &c->max_position_embeddings, 0);
    WANT(num, "rms_norm_eps", &c->rms_norm_eps, 0);
    WANT(num, "rope_theta", &c->rope_theta, 0);
    WANT(num, "initializer_range", &c->initializer_range, 0);
    WANT(bool, "tie_word_embeddings", &c->tie_word_embeddings, 0);
    WANT(bool, "moonrl_value_head", &c->value_head, 0);
    if ((st = token_ids(root, "bos_token_id", source, c->vocab_size, &c->bos_token_id))) goto done;
    if ((st = token_ids(root, "eos_token_id", source, c->vocab_size, &c->eos_token_id))) goto done;
    int num_labels = 1;
    WANT(int, "num_labels", &num_labels, 0);
    if (c->value_head && num_labels != 1) {
        st = mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: num_labels %d: only a scalar value head (num_labels 1) is supported", source, num_labels);
        goto done;
    }
    const char *act = mrl_json_get_string(root, "hidden_act");
    if (act && strcmp(act, "silu") != 0) {
        st = mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: hidden_act '%s' is not supported (only 'silu')", source, act);
        goto done;
    }
    if (c->arch == MRL_ARCH_QWEN3_MOE) { /* Transformers' Qwen3MoeConfig defaults where a key is absent */
        c->num_experts = 128, c->num_experts_per_tok = 8, c->moe_intermediate_size = 768;
        c->decoder_sparse_step = 1, c->router_aux_loss_coef = 0.001;
        WANT(int, "num_experts", &c->num_experts, 0);
        WANT(int, "num_experts_per_tok", &c->num_experts_per_tok, 0);
        WANT(int, "moe_intermediate_size", &c->moe_intermediate_size, 0);
        WANT(bool, "norm_topk_prob", &c->norm_topk_prob, 0);
        WANT(int, "decoder_sparse_step", &c->decoder_sparse_step, 0);
        WANT(bool, "output_router_logits", &c->output_router_logits, 0);
        WANT(num, "router_aux_loss_coef", &c->router_aux_loss_coef, 0);
        const mrl_json *only = mrl_json_get(root, "mlp_only_layers");
        if (only && only->type != MRL_JSON_NULL && only->type != MRL_JSON_ARRAY) {
            st = mrl_set_error(MRL_ERR_FORMAT, "%s: \"mlp_only_layers\" must be a list of layer indices", source);
            goto done;
        }
        for (size_t i = 0; only && only->type == MRL_JSON_ARRAY && i < only->length; i++) {
            const mrl_json *v = only->items[i];
            if (v->type != MRL_JSON_NUMBER || !v->is_integer || v->integer < 0 || v->integer >= 1024) {
                st = mrl_set_error(MRL_ERR_FORMAT, "%s: mlp_only_layers[%zu] must be a layer index in 0..1023", source, i);
                goto done;
            }
            c->mlp_only_layers[v->integer / 64] |= (uint64_t)1 << (v->integer % 64);
        }
    }
    if (mrl_model_is_mla(c)) { /* Transformers' DeepseekV3Config defaults where a key is absent */
        c->q_lora_rank = 1536, c->kv_lora_rank = 512, c->qk_nope_head_dim = 128, c->qk_rope_head_dim = 64;
        c->v_head_dim = 128, c->rope_interleave = 1;
        const mrl_json *qr = mrl_json_get(root, "q_lora_rank");
        if (qr && qr->type == MRL_JSON_NULL) c->q_lora_rank = 0; /* (null: q_proj, no low-rank queries) */
        else WANT(int, "q_lora_rank", &c->q_lora_rank, 0);
        WANT(int, "kv_lora_rank", &c->kv_lora_rank, 0);
        WANT(int, "qk_nope_head_dim", &c->qk_nope_head_dim, 0);
        WANT(int, "qk_rope_head_dim", &c->qk_rope_head_dim, 0);
        WANT(int, "v_head_dim", &c->v_head_dim, 0);
        WANT(bool, "rope_interleave", &c->rope_interleave, 0);
        if (c->num_key_value_heads != c->num_attention_heads) {
            st = mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: num_key_value_heads %d differs from num_attention_heads %d (MLA "
                               "makes every head's keys and values: they must be equal)", source,
                               c->num_key_value_heads, c->num_attention_heads);
            goto done;
        }
        int qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
        c->head_dim = qk > c->v_head_dim ? qk : c->v_head_dim; /* (the attention's padded head; "head_dim" unread) */
        /* the mixture of experts: none when first_k_dense_replace covers every layer */
        c->num_experts = 256, c->num_experts_per_tok = 8, c->moe_intermediate_size = 2048, c->n_shared_experts = 1;
        c->n_group = 8, c->topk_group = 4, c->routed_scaling_factor = 2.5, c->norm_topk_prob = 1;
        c->first_k_dense_replace = 3, c->decoder_sparse_step = 1;
        WANT(int, "n_routed_experts", &c->num_experts, 0);
        WANT(int, "num_experts_per_tok", &c->num_experts_per_tok, 0);
        WANT(int, "moe_intermediate_size", &c->moe_intermediate_size, 0);
        WANT(int, "n_shared_experts", &c->n_shared_experts, 0);
        WANT(int, "n_group", &c->n_group, 0);
        WANT(int, "topk_group", &c->topk_group, 0);
        WANT(num, "routed_scaling_factor", &c->routed_scaling_factor, 0);
        WANT(bool, "norm_topk_prob", &c->norm_topk_prob, 0);
        WANT(int, "first_k_dense_replace", &c->first_k_dense_replace, 0);
        const char *scoring = mrl_json_get_string(root, "scoring_func"), *method = mrl_json_get_string(root, "topk_method");
        if ((scoring && strcmp(scoring, "sigmoid")) || (method && strcmp(method, "noaux_tc"))) {
            st = mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: %s '%s' is not supported (DeepSeek-V3's: scoring_func "
                               "'sigmoid', topk_method 'noaux_tc')", source, scoring && strcmp(scoring, "sigmoid")
                               ? "scoring_func" : "topk_method", scoring && strcmp(scoring, "sigmoid") ? scoring : method);
            goto done;
        }
        WANT(int, "num_nextn_predict_layers", &c->num_nextn_predict_layers, 0);
        if (c->first_k_dense_replace >= c->num_hidden_layers) /* every layer dense: no experts */
            c->num_experts = c->num_experts_per_tok = c->moe_intermediate_size = c->n_shared_experts = 0,
            c->n_group = c->topk_group = 0, c->routed_scaling_factor = 0, c->norm_topk_prob = 0,
            c->first_k_dense_replace = 0;
    }
    int flag = 0;
    WANT(bool, "attention_bias", &flag, 0);
    if (flag && c->arch != MRL_ARCH_QWEN2) {
        st = mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: attention_bias true is not supported for %s", source, mt);
        goto done;
    }
    c->attention_bias = c->arch == MRL_ARCH_QWEN2;
    flag = 0;
    WANT(bool, "mlp_bias", &flag, 0);
    if (flag) {
        st = mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: mlp_bias true is not supported", source);
        goto done;
    }
    flag = 0;
    WANT(bool, "use_sliding_window", &flag, 0);
    if (flag) {
        st = mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: use_sliding_window true (sliding-window attention) is not supported", source);
        goto done;
    }
    const mrl_json *types = mrl_json_get(root, "layer_types"); /* newer configs: one attention kind a layer */
    if (types && types->type == MRL_JSON_ARRAY)
        for (size_t i = 0; i < types->length; i++)
            if (types->items[i]->type != MRL_JSON_STRING || strcmp(types->items[i]->string, "full_attention") != 0) {
                st = mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: layer_types[%zu] is not \"full_attention\" (sliding-window "
                                   "attention is not supported)", source, i);
                goto done;
            }
    /* Transformers 5 keeps rope_theta and the scaling in "rope_parameters" */
    const mrl_json *rp = mrl_json_get(root, "rope_parameters");
    if (rp && rp->type == MRL_JSON_OBJECT) {
        const mrl_json *outer = root;
        root = rp;
        WANT(num, "rope_theta", &c->rope_theta, 0);
        root = outer;
    }
    st = parse_rope_scaling(rp && rp->type == MRL_JSON_OBJECT ? rp : mrl_json_get(root, "rope_scaling"), source, c);
    if (st) goto done;
    if (c->head_dim == 0 && c->num_attention_heads > 0) c->head_dim = c->hidden_size / c->num_attention_heads;
    st = mrl_model_config_validate(c);
done:
    mrl_json_free(doc);
    return st;
}

mrl_status mrl_model_config_load(const char *path, mrl_model_config *c) {
    if (!path) return mrl_set_error(MRL_ERR_INVALID, "model config: NULL path");
    FILE *f;
    mrl_status opened = mrl_io_fopen_read(path, &f);
    if (opened) return opened;
    char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf, f);
    int big = !feof(f);
    fclose(f);
    if (big) return mrl_set_error(MRL_ERR_FORMAT, "%s: larger than 64 KiB, not a config.json", path);
    return mrl_model_config_parse(buf, n, path, c);
}

mrl_status mrl_model_config_validate(const mrl_model_config *c) {
    if (!c) return mrl_set_error(MRL_ERR_INVALID, "model config: NULL");
#define POS(field, max)                                                                                         \
    if (c->field <= 0 || c->field > (max))                                                                       \
        return mrl_set_error(MRL_ERR_INVALID, "model config: " #field " = %d (must be in 1..%d)", c->field, (max));
    POS(vocab_size, 1 << 24)
    POS(hidden_size, 1 << 16)
    POS(intermediate_size, 1 << 18)
    POS(num_hidden_layers, 1024)
    POS(num_attention_heads, 1024)
    POS(num_key_value_heads, 1024)
    POS(head_dim, 1024)
#undef POS
    if (!mrl_model_arch_names(c->arch)) {
        char list[ARCH_LIST];
        return mrl_set_error(MRL_ERR_INVALID, "model config: arch = %d (%s)", c->arch, arch_list(list, 1));
    }
    if (c->arch == MRL_ARCH_QWEN3_MOE) {
        if (c->num_experts <= 0 || c->num_experts > 4096)
            return mrl_set_error(MRL_ERR_INVALID, "model config: num_experts = %d (must be in 1..4096)", c->num_experts);
        if (c->num_experts_per_tok <= 0 || c->num_experts_per_tok > c->num_experts)
            return mrl_set_error(MRL_ERR_INVALID, "model config: num_experts_per_tok = %d (must be in 1..num_experts = %d)",
                                 c->num_experts_per_tok, c->num_experts);
        if (c->moe_intermediate_size <= 0 || c->moe_intermediate_size > (1 << 18))
            return mrl_set_error(MRL_ERR_INVALID, "model config: moe_intermediate_size = %d (must be in 1..%d)",
                                 c->moe_intermediate_size, 1 << 18);
        if (c->decoder_sparse_step <= 0)
            return mrl_set_error(MRL_ERR_INVALID, "model config: decoder_sparse_step = %d (must be >= 1)", c->decoder_sparse_step);
        if (!(c->router_aux_loss_coef >= 0))
            return mrl_set_error(MRL_ERR_INVALID, "model config: router_aux_loss_coef must be >= 0");
    } else if (c->arch == MRL_ARCH_DEEPSEEK_V3 && c->num_experts != 0) {
        int E = c->num_experts, G = c->n_group;
        if (E < 0 || E > 4096 || G < 1 || E % G || E / G < 2 || c->topk_group < 1 || c->topk_group > G)
            return mrl_set_error(MRL_ERR_INVALID, "model config: n_routed_experts = %d in n_group = %d groups, topk_group "
                                 "= %d (at most 4096 experts, at least 2 a group, 1 <= topk_group <= n_group)", E, G,
                                 c->topk_group);
        if (c->num_experts_per_tok < 1 || c->num_experts_per_tok > c->topk_group * (E / G))
            return mrl_set_error(MRL_ERR_INVALID, "model config: num_experts_per_tok = %d (must be in 1..%d, the experts "
                                 "of topk_group groups)", c->num_experts_per_tok, c->topk_group * (E / G));
        if (c->moe_intermediate_size <= 0 || c->moe_intermediate_size > (1 << 18) || c->n_shared_experts < 0 ||
            c->n_shared_experts > 64)
            return mrl_set_error(MRL_ERR_INVALID, "model config: moe_intermediate_size = %d, n_shared_experts = %d (must "
                                 "be in 1..%d and 0..64)", c->moe_intermediate_size, c->n_shared_experts, 1 << 18);
        if (!(c->routed_scaling_factor > 0) || !isfinite(c->routed_scaling_factor) || c->first_k_dense_replace < 0)
            return mrl_set_error(MRL_ERR_INVALID, "model config: routed_scaling_factor must be a finite number > 0 and "
                                 "first_k_dense_replace >= 0");
    } else if (c->num_experts != 0) {
        return mrl_set_error(MRL_ERR_INVALID, "model config: num_experts = %d for a dense architecture (experts are "
                             "qwen3_moe's and deepseek_v3's)", c->num_experts);
    }
    if (mrl_model_is_mla(c)) {
        int dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim;
        if (c->kv_lora_rank <= 0 || c->kv_lora_rank > (1 << 16) || c->q_lora_rank < 0 || c->q_lora_rank > (1 << 16))
            return mrl_set_error(MRL_ERR_INVALID, "model config: kv_lora_rank = %d, q_lora_rank = %d (must be in 1..65536 "
                                 "and 0..65536, 0: no low-rank queries)", c->kv_lora_rank, c->q_lora_rank);
        if (dn < 0 || dn > 1024 || dr <= 0 || dr > 1024 || dr % 2 || dv <= 0 || dv > 1024)
            return mrl_set_error(MRL_ERR_INVALID, "model config: qk_nope_head_dim = %d, qk_rope_head_dim = %d, v_head_dim "
                                 "= %d (must be in 0..1024, an even 2..1024 and 1..1024)", dn, dr, dv);
        int hd = dn + dr > dv ? dn + dr : dv;
        if (c->head_dim != hd || c->num_key_value_heads != c->num_attention_heads || c->attention_bias)
            return mrl_set_error(MRL_ERR_INVALID, "model config: deepseek_v3 needs head_dim = max(qk_nope_head_dim + "
                                 "qk_rope_head_dim, v_head_dim) = %d (has %d), num_key_value_heads = "
                                 "num_attention_heads and no attention_bias", hd, c->head_dim);
        if (c->num_nextn_predict_layers < 0 || c->num_nextn_predict_layers > 1)
            return mrl_set_error(MRL_ERR_UNSUPPORTED, "model config: num_nextn_predict_layers = %d (0 or 1 multi-token "
                                 "prediction layer)", c->num_nextn_predict_layers);
    } else if (c->q_lora_rank || c->kv_lora_rank || c->qk_nope_head_dim || c->qk_rope_head_dim || c->v_head_dim ||
               c->num_nextn_predict_layers) {
        return mrl_set_error(MRL_ERR_INVALID, "model config: q_lora_rank, kv_lora_rank, qk_*_head_dim, v_head_dim "
                             "and num_nextn_predict_layers are deepseek_v3's: 0 for %s", arch_table[c->arch].model_type);
    }
    if (c->num_attention_heads % c->num_key_value_heads)
        return mrl_set_error(MRL_ERR_INVALID, "model config: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                             c->num_attention_heads, c->num_key_value_heads);
    if (c->head_dim % 2) return mrl_set_error(MRL_ERR_INVALID, "model config: head_dim %d must be even (RoPE)", c->head_dim);
    if (c->attention_bias && c->arch != MRL_ARCH_QWEN2)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "model config: attention_bias is supported for qwen2 only");
    /* finite: 1e999 reads as inf, which config.json cannot hold (to_json would write "inf") */
    const struct { const char *name; double v; } reals[] = {
        {"rms_norm_eps", c->rms_norm_eps}, {"rope_theta", c->rope_theta}, {"initializer_range", c->initializer_range},
        {"rope_scaling.factor", c->rope_factor}, {"rope_scaling.low_freq_factor", c->rope_low_freq_factor},
        {"rope_scaling.high_freq_factor", c->rope_high_freq_factor}, {"router_aux_loss_coef", c->router_aux_loss_coef},
        {"rope_scaling.beta_fast", c->rope_beta_fast}, {"rope_scaling.beta_slow", c->rope_beta_slow},
        {"rope_scaling.attention_factor", c->rope_attention_factor}, {"rope_scaling.mscale", c->rope_mscale},
        {"rope_scaling.mscale_all_dim", c->rope_mscale_all_dim}};
    for (size_t i = 0; i < sizeof reals / sizeof *reals; i++)
        if (!isfinite(reals[i].v))
            return mrl_set_error(MRL_ERR_INVALID, "model config: %s = %g (must be a finite number)", reals[i].name, reals[i].v);
    if (!(c->rms_norm_eps > 0) || !(c->rope_theta > 0) || !(c->initializer_range >= 0))
        return mrl_set_error(MRL_ERR_INVALID, "model config: rms_norm_eps, rope_theta must be > 0 and initializer_range >= 0");
    if (c->rope_scaling != MRL_ROPE_NONE && c->rope_scaling != MRL_ROPE_LLAMA3 && c->rope_scaling != MRL_ROPE_YARN)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "model config: rope_scaling = %d", c->rope_scaling);
    if (c->rope_scaling == MRL_ROPE_YARN && (!(c->rope_factor > 0) || !(c->rope_beta_fast > 0) ||
                                             !(c->rope_beta_slow > 0) || !(c->rope_attention_factor > 0) ||
                                             c->rope_original_max_position_embeddings <= 0))
        return mrl_set_error(MRL_ERR_INVALID, "model config: rope_scaling yarn needs factor, beta_fast, beta_slow, "
                             "attention_factor and original_max_position_embeddings > 0");
    return MRL_OK;
}

typedef struct out_buf {
    char *buf;
    size_t cap, len;
} out_buf;

static void put(out_buf *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(out_buf *o, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    size_t room = o->len < o->cap ? o->cap - o->len : 0;
    int n = vsnprintf(room ? o->buf + o->len : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0) o->len += (size_t)n;
}

mrl_status mrl_model_config_to_json(const mrl_model_config *c, char *buf, size_t cap, size_t *len) {
    mrl_status st = mrl_model_config_validate(c);
    if (st) return st;
    out_buf o = {buf, cap, 0};
    const char *mt = arch_table[c->arch].model_type;
    put(&o, "{\n  \"architectures\": [\"%s%s\"],\n  \"model_type\": \"%s\",\n", arch_table[c->arch].hf_class,
        c->value_head ? "ForSequenceClassification" : "ForCausalLM", mt);
    put(&o, "  \"vocab_size\": %d,\n  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n", c->vocab_size,
        c->hidden_size, c->intermediate_size);
    put(&o, "  \"num_hidden_layers\": %d,\n  \"num_attention_heads\": %d,\n  \"num_key_value_heads\": %d,\n",
        c->num_hidden_layers, c->num_attention_heads, c->num_key_value_heads);
    put(&o, "  \"head_dim\": %d,\n  \"max_position_embeddings\": %d,\n", mrl_model_rope_dim(c), /* (MLA: Transformers') */
        c->max_position_embeddings);
    put(&o, "  \"hidden_act\": \"silu\",\n  \"rms_norm_eps\": %.17g,\n  \"rope_theta\": %.17g,\n", c->rms_norm_eps,
        c->rope_theta);
    if (c->rope_scaling == MRL_ROPE_LLAMA3)
        put(&o, "  \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": %.17g, \"low_freq_factor\": %.17g, "
                "\"high_freq_factor\": %.17g, \"original_max_position_embeddings\": %d},\n",
            c->rope_factor, c->rope_low_freq_factor, c->rope_high_freq_factor, c->rope_original_max_position_embeddings);
    else if (c->rope_scaling == MRL_ROPE_YARN) {
        put(&o, "  \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": %.17g, \"original_max_position_embeddings\": %d, "
                "\"beta_fast\": %.17g, \"beta_slow\": %.17g, \"truncate\": %s", c->rope_factor,
            c->rope_original_max_position_embeddings, c->rope_beta_fast, c->rope_beta_slow,
            c->rope_truncate ? "true" : "false");
        if (c->rope_mscale != 0) put(&o, ", \"mscale\": %.17g", c->rope_mscale);
        if (c->rope_mscale_all_dim != 0) put(&o, ", \"mscale_all_dim\": %.17g", c->rope_mscale_all_dim);
        if (c->rope_attention_factor_given) put(&o, ", \"attention_factor\": %.17g", c->rope_attention_factor);
        put(&o, "},\n");
    } else
        put(&o, "  \"rope_scaling\": null,\n");
    put(&o, "  \"initializer_range\": %.17g,\n  \"tie_word_embeddings\": %s,\n", c->initializer_range,
        c->tie_word_embeddings ? "true" : "false");
    if (c->arch == MRL_ARCH_LLAMA) put(&o, "  \"attention_bias\": false,\n  \"mlp_bias\": false,\n");
    if (c->arch == MRL_ARCH_QWEN3 || c->arch == MRL_ARCH_QWEN3_MOE) put(&o, "  \"attention_bias\": false,\n");
    if (c->arch == MRL_ARCH_QWEN3_MOE) {
        put(&o, "  \"num_experts\": %d,\n  \"num_experts_per_tok\": %d,\n  \"moe_intermediate_size\": %d,\n",
            c->num_experts, c->num_experts_per_tok, c->moe_intermediate_size);
        put(&o, "  \"norm_topk_prob\": %s,\n  \"decoder_sparse_step\": %d,\n  \"mlp_only_layers\": [",
            c->norm_topk_prob ? "true" : "false", c->decoder_sparse_step);
        for (int l = 0, n = 0; l < 1024; l++)
            if (c->mlp_only_layers[l / 64] >> (l % 64) & 1) put(&o, "%s%d", n++ ? ", " : "", l);
        put(&o, "],\n  \"router_aux_loss_coef\": %.17g,\n  \"output_router_logits\": %s,\n", c->router_aux_loss_coef,
            c->output_router_logits ? "true" : "false");
    }
    if (mrl_model_is_mla(c)) { /* (every layer dense: first_k_dense_replace covers them all) */
        if (c->q_lora_rank) put(&o, "  \"q_lora_rank\": %d,\n", c->q_lora_rank);
        else put(&o, "  \"q_lora_rank\": null,\n");
        put(&o, "  \"kv_lora_rank\": %d,\n  \"qk_nope_head_dim\": %d,\n  \"qk_rope_head_dim\": %d,\n  \"v_head_dim\": %d,\n",
            c->kv_lora_rank, c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim);
        put(&o, "  \"rope_interleave\": %s,\n  \"attention_bias\": false,\n  \"num_nextn_predict_layers\": %d,\n",
            c->rope_interleave ? "true" : "false", c->num_nextn_predict_layers);
        if (c->num_experts) {
            put(&o, "  \"first_k_dense_replace\": %d,\n  \"n_routed_experts\": %d,\n  \"n_shared_experts\": %d,\n",
                c->first_k_dense_replace, c->num_experts, c->n_shared_experts);
            put(&o, "  \"num_experts_per_tok\": %d,\n  \"n_group\": %d,\n  \"topk_group\": %d,\n  "
                    "\"moe_intermediate_size\": %d,\n", c->num_experts_per_tok, c->n_group, c->topk_group,
                c->moe_intermediate_size);
            put(&o, "  \"routed_scaling_factor\": %.17g,\n  \"norm_topk_prob\": %s,\n  \"scoring_func\": \"sigmoid\",\n"
                    "  \"topk_method\": \"noaux_tc\",\n", c->routed_scaling_factor, c->norm_topk_prob ? "true" : "false");
        } else { /* (every layer dense: first_k_dense_replace covers them all) */
            put(&o, "  \"first_k_dense_replace\": %d,\n  \"n_routed_experts\": 2,\n  \"n_shared_experts\": 1,\n  "
                    "\"num_experts_per_tok\": 1,\n  \"n_group\": 1,\n  \"topk_group\": 1,\n  "
                    "\"moe_intermediate_size\": %d,\n", c->num_hidden_layers, c->intermediate_size);
        }
    }
    if (c->arch != MRL_ARCH_LLAMA && !mrl_model_is_mla(c))
        put(&o, "  \"use_sliding_window\": false,\n  \"max_window_layers\": %d,\n", c->num_hidden_layers);
    if (c->value_head) put(&o, "  \"num_labels\": 1,\n  \"id2label\": {\"0\": \"LABEL_0\"},\n  \"label2id\": {\"LABEL_0\": 0},\n");
    if (c->bos_token_id >= 0) put(&o, "  \"bos_token_id\": %d,\n", c->bos_token_id);
    if (c->eos_token_id >= 0) put(&o, "  \"eos_token_id\": %d,\n", c->eos_token_id);
    put(&o, "  \"attention_dropout\": 0.0,\n  \"use_cache\": true,\n  \"torch_dtype\": \"float32\"\n}\n");
    if (len) *len = o.len;
    if (o.len + 1 > cap) return mrl_set_error(MRL_ERR_INVALID, "model config: %zu bytes needed for the JSON, buffer holds %zu", o.len + 1, cap);
    return MRL_OK;
}
