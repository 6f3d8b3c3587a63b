/* Whether products that two threads read faster on an idle machine run on
 * them, decided by measurement on the calling thread (internal).
 *
 * A decode step makes dozens of products bound by reading their weights:
 * two cores read them faster than one, but on a machine with more runnable
 * threads than cores every parallel region waits for its second thread to
 * be scheduled, and the same step ran many times slower split than not
 * (bench/RESULTS.md, "Decode on two threads"). Neither
 * fixed rule is right on both machines, so each calling thread times its
 * products in windows of WINDOW products run the same way (one product
 * alone misleads: the first split one after a run of unsplit ones wakes the
 * sleeping worker threads), keeps a moving average of the time per
 * multiply-add of each way, runs the faster, and now and then the other (less often
 * while it keeps losing), to follow a load that changes. Only for kernels whose results
 * do not depend on the thread count: switching never changes a bit. */
#pragma once
#include <stdint.h>
#include <time.h>

#define MRL_SPLIT_WINDOW 64
#define MRL_SPLIT_EXPLORE_MAX 64

typedef struct mrl_split_choice {
    double per_mac[2]; /* seconds per multiply-add, not split [0] and split [1]; 0: not measured */
    double seconds, macs; /* the window so far */
    int split, left;      /* the way of this window, and its products still to run */
    int best;             /* the faster way so far */
    int since, every;     /* windows since the other way was tried, and how many to wait */
} mrl_split_choice;

static inline double mrl_split_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* 1: run this product split over the threads, 0: on the calling thread. */
static inline int mrl_split_pick(mrl_split_choice *c) {
    if (c->left > 0) return c->split;
    if (c->per_mac[1] == 0) c->split = 1; /* measure each way first */
    else if (c->per_mac[0] == 0) c->split = 0;
    else if (++c->since >= c->every) c->split = !c->best, c->since = 0; /* try the other way */
    else c->split = c->best;
    c->left = MRL_SPLIT_WINDOW, c->seconds = c->macs = 0;
    return c->split;
}

/* What the product just picked took: `seconds` for `macs` multiply-adds.
 * A try of the other way that loses doubles the wait before the next one
 * (up to EXPLORE_MAX windows: a steady machine pays ~1/64 of its windows
 * for trying); one that wins switches, and tries again soon. */
static inline void mrl_split_record(mrl_split_choice *c, double seconds, double macs) {
    c->seconds += seconds, c->macs += macs;
    if (--c->left > 0) return;
    double v = c->seconds / (c->macs > 1 ? c->macs : 1);
    double *e = &c->per_mac[c->split];
    *e = *e > 0 ? 0.5 * *e + 0.5 * v : v;
    if (c->per_mac[0] == 0 || c->per_mac[1] == 0) return;
    int best = c->per_mac[1] < c->per_mac[0];
    if (c->every == 0) c->every = 2;
    if (best != c->best) c->best = best, c->every = 2;
    else if (c->split != best && c->every < MRL_SPLIT_EXPLORE_MAX) c->every *= 2;
}

/* The bf16 kernels' thresholds for products bound by reading their weights
 * (a decode step's): below MRL_SPLIT_W_ELEMS elements of W one thread
 * reads it as fast as two; from MRL_SPLIT_ALWAYS_MACS multiply-adds a
 * product always splits. */
#define MRL_SPLIT_W_ELEMS ((int64_t)1 << 17)
#define MRL_SPLIT_ALWAYS_MACS ((int64_t)1 << 22)

/* Whether such a product (w_elems elements of W, macs multiply-adds) runs
 * split over `threads`: never below MRL_SPLIT_W_ELEMS or on one thread,
 * always from MRL_SPLIT_ALWAYS_MACS, by c's measurement between, when
 * *measured is set to 1: the caller then records its time. */
static inline int mrl_split_weights(mrl_split_choice *c, int64_t w_elems, int64_t macs, int threads, int *measured) {
    *measured = 0;
    if (w_elems < MRL_SPLIT_W_ELEMS || threads < 2) return 0;
    if (macs >= MRL_SPLIT_ALWAYS_MACS) return 1;
    *measured = 1;
    return mrl_split_pick(c);
}
