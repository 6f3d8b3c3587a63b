/* The HTTP server of moonrl serve (core/serve/http.c), driven from one
 * thread: plain sockets as clients, mrl_http_poll between their sends and
 * reads. Requests and their fields, keep-alive, pipelining, streaming
 * (chunked), a client that leaves (take_gone) and one that half-closes
 * (answered), the limits (413, 431, 400, 503), the deadlines (head, body,
 * request), a new connection taking a slow one's place, bad ids and bad
 * arguments. Run under ASan by dev.sh test. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>
#include "moonrl/http.h"
#include "moonrl/loop.h"
#include "moonrl/runtime.h"
#include "check.h"

static int client(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    fcntl(fd, F_SETFL, O_NONBLOCK);
    return fd;
}

static void send_all(int fd, const char *s, size_t n) {
    while (n) {
        ssize_t k = send(fd, s, n, MSG_NOSIGNAL);
        if (k <= 0) {
            if (k < 0 && errno == EAGAIN) continue;
            return;
        }
        s += k, n -= (size_t)k;
    }
}

static void send_str(int fd, const char *s) { send_all(fd, s, strlen(s)); }

/* Poll the server until a request comes (2 s at most). */
static int wait_request(mrl_http *srv, mrl_http_request *req) {
    int got = 0;
    double end = mrl_time_now() + 2;
    while (!got && mrl_time_now() < end) mrl_http_poll(srv, 10, req, &got);
    return got;
}

/* Read from fd, polling the server meanwhile, until `needle` is in what came
 * (or the peer closed, or 2 s passed). Returns what came (static). */
static char *read_until(mrl_http *srv, int fd, const char *needle) {
    static char buf[1 << 16];
    size_t n = 0;
    double end = mrl_time_now() + 2;
    buf[0] = 0;
    while (mrl_time_now() < end && n < sizeof buf - 1) {
        mrl_http_request req;
        int got;
        mrl_http_poll(srv, 5, &req, &got);
        ssize_t k = recv(fd, buf + n, sizeof buf - 1 - n, 0);
        if (k > 0) {
            n += (size_t)k;
            buf[n] = 0;
            if (needle && strstr(buf, needle)) break;
        } else if (k == 0) {
            break;
        }
    }
    return buf;
}

/* Poll the server for `seconds` (the requests that come are left unanswered). */
static void pump(mrl_http *srv, double seconds) {
    double end = mrl_time_now() + seconds;
    mrl_http_request req;
    int got;
    while (mrl_time_now() < end) mrl_http_poll(srv, 5, &req, &got);
}

static void test_basic(void) {
    mrl_http_config cfg;
    mrl_http_config_default(&cfg);
    mrl_http *srv;
    CHECK_OK(mrl_http_open("127.0.0.1", 0, &cfg, &srv));
    int port = mrl_http_port(srv);
    CHECK(port > 0);
    int fd = client(port);
    CHECK(fd >= 0);
    send_str(fd, "POST /v1/x?a=1 HTTP/1.1\r\nHost: h\r\ncontent-type: application/json\r\nContent-Length: 5\r\n\r\nhello");
    mrl_http_request req;
    CHECK(wait_request(srv, &req));
    CHECK(strcmp(req.method, "POST") == 0);
    CHECK(strcmp(req.path, "/v1/x") == 0);
    CHECK(strcmp(req.query, "a=1") == 0);
    CHECK(strcmp(req.content_type, "application/json") == 0);
    CHECK(req.body_len == 5 && memcmp(req.body, "hello", 5) == 0 && req.body[5] == 0);
    int64_t id = req.id;
    mrl_http_stats st;
    mrl_http_get_stats(srv, &st);
    CHECK(st.in_flight == 1 && st.requests_total == 1 && st.connections_open == 1);
    CHECK_OK(mrl_http_respond(srv, id, 200, "text/plain", "ok", 2));
    CHECK(mrl_http_respond(srv, id, 200, "text/plain", "ok", 2) != MRL_OK); /* answered already */
    char *r = read_until(srv, fd, "\r\n\r\nok");
    CHECK_STR_CONTAINS(r, "HTTP/1.1 200 OK\r\n");
    CHECK_STR_CONTAINS(r, "Content-Length: 2\r\n");
    CHECK_STR_CONTAINS(r, "Connection: keep-alive\r\n");

    /* the same connection: a streamed response, chunked */
    send_str(fd, "GET /s HTTP/1.1\r\n\r\n");
    CHECK(wait_request(srv, &req));
    CHECK(strcmp(req.path, "/s") == 0 && req.body_len == 0 && strcmp(req.query, "") == 0);
    CHECK(mrl_http_stream_write(srv, req.id, "x", 1) != MRL_OK); /* no stream_begin yet */
    CHECK_OK(mrl_http_stream_begin(srv, req.id, 200, "text/event-stream"));
    CHECK_OK(mrl_http_stream_write(srv, req.id, "data: 1\n\n", 9));
    CHECK_OK(mrl_http_stream_write(srv, req.id, "", 0));
    CHECK_OK(mrl_http_stream_write(srv, req.id, "data: 22\n\n", 10));
    CHECK_OK(mrl_http_stream_end(srv, req.id));
    r = read_until(srv, fd, "0\r\n\r\n");
    CHECK_STR_CONTAINS(r, "Transfer-Encoding: chunked\r\n");
    CHECK_STR_CONTAINS(r, "\r\n\r\n9\r\ndata: 1\n\n\r\na\r\ndata: 22\n\n\r\n0\r\n\r\n");

    /* pipelined: two requests in one write, answered in order */
    send_str(fd, "GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\nConnection: close\r\n\r\n");
    CHECK(wait_request(srv, &req));
    CHECK(strcmp(req.path, "/a") == 0);
    mrl_http_request req2;
    int got = 1;
    CHECK_OK(mrl_http_poll(srv, 0, &req2, &got));
    CHECK(got == 0); /* /b waits until /a is answered */
    CHECK_OK(mrl_http_respond(srv, req.id, 404, NULL, "A", 1));
    CHECK(wait_request(srv, &req));
    CHECK(strcmp(req.path, "/b") == 0);
    CHECK_OK(mrl_http_respond(srv, req.id, 200, NULL, "B", 1));
    r = read_until(srv, fd, NULL); /* to the close */
    CHECK_STR_CONTAINS(r, "HTTP/1.1 404 Not Found");
    CHECK_STR_CONTAINS(r, "Connection: close\r\n\r\nB");
    CHECK(strstr(r, "\r\n\r\nA") < strstr(r, "\r\n\r\nB"));
    close(fd);

    /* a client that leaves while its request is open: its EOF could be a half-close, so the
       server probes it at once and the reset of the closed socket tells */
    fd = client(port);
    send_str(fd, "GET /slow HTTP/1.1\r\n\r\n");
    CHECK(wait_request(srv, &req));
    id = req.id;
    close(fd);
    int64_t gone[4];
    int n = 0;
    double end = mrl_time_now() + 5;
    while (n == 0 && mrl_time_now() < end) {
        mrl_http_poll(srv, 10, &req2, &got);
        n = mrl_http_take_gone(srv, gone, 4);
    }
    CHECK(n == 1 && gone[0] == id);
    CHECK(mrl_http_respond(srv, id, 200, NULL, "", 0) != MRL_OK);
    CHECK(mrl_http_stream_begin(srv, id, 200, NULL) != MRL_OK);
    mrl_http_get_stats(srv, &st);
    CHECK(st.in_flight == 0 && st.gone_total == 1);

    /* ids that never were */
    CHECK(mrl_http_respond(srv, 0, 200, NULL, "", 0) != MRL_OK);
    CHECK(mrl_http_respond(srv, 123456789, 200, NULL, "", 0) != MRL_OK);
    CHECK(mrl_http_stream_end(srv, -5) != MRL_OK);
    mrl_http_close(srv, 100);
}

/* A complete request, then the client's half-close (shutdown of its write side): answered (after the
 * probe, which the client skips; a client that is still there is not gone), then the connection
 * closes. HTTP/1.0 gets no probe. */
static void test_half_close(void) {
    mrl_http *srv;
    CHECK_OK(mrl_http_open("127.0.0.1", 0, NULL, &srv));
    int port = mrl_http_port(srv);
    for (int http10 = 0; http10 < 2; http10++) {
        int fd = client(port);
        send_str(fd, http10 ? "POST /x HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi"
                            : "POST /x HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi");
        shutdown(fd, SHUT_WR);
        mrl_http_request req;
        CHECK(wait_request(srv, &req));
        CHECK(req.body_len == 2);
        int64_t id = req.id;
        pump(srv, 0.6); /* the EOF, the probe and two ticks past it */
        int64_t gone[2];
        CHECK(mrl_http_take_gone(srv, gone, 2) == 0);
        CHECK_OK(mrl_http_respond(srv, id, 200, "text/plain", "answered", 8));
        char *r = read_until(srv, fd, NULL); /* to the close */
        CHECK_STR_CONTAINS(r, "\r\n\r\nanswered");
        if (http10) CHECK(strncmp(r, "HTTP/1.0 200 OK", 15) == 0);
        else CHECK(strncmp(r, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK", 40) == 0);
        close(fd);
    }
    /* a partial request and EOF: nothing to answer, closed */
    int fd = client(port);
    send_str(fd, "POST /x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhi");
    shutdown(fd, SHUT_WR);
    CHECK(strcmp(read_until(srv, fd, NULL), "") == 0);
    close(fd);
    mrl_http_close(srv, 100);
}

/* The deadlines: a head or a body trickled byte by byte is cut at its deadline (408) however
 * often bytes come; a request not answered in time gets 503 and is reported gone. */
static void test_deadlines(void) {
    mrl_http_config cfg;
    mrl_http_config_default(&cfg);
    cfg.header_timeout_s = 0.6;
    cfg.body_timeout_s = 0.6;
    cfg.request_timeout_s = 0.6;
    mrl_http *srv;
    CHECK_OK(mrl_http_open("127.0.0.1", 0, &cfg, &srv));
    int port = mrl_http_port(srv);
    const char *starts[] = {"GET / HTTP/1.1\r\nX-Slow: ", "POST / HTTP/1.1\r\nContent-Length: 100\r\n\r\n"};
    for (int k = 0; k < 2; k++) {
        int fd = client(port);
        send_str(fd, starts[k]);
        double t0 = mrl_time_now(), end = t0 + 6;
        char buf[512];
        ssize_t n = 0;
        while (mrl_time_now() < end) { /* a byte every 50 ms */
            pump(srv, 0.05);
            send(fd, "a", 1, MSG_NOSIGNAL);
            n = recv(fd, buf, sizeof buf - 1, 0);
            if (n > 0) break;
        }
        double took = mrl_time_now() - t0;
        CHECK(n > 0 && took > 0.55 && took < 5); /* bytes went on coming: only the deadline ends it */
        buf[n > 0 ? n : 0] = 0;
        CHECK_STR_CONTAINS(buf, "HTTP/1.1 408 ");
        close(fd);
    }
    int fd = client(port);
    send_str(fd, "GET /never HTTP/1.1\r\n\r\n");
    mrl_http_request req;
    CHECK(wait_request(srv, &req));
    int64_t id = req.id;
    CHECK_STR_CONTAINS(read_until(srv, fd, "}}"), "HTTP/1.1 503 ");
    int64_t gone[2];
    CHECK(mrl_http_take_gone(srv, gone, 2) == 1 && gone[0] == id);
    CHECK(mrl_http_respond(srv, id, 200, NULL, "", 0) != MRL_OK);
    close(fd);
    mrl_http_stats st;
    mrl_http_get_stats(srv, &st);
    CHECK(st.timed_out_total == 3 && st.in_flight == 0);
    mrl_http_close(srv, 100);
}

/* At max_connections, connections holding partial heads make room for a new one (the slowest
 * first); connections with a request in progress never do. */
static void test_eviction(void) {
    mrl_http_config cfg;
    mrl_http_config_default(&cfg);
    cfg.max_connections = 3;
    mrl_http *srv;
    CHECK_OK(mrl_http_open("127.0.0.1", 0, &cfg, &srv));
    int port = mrl_http_port(srv);
    mrl_http_request req;
    int got, slow[2];
    for (int i = 0; i < 2; i++) {
        slow[i] = client(port);
        send_str(slow[i], "GET / HTTP/1.1\r\nX-Slow: a");
        mrl_http_poll(srv, 20, &req, &got);
    }
    int busy = client(port); /* a request in progress */
    send_str(busy, "GET /busy HTTP/1.1\r\n\r\n");
    CHECK(wait_request(srv, &req));
    int64_t busy_id = req.id;
    int fresh[2];
    for (int i = 0; i < 2; i++) { /* each new one takes a slow one's place, the oldest first */
        fresh[i] = client(port);
        send_str(fresh[i], "GET /health HTTP/1.1\r\n\r\n");
        CHECK(wait_request(srv, &req));
        CHECK(strcmp(req.path, "/health") == 0);
        CHECK_OK(mrl_http_respond(srv, req.id, 200, NULL, "ok", 2));
        CHECK_STR_CONTAINS(read_until(srv, fresh[i], "ok"), "HTTP/1.1 200 ");
        CHECK_STR_CONTAINS(read_until(srv, slow[i], NULL), "HTTP/1.1 503 ");
        close(slow[i]);
    }
    close(fresh[0]), close(fresh[1]);
    pump(srv, 0.05); /* the server sees them close */
    /* every connection with a request in progress: a new one gets 503 (nothing can make room), however
       long they have run */
    int a = client(port), b = client(port);
    send_str(a, "GET /a HTTP/1.1\r\n\r\n");
    CHECK(wait_request(srv, &req));
    int64_t a_id = req.id;
    send_str(b, "GET /b HTTP/1.1\r\n\r\n");
    CHECK(wait_request(srv, &req));
    pump(srv, 1.2); /* past the second an idle connection is spared for */
    int c = client(port);
    CHECK_STR_CONTAINS(read_until(srv, c, "}}"), "HTTP/1.1 503 ");
    CHECK_OK(mrl_http_respond(srv, busy_id, 200, NULL, "done", 4));
    CHECK_STR_CONTAINS(read_until(srv, busy, "done"), "HTTP/1.1 200 ");
    CHECK_OK(mrl_http_respond(srv, a_id, 200, NULL, "a", 1));
    CHECK_STR_CONTAINS(read_until(srv, a, "\r\n\r\na"), "HTTP/1.1 200 ");
    mrl_http_stats st;
    mrl_http_get_stats(srv, &st);
    CHECK(st.evicted_total == 2);
    close(a), close(b), close(c), close(busy);
    mrl_http_close(srv, 100);
}

static void test_limits(void) {
    mrl_http_config cfg;
    mrl_http_config_default(&cfg);
    cfg.max_body_bytes = 100;
    cfg.max_header_bytes = 1024;
    cfg.max_connections = 3;
    mrl_http *srv;
    CHECK_OK(mrl_http_open("localhost", 0, &cfg, &srv));
    int port = mrl_http_port(srv);
    int fd = client(port);
    send_str(fd, "POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n");
    char *r = read_until(srv, fd, "}}");
    CHECK_STR_CONTAINS(r, "HTTP/1.1 413 ");
    CHECK_STR_CONTAINS(r, "\"code\": 413");
    close(fd);

    fd = client(port);
    char big[2048];
    memset(big, 'a', sizeof big);
    send_str(fd, "GET / HTTP/1.1\r\nX: ");
    send_all(fd, big, sizeof big);
    r = read_until(srv, fd, "}}");
    CHECK_STR_CONTAINS(r, "HTTP/1.1 431 ");
    close(fd);

    const char *bad[] = {"GET\r\n\r\n", "GET / FTP/1.0\r\n\r\n", "G(T / HTTP/1.1\r\n\r\n", "GET nopath HTTP/1.1\r\n\r\n",
                         "GET / HTTP/1.1\r\nno colon\r\n\r\n", "GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                         "GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        fd = client(port);
        send_str(fd, bad[i]);
        r = read_until(srv, fd, "}}");
        CHECK_STR_CONTAINS(r, "HTTP/1.1 400 ");
        close(fd);
    }
    fd = client(port);
    send_str(fd, "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
    CHECK_STR_CONTAINS(read_until(srv, fd, "}}"), "HTTP/1.1 411 ");
    close(fd);
    /* a NUL (or another control character) in a header value */
    static const char nul[] = "GET / HTTP/1.1\r\nX-A: a\0b\r\n\r\n";
    static const char ctl[] = "GET / HTTP/1.1\r\nX-A: a\x01b\r\n\r\n";
    static const char tab[] = "GET / HTTP/1.1\r\nX-A: a\tb\r\nConnection: close\r\n\r\n";
    fd = client(port);
    send_all(fd, nul, sizeof nul - 1);
    CHECK_STR_CONTAINS(read_until(srv, fd, "}}"), "HTTP/1.1 400 ");
    close(fd);
    fd = client(port);
    send_all(fd, ctl, sizeof ctl - 1);
    CHECK_STR_CONTAINS(read_until(srv, fd, "}}"), "HTTP/1.1 400 ");
    close(fd);
    fd = client(port); /* a tab is fine */
    send_all(fd, tab, sizeof tab - 1);
    mrl_http_request treq;
    CHECK(wait_request(srv, &treq));
    CHECK_OK(mrl_http_respond(srv, treq.id, 200, NULL, "", 0));
    CHECK_STR_CONTAINS(read_until(srv, fd, NULL), "HTTP/1.1 200 ");
    close(fd);

    /* connections past max_connections: 503 */
    int fds[4];
    for (int i = 0; i < 4; i++) {
        fds[i] = client(port);
        mrl_http_request req;
        int got;
        mrl_http_poll(srv, 20, &req, &got);
    }
    CHECK_STR_CONTAINS(read_until(srv, fds[3], "}}"), "HTTP/1.1 503 ");
    for (int i = 0; i < 4; i++) close(fds[i]);
    mrl_http_stats st;
    mrl_http_get_stats(srv, &st);
    CHECK(st.rejected_total == 13 && st.requests_total == 1);
    mrl_http_close(srv, 100);
}

static void test_bad_arguments(void) {
    mrl_http *srv = NULL;
    CHECK(mrl_http_open("127.0.0.1", 70000, NULL, &srv) != MRL_OK && srv == NULL);
    CHECK(mrl_http_open("no-such-host.invalid", 0, NULL, &srv) != MRL_OK);
    CHECK_STR_CONTAINS(mrl_last_error(), "no-such-host.invalid");
    mrl_http_config cfg;
    mrl_http_config_default(&cfg);
    cfg.max_connections = 0;
    CHECK(mrl_http_open("127.0.0.1", 0, &cfg, &srv) != MRL_OK);
    /* a port that is taken */
    mrl_http *a;
    CHECK_OK(mrl_http_open("127.0.0.1", 0, NULL, &a));
    CHECK(mrl_http_open("127.0.0.1", mrl_http_port(a), NULL, &srv) != MRL_OK);
    CHECK_STR_CONTAINS(mrl_last_error(), "in use");
    mrl_http_request req;
    int got;
    CHECK(mrl_http_poll(NULL, 0, &req, &got) != MRL_OK);
    mrl_http_close(a, 0);
    mrl_http_close(NULL, 0);
}

int main(void) {
    if (mrl_init() != MRL_OK) return 1;
    test_basic();
    test_half_close();
    test_deadlines();
    test_eviction();
    test_limits();
    test_bad_arguments();
    mrl_shutdown();
    CHECK_DONE();
}
