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
        const float *qr = qf + th * (dn + dr), *kvr = kv + th * (dn + dv);
        q[e] = j < dn ? qr[j] : j < dn + dr ? rotated(qr + dn, c, s, dr, j - dn, interleave) : 0.0f;
        k[e] = j < dn ? kvr[j] : j < dn + dr ? rotated(kr + t * dr, c, s, dr, j - dn, interleave) : 0.0f;
        v[e] = j < dv ? kvr[dn + j] : 0.0f;
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
