/* The one write loop of the core (internal): every file moonrl writes
 * (safetensors, checkpoints, atomic files) goes through it, so that the
 * fault injection of moonrl/fault.h can stop the process after an exact
 * number of bytes. And the opening and read loop of every reader. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "moonrl/status.h"

/* Read n bytes of fd from offset with pread (retrying short reads and
 * EINTR). Returns the bytes read: fewer than n when the file ends first or
 * a read fails, with *err the errno of the failure (0 at the end of the file). */
int64_t mrl_io_pread_all(int fd, void *buf, int64_t n, int64_t offset, int *err);

/* Write all n bytes to fd (retrying short writes and EINTR); errors name path. */
mrl_status mrl_io_write_all(int fd, const void *data, size_t n, const char *path);
/* fsync the directory holding path (its parent). */
mrl_status mrl_io_sync_parent(const char *path);

/* Open path for reading, refusing anything but a regular file before it can
 * block: the open itself does not wait (a FIFO's open waits for a writer, a
 * device's may never return), and a FIFO, directory, device or socket is an
 * error naming path and what it is. The descriptor is blocking; *size (may
 * be NULL) is the file's length. Every file the core reads opens here. */
mrl_status mrl_io_open_read(const char *path, int *fd, int64_t *size);
/* The same as a stdio stream ("rb"). */
mrl_status mrl_io_fopen_read(const char *path, FILE **out);
