/* The versioned weight store in shared memory (moonrl/weight_store.h).
 *
 * Layout of the mapping (the same in every process, page-aligned parts):
 *   header page(s): ws_header, then one 64-byte line per reader
 *   slot 0 .. slot n_slots-1: n_floats floats each, slot_bytes apart
 *
 * All the state that changes lives in two kinds of atomic words:
 *   latest             (version + 1) << 16 | flags << 8 | slot: the latest
 *                      publish in one word, so a reader reads version, flags
 *                      and slot together, and a version never repeats (the
 *                      word is its own sequence number: no ABA)
 *   readers[r].held    the slot reader r holds (NO_SLOT: none)
 *
 * The protocol (every access below to these two is seq_cst, which is what
 * the argument needs: a store followed by a load of the other word):
 *   reader: L = latest; held[r] = slot(L); if latest != L, retry with the
 *           new value; else it holds slot(L) and reads it.
 *   writer: scan held[0..R-1]; write into a slot that is neither slot(latest)
 *           nor held; latest = that slot's word.
 * Why no reader ever reads a slot while the writer writes it: say reader r
 * holds s, its re-check having read again the word L it stored a hold for,
 * the word stored by publish P. Every publish up to P finished writing
 * before P's store of L, which r's loads of L synchronise with. A publish Q
 * after P that scans the holds after r's store of held[r] (in the single
 * order of all seq_cst operations) sees the hold and keeps off s. One that
 * scans before that store cannot choose s either: if Q comes right after P,
 * latest is L, whose slot is s; if another publish came between, that one
 * stored a new word before Q's scan, hence before r's re-check, which then
 * could not have read L (a word never repeats). And when r lets s go (a new
 * hold, or NO_SLOT: release stores), its reads of s come before the
 * writer's scan that sees it gone.
 * With R holds and one latest at most R + 1 slots are busy, so of R + 2 the
 * writer always finds one: it never waits. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>
#include "moonrl/loop.h"
#include "base/mem.h"
#include "base/parallel.h"
#include "moonrl/dtype.h"
#include "moonrl/weight_store.h"
#include "base/error.h"

enum {
    MAX_READERS = 128,
    MAX_SLOTS = MAX_READERS + 2,
    NO_SLOT = 0xff, /* in the latest word: a flags-only publish; in held: nothing held */
    WRITER = -1,    /* a handle's reader index: the creator */
    CO_WRITER = -2, /* one that writes ranges of the creator's versions (mrl_weight_store_open_writer) */
    LAYOUT = 1,     /* the header's layout version: a store of another one is refused */
    CACHE_LINE = 64,
};
#define WS_MAGIC 0x53576c726e6f6f6dull /* "moonrlWS" in the file's first bytes */
#define MAX_VERSION (((int64_t)1 << 47) - 1)
#define SPIN_SECONDS 5e-6

/* Cross-process atomics must not hide a lock in this process's memory. */
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2, "lock-free atomics needed");

/* One line per reader: its hold changes at every acquire, and should not
 * bounce the lines of the others (or of latest). */
typedef struct ws_reader {
    _Alignas(CACHE_LINE) _Atomic int32_t held;
    _Atomic int32_t pid; /* the process that opened this index, 0: none */
} ws_reader;
_Static_assert(sizeof(ws_reader) == CACHE_LINE, "one line per reader");

typedef struct ws_header {
    _Atomic uint64_t magic; /* stored last by the creator: a half-made store is no store */
    uint32_t layout;
    int32_t n_readers, n_slots;
    int32_t writer_pid; /* named in a reader's timeout: is the writer still there? */
    int64_t n_floats;
    int64_t header_bytes; /* slot 0 starts here: a page multiple */
    int64_t slot_bytes;   /* n_floats floats rounded up to a page */
    int64_t total_bytes;  /* the file's size */
    _Alignas(CACHE_LINE) _Atomic uint64_t latest;
    ws_reader readers[];
} ws_header;

struct mrl_weight_store {
    ws_header *hdr; /* the mapping: header, then the slots */
    char *slots;
    int64_t map_bytes, n_floats, slot_bytes;
    int n_readers, n_slots;
    int reader;           /* the index this handle opened as; -1: the writer */
    int64_t last_version; /* writer: the version last published, -1: none */
    int unlinked;         /* writer: the name is gone (or there is none) */
    char name[NAME_MAX + 1]; /* "": private memory */
};

/* ---------------------------------------------------------------- words */

static uint64_t make_word(int64_t version, int flags, int slot) {
    return (uint64_t)(version + 1) << 16 | (uint64_t)flags << 8 | (uint64_t)slot;
}
static int64_t word_version(uint64_t word) { return (int64_t)(word >> 16) - 1; }
static int word_flags(uint64_t word) { return (int)(word >> 8 & 0xff); }
static int word_slot(uint64_t word) { return (int)(word & 0xff); }

/* ---------------------------------------------------------------- sizes */

static const char *label(const mrl_weight_store *w) { return w->name[0] ? w->name : "(private)"; }

static int64_t page_size(void) {
    long page = sysconf(_SC_PAGE_SIZE);
    return page > 0 ? page : 4096;
}
static int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

static int64_t header_bytes_for(int n_readers) {
    return round_up((int64_t)(sizeof(ws_header) + (size_t)n_readers * sizeof(ws_reader)), page_size());
}

/* Bytes of physical memory, 0 when unknown. */
static int64_t physical_memory(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? (int64_t)pages * page : 0;
}

/* A POSIX shared-memory name: "/" then a file name (glibc puts it in /dev/shm). */
static mrl_status check_name(const char *name) {
    size_t len = strlen(name);
    if (len < 2 || name[0] != '/' || strchr(name + 1, '/') || len > NAME_MAX)
        return mrl_set_error(MRL_ERR_INVALID, "weight store: bad shared-memory name '%s': it must be '/' and then "
                             "1 to %d characters without '/'", name, NAME_MAX - 1);
    return MRL_OK;
}

/* ------------------------------------------------------------- writer side */

/* The store's memory: private (anonymous) or the shared-memory object
 * `name`, all of its pages allocated now. */
static mrl_status map_new(mrl_weight_store *w, const char *name) {
    int64_t bytes = w->map_bytes;
    if (!name) {
        void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (p == MAP_FAILED)
            return mrl_set_error(MRL_ERR_NOMEM, "weight store (private): cannot map %lld bytes: %s", (long long)bytes,
                                 strerror(errno));
        w->hdr = p;
        return MRL_OK;
    }
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        if (errno == EEXIST)
            return mrl_set_error(MRL_ERR_IO, "weight store %s: the name exists already (/dev/shm%s): another store's, "
                                 "or one left by a killed job", name, name);
        return mrl_set_error(MRL_ERR_IO, "weight store %s: cannot create: %s", name, strerror(errno));
    }
    snprintf(w->name, sizeof w->name, "%s", name);
    w->unlinked = 0; /* from here on free removes the name */
    /* The pages are allocated now (posix_fallocate), not at first touch: on
     * a full /dev/shm that first touch would be a SIGBUS in the middle of a
     * publish, or worse in a reader. */
    int err = ftruncate(fd, (off_t)bytes) != 0 ? errno : posix_fallocate(fd, 0, (off_t)bytes);
    if (err) {
        struct statvfs vfs;
        double free_gib = fstatvfs(fd, &vfs) == 0 ? (double)vfs.f_bavail * (double)vfs.f_frsize / 1073741824.0 : -1;
        close(fd);
        return mrl_set_error(err == ENOSPC ? MRL_ERR_NOMEM : MRL_ERR_IO,
                             "weight store %s: cannot allocate %lld bytes (%.2f GiB) in /dev/shm: %s (%.2f GiB free "
                             "there; a container may need a larger --shm-size)", name, (long long)bytes,
                             bytes / 1073741824.0, strerror(err), free_gib);
    }
    void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    err = errno;
    close(fd); /* the mapping keeps the object */
    if (p == MAP_FAILED)
        return mrl_set_error(MRL_ERR_NOMEM, "weight store %s: cannot map %lld bytes: %s", name, (long long)bytes,
                             strerror(err));
    w->hdr = p;
    return MRL_OK;
}

mrl_status mrl_weight_store_create(const char *name, int64_t n_floats, int n_readers, mrl_weight_store **out) {
    if (!out) return mrl_set_error(MRL_ERR_INVALID, "weight store: NULL out");
    *out = NULL;
    mrl_status st = name ? check_name(name) : MRL_OK;
    if (st) return st;
    const char *shown = name ? name : "(private)";
    if (n_readers < 1 || n_readers > MAX_READERS)
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: %d readers (must be 1..%d)", shown, n_readers,
                             MAX_READERS);
    /* n_floats is bounded before any product is formed from it */
    if (n_floats < 1 || n_floats > ((int64_t)1 << 44))
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: %lld floats per slot (must be 1..2^44)", shown,
                             (long long)n_floats);
    int64_t slot_bytes = round_up(n_floats * (int64_t)sizeof(float), page_size());
    int64_t header_bytes = header_bytes_for(n_readers), n_slots = n_readers + 2;
    int64_t total = header_bytes + n_slots * slot_bytes, phys = physical_memory();
    if (phys > 0 && total > phys)
        return mrl_set_error(MRL_ERR_NOMEM, "weight store %s: %lld slots of %lld floats need %lld bytes (%.2f GiB), "
                             "more than this machine's physical memory (%.2f GiB)", shown, (long long)n_slots,
                             (long long)n_floats, (long long)total, total / 1073741824.0, phys / 1073741824.0);
    mrl_weight_store *w = calloc(1, sizeof *w);
    if (!w) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    *w = (mrl_weight_store){.map_bytes = total, .n_floats = n_floats, .slot_bytes = slot_bytes,
                            .n_readers = n_readers, .n_slots = (int)n_slots, .reader = -1, .last_version = -1,
                            .unlinked = 1};
    st = map_new(w, name);
    if (st) {
        mrl_weight_store_free(w); /* unlinks a name it created */
        return st;
    }
    ws_header *h = w->hdr;
    h->layout = LAYOUT;
    h->writer_pid = (int32_t)getpid();
    h->n_readers = n_readers;
    h->n_slots = (int32_t)n_slots;
    h->n_floats = n_floats;
    h->header_bytes = header_bytes;
    h->slot_bytes = slot_bytes;
    h->total_bytes = total;
    atomic_init(&h->latest, make_word(-1, 0, NO_SLOT));
    for (int r = 0; r < n_readers; r++) {
        atomic_init(&h->readers[r].held, NO_SLOT);
        atomic_init(&h->readers[r].pid, 0);
    }
    atomic_store_explicit(&h->magic, WS_MAGIC, memory_order_release);
    w->slots = (char *)h + header_bytes;
    mrl_mem_account(MRL_MEM_PARAMS, total);
    *out = w;
    return MRL_OK;
}

mrl_status mrl_weight_store_unlink(mrl_weight_store *w) {
    if (!w) return mrl_set_error(MRL_ERR_INVALID, "weight store: NULL handle");
    if (w->reader >= 0)
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: reader %d cannot unlink: the writer does, once every "
                             "reader has opened", label(w), w->reader);
    if (w->unlinked) return MRL_OK;
    /* ENOENT: someone removed it already; the goal, no name left, holds */
    if (shm_unlink(w->name) != 0 && errno != ENOENT)
        return mrl_set_error(MRL_ERR_IO, "weight store %s: cannot unlink /dev/shm%s: %s", w->name, w->name,
                             strerror(errno));
    w->unlinked = 1;
    return MRL_OK;
}

void mrl_weight_store_free(mrl_weight_store *w) {
    if (!w) return;
    if (w->reader < 0 && !w->unlinked) shm_unlink(w->name);
    if (w->hdr) {
        if (w->reader >= 0) {
            /* this index is free again, and holds nothing */
            atomic_store(&w->hdr->readers[w->reader].held, NO_SLOT);
            atomic_store(&w->hdr->readers[w->reader].pid, 0);
        }
        if (w->slots) mrl_mem_account(MRL_MEM_PARAMS, -w->map_bytes);
        munmap(w->hdr, (size_t)w->map_bytes);
    }
    free(w);
}

int64_t mrl_weight_store_floats(const mrl_weight_store *w) { return w->n_floats; }
int mrl_weight_store_readers(const mrl_weight_store *w) { return w->n_readers; }

/* A slot that is neither the latest nor held by a reader (-1: none, which
 * cannot happen with n_readers + 2 slots and readers that keep to the
 * protocol). Read fresh at every publish, after the previous one. */
static int free_slot(const mrl_weight_store *w, int latest_slot) {
    char busy[MAX_SLOTS] = {0};
    if (latest_slot < w->n_slots) busy[latest_slot] = 1;
    for (int r = 0; r < w->n_readers; r++) {
        int32_t held = atomic_load(&w->hdr->readers[r].held);
        if (held >= 0 && held < w->n_slots) busy[held] = 1; /* another process's word: trusted only in range */
    }
    for (int s = 0; s < w->n_slots; s++)
        if (!busy[s]) return s;
    return -1;
}

/* The copy, in chunks of 64 KiB: at least 16 of them (1 MiB) per thread,
 * below which starting the threads costs more than sharing the copy saves. */
enum { COPY_CHUNK = 16384, COPY_GRAIN = 16 };

typedef struct copy_job {
    float *dst;
    const float *src;
    int64_t n;
} copy_job;

static void copy_chunks(void *ctx, int64_t begin, int64_t end) {
    const copy_job *c = ctx;
    int64_t lo = begin * COPY_CHUNK, hi = end * COPY_CHUNK < c->n ? end * COPY_CHUNK : c->n;
    memcpy(c->dst + lo, c->src + lo, (size_t)(hi - lo) * sizeof(float));
}

static mrl_status only_writer(const mrl_weight_store *w, const char *what) {
    if (!w) return mrl_set_error(MRL_ERR_INVALID, "weight store: NULL handle");
    if (w->reader != WRITER)
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: opened as %s: only the writer %s", label(w),
                             w->reader == CO_WRITER ? "a co-writer" : "a reader", what);
    return MRL_OK;
}

mrl_status mrl_weight_store_begin(mrl_weight_store *w, int *slot) {
    mrl_status st = only_writer(w, "begins a version");
    if (st) return st;
    if (!slot) return mrl_set_error(MRL_ERR_INVALID, "weight store %s: begin: NULL slot", label(w));
    uint64_t now = atomic_load(&w->hdr->latest); /* our own last store */
    *slot = free_slot(w, word_slot(now));
    if (*slot < 0)
        return mrl_set_error(MRL_ERR_INTERNAL, "weight store %s: no free slot among %d (a reader index used by "
                             "two readers?)", label(w), w->n_slots);
    return MRL_OK;
}

mrl_status mrl_weight_store_write(mrl_weight_store *w, int slot, int64_t offset, const float *src, int64_t count) {
    if (!w) return mrl_set_error(MRL_ERR_INVALID, "weight store: NULL handle");
    if (w->reader >= 0)
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: opened as reader %d: readers do not write", label(w),
                             w->reader);
    if (slot < 0 || slot >= w->n_slots || offset < 0 || count < 0 || offset > w->n_floats ||
        count > w->n_floats - offset || (count && !src))
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: write of [%lld, +%lld) into slot %d (%d slots of %lld "
                             "floats)", label(w), (long long)offset, (long long)count, slot, w->n_slots,
                             (long long)w->n_floats);
    copy_job job = {(float *)(w->slots + slot * w->slot_bytes) + offset, src, count};
    mrl_parallel_for((count + COPY_CHUNK - 1) / COPY_CHUNK, COPY_GRAIN, copy_chunks, &job);
    return MRL_OK;
}

/* The writer's version and flags for the next publish. */
static mrl_status check_publish(const mrl_weight_store *w, int64_t version, int flags) {
    mrl_status st = only_writer(w, "publishes");
    if (st) return st;
    if (version < 0 || version > MAX_VERSION || version <= w->last_version)
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: version %lld after version %lld: versions must "
                             "increase (from 0, at most 2^47 - 1)", label(w), (long long)version,
                             (long long)w->last_version);
    if (flags & ~(MRL_WS_STOP | MRL_WS_ROLLBACK))
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: unknown flags 0x%x in a publish", label(w), flags);
    return MRL_OK;
}

mrl_status mrl_weight_store_commit(mrl_weight_store *w, int slot, int64_t version, int flags) {
    mrl_status st = check_publish(w, version, flags);
    if (st) return st;
    if (slot < 0) slot = NO_SLOT; /* flags only */
    if (slot != NO_SLOT && slot >= w->n_slots)
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: commit of slot %d (%d slots)", label(w), slot,
                             w->n_slots);
    atomic_store(&w->hdr->latest, make_word(version, flags, slot));
    w->last_version = version;
    return MRL_OK;
}

mrl_status mrl_weight_store_publish(mrl_weight_store *w, const float *src, int64_t version, int flags) {
    mrl_status st = check_publish(w, version, flags);
    if (st) return st;
    int slot = NO_SLOT;
    if (src) {
        if ((st = mrl_weight_store_begin(w, &slot))) return st;
        mrl_weight_store_write(w, slot, 0, src, w->n_floats);
    }
    return mrl_weight_store_commit(w, slot, version, flags);
}

/* ------------------------------------------------------------- reader side */

int64_t mrl_weight_store_latest(const mrl_weight_store *w, int *flags) {
    uint64_t word = atomic_load_explicit(&w->hdr->latest, memory_order_acquire);
    if (flags) *flags = word_flags(word);
    return word_version(word);
}

static int ready(uint64_t word, int64_t min_version) {
    return word_version(word) >= min_version || (word_flags(word) & MRL_WS_STOP);
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static mrl_status timed_out(const mrl_weight_store *w, int reader, int64_t min_version, double timeout_s,
                            uint64_t word) {
    char writer[80] = "";
    int32_t pid = w->hdr->writer_pid;
    if (w->name[0] && pid > 0) /* between processes: is the writer still there? */
        snprintf(writer, sizeof writer, "; the writer, process %d, %s", (int)pid,
                 kill(pid, 0) != 0 && errno == ESRCH ? "is gone" : "is still running");
    return mrl_set_error(MRL_ERR_TIMEOUT, "weight store %s: reader %d waited %.3g s for version >= %lld; the latest "
                         "seen is %lld%s%s", label(w), reader, timeout_s, (long long)min_version,
                         (long long)word_version(word), word_version(word) < 0 ? " (none published)" : "", writer);
}

/* Waits until the latest word is ready for min_version; *word is it. A
 * few microseconds of spinning catch a publish that is about to land;
 * after that each sleep is a quarter of the time waited so far (1 us to
 * 1 ms): a reader wakes at most about 25% late, and one that waits for
 * minutes wakes a thousand times a second, a negligible load. */
static mrl_status wait_ready(mrl_weight_store *w, int reader, int64_t min_version, double timeout_s, uint64_t *word) {
    double start = mrl_time_now();
    for (;;) {
        *word = atomic_load_explicit(&w->hdr->latest, memory_order_acquire);
        if (ready(*word, min_version)) return MRL_OK;
        if (mrl_stop_requested())
            return mrl_set_error(MRL_ERR_STOPPED, "weight store %s: reader %d stopped while waiting for version >= "
                                 "%lld (the latest is %lld): %s", label(w), reader, (long long)min_version,
                                 (long long)word_version(*word), mrl_stop_reason());
        double waited = mrl_time_now() - start;
        if (timeout_s > 0 && waited >= timeout_s) return timed_out(w, reader, min_version, timeout_s, *word);
        if (waited < SPIN_SECONDS) {
            cpu_relax();
            continue;
        }
        double nap = waited / 4;
        if (nap < 1e-6) nap = 1e-6;
        if (nap > 1e-3) nap = 1e-3;
        struct timespec ts = {0, (long)(nap * 1e9)};
        nanosleep(&ts, NULL);
    }
}

static mrl_status check_reader(const mrl_weight_store *w, int reader) {
    if (w->reader == CO_WRITER)
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: a co-writer's handle does not read", label(w));
    if (w->reader >= 0 && reader != w->reader)
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: this handle was opened as reader %d, not %d",
                             label(w), w->reader, reader);
    if (reader < 0 || reader >= w->n_readers)
        return mrl_set_error(MRL_ERR_INVALID, "weight store %s: reader %d (the store has readers 0..%d)", label(w),
                             reader, w->n_readers - 1);
    return MRL_OK;
}

mrl_status mrl_weight_store_acquire(mrl_weight_store *w, int reader, int64_t min_version, double timeout_s,
                                    const float **params, int64_t *version, int *flags) {
    if (!w) return mrl_set_error(MRL_ERR_INVALID, "weight store: NULL handle");
    mrl_status st = check_reader(w, reader);
    if (st) return st;
    if (!(timeout_s >= 0)) return mrl_set_error(MRL_ERR_INVALID, "weight store %s: timeout %g s", label(w), timeout_s);
    _Atomic int32_t *held = &w->hdr->readers[reader].held;
    uint64_t word = atomic_load_explicit(&w->hdr->latest, memory_order_acquire);
    for (;;) {
        /* a publish that came during the re-check may be a flags-only one
         * after a STOP that no longer satisfies min_version: wait again */
        if (!ready(word, min_version) && (st = wait_ready(w, reader, min_version, timeout_s, &word))) return st;
        atomic_store(held, word_slot(word));
        uint64_t again = atomic_load(&w->hdr->latest);
        if (again == word) break; /* still the latest after the hold was visible: ours */
        word = again;
    }
    int slot = word_slot(word);
    if (params) *params = slot == NO_SLOT ? NULL : (const float *)(w->slots + slot * w->slot_bytes);
    if (version) *version = word_version(word);
    if (flags) *flags = word_flags(word);
    return MRL_OK;
}

void mrl_weight_store_release(mrl_weight_store *w, int reader) {
    /* release order: the reads of the slot come before the writer can see it free */
    if (w && reader >= 0 && reader < w->n_readers && (w->reader == WRITER || reader == w->reader))
        atomic_store_explicit(&w->hdr->readers[reader].held, NO_SLOT, memory_order_release);
}

/* What is wrong with a file that claims to be a store, or NULL. */
static const char *bad_header(const ws_header *h, int64_t file_bytes, char *why, size_t why_size) {
    if (atomic_load_explicit(&h->magic, memory_order_acquire) != WS_MAGIC)
        return "it does not start with a weight store's magic (not a store, or one still being made)";
    if (h->layout != LAYOUT) {
        snprintf(why, why_size, "its layout version is %u, this build reads %d", h->layout, LAYOUT);
        return why;
    }
    if (h->n_readers < 1 || h->n_readers > MAX_READERS || h->n_slots != h->n_readers + 2 || h->n_floats < 1 ||
        h->n_floats > ((int64_t)1 << 44) || h->header_bytes != header_bytes_for(h->n_readers) ||
        h->slot_bytes != round_up(h->n_floats * (int64_t)sizeof(float), page_size()) ||
        h->total_bytes != h->header_bytes + h->n_slots * h->slot_bytes || h->total_bytes != file_bytes) {
        snprintf(why, why_size, "its header is inconsistent (%d readers, %d slots of %lld floats, %lld bytes "
                 "declared, %lld in the file)", h->n_readers, h->n_slots, (long long)h->n_floats,
                 (long long)h->total_bytes, (long long)file_bytes);
        return why;
    }
    return NULL;
}

/* Takes reader index r for this process. An index held by a process that
 * no longer exists is taken over (a restarted rollout rank). */
static mrl_status claim_reader(mrl_weight_store *w, int reader) {
    _Atomic int32_t *pid = &w->hdr->readers[reader].pid;
    int32_t me = (int32_t)getpid(), owner = 0;
    while (!atomic_compare_exchange_strong(pid, &owner, me)) {
        if (owner == me || kill(owner, 0) == 0 || errno != ESRCH)
            return mrl_set_error(MRL_ERR_INVALID, "weight store %s: reader %d is open already, in process %d: each "
                                 "reader index is for one reader", w->name, reader, (int)owner);
        /* owner is gone: try again from its pid (another taker may win) */
    }
    atomic_store(&w->hdr->readers[reader].held, NO_SLOT);
    return MRL_OK;
}

static mrl_status open_as(const char *name, int64_t n_floats, int reader, mrl_weight_store **out);

mrl_status mrl_weight_store_open(const char *name, int64_t n_floats, int reader, mrl_weight_store **out) {
    if (reader >= 0) return open_as(name, n_floats, reader, out);
    if (out) *out = NULL;
    return mrl_set_error(MRL_ERR_INVALID, "weight store %s: reader %d", name ? name : "(null)", reader);
}

mrl_status mrl_weight_store_open_writer(const char *name, int64_t n_floats, mrl_weight_store **out) {
    return open_as(name, n_floats, CO_WRITER, out);
}

static mrl_status open_as(const char *name, int64_t n_floats, int reader, mrl_weight_store **out) {
    if (!out) return mrl_set_error(MRL_ERR_INVALID, "weight store: NULL out");
    *out = NULL;
    if (!name) return mrl_set_error(MRL_ERR_INVALID, "weight store: open needs a name (a private store's handle is "
                                    "its readers' too)");
    mrl_status st = check_name(name);
    if (st) return st;
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) {
        if (errno == ENOENT)
            return mrl_set_error(MRL_ERR_IO, "weight store %s: no such store (/dev/shm%s does not exist): the writer "
                                 "has not created it yet, or has unlinked it already", name, name);
        return mrl_set_error(MRL_ERR_IO, "weight store %s: cannot open: %s", name, strerror(errno));
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int err = errno;
        close(fd);
        return mrl_set_error(MRL_ERR_IO, "weight store %s: cannot stat: %s", name, strerror(err));
    }
    if (sb.st_size < (off_t)sizeof(ws_header)) {
        close(fd);
        return mrl_set_error(MRL_ERR_FORMAT, "weight store %s: /dev/shm%s is not a weight store: %lld bytes, less "
                             "than a store's header", name, name, (long long)sb.st_size);
    }
    void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    int err = errno;
    close(fd);
    if (p == MAP_FAILED)
        return mrl_set_error(MRL_ERR_IO, "weight store %s: cannot map %lld bytes: %s", name, (long long)sb.st_size,
                             strerror(err));
    mrl_weight_store *w = calloc(1, sizeof *w);
    if (!w) {
        munmap(p, (size_t)sb.st_size);
        return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    }
    ws_header *h = p;
    *w = (mrl_weight_store){.hdr = h, .map_bytes = sb.st_size, .reader = -1, .unlinked = 1};
    snprintf(w->name, sizeof w->name, "%s", name);
    char why[200];
    const char *bad = bad_header(h, sb.st_size, why, sizeof why);
    if (bad) st = mrl_set_error(MRL_ERR_FORMAT, "weight store %s: /dev/shm%s is not a usable store: %s", name, name, bad);
    else if (h->n_floats != n_floats)
        st = mrl_set_error(MRL_ERR_INVALID, "weight store %s: holds %lld floats per slot, the reader expects %lld",
                           name, (long long)h->n_floats, (long long)n_floats);
    else if (reader != CO_WRITER && (reader < 0 || reader >= h->n_readers))
        st = mrl_set_error(MRL_ERR_INVALID, "weight store %s: reader %d (the store has readers 0..%d)", name, reader,
                           h->n_readers - 1);
    if (!st && reader != CO_WRITER) st = claim_reader(w, reader);
    if (st) {
        mrl_weight_store_free(w); /* reader -1 and unlinked: only unmaps */
        return st;
    }
    w->n_floats = h->n_floats;
    w->slot_bytes = h->slot_bytes;
    w->n_readers = h->n_readers;
    w->n_slots = h->n_slots;
    w->reader = reader;
    w->slots = (char *)h + h->header_bytes;
    /* a reader only reads the weights: a stray write in its engine faults
     * here instead of corrupting every reader's copy */
    if (reader != CO_WRITER) mprotect(w->slots, (size_t)(w->n_slots * w->slot_bytes), PROT_READ);
    mrl_mem_account(MRL_MEM_PARAMS, w->map_bytes);
    *out = w;
    return MRL_OK;
}

int64_t mrl_weights_bf16_delta(uint16_t *old16, const float *cur, int64_t n, int64_t cap, uint32_t *at, uint16_t *val) {
    /* a chunk at a time through the vectorised conversion, then a compare (mostly equal: the
     * chunk's words compared 4 at a time first) */
    enum { CHUNK = 4096 };
    uint16_t b[CHUNK];
    int64_t k = 0;
    for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
        int64_t m = n - i0 < CHUNK ? n - i0 : CHUNK;
        mrl_convert_f32_to_bf16(cur + i0, b, m);
        uint16_t *o = old16 + i0;
        for (int64_t j = 0; j < m; j++) {
            if (j + 4 <= m && memcmp(b + j, o + j, 8) == 0) {
                j += 3;
                continue;
            }
            if (b[j] == o[j]) continue;
            if (k < cap) at[k] = (uint32_t)(i0 + j), val[k] = b[j];
            o[j] = b[j];
            k++;
        }
    }
    return k;
}

void mrl_weights_bf16_apply(float *dst, const int64_t *start, const int64_t *to, const int64_t *count, int64_t n,
                            const uint32_t *at, const uint16_t *val, int64_t k) {
    int64_t c = 0;
    for (int64_t j = 0; j < k; j++) {
        int64_t pos = at[j];
        while (c + 1 < n && start[c + 1] <= pos) c++;
        if (c < n && pos >= start[c] && pos < start[c] + count[c]) dst[to[c] + pos - start[c]] = mrl_bf16_to_f32(val[j]);
    }
}
