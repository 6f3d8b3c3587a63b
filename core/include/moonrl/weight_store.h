/* A versioned weight store in shared memory (core/dist/weight_store.c).
 *
 * The same-host path by which a trainer publishes each new weights version
 * to the rollout (generation) processes of its host: a publish costs about
 * one memcpy of the parameter buffer, and a reader's engine reads the
 * weights in place, in the store's memory (zero copy).
 *
 * One writer, n_readers readers, n_readers + 2 slots: the latest version
 * takes one slot, each reader holds at most one, so a publish always finds
 * a free slot. A publish therefore never waits for a reader, however slow,
 * and a reader never sees a slot that is being written (no torn weights).
 * A reader that holds an old version keeps it, unchanged, until it acquires
 * again or releases.
 *
 * Between processes the store is a POSIX shared-memory object (/dev/shm):
 * the writer creates it under a name, sends the name to its readers (a
 * broadcast over the communicator), they open it, and once all have opened
 * the writer unlinks the name: the mappings stay valid, and a job that is
 * killed leaves nothing behind in /dev/shm. Between threads of one process
 * (name NULL) the store is private memory and the writer's handle is also
 * every reader's: a reader thread calls mrl_weight_store_acquire /
 * mrl_weight_store_release on it with its own reader index.
 *
 * Versions: a publish carries a version (>= 0, each larger than the last,
 * below 2^47) and flags. A publish without weights (src NULL) carries flags
 * only: MRL_WS_STOP, "no more weights will come", ends the readers' waits.
 * MRL_WS_ROLLBACK marks weights that are an earlier state put back (a guard
 * undid a step): the version still increases, the flag tells the reader
 * that samples of the versions it replaces are from weights that no longer
 * exist.
 *
 * Threads: the writer's calls come from one thread at a time; each reader
 * index is used by one thread at a time; mrl_weight_store_latest may be
 * called from any thread. */
#pragma once
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_weight_store mrl_weight_store;

/* Flags a publish can carry. */
enum { MRL_WS_STOP = 1, MRL_WS_ROLLBACK = 2 };

/* Writer side: a new store of n_floats floats per slot for n_readers
 * readers (1..128). name: a POSIX shared-memory name ("/moonrl-<pid>-<k>":
 * a leading '/', no other), created exclusively (an existing name is an
 * error naming it); NULL: private memory of this process. The store's
 * memory is allocated here, all of it (posix_fallocate: a full /dev/shm is
 * an error now, never a SIGBUS later), and must fit in physical memory. */
mrl_status mrl_weight_store_create(const char *name, int64_t n_floats, int n_readers, mrl_weight_store **out);
/* Reader side, another process: open the store `name` as reader `reader`
 * (0..n_readers-1, one process per index). n_floats must be the store's.
 * A missing name, or a file that is not a weight store of this build's
 * layout, is an error naming the name and what is wrong. */
mrl_status mrl_weight_store_open(const char *name, int64_t n_floats, int reader, mrl_weight_store **out);
/* Several writers (trainers that each hold a shard of the weights,
 * dist.zero=3): another process of the host opens the store as a
 * co-writer; for each version the writer takes a free slot (begin), gives
 * its index to the co-writers, every one copies its ranges into it (write),
 * and once all are done (the caller's barrier) the writer publishes it
 * (commit: the slot and the version, as mrl_weight_store_publish; a
 * flags-only version: slot -1). Readers never see a slot before its
 * commit. publish is begin, one write of all n_floats and commit. */
mrl_status mrl_weight_store_open_writer(const char *name, int64_t n_floats, mrl_weight_store **out);
mrl_status mrl_weight_store_begin(mrl_weight_store *w, int *slot);
mrl_status mrl_weight_store_write(mrl_weight_store *w, int slot, int64_t offset, const float *src, int64_t count);
mrl_status mrl_weight_store_commit(mrl_weight_store *w, int slot, int64_t version, int flags);
/* Writer: remove the name from /dev/shm; the mappings stay valid. Call it
 * once every reader has opened. Idempotent (and a no-op for a private
 * store); free also unlinks if it was not done. */
mrl_status mrl_weight_store_unlink(mrl_weight_store *w);
/* Writer: unmaps (and unlinks). Reader: releases its hold and its index,
 * then unmaps. */
void mrl_weight_store_free(mrl_weight_store *w);

int64_t mrl_weight_store_floats(const mrl_weight_store *w);
int mrl_weight_store_readers(const mrl_weight_store *w);

/* Writer: copy src (n_floats floats) into a free slot and make it the
 * latest, as `version` with `flags` (a combination of MRL_WS_*); src NULL:
 * flags only, no weights. The copy is split over the worker threads
 * (mrl_parallel_for): a large memcpy is memory-bound, and two threads
 * draw more bandwidth than one on some CPUs (bench/async/weight_publish.lua
 * measures it). Returns once the version is published; never waits for a
 * reader. */
mrl_status mrl_weight_store_publish(mrl_weight_store *w, const float *src, int64_t version, int flags);

/* The latest published version (-1: none yet) and its flags (flags may be
 * NULL), holding nothing: a cheap poll, for a reader that checks between
 * generation steps whether newer weights exist. */
int64_t mrl_weight_store_latest(const mrl_weight_store *w, int *flags);

/* Reader: wait until the latest version is >= min_version or carries
 * MRL_WS_STOP, for at most timeout_s seconds (0: no limit), then hold it:
 * *params points at its n_floats floats (NULL for a flags-only version),
 * valid and unchanged until this reader's next acquire or release;
 * *version and *flags are its (either may be NULL). The hold is what keeps
 * the writer off the slot. The wait is polite: a few microseconds of
 * spinning, then sleeps of a quarter of the time waited so far, up to
 * 1 ms. A passed deadline is MRL_ERR_TIMEOUT, saying which version was
 * awaited and the latest seen; a stop request (mrl_stop_requested, a
 * signal) ends the wait with MRL_ERR_STOPPED. */
mrl_status mrl_weight_store_acquire(mrl_weight_store *w, int reader, int64_t min_version, double timeout_s,
                                    const float **params, int64_t *version, int *flags);
/* Reader: let go of the version held (its params are no longer valid). */
void mrl_weight_store_release(mrl_weight_store *w, int reader);

/* Delta publication (async.weights_delta, between trainers and rollout ranks that generate in
 * bf16): the elements of a version whose bf16 value changed since the last one. old16 holds the
 * last version's bf16 values of cur's n floats (n < 2^32) and is updated to this version's; the
 * positions (ascending) and new bf16 values of the changed ones go to at[] and val[] (room for
 * cap). Returns how many changed: more than cap means only cap were written, and the caller
 * sends the whole version instead. A receiver that sets those elements to the bf16 values holds
 * this version's bf16 values exactly where it held the last one's. */
int64_t mrl_weights_bf16_delta(uint16_t *old16, const float *cur, int64_t n, int64_t cap, uint32_t *at, uint16_t *val);
/* The receiver's side: k changes (positions ascending in the sender's stream, bf16 values) into
 * dst, where n copies map the stream (copy i: positions [start[i], start[i] + count[i]) to
 * dst + to[i], the starts ascending); a position no copy holds is skipped. */
void mrl_weights_bf16_apply(float *dst, const int64_t *start, const int64_t *to, const int64_t *count, int64_t n,
                            const uint32_t *at, const uint16_t *val, int64_t k);

#ifdef __cplusplus
}
#endif
