/* LoRA adapters (moonrl/model.h, mrl_model_set_lora): their buffers and PEFT-named views,
 * their init, and their part of the layers' products, forward and backward side by side.
 *
 * The base stays as it is: each targeted product keeps reading W (fp32, its bf16 copy or the
 * engine's panels), and the adapter adds s (x A^T) B^T to its output, s = alpha / rank, so
 * W + s BA is never formed and an adapter update never touches the base's copies. With
 * adapters on, the backward writes no gradient of the base: the products of dW are skipped
 * (layer.c drops a product without destination), the embedding's and head's too (forward.c),
 * and the norms' weight gradients, which their ops write beside dx, go to a sink. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "model_internal.h"
#include "base/error.h"
#include "base/mem.h"
#include "base/parallel.h"
#include "base/rng.h"

/* The seven matrices' module names (mrl_layer_matrices' order) and the experts' three. */
static const char *const MOD[7] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                   "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
static const char *const EXPERT[3] = {"gate_proj", "up_proj", "down_proj"};

typedef struct lora_layout {
    mrl_lora *lo;
    int64_t off;
    int n;
    size_t names_len;
} lora_layout;

/* A view of shape [d0, d1] at offset `at` of the adapters (filled when lo->views exists), or
 * only its name counted. */
static void add(lora_layout *ly, const char *name, int64_t d0, int64_t d1, int64_t at) {
    mrl_lora *lo = ly->lo;
    size_t nlen = strlen(name) + 1;
    if (lo->views) {
        memcpy(lo->names + ly->names_len, name, nlen);
        lo->views[ly->n] = (mrl_param_view){lo->names + ly->names_len, at, d0 * d1, 2, {d0, d1}, 1};
    }
    ly->names_len += nlen;
    ly->n++;
}

/* The one place that defines the adapters' layout: layer by layer, a dense layer's targets A
 * then B, a sparse layer's experts' targets as [E, r, in] then [E, out, r] blocks (views per
 * expert). Run to count, then to fill the views and the layer tables (lo->params set). */
static void build(const mrl_model *m, lora_layout *ly) {
    mrl_lora *lo = ly->lo;
    const mrl_model_config *c = &m->cfg;
    int64_t r = lo->cfg.rank, E = c->num_experts;
    char name[160];
    for (int l = 0; l < c->num_hidden_layers; l++) {
        if (lo->layer_off) lo->layer_off[l] = ly->off;
        mrl_layer_matrix mats[7]; /* (their shapes; which exist, by the config: a layout-only model has no pointers) */
        mrl_layer_matrices(c, (layer_params *)&m->lp[l], mats); /* (reads only) */
        int sparse = mrl_model_layer_is_moe(c, l);
        lora_layer *P = lo->params ? &lo->lp[l] : NULL, *G = lo->grads ? &lo->lg[l] : NULL;
        for (int i = 0; i < 7; i++) {
            if (!(lo->cfg.targets & (1u << i)) || (i >= 4 && sparse)) continue;
            int64_t N = mats[i].N, K = mats[i].K;
            snprintf(name, sizeof name, "base_model.model.model.layers.%d.%s.lora_A.weight", l, MOD[i]);
            add(ly, name, r, K, ly->off);
            if (P) P->A[i] = lo->params + ly->off;
            if (G) G->A[i] = lo->grads + ly->off;
            ly->off += r * K;
            snprintf(name, sizeof name, "base_model.model.model.layers.%d.%s.lora_B.weight", l, MOD[i]);
            add(ly, name, N, r, ly->off);
            if (P) P->B[i] = lo->params + ly->off;
            if (G) G->B[i] = lo->grads + ly->off;
            ly->off += N * r;
        }
        if (!sparse) continue;
        for (int j = 0; j < 3; j++) { /* gate, up, down */
            if (!(lo->cfg.targets & (MRL_LORA_GATE << j))) continue;
            int64_t N, K;
            mrl_expert_matrix(c, j, &N, &K);
            int64_t a0 = ly->off, b0 = a0 + E * r * K;
            for (int64_t e = 0; e < E; e++) {
                snprintf(name, sizeof name, "base_model.model.model.layers.%d.mlp.experts.%lld.%s.lora_A.weight", l,
                         (long long)e, EXPERT[j]);
                add(ly, name, r, K, a0 + e * r * K);
                snprintf(name, sizeof name, "base_model.model.model.layers.%d.mlp.experts.%lld.%s.lora_B.weight", l,
                         (long long)e, EXPERT[j]);
                add(ly, name, N, r, b0 + e * N * r);
            }
            if (P) P->eA[j] = lo->params + a0, P->eB[j] = lo->params + b0;
            if (G) G->eA[j] = lo->grads + a0, G->eB[j] = lo->grads + b0;
            ly->off = b0 + E * N * r;
        }
    }
    if (lo->layer_off) lo->layer_off[c->num_hidden_layers] = ly->off;
}

void mrl_lora_free(mrl_lora *lo) {
    if (!lo) return;
    mrl_buffer_free(&lo->params_buf);
    mrl_buffer_free(&lo->grads_buf);
    mrl_buffer_free(&lo->sink_buf);
    mrl_mem_free(lo->views);
    mrl_mem_free(lo->names);
    mrl_mem_free(lo->lp);
    mrl_mem_free(lo->lg);
    mrl_mem_free(lo->layer_off);
    mrl_mem_free(lo);
}

void mrl_lora_point(mrl_model *m) {
    mrl_lora *lo = m->lora;
    if (!lo) return;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        m->lp[l].lora = lo->on ? &lo->lp[l] : NULL;
        /* the frozen parameters: no gradients but the norms', which go to the sink */
        layer_params *g = &m->lg[l];
        float **f = (float **)g;
        for (size_t i = 0; i < offsetof(layer_params, pq) / sizeof(float *); i++) f[i] = NULL;
        g->ln1 = g->ln2 = lo->sink;
        if (m->lp[l].q_norm) g->q_norm = g->k_norm = lo->sink;
        g->lora = &lo->lg[l];
    }
    m->g_embed = m->g_lm_head = m->g_score = NULL;
    m->g_final_norm = lo->sink;
}

static mrl_status check_config(const mrl_lora_config *cfg) {
    if (!(cfg->dropout >= 0 && cfg->dropout < 1))
        return mrl_set_error(MRL_ERR_INVALID, "LoRA: dropout must be in [0, 1), got %g", cfg->dropout);
    if (cfg->rank < 1 || cfg->rank > 4096)
        return mrl_set_error(MRL_ERR_INVALID, "LoRA: rank must be in 1..4096, got %d", cfg->rank);
    if (!(cfg->alpha > 0) || !isfinite(cfg->alpha))
        return mrl_set_error(MRL_ERR_INVALID, "LoRA: alpha must be a positive number, got %g", cfg->alpha);
    if (!(cfg->targets & MRL_LORA_ALL) || (cfg->targets & ~(unsigned)MRL_LORA_ALL))
        return mrl_set_error(MRL_ERR_INVALID, "LoRA: targets 0x%x name none of the seven projections", cfg->targets);
    return MRL_OK;
}

/* An adapter set for m's layout: views, tables, parameters (initialised as PEFT's:
 * kaiming_uniform_ with a = sqrt(5), U(-1/sqrt(in), 1/sqrt(in)), B = 0, in view order from
 * cfg->seed; made on the host, then copied to `device`) and, when trained, zeroed gradients. */
static mrl_status lora_new(const mrl_model *m, const mrl_lora_config *cfg, int trained, mrl_device device,
                           mrl_lora **out) {
    mrl_status st = check_config(cfg);
    if (st) return st;
    mrl_lora *lo = mrl_mem_alloc(sizeof *lo, MRL_MEM_OTHER);
    if (!lo) return MRL_ERR_NOMEM;
    memset(lo, 0, sizeof *lo);
    lo->m = m;
    lo->cfg = *cfg;
    lo->scale = (float)(cfg->alpha / cfg->rank);
    lo->on = 1;
    lora_layout ly = {lo};
    build(m, &ly); /* count */
    int L = m->cfg.num_hidden_layers;
    lo->n = ly.off;
    lo->n_views = ly.n;
    lo->views = mrl_mem_alloc(sizeof(mrl_param_view) * (ly.n ? ly.n : 1), MRL_MEM_OTHER);
    lo->names = mrl_mem_alloc(ly.names_len + 1, MRL_MEM_OTHER);
    lo->lp = mrl_mem_alloc(sizeof(lora_layer) * (L ? L : 1), MRL_MEM_OTHER);
    lo->lg = mrl_mem_alloc(sizeof(lora_layer) * (L ? L : 1), MRL_MEM_OTHER);
    lo->layer_off = mrl_mem_alloc(sizeof(int64_t) * (L + 1), MRL_MEM_OTHER);
    size_t bytes = sizeof(float) * (size_t)(lo->n ? lo->n : 1);
    float *init = mrl_mem_alloc(bytes, MRL_MEM_OTHER); /* (the init, made on the host) */
    int ok = lo->views && lo->names && lo->lp && lo->lg && lo->layer_off && init &&
             mrl_buffer_alloc(device, bytes, MRL_MEM_PARAMS, &lo->params_buf) == MRL_OK &&
             (!trained || mrl_buffer_alloc(device, bytes, MRL_MEM_GRADS, &lo->grads_buf) == MRL_OK); /* (zeroed) */
    if (!ok) {
        mrl_mem_free(init);
        mrl_lora_free(lo);
        return mrl_wrap_error(MRL_ERR_NOMEM, "LoRA: no memory for %lld adapter parameters", (long long)ly.off);
    }
    lo->params = lo->params_buf.data;
    lo->grads = trained ? lo->grads_buf.data : NULL;
    memset(lo->lp, 0, sizeof(lora_layer) * (L ? L : 1));
    memset(lo->lg, 0, sizeof(lora_layer) * (L ? L : 1));
    ly = (lora_layout){lo};
    build(m, &ly); /* the views, the tables */
    uint64_t s = cfg->seed;
    memset(init, 0, bytes); /* (B = 0) */
    for (int i = 0; i < lo->n_views; i++) {
        const mrl_param_view *v = &lo->views[i];
        if (strstr(v->name, ".lora_B.")) continue;
        float *p = init + v->offset;
        double bound = 1.0 / sqrt((double)v->shape[1]);
        for (int64_t j = 0; j < v->numel; j++) p[j] = (float)((2 * mrl_unit53(mrl_splitmix64(&s)) - 1) * bound);
    }
    st = mrl_device_memcpy(lo->params, init, bytes);
    mrl_mem_free(init);
    if (st) {
        mrl_lora_free(lo);
        return st;
    }
    *out = lo;
    return MRL_OK;
}

mrl_status mrl_lora_count(const mrl_model_config *mc, const mrl_lora_config *cfg, int64_t *model_params,
                          int64_t *lora_params) {
    if (!mc || !cfg || !model_params || !lora_params) return mrl_set_error(MRL_ERR_INVALID, "mrl_lora_count: NULL argument");
    mrl_status st = check_config(cfg);
    mrl_model *m = NULL;
    if (st || (st = mrl_model_alloc_layout(mc, &m))) return st; /* (views and tables, no buffer) */
    mrl_lora lo = {.cfg = *cfg};
    lora_layout ly = {&lo};
    build(m, &ly);
    *model_params = m->n_params, *lora_params = ly.off;
    mrl_model_free(m);
    return MRL_OK;
}

mrl_status mrl_lora_create(const mrl_model *m, const mrl_lora_config *cfg, mrl_lora **out) {
    if (!m || !cfg || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_lora_create: NULL argument");
    if (m->tp_size > 1 || m->pp_stages > 1 || (m->p_region && !m->quant))
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "LoRA adapters of their own: a whole model only for now");
    return lora_new(m, cfg, 0, (mrl_device){MRL_DEVICE_CPU, 0}, out); /* (what an engine on the CPU serves) */
}

mrl_status mrl_model_set_lora(mrl_model *m, const mrl_lora_config *cfg) {
    if (!m || !cfg) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_lora: NULL argument");
    if (m->lora) return mrl_set_error(MRL_ERR_INVALID, "LoRA: the model has adapters already");
    const char *why = m->tp_size > 1                   ? "tensor parallel"
                      : m->cp_size > 1                 ? "context parallel"
                      : m->pp_stages > 1               ? "pipeline parallel"
                      : m->p_region && !m->quant       ? "sharded parameters (ZeRO-3)"
                      : m->ep                          ? "expert parallel"
                      : m->grad_acquire                ? "gradient windows (ZeRO-2)"
                      : m->score                       ? "a value head (a critic trains whole)"
                      : mrl_model_is_mla(&m->cfg)      ? "multi-head latent attention (deepseek_v3)"
                                                       : NULL;
    mrl_status st = check_config(cfg);
    if (st) return st;
    if (why) return mrl_set_error(MRL_ERR_UNSUPPORTED, "LoRA: not yet with %s", why);
    if (cfg->dropout > 0 && m->device.kind != MRL_DEVICE_CPU)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "LoRA: dropout on a GPU not yet (its masks are drawn on the host)");
    mrl_lora *lo;
    if ((st = lora_new(m, cfg, 1, m->device, &lo))) return st;
    int64_t D = m->cfg.hidden_size, hd = m->cfg.head_dim;
    lo->sink_n = D > hd ? D : hd;
    if (mrl_buffer_alloc(m->device, sizeof(float) * (size_t)lo->sink_n, MRL_MEM_OTHER, &lo->sink_buf)) {
        mrl_lora_free(lo);
        return MRL_ERR_NOMEM;
    }
    lo->sink = lo->sink_buf.data;
    m->lora = lo;
    /* the base is frozen: its gradient buffer (if any) goes, and the layouts are the adapters' */
    mrl_buffer_free(&m->grads_buf);
    m->grads = NULL;
    mrl_model_release_activations(m); /* (the scratch joins the layout) */
    mrl_lora_point(m);
    return MRL_OK;
}

const mrl_lora_config *mrl_lora_get_config(const mrl_lora *ad) { return ad ? &ad->cfg : NULL; }
int mrl_lora_rank(const mrl_lora *ad) { return ad ? ad->cfg.rank : 0; }
int64_t mrl_lora_num_params(const mrl_lora *ad) { return ad ? ad->n : 0; }
float *mrl_lora_params(mrl_lora *ad) { return ad ? ad->params : NULL; }
int mrl_lora_num_views(const mrl_lora *ad) { return ad ? ad->n_views : 0; }
const lora_layer *mrl_lora_layer(const mrl_lora *ad, int l) { return &ad->lp[l]; }
const mrl_lora *mrl_model_lora_on(const mrl_model *m) { return m->lora && m->lora->on ? m->lora : NULL; }

mrl_status mrl_lora_view(const mrl_lora *ad, int i, mrl_param_view *out) {
    int n = mrl_lora_num_views(ad);
    if (!out || i < 0 || i >= n) return mrl_set_error(MRL_ERR_INVALID, "LoRA view %d out of range (0..%d)", i, n - 1);
    *out = ad->views[i];
    return MRL_OK;
}

const mrl_lora_config *mrl_model_lora(const mrl_model *m) { return m && m->lora ? &m->lora->cfg : NULL; }
int mrl_model_lora_rank(const mrl_model *m) { return m && m->lora ? m->lora->cfg.rank : 0; }
int64_t mrl_model_lora_num_params(const mrl_model *m) { return m && m->lora ? m->lora->n : 0; }
float *mrl_model_lora_params(mrl_model *m) { return m && m->lora ? m->lora->params : NULL; }
float *mrl_model_lora_grads(mrl_model *m) { return m && m->lora ? m->lora->grads : NULL; }
int mrl_model_lora_num_views(const mrl_model *m) { return m && m->lora ? m->lora->n_views : 0; }

mrl_status mrl_model_lora_view(const mrl_model *m, int i, mrl_param_view *out) {
    return mrl_lora_view(m ? m->lora : NULL, i, out);
}

mrl_status mrl_model_lora_merged(mrl_model *m, float *dst) {
    if (!m || !dst) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_lora_merged: NULL argument");
    if (!m->lora) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_lora_merged: the model has no LoRA adapters");
    if (m->device.kind != MRL_DEVICE_CPU)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "LoRA: merged weights of a model on the CPU only for now");
    const mrl_model_config *c = &m->cfg;
    const mrl_kernels *k = m->k;
    int64_t r = m->lora->cfg.rank, E = c->num_experts;
    float s = m->lora->scale;
    mrl_status st = mrl_model_read_params(m, dst); /* (a frozen base's made whole: quant.c) */
    if (st) return st;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const lora_layer *P = &m->lora->lp[l];
        mrl_layer_matrix mats[7];
        mrl_layer_matrices(c, &m->lp[l], mats);
        for (int i = 0; i < 7; i++) /* W [N,K] += s B [N,r] A [r,K] */
            if (P->A[i])
                k->gemm(0, 0, mats[i].N, mats[i].K, r, s, P->B[i], r, P->A[i], mats[i].K, 1.0f,
                        dst + (mats[i].w - m->params), mats[i].K);
        const float *ew[3] = {m->lp[l].ewg, m->lp[l].ewu, m->lp[l].ewd};
        for (int j = 0; j < 3; j++) {
            if (!P->eA[j]) continue;
            int64_t N, K;
            mrl_expert_matrix(c, j, &N, &K);
            for (int64_t e = 0; e < E; e++)
                k->gemm(0, 0, N, K, r, s, P->eB[j] + e * N * r, r, P->eA[j] + e * r * K, K, 1.0f,
                        dst + (ew[j] - m->params) + e * N * K, K);
        }
    }
    return MRL_OK;
}

void mrl_model_set_training(mrl_model *m, int on, uint64_t key) {
    if (!m) return;
    m->training = on != 0;
    if (m->lora) m->lora->drop_base = key, m->lora->drop_count = 0;
}

void mrl_lora_begin_forward(mrl_model *m) {
    mrl_lora *lo = m->lora;
    if (!lo) return;
    lo->dropping = m->training && lo->cfg.dropout > 0;
    if (lo->dropping) lo->drop_key = mrl_mix64(lo->cfg.seed ^ mrl_mix64(lo->drop_base + ++lo->drop_count));
}

int mrl_lora_dropping(const mrl_model *m) { return m->lora && m->lora->dropping; }

typedef struct drop_ctx {
    const float *x;
    float *xd;
    uint64_t key, cut;
    float scale;
} drop_ctx;

static void drop_range(void *vc, int64_t i0, int64_t i1) {
    const drop_ctx *c = vc;
    for (int64_t i = i0; i < i1; i++)
        c->xd[i] = (mrl_mix64(c->key ^ (uint64_t)i) >> 11) >= c->cut ? c->x[i] * c->scale : 0.0f;
}

/* Element i of a matrix's input is kept when the 53 bits of mix64(key ^ i) are at least p 2^53,
 * key = mix64(the forward's key ^ A's offset in the adapters): a mask of its own for every matrix
 * (every expert's too) and forward, the same in the backward (and in a recomputed forward). */
const float *mrl_lora_drop(const mrl_model *m, const float *A, const float *x, float *xd, int64_t T, int64_t K) {
    if (!xd || !mrl_lora_dropping(m) || T <= 0) return x;
    const mrl_lora *lo = m->lora;
    drop_ctx c = {x, xd, mrl_mix64(lo->drop_key ^ (uint64_t)(A - lo->params)),
                  (uint64_t)(lo->cfg.dropout * 9007199254740992.0), (float)(1.0 / (1.0 - lo->cfg.dropout))};
    mrl_parallel_for(T * K, 1 << 15, drop_range, &c);
    return xd;
}

void mrl_model_lora_changed(mrl_model *m) {
    if (m) atomic_fetch_add(&m->weights_gen, 1); /* (the base's bf16 copies stay as they are) */
}

void mrl_model_lora_enable(mrl_model *m, int on) {
    if (!m || !m->lora) return;
    m->lora->on = on != 0;
    mrl_lora_point(m); /* (the weights' generation stays: a reference's forward turns them off for itself) */
}

void mrl_model_lora_layers(const mrl_model *m, layer_params *layers) {
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) layers[l].lora = m->lp[l].lora;
}

int64_t mrl_model_lora_scratch(const mrl_model *m, int64_t T) {
    if (!m->lora) return 0;
    int64_t rows = T * (m->cfg.num_experts > 0 ? (m->cfg.num_experts_per_tok > 1 ? m->cfg.num_experts_per_tok : 1) : 1);
    return rows * m->lora->cfg.rank;
}

void mrl_lora_fwd(const mrl_kernels *k, const mrl_lora *ad, const float *A, const float *B, const float *x, float *y,
                  int64_t T, int64_t N, int64_t K, float *u) {
    if (!A || T <= 0) return;
    k->lora_fwd(y, u, x, A, B, T, N, K, ad->cfg.rank, ad->scale); /* u = x A^T [T,r]; y += s u B^T */
}

void mrl_lora_bwd(const mrl_model *m, const float *A, const float *B, float *gA, float *gB, const float *x,
                  const float *dy, float *dx, int64_t T, int64_t N, int64_t K, float *u, float *du) {
    if (!A || T <= 0) return;
    const mrl_kernels *k = m->k;
    int64_t r = m->lora->cfg.rank;
    float s = m->lora->scale;
    const float *xd = mrl_lora_drop(m, A, x, m->lora_xd, T, K);       /* (dropout: the forward's mask again) */
    k->gemm(0, 1, T, r, K, 1.0f, xd, K, A, K, 0.0f, u, r);              /* u = xd A^T (again: [T,r] is cheap) */
    k->gemm(1, 0, N, r, T, s, dy, N, u, r, 1.0f, gB, r);                /* dB += s dy^T u [N,r] */
    k->gemm(0, 0, T, r, N, s, dy, N, B, r, 0.0f, du, r);                /* du = s dy B [T,r] */
    k->gemm(1, 0, r, K, T, 1.0f, du, r, xd, K, 1.0f, gA, K);            /* dA += du^T xd [r,K] */
    if (!dx) return;
    if (xd == x) {
        k->gemm(0, 0, T, K, r, 1.0f, du, r, A, K, 1.0f, dx, K);         /* dx += du A */
        return;
    }
    k->gemm(0, 0, T, K, r, 1.0f, du, r, A, K, 0.0f, m->lora_xd, K);     /* dx += mask (du A) / (1 - p) */
    mrl_lora_drop(m, A, m->lora_xd, m->lora_xd, T, K);
    k->add(dx, m->lora_xd, T * K);
}
