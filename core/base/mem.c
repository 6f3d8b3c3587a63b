/* Host allocations with per-category accounting. Each block carries a small
 * header (its size and category) in front of the 64-byte-aligned payload so
 * that mrl_mem_free can undo the accounting. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include "base/mem.h"
#include "base/error.h"

#define MEM_ALIGN 64

typedef struct block_header {
    size_t bytes;
    int category;
    unsigned magic;
} block_header;
#define BLOCK_MAGIC 0x6d726c4du

/* one set of counters per device kind: [0] host, [1] CUDA (every GPU of the process) */
static _Atomic int64_t counters_current[2][MRL_MEM_NUM_CATEGORIES];
static _Atomic int64_t counters_peak[2][MRL_MEM_NUM_CATEGORIES];
static _Atomic int64_t counters_total[2], counters_total_peak[2];

static void raise_peak(_Atomic int64_t *peak_slot, int64_t value) {
    int64_t seen = atomic_load(peak_slot);
    while (value > seen && !atomic_compare_exchange_weak(peak_slot, &seen, value)) {}
}

static void account(int kind, mrl_mem_category category, int64_t delta) {
    if ((int)category < 0 || category >= MRL_MEM_NUM_CATEGORIES) category = MRL_MEM_OTHER;
    int64_t now = atomic_fetch_add(&counters_current[kind][category], delta) + delta;
    int64_t all = atomic_fetch_add(&counters_total[kind], delta) + delta;
    if (delta > 0) {
        raise_peak(&counters_peak[kind][category], now);
        raise_peak(&counters_total_peak[kind], all);
    }
}

void mrl_mem_account(mrl_mem_category category, int64_t delta) { account(0, category, delta); }
void mrl_mem_account_device(mrl_mem_category category, int64_t delta) { account(1, category, delta); }

static void get_stats(int kind, mrl_mem_stats *out) {
    for (int i = 0; i < MRL_MEM_NUM_CATEGORIES; i++) {
        out->current[i] = atomic_load(&counters_current[kind][i]);
        out->peak[i] = atomic_load(&counters_peak[kind][i]);
    }
    out->total = atomic_load(&counters_total[kind]);
    out->total_peak = atomic_load(&counters_total_peak[kind]);
}

void mrl_mem_get_device_stats(mrl_mem_stats *out) {
    if (out) get_stats(1, out);
}

/* A number from a /proc or cgroup file: the value after `key` (NULL: the
 * first number in the file), in bytes (the file's kB times 1024 with kb);
 * -1 when the file or the key is not there. */
static int64_t read_number(const char *path, const char *key, int kb) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[256];
    int64_t v = -1;
    while (fgets(line, sizeof line, f)) {
        const char *at = line;
        if (key) {
            size_t n = strlen(key);
            if (strncmp(line, key, n) != 0) continue;
            at = line + n;
        }
        char *end;
        long long x = strtoll(at, &end, 10);
        if (end != at) v = kb ? (int64_t)x * 1024 : (int64_t)x;
        break;
    }
    fclose(f);
    return v;
}

int64_t mrl_mem_available(void) {
    int64_t avail = read_number("/proc/meminfo", "MemAvailable:", 1);
    /* a container's limit (cgroup v2), when tighter than the machine's */
    int64_t limit = read_number("/sys/fs/cgroup/memory.max", NULL, 0);
    int64_t used = read_number("/sys/fs/cgroup/memory.current", NULL, 0);
    if (limit > 0 && used >= 0 && (avail < 0 || limit - used < avail)) avail = limit - used > 0 ? limit - used : 0;
    return avail;
}

/* Allocations this large are checked against the memory available first:
 * Linux promises nearly any size (overcommit) and then kills the process
 * when the zero fill touches pages that are not there. */
#define MEM_CHECK_BYTES ((size_t)64 << 20)

/* Allocations this large start on a 2 MiB boundary and ask the kernel for
 * transparent huge pages (MADV_HUGEPAGE: with THP in its common "madvise"
 * mode there are none otherwise). Weights, KV cache and activations are
 * streamed or read in scattered blocks (paged attention): 4 KiB pages make
 * each new page a TLB miss, and in a virtual machine a miss walks two page
 * tables. Decode and the training step ran faster so, and advising every
 * category did better than the weights alone (bench/RESULTS.md, "Huge
 * pages"). The price is a slower first touch where the host backs the
 * guest's memory lazily (a block freed and allocated again is then faster
 * than with small pages). */
#define HUGE_PAGE_BYTES ((size_t)2 << 20)
#define HUGE_ALLOC_BYTES ((size_t)4 << 20)

/* The process's budget for the bytes it holds through moonrl (0: none), and
 * the name errors give it (the config key that set it). */
static _Atomic int64_t budget_bytes;
static char budget_name[64] = "the memory budget";

mrl_status mrl_mem_set_budget(int64_t bytes, const char *name) {
    if (bytes < 0) return mrl_set_error(MRL_ERR_INVALID, "memory budget must be >= 0 bytes, got %lld", (long long)bytes);
    snprintf(budget_name, sizeof budget_name, "%s", name && *name ? name : "the memory budget");
    atomic_store(&budget_bytes, bytes);
    return MRL_OK;
}

int64_t mrl_mem_budget(void) { return atomic_load(&budget_bytes); }

/* 1 (and the error set) when `bytes` more would take the process past its budget. Every size,
 * not only the large ones: two loads and a compare. Threads allocating at once may each pass
 * with the other's bytes not yet counted; a budget is a guard against a model that cannot fit,
 * not an exact cap. */
static int past_budget(size_t bytes, mrl_mem_category category) {
    int64_t budget = atomic_load_explicit(&budget_bytes, memory_order_relaxed);
    if (budget <= 0) return 0;
    int64_t held = atomic_load_explicit(&counters_total[0], memory_order_relaxed);
    if (held + (int64_t)bytes <= budget) return 0;
    mrl_set_error(MRL_ERR_NOMEM, "%s asks for %.1f MiB, and this process holds %.1f MiB through moonrl: "
                  "past %s (%.1f MiB)", mrl_mem_category_name(category), bytes / 1048576.0,
                  held / 1048576.0, budget_name, budget / 1048576.0);
    return 1;
}

void *mrl_mem_alloc(size_t bytes, mrl_mem_category category) {
    if (bytes > ((size_t)1 << 46)) {
        mrl_set_error(MRL_ERR_NOMEM, "allocation of %zu bytes for %s refused (too large)", bytes,
                      mrl_mem_category_name(category));
        return NULL;
    }
    if (past_budget(bytes, category)) return NULL;
    if (bytes >= MEM_CHECK_BYTES) {
        int64_t avail = mrl_mem_available();
        if (avail >= 0 && (int64_t)bytes > avail) {
            mrl_set_error(MRL_ERR_NOMEM, "%s asks for %.2f GiB, more than the %.2f GiB of memory available "
                          "(MemAvailable, or the container's limit); this process holds %.2f GiB through moonrl",
                          mrl_mem_category_name(category), bytes / 1073741824.0, avail / 1073741824.0,
                          atomic_load(&counters_total[0]) / 1073741824.0);
            return NULL;
        }
    }
    size_t padded = (bytes + MEM_ALIGN - 1) / MEM_ALIGN * MEM_ALIGN;
    int huge = padded >= HUGE_ALLOC_BYTES;
    char *raw = NULL; /* posix_memalign: aligned_alloc wants the size a multiple of the alignment */
    if (posix_memalign((void **)&raw, huge ? HUGE_PAGE_BYTES : MEM_ALIGN, padded + MEM_ALIGN)) raw = NULL;
    if (!raw) {
        mrl_set_error(MRL_ERR_NOMEM, "out of memory allocating %zu bytes for %s", bytes,
                      mrl_mem_category_name(category));
        return NULL;
    }
#ifdef MADV_HUGEPAGE
    if (huge) madvise(raw, (padded + MEM_ALIGN) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, MADV_HUGEPAGE); /* advice only */
#endif
    memset(raw + MEM_ALIGN, 0, padded); /* (the fault of each 2 MiB page happens here) */
    block_header *h = (block_header *)raw;
    h->bytes = bytes;
    h->category = category;
    h->magic = BLOCK_MAGIC;
    mrl_mem_account(category, (int64_t)bytes);
    return raw + MEM_ALIGN;
}

void mrl_mem_free(void *ptr) {
    if (!ptr) return;
    char *raw = (char *)ptr - MEM_ALIGN;
    block_header *h = (block_header *)raw;
    if (h->magic != BLOCK_MAGIC) abort(); /* freeing memory not from mrl_mem_alloc: a bug */
    h->magic = 0;
    mrl_mem_account((mrl_mem_category)h->category, -(int64_t)h->bytes);
    free(raw);
}

void mrl_mem_get_stats(mrl_mem_stats *out) {
    if (out) get_stats(0, out);
}

void mrl_mem_reset_peak(void) {
    for (int kind = 0; kind < 2; kind++) {
        for (int i = 0; i < MRL_MEM_NUM_CATEGORIES; i++)
            atomic_store(&counters_peak[kind][i], atomic_load(&counters_current[kind][i]));
        atomic_store(&counters_total_peak[kind], atomic_load(&counters_total[kind]));
    }
}

const char *mrl_mem_category_name(mrl_mem_category category) {
    static const char *names[] = {"params", "grads", "optim", "activations", "kv_cache", "other"};
    if ((int)category < 0 || category >= MRL_MEM_NUM_CATEGORIES) return "unknown";
    return names[category];
}

int64_t mrl_mem_rss(void) { return read_number("/proc/self/status", "VmRSS:", 1); }
int64_t mrl_mem_rss_peak(void) { return read_number("/proc/self/status", "VmHWM:", 1); }

/* The highest VmHWM seen before a reset: the kernel forgets it, and the
 * process's peak since it began (mrl_mem_rss_peak_lifetime) needs it. */
static _Atomic int64_t rss_peak_reset;

int64_t mrl_mem_rss_peak_lifetime(void) {
    int64_t now = mrl_mem_rss_peak(), before = atomic_load(&rss_peak_reset);
    return now > before ? now : before;
}

void mrl_mem_reset_rss_peak(void) {
    raise_peak(&rss_peak_reset, mrl_mem_rss_peak());
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return;
    fputs("5", f); /* 5: reset the peak resident set size (proc(5)) */
    fclose(f);
}

/* ---- regions: reserved address space, memory only where pinned ---- */

/* The host's backing: anonymous pages, readable only while mapped. */
static mrl_status host_reserve(const mrl_mem_backing *b, int64_t bytes, char **base, void **state) {
    (void)b;
    *state = NULL;
    void *p = mmap(NULL, (size_t)bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return MRL_ERR_NOMEM;
#ifdef MADV_HUGEPAGE
    /* advice only: parts gathered into place and given back every step fault in 2 MiB pages
     * instead of 4 KiB ones (a ZeRO-3 step on 2 ranks took 0.94 s with small pages, 0.58 s so;
     * bench/RESULTS.md, "Sharded training state"); the resident set may then exceed what is
     * pinned by up to a huge page at each end of a part */
    madvise(p, (size_t)bytes, MADV_HUGEPAGE);
#endif
    *base = p;
    return MRL_OK;
}
static void host_release(void *state, char *base, int64_t bytes) {
    (void)state;
    munmap(base, (size_t)bytes);
}
static mrl_status host_map(void *state, char *base, int64_t lo, int64_t hi) {
    (void)state;
    if (mprotect(base + lo, (size_t)(hi - lo), PROT_READ | PROT_WRITE))
        return mrl_set_error(MRL_ERR_NOMEM, "memory region: cannot map %lld bytes", (long long)(hi - lo));
    return MRL_OK;
}
static void host_unmap(void *state, char *base, int64_t lo, int64_t hi) { /* zero when mapped again */
    (void)state;
    madvise(base + lo, (size_t)(hi - lo), MADV_DONTNEED);
    mprotect(base + lo, (size_t)(hi - lo), PROT_NONE);
}
static const mrl_mem_backing host_backing = {4096, 0, host_reserve, host_release, host_map, host_unmap, 0};

struct mrl_mem_region {
    char *base;
    int64_t bytes, pages, page;
    uint8_t *pins; /* [pages]: how many pins hold each page (0: no memory, unreadable) */
    int64_t resident; /* bytes of pinned pages, counted under category */
    mrl_mem_category category;
    const mrl_mem_backing *b;
    void *state; /* the backing's, for this region */
};

mrl_status mrl_mem_region_create(int64_t bytes, mrl_mem_category category, mrl_mem_region **out) {
    return mrl_mem_region_create_backed(bytes, category, NULL, out);
}

mrl_status mrl_mem_region_create_backed(int64_t bytes, mrl_mem_category category, const mrl_mem_backing *b,
                                        mrl_mem_region **out) {
    *out = NULL;
    if (!b) b = &host_backing;
    if (bytes <= 0 || bytes > ((int64_t)1 << 46) || b->page <= 0)
        return mrl_set_error(MRL_ERR_INVALID, "memory region of %lld bytes", (long long)bytes);
    mrl_mem_region *r = calloc(1, sizeof *r);
    if (!r) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    r->bytes = bytes;
    r->page = b->page;
    r->pages = (bytes + r->page - 1) / r->page;
    r->category = category;
    r->b = b;
    r->pins = calloc((size_t)r->pages, 1);
    /* address space only: no page is readable until pinned */
    mrl_status st = r->pins ? b->reserve(b, r->pages * r->page, &r->base, &r->state) : MRL_ERR_NOMEM;
    if (st) {
        free(r->pins);
        free(r);
        return mrl_wrap_error(st, "cannot reserve %lld bytes of %s address space for %s", (long long)bytes,
                              b->device ? "device" : "host", mrl_mem_category_name(category));
    }
    *out = r;
    return MRL_OK;
}

static void region_account(const mrl_mem_region *r, int64_t delta) {
    if (r->b->device) mrl_mem_account_device(r->category, delta);
    else mrl_mem_account(r->category, delta);
}

/* Each run of pages in [a, b) that is pinned (pinned = 1) or not (0) unmapped at once. */
static void unmap_runs(mrl_mem_region *r, int64_t a, int64_t b, int pinned) {
    for (int64_t p = a; p < b;) {
        if ((r->pins[p] != 0) != pinned) {
            p++;
            continue;
        }
        int64_t q = p;
        while (q < b && (r->pins[q] != 0) == pinned) q++;
        r->b->unmap(r->state, r->base, p * r->page, q * r->page);
        p = q;
    }
}

void mrl_mem_region_free(mrl_mem_region *r) {
    if (!r) return;
    unmap_runs(r, 0, r->pages, 1); /* what is still pinned given back */
    r->b->release(r->state, r->base, r->pages * r->page);
    region_account(r, -r->resident);
    free(r->pins);
    free(r);
}

void *mrl_mem_region_base(const mrl_mem_region *r) { return r ? r->base : NULL; }
int64_t mrl_mem_region_resident(const mrl_mem_region *r) { return r ? r->resident : 0; }
int64_t mrl_mem_region_page(const mrl_mem_region *r) { return r ? r->page : 0; }

/* The pages [a, b) of bytes [lo, hi) (hi > lo). */
static void page_span(const mrl_mem_region *r, int64_t lo, int64_t hi, int64_t *a, int64_t *b) {
    *a = lo / r->page;
    *b = (hi + r->page - 1) / r->page;
}

mrl_status mrl_mem_region_pin(mrl_mem_region *r, int64_t lo, int64_t hi) {
    if (lo < 0 || hi > r->bytes || lo > hi)
        return mrl_set_error(MRL_ERR_INVALID, "memory region: pin [%lld, %lld) outside its %lld bytes", (long long)lo,
                             (long long)hi, (long long)r->bytes);
    if (lo == hi) return MRL_OK;
    int64_t a, b, fresh = 0;
    page_span(r, lo, hi, &a, &b);
    for (int64_t p = a; p < b; p++) {
        if (r->pins[p] == UINT8_MAX)
            return mrl_set_error(MRL_ERR_INTERNAL, "memory region: page %lld pinned %d times", (long long)p, UINT8_MAX);
        fresh += r->pins[p] == 0;
    }
    if (fresh && !r->b->device && past_budget((size_t)(fresh * r->page), r->category)) return MRL_ERR_NOMEM;
    for (int64_t p = a; p < b;) { /* each run of unpinned pages mapped at once */
        if (r->pins[p]) {
            p++;
            continue;
        }
        int64_t q = p;
        while (q < b && !r->pins[q]) q++;
        mrl_status st = r->b->map(r->state, r->base, p * r->page, q * r->page);
        if (st) {
            unmap_runs(r, a, p, 0); /* the runs mapped before it given back: nothing pinned */
            return st;
        }
        p = q;
    }
    for (int64_t p = a; p < b; p++) r->pins[p]++;
    r->resident += fresh * r->page;
    region_account(r, fresh * r->page);
    return MRL_OK;
}

void mrl_mem_region_unpin(mrl_mem_region *r, int64_t lo, int64_t hi) {
    if (lo < 0 || hi > r->bytes || lo >= hi) return;
    int64_t a, b, freed = 0;
    page_span(r, lo, hi, &a, &b);
    for (int64_t p = a; p < b; p++)
        if (r->pins[p] && --r->pins[p] == 0) freed++;
    unmap_runs(r, a, b, 0); /* the pages left unpinned given back (zero when pinned again) */
    r->resident -= freed * r->page;
    region_account(r, -freed * r->page);
}
