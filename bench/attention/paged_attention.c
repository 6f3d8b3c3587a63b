/* Decode attention: paged KV cache vs a contiguous KV cache, in one process.
 *
 *   contiguous  the baseline: each sequence's K/V in one piece, [Hk, len, hd]
 *               (a Hugging Face cache), attended by a straightforward
 *               vectorised kernel (AVX-512 dot product per key and query
 *               head, softmax, AXPY of V rows), parallel over (sequence, kv
 *               head) with the same mrl_parallel_for;
 *   paged       the fast table's paged_attn, block_size 16, the sequences' blocks
 *               scattered over the pool in a random order (what a
 *               long-running engine looks like);
 *   paged bf16  the same, over a bf16 copy of the cache (kv_bf16: half the
 *               bytes; what the engine's kv_cache_dtype auto gives a bf16 model);
 *   reference   the plain paged reference (double, scalar), for scale.
 * Each step is one decode token per sequence (Hq query heads, GQA).
 * Prints tokens/s (one attention layer, one token per sequence per step)
 * and the paged / contiguous speed ratio. Needs AVX-512 (the baseline).
 * usage: bench_paged_attention [iterations] [shape name filter] [repetitions, 3; more skips the reference] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>
#include "base/parallel.h"
#include "kernels.h"
#include "cpu/paged_attention.h"
#include "moonrl/dtype.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- the contiguous baseline ---- */

typedef struct contig {
    const float *q, *k, *v; /* q [n, Hq, hd]; k, v [n, Hk, len, hd] */
    float *out;
    int n, len, Hq, Hk, hd;
    float scale;
} contig;

__attribute__((target("avx512f"))) static float dot512(const float *a, const float *b, int n) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f"))) static void contig_range(void *vctx, int64_t b, int64_t e) {
    const contig *c = vctx;
    int G = c->Hq / c->Hk, hd = c->hd;
    float *p = malloc(sizeof(float) * c->len);
    for (int64_t it = b; it < e; it++) {
        int i = (int)(it / c->Hk), g = (int)(it % c->Hk);
        const float *k = c->k + ((int64_t)i * c->Hk + g) * c->len * hd, *v = c->v + ((int64_t)i * c->Hk + g) * c->len * hd;
        for (int r = 0; r < G; r++) {
            const float *q = c->q + ((int64_t)i * c->Hq + g * G + r) * hd;
            float *o = c->out + ((int64_t)i * c->Hq + g * G + r) * hd, m = -INFINITY, sum = 0;
            for (int j = 0; j < c->len; j++) {
                p[j] = dot512(q, k + (int64_t)j * hd, hd) * c->scale;
                m = p[j] > m ? p[j] : m;
            }
            for (int j = 0; j < c->len; j++) sum += (p[j] = expf(p[j] - m));
            for (int d = 0; d < hd; d += 16) {
                __m512 acc = _mm512_setzero_ps();
                for (int j = 0; j < c->len; j++)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(v + (int64_t)j * hd + d), acc);
                _mm512_storeu_ps(o + d, _mm512_mul_ps(acc, _mm512_set1_ps(1.0f / sum)));
            }
        }
    }
    free(p);
}

static void contig_attention(const contig *c) { mrl_parallel_for((int64_t)c->n * c->Hk, 1, contig_range, (void *)c); }

static int reps = 3; /* timed repetitions of each measurement (the best is kept): argv[3] */

static double time_contig(const contig *c, int iters, int layers, int64_t stride) {
    double best = 1e30;
    contig l = *c;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = now();
        for (int i = 0; i < iters * layers; i++) {
            l.k = c->k + (i % layers) * stride;
            l.v = c->v + (i % layers) * stride;
            contig_attention(&l);
        }
        double dt = (now() - t0) / (iters * layers);
        if (dt < best) best = dt;
    }
    return best;
}

static uint64_t rng = 0x1234567;
static uint32_t next(void) {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng >> 33);
}

/* layers: how many copies of the cache a step goes through, one call per
 * layer as a decode step does; enough of them that the K/V come from memory
 * and not from the last level cache, as in an engine (1: the same cache each
 * call, in cache when it fits). */
typedef struct shape {
    const char *name;
    int n_seqs, ctx, Hq, Hk, hd, layers;
} shape;

/* Seconds per call, best of `reps`; call i reads layer i % layers (its caches
 * `stride` elements after the previous layer's). */
static double time_it(const mrl_paged_attn *a, int iters, int reference, int layers, int64_t stride) {
    double best = 1e30;
    mrl_paged_attn l = *a;
    int bytes = a->kv_bf16 ? 2 : 4;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = now();
        for (int i = 0; i < iters * layers; i++) {
            l.k_cache = (const char *)a->k_cache + (i % layers) * stride * bytes;
            l.v_cache = (const char *)a->v_cache + (i % layers) * stride * bytes;
            (reference ? mrl_kernels_cpu_reference() : mrl_kernels_cpu_fast())->paged_attn(&l);
        }
        double dt = (now() - t0) / (iters * layers);
        if (dt < best) best = dt;
    }
    return best;
}

/* n elements of a copied to each of the layers - 1 slots after it. */
static void *replicate(void *a, int64_t n, size_t elem, int layers) {
    char *b = malloc(n * elem * layers);
    for (int l = 0; l < layers; l++) memcpy(b + l * n * elem, a, n * elem);
    free(a);
    return b;
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
    /* contiguous: the same keys and values, [n, Hk, len, hd] */
    float *kcont = malloc(sizeof(float) * cache_floats), *vcont = malloc(sizeof(float) * cache_floats);
    float *out2 = malloc(sizeof(float) * s.n_seqs * s.Hq * s.hd);
    for (int i = 0; i < s.n_seqs; i++)
        for (int g = 0; g < s.Hk; g++)
            for (int j = 0; j < s.ctx; j++)
                for (int d = 0; d < s.hd; d++) {
                    int64_t blk = perm[(int64_t)i * bps + j / bs], off = j % bs;
                    int64_t src = (blk * s.Hk + g) * bs * s.hd;
                    int64_t dst = (((int64_t)i * s.Hk + g) * s.ctx + j) * s.hd + d;
                    kcont[dst] = kc[src + (int64_t)d * bs + off];
                    vcont[dst] = vc[src + off * s.hd + d];
                }
    contig cont = {q, kcont, vcont, out2, s.n_seqs, s.ctx, s.Hq, s.Hk, s.hd, paged.scale};
    mrl_kernels_cpu_fast()->paged_attn(&paged); /* warm up, and the two must agree */
    contig_attention(&cont);
    double maxdiff = 0;
    for (int64_t i = 0; i < (int64_t)s.n_seqs * s.Hq * s.hd; i++)
        maxdiff = fmax(maxdiff, fabs(out[i] - out2[i]));
    double t_ref = reps > 3 ? NAN : time_it(&paged, iters / 10 > 0 ? iters / 10 : 1, 1, 1, 0); /* slow: not repeated */
    uint16_t *kc16 = malloc(sizeof(uint16_t) * cache_floats), *vc16 = malloc(sizeof(uint16_t) * cache_floats);
    for (int64_t i = 0; i < cache_floats; i++) {
        kc16[i] = mrl_f32_to_bf16(kc[i]);
        vc16[i] = mrl_f32_to_bf16(vc[i]);
    }
    /* every layer's copy of the caches, then the timings */
    paged.k_cache = kc = replicate(kc, cache_floats, sizeof(float), s.layers);
    paged.v_cache = vc = replicate(vc, cache_floats, sizeof(float), s.layers);
    cont.k = kcont = replicate(kcont, cache_floats, sizeof(float), s.layers);
    cont.v = vcont = replicate(vcont, cache_floats, sizeof(float), s.layers);
    mrl_paged_attn paged16 = paged;
    paged16.k_cache = kc16 = replicate(kc16, cache_floats, sizeof(uint16_t), s.layers);
    paged16.v_cache = vc16 = replicate(vc16, cache_floats, sizeof(uint16_t), s.layers);
    paged16.kv_bf16 = 1;
    double t_cont = time_contig(&cont, iters, s.layers, cache_floats);
    double t_paged = time_it(&paged, iters, 0, s.layers, cache_floats);
    double t_paged16 = time_it(&paged16, iters, 0, s.layers, cache_floats);
    mrl_cpu_paged_attn_bf16_products(0); /* the same cache through the fp32 loops (widened K/V) */
    double t_paged16_f32 = time_it(&paged16, iters, 0, s.layers, cache_floats);
    mrl_cpu_paged_attn_bf16_products(1);
    double kv_bytes = 2.0 * s.n_seqs * s.ctx * s.Hk * s.hd * sizeof(float);
    printf("%-26s %2d layers  contiguous %7.0f tok/s (%5.1f GB/s)  paged %7.0f tok/s (%5.1f GB/s)  paged/contiguous %.2fx  "
           "paged bf16 %7.0f tok/s (%5.1f GB/s)  bf16 cache, fp32 products %7.0f tok/s  reference %5.0f tok/s  "
           "(max |paged - contiguous| %.1e)\n",
           s.name, s.layers, s.n_seqs / t_cont, kv_bytes / t_cont * 1e-9, s.n_seqs / t_paged, kv_bytes / t_paged * 1e-9,
           t_cont / t_paged, s.n_seqs / t_paged16, kv_bytes / 2 / t_paged16 * 1e-9, s.n_seqs / t_paged16_f32, s.n_seqs / t_ref, maxdiff);
    free(kc16); free(vc16);
    free(kc); free(vc); free(q); free(out); free(out2); free(lens); free(qs); free(perm); free(kcont); free(vcont);
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 20;
    if (argc > 3 && atoi(argv[3]) > 0) reps = atoi(argv[3]);
    if (iters < 1) iters = 1;
    if (!__builtin_cpu_supports("avx512f")) {
        printf("the contiguous baseline needs AVX-512\n");
        return 0;
    }
    printf("isa %s, %d threads, %d iterations (best of %d)\n", mrl_kernels_cpu_fast_isa(), mrl_parallel_threads(), iters,
           reps);
    shape shapes[] = {
        {"smollm2-135m b64 ctx256", 64, 256, 9, 3, 64, 30},
        {"smollm2-135m b64 ctx256 in-cache", 64, 256, 9, 3, 64, 1},
        {"100m b64 ctx256", 64, 256, 12, 4, 64, 8},
        {"qwen2.5-0.5b b16 ctx512", 16, 512, 14, 2, 64, 1},
        {"qwen2.5-0.5b b64 ctx1024", 64, 1024, 14, 2, 64, 1},
        {"llama-8b-ish b16 ctx2048", 16, 2048, 32, 8, 128, 1},
        {"qwen3-1.7b b32 ctx4096", 32, 4096, 16, 8, 128, 1},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (argc <= 2 || strstr(shapes[i].name, argv[2])) run(shapes[i], iters);
    return 0;
}
