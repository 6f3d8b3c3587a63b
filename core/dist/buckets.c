/* Gradient buckets reduced while the backward runs (moonrl/dist.h).
 *
 * The buckets are the segments of a pipeline (dist_internal.h) over the
 * gradient buffer, cut from its end. The model's hook says which ranges
 * are final; a bucket starts its all-to-all once its whole range is final
 * and every bucket after it (higher in memory) has started, so every rank
 * starts them in the same order whatever order its hook reports ranges in
 * (or if it never calls the hook at all: finish starts the rest). Each
 * bucket set has its own two communicators, one per stage, since the two
 * stages of different buckets interleave differently on each rank. */
#include <stdlib.h>
#include <string.h>
#include "dist_internal.h"
#include "base/error.h"

struct mrl_dist_buckets {
    mrl_dist_member m1, m2; /* d (NULL once finalized) and a communicator per stage, d's list */
    float *grads;
    int64_t n;
    int mode;
    mrl_dist_pipe pipe;
    char *scratch;
    int armed;
    int overlapped;
    /* the ranges found final in this backward: sorted, disjoint, not touching */
    int64_t (*ranges)[2];
    int n_ranges, cap_ranges;
};

mrl_status mrl_dist_buckets_create(mrl_dist *d, float *grads, int64_t n, int64_t bucket_bytes, int mode,
                                   mrl_dist_buckets **out) {
    *out = NULL;
    if (n < 0 || (n > 0 && !grads))
        return mrl_set_error(MRL_ERR_INVALID, "dist: buckets: %lld gradients at %p", (long long)n, (void *)grads);
    if (bucket_bytes < (int64_t)sizeof(float))
        return mrl_set_error(MRL_ERR_INVALID, "dist: buckets: bucket size %lld bytes", (long long)bucket_bytes);
    if (mode != MRL_DIST_BUCKETS_ALLREDUCE && mode != MRL_DIST_BUCKETS_REDUCE_SCATTER)
        return mrl_set_error(MRL_ERR_INVALID, "dist: buckets: unknown mode %d", mode);
    mrl_status st = mrl_dist_begin(d, "buckets_create");
    if (st) return st;
    mrl_dist_buckets *b = calloc(1, sizeof *b);
    if (!b) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    b->grads = grads;
    b->n = n;
    b->mode = mode;
    st = mrl_dist_pipe_init(&b->pipe, d, NULL, NULL, grads, n, bucket_bytes / (int64_t)sizeof(float), MRL_DIST_F32,
                            MRL_DIST_SUM, mode == MRL_DIST_BUCKETS_ALLREDUCE);
    if (!st && b->pipe.scratch_bytes > 0 && !(b->scratch = malloc((size_t)b->pipe.scratch_bytes)))
        st = mrl_set_error(MRL_ERR_NOMEM, "dist: buckets: out of memory for %lld bytes of scratch",
                           (long long)b->pipe.scratch_bytes);
    /* collectives: every rank makes its bucket sets in the same order */
    if (!st && !(st = mrl_dist_member_join(d, &b->m1)) && (st = mrl_dist_member_join(d, &b->m2)))
        mrl_dist_member_leave(&b->m1, 0);
    if (st) {
        /* after a failed idup the communicator is broken: nothing to free */
        mrl_dist_pipe_free(&b->pipe);
        free(b->scratch);
        free(b);
        return st;
    }
    b->pipe.scratch = b->scratch;
    b->pipe.comm1 = b->m1.comm;
    b->pipe.comm2 = b->m2.comm;
    *out = b;
    return MRL_OK;
}

void mrl_dist_buckets_free(mrl_dist_buckets *b) {
    if (!b) return;
    /* requests still in flight (a round never finished) hold the scratch:
     * then it stays allocated */
    int busy = b->pipe.first_busy < b->pipe.started;
    mrl_dist_member_leave(&b->m1, busy);
    mrl_dist_member_leave(&b->m2, busy);
    mrl_dist_pipe_free(&b->pipe);
    if (!busy) free(b->scratch);
    free(b->ranges);
    free(b);
}

int mrl_dist_buckets_overlapped(const mrl_dist_buckets *b) { return b->overlapped; }
int mrl_dist_buckets_count(const mrl_dist_buckets *b) { return b->pipe.nseg; }

void mrl_dist_buckets_arm(mrl_dist_buckets *b, int on) {
    b->armed = on != 0;
    if (!on && b->pipe.started == 0) b->n_ranges = 0; /* (nothing started: nothing found final yet either) */
}

/* Adds [lo, hi) to the final ranges, merging what it touches. */
static int add_range(mrl_dist_buckets *b, int64_t lo, int64_t hi) {
    int i = 0;
    while (i < b->n_ranges && b->ranges[i][1] < lo) i++; /* ranges before it, not touching */
    int j = i;
    while (j < b->n_ranges && b->ranges[j][0] <= hi) { /* ranges it touches: merged into one */
        if (b->ranges[j][0] < lo) lo = b->ranges[j][0];
        if (b->ranges[j][1] > hi) hi = b->ranges[j][1];
        j++;
    }
    if (j == i) { /* a new range at i */
        if (b->n_ranges == b->cap_ranges) {
            int cap = b->cap_ranges ? 2 * b->cap_ranges : 64;
            void *r = realloc(b->ranges, (size_t)cap * sizeof *b->ranges);
            if (!r) return -1;
            b->ranges = r;
            b->cap_ranges = cap;
        }
        memmove(b->ranges + i + 1, b->ranges + i, (size_t)(b->n_ranges - i) * sizeof *b->ranges);
        b->n_ranges++;
    } else if (j > i + 1) { /* ranges i+1 .. j-1 are absorbed into i */
        memmove(b->ranges + i + 1, b->ranges + j, (size_t)(b->n_ranges - j) * sizeof *b->ranges);
        b->n_ranges -= j - i - 1;
    }
    b->ranges[i][0] = lo;
    b->ranges[i][1] = hi;
    return 0;
}

static int covered(const mrl_dist_buckets *b, int64_t lo, int64_t hi) {
    int a = 0, z = b->n_ranges - 1; /* the last range that begins at or before lo */
    while (a <= z) {
        int m = (a + z) / 2;
        if (b->ranges[m][0] <= lo) a = m + 1;
        else z = m - 1;
    }
    return z >= 0 && b->ranges[z][1] >= hi;
}

void mrl_dist_buckets_ready(void *vb, int64_t offset, int64_t count) {
    mrl_dist_buckets *b = vb;
    mrl_dist *d = b->m1.d;
    if (!b->armed || !d || d->broken) return;
    int64_t lo = offset > 0 ? offset : 0, hi = offset + count < b->n ? offset + count : b->n;
    if (hi > lo && add_range(b, lo, hi) != 0) return; /* out of memory: finish starts the rest */
    /* errors break the communicator; finish reports them */
    mrl_dist_pipe *p = &b->pipe;
    while (p->started < p->nseg && covered(b, p->segs[p->started].lo, p->segs[p->started].hi))
        if (mrl_dist_pipe_start(p)) return;
    int done;
    if (p->started > p->first_busy && d->size > 1) mrl_dist_pipe_progress(p, &done);
}

mrl_status mrl_dist_buckets_finish(mrl_dist_buckets *b) {
    mrl_dist *d = b->m1.d;
    if (!d) return mrl_set_error(MRL_ERR_INVALID, "dist: buckets_finish after mrl_dist_finalize");
    mrl_dist_pipe *p = &b->pipe;
    int before = p->started;
    mrl_status st = mrl_dist_begin(d, "buckets_finish");
    while (!st && p->started < p->nseg) st = mrl_dist_pipe_start(p);
    if (!st) st = mrl_dist_wait(d, mrl_dist_pipe_progress, p);
    /* the next round: nothing started, nothing final, not armed */
    b->overlapped = before;
    b->armed = 0;
    b->n_ranges = 0;
    if (!st) mrl_dist_pipe_reset(p);
    return st;
}
