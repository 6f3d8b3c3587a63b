/* Logging with levels. Messages go to stderr with a level tag; the level
 * comes from mrl_log_set_level() or the MOONRL_LOG environment variable
 * (error, warn, info, debug, trace). */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mrl_log_level {
    MRL_LOG_ERROR = 0,
    MRL_LOG_WARN = 1,
    MRL_LOG_INFO = 2,
    MRL_LOG_DEBUG = 3,
    MRL_LOG_TRACE = 4
} mrl_log_level;

void mrl_log_set_level(mrl_log_level level);
mrl_log_level mrl_log_get_level(void);
/* Log one message (no format: Lua passes a formatted string; C code calls
 * mrl_logf, core/base/log.h). */
void mrl_log_write(mrl_log_level level, const char *message);
/* In a job of size > 1 every line carries "rank R/N" (size 1: nothing). */
void mrl_log_set_rank(int rank, int size);
/* " rank R/N" or "" (for other writers of error lines). */
const char *mrl_log_rank_tag(void);

#ifdef __cplusplus
}
#endif
