/* Logging from C (core internal; moonrl/log.h has the levels and what Lua
 * calls). */
#pragma once
#include "moonrl/log.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Log one printf-style message at `level`. */
void mrl_logf(mrl_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Parse "error" .. "trace" (MOONRL_LOG); returns -1 for an unknown name. */
int mrl_log_level_parse(const char *name);

#ifdef __cplusplus
}
#endif
