/* tests/fuzz.c -- libFuzzer targets for ltg's readers of untrusted bytes.
 *
 * One target per build, chosen with -DFUZZ_<NAME>:
 *   HTTP_REQUEST   http_head_end (whole, in two parts, byte by byte), then
 *                  http_parse_request on the head and chunk_decode on the rest
 *   HTTP_RESPONSE  http_parse_response on the head (Retry-After read), then
 *                  chunk_decode over the rest, then sse_event_len event by
 *                  event over what it decoded (each event's data and usage read)
 *   JSON           json_parse at several depths and token limits, every
 *                  string unescaped and written back, every object checked
 *                  for duplicate keys, every number read; jw_str round trip
 *   CONFIG         catalog_load of the input as text
 *   LOG_REPLAY     the input as DATA/state.log replayed by log_open; or, when
 *                  it starts with a ledger segment's magic, as a day of the
 *                  ledger, opened as today, then as a sealed day (its index
 *                  rebuilt), then from that index: the answers must agree;
 *                  or, with the magic of an earlier version's ledger.log,
 *                  migrated into days
 *   DNS            dns_parse_answer, and dns_build_query on a name from the
 *                  input, whose answer must then parse
 *   STORED         every kind's parse (create, patch, log) and validate
 *                  (groups and keys, through their rows): what the API took
 *                  survives the log; a PATCH leaves its base
 *   TLS_ANCHORS    tls_load_anchors on the input as a PEM or DER file
 *   XL             the translator (section 17): a JSON input as a request
 *                  both ways and as an answer both ways; any input as a
 *                  provider's stream of either API, fed event by event to
 *                  the other's encoder. Every body and every event's data
 *                  written must parse as JSON
 * `make fuzz` builds each as tests/fuzz-<name> and runs it over its seeds in
 * tests/fuzz/<name>/.
 *
 * Like tests/unit.c it includes ltg.c without its main() to reach the
 * static functions. A parser gets a heap copy of exactly its bytes, so ASan
 * sees a read one byte past the end. What must hold whatever the input (the
 * same answer whole and split, a writer's output parses, a group the API
 * took survives the log) is checked too: a violation prints why and aborts,
 * which libFuzzer reports as a crash with the input that caused it.
 */
#if !defined(FUZZ_HTTP_REQUEST) && !defined(FUZZ_HTTP_RESPONSE) && !defined(FUZZ_JSON) && !defined(FUZZ_CONFIG) && \
    !defined(FUZZ_LOG_REPLAY) && !defined(FUZZ_DNS) && !defined(FUZZ_STORED) && \
    !defined(FUZZ_TLS_ANCHORS) && !defined(FUZZ_RESP) && !defined(FUZZ_XL)
#error "choose a target: -DFUZZ_HTTP_REQUEST, ..., -DFUZZ_RESP (or run make fuzz)"
#endif

#define LTG_NO_MAIN
#include "../ltg.c"

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* stderr as it was at start-up: `make fuzz` runs with -close_fd_mask=2 to
 * silence ltg_log, and a failed check must still be heard. */
static int report_fd = 2;

static void scratch_remove(void);

static void fuzz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fuzz_fail(const char *fmt, ...) {
    char m[1024];
    int k = snprintf(m, sizeof m, "fuzz: check failed: ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m + k, sizeof m - (size_t)k - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(m);
    m[len++] = '\n';
    if (write(report_fd, m, len) < 0) { /* nowhere to say it */ }
    scratch_remove();
    abort();
}

#define REQUIRE(cond, ...)                  \
    do {                                    \
        if (!(cond)) fuzz_fail(__VA_ARGS__); \
    } while (0)

/* A heap copy of exactly n bytes (a read past them is an ASan report). */
static char *copy(const void *p, size_t n) {
    char *c = malloc(n);
    if (n) memcpy(c, p, n);
    return c;
}

/* A copy with a NUL after it, for the functions that take C strings. */
static char *cstr(const void *p, size_t n) {
    char *c = malloc(n + 1);
    if (n) memcpy(c, p, n);
    c[n] = 0;
    return c;
}

/* FNV-1a of the input: split points and limits that vary with the input
 * but need no bytes of their own, so every seed is a plain example. */
static uint64_t input_hash(const uint8_t *d, size_t n) { return hash_bytes(d, n); }

/* Is s[0..n) valid UTF-8 as ltg's reader defines it? */
static int utf8_ok(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        int k = utf8_len((const unsigned char *)s, i, n);
        if (!k) return 0;
        i += (size_t)k;
    }
    return 1;
}

/* Write the input to `path`; aborts when it cannot (the machine, not ltg). */
static void write_input(const char *path, const void *p, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0 && write_all(fd, p, n) == 0, "cannot write %s: %s", path, strerror(errno));
    close(fd);
}

/* A scratch directory for the targets that write a file per input (log,
 * TLS): under $LTG_FUZZ_TMP when set (`make fuzz` sets it and removes it
 * after the run, whatever happened), else on tmpfs when there is one. Removed
 * at exit and when a check fails; a sanitizer's report leaves it behind. */
static char scratch[256];
/* Remove what the targets leave in the scratch directory (and, with
 * `self`, the directory): files, and the files of its subdirectories. */
static void scratch_empty(const char *dir, int self) {
    DIR *d = opendir(dir);
    char path[600];
    for (struct dirent *de; d && (de = readdir(d));) {
        if (de->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if (unlink(path) < 0) scratch_empty(path, 1);
    }
    if (d) closedir(d);
    if (self) rmdir(dir);
}
static void scratch_clean(void) { scratch_empty(scratch, 0); }
static void scratch_remove(void) {
    if (!scratch[0]) return;
    scratch_empty(scratch, 1);
    scratch[0] = 0;
}
static void scratch_make(void) {
    const char *parent = getenv("LTG_FUZZ_TMP");
    if (!parent || !*parent) parent = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(scratch, sizeof scratch, "%.200s/ltg-fuzz-XXXXXX", parent);
    REQUIRE(mkdtemp(scratch), "mkdtemp %s: %s", scratch, strerror(errno));
    atexit(scratch_remove);
}

static void target_init(void);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    report_fd = dup(2);
    if (report_fd < 0) report_fd = 2;
    target_init();
    return 0;
}

/* ---- HTTP: shared checks ---- */

#if defined(FUZZ_HTTP_REQUEST) || defined(FUZZ_HTTP_RESPONSE)

/* The head's end found whole, in two parts cut at `cut` (the first part an
 * exact copy, so a look past its end is caught), and byte by byte: all three
 * must agree. Returns it. */
static int head_end_checked(const char *b, size_t n, size_t cut) {
    size_t scan = 0;
    int whole = http_head_end(b, n, &scan);
    REQUIRE(whole == LTG_AGAIN || (whole > 0 && (size_t)whole <= n), "http_head_end returned %d for %zu bytes", whole, n);
    REQUIRE(scan <= n, "scan %zu past %zu bytes", scan, n);

    char *first = copy(b, cut);
    scan = 0;
    int two = http_head_end(first, cut, &scan);
    free(first);
    if (two == LTG_AGAIN) {
        REQUIRE(scan <= cut, "scan %zu past the first part's %zu bytes", scan, cut);
        two = http_head_end(b, n, &scan);
    }
    REQUIRE(two == whole, "head end: whole %d, cut at %zu %d", whole, cut, two);

    int bytewise = LTG_AGAIN;
    scan = 0;
    for (size_t k = 1; k <= n && bytewise == LTG_AGAIN; k++) bytewise = http_head_end(b, k, &scan);
    REQUIRE(bytewise == whole, "head end: whole %d, byte by byte %d", whole, bytewise);
    return whole;
}

/* Each header slice lies inside the head. */
static void headers_in(const http_header *h, int nh, size_t len) {
    REQUIRE(nh >= 0 && nh <= HTTP_MAX_HEADERS, "nh %d", nh);
    for (int i = 0; i < nh; i++) {
        REQUIRE(h[i].name.len > 0 && (size_t)h[i].name.off + h[i].name.len <= len, "header %d name outside the head", i);
        REQUIRE((size_t)h[i].value.off + h[i].value.len <= len, "header %d value outside the head", i);
    }
}

/* Decode in[0..n) as a chunked body three ways -- whole; one byte at a
 * time; in pieces of input-derived sizes, each an exact copy -- and require
 * the same outcome. The whole decode's output is left in *out (empty on an
 * error). */
static void chunk_checked(const char *in, size_t n, uint64_t h, buf *out) {
    chunk_decoder a = {0};
    long ka = chunk_decode(&a, in, n, out);
    REQUIRE(ka == LTG_ERR || (ka >= 0 && (size_t)ka <= n), "chunk_decode returned %ld for %zu bytes", ka, n);
    REQUIRE(ka != LTG_ERR || a.state == CHUNK_ERROR, "an error leaves state %d", a.state);
    if (ka == LTG_ERR) {
        buf junk = {0};
        REQUIRE(chunk_decode(&a, "0\r\n\r\n", 5, &junk) == LTG_ERR, "a chunk error is not sticky");
        buf_free(&junk);
    }

    for (int mode = 0; mode < 2; mode++) {
        chunk_decoder b = {0};
        buf ob = {0};
        size_t used = 0;
        long kb = 0;
        uint64_t r = h | 1;
        while (used < n && b.state != CHUNK_DONE) {
            size_t step = 1;
            if (mode) {
                r ^= r << 13, r ^= r >> 7, r ^= r << 17; /* xorshift */
                step = 1 + (size_t)(r % 64);
                if (step > n - used) step = n - used;
            }
            char *piece = copy(in + used, step);
            long k = chunk_decode(&b, piece, step, &ob);
            free(piece);
            if (k < 0) { kb = k; break; }
            REQUIRE(k > 0 && (size_t)k <= step, "chunk_decode consumed %ld of %zu bytes in state %d", k, step, b.state);
            used += (size_t)k;
        }
        const char *how = mode ? "in pieces" : "byte by byte";
        REQUIRE((ka < 0) == (kb < 0), "chunked: whole %s, %s %s", ka < 0 ? "fails" : "passes", how, kb < 0 ? "fails" : "passes");
        if (ka >= 0) {
            REQUIRE((size_t)ka == used && a.state == b.state, "chunked: whole used %ld (state %d), %s %zu (state %d)", ka, a.state, how,
                    used, b.state);
            REQUIRE(out->len == ob.len && (!ob.len || memcmp(out->p, ob.p, ob.len) == 0), "chunked: whole and %s decode differently", how);
        }
        buf_free(&ob);
    }
    if (ka < 0) out->len = 0;
}

#endif

/* ---- http_request ---- */

#ifdef FUZZ_HTTP_REQUEST
static void target_init(void) {}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    uint64_t h = input_hash(d, n);
    char *b = copy(d, n);
    int end = head_end_checked(b, n, (size_t)(h % (n + 1)));
    size_t body = 0;
    if (end > 0) {
        body = (size_t)end;
        char *head = copy(b, body);
        http_request r;
        int rc = http_parse_request(head, body, &r);
        if (rc == LTG_ERR) {
            REQUIRE(r.err && (r.status == 400 || r.status == 431 || r.status == 501 || r.status == 417), "request error without a reason (status %d)", r.status);
        } else {
            REQUIRE(rc == end, "http_parse_request returned %d for a head of %d", rc, end);
            REQUIRE(r.method.len > 0 && (size_t)r.method.off + r.method.len <= body, "method outside the head");
            REQUIRE((r.target.len > 0 || memmem(head, body, "://", 3)) && (size_t)r.target.off + r.target.len <= body,
                    "target outside the head (empty only for an absolute-form one without path or query)");
            REQUIRE(r.minor >= 0 && r.minor <= 9, "minor %d", r.minor);
            REQUIRE(!(r.chunked && r.content_length >= 0), "both chunked and a Content-Length taken");
            headers_in(r.h, r.nh, body);
            size_t vn;
            const char *v = http_header_get(head, r.h, r.nh, "host", &vn);
            REQUIRE(r.minor == 0 || v, "HTTP/1.1 without Host taken");
            if (v) REQUIRE(v >= head && v + vn <= head + body, "Host value outside the head");
        }
        free(head);
    }
    buf out = {0};
    chunk_checked(b + body, n - body, h, &out);
    buf_free(&out);
    free(b);
    return 0;
}
#endif

/* ---- http_response ---- */

#ifdef FUZZ_HTTP_RESPONSE
static void target_init(void) {}

/* Walk s[0..n) event by event as the stream relay does; an event complete
 * in a prefix is the same event in the whole. */
static void sse_walk(const char *s, size_t n, uint64_t h) {
    char *c = copy(s, n);
    exchange x;
    memset(&x, 0, sizeof x);
    x.hide_usage = 1, x.kind = x.up = &WIRE[h % 2 ? 0 : 3]; /* chat, or the Responses API */
    size_t off = 0, k;
    while ((k = sse_event_len(c + off, n - off)) > 0) {
        REQUIRE(k <= n - off, "sse_event_len %zu past the %zu bytes left", k, n - off);
        size_t m = (size_t)(h % (n - off + 1));
        char *prefix = copy(c + off, m);
        size_t kp = sse_event_len(prefix, m);
        free(prefix);
        REQUIRE(kp == 0 || kp == k, "sse: the first event is %zu bytes, in a prefix of %zu bytes %zu", k, m, kp);
        char *ev = copy(c + off, k);
        stream_take(&x, ev, k);
        free(ev);
        off += k;
        h = h * 6364136223846793005ULL + 1442695040888963407ULL;
    }
    buf_free(&x.event);
    free(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    uint64_t h = input_hash(d, n);
    char *b = copy(d, n);
    int end = head_end_checked(b, n, (size_t)(h % (n + 1)));
    size_t body = 0;
    int status = 200;
    if (end > 0) {
        body = (size_t)end;
        char *head = copy(b, body);
        http_response r;
        int rc = http_parse_response(head, body, &r);
        if (rc == LTG_ERR) {
            REQUIRE(r.err != NULL, "response error without a reason");
        } else {
            REQUIRE(rc == end, "http_parse_response returned %d for a head of %d", rc, end);
            REQUIRE(r.status >= 0 && r.status <= 999 && r.minor >= 0 && r.minor <= 9, "status %d minor %d", r.status, r.minor);
            REQUIRE((size_t)r.reason.off + r.reason.len <= body, "reason outside the head");
            REQUIRE(!(r.chunked && r.content_length >= 0), "both chunked and a Content-Length taken");
            headers_in(r.h, r.nh, body);
            status = r.status;
            size_t vn;
            const char *v = http_header_get(head, r.h, r.nh, "retry-after", &vn);
            if (v) {
                char *val = copy(v, vn);
                long ms = retry_after_ms(val, vn, 784111777);
                REQUIRE(ms >= -1, "retry_after_ms %ld", ms);
                free(val);
            }
        }
        free(head);
    }
    buf out = {0};
    chunk_checked(b + body, n - body, h, &out);
    sse_walk(out.p, out.len, h);
    sse_walk(b + body, n - body, h >> 7); /* a body without chunked coding */
    int no_choices;
    char *dec = copy(out.p, out.len);
    for (size_t k = 0; k < sizeof WIRE / sizeof *WIRE; k++) { /* every kind's usage, classes and all: none trusts the input */
        usage_counts uc = {0};
        long long tok[NTOK];
        usage_read(&WIRE[k], WIRE[k].event_usage, dec, out.len, &uc, &no_choices);
        if (usage_classes(&WIRE[k], &uc, tok) == 0)
            for (int c = 0; c < NTOK; c++) REQUIRE(tok[c] >= 0 && tok[c] <= 3LL * MAX_USAGE_TOKENS, "class %d: %lld", c, tok[c]);
        usage_read(&WIRE[k], NULL, dec, out.len, &uc, &no_choices);
    }
    attempt_context_length(status == 413 ? 413 : 400, dec, out.len);
    free(dec);
    buf_free(&out);
    free(b);
    return 0;
}
#endif

/* ---- json ---- */

#ifdef FUZZ_JSON
static void target_init(void) {}

/* Everything a caller may do with a parse's tokens; and the tree must be
 * a tree: `next` and `size` agree wherever children were stored. */
static void json_walk(const char *s, size_t n, const json_tok *t, int ntok) {
    REQUIRE(ntok >= 1, "a parse without tokens");
    for (int i = 0; i < ntok; i++) {
        REQUIRE(t[i].start <= t[i].end && t[i].end <= n, "token %d spans %u..%u of %zu", i, t[i].start, t[i].end, n);
        REQUIRE(t[i].next > i && t[i].next <= ntok, "token %d: next %d of %d", i, t[i].next, ntok);
        if (t[i].type == JSON_OBJECT || t[i].type == JSON_ARRAY) {
            REQUIRE(t[i].size >= 0, "token %d: size %d", i, t[i].size);
            if (t[i].size && t[i].next == i + 1) continue; /* members not stored */
            int j = i + 1;
            for (int m = 0; m < t[i].size; m++) {
                REQUIRE(j < t[i].next, "token %d: child %d at %d past next %d", i, m, j, t[i].next);
                if (t[i].type == JSON_OBJECT) {
                    REQUIRE(t[j].type == JSON_STRING && j + 1 < t[i].next, "token %d: member %d has no key and value", i, m);
                    j = t[j + 1].next;
                } else {
                    j = t[j].next;
                }
            }
            REQUIRE(j == t[i].next, "token %d: children end at %d, next is %d", i, j, t[i].next);
            if (t[i].type == JSON_OBJECT) {
                int dup = json_duplicate_key(s, t, i);
                REQUIRE(dup == -1 || (dup > i && dup < t[i].next && t[dup].type == JSON_STRING), "duplicate key %d", dup);
                json_get(s, t, i, "model");
            }
        } else if (t[i].type == JSON_STRING) {
            buf u = {0}, w2 = {0}, u2 = {0};
            json_unescape(s, t, i, &u);
            REQUIRE(utf8_ok(u.p, u.len), "token %d unescapes to invalid UTF-8", i);
            json_eq(s, t, i, "model");
            /* Written back, it parses and unescapes to the same bytes. */
            jwriter w;
            jw_init(&w, &w2);
            jw_str(&w, u.p ? u.p : "", u.len);
            json_tok t2[2];
            json_result r2;
            char *again = copy(w2.p, w2.len);
            REQUIRE(json_parse(again, w2.len, t2, 2, -1, &r2) == 0 && t2[0].type == JSON_STRING, "written string does not parse: %s", r2.err);
            json_unescape(again, t2, 0, &u2);
            REQUIRE(u.len == u2.len && (!u.len || memcmp(u.p, u2.p, u.len) == 0), "token %d: unescape, write, unescape changes it", i);
            free(again);
            buf_free(&u), buf_free(&w2), buf_free(&u2);
        } else if (t[i].type == JSON_NUMBER) {
            double v;
            int rc = json_number(s, t, i, &v);
            REQUIRE(rc == 0 || rc == LTG_ERR, "json_number %d", rc);
            long long ll;
            json_int(s, t, i, &ll);
        } else {
            REQUIRE(t[i].type == JSON_TRUE || t[i].type == JSON_FALSE || t[i].type == JSON_NULL, "token %d: type %d", i, t[i].type);
        }
    }
}

static const char *scan_doc;
static size_t scan_len;
static int scan_members;

/* json_scan's callback: name and value lie inside the document. */
static void scan_member(void *ctx, const char *name, size_t nlen, const char *v, size_t vlen) {
    (void)ctx;
    REQUIRE(name >= scan_doc && name + nlen <= scan_doc + scan_len && v >= scan_doc && v + vlen <= scan_doc + scan_len,
            "json_scan's member outside the document");
    scan_members++;
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    uint64_t h = input_hash(d, n);
    char *s = copy(d, n);
    int big = (int)(n / 2 + 4); /* at least one byte a token (and 2 for most) */
    json_tok *t = malloc((size_t)big * sizeof *t);
    json_result res;

    int all = json_parse(s, n, t, big, -1, &res);
    int ntok = res.ntok;
    if (all == 0) json_walk(s, n, t, ntok);
    else REQUIRE(all == LTG_ERR && res.err && res.err_offset <= n, "error %d at %zu", all, res.err_offset);

    /* json_scan takes exactly the documents json_parse takes whose objects
     * each name a member once (json_duplicate_key, object by object). */
    int dup = 0;
    for (int i = 0; all == 0 && i < ntok; i++)
        if (t[i].type == JSON_OBJECT && json_duplicate_key(s, t, i) >= 0) dup = 1;
    scan_doc = s, scan_len = n, scan_members = 0;
    int scanned = json_scan(s, n, scan_member, NULL, &res);
    REQUIRE(scanned == (all == 0 && !dup ? 0 : LTG_ERR), "json_scan %s a document json_parse %s (a repeated name: %d): %s",
            scanned ? "refuses" : "takes", all ? "refuses" : "takes", dup, scanned ? res.err : "");
    if (dup && all == 0) REQUIRE(strstr(res.err, "repeated") && res.err_offset < n && s[res.err_offset - 1] == '"', "a repeated name not pointed at");

    json_tok *t1 = malloc((size_t)big * sizeof *t1);
    int shallow = json_parse(s, n, t1, big, 1, &res);
    REQUIRE(shallow == all, "store_depth -1 %s, 1 %s", all ? "fails" : "passes", shallow ? "fails" : "passes");
    if (shallow == 0) {
        REQUIRE(res.ntok <= ntok, "shallow parse stores more tokens (%d) than the deep one (%d)", res.ntok, ntok);
        json_walk(s, n, t1, res.ntok);
    }
    free(t1);

    /* A small token budget: the same tokens while it suffices. */
    int small = 1 + (int)(h % 16);
    json_tok *ts = malloc((size_t)small * sizeof *ts);
    int lim = json_parse(s, n, ts, small, -1, &res);
    if (all != 0) REQUIRE(lim == LTG_ERR, "a document refused with room for every token is taken with %d", small);
    else if (ntok <= small) REQUIRE(lim == 0 && res.ntok == ntok && memcmp(ts, t, (size_t)ntok * sizeof *t) == 0, "%d tokens fit in %d, refused or different: %s", ntok, small, res.err);
    else REQUIRE(lim == LTG_ERR && strstr(res.err, "too many"), "%d tokens taken with room for %d", ntok, small);
    int root = json_parse(s, n, ts, 1, 0, &res);
    REQUIRE(root == all, "root-only parse disagrees");
    free(ts);
    free(t);

    /* The writer: any bytes make a string that parses and reads back (the
     * same bytes when they were valid UTF-8). */
    buf out = {0}, back = {0};
    jwriter w;
    jw_init(&w, &out);
    jw_open(&w, '[');
    jw_str(&w, s, n);
    double v = 0;
    if (n >= 8) memcpy(&v, d, 8);
    jw_num(&w, v);
    jw_int(&w, (long long)h);
    jw_close(&w, ']');
    char *o = copy(out.p, out.len);
    json_tok tw[4];
    REQUIRE(json_parse(o, out.len, tw, 4, -1, &res) == 0 && res.ntok == 4 && tw[1].type == JSON_STRING,
            "writer output refused: %s at %zu: %.200s", res.err, res.err_offset, out.p);
    json_unescape(o, tw, 1, &back);
    if (utf8_ok(s, n)) REQUIRE(back.len == n && (!n || memcmp(back.p, s, n) == 0), "jw_str then json_unescape changes valid UTF-8");
    double nv;
    REQUIRE(tw[2].type == JSON_NULL || json_number(o, tw, 2, &nv) == 0, "jw_num wrote a number json_number refuses");
    free(o);
    buf_free(&out), buf_free(&back);
    free(s);
    return 0;
}
#endif

/* ---- config ---- */

#ifdef FUZZ_CONFIG
static void target_init(void) {
    setenv("LTG_FUZZ_KEY", "fuzz-secret", 1);
    unsetenv("LTG_FUZZ_UNSET");
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    char *text = cstr(d, n);
    char err[512];
    err[0] = 0;
    catalog *c = catalog_load("fuzz.json", text, err, sizeof err);
    if (!c) {
        REQUIRE(strncmp(err, "fuzz.json: ", 11) == 0, "a refusal that does not name the file: \"%s\"", err);
    } else {
        REQUIRE(c->nprov > 0 && c->nmodels > 0, "a catalog without providers or models");
        for (int i = 0; i < c->nmodels; i++) {
            model *m = &c->models[i];
            REQUIRE(m->alias && *m->alias && m->ndep >= 1 && m->ndep <= MAX_DEPLOYMENTS, "model %d incomplete", i);
            for (int k = 0; k < m->ndep; k++)
                REQUIRE(m->dep[k].p && m->dep[k].upstream && *m->dep[k].upstream && m->dep[k].m == m && m->dep[k].weight >= 1 &&
                        m->dep[k].weight <= 100 && m->dep[k].p->api == m->api, "model %d, deployment %d incomplete", i, k);
            REQUIRE(catalog_model(c, m->alias, strlen(m->alias)) == m, "model %s not found by its alias", m->alias);
        }
        for (int i = 0; i < c->nprov; i++) {
            provider *p = &c->prov[i];
            REQUIRE(p->host && *p->host && p->base_path && p->hostport && p->port > 0 && p->port < 65536, "provider %d incomplete", i);
        }
        catalog_free(c);
    }
    free(text);
    return 0;
}
#endif

/* An item as the log has it, parsed back as replay would, gives the same
 * record (what a compaction writes replays to what it read); with `cat`, it
 * also still passes validation. */
#if defined(FUZZ_LOG_REPLAY) || defined(FUZZ_STORED)
static void log_round_trip(const store_kind *K, const stored *it, const catalog *cat) {
    buf a = {0}, b = {0};
    jwriter w;
    jw_init(&w, &a);
    K->json(&w, it, 1);
    char *s = copy(a.p, a.len);
    json_tok t[256];
    json_result res;
    REQUIRE(json_parse(s, a.len, t, 256, -1, &res) == 0, "a %s's log JSON does not parse: %s: %.300s", K->noun, res.err, a.p);
    stored *again = K->make();
    verr e = {0};
    REQUIRE(K->parse(s, t, 0, again, PARSE_LOG, &e) == 0, "a %s is refused on replay: %s %s: %.300s", K->noun, e.pointer, e.detail, a.p);
    REQUIRE(!cat || K->validate(again, cat, &e) == 0, "a valid %s fails validation after the log: %s %s: %.300s", K->noun, e.pointer, e.detail, a.p);
    jw_init(&w, &b);
    K->json(&w, again, 1);
    REQUIRE(a.len == b.len && memcmp(a.p, b.p, a.len) == 0, "a %s changes through the log:\n%s\n%s", K->noun, a.p, b.p);
    K->drop(again);
    free(s);
    buf_free(&a), buf_free(&b);
}
#endif

/* ---- log_replay ---- */

#ifdef FUZZ_LOG_REPLAY
#include "reset.h"

static void target_init(void) {
    scratch_make();
    options_default();
    S.ledger_index = 8192; /* a few events a chunk: every day of a few dozen is read in parts */
    store_reset();
}

/* What the server does with replayed state: write it out (the API, a
 * compaction). */
static void use_state(void) {
    buf out = {0};
    jwriter w;
    for (int k = 0; k < 2; k++) {
        const store_kind *K = KINDS[k];
        for (int i = 0; i < K->all->n; i++) {
            stored *it = K->all->p[i];
            if (!it) continue;
            REQUIRE(store_find(K, it->id) == it, "%s %d not found by its id", K->noun, i);
            out.len = 0, jw_init(&w, &out), K->json(&w, it, 0);
            log_round_trip(K, it, NULL);
        }
    }
    for (int i = 0; i < ST.iv.n; i++)
        if (ST.iv.p[i]) out.len = 0, jw_init(&w, &out), idem_json(&w, ST.iv.p[i]);
    buf_free(&out);
}

#define FUZZ_DAY 1795910400000LL /* 2026-11-29, the day a segment input is */

/* What the ledger answers about its days: every event, those of the first
 * event's key and group, usage, budgets and the replays. */
static void ledger_answers(buf *out) {
    ledger_query q = {FUZZ_DAY - DAY_MS, FUZZ_DAY + 2 * DAY_MS, NULL, NULL, INT64_MAX, UINT32_MAX};
    jwriter w;
    jw_init(&w, out), jw_open(&w, '[');
    size_t total = ledger_page(&q, 0, 1000, &w);
    char key[37] = "", grp[37] = "";
    if (LG.nseg && seg_count(LG.seg[0])) {
        seg_view v;
        buf rec = {0};
        rec_view rv;
        if (view_open(&v, LG.seg[0], 0, NULL, UINT32_MAX) == 0 && view_record(&v, 0, &rec, &rv) == 0)
            memcpy(key, rv.key, 36), memcpy(grp, rv.group, 36), key[36] = grp[36] = 0;
        view_close(&v), buf_free(&rec);
    }
    q.key = key, total += ledger_page(&q, 0, 7, &w);
    q.group = grp, total += ledger_page(&q, 1, 3, &w);
    q.key = NULL, total += ledger_page(&q, 0, 1000, &w);
    jw_close(&w, ']');
    buf_printf(out, " %zu", total);
    usage_row by_day[3] = {{0}}, all = {0};
    model_usage *mu = NULL;
    int nmu = 0;
    ledger_usage(FUZZ_DAY - DAY_MS, 3, NULL, by_day, &all, &mu, &nmu);
    ledger_usage(FUZZ_DAY - DAY_MS, 3, grp, by_day, &all, &mu, &nmu);
    for (int i = 0; i < 3; i++) {
        buf_printf(out, " %lld/%lld/%lld", by_day[i].requests, by_day[i].abandoned, (long long)by_day[i].spend);
        for (int k = 0; k < NTOK; k++) buf_printf(out, "/%lld", by_day[i].tok[k]); /* every class, whatever the record's version */
    }
    for (int i = 0; i < nmu; i++) buf_printf(out, " %s:%lld", mu[i].alias, mu[i].u.requests);
    free(mu);
    buf_printf(out, " since %lld", (long long)(LG.nseg ? seg_spent_since(LG.seg[0], 'g', grp, FUZZ_DAY + DAY_MS / 2) : 0));
}

static int replays_seen;
static void count_replay(const rec_view *rv, int64_t day, uint64_t off, uint32_t len) {
    (void)rv, (void)day, (void)off, (void)len;
    replays_seen++;
}

/* A day's answers must not depend on how it was read: replayed into memory
 * (the open day), rebuilt into an index file, or read from that file. */
static void fuzz_ledger(const char *path, const uint8_t *f, size_t n) {
    char err[512];
    buf open_day = {0}, rebuilt = {0}, indexed = {0};
    for (int pass = 0; pass < 3; pass++) {
        if (pass < 2) write_input(path, f, n);
        char idx[300];
        snprintf(idx, sizeof idx, "%s/ledger/2026-11-29.idx", scratch);
        if (pass < 2) unlink(idx);
        store_reset();
        err[0] = 0;
        int64_t now = pass == 0 ? FUZZ_DAY + 1000 : FUZZ_DAY + DAY_MS + 1000; /* the same day, then the next */
        if (ledger_open(scratch, now, err, sizeof err) < 0) {
            REQUIRE(err[0], "a refused ledger without a message");
            REQUIRE(pass == 0, "a ledger that opened as the open day is refused as a sealed one: %s", err);
            break;
        }
        budget_rebuild(now);
        replays_seen = 0;
        ledger_replays(0, count_replay);
        ledger_answers(pass == 0 ? &open_day : pass == 1 ? &rebuilt : &indexed);
        buf_printf(pass == 0 ? &open_day : pass == 1 ? &rebuilt : &indexed, " replays %d", replays_seen);
        if (pass == 1) REQUIRE(LG.nseg != 1 || LG.seg[0]->state == SEG_SEALED, "a sealed day's index file was not written");
    }
    if (rebuilt.len) {
        REQUIRE(open_day.len == rebuilt.len && memcmp(open_day.p, rebuilt.p, open_day.len) == 0, "the open day and the rebuilt one differ:\n%s\n%s", open_day.p, rebuilt.p);
        REQUIRE(indexed.len == rebuilt.len && memcmp(indexed.p, rebuilt.p, rebuilt.len) == 0, "the day from its index differs:\n%s\n%s", rebuilt.p, indexed.p);
    }
    buf_free(&open_day), buf_free(&rebuilt), buf_free(&indexed);
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    int segment_in = n >= 8 && memcmp(d, SEG_MAGIC, 8) == 0, v1 = n >= 8 && memcmp(d, LEDGER_V1_MAGIC, 8) == 0;
    /* Checksums are put right (a checksum field of ffffffff is left wrong),
     * so that mutated payloads reach the apply functions. */
    uint8_t *f = (uint8_t *)copy(d, n);
    for (size_t off = 8; n >= 8 && n - off >= 8;) {
        uint32_t len = get_le32(f + off);
        if (len > n - off - 8) break;
        if (get_le32(f + off + 4) != 0xFFFFFFFFu) put_le32(f + off + 4, crc32(f + off + 8, len));
        off += 8 + (size_t)len;
    }
    char path[300], err[512];
    snprintf(path, sizeof path, "%s/ledger", scratch);
    mkdir(path, 0700);
    if (segment_in) {
        snprintf(path, sizeof path, "%s/ledger/2026-11-29.log", scratch);
        fuzz_ledger(path, f, n);
    } else if (v1) { /* an earlier version's ledger.log: migrated into days */
        scratch_clean();
        snprintf(path, sizeof path, "%s/ledger.log", scratch);
        write_input(path, f, n);
        err[0] = 0;
        if (ledger_open(scratch, FUZZ_DAY + 40 * DAY_MS, err, sizeof err) == 0) {
            REQUIRE(access(path, F_OK) != 0, "ledger.log is still there after its migration");
            budget_rebuild(FUZZ_DAY);
        } else REQUIRE(err[0] && access(path, F_OK) == 0, "a refused migration without a message, or without its ledger.log");
    } else {
        snprintf(path, sizeof path, "%s/state.log", scratch);
        write_input(path, f, n);
        err[0] = 0;
        snprintf(LOG.tmp, sizeof LOG.tmp, "%.200s/state.log.tmp", scratch);
        if (log_open(&LOG.f, scratch, "state.log", LOG_MAGIC, 0, store_apply, NULL, err, sizeof err) == 0) {
            struct stat st;
            REQUIRE(stat(path, &st) == 0 && st.st_size == LOG.f.size, "after replay the file has %lld bytes, the log says %lld",
                    (long long)st.st_size, (long long)LOG.f.size);
            use_state();
            if ((size_t)LOG.f.size != n) { /* a torn tail was cut (or the file made): it now replays whole */
                store_reset();
                REQUIRE(log_open(&LOG.f, scratch, "state.log", LOG_MAGIC, 0, store_apply, NULL, err, sizeof err) == 0,
                        "a log cut back to its last whole record does not replay: %s", err);
                REQUIRE(stat(path, &st) == 0 && st.st_size == LOG.f.size, "a second replay changed the file");
            }
        } else REQUIRE(err[0], "a refused log without a message");
    }
    free(f);
    store_reset();
    scratch_clean();
    return 0;
}
#endif

/* ---- dns ---- */

#ifdef FUZZ_DNS
static void target_init(void) {}

/* The question name of a DNS packet (labels at offset 12) as dotted text,
 * or the bytes up to the first NUL after the id when it has none. */
static void name_of(const uint8_t *d, size_t n, char *out, size_t cap) {
    size_t i = 12, o = 0;
    while (i < n && d[i] && d[i] < 64 && i + 1 + d[i] <= n && o + d[i] + 2 < cap) {
        if (o) out[o++] = '.';
        memcpy(out + o, d + i + 1, d[i]);
        o += d[i], i += 1u + d[i];
    }
    out[o] = 0;
    if (!o && n > 2) snprintf(out, cap, "%.*s", (int)(n - 2), (const char *)d + 2);
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    uint16_t id = n >= 2 ? (uint16_t)(d[0] << 8 | d[1]) : 0;
    uint8_t *p = (uint8_t *)copy(d, n);
    struct in_addr addr;
    uint32_t ttl = 0;
    const char *why = NULL;
    /* The input as the answer to a query whose head and question are its own first bytes. */
    if (dns_parse_answer(p, n, p, n < 40 ? n : 40, &addr, &ttl, &why) == 0) REQUIRE(ttl <= DNS_MAX_TTL_S, "ttl %u", ttl);
    else REQUIRE(why != NULL, "a refused answer without a reason");
    free(p);

    /* A query for a name from the input; answered with one A record, the
     * answer must parse to that address. */
    char name[600];
    name_of(d, n, name, sizeof name);
    size_t cap = strlen(name) + 18 + 16;
    uint8_t *q = malloc(cap);
    int qn = dns_build_query(name, id, q, cap - 16);
    if (qn > 0) {
        REQUIRE((size_t)qn <= cap - 16, "query of %d bytes in %zu", qn, cap - 16);
        uint8_t *a = malloc((size_t)qn + 16);
        memcpy(a, q, (size_t)qn);
        a[2] |= 0x80, a[7] = 1;
        uint32_t want_ttl = n >= 4 ? get_le32(d + n - 4) : 7;
        uint8_t rr[16] = {0xC0, 12, 0, 1, 0, 1, 0, 0, 0, 0, 0, 4, 10, 20, 30, 40};
        rr[6] = (uint8_t)(want_ttl >> 24), rr[7] = (uint8_t)(want_ttl >> 16), rr[8] = (uint8_t)(want_ttl >> 8), rr[9] = (uint8_t)want_ttl;
        memcpy(a + qn, rr, 16);
        why = NULL;
        REQUIRE(dns_parse_answer(a, (size_t)qn + 16, q, (size_t)qn, &addr, &ttl, &why) == 0 && ntohl(addr.s_addr) == 0x0A141E28 &&
                    ttl == (want_ttl < DNS_MAX_TTL_S ? want_ttl : DNS_MAX_TTL_S),
                "the answer to our own query for \"%s\" is refused: %s", name, why ? why : "(wrong address or ttl)");
        free(a);
    }
    free(q);
    return 0;
}
#endif

/* ---- stored: a token group's or key's fields, as the API, a PATCH and the
 * log lay them over an item (one target for every row of KINDS) ---- */

#ifdef FUZZ_STORED
#include "fixtures.h"

static catalog *cat;
static stored *base[2];      /* one item of each kind, a PATCH's base */
static buf base_json[2];

static void log_json(const store_kind *K, const stored *it, buf *out) {
    jwriter w;
    out->len = 0;
    jw_init(&w, out);
    K->json(&w, it, 1);
}

/* One item of kind K from `full`, as a handler makes it. */
static stored *base_item(const store_kind *K, const char *full) {
    json_tok t[64];
    json_result r;
    verr e = {0};
    stored *it = K->make();
    REQUIRE(json_parse(full, strlen(full), t, 64, -1, &r) == 0 && K->parse(full, t, 0, it, PARSE_CREATE, &e) == 0 &&
                K->validate(it, cat, &e) == 0,
            "base %s: %s %s", K->noun, e.pointer, e.detail);
    memcpy(it->id, "00000000-0000-4000-8000-000000000000", 37);
    return it;
}

static void target_init(void) {
    char err[512];
    options_default(); /* main()'s: a 30d period fits */
    store_init();
    cat = catalog_load("t.json", FIXTURE_CATALOG, err, sizeof err);
    REQUIRE(cat, "catalog: %s", err);
    base[0] = base_item(&GROUPS, FIXTURE_FULL_GROUP);
    memcpy(base[0]->id, "22222222-2222-4222-8222-222222222222", 37);
    store_put(&GROUPS, GROUPS.clone(base[0]), 100); /* the group the keys name */
    base[1] = base_item(&KEYS, "{\"name\":\"k\",\"token_group_id\":\"22222222-2222-4222-8222-222222222222\",\"max_budget\":2.5,"
                               "\"budget_duration\":\"1mo\",\"rpm_limit\":10,\"tpm_limit\":1000,\"blocked\":true}");
    for (int k = 0; k < 2; k++) log_json(KINDS[k], base[k], &base_json[k]);
}

static void one_kind(int k, const char *s, const json_tok *t) {
    const store_kind *K = KINDS[k];
    for (int mode = PARSE_CREATE; mode <= PARSE_LOG; mode++) {
        stored *it = mode == PARSE_PATCH ? K->clone(base[k]) : K->make();
        verr e = {0};
        int ok = K->parse(s, t, 0, it, mode, &e) == 0;
        if (!ok) REQUIRE(e.code && e.detail[0], "%s: parse refused without a reason (mode %d)", K->noun, mode);
        int valid = ok && K->validate(it, cat, &e) == 0;
        if (ok && !valid) REQUIRE(e.code && e.detail[0], "%s: validate refused without a reason (mode %d)", K->noun, mode);
        buf a = {0};
        if (!it->id[0]) memcpy(it->id, "11111111-1111-4111-8111-111111111111", 37); /* as a handler does */
        if (valid || (ok && mode == PARSE_LOG)) { /* the log's items are written back unchecked */
            jwriter w;
            jw_init(&w, &a);
            K->json(&w, it, 0);
            log_json(K, it, &a);
        }
        if (valid) log_round_trip(K, it, cat); /* what the API took survives the log */
        buf_free(&a);
        K->drop(it);
    }
    buf now = {0};
    log_json(K, base[k], &now);
    REQUIRE(now.len == base_json[k].len && memcmp(now.p, base_json[k].p, now.len) == 0, "a PATCH changed the %s it was laid over", K->noun);
    buf_free(&now);
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    char *s = copy(d, n);
    int max = (int)(n / 2 + 4);
    json_tok *t = malloc((size_t)max * sizeof *t);
    json_result res;
    if (json_parse(s, n, t, max, -1, &res) == 0)
        for (int k = 0; k < 2; k++) one_kind(k, s, t);
    free(t);
    free(s);
    return 0;
}
#endif

/* ---- tls_anchors ---- */

#ifdef FUZZ_TLS_ANCHORS
static char cert_path[300];

static void target_init(void) {
    scratch_make();
    snprintf(cert_path, sizeof cert_path, "%s/ca.pem", scratch);
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    write_input(cert_path, d, n);
    char err[512];
    err[0] = 0;
    int rc = tls_load_anchors(cert_path, err, sizeof err);
    if (rc < 0) REQUIRE(err[0] && TLS.nta == 0, "refused without a message, or with anchors kept (%zu)", TLS.nta);
    else REQUIRE(rc > 0 && (size_t)rc == TLS.nta, "%d anchors said, %zu kept", rc, TLS.nta);
    for (size_t i = 0; i < TLS.nta; i++) {
        const br_x509_trust_anchor *ta = &TLS.ta[i];
        REQUIRE(ta->pkey.key_type == BR_KEYTYPE_RSA || ta->pkey.key_type == BR_KEYTYPE_EC, "anchor %zu: key type %d", i, ta->pkey.key_type);
        free(ta->dn.data);
    }
    free(TLS.ta);
    TLS.ta = NULL, TLS.nta = TLS.cap = 0;
    return 0;
}
#endif

/* ---- resp ---- */

#ifdef FUZZ_RESP
static void target_init(void) {}

/* One Redis reply (section 20): whole, then every shorter prefix. A reply
 * that parses is prefix-free -- each shorter prefix only wants more -- and
 * its tokens stay within the input and their own list. */
int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    static resp_tok t[RESP_MAX_TOKS];
    const char *p = copy(d, n);
    size_t at = 0;
    int nt = 0, r = resp_elem(p, n, &at, t, RESP_MAX_TOKS, &nt, 0);
    REQUIRE(r == 1 || r == 0 || r == LTG_ERR, "resp_elem returned %d", r);
    if (r == 1) {
        REQUIRE(at <= n && nt >= 1 && t[0].next == nt, "consumed %zu of %zu, %d tokens, next %d", at, n, nt,
                t[0].next);
        for (int i = 0; i < nt; i++)
            REQUIRE(t[i].next > i && t[i].next <= nt && (strchr("+-$", t[i].type) == NULL || t[i].off + t[i].len <= at),
                    "token %d: type %c next %d off %zu len %zu", i, t[i].type, t[i].next, t[i].off, t[i].len);
        for (size_t k = 0; k < at; k++) {
            const char *q = copy(d, k);
            size_t a2 = 0;
            int n2 = 0;
            REQUIRE(resp_elem(q, k, &a2, t, RESP_MAX_TOKS, &n2, 0) == 0, "a prefix of %zu bytes of a whole reply "
                    "did not just want more", k);
            free((void *)q);
        }
    }
    free((void *)p);
    return 0;
}
#endif

#ifdef FUZZ_XL
static void target_init(void) {}

/* Each SSE event of out (an encoder's output) has data that is JSON or [DONE]. */
static void xl_events_parse(const buf *out) {
    size_t off = 0, k;
    if (!out->len) return;
    buf data = {0};
    static json_tok t[1];
    json_result res;
    while ((k = sse_event_len(out->p + off, out->len - off)) > 0) {
        if (sse_event_data(out->p + off, k, &data) && data.len && strcmp(data.p, "[DONE]") != 0)
            REQUIRE(json_parse(data.p, data.len, t, 1, 0, &res) == 0, "an event's data is not JSON: %.*s",
                    (int)data.len, data.p);
        off += k;
    }
    REQUIRE(off == out->len, "the encoder's output ends inside an event");
    buf_free(&data);
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    if (!n) return 0;
    const char *p = copy(d, n);
    static json_tok t[1];
    json_result res;
    long long u[NTOK] = {[TOK_IN] = 9, [TOK_CACHE_READ] = 2, [TOK_OUT] = 4};
    buf out = {0};
    if (json_parse(p, n, t, 1, 0, &res) == 0 && t[0].type == JSON_OBJECT) {
        xl_target tg = {"m", 100, (int)(n & 1)};
        xl_verdict v;
        const char *why;
        static json_tok top[512]; /* admission's top level, half the time */
        const json_tok *tp = n & 2 && json_parse(p, n, top, 512, 1, &res) == 0 ? top : NULL;
        for (int from = XL_CHAT; from <= XL_MESSAGES; from++) {
            xl_api to = from == XL_CHAT ? XL_MESSAGES : XL_CHAT;
            if (xl_request((xl_api)from, to, p, n, tp, &tg, &out, &v) == 0)
                REQUIRE(json_parse(out.p, out.len, t, 1, 0, &res) == 0, "a translated request is not JSON: %s",
                        out.p);
            if (xl_answer((xl_api)from, from == XL_CHAT ? XL_MESSAGES : XL_CHAT, p, n, "{}", 2, "req_fuzz", u, &out, &why) == 0)
                REQUIRE(json_parse(out.p, out.len, t, 1, 0, &res) == 0, "a translated answer is not JSON: %s",
                        out.p);
        }
        /* Responses to chat, and a chat answer back (the body its own request, for its tools) */
        if (xl_request(XL_RESPONSES, XL_CHAT, p, n, tp, &tg, &out, &v) == 0)
            REQUIRE(json_parse(out.p, out.len, t, 1, 0, &res) == 0, "a translated request is not JSON: %s",
                    out.p);
        if (xl_answer(XL_CHAT, XL_RESPONSES, p, n, p, n, "req_fuzz", u, &out, &why) == 0)
            REQUIRE(json_parse(out.p, out.len, t, 1, 0, &res) == 0, "a translated answer is not JSON: %s",
                    out.p);
    }
    for (int from = XL_CHAT; from <= XL_MESSAGES; from++) {
        xl_stream *xs = xl_stream_new((xl_api)from, from == XL_CHAT ? XL_MESSAGES : XL_CHAT, 1, 5, "{}", 2);
        size_t off = 0, k;
        buf data = {0}, all = {0};
        const char *why;
        int r = 0;
        while (r == 0 && (k = sse_event_len(p + off, n - off)) > 0) {
            sse_event_data(p + off, k, &data);
            /* section 18 feeds only events whose data is JSON or [DONE] (stream_take) */
            int ok = !data.len || strcmp(data.p, "[DONE]") == 0 || json_parse(data.p, data.len, t, 1, 0, &res) == 0;
            out.len = 0;
            if (ok) r = xl_feed(xs, p + off, k, &data, u, &out, &why);
            if (out.len) buf_append(&all, out.p, out.len);
            off += k;
        }
        if (r == 0) {
            out.len = 0;
            xl_feed_end(xs, u, &out, &why);
            if (out.len) buf_append(&all, out.p, out.len);
        }
        xl_events_parse(&all);
        xl_stream_free(xs);
        buf_free(&data);
        buf_free(&all);
    }
    buf_free(&out);
    free((void *)p);
    return 0;
}
#endif
