/* Stopping cleanly: stop requests, SIGINT / SIGTERM / SIGUSR2 handled on the
 * loop thread, the run's deadline, and sleeps that end early on a stop
 * (moonrl/loop.h). The stop state is atomics, read from any thread. */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include "runtime/loop_thread.h"
#include "moonrl/supervise.h"
#include "base/error.h"

static uv_signal_t sigint_handle, sigterm_handle, sigusr2_handle;
static int signals_installed;          /* guarded by signals_lock */
static uv_mutex_t signals_lock;
static uv_cond_t signals_cond;
static uv_timer_t deadline_timer;
static double deadline_seconds;        /* of the timer set last (loop thread) */

static _Atomic int stop_code;
static char stop_reason[256];

mrl_status mrl_sleep(double seconds) {
    double end = mrl_time_now() + seconds;
    for (;;) {
        if (atomic_load(&stop_code)) return mrl_set_error(MRL_ERR_STOPPED, "stopped: %s", stop_reason);
        double left = end - mrl_time_now();
        if (left <= 0) return MRL_OK;
        if (left > 0.01) left = 0.01; /* wake often enough to notice a stop */
        struct timespec ts = {(time_t)left, (long)((left - (time_t)left) * 1e9)};
        nanosleep(&ts, NULL);
    }
}

/* ---------------------------------------------------------------- stop */

int mrl_stop_requested(void) { return atomic_load(&stop_code); }
const char *mrl_stop_reason(void) { return atomic_load(&stop_code) ? stop_reason : ""; }

void mrl_request_stop(int code, const char *reason) {
    if (atomic_load(&stop_code)) return; /* keep the first reason */
    snprintf(stop_reason, sizeof stop_reason, "%s", reason ? reason : "stop requested");
    atomic_store(&stop_code, code ? code : -2);
}

void mrl_clear_stop(void) {
    stop_reason[0] = 0;
    atomic_store(&stop_code, 0);
}

static _Atomic int count_only, signals_received, signal_last, exit_now;

int mrl_signals_exit_at_once(int on) { return atomic_exchange(&exit_now, on ? 1 : 0); }

void mrl_signals_count_only(void) { atomic_store(&count_only, 1); }
int mrl_signals_received(void) { return atomic_load(&signals_received); }
int mrl_signal_last(void) { return atomic_load(&signal_last); }

static void on_signal(uv_signal_t *handle, int signum) {
    (void)handle;
    /* SIGUSR2 is a SIGINT / SIGTERM that `moonrl launch` forwarded through mpirun, which passes
     * SIGUSR1/2 on to every rank but ends the job on SIGTERM: the ranks stop as on SIGTERM */
    const char *name = signum == SIGINT ? "SIGINT" : signum == SIGTERM ? "SIGTERM" : "SIGUSR2 (a stop from the launcher)";
    if (signum == SIGUSR2) signum = SIGTERM;
    atomic_store(&signal_last, signum);
    atomic_fetch_add(&signals_received, 1);
    if (atomic_load(&count_only)) return;
    if (atomic_load(&stop_code) > 0) {
        /* second signal: the user does not want to wait for a safe point */
        fprintf(stderr, "moonrl: second %s, exiting now\n", name);
        fflush(stderr);
        _exit(128 + signum);
    }
    if (atomic_load(&exit_now)) {
        /* the main thread is in a wait that would never see the stop request */
        fprintf(stderr, "moonrl: received %s while waiting, exiting now\n", name);
        fflush(stderr);
        _exit(128 + signum);
    }
    fprintf(stderr, "moonrl: received %s, stopping at the next safe point (send it again to exit now)\n", name);
    fflush(stderr);
    snprintf(stop_reason, sizeof stop_reason, "%s", name);
    atomic_store(&stop_code, signum);
    char beat[64];
    snprintf(beat, sizeof beat, "signal %s", name); /* a supervisor then need not forward it */
    mrl_heartbeat(beat);
}

static void on_deadline(uv_timer_t *timer) {
    (void)timer;
    char reason[128];
    snprintf(reason, sizeof reason, "deadline of %.3g s passed", deadline_seconds);
    mrl_request_stop(-1, reason);
}

/* ----------------------------------------------------- on the loop thread */

void mrl_deadline_on_loop(double seconds) {
    uv_timer_stop(&deadline_timer);
    if (seconds > 0) {
        deadline_seconds = seconds;
        uv_timer_start(&deadline_timer, on_deadline, (uint64_t)(seconds * 1000.0 + 0.5), 0);
    }
}

void mrl_signals_on_loop(void) {
    if (signals_installed) return;
    uv_signal_init(mrl_uv_loop, &sigint_handle);
    uv_signal_init(mrl_uv_loop, &sigterm_handle);
    uv_signal_start(&sigint_handle, on_signal, SIGINT);
    uv_signal_start(&sigterm_handle, on_signal, SIGTERM);
    uv_signal_init(mrl_uv_loop, &sigusr2_handle);
    uv_signal_start(&sigusr2_handle, on_signal, SIGUSR2);
    uv_mutex_lock(&signals_lock);
    signals_installed = 1;
    uv_cond_broadcast(&signals_cond);
    uv_mutex_unlock(&signals_lock);
}

void mrl_signals_loop_init(void) {
    uv_mutex_init(&signals_lock);
    uv_cond_init(&signals_cond);
    uv_timer_init(mrl_uv_loop, &deadline_timer);
}

void mrl_signals_loop_close(void) {
    signals_installed = 0;
    uv_mutex_destroy(&signals_lock);
    uv_cond_destroy(&signals_cond);
}

/* ---------------------------------------------------------------- API */

/* Returns once the handlers are in place: a signal sent after this call is a
 * stop request, never the default action (the run would die unsaved). */
mrl_status mrl_signals_install(void) {
    mrl_status st = mrl_loop_post(CMD_SIGNALS, NULL, 0);
    if (st != MRL_OK) return st;
    uv_mutex_lock(&signals_lock);
    while (!signals_installed) uv_cond_wait(&signals_cond, &signals_lock);
    uv_mutex_unlock(&signals_lock);
    return MRL_OK;
}

/* At most MRL_DEADLINE_MAX seconds: the timer counts uint64 milliseconds from the loop's clock, and
 * inf (or 1e300) converted to them was undefined: the deadline fired at once. */
mrl_status mrl_deadline_set(double seconds) {
    if (!(seconds >= 0) || !(seconds <= MRL_DEADLINE_MAX))
        return mrl_set_error(MRL_ERR_INVALID, "deadline must be in 0..%g seconds, got %g", MRL_DEADLINE_MAX, seconds);
    return mrl_loop_post(CMD_DEADLINE, NULL, seconds);
}
