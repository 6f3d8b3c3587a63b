/* The fast inner loops, written once with GCC vector types of VW floats and
 * compiled once per instruction set: isa_avx512.c (VW 16), isa_avx2.c (VW 8),
 * isa_sse.c (VW 4), each under its own `#pragma GCC target`. Before
 * including, define VW and ISA_TABLE (the mrl_cpu_isa to define),
 * ISA_NAME, ISA_LEVEL and ISA_LOOP (the names of this set's conversion
 * loops, written with intrinsics in convert.c).
 * Sums run in VW lanes (fp32), tails in scalar code. */
#include <math.h>
#include <cblas.h>
#include <string.h>
#include <immintrin.h>
#include "isa.h"
#include "kernels.h"

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline vf ld(const float *p) { return *(const vfu *)p; }
static inline void st(float *p, vf v) { *(vfu *)p = v; }
static inline vf splat(float x) {
    vf v = {0};
    return v + x;
}
static inline float hsum(vf v) {
    float s = 0;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}
static inline float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < VW; i++) m = v[i] > m ? v[i] : m;
    return m;
}
/* Lane-wise square root, correctly rounded (IEEE) like sqrtf. */
static inline vf vsqrt(vf x) {
#if VW == 16
    return (vf)_mm512_sqrt_ps((__m512)x);
#elif VW == 8
    return (vf)_mm256_sqrt_ps((__m256)x);
#else
    return (vf)_mm_sqrt_ps((__m128)x);
#endif
}
static inline vf vsel(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf vmax(vf a, vf b) { return vsel(a > b, a, b); }

/* exp(x): x = n ln2 + r, |r| <= ln2/2, e^r by its degree-7 Taylor
 * polynomial (error below 1e-8 relative), 2^n put into the exponent bits.
 * x is clamped to [-87.3, 88.3] (normal results only). */
static inline vf vexp(vf x) {
    x = vmax(x, splat(-87.3f));
    x = vsel(x < splat(88.3f), x, splat(88.3f));
    vf n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    vf r = x - n * 0.693145751953125f - n * 1.428606765330187e-6f;
    vf p = splat(1.0f / 5040);
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

static float dot(const float *a, const float *b, int64_t n) {
    vf acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i + 2 * VW <= n; i += 2 * VW) {
        acc0 += ld(a + i) * ld(b + i);
        acc1 += ld(a + i + VW) * ld(b + i + VW);
    }
    for (; i + VW <= n; i += VW) acc0 += ld(a + i) * ld(b + i);
    float s = hsum(acc0 + acc1);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void rmsnorm_fwd_rows(float *out, float *rstd, const float *x, const float *w, int64_t t0,
                             int64_t t1, int D, float eps) {
    for (int64_t t = t0; t < t1; t++) {
        const float *xr = x + t * D;
        float *o = out + t * D;
        float r = 1.0f / sqrtf(dot(xr, xr, D) / D + eps);
        rstd[t] = r;
        int i = 0;
        for (; i + VW <= D; i += VW) st(o + i, ld(xr + i) * r * ld(w + i));
        for (; i < D; i++) o[i] = xr[i] * r * w[i];
    }
}

static void rmsnorm_bwd_rows(float *dx, float *dw_part, const float *dout, const float *x,
                             const float *w, const float *rstd, int64_t t0, int64_t t1, int D) {
    for (int64_t t = t0; t < t1; t++) {
        const float *xr = x + t * D, *dy = dout + t * D;
        float *d = dx + t * D;
        float r = rstd[t];
        vf acc = {0};
        int i = 0;
        for (; i + VW <= D; i += VW) acc += ld(dy + i) * ld(w + i) * ld(xr + i);
        float s = hsum(acc);
        for (; i < D; i++) s += dy[i] * w[i] * xr[i];
        float c = s * r * r * r / D;
        for (i = 0; i + VW <= D; i += VW) {
            vf xv = ld(xr + i), dyv = ld(dy + i);
            st(d + i, ld(d + i) + r * ld(w + i) * dyv - c * xv);
            st(dw_part + i, ld(dw_part + i) + dyv * xv * r);
        }
        for (; i < D; i++) {
            d[i] += r * w[i] * dy[i] - c * xr[i];
            dw_part[i] += dy[i] * xr[i] * r;
        }
    }
}

static void swiglu_fwd(float *out, const float *gate, const float *up, int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        vf g = ld(gate + i);
        st(out + i, g / (1.0f + vexp(-g)) * ld(up + i));
    }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                       int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        vf g = ld(gate + i), d = ld(dout + i), s = 1.0f / (1.0f + vexp(-g));
        st(dgate + i, d * ld(up + i) * s * (1.0f + g * (1.0f - s)));
        st(dup + i, d * g * s);
    }
    for (; i < n; i++) {
        float g = gate[i], s = 1.0f / (1.0f + expf(-g)), d = dout[i];
        dgate[i] = d * up[i] * s * (1.0f + g * (1.0f - s));
        dup[i] = d * g * s;
    }
}

static void head_fwd_row(const float *z, int V, float inv_temp, int32_t target, float *lse,
                         float *entropy, float *logprob) {
    vf mv = splat(-INFINITY);
    int j = 0;
    for (; j + VW <= V; j += VW) mv = vmax(mv, ld(z + j));
    float m = hmax(mv);
    for (; j < V; j++) m = z[j] > m ? z[j] : m;
    m *= inv_temp;
    vf s0 = {0}, s1 = {0}, sz0 = {0}, sz1 = {0};
    for (j = 0; j + 2 * VW <= V; j += 2 * VW) {
        vf a = ld(z + j) * inv_temp, b = ld(z + j + VW) * inv_temp;
        vf ea = vexp(a - m), eb = vexp(b - m);
        s0 += ea;
        s1 += eb;
        sz0 += ea * a;
        sz1 += eb * b;
    }
    float s = hsum(s0 + s1), sz = hsum(sz0 + sz1);
    for (; j < V; j++) {
        float a = z[j] * inv_temp, e = expf(a - m);
        s += e;
        sz += e * a;
    }
    float l = m + logf(s);
    *lse = l;
    *entropy = l - sz / s;
    *logprob = target >= 0 && target < V ? z[target] * inv_temp - l : 0.0f;
}

static void head_bwd_row(float *z, int V, float inv_temp, int32_t target, float lse, float ent,
                         float glp, float gh) {
    int j = 0;
    for (; j + VW <= V; j += VW) {
        vf lp = ld(z + j) * inv_temp - lse, p = vexp(lp);
        st(z + j, (-glp * p - gh * p * (lp + ent)) * inv_temp);
    }
    for (; j < V; j++) {
        float lp = z[j] * inv_temp - lse, p = expf(lp);
        z[j] = (-glp * p - gh * p * (lp + ent)) * inv_temp;
    }
    if (target >= 0 && target < V) z[target] += glp * inv_temp; /* (>= V: another rank's slice) */
}

/* ---- attention: one sequence of L tokens at a time, in blocks of ATT_QB queries ----
 * The block products (scores, P V, and the five of the backward) are sgemm
 * calls (OpenBLAS runs single-threaded inside our workers, see fast.c); a
 * query block [i0, i0 + nb) only meets keys [0, i0 + nb), so only the
 * diagonal tile is computed past the causal mask. */

/* Causal softmax of one score row in place: p[j] = exp(s[j] - shift) for
 * j <= i (shift = the row max when lse is wanted, else the saved lse),
 * 0 for i < j < n. Returns the sum. */
static float causal_exp_row(float *row, int64_t i, int64_t n, float shift) {
    vf acc = {0};
    int64_t j = 0, valid = i + 1;
    for (; j + VW <= valid; j += VW) {
        vf e = vexp(ld(row + j) - shift);
        st(row + j, e);
        acc += e;
    }
    float s = hsum(acc);
    for (; j < valid; j++) {
        row[j] = expf(row[j] - shift);
        s += row[j];
    }
    for (; j < n; j++) row[j] = 0;
    return s;
}

/* The keys and values of sequence s for KV head kh. Without a prefix they are
 * its own rows, read in place (row stride ks). A sequence that continues a
 * prefix sequence (shared-prompt packing, see mrl_batch.prefix) meets the
 * prefix's rows first, then its own: both are copied into contiguous scratch
 * rows (stride hd) so that the block products stay single sgemm calls. */
typedef struct attn_keys {
    const float *k, *v;
    int64_t ld;  /* row stride of k and v */
    int64_t pre; /* prefix rows in front of the sequence's own (0: none) */
    int64_t n;   /* pre + own rows */
} attn_keys;

static int64_t attn_prefix_rows(const mrl_attn_args *a, int s, int64_t *first_row) {
    if (!a->prefix || a->prefix[s] < 0) return 0;
    int p = a->prefix[s];
    *first_row = a->cu_seqlens[p];
    return a->cu_seqlens[p + 1] - a->cu_seqlens[p];
}

/* rows of hd floats, dst rows dst_ld apart, src rows src_ld apart */
static void copy_rows(float *dst, int64_t dst_ld, const float *src, int64_t src_ld, int64_t rows, int hd) {
    for (int64_t r = 0; r < rows; r++) memcpy(dst + r * dst_ld, src + r * src_ld, sizeof(float) * hd);
}

/* gather: 2 * (pre + L) * hd floats of scratch when the sequence has a prefix */
static attn_keys attn_keys_of(const mrl_attn_args *a, int s, int kh, float *gather) {
    int hd = a->hd;
    int64_t b = a->cu_seqlens[s], L = a->cu_seqlens[s + 1] - b, ks = (int64_t)a->Hk * hd, pb = 0;
    int64_t pre = attn_prefix_rows(a, s, &pb);
    attn_keys r = {a->k + b * ks + (int64_t)kh * hd, a->v + b * ks + (int64_t)kh * hd, ks, pre, pre + L};
    if (pre > 0) {
        float *kc = gather, *vc = gather + r.n * hd;
        copy_rows(kc, hd, a->k + pb * ks + (int64_t)kh * hd, ks, pre, hd);
        copy_rows(kc + pre * hd, hd, r.k, ks, L, hd);
        copy_rows(vc, hd, a->v + pb * ks + (int64_t)kh * hd, ks, pre, hd);
        copy_rows(vc + pre * hd, hd, r.v, ks, L, hd);
        r.k = kc, r.v = vc, r.ld = hd;
    }
    return r;
}

static void attn_fwd_head(const mrl_attn_args *a, int s, int h, float *scratch) {
    int64_t b = a->cu_seqlens[s], L = a->cu_seqlens[s + 1] - b;
    if (L <= 0) return;
    int hd = a->hd, kh = h / (a->Hq / a->Hk);
    int64_t qs = (int64_t)a->Hq * hd, lp = mrl_attn_row_floats(a->max_keys);
    float *S = scratch; /* [ATT_QB, lp] */
    attn_keys K = attn_keys_of(a, s, kh, scratch + ATT_QB * lp);
    int64_t pre = K.pre;
    for (int64_t i0 = 0; i0 < L; i0 += ATT_QB) {
        /* query i of the block sits at key position pre + i0 + r and meets keys 0 .. that */
        int64_t nb = L - i0 < ATT_QB ? L - i0 : ATT_QB, n = pre + i0 + nb;
        const float *qb = a->q + (b + i0) * qs + (int64_t)h * hd;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)nb, (blasint)n, hd, a->scale, qb,
                    (blasint)qs, K.k, (blasint)K.ld, 0.0f, S, (blasint)lp); /* S = scale Q K^T [nb, n] */
        for (int64_t r = 0; r < nb; r++) {
            float *row = S + r * lp, m = -INFINITY;
            int64_t last = pre + i0 + r;
            for (int64_t j = 0; j <= last; j++) m = row[j] > m ? row[j] : m;
            float sum = causal_exp_row(row, last, n, m), inv = 1.0f / sum;
            for (int64_t j = 0; j <= last; j++) row[j] *= inv;
            a->lse[(b + i0 + r) * a->Hq + h] = m + logf(sum);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)nb, hd, (blasint)n, 1.0f, S, (blasint)lp,
                    K.v, (blasint)K.ld, 0.0f, a->out + (b + i0) * qs + (int64_t)h * hd, (blasint)qs); /* O = P V */
    }
}

/* The backward of sequence s for the query heads sharing KV head kh:
 * dQ of its rows (overwritten), dK / dV of its K.n keys added into dk / dv
 * (row stride K.ld, the same layout as K.k: in place, or the scratch rows
 * of a prefixed sequence). P = exp(S - lse); dP = dO V^T;
 * dS = P (dP - rowsum(dO O)) scale; dQ = dS K; dK += dS^T Q; dV += P^T dO. */
static void attn_bwd_seq(const mrl_attn_args *a, int s, int kh, attn_keys K, float *dk, float *dv,
                         float *scratch) {
    int64_t b = a->cu_seqlens[s], L = a->cu_seqlens[s + 1] - b, pre = K.pre;
    int hd = a->hd, group = a->Hq / a->Hk;
    int64_t lp = mrl_attn_row_floats(a->max_keys), qs = (int64_t)a->Hq * hd;
    float *P = scratch, *dS = scratch + ATT_QB * lp; /* [ATT_QB, lp] each */
    for (int h = kh * group; h < (kh + 1) * group; h++)
        for (int64_t i0 = 0; i0 < L; i0 += ATT_QB) {
            int64_t nb = L - i0 < ATT_QB ? L - i0 : ATT_QB, n = pre + i0 + nb, qo = (b + i0) * qs + (int64_t)h * hd;
            const float *qb = a->q + qo, *dob = a->dout + qo, *ob = a->o + qo;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)nb, (blasint)n, hd, a->scale, qb,
                        (blasint)qs, K.k, (blasint)K.ld, 0.0f, P, (blasint)lp);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)nb, (blasint)n, hd, 1.0f, dob,
                        (blasint)qs, K.v, (blasint)K.ld, 0.0f, dS, (blasint)lp); /* dP */
            for (int64_t r = 0; r < nb; r++) {
                float *p = P + r * lp, *ds = dS + r * lp;
                int64_t last = pre + i0 + r;
                causal_exp_row(p, last, n, a->lse_in[(b + i0 + r) * a->Hq + h]);
                float Di = dot(dob + r * qs, ob + r * qs, hd);
                int64_t j = 0, valid = last + 1;
                for (; j + VW <= valid; j += VW) st(ds + j, ld(p + j) * (ld(ds + j) - Di) * a->scale);
                for (; j < valid; j++) ds[j] = p[j] * (ds[j] - Di) * a->scale;
                for (; j < n; j++) ds[j] = 0;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)nb, hd, (blasint)n, 1.0f, dS,
                        (blasint)lp, K.k, (blasint)K.ld, 0.0f, a->dq + qo, (blasint)qs); /* dQ */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (blasint)n, hd, (blasint)nb, 1.0f, dS,
                        (blasint)lp, qb, (blasint)qs, 1.0f, dk, (blasint)K.ld); /* dK */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (blasint)n, hd, (blasint)nb, 1.0f, P,
                        (blasint)lp, dob, (blasint)qs, 1.0f, dv, (blasint)K.ld); /* dV */
        }
}

/* The backward item (s, kh): all query heads sharing KV head kh, so that dk / dv
 * of (s, kh) have one writer. A sequence that continues a prefix is done by
 * its prefix's item (it adds into the prefix's dk / dv), in sequence order,
 * so the sums do not depend on the thread count. */
static void attn_bwd_group(const mrl_attn_args *a, int s, int kh, float *scratch) {
    if (a->prefix && a->prefix[s] >= 0) return;
    int hd = a->hd;
    int64_t b = a->cu_seqlens[s], L = a->cu_seqlens[s + 1] - b, ks = (int64_t)a->Hk * hd;
    int64_t lp = mrl_attn_row_floats(a->max_keys);
    float *dkb = a->dk + b * ks + (int64_t)kh * hd, *dvb = a->dv + b * ks + (int64_t)kh * hd;
    for (int64_t j = 0; j < L; j++) {
        memset(dkb + j * ks, 0, sizeof(float) * hd);
        memset(dvb + j * ks, 0, sizeof(float) * hd);
    }
    if (L > 0) attn_bwd_seq(a, s, kh, attn_keys_of(a, s, kh, NULL), dkb, dvb, scratch);
    if (!a->prefix) return;
    float *gather = scratch + 2 * ATT_QB * lp;
    for (int c = s + 1; c < a->n_seqs; c++) {
        if (a->prefix[c] != s) continue;
        int64_t cb = a->cu_seqlens[c], cl = a->cu_seqlens[c + 1] - cb;
        if (cl <= 0) continue;
        attn_keys K = attn_keys_of(a, c, kh, gather);
        float *dkc = gather + 2 * K.n * hd, *dvc = dkc + K.n * hd; /* [K.n, hd] each */
        memset(dkc, 0, sizeof(float) * 2 * K.n * hd);
        attn_bwd_seq(a, c, kh, K, dkc, dvc, scratch);
        for (int64_t j = 0; j < K.pre; j++) /* the prefix's keys: summed over the sequences */
            for (int e = 0; e < hd; e++) {
                dkb[j * ks + e] += dkc[j * hd + e];
                dvb[j * ks + e] += dvc[j * hd + e];
            }
        copy_rows(a->dk + cb * ks + (int64_t)kh * hd, ks, dkc + K.pre * hd, hd, cl, hd);
        copy_rows(a->dv + cb * ks + (int64_t)kh * hd, ks, dvc + K.pre * hd, hd, cl, hd);
    }
}

/* w[i] = exp(x[i] - m) (0 below -87), their sum in double lanes. */
static double exp_sum(float *w, const float *x, float m, int64_t n) {
    typedef double vd __attribute__((vector_size(VW * 8)));
    vd acc = {0};
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        vf t = ld(x + i) - m;
        vf y = vsel(t >= splat(-87.0f), vexp(t), splat(0));
        st(w + i, y);
        acc += __builtin_convertvector(y, vd);
    }
    double s = 0;
    for (int k = 0; k < VW; k++) s += acc[k];
    for (; i < n; i++) {
        float t = x[i] - m;
        s += (w[i] = t >= -87.0f ? expf(t) : 0.0f);
    }
    return s;
}

/* The sum of v's lanes by halving (log2(VW) vector adds). */
static inline float hsum_tree(vf v) {
    typedef float v4 __attribute__((vector_size(16)));
#if VW == 16
    typedef float v8 __attribute__((vector_size(32)));
    v8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#elif VW == 8
    v4 q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
    v4 q = v;
#endif
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* The lane sums of 4 vectors at once (shared shuffles); the same sums
 * hsum_tree gives. */
static inline void hsum4(const vf *v, float *out) {
#if VW == 16
    vf ab = __builtin_shufflevector(v[0], v[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(v[0], v[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf cd = __builtin_shufflevector(v[2], v[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(v[2], v[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* ab: a's 8 half sums then b's; cd likewise; now 4 quarter sums of each */
    vf q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++) out[j] = (q[4 * j] + q[4 * j + 2]) + (q[4 * j + 1] + q[4 * j + 3]);
#else
    for (int j = 0; j < 4; j++) out[j] = hsum_tree(v[j]);
#endif
}

/* y[t, n] += s * u[t,:] . B[n,:] (r <= 64 terms: LoRA's second product, its rank the short side):
 * blocks of VW outputs n, B's block [VW, r] turned once into r vectors of VW lanes, each used by
 * every row t (a dot product of r terms per output would end in a horizontal sum each). */
static void lora_up(int64_t T, int64_t N, int64_t r, float s, const float *u, const float *B, float *y) {
    float bt[64 * VW];
    int64_t n = 0;
    for (; n + VW <= N; n += VW) {
        for (int64_t j = 0; j < r; j++)
            for (int i = 0; i < VW; i++) bt[j * VW + i] = B[(n + i) * r + j];
        for (int64_t t = 0; t < T; t++) {
            const float *ut = u + t * r;
            vf acc = splat(0);
            for (int64_t j = 0; j < r; j++) acc += splat(ut[j]) * ld(bt + j * VW);
            float *yt = y + t * N + n;
            st(yt, ld(yt) + splat(s) * acc);
        }
    }
    for (; n < N; n++)
        for (int64_t t = 0; t < T; t++) {
            float acc = 0;
            for (int64_t j = 0; j < r; j++) acc += u[t * r + j] * B[n * r + j];
            y[t * N + n] += s * acc;
        }
}

/* C[m, n] = alpha * A[m,:] . B[n,:] (+ beta * C[m, n]; beta 0: C is not read) for m < M, n0 <= n < n1:
 * the product with few rows (decode steps), streaming each row of B once for all M rows of A.
 * Blocks of 4 rows of B x 4 rows of A in 16 vector accumulators. */
static void gemm_nt_rows(int64_t M, int64_t n0, int64_t n1, int64_t K, float alpha, const float *A, int64_t lda,
                         const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    for (int64_t n = n0; n < n1; n += 4) {
        int nn = n1 - n < 4 ? (int)(n1 - n) : 4;
        const float *b[4];
        for (int j = 0; j < 4; j++) b[j] = B + (n + (j < nn ? j : 0)) * ldb;
        for (int64_t m = 0; m < M; m += 4) {
            int mm = M - m < 4 ? (int)(M - m) : 4;
            const float *a[4];
            for (int i = 0; i < 4; i++) a[i] = A + (m + (i < mm ? i : 0)) * lda;
            vf acc[4][4];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = splat(0);
            int64_t k = 0;
            for (; k + VW <= K; k += VW) {
                vf bv[4], av[4];
                for (int j = 0; j < 4; j++) bv[j] = ld(b[j] + k);
                for (int i = 0; i < 4; i++) av[i] = ld(a[i] + k);
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) acc[i][j] += av[i] * bv[j];
            }
            for (int i = 0; i < mm; i++) {
                float sums[4];
                hsum4(acc[i], sums);
                for (int j = 0; j < nn; j++) {
                    float sum = sums[j];
                    for (int64_t t = k; t < K; t++) sum += a[i][t] * b[j][t];
                    float *c = C + (m + i) * ldc + n + j;
                    *c = beta == 0 ? alpha * sum : alpha * sum + beta * *c;
                }
            }
        }
    }
}

/* ---- few rows times weight panels (kernels.h: MRL_PANEL) ----------------------
 * A tile of PMR rows of A and one panel (PNV vectors of columns): each A
 * element is broadcast against the panel's row k, which lies next to row
 * k+1, so the panel is one contiguous stream. PMR * PNV accumulators
 * (12) stay in registers. Each output is one sum in k order: the result
 * does not depend on how the columns are sliced over threads. */
#define PNV (MRL_PANEL / VW)
#define PMR (12 / PNV)

static inline __attribute__((always_inline)) void panel_tile(int mr, int64_t K, float alpha, const float *A,
                                                             int64_t lda, const float *P, float beta, float *C,
                                                             int64_t ldc, int ncols) {
    vf acc[PMR][PNV];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < PNV; j++) acc[i][j] = splat(0);
    for (int64_t k = 0; k < K; k++) {
        vf b[PNV];
        for (int j = 0; j < PNV; j++) b[j] = ld(P + k * MRL_PANEL + j * VW);
        for (int i = 0; i < mr; i++) {
            vf a = splat(A[i * lda + k]);
            for (int j = 0; j < PNV; j++) acc[i][j] += a * b[j];
        }
    }
    for (int i = 0; i < mr; i++) {
        float *c = C + i * ldc;
        if (ncols == MRL_PANEL) {
            for (int j = 0; j < PNV; j++) {
                vf r = acc[i][j] * alpha;
                st(c + j * VW, beta == 0 ? r : r + ld(c + j * VW) * beta);
            }
        } else { /* the last panel: columns past N are not stored */
            float row[MRL_PANEL];
            for (int j = 0; j < PNV; j++) st(row + j * VW, acc[i][j] * alpha);
            for (int j = 0; j < ncols; j++) c[j] = beta == 0 ? row[j] : row[j] + beta * c[j];
        }
    }
}

/* C[m, 32 p0 .. min(32 p1, N)) for m < M from panels p0..p1 of P */
static void gemm_panels(int64_t M, int64_t p0, int64_t p1, int64_t N, int64_t K, float alpha, const float *A,
                        int64_t lda, const float *P, float beta, float *C, int64_t ldc) {
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = P + p * MRL_PANEL * K;
        int64_t n = p * MRL_PANEL;
        int ncols = N - n < MRL_PANEL ? (int)(N - n) : MRL_PANEL;
        int64_t m = 0;
        for (; m + PMR <= M; m += PMR) panel_tile(PMR, K, alpha, A + m * lda, lda, panel, beta, C + m * ldc + n, ldc, ncols);
        switch (M - m) { /* the rows left, one unrolled shape each */
#if PMR > 5
        case 5: panel_tile(5, K, alpha, A + m * lda, lda, panel, beta, C + m * ldc + n, ldc, ncols); break;
        case 4: panel_tile(4, K, alpha, A + m * lda, lda, panel, beta, C + m * ldc + n, ldc, ncols); break;
        case 3: panel_tile(3, K, alpha, A + m * lda, lda, panel, beta, C + m * ldc + n, ldc, ncols); break;
#endif
#if PMR > 2
        case 2: panel_tile(2, K, alpha, A + m * lda, lda, panel, beta, C + m * ldc + n, ldc, ncols); break;
        case 1: panel_tile(1, K, alpha, A + m * lda, lda, panel, beta, C + m * ldc + n, ldc, ncols); break;
#endif
        default: break;
        }
    }
}

/* AdamW (the formula in adamw.c): the scalar loop's fp32 operations in its
 * order, in VW lanes, no fused multiply-add (fp-contract off: GCC would
 * fuse under the AVX2 / AVX-512 targets), so the same bits as the scalar
 * loop. Loads and stores written out: a helper with other optimisation
 * options would not be inlined. */
__attribute__((optimize("fp-contract=off"))) static void adamw(float *p, const float *g, float *m, float *v,
                                                               int64_t n, const mrl_adamw_coeffs *c) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        vf gi = *(const vfu *)(g + i);
        vf pi = *(const vfu *)(p + i) * c->decay;
        vf mi = *(const vfu *)(m + i) * c->beta1 + c->one_minus_beta1 * gi;
        vf vi = *(const vfu *)(v + i) * c->beta2 + c->one_minus_beta2 * gi * gi;
        vf denom = vsqrt(vi) / c->bc2_sqrt + c->eps;
        *(vfu *)(p + i) = pi + c->neg_step * (mi / denom);
        *(vfu *)(m + i) = mi;
        *(vfu *)(v + i) = vi;
    }
    mrl_cpu_adamw_scalar(p + i, g + i, m + i, v + i, n - i, c);
}

const mrl_cpu_isa ISA_TABLE = {
    .name = ISA_NAME,
    .level = ISA_LEVEL,
    .exp_sum = exp_sum,
    .rmsnorm_fwd_rows = rmsnorm_fwd_rows,
    .rmsnorm_bwd_rows = rmsnorm_bwd_rows,
    .swiglu_fwd = swiglu_fwd,
    .swiglu_bwd = swiglu_bwd,
    .head_fwd_row = head_fwd_row,
    .head_bwd_row = head_bwd_row,
    .attn_fwd_head = attn_fwd_head,
    .attn_bwd_group = attn_bwd_group,
    .gemm_nt_rows = gemm_nt_rows,
    .lora_up = lora_up,
    .gemm_panels = gemm_panels,
    .adamw = adamw,
    .bf16_to_f32 = ISA_LOOP(mrl_cpu_bf16_to_f32),
    .f32_to_bf16 = ISA_LOOP(mrl_cpu_f32_to_bf16),
    .f16_to_f32 = ISA_LOOP(mrl_cpu_f16_to_f32),
    .f32_to_f16 = ISA_LOOP(mrl_cpu_f32_to_f16),
    .dequant = ISA_LOOP(mrl_cpu_dequant),
};
