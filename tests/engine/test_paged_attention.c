/* Paged attention over a real KV cache: the K/V written by the op table's
 * paged_kv_write into the slots mrl_kv_cache_append gives, then paged_attn
 * (reference and fast tables) against a straightforward contiguous causal
 * attention, on random data: several sequences grown in interleaved steps
 * (so their blocks interleave), forks that share a parent's blocks (full
 * and partial, copy-on-write), mixed prefill chunks and single-token
 * decodes, GQA. (Each op of every table against the reference, at every
 * instruction set, and the shape errors: tests/kernels/test_ops.c.) */
#include <stdlib.h>
#include "check.h"
#include "moonrl/status.h"
#include "moonrl/parallel.h"
#include "engine/kv_cache.h"
#include "kernels.h"

static uint64_t rng = 88172645463325252ULL;
static uint64_t next_u64(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static float randf(void) { return (float)((next_u64() >> 40) * (1.0 / 16777216.0) * 2 - 1); }
static int randi(int n) { return (int)(next_u64() % (uint64_t)n); }

#define MAXS 8
#define MAXLEN 300 /* > KEY_TILE: V accumulated over several key tiles */

typedef struct seq_data {
    int id;            /* kv cache sequence */
    int len;
    float *k, *v;      /* contiguous [MAXLEN, Hk, hd] */
} seq_data;

/* Straightforward causal attention of the last n_q tokens of a contiguous sequence. */
static void contiguous_attention(float *out, const float *q, const float *k, const float *v, int len, int n_q,
                                 int Hq, int Hk, int hd, float scale) {
    int G = Hq / Hk;
    double *p = malloc(sizeof(double) * len);
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
            for (int d = 0; d < hd; d++) {
                double acc = 0;
                for (int c = 0; c <= pos; c++) acc += p[c] * v[((int64_t)c * Hk + h / G) * hd + d];
                out[((int64_t)j * Hq + h) * hd + d] = (float)(acc / sum);
            }
        }
    }
    free(p);
}

static int64_t total_cow = 0; /* copy-on-write copies seen, all cases */

static void run_case(int Hq, int Hk, int hd, int bs, int n_rounds) {
    const mrl_kernels *R = mrl_kernels_cpu_reference(), *F = mrl_kernels_cpu_fast();
    mrl_kv_cache_config cfg = {.n_layers = 2, .n_kv_heads = Hk, .head_dim = hd, .block_size = bs,
                               .budget_bytes = (int64_t)4 * MAXS * (MAXLEN / bs + 2) * Hk * bs * hd * 2 * 2 * 4};
    mrl_kv_cache *c;
    CHECK_OK(mrl_kv_cache_create(&cfg, &c));
    if (!c) return;
    int layer = 1;
    float *kc = mrl_kv_cache_k(c, layer), *vc = mrl_kv_cache_v(c, layer);
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
            for (int64_t x = (int64_t)qs[b] * Hq * hd; x < (int64_t)(qs[b] + n) * Hq * hd; x++) q[x] = randf();
            for (int j = 0; j < n; j++)
                for (int x = 0; x < Hk * hd; x++) {
                    float kx = randf() * 2, vx = randf();
                    kn[(int64_t)(qs[b] + j) * Hk * hd + x] = kx;
                    vn[(int64_t)(qs[b] + j) * Hk * hd + x] = vx;
                    d->k[(int64_t)(d->len + j) * Hk * hd + x] = kx;
                    d->v[(int64_t)(d->len + j) * Hk * hd + x] = vx;
                }
            d->len += n;
            lens[b] = d->len;
            qs[b + 1] = qs[b] + n;
            int nb = mrl_kv_cache_seq_blocks(c, d->id, NULL);
            if (nb > max_blocks) max_blocks = nb;
        }
        (round % 2 ? F : R)->paged_kv_write(kc, vc, kn, vn, slots, T, Hk, hd, bs);
        int32_t *tables = calloc((size_t)n_seqs * (max_blocks ? max_blocks : 1), sizeof(int32_t));
        for (int b = 0; b < n_seqs; b++) {
            const int32_t *t;
            int nb = mrl_kv_cache_seq_blocks(c, s[order[b]].id, &t);
            memcpy(tables + (int64_t)b * max_blocks, t, sizeof(int32_t) * nb);
        }
        mrl_paged_attn a = {.out = out_ref, .q = q, .k_cache = kc, .v_cache = vc, .block_tables = tables,
                            .seq_lens = lens, .query_start = qs, .n_seqs = n_seqs, .max_blocks_per_seq = max_blocks,
                            .block_size = bs, .Hq = Hq, .Hk = Hk, .hd = hd, .scale = scale};
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
        for (int b = 0; b < n_seqs; b++) {
            seq_data *d = &s[order[b]];
            int n = qs[b + 1] - qs[b];
            contiguous_attention(out_cont + (int64_t)qs[b] * Hq * hd, q + (int64_t)qs[b] * Hq * hd, d->k, d->v,
                                 d->len, n, Hq, Hk, hd, scale);
        }
        /* error relative to the row's scale: max |diff| / max |expected| per
         * (token, head) row of hd values */
        double err_ref = 0, err_fast = 0;
        for (int64_t row = 0; row < (int64_t)T * Hq; row++) {
            double mx = 1e-30, d1 = 0, d2 = 0;
            for (int64_t x = row * hd; x < (row + 1) * hd; x++) {
                if (fabs(out_cont[x]) > mx) mx = fabs(out_cont[x]);
                if (fabs(out_ref[x] - out_cont[x]) > d1) d1 = fabs(out_ref[x] - out_cont[x]);
                if (fabs(out_fast[x] - out_cont[x]) > d2) d2 = fabs(out_fast[x] - out_cont[x]);
            }
            if (d1 / mx > err_ref) err_ref = d1 / mx;
            if (d2 / mx > err_fast) err_fast = d2 / mx;
        }
        CHECK(err_ref < 1e-6);
        CHECK(err_fast < 2e-6);
        if (getenv("VERBOSE") || err_fast >= 2e-6 || err_ref >= 1e-6)
            fprintf(stderr, "Hq=%d Hk=%d hd=%d bs=%d round %d: rel err ref %.3g fast %.3g\n", Hq, Hk, hd, bs, round,
                    err_ref, err_fast);
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
    run_case(4, 2, 16, 4, 8);   /* GQA 2:1, tiny blocks */
    run_case(8, 2, 64, 16, 8);  /* GQA 4:1, vLLM's block size */
    run_case(14, 2, 64, 16, 4); /* GQA 7:1 (Qwen2.5-0.5B): head runs of 4 + 2 + 1 */
    run_case(3, 3, 24, 5, 6);   /* MHA, odd sizes (masked tails) */
    run_case(2, 1, 128, 7, 6);  /* one kv head, hd 128 */
    run_case(16, 1, 8, 32, 4);  /* 16 heads per kv head, blocks of 32 */
    mrl_parallel_set_threads(1);
    run_case(4, 1, 40, 3, 4);   /* single thread */
    CHECK(total_cow > 0);        /* forks were appended to: shared partial blocks copied */
    CHECK_DONE();
}
