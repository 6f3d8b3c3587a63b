/* A mutation driver for the fuzz targets where libFuzzer is not at hand (gcc
 * builds: build-sanitize, the CI's). It calls the target's
 * LLVMFuzzerTestOneInput as libFuzzer would and takes libFuzzer's flags, so a
 * target and the commands that run it are the same for both:
 *
 *   fuzz_json [-flags] DIR...    every file of each DIR (the seeds) once, then
 *                                mutations of them until the time is up
 *   fuzz_json FILE...            each file once, nothing else (reproduce a finding)
 *
 *   -max_total_time=S   seconds of mutations after the seeds (default 10)
 *   -runs=N             at most N mutated inputs
 *   -seed=N             the random seed (default: from the clock; printed first)
 *   -max_len=N          longest mutated input (default: the longest seed + 1024, at least 4096)
 *   -timeout=S          an input running longer than S seconds is a finding (default 20)
 *   -rss_limit_mb=M     the process growing past M MiB is a finding (default 2048)
 *   -artifact_prefix=P  a finding's input is written to P + "crash-|timeout-|oom-" + hash
 *   -dict=FILE          tokens the mutations insert (libFuzzer's / AFL's dictionary format)
 *   any other -flag is libFuzzer's and is ignored here.
 *
 * Unlike libFuzzer it has no coverage feedback: it mutates the seeds (and
 * now and then the previous mutant again) blindly. What it does have: the
 * seeds themselves run every time (the regression part), mutations made for
 * binary headers (interesting integers, lengths, splices between seeds) and
 * for text (dictionary tokens, numbers rewritten), and every way a run can
 * go wrong caught and its input kept.
 *
 * How an input is kept whatever kills the process: the fuzzing runs in a
 * child process that copies each input into memory shared with the parent
 * before running it. The parent waits; when the child dies in an input (a
 * sanitizer report, a signal, an abort), overruns the timeout or the memory
 * limit, it writes that input out as the artifact and fails. Each input runs
 * from a heap copy of exactly its size, so the sanitizers catch a read one
 * byte past it; after an input that left allocations behind, LeakSanitizer
 * looks for a leak then and there, so a leak too is blamed on its input. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "fuzz.h"

/* The sanitizers' hooks, where their runtimes are linked (weak: NULL otherwise). */
int __sanitizer_install_malloc_and_free_hooks(void (*m)(const volatile void *, size_t),
                                              void (*f)(const volatile void *)) __attribute__((weak));
int __lsan_do_recoverable_leak_check(void) __attribute__((weak));
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

/* Reports with a stack, and the limits libFuzzer applies: an abort() (a
 * broken FUZZ_ASSERT) reported like any other finding, and one allocation
 * over 2 GiB is a finding, not a slow swap. ASAN_OPTIONS / UBSAN_OPTIONS
 * in the environment still win. */
const char *__asan_default_options(void) { return "handle_abort=1:max_allocation_size_mb=2048:detect_leaks=1"; }
const char *__ubsan_default_options(void) { return "halt_on_error=1:print_stacktrace=1"; }

typedef struct blob {
    uint8_t *p;
    size_t n;
    char *name;
} blob;

/* What the child shares with the parent: the input running now. */
typedef struct shared {
    atomic_int running;      /* 1 while an input runs (its bytes below) */
    atomic_ullong done;      /* inputs finished: the parent's sign of progress */
    size_t len;
    uint8_t data[];
} shared;

static struct {
    double seconds, timeout;
    long long runs;
    uint64_t seed;
    size_t max_len;
    long rss_limit_mb;
    const char *artifact_prefix, *dict;
} opt = {10, 20, -1, 0, 0, 2048, "", NULL};

static blob *seeds, *tokens;
static size_t n_seeds, n_tokens;
static shared *sh;
static uint64_t rng_state;

static uint64_t rnd(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1DULL;
}
static size_t below(size_t n) { return n ? (size_t)(rnd() % n) : 0; }

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "fuzz: out of memory\n");
        exit(1);
    }
    return p;
}

/* ------------------------------------------------------------ inputs */

static int read_file(const char *path, blob *out) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    size_t cap = 4096, n = 0;
    uint8_t *p = xmalloc(cap);
    for (;;) {
        if (n == cap) p = realloc(p, cap *= 2);
        size_t got = fread(p + n, 1, cap - n, f);
        if (!got) break;
        n += got;
    }
    fclose(f);
    out->p = p, out->n = n, out->name = strdup(path);
    return 0;
}

static void add_seed(const char *path) {
    seeds = realloc(seeds, (n_seeds + 1) * sizeof *seeds);
    if (read_file(path, &seeds[n_seeds]) == 0) n_seeds++;
    else fprintf(stderr, "fuzz: cannot read %s: %s\n", path, strerror(errno));
}

static int by_name(const void *a, const void *b) { return strcmp(((const blob *)a)->name, ((const blob *)b)->name); }

static void add_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "fuzz: cannot open %s: %s\n", dir, strerror(errno));
        exit(1);
    }
    struct dirent *e;
    char path[4096];
    size_t first = n_seeds;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) add_seed(path);
    }
    closedir(d);
    if (n_seeds > first) qsort(seeds + first, n_seeds - first, sizeof *seeds, by_name); /* the same order every run */
}

/* A dictionary: lines `name="text"` or `"text"` with \\, \" and \xNN escapes; # comments. */
static void read_dict(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "fuzz: cannot read the dictionary %s: %s\n", path, strerror(errno));
        exit(1);
    }
    char line[4096];
    while (fgets(line, sizeof line, f)) {
        char *q = strchr(line, '"');
        if (line[strspn(line, " \t")] == '#' || !q) continue;
        uint8_t *tok = xmalloc(strlen(q));
        size_t n = 0;
        for (q++; *q && *q != '"'; q++) {
            if (*q == '\\' && q[1] == 'x' && q[2] && q[3]) {
                char hex[3] = {q[2], q[3], 0};
                tok[n++] = (uint8_t)strtol(hex, NULL, 16);
                q += 3;
            } else if (*q == '\\' && q[1]) {
                tok[n++] = (uint8_t)*++q;
            } else {
                tok[n++] = (uint8_t)*q;
            }
        }
        tokens = realloc(tokens, (n_tokens + 1) * sizeof *tokens);
        tokens[n_tokens++] = (blob){tok, n, NULL};
    }
    fclose(f);
}

/* ------------------------------------------------------------ mutations */

static const int64_t interesting[] = {0, 1, -1, 2, 7, 8, 16, 32, 64, 100, 127, 128, 255, 256, 1000, 1024, 4096,
                                      32767, 32768, 65535, 65536, 0x7fffffff, 0x80000000LL, 0xffffffffLL,
                                      0x100000000LL, 1LL << 53, 0x7fffffffffffffffLL, INT64_MIN, -2, -128, -32768};
static const char *const numbers[] = {"0", "-1", "1", "-0", "2", "255", "256", "65536", "2147483647", "2147483648",
                                      "4294967295", "4294967296", "9007199254740993", "9223372036854775807",
                                      "9223372036854775808", "18446744073709551616", "-9223372036854775809",
                                      "1e309", "-1e309", "1e-400", "0.5", "1.5e3", "NaN", "Infinity", "1e",
                                      "00", "1.", ".5", "99999999999999999999999999999"};
static const char special[] = "\0\1\x7f\x80\xff\"\\{}[],:\n\r\t 0-.e<>%/?=&#";

/* Replace p[at..at+del) with ins[0..n), within cap. */
static void splice_in(uint8_t *p, size_t *len, size_t cap, size_t at, size_t del, const uint8_t *ins, size_t n) {
    if (at > *len) at = *len;
    if (del > *len - at) del = *len - at;
    if (*len - del + n > cap) n = cap - (*len - del);
    memmove(p + at + n, p + at + del, *len - at - del);
    if (n) memcpy(p + at, ins, n);
    *len = *len - del + n;
}

static size_t small_len(size_t max) { /* mostly short ranges */
    size_t n = 1 + below(rnd() & 3 ? 8 : 64);
    return n < max ? n : max;
}

static void mutate_once(uint8_t *p, size_t *len, size_t cap) {
    size_t n = *len;
    uint8_t tmp[128];
    switch (below(14)) {
    case 0: /* flip a bit */
        if (n) p[below(n)] ^= (uint8_t)(1u << below(8));
        break;
    case 1: /* a random byte */
        if (n) p[below(n)] = (uint8_t)rnd();
        break;
    case 2: /* a byte that means something to some parser */
        if (n) p[below(n)] = (uint8_t)special[below(sizeof special - 1)];
        break;
    case 3: /* an interesting integer, 1 to 8 bytes, either endianness */
    case 4: {
        size_t w = (size_t)1 << below(4);
        if (n < w) break;
        uint64_t v = (uint64_t)interesting[below(sizeof interesting / sizeof *interesting)];
        if (rnd() & 1) v += (uint64_t)(int64_t)(below(33) - 16);
        size_t at = below(n - w + 1);
        int be = (int)(rnd() & 1);
        for (size_t i = 0; i < w; i++) p[at + i] = (uint8_t)(v >> (8 * (be ? w - 1 - i : i)));
        break;
    }
    case 5: /* delete a range */
        if (n) {
            size_t at = below(n);
            splice_in(p, len, cap, at, small_len(n - at), NULL, 0);
        }
        break;
    case 6: { /* insert random bytes, or one byte repeated */
        size_t k = small_len(sizeof tmp);
        int same = (int)(rnd() & 1);
        uint8_t b = (uint8_t)rnd();
        for (size_t i = 0; i < k; i++) tmp[i] = same ? b : (uint8_t)rnd();
        splice_in(p, len, cap, below(n + 1), 0, tmp, k);
        break;
    }
    case 7: /* copy a range of the input elsewhere, inserted or over */
    case 8:
        if (n) {
            size_t from = below(n), k = small_len(n - from);
            if (k > sizeof tmp) k = sizeof tmp;
            memcpy(tmp, p + from, k);
            size_t at = below(n + 1);
            splice_in(p, len, cap, at, (rnd() & 1) ? k : 0, tmp, k);
        }
        break;
    case 9: { /* a range of another seed */
        const blob *s = &seeds[below(n_seeds)];
        if (!s->n) break;
        size_t from = below(s->n), k = 1 + below(rnd() & 1 ? 64 : s->n - from);
        if (k > s->n - from) k = s->n - from;
        size_t at = below(n + 1);
        splice_in(p, len, cap, at, (rnd() & 1) ? k : 0, s->p + from, k);
        break;
    }
    case 10: /* a dictionary token */
    case 11:
        if (n_tokens) {
            const blob *t = &tokens[below(n_tokens)];
            size_t at = below(n + 1);
            splice_in(p, len, cap, at, (rnd() & 3) ? 0 : t->n, t->p, t->n);
        }
        break;
    case 12: { /* the decimal number nearest a place becomes an interesting one */
        if (!n) break;
        size_t at = below(n);
        while (at < n && !(p[at] >= '0' && p[at] <= '9')) at++;
        if (at == n) break;
        size_t end = at;
        while (at > 0 && ((p[at - 1] >= '0' && p[at - 1] <= '9') || p[at - 1] == '-')) at--;
        while (end < n && ((p[end] >= '0' && p[end] <= '9') || p[end] == '.' || p[end] == 'e')) end++;
        const char *num = numbers[below(sizeof numbers / sizeof *numbers)];
        splice_in(p, len, cap, at, end - at, (const uint8_t *)num, strlen(num));
        break;
    }
    default: /* cut short */
        if (n) *len = below(n);
        break;
    }
}

/* A new input in out (cap bytes): a seed, or now and then the last input,
 * under 1 to 8 mutations (mostly few). */
static size_t next_input(uint8_t *out, size_t cap, size_t last_len) {
    size_t len;
    if (last_len && below(4) == 0) {
        len = last_len; /* out still holds it */
    } else {
        const blob *s = &seeds[below(n_seeds)];
        len = s->n < cap ? s->n : cap;
        memcpy(out, s->p, len);
    }
    int k = 1 + (int)below(rnd() & 1 ? 2 : 8);
    for (int i = 0; i < k; i++) mutate_once(out, &len, cap);
    return len;
}

/* ------------------------------------------------------------ running */

static atomic_long live_allocs;
static void on_malloc(const volatile void *p, size_t n) {
    (void)p, (void)n;
    atomic_fetch_add_explicit(&live_allocs, 1, memory_order_relaxed);
}
static void on_free(const volatile void *p) {
    if (p) atomic_fetch_sub_explicit(&live_allocs, 1, memory_order_relaxed);
}

enum { EXIT_LEAK = 86 };

/* Zero the stack below this frame: pointers the input's calls left there
 * would otherwise look like references to LeakSanitizer, which scans the
 * stack the check itself then runs on. */
__attribute__((noinline)) static void clear_stack(void) {
    volatile char pad[1 << 16];
    memset((char *)pad, 0, sizeof pad);
}

static void run_one(const uint8_t *data, size_t n) {
    memcpy(sh->data, data, n);
    sh->len = n;
    atomic_store(&sh->running, 1);
    long before = atomic_load(&live_allocs);
    uint8_t *copy = xmalloc(n); /* exactly n bytes: a read past the end is caught */
    memcpy(copy, data, n);
    LLVMFuzzerTestOneInput(copy, n);
    free(copy);
    if (__lsan_do_recoverable_leak_check && atomic_load(&live_allocs) > before &&
        (clear_stack(), __lsan_do_recoverable_leak_check())) {
        fprintf(stderr, "fuzz: the input above leaked memory\n");
        _exit(EXIT_LEAK);
    }
    atomic_store(&sh->running, 0);
    atomic_fetch_add(&sh->done, 1);
}

static int child(int argc, char **argv, int reproduce) {
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    if (__sanitizer_install_malloc_and_free_hooks) __sanitizer_install_malloc_and_free_hooks(on_malloc, on_free);
    double t0 = now();
    for (size_t i = 0; i < n_seeds; i++) run_one(seeds[i].p, seeds[i].n);
    double t_seeds = now() - t0;
    if (reproduce) {
        printf("fuzz: %zu input(s) ran without a finding\n", n_seeds);
        return 0;
    }
    uint8_t *buf = xmalloc(opt.max_len);
    long long runs = 0;
    size_t len = 0;
    double end = now() + opt.seconds;
    while ((opt.runs < 0 || runs < opt.runs) && now() < end) {
        len = next_input(buf, opt.max_len, len);
        run_one(buf, len);
        runs++;
    }
    free(buf);
    double t = now() - t0 - t_seeds;
    printf("fuzz: %zu seeds in %.1f s, then %lld mutated inputs in %.1f s (%.0f/s): no finding\n", n_seeds, t_seeds,
           runs, t, t > 0 ? (double)runs / t : 0.0);
    return 0;
}

static long rss_mb(pid_t pid) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/statm", (int)pid);
    FILE *f = fopen(path, "r");
    long pages = 0, rss = 0;
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &rss) != 2) rss = 0;
        fclose(f);
    }
    return rss * (sysconf(_SC_PAGESIZE) / 1024) / 1024;
}

/* Write the input the child was running to the artifact file; print its path. */
static void save_artifact(const char *kind) {
    uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a: the same input, the same name */
    for (size_t i = 0; i < sh->len; i++) h = (h ^ sh->data[i]) * 0x100000001b3ULL;
    char path[4096];
    snprintf(path, sizeof path, "%s%s-%016llx", opt.artifact_prefix, kind, (unsigned long long)h);
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) { /* make the prefix's directory */
        *slash = 0;
        for (char *q = dir + 1; *q; q++)
            if (*q == '/') *q = 0, mkdir(dir, 0755), *q = '/';
        mkdir(dir, 0755);
    }
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(sh->data, 1, sh->len, f) != sh->len || fclose(f)) {
        fprintf(stderr, "fuzz: could not write %s: %s\n", path, strerror(errno));
        return;
    }
    fprintf(stderr, "fuzz: %s: the input (%zu bytes) is in %s\n", kind, sh->len, path);
}

static int parent(pid_t pid) {
    unsigned long long seen = 0;
    double since = now();
    for (;;) {
        int status;
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) {
            if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
            if (WIFSIGNALED(status)) fprintf(stderr, "fuzz: killed by signal %d\n", WTERMSIG(status));
            if (!atomic_load(&sh->running)) {
                fprintf(stderr, "fuzz: the process failed outside any input (status %d)\n", status);
                return 1;
            }
            save_artifact(WIFEXITED(status) && WEXITSTATUS(status) == EXIT_LEAK ? "leak" : "crash");
            return 1;
        }
        if (r < 0 && errno != EINTR) {
            perror("fuzz: waitpid");
            return 1;
        }
        unsigned long long done = atomic_load(&sh->done);
        if (done != seen) seen = done, since = now();
        const char *kill_as = NULL;
        if (atomic_load(&sh->running) && now() - since > opt.timeout) {
            fprintf(stderr, "fuzz: an input ran longer than %.0f s\n", opt.timeout);
            kill_as = "timeout";
        } else if (rss_mb(pid) > opt.rss_limit_mb) {
            fprintf(stderr, "fuzz: the process grew past %ld MiB\n", opt.rss_limit_mb);
            kill_as = "oom";
        }
        if (kill_as) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            save_artifact(kill_as);
            return 1;
        }
        usleep(20000);
    }
}

static int flag(const char *a, const char *name, const char **value) {
    size_t n = strlen(name);
    if (strncmp(a, name, n) || a[n] != '=') return 0;
    *value = a + n + 1;
    return 1;
}

int main(int argc, char **argv) {
    int n_dirs = 0, n_files = 0;
    opt.seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (a[0] == '-') {
            if (flag(a, "-max_total_time", &v)) opt.seconds = atof(v);
            else if (flag(a, "-runs", &v)) opt.runs = atoll(v);
            else if (flag(a, "-seed", &v)) opt.seed = strtoull(v, NULL, 10);
            else if (flag(a, "-max_len", &v)) opt.max_len = (size_t)atoll(v);
            else if (flag(a, "-timeout", &v)) opt.timeout = atof(v);
            else if (flag(a, "-rss_limit_mb", &v)) opt.rss_limit_mb = atol(v);
            else if (flag(a, "-artifact_prefix", &v)) opt.artifact_prefix = v;
            else if (flag(a, "-dict", &v)) opt.dict = v;
            continue;
        }
        struct stat st;
        if (stat(a, &st) != 0) {
            fprintf(stderr, "fuzz: %s: %s\n", a, strerror(errno));
            return 1;
        }
        if (S_ISDIR(st.st_mode)) add_dir(a), n_dirs++;
        else add_seed(a), n_files++;
    }
    if (n_dirs && n_files) {
        fprintf(stderr, "fuzz: give seed directories (fuzz) or input files (reproduce), not both\n");
        return 1;
    }
    if (!n_seeds) { /* nothing to start from: one empty input */
        seeds = xmalloc(sizeof *seeds);
        seeds[0] = (blob){xmalloc(1), 0, strdup("(empty)")};
        n_seeds = 1;
    }
    if (opt.dict) read_dict(opt.dict);
    size_t longest = 0;
    for (size_t i = 0; i < n_seeds; i++) longest = seeds[i].n > longest ? seeds[i].n : longest;
    if (!opt.max_len) opt.max_len = longest + 1024 > 4096 ? longest + 1024 : 4096;
    if (opt.max_len < longest) opt.max_len = longest;
    rng_state = opt.seed ? opt.seed : 1;
    if (!n_files) printf("fuzz: seed %llu (rerun the same inputs with -seed=%llu)\n", (unsigned long long)opt.seed,
                         (unsigned long long)opt.seed);
    fflush(stdout);

    sh = mmap(NULL, sizeof *sh + opt.max_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) {
        perror("fuzz: mmap");
        return 1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        perror("fuzz: fork");
        return 1;
    }
    if (pid == 0) {
        int rc = child(argc, argv, n_files > 0);
        fflush(stdout);
        exit(rc);
    }
    return parent(pid);
}
