/* core/serve/http.c: the request head (request line, headers, the
 * Content-Length / Transfer-Encoding / Expect / Connection rules, the
 * limits), bodies and pipelined requests, as `moonrl serve` reads them
 * from a socket. Input: the bytes a client sends on one connection, in
 * pieces whose size depends on the input's length (so a head also arrives
 * split); the client then closes its side and reads until the server
 * closes (or leaves, when the target left a request unanswered).
 * Properties: every request handed over has a method, a path starting with
 * '/', NUL-terminated strings and a body within the limit; the server
 * answers and closes the connection in bounded time. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include "fuzz.h"
#include "moonrl/http.h"

enum { MAX_HEADER = 4096, MAX_BODY = 16384 };

static mrl_http *srv;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Hands over the requests ready; returns how many it left unanswered. */
static int serve(void) {
    mrl_http_request req;
    int got = 1, left = 0;
    while (got) {
        FUZZ_ASSERT(mrl_http_poll(srv, 0, &req, &got) == MRL_OK);
        if (!got) break;
        FUZZ_ASSERT(req.method[0] && req.path[0] == '/');
        FUZZ_ASSERT(req.body_len >= 0 && req.body_len <= MAX_BODY && req.body[req.body_len] == 0);
        FUZZ_ASSERT(strlen(req.query) < MAX_HEADER && strlen(req.content_type) < MAX_HEADER &&
                    strlen(req.authorization) < MAX_HEADER);
        /* answer each way the server can: whole, streamed, or not at all (the client leaves) */
        if (req.body_len % 3 == 0) {
            mrl_http_respond(srv, req.id, 200, "text/plain", "ok", 2);
        } else if (req.body_len % 3 == 1) {
            mrl_http_stream_begin(srv, req.id, 200, "text/event-stream");
            mrl_http_stream_write(srv, req.id, "data: x\n\n", 9);
            mrl_http_stream_end(srv, req.id);
        } else {
            left++;
        }
    }
    int64_t gone[64];
    mrl_http_take_gone(srv, gone, 64);
    return left;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!srv) {
        mrl_http_config cfg;
        mrl_http_config_default(&cfg);
        cfg.max_header_bytes = MAX_HEADER;
        cfg.max_body_bytes = MAX_BODY;
        cfg.idle_timeout_s = 5;
        FUZZ_ASSERT(mrl_http_open("127.0.0.1", 0, &cfg, &srv) == MRL_OK);
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    FUZZ_ASSERT(fd >= 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)mrl_http_port(srv))};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    FUZZ_ASSERT(connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0);
    fcntl(fd, F_SETFL, O_NONBLOCK);
    size_t piece = size % 3 == 0 ? size + 1 : size % 3 == 1 ? 13 : 200, sent = 0;
    int shut = 0, quiet = 0, unanswered = 0;
    char buf[65536];
    double t0 = now();
    for (;;) {
        if (sent < size) {
            size_t n = size - sent < piece ? size - sent : piece;
            ssize_t w = send(fd, data + sent, n, MSG_NOSIGNAL);
            if (w > 0) sent += (size_t)w;
            else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) sent = size; /* the server closed */
        }
        unanswered += serve();
        ssize_t r = read(fd, buf, sizeof buf);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) break; /* the server closed */
        quiet = r > 0 ? 0 : quiet + 1;
        /* all sent and nothing more coming back: the client closes its side */
        if (sent == size && !shut && quiet > 3) {
            shutdown(fd, SHUT_WR);
            shut = 1;
        } else if (shut && unanswered && quiet > 6) {
            break; /* a request left unanswered: the server answers a half-closed client's requests in
                    * order, so the answers never end; the client leaves, as one that gave up would */
        }
        FUZZ_ASSERT(now() - t0 < 10); /* the server never closed the connection */
    }
    close(fd);
    serve();
    return 0;
}
