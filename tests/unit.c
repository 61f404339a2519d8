/* tests/unit.c -- unit tests for ltg's parsers, writer, config loader and resolver.
 *
 * It includes ltg.c itself (without main) to reach the static functions.
 * Every parser is fed each case whole and one byte at a time, and the input
 * is placed right before an unmapped page, so a read past the end crashes
 * here instead of passing by luck. Ends with "N passed, M failed".
 */
#define LTG_NO_MAIN
#include "../ltg.c"

#include <sys/mman.h>

static int passed, failed;

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
        CHECK(strcmp(c->prov[0].hostport, "127.0.0.1:9000") == 0 && strcmp(c->prov[0].api_key, "provider-secret") == 0, "host and key");
        CHECK(strcmp(c->prov[1].host, "::1") == 0 && c->prov[1].port == 80 && strcmp(c->prov[1].hostport, "[::1]") == 0, "ipv6 url");
        catalog *tc = load("{\"providers\":{\"t\":{\"base_url\":\"https://api.example.com/v1\",\"tls_verify\":false},\"u\":{\"base_url\":\"https://h:8443\"}},"
                           "\"models\":{\"M\":{\"provider\":\"t\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", err);
        CHECK(tc && tc->prov[0].tls && tc->prov[0].port == 443 && !tc->prov[0].tls_verify && strcmp(tc->prov[0].hostport, "api.example.com") == 0 &&
              tc->prov[1].tls_verify && strcmp(tc->prov[1].hostport, "h:8443") == 0, "https providers: %s", err);
        catalog_free(tc);
        model *m = catalog_model(c, "A", 1);
        CHECK(m && m->p == &c->prov[0] && m->in_price == 1 && m->out_price == 2.5 && m->max_output_tokens == 100, "model A");
        CHECK(catalog_model(c, "B", 1)->max_output_tokens == 4096, "default max_output_tokens");
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
        {"{\"providers\":{\"p\":{\"base_url\":\"ftp://x\"}},\"models\":{}}", "providers.p.base_url: must start with http"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x:99999\"}},\"models\":{}}", "providers.p.base_url: has an invalid port"},
        {"{\"providers\":{\"p\":{\"base_url\":\"https://x\",\"tls_verify\":\"no\"}},\"models\":{}}", "providers.p.tls_verify: must be true or false"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"api_key_env\":\"UNIT_UNSET\"}},\"models\":{}}", "providers.p.api_key_env: environment variable UNIT_UNSET is not set"},
        /* a key pasted where the variable's name belongs is not repeated */
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"api_key_env\":\"sk-unit-0123456789\"}},\"models\":{}}", "providers.p.api_key_env: no environment variable of that name is set (the value is not shown"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\",\"bogus\":1}},\"models\":{}}", "providers.p.bogus: unknown field"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{}}", "models: must be an object with at least one"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"nope\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.provider: no provider named \"nope\""},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"output_usd_per_mtok\":1}}}", "models.M.input_usd_per_mtok: missing"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":-1,\"output_usd_per_mtok\":1}}}", "models.M.input_usd_per_mtok: must be a number >= 0"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"upstream_model\":\"m\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1,\"max_output_tokens\":1.5}}}", "models.M.max_output_tokens: must be a whole number"},
        {"{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{\"M\":{\"provider\":\"p\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}", "models.M.upstream_model: missing"},
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
    CHECK(dns_parse_answer(a, i, 0x1234, &addr, &ttl, &why) == 0 && ttl == 60 && ntohl(addr.s_addr) == 0x0A010203, "A after CNAME");
    CHECK(dns_parse_answer(a, i, 0x9999, &addr, &ttl, &why) < 0, "wrong id");
    for (size_t cut = 0; cut < i; cut++) /* every truncation fails cleanly (the guard page catches over-reads) */
        CHECK(dns_parse_answer((const uint8_t *)guarded((const char *)a, cut), cut, 0x1234, &addr, &ttl, &why) < 0, "truncated at %zu", cut);
    a[3] = 0x83;
    CHECK(dns_parse_answer(a, i, 0x1234, &addr, &ttl, &why) < 0 && strstr(why, "NXDOMAIN"), "nxdomain");
    /* A compression loop must not hang. */
    uint8_t loop[] = {0x12, 0x34, 0x81, 0x80, 0, 0, 0, 1, 0, 0, 0, 0, 0xC0, 12, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4, 1, 2, 3, 4};
    CHECK(dns_parse_answer(loop, sizeof loop, 0x1234, &addr, &ttl, &why) == 0, "pointer answer parses");
}

/* ---- the store: validation ---- */

static catalog *unit_cat;

/* Parse `body` as a create (or, with `base`, a PATCH over a clone of it)
 * and validate. Returns the group or NULL with *e filled. */
static group *try_group(const char *body, const group *base, verr *e) {
    json_tok t[256];
    json_result r;
    memset(e, 0, sizeof *e);
    if (json_parse(body, strlen(body), t, 256, -1, &r) < 0) { verr_set(e, "invalid_json", "%s", r.err); return NULL; }
    group *g = base ? group_clone(base) : group_new();
    if (group_parse(body, t, 0, g, base ? PARSE_PATCH : PARSE_CREATE, e) < 0 || group_validate(g, unit_cat, e) < 0) {
        group_free(g);
        return NULL;
    }
    return g;
}

static void expect_refused(const char *body, const group *base, const char *code, const char *pointer, const char *words) {
    verr e;
    group *g = try_group(body, base, &e);
    CHECK(!g && e.code && strcmp(e.code, code) == 0 && strcmp(e.pointer, pointer) == 0 && strstr(e.detail, words),
          "%s: got %s %s \"%s\", want %s %s \"%s\"", body, e.code ? e.code : "(accepted)", e.pointer, e.detail, code, pointer, words);
    group_free(g);
}

static void test_group_validation(void) {
    char err[512];
    unit_cat = catalog_load("t.json", "{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{"
                                      "\"A\":{\"provider\":\"p\",\"upstream_model\":\"a\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},"
                                      "\"B\":{\"provider\":\"p\",\"upstream_model\":\"b\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},"
                                      "\"C\":{\"provider\":\"p\",\"upstream_model\":\"c\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},"
                                      "\"D\":{\"provider\":\"p\",\"upstream_model\":\"d\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},"
                                      "\"E\":{\"provider\":\"p\",\"upstream_model\":\"e\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},"
                                      "\"x/y~z\":{\"provider\":\"p\",\"upstream_model\":\"xyz\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}",
                              err, sizeof err);
    CHECK(unit_cat != NULL, "catalog: %s", err);
    verr e;
    group *g = try_group("{\"name\":\"g\",\"allowed_models\":[\"A\",\"B\",\"C\",\"D\",\"E\"],\"fallbacks\":{\"A\":[\"B\",\"C\",\"D\"]},"
                         "\"retries\":{\"max_attempts\":5,\"retry_delay_ms\":60000,\"backoff\":\"linear\",\"request_timeout_ms\":100},"
                         "\"max_budget\":0.123456,\"budget_duration\":\"7d\",\"cache_ttl\":0,\"max_parallel_requests\":1,\"blocked\":true}", NULL, &e);
    CHECK(g && g->nfb == 1 && g->fb[0].n == 3 && g->retries.max_attempts == 5 && g->retries.backoff == BACKOFF_LINEAR &&
          g->max_budget == 0.123456 && g->budget_days == 7 && g->cache_ttl == 0 && g->max_parallel == 1 && g->blocked, "full group: %s %s", e.pointer, e.detail);
    group *min = try_group("{\"name\":\"m\",\"allowed_models\":[]}", NULL, &e);
    CHECK(min && !min->has_retries && !min->has_budget && min->cache_ttl == UNSET && min->max_parallel == UNSET, "minimal group");
    group_free(min);

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
        CHECK(p && strcmp(p->name, "renamed") == 0 && p->nfb == 1 && p->retries.max_attempts == 5 && p->has_budget, "patch keeps the rest");
        group_free(p);
        p = try_group("{\"retries\":null,\"fallbacks\":null,\"max_budget\":null,\"cache_ttl\":null,\"max_parallel_requests\":null}", g, &e);
        CHECK(p && !p->has_retries && p->nfb == 0 && !p->has_budget && p->cache_ttl == UNSET && p->max_parallel == UNSET, "null clears");
        group_free(p);
        p = try_group("{\"retries\":{\"max_attempts\":3}}", g, &e);
        CHECK(p && p->retries.max_attempts == 3 && p->retries.retry_delay_ms == 250 && p->retries.backoff == BACKOFF_EXPONENTIAL &&
              p->retries.request_timeout_ms == 0, "retries replaced whole, not merged");
        group_free(p);
        expect_refused("{\"allowed_models\":[\"A\"]}", g, "invalid_request", "/fallbacks/A/0", "must also be in allowed_models");
        expect_refused("{\"name\":null}", g, "invalid_request", "/name", "cannot be null");
        expect_refused("{\"allowed_models\":null}", g, "invalid_request", "/allowed_models", "cannot be null");
        CHECK(strcmp(g->name, "g") == 0 && g->nallowed == 5, "a refused patch leaves the original untouched");
    }
    group_free(g);
}

/* ---- the store: the log ---- */

static char unit_dir[256];

static void store_clear(void) {
    for (int i = 0; i < ST.gv.n; i++) group_free(ST.gv.p[i]);
    for (int i = 0; i < ST.kv.n; i++) tkey_free(ST.kv.p[i]);
    for (int i = 0; i < ST.iv.n; i++) idem_free(ST.iv.p[i]);
    free(ST.gv.p), free(ST.kv.p), free(ST.iv.p);
    free(ST.groups.slot), free(ST.keys.slot), free(ST.keys_by_hash.slot), free(ST.idems.slot);
    memset(&ST, 0, sizeof ST);
    store_init();
    if (LOG.f.fd >= 0) close(LOG.f.fd);
    if (LOG.tmp_fd >= 0) close(LOG.tmp_fd);
    buf_free(&LOG.tail), buf_free(&LOG.f.pending);
    memset(&LOG, 0, sizeof LOG);
    LOG.f.fd = LOG.tmp_fd = -1;
}

/* Log and apply a group as the handlers do: one record, then memory. */
static group *log_group(const char *name, int i) {
    group *g = group_new();
    uuid_new(g->id);
    char nm[64];
    snprintf(nm, sizeof nm, "%s-%d", name, i);
    g->name = xstrdup(nm);
    g->allowed = xcalloc(1, sizeof *g->allowed), g->allowed[0] = xstrdup("A"), g->nallowed = 1;
    g->version = 1, g->created_at = g->updated_at = 1700000000000LL + i;
    buf p = {0};
    jwriter w;
    jw_init(&w, &p);
    jw_open(&w, '{'), jw_key(&w, "ops"), jw_open(&w, '['), jw_open(&w, '{'), jw_key(&w, "put_group"), group_json(&w, g, 1);
    jw_close(&w, '}'), jw_close(&w, ']'), jw_close(&w, '}');
    const char *why;
    int rc = state_append(p.p, p.len, &why);
    CHECK(rc == 0, "append");
    store_put_group(g, p.len + 8);
    buf_free(&p);
    return g;
}

static void log_delete_group(const char *id) {
    char p[128];
    snprintf(p, sizeof p, "{\"ops\":[{\"del_group\":\"%s\"}]}", id);
    const char *why;
    CHECK(state_append(p, strlen(p), &why) == 0, "append delete");
    store_del_group(id);
}

/* A fingerprint of the store: every group's log JSON, in id order. */
static void store_fingerprint(buf *out) {
    out->len = 0;
    int n = 0;
    group **all = xcalloc((size_t)ST.gv.live + 1, sizeof *all);
    for (int i = 0; i < ST.gv.n; i++)
        if (ST.gv.p[i]) all[n++] = ST.gv.p[i];
    for (int i = 1; i < n; i++) /* insertion sort by id: small n */
        for (int k = i; k > 0 && strcmp(all[k - 1]->id, all[k]->id) > 0; k--) {
            group *t = all[k];
            all[k] = all[k - 1], all[k - 1] = t;
        }
    jwriter w;
    jw_init(&w, out);
    jw_open(&w, '[');
    for (int i = 0; i < n; i++) group_json(&w, all[i], 1);
    jw_close(&w, ']');
    free(all);
}

static int reopen(char *err) {
    store_clear();
    snprintf(LOG.tmp, sizeof LOG.tmp, "%.200s/state.log.tmp", unit_dir);
    return log_open(&LOG.f, unit_dir, "state.log", LOG_MAGIC, store_apply, err, 512);
}

static off_t file_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? st.st_size : -1;
}

static void test_log(void) {
    /* tmpfs when there is one: thousands of fsyncs are the test's, not the disk's. */
    snprintf(unit_dir, sizeof unit_dir, "%s/ltg-unit-XXXXXX", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
    if (!mkdtemp(unit_dir)) { CHECK(0, "mkdtemp"); return; }
    char err[512], path[300];
    snprintf(path, sizeof path, "%s/state.log", unit_dir);
    store_clear();
    CHECK(reopen(err) == 0 && file_size(path) == 8, "new log: %s", err);
    group *g1 = log_group("a", 1);
    char id1[37];
    memcpy(id1, g1->id, 37);
    log_group("b", 2);
    group *g3 = log_group("c", 3);
    char id3[37];
    memcpy(id3, g3->id, 37);
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
    for (int i = 0; i < 4000; i++) memcpy(ids[i], log_group("g", i)->id, 37);
    for (int i = 0; i < 2000; i++) log_delete_group(ids[i]); /* 2000 live groups, 6000 records */
    off_t grown = LOG.f.size;
    CHECK(compact_due(), "compaction due: log %lld, live %zu", (long long)LOG.f.size, ST.live_bytes);
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
    store_clear();
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", unit_dir);
    CHECK(system(cmd) == 0, "cleanup");
}

/* ---- the attempt plan ---- */

static void test_plan(void) {
    /* The outcome table of API.md 4.3, row by row. */
    attempt_plan p = plan_start(2, 3);
    CHECK(plan_next(&p, OUTCOME_OK) == PLAN_ANSWER && p.model == 0 && p.attempt == 1, "ok answers");
    p = plan_start(2, 3);
    CHECK(plan_next(&p, OUTCOME_TERMINAL) == PLAN_ANSWER && p.model == 0, "terminal answers, no other attempt");
    p = plan_start(2, 3);
    CHECK(plan_next(&p, OUTCOME_NO_WORK) == PLAN_RETRY_SAME && p.model == 0 && p.attempt == 2, "no_work retries the same model");
    CHECK(plan_next(&p, OUTCOME_NO_WORK) == PLAN_RETRY_SAME && p.attempt == 3, "no_work again");
    CHECK(plan_next(&p, OUTCOME_NO_WORK) == PLAN_NEXT_MODEL && p.model == 1 && p.attempt == 1, "attempts spent: next model");
    CHECK(plan_next(&p, OUTCOME_NO_WORK) == PLAN_RETRY_SAME && p.model == 1 && p.attempt == 2, "the fallback gets its own attempts");
    p = plan_start(2, 3);
    CHECK(plan_next(&p, OUTCOME_INDETERMINATE) == PLAN_NEXT_MODEL && p.model == 1 && p.attempt == 1, "indeterminate never retries the same model");
    CHECK(plan_next(&p, OUTCOME_INDETERMINATE) == PLAN_GIVE_UP, "indeterminate on the last model: give up");
    p = plan_start(3, 5);
    CHECK(plan_next(&p, OUTCOME_UNKNOWN_MODEL) == PLAN_NEXT_MODEL && p.model == 1, "404: next model");
    CHECK(plan_next(&p, OUTCOME_CIRCUIT_OPEN) == PLAN_NEXT_MODEL && p.model == 2, "circuit open: next model");
    CHECK(plan_next(&p, OUTCOME_UNKNOWN_MODEL) == PLAN_GIVE_UP, "chain spent");
    p = plan_start(1, 1);
    CHECK(plan_next(&p, OUTCOME_NO_WORK) == PLAN_GIVE_UP, "one attempt, one model");
    p = plan_start(2, 2);
    CHECK(plan_next_model(&p) == PLAN_NEXT_MODEL && p.model == 1 && p.attempt == 1 && plan_next_model(&p) == PLAN_GIVE_UP, "skip a model");

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
    model m = {0};
    m.alias = "M";
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
    g.has_budget = 1, g.max_budget = 1, g.budget_days = 1, g.budget_anchor = 1000;
    int64_t start, end;
    group_period(&g, 1000 + 5 * 86400000LL + 7, &start, &end);
    CHECK(start == 1000 + 5 * 86400000LL && end == start + 86400000LL, "the sixth daily period");
    budget_refresh(&g, 2000);
    g.spend = 500;
    budget_refresh(&g, 1000 + 86400000LL - 1);
    CHECK(g.spend == 500, "same period: spend kept");
    budget_refresh(&g, 1000 + 86400000LL);
    CHECK(g.spend == 0 && g.period_start == 1000 + 86400000LL, "rolled over at the anchor's hour, not at midnight");
    g.budget_days = 0;
    group_period(&g, 99 * 86400000LL, &start, &end);
    CHECK(start == 1000 && end == 0, "a lifetime budget never resets");
    g.has_budget = 0;
    group_period(&g, 5000, &start, &end);
    CHECK(start == 0 && end == 0, "no budget, no period");

    /* The worst case: bytes / 3 at the input price plus max_tokens at the output price, dearest model. */
    model a = {.alias = "a", .in_price = 1, .out_price = 2, .max_output_tokens = 100};
    model b = {.alias = "b", .in_price = 3, .out_price = 1, .max_output_tokens = 4096};
    model *chain[2] = {&a, &b};
    CHECK(worst_case(chain, 1, 300, 50) == 100 * 1 + 50 * 2, "one model, max_tokens");
    CHECK(worst_case(chain, 1, 301, 0) == 101 * 1 + 100 * 2, "rounded up, the model's default output");
    CHECK(worst_case(chain, 2, 300, 0) == 100 * 3 + 4096, "the dearest of the chain");

    /* Usage from an answer or an event. */
    long long in, out;
    int no_choices;
    const char *ans = "{\"id\":\"x\",\"choices\":[{}],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":5,\"total_tokens\":17}}";
    CHECK(usage_read(ans, strlen(ans), &in, &out, &no_choices) == 1 && in == 12 && out == 5 && !no_choices, "usage");
    const char *none = "{\"usage\":null}";
    CHECK(usage_read(none, strlen(none), &in, &out, &no_choices) == 0 && no_choices, "null usage");
    const char *chunk = "{\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}";
    CHECK(usage_read(chunk, strlen(chunk), &in, &out, &no_choices) == 1 && no_choices && out == 2, "a usage-only chunk");
    CHECK(usage_read("<html>", 6, &in, &out, &no_choices) == LTG_ERR, "not JSON");
    CHECK(usage_read("{\"usage\":{}", 12, &in, &out, &no_choices) == LTG_ERR, "cut JSON");
    /* A thousand embeddings, then the usage: the answer's size does not matter. */
    buf big = {0};
    buf_puts(&big, "{\"data\":[");
    for (int i = 0; i < 1000; i++) buf_printf(&big, "%s{\"embedding\":[0.1,0.2],\"index\":%d}", i ? "," : "", i);
    buf_puts(&big, "],\"usage\":{\"prompt_tokens\":7,\"total_tokens\":7}}");
    CHECK(usage_read(big.p, big.len, &in, &out, &no_choices) == 1 && in == 7 && out == 0, "usage after 1000 embeddings");
    big.len = 0;
    buf_puts(&big, "{");
    for (int i = 0; i < 200; i++) buf_printf(&big, "\"k%d\":%d,", i, i);
    buf_puts(&big, "\"z\":0}");
    CHECK(usage_read(big.p, big.len, &in, &out, &no_choices) == 0, "200 members: still JSON, no usage looked for");
    buf_free(&big);

    /* A stream's events: comments and empty data are not the answer; data must be JSON or [DONE]. */
    {
        exchange x;
        memset(&x, 0, sizeof x);
        x.hide_usage = 1;
        CHECK(stream_event(&x, ": ping\n\n", 8) == SSE_EMPTY, "a comment");
        CHECK(stream_event(&x, "data:\n\n", 7) == SSE_EMPTY, "empty data");
        CHECK(stream_event(&x, "data: [DONE]\n\n", 14) == SSE_RELAY, "[DONE]");
        CHECK(stream_event(&x, "data: <html>\n\n", 14) == LTG_ERR, "not JSON");
        const char *ev = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\n";
        CHECK(stream_event(&x, ev, strlen(ev)) == SSE_HIDE && x.usage_known && x.out_tok == 4, "the usage chunk ltg asked for");
        x.hide_usage = 0;
        CHECK(stream_event(&x, ev, strlen(ev)) == SSE_RELAY, "the usage chunk the client asked for");
    }

    /* A provider's key quoted back by the provider is masked, byte for byte. */
    {
        provider p = {.api_key = "sk-prov-1234"};
        char body[] = "{\"error\":\"bad key sk-prov-1234, sk-prov-1234!\"}";
        mask_provider_key(&p, body, strlen(body));
        CHECK(strcmp(body, "{\"error\":\"bad key ************, ************!\"}") == 0, "masked: %s", body);
        p.api_key = NULL;
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
    char body[100] = {0};
    S.now = 1000;
    cache_put(k1, body, 100, "a", 1, 2, 5000), cache_put(k2, body, 100, "a", 1, 2, 5000), cache_put(k3, body, 100, "a", 1, 2, 5000);
    CHECK(cache_get(k1) && cache_get(k2) && cache_get(k3), "three fit");
    CHECK(cache_get(k1) != NULL, "k1 used again: k2 is now the oldest");
    cache_put(k4, body, 100, "a", 1, 2, 5000);
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

int main(void) {
    test_json_reader();
    test_json_writer();
    test_http_request();
    test_http_response();
    test_chunked();
    test_sse();
    test_config();
    test_dns();
    test_timers();
    test_plan();
    test_group_validation();
    test_ledger_pieces();
    test_log();
    printf("unit: %d passed, %d failed\n", passed, failed);
    return failed != 0;
}
