/* Tensor parallel (mrl_model_load_dir_tp, moonrl/model.h) and context parallel
 * (mrl_model_set_cp_group) against the whole
 * model, for Llama with a value head, Qwen2's biases and Qwen3's per-head
 * norms, in fp32 and bf16 on 2 ranks (and Qwen2 on 4): the ranks' slices are loaded from the whole
 * model's directory and run on threads of their own, their sums going
 * through a shared buffer in rank order (what mrl_dist_allreduce does
 * between processes):
 *   - each slice's shape, and its values the rows or columns of the whole
 *     tensor;
 *   - the log-probs, entropy and values of a packed batch (shared prompts
 *     included) on every rank, against the whole model's: with the
 *     embedding and head split by vocabulary (212 tokens over 2 and 4 ranks:
 *     the head's statistics combined over the slices) and whole (211);
 *   - after a backward, each rank's gradients: a split view's the slice of
 *     the whole model's, the others' the whole view's;
 *   - saved by the group (each split tensor gathered, rank 0 writing): the
 *     whole model's files byte for byte;
 *   - the engine on each rank's slices, the ranks stepping together: greedy
 *     and seeded sampled tokens those of the engine on the whole model (a
 *     shared prompt, prefix caching, fp32 and bf16; and with a cache so
 *     small that sequences are pre-empted and 5 tokens a step, which
 *     chunks the prompts), their log-probs within the forward's bounds, and
 *     the same on every rank; a mixture of experts too;
 *   - sequence parallel (the residual stream and norms on each rank's share
 *     of the tokens) on 2 and 4 ranks, bf16 and shared K/V heads: the same,
 *     the row-parallel sums reduce-scattered (each rank's piece alone: the
 *     rest of its buffer NaN), or all-reduced where no reduce-scatter is set;
 *   - ZeRO-3 shards of the slices, read by range, the slices' values;
 *   - context parallel (the whole model on each rank, the batch's tokens
 *     split, all-to-alls around attention) on 2 and 4 ranks: the whole
 *     batch's log-probs, entropy and values on every rank, and the ranks'
 *     gradients summed the whole model's; with tensor parallel on 4 ranks
 *     (tp 2 x cp 2): the outputs, and each slice's gradient summed over its
 *     two token shares;
 *   - a mixture of experts (Qwen3-MoE, a dense layer and a sparse one) on 2
 *     and 4 ranks, fp32 and bf16: each expert's MLP split as the dense one,
 *     the router whole; the same outputs, gradients and saved files;
 *   - the refusals, naming the key: a size that does not divide the heads,
 *     the KV heads, the intermediate size or the experts'; sequence parallel
 *     on a mixture of experts; a forward or a save without the group's
 *     collectives.
 * Bounds: the ranks' partial products add in another order than the whole
 * model's single product (below). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "check.h"
#include "models.h"
#include "moonrl/engine.h"
#include "moonrl/model.h"
#include "moonrl/runtime.h"

#define LP_TOL 2e-5    /* max |lp tp - lp whole|, logits of a few units */
#define GRAD_TOL 2e-5  /* ||g tp - g whole|| / ||g whole|| per view */
/* bf16: both sides round fp32 activations to bf16, which agree until an fp32 ulp of difference
 * crosses a bf16 rounding edge (2^-8 relative) now and then: test_bf16.c's bounds for two
 * tables (LP_TABLES, GRAD_TABLES) */
#define LP_TOL16 0.025
#define GRAD_TOL16 0.015

enum { MAX_TP = 4 };

/* The group's allreduce: each rank's buffer in the slot of its rank; rank 0 sums in rank order
 * into every buffer between two barriers. */
typedef struct a2a_post { const float *send; const int64_t *counts; } a2a_post;
typedef struct group {
    pthread_barrier_t bar;
    float *bufs[MAX_TP];
    a2a_post posts[MAX_TP]; /* (group_a2a's) */
    int size;
} group;
typedef struct member {
    group *g;
    int rank;
    mrl_model *m;
    const mrl_batch *b;
    float lp[96], ent[96], val[96];
    const batch *x;
    const char *save_to; /* then the group's save there */
    mrl_status fwd, bwd, saved;
} member;

static mrl_status group_sum(void *ctx, float *buf, int64_t n) {
    member *me = ctx;
    group *g = me->g;
    g->bufs[me->rank] = buf;
    pthread_barrier_wait(&g->bar);
    if (me->rank == 0)
        for (int64_t i = 0; i < n; i++) {
            float s = g->bufs[0][i];
            for (int r = 1; r < g->size; r++) s += g->bufs[r][i];
            for (int r = 0; r < g->size; r++) g->bufs[r][i] = s;
        }
    pthread_barrier_wait(&g->bar);
    return MRL_OK;
}

/* The group's reduce-scatter (sequence parallel's): each rank's piece of n / size summed over the
 * ranks in rank order into its own buffer, the rest of its buffer NaN (a read of another piece
 * would show). */
static mrl_status group_rs(void *ctx, float *buf, int64_t n) {
    member *me = ctx;
    group *g = me->g;
    int64_t piece = n / g->size, lo = me->rank * piece;
    float *sum = malloc(sizeof(float) * (size_t)(piece ? piece : 1));
    g->bufs[me->rank] = buf;
    pthread_barrier_wait(&g->bar);
    for (int64_t i = 0; i < piece; i++) {
        float s = g->bufs[0][lo + i];
        for (int r = 1; r < g->size; r++) s += g->bufs[r][lo + i];
        sum[i] = s;
    }
    pthread_barrier_wait(&g->bar); /* (every rank has read every buffer) */
    for (int64_t i = 0; i < n; i++) buf[i] = i >= lo && i < lo + piece ? sum[i - lo] : NAN;
    free(sum);
    pthread_barrier_wait(&g->bar);
    return MRL_OK;
}

static mrl_status group_gather(void *ctx, const float *mine, int64_t n, float *all) {
    member *me = ctx;
    group *g = me->g;
    g->bufs[me->rank] = (float *)mine;
    pthread_barrier_wait(&g->bar);
    for (int r = 0; r < g->size; r++) memcpy(all + r * n, g->bufs[r], sizeof(float) * (size_t)n);
    pthread_barrier_wait(&g->bar);
    return MRL_OK;
}

/* The group's all-to-all: each rank's send buffer and counts posted; each rank copies the block
 * every rank sent it (after the blocks for the ranks before it) into its place in recv. */
static mrl_status group_a2a(void *ctx, const float *send, const int64_t *send_counts, float *recv,
                            const int64_t *recv_counts, int64_t unit) {
    member *me = ctx;
    group *g = me->g;
    g->posts[me->rank] = (a2a_post){send, send_counts};
    pthread_barrier_wait(&g->bar);
    int64_t at = 0;
    for (int r = 0; r < g->size; r++) {
        int64_t from = 0;
        for (int q = 0; q < me->rank; q++) from += g->posts[r].counts[q];
        if (g->posts[r].counts[me->rank] != recv_counts[r]) abort(); /* (the counts must match) */
        memcpy(recv + at * unit, g->posts[r].send + from * unit, sizeof(float) * (size_t)(recv_counts[r] * unit));
        at += recv_counts[r];
    }
    pthread_barrier_wait(&g->bar);
    return MRL_OK;
}

static void *run_rank(void *arg) {
    member *me = arg;
    int vh = mrl_model_get_config(me->m)->value_head;
    me->fwd = mrl_model_forward(me->m, me->b, 1.0f, me->lp, me->ent, vh ? me->val : NULL);
    me->bwd = me->fwd ? me->fwd : mrl_model_backward(me->m, me->x->dlp, me->x->dent, vh ? me->x->dval : NULL);
    /* (K/V heads held by several ranks) in two ranges, as two ZeRO-2 shards would: a view
     * crossing their border summed in its two parts */
    int64_t n = mrl_model_num_params(me->m), half = n / 2 + 7;
    float *g = mrl_model_grads(me->m);
    if (!me->bwd) me->bwd = mrl_model_tp_sync_grads(me->m, g, 0, half);
    if (!me->bwd) me->bwd = mrl_model_tp_sync_grads(me->m, g + half, half, n - half);
    me->saved = mrl_model_save_dir(me->m, me->save_to);
    return NULL;
}

/* ||a - b|| / ||b|| */
static double rel(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d, den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Rank r's slice of whole view w (rows or columns, as the view's shape says) into out; r is the
 * slice's index (a K/V head held by several ranks: theirs). */
static int slice_of(const mrl_param_view *w, const mrl_param_view *v, const float *whole, int r, float *out) {
    if (v->ndim == 1 && v->shape[0] != w->shape[0]) { /* a bias: rows */
        memcpy(out, whole + w->offset + r * v->numel, sizeof(float) * (size_t)v->numel);
        return 1;
    }
    if (v->ndim == 2 && v->shape[0] != w->shape[0]) { /* rows */
        memcpy(out, whole + w->offset + r * v->numel, sizeof(float) * (size_t)v->numel);
        return 1;
    }
    if (v->ndim == 2 && v->shape[1] != w->shape[1]) { /* columns */
        for (int64_t i = 0; i < v->shape[0]; i++)
            memcpy(out + i * v->shape[1], whole + w->offset + i * w->shape[1] + r * v->shape[1],
                   sizeof(float) * (size_t)v->shape[1]);
        return 2;
    }
    memcpy(out, whole + w->offset, sizeof(float) * (size_t)v->numel);
    return 0;
}

/* The whole model of c (seed's weights) saved to dir and loaded from it in dtype, and its forward
 * and backward of a new batch x: its log-probs, entropy and values, its gradients kept. */
static mrl_model *reference(const mrl_model_config *c, uint64_t seed, int dtype, const char *dir, batch *x, float *lp,
                            float *ent, float *val) {
    mrl_model *src = small_model(c, seed);
    CHECK_OK(mrl_model_save_dir(src, dir));
    mrl_model_free(src);
    mrl_model *whole = NULL;
    CHECK_OK(mrl_model_load_dir(dir, &whole));
    CHECK_OK(mrl_model_set_dtype(whole, dtype));
    make_batch(x, c->vocab_size);
    CHECK_OK(mrl_model_forward(whole, &x->b, 1.0f, lp, ent, c->value_head ? val : NULL));
    CHECK_OK(mrl_model_backward(whole, x->dlp, x->dent, c->value_head ? x->dval : NULL));
    return whole;
}

/* kv_shared: with more ranks than K/V heads (each held by several), else one K/V head a rank;
 * vocab: 212 splits the embedding and head by vocabulary over 2 and 4 ranks, 211 keeps them whole */
static void case_tp(int arch, int dtype, int size, int kv_shared, int vocab, int sp, const char *dir) {
    mrl_model_config c = small_config(arch);
    c.vocab_size = vocab;
    c.value_head = arch == MRL_ARCH_LLAMA;
    if (size > c.num_key_value_heads && !kv_shared) c.num_key_value_heads = size; /* (4 ranks: one K/V head each) */
    int moe = arch == MRL_ARCH_QWEN3_MOE;
    if (moe) { /* a dense first layer, then experts (each expert's MLP split, the router whole) */
        c.num_experts = 6, c.num_experts_per_tok = 2, c.moe_intermediate_size = 32, c.norm_topk_prob = 1;
        c.decoder_sparse_step = 1;
        c.mlp_only_layers[0] = 1;
    }
    batch x;
    float lp[96], ent[96], val[96];
    mrl_model *whole = reference(&c, 11 + (uint64_t)arch, dtype, dir, &x, lp, ent, val);
    const float *gw = mrl_model_grads(whole), *pw = mrl_model_params(whole);

    group g = {.size = size};
    pthread_barrier_init(&g.bar, NULL, (unsigned)size);
    member ms[MAX_TP];
    pthread_t th[MAX_TP];
    char tp_dir[300], whole_dir[300], cmd[1300];
    snprintf(tp_dir, sizeof tp_dir, "%s/tp_saved", dir);
    snprintf(whole_dir, sizeof whole_dir, "%s/whole_saved", dir);
    CHECK_OK(mrl_model_save_dir(whole, whole_dir));
    for (int r = 0; r < size; r++) {
        ms[r] = (member){.g = &g, .rank = r, .b = &x.b, .x = &x, .save_to = tp_dir};
        CHECK_OK(mrl_model_load_dir_tp(dir, r, size, 0, &ms[r].m));
        CHECK_OK(mrl_model_set_dtype(ms[r].m, dtype));
        CHECK_OK(mrl_model_set_tp_group(ms[r].m, group_sum, group_gather, &ms[r]));
        if (sp) CHECK_OK(mrl_model_set_sequence_parallel(ms[r].m, 1));
        if (sp && !kv_shared) CHECK_OK(mrl_model_set_tp_reduce_scatter(ms[r].m, group_rs)); /* (else the allreduce's) */
        int rank = -1;
        mrl_model_config all;
        CHECK(mrl_model_tp(ms[r].m, &rank, &all) == size && rank == r && all.num_attention_heads == c.num_attention_heads);
        const mrl_model_config *lc = mrl_model_get_config(ms[r].m);
        int kv = c.num_key_value_heads >= size ? c.num_key_value_heads / size : 1;
        CHECK(lc->num_attention_heads == c.num_attention_heads / size && lc->num_key_value_heads == kv &&
              lc->intermediate_size == c.intermediate_size / size &&
              lc->moe_intermediate_size == (moe ? c.moe_intermediate_size / size : c.moe_intermediate_size) &&
              lc->vocab_size == (vocab % size ? vocab : vocab / size) && all.vocab_size == vocab);
        CHECK(mrl_model_tp_copies(ms[r].m, "model.layers.0.self_attn.k_proj.weight") == (kv_shared ? size / c.num_key_value_heads : 1));
    }
    for (int r = 0; r < size; r++) pthread_create(&th[r], NULL, run_rank, &ms[r]);
    for (int r = 0; r < size; r++) pthread_join(th[r], NULL);
    double lp_tol = dtype ? LP_TOL16 : LP_TOL, g_tol = dtype ? GRAD_TOL16 : GRAD_TOL;
    double worst_lp = 0, worst_g = 0, worst_w = 0;
    const char *worst_name = "";
    int64_t split_views = 0;
    for (int r = 0; r < size; r++) {
        member *me = &ms[r];
        CHECK_OK(me->fwd);
        CHECK_OK(me->bwd);
        CHECK_OK(me->saved);
        int64_t n = x.b.n_tokens;
        for (int64_t i = 0; i < n; i++) {
            double d = fmax(fabs(me->lp[i] - lp[i]), fabs(me->ent[i] - ent[i]));
            if (c.value_head) d = fmax(d, fabs(me->val[i] - val[i]));
            if (!(d <= worst_lp)) worst_lp = d;
        }
        const float *gr = mrl_model_grads(me->m), *pr = mrl_model_params(me->m);
        for (int i = 0; i < mrl_model_num_views(me->m); i++) {
            mrl_param_view v, w;
            mrl_model_view(me->m, i, &v);
            CHECK_OK(mrl_model_find_view(whole, v.name, &w));
            float *want = malloc(sizeof(float) * (size_t)v.numel);
            int slice = r / mrl_model_tp_copies(me->m, v.name);
            split_views += slice_of(&w, &v, pw, slice, want) != 0; /* the values: the slice, bit for bit */
            double dw = rel(pr + v.offset, want, v.numel);
            if (!(dw <= worst_w)) worst_w = dw;
            slice_of(&w, &v, gw, slice, want);
            double e = rel(gr + v.offset, want, v.numel);
            if (!(e <= worst_g)) worst_g = e, worst_name = v.name;
            free(want);
        }
    }
    printf("%s %s tp=%d%s%s, vocabulary %d (%s): %lld split views, max |d lp, ent, value| %.3g, worst gradient %.3g (%s)\n",
           mrl_model_arch_names(arch)->model_type, dtype ? "bf16" : "fp32", size, kv_shared ? " (K/V heads shared)" : "",
           sp ? ", sequence parallel" : "", vocab, vocab % size ? "whole head" : "split", (long long)split_views, worst_lp, worst_g, worst_name);
    /* q k v o gate up down (+ 3 biases) a layer (a sparse one: gate up down of each expert), and the
     * embedding and an untied head split by vocabulary */
    int vocab_views = vocab % size ? 0 : c.tie_word_embeddings ? 1 : 2, layer_views = 0;
    for (int l = 0; l < c.num_hidden_layers; l++)
        layer_views += (c.attention_bias ? 7 : 4) + (mrl_model_layer_is_moe(&c, l) ? 3 * c.num_experts : 3);
    CHECK(split_views == (int64_t)size * (layer_views + vocab_views));
    CHECK(worst_w == 0);
    if (sp) { /* a rank's activations for a long batch: less with the rows split */
        int64_t with = mrl_model_activation_bytes(ms[0].m, 4096);
        CHECK_OK(mrl_model_set_sequence_parallel(ms[0].m, 0));
        int64_t without = mrl_model_activation_bytes(ms[0].m, 4096);
        printf("  activations of 4096 tokens a rank: %.2fx of tensor parallel's alone\n", (double)with / (double)without);
        CHECK(with < without);
    }
    CHECK(worst_lp <= lp_tol);
    CHECK(worst_g <= g_tol);
    /* saved by the group (rank 0 writing the gathered tensors): the whole model's files, byte for byte */
    snprintf(cmd, sizeof cmd, "cmp -s '%s/model.safetensors' '%s/model.safetensors' && cmp -s '%s/config.json' "
             "'%s/config.json'", tp_dir, whole_dir, tp_dir, whole_dir);
    CHECK(system(cmd) == 0);
    for (int r = 0; r < size; r++) mrl_model_free(ms[r].m);
    pthread_barrier_destroy(&g.bar);
    mrl_model_free(whole);
}

/* ZeRO-3 under tensor parallel (mrl_model_load_dir_tp_shard): each of 3 shards of each rank's
 * slices, read by range (a shard's border inside a row of a column-split view too), holds the
 * values of the whole slices at its offsets. */
static void case_tp_shards(const char *dir) {
    mrl_model_config c = small_config(MRL_ARCH_QWEN2); /* biases, its own head */
    c.vocab_size = 212;
    mrl_model *src = small_model(&c, 51);
    CHECK_OK(mrl_model_save_dir(src, dir));
    mrl_model_free(src);
    int64_t checked = 0, differ = 0;
    for (int r = 0; r < 2; r++) {
        mrl_model *slices = NULL;
        CHECK_OK(mrl_model_load_dir_tp(dir, r, 2, 0, &slices));
        const float *want = mrl_model_params(slices);
        for (int i = 0; i < 3; i++) {
            mrl_model *m = NULL;
            CHECK_OK(mrl_model_load_dir_tp_shard(dir, r, 2, 3, 3, i, 0, &m));
            int64_t off = -1, cnt = -1;
            CHECK(mrl_model_shard(m, &off, &cnt) == 1 && cnt > 0);
            const float *got = mrl_model_params(m);
            for (int64_t j = off; j < off + cnt; j++) differ += memcmp(&got[j], &want[j], sizeof(float)) != 0;
            checked += cnt;
            mrl_model_free(m);
        }
        CHECK(checked == (r + 1) * mrl_model_num_params(slices));
        mrl_model_free(slices);
    }
    printf("tp=2, 3 shards a rank: %lld parameters read by range, %lld differ from the slices\n", (long long)checked,
           (long long)differ);
    CHECK(differ == 0);
    mrl_model *m = NULL;
    CHECK(mrl_model_load_dir_tp_shard(dir, 0, 2, 3, 2, 0, 0, &m) == MRL_ERR_INVALID && !m); /* 2 does not divide 3 */
}

/* ---- context parallel ---- */

/* Each rank the whole model, the batch's tokens split over size ranks: the log-probs, entropy and
 * values of the whole batch on every rank, and the ranks' gradients summed the whole model's. */
static void case_cp(int arch, int dtype, int size, const char *dir) {
    mrl_model_config c = small_config(arch);
    c.value_head = arch == MRL_ARCH_LLAMA;
    c.num_key_value_heads = 4; /* (4 ranks: one K/V head each) */
    batch x;
    float lp[96], ent[96], val[96];
    mrl_model *whole = reference(&c, 31 + (uint64_t)arch, dtype, dir, &x, lp, ent, val);
    group g = {.size = size};
    pthread_barrier_init(&g.bar, NULL, (unsigned)size);
    member ms[MAX_TP];
    pthread_t th[MAX_TP];
    char out[MAX_TP][300]; /* (a whole model saves as usual: each rank into its own directory) */
    for (int r = 0; r < size; r++) {
        snprintf(out[r], sizeof out[r], "%s/cp_saved%d", dir, r);
        ms[r] = (member){.g = &g, .rank = r, .b = &x.b, .x = &x, .save_to = out[r]};
        CHECK_OK(mrl_model_load_dir(dir, &ms[r].m));
        CHECK_OK(mrl_model_set_dtype(ms[r].m, dtype));
        CHECK_OK(mrl_model_set_cp_group(ms[r].m, r, size, group_gather, group_a2a, &ms[r]));
    }
    for (int r = 0; r < size; r++) pthread_create(&th[r], NULL, run_rank, &ms[r]);
    for (int r = 0; r < size; r++) pthread_join(th[r], NULL);
    int64_t n = mrl_model_num_params(whole);
    float *sum = calloc((size_t)n, sizeof(float));
    double worst_lp = 0;
    for (int r = 0; r < size; r++) {
        CHECK_OK(ms[r].fwd);
        CHECK_OK(ms[r].bwd);
        for (int64_t i = 0; i < x.b.n_tokens; i++) {
            double d = fmax(fabs(ms[r].lp[i] - lp[i]), fabs(ms[r].ent[i] - ent[i]));
            if (c.value_head) d = fmax(d, fabs(ms[r].val[i] - val[i]));
            if (!(d <= worst_lp)) worst_lp = d;
        }
        const float *gr = mrl_model_grads(ms[r].m);
        for (int64_t i = 0; i < n; i++) sum[i] += gr[i];
    }
    const char *which = "";
    double worst_g = worst_view(whole, sum, mrl_model_grads(whole), &which);
    printf("%s %s cp=%d: max |d lp, ent, value| %.3g, the ranks' gradients summed within %.3g (%s)\n",
           mrl_model_arch_names(arch)->model_type, dtype ? "bf16" : "fp32", size, worst_lp, worst_g, which);
    CHECK(worst_lp <= (dtype ? LP_TOL16 : LP_TOL));
    CHECK(worst_g <= (dtype ? GRAD_TOL16 : GRAD_TOL));
    /* a batch of fewer tokens than ranks (3: two sequences of 2 and 1): the ranks without one take
     * part in the exchanges, and every rank has the whole model's outputs */
    int32_t tok3[3] = {5, 9, 2}, tg3[3] = {9, -1, -1}, cu3[3] = {0, 2, 3};
    mrl_batch b3 = {tok3, tg3, cu3, 3, 2, NULL};
    float lp3[3], ent3[3], val3[3];
    CHECK_OK(mrl_model_forward(whole, &b3, 1.0f, lp3, ent3, c.value_head ? val3 : NULL));
    batch x3 = x;
    x3.b = b3;
    for (int r = 0; r < size; r++) ms[r].b = &x3.b, ms[r].x = &x3;
    for (int r = 0; r < size; r++) pthread_create(&th[r], NULL, run_rank, &ms[r]);
    for (int r = 0; r < size; r++) pthread_join(th[r], NULL);
    double worst3 = 0;
    for (int r = 0; r < size; r++) {
        CHECK_OK(ms[r].fwd);
        CHECK_OK(ms[r].bwd);
        for (int i = 0; i < 3; i++) worst3 = fmax(worst3, fmax(fabs(ms[r].lp[i] - lp3[i]), fabs(ms[r].ent[i] - ent3[i])));
    }
    printf("  a batch of 3 tokens over %d ranks: outputs within %.3g\n", size, worst3);
    CHECK(worst3 <= (dtype ? LP_TOL16 : LP_TOL));
    free(sum);
    for (int r = 0; r < size; r++) mrl_model_free(ms[r].m);
    pthread_barrier_destroy(&g.bar);
    mrl_model_free(whole);
}

/* Tensor and context parallel together on 4 ranks (tp 2 x cp 2): rank r holds slice r % 2 and
 * takes token share r / 2; its sums go over its tensor-parallel pair, its all-to-alls over its
 * context-parallel pair. Every rank's outputs the whole model's; each slice's gradient, summed
 * over the two ranks that hold it, the slice of the whole model's. */
static void case_tp_cp(int arch, const char *dir) {
    mrl_model_config c = small_config(arch);
    c.vocab_size = 212;
    c.value_head = arch == MRL_ARCH_LLAMA;
    c.num_key_value_heads = 4; /* (2 a slice, split over the context-parallel pair) */
    batch x;
    float lp[96], ent[96], val[96];
    mrl_model *whole = reference(&c, 41 + (uint64_t)arch, 0, dir, &x, lp, ent, val);
    group tg[2] = {{.size = 2}, {.size = 2}}, cg[2] = {{.size = 2}, {.size = 2}};
    for (int i = 0; i < 2; i++) pthread_barrier_init(&tg[i].bar, NULL, 2), pthread_barrier_init(&cg[i].bar, NULL, 2);
    member ms[4], cps[4];
    pthread_t th[4];
    char out[2][300]; /* (each tensor-parallel pair saves, into its own directory) */
    for (int i = 0; i < 2; i++) snprintf(out[i], sizeof out[i], "%s/tp_cp_saved%d", dir, i);
    for (int r = 0; r < 4; r++) {
        ms[r] = (member){.g = &tg[r / 2], .rank = r % 2, .b = &x.b, .x = &x, .save_to = out[r / 2]};
        cps[r] = (member){.g = &cg[r % 2], .rank = r / 2};
        CHECK_OK(mrl_model_load_dir_tp(dir, r % 2, 2, 0, &ms[r].m));
        CHECK_OK(mrl_model_set_tp_group(ms[r].m, group_sum, group_gather, &ms[r]));
        CHECK_OK(mrl_model_set_cp_group(ms[r].m, r / 2, 2, group_gather, group_a2a, &cps[r]));
    }
    for (int r = 0; r < 4; r++) pthread_create(&th[r], NULL, run_rank, &ms[r]);
    for (int r = 0; r < 4; r++) pthread_join(th[r], NULL);
    double worst_lp = 0, worst_g = 0;
    const char *worst_name = "";
    const float *gw = mrl_model_grads(whole);
    for (int r = 0; r < 4; r++) {
        CHECK_OK(ms[r].fwd);
        CHECK_OK(ms[r].bwd);
        CHECK_OK(ms[r].saved);
        for (int64_t i = 0; i < x.b.n_tokens; i++) {
            double d = fmax(fabs(ms[r].lp[i] - lp[i]), fabs(ms[r].ent[i] - ent[i]));
            if (c.value_head) d = fmax(d, fabs(ms[r].val[i] - val[i]));
            if (!(d <= worst_lp)) worst_lp = d;
        }
        if (r >= 2) continue;
        const float *g0 = mrl_model_grads(ms[r].m), *g1 = mrl_model_grads(ms[r + 2].m); /* the slice's two token shares */
        for (int i = 0; i < mrl_model_num_views(ms[r].m); i++) {
            mrl_param_view v, w;
            mrl_model_view(ms[r].m, i, &v);
            CHECK_OK(mrl_model_find_view(whole, v.name, &w));
            float *want = malloc(sizeof(float) * (size_t)v.numel), *got = malloc(sizeof(float) * (size_t)v.numel);
            slice_of(&w, &v, gw, r, want);
            for (int64_t j = 0; j < v.numel; j++) got[j] = g0[v.offset + j] + g1[v.offset + j];
            double e = rel(got, want, v.numel);
            if (!(e <= worst_g)) worst_g = e, worst_name = v.name;
            free(want), free(got);
        }
    }
    printf("%s tp=2 x cp=2: max |d lp, ent, value| %.3g, worst gradient %.3g (%s)\n", mrl_model_arch_names(arch)->model_type,
           worst_lp, worst_g, worst_name);
    CHECK(worst_lp <= LP_TOL);
    CHECK(worst_g <= GRAD_TOL);
    for (int r = 0; r < 4; r++) mrl_model_free(ms[r].m);
    for (int i = 0; i < 2; i++) pthread_barrier_destroy(&tg[i].bar), pthread_barrier_destroy(&cg[i].bar);
    mrl_model_free(whole);
}

/* ---- the engine over slices ---- */

enum { PROMPTS = 3, SAMPLES = 2, NEW = 12 };

typedef struct gen {
    mrl_model *m;
    int32_t tokens[2 * PROMPTS][SAMPLES][NEW]; /* greedy, then sampled */
    float lps[2 * PROMPTS][SAMPLES][NEW];
    int n[2 * PROMPTS][SAMPLES];
    int64_t kv_bytes, batch_tokens; /* 0: 1 MiB and 64 */
    int64_t preemptions;            /* the engine's, over both rounds */
    mrl_status st;
} gen;

/* Two rounds: greedy, then sampled (seeded streams); prompts 0 and 1 share their first tokens. */
static void *generate(void *arg) {
    gen *g = arg;
    mrl_engine_config ec;
    mrl_engine_config_default(&ec);
    ec.kv_cache_bytes = g->kv_bytes ? g->kv_bytes : 1 << 20, ec.max_num_seqs = 8, ec.block_size = 4;
    ec.max_num_batched_tokens = g->batch_tokens ? (int)g->batch_tokens : 64;
    mrl_engine *e = NULL;
    if ((g->st = mrl_engine_create(g->m, &ec, &e))) return NULL;
    static const int32_t prompts[PROMPTS][6] = {{3, 9, 14, 2, 7, 5}, {3, 9, 14, 2, 11, 1}, {8, 4, 6, 19, 2, 12}};
    for (int round = 0; round < 2 && !g->st; round++) {
        int ids[PROMPTS];
        for (int i = 0; i < PROMPTS && !g->st; i++) {
            mrl_engine_request r = {.prompt = prompts[i], .prompt_len = 6, .n = SAMPLES, .max_new_tokens = NEW,
                                    .params = {.temperature = round ? 1.0f : 0.0f, .top_k = 0, .top_p = 1.0f},
                                    .seed = 77, .step = round, .prompt_index = i};
            g->st = mrl_engine_add_request(e, &r, &ids[i]);
        }
        if (!g->st) g->st = mrl_engine_run(e);
        for (int i = 0; i < PROMPTS && !g->st; i++)
            for (int j = 0; j < SAMPLES && !g->st; j++) {
                const int32_t *tok;
                const float *lp;
                int n, why, at = round * PROMPTS + i;
                g->st = mrl_engine_get_output(e, ids[i], j, &tok, &lp, &n, &why);
                g->n[at][j] = n;
                for (int t = 0; t < n && t < NEW; t++) g->tokens[at][j][t] = tok[t], g->lps[at][j][t] = lp[t];
            }
        if (!g->st && round == 0) g->st = mrl_engine_reset(e);
    }
    mrl_engine_stats es;
    mrl_engine_get_stats(e, &es);
    g->preemptions = es.preemptions;
    mrl_engine_free(e);
    return NULL;
}

static void *generate_rank(void *arg) { return generate(arg); }

/* tight: a KV cache of 16 KiB (64 tokens of a rank's K/V heads, 32 of the whole model's) and 5
 * tokens a step: sequences pre-empted and recomputed, prompts prefilled in chunks; the tokens
 * must not change. */
static void case_engine(int arch, int dtype, int vocab, int tight, const char *dir) {
    mrl_model_config c = small_config(arch);
    c.vocab_size = vocab; /* 212: the logits in slices, gathered for the sampler */
    if (arch == MRL_ARCH_QWEN3_MOE) /* experts: each rank's slice of every one */
        c.num_experts = 6, c.num_experts_per_tok = 2, c.moe_intermediate_size = 32, c.decoder_sparse_step = 1;
    mrl_model *src = small_model(&c, 21);
    CHECK_OK(mrl_model_save_dir(src, dir));
    mrl_model_free(src);
    gen whole = {0};
    if (tight) whole.kv_bytes = 16 << 10, whole.batch_tokens = 5;
    CHECK_OK(mrl_model_load_dir(dir, &whole.m));
    CHECK_OK(mrl_model_set_dtype(whole.m, dtype));
    generate(&whole);
    CHECK_OK(whole.st);
    group g = {.size = 2};
    pthread_barrier_init(&g.bar, NULL, 2);
    member ms[2];
    gen ranks[2];
    pthread_t th[2];
    for (int r = 0; r < 2; r++) {
        ms[r] = (member){.g = &g, .rank = r};
        memset(&ranks[r], 0, sizeof ranks[r]);
        ranks[r].kv_bytes = whole.kv_bytes, ranks[r].batch_tokens = whole.batch_tokens;
        CHECK_OK(mrl_model_load_dir_tp(dir, r, 2, 0, &ranks[r].m));
        CHECK_OK(mrl_model_set_dtype(ranks[r].m, dtype));
        CHECK_OK(mrl_model_set_tp_group(ranks[r].m, group_sum, group_gather, &ms[r]));
        pthread_create(&th[r], NULL, generate_rank, &ranks[r]);
    }
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    int64_t tokens = 0, differ = 0, across = 0;
    double worst = 0;
    for (int r = 0; r < 2; r++) {
        CHECK_OK(ranks[r].st);
        for (int i = 0; i < 2 * PROMPTS; i++)
            for (int j = 0; j < SAMPLES; j++) {
                differ += ranks[r].n[i][j] != whole.n[i][j];
                for (int t = 0; t < whole.n[i][j] && t < NEW; t++) {
                    tokens += r == 0;
                    differ += ranks[r].tokens[i][j][t] != whole.tokens[i][j][t];
                    across += ranks[r].tokens[i][j][t] != ranks[0].tokens[i][j][t] ||
                              memcmp(&ranks[r].lps[i][j][t], &ranks[0].lps[i][j][t], sizeof(float)) != 0;
                    double d = fabs(ranks[r].lps[i][j][t] - whole.lps[i][j][t]);
                    if (!(d <= worst)) worst = d;
                }
            }
        mrl_model_free(ranks[r].m);
    }
    printf("engine %s %s tp=2, vocabulary %d%s: %lld tokens (greedy, sampled), %lld differ from the whole model's, "
           "log-probs within %.3g; pre-emptions %lld (ranks), %lld (whole)\n", mrl_model_arch_names(arch)->model_type,
           dtype ? "bf16" : "fp32", vocab,
           tight ? ", a tight cache and 5 tokens a step" : "", (long long)tokens, (long long)differ, worst,
           (long long)ranks[0].preemptions, (long long)whole.preemptions);
    CHECK(tokens > 2 * PROMPTS * SAMPLES && differ == 0 && across == 0);
    CHECK(!tight || (ranks[0].preemptions > 0 && ranks[1].preemptions == ranks[0].preemptions));
    CHECK(worst <= (dtype ? LP_TOL16 : LP_TOL));
    pthread_barrier_destroy(&g.bar);
    mrl_model_free(whole.m);
}

/* Sizes the config does not divide, a mixture of experts: errors naming the key. A forward
 * without the allreduce fails naming it. */
static void case_refusals(const char *dir) {
    mrl_model_config c = small_config(MRL_ARCH_QWEN3);
    mrl_model *src = small_model(&c, 5);
    CHECK_OK(mrl_model_save_dir(src, dir));
    mrl_model_free(src);
    mrl_model *m = NULL;
    CHECK(mrl_model_load_dir_tp(dir, 0, 3, 0, &m) == MRL_ERR_INVALID && !m);
    CHECK_STR_CONTAINS(mrl_last_error(), "num_attention_heads (4) is not a multiple of 3");
    CHECK(mrl_model_load_dir_tp(dir, 2, 2, 0, &m) == MRL_ERR_INVALID);
    CHECK_OK(mrl_model_load_dir_tp(dir, 1, 2, 0, &m));
    batch x;
    make_batch(&x, c.vocab_size);
    float lp[96];
    CHECK(mrl_model_forward(m, &x.b, 1.0f, lp, NULL, NULL) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "mrl_model_set_tp_group");
    char out[300];
    snprintf(out, sizeof out, "%s/slices", dir);
    CHECK(mrl_model_save_dir(m, out) == MRL_ERR_INVALID); /* saving gathers the slices: the group's */
    CHECK_STR_CONTAINS(mrl_last_error(), "all-gather");
    mrl_model_free(m);
    mrl_model *whole = NULL;
    CHECK_OK(mrl_model_load_dir(dir, &whole));
    CHECK(mrl_model_set_tp_group(whole, group_sum, group_gather, NULL) == MRL_ERR_INVALID);
    /* context parallel: heads it does not divide */
    CHECK(mrl_model_set_cp_group(whole, 0, 3, group_gather, group_a2a, NULL) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "num_attention_heads (4) is not a multiple of 3");
    CHECK_OK(mrl_model_set_cp_group(whole, 0, 1, NULL, NULL, NULL)); /* (size 1: off) */
    CHECK(mrl_model_set_sequence_parallel(whole, 1) == MRL_ERR_INVALID); /* not tensor parallel */
    CHECK_STR_CONTAINS(mrl_last_error(), "not tensor parallel");
    mrl_model *odd = NULL; /* a vocabulary of 211 over 2 ranks: the head is whole, sequence parallel refused */
    CHECK_OK(mrl_model_load_dir_tp(dir, 0, 2, 0, &odd));
    CHECK(mrl_model_set_sequence_parallel(odd, 1) == MRL_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(mrl_last_error(), "split by vocabulary");
    mrl_model_free(odd);
    CHECK(mrl_model_tp(whole, NULL, NULL) == 1);
    mrl_model_free(whole);
    mrl_model_config e;
    tiny_config(&e, MRL_ARCH_QWEN3_MOE, 64);
    e.num_experts = 4, e.num_experts_per_tok = 2, e.moe_intermediate_size = 32, e.decoder_sparse_step = 1;
    CHECK_OK(mrl_model_create(&e, 3, &src));
    CHECK_OK(mrl_model_save_dir(src, dir));
    mrl_model_free(src);
    CHECK(mrl_model_load_dir_tp(dir, 0, 3, 0, &m) == MRL_ERR_INVALID); /* (4 heads) */
    e.num_attention_heads = 6, e.num_key_value_heads = 3, e.head_dim = 8, e.num_hidden_layers = 1;
    e.intermediate_size = 97; /* (no dense layer: not divided) */
    CHECK_OK(mrl_model_create(&e, 3, &src));
    CHECK_OK(mrl_model_save_dir(src, dir));
    mrl_model_free(src);
    CHECK(mrl_model_load_dir_tp(dir, 0, 3, 0, &m) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "moe_intermediate_size (32) is not a multiple of 3");
    e.vocab_size = 66, e.moe_intermediate_size = 33;
    CHECK_OK(mrl_model_create(&e, 3, &src));
    CHECK_OK(mrl_model_save_dir(src, dir));
    mrl_model_free(src);
    CHECK_OK(mrl_model_load_dir_tp(dir, 1, 3, 0, &m));
    CHECK(mrl_model_get_config(m)->moe_intermediate_size == 11 && mrl_model_get_config(m)->intermediate_size == 97);
    CHECK(mrl_model_set_sequence_parallel(m, 1) == MRL_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(mrl_last_error(), "mixture of experts");
    mrl_model_free(m);
}

int main(void) {
    rng = MRL_GOLDEN64;
    char dir[] = "/tmp/moonrl_tp_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    static const int arches[3] = {MRL_ARCH_LLAMA, MRL_ARCH_QWEN2, MRL_ARCH_QWEN3};
    for (int a = 0; a < 3; a++)
        for (int dtype = 0; dtype < 2; dtype++) case_tp(arches[a], dtype, 2, 0, 212, 0, dir);
    case_tp(MRL_ARCH_QWEN2, 0, 4, 0, 212, 0, dir);
    for (int dtype = 0; dtype < 2; dtype++) case_tp(MRL_ARCH_QWEN3_MOE, dtype, 2, 0, 212, 0, dir); /* experts split */
    case_tp(MRL_ARCH_QWEN3_MOE, 0, 4, 1, 212, 0, dir);
    for (int a = 0; a < 3; a++) case_tp(arches[a], 0, 4, 1, 212, 0, dir); /* 2 K/V heads over 4 ranks */
    case_tp(MRL_ARCH_QWEN2, 0, 2, 0, 211, 0, dir); /* a vocabulary 2 does not divide: whole embedding and head */
    case_tp(MRL_ARCH_LLAMA, 1, 4, 0, 211, 0, dir);
    /* sequence parallel: 2 and 4 ranks, shared K/V heads, bf16 */
    for (int a = 0; a < 3; a++) case_tp(arches[a], 0, 2, 0, 212, 1, dir);
    case_tp(MRL_ARCH_QWEN3, 1, 2, 0, 212, 1, dir);
    case_tp(MRL_ARCH_QWEN2, 0, 4, 0, 212, 1, dir);
    case_tp(MRL_ARCH_LLAMA, 0, 4, 1, 212, 1, dir);
    for (int dtype = 0; dtype < 2; dtype++) case_engine(MRL_ARCH_QWEN3, dtype, 212, 0, dir);
    case_engine(MRL_ARCH_QWEN3, 0, 211, 0, dir);
    case_engine(MRL_ARCH_QWEN3, 0, 212, 1, dir);
    case_engine(MRL_ARCH_QWEN3_MOE, 0, 212, 0, dir);
    for (int a = 0; a < 3; a++) case_cp(arches[a], 0, 2, dir);
    case_cp(MRL_ARCH_QWEN3, 1, 2, dir);
    case_cp(MRL_ARCH_QWEN2, 0, 4, dir);
    for (int a = 0; a < 3; a++) case_tp_cp(arches[a], dir);
    case_tp_shards(dir);
    case_refusals(dir);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    mrl_shutdown();
    CHECK_DONE();
}
