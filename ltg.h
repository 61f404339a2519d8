/* ltg.h -- the contracts of ltg's reusable parts.
 *
 * ltg is one C file (ltg.c). This header holds the types and functions that
 * another program may take when it vendors ltg: the byte buffer, the JSON
 * reader and writer, and the resumable HTTP/1.1 parsers. Each contract is
 * written once, here; ltg.c says "see ltg.h" beside the implementation.
 *
 * Conventions, shared by every parser below:
 *   - A parser never allocates and never blocks. Results are slices
 *     (offset + length) into the caller's buffer.
 *   - A parser returns the number of bytes it consumed (>= 0), LTG_AGAIN when
 *     it needs more input, or LTG_ERR when the input is invalid. After
 *     LTG_ERR its state says why (a status or a message). The chunked
 *     decoder's error is sticky (every later call fails); the head parsers
 *     take a whole head each call and hold nothing between calls.
 */
#ifndef LTG_H
#define LTG_H

#include <stddef.h>
#include <stdint.h>

#define LTG_AGAIN (-2)
#define LTG_ERR (-1)

/* ===== Byte buffer =====
 * One growable buffer type for everything ltg builds or receives. `len`
 * bytes of `p` are used; `p[len]` is always a NUL so a buffer may be handed
 * to string functions. Allocation failure aborts: a gateway that cannot get
 * a few kilobytes has no useful way to continue. */
typedef struct {
    char *p;
    size_t len, cap;
} buf;

void buf_reserve(buf *b, size_t extra);            /* room for `extra` more bytes */
void buf_append(buf *b, const void *data, size_t n);
void buf_puts(buf *b, const char *s);
void buf_cat(buf *b, ...) __attribute__((sentinel)); /* the strings given, up to a NULL */
void buf_printf(buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void buf_consume(buf *b, size_t n);                /* drop the first n bytes */
void buf_free(buf *b);

/* ===== JSON reader =====
 * Strict RFC 8259, jsmn-style: json_parse() fills a caller-given token array
 * in document order and allocates nothing. A token covers a value: for a
 * string, `start`/`end` are the bytes between the quotes (still escaped: use
 * json_unescape); for other values the value's own bytes. `size` is the
 * number of children (an object's keys count once each, the key token is
 * followed by its value's tokens); `next` is the index of the first token
 * after this one's subtree, so walking siblings is `i = t[i].next`. */
typedef enum { JSON_OBJECT, JSON_ARRAY, JSON_STRING, JSON_NUMBER, JSON_TRUE, JSON_FALSE, JSON_NULL } json_type;

typedef struct {
    json_type type;
    uint32_t start, end; /* byte range in the input */
    int size;            /* children: members of an object, elements of an array */
    int next;            /* index of the token after this subtree */
} json_tok;

typedef struct {
    int ntok;          /* tokens written */
    size_t err_offset; /* on error: the byte offset where the input went wrong */
    const char *err;   /* on error: what was wrong, e.g. "expected ':'" */
} json_result;

#define JSON_MAX_DEPTH 64

/* Parse `len` bytes of `s` as one JSON value with optional surrounding white
 * space. The whole document is always validated, but only values nested at
 * most `store_depth` deep are stored (0 = the root only, 1 = the root and its
 * members, -1 = all): a proxy that needs a request's top-level fields does
 * not pay a token for every word of a long conversation. Returns 0 and fills
 * `res->ntok`, or LTG_ERR with res->err and res->err_offset set (also when
 * more than `max` tokens would be stored). */
int json_parse(const char *s, size_t len, json_tok *t, int max, int store_depth, json_result *res);

/* Validate s as json_parse does, storing no token, and check the member
 * names of every object at every depth: a name repeated in one object
 * (compared unescaped) fails it with res->err "a member name repeated in
 * one object" and res->err_offset at the repeated name -- a proxy and the
 * server behind it could read such a document differently. `member`, when
 * not NULL, is called for each member whose value is a string, with the
 * name and the value still escaped. Work is n log n; the names of the
 * objects open at once are at most 65,536. */
typedef void json_member_fn(void *ctx, const char *name, size_t nlen, const char *value,
                            size_t vlen);
int json_scan(const char *s, size_t len, json_member_fn *member, void *ctx, json_result *res);

/* In object token `obj`, the index of the value whose key equals `key`, or -1
 * (also when the object's members were too deep to be stored). */
int json_get(const char *s, const json_tok *t, int obj, const char *key);
/* The key token of the first member of object `obj` whose key (unescaped)
 * repeats an earlier one, or -1. */
int json_duplicate_key(const char *s, const json_tok *t, int obj);
/* 1 when token i is a string equal to `lit` (compared unescaped). */
int json_eq(const char *s, const json_tok *t, int i, const char *lit);
/* Append the unescaped bytes of string token i to `out` (UTF-8). */
void json_unescape(const char *s, const json_tok *t, int i, buf *out);
/* Read number token i; returns 0, or LTG_ERR when it is not a number. */
int json_number(const char *s, const json_tok *t, int i, double *out);

/* ===== JSON writer =====
 * Appends to a buf and inserts the commas itself: call jw_key() before each
 * member of an object, then the value. Strings are escaped per RFC 8259
 * (control characters as \u00XX); invalid UTF-8 is written as U+FFFD.
 * jw_key takes a string literal (plain ASCII, as every name ltg writes:
 * copied as it is, quotes and ':' joined at compile time); jw_name any other
 * name, escaped when it must be. */
typedef struct {
    buf *out;
    int depth;
    uint64_t need_comma; /* bit d: the container at depth d already has a member */
} jwriter;

void jw_init(jwriter *w, buf *out);
void jw_open(jwriter *w, char brace); /* '{' or '[' */
void jw_close(jwriter *w, char brace); /* '}' or ']' */
#define jw_key(w, literal) jw_lit_key((w), "\"" literal "\":", sizeof(literal) + 2)
void jw_lit_key(jwriter *w, const char *quoted, size_t n);
void jw_name(jwriter *w, const char *name);
void jw_str(jwriter *w, const char *s, size_t n);
void jw_cstr(jwriter *w, const char *s); /* NULL writes null */
/* a string literal of plain ASCII as a value, its quotes joined at compile time */
#define jw_lit(w, literal) jw_raw((w), "\"" literal "\"", sizeof(literal) + 1)
void jw_int(jwriter *w, long long v);
void jw_num(jwriter *w, double v);
void jw_bool(jwriter *w, int v);
void jw_null(jwriter *w);
void jw_raw(jwriter *w, const char *json, size_t n); /* an already-encoded value */

/* ===== HTTP/1.1 messages =====
 * The head parsers take the whole head (through the blank line): find it
 * with http_head_end(), which resumes where it stopped, so a head that
 * arrives one byte at a time is scanned once. */
typedef struct {
    uint32_t off, len;
} slice;

#define HTTP_MAX_HEADERS 64

typedef struct {
    slice name, value;
} http_header;

typedef struct {
    /* target: origin-form; of an absolute-form one, the path and query (empty: neither, i.e. "/") */
    slice method, target;
    int minor;              /* HTTP/1.<minor> */
    http_header h[HTTP_MAX_HEADERS];
    int nh;
    int status;             /* on LTG_ERR: the status to answer (400, 431, 501) */
    const char *err;        /* on LTG_ERR: why */
    /* Framing and connection facts, derived from the headers: */
    long long content_length; /* -1 when absent */
    int chunked, keep_alive, expect_continue;
} http_request;

typedef struct {
    int status, minor;
    slice reason;
    http_header h[HTTP_MAX_HEADERS];
    int nh;
    const char *err;
    long long content_length;
    int chunked, keep_alive;
} http_response;

/* Look for the end of a head in buf[0..len). `*scan` is where the previous
 * call stopped (start at 0). Returns the head's length including the blank
 * line, or LTG_AGAIN. */
int http_head_end(const char *buf, size_t len, size_t *scan);
/* Parse a complete request head of `len` bytes. Returns len or LTG_ERR. */
int http_parse_request(const char *buf, size_t len, http_request *r);
/* Parse a complete response head of `len` bytes. Returns len or LTG_ERR. */
int http_parse_response(const char *buf, size_t len, http_response *r);
/* The value of header `name` (case-insensitive) or NULL; `*n` gets its length. */
const char *http_header_get(const char *buf, const http_header *h, int nh, const char *name,
                            size_t *n);

/* Chunked transfer coding, decoded incrementally. */
typedef enum { CHUNK_SIZE, CHUNK_SIZE_WS, CHUNK_EXT, CHUNK_SIZE_LF, CHUNK_DATA, CHUNK_DATA_CR, CHUNK_DATA_LF,
               CHUNK_TRAILER, CHUNK_TRAILER_LF, CHUNK_DONE, CHUNK_ERROR } chunk_state;

typedef struct {
    chunk_state state;
    uint64_t left;    /* bytes left in the current chunk */
    int digits;       /* hex digits read for the current size */
    int line;         /* bytes of the current extension or trailer line */
    int trailer;      /* bytes of all trailer lines, bounded */
} chunk_decoder;

/* Decode up to `n` bytes of `in`, appending the data to `out`. Returns bytes
 * consumed (it stops right after the final CRLF of the message), or LTG_ERR.
 * d->state == CHUNK_DONE once the last chunk and its trailers are read. */
long chunk_decode(chunk_decoder *d, const char *in, size_t n, buf *out);

/* Server-sent events: the length of the first complete event in s[0..n)
 * including its blank line ("\n\n", "\r\n\r\n" or mixed), or 0 if none yet. */
size_t sse_event_len(const char *s, size_t n);

/* The data of one SSE event ev[0..n): its "data:" field values (one leading
 * space dropped), joined by newlines, into `out` (emptied first). Returns
 * 0 when the event has no data line (a comment, an "event:" alone). */
int sse_event_data(const char *ev, size_t n, buf *out);

/* ===== The attempt planner =====
 * For a requested model M the plan is [M] + fallbacks[M], each model with up
 * to max_attempts attempts. Every attempt ends in one outcome; the outcome
 * alone decides what happens next (README "Retries and fallback"). These functions are pure:
 * no sockets, no clock, so the table can be tested row by row. */
typedef enum { BACKOFF_CONSTANT, BACKOFF_LINEAR, BACKOFF_EXPONENTIAL } backoff_kind;

typedef enum {
    OUTCOME_OK,            /* 2xx */
    OUTCOME_NO_WORK,       /* nothing reached the provider, 429, 529 */
    OUTCOME_INDETERMINATE, /* timeout, 408, 5xx, connection lost after sending */
    OUTCOME_TERMINAL,      /* context length, 400, 401, 403, 422, other 4xx but 404 */
    OUTCOME_UNKNOWN_MODEL, /* 404 */
    OUTCOME_CIRCUIT_OPEN,  /* the breakers of all the model's deployments are open: no call made */
    OUTCOME_UNTRANSLATABLE /* the request cannot be carried to the model's API: no call made */
} attempt_outcome;

typedef enum {
    PLAN_ANSWER,      /* the outcome's answer goes to the client */
    PLAN_RETRY_NOW,   /* the same model again at once: another deployment, or the next key */
    PLAN_RETRY_AFTER, /* the same model again after step.delay_ms: the backoff, or Retry-After */
    PLAN_NEXT_MODEL,  /* the next model of the chain, at once */
    PLAN_GIVE_UP      /* nothing left to try, or no time left (step.late) */
} plan_action;

typedef struct {
    int nmodels;      /* 1 + the fallbacks: at most 4 */
    int model;        /* the current model's index in the chain */
    int attempt;      /* the current attempt's number on that model, from 1 */
    int max_attempts; /* per model, 1..5 */
    int backoff;      /* backoff_kind */
    int delay_ms;     /* the backoff's base delay */
} attempt_plan;

/* What is known when an attempt ends, besides its outcome. */
typedef struct {
    attempt_outcome outcome;
    int key_refused;          /* a 401/403, and the provider has another key to try */
    int other_deployment;     /* another deployment of the model could take the attempt now */
    long retry_after_ms;      /* the provider's Retry-After (-1: none) */
    unsigned jitter_permille; /* 0..200, for the backoff */
    long long now, deadline;  /* ms: no attempt starts at or after the deadline */
} plan_facts;

typedef struct {
    plan_action action;
    long delay_ms; /* PLAN_RETRY_AFTER: the wait */
    int next_key;  /* PLAN_RETRY_NOW: the same deployment with the provider's next key */
    int late;      /* PLAN_GIVE_UP: because of the deadline */
} plan_step;

/* A plan at its first attempt. */
attempt_plan plan_start(int nmodels, int max_attempts, int backoff, int delay_ms);
/* After an attempt: the whole decision of what comes next (README "Retries
 * and fallback", row by row); the plan moves to the attempt it names. */
plan_step plan_next(attempt_plan *p, const plan_facts *f);
/* The outcome of an answer with HTTP `status`, or of a failure with no
 * status (status 0): `reached` says whether any byte of the request was
 * handed to the provider's connection. */
attempt_outcome attempt_classify(int status, int reached);
/* Is this error answer a context-length refusal (code
 * context_length_exceeded, or a message saying so)? */
int attempt_context_length(int status, const char *body, size_t n);
const char *outcome_name(attempt_outcome o);
/* The delay before attempt n (n >= 2) of a model: delay_ms x 1, x (n-1) or
 * x 2^(n-2) for a constant, linear or exponential backoff, plus
 * jitter_permille/1000 of that (0..200: jitter only lengthens), capped at
 * 10 s. */
long backoff_ms(int backoff, int delay_ms, int n, unsigned jitter_permille);
/* A Retry-After value (delta-seconds or an HTTP date) in ms from `now`
 * (seconds since the epoch); -1 when it is neither. */
long retry_after_ms(const char *v, size_t n, long long now);

/* ===== The engine's hooks =====
 * ltg.c's engine -- the event loop (section 5), the HTTP/1.1 server (15)
 * and the upstream client (9) -- knows nothing of groups, budgets or
 * ledgers: it calls the gateway only through these, which the gateway sets
 * once at start-up (Redis's aeSetBeforeSleepProc, not calls by name). */
typedef struct conn conn;
typedef struct upstream upstream;

typedef struct {
    /* Each turn, in order, before the loop sleeps in poll(): flush what is
     * pending, write the turn's records... One returns 1 when work remains
     * that should not wait for an event: the loop then polls without
     * sleeping. */
    int (*before_sleep[4])(void);
    void (*woke)(void);  /* after each poll: act on the signals that came */
    int (*done)(void);   /* 1: loop_run() returns */
} loop_hooks;

/* The server hands every request whose head and body are in to serve(c).
 * It answers, now or from a later turn, with the server's reply functions,
 * which end the request (conn_done): the server then parses the next
 * pipelined request on its own turn -- replying never re-enters the
 * parser. */
typedef void server_serve(conn *c);
/* Once a request's head parses, before its body is read, the server calls
 * begin(c): what it learns of the request there (its id, its endpoint) is
 * known to the errors the server may answer before serve(c), a body too
 * large or too slow. It may set c->refuse_body to 401 (no key that may send
 * a body), 404 (no such path) or 413 (a path that takes none): a body that is not whole after
 * the read that brought its head is then refused so, and the connection
 * closed. */
typedef void server_begin(conn *c);
/* Once per request, when it is over -- its answer handed to the socket, or
 * its client gone first -- the server calls ended(c), which may read the
 * request and what the server recorded of its answer (the access log and
 * the metrics, in ltg). */
typedef void server_ended(conn *c);
/* An error the server finds itself -- a head too large, a malformed body,
 * a body too slow -- and every error a handler answers with conn_error:
 * error(c, status, code, headers, message) answers it in the shape of the
 * API the listener serves, with the server's reply functions. `headers`:
 * extra header lines (each ending in CRLF), or NULL. */
typedef void server_error(conn *c, int status, const char *code, const char *headers,
                          const char *msg);

/* A request served over several turns has an owner (the inference
 * exchange); the server tells it: */
typedef struct {
    void (*gone)(void *owner);    /* the client left: let go of the connection, now */
    void (*drained)(void *owner); /* the client has read all that waited for it */
} conn_owner;

/* An upstream connection tells its owner of news -- its answer's head,
 * more of the body, the end, a failure -- by calling event(owner), which
 * reads the connection's state. Never from inside the call that started or
 * released it: a failure is reported on a later turn. */
typedef void upstream_event(void *owner);

#endif
