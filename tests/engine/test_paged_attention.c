/* Paged attention over a real KV cache: the K/V written by the op table's
 * paged_kv_write into the slots mrl_kv_cache_append gives, then paged_attn
 * (reference and fast tables) against a straightforward contiguous causal
 * attention, on random data: several sequences grown in interleaved steps
 * (so their blocks interleave), forks that share a parent's blocks (full
 * and partial, copy-on-write), mixed prefill chunks and single-token
 * decodes, GQA; with the cache in fp32 and in bf16. A bf16 cache on a CPU
 * with AVX512-BF16 takes bf16 products (q and the softmax weights rounded
 * to bf16): that path is held, row by row, to attention with the weights so
 * rounded, and with its bf16 products turned off to exact attention. (Each
 * op of every table against the reference, at every instruction set, and
 * the shape errors: tests/kernels/test_ops.c.) */
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "moonrl/status.h"
#include "moonrl/parallel.h"
#include "moonrl/dtype.h"
#include "engine/kv_cache.h"
#include "cpu/paged_attention.h"
#include "cpu/gemm_bf16.h"
#include "kernels.h"
#include "random.h"

#define MAXS 8
#define MAXLEN 300 /* > KEY_TILE: V accumulated over several key tiles */

typedef struct seq_data {
    int id;            /* kv cache sequence */
    int len;
    float *k, *v;      /* contiguous [MAXLEN, Hk, hd] */
} seq_data;

/* Straightforward causal attention of the last n_q tokens of a contiguous
 * sequence, in double. bf16_weights: each softmax weight rounded to bf16 (as
 * fp32 then bf16, the kernel's order) before it meets V, and slack[x] the
 * most a weight lying within 1/256 of an ulp of a rounding midpoint can move
 * output x (the kernel's fp32 weight may round the other way: one bf16 ulp,
 * at most 2^-7 of the weight); else slack is 0. */
static void contiguous_attention(float *out, float *slack, const float *q, const float *k, const float *v, int len,
                                 int n_q, int Hq, int Hk, int hd, float scale, int bf16_weights) {
    int G = Hq / Hk;
    double *p = malloc(sizeof(double) * len);
    char *near = malloc((size_t)len);
    for (int j = 0; j < n_q; j++) {
        int pos = len - n_q + j;
        for (int h = 0; h < Hq; h++) {
            const float *qq = q + ((int64_t)j * Hq + h) * hd;
            double m = -1e300, sum = 0;
            for (int c = 0; c <= pos; c++) {
                double s = 0;
                for (int d = 0; d < hd; d++) s += (double)qq[d] * k[((int64_t)c * Hk + h / G) * hd + d];
                p[c] = s * scale;
                if (p[c] > m) m = p[c];
            }
            for (int c = 0; c <= pos; c++) sum += (p[c] = exp(p[c] - m));
            for (int c = 0; c <= pos; c++) {
                p[c] /= sum;
                near[c] = 0;
                if (!bf16_weights) continue;
                float w = (float)p[c];
                uint32_t bits;
                memcpy(&bits, &w, 4);
                near[c] = abs((int)(bits & 0xffff) - 0x8000) < 256;
                p[c] = mrl_bf16_to_f32(mrl_f32_to_bf16(w));
            }
            for (int d = 0; d < hd; d++) {
                double acc = 0, sl = 0;
                for (int c = 0; c <= pos; c++) {
                    double vx = v[((int64_t)c * Hk + h / G) * hd + d];
                    acc += p[c] * vx;
                    if (near[c]) sl += p[c] * fabs(vx) / 128;
                }
                out[((int64_t)j * Hq + h) * hd + d] = (float)acc;
                slack[((int64_t)j * Hq + h) * hd + d] = (float)sl;
            }
        }
    }
    free(p);
    free(near);
}

/* The worst of max |got - want| / max |want| over the (token, head) rows of
 * hd values, what each output's slack allows taken off first. */
static double row_error(const float *got, const float *want, const float *slack, int64_t rows, int hd) {
    double worst = 0;
    for (int64_t row = 0; row < rows; row++) {
        double mx = 1e-30, d = 0;
        for (int64_t x = row * hd; x < (row + 1) * hd; x++) {
            if (fabs(want[x]) > mx) mx = fabs(want[x]);
            double e = fabs(got[x] - want[x]) - slack[x];
            if (e > d) d = e;
        }
        if (d / mx > worst) worst = d / mx;
    }
    return worst;
}

static int64_t total_cow = 0; /* copy-on-write copies seen, all cases */

static int64_t bf16_product_rounds = 0; /* rounds that took the bf16 products */

static float bf16_exact(float x) { return mrl_bf16_to_f32(mrl_f32_to_bf16(x)); }

static void run_case(int Hq, int Hk, int hd, int bs, int n_rounds, int bf16) {
    const mrl_kernels *R = mrl_kernels_cpu_reference(), *F = mrl_kernels_cpu_fast();
    mrl_kv_cache_config cfg = {.n_layers = 2, .n_kv_heads = Hk, .head_dim = hd, .block_size = bs, .bf16 = bf16,
                               .budget_bytes = (int64_t)4 * MAXS * (MAXLEN / bs + 2) * Hk * bs * hd * 2 * 2 * 4};
    mrl_kv_cache *c;
    CHECK_OK(mrl_kv_cache_create(&cfg, &c));
    if (!c) return;
    int layer = 1;
    void *kc = mrl_kv_cache_k(c, layer), *vc = mrl_kv_cache_v(c, layer);
    seq_data s[MAXS];
    int n_seqs = 0;
    float scale = 1.0f / sqrtf((float)hd);
    for (int round = 0; round < n_rounds; round++) {
        /* grow: maybe a new sequence, maybe a fork, then each gets 1..48 new tokens */
        if (n_seqs < MAXS && (n_seqs < 2 || randi(3) == 0)) {
            seq_data *d = &s[n_seqs++];
            d->k = calloc((size_t)MAXLEN * Hk * hd, sizeof(float));
            d->v = calloc((size_t)MAXLEN * Hk * hd, sizeof(float));
            d->len = 0;
            if (n_seqs > 1 && randi(2)) { /* fork an existing one */
                seq_data *p = &s[randi(n_seqs - 1)];
                CHECK_OK(mrl_kv_cache_fork(c, p->id, &d->id));
                d->len = p->len;
                memcpy(d->k, p->k, sizeof(float) * (size_t)p->len * Hk * hd);
                memcpy(d->v, p->v, sizeof(float) * (size_t)p->len * Hk * hd);
            } else {
                CHECK_OK(mrl_kv_cache_seq_new(c, &d->id));
            }
        }
        int32_t qs[MAXS + 1], lens[MAXS], slots[MAXS * 48];
        int order[MAXS], n_new[MAXS];
        qs[0] = 0;
        for (int i = 0; i < n_seqs; i++) {
            order[i] = i;
            int room = MAXLEN - s[i].len;
            n_new[i] = room <= 0 ? 0 : 1 + randi(room < 48 ? room : 48);
            if (randi(2)) n_new[i] = room > 0; /* a decode */
        }
        for (int i = n_seqs - 1; i > 0; i--) { /* random batch order */
            int j = randi(i + 1), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        int T = 0;
        for (int b = 0; b < n_seqs; b++) T += n_new[order[b]];
        float *q = malloc(sizeof(float) * (size_t)(T ? T : 1) * Hq * hd);
        float *kn = malloc(sizeof(float) * (size_t)(T ? T : 1) * Hk * hd);
        float *vn = malloc(sizeof(float) * (size_t)(T ? T : 1) * Hk * hd);
        float *out_ref = calloc((size_t)(T ? T : 1) * Hq * hd, sizeof(float));
        float *out_fast = calloc((size_t)(T ? T : 1) * Hq * hd, sizeof(float));
        float *out_cont = calloc((size_t)(T ? T : 1) * Hq * hd, sizeof(float));
        int max_blocks = 0;
        for (int b = 0; b < n_seqs; b++) {
            seq_data *d = &s[order[b]];
            int n = n_new[order[b]];
            CHECK(mrl_kv_cache_blocks_needed(c, d->id, n) <= mrl_kv_cache_num_free(c));
            CHECK_OK(mrl_kv_cache_append(c, d->id, n, slots + qs[b]));
            for (int64_t x = (int64_t)qs[b] * Hq * hd; x < (int64_t)(qs[b] + n) * Hq * hd; x++)
                q[x] = bf16 ? bf16_exact(frand()) : frand(); /* bf16: what the bf16 products round q to */
            for (int j = 0; j < n; j++)
                for (int x = 0; x < Hk * hd; x++) {
                    float kx = frand() * 2, vx = frand();
                    kn[(int64_t)(qs[b] + j) * Hk * hd + x] = kx;
                    vn[(int64_t)(qs[b] + j) * Hk * hd + x] = vx;
                    d->k[(int64_t)(d->len + j) * Hk * hd + x] = bf16 ? bf16_exact(kx) : kx; /* what the cache holds */
                    d->v[(int64_t)(d->len + j) * Hk * hd + x] = bf16 ? bf16_exact(vx) : vx;
                }
            d->len += n;
            lens[b] = d->len;
            qs[b + 1] = qs[b] + n;
            int nb = mrl_kv_cache_seq_blocks(c, d->id, NULL);
            if (nb > max_blocks) max_blocks = nb;
        }
        if (bf16) (round % 2 ? F : R)->paged_kv_write_bf16(kc, vc, kn, vn, slots, T, Hk, hd, bs);
        else (round % 2 ? F : R)->paged_kv_write(kc, vc, kn, vn, slots, T, Hk, hd, bs);
        int32_t *tables = calloc((size_t)n_seqs * (max_blocks ? max_blocks : 1), sizeof(int32_t));
        for (int b = 0; b < n_seqs; b++) {
            const int32_t *t;
            int nb = mrl_kv_cache_seq_blocks(c, s[order[b]].id, &t);
            memcpy(tables + (int64_t)b * max_blocks, t, sizeof(int32_t) * nb);
        }
        mrl_paged_attn a = {.out = out_ref, .q = q, .k_cache = kc, .v_cache = vc, .block_tables = tables,
                            .seq_lens = lens, .query_start = qs, .n_seqs = n_seqs, .max_blocks_per_seq = max_blocks,
                            .block_size = bs, .Hq = Hq, .Hk = Hk, .hd = hd, .scale = scale, .kv_bf16 = bf16};
        CHECK_OK(R->paged_attn(&a));
        a.out = out_fast;
        void *ws = NULL;
        if (round % 2) { /* the caller's workspace, exactly the size asked for */
            a.workspace_bytes = F->paged_attn_workspace(&a);
            CHECK(a.workspace_bytes > 0);
            a.workspace = ws = malloc((size_t)a.workspace_bytes);
        }
        CHECK_OK(F->paged_attn(&a));
        if (ws && a.workspace_bytes > 64) {
            a.workspace_bytes -= 64;
            CHECK(F->paged_attn(&a) == MRL_ERR_INVALID);
            CHECK_STR_CONTAINS(mrl_last_error(), "workspace");
        }
        free(ws);
        int rounded = mrl_cpu_paged_attn_takes_bf16_products(&a); /* the weights rounded to bf16 */
        float *out_exact = NULL;
        if (rounded) { /* the same cache through the fp32 loops: exact attention again */
            bf16_product_rounds++;
            out_exact = calloc((size_t)(T ? T : 1) * Hq * hd, sizeof(float));
            a.out = out_exact, a.workspace = NULL, a.workspace_bytes = 0;
            mrl_cpu_paged_attn_bf16_products(0);
            CHECK(!mrl_cpu_paged_attn_takes_bf16_products(&a));
            CHECK_OK(F->paged_attn(&a));
            mrl_cpu_paged_attn_bf16_products(1);
        }
        float *out_round = calloc((size_t)(T ? T : 1) * Hq * hd, sizeof(float));
        float *none = calloc((size_t)(T ? T : 1) * Hq * hd, sizeof(float)), *slack = calloc((size_t)(T ? T : 1) * Hq * hd, sizeof(float));
        for (int b = 0; b < n_seqs; b++) {
            seq_data *d = &s[order[b]];
            int n = qs[b + 1] - qs[b];
            int64_t at = (int64_t)qs[b] * Hq * hd;
            contiguous_attention(out_cont + at, none + at, q + at, d->k, d->v, d->len, n, Hq, Hk, hd, scale, 0);
            if (rounded)
                contiguous_attention(out_round + at, slack + at, q + at, d->k, d->v, d->len, n, Hq, Hk, hd, scale, 1);
        }
        /* error relative to the row's scale: max |diff| / max |expected| per
         * (token, head) row of hd values */
        double err_ref = row_error(out_ref, out_cont, none, (int64_t)T * Hq, hd);
        double err_fast = rounded ? row_error(out_fast, out_round, slack, (int64_t)T * Hq, hd)
                                  : row_error(out_fast, out_cont, none, (int64_t)T * Hq, hd);
        double err_exact = rounded ? row_error(out_exact, out_cont, none, (int64_t)T * Hq, hd) : 0;
        CHECK(err_ref < 1e-6);
        CHECK(err_fast < 2e-6);
        CHECK(err_exact < 2e-6);
        if (getenv("VERBOSE") || err_fast >= 2e-6 || err_ref >= 1e-6 || err_exact >= 2e-6)
            fprintf(stderr, "Hq=%d Hk=%d hd=%d bs=%d%s round %d: rel err ref %.3g fast %.3g%s (fp32 products %.3g)\n",
                    Hq, Hk, hd, bs, bf16 ? " bf16" : "", round, err_ref, err_fast,
                    rounded ? " against bf16 weights" : "", err_exact);
        free(out_exact); free(out_round); free(none); free(slack);
        free(q); free(kn); free(vn); free(out_ref); free(out_fast); free(out_cont); free(tables);
    }
    mrl_kv_cache_stats st;
    mrl_kv_cache_get_stats(c, &st);
    total_cow += st.cow_copies;
    for (int i = 0; i < n_seqs; i++) {
        CHECK_OK(mrl_kv_cache_seq_free(c, s[i].id));
        free(s[i].k);
        free(s[i].v);
    }
    mrl_kv_cache_get_stats(c, &st);
    CHECK(st.free_blocks == st.num_blocks);
    mrl_kv_cache_destroy(c);
}

int main(void) {
    printf("paged attention path: %s\n", mrl_kernels_cpu_fast_isa());
    for (int bf16 = 0; bf16 < 2; bf16++) {
        run_case(4, 2, 16, 4, 8, bf16);   /* GQA 2:1, tiny blocks */
        run_case(8, 2, 64, 16, 8, bf16);  /* GQA 4:1, vLLM's block size */
        run_case(14, 2, 64, 16, 4, bf16); /* GQA 7:1 (Qwen2.5-0.5B): head runs of 4 + 2 + 1 */
        run_case(9, 3, 64, 16, 6, bf16);  /* SmolLM2's 3:1 */
        run_case(3, 3, 24, 5, 6, bf16);   /* MHA, odd sizes (masked tails) */
        run_case(2, 1, 128, 7, 6, bf16);  /* one kv head, hd 128 */
        run_case(16, 1, 8, 32, 4, bf16);  /* 16 heads per kv head, blocks of 32 */
        run_case(16, 2, 128, 16, 4, bf16); /* 8 heads per kv head, hd 128 */
    }
    mrl_parallel_set_threads(1);
    run_case(4, 1, 40, 3, 4, 0);   /* single thread */
    run_case(6, 2, 32, 16, 4, 1);
    CHECK(total_cow > 0);        /* forks were appended to: shared partial blocks copied */
    if (mrl_cpu_has_avx512_bf16()) CHECK(bf16_product_rounds > 0); /* the bf16 products were reached */
    printf("rounds with bf16 products: %lld\n", (long long)bf16_product_rounds);
    CHECK_DONE();
}
