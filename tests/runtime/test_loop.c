/* The libuv event loop: subprocesses with timeouts, background jobs,
 * deadlines and stop requests; the supervised child with its heartbeats
 * (moonrl/supervise.h). */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
#include "runtime/loop_internal.h"
#include "moonrl/runtime.h"
#include "moonrl/supervise.h"
#include "check.h"
#include "base/error.h"

static void test_proc_output(void) {
    const char *argv[] = {"sh", "-c", "read line; echo got:$line; echo oops >&2; exit 3", NULL};
    mrl_proc *p;
    CHECK_OK(mrl_proc_spawn(argv, "hello\n", 6, 10, 0, &p));
    mrl_proc_result r;
    CHECK_OK(mrl_proc_wait(p, &r));
    CHECK(mrl_proc_done(p));
    CHECK(r.exited && r.exit_status == 3 && !r.timed_out && r.term_signal == 0);
    size_t n;
    CHECK(strcmp(mrl_proc_stdout(p, &n), "got:hello\n") == 0 && n == 10);
    CHECK(strcmp(mrl_proc_stderr(p, &n), "oops\n") == 0);
    mrl_proc_free(p);
}

static void test_proc_timeout(void) {
    /* the child starts a grandchild that holds the pipes: both must die */
    const char *argv[] = {"sh", "-c", "sleep 30 & sleep 30", NULL};
    mrl_proc *p;
    double t0 = mrl_time_now();
    CHECK_OK(mrl_proc_spawn(argv, NULL, 0, 0.3, 0, &p));
    mrl_proc_result r;
    CHECK_OK(mrl_proc_wait(p, &r));
    double took = mrl_time_now() - t0;
    CHECK(r.timed_out && !r.exited && r.term_signal == 9);
    CHECK(took < 5.0);
    mrl_proc_free(p);
}

static void test_proc_many_and_missing(void) {
    mrl_proc *ps[8];
    for (int i = 0; i < 8; i++) {
        char code[32];
        snprintf(code, sizeof code, "exit %d", i);
        const char *argv[] = {"sh", "-c", code, NULL};
        CHECK_OK(mrl_proc_spawn(argv, NULL, 0, 10, 0, &ps[i]));
    }
    for (int i = 0; i < 8; i++) {
        mrl_proc_result r;
        CHECK_OK(mrl_proc_wait(ps[i], &r));
        CHECK(r.exit_status == i);
        mrl_proc_free(ps[i]);
    }
    const char *argv[] = {"/no/such/program-moonrl", NULL};
    mrl_proc *p;
    CHECK_OK(mrl_proc_spawn(argv, NULL, 0, 1, 0, &p));
    CHECK(mrl_proc_wait(p, NULL) == MRL_ERR_IO);
    CHECK_STR_CONTAINS(mrl_last_error(), "cannot start '/no/such/program-moonrl'");
    mrl_proc_free(p);
    const char *empty[] = {NULL};
    CHECK(mrl_proc_spawn(empty, NULL, 0, 1, 0, &p) == MRL_ERR_INVALID);
    /* freeing a running child kills it rather than hanging */
    const char *slow[] = {"sleep", "30", NULL};
    CHECK_OK(mrl_proc_spawn(slow, NULL, 0, 0, 0, &p));
    double t0 = mrl_time_now();
    mrl_proc_free(p);
    CHECK(mrl_time_now() - t0 < 5.0);
}

static void test_output_cap(void) {
    const char *argv[] = {"sh", "-c", "head -c 100000 /dev/zero | tr '\\0' x", NULL};
    mrl_proc *p;
    CHECK_OK(mrl_proc_spawn(argv, NULL, 0, 10, 1000, &p));
    CHECK_OK(mrl_proc_wait(p, NULL));
    size_t n;
    mrl_proc_stdout(p, &n);
    CHECK(n == 1000);
    mrl_proc_free(p);
}

static mrl_status failing_job(void *arg) {
    return mrl_set_error(MRL_ERR_FORMAT, "job %d went wrong", *(int *)arg);
}

static void test_jobs(void) {
    char path[] = "/tmp/moonrl_test_job_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    const char text[] = "checkpoint bytes";
    mrl_job *job;
    CHECK_OK(mrl_job_write_file(path, text, sizeof text - 1, &job));
    CHECK_OK(mrl_job_wait(job));
    CHECK(mrl_job_done(job));
    mrl_job_free(job);
    FILE *f = fopen(path, "rb");
    char buf[64] = {0};
    CHECK(f && fread(buf, 1, sizeof buf, f) == sizeof text - 1);
    if (f) fclose(f);
    CHECK(strcmp(buf, text) == 0);
    remove(path);

    CHECK_OK(mrl_job_write_file("/no/such/dir/file", text, 3, &job));
    CHECK(mrl_job_wait(job) == MRL_ERR_IO);
    CHECK_STR_CONTAINS(mrl_last_error(), "/no/such/dir/file");
    mrl_job_free(job);

    int arg = 42;
    CHECK_OK(mrl_job_submit(failing_job, &arg, &job));
    CHECK(mrl_job_wait(job) == MRL_ERR_FORMAT);
    CHECK_STR_CONTAINS(mrl_last_error(), "job 42 went wrong");
    mrl_job_free(job);
}

static void test_stop_and_deadline(void) {
    CHECK(mrl_stop_requested() == 0);
    CHECK_OK(mrl_deadline_set(0.2));
    double t0 = mrl_time_now();
    CHECK(mrl_sleep(10) == MRL_ERR_STOPPED); /* the deadline cuts the sleep short */
    CHECK(mrl_time_now() - t0 < 5.0);
    CHECK(mrl_stop_requested() == -1);
    CHECK_STR_CONTAINS(mrl_stop_reason(), "deadline");
    mrl_clear_stop();
    CHECK(mrl_stop_requested() == 0);
    CHECK_OK(mrl_sleep(0.01));
    CHECK(mrl_deadline_set(-1) == MRL_ERR_INVALID);
    CHECK(mrl_deadline_set(1.0 / 0.0) == MRL_ERR_INVALID); /* inf once fired at once */
    CHECK(mrl_deadline_set(0.0 / 0.0) == MRL_ERR_INVALID);
    CHECK(mrl_deadline_set(1e300) == MRL_ERR_INVALID);
    CHECK_OK(mrl_deadline_set(1e9)); /* 31 years: set, and cancelled */
    CHECK_OK(mrl_deadline_set(0));
    mrl_request_stop(0, "test");
    CHECK(mrl_stop_requested() == -2);
    mrl_clear_stop();
}

/* The handlers are in place when mrl_signals_install returns: a SIGINT sent the next moment is
 * a stop request, never the default action (which would kill the run unsaved). Done in a child
 * process (with its own event loop). */
static void test_signals_installed_on_return(void) {
    pid_t pid = fork();
    if (pid == 0) {
        if (mrl_init() != MRL_OK || mrl_signals_install() != MRL_OK) _exit(2);
        raise(SIGINT);
        double t0 = mrl_time_now();
        while (mrl_stop_requested() != SIGINT && mrl_time_now() - t0 < 5) mrl_sleep(0.001);
        _exit(mrl_stop_requested() == SIGINT ? 0 : 3);
    }
    int st;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    /* the supervisor's mode: counted, and a second signal does not end the process */
    pid = fork();
    if (pid == 0) {
        if (mrl_init() != MRL_OK || mrl_signals_install() != MRL_OK) _exit(2);
        mrl_signals_count_only();
        raise(SIGTERM);
        raise(SIGTERM);
        double t0 = mrl_time_now();
        while (mrl_signals_received() < 2 && mrl_time_now() - t0 < 5) mrl_sleep(0.001);
        _exit(mrl_signals_received() == 2 && mrl_signal_last() == SIGTERM && mrl_stop_requested() == 0 ? 0 : 3);
    }
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static void test_child(void) {
    /* beats arrive, the exit status comes back */
    const char *argv[] = {"/bin/sh", "-c", "echo one >&3; echo two >&3; exit 7", NULL};
    mrl_child *c;
    CHECK_OK(mrl_child_spawn(argv, NULL, &c));
    double t0 = mrl_time_now();
    while (!mrl_child_poll(c, 0.1) && mrl_time_now() - t0 < 10) {}
    CHECK(mrl_child_status(c) == 7);
    CHECK(mrl_child_beats(c) == 2);
    CHECK(strcmp(mrl_child_recent(c, 8), "one\ntwo\n") == 0);
    CHECK(strcmp(mrl_child_recent(c, 1), "two\n") == 0);
    mrl_child_free(c);

    /* a silent child: idle time grows; a signal to its group ends it; env_extra is passed */
    const char *argv2[] = {"/bin/sh", "-c", "[ \"$MOONRL_X\" = 42 ] || exit 3; sleep 30", NULL};
    const char *env[] = {"MOONRL_X=42", NULL};
    CHECK_OK(mrl_child_spawn(argv2, env, &c));
    CHECK(mrl_child_poll(c, 0.3) == 0);
    CHECK(mrl_child_idle_seconds(c) >= 0.25);
    CHECK(mrl_child_beats(c) == 0);
    CHECK_OK(mrl_child_signal(c, SIGTERM));
    t0 = mrl_time_now();
    while (!mrl_child_poll(c, 0.1) && mrl_time_now() - t0 < 10) {}
    CHECK(mrl_child_status(c) == -SIGTERM);
    mrl_child_free(c);

    const char *bad[] = {"/nonexistent/moonrl-child", NULL};
    CHECK(mrl_child_spawn(bad, NULL, &c) != MRL_OK);
    CHECK_STR_CONTAINS(mrl_last_error(), "/nonexistent/moonrl-child");
    /* no supervisor listening: a beat is a no-op */
    mrl_heartbeat("nobody hears this");
}

int main(void) {
    test_signals_installed_on_return(); /* first: its children start their own event loop */
    CHECK_OK(mrl_init());
    test_proc_output();
    test_proc_timeout();
    test_proc_many_and_missing();
    test_output_cap();
    test_jobs();
    test_stop_and_deadline();
    test_child();
    mrl_shutdown();
    CHECK_DONE();
}
