/* The interface between libmoonrl's communicator (core/dist/dist.c) and the
 * MPI plugin libmoonrl_mpi.so (core/dist/mpi_plugin.c).
 *
 * libmoonrl never links MPI: the plugin is dlopen'ed when the world has
 * more than one rank, and everything moonrl does with MPI goes through this
 * table. The plugin stays a thin wrapper (one MPI call per entry); the
 * algorithms, the deadlines and the reports live in libmoonrl, so that a
 * plugin built against another MPI needs nothing else.
 *
 * Handles (communicators, requests) are opaque pointers owned by the
 * plugin. A request is freed by the plugin when test() reports it done;
 * requests abandoned after a timeout are never freed (the process is about
 * to end). Counts and displacements are in units of `unit` bytes (the plugin
 * makes a contiguous datatype of that size), so a buffer of up to 2^31
 * elements of any type fits MPI's int counts; a count or displacement that
 * still does not fit fails with MRL_DIST_ERR_COUNT. Every entry but abort
 * returns 0 or an error code that error_string describes. Only the thread
 * that called init calls the others (MPI_THREAD_FUNNELED). */
#pragma once
#include <stdint.h>
#include "moonrl/dist.h"

/* Raised whenever this table changes shape or meaning. */
#define MRL_DIST_PLUGIN_ABI 2
/* The plugin's one exported symbol: const mrl_dist_plugin *NAME(void). */
#define MRL_DIST_PLUGIN_ENTRY "mrl_dist_mpi_backend"
/* error codes of the plugin's own (MPI's are positive and small) */
#define MRL_DIST_ERR_COUNT (-1)  /* a count or displacement beyond INT_MAX */
#define MRL_DIST_ERR_NOMEM (-2)

typedef struct mrl_dist_plugin {
    int abi;          /* MRL_DIST_PLUGIN_ABI */
    int struct_size;  /* sizeof(mrl_dist_plugin) */
    const char *name; /* "mpi" */

    /* MPI_Init_thread (FUNNELED); errors return instead of aborting. */
    int (*init)(void);
    int (*finalize)(void);
    /* MPI_Abort on the world: ends every rank. */
    void (*abort)(int code);
    /* MPI_COMM_WORLD and this process's place in it. */
    int (*world)(void **comm, int *rank, int *size);
    /* This process's place among the ranks on its host (MPI_Comm_split_type
     * SHARED); blocking, called once at init when the launcher did not say. */
    int (*node_local)(void *comm, int *rank, int *size);
    /* The MPI library's version string (MPI_Get_library_version). */
    void (*library_version)(char *out, int cap);
    /* Text for an error code of this table. */
    void (*error_string)(int code, char *out, int cap);

    /* A copy of comm, usable once req is done (MPI_Comm_idup). */
    int (*comm_idup)(void *comm, void **out, void **req);
    void (*comm_free)(void *comm);

    /* Non-blocking collectives (MPI_I*). send == NULL in iallgatherv: in
     * place (this rank's piece is already at recv + rdispls[rank]). */
    int (*ialltoallv)(void *comm, const void *send, const int64_t *scounts, const int64_t *sdispls, void *recv,
                      const int64_t *rcounts, const int64_t *rdispls, int64_t unit, void **req);
    int (*iallgatherv)(void *comm, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                       const int64_t *rdispls, int64_t unit, void **req);
    /* In place; dtype and op are mrl_dist_dtype / mrl_dist_op (MAX, MIN). */
    int (*iallreduce)(void *comm, void *buf, int64_t count, int dtype, int op, void **req);
    int (*ibcast)(void *comm, void *buf, int64_t bytes, int root, void **req);
    int (*ibarrier)(void *comm, void **req);

    /* Point to point, for the timeout reports. source -1: any. */
    int (*isend)(void *comm, const void *buf, int64_t bytes, int dest, int tag, void **req);
    int (*irecv)(void *comm, void *buf, int64_t bytes, int source, int tag, void **req);
    int (*iprobe)(void *comm, int source, int tag, int *found, int *from, int64_t *bytes);

    /* *done = 1 once req finished (and then it is freed). */
    int (*test)(void *req, int *done);

    /* MPI_Comm_split (blocking: called after a barrier with the deadline, so
     * every rank is there): the ranks of comm with the same color, ordered by
     * key; this process's rank and size in it. color < 0: none (*out NULL). */
    int (*comm_split)(void *comm, int color, int key, void **out, int *rank, int *size);
} mrl_dist_plugin;

typedef const mrl_dist_plugin *(*mrl_dist_plugin_entry)(void);
