// Causal attention over packed variable-length sequences on CUDA (the
// attn_fwd / attn_bwd slots; kernels/cpu/reference.c has the math and the
// prefix layout: sequence s attends to every row of sequence prefix[s],
// then causally to its own rows).
//
// Forward, flash style: a block takes a tile of 32 query rows of one
// sequence and one head (8 warps, 4 rows each), walks the keys it may see
// in tiles of 32 held in shared memory (the prefix's rows, then its own up
// to its last query), and keeps per row the running max, the running sum
// of exp and the weighted sum of V (online softmax): the scores never
// reach memory. In a tile, lane j of a warp computes the scores of key j
// for the warp's 4 rows; then each lane accumulates the output dimensions
// d = lane, lane + 32, ... with the weights broadcast by shuffles.
//
// Backward, recomputing the weights from the forward's lse:
//   dq: the forward's shape; per key p = exp(s - lse), dp = dO . v,
//       ds = p (dp - D) scale, D = dO . O; dq += ds k.
//   dk, dv: a block takes a tile of 32 key rows of one sequence and one
//       kv head and walks every query that sees them (its own rows from
//       the tile on, every row of the sequences that take it as their
//       prefix, each query head of the group), in tiles of 32:
//       dv += p dO, dk += ds q. Each gradient row is written once by one
//       block: no atomics, and the same result on every run.
// fp32 throughout (no tensor cores yet); head_dim <= 256.
//
// The sequence lengths stay on the device: a one-block kernel turns
// cu_seqlens into each sequence's first tile (in the table's scratch) and
// the blocks stride over the tiles, so nothing is copied to the host.
#include "ops.cuh"

#define TILE 32      // query rows a block takes, key rows a tile holds
#define WARPS 8
#define RW 4         // rows per warp: TILE = WARPS * RW
#define MAX_HD 256

// first_tile[s] = tiles of sequences before s; first_tile[n_seqs] = all.
// One block: each thread counts a contiguous range of sequences, then a
// scan over the threads.
#define SCAN_THREADS 1024
__global__ static void __launch_bounds__(SCAN_THREADS)
seq_tiles_kernel(int32_t *first_tile, const int32_t *cu, int n_seqs) {
    __shared__ int sh[33];
    int chunk = (n_seqs + SCAN_THREADS - 1) / SCAN_THREADS, lo = threadIdx.x * chunk, hi = min(n_seqs, lo + chunk);
    int mine = 0, total;
    for (int s = lo; s < hi; s++) mine += (max(cu[s + 1] - cu[s], 0) + TILE - 1) / TILE;
    int t = block_exclusive_scan(mine, sh, &total);
    for (int s = lo; s < hi; s++) {
        first_tile[s] = t;
        t += (max(cu[s + 1] - cu[s], 0) + TILE - 1) / TILE;
    }
    if (threadIdx.x == 0) first_tile[n_seqs] = total;
}

// The sequence holding tile `tile`: the s with first_tile[s] <= tile < first_tile[s + 1].
__device__ static int seq_of_tile(const int32_t *first_tile, int n_seqs, int tile) {
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (first_tile[mid + 1] <= tile) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// rows [r0, r1) of x [*, H, hd] at head h into sm [TILE][ld], zeros past r1 and past hd
__device__ static void load_rows(float *sm, int ld, const float *x, int64_t r0, int64_t r1, int H, int h, int hd) {
    for (int e = threadIdx.x; e < TILE * ld; e += blockDim.x) {
        int r = e / ld, d = e % ld;
        sm[e] = r0 + r < r1 && d < hd ? x[((r0 + r) * H + h) * hd + d] : 0.0f;
    }
}

// ---- forward ----

// smem: Q [TILE][hd] (read broadcast), K [TILE][NC*32+1] (read by row per
// lane: the odd stride keeps the lanes in distinct banks), V [TILE][NC*32].
template <int NC>
__global__ static void __launch_bounds__(WARPS * 32)
attn_fwd_kernel(float *out, float *lse, const float *q, const float *k, const float *v, const int32_t *cu,
                const int32_t *prefix, const int32_t *first_tile, int n_seqs, int Hq, int Hk, int hd, float scale) {
    extern __shared__ float sm[];
    const int ldk = NC * 32 + 1, ldv = NC * 32;
    float *Qs = sm, *Ks = Qs + TILE * hd, *Vs = Ks + TILE * ldk;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, h = blockIdx.y, kh = h / (Hq / Hk);
    const int tiles = first_tile[n_seqs];
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int s = seq_of_tile(first_tile, n_seqs, tile);
        int64_t i0 = cu[s] + (int64_t)(tile - first_tile[s]) * TILE, i1 = min((int64_t)cu[s + 1], i0 + TILE);
        __syncthreads();  // the previous tile's readers are done
        load_rows(Qs, hd, q, i0, i1, Hq, h, hd);
        float m[RW], l[RW], o[RW][NC];
        for (int r = 0; r < RW; r++) {
            m[r] = -INFINITY, l[r] = 0;
            for (int c = 0; c < NC; c++) o[r][c] = 0;
        }
        int pre = prefix ? prefix[s] : -1;
        for (int range = pre >= 0 ? 0 : 1; range < 2; range++) {
            int64_t a = range ? cu[s] : cu[pre], b = range ? i1 : cu[pre + 1];
            for (int64_t j0 = a; j0 < b; j0 += TILE) {
                __syncthreads();
                load_rows(Ks, ldk, k, j0, b, Hk, kh, hd);
                load_rows(Vs, ldv, v, j0, b, Hk, kh, hd);
                __syncthreads();
                float acc[RW];
                for (int r = 0; r < RW; r++) acc[r] = 0;
                const float *kr = Ks + lane * ldk;
                for (int e = 0; e < hd; e++) {
                    float kv = kr[e];
                    for (int r = 0; r < RW; r++) acc[r] += Qs[(w * RW + r) * hd + e] * kv;
                }
                int64_t j = j0 + lane;
                float p[RW];
                for (int r = 0; r < RW; r++) {
                    int64_t i = i0 + w * RW + r;
                    bool ok = j < b && i < i1 && (range == 0 || j <= i);
                    float sc = ok ? acc[r] * scale : -INFINITY;
                    float mn = fmaxf(m[r], warp_max_f(sc));  // uniform over the warp
                    float alpha = mn == -INFINITY || m[r] == -INFINITY ? (mn == -INFINITY ? 1.0f : 0.0f)
                                                                       : expf(m[r] - mn);
                    p[r] = ok ? expf(sc - mn) : 0.0f;
                    l[r] = l[r] * alpha + p[r];
                    for (int c = 0; c < NC; c++) o[r][c] *= alpha;
                    m[r] = mn;
                }
                for (int jj = 0; jj < TILE; jj++) {
                    const float *vr = Vs + jj * ldv + lane;
                    for (int r = 0; r < RW; r++) {
                        float pj = __shfl_sync(FULL_MASK, p[r], jj);
                        for (int c = 0; c < NC; c++) o[r][c] += pj * vr[c * 32];
                    }
                }
            }
        }
        for (int r = 0; r < RW; r++) {
            int64_t i = i0 + w * RW + r;
            float sum = warp_sum_f(l[r]);
            if (i >= i1) continue;
            float inv = 1.0f / sum;
            for (int c = 0; c < NC; c++) {
                int d = c * 32 + lane;
                if (d < hd) out[(i * Hq + h) * hd + d] = o[r][c] * inv;
            }
            if (lane == 0) lse[i * Hq + h] = m[r] + logf(sum);
        }
    }
}

// ---- backward: dq ----

// smem: Q, dO [TILE][hd] (broadcast), K, V [TILE][NC*32+1] (rows per lane).
template <int NC>
__global__ static void __launch_bounds__(WARPS * 32)
attn_dq_kernel(float *dq, const float *dout, const float *out, const float *lse, const float *q, const float *k,
               const float *v, const int32_t *cu, const int32_t *prefix, const int32_t *first_tile, int n_seqs,
               int Hq, int Hk, int hd, float scale) {
    extern __shared__ float sm[];
    const int ld = NC * 32 + 1;
    float *Qs = sm, *Ds = Qs + TILE * hd, *Ks = Ds + TILE * hd, *Vs = Ks + TILE * ld;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, h = blockIdx.y, kh = h / (Hq / Hk);
    const int tiles = first_tile[n_seqs];
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int s = seq_of_tile(first_tile, n_seqs, tile);
        int64_t i0 = cu[s] + (int64_t)(tile - first_tile[s]) * TILE, i1 = min((int64_t)cu[s + 1], i0 + TILE);
        __syncthreads();
        load_rows(Qs, hd, q, i0, i1, Hq, h, hd);
        load_rows(Ds, hd, dout, i0, i1, Hq, h, hd);
        float L[RW], Di[RW], g[RW][NC];
        for (int r = 0; r < RW; r++) {  // D = dO . O, lse of the warp's rows
            int64_t i = i0 + w * RW + r;
            float d = 0;
            if (i < i1)
                for (int e = lane; e < hd; e += 32) d += dout[(i * Hq + h) * hd + e] * out[(i * Hq + h) * hd + e];
            Di[r] = warp_sum_f(d);
            L[r] = i < i1 ? lse[i * Hq + h] : 0.0f;
            for (int c = 0; c < NC; c++) g[r][c] = 0;
        }
        int pre = prefix ? prefix[s] : -1;
        for (int range = pre >= 0 ? 0 : 1; range < 2; range++) {
            int64_t a = range ? cu[s] : cu[pre], b = range ? i1 : cu[pre + 1];
            for (int64_t j0 = a; j0 < b; j0 += TILE) {
                __syncthreads();
                load_rows(Ks, ld, k, j0, b, Hk, kh, hd);
                load_rows(Vs, ld, v, j0, b, Hk, kh, hd);
                __syncthreads();
                float sa[RW], pa[RW];
                for (int r = 0; r < RW; r++) sa[r] = pa[r] = 0;
                const float *kr = Ks + lane * ld, *vr = Vs + lane * ld;
                for (int e = 0; e < hd; e++) {
                    float kv = kr[e], vv = vr[e];
                    for (int r = 0; r < RW; r++) {
                        sa[r] += Qs[(w * RW + r) * hd + e] * kv;
                        pa[r] += Ds[(w * RW + r) * hd + e] * vv;
                    }
                }
                int64_t j = j0 + lane;
                float ds[RW];
                for (int r = 0; r < RW; r++) {
                    int64_t i = i0 + w * RW + r;
                    bool ok = j < b && i < i1 && (range == 0 || j <= i);
                    float p = ok ? expf(sa[r] * scale - L[r]) : 0.0f;
                    ds[r] = p * (pa[r] - Di[r]) * scale;
                }
                for (int jj = 0; jj < TILE; jj++) {
                    const float *kj = Ks + jj * ld + lane;
                    for (int r = 0; r < RW; r++) {
                        float d = __shfl_sync(FULL_MASK, ds[r], jj);
                        for (int c = 0; c < NC; c++) g[r][c] += d * kj[c * 32];
                    }
                }
            }
        }
        for (int r = 0; r < RW; r++) {
            int64_t i = i0 + w * RW + r;
            if (i >= i1) continue;
            for (int c = 0; c < NC; c++) {
                int d = c * 32 + lane;
                if (d < hd) dq[(i * Hq + h) * hd + d] = g[r][c];
            }
        }
    }
}

// ---- backward: dk, dv ----

// smem: K, V of the block's keys [TILE][hd] (broadcast), a query tile's
// Q, dO [TILE][NC*32+1] (rows per lane), its lse and D [TILE].
template <int NC>
__global__ static void __launch_bounds__(WARPS * 32)
attn_dkdv_kernel(float *dk, float *dv, const float *dout, const float *out, const float *lse, const float *q,
                 const float *k, const float *v, const int32_t *cu, const int32_t *prefix, const int32_t *first_tile,
                 int n_seqs, int Hq, int Hk, int hd, float scale) {
    extern __shared__ float sm[];
    const int ld = NC * 32 + 1, G = Hq / Hk;
    float *Ks = sm, *Vs = Ks + TILE * hd, *Qs = Vs + TILE * hd, *Os = Qs + TILE * ld, *Ls = Os + TILE * ld,
          *Dsh = Ls + TILE;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, kh = blockIdx.y;
    const int tiles = first_tile[n_seqs];
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int s = seq_of_tile(first_tile, n_seqs, tile);
        int64_t j0 = cu[s] + (int64_t)(tile - first_tile[s]) * TILE, j1 = min((int64_t)cu[s + 1], j0 + TILE);
        __syncthreads();
        load_rows(Ks, hd, k, j0, j1, Hk, kh, hd);
        load_rows(Vs, hd, v, j0, j1, Hk, kh, hd);
        float gk[RW][NC], gv[RW][NC];
        for (int r = 0; r < RW; r++)
            for (int c = 0; c < NC; c++) gk[r][c] = gv[r][c] = 0;
        // the query ranges that see these keys: its own rows from j0 on
        // (causal), then every sequence whose prefix it is (all of them)
        for (int src = -1; src < n_seqs; src++) {
            if (src >= 0 && (!prefix || prefix[src] != s)) continue;
            int64_t a = src < 0 ? j0 : cu[src], b = src < 0 ? cu[s + 1] : cu[src + 1];
            for (int h = kh * G; h < kh * G + G; h++)
                for (int64_t i0 = a; i0 < b; i0 += TILE) {
                    __syncthreads();
                    load_rows(Qs, ld, q, i0, b, Hq, h, hd);
                    load_rows(Os, ld, dout, i0, b, Hq, h, hd);
                    for (int r = 0; r < RW; r++) {  // lse and D = dO . O of the tile's rows
                        int64_t i = i0 + w * RW + r;
                        float d = 0;
                        if (i < b)
                            for (int e = lane; e < hd; e += 32)
                                d += dout[(i * Hq + h) * hd + e] * out[(i * Hq + h) * hd + e];
                        d = warp_sum_f(d);
                        if (lane == 0) {
                            Dsh[w * RW + r] = d;
                            Ls[w * RW + r] = i < b ? lse[i * Hq + h] : 0.0f;
                        }
                    }
                    __syncthreads();
                    float sa[RW], pa[RW];
                    for (int r = 0; r < RW; r++) sa[r] = pa[r] = 0;
                    const float *qr = Qs + lane * ld, *dr = Os + lane * ld;
                    for (int e = 0; e < hd; e++) {
                        float qv = qr[e], dv_ = dr[e];
                        for (int r = 0; r < RW; r++) {
                            sa[r] += qv * Ks[(w * RW + r) * hd + e];
                            pa[r] += dv_ * Vs[(w * RW + r) * hd + e];
                        }
                    }
                    int64_t i = i0 + lane;  // this lane's query
                    float p[RW], ds[RW];
                    for (int r = 0; r < RW; r++) {
                        int64_t j = j0 + w * RW + r;
                        bool ok = i < b && j < j1 && (src >= 0 || j <= i);
                        p[r] = ok ? expf(sa[r] * scale - Ls[lane]) : 0.0f;
                        ds[r] = p[r] * (pa[r] - Dsh[lane]) * scale;
                    }
                    for (int ii = 0; ii < TILE; ii++) {
                        const float *qi = Qs + ii * ld + lane, *di = Os + ii * ld + lane;
                        for (int r = 0; r < RW; r++) {
                            float pp = __shfl_sync(FULL_MASK, p[r], ii), dd = __shfl_sync(FULL_MASK, ds[r], ii);
                            for (int c = 0; c < NC; c++) {
                                gv[r][c] += pp * di[c * 32];
                                gk[r][c] += dd * qi[c * 32];
                            }
                        }
                    }
                }
        }
        for (int r = 0; r < RW; r++) {
            int64_t j = j0 + w * RW + r;
            if (j >= j1) continue;
            for (int c = 0; c < NC; c++) {
                int d = c * 32 + lane;
                if (d < hd) {
                    dk[(j * Hk + kh) * hd + d] = gk[r][c];
                    dv[(j * Hk + kh) * hd + d] = gv[r][c];
                }
            }
        }
    }
}

// ---- launches ----

static int check_shapes(const char *fn, int n_seqs, int Hq, int Hk, int hd) {
    if (n_seqs < 0 || Hk < 1 || Hq < Hk || Hq % Hk || hd < 1 || Hq > 65535) {
        cuda_ops_fail(MRL_ERR_INVALID, "cuda %s: bad shape (n_seqs=%d Hq=%d Hk=%d hd=%d)", fn, n_seqs, Hq, Hk, hd);
        return 0;
    }
    if (hd > MAX_HD) {
        cuda_ops_fail(MRL_ERR_UNSUPPORTED, "cuda %s: head_dim %d > %d", fn, hd, MAX_HD);
        return 0;
    }
    return n_seqs > 0;
}

// each sequence's first tile, in the scratch
static int32_t *seq_tiles(const int32_t *cu, int n_seqs) {
    int32_t *ft = (int32_t *)cuda_ops_scratch((size_t)(n_seqs + 1) * sizeof(int32_t));
    if (!ft) return NULL;
    seq_tiles_kernel<<<1, SCAN_THREADS, 0, cuda_ops_stream()>>>(ft, cu, n_seqs);
    return ft;
}

template <typename K>
static int launch_prepare(K kernel, size_t smem) {
    if (smem > 48 * 1024 &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) {
        cuda_ops_fail(MRL_ERR_DEVICE, "cuda attention: %zu bytes of shared memory refused", smem);
        return 0;
    }
    return 1;
}

template <int NC>
static void fwd_nc(float *out, float *lse, const float *q, const float *k, const float *v, const int32_t *cu,
                   const int32_t *prefix, const int32_t *ft, int n_seqs, int Hq, int Hk, int hd, float scale) {
    size_t smem = sizeof(float) * (TILE * hd + TILE * (NC * 32 + 1) + TILE * NC * 32);
    if (!launch_prepare(attn_fwd_kernel<NC>, smem)) return;
    dim3 grid(2 * cuda_ops_sm_count(), Hq);
    attn_fwd_kernel<NC><<<grid, WARPS * 32, smem, cuda_ops_stream()>>>(out, lse, q, k, v, cu, prefix, ft, n_seqs, Hq,
                                                                        Hk, hd, scale);
    cuda_ops_launched("attn_fwd");
}

template <int NC>
static void bwd_nc(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                   const float *q, const float *k, const float *v, const int32_t *cu, const int32_t *prefix,
                   const int32_t *ft, int n_seqs, int Hq, int Hk, int hd, float scale) {
    size_t smem = sizeof(float) * (2 * TILE * hd + 2 * TILE * (NC * 32 + 1) + 2 * TILE);
    if (!launch_prepare(attn_dq_kernel<NC>, smem) || !launch_prepare(attn_dkdv_kernel<NC>, smem)) return;
    cudaStream_t st = cuda_ops_stream();
    attn_dq_kernel<NC><<<dim3(2 * cuda_ops_sm_count(), Hq), WARPS * 32, smem, st>>>(
        dq, dout, out, lse, q, k, v, cu, prefix, ft, n_seqs, Hq, Hk, hd, scale);
    attn_dkdv_kernel<NC><<<dim3(2 * cuda_ops_sm_count(), Hk), WARPS * 32, smem, st>>>(
        dk, dv, dout, out, lse, q, k, v, cu, prefix, ft, n_seqs, Hq, Hk, hd, scale);
    cuda_ops_launched("attn_bwd");
}

#define BY_NC(fn, ...)                                              \
    switch ((hd + 31) / 32) {                                       \
    case 1: fn<1>(__VA_ARGS__); break;                              \
    case 2: fn<2>(__VA_ARGS__); break;                              \
    case 3: fn<3>(__VA_ARGS__); break;                              \
    case 4: fn<4>(__VA_ARGS__); break;                              \
    case 5: fn<5>(__VA_ARGS__); break;                              \
    case 6: fn<6>(__VA_ARGS__); break;                              \
    case 7: fn<7>(__VA_ARGS__); break;                              \
    default: fn<8>(__VA_ARGS__); break;                             \
    }

void cuda_attn_fwd(float *out, float *lse, const float *q, const float *k, const float *v, const int32_t *cu,
                   const int32_t *prefix, int n_seqs, int Hq, int Hk, int hd, float scale) {
    if (!check_shapes("attn_fwd", n_seqs, Hq, Hk, hd)) return;
    int32_t *ft = seq_tiles(cu, n_seqs);
    if (!ft) return;
    BY_NC(fwd_nc, out, lse, q, k, v, cu, prefix, ft, n_seqs, Hq, Hk, hd, scale)
}

void cuda_attn_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                   const float *q, const float *k, const float *v, const int32_t *cu, const int32_t *prefix,
                   int n_seqs, int Hq, int Hk, int hd, float scale) {
    if (!check_shapes("attn_bwd", n_seqs, Hq, Hk, hd)) return;
    int32_t *ft = seq_tiles(cu, n_seqs);
    if (!ft) return;
    BY_NC(bwd_nc, dq, dk, dv, dout, out, lse, q, k, v, cu, prefix, ft, n_seqs, Hq, Hk, hd, scale)
}
