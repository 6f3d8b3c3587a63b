/* Setting the per-thread error (core internal; moonrl/status.h has the
 * codes and what callers read back). Every C file of the core and the
 * kernels reports failures through this one call. */
#pragma once
#include "moonrl/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Set the last error on this thread (printf-style) and return `status`. */
mrl_status mrl_set_error(mrl_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The same with the last error kept after it ("<context>: <last error>"):
 * for a failure whose cause a lower layer said already, as the memory
 * layer's refusal names the category, the sizes and run.memory_budget_mb. */
mrl_status mrl_wrap_error(mrl_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#ifdef __cplusplus
}
#endif
