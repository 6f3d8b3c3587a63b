/* A small HTTP/1.1 client on a libuv loop of its own, run only from
 * mrl_httpc_poll (and close) on the caller's thread (see
 * moonrl/http_client.h).
 *
 * A request is queued on its host (one per (name, port)), waits there for a
 * connection, is carried by one, then waits in the done queue until
 * mrl_httpc_poll hands it over:
 *   R_WAIT  in its host's wait queue (a name being resolved, or every
 *           connection of the host busy)
 *   R_CONN  on a connection: being connected, sent, or its response read
 *   R_DONE  finished (a response or a failure), in the done queue
 * A connection is
 *   K_CONNECTING  made for the request it carries (sent once connected)
 *   K_BUSY        carrying a request
 *   K_IDLE        in the pool, read from all the same (the server's EOF, or
 *                 bytes nobody asked for, close it at once)
 * and the response on a busy one is parsed as it comes: the head (up to its
 * blank line), then the body by its framing (P_LENGTH, the chunks, or
 * P_TO_EOF). Any failure closes the connection: after a malformed or cut
 * response nothing on it can be trusted.
 *
 * Every live request is also on one list (c->all, in queueing order) that
 * the tick (every TICK_MS) walks for the deadlines and cancel walks for an
 * id: a linear walk, cheap next to the thousands of requests a client has
 * in flight at most. */
#define _GNU_SOURCE
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <uv.h>
#include "moonrl/http_client.h"
#include "base/error.h"

enum { R_WAIT, R_CONN, R_DONE };
enum { K_CONNECTING, K_BUSY, K_IDLE };
enum { P_HEAD, P_LENGTH, P_TO_EOF, P_CHUNK_SIZE, P_CHUNK_DATA, P_CHUNK_END, P_TRAILER, P_DONE };
enum { H_UNRESOLVED, H_RESOLVING, H_RESOLVED };

#define MAX_HEAD (64 << 10)    /* a response's head; also its trailers */
#define MAX_LINE 4096          /* a chunk's size line */
#define READ_CHUNK 65536
#define TICK_MS 50             /* how often the deadlines are checked */

struct host;
struct conn;

typedef struct req {
    int64_t id;
    struct host *host;
    struct conn *conn;          /* in R_CONN */
    struct req *prev, *next;    /* in its host's wait queue (R_WAIT) or the done queue (R_DONE) */
    struct req *all_prev, *all_next;
    int where;
    int head_only;              /* a HEAD request: its response has no body */
    int retried;                /* sent again once already (the keep-alive race) */
    int fresh;                  /* to go on a new connection, not a pooled one */
    char *out;                  /* the request's bytes, head and body (until it ends) */
    size_t out_len;
    double start, deadline;     /* seconds (now_s); deadline 0: none */
    int status;
    char *body;                 /* the response's body, NUL-terminated */
    size_t body_len, body_cap;
    const char *error;          /* NULL, or err */
    char err[320];
    double seconds;
} req;

typedef struct queue { req *head, *tail; } queue;

typedef struct conn {
    uv_tcp_t tcp;
    uv_connect_t connect;
    struct host *host;
    struct conn *prev, *next;   /* its host's connections, the last to become idle first */
    req *req;                   /* the request it carries (K_CONNECTING, K_BUSY) */
    int state;
    int closing;                /* uv_close called: freed by its close callback */
    int writes;                 /* writes not yet done */
    int64_t served;             /* responses read whole: > 0 means reused (the keep-alive race applies) */
    double connect_start;
    char *in;                   /* bytes received, not yet parsed */
    size_t in_len, in_cap;
    size_t scan;                /* in P_HEAD: how far the search for the head's end has gone */
    /* the response being read */
    int got_bytes;              /* any byte of it came */
    int phase;
    int status;
    int keep_alive;
    size_t remaining;           /* P_LENGTH, P_CHUNK_DATA: bytes still to come */
    size_t trailer_bytes;
} conn;

typedef struct host {
    struct mrl_httpc *client;
    char name[256];             /* an IPv6 literal without brackets */
    int port;
    int resolve;
    struct sockaddr_storage addr;
    uv_getaddrinfo_t gai;       /* in H_RESOLVING */
    conn *conns;
    int n_conns;
    queue wait;
} host;

struct mrl_httpc {
    uv_loop_t loop;
    uv_timer_t tick;            /* every TICK_MS: the deadlines */
    uv_timer_t wait;            /* bounds one poll's wait */
    mrl_httpc_config cfg;
    int closing;
    host **hosts;
    int n_hosts, cap_hosts;
    req *all_head, *all_tail;   /* every live request, handed over ones excepted */
    queue done;
    req *cur;                   /* the request last handed over: its strings live until the next poll */
    int64_t serial;
    mrl_httpc_stats stats;
    char read_buf[READ_CHUNK];
};

static double now_s(void) { return (double)uv_hrtime() * 1e-9; }

/* ------------------------------------------------------------ lists */

static void q_push_back(queue *q, req *r) {
    r->next = NULL;
    r->prev = q->tail;
    if (q->tail) q->tail->next = r;
    else q->head = r;
    q->tail = r;
}

static void q_push_front(queue *q, req *r) {
    r->prev = NULL;
    r->next = q->head;
    if (q->head) q->head->prev = r;
    else q->tail = r;
    q->head = r;
}

static void q_remove(queue *q, req *r) {
    if (r->prev) r->prev->next = r->next;
    else q->head = r->next;
    if (r->next) r->next->prev = r->prev;
    else q->tail = r->prev;
    r->prev = r->next = NULL;
}

static void conn_unlink(conn *k) {
    host *h = k->host;
    if (k->prev) k->prev->next = k->next;
    else h->conns = k->next;
    if (k->next) k->next->prev = k->prev;
    k->prev = k->next = NULL;
}

static void conn_push_front(conn *k) {
    host *h = k->host;
    k->prev = NULL;
    k->next = h->conns;
    if (h->conns) h->conns->prev = k;
    h->conns = k;
}

/* Off the live list, and freed. */
static void free_req(mrl_httpc *c, req *r) {
    if (r->all_prev) r->all_prev->all_next = r->all_next;
    else c->all_head = r->all_next;
    if (r->all_next) r->all_next->all_prev = r->all_prev;
    else c->all_tail = r->all_prev;
    c->stats.pending--;
    free(r->out);
    free(r->body);
    free(r);
}

/* ------------------------------------------------------------ ending requests */

static void finish(req *r) {
    mrl_httpc *c = r->host->client;
    r->where = R_DONE;
    r->seconds = now_s() - r->start;
    free(r->out); /* no retry from here */
    r->out = NULL;
    q_push_back(&c->done, r);
}

static void fail(req *r, const char *error) {
    mrl_httpc *c = r->host->client;
    snprintf(r->err, sizeof r->err, "%s", error);
    r->error = r->err;
    r->status = 0;
    r->body_len = 0;
    if (r->body) r->body[0] = 0;
    c->stats.failed_total++;
    finish(r);
}

static void detach(conn *k) {
    if (k->req) k->req->conn = NULL;
    k->req = NULL;
}

static void on_conn_closed(uv_handle_t *hd) {
    conn *k = hd->data;
    free(k->in);
    free(k);
}

/* Out of the pool, closed; freed by libuv's close callback. Its request must be detached. */
static void close_conn(conn *k) {
    if (k->closing) return;
    host *h = k->host;
    k->closing = 1;
    conn_unlink(k);
    h->n_conns--;
    h->client->stats.connections_open--;
    uv_close((uv_handle_t *)&k->tcp, on_conn_closed);
}

/* The connection broke (an error, the server's EOF, a malformed response) while carrying a
 * request: closed, and the request either sent again on a fresh connection — the keep-alive race:
 * a reused connection the server had closed while it sat idle fails before any byte of a response
 * comes — or failed with `error`. The caller dispatches the host again. */
static void drop_conn(conn *k, const char *error) {
    req *r = k->req;
    detach(k);
    close_conn(k);
    if (!r) return;
    if (!k->got_bytes && k->served > 0 && !r->retried) {
        r->retried = 1;
        r->fresh = 1;
        r->where = R_WAIT;
        r->body_len = 0;
        r->host->client->stats.retried_total++;
        q_push_front(&r->host->wait, r);
    } else {
        fail(r, error);
    }
}

static void dispatch(host *h);

static void conn_broke(conn *k, const char *error) {
    host *h = k->host;
    drop_conn(k, error);
    dispatch(h);
}

/* ------------------------------------------------------------ sending */

typedef struct write_req {
    uv_write_t w;
    char data[];
} write_req;

static void on_written(uv_write_t *w, int status) {
    conn *k = w->handle->data;
    free(w);
    k->writes--;
    if (k->closing || status >= 0) return;
    /* With a response begun, its reading decides (a server may answer early, as a 413, and close
       before reading the rest); with none, the connection is gone (the keep-alive race, maybe). */
    if (k->req && !k->got_bytes) conn_broke(k, uv_strerror(status));
}

/* Send the request's bytes (a copy: the request may end, by a cancel or its deadline, before
 * the write does). 0, or libuv's error. */
static int send_request(conn *k) {
    req *r = k->req;
    write_req *w = malloc(sizeof *w + r->out_len);
    if (!w) return UV_ENOMEM;
    memcpy(w->data, r->out, r->out_len);
    uv_buf_t buf = uv_buf_init(w->data, (unsigned)r->out_len);
    int rc = uv_write(&w->w, (uv_stream_t *)&k->tcp, &buf, 1, on_written);
    if (rc) {
        free(w);
        return rc;
    }
    k->writes++;
    return 0;
}

/* k carries r from here: sent now, or once connected. No dispatch on a failure (the caller's
 * loop goes on). */
static void assign(conn *k, req *r) {
    k->req = r;
    r->conn = k;
    r->where = R_CONN;
    r->body_len = 0;
    k->got_bytes = 0;
    k->phase = P_HEAD;
    k->scan = 0;
    k->status = 0;
    k->keep_alive = 1;
    k->remaining = 0;
    k->trailer_bytes = 0;
    if (k->state == K_CONNECTING) return;
    k->state = K_BUSY;
    int rc = send_request(k);
    if (rc) drop_conn(k, uv_strerror(rc));
}

/* ------------------------------------------------------------ parsing the response */

static int is_tchar(int ch) {
    /* ch != 0: strchr finds a NUL byte too (the string's end) */
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           (ch != 0 && strchr("!#$%&'*+-.^_`|~", ch));
}

/* Whether the comma-separated list holds token (case-insensitive); *last: whether it is the last. */
static int has_token(const char *list, const char *token, int *last) {
    size_t n = strlen(token);
    int found = 0;
    if (last) *last = 0;
    for (const char *p = list; *p;) {
        while (*p == ' ' || *p == ',' || *p == '\t') p++;
        if (!*p) break;
        const char *e = p;
        while (*e && *e != ',') e++;
        const char *t = e;
        while (t > p && (t[-1] == ' ' || t[-1] == '\t')) t--;
        int is = (size_t)(t - p) == n && strncasecmp(p, token, n) == 0;
        found |= is;
        if (last) *last = is;
        p = e;
    }
    return found;
}

/* Where the head in p[0..n) ends (just past its blank line), or 0 while it has not come; the
 * search resumes at *scan. Lines may end in CRLF or a bare LF. */
static size_t head_end(const char *p, size_t n, size_t *scan) {
    for (size_t i = *scan; i < n; i++) {
        if (p[i] != '\n') continue;
        if (i + 1 < n && p[i + 1] == '\n') return i + 2;
        if (i + 2 < n && p[i + 1] == '\r' && p[i + 2] == '\n') return i + 3;
    }
    *scan = n >= 2 ? n - 2 : 0; /* a blank line cut by the read's end is looked at again */
    return 0;
}

/* A header's value, trimmed, into dst; -1 when it does not fit. */
static int copy_value(char *dst, size_t cap, const char *v, size_t n) {
    while (n && (*v == ' ' || *v == '\t')) v++, n--;
    while (n && (v[n - 1] == ' ' || v[n - 1] == '\t')) n--;
    if (n >= cap) return -1;
    memcpy(dst, v, n);
    dst[n] = 0;
    return 0;
}

/* The head in p[0..n): the status line and the headers that frame the body. NULL when fine (the
 * phase says what comes next: P_HEAD again after an interim 1xx), else why not. */
static const char *parse_head(conn *k, const char *p, size_t n) {
    mrl_httpc *c = k->host->client;
    const char *end = p + n;
    const char *eol = memchr(p, '\n', n);
    const char *line_end = eol > p && eol[-1] == '\r' ? eol - 1 : eol;
    /* HTTP/1.x SP 3DIGIT [SP reason] */
    size_t len = (size_t)(line_end - p);
    if (len < 12 || memcmp(p, "HTTP/1.", 7) != 0 || p[7] < '0' || p[7] > '9' || p[8] != ' ' ||
        p[9] < '1' || p[9] > '9' || p[10] < '0' || p[10] > '9' || p[11] < '0' || p[11] > '9' ||
        (len > 12 && p[12] != ' '))
        return "malformed response: bad status line";
    int http10 = p[7] == '0';
    int status = (p[9] - '0') * 100 + (p[10] - '0') * 10 + (p[11] - '0');
    int keep_alive = !http10, chunked = 0, has_te = 0;
    int64_t clen = -1;
    char value[256];
    for (p = eol + 1; p < end;) {
        eol = memchr(p, '\n', (size_t)(end - p));
        line_end = eol > p && eol[-1] == '\r' ? eol - 1 : eol;
        if (line_end == p) break; /* the blank line */
        const char *colon = memchr(p, ':', (size_t)(line_end - p));
        if (!colon || colon == p) return "malformed response: bad header line";
        for (const char *q = p; q < colon; q++)
            if (!is_tchar((unsigned char)*q)) return "malformed response: bad header name";
        size_t nlen = (size_t)(colon - p);
        const char *v = colon + 1;
        size_t vn = (size_t)(line_end - v);
#define IS(name) (nlen == sizeof(name) - 1 && strncasecmp(p, name, nlen) == 0)
        if (IS("content-length")) {
            if (copy_value(value, sizeof value, v, vn) != 0) return "malformed response: bad Content-Length";
            size_t d = strlen(value);
            if (d == 0 || d > 18 || strspn(value, "0123456789") != d) return "malformed response: bad Content-Length";
            int64_t x = strtoll(value, NULL, 10);
            if (clen >= 0 && x != clen) return "malformed response: conflicting Content-Length headers";
            clen = x;
        } else if (IS("transfer-encoding")) {
            if (copy_value(value, sizeof value, v, vn) != 0) return "malformed response: bad Transfer-Encoding";
            has_te = 1;
            has_token(value, "chunked", &chunked); /* what counts is whether chunked comes last */
        } else if (IS("connection")) {
            if (copy_value(value, sizeof value, v, vn) != 0) return "malformed response: bad Connection";
            if (has_token(value, "close", NULL)) keep_alive = 0;
            else if (has_token(value, "keep-alive", NULL)) keep_alive = 1;
        }
#undef IS
        p = eol + 1;
    }
    k->status = status;
    k->keep_alive = keep_alive;
    /* the body's framing, RFC 9112 6.3 */
    if (status == 101) return "malformed response: unexpected 101 Switching Protocols";
    if (status < 200) { /* interim (100 Continue, 103 Early Hints): the real response follows */
        k->phase = P_HEAD;
        return NULL;
    }
    if (k->req->head_only || status == 204 || status == 304) {
        k->phase = P_DONE;
    } else if (has_te) {
        /* a Content-Length beside it is ignored, and the connection not reused after (it may have
           been a smuggling attempt); a coding other than chunked last ends with the connection */
        k->phase = chunked ? P_CHUNK_SIZE : P_TO_EOF;
        if (!chunked || clen >= 0) k->keep_alive = 0;
    } else if (clen >= 0) {
        if (clen > c->cfg.max_response_bytes) return "response too large";
        k->phase = clen ? P_LENGTH : P_DONE;
        k->remaining = (size_t)clen;
    } else {
        k->phase = P_TO_EOF;
        k->keep_alive = 0;
    }
    return NULL;
}

/* A chunk's size line p[0..n) (its LF excluded): hex digits, then maybe an extension. */
static const char *parse_chunk_size(conn *k, const char *p, size_t n) {
    mrl_httpc *c = k->host->client;
    if (n && p[n - 1] == '\r') n--;
    size_t i = 0;
    uint64_t size = 0;
    for (; i < n; i++) {
        int ch = (unsigned char)p[i], d;
        if (ch >= '0' && ch <= '9') d = ch - '0';
        else if (ch >= 'a' && ch <= 'f') d = ch - 'a' + 10;
        else if (ch >= 'A' && ch <= 'F') d = ch - 'A' + 10;
        else break;
        if (size >> 56) return "response too large"; /* 15 hex digits and more: no body is that long */
        size = size * 16 + (uint64_t)d;
    }
    if (i == 0) return "malformed response: bad chunk size";
    while (i < n && (p[i] == ' ' || p[i] == '\t')) i++;
    if (i < n && p[i] != ';') return "malformed response: bad chunk size";
    if (size > (uint64_t)c->cfg.max_response_bytes - k->req->body_len) return "response too large";
    k->remaining = (size_t)size;
    k->phase = size ? P_CHUNK_DATA : P_TRAILER;
    return NULL;
}

static const char *append_body(conn *k, const char *p, size_t n) {
    req *r = k->req;
    size_t max = (size_t)k->host->client->cfg.max_response_bytes;
    if (n > max - r->body_len) return "response too large";
    size_t need = r->body_len + n + 1; /* the NUL */
    if (need > r->body_cap) {
        /* grown as the bytes come, not to a length the server claims */
        size_t cap = r->body_cap ? r->body_cap : 4096;
        while (cap < need) cap *= 2;
        if (cap > max + 1) cap = max + 1;
        char *b = realloc(r->body, cap);
        if (!b) return "out of memory";
        r->body = b;
        r->body_cap = cap;
    }
    memcpy(r->body + r->body_len, p, n);
    r->body_len += n;
    r->body[r->body_len] = 0;
    return NULL;
}

/* The response is in: handed to the done queue, and the connection back to the pool (unless it
 * is to close, or holds bytes past the response, or its request is still going out). */
static void complete(conn *k) {
    req *r = k->req;
    host *h = k->host;
    int reuse = k->keep_alive && k->in_len == 0 && k->writes == 0;
    detach(k);
    r->status = k->status;
    finish(r);
    k->served++;
    if (reuse) {
        k->state = K_IDLE;
        conn_unlink(k); /* to the front: the last to go idle is the first reused (the least likely closed) */
        conn_push_front(k);
    } else {
        close_conn(k);
    }
    dispatch(h);
}

/* Parse what k->in holds, as far as it goes. */
static void parse(conn *k) {
    size_t pos = 0;
    const char *err = NULL;
    while (!err && k->phase != P_DONE) {
        const char *p = k->in + pos;
        size_t n = k->in_len - pos;
        if (k->phase == P_HEAD) {
            size_t len = head_end(p, n, &k->scan);
            if (!len) {
                if (n > MAX_HEAD) err = "response head too large";
                break;
            }
            if (len > MAX_HEAD) err = "response head too large";
            else err = parse_head(k, p, len);
            pos += len;
            k->scan = 0;
        } else if (k->phase == P_LENGTH || k->phase == P_CHUNK_DATA || k->phase == P_TO_EOF) {
            if (n == 0) break;
            size_t take = k->phase == P_TO_EOF || n < k->remaining ? n : k->remaining;
            err = append_body(k, p, take);
            pos += take;
            if (k->phase == P_TO_EOF) continue;
            k->remaining -= take;
            if (k->remaining == 0) k->phase = k->phase == P_LENGTH ? P_DONE : P_CHUNK_END;
        } else if (k->phase == P_CHUNK_SIZE) {
            const char *eol = memchr(p, '\n', n);
            if (!eol) {
                if (n > MAX_LINE) err = "malformed response: chunk size line too long";
                break;
            }
            if (eol - p > MAX_LINE) err = "malformed response: chunk size line too long";
            else err = parse_chunk_size(k, p, (size_t)(eol - p));
            pos += (size_t)(eol - p) + 1;
        } else if (k->phase == P_CHUNK_END) { /* the CRLF after a chunk's data */
            if (n == 0 || (p[0] == '\r' && n < 2)) break;
            if (p[0] == '\n') pos += 1;
            else if (p[0] == '\r' && p[1] == '\n') pos += 2;
            else err = "malformed response: chunk not followed by CRLF";
            k->phase = P_CHUNK_SIZE;
        } else { /* P_TRAILER: header lines up to a blank one, dropped */
            const char *eol = memchr(p, '\n', n);
            size_t len = eol ? (size_t)(eol - p) : n;
            if (k->trailer_bytes + len > MAX_HEAD) err = "response head too large";
            if (!eol || err) break;
            pos += len + 1;
            k->trailer_bytes += len + 1;
            if (len == 0 || (len == 1 && p[0] == '\r')) k->phase = P_DONE;
        }
    }
    if (pos) {
        memmove(k->in, k->in + pos, k->in_len - pos);
        k->in_len -= pos;
    }
    if (err) conn_broke(k, err);
    else if (k->phase == P_DONE) complete(k);
}

/* ------------------------------------------------------------ reading */

static void on_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf) {
    (void)suggested;
    conn *k = hd->data;
    *buf = uv_buf_init(k->host->client->read_buf, READ_CHUNK);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
    conn *k = s->data;
    if (k->closing || nread == 0) return;
    host *h = k->host;
    if (!k->req) { /* idle: the server closed it, or sent what nobody asked for */
        close_conn(k);
        dispatch(h);
        return;
    }
    if (nread < 0) {
        if (nread == UV_EOF && k->phase == P_TO_EOF) complete(k); /* a body that ends with the connection */
        else if (nread == UV_EOF)
            conn_broke(k, k->got_bytes ? "connection closed mid-response" : "connection closed before the response");
        else conn_broke(k, uv_strerror((int)nread));
        return;
    }
    k->got_bytes = 1;
    size_t need = k->in_len + (size_t)nread;
    if (need > k->in_cap) { /* bounded: parse consumes all but a head (MAX_HEAD) or a line (MAX_LINE) */
        size_t cap = k->in_cap ? k->in_cap : 4096;
        while (cap < need) cap *= 2;
        char *p = realloc(k->in, cap);
        if (!p) {
            conn_broke(k, "out of memory");
            return;
        }
        k->in = p;
        k->in_cap = cap;
    }
    memcpy(k->in + k->in_len, buf->base, (size_t)nread);
    k->in_len = need;
    parse(k);
}

/* ------------------------------------------------------------ connections */

static void on_connect(uv_connect_t *cr, int status) {
    conn *k = cr->handle->data;
    if (k->closing) return; /* closed while connecting (cancelled, timed out): UV_ECANCELED */
    if (status < 0) {
        conn_broke(k, uv_strerror(status));
        return;
    }
    k->state = K_BUSY;
    uv_tcp_nodelay(&k->tcp, 1);
    int rc = uv_read_start((uv_stream_t *)&k->tcp, on_alloc, on_read);
    if (!rc && k->req) rc = send_request(k);
    if (rc) {
        conn_broke(k, uv_strerror(rc));
        return;
    }
    if (!k->req) { /* (cannot happen: a request leaving a connection closes it) */
        k->state = K_IDLE;
        dispatch(k->host);
    }
}

/* A new connection to h, carrying r. No dispatch on a failure (the caller's loop goes on). */
static void open_conn(host *h, req *r) {
    mrl_httpc *c = h->client;
    conn *k = calloc(1, sizeof *k);
    if (!k || uv_tcp_init(&c->loop, &k->tcp) != 0) {
        free(k);
        fail(r, "out of memory");
        return;
    }
    k->tcp.data = k;
    k->host = h;
    k->state = K_CONNECTING;
    k->connect_start = now_s();
    conn_push_front(k);
    h->n_conns++;
    c->stats.connections_open++;
    c->stats.connections_total++;
    assign(k, r);
    int rc = uv_tcp_connect(&k->connect, &k->tcp, (const struct sockaddr *)&h->addr, on_connect);
    if (rc) drop_conn(k, uv_strerror(rc));
}

static void fail_waiting(host *h, const char *error) {
    while (h->wait.head) {
        req *r = h->wait.head;
        q_remove(&h->wait, r);
        fail(r, error);
    }
}

static void on_resolved(uv_getaddrinfo_t *g, int status, struct addrinfo *res) {
    host *h = g->data;
    if (h->client->closing) { /* cancelled by close */
        uv_freeaddrinfo(res);
        return;
    }
    const struct addrinfo *pick = NULL;
    for (const struct addrinfo *a = status == 0 ? res : NULL; a; a = a->ai_next) {
        /* IPv4 first: servers listening on 0.0.0.0 are common, "localhost" may give ::1 first */
        if (a->ai_family == AF_INET) {
            pick = a;
            break;
        }
        if (a->ai_family == AF_INET6 && !pick) pick = a;
    }
    if (!pick) {
        char why[320];
        snprintf(why, sizeof why, "cannot resolve host '%.200s': %s", h->name,
                 status ? uv_strerror(status) : "no address");
        h->resolve = H_UNRESOLVED; /* the next request tries again */
        fail_waiting(h, why);
    } else {
        memcpy(&h->addr, pick->ai_addr, pick->ai_addrlen);
        if (h->addr.ss_family == AF_INET) ((struct sockaddr_in *)&h->addr)->sin_port = htons((uint16_t)h->port);
        else ((struct sockaddr_in6 *)&h->addr)->sin6_port = htons((uint16_t)h->port);
        h->resolve = H_RESOLVED;
        dispatch(h);
    }
    uv_freeaddrinfo(res);
}

/* Give waiting requests connections, in order: an idle one (the last to go idle), else a new one
 * while the host has fewer than max_connections_per_host; else they wait for one to free. A
 * request to go on a fresh connection (a retry) at the limit has an idle one closed to make
 * room. */
static void dispatch(host *h) {
    mrl_httpc *c = h->client;
    if (c->closing || !h->wait.head) return;
    if (h->resolve == H_RESOLVING) return;
    if (h->resolve == H_UNRESOLVED) {
        struct addrinfo hints;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        h->gai.data = h;
        int rc = uv_getaddrinfo(&c->loop, &h->gai, on_resolved, h->name, NULL, &hints);
        if (rc) {
            char why[320];
            snprintf(why, sizeof why, "cannot resolve host '%.200s': %s", h->name, uv_strerror(rc));
            fail_waiting(h, why);
        } else {
            h->resolve = H_RESOLVING;
        }
        return;
    }
    while (h->wait.head) {
        req *r = h->wait.head;
        conn *idle = NULL;
        for (conn *k = h->conns; k; k = k->next)
            if (k->state == K_IDLE) {
                idle = k;
                break;
            }
        if (idle && !r->fresh) {
            q_remove(&h->wait, r);
            assign(idle, r);
        } else if (h->n_conns < c->cfg.max_connections_per_host) {
            q_remove(&h->wait, r);
            open_conn(h, r);
        } else if (idle) {
            close_conn(idle);
        } else {
            break; /* every connection busy: the next one to free takes the head */
        }
    }
}

/* ------------------------------------------------------------ deadlines */

static void expire(req *r, const char *why) {
    mrl_httpc *c = r->host->client;
    host *h = r->host;
    c->stats.timed_out_total++;
    if (r->where == R_WAIT) {
        q_remove(&h->wait, r);
    } else { /* R_CONN: its connection holds part of an exchange: closed */
        conn *k = r->conn;
        detach(k);
        close_conn(k);
    }
    fail(r, why);
    dispatch(h);
}

static void on_tick(uv_timer_t *t) {
    mrl_httpc *c = t->data;
    double now = now_s(), ct = c->cfg.connect_timeout_s;
    /* expire ends requests (into the done queue) but frees none: the walk stays valid */
    for (req *r = c->all_head; r; r = r->all_next) {
        if (r->where == R_DONE) continue;
        if (r->deadline > 0 && now >= r->deadline) expire(r, "timed out");
        else if (r->where == R_CONN && r->conn->state == K_CONNECTING && ct > 0 && now - r->conn->connect_start >= ct)
            expire(r, "connect timed out");
    }
}

static void on_wait(uv_timer_t *t) { (void)t; }

/* ------------------------------------------------------------ the API */

void mrl_httpc_config_default(mrl_httpc_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->max_connections_per_host = 64;
    cfg->connect_timeout_s = 10;
    cfg->max_response_bytes = 256ll << 20;
}

mrl_status mrl_httpc_open(const mrl_httpc_config *cfg, mrl_httpc **out) {
    if (!out) return mrl_set_error(MRL_ERR_INVALID, "http client open: NULL out");
    *out = NULL;
    mrl_httpc_config k;
    if (cfg) k = *cfg;
    else mrl_httpc_config_default(&k);
    if (k.max_connections_per_host == 0) k.max_connections_per_host = 64;
    if (k.max_response_bytes == 0) k.max_response_bytes = 256ll << 20;
    if (k.max_connections_per_host < 1 || k.max_connections_per_host > 65535)
        return mrl_set_error(MRL_ERR_INVALID, "http client: max_connections_per_host %d is not in 1..65535",
                             k.max_connections_per_host);
    if (!(k.connect_timeout_s >= 0))
        return mrl_set_error(MRL_ERR_INVALID, "http client: connect_timeout_s must be >= 0 (0: none)");
    if (k.max_response_bytes < 1 || k.max_response_bytes > (1ll << 40))
        return mrl_set_error(MRL_ERR_INVALID, "http client: max_response_bytes %lld is not in 1..2^40",
                             (long long)k.max_response_bytes);
    mrl_httpc *c = calloc(1, sizeof *c);
    if (!c) return mrl_set_error(MRL_ERR_NOMEM, "http client: out of memory");
    c->cfg = k;
    int rc = uv_loop_init(&c->loop);
    if (rc) {
        free(c);
        return mrl_set_error(MRL_ERR_IO, "http client: uv_loop_init: %s", uv_strerror(rc));
    }
    uv_timer_init(&c->loop, &c->tick);
    c->tick.data = c;
    uv_timer_init(&c->loop, &c->wait);
    uv_timer_start(&c->tick, on_tick, TICK_MS, TICK_MS);
    signal(SIGPIPE, SIG_IGN); /* a write to a closed socket is that connection's error, not the process's end */
    *out = c;
    return MRL_OK;
}

/* The caller's header lines: each "Name: value\r\n", the name a token, no control character but
 * a tab in the value, none of the headers the client writes itself. NULL when fine (*ctype: one
 * is Content-Type), else why not. */
static const char *check_headers(const char *hs, int *ctype) {
    *ctype = 0;
    for (const char *p = hs; *p;) {
        const char *eol = strstr(p, "\r\n");
        if (!eol) return "each header line must end with \\r\\n";
        const char *colon = memchr(p, ':', (size_t)(eol - p));
        if (!colon || colon == p) return "a header line is not 'Name: value'";
        for (const char *q = p; q < colon; q++)
            if (!is_tchar((unsigned char)*q)) return "a header name is not a token";
        for (const char *q = colon + 1; q < eol; q++)
            if (((unsigned char)*q < 0x20 && *q != '\t') || *q == 0x7f) return "a header value holds a control character";
        size_t n = (size_t)(colon - p);
#define IS(name) (n == sizeof(name) - 1 && strncasecmp(p, name, n) == 0)
        if (IS("host") || IS("content-length") || IS("transfer-encoding") || IS("connection"))
            return "Host, Content-Length, Transfer-Encoding and Connection are the client's to send";
        if (IS("content-type")) *ctype = 1;
#undef IS
        p = eol + 2;
    }
    return NULL;
}

static host *get_host(mrl_httpc *c, const char *name, int port) {
    for (int i = 0; i < c->n_hosts; i++)
        if (c->hosts[i]->port == port && strcmp(c->hosts[i]->name, name) == 0) return c->hosts[i];
    if (c->n_hosts == c->cap_hosts) {
        int cap = c->cap_hosts ? 2 * c->cap_hosts : 8;
        host **hs = realloc(c->hosts, (size_t)cap * sizeof *hs);
        if (!hs) return NULL;
        c->hosts = hs;
        c->cap_hosts = cap;
    }
    host *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->client = c;
    snprintf(h->name, sizeof h->name, "%s", name);
    h->port = port;
    /* a literal needs no resolver */
    if (uv_ip4_addr(name, port, (struct sockaddr_in *)&h->addr) == 0 ||
        uv_ip6_addr(name, port, (struct sockaddr_in6 *)&h->addr) == 0)
        h->resolve = H_RESOLVED;
    c->hosts[c->n_hosts++] = h;
    return h;
}

mrl_status mrl_httpc_request(mrl_httpc *c, const char *host_name, int port, const char *method, const char *path,
                             const char *headers, const char *body, int64_t body_len, double timeout_s,
                             int64_t *id) {
    if (!c || !host_name || !path || !id) return mrl_set_error(MRL_ERR_INVALID, "http client request: NULL argument");
    *id = 0;
    if (!method) method = "GET";
    /* the host: "[v6]" taken without its brackets; no byte that could break the Host line */
    char name[256];
    size_t hn = strlen(host_name);
    if (hn >= 2 && host_name[0] == '[' && host_name[hn - 1] == ']') host_name++, hn -= 2;
    if (hn == 0 || hn >= sizeof name) return mrl_set_error(MRL_ERR_INVALID, "http client request: bad host");
    memcpy(name, host_name, hn);
    name[hn] = 0;
    for (size_t i = 0; i < hn; i++)
        if ((unsigned char)name[i] <= ' ' || name[i] == 0x7f || strchr("/?#@[]", name[i]))
            return mrl_set_error(MRL_ERR_INVALID, "http client request: bad host '%s'", name);
    if (port < 1 || port > 65535)
        return mrl_set_error(MRL_ERR_INVALID, "http client request: port %d is not in 1..65535", port);
    size_t mn = strlen(method);
    if (mn == 0 || mn > 15) return mrl_set_error(MRL_ERR_INVALID, "http client request: bad method");
    for (size_t i = 0; i < mn; i++)
        if (!is_tchar((unsigned char)method[i])) return mrl_set_error(MRL_ERR_INVALID, "http client request: bad method");
    if (path[0] != '/') return mrl_set_error(MRL_ERR_INVALID, "http client request: the path must start with '/'");
    for (const char *q = path; *q; q++)
        if ((unsigned char)*q <= ' ' || *q == 0x7f)
            return mrl_set_error(MRL_ERR_INVALID, "http client request: the path holds a space or a control character");
    int has_ctype = 0;
    const char *why = headers ? check_headers(headers, &has_ctype) : NULL;
    if (why) return mrl_set_error(MRL_ERR_INVALID, "http client request: %s", why);
    if (body_len < 0 || (body_len > 0 && !body))
        return mrl_set_error(MRL_ERR_INVALID, "http client request: bad body (%lld bytes)", (long long)body_len);
    if (!(timeout_s >= 0)) return mrl_set_error(MRL_ERR_INVALID, "http client request: timeout_s must be >= 0 (0: none)");
    if (c->closing) return mrl_set_error(MRL_ERR_INVALID, "http client request: the client is closing");

    host *h = get_host(c, name, port);
    req *r = h ? calloc(1, sizeof *r) : NULL;
    int with_body = body || !strcmp(method, "POST") || !strcmp(method, "PUT") || !strcmp(method, "PATCH");
    size_t hl = headers ? strlen(headers) : 0;
    size_t cap = mn + strlen(path) + hn + hl + (size_t)body_len + 256;
    if (r) r->out = malloc(cap);
    if (!r || !r->out) {
        free(r);
        return mrl_set_error(MRL_ERR_NOMEM, "http client request: out of memory");
    }
    int v6 = strchr(name, ':') != NULL;
    size_t o = (size_t)snprintf(r->out, cap, "%s %s HTTP/1.1\r\nHost: %s%s%s:%d\r\nConnection: keep-alive\r\n", method,
                                path, v6 ? "[" : "", name, v6 ? "]" : "", port);
    if (with_body) {
        if (!has_ctype) o += (size_t)snprintf(r->out + o, cap - o, "Content-Type: application/json\r\n");
        o += (size_t)snprintf(r->out + o, cap - o, "Content-Length: %lld\r\n", (long long)body_len);
    }
    memcpy(r->out + o, headers ? headers : "", hl);
    o += hl;
    memcpy(r->out + o, "\r\n", 2);
    o += 2;
    if (body_len) memcpy(r->out + o, body, (size_t)body_len);
    r->out_len = o + (size_t)body_len;

    r->id = ++c->serial;
    r->host = h;
    r->head_only = strcmp(method, "HEAD") == 0;
    r->start = now_s();
    r->deadline = timeout_s > 0 ? r->start + timeout_s : 0;
    r->where = R_WAIT;
    r->all_prev = c->all_tail;
    if (c->all_tail) c->all_tail->all_next = r;
    else c->all_head = r;
    c->all_tail = r;
    c->stats.pending++;
    c->stats.requests_total++;
    q_push_back(&h->wait, r);
    *id = r->id;
    dispatch(h); /* the connect (or the write on an idle connection) starts now; the rest in poll */
    return MRL_OK;
}

mrl_status mrl_httpc_poll(mrl_httpc *c, int timeout_ms, mrl_httpc_response *resp, int *got) {
    if (!c || !resp || !got) return mrl_set_error(MRL_ERR_INVALID, "http client poll: NULL argument");
    *got = 0;
    if (c->cur) { /* the previous response's strings: valid until now */
        free(c->cur->body);
        free(c->cur);
        c->cur = NULL;
    }
    uv_update_time(&c->loop); /* the timers below start from now, not from the last poll */
    if (!c->done.head && timeout_ms > 0) {
        double end = now_s() + timeout_ms * 1e-3;
        for (;;) {
            double left = end - now_s();
            if (c->done.head || left <= 0) break;
            uv_timer_start(&c->wait, on_wait, (uint64_t)(left * 1e3) + 1, 0);
            uv_run(&c->loop, UV_RUN_ONCE); /* returns after some events: the tick at most TICK_MS on */
        }
        uv_timer_stop(&c->wait);
    }
    uv_run(&c->loop, UV_RUN_NOWAIT);
    req *r = c->done.head;
    if (!r) return MRL_OK;
    q_remove(&c->done, r);
    /* off the live list; kept (c->cur) until the next poll */
    if (r->all_prev) r->all_prev->all_next = r->all_next;
    else c->all_head = r->all_next;
    if (r->all_next) r->all_next->all_prev = r->all_prev;
    else c->all_tail = r->all_prev;
    c->stats.pending--;
    c->cur = r;
    resp->id = r->id;
    resp->status = r->status;
    resp->body = r->body && r->body_len ? r->body : "";
    resp->body_len = (int64_t)r->body_len;
    resp->error = r->error;
    resp->seconds = r->seconds;
    *got = 1;
    return MRL_OK;
}

void mrl_httpc_cancel(mrl_httpc *c, int64_t id) {
    if (!c) return;
    req *r = c->all_tail; /* the newest first: those cancelled are most often recent */
    while (r && r->id != id) r = r->all_prev;
    if (!r) return;
    host *h = r->host;
    if (r->where == R_WAIT) {
        q_remove(&h->wait, r);
    } else if (r->where == R_DONE) {
        q_remove(&c->done, r);
    } else { /* its connection is mid-exchange: closed */
        conn *k = r->conn;
        detach(k);
        close_conn(k);
    }
    free_req(c, r);
    dispatch(h);
}

int mrl_httpc_pending(const mrl_httpc *c) { return c ? c->stats.pending : 0; }

void mrl_httpc_get_stats(const mrl_httpc *c, mrl_httpc_stats *out) {
    if (!out) return;
    if (!c) {
        memset(out, 0, sizeof *out);
        return;
    }
    *out = c->stats;
}

void mrl_httpc_close(mrl_httpc *c) {
    if (!c) return;
    c->closing = 1;
    for (int i = 0; i < c->n_hosts; i++) {
        host *h = c->hosts[i];
        while (h->conns) {
            detach(h->conns);
            close_conn(h->conns);
        }
        if (h->resolve == H_RESOLVING) uv_cancel((uv_req_t *)&h->gai); /* one already running is waited for below */
    }
    while (c->all_head) free_req(c, c->all_head);
    if (c->cur) {
        free(c->cur->body);
        free(c->cur);
    }
    uv_close((uv_handle_t *)&c->tick, NULL);
    uv_close((uv_handle_t *)&c->wait, NULL);
    uv_run(&c->loop, UV_RUN_DEFAULT); /* the close callbacks (every connection freed), the resolver's */
    uv_loop_close(&c->loop);
    for (int i = 0; i < c->n_hosts; i++) free(c->hosts[i]);
    free(c->hosts);
    free(c);
}
