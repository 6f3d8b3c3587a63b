// The engine's paged K/V cache on CUDA: the write of new tokens' K/V into
// their slots, and attention of a batch of new queries (prefill chunks and
// single-token decodes mixed) over each sequence's blocks. The layout is
// that of kernels/cpu/paged_attention.h: K transposed inside a block
// ([hd][block_size]), so the keys of consecutive lanes are consecutive
// floats; V as [block_size][hd], so a V row is read by the lanes along d.
//
// Attention: one block of 4 warps per (query token, query head); warp w
// takes the context's key tiles w, w + 4, ... of 32 keys (lane = key) with
// its own online softmax, and the 4 partial results are merged at the end.
// The batch's descriptors stay on the device: the blocks stride over the
// tokens and find each token's sequence by binary search on query_start.
// A sequence whose lengths do not fit its blocks gets NaN rows and is
// reported by mrl_cuda_ops_check (the CPU checks it before it reads).
#include "ops.cuh"

#define WARPS 4
#define MAX_HD 1024

// E: float, or uint16_t for a bf16 cache (rounded to nearest even).
template <typename E>
__global__ static void kv_write_kernel(E *k_cache, E *v_cache, const float *k, const float *v,
                                       const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size) {
    int64_t per_token = (int64_t)Hk * hd;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < T * per_token;
         e += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = e / per_token;
        int32_t slot = slot_mapping[t];
        if (slot < 0) continue;
        int h = (int)(e % per_token / hd), d = (int)(e % hd);
        int64_t blk = slot / block_size, off = slot % block_size;
        int64_t base = (blk * Hk + h) * (int64_t)block_size * hd;
        store_f32(k_cache + base + (int64_t)d * block_size + off, k[e]);
        store_f32(v_cache + base + off * hd + d, v[e]);
    }
}

template <typename E>
static void kv_write(const char *name, E *k_cache, E *v_cache, const float *k, const float *v,
                     const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size) {
    if (T <= 0 || Hk <= 0 || hd <= 0) return;
    if (block_size < 1) {
        cuda_ops_fail(MRL_ERR_INVALID, "cuda %s: block_size %d", name, block_size);
        return;
    }
    kv_write_kernel<E><<<grid_for(T * Hk * hd, 256), 256, 0, cuda_ops_stream()>>>(k_cache, v_cache, k, v, slot_mapping,
                                                                                  T, Hk, hd, block_size);
    cuda_ops_launched(name);
}

void cuda_paged_kv_write(float *k_cache, float *v_cache, const float *k, const float *v, const int32_t *slot_mapping,
                         int64_t T, int Hk, int hd, int block_size) {
    kv_write("paged_kv_write", k_cache, v_cache, k, v, slot_mapping, T, Hk, hd, block_size);
}

void cuda_paged_kv_write_bf16(uint16_t *k_cache, uint16_t *v_cache, const float *k, const float *v,
                              const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size) {
    kv_write("paged_kv_write_bf16", k_cache, v_cache, k, v, slot_mapping, T, Hk, hd, block_size);
}

// smem: q [hd], each warp's output [WARPS][hd], max and sum [WARPS] each.
// E: the cache's element (float, or uint16_t holding bf16: read widened).
template <typename E, int NC>
__global__ static void __launch_bounds__(WARPS * 32) paged_attn_kernel(mrl_paged_attn a, int *bad_seq) {
    extern __shared__ float sm[];
    const int hd = a.hd, bs = a.block_size, G = a.Hq / a.Hk, h = blockIdx.y, g = h / G;
    float *qs = sm, *ow = qs + hd, *mw = ow + WARPS * hd, *lw = mw + WARPS;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t T = a.query_start[a.n_seqs];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        int lo = 0, hi = a.n_seqs - 1;  // the sequence with query_start[i] <= t < query_start[i + 1]
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (a.query_start[mid + 1] <= t) lo = mid + 1;
            else hi = mid;
        }
        const int i = lo, n_q = a.query_start[i + 1] - a.query_start[i], len = a.seq_lens[i];
        float *o = a.out + (t * a.Hq + h) * hd;
        __syncthreads();  // the previous token's readers of sm are done
        if (n_q > len || (int64_t)len > (int64_t)a.max_blocks_per_seq * bs) {
            if (threadIdx.x == 0) atomicMin(bad_seq, i);
            for (int d = threadIdx.x; d < hd; d += blockDim.x) o[d] = __int_as_float(0x7fc00000);
            continue;
        }
        const int32_t *table = a.block_tables + (int64_t)i * a.max_blocks_per_seq;
        const int pos = len - n_q + (int)(t - a.query_start[i]);  // keys 0..pos
        for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = a.q[(t * a.Hq + h) * hd + d];
        __syncthreads();
        float m = -INFINITY, l = 0, acc[NC];
        for (int c = 0; c < NC; c++) acc[c] = 0;
        for (int c0 = w * 32; c0 <= pos; c0 += WARPS * 32) {
            int c = c0 + lane;
            bool ok = c <= pos;
            float s = -INFINITY;
            const E *vrow = NULL;
            if (ok) {
                int64_t base = ((int64_t)table[c / bs] * a.Hk + g) * bs * hd;
                const E *kt = (const E *)a.k_cache + base + c % bs;
                float dot = 0;
                for (int d = 0; d < hd; d++) dot += qs[d] * load_f32(kt + (int64_t)d * bs);
                s = dot * a.scale;
                vrow = (const E *)a.v_cache + base + (int64_t)(c % bs) * hd;
            }
            float mn = fmaxf(m, warp_max_f(s));  // the tile's first key is valid: mn is finite
            float alpha = m == -INFINITY ? 0.0f : expf(m - mn);
            float p = ok ? expf(s - mn) : 0.0f;
            l = l * alpha + p;
            for (int k = 0; k < NC; k++) acc[k] *= alpha;
            m = mn;
            for (int jj = 0; jj < 32 && c0 + jj <= pos; jj++) {
                float pj = __shfl_sync(FULL_MASK, p, jj);
                const E *vr = (const E *)__shfl_sync(FULL_MASK, (unsigned long long)vrow, jj);
                for (int k = 0; k < NC; k++) {
                    int d = k * 32 + lane;
                    if (d < hd) acc[k] += pj * load_f32(vr + d);
                }
            }
        }
        l = warp_sum_f(l);
        for (int k = 0; k < NC; k++) {
            int d = k * 32 + lane;
            if (d < hd) ow[w * hd + d] = acc[k];
        }
        if (lane == 0) mw[w] = m, lw[w] = l;
        __syncthreads();
        float M = -INFINITY;
        for (int x = 0; x < WARPS; x++) M = fmaxf(M, mw[x]);
        float sc[WARPS], L = 0;
        for (int x = 0; x < WARPS; x++) {
            sc[x] = mw[x] == -INFINITY ? 0.0f : expf(mw[x] - M);  // a warp that had no keys weighs 0
            L += lw[x] * sc[x];
        }
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float sum = 0;
            for (int x = 0; x < WARPS; x++) sum += ow[x * hd + d] * sc[x];
            o[d] = sum / L;
        }
    }
}

template <typename E>
static void launch_attn(const mrl_paged_attn *a, int *flag, dim3 grid, size_t smem, cudaStream_t st) {
    int nc = (a->hd + 31) / 32;
    if (nc <= 1) paged_attn_kernel<E, 1><<<grid, WARPS * 32, smem, st>>>(*a, flag);
    else if (nc <= 2) paged_attn_kernel<E, 2><<<grid, WARPS * 32, smem, st>>>(*a, flag);
    else if (nc <= 4) paged_attn_kernel<E, 4><<<grid, WARPS * 32, smem, st>>>(*a, flag);
    else if (nc <= 8) paged_attn_kernel<E, 8><<<grid, WARPS * 32, smem, st>>>(*a, flag);
    else if (nc <= 16) paged_attn_kernel<E, 16><<<grid, WARPS * 32, smem, st>>>(*a, flag);
    else paged_attn_kernel<E, 32><<<grid, WARPS * 32, smem, st>>>(*a, flag);
}

// No workspace: the merge of the warps' partial results is in shared memory.
int64_t cuda_paged_attn_workspace(const mrl_paged_attn *a) {
    (void)a;
    return 0;
}

mrl_status cuda_paged_attn(const mrl_paged_attn *a) {
    if (!a || !a->out || !a->q || !a->k_cache || !a->v_cache || !a->seq_lens || !a->query_start ||
        (a->n_seqs > 0 && !a->block_tables))
        return cuda_ops_fail(MRL_ERR_INVALID, "paged_attention_cuda: NULL argument");
    if (a->n_seqs < 0 || a->Hk < 1 || a->Hq < a->Hk || a->Hq % a->Hk || a->hd < 1 || a->hd > MAX_HD ||
        a->block_size < 1 || a->max_blocks_per_seq < 0 || a->Hq > 65535)
        return cuda_ops_fail(MRL_ERR_INVALID,
                             "paged_attention_cuda: bad shape (n_seqs=%d Hq=%d Hk=%d hd=%d block_size=%d)", a->n_seqs,
                             a->Hq, a->Hk, a->hd, a->block_size);
    if (a->n_seqs == 0) return MRL_OK;
    int *flag = cuda_ops_device_flag();
    if (!flag) return MRL_ERR_NOMEM;
    size_t smem = sizeof(float) * ((WARPS + 1) * a->hd + 2 * WARPS);
    dim3 grid(4 * cuda_ops_sm_count(), a->Hq);
    cudaStream_t st = cuda_ops_stream();
    if (a->kv_bf16) launch_attn<uint16_t>(a, flag, grid, smem, st);
    else launch_attn<float>(a, flag, grid, smem, st);
    return cuda_ops_launched("paged_attn");
}
