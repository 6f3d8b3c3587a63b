/* The HTTP client (core/serve/http_client.c), driven from one thread
 * against the server of moonrl serve (core/serve/http.c, polled between the
 * client's polls) and against plain sockets playing misbehaving servers.
 * Round trips (GET, POST, a streamed chunked body, a name resolved), 200
 * requests over a pool of 4 connections (each answered once, with its own
 * body, on 4 connections only), the keep-alive race (a reused connection
 * the server closed: sent again once, on a fresh one), the framings
 * (chunked trickled byte by byte, read to the end, interim 100, 204), the
 * failures (refused, a server that never answers, one that closes before or
 * in the middle of a response, a body past the limit, malformed heads and
 * chunks, a head past 64 KiB), cancel, the deadline of a queued request, bad
 * arguments, and close with requests in flight. Run under ASan by dev.sh
 * test. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>
#include "moonrl/http.h"
#include "moonrl/http_client.h"
#include "moonrl/loop.h"
#include "moonrl/runtime.h"
#include "check.h"

/* ------------------------------------------------------------ the moonrl server's side */

static int64_t held[16]; /* requests to /hold: left unanswered */
static int n_held;
static char last_ctype[128];

/* Answer what the server has: /echo with "<method> <body>", /stream with a chunked body in three
 * writes, /hold not at all. */
static void serve(mrl_http *srv) {
    mrl_http_request q;
    int got = 1;
    while (srv && got) {
        mrl_http_poll(srv, 0, &q, &got);
        if (!got) break;
        snprintf(last_ctype, sizeof last_ctype, "%s", q.content_type);
        if (strcmp(q.path, "/echo") == 0) {
            char out[512];
            int n = snprintf(out, sizeof out, "%s %.*s", q.method, (int)q.body_len, q.body);
            mrl_http_respond(srv, q.id, 200, "text/plain", out, n);
        } else if (strcmp(q.path, "/stream") == 0) {
            mrl_http_stream_begin(srv, q.id, 200, "text/event-stream");
            mrl_http_stream_write(srv, q.id, "ab", 2);
            mrl_http_stream_write(srv, q.id, "cd", 2);
            mrl_http_stream_write(srv, q.id, "e", 1);
            mrl_http_stream_end(srv, q.id);
        } else if (strcmp(q.path, "/hold") == 0 && n_held < 16) {
            held[n_held++] = q.id;
        } else {
            mrl_http_respond(srv, q.id, 404, NULL, "{}", 2);
        }
    }
}

/* Poll the client (and the server, when given) until a response comes, `seconds` at most. */
static int wait_response(mrl_httpc *c, mrl_http *srv, mrl_httpc_response *resp, double seconds) {
    int got = 0;
    double end = mrl_time_now() + seconds;
    while (!got && mrl_time_now() < end) {
        serve(srv);
        CHECK_OK(mrl_httpc_poll(c, srv ? 1 : 10, resp, &got));
    }
    return got;
}

/* One request, its response waited for (5 s at most). */
static int fetch(mrl_httpc *c, mrl_http *srv, const char *host, int port, const char *method, const char *path,
                 const char *headers, const char *body, mrl_httpc_response *resp) {
    int64_t id = 0;
    CHECK_OK(mrl_httpc_request(c, host, port, method, path, headers, body, body ? (int64_t)strlen(body) : 0, 5, &id));
    CHECK(id > 0);
    int got = wait_response(c, srv, resp, 5);
    CHECK(got && resp->id == id);
    return got;
}

/* ------------------------------------------------------------ plain sockets as servers */

static int listen_raw(int *port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 16) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        close(fd);
        return -1;
    }
    fcntl(fd, F_SETFL, O_NONBLOCK);
    *port = ntohs(a.sin_port);
    return fd;
}

/* A port nothing listens on: bound for a moment, then let go. */
static int closed_port(void) {
    int port = 0, fd = listen_raw(&port);
    close(fd);
    return port;
}

/* A misbehaving server's one connection: accept it, read the request's head, then send `reply`
 * (all at once, or a byte between two client polls when trickle), then close when told to. */
typedef struct raw {
    int lfd, fd;
    char in[8192];
    size_t in_len;
} raw;

static int raw_accept(raw *s) {
    if (s->fd >= 0) return 1;
    s->fd = accept(s->lfd, NULL, NULL);
    if (s->fd < 0) return 0;
    fcntl(s->fd, F_SETFL, O_NONBLOCK);
    s->in_len = 0;
    return 1;
}

/* 1 once a whole request head came on s->fd (consumed). */
static int raw_request_in(raw *s) {
    if (!raw_accept(s)) return 0;
    ssize_t k = recv(s->fd, s->in + s->in_len, sizeof s->in - 1 - s->in_len, 0);
    if (k > 0) s->in_len += (size_t)k;
    s->in[s->in_len] = 0;
    char *e = strstr(s->in, "\r\n\r\n");
    if (!e) return 0;
    size_t used = (size_t)(e + 4 - s->in);
    memmove(s->in, e + 4, s->in_len - used + 1);
    s->in_len -= used;
    return 1;
}

/* Queue GET /x to the raw server and play its part: the reply after the request's head, then a
 * close if close_after. The response is waited for (5 s at most). */
static int exchange(mrl_httpc *c, raw *s, int port, const char *reply, size_t len, int trickle, int close_after,
                    double timeout_s, mrl_httpc_response *resp) {
    int64_t id;
    CHECK_OK(mrl_httpc_request(c, "127.0.0.1", port, "GET", "/x", NULL, NULL, 0, timeout_s, &id));
    int got = 0, asked = 0;
    size_t sent = 0;
    double end = mrl_time_now() + 5;
    while (!got && mrl_time_now() < end) {
        CHECK_OK(mrl_httpc_poll(c, 1, resp, &got));
        if (got) break;
        if (!asked) asked = raw_request_in(s);
        if (!asked || s->fd < 0) continue;
        if (sent < len) {
            size_t n = trickle ? 1 : len - sent;
            ssize_t k = send(s->fd, reply + sent, n, MSG_NOSIGNAL);
            if (k > 0) sent += (size_t)k;
            else if (k < 0 && errno != EAGAIN) sent = len; /* the client has gone: nothing more to send */
        }
        if (sent == len && close_after) {
            close(s->fd);
            s->fd = -1;
        }
    }
    CHECK(got && resp->id == id);
    return got;
}

static void raw_close(raw *s) {
    if (s->fd >= 0) close(s->fd);
    s->fd = -1;
}

/* ------------------------------------------------------------ the tests */

static void test_round_trips(void) {
    mrl_http *srv;
    CHECK_OK(mrl_http_open("127.0.0.1", 0, NULL, &srv));
    int port = mrl_http_port(srv);
    mrl_httpc *c;
    CHECK_OK(mrl_httpc_open(NULL, &c));
    mrl_httpc_response r;
    if (fetch(c, srv, "127.0.0.1", port, "GET", "/echo", NULL, NULL, &r)) {
        CHECK(r.status == 200 && r.error == NULL);
        CHECK(r.body_len == 4 && strcmp(r.body, "GET ") == 0);
        CHECK(r.seconds >= 0 && r.seconds < 5);
    }
    if (fetch(c, srv, "127.0.0.1", port, "POST", "/echo", NULL, "{\"a\": 1}", &r)) {
        CHECK(r.status == 200 && strcmp(r.body, "POST {\"a\": 1}") == 0);
        CHECK(strcmp(last_ctype, "application/json") == 0); /* the default */
    }
    if (fetch(c, srv, "127.0.0.1", port, "POST", "/echo", "Content-Type: text/plain\r\nX-Y: z\r\n", "hi", &r)) {
        CHECK(r.status == 200 && strcmp(r.body, "POST hi") == 0);
        CHECK(strcmp(last_ctype, "text/plain") == 0);
    }
    if (fetch(c, srv, "127.0.0.1", port, "POST", "/echo", NULL, NULL, &r)) /* a POST without a body */
        CHECK(r.status == 200 && strcmp(r.body, "POST ") == 0);
    if (fetch(c, srv, "127.0.0.1", port, NULL, "/stream", NULL, NULL, &r)) /* chunked, from the server's stream */
        CHECK(r.status == 200 && r.body_len == 5 && strcmp(r.body, "abcde") == 0);
    if (fetch(c, srv, "127.0.0.1", port, "GET", "/nothing", NULL, NULL, &r))
        CHECK(r.status == 404 && r.error == NULL && strcmp(r.body, "{}") == 0);
    /* all of them on one keep-alive connection */
    mrl_httpc_stats st;
    mrl_httpc_get_stats(c, &st);
    CHECK(st.connections_total == 1 && st.connections_open == 1 && st.requests_total == 6 && st.pending == 0);
    /* a name (resolved by libuv's thread pool): a host of its own, so a connection of its own */
    if (fetch(c, srv, "localhost", port, "GET", "/echo", NULL, NULL, &r)) CHECK(r.status == 200);
    mrl_httpc_get_stats(c, &st);
    CHECK(st.connections_total == 2 && st.failed_total == 0);
    mrl_httpc_close(c);
    mrl_http_close(srv, 100);
}

/* 200 requests over a pool of 4 connections: every one answered once, with its own body, and never
 * more than 4 connections (the server counts the same). */
static void test_pool(void) {
    mrl_http *srv;
    CHECK_OK(mrl_http_open("127.0.0.1", 0, NULL, &srv));
    int port = mrl_http_port(srv);
    mrl_httpc_config cfg;
    mrl_httpc_config_default(&cfg);
    cfg.max_connections_per_host = 4;
    mrl_httpc *c;
    CHECK_OK(mrl_httpc_open(&cfg, &c));
    enum { N = 200 };
    int64_t ids[N];
    int seen[N];
    memset(seen, 0, sizeof seen);
    for (int round = 0; round < 2; round++) {
        int n = round == 0 ? N : 20;
        for (int i = 0; i < n; i++) {
            char body[32];
            snprintf(body, sizeof body, "n=%d", i);
            CHECK_OK(mrl_httpc_request(c, "127.0.0.1", port, "POST", "/echo", NULL, body, (int64_t)strlen(body), 10, &ids[i]));
            seen[i] = 0;
        }
        CHECK(mrl_httpc_pending(c) == n);
        mrl_httpc_stats st;
        mrl_httpc_get_stats(c, &st);
        CHECK(st.connections_open <= 4);
        int done = 0, bad = 0;
        double end = mrl_time_now() + 20;
        while (done < n && mrl_time_now() < end) {
            mrl_httpc_response r;
            int got;
            serve(srv);
            CHECK_OK(mrl_httpc_poll(c, 1, &r, &got));
            if (!got) continue;
            int i = 0;
            while (i < n && ids[i] != r.id) i++;
            char want[32];
            snprintf(want, sizeof want, "POST n=%d", i);
            if (i == n || seen[i] || r.status != 200 || strcmp(r.body, want) != 0) bad++;
            else seen[i] = 1;
            done++;
        }
        CHECK(done == n && bad == 0 && mrl_httpc_pending(c) == 0);
        mrl_httpc_get_stats(c, &st);
        CHECK(st.connections_total == 4 && st.connections_open == 4 && st.retried_total == 0 && st.failed_total == 0);
    }
    mrl_http_stats ss;
    mrl_http_get_stats(srv, &ss);
    CHECK(ss.connections_total == 4 && ss.requests_total == N + 20);
    mrl_httpc_close(c);
    mrl_http_close(srv, 100);
}

/* The keep-alive race: the server closes a pooled connection just as a request goes out on it. The
 * request is sent again, once, on a fresh connection; a second such failure is reported. */
static void test_keep_alive_race(void) {
    raw s = {.fd = -1};
    int port;
    s.lfd = listen_raw(&port);
    mrl_httpc *c;
    CHECK_OK(mrl_httpc_open(NULL, &c));
    static const char ok[] = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    mrl_httpc_response r;
    if (exchange(c, &s, port, ok, sizeof ok - 1, 0, 0, 5, &r)) CHECK(r.status == 200 && strcmp(r.body, "ok") == 0);
    for (int k = 0; k < 2; k++) {
        int64_t id;
        /* the pooled connection takes it (written at once); the server then closes without reading */
        CHECK_OK(mrl_httpc_request(c, "127.0.0.1", port, "POST", "/x", NULL, "{}", 2, 5, &id));
        raw_close(&s);
        mrl_httpc_stats st;
        int got = 0;
        double end = mrl_time_now() + 5;
        while (!got && mrl_time_now() < end) {
            CHECK_OK(mrl_httpc_poll(c, 1, &r, &got));
            if (got) break;
            if (raw_request_in(&s)) { /* the retry, on a new connection */
                static const char again[] = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nagain";
                if (k == 0) send(s.fd, again, sizeof again - 1, MSG_NOSIGNAL);
                else raw_close(&s); /* closed again: not retried twice */
            }
        }
        CHECK(got && r.id == id);
        mrl_httpc_get_stats(c, &st);
        if (k == 0) {
            CHECK(r.status == 200 && strcmp(r.body, "again") == 0);
            CHECK(st.retried_total == 1 && st.connections_total == 2);
        } else {
            CHECK(r.status == 0 && r.error && strcmp(r.error, "connection closed before the response") == 0);
            CHECK(st.retried_total == 2 && st.connections_total == 3 && st.failed_total == 1);
        }
    }
    raw_close(&s);
    close(s.lfd);
    mrl_httpc_close(c);
}

/* Framings: chunked (with an extension and a trailer) trickled a byte at a time and then the
 * connection reused; an interim 100; 204; HTTP/1.0 read to the end. */
static void test_framing(void) {
    raw s = {.fd = -1};
    int port;
    s.lfd = listen_raw(&port);
    mrl_httpc *c;
    CHECK_OK(mrl_httpc_open(NULL, &c));
    mrl_httpc_response r;
    static const char chunked[] = "HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n"
                                  "5;x=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n";
    if (exchange(c, &s, port, chunked, sizeof chunked - 1, 1, 0, 5, &r))
        CHECK(r.status == 200 && r.body_len == 11 && strcmp(r.body, "hello world") == 0);
    static const char interim[] = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nCONTENT-LENGTH: 3\r\n\r\nabc";
    if (exchange(c, &s, port, interim, sizeof interim - 1, 0, 0, 5, &r)) CHECK(r.status == 201 && strcmp(r.body, "abc") == 0);
    static const char none[] = "HTTP/1.1 204 No Content\r\n\r\n";
    if (exchange(c, &s, port, none, sizeof none - 1, 0, 0, 5, &r)) CHECK(r.status == 204 && r.body_len == 0 && r.body[0] == 0);
    mrl_httpc_stats st;
    mrl_httpc_get_stats(c, &st);
    CHECK(st.connections_total == 1); /* one connection for the three */
    static const char http10[] = "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end";
    if (exchange(c, &s, port, http10, sizeof http10 - 1, 0, 1, 5, &r))
        CHECK(r.status == 200 && strcmp(r.body, "until the end") == 0);
    static const char bare_lf[] = "HTTP/1.1 200 OK\nContent-Length: 2\n\nlf";
    if (exchange(c, &s, port, bare_lf, sizeof bare_lf - 1, 0, 0, 5, &r)) CHECK(r.status == 200 && strcmp(r.body, "lf") == 0);
    raw_close(&s);
    close(s.lfd);
    mrl_httpc_close(c);
}

/* What fails a request: status 0 and the error; never a crash, a hang or a large allocation. */
static void test_failures(void) {
    mrl_httpc_config cfg;
    mrl_httpc_config_default(&cfg);
    cfg.max_response_bytes = 1 << 20;
    mrl_httpc *c;
    CHECK_OK(mrl_httpc_open(&cfg, &c));
    mrl_httpc_response r;
    int64_t id;

    CHECK_OK(mrl_httpc_request(c, "127.0.0.1", closed_port(), "GET", "/", NULL, NULL, 0, 5, &id));
    if (wait_response(c, NULL, &r, 5)) CHECK(r.id == id && r.status == 0 && r.error && strcmp(r.error, "connection refused") == 0);

    /* a server that takes the connection and never answers: the deadline */
    raw s = {.fd = -1};
    int port;
    s.lfd = listen_raw(&port);
    double t0 = mrl_time_now();
    CHECK_OK(mrl_httpc_request(c, "127.0.0.1", port, "GET", "/", NULL, NULL, 0, 0.3, &id));
    if (wait_response(c, NULL, &r, 5)) {
        double took = mrl_time_now() - t0;
        CHECK(r.id == id && r.status == 0 && r.error && strcmp(r.error, "timed out") == 0);
        CHECK(took > 0.25 && took < 2 && r.seconds > 0.25 && r.seconds < 2);
    }
    raw_accept(&s);
    raw_close(&s); /* (the client closed it) */

    struct { const char *reply; int close_after; const char *error; } cases[] = {
        {"", 1, "connection closed before the response"},
        {"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc", 1, "connection closed mid-response"},
        {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", 1, "connection closed mid-response"},
        {"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n", 0, "response too large"},
        {"HTTP/1.1 200 OK\r\nContent-Length: 1048577\r\n\r\n", 0, "response too large"},
        {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\n", 0, "response too large"},
        {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100001\r\n", 0, "response too large"},
        {"FOO BAR\r\n\r\n", 0, "malformed response: bad status line"},
        {"HTTP/1.1 2x0 OK\r\n\r\n", 0, "malformed response: bad status line"},
        {"HTTP/2 200\r\n\r\n", 0, "malformed response: bad status line"},
        {"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", 0, "malformed response: bad header line"},
        {"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 0, "malformed response: conflicting"},
        {"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", 0, "malformed response: bad Content-Length"},
        {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 0, "malformed response: bad chunk size"},
        {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", 0, "malformed response: chunk not followed"},
        {"HTTP/1.1 101 Switching Protocols\r\n\r\n", 0, "malformed response: unexpected 101"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        if (exchange(c, &s, port, cases[i].reply, strlen(cases[i].reply), 0, cases[i].close_after, 5, &r)) {
            CHECK(r.status == 0 && r.error && strncmp(r.error, cases[i].error, strlen(cases[i].error)) == 0);
            CHECK(r.body_len == 0);
            if (!r.error || strncmp(r.error, cases[i].error, strlen(cases[i].error)) != 0)
                fprintf(stderr, "case %zu: got '%s'\n", i, r.error ? r.error : "(null)");
        }
        raw_close(&s);
    }

    /* bodies past the limit as they come: close-delimited, and a chunk stream of small chunks */
    size_t big = (1 << 20) + 4096;
    char *reply = malloc(2 * big + 64);
    int hl = snprintf(reply, 64, "HTTP/1.0 200 OK\r\n\r\n");
    memset(reply + hl, 'x', big);
    if (exchange(c, &s, port, reply, (size_t)hl + big, 0, 1, 5, &r)) CHECK(r.status == 0 && r.error && strcmp(r.error, "response too large") == 0);
    raw_close(&s);
    size_t o = (size_t)snprintf(reply, 64, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
    for (size_t data = 0; data < big; data += 8) o += (size_t)snprintf(reply + o, 64, "8\r\n12345678\r\n");
    if (exchange(c, &s, port, reply, o, 0, 0, 5, &r)) CHECK(r.status == 0 && r.error && strcmp(r.error, "response too large") == 0);
    raw_close(&s);
    /* a head that never ends: cut at 64 KiB */
    o = (size_t)snprintf(reply, 64, "HTTP/1.1 200 OK\r\nX-Long: ");
    memset(reply + o, 'a', 70000);
    if (exchange(c, &s, port, reply, o + 70000, 0, 0, 5, &r)) CHECK(r.status == 0 && r.error && strcmp(r.error, "response head too large") == 0);
    raw_close(&s);
    free(reply);

    mrl_httpc_stats st;
    mrl_httpc_get_stats(c, &st);
    CHECK(st.timed_out_total == 1 && st.retried_total == 0 && st.connections_open == 0 && st.pending == 0);
    close(s.lfd);

    /* a name that does not resolve */
    CHECK_OK(mrl_httpc_request(c, "no-such-host.invalid", 80, "GET", "/", NULL, NULL, 0, 10, &id));
    if (wait_response(c, NULL, &r, 10)) {
        CHECK(r.id == id && r.status == 0);
        CHECK_STR_CONTAINS(r.error, "cannot resolve host 'no-such-host.invalid'");
    }
    mrl_httpc_close(c);
}

/* Cancel: a queued request and one on its connection; no response comes for either, the server
 * learns that its client left, and the pool goes on. A queued request's deadline. */
static void test_cancel(void) {
    mrl_http *srv;
    CHECK_OK(mrl_http_open("127.0.0.1", 0, NULL, &srv));
    int port = mrl_http_port(srv);
    mrl_httpc_config cfg;
    mrl_httpc_config_default(&cfg);
    cfg.max_connections_per_host = 1;
    mrl_httpc *c;
    CHECK_OK(mrl_httpc_open(&cfg, &c));
    n_held = 0;
    int64_t a, b, d;
    CHECK_OK(mrl_httpc_request(c, "127.0.0.1", port, "GET", "/hold", NULL, NULL, 0, 0, &a));
    CHECK_OK(mrl_httpc_request(c, "127.0.0.1", port, "GET", "/echo", NULL, NULL, 0, 0, &b)); /* waits for the one connection */
    CHECK_OK(mrl_httpc_request(c, "127.0.0.1", port, "GET", "/echo", NULL, NULL, 0, 0.2, &d)); /* its deadline passes in the queue */
    mrl_httpc_response r;
    int got = 0;
    double end = mrl_time_now() + 5;
    while (n_held == 0 && mrl_time_now() < end) {
        serve(srv);
        CHECK_OK(mrl_httpc_poll(c, 1, &r, &got));
        CHECK(!got);
    }
    CHECK(n_held == 1);
    mrl_httpc_cancel(c, b);
    CHECK(mrl_httpc_pending(c) == 2);
    if (wait_response(c, srv, &r, 5)) CHECK(r.id == d && r.status == 0 && strcmp(r.error, "timed out") == 0);
    mrl_httpc_cancel(c, a);
    mrl_httpc_cancel(c, a);      /* twice: ignored */
    mrl_httpc_cancel(c, 123456); /* never was: ignored */
    CHECK(mrl_httpc_pending(c) == 0);
    int64_t gone[4];
    int n = 0;
    end = mrl_time_now() + 5;
    while (n == 0 && mrl_time_now() < end) {
        serve(srv);
        CHECK_OK(mrl_httpc_poll(c, 1, &r, &got));
        CHECK(!got);
        n = mrl_http_take_gone(srv, gone, 4);
    }
    CHECK(n == 1 && gone[0] == held[0]);
    /* the pool goes on, on a new connection */
    if (fetch(c, srv, "127.0.0.1", port, "GET", "/echo", NULL, NULL, &r)) CHECK(r.status == 200);
    mrl_httpc_stats st;
    mrl_httpc_get_stats(c, &st);
    CHECK(st.connections_total == 2 && st.connections_open == 1 && st.pending == 0 && st.timed_out_total == 1);
    /* close with requests in flight (one on a connection, one queued) and one done, not polled */
    CHECK_OK(mrl_httpc_request(c, "127.0.0.1", port, "GET", "/hold", NULL, NULL, 0, 0, &a));
    CHECK_OK(mrl_httpc_request(c, "127.0.0.1", port, "GET", "/echo", NULL, NULL, 0, 0, &b));
    CHECK_OK(mrl_httpc_request(c, "127.0.0.1", closed_port(), "GET", "/", NULL, NULL, 0, 0, &d));
    for (int i = 0; i < 20; i++) {
        serve(srv);
        CHECK_OK(mrl_httpc_poll(c, 1, &r, &got));
        if (got) CHECK(r.id == d && strcmp(r.error, "connection refused") == 0);
    }
    CHECK_OK(mrl_httpc_request(c, "127.0.0.1", closed_port(), "GET", "/", NULL, NULL, 0, 0, &d));
    mrl_httpc_close(c);
    mrl_http_close(srv, 100);
}

static void test_bad_arguments(void) {
    mrl_httpc *c = NULL;
    mrl_httpc_config cfg;
    mrl_httpc_config_default(&cfg);
    cfg.max_connections_per_host = -1;
    CHECK(mrl_httpc_open(&cfg, &c) != MRL_OK && c == NULL);
    mrl_httpc_config_default(&cfg);
    cfg.connect_timeout_s = -1;
    CHECK(mrl_httpc_open(&cfg, &c) != MRL_OK);
    memset(&cfg, 0, sizeof cfg); /* zeros: the defaults */
    CHECK_OK(mrl_httpc_open(&cfg, &c));
    int64_t id = 7;
    CHECK(mrl_httpc_request(c, "127.0.0.1", 0, "GET", "/", NULL, NULL, 0, 0, &id) != MRL_OK && id == 0);
    CHECK_STR_CONTAINS(mrl_last_error(), "port 0");
    CHECK(mrl_httpc_request(c, "127.0.0.1", 70000, "GET", "/", NULL, NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, NULL, 80, "GET", "/", NULL, NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "", 80, "GET", "/", NULL, NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "a b", 80, "GET", "/", NULL, NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "h\r\nX: y", 80, "GET", "/", NULL, NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "127.0.0.1", 80, "G T", "/", NULL, NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "127.0.0.1", 80, "GET", "x", NULL, NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "127.0.0.1", 80, "GET", "/a b", NULL, NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "127.0.0.1", 80, "GET", "/", "X: y", NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "127.0.0.1", 80, "GET", "/", "X: y\r\nZ\r\n", NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "127.0.0.1", 80, "GET", "/", "X: a\nb\r\n", NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "127.0.0.1", 80, "GET", "/", "host: x\r\n", NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "127.0.0.1", 80, "GET", "/", "Content-Length: 3\r\n", NULL, 0, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "127.0.0.1", 80, "POST", "/", NULL, NULL, 3, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "127.0.0.1", 80, "POST", "/", NULL, "x", -1, 0, &id) != MRL_OK);
    CHECK(mrl_httpc_request(c, "127.0.0.1", 80, "GET", "/", NULL, NULL, 0, -1, &id) != MRL_OK);
    CHECK(mrl_httpc_pending(c) == 0);
    mrl_httpc_response r;
    int got;
    CHECK(mrl_httpc_poll(NULL, 0, &r, &got) != MRL_OK);
    CHECK(mrl_httpc_poll(c, 0, NULL, &got) != MRL_OK);
    CHECK_OK(mrl_httpc_poll(c, 0, &r, &got));
    CHECK(got == 0);
    mrl_httpc_cancel(NULL, 1);
    CHECK(mrl_httpc_pending(NULL) == 0);
    mrl_httpc_close(c);
    mrl_httpc_close(NULL);
}

int main(void) {
    if (mrl_init() != MRL_OK) return 1;
    test_round_trips();
    test_pool();
    test_keep_alive_race();
    test_framing();
    test_failures();
    test_cancel();
    test_bad_arguments();
    mrl_shutdown();
    CHECK_DONE();
}
