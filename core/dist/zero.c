/* Sharded training state (moonrl/dist.h): gradients reduce-scattered into
 * each rank's shard (ZeRO-2 and 3), parameters gathered into place (ZeRO-3).
 *
 * Gradients. The model has no gradient buffer: each part of the backward (the head,
 * each layer, the embedding) writes into a window of its own range, lent by
 * acquire; once the range is final (the model's grad hook) the window's
 * values are reduce-scattered: each segment of the range is an all-to-all-v
 * that brings every other rank's values of (segment ∩ my shard) into a
 * scratch slot, combined in rank order (mrl_dist_combine_self, the sums of
 * mrl_dist_allreduce bit for bit) and added to this rank's accumulator. A
 * window goes back to the pool once all its segments are in.
 *
 * Memory: the shard accumulator, the windows of the ranges in flight (the
 * pool keeps them for the next backward) and `depth` scratch slots of
 * size * segment floats; segments wait for a free slot, so the scratch
 * stays bounded however large a range is (an embedding of 150k rows).
 *
 * Order: segments start in the order the ranges became final, the same on
 * every rank (the backward's order); each element is added to the
 * accumulator once per backward, and finish waits for every segment, so
 * the accumulation's order is the micro-batches' order.
 *
 * A GPU model's backward (mrl_dist_grad_shard_set_device) writes into
 * windows in the GPU's memory: each is copied to a host mirror as its range
 * becomes final and goes on from there as above (the communicator's
 * buffers are host memory), and finish copies the accumulator to the GPU,
 * where the optimizer reads it. With an NCCL communicator between the GPUs
 * (mrl_dist_grad_shard_set_nccl) a final range is reduce-scattered there
 * instead, at once (one group of NCCL reduces, one a rank's piece: NCCL's
 * sums, not in rank order), and added to the accumulator on the GPU. */
#include <stdlib.h>
#include <string.h>
#include "dist_internal.h"
#include "base/error.h"
#include "moonrl/mem.h"
#include "runtime/device_internal.h"
#include "moonrl/dist_nccl.h"

enum {
    DEPTH = 2,  /* scratch slots: segments in flight at once */
    PENDING = 2 /* ranges final and not yet all added: a new window waits for fewer (FSDP's
                 * rate limit), so that a rank ahead of the others does not lend a window
                 * for every range of the model */
};

typedef struct window {
    float *buf;           /* the values (a GPU window's host mirror) */
    mrl_buffer dev;       /* a GPU window: what the backward writes */
    int64_t cap;          /* floats */
    int64_t lo, hi;       /* the range it holds while lent */
    int64_t segs_left;    /* segments of its range not yet added (-1: being written) */
    int lent;
} window;

typedef struct slot {
    void *req;
    float *scratch; /* size * scratch_n floats */
    int64_t scratch_n;
    window *w;
    int64_t mine_lo, mine_n; /* the segment ∩ my shard */
    int busy;
} slot;

struct mrl_dist_grad_shard {
    mrl_dist_member m; /* d, the communicator of its own, d's list */
    int64_t n, off, count, seg;
    int shards; /* the gradient's pieces: rank r owns piece r % shards (mrl_dist_group_shard) */
    float *acc; /* [count]: this rank's shard of the gradient sum */
    mrl_device device; /* where the windows are */
    mrl_buffer dev_acc; /* a GPU's: acc's copy there, made by finish (with NCCL: the accumulator) */
    mrl_nccl *nc;       /* the GPUs' communicator, when the sums go through NCCL */
    mrl_buffer dev_scratch; /* NCCL: this rank's piece of a range's sum */
    window *wins;
    int n_wins, cap_wins;
    /* the queue of segments to start: windows in the order they became final, each cut into
     * segments [lo + k*seg, ...) */
    window **queue;
    int q_head, q_len, q_cap;
    int64_t q_next; /* where the head window's next segment begins */
    slot slots[DEPTH];
    mrl_status failed; /* a failure inside a hook (which cannot return one): finish reports it */
    int64_t window_bytes, window_peak;
    int64_t sent; /* bytes this rank's all-to-alls sent the others, since creation */
};

static int slots_busy(const mrl_dist_grad_shard *g) {
    int busy = 0;
    for (int i = 0; i < DEPTH; i++) busy |= g->slots[i].busy;
    return busy;
}

/* [lo, hi) ∩ rank r's shard: start and length (0 when they do not meet). */
static void meet(const mrl_dist_grad_shard *g, int r, int64_t lo, int64_t hi, int64_t *at, int64_t *len) {
    int64_t off, cnt;
    mrl_dist_group_shard(g->n, g->m.d->size, g->shards, r % g->shards, &off, &cnt);
    mrl_dist_meet(off, cnt, lo, hi, at, len);
}

mrl_status mrl_dist_grad_shard_create(mrl_dist *d, int64_t n, int64_t segment_bytes, int shards,
                                      mrl_dist_grad_shard **out) {
    *out = NULL;
    if (shards < 1 || shards > d->size || d->size % shards)
        return mrl_set_error(MRL_ERR_INVALID, "dist: sharded gradients: %d shards over %d ranks (a divisor of them)",
                             shards, d->size);
    if (n <= 0 || n < d->size)
        return mrl_set_error(MRL_ERR_INVALID, "dist: sharded gradients: %lld parameters over %d ranks", (long long)n,
                             d->size);
    /* a slot's scratch (every rank's piece of a segment) is then about segment_bytes */
    int64_t seg = segment_bytes / (int64_t)sizeof(float) / d->size, max = mrl_dist_max_segment(d->size);
    if (seg < 1) return mrl_set_error(MRL_ERR_INVALID, "dist: sharded gradients: segment of %lld bytes", (long long)segment_bytes);
    if (seg > max) seg = max;
    mrl_status st = mrl_dist_begin(d, "grad_shard_create");
    if (st) return st;
    mrl_dist_grad_shard *g = calloc(1, sizeof *g);
    if (!g) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    g->n = n;
    g->seg = seg;
    g->shards = shards;
    mrl_dist_group_shard(n, d->size, shards, d->rank % shards, &g->off, &g->count);
    g->acc = mrl_mem_alloc(sizeof(float) * (size_t)g->count, MRL_MEM_GRADS);
    if (!g->acc) {
        int64_t count = g->count;
        free(g);
        return mrl_wrap_error(MRL_ERR_NOMEM, "dist: no memory for this rank's %lld gradients", (long long)count);
    }
    if ((st = mrl_dist_member_join(d, &g->m))) {
        mrl_mem_free(g->acc);
        free(g);
        return st;
    }
    *out = g;
    return MRL_OK;
}

static void drop_window(window *w) {
    mrl_mem_free(w->buf);
    mrl_buffer_free(&w->dev);
}

/* what a window of cap floats holds: on a GPU, there and its host mirror (none with NCCL) */
static int64_t window_size(const mrl_dist_grad_shard *g, int64_t cap) {
    return (int64_t)sizeof(float) * cap * (g->device.kind == MRL_DEVICE_CPU || g->nc ? 1 : 2);
}

mrl_status mrl_dist_grad_shard_set_device(mrl_dist_grad_shard *g, mrl_device device) {
    if (!g) return mrl_set_error(MRL_ERR_INVALID, "mrl_dist_grad_shard_set_device: NULL shard");
    if (g->n_wins) return mrl_set_error(MRL_ERR_INVALID, "mrl_dist_grad_shard_set_device: after the first window");
    if (device.kind == MRL_DEVICE_CPU) return MRL_OK;
    mrl_status st = mrl_buffer_alloc(device, sizeof(float) * (size_t)g->count, MRL_MEM_GRADS, &g->dev_acc);
    if (st) return mrl_wrap_error(st, "dist: this rank's %lld gradients on %s", (long long)g->count, "the GPU");
    g->device = device;
    return MRL_OK;
}

mrl_status mrl_dist_grad_shard_set_nccl(mrl_dist_grad_shard *g, mrl_nccl *nc) {
    if (!g || !nc) return mrl_set_error(MRL_ERR_INVALID, "mrl_dist_grad_shard_set_nccl: NULL argument");
    if (!g->dev_acc.data)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_dist_grad_shard_set_nccl: the windows are not on a GPU");
    if (g->n_wins) return mrl_set_error(MRL_ERR_INVALID, "mrl_dist_grad_shard_set_nccl: after the first window");
    if (mrl_nccl_size(nc) != g->m.d->size || mrl_nccl_rank(nc) != g->m.d->rank || g->shards != g->m.d->size)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_dist_grad_shard_set_nccl: the communicator is not the shards' "
                             "(rank %d of %d, %d shards)", mrl_nccl_rank(nc), mrl_nccl_size(nc), g->shards);
    g->nc = nc;
    return MRL_OK;
}

/* NCCL: window w's range summed over the ranks at once, this rank's piece added on the GPU. */
static mrl_status nccl_range(mrl_dist_grad_shard *g, window *w) {
    mrl_dist *d = g->m.d;
    int64_t *offset = d->tmp, *count = offset + d->size, at, mine_lo, mine_n;
    for (int r = 0; r < d->size; r++) {
        meet(g, r, w->lo, w->hi, &at, &count[r]);
        offset[r] = count[r] ? at - w->lo : 0;
        if (r != d->rank) g->sent += (int64_t)sizeof(float) * count[r];
    }
    meet(g, d->rank, w->lo, w->hi, &mine_lo, &mine_n);
    if ((int64_t)g->dev_scratch.bytes < (int64_t)sizeof(float) * mine_n) {
        mrl_buffer_free(&g->dev_scratch);
        if (mrl_buffer_alloc(g->device, sizeof(float) * (size_t)mine_n, MRL_MEM_GRADS, &g->dev_scratch))
            return mrl_wrap_error(MRL_ERR_NOMEM, "dist: no GPU memory for %lld floats of reduce-scatter scratch",
                                  (long long)mine_n);
    }
    mrl_status st = mrl_nccl_reduce_scatter_pieces(g->nc, w->dev.data, g->dev_scratch.data, offset, count, MRL_DIST_F32,
                                                   MRL_DIST_SUM);
    if (st) return st;
    if (mine_n > 0) mrl_kernels_for(g->device)->add((float *)g->dev_acc.data + (mine_lo - g->off), g->dev_scratch.data, mine_n);
    return MRL_OK;
}

void mrl_dist_grad_shard_free(mrl_dist_grad_shard *g) {
    if (!g) return;
    /* a round that never finished (a timeout: the process is ending) keeps what MPI may still write */
    int busy = slots_busy(g);
    mrl_dist_member_leave(&g->m, busy);
    if (!busy) {
        for (int i = 0; i < DEPTH; i++) mrl_mem_free(g->slots[i].scratch);
        for (int i = 0; i < g->n_wins; i++) drop_window(&g->wins[i]);
    }
    free(g->wins);
    free(g->queue);
    mrl_mem_free(g->acc);
    mrl_buffer_free(&g->dev_acc);
    mrl_buffer_free(&g->dev_scratch);
    free(g);
}

float *mrl_dist_grad_shard_grads(mrl_dist_grad_shard *g) { return g->dev_acc.data ? g->dev_acc.data : g->acc; }
int64_t mrl_dist_grad_shard_window_bytes(const mrl_dist_grad_shard *g) { return g->window_bytes; }
int64_t mrl_dist_grad_shard_window_peak(const mrl_dist_grad_shard *g) { return g->window_peak; }
int64_t mrl_dist_grad_shard_bytes_sent(const mrl_dist_grad_shard *g) { return g->sent; }

void mrl_dist_grad_shard_trim(mrl_dist_grad_shard *g) {
    if (slots_busy(g) || g->q_len) return; /* (only between rounds) */
    int kept = 0;
    for (int i = 0; i < g->n_wins; i++) {
        if (g->wins[i].lent) {
            g->wins[kept++] = g->wins[i];
            continue;
        }
        g->window_bytes -= window_size(g, g->wins[i].cap);
        drop_window(&g->wins[i]);
    }
    g->n_wins = kept;
    for (int i = 0; i < DEPTH; i++) {
        mrl_mem_free(g->slots[i].scratch);
        g->slots[i].scratch = NULL;
        g->slots[i].scratch_n = 0;
    }
}

void mrl_dist_grad_shard_zero(mrl_dist_grad_shard *g) {
    memset(g->acc, 0, sizeof(float) * (size_t)g->count);
    if (g->dev_acc.data) mrl_buffer_fill_zero(&g->dev_acc, NULL); /* (queued: fails only with the GPU, seen next) */
}

static void fail(mrl_dist_grad_shard *g, mrl_status st) {
    if (!g->failed) g->failed = st;
}

/* A segment whose all-to-all finished: the ranks' values in rank order, then into acc. */
static void add_segment(mrl_dist_grad_shard *g, slot *s) {
    window *w = s->w;
    if (s->mine_n > 0) {
        float *mine = w->buf + (s->mine_lo - w->lo);
        if (g->m.d->size > 1)
            mrl_dist_combine_self(mine, s->scratch, s->mine_n, g->m.d->size, g->m.d->rank, MRL_DIST_F32, MRL_DIST_SUM);
        float *acc = g->acc + (s->mine_lo - g->off);
        for (int64_t i = 0; i < s->mine_n; i++) acc[i] += mine[i];
    }
    s->busy = 0;
    s->w = NULL;
    if (--w->segs_left == 0) w->lent = 0; /* back to the pool */
}

/* Start the queue's next segment in slot s. */
static mrl_status start_segment(mrl_dist_grad_shard *g, slot *s) {
    mrl_dist *d = g->m.d;
    window *w = g->queue[g->q_head];
    int64_t lo = g->q_next, hi = lo + g->seg < w->hi ? lo + g->seg : w->hi;
    g->q_next = hi;
    if (hi == w->hi) { /* the window's last segment: the next one's first comes next */
        g->q_head = (g->q_head + 1) % g->q_cap;
        g->q_len--;
        if (g->q_len > 0) g->q_next = g->queue[g->q_head]->lo;
    }
    s->w = w;
    s->busy = 1;
    meet(g, d->rank, lo, hi, &s->mine_lo, &s->mine_n);
    if (d->size == 1) {
        add_segment(g, s);
        return MRL_OK;
    }
    if (s->scratch_n < s->mine_n) { /* grown to what the segments need: at most a whole one, or the shard */
        mrl_mem_free(s->scratch);
        s->scratch_n = 0;
        if (!(s->scratch = mrl_mem_alloc(sizeof(float) * (size_t)(d->size * s->mine_n), MRL_MEM_GRADS)))
            return mrl_wrap_error(MRL_ERR_NOMEM, "dist: no memory for %lld floats of reduce-scatter scratch",
                                  (long long)(d->size * s->mine_n));
        s->scratch_n = s->mine_n;
    }
    int64_t *sc = d->tmp, *sd = sc + d->size, *rc = sd + d->size, *rd = rc + d->size;
    for (int r = 0; r < d->size; r++) {
        int64_t at;
        meet(g, r, lo, hi, &at, &sc[r]);
        sd[r] = at - w->lo; /* in the window */
        rc[r] = s->mine_n;
        rd[r] = (int64_t)r * s->mine_n;
    }
    sc[d->rank] = rc[d->rank] = 0; /* this rank's own values stay in the window: the combine reads them there */
    for (int r = 0; r < d->size; r++) g->sent += (int64_t)sizeof(float) * sc[r];
    int e = d->be->ialltoallv(g->m.comm, w->buf, sc, sd, s->scratch, rc, rd, sizeof(float), &s->req);
    if (e) return mrl_dist_fail(d, e, "the all-to-all of a gradient reduce-scatter");
    return MRL_OK;
}

/* Test what is in flight, add what finished, start queued segments in free slots. */
static mrl_status progress(void *ctx, int *done) {
    mrl_dist_grad_shard *g = ctx;
    mrl_dist *d = g->m.d;
    *done = 0;
    for (int i = 0; i < DEPTH; i++) {
        slot *s = &g->slots[i];
        if (!s->busy || d->size == 1) continue;
        int fin = 0;
        int e = d->be->test(s->req, &fin);
        if (e) return mrl_dist_fail(d, e, "the all-to-all of a gradient reduce-scatter");
        if (!fin) continue;
        s->req = NULL;
        add_segment(g, s);
    }
    for (int i = 0; i < DEPTH && g->q_len > 0; i++) {
        slot *s = &g->slots[i];
        if (s->busy) continue;
        mrl_status st = start_segment(g, s);
        if (st) return st;
    }
    *done = !slots_busy(g) && g->q_len == 0;
    return MRL_OK;
}

static mrl_status few_pending(void *ctx, int *done) {
    mrl_dist_grad_shard *g = ctx;
    int ignore;
    mrl_status st = progress(g, &ignore);
    int pending = 0;
    for (int i = 0; i < g->n_wins; i++) pending += g->wins[i].lent && g->wins[i].segs_left > 0;
    *done = pending < PENDING;
    return st;
}

float *mrl_dist_grad_shard_acquire(void *vg, int64_t offset, int64_t count) {
    mrl_dist_grad_shard *g = vg;
    if (!g->m.d) {
        mrl_set_error(MRL_ERR_INVALID, "dist: a gradient window after mrl_dist_finalize");
        return NULL;
    }
    if (offset < 0 || count <= 0 || offset + count > g->n) {
        mrl_set_error(MRL_ERR_INVALID, "dist: gradient window [%lld, %lld) outside the %lld parameters",
                      (long long)offset, (long long)(offset + count), (long long)g->n);
        return NULL;
    }
    if (!g->failed && !g->m.d->broken) { /* windows coming back; at most PENDING ranges waiting */
        mrl_status st = mrl_dist_begin(g->m.d, "grad_shard_window");
        if (!st) st = mrl_dist_wait(g->m.d, few_pending, g);
        if (st) { /* (the error is set: the backward fails with it) */
            fail(g, st);
            return NULL;
        }
    }
    window *best = NULL;
    for (int i = 0; i < g->n_wins; i++) {
        window *w = &g->wins[i];
        if (!w->lent && w->cap >= count && (!best || w->cap < best->cap)) best = w;
    }
    if (!best) {
        if (g->n_wins == g->cap_wins) {
            int cap = g->cap_wins ? 2 * g->cap_wins : 8;
            window *nw = realloc(g->wins, (size_t)cap * sizeof *nw);
            if (!nw) {
                mrl_set_error(MRL_ERR_NOMEM, "out of memory");
                return NULL;
            }
            /* the queue points at windows: move its pointers with them */
            for (int i = 0; i < g->q_len; i++) {
                int q = (g->q_head + i) % g->q_cap;
                g->queue[q] = nw + (g->queue[q] - g->wins);
            }
            for (int i = 0; i < DEPTH; i++)
                if (g->slots[i].w) g->slots[i].w = nw + (g->slots[i].w - g->wins);
            g->wins = nw;
            g->cap_wins = cap;
        }
        window nw0 = {.cap = count};
        if (!g->nc && !(nw0.buf = mrl_mem_alloc(sizeof(float) * (size_t)count, MRL_MEM_GRADS)))
            return NULL; /* (the error is set) */
        if (g->device.kind != MRL_DEVICE_CPU && /* zeroed */
            mrl_buffer_alloc(g->device, sizeof(float) * (size_t)count, MRL_MEM_GRADS, &nw0.dev)) {
            mrl_mem_free(nw0.buf);
            mrl_set_error(MRL_ERR_NOMEM, "dist: no GPU memory for a gradient window of %lld floats", (long long)count);
            return NULL;
        }
        best = &g->wins[g->n_wins++];
        *best = nw0;
        g->window_bytes += window_size(g, count);
        if (g->window_bytes > g->window_peak) g->window_peak = g->window_bytes;
    } else if (best->dev.data) {
        if (mrl_buffer_fill_zero(&best->dev, NULL)) return NULL;
    } else {
        memset(best->buf, 0, sizeof(float) * (size_t)count);
    }
    best->lent = 1;
    best->lo = offset;
    best->hi = offset + count;
    best->segs_left = -1;
    return best->dev.data ? best->dev.data : best->buf;
}

void mrl_dist_grad_shard_ready(void *vg, int64_t offset, int64_t count) {
    mrl_dist_grad_shard *g = vg;
    if (!g->m.d) return; /* (acquire failed already) */
    window *w = NULL;
    for (int i = 0; i < g->n_wins; i++)
        if (g->wins[i].lent && g->wins[i].segs_left < 0 && g->wins[i].lo == offset && g->wins[i].hi == offset + count)
            w = &g->wins[i];
    if (!w) {
        fail(g, mrl_set_error(MRL_ERR_INVALID, "dist: gradient range [%lld, %lld) final but never lent",
                              (long long)offset, (long long)(offset + count)));
        return;
    }
    if (g->nc) { /* through NCCL, now: the window is back in the pool */
        mrl_status nst = g->failed || g->m.d->broken ? MRL_OK : nccl_range(g, w);
        w->lent = 0;
        w->segs_left = 0;
        if (nst) fail(g, mrl_wrap_error(nst, "dist: gradient range [%lld, %lld) reduce-scattered by NCCL",
                                        (long long)offset, (long long)(offset + count)));
        return;
    }
    w->segs_left = (count + g->seg - 1) / g->seg;
    mrl_status cst; /* a GPU window: its values over to the mirror (after the backward's kernels) */
    if (w->dev.data && (cst = mrl_device_memcpy(w->buf, w->dev.data, sizeof(float) * (size_t)count))) {
        w->lent = 0;
        fail(g, mrl_wrap_error(cst, "dist: gradient range [%lld, %lld) from the GPU", (long long)offset,
                               (long long)(offset + count)));
        return;
    }
    if (g->q_len == g->q_cap) {
        int cap = g->q_cap ? 2 * g->q_cap : 16;
        window **q = malloc((size_t)cap * sizeof *q);
        if (!q) {
            fail(g, mrl_set_error(MRL_ERR_NOMEM, "out of memory"));
            return;
        }
        for (int i = 0; i < g->q_len; i++) q[i] = g->queue[(g->q_head + i) % (g->q_cap ? g->q_cap : 1)];
        free(g->queue);
        g->queue = q;
        g->q_head = 0;
        g->q_cap = cap;
    }
    if (g->q_len == 0) g->q_next = w->lo;
    g->queue[(g->q_head + g->q_len) % g->q_cap] = w;
    g->q_len++;
    if (g->failed || g->m.d->broken) return;
    int done;
    mrl_status st = progress(g, &done);
    if (st) fail(g, st);
}

mrl_status mrl_dist_grad_shard_finish(mrl_dist_grad_shard *g) {
    if (!g->m.d) return mrl_set_error(MRL_ERR_INVALID, "dist: grad_shard_finish after mrl_dist_finalize");
    mrl_status st = g->failed;
    g->failed = MRL_OK;
    if (!st) st = mrl_dist_begin(g->m.d, "grad_shard_finish");
    if (!st) st = mrl_dist_wait(g->m.d, progress, g);
    for (int i = 0; i < g->n_wins; i++)
        if (g->wins[i].lent && g->wins[i].segs_left < 0 && !st) /* lent and never final: a backward cut short */
            st = mrl_set_error(MRL_ERR_INVALID, "dist: gradient window [%lld, %lld) lent and never final",
                               (long long)g->wins[i].lo, (long long)g->wins[i].hi);
    if (st) { /* the round is lost: the next starts clean (the caller fails the step) */
        if (!slots_busy(g)) {
            for (int i = 0; i < g->n_wins; i++) g->wins[i].lent = 0;
            g->q_len = 0;
        }
        return st;
    }
    if (g->dev_acc.data && !g->nc &&
        (st = mrl_device_memcpy(g->dev_acc.data, g->acc, sizeof(float) * (size_t)g->count)))
        return mrl_wrap_error(st, "dist: this rank's gradients to the GPU");
    return MRL_OK;
}

/* ---- Parameters gathered into place (ZeRO-3) ---------------------------
 * A range [lo, hi) of the parameter buffer is all-gathered in place: each
 * rank's piece of it (its shard ∩ the range) is already where it belongs,
 * and an all-gather-v of each segment of the range brings the others'. A
 * few ranges may be in flight (the next layer's while this one computes). */

enum { GATHERS = 4 };

typedef struct gather {
    int64_t lo, hi;
    void **reqs;
    int nreq, busy;
    float *dev;     /* a GPU's parameters: the range lands in stage, then goes there */
    float *stage;   /* host memory, stage_n floats */
    int64_t stage_n;
} gather;

struct mrl_dist_param_gather {
    mrl_dist_member m; /* d (the world, or a shard group), the communicator of its own, d's list */
    mrl_nccl *nc;      /* a GPU's parts gathered by NCCL (mrl_dist_param_gather_set_nccl) */
    int64_t n;
    int world; /* rank r of d holds mrl_dist_group_shard(n, world, d->size, r) */
    int64_t received; /* bytes of the others' shards gathered into place, since creation */
    gather g[GATHERS];
};

mrl_status mrl_dist_param_gather_create(mrl_dist *d, int64_t n, int world, mrl_dist_param_gather **out) {
    *out = NULL;
    if (world < d->size || world % d->size)
        return mrl_set_error(MRL_ERR_INVALID, "dist: sharded parameters: %d ranks in a world of %d", d->size, world);
    if (n <= 0 || n < d->size)
        return mrl_set_error(MRL_ERR_INVALID, "dist: sharded parameters: %lld over %d ranks", (long long)n, d->size);
    mrl_status st = mrl_dist_begin(d, "param_gather_create");
    if (st) return st;
    mrl_dist_param_gather *p = calloc(1, sizeof *p);
    if (!p) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    p->n = n;
    p->world = world;
    if ((st = mrl_dist_member_join(d, &p->m))) {
        free(p);
        return st;
    }
    *out = p;
    return MRL_OK;
}

void mrl_dist_param_gather_free(mrl_dist_param_gather *p) {
    if (!p) return;
    int busy = 0;
    for (int i = 0; i < GATHERS; i++) busy |= p->g[i].busy;
    mrl_dist_member_leave(&p->m, busy);
    for (int i = 0; i < GATHERS; i++) {
        free(p->g[i].reqs);
        if (!busy) mrl_mem_free(p->g[i].stage);
    }
    free(p);
}

mrl_status mrl_dist_param_gather_start(void *vp, float *params, int64_t offset, int64_t count) {
    mrl_dist_param_gather *p = vp;
    mrl_dist *d = p->m.d;
    if (!d) return mrl_set_error(MRL_ERR_INVALID, "dist: a parameter gather after mrl_dist_finalize");
    if (offset < 0 || count <= 0 || offset + count > p->n)
        return mrl_set_error(MRL_ERR_INVALID, "dist: parameter gather [%lld, %lld) outside the %lld parameters",
                             (long long)offset, (long long)(offset + count), (long long)p->n);
    gather *g = NULL;
    for (int i = 0; i < GATHERS && !g; i++)
        if (!p->g[i].busy) g = &p->g[i];
    if (!g) return mrl_set_error(MRL_ERR_INVALID, "dist: more than %d parameter gathers in flight", GATHERS);
    mrl_status st = mrl_dist_begin(d, "param_gather");
    if (st) return st;
    int64_t seg = mrl_dist_max_segment(d->size), nseg = (count + seg - 1) / seg;
    void **reqs = realloc(g->reqs, sizeof(void *) * (size_t)nseg);
    if (!reqs) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    g->reqs = reqs;
    g->lo = offset;
    g->hi = offset + count;
    g->nreq = 0;
    g->dev = NULL;
    if (d->size == 1) {
        g->busy = 1;
        return MRL_OK;
    }
    int on_gpu = mrl_device_of(params).kind != MRL_DEVICE_CPU;
    if (p->nc && on_gpu) { /* a GPU's, by NCCL: done when it returns */
        int64_t *off = d->tmp, *bytes = off + d->size;
        for (int r = 0; r < d->size; r++) {
            int64_t o, c, at;
            mrl_dist_group_shard(p->n, p->world, d->size, r, &o, &c);
            mrl_dist_meet(o, c, offset, offset + count, &at, &bytes[r]);
            off[r] = (int64_t)sizeof(float) * (bytes[r] ? at : 0), bytes[r] *= (int64_t)sizeof(float);
            if (r != d->rank) p->received += bytes[r];
        }
        if ((st = mrl_nccl_allgather_pieces(p->nc, params, off, bytes))) return st;
        g->busy = 1;
        return MRL_OK;
    }
    if (on_gpu) { /* a GPU's: through host memory, this rank's piece first */
        if (g->stage_n < count) {
            mrl_mem_free(g->stage);
            g->stage_n = 0;
            if (!(g->stage = mrl_mem_alloc(sizeof(float) * (size_t)count, MRL_MEM_PARAMS)))
                return mrl_wrap_error(MRL_ERR_NOMEM, "dist: a host buffer for %lld parameters", (long long)count);
            g->stage_n = count;
        }
        int64_t off, cnt, at, len;
        mrl_dist_group_shard(p->n, p->world, d->size, d->rank, &off, &cnt);
        mrl_dist_meet(off, cnt, offset, offset + count, &at, &len);
        if (len > 0 && (st = mrl_device_memcpy(g->stage + (at - offset), params + at, sizeof(float) * (size_t)len)))
            return mrl_wrap_error(st, "dist: this rank's parameters from the GPU");
        g->dev = params;
    }
    g->busy = 1;
    for (int64_t lo = offset; lo < offset + count; lo += seg) {
        int64_t hi = lo + seg < offset + count ? lo + seg : offset + count;
        int64_t *rc = d->tmp, *rd = rc + d->size, mine = 0;
        for (int r = 0; r < d->size; r++) {
            int64_t off, cnt, at;
            mrl_dist_group_shard(p->n, p->world, d->size, r, &off, &cnt);
            mrl_dist_meet(off, cnt, lo, hi, &at, &rc[r]);
            rd[r] = at - lo;
            if (r == d->rank) mine = rc[r];
        }
        p->received += (int64_t)sizeof(float) * (hi - lo - mine);
        float *into = g->dev ? g->stage + (lo - offset) : params + lo;
        int e = d->be->iallgatherv(p->m.comm, NULL, mine, into, rc, rd, sizeof(float), &g->reqs[g->nreq]);
        if (e) return mrl_dist_fail(d, e, "the all-gather of a parameter range");
        g->nreq++;
    }
    return MRL_OK;
}

int64_t mrl_dist_param_gather_bytes_received(const mrl_dist_param_gather *p) { return p->received; }

mrl_status mrl_dist_param_gather_set_nccl(mrl_dist_param_gather *p, mrl_nccl *nc) {
    if (!p || !nc) return mrl_set_error(MRL_ERR_INVALID, "mrl_dist_param_gather_set_nccl: NULL argument");
    if (!p->m.d || mrl_nccl_size(nc) != p->m.d->size || mrl_nccl_rank(nc) != p->m.d->rank)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_dist_param_gather_set_nccl: the communicator is not the gather's "
                             "ranks (rank %d of %d)", mrl_nccl_rank(nc), mrl_nccl_size(nc));
    p->nc = nc;
    return MRL_OK;
}

typedef struct gather_wait {
    mrl_dist *d;
    gather *g;
} gather_wait;

static mrl_status gather_poll(void *ctx, int *done) {
    gather_wait *w = ctx;
    int left = 0;
    for (int i = 0; i < w->g->nreq; i++) {
        if (!w->g->reqs[i]) continue;
        int fin = 0;
        int e = w->d->be->test(w->g->reqs[i], &fin);
        if (e) return mrl_dist_fail(w->d, e, "the all-gather of a parameter range");
        if (fin) w->g->reqs[i] = NULL;
        else left++;
    }
    *done = left == 0;
    return MRL_OK;
}

mrl_status mrl_dist_param_gather_wait(void *vp, float *params, int64_t offset, int64_t count) {
    (void)params;
    mrl_dist_param_gather *p = vp;
    if (!p->m.d) return mrl_set_error(MRL_ERR_INVALID, "dist: a parameter gather after mrl_dist_finalize");
    gather *g = NULL;
    for (int i = 0; i < GATHERS && !g; i++)
        if (p->g[i].busy && p->g[i].lo == offset && p->g[i].hi == offset + count) g = &p->g[i];
    if (!g)
        return mrl_set_error(MRL_ERR_INVALID, "dist: no parameter gather of [%lld, %lld) in flight", (long long)offset,
                             (long long)(offset + count));
    mrl_status st = mrl_dist_begin(p->m.d, "param_gather_wait");
    gather_wait w = {p->m.d, g};
    if (!st && g->nreq > 0) st = mrl_dist_wait(p->m.d, gather_poll, &w);
    if (!st) g->busy = 0; /* (after a failure the requests stay: the communicator is broken) */
    if (!st && g->dev && (st = mrl_device_memcpy(g->dev + g->lo, g->stage, sizeof(float) * (size_t)(g->hi - g->lo))))
        st = mrl_wrap_error(st, "dist: gathered parameters to the GPU");
    return st;
}
