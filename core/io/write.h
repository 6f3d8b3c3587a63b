/* File helpers shared by the core (internal). */
#pragma once
#include <stddef.h>
#include "moonrl/status.h"

/* Write data to path atomically: a temporary file beside it, fsync, rename. */
mrl_status mrl_file_write_atomic(const char *path, const void *data, size_t bytes);
/* Create a directory and its parents (like mkdir -p). */
mrl_status mrl_file_mkdirs(const char *path);
