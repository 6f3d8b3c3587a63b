/* The file system, through system calls only: no path ever reaches a shell.
 *
 * What run directories and checkpoints need: directories created exactly
 * once, whole files written atomically (temporary file, fsync, rename, fsync
 * of the directory), directory listings, trees removed, files checksummed
 * (CRC-32C) and hashed (SHA-256), and a lock that says a run directory is in use. Every error
 * names the path and the reason (strerror). */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_fs_info {
    int exists;     /* 0 when nothing is at the path */
    int is_dir;
    int is_file;    /* a regular file */
    int64_t size;   /* bytes of a regular file */
    double mtime;   /* seconds since the epoch */
} mrl_fs_info;

/* What is at path (does not follow a final symlink: a link is neither). */
mrl_status mrl_fs_stat(const char *path, mrl_fs_info *out);
/* Create a directory and its parents (mkdir -p); fine if it exists. */
mrl_status mrl_fs_mkdirs(const char *path);
/* Create the directory path (its parents as needed). *created is 1 when this
 * call created it, 0 when a directory was already there (another process
 * may have made it a moment ago: only one caller ever sees 1). */
mrl_status mrl_fs_mkdir(const char *path, int *created);
/* Remove a file, or a directory and everything under it (symlinks are
 * removed, never followed). Nothing there is not an error. */
mrl_status mrl_fs_remove(const char *path);
/* rename(2), then fsync the directory that now holds `to`. */
mrl_status mrl_fs_rename(const char *from, const char *to);
/* fsync a directory (so that the names created in it survive a crash). */
mrl_status mrl_fs_sync_dir(const char *path);
/* Write bytes to path atomically: a temporary file beside it, fsync, rename,
 * fsync of the directory. A failure leaves what was at path untouched. */
mrl_status mrl_fs_write_file(const char *path, const void *data, size_t bytes);
/* Copy a regular file (atomically, as mrl_fs_write_file). */
mrl_status mrl_fs_copy_file(const char *from, const char *to);
/* Cut a file to `size` bytes and fsync it. */
mrl_status mrl_fs_truncate(const char *path, int64_t size);
/* Bytes free for an unprivileged writer on the file system holding path. */
mrl_status mrl_fs_free_bytes(const char *path, int64_t *out);

/* MRL_OK when path is a regular file that opens for reading, else an error
 * naming it and why: missing, unreadable, or not a regular file (a FIFO,
 * whose open would wait for a writer, a directory, a device, a socket).
 * Checked without blocking; what Lua checks before it opens a file. */
mrl_status mrl_fs_check_readable(const char *path);

/* Directory listing: names in strcmp order, without "." and "..". */
typedef struct mrl_fs_list mrl_fs_list;
mrl_status mrl_fs_list_open(const char *path, mrl_fs_list **out);
int64_t mrl_fs_list_count(const mrl_fs_list *list);
const char *mrl_fs_list_name(const mrl_fs_list *list, int64_t index);
void mrl_fs_list_free(mrl_fs_list *list);

/* An exclusive advisory lock (flock) on the file path, created if missing.
 * MRL_ERR_IO naming the holder's pid (written into the file) when another
 * process holds it. The lock lasts until mrl_fs_unlock or the process ends
 * (a killed process releases it). */
mrl_status mrl_fs_lock(const char *path, int *fd_out);
void mrl_fs_unlock(int fd);

/* CRC-32C (Castagnoli, the checksum of iSCSI and ext4): start with crc = 0
 * and feed the pieces in order. SSE4.2's crc32 instruction where the CPU has
 * it; the same values from a table elsewhere. */
uint32_t mrl_crc32c(uint32_t crc, const void *data, size_t bytes);
/* CRC-32C and size of a whole file, read in pieces. */
mrl_status mrl_fs_crc32c_file(const char *path, uint32_t *crc, int64_t *size);

/* SHA-256 (the value sha256sum prints) of bytes, and of a whole file with its
 * size: a key for content where a checksum could be forged (a crafted file can
 * match any CRC-32C). */
void mrl_sha256(const void *data, size_t bytes, uint8_t out[32]);
mrl_status mrl_fs_sha256_file(const char *path, uint8_t out[32], int64_t *size);

/* What tells a file's versions apart without reading it: stat(2) of path,
 * following links. Writing to a file changes its ctime even when its mtime
 * is set back afterwards (touch -r, cp -p, tar), and nothing sets ctime. */
typedef struct mrl_fs_file_id {
    int exists;        /* 0 when nothing is at the path (or a link leads nowhere) */
    int is_file;       /* a regular file */
    int64_t dev, ino, size;
    int64_t mtime_s, mtime_ns; /* seconds and nanoseconds */
    int64_t ctime_s, ctime_ns;
} mrl_fs_file_id;
mrl_status mrl_fs_identify(const char *path, mrl_fs_file_id *out);

#ifdef __cplusplus
}
#endif
