/* The generation engine: the model's inference path over a paged KV cache,
 * driven by the continuous-batching scheduler (scheduler.h).
 *
 * One step, for the T tokens the scheduler picked (prefill chunks and
 * decodes mixed), D hidden, Q = Hq*hd, K = Hk*hd, F intermediate:
 *   x = embed[tokens]                                          [T,D]
 *   per layer: ln1, q/k/v (+biases, qwen3 norms), RoPE at the tokens'
 *     positions (mrl_layer_qkv, the trainer's code)             [T,Q] [T,K] [T,K]
 *     K/V -> their cache slots; paged attention over each
 *     sequence's blocks                                         att [T,Q]
 *     x = layer output (mrl_layer_out: o-proj, residual, ln2, SwiGLU MLP)
 *   rows = x[logits_indices]; rmsnorm; logits = rows W_lm^T    [n_logits,V]
 *   sample (mrl_sched_update).
 * The model is seen through core/model/layer.h only. Every op comes from
 * the model's op table (mrl_model_kernels, read at each step), the sampler's
 * too (mrl_sched_set_kernels): a model set to the reference kernels
 * generates with the reference kernels.
 * The weights come from a parameter buffer with the model's layout: the
 * model's own by default (no transfer, no reload after an optimizer step).
 * The layers' matrices are copied into weight panels at the start of each
 * generation round (pack_weights, engine.h): one pass over the weights per
 * round instead of OpenBLAS's packing of every matrix on every step. With
 * the model's dtype bf16 the products read bf16 weight panels and copies
 * instead, the model's own (written by its refresh after an update, the
 * copies shared with the trainer; prepare_weights).
 *
 * On a GPU (the model's device, mrl_model_set_device) the weights, the
 * activations and the KV pool are device memory: each step sends the
 * scheduler's host arrays over in one copy (stage_batch); the sampler reads
 * the logits in place and returns the tokens (the CUDA table's sample).
 * There are no panels on a GPU (cuBLASLt reads the weights as they are).
 *
 * A background run (mrl_engine_run_async) is mrl_engine_run on a thread of
 * its own. The engine's state then belongs to that thread: every other call
 * that reads or writes it is refused until mrl_engine_wait has joined it,
 * except the counters, which the thread publishes after each step under a
 * lock (get_stats, num_unfinished read that copy). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "engine/scheduler.h"
#include "model/layer.h"
#include "moonrl/fault.h"
#include "moonrl/loop.h"
#include "moonrl/mem.h"
#include "base/parallel.h"
#include "moonrl/trace.h"
#include "moonrl/weight_store.h"
#include "base/error.h"
#include "base/rng.h"
#include "runtime/device_internal.h"

/* A captured decode step (CUDA graphs, below forward_step's staging). */
enum { MAX_GRAPHS = 64 };
typedef struct decode_graph {
    int n, width;     /* sequences, block-table width */
    int warm, failed; /* ran once without a graph; capture failed (never graphed) */
    mrl_graph *g;
} decode_graph;

struct mrl_engine {
    mrl_model *m;
    const mrl_model_config *mc; /* the model's */
    mrl_engine_config cfg;
    int latent;              /* multi-head latent attention over a latent cache (cfg.mla_cache, engine.h) */
    int mtp;                 /* speculative decoding with the MTP layer (cfg.mtp): its buffers below */
    float *mtp_h, *mtp_e, *mtp_n, *mtp_cat, *mtp_x, *mtp_rstd; /* [T,D] x3, [T,2D], [T,D], [T] */
    const float *base;       /* the parameter buffer read */
    layer_params *lp;        /* [L] pointing into base */
    mrl_model_weights w;     /* embedding, final norm, lm_head in base */
    mtp_params mtpw;         /* the MTP layer in base (cfg.mtp) */
    mrl_kv_cache *kv;
    mrl_sched *sched;
    mrl_sched_stats done;    /* totals of the schedulers dropped by reset */
    /* activations of one step, for max_num_batched_tokens tokens (act_mem's data, on the model's device) */
    mrl_buffer act_mem;
    void *act_buf;
    layer_acts a;
    int64_t lora_scratch; /* the floats of a.lora_u (LoRA's scratch; 0: none) */
    /* LoRA adapters served beside the weights (mrl_engine_set_adapter), the largest rank among
     * them, and a step's segments of rows by adapter ([max_num_seqs], a step's sequences) */
    const mrl_lora *adapters[MRL_ENGINE_MAX_ADAPTERS + 1];
    uint64_t adapter_gen[MRL_ENGINE_MAX_ADAPTERS + 1]; /* set_adapter calls of each slot: in its K/V's salt */
    int adapter_rank;
    quant_layer *qlayers; /* a quantized base's layers as blocks (a dense model's; NULL: none): steps of
                           * few rows read them in place of making each layer whole */
    lora_seg *segs;
    float *x;                /* [T,D] residual stream */
    float *mla_lse;          /* [T,Hq] a latent cache's prefill in the expanded form: attn_fwd's log-sum-exps */
    float *rows, *rows_n, *rstd_n; /* [S,D] [S,D] [S] the rows that need logits */
    float *logits;           /* [S,V] */
    float *logits_part, *logits_all; /* vocabulary-parallel: this rank's [S,V/tp], the group's [tp,S,V/tp] */
    int32_t *tp_ids, *tp_ids_host;   /* and a step's tokens as rows of its slice (mrl_model_tp_ids; a GPU's staged) */
    int64_t logit_rows;      /* S */
    mrl_buffer attn_ws; /* paged attention's workspace */
    /* on a GPU: the step's host arrays packed (stage_host) and their copy on the device
     * (stage_dev): tokens, positions, slots, logits indices, query starts, lengths, block tables */
    int on_device;
    int reads_own;           /* base is the model's own buffer (rebase) */
    int32_t *stage_host;
    mrl_buffer stage_dev;
    mrl_stream *stream;      /* a GPU: the stream its steps run on (graphs are captured on it) */
    decode_graph graphs[MAX_GRAPHS];
    int n_graphs;
    uint64_t graph_sig;      /* the addresses the graphs hold (graph_signature) */
    int64_t graph_captures, graph_launches, graph_failures;
    float *panels;           /* the layers' matrices as weight panels (cfg.pack_weights; fp32 only) */
    int panels_stale;        /* repack before the next step (a new round, new weights) */
    int64_t packed_gen;      /* the model's weights generation the fp32 panels were packed at (-1: another buffer's) */
    mrl_buffer copy16;       /* bf16: the copies of a buffer not the model's (prepare_weights), */
    mrl_buffer copy_p16;     /* and their bf16 weight panels (pack_weights) */
    const uint16_t *ext16;   /* bf16 copies and panels kept by a model copy (attach_copy): */
    const uint32_t *ext_p16; /* read as they are, nothing converted here */
    /* the background run (mrl_engine_run_async) */
    _Atomic int async;       /* ASYNC_*: claimed with a compare-exchange, so two starts cannot both win */
    _Atomic int pause;       /* mrl_engine_pause: the background run returns after its current step */
    pthread_t thread;
    int async_threads;       /* its OpenMP threads */
    mrl_status async_status; /* its result, and its error message (mrl_last_error is per thread), */
    char async_error[1024];  /* read after the join */
    pthread_mutex_t published_lock;
    mrl_engine_stats published; /* the counters after its latest step */
    int published_unfinished;
    /* weight versions (asynchronous RL) */
    int64_t version;         /* of the weights read now: recorded with every token sampled */
    mrl_weight_store *follow; /* newer versions published here are swapped in between steps */
    int follow_reader;
    /* the routing record (mrl_engine_record_routing), per request id */
    int record_routing;
    int64_t route_width;     /* R = sparse layers x num_experts_per_tok entries a position */
    struct route_rec *routes;
    int routes_cap, next_req; /* next_req: the id the scheduler gives the next request */
};

/* One request's routing record: R int16 a position; the prompt's positions
 * are shared by its samples (a group is prefilled once, then forked), each
 * sample's generated positions are its own. -1 where a position never ran. */
typedef struct route_rec {
    int prompt_len, n, max_new;
    int16_t *prompt; /* [prompt_len, R]; NULL: no record (added with recording off) */
    int16_t *gen;    /* [n, max_new, R] */
} route_rec;

static void route_free(route_rec *r) {
    free(r->prompt);
    free(r->gen);
    memset(r, 0, sizeof(*r));
}

static void routes_clear(mrl_engine *e) {
    for (int i = 0; i < e->routes_cap; i++) route_free(&e->routes[i]);
}

/* Each token of the step's picks in sparse layer number `ord` (e->a.sel) into its request's record. */
static void record_routing(mrl_engine *e, const mrl_sched_batch *b, int ord) {
    int64_t K = e->mc->num_experts_per_tok, R = e->route_width;
    for (int t = 0; t < b->n_tokens; t++) {
        int i = b->seq_index[t], req = b->seq_req[i], pos = b->positions[t];
        route_rec *r = req < e->routes_cap ? &e->routes[req] : NULL;
        if (!r || !r->prompt) continue;
        int64_t g = pos - r->prompt_len;
        if (g >= r->max_new) continue; /* never: a sample feeds back at most max_new - 1 tokens */
        int16_t *dst = g < 0 ? r->prompt + (int64_t)pos * R : r->gen + ((int64_t)b->seq_sample[i] * r->max_new + g) * R;
        for (int64_t j = 0; j < K; j++) dst[ord * K + j] = (int16_t)e->a.sel[(int64_t)t * K + j];
    }
}

enum { ASYNC_IDLE = 0, ASYNC_RUNNING = 1, ASYNC_JOINING = 2 };

/* MRL_OK when the calling thread may use the engine's state, else the busy error. */
static mrl_status check_idle(const mrl_engine *e, const char *what) {
    if (atomic_load(&e->async) == ASYNC_IDLE) return MRL_OK;
    return mrl_set_error(MRL_ERR_INVALID, "engine %s: engine busy: a background run is in progress "
                         "(mrl_engine_wait first)", what);
}

void mrl_engine_config_default(mrl_engine_config *cfg) {
    if (!cfg) return;
    *cfg = (mrl_engine_config){.kv_cache_bytes = (int64_t)256 << 20, .block_size = 16, .max_num_seqs = 256,
                               .max_num_batched_tokens = 2048, .max_model_len = 0, .prefix_caching = 1,
                               .pack_weights = 1, .cuda_graphs = 1};
}

/* Carve the step's activations (base NULL: only count). Returns bytes. */
static int64_t layout(mrl_engine *e, char *base) {
    const mrl_model_config *c = e->mc;
    int64_t T = e->cfg.max_num_batched_tokens, S = e->logit_rows, D = c->hidden_size, F = c->intermediate_size,
            hd = c->head_dim, Hq = c->num_attention_heads, Hk = c->num_key_value_heads, Q = Hq * hd, K = Hk * hd,
            V = mrl_model_whole_vocab(e->m), Vp = mrl_model_tp_vocab(e->m, NULL);
    int64_t off = 0;
    layer_acts *a = &e->a;
#define TAKE(ptr, count) MRL_LAYOUT_TAKE(base, off, ptr, float, count)
    TAKE(e->x, T * D);
    TAKE(a->ln1, T * D);
    TAKE(a->rstd1, T);
    if (mrl_arch_qk_norm(c->arch)) {
        TAKE(a->qraw, T * Q);
        TAKE(a->kraw, T * K);
        TAKE(a->rstdq, T * Hq);
        TAKE(a->rstdk, T * Hk);
    }
    TAKE(a->q, T * Q);
    TAKE(a->k, T * K);
    TAKE(a->v, T * K);
    TAKE(a->att, T * Q);
    off += mrl_mla_acts_layout(c, a, T, base ? base + off : NULL, 3); /* (multi-head latent attention's) */
    if (e->latent) { /* its absorbed form (layer.c, mla_absorb) */
        int64_t W = c->kv_lora_rank + c->qk_rope_head_dim;
        TAKE(a->mla_qcat, T * Hq * W);
        TAKE(a->mla_qabs, T * Hq * W);
        TAKE(a->mla_lat, T * W);
        TAKE(a->mla_olat, T * Hq * c->kv_lora_rank);
        TAKE(e->mla_lse, T * Hq);
    }
    TAKE(a->h, T * D);
    TAKE(a->ln2, T * D);
    TAKE(a->rstd2, T);
    int n_moe = 0, n_dense = 0; /* one set of buffers for all layers: the dense MLP's and the experts' as needed */
    for (int l = 0; l < c->num_hidden_layers + e->mtp; l++) { /* (the MTP layer's too) */
        int moe = mrl_model_layer_is_moe(c, l);
        n_moe += moe, n_dense += !moe;
    }
    if (e->mtp) { /* (engine.h, mtp) */
        TAKE(e->mtp_h, T * D);
        TAKE(e->mtp_e, T * D);
        TAKE(e->mtp_n, T * D);
        TAKE(e->mtp_cat, T * 2 * D);
        TAKE(e->mtp_x, T * D);
        TAKE(e->mtp_rstd, T);
    }
    if (n_dense) {
        TAKE(a->gate, T * F);
        TAKE(a->up, T * F);
        TAKE(a->act, T * F);
    }
    if (n_moe) off += mrl_moe_acts_layout(c, a, T, base ? base + off : NULL);
    /* the adapters' (lora.c): the model's, if it has them now, or the largest served */
    e->lora_scratch = mrl_model_lora_scratch(e->m, T);
    if (e->lora_scratch < T * e->adapter_rank) e->lora_scratch = T * e->adapter_rank;
    if (e->lora_scratch) TAKE(a->lora_u, e->lora_scratch);
    else if (base) a->lora_u = NULL;
    TAKE(e->rows, S * D);
    TAKE(e->rows_n, S * D);
    TAKE(e->rstd_n, S);
    TAKE(e->logits, S * V);
    if (Vp) { /* (tensor parallel, tp.c) */
        TAKE(e->logits_part, S * Vp);
        TAKE(e->logits_all, S * V);
        MRL_LAYOUT_TAKE(base, off, e->tp_ids, int32_t, T);
    }
#undef TAKE
    return off;
}

/* Point the layer / embedding / head pointers at `base` (model layout). */
static void rebase(mrl_engine *e, const float *base) {
    mrl_model_weights_at(e->m, base, &e->w, e->lp);
    mrl_model_mtp_at(e->m, base, &e->mtpw);
    e->base = base;
    e->reads_own = base == mrl_model_params(e->m);
}

/* Layer l's parameters, the MTP layer's after the last (cfg.mtp: its panels packed too). */
static layer_params *panel_layer(mrl_engine *e, int l) {
    return l < e->mc->num_hidden_layers ? &e->lp[l] : &e->mtpw.layer;
}

/* The panels' floats; with e->panels, also point each layer's matrices at
 * their place in it (one walk gives both, so they cannot disagree). */
static int64_t point_panels(mrl_engine *e) {
    mrl_layer_matrix mats[7];
    int64_t off = 0;
    for (int l = 0; l < e->mc->num_hidden_layers + e->mtp; l++) {
        mrl_layer_matrices(e->mc, panel_layer(e, l), mats);
        for (int i = 0; i < 7; i++) {
            if (!mats[i].w) continue; /* a sparse layer's MLP: its experts are read in place */
            if (e->panels) *mats[i].panels = e->panels + off;
            off += mrl_panels_floats(mats[i].N, mats[i].K);
        }
    }
    return off;
}

/* Matrices [first, last) of all layers' seven, each into the panels its layer points at. */
static void pack_range(void *ctx, int64_t first, int64_t last) {
    mrl_engine *e = ctx;
    const mrl_kernels *k = mrl_model_kernels(e->m);
    mrl_layer_matrix mats[7];
    for (int64_t index = first; index < last; index++) {
        mrl_layer_matrices(e->mc, panel_layer(e, (int)(index / 7)), mats);
        const mrl_layer_matrix *mat = &mats[index % 7];
        if (!mat->w) continue;
        k->panels_pack((float *)*mat->panels, mat->w, mat->N, mat->K); /* e->panels, ours to write */
    }
}

/* Copy the weights read (base) into the panels, the matrices spread over the threads. */
static void pack_panels(mrl_engine *e) {
    point_panels(e); /* rebase (attach_params) leaves the layers without panel pointers */
    mrl_parallel_for((int64_t)(e->mc->num_hidden_layers + e->mtp) * 7, 1, pack_range, e);
    e->panels_stale = 0;
    e->packed_gen = e->reads_own ? mrl_model_weights_generation(e->m) : -1;
}

/* The weights this step's products read. fp32: the panels, repacked when
 * stale. bf16 (the model's dtype, moonrl/model.h): reading the model's own
 * buffer, its bf16 copies and (pack_weights) bf16 weight panels of the
 * layers' matrices and the head, both written by the model's one refresh
 * after its weights change (the trainer reads the same copies: no copy per
 * round); another buffer (attach_params, a weight store): copies and
 * panels of our own, converted when stale as the fp32 panels are. */
static mrl_status prepare_weights(mrl_engine *e) {
    /* LoRA: the model's adapters as they are now (on, off), read in place; adapters made after the
     * engine (a run that trains them after a full warm-up) need their scratch: the activations
     * are laid out again (the graphs, which hold their addresses, are dropped with them) */
    int64_t need = mrl_model_lora_scratch(e->m, e->cfg.max_num_batched_tokens);
    if (need < (int64_t)e->cfg.max_num_batched_tokens * e->adapter_rank)
        need = (int64_t)e->cfg.max_num_batched_tokens * e->adapter_rank;
    if (need > e->lora_scratch) {
        mrl_buffer_free(&e->act_mem);
        e->act_buf = NULL;
        int64_t bytes = layout(e, NULL);
        if (mrl_buffer_alloc(mrl_model_get_device(e->m), (size_t)bytes, MRL_MEM_ACTIVATIONS, &e->act_mem))
            return mrl_wrap_error(MRL_ERR_NOMEM, "engine step: no memory for the activations with LoRA's scratch "
                                  "(%lld bytes)", (long long)bytes);
        e->act_buf = e->act_mem.data;
        layout(e, e->act_buf);
    }
    /* (the model's own adapters apply to its own buffer: another one holds whole weights of its own,
     * e.g. a copy with the adapters merged in) */
    if (e->reads_own) mrl_model_lora_layers(e->m, e->lp);
    else
        for (int l = 0; l < e->mc->num_hidden_layers; l++) e->lp[l].lora = NULL;
    if (mrl_model_dtype(e->m) != MRL_MODEL_BF16) {
        if (e->w.lm_head16) { /* switched back to fp32 (its fp32 panels were dropped then) */
            mrl_model_weights16_at(e->m, NULL, &e->w, e->lp);
            mrl_model_panels16_at(e->m, NULL, &e->w, e->lp);
        }
        if (e->panels && e->panels_stale) pack_panels(e);
        return MRL_OK;
    }
    if (e->panels) { /* fp32 panels, of a model switched to bf16 since: not read again */
        mrl_mem_free(e->panels);
        e->panels = NULL;
    }
    const uint16_t *w16;
    const uint32_t *p16 = NULL; /* none: the products read the plain copies */
    int pack = e->cfg.pack_weights && !e->on_device;
    if (e->ext16) {
        w16 = e->ext16;
        if (pack) p16 = e->ext_p16;
    } else if (e->base == mrl_model_params(e->m)) {
        w16 = mrl_model_bf16_params(e->m);
        if (pack) p16 = mrl_model_bf16_panels(e->m); /* NULL without the memory: the plain copies do */
    } else {
        if (!e->copy16.data) {
            int64_t n = mrl_model_num_params(e->m);
            if (mrl_buffer_alloc(mrl_model_get_device(e->m), (size_t)n * sizeof(uint16_t), MRL_MEM_PARAMS, &e->copy16))
                return mrl_wrap_error(MRL_ERR_NOMEM, "engine step: no memory for the bf16 copy of the weights "
                                     "(%lld bytes)", (long long)n * 2);
            if (pack) mrl_buffer_alloc(mrl_model_get_device(e->m), (size_t)mrl_model_panels16_bytes(e->m), MRL_MEM_PARAMS,
                                       &e->copy_p16); /* failing: none */
            e->panels_stale = 1;
        }
        if (e->panels_stale) {
            mrl_model_bf16_convert(e->m, e->base, e->copy16.data);
            if (e->copy_p16.data) mrl_model_bf16_pack_panels(e->m, e->copy16.data, e->copy_p16.data);
        }
        w16 = e->copy16.data;
        p16 = e->copy_p16.data;
    }
    mrl_model_weights16_at(e->m, w16, &e->w, e->lp);
    mrl_model_panels16_at(e->m, p16, &e->w, e->lp); /* pq .. pd: the bf16 panels, or NULL */
    e->panels_stale = 0;
    return MRL_OK;
}

/* A new scheduler over the cache (created on first use, else cleared). */
static mrl_status new_sched(mrl_engine *e) {
    const mrl_model_config *c = e->mc;
    mrl_kv_cache_config kc = {.n_layers = c->num_hidden_layers + e->mtp, .n_kv_heads = c->num_key_value_heads,
                              .head_dim = c->head_dim, .block_size = e->cfg.block_size, .latent = e->latent,
                              .budget_bytes = e->cfg.kv_cache_bytes, .prefix_caching = e->cfg.prefix_caching,
                              .bf16 = e->cfg.kv_cache_dtype == MRL_KV_BF16 ||
                                      (e->cfg.kv_cache_dtype == MRL_KV_AUTO && mrl_model_dtype(e->m) == MRL_MODEL_BF16),
                              .k = mrl_model_kernels(e->m), .device = mrl_model_get_device(e->m)};
    if (e->latent) kc.n_kv_heads = 1, kc.head_dim = c->kv_lora_rank + c->qk_rope_head_dim; /* a row a token */
    mrl_status st = e->kv ? mrl_kv_cache_clear(e->kv) : mrl_kv_cache_create(&kc, &e->kv);
    if (st) return st;
    mrl_sched_config sc = {.max_num_seqs = e->cfg.max_num_seqs,
                           .max_num_batched_tokens = e->cfg.max_num_batched_tokens,
                           .max_model_len = e->cfg.max_model_len, .vocab_size = mrl_model_whole_vocab(e->m)};
    st = mrl_sched_create(&sc, e->kv, &e->sched);
    if (!st) mrl_sched_set_version(e->sched, e->version);
    if (!st) mrl_sched_set_mtp(e->sched, e->mtp);
    return st;
}

static void drop_sched(mrl_engine *e) {
    if (e->sched) {
        mrl_sched_stats s;
        mrl_sched_get_stats(e->sched, &s);
        e->done.steps += s.steps;
        e->done.prefill_tokens += s.prefill_tokens;
        e->done.decode_tokens += s.decode_tokens;
        e->done.prefix_hit_tokens += s.prefix_hit_tokens;
        e->done.preemptions += s.preemptions;
        e->done.forks += s.forks;
        e->done.generated_tokens += s.generated_tokens;
        e->done.spec_drafts += s.spec_drafts;
        e->done.spec_accepted += s.spec_accepted;
    }
    mrl_sched_destroy(e->sched);
    e->sched = NULL;
}

static mrl_status join_run(mrl_engine *e);
static void drop_graphs(mrl_engine *e);

void mrl_engine_free(mrl_engine *e) {
    if (!e) return;
    if (atomic_load(&e->async) == ASYNC_RUNNING) join_run(e); /* never free what the thread uses */
    pthread_mutex_destroy(&e->published_lock);
    drop_sched(e);
    mrl_kv_cache_destroy(e->kv);
    drop_graphs(e);
    mrl_stream_destroy(e->stream);
    mrl_buffer_free(&e->act_mem);
    mrl_mem_free(e->segs);
    mrl_buffer_free(&e->attn_ws);
    mrl_buffer_free(&e->stage_dev);
    mrl_mem_free(e->stage_host);
    mrl_mem_free(e->tp_ids_host);
    mrl_mem_free(e->panels);
    mrl_mem_free(e->qlayers);
    mrl_buffer_free(&e->copy16);
    mrl_buffer_free(&e->copy_p16);
    mrl_mem_free(e->lp);
    routes_clear(e);
    free(e->routes);
    mrl_mem_free(e);
}

/* Bytes of physical memory (sysconf), 0 when unknown. */
static int64_t physical_memory(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? (int64_t)pages * page : 0;
}

mrl_status mrl_engine_create(mrl_model *model, const mrl_engine_config *cfg, mrl_engine **out) {
    if (!out) return mrl_set_error(MRL_ERR_INVALID, "engine create: NULL out");
    *out = NULL;
    if (!model || !cfg) return mrl_set_error(MRL_ERR_INVALID, "engine create: NULL model or config");
    mrl_engine_config c = *cfg;
    mrl_device device = mrl_model_get_device(model);
    int on_device = mrl_model_kernels(model)->on_device;
    if (on_device) c.pack_weights = 0; /* panels are the CPU's layout */
    if (mrl_model_quantized_bytes(model) > 0) /* a quantized base: its blocks read, or a layer made whole at a */
        c.pack_weights = 0, c.cuda_graphs = 0;    /* time (no copy of them all; a layer's pages change each step) */
    const mrl_model_config *mc = mrl_model_get_config(model);
    if (c.max_model_len <= 0) c.max_model_len = mc->max_position_embeddings;
    /* every size is checked before anything is allocated from it */
#define BOUND(field, lo, hi)                                                                                     \
    if (c.field < (lo) || c.field > (hi))                                                                        \
        return mrl_set_error(MRL_ERR_INVALID, "engine create: " #field " = %lld (must be in %lld..%lld)",       \
                             (long long)c.field, (long long)(lo), (long long)(hi));
    BOUND(block_size, 1, 4096)
    BOUND(max_num_seqs, 1, 1 << 20)
    BOUND(max_num_batched_tokens, 1, 1 << 24)
    BOUND(max_model_len, 2, INT32_MAX)
    BOUND(kv_cache_dtype, MRL_KV_AUTO, MRL_KV_BF16)
    BOUND(mla_cache, MRL_MLA_LATENT, MRL_MLA_EXPANDED)
    BOUND(mtp, 0, 1)
#undef BOUND
    if (c.mtp && mc->num_nextn_predict_layers != 1)
        return mrl_set_error(MRL_ERR_INVALID, "engine create: mtp = 1 needs a model with a multi-token prediction layer "
                             "(num_nextn_predict_layers 1; the model has %d)", mc->num_nextn_predict_layers);
    if (c.mtp && (on_device || mrl_model_tp(model, NULL, NULL) > 1))
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "engine create: speculative decoding with the MTP layer (mtp = 1) is "
                             "not yet on a GPU or under tensor parallel");
    int64_t phys = on_device ? 0 : physical_memory(); /* a GPU's own allocator says when it has too little */
    if (c.kv_cache_bytes <= 0 || (phys > 0 && c.kv_cache_bytes > phys))
        return mrl_set_error(MRL_ERR_INVALID, "engine create: kv_cache_bytes = %lld (%.1f GiB): the KV cache must be > 0 "
                             "and at most this machine's physical memory (%lld bytes, %.1f GiB)", (long long)c.kv_cache_bytes,
                             c.kv_cache_bytes / 1073741824.0, (long long)phys, phys / 1073741824.0);
    /* rows needing logits in one step: at most one per running sequence */
    mrl_engine probe = {.m = model, .mc = mc, .cfg = c, .on_device = on_device,
                        .latent = mrl_model_is_mla(mc) && c.mla_cache == MRL_MLA_LATENT};
    probe.mtp = c.mtp;
    int64_t seq_rows = (int64_t)c.max_num_seqs * (c.mtp ? 2 : 1); /* (a draft's sample: two rows of logits) */
    probe.logit_rows = seq_rows < c.max_num_batched_tokens ? seq_rows : c.max_num_batched_tokens;
    int64_t bytes = layout(&probe, NULL);
    if (phys > 0 && bytes > phys)
        return mrl_set_error(MRL_ERR_INVALID, "engine create: the activations of max_num_batched_tokens = %d tokens "
                             "with logits for %lld rows (max_num_seqs = %d) take %lld bytes (%.1f GiB), more than "
                             "this machine's physical memory (%lld bytes)", c.max_num_batched_tokens,
                             (long long)probe.logit_rows, c.max_num_seqs, (long long)bytes, bytes / 1073741824.0,
                             (long long)phys);
    mrl_engine *e = mrl_mem_alloc(sizeof(*e), MRL_MEM_OTHER);
    if (!e) return mrl_wrap_error(MRL_ERR_NOMEM, "engine create");
    *e = probe;
    e->route_width = (int64_t)mrl_model_num_moe_layers(model) * mc->num_experts_per_tok;
    pthread_mutex_init(&e->published_lock, NULL); /* before any path to mrl_engine_free */
    mrl_status st = MRL_OK;
    e->lp = mrl_mem_alloc(sizeof(layer_params) * mc->num_hidden_layers, MRL_MEM_OTHER);
    if (e->lp && mrl_buffer_alloc(device, (size_t)bytes, MRL_MEM_ACTIVATIONS, &e->act_mem) == MRL_OK)
        e->act_buf = e->act_mem.data;
    if (!e->act_buf)
        st = mrl_wrap_error(MRL_ERR_NOMEM, "engine create: no memory for the activations of %d tokens (%lld bytes)",
                           c.max_num_batched_tokens, (long long)bytes);
    if (!st) {
        layout(e, e->act_buf);
        rebase(e, mrl_model_params(model));
    }
    if (!st && mrl_model_quantized_bytes(model) > 0 && mc->num_experts == 0) {
        e->qlayers = mrl_mem_alloc(sizeof(quant_layer) * (size_t)mc->num_hidden_layers, MRL_MEM_OTHER);
        if (!e->qlayers) st = mrl_wrap_error(MRL_ERR_NOMEM, "engine create: a quantized base's layer tables");
        for (int l = 0; !st && l < mc->num_hidden_layers; l++) mrl_model_quant_layer(model, l, &e->qlayers[l]);
    }
    if (!st && e->tp_ids && on_device) { /* (tensor parallel: the step's slice rows, made on the host) */
        e->tp_ids_host = mrl_mem_alloc(sizeof(int32_t) * (size_t)c.max_num_batched_tokens, MRL_MEM_ACTIVATIONS);
        if (!e->tp_ids_host) st = mrl_wrap_error(MRL_ERR_NOMEM, "engine create: tensor parallel's token rows");
    }
    if (!st && c.pack_weights && mrl_model_dtype(model) != MRL_MODEL_BF16) { /* bf16 reads bf16 copies */
        int64_t floats = point_panels(e); /* no panels yet: only counts */
        e->panels = mrl_mem_alloc((size_t)floats * sizeof(float), MRL_MEM_PARAMS);
        if (!e->panels)
            st = mrl_wrap_error(MRL_ERR_NOMEM, "engine create: no memory for the weight panels (%lld bytes; "
                               "pack_weights = 0 reads the weights in place)", (long long)floats * 4);
        e->panels_stale = 1;
    }
    if (!st && on_device) st = mrl_stream_create(device, &e->stream); /* its steps' stream (graphs need one) */
    if (!st) st = new_sched(e);
    if (!st) { /* RoPE for the longest sequence the engine can hold, not for max_model_len unseen */
        int64_t cache_tokens = (int64_t)mrl_kv_cache_num_blocks(e->kv) * c.block_size;
        st = mrl_model_rope_prepare(model, c.max_model_len < cache_tokens ? c.max_model_len : cache_tokens);
    }
    if (st) {
        mrl_engine_free(e);
        return st;
    }
    *out = e;
    return MRL_OK;
}

/* A new round (a reset, a request added to an engine with none unfinished): the weights may have
 * moved. The model's own buffer says so (its weights generation, mrl_model_weights_changed, as its
 * bf16 copies are refreshed): its fp32 panels are packed again only then; another buffer's always. */
static void new_round(mrl_engine *e) {
    if (!e->reads_own || e->packed_gen != mrl_model_weights_generation(e->m)) e->panels_stale = 1;
}

mrl_status mrl_engine_reset(mrl_engine *e) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine reset: NULL engine");
    mrl_status st = check_idle(e, "reset");
    if (st) return st;
    drop_sched(e); /* frees the sequences of unfinished requests too */
    routes_clear(e); /* request ids restart at 0 */
    e->next_req = 0;
    new_round(e);
    return new_sched(e);
}

/* Read `params` (NULL: the model's own) from the next step on. Nothing
 * reads the previous buffer afterwards: the layers' pointers move now, and
 * the panels (the only copy of the old matrices) are repacked from the new
 * buffer before the next step runs. */
static mrl_status use_params(mrl_engine *e, const float *params, int64_t n_params, const char *what) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine %s: NULL engine", what);
    mrl_status st = check_idle(e, what);
    if (st) return st;
    if (params && n_params != mrl_model_num_params(e->m))
        return mrl_set_error(MRL_ERR_INVALID, "engine %s: buffer of %lld floats, the model has %lld", what,
                             (long long)n_params, (long long)mrl_model_num_params(e->m));
    mrl_device want = mrl_model_get_device(e->m), got = mrl_device_of(params);
    if (params && (got.kind != want.kind || got.index != want.index))
        return mrl_set_error(MRL_ERR_INVALID, "engine %s: the buffer is %s memory, the model's weights are on %s", what,
                             got.kind == MRL_DEVICE_CPU ? "host" : "GPU", want.kind == MRL_DEVICE_CPU ? "the host" : "a GPU");
    rebase(e, params ? params : mrl_model_params(e->m));
    e->ext16 = NULL, e->ext_p16 = NULL;
    e->panels_stale = 1;
    return MRL_OK;
}

mrl_status mrl_engine_attach_params(mrl_engine *e, const float *params, int64_t n_params) {
    mrl_status st = use_params(e, params, n_params, "attach_params");
    return st ? st : mrl_engine_reset(e);
}

mrl_status mrl_engine_attach_copy(mrl_engine *e, const mrl_model_copy *c) {
    if (!c) return mrl_engine_attach_params(e, NULL, 0);
    mrl_status st = use_params(e, mrl_model_copy_params(c), e ? mrl_model_num_params(e->m) : 0, "attach_copy");
    if (st) return st;
    mrl_buffer_free(&e->copy16); /* (the copies of a buffer attached before: not read again) */
    mrl_buffer_free(&e->copy_p16);
    e->ext16 = mrl_model_copy_bf16(c), e->ext_p16 = mrl_model_copy_panels(c);
    return mrl_engine_reset(e);
}

mrl_status mrl_engine_swap_params(mrl_engine *e, const float *params, int64_t n_params) {
    return use_params(e, params, n_params, "swap_params"); /* requests, sequences and cache stay */
}

mrl_status mrl_engine_set_adapter(mrl_engine *e, int slot, const mrl_lora *ad) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine set_adapter: NULL engine");
    mrl_status st = check_idle(e, "set_adapter");
    if (st) return st;
    if (slot < 1 || slot > MRL_ENGINE_MAX_ADAPTERS)
        return mrl_set_error(MRL_ERR_INVALID, "engine set_adapter: slot %d is outside 1..%d", slot, MRL_ENGINE_MAX_ADAPTERS);
    if (ad && e->mc->num_experts > 0)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "engine set_adapter: a mixture-of-experts model serves its own "
                             "adapters only (its experts see their rows grouped by expert, not by request)");
    if (ad && (e->on_device || mrl_model_tp_vocab(e->m, NULL) || mrl_model_whole_vocab(e->m) != e->mc->vocab_size))
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "engine set_adapter: a whole model on the CPU only for now");
    if (!e->segs) {
        e->segs = mrl_mem_alloc(sizeof(lora_seg) * (size_t)e->cfg.max_num_seqs, MRL_MEM_OTHER);
        if (!e->segs) return mrl_wrap_error(MRL_ERR_NOMEM, "engine set_adapter");
    }
    e->adapters[slot] = ad;
    e->adapter_rank = 0;
    for (int i = 1; i <= MRL_ENGINE_MAX_ADAPTERS; i++)
        if (e->adapters[i] && mrl_lora_rank(e->adapters[i]) > e->adapter_rank) e->adapter_rank = mrl_lora_rank(e->adapters[i]);
    e->adapter_gen[slot]++; /* (a slot's cached blocks were another adapter's K/V) */
    return MRL_OK;
}

mrl_status mrl_engine_add_request(mrl_engine *e, const mrl_engine_request *r, int *req_id) {
    if (!e || !r || !req_id) return mrl_set_error(MRL_ERR_INVALID, "engine add_request: NULL argument");
    mrl_status st = check_idle(e, "add_request");
    if (st) return st;
    if (r->adapter < 0 || r->adapter > MRL_ENGINE_MAX_ADAPTERS || (r->adapter && !e->adapters[r->adapter]))
        return mrl_set_error(MRL_ERR_INVALID, "engine add_request: no LoRA adapter in slot %d", r->adapter);
    int V = mrl_model_whole_vocab(e->m);
    for (int i = 0; i < r->n_eos; i++)
        if (r->eos_ids && (r->eos_ids[i] < 0 || r->eos_ids[i] >= V))
            return mrl_set_error(MRL_ERR_INVALID, "engine add_request: eos id %d is outside the vocabulary (%d)",
                                 r->eos_ids[i], V);
    for (int i = 0; i < r->n_stop; i++)
        if (r->stop_ids && (r->stop_ids[i] < 0 || r->stop_ids[i] >= V))
            return mrl_set_error(MRL_ERR_INVALID, "engine add_request: stop id %d is outside the vocabulary (%d)",
                                 r->stop_ids[i], V);
    if (mrl_sched_num_unfinished(e->sched) == 0) new_round(e);
    mrl_sched_request q = {.prompt = r->prompt, .prompt_len = r->prompt_len, .n = r->n,
                           .max_new_tokens = r->max_new_tokens, .eos_ids = r->eos_ids, .n_eos = r->n_eos,
                           .stop_ids = r->stop_ids, .n_stop = r->n_stop, .params = r->params, .seed = r->seed,
                           .step = r->step, .prompt_index = r->prompt_index,
                           .first_sample = r->first_sample, .top_logprobs = r->top_logprobs,
                           .adapter = r->adapter,
                           .kv_salt = r->adapter ? mrl_mix64(((uint64_t)r->adapter << 32) ^ e->adapter_gen[r->adapter]) : 0};
    if (!e->record_routing || e->route_width == 0 || r->prompt_len < 1 || r->n < 1 || r->max_new_tokens < 1) {
        st = mrl_sched_add(e->sched, &q, req_id); /* (bad sizes: the scheduler's error) */
        if (!st) e->next_req = *req_id + 1;
        return st;
    }
    /* the record first, so that a request is never queued without the record it was asked with */
    int max_new = r->max_new_tokens; /* what a sample can generate: the scheduler stops it at max_model_len */
    if (max_new > e->cfg.max_model_len - r->prompt_len) max_new = e->cfg.max_model_len - r->prompt_len;
    if (max_new < 1) max_new = 1; /* (a prompt too long: the scheduler's error below) */
    int64_t R = e->route_width, P = r->prompt_len, G = (int64_t)r->n * max_new;
    route_rec rec = {.prompt_len = r->prompt_len, .n = r->n, .max_new = max_new,
                     .prompt = malloc(sizeof(int16_t) * P * R), .gen = malloc(sizeof(int16_t) * G * R)};
    if (e->next_req >= e->routes_cap) { /* room for the id the scheduler gives next (they count from 0) */
        int cap = e->routes_cap ? e->routes_cap : 16;
        while (cap <= e->next_req) cap *= 2;
        route_rec *grown = realloc(e->routes, sizeof(route_rec) * cap);
        if (grown) {
            memset(grown + e->routes_cap, 0, sizeof(route_rec) * (cap - e->routes_cap));
            e->routes = grown;
            e->routes_cap = cap;
        }
    }
    if (!rec.prompt || !rec.gen || e->next_req >= e->routes_cap) {
        route_free(&rec);
        return mrl_set_error(MRL_ERR_NOMEM, "engine add_request: no memory for the routing record (%lld bytes)",
                             (long long)((P + G) * R * 2));
    }
    memset(rec.prompt, 0xff, sizeof(int16_t) * P * R); /* -1: not run (yet) */
    memset(rec.gen, 0xff, sizeof(int16_t) * G * R);
    st = mrl_sched_add(e->sched, &q, req_id);
    if (!st && *req_id != e->next_req) /* never: the scheduler numbers requests 0, 1, ... until a reset */
        st = mrl_set_error(MRL_ERR_INTERNAL, "engine add_request: request id %d, %d expected", *req_id, e->next_req);
    if (st) {
        route_free(&rec);
        return st;
    }
    e->next_req = *req_id + 1;
    route_free(&e->routes[*req_id]);
    e->routes[*req_id] = rec;
    return MRL_OK;
}

mrl_status mrl_engine_record_routing(mrl_engine *e, int on) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine record_routing: NULL engine");
    mrl_status st = check_idle(e, "record_routing");
    if (!st) e->record_routing = on != 0;
    return st;
}

mrl_status mrl_engine_get_output_routing(mrl_engine *e, int req_id, int sample, int16_t *out, int64_t cap,
                                         int64_t *n_positions) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine get_output_routing: NULL engine");
    mrl_status st = check_idle(e, "get_output_routing");
    if (st) return st;
    int n = 0;
    st = mrl_sched_output(e->sched, req_id, sample, NULL, NULL, NULL, &n, NULL);
    if (st) return st;
    const route_rec *r = req_id < e->routes_cap ? &e->routes[req_id] : NULL;
    if (!r || !r->prompt)
        return mrl_set_error(MRL_ERR_INVALID, "engine get_output_routing: request %d has no routing record (added "
                             "with recording off, or a model without sparse layers)", req_id);
    int64_t R = e->route_width, P = r->prompt_len, total = (P + n) * R;
    if (n_positions) *n_positions = P + n;
    if (!out) return MRL_OK;
    if (cap < total)
        return mrl_set_error(MRL_ERR_INVALID, "engine get_output_routing: room for %lld entries, sample %d of request "
                             "%d needs %lld ((prompt + generated) x sparse layers x num_experts_per_tok)",
                             (long long)cap, sample, req_id, (long long)total);
    memcpy(out, r->prompt, sizeof(int16_t) * P * R);
    memcpy(out + P * R, r->gen + (int64_t)sample * r->max_new * R, sizeof(int16_t) * n * R);
    return MRL_OK;
}

/* On a GPU: the batch's host arrays the ops read, packed and sent over in
 * one copy; *d is b with its pointers into the device's copy, its block
 * tables `width` wide (>= b's: a decode graph's, padded with block 0,
 * which no sequence reads past its length). */
static mrl_status stage_batch(mrl_engine *e, const mrl_sched_batch *b, mrl_sched_batch *d, int width) {
    *d = *b;
    if (!e->on_device) return MRL_OK;
    struct { const int32_t *src; int64_t n; const int32_t **dst; } parts[] = {
        {b->token_ids, b->n_tokens, &d->token_ids},         {b->positions, b->n_tokens, &d->positions},
        {b->slot_mapping, b->n_tokens, &d->slot_mapping},   {b->logits_indices, b->n_logits, &d->logits_indices},
        {b->query_start, b->n_seqs + 1, &d->query_start},   {b->seq_lens, b->n_seqs, &d->seq_lens},
        {NULL, (int64_t)b->n_seqs * width, &d->block_tables}};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) total += parts[i].n;
    if ((size_t)total * sizeof(int32_t) > e->stage_dev.bytes) { /* grown by half again: few regrowths */
        mrl_buffer_free(&e->stage_dev);
        mrl_mem_free(e->stage_host);
        int64_t cap = total + total / 2 + 64;
        e->stage_host = mrl_mem_alloc((size_t)cap * sizeof(int32_t), MRL_MEM_ACTIVATIONS);
        mrl_status st = e->stage_host ? mrl_buffer_alloc(mrl_model_get_device(e->m), (size_t)cap * sizeof(int32_t),
                                                         MRL_MEM_ACTIVATIONS, &e->stage_dev)
                                      : MRL_ERR_NOMEM;
        if (st) {
            mrl_mem_free(e->stage_host);
            e->stage_host = NULL;
            return mrl_set_error(MRL_ERR_NOMEM, "engine step: no memory for the batch's %lld indices", (long long)total);
        }
    }
    int64_t off = 0;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        int32_t *at = e->stage_host + off;
        if (parts[i].src && parts[i].n > 0) {
            memcpy(at, parts[i].src, sizeof(int32_t) * parts[i].n);
        } else if (!parts[i].src) { /* the block tables, rows re-laid `width` wide */
            memset(at, 0, sizeof(int32_t) * parts[i].n);
            for (int s = 0; s < b->n_seqs; s++)
                memcpy(at + (int64_t)s * width, b->block_tables + (int64_t)s * b->max_blocks_per_seq,
                       sizeof(int32_t) * b->max_blocks_per_seq);
        }
        *parts[i].dst = (const int32_t *)e->stage_dev.data + off;
        off += parts[i].n;
    }
    d->max_blocks_per_seq = width;
    return mrl_model_kernels(e->m)->to_device(e->stage_dev.data, e->stage_host, off * (int64_t)sizeof(int32_t));
}

/* LoRA: the step's rows in segments by adapter (mrl_engine_set_adapter), each sequence's rows
 * with its request's slot (0: the model's own adapters, or none); the count, or 0 when no request
 * of the step names a slot (the layers then read the model's own, p->lora). */
static int step_segments(mrl_engine *e, const mrl_sched_batch *hb) {
    if (!e->segs || !e->adapter_rank) return 0;
    int n = 0, any = 0;
    for (int i = 0; i < hb->n_seqs; i++) {
        int slot = mrl_sched_request_adapter(e->sched, hb->seq_req[i]);
        const mrl_lora *ad = slot ? e->adapters[slot] : e->reads_own ? mrl_model_lora_on(e->m) : NULL;
        int64_t r0 = hb->query_start[i], rows = hb->query_start[i + 1] - r0;
        any |= slot != 0;
        if (n > 0 && e->segs[n - 1].ad == ad) { /* (the sequences' rows are contiguous, in order) */
            e->segs[n - 1].rows += rows;
            continue;
        }
        e->segs[n++] = (lora_seg){r0, rows, ad, NULL};
    }
    return any ? n : 0;
}

/* A quantized base's steps of at most this many rows read its blocks (qgemm), longer ones make
 * each layer whole: reading the blocks costs its dequantization once per row of W, which few rows
 * share, where the library's product of a whole layer is faster for many. */
#define QGEMM_ROWS 64

/* Layer l of a step over the paged K/V cache (the residual stream x [T,D], in place): q, k, v, the
 * new K/V into their slots, paged attention over each sequence's, the rest of the layer. */
static mrl_status paged_layer(mrl_engine *e, layer_params *p, const mrl_sched_batch *b, int l, int64_t T, float *x) {
    const mrl_model *m = e->m;
    const mrl_model_config *c = e->mc;
    const mrl_kernels *k = mrl_model_kernels(m);
    int Hq = c->num_attention_heads, Hk = c->num_key_value_heads, hd = c->head_dim;
    mrl_layer_qkv(m, p, &e->a, x, b->positions, T);
    if (mrl_kv_cache_get_config(e->kv)->bf16)
        k->paged_kv_write_bf16(mrl_kv_cache_k(e->kv, l), mrl_kv_cache_v(e->kv, l), e->a.k, e->a.v, b->slot_mapping, T,
                               Hk, hd, e->cfg.block_size);
    else
        k->paged_kv_write(mrl_kv_cache_k(e->kv, l), mrl_kv_cache_v(e->kv, l), e->a.k, e->a.v, b->slot_mapping, T, Hk,
                          hd, e->cfg.block_size);
    mrl_paged_attn args;
    mrl_status st = mrl_sched_attn_args(b, e->kv, l, Hq, e->a.q, e->a.att, &args);
    if (st) return st;
    args.scale = mrl_model_attn_scale(c); /* (the cache's scale is 1/sqrt(head_dim); MLA's is not) */
    int64_t need = k->paged_attn_workspace(&args); /* (the CUDA kernel needs none) */
    if (need > (int64_t)e->attn_ws.bytes) {
        mrl_buffer_free(&e->attn_ws);
        mrl_buffer_alloc(mrl_model_get_device(m), (size_t)(need + need / 2), MRL_MEM_ACTIVATIONS, &e->attn_ws);
    }
    if (e->attn_ws.data) {
        args.workspace = e->attn_ws.data;
        args.workspace_bytes = (int64_t)e->attn_ws.bytes;
    }
    if ((st = k->paged_attn(&args))) return st;
    mrl_layer_out(m, p, &e->a, x, x, T);
    return MRL_OK;
}

/* A step over the latent cache with whole prompts and other rows (decodes, later chunks) together:
 * the whole prompts' sequences in the expanded form (attention over their own rows), the others'
 * in the absorbed form over the cache; runs of sequences of one form each one call. Every row's
 * latent row is cached; att_v is each form's output (mrl_layer_out reads it as it is). */
static mrl_status mixed_layer(mrl_engine *e, layer_params *p, const mrl_sched_batch *hb, const mrl_sched_batch *b,
                              int l, int64_t T, float *x) {
    const mrl_model *m = e->m;
    const mrl_model_config *c = e->mc;
    const mrl_kernels *k = mrl_model_kernels(m);
    layer_acts *a = &e->a;
    int W = c->kv_lora_rank + c->qk_rope_head_dim, H = c->num_attention_heads, dv = c->v_head_dim;
    a->mla_absorbed = 0;
    mrl_layer_qkv(m, p, a, x, b->positions, T);          /* q, k, v of every row (and qf, cn, kr) */
    mrl_layer_mla_absorb(m, p, a, b->positions, T);      /* qabs and the latent rows of every row */
    k->latent_kv_write(mrl_kv_cache_k(e->kv, l), a->mla_lat, b->slot_mapping, T, W, mrl_kv_cache_get_config(e->kv)->bf16);
    mrl_paged_attn args;
    mrl_status st = mrl_sched_attn_args(b, e->kv, l, H, a->mla_qabs, a->mla_olat, &args);
    if (st) return st;
    args.hv = c->kv_lora_rank, args.scale = mrl_model_attn_scale(c);
    for (int i0 = 0, i1; i0 < hb->n_seqs; i0 = i1) {
        int whole = hb->query_start[i0 + 1] - hb->query_start[i0] == hb->seq_lens[i0];
        for (i1 = i0 + 1; i1 < hb->n_seqs && (hb->query_start[i1 + 1] - hb->query_start[i1] == hb->seq_lens[i1]) == whole;)
            i1++;
        if (whole) { /* (the rows' offsets are the batch's own: query_start from i0) */
            k->attn_fwd(a->att, e->mla_lse, a->q, a->k, a->v, b->query_start + i0, NULL, i1 - i0, H, H, c->head_dim,
                        args.scale);
            continue;
        }
        mrl_paged_attn run = args;
        run.query_start = b->query_start + i0, run.seq_lens = b->seq_lens + i0, run.n_seqs = i1 - i0;
        run.block_tables = b->block_tables + (int64_t)i0 * b->max_blocks_per_seq;
        if ((st = k->mla_paged_attn(&run))) return st;
    }
    mrl_layer_mla_unabsorb(m, p, a, T); /* att_v of every row from olat, then the whole prompts' own */
    for (int i = 0; i < hb->n_seqs; i++) {
        int64_t q0 = hb->query_start[i], n = hb->query_start[i + 1] - q0;
        if (n == hb->seq_lens[i])
            k->copy_rows(a->att_v + q0 * H * dv, dv, a->att + q0 * H * c->head_dim, c->head_dim, n * H, dv);
    }
    a->mla_absorbed = 2;
    mrl_layer_out(m, p, a, x, x, T);
    a->mla_absorbed = 0;
    return MRL_OK;
}

/* Layer l of a step over the latent cache (engine.h, MRL_MLA_LATENT). A step of whole prompts
 * (fresh: no row attends to a cached one) runs the expanded form, the trainer's (layer.c: every
 * head's K and V from the latent, attention over the step's rows), and caches each token's latent
 * row; any other step (decodes, a prompt's later chunk, a cached prefix) the absorbed form: the
 * absorbed queries and this step's latent rows, the rows into their slots, the attention over
 * each sequence's rows, the output taken back through kv_b_proj's value rows. */
static mrl_status latent_layer(mrl_engine *e, layer_params *p, const mrl_sched_batch *hb, const mrl_sched_batch *b,
                               int l, int64_t T, int fresh, float *x) {
    const mrl_model *m = e->m;
    const mrl_model_config *c = e->mc;
    const mrl_kernels *k = mrl_model_kernels(m);
    int W = c->kv_lora_rank + c->qk_rope_head_dim, H = c->num_attention_heads;
    if (fresh == 2) return mixed_layer(e, p, hb, b, l, T, x);
    if (fresh) {
        layer_acts *a = &e->a;
        a->mla_absorbed = 0;
        mrl_layer_qkv(m, p, a, x, b->positions, T);
        k->copy_rows(a->mla_lat, W, a->cn, c->kv_lora_rank, T, c->kv_lora_rank); /* [c' | rope(kr)]: the turned */
        k->copy_rows(a->mla_lat + c->kv_lora_rank, W, a->k + c->qk_nope_head_dim, (int64_t)H * c->head_dim, T,
                     c->qk_rope_head_dim); /* rope key is every head's; head 0's */
        k->latent_kv_write(mrl_kv_cache_k(e->kv, l), a->mla_lat, b->slot_mapping, T, W,
                           mrl_kv_cache_get_config(e->kv)->bf16);
        k->attn_fwd(a->att, e->mla_lse, a->q, a->k, a->v, b->query_start, NULL, b->n_seqs, H, H, c->head_dim,
                    mrl_model_attn_scale(c));
        mrl_layer_out(m, p, a, x, x, T);
        return MRL_OK;
    }
    e->a.mla_absorbed = 1;
    mrl_layer_qkv(m, p, &e->a, x, b->positions, T);
    k->latent_kv_write(mrl_kv_cache_k(e->kv, l), e->a.mla_lat, b->slot_mapping, T, W,
                       mrl_kv_cache_get_config(e->kv)->bf16);
    mrl_paged_attn args;
    mrl_status st = mrl_sched_attn_args(b, e->kv, l, c->num_attention_heads, e->a.mla_qabs, e->a.mla_olat, &args);
    if (st) return st;
    args.hv = c->kv_lora_rank, args.scale = mrl_model_attn_scale(c);
    if ((st = k->mla_paged_attn(&args))) return st;
    mrl_layer_out(m, p, &e->a, x, x, T);
    return MRL_OK;
}

/* The kernels of one step: hb the scheduler's batch, b what the ops read
 * (hb, or its copy on the GPU); logits of b's logits_indices rows. Nothing
 * here waits for the device or allocates on it (a decode graph captures it). */
static mrl_status run_model(mrl_engine *e, const mrl_sched_batch *hb, const mrl_sched_batch *b) {
    const mrl_model *m = e->m;
    const mrl_model_config *c = e->mc;
    const mrl_kernels *k = mrl_model_kernels(m);
    int64_t T = hb->n_tokens, D = c->hidden_size, V = c->vocab_size, S = hb->n_logits;
    mrl_status st = MRL_OK;
    float *logits = e->logits_part ? e->logits_part : e->logits; /* vocabulary-parallel: this rank's slice */
    if (e->logits_part) { /* this rank's rows, summed over the group (tp.c; no graph captures a tensor-parallel step) */
        int32_t *ids = e->on_device ? e->tp_ids_host : e->tp_ids;
        mrl_model_tp_ids(m, hb->token_ids, ids, T);
        if (e->on_device && (st = k->to_device(e->tp_ids, ids, (int64_t)sizeof(int32_t) * T))) return st;
        mrl_model_tp_embed(m, e->x, e->w.embed, e->tp_ids, T);
    } else {
        k->gather_rows(e->x, e->w.embed, b->token_ids, T, D); /* [T,D] */
    }
    int n_segs = step_segments(e, hb);
    e->a.lora_segs = n_segs ? e->segs : NULL;
    e->a.n_lora_segs = n_segs;
    /* a quantized base: a step of few rows (decode) reads its blocks (the qgemm op), a longer one
     * makes each layer whole (its products are then the trainer's) */
    int quantized = e->reads_own && mrl_model_quantized_bytes(m) > 0;
    int prompts = 0; /* a latent cache: its sequences whose whole prompts run now (fresh: all 1, some 2, none 0) */
    for (int i = 0; e->latent && i < hb->n_seqs; i++) prompts += hb->query_start[i + 1] - hb->query_start[i] == hb->seq_lens[i];
    int fresh = prompts == 0 ? 0 : prompts == hb->n_seqs ? 1 : 2;
    int blocks = quantized && e->qlayers && T <= QGEMM_ROWS, whole = quantized && !blocks;
    for (int l = 0, ord = 0; l < c->num_hidden_layers && !st; l++) {
        layer_params *p = &e->lp[l];
        p->quant = blocks ? &e->qlayers[l] : NULL;
        for (int i = 0; i < n_segs; i++) e->segs[i].L = e->segs[i].ad ? mrl_lora_layer(e->segs[i].ad, l) : NULL;
        if (whole && (st = mrl_model_layer_use(e->m, l))) break;
        st = e->latent ? latent_layer(e, p, hb, b, l, T, fresh, e->x) : paged_layer(e, p, b, l, T, e->x);
        if (whole) mrl_model_layer_unuse(e->m, l);
        if (st) break;
        if (p->router && e->routes) record_routing(e, hb, ord++); /* mrl_engine_record_routing */
    }
    if (!st) st = mrl_model_tp_status(e->m); /* tensor parallel: a sum over the group that failed */
    if (st || S == 0) return st;
    k->gather_rows(e->rows, e->x, b->logits_indices, S, D); /* [S,D] */
    k->rmsnorm_fwd(e->rows_n, e->rstd_n, e->rows, e->w.final_norm, S, (int)D, (float)c->rms_norm_eps);
    if (e->w.lm_head_p16) /* bf16 panels and the plain copy: the table reads the faster */
        k->gemm_bf16_panels(S, V, D, 1.0f, e->rows_n, D, e->w.lm_head_p16, e->w.lm_head16, D, 0.0f, logits, V);
    else if (e->w.lm_head16) /* bf16, as the trainer's head (forward.c) */
        k->gemm_bf16(0, 1, S, V, D, 1.0f, e->rows_n, 0, D, e->w.lm_head16, 1, D, 0.0f, logits, V);
    else
        k->gemm(0, 1, S, V, D, 1.0f, e->rows_n, D, e->w.lm_head, D, 0.0f, logits, V); /* [S,V] */
    /* the sampler draws from the whole rows: the group's slices side by side, the same on every rank */
    return e->logits_part ? mrl_model_tp_logits(m, logits, S, e->logits_all, e->logits) : MRL_OK;
}

/* ---- CUDA graphs of decode steps (a GPU, cfg.cuda_graphs) ----
 * A step of decodes only (one token a sequence) launches the same kernels
 * for the same (sequences, block-table width) every time, reading what
 * changes (tokens, positions, slots, lengths, block tables) from the staged
 * copy at the same addresses: the second step of a shape captures them into
 * a graph (the first sized every buffer), later ones launch it, one launch
 * instead of ~15 a layer. The block-table width is rounded up to a power of
 * two so that a sequence's growth rarely asks for a new graph. Graphs hold
 * addresses: when one of them changes (the weights read, the activations,
 * the staging, the RoPE tables, the kernels' own scratch) all are dropped. */

static uint64_t graph_signature(const mrl_engine *e) {
    const void *parts[] = {e->base, e->w.lm_head16, e->lp[0].hq, e->act_buf, e->stage_dev.data, e->attn_ws.data,
                           mrl_model_rope_cos(e->m), mrl_kv_cache_k(e->kv, 0)};
    uint64_t h = mrl_device_kernels_epoch(mrl_model_get_device(e->m)) * 0x9e3779b97f4a7c15ULL;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) h = (h ^ (uint64_t)(uintptr_t)parts[i]) * 0x100000001b3ULL;
    return h;
}

static void drop_graphs(mrl_engine *e) {
    for (int i = 0; i < e->n_graphs; i++) mrl_graph_free(e->graphs[i].g);
    e->n_graphs = 0;
}

static int decode_only(const mrl_engine *e, const mrl_sched_batch *b) {
    return e->on_device && e->cfg.cuda_graphs && mrl_model_tp(e->m, NULL, NULL) == 1 && b->n_prefill_tokens == 0 &&
           b->n_tokens == b->n_seqs &&
           b->n_logits == b->n_tokens;
}

/* The entry of (n, width), made when absent (NULL: the table is full). */
static decode_graph *graph_entry(mrl_engine *e, int n, int width) {
    for (int i = 0; i < e->n_graphs; i++)
        if (e->graphs[i].n == n && e->graphs[i].width == width) return &e->graphs[i];
    if (e->n_graphs == MAX_GRAPHS) return NULL;
    decode_graph *g = &e->graphs[e->n_graphs++];
    *g = (decode_graph){.n = n, .width = width};
    return g;
}

static mrl_status run_graphed(mrl_engine *e, const mrl_sched_batch *hb, const mrl_sched_batch *b) {
    uint64_t sig = graph_signature(e);
    if (sig != e->graph_sig) {
        drop_graphs(e);
        e->graph_sig = sig;
    }
    decode_graph *g = graph_entry(e, hb->n_tokens, b->max_blocks_per_seq);
    if (!g || g->failed || !g->warm) { /* the first run of a shape sizes what it uses; then it is captured */
        if (g) g->warm = 1;
        return run_model(e, hb, b);
    }
    if (!g->g) {
        mrl_status st = mrl_graph_capture_begin(e->stream);
        if (!st) {
            mrl_status ran = run_model(e, hb, b);
            st = mrl_graph_capture_end(e->stream, &g->g);
            if (!st && ran) { /* captured, but an op refused its arguments: nothing of it may run */
                mrl_graph_free(g->g);
                g->g = NULL;
                return ran;
            }
        }
        if (st) { /* this shape runs without a graph from now on; what the spoilt capture left pending is dropped */
            g->failed = 1;
            e->graph_failures++;
            mrl_model_kernels(e->m)->sync();
            mrl_clear_error();
            return run_model(e, hb, b);
        }
        e->graph_captures++;
    }
    e->graph_launches++;
    return mrl_graph_launch(g->g, e->stream);
}

/* The model over one scheduled batch: logits of its logits_indices rows. */
static mrl_status forward_step(mrl_engine *e, const mrl_sched_batch *hb) {
    const mrl_kernels *k = mrl_model_kernels(e->m);
    if (hb->n_tokens > e->cfg.max_num_batched_tokens || hb->n_logits > e->logit_rows)
        return mrl_set_error(MRL_ERR_INTERNAL, "engine step: %d tokens / %d logit rows over the buffers",
                             hb->n_tokens, hb->n_logits);
    mrl_status st = prepare_weights(e);
    int graphed = decode_only(e, hb), width = hb->max_blocks_per_seq;
    if (graphed) /* a power of two, so that a graph serves sequences as they grow */
        for (width = 1; width < hb->max_blocks_per_seq; width *= 2) {}
    mrl_sched_batch staged; /* what the ops read: hb itself, or (a GPU) its copy there */
    if (!st) st = stage_batch(e, hb, &staged, width);
    if (!st) st = graphed ? run_graphed(e, hb, &staged) : run_model(e, hb, &staged);
    mrl_status done = k->sync(); /* a GPU's first failure of the step (nothing on the CPU) */
    return st ? st : done;
}

/* Following a weight store: a version newer than the one read now is taken
 * (the hold moves to it, so the writer may reuse the slot left) and swapped
 * in for this step; the tokens sampled from here on record it. Between two
 * steps nothing reads the weights, so the slot left is free at once. */
static mrl_status take_newer_weights(mrl_engine *e) {
    int flags = 0;
    int64_t latest = mrl_weight_store_latest(e->follow, &flags);
    if (latest <= e->version || (flags & MRL_WS_STOP)) return MRL_OK;
    const float *params;
    int64_t version;
    mrl_status st = mrl_weight_store_acquire(e->follow, e->follow_reader, latest, 0, &params, &version, &flags);
    if (st) return st;
    rebase(e, params);
    e->panels_stale = 1;
    e->version = version;
    mrl_sched_set_version(e->sched, version);
    return MRL_OK;
}

/* Speculative decoding's draft pass (engine.h, mtp), after a step's update: the MTP layer over
 * the step's rows the scheduler planned (mrl_sched_mtp: those computed whose next token is
 * known), from the step's final hidden states (normed, as the head reads them) and the next
 * tokens' embeddings (zero at position 0, as vLLM's), writing its own layer of the cache; then,
 * from each planned draft row, the MTP head's most likely token, the sample's draft. */
static mrl_status mtp_pass(mrl_engine *e) {
    const mrl_sched_mtp *plan = mrl_sched_mtp_plan(e->sched);
    if (!plan || plan->batch.n_tokens == 0) return MRL_OK;
    const mrl_model *m = e->m;
    const mrl_model_config *c = e->mc;
    const mrl_kernels *k = mrl_model_kernels(m);
    const mtp_params *w = &e->mtpw;
    const mrl_sched_batch *b = &plan->batch;
    int64_t M = b->n_tokens, D = c->hidden_size, V = c->vocab_size;
    float eps = (float)c->rms_norm_eps;
    k->gather_rows(e->mtp_h, e->x, plan->src_rows, M, D); /* the main model's last layer out, these rows */
    k->rmsnorm_fwd(e->mtp_n, e->mtp_rstd, e->mtp_h, e->w.final_norm, M, (int)D, eps);
    k->rmsnorm_fwd(e->mtp_h, e->mtp_rstd, e->mtp_n, w->hnorm, M, (int)D, eps);
    k->gather_rows(e->mtp_e, w->embed, b->token_ids, M, D);
    for (int64_t t = 0; t < M; t++)
        if (b->positions[t] == 0) k->zero(e->mtp_e + t * D, (int64_t)sizeof(float) * D);
    k->rmsnorm_fwd(e->mtp_n, e->mtp_rstd, e->mtp_e, w->enorm, M, (int)D, eps);
    k->copy_rows(e->mtp_cat, 2 * D, e->mtp_n, D, M, D); /* [embedding, hidden] */
    k->copy_rows(e->mtp_cat + D, 2 * D, e->mtp_h, D, M, D);
    k->gemm(0, 1, M, D, 2 * D, 1.0f, e->mtp_cat, 2 * D, w->eh_proj, 2 * D, 0.0f, e->mtp_x, D);
    layer_params lp = w->layer;
    int L = c->num_hidden_layers;
    mrl_status st = e->latent ? latent_layer(e, &lp, b, b, L, M, 0, e->mtp_x) : paged_layer(e, &lp, b, L, M, e->mtp_x);
    if (st || plan->n_drafts == 0) return st;
    int64_t nd = plan->n_drafts;
    k->gather_rows(e->rows, e->mtp_x, plan->draft_rows, nd, D);
    k->rmsnorm_fwd(e->rows_n, e->rstd_n, e->rows, w->head_norm, nd, (int)D, eps);
    k->gemm(0, 1, nd, V, D, 1.0f, e->rows_n, D, w->head, D, 0.0f, e->logits, V);
    for (int64_t i = 0; i < nd; i++) { /* the most likely token (the first of equals) */
        const float *r = e->logits + i * V;
        int32_t best = 0;
        for (int32_t v = 1; v < V; v++)
            if (r[v] > r[best]) best = v;
        mrl_sched_set_draft(e->sched, plan->draft_seqs[i], best);
    }
    return MRL_OK;
}

/* One step, on whichever thread owns the engine (the caller's or the background run's). */
static mrl_status step(mrl_engine *e) {
    const mrl_sched_batch *b;
    /* a model moved to another device since (mrl_model_set_device) left this engine's buffers behind */
    if (mrl_model_kernels(e->m)->on_device != e->on_device || (e->reads_own && e->base != mrl_model_params(e->m)))
        return mrl_set_error(MRL_ERR_INVALID, "engine step: the model moved to another device after the engine was "
                             "made (its weights and buffers are elsewhere now): make a new engine");
    if (e->follow && mrl_sched_has_unfinished(e->sched)) {
        mrl_status st = take_newer_weights(e);
        if (st) return st;
    }
    mrl_device device = mrl_model_get_device(e->m);
    mrl_status st = MRL_OK;
    if (e->stream) { /* a GPU: what the trainer launched on the default stream is done first; then the step's
                      * work, the scheduler's block copies (copy-on-write) included, goes on the engine's */
        st = mrl_model_kernels(e->m)->sync();
        mrl_stream_set_current(device, e->stream);
    }
    if (!st) st = mrl_sched_schedule(e->sched, &b);
    if (!st && b->n_tokens > 0) st = forward_step(e, b);
    if (mrl_fault_engine_delay() > 0) mrl_fault_busy(mrl_fault_engine_delay()); /* MOONRL_FAULT slow_engine */
    mrl_sched_set_kernels(e->sched, mrl_model_kernels(e->m)); /* sampling with the model's table too */
    if (!st) st = mrl_sched_update(e->sched, e->logits); /* (on a GPU: waits for its stream, tokens back) */
    if (!st && e->mtp && b->n_tokens > 0) st = mtp_pass(e); /* (the drafts of the next step) */
    if (e->stream) mrl_stream_set_current(device, NULL);
    return st;
}

mrl_status mrl_engine_step(mrl_engine *e, int *n_unfinished) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine step: NULL engine");
    mrl_status st = check_idle(e, "step");
    if (st) return st;
    st = step(e);
    if (n_unfinished) *n_unfinished = mrl_engine_num_unfinished(e);
    return st;
}

static void read_stats(const mrl_engine *e, mrl_engine_stats *out);

/* Copy the counters for the calling thread to read while a background run owns the engine. */
static void publish(mrl_engine *e) {
    mrl_engine_stats s;
    read_stats(e, &s);
    int unfinished = mrl_sched_num_unfinished(e->sched);
    pthread_mutex_lock(&e->published_lock);
    e->published = s;
    e->published_unfinished = unfinished;
    pthread_mutex_unlock(&e->published_lock);
}

/* Steps until every request is finished or a stop is requested; background:
 * the background run's (publish the counters after each step, return when
 * paused). */
static mrl_status run_steps(mrl_engine *e, int background) {
    while (mrl_sched_has_unfinished(e->sched)) {
        if (background && atomic_load(&e->pause)) return MRL_OK; /* requests stay queued, as they are */
        if (mrl_stop_requested())
            return mrl_set_error(MRL_ERR_STOPPED, "engine run: stop requested (%s)", mrl_stop_reason());
        mrl_status st = step(e);
        if (background) publish(e);
        if (st) return st;
    }
    return MRL_OK;
}

mrl_status mrl_engine_run(mrl_engine *e) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine run: NULL engine");
    mrl_status st = check_idle(e, "run");
    return st ? st : run_steps(e, 0);
}

/* ---- the background run ----
 * OpenBLAS: the kernels call cblas_sgemm (kernels/cpu/fast.c; the attention
 * in kernels/cpu/isa_impl.h) with OpenBLAS at one thread
 * (openblas_set_num_threads(1)), so each call runs on its caller's thread,
 * and the OpenMP workers of one parallel-for already call it at the same
 * time. The library here is Debian's 0.3.21 pthread build
 * (openblas_get_parallel() = 1): its buffer allocator (driver/others/
 * memory.c) is lock-protected for concurrent callers since 0.3.7..0.3.9
 * (OpenBLAS issues #2126, #2444), so this thread's products and the
 * caller's may overlap. tests/engine/test_engine.c (test_async) checks it:
 * a training step run alongside a background run is bit-identical to one
 * run alone, and so are the samples. */

static void *run_thread(void *arg) {
    mrl_engine *e = arg;
    mrl_parallel_set_thread_threads(e->async_threads); /* this thread's kernels only */
    mrl_trace_thread_name("engine thread"); /* its own track in trace.json, beside the trainer's phases */
    mrl_trace_begin("generate (background)");
    mrl_status st = run_steps(e, 1);
    mrl_trace_end("generate (background)");
    if (st) snprintf(e->async_error, sizeof e->async_error, "%s", mrl_last_error());
    e->async_status = st; /* read by the joining thread: pthread_join orders it */
    return NULL;
}

mrl_status mrl_engine_run_async(mrl_engine *e, int threads) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine run_async: NULL engine");
    if (threads < 1) return mrl_set_error(MRL_ERR_INVALID, "engine run_async: threads = %d (must be >= 1)", threads);
    if (e->on_device) /* the CUDA table serves one thread's stream at a time (kernels/cuda/table.cu) */
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "engine run_async: the engine is on a GPU, whose op table serves "
                             "one thread at a time: generate with mrl_engine_run (no overlap with training yet)");
    int idle = ASYNC_IDLE;
    if (!atomic_compare_exchange_strong(&e->async, &idle, ASYNC_RUNNING)) return check_idle(e, "run_async");
    /* A training forward on the same model while this runs must not regrow
     * the RoPE tables the thread reads (mrl_model_forward grows them for
     * longer sequences): cover every position the model has. */
    mrl_status st = mrl_model_rope_prepare(e->m, e->mc->max_position_embeddings);
    if (st) st = mrl_set_error(st, "engine run_async: no memory for the RoPE tables of %d positions",
                               e->mc->max_position_embeddings);
    e->async_threads = threads;
    atomic_store(&e->pause, 0);
    e->async_status = MRL_OK;
    e->async_error[0] = 0;
    if (!st) publish(e);
    int rc = st ? 0 : pthread_create(&e->thread, NULL, run_thread, e);
    if (!st && rc) st = mrl_set_error(MRL_ERR_INTERNAL, "engine run_async: cannot start a thread: %s", strerror(rc));
    if (st) atomic_store(&e->async, ASYNC_IDLE);
    return st;
}

/* Join the background run (started, and not joined yet); its status, its
 * message set on the joining thread. Read before the engine is idle again. */
static mrl_status join_run(mrl_engine *e) {
    pthread_join(e->thread, NULL);
    mrl_status st = e->async_status;
    if (st) mrl_set_error(st, "%s", e->async_error);
    atomic_store(&e->async, ASYNC_IDLE);
    return st;
}

mrl_status mrl_engine_wait(mrl_engine *e) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine wait: NULL engine");
    int running = ASYNC_RUNNING;
    if (!atomic_compare_exchange_strong(&e->async, &running, ASYNC_JOINING))
        return mrl_set_error(MRL_ERR_INVALID, running == ASYNC_JOINING ? "engine wait: another thread is waiting"
                             : "engine wait: no background run (mrl_engine_run_async first)");
    return join_run(e);
}

int mrl_engine_running(const mrl_engine *e) { return e && atomic_load(&e->async) != ASYNC_IDLE; }

void mrl_engine_pause(mrl_engine *e) {
    if (e) atomic_store(&e->pause, 1);
}

int mrl_engine_request_done(mrl_engine *e, int req_id) {
    if (!e || check_idle(e, "request_done")) return -1;
    return mrl_sched_request_done(e->sched, req_id);
}

mrl_status mrl_engine_release(mrl_engine *e, int req_id) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine release: NULL engine");
    mrl_status st = check_idle(e, "release");
    if (!st) st = mrl_sched_release(e->sched, req_id);
    if (!st && req_id < e->routes_cap) route_free(&e->routes[req_id]);
    return st;
}

mrl_status mrl_engine_get_output(mrl_engine *e, int req_id, int sample, const int32_t **tokens,
                                 const float **logprobs, int *n_tokens, int *finish_reason) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine get_output: NULL engine");
    mrl_status st = check_idle(e, "get_output");
    if (st) return st;
    return mrl_sched_output(e->sched, req_id, sample, tokens, logprobs, NULL, n_tokens, finish_reason);
}

mrl_status mrl_engine_get_output_top_logprobs(mrl_engine *e, int req_id, int sample, const int32_t **ids,
                                              const float **lps, int *top) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine get_output_top_logprobs: NULL engine");
    mrl_status st = check_idle(e, "get_output_top_logprobs");
    return st ? st : mrl_sched_output_top(e->sched, req_id, sample, ids, lps, top);
}

mrl_status mrl_engine_get_output_versions(mrl_engine *e, int req_id, int sample, const int64_t **versions) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine get_output_versions: NULL engine");
    mrl_status st = check_idle(e, "get_output_versions");
    return st ? st : mrl_sched_output_versions(e->sched, req_id, sample, versions);
}

mrl_status mrl_engine_set_version(mrl_engine *e, int64_t version) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine set_version: NULL engine");
    mrl_status st = check_idle(e, "set_version");
    if (st) return st;
    e->version = version;
    mrl_sched_set_version(e->sched, version);
    return MRL_OK;
}

int64_t mrl_engine_version(const mrl_engine *e) { return e ? e->version : 0; }

mrl_status mrl_engine_follow(mrl_engine *e, mrl_weight_store *ws, int reader) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine follow: NULL engine");
    mrl_status st = check_idle(e, "follow");
    if (st) return st;
    if (ws && (reader < 0 || reader >= mrl_weight_store_readers(ws)))
        return mrl_set_error(MRL_ERR_INVALID, "engine follow: reader %d of a store with %d readers", reader,
                             mrl_weight_store_readers(ws));
    if (ws && mrl_weight_store_floats(ws) != mrl_model_num_params(e->m))
        return mrl_set_error(MRL_ERR_INVALID, "engine follow: a store of %lld floats, the model has %lld",
                             (long long)mrl_weight_store_floats(ws), (long long)mrl_model_num_params(e->m));
    if (ws && e->on_device)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "engine follow: a weight store is host shared memory; an engine on "
                             "a GPU reads its model's weights (no store to follow)");
    e->follow = ws;
    e->follow_reader = reader;
    return MRL_OK;
}

mrl_status mrl_engine_stop_sample(mrl_engine *e, int req_id, int sample) {
    if (!e) return mrl_set_error(MRL_ERR_INVALID, "engine stop_sample: NULL engine");
    mrl_status st = check_idle(e, "stop_sample");
    if (st) return st;
    return mrl_sched_stop(e->sched, req_id, sample);
}

/* The lock of a const engine: taking it to read the published copy changes nothing the caller sees. */
static pthread_mutex_t *published_lock(const mrl_engine *e) { return (pthread_mutex_t *)&e->published_lock; }

int mrl_engine_num_unfinished(const mrl_engine *e) {
    if (!e) return 0;
    if (atomic_load(&e->async) == ASYNC_IDLE) return mrl_sched_num_unfinished(e->sched);
    pthread_mutex_lock(published_lock(e));
    int n = e->published_unfinished;
    pthread_mutex_unlock(published_lock(e));
    return n;
}

void mrl_engine_get_stats(const mrl_engine *e, mrl_engine_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof(*out));
    if (!e) return;
    if (atomic_load(&e->async) == ASYNC_IDLE) {
        read_stats(e, out);
        return;
    }
    pthread_mutex_lock(published_lock(e));
    *out = e->published;
    pthread_mutex_unlock(published_lock(e));
}

static void read_stats(const mrl_engine *e, mrl_engine_stats *out) {
    mrl_sched_stats s;
    mrl_sched_get_stats(e->sched, &s);
    mrl_kv_cache_stats k;
    mrl_kv_cache_get_stats(e->kv, &k);
    out->steps = e->done.steps + s.steps;
    out->graph_launches = e->graph_launches;
    out->graph_captures = e->graph_captures;
    out->graph_failures = e->graph_failures;
    out->prefill_tokens = e->done.prefill_tokens + s.prefill_tokens;
    out->decode_tokens = e->done.decode_tokens + s.decode_tokens;
    out->generated_tokens = e->done.generated_tokens + s.generated_tokens;
    out->prefix_hit_tokens = e->done.prefix_hit_tokens + s.prefix_hit_tokens;
    out->preemptions = e->done.preemptions + s.preemptions;
    out->forks = e->done.forks + s.forks;
    out->kv_blocks_total = k.num_blocks;
    out->kv_blocks_used = k.used_blocks;
    out->kv_blocks_free = k.free_blocks;
    out->kv_block_size = e->cfg.block_size;
    out->kv_bytes_per_token = mrl_kv_cache_block_bytes(e->kv) / e->cfg.block_size;
    out->spec_drafts = e->done.spec_drafts + s.spec_drafts;
    out->spec_accepted = e->done.spec_accepted + s.spec_accepted;
    out->running = s.running;
    out->waiting = s.waiting;
    out->finished = s.finished;
}
