/* The one write loop of the core (internal): every file moonrl writes
 * (safetensors, checkpoints, atomic files) goes through it, so that the
 * fault injection of moonrl/fault.h can stop the process after an exact
 * number of bytes. */
#pragma once
#include <stddef.h>
#include "moonrl/status.h"

/* Write all n bytes to fd (retrying short writes and EINTR); errors name path. */
mrl_status mrl_io_write_all(int fd, const void *data, size_t n, const char *path);
/* fsync the directory holding path (its parent). */
mrl_status mrl_io_sync_parent(const char *path);
