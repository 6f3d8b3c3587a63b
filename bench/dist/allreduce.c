/* All-reduce SUM of f32 buffers between the ranks of one job: moonrl's
 * mrl_dist_allreduce (core/dist: deterministic rank-order sums) and, when
 * the bench is built with MPI, plain MPI_Allreduce on MPI_COMM_WORLD in the
 * same process, size after size. bench/dist/allreduce.sh runs it under mpirun
 * (shared memory and TCP) next to torch.distributed's gloo
 * (bench/dist/allreduce_gloo.py) and prints the ratios.
 *
 * usage: mpirun -n 2 ... bench_allreduce [--impl LIST] [--min-mib 1]
 *        [--max-mib 256] [--factor 4] [--iters N] [--warmup W]
 * LIST: comma-separated moonrl, mpi (MPI_Allreduce), mpi_nb (MPI_Iallreduce
 * tested until done: the non-blocking collectives moonrl is built on);
 * "both" = moonrl,mpi (the default), "all" = all three.
 *
 * Each iteration: the buffer is refilled from this rank's source values (not
 * timed), a barrier, then one all-reduce, timed on every rank; an
 * iteration's time is the slowest rank's. The implementations take turns
 * call by call, so that they see the same load. Printed per size: the median and
 * the minimum over the iterations after the warm-up, the algorithm bandwidth
 * (bytes / time) and the bus bandwidth (2 (n-1)/n bytes / time). The result
 * of the first iteration is checked against the exact sum. One JSON line per
 * size and implementation on stdout (rank 0). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "moonrl/dist.h"
#include "moonrl/status.h"
#ifdef BENCH_HAVE_MPI
#include <mpi.h>
#endif

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void check(mrl_status st, const char *what) {
    if (st) {
        fprintf(stderr, "bench_allreduce: %s: %s\n", what, mrl_last_error());
        exit(1);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Small integers and halves: every partial sum is exact in f32, whatever the order. */
static float value(int64_t i, int rank) { return (float)(i % 1024) * 0.5f + (float)rank; }

typedef enum { IMPL_MOONRL, IMPL_MPI, IMPL_MPI_NB } impl;
static const char *impl_names[] = {"moonrl", "mpi", "mpi_nb"};

static void reduce(mrl_dist *d, impl which, float *buf, int64_t n) {
    if (which == IMPL_MOONRL) {
        check(mrl_dist_allreduce(d, buf, n, MRL_DIST_F32, MRL_DIST_SUM), "mrl_dist_allreduce");
        return;
    }
#ifdef BENCH_HAVE_MPI
    /* counts beyond INT_MAX do not occur here (256 MiB = 2^26 floats) */
    int rc;
    if (which == IMPL_MPI) {
        rc = MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    } else { /* the non-blocking one (libnbc), as moonrl's collectives are, tested until done */
        MPI_Request req;
        int done = 0;
        rc = MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
        while (rc == MPI_SUCCESS && !done) rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) {
        fprintf(stderr, "bench_allreduce: MPI_%sallreduce failed\n", which == IMPL_MPI ? "A" : "Ia");
        exit(1);
    }
#else
    (void)d;
    (void)buf;
    (void)n;
#endif
}

static void barrier(mrl_dist *d, impl which) {
#ifdef BENCH_HAVE_MPI
    if (which != IMPL_MOONRL) {
        MPI_Barrier(MPI_COMM_WORLD);
        return;
    }
#endif
    (void)which;
    check(mrl_dist_barrier(d), "mrl_dist_barrier");
}

int main(int argc, char **argv) {
    const char *impl_arg = "both";
    double min_mib = 1, max_mib = 256;
    int factor = 4, iters_arg = 0, warmup = 3;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench_allreduce: %s needs a value\n", a);
            return 2;
        }
        if (!strcmp(a, "--impl")) impl_arg = v;
        else if (!strcmp(a, "--min-mib")) min_mib = atof(v);
        else if (!strcmp(a, "--max-mib")) max_mib = atof(v);
        else if (!strcmp(a, "--factor")) factor = atoi(v);
        else if (!strcmp(a, "--iters")) iters_arg = atoi(v);
        else if (!strcmp(a, "--warmup")) warmup = atoi(v);
        else {
            fprintf(stderr, "bench_allreduce: unknown option %s\n", a);
            return 2;
        }
        i++;
    }
    if (factor < 2) factor = 2;
    /* a comma-separated list; "both": moonrl,mpi; "all": moonrl,mpi,mpi_nb */
    int n_impl = 0;
    impl impls[3];
    if (!strcmp(impl_arg, "both")) impl_arg = "moonrl,mpi";
    if (!strcmp(impl_arg, "all")) impl_arg = "moonrl,mpi,mpi_nb";
    for (const char *p = impl_arg; *p;) {
        size_t len = strcspn(p, ",");
        int found = 0;
        for (int k = 0; k < 3; k++)
            if (strlen(impl_names[k]) == len && !strncmp(p, impl_names[k], len) && n_impl < 3) {
                impls[n_impl++] = (impl)k;
                found = 1;
            }
        if (!found) {
            fprintf(stderr, "bench_allreduce: --impl: moonrl, mpi, mpi_nb (a list), both or all\n");
            return 2;
        }
#ifndef BENCH_HAVE_MPI
        if (impls[n_impl - 1] != IMPL_MOONRL) {
            fprintf(stderr, "bench_allreduce: built without MPI: no --impl %s\n", impl_names[impls[n_impl - 1]]);
            return 2;
        }
#endif
        p += len;
        if (*p == ',') p++;
    }
    if (!n_impl) {
        fprintf(stderr, "bench_allreduce: --impl: moonrl, mpi, mpi_nb (a list), both or all\n");
        return 2;
    }

    mrl_dist *d;
    check(mrl_dist_init(600, &d), "mrl_dist_init");
    int rank = mrl_dist_rank(d), size = mrl_dist_size(d);
    if (size < 2) {
        /* one rank: moonrl never loads MPI, so MPI_Allreduce cannot run */
        if (rank == 0) fprintf(stderr, "bench_allreduce: world size %d (run it under mpirun -n 2)\n", size);
        int k = 0;
        for (int i = 0; i < n_impl; i++)
            if (impls[i] == IMPL_MOONRL) impls[k++] = IMPL_MOONRL;
        n_impl = k;
        if (!n_impl) return 2;
    }

    int64_t max_n = (int64_t)(max_mib * (1 << 20)) / 4;
    float *buf = malloc((size_t)max_n * 4), *src = malloc((size_t)max_n * 4);
    if (!buf || !src) {
        fprintf(stderr, "bench_allreduce: out of memory\n");
        return 1;
    }
    for (int64_t i = 0; i < max_n; i++) src[i] = value(i, rank);
    memcpy(buf, src, (size_t)max_n * 4); /* every page touched before the first timing */

    for (double mib = min_mib; mib <= max_mib + 1e-9; mib *= factor) {
        int64_t n = (int64_t)(mib * (1 << 20)) / 4;
        double bytes = (double)n * 4;
        /* about 4 GiB of all-reduces a size, at least 10 and at most 100 timed iterations */
        int iters = iters_arg > 0 ? iters_arg : (int)fmin(100, fmax(10, 4.0 * (1 << 30) / bytes));
        /* the implementations take turns call by call (A B A B ...): a change of the machine's
         * load while a size runs falls on all of them alike */
        int per = warmup + iters;
        double *t = calloc((size_t)(n_impl * per), sizeof *t);
        for (int k = 0; k < per; k++)
            for (int w = 0; w < n_impl; w++) {
                impl which = impls[w];
                memcpy(buf, src, (size_t)n * 4);
                barrier(d, which);
                double t0 = now();
                reduce(d, which, buf, n);
                t[w * per + k] = now() - t0;
                if (k == 0) {
                    /* the exact sum: value(i, 0) + ... + value(i, size - 1) */
                    for (int64_t i = 0; i < n; i++) {
                        float want = 0;
                        for (int r = 0; r < size; r++) want += value(i, r);
                        if (buf[i] != want) {
                            fprintf(stderr, "bench_allreduce: %s: rank %d: wrong sum at %lld: %g, want %g\n",
                                    impl_names[which], rank, (long long)i, buf[i], want);
                            return 1;
                        }
                    }
                }
            }
        /* an iteration lasts as long as its slowest rank */
        check(mrl_dist_allreduce(d, t, n_impl * per, MRL_DIST_F64, MRL_DIST_MAX), "the times");
        for (int w = 0; w < n_impl; w++) {
            double *timed = t + w * per + warmup;
            qsort(timed, (size_t)iters, sizeof *timed, cmp_double);
            double med = iters % 2 ? timed[iters / 2] : 0.5 * (timed[iters / 2 - 1] + timed[iters / 2]);
            double algbw = bytes / med / 1e9, busbw = algbw * 2.0 * (size - 1) / size;
            if (rank == 0) {
                printf("{\"impl\": \"%s\", \"ranks\": %d, \"bytes\": %.0f, \"iters\": %d, \"median_s\": %.6e, "
                       "\"min_s\": %.6e, \"max_s\": %.6e, \"algbw_GBps\": %.3f, \"busbw_GBps\": %.3f}\n",
                       impl_names[impls[w]], size, bytes, iters, med, timed[0], timed[iters - 1], algbw, busbw);
                fflush(stdout);
            }
        }
        free(t);
    }
    free(buf);
    free(src);
    mrl_dist_finalize(d);
    return 0;
}
