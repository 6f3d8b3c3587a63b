/* libmoonrl_mpi.so: the table of core/dist/backend.h over MPI. One MPI call
 * per entry; everything else (algorithms, deadlines, reports) is in
 * libmoonrl. Built only where MPI is found; loaded with RTLD_GLOBAL so that
 * Open MPI's own components find libmpi's symbols. */
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "backend.h"

/* A request and what MPI reads until it completes: the int copies of the
 * count and displacement arrays of the v-collectives. */
typedef struct req {
    MPI_Request r;
    int *ints;
} req;

typedef struct comm {
    MPI_Comm c;
} comm;

static comm world_comm;

/* ------------------------------------------------------------- helpers */

static int new_req(int n_ints, req **out) {
    req *q = calloc(1, sizeof *q);
    if (!q) return MRL_DIST_ERR_NOMEM;
    if (n_ints > 0 && !(q->ints = malloc((size_t)n_ints * sizeof(int)))) {
        free(q);
        return MRL_DIST_ERR_NOMEM;
    }
    q->r = MPI_REQUEST_NULL;
    *out = q;
    return 0;
}

static void free_req(req *q) {
    free(q->ints);
    free(q);
}

/* The started request, or the error with the request freed. */
static int started(int rc, req *q, void **out) {
    if (rc != MPI_SUCCESS) {
        free_req(q);
        return rc;
    }
    *out = q;
    return 0;
}

static int to_ints(const int64_t *v, int n, int *out) {
    for (int i = 0; i < n; i++) {
        if (v[i] < 0 || v[i] > INT_MAX) return MRL_DIST_ERR_COUNT;
        out[i] = (int)v[i];
    }
    return 0;
}

/* A contiguous type of `unit` bytes; a few sizes are ever used, so they are
 * made once and kept until MPI_Finalize. */
enum { N_TYPES = 16 };
static struct {
    int64_t unit;
    MPI_Datatype type;
} types[N_TYPES];
static int n_types;

static int unit_type(int64_t unit, MPI_Datatype *out) {
    if (unit == 1) {
        *out = MPI_BYTE;
        return 0;
    }
    if (unit < 1 || unit > INT_MAX) return MRL_DIST_ERR_COUNT;
    for (int i = 0; i < n_types; i++)
        if (types[i].unit == unit) {
            *out = types[i].type;
            return 0;
        }
    MPI_Datatype t;
    int rc = MPI_Type_contiguous((int)unit, MPI_BYTE, &t);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&t);
    if (rc != MPI_SUCCESS) return rc;
    if (n_types < N_TYPES) {
        types[n_types].unit = unit;
        types[n_types++].type = t;
    }
    *out = t; /* beyond the cache: leaked, one per call (never happens: libmoonrl uses <= 4 units) */
    return 0;
}

static MPI_Datatype dtype_of(int dtype) {
    switch (dtype) {
    case MRL_DIST_F32: return MPI_FLOAT;
    case MRL_DIST_F64: return MPI_DOUBLE;
    case MRL_DIST_I64: return MPI_INT64_T;
    case MRL_DIST_U8: return MPI_UINT8_T;
    }
    return MPI_DATATYPE_NULL;
}

/* ------------------------------------------------------------ the table */

static int p_init(void) {
    int flag = 0, provided = 0;
    MPI_Finalized(&flag);
    if (flag) return MPI_ERR_OTHER; /* MPI cannot start twice in a process */
    MPI_Initialized(&flag);
    if (!flag) {
        int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
        if (rc != MPI_SUCCESS) return rc;
    }
    /* errors come back as codes: libmoonrl turns them into a status */
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    world_comm.c = MPI_COMM_WORLD;
    return 0;
}

static int p_finalize(void) {
    for (int i = 0; i < n_types; i++) MPI_Type_free(&types[i].type);
    n_types = 0;
    return MPI_Finalize();
}

static void p_abort(int code) { MPI_Abort(MPI_COMM_WORLD, code); }

static int p_world(void **c, int *rank, int *size) {
    int rc = MPI_Comm_rank(MPI_COMM_WORLD, rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(MPI_COMM_WORLD, size);
    *c = &world_comm;
    return rc;
}

static int p_node_local(void *c, int *rank, int *size) {
    MPI_Comm local;
    int rc = MPI_Comm_split_type(((comm *)c)->c, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Comm_rank(local, rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(local, size);
    MPI_Comm_free(&local);
    return rc;
}

static int p_comm_split(void *c, int color, int key, void **out, int *rank, int *size) {
    comm *n = calloc(1, sizeof *n);
    if (!n) return MRL_DIST_ERR_NOMEM;
    int rc = MPI_Comm_split(((comm *)c)->c, color < 0 ? MPI_UNDEFINED : color, key, &n->c);
    if (rc == MPI_SUCCESS && n->c == MPI_COMM_NULL) { /* color < 0: not a member */
        free(n);
        *out = NULL;
        *rank = -1;
        *size = 0;
        return MPI_SUCCESS;
    }
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(n->c, rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(n->c, size);
    if (rc != MPI_SUCCESS) {
        free(n);
        return rc;
    }
    *out = n;
    return MPI_SUCCESS;
}

static void p_library_version(char *out, int cap) {
    char v[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    if (cap <= 0) return;
    out[0] = 0;
    if (MPI_Get_library_version(v, &len) != MPI_SUCCESS) return;
    /* the first line is enough ("Open MPI v4.1.4, package: ...") */
    char *nl = strchr(v, '\n');
    if (nl) *nl = 0;
    strncpy(out, v, (size_t)cap - 1);
    out[cap - 1] = 0;
}

static void p_error_string(int code, char *out, int cap) {
    if (cap <= 0) return;
    if (code == MRL_DIST_ERR_COUNT) {
        strncpy(out, "a count or displacement does not fit MPI's int", (size_t)cap - 1);
    } else if (code == MRL_DIST_ERR_NOMEM) {
        strncpy(out, "out of memory", (size_t)cap - 1);
    } else {
        char s[MPI_MAX_ERROR_STRING];
        int len = 0;
        if (MPI_Error_string(code, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", code);
        strncpy(out, s, (size_t)cap - 1);
    }
    out[cap - 1] = 0;
}

static int p_comm_idup(void *c, void **out, void **r) {
    comm *n = calloc(1, sizeof *n);
    req *q;
    if (!n) return MRL_DIST_ERR_NOMEM;
    int rc = new_req(0, &q);
    if (rc) {
        free(n);
        return rc;
    }
    rc = MPI_Comm_idup(((comm *)c)->c, &n->c, &q->r);
    if (rc != MPI_SUCCESS) {
        free(n);
        free_req(q);
        return rc;
    }
    *out = n;
    *r = q;
    return 0;
}

static void p_comm_free(void *c) {
    comm *n = c;
    if (!n || n == &world_comm) return;
    MPI_Comm_free(&n->c);
    free(n);
}

static int p_ialltoallv(void *c, const void *send, const int64_t *scounts, const int64_t *sdispls, void *recv,
                        const int64_t *rcounts, const int64_t *rdispls, int64_t unit, void **out) {
    MPI_Comm mc = ((comm *)c)->c;
    int size, rc;
    MPI_Datatype t;
    req *q;
    MPI_Comm_size(mc, &size);
    if ((rc = unit_type(unit, &t))) return rc;
    if ((rc = new_req(4 * size, &q))) return rc;
    int *sc = q->ints, *sd = sc + size, *rc_ = sd + size, *rd = rc_ + size;
    if ((rc = to_ints(scounts, size, sc)) || (rc = to_ints(sdispls, size, sd)) || (rc = to_ints(rcounts, size, rc_)) ||
        (rc = to_ints(rdispls, size, rd))) {
        free_req(q);
        return rc;
    }
    return started(MPI_Ialltoallv(send, sc, sd, t, recv, rc_, rd, t, mc, &q->r), q, out);
}

static int p_iallgatherv(void *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                         const int64_t *rdispls, int64_t unit, void **out) {
    MPI_Comm mc = ((comm *)c)->c;
    int size, rc;
    MPI_Datatype t;
    req *q;
    MPI_Comm_size(mc, &size);
    if (scount < 0 || scount > INT_MAX) return MRL_DIST_ERR_COUNT;
    if ((rc = unit_type(unit, &t))) return rc;
    if ((rc = new_req(2 * size, &q))) return rc;
    int *rc_ = q->ints, *rd = rc_ + size;
    if ((rc = to_ints(rcounts, size, rc_)) || (rc = to_ints(rdispls, size, rd))) {
        free_req(q);
        return rc;
    }
    const void *s = send ? send : MPI_IN_PLACE;
    return started(MPI_Iallgatherv(s, (int)scount, t, recv, rc_, rd, t, mc, &q->r), q, out);
}

static int p_iallreduce(void *c, void *buf, int64_t count, int dtype, int op, void **out) {
    MPI_Datatype t = dtype_of(dtype);
    MPI_Op o = op == MRL_DIST_MAX ? MPI_MAX : op == MRL_DIST_MIN ? MPI_MIN : MPI_OP_NULL;
    req *q;
    int rc;
    if (count < 0 || count > INT_MAX) return MRL_DIST_ERR_COUNT;
    if (t == MPI_DATATYPE_NULL || o == MPI_OP_NULL) return MPI_ERR_ARG;
    if ((rc = new_req(0, &q))) return rc;
    return started(MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, t, o, ((comm *)c)->c, &q->r), q, out);
}

static int p_ibcast(void *c, void *buf, int64_t bytes, int root, void **out) {
    req *q;
    int rc;
    if (bytes < 0 || bytes > INT_MAX) return MRL_DIST_ERR_COUNT;
    if ((rc = new_req(0, &q))) return rc;
    return started(MPI_Ibcast(buf, (int)bytes, MPI_BYTE, root, ((comm *)c)->c, &q->r), q, out);
}

static int p_ibarrier(void *c, void **out) {
    req *q;
    int rc;
    if ((rc = new_req(0, &q))) return rc;
    return started(MPI_Ibarrier(((comm *)c)->c, &q->r), q, out);
}

static int p_isend(void *c, const void *buf, int64_t bytes, int dest, int tag, void **out) {
    req *q;
    int rc;
    if (bytes < 0 || bytes > INT_MAX) return MRL_DIST_ERR_COUNT;
    if ((rc = new_req(0, &q))) return rc;
    return started(MPI_Isend(buf, (int)bytes, MPI_BYTE, dest, tag, ((comm *)c)->c, &q->r), q, out);
}

static int p_irecv(void *c, void *buf, int64_t bytes, int source, int tag, void **out) {
    req *q;
    int rc;
    if (bytes < 0 || bytes > INT_MAX) return MRL_DIST_ERR_COUNT;
    if ((rc = new_req(0, &q))) return rc;
    int src = source < 0 ? MPI_ANY_SOURCE : source;
    return started(MPI_Irecv(buf, (int)bytes, MPI_BYTE, src, tag, ((comm *)c)->c, &q->r), q, out);
}

static int p_iprobe(void *c, int source, int tag, int *found, int *from, int64_t *bytes) {
    MPI_Status st;
    int n = 0;
    int rc = MPI_Iprobe(source < 0 ? MPI_ANY_SOURCE : source, tag, ((comm *)c)->c, found, &st);
    if (rc != MPI_SUCCESS || !*found) return rc;
    MPI_Get_count(&st, MPI_BYTE, &n);
    *from = st.MPI_SOURCE;
    *bytes = n;
    return 0;
}

static int p_test(void *r, int *done) {
    req *q = r;
    int flag = 0;
    int rc = MPI_Test(&q->r, &flag, MPI_STATUS_IGNORE);
    *done = rc != MPI_SUCCESS || flag;
    if (*done) free_req(q);
    return rc;
}

static const mrl_dist_plugin table = {
    .abi = MRL_DIST_PLUGIN_ABI,
    .struct_size = sizeof(mrl_dist_plugin),
    .name = "mpi",
    .init = p_init,
    .finalize = p_finalize,
    .abort = p_abort,
    .world = p_world,
    .node_local = p_node_local,
    .library_version = p_library_version,
    .error_string = p_error_string,
    .comm_idup = p_comm_idup,
    .comm_free = p_comm_free,
    .ialltoallv = p_ialltoallv,
    .iallgatherv = p_iallgatherv,
    .iallreduce = p_iallreduce,
    .ibcast = p_ibcast,
    .ibarrier = p_ibarrier,
    .isend = p_isend,
    .irecv = p_irecv,
    .iprobe = p_iprobe,
    .test = p_test,
    .comm_split = p_comm_split,
};

__attribute__((visibility("default"))) const mrl_dist_plugin *mrl_dist_mpi_backend(void) { return &table; }
