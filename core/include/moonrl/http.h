/* A small HTTP/1.1 server on libuv for `moonrl serve`, driven by polling.
 *
 * The caller (a Lua loop that also steps the generation engine) owns the
 * thread: every libuv callback runs inside mrl_http_poll, so nothing here
 * ever calls back into Lua, and no lock is needed.
 *
 *     mrl_http_config cfg; mrl_http_config_default(&cfg);
 *     mrl_http_open("127.0.0.1", 8000, &cfg, &srv);   port 0: any free port (mrl_http_port)
 *     loop:
 *       mrl_http_poll(srv, busy ? 0 : 50, &req, &got);  the next complete request, if any
 *       mrl_http_respond(srv, req.id, 200, "application/json", body, len);
 *       or mrl_http_stream_begin / _write ... / _end   (chunked transfer: SSE)
 *       mrl_http_take_gone(srv, ids, 64);              requests whose client went away
 *     mrl_http_close(srv);
 *
 * What it handles by itself: Content-Length bodies (a request with another
 * transfer encoding gets 411), `Expect: 100-continue`, keep-alive (HTTP/1.1's
 * default; "Connection: close" and HTTP/1.0 close after the response),
 * pipelined requests (answered one after the other), a client that
 * half-closes after its request (answered, then closed), and the limits: a
 * head over max_header_bytes gets 431, a body over max_body_bytes 413, a
 * malformed head (a control character in a header value included) 400; each
 * of those closes the connection.
 *
 * Time: a connection waiting for its next request is closed after
 * idle_timeout_s of silence; a request's head must be in within
 * header_timeout_s of its first byte (of the accept, for a connection's
 * first request) and its body within body_timeout_s of its head, else 408.
 * A byte received resets none of these, so a client trickling bytes holds
 * its connection no longer than they allow. A complete request must be
 * answered within request_timeout_s: past it the server answers 503 itself
 * (or, for a response that has begun, closes the connection) and reports the
 * id through mrl_http_take_gone, so no request waits forever.
 *
 * Connections: past max_connections, a new one takes the place of one
 * without a complete request: a finished one draining first, then the
 * longest idle (for a second at least), then the partial request begun
 * first, which gets a 503. Connections trickling a head cannot lock new
 * clients out. Only when every other connection has a request in progress,
 * a response going out, or has just been accepted does the new one get a
 * 503.
 *
 * A client's EOF while its request is open is taken as a half-close: the
 * request is answered. A client that closed entirely is found out by a
 * stream's next write, or, for an HTTP/1.1 request not yet answered, by the
 * "100 Continue" interim response (which HTTP/1.1 clients skip) sent at the
 * EOF, which a closed socket refuses; its request is then gone.
 *
 * Error bodies are OpenAI-style JSON: {"error": {"message", "type", "param",
 * "code"}}. SIGPIPE is ignored from mrl_http_open on (a write to a closed
 * socket is an error of that connection, not the end of the process). */
#pragma once
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_http mrl_http;

typedef struct mrl_http_config {
    int64_t max_body_bytes;   /* default 16 MiB */
    int max_header_bytes;     /* request line and headers; default 64 KiB */
    int max_connections;      /* open at once, in 1..65535; default 1024 */
    double idle_timeout_s;    /* a connection with no request under way is closed after this; default 30 */
    int64_t max_write_queue;  /* bytes queued to one slow client before it is dropped; default 64 MiB */
    double header_timeout_s;  /* a request's whole head, from its first byte (or the accept); default 60 */
    double body_timeout_s;    /* a request's whole body, from its head; default 60 */
    double request_timeout_s; /* from a request complete to its response's end; default 600 */
} mrl_http_config;

/* One complete request, as mrl_http_poll hands it over. The strings are
 * NUL-terminated and stay valid until the next mrl_http_poll or close. */
typedef struct mrl_http_request {
    int64_t id;               /* unique for the server's life; what respond / stream take */
    const char *method;       /* "GET", "POST", ... */
    const char *path;         /* the target up to '?' */
    const char *query;        /* after '?' ("" when none) */
    const char *body;         /* body_len bytes (+ a NUL) */
    int64_t body_len;
    const char *content_type; /* "" when absent */
    const char *authorization;/* "" when absent */
} mrl_http_request;

typedef struct mrl_http_stats {
    int64_t connections_total;  /* accepted */
    int64_t requests_total;     /* handed to the caller */
    int64_t rejected_total;     /* answered with a 4xx/5xx by the server itself (limits, malformed) */
    int64_t gone_total;         /* handed-over requests whose client went away (or that timed out) before the end */
    int connections_open;
    int in_flight;              /* handed over, not finished */
    int64_t timed_out_total;    /* requests ended at a deadline: head or body late (408), not answered in time */
    int64_t evicted_total;      /* connections closed to make room for a new one */
} mrl_http_stats;

void mrl_http_config_default(mrl_http_config *cfg);
/* Listen on host (a numeric IPv4/IPv6 address or a name: its first
 * address) and port (0: a free one). Fails with a clear message when the
 * address is taken or the host cannot be resolved. cfg may be NULL. */
mrl_status mrl_http_open(const char *host, int port, const mrl_http_config *cfg, mrl_http **out);
/* The port actually bound. */
int mrl_http_port(const mrl_http *srv);
/* Do the pending I/O — waiting up to timeout_ms (0: none) when nothing is
 * ready — and hand over the next complete request: *got = 1 and *req
 * filled, or *got = 0. Call again with 0 to drain what else is ready. */
mrl_status mrl_http_poll(mrl_http *srv, int timeout_ms, mrl_http_request *req, int *got);
/* The whole response to a handed-over request (the connection then reads
 * the next one, or closes). MRL_ERR_INVALID for an unknown, gone or
 * already answered id (the caller may ignore it: a client that left). */
mrl_status mrl_http_respond(mrl_http *srv, int64_t id, int status, const char *content_type, const char *body,
                            int64_t len);
/* A streamed response: the head (chunked transfer encoding on HTTP/1.1, a
 * close-delimited body on HTTP/1.0), any number of writes (each sent at
 * once, as one chunk; empty writes are skipped), and the end. */
mrl_status mrl_http_stream_begin(mrl_http *srv, int64_t id, int status, const char *content_type);
mrl_status mrl_http_stream_write(mrl_http *srv, int64_t id, const char *data, int64_t len);
mrl_status mrl_http_stream_end(mrl_http *srv, int64_t id);
/* Ids of handed-over, unfinished requests whose connection closed, or that
 * passed request_timeout_s, since the last call (up to max of them into
 * ids); returns how many. */
int mrl_http_take_gone(mrl_http *srv, int64_t *ids, int max);
void mrl_http_get_stats(const mrl_http *srv, mrl_http_stats *out);
/* Stop accepting connections (those open are served on); for a graceful
 * shutdown. */
void mrl_http_stop_listening(mrl_http *srv);
/* Flush what is queued (waiting up to flush_ms), close every connection
 * and free the server. NULL is ignored. */
void mrl_http_close(mrl_http *srv, int flush_ms);

#ifdef __cplusplus
}
#endif
