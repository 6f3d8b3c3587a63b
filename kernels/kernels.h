/* The op table: one struct of function pointers per backend, and the one
 * door into every kernel: the model, the engine (paged attention, sampling),
 * the optimizer and the dtype conversions call ops only through it, so a
 * backend is a new table. CPU reference (plain loops, trusted by tests), CPU
 * fast (OpenBLAS + the AVX-512 / AVX2 / SSE loops chosen at run time,
 * kernels/cpu/isa.h) and CUDA (kernels/cuda, on device memory: the
 * memory slots below say where a table's arrays live and move them).
 * tests/kernels/test_ops.c runs every op of every table (the CPU's, and
 * CUDA's where there is a GPU) against the reference. Internal to the
 * core (not part of the FFI).
 *
 * Row-major everywhere. T = tokens, D = row width. Functions whose name
 * ends in _bwd ACCUMULATE (+=) into parameter gradients; what they do to
 * input gradients is said per op. */
#pragma once
#include <stdint.h>
#include "moonrl/sampling.h" /* mrl_sampling_params */
#include "moonrl/status.h"

/* Weight panels: W [N,K] (row-major, a linear layer's weight) laid out again
 * as ceil(N/32) panels of [K][32], columns past N zero. A product of few rows
 * with W then streams each panel once, contiguously, with nothing to pack per
 * call (OpenBLAS packs all of W on every call, which costs as much as the
 * arithmetic at decode batch sizes). The engine keeps its weights so. */
#define MRL_PANEL 32
static inline int64_t mrl_panels_floats(int64_t N, int64_t K) {
    return (N + MRL_PANEL - 1) / MRL_PANEL * MRL_PANEL * K;
}
/* Panel b of W into P (the table's panels_pack op does every panel). */
static inline void mrl_panel_pack(float *P, const float *W, int64_t N, int64_t K, int64_t b) {
    float *dst = P + b * MRL_PANEL * K;
    for (int j = 0; j < MRL_PANEL; j++) { /* W's rows read in order; the panel stays in cache */
        int64_t n = b * MRL_PANEL + j;
        for (int64_t k = 0; k < K; k++) dst[k * MRL_PANEL + j] = n < N ? W[n * K + k] : 0.0f;
    }
}

/* bf16 weight panels (a model in bf16; the engine's): W [N,K] as bf16 pairs
 * along K, ceil(N/48) panels of [ceil(K/2)][48] dwords, dword (kp, j) of
 * panel b = (W[48b+j][2kp], W[48b+j][2kp+1]) (low half first), columns past
 * N and k past K zero: the packed B of the bf16 kernel's micro-tile
 * (kernels/cpu/gemm_bf16_avx512.c) over all of K. Half the bytes of the
 * fp32 panels, read once per product. */
#define MRL_PANEL16 48
static inline int64_t mrl_panels16_dwords(int64_t N, int64_t K) {
    return (N + MRL_PANEL16 - 1) / MRL_PANEL16 * MRL_PANEL16 * ((K + 1) / 2);
}
/* Panel b of W (bf16 [N,K]) into P (the table's panels16_pack op does every panel). */
static inline void mrl_panel16_pack(uint32_t *P, const uint16_t *W, int64_t N, int64_t K, int64_t b) {
    int64_t Kp = (K + 1) / 2;
    uint32_t *dst = P + b * MRL_PANEL16 * Kp;
    for (int j = 0; j < MRL_PANEL16; j++) {
        int64_t n = b * MRL_PANEL16 + j;
        for (int64_t kp = 0; kp < Kp; kp++) {
            uint32_t lo = n < N ? W[n * K + 2 * kp] : 0, hi = n < N && 2 * kp + 1 < K ? W[n * K + 2 * kp + 1] : 0;
            dst[kp * MRL_PANEL16 + j] = lo | hi << 16;
        }
    }
}
/* Element (n, k) of W from its bf16 panels. */
static inline uint16_t mrl_panel16_at(const uint32_t *P, int64_t K, int64_t n, int64_t k) {
    int64_t Kp = (K + 1) / 2;
    uint32_t d = P[n / MRL_PANEL16 * MRL_PANEL16 * Kp + k / 2 * MRL_PANEL16 + n % MRL_PANEL16];
    return (uint16_t)(k % 2 ? d >> 16 : d);
}

/* One matrix product C = alpha op(A) op(B) + beta C (see gemm below).
 * b_panels: B is W [N,K] packed by panels_pack (op(B) = W^T; trans_a
 * must be 0 and trans_b 1; ldb is ignored). */
/* One product of gemm_bf16_panels_group: C[M,N] = alpha * bf16(A) W^T +
 * beta * C, W [N,K] as bf16 weight panels P and, optionally, its plain bf16
 * copy W16 (ldw; NULL: none), as gemm_bf16_panels takes them. */
typedef struct mrl_panels_part {
    int64_t N;
    const uint32_t *P;
    const uint16_t *W16;
    int64_t ldw;
    float alpha, beta;
    float *C;
    int64_t ldc;
} mrl_panels_part;

typedef struct mrl_gemm_desc {
    int trans_a, trans_b;
    int64_t M, N, K;
    float alpha;
    const float *A;
    int64_t lda;
    const float *B;
    int64_t ldb;
    float beta;
    float *C;
    int64_t ldc;
    int b_panels;
    int b_quant; /* B is W [N,K] as GGML blocks of this type (qgemm's; trans_b, ldb = K), else 0 */
} mrl_gemm_desc;

/* Paged attention: attention of a batch of new query tokens (prefill
 * chunks and single-token decodes mixed) over each sequence's K/V held in
 * the blocks of a paged cache (kernels/cpu/paged_attention.h has the cache
 * layout and the batch's meaning). */
typedef struct mrl_paged_attn {
    float *out;                  /* [T, Hq, hd] */
    const float *q;              /* [T, Hq, hd] */
    const void *k_cache;         /* one layer: [num_blocks, Hk, hd, block_size] */
    const void *v_cache;         /* one layer: [num_blocks, Hk, block_size, hd] (fp32, or kv_bf16 below) */
    const int32_t *block_tables; /* [n_seqs, max_blocks_per_seq] */
    const int32_t *seq_lens;     /* [n_seqs] */
    const int32_t *query_start;  /* [n_seqs + 1], query_start[0] = 0 */
    int n_seqs;
    int max_blocks_per_seq;
    int block_size;
    int Hq, Hk, hd;
    float scale;
    /* optional scratch (the caller's activation memory, so nothing is
     * allocated per call): at least paged_attn_workspace(this) bytes,
     * 64-byte aligned; NULL: the kernel allocates and frees its own. */
    void *workspace;
    int64_t workspace_bytes;
    /* mla_paged_attn's: the values a head's output holds, each key row's first hv (0: hd) */
    int hv;
    /* 0: the cache holds fp32; 1: bf16 (uint16_t), the same layout, and the
     * two products may take bf16 operands as the bf16 model's others do (q
     * and the softmax weights rounded to bf16, fp32 sums: the CPU's
     * AVX512-BF16 path) or read the cache widened, exactly (elsewhere) */
    int kv_bf16;
} mrl_paged_attn;

/* fp32 coefficients of one AdamW step, rounded as PyTorch rounds its
 * scalars (core/optim/adamw.c fills them). */
typedef struct mrl_adamw_coeffs {
    float decay;      /* 1 - lr * wd (1 for no-decay) */
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
    float bc2_sqrt;   /* sqrt(1 - beta2^t) */
    float eps;
    float neg_step;   /* -lr / (1 - beta1^t) */
} mrl_adamw_coeffs;

/* One AdamW step over n parameters: elements inside the no-decay ranges
 * use `no_decay`, the others `decay`. */
typedef struct mrl_adamw_args {
    float *p, *m, *v;
    const float *g;
    int64_t n;
    mrl_adamw_coeffs decay, no_decay;
    const int64_t *ranges; /* the no-decay ranges, merged, sorted, non-empty: begin0, end0, begin1, end1, ... */
    int64_t n_ranges;
} mrl_adamw_args;

typedef struct mrl_kernels {
    const char *name;

    /* ---- the table's memory ----
     * on_device 0: every array an op takes is host memory (the CPU tables);
     * 1: device memory the host cannot read (CUDA: allocated on the device,
     * mrl_buffer_alloc; the exceptions are listed in kernels/cuda/cuda_backend.h).
     * The four slots below work on either: copy and zero within the table's
     * memory (ordered with the ops), to_device from host memory (the host
     * array may be reused when it returns), to_host into host memory once
     * every op before it is done (copy's dst and src must not overlap).
     * sync waits for every op launched and returns the first failure of a
     * slot that returns nothing (bad shapes, a launch or library error)
     * since the last sync, clearing it: the model ends each forward and
     * backward with it. The CPU tables have nothing pending: MRL_OK. */
    int on_device;
    void (*copy)(void *dst, const void *src, int64_t bytes);
    void (*zero)(void *dst, int64_t bytes);
    mrl_status (*to_device)(void *dst, const void *host_src, int64_t bytes);
    mrl_status (*to_host)(void *host_dst, const void *src, int64_t bytes);
    mrl_status (*sync)(void);
    /* dst[r, 0..cols) = src[r, 0..cols) for r < rows, rows ldd and lds floats apart (a part of
     * each row of a matrix: MLA's latent and rope key, its heads' values without padding). */
    void (*copy_rows)(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols);

    /* C[M,N] = alpha * op(A) op(B) + beta * C, op(X) = X or X^T
     * (trans_a: A is stored [K,M]; trans_b: B is stored [N,K]). */
    void (*gemm)(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                 int64_t ldc);

    /* n independent products at once (one parallel region); no output may
     * overlap another product's output or inputs. */
    void (*gemm_group)(const mrl_gemm_desc *g, int n);
    /* C[M,N] = alpha * A W^T + beta * C (beta 0: C is not read), A fp32 [M,K] (lda), W [N,K] read
     * from its GGML blocks of `type` (dequant's), K a multiple of 32: an engine step's products
     * over a quantized base, reading its blocks instead of a dequantized copy (few rows: decode). */
    void (*qgemm)(int type, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                  const void *W, float beta, float *C, int64_t ldc);

    /* The same product in bf16 with fp32 accumulation (the mixed precision
     * of docs/architecture.md, "Precision"; kernels/cpu/gemm_bf16.h): each of A and B is
     * fp32, rounded to bf16 on the way in (x_bf16 = 0), or bf16 already
     * (x_bf16 = 1: uint16_t storage, leading dimension in elements). beta = 0
     * ignores what C held. Parallel inside (not for use in gemm_group). */
    void (*gemm_bf16)(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                      int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C,
                      int64_t ldc);
    /* C[M,N] = alpha * bf16(A) W^T + beta * C with fp32 accumulation, A fp32
     * [M,K] (lda) rounded on the way in, W [N,K] given as bf16 weight panels
     * P (above, MRL_PANEL16) and, optionally (W16 NULL: not), as its plain
     * bf16 copy W16 (ldw), the same values: the table reads whichever is
     * faster for the shape (the engine's products in bf16). */
    void (*gemm_bf16_panels)(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                             const uint32_t *P, const uint16_t *W16, int64_t ldw, float beta, float *C, int64_t ldc);
    /* n (1..8) such products of one A [M,K] (the engine's q, k, v; gate, up),
     * each C as gemm_bf16_panels gives it: the table may pack A once and run
     * them in one parallel region. No C may overlap A or another C. */
    void (*gemm_bf16_panels_group)(int64_t M, int64_t K, const float *A, int64_t lda, const mrl_panels_part *w,
                                   int n);

    /* out[t] = x[t] * rstd[t] * w, rstd[t] = 1/sqrt(mean(x[t]^2) + eps); x [T,D]. */
    void (*rmsnorm_fwd)(float *out, float *rstd, const float *x, const float *w, int64_t T, int D,
                        float eps);
    /* dx[T,D] += d/dx; dw[D] += d/dw. */
    void (*rmsnorm_bwd)(float *dx, float *dw, const float *dout, const float *x, const float *w,
                        const float *rstd, int64_t T, int D);

    /* In place on x [T, H, hd]: rotate pairs (i, i + hd/2) by pos[t] * inv_freq[i]
     * using cos/sin tables [max_pos, hd/2]; inverse = 1 rotates back (the backward). */
    void (*rope)(float *x, const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T,
                 int H, int hd, int inverse);

    /* MLA (DeepSeek-V2/V3's multi-head latent attention, core/model/layer.c): the attention
     * inputs of T tokens in the layout attn_fwd and the paged cache take, H heads of hd:
     *   q[t,h] = [qf[t,h,:dn], rope(qf[t,h,dn:]), 0 ..]   qf [T,H,dn+dr] (q_proj's output)
     *   k[t,h] = [kv[t,h,:dn], rope(kr[t]),       0 ..]   kv [T,H,dn+dv] (kv_b_proj's), kr [T,dr]
     *   v[t,h] = [kv[t,h,dn:],                    0 ..]   (the rope key: one for every head)
     * hd >= dn+dr and >= dv: the padding is zeros, which change no score and no output that is
     * read. q, k or v NULL: not made (and qf, kv or kr not read where nothing reads them: the
     * engine's absorbed form makes q alone, or one head's k, the latent cache's row). rope rotates by pos[t] * inv_freq[i] (tables [max_pos, dr/2], as rope's) the pairs
     * (2i, 2i+1) when interleave (DeepSeek's checkpoints: Transformers' rope_interleave, which
     * writes pair i's two outputs at i and i + dr/2), else (i, i + dr/2). */
    void (*mla_qkv)(float *q, float *k, float *v, const float *qf, const float *kv, const float *kr,
                    const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr,
                    int dv, int hd, int interleave);
    /* Its backward (the map is linear): dqf [T,H,dn+dr], dkv [T,H,dn+dv], dkr [T,dr] (all
     * overwritten; dkr the sum over the heads, in head order) from dq, dk, dv [T,H,hd], whose
     * padding is not read. */
    void (*mla_qkv_bwd)(float *dqf, float *dkv, float *dkr, const float *dq, const float *dk, const float *dv,
                        const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr,
                        int dvd, int hd, int interleave);

    /* out = silu(gate) * up, n elements. */
    void (*swiglu_fwd)(float *out, const float *gate, const float *up, int64_t n);
    /* dgate = dout * up * silu'(gate), dup = dout * silu(gate) (overwritten). */
    void (*swiglu_bwd)(float *dgate, float *dup, const float *dout, const float *gate,
                       const float *up, int64_t n);

    /* Causal attention per sequence and head; q [T,Hq,hd], k/v [T,Hk,hd],
     * out [T,Hq,hd], lse [T,Hq] (log-sum-exp of the scaled scores).
     * prefix (NULL: none): [n_seqs], sequence s first attends to all rows of
     * sequence prefix[s] (an earlier one without prefix; -1: none), then
     * causally to its own: the layout of mrl_batch.prefix. */
    void (*attn_fwd)(float *out, float *lse, const float *q, const float *k, const float *v,
                     const int32_t *cu_seqlens, const int32_t *prefix, int n_seqs, int Hq, int Hk, int hd,
                     float scale);
    /* dq, dk, dv (overwritten) from dout; a prefix's dk / dv sum over every
     * sequence that attends to it. */
    void (*attn_bwd)(float *dq, float *dk, float *dv, const float *dout, const float *out,
                     const float *lse, const float *q, const float *k, const float *v,
                     const int32_t *cu_seqlens, const int32_t *prefix, int n_seqs, int Hq, int Hk, int hd,
                     float scale);

    /* Head statistics of logits rows [rows, V] scaled by inv_temp: per row
     * lse, entropy, and logprob of target (0 if target < 0, or >= V: a
     * target in another rank's slice of the vocabulary, tensor parallel). */
    void (*head_fwd)(const float *logits, int64_t rows, int V, float inv_temp,
                     const int32_t *targets, float *lse, float *entropy, float *logprob);
    /* In place: logits row -> d loss / d raw logits, given the row's lse and
     * entropy and the upstream dlogprob / dentropy (NULL = 0). A target >= V
     * (a slice of the vocabulary whose row's lse and entropy are the whole
     * row's): the -p terms of its dlogprob without the target's own. */
    void (*head_bwd)(float *logits, int64_t rows, int V, float inv_temp, const int32_t *targets,
                     const float *lse, const float *entropy, const float *dlogprob,
                     const float *dentropy);

    /* ---- rows, biases, weight panels ---- */
    /* out[i] = src[idx[i]] for i < n, rows of D floats (the embedding); a
     * negative idx[i]: a row of zeros (a token of another rank's slice of a
     * vocabulary-parallel embedding). */
    void (*gather_rows)(float *out, const float *src, const int32_t *idx, int64_t n, int64_t D);
    /* dst[idx[i]] += src[i] for i = 0 .. n-1 in that order (the embedding's
     * gradient: a row named twice gets both, first one first); a negative
     * idx[i] adds nothing. */
    void (*scatter_add_rows)(float *dst, const float *src, const int32_t *idx, int64_t n, int64_t D);
    /* y[t] += b for t < T, rows of N floats. */
    void (*bias_add)(float *y, const float *b, int64_t T, int64_t N);
    /* db[N] += sum over t < T of dy[t], added in t order. */
    void (*bias_bwd)(float *db, const float *dy, int64_t T, int64_t N);
    /* LoRA's part of a product (core/model/lora.c): u [T,r] = x [T,K] A [r,K]^T, then
     * y [T,N] += s u B [N,r]^T. A decode step's few rows run it once per adapted matrix per
     * layer: one call, where two library products would each pay their set-up. */
    void (*lora_fwd)(float *y, float *u, const float *x, const float *A, const float *B, int64_t T, int64_t N,
                     int64_t K, int64_t r, float s);
    /* P[mrl_panels_floats(N, K)] = W [N,K] as weight panels (above). */
    void (*panels_pack)(float *P, const float *W, int64_t N, int64_t K);
    /* P[mrl_panels16_dwords(N, K)] = W [N,K] (bf16) as bf16 weight panels (above). */
    void (*panels16_pack)(uint32_t *P, const uint16_t *W, int64_t N, int64_t K);

    /* ---- generation ---- */
    /* Write the K/V rows of T new tokens ([T, Hk, hd] each) into their
     * slots of one layer's paged cache (slot_mapping[T]; a negative slot
     * skips the token). */
    void (*paged_kv_write)(float *k_cache, float *v_cache, const float *k, const float *v,
                           const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size);
    /* The same into a bf16 cache (mrl_paged_attn.kv_bf16), each value
     * rounded to nearest even as mrl_f32_to_bf16 does. */
    void (*paged_kv_write_bf16)(uint16_t *k_cache, uint16_t *v_cache, const float *k, const float *v,
                                const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size);
    /* Bytes of workspace paged_attn would like for this batch (0: none,
     * or bad shapes). */
    int64_t (*paged_attn_workspace)(const mrl_paged_attn *a);
    /* a->out from the cache. Checks the shapes (Hq a multiple of Hk,
     * hd <= 1024, each sequence's queries <= its length <= its blocks'
     * capacity): MRL_ERR_INVALID; MRL_ERR_NOMEM for its scratch. */
    mrl_status (*paged_attn)(const mrl_paged_attn *a);
    /* Multi-head latent attention's absorbed form over a latent cache (core/engine/kv_cache.h,
     * latent): one array a layer of rows [slots, hd] (a->k_cache; v_cache unread; Hk = 1), each
     * token's normed latent then its turned rope key. Query head h of token t (q [T,Hq,hd]: its
     * nope part taken through kv_b_proj's key rows, its rope part turned) scores every row of its
     * sequence up to its position (paged_attn's batch and causality), scaled by a->scale, and
     * out[t,h,0..hv) is the softmax-weighted sum of those rows' first hv values (the latent;
     * out [T,Hq,hv]). Checks the shapes as paged_attn does (Hk 1, hv <= hd <= 1024). */
    mrl_status (*mla_paged_attn)(const mrl_paged_attn *a);
    /* Rows [T, W] into their slots of one layer's latent cache ([slots, W]; bf16: each value
     * rounded to nearest even); a negative slot skips its row. */
    void (*latent_kv_write)(void *cache, const float *rows, const int32_t *slot_mapping, int64_t T, int W, int bf16);
    /* One token from each of n rows of V logits (rows[r]; rows may repeat)
     * with params[r] (already checked) and the uniform u[r] in [0, 1) of
     * the row's random stream, in the order of moonrl/engine.h: tokens[r],
     * logprobs[r] (temperature-scaled, untruncated) and lp_processed[r]
     * (may be NULL). A row holding a NaN or no finite maximum fails with
     * MRL_ERR_INVALID: its token is -1 and the message, "row R: ...", is
     * that of the first such row. */
    mrl_status (*sample)(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                         const double *u, int32_t *tokens, float *logprobs, float *lp_processed);
    /* The k most likely tokens of each of n rows of V logits (rows[r]; rows
     * may repeat) and their log-probs under softmax(logits / t) over the
     * whole vocabulary, t the temperature of params[r] (1 when greedy): the
     * distribution of sample's logprobs, so a sampled token's entry is its
     * logprob. ids [n,k] and lps [n,k], row r's best first, ties the lower
     * id; 1 <= k <= V (MRL_ERR_INVALID otherwise). The rows are rows sample
     * took (no NaN, a finite maximum). The engine's top_logprobs. */
    mrl_status (*top_logprobs)(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                               int k, int32_t *ids, float *lps);

    /* ---- mixture of experts: the router of a sparse layer (core/model/moe.c) ---- */
    /* T tokens, E experts, k picks a token (1 <= k <= E):
     *   prob [T,E] = softmax(logits [T,E]) of each row in fp32 (prob may be
     *                logits: in place)
     *   sel  [T,k] = the k largest prob[t], largest first, ties the lower
     *                expert; with replay (NULL: none), token t's picks are
     *                replay[t * replay_stride .. + k) instead unless the
     *                first is negative (the caller checked them: k distinct
     *                experts in 0..E-1, or k times -1)
     *   w    [T,k] = prob[t, sel[t]], divided by their sum when norm
     *   how  [T]   (NULL: not wanted) 0: the router's own picks; 1:
     *              replayed, the same set as its own; 2: replayed, another
     *   The picks decide which experts run: every table computes a row's
     *   softmax in the reference's order (the max, the exps summed in fp32
     *   in expert order, the divisions), so the probabilities differ only by
     *   their exp's rounding and a pick can flip only between experts
     *   within an ulp of each other. */
    void (*moe_route)(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits, const int16_t *replay,
                      int64_t replay_stride, int64_t T, int E, int k, int norm);
    /* DeepSeek-V3's router (moonrl/model.h), the same outputs as moe_route's but:
     *   prob [T,E] = sigmoid(logits) in fp32, 1 / (1 + exp(-x)) (may be logits: in place)
     *   sel        = of the experts of the topk_group best of G groups of E / G (a group scored by
     *                the sum of its two best prob + bias, bias [E]), the k largest prob + bias,
     *                largest first (ties: the lower group, the lower expert); or the replay
     *   w          = prob[t, sel], divided by (their sum + 1e-20) when norm, times scale
     * (the choice, prob + bias and the groups' sums, in fp32 on every table, as the weights) */
    void (*moe_route_grouped)(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits,
                              const float *bias, const int16_t *replay, int64_t replay_stride, int64_t T, int E, int k,
                              int groups, int topk_group, int norm, float scale);
    /* The A = T*k picks sel [A] (pick i is token i / k's) grouped by expert,
     * each expert's in pick order (a stable counting sort): eoff [E+1],
     * expert e's rows eoff[e] .. eoff[e+1]; row [A], the grouped row of pick
     * i; tok [A], the token of grouped row r. */
    void (*moe_group)(int32_t *eoff, int32_t *row, int32_t *tok, const int32_t *sel, int64_t A, int E, int k);

    /* ---- optimizer and reductions ---- */
    /* One AdamW step in place on a->p, a->m, a->v (torch.optim.AdamW, moonrl/optim.h). */
    void (*adamw)(const mrl_adamw_args *a);
    /* *out = sum of x[i] (squares = 0) or of x[i]^2 (squares = 1), in
     * double; MRL_ERR_NOMEM when the kernel's scratch cannot be had. */
    mrl_status (*sum)(const float *x, int64_t n, int squares, double *out);
    /* x[i] *= s. */
    void (*scale)(float *x, int64_t n, float s);
    /* y[i] += x[i] (a sharded gradient's sum added to its accumulator). */
    void (*add)(float *y, const float *x, int64_t n);

    /* ---- dtype conversions (the rounding of moonrl/dtype.h: same bits on every table) ---- */
    void (*bf16_to_f32)(const uint16_t *src, float *dst, int64_t n);
    void (*f32_to_bf16)(const float *src, uint16_t *dst, int64_t n);
    void (*f16_to_f32)(const uint16_t *src, float *dst, int64_t n);
    void (*f32_to_f16)(const float *src, uint16_t *dst, int64_t n);
    /* dst[n] = the weights of n / 32 GGML blocks of `type` (MRL_QUANT_Q4_0, Q4_1, Q8_0: ggml's
     * numbers, moonrl/gguf.h), n a multiple of 32: a quantized base's matrices made whole where
     * they are used (core/model/quant.c). Each weight is the block's d * q (+ m) in fp32, with no
     * fused multiply-add: gguf-py's dequantization, the same bits on every table. */
    void (*dequant)(int type, const void *blocks, float *dst, int64_t n);
} mrl_kernels;

/* The GGML block types the dequant op reads (ggml's numbers): 32 weights a block, each a 4- or
 * 8-bit integer q and the block's fp16 scale d (and minimum m): d (q - 8), d q + m, d q. */
enum { MRL_QUANT_Q4_0 = 2, MRL_QUANT_Q4_1 = 3, MRL_QUANT_Q8_0 = 8 };
/* Bytes of one block of type (0: not a type the dequant op reads). */
static inline int mrl_quant_block_bytes(int type) {
    return type == MRL_QUANT_Q4_0 ? 18 : type == MRL_QUANT_Q4_1 ? 20 : type == MRL_QUANT_Q8_0 ? 34 : 0;
}

const mrl_kernels *mrl_kernels_cpu_reference(void);
const mrl_kernels *mrl_kernels_cpu_fast(void);
/* The table of a device: mrl_kernels_for, core/runtime/device_internal.h
 * (the dispatch over backends sits above the kernels). */
/* Which vector path the fast table uses here: "avx512", "avx2" or "sse"
 * (the one CPU-feature choice of kernels/cpu/isa.c; mrl_kernel_isa() in
 * moonrl/runtime.h reports it). */
const char *mrl_kernels_cpu_fast_isa(void);
/* Make the fast table use "avx512", "avx2" or "sse" (tests); 0 on success,
 * -1 when this CPU lacks it or the name is unknown. Not thread-safe: call
 * it between kernels. */
int mrl_kernels_cpu_fast_set_isa(const char *name);
