/* tests/unit.c -- unit tests for ltg's parsers, writer, config loader and resolver.
 *
 * It includes ltg.c itself (without main) to reach the static functions.
 * Every parser is fed each case whole and one byte at a time, and the input
 * is placed right before an unmapped page, so a read past the end crashes
 * here instead of passing by luck. Ends with "N passed, M failed".
 *
 *   tests/unit                 every test
 *   tests/unit ledger test_plan  only the tests whose name contains one of these
 *                              (a whole name, e.g. test_log: that test alone)
 */
#define LTG_NO_MAIN
#include "../ltg.c"
#include "reset.h"
#include "fixtures.h"

#include <sys/mman.h>

static int passed, failed, skipped;

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (cond) passed++;                                               \
        else {                                                            \
            failed++;                                                     \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                   \
            printf(__VA_ARGS__);                                          \
            printf("\n");                                                 \
        }                                                                 \
    } while (0)

/* A copy of s[0..n) that ends exactly where an unmapped page begins. */
static char *guard_base;
static size_t guard_len;
static const char *guarded(const char *s, size_t n) {
    long page = sysconf(_SC_PAGESIZE);
    if (guard_base) munmap(guard_base, guard_len);
    size_t data_pages = (n + (size_t)page - 1) / (size_t)page + 1;
    guard_len = (data_pages + 1) * (size_t)page;
    guard_base = mmap(NULL, guard_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    mprotect(guard_base + data_pages * (size_t)page, (size_t)page, PROT_NONE);
    char *p = guard_base + data_pages * (size_t)page - n;
    memcpy(p, s, n);
    return p;
}

/* ---- JSON ---- */

static int parses(const char *s) {
    json_tok t[256];
    json_result r;
    const char *g = guarded(s, strlen(s));
    return json_parse(g, strlen(s), t, 256, -1, &r) == 0;
}

/* json_scan's duplicate check: names compared unescaped at every depth,
 * also when another name shares their hash (sorted by hash, then name). */
static void test_json_scan(void) {
    json_result res;
    static const char *const dups[] = {"{\"a\":1,\"a\":2}", "{\"a\":1,\"\\u0061\":2}", "[{\"x\":{},\"x\":[]}]",
                                       "{\"s\":{\"include_usage\":true,\"include_usage\":false}}", "{\"a\":1,\"b\":2,\"c\":3,\"a\":4}"};
    for (size_t i = 0; i < sizeof dups / sizeof *dups; i++)
        CHECK(json_scan(dups[i], strlen(dups[i]), NULL, NULL, &res) < 0 && strstr(res.err, "repeated"), "a repeated name: %s", dups[i]);
    static const char *const fine[] = {"{\"a\":{\"a\":1}}", "[{\"a\":1},{\"a\":2}]", "{}", "[]", "{\"a\":1,\"A\":2}"};
    for (size_t i = 0; i < sizeof fine / sizeof *fine; i++) CHECK(json_scan(fine[i], strlen(fine[i]), NULL, NULL, &res) == 0, "taken: %s", fine[i]);
    /* Names whose hashes collide, repeated around one that does not repeat: found all the same. */
    jparser p = {.s = "{\"ab\":0,\"cd\":0,\"ab\":0}", .res = &res};
    jkey k[3] = {{2, 4, 7}, {9, 11, 7}, {16, 18, 7}}; /* three names, one hash */
    p.keys = k, p.nkeys = 3;
    CHECK(jp_names_unique(&p, 0) < 0, "a repeated name between two others of its hash");
}

static void test_json_reader(void) {
    static const char *valid[] = {
        "{}", "[]", "0", "-0", "1.5e10", "-1.25E-3", "\"\"", "true", "false", "null", " \t\r\n{\"a\" : [1, 2, {\"b\":null}]} ",
        "\"\\u00e9\\ud83d\\ude00\\n\\\"\\\\\\/\"", "\"h\xc3\xa9llo \xe2\x82\xac \xf0\x9f\x98\x80\"", "[[[[[]]]]]", "{\"\":\"\"}",
    };
    for (size_t i = 0; i < sizeof valid / sizeof *valid; i++) CHECK(parses(valid[i]), "valid JSON refused: %s", valid[i]);
    static const char *invalid[] = {
        "", " ", "{", "}", "[1,]", "{\"a\":1,}", "{\"a\" 1}", "{a:1}", "01", "1.", ".5", "1e", "+1", "-", "tru", "nul",
        "\"abc", "\"\\x\"", "\"\\u12g4\"", "\"a\nb\"", "[1 2]", "{} {}", "'a'", "[1]x", "\"\xc0\xaf\"", "\"\xed\xa0\x80\"",
        "\"\xf4\x90\x80\x80\"", "\"\xe2\x82\"", "\"\x80\"", "NaN", "Infinity", "[-]", "{\"a\":}", "\"a\"\"b\"", "/* c */ 1",
    };
    for (size_t i = 0; i < sizeof invalid / sizeof *invalid; i++) CHECK(!parses(invalid[i]), "invalid JSON taken: %s", invalid[i]);

    /* Depth limit: 64 nested arrays parse, 65 do not. */
    char deep[200];
    for (int d = 64; d <= 65; d++) {
        memset(deep, '[', (size_t)d);
        memset(deep + d, ']', (size_t)d);
        deep[2 * d] = 0;
        CHECK(parses(deep) == (d == 64), "depth %d", d);
    }

    /* Tokens, siblings and lookups. */
    const char *s = "{\"model\":\"K\\u0033\",\"n\":[1,2,3],\"o\":{\"x\":true},\"stream\":false}";
    json_tok t[32];
    json_result r;
    CHECK(json_parse(s, strlen(s), t, 32, -1, &r) == 0 && r.ntok == 14, "token count %d", r.ntok);
    CHECK(t[0].type == JSON_OBJECT && t[0].size == 4, "root object of 4 members");
    int m = json_get(s, t, 0, "model");
    CHECK(json_eq(s, t, m, "K3"), "escaped value compares unescaped");
    int n = json_get(s, t, 0, "n");
    CHECK(t[n].type == JSON_ARRAY && t[n].size == 3 && t[n].next == n + 4, "array subtree next");
    int o = json_get(s, t, 0, "o");
    CHECK(t[json_get(s, t, o, "x")].type == JSON_TRUE, "nested lookup");
    CHECK(json_get(s, t, 0, "missing") == -1, "missing key");
    CHECK(t[json_get(s, t, 0, "stream")].type == JSON_FALSE, "last member");

    /* Shallow storage: depth 1 keeps the members, not their insides. */
    CHECK(json_parse(s, strlen(s), t, 32, 1, &r) == 0 && r.ntok == 9, "shallow token count %d", r.ntok);
    o = json_get(s, t, 0, "o");
    CHECK(o > 0 && t[o].type == JSON_OBJECT && json_get(s, t, o, "x") == -1, "shallow: inner members not stored");
    CHECK(json_get(s, t, 0, "stream") > 0, "shallow: later members still found");
    const char *deepdoc = "[[[[1,2,3,[4,[5]]]]]]";
    CHECK(json_parse(deepdoc, strlen(deepdoc), t, 1, 0, &r) == 0 && r.ntok == 1, "root only");
    CHECK(json_parse(s, strlen(s), t, 4, -1, &r) < 0 && strstr(r.err, "too many"), "token limit");

    /* Duplicate keys, also when one of them is escaped. */
    const char *dups = "{\"model\":\"a\",\"x\":1,\"mod\\u0065l\":\"b\"}";
    CHECK(json_parse(dups, strlen(dups), t, 32, 1, &r) == 0 && json_duplicate_key(dups, t, 0) == 5, "duplicate key found");
    CHECK(json_parse(s, strlen(s), t, 32, 1, &r) == 0 && json_duplicate_key(s, t, 0) == -1, "no duplicate");

    /* Errors name the byte offset. */
    const char *bad = "{\"a\": [1, 2,, 3]}";
    CHECK(json_parse(bad, strlen(bad), t, 32, -1, &r) < 0 && r.err_offset == 12, "offset %zu", r.err_offset);

    /* Unescaping, including surrogate pairs and a lone surrogate. */
    const char *es = "\"a\\tb\\u00e9\\ud83d\\ude00\\udc00\"";
    json_parse(es, strlen(es), t, 4, -1, &r);
    buf b = {0};
    json_unescape(es, t, 0, &b);
    CHECK(b.len == 12 && memcmp(b.p, "a\tb\xc3\xa9\xf0\x9f\x98\x80\xef\xbf\xbd", 12) == 0, "unescape");
    buf_free(&b);

    double d;
    const char *num = "[-12.5e2]";
    json_parse(num, strlen(num), t, 4, -1, &r);
    CHECK(json_number(num, t, 1, &d) == 0 && d == -1250, "number");
}

static void test_json_writer(void) {
    buf b = {0};
    jwriter w;
    jw_init(&w, &b);
    jw_open(&w, '{');
    jw_key(&w, "s"), jw_str(&w, "q\"b\\n\n\x01\xc3\xa9\xff", 10);
    jw_key(&w, "a"), jw_open(&w, '[');
    jw_int(&w, -3), jw_num(&w, 0.5), jw_bool(&w, 1), jw_null(&w), jw_cstr(&w, NULL);
    jw_open(&w, '{'), jw_close(&w, '}');
    jw_close(&w, ']');
    jw_key(&w, "r"), jw_raw(&w, "[1]", 3);
    jw_close(&w, '}');
    const char *want = "{\"s\":\"q\\\"b\\\\n\\n\\u0001\xc3\xa9\xef\xbf\xbd\",\"a\":[-3,0.5,true,null,null,{}],\"r\":[1]}";
    CHECK(strcmp(b.p, want) == 0, "writer: %s", b.p);
    CHECK(parses(b.p), "writer output parses");
    buf_free(&b);
}

/* ---- HTTP ---- */

/* Feed s whole and byte by byte to http_head_end; both must agree. */
static int head_len(const char *s) {
    size_t n = strlen(s), scan = 0;
    const char *g = guarded(s, n);
    int whole = http_head_end(g, n, &scan);
    int bytewise = LTG_AGAIN;
    scan = 0;
    for (size_t k = 1; k <= n && bytewise == LTG_AGAIN; k++) bytewise = http_head_end(g, k, &scan);
    return whole == bytewise ? whole : -100;
}

static int parse_req(const char *s, http_request *r) {
    int n = head_len(s);
    if (n < 0) return n;
    return http_parse_request(guarded(s, strlen(s)), (size_t)n, r);
}

static void test_http_request(void) {
    http_request r;
    const char *ok = "POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\nX-Empty:\r\n"
                     "Authorization:  Bearer k  \r\n\r\nbody";
    CHECK(parse_req(ok, &r) == (int)strlen(ok) - 4, "whole head");
    const char *b = guarded(ok, strlen(ok));
    CHECK(r.method.len == 4 && r.target.len == 24 && r.minor == 1 && r.nh == 4, "request line and headers");
    size_t n;
    const char *v = http_header_get(b, r.h, r.nh, "AUTHORIZATION", &n);
    CHECK(v && n == 8 && memcmp(v, "Bearer k", 8) == 0, "header value trimmed");
    CHECK(http_header_get(b, r.h, r.nh, "x-empty", &n) && n == 0, "empty header value");
    CHECK(r.content_length == 12 && !r.chunked && r.keep_alive, "framing");

    CHECK(parse_req("GET / HTTP/1.0\r\n\r\n", &r) > 0 && !r.keep_alive, "1.0 closes by default");
    CHECK(parse_req("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", &r) > 0 && r.keep_alive, "1.0 keep-alive");
    CHECK(parse_req("GET / HTTP/1.1\r\nHost: a\r\nConnection: foo, close\r\n\r\n", &r) > 0 && !r.keep_alive, "close token");
    CHECK(parse_req("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", &r) > 0 && r.chunked, "chunked");
    CHECK(parse_req("POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n", &r) > 0 && r.expect_continue, "expect");
    CHECK(parse_req("\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", &r) > 0, "leading empty line ignored");
    CHECK(parse_req("GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n", &r) > 0, "identical lengths");

    static const struct { const char *req; int status; } bad[] = {
        {"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 400},
        {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
        {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501},
        {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400},
        {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1x\r\n\r\n", 400},
        {"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n", 400},
        {"GET / HTTP/1.1\r\nHost: a\r\nNo colon\r\n\r\n", 400},
        {"GET / HTTP/1.1\r\nHost: a\r\nX : y\r\n\r\n", 400},
        {"GET / HTTP/1.1\nHost: a\n\n", 400},
        {"GET / HTTP/1.1\r\nHost: a\r\nX: a\rb\r\n\r\n", 400},
        {"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 400},
        {"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", 400},
        {"GET / HTTP/1.1\r\n\r\n", 400},
        {"GET / HTTP/1.1\r\nHost: a\r\nExpect: magic\r\n\r\n", 417},
        {"G@T / HTTP/1.1\r\nHost: a\r\n\r\n", 400},
        {"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        int res = parse_req(bad[i].req, &r);
        CHECK(res == LTG_ERR && r.status == bad[i].status && r.err, "bad request %zu: got %d status %d", i, res, r.status);
    }
    /* HTTP/1.0 with Transfer-Encoding: never kept alive (RFC 9112 6.1). */
    CHECK(parse_req("POST / HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n", &r) > 0 && !r.keep_alive && r.chunked,
          "HTTP/1.0 with Transfer-Encoding closes");
    /* A NUL inside a header value. */
    const char nul[] = "GET / HTTP/1.1\r\nHost: a\r\nX: a\0b\r\n\r\n";
    CHECK(http_parse_request(guarded(nul, sizeof nul - 1), sizeof nul - 1, &r) == LTG_ERR, "NUL refused");

    /* 65 headers: 431. */
    buf many = {0};
    buf_puts(&many, "GET / HTTP/1.1\r\nHost: a\r\n");
    for (int i = 0; i < HTTP_MAX_HEADERS; i++) buf_printf(&many, "X-%d: y\r\n", i);
    buf_puts(&many, "\r\n");
    CHECK(parse_req(many.p, &r) == LTG_ERR && r.status == 431, "too many headers");
    buf_free(&many);

    CHECK(head_len("GET / HTTP/1.1\r\nHost: a\r\n") == LTG_AGAIN, "incomplete head");
    CHECK(head_len("GET / HTTP/1.1\r\nHost: a\r\n\r") == LTG_AGAIN, "incomplete at CR");
}

static void test_http_response(void) {
    http_response r;
    const char *s = "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\nContent-Length: 10\r\n\r\n";
    CHECK(http_parse_response(guarded(s, strlen(s)), strlen(s), &r) > 0 && r.status == 429 && r.content_length == 10 && r.keep_alive, "429");
    s = "HTTP/1.0 200 OK\r\n\r\n";
    CHECK(http_parse_response(guarded(s, strlen(s)), strlen(s), &r) > 0 && !r.keep_alive && r.content_length == -1, "1.0 eof body");
    s = "HTTP/1.1 200\r\nTransfer-Encoding: chunked\r\n\r\n";
    CHECK(http_parse_response(guarded(s, strlen(s)), strlen(s), &r) > 0 && r.chunked && r.reason.len == 0, "no reason phrase");
    static const char *bad[] = {"HTTP/1.1 20 OK\r\n\r\n", "HTTP/1.1 200 OK\n\n", "HTTX/1.1 200 OK\r\n\r\n",
                                "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        CHECK(http_parse_response(guarded(bad[i], strlen(bad[i])), strlen(bad[i]), &r) == LTG_ERR, "bad response %zu", i);
}

/* Decode s whole and byte by byte; both must give `want` (NULL: an error). */
static void check_chunked(const char *s, const char *want, size_t want_rest) {
    size_t n = strlen(s);
    const char *g = guarded(s, n);
    for (int bytewise = 0; bytewise < 2; bytewise++) {
        chunk_decoder d = {0};
        buf out = {0};
        size_t used = 0;
        int err = 0;
        while (used < n && d.state != CHUNK_DONE) {
            size_t step = bytewise ? 1 : n - used;
            long k = chunk_decode(&d, g + used, step, &out);
            if (k < 0) { err = 1; break; }
            used += (size_t)k;
        }
        if (!want) CHECK(err || d.state != CHUNK_DONE, "chunked should fail: %s", s);
        else CHECK(!err && d.state == CHUNK_DONE && out.len == strlen(want) && memcmp(out.p ? out.p : "", want, out.len) == 0 && n - used == want_rest,
                   "chunked %s (%s)", s, bytewise ? "byte by byte" : "whole");
        buf_free(&out);
    }
}

static void test_chunked(void) {
    check_chunked("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", "hello world", 0);
    check_chunked("a;ext=1\r\n0123456789\r\n0\r\nTrailer: x\r\n\r\nNEXT", "0123456789", 4);
    check_chunked("A \r\n0123456789\r\n0\r\n\r\n", "0123456789", 0);
    check_chunked("0\r\n\r\n", "", 0);
    check_chunked("5\r\nhelloX\r\n0\r\n\r\n", NULL, 0);
    check_chunked("z\r\n", NULL, 0);
    check_chunked("5\nhello\r\n0\r\n\r\n", NULL, 0);
    check_chunked("fffffffffffffffff\r\n", NULL, 0);
    check_chunked("\r\n", NULL, 0);
    check_chunked("5 \t;a=b \r\nhello\r\n0\r\n\r\n", "hello", 0); /* white space, then an extension */
    check_chunked("5 xyz\r\nhello\r\n0\r\n\r\n", NULL, 0);       /* after white space only ";" or the line's end */
    check_chunked("5 5\r\nhello\r\n0\r\n\r\n", NULL, 0);
    check_chunked("5;a\001b\r\nhello\r\n0\r\n\r\n", NULL, 0);    /* a control byte in an extension */
    /* Errors are sticky. */
    chunk_decoder d = {0};
    buf out = {0};
    CHECK(chunk_decode(&d, "x", 1, &out) < 0 && chunk_decode(&d, "0\r\n\r\n", 5, &out) < 0, "sticky error");
    buf_free(&out);
}

static void test_sse(void) {
    CHECK(sse_event_len("data: a\n\ndata: b\n\n", 18) == 9, "LF");
    CHECK(sse_event_len("data: a\r\n\r\nrest", 15) == 11, "CRLF");
    CHECK(sse_event_len("data: a\r\rx", 10) == 9, "CR");

    /* The data of an event: "data:" lines joined, one leading space dropped. */
    buf d = {0};
    CHECK(sse_event_data("data: {}\n\n", 10, &d) && d.len == 2 && memcmp(d.p, "{}", 2) == 0, "one data line");
    CHECK(sse_event_data("event: x\r\ndata:a\r\ndata:  b\r\n\r\n", 30, &d) && d.len == 4 && memcmp(d.p, "a\n b", 4) == 0, "two lines, CRLF");
    CHECK(!sse_event_data(": ping\n\n", 8, &d) && d.len == 0, "a comment has no data");
    CHECK(sse_event_data("data:\n\n", 7, &d) && d.len == 0, "empty data");
    CHECK(sse_event_data("data: x", 7, &d) && d.len == 1 && d.p[0] == 'x', "no line end");
    buf_free(&d);
    CHECK(sse_event_len("data: a\ndata: b\n\n", 17) == 17, "two lines");
    CHECK(sse_event_len("data: a\n", 8) == 0, "incomplete");
    CHECK(sse_event_len("data: a\r\n\r", 10) == 0, "CR at the end waits");
    CHECK(sse_event_len(": ping\n\n", 8) == 8, "comment event");

    /* The moment a client has a whole stream, for each API: its last event (after it, a client
     * that closes has its answer: the request succeeded). */
    static const struct { const char *ev; int last; } ends[] = {
        {"data: [DONE]\n\n", 1},                                            /* chat, completions */
        {"data: {\"id\":\"c\",\"choices\":[{\"finish_reason\":\"stop\"}]}\n\n", 0},
        {"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n", 1}, /* Anthropic */
        {"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{}}\n\n", 0},
        {"data: {\"type\":\"message_stop\"}\n\n", 1},                     /* no event: line */
        {"event: response.completed\r\ndata: {\"type\":\"response.completed\"}\r\n\r\n", 1},
        {"event: response.incomplete\ndata: {}\n\n", 1},                    /* Responses */
        {"event: response.failed\ndata: {}\n\n", 1},
        {"event: response.output_text.done\ndata: {}\n\n", 0},
        {"event: response.completed_x\ndata: {}\n\n", 0},
        {"data: {\"type\":\"response.completed\",\"response\":{}}\n\n", 1},
        {"data: {\"type\":\"response.created\"}\n\n", 0},
    };
    for (size_t i = 0; i < sizeof ends / sizeof ends[0]; i++) {
        size_t n = strlen(ends[i].ev);
        sse_event_data(ends[i].ev, n, &d);
        CHECK(stream_last(ends[i].ev, n, &d) == ends[i].last, "the last event? %s", ends[i].ev);
    }
    buf_free(&d);
}

/* ---- config ---- */

static catalog *load(const char *text, char *err) { return catalog_load("test.json", text, err, 512); }

static void test_config(void) {
    char err[512];
    setenv("UNIT_KEY", "provider-secret", 1);
    setenv("UNIT_ADMIN", "admin-secret", 1);
    unsetenv("UNIT_UNSET");
    const char *good = "{\"providers\":{\"p\":{\"base_url\":\"http://127.0.0.1:9000/v1/\",\"api_key_env\":\"UNIT_KEY\"},"
                       "\"q\":{\"base_url\":\"http://[::1]/x\"}},"
                       "\"models\":{\"A\":{\"provider\":\"p\",\"upstream_model\":\"a-1\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":2.5,"
                       "\"context_window\":1000,\"max_output_tokens\":100},"
                       "\"B\":{\"provider\":\"q\",\"upstream_model\":\"b\",\"input_usd_per_mtok\":0,\"output_usd_per_mtok\":0}},"
                       "\"admin_keys\":[{\"key_env\":\"UNIT_ADMIN\",\"permissions\":[\"*\"]},"
                       "{\"key_sha256\":\"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\",\"permissions\":[\"llm_token_gateway.spend.read\"]}]}";
    catalog *c = load(good, err);
    CHECK(c != NULL, "good config: %s", err);
    if (c) {
        CHECK(c->nprov == 2 && c->nmodels == 2 && c->nadmins == 2, "counts");
        CHECK(strcmp(c->prov[0].host, "127.0.0.1") == 0 && c->prov[0].port == 9000 && strcmp(c->prov[0].base_path, "/v1") == 0, "url");
        CHECK(strcmp(c->prov[0].hostport, "127.0.0.1:9000") == 0 && c->prov[0].nkeys == 1 && strcmp(c->prov[0].keys[0], "provider-secret") == 0, "host and key");
        CHECK(strcmp(c->prov[1].host, "::1") == 0 && c->prov[1].port == 80 && strcmp(c->prov[1].hostport, "[::1]") == 0, "ipv6 url");
        catalog *tc = load("{\"providers\":{\"t\":{\"base_url\":\"https://api.example.com/v1\",\"tls_verify\":false},\"u\":{\"base_url\":\"https://h:8443\"}},"
                           "\"models\":{\"M\":{\"provider\":\"t\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", err);
        CHECK(tc && tc->prov[0].tls && tc->prov[0].port == 443 && !tc->prov[0].tls_verify && strcmp(tc->prov[0].hostport, "api.example.com") == 0 &&
              tc->prov[1].tls_verify && strcmp(tc->prov[1].hostport, "h:8443") == 0, "https providers: %s", err);
        catalog_free(tc);
        catalog *dc = load("{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"q\":{\"base_url\":\"http://y\"}},\"models\":{\"M\":{\"deployments\":["
                           "{\"provider\":\"p\",\"upstream_model\":\"m-eu\",\"weight\":3},{\"provider\":\"q\",\"upstream_model\":\"m-us\"}],"
                           "\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", err);
        CHECK(dc && dc->models[0].ndep == 2 && dc->models[0].dep[0].weight == 3 && dc->models[0].dep[1].weight == 1 &&
              strcmp(dc->models[0].dep[1].name, "q/m-us") == 0 && dc->models[0].dep[1].p == &dc->prov[1] && dc->models[0].dep[1].m == &dc->models[0],
              "deployments: %s", err);
        catalog_free(dc);
        /* endpoints: all four by default, as listed, Anthropic's two */
        catalog *ec = load("{\"providers\":{\"g\":{\"base_url\":\"http://x\",\"endpoints\":[\"chat\",\"embeddings\",\"chat\"]},"
                           "\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{\"G\":{\"provider\":\"g\",\"upstream_model\":\"g\","
                           "\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},\"C\":{\"provider\":\"a\",\"upstream_model\":\"c\","
                           "\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", err);
        const model *eg = ec ? catalog_model(ec, "G", 1) : NULL, *ea = ec ? catalog_model(ec, "C", 1) : NULL;
        CHECK(eg && eg->endpoints == (1u << EP_CHAT | 1u << EP_EMBEDDINGS) && model_native(eg, &WIRE[0]) &&
              !model_native(eg, &WIRE[3]) && model_xl(eg) == XL_CHAT && c->prov[0].endpoints == EPS_OPENAI &&
              ea && ea->endpoints == EPS_ANTHROPIC && model_native(ea, &WIRE[4]) && !model_native(ea, &WIRE[0]),
              "endpoints: %s", err);
        catalog_free(ec);
        model *m = catalog_model(c, "A", 1);
        CHECK(m && m->ndep == 1 && m->dep[0].p == &c->prov[0] && m->dep[0].weight == 1 && strcmp(m->dep[0].name, "p/a-1") == 0 && m->price.p[PRICE_IN] == 1000000 && m->price.p[PRICE_OUT] == 2500000 && m->price.p[PRICE_CACHE_READ] == 1000000 && m->max_output_tokens == 100, "model A");
        CHECK(catalog_model(c, "B", 1)->max_output_tokens == 4096, "default max_output_tokens");
        catalog *pc = load("{\"providers\":{\"o\":{\"base_url\":\"http://x\"},\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{"
                           "\"O\":{\"provider\":\"o\",\"upstream_model\":\"o\",\"input_usd_per_mtok\":2,\"output_usd_per_mtok\":8,\"cache_read_usd_per_mtok\":0.5},"
                           "\"A\":{\"provider\":\"a\",\"upstream_model\":\"a\",\"input_usd_per_mtok\":3,\"output_usd_per_mtok\":15,"
                           "\"long_context\":{\"above_input_tokens\":200000,\"input_usd_per_mtok\":6,\"output_usd_per_mtok\":22.5}}}}", err);
        const model *po = pc ? catalog_model(pc, "O", 1) : NULL, *pa = pc ? catalog_model(pc, "A", 1) : NULL;
        CHECK(po && po->price.p[PRICE_CACHE_READ] == 500000 && po->price.p[PRICE_CACHE_WRITE] == 2000000 && po->price.p[PRICE_CACHE_WRITE_1H] == 2000000 &&
              !po->long_above, "OpenAI's defaults: cache writes at the input price, the read price as given: %s", err);
        CHECK(pa && pa->price.p[PRICE_CACHE_READ] == 300000 && pa->price.p[PRICE_CACHE_WRITE] == 3750000 && pa->price.p[PRICE_CACHE_WRITE_1H] == 6000000 &&
              pa->long_above == 200000 && pa->long_price.p[PRICE_IN] == 6000000 && pa->long_price.p[PRICE_CACHE_READ] == 600000 &&
              pa->long_price.p[PRICE_CACHE_WRITE_1H] == 12000000 && pa->long_price.p[PRICE_OUT] == 22500000,
              "Anthropic's multipliers 0.1, 1.25, 2; the long tier scaled with its input price");
        catalog_free(pc);
        uint8_t h[32];
        sha256("admin-secret", 12, h);
        CHECK(memcmp(h, c->admins[0].sha, 32) == 0 && c->admins[0].perms == PERM_ALL, "admin key hashed");
        CHECK(c->admins[1].perms == PERM_SPEND_READ && c->admins[1].sha[0] == 0x9f, "sha256 key");
        catalog_free(c);
    }
    static const struct { const char *cfg, *want; } bad[] = {
        {"{", "not valid JSON: expected a string key at byte offset 1"},
        {"[]", "must be a JSON object"},
        {"{\"providers\":{},\"models\":{}}", "providers: must be an object"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\":{}}}",
         "models: an alias must be 1 to 128 bytes"},
        {"{\"providers\":{\"p\":{\"base_url\":\"ftp://x\"}},\"models\":{}}", "providers.p.base_url: must start with http"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x:99999\"}},\"models\":{}}", "providers.p.base_url: has an invalid port"},
        {"{\"providers\":{\"p\":{\"base_url\":\"https://x\",\"tls_verify\":\"no\"}},\"models\":{}}", "providers.p.tls_verify: must be true or false"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"api_key_env\":\"UNIT_UNSET\"}},\"models\":{}}", "providers.p.api_key_env: environment variable UNIT_UNSET is not set"},
        /* a key pasted where the variable's name belongs is not repeated */
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"api_key_env\":\"sk-unit-0123456789\"}},\"models\":{}}", "providers.p.api_key_env: no environment variable of that name is set (the value is not shown"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"bogus\":1}},\"models\":{}}", "providers.p.bogus: unknown field"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"api_key_env\":\"UNIT_KEY\",\"api_key_envs\":[\"UNIT_KEY\"]}},\"models\":{}}", "providers.p.api_key_envs: give api_key_env or api_key_envs, not both"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"api_key_envs\":[]}},\"models\":{}}", "providers.p.api_key_envs: must be a list of 1 to 16"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"api_key_envs\":[\"UNIT_KEY\",\"UNIT_UNSET\"]}},\"models\":{}}", "providers.p.api_key_envs: environment variable UNIT_UNSET is not set"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"api\":\"gemini\"}},\"models\":{}}", "providers.p.api: must be \"openai\""},
        /* endpoints: a non-empty list of the four; not for an Anthropic provider; one model's
         * deployments serve the same */
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"endpoints\":[]}},\"models\":{}}", "providers.p.endpoints: must be a non-empty array of \"chat\""},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"endpoints\":\"chat\"}},\"models\":{}}", "providers.p.endpoints: must be a non-empty array"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"endpoints\":[\"chat\",\"messages\"]}},\"models\":{}}", "providers.p.endpoints: must be a non-empty array"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"api\":\"anthropic\",\"endpoints\":[\"chat\"]}},\"models\":{}}", "providers.p.endpoints: is for OpenAI-API providers"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"g\":{\"base_url\":\"http://y\",\"endpoints\":[\"chat\"]}},\"models\":{\"M\":{\"deployments\":[{\"provider\":\"p\",\"upstream_model\":\"m\"},{\"provider\":\"g\",\"upstream_model\":\"m\"}],\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.deployments[1].provider: \"g\" serves other endpoints than the model's first deployment"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{}}", "models: must be an object with at least one"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"nope\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.provider: no provider named \"nope\""},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"output_usd_per_mtok\":1}}}", "models.M.input_usd_per_mtok: missing"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":-1,\"output_usd_per_mtok\":1}}}", "models.M.input_usd_per_mtok: must be a number from 0 to 10000"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1,\"cache_read_usd_per_mtok\":20000}}}", "models.M.cache_read_usd_per_mtok: must be a number from 0 to 10000"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1,\"cache_write_usd_per_mtok\":\"1\"}}}", "models.M.cache_write_usd_per_mtok: must be a number"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1,\"cache_read_usd_per_mtk\":1}}}", "models.M.cache_read_usd_per_mtk: unknown field"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1,\"long_context\":5}}}", "models.M.long_context: must be an object"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1,\"long_context\":{\"input_usd_per_mtok\":2,\"output_usd_per_mtok\":2}}}}", "models.M.long_context.above_input_tokens: missing"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1,\"long_context\":{\"above_input_tokens\":200000,\"output_usd_per_mtok\":2}}}}", "models.M.long_context.input_usd_per_mtok: missing"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1,\"long_context\":{\"above_input_tokens\":200000,\"input_usd_per_mtok\":2,\"output_usd_per_mtok\":2,\"cache\":1}}}}", "models.M.long_context.cache: unknown field"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1,\"max_input_part_tokens\":0}}}", "models.M.max_input_part_tokens: must be a whole number >= 1"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1,\"max_output_tokens\":1.5}}}", "models.M.max_output_tokens: must be a whole number"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.upstream_model: missing"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{\"M\":{\"deployments\":[],\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.deployments: must be a list of 1 to 16"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{\"M\":{\"deployments\":[{\"provider\":\"p\",\"upstream_model\":\"m\"}],\"provider\":\"p\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.deployments: give provider and upstream_model, or deployments, not both"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{\"M\":{\"deployments\":[{\"provider\":\"p\",\"upstream_model\":\"m\",\"weight\":0}],\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.deployments[0].weight: must be a whole number from 1 to 100"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{\"M\":{\"deployments\":[{\"provider\":\"p\",\"upstream_model\":\"m\",\"weight\":101}],\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.deployments[0].weight: must be a whole number from 1 to 100"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{\"M\":{\"deployments\":[{\"provider\":\"p\",\"upstream_model\":\"m\"},{\"provider\":\"p\",\"upstream_model\":\"m\"}],\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.deployments[1]: deployment p/m is listed twice"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{\"M\":{\"deployments\":[{\"provider\":\"p\",\"upstream_model\":\"m\"},{\"provider\":\"a\",\"upstream_model\":\"m\"}],\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.deployments[1].provider: \"a\" speaks another API"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{\"M\":{\"deployments\":[{\"provider\":\"q\",\"upstream_model\":\"m\"}],\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.deployments[0].provider: no provider named \"q\""},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{\"M\":{\"deployments\":[{\"provider\":\"p\",\"upstream_model\":\"m\",\"region\":1}],\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.deployments[0].region: unknown field"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{\"M\":{\"deployments\":[\"p/m\"],\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.deployments[0]: must be an object"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"},\"a\":{\"base_url\":\"http://y\",\"api\":\"anthropic\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"weight\":2,\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.weight: belongs to an element of \"deployments\""},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}},\"admin_keys\":[{\"permissions\":[\"*\"]}]}", "admin_keys[0]: give exactly one of key_env and key_sha256"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}},\"admin_keys\":[{\"key_env\":\"UNIT_ADMIN\",\"permissions\":[\"root\"]}]}", "admin_keys[0].permissions: unknown permission"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}},\"admin_keys\":[{\"key_sha256\":\"abc\",\"permissions\":[\"*\"]}]}", "admin_keys[0].key_sha256: must be 64 hex digits"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}},\"extra\":1}", "test.json: extra: unknown field"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}},\"dev_keys\":[\"some-dev-key\"]}", "dev_keys: was removed"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        err[0] = 0;
        c = load(bad[i].cfg, err);
        CHECK(!c && strstr(err, bad[i].want) && strncmp(err, "test.json: ", 11) == 0, "bad config %zu: got \"%s\", want \"%s\"", i, err, bad[i].want);
        catalog_free(c);
    }
    CHECK(!catalog_load("/nonexistent/ltg.json", NULL, err, sizeof err) && strstr(err, "/nonexistent/ltg.json: cannot read"), "missing file");
}

/* ---- DNS ---- */

static void test_dns(void) {
    uint8_t q[300];
    int n = dns_build_query("api.example.com", 0x1234, q, sizeof q);
    static const uint8_t want[] = {0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 3, 'a', 'p', 'i', 7, 'e', 'x', 'a', 'm', 'p', 'l', 'e',
                                   3, 'c', 'o', 'm', 0, 0, 1, 0, 1};
    CHECK(n == (int)sizeof want && memcmp(q, want, sizeof want) == 0, "query bytes");
    CHECK(dns_build_query("a..b", 1, q, sizeof q) < 0, "empty label");
    CHECK(dns_build_query("example.com.", 1, q, sizeof q) > 0, "trailing dot");
    n = dns_build_query("api.example.com", 0x1234, q, sizeof q); /* the query the answers below answer */

    /* An answer: the question, a CNAME (ttl 300) then an A record (ttl 60), names compressed. */
    uint8_t a[512];
    memcpy(a, want, sizeof want);
    a[2] = 0x81, a[3] = 0x80, a[7] = 2;
    size_t i = sizeof want;
    static const uint8_t cname[] = {0xC0, 12, 0, 5, 0, 1, 0, 0, 1, 44, 0, 4, 1, 'x', 0xC0, 16};
    static const uint8_t arec[] = {0xC0, 28, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 10, 1, 2, 3};
    memcpy(a + i, cname, sizeof cname), i += sizeof cname;
    memcpy(a + i, arec, sizeof arec), i += sizeof arec;
    struct in_addr addr;
    uint32_t ttl;
    const char *why;
    CHECK(dns_parse_answer(a, i, q, (size_t)n, &addr, &ttl, &why) == 0 && ttl == 60 && ntohl(addr.s_addr) == 0x0A010203, "A after CNAME");
    uint8_t other[300];
    int on = dns_build_query("api.example.com", 0x9999, other, sizeof other);
    CHECK(dns_parse_answer(a, i, other, (size_t)on, &addr, &ttl, &why) < 0 && strstr(why, "another query"), "wrong id");
    on = dns_build_query("api.example.org", 0x1234, other, sizeof other);
    CHECK(dns_parse_answer(a, i, other, (size_t)on, &addr, &ttl, &why) < 0 && strstr(why, "another query"), "another name, the same id");
    on = dns_build_query("API.Example.COM", 0x1234, other, sizeof other);
    CHECK(dns_parse_answer(a, i, other, (size_t)on, &addr, &ttl, &why) == 0, "the same name in other case");
    a[5] = 2;
    CHECK(dns_parse_answer(a, i, q, (size_t)n, &addr, &ttl, &why) < 0, "two questions: not an answer to ours");
    a[5] = 1;
    for (size_t cut = 0; cut < i; cut++) /* every truncation fails cleanly (the guard page catches over-reads) */
        CHECK(dns_parse_answer((const uint8_t *)guarded((const char *)a, cut), cut, q, (size_t)n, &addr, &ttl, &why) < 0, "truncated at %zu", cut);
    a[3] = 0x83;
    CHECK(dns_parse_answer(a, i, q, (size_t)n, &addr, &ttl, &why) < 0 && strstr(why, "NXDOMAIN"), "nxdomain");
    /* A compression loop must not hang: a question and an answer both named by a pointer to themselves. */
    uint8_t loop[] = {0x12, 0x34, 0x81, 0x80, 0, 1, 0, 1, 0, 0, 0, 0, 0xC0, 12, 0, 1, 0, 1,
                      0xC0, 12, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4, 1, 2, 3, 4};
    CHECK(dns_parse_answer(loop, sizeof loop, loop, 18, &addr, &ttl, &why) == 0, "pointer answer parses");
}

/* ---- the store: validation ---- */

/* A group the test made, or NULL. */
static void group_drop(group *g) {
    if (g) group_free(&g->s);
}

static catalog *unit_cat;

/* Parse `body` as a create (or, with `base`, a PATCH over a clone of it)
 * and validate. Returns the group or NULL with *e filled. */
static group *try_group(const char *body, const group *base, verr *e) {
    json_tok t[256];
    json_result r;
    memset(e, 0, sizeof *e);
    if (json_parse(body, strlen(body), t, 256, -1, &r) < 0) {
        verr_at(e, NULL, NULL, "%s", r.err);
        e->code = "invalid_json";
        return NULL;
    }
    group *g = base ? (group *)group_clone(&base->s) : (group *)group_new();
    if (group_parse(body, t, 0, &g->s, base ? PARSE_PATCH : PARSE_CREATE, e) < 0 || group_validate(&g->s, unit_cat, e) < 0) {
        group_drop(g);
        return NULL;
    }
    return g;
}

static void expect_refused(const char *body, const group *base, const char *code, const char *pointer, const char *words) {
    verr e;
    group *g = try_group(body, base, &e);
    CHECK(!g && e.code && strcmp(e.code, code) == 0 && strcmp(e.pointer, pointer) == 0 && strstr(e.detail, words),
          "%s: got %s %s \"%s\", want %s %s \"%s\"", body, e.code ? e.code : "(accepted)", e.pointer, e.detail, code, pointer, words);
    group_drop(g);
}

static void test_group_validation(void) {
    char err[512];
    unit_cat = catalog_load("t.json", FIXTURE_CATALOG, err, sizeof err);
    CHECK(unit_cat != NULL, "catalog: %s", err);
    verr e;
    group *g = try_group(FIXTURE_FULL_GROUP, NULL, &e);
    CHECK(g && g->nfb == 1 && g->fb[0].n == 3 && g->retries.max_attempts == 5 && g->retries.backoff == BACKOFF_LINEAR &&
          g->s.al.max_budget == 0.123456 && g->s.al.budget_days == 7 && g->cache_ttl == 0 && g->max_parallel == 1 && g->s.blocked, "full group: %s %s", e.pointer, e.detail);
    group *min = try_group("{\"name\":\"m\",\"allowed_models\":[]}", NULL, &e);
    CHECK(min && !min->has_retries && !min->s.al.has_budget && min->cache_ttl == UNSET && min->max_parallel == UNSET, "minimal group");
    group_drop(min);

    /* The catalog is checked first, whatever else is wrong. */
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\",\"Nope\"],\"retries\":{\"max_attempts\":9}}", NULL, "model_not_in_catalog", "/allowed_models/1", "Nope");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\"],\"fallbacks\":{\"Z\":[]}}", NULL, "model_not_in_catalog", "/fallbacks/Z", "Z");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\"],\"fallbacks\":{\"A\":[\"Q\"]}}", NULL, "model_not_in_catalog", "/fallbacks/A/0", "Q");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\"],\"fallbacks\":{\"A\":[\"B\",\"x~/\"]}}", NULL, "model_not_in_catalog", "/fallbacks/A/1", "x~/");
    /* RFC 6901 escaping of "~" and "/" in a pointer. */
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\"],\"fallbacks\":{\"x/y~z\":[\"A\"]}}", NULL, "invalid_request", "/fallbacks/x~1y~0z", "not in allowed_models");
    /* Fallback rules. */
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\",\"B\"],\"fallbacks\":{\"C\":[\"A\"]}}", NULL, "invalid_request", "/fallbacks/C", "not in allowed_models");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\",\"B\"],\"fallbacks\":{\"A\":[\"B\",\"C\"]}}", NULL, "invalid_request", "/fallbacks/A/1", "must also be in allowed_models");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\",\"B\"],\"fallbacks\":{\"A\":[\"A\"]}}", NULL, "invalid_request", "/fallbacks/A/0", "its own fallback");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\",\"B\"],\"fallbacks\":{\"A\":[\"B\",\"B\"]}}", NULL, "invalid_request", "/fallbacks/A/1", "twice");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\",\"B\",\"C\",\"D\",\"E\"],\"fallbacks\":{\"A\":[\"B\",\"C\",\"D\",\"E\"]}}", NULL, "invalid_request", "/fallbacks/A", "at most 3");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\"],\"fallbacks\":{\"A\":\"B\"}}", NULL, "invalid_request", "/fallbacks/A", "list");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\"],\"fallbacks\":[]}", NULL, "invalid_request", "/fallbacks", "object");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[\"A\",\"A\"]}", NULL, "invalid_request", "/allowed_models/1", "twice");
    /* Retry ranges, each edge. */
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"max_attempts\":0}}", NULL, "invalid_request", "/retries/max_attempts", "between 1 and 5");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"max_attempts\":6}}", NULL, "invalid_request", "/retries/max_attempts", "between 1 and 5");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"retry_delay_ms\":-1}}", NULL, "invalid_request", "/retries/retry_delay_ms", "between 0 and 60000");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"retry_delay_ms\":60001}}", NULL, "invalid_request", "/retries/retry_delay_ms", "between 0 and 60000");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"request_timeout_ms\":99}}", NULL, "invalid_request", "/retries/request_timeout_ms", "between 100 and 600000");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"request_timeout_ms\":600001}}", NULL, "invalid_request", "/retries/request_timeout_ms", "between 100 and 600000");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"request_timeout_ms\":0}}", NULL, "invalid_request", "/retries/request_timeout_ms", "between 100 and 600000");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"deadline_ms\":999}}", NULL, "invalid_request", "/retries/deadline_ms", "between 1000 and 3600000");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"deadline_ms\":3600001}}", NULL, "invalid_request", "/retries/deadline_ms", "between 1000 and 3600000");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"deadline_ms\":0}}", NULL, "invalid_request", "/retries/deadline_ms", "between 1000 and 3600000");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"backoff\":\"random\"}}", NULL, "invalid_request", "/retries/backoff", "exponential");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"max_attempts\":2.5}}", NULL, "invalid_request", "/retries/max_attempts", "whole number");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":{\"jitter\":1}}", NULL, "invalid_request", "/retries/jitter", "unknown field");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"retries\":5}", NULL, "invalid_request", "/retries", "object");
    /* Other fields. */
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"max_budget\":-1}", NULL, "invalid_request", "/max_budget", "between 0");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"max_budget\":0.1234567}", NULL, "invalid_request", "/max_budget", "six decimal places");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"max_budget\":\"10\"}", NULL, "invalid_request", "/max_budget", "number");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"budget_duration\":\"2d\"}", NULL, "invalid_request", "/budget_duration", "\"30d\"");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"cache_ttl\":-5}", NULL, "invalid_request", "/cache_ttl", "between 0 and");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"cache_ttl\":1.5}", NULL, "invalid_request", "/cache_ttl", "whole number");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"max_parallel_requests\":0}", NULL, "invalid_request", "/max_parallel_requests", "between 1");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"blocked\":\"yes\"}", NULL, "invalid_request", "/blocked", "true or false");
    expect_refused("{\"name\":5,\"allowed_models\":[]}", NULL, "invalid_request", "/name", "string");
    expect_refused("{\"name\":\"\",\"allowed_models\":[]}", NULL, "invalid_request", "/name", "1 to 200");
    expect_refused("{\"name\":\"g\",\"allowed_models\":\"A\"}", NULL, "invalid_request", "/allowed_models", "list");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[1]}", NULL, "invalid_request", "/allowed_models/0", "string");
    expect_refused("{\"allowed_models\":[]}", NULL, "invalid_request", "/name", "required");
    expect_refused("{\"name\":\"g\"}", NULL, "invalid_request", "/allowed_models", "required");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"frobnicate\":1}", NULL, "invalid_request", "/frobnicate", "unknown field");
    expect_refused("{\"name\":\"g\",\"allowed_models\":[],\"version\":3}", NULL, "invalid_request", "/version", "read-only");
    expect_refused("[]", NULL, "invalid_request", "", "JSON object");

    /* PATCH: omitted kept, null clears, nested objects replaced whole, rules on the merged result. */
    if (g) {
        group *p = try_group("{\"name\":\"renamed\"}", g, &e);
        CHECK(p && strcmp(p->s.name, "renamed") == 0 && p->nfb == 1 && p->retries.max_attempts == 5 && p->s.al.has_budget, "patch keeps the rest");
        group_drop(p);
        p = try_group("{\"retries\":null,\"fallbacks\":null,\"max_budget\":null,\"cache_ttl\":null,\"max_parallel_requests\":null}", g, &e);
        CHECK(p && !p->has_retries && p->nfb == 0 && !p->s.al.has_budget && p->cache_ttl == UNSET && p->max_parallel == UNSET, "null clears");
        group_drop(p);
        p = try_group("{\"retries\":{\"max_attempts\":3}}", g, &e);
        CHECK(p && p->retries.max_attempts == 3 && p->retries.retry_delay_ms == 250 && p->retries.backoff == BACKOFF_EXPONENTIAL &&
              p->retries.request_timeout_ms == 0, "retries replaced whole, not merged");
        group_drop(p);
        expect_refused("{\"allowed_models\":[\"A\"]}", g, "invalid_request", "/fallbacks/A/0", "must also be in allowed_models");
        expect_refused("{\"name\":null}", g, "invalid_request", "/name", "cannot be null");
        expect_refused("{\"allowed_models\":null}", g, "invalid_request", "/allowed_models", "cannot be null");
        CHECK(strcmp(g->s.name, "g") == 0 && g->nallowed == 5, "a refused patch leaves the original untouched");
    }
    group_drop(g);
}

/* ---- the store: the log ---- */

static char unit_dir[256]; /* a new, empty directory for each test (main) */

/* Log g as the handlers do (one record), then put it in memory. */
/* Append {"ops":[{op: item}]} to the state log: the record's size. */
static size_t unit_log_put(const char *op, const buf *item) {
    buf p = {0};
    buf_printf(&p, "{\"ops\":[{\"%s\":%s}]}", op, item->p);
    const char *why;
    CHECK(state_append(p.p, p.len, &why) == 0, "append a %s", op);
    size_t n = p.len + 8;
    buf_free(&p);
    return n;
}

static group *log_put_group(group *g) {
    buf item = {0};
    jwriter w;
    jw_init(&w, &item), group_json(&w, &g->s, 1);
    store_put(&GROUPS, &g->s, unit_log_put("put_group", &item));
    buf_free(&item);
    return g;
}

/* Log and apply a group as the handlers do: one record, then memory. */
static group *log_group(const char *name, int i) {
    group *g = (group *)group_new();
    uuid_new(g->s.id);
    char nm[64];
    snprintf(nm, sizeof nm, "%s-%d", name, i);
    g->s.name = xstrdup(nm);
    g->allowed = xcalloc(1, sizeof *g->allowed), g->allowed[0] = xstrdup("A"), g->nallowed = 1;
    g->s.version = 1, g->s.created_at = g->s.updated_at = 1700000000000LL + i;
    return log_put_group(g);
}

static void log_delete_group(const char *id) {
    char p[128];
    snprintf(p, sizeof p, "{\"ops\":[{\"del_group\":\"%s\"}]}", id);
    const char *why;
    CHECK(state_append(p, strlen(p), &why) == 0, "append delete");
    store_del(&GROUPS, id);
}

/* A fingerprint of the store: every group's log JSON, in id order. */
static void store_fingerprint(buf *out) {
    out->len = 0;
    int n = 0;
    group **all = xcalloc((size_t)ST.gv.live + 1, sizeof *all);
    for (int i = 0; i < ST.gv.n; i++)
        if (ST.gv.p[i]) all[n++] = ST.gv.p[i];
    for (int i = 1; i < n; i++) /* insertion sort by id: small n */
        for (int k = i; k > 0 && strcmp(all[k - 1]->s.id, all[k]->s.id) > 0; k--) {
            group *t = all[k];
            all[k] = all[k - 1], all[k - 1] = t;
        }
    jwriter w;
    jw_init(&w, out);
    jw_open(&w, '[');
    for (int i = 0; i < n; i++) group_json(&w, &all[i]->s, 1);
    jw_close(&w, ']');
    free(all);
}

static int reopen(char *err) {
    store_reset();
    snprintf(LOG.tmp, sizeof LOG.tmp, "%.200s/state.log.tmp", unit_dir);
    return log_open(&LOG.f, unit_dir, "state.log", LOG_MAGIC, 0, store_apply, NULL, err, 512);
}

static off_t file_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? st.st_size : -1;
}

static void test_log(void) {
    char err[512], path[300];
    snprintf(path, sizeof path, "%s/state.log", unit_dir);
    store_reset();
    CHECK(reopen(err) == 0 && file_size(path) == 8, "new log: %s", err);
    group *g1 = log_group("a", 1);
    char id1[37];
    memcpy(id1, g1->s.id, 37);
    log_group("b", 2);
    group *g3 = log_group("c", 3);
    char id3[37];
    memcpy(id3, g3->s.id, 37);
    log_delete_group(id3);
    buf before = {0}, after = {0};
    store_fingerprint(&before);
    off_t whole = file_size(path);

    CHECK(reopen(err) == 0 && ST.gv.live == 2 && group_find(id1) && !group_find(id3), "replay: %s", err);
    store_fingerprint(&after);
    CHECK(before.len == after.len && memcmp(before.p, after.p, before.len) == 0, "replay gives the same state");

    /* A torn tail: half a record. */
    int fd = open(path, O_WRONLY | O_APPEND);
    uint8_t h[8];
    put_le32(h, 100), put_le32(h + 4, 0);
    CHECK(write(fd, h, 8) == 8 && write(fd, "{\"ops\":[", 8) == 8, "write torn");
    close(fd);
    CHECK(reopen(err) == 0 && file_size(path) == whole && ST.gv.live == 2, "torn tail truncated");
    /* A torn tail: a whole-length record whose checksum fails (the last one). */
    fd = open(path, O_WRONLY | O_APPEND);
    const char *pl = "{\"ops\":[]}";
    put_le32(h, (uint32_t)strlen(pl)), put_le32(h + 4, crc32(pl, strlen(pl)) ^ 1);
    CHECK(write(fd, h, 8) == 8 && write(fd, pl, strlen(pl)) == (ssize_t)strlen(pl), "write bad tail");
    close(fd);
    CHECK(reopen(err) == 0 && file_size(path) == whole, "bad last record truncated");
    /* Only a few bytes of a header. */
    fd = open(path, O_WRONLY | O_APPEND);
    CHECK(write(fd, h, 3) == 3, "write 3");
    close(fd);
    CHECK(reopen(err) == 0 && file_size(path) == whole, "torn header truncated");

    /* Damage in the middle: a flipped byte in the first record stops start-up. */
    fd = open(path, O_RDWR);
    char c;
    CHECK(pread(fd, &c, 1, 20) == 1, "read");
    c ^= 0x20;
    CHECK(pwrite(fd, &c, 1, 20) == 1, "flip");
    close(fd);
    CHECK(reopen(err) < 0 && strstr(err, "damaged record at offset 8") && strstr(err, "checksum"), "damage in the middle: %s", err);
    CHECK(file_size(path) == whole, "a damaged log is not truncated");
    /* Not an ltg log at all. */
    fd = open(path, O_RDWR);
    CHECK(pwrite(fd, "XXXXXXXX", 8, 0) == 8, "magic");
    close(fd);
    CHECK(reopen(err) < 0 && strstr(err, "not an ltg state.log"), "bad magic: %s", err);

    /* Compaction: a log grown past twice the live state is rewritten in steps
     * while changes keep arriving, and replays to the same state. */
    unlink(path);
    CHECK(reopen(err) == 0, "fresh");
    static char ids[4000][37];
    for (int i = 0; i < 4000; i++) memcpy(ids[i], log_group("g", i)->s.id, 37);
    for (int i = 0; i < 2000; i++) log_delete_group(ids[i]); /* 2000 live groups, 6000 records */
    off_t grown = LOG.f.size;
    CHECK(compact_due(wall_ms()), "compaction due: log %lld, live %zu", (long long)LOG.f.size, ST.live_bytes);
    int steps = 0, during = 0;
    while (store_tick()) { /* changes arrive between the steps */
        steps++;
        log_group("during", during++);
        if (steps == 1) log_delete_group(ids[3999]);
    }
    off_t small = file_size(path);
    CHECK(steps >= 3 && !LOG.compacting && small < grown / 2 && small == LOG.f.size, "compacted %lld -> %lld bytes in %d steps",
          (long long)grown, (long long)small, steps);
    CHECK(access(LOG.tmp, F_OK) != 0, "no temporary file left");
    log_group("after", 1); /* the new file takes appends */
    store_fingerprint(&before);
    int want = 2000 - 1 + during + 1;
    CHECK(reopen(err) == 0 && ST.gv.live == want, "replay after compaction: %d groups, want %d", ST.gv.live, want);
    store_fingerprint(&after);
    CHECK(before.len == after.len && memcmp(before.p, after.p, before.len) == 0, "compaction keeps the state");
    buf_free(&before), buf_free(&after);
    store_reset();
}

/* ---- the ledger's days, with an injected clock ---- */

#define UDAY 1795910400000LL /* 2026-11-29T00:00:00Z */

static char ledger_data[300];
static int unit_nevents;

static const char *unit_id(char kind, int i) { /* a 36-byte id, distinct per (kind, i) */
    static char ids[4][64][37];
    char *s = ids[kind == 'k' ? 0 : kind == 'g' ? 1 : 2][i];
    snprintf(s, 37, "%c%07d-0000-4000-8000-000000000000", kind == 'k' ? 'a' : 'b', i); /* hex: a key 'a...', a group 'b...' */
    return s;
}

/* One event, as exchange_settle writes it; its JSON names its number. */
static void unit_event(int64_t at, int key, int grp, const char *alias, int64_t charged, int status) {
    char ev[128];
    snprintf(ev, sizeof ev, "{\"n\":%d,\"token_group_id\":\"%s\"}", unit_nevents++, unit_id('g', grp));
    rec_view v = {.charged = charged, .tok = {[TOK_IN] = 10, [TOK_OUT] = 3}, .status = (uint8_t)status, .key = unit_id('k', key),
                  .group = unit_id('g', grp), .model = alias, .model_len = strlen(alias), .event = ev, .event_len = strlen(ev), .replay = ""};
    int64_t day;
    uint64_t off;
    uint32_t len;
    CHECK(ledger_add(&v, at, &day, &off, &len) == 0 && day == day_of(at > LG.last_at ? at : LG.last_at), "event at %lld", (long long)at);
}

/* The numbers of the events a query shows, as "0,1,2". */
static void unit_page(const ledger_query *q, size_t skip, size_t size, char *out, size_t cap, size_t *total) {
    buf b = {0};
    jwriter w;
    jw_init(&w, &b), jw_open(&w, '[');
    *total = ledger_page(q, skip, size, &w);
    jw_close(&w, ']');
    out[0] = 0;
    for (const char *p = b.p; (p = strstr(p, "\"n\":")); p += 4) snprintf(out + strlen(out), cap - strlen(out), "%s%d", out[0] ? "," : "", atoi(p + 4));
    buf_free(&b);
}

static ledger_query unit_query(int64_t start, int days) { return (ledger_query){start, start + days * DAY_MS, NULL, NULL, INT64_MAX, UINT32_MAX}; }

/* Seal what the clock says has ended: sync the events, then a tick. */
static void unit_tick(int64_t now) {
    ledger_sync(NULL);
    S.now += IDX_RETRY_MS + 1;
    ledger_tick(now);
    ledger_sync(NULL);
    ledger_tick(now);
}

/* ledger_data: a new, empty directory of unit_dir named `name`, for a test's ledger. */
static void unit_data_dir(const char *name) {
    char cmd[1400];
    snprintf(ledger_data, sizeof ledger_data, "%s/%s", unit_dir, name);
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", ledger_data, ledger_data);
    CHECK(system(cmd) == 0, "mkdir %s", ledger_data);
}

static int unit_reopen_ledger(int64_t now, char *err) {
    store_reset();
    snprintf(LOG.tmp, sizeof LOG.tmp, "%.200s/state.log.tmp", ledger_data);
    if (log_open(&LOG.f, ledger_data, "state.log", LOG_MAGIC, 0, store_apply, NULL, err, 512) < 0) return LTG_ERR;
    if (ledger_open(ledger_data, now, err, 512) < 0) return LTG_ERR;
    budget_rebuild(now);
    return 0;
}

static group *unit_group(int i, int budget_days, int64_t anchor) {
    group *g = (group *)group_new();
    memcpy(g->s.id, unit_id('g', i), 37);
    g->s.name = xstrdup("u"), g->allowed = xcalloc(1, sizeof *g->allowed), g->nallowed = 0;
    g->s.version = 1, g->s.created_at = g->s.updated_at = anchor;
    g->s.al.has_budget = 1, g->s.al.max_budget = 1000, g->s.al.budget_days = budget_days, g->s.al.budget_anchor = anchor;
    return log_put_group(g);
}

/* A token key of group `grp` with a budget (budget_days as a group's; -2: none), logged and applied. */
static tkey *unit_key(int i, int grp, int budget_days, int64_t anchor) {
    tkey *k = (tkey *)tkey_new();
    memcpy(k->s.id, unit_id('k', i), 37), memcpy(k->group_id, unit_id('g', grp), 37);
    k->s.name = xstrdup("k"), k->s.version = 1, k->s.created_at = k->s.updated_at = anchor, k->hash[0] = (uint8_t)i;
    if (budget_days > -2) k->s.al.has_budget = 1, k->s.al.max_budget = 1000, k->s.al.budget_days = budget_days, k->s.al.budget_anchor = anchor;
    buf item = {0};
    jwriter w;
    jw_init(&w, &item), tkey_json(&w, &k->s, 1);
    store_put(&KEYS, &k->s, unit_log_put("put_key", &item));
    buf_free(&item);
    return k;
}

static void test_ledger_days(void) {
    char err[512], path[400], got[256];
    size_t total;
    unit_data_dir("ledger-days");
    S.ledger_days = 90, S.now = 1000000;
    CHECK(unit_reopen_ledger(UDAY + DAY_MS - 1000, err) == 0 && LG.nseg == 0, "an empty ledger: %s", err);

    /* Roll-over mid-traffic: three events on the 29th, two on the 30th. */
    unit_event(UDAY + DAY_MS - 900, 0, 0, "A", 5, EV_SUCCEEDED);
    unit_event(UDAY + DAY_MS - 800, 1, 0, "B", 7, EV_FAILED);
    unit_event(UDAY + DAY_MS - 700, 2, 1, "A", 11, EV_SUCCEEDED);
    unit_event(UDAY + DAY_MS + 100, 0, 0, "A", 13, EV_PARTIAL);
    unit_event(UDAY + DAY_MS + 200, 2, 1, "B", 17, EV_SUCCEEDED);
    CHECK(LG.nseg == 2 && LG.seg[0]->state == SEG_SEALING && LG.seg[1]->state == SEG_OPEN && LG.seg[1]->day == UDAY + DAY_MS,
          "the day ended: the 29th is sealing, the 30th open");
    ledger_query q = unit_query(UDAY, 2);
    unit_page(&q, 0, 50, got, sizeof got, &total);
    CHECK(total == 5 && strcmp(got, "0,1,2,3,4") == 0, "before the seal: %s", got);
    unit_tick(UDAY + DAY_MS + 300);
    seg_path(UDAY, ".idx", LG.dir, path, sizeof path);
    CHECK(LG.seg[0]->state == SEG_SEALED && access(path, F_OK) == 0 && LG.seg[0]->nchunk == 1 && seg_count(LG.seg[0]) == 3, "sealed, with its index file");
    CHECK(LG.seg[0]->f.fd < 0 && LG.seg[0]->mem.n == 0, "a sealed day holds no memory and no fd");

    /* Queries across the two days: pages, filters, snapshots, usage. */
    for (int pass = 0; pass < 2; pass++) {
        unit_page(&q, 0, 50, got, sizeof got, &total);
        CHECK(total == 5 && strcmp(got, "0,1,2,3,4") == 0, "every event, in order (pass %d): %s", pass, got);
        unit_page(&q, 2, 2, got, sizeof got, &total);
        CHECK(total == 5 && strcmp(got, "2,3") == 0, "a page across the days: %s", got);
        q.key = unit_id('k', 0);
        unit_page(&q, 0, 50, got, sizeof got, &total);
        CHECK(total == 2 && strcmp(got, "0,3") == 0, "by key: %s", got);
        q.group = unit_id('g', 0);
        unit_page(&q, 1, 50, got, sizeof got, &total);
        CHECK(total == 2 && strcmp(got, "3") == 0, "by key and its group, page 2: %s", got);
        q.group = unit_id('g', 1);
        unit_page(&q, 0, 50, got, sizeof got, &total);
        CHECK(total == 0 && !got[0], "by key and another group: none");
        q.key = NULL;
        unit_page(&q, 0, 50, got, sizeof got, &total);
        CHECK(total == 2 && strcmp(got, "2,4") == 0, "by group: %s", got);
        q.group = NULL, q.snap_day = UDAY + DAY_MS, q.snap_n = 1;
        unit_page(&q, 0, 50, got, sizeof got, &total);
        CHECK(total == 4 && strcmp(got, "0,1,2,3") == 0, "a snapshot taken at the 30th's first event: %s", got);
        q.snap_day = UDAY, q.snap_n = 2;
        unit_page(&q, 0, 50, got, sizeof got, &total);
        CHECK(total == 2 && strcmp(got, "0,1") == 0, "a snapshot of the 29th: %s", got);
        q = unit_query(UDAY + DAY_MS, 1);
        unit_page(&q, 0, 50, got, sizeof got, &total);
        CHECK(total == 2 && strcmp(got, "3,4") == 0, "one day: %s", got);
        q = unit_query(UDAY, 2);
        usage_row by_day[2] = {{0}}, all = {0};
        model_usage *mu = NULL;
        int nmu = 0;
        ledger_usage(UDAY, 2, NULL, by_day, &all, &mu, &nmu);
        CHECK(all.requests == 5 && by_day[0].requests == 3 && by_day[1].requests == 2 && all.spend == 53 && by_day[0].failed == 1 &&
              by_day[1].partial == 1 && all.tok[TOK_IN] == 50, "usage by day");
        CHECK(nmu == 2 && strcmp(mu[0].alias, "A") == 0 && mu[0].u.requests == 3 && mu[0].u.spend == 29 && mu[1].u.spend == 24, "usage by model");
        free(mu), mu = NULL, nmu = 0;
        memset(by_day, 0, sizeof by_day), memset(&all, 0, sizeof all);
        ledger_usage(UDAY, 2, unit_id('g', 1), by_day, &all, &mu, &nmu);
        CHECK(all.requests == 2 && all.spend == 28 && by_day[0].spend == 11 && nmu == 2, "usage of one group");
        free(mu);
        CHECK(seg_spent_since(LG.seg[0], 'g', unit_id('g', 0), UDAY + DAY_MS - 850) == 7 && seg_spent_since(LG.seg[0], 'g', unit_id('g', 0), 0) == 12 &&
              seg_spent_since(LG.seg[0], 'g', unit_id('g', 0), UDAY + DAY_MS) == 0, "a group's spend since a time, from the running sums");
        CHECK(seg_spent_since(LG.seg[0], 'k', unit_id('k', 0), 0) == 5 && seg_spent_since(LG.seg[0], 'k', unit_id('k', 0), UDAY + DAY_MS - 850) == 0 &&
              seg_spent_since(LG.seg[0], 'k', unit_id('k', 2), UDAY + DAY_MS - 750) == 11 && seg_spent_since(LG.seg[1], 'k', unit_id('k', 0), 0) == 13 &&
              seg_spent_since(LG.seg[0], 'k', unit_id('k', 7), 0) == 0, "a key's spend since a time: a sealed day's running sums, the open day's events");
        CHECK(unit_reopen_ledger(UDAY + DAY_MS + 400, err) == 0 && LG.nseg == 2 && LG.seg[0]->state == SEG_SEALED &&
              LG.seg[1]->state == SEG_OPEN && LG.seg[1]->mem.n == 2, "start-up: the sealed day from its index, the open one replayed: %s", err);
    }

    /* A damaged index file, and a missing one, are rebuilt from the log. */
    int fd = open(path, O_RDWR);
    char c = 0;
    CHECK(fd >= 0 && pread(fd, &c, 1, 200) == 1, "read");
    c ^= 1;
    CHECK(pwrite(fd, &c, 1, 200) == 1, "flip a byte");
    close(fd);
    CHECK(unit_reopen_ledger(UDAY + DAY_MS + 400, err) == 0 && LG.seg[0]->state == SEG_SEALED && LG.seg[0]->nchunk == 1 && seg_count(LG.seg[0]) == 3,
          "a damaged index file is rebuilt");
    unit_page(&q, 0, 50, got, sizeof got, &total);
    CHECK(total == 5 && strcmp(got, "0,1,2,3,4") == 0, "the same events after the rebuild: %s", got);
    unlink(path);
    CHECK(unit_reopen_ledger(UDAY + DAY_MS + 400, err) == 0 && access(path, F_OK) == 0 && LG.seg[0]->state == SEG_SEALED, "a missing one too");

    /* Retention: --ledger-days 1 keeps yesterday and today. */
    S.ledger_days = 1;
    unit_tick(UDAY + DAY_MS + 500);
    CHECK(LG.nseg == 2, "on the 30th both days are kept");
    unit_tick(UDAY + 2 * DAY_MS + 10);
    seg_path(UDAY, ".log", LG.dir, path, sizeof path);
    CHECK(LG.nseg == 1 && LG.seg[0]->day == UDAY + DAY_MS && LG.seg[0]->state == SEG_SEALED && access(path, F_OK) != 0,
          "on the 1st the 30th is sealed and the 29th deleted");
    CHECK(ledger_retained_from(UDAY + 2 * DAY_MS + 10) == UDAY + DAY_MS, "retained_from");
    unit_tick(UDAY + 3 * DAY_MS);
    CHECK(LG.nseg == 0, "and on the 2nd the 30th");
    S.ledger_days = 90;
    store_reset();
}

/* Rollups against a full recount, and budgets through restarts, retention
 * and a crash between a carried spend and the deletion it precedes. */
/* Budgets, rollups and retention over four days; with a small index_bytes
 * (--ledger-index-mb) every day is in several chunks. */
static void test_ledger_budgets(long long index_bytes) {
    char err[512], cmd[1400];
    unit_data_dir("ledger-budgets");
    S.ledger_days = 30, S.now = 1000000, S.ledger_index = index_bytes;
    CHECK(unit_reopen_ledger(UDAY, err) == 0, "open: %s", err);
    unit_group(0, 0, UDAY - 5 * DAY_MS); /* a lifetime budget */
    unit_group(1, 1, UDAY + DAY_MS / 2); /* a daily one, anchored at noon */
    unit_group(2, 7, UDAY + 3600000);    /* a weekly one */
    unit_key(0, 0, 0, UDAY - 5 * DAY_MS);  /* keys: a lifetime budget, */
    unit_key(2, 1, 1, UDAY + DAY_MS / 2);  /* a daily one, */
    unit_key(3, 1, -2, UDAY);              /* none */
    /* Four days of events from 6 keys of 3 groups over 3 models, and the recount they must match. */
    static const char *models[] = {"A", "B", "C"};
    usage_row want[4][3][3] = {{{{0}}}};
    int64_t spent[3][4] = {{0}}, kspent[6][4] = {{0}}, at = UDAY;
    uint64_t rnd = 12345;
    for (int i = 0; i < 3000; i++) {
        rnd = rnd * 6364136223846793005ULL + 1442695040888963407ULL;
        at += (int64_t)((rnd >> 33) % 200000);
        int key = (int)((rnd >> 20) % 6), grp = key / 2, m = (int)((rnd >> 40) % 3), st = (int)((rnd >> 50) % 3);
        int64_t charged = (int64_t)((rnd >> 44) % 1000);
        int d = (int)((at - UDAY) / DAY_MS);
        if (at >= UDAY + 3 * DAY_MS + DAY_MS / 3) break;
        unit_event(at, key, grp, models[m], charged, st);
        ledger_entry e = {.tok = {[TOK_IN] = 10, [TOK_OUT] = 3}, .status = (uint8_t)st, .charged = charged};
        usage_add(&want[d][grp][m], &e);
        spent[grp][d] += charged, kspent[key][d] += charged;
        if (i % 500 == 0) unit_tick(at);
    }
    int64_t now = UDAY + 3 * DAY_MS + DAY_MS / 3;
    unit_tick(now);
    CHECK(LG.nseg == 4 && LG.seg[2]->state == SEG_SEALED && LG.seg[3]->state == SEG_OPEN, "three sealed days and an open one");
    CHECK(index_bytes > (1 << 20) ? LG.seg[1]->nchunk == 1 : LG.seg[1]->nchunk > 2 && LG.seg[3]->nchunk > 0, "%u chunks a day", LG.seg[1]->nchunk);
    for (int pass = 0; pass < 2; pass++) {
        for (int grp = -1; grp < 3; grp++) {
            usage_row by_day[4] = {{0}}, all = {0};
            model_usage *mu = NULL;
            int nmu = 0, same = 1;
            ledger_usage(UDAY, 4, grp < 0 ? NULL : unit_id('g', grp), by_day, &all, &mu, &nmu);
            for (int d = 0; d < 4; d++) {
                usage_row w = {0};
                for (int g = 0; g < 3; g++)
                    for (int m = 0; m < 3; m++)
                        if (grp < 0 || g == grp) usage_sum(&w, &want[d][g][m]);
                same &= memcmp(&w, &by_day[d], sizeof w) == 0;
            }
            for (int k = 0; k < nmu; k++) {
                usage_row w = {0};
                for (int d = 0; d < 4; d++)
                    for (int g = 0; g < 3; g++)
                        if (grp < 0 || g == grp) usage_sum(&w, &want[d][g][mu[k].alias[0] - 'A']);
                same &= memcmp(&w, &mu[k].u, sizeof w) == 0;
            }
            CHECK(same && nmu == 3, "the rollups equal a full recount (group %d, pass %d)", grp, pass);
            free(mu);
        }
        CHECK(unit_reopen_ledger(now, err) == 0, "reopen: %s", err);
    }
    /* Budgets: the lifetime one counts all four days, the daily one since its anchor's hour yesterday, the weekly one since its anchor. */
    group *g0 = group_find(unit_id('g', 0)), *g1 = group_find(unit_id('g', 1)), *g2 = group_find(unit_id('g', 2));
    int64_t life_want = spent[0][0] + spent[0][1] + spent[0][2] + spent[0][3], daily_want = 0, weekly_want = 0, kdaily_want = 0;
    int64_t klife_want = kspent[0][0] + kspent[0][1] + kspent[0][2] + kspent[0][3];
    for (int i = 0; i < LG.nseg; i++) {
        segment *s = LG.seg[i];
        seg_view v;
        buf rec = {0};
        rec_view rv;
        int64_t n = view_open(&v, s, 0, NULL, UINT32_MAX) == 0 ? seg_count(s) : 0;
        for (int64_t k = 0; k < n; k++)
            if (view_record(&v, (uint32_t)k, &rec, &rv) == 0) {
                if (memcmp(rv.group, unit_id('g', 1), 36) == 0 && rv.at >= UDAY + 2 * DAY_MS + DAY_MS / 2) daily_want += rv.charged;
                if (memcmp(rv.group, unit_id('g', 2), 36) == 0 && rv.at >= UDAY + 3600000) weekly_want += rv.charged;
                if (memcmp(rv.key, unit_id('k', 2), 36) == 0 && rv.at >= UDAY + 2 * DAY_MS + DAY_MS / 2) kdaily_want += rv.charged;
            }
        view_close(&v), buf_free(&rec);
    }
    CHECK(g0->s.al.spend == life_want && g1->s.al.spend == daily_want && g2->s.al.spend == weekly_want && daily_want > 0,
          "budgets from rollups and running sums: %lld/%lld %lld/%lld %lld/%lld", (long long)g0->s.al.spend, (long long)life_want,
          (long long)g1->s.al.spend, (long long)daily_want, (long long)g2->s.al.spend, (long long)weekly_want);
    tkey *k0 = tkey_find(unit_id('k', 0)), *k2 = tkey_find(unit_id('k', 2)), *k3 = tkey_find(unit_id('k', 3));
    CHECK(k0 && k2 && k3 && k0->s.al.spend == klife_want && k2->s.al.spend == kdaily_want && kdaily_want > 0 && k3->s.al.spend == 0,
          "keys' budgets from their running sums: %lld/%lld %lld/%lld", k0 ? (long long)k0->s.al.spend : -1LL, (long long)klife_want,
          k2 ? (long long)k2->s.al.spend : -1LL, (long long)kdaily_want);
    /* Retention takes the 29th: the lifetime budget carries it, through a restart. */
    S.ledger_days = 2;
    verr e = {0};
    group *g;
    char saved[1400];
    snprintf(cmd, sizeof cmd, "cp %s/ledger/2026-11-29.log %s/saved.log && cp %s/ledger/2026-11-29.idx %s/saved.idx", ledger_data, ledger_data, ledger_data, ledger_data);
    CHECK(system(cmd) == 0, "save the 29th");
    unit_tick(now);
    CHECK(LG.nseg == 3 && LG.seg[0]->day == UDAY + DAY_MS, "the 29th deleted");
    CHECK(g0->s.al.spend == life_want && g0->s.al.carry == spent[0][0] && g0->s.al.carry_to == UDAY + DAY_MS, "carried: %lld of %lld",
          (long long)g0->s.al.carry, (long long)spent[0][0]);
    k0 = tkey_find(unit_id('k', 0));
    CHECK(k0->s.al.spend == klife_want && k0->s.al.carry == kspent[0][0] && k0->s.al.carry_to == UDAY + DAY_MS && kspent[0][0] > 0,
          "a key's lifetime budget carried too: %lld of %lld", (long long)k0->s.al.carry, (long long)kspent[0][0]);
    CHECK(unit_reopen_ledger(now, err) == 0, "reopen: %s", err);
    k0 = tkey_find(unit_id('k', 0));
    CHECK(k0 && k0->s.al.spend == klife_want, "after a restart the key's lifetime spend is the same: %lld", k0 ? (long long)k0->s.al.spend : -1LL);
    g0 = group_find(unit_id('g', 0));
    g2 = group_find(unit_id('g', 2));
    CHECK(g0 && g0->s.al.spend == life_want, "after a restart the lifetime spend is the same: %lld", g0 ? (long long)g0->s.al.spend : -1LL);
    CHECK(g2 && g2->s.al.spend == weekly_want, "and so is a weekly one's, under a retention lowered to 2 days: %lld", g2 ? (long long)g2->s.al.spend : -1LL);
    /* A crash after the carried spend was logged but before the day was deleted: not counted twice. */
    snprintf(saved, sizeof saved, "cp %s/saved.log %s/ledger/2026-11-29.log && cp %s/saved.idx %s/ledger/2026-11-29.idx", ledger_data, ledger_data, ledger_data, ledger_data);
    CHECK(system(saved) == 0, "put the 29th back");
    S.ledger_days = 30;
    CHECK(unit_reopen_ledger(now, err) == 0 && LG.nseg == 4, "reopen with the day back: %s", err);
    g0 = group_find(unit_id('g', 0));
    CHECK(g0 && g0->s.al.spend == life_want, "the carried day is not counted twice: %lld", g0 ? (long long)g0->s.al.spend : -1LL);
    k0 = tkey_find(unit_id('k', 0));
    CHECK(k0 && k0->s.al.spend == klife_want, "nor a key's: %lld", k0 ? (long long)k0->s.al.spend : -1LL);
    /* A budget period longer than the retention is refused. */
    S.ledger_days = 5;
    g = (group *)group_new();
    g->s.name = xstrdup("x"), g->allowed = xcalloc(1, sizeof *g->allowed), g->s.al.has_budget = 1, g->s.al.max_budget = 1, g->s.al.budget_days = 7;
    CHECK(group_validate(&g->s, NULL, &e) < 0 && strcmp(e.pointer, "/budget_duration") == 0 && strstr(e.detail, "--ledger-days"), "7d over 5 days kept: %s", e.detail);
    g->s.al.budget_days = 1;
    CHECK(group_validate(&g->s, NULL, &e) == 0, "1d is fine");
    group_drop(g);
    S.ledger_days = 90, S.ledger_index = 16LL << 20;
    store_reset();
}

/* A ledger.log of an earlier version is split into days, once. */
static void test_ledger_migration(void) {
    char err[512], path[400], got[256];
    size_t total;
    unit_data_dir("ledger-migrate");
    snprintf(path, sizeof path, "%s/ledger.log", ledger_data);
    buf f = {0};
    buf_append(&f, LEDGER_V1_MAGIC, 8);
    for (int i = 0; i < 5; i++) {
        char p[512];
        int64_t at = UDAY + (i < 3 ? 1000 * i : DAY_MS + 1000 * i);
        snprintf(p, sizeof p, "{\"t\":%lld,\"c\":%d,\"e\":{\"n\":%d,\"token_key_id\":\"%s\",\"token_group_id\":\"%s\",\"model\":%s,\"requested_model\":\"R\","
                 "\"status\":\"%s\",\"cache_hit\":%s,\"input_tokens\":4,\"output_tokens\":2}%s}",
                 (long long)at, 10 * i, i, unit_id('k', i % 2), unit_id('g', 0), i == 1 ? "null" : "\"M\"", i == 2 ? "failed" : "succeeded",
                 i == 3 ? "true" : "false", i == 4 ? ",\"r\":{\"k\":\"00\"}" : "");
        log_frame(&f, p, strlen(p));
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0 && write(fd, f.p, f.len) == (ssize_t)f.len, "write ledger.log");
    close(fd);
    buf_free(&f);
    S.ledger_days = 90, S.now = 1000000;
    CHECK(unit_reopen_ledger(UDAY + 2 * DAY_MS, err) == 0 && access(path, F_OK) != 0, "migrated, ledger.log removed: %s", err);
    CHECK(LG.nseg == 2 && LG.seg[0]->state == SEG_SEALED && LG.seg[1]->state == SEG_SEALED, "into two sealed days");
    ledger_query q = unit_query(UDAY, 2);
    unit_page(&q, 0, 50, got, sizeof got, &total);
    CHECK(total == 5 && strcmp(got, "0,1,2,3,4") == 0, "every event kept: %s", got);
    usage_row by_day[2] = {{0}}, all = {0};
    model_usage *mu = NULL;
    int nmu = 0;
    ledger_usage(UDAY, 2, NULL, by_day, &all, &mu, &nmu);
    CHECK(all.requests == 5 && all.failed == 1 && all.cache_hits == 1 && all.spend == 100 && nmu == 2 && strcmp(mu[1].alias, "R") == 0,
          "their fields: the requested model where none served");
    free(mu);
    CHECK(unit_reopen_ledger(UDAY + 2 * DAY_MS, err) == 0 && LG.nseg == 2, "a second start migrates nothing");
    store_reset();
}

/* The largest values an event can carry are written as ltg can read them
 * back: a charge past MAX_CHARGE is recorded as MAX_CHARGE, every token
 * class at its most; a restart on that ledger starts (README "Cost"). */
static void test_ledger_extremes(void) {
    char err[512];
    unit_data_dir("ledger-extremes");
    S.ledger_days = 90, S.now = 1000000;
    CHECK(unit_reopen_ledger(UDAY + 1000, err) == 0, "an empty ledger: %s", err);
    char alias[256];
    memset(alias, 'm', 255), alias[255] = 0;
    rec_view v = {.charged = MAX_CHARGE * 5, .status = EV_ABANDONED, .flags = EVF_ESTIMATED | EVF_CACHE_HIT, .key = unit_id('k', 1),
                  .group = unit_id('g', 1), .model = alias, .model_len = 255, .event = "{}", .event_len = 2, .replay = ""};
    for (int k = 0; k < NTOK; k++) v.tok[k] = UINT32_MAX;
    int64_t day;
    uint64_t off;
    uint32_t len;
    CHECK(ledger_add(&v, UDAY + 2000, &day, &off, &len) == 0 && v.charged == MAX_CHARGE, "the most a charge may be, recorded");
    ledger_sync(NULL);
    CHECK(unit_reopen_ledger(UDAY + 3000, err) == 0 && LG.nseg == 1 && seg_count(LG.seg[0]) == 1, "the same day, started again: %s", err);
    CHECK(unit_reopen_ledger(UDAY + DAY_MS + 3000, err) == 0 && LG.seg[0]->state == SEG_SEALED, "sealed, with its index file: %s", err);
    usage_row by_day[1] = {{0}}, all = {0};
    model_usage *mu = NULL;
    int nmu = 0;
    ledger_usage(UDAY, 1, NULL, by_day, &all, &mu, &nmu);
    CHECK(all.requests == 1 && all.abandoned == 1 && all.spend == MAX_CHARGE && all.tok[TOK_REASONING] == UINT32_MAX, "read back whole");
    free(mu);
    store_reset();
}

/* A new log DIR/NAME in the unit directory (its path in path[400]). */
static void unit_fresh_log(logfile *l, const char *name, char *path) {
    snprintf(path, 400, "%s/%s", unit_dir, name);
    unlink(path);
    *l = (logfile){.fd = -1};
    log_init(l, unit_dir, name, LOG_MAGIC);
}

/* A log whose disk fails keeps its records and writes them when it can. */
static void test_log_failures(void) {
    char path[400];
    logfile l;
    unit_fresh_log(&l, "fail.log", path);
    const char *why;
    CHECK(log_append(&l, "one", 3, 1, &why) == 0 && file_size(path) == 8 + 11, "a synchronous append");
    int real = l.fd;
    l.fd = open("/dev/full", O_WRONLY);
    CHECK(l.fd >= 0, "/dev/full");
    CHECK(log_append(&l, "two", 3, 1, &why) < 0 && strstr(why, "No space") && l.pending.len == 0 && l.size == 19, "refused: %s", why);
    CHECK(log_append(&l, "three", 5, 0, &why) == 0 && log_append(&l, "four", 4, 0, &why) == 0, "batched appends wait");
    CHECK(log_sync(&l) < 0 && l.failing && l.pending.len == 8 + 5 + 8 + 4, "a failed write keeps them");
    close(l.fd);
    l.fd = real; /* space returns */
    CHECK(log_sync(&l) == 0 && !l.failing && l.pending.len == 0 && file_size(path) == 19 + 13 + 12 && l.durable == l.size, "written again");
    buf b = {0};
    read_file(path, &b);
    CHECK(b.len == 44 && memcmp(b.p + 19 + 8, "three", 5) == 0 && memcmp(b.p + 19 + 13 + 8, "four", 4) == 0, "nothing lost, nothing twice");
    buf_free(&b), buf_free(&l.pending);
    close(l.fd);
}

/* An fsync off the loop (Linux AIO): the records it covers go when it
 * ends, those written meanwhile stay; a failed one keeps every record for
 * a rewrite. */
static void test_log_async(void) {
    char path[400];
    logfile l;
    unit_fresh_log(&l, "async.log", path);
    const char *why;
    AIO.efd = eventfd(0, EFD_CLOEXEC);
    AIO.ctx = 0;
    if (AIO.efd < 0 || syscall(SYS_io_setup, AIO_MAX, &AIO.ctx) < 0) {
        printf("skip - test_log_async (no Linux AIO here: %s)\n", strerror(errno));
        skipped++;
        if (AIO.efd >= 0) close(AIO.efd);
        AIO.efd = -1;
        return;
    }
    CHECK(log_append(&l, "one", 3, 0, &why) == 0 && log_sync_start(&l) == 0, "started");
    CHECK(l.syncing == 11 && AIO.inflight == 1 && file_size(path) == 8 + 11, "written, fsync in flight: %zu", l.syncing);
    CHECK(log_append(&l, "two", 3, 0, &why) == 0 && log_sync_start(&l) == 0 && l.syncing == 11, "one fsync at a time: %zu %zu %zu", l.syncing, l.written, l.pending.len);
    uint64_t count;
    CHECK(read(AIO.efd, &count, sizeof count) == sizeof count && count == 1, "its end counted on the eventfd");
    aio_reap(0);
    CHECK(!l.syncing && !AIO.inflight && l.durable == 19 && l.pending.len == 11 && l.written == 0, "the first record let go, the second kept");
    CHECK(log_sync_start(&l) == 0 && log_sync(&l) == 0 && l.durable == 30 && !l.pending.len && !AIO.inflight, "log_sync waits for the one in flight");
    CHECK(log_append(&l, "three", 5, 0, &why) == 0 && log_sync_start(&l) == 0, "another");
    aio_reap(1);
    CHECK(log_append(&l, "four", 4, 0, &why) == 0 && log_write(&l) == 0 && l.written == 12, "written, not fsynced");
    l.syncing = l.written; /* as if an fsync of both had failed */
    AIO.inflight++;
    log_synced(&l, -EIO);
    CHECK(l.failing && l.written == 0 && l.pending.len == 12 && l.durable == 43, "a failed fsync keeps them: %s", l.why);
    CHECK(log_sync(&l) == 0 && !l.failing && file_size(path) == 43 + 12, "written again, once");
    buf_free(&l.pending);
    close(l.fd);
    syscall(SYS_io_destroy, AIO.ctx);
    close(AIO.efd);
    AIO.efd = -1;
}

/* Expired idempotency records leave the state log within the hour, even
 * when they are too few to pass the live state. */
static void test_compaction_on_time(void) {
    char err[512];
    snprintf(ledger_data, sizeof ledger_data, "%s", unit_dir);
    char path[400];
    snprintf(path, sizeof path, "%s/state.log", unit_dir);
    unlink(path);
    CHECK(reopen(err) == 0, "fresh: %s", err);
    for (int i = 0; i < 5000; i++) log_group("live", i);
    int64_t now = wall_ms();
    for (int i = 0; i < 50; i++) {
        idem *r = xcalloc(1, sizeof *r);
        r->key[0] = (uint8_t)i, r->key[1] = 7, r->done = 1, r->status = 200, r->response = xstrdup("{}"), r->expires = now + 1000;
        buf p = {0};
        jwriter w;
        jw_init(&w, &p);
        jw_open(&w, '{'), jw_key(&w, "ops"), jw_open(&w, '['), jw_close(&w, ']'), jw_key(&w, "idem"), idem_json(&w, r), jw_close(&w, '}');
        const char *why;
        CHECK(state_append(p.p, p.len, &why) == 0, "idem record");
        idem_put(r, p.len + 8);
        buf_free(&p);
    }
    LOG.last_compaction = now;
    CHECK(!compact_due(now + 2000), "nothing expired yet: not due");
    store_purge(now + 2000);
    CHECK(ST.expired == 50 && ST.iv.live == 0, "50 expired");
    CHECK(!compact_due(now + 2000 + COMPACT_EXPIRED_MS / 2), "within the hour: not yet (garbage %lld < live %zu)", (long long)LOG.f.size, ST.live_bytes);
    CHECK(compact_due(now + COMPACT_EXPIRED_MS), "after an hour: due");
    compact_start();
    while (LOG.compacting) compact_step(now + COMPACT_EXPIRED_MS);
    CHECK(ST.expired == 0 && reopen(err) == 0 && ST.iv.live == 0 && ST.expired == 0 && ST.gv.live == 5000, "compacted: no idempotency record left in the file");
    store_reset();
}

/* ---- an exchange against a fake upstream (the seam of ltg.h) ---- */

static upstream *fake_ups[8];
static int nfake;

static upstream *fake_open(provider *p, void *owner, upstream_event *event, const char *req, size_t n) {
    upstream *u = xcalloc(1, sizeof *u);
    u->fd = -1, u->p = p, u->owner = owner, u->event = event, u->state = UP_HEAD;
    timer_init(&u->t, up_notify, u);
    buf_append(&u->out, req, n);
    if (nfake < 8) fake_ups[nfake] = u;
    nfake++;
    return u;
}

/* The fake's answer: a status and a whole body, then the news. */
static void fake_answer(upstream *u, int status, const char *body) {
    buf_puts(&u->head, "HTTP/1.1\r\n\r\n"); /* up_has_head() */
    u->resp.status = status, u->state = UP_DONE, u->wrote = u->out.len;
    buf_puts(&u->body, body);
    u->event(u->owner);
}

static exchange *fake_exchange(catalog *cat, int max_attempts, long long deadline_ms) {
    exchange *x = xcalloc(1, sizeof *x);
    x->cat = cat, cat->refs++, S.nexchanges++;
    snprintf(x->rid, sizeof x->rid, "req_unit");
    x->kind = x->up = &WIRE[0]; /* chat completions */
    memcpy(x->group_id, unit_id('g', 9), 37), memcpy(x->key_id, unit_id('k', 9), 37);
    x->chain[0] = catalog_model(cat, "A", 1), x->chain[1] = catalog_model(cat, "B", 1), x->nchain = 2;
    buf_puts(&x->body, "{\"model\":\"A\"}");
    x->edit[x->nedit++] = (body_edit){9, 12, NULL};
    x->rp = (retry_policy){max_attempts, 100, BACKOFF_CONSTANT, 0, 0};
    x->deadline_ms = deadline_ms, x->plan = plan_start(2, max_attempts, BACKOFF_CONSTANT, 100), x->started = S.now;
    timer_init(&x->deadline, exchange_deadline, x), timer_init(&x->t, exchange_timer, x);
    timer_set(&x->deadline, deadline_ms);
    return x;
}

/* The last spend event's JSON. */
static void last_event(buf *out) {
    segment *s = LG.seg[LG.nseg - 1];
    seg_view v;
    buf rec = {0};
    rec_view rv;
    out->len = 0;
    if (view_open(&v, s, 0, NULL, UINT32_MAX) == 0 && view_record(&v, seg_count(s) - 1, &rec, &rv) == 0) buf_append(out, rv.event, rv.event_len);
    view_close(&v), buf_free(&rec);
}

/* Today's index past --ledger-index-mb: spilled in chunks, read in parts,
 * loaded at start-up; a torn chunk, an older format, a chunk that cannot
 * be written. Every answer is checked against the events as added. */
typedef struct { int key; int64_t at, charged; } unit_ev;
static unit_ev unit_evs[4000];
static int unit_nev;

static void chunk_event(int64_t at, int key, int64_t charged) {
    unit_evs[unit_nev++] = (unit_ev){key, at, charged};
    unit_event(at, key, key / 2, key % 3 ? "A" : "B", charged, EV_SUCCEEDED);
}

/* Every query of the day against the list (pass: a name for the messages). */
static void chunk_answers(const char *pass, int64_t now) {
    char got[65536], want[65536];
    size_t total;
    int n = unit_nev;
    ledger_query q = unit_query(UDAY, 1);
    unit_page(&q, 0, 5000, got, sizeof got, &total);
    want[0] = 0;
    for (int i = 0; i < n; i++) snprintf(want + strlen(want), sizeof want - strlen(want), "%s%d", i ? "," : "", i + unit_nevents - n);
    CHECK(total == (size_t)n && strcmp(got, want) == 0, "%s: every event, in order, across the chunks", pass);
    const segment *s = LG.seg[LG.nseg - 1];
    for (uint32_t c = 1; c < s->nchunk; c++) { /* pages across each boundary */
        unit_page(&q, s->chunk[c].first - 2, 4, got, sizeof got, &total);
        int f = (int)s->chunk[c].first - 2 + unit_nevents - n;
        snprintf(want, sizeof want, "%d,%d,%d,%d", f, f + 1, f + 2, f + 3);
        CHECK(strcmp(got, want) == 0, "%s: the page across chunk %u: %s", pass, c, got);
    }
    for (int key = 0; key < 6; key++) {
        int cnt = 0, third = -1;
        int64_t since = UDAY + (int64_t)key * 7000, after = 0, all = 0;
        for (int i = 0; i < n; i++)
            if (unit_evs[i].key == key) {
                if (cnt++ == 2) third = i;
                all += unit_evs[i].charged;
                if (unit_evs[i].at >= since) after += unit_evs[i].charged;
            }
        q = unit_query(UDAY, 1);
        q.key = unit_id('k', key);
        unit_page(&q, 2, 1, got, sizeof got, &total);
        snprintf(want, sizeof want, "%d", third + unit_nevents - n);
        CHECK(total == (size_t)cnt && strcmp(got, want) == 0, "%s: key %d: %zu events, the third %s", pass, key, total, got);
        q.group = unit_id('g', key / 2);
        unit_page(&q, 0, 0, got, sizeof got, &total);
        CHECK(total == (size_t)cnt, "%s: key %d in its group", pass, key);
        q.group = unit_id('g', (key / 2 + 1) % 3);
        unit_page(&q, 0, 0, got, sizeof got, &total);
        CHECK(total == 0, "%s: key %d in another group: none", pass, key);
        CHECK(seg_spent_since(LG.seg[LG.nseg - 1], 'k', unit_id('k', key), since) == after &&
              seg_spent_since(LG.seg[LG.nseg - 1], 'k', unit_id('k', key), 0) == all, "%s: key %d's spend since a time", pass, key);
    }
    q = unit_query(UDAY, 1); /* a snapshot inside the second chunk, of one group */
    q.group = unit_id('g', 1);
    q.snap_day = UDAY, q.snap_n = s->nchunk > 1 ? s->chunk[1].first + 7 : 7;
    int want_n = 0;
    for (uint32_t i = 0; i < q.snap_n && (int)i < n; i++) want_n += unit_evs[i].key / 2 == 1;
    unit_page(&q, 0, 0, got, sizeof got, &total);
    CHECK(total == (size_t)want_n, "%s: a snapshot mid-chunk: %zu of %d", pass, total, want_n);
    usage_row by_day[1] = {{0}}, sum = {0};
    model_usage *mu = NULL;
    int nmu = 0;
    int64_t spend = 0, spend_g2 = 0;
    for (int i = 0; i < n; i++) spend += unit_evs[i].charged, spend_g2 += unit_evs[i].key / 2 == 2 ? unit_evs[i].charged : 0;
    ledger_usage(UDAY, 1, NULL, by_day, &sum, &mu, &nmu);
    CHECK(sum.requests == n && sum.spend == spend && nmu == 2, "%s: usage of the day: %lld requests", pass, sum.requests);
    free(mu), mu = NULL, nmu = 0;
    memset(&sum, 0, sizeof sum), memset(by_day, 0, sizeof by_day);
    ledger_usage(UDAY, 1, unit_id('g', 2), by_day, &sum, &mu, &nmu);
    CHECK(sum.spend == spend_g2, "%s: usage of one group", pass);
    free(mu);
    budget_rebuild(now); /* the events were added without admission */
    group *g = group_find(unit_id('g', 2));
    CHECK(g && g->s.al.spend == spend_g2, "%s: a lifetime budget counts every chunk: %lld of %lld", pass, g ? (long long)g->s.al.spend : -1LL, (long long)spend_g2);
}

static void test_ledger_chunks(void) {
    char err[512], path[400];
    unit_data_dir("ledger-chunks");
    options_default();
    S.now = 1000000, S.ledger_index = 24 << 10;
    int64_t now = UDAY + DAY_MS / 2;
    CHECK(unit_reopen_ledger(now, err) == 0, "open: %s", err);
    unit_group(2, 0, UDAY - DAY_MS); /* a lifetime budget */
    unit_nev = 0;
    size_t most = 0;
    for (int i = 0; i < 1500; i++) {
        chunk_event(UDAY + 1000 + i * 20, i % 6, i % 7 + 1);
        if (LG.seg[0]->mem.bytes > most) most = LG.seg[0]->mem.bytes;
        if (i % 400 == 0) unit_tick(now);
    }
    segment *s = LG.seg[0];
    uint32_t nchunk = s->nchunk;
    CHECK(nchunk >= 4 && most <= (size_t)S.ledger_index && s->mem.n < 1500, "%u chunks; memory at most %zu bytes of %lld", nchunk, most, S.ledger_index);
    chunk_answers("live", now);
    unit_tick(now);
    CHECK(unit_reopen_ledger(now, err) == 0 && LG.nseg == 1 && LG.seg[0]->nchunk == nchunk && seg_count(LG.seg[0]) == 1500 && LG.seg[0]->mem.n < 1500,
          "start-up loads the chunks and replays the rest: %s", err);
    chunk_answers("restarted", now);

    /* A chunk a crash cut short: cut off, its events replayed from the log. */
    seg_path(UDAY, ".idx", LG.dir, path, sizeof path);
    struct stat st;
    CHECK(stat(path, &st) == 0 && truncate(path, st.st_size - 10) == 0, "cut the index file");
    CHECK(unit_reopen_ledger(now, err) == 0 && LG.seg[0]->nchunk >= nchunk - 1 && seg_count(LG.seg[0]) == 1500, "a torn chunk is cut off: %s", err);
    chunk_answers("torn", now);
    /* An index file of an older format: rebuilt. */
    int fd = open(path, O_WRONLY);
    CHECK(fd >= 0 && pwrite(fd, "LTGIDX3\n", 8, 0) == 8, "an older magic");
    close(fd);
    CHECK(unit_reopen_ledger(now, err) == 0 && LG.seg[0]->nchunk >= 4 && seg_count(LG.seg[0]) == 1500, "an older index file is rebuilt: %s", err);
    chunk_answers("rebuilt", now);

    /* A chunk that cannot be written: the events stay, new requests are refused until it is. */
    char moved[420];
    const char *why = NULL;
    snprintf(moved, sizeof moved, "%s.away", path);
    CHECK(rename(path, moved) == 0 && mkdir(path, 0700) == 0, "a directory where the index file was");
    uint32_t before = LG.seg[0]->nchunk;
    for (int i = 0; i < 1000 && ledger_writable(&why); i++) chunk_event(UDAY + 40000 + i * 20, i % 6, 2);
    CHECK(!ledger_writable(&why) && strstr(why, "index") && LG.seg[0]->nchunk == before, "a full index that cannot be spilled refuses: %s", why ? why : "");
    CHECK(rmdir(path) == 0 && rename(moved, path) == 0, "the file back");
    S.now += IDX_RETRY_MS + 1;
    ledger_tick(now);
    CHECK(ledger_writable(&why) && LG.seg[0]->nchunk == before + 1, "written at the next try");
    chunk_answers("after the failure", now);

    /* The day ends: its last chunk written, sealed, and read the same. */
    unit_tick(UDAY + DAY_MS + 10);
    CHECK(LG.seg[0]->state == SEG_SEALED && LG.seg[0]->mem.n == 0 && seg_count(LG.seg[0]) == (uint32_t)unit_nev, "sealed");
    now = UDAY + DAY_MS + 10;
    chunk_answers("sealed", now);
    CHECK(unit_reopen_ledger(now, err) == 0 && LG.seg[0]->state == SEG_SEALED, "a sealed day of chunks opens as it is: %s", err);
    chunk_answers("sealed, restarted", now);
    S.ledger_index = 16LL << 20;
    store_reset();
}

static void test_exchange_fake(void) {
    char err[512];
    unit_data_dir("exchange");
    S.now = 5000000;
    S.meter_s = 0; /* an answer given up on is closed at once: metering is tested on the wire (integration_cost.py) */
    CHECK(unit_reopen_ledger(wall_ms(), err) == 0, "ledger: %s", err);
    catalog *cat = load("{\"providers\":{\"p\":{\"base_url\":\"http://127.0.0.1:1/v1\"}},\"models\":{"
                        "\"A\":{\"provider\":\"p\",\"upstream_model\":\"a\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},"
                        "\"B\":{\"provider\":\"p\",\"upstream_model\":\"b\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", err);
    CHECK(cat != NULL, "catalog: %s", err);
    if (!cat) return;
    S.cat = cat, S.up_open = fake_open;
    buf ev = {0};
    /* 503 on A (indeterminate): the next model at once; B answers. */
    nfake = 0;
    exchange *x = fake_exchange(cat, 2, 10000);
    exchange_start(x);
    CHECK(nfake == 1 && strstr(fake_ups[0]->out.p, "\"model\":\"a\""), "the first attempt goes to A, renamed");
    fake_answer(fake_ups[0], 503, "{\"error\":{}}");
    CHECK(nfake == 2 && strstr(fake_ups[1]->out.p, "\"model\":\"b\"") && x->state == X_ATTEMPTING, "503 is indeterminate: B at once");
    fake_answer(fake_ups[1], 200, "{\"choices\":[{}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}");
    last_event(&ev);
    CHECK(strstr(ev.p, "\"attempts\":2") && strstr(ev.p, "\"outcome\":\"indeterminate\"") && strstr(ev.p, "\"model\":\"B\",\"deployment\":\"p/b\",\"attempt\":1,\"status\":200,\"outcome\":\"ok\"") &&
          strstr(ev.p, "\"status\":\"succeeded\""), "the event: %s", ev.p);
    CHECK(cat->models[0].dep[0].inflight == 0 && cat->models[1].dep[0].inflight == 0, "nothing left in flight on either deployment (%d, %d)",
          cat->models[0].dep[0].inflight, cat->models[1].dep[0].inflight);
    /* 429 (no work): the same model after the backoff, on the timer. */
    nfake = 0;
    x = fake_exchange(cat, 2, 10000);
    exchange_start(x);
    fake_answer(fake_ups[0], 429, "{}");
    CHECK(nfake == 1 && x->state == X_BACKOFF && x->t.slot >= 0, "429: waiting the backoff");
    S.now += 200;
    timers_run();
    CHECK(nfake == 2 && x->state == X_ATTEMPTING && strstr(fake_ups[1]->out.p, "\"model\":\"a\""), "then A again");
    fake_answer(fake_ups[1], 400, "{\"error\":{\"message\":\"bad\"}}");
    last_event(&ev);
    CHECK(strstr(ev.p, "\"outcome\":\"no_work\"") && strstr(ev.p, "\"outcome\":\"terminal\"") && strstr(ev.p, "\"status\":\"failed\"") &&
          strstr(ev.p, "\"http_status\":400"), "429 then a terminal 400: %s", ev.p);
    /* A provider that never answers: cut at the deadline, nothing after it. */
    nfake = 0;
    x = fake_exchange(cat, 1, 3000);
    exchange_start(x);
    fake_ups[0]->wrote = fake_ups[0]->out.len;
    S.now += 3000;
    timers_run();
    last_event(&ev);
    CHECK(nfake == 1 && strstr(ev.p, "\"http_status\":504") && strstr(ev.p, "no answer within the deadline"), "the deadline: %s", ev.p);
    /* A 200 that is not JSON: indeterminate, not a success. */
    nfake = 0;
    x = fake_exchange(cat, 1, 10000);
    exchange_start(x);
    fake_answer(fake_ups[0], 200, "<html>");
    CHECK(nfake == 2, "a 200 that is not JSON moves to B");
    fake_answer(fake_ups[1], 502, "{}");
    last_event(&ev);
    CHECK(strstr(ev.p, "not JSON") && strstr(ev.p, "\"http_status\":502"), "then every attempt failed: %s", ev.p);
    CHECK(S.nexchanges == 0, "every exchange freed");
    buf_free(&ev);
    S.up_open = NULL, S.cat = NULL;
    catalog_free(cat);
    store_reset();
}

/* ---- the attempt plan ---- */

static void test_plan(void) {
    /* The plan, row by row: the README's "Retries and fallback" table and what the deadline, the
     * other deployments, Retry-After and a refused key add to it. Each row starts from a plan at
     * (model, attempt) of a chain of `models`, max 3 attempts, a constant backoff of 100 ms; the facts
     * are {outcome, key refused, another deployment free, Retry-After, jitter, now, deadline}. */
#define OK OUTCOME_OK
#define NW OUTCOME_NO_WORK
#define IND OUTCOME_INDETERMINATE
#define TERM OUTCOME_TERMINAL
#define UNK OUTCOME_UNKNOWN_MODEL
#define OPEN OUTCOME_CIRCUIT_OPEN
    static const struct {
        const char *what;
        int models, model, attempt;
        plan_facts f;
        plan_action want;
        int model_after, attempt_after;
        long delay;
        int next_key, late;
    } steps[] = {
        {"ok answers", 2, 0, 1, {OK, 0, 0, -1, 0, 0, 1000}, PLAN_ANSWER, 0, 1, 0, 0, 0},
        {"terminal answers, no other attempt", 2, 0, 1, {TERM, 0, 0, -1, 0, 0, 1000}, PLAN_ANSWER, 0, 1, 0, 0, 0},
        {"an answer past the deadline is still the answer", 2, 0, 1, {OK, 0, 0, -1, 0, 2000, 1000}, PLAN_ANSWER, 0, 1, 0, 0, 0},
        {"no_work: the same model after the backoff", 2, 0, 1, {NW, 0, 0, -1, 0, 0, 1000}, PLAN_RETRY_AFTER, 0, 2, 100, 0, 0},
        {"no_work: Retry-After replaces the backoff", 2, 0, 1, {NW, 0, 0, 300, 0, 0, 1000}, PLAN_RETRY_AFTER, 0, 2, 300, 0, 0},
        {"no_work with another deployment free: at once", 2, 0, 2, {NW, 0, 1, -1, 0, 0, 1000}, PLAN_RETRY_NOW, 0, 3, 0, 0, 0},
        {"no_work, attempts spent: the next model", 2, 0, 3, {NW, 0, 1, -1, 0, 0, 1000}, PLAN_NEXT_MODEL, 1, 1, 0, 0, 0},
        {"the fallback gets its own attempts", 2, 1, 1, {NW, 0, 0, -1, 0, 0, 1000}, PLAN_RETRY_AFTER, 1, 2, 100, 0, 0},
        {"no_work, attempts spent on the last model: give up", 2, 1, 3, {NW, 0, 0, -1, 0, 0, 1000}, PLAN_GIVE_UP, 1, 3, 0, 0, 0},
        {"no_work whose wait ends past the deadline: the next model", 2, 0, 1, {NW, 0, 0, -1, 0, 950, 1000}, PLAN_NEXT_MODEL, 1, 1, 0, 0, 0},
        {"... on the last model: give up, late", 2, 1, 1, {NW, 0, 0, 200, 0, 950, 1000}, PLAN_GIVE_UP, 1, 2, 200, 0, 1},
        {"indeterminate: never the same model again", 2, 0, 1, {IND, 0, 1, -1, 0, 0, 1000}, PLAN_NEXT_MODEL, 1, 1, 0, 0, 0},
        {"indeterminate on the last model: give up", 2, 1, 1, {IND, 0, 0, -1, 0, 0, 1000}, PLAN_GIVE_UP, 1, 1, 0, 0, 0},
        {"unknown_model: the next model", 3, 0, 1, {UNK, 0, 1, -1, 0, 0, 1000}, PLAN_NEXT_MODEL, 1, 1, 0, 0, 0},
        {"circuit_open: the next model", 3, 1, 1, {OPEN, 0, 0, -1, 0, 0, 1000}, PLAN_NEXT_MODEL, 2, 1, 0, 0, 0},
        {"a failure at the deadline: give up, late", 2, 0, 1, {IND, 0, 0, -1, 0, 1000, 1000}, PLAN_GIVE_UP, 0, 1, 0, 0, 1},
        {"a refused key with another: the same attempt, the next key", 2, 0, 1, {TERM, 1, 0, -1, 0, 0, 1000}, PLAN_RETRY_NOW, 0, 1, 0, 1, 0},
        {"... but an answer first: terminal answers when no key is left", 2, 0, 1, {TERM, 0, 0, -1, 0, 0, 1000}, PLAN_ANSWER, 0, 1, 0, 0, 0},
        {"a refused key at the deadline: give up, late", 2, 0, 1, {TERM, 1, 0, -1, 0, 1000, 1000}, PLAN_GIVE_UP, 0, 1, 0, 0, 1},
    };
#undef OK
#undef NW
#undef IND
#undef TERM
#undef UNK
#undef OPEN
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++) {
        attempt_plan p = plan_start(steps[i].models, 3, BACKOFF_CONSTANT, 100);
        p.model = steps[i].model, p.attempt = steps[i].attempt;
        plan_step st = plan_next(&p, &steps[i].f);
        CHECK(st.action == steps[i].want && p.model == steps[i].model_after && p.attempt == steps[i].attempt_after &&
                  (st.action != PLAN_RETRY_AFTER || st.delay_ms == steps[i].delay) && st.next_key == steps[i].next_key &&
                  st.late == steps[i].late,
              "plan: %s: action %d at (%d, %d), delay %ld, next_key %d, late %d", steps[i].what, st.action, p.model, p.attempt,
              st.delay_ms, st.next_key, st.late);
    }
    attempt_plan pe = plan_start(1, 5, BACKOFF_EXPONENTIAL, 250);
    pe.attempt = 3;
    plan_facts fe = {.outcome = OUTCOME_NO_WORK, .retry_after_ms = -1, .jitter_permille = 200, .deadline = 100000};
    plan_step se = plan_next(&pe, &fe);
    CHECK(se.action == PLAN_RETRY_AFTER && se.delay_ms == 1200 && pe.attempt == 4, "plan: the group's backoff for attempt 4, "
          "jitter included: %d, %ld", se.action, se.delay_ms);
    /* Classification of statuses and of failures without one. */
    static const struct { int status, reached; attempt_outcome want; } rows[] = {
        {200, 1, OUTCOME_OK}, {201, 1, OUTCOME_OK}, {429, 1, OUTCOME_NO_WORK}, {529, 1, OUTCOME_NO_WORK},
        {408, 1, OUTCOME_INDETERMINATE}, {500, 1, OUTCOME_INDETERMINATE}, {502, 1, OUTCOME_INDETERMINATE},
        {503, 1, OUTCOME_INDETERMINATE}, {504, 1, OUTCOME_INDETERMINATE}, {404, 1, OUTCOME_UNKNOWN_MODEL},
        {400, 1, OUTCOME_TERMINAL}, {401, 1, OUTCOME_TERMINAL}, {403, 1, OUTCOME_TERMINAL}, {413, 1, OUTCOME_TERMINAL},
        {422, 1, OUTCOME_TERMINAL}, {409, 1, OUTCOME_TERMINAL}, {0, 0, OUTCOME_NO_WORK}, {0, 1, OUTCOME_INDETERMINATE},
    };
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++)
        CHECK(attempt_classify(rows[i].status, rows[i].reached) == rows[i].want, "classify %d/%d", rows[i].status, rows[i].reached);
    const char *ctx1 = "{\"error\":{\"message\":\"x\",\"code\":\"context_length_exceeded\"}}";
    const char *ctx2 = "{\"error\":{\"message\":\"This model's maximum context length is 8192 tokens.\"}}";
    const char *other = "{\"error\":{\"message\":\"bad temperature\"}}";
    CHECK(attempt_context_length(400, ctx1, strlen(ctx1)) && attempt_context_length(413, ctx2, strlen(ctx2)), "context length found");
    CHECK(!attempt_context_length(400, other, strlen(other)) && !attempt_context_length(500, ctx1, strlen(ctx1)), "not context length");
    CHECK(strcmp(outcome_name(OUTCOME_NO_WORK), "no_work") == 0 && strcmp(outcome_name(OUTCOME_CIRCUIT_OPEN), "circuit_open") == 0, "names");

    /* Backoff: x1, x(n-1), x2^(n-2); jitter only lengthens, up to 20 percent; capped at 10 s. */
    CHECK(backoff_ms(BACKOFF_CONSTANT, 250, 4, 0) == 250, "constant");
    CHECK(backoff_ms(BACKOFF_LINEAR, 250, 2, 0) == 250 && backoff_ms(BACKOFF_LINEAR, 250, 4, 0) == 750, "linear");
    CHECK(backoff_ms(BACKOFF_EXPONENTIAL, 250, 2, 0) == 250 && backoff_ms(BACKOFF_EXPONENTIAL, 250, 5, 0) == 2000, "exponential");
    CHECK(backoff_ms(BACKOFF_CONSTANT, 1000, 2, 200) == 1200 && backoff_ms(BACKOFF_CONSTANT, 1000, 2, 999) == 1200, "jitter at most 20 percent");
    CHECK(backoff_ms(BACKOFF_EXPONENTIAL, 60000, 5, 100) == 10000, "capped at 10 s");
    CHECK(backoff_ms(BACKOFF_EXPONENTIAL, 0, 5, 100) == 0, "zero delay");

    /* Retry-After: seconds or an HTTP date. */
    CHECK(retry_after_ms("2", 1, 0) == 2000 && retry_after_ms("0", 1, 0) == 0, "delta seconds");
    const char *date = "Sun, 06 Nov 1994 08:49:37 GMT";
    CHECK(retry_after_ms(date, strlen(date), 784111777 - 3) == 3000, "http date");
    CHECK(retry_after_ms(date, strlen(date), 784111777 + 60) == 0, "a date in the past");
    CHECK(retry_after_ms("soon", 4, 0) == -1 && retry_after_ms("-1", 2, 0) == -1, "garbage");

    /* The circuit breaker: 5 failures open it, 5 s later one probe goes through. */
    model mm = {.alias = "M"};
    deployment m = {.m = &mm, .name = "p/m"};
    int probe;
    for (int i = 0; i < 4; i++) breaker_record(&m, OUTCOME_INDETERMINATE, 0, 1000);
    CHECK(breaker_allows(&m, 1000, &probe) && !probe, "4 failures: closed");
    breaker_record(&m, OUTCOME_OK, 0, 1000);
    for (int i = 0; i < 4; i++) breaker_record(&m, OUTCOME_NO_WORK, 0, 1000);
    CHECK(breaker_allows(&m, 1000, &probe), "a success resets the count");
    breaker_record(&m, OUTCOME_NO_WORK, 0, 1000);
    CHECK(!breaker_allows(&m, 1000, &probe) && !breaker_allows(&m, 5999, &probe), "5 failures: open for 5 s");
    CHECK(breaker_allows(&m, 6000, &probe) && probe, "then one probe");
    int probe2;
    CHECK(!breaker_allows(&m, 6001, &probe2), "only one probe at a time");
    breaker_record(&m, OUTCOME_INDETERMINATE, 1, 6100);
    CHECK(!breaker_allows(&m, 6200, &probe2) && breaker_allows(&m, 11100, &probe2) && probe2, "a failed probe opens it again");
    breaker_record(&m, OUTCOME_OK, 1, 11200);
    CHECK(breaker_allows(&m, 11200, &probe) && !probe && !m.cb_open_until, "a good probe closes it");
    for (int i = 0; i < 5; i++) breaker_record(&m, OUTCOME_TERMINAL, 0, 12000);
    CHECK(breaker_allows(&m, 12000, &probe), "terminal answers are not failures of the provider");
    for (int i = 0; i < 5; i++) breaker_record(&m, OUTCOME_INDETERMINATE, 0, 13000);
    CHECK(breaker_allows(&m, 18000, &probe) && probe, "probe");
    breaker_forget_probe(&m);
    CHECK(breaker_allows(&m, 18001, &probe) && probe, "a probe whose client left is taken over by the next request");

    /* Deployments: weighted, the fewest in flight first, open breakers skipped. */
    deployment ds[2] = {{.weight = 3}, {.weight = 1}};
    model dm = {.alias = "D", .dep = ds, .ndep = 2};
    int got[2] = {0}, streak = 0, longest = 0, last = -1;
    for (int i = 0; i < 400; i++) {
        int k = deployment_pick(&dm, 0, 0);
        got[k]++, streak = k == last ? streak + 1 : 1, last = k;
        if (streak > longest) longest = streak;
    }
    CHECK(got[0] == 300 && got[1] == 100 && longest <= 3, "weights 3:1 in sequence: %d:%d, longest run %d", got[0], got[1], longest);
    ds[0].inflight = 4, ds[1].inflight = 1;
    CHECK(deployment_pick(&dm, 0, 0) == 1, "4 in flight on weight 3 is busier than 1 on weight 1");
    ds[0].inflight = 2;
    CHECK(deployment_pick(&dm, 0, 0) == 0, "2 in flight on weight 3 is less busy than 1 on weight 1");
    ds[0].inflight = ds[1].inflight = 0;
    CHECK(deployment_pick(&dm, 1, 0) == 1 && deployment_pick(&dm, 1, 0) == 1, "a deployment that answered no_work is avoided");
    CHECK(deployment_other(&dm, 1, 0) && !deployment_other(&dm, 3, 0), "another deployment: there is one / none");
    int k = deployment_pick(&dm, 3, 0);
    CHECK(k == 0 || k == 1, "every deployment avoided: any of them (%d)", k);
    ds[1].cb_open_until = 5000;
    for (int i = 0; i < 5; i++) CHECK(deployment_pick(&dm, 1, 1000) == 0, "an open breaker is skipped, even for one avoided");
    ds[0].cb_open_until = 5000;
    CHECK(deployment_pick(&dm, 0, 1000) == -1 && !deployment_other(&dm, 0, 1000), "every breaker open: none");
    CHECK(deployment_pick(&dm, 0, 5000) >= 0, "half-open: a probe may go");
}

/* ---- the ledger, budgets, cache ---- */

static void test_ledger_pieces(void) {
    int64_t ms;
    CHECK(parse_day("2026-11-29", &ms) == 0 && ms == 1795910400000LL, "a day");
    CHECK(parse_day("2024-02-29", &ms) == 0, "a leap day");
    static const char *bad[] = {"2026-02-29", "2026-13-01", "2026-1-01", "20261129", "2026-11-29x", "2026-11-2", "", "2026/11/29"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) CHECK(parse_day(bad[i], &ms) < 0, "bad day %s", bad[i]);

    /* Budget periods: anchored, rolling over by themselves; a new period starts empty. */
    group g = {0};
    g.s.al.has_budget = 1, g.s.al.max_budget = 1, g.s.al.budget_days = 1, g.s.al.budget_anchor = 1000;
    int64_t start, end;
    allow_period(&g.s.al, 1000 + 5 * 86400000LL + 7, &start, &end);
    CHECK(start == 1000 + 5 * 86400000LL && end == start + 86400000LL, "the sixth daily period");
    budget_refresh(&g.s.al, 2000);
    g.s.al.spend = 500;
    budget_refresh(&g.s.al, 1000 + 86400000LL - 1);
    CHECK(g.s.al.spend == 500, "same period: spend kept");
    budget_refresh(&g.s.al, 1000 + 86400000LL);
    CHECK(g.s.al.spend == 0 && g.s.al.period_start == 1000 + 86400000LL, "rolled over at the anchor's hour, not at midnight");
    g.s.al.budget_days = 0;
    allow_period(&g.s.al, 99 * 86400000LL, &start, &end);
    CHECK(start == 1000 && end == 0, "a lifetime budget never resets");
    g.s.al.has_budget = 0;
    allow_period(&g.s.al, 5000, &start, &end);
    CHECK(start == 0 && end == 0, "no budget, no period");

    /* A calendar month (1mo), UTC: the first period starts at the anchor, the next ones on the 1st. */
    allowance mo = {.has_budget = 1, .max_budget = 1, .budget_days = BUDGET_MONTH, .budget_anchor = UDAY + 3600000}; /* 2026-11-29T01:00Z */
    const int64_t DEC1 = UDAY + 2 * DAY_MS, JAN1 = DEC1 + 31 * DAY_MS, FEB1 = JAN1 + 31 * DAY_MS, MAR1 = FEB1 + 28 * DAY_MS;
    allow_period(&mo, DEC1 - 1, &start, &end);
    CHECK(start == mo.budget_anchor && end == DEC1, "the first month: from the anchor to December 1st");
    budget_refresh(&mo, DEC1 - 1), mo.spend = 700;
    budget_refresh(&mo, DEC1 - 1);
    CHECK(mo.spend == 700 && allow_days(&mo) == 31, "the same month: spend kept");
    budget_refresh(&mo, DEC1);
    allow_period(&mo, DEC1, &start, &end);
    CHECK(mo.spend == 0 && mo.period_start == DEC1 && mo.period_end == JAN1 && start == DEC1 && end == JAN1, "rolled over at 00:00 UTC on the 1st");
    mo.spend = 5, mo.budget_days = 7; /* a period's end is known until a change says otherwise (budget_follow) */
    budget_refresh(&mo, DEC1 + DAY_MS);
    CHECK(mo.spend == 5 && mo.period_end == JAN1, "within the known period nothing is recomputed");
    mo.budget_days = BUDGET_MONTH;
    allow_period(&mo, JAN1 + 5, &start, &end);
    CHECK(start == JAN1 && end == FEB1, "over the year's end: January 2027");
    allow_period(&mo, FEB1 + 27 * DAY_MS, &start, &end);
    CHECK(start == FEB1 && end == MAR1, "February: 28 days");
    CHECK(month_start(1832976000000LL, 0) == 1832976000000LL && month_start(1832976000000LL, 1) - 1832976000000LL == 29 * DAY_MS,
          "February 2028: 29 days");
    allow_period(&mo, mo.budget_anchor - 1000, &start, &end);
    CHECK(start == mo.budget_anchor && end == DEC1, "a clock before the anchor: the first period");

    /* The reservation path: every allowance or none; settled with what was used. */
    allowance ka = {.has_budget = 1, .max_budget = 0.0001, .budget_days = 1, .budget_anchor = 1, .rpm_limit = UNSET, .tpm_limit = 50},
              ga = {.has_budget = 0, .rpm_limit = 2, .tpm_limit = UNSET};
    allowance *both[2] = {&ka, &ga};
    hold h1 = {0}, h2 = {0}, h3 = {0}; /* a request's hold starts empty: hold_reserve adds to it */
    hold_refusal hwhy;
    int64_t hnow0 = S.now;
    S.now = 5000000;
    CHECK(hold_reserve(both, 2, 60, 20, 10000, &h1, &hwhy) == 0 && ka.reserved == 60 && ga.reserved == 60 && h1.sec == 5000, "held in both");
    CHECK(hold_reserve(both, 2, 60, 20, 10000, &h2, &hwhy) < 0 && hwhy.who == 0 && strcmp(hwhy.limit, "max_budget") == 0 && ka.reserved == 60 &&
          ga.reserved == 60 && rl_used(ga.rl, 5000, 0) == 1, "the key's budget refuses: nothing held anywhere, not even the group's request");
    CHECK(hold_reserve(both, 2, 10, 40, 10000, &h2, &hwhy) < 0 && hwhy.who == 0 && strcmp(hwhy.limit, "tpm_limit") == 0 && hwhy.wait > 0,
          "the key's tpm_limit refuses first");
    CHECK(hold_reserve(both, 2, 10, 20, 10000, &h2, &hwhy) == 0 && hold_reserve(both, 2, 1, 1, 10000, &h3, &hwhy) < 0 && hwhy.who == 1 &&
          strcmp(hwhy.limit, "rpm_limit") == 0, "the group's rpm_limit: 2, the third refused");
    hold h4 = h1;
    CHECK(hold_reserve(both, 2, 0, 5, 10000, &h4, &hwhy) == 0 && h4.cost == 60 && h4.tok == 25 && rl_used(ga.rl, 5000, 0) == 2,
          "a later attempt adds its worst case, and is not another request (rpm_limit 2 is full, yet it fits)");
    CHECK(hold_reserve(both, 2, 0, 30, 10000, &h4, &hwhy) < 0 && strcmp(hwhy.limit, "tpm_limit") == 0 && h4.tok == 25,
          "a later attempt past the tpm_limit: refused, the hold as it was");
    h1 = h4;
    hold_settle(both, 2, &h1, 25, 5, 10000, NULL);
    CHECK(ka.reserved == 10 && ka.spend == 25 && ga.reserved == 10 && ga.spend == 25 && rl_used(ka.rl, 5000, 1) == 25 && h1.sec == 0,
          "settled: the real cost and tokens replace the worst case");
    hold_settle((allowance *[]){NULL, &ga}, 2, &h2, 0, 0, 10000, NULL);
    CHECK(ga.reserved == 0 && ka.reserved == 10, "an allowance gone (its key deleted) is skipped");
    free(ka.rl), free(ga.rl);
    S.now = hnow0;

    /* The worst case: input tokens at the dearest input class, the output limit times the answers. */
    model a = {.alias = "a", .price = {{1000000, 1000000, 1000000, 1000000, 2000000}}, .max_output_tokens = 100, .context_window = 1000,
               .max_input_part_tokens = 50};
    model b = {.alias = "b", .price = {{3000000, 300000, 3750000, 6000000, 15000000}}, .max_output_tokens = 4096, .context_window = 200000,
               .max_input_part_tokens = 2000, .long_above = 1000, .long_price = {{6000000, 600000, 7500000, 12000000, 22500000}}};
    worst_shape sh = {100, 0, 0, 50, 1};
    CHECK(worst_case(&sh, &a).cost == 100 * 1 + 50 * 2 && worst_case(&sh, &a).in == 100 && worst_case(&sh, &a).out == 50, "max_tokens");
    sh.out = 0;
    CHECK(worst_case(&sh, &a).cost == 100 * 1 + 100 * 2, "the model's default output");
    sh.n = 4;
    CHECK(worst_case(&sh, &a).cost == 100 * 1 + 400 * 2, "n = 4: four answers");
    sh = (worst_shape){100, -1, 2, 10, 1};
    CHECK(worst_case(&sh, &a).in == 100 + 1000 + 2 * 50, "a previous response unknown: the context window; two image parts");
    sh = (worst_shape){100, 0, 0, 10, 1};
    CHECK(worst_case(&sh, &b).cost == 100 * 6 + 10 * 15 && worst_case(&sh, &b).in_cost == 600, "Anthropic's dearest input: a 1-hour cache write");
    sh.prompt = 2000;
    CHECK(worst_case(&sh, &b).cost == 2000 * 12 + (10 * 225 + 9) / 10, "past long_above: the long-context tier");
    sh = (worst_shape){1, 0, 0, 1000000000000LL, 128};
    CHECK(worst_case(&sh, &b).cost == MAX_CHARGE + 1, "past a million USD: flagged");

    /* Costs: exact, every class priced (the issue's table, to the micro-USD). */
    long long t1[NTOK] = {[TOK_IN] = 50012, [TOK_CACHE_READ] = 48000, [TOK_CACHE_WRITE] = 2000, [TOK_OUT] = 100};
    model sonnet = {.price = {{3000000, 300000, 3750000, 6000000, 15000000}}};
    CHECK(tokens_cost(&sonnet, t1) == 23436, "Anthropic: 12 + 48,000 read + 2,000 written, 100 out: %lld", (long long)tokens_cost(&sonnet, t1));
    long long t2[NTOK] = {[TOK_IN] = 50000, [TOK_CACHE_READ] = 48000, [TOK_OUT] = 100};
    model gpt = {.price = {{2000000, 500000, 2000000, 2000000, 8000000}}};
    CHECK(tokens_cost(&gpt, t2) == 28800, "OpenAI: 50,000 of which 48,000 cached, 100 out");
    long long t3[NTOK] = {[TOK_IN] = 3000, [TOK_CACHE_WRITE] = 3000, [TOK_CACHE_WRITE_1H] = 1000, [TOK_OUT] = 0};
    CHECK(tokens_cost(&sonnet, t3) == 2000 * 3.75 + 1000 * 6, "5-minute and 1-hour writes apart");

    /* Usage from an answer or an event: every token class. */
    usage_counts uc = {0};
    long long tk[NTOK];
    int no_choices;
#define UREAD(k, in, s) (uc = (usage_counts){0}, usage_read(k, in, s, strlen(s), &uc, &no_choices))
    const char *ans = "{\"id\":\"x\",\"choices\":[{}],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":5,\"total_tokens\":17}}";
    CHECK(UREAD(&WIRE[0], NULL, ans) == 1 && uc.raw[TOK_IN] == 12 && uc.raw[TOK_OUT] == 5 && !no_choices && uc.seen, "usage");
    const char *full = "{\"usage\":{\"prompt_tokens\":50000,\"completion_tokens\":100,\"total_tokens\":50100,\"prompt_tokens_details\":"
                       "{\"cached_tokens\":48000,\"audio_tokens\":0},\"completion_tokens_details\":{\"reasoning_tokens\":64,\"audio_tokens\":0}}}";
    CHECK(UREAD(&WIRE[0], NULL, full) == 1 && usage_classes(&WIRE[0], &uc, tk) == 0 && tk[TOK_IN] == 50000 && tk[TOK_CACHE_READ] == 48000 &&
          tk[TOK_OUT] == 100 && tk[TOK_REASONING] == 64, "OpenAI's details: cached and reasoning tokens");
    const char *none = "{\"usage\":null}";
    CHECK(UREAD(&WIRE[0], NULL, none) == 0 && no_choices && !uc.seen, "null usage");
    const char *chunk = "{\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}";
    CHECK(UREAD(&WIRE[0], NULL, chunk) == 1 && no_choices && uc.raw[TOK_OUT] == 2, "a usage-only chunk");
    CHECK(UREAD(&WIRE[0], NULL, "<html>") == LTG_ERR, "not JSON");
    CHECK(UREAD(&WIRE[0], NULL, "{\"usage\":{}") == LTG_ERR, "cut JSON");
    static const char *const hostile[] = {"{\"usage\":{\"prompt_tokens\":-5,\"completion_tokens\":1}}", "{\"usage\":{\"prompt_tokens\":12.5}}",
                                      "{\"usage\":{\"prompt_tokens\":\"12\"}}", "{\"usage\":{\"prompt_tokens\":1000000000000000}}",
                                      "{\"usage\":{\"prompt_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":11}}}",
                                      "{\"usage\":{\"prompt_tokens\":5,\"prompt_tokens_details\":{\"cached_tokens\":-1}}}"};
    for (size_t i = 0; i < sizeof hostile / sizeof *hostile; i++)
        CHECK(UREAD(&WIRE[0], NULL, hostile[i]) == 1 && uc.seen && usage_classes(&WIRE[0], &uc, tk) < 0, "a usage that cannot be true: %s", hostile[i]);
    const char *apart = "{\"usage\":{\"completion_tokens\":10,\"completion_tokens_details\":{\"reasoning_tokens\":11}}}";
    CHECK(UREAD(&WIRE[0], NULL, apart) == 1 && usage_classes(&WIRE[0], &uc, tk) == 0 && tk[TOK_OUT] == 21 && tk[TOK_REASONING] == 11,
          "reasoning counted apart from the output (more than it): billed as output all the same");
    /* A thousand embeddings, then the usage: the answer's size does not matter. */
    buf big = {0};
    buf_puts(&big, "{\"data\":[");
    for (int i = 0; i < 1000; i++) buf_printf(&big, "%s{\"embedding\":[0.1,0.2],\"index\":%d}", i ? "," : "", i);
    buf_puts(&big, "],\"usage\":{\"prompt_tokens\":7,\"total_tokens\":7}}");
    CHECK(UREAD(&WIRE[0], NULL, big.p) == 1 && uc.raw[TOK_IN] == 7 && uc.raw[TOK_OUT] == 0, "usage after 1000 embeddings");
    big.len = 0;
    buf_puts(&big, "{");
    for (int i = 0; i < 200; i++) buf_printf(&big, "\"k%d\":%d,", i, i);
    buf_puts(&big, "\"z\":0}");
    CHECK(UREAD(&WIRE[0], NULL, big.p) == 0, "200 members: still JSON, no usage looked for");
    buf_free(&big);
    /* The Responses API: its own member names; in a stream, the usage inside "response". */
    const wire_kind *resp = &WIRE[3];
    CHECK(strcmp(resp->path, "/v1/responses") == 0, "WIRE[3] is the Responses API");
    const char *rbody = "{\"id\":\"resp_1\",\"output\":[],\"usage\":{\"input_tokens\":9,\"input_tokens_details\":{\"cached_tokens\":4},"
                        "\"output_tokens\":4,\"output_tokens_details\":{\"reasoning_tokens\":2},\"total_tokens\":13}}";
    CHECK(UREAD(resp, NULL, rbody) == 1 && usage_classes(resp, &uc, tk) == 0 && tk[TOK_IN] == 9 && tk[TOK_CACHE_READ] == 4 && tk[TOK_OUT] == 4 &&
          tk[TOK_REASONING] == 2, "a response's usage, with its details");
    const char *rdone = "{\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":3,\"output_tokens\":8}}}";
    CHECK(UREAD(resp, resp->event_usage, rdone) == 2 && uc.raw[TOK_IN] == 3 && uc.raw[TOK_OUT] == 8, "response.completed's usage");
    const char *rcreated = "{\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null}}";
    CHECK(UREAD(resp, resp->event_usage, rcreated) == 0, "response.created: no usage yet");
    CHECK(UREAD(resp, resp->event_usage, "{\"type\":\"x\"}") == 0, "an event without a response");
    /* too many values for one parse: read one level at a time, inside "response" too */
    big = (buf){0};
    buf_puts(&big, "{\"type\":\"response.completed\",\"response\":{\"output\":[");
    for (int i = 0; i < 200; i++) buf_printf(&big, "%s{\"type\":\"message\",\"n\":%d}", i ? "," : "", i);
    buf_puts(&big, "],\"usage\":{\"input_tokens\":3,\"output_tokens\":8,\"output_tokens_details\":{\"reasoning_tokens\":2}}}}");
    CHECK(UREAD(resp, resp->event_usage, big.p) == 2 && uc.raw[TOK_IN] == 3 && uc.raw[TOK_OUT] == 8 && uc.raw[TOK_REASONING] == 2,
          "response.completed after 200 output items");
    buf_free(&big);
    /* Anthropic: message_start holds the input (in "message"), message_delta the output alone. */
    const wire_kind *msg = &WIRE[4];
    CHECK(strcmp(msg->path, "/v1/messages") == 0, "WIRE[4] is Anthropic's Messages");
    const char *mstart = "{\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":12,\"cache_creation_input_tokens\":2000,"
                         "\"cache_read_input_tokens\":48000,\"cache_creation\":{\"ephemeral_5m_input_tokens\":1500,\"ephemeral_1h_input_tokens\":500},"
                         "\"output_tokens\":1,\"service_tier\":\"standard\"}}}";
    const char *mdelta = "{\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":100}}";
    CHECK(UREAD(msg, msg->event_usage, mstart) == 2 && uc.raw[TOK_IN] == 12 && uc.raw[TOK_OUT] == 1, "message_start");
    CHECK(usage_read(msg, msg->event_usage, mdelta, strlen(mdelta), &uc, &no_choices) == 1 && uc.raw[TOK_IN] == 12 && uc.raw[TOK_OUT] == 100,
          "message_delta: the output alone, the rest kept");
    CHECK(usage_classes(msg, &uc, tk) == 0 && tk[TOK_IN] == 50012 && tk[TOK_CACHE_READ] == 48000 && tk[TOK_CACHE_WRITE] == 2000 &&
          tk[TOK_CACHE_WRITE_1H] == 500 && tk[TOK_OUT] == 100 && tokens_cost(&sonnet, tk) == 24561,
          "Anthropic's input is uncached + read + written: %lld", (long long)tokens_cost(&sonnet, tk));
#undef UREAD

    /* Response pins: found by id, gone after 24 hours, the oldest out first past PIN_MAX. */
    int64_t now0 = S.now;
    const char *pd = NULL;
    const char *G1 = unit_id('g', 1), *G2 = unit_id('g', 2);
    pin_put(G1, "resp_a", 6, "Kimi-K3", "local/kimi-k3");
    long long ptok;
    CHECK(!pin_get(G2, "resp_a", 6, &pd, &ptok), "another group's pin: not found");
    CHECK(pin_get(G1, "resp_a", 6, &pd, &ptok) && strcmp(pin_get(G1, "resp_a", 6, &pd, &ptok), "Kimi-K3") == 0 && strcmp(pd, "local/kimi-k3") == 0 &&
          ptok == -1 && !pin_get(G1, "resp_b", 6, &pd, &ptok), "a pin");
    pin_tokens(G1, "resp_a", 1234);
    CHECK(pin_get(G1, "resp_a", 6, &pd, &ptok) && ptok == 1234, "its usage, once known");
    pin_put(G1, "resp_a", 6, "GLM", "eu/glm");
    CHECK(strcmp(pin_get(G1, "resp_a", 6, &pd, &ptok), "GLM") == 0 && strcmp(pd, "eu/glm") == 0, "the same id again: the newer wins");
    S.now += PIN_TTL_MS;
    CHECK(!pin_get(G1, "resp_a", 6, &pd, &ptok) && PINS.n == 0, "expired after 24 hours");
    char pid[32];
    for (int i = 0; i < PIN_MAX + 10; i++) {
        int k = snprintf(pid, sizeof pid, "resp_%d", i);
        pin_put(G1, pid, (size_t)k, "M", "p/m");
    }
    CHECK(PINS.n == PIN_MAX && !pin_get(G1, "resp_9", 6, &pd, &ptok) && pin_get(G1, "resp_10", 7, &pd, &ptok) && PINS.map.live == PIN_MAX, "bounded: the oldest out first (%d, %zu)", PINS.n, PINS.map.live);
    while (PINS.n) pin_drop_oldest();
    S.now = now0;

    /* A stream's events: comments and empty data are not the answer; data must be JSON or [DONE]. */
    {
        exchange x;
        memset(&x, 0, sizeof x);
        x.hide_usage = 1, x.kind = x.up = &WIRE[0];
        CHECK(stream_take(&x, ": ping\n\n", 8) == SSE_EMPTY, "a comment");
        CHECK(stream_take(&x, "data:\n\n", 7) == SSE_EMPTY, "empty data");
        CHECK(stream_take(&x, "data: [DONE]\n\n", 14) == SSE_RELAY, "[DONE]");
        CHECK(stream_take(&x, "data: <html>\n\n", 14) == LTG_ERR, "not JSON");
        const char *ev = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\n";
        CHECK(stream_take(&x, ev, strlen(ev)) == SSE_HIDE && x.usage.final && x.usage.raw[TOK_OUT] == 4, "the usage chunk ltg asked for");
        x.hide_usage = 0;
        CHECK(stream_take(&x, ev, strlen(ev)) == SSE_RELAY, "the usage chunk the client asked for");
        buf_free(&x.event);
    }

    /* Rate limits: a sliding minute of one-second slots; Retry-After is when enough leaves. */
    {
        int64_t rl_now0 = S.now;
        group *rg = (group *)group_new();
        rg->s.al.rpm_limit = 3, rg->s.al.tpm_limit = 100;
        const char *which = NULL;
        S.now = 1000000;
        CHECK(rate_check(&rg->s.al, 1, 10, &which) == 0, "an empty window admits");
        int64_t sec = S.now / 1000;
        rate_count(&rg->s.al, 1, 40, sec);
        S.now += 10000, rate_count(&rg->s.al, 1, 40, S.now / 1000);
        S.now += 10000;
        CHECK(rate_check(&rg->s.al, 1, 30, &which) == 40 && strcmp(which, "tpm_limit") == 0, "tokens: free in 40 s, when the first leaves (%s)", which);
        rate_settle(&rg->s.al, sec, 40, 5);
        CHECK(rate_check(&rg->s.al, 1, 30, &which) == 0, "settled with its real usage: room again");
        rate_count(&rg->s.al, 1, 5, S.now / 1000);
        CHECK(rate_check(&rg->s.al, 1, 1, &which) == 40 && strcmp(which, "rpm_limit") == 0, "requests: 3 in the minute, wait 40 s");
        S.now += 40000;
        CHECK(rate_check(&rg->s.al, 1, 1, &which) == 0, "the first request left the window");
        rate_settle(&rg->s.al, sec, 40, 5); /* its second has left: nothing to settle */
        CHECK(rl_used(rg->s.al.rl, S.now / 1000, 1) == 45, "the tokens of the window: %lld", (long long)rl_used(rg->s.al.rl, S.now / 1000, 1));
        group_drop(rg);
        S.now = rl_now0;
    }

    /* A provider's keys are used in turn; one that rests is skipped; all resting: in turn anyway. */
    {
        char *keys[] = {"k0", "k1", "k2"};
        int64_t rest[3] = {0, 0, 0};
        provider p = {.keys = keys, .nkeys = 3, .key_bad_until = rest};
        int a0 = provider_key(&p), a1 = provider_key(&p), a2 = provider_key(&p), a3 = provider_key(&p);
        CHECK(a0 == 0 && a1 == 1 && a2 == 2 && a3 == 0, "in turn: %d %d %d %d", a0, a1, a2, a3);
        rest[1] = S.now + KEY_REST_MS;
        a0 = provider_key(&p), a1 = provider_key(&p), a2 = provider_key(&p);
        CHECK(a0 == 2 && a1 == 0 && a2 == 2, "a resting key is skipped: %d %d %d", a0, a1, a2);
        rest[0] = rest[2] = S.now + KEY_REST_MS;
        CHECK(provider_key(&p) >= 0, "every key resting: one anyway");
        provider nokeys = {0};
        CHECK(provider_key(&nokeys) == -1, "no keys");
    }

    /* A provider's key quoted back by the provider is masked, byte for byte. */
    {
        char *keys[] = {"sk-prov-0000", "sk-prov-1234"};
        provider p = {.keys = keys, .nkeys = 2};
        char body[] = "{\"error\":\"bad key sk-prov-1234, sk-prov-1234!\"}";
        mask_provider_key(&p, body, strlen(body));
        CHECK(strcmp(body, "{\"error\":\"bad key ************, ************!\"}") == 0, "masked: %s", body);
        p.nkeys = 0;
        mask_provider_key(&p, body, strlen(body));
        mask_provider_key(&p, NULL, 0);
    }

    /* Asking a stream for its usage: the body edits. */
    static const struct { const char *body, *want; int hide; } edits[] = {
        {"{\"model\":\"m\",\"stream\":true}", "{\"model\":\"m\",\"stream\":true,\"stream_options\":{\"include_usage\":true}}", 1},
        {"{\"model\":\"m\",\"stream_options\":null}", "{\"model\":\"m\",\"stream_options\":{\"include_usage\":true}}", 1},
        {"{\"model\":\"m\",\"stream_options\":{}}", "{\"model\":\"m\",\"stream_options\":{\"include_usage\":true}}", 1},
        {"{\"model\":\"m\",\"stream_options\":{\"x\":1}}", "{\"model\":\"m\",\"stream_options\":{\"include_usage\":true,\"x\":1}}", 1},
        {"{\"model\":\"m\",\"stream_options\":{\"include_usage\":false}}", "{\"model\":\"m\",\"stream_options\":{\"include_usage\":true}}", 1},
        {"{\"model\":\"m\",\"stream_options\":{\"include_usage\":true}}", "{\"model\":\"m\",\"stream_options\":{\"include_usage\":true}}", 0},
    };
    for (size_t i = 0; i < sizeof edits / sizeof *edits; i++) {
        const char *body = edits[i].body;
        json_tok t[16];
        json_result r;
        json_parse(body, strlen(body), t, 16, 1, &r);
        body_edit e = {0, 0, NULL};
        int hide;
        const char *why;
        int rc = usage_edit(body, t, json_get(body, t, 0, "stream_options"), &e, &hide, &why);
        buf edited = {0};
        buf_append(&edited, body, e.text ? e.at : strlen(body));
        if (e.text) buf_puts(&edited, e.text), buf_puts(&edited, body + e.end);
        CHECK(rc == 0 && hide == edits[i].hide && strcmp(edited.p, edits[i].want) == 0, "usage edit %zu: %s", i, edited.p);
        buf_free(&edited), free(e.text);
    }

    /* The cache: TTL and least recently used out first. */
    CACHE.limit = 3 * (sizeof(cache_entry) + 100);
    uint8_t k1[32] = {1}, k2[32] = {2}, k3[32] = {3}, k4[32] = {4};
    long long ctok[NTOK] = {1, 0, 0, 0, 2, 0};
    char body[100] = {0};
    S.now = 1000;
    cache_put(k1, body, 100, "a", ctok, 5000), cache_put(k2, body, 100, "a", ctok, 5000), cache_put(k3, body, 100, "a", ctok, 5000);
    CHECK(cache_get(k1) && cache_get(k2) && cache_get(k3), "three fit");
    CHECK(cache_get(k1) != NULL, "k1 used again: k2 is now the oldest");
    cache_put(k4, body, 100, "a", ctok, 5000);
    CHECK(!cache_get(k2) && cache_get(k1) && cache_get(k3) && cache_get(k4), "the least recently used went out");
    S.now = 6000;
    CHECK(!cache_get(k1) && CACHE.bytes == 2 * (sizeof(cache_entry) + 100), "expired at the TTL");
    while (CACHE.head) cache_drop(CACHE.head);
    CHECK(CACHE.bytes == 0 && CACHE.map.live == 0, "emptied");
}

/* ---- timers ---- */

static int fired[8], nfired;
static void note_fire(void *ctx) { fired[nfired++] = (int)(intptr_t)ctx; }

static void test_timers(void) {
    timer t[5];
    S.now = 1000;
    for (int i = 0; i < 5; i++) timer_init(&t[i], note_fire, (void *)(intptr_t)i);
    timer_set(&t[0], 50), timer_set(&t[1], 10), timer_set(&t[2], 30), timer_set(&t[3], 20), timer_set(&t[4], 40);
    timer_stop(&t[2]);
    timer_set(&t[0], 5); /* re-armed earlier */
    S.now = 1100;
    timers_run();
    CHECK(nfired == 4 && fired[0] == 0 && fired[1] == 1 && fired[2] == 3 && fired[3] == 4, "timer order");
    CHECK(S.nheap == 0 && t[2].slot == -1, "heap empty");
}

/* ---- RESP (section 20) ---- */

/* Parse all of s: 1, 0 (wants more) or LTG_ERR; the tokens in t, their count in *nt. */
static int resp_all(const char *s, size_t n, resp_tok *t, int max, int *nt) {
    size_t at = 0;
    *nt = 0;
    const char *g = guarded(s, n);
    int r = resp_elem(g, n, &at, t, max, nt, 0);
    return r == 1 && at != n ? LTG_ERR : r;
}

static void test_resp(void) {
    resp_tok t[64];
    int nt;
    static const char xread[] = "*1\r\n*2\r\n$7\r\nltg:log\r\n*2\r\n*2\r\n$3\r\n1-0\r\n*2\r\n$1\r\nr\r\n"
                                "$2\r\n{}\r\n*2\r\n$3\r\n2-5\r\n*0\r\n";
    CHECK(resp_all("+OK\r\n", 5, t, 64, &nt) == 1 && t[0].type == '+' && t[0].len == 2, "simple string");
    CHECK(resp_all("-ERR no\r\n", 9, t, 64, &nt) == 1 && t[0].type == '-' && t[0].len == 6, "error");
    CHECK(resp_all(":-42\r\n", 6, t, 64, &nt) == 1 && t[0].num == -42, "negative integer");
    CHECK(resp_all("$-1\r\n", 5, t, 64, &nt) == 1 && t[0].type == '_', "null bulk");
    CHECK(resp_all("*-1\r\n", 5, t, 64, &nt) == 1 && t[0].type == '_', "null array");
    CHECK(resp_all("$0\r\n\r\n", 6, t, 64, &nt) == 1 && t[0].type == '$' && t[0].len == 0, "empty bulk");
    CHECK(resp_all("$5\r\na\r\nbc\r\n", 11, t, 64, &nt) == 1 && t[0].len == 5, "a bulk holding CRLF");
    CHECK(resp_all(xread, sizeof xread - 1, t, 64, &nt) == 1 && nt == 12 && t[0].next == 12 &&
              t[3].num == 2 && t[4].next == 9 && resp_is(xread, t, 7, "r") && t[11].num == 0,
          "an XREAD answer: %d tokens", nt);
    for (size_t n = 0; n < sizeof xread - 1; n++) /* every prefix wants more, none reads past */
        CHECK(resp_all(xread, n, t, 64, &nt) == 0, "prefix of %zu bytes", n);
    static const char *const bad[] = {"?x\r\n", "+OK\n", ":12a\r\n", "$3\r\nabcd\r\n", "$x\r\n",
                                      "*1\r\n!\r\n", ":\r\n", "$--1\r\n"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        CHECK(resp_all(bad[i], strlen(bad[i]), t, 64, &nt) == LTG_ERR, "malformed %s", bad[i]);
    CHECK(resp_all("\0" "1\r\n", 4, t, 64, &nt) == LTG_ERR, "a NUL where the type is");
    CHECK(resp_all("*3\r\n:1\r\n:2\r\n:3\r\n", 16, t, 3, &nt) == LTG_ERR, "more tokens than room");
    char deep[200] = "";
    for (int i = 0; i < 12; i++) strcat(deep, "*1\r\n");
    strcat(deep, ":1\r\n");
    CHECK(resp_all(deep, strlen(deep), t, 64, &nt) == LTG_ERR, "nested deeper than RESP_MAX_DEPTH");
    CHECK(resp_all("$9999999999\r\n", 13, t, 64, &nt) == LTG_ERR, "a bulk over RESP_MAX_BULK");
    buf b = {0};
    resp_cmd(&b, (rarg[]){RA("SET"), RA("k"), {"a\r\nb", 4}}, 3);
    CHECK(b.len == 30 && memcmp(b.p, "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n", 30) == 0,
          "a command: %.*s", (int)b.len, b.p);
    buf_free(&b);
    CHECK(sid_cmp("1-0", "1-0") == 0 && sid_cmp("9-1", "10-0") < 0 && sid_cmp("10-2", "10-10") < 0 &&
              sid_cmp("1796525140541-0", "1796525134125-7") > 0,
          "stream ids compare as numbers");
    static const struct { const char *url, *host; int port, db, ok; } urls[] = {
        {"redis://10.0.0.5", "10.0.0.5", 6379, 0, 1}, {"redis://r.internal:7000/3", "r.internal", 7000, 3, 1},
        {"redis://[::1]:6380/", "::1", 6380, 0, 1}, {"redis://h:0", "", 0, 0, 0},
        {"rediss://h", "", 0, 0, 0}, {"redis://:6379", "", 0, 0, 0}, {"redis://h:6379/x", "", 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof urls / sizeof *urls; i++) {
        CL.url = urls[i].url;
        CL.db = 0;
        const char *why = cl_parse();
        CHECK(urls[i].ok ? !why && strcmp(CL.host, urls[i].host) == 0 && CL.port == urls[i].port &&
                                   CL.db == urls[i].db
                         : why != NULL,
              "--cluster %s: %s (%s:%d/%d)", urls[i].url, why ? why : "ok", CL.host, CL.port, CL.db);
    }
    CL.url = NULL;
}

/* An entry of ltg:events read from the stream (cl_event) whose last field, b (the scopes' spent
 * and held), ends where the reply's bytes do, on an unmapped page: read within its bytes. */
static void test_cl_event_bounds(void) {
    char err[512];
    unit_data_dir("cl-event");
    S.ledger_days = 90, S.now = 1000000;
    CHECK(unit_reopen_ledger(UDAY + 1000, err) == 0, "an empty ledger: %s", err);
    rec_view v = {.charged = 7, .status = EV_SUCCEEDED, .key = unit_id('k', 1), .group = unit_id('g', 1),
                  .model = "m", .model_len = 1, .event = "{}", .event_len = 2, .replay = ""};
    buf rec = {0}, ent = {0};
    rec_encode(&rec, &v);
    char sid[32], b[] = "g:x 1000 0";
    snprintf(sid, sizeof sid, "%lld-0", (long long)(UDAY + 5000));
    buf_printf(&ent, "*2\r\n$%zu\r\n%s\r\n*4\r\n$1\r\ne\r\n$%zu\r\n", strlen(sid), sid, rec.len);
    buf_append(&ent, rec.p, rec.len);
    buf_printf(&ent, "\r\n$1\r\nb\r\n$%zu\r\n%s\r\n", strlen(b), b);
    resp_tok t[16];
    int nt = 0;
    size_t at = 0;
    const char *g = guarded(ent.p, ent.len);
    CHECK(resp_elem(g, ent.len, &at, t, 16, &nt, 0) == 1 && at == ent.len, "the entry parses");
    CHECK(cl_event(sid, g, t, 0) == 0 && strcmp(CL.ev_applied, sid) == 0, "the event is read: %s", CL.ev_applied);
    buf_free(&rec);
    buf_free(&ent);
    CL.ev_applied[0] = 0;
    store_reset();
}

/* ---- the runner ---- */

static void test_ledger_budgets_16m(void) { test_ledger_budgets(16LL << 20); }
static void test_ledger_budgets_16k(void) { test_ledger_budgets(16 << 10); }

/* ltg's SHA-256 (section 2), on the SHA extensions when the processor has
 * them and on BearSSL's code: equal to BearSSL's SHA-256 for every length
 * around the block boundaries, whole and in pieces; its HMAC (keys short and
 * long) and HMAC-DRBG equal BearSSL's on its own SHA-256; RFC 4231's case 2. */
static void test_sha256(void) {
    uint8_t msg[300], key[100], mine[32], theirs[32];
    for (size_t i = 0; i < sizeof msg; i++) msg[i] = (uint8_t)(i * 7 + 1);
    for (size_t i = 0; i < sizeof key; i++) key[i] = (uint8_t)(i * 13 + 5);
    int ni = sha_ni_present();
    if (!ni) printf("skip - test_sha256 on the SHA extensions (this processor has none)\n"), skipped++;
    for (int path = 0; path <= ni; path++) {
        SHA_NI = path;
        const char *how = path ? "SHA extensions" : "portable";
        int same = 1;
        for (size_t n = 0; n <= sizeof msg && same; n++) {
            sha_run r;
            sha_init(&r.vtable);
            sha_add(&r.vtable, msg, n / 3); /* in pieces */
            sha_add(&r.vtable, msg + n / 3, n - n / 3);
            sha_out(&r.vtable, mine);
            br_sha256_context c;
            br_sha256_init(&c);
            br_sha256_update(&c, msg, n);
            br_sha256_out(&c, theirs);
            CHECK((same = !memcmp(mine, theirs, 32)), "%s: SHA-256 of %zu bytes", how, n);
        }
        for (size_t kn = 32; kn <= sizeof key && same; kn += 34) /* 32, 66 (hashed first), 100 */
            for (size_t n = 0; n <= sizeof msg && same; n += 7) {
                br_hmac_key_context k1, k2;
                br_hmac_key_init(&k1, &LTG_SHA256, key, kn);
                br_hmac_key_init(&k2, &br_sha256_vtable, key, kn);
                chain_of(&k1, msg + n % 50, msg, n, mine);
                chain_of(&k2, msg + n % 50, msg, n, theirs);
                CHECK((same = !memcmp(mine, theirs, 32)), "%s: HMAC, key %zu bytes, message 32 + %zu", how, kn, n);
            }
        br_hmac_drbg_context d1, d2;
        uint8_t o1[200], o2[200];
        br_hmac_drbg_init(&d1, &LTG_SHA256, key, 32);
        br_hmac_drbg_init(&d2, &br_sha256_vtable, key, 32);
        for (int i = 0; i < 3; i++) {
            br_hmac_drbg_generate(&d1, o1, sizeof o1);
            br_hmac_drbg_generate(&d2, o2, sizeof o2);
            CHECK(!memcmp(o1, o2, sizeof o1), "%s: HMAC-DRBG, draw %d", how, i);
        }
        br_hmac_key_context k;
        br_hmac_context h;
        br_hmac_key_init(&k, &LTG_SHA256, "Jefe", 4);
        br_hmac_init(&h, &k, 0);
        br_hmac_update(&h, "what do ya want for nothing?", 28);
        br_hmac_out(&h, mine);
        char hex[65];
        hex_encode(mine, 32, hex);
        CHECK(!strcmp(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
              "%s: RFC 4231 case 2: %s", how, hex);
    }
    SHA_NI = -1;
}

/* jv_*: walking a validated document, storing nothing -- the same members json_parse finds. */
static void test_jv(void) {
    const char *doc = " {\"a\": [1, {\"b\":\"x\\\"}\"}, [] ], \"c\" : -2.5e3, \"d\":{}, \"e\":null} ";
    size_t n = strlen(doc), pos = 0;
    json_tok root = jv_at(doc, n, 0), k, v, a;
    CHECK(root.type == JSON_OBJECT && doc[root.end - 1] == '}', "root %d", root.type);
    const char *names[] = {"a", "c", "d", "e"};
    json_type types[] = {JSON_ARRAY, JSON_NUMBER, JSON_OBJECT, JSON_NULL};
    int i = 0;
    while (jv_next(doc, n, &root, &pos, &k, &v) && i < 4) {
        CHECK(json_eq(doc, &k, 0, names[i]) && v.type == types[i], "member %d", i);
        i++;
    }
    CHECK(i == 4, "4 members, %d", i);
    CHECK(jv_get(doc, n, &root, "a", &a) && a.type == JSON_ARRAY, "a");
    pos = 0;
    int e = 0;
    while (jv_next(doc, n, &a, &pos, &k, &v)) e++;
    CHECK(e == 3, "a has 3 elements, %d", e);
    CHECK(jv_get(doc, n, &root, "c", &v) && v.end - v.start == 6, "c's bytes");
    CHECK(!jv_get(doc, n, &root, "zz", &v) && v.type == JSON_NULL && v.start == 0 && v.end == 0,
          "no zz: v an empty null, never a neighbour's value");
    /* strings end at the quote no odd run of backslashes escapes */
    static const struct { const char *doc, *second; } q[] = {
        {"{\"a\":\"x\\\\\",\"b\":1}", "b"},          /* "x\\" then b */
        {"{\"a\":\"x\\\"y\",\"b\":1}", "b"},          /* "x\"y" then b */
        {"{\"a\":\"\\\\\\\"\",\"b\":1}", "b"},     /* "\\\"" then b */
        {"{\"a\":\"\",\"b\":1}", "b"},                  /* "" then b */
        {"{\"a\":\"\\\\\\\\\",\"b\":1}", "b"},    /* "\\\\" then b */
    };
    for (size_t c = 0; c < sizeof q / sizeof *q; c++) {
        size_t dn = strlen(q[c].doc);
        json_tok d = jv_doc(q[c].doc, dn), bv;
        CHECK(d.type == JSON_OBJECT && d.end == dn && jv_get(q[c].doc, dn, &d, q[c].second, &bv) &&
                  bv.type == JSON_NUMBER && q[c].doc[bv.start] == '1',
              "case %zu: %s", c, q[c].doc);
    }
}

/* xl_request on s walked, and again from the top-level tokens admission would have parsed:
 * the same answer both ways. */
static int xl_both(xl_api from, xl_api to, const char *s, const xl_target *t, buf *out,
                   xl_verdict *v) {
    json_tok top[256];
    json_result res;
    xl_verdict v2;
    buf out2 = {0};
    int r = xl_request(from, to, s, strlen(s), NULL, t, out, v);
    CHECK(json_parse(s, strlen(s), top, 256, 1, &res) == 0, "the case's top level: %s", s);
    int r2 = xl_request(from, to, s, strlen(s), top, t, &out2, &v2);
    CHECK(r2 == r && strcmp(v2.param, v->param) == 0 && strcmp(v2.dropped, v->dropped) == 0 &&
          out2.len == out->len && (!out->len || memcmp(out2.p, out->p, out->len) == 0),
          "the same from admission's tokens: %s", s);
    buf_free(&out2);
    return r;
}

/* One translated request against its golden. */
static void xl_golden(xl_api from, xl_api to, const char *in, const char *want, const char *param,
                      const char *dropped) {
    xl_target t = {"up-model", 8000, 1};
    xl_verdict v;
    buf out = {0};
    json_tok tok[1];
    json_result res;
    CHECK(json_parse(in, strlen(in), tok, 1, 0, &res) == 0, "the case is JSON: %s", in);
    int r = xl_both(from, to, in, &t, &out, &v);
    if (param) {
        CHECK(r < 0 && strcmp(v.param, param) == 0, "refused at %s: got %d %s (%s) for %s", param, r,
              v.param, v.msg, in);
    } else {
        CHECK(r == 0 && out.p && strcmp(out.p, want) == 0, "%s\n  want %s\n  got  %s (%s)", in,
              want, out.p ? out.p : "", v.msg);
        CHECK(r != 0 || json_parse(out.p, out.len, tok, 1, 0, &res) == 0, "output is JSON");
        CHECK(strcmp(v.dropped, dropped ? dropped : "") == 0, "dropped %s, want %s", v.dropped,
              dropped ? dropped : "");
    }
    buf_free(&out);
}

static void test_xl_ptr(void) {
    char p[16], small[8];
    CHECK(!strcmp(xl_ptr(p, sizeof p, "/messages", NULL, 12, "content"), "/messages/12/co"), "%s",
          p);
    CHECK(!strcmp(xl_ptr(p, sizeof p, "/messages", NULL, 0, NULL), "/messages/0"), "%s", p);
    CHECK(!strcmp(xl_ptr(p, sizeof p, p, "tool_calls", -1, NULL), "/messages/0/too"), "%s", p);
    CHECK(!strcmp(xl_ptr(small, sizeof small, "/a", "b", 345, "c"), "/a/b/34"), "%s", small);
    CHECK(!strcmp(xl_ptr(small, sizeof small, "", "t", 7, NULL), "/t/7"), "%s", small);
    CHECK(!strcmp(xl_ptr(small, sizeof small, small, NULL, -1, "x"), "/t/7/x"), "%s", small);
}

static void test_xl_requests(void) {
    /* Messages -> chat */
    xl_golden(XL_MESSAGES, XL_CHAT,
              "{\"model\":\"C\",\"max_tokens\":10,\"system\":[{\"type\":\"text\",\"text\":\"a\","
              "\"cache_control\":{\"type\":\"ephemeral\"}},{\"type\":\"text\",\"text\":\"b\"}],"
              "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"top_k\":5}",
              "{\"model\":\"up-model\",\"messages\":[{\"role\":\"system\",\"content\":\"a\\nb\"},"
              "{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":10}",
              NULL, "/top_k,/system/0/cache_control");
    /* a tool loop: tool_use -> tool_calls, tool_result before the turn's text, is_error */
    xl_golden(XL_MESSAGES, XL_CHAT,
              "{\"model\":\"C\",\"max_tokens\":10,\"messages\":[{\"role\":\"user\",\"content\":\"go\"},"
              "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"ok\"},{\"type\":"
              "\"tool_use\",\"id\":\"toolu_1\",\"name\":\"Bash\",\"input\":{\"command\":\"ls\"}}]},"
              "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"and?\"},{\"type\":"
              "\"tool_result\",\"tool_use_id\":\"toolu_1\",\"is_error\":true,\"content\":[{\"type\":"
              "\"text\",\"text\":\"no\"}]}]}],\"tools\":[{\"name\":\"Bash\",\"description\":\"run\","
              "\"input_schema\":{\"type\":\"object\"}}],\"tool_choice\":{\"type\":\"any\","
              "\"disable_parallel_tool_use\":true},\"stream\":true}",
              "{\"model\":\"up-model\",\"messages\":[{\"role\":\"user\",\"content\":\"go\"},{\"role\":"
              "\"assistant\",\"content\":\"ok\",\"tool_calls\":[{\"id\":\"toolu_1\",\"type\":"
              "\"function\",\"function\":{\"name\":\"Bash\",\"arguments\":\"{\\\"command\\\":\\\"ls\\\"}\"}}]},"
              "{\"role\":\"tool\",\"tool_call_id\":\"toolu_1\",\"content\":\"Error: no\"},{\"role\":"
              "\"user\",\"content\":\"and?\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":"
              "\"Bash\",\"description\":\"run\",\"parameters\":{\"type\":\"object\"}}}],\"tool_choice\":"
              "\"required\",\"parallel_tool_calls\":false,\"max_tokens\":10,\"stream\":true,"
              "\"stream_options\":{\"include_usage\":true}}",
              NULL, NULL);
    /* images by base64 and URL; thinking to a reasoning model; metadata.user_id */
    xl_golden(XL_MESSAGES, XL_CHAT,
              "{\"model\":\"C\",\"max_tokens\":10,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":"
              "\"image\",\"source\":{\"type\":\"base64\",\"media_type\":\"image/png\",\"data\":\"QUJD\"}},"
              "{\"type\":\"image\",\"source\":{\"type\":\"url\",\"url\":\"https://x/y.png\"}},{\"type\":"
              "\"text\",\"text\":\"what?\"}]}],\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":3000},"
              "\"metadata\":{\"user_id\":\"u1\"}}",
              "{\"model\":\"up-model\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":"
              "\"image_url\",\"image_url\":{\"url\":\"data:image/png;base64,QUJD\"}},{\"type\":"
              "\"image_url\",\"image_url\":{\"url\":\"https://x/y.png\"}},{\"type\":\"text\",\"text\":"
              "\"what?\"}]}],\"max_tokens\":10,\"user\":\"u1\",\"reasoning_effort\":\"medium\"}",
              NULL, NULL);
    /* refused, each with its pointer */
    xl_golden(XL_MESSAGES, XL_CHAT,
              "{\"model\":\"C\",\"max_tokens\":1,\"messages\":[],\"tools\":[{\"type\":\"bash_20250124\","
              "\"name\":\"bash\"}]}", NULL, "/tools/0/type", NULL);
    xl_golden(XL_MESSAGES, XL_CHAT, "{\"model\":\"C\",\"max_tokens\":1,\"messages\":[],\"mcp_servers\":[]}",
              NULL, "/mcp_servers", NULL);
    xl_golden(XL_MESSAGES, XL_CHAT, "{\"model\":\"C\",\"max_tokens\":1,\"messages\":[],\"new_thing\":1}",
              NULL, "/new_thing", NULL);
    xl_golden(XL_MESSAGES, XL_CHAT,
              "{\"model\":\"C\",\"max_tokens\":1,\"messages\":[],\"stop_sequences\":[\"a\",\"b\",\"c\","
              "\"d\",\"e\"]}", NULL, "/stop_sequences", NULL);
    /* chat -> Messages: system hoisted, the model's max_output_tokens, tool results coalesced into
     * one user turn right after the calls, the user text after them, ids Anthropic refuses mapped
     * injectively, thinking off after a tool call */
    xl_golden(XL_CHAT, XL_MESSAGES,
              "{\"model\":\"G\",\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\","
              "\"content\":\"go\"},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":"
              "\"functions.Bash:0\",\"type\":\"function\",\"function\":{\"name\":\"Bash\",\"arguments\":"
              "\"{\\\"c\\\":1}\"}},{\"id\":\"call_2\",\"type\":\"function\",\"function\":{\"name\":\"Bash\","
              "\"arguments\":\"\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"functions.Bash:0\",\"content\":"
              "\"r1\"},{\"role\":\"tool\",\"tool_call_id\":\"call_2\",\"content\":\"r2\"},{\"role\":\"user\","
              "\"content\":\"next\"}],\"reasoning_effort\":\"high\",\"seed\":4,\"temperature\":0.5,"
              "\"stop\":\"END\",\"user\":\"u\"}",
              "{\"model\":\"up-model\",\"messages\":[{"
              "\"role\":\"user\",\"content\":\"go\"},{\"role\":\"assistant\","
              "\"content\":[{\"type\":\"tool_use\",\"id\":\"functions_Bash_0_a97d1507\",\"name\":\"Bash\","
              "\"input\":{\"c\":1}},{\"type\":\"tool_use\",\"id\":\"call_2\",\"name\":\"Bash\",\"input\":{}}]},"
              "{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":"
              "\"functions_Bash_0_a97d1507\",\"content\":\"r1\"},{\"type\":\"tool_result\",\"tool_use_id\":"
              "\"call_2\",\"content\":\"r2\"},{\"type\":\"text\",\"text\":\"next\"}]}],\"system\":\"s\","
              "\"max_tokens\":8000,\"stop_sequences\":[\"END\"],\"temperature\":0.5,"
              "\"metadata\":{\"user_id\":\"u\"}}",
              NULL, "/seed,/reasoning_effort");
    /* an image as a data: URL becomes a base64 source (the fuzzer found the slice written with
     * its neighbours as quotes); an https one a url source; detail dropped */
    xl_golden(XL_CHAT, XL_MESSAGES,
              "{\"model\":\"G\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\","
              "\"image_url\":{\"url\":\"data:image/png;base64,QQ==\",\"detail\":\"low\"}},{\"type\":"
              "\"image_url\",\"image_url\":{\"url\":\"https://x/y.png\"}}]}]}",
              "{\"model\":\"up-model\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image\","
              "\"source\":{\"type\":\"base64\",\"media_type\":\"image/png\",\"data\":\"QQ==\"}},{\"type\":"
              "\"image\",\"source\":{\"type\":\"url\",\"url\":\"https://x/y.png\"}}]}],\"max_tokens\":8000}",
              NULL, "/messages/0/content/0");
    xl_golden(XL_CHAT, XL_MESSAGES, "{\"model\":\"G\",\"messages\":[],\"n\":2}", NULL, "/n", NULL);
    xl_golden(XL_CHAT, XL_MESSAGES, "{\"model\":\"G\",\"messages\":[],\"temperature\":1.5}", NULL,
              "/temperature", NULL);
    xl_golden(XL_CHAT, XL_MESSAGES, "{\"model\":\"G\",\"messages\":[],\"logprobs\":true}", NULL,
              "/logprobs", NULL);
    xl_golden(XL_CHAT, XL_MESSAGES,
              "{\"model\":\"G\",\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"a\","
              "\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"[1]\"}}]}]}",
              NULL, "/messages/0/tool_calls/0", NULL);
    xl_golden(XL_CHAT, XL_MESSAGES,
              "{\"model\":\"G\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_audio\","
              "\"input_audio\":{}}]}]}", NULL, "/messages/0/content/0", NULL);
    /* a name past chat's 64 bytes: 55 of it, "_", 8 hex; the id map never makes two ids one */
    char a[74], b[74];
    xl_anthropic_id("x.y", 3, a);
    xl_anthropic_id("x_y", 3, b);
    CHECK(strcmp(a, b) != 0 && strcmp(b, "x_y") == 0 && strncmp(a, "x_y_", 4) == 0, "ids %s %s", a, b);
    char cn[65];
    xl_chat_name("mcp__a_very_long_server_name__and_a_very_long_tool_name_too_long_x", 66, cn);
    CHECK(strlen(cn) == 64 && cn[55] == '_', "name %s", cn);
}

/* Feed a provider's SSE events one at a time; the client's stream, joined. */
/* The goldens below are written with ' for " (no case needs an apostrophe): readable JSON. */
static char *sq(const char *s) {
    char *d = strdup(s ? s : "");
    for (char *p = d; *p; p++)
        if (*p == '\'') *p = '"';
    return d;
}

/* One request golden for a target with or without reasoning; want NULL with param set: refused
 * there. */
static void xlg(xl_api from, xl_api to, int reasoning, const char *in, const char *want,
                const char *param, const char *dropped) {
    xl_target t = {"up-model", 8000, reasoning};
    xl_verdict v;
    buf out = {0};
    char *i = sq(in), *w = sq(want);
    int r = xl_both(from, to, i, &t, &out, &v);
    if (param) {
        CHECK(r < 0 && strcmp(v.param, param) == 0, "refused at %s: got %d %s (%s) for %s", param,
              r, v.param, v.msg, i);
    } else {
        CHECK(r == 0 && out.p && strcmp(out.p, w) == 0, "%s\n  want %s\n  got  %s (%s)", i, w,
              out.p ? out.p : "", v.msg);
        CHECK(strcmp(v.dropped, dropped ? dropped : "") == 0, "%s: dropped %s, want %s", i,
              v.dropped, dropped ? dropped : "");
    }
    free(i), free(w);
    buf_free(&out);
}

#define M2C(in, want, dropped) xlg(XL_MESSAGES, XL_CHAT, 1, in, want, NULL, dropped)
#define C2M(in, want, dropped) xlg(XL_CHAT, XL_MESSAGES, 1, in, want, NULL, dropped)
#define M2C_NO(in, param) xlg(XL_MESSAGES, XL_CHAT, 1, in, NULL, param, NULL)
#define C2M_NO(in, param) xlg(XL_CHAT, XL_MESSAGES, 1, in, NULL, param, NULL)

/* Every row of the mapping tables, Messages -> chat (the note's 1a), with its peers' bugs. */
static void test_xl_m2c_rows(void) {
    /* blank text skipped, user and assistant; cache_control on a block named when dropped
     * (Portkey#1589: a scope Anthropic accepts is no reason to refuse) */
    M2C("{'model':'C','max_tokens':9,'messages':[{'role':'user','content':[{'type':'text',"
        "'text':' '},{'type':'text','text':'hi','cache_control':{'type':'ephemeral','scope':'turn'}}]},"
        "{'role':'assistant','content':[{'type':'text','text':' '},{'type':'text','text':'yo'}]}]}",
        "{'model':'up-model','messages':[{'role':'user','content':'hi'},{'role':'assistant',"
        "'content':'yo'}],'max_tokens':9}",
        "/messages/0/content/1/cache_control");
    /* a PDF document as chat's file part; by URL it cannot be carried */
    M2C("{'model':'C','max_tokens':9,'messages':[{'role':'user','content':[{'type':'document',"
        "'source':{'type':'base64','media_type':'application/pdf','data':'QQ=='}},{'type':'text',"
        "'text':'sum'}]}]}",
        "{'model':'up-model','messages':[{'role':'user','content':[{'type':'file','file':"
        "{'filename':'document.pdf','file_data':'data:application/pdf;base64,QQ=='}},{'type':"
        "'text','text':'sum'}]}],'max_tokens':9}",
        NULL);
    M2C_NO("{'model':'C','max_tokens':9,'messages':[{'role':'user','content':[{'type':'document',"
           "'source':{'type':'url','url':'https://x/a.pdf'}}]}]}",
           "/messages/0/content/0/source");
    /* tool results: each a tool message before the turn's text (envoy#1953), in order, empty
     * content said so, is_error prefixed; an image in one has no place in a chat tool message */
    M2C("{'model':'C','max_tokens':9,'messages':[{'role':'assistant','content':[{'type':'tool_use',"
        "'id':'t1','name':'f','input':{}},{'type':'tool_use','id':'t2','name':'f','input':{'a':1}}]},"
        "{'role':'user','content':[{'type':'text','text':'next'},{'type':'tool_result','tool_use_id':"
        "'t2','content':[]},{'type':'tool_result','tool_use_id':'t1','content':'ok',"
        "'cache_control':{'type':'ephemeral'}}]}]}",
        "{'model':'up-model','messages':[{'role':'assistant','content':null,'tool_calls':[{'id':"
        "'t1','type':'function','function':{'name':'f','arguments':'{}'}},{'id':'t2','type':"
        "'function','function':{'name':'f','arguments':'{\\'a\\':1}'}}]},{'role':'tool',"
        "'tool_call_id':'t2','content':'(no output)'},{'role':'tool','tool_call_id':'t1',"
        "'content':'ok'},{'role':'user','content':'next'}],'max_tokens':9}",
        "/messages/1/content/2/cache_control");
    M2C_NO("{'model':'C','max_tokens':9,'messages':[{'role':'user','content':[{'type':'tool_result',"
           "'tool_use_id':'t1','content':[{'type':'image','source':{'type':'base64','media_type':"
           "'image/png','data':'QQ=='}}]}]}]}",
           "/messages/0/content/0/content/0");
    /* thinking and redacted thinking in the history: another provider cannot read them */
    M2C("{'model':'C','max_tokens':9,'messages':[{'role':'user','content':'q'},{'role':'assistant',"
        "'content':[{'type':'redacted_thinking','data':'xx'},{'type':'thinking','thinking':'h',"
        "'signature':'s'},{'type':'text','text':'a'}]}]}",
        "{'model':'up-model','messages':[{'role':'user','content':'q'},{'role':'assistant',"
        "'content':'a'}],'max_tokens':9}",
        "/messages/1/content/0");
    /* tool_choice: auto, none, a named tool; a choice without tools says nothing */
    M2C("{'model':'C','max_tokens':9,'messages':[],'tools':[{'name':'f','input_schema':{}}],"
        "'tool_choice':{'type':'auto'}}",
        "{'model':'up-model','messages':[],'tools':[{'type':'function','function':{'name':'f',"
        "'parameters':{}}}],'tool_choice':'auto','max_tokens':9}", NULL);
    M2C("{'model':'C','max_tokens':9,'messages':[],'tools':[{'name':'f','input_schema':{}}],"
        "'tool_choice':{'type':'none'}}",
        "{'model':'up-model','messages':[],'tools':[{'type':'function','function':{'name':'f',"
        "'parameters':{}}}],'tool_choice':'none','max_tokens':9}", NULL);
    M2C("{'model':'C','max_tokens':9,'messages':[],'tools':[{'name':'f','input_schema':{}}],"
        "'tool_choice':{'type':'tool','name':'f'}}",
        "{'model':'up-model','messages':[],'tools':[{'type':'function','function':{'name':'f',"
        "'parameters':{}}}],'tool_choice':{'type':'function','function':{'name':'f'}},"
        "'max_tokens':9}", NULL);
    /* a name past chat's 64 bytes, the same in the tools, the choice and the history */
    M2C("{'model':'C','max_tokens':9,'messages':[{'role':'assistant','content':[{'type':'tool_use',"
        "'id':'t1','name':'mcp__a_very_long_server_name__and_a_very_long_tool_name_too_long_x',"
        "'input':{}}]}],'tools':[{'name':"
        "'mcp__a_very_long_server_name__and_a_very_long_tool_name_too_long_x','input_schema':{}}],"
        "'tool_choice':{'type':'tool','name':"
        "'mcp__a_very_long_server_name__and_a_very_long_tool_name_too_long_x'}}",
        "{'model':'up-model','messages':[{'role':'assistant','content':null,'tool_calls':[{'id':"
        "'t1','type':'function','function':{'name':"
        "'mcp__a_very_long_server_name__and_a_very_long_tool_name_abfb628c','arguments':'{}'}}]}],"
        "'tools':[{'type':'function','function':{'name':"
        "'mcp__a_very_long_server_name__and_a_very_long_tool_name_abfb628c','parameters':{}}}],"
        "'tool_choice':{'type':'function','function':{'name':"
        "'mcp__a_very_long_server_name__and_a_very_long_tool_name_abfb628c'}},'max_tokens':9}",
        NULL);
    /* thinking: a budget by bucket, adaptive by its effort, nothing to a model without
     * reasoning (Groq refuses it: cherry-studio#1099) */
    M2C("{'model':'C','max_tokens':9,'messages':[],'thinking':{'type':'enabled','budget_tokens':1024}}",
        "{'model':'up-model','messages':[],'max_tokens':9,'reasoning_effort':'low'}", NULL);
    M2C("{'model':'C','max_tokens':9,'messages':[],'thinking':{'type':'enabled','budget_tokens':9000}}",
        "{'model':'up-model','messages':[],'max_tokens':9,'reasoning_effort':'high'}", NULL);
    M2C("{'model':'C','max_tokens':9,'messages':[],'thinking':{'type':'adaptive'},"
        "'output_config':{'effort':'high'}}",
        "{'model':'up-model','messages':[],'max_tokens':9,'reasoning_effort':'high'}", NULL);
    xlg(XL_MESSAGES, XL_CHAT, 0,
        "{'model':'C','max_tokens':9,'messages':[],'thinking':{'type':'enabled','budget_tokens':2000}}",
        "{'model':'up-model','messages':[],'max_tokens':9}", NULL, "/thinking");
    /* structured output, both spellings; sampling kept, top_k dropped */
    M2C("{'model':'C','max_tokens':9,'messages':[],'output_format':{'type':'json_schema','schema':"
        "{'type':'object'}},'temperature':0.5,'top_p':0.9,'top_k':3}",
        "{'model':'up-model','messages':[],'max_tokens':9,'temperature':0.5,'top_p':0.9,"
        "'response_format':{'type':'json_schema','json_schema':{'name':'output','schema':{'type':"
        "'object'}}}}", "/top_k");
    /* hints dropped and named; what only Anthropic runs refused */
    M2C("{'model':'C','max_tokens':9,'messages':[],'context_management':{},'service_tier':'auto',"
        "'inference_geo':'us'}",
        "{'model':'up-model','messages':[],'max_tokens':9}",
        "/context_management,/service_tier,/inference_geo");
    M2C_NO("{'model':'C','max_tokens':9,'messages':[],'container':'c1'}", "/container");
    M2C_NO("{'model':'C','max_tokens':9,'messages':[],'tools':[{'type':'web_search_20250305',"
           "'name':'web_search'},{'name':'f','input_schema':{}}]}", "/tools/0/type");
    M2C_NO("{'model':'C','max_tokens':9,'messages':[{'role':'robot','content':'x'}]}",
           "/messages/0/content");
    /* a tool_use without its name (the fuzzer's: the name was read from beyond the body) */
    M2C_NO("{'model':'C','max_tokens':9,'messages':[{'role':'assistant','content':[{'type':"
           "'tool_use','id':'t1','name!':'f','input':{}}]}]}", "/messages/0/content/0");
}

/* Every row of the mapping tables, chat -> Messages (the note's 1b). */
#define R2C(in, want, dropped) xlg(XL_RESPONSES, XL_CHAT, 1, in, want, NULL, dropped)
#define R2C_NO(in, param) xlg(XL_RESPONSES, XL_CHAT, 1, in, NULL, param, NULL)
#define R2C_TOOL_PARAMS "{'type':'object','properties':{'input':{'type':'string','description':" \
                        "'the whole input of the tool, as free-form text'}},'required':['input']," \
                        "'additionalProperties':false}"

/* The rows of Responses -> chat (note 1c): instructions, input as a string or items, calls
 * merged with the text before them (DeepSeek: codex#22129), an output without its call as user
 * text (Bifrost), custom tools as a function of one string (apply_patch: 9router#1371),
 * reasoning dropped, built-ins and stored state refused. */
static void test_xl_r2c_rows(void) {
    R2C("{'model':'G','instructions':'be brief','input':'hi','max_output_tokens':100,'store':true}",
        "{'model':'up-model','messages':[{'role':'system','content':'be brief'},{'role':'user',"
        "'content':'hi'}],'max_tokens':100}", NULL);
    R2C("{'model':'G','input':[{'type':'message','role':'developer','content':[{'type':'input_text',"
        "'text':'rules'}]},{'role':'user','content':[{'type':'input_text','text':'a'},{'type':"
        "'input_text','text':'b'}]},{'type':'reasoning','id':'rs_1','summary':[]},{'type':'message',"
        "'role':'assistant','content':[{'type':'output_text','text':'let me look'}]},{'type':"
        "'function_call','call_id':'c1','name':'shell','arguments':'{\\'cmd\\':\\'ls\\'}'},{'type':"
        "'function_call','call_id':'c2','name':'shell','arguments':'{}'},{'type':"
        "'function_call_output','call_id':'c1','output':'a.txt'},{'type':'function_call_output',"
        "'call_id':'c2','output':[{'type':'input_text','text':'b'}]}]}",
        "{'model':'up-model','messages':[{'role':'system','content':'rules'},{'role':'user','content':"
        "'a\\nb'},{'role':'assistant','content':'let me look','tool_calls':[{'id':'c1','type':"
        "'function','function':{'name':'shell','arguments':'{\\'cmd\\':\\'ls\\'}'}},{'id':'c2',"
        "'type':'function','function':{'name':'shell','arguments':'{}'}}]},{'role':'tool',"
        "'tool_call_id':'c1','content':'a.txt'},{'role':'tool','tool_call_id':'c2','content':'b'}]}",
        "/input/2");
    R2C("{'model':'G','input':[{'role':'user','content':'go'},{'type':'function_call_output',"
        "'call_id':'gone','output':'x'}]}",
        "{'model':'up-model','messages':[{'role':'user','content':'go'},{'role':'user','content':"
        "'The result of tool call gone:\\nx'}]}", NULL);
    R2C("{'model':'G','input':[{'role':'user','content':'edit'},{'type':'custom_tool_call','call_id':"
        "'p1','name':'apply_patch','input':'*** Begin Patch\\n'},{'type':'custom_tool_call_output',"
        "'call_id':'p1','output':'ok'}],'tools':[{'type':'custom','name':'apply_patch','description':"
        "'Edit files.','format':{'type':'grammar','syntax':'lark','definition':'start: x'}},{'type':"
        "'function','name':'shell','parameters':{'type':'object'},'strict':false}],'tool_choice':"
        "{'type':'custom','name':'apply_patch'},'parallel_tool_calls':false}",
        "{'model':'up-model','messages':[{'role':'user','content':'edit'},{'role':'assistant',"
        "'content':null,'tool_calls':[{'id':'p1','type':'function','function':{'name':'apply_patch',"
        "'arguments':'{\\'input\\':\\'*** Begin Patch\\\\n\\'}'}}]},{'role':'tool','tool_call_id':"
        "'p1','content':'ok'}],'tools':[{'type':'function','function':{'name':'apply_patch',"
        "'description':'Edit files.\\n\\nThe input follows this lark grammar:\\nstart: x',"
        "'parameters':" R2C_TOOL_PARAMS "}},{'type':'function','function':{'name':'shell',"
        "'parameters':{'type':'object'},'strict':false}}],'tool_choice':{'type':'function',"
        "'function':{'name':'apply_patch'}},'parallel_tool_calls':false}", NULL);
    R2C("{'model':'G','input':'x','text':{'format':{'type':'json_schema','name':'out','schema':"
        "{'type':'object'},'strict':true},'verbosity':'low'},'reasoning':{'effort':'high','summary':"
        "'auto'},'temperature':0.5,'top_p':0.9,'user':'u','include':['reasoning.encrypted_content'],"
        "'previous_response_id':null}",
        "{'model':'up-model','messages':[{'role':'user','content':'x'}],'temperature':0.5,'top_p':0.9,"
        "'user':'u','response_format':{'type':'json_schema','json_schema':{'name':'out','schema':"
        "{'type':'object'},'strict':true}},'reasoning_effort':'high'}",
        "/include,/text/verbosity,/reasoning/summary");
    R2C("{'model':'G','input':[{'role':'user','content':[{'type':'input_text','text':'see'},{'type':"
        "'input_image','image_url':'https://x/a.png','detail':'low'}]}]}",
        "{'model':'up-model','messages':[{'role':'user','content':[{'type':'text','text':'see'},"
        "{'type':'image_url','image_url':{'url':'https://x/a.png','detail':'low'}}]}]}", NULL);
    R2C_NO("{'model':'G','input':'x','tools':[{'type':'file_search','vector_store_ids':['v']}]}",
           "/tools/0/type");
    /* Codex's defaults: web_search and tool_search dropped (a list left empty is none), a
     * namespace's tools each NS__name, and a namespaced call in the history named so */
    R2C("{'model':'G','input':'x','tools':[{'type':'web_search','external_web_access':false},"
        "{'type':'tool_search','execution':'client'}],'tool_choice':'auto'}",
        "{'model':'up-model','messages':[{'role':'user','content':'x'}]}", "/tools/0,/tools/1");
    R2C("{'model':'G','input':[{'role':'user','content':'x'},{'type':'function_call','call_id':'c1',"
        "'namespace':'multi_agent_v1','name':'close_agent','arguments':'{}'},{'type':"
        "'function_call_output','call_id':'c1','output':'done'}],'tools':[{'type':'namespace','name':"
        "'multi_agent_v1','description':'Sub-agents.','tools':[{'type':'function','name':"
        "'close_agent','parameters':{'type':'object'}}]},{'type':'web_search'}]}",
        "{'model':'up-model','messages':[{'role':'user','content':'x'},{'role':'assistant','content':"
        "null,'tool_calls':[{'id':'c1','type':'function','function':{'name':"
        "'multi_agent_v1__close_agent','arguments':'{}'}}]},{'role':'tool','tool_call_id':'c1',"
        "'content':'done'}],'tools':[{'type':'function','function':{'name':"
        "'multi_agent_v1__close_agent','parameters':{'type':'object'}}}]}", "/tools/1");
    R2C_NO("{'model':'G','input':'x','tools':[{'type':'namespace','name':'n'}]}", "/tools/0/type");
    R2C_NO("{'model':'G','input':'x','previous_response_id':'resp_1'}", "/previous_response_id");
    R2C("{'model':'G','input':'x','stream':true}",
        "{'model':'up-model','messages':[{'role':'user','content':'x'}],'stream':true,"
        "'stream_options':{'include_usage':true}}", NULL);
    R2C_NO("{'model':'G','input':[{'role':'user','content':[{'type':'input_image','file_id':'f1'}]}]}",
           "/input/0/content/0");
    R2C_NO("{'model':'G','input':[{'type':'web_search_call','id':'ws'}]}", "/input/0");
    R2C_NO("{'model':'G','input':[{'type':'item_reference','id':'msg_1'}]}", "/input/0");
    R2C_NO("{'model':'G','input':'x','tool_choice':{'type':'allowed_tools'},'tools':[{'type':"
           "'function','name':'f'}]}", "/tool_choice");
    R2C_NO("{'model':'G','input':'x','nonsense':1}", "/nonsense");
    /* Responses -> Messages, through chat's form: Codex on Claude */
    xlg(XL_RESPONSES, XL_MESSAGES, 1,
        "{'model':'G','instructions':'be brief','input':[{'role':'user','content':'hi'},{'type':"
        "'function_call','call_id':'c1','name':'shell','arguments':'{\\'cmd\\':1}'},{'type':"
        "'function_call_output','call_id':'c1','output':'ok'}],'tools':[{'type':'function','name':"
        "'shell','parameters':{'type':'object'}}],'max_output_tokens':100,'temperature':0.5}",
        "{'model':'up-model','messages':[{'role':'user','content':'hi'},{'role':'assistant',"
        "'content':[{'type':'tool_use','id':'c1','name':'shell','input':{'cmd':1}}]},{'role':'user',"
        "'content':[{'type':'tool_result','tool_use_id':'c1','content':'ok'}]}],'system':"
        "'be brief','tools':[{'name':'shell','input_schema':{'type':'object'}}],'max_tokens':100,"
        "'temperature':0.5}", NULL, NULL);
    xlg(XL_RESPONSES, XL_MESSAGES, 1, "{'model':'G','input':'x','temperature':1.5}", NULL,
        "/temperature", NULL);
    R2C_NO("{'model':'G'}", "/input");
}

static void test_xl_c2m_rows(void) {
    /* blank text skipped (BiFangKNT/mtga#68); an empty assistant turn is not sent empty
     * (envoy#2191) */
    C2M("{'model':'G','messages':[{'role':'user','content':[{'type':'text','text':' '},{'type':"
        "'text','text':'x'}]},{'role':'assistant','content':''},{'role':'user','content':'y'}]}",
        "{'model':'up-model','messages':[{'role':'user','content':[{'type':'text','text':'x'}]},"
        "{'role':'assistant','content':[{'type':'text','text':'(empty)'}]},{'role':'user',"
        "'content':'y'}],'max_tokens':8000}", NULL);
    /* system and developer messages hoisted in order, never overwriting each other (envoy#2488);
     * "system" follows the turns, found as they are walked */
    C2M("{'model':'G','messages':[{'role':'system','content':'a'},{'role':'developer','content':"
        "[{'type':'text','text':'b'}]},{'role':'user','content':'q'}]}",
        "{'model':'up-model','messages':[{'role':'user','content':'q'}],'system':[{'type':'text',"
        "'text':'a'},{'type':'text','text':'b'}],'max_tokens':8000}", NULL);
    /* a string stays a string; a single system message of blocks stays blocks, and an
     * assistant's text with its tool calls is blocks */
    C2M("{'model':'G','messages':[{'role':'system','content':[{'type':'text','text':'s'}]},{'role':"
        "'user','content':'q'},{'role':'assistant','content':'t','tool_calls':[{'id':'c1','type':"
        "'function','function':{'name':'f','arguments':'{}'}}]},{'role':'tool','tool_call_id':"
        "'c1','content':'r'}]}",
        "{'model':'up-model','messages':[{'role':'user','content':'q'},{'role':'assistant',"
        "'content':[{'type':'text','text':'t'},{'type':'tool_use','id':'c1','name':'f','input':"
        "{}}]},{'role':'user','content':[{'type':'tool_result','tool_use_id':'c1','content':'r'}]}],"
        "'system':[{'type':'text','text':'s'}],'max_tokens':8000}", NULL);
    /* a file with its data is a document; a file id cannot be carried */
    C2M("{'model':'G','messages':[{'role':'user','content':[{'type':'file','file':{'filename':"
        "'a.pdf','file_data':'data:application/pdf;base64,QQ=='}}]}]}",
        "{'model':'up-model','messages':[{'role':'user','content':[{'type':'document','source':"
        "{'type':'base64','media_type':'application/pdf','data':'QQ=='}}]}],'max_tokens':8000}",
        NULL);
    C2M_NO("{'model':'G','messages':[{'role':'user','content':[{'type':'file','file':{'file_id':"
           "'file-1'}}]}]}", "/messages/0/content/0");
    /* a tool without parameters gets an empty object schema; strict passes (envoy#2232) */
    C2M("{'model':'G','messages':[],'tools':[{'type':'function','function':{'name':'f','strict':"
        "true}}],'tool_choice':'required'}",
        "{'model':'up-model','messages':[],'tools':[{'name':'f','input_schema':{'type':'object',"
        "'properties':{}},'strict':true}],'tool_choice':{'type':'any'},'max_tokens':8000}", NULL);
    /* parallel_tool_calls false without a choice: auto, one call at a time */
    C2M("{'model':'G','messages':[],'tools':[{'type':'function','function':{'name':'f',"
        "'parameters':{'type':'object'}}}],'parallel_tool_calls':false}",
        "{'model':'up-model','messages':[],'tools':[{'name':'f','input_schema':{'type':'object'}}],"
        "'tool_choice':{'type':'auto','disable_parallel_tool_use':true},'max_tokens':8000}", NULL);
    C2M_NO("{'model':'G','messages':[],'tools':[{'type':'custom','custom':{'name':'g'}}]}",
           "/tools/0/type");
    /* stops: an array kept, a blank one refused (Anthropic refuses it) */
    C2M("{'model':'G','messages':[],'stop':['a','b']}",
        "{'model':'up-model','messages':[],'max_tokens':8000,'stop_sequences':['a','b']}", NULL);
    C2M_NO("{'model':'G','messages':[],'stop':['a',' ']}", "/stop");
    /* the output limit: max_completion_tokens first */
    C2M("{'model':'G','messages':[],'max_completion_tokens':50,'max_tokens':9}",
        "{'model':'up-model','messages':[],'max_tokens':50}", NULL);
    /* reasoning effort as a budget: low 1024; high capped below max_tokens; too small a limit
     * refused; none asks for nothing */
    C2M("{'model':'G','messages':[],'reasoning_effort':'low'}",
        "{'model':'up-model','messages':[],'max_tokens':8000,'thinking':{'type':'enabled',"
        "'budget_tokens':1024}}", NULL);
    C2M("{'model':'G','messages':[],'max_tokens':3000,'reasoning_effort':'high'}",
        "{'model':'up-model','messages':[],'max_tokens':3000,'thinking':{'type':'enabled',"
        "'budget_tokens':2999}}", NULL);
    C2M_NO("{'model':'G','messages':[],'max_tokens':1000,'reasoning_effort':'low'}",
           "/reasoning_effort");
    C2M("{'model':'G','messages':[],'reasoning_effort':'none'}",
        "{'model':'up-model','messages':[],'max_tokens':8000}", NULL);
    /* structured output; json_object has no Anthropic equivalent */
    C2M("{'model':'G','messages':[],'response_format':{'type':'json_schema','json_schema':"
        "{'name':'n','schema':{'type':'object'}}}}",
        "{'model':'up-model','messages':[],'max_tokens':8000,'output_config':{'format':{'type':"
        "'json_schema','schema':{'type':'object'}}}}", NULL);
    C2M_NO("{'model':'G','messages':[],'response_format':{'type':'json_object'}}",
           "/response_format");
    /* reasoning in the history is not replayed (a foreign thinking block fails Anthropic's
     * signature check: claude-code-hub#518) */
    C2M("{'model':'G','messages':[{'role':'user','content':'q'},{'role':'assistant','content':'a',"
        "'reasoning_content':'hm'},{'role':'user','content':'r'}]}",
        "{'model':'up-model','messages':[{'role':'user','content':'q'},{'role':'assistant',"
        "'content':'a'},{'role':'user','content':'r'}],'max_tokens':8000}",
        "/messages/1/reasoning_content");
    /* what Anthropic has no place for, refused; the hints dropped and named */
    static const char *const refused[] = {"audio", "modalities", "prediction", "web_search_options",
                                          "functions", "function_call", "top_logprobs"};
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        char in[160], ptr[40];
        snprintf(in, sizeof in, "{'model':'G','messages':[],'%s':{'x':1}}", refused[i]);
        snprintf(ptr, sizeof ptr, "/%s", refused[i]);
        C2M_NO(in, ptr);
    }
    C2M("{'model':'G','messages':[],'frequency_penalty':1,'presence_penalty':1,'logit_bias':{},"
        "'metadata':{},'store':true,'service_tier':'auto','seed':1}",
        "{'model':'up-model','messages':[],'max_tokens':8000}",
        "/frequency_penalty,/presence_penalty,/logit_bias,/metadata,/store,/service_tier,/seed");
}

/* One whole answer translated: each of `has` (|-separated, ' for ") in it, none of `hasnt`. */
static void xla(xl_api from, xl_api client, const long long u[NTOK], const char *in,
                const char *has, const char *hasnt) {
    buf out = {0};
    const char *why = NULL;
    char *i = sq(in), *h = sq(has), *n = sq(hasnt);
    const char *req = "{'tools':[{'name':'mcp__a_very_long_server_name__and_a_very_long_tool_name_too_long_x'}]}";
    char *r = sq(req);
    CHECK(xl_answer(from, client, i, strlen(i), r, strlen(r), "req_unit", u, &out, &why) == 0 && out.p,
          "%s: %s", i, why ? why : "");
    for (char *w = strtok(h, "|"); w && out.p; w = strtok(NULL, "|"))
        CHECK(strstr(out.p, w), "%s\n  lacks %s\n  got %s", i, w, out.p);
    for (char *w = strtok(n, "|"); w && out.p; w = strtok(NULL, "|"))
        CHECK(!strstr(out.p, w), "%s\n  has %s\n  got %s", i, w, out.p);
    free(i), free(h), free(n), free(r);
    buf_free(&out);
}

/* Answers both ways (the note's 2): every stop reason, content, usage in the client's terms,
 * ids. */
static void test_xl_answers(void) {
    long long u[NTOK] = {[TOK_IN] = 20, [TOK_CACHE_READ] = 5, [TOK_CACHE_WRITE] = 3, [TOK_OUT] = 7};
    /* every stop reason, each way (a chat tool_calls or function_call without a call: end_turn) */
    static const struct { xl_api from; const char *said, *want; } stops[] = {
        {XL_MESSAGES, "end_turn", "stop"}, {XL_MESSAGES, "stop_sequence", "stop"},
        {XL_MESSAGES, "pause_turn", "stop"}, {XL_MESSAGES, "max_tokens", "length"},
        {XL_MESSAGES, "model_context_window_exceeded", "length"},
        {XL_MESSAGES, "refusal", "content_filter"}, {XL_CHAT, "stop", "end_turn"},
        {XL_CHAT, "length", "max_tokens"}, {XL_CHAT, "content_filter", "refusal"},
        {XL_CHAT, "function_call", "end_turn"}, {XL_CHAT, "tool_calls", "end_turn"},
    };
    for (size_t i = 0; i < sizeof stops / sizeof *stops; i++) {
        char in[300], want[80];
        int m = stops[i].from == XL_MESSAGES;
        snprintf(in, sizeof in, m ? "{'id':'m1','model':'c','content':[{'type':'text','text':'a'}],"
                                    "'stop_reason':'%s'}"
                                  : "{'id':'c1','model':'g','choices':[{'index':0,'message':{"
                                    "'role':'assistant','content':'a'},'finish_reason':'%s'}]}",
                 stops[i].said);
        snprintf(want, sizeof want, m ? "'finish_reason':'%s'" : "'stop_reason':'%s'",
                 stops[i].want);
        xla(stops[i].from, m ? XL_CHAT : XL_MESSAGES, u, in, want, NULL);
    }
    /* Anthropic -> chat: text blocks joined, thinking as reasoning_content, redacted thinking
     * dropped, a tool_use as tool_calls (whatever the stop reason), its hashed name the
     * client's own; usage inclusive, the cache writes beside it; the id chatcmpl-<its> */
    xla(XL_MESSAGES, XL_CHAT, u,
        "{'id':'m1','model':'c','content':[{'type':'redacted_thinking','data':'zz'},{'type':"
        "'thinking','thinking':'hm','signature':'s'},{'type':'text','text':'a'},{'type':'text',"
        "'text':'b'},{'type':'tool_use','id':'toolu_1','name':"
        "'mcp__a_very_long_server_name__and_a_very_long_tool_name_abfb628c','input':{'x':1}}],"
        "'stop_reason':'end_turn'}",
        "'id':'chatcmpl-m1'|'content':'ab'|'reasoning_content':'hm'|'finish_reason':'tool_calls'|"
        "'tool_calls':[{'id':'toolu_1','type':'function','function':{'name':"
        "'mcp__a_very_long_server_name__and_a_very_long_tool_name_abfb628c','arguments':"
        "'{\\'x\\':1}'}}]|'prompt_tokens':20,'completion_tokens':7|'cached_tokens':5|"
        "'cache_creation_input_tokens':3",
        "zz|'s'");
    /* Anthropic -> Responses (Codex on Claude), through chat's form */
    xla(XL_MESSAGES, XL_RESPONSES, u,
        "{'id':'m1','model':'c','content':[{'type':'text','text':'ok'},{'type':'tool_use','id':"
        "'toolu_1','name':'shell','input':{'cmd':1}}],'stop_reason':'tool_use'}",
        "'id':'resp_req_unit','object':'response'|'status':'completed'|'model':'c'|'type':"
        "'output_text','text':'ok'|'type':'function_call'|'call_id':'toolu_1','name':'shell',"
        "'arguments':'{\\'cmd\\':1}'|'input_tokens':20,'input_tokens_details':{'cached_tokens':5}",
        NULL);
    /* one text block is written as it is, escapes and all; a text that is not a string is none */
    xla(XL_MESSAGES, XL_CHAT, u,
        "{'id':'m1','model':'c','content':[{'type':'text','text':'say \\'hi\\''},{'type':'text',"
        "'text':1}],'stop_reason':'end_turn'}",
        "'content':'say \\'hi\\''}|'finish_reason':'stop'", NULL);
    /* chat -> Anthropic: blocks thinking-less, text then tool_use; a tool call ends with
     * tool_use whatever was said (GLM's stop: weave-os/router#250, bifrost#6123); an id
     * Anthropic refuses mapped; usage exclusive; the name mapped back to the client's */
    xla(XL_CHAT, XL_MESSAGES, u,
        "{'id':'c1','model':'g','choices':[{'index':0,'message':{'role':'assistant','content':'ok',"
        "'reasoning_content':'hm','tool_calls':[{'id':'functions.Bash:0','type':'function',"
        "'function':{'name':'mcp__a_very_long_server_name__and_a_very_long_tool_name_abfb628c',"
        "'arguments':''}}]},'finish_reason':'stop'}]}",
        "'id':'msg_c1'|'content':[{'type':'text','text':'ok'},{'type':'tool_use','id':"
        "'functions_Bash_0_a97d1507','name':"
        "'mcp__a_very_long_server_name__and_a_very_long_tool_name_too_long_x','input':{}}]|"
        "'stop_reason':'tool_use'|'input_tokens':12,'cache_creation_input_tokens':3,"
        "'cache_read_input_tokens':5,'output_tokens':7",
        "hm");
    /* chat -> Responses: the id minted from the request's, the text a message item, a call a
     * function_call, a custom tool's call a custom_tool_call with its input (apply_patch kept
     * whole); usage inclusive; a length stop incomplete */
    {
        buf ro = {0};
        const char *rwhy = NULL;
        char *ra = sq("{'id':'c1','model':'g','choices':[{'index':0,'message':{'role':'assistant',"
                      "'content':'ok','reasoning_content':'hm','tool_calls':[{'id':'call_1','type':"
                      "'function','function':{'name':'shell','arguments':'{\\'cmd\\':1}'}},{'id':"
                      "'call_2','type':'function','function':{'name':'apply_patch','arguments':"
                      "'{\\'input\\':\\'*** Begin Patch\\\\n\\'}'}},{'id':'call_3','type':"
                      "'function','function':{'name':'ns__f','arguments':'{}'}}]},'finish_reason':"
                      "'length'}]}");
        char *rq = sq("{'tools':[{'type':'function','name':'shell'},{'type':'custom','name':"
                      "'apply_patch'},{'type':'namespace','name':'ns','tools':[{'type':'function',"
                      "'name':'f'}]}]}");
        CHECK(xl_answer(XL_CHAT, XL_RESPONSES, ra, strlen(ra), rq, strlen(rq), "req_9", u, &ro,
                        &rwhy) == 0 && ro.p, "chat -> Responses");
        char *want = sq("{'id':'resp_req_9','object':'response','created_at':|'status':'incomplete',"
                        "'incomplete_details':{'reason':'max_output_tokens'},'model':'g','output':["
                        "{'type':'reasoning','id':'rs_req_9','summary':[{'type':'summary_text','text':"
                        "'hm'}]},{'type':'message','id':'msg_req_9','status':'completed','role':"
                        "'assistant','content':[{'type':'output_text','text':'ok','annotations':[]}]},"
                        "{'type':'function_call','id':'fc_req_9_0','call_id':'call_1','name':'shell',"
                        "'arguments':'{\\'cmd\\':1}','status':'completed'},{'type':'custom_tool_call',"
                        "'id':'ctc_req_9_1','call_id':'call_2','name':'apply_patch','input':"
                        "'*** Begin Patch\\n','status':'completed'},{'type':'function_call','id':"
                        "'fc_req_9_2','call_id':'call_3','name':'f','namespace':'ns','arguments':"
                        "'{}','status':'completed'}],'store':false,'usage':{"
                        "'input_tokens':20,'input_tokens_details':{'cached_tokens':5},'output_tokens':7,"
                        "'output_tokens_details':{'reasoning_tokens':0},'total_tokens':27}}");
        char *cut = strchr(want, '|'); /* the time between */
        *cut = 0;
        size_t rest = strlen(cut + 1);
        CHECK(ro.p && strncmp(ro.p, want, strlen(want)) == 0 && ro.len > rest &&
              strcmp(ro.p + ro.len - rest, cut + 1) == 0, "chat -> Responses:\n  got  %s",
              ro.p ? ro.p : "");
        free(ra), free(rq), free(want);
        buf_free(&ro);
    }
    /* a tool call whose arguments are not an object cannot become Anthropic's input */
    buf out = {0};
    const char *why = NULL;
    char *bad = sq("{'id':'c1','choices':[{'message':{'tool_calls':[{'id':'a','function':"
                   "{'name':'f','arguments':'[1]'}}]}}]}");
    CHECK(xl_answer(XL_CHAT, XL_MESSAGES, bad, strlen(bad), "{}", 2, "req_unit", u, &out, &why) < 0 && why,
          "arguments [1] carried");
    free(bad);
    buf_free(&out);
}

/* A provider's error in the client's shape: the message kept (a text body's first line; an
 * array-wrapped one), the status mapped. */
static void test_xl_errors(void) {
    static const struct { xl_api client; int status; const char *body, *has; int to; } e[] = {
        {XL_MESSAGES, 400, "Bad request body\nmore", "'message':'Bad request body'", 400},
        {XL_MESSAGES, 503, "{'error':{'message':'busy','type':'server_error'}}",
         "'type':'overloaded_error','message':'busy'", 529},
        {XL_MESSAGES, 429, "{'error':{'message':'q','type':'insufficient_quota','code':"
         "'insufficient_quota'}}", "'type':'billing_error'", 402},
        {XL_CHAT, 529, "{'type':'error','error':{'type':'overloaded_error','message':'Overloaded'}}",
         "'message':'Overloaded'", 503},
        {XL_CHAT, 402, "{'type':'error','error':{'type':'billing_error','message':'pay'}}",
         "'type':'insufficient_quota','param':null,'code':'insufficient_quota'", 429},
        {XL_CHAT, 400, "[{'error':{'code':400,'message':'bad','status':'INVALID_ARGUMENT'}}]",
         "'message':'bad'", 400},
    };
    for (size_t i = 0; i < sizeof e / sizeof *e; i++) {
        buf out = {0};
        char *b = sq(e[i].body), *h = sq(e[i].has);
        int to = xl_error(e[i].client, e[i].status, b, strlen(b), &out);
        CHECK(to == e[i].to && out.p && strstr(out.p, h), "case %zu: %d %s", i, to,
              out.p ? out.p : "");
        free(b), free(h);
        buf_free(&out);
    }
}

static int xl_run(xl_stream *xs, const char *const *evs, buf *all) {
    long long u[NTOK] = {[TOK_IN] = 20, [TOK_CACHE_READ] = 5, [TOK_OUT] = 7};
    buf data = {0}, out = {0};
    const char *why = NULL;
    int r = 0;
    for (int i = 0; evs[i] && r == 0; i++) {
        sse_event_data(evs[i], strlen(evs[i]), &data);
        out.len = 0;
        r = xl_feed(xs, evs[i], strlen(evs[i]), &data, u, &out, &why);
        if (out.len) buf_append(all, out.p, out.len);
    }
    if (r == 0) {
        out.len = 0;
        r = xl_feed_end(xs, u, &out, &why);
        if (out.len) buf_append(all, out.p, out.len);
    }
    buf_free(&data);
    buf_free(&out);
    return r;
}

static void test_xl_streams(void) {
    /* chat -> Anthropic: two parallel calls, fragments interleaved (one chunk carries both), a
     * finish of "stop" with tools (GLM's), then usage and [DONE] */
    static const char *const chat[] = {
        "data: {\"id\":\"c1\",\"model\":\"glm\",\"choices\":[{\"index\":0,\"delta\":{\"role\":"
        "\"assistant\",\"content\":null}}]}\n\n",
        ": keep-alive\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":"
        "\"call_a\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"\"}}]}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":"
        "\"call_b\",\"type\":\"function\",\"function\":{\"name\":\"g\",\"arguments\":\"{\\\"y\"}}]}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,"
        "\"function\":{\"arguments\":\"{\\\"x\\\":\"}},{\"index\":1,\"function\":{\"arguments\":"
        "\"\\\":2}\"}}]}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,"
        "\"function\":{\"arguments\":\"1}\"}}]}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":20}}\n\n",
        "data: [DONE]\n\n", NULL};
    buf all = {0};
    xl_stream *xs = xl_stream_new(XL_CHAT, XL_MESSAGES, 0, 99, "{}", 2);
    CHECK(xl_run(xs, chat, &all) == 1, "the stream is whole");
    const char *want =
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_c1\","
        "\"type\":\"message\",\"role\":\"assistant\",\"model\":\"glm\",\"content\":[],\"stop_reason\":"
        "null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":99,\"cache_creation_input_tokens\":0,"
        "\"cache_read_input_tokens\":0,\"output_tokens\":1}}}\n\n"
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,"
        "\"content_block\":{\"type\":\"tool_use\",\"id\":\"call_a\",\"name\":\"f\",\"input\":{}}}\n\n"
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":"
        "{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"x\\\":\"}}\n\n"
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":"
        "{\"type\":\"input_json_delta\",\"partial_json\":\"1}\"}}\n\n"
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n"
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,"
        "\"content_block\":{\"type\":\"tool_use\",\"id\":\"call_b\",\"name\":\"g\",\"input\":{}}}\n\n"
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":"
        "{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"y\\\":2}\"}}\n\n"
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":1}\n\n"
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":"
        "\"tool_use\",\"stop_sequence\":null},\"usage\":{\"input_tokens\":15,"
        "\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":5,\"output_tokens\":7}}\n\n"
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
    CHECK(all.p && strcmp(all.p, want) == 0, "chat -> messages:\n%s", all.p ? all.p : "");
    xl_stream_free(xs);
    /* Anthropic -> chat: thinking, text, a tool call, a ping; the usage chunk asked for */
    static const char *const anth[] = {
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m1\",\"model\":"
        "\"claude\",\"usage\":{\"input_tokens\":3}}}\n\n",
        "event: ping\ndata: {\"type\":\"ping\"}\n\n",
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,"
        "\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":"
        "{\"type\":\"thinking_delta\",\"thinking\":\"hm\"}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":"
        "{\"type\":\"signature_delta\",\"signature\":\"sig\"}}\n\n",
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,"
        "\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"Bash\",\"input\":{}}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":"
        "{\"type\":\"input_json_delta\",\"partial_json\":\"{}\"}}\n\n",
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":1}\n\n",
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":"
        "\"tool_use\"},\"usage\":{\"output_tokens\":7}}\n\n",
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n", NULL};
    all.len = 0;
    xs = xl_stream_new(XL_MESSAGES, XL_CHAT, 1, 99, "{}", 2);
    CHECK(xl_run(xs, anth, &all) == 1, "the stream is whole");
    CHECK(all.p && strncmp(all.p, "data: {\"id\":\"chatcmpl-m1\"", 25) == 0, "the first chunk: %.80s",
          all.p ? all.p : "");
    CHECK(strstr(all.p, "\"delta\":{\"role\":\"assistant\",\"reasoning_content\":\"hm\"}") &&
          strstr(all.p, "\"tool_calls\":[{\"index\":0,\"id\":\"toolu_1\",\"type\":\"function\","
                        "\"function\":{\"name\":\"Bash\",\"arguments\":\"\"}}]") &&
          strstr(all.p, "\"finish_reason\":\"tool_calls\"") &&
          strstr(all.p, "\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":7") &&
          !strstr(all.p, "sig") && strcmp(all.p + all.len - 14, "data: [DONE]\n\n") == 0,
          "messages -> chat:\n%s", all.p);
    xl_stream_free(xs);
    /* cut before the end: an error, never a whole stream */
    static const char *const cut[] = {chat[0], chat[2], NULL};
    all.len = 0;
    xs = xl_stream_new(XL_CHAT, XL_MESSAGES, 0, 99, "{}", 2);
    CHECK(xl_run(xs, cut, &all) < 0, "a cut stream is not whole");
    xl_stream_free(xs);
    buf_free(&all);
}

/* A stream of events written with ' for ", translated whole: its output, and xl_run's verdict. */
static int xls(xl_api from, xl_api client, int include_usage, const char *const *evs, buf *all) {
    const char *v[16];
    char *c[16];
    int n = 0;
    for (; evs[n] && n < 15; n++) v[n] = c[n] = sq(evs[n]);
    v[n] = NULL;
    xl_stream *xs = xl_stream_new(from, client, include_usage, 99, "{}", 2);
    all->len = 0;
    int r = xl_run(xs, v, all);
    xl_stream_free(xs);
    for (int i = 0; i < n; i++) free(c[i]);
    return r;
}

/* Is each of the |-separated parts (' for ") in s, in this order? */
static int in_order(const char *s, const char *parts) {
    char *p = sq(parts), *at = (char *)s;
    int ok = 1;
    for (char *w = strtok(p, "|"); w && ok; w = strtok(NULL, "|")) {
        char *f = strstr(at, w);
        ok = f != NULL;
        if (f) at = f + strlen(w);
    }
    free(p);
    return ok;
}

/* chat -> Responses, streamed (note 3): one response id throughout, sequence numbers from 0
 * up, reasoning then text each an item (added, part, deltas, done with the whole text), the
 * calls whole at the end -- a function's arguments, apply_patch's input kept -- and
 * response.completed with every item and the usage (one byte at a time: integration_translate). */
static void test_xl_responses_stream(void) {
    static const char *const chat[] = {
        "data: {'id':'c1','model':'glm','choices':[{'index':0,'delta':{'role':'assistant',"
        "'reasoning_content':'hm '}}]}\n\n",
        "data: {'id':'c1','choices':[{'index':0,'delta':{'reasoning_content':'ok'}}]}\n\n",
        "data: {'id':'c1','choices':[{'index':0,'delta':{'content':'I will '}}]}\n\n",
        "data: {'id':'c1','choices':[{'index':0,'delta':{'content':'edit.'}}]}\n\n",
        ": keep-alive\n\n",
        "data: {'id':'c1','choices':[{'index':0,'delta':{'tool_calls':[{'index':0,'id':'call_a',"
        "'type':'function','function':{'name':'shell','arguments':'{\\'cmd'}},{'index':1,'id':"
        "'call_b','type':'function','function':{'name':'apply_patch','arguments':'{\\'input'}}]}}]}"
        "\n\n",
        "data: {'id':'c1','choices':[{'index':0,'delta':{'tool_calls':[{'index':1,'function':"
        "{'arguments':'\\':\\'*** Begin Patch\\\\n\\'}'}},{'index':0,'function':{'arguments':"
        "'\\':1}'}}]}}]}\n\n",
        "data: {'id':'c1','choices':[{'index':0,'delta':{},'finish_reason':'tool_calls'}]}\n\n",
        "data: {'id':'c1','choices':[],'usage':{'prompt_tokens':20}}\n\n",
        "data: [DONE]\n\n", NULL};
    const char *v[16];
    char *c[16], *req = sq("{'tools':[{'type':'function','name':'shell'},{'type':'custom','name':"
                           "'apply_patch'}]}");
    int n = 0;
    for (; chat[n]; n++) v[n] = c[n] = sq(chat[n]);
    v[n] = NULL;
    {
        buf all = {0};
        xl_stream *xs = xl_stream_new(XL_CHAT, XL_RESPONSES, 0, 99, req, strlen(req));
        snprintf(xs->rid, sizeof xs->rid, "req_7");
        CHECK(xl_run(xs, v, &all) == 1, "the stream is whole");
        CHECK(in_order(all.p ? all.p : "",
                       "event: response.created|'sequence_number':0,'response':{'id':'resp_req_7',"
                       "'object':'response'|'status':'in_progress'|event: response.in_progress|"
                       "'sequence_number':1,|event: response.output_item.added|'item':{'id':"
                       "'rs_req_7_0','type':'reasoning','summary':[]}|"
                       "event: response.reasoning_summary_part.added|"
                       "event: response.reasoning_summary_text.delta|'delta':'hm '|'delta':'ok'|"
                       "event: response.reasoning_summary_text.done|'text':'hm ok'|"
                       "event: response.reasoning_summary_part.done|event: response.output_item.done|"
                       "event: response.output_item.added|'id':'msg_req_7_1','type':'message',"
                       "'status':'in_progress'|event: response.content_part.added|"
                       "event: response.output_text.delta|'item_id':'msg_req_7_1','output_index':1,"
                       "'content_index':0,'delta':'I will '|'delta':'edit.'|"
                       "event: response.output_text.done|'text':'I will edit.'|"
                       "event: response.content_part.done|event: response.output_item.done|"
                       "'status':'completed','role':'assistant','content':[{'type':'output_text',"
                       "'text':'I will edit.','annotations':[]}]|"
                       "event: response.output_item.added|'id':'fc_req_7_2','type':'function_call',"
                       "'status':'in_progress','call_id':'call_a','name':'shell','arguments':''|"
                       "event: response.function_call_arguments.delta|"
                       "event: response.function_call_arguments.done|'arguments':'{\\'cmd\\':1}'|"
                       "event: response.output_item.done|event: response.output_item.added|"
                       "'id':'ctc_req_7_3','type':'custom_tool_call'|"
                       "event: response.custom_tool_call_input.delta|"
                       "event: response.custom_tool_call_input.done|'input':'*** Begin Patch\\n'|"
                       "event: response.output_item.done|event: response.completed|"
                       "'status':'completed'|'output':[{'id':'rs_req_7_0'|'id':'msg_req_7_1'|"
                       "'id':'fc_req_7_2'|'id':'ctc_req_7_3'|'usage':{'input_tokens':20,"
                       "'input_tokens_details':{'cached_tokens':5},'output_tokens':7"),
              "the events:\n%s", all.p ? all.p : "");
        /* sequence numbers 0, 1, 2... with no gap, one per event */
        int seq = 0, events = 0;
        for (const char *p = all.p; p && (p = strstr(p, "\"sequence_number\":")); p++, seq++) {
            CHECK(atoi(p + 18) == seq, "sequence_number %d where %d was due", atoi(p + 18), seq);
            if (atoi(p + 18) != seq) break;
        }
        for (const char *p = all.p; p && (p = strstr(p, "event: ")); p++) events++;
        CHECK(seq == events && seq > 20, "%d sequence numbers, %d events", seq, events);
        xl_stream_free(xs);
        buf_free(&all);
    }
    for (int i = 0; i < n; i++) free(c[i]);
    /* a length stop: response.incomplete with its reason */
    static const char *const cut[] = {
        "data: {'id':'c2','model':'glm','choices':[{'index':0,'delta':{'content':'abc'}}]}\n\n",
        "data: {'id':'c2','choices':[{'index':0,'delta':{},'finish_reason':'length'}]}\n\n",
        "data: [DONE]\n\n", NULL};
    for (n = 0; cut[n]; n++) v[n] = c[n] = sq(cut[n]);
    v[n] = NULL;
    buf all = {0};
    xl_stream *xs = xl_stream_new(XL_CHAT, XL_RESPONSES, 0, 99, req, strlen(req));
    CHECK(xl_run(xs, v, &all) == 1 &&
              in_order(all.p ? all.p : "", "event: response.output_text.done|'text':'abc'|"
                                           "event: response.incomplete|'status':'incomplete',"
                                           "'incomplete_details':{'reason':'max_output_tokens'}"),
          "a length stop:\n%s", all.p ? all.p : "");
    xl_stream_free(xs);
    buf_free(&all);
    for (int i = 0; i < n; i++) free(c[i]);
    free(req);
}

/* The stream steps of the note's 3, each in a stream of its own. */
static void test_xl_stream_rows(void) {
    buf all = {0};
    /* chat -> Anthropic: a role-only chunk is no content (the head waits: a failure still fails
     * over); arguments before the name are held, then sent inside the block; a call without
     * arguments says {}; a fragment keyed by index though its id is null (litellm#20711);
     * text closes the open call's block and opens the next index (the call held meanwhile
     * follows it: blocks never overlap, bifrost#3441); a finish without [DONE] ends it */
    static const char *const c1[] = {
        "data: {'id':'c','model':'g','choices':[{'index':0,'delta':{'role':'assistant'}}]}\n\n",
        NULL};
    CHECK(xls(XL_CHAT, XL_MESSAGES, 0, c1, &all) < 0 && all.len == 0,
          "a role-only chunk wrote %s", all.p ? all.p : "");
    static const char *const c2[] = {
        "data: {'id':'c','model':'g','choices':[{'index':0,'delta':{'tool_calls':[{'index':0,"
        "'function':{'arguments':'{\\'a\\''}}]}}]}\n\n",
        "data: {'id':'c','choices':[{'index':0,'delta':{'tool_calls':[{'index':0,'id':'k1',"
        "'function':{'name':'f','arguments':':1}'}}]}}]}\n\n",
        "data: {'id':'c','choices':[{'index':0,'delta':{'tool_calls':[{'index':1,'id':'k2',"
        "'function':{'name':'g'}}]}}]}\n\n",
        "data: {'id':'c','choices':[{'index':0,'delta':{'tool_calls':[{'index':1,'id':null,"
        "'function':{'arguments':''}}]}}]}\n\n",
        "data: {'id':'c','choices':[{'index':0,'delta':{'content':'done'}}]}\n\n",
        "data: {'id':'c','choices':[{'index':0,'delta':{},'finish_reason':'tool_calls'}]}\n\n",
        NULL};
    CHECK(xls(XL_CHAT, XL_MESSAGES, 0, c2, &all) == 1, "a finish without [DONE] is whole");
    CHECK(all.p && in_order(all.p, "event: message_start|'index':0,'content_block':{'type':'tool_use',"
                            "'id':'k1','name':'f','input':{}}|'partial_json':'{\\'a\\''|"
                            "'partial_json':':1}'|'content_block_stop','index':0|'index':1,"
                            "'content_block':{'type':'text'|'text':'done'|"
                            "'content_block_stop','index':1|'index':2,"
                            "'content_block':{'type':'tool_use','id':'k2','name':'g'|"
                            "'partial_json':'{}'|'content_block_stop','index':2|"
                            "'stop_reason':'tool_use'|event: message_stop"),
          "chat -> messages:\n%s", all.p ? all.p : "");
    /* Anthropic -> chat without the usage chunk asked for: none, but the finish and [DONE];
     * the first content chunk carries the role (agentgateway#3005), pings as comments */
    static const char *const a1[] = {
        "event: message_start\ndata: {'type':'message_start','message':{'id':'m','model':'c',"
        "'usage':{'input_tokens':3,'output_tokens':1}}}\n\n",
        "event: ping\ndata: {'type':'ping'}\n\n",
        "event: content_block_start\ndata: {'type':'content_block_start','index':0,"
        "'content_block':{'type':'text','text':''}}\n\n",
        "event: content_block_delta\ndata: {'type':'content_block_delta','index':0,'delta':"
        "{'type':'text_delta','text':'hi'}}\n\n",
        "event: ping\ndata: {'type':'ping'}\n\n",
        "event: content_block_stop\ndata: {'type':'content_block_stop','index':0}\n\n",
        "event: message_delta\ndata: {'type':'message_delta','delta':{'stop_reason':"
        "'max_tokens'},'usage':{'output_tokens':7}}\n\n",
        "event: message_stop\ndata: {'type':'message_stop'}\n\n", NULL};
    CHECK(xls(XL_MESSAGES, XL_CHAT, 0, a1, &all) == 1, "whole");
    CHECK(all.p && in_order(all.p, "'delta':{'role':'assistant','content':'hi'}|: ping|"
                            "'finish_reason':'length'|data: [DONE]") &&
              !strstr(all.p, "'choices':[]") && !strstr(all.p, "\"choices\":[]"),
          "messages -> chat:\n%s", all.p ? all.p : "");
    /* a delta for a block that never started (litellm#13373) is not a tool call's */
    static const char *const a2[] = {
        a1[0],
        "event: content_block_delta\ndata: {'type':'content_block_delta','index':3,'delta':"
        "{'type':'input_json_delta','partial_json':'{}'}}\n\n",
        a1[2], a1[3], a1[5], a1[6], a1[7], NULL};
    /* a delta whose text is not a string is no answer ltg can pass on (the fuzzer's) */
    static const char *const a3[] = {
        a1[0], a1[2],
        "event: content_block_delta\ndata: {'type':'content_block_delta','index':0,'delta':"
        "{'type':'text_delta','text':{'model':'C'}}}\n\n", NULL};
    CHECK(xls(XL_MESSAGES, XL_CHAT, 1, a3, &all) < 0, "a text object was passed on: %s",
          all.p ? all.p : "");
    CHECK(xls(XL_MESSAGES, XL_CHAT, 1, a2, &all) == 1 && all.p && !strstr(all.p, "tool_calls") &&
              strstr(all.p, "\"choices\":[],\"usage\":{\"prompt_tokens\":20"),
          "a stray delta:\n%s", all.p ? all.p : "");
    buf_free(&all);
}

#define T(fn) {#fn, fn}
static const struct { const char *name; void (*fn)(void); } TESTS[] = {
    T(test_json_reader), T(test_json_scan), T(test_json_writer), T(test_http_request), T(test_http_response),
    T(test_chunked), T(test_sse), T(test_resp), T(test_cl_event_bounds), T(test_config), T(test_dns), T(test_timers), T(test_plan),
    T(test_group_validation), T(test_ledger_pieces), T(test_log), T(test_log_failures), T(test_log_async), T(test_compaction_on_time),
    T(test_ledger_days), T(test_ledger_budgets_16m), T(test_ledger_budgets_16k), T(test_ledger_chunks),
    T(test_ledger_migration), T(test_ledger_extremes), T(test_sha256), T(test_exchange_fake),
    T(test_jv), T(test_xl_ptr), T(test_xl_requests), T(test_xl_m2c_rows), T(test_xl_c2m_rows), T(test_xl_r2c_rows), T(test_xl_answers), T(test_xl_errors), T(test_xl_streams), T(test_xl_responses_stream), T(test_xl_stream_rows),
};
#define NTESTS (sizeof TESTS / sizeof *TESTS)

/* tests/unit [NAME...]: the tests whose function name contains one of the
 * NAMEs (all without one; a test's whole name runs it alone). Each starts from main()'s defaults, an empty
 * store and a new, empty unit_dir, so that any test runs alone or in any
 * order. */
int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* a crash keeps the lines before it */
    int run[NTESTS] = {0}, nrun = 0;
    for (int a = 1; a < argc; a++) {
        int any = 0; /* a test's own name: that test alone, else those whose name contains it */
        for (size_t i = 0; i < NTESTS; i++)
            if (strcmp(TESTS[i].name, argv[a]) == 0) run[i] = any = 1;
        if (!any)
            for (size_t i = 0; i < NTESTS; i++)
                if (strstr(TESTS[i].name, argv[a])) run[i] = any = 1;
        if (!any) {
            printf("unit: no test named like \"%s\"; the tests:", argv[a]);
            for (size_t i = 0; i < NTESTS; i++) printf(" %s", TESTS[i].name);
            printf("\n");
            return 2;
        }
    }
    /* tmpfs when there is one: thousands of fsyncs are the tests', not the disk's. */
    const char *tmp = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    for (size_t i = 0; i < NTESTS; i++) {
        if (argc > 1 && !run[i]) continue;
        store_reset();
        options_default(); /* main()'s defaults */
        unit_nevents = nfired = 0;
        snprintf(unit_dir, sizeof unit_dir, "%s/ltg-unit-XXXXXX", tmp);
        if (!mkdtemp(unit_dir)) {
            CHECK(0, "mkdtemp %s", unit_dir);
            break;
        }
        int before = failed;
        TESTS[i].fn();
        nrun++;
        if (argc > 1 || failed != before) printf("%s %s\n", failed != before ? "FAIL" : "ok", TESTS[i].name);
        store_reset(); /* closes the files the test left open in unit_dir */
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf %s", unit_dir);
        CHECK(system(cmd) == 0, "cleanup of %s", unit_dir);
    }
    if (skipped) printf("unit: %d passed, %d failed, %d skipped\n", passed, failed, skipped);
    else printf("unit: %d passed, %d failed\n", passed, failed);
    return failed != 0;
}
