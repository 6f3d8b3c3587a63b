/* The communicator between the ranks of one job (core/dist).
 *
 * N processes started by mpirun, srun or `moonrl launch` form one
 * communicator. Rank, world size and local rank come from the launcher's
 * environment (Open MPI's OMPI_COMM_WORLD_*, PMIx's PMIX_RANK, Slurm's
 * SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID). With world size 1 every
 * operation is a copy or nothing, and MPI is never loaded. With more, MPI
 * comes from the plugin libmoonrl_mpi.so (built where MPI is, loaded at run
 * time: moonrl itself never links MPI), next to libmoonrl.so or named by
 * MOONRL_MPI_PLUGIN.
 *
 * Determinism: SUM and MEAN add the ranks' values in rank order (rank 0 +
 * rank 1 + ... in the buffer's type), whatever the transport, the message
 * size or the algorithm MPI picks, so a job gives bit-identical results from
 * run to run for a given world size, and reduce-scatter + all-gather of the
 * shards equals an all-reduce bit for bit (ZeRO-1 equals plain data
 * parallel).
 *
 * Shards: the buffer of n elements is cut into `size` contiguous pieces,
 * rank r owning [mrl_dist_shard(n, size, r)): the first n % size ranks one
 * element more.
 *
 * Deadlines: no operation waits forever. One that has not finished within
 * the communicator's timeout (seconds; 0 = none) prints to stderr which rank
 * waited, in which operation (its name and sequence number), at which step
 * (mrl_dist_set_step), and what the other ranks answered (where they are
 * waiting, or nothing: dead or hung); it returns MRL_ERR_TIMEOUT with that
 * text, and the communicator is broken from then on: every later operation
 * fails at once with the same error, and mrl_dist_finalize does not wait
 * for the others.
 *
 * Every rank calls the collectives (and mrl_dist_buckets_create) in the
 * same order with the same counts, from the thread that called
 * mrl_dist_init. Bad arguments return MRL_ERR_INVALID before anything
 * starts and do not break the communicator. */
#pragma once
#include <stdint.h>
#include "device.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_dist mrl_dist;

typedef enum mrl_dist_dtype {
    MRL_DIST_F32 = 0,
    MRL_DIST_F64 = 1,
    MRL_DIST_I64 = 2,
    MRL_DIST_U8 = 3
} mrl_dist_dtype;

typedef enum mrl_dist_op {
    MRL_DIST_SUM = 0,
    MRL_DIST_MEAN = 1, /* the sum in rank order, divided by the world size
                        * (i64: truncated; u8: refused, its sum wraps) */
    MRL_DIST_MAX = 2, /* exact in any order: MPI's own in mrl_dist_allreduce */
    MRL_DIST_MIN = 3
} mrl_dist_op;

/* Where this process sits in the job, from the launcher's environment. */
typedef struct mrl_dist_env {
    int rank;
    int size;       /* 0: the launcher does not say (PMIx alone): MPI will */
    int local_rank; /* among the ranks on this host */
    int local_size; /* 0: the launcher does not say: MPI will */
    const char *launcher; /* "none", "openmpi", "pmix", "slurm" */
} mrl_dist_env;

mrl_status mrl_dist_env_detect(mrl_dist_env *out);

/* The job's communicator. timeout: seconds (0 = none). With world size > 1
 * this loads the MPI plugin and initialises MPI; an error says what is
 * missing. The returned handle lives until mrl_dist_finalize. */
mrl_status mrl_dist_init(double timeout, mrl_dist **out);
/* MPI_Finalize (unless broken: then it returns at once) and free. */
void mrl_dist_finalize(mrl_dist *d);

int mrl_dist_rank(const mrl_dist *d);
int mrl_dist_size(const mrl_dist *d);
int mrl_dist_local_rank(const mrl_dist *d);
int mrl_dist_local_size(const mrl_dist *d);
/* "none" (world size 1) or "mpi". */
const char *mrl_dist_backend(const mrl_dist *d);
void mrl_dist_set_timeout(mrl_dist *d, double seconds);
/* The step named in timeout reports. */
void mrl_dist_set_step(mrl_dist *d, int64_t step);
/* 1 after a timeout (or an MPI error). */
int mrl_dist_broken(const mrl_dist *d);

/* A communicator of the ranks that pass the same color >= 0 (ordered as in
 * d); color < 0: *out = NULL, this rank is in none. Every rank of d calls
 * it (after a barrier under the deadline). name ("trainers", "rollout")
 * appears in its timeout reports, which name world ranks. Free it with
 * mrl_dist_free before d is finalized. */
mrl_status mrl_dist_split(mrl_dist *d, int color, const char *name, mrl_dist **out);
void mrl_dist_free(mrl_dist *d);

/* Rank r's shard of n elements: [*offset, *offset + *count). */
void mrl_dist_shard(int64_t n, int size, int rank, int64_t *offset, int64_t *count);
/* Hybrid sharding (HSDP): n elements in `shards` pieces, each the union of
 * size / shards consecutive rank shards of mrl_dist_shard(n, size, .): piece
 * `index` is [*offset, *offset + *count). shards == size (or one that does
 * not divide size): mrl_dist_shard itself. A piece is then always whole
 * rank shards, so a sum over them in rank order is the same in every
 * layout. */
void mrl_dist_group_shard(int64_t n, int size, int shards, int index, int64_t *offset, int64_t *count);
int64_t mrl_dist_dtype_size(int dtype);

mrl_status mrl_dist_barrier(mrl_dist *d);
/* In place over count elements of dtype on every rank. */
mrl_status mrl_dist_allreduce(mrl_dist *d, void *buf, int64_t count, int dtype, int op);
/* bytes from root to every rank, in place. */
mrl_status mrl_dist_broadcast(mrl_dist *d, void *buf, int64_t bytes, int root);
/* Every rank's `bytes` bytes of send, in rank order, into recv (size * bytes). */
mrl_status mrl_dist_allgather(mrl_dist *d, const void *send, int64_t bytes, void *recv);
/* Point to point (pipeline parallel's activations and their gradients): send copies `bytes` of
 * buf and posts them to rank dest, returning at once (buf is free again; the message goes out
 * while this rank goes on, and mrl_dist_flush_sends waits until every one has); recv waits,
 * within the deadline, for `bytes` from rank src into buf. tag (0 .. 999) is a channel: the
 * messages of one channel between two ranks arrive in the order they were sent. */
mrl_status mrl_dist_send(mrl_dist *d, const void *buf, int64_t bytes, int dest, int tag);
mrl_status mrl_dist_recv(mrl_dist *d, void *buf, int64_t bytes, int src, int tag);
mrl_status mrl_dist_flush_sends(mrl_dist *d);
/* The same for n floats, peers by rank of d (model.h's mrl_pp_send and mrl_pp_recv; ctx: d). */
mrl_status mrl_dist_pp_send(void *d, const float *buf, int64_t n, int peer, int tag);
mrl_status mrl_dist_pp_recv(void *d, float *buf, int64_t n, int peer, int tag);
/* A tensor-parallel model's group collectives over d (mrl_model_set_tp_group's, ctx = d): n
 * floats summed in place (mrl_dist_allreduce's rank order), every rank's n floats into all. */
mrl_status mrl_dist_tp_allreduce(void *d, float *buf, int64_t n);
mrl_status mrl_dist_tp_allgather(void *d, const float *mine, int64_t n, float *all);
/* Sequence parallel's reduce-scatter (model.h's mrl_tp_reduce_scatter, ctx = d): n floats in d's
 * size equal pieces, mrl_dist_reduce_scatter's sum of this rank's. */
mrl_status mrl_dist_tp_reduce_scatter(void *d, float *buf, int64_t n);
/* A context-parallel model's all-to-all over d (mrl_model_set_cp_group's, ctx = d, with
 * mrl_dist_tp_allgather): mrl_dist_alltoallv of rows of `unit` floats. */
mrl_status mrl_dist_cp_alltoallv(void *d, const float *send, const int64_t *send_counts, float *recv,
                                 const int64_t *recv_counts, int64_t unit);
/* In place over buf[count]: this rank's shard receives the reduction of
 * every rank's values of that shard; the rest of buf is left as it was. */
mrl_status mrl_dist_reduce_scatter(mrl_dist *d, void *buf, int64_t count, int dtype, int op);
/* In place over buf[count]: every rank's shard copied into the others. */
mrl_status mrl_dist_allgather_shards(mrl_dist *d, void *buf, int64_t count, int dtype);
/* Rows of `unit` bytes between every pair of ranks (expert parallelism's
 * dispatch and combine): this rank sends send_counts[q] rows to rank q, the
 * rows for q following those for the ranks before it in send, and receives
 * recv_counts[q] rows from each rank q into recv, in rank order. The counts
 * must match (what q sends this rank is what this rank expects of q): send
 * them first, e.g. with mrl_dist_allgather. Point to point, in messages of
 * at most 1 GiB (a rank may send and receive nothing). */
mrl_status mrl_dist_alltoallv(mrl_dist *d, const void *send, const int64_t *send_counts, void *recv,
                              const int64_t *recv_counts, int64_t unit);
/* One piece from every rank to a set of ranks (ZeRO-3's trainers sending their shards of the
 * weights to the rollout ranks): each rank sends its `count` units of send (maybe none) to every
 * rank q with to[q] set; a rank with to[rank] set receives recv_counts[q] units from each rank
 * q, in rank order, into recv (its own count too, which must be what it sends itself). Every
 * rank calls it with the same `to`. Point to point, in messages of at most 1 GiB. */
mrl_status mrl_dist_send_pieces(mrl_dist *d, const void *send, int64_t count, const uint8_t *to, void *recv,
                                const int64_t *recv_counts, int64_t unit);
/* Variable-size byte blobs (samples, metrics; up to 1 GiB in all): every rank gives `bytes`
 * bytes; *out_data gets them all concatenated in rank order and
 * *out_offsets size + 1 offsets into it (rank r's blob is
 * [offsets[r], offsets[r+1])). Both are owned by d, valid until the next
 * call. */
mrl_status mrl_dist_allgather_blobs(mrl_dist *d, const void *data, int64_t bytes, const uint8_t **out_data,
                                    const int64_t **out_offsets);

/* ---- Gradient buckets, reduced while the backward runs ----------------
 * The n floats of a gradient buffer are cut into buckets of about
 * bucket_bytes. mrl_dist_buckets_ready(b, offset, count) says a range is
 * final (its signature is the model's gradient hook, mrl_model_set_grad_hook);
 * once armed, a bucket whose whole range is final starts its reduction at
 * once (buckets start from the end of the buffer, the order in which a
 * backward finishes them, and always in that order on every rank).
 * mrl_dist_buckets_finish starts the rest and waits for all: afterwards the
 * buffer holds the sum over ranks (mode ALLREDUCE) or this rank's shard
 * holds it (mode REDUCE_SCATTER, ZeRO-1; the rest is left as it was). The
 * sums are the rank-order sums of mrl_dist_allreduce, bit for bit.
 * Create is a collective (every rank, same order); free may come after
 * mrl_dist_finalize. */
typedef struct mrl_dist_buckets mrl_dist_buckets;

typedef enum mrl_dist_bucket_mode {
    MRL_DIST_BUCKETS_ALLREDUCE = 0,
    MRL_DIST_BUCKETS_REDUCE_SCATTER = 1
} mrl_dist_bucket_mode;

mrl_status mrl_dist_buckets_create(mrl_dist *d, float *grads, int64_t n, int64_t bucket_bytes, int mode,
                                   mrl_dist_buckets **out);
void mrl_dist_buckets_free(mrl_dist_buckets *b);
/* on 1: the next backward is the last before finish: its final ranges start their
 * reductions (earlier backwards of an accumulation must not). on 0: not (a new
 * accumulation: an arm meant for another model's backward, which a session's
 * micro-batches give every optimizer, must not start these buckets early). */
void mrl_dist_buckets_arm(mrl_dist_buckets *b, int on);
void mrl_dist_buckets_ready(void *b, int64_t offset, int64_t count);
mrl_status mrl_dist_buckets_finish(mrl_dist_buckets *b);
/* Buckets whose reduction started before finish in the last round (how
 * much of the communication overlapped the backward). */
int mrl_dist_buckets_overlapped(const mrl_dist_buckets *b);
int mrl_dist_buckets_count(const mrl_dist_buckets *b);

/* ---- Sharded gradients (ZeRO-2 and up) --------------------------------
 * Rank r keeps only the sum over ranks of its shard of the n gradients
 * (piece r % shards of mrl_dist_group_shard(n, size, shards, .): shards =
 * size, mrl_dist_shard; fewer, hybrid sharding, each piece kept by
 * size / shards ranks, one in each group of `shards` consecutive ranks, all
 * of them summing every rank's values), accumulated over the backwards of an update; no rank
 * holds the whole gradient. A model lends its backward's ranges from it
 * (mrl_model_set_grad_windows with acquire, mrl_model_set_grad_hook with
 * ready): acquire gives a zeroed window for [offset, offset + count) of the
 * gradient layout; ready says the range is final, and its reduce-scatter
 * starts (segments of about segment_bytes, at most two in flight, each
 * combined in rank order: the sums of mrl_dist_allreduce bit for bit),
 * then the window goes back to the pool. finish waits for every range of
 * the backward and reports a failure of the hooks (which return none); call
 * it after each backward. zero: the accumulator to 0 (a new update).
 * grads: the accumulator, count = this rank's shard. window_bytes: what the
 * pool holds now (MRL_MEM_GRADS, as the accumulator and the scratch).
 * Create is a collective. */
typedef struct mrl_dist_grad_shard mrl_dist_grad_shard;
mrl_status mrl_dist_grad_shard_create(mrl_dist *d, int64_t n, int64_t segment_bytes, int shards,
                                      mrl_dist_grad_shard **out);
void mrl_dist_grad_shard_free(mrl_dist_grad_shard *g);
/* A GPU model's backward (before the first window): the windows are lent in that GPU's memory,
 * each copied to host memory as its range becomes final (the reduce-scatter runs there, with the
 * same sums), and finish copies the accumulator to the GPU, where grads then points. */
mrl_status mrl_dist_grad_shard_set_device(mrl_dist_grad_shard *g, mrl_device device);
float *mrl_dist_grad_shard_acquire(void *g, int64_t offset, int64_t count);
void mrl_dist_grad_shard_ready(void *g, int64_t offset, int64_t count);
mrl_status mrl_dist_grad_shard_finish(mrl_dist_grad_shard *g);
void mrl_dist_grad_shard_zero(mrl_dist_grad_shard *g);
/* The pool's windows and the scratch given back (between updates: the optimizer step does not
 * need them, and a head's window alone may be as large as a tenth of a model). */
void mrl_dist_grad_shard_trim(mrl_dist_grad_shard *g);
float *mrl_dist_grad_shard_grads(mrl_dist_grad_shard *g);
int64_t mrl_dist_grad_shard_window_bytes(const mrl_dist_grad_shard *g);
int64_t mrl_dist_grad_shard_window_peak(const mrl_dist_grad_shard *g);
/* Bytes this rank's reduce-scatters sent the other ranks, since creation. */
int64_t mrl_dist_grad_shard_bytes_sent(const mrl_dist_grad_shard *g);

/* ---- Sharded parameters (ZeRO-3) ----------------------------------------
 * A buffer of n parameters of which rank r of d holds only its shard
 * mrl_dist_group_shard(n, world, size of d, r) in place (d: the world, or
 * under hybrid sharding the group of consecutive ranks sharding among
 * themselves; world: the ranks of the whole job): start begins the all-gather of [offset,
 * offset + count) into params (each rank's piece of the range is already
 * there: in place), wait completes it; up to four ranges in flight, started
 * and waited for in the same order on every rank (a model's forward and
 * backward: mrl_model_set_param_gather has these signatures). Create is a
 * collective. */
typedef struct mrl_dist_param_gather mrl_dist_param_gather;
mrl_status mrl_dist_param_gather_create(mrl_dist *d, int64_t n, int world, mrl_dist_param_gather **out);
void mrl_dist_param_gather_free(mrl_dist_param_gather *p);
mrl_status mrl_dist_param_gather_start(void *p, float *params, int64_t offset, int64_t count);
mrl_status mrl_dist_param_gather_wait(void *p, float *params, int64_t offset, int64_t count);
/* Bytes of the other ranks' shards gathered into place, since creation. */
int64_t mrl_dist_param_gather_bytes_received(const mrl_dist_param_gather *p);

#ifdef __cplusplus
}
#endif
