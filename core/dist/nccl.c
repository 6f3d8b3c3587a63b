/* The NCCL communicator between the GPUs of a job (moonrl/dist_nccl.h).
 *
 * The NCCL communicator is non-blocking (ncclConfig.blocking = 0), so that
 * no NCCL call can hold the thread past the deadline: creation, the
 * queueing of a collective and its completion are all polled
 * (ncclCommGetAsyncError, cudaStreamQuery) against the clock, and
 * ncclCommAbort ends whatever a late or failed rank left behind.
 *
 * Each call goes through three waits, each under the same deadline:
 *   1. its inputs: an event recorded on the wait stream, polled on the host
 *      (so that nothing is queued behind work that may never finish, and an
 *      abort never frees what a queued kernel still needs);
 *   2. the queueing: a non-blocking NCCL call may return ncclInProgress;
 *   3. the collective itself, on the communicator's stream. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "moonrl/dist_nccl.h"
#include "base/log.h"
#include "base/error.h"

#ifdef MRL_HAVE_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "core/dist/nccl.c needs NCCL >= 2.14 (non-blocking communicators, ncclCommFinalize)"
#endif

struct mrl_nccl {
    ncclComm_t comm;          /* NULL once aborted */
    cudaStream_t stream;      /* where the collectives run */
    cudaStream_t wait_stream; /* the inputs' stream (NULL: legacy default) */
    cudaEvent_t inputs;       /* recorded on wait_stream before each call */
    int rank, size, device;
    double timeout; /* seconds; 0 = none */
    int64_t seq;    /* operations started */
    int broken;
    mrl_status broken_status;
    char broken_msg[768];
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Between two polls: spin for the first millisecond (small collectives
 * finish in microseconds), then sleep, longer as the wait grows. */
static void pause_poll(double waited) {
    if (waited < 1e-3) return;
    struct timespec ts = {0, waited < 0.1 ? 20000 : 500000};
    nanosleep(&ts, NULL);
}

static int late(double t0, double timeout) { return timeout > 0 && now_s() - t0 > timeout; }

/* The calling thread's device switched to the communicator's for a call. */
typedef struct device_guard {
    int prev;
} device_guard;

static mrl_status device_enter(int device, device_guard *g) {
    g->prev = -1;
    if (cudaGetDevice(&g->prev) != cudaSuccess) g->prev = -1;
    if (g->prev == device) return MRL_OK;
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess)
        return mrl_set_error(MRL_ERR_DEVICE, "NCCL: cudaSetDevice(%d) failed: %s", device, cudaGetErrorString(e));
    return MRL_OK;
}

static void device_leave(int device, const device_guard *g) {
    if (g->prev >= 0 && g->prev != device) cudaSetDevice(g->prev);
}

static const char *nccl_detail(ncclComm_t comm) {
    const char *s = ncclGetLastError(comm);
    return s && *s ? s : "no detail";
}

/* Break the communicator: abort NCCL, keep the message for every later call. */
static mrl_status nc_break(mrl_nccl *nc, mrl_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(nc->broken_msg, sizeof nc->broken_msg, fmt, ap);
    va_end(ap);
    nc->broken = 1;
    nc->broken_status = status;
    if (nc->comm) {
        ncclCommAbort(nc->comm);
        nc->comm = NULL;
    }
    mrl_logf(MRL_LOG_ERROR, "%s", nc->broken_msg);
    return mrl_set_error(status, "%s", nc->broken_msg);
}

static int64_t dtype_bytes(int dtype) {
    switch (dtype) {
    case MRL_DIST_F32: return 4;
    case MRL_DIST_F64: return 8;
    case MRL_DIST_I64: return 8;
    case MRL_DIST_U8: return 1;
    case MRL_NCCL_BF16: return 2;
    case MRL_NCCL_F16: return 2;
    }
    return 0;
}

static ncclDataType_t nccl_dtype(int dtype) {
    switch (dtype) {
    case MRL_DIST_F64: return ncclFloat64;
    case MRL_DIST_I64: return ncclInt64;
    case MRL_DIST_U8: return ncclUint8;
    case MRL_NCCL_BF16: return ncclBfloat16;
    case MRL_NCCL_F16: return ncclFloat16;
    default: return ncclFloat32;
    }
}

static int nccl_op(int op, ncclRedOp_t *out) {
    switch (op) {
    case MRL_DIST_SUM: *out = ncclSum; return 1;
    case MRL_DIST_MEAN: *out = ncclAvg; return 1;
    case MRL_DIST_MAX: *out = ncclMax; return 1;
    case MRL_DIST_MIN: *out = ncclMin; return 1;
    }
    return 0;
}

static mrl_status check_types(const char *name, int dtype, int op, ncclRedOp_t *rop) {
    if (!dtype_bytes(dtype)) return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: unknown dtype %d", name, dtype);
    if (!nccl_op(op, rop)) return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: unknown op %d", name, op);
    return MRL_OK;
}

/* A device pointer of the communicator's GPU (or managed memory): a host
 * pointer would make the kernel fault and poison the whole CUDA context. */
static mrl_status check_ptr(const mrl_nccl *nc, const char *name, const char *what, const void *p) {
    if (nc->broken) return mrl_set_error(nc->broken_status, "%s", nc->broken_msg);
    if (!p) return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: %s is NULL", name, what);
    struct cudaPointerAttributes a;
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: %s (%p) is not device memory: %s", name, what, p,
                             cudaGetErrorString(e));
    }
    if (a.type == cudaMemoryTypeManaged) return MRL_OK;
    if (a.type != cudaMemoryTypeDevice)
        return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: %s (%p) is not device memory", name, what, p);
    if (a.device != nc->device)
        return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: %s (%p) is on cuda:%d, the communicator on cuda:%d", name,
                             what, p, a.device, nc->device);
    return MRL_OK;
}

/* One collective in progress. */
typedef struct op_ctx {
    const char *name;
    int64_t seq;
    double t0;
    device_guard dev;
} op_ctx;

static mrl_status op_begin(mrl_nccl *nc, const char *name, op_ctx *c) {
    if (nc->broken) return mrl_set_error(nc->broken_status, "%s", nc->broken_msg);
    c->name = name;
    c->seq = nc->seq++;
    c->t0 = now_s();
    return device_enter(nc->device, &c->dev);
}

static mrl_status op_end(mrl_nccl *nc, op_ctx *c, mrl_status st) {
    device_leave(nc->device, &c->dev);
    return st;
}

static mrl_status op_timeout(mrl_nccl *nc, const op_ctx *c, const char *waiting_for) {
    return nc_break(nc, MRL_ERR_TIMEOUT,
                    "NCCL %s #%lld on rank %d of %d (cuda:%d) did not finish within %g s: it was waiting for %s; "
                    "the NCCL communicator is aborted",
                    c->name, (long long)c->seq, nc->rank, nc->size, nc->device, nc->timeout, waiting_for);
}

static mrl_status op_cuda_error(mrl_nccl *nc, const op_ctx *c, const char *what, cudaError_t e) {
    return nc_break(nc, MRL_ERR_DEVICE, "NCCL %s #%lld on rank %d of %d (cuda:%d): %s failed: %s", c->name,
                    (long long)c->seq, nc->rank, nc->size, nc->device, what, cudaGetErrorString(e));
}

static mrl_status op_nccl_error(mrl_nccl *nc, const op_ctx *c, const char *what, ncclResult_t r) {
    return nc_break(nc, MRL_ERR_DEVICE, "NCCL %s #%lld on rank %d of %d (cuda:%d): %s: %s (%s)", c->name,
                    (long long)c->seq, nc->rank, nc->size, nc->device, what, ncclGetErrorString(r),
                    nccl_detail(nc->comm));
}

/* Wait 1: the work queued on the wait stream before the call. */
static mrl_status wait_inputs(mrl_nccl *nc, const op_ctx *c) {
    cudaError_t e = cudaEventRecord(nc->inputs, nc->wait_stream);
    if (e != cudaSuccess) return op_cuda_error(nc, c, "cudaEventRecord on the wait stream", e);
    for (;;) {
        e = cudaEventQuery(nc->inputs);
        if (e == cudaSuccess) return MRL_OK;
        if (e != cudaErrorNotReady) return op_cuda_error(nc, c, "waiting for the inputs (cudaEventQuery)", e);
        if (late(c->t0, nc->timeout))
            return op_timeout(nc, c, "its inputs (the work queued on the wait stream before it)");
        pause_poll(now_s() - c->t0);
    }
}

/* Waits 2 and 3: r is what the NCCL call returned. */
static mrl_status wait_done(mrl_nccl *nc, const op_ctx *c, ncclResult_t r) {
    ncclResult_t async = r;
    while (async == ncclInProgress) {
        if (late(c->t0, nc->timeout)) return op_timeout(nc, c, "NCCL to queue it");
        pause_poll(now_s() - c->t0);
        ncclResult_t q = ncclCommGetAsyncError(nc->comm, &async);
        if (q != ncclSuccess) async = q;
    }
    if (async != ncclSuccess) return op_nccl_error(nc, c, "queueing failed", async);
    for (;;) {
        cudaError_t e = cudaStreamQuery(nc->stream);
        ncclResult_t q = ncclCommGetAsyncError(nc->comm, &async);
        if (q != ncclSuccess) async = q;
        if (async != ncclSuccess && async != ncclInProgress) return op_nccl_error(nc, c, "NCCL reported an error", async);
        if (e == cudaSuccess) return MRL_OK;
        if (e != cudaErrorNotReady) return op_cuda_error(nc, c, "the collective (cudaStreamQuery)", e);
        if (late(c->t0, nc->timeout))
            return op_timeout(nc, c, "the collective to complete (another rank did not join it, or is hung)");
        pause_poll(now_s() - c->t0);
    }
}

/* ---- Creation ------------------------------------------------------------ */

/* What rank 0 sends: whether it has an id, and the id. */
typedef struct id_message {
    int64_t ok;
    ncclUniqueId id;
} id_message;

static void nc_release(mrl_nccl *nc) {
    if (nc->comm) ncclCommAbort(nc->comm);
    if (nc->inputs) cudaEventDestroy(nc->inputs);
    if (nc->stream) cudaStreamDestroy(nc->stream);
    free(nc);
}

/* This rank's own setup: device, stream, event. */
static mrl_status local_setup(mrl_nccl *nc) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return mrl_set_error(MRL_ERR_DEVICE, "NCCL on rank %d: no CUDA device visible (%s)", nc->rank,
                             cudaGetErrorString(e));
    }
    if (nc->device < 0 || nc->device >= n)
        return mrl_set_error(MRL_ERR_INVALID, "NCCL on rank %d: device %d does not exist (%d CUDA device%s visible)",
                             nc->rank, nc->device, n, n == 1 ? "" : "s");
    if ((e = cudaSetDevice(nc->device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&nc->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&nc->inputs, cudaEventDisableTiming)) != cudaSuccess)
        return mrl_set_error(MRL_ERR_DEVICE, "NCCL on rank %d: setting up cuda:%d failed: %s", nc->rank, nc->device,
                             cudaGetErrorString(e));
    return MRL_OK;
}

mrl_status mrl_nccl_create(mrl_dist *d, int device, double timeout, mrl_nccl **out) {
    if (!out) return mrl_set_error(MRL_ERR_INVALID, "mrl_nccl_create: out is NULL");
    *out = NULL;
    if (!d) return mrl_set_error(MRL_ERR_INVALID, "mrl_nccl_create: no MPI communicator");
    if (!(timeout >= 0)) return mrl_set_error(MRL_ERR_INVALID, "mrl_nccl_create: timeout %g is not >= 0", timeout);
    mrl_nccl *nc = calloc(1, sizeof *nc);
    if (!nc) return mrl_set_error(MRL_ERR_NOMEM, "mrl_nccl_create: out of memory");
    nc->rank = mrl_dist_rank(d);
    nc->size = mrl_dist_size(d);
    nc->device = device;
    nc->timeout = timeout;
    device_guard g;
    g.prev = -1;
    if (cudaGetDevice(&g.prev) != cudaSuccess) {
        cudaGetLastError();
        g.prev = -1;
    }

    /* Every rank learns whether all could set up their GPU before any of
     * them waits in NCCL's bootstrap for a rank that never comes. */
    mrl_status local = local_setup(nc);
    char local_msg[512];
    snprintf(local_msg, sizeof local_msg, "%s", local == MRL_OK ? "" : mrl_last_error());
    int64_t all_ok = local == MRL_OK;
    mrl_status st = mrl_dist_allreduce(d, &all_ok, 1, MRL_DIST_I64, MRL_DIST_MIN);
    if (st != MRL_OK) goto fail;
    if (local != MRL_OK) {
        st = mrl_set_error(local, "%s", local_msg);
        goto fail;
    }
    if (!all_ok) {
        st = mrl_set_error(MRL_ERR_DEVICE, "NCCL on rank %d: another rank could not set up its GPU", nc->rank);
        goto fail;
    }

    id_message msg;
    memset(&msg, 0, sizeof msg);
    ncclResult_t r = ncclSuccess;
    if (nc->rank == 0) {
        r = ncclGetUniqueId(&msg.id);
        msg.ok = r == ncclSuccess;
    }
    st = mrl_dist_broadcast(d, &msg, (int64_t)sizeof msg, 0);
    if (st != MRL_OK) goto fail;
    if (!msg.ok) {
        st = nc->rank == 0 ? mrl_set_error(MRL_ERR_DEVICE, "NCCL: ncclGetUniqueId failed: %s (%s)",
                                           ncclGetErrorString(r), nccl_detail(NULL))
                           : mrl_set_error(MRL_ERR_DEVICE, "NCCL on rank %d: rank 0 could not make the NCCL id",
                                           nc->rank);
        goto fail;
    }

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    double t0 = now_s();
    r = ncclCommInitRankConfig(&nc->comm, nc->size, msg.id, nc->rank, &config);
    ncclResult_t async = r;
    while (async == ncclInProgress) {
        if (late(t0, timeout)) {
            st = mrl_set_error(MRL_ERR_TIMEOUT,
                               "NCCL on rank %d of %d (cuda:%d): creating the communicator did not finish within "
                               "%g s (another rank did not join); aborted",
                               nc->rank, nc->size, device, timeout);
            mrl_logf(MRL_LOG_ERROR, "%s", mrl_last_error());
            goto fail;
        }
        pause_poll(now_s() - t0);
        ncclResult_t q = ncclCommGetAsyncError(nc->comm, &async);
        if (q != ncclSuccess) async = q;
    }
    if (async != ncclSuccess) {
        st = mrl_set_error(MRL_ERR_DEVICE, "NCCL on rank %d of %d (cuda:%d): ncclCommInitRankConfig failed: %s (%s)",
                           nc->rank, nc->size, device, ncclGetErrorString(async), nccl_detail(nc->comm));
        goto fail;
    }
    if (g.prev >= 0 && g.prev != device) cudaSetDevice(g.prev);
    *out = nc;
    return MRL_OK;

fail:
    nc_release(nc);
    if (g.prev >= 0 && g.prev != device) cudaSetDevice(g.prev);
    return st;
}

void mrl_nccl_free(mrl_nccl *nc) {
    if (!nc) return;
    device_guard g;
    if (device_enter(nc->device, &g) != MRL_OK) g.prev = -1;
    if (nc->comm && !nc->broken) {
        /* flush, within the deadline; abort what is late */
        double t0 = now_s();
        ncclResult_t async = ncclCommFinalize(nc->comm);
        while (async == ncclInProgress && !late(t0, nc->timeout)) {
            pause_poll(now_s() - t0);
            ncclResult_t q = ncclCommGetAsyncError(nc->comm, &async);
            if (q != ncclSuccess) async = q;
        }
        if (async == ncclSuccess) {
            ncclCommDestroy(nc->comm);
            nc->comm = NULL;
        }
    }
    int device = nc->device;
    nc_release(nc); /* aborts the communicator if still there */
    device_leave(device, &g);
}

int mrl_nccl_rank(const mrl_nccl *nc) { return nc ? nc->rank : -1; }
int mrl_nccl_size(const mrl_nccl *nc) { return nc ? nc->size : 0; }
int mrl_nccl_device(const mrl_nccl *nc) { return nc ? nc->device : -1; }
void *mrl_nccl_stream(const mrl_nccl *nc) { return nc ? (void *)nc->stream : NULL; }
int mrl_nccl_broken(const mrl_nccl *nc) { return nc ? nc->broken : 0; }
int64_t mrl_nccl_seq(const mrl_nccl *nc) { return nc ? nc->seq : 0; }

void mrl_nccl_set_timeout(mrl_nccl *nc, double seconds) {
    if (nc && seconds >= 0) nc->timeout = seconds;
}

void mrl_nccl_set_wait_stream(mrl_nccl *nc, void *stream) {
    if (nc) nc->wait_stream = (cudaStream_t)stream;
}

/* ---- Collectives --------------------------------------------------------- */

#define NC_CHECK(nc, name)                                                                   \
    do {                                                                                     \
        if (!(nc)) return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: no communicator", name); \
    } while (0)

mrl_status mrl_nccl_allreduce(mrl_nccl *nc, void *dev_buf, int64_t count, int dtype, int op) {
    static const char name[] = "allreduce";
    NC_CHECK(nc, name);
    ncclRedOp_t rop = ncclSum;
    mrl_status st = check_types(name, dtype, op, &rop);
    if (st != MRL_OK) return st;
    if (count < 0) return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: count %lld < 0", name, (long long)count);
    if (count > 0 && (st = check_ptr(nc, name, "the buffer", dev_buf)) != MRL_OK) return st;
    op_ctx c;
    if ((st = op_begin(nc, name, &c)) != MRL_OK) return st;
    if (count == 0) return op_end(nc, &c, MRL_OK);
    if ((st = wait_inputs(nc, &c)) != MRL_OK) return op_end(nc, &c, st);
    ncclResult_t r = ncclAllReduce(dev_buf, dev_buf, (size_t)count, nccl_dtype(dtype), rop, nc->comm, nc->stream);
    return op_end(nc, &c, wait_done(nc, &c, r));
}

mrl_status mrl_nccl_broadcast(mrl_nccl *nc, void *dev_buf, int64_t bytes, int root) {
    static const char name[] = "broadcast";
    NC_CHECK(nc, name);
    if (bytes < 0) return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: bytes %lld < 0", name, (long long)bytes);
    if (root < 0 || root >= nc->size)
        return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: root %d is not a rank (world size %d)", name, root, nc->size);
    mrl_status st;
    if (bytes > 0 && (st = check_ptr(nc, name, "the buffer", dev_buf)) != MRL_OK) return st;
    op_ctx c;
    if ((st = op_begin(nc, name, &c)) != MRL_OK) return st;
    if (bytes == 0) return op_end(nc, &c, MRL_OK);
    if ((st = wait_inputs(nc, &c)) != MRL_OK) return op_end(nc, &c, st);
    ncclResult_t r = ncclBroadcast(dev_buf, dev_buf, (size_t)bytes, ncclUint8, root, nc->comm, nc->stream);
    return op_end(nc, &c, wait_done(nc, &c, r));
}

mrl_status mrl_nccl_allgather(mrl_nccl *nc, const void *send, int64_t bytes, void *recv) {
    static const char name[] = "allgather";
    NC_CHECK(nc, name);
    if (bytes < 0) return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: bytes %lld < 0", name, (long long)bytes);
    mrl_status st;
    if (bytes > 0 &&
        ((st = check_ptr(nc, name, "send", send)) != MRL_OK || (st = check_ptr(nc, name, "recv", recv)) != MRL_OK))
        return st;
    op_ctx c;
    if ((st = op_begin(nc, name, &c)) != MRL_OK) return st;
    if (bytes == 0) return op_end(nc, &c, MRL_OK);
    if ((st = wait_inputs(nc, &c)) != MRL_OK) return op_end(nc, &c, st);
    ncclResult_t r = ncclAllGather(send, recv, (size_t)bytes, ncclUint8, nc->comm, nc->stream);
    return op_end(nc, &c, wait_done(nc, &c, r));
}

mrl_status mrl_nccl_reduce_scatter(mrl_nccl *nc, const void *send, void *recv, int64_t recv_count, int dtype,
                                   int op) {
    static const char name[] = "reduce_scatter";
    NC_CHECK(nc, name);
    ncclRedOp_t rop = ncclSum;
    mrl_status st = check_types(name, dtype, op, &rop);
    if (st != MRL_OK) return st;
    if (recv_count < 0)
        return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: recv_count %lld < 0", name, (long long)recv_count);
    if (recv_count > 0 &&
        ((st = check_ptr(nc, name, "send", send)) != MRL_OK || (st = check_ptr(nc, name, "recv", recv)) != MRL_OK))
        return st;
    op_ctx c;
    if ((st = op_begin(nc, name, &c)) != MRL_OK) return st;
    if (recv_count == 0) return op_end(nc, &c, MRL_OK);
    if ((st = wait_inputs(nc, &c)) != MRL_OK) return op_end(nc, &c, st);
    ncclResult_t r =
        ncclReduceScatter(send, recv, (size_t)recv_count, nccl_dtype(dtype), rop, nc->comm, nc->stream);
    return op_end(nc, &c, wait_done(nc, &c, r));
}

/* Each rank's piece in one group: the ranks' pieces checked, then queued by one(q) per rank. */
static mrl_status pieces_check(mrl_nccl *nc, const char *name, const int64_t *offset, const int64_t *len,
                               const void *buf, const void *buf2, int64_t *total) {
    if (!offset || !len) return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: NULL pieces", name);
    *total = 0;
    for (int q = 0; q < nc->size; q++) {
        if (offset[q] < 0 || len[q] < 0)
            return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: rank %d's piece [%lld, +%lld)", name, q, (long long)offset[q],
                                 (long long)len[q]);
        *total += len[q];
    }
    mrl_status st = MRL_OK;
    if (*total > 0 && buf) st = check_ptr(nc, name, "the buffer", buf);
    if (!st && *total > 0 && buf2) st = check_ptr(nc, name, "recv", buf2);
    return st;
}

mrl_status mrl_nccl_allgather_pieces(mrl_nccl *nc, void *dev_buf, const int64_t *offset, const int64_t *bytes) {
    static const char name[] = "allgather_pieces";
    NC_CHECK(nc, name);
    int64_t total = 0;
    mrl_status st = pieces_check(nc, name, offset, bytes, dev_buf, NULL, &total);
    if (st) return st;
    op_ctx c;
    if ((st = op_begin(nc, name, &c)) != MRL_OK) return st;
    if (total == 0) return op_end(nc, &c, MRL_OK);
    if ((st = wait_inputs(nc, &c)) != MRL_OK) return op_end(nc, &c, st);
    ncclResult_t r = ncclGroupStart();
    for (int q = 0; q < nc->size && (r == ncclSuccess || r == ncclInProgress); q++) {
        char *at = (char *)dev_buf + offset[q];
        if (bytes[q] > 0) r = ncclBroadcast(at, at, (size_t)bytes[q], ncclUint8, q, nc->comm, nc->stream);
    }
    ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess || r == ncclInProgress) r = e;
    return op_end(nc, &c, wait_done(nc, &c, r));
}

mrl_status mrl_nccl_reduce_scatter_pieces(mrl_nccl *nc, const void *send, void *recv, const int64_t *offset,
                                          const int64_t *count, int dtype, int op) {
    static const char name[] = "reduce_scatter_pieces";
    NC_CHECK(nc, name);
    ncclRedOp_t rop = ncclSum;
    mrl_status st = check_types(name, dtype, op, &rop);
    int64_t total = 0;
    if (!st) st = pieces_check(nc, name, offset, count, send, count && count[nc->rank] > 0 ? recv : NULL, &total);
    if (st) return st;
    op_ctx c;
    if ((st = op_begin(nc, name, &c)) != MRL_OK) return st;
    if (total == 0) return op_end(nc, &c, MRL_OK);
    if ((st = wait_inputs(nc, &c)) != MRL_OK) return op_end(nc, &c, st);
    size_t esize = dtype_bytes(dtype);
    ncclResult_t r = ncclGroupStart();
    for (int q = 0; q < nc->size && (r == ncclSuccess || r == ncclInProgress); q++)
        if (count[q] > 0)
            r = ncclReduce((const char *)send + esize * (size_t)offset[q], q == nc->rank ? recv : NULL, (size_t)count[q],
                           nccl_dtype(dtype), rop, q, nc->comm, nc->stream);
    ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess || r == ncclInProgress) r = e;
    return op_end(nc, &c, wait_done(nc, &c, r));
}

mrl_status mrl_nccl_alltoallv(mrl_nccl *nc, const void *send, const int64_t *send_counts, void *recv,
                              const int64_t *recv_counts, int64_t unit) {
    static const char name[] = "alltoallv";
    NC_CHECK(nc, name);
    if (!send_counts || !recv_counts || unit <= 0)
        return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: NULL counts or a unit of %lld bytes", name, (long long)unit);
    int64_t ns = 0, nr = 0;
    for (int q = 0; q < nc->size; q++) {
        if (send_counts[q] < 0 || recv_counts[q] < 0)
            return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: rank %d's counts %lld, %lld", name, q,
                                 (long long)send_counts[q], (long long)recv_counts[q]);
        ns += send_counts[q], nr += recv_counts[q];
    }
    if (send_counts[nc->rank] != recv_counts[nc->rank])
        return mrl_set_error(MRL_ERR_INVALID, "NCCL %s: this rank sends itself %lld rows and receives %lld", name,
                             (long long)send_counts[nc->rank], (long long)recv_counts[nc->rank]);
    mrl_status st = MRL_OK;
    if (ns > 0 && (st = check_ptr(nc, name, "send", send)) != MRL_OK) return st;
    if (nr > 0 && (st = check_ptr(nc, name, "recv", recv)) != MRL_OK) return st;
    op_ctx c;
    if ((st = op_begin(nc, name, &c)) != MRL_OK) return st;
    if (ns + nr == 0) return op_end(nc, &c, MRL_OK);
    if ((st = wait_inputs(nc, &c)) != MRL_OK) return op_end(nc, &c, st);
    const char *s8 = send;
    char *r8 = recv;
    int64_t so = 0, ro = 0;
    ncclResult_t r = ncclGroupStart();
    for (int q = 0; q < nc->size && (r == ncclSuccess || r == ncclInProgress); q++) {
        size_t sb = (size_t)(send_counts[q] * unit), rb = (size_t)(recv_counts[q] * unit);
        if (q == nc->rank) {
            if (sb) {
                cudaError_t e = cudaMemcpyAsync(r8 + ro, s8 + so, sb, cudaMemcpyDeviceToDevice, nc->stream);
                if (e != cudaSuccess) r = ncclUnhandledCudaError;
            }
        } else {
            if (sb) r = ncclSend(s8 + so, sb, ncclUint8, q, nc->comm, nc->stream);
            if (rb && (r == ncclSuccess || r == ncclInProgress)) r = ncclRecv(r8 + ro, rb, ncclUint8, q, nc->comm, nc->stream);
        }
        so += (int64_t)sb, ro += (int64_t)rb;
    }
    ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess || r == ncclInProgress) r = e;
    return op_end(nc, &c, wait_done(nc, &c, r));
}

#endif /* MRL_HAVE_CUDA */

mrl_status mrl_nccl_cp_alltoallv(void *nc, const float *send, const int64_t *send_counts, float *recv,
                                 const int64_t *recv_counts, int64_t unit) {
    return mrl_nccl_alltoallv(nc, send, send_counts, recv, recv_counts, (int64_t)sizeof(float) * unit);
}

mrl_status mrl_nccl_tp_allreduce(void *nc, float *buf, int64_t n) {
    return mrl_nccl_allreduce(nc, buf, n, MRL_DIST_F32, MRL_DIST_SUM);
}

mrl_status mrl_nccl_tp_allgather(void *nc, const float *mine, int64_t n, float *all) {
    return mrl_nccl_allgather(nc, mine, (int64_t)sizeof(float) * n, all);
}

#ifndef MRL_HAVE_CUDA

static mrl_status no_nccl(void) {
    return mrl_set_error(MRL_ERR_UNSUPPORTED, "moonrl was built without CUDA/NCCL");
}

mrl_status mrl_nccl_create(mrl_dist *d, int device, double timeout, mrl_nccl **out) {
    if (out) *out = NULL;
    return no_nccl();
}
void mrl_nccl_free(mrl_nccl *nc) {}
int mrl_nccl_rank(const mrl_nccl *nc) { return -1; }
int mrl_nccl_size(const mrl_nccl *nc) { return 0; }
int mrl_nccl_device(const mrl_nccl *nc) { return -1; }
void *mrl_nccl_stream(const mrl_nccl *nc) { return NULL; }
void mrl_nccl_set_timeout(mrl_nccl *nc, double seconds) {}
void mrl_nccl_set_wait_stream(mrl_nccl *nc, void *stream) {}
int mrl_nccl_broken(const mrl_nccl *nc) { return 0; }
int64_t mrl_nccl_seq(const mrl_nccl *nc) { return 0; }
mrl_status mrl_nccl_allreduce(mrl_nccl *nc, void *dev_buf, int64_t count, int dtype, int op) { return no_nccl(); }
mrl_status mrl_nccl_broadcast(mrl_nccl *nc, void *dev_buf, int64_t bytes, int root) { return no_nccl(); }
mrl_status mrl_nccl_allgather(mrl_nccl *nc, const void *send, int64_t bytes, void *recv) { return no_nccl(); }
mrl_status mrl_nccl_reduce_scatter(mrl_nccl *nc, const void *send, void *recv, int64_t recv_count, int dtype,
                                   int op) {
    return no_nccl();
}
mrl_status mrl_nccl_allgather_pieces(mrl_nccl *nc, void *dev_buf, const int64_t *offset, const int64_t *bytes) {
    return no_nccl();
}
mrl_status mrl_nccl_reduce_scatter_pieces(mrl_nccl *nc, const void *send, void *recv, const int64_t *offset,
                                          const int64_t *count, int dtype, int op) {
    return no_nccl();
}
mrl_status mrl_nccl_alltoallv(mrl_nccl *nc, const void *send, const int64_t *send_counts, void *recv,
                              const int64_t *recv_counts, int64_t unit) {
    return no_nccl();
}

#endif
