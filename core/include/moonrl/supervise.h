/* Supervising a run: the supervisor (`moonrl run --restarts N`) starts the
 * recipe in a child process and watches two things, its exit and its
 * heartbeat. The child beats at every phase of its loop by writing one line
 * to a pipe the supervisor gave it (MOONRL_HEARTBEAT_FD); a child that stops
 * beating is hung.
 *
 * Plain POSIX (posix_spawn, poll, waitpid) in the supervisor, which does
 * nothing else while the child runs. */
#pragma once
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- in the child ------------------------------------------------------- */
/* Send one heartbeat line (no newline needed; cut at 255 bytes). Does
 * nothing when no supervisor listens; never blocks (a full pipe drops the
 * beat: the reader is behind, it has seen recent ones). */
void mrl_heartbeat(const char *text);

/* --- in the supervisor -------------------------------------------------- */
typedef struct mrl_child mrl_child;

/* Start argv[0] (the executable's path) with argv, the supervisor's standard
 * input, output and error, its environment plus env_extra ("KEY=VALUE"
 * strings, NULL-terminated; may be NULL) and MOONRL_HEARTBEAT_FD. The child
 * leads a new process group, so that a terminal's Ctrl-C reaches only the
 * supervisor, which forwards it. */
mrl_status mrl_child_spawn(const char *const *argv, const char *const *env_extra, mrl_child **out);
/* Wait up to timeout_s seconds for the child to exit, reading its heartbeats
 * meanwhile. Returns 1 when it has exited, else 0. */
int mrl_child_poll(mrl_child *child, double timeout_s);
/* Seconds since the last heartbeat (since the start when none came yet). */
double mrl_child_idle_seconds(const mrl_child *child);
/* Heartbeats received so far. */
long mrl_child_beats(const mrl_child *child);
/* The last `count` (at most 64) heartbeat lines, oldest first, each ending
 * in a newline; valid until the next poll. */
const char *mrl_child_recent(mrl_child *child, int count);
/* Send a signal to the child's process group. */
mrl_status mrl_child_signal(mrl_child *child, int signum);
int mrl_child_pid(const mrl_child *child);
/* After exit: the exit status (>= 0) or -(signal number) when a signal ended it. */
int mrl_child_status(const mrl_child *child);
/* Frees; a child still running is killed (SIGKILL to its group) first. */
void mrl_child_free(mrl_child *child);

#ifdef __cplusplus
}
#endif
