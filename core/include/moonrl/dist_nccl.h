/* The NCCL communicator between the GPUs of a job (core/dist/nccl.c).
 *
 * One per rank, over the same ranks as the MPI communicator it is created
 * from: rank 0 makes NCCL's unique id, mrl_dist_broadcast hands it to the
 * others, and every rank joins with its mrl_dist_rank / mrl_dist_size. The
 * collectives work on device memory (void * device pointers, one GPU per
 * rank) and run on the communicator's own CUDA stream.
 *
 * Every call returns when its collective has finished on this rank (the
 * buffers can be read and reused at once). Before it starts, the work
 * already queued on the wait stream (mrl_nccl_set_wait_stream; NULL, the
 * default, is CUDA's legacy default stream) is finished first, so the inputs
 * written by kernels on that stream are complete.
 *
 * Deadlines: no call waits forever. One that has not finished within the
 * communicator's timeout (seconds; 0 = none; set at create, changed with
 * mrl_nccl_set_timeout) aborts the NCCL communicator (ncclCommAbort) and
 * returns MRL_ERR_TIMEOUT with a message naming the rank, the operation and
 * its sequence number, and what it was waiting for; an error NCCL reports
 * (ncclCommGetAsyncError: a peer gone, a network failure) does the same with
 * MRL_ERR_DEVICE. The communicator is broken from then on: every later call
 * fails at once with the same error, and mrl_nccl_free does not wait for
 * the other ranks. Creation has the same deadline (a rank that never joins).
 *
 * Bad arguments (an unknown dtype or op, a root out of range, a NULL buffer)
 * return MRL_ERR_INVALID before anything is queued and do not break it.
 *
 * Types and reductions: dtype is an mrl_dist_dtype (F32, F64, I64, U8) or
 * one of the GPU-only types below; op an mrl_dist_op, MEAN being NCCL's
 * average (ncclAvg). Unlike mrl_dist, the sums are NCCL's: reproducible from
 * run to run for the same world size, topology and NCCL version, but not in
 * rank order, so not bit-equal to mrl_dist_allreduce, and a reduce-scatter
 * followed by an all-gather need not equal an all-reduce bit for bit.
 *
 * One thread at a time per communicator. Without CUDA (MRL_HAVE_CUDA unset
 * at build time) every function returns MRL_ERR_UNSUPPORTED. */
#pragma once
#include <stdint.h>
#include "status.h"
#include "dist.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_nccl mrl_nccl;

/* Element types of GPU buffers beyond mrl_dist_dtype's (values kept clear
 * of that enum's). */
typedef enum mrl_nccl_dtype {
    MRL_NCCL_BF16 = 16,
    MRL_NCCL_F16 = 17
} mrl_nccl_dtype;

/* Collective over every rank of d (each calls it, in the same order as its
 * other collectives on d): joins the NCCL communicator on CUDA device
 * `device` (usually mrl_dist_local_rank). timeout: seconds (0 = none), for
 * the creation and every later call. */
mrl_status mrl_nccl_create(mrl_dist *d, int device, double timeout, mrl_nccl **out);
/* Finishes the communicator (ncclCommFinalize + ncclCommDestroy, within the
 * deadline; ncclCommAbort when broken or late) and frees it. NULL is a no-op. */
void mrl_nccl_free(mrl_nccl *nc);

int mrl_nccl_rank(const mrl_nccl *nc);
int mrl_nccl_size(const mrl_nccl *nc);
int mrl_nccl_device(const mrl_nccl *nc);
/* The communicator's cudaStream_t. */
void *mrl_nccl_stream(const mrl_nccl *nc);
void mrl_nccl_set_timeout(mrl_nccl *nc, double seconds);
/* A cudaStream_t whose queued work every later call waits for before it
 * starts (NULL: the legacy default stream). */
void mrl_nccl_set_wait_stream(mrl_nccl *nc, void *stream);
/* 1 after a timeout or an NCCL / CUDA error. */
int mrl_nccl_broken(const mrl_nccl *nc);
/* Operations started so far (the sequence number of the next one). */
int64_t mrl_nccl_seq(const mrl_nccl *nc);

/* In place over count elements of dtype in dev_buf on every rank. */
mrl_status mrl_nccl_allreduce(mrl_nccl *nc, void *dev_buf, int64_t count, int dtype, int op);
/* bytes of dev_buf from rank root to every rank, in place. */
mrl_status mrl_nccl_broadcast(mrl_nccl *nc, void *dev_buf, int64_t bytes, int root);
/* Every rank's `bytes` bytes of send, in rank order, into recv (size *
 * bytes). send may be recv + rank * bytes (in place). */
mrl_status mrl_nccl_allgather(mrl_nccl *nc, const void *send, int64_t bytes, void *recv);
/* send holds size * recv_count elements; recv (recv_count elements) gets
 * the reduction over ranks of send[rank * recv_count, (rank + 1) *
 * recv_count). recv may be send + rank * recv_count (in place). */
mrl_status mrl_nccl_reduce_scatter(mrl_nccl *nc, const void *send, void *recv, int64_t recv_count, int dtype,
                                   int op);
/* The same over uneven pieces (each rank's shard of a buffer: mrl_dist_shard's differ in size,
 * which NCCL's all-gather and reduce-scatter do not take), as one group of per-rank calls.
 * allgather_pieces: rank r's bytes[r] bytes at byte offset[r] of dev_buf broadcast in place to
 * every rank. reduce_scatter_pieces: the reduction over ranks of send's count[r] elements at
 * element offset[r] into rank r's recv (count[rank] elements). */
mrl_status mrl_nccl_allgather_pieces(mrl_nccl *nc, void *dev_buf, const int64_t *offset, const int64_t *bytes);
mrl_status mrl_nccl_reduce_scatter_pieces(mrl_nccl *nc, const void *send, void *recv, const int64_t *offset,
                                          const int64_t *count, int dtype, int op);

/* Every rank's rows to every rank (a context-parallel model's all-to-all): this rank sends
 * send_counts[q] rows of `unit` bytes to rank q, one block after another in rank order in send,
 * and receives recv_counts[q] rows from each into recv, in rank order; as one group of NCCL
 * sends and receives (NCCL has no all-to-all-v). Its own block is copied on the GPU. */
mrl_status mrl_nccl_alltoallv(mrl_nccl *nc, const void *send, const int64_t *send_counts, void *recv,
                              const int64_t *recv_counts, int64_t unit);

/* The sharded training state's collectives on GPUs through this communicator (moonrl/dist.h,
 * over the same ranks): a GPU model's gradient ranges reduce-scattered by
 * mrl_nccl_reduce_scatter_pieces and added to the shard on the GPU (after
 * mrl_dist_grad_shard_set_device, before the first window; not under hybrid sharding), and
 * its parts gathered into place by mrl_nccl_allgather_pieces. */
mrl_status mrl_dist_grad_shard_set_nccl(mrl_dist_grad_shard *g, mrl_nccl *nc);
mrl_status mrl_dist_param_gather_set_nccl(mrl_dist_param_gather *p, mrl_nccl *nc);

/* A tensor-parallel GPU model's group collectives (moonrl/model.h's mrl_model_set_tp_device_group,
 * as mrl_tp_allreduce and mrl_tp_allgather; ctx: an mrl_nccl over the group's ranks): the f32 sum
 * of n floats in place, and every rank's n floats in rank order. NCCL gives every rank the same
 * sum, so the ranks' residual streams stay alike. */
mrl_status mrl_nccl_tp_allreduce(void *nc, float *buf, int64_t n);
mrl_status mrl_nccl_tp_allgather(void *nc, const float *mine, int64_t n, float *all);
/* A context-parallel GPU model's all-to-all (moonrl/model.h's mrl_model_set_cp_device_group, as
 * mrl_cp_alltoallv: rows of `unit` floats; ctx: an mrl_nccl over the group's ranks). */
mrl_status mrl_nccl_cp_alltoallv(void *nc, const float *send, const int64_t *send_counts, float *recv,
                                 const int64_t *recv_counts, int64_t unit);

#ifdef __cplusplus
}
#endif
