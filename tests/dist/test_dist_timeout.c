/* Deadlines (tests/dist/timeout.sh runs it under mpirun with 2 or 3 ranks):
 * rank 1 sleeps well past a 1-second timeout before OP (allreduce, barrier
 * or buckets: the finish of a bucket set); every other rank must get
 * MRL_ERR_TIMEOUT within a few seconds, with a message that names the
 * operation, the step, rank 1 as silent and the other waiting ranks, and
 * every later operation must fail at once. Each rank that checked all of
 * that prints "timeout test: ok on rank R". OP abandon: an all-reduce
 * where only rank 0 has the short timeout; ranks 2.. (30 s) must give up as
 * soon as rank 0's report reaches them. The job then ends non-zero:
 * the ranks that gave up exit without MPI_Finalize. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "check.h"
#include "moonrl/dist.h"
#include "moonrl/loop.h"

int main(int argc, char **argv) {
    const char *op = argc > 1 ? argv[1] : "allreduce";
    mrl_dist *d = NULL;
    CHECK_OK(mrl_dist_init(30, &d));
    if (!d) CHECK_DONE();
    int rank = mrl_dist_rank(d), size = mrl_dist_size(d);
    float x[1000];
    for (int i = 0; i < 1000; i++) x[i] = (float)i;
    mrl_dist_buckets *b = NULL;
    CHECK_OK(mrl_dist_buckets_create(d, x, 1000, 400, MRL_DIST_BUCKETS_ALLREDUCE, &b));
    CHECK_OK(mrl_dist_allreduce(d, x, 1000, MRL_DIST_F32, MRL_DIST_SUM)); /* all here */
    mrl_dist_set_step(d, 7);
    int abandon = !strcmp(op, "abandon");
    mrl_dist_set_timeout(d, abandon && rank >= 2 ? 30 : 1);
    if (rank == 1) {
        /* hung (or busy elsewhere) for longer than the others will wait */
        struct timespec t = {8, 0};
        nanosleep(&t, NULL);
    }
    double t0 = mrl_time_now();
    mrl_status st;
    const char *name = op;
    if (!strcmp(op, "barrier")) {
        st = mrl_dist_barrier(d);
    } else if (!strcmp(op, "buckets")) {
        mrl_dist_buckets_arm(b, 1);
        mrl_dist_buckets_ready(b, 0, 1000); /* all buckets start in the backward */
        st = mrl_dist_buckets_finish(b);
        name = "buckets_finish";
    } else {
        name = "allreduce";
        st = mrl_dist_allreduce(d, x, 1000, MRL_DIST_F32, MRL_DIST_SUM);
    }
    double waited = mrl_time_now() - t0;
    if (rank == 1) return 1; /* not reached in time: the others ended the job */
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", mrl_last_error());
    CHECK(st == MRL_ERR_TIMEOUT);
    /* (a rank that another's giving up reached first waited less than its own timeout) */
    double least = strstr(msg, "abandoned after") ? 0.0 : 0.9;
    CHECK(waited >= least && waited < 5);
    if (!(waited >= least && waited < 5)) fprintf(stderr, "rank %d: waited %.2f s\n", rank, waited);
    CHECK(mrl_dist_broken(d));
    char want[128];
    snprintf(want, sizeof want, "moonrl [rank %d/%d] %s #", rank, size, name);
    CHECK_STR_CONTAINS(msg, want);
    if (abandon && rank >= 2) {
        CHECK_STR_CONTAINS(msg, "at step 7 abandoned after");
        CHECK_STR_CONTAINS(msg, "rank 0 gave up waiting");
        CHECK_STR_CONTAINS(msg, "rank 0: waiting in allreduce #4 at step 7 for 1.0");
    } else if (!strstr(msg, "at step 7 timed out")) {
        /* the ranks' deadlines differ by when each began to wait: a loaded machine may let
         * another waiting rank's pass first, whose giving up this one then reports */
        CHECK_STR_CONTAINS(msg, "at step 7 abandoned after");
        CHECK_STR_CONTAINS(msg, "gave up waiting");
    }
    CHECK_STR_CONTAINS(msg, "rank 1: no answer (dead or hung)");
    for (int r = 0; r < size; r++) {
        if (r == 1 || r == rank) continue;
        snprintf(want, sizeof want, "rank %d: waiting in %s #", r, name);
        CHECK_STR_CONTAINS(msg, want);
    }
    /* broken: the next operation fails at once, with the same report */
    t0 = mrl_time_now();
    CHECK(mrl_dist_barrier(d) == MRL_ERR_TIMEOUT);
    CHECK(mrl_time_now() - t0 < 0.1);
    CHECK(strcmp(mrl_last_error(), msg) == 0);
    mrl_dist_buckets_free(b);
    mrl_dist_finalize(d); /* returns at once: no MPI_Finalize */
    if (!check_failures) printf("timeout test: ok on rank %d (%.2f s)\n", rank, waited);
    fflush(stdout);
    CHECK_DONE();
}
