/* File helpers: atomic whole-file writes and mkdir -p. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "file.h"

mrl_status mrl_file_write_atomic(const char *path, const void *data, size_t bytes) {
    if (!path || !path[0]) return mrl_set_error(MRL_ERR_INVALID, "write: empty path");
    size_t n = strlen(path);
    char *tmp = malloc(n + 32);
    if (!tmp) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    snprintf(tmp, n + 32, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        mrl_status st = mrl_set_error(MRL_ERR_IO, "%s: cannot open for writing: %s", tmp, strerror(errno));
        free(tmp);
        return st;
    }
    int ok = fwrite(data, 1, bytes, f) == bytes;
    ok = fflush(f) == 0 && ok;
    ok = fsync(fileno(f)) == 0 && ok;
    int saved_errno = errno;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        if (ok) saved_errno = errno;
        remove(tmp);
        free(tmp);
        return mrl_set_error(MRL_ERR_IO, "%s: write failed: %s", path, strerror(saved_errno));
    }
    free(tmp);
    return MRL_OK;
}

mrl_status mrl_file_mkdirs(const char *path) {
    if (!path || !path[0]) return mrl_set_error(MRL_ERR_INVALID, "mkdir: empty path");
    char *copy = strdup(path);
    if (!copy) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    for (char *p = copy + 1;; p++) {
        if (*p == '/' || *p == 0) {
            char saved = *p;
            *p = 0;
            if (mkdir(copy, 0777) != 0 && errno != EEXIST) {
                mrl_status st = mrl_set_error(MRL_ERR_IO, "%s: cannot create directory: %s", copy, strerror(errno));
                free(copy);
                return st;
            }
            *p = saved;
            if (!saved) break;
        }
    }
    struct stat st;
    int is_dir = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
    free(copy);
    if (!is_dir) return mrl_set_error(MRL_ERR_IO, "%s: exists and is not a directory", path);
    return MRL_OK;
}
