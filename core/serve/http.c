/* A small HTTP/1.1 server on a libuv loop of its own, run only from
 * mrl_http_poll on the caller's thread (see moonrl/http.h).
 *
 * Each connection is a slot of a fixed table; a request's id is
 * (serial << 16) | slot, so the caller's id finds its connection in O(1)
 * and an id whose connection has gone (or moved on to the next request)
 * never matches again. A connection goes through
 *   READ    bytes arrive, the head then the body are parsed
 *   READY   a complete request waits in the ready ring for mrl_http_poll
 *   HANDED  the caller has it; more bytes are only buffered (pipelining)
 *   STREAM  the caller is streaming the response
 *   DRAIN   a last response was sent and the write side shut down: what the
 *           client still sends is read and dropped (closing with unread
 *           bytes would reset the connection and could destroy the response
 *           before the client reads it), until its EOF or a deadline
 * and back to READ after a response on a keep-alive connection.
 *
 * Deadlines (on_tick, every TICK_MS): in READ, idle_timeout_s from the last
 * response (or the accept) while nothing of a request has come,
 * header_timeout_s from a request's first byte (or the accept) to its whole
 * head, body_timeout_s from the head to the whole body; in READY, HANDED and
 * STREAM, request_timeout_s from the request complete to its response's
 * end. Bytes received move none of them. */
#define _GNU_SOURCE
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <uv.h>
#include "moonrl/http.h"
#include "base/error.h"

enum { C_READ, C_READY, C_HANDED, C_STREAM, C_DRAIN };

#define SPARE_SLOTS 64          /* connections past max_connections, kept just long enough for a 503 */
#define DRAIN_SECONDS 2.0
#define READ_CHUNK 65536
#define TICK_MS 100             /* how often the deadlines (and probed clients) are checked */

typedef struct conn {
    uv_tcp_t tcp;
    struct mrl_http *srv;
    int slot;
    int state;
    int closing;                /* uv_close called: no more writes, no lookups */
    int head_done;              /* the head of the request being read is parsed */
    int keep_alive, http10, chunked;
    int64_t req_id;             /* the request in READY / HANDED / STREAM */
    char *in;                   /* bytes received and not consumed */
    size_t in_len, in_cap;
    size_t head_len;            /* when head_done: the head's bytes, CRLFCRLF included */
    int64_t body_len;
    char *parsed;               /* one block: method, path, query, content type, authorization, body */
    size_t off_path, off_query, off_ctype, off_auth, off_body;
    double last_active;         /* seconds (uv_now): the accept, or the last response */
    double req_start;           /* the first byte of the request being read (the accept for the first); 0: none yet */
    double head_at;             /* when head_done: when the head was parsed */
    double ready_at;            /* in READY / HANDED / STREAM: when the request was complete */
    double drain_deadline;
    int peer_eof;               /* the client's EOF came: a request open is answered, then the connection closes */
    int shutting;               /* uv_shutdown requested, not done (the queued bytes are going out) */
    int probed;                 /* the "100 Continue" probe was sent (see probe) */
} conn;

struct mrl_http {
    uv_loop_t loop;
    uv_tcp_t listener;
    uv_timer_t tick;            /* every TICK_MS: the deadlines */
    uv_timer_t wait;            /* bounds one poll's wait */
    mrl_http_config cfg;
    int listening;
    int port;
    conn **slots;
    int n_slots, *free_slots, n_free;
    int64_t serial;
    int64_t *ready;             /* ring of request ids waiting for mrl_http_poll */
    int ready_head, ready_count;
    int64_t *gone;              /* ids for mrl_http_take_gone */
    int n_gone, cap_gone;
    char *cur;                  /* the block of the request last handed over */
    char read_buf[READ_CHUNK];
    mrl_http_stats stats;
};

static double now_s(mrl_http *srv) { return (double)uv_now(&srv->loop) * 1e-3; }

static const char *reason_phrase(int status) {
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 201: return "Created";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Payload Too Large";
    case 422: return "Unprocessable Entity";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return status < 300 ? "OK" : status < 500 ? "Bad Request" : "Internal Server Error";
    }
}

/* ------------------------------------------------------------ closing */

static void push_gone(mrl_http *srv, int64_t id) {
    if (srv->n_gone == srv->cap_gone) {
        int cap = srv->cap_gone ? 2 * srv->cap_gone : 64;
        int64_t *g = realloc(srv->gone, (size_t)cap * sizeof *g);
        if (!g) return; /* out of memory: the caller then only learns from a failed respond */
        srv->gone = g;
        srv->cap_gone = cap;
    }
    srv->gone[srv->n_gone++] = id;
}

static void on_conn_closed(uv_handle_t *h) {
    conn *c = h->data;
    free(c->in);
    free(c->parsed);
    free(c);
}

static void close_conn(conn *c) {
    if (c->closing) return;
    mrl_http *srv = c->srv;
    c->closing = 1;
    if (c->state == C_HANDED || c->state == C_STREAM) {
        push_gone(srv, c->req_id);
        srv->stats.in_flight--;
        srv->stats.gone_total++;
    }
    /* free the slot now: lookups of its ids fail from here on (a READY id in the ring is skipped) */
    srv->slots[c->slot] = NULL;
    srv->free_slots[srv->n_free++] = c->slot;
    srv->stats.connections_open--;
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
}

/* ------------------------------------------------------------ writing */

typedef struct write_req {
    uv_write_t req;
    size_t len;
    char data[];
} write_req;

static void on_written(uv_write_t *w, int status) {
    conn *c = w->handle->data;
    free(w);
    if (status < 0 && !c->closing) close_conn(c); /* the client went away */
}

/* Queue parts[0..n) as one write; the bytes are copied. A connection that
 * cannot take it (an error, or a client so slow that max_write_queue is
 * queued already) is closed: 0 then, else 1. */
static int send_parts(conn *c, const uv_buf_t *parts, int n) {
    if (c->closing) return 0;
    if ((int64_t)uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) > c->srv->cfg.max_write_queue) {
        close_conn(c);
        return 0;
    }
    size_t total = 0;
    for (int i = 0; i < n; i++) total += parts[i].len;
    write_req *w = malloc(sizeof *w + total);
    if (!w) {
        close_conn(c);
        return 0;
    }
    w->len = 0;
    for (int i = 0; i < n; i++) {
        if (parts[i].len) memcpy(w->data + w->len, parts[i].base, parts[i].len);
        w->len += parts[i].len;
    }
    uv_buf_t buf = uv_buf_init(w->data, (unsigned)w->len);
    if (uv_write(&w->req, (uv_stream_t *)&c->tcp, &buf, 1, on_written) != 0) {
        free(w);
        close_conn(c);
        return 0;
    }
    return 1;
}

static int send_bytes(conn *c, const char *a, size_t alen, const char *b, size_t blen) {
    uv_buf_t parts[2] = {uv_buf_init((char *)a, (unsigned)alen), uv_buf_init((char *)b, (unsigned)blen)};
    return send_parts(c, parts, 2);
}

static void on_shutdown(uv_shutdown_t *r, int status) {
    conn *c = r->handle->data;
    free(r);
    c->shutting = 0;
    if (c->closing) return;
    if (status < 0 || c->peer_eof) close_conn(c); /* the client's EOF came already: nothing to drain */
    else c->drain_deadline = now_s(c->srv) + DRAIN_SECONDS;
}

/* After the last response: shut the write side down once the queued bytes
 * are out, then drain (see the top of the file). */
static void finish_conn(conn *c) {
    if (c->closing) return;
    c->state = C_DRAIN;
    c->drain_deadline = now_s(c->srv) + DRAIN_SECONDS + 30; /* on_shutdown sets the real one */
    uv_shutdown_t *r = malloc(sizeof *r);
    if (!r || uv_shutdown(r, (uv_stream_t *)&c->tcp, on_shutdown) != 0) {
        free(r);
        close_conn(c);
        return;
    }
    c->shutting = 1;
}

/* The head of a response. */
static int format_head(conn *c, char *out, size_t cap, int status, const char *ctype, int64_t len, int stream) {
    const char *conn_hdr = c->keep_alive ? "keep-alive" : "close";
    if (stream && c->chunked)
        return snprintf(out, cap,
                        "HTTP/1.1 %d %s\r\nServer: moonrl\r\nContent-Type: %s\r\nCache-Control: no-cache\r\n"
                        "Transfer-Encoding: chunked\r\nConnection: %s\r\n\r\n",
                        status, reason_phrase(status), ctype, conn_hdr);
    if (stream) /* HTTP/1.0: the body ends when the connection does */
        return snprintf(out, cap, "HTTP/1.%d %d %s\r\nServer: moonrl\r\nContent-Type: %s\r\nCache-Control: no-cache\r\n"
                                  "Connection: close\r\n\r\n",
                        c->http10 ? 0 : 1, status, reason_phrase(status), ctype);
    return snprintf(out, cap, "HTTP/1.%d %d %s\r\nServer: moonrl\r\nContent-Type: %s\r\nContent-Length: %lld\r\n"
                              "Connection: %s\r\n\r\n",
                    c->http10 ? 0 : 1, status, reason_phrase(status), ctype, (long long)len, conn_hdr);
}

/* An error response that ends the connection: queued, 1; 0 when the connection closed instead. */
static int send_error(conn *c, int status, const char *message) {
    char body[512], head[512];
    const char *type = status == 404   ? "NotFoundError"
                       : status == 503 ? "ServiceUnavailable"
                       : status >= 500 ? "InternalServerError"
                                       : "BadRequestError";
    int blen = snprintf(body, sizeof body, "{\"error\": {\"message\": \"%s\", \"type\": \"%s\", \"param\": null, \"code\": %d}}",
                        message, type, status);
    c->keep_alive = 0;
    int hlen = format_head(c, head, sizeof head, status, "application/json", blen, 0);
    return send_bytes(c, head, (size_t)hlen, body, (size_t)blen);
}

/* An error the server answers by itself; the connection then closes. */
static void reject(conn *c, int status, const char *message) {
    c->srv->stats.rejected_total++;
    if (send_error(c, status, message)) finish_conn(c);
}

/* ------------------------------------------------------------ parsing */

static int is_tchar(int ch) {
    /* ch != 0: strchr finds a NUL byte too (the string's end) */
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           (ch != 0 && strchr("!#$%&'*+-.^_`|~", ch));
}

/* The text of a header's value, trimmed, as a NUL-terminated copy into dst. */
static void copy_value(char *dst, size_t cap, const char *v, size_t n) {
    while (n && (*v == ' ' || *v == '\t')) v++, n--;
    while (n && (v[n - 1] == ' ' || v[n - 1] == '\t')) n--;
    if (n >= cap) n = cap - 1;
    memcpy(dst, v, n);
    dst[n] = 0;
}

static int has_token(const char *list, const char *token) {
    size_t n = strlen(token);
    for (const char *p = list; *p;) {
        while (*p == ' ' || *p == ',' || *p == '\t') p++;
        const char *e = p;
        while (*e && *e != ',') e++;
        const char *t = e;
        while (t > p && (t[-1] == ' ' || t[-1] == '\t')) t--;
        if ((size_t)(t - p) == n && strncasecmp(p, token, n) == 0) return 1;
        p = e;
    }
    return 0;
}

/* Parse the head in c->in[0 .. head_len): the request line and the headers
 * we act on. 0 when fine, else the status to reject with (*why says why). */
static int parse_head(conn *c, const char **why) {
    mrl_http *srv = c->srv;
    const char *p = c->in, *end = c->in + c->head_len - 2; /* up to the blank line's CRLF */
    const char *eol = memchr(p, '\n', (size_t)(end - p));
    if (!eol) return *why = "malformed request line", 400;
    const char *line_end = eol > p && eol[-1] == '\r' ? eol - 1 : eol;
    /* METHOD SP target SP HTTP/x.y */
    const char *sp1 = memchr(p, ' ', (size_t)(line_end - p));
    if (!sp1 || sp1 == p || sp1 - p > 15) return *why = "malformed request line", 400;
    for (const char *q = p; q < sp1; q++)
        if (!is_tchar((unsigned char)*q)) return *why = "malformed request method", 400;
    const char *target = sp1 + 1;
    const char *sp2 = memchr(target, ' ', (size_t)(line_end - target));
    if (!sp2 || sp2 == target) return *why = "malformed request line", 400;
    const char *version = sp2 + 1;
    size_t vlen = (size_t)(line_end - version);
    if (vlen == 8 && memcmp(version, "HTTP/1.1", 8) == 0) c->http10 = 0;
    else if (vlen == 8 && memcmp(version, "HTTP/1.0", 8) == 0) c->http10 = 1;
    else if (vlen >= 5 && memcmp(version, "HTTP/", 5) == 0) return *why = "only HTTP/1.0 and HTTP/1.1 are served", 505;
    else return *why = "malformed request line", 400;
    if (*target != '/') return *why = "the request target must be a path starting with /", 400;
    for (const char *q = target; q < sp2; q++)
        if ((unsigned char)*q <= ' ' || *q == 0x7f) return *why = "malformed request target", 400;
    c->keep_alive = !c->http10;

    char ctype[256] = "", auth[1024] = "", value[256];
    int64_t clen = -1;
    int expect_continue = 0;
    for (p = eol + 1; p < end;) {
        eol = memchr(p, '\n', (size_t)(end + 2 - p));
        if (!eol) eol = end;
        line_end = eol > p && eol[-1] == '\r' ? eol - 1 : eol;
        const char *colon = memchr(p, ':', (size_t)(line_end - p));
        if (!colon || colon == p) return *why = "malformed header line", 400;
        for (const char *q = p; q < colon; q++)
            if (!is_tchar((unsigned char)*q)) return *why = "malformed header name", 400;
        size_t nlen = (size_t)(colon - p);
        const char *v = colon + 1;
        size_t vn = (size_t)(line_end - v);
        for (size_t k = 0; k < vn; k++) { /* RFC 9110 5.5: no NUL, CR, LF or other control character but HTAB */
            unsigned char ch = (unsigned char)v[k];
            if ((ch < 0x20 && ch != '\t') || ch == 0x7f) return *why = "malformed header value (a control character)", 400;
        }
#define IS(name) (nlen == sizeof(name) - 1 && strncasecmp(p, name, nlen) == 0)
        if (IS("content-length")) {
            copy_value(value, sizeof value, v, vn);
            size_t k = strlen(value);
            if (k == 0 || k > 18 || strspn(value, "0123456789") != k) return *why = "malformed Content-Length", 400;
            int64_t n = strtoll(value, NULL, 10);
            if (clen >= 0 && n != clen) return *why = "conflicting Content-Length headers", 400;
            clen = n;
        } else if (IS("transfer-encoding")) {
            copy_value(value, sizeof value, v, vn);
            if (strcasecmp(value, "identity") != 0)
                return *why = "a request body needs a Content-Length (chunked request bodies are not supported)", 411;
        } else if (IS("connection")) {
            copy_value(value, sizeof value, v, vn);
            if (has_token(value, "close")) c->keep_alive = 0;
            else if (has_token(value, "keep-alive")) c->keep_alive = 1;
        } else if (IS("expect")) {
            copy_value(value, sizeof value, v, vn);
            if (strcasecmp(value, "100-continue") == 0) expect_continue = 1;
            else return *why = "unsupported Expect header", 400;
        } else if (IS("content-type")) {
            copy_value(ctype, sizeof ctype, v, vn);
        } else if (IS("authorization")) {
            copy_value(auth, sizeof auth, v, vn);
        }
#undef IS
        p = eol + 1;
    }
    if (clen < 0) clen = 0;
    if (clen > srv->cfg.max_body_bytes) return *why = "request body too large", 413;
    c->body_len = clen;

    /* one block for the strings the caller reads */
    size_t tlen = (size_t)(sp2 - target), mlen = (size_t)(sp1 - c->in);
    const char *qmark = memchr(target, '?', tlen);
    size_t plen = qmark ? (size_t)(qmark - target) : tlen;
    size_t qlen = qmark ? tlen - plen - 1 : 0;
    size_t clen_s = strlen(ctype), alen = strlen(auth);
    size_t total = mlen + 1 + plen + 1 + qlen + 1 + clen_s + 1 + alen + 1 + (size_t)clen + 1;
    free(c->parsed);
    c->parsed = malloc(total);
    if (!c->parsed) return *why = "out of memory", 503;
    char *b = c->parsed;
    size_t o = 0;
    memcpy(b + o, c->in, mlen), o += mlen, b[o++] = 0;
    c->off_path = o, memcpy(b + o, target, plen), o += plen, b[o++] = 0;
    c->off_query = o;
    if (qlen) memcpy(b + o, qmark + 1, qlen);
    o += qlen, b[o++] = 0;
    c->off_ctype = o, memcpy(b + o, ctype, clen_s), o += clen_s, b[o++] = 0;
    c->off_auth = o, memcpy(b + o, auth, alen), o += alen, b[o++] = 0;
    c->off_body = o;
    b[o + (size_t)clen] = 0;
    if (expect_continue && clen > 0 && c->in_len < c->head_len + (size_t)clen) {
        static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
        send_bytes(c, cont, sizeof cont - 1, NULL, 0);
    }
    return 0;
}

static int is_ready(mrl_http *srv, int64_t id) {
    conn *c = srv->slots[id & 0xffff];
    return c && !c->closing && c->req_id == id && c->state == C_READY;
}

static void ready_push(mrl_http *srv, int64_t id) {
    int cap = srv->n_slots;
    if (srv->ready_count == cap) {
        /* full of ids whose connections left or timed out: keep the live ones (one a connection at
           most, so there is room after) */
        int n = 0;
        for (int k = 0; k < srv->ready_count; k++) {
            int64_t x = srv->ready[(srv->ready_head + k) % cap];
            if (is_ready(srv, x)) srv->ready[(srv->ready_head + n++) % cap] = x;
        }
        srv->ready_count = n;
        if (n == cap) return;
    }
    srv->ready[(srv->ready_head + srv->ready_count) % cap] = id;
    srv->ready_count++;
}

/* Parse what c->in holds, in state READ: at most one request becomes READY. */
static void process(conn *c) {
    mrl_http *srv = c->srv;
    if (c->closing || c->state != C_READ) return;
    if (!c->head_done) {
        /* tolerate blank lines before a request line (RFC 9112 2.2) */
        size_t skip = 0;
        while (skip < c->in_len && (c->in[skip] == '\r' || c->in[skip] == '\n')) skip++;
        if (skip) {
            memmove(c->in, c->in + skip, c->in_len - skip);
            c->in_len -= skip;
        }
        char *e = c->in_len >= 4 ? memmem(c->in, c->in_len, "\r\n\r\n", 4) : NULL;
        size_t limit = (size_t)srv->cfg.max_header_bytes;
        if (!e) {
            if (c->in_len > limit) reject(c, 431, "request head too large");
            return;
        }
        c->head_len = (size_t)(e - c->in) + 4;
        if (c->head_len > limit) {
            reject(c, 431, "request head too large");
            return;
        }
        const char *why = "";
        int bad = parse_head(c, &why);
        if (bad) {
            reject(c, bad, why);
            return;
        }
        c->head_done = 1;
        c->head_at = now_s(srv);
    }
    size_t need = c->head_len + (size_t)c->body_len;
    if (c->in_len < need) return;
    memcpy(c->parsed + c->off_body, c->in + c->head_len, (size_t)c->body_len);
    memmove(c->in, c->in + need, c->in_len - need);
    c->in_len -= need;
    if (c->in_cap > (1u << 20) && c->in_len <= READ_CHUNK) { /* give a large body's buffer back */
        size_t cap = c->in_len > 4096 ? c->in_len : 4096;
        char *p = realloc(c->in, cap);
        if (p) c->in = p, c->in_cap = cap;
    }
    c->head_done = 0;
    c->req_id = (++srv->serial << 16) | c->slot;
    c->state = C_READY;
    c->ready_at = now_s(srv);
    c->req_start = 0;
    ready_push(srv, c->req_id);
}

/* ------------------------------------------------------------ reading */

/* The client's EOF while its request waits or runs: a half-close (to be answered) or a client gone
 * (whose request is to be stopped). An interim "100 Continue", which an HTTP/1.1 client skips (RFC
 * 9110 15.2), tells them apart: a closed socket answers it with a reset, which on_tick finds
 * (peer_closed). Not for HTTP/1.0 (no 1xx), nor once a stream's head is out (its writes tell). */
static void probe(conn *c) {
    static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
    if (c->http10 || c->probed || c->state == C_STREAM) return;
    c->probed = 1;
    send_bytes(c, cont, sizeof cont - 1, NULL, 0);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    conn *c = h->data;
    *buf = uv_buf_init(c->srv->read_buf, READ_CHUNK);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
    conn *c = s->data;
    if (c->closing) return;
    if (nread < 0) {
        if (nread == UV_EOF && (c->state == C_READY || c->state == C_HANDED || c->state == C_STREAM)) {
            /* a half-close after a complete request: it is answered (a client gone entirely is
               found out by the probe, or a stream's next write) */
            c->peer_eof = 1;
            if (c->in_len == 0) c->keep_alive = 0; /* no pipelined bytes: nothing after this response */
            probe(c);
            return;
        }
        if (nread == UV_EOF && c->state == C_READ) { /* nothing (or half a request) to answer: the response */
            c->peer_eof = 1;                        /* queued last goes out first, then the close */
            finish_conn(c);
        } else if (nread == UV_EOF && c->state == C_DRAIN && c->shutting) {
            c->peer_eof = 1; /* on_shutdown closes, once the queued bytes are out */
        } else {
            close_conn(c); /* an error, or EOF while draining */
        }
        return;
    }
    if (nread == 0) return;
    mrl_http *srv = c->srv;
    if (c->state == C_DRAIN) return; /* dropped: see the top of the file */
    if (c->state == C_READ && c->req_start == 0) c->req_start = now_s(srv); /* a request's first byte */
    size_t limit = (size_t)srv->cfg.max_header_bytes + (size_t)srv->cfg.max_body_bytes + READ_CHUNK;
    if (c->in_len + (size_t)nread > limit) {
        /* in READ the limits reject the request before this; past it, a client pipelining too much */
        if (c->state == C_READ && !c->head_done) reject(c, 431, "request head too large");
        else if (c->state == C_READ) reject(c, 413, "request body too large");
        else close_conn(c);
        return;
    }
    if (c->in_len + (size_t)nread > c->in_cap) {
        size_t cap = c->in_cap ? c->in_cap : 4096;
        while (cap < c->in_len + (size_t)nread) cap *= 2;
        char *p = realloc(c->in, cap);
        if (!p) {
            close_conn(c);
            return;
        }
        c->in = p;
        c->in_cap = cap;
    }
    memcpy(c->in + c->in_len, buf->base, (size_t)nread);
    c->in_len += (size_t)nread;
    process(c);
}

static void free_handle(uv_handle_t *h) { free(h); }

/* The connection to close for a new one past max_connections: one draining with its response out,
 * else one that has received nothing of a request for EVICT_IDLE_AFTER seconds at least (the
 * longest idle), else the one whose partial request began first. NULL when every other connection
 * has a complete request, a response going out, or has just been accepted (its bytes may not have
 * been read yet). */
#define EVICT_IDLE_AFTER 1.0
static conn *pick_victim(mrl_http *srv, const conn *except) {
    conn *best = NULL;
    int best_rank = 0;
    double best_t = 0, now = now_s(srv);
    for (int i = 0; i < srv->n_slots; i++) {
        conn *c = srv->slots[i];
        if (!c || c == except || c->closing || c->shutting) continue;
        if (uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) > 0) continue; /* a response going out */
        int rank;
        double t;
        if (c->state == C_DRAIN) rank = 3, t = c->drain_deadline;
        else if (c->state != C_READ) continue;
        else if (c->in_len == 0 && !c->head_done) {
            if (now - c->last_active < EVICT_IDLE_AFTER) continue;
            rank = 2, t = c->last_active;
        } else rank = 1, t = c->req_start;
        if (rank > best_rank || (rank == best_rank && t < best_t)) best = c, best_rank = rank, best_t = t;
    }
    return best;
}

static void evict(conn *c) {
    c->srv->stats.evicted_total++;
    /* a partial request is told why, best effort: the socket closes at once */
    if (c->state == C_READ && (c->in_len > 0 || c->head_done)) send_error(c, 503, "too many connections: this slow one made room");
    close_conn(c);
}

static void on_connection(uv_stream_t *server, int status) {
    mrl_http *srv = server->data;
    if (status < 0) return;
    if (srv->n_free == 0) { /* the spare slots too: make room if some connection can give it */
        conn *v = pick_victim(srv, NULL);
        if (v) evict(v);
    }
    conn *c = calloc(1, sizeof *c);
    if (!c || srv->n_free == 0 || uv_tcp_init(&srv->loop, &c->tcp) != 0) {
        /* no room even for a 503: accept and drop, so that the backlog does not fill */
        free(c);
        uv_tcp_t *t = malloc(sizeof *t);
        if (t && uv_tcp_init(&srv->loop, t) == 0) {
            if (uv_accept(server, (uv_stream_t *)t) == 0) {}
            uv_close((uv_handle_t *)t, free_handle);
        } else {
            free(t);
        }
        return;
    }
    c->tcp.data = c;
    c->srv = srv;
    c->slot = srv->free_slots[--srv->n_free];
    srv->slots[c->slot] = c;
    srv->stats.connections_open++;
    srv->stats.connections_total++;
    c->last_active = c->req_start = now_s(srv);
    c->keep_alive = 1;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) {
        close_conn(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1); /* streamed tokens go out at once */
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) {
        close_conn(c);
        return;
    }
    if (srv->stats.connections_open > srv->cfg.max_connections) {
        conn *v = pick_victim(srv, c);
        if (v) evict(v);
        else reject(c, 503, "too many connections");
    }
}

/* Whether the client's socket is closed: after the probe, the reset of a client that closed entirely. */
static int peer_closed(conn *c) {
    uv_os_fd_t fd;
    if (uv_fileno((const uv_handle_t *)&c->tcp, &fd) != 0) return 0;
#ifdef TCP_INFO
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) == 0) return ti.tcpi_state == TCP_CLOSE;
#endif
    int err = 0;
    socklen_t elen = sizeof err;
    return getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) == 0 && err != 0;
}

static void time_out(conn *c, const char *why) {
    c->srv->stats.timed_out_total++;
    reject(c, 408, why);
}

/* A request past request_timeout_s: 503 when nothing of its response has gone out, else the
 * connection closes (a stream cut short); the caller learns it from mrl_http_take_gone. */
static void expire(conn *c) {
    mrl_http *srv = c->srv;
    srv->stats.timed_out_total++;
    if (c->state == C_STREAM) {
        close_conn(c);
        return;
    }
    if (c->state == C_HANDED) {
        push_gone(srv, c->req_id);
        srv->stats.in_flight--;
        srv->stats.gone_total++;
    }
    c->state = C_READ; /* neither READY (its ring entry is skipped) nor handed (close_conn counts nothing) */
    c->req_id = 0;
    reject(c, 503, "the request was not answered in time");
}

static void on_tick(uv_timer_t *t) {
    mrl_http *srv = t->data;
    const mrl_http_config *cfg = &srv->cfg;
    double now = now_s(srv);
    for (int i = 0; i < srv->n_slots; i++) {
        conn *c = srv->slots[i];
        if (!c || c->closing) continue;
        switch (c->state) {
        case C_READ:
            if (c->head_done) {
                if (now - c->head_at > cfg->body_timeout_s) time_out(c, "request body not received in time");
            } else if (c->req_start > 0 && now - c->req_start > cfg->header_timeout_s) {
                if (c->in_len > 0) time_out(c, "request head not received in time");
                else close_conn(c);
            } else if (c->in_len == 0 && now - c->last_active > cfg->idle_timeout_s) {
                close_conn(c);
            }
            break;
        case C_READY:
        case C_HANDED:
        case C_STREAM:
            if (now - c->ready_at > cfg->request_timeout_s) expire(c);
            else if (c->probed && peer_closed(c)) close_conn(c); /* reported by mrl_http_take_gone when handed */
            break;
        case C_DRAIN:
            if (now > c->drain_deadline) close_conn(c);
            break;
        }
    }
}

static void on_wait(uv_timer_t *t) { (void)t; }

/* ------------------------------------------------------------ the API */

void mrl_http_config_default(mrl_http_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->max_body_bytes = 16ll << 20;
    cfg->max_header_bytes = 64 << 10;
    cfg->max_connections = 1024;
    cfg->idle_timeout_s = 30;
    cfg->max_write_queue = 64ll << 20;
    cfg->header_timeout_s = 60;
    cfg->body_timeout_s = 60;
    cfg->request_timeout_s = 600;
}

static mrl_status uv_error(const char *what, const char *host, int port, int rc) {
    return mrl_set_error(MRL_ERR_IO, "http: cannot %s %s:%d: %s", what, host, port, uv_strerror(rc));
}

static void free_server(mrl_http *srv) {
    free(srv->slots);
    free(srv->free_slots);
    free(srv->ready);
    free(srv->gone);
    free(srv->cur);
    free(srv);
}

mrl_status mrl_http_open(const char *host, int port, const mrl_http_config *cfg, mrl_http **out) {
    if (!out) return mrl_set_error(MRL_ERR_INVALID, "http open: NULL out");
    *out = NULL;
    if (!host || !host[0]) host = "127.0.0.1";
    if (port < 0 || port > 65535) return mrl_set_error(MRL_ERR_INVALID, "http: port %d is not in 0..65535", port);
    mrl_http_config c;
    if (cfg) c = *cfg;
    else mrl_http_config_default(&c);
    if (c.max_connections < 1 || c.max_connections > 65535 - SPARE_SLOTS)
        return mrl_set_error(MRL_ERR_INVALID, "http: max_connections %d is not in 1..%d", c.max_connections,
                             65535 - SPARE_SLOTS);
    if (c.max_body_bytes < 0 || c.max_body_bytes > (1ll << 34))
        return mrl_set_error(MRL_ERR_INVALID, "http: max_body_bytes %lld is not in 0..2^34", (long long)c.max_body_bytes);
    if (c.max_header_bytes < 256 || c.max_header_bytes > (16 << 20))
        return mrl_set_error(MRL_ERR_INVALID, "http: max_header_bytes %d is not in 256..16 MiB", c.max_header_bytes);
    if (!(c.idle_timeout_s > 0)) return mrl_set_error(MRL_ERR_INVALID, "http: idle_timeout_s must be > 0");
    if (!(c.header_timeout_s > 0)) return mrl_set_error(MRL_ERR_INVALID, "http: header_timeout_s must be > 0");
    if (!(c.body_timeout_s > 0)) return mrl_set_error(MRL_ERR_INVALID, "http: body_timeout_s must be > 0");
    if (!(c.request_timeout_s > 0)) return mrl_set_error(MRL_ERR_INVALID, "http: request_timeout_s must be > 0");
    if (c.max_write_queue < 1) return mrl_set_error(MRL_ERR_INVALID, "http: max_write_queue must be >= 1");

    /* the address: numeric, else the first one the resolver gives */
    struct sockaddr_storage addr;
    memset(&addr, 0, sizeof addr);
    if (uv_ip4_addr(host, port, (struct sockaddr_in *)&addr) != 0 &&
        uv_ip6_addr(host, port, (struct sockaddr_in6 *)&addr) != 0) {
        struct addrinfo hints, *res = NULL;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        int rc = getaddrinfo(host, NULL, &hints, &res);
        if (rc != 0 || !res)
            return mrl_set_error(MRL_ERR_INVALID, "http: cannot resolve host '%s': %s", host, gai_strerror(rc));
        memcpy(&addr, res->ai_addr, res->ai_addrlen);
        if (addr.ss_family == AF_INET) ((struct sockaddr_in *)&addr)->sin_port = htons((uint16_t)port);
        else ((struct sockaddr_in6 *)&addr)->sin6_port = htons((uint16_t)port);
        freeaddrinfo(res);
    }

    mrl_http *srv = calloc(1, sizeof *srv);
    if (!srv) return mrl_set_error(MRL_ERR_NOMEM, "http: out of memory");
    srv->cfg = c;
    srv->n_slots = c.max_connections + SPARE_SLOTS;
    srv->slots = calloc((size_t)srv->n_slots, sizeof *srv->slots);
    srv->free_slots = malloc((size_t)srv->n_slots * sizeof *srv->free_slots);
    srv->ready = malloc((size_t)srv->n_slots * sizeof *srv->ready);
    if (!srv->slots || !srv->free_slots || !srv->ready) {
        free_server(srv);
        return mrl_set_error(MRL_ERR_NOMEM, "http: out of memory");
    }
    for (int i = 0; i < srv->n_slots; i++) srv->free_slots[i] = srv->n_slots - 1 - i; /* slot 0 first */
    srv->n_free = srv->n_slots;
    int rc = uv_loop_init(&srv->loop);
    if (rc) {
        free_server(srv);
        return mrl_set_error(MRL_ERR_IO, "http: uv_loop_init: %s", uv_strerror(rc));
    }
    uv_tcp_init(&srv->loop, &srv->listener);
    srv->listener.data = srv;
    uv_timer_init(&srv->loop, &srv->tick);
    srv->tick.data = srv;
    uv_timer_init(&srv->loop, &srv->wait);
    rc = uv_tcp_bind(&srv->listener, (const struct sockaddr *)&addr, 0);
    if (!rc) rc = uv_listen((uv_stream_t *)&srv->listener, 511, on_connection);
    if (rc) {
        mrl_status st = uv_error("listen on", host, port, rc);
        uv_close((uv_handle_t *)&srv->listener, NULL);
        uv_close((uv_handle_t *)&srv->tick, NULL);
        uv_close((uv_handle_t *)&srv->wait, NULL);
        uv_run(&srv->loop, UV_RUN_DEFAULT);
        uv_loop_close(&srv->loop);
        free_server(srv);
        return st;
    }
    struct sockaddr_storage bound;
    int blen = sizeof bound;
    uv_tcp_getsockname(&srv->listener, (struct sockaddr *)&bound, &blen);
    srv->port = bound.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&bound)->sin6_port)
                                            : ntohs(((struct sockaddr_in *)&bound)->sin_port);
    srv->listening = 1;
    uv_timer_start(&srv->tick, on_tick, TICK_MS, TICK_MS);
    signal(SIGPIPE, SIG_IGN);
    *out = srv;
    return MRL_OK;
}

int mrl_http_port(const mrl_http *srv) { return srv ? srv->port : 0; }

mrl_status mrl_http_poll(mrl_http *srv, int timeout_ms, mrl_http_request *req, int *got) {
    if (!srv || !req || !got) return mrl_set_error(MRL_ERR_INVALID, "http poll: NULL argument");
    *got = 0;
    free(srv->cur); /* the previous request's strings: valid until now */
    srv->cur = NULL;
    uv_update_time(&srv->loop);
    if (srv->ready_count == 0 && timeout_ms > 0) {
        uv_timer_start(&srv->wait, on_wait, (uint64_t)timeout_ms, 0);
        uv_run(&srv->loop, UV_RUN_ONCE); /* returns after the first events (or the timer) */
        uv_timer_stop(&srv->wait);
    }
    uv_run(&srv->loop, UV_RUN_NOWAIT);
    while (srv->ready_count > 0) {
        int64_t id = srv->ready[srv->ready_head];
        srv->ready_head = (srv->ready_head + 1) % srv->n_slots;
        srv->ready_count--;
        conn *c = srv->slots[id & 0xffff];
        if (!c || c->closing || c->req_id != id || c->state != C_READY) continue; /* its client left */
        c->state = C_HANDED;
        srv->cur = c->parsed; /* moved: the connection parses its next request into a new block */
        c->parsed = NULL;
        const char *b = srv->cur;
        req->id = id;
        req->method = b;
        req->path = b + c->off_path;
        req->query = b + c->off_query;
        req->content_type = b + c->off_ctype;
        req->authorization = b + c->off_auth;
        req->body = b + c->off_body;
        req->body_len = c->body_len;
        srv->stats.requests_total++;
        srv->stats.in_flight++;
        *got = 1;
        break;
    }
    return MRL_OK;
}

static conn *find(mrl_http *srv, int64_t id, const char *what) {
    if (!srv) {
        mrl_set_error(MRL_ERR_INVALID, "http %s: NULL server", what);
        return NULL;
    }
    int64_t slot = id & 0xffff;
    conn *c = id > 0 && slot < srv->n_slots ? srv->slots[slot] : NULL;
    if (!c || c->closing || c->req_id != id || (c->state != C_HANDED && c->state != C_STREAM)) {
        mrl_set_error(MRL_ERR_INVALID, "http %s: request %lld is not open (answered already, or its client left)",
                      what, (long long)id);
        return NULL;
    }
    return c;
}

/* The request is answered (its response is being queued): from here on a
 * failed write is no longer the caller's request going away. */
static void end_request(conn *c) {
    c->srv->stats.in_flight--;
    c->req_id = 0;
    c->state = C_READ;
}

/* After the response: the next request of a keep-alive connection, or the end. */
static void after_response(conn *c) {
    if (c->closing) return;
    if (!c->keep_alive) {
        finish_conn(c);
        return;
    }
    c->last_active = now_s(c->srv);
    c->req_start = c->in_len ? c->last_active : 0; /* pipelined bytes: the next request has begun */
    c->probed = 0;
    process(c); /* a pipelined request may be buffered already */
    if (!c->closing && c->peer_eof && c->state == C_READ) finish_conn(c); /* half-closed: nothing more comes */
}

mrl_status mrl_http_respond(mrl_http *srv, int64_t id, int status, const char *content_type, const char *body,
                            int64_t len) {
    conn *c = find(srv, id, "respond");
    if (!c) return MRL_ERR_INVALID;
    if (c->state != C_HANDED) return mrl_set_error(MRL_ERR_INVALID, "http respond: request %lld is streaming", (long long)id);
    if (status < 100 || status > 999) return mrl_set_error(MRL_ERR_INVALID, "http respond: status %d", status);
    if (len < 0 || (len > 0 && !body)) return mrl_set_error(MRL_ERR_INVALID, "http respond: bad body");
    char head[512];
    int hlen = format_head(c, head, sizeof head, status, content_type ? content_type : "application/json", len, 0);
    end_request(c);
    send_bytes(c, head, (size_t)hlen, body, (size_t)len); /* a failed write closes the connection */
    after_response(c);
    return MRL_OK;
}

mrl_status mrl_http_stream_begin(mrl_http *srv, int64_t id, int status, const char *content_type) {
    conn *c = find(srv, id, "stream_begin");
    if (!c) return MRL_ERR_INVALID;
    if (c->state != C_HANDED) return mrl_set_error(MRL_ERR_INVALID, "http stream_begin: request %lld is streaming already", (long long)id);
    c->chunked = !c->http10;
    if (c->http10) c->keep_alive = 0;
    char head[512];
    int hlen = format_head(c, head, sizeof head, status, content_type ? content_type : "text/event-stream", 0, 1);
    c->state = C_STREAM;
    send_bytes(c, head, (size_t)hlen, NULL, 0);
    return MRL_OK;
}

mrl_status mrl_http_stream_write(mrl_http *srv, int64_t id, const char *data, int64_t len) {
    conn *c = find(srv, id, "stream_write");
    if (!c) return MRL_ERR_INVALID;
    if (c->state != C_STREAM) return mrl_set_error(MRL_ERR_INVALID, "http stream_write: request %lld has no stream_begin", (long long)id);
    if (len <= 0) return MRL_OK;
    if (c->chunked) { /* the chunk's size line, its data and its CRLF */
        char size[32];
        int n = snprintf(size, sizeof size, "%llx\r\n", (unsigned long long)len);
        uv_buf_t parts[3] = {uv_buf_init(size, (unsigned)n), uv_buf_init((char *)data, (unsigned)len),
                             uv_buf_init((char *)"\r\n", 2)};
        send_parts(c, parts, 3);
    } else {
        send_bytes(c, data, (size_t)len, NULL, 0);
    }
    return MRL_OK;
}

mrl_status mrl_http_stream_end(mrl_http *srv, int64_t id) {
    conn *c = find(srv, id, "stream_end");
    if (!c) return MRL_ERR_INVALID;
    if (c->state != C_STREAM) return mrl_set_error(MRL_ERR_INVALID, "http stream_end: request %lld has no stream_begin", (long long)id);
    end_request(c);
    if (c->chunked) send_bytes(c, "0\r\n\r\n", 5, NULL, 0);
    after_response(c);
    return MRL_OK;
}

int mrl_http_take_gone(mrl_http *srv, int64_t *ids, int max) {
    if (!srv || !ids || max <= 0 || srv->n_gone == 0) return 0;
    int n = srv->n_gone < max ? srv->n_gone : max;
    memcpy(ids, srv->gone, (size_t)n * sizeof *ids);
    memmove(srv->gone, srv->gone + n, (size_t)(srv->n_gone - n) * sizeof *ids);
    srv->n_gone -= n;
    return n;
}

void mrl_http_get_stats(const mrl_http *srv, mrl_http_stats *out) {
    if (!out) return;
    if (!srv) {
        memset(out, 0, sizeof *out);
        return;
    }
    *out = srv->stats;
}

void mrl_http_stop_listening(mrl_http *srv) {
    if (!srv || !srv->listening) return;
    srv->listening = 0;
    uv_close((uv_handle_t *)&srv->listener, NULL);
}

static int writes_pending(mrl_http *srv) {
    for (int i = 0; i < srv->n_slots; i++) {
        conn *c = srv->slots[i];
        if (c && !c->closing && uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) > 0) return 1;
    }
    return 0;
}

void mrl_http_close(mrl_http *srv, int flush_ms) {
    if (!srv) return;
    mrl_http_stop_listening(srv);
    /* let queued responses go out: a client that got its answer should not see a reset */
    double end = now_s(srv) + (flush_ms > 0 ? flush_ms : 0) * 1e-3;
    while (writes_pending(srv) && now_s(srv) < end) {
        uv_timer_start(&srv->wait, on_wait, 10, 0);
        uv_run(&srv->loop, UV_RUN_ONCE);
        uv_update_time(&srv->loop);
    }
    for (int i = 0; i < srv->n_slots; i++)
        if (srv->slots[i]) close_conn(srv->slots[i]);
    uv_close((uv_handle_t *)&srv->tick, NULL);
    uv_close((uv_handle_t *)&srv->wait, NULL);
    uv_run(&srv->loop, UV_RUN_DEFAULT); /* the close callbacks: every handle freed */
    uv_loop_close(&srv->loop);
    free_server(srv);
}
