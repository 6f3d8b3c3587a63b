/* Loading and saving Hugging Face model directories: config.json plus
 * safetensors (one file or shards, through moonrl/safetensors.h).
 *
 * Load: every parameter view the config implies is first checked against
 * the file's tensor names and shapes, and only then is the parameter buffer
 * allocated (a config.json larger than its weights is an error, not
 * gigabytes allocated); each view is then read by its Hugging Face name
 * (F32, BF16 or F16 converted to fp32). Tolerated: a stored
 * lm_head.weight in a tied model (ignored), *.rotary_emb.inv_freq buffers
 * (ignored); for a value-head model without score.weight (a policy
 * checkpoint turned critic) the score gets the documented init (seed 0),
 * and a ...ForSequenceClassification checkpoint without lm_head.weight gets
 * a copy of the embedding. Any other missing or extra tensor is an error.
 * Save: config.json and the weights in F32 (metadata format "pt", as
 * Transformers expects), streamed tensor by tensor into model.safetensors
 * or, past the shard limit, model-0000K-of-0000N.safetensors shards with
 * model.safetensors.index.json; each file written atomically. */
#include <stdio.h>
#include <string.h>
#include "moonrl/dist.h"
#include "moonrl/fs.h"
#include "moonrl/safetensors.h"
#include "moonrl/mem.h"
#include "model_internal.h"
#include "base/error.h"

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* "[a, b, c]" */
static const char *shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++) n += (size_t)snprintf(buf + n, cap - n, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
    return buf;
}

/* The views are absent from the file where tolerated (see the top). */
static int may_be_missing(const mrl_model *m, const char *name) {
    return strcmp(name, "score.weight") == 0 || (strcmp(name, "lm_head.weight") == 0 && m->cfg.value_head);
}

/* The whole tensor's shape of view v (a tensor-parallel rank's: its slice's times the ranks). */
static void whole_shape(const mrl_model *m, const mrl_param_view *v, int64_t shape[2]) {
    shape[0] = v->shape[0], shape[1] = v->ndim > 1 ? v->shape[1] : 0;
    int split = mrl_model_tp_split(m, v->name);
    if (split) shape[split - 1] *= m->tp_size / mrl_model_tp_copies(m, v->name);
}

/* A pipeline stage: 1 when the file's tensor `name` is another stage's part. */
static int other_stage(const mrl_model *m, const char *name) {
    if (m->pp_stages <= 1) return 0;
    int l;
    if (sscanf(name, "model.layers.%d.", &l) == 1) return l < m->pp_l0 || l >= m->pp_l0 + m->cfg.num_hidden_layers;
    if (strcmp(name, "model.embed_tokens.weight") == 0) return m->embed == NULL;
    return !mrl_model_has_head(m); /* the final norm, the head, a value head */
}

/* Every view the config implies against the file's names and shapes, and
 * every tensor of the file against the views: before any parameter memory
 * is allocated, so that a config.json larger than its weights costs
 * nothing (m has its views only, mrl_model_alloc_layout). */
static mrl_status check_tensors(const mrl_model *m, mrl_st *st, const char *dir) {
    for (int i = 0; i < m->n_views; i++) {
        const mrl_param_view *v = &m->views[i];
        if (!mrl_st_has(st, v->name)) {
            if (may_be_missing(m, v->name)) continue;
            return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s' is missing", dir, v->name);
        }
        mrl_st_tensor t;
        mrl_status s = mrl_st_find(st, v->name, &t);
        if (s) return s;
        int64_t shape[2];
        whole_shape(m, v, shape);
        int same = t.ndim == v->ndim && t.shape[0] == shape[0] && (v->ndim == 1 || t.shape[1] == shape[1]);
        if (!same) {
            char got[256], want[64];
            return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s' has shape %s, the config implies %s", dir, v->name,
                                 shape_str(got, sizeof got, t.ndim, t.shape), shape_str(want, sizeof want, v->ndim, shape));
        }
    }
    /* anything else in the checkpoint is a part this model does not have */
    for (int64_t i = 0; i < mrl_st_count(st); i++) {
        mrl_st_tensor t;
        mrl_status s = mrl_st_info(st, i, &t);
        if (s) return s;
        if (ends_with(t.name, "rotary_emb.inv_freq")) continue;
        if (strcmp(t.name, "lm_head.weight") == 0 && m->cfg.tie_word_embeddings) continue;
        if (other_stage(m, t.name)) continue;
        mrl_param_view v;
        if (mrl_model_find_view(m, t.name, &v) != MRL_OK)
            return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: tensor '%s' has no place in a %s model with this config",
                                 dir, t.name, mrl_model_arch_names(m->cfg.arch)->model_type);
    }
    mrl_clear_error();
    return MRL_OK;
}

/* Elements [a, b) of a tensor-parallel rank's slice of view v (its rows or columns of the file's
 * tensor `from`, v's own or the embedding in place of a value-head model's missing lm_head): all
 * of it, or the part a ZeRO-3 shard holds. */
static mrl_status read_tp_slice(const mrl_model *m, mrl_st *st, const mrl_param_view *v, const char *from, int64_t a,
                                int64_t b, float *dst) {
    if (mrl_model_tp_split(m, v->name) == 1) /* rows: one range (a K/V head held by several ranks: theirs) */
        return mrl_st_read_f32_range(st, from, (int64_t)(m->tp_rank / mrl_model_tp_copies(m, v->name)) * v->numel + a,
                                     b - a, dst);
    int64_t cols = v->shape[1]; /* columns: a range of each row, or of the rows [a, b) reaches */
    for (int64_t e = a; e < b;) {
        int64_t row = e / cols, c0 = e % cols, run = cols - c0 < b - e ? cols - c0 : b - e;
        mrl_status s = mrl_st_read_f32_range(st, from, row * cols * m->tp_size + m->tp_rank * cols + c0, run, dst + (e - a));
        if (s) return s;
        e += run;
    }
    return MRL_OK;
}

/* Fill parameters [lo, hi) (shapes checked by check_tensors): each view's part in the range,
 * read by range (a sharded model's buffer has memory there only; a GPU's, through a host buffer
 * of the largest part, reused). */
static mrl_status read_weights(mrl_model *m, mrl_st *st, int64_t lo, int64_t hi) {
    float *stage = NULL;
    int64_t stage_n = 0;
    mrl_status s = MRL_OK;
    for (int i = 0; !s && i < m->n_views; i++) {
        const mrl_param_view *v = &m->views[i];
        int64_t a = v->offset > lo ? v->offset : lo, b = v->offset + v->numel < hi ? v->offset + v->numel : hi;
        if (b <= a) continue;
        float *dst = m->params + a;
        if (m->k->on_device) {
            if (stage_n < b - a) {
                mrl_mem_free(stage);
                if (!(stage = mrl_mem_alloc(sizeof(float) * (size_t)(b - a), MRL_MEM_OTHER)))
                    return mrl_wrap_error(MRL_ERR_NOMEM, "model: a host buffer for %s", v->name);
                stage_n = b - a;
            }
            dst = stage;
        }
        const char *from = v->name;
        if (!mrl_st_has(st, v->name)) { /* may_be_missing */
            if (strcmp(v->name, "score.weight") == 0) { /* the documented init, then its part */
                float *tmp = mrl_mem_alloc(sizeof(float) * (size_t)v->numel, MRL_MEM_OTHER);
                if (!tmp) {
                    s = mrl_wrap_error(MRL_ERR_NOMEM, "model: the init of %s", v->name);
                    break;
                }
                uint64_t seed = 0;
                mrl_model_init_view(m, v, &seed, tmp);
                memcpy(dst, tmp + (a - v->offset), sizeof(float) * (size_t)(b - a));
                mrl_mem_free(tmp);
                from = NULL;
            } else {
                from = "model.embed_tokens.weight"; /* lm_head.weight of a value-head model: the embedding */
            }
        }
        if (from && mrl_model_tp_split(m, v->name)) s = read_tp_slice(m, st, v, from, a - v->offset, b - v->offset, dst);
        else if (from) s = mrl_st_read_f32_range(st, from, a - v->offset, b - a, dst);
        if (!s && dst == stage) s = m->k->to_device(m->params + a, stage, (int64_t)sizeof(float) * (b - a));
    }
    mrl_mem_free(stage);
    return s;
}

/* A tensor-parallel rank's config (rank of size: the heads and the MLP divided) from the whole
 * model's; the sizes it cannot divide are errors naming the key. Fewer K/V heads than ranks (a
 * divisor of them): one K/V head a rank, held by *kv_copies ranks. A vocabulary size divides
 * is split (*vocab 1), else the embedding and head stay whole (Megatron pads the vocabulary
 * instead: Hugging Face's are multiples of 64 or more, which the usual sizes divide). */
static mrl_status tp_config(const char *dir, int size, mrl_model_config *c, int *kv_copies, int *vocab) {
    *kv_copies = 1;
    if (c->num_key_value_heads < size && size % c->num_key_value_heads == 0) {
        *kv_copies = size / c->num_key_value_heads;
        c->num_key_value_heads = size; /* (divided below: one a rank) */
    }
    /* a mixture of experts: each expert's MLP split as the dense one is (moe.c), and the dense
     * MLP's size only where some layer has one */
    int dense = 0, sparse = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        int moe = mrl_model_layer_is_moe(c, l);
        sparse |= moe, dense |= !moe;
    }
    const char *keys[4] = {"num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size"};
    int *values[4] = {&c->num_attention_heads, &c->num_key_value_heads, &c->intermediate_size,
                      &c->moe_intermediate_size};
    int used[4] = {1, 1, dense, sparse};
    for (int i = 0; i < 4; i++)
        if (used[i] && *values[i] % size)
            return mrl_set_error(MRL_ERR_INVALID, "%s: tensor parallel over %d ranks: %s (%d) is not a multiple of %d%s",
                                 dir, size, keys[i], *values[i], size,
                                 i == 1 ? " (nor a divisor of it, which would share each K/V head)" : "");
    for (int i = 0; i < 4; i++)
        if (used[i]) *values[i] /= size;
    *vocab = c->vocab_size % size == 0;
    if (*vocab) c->vocab_size /= size;
    return MRL_OK;
}

/* config.json, the files opened and checked against the layout (no parameter memory yet);
 * tp_size > 1: rank tp_rank's slices (mrl_model_load_dir_tp). */
static mrl_status open_dir(const char *dir, int value_head, int tp_rank, int tp_size, const mrl_model_stage *stage,
                           mrl_model **out, mrl_st **st) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path)
        return mrl_set_error(MRL_ERR_INVALID, "model directory path too long");
    mrl_model_config whole, cfg;
    mrl_status s = mrl_model_config_load(path, &whole);
    if (s) return s;
    if (value_head) whole.value_head = 1;
    cfg = whole;
    int kv_copies = 1, vocab = 0;
    if (tp_size > 1 && mrl_model_is_mla(&whole))
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: tensor parallel is not yet supported for deepseek_v3 (multi-head "
                             "latent attention)", dir);
    if (tp_size > 1 && (s = tp_config(dir, tp_size, &cfg, &kv_copies, &vocab))) return s;
    int pp = stage && stage->stages > 1;
    int moe0 = 0, moe_all = 0;
    if (pp) { /* a pipeline stage: its run of layers */
        if (stage->stage < 0 || stage->stage >= stage->stages || stage->layers < 1 || stage->first_layer < 0 ||
            stage->first_layer + stage->layers > whole.num_hidden_layers)
            return mrl_set_error(MRL_ERR_INVALID, "%s: pipeline stage %d of %d with layers [%d, %d) of the %d "
                                 "(num_hidden_layers)", dir, stage->stage, stage->stages, stage->first_layer,
                                 stage->first_layer + stage->layers, whole.num_hidden_layers);
        cfg.num_hidden_layers = stage->layers;
        if (whole.num_experts > 0) { /* which of its layers are sparse, in its own numbering */
            memset(cfg.mlp_only_layers, 0, sizeof cfg.mlp_only_layers);
            cfg.decoder_sparse_step = 1;
            cfg.first_k_dense_replace = 0; /* (DeepSeek's dense first layers: in mlp_only_layers below) */
            for (int l = 0; l < whole.num_hidden_layers; l++) {
                int moe = mrl_model_layer_is_moe(&whole, l), local = l - stage->first_layer;
                moe_all += moe;
                moe0 += moe && local < 0;
                if (!moe && local >= 0 && local < stage->layers)
                    cfg.mlp_only_layers[local / 64] |= (uint64_t)1 << (local % 64);
            }
        }
    }
    if ((s = mrl_st_open(dir, st))) return s;
    if (cfg.num_nextn_predict_layers) { /* a config that names the MTP layer without its weights (Transformers
                                         * saves none): the model without it */
        char name[96];
        snprintf(name, sizeof name, "model.layers.%d.eh_proj.weight", whole.num_hidden_layers);
        if (!mrl_st_has(*st, name)) cfg.num_nextn_predict_layers = whole.num_nextn_predict_layers = 0;
    }
    s = mrl_model_alloc_stage_layout(&cfg, stage, out); /* views only: the sizes are the file's to confirm */
    if (!s && pp) {
        (*out)->pp_whole = whole;
        (*out)->pp_moe0 = moe0, (*out)->pp_moe_all = moe_all;
    }
    if (!s && tp_size > 1)
        (*out)->tp_rank = tp_rank, (*out)->tp_size = tp_size, (*out)->tp_cfg = whole, (*out)->tp_kv_copies = kv_copies,
        (*out)->tp_vocab = vocab;
    if (!s) s = check_tensors(*out, *st, dir);
    if (s) {
        mrl_st_close(*st);
        *st = NULL;
        mrl_model_free(*out);
        *out = NULL;
    }
    return s;
}

/* A load's end: parameters [lo, hi) read into m (its buffer made, s the making's status), the
 * files closed; *out = m, or m freed on a failure. */
static mrl_status finish_load(mrl_model *m, mrl_st *st, mrl_status s, int64_t lo, int64_t hi, mrl_model **out) {
    if (!s) s = read_weights(m, st, lo, hi);
    mrl_st_close(st);
    if (s) {
        mrl_model_free(m);
        return s;
    }
    *out = m;
    return MRL_OK;
}

/* shard `index` of `shards` over `world` ranks (mrl_model_load_dir_shard's arguments) */
static mrl_status check_shard(const char *fn, int world, int shards, int index) {
    if (world < 1 || shards < 1 || world % shards || index < 0 || index >= shards)
        return mrl_set_error(MRL_ERR_INVALID, "%s: shard %d of %d over %d ranks", fn, index, shards, world);
    return MRL_OK;
}

/* finish_load of the whole buffer (world 1), or of this rank's shard of it: the layout is the same
 * on every rank that holds it (the slices, the stage), so are the shards */
static mrl_status finish_shard_load(mrl_model *m, mrl_st *st, int world, int shards, int index, mrl_model **out) {
    if (world == 1) return finish_load(m, st, mrl_model_alloc_params(m), 0, m->n_params, out);
    int64_t offset, count;
    mrl_dist_group_shard(m->n_params, world, shards, index, &offset, &count);
    return finish_load(m, st, mrl_model_alloc_shard(m, offset, count), offset, offset + count, out);
}

mrl_status mrl_model_load_dir(const char *dir, mrl_model **out) {
    if (!dir || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_load_dir: NULL argument");
    *out = NULL;
    mrl_st *st = NULL;
    mrl_model *m = NULL;
    mrl_status s = open_dir(dir, 0, 0, 1, NULL, &m, &st);
    if (s) return s;
    return finish_load(m, st, mrl_model_alloc_params(m), 0, m->n_params, out);
}

mrl_status mrl_model_load_dir_shard(const char *dir, int world, int shards, int index, int value_head,
                                    mrl_model **out) {
    if (!dir || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_load_dir_shard: NULL argument");
    mrl_status s = check_shard("mrl_model_load_dir_shard", world, shards, index);
    if (s) return s;
    *out = NULL;
    mrl_st *st = NULL;
    mrl_model *m = NULL;
    if ((s = open_dir(dir, value_head, 0, 1, NULL, &m, &st))) return s;
    int64_t offset, count; /* (sharded even over one rank: the caller's layout) */
    mrl_dist_group_shard(m->n_params, world, shards, index, &offset, &count);
    return finish_load(m, st, mrl_model_alloc_shard(m, offset, count), offset, offset + count, out);
}

mrl_status mrl_model_load_dir_tp(const char *dir, int rank, int size, int value_head, mrl_model **out) {
    return mrl_model_load_dir_tp_shard(dir, rank, size, 1, 1, 0, value_head, out);
}

mrl_status mrl_model_load_dir_tp_shard(const char *dir, int rank, int size, int world, int shards, int index,
                                       int value_head, mrl_model **out) {
    if (!dir || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_load_dir_tp: NULL argument");
    *out = NULL;
    if (size < 1 || rank < 0 || rank >= size)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_load_dir_tp: rank %d of %d", rank, size);
    mrl_status s = check_shard("mrl_model_load_dir_tp_shard", world, shards, index);
    mrl_st *st = NULL;
    mrl_model *m = NULL;
    if (s || (s = open_dir(dir, value_head, rank, size, NULL, &m, &st))) return s;
    return finish_shard_load(m, st, world, shards, index, out);
}

mrl_status mrl_model_load_dir_stage(const char *dir, const mrl_model_stage *stage, int tp_rank, int tp_size,
                                    int value_head, mrl_model **out) {
    return mrl_model_load_dir_stage_shard(dir, stage, tp_rank, tp_size, 1, 1, 0, value_head, out);
}

mrl_status mrl_model_load_dir_stage_shard(const char *dir, const mrl_model_stage *stage, int tp_rank, int tp_size,
                                          int world, int shards, int index, int value_head, mrl_model **out) {
    if (!dir || !stage || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_load_dir_stage: NULL argument");
    *out = NULL;
    if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_load_dir_stage: tensor-parallel rank %d of %d", tp_rank, tp_size);
    mrl_status s = check_shard("mrl_model_load_dir_stage_shard", world, shards, index);
    mrl_st *st = NULL;
    mrl_model *m = NULL;
    if (s || (s = open_dir(dir, value_head, tp_rank, tp_size, stage, &m, &st))) return s;
    return finish_shard_load(m, st, world, shards, index, out);
}

/* What m holds, [lo, hi) of its buffer, read again from dir's files. */
static mrl_status read_again(mrl_model *m, const char *dir, int64_t lo, int64_t hi) {
    mrl_st *st = NULL;
    mrl_status s = mrl_st_open(dir, &st);
    if (s) return s;
    if (!(s = check_tensors(m, st, dir))) s = read_weights(m, st, lo, hi);
    mrl_st_close(st);
    mrl_model_weights_changed(m);
    return s;
}

mrl_status mrl_model_read_shard(mrl_model *m, const char *dir) {
    if (!m || !dir) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_read_shard: NULL argument");
    if (!m->p_region) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_read_shard: the parameters are not sharded");
    return read_again(m, dir, m->shard_off, m->shard_off + m->shard_count);
}

mrl_status mrl_model_read_tp(mrl_model *m, const char *dir) {
    if (!m || !dir) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_read_tp: NULL argument");
    if (m->tp_size <= 1 && m->pp_stages <= 1)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_read_tp: not a tensor-parallel model nor a pipeline stage");
    if (m->p_region) return read_again(m, dir, m->shard_off, m->shard_off + m->shard_count); /* (ZeRO-3: its shard) */
    return read_again(m, dir, 0, m->n_params);
}

/* The whole model's config of a pipeline stage (and a tensor-parallel rank): its layers all. */
static mrl_model_config whole_config(const mrl_model *m) {
    return m->pp_stages > 1 ? m->pp_whole : m->tp_size > 1 ? m->tp_cfg : m->cfg;
}

static mrl_status write_config(mrl_model *m, const char *dir) {
    char json[16384], path[4096]; /* room for a long mlp_only_layers */
    size_t len = 0;
    mrl_model_config c = whole_config(m);
    mrl_status s = mrl_model_config_to_json(&c, json, sizeof json, &len);
    if (s) return s;
    snprintf(path, sizeof path, "%s/config.json", dir);
    return mrl_fs_write_file(path, json, len); /* temporary file, fsync, rename, fsync of dir */
}

/* The tensors go out through the safetensors stream one at a time, each
 * straight from its view of the fp32 master buffer (a GPU model's through a
 * host buffer of the largest view, reused): saving never holds a second
 * copy of the model, whatever its size. Shards are filled in view order
 * (embedding, layers, norm, head), as transformers' save_pretrained fills
 * them in state-dict order. */
/* A GPU model's views are written from a host buffer of the largest view (*host; NULL on the
 * CPU, where they are written in place). */
static mrl_status host_view_buffer(mrl_model *m, const char *dir, float **host) {
    *host = NULL;
    if (!m->k->on_device) return MRL_OK;
    int64_t most = 0;
    for (int i = 0; i < m->n_views; i++)
        if (m->views[i].numel > most) most = m->views[i].numel;
    *host = mrl_mem_alloc(sizeof(float) * (size_t)(most ? most : 1), MRL_MEM_OTHER);
    if (!*host) return mrl_wrap_error(MRL_ERR_NOMEM, "%s: a host buffer for one tensor of the model", dir);
    return MRL_OK;
}

/* The safetensors stream of the model's views (whole tensors), declared in view order. */
static mrl_status open_stream(mrl_model *m, const char *dir, int64_t max_shard_bytes, mrl_st_stream **st) {
    mrl_status s = mrl_st_stream_open(dir, max_shard_bytes, st);
    if (!s) s = mrl_st_stream_set_metadata(*st, "format", "pt"); /* what Transformers expects */
    for (int i = 0; !s && i < m->n_views; i++) {
        int64_t shape[2];
        whole_shape(m, &m->views[i], shape);
        s = mrl_st_stream_declare(*st, m->views[i].name, MRL_DTYPE_F32, m->views[i].ndim, shape);
    }
    return s;
}

/* View v written to the stream: from the parameters, or through host. */
static mrl_status write_view(mrl_model *m, const char *dir, mrl_st_stream *st, const mrl_param_view *v, float *host) {
    const float *src = m->params + v->offset;
    if (host) {
        mrl_status c = m->k->to_host(host, src, (int64_t)sizeof(float) * v->numel);
        if (c) return mrl_wrap_error(c, "%s: tensor '%s'", dir, v->name); /* the device's own error after it */
        src = host;
    }
    return mrl_st_stream_write(st, v->name, src, v->numel);
}

/* A sharded model: every rank gathers the model view by view (the gathers are collectives), the
 * writer writes each view while it is whole; a write error stops the writing, not the gathers
 * (the other ranks would wait for them), and is returned at the end. */
static mrl_status save_gathered(mrl_model *m, const char *dir, int64_t max_shard_bytes) {
    mrl_st_stream *st = NULL;
    float *host = NULL;
    mrl_status s = MRL_OK, g = MRL_OK;
    if (m->shard_writer) {
        s = host_view_buffer(m, dir, &host);
        if (!s) s = open_stream(m, dir, max_shard_bytes, &st);
    }
    for (int i = 0; !g && i < m->n_views; i++) {
        const mrl_param_view *v = &m->views[i];
        if ((g = mrl_model_fetch(m, v->offset, v->numel))) break;
        if (!s && m->shard_writer) s = write_view(m, dir, st, v, host);
        mrl_model_drop(m, v->offset, v->numel);
    }
    if (!s && !g && m->shard_writer) s = mrl_st_stream_finish(st);
    mrl_st_stream_free(st);
    mrl_mem_free(host);
    if (!s && !g && m->shard_writer) s = write_config(m, dir);
    return g ? g : s;
}

/* View v of a tensor-parallel rank as the whole tensor: its slices gathered over the group (a
 * collective: every rank of it calls this for the same views) and put together, in *src (all:
 * [numel size], out: as large, mine: [numel] host buffers); whole views are read through out.
 * The ranks' rows one after the other, or each row's columns of the ranks side by side; a K/V
 * head several ranks hold: the first of them. *n: the whole tensor's elements. */
static mrl_status gather_view(mrl_model *m, const mrl_param_view *v, float *mine, float *all, float *out,
                              const float **src, int64_t *n);

/* (sharded, ZeRO-3: the view gathered into place first and let go after: a collective of the
 * shard group too) */
static mrl_status whole_view(mrl_model *m, const mrl_param_view *v, float *mine, float *all, float *out,
                             const float **src, int64_t *n) {
    mrl_status g = m->p_region ? mrl_model_fetch(m, v->offset, v->numel) : MRL_OK;
    if (g) return g;
    g = gather_view(m, v, mine, all, out, src, n);
    if (m->p_region) mrl_model_drop(m, v->offset, v->numel);
    return g;
}

static mrl_status gather_view(mrl_model *m, const mrl_param_view *v, float *mine, float *all, float *out,
                              const float **src, int64_t *n) {
    int split = mrl_model_tp_split(m, v->name);
    *n = v->numel;
    if (!split) { /* (the same on every rank) */
        *src = out;
        return m->k->to_host(out, m->params + v->offset, (int64_t)sizeof(float) * v->numel);
    }
    int64_t size = m->tp_size;
    mrl_status g = m->k->to_host(mine, m->params + v->offset, (int64_t)sizeof(float) * v->numel);
    if (g || (g = m->tp_gather(m->tp_ctx, mine, v->numel, all))) return g;
    *src = all; /* rows: the ranks' slices one after the other already */
    int copies = mrl_model_tp_copies(m, v->name), parts = (int)size / copies;
    if (copies > 1) { /* a K/V head held by several ranks: the first of each */
        for (int h = 0; h < parts; h++)
            memcpy(out + h * v->numel, all + (int64_t)h * copies * v->numel, sizeof(float) * (size_t)v->numel);
        *src = out;
    }
    if (split == 2) { /* columns: row i of rank r's slice goes to row i's r-th block */
        int64_t rows = v->shape[0], cols = v->shape[1];
        for (int64_t r = 0; r < size; r++)
            for (int64_t row = 0; row < rows; row++)
                memcpy(out + row * cols * size + r * cols, all + r * v->numel + row * cols, sizeof(float) * (size_t)cols);
        *src = out;
    }
    *n = v->numel * parts;
    return MRL_OK;
}

/* Host buffers for whole_view of the model's largest view: mine, all and out (NULL: none). */
static mrl_status view_buffers(const mrl_model *m, const char *dir, float **mine, float **all, float **out) {
    int64_t most = 0, n = m->tp_size > 1 ? m->tp_size : 1;
    for (int i = 0; i < m->n_views; i++)
        if (m->views[i].numel > most) most = m->views[i].numel;
    *mine = mrl_mem_alloc(sizeof(float) * (size_t)(most ? most : 1), MRL_MEM_OTHER);
    *all = mrl_mem_alloc(sizeof(float) * (size_t)(most * n > 0 ? most * n : 1), MRL_MEM_OTHER);
    *out = mrl_mem_alloc(sizeof(float) * (size_t)(most * n > 0 ? most * n : 1), MRL_MEM_OTHER);
    return *mine && *all && *out ? MRL_OK : mrl_wrap_error(MRL_ERR_NOMEM, "%s: host buffers for one tensor", dir);
}

/* A tensor-parallel model: every rank of the group gathers each split view (the gathers are
 * collectives) and rank 0 writes the whole tensors (whole_view). A write error stops the
 * writing, not the gathers. */
static mrl_status save_tp(mrl_model *m, const char *dir, int64_t max_shard_bytes) {
    if (!m->tp_gather)
        return mrl_set_error(MRL_ERR_INVALID, "%s: a tensor-parallel model saves through its group's all-gather "
                             "(mrl_model_set_tp_group)", dir);
    float *mine = NULL, *all = NULL, *out = NULL;
    mrl_st_stream *st = NULL;
    int writer = m->tp_rank == 0 && (!m->p_region || m->shard_writer); /* (sharded: the first group's) */
    mrl_status s = view_buffers(m, dir, &mine, &all, &out);
    mrl_status g = s;
    if (!s && writer) s = open_stream(m, dir, max_shard_bytes, &st);
    for (int i = 0; !g && i < m->n_views; i++) {
        const mrl_param_view *v = &m->views[i];
        const float *src = NULL;
        int64_t n = 0;
        g = whole_view(m, v, mine, all, out, &src, &n);
        if (!g && !s && writer) s = mrl_st_stream_write(st, v->name, src, n);
    }
    if (!s && !g && writer) s = mrl_st_stream_finish(st);
    mrl_st_stream_free(st);
    mrl_mem_free(mine), mrl_mem_free(all), mrl_mem_free(out);
    if (!s && !g && writer) s = write_config(m, dir);
    return g ? mrl_wrap_error(g, "%s: gathering the tensor-parallel slices", dir) : s;
}


/* The stage that holds the whole model's view `name`. */
static int owner_stage(const mrl_model *m, const char *name, const int *first) {
    int l;
    if (sscanf(name, "model.layers.%d.", &l) == 1) {
        int s = 0;
        while (s + 1 < m->pp_stages && first[s + 1] <= l) s++;
        return s;
    }
    return strcmp(name, "model.embed_tokens.weight") == 0 ? 0 : m->pp_stages - 1;
}

enum { PP_SAVE_TAG = 999 };

/* A pipeline stage: every rank of every stage calls it. The first stage's tensor-parallel rank 0
 * writes the whole model, view by view in the whole model's order: its own views, and each other
 * stage's as that stage's tensor-parallel rank 0 sends it (put together over its group first:
 * whole_view), one tensor at a time. A tied head's copy on the last stage is not written (the
 * first stage's embedding is the tensor). */
static mrl_status save_pp(mrl_model *m, const char *dir, int64_t max_shard_bytes) {
    if (!m->pp_send || !m->pp_recv)
        return mrl_set_error(MRL_ERR_INVALID, "%s: a pipeline stage saves through its pipeline's transfers "
                             "(mrl_model_set_pp_group)", dir);
    if (m->tp_size > 1 && !m->tp_gather)
        return mrl_set_error(MRL_ERR_INVALID, "%s: a tensor-parallel model saves through its group's all-gather "
                             "(mrl_model_set_tp_group)", dir);
    mrl_model_config c = whole_config(m);
    /* (sharded, ZeRO-3: every pipeline is in its stage's gathers, the first one's ranks write and send) */
    int first_group = !m->p_region || m->shard_writer;
    int writer = m->pp_stage == 0 && m->tp_rank == 0 && first_group;
    /* every stage's first layer (the stages send theirs around: each knows its own only) */
    int first[256];
    if (m->pp_stages > 256) return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: more than 256 pipeline stages", dir);
    mrl_model *w = NULL; /* the whole model's views (no parameters) */
    mrl_status s = mrl_model_alloc_layout(&c, &w);
    float *mine = NULL, *all = NULL, *out = NULL, *recv = NULL;
    if (!s) s = view_buffers(m, dir, &mine, &all, &out);
    int64_t most = 0;
    for (int i = 0; w && i < w->n_views; i++)
        if (w->views[i].numel > most) most = w->views[i].numel;
    if (!s && writer && !(recv = mrl_mem_alloc(sizeof(float) * (size_t)(most ? most : 1), MRL_MEM_OTHER)))
        s = mrl_wrap_error(MRL_ERR_NOMEM, "%s: a host buffer for one tensor", dir);
    mrl_status g = s;
    for (int q = 0; !g && q < m->pp_stages; q++) { /* stage q's first layer, from stage q to everyone, in turn */
        float f = (float)m->pp_l0;
        if (q == m->pp_stage) {
            for (int r = 0; !g && r < m->pp_stages; r++)
                if (r != q) g = m->pp_send(m->pp_ctx, &f, 1, r, PP_SAVE_TAG);
            first[q] = m->pp_l0;
        } else {
            g = m->pp_recv(m->pp_ctx, &f, 1, q, PP_SAVE_TAG);
            first[q] = (int)f;
        }
    }
    mrl_st_stream *st = NULL;
    if (!s && !g && writer) {
        s = mrl_st_stream_open(dir, max_shard_bytes, &st);
        if (!s) s = mrl_st_stream_set_metadata(st, "format", "pt");
        for (int i = 0; !s && i < w->n_views; i++) {
            int64_t shape[2] = {w->views[i].shape[0], w->views[i].ndim > 1 ? w->views[i].shape[1] : 0};
            s = mrl_st_stream_declare(st, w->views[i].name, MRL_DTYPE_F32, w->views[i].ndim, shape);
        }
    }
    for (int i = 0; !g && w && i < w->n_views; i++) {
        const mrl_param_view *wv = &w->views[i];
        int o = owner_stage(m, wv->name, first);
        if (o == m->pp_stage) { /* mine: put together over the group; to the writer */
            mrl_param_view v;
            if ((g = mrl_model_find_view(m, wv->name, &v))) break;
            const float *src = NULL;
            int64_t n = 0;
            if ((g = whole_view(m, &v, mine, all, out, &src, &n))) break;
            if (writer) {
                if (!s) s = mrl_st_stream_write(st, wv->name, src, n);
            } else if (m->tp_rank == 0 && first_group) {
                g = m->pp_send(m->pp_ctx, src, n, 0, PP_SAVE_TAG);
            }
        } else if (writer) { /* another stage's */
            if ((g = m->pp_recv(m->pp_ctx, recv, wv->numel, o, PP_SAVE_TAG))) break;
            if (!s) s = mrl_st_stream_write(st, wv->name, recv, wv->numel);
        }
    }
    if (!s && !g && writer) s = mrl_st_stream_finish(st);
    mrl_st_stream_free(st);
    mrl_mem_free(mine), mrl_mem_free(all), mrl_mem_free(out), mrl_mem_free(recv);
    if (!s && !g && writer) s = write_config(m, dir);
    mrl_model_free(w);
    return g ? mrl_wrap_error(g, "%s: sending the pipeline stages' tensors", dir) : s;
}

mrl_status mrl_model_save_dir_sharded(mrl_model *m, const char *dir, int64_t max_shard_bytes) {
    if (!m || !dir) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_save_dir_sharded: NULL argument");
    if (strlen(dir) > 4000) return mrl_set_error(MRL_ERR_INVALID, "model directory path too long");
    if (m->pp_stages > 1) return save_pp(m, dir, max_shard_bytes);
    if (m->tp_size > 1) return save_tp(m, dir, max_shard_bytes);
    if (m->p_region) return save_gathered(m, dir, max_shard_bytes);
    float *host;
    mrl_status s = host_view_buffer(m, dir, &host);
    if (s) return s;
    mrl_st_stream *st = NULL;
    s = open_stream(m, dir, max_shard_bytes, &st);
    for (int i = 0; !s && i < m->n_views; i++) s = write_view(m, dir, st, &m->views[i], host);
    if (!s) s = mrl_st_stream_finish(st);
    mrl_st_stream_free(st);
    mrl_mem_free(host);
    if (!s) s = write_config(m, dir);
    return s;
}

mrl_status mrl_model_save_dir(mrl_model *m, const char *dir) {
    return mrl_model_save_dir_sharded(m, dir, MRL_MODEL_MAX_SHARD_BYTES);
}
