/* MLA's attention inputs and their backward (kernels.h, mla_qkv): copies and RoPE's rotation,
 * token by token. The fast table runs the reference's rows over the threads: each token's
 * outputs are its own, so both give the same bits. The rotation's products and sums are fp32 with
 * no fused multiply-add (rope's arithmetic, and the CUDA table's __fmul_rn). */
#include <string.h>
#include "cpu/mla.h"
#include "base/parallel.h"

#define NO_FMA __attribute__((optimize("fp-contract=off")))

typedef struct mla_args {
    float *o0, *o1, *o2;       /* q, k, v (forward) or dqf, dkv, dkr (backward) */
    const float *i0, *i1, *i2; /* qf, kv, kr or dq, dk, dv */
    const int32_t *pos;
    const float *cos_t, *sin_t;
    int H, dn, dr, dv, hd, interleave;
} mla_args;

/* out [dr] = x [dr] rotated (forward) by the angles of c, s [dr/2]: pair i is (2i, 2i+1) when
 * interleaved, (i, i + dr/2) otherwise; its outputs go to (i, i + dr/2). */
NO_FMA static void rotate(float *out, const float *x, const float *c, const float *s, int dr, int interleave) {
    int half = dr / 2;
    for (int i = 0; i < half; i++) {
        float a = interleave ? x[2 * i] : x[i], b = interleave ? x[2 * i + 1] : x[i + half];
        out[i] = a * c[i] - b * s[i];
        out[i + half] = b * c[i] + a * s[i];
    }
}

/* The transpose: dx [dr] from dout [dr] (rotated back, into the pair's own places); add: dx += */
NO_FMA static void rotate_back(float *dx, const float *d, const float *c, const float *s, int dr, int interleave,
                               int add) {
    int half = dr / 2;
    for (int i = 0; i < half; i++) {
        float a = d[i] * c[i] + d[i + half] * s[i], b = d[i + half] * c[i] - d[i] * s[i];
        float *pa = interleave ? &dx[2 * i] : &dx[i], *pb = interleave ? &dx[2 * i + 1] : &dx[i + half];
        if (add) *pa += a, *pb += b;
        else *pa = a, *pb = b;
    }
}

static void fwd_rows(void *vc, int64_t t0, int64_t t1) {
    const mla_args *a = vc;
    int H = a->H, dn = a->dn, dr = a->dr, dv = a->dv, hd = a->hd, half = dr / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = a->cos_t + (int64_t)a->pos[t] * half, *s = a->sin_t + (int64_t)a->pos[t] * half;
        for (int h = 0; h < H; h++) {
            int64_t th = t * H + h;
            float *q = a->o0 + th * hd, *k = a->o1 + th * hd, *v = a->o2 + th * hd;
            const float *qf = a->i0 + th * (dn + dr), *kv = a->i1 + th * (dn + dv);
            memset(q, 0, sizeof(float) * hd), memset(k, 0, sizeof(float) * hd), memset(v, 0, sizeof(float) * hd);
            memcpy(q, qf, sizeof(float) * dn);
            rotate(q + dn, qf + dn, c, s, dr, a->interleave);
            memcpy(k, kv, sizeof(float) * dn);
            rotate(k + dn, a->i2 + t * dr, c, s, dr, a->interleave);
            memcpy(v, kv + dn, sizeof(float) * dv);
        }
    }
}

static void bwd_rows(void *vc, int64_t t0, int64_t t1) {
    const mla_args *a = vc;
    int H = a->H, dn = a->dn, dr = a->dr, dv = a->dv, hd = a->hd, half = dr / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = a->cos_t + (int64_t)a->pos[t] * half, *s = a->sin_t + (int64_t)a->pos[t] * half;
        float *dkr = a->o2 + t * dr;
        for (int h = 0; h < H; h++) {
            int64_t th = t * H + h;
            const float *dq = a->i0 + th * hd, *dk = a->i1 + th * hd, *dvv = a->i2 + th * hd;
            float *dqf = a->o0 + th * (dn + dr), *dkv = a->o1 + th * (dn + dv);
            memcpy(dqf, dq, sizeof(float) * dn);
            rotate_back(dqf + dn, dq + dn, c, s, dr, a->interleave, 0);
            memcpy(dkv, dk, sizeof(float) * dn);
            memcpy(dkv + dn, dvv, sizeof(float) * dv);
            rotate_back(dkr, dk + dn, c, s, dr, a->interleave, h > 0); /* the heads' sum, head by head */
        }
        if (H == 0) memset(dkr, 0, sizeof(float) * dr);
    }
}

#define FWD_ARGS                                                                                                   \
    mla_args a = {q, k, v, qf, kv, kr, pos, cos_t, sin_t, H, dn, dr, dv, hd, interleave};                         \
    if (T <= 0) return;
#define BWD_ARGS                                                                                                   \
    mla_args a = {dqf, dkv, dkr, dq, dk, dv, pos, cos_t, sin_t, H, dn, dr, dvd, hd, interleave};                  \
    if (T <= 0) return;

void mrl_cpu_ref_mla_qkv(float *q, float *k, float *v, const float *qf, const float *kv, const float *kr,
                         const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr,
                         int dv, int hd, int interleave) {
    FWD_ARGS
    fwd_rows(&a, 0, T);
}

void mrl_cpu_fast_mla_qkv(float *q, float *k, float *v, const float *qf, const float *kv, const float *kr,
                          const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr,
                          int dv, int hd, int interleave) {
    FWD_ARGS
    mrl_parallel_for(T, 16, fwd_rows, &a);
}

void mrl_cpu_ref_mla_qkv_bwd(float *dqf, float *dkv, float *dkr, const float *dq, const float *dk, const float *dv,
                             const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn,
                             int dr, int dvd, int hd, int interleave) {
    BWD_ARGS
    bwd_rows(&a, 0, T);
}

void mrl_cpu_fast_mla_qkv_bwd(float *dqf, float *dkv, float *dkr, const float *dq, const float *dk, const float *dv,
                              const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn,
                              int dr, int dvd, int hd, int interleave) {
    BWD_ARGS
    mrl_parallel_for(T, 16, bwd_rows, &a);
}
