/* Per-thread last-error message. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include "base/error.h"

static _Thread_local char last_error[1024];

const char *mrl_last_error(void) { return last_error; }

void mrl_clear_error(void) { last_error[0] = 0; }

mrl_status mrl_set_error(mrl_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

mrl_status mrl_wrap_error(mrl_status status, const char *fmt, ...) {
    char cause[sizeof last_error];
    snprintf(cause, sizeof cause, "%s", last_error);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    if (!cause[0] || n < 0 || (size_t)n + 3 > sizeof last_error) return status;
    size_t at = (size_t)n, k = strlen(cause); /* the cause cut to what is left of the buffer */
    if (k > sizeof last_error - at - 3) k = sizeof last_error - at - 3;
    memcpy(last_error + at, ": ", 2);
    memcpy(last_error + at + 2, cause, k);
    last_error[at + 2 + k] = 0;
    return status;
}

const char *mrl_status_name(mrl_status status) {
    switch (status) {
    case MRL_OK: return "MRL_OK";
    case MRL_ERR_INVALID: return "MRL_ERR_INVALID";
    case MRL_ERR_NOMEM: return "MRL_ERR_NOMEM";
    case MRL_ERR_IO: return "MRL_ERR_IO";
    case MRL_ERR_FORMAT: return "MRL_ERR_FORMAT";
    case MRL_ERR_UNSUPPORTED: return "MRL_ERR_UNSUPPORTED";
    case MRL_ERR_DEVICE: return "MRL_ERR_DEVICE";
    case MRL_ERR_STOPPED: return "MRL_ERR_STOPPED";
    case MRL_ERR_TIMEOUT: return "MRL_ERR_TIMEOUT";
    case MRL_ERR_INTERNAL: return "MRL_ERR_INTERNAL";
    }
    return "MRL_ERR_UNKNOWN";
}
