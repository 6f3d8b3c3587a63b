// MLA's attention inputs and their backward (kernels.h, mla_qkv), and the row copy (copy_rows).
// One thread per output element in grid-stride loops; the rotation's arithmetic is the CPU
// reference's (kernels/cpu/mla.c) with no fused multiply-add (__fmul_rn), so the same bits.
#include "ops.cuh"

#define THREADS 256
#define GRID_STRIDE(i, n) \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

// ---- copy_rows ----

__global__ static void copy_rows_kernel(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                                        int64_t cols) {
    GRID_STRIDE(e, rows * cols) {
        int64_t r = e / cols, j = e % cols;
        dst[r * ldd + j] = src[r * lds + j];
    }
}

void cuda_copy_rows(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    copy_rows_kernel<<<grid_for(rows * cols, THREADS), THREADS, 0, cuda_ops_stream()>>>(dst, ldd, src, lds, rows,
                                                                                       cols);
    cuda_ops_launched("copy_rows");
}

// ---- mla_qkv ----

// Output j of a rotated [dr] vector x (pair i = j mod dr/2: (2i, 2i+1) interleaved, else (i, i + dr/2)).
__device__ static float rotated(const float *x, const float *c, const float *s, int dr, int j, int interleave) {
    int half = dr / 2, i = j < half ? j : j - half;
    float a = interleave ? x[2 * i] : x[i], b = interleave ? x[2 * i + 1] : x[i + half];
    return j < half ? __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i])) : __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s[i]));
}

// Element j of x [dr] from the rotated gradient d [dr] (the transpose of rotated).
__device__ static float rotated_back(const float *d, const float *c, const float *s, int dr, int j, int interleave) {
    int half = dr / 2, i, first; // the pair of element j, and whether j is its first member
    if (interleave) i = j / 2, first = j % 2 == 0;
    else i = j < half ? j : j - half, first = j < half;
    return first ? __fadd_rn(__fmul_rn(d[i], c[i]), __fmul_rn(d[i + half], s[i]))
                 : __fsub_rn(__fmul_rn(d[i + half], c[i]), __fmul_rn(d[i], s[i]));
}

// one thread per (t, h, j < hd): q, k and v's element j
__global__ static void mla_qkv_kernel(float *q, float *k, float *v, const float *qf, const float *kv, const float *kr,
                                      const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H,
                                      int dn, int dr, int dv, int hd, int interleave) {
    GRID_STRIDE(e, T * H * hd) {
        int j = (int)(e % hd);
        int64_t th = e / hd, t = th / H;
        const float *c = cos_t + (int64_t)pos[t] * (dr / 2), *s = sin_t + (int64_t)pos[t] * (dr / 2);
        const float *qr = qf ? qf + th * (dn + dr) : NULL, *kvr = kv ? kv + th * (dn + dv) : NULL;
        if (q) q[e] = j < dn ? qr[j] : j < dn + dr ? rotated(qr + dn, c, s, dr, j - dn, interleave) : 0.0f;
        if (k) k[e] = j < dn ? kvr[j] : j < dn + dr ? rotated(kr + t * dr, c, s, dr, j - dn, interleave) : 0.0f;
        if (v) v[e] = j < dv ? kvr[dn + j] : 0.0f;
    }
}

// one thread per (t, h, j < dn + dr) of dqf, per (t, h, j < dn + dv) of dkv, per (t, j < dr) of dkr
__global__ static void mla_qkv_bwd_kernel(float *dqf, float *dkv, float *dkr, const float *dq, const float *dk,
                                          const float *dv, const int32_t *pos, const float *cos_t,
                                          const float *sin_t, int64_t T, int H, int dn, int dr, int dvd, int hd,
                                          int interleave) {
    int64_t nq = T * H * (dn + dr), nkv = T * H * (dn + dvd);
    GRID_STRIDE(e, nq + nkv + T * dr) {
        if (e < nq) {
            int w = dn + dr, j = (int)(e % w);
            int64_t th = e / w, t = th / H;
            const float *c = cos_t + (int64_t)pos[t] * (dr / 2), *s = sin_t + (int64_t)pos[t] * (dr / 2);
            dqf[e] = j < dn ? dq[th * hd + j] : rotated_back(dq + th * hd + dn, c, s, dr, j - dn, interleave);
        } else if (e < nq + nkv) {
            int64_t f = e - nq;
            int w = dn + dvd, j = (int)(f % w);
            int64_t th = f / w;
            dkv[f] = j < dn ? dk[th * hd + j] : dv[th * hd + j - dn];
        } else { // the heads' sum in head order, as the reference adds them
            int64_t f = e - nq - nkv, t = f / dr;
            int j = (int)(f % dr);
            const float *c = cos_t + (int64_t)pos[t] * (dr / 2), *s = sin_t + (int64_t)pos[t] * (dr / 2);
            float sum = 0.0f;
            for (int h = 0; h < H; h++) {
                float x = rotated_back(dk + (t * H + h) * hd + dn, c, s, dr, j, interleave);
                sum = h ? __fadd_rn(sum, x) : x;
            }
            dkr[f] = sum;
        }
    }
}

void cuda_mla_qkv(float *q, float *k, float *v, const float *qf, const float *kv, const float *kr, const int32_t *pos,
                  const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr, int dv, int hd,
                  int interleave) {
    if (T <= 0 || H <= 0 || hd <= 0) return;
    mla_qkv_kernel<<<grid_for(T * H * hd, THREADS), THREADS, 0, cuda_ops_stream()>>>(q, k, v, qf, kv, kr, pos, cos_t,
                                                                                    sin_t, T, H, dn, dr, dv, hd,
                                                                                    interleave);
    cuda_ops_launched("mla_qkv");
}

void cuda_mla_qkv_bwd(float *dqf, float *dkv, float *dkr, const float *dq, const float *dk, const float *dv,
                      const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr,
                      int dvd, int hd, int interleave) {
    if (T <= 0 || H <= 0) return;
    int64_t n = T * H * (dn + dr) + T * H * (dn + dvd) + T * dr;
    mla_qkv_bwd_kernel<<<grid_for(n, THREADS), THREADS, 0, cuda_ops_stream()>>>(dqf, dkv, dkr, dq, dk, dv, pos, cos_t,
                                                                                sin_t, T, H, dn, dr, dvd, hd,
                                                                                interleave);
    cuda_ops_launched("mla_qkv_bwd");
}

// ---- the latent cache ----

__global__ static void latent_write_kernel(void *cache, const float *rows, const int32_t *slots, int64_t T, int W,
                                           int bf16) {
    GRID_STRIDE(e, T * W) {
        int64_t t = e / W;
        int d = (int)(e % W);
        if (slots[t] < 0) continue;
        int64_t at = (int64_t)slots[t] * W + d;
        if (bf16) ((uint16_t *)cache)[at] = f32_to_bf16_bits(rows[e]);
        else ((float *)cache)[at] = rows[e];
    }
}

void cuda_latent_kv_write(void *cache, const float *rows, const int32_t *slot_mapping, int64_t T, int W, int bf16) {
    if (T <= 0 || W <= 0) return;
    latent_write_kernel<<<grid_for(T * W, THREADS), THREADS, 0, cuda_ops_stream()>>>(cache, rows, slot_mapping, T, W,
                                                                                     bf16);
    cuda_ops_launched("latent_kv_write");
}

// Blocks over (query tokens, heads): block (x, h) takes tokens x, x + gridDim.x, ... (their count is
// the device's query_start[n_seqs]) of head h: the token's sequence found in query_start, the
// scores of its context's rows into the block's scratch (threads over the keys), their max and sum
// reduced in the block, then the output's values (threads over them) summed over the keys in
// key order.
#define ATT_THREADS 128
__device__ static float latent_value(const mrl_paged_attn &a, const int32_t *table, int c, int d) {
    int64_t at = ((int64_t)table[c / a.block_size] * a.block_size + c % a.block_size) * a.hd + d;
    return a.kv_bf16 ? load_f32((const uint16_t *)a.k_cache + at) : ((const float *)a.k_cache)[at];
}

__global__ static void __launch_bounds__(ATT_THREADS) mla_attn_kernel(const mrl_paged_attn a, float *scratch, int max_ctx,
                                                                      int *bad_seq) {
    __shared__ float red[ATT_THREADS];
    const int h = blockIdx.y, hv = a.hv ? a.hv : a.hd;
    const int64_t T0 = a.query_start[0], T = a.query_start[a.n_seqs]; // (a run of a batch's sequences: past 0)
    float *s = scratch + ((int64_t)blockIdx.y * gridDim.x + blockIdx.x) * max_ctx;
    for (int64_t t = T0 + blockIdx.x; t < T; t += gridDim.x) {
        int i = 0;
        while (i + 1 < a.n_seqs && a.query_start[i + 1] <= t) i++;
        int n_q = a.query_start[i + 1] - a.query_start[i], len = a.seq_lens[i];
        float *o = a.out + (t * a.Hq + h) * hv;
        __syncthreads(); // (the previous token's readers of red and s are done)
        if (n_q > len || len > max_ctx) {
            if (threadIdx.x == 0) atomicMin(bad_seq, i);
            for (int d = threadIdx.x; d < hv; d += blockDim.x) o[d] = __int_as_float(0x7fc00000);
            continue;
        }
        const int n = len - n_q + (int)(t - a.query_start[i]) + 1;
        const int32_t *table = a.block_tables + (int64_t)i * a.max_blocks_per_seq;
        const float *q = a.q + (t * a.Hq + h) * a.hd;
        float m = -INFINITY;
        for (int c = threadIdx.x; c < n; c += blockDim.x) {
            float dot = 0;
            for (int d = 0; d < a.hd; d++) dot += q[d] * latent_value(a, table, c, d);
            s[c] = dot * a.scale;
            m = fmaxf(m, s[c]);
        }
        red[threadIdx.x] = m;
        __syncthreads();
        for (int w = blockDim.x / 2; w > 0; w /= 2) {
            if ((int)threadIdx.x < w) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + w]);
            __syncthreads();
        }
        m = red[0];
        __syncthreads();
        float sum = 0;
        for (int c = threadIdx.x; c < n; c += blockDim.x) sum += s[c] = expf(s[c] - m);
        red[threadIdx.x] = sum;
        __syncthreads();
        for (int w = blockDim.x / 2; w > 0; w /= 2) {
            if ((int)threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
            __syncthreads();
        }
        float inv = 1.0f / red[0];
        for (int d = threadIdx.x; d < hv; d += blockDim.x) {
            float acc = 0;
            for (int c = 0; c < n; c++) acc += s[c] * latent_value(a, table, c, d);
            o[d] = acc * inv;
        }
    }
}

mrl_status cuda_mla_paged_attn(const mrl_paged_attn *a) {
    int hv = a->hv ? a->hv : a->hd;
    if (!a->out || !a->q || !a->k_cache || !a->seq_lens || !a->query_start || (a->n_seqs > 0 && !a->block_tables))
        return cuda_ops_fail(MRL_ERR_INVALID, "mla_paged_attn: NULL argument");
    if (a->Hk != 1 || a->Hq < 1 || a->Hq > 65535 || a->hd < 1 || a->hd > 1024 || hv > a->hd || a->block_size < 1 ||
        a->n_seqs < 0 || a->max_blocks_per_seq < 0)
        return cuda_ops_fail(MRL_ERR_INVALID, "mla_paged_attn: Hq %d, Hk %d (must be 1), hd %d, hv %d, block_size %d",
                             a->Hq, a->Hk, a->hd, hv, a->block_size);
    if (a->n_seqs == 0) return MRL_OK;
    int *flag = cuda_ops_device_flag();
    if (!flag) return MRL_ERR_NOMEM;
    int max_ctx = a->max_blocks_per_seq * a->block_size > 0 ? a->max_blocks_per_seq * a->block_size : 1;
    dim3 grid(4 * cuda_ops_sm_count(), a->Hq);
    float *scratch = (float *)cuda_ops_scratch(sizeof(float) * (size_t)grid.x * grid.y * max_ctx);
    if (!scratch) return MRL_ERR_NOMEM;
    mla_attn_kernel<<<grid, ATT_THREADS, 0, cuda_ops_stream()>>>(*a, scratch, max_ctx, flag);
    return cuda_ops_launched("mla_paged_attn");
}
