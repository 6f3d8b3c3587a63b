/* The scratch files of the fuzz targets (fuzz.h). One directory per process,
 * so targets run side by side (meson runs tests in parallel) never share a
 * file. */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "fuzz.h"

static char dir[256];

static void remove_dir(void) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char path[512];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

const char *fuzz_dir(void) {
    if (!dir[0]) {
        const char *tmp = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/moonrl-fuzz-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(dir)) {
            perror("fuzz: mkdtemp");
            exit(1);
        }
        atexit(remove_dir);
    }
    return dir;
}

const char *fuzz_file(const char *name, const uint8_t *data, size_t size) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", fuzz_dir(), name);
    /* a new file each time (not rewritten in place): a parser that maps the
     * file would otherwise see the next input's bytes under its old size */
    unlink(path);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) {
        perror(path);
        exit(1);
    }
    for (size_t at = 0; at < size;) {
        ssize_t w = write(fd, data + at, size - at);
        if (w <= 0) {
            perror(path);
            exit(1);
        }
        at += (size_t)w;
    }
    close(fd);
    return path;
}
