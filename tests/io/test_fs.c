/* The file system layer (moonrl/fs.h) and the write-budget fault (moonrl/fault.h). */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "moonrl/fault.h"
#include "moonrl/fs.h"
#include "moonrl/runtime.h"
#include "check.h"

static char root[256];

static void path_of(char *out, size_t n, const char *rel) { snprintf(out, n, "%s/%s", root, rel); }

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = malloc(1 << 20);
    *len = fread(buf, 1, 1 << 20, f);
    fclose(f);
    return buf;
}

static void test_dirs_and_files(void) {
    char a[512], b[512];
    int created = -1;
    path_of(a, sizeof a, "x/y/z");
    CHECK_OK(mrl_fs_mkdir(a, &created));
    CHECK(created == 1);
    CHECK_OK(mrl_fs_mkdir(a, &created));
    CHECK(created == 0); /* only one caller ever sees 1 */
    path_of(b, sizeof b, "x/y/z/f.txt");
    CHECK_OK(mrl_fs_write_file(b, "hello", 5));
    mrl_fs_info info;
    CHECK_OK(mrl_fs_stat(b, &info));
    CHECK(info.exists && info.is_file && !info.is_dir && info.size == 5);
    CHECK_OK(mrl_fs_write_file(b, "hi", 2)); /* replaced atomically, no temporary left */
    mrl_fs_list *l;
    CHECK_OK(mrl_fs_list_open(a, &l));
    CHECK(mrl_fs_list_count(l) == 1 && strcmp(mrl_fs_list_name(l, 0), "f.txt") == 0);
    mrl_fs_list_free(l);
    CHECK(mrl_fs_mkdir(b, &created) != MRL_OK); /* a file is in the way */
    CHECK_STR_CONTAINS(mrl_last_error(), "not a directory");

    /* listing is sorted; copy; truncate; rename */
    char c[512], d[512];
    path_of(c, sizeof c, "x/y/z/a.txt");
    CHECK_OK(mrl_fs_copy_file(b, c));
    CHECK_OK(mrl_fs_list_open(a, &l));
    CHECK(mrl_fs_list_count(l) == 2 && strcmp(mrl_fs_list_name(l, 0), "a.txt") == 0);
    mrl_fs_list_free(l);
    CHECK_OK(mrl_fs_truncate(c, 1));
    CHECK_OK(mrl_fs_stat(c, &info));
    CHECK(info.size == 1);
    path_of(d, sizeof d, "x/moved");
    CHECK_OK(mrl_fs_rename(a, d));
    CHECK_OK(mrl_fs_stat(a, &info));
    CHECK(!info.exists);

    /* remove a tree; a symlink inside is removed, never followed */
    char outside[512], link[512];
    path_of(outside, sizeof outside, "keep.txt");
    CHECK_OK(mrl_fs_write_file(outside, "keep", 4));
    path_of(link, sizeof link, "x/moved/link");
    CHECK(symlink(outside, link) == 0);
    path_of(a, sizeof a, "x");
    CHECK_OK(mrl_fs_remove(a));
    CHECK_OK(mrl_fs_stat(a, &info));
    CHECK(!info.exists);
    CHECK_OK(mrl_fs_stat(outside, &info));
    CHECK(info.exists && info.size == 4);
    CHECK_OK(mrl_fs_remove(a)); /* nothing there: fine */
    int64_t free_bytes = 0;
    CHECK_OK(mrl_fs_free_bytes(root, &free_bytes));
    CHECK(free_bytes > 0);
    /* errors name the path */
    CHECK(mrl_fs_list_open("/nonexistent/moonrl", &l) != MRL_OK);
    CHECK_STR_CONTAINS(mrl_last_error(), "/nonexistent/moonrl");
}

static void test_lock(void) {
    char p[512];
    path_of(p, sizeof p, ".lock");
    int fd1 = -1, fd2 = -1;
    CHECK_OK(mrl_fs_lock(p, &fd1));
    CHECK(mrl_fs_lock(p, &fd2) != MRL_OK); /* a second holder, even in this process */
    CHECK_STR_CONTAINS(mrl_last_error(), "in use");
    mrl_fs_unlock(fd1);
    CHECK_OK(mrl_fs_lock(p, &fd2));
    mrl_fs_unlock(fd2);
    /* a killed holder releases it */
    pid_t pid = fork();
    if (pid == 0) {
        int fd;
        if (mrl_fs_lock(p, &fd) != MRL_OK) _exit(1);
        raise(SIGKILL);
    }
    int st;
    waitpid(pid, &st, 0);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    CHECK_OK(mrl_fs_lock(p, &fd1));
    mrl_fs_unlock(fd1);
}

static void test_crc(void) {
    CHECK(mrl_crc32c(0, "123456789", 9) == 0xE3069283u); /* the standard check value */
    CHECK(mrl_crc32c(0, "", 0) == 0);
    /* in pieces = at once, any split */
    char buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = (char)(i * 7 + 3);
    uint32_t whole = mrl_crc32c(0, buf, 1000);
    for (int cut = 0; cut <= 1000; cut += 37) CHECK(mrl_crc32c(mrl_crc32c(0, buf, (size_t)cut), buf + cut, 1000 - (size_t)cut) == whole);
    char p[512];
    path_of(p, sizeof p, "crc.bin");
    CHECK_OK(mrl_fs_write_file(p, buf, 1000));
    uint32_t crc = 0;
    int64_t size = 0;
    CHECK_OK(mrl_fs_crc32c_file(p, &crc, &size));
    CHECK(crc == whole && size == 1000);
}

static void hex(const uint8_t d[32], char out[65]) {
    for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
}

/* SHA-256: FIPS 180-4's examples, every split of the input into two pieces around the 64-byte
 * blocks, a file; the identity of a file changes with an edit whose mtime is set back. */
static void test_sha256(void) {
    uint8_t d[32];
    char h[65];
    mrl_sha256("", 0, d);
    hex(d, h);
    CHECK(!strcmp(h, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"));
    mrl_sha256("abc", 3, d);
    hex(d, h);
    CHECK(!strcmp(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
    const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"; /* 56 bytes: two blocks of padding */
    mrl_sha256(two, strlen(two), d);
    hex(d, h);
    CHECK(!strcmp(h, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
    char *million = malloc(1000000);
    memset(million, 'a', 1000000);
    char p[512];
    path_of(p, sizeof p, "sha.bin");
    CHECK_OK(mrl_fs_write_file(p, million, 1000000));
    int64_t size = 0;
    CHECK_OK(mrl_fs_sha256_file(p, d, &size));
    hex(d, h);
    CHECK(size == 1000000 && !strcmp(h, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"));
    uint8_t whole[32], part[32];
    mrl_sha256(million, 200, whole);
    for (int cut = 0; cut <= 200; cut++) { /* the file's pieces go through the same update */
        path_of(p, sizeof p, "sha-cut.bin");
        CHECK_OK(mrl_fs_write_file(p, million, (size_t)cut));
        CHECK_OK(mrl_fs_sha256_file(p, part, &size));
        mrl_sha256(million, (size_t)cut, d);
        CHECK(!memcmp(part, d, 32) && size == cut);
    }
    CHECK(memcmp(whole, d, 32) == 0);
    free(million);
    /* identity: follows links; an edit with the mtime put back still changes it (ctime) */
    mrl_fs_file_id a, b, l;
    char link[512];
    path_of(link, sizeof link, "sha-link.bin");
    CHECK(symlink(p, link) == 0);
    CHECK_OK(mrl_fs_identify(p, &a));
    CHECK_OK(mrl_fs_identify(link, &l));
    CHECK(a.exists && a.is_file && a.size == 200 && l.ino == a.ino && l.dev == a.dev && l.ctime_ns == a.ctime_ns);
    struct timespec pause = {0, 20 * 1000 * 1000}; /* past a coarse clock tick */
    nanosleep(&pause, NULL);
    int fd = open(p, O_WRONLY);
    CHECK(fd >= 0 && pwrite(fd, "b", 1, 0) == 1);
    struct timespec times[2] = {{a.mtime_s, a.mtime_ns}, {a.mtime_s, a.mtime_ns}};
    CHECK(futimens(fd, times) == 0); /* touch -r */
    close(fd);
    CHECK_OK(mrl_fs_identify(p, &b));
    CHECK(b.size == a.size && b.ino == a.ino && b.mtime_s == a.mtime_s && b.mtime_ns == a.mtime_ns);
    CHECK(b.ctime_s != a.ctime_s || b.ctime_ns != a.ctime_ns);
    path_of(p, sizeof p, "nothing-here");
    CHECK_OK(mrl_fs_identify(p, &b));
    CHECK(!b.exists);
}

/* The write budget kills at the exact byte: the temporary file holds that many bytes, the
 * destination keeps what it had. */
static void test_write_budget(void) {
    char p[512], tmp[600];
    path_of(p, sizeof p, "budget.bin");
    CHECK_OK(mrl_fs_write_file(p, "old", 3));
    pid_t pid = fork();
    if (pid == 0) {
        char data[10000];
        memset(data, 'x', sizeof data);
        mrl_fault_kill_after_bytes(1234);
        mrl_fs_write_file(p, data, sizeof data);
        _exit(0); /* not reached */
    }
    int st;
    waitpid(pid, &st, 0);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    size_t len = 0;
    char *got = read_all(p, &len);
    CHECK(got && len == 3 && memcmp(got, "old", 3) == 0);
    free(got);
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", p, (int)pid);
    mrl_fs_info info;
    CHECK_OK(mrl_fs_stat(tmp, &info));
    CHECK(info.exists && info.size == 1234);
    CHECK(mrl_fault_bytes_left() == -1); /* off in this process */
}

/* A FIFO, a directory and a device are refused by every reader, naming the path, without
 * blocking (the open of a FIFO with no writer waits for ever: alarm bounds the test). */
static void test_not_regular(void) {
    char fifo[512], dir[512], file[512], copy[512];
    path_of(fifo, sizeof fifo, "fifo.json");
    path_of(dir, sizeof dir, "adir");
    path_of(file, sizeof file, "plain.json");
    path_of(copy, sizeof copy, "copy.json");
    CHECK(mkfifo(fifo, 0644) == 0);
    CHECK_OK(mrl_fs_mkdirs(dir));
    CHECK_OK(mrl_fs_write_file(file, "{}", 2));
    alarm(20);
    CHECK(mrl_fs_check_readable(fifo) == MRL_ERR_IO);
    CHECK_STR_CONTAINS(mrl_last_error(), fifo);
    CHECK_STR_CONTAINS(mrl_last_error(), "not a regular file (a FIFO)");
    uint32_t crc;
    int64_t size;
    CHECK(mrl_fs_crc32c_file(fifo, &crc, &size) == MRL_ERR_IO);
    CHECK_STR_CONTAINS(mrl_last_error(), "a FIFO");
    CHECK(mrl_fs_copy_file(fifo, copy) == MRL_ERR_IO);
    CHECK_STR_CONTAINS(mrl_last_error(), fifo);
    CHECK(mrl_fs_check_readable(dir) == MRL_ERR_IO);
    CHECK_STR_CONTAINS(mrl_last_error(), "a directory");
    CHECK(mrl_fs_check_readable("/dev/null") == MRL_ERR_IO);
    CHECK_STR_CONTAINS(mrl_last_error(), "a character device");
    alarm(0);
    CHECK_OK(mrl_fs_check_readable(file));
    CHECK(mrl_fs_check_readable(copy) == MRL_ERR_IO); /* missing */
    CHECK_STR_CONTAINS(mrl_last_error(), "No such file");
}

int main(void) {
    CHECK_OK(mrl_init());
    snprintf(root, sizeof root, "/tmp/moonrl-test-fs-%d", (int)getpid());
    CHECK_OK(mrl_fs_mkdirs(root));
    test_dirs_and_files();
    test_lock();
    test_crc();
    test_sha256();
    test_write_budget();
    test_not_regular();
    CHECK_OK(mrl_fs_remove(root));
    mrl_shutdown();
    CHECK_DONE();
}
