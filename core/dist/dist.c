/* The job's communicator (moonrl/dist.h): set-up, the waits with
 * deadlines and their reports, and the collectives. MPI comes from the
 * plugin (backend.h); every algorithm is here. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "dist_internal.h"
#include "moonrl/loop.h"
#include "base/error.h"

/* one of mrl_dist_send's messages going out: its requests (a piece a GiB) and its copy of the data */
typedef struct p2p_send {
    void **reqs;
    int n;
    void *data;
} p2p_send;

enum {
    NOTE_MAGIC = 0x6d726c64, /* "mrld" */
    NOTE_TAG = 7001,
    EXCHANGE_TAG = 7002, /* the messages of mrl_dist_alltoallv and mrl_dist_send_pieces */
    P2P_TAG = 8000,      /* mrl_dist_send and mrl_dist_recv: P2P_TAG + their tag */
};

/* All-reduces gathering at most this many bytes on each rank (size *
 * buffer) all-gather every rank's buffer and add locally: one collective
 * instead of two, for the many small sums of metrics. */
enum { SMALL_ALLREDUCE = 256 << 10 };

/* ---------------------------------------------------------------- text */

typedef struct text {
    char *s;
    size_t len, cap;
} text;

static void add(text *t, const char *fmt, ...) {
    va_list ap;
    for (;;) {
        size_t room = t->cap - t->len;
        va_start(ap, fmt);
        int k = t->s ? vsnprintf(t->s + t->len, room, fmt, ap) : -1;
        va_end(ap);
        if (k >= 0 && (size_t)k < room) {
            t->len += (size_t)k;
            return;
        }
        size_t cap = t->cap ? 2 * t->cap : 1024;
        while (k >= 0 && cap < t->len + (size_t)k + 1) cap *= 2;
        char *s = realloc(t->s, cap);
        if (!s) return; /* the report is cut short; nothing else to do */
        t->s = s;
        t->cap = cap;
    }
}

/* " at step N", or " (no step set)" before the first mrl_dist_set_step. */
static const char *at_step(int64_t step, char *buf, size_t cap) {
    if (step < 0) snprintf(buf, cap, " (no step set)");
    else snprintf(buf, cap, " at step %lld", (long long)step);
    return buf;
}

/* ----------------------------------------------------- reports between ranks */

/* Reads the reports other ranks sent (at most one from each); returns a
 * rank that sent one now, or -1. */
static int drain_notes(mrl_dist *d) {
    int got = -1;
    if (!d->diag) return -1;
    for (int guard = 0; guard < d->size; guard++) {
        int found = 0, from = -1;
        int64_t bytes = 0;
        if (d->be->iprobe(d->diag, -1, NOTE_TAG, &found, &from, &bytes) || !found) break;
        size_t cap = (size_t)bytes > sizeof(mrl_dist_note) ? (size_t)bytes : sizeof(mrl_dist_note);
        mrl_dist_note *n = calloc(1, cap);
        void *req = NULL;
        if (!n || d->be->irecv(d->diag, n, bytes, from, NOTE_TAG, &req)) {
            free(n);
            break;
        }
        /* the message is here (probed): this completes at once */
        int done = 0;
        double end = mrl_time_now() + 1;
        while (!done && mrl_time_now() < end) {
            if (d->be->test(req, &done)) break;
            if (!done) sched_yield();
        }
        if (!done) break; /* n stays with MPI */
        if (bytes == (int64_t)sizeof *n && n->magic == NOTE_MAGIC && from >= 0 && from < d->size && from != d->rank) {
            d->notes[from] = *n;
            got = from;
        }
        free(n);
    }
    return got;
}

/* Tells every other rank that this one gives up on the current operation.
 * Returns the requests (size entries; NULL where done or not sent). */
static void **send_notes(mrl_dist *d, int kind, double waited, mrl_dist_note **msg) {
    *msg = NULL;
    if (!d->diag) return NULL;
    mrl_dist_note *n = calloc(1, sizeof *n);
    void **reqs = calloc((size_t)d->size, sizeof *reqs);
    if (!n || !reqs) {
        free(n);
        free(reqs);
        return NULL;
    }
    n->magic = NOTE_MAGIC;
    n->rank = d->rank;
    n->kind = kind;
    n->seq = d->op_seq;
    n->step = d->step;
    n->waited = waited;
    snprintf(n->op, sizeof n->op, "%s", d->op ? d->op : "?");
    for (int r = 0; r < d->size; r++)
        if (r != d->rank && d->be->isend(d->diag, n, sizeof *n, r, NOTE_TAG, &reqs[r])) reqs[r] = NULL;
    *msg = n;
    return reqs;
}

/* Frees the notes' requests that completed; 1 when all did. */
static int sends_done(mrl_dist *d, void **reqs) {
    int all = 1;
    for (int r = 0; reqs && r < d->size; r++) {
        int done = 0;
        if (reqs[r] && (d->be->test(reqs[r], &done) || done)) reqs[r] = NULL;
        if (reqs[r]) all = 0;
    }
    return all;
}

static void describe(text *t, const mrl_dist *d, const mrl_dist_note *n) {
    char s[48];
    if (n->magic != NOTE_MAGIC) {
        add(t, "no answer (dead or hung)");
        return;
    }
    const char *where = n->kind == MRL_DIST_NOTE_ERROR ? "failed in" : "waiting in";
    add(t, "%s %s #%lld%s for %.2f s", where, n->op, (long long)n->seq, at_step(n->step, s, sizeof s), n->waited);
    if (n->kind == MRL_DIST_NOTE_TIMEOUT) add(t, " (timed out)");
    if (n->seq != d->op_seq || strcmp(n->op, d->op ? d->op : "?") != 0) add(t, " [not this rank's operation]");
}

static int same_state(const mrl_dist_note *a, const mrl_dist_note *b) {
    if ((a->magic == NOTE_MAGIC) != (b->magic == NOTE_MAGIC)) return 0;
    if (a->magic != NOTE_MAGIC) return 1;
    return a->kind == b->kind && a->seq == b->seq && a->step == b->step && !strcmp(a->op, b->op);
}

/* The report: a header, then one line per run of ranks in the same state.
 * `prefix` starts each line (the stderr block) or, when NULL, the lines
 * are joined with "; " (the error message). */
static void report(text *t, mrl_dist *d, const char *head, const char *prefix) {
    if (prefix) add(t, "%s %s\n", prefix, head);
    else add(t, "%s", head);
    for (int r = 0; r < d->size;) {
        if (r == d->rank) {
            r++;
            continue;
        }
        int last = r;
        double waited = d->notes[r].waited;
        while (last + 1 < d->size && last + 1 != d->rank && same_state(&d->notes[r], &d->notes[last + 1])) {
            last++;
            if (d->notes[last].waited > waited) waited = d->notes[last].waited;
        }
        mrl_dist_note n = d->notes[r];
        n.waited = waited;
        if (prefix) add(t, "%s   ", prefix);
        else add(t, "; ");
        if (d->world_ranks && last > r) add(t, "ranks %d-%d (of %s): ", d->world_ranks[r], d->world_ranks[last], d->name);
        else if (d->world_ranks) add(t, "rank %d: ", d->world_ranks[r]);
        else if (last > r) add(t, "ranks %d-%d: ", r, last);
        else add(t, "rank %d: ", r);
        describe(t, d, &n);
        if (prefix) add(t, "\n");
        r = last + 1;
    }
    if (prefix) add(t, "%s the communicator is broken: every later operation fails at once\n", prefix);
}

static mrl_status break_with(mrl_dist *d, mrl_status status, const char *head) {
    char prefix[96];
    if (d->world_ranks) snprintf(prefix, sizeof prefix, "moonrl [rank %d/%d, %s]", d->world_rank, d->world_size, d->name);
    else snprintf(prefix, sizeof prefix, "moonrl [rank %d/%d]", d->rank, d->size);
    text block = {0}, msg = {0};
    report(&block, d, head, prefix);
    add(&msg, "%s ", prefix);
    report(&msg, d, head, NULL);
    /* one write: the blocks of several ranks do not interleave line by line */
    if (block.s) {
        fputs(block.s, stderr);
        fflush(stderr);
    }
    d->broken = 1;
    d->broken_status = status;
    snprintf(d->broken_msg, sizeof d->broken_msg, "%s", msg.s ? msg.s : head);
    free(block.s);
    free(msg.s);
    return mrl_set_error(status, "%s", d->broken_msg);
}

/* The current operation is over for this rank: it timed out (peer < 0) or
 * rank `peer` reported that it gave up. Tell the others, listen a little
 * for their reports, print the report, break. */
static mrl_status give_up(mrl_dist *d, int peer) {
    double waited = mrl_time_now() - d->op_start;
    mrl_dist_note *msg;
    void **reqs = send_notes(d, peer < 0 ? MRL_DIST_NOTE_TIMEOUT : MRL_DIST_NOTE_ABANDON, waited, &msg);
    /* the others time out about when we do (or learn of it at their next
     * look at the report channel): wait for them, but not long. A rank
     * that only learnt of another's timeout waits less: its report must be
     * out before that rank's grace ends, when the launcher ends the job. */
    double grace = d->timeout > 0 && d->timeout < 2 ? d->timeout : 2;
    if (peer >= 0) grace = grace < 0.25 ? grace : 0.25;
    double end = mrl_time_now() + grace;
    for (;;) {
        drain_notes(d);
        int all = 1;
        for (int r = 0; r < d->size; r++)
            if (r != d->rank && d->notes[r].magic != NOTE_MAGIC) all = 0;
        int sent = sends_done(d, reqs);
        if ((all && sent) || mrl_time_now() >= end || !d->diag) break;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    if (sends_done(d, reqs)) {
        free(reqs);
        free(msg);
    } /* else both stay with MPI: the process is about to end */
    char head[256], s[48];
    if (peer < 0)
        snprintf(head, sizeof head, "%s #%lld%s timed out: not finished after %.2f s (timeout %g s)", d->op,
                 (long long)d->op_seq, at_step(d->step, s, sizeof s), waited, d->timeout);
    else
        snprintf(head, sizeof head, "%s #%lld%s abandoned after %.2f s: rank %d %s", d->op, (long long)d->op_seq,
                 at_step(d->step, s, sizeof s), waited, peer,
                 d->notes[peer].kind == MRL_DIST_NOTE_ERROR ? "had an MPI error" : "gave up waiting");
    return break_with(d, MRL_ERR_TIMEOUT, head);
}

mrl_status mrl_dist_fail(mrl_dist *d, int rc, const char *what) {
    char err[256] = "", head[512], s[48];
    d->be->error_string(rc, err, sizeof err);
    snprintf(head, sizeof head, "%s #%lld%s: %s failed: %s", d->op ? d->op : "?", (long long)d->op_seq,
             at_step(d->step, s, sizeof s), what, err);
    /* the others would wait for this rank until their deadlines: tell them now */
    mrl_dist_note *msg;
    void **reqs = send_notes(d, MRL_DIST_NOTE_ERROR, mrl_time_now() - d->op_start, &msg);
    double end = mrl_time_now() + 0.2;
    while (reqs && !sends_done(d, reqs) && mrl_time_now() < end) sched_yield();
    if (sends_done(d, reqs)) {
        free(reqs);
        free(msg);
    }
    return break_with(d, MRL_ERR_IO, head);
}

/* ----------------------------------------------------------------- waits */

/* ---------------------------------------------------------------- members */

void mrl_dist_members_detach_all(mrl_dist *d) {
    for (mrl_dist_member *m = d->members, *next; m; m = next) {
        next = m->next;
        if (m->comm && !d->broken) d->be->comm_free(m->comm);
        m->comm = NULL;
        m->d = NULL;
        m->next = NULL;
    }
    d->members = NULL;
}

mrl_status mrl_dist_member_join(mrl_dist *d, mrl_dist_member *m) {
    m->d = d;
    m->comm = NULL;
    if (d->size > 1) {
        void *req = NULL;
        int e = d->be->comm_idup(d->coll, &m->comm, &req);
        mrl_status st = mrl_dist_wait_req(d, e, req, "MPI_Comm_idup");
        if (st) return st;
    }
    m->next = d->members;
    d->members = m;
    return MRL_OK;
}

void mrl_dist_member_leave(mrl_dist_member *m, int busy) {
    if (!m->d) return;
    for (mrl_dist_member **p = &m->d->members; *p; p = &(*p)->next)
        if (*p == m) {
            *p = m->next;
            break;
        }
    if (!busy && m->comm && !m->d->broken) m->d->be->comm_free(m->comm);
}


mrl_status mrl_dist_begin(mrl_dist *d, const char *op) {
    if (d->broken) return mrl_set_error(d->broken_status, "%s", d->broken_msg);
    d->op = op;
    d->op_seq = ++d->seq;
    d->op_start = mrl_time_now();
    return MRL_OK;
}

mrl_status mrl_dist_wait(mrl_dist *d, mrl_dist_poll poll, void *ctx) {
    int slow = 0;
    for (unsigned spin = 1;; spin++) {
        int done = 0;
        mrl_status st = poll(ctx, &done);
        if (st || done) return st;
        if (spin % 16 == 0) {
            /* the clock, the report channel and the deadline: every so often */
            double now = mrl_time_now();
            if (d->diag && now - d->last_probe >= 0.05) {
                d->last_probe = now;
                int from = drain_notes(d);
                if (from >= 0) return give_up(d, from);
            }
            if (d->timeout > 0 && now - d->op_start > d->timeout) return give_up(d, -1);
            /* a long wait (another rank still computing): stop burning a core it may need */
            slow = now - d->op_start > 0.1;
        }
        if (slow) {
            struct timespec t = {0, 50000};
            nanosleep(&t, NULL);
        } else {
            /* oversubscribed ranks (more ranks than cores) progress only if we let them run */
            sched_yield();
        }
    }
}

typedef struct req_set {
    mrl_dist *d;
    void **reqs;
    int n;
    const char *what;
} req_set;

static mrl_status poll_reqs(void *ctx, int *done) {
    req_set *q = ctx;
    int left = 0;
    for (int i = 0; i < q->n; i++) {
        if (!q->reqs[i]) continue;
        int fin = 0;
        int e = q->d->be->test(q->reqs[i], &fin);
        if (e) {
            q->reqs[i] = NULL;
            return mrl_dist_fail(q->d, e, q->what);
        }
        if (fin) q->reqs[i] = NULL;
        else left++;
    }
    *done = left == 0;
    return MRL_OK;
}

static mrl_status wait_reqs(mrl_dist *d, void **reqs, int n, const char *what) {
    req_set q = {d, reqs, n, what};
    return mrl_dist_wait(d, poll_reqs, &q);
}

mrl_status mrl_dist_wait_req(mrl_dist *d, int rc, void *req, const char *what) {
    if (rc) return mrl_dist_fail(d, rc, what);
    return wait_reqs(d, &req, 1, what);
}

mrl_status mrl_dist_scratch(mrl_dist *d, size_t bytes) {
    if (bytes <= d->scratch_cap) return MRL_OK;
    free(d->scratch);
    d->scratch_cap = 0;
    if (!(d->scratch = malloc(bytes)))
        return mrl_set_error(MRL_ERR_NOMEM, "dist: out of memory for %zu bytes of scratch", bytes);
    d->scratch_cap = bytes;
    return MRL_OK;
}

/* ------------------------------------------------------------ the handle */

static mrl_status idup(mrl_dist *d, void *comm, void **out) {
    /* *out is set only once the copy is usable: the wait may look at d->diag */
    void *req = NULL, *c = NULL;
    int rc = d->be->comm_idup(comm, &c, &req);
    mrl_status st = mrl_dist_wait_req(d, rc, req, "MPI_Comm_idup");
    if (!st) *out = c;
    return st;
}

mrl_status mrl_dist_init(double timeout, mrl_dist **out) {
    *out = NULL;
    mrl_dist_env env;
    mrl_status st = mrl_dist_env_detect(&env);
    if (st) return st;
    mrl_dist *d = calloc(1, sizeof *d);
    if (!d) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    d->rank = env.rank;
    d->size = env.size;
    d->local_rank = env.local_rank;
    d->local_size = env.local_size > 0 ? env.local_size : 1;
    d->launcher = env.launcher;
    d->timeout = timeout > 0 ? timeout : 0;
    d->step = -1;
    if (env.size != 1) {
        const mrl_dist_plugin *be;
        if ((st = mrl_dist_load_plugin(&env, &be))) goto fail;
        int rc = be->init();
        if (rc) {
            char err[256] = "";
            be->error_string(rc, err, sizeof err);
            st = mrl_set_error(MRL_ERR_IO, "dist: MPI_Init failed: %s", err);
            goto fail;
        }
        d->be = be;
        int rank = 0, size = 1;
        be->library_version(d->mpi_version, sizeof d->mpi_version);
        if ((rc = be->world(&d->world, &rank, &size))) {
            st = mrl_set_error(MRL_ERR_IO, "dist: MPI_Comm_rank failed");
            goto fail;
        }
        if (env.size > 0 && (rank != env.rank || size != env.size)) {
            st = mrl_set_error(MRL_ERR_UNSUPPORTED,
                               "dist: the launcher (%s) says rank %d of %d, MPI (%s) says rank %d of %d: the "
                               "plugin's MPI is not the launcher's (MOONRL_MPI_PLUGIN, or rebuild against it)",
                               env.launcher, env.rank, env.size, d->mpi_version, rank, size);
            goto fail;
        }
        d->rank = rank;
        d->size = size;
        if (!(d->notes = calloc((size_t)size, sizeof *d->notes)) ||
            !(d->tmp = calloc(4 * (size_t)size, sizeof *d->tmp)) ||
            !(d->blob_off = calloc((size_t)size + 1, sizeof *d->blob_off))) {
            st = mrl_set_error(MRL_ERR_NOMEM, "out of memory");
            goto fail;
        }
        if (env.local_size <= 0 && (rc = be->node_local(d->world, &d->local_rank, &d->local_size))) {
            st = mrl_dist_fail(d, rc, "MPI_Comm_split_type");
            goto fail;
        }
        /* the report channel first: a timeout while making the other one can use it */
        mrl_dist_begin(d, "init");
        if ((st = idup(d, d->world, &d->diag)) || (st = idup(d, d->world, &d->coll))) goto fail;
    } else if (!(d->blob_off = calloc(2, sizeof *d->blob_off))) {
        st = mrl_set_error(MRL_ERR_NOMEM, "out of memory");
        goto fail;
    }
    *out = d;
    return MRL_OK;
fail:
    /* MPI stays as it is (it cannot be initialised twice): the process is
     * expected to end on this error */
    free(d->notes);
    free(d->tmp);
    free(d->blob_off);
    free(d);
    return st;
}

mrl_status mrl_dist_split(mrl_dist *d, int color, const char *name, mrl_dist **out) {
    *out = NULL;
    if (!name) name = "";
    if (!d->be) { /* one process: it is the whole of its group, or of none */
        if (color < 0) return MRL_OK;
        mrl_dist *s = calloc(1, sizeof *s);
        if (!s || !(s->blob_off = calloc(2, sizeof *s->blob_off)) || !(s->world_ranks = calloc(1, sizeof(int)))) {
            if (s) free(s->blob_off);
            free(s);
            return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
        }
        s->size = s->local_size = s->world_size = 1;
        s->launcher = d->launcher;
        s->timeout = d->timeout;
        s->step = d->step;
        snprintf(s->name, sizeof s->name, "%s", name);
        *out = s;
        return MRL_OK;
    }
    /* MPI_Comm_split blocks until every rank calls it: a barrier under the deadline first, so
     * that a missing rank is a report and not a hang */
    mrl_status st = mrl_dist_barrier(d);
    if (st) return st;
    void *c = NULL;
    int rank = -1, size = 0;
    int rc = d->be->comm_split(d->world, color, d->rank, &c, &rank, &size);
    if (rc) return mrl_dist_fail(d, rc, "MPI_Comm_split");
    if (!c) return MRL_OK;
    mrl_dist *s = calloc(1, sizeof *s);
    if (!s) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    s->be = d->be;
    s->world = c;
    s->rank = rank;
    s->size = size;
    s->local_rank = d->local_rank;
    s->local_size = d->local_size;
    s->launcher = d->launcher;
    s->timeout = d->timeout;
    s->step = d->step;
    s->world_rank = d->world_ranks ? d->world_rank : d->rank;
    s->world_size = d->world_ranks ? d->world_size : d->size;
    snprintf(s->name, sizeof s->name, "%s", name);
    if (!(s->notes = calloc((size_t)size, sizeof *s->notes)) || !(s->tmp = calloc(4 * (size_t)size, sizeof *s->tmp)) ||
        !(s->blob_off = calloc((size_t)size + 1, sizeof *s->blob_off)) ||
        !(s->world_ranks = calloc((size_t)size, sizeof(int)))) {
        mrl_dist_free(s);
        return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    }
    mrl_dist_begin(s, "split");
    int32_t me = s->world_rank;
    if ((st = idup(s, s->world, &s->diag)) || (st = idup(s, s->world, &s->coll)) ||
        (st = mrl_dist_allgather(s, &me, sizeof me, s->world_ranks))) {
        mrl_dist_free(s);
        return st;
    }
    *out = s;
    return MRL_OK;
}

void mrl_dist_free(mrl_dist *d) {
    if (!d) return;
    if (!d->world_ranks) { /* the world: MPI itself goes with it */
        mrl_dist_finalize(d);
        return;
    }
    mrl_dist_members_detach_all(d);
    if (d->be && !d->broken) {
        if (d->coll) d->be->comm_free(d->coll);
        if (d->diag) d->be->comm_free(d->diag);
        d->be->comm_free(d->world);
    }
    for (int i = 0; i < d->n_sends; i++) free(d->sends[i].data); /* (requests abandoned: the process ends) */
    free(d->sends);
    free(d->notes);
    free(d->tmp);
    free(d->scratch);
    free(d->blob);
    free(d->blob_off);
    free(d->world_ranks);
    free(d);
}

void mrl_dist_finalize(mrl_dist *d) {
    if (!d) return;
    if (d->world_ranks) {
        mrl_dist_free(d);
        return;
    }
    if (d->be && !d->broken) {
        /* every rank gets here, or MPI_Finalize would wait for the missing
         * ones forever: a barrier with the deadline first */
        mrl_dist_begin(d, "finalize");
        void *req = NULL;
        int rc = d->be->ibarrier(d->coll, &req);
        if (mrl_dist_wait_req(d, rc, req, "MPI_Ibarrier") == MRL_OK) {
            mrl_dist_members_detach_all(d);
            d->be->comm_free(d->coll);
            d->be->comm_free(d->diag);
            d->be->finalize();
        }
    }
    if (d->broken) mrl_dist_members_detach_all(d);
    /* the plugin stays loaded: libmpi may still have threads and handlers */
    for (int i = 0; i < d->n_sends; i++) free(d->sends[i].data); /* (requests abandoned: the process ends) */
    free(d->sends);
    free(d->notes);
    free(d->tmp);
    free(d->scratch);
    free(d->blob);
    free(d->blob_off);
    free(d);
}

int mrl_dist_rank(const mrl_dist *d) { return d->rank; }
int mrl_dist_size(const mrl_dist *d) { return d->size; }
int mrl_dist_local_rank(const mrl_dist *d) { return d->local_rank; }
int mrl_dist_local_size(const mrl_dist *d) { return d->local_size; }
const char *mrl_dist_backend(const mrl_dist *d) { return d->be ? d->be->name : "none"; }
void mrl_dist_set_timeout(mrl_dist *d, double seconds) { d->timeout = seconds > 0 ? seconds : 0; }
void mrl_dist_set_step(mrl_dist *d, int64_t step) { d->step = step; }
int mrl_dist_broken(const mrl_dist *d) { return d->broken; }

void mrl_dist_shard(int64_t n, int size, int rank, int64_t *offset, int64_t *count) {
    if (n < 0) n = 0;
    if (size < 1) size = 1;
    int64_t base = n / size, extra = n % size;
    *offset = rank * base + (rank < extra ? rank : extra);
    *count = rank < 0 || rank >= size ? 0 : base + (rank < extra ? 1 : 0);
}

void mrl_dist_group_shard(int64_t n, int size, int shards, int index, int64_t *offset, int64_t *count) {
    if (shards < 1 || size % shards) shards = size; /* (no groups: the plain shard) */
    int per = size / shards; /* the world's pieces a group shard takes */
    int64_t off0, cnt0, off1, cnt1;
    mrl_dist_shard(n, size, index * per, &off0, &cnt0);
    mrl_dist_shard(n, size, index * per + per - 1, &off1, &cnt1);
    *offset = off0;
    *count = index < 0 || index >= shards ? 0 : off1 + cnt1 - off0;
}

int64_t mrl_dist_dtype_size(int dtype) {
    switch (dtype) {
    case MRL_DIST_F32: return 4;
    case MRL_DIST_F64: return 8;
    case MRL_DIST_I64: return 8;
    case MRL_DIST_U8: return 1;
    }
    return 0;
}

/* --------------------------------------------------------- collectives */

static mrl_status check_buf(const char *op, const void *buf, int64_t count, int dtype) {
    if (mrl_dist_dtype_size(dtype) == 0) return mrl_set_error(MRL_ERR_INVALID, "dist: %s: unknown dtype %d", op, dtype);
    if (count < 0) return mrl_set_error(MRL_ERR_INVALID, "dist: %s: count %lld", op, (long long)count);
    if (count > 0 && !buf) return mrl_set_error(MRL_ERR_INVALID, "dist: %s: NULL buffer", op);
    return MRL_OK;
}

static mrl_status check_op(const char *name, int dtype, int op) {
    if (op < MRL_DIST_SUM || op > MRL_DIST_MIN)
        return mrl_set_error(MRL_ERR_INVALID, "dist: %s: unknown op %d", name, op);
    if (op == MRL_DIST_MEAN && dtype == MRL_DIST_U8)
        return mrl_set_error(MRL_ERR_INVALID, "dist: %s: MEAN of u8 (its sum wraps): sum into a wider type", name);
    return MRL_OK;
}

mrl_status mrl_dist_barrier(mrl_dist *d) {
    mrl_status st = mrl_dist_begin(d, "barrier");
    if (st || d->size == 1) return st;
    void *req = NULL;
    int rc = d->be->ibarrier(d->coll, &req);
    return mrl_dist_wait_req(d, rc, req, "MPI_Ibarrier");
}

/* Runs a whole pipeline on the collectives' communicator. */
static mrl_status run_pipe(mrl_dist *d, void *buf, int64_t count, int dtype, int op, int scatter, int gather) {
    mrl_dist_pipe p;
    mrl_status st = mrl_dist_pipe_init(&p, d, d->coll, d->coll, buf, count, count, dtype, op, gather);
    if (!st) st = mrl_dist_scratch(d, (size_t)p.scratch_bytes);
    if (st) {
        mrl_dist_pipe_free(&p);
        return st;
    }
    p.scratch = d->scratch;
    if (scatter) {
        /* every stage 1 first, then the stage 2s as they come, in order: the
         * same sequence on every rank on the one communicator */
        while (!st && p.started < p.nseg) st = mrl_dist_pipe_start(&p);
    } else {
        for (int k = 0; k < p.nseg; k++) p.segs[k].stage = SEG_SUMMED; /* all-gather only */
        p.started = p.nseg;
    }
    if (!st) st = mrl_dist_wait(d, mrl_dist_pipe_progress, &p);
    mrl_dist_pipe_free(&p);
    return st;
}

mrl_status mrl_dist_allreduce(mrl_dist *d, void *buf, int64_t count, int dtype, int op) {
    mrl_status st = check_buf("allreduce", buf, count, dtype);
    if (!st) st = check_op("allreduce", dtype, op);
    if (!st) st = mrl_dist_begin(d, "allreduce");
    if (st || d->size == 1 || count == 0) return st;
    int64_t esz = mrl_dist_dtype_size(dtype);
    if (op == MRL_DIST_MAX || op == MRL_DIST_MIN) {
        /* exact whatever the order: MPI's own, in pieces that fit its int counts */
        int64_t chunk = (int64_t)1 << 30, n = (count + chunk - 1) / chunk;
        void **reqs = calloc((size_t)n, sizeof *reqs);
        if (!reqs) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
        for (int64_t i = 0; i < n && !st; i++) {
            int64_t c = count - i * chunk < chunk ? count - i * chunk : chunk;
            int e = d->be->iallreduce(d->coll, (char *)buf + i * chunk * esz, c, dtype, op, &reqs[i]);
            if (e) st = mrl_dist_fail(d, e, "MPI_Iallreduce");
        }
        if (!st) st = wait_reqs(d, reqs, (int)n, "MPI_Iallreduce");
        free(reqs);
        return st;
    }
    if (count * esz <= SMALL_ALLREDUCE / d->size) {
        /* every rank's whole buffer, added here in rank order */
        if ((st = mrl_dist_scratch(d, (size_t)(count * esz * d->size)))) return st;
        int64_t *rc = d->tmp, *rd = rc + d->size;
        for (int r = 0; r < d->size; r++) {
            rc[r] = count;
            rd[r] = r * count;
        }
        void *req = NULL;
        int e = d->be->iallgatherv(d->coll, buf, count, d->scratch, rc, rd, esz, &req);
        if ((st = mrl_dist_wait_req(d, e, req, "the all-gather of an all-reduce"))) return st;
        mrl_dist_combine(buf, d->scratch, count, d->size, dtype, op);
        return MRL_OK;
    }
    return run_pipe(d, buf, count, dtype, op, 1, 1);
}

mrl_status mrl_dist_reduce_scatter(mrl_dist *d, void *buf, int64_t count, int dtype, int op) {
    mrl_status st = check_buf("reduce_scatter", buf, count, dtype);
    if (!st) st = check_op("reduce_scatter", dtype, op);
    if (!st) st = mrl_dist_begin(d, "reduce_scatter");
    if (st || d->size == 1 || count == 0) return st;
    return run_pipe(d, buf, count, dtype, op, 1, 0);
}

mrl_status mrl_dist_allgather_shards(mrl_dist *d, void *buf, int64_t count, int dtype) {
    mrl_status st = check_buf("allgather_shards", buf, count, dtype);
    if (!st) st = mrl_dist_begin(d, "allgather_shards");
    if (st || d->size == 1 || count == 0) return st;
    return run_pipe(d, buf, count, dtype, MRL_DIST_SUM, 0, 1);
}

mrl_status mrl_dist_broadcast(mrl_dist *d, void *buf, int64_t bytes, int root) {
    if (bytes < 0 || (bytes > 0 && !buf))
        return mrl_set_error(MRL_ERR_INVALID, "dist: broadcast: %lld bytes at %p", (long long)bytes, buf);
    if (root < 0 || root >= d->size)
        return mrl_set_error(MRL_ERR_INVALID, "dist: broadcast: root %d of a world of %d", root, d->size);
    mrl_status st = mrl_dist_begin(d, "broadcast");
    if (st || d->size == 1 || bytes == 0) return st;
    /* pieces that fit MPI's int counts, all in flight at once */
    int64_t chunk = (int64_t)1 << 30, n = (bytes + chunk - 1) / chunk;
    void **reqs = calloc((size_t)n, sizeof *reqs);
    if (!reqs) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < n && !st; i++) {
        int64_t c = bytes - i * chunk < chunk ? bytes - i * chunk : chunk;
        int e = d->be->ibcast(d->coll, (char *)buf + i * chunk, c, root, &reqs[i]);
        if (e) st = mrl_dist_fail(d, e, "MPI_Ibcast");
    }
    if (!st) st = wait_reqs(d, reqs, (int)n, "MPI_Ibcast");
    free(reqs);
    return st;
}

mrl_status mrl_dist_tp_allreduce(void *d, float *buf, int64_t n) {
    return mrl_dist_allreduce(d, buf, n, MRL_DIST_F32, MRL_DIST_SUM);
}

mrl_status mrl_dist_tp_reduce_scatter(void *d, float *buf, int64_t n) {
    return mrl_dist_reduce_scatter(d, buf, n, MRL_DIST_F32, MRL_DIST_SUM);
}

mrl_status mrl_dist_tp_allgather(void *d, const float *mine, int64_t n, float *all) {
    return mrl_dist_allgather(d, mine, (int64_t)sizeof(float) * n, all);
}

mrl_status mrl_dist_cp_alltoallv(void *d, const float *send, const int64_t *send_counts, float *recv,
                                 const int64_t *recv_counts, int64_t unit) {
    return mrl_dist_alltoallv(d, send, send_counts, recv, recv_counts, (int64_t)sizeof(float) * unit);
}

mrl_status mrl_dist_allgather(mrl_dist *d, const void *send, int64_t bytes, void *recv) {
    if (bytes < 0 || (bytes > 0 && (!send || !recv)))
        return mrl_set_error(MRL_ERR_INVALID, "dist: allgather: %lld bytes from %p to %p", (long long)bytes, send,
                             recv);
    mrl_status st = mrl_dist_begin(d, "allgather");
    if (st || bytes == 0) return st;
    if (d->size == 1) {
        memmove(recv, send, (size_t)bytes);
        return MRL_OK;
    }
    /* the largest unit (a power of two dividing bytes) that makes the counts fit an int */
    int64_t unit = 1;
    while (unit < (1 << 20) && bytes % (2 * unit) == 0 && bytes / unit * d->size > (1 << 30)) unit *= 2;
    if (bytes / unit * d->size > (1 << 30))
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "dist: allgather: %lld bytes from each of %d ranks: too many for MPI",
                             (long long)bytes, d->size);
    int64_t *rc = d->tmp, *rd = rc + d->size;
    for (int r = 0; r < d->size; r++) {
        rc[r] = bytes / unit;
        rd[r] = r * (bytes / unit);
    }
    /* MPI refuses overlapping buffers; in place is how to say it */
    const void *s = (const char *)send == (const char *)recv + d->rank * bytes ? NULL : send;
    void *req = NULL;
    int e = d->be->iallgatherv(d->coll, s, bytes / unit, recv, rc, rd, unit, &req);
    return mrl_dist_wait_req(d, e, req, "MPI_Iallgatherv");
}

/* Point to point: sbytes[r] bytes from send + soff[r] to rank r and rbytes[r] from rank r into
 * recv + roff[r], in messages of at most 1 GiB; this rank's own by memmove. Not one
 * MPI_Ialltoallv: where a rank sent and received nothing (hybrid sharding's replicas, an
 * expert-parallel rank whose tokens all stay home), Open MPI 4.1's next nonblocking collective
 * on the communicator never completed and the job hung (tests/dist's test_send_pieces). */
static mrl_status exchange(mrl_dist *d, const void *send, const int64_t *soff, const int64_t *sbytes, void *recv,
                           const int64_t *roff, const int64_t *rbytes, const char *what) {
    const int64_t chunk = (int64_t)1 << 30;
    int64_t n_req = 0;
    for (int r = 0; r < d->size; r++)
        if (r != d->rank) n_req += (sbytes[r] + chunk - 1) / chunk + (rbytes[r] + chunk - 1) / chunk;
    void **reqs = n_req ? calloc((size_t)n_req, sizeof *reqs) : NULL;
    if (n_req && !reqs) return mrl_set_error(MRL_ERR_NOMEM, "dist: %s: out of memory", what);
    int64_t k = 0;
    int e = 0;
    for (int r = 0; r < d->size && !e; r++) {
        if (r == d->rank) {
            if (rbytes[r]) memmove((char *)recv + roff[r], (const char *)send + soff[r], (size_t)rbytes[r]);
            continue;
        }
        for (int64_t o = 0; o < rbytes[r] && !e; o += chunk)
            e = d->be->irecv(d->coll, (char *)recv + roff[r] + o, rbytes[r] - o < chunk ? rbytes[r] - o : chunk, r,
                             EXCHANGE_TAG, &reqs[k++]);
        for (int64_t o = 0; o < sbytes[r] && !e; o += chunk)
            e = d->be->isend(d->coll, (const char *)send + soff[r] + o, sbytes[r] - o < chunk ? sbytes[r] - o : chunk, r,
                             EXCHANGE_TAG, &reqs[k++]);
    }
    mrl_status st = e ? mrl_dist_fail(d, e, what) : wait_reqs(d, reqs, (int)k, what);
    free(reqs);
    return st;
}

mrl_status mrl_dist_alltoallv(mrl_dist *d, const void *send, const int64_t *send_counts, void *recv,
                              const int64_t *recv_counts, int64_t unit) {
    if (!send_counts || !recv_counts || unit < 1)
        return mrl_set_error(MRL_ERR_INVALID, "dist: alltoallv: counts %p, %p, unit %lld", (const void *)send_counts,
                             (const void *)recv_counts, (long long)unit);
    int64_t ns = 0, nr = 0;
    for (int r = 0; r < d->size; r++) {
        if (send_counts[r] < 0 || recv_counts[r] < 0)
            return mrl_set_error(MRL_ERR_INVALID, "dist: alltoallv: a negative count for rank %d", r);
        ns += send_counts[r];
        nr += recv_counts[r];
    }
    if ((ns > 0 && !send) || (nr > 0 && !recv))
        return mrl_set_error(MRL_ERR_INVALID, "dist: alltoallv: %lld units from %p, %lld into %p", (long long)ns, send,
                             (long long)nr, recv);
    mrl_status st = mrl_dist_begin(d, "alltoallv");
    if (st) return st;
    if (d->size == 1) {
        if (send_counts[0] != recv_counts[0])
            return mrl_set_error(MRL_ERR_INVALID, "dist: alltoallv: one rank sends itself %lld units and expects %lld",
                                 (long long)send_counts[0], (long long)recv_counts[0]);
        if (ns) memmove(recv, send, (size_t)(ns * unit));
        return MRL_OK;
    }
    if (send_counts[d->rank] != recv_counts[d->rank])
        return mrl_set_error(MRL_ERR_INVALID, "dist: alltoallv: rank %d sends itself %lld units and expects %lld", d->rank,
                             (long long)send_counts[d->rank], (long long)recv_counts[d->rank]);
    int64_t *so = calloc(4 * (size_t)d->size, sizeof *so), *sb = so + d->size, *ro = sb + d->size, *rb = ro + d->size;
    if (!so) return mrl_set_error(MRL_ERR_NOMEM, "dist: alltoallv: out of memory");
    int64_t s_off = 0, r_off = 0; /* in rank order, in bytes */
    for (int r = 0; r < d->size; r++) {
        sb[r] = send_counts[r] * unit, rb[r] = recv_counts[r] * unit;
        so[r] = s_off, ro[r] = r_off;
        s_off += sb[r], r_off += rb[r];
    }
    st = exchange(d, send, so, sb, recv, ro, rb, "alltoallv");
    free(so);
    return st;
}

mrl_status mrl_dist_send_pieces(mrl_dist *d, const void *send, int64_t count, const uint8_t *to, void *recv,
                                const int64_t *recv_counts, int64_t unit) {
    if (!to || count < 0 || unit < 1 || (count > 0 && !send))
        return mrl_set_error(MRL_ERR_INVALID, "dist: send_pieces: %lld units from %p, to %p, unit %lld", (long long)count,
                             send, (const void *)to, (long long)unit);
    int64_t nr = 0;
    if (to[d->rank]) {
        if (!recv_counts) return mrl_set_error(MRL_ERR_INVALID, "dist: send_pieces: a receiver without its counts");
        for (int r = 0; r < d->size; r++) {
            if (recv_counts[r] < 0) return mrl_set_error(MRL_ERR_INVALID, "dist: send_pieces: a negative count for rank %d", r);
            nr += recv_counts[r];
        }
        if (nr > 0 && !recv) return mrl_set_error(MRL_ERR_INVALID, "dist: send_pieces: %lld units into NULL", (long long)nr);
        if (recv_counts[d->rank] != (to[d->rank] ? count : 0))
            return mrl_set_error(MRL_ERR_INVALID, "dist: send_pieces: rank %d expects %lld units of itself, sends %lld",
                                 d->rank, (long long)recv_counts[d->rank], (long long)count);
    }
    mrl_status st = mrl_dist_begin(d, "send_pieces");
    if (st) return st;
    if (d->size == 1) {
        if (to[0] && count) memmove(recv, send, (size_t)(count * unit));
        return MRL_OK;
    }
    int64_t *so = calloc(4 * (size_t)d->size, sizeof *so), *sb = so + d->size, *ro = sb + d->size, *rb = ro + d->size;
    if (!so) return mrl_set_error(MRL_ERR_NOMEM, "dist: send_pieces: out of memory");
    int64_t r_off = 0;
    for (int r = 0; r < d->size; r++) { /* the same piece (offset 0) to every receiver */
        sb[r] = to[r] ? count * unit : 0;
        rb[r] = to[d->rank] ? recv_counts[r] * unit : 0;
        ro[r] = r_off;
        r_off += rb[r];
    }
    st = exchange(d, send, so, sb, recv, ro, rb, "send_pieces");
    free(so);
    return st;
}

mrl_status mrl_dist_allgather_blobs(mrl_dist *d, const void *data, int64_t bytes, const uint8_t **out_data,
                                    const int64_t **out_offsets) {
    *out_data = NULL;
    *out_offsets = NULL;
    if (bytes < 0 || (bytes > 0 && !data))
        return mrl_set_error(MRL_ERR_INVALID, "dist: allgather_blobs: %lld bytes at %p", (long long)bytes, data);
    mrl_status st = mrl_dist_begin(d, "allgather_blobs");
    if (st) return st;
    int64_t *sizes = d->tmp, *off = d->blob_off;
    if (d->size == 1) {
        off[0] = 0;
        off[1] = bytes;
    } else {
        /* the sizes first, then the blobs */
        int64_t *rc = sizes + d->size, *rd = rc + d->size;
        for (int r = 0; r < d->size; r++) {
            rc[r] = 1;
            rd[r] = r;
        }
        void *req = NULL;
        int e = d->be->iallgatherv(d->coll, &bytes, 1, sizes, rc, rd, 8, &req);
        if ((st = mrl_dist_wait_req(d, e, req, "the all-gather of the blob sizes"))) return st;
        off[0] = 0;
        for (int r = 0; r < d->size; r++) off[r + 1] = off[r] + sizes[r];
    }
    int64_t total = off[d->size];
    if (total > (int64_t)1 << 30 || total < 0)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "dist: allgather_blobs: %lld bytes in all: more than 1 GiB",
                             (long long)total);
    if ((size_t)total + 1 > d->blob_cap) {
        uint8_t *b = realloc(d->blob, (size_t)total + 1);
        if (!b) return mrl_set_error(MRL_ERR_NOMEM, "dist: out of memory for %lld bytes of blobs", (long long)total);
        d->blob = b;
        d->blob_cap = (size_t)total + 1;
    }
    if (d->size == 1) {
        if (bytes) memcpy(d->blob, data, (size_t)bytes);
    } else if (total > 0) {
        int64_t *rd = sizes + d->size;
        for (int r = 0; r < d->size; r++) rd[r] = off[r];
        void *req = NULL;
        /* (a NULL send would say "in place") */
        int e = d->be->iallgatherv(d->coll, bytes ? data : (const void *)&total, bytes, d->blob, sizes, rd, 1, &req);
        if ((st = mrl_dist_wait_req(d, e, req, "the all-gather of the blobs"))) return st;
    }
    *out_data = d->blob;
    *out_offsets = off;
    return MRL_OK;
}

/* ---- point to point (pipeline parallel) ----
 * A send copies its data and posts it; the message goes out while the rank goes on (its
 * requests are tested by every wait that follows), so that a schedule of sends and receives
 * never waits on a send: only a receive waits, for data the schedule guarantees is on its
 * way. mrl_dist_flush_sends waits for them all (the end of a step). Messages of up to 1 GiB
 * each (MPI's int counts). */
enum { P2P_CHUNK = 1 << 30, P2P_TAGS = 1000 };

/* test the sends going out; *left: how many are not done (their copies freed as they finish) */
static mrl_status progress_sends(mrl_dist *d, int *left) {
    int k = 0;
    mrl_status st = MRL_OK;
    for (int i = 0; i < d->n_sends; i++) {
        p2p_send *s = &d->sends[i];
        int busy = 0;
        for (int j = 0; j < s->n && !st; j++) {
            if (!s->reqs[j]) continue;
            int fin = 0, e = d->be->test(s->reqs[j], &fin);
            if (e) {
                s->reqs[j] = NULL;
                st = mrl_dist_fail(d, e, "MPI_Isend (pipeline)");
            } else if (fin) {
                s->reqs[j] = NULL;
            } else {
                busy = 1;
            }
        }
        if (busy) {
            d->sends[k++] = *s;
        } else {
            free(s->reqs);
            free(s->data);
        }
    }
    d->n_sends = k;
    if (left) *left = k;
    return st;
}

static mrl_status check_p2p(const mrl_dist *d, const char *op, const void *buf, int64_t bytes, int peer, int tag) {
    if (bytes < 0 || (bytes > 0 && !buf))
        return mrl_set_error(MRL_ERR_INVALID, "dist: %s: %lld bytes at %p", op, (long long)bytes, buf);
    if (peer < 0 || peer >= d->size || peer == d->rank)
        return mrl_set_error(MRL_ERR_INVALID, "dist: %s: rank %d of a world of %d (this rank is %d)", op, peer, d->size,
                             d->rank);
    if (tag < 0 || tag >= P2P_TAGS) return mrl_set_error(MRL_ERR_INVALID, "dist: %s: tag %d (0 .. %d)", op, tag, P2P_TAGS - 1);
    return MRL_OK;
}

mrl_status mrl_dist_send(mrl_dist *d, const void *buf, int64_t bytes, int dest, int tag) {
    mrl_status st = check_p2p(d, "send", buf, bytes, dest, tag);
    if (!st) st = mrl_dist_begin(d, "send");
    if (st) return st;
    if (d->n_sends == d->cap_sends) {
        int cap = d->cap_sends ? 2 * d->cap_sends : 8;
        p2p_send *grown = realloc(d->sends, sizeof *grown * (size_t)cap);
        if (!grown) return mrl_set_error(MRL_ERR_NOMEM, "dist: send: out of memory");
        d->sends = grown, d->cap_sends = cap;
    }
    int n = (int)((bytes + P2P_CHUNK - 1) / P2P_CHUNK);
    p2p_send s = {calloc((size_t)(n ? n : 1), sizeof(void *)), n, malloc((size_t)(bytes ? bytes : 1))};
    if (!s.reqs || !s.data) {
        free(s.reqs), free(s.data);
        return mrl_set_error(MRL_ERR_NOMEM, "dist: send: no memory for a copy of %lld bytes", (long long)bytes);
    }
    memcpy(s.data, buf, (size_t)bytes);
    int e = 0;
    for (int j = 0; j < n && !e; j++) {
        int64_t o = (int64_t)j * P2P_CHUNK;
        e = d->be->isend(d->coll, (char *)s.data + o, bytes - o < P2P_CHUNK ? bytes - o : P2P_CHUNK, dest, P2P_TAG + tag,
                         &s.reqs[j]);
    }
    d->sends[d->n_sends++] = s; /* (a failure leaves its posted pieces to the list) */
    if (e) return mrl_dist_fail(d, e, "MPI_Isend (pipeline)");
    return progress_sends(d, NULL);
}

typedef struct p2p_recv {
    mrl_dist *d;
    void **reqs;
    int n;
} p2p_recv;

static mrl_status poll_recv(void *ctx, int *done) {
    p2p_recv *q = ctx;
    mrl_status st = progress_sends(q->d, NULL); /* (the sends go on meanwhile) */
    req_set r = {q->d, q->reqs, q->n, "MPI_Irecv (pipeline)"};
    return st ? st : poll_reqs(&r, done);
}

mrl_status mrl_dist_recv(mrl_dist *d, void *buf, int64_t bytes, int src, int tag) {
    mrl_status st = check_p2p(d, "recv", buf, bytes, src, tag);
    if (!st) st = mrl_dist_begin(d, "recv");
    if (st || bytes == 0) return st;
    int n = (int)((bytes + P2P_CHUNK - 1) / P2P_CHUNK), e = 0;
    void **reqs = calloc((size_t)n, sizeof *reqs);
    if (!reqs) return mrl_set_error(MRL_ERR_NOMEM, "dist: recv: out of memory");
    for (int j = 0; j < n && !e; j++) {
        int64_t o = (int64_t)j * P2P_CHUNK;
        e = d->be->irecv(d->coll, (char *)buf + o, bytes - o < P2P_CHUNK ? bytes - o : P2P_CHUNK, src, P2P_TAG + tag,
                         &reqs[j]);
    }
    p2p_recv q = {d, reqs, n};
    st = e ? mrl_dist_fail(d, e, "MPI_Irecv (pipeline)") : mrl_dist_wait(d, poll_recv, &q);
    free(reqs);
    return st;
}

static mrl_status poll_sends(void *ctx, int *done) {
    int left = 0;
    mrl_status st = progress_sends(ctx, &left);
    *done = left == 0;
    return st;
}

mrl_status mrl_dist_flush_sends(mrl_dist *d) {
    mrl_status st = mrl_dist_begin(d, "flush_sends");
    if (st || d->n_sends == 0) return st;
    return mrl_dist_wait(d, poll_sends, d);
}

mrl_status mrl_dist_pp_send(void *d, const float *buf, int64_t n, int peer, int tag) {
    return mrl_dist_send(d, buf, (int64_t)sizeof(float) * n, peer, tag);
}

mrl_status mrl_dist_pp_recv(void *d, float *buf, int64_t n, int peer, int tag) {
    return mrl_dist_recv(d, buf, (int64_t)sizeof(float) * n, peer, tag);
}
