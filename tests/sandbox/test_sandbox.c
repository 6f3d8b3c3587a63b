/* The sandbox's C interface (moonrl/sandbox.h), also under the sanitizers: a program's streams
 * (stdin written while it reads, stdout and stderr both larger than a pipe's buffer), files in
 * /tmp and /box, the result's fields, the output limit's truncation, runs from several threads
 * at once, a batch (in order, a failed run in its place, freed untaken), the warm pool (a run, a
 * batch on it, a session, what it refuses), a cold session killed at its close, and the spec's
 * errors naming their field. The attacks are tests/sandbox/test_sandbox.lua's.
 * Skipped (77) where the machine gives no namespaces. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "moonrl/runtime.h"
#include "moonrl/sandbox.h"

static void *run_one(void *arg) {
    int i = (int)(intptr_t)arg;
    char code[64];
    snprintf(code, sizeof code, "echo run %d", i);
    const char *argv[] = {"sh", "-c", code, NULL};
    mrl_sandbox_spec s = {.argv = argv};
    mrl_sandbox_result r;
    char want[32];
    snprintf(want, sizeof want, "run %d\n", i);
    if (mrl_sandbox_run(&s, &r)) {
        fprintf(stderr, "run %d: %s\n", i, mrl_last_error());
        return (void *)1;
    }
    int bad = !(r.exited && r.status == 0 && strcmp(r.out, want) == 0);
    if (bad) fprintf(stderr, "run %d: exited %d status %d out '%s' err '%s'\n", i, r.exited, r.status, r.out, r.err);
    mrl_sandbox_result_free(&r);
    return (void *)(intptr_t)bad;
}

int main(void) {
    mrl_sandbox_caps caps;
    CHECK_OK(mrl_sandbox_probe(&caps));
    printf("%s\n", caps.detail);
    if (!caps.namespaces) return 77;
    /* 1 MiB through stdin, echoed on stdout and (reversed case) stderr: the streams at once */
    int64_t n = 1 << 20;
    char *in = malloc((size_t)n);
    for (int64_t i = 0; i < n; i++) in[i] = (char)('a' + i % 26);
    const char *argv[] = {"sh", "-c", "tee /dev/stderr | tr a-z A-Z > /dev/null; cat /tmp/f.txt /box/g.txt; exit 5", NULL};
    mrl_sandbox_file files[2] = {{"f.txt", "in tmp\n", 7, 0, 0}, {"g.txt", "in box\n", 7, 0, 1}};
    mrl_sandbox_spec s = {.argv = argv, .stdin_data = in, .stdin_len = n, .files = files, .n_files = 2,
                          .limits = {.output_bytes = 4 << 20}};
    mrl_sandbox_result r;
    CHECK_OK(mrl_sandbox_run(&s, &r));
    CHECK(r.exited == 1 && r.status == 5 && r.limit == MRL_SANDBOX_LIMIT_NONE);
    CHECK(r.out_len == 14 && strcmp(r.out, "in tmp\nin box\n") == 0 && !r.out_truncated);
    CHECK(r.err_len == n && memcmp(r.err, in, (size_t)n) == 0 && r.err[n] == 0);
    if (r.err_len != n) fprintf(stderr, "stderr: %lld bytes (%.200s)\n", (long long)r.err_len, r.err);
    CHECK(r.wall_s > 0 && r.cpu_s >= 0 && r.peak_memory_bytes > 0);
    mrl_sandbox_result_free(&r);
    /* the output limit: the run killed, the output cut at the limit and marked */
    const char *yes[] = {"yes", NULL};
    mrl_sandbox_spec y = {.argv = yes, .limits = {.output_bytes = 10000}};
    CHECK_OK(mrl_sandbox_run(&y, &r));
    CHECK(r.limit == MRL_SANDBOX_LIMIT_OUTPUT && r.out_len == 10000 && r.out_truncated && !r.exited && r.status == 9);
    CHECK(strcmp(mrl_sandbox_limit_name(r.limit), "output") == 0);
    mrl_sandbox_result_free(&r);
    /* several threads at once */
    pthread_t th[4];
    for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, run_one, (void *)(intptr_t)i);
    for (int i = 0; i < 4; i++) {
        void *bad;
        pthread_join(th[i], &bad);
        CHECK(bad == NULL);
    }
    /* a batch: in order, on 2 threads, a run the sandbox fails in its place */
    enum { NB = 6 };
    mrl_sandbox_spec specs[NB];
    const char *argvs[NB][4];
    char codes[NB][32];
    for (int i = 0; i < NB; i++) {
        snprintf(codes[i], sizeof codes[i], "echo batch %d", i);
        argvs[i][0] = i == 3 ? "no-such-program" : "sh", argvs[i][1] = "-c", argvs[i][2] = codes[i], argvs[i][3] = NULL;
        specs[i] = (mrl_sandbox_spec){.argv = argvs[i]};
    }
    mrl_sandbox_batch *b = NULL;
    CHECK_OK(mrl_sandbox_batch_start(specs, NB, 2, &b));
    mrl_sandbox_batch_wait(b);
    CHECK(mrl_sandbox_batch_done(b));
    for (int i = 0; i < NB; i++) {
        char want[32];
        snprintf(want, sizeof want, "batch %d\n", i);
        mrl_status st = mrl_sandbox_batch_take(b, i, &r);
        if (i == 3) CHECK(st == MRL_ERR_INVALID && strstr(mrl_last_error(), "no-such-program"));
        else CHECK(st == MRL_OK && r.exited && strcmp(r.out, want) == 0);
        mrl_sandbox_result_free(&r);
    }
    CHECK(mrl_sandbox_batch_take(b, 0, &r) == MRL_ERR_INVALID); /* (taken) */
    mrl_sandbox_batch_free(b);
    CHECK_OK(mrl_sandbox_batch_start(specs, NB, 0, &b)); /* freed without taking: its results freed */
    mrl_sandbox_batch_free(b);
    /* the warm pool: runs forked by its zygote, one alone and a batch of them */
    mrl_sandbox_pool *pool = NULL;
    CHECK_OK(mrl_sandbox_pool_open("python", MRL_SANDBOX_NET_NONE, NULL, &pool));
    const char *pyargv[] = {"python3", "-c", "import sys; print(sys.stdin.read()[::-1]); sys.exit(4)", NULL};
    mrl_sandbox_spec ps = {.argv = pyargv, .stdin_data = "abc", .stdin_len = 3, .pool = pool};
    CHECK_OK(mrl_sandbox_run(&ps, &r));
    CHECK(r.exited && r.status == 4 && strcmp(r.out, "cba\n") == 0);
    mrl_sandbox_result_free(&r);
    mrl_sandbox_spec pspecs[4];
    for (int i = 0; i < 4; i++) pspecs[i] = ps;
    CHECK_OK(mrl_sandbox_batch_start(pspecs, 4, 2, &b));
    for (int i = 0; i < 4; i++) {
        CHECK(mrl_sandbox_batch_take(b, i, &r) == MRL_OK && r.status == 4 && strcmp(r.out, "cba\n") == 0);
        mrl_sandbox_result_free(&r);
    }
    mrl_sandbox_batch_free(b);
    /* a session on the pool: a line in, a line out, the rest at its close */
    const char *echo[] = {"python3", "-c", "import sys\nfor l in sys.stdin: print('got', l.strip(), flush=True)\nprint('end')",
                          NULL};
    mrl_sandbox_spec ss = {.argv = echo, .pool = pool};
    mrl_sandbox_session *sess = NULL;
    CHECK_OK(mrl_sandbox_session_start(&ss, &sess));
    CHECK_OK(mrl_sandbox_session_send(sess, "a\nb\n", 4, 5));
    char *line = NULL;
    int64_t len = 0;
    int ended = 0;
    CHECK_OK(mrl_sandbox_session_recv(sess, "\n", 10, &line, &len, &ended));
    CHECK(line && strcmp(line, "got a\n") == 0 && len == 6 && !ended);
    free(line);
    CHECK_OK(mrl_sandbox_session_close(sess, 0, &r));
    CHECK(r.exited && r.status == 0 && strcmp(r.out, "got b\nend\n") == 0);
    mrl_sandbox_result_free(&r);
    /* a cold one that never answers: the receive's time passes, the close kills it */
    const char *sleeper[] = {"sleep", "30", NULL};
    ss = (mrl_sandbox_spec){.argv = sleeper};
    CHECK_OK(mrl_sandbox_session_start(&ss, &sess));
    CHECK(mrl_sandbox_session_recv(sess, "\n", 0.2, &line, &len, &ended) == MRL_ERR_TIMEOUT && !line);
    CHECK_OK(mrl_sandbox_session_close(sess, 1, &r));
    CHECK(!r.exited && r.status == 9);
    mrl_sandbox_result_free(&r);
    ps.argv = yes; /* (not python: the pool's error) */
    CHECK(mrl_sandbox_run(&ps, &r) == MRL_ERR_INVALID && strstr(mrl_last_error(), "python3 FILE ARGS"));
    mrl_sandbox_pool_close(pool);
    CHECK(mrl_sandbox_pool_open("ruby", 0, NULL, &pool) == MRL_ERR_INVALID && strstr(mrl_last_error(), "'ruby'"));
    /* errors naming the field */
    mrl_sandbox_file dup[2] = {{"a", "x", 1, 0, 0}, {"a", "y", 1, 0, 0}};
    mrl_sandbox_spec e = {.argv = yes, .files = dup, .n_files = 2};
    CHECK(mrl_sandbox_run(&e, &r) == MRL_ERR_INVALID && strstr(mrl_last_error(), "files[1].name 'a' given twice"));
    e = (mrl_sandbox_spec){.argv = yes, .limits = {.wall_s = -1}};
    CHECK(mrl_sandbox_run(&e, &r) == MRL_ERR_INVALID && strstr(mrl_last_error(), "limits.wall_s"));
    const char *none[] = {NULL};
    e = (mrl_sandbox_spec){.argv = none};
    CHECK(mrl_sandbox_run(&e, &r) == MRL_ERR_INVALID && strstr(mrl_last_error(), "argv is empty"));
    const char *envs[] = {"NOEQUALS", NULL};
    e = (mrl_sandbox_spec){.argv = yes, .env = envs};
    CHECK(mrl_sandbox_run(&e, &r) == MRL_ERR_INVALID && strstr(mrl_last_error(), "env[0] 'NOEQUALS'"));
    free(in);
    mrl_shutdown();
    CHECK_DONE();
}
