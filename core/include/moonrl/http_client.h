/* A small HTTP/1.1 client on libuv, driven by polling: many requests in
 * flight to a few servers (vLLM, SGLang, `moonrl serve`), their answers
 * taken from one thread, as the server (moonrl/http.h) is.
 *
 *     mrl_httpc_config cfg; mrl_httpc_config_default(&cfg);
 *     mrl_httpc_open(&cfg, &c);
 *     mrl_httpc_request(c, "127.0.0.1", 8000, "POST", "/v1/completions", NULL, body, len, 60, &id);
 *     loop:
 *       mrl_httpc_poll(c, 50, &resp, &got);   a finished request, if any (in any order)
 *     mrl_httpc_close(c);
 *
 * Every libuv callback runs inside mrl_httpc_poll (and close), on the
 * caller's thread: nothing is called back, nothing is locked.
 *
 * Connections: a keep-alive pool per (host, port), at most
 * max_connections_per_host open at once; requests past it wait, in order,
 * for one to free. A request that fails on a reused connection before any
 * byte of its response came (the server closed it while it sat idle: the
 * keep-alive race) is sent once more on a fresh connection; any other
 * failure is reported as it is.
 *
 * Responses: Content-Length, chunked, or (HTTP/1.0, or no length) read to
 * the connection's end; interim 1xx responses are skipped. A malformed,
 * oversized (head past 64 KiB, body past max_response_bytes) or cut-short
 * response fails its request (status 0, error set) and closes its
 * connection; nothing a server sends can crash, hang or grow memory past
 * those bounds.
 *
 * Names: an IPv4 or IPv6 literal is used as it is; a name is resolved once
 * per host (in libuv's thread pool; an IPv4 address is preferred), the
 * result kept for the client's life (a failed resolution is tried again by
 * the next request). Plain HTTP only: no TLS, no proxies, no redirects.
 * SIGPIPE is ignored from mrl_httpc_open on. */
#pragma once
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_httpc mrl_httpc;

typedef struct mrl_httpc_config {
    int max_connections_per_host; /* open at once to one (host, port); 0: 64 */
    double connect_timeout_s;     /* a connection not made by then fails its request; 0: none; default 10 */
    int64_t max_response_bytes;   /* a response body past this fails its request; 0: 256 MiB */
} mrl_httpc_config;

/* A finished request, as mrl_httpc_poll hands it over. The strings stay
 * valid until the next mrl_httpc_poll or close. */
typedef struct mrl_httpc_response {
    int64_t id;           /* what mrl_httpc_request gave */
    int status;           /* the HTTP status; 0 for a transport failure (error says which) */
    const char *body;     /* body_len bytes (+ a NUL); "" for a failure */
    int64_t body_len;
    const char *error;    /* NULL, or the failure: "connection refused", "timed out", "response too large", ... */
    double seconds;       /* from mrl_httpc_request to the end */
} mrl_httpc_response;

typedef struct mrl_httpc_stats {
    int64_t requests_total;    /* queued by mrl_httpc_request */
    int64_t connections_total; /* opened (a connection reused is counted once) */
    int64_t retried_total;     /* sent again after a reused connection failed before any response byte */
    int64_t failed_total;      /* ended with a transport failure (timed out included) */
    int64_t timed_out_total;   /* past their timeout_s, or their connection's connect_timeout_s */
    int connections_open;
    int pending;               /* as mrl_httpc_pending */
} mrl_httpc_stats;

void mrl_httpc_config_default(mrl_httpc_config *cfg);
/* cfg may be NULL (the defaults). */
mrl_status mrl_httpc_open(const mrl_httpc_config *cfg, mrl_httpc **out);
/* Queue a request; *id (> 0) names it. host: a name or an IPv4/IPv6
 * literal; method: NULL for GET; path: the target, starting with '/';
 * headers: extra header lines, each "Name: value\r\n" (NULL: none; not Host,
 * Content-Length, Transfer-Encoding or Connection, which the client sends);
 * body: body_len bytes, NULL when none. A request with a body (or a POST,
 * PUT or PATCH) gets Content-Length, and Content-Type: application/json
 * unless headers name one. timeout_s: the whole request's deadline
 * (waiting for a connection, connecting, sending, the response); 0: none.
 * Fails (MRL_ERR_INVALID) only on bad arguments: every failure of the
 * request itself comes as its response. */
mrl_status mrl_httpc_request(mrl_httpc *c, const char *host, int port, const char *method, const char *path,
                             const char *headers, const char *body, int64_t body_len, double timeout_s,
                             int64_t *id);
/* Do the pending I/O, waiting up to timeout_ms (0: not at all) for a
 * request to finish, and hand over the next finished one: *got = 1 and
 * *resp filled, or *got = 0. Call again with 0 to drain what else is done. */
mrl_status mrl_httpc_poll(mrl_httpc *c, int timeout_ms, mrl_httpc_response *resp, int *got);
/* Forget a request: its connection (if it has one) is closed, and no
 * response for it will come. An unknown or handed-over id is ignored. */
void mrl_httpc_cancel(mrl_httpc *c, int64_t id);
/* Requests queued whose response has not been handed over yet. */
int mrl_httpc_pending(const mrl_httpc *c);
void mrl_httpc_get_stats(const mrl_httpc *c, mrl_httpc_stats *out);
/* Close every connection, drop the pending requests and free the client.
 * NULL is ignored. */
void mrl_httpc_close(mrl_httpc *c);

#ifdef __cplusplus
}
#endif
