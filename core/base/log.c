/* Levelled logging to stderr. One fprintf per message so that lines from
 * several threads do not interleave within a line. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include "base/log.h"

static mrl_log_level current_level = MRL_LOG_INFO;
static const char *level_names[] = {"error", "warn", "info", "debug", "trace"};
/* " rank R/N" in every line of a job with several ranks: whose line it is */
static char line_tag[48];

void mrl_log_set_rank(int rank, int size) {
    if (size > 1) snprintf(line_tag, sizeof line_tag, " rank %d/%d", rank, size);
    else line_tag[0] = 0;
}
const char *mrl_log_rank_tag(void) { return line_tag; }

void mrl_log_set_level(mrl_log_level level) { current_level = level; }
mrl_log_level mrl_log_get_level(void) { return current_level; }

int mrl_log_level_parse(const char *name) {
    for (int i = 0; i < 5; i++)
        if (name && strcmp(name, level_names[i]) == 0) return i;
    return -1;
}

void mrl_log_write(mrl_log_level level, const char *message) {
    if (level > current_level || level < 0) return;
    fprintf(stderr, "[moonrl%s %s] %s\n", line_tag, level_names[level], message);
}

void mrl_logf(mrl_log_level level, const char *fmt, ...) {
    if (level > current_level || level < 0) return;
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    mrl_log_write(level, buf);
}
