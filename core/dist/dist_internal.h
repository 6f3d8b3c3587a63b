/* What the files of core/dist share: the communicator's struct, its waits
 * with deadlines, and the segment pipeline behind reduce-scatter,
 * all-reduce and the gradient buckets. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "backend.h"
#include "moonrl/dist.h"

/* What a rank that gives up on an operation tells every other rank, over
 * the communicator kept for these reports. */
typedef struct mrl_dist_note {
    int32_t magic; /* NOTE_MAGIC once filled */
    int32_t rank;
    int32_t kind; /* MRL_DIST_NOTE_* */
    int32_t pad;
    int64_t seq, step;
    double waited; /* seconds in the operation when it gave up */
    char op[32];
} mrl_dist_note;

enum {
    MRL_DIST_NOTE_TIMEOUT = 1, /* its deadline passed */
    MRL_DIST_NOTE_ABANDON = 2, /* another rank's report reached it while it waited */
    MRL_DIST_NOTE_ERROR = 3    /* an MPI call failed there */
};

typedef struct mrl_dist_buckets mrl_dist_buckets;

/* The head of an object that holds a communicator of its own made from d's (buckets.c's bucket
 * sets, zero.c's gradient shards and parameter gathers): d's list of them gives up those
 * communicators before MPI_Finalize, after which the object may still be freed (d NULL then). */
typedef struct mrl_dist_member {
    mrl_dist *d;
    void *comm;
    struct mrl_dist_member *next;
} mrl_dist_member;

struct mrl_dist {
    int rank, size, local_rank, local_size;
    const char *launcher;
    const mrl_dist_plugin *be; /* NULL with world size 1 */
    void *world;                /* MPI_COMM_WORLD */
    void *coll;                 /* a copy of it for the collectives */
    void *diag;                 /* another, for the timeout reports only */
    double timeout;
    int64_t step;
    int64_t seq;        /* operations started so far */
    const char *op;     /* the current one, its number, when it began */
    int64_t op_seq;
    double op_start;
    double last_probe;  /* when the report channel was last looked at */
    int broken;
    mrl_status broken_status;
    char broken_msg[1024];
    mrl_dist_note *notes; /* [size]: what each rank reported (magic set) */
    int64_t *tmp;         /* [4 * size]: counts and displacements being built */
    char *scratch;        /* for all-reduce and reduce-scatter */
    size_t scratch_cap;
    uint8_t *blob; /* allgather_blobs' results */
    size_t blob_cap;
    int64_t *blob_off; /* [size + 1] */
    mrl_dist_member *members; /* the live ones (bucket sets, grad shards, param gathers): their
                               * communicators go before MPI_Finalize */
    /* a communicator made by mrl_dist_split: its name, and the world rank of each of its ranks
     * (reports name world ranks); NULL for the world itself */
    char name[32];
    /* mrl_dist_send's messages still going out: each one's requests and its copy of the data */
    struct p2p_send *sends;
    int n_sends, cap_sends;
    int *world_ranks;
    int world_rank, world_size;
    char mpi_version[160];
};

/* Finds and loads libmoonrl_mpi.so (env.c). */
mrl_status mrl_dist_load_plugin(const mrl_dist_env *env, const mrl_dist_plugin **out);
/* Starts operation `op` (a string literal): fails at once when broken. */
mrl_status mrl_dist_begin(mrl_dist *d, const char *op);
/* An error code of the plugin in `what`: the communicator breaks. */
mrl_status mrl_dist_fail(mrl_dist *d, int rc, const char *what);
/* Calls poll until it sets *done, within the current operation's deadline
 * (and gives up at once when another rank reported a timeout). */
typedef mrl_status (*mrl_dist_poll)(void *ctx, int *done);
mrl_status mrl_dist_wait(mrl_dist *d, mrl_dist_poll poll, void *ctx);
/* The request the plugin just started (rc: its answer), waited for. */
mrl_status mrl_dist_wait_req(mrl_dist *d, int rc, void *req, const char *what);
/* m joins d with a communicator of its own, for a stream of collectives started in the same
 * order on every rank, while the order between two streams may differ (a bucket set's two
 * stages, the grad shard's segments as slots free up). */
mrl_status mrl_dist_member_join(mrl_dist *d, mrl_dist_member *m);
/* m leaves its d (if not finalized); its communicator is freed unless requests still in flight
 * (a round that never finished: a timeout, the process is ending) may use it. */
void mrl_dist_member_leave(mrl_dist_member *m, int busy);
/* Frees the communicators of d's members (before MPI_Finalize) and detaches them from d. */
void mrl_dist_members_detach_all(mrl_dist *d);
/* Grows d->scratch to at least `bytes`. */
mrl_status mrl_dist_scratch(mrl_dist *d, size_t bytes);

/* out[i] = parts[0][i] op parts[1][i] op ... op parts[nparts-1][i], left to
 * right (rank order) in the type of the data; MEAN then divides by nparts.
 * Part s starts at parts + s * n elements. */
void mrl_dist_combine(void *out, const void *parts, int64_t n, int nparts, int dtype, int op);
/* The same, with part `self` taken from out, which holds it on entry (its
 * slot in parts is not read): the caller's own values need no copy. */
void mrl_dist_combine_self(void *out, const void *parts, int64_t n, int nparts, int self, int dtype, int op);

/* ---- The segment pipeline ---------------------------------------------
 * A buffer cut into segments from its end: segment k is
 * [n - (k+1) * len, n - k * len) (the first one in memory may be shorter).
 * Stage 1 of a segment is an all-to-all-v that brings every other rank's
 * values of (segment ∩ my shard) into scratch (this rank's own stay in the
 * buffer, and their slot in scratch is left unused); when it completes they are combined
 * in rank order into the buffer; stage 2 (when `gather`) all-gathers the
 * segment's shard pieces in place. Segments start their stage 1 in order
 * (pipe_start) and their stage 2 in order too, on comm1 and comm2: the
 * order of the collectives on each communicator is the same on every rank
 * whatever order the requests complete in. */
enum { SEG_IDLE, SEG_SCATTER, SEG_SUMMED, SEG_GATHER, SEG_DONE };

typedef struct mrl_dist_seg {
    int64_t lo, hi;          /* [lo, hi) of the buffer, in elements */
    int64_t mine_lo, mine_n; /* its intersection with this rank's shard */
    int64_t scratch_off;     /* elements: where the size * mine_n pieces land */
    void *req;
    int stage;
} mrl_dist_seg;

typedef struct mrl_dist_pipe {
    mrl_dist *d;
    void *comm1, *comm2;
    char *buf;
    int dtype, op, gather;
    int64_t esz, n;
    mrl_dist_seg *segs;
    int nseg;
    int started;  /* segments [0, started) began stage 1 */
    int gathered; /* segments [0, gathered) are past SEG_SUMMED */
    int first_busy; /* segments before it are done */
    int64_t scratch_bytes; /* what `scratch` must hold */
    char *scratch;
} mrl_dist_pipe;

/* [lo, hi) ∩ [off, off + cnt): where it starts and its length (0 when they do not meet, *at
 * then lo): a rank's piece of a segment. */
static inline void mrl_dist_meet(int64_t off, int64_t cnt, int64_t lo, int64_t hi, int64_t *at, int64_t *len) {
    int64_t a = off > lo ? off : lo, b = off + cnt < hi ? off + cnt : hi;
    *at = b > a ? a : lo;
    *len = b > a ? b - a : 0;
}

/* The largest segment the pipeline cuts (int counts in MPI). */
int64_t mrl_dist_max_segment(int size);
mrl_status mrl_dist_pipe_init(mrl_dist_pipe *p, mrl_dist *d, void *comm1, void *comm2, void *buf, int64_t n,
                              int64_t seg_len, int dtype, int op, int gather);
void mrl_dist_pipe_free(mrl_dist_pipe *p);
/* Back to "nothing started", for the next round. */
void mrl_dist_pipe_reset(mrl_dist_pipe *p);
/* Stage 1 of the next segment. */
mrl_status mrl_dist_pipe_start(mrl_dist_pipe *p);
/* Tests what is in flight, combines, starts stage 2s; *done when all are. */
mrl_status mrl_dist_pipe_progress(void *pipe, int *done);
