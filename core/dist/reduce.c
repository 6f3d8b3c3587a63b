/* Deterministic reductions: the rank-order combine and the segment
 * pipeline (reduce-scatter by all-to-all-v, combine, all-gather) that
 * mrl_dist_allreduce, mrl_dist_reduce_scatter, mrl_dist_allgather_shards
 * and the gradient buckets share, so that all of them add the same values
 * in the same order and give the same bits. */
#include <stdlib.h>
#include <string.h>
#include "dist_internal.h"
#include "base/error.h"

/* ------------------------------------------------------------- combine */

/* Blocks small enough that the output block stays in cache while every
 * rank's part is added to it. */
enum { BLOCK = 2048 };

/* Integer sums wrap (in unsigned arithmetic: signed overflow is undefined). */
#define ADD_F(a, b) ((a) + (b))
#define ADD_I64(a, b) ((int64_t)((uint64_t)(a) + (uint64_t)(b)))
#define ADD_U8(a, b) ((uint8_t)((a) + (b)))
#define MAX_(a, b) ((b) > (a) ? (b) : (a))
#define MIN_(a, b) ((b) < (a) ? (b) : (a))

/* Part `self` (0 <= self < nparts) is read from out itself, which holds it
 * on entry (the caller's own values, never copied into parts); self < 0:
 * every part is in parts. The additions are the same either way. */
#define COMBINE_LOOP(T, F)                                                   \
    do {                                                                     \
        T *o = out;                                                          \
        const T *p = parts;                                                  \
        T acc[BLOCK];                                                        \
        for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                          \
            int64_t m = b0 + BLOCK < n ? BLOCK : n - b0;                     \
            T *ob = o + b0;                                                  \
            if (self == 0) { /* out already holds part 0: add the rest */    \
                for (int s = 1; s < nparts; s++) {                           \
                    const T *q = p + (int64_t)s * n + b0;                    \
                    for (int64_t i = 0; i < m; i++) ob[i] = F(ob[i], q[i]);  \
                }                                                            \
                continue;                                                    \
            }                                                                \
            /* out's block is read (part self) before it is written */      \
            T *t = self > 0 ? acc : ob;                                      \
            for (int64_t i = 0; i < m; i++) t[i] = p[b0 + i];                \
            for (int s = 1; s < nparts; s++) {                               \
                const T *q = s == self ? ob : p + (int64_t)s * n + b0;       \
                for (int64_t i = 0; i < m; i++) t[i] = F(t[i], q[i]);        \
            }                                                                \
            if (t != ob) memcpy(ob, t, (size_t)m * sizeof(T));               \
        }                                                                    \
    } while (0)

#define COMBINE_TYPE(T, ADD)                                                 \
    do {                                                                     \
        if (op == MRL_DIST_MAX) COMBINE_LOOP(T, MAX_);                       \
        else if (op == MRL_DIST_MIN) COMBINE_LOOP(T, MIN_);                  \
        else COMBINE_LOOP(T, ADD);                                           \
    } while (0)

static void combine(void *out, const void *parts, int64_t n, int nparts, int self, int dtype, int op) {
    if (n <= 0 || nparts <= 0) return;
    switch (dtype) {
    case MRL_DIST_F32:
        COMBINE_TYPE(float, ADD_F);
        if (op == MRL_DIST_MEAN)
            for (int64_t i = 0; i < n; i++) ((float *)out)[i] /= (float)nparts;
        break;
    case MRL_DIST_F64:
        COMBINE_TYPE(double, ADD_F);
        if (op == MRL_DIST_MEAN)
            for (int64_t i = 0; i < n; i++) ((double *)out)[i] /= (double)nparts;
        break;
    case MRL_DIST_I64:
        COMBINE_TYPE(int64_t, ADD_I64);
        if (op == MRL_DIST_MEAN)
            for (int64_t i = 0; i < n; i++) ((int64_t *)out)[i] /= nparts;
        break;
    case MRL_DIST_U8: COMBINE_TYPE(uint8_t, ADD_U8); break; /* MEAN of u8 is refused before */
    }
}

void mrl_dist_combine(void *out, const void *parts, int64_t n, int nparts, int dtype, int op) {
    combine(out, parts, n, nparts, -1, dtype, op);
}

void mrl_dist_combine_self(void *out, const void *parts, int64_t n, int nparts, int self, int dtype, int op) {
    combine(out, parts, n, nparts, self, dtype, op);
}

/* ------------------------------------------------------------ pipeline */

int64_t mrl_dist_max_segment(int size) {
    /* every count, displacement and the scratch span (size pieces of up to a
     * segment each) stay below 2^30 units */
    int64_t len = ((int64_t)1 << 30) / (size > 0 ? size : 1);
    return len < ((int64_t)1 << 26) ? len : ((int64_t)1 << 26);
}

/* [lo, hi) ∩ rank r's shard, as an offset from lo and a length. */
static void piece(int64_t n, int size, int r, int64_t lo, int64_t hi, int64_t *at, int64_t *len) {
    int64_t off, cnt, a;
    mrl_dist_shard(n, size, r, &off, &cnt);
    mrl_dist_meet(off, cnt, lo, hi, &a, len);
    *at = a - lo;
}

mrl_status mrl_dist_pipe_init(mrl_dist_pipe *p, mrl_dist *d, void *comm1, void *comm2, void *buf, int64_t n,
                              int64_t seg_len, int dtype, int op, int gather) {
    memset(p, 0, sizeof *p);
    p->d = d;
    p->comm1 = comm1;
    p->comm2 = comm2;
    p->buf = buf;
    p->dtype = dtype;
    p->op = op;
    p->gather = gather;
    p->esz = mrl_dist_dtype_size(dtype);
    p->n = n;
    int64_t max = mrl_dist_max_segment(d->size);
    if (seg_len < 1) seg_len = 1;
    if (seg_len > max) seg_len = max;
    int64_t nseg = n > 0 ? (n + seg_len - 1) / seg_len : 0;
    if (nseg > (1 << 30)) return mrl_set_error(MRL_ERR_INVALID, "dist: %lld segments of %lld elements: too many",
                                               (long long)nseg, (long long)seg_len);
    p->nseg = (int)nseg;
    if (nseg > 0 && !(p->segs = calloc((size_t)nseg, sizeof *p->segs)))
        return mrl_set_error(MRL_ERR_NOMEM, "dist: out of memory for %lld segments", (long long)nseg);
    int64_t off = 0;
    for (int k = 0; k < p->nseg; k++) {
        mrl_dist_seg *s = &p->segs[k];
        s->hi = n - (int64_t)k * seg_len;
        s->lo = s->hi - seg_len > 0 ? s->hi - seg_len : 0;
        int64_t at;
        piece(n, d->size, d->rank, s->lo, s->hi, &at, &s->mine_n);
        s->mine_lo = s->lo + at;
        s->scratch_off = off;
        off += (int64_t)d->size * s->mine_n;
    }
    p->scratch_bytes = off * p->esz;
    return MRL_OK;
}

void mrl_dist_pipe_free(mrl_dist_pipe *p) {
    free(p->segs);
    p->segs = NULL;
    p->nseg = 0;
}

void mrl_dist_pipe_reset(mrl_dist_pipe *p) {
    for (int k = 0; k < p->nseg; k++) {
        p->segs[k].stage = SEG_IDLE;
        p->segs[k].req = NULL;
    }
    p->started = p->gathered = p->first_busy = 0;
}

mrl_status mrl_dist_pipe_start(mrl_dist_pipe *p) {
    mrl_dist *d = p->d;
    if (p->started >= p->nseg) return MRL_OK;
    mrl_dist_seg *s = &p->segs[p->started++];
    if (d->size == 1 || !d->be) { /* one rank: its values are the sum */
        s->stage = SEG_SUMMED;
        return MRL_OK;
    }
    int64_t *sc = d->tmp, *sd = sc + d->size, *rc = sd + d->size, *rd = rc + d->size;
    for (int r = 0; r < d->size; r++) {
        piece(p->n, d->size, r, s->lo, s->hi, &sd[r], &sc[r]);
        rc[r] = s->mine_n;
        rd[r] = (int64_t)r * s->mine_n;
    }
    /* this rank's own piece stays where it is: the combine reads it from the buffer */
    sc[d->rank] = rc[d->rank] = 0;
    int e = d->be->ialltoallv(p->comm1, p->buf + s->lo * p->esz, sc, sd, p->scratch + s->scratch_off * p->esz, rc,
                              rd, p->esz, &s->req);
    if (e) return mrl_dist_fail(d, e, "the all-to-all of a reduce-scatter");
    s->stage = SEG_SCATTER;
    return MRL_OK;
}

static mrl_status start_gather(mrl_dist_pipe *p, mrl_dist_seg *s) {
    mrl_dist *d = p->d;
    if (d->size == 1 || !d->be) {
        s->stage = SEG_DONE;
        return MRL_OK;
    }
    int64_t *rc = d->tmp, *rd = rc + d->size;
    for (int r = 0; r < d->size; r++) piece(p->n, d->size, r, s->lo, s->hi, &rd[r], &rc[r]);
    int e = d->be->iallgatherv(p->comm2, NULL, s->mine_n, p->buf + s->lo * p->esz, rc, rd, p->esz, &s->req);
    if (e) return mrl_dist_fail(d, e, "the all-gather of the shards");
    s->stage = SEG_GATHER;
    return MRL_OK;
}

mrl_status mrl_dist_pipe_progress(void *pipe, int *done) {
    mrl_dist_pipe *p = pipe;
    mrl_dist *d = p->d;
    *done = 0;
    for (int k = p->first_busy; k < p->started; k++) {
        mrl_dist_seg *s = &p->segs[k];
        if (s->stage != SEG_SCATTER && s->stage != SEG_GATHER) continue;
        int fin = 0;
        int e = d->be->test(s->req, &fin);
        if (e) return mrl_dist_fail(d, e, s->stage == SEG_SCATTER ? "the all-to-all of a reduce-scatter"
                                                                  : "the all-gather of the shards");
        if (!fin) continue;
        s->req = NULL;
        if (s->stage == SEG_SCATTER) {
            /* every rank's piece of my shard is in: add them up in rank order */
            mrl_dist_combine_self(p->buf + s->mine_lo * p->esz, p->scratch + s->scratch_off * p->esz, s->mine_n,
                                  d->size, d->rank, p->dtype, p->op);
            s->stage = SEG_SUMMED;
        } else {
            s->stage = SEG_DONE;
        }
    }
    /* stage 2 in segment order, whatever order stage 1 completed in */
    while (p->gathered < p->started && p->segs[p->gathered].stage == SEG_SUMMED) {
        mrl_dist_seg *s = &p->segs[p->gathered++];
        if (!p->gather) {
            s->stage = SEG_DONE;
            continue;
        }
        mrl_status st = start_gather(p, s);
        if (st) return st;
    }
    while (p->first_busy < p->nseg && p->segs[p->first_busy].stage == SEG_DONE) p->first_busy++;
    *done = p->first_busy == p->nseg;
    return MRL_OK;
}
