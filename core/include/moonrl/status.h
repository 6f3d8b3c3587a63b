/* Status codes and the per-thread last-error message.
 *
 * Every fallible C function in moonrl returns an mrl_status. On failure it
 * also records a human-readable message for the calling thread, read back
 * with mrl_last_error(). Lua wrappers turn a non-zero status into a Lua error
 * carrying that message. (The core sets it with mrl_set_error, core/base/error.h.) */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mrl_status {
    MRL_OK = 0,
    MRL_ERR_INVALID = 1,     /* bad argument or bad input (config, shape) */
    MRL_ERR_NOMEM = 2,       /* an allocation failed */
    MRL_ERR_IO = 3,          /* a file could not be read or written */
    MRL_ERR_FORMAT = 4,      /* a file was read but its content is wrong */
    MRL_ERR_UNSUPPORTED = 5, /* valid input that moonrl does not handle */
    MRL_ERR_DEVICE = 6,      /* a device (CUDA) call failed */
    MRL_ERR_STOPPED = 7,     /* the run was asked to stop (SIGINT/SIGTERM) */
    MRL_ERR_TIMEOUT = 8,     /* a deadline passed */
    MRL_ERR_INTERNAL = 9     /* a broken invariant inside moonrl */
} mrl_status;

/* The message of the last error set on this thread ("" if none). */
const char *mrl_last_error(void);
/* Forget the last error on this thread. */
void mrl_clear_error(void);
/* The name of a status code: "MRL_ERR_IO", ... */
const char *mrl_status_name(mrl_status status);

#ifdef __cplusplus
}
#endif
