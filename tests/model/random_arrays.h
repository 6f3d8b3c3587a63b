/* Moved to tests/lib/random.h; this forward stays while bench/ (cuda_ops.c, built with
 * include_directories('../tests')) includes it by its old name. */
#include "../lib/random.h"
