/* Pipeline parallel (mrl_model_load_dir_stage, moonrl/model.h) against the
 * whole model, for Llama with a tied head and a value head, Qwen2's biases
 * and own lm_head, and Qwen3's per-head norms, in fp32 and bf16: the stages
 * are loaded from the whole model's directory (2 stages of 2 layers, an
 * uneven 1 + 3, and 4 of one layer) and run K micro-batches (1, 2, 8) under
 * the 1F1B schedule in one thread: each stage's ops in 1F1B order, an op
 * run as soon as its input is there (the stage before's output rows, the
 * stage after's gradient of them), each micro-batch in the activation slot
 * j mod (stages - stage) — the one its backward frees in 1F1B:
 *   - each stage's views: its layers' (named by the whole model's layer
 *     numbers), the embedding on the first, the final norm, head and value
 *     head on the last (a tied head: a copy of the embedding), the values
 *     the whole model's;
 *   - the last stage's log-probs, entropy and values of every micro-batch:
 *     the whole model's bits (the same products in the same order; the rows
 *     between stages are copied);
 *   - the gradients accumulated over the micro-batches: each view's the
 *     whole model's bits, but a tied embedding's, whose two parts (the first
 *     stage's embedding rows, the last stage's head) add in another order;
 *     summed, within 1e-6 of the whole model's;
 *   - a mixture of experts (Qwen3-MoE, a dense layer between sparse ones: a
 *     stage's own numbering of them differs from the whole model's), its
 *     batches' routing replayed (rows of all the whole model's sparse
 *     layers, picks that are not the router's), with the load-balancing loss
 *     (its statistics sent on with the rows, the totals back with their
 *     gradients): the same bits, and the last stage's aux loss the whole
 *     model's;
 *   - the refusals: a stage outside the layers, a forward without input, a
 *     backward without the output's gradient, load-balancing statistics
 *     given to a model that is not a sparse stage or with a bad count. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "check.h"
#include "models.h"
#include "moonrl/model.h"
#include "moonrl/runtime.h"

enum { MAX_PP = 4, MAX_MB = 8 };

/* ||a - b|| / ||b|| over n floats */
static double rel(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), den += (double)b[i] * b[i];
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

typedef struct stage_run {
    mrl_model *m;
    int next;          /* the next op of its 1F1B order */
    int ops[2 * MAX_MB]; /* j >= 0: forward of micro-batch j; -1 - j: its backward */
} stage_run;

static void case_pp(int arch, int dtype, int stages, const int *layers, int K, const char *dir) {
    mrl_model_config c = small_config(arch);
    c.num_hidden_layers = 4;
    c.value_head = arch == MRL_ARCH_LLAMA;
    int moe = arch == MRL_ARCH_QWEN3_MOE;
    if (moe) { /* layer 1 dense, the others sparse: a stage's own numbering differs from the whole's */
        c.num_experts = 5, c.num_experts_per_tok = 2, c.moe_intermediate_size = 24, c.decoder_sparse_step = 1;
        c.norm_topk_prob = 1, c.mlp_only_layers[0] = 2;
    }
    mrl_model *src = small_model(&c, 21 + (uint64_t)arch);
    CHECK_OK(mrl_model_save_dir(src, dir));
    mrl_model_free(src);
    mrl_model *whole = NULL;
    CHECK_OK(mrl_model_load_dir(dir, &whole));
    CHECK_OK(mrl_model_set_dtype(whole, dtype));
    if (moe) mrl_model_set_router_aux_coef(whole, 0.01);
    static double aux_loss[MAX_MB], auxf[MAX_PP][MAX_MB][11], auxb[MAX_PP][MAX_MB][11]; /* 2 E + 1 */
    static batch xs[MAX_MB];
    static float lp[MAX_MB][96], ent[MAX_MB][96], val[MAX_MB][96];
    static int16_t routes[MAX_MB][96 * 3 * 2];
    for (int j = 0; j < K; j++) {
        make_batch(&xs[j], c.vocab_size);
        if (moe) { /* routing replay: other picks than the router's, the rows the whole model's (3 sparse layers) */
            for (int64_t t = 0; t < xs[j].b.n_tokens; t++)
                for (int o = 0; o < 3; o++)
                    for (int k = 0; k < 2; k++) routes[j][(t * 3 + o) * 2 + k] = (int16_t)((t + 3 * o + k + j) % 5);
            xs[j].b.routing = routes[j];
        }
        CHECK_OK(mrl_model_forward(whole, &xs[j].b, 0.8f, lp[j], ent[j], c.value_head ? val[j] : NULL));
        aux_loss[j] = mrl_model_router_aux_loss(whole);
        CHECK(!moe || aux_loss[j] > 0);
        CHECK_OK(mrl_model_backward(whole, xs[j].dlp, xs[j].dent, c.value_head ? xs[j].dval : NULL));
        int64_t replayed = 0, differ = 0;
        mrl_model_routing_replay_stats(whole, &replayed, &differ);
        CHECK(!moe || (replayed == 3 * xs[j].b.n_tokens && differ > 0)); /* (other picks than its own) */
    }
    const float *gw = mrl_model_grads(whole), *pw = mrl_model_params(whole);

    stage_run st[MAX_PP];
    for (int s = 0, first = 0; s < stages; first += layers[s], s++) {
        mrl_model_stage spec = {s, stages, first, layers[s]};
        st[s] = (stage_run){0};
        CHECK_OK(mrl_model_load_dir_stage(dir, &spec, 0, 1, 0, &st[s].m));
        if (!st[s].m) exit(1);
        CHECK_OK(mrl_model_set_dtype(st[s].m, dtype));
        CHECK_OK(mrl_model_pp_slots(st[s].m, stages - s));
        CHECK(mrl_model_pp_aux_size(st[s].m) == (moe ? 11 : 0));
        if (moe) mrl_model_set_router_aux_coef(st[s].m, 0.01);
        mrl_model_stage got;
        CHECK(mrl_model_pp(st[s].m, &got) == stages && got.stage == s && got.first_layer == first &&
              got.layers == layers[s] && mrl_model_pp_layers(st[s].m) == 4);
        CHECK(mrl_model_get_config(st[s].m)->num_hidden_layers == layers[s]);
        CHECK(mrl_model_num_moe_layers(st[s].m) == (moe ? 3 : 0)); /* (the whole model's) */
        /* the views: this stage's parts, named as in the whole model, with its values */
        int64_t n = 0;
        for (int i = 0; i < mrl_model_num_views(st[s].m); i++) {
            mrl_param_view v, w;
            mrl_model_view(st[s].m, i, &v);
            CHECK_OK(mrl_model_find_view(whole, v.name, &w));
            int l = -1;
            if (sscanf(v.name, "model.layers.%d.", &l) == 1) CHECK(l >= first && l < first + layers[s]);
            else if (strcmp(v.name, "model.embed_tokens.weight") == 0) CHECK(s == 0 || (s == stages - 1 && c.tie_word_embeddings));
            else CHECK(s == stages - 1);
            CHECK(v.numel == w.numel && memcmp(mrl_model_params(st[s].m) + v.offset, pw + w.offset, 4 * (size_t)v.numel) == 0);
            n += v.numel;
        }
        CHECK(n == mrl_model_num_params(st[s].m));
        /* 1F1B: min(stages - s - 1, K) forwards, then one forward and one backward, then the backwards */
        int w = stages - s - 1 < K ? stages - s - 1 : K, o = 0;
        for (int j = 0; j < w; j++) st[s].ops[o++] = j;
        for (int j = w; j < K; j++) st[s].ops[o++] = j, st[s].ops[o++] = -1 - (j - w);
        for (int j = K - w; j < K; j++) st[s].ops[o++] = -1 - j;
        CHECK(o == 2 * K);
    }
    /* the rows between stages: out[s][j] stage s's output of micro-batch j, grad[s][j] the
     * gradient of stage s's input (NULL: not yet) */
    float *out[MAX_PP][MAX_MB] = {{0}}, *grad[MAX_PP][MAX_MB] = {{0}};
    float got_lp[96], got_ent[96], got_val[96];
    int64_t D = c.hidden_size;
    for (int progress = 1; progress;) {
        progress = 0;
        for (int s = 0; s < stages; s++) {
            stage_run *r = &st[s];
            if (r->next == 2 * K) continue;
            int op = r->ops[r->next], j = op >= 0 ? op : -1 - op, last = s == stages - 1;
            if (op >= 0 && s > 0 && !out[s - 1][j]) continue;      /* its input not there yet */
            if (op < 0 && !last && !grad[s + 1][j]) continue;        /* its output's gradient not yet */
            CHECK_OK(mrl_model_pp_use_slot(r->m, j % (stages - s)));
            int64_t rows = mrl_model_pp_rows(r->m, &xs[j].b);
            CHECK(rows == xs[j].b.n_tokens);
            if (op >= 0) {
                if (s > 0) CHECK_OK(mrl_model_pp_set_input(r->m, out[s - 1][j]));
                if (s > 0 && moe) CHECK_OK(mrl_model_pp_aux_set(r->m, auxf[s - 1][j]));
                CHECK_OK(mrl_model_forward(r->m, &xs[j].b, 0.8f, last ? got_lp : NULL, last ? got_ent : NULL,
                                           last && c.value_head ? got_val : NULL));
                if (moe) CHECK_OK(mrl_model_pp_aux_get(r->m, auxf[s][j]));
                if (last) { /* the whole model's bits */
                    CHECK(memcmp(got_lp, lp[j], 4 * (size_t)rows) == 0 && memcmp(got_ent, ent[j], 4 * (size_t)rows) == 0);
                    CHECK(mrl_model_router_aux_loss(r->m) == aux_loss[j]);
                    if (c.value_head) CHECK(memcmp(got_val, val[j], 4 * (size_t)rows) == 0);
                } else {
                    const float *y = mrl_model_pp_output(r->m);
                    CHECK(y != NULL);
                    out[s][j] = malloc(sizeof(float) * (size_t)(rows * D));
                    if (y) memcpy(out[s][j], y, sizeof(float) * (size_t)(rows * D));
                }
            } else {
                if (!last) CHECK_OK(mrl_model_pp_set_output_grad(r->m, grad[s + 1][j]));
                if (!last && moe) CHECK_OK(mrl_model_pp_aux_set(r->m, auxb[s + 1][j]));
                CHECK_OK(mrl_model_backward(r->m, last ? xs[j].dlp : NULL, last ? xs[j].dent : NULL,
                                            last && c.value_head ? xs[j].dval : NULL));
                if (moe) CHECK_OK(mrl_model_pp_aux_get(r->m, auxb[s][j])); /* (the totals, for the stage before) */
                if (s > 0) {
                    const float *dx = mrl_model_pp_input_grad(r->m);
                    CHECK(dx != NULL);
                    grad[s][j] = malloc(sizeof(float) * (size_t)(rows * D));
                    if (dx) memcpy(grad[s][j], dx, sizeof(float) * (size_t)(rows * D));
                }
            }
            r->next++;
            progress = 1;
        }
    }
    for (int s = 0; s < stages; s++) CHECK(st[s].next == 2 * K); /* (the schedule never waits forever) */
    /* the gradients: the whole model's bits, a tied embedding's two parts summed within 1e-6 */
    float *tied = NULL;
    for (int s = 0; s < stages; s++) {
        const float *g = mrl_model_grads(st[s].m);
        for (int i = 0; i < mrl_model_num_views(st[s].m); i++) {
            mrl_param_view v, w;
            mrl_model_view(st[s].m, i, &v);
            mrl_model_find_view(whole, v.name, &w);
            if (c.tie_word_embeddings && strcmp(v.name, "model.embed_tokens.weight") == 0) {
                if (!tied) tied = calloc((size_t)v.numel, sizeof(float));
                for (int64_t e = 0; e < v.numel; e++) tied[e] += g[v.offset + e];
                continue;
            }
            int same = memcmp(g + v.offset, gw + w.offset, 4 * (size_t)v.numel) == 0;
            if (!same) fprintf(stderr, "stage %d of %d, %s: gradient %g from the whole model's\n", s, stages, v.name,
                               rel(g + v.offset, gw + w.offset, v.numel));
            CHECK(same);
        }
    }
    if (tied) {
        mrl_param_view w;
        mrl_model_find_view(whole, "model.embed_tokens.weight", &w);
        CHECK(rel(tied, gw + w.offset, w.numel) < 1e-6);
        free(tied);
    }
    for (int s = 0; s < stages; s++) {
        for (int j = 0; j < K; j++) free(out[s][j]), free(grad[s][j]);
        mrl_model_free(st[s].m);
    }
    mrl_model_free(whole);
}

static void case_refusals(const char *dir) {
    mrl_model_config c = small_config(MRL_ARCH_LLAMA);
    c.num_hidden_layers = 4;
    mrl_model *src = small_model(&c, 5), *m = NULL;
    CHECK_OK(mrl_model_save_dir(src, dir));
    mrl_model_free(src);
    mrl_model_stage bad = {1, 2, 2, 3}; /* layers 2 .. 4 of 4 */
    CHECK(mrl_model_load_dir_stage(dir, &bad, 0, 1, 0, &m) == MRL_ERR_INVALID && !m);
    CHECK_STR_CONTAINS(mrl_last_error(), "num_hidden_layers");
    mrl_model_stage one = {1, 2, 2, 2};
    CHECK_OK(mrl_model_load_dir_stage(dir, &one, 0, 1, 0, &m));
    batch x;
    make_batch(&x, c.vocab_size);
    CHECK(mrl_model_forward(m, &x.b, 1.0f, NULL, NULL, NULL) == MRL_ERR_INVALID); /* no input rows */
    CHECK_STR_CONTAINS(mrl_last_error(), "mrl_model_pp_set_input");
    CHECK(mrl_model_pp_set_output_grad(m, x.dlp) == MRL_ERR_INVALID); /* the last stage has the head */
    mrl_model_free(m);
    mrl_model_stage zero = {0, 2, 0, 2};
    CHECK_OK(mrl_model_load_dir_stage(dir, &zero, 0, 1, 0, &m));
    CHECK_OK(mrl_model_forward(m, &x.b, 1.0f, NULL, NULL, NULL));
    CHECK(mrl_model_backward(m, NULL, NULL, NULL) == MRL_ERR_INVALID); /* no gradient of its output */
    CHECK_STR_CONTAINS(mrl_last_error(), "mrl_model_pp_set_output_grad");
    CHECK(mrl_model_pp_set_input(m, x.dlp) == MRL_ERR_INVALID); /* the first stage reads tokens */
    CHECK(mrl_model_pp_use_slot(m, 1) == MRL_ERR_INVALID);     /* one slot */
    double stats[9] = {0};
    CHECK(mrl_model_pp_aux_size(m) == 0 && mrl_model_pp_aux_set(m, stats) == MRL_ERR_INVALID); /* dense */
    mrl_model_free(m);
    mrl_model_config e = small_config(MRL_ARCH_QWEN3);
    e.arch = MRL_ARCH_QWEN3_MOE, e.num_experts = 4, e.num_experts_per_tok = 2, e.moe_intermediate_size = 32,
    e.decoder_sparse_step = 1;
    CHECK_OK(mrl_model_create(&e, 3, &src));
    CHECK_OK(mrl_model_save_dir(src, dir));
    mrl_model_free(src);
    mrl_model_stage moe = {0, 2, 0, 1};
    CHECK_OK(mrl_model_load_dir_stage(dir, &moe, 0, 1, 0, &m));
    CHECK(mrl_model_pp_aux_size(m) == 9);
    stats[8] = -1; /* a negative token count */
    CHECK(mrl_model_pp_aux_set(m, stats) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "token count");
    mrl_model_free(m);
}

int main(void) {
    rng = MRL_GOLDEN64;
    char dir[] = "/tmp/moonrl_pp_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    static const int arches[3] = {MRL_ARCH_LLAMA, MRL_ARCH_QWEN2, MRL_ARCH_QWEN3};
    static const int two[2] = {2, 2}, uneven[2] = {1, 3}, four[4] = {1, 1, 1, 1};
    for (int a = 0; a < 3; a++)
        for (int dtype = 0; dtype < 2; dtype++) case_pp(arches[a], dtype, 2, two, 2, dir);
    for (int K = 1; K <= 8; K *= 2) case_pp(MRL_ARCH_LLAMA, 0, 4, four, K, dir);
    case_pp(MRL_ARCH_QWEN2, 0, 4, four, 8, dir);
    case_pp(MRL_ARCH_QWEN3, 1, 2, uneven, 8, dir);
    case_pp(MRL_ARCH_QWEN2, 0, 2, uneven, 1, dir);
    /* a mixture of experts (a dense layer between sparse ones, routing replayed): 2 + 2, 1 + 3, 4 x 1 */
    for (int dtype = 0; dtype < 2; dtype++) case_pp(MRL_ARCH_QWEN3_MOE, dtype, 2, two, 2, dir);
    case_pp(MRL_ARCH_QWEN3_MOE, 0, 2, uneven, 8, dir);
    case_pp(MRL_ARCH_QWEN3_MOE, 0, 4, four, 8, dir);
    case_refusals(dir);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    mrl_shutdown();
    CHECK_DONE();
}
