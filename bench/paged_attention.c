/* Decode attention: paged KV cache vs a contiguous KV cache, in one process.
 *
 *   contiguous  each sequence's K/V in one piece, [Hk, len, hd] (the layout
 *               of a Hugging Face cache), run by the same fast kernel with one
 *               block per sequence: the cost without paging;
 *   paged       block_size 16, the sequences' blocks scattered over the pool
 *               in a random order (what a long-running engine looks like);
 *   reference   the plain paged reference (double, scalar), for scale.
 * Each step is one decode token per sequence (Hq query heads, GQA).
 * Prints tokens/s and the paged / contiguous ratio.
 * usage: bench_paged_attention [iterations] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "moonrl/parallel.h"
#include "cpu/paged_attention.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rng = 0x1234567;
static uint32_t next(void) {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng >> 33);
}

typedef struct shape {
    const char *name;
    int n_seqs, ctx, Hq, Hk, hd;
} shape;

static double time_it(const mrl_paged_attn *a, int iters, int reference) {
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now();
        for (int i = 0; i < iters; i++) {
            if (reference) mrl_paged_attention_ref(a);
            else mrl_paged_attention(a);
        }
        double dt = (now() - t0) / iters;
        if (dt < best) best = dt;
    }
    return best;
}

static void run(shape s, int iters) {
    int bs = 16, bps = (s.ctx + bs - 1) / bs, nb = s.n_seqs * bps;
    int64_t block_floats = (int64_t)s.Hk * bs * s.hd;
    int64_t cache_floats = (int64_t)nb * block_floats;
    float *kc = malloc(sizeof(float) * cache_floats), *vc = malloc(sizeof(float) * cache_floats);
    float *q = malloc(sizeof(float) * s.n_seqs * s.Hq * s.hd), *out = malloc(sizeof(float) * s.n_seqs * s.Hq * s.hd);
    for (int64_t i = 0; i < cache_floats; i++) {
        kc[i] = (float)(next() % 2001) / 1000.0f - 1.0f;
        vc[i] = (float)(next() % 2001) / 1000.0f - 1.0f;
    }
    for (int64_t i = 0; i < (int64_t)s.n_seqs * s.Hq * s.hd; i++) q[i] = (float)(next() % 2001) / 1000.0f - 1.0f;
    int32_t *lens = malloc(sizeof(int32_t) * s.n_seqs), *qs = malloc(sizeof(int32_t) * (s.n_seqs + 1));
    for (int i = 0; i < s.n_seqs; i++) {
        lens[i] = s.ctx;
        qs[i] = i;
    }
    qs[s.n_seqs] = s.n_seqs;
    /* paged: a random permutation of the blocks */
    int32_t *perm = malloc(sizeof(int32_t) * nb);
    for (int i = 0; i < nb; i++) perm[i] = i;
    for (int i = nb - 1; i > 0; i--) {
        int j = (int)(next() % (uint32_t)(i + 1)), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    mrl_paged_attn paged = {.out = out, .q = q, .k_cache = kc, .v_cache = vc, .block_tables = perm, .seq_lens = lens,
                            .query_start = qs, .n_seqs = s.n_seqs, .max_blocks_per_seq = bps, .block_size = bs,
                            .Hq = s.Hq, .Hk = s.Hk, .hd = s.hd, .scale = 1.0f / sqrtf((float)s.hd)};
    /* contiguous: one block of bps*16 tokens per sequence, [Hk, len, hd] */
    int32_t *ident = malloc(sizeof(int32_t) * s.n_seqs);
    for (int i = 0; i < s.n_seqs; i++) ident[i] = i;
    mrl_paged_attn cont = paged;
    cont.block_tables = ident;
    cont.max_blocks_per_seq = 1;
    cont.block_size = bps * bs;
    mrl_paged_attention(&paged); /* warm up */
    mrl_paged_attention(&cont);
    double t_cont = time_it(&cont, iters, 0), t_paged = time_it(&paged, iters, 0);
    double t_ref = time_it(&paged, iters / 10 > 0 ? iters / 10 : 1, 1);
    double kv_bytes = 2.0 * s.n_seqs * s.ctx * s.Hk * s.hd * sizeof(float);
    printf("%-28s contiguous %9.0f tok/s (%5.1f GB/s)  paged %9.0f tok/s (%5.1f GB/s)  paged/contiguous %.2f  "
           "reference %7.0f tok/s  fast/reference %.1fx\n",
           s.name, s.n_seqs / t_cont, kv_bytes / t_cont * 1e-9, s.n_seqs / t_paged, kv_bytes / t_paged * 1e-9,
           t_cont / t_paged, s.n_seqs / t_ref, t_ref / t_paged);
    free(kc); free(vc); free(q); free(out); free(lens); free(qs); free(perm); free(ident);
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 20;
    if (iters < 1) iters = 1;
    printf("isa %s, %d threads, %d iterations (best of 3)\n", mrl_paged_attention_isa(), mrl_parallel_threads(), iters);
    shape shapes[] = {
        {"qwen2.5-0.5b b16 ctx512", 16, 512, 14, 2, 64},
        {"qwen2.5-0.5b b64 ctx1024", 64, 1024, 14, 2, 64},
        {"llama-8b-ish b16 ctx2048", 16, 2048, 32, 8, 128},
        {"qwen3-1.7b b32 ctx4096", 32, 4096, 16, 8, 128},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) run(shapes[i], iters);
    return 0;
}
