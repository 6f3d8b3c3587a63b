/* The file system through system calls (moonrl/fs.h), the core's one write
 * loop (write.h) and the write-budget fault injection (moonrl/fault.h). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>
#include "moonrl/fault.h"
#include "moonrl/fs.h"
#include "sha256.h"
#include "write.h"
#include "base/error.h"
#include "base/cpu.h"

/* ------------------------------------------------------- writes + faults */

static _Atomic int64_t write_budget = -1; /* bytes before SIGKILL; -1 off */

void mrl_fault_kill_after_bytes(int64_t bytes) { atomic_store(&write_budget, bytes < 0 ? -1 : bytes); }
int64_t mrl_fault_bytes_left(void) { return atomic_load(&write_budget); }

void mrl_fault_kill(void) {
    raise(SIGKILL);
    _exit(137); /* not reached */
}

void mrl_fault_signal(int signum) { kill(getpid(), signum); }

void mrl_fault_busy(double seconds) {
    struct timespec left = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&left, &left) != 0 && errno == EINTR) {}
}

/* Read by the engine thread too: a plain double written once at start-up, before any engine runs. */
static double engine_delay = 0;
void mrl_fault_slow_engine(double seconds) { engine_delay = seconds > 0 ? seconds : 0; }
double mrl_fault_engine_delay(void) { return engine_delay; }

void mrl_fault_crash(void) {
    signal(SIGSEGV, SIG_DFL);
    raise(SIGSEGV);
    _exit(139); /* not reached */
}

void mrl_fault_hang(void) {
    for (;;) pause();
}

/* How much of an n-byte write may go out before the budget kills us. */
static size_t budget_take(size_t n) {
    int64_t left = atomic_load(&write_budget);
    if (left < 0) return n;
    if ((int64_t)n < left) {
        atomic_fetch_sub(&write_budget, (int64_t)n);
        return n;
    }
    return (size_t)left; /* write this much, then die */
}

int64_t mrl_io_pread_all(int fd, void *buf, int64_t n, int64_t offset, int *err) {
    int64_t done = 0;
    *err = 0;
    while (done < n) {
        ssize_t k = pread(fd, (char *)buf + done, (size_t)(n - done), (off_t)(offset + done));
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) *err = errno;
        if (k <= 0) break;
        done += k;
    }
    return done;
}

/* What a file that is not regular is, for messages. */
static const char *file_kind(mode_t mode) {
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "not a regular file";
}

mrl_status mrl_io_open_read(const char *path, int *fd_out, int64_t *size) {
    *fd_out = -1;
    if (!path || !path[0]) return mrl_set_error(MRL_ERR_INVALID, "open: empty path");
    /* O_NONBLOCK: the open of a FIFO waits for a writer, and a device's may never return; a
     * regular file ignores the flag */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return mrl_set_error(MRL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int err = errno;
        close(fd);
        return mrl_set_error(MRL_ERR_IO, "%s: cannot stat: %s", path, strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return mrl_set_error(MRL_ERR_IO, "%s: not a regular file (%s)", path, file_kind(st.st_mode));
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    if (size) *size = (int64_t)st.st_size;
    *fd_out = fd;
    return MRL_OK;
}

mrl_status mrl_io_fopen_read(const char *path, FILE **out) {
    *out = NULL;
    int fd;
    mrl_status s = mrl_io_open_read(path, &fd, NULL);
    if (s) return s;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return mrl_set_error(MRL_ERR_NOMEM, "%s: cannot open: %s", path, strerror(errno));
    }
    *out = f;
    return MRL_OK;
}

mrl_status mrl_fs_check_readable(const char *path) {
    int fd;
    mrl_status s = mrl_io_open_read(path, &fd, NULL);
    if (!s) close(fd);
    return s;
}

mrl_status mrl_io_write_all(int fd, const void *data, size_t n, const char *path) {
    const char *p = data;
    size_t allowed = budget_take(n);
    size_t todo = allowed;
    while (todo > 0) {
        ssize_t k = write(fd, p, todo > (1u << 30) ? (1u << 30) : todo);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return mrl_set_error(MRL_ERR_IO, "%s: write failed: %s", path, strerror(errno));
        if (k == 0) return mrl_set_error(MRL_ERR_IO, "%s: write failed: no progress", path);
        p += k;
        todo -= (size_t)k;
    }
    if (allowed < n) {
        /* the fault: the bytes so far reached the kernel, the rest never will */
        fprintf(stderr, "moonrl: fault injection: killed after the write budget, in %s\n", path);
        fflush(stderr);
        raise(SIGKILL);
    }
    return MRL_OK;
}

static char *parent_of(const char *path) {
    const char *slash = strrchr(path, '/');
    if (!slash) return strdup(".");
    if (slash == path) return strdup("/");
    return strndup(path, (size_t)(slash - path));
}

mrl_status mrl_fs_sync_dir(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return mrl_set_error(MRL_ERR_IO, "%s: cannot open directory: %s", path, strerror(errno));
    int rc = fsync(fd);
    int err = errno;
    close(fd);
    /* some file systems cannot fsync a directory; they order metadata themselves */
    if (rc != 0 && err != EINVAL && err != ENOTSUP)
        return mrl_set_error(MRL_ERR_IO, "%s: fsync failed: %s", path, strerror(err));
    return MRL_OK;
}

mrl_status mrl_io_sync_parent(const char *path) {
    char *dir = parent_of(path);
    if (!dir) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    mrl_status s = mrl_fs_sync_dir(dir);
    free(dir);
    return s;
}

/* ---------------------------------------------------------------- files */

mrl_status mrl_fs_write_file(const char *path, const void *data, size_t bytes) {
    if (!path || !path[0]) return mrl_set_error(MRL_ERR_INVALID, "write: empty path");
    size_t n = strlen(path);
    char *tmp = malloc(n + 32);
    if (!tmp) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    snprintf(tmp, n + 32, "%s.tmp.%d", path, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        mrl_status st = mrl_set_error(MRL_ERR_IO, "%s: cannot create %s: %s", path, tmp, strerror(errno));
        free(tmp);
        return st;
    }
    mrl_status st = mrl_io_write_all(fd, data, bytes, path);
    if (!st && fsync(fd) != 0) st = mrl_set_error(MRL_ERR_IO, "%s: fsync failed: %s", path, strerror(errno));
    if (close(fd) != 0 && !st) st = mrl_set_error(MRL_ERR_IO, "%s: close failed: %s", path, strerror(errno));
    if (!st && rename(tmp, path) != 0)
        st = mrl_set_error(MRL_ERR_IO, "%s: rename from %s failed: %s", path, tmp, strerror(errno));
    if (st) unlink(tmp);
    free(tmp);
    if (!st) st = mrl_io_sync_parent(path);
    return st;
}

mrl_status mrl_fs_copy_file(const char *from, const char *to) {
    int fd;
    int64_t file_size;
    mrl_status opened = mrl_io_open_read(from, &fd, &file_size);
    if (opened) return opened;
    size_t size = (size_t)file_size;
    char *buf = malloc(size ? size : 1);
    if (!buf) {
        close(fd);
        return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory reading %zu bytes", from, size);
    }
    size_t got = 0;
    while (got < size) {
        ssize_t k = read(fd, buf + got, size - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        got += (size_t)k;
    }
    close(fd);
    mrl_status s = got == size ? mrl_fs_write_file(to, buf, size)
                               : mrl_set_error(MRL_ERR_IO, "%s: short read (%zu of %zu bytes)", from, got, size);
    free(buf);
    return s;
}

mrl_status mrl_fs_truncate(const char *path, int64_t size) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return mrl_set_error(MRL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    mrl_status s = MRL_OK;
    if (ftruncate(fd, (off_t)size) != 0 || fsync(fd) != 0)
        s = mrl_set_error(MRL_ERR_IO, "%s: cannot truncate to %lld bytes: %s", path, (long long)size, strerror(errno));
    close(fd);
    return s;
}

mrl_status mrl_fs_free_bytes(const char *path, int64_t *out) {
    struct statvfs vfs;
    if (statvfs(path, &vfs) != 0) return mrl_set_error(MRL_ERR_IO, "%s: statvfs failed: %s", path, strerror(errno));
    *out = (int64_t)vfs.f_bavail * (int64_t)vfs.f_frsize;
    return MRL_OK;
}

/* lstat (or stat, following links) of path; *found 0 when nothing is there, which is no error. */
static mrl_status stat_of(const char *path, int follow, struct stat *st, int *found) {
    *found = 0;
    if (!path || !path[0]) return mrl_set_error(MRL_ERR_INVALID, "stat: empty path");
    if ((follow ? stat(path, st) : lstat(path, st)) != 0) {
        if (errno == ENOENT || errno == ENOTDIR) return MRL_OK;
        return mrl_set_error(MRL_ERR_IO, "%s: %s", path, strerror(errno));
    }
    *found = 1;
    return MRL_OK;
}

mrl_status mrl_fs_stat(const char *path, mrl_fs_info *out) {
    memset(out, 0, sizeof *out);
    struct stat st;
    mrl_status s = stat_of(path, 0, &st, &out->exists);
    if (s || !out->exists) return s;
    out->is_dir = S_ISDIR(st.st_mode);
    out->is_file = S_ISREG(st.st_mode);
    out->size = (int64_t)st.st_size;
    out->mtime = (double)st.st_mtim.tv_sec + 1e-9 * (double)st.st_mtim.tv_nsec;
    return MRL_OK;
}

/* ---------------------------------------------------------- directories */

static mrl_status make_dirs(const char *path, int *created) {
    if (!path || !path[0]) return mrl_set_error(MRL_ERR_INVALID, "mkdir: empty path");
    char *copy = strdup(path);
    if (!copy) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    int made_last = 0;
    for (char *p = copy + 1;; p++) {
        if (*p == '/' || *p == 0) {
            char saved = *p;
            *p = 0;
            made_last = 0;
            if (mkdir(copy, 0777) == 0) made_last = 1;
            else if (errno != EEXIST) {
                mrl_status st = mrl_set_error(MRL_ERR_IO, "%s: cannot create directory: %s", copy, strerror(errno));
                free(copy);
                return st;
            }
            *p = saved;
            if (!saved) break;
        }
    }
    free(copy);
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return mrl_set_error(MRL_ERR_IO, "%s: exists and is not a directory", path);
    if (created) *created = made_last;
    return MRL_OK;
}

mrl_status mrl_fs_mkdirs(const char *path) { return make_dirs(path, NULL); }

mrl_status mrl_fs_mkdir(const char *path, int *created) {
    *created = 0;
    return make_dirs(path, created);
}

static mrl_status remove_at(int parent, const char *name, const char *shown) {
    struct stat st;
    if (fstatat(parent, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) return MRL_OK;
        return mrl_set_error(MRL_ERR_IO, "%s: %s", shown, strerror(errno));
    }
    if (!S_ISDIR(st.st_mode)) {
        if (unlinkat(parent, name, 0) != 0 && errno != ENOENT)
            return mrl_set_error(MRL_ERR_IO, "%s: cannot remove: %s", shown, strerror(errno));
        return MRL_OK;
    }
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return mrl_set_error(MRL_ERR_IO, "%s: cannot open directory: %s", shown, strerror(errno));
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return mrl_set_error(MRL_ERR_IO, "%s: cannot list: %s", shown, strerror(errno));
    }
    mrl_status s = MRL_OK;
    struct dirent *e;
    while (!s && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        s = remove_at(dirfd(d), e->d_name, shown);
    }
    closedir(d);
    if (!s && unlinkat(parent, name, AT_REMOVEDIR) != 0 && errno != ENOENT)
        s = mrl_set_error(MRL_ERR_IO, "%s: cannot remove directory: %s", shown, strerror(errno));
    return s;
}

mrl_status mrl_fs_remove(const char *path) {
    if (!path || !path[0]) return mrl_set_error(MRL_ERR_INVALID, "remove: empty path");
    return remove_at(AT_FDCWD, path, path);
}

mrl_status mrl_fs_rename(const char *from, const char *to) {
    if (rename(from, to) != 0)
        return mrl_set_error(MRL_ERR_IO, "%s: cannot rename to %s: %s", from, to, strerror(errno));
    return mrl_io_sync_parent(to);
}

struct mrl_fs_list {
    char **names;
    int64_t count;
};

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

mrl_status mrl_fs_list_open(const char *path, mrl_fs_list **out) {
    *out = NULL;
    DIR *d = opendir(path);
    if (!d) return mrl_set_error(MRL_ERR_IO, "%s: cannot list: %s", path, strerror(errno));
    mrl_fs_list *l = calloc(1, sizeof *l);
    int64_t cap = 0;
    struct dirent *e;
    mrl_status s = l ? MRL_OK : mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    while (!s && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (l->count == cap) {
            cap = cap ? 2 * cap : 16;
            char **grown = realloc(l->names, (size_t)cap * sizeof *grown);
            if (!grown) {
                s = mrl_set_error(MRL_ERR_NOMEM, "out of memory");
                break;
            }
            l->names = grown;
        }
        if (!(l->names[l->count] = strdup(e->d_name))) s = mrl_set_error(MRL_ERR_NOMEM, "out of memory");
        else l->count++;
    }
    closedir(d);
    if (s) {
        mrl_fs_list_free(l);
        return s;
    }
    if (l->count) qsort(l->names, (size_t)l->count, sizeof *l->names, cmp_str);
    *out = l;
    return MRL_OK;
}

int64_t mrl_fs_list_count(const mrl_fs_list *l) { return l ? l->count : 0; }
const char *mrl_fs_list_name(const mrl_fs_list *l, int64_t i) {
    return l && i >= 0 && i < l->count ? l->names[i] : NULL;
}

void mrl_fs_list_free(mrl_fs_list *l) {
    if (!l) return;
    for (int64_t i = 0; i < l->count; i++) free(l->names[i]);
    free(l->names);
    free(l);
}

/* ----------------------------------------------------------------- locks */

mrl_status mrl_fs_lock(const char *path, int *fd_out) {
    *fd_out = -1;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return mrl_set_error(MRL_ERR_IO, "%s: cannot open lock file: %s", path, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int err = errno;
        char holder[32] = "";
        ssize_t k = pread(fd, holder, sizeof holder - 1, 0);
        holder[k > 0 ? k : 0] = 0;
        holder[strcspn(holder, "\n")] = 0;
        close(fd);
        if (err == EWOULDBLOCK)
            return mrl_set_error(MRL_ERR_IO, "%s: in use by another run (process %s)", path, holder[0] ? holder : "?");
        return mrl_set_error(MRL_ERR_IO, "%s: cannot lock: %s", path, strerror(err));
    }
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)n, 0) != n) {
        /* the lock holds without the pid; it is only shown in messages */
    }
    *fd_out = fd;
    return MRL_OK;
}

void mrl_fs_unlock(int fd) {
    if (fd >= 0) close(fd); /* closing the descriptor releases the flock */
}

/* -------------------------------------------------------------- CRC-32C */

static uint32_t crc_table[256];

static void crc_table_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc_soft(uint32_t crc, const unsigned char *p, size_t n) {
    if (!crc_table[1]) crc_table_init();
    while (n--) crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#endif

uint32_t mrl_crc32c(uint32_t crc, const void *data, size_t bytes) {
    crc = ~crc;
#if defined(__x86_64__)
    if (mrl_cpu()->sse4_2) return ~crc_hw(crc, data, bytes);
#endif
    return ~crc_soft(crc, data, bytes);
}

/* Read a whole file in pieces of 1 MiB, handing each to take(ctx, piece, bytes). */
static mrl_status read_pieces(const char *path, void (*take)(void *, const void *, size_t), void *ctx,
                              int64_t *size) {
    int fd;
    mrl_status opened = mrl_io_open_read(path, &fd, NULL);
    if (opened) return opened;
    enum { CHUNK = 1 << 20 };
    unsigned char *buf = malloc(CHUNK);
    if (!buf) {
        close(fd);
        return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    }
    int64_t total = 0;
    mrl_status s = MRL_OK;
    for (;;) {
        ssize_t k = read(fd, buf, CHUNK);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            s = mrl_set_error(MRL_ERR_IO, "%s: read failed: %s", path, strerror(errno));
            break;
        }
        if (k == 0) break;
        take(ctx, buf, (size_t)k);
        total += k;
    }
    free(buf);
    close(fd);
    if (!s && size) *size = total;
    return s;
}

static void take_crc(void *ctx, const void *p, size_t n) { *(uint32_t *)ctx = mrl_crc32c(*(uint32_t *)ctx, p, n); }

mrl_status mrl_fs_crc32c_file(const char *path, uint32_t *crc, int64_t *size) {
    uint32_t c = 0;
    mrl_status s = read_pieces(path, take_crc, &c, size);
    if (!s) *crc = c;
    return s;
}

static void take_sha(void *ctx, const void *p, size_t n) { mrl_sha256_update(ctx, p, n); }

mrl_status mrl_fs_sha256_file(const char *path, uint8_t out[32], int64_t *size) {
    mrl_sha256_ctx sha;
    mrl_sha256_init(&sha);
    mrl_status s = read_pieces(path, take_sha, &sha, size);
    if (!s) mrl_sha256_final(&sha, out);
    return s;
}

mrl_status mrl_fs_identify(const char *path, mrl_fs_file_id *out) {
    memset(out, 0, sizeof *out);
    struct stat st;
    mrl_status s = stat_of(path, 1, &st, &out->exists);
    if (s || !out->exists) return s;
    out->is_file = S_ISREG(st.st_mode);
    out->dev = (int64_t)st.st_dev;
    out->ino = (int64_t)st.st_ino;
    out->size = (int64_t)st.st_size;
    out->mtime_s = (int64_t)st.st_mtim.tv_sec;
    out->mtime_ns = (int64_t)st.st_mtim.tv_nsec;
    out->ctime_s = (int64_t)st.st_ctim.tv_sec;
    out->ctime_ns = (int64_t)st.st_ctim.tv_nsec;
    return MRL_OK;
}
