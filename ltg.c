/* ltg.c -- an LLM token gateway in one file.
 *
 * Applications call models through ltg. It sits between them and the model
 * providers and owns what an application should not: which models a
 * credential may use, how a failed call is retried or moved to a fallback,
 * what may be spent, and the record of what happened. Two listeners: the
 * control plane (admin keys) manages token groups -- the policy -- and
 * issues token keys; the inference plane speaks OpenAI's APIs and
 * Anthropic's Messages and accepts only token keys, and a chat, Messages or
 * Responses client reaches a model of either API (section 17 translates).
 * Changes to groups and keys are fsynced to an append-only log before they
 * are acknowledged; every admitted inference request leaves a
 * spend event in the ledger (refusals and token counts do not; nor does a
 * request still running when a drain ends), one log per UTC day, each
 * sealed at midnight with an index file beside it and deleted after
 * --ledger-days. Memory, disk and start-up time depend on what ltg holds
 * now, never on how much it has served.
 *
 * One process, one thread, one poll() loop. Every socket is non-blocking;
 * every wait (a timeout, a backoff, a DNS answer, a slow client) is a timer
 * or a poll interest, never a sleep. Memory has an owner you can name: a
 * client connection owns its buffers and its current exchange; an exchange
 * owns the upstream connection it borrowed from its provider's pool.
 *
 * The life of one chat request:
 *   1. conn_read() gathers bytes; http_head_end()/http_parse_request() find
 *      and parse the head, route_begin() (20) gives the request its id, the
 *      body arrives (Content-Length or chunked; one still to come after the
 *      head's read, only for a known key) (6).
 *   2. route() (20) sends it to inference_call() (18): parse, admit, start.
 *      Admission is a list of checks, each a refusal or nothing: the token
 *      key resolves to its group, the body's model must be allowed, the
 *      ledger must be writable, the first attempt's worst case must fit the
 *      key's and the group's budgets and rate limits and is held
 *      (hold_reserve, 15; with --cluster, in the shared store: cl_hold,
 *      21; each later attempt holds its own); an
 *      idempotent replay or a cached answer may answer here.
 *   3. exchange_attempt() (18) picks a deployment of the current model of
 *      the chain [M] + fallbacks[M] (deployment_pick, 11), rewrites "model"
 *      for it -- or, for a model whose provider speaks another API than the
 *      client's or does not serve its endpoint (model_native), translates
 *      the request (xl_request, 17) and later its answer, or skips the model
 *      when nothing translates it -- and up_start() (9) borrows a pooled
 *      upstream connection or opens one (resolving the host without
 *      blocking, 7).
 *   4. The upstream connection calls exchange_upstream() back; a success is
 *      relayed (a stream event by event), and every attempt's result goes
 *      to attempt_decide() (18), which classifies it and asks plan_next()
 *      (11): answer, retry the same model after a backoff (or at once on
 *      another of its deployments, or with the provider's next key), move
 *      to the next one, or give up; exchange_step() acts on it.
 *   5. Every attempt is billed when it is over (attempt_bill, 18: its
 *      provider's usage at its model's prices; nothing if nothing reached
 *      the provider or it answered an error; else ltg's estimate; a whole
 *      answer given up on is first read to its end by a meter);
 *      exchange_settle() bills the answer, and exchange_book() -- once no
 *      meter is left -- replaces the hold by what was charged (hold_settle,
 *      15) and adds the spend event to today's segment (14; with --cluster
 *      it goes through the shared stream, and comes back from it: 21); the upstream
 *      connection returns to the pool and the client connection waits for
 *      its next request (6), once request_ended() (19) has counted it in
 *      the metrics and written its access log line.
 *
 * Sections (banners below carry the same names):
 *   1. Limits and global state
 *   2. Utilities: logging, time, random, buffers, hashing, metrics, addresses
 *   3. JSON reader and writer
 *   4. HTTP/1.1 messages: heads, chunked coding, SSE
 *   5. The event loop: fds, timers, deferred close
 *   6. Client connections: the HTTP/1.1 server
 *   7. Name resolution: /etc/hosts and a DNS client of its own
 *   8. TLS: trust anchors and the pump
 *   9. Upstream connections and the pool
 *  10. Catalog config
 *  11. The attempt plan: retry, fallback, breakers, deployments
 *  12. The store: token groups, token keys, idempotency records
 *  13. The append-only log
 *  14. The ledger: daily segments, index files, retention, the chain
 *  15. Budgets and rate limits, the cache, idempotent inference
 *  16. The control plane
 *  17. Translation: one API for every model
 *  18. Inference: the proxy path
 *  19. Observability: metrics and the access log
 *  20. Routing
 *  21. Several instances: the Redis link
 *  22. main
 *
 * Sections 3 to 9 are the engine -- parsers, the loop, the HTTP server,
 * name resolution, TLS and upstream connections -- and 10 to 21 the
 * gateway built on it. The engine calls the gateway only through the hooks
 * of ltg.h; of the gateway's it carries only what the access log wants of a
 * request (req_facts) and what a provider needs beside its address (its API
 * keys and APIs).
 *
 * Read ltg.h first: it holds the contracts of the parsers and buffers.
 */
#define _GNU_SOURCE
#include "ltg.h"

#include <arpa/inet.h>
#include <assert.h>
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/aio_abi.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <bearssl.h>

/* ===== 1. Limits and global state =====
 *
 * IMPLEMENTATION NOTES
 * Most limits of the README's "Limits and bad input" live here as defaults (a few sit beside
 * the code they bound: the parsers' in ltg.h, LOG_MAX_RECORD, MAX_PRICE_USD...); the command line
 * may change the operator-facing ones. The process-wide state -- options,
 * the loop, the listeners -- is one global struct, `S`; each later section
 * keeps its own state in statics beside its code (the structs ST, LOG, LG,
 * CACHE, TLS, PINS, ALOG, METERS, TRUSTED, CL; tables such as PEERS, METRICS, hosts;
 * the API kinds' WIRE), so a reader finds it where it is used. The few
 * other file-scope variables sit beside the functions that use them: the
 * loop's deferred closes, the client connection list, a handful of timers
 * and refusal episodes, START_TIME.
 */
#define MAX_HEAD_BYTES (16 * 1024)       /* request head; 431 beyond */
#define UP_MAX_HEAD_BYTES (64 * 1024)    /* provider response head */
#define UP_MAX_BODY_BYTES (64 * 1024 * 1024) /* non-streaming provider answer */
#define ADMIN_MAX_CONNS 64               /* control-plane connections, counted apart */
#define MAX_BODY_FIELDS 512              /* top-level JSON tokens of a request body */
#define ALIAS_MAX 128                    /* bytes of a model alias */
#define READ_CHUNK 16384
#define OUT_HIGH_WATER (256 * 1024)      /* unsent output past this: stop reading the other side */
#define BODY_MIN_RATE 4096               /* bytes/s a request body keeps up after --head-timeout */
/* The raw bytes of a chunked body of at most `max` decoded bytes: its framing is bounded too. */
#define RAW_BODY_MAX(max) (2 * (max) + 65536)
#define EPISODE_QUIET_MS 10000           /* quiet this long, an episode of refusals is over */
#define LINGER_MS 2000                   /* after a closing answer: the client's bytes dropped */
#define POOL_IDLE_MS 30000               /* idle pooled upstream connection lifetime */
#define POOL_MAX_IDLE 64                 /* idle connections kept per provider */
#define KEY_REST_MS 60000                /* a provider key refused (401/403) rests this long */
#define CONNECT_TIMEOUT_MS 10000
/* The x-ltg-deadline default (README "Per-request overrides"): a reasoning model may think
 * for minutes. */
#define DEFAULT_DEADLINE_MS 600000
#define DNS_TIMEOUT_MS 2000
#define DNS_TRIES 3
#define DNS_NEGATIVE_TTL_S 5
#define DNS_MAX_TTL_S 3600
#define MAX_CHARGE 1000000000000LL       /* micro-USD: one request's million USD is no event */
#define MAX_USAGE_TOKENS 10000000        /* a usage count past this violates the protocol */
#define METER_MAX 256                    /* abandoned answers read to their end at once (18) */
#define METER_MAX_BODY (1 << 20)         /* ... each this long at most, then charged the estimate */

/* The token classes of a request's usage (README "Cost"). Input and output
 * are inclusive -- a cache read or write is an input token, a reasoning
 * token an output token -- and the others say which part was priced
 * apart: cache reads, cache writes (of them, 1-hour writes), reasoning. */
enum { TOK_IN, TOK_CACHE_READ, TOK_CACHE_WRITE, TOK_CACHE_WRITE_1H, TOK_OUT, TOK_REASONING, NTOK };
static const char *const tok_names[NTOK] = {
    "input_tokens", "cache_read_tokens", "cache_write_tokens", "cache_write_1h_tokens",
    "output_tokens", "reasoning_tokens"
};

typedef struct timer timer;
typedef struct exchange exchange;
typedef struct wire_kind wire_kind;
typedef struct provider provider;
typedef struct model model;
typedef struct catalog catalog;
typedef struct dns_entry dns_entry;

/* A deadline that wakes the loop. Embedded in its owner; `slot` is its index
 * in the timer heap, -1 when not armed. */
struct timer {
    int64_t when;
    int slot;
    void (*fire)(void *ctx);
    void *ctx;
};

typedef void fd_handler(void *ctx, int revents);

typedef struct {
    fd_handler *handler; /* NULL: nobody watches this fd */
    void *ctx;
    short events;
    int64_t seen; /* S.now when it last had an event or a new interest */
} fd_watch;

static struct {
    /* options */
    const char *config_path, *data_dir, *resolv_conf;
    const char *listen_addr, *admin_addr;
    const char *trusted_proxies; /* --trusted-proxies (section 6) */
    int max_conns, drain_seconds;
    int max_per_ip;           /* inference connections from one client address */
    int max_stream_s;         /* a started stream is cut after this long */
    int stream_idle_s;        /* ... and after this long without an event */
    /* an abandoned whole answer is read this long for its usage (0: closed at once) */
    int meter_s;
    int max_meters;           /* ... so many at a time: METER_MAX, or fewer when fds are short */
    int ledger_days;          /* days of spend events kept (section 14) */
    /* bytes today's index may hold in memory before it is spilled (section 14) */
    long long ledger_index;
    const char *ledger_key_env; /* --ledger-key-env: the ledger's chain is keyed by it */
    int metrics_auth;         /* GET /metrics needs an admin key (section 19) */
    long long max_body;
    int head_timeout_ms, idle_timeout_ms;
    long long cache_mb;

    /* the loop */
    loop_hooks hooks;         /* what the loop calls (ltg.h): set by main */
    server_begin *begin;      /* what the server tells of each head that parses: route_begin() */
    server_serve *serve;      /* what the server hands each request to: route() */
    server_ended *ended;      /* and tells when it is over: request_ended() */
    server_error *error;      /* and has answer the errors it finds: route_error() */
    /* up_start(); a test's fake */
    upstream *(*up_open)(provider *p, void *owner, upstream_event *event, const char *req,
                         size_t n);
    /* monotonic ms: read before the timers run and after poll() returns */
    int64_t now;
    fd_watch *fds;            /* indexed by fd */
    int nfds_cap, fd_high;    /* table size; highest watched fd + 1 */
    struct pollfd *pfds;
    timer **heap;             /* min-heap of armed timers */
    int nheap, heap_cap;
    conn *pending_writes;     /* connections with output to flush this turn */
    conn *closing;            /* connections to free at the end of this turn */
    int sig_pipe[2];          /* self-pipe: signal handlers write here */
    volatile sig_atomic_t got_term, got_hup, got_usr1;

    /* listeners and clients */
    int listen_fd, admin_fd;
    int nconns;
    int nexchanges;           /* inference requests in flight, with or without their client */
    int ndetached;            /* of those, idempotent ones whose client left: at most max_conns */
    /* control-plane connections, counted apart: an inference flood cannot lock the operator out */
    int nadmin, max_admin;
    int draining;
    int64_t drain_until;

    /* state */
    catalog *cat;
    br_hmac_drbg_context rng; /* every id and jitter: seeded from getrandom (section 2) */
    uint8_t rng_pool[512];    /* its output not yet used */
    size_t rng_left;

    /* name resolution */
    struct sockaddr_storage dns_servers[3];
    int ndns_servers;
    dns_entry *dns_cache;
} S;

/* Section 21's, for the sections before it (the state is shared only with --cluster). */
static int cl_on(void);
static void cl_note_sid(const char *p, const json_tok *t);
static const char *cl_applied(void);
static const char *cl_unready(void);
static int cl_behind(void);
static int cl_stale(void);
static void cl_metrics(buf *b);
static int cl_unsettled(void);
static int cl_outbox_full(void);
static int cl_day_over(int64_t end);

/* ===== 2. Utilities: logging, time, random, buffers, hashing, metrics, addresses =====
 *
 * IMPLEMENTATION NOTES
 * Log lines go to stderr with a UTC timestamp; ltg never logs a secret.
 * Also here: CRC-32 for log records, UUIDs for ids, one hash table (open
 * addressing) that every index of the store uses, the table of metric
 * series that every section counts into (section 19 writes it out), and
 * SHA-256.
 * `S.now` is read before the timers run and again after poll() returns
 * (libuv does the same): every timer set in between agrees on what "now"
 * is. Random numbers for ids and jitter come from BearSSL's HMAC-DRBG
 * (over ltg's SHA-256), seeded from getrandom(); secrets (when the
 * control plane issues keys) come from getrandom() directly.
 */
static void ltg_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void ltg_log(const char *fmt, ...) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char line[1024];
    int n = snprintf(line, sizeof line,
                     "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ ltg: ", tm.tm_year + 1900, tm.tm_mon + 1,
                     tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - n - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(line);
    line[len++] = '\n';
    if (write(2, line, len) < 0) { /* nowhere left to report it */ }
}

static int64_t clock_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static double clock_s(void) { /* finer, for what takes less than a millisecond (an fsync) */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* SHA-256, for every hash ltg takes on the hot path: a token key looked
 * up, the random ids' HMAC-DRBG, the ledger's chain (section 14). On an
 * x86-64 processor with the SHA extensions (cpuid leaf 7, EBX bit 29: most
 * made since 2017) its compression runs on them, about five times BearSSL's
 * portable code; elsewhere BearSSL's runs. LTG_SHA256 gives it to BearSSL
 * as a hash class, so its HMAC and HMAC-DRBG use it; the unit tests hold
 * both compressions to BearSSL's own SHA-256. */
static const uint32_t SHA256_IV[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                      0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

static void be32_put(uint8_t *p, const uint32_t *v, int n) {
    for (int i = 0; i < 4 * n; i++) p[i] = (uint8_t)(v[i / 4] >> (24 - 8 * (i % 4)));
}
static void be32_get(uint32_t *v, const uint8_t *p, int n) {
    for (int i = 0; i < 4 * n; i++) v[i / 4] = v[i / 4] << 8 | p[i];
}

/* The compression of nb 64-byte blocks into st, with BearSSL's code. */
static void sha256_blocks_portable(uint32_t st[8], const uint8_t *p, size_t nb) {
    uint8_t b[32];
    be32_put(b, st, 8);
    br_sha256_context c;
    br_sha256_init(&c);
    br_sha256_set_state(&c, b, 64);
    br_sha256_update(&c, p, 64 * nb);
    br_sha256_state(&c, b);
    be32_get(st, b, 8);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>

static const uint32_t SHA256_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

/* The same on the SHA extensions. They hold the state as two halves, ABEF
 * and CDGH; each sha256rnds2 does two rounds, and sha256msg1/msg2 extend the
 * message four words at a time: w[i % 4] is words 4i..4i+3. */
__attribute__((target("sha,sse4.1,ssse3")))
static void sha256_blocks_ni(uint32_t st[8], const uint8_t *p, size_t nb) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i dcba = _mm_loadu_si128((const __m128i *)st);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)(st + 4));
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1), efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8), cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    for (; nb; nb--, p += 64) {
        __m128i abef0 = abef, cdgh0 = cdgh, w[4];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            __m128i *x = &w[i % 4];
            if (i < 4)
                *x = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
            else { /* w[i-4] + s0(w[i-3]) + w[i-2..i-1]'s words 1-4, then s1 */
                __m128i w3 = w[(i + 1) % 4], w2 = w[(i + 2) % 4], w1 = w[(i + 3) % 4];
                *x = _mm_sha256msg2_epu32(
                    _mm_add_epi32(_mm_sha256msg1_epu32(*x, w3), _mm_alignr_epi8(w1, w2, 4)), w1);
            }
            __m128i m = _mm_add_epi32(*x, _mm_loadu_si128((const __m128i *)(SHA256_K + 4 * i)));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, m);
            abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(m, 0x0E));
        }
        abef = _mm_add_epi32(abef, abef0);
        cdgh = _mm_add_epi32(cdgh, cdgh0);
    }
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B), dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)st, _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)(st + 4), _mm_alignr_epi8(dchg, feba, 8));
}

static int sha_ni_present(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_SSE4_1) && (c & bit_SSSE3) &&
           __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 29 & 1);
}
#else
static int sha_ni_present(void) { return 0; }
#define sha256_blocks_ni sha256_blocks_portable
#endif

static int SHA_NI = -1; /* 1: the SHA extensions, 0: BearSSL's code, -1: not asked yet */

static void sha256_blocks(uint32_t st[8], const uint8_t *p, size_t nb) {
    if (SHA_NI < 0) SHA_NI = sha_ni_present();
    (SHA_NI ? sha256_blocks_ni : sha256_blocks_portable)(st, p, nb);
}

/* A SHA-256 in progress, laid out as a BearSSL hash context (vtable first). */
typedef struct {
    const br_hash_class *vtable;
    uint32_t st[8];
    uint8_t blk[64];
    size_t fill;                /* bytes in blk */
    uint64_t len;               /* bytes taken */
} sha_run;

static void sha_add(const br_hash_class **ctx, const void *data, size_t n) {
    sha_run *s = (sha_run *)ctx;
    const uint8_t *p = data;
    s->len += n;
    while (n) {
        if (!s->fill && n >= 64) { /* whole blocks straight from the data */
            sha256_blocks(s->st, p, n / 64);
            p += n & ~(size_t)63;
            n &= 63;
            continue;
        }
        size_t k = 64 - s->fill < n ? 64 - s->fill : n;
        memcpy(s->blk + s->fill, p, k);
        s->fill += k, p += k, n -= k;
        if (s->fill == 64) sha256_blocks(s->st, s->blk, 1), s->fill = 0;
    }
}

static void sha_out(const br_hash_class *const *ctx, void *out) {
    sha_run s = *(const sha_run *)ctx; /* the context goes on unchanged, as BearSSL's does */
    uint64_t bits = s.len * 8;
    uint8_t pad[72] = {0x80};
    size_t k = (s.fill < 56 ? 56 : 120) - s.fill;
    for (int i = 0; i < 8; i++) pad[k + i] = (uint8_t)(bits >> (56 - 8 * i));
    sha_add(&s.vtable, pad, k + 8);
    be32_put(out, s.st, 8);
}

static uint64_t sha_state(const br_hash_class *const *ctx, void *out) {
    const sha_run *s = (const sha_run *)ctx;
    be32_put(out, s->st, 8);
    return s->len;
}

static void sha_set_state(const br_hash_class **ctx, const void *stb, uint64_t count) {
    sha_run *s = (sha_run *)ctx;
    be32_get(s->st, stb, 8);
    s->len = count, s->fill = 0; /* count is a multiple of 64 */
}

static void sha_init(const br_hash_class **ctx);
static const br_hash_class LTG_SHA256 = {
    sizeof(sha_run),
    BR_HASHDESC_ID(br_sha256_ID) | BR_HASHDESC_OUT(32) | BR_HASHDESC_STATE(32) |
        BR_HASHDESC_LBLEN(6) | BR_HASHDESC_MD_PADDING | BR_HASHDESC_MD_PADDING_BE,
    sha_init, sha_add, sha_out, sha_state, sha_set_state};
_Static_assert(sizeof(sha_run) <= sizeof(br_hash_compat_context), "BearSSL's HMAC holds it");

static void sha_init(const br_hash_class **ctx) {
    sha_run *s = (sha_run *)ctx;
    *s = (sha_run){.vtable = &LTG_SHA256};
    memcpy(s->st, SHA256_IV, sizeof s->st);
}

static void sha256(const void *data, size_t n, uint8_t out[32]) {
    sha_run s;
    sha_init(&s.vtable);
    sha_add(&s.vtable, data, n);
    sha_out(&s.vtable, out);
}

/* Random numbers for every id ltg makes (request ids, resource UUIDs, DNS
 * query ids) and for retry jitter: BearSSL's HMAC-DRBG (SHA-256), seeded
 * with 32 bytes from getrandom(), so that no id tells anything of the
 * next. It is drawn 512 bytes at a time: a request costs a fraction of one
 * generate call. Without getrandom() (it never fails on Linux since 3.17
 * once the pool is ready, which it is long before ltg starts) ltg refuses
 * to make ids from something weaker and stops. */
static void rng_seed(void) {
    uint8_t seed[32];
    if (getrandom(seed, sizeof seed, 0) != (ssize_t)sizeof seed) {
        ltg_log("getrandom: %s: no seed for the random ids", strerror(errno));
        abort();
    }
    br_hmac_drbg_init(&S.rng, &LTG_SHA256, seed, sizeof seed);
    S.rng_left = 0;
}

static uint64_t rng_next(void) {
    if (!S.rng.digest_class) rng_seed();
    if (S.rng_left < 8) {
        br_hmac_drbg_generate(&S.rng, S.rng_pool, sizeof S.rng_pool);
        S.rng_left = sizeof S.rng_pool;
    }
    uint64_t v;
    S.rng_left -= 8;
    memcpy(&v, S.rng_pool + S.rng_left, 8);
    memset(S.rng_pool + S.rng_left, 0, 8); /* used once */
    return v;
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { ltg_log("out of memory (%zu bytes)", n); abort(); }
    return p;
}
static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) { ltg_log("out of memory"); abort(); }
    return p;
}
static void *xrealloc(void *p, size_t n) {
    p = realloc(p, n ? n : 1);
    if (!p) { ltg_log("out of memory (%zu bytes)", n); abort(); }
    return p;
}
static char *xstrndup(const char *s, size_t n) {
    char *p = xmalloc(n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

/* see ltg.h */
void buf_reserve(buf *b, size_t extra) {
    if (b->len + extra + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1) cap *= 2;
    b->p = xrealloc(b->p, cap);
    b->cap = cap;
}
void buf_append(buf *b, const void *data, size_t n) {
    buf_reserve(b, n);
    if (n) memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = 0;
}
void buf_puts(buf *b, const char *s) { buf_append(b, s, strlen(s)); }
void buf_cat(buf *b, ...) {
    va_list ap;
    va_start(ap, b);
    for (const char *s; (s = va_arg(ap, const char *));) buf_puts(b, s);
    va_end(ap);
}
/* Formatted once into the room there is; only what does not fit is
 * formatted again, into more (a request writes a dozen heads this way). */
void buf_printf(buf *b, const char *fmt, ...) {
    buf_reserve(b, 0);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0) n = 0; /* no format of ltg's fails; if one did, nothing is added */
    if ((size_t)n >= b->cap - b->len) {
        buf_reserve(b, (size_t)n);
        va_start(ap, fmt);
        vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
        va_end(ap);
    }
    b->len += (size_t)n;
    b->p[b->len] = 0;
}
void buf_consume(buf *b, size_t n) {
    if (n >= b->len) { b->len = 0; if (b->p) b->p[0] = 0; return; }
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
    b->p[b->len] = 0;
}
void buf_free(buf *b) {
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

static int ascii_casecmp_n(const char *a, size_t an, const char *b) {
    size_t bn = strlen(b);
    if (an != bn) return 1;
    for (size_t i = 0; i < an; i++)
        if (tolower((unsigned char)a[i]) != tolower((unsigned char)b[i])) return 1;
    return 0;
}

/* Parse a decimal integer that fills all of s[0..n); LTG_ERR otherwise. */
static int parse_ll(const char *s, size_t n, long long max, long long *out) {
    long long v = 0;
    if (n == 0 || n > 18) return LTG_ERR;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return LTG_ERR;
        v = v * 10 + (s[i] - '0');
    }
    if (v > max) return LTG_ERR;
    *out = v;
    return 0;
}

/* Wall-clock milliseconds since the epoch, for timestamps people read. */
static int64_t wall_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* "2026-11-29T18:00:00.123Z" into out (64 bytes). */
static void iso_time(int64_t ms, char out[64]) {
    static time_t last = -1; /* a request writes three times of the same second: formatted once */
    static char head[96];    /* room for any int the fields could be; the clamp keeps them to 20 */
    ms = ms < 0 ? 0 : ms > 253402300799999LL ? 253402300799999LL : ms; /* 1970 to 9999 */
    int m = (int)((ms % 1000 + 1000) % 1000);
    time_t sec = (time_t)((ms - m) / 1000);
    if (sec != last) {
        struct tm tm;
        gmtime_r(&sec, &tm);
        snprintf(head, sizeof head, "%04d-%02d-%02dT%02d:%02d:%02d.", tm.tm_year + 1900,
                 tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec);
        last = sec;
    }
    int n = (int)strlen(head);
    memcpy(out, head, (size_t)n);
    out[n++] = (char)('0' + m / 100);
    out[n++] = (char)('0' + m / 10 % 10);
    out[n++] = (char)('0' + m % 10);
    memcpy(out + n, "Z", 2);
}

/* "YYYY-MM-DD" as the wall ms of its midnight UTC; LTG_ERR when it is not a date. */
static int parse_day(const char *s, int64_t *ms) {
    if (strlen(s) != 10 || s[4] != '-' || s[7] != '-') return LTG_ERR;
    for (int i = 0; i < 10; i++)
        if (i != 4 && i != 7 && !isdigit((unsigned char)s[i])) return LTG_ERR;
    int y = atoi(s), m = atoi(s + 5), d = atoi(s + 8);
    struct tm tm = {.tm_year = y - 1900, .tm_mon = m - 1, .tm_mday = d};
    time_t t = timegm(&tm);
    /* 2026-02-30 */
    if (tm.tm_year != y - 1900 || tm.tm_mon != m - 1 || tm.tm_mday != d) return LTG_ERR;
    *ms = (int64_t)t * 1000;
    return 0;
}

static void hex_encode(const uint8_t *p, size_t n, char *out) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[p[i] >> 4];
        out[2 * i + 1] = digits[p[i] & 15];
    }
    out[2 * n] = 0;
}

/* Random bytes from the kernel, for secrets and ids; aborts if it has none. */
static void os_random(void *p, size_t n) {
    for (size_t got = 0; got < n;) {
        ssize_t r = getrandom((char *)p + got, n - got, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { ltg_log("getrandom: %s", strerror(errno)); abort(); }
        got += (size_t)r;
    }
}

/* A random (version 4) UUID: 8-4-4-4-12 hex digits, the version nibble 4,
 * from the generator above (a spend event makes one per request, and a
 * system call each would show). */
static void uuid_new(char out[37]) {
    uint8_t b[16];
    char h[33];
    uint64_t r[2] = {rng_next(), rng_next()};
    memcpy(b, r, 16);
    b[6] = (uint8_t)((b[6] & 0x0F) | 0x40);
    b[8] = (uint8_t)((b[8] & 0x3F) | 0x80);
    hex_encode(b, 16, h);
    snprintf(out, 37, "%.8s-%.4s-%.4s-%.4s-%.12s", h, h + 8, h + 12, h + 16, h + 20);
}

static void put_le32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}
static uint32_t get_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* CRC-32 (IEEE 802.3), the checksum of every log record and index file,
 * continued from `crc` (0 to start). Eight bytes a step ("slicing by 8"):
 * start-up reads every byte it trusts through this, so it is worth the
 * 8 KiB table, about five times the speed of a byte at a time. */
static uint32_t crc32_more(uint32_t crc, const void *data, size_t n) {
    static uint32_t t[8][256];
    if (!t[0][1])
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            t[0][i] = c;
        }
    if (!t[7][1])
        for (int k = 1; k < 8; k++)
            for (int i = 0; i < 256; i++) t[k][i] = t[0][t[k - 1][i] & 0xFF] ^ (t[k - 1][i] >> 8);
    const uint8_t *p = data;
    uint32_t c = ~crc;
    for (; n >= 8; p += 8, n -= 8) {
        uint32_t lo = c ^ get_le32(p), hi = get_le32(p + 4);
        c = t[7][lo & 0xFF] ^ t[6][lo >> 8 & 0xFF] ^ t[5][lo >> 16 & 0xFF] ^ t[4][lo >> 24] ^
            t[3][hi & 0xFF] ^ t[2][hi >> 8 & 0xFF] ^ t[1][hi >> 16 & 0xFF] ^ t[0][hi >> 24];
    }
    while (n--) c = t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return ~c;
}

static uint32_t crc32(const void *data, size_t n) { return crc32_more(0, data, n); }

/* A hash table of pointers to items that carry their own key (open
 * addressing, linear probing). `key` returns an item's key bytes. Every
 * lookup in what grows with use goes through one: groups and keys by id,
 * keys by secret hash, idempotency records, the cache, client addresses,
 * the ledger's names. The short lists fixed by the catalog or a group --
 * the catalog's models (catalog_model), a group's allowed models and
 * fallbacks -- are scanned. */
#define HMAP_TOMB ((void *)1)
typedef struct {
    void **slot;
    size_t cap, used, live; /* used counts tombstones too */
    const void *(*key)(const void *item, size_t *n);
} hmap;

static uint64_t hash_bytes(const void *p, size_t n) {
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 1099511628211ULL;
    return h;
}

static size_t hmap_find(const hmap *m, const void *k, size_t n) {
    size_t i = (size_t)hash_bytes(k, n) & (m->cap - 1);
    for (;; i = (i + 1) & (m->cap - 1)) {
        void *it = m->slot[i];
        if (!it) return i;
        if (it == HMAP_TOMB) continue;
        size_t kn;
        const void *kk = m->key(it, &kn);
        if (kn == n && memcmp(kk, k, n) == 0) return i;
    }
}

static void *hmap_get(const hmap *m, const void *k, size_t n) {
    if (!m->cap) return NULL;
    void *it = m->slot[hmap_find(m, k, n)];
    return it == HMAP_TOMB ? NULL : it;
}

static void hmap_put(hmap *m, void *item);

static void hmap_grow(hmap *m) {
    hmap old = *m;
    m->cap = m->cap ? (m->live * 4 > m->cap ? m->cap * 2 : m->cap) : 64;
    m->slot = xcalloc(m->cap, sizeof *m->slot);
    m->used = m->live = 0;
    for (size_t i = 0; i < old.cap; i++)
        if (old.slot[i] && old.slot[i] != HMAP_TOMB) hmap_put(m, old.slot[i]);
    free(old.slot);
}

/* Insert or replace the item with the same key. */
static void hmap_put(hmap *m, void *item) {
    if ((m->used + 1) * 4 > m->cap * 3) hmap_grow(m);
    size_t n;
    const void *k = m->key(item, &n);
    size_t i = hmap_find(m, k, n);
    if (!m->slot[i]) {
        m->used++;
        m->live++;
    }
    m->slot[i] = item;
}

static void *hmap_del(hmap *m, const void *k, size_t n) {
    if (!m->cap) return NULL;
    size_t i = hmap_find(m, k, n);
    void *it = m->slot[i];
    if (!it) return NULL;
    m->slot[i] = HMAP_TOMB;
    m->live--;
    return it;
}

/* Metrics: counters and histograms, each a *series* named by its family
 * and its label values (Prometheus's data model), in one hash table. The
 * label values are catalog aliases, provider and group names and fixed
 * words, so the table's size follows the catalog and the groups, never the
 * traffic; it is still capped at METRICS_MAX_SERIES, past which an
 * observation is counted as dropped instead. Section 19 writes them out. */
#define METRICS_MAX_SERIES 4096
#define NBUCKETS 15
static const double BUCKETS[NBUCKETS] = {
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300
};

enum {
    M_REQUESTS, M_DURATION, M_ATTEMPTS, M_TTFT, M_TOKENS, M_HOLD_EXCEEDED, M_SPEND, M_TLS,
    M_CACHE, M_LEDGER, M_FSYNC, M_KEY_FAILS, M_RATE_LIMITED, M_CLUSTER_CALL, M_DROPPED,
    M_TRANSLATED, M_XL_DROPPED, NFAMILIES
};

typedef struct {
    double v;        /* a counter's value; a histogram's sum */
    /* a histogram's counts per bucket, then +Inf (the count); NULL for a counter */
    uint64_t *b;
    size_t n;        /* bytes of key: the family (one byte), then the labels as written */
    char key[];
} series;

static const void *series_key(const void *it, size_t *n) {
    *n = ((const series *)it)->n;
    return ((const series *)it)->key;
}
static hmap METRICS = {.key = series_key};

/* A series' key: the family, then the labels, given as name, value pairs
 * ending with NULL, as the text format writes them (values escaped). */
#define SERIES_KEY_MAX 1024
static size_t series_keyv(char key[SERIES_KEY_MAX], int fam, va_list ap) {
    size_t n = 1;
    key[0] = (char)fam;
    for (const char *name; (name = va_arg(ap, const char *));) {
        const char *v = va_arg(ap, const char *);
        /* never: names are words, values bounded (aliases, group names) */
        size_t l = strlen(name);
        if (n + l + 8 > SERIES_KEY_MAX) break;
        if (n > 1) key[n++] = ',';
        memcpy(key + n, name, l);
        memcpy(key + n + l, "=\"", 2);
        n += l + 2;
        for (; v && *v && n + 3 < SERIES_KEY_MAX; v++) {
            if (*v == '\\' || *v == '"' || *v == '\n') key[n++] = '\\';
            key[n++] = *v == '\n' ? 'n' : *v;
        }
        key[n++] = '"';
    }
    return n;
}

/* The series of `fam` with those labels, made on first use; NULL when the
 * table is full. */
static series *series_vget(int fam, int histogram, va_list ap) {
    char key[SERIES_KEY_MAX];
    size_t n = series_keyv(key, fam, ap);
    series *s = hmap_get(&METRICS, key, n);
    if (s || METRICS.live >= METRICS_MAX_SERIES) return s;
    s = xcalloc(1, sizeof *s + n);
    memcpy(s->key, key, s->n = n);
    if (histogram) s->b = xcalloc(NBUCKETS + 1, sizeof *s->b);
    hmap_put(&METRICS, s);
    return s;
}

static void metric_dropped(void);

/* Add v to a counter: metric_add(M_ATTEMPTS, 1, "model", alias, "outcome", name, NULL). */
static void metric_add(int fam, double v, ...) {
    va_list ap;
    va_start(ap, v);
    series *s = series_vget(fam, 0, ap);
    va_end(ap);
    if (s) s->v += v;
    else metric_dropped();
}

/* One observation of `seconds` in a histogram. */
static void metric_observe(int fam, double seconds, ...) {
    va_list ap;
    va_start(ap, seconds);
    series *s = series_vget(fam, 1, ap);
    va_end(ap);
    if (!s) { metric_dropped(); return; }
    s->v += seconds;
    for (int i = 0; i < NBUCKETS; i++) s->b[i] += seconds <= BUCKETS[i];
    s->b[NBUCKETS]++;
}

/* Drop the series of `fam` whose labels begin with the ones given (a
 * deleted group's). */
static void metric_forget(int fam, ...) {
    char key[SERIES_KEY_MAX];
    va_list ap;
    va_start(ap, fam);
    size_t n = series_keyv(key, fam, ap);
    va_end(ap);
    for (size_t i = 0; i < METRICS.cap; i++) {
        series *s = METRICS.slot[i];
        if (s == HMAP_TOMB || !s || s->n < n || memcmp(s->key, key, n) != 0 ||
            (s->n > n && s->key[n] != ','))
            continue;
        hmap_del(&METRICS, s->key, s->n);
        free(s->b);
        free(s);
    }
}

static void metric_dropped(void) {
    series *s = hmap_get(&METRICS, (char[]){M_DROPPED}, 1);
    if (!s) { /* its own slot is kept free for it: made past the cap */
        s = xcalloc(1, sizeof *s + 1);
        s->key[0] = M_DROPPED;
        s->n = 1;
        hmap_put(&METRICS, s);
    }
    s->v++;
}

/* Parse a numeric IPv4 or IPv6 address into `ss` (port 0). */
static int addr_parse(const char *s, struct sockaddr_storage *ss) {
    memset(ss, 0, sizeof *ss);
    struct sockaddr_in *a4 = (struct sockaddr_in *)ss;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)ss;
    if (inet_pton(AF_INET, s, &a4->sin_addr) == 1) { a4->sin_family = AF_INET; return 0; }
    if (inet_pton(AF_INET6, s, &a6->sin6_addr) == 1) { a6->sin6_family = AF_INET6; return 0; }
    return LTG_ERR;
}

static void addr_set_port(struct sockaddr_storage *ss, int port) {
    if (ss->ss_family == AF_INET) ((struct sockaddr_in *)ss)->sin_port = htons((uint16_t)port);
    else ((struct sockaddr_in6 *)ss)->sin6_port = htons((uint16_t)port);
}

static socklen_t addr_len(const struct sockaddr_storage *ss) {
    return ss->ss_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
}

/* ===== 3. JSON reader and writer =====
 *
 * IMPLEMENTATION NOTES
 * The reader is recursive descent over RFC 8259, bounded by JSON_MAX_DEPTH,
 * and it is strict: no trailing commas, no comments, no leading zeros, no
 * raw control characters in strings, UTF-8 checked byte by byte (overlong
 * forms, surrogates and code points past U+10FFFF are refused). Errors name
 * the byte offset, which reaches the client in the 400 message. Strings
 * stay escaped (ltg.h) because most of them are never looked at. The
 * writer keeps one bit per nesting level: is a comma due?
 */
/* a member name of an open object (json_scan) */
typedef struct { uint32_t start, end; uint64_t h; } jkey;

typedef struct {
    const char *s;
    size_t len, i;
    json_tok *t;
    int max, n, store_depth;
    json_result *res;
    int scan;                   /* json_scan: check names, call `member` */
    jkey *keys;                 /* the names of the objects open on the path, innermost last */
    int nkeys, capkeys;
    json_member_fn *member;
    void *ctx;
} jparser;

#define JSON_SCAN_MAX_KEYS 65536 /* member names of the objects open at once, for json_scan */

static int jp_fail(jparser *p, const char *why) {
    p->res->err = why;
    p->res->err_offset = p->i;
    return LTG_ERR;
}

static void jp_ws(jparser *p) {
    while (p->i < p->len &&
           (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\n' || p->s[p->i] == '\r'))
        p->i++;
}

/* Store a token if this depth is stored; returns its index, -1 when not
 * stored, or LTG_ERR (-1 is never both: see the callers). */
static int jp_token(jparser *p, json_type type, int depth, int *idx) {
    *idx = -1;
    /* json_scan stores nothing */
    if (!p->t || (p->store_depth >= 0 && depth > p->store_depth)) return 0;
    if (p->n >= p->max) return jp_fail(p, "too many JSON values");
    json_tok *t = &p->t[p->n];
    t->type = type;
    t->start = (uint32_t)p->i;
    t->end = (uint32_t)p->i;
    t->size = 0;
    t->next = p->n + 1;
    *idx = p->n++;
    return 0;
}

/* Length of the UTF-8 sequence at s[i..len), or 0 when it is invalid. */
static int utf8_len(const unsigned char *s, size_t i, size_t len) {
    unsigned c = s[i];
    if (c < 0x80) return 1;
    int n;
    unsigned min, cp;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
        min = 0x80;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        min = 0x800;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        min = 0x10000;
        cp = c & 0x07;
    } else return 0;
    if (i + n > len) return 0;
    for (int k = 1; k < n; k++) {
        if ((s[i + k] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return n;
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* n hex digits of s as n/2 bytes: 0, or LTG_ERR at a character that is not one. */
static int hex_decode(const char *s, size_t n, uint8_t *out) {
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval((unsigned char)s[2 * i]), lo = hexval((unsigned char)s[2 * i + 1]);
        if (hi < 0 || lo < 0) return LTG_ERR;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return 0;
}

/* A byte a JSON string holds as it is, read or written: printable ASCII but the quote and the
 * backslash (the reader, the writer and jw_key take runs of them at once). */
static int json_plain(unsigned char c) { return c >= 0x20 && c < 0x80 && c != '"' && c != '\\'; }

static int jp_string(jparser *p, int depth) {
    int k;
    p->i++; /* the opening quote */
    if (jp_token(p, JSON_STRING, depth, &k) < 0) return LTG_ERR;
    const unsigned char *s = (const unsigned char *)p->s;
    const size_t len = p->len;
    while (p->i < len) {
        /* most bytes: json_plain's, written out (the compiler makes a loop a seventh shorter
         * of it), in a local index (p->i could alias s) */
        size_t i = p->i;
        while (i < len && s[i] >= 0x20 && s[i] < 0x80 && s[i] != '"' && s[i] != '\\') i++;
        if ((p->i = i) == len) break;
        unsigned c = s[i];
        if (c == '"') {
            if (k >= 0) p->t[k].end = (uint32_t)p->i;
            p->i++;
            return 0;
        }
        if (c < 0x20) return jp_fail(p, "control character in string (escape it)");
        if (c == '\\') {
            if (p->i + 1 >= p->len) break;
            c = s[p->i + 1];
            if (c == 'u') {
                if (p->i + 6 > p->len) break;
                for (int h = 2; h < 6; h++)
                    if (hexval(s[p->i + h]) < 0) { p->i += h; return jp_fail(p, "bad \\u escape"); }
                p->i += 6;
            } else if (strchr("\"\\/bfnrt", (int)c) && c) {
                p->i += 2;
            } else {
                p->i++;
                return jp_fail(p, "bad escape in string");
            }
            continue;
        }
        int n = utf8_len(s, p->i, p->len);
        if (!n) return jp_fail(p, "invalid UTF-8 in string");
        p->i += n;
    }
    return jp_fail(p, "unterminated string");
}

static int jp_number(jparser *p, int depth) {
    int k;
    if (jp_token(p, JSON_NUMBER, depth, &k) < 0) return LTG_ERR;
    const char *s = p->s;
    size_t i = p->i;
    if (i < p->len && s[i] == '-') i++;
    if (i < p->len && s[i] == '0') i++;
    else if (i < p->len && s[i] >= '1' && s[i] <= '9')
        while (i < p->len && isdigit((unsigned char)s[i])) i++;
    else { p->i = i; return jp_fail(p, "bad number"); }
    if (i < p->len && s[i] == '.') {
        i++;
        if (i >= p->len || !isdigit((unsigned char)s[i])) {
            p->i = i;
            return jp_fail(p, "bad number: digit expected after '.'");
        }
        while (i < p->len && isdigit((unsigned char)s[i])) i++;
    }
    if (i < p->len && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < p->len && (s[i] == '+' || s[i] == '-')) i++;
        if (i >= p->len || !isdigit((unsigned char)s[i])) {
            p->i = i;
            return jp_fail(p, "bad number: digit expected in exponent");
        }
        while (i < p->len && isdigit((unsigned char)s[i])) i++;
    }
    p->i = i;
    if (k >= 0) p->t[k].end = (uint32_t)i;
    return 0;
}

/* The bytes of name [start, end) unescaped: in place when it has no escape, else in *tmp. */
static const char *jp_name_bytes(const jparser *p, uint32_t start, uint32_t end, buf *tmp,
                                 size_t *n) {
    if (!memchr(p->s + start, '\\', end - start)) { *n = end - start; return p->s + start; }
    json_tok t = {JSON_STRING, start, end, 0, 1};
    tmp->len = 0;
    json_unescape(p->s, &t, 0, tmp);
    *n = tmp->len;
    return tmp->p;
}

/* json_scan: a member name [start, end) of the innermost open object. */
static int jp_name(jparser *p, size_t start, size_t end) {
    if (p->nkeys == JSON_SCAN_MAX_KEYS)
        return jp_fail(p, "too many member names in the objects open at once");
    if (p->nkeys == p->capkeys) {
        p->capkeys = p->capkeys ? p->capkeys * 2 : 64;
        p->keys = xrealloc(p->keys, (size_t)p->capkeys * sizeof *p->keys);
    }
    buf tmp = {0};
    size_t n;
    const char *b = jp_name_bytes(p, (uint32_t)start, (uint32_t)end, &tmp, &n);
    p->keys[p->nkeys++] = (jkey){(uint32_t)start, (uint32_t)end, hash_bytes(b, n)};
    buf_free(&tmp);
    return 0;
}

static const jparser *jkey_doc; /* for the comparator: qsort has no context */

/* By hash, then by the names themselves (equal names are neighbours even
 * when other names share their hash), then by place. */
static int jkey_cmp(const void *a, const void *b) {
    const jkey *x = a, *y = b;
    if (x->h != y->h) return (x->h > y->h) - (x->h < y->h);
    buf ta = {0}, tb = {0};
    size_t na, nb;
    const char *sa = jp_name_bytes(jkey_doc, x->start, x->end, &ta, &na),
               *sb = jp_name_bytes(jkey_doc, y->start, y->end, &tb, &nb);
    int c = memcmp(sa, sb, na < nb ? na : nb);
    if (!c) c = (na > nb) - (na < nb);
    buf_free(&ta);
    buf_free(&tb);
    return c ? c : (x->start > y->start) - (x->start < y->start);
}

/* json_scan: an object closed; its names are keys[base..]: each must be
 * there once. Sorted by hash, so equal names are neighbours: n log n. */
static int jp_names_unique(jparser *p, int base) {
    jkey *k = p->keys + base;
    int n = p->nkeys - base, dup = -1;
    jkey_doc = p;
    qsort(k, (size_t)n, sizeof *k, jkey_cmp);
    buf ta = {0}, tb = {0};
    for (int i = 1; i < n && dup < 0; i++) {
        size_t na, nb;
        if (k[i].h != k[i - 1].h) continue;
        const char *a = jp_name_bytes(p, k[i - 1].start, k[i - 1].end, &ta, &na),
                   *b = jp_name_bytes(p, k[i].start, k[i].end, &tb, &nb);
        if (na == nb && memcmp(a, b, na) == 0) dup = i;
    }
    buf_free(&ta);
    buf_free(&tb);
    p->nkeys = base;
    if (dup < 0) return 0;
    p->i = k[dup].start;
    return jp_fail(p, "a member name repeated in one object");
}

/* true, false or null. */
static int jp_literal(jparser *p, int depth) {
    static const struct { const char *word; json_type type; } lits[] = {
        {"true", JSON_TRUE}, {"false", JSON_FALSE}, {"null", JSON_NULL}};
    for (int w = 0; w < 3; w++) {
        size_t n = strlen(lits[w].word);
        if (p->len - p->i >= n && memcmp(p->s + p->i, lits[w].word, n) == 0) {
            int k;
            if (jp_token(p, lits[w].type, depth, &k) < 0) return LTG_ERR;
            p->i += n;
            if (k >= 0) p->t[k].end = (uint32_t)p->i;
            return 0;
        }
    }
    return jp_fail(p, "unexpected character");
}

static int jp_value(jparser *p, int depth) {
    jp_ws(p);
    if (p->i >= p->len) return jp_fail(p, "unexpected end of JSON");
    char c = p->s[p->i];
    if (c == '{' || c == '[') {
        if (depth >= JSON_MAX_DEPTH) return jp_fail(p, "JSON nested too deeply");
        int k;
        if (jp_token(p, c == '{' ? JSON_OBJECT : JSON_ARRAY, depth, &k) < 0) return LTG_ERR;
        char close = c == '{' ? '}' : ']';
        p->i++;
        jp_ws(p);
        if (p->i < p->len && p->s[p->i] == close) {
            p->i++;
        } else {
            int base = p->nkeys;
            for (;;) {
                size_t name = 0, vat;
                if (c == '{') {
                    jp_ws(p);
                    if (p->i >= p->len || p->s[p->i] != '"')
                        return jp_fail(p, "expected a string key");
                    name = p->i + 1;
                    if (jp_string(p, depth + 1) < 0 || (p->scan && jp_name(p, name, p->i - 1) < 0))
                        return LTG_ERR;
                    jp_ws(p);
                    if (p->i >= p->len || p->s[p->i] != ':') return jp_fail(p, "expected ':'");
                    p->i++;
                    jp_ws(p);
                }
                vat = p->i;
                if (jp_value(p, depth + 1) < 0) return LTG_ERR;
                if (p->member && name && p->s[vat] == '"')
                    p->member(p->ctx, p->s + name, p->keys[p->nkeys - 1].end - name, p->s + vat + 1,
                              p->i - vat - 2);
                if (k >= 0) p->t[k].size++;
                jp_ws(p);
                if (p->i < p->len && p->s[p->i] == ',') { p->i++; continue; }
                if (p->i < p->len && p->s[p->i] == close) { p->i++; break; }
                return jp_fail(p, c == '{' ? "expected ',' or '}'" : "expected ',' or ']'");
            }
            if (p->scan && c == '{' && jp_names_unique(p, base) < 0) return LTG_ERR;
        }
        if (k >= 0) {
            p->t[k].end = (uint32_t)p->i;
            p->t[k].next = p->n;
        }
        return 0;
    }
    if (c == '"') return jp_string(p, depth);
    if (c == '-' || (c >= '0' && c <= '9')) return jp_number(p, depth);
    return jp_literal(p, depth);
}

/* see ltg.h */
int json_parse(const char *s, size_t len, json_tok *t, int max, int store_depth, json_result *res) {
    jparser p = {.s = s, .len = len, .t = t, .max = max, .store_depth = store_depth, .res = res};
    res->ntok = 0;
    res->err = NULL;
    res->err_offset = 0;
    if (len >= UINT32_MAX) return jp_fail(&p, "JSON document too large");
    if (jp_value(&p, 0) < 0) return LTG_ERR;
    jp_ws(&p);
    if (p.i != len) return jp_fail(&p, "unexpected data after the JSON value");
    res->ntok = p.n;
    return 0;
}

/* see ltg.h */
int json_scan(const char *s, size_t len, json_member_fn *member, void *ctx, json_result *res) {
    jparser p = {.s = s, .len = len, .res = res, .scan = 1, .member = member, .ctx = ctx};
    res->ntok = 0;
    res->err = NULL;
    res->err_offset = 0;
    int rc = len >= UINT32_MAX ? jp_fail(&p, "JSON document too large") : jp_value(&p, 0);
    if (rc == 0) {
        jp_ws(&p);
        if (p.i != len) rc = jp_fail(&p, "unexpected data after the JSON value");
    }
    free(p.keys);
    return rc;
}

/* see ltg.h */
int json_get(const char *s, const json_tok *t, int obj, const char *key) {
    /* members not stored */
    if (obj < 0 || t[obj].type != JSON_OBJECT || t[obj].next == obj + 1) return -1;
    int i = obj + 1;
    for (int m = 0; m < t[obj].size; m++) {
        if (json_eq(s, t, i, key)) return i + 1;
        i = t[i + 1].next;
    }
    return -1;
}

/* see ltg.h */
void json_unescape(const char *s, const json_tok *t, int i, buf *out) {
    const char *p = s + t[i].start, *end = s + t[i].end;
    buf_reserve(out, (size_t)(end - p));
    while (p < end) {
        if (*p != '\\') { out->p[out->len++] = *p++; continue; }
        char c = p[1];
        p += 2;
        unsigned cp;
        switch (c) {
        case 'b': cp = '\b'; break;
        case 'f': cp = '\f'; break;
        case 'n': cp = '\n'; break;
        case 'r': cp = '\r'; break;
        case 't': cp = '\t'; break;
        case 'u':
            cp = (unsigned)(hexval(p[0]) << 12 | hexval(p[1]) << 8 | hexval(p[2]) << 4 |
                            hexval(p[3]));
            p += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF && end - p >= 6 && p[0] == '\\' && p[1] == 'u') {
                unsigned lo = (unsigned)(hexval(p[2]) << 12 | hexval(p[3]) << 8 |
                                         hexval(p[4]) << 4 | hexval(p[5]));
                if (lo >= 0xDC00 && lo <= 0xDFFF) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    p += 6;
                }
            }
            if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD; /* a lone surrogate */
            break;
        default: cp = (unsigned char)c; break; /* " \ / */
        }
        char u[4];
        int n;
        if (cp < 0x80) {
            u[0] = (char)cp;
            n = 1;
        } else if (cp < 0x800) {
            u[0] = (char)(0xC0 | cp >> 6);
            u[1] = (char)(0x80 | (cp & 0x3F));
            n = 2;
        } else if (cp < 0x10000) {
            u[0] = (char)(0xE0 | cp >> 12);
            u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
            u[2] = (char)(0x80 | (cp & 0x3F));
            n = 3;
        } else {
            u[0] = (char)(0xF0 | cp >> 18);
            u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
            u[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
            u[3] = (char)(0x80 | (cp & 0x3F));
            n = 4;
        }
        buf_reserve(out, (size_t)(end - p) + 4);
        memcpy(out->p + out->len, u, (size_t)n);
        out->len += (size_t)n;
    }
    out->p[out->len] = 0;
}

/* see ltg.h */
int json_duplicate_key(const char *s, const json_tok *t, int obj) {
    if (obj < 0 || t[obj].type != JSON_OBJECT || t[obj].next == obj + 1) return -1;
    int n = t[obj].size, dup = -1;
    buf *keys = xcalloc((size_t)n, sizeof *keys);
    int i = obj + 1;
    for (int m = 0; m < n && dup < 0; m++, i = t[i + 1].next) {
        json_unescape(s, t, i, &keys[m]);
        for (int k = 0; k < m && dup < 0; k++)
            if (keys[k].len == keys[m].len && memcmp(keys[k].p, keys[m].p, keys[m].len) == 0)
                dup = i;
    }
    for (int m = 0; m < n; m++) buf_free(&keys[m]);
    free(keys);
    return dup;
}

/* see ltg.h */
int json_eq(const char *s, const json_tok *t, int i, const char *lit) {
    if (i < 0 || t[i].type != JSON_STRING) return 0;
    size_t n = t[i].end - t[i].start;
    /* an escape is longer than what it stands for (and a literal has none): only a longer
     * token can be equal once unescaped */
    size_t l = strlen(lit);
    if (n <= l) return n == l && memcmp(s + t[i].start, lit, n) == 0;
    if (!memchr(s + t[i].start, '\\', n)) return 0;
    buf b = {0};
    json_unescape(s, t, i, &b);
    int eq = b.len == strlen(lit) && memcmp(b.p, lit, b.len) == 0;
    buf_free(&b);
    return eq;
}

/* see ltg.h */
int json_number(const char *s, const json_tok *t, int i, double *out) {
    if (i < 0 || t[i].type != JSON_NUMBER) return LTG_ERR;
    char tmp[64];
    size_t n = t[i].end - t[i].start;
    if (n >= sizeof tmp) return LTG_ERR;
    memcpy(tmp, s + t[i].start, n);
    tmp[n] = 0;
    *out = strtod(tmp, NULL);
    return isfinite(*out) ? 0 : LTG_ERR;
}

/* String token i unescaped, in a new NUL-terminated allocation. */
static char *json_strdup(const char *s, const json_tok *t, int i) {
    buf b = {0};
    json_unescape(s, t, i, &b);
    if (!b.p) buf_reserve(&b, 0);
    return b.p;
}

/* A whole number in token i; LTG_ERR when it is not one. */
static int json_int(const char *s, const json_tok *t, int i, long long *out) {
    double d;
    size_t n = i >= 0 && t[i].type == JSON_NUMBER ? t[i].end - t[i].start : 0;
    if (n && n <= 15) { /* digits alone, as most counts are: no strtod */
        long long v = 0;
        size_t j = 0;
        for (const char *p = s + t[i].start; j < n && p[j] >= '0' && p[j] <= '9'; j++)
            v = v * 10 + (p[j] - '0');
        if (j == n) return *out = v, 0;
    }
    if (json_number(s, t, i, &d) < 0 || d != floor(d) || fabs(d) > 1e15) return LTG_ERR;
    *out = (long long)d;
    return 0;
}

/* ---- walking a document already validated ----
 * The translator (section 17) reads a client's body, which admission validated whole, and a
 * provider's answer or event, which usage_read validated: one container at a time, storing
 * nothing. jv_at reads the value at an offset into a token of json_parse's shape (a string's
 * bytes between its quotes; size and next unset), jv_next steps through a container's members
 * or elements, jv_get finds a member, jv_members several in one walk, jv_next_members the
 * elements of an array of objects with their members, each element walked once. A conversation
 * of any length costs no token array. Only for a document json_parse accepted: nothing here
 * checks the grammar. */
static size_t jv_ws(const char *s, size_t n, size_t i) {
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
    return i;
}

/* The offset just past the string whose opening quote is s[i]: the quote that no odd run of
 * backslashes escapes. */
static size_t jv_string_end(const char *s, size_t n, size_t i) {
    for (size_t b = 1; b & 1;) {
        const char *q = i + 1 < n ? memchr(s + i + 1, '"', n - i - 1) : NULL;
        if (!q) return n;
        i = (size_t)(q - s);
        for (b = 0; s[i - 1 - b] == '\\'; b++) {}
    }
    return i + 1;
}

/* The offset just past the value that starts at s[i] (after white space). */
static size_t jv_skip(const char *s, size_t n, size_t i) {
    int depth = 0;
    i = jv_ws(s, n, i);
    do {
        if (i >= n) return n;
        char c = s[i];
        if (c == '"') {
            i = jv_string_end(s, n, i);
        } else if (c == '{' || c == '[') {
            depth++, i++;
        } else if (c == '}' || c == ']') {
            depth--, i++;
        } else if (depth == 0) { /* a number or a literal, alone: to what ends it */
            while (i < n && s[i] != ',' && s[i] != '}' && s[i] != ']' && s[i] != ' ' &&
                   s[i] != '\n' && s[i] != '\r' && s[i] != '\t')
                i++;
        } else {
            i++;
        }
    } while (depth > 0);
    return i;
}

/* The value s[i..end) as a token (a string's without its quotes). */
static json_tok jv_span(const char *s, size_t n, size_t i, size_t end) {
    char c = i < n ? s[i] : 'n';
    json_type type = c == '{'   ? JSON_OBJECT
                     : c == '[' ? JSON_ARRAY
                     : c == '"' ? JSON_STRING
                     : c == 't' ? JSON_TRUE
                     : c == 'f' ? JSON_FALSE
                     : c == 'n' ? JSON_NULL
                                : JSON_NUMBER;
    if (type == JSON_STRING) return (json_tok){type, (uint32_t)i + 1, (uint32_t)end - 1, 0, 0};
    return (json_tok){type, (uint32_t)i, (uint32_t)end, 0, 0};
}

static json_tok jv_at(const char *s, size_t n, size_t i) {
    i = jv_ws(s, n, i);
    return jv_span(s, n, i, jv_skip(s, n, i));
}

/* The whole document s[0..n), one value between white space, without walking it. */
static json_tok jv_doc(const char *s, size_t n) {
    size_t i = jv_ws(s, n, 0);
    while (n > i && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\n' || s[n - 1] == '\r'))
        n--;
    return jv_span(s, n, i, n);
}

/* The next member (key and value) or element (value) of container c; *pos is 0 before the
 * first. 0 when there is none left. */
static int jv_next(const char *s, size_t n, const json_tok *c, size_t *pos, json_tok *key,
                   json_tok *val) {
    size_t i = jv_ws(s, n, *pos ? *pos : c->start + 1);
    if (i < n && s[i] == ',') i = jv_ws(s, n, i + 1);
    if (i >= c->end - 1) return 0;
    if (c->type == JSON_OBJECT) { /* a name: a string */
        size_t e = jv_string_end(s, n, i);
        *key = (json_tok){JSON_STRING, (uint32_t)i + 1, (uint32_t)e - 1, 0, 0};
        i = jv_ws(s, n, e) + 1; /* past the ':' */
    }
    *val = jv_at(s, n, i); /* each value skipped once: *pos is where it ends */
    *pos = val->end + (val->type == JSON_STRING);
    return 1;
}

/* The value of member `name` of object o; 0 when it has none (or o is not an object), *val
 * then an empty null: never a neighbour's value, never unset. */
static int jv_get(const char *s, size_t n, const json_tok *o, const char *name, json_tok *val) {
    size_t pos = 0;
    json_tok k, v;
    *val = (json_tok){JSON_NULL, 0, 0, 0, 0};
    if (o->type != JSON_OBJECT) return 0;
    while (jv_next(s, n, o, &pos, &k, &v))
        if (json_eq(s, &k, 0, name)) {
            *val = v;
            return 1;
        }
    return 0;
}

/* The members `names` (NULL-ended, at most 32) of the object whose '{' is s[i], in one walk:
 * vals[i] for each found (the first of a repeated name), its bit in *got; the offset just past
 * the object's '}'. With `all` the bits of every name, the walk stops once all are found (and
 * returns 0): the rest of an answer, its usage say, is not skipped through. */
static size_t jv_walk(const char *s, size_t n, size_t i, const char *const *names,
                      json_tok *vals, unsigned *got, unsigned all) {
    for (i = jv_ws(s, n, i + 1); i < n && s[i] != '}'; i = jv_ws(s, n, i)) {
        if (s[i] == ',') i = jv_ws(s, n, i + 1);
        size_t e = jv_string_end(s, n, i);
        json_tok k = {JSON_STRING, (uint32_t)i + 1, (uint32_t)e - 1, 0, 0};
        json_tok v = jv_at(s, n, jv_ws(s, n, e) + 1); /* past the ':' */
        for (int j = 0; names[j]; j++) /* the first byte first (unless it is an escape) */
            if (!(*got >> j & 1) && (s[k.start] == names[j][0] || s[k.start] == '\\') &&
                json_eq(s, &k, 0, names[j])) {
                vals[j] = v, *got |= 1u << j;
                if (*got == all) return 0;
                break;
            }
        i = v.end + (v.type == JSON_STRING);
    }
    return i + 1;
}

/* The members `names` (NULL-ended, at most 32) of object o in one walk: vals[i] for each found
 * (the first of a repeated name), its bit set in the result; an empty null for each not found,
 * as jv_get leaves (o need not be an object: then none is). */
static unsigned jv_members(const char *s, size_t n, const json_tok *o, const char *const *names,
                           json_tok *vals) {
    unsigned got = 0, all = 0;
    for (int i = 0; names[i]; i++) vals[i] = (json_tok){JSON_NULL, 0, 0, 0, 0}, all |= 1u << i;
    if (o->type == JSON_OBJECT) jv_walk(s, n, o->start, names, vals, &got, all);
    return got;
}

/* jv_next for array a whose elements are objects, with each one's members `names` found as
 * jv_members finds them (*got), in the same walk: an element is not skipped, then walked. */
static int jv_next_members(const char *s, size_t n, const json_tok *a, size_t *pos,
                           const char *const *names, json_tok *vals, unsigned *got,
                           json_tok *val) {
    size_t i = jv_ws(s, n, *pos ? *pos : a->start + 1);
    if (i < n && s[i] == ',') i = jv_ws(s, n, i + 1);
    *got = 0;
    for (int j = 0; names[j]; j++) vals[j] = (json_tok){JSON_NULL, 0, 0, 0, 0};
    if (i >= a->end - 1) return 0;
    if (s[i] != '{') {
        *val = jv_at(s, n, i);
        *pos = val->end + (val->type == JSON_STRING);
        return 1;
    }
    *pos = jv_walk(s, n, i, names, vals, got, 0);
    *val = (json_tok){JSON_OBJECT, (uint32_t)i, (uint32_t)*pos, 0, 0};
    return 1;
}

/* The bytes of value v as the document has them (a string with its quotes). */
static void jv_raw(const json_tok *v, uint32_t *at, uint32_t *len) {
    int q = v->type == JSON_STRING;
    *at = v->start - q;
    *len = v->end - v->start + 2 * q;
}

/* see ltg.h */
void jw_init(jwriter *w, buf *out) {
    w->out = out;
    w->depth = 0;
    w->need_comma = 0;
}

static void jw_sep(jwriter *w) {
    uint64_t bit = 1ULL << (w->depth & 63);
    if (w->need_comma & bit) buf_append(w->out, ",", 1);
    w->need_comma |= bit;
}
void jw_open(jwriter *w, char brace) {
    jw_sep(w);
    buf_append(w->out, &brace, 1);
    w->depth++;
    w->need_comma &= ~(1ULL << (w->depth & 63));
}
void jw_close(jwriter *w, char brace) {
    w->depth--;
    buf_append(w->out, &brace, 1);
}
void jw_lit_key(jwriter *w, const char *quoted, size_t n) {
    buf *b = w->out;
    uint64_t bit = 1ULL << (w->depth & 63);
    buf_reserve(b, n + 1);
    if (w->need_comma & bit) b->p[b->len++] = ',';
    memcpy(b->p + b->len, quoted, n + 1); /* and the NUL */
    b->len += n;
    w->need_comma &= ~bit; /* the value follows without a comma */
}
void jw_name(jwriter *w, const char *name) {
    buf *b = w->out;
    uint64_t bit = 1ULL << (w->depth & 63);
    size_t n = 0;
    while (json_plain((unsigned char)name[n])) n++;
    if (name[n]) { /* a name to escape: a model's, say */
        jw_str(w, name, n + strlen(name + n));
        buf_append(b, ":", 1);
    } else { /* most are plain: one copy */
        buf_reserve(b, n + 4); /* a comma, the quotes, the ':' */
        if (w->need_comma & bit) b->p[b->len++] = ',';
        b->p[b->len++] = '"';
        memcpy(b->p + b->len, name, n);
        memcpy(b->p + b->len + n, "\":", 3); /* the closing quote, ':' and the NUL */
        b->len += n + 2;
    }
    w->need_comma &= ~bit; /* the value follows without a comma */
}
void jw_str(jwriter *w, const char *s, size_t n) {
    static const char hex[] = "0123456789abcdef";
    jw_sep(w);
    buf *b = w->out;
    buf_reserve(b, n + 2);
    b->p[b->len++] = '"';
    for (size_t i = 0; i < n;) {
        size_t j = i; /* a run of bytes written as they are: most of a string, in one copy */
        while (j < n && json_plain((unsigned char)s[j])) j++;
        if (j > i) {
            buf_append(b, s + i, j - i);
            i = j;
        }
        if (i == n) break;
        unsigned char c = (unsigned char)s[i];
        buf_reserve(b, 8);
        if (c == '"' || c == '\\') {
            b->p[b->len++] = '\\';
            b->p[b->len++] = (char)c;
            i++;
        } else if (c < 0x20) {
            const char *esc = c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t" : NULL;
            if (esc) {
                memcpy(b->p + b->len, esc, 2);
                b->len += 2;
            } else {
                memcpy(b->p + b->len, "\\u00", 4);
                b->p[b->len + 4] = hex[c >> 4];
                b->p[b->len + 5] = hex[c & 15];
                b->len += 6;
            }
            i++;
        } else if (c < 0x80) {
            b->p[b->len++] = (char)c;
            i++;
        } else {
            int k = utf8_len((const unsigned char *)s, i, n);
            if (k) {
                memcpy(b->p + b->len, s + i, (size_t)k);
                b->len += (size_t)k;
                i += (size_t)k;
            } else {
                memcpy(b->p + b->len, "\xEF\xBF\xBD", 3);
                b->len += 3;
                i++;
            }
        }
    }
    buf_append(b, "\"", 1);
}
void jw_cstr(jwriter *w, const char *s) {
    if (s) jw_str(w, s, strlen(s));
    else jw_null(w);
}
/* v's decimal digits at the end of out (no printf: the event and the access
 * log write a dozen numbers a request). */
static void buf_uint(buf *out, unsigned long long v) {
    char d[24];
    int k = 24;
    do d[--k] = (char)('0' + v % 10), v /= 10;
    while (v);
    buf_append(out, d + k, (size_t)(24 - k));
}

void jw_int(jwriter *w, long long v) {
    jw_sep(w);
    if (v < 0) buf_append(w->out, "-", 1);
    buf_uint(w->out, v < 0 ? 0 - (unsigned long long)v : (unsigned long long)v);
}
void jw_num(jwriter *w, double v) {
    jw_sep(w);
    if (!isfinite(v)) { buf_puts(w->out, "null"); return; }
    buf_printf(w->out, "%.17g", v); /* 17 digits: the same double reads back */
}
void jw_bool(jwriter *w, int v) { jw_sep(w); buf_puts(w->out, v ? "true" : "false"); }
void jw_null(jwriter *w) { jw_sep(w); buf_puts(w->out, "null"); }
void jw_raw(jwriter *w, const char *json, size_t n) { jw_sep(w); buf_append(w->out, json, n); }

/* A string, or null for NULL or "". */
static void jw_str_or_null(jwriter *w, const char *s) { jw_cstr(w, s && *s ? s : NULL); }

/* A number that may be unknown: null when it is. */
static void jw_int_or_null(jwriter *w, int known, long long v) {
    if (known) jw_int(w, v);
    else jw_null(w);
}

/* Money: micro-USD written as a plain decimal, "0.000096" (never 9.6e-05). */
/* micro-USD as USD with six decimals, at the end of out. */
static void buf_usd(buf *out, int64_t micro) {
    /* no overflow, even at INT64_MIN */
    uint64_t u = micro < 0 ? 0 - (uint64_t)micro : (uint64_t)micro;
    char frac[8] = {'.'};
    if (micro < 0) buf_puts(out, "-");
    buf_uint(out, u / 1000000);
    for (int i = 6, f = (int)(u % 1000000); i >= 1; i--, f /= 10) frac[i] = (char)('0' + f % 10);
    buf_append(out, frac, 7);
}

static void jw_usd(jwriter *w, int64_t micro) {
    jw_sep(w);
    buf_usd(w->out, micro);
}

/* A time in ISO 8601, or its date alone ("2026-11-29"). */
static void jw_time(jwriter *w, int64_t ms, int date_only) {
    char ts[64];
    iso_time(ms, ts);
    if (date_only) ts[10] = 0;
    jw_cstr(w, ts);
}

/* ===== 4. HTTP/1.1 messages: heads, chunked coding, SSE =====
 *
 * IMPLEMENTATION NOTES
 * Beyond ltg.h's contract (picohttpparser's), the parsers are strict where
 * leniency lets two parties disagree about where a message ends, which is
 * how request smuggling works: lines end in CRLF, obsolete line folding and
 * NUL bytes are refused, a message with both Content-Length and
 * Transfer-Encoding is refused, two different Content-Lengths are refused,
 * and the only transfer coding is "chunked".
 */
static int is_tchar(int c) { return c > 32 && c < 127 && !strchr("\"(),/:;<=>?@[\\]{}", c); }

/* see ltg.h */
int http_head_end(const char *b, size_t len, size_t *scan) {
    size_t i = *scan;
    while (i < len) {
        const char *nl = memchr(b + i, '\n', len - i);
        if (!nl) break;
        size_t k = (size_t)(nl - b);
        if (k + 1 >= len || (b[k + 1] == '\r' && k + 2 >= len)) { *scan = k; return LTG_AGAIN; }
        if (b[k + 1] == '\n') return (int)(k + 2); /* bare LF: the parser refuses it */
        if (b[k + 1] == '\r' && b[k + 2] == '\n') return (int)(k + 3);
        i = k + 1;
    }
    *scan = len;
    return LTG_AGAIN;
}

/* see ltg.h */
const char *http_header_get(const char *b, const http_header *h, int nh, const char *name,
                            size_t *n) {
    for (int i = 0; i < nh; i++)
        if (ascii_casecmp_n(b + h[i].name.off, h[i].name.len, name) == 0) {
            *n = h[i].value.len;
            return b + h[i].value.off;
        }
    return NULL;
}

/* Parse header lines from b[i..len) into h[]; the head ends with an empty
 * line. Returns the index after it, or LTG_ERR with *err (and *status for
 * a request) set. */
static int http_parse_headers(const char *b, size_t len, size_t i, http_header *h, int *nh,
                              const char **err, int *status) {
    *nh = 0;
    for (;;) {
        if (i + 1 < len && b[i] == '\r' && b[i + 1] == '\n') return (int)(i + 2);
        if (i < len && (b[i] == ' ' || b[i] == '\t')) {
            *err = "obsolete line folding is not allowed";
            return LTG_ERR;
        }
        size_t s = i;
        while (i < len && is_tchar((unsigned char)b[i])) i++;
        if (i == s || i >= len || b[i] != ':') { *err = "malformed header line"; return LTG_ERR; }
        slice name = {(uint32_t)s, (uint32_t)(i - s)};
        i++;
        while (i < len && (b[i] == ' ' || b[i] == '\t')) i++;
        s = i;
        while (i < len && b[i] != '\r' && b[i] != '\n') {
            unsigned char c = (unsigned char)b[i];
            if ((c < 32 && c != '\t') || c == 127) {
                *err = "invalid character in a header value";
                return LTG_ERR;
            }
            i++;
        }
        if (i + 1 >= len || b[i] != '\r' || b[i + 1] != '\n') {
            *err = "header lines must end with CRLF";
            return LTG_ERR;
        }
        size_t e = i;
        while (e > s && (b[e - 1] == ' ' || b[e - 1] == '\t')) e--;
        if (*nh == HTTP_MAX_HEADERS) {
            *err = "too many header fields";
            *status = 431;
            return LTG_ERR;
        }
        h[*nh].name = name;
        h[*nh].value = (slice){(uint32_t)s, (uint32_t)(e - s)};
        (*nh)++;
        i += 2;
    }
}

/* Does the comma-separated header value v[0..n) hold `token`? */
static int header_has_token(const char *v, size_t n, const char *token) {
    size_t i = 0;
    while (i < n) {
        while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ',')) i++;
        size_t s = i;
        while (i < n && v[i] != ',') i++;
        size_t e = i;
        while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t')) e--;
        if (e > s && ascii_casecmp_n(v + s, e - s, token) == 0) return 1;
    }
    return 0;
}

/* The framing facts of a message: Content-Length, chunked, keep-alive.
 * Shared by requests and responses; returns 0 or LTG_ERR with *err. */
static int http_framing(const char *b, const http_header *h, int nh, int minor, long long *cl,
                        int *chunked, int *keep_alive, const char **err, int *status) {
    *cl = -1;
    *chunked = 0;
    *keep_alive = minor >= 1;
    int te = 0;
    for (int i = 0; i < nh; i++) {
        const char *n = b + h[i].name.off, *v = b + h[i].value.off;
        size_t nl = h[i].name.len, vl = h[i].value.len;
        if (ascii_casecmp_n(n, nl, "content-length") == 0) {
            long long x;
            if (parse_ll(v, vl, LLONG_MAX / 2, &x) < 0) {
                *err = "invalid Content-Length";
                return LTG_ERR;
            }
            if (*cl >= 0 && *cl != x) {
                *err = "conflicting Content-Length headers";
                return LTG_ERR;
            }
            *cl = x;
        } else if (ascii_casecmp_n(n, nl, "transfer-encoding") == 0) {
            if (te || ascii_casecmp_n(v, vl, "chunked") != 0) {
                *err = "only Transfer-Encoding: chunked is supported";
                *status = 501;
                return LTG_ERR;
            }
            te = *chunked = 1;
        } else if (ascii_casecmp_n(n, nl, "connection") == 0) {
            if (header_has_token(v, vl, "close")) *keep_alive = 0;
            else if (header_has_token(v, vl, "keep-alive")) *keep_alive = 1;
        }
    }
    if (te && *cl >= 0) { *err = "both Content-Length and Transfer-Encoding"; return LTG_ERR; }
    /* RFC 9112 6.1: its framing is not to be trusted for a next message */
    if (te && minor == 0) *keep_alive = 0;
    return 0;
}

/* see ltg.h */
int http_parse_request(const char *b, size_t len, http_request *r) {
    r->nh = 0;
    r->status = 400;
    r->err = NULL;
    r->expect_continue = 0;
    size_t i = 0;
    /* RFC 9112 2.2: ignore leading empty lines */
    while (i + 1 < len && b[i] == '\r' && b[i + 1] == '\n') i += 2;
    size_t s = i;
    while (i < len && is_tchar((unsigned char)b[i])) i++;
    if (i == s || i >= len || b[i] != ' ') { r->err = "malformed request line"; return LTG_ERR; }
    r->method = (slice){(uint32_t)s, (uint32_t)(i - s)};
    s = ++i;
    while (i < len && (unsigned char)b[i] > 32 && (unsigned char)b[i] < 127) i++;
    if (i == s || i >= len || b[i] != ' ') { r->err = "malformed request target"; return LTG_ERR; }
    r->target = (slice){(uint32_t)s, (uint32_t)(i - s)};
    if (b[s] != '/' && b[s] != '*') {
        /* absolute-form (RFC 9112 3.2.2): served as its path and query */
        size_t k = s;
        while (k < i && (isalnum((unsigned char)b[k]) || b[k] == '+' || b[k] == '-' || b[k] == '.'))
            k++;
        if (k == s || i - k < 3 || memcmp(b + k, "://", 3) != 0) {
            r->err = "malformed request target";
            return LTG_ERR;
        }
        k += 3;
        while (k < i && b[k] != '/' && b[k] != '?') k++;
        /* "http://h?q" is "?q": no path, no endpoint */
        r->target = (slice){(uint32_t)k, (uint32_t)(i - k)};
    }
    i++;
    if (len - i < 10 || memcmp(b + i, "HTTP/1.", 7) != 0 || !isdigit((unsigned char)b[i + 7]) ||
        b[i + 8] != '\r' || b[i + 9] != '\n') {
        r->err = "malformed HTTP version (HTTP/1.0 or HTTP/1.1 expected)";
        return LTG_ERR;
    }
    r->minor = b[i + 7] - '0';
    int end = http_parse_headers(b, len, i + 10, r->h, &r->nh, &r->err, &r->status);
    if (end < 0) return LTG_ERR;
    if ((size_t)end != len) { r->err = "malformed request head"; return LTG_ERR; }
    if (http_framing(b, r->h, r->nh, r->minor, &r->content_length, &r->chunked, &r->keep_alive,
                     &r->err, &r->status) < 0)
        return LTG_ERR;
    size_t n;
    const char *v = http_header_get(b, r->h, r->nh, "expect", &n);
    if (v) {
        if (ascii_casecmp_n(v, n, "100-continue") != 0) {
            r->err = "unsupported Expect";
            r->status = 417;
            return LTG_ERR;
        }
        r->expect_continue = r->minor >= 1;
    }
    int hosts = 0;
    for (int k = 0; k < r->nh; k++)
        hosts += ascii_casecmp_n(b + r->h[k].name.off, r->h[k].name.len, "host") == 0;
    if (r->minor >= 1 && !hosts) { r->err = "missing Host header"; return LTG_ERR; }
    if (hosts > 1) { r->err = "more than one Host header"; return LTG_ERR; }
    return (int)len;
}

/* see ltg.h */
int http_parse_response(const char *b, size_t len, http_response *r) {
    r->nh = 0;
    r->err = NULL;
    int status_unused = 0;
    if (len < 14 || memcmp(b, "HTTP/1.", 7) != 0 || !isdigit((unsigned char)b[7]) || b[8] != ' ' ||
        !isdigit((unsigned char)b[9]) || !isdigit((unsigned char)b[10]) ||
        !isdigit((unsigned char)b[11])) {
        r->err = "malformed status line";
        return LTG_ERR;
    }
    r->minor = b[7] - '0';
    r->status = (b[9] - '0') * 100 + (b[10] - '0') * 10 + (b[11] - '0');
    /* RFC 9110 15 */
    if (r->status < 100 || r->status > 599) { r->err = "a status outside 100-599"; return LTG_ERR; }
    size_t i = 12;
    if (b[i] == ' ') i++;
    size_t s = i;
    while (i < len && b[i] != '\r' && b[i] != '\n') i++;
    if (i + 1 >= len || b[i] != '\r' || b[i + 1] != '\n') {
        r->err = "malformed status line";
        return LTG_ERR;
    }
    r->reason = (slice){(uint32_t)s, (uint32_t)(i - s)};
    int end = http_parse_headers(b, len, i + 2, r->h, &r->nh, &r->err, &status_unused);
    if (end < 0) return LTG_ERR;
    if ((size_t)end != len) { r->err = "malformed response head"; return LTG_ERR; }
    if (http_framing(b, r->h, r->nh, r->minor, &r->content_length, &r->chunked, &r->keep_alive,
                     &r->err, &status_unused) < 0)
        return LTG_ERR;
    return (int)len;
}

/* One byte of the framing around the data (every state but CHUNK_DATA):
 * the state it leads to, CHUNK_ERROR when it cannot be there. */
static chunk_state chunk_frame(chunk_decoder *d, char c) {
    switch (d->state) {
    case CHUNK_SIZE: {
        int h = hexval((unsigned char)c);
        if (h >= 0 && d->digits < 15) {
            d->left = d->left * 16 + (uint64_t)h;
            d->digits++;
            return CHUNK_SIZE;
        }
        if (h >= 0 || !d->digits) return CHUNK_ERROR;
        d->state = CHUNK_SIZE_WS; /* the size is over: the same byte, looked at in that state */
        return chunk_frame(d, c);
    }
    case CHUNK_SIZE_WS:
        /* white space after the size: then ";" and an extension, or the line's end */
        if (c == ';') return CHUNK_EXT;
        /* bounded, as an extension */
        if ((c == ' ' || c == '\t') && ++d->line <= 1024) return CHUNK_SIZE_WS;
        return c == '\r' ? CHUNK_SIZE_LF : CHUNK_ERROR;
    case CHUNK_EXT: /* chunk extensions are allowed and ignored */
        if (c == '\r') return CHUNK_SIZE_LF;
        if (((unsigned char)c < 32 && c != '\t') || c == 127 || ++d->line > 1024)
            return CHUNK_ERROR;
        return CHUNK_EXT;
    case CHUNK_SIZE_LF:
        if (c != '\n') return CHUNK_ERROR;
        d->digits = 0;
        d->line = 0;
        return d->left ? CHUNK_DATA : CHUNK_TRAILER;
    case CHUNK_DATA_CR: return c == '\r' ? CHUNK_DATA_LF : CHUNK_ERROR;
    case CHUNK_DATA_LF: return c == '\n' ? CHUNK_SIZE : CHUNK_ERROR;
    case CHUNK_TRAILER: /* trailer fields are read and dropped */
        if (c == '\r') return CHUNK_TRAILER_LF;
        if (c == '\n' || c == 0 || ++d->trailer > 8192) return CHUNK_ERROR;
        d->line++;
        return CHUNK_TRAILER;
    case CHUNK_TRAILER_LF: {
        if (c != '\n') return CHUNK_ERROR;
        int more = d->line;
        d->line = 0;
        return more ? CHUNK_TRAILER : CHUNK_DONE;
    }
    default: return CHUNK_ERROR; /* CHUNK_DATA is the caller's; DONE and ERROR take nothing */
    }
}

/* see ltg.h */
long chunk_decode(chunk_decoder *d, const char *in, size_t n, buf *out) {
    size_t i = 0;
    while (i < n && d->state != CHUNK_DONE && d->state != CHUNK_ERROR) { /* errors are sticky */
        if (d->state == CHUNK_DATA) {
            size_t take = n - i < d->left ? n - i : (size_t)d->left;
            buf_append(out, in + i, take);
            i += take;
            d->left -= take;
            if (!d->left) d->state = CHUNK_DATA_CR;
        } else {
            d->state = chunk_frame(d, in[i++]);
        }
    }
    return d->state == CHUNK_ERROR ? LTG_ERR : (long)i;
}

/* see ltg.h */
size_t sse_event_len(const char *s, size_t n) {
    int line_empty = 1;
    for (size_t i = 0; i < n;) {
        /* to the line's end: the first LF, or a CR before it */
        const char *lf = memchr(s + i, '\n', n - i);
        size_t lim = lf ? (size_t)(lf - s) : n;
        const char *cr = memchr(s + i, '\r', lim - i);
        size_t end = cr ? (size_t)(cr - s) : lim;
        if (end == n) return 0;
        if (end > i) line_empty = 0;
        i = end;
        size_t e = i + 1;
        if (s[i] == '\r') {
            if (e >= n) return 0; /* a CR at the end may be the first half of CRLF */
            if (s[e] == '\n') e++;
        }
        if (line_empty) return e;
        line_empty = 1;
        i = e;
    }
    return 0;
}

/* see ltg.h */
int sse_event_data(const char *ev, size_t n, buf *out) {
    int any = 0;
    out->len = 0;
    for (size_t i = 0; i < n;) {
        const char *nl = memchr(ev + i, '\n', n - i);
        size_t e = nl ? (size_t)(nl - ev) : n; /* the line's end: its first \n or \r */
        const char *cr = memchr(ev + i, '\r', e - i);
        if (cr) e = (size_t)(cr - ev);
        if (e - i >= 5 && memcmp(ev + i, "data:", 5) == 0) {
            size_t s = i + 5 + (e > i + 5 && ev[i + 5] == ' ');
            if (any) buf_append(out, "\n", 1);
            buf_append(out, ev + s, e - s);
            any = 1;
        }
        i = e + (e + 1 < n && ev[e] == '\r' && ev[e + 1] == '\n') + 1;
    }
    return any;
}

/* ===== 5. The event loop: fds, timers, deferred close =====
 *
 * IMPLEMENTATION NOTES
 * One handler per fd, kept in a table indexed by the fd (Redis's ae.c).
 * Each turn runs the due timers and the before-sleep hooks, closes the
 * deferred fds, then rebuilds the pollfd array from that table (its hot
 * fds, see below), polls
 * with the timeout of the nearest timer, and dispatches.
 *
 * Closing is deferred twice over. A closed connection is only marked and
 * queued; it is freed at the end of the turn, so no handler frees what a
 * caller further up the stack still uses. And the fd itself is closed at
 * the end of the turn too, so the kernel cannot hand the same number to a
 * new socket while a stale poll result for the old one waits to be read.
 *
 * Output is written directly first: a connection with new output joins the
 * pending list, which is flushed once before the loop sleeps, and POLLOUT
 * is requested only when a write returned EAGAIN (Redis's
 * handleClientsWithPendingWrites).
 *
 * poll() costs per fd, so a thousand idle keep-alive clients would be paid
 * for on every request. An fd that has had no event for HOT_MS (a client
 * between requests, a pooled upstream connection, a quiet listener) is
 * left out of the pollfd array, and every SWEEP_MS one turn polls them
 * all: a request on an idle connection waits at most that long before ltg
 * sees it, and the busy ones pay for the hot few. A loop with nothing hot
 * polls everything and sleeps until its next timer.
 *
 * Timers live in a binary min-heap; each knows its slot, so stopping one is
 * O(log n). Signals reach the loop through a self-pipe, never by
 * interrupting it at an unknown point.
 *
 * The loop knows nothing of what it runs: it calls the hooks it was given
 * (S.hooks, loop_hooks in ltg.h: the server's flush, the store's turn,
 * then the access log's write).
 */
#define HOT_MS 1000      /* an fd without an event this long is polled only in a sweep */
#define SWEEP_MS 5       /* how often a sweep polls every fd */

static int *fds_to_close;
static int nclose, close_cap;
static int64_t sweep_due; /* the next turn that polls every fd */

static void loop_watch(int fd, short events, fd_handler *h, void *ctx) {
    if (fd < 0 || fd >= S.nfds_cap) {
        ltg_log("fd %d beyond the fd table (%d)", fd, S.nfds_cap);
        abort();
    }
    S.fds[fd] = (fd_watch){h, ctx, events, S.now};
    if (fd >= S.fd_high) S.fd_high = fd + 1;
}

static void loop_events(int fd, short events) {
    S.fds[fd].events = events;
    S.fds[fd].seen = S.now;
}

/* The pollfd array of this turn: the hot fds, or every fd in a sweep.
 * Returns how many; *cold counts those left out. */
static int loop_pollfds(int *cold) {
    int n = 0, sweep = S.now >= sweep_due;
    *cold = 0;
    for (int fd = 0; fd < S.fd_high; fd++) {
        const fd_watch *w = &S.fds[fd];
        /* an fd that wants nothing is not polled at all */
        if (!w->handler || !w->events) continue;
        if (!sweep && S.now - w->seen >= HOT_MS) {
            (*cold)++;
            continue;
        }
        S.pfds[n++] = (struct pollfd){fd, w->events, 0};
    }
    if (sweep) sweep_due = S.now + SWEEP_MS;
    return n;
}

/* Stop watching fd and close it at the end of this turn. */
static void loop_close(int fd) {
    if (fd < 0) return;
    S.fds[fd] = (fd_watch){0};
    if (nclose == close_cap) {
        close_cap = close_cap ? close_cap * 2 : 64;
        fds_to_close = xrealloc(fds_to_close, (size_t)close_cap * sizeof *fds_to_close);
    }
    fds_to_close[nclose++] = fd;
}

static void timer_init(timer *t, void (*fire)(void *), void *ctx) {
    t->slot = -1;
    t->fire = fire;
    t->ctx = ctx;
    t->when = 0;
}

static int timer_less(int a, int b) { return S.heap[a]->when < S.heap[b]->when; }

static void heap_swap(int a, int b) {
    timer *t = S.heap[a];
    S.heap[a] = S.heap[b];
    S.heap[b] = t;
    S.heap[a]->slot = a;
    S.heap[b]->slot = b;
}

static void heap_fix(int i) {
    while (i > 0 && timer_less(i, (i - 1) / 2)) {
        heap_swap(i, (i - 1) / 2);
        i = (i - 1) / 2;
    }
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < S.nheap && timer_less(l, m)) m = l;
        if (r < S.nheap && timer_less(r, m)) m = r;
        if (m == i) return;
        heap_swap(i, m);
        i = m;
    }
}

static void timer_stop(timer *t) {
    if (t->slot < 0) return;
    int i = t->slot;
    t->slot = -1;
    S.nheap--;
    if (i == S.nheap) return;
    S.heap[i] = S.heap[S.nheap];
    S.heap[i]->slot = i;
    heap_fix(i);
}

/* Arm (or re-arm) t to fire `ms` from now. */
static void timer_set(timer *t, int64_t ms) {
    t->when = S.now + ms;
    if (t->slot >= 0) { heap_fix(t->slot); return; }
    if (S.nheap == S.heap_cap) {
        S.heap_cap = S.heap_cap ? S.heap_cap * 2 : 256;
        S.heap = xrealloc(S.heap, (size_t)S.heap_cap * sizeof *S.heap);
    }
    t->slot = S.nheap;
    S.heap[S.nheap++] = t;
    heap_fix(t->slot);
}

static void timers_run(void) {
    while (S.nheap && S.heap[0]->when <= S.now) {
        timer *t = S.heap[0];
        timer_stop(t);
        t->fire(t->ctx);
    }
}

static void on_signal(int sig) {
    if (sig == SIGHUP) S.got_hup = 1;
    else if (sig == SIGUSR1) S.got_usr1 = 1;
    else S.got_term = 1;
    int saved = errno;
    if (write(S.sig_pipe[1], "s", 1) < 0) { /* the pipe is full: a wake-up is already pending */ }
    errno = saved;
}

/* The loop (see loop_hooks in ltg.h). */
static void loop_run(void) {
    for (;;) {
        S.now = clock_ms();
        timers_run();
        int busy = 0; /* work remains (a compaction): poll without sleeping */
        for (int i = 0; i < 4 && S.hooks.before_sleep[i]; i++) busy |= S.hooks.before_sleep[i]();
        for (int i = 0; i < nclose; i++) close(fds_to_close[i]);
        nclose = 0;
        if (S.hooks.done && S.hooks.done()) return;
        int cold, n = loop_pollfds(&cold);
        int timeout = busy ? 0 : -1;
        if (S.nheap && !busy) {
            int64_t d = S.heap[0]->when - clock_ms();
            timeout = d < 0 ? 0 : d > 60000 ? 60000 : (int)d;
        }
        if (cold && (timeout < 0 || timeout > sweep_due - S.now))
            timeout = (int)(sweep_due - S.now);
        int ready = poll(S.pfds, (nfds_t)n, timeout);
        if (ready < 0 && errno != EINTR) { ltg_log("poll: %s", strerror(errno)); abort(); }
        S.now = clock_ms();
        for (int i = 0; i < n && ready > 0; i++) {
            if (!S.pfds[i].revents) continue;
            ready--;
            fd_watch *w = &S.fds[S.pfds[i].fd];
            w->seen = S.now;
            /* NULL: unwatched earlier this turn */
            if (w->handler) w->handler(w->ctx, S.pfds[i].revents);
        }
        if (S.hooks.woke) S.hooks.woke();
    }
}

/* ===== 6. Client connections: the HTTP/1.1 server =====
 *
 * IMPLEMENTATION NOTES
 * A client connection is a small state machine (conn_to asserts every
 * transition and arms the timer for the state entered):
 *
 *   IDLE --(a byte)--> HEAD --(parsed)--> BODY --(complete)--> BUSY
 *    ^                                                          |
 *    +--------------------(answered: the next request)----------+
 *
 *   an answer that closes: --(written)--> LINGER --> CLOSED; any state --> CLOSED
 *
 * The current request's head stays at the front of `in` while it is served
 * (the parsed header slices point into it); its body is decoded into
 * `body`. The server hands it to S.serve (route, section 20; the contract
 * and conn_owner are in ltg.h). conn_done() drops the request's bytes, and
 * what follows in `in` is the next pipelined request, parsed by
 * conn_process()'s loop or after the next flush. A request is served only
 * when the one before it is answered, so answers leave in order.
 *
 * One timer per connection means what the state says: IDLE, the idle
 * keep-alive limit; HEAD, the head limit (counted from the head's first
 * byte, not re-armed by a slow trickle: that is what stops slowloris);
 * BODY, the body's rate (--head-timeout from the head, and a second more
 * per BODY_MIN_RATE bytes, but never --head-timeout without a byte); BUSY,
 * none; LINGER, LINGER_MS. While an answer
 * waits to be written, it fires only if the client took nothing since it
 * started: a client that stops reading is closed, not kept for ever.
 *
 * While a request is served, the connection keeps reading, so a client
 * that goes away is noticed at once and its upstream request is cancelled;
 * but it stops reading when more than 64 KiB of pipelined requests wait,
 * or when more than OUT_HIGH_WATER of answers wait for the client to read
 * them (whatever it is waiting for): a client that pipelines and never
 * reads holds at most that much, then TCP pushes back on it.
 *
 * Against one client holding every slot (slowloris, slow bodies, slow
 * reads): a head must be complete within --head-timeout of its first byte,
 * a body must keep up BODY_MIN_RATE after that and never pause that long,
 * and one still to come after the head's read is read only when begin()
 * set no refuse_body (the gateway's: a key that may send one); one client address may
 * hold --max-conns-per-ip inference connections (its next are closed); and
 * when a listener's table is full, a connection without a request in
 * service -- an idle keep-alive one first, then one of the client holding
 * the most connections, then the one waiting longest -- is closed to make
 * room, so the newcomer is refused only when every connection is being
 * served. Each episode is logged when it starts and when it ends, with
 * its count.
 */
typedef enum { CONN_IDLE, CONN_HEAD, CONN_BODY, CONN_BUSY, CONN_LINGER, CONN_CLOSED } conn_state;

/* What the gateway learns of the request it serves, for the access log
 * and the metrics (section 19): cleared by the server for each request. */
typedef struct {
    char key_id[37], group_id[37];
    char requested[ALIAS_MAX + 1], served[ALIAS_MAX + 1]; /* catalog aliases, or "" */
    const char *endpoint;     /* the inference route, or NULL: not counted in ltg_requests_total */
    const char *cache;        /* "hit", "miss", "bypass", or NULL */
    int anthropic;            /* an Anthropic endpoint: its errors in Anthropic's shape */
    const char *client_api;   /* the API its path speaks ("chat", "messages"...), or NULL */
    const char *param;        /* its error's field, a JSON Pointer (NULL: none) */
    int attempts;             /* -1: none made (refused before dispatch) */
    long long tok[NTOK];      /* its usage; [TOK_IN] -1: none (refused before dispatch) */
    int64_t cost;             /* micro-USD; -1: unknown */
    int estimated;            /* the cost is ltg's estimate (README "Cost") */
    /* an inference call's W3C trace (README "Trace context"): its id, its flags; "" none */
    char trace_id[33], trace_flags[3];
} req_facts;

struct conn {
    conn *prev, *next;        /* every open connection, for draining */
    int fd, admin;
    conn_state state;
    buf in;                   /* received bytes; the current request's head first */
    size_t scan;              /* http_head_end's resume point */
    /* bytes of `in` taken by the current head and body (until it is decoded) */
    size_t head_len, body_raw;
    /* the raw bytes the body took, once decoded (the access log's bytes_in) */
    size_t body_in;
    http_request req;
    chunk_decoder cd;
    buf body;                 /* the current request's decoded body */
    buf out;                  /* answer bytes not yet written */
    size_t out_off;
    uint64_t written, written_mark; /* bytes sent in all; at the timer's start */
    int keep_alive;           /* the current answer keeps the connection */
    int close_after;          /* close once `out` is written */
    /* ... and first read and drop what the client still sends (conn_fail) */
    int linger;
    int processing, pending, want_out, read_paused;
    timer t;                  /* what it means is the state's */
    int64_t state_at;         /* S.now: when its state began (shedding takes the oldest) */
    uint64_t served;          /* requests answered: one that had none yet is new, not idle */
    struct peer *peer;        /* its client address, counted (inference connections) */
    /* that address: the socket's, or what a trusted proxy says (the access log's "client") */
    uint8_t client[16];
    int trusted;              /* it comes from --trusted-proxies */
    int proxy_pending;        /* ... and may still begin with a PROXY protocol header */
    int proxied;              /* ... it did: its client is final (X-Forwarded-For is not read) */
    int forwarded;            /* its peer is the X-Forwarded-For client of the request in service */
    int refuse_body;          /* set by S.begin: 401, 404 or 413 for a body not whole at once */
    int64_t body_seen, body_at; /* the body's bytes so far, and S.now when they last grew */
    /* what serves the current request over several turns (an exchange), or NULL */
    void *owner;
    const conn_owner *owner_ops; /* and how it is told of the client (ltg.h) */
    char rid[32];             /* the current request's id */
    int64_t began;            /* S.now when its head was in */
    int status;               /* the status of its answer's head, once sent */
    uint64_t queued, queued_mark; /* bytes given to conn_send in all; at the request's start */
    req_facts f;
    conn *next_pending, *next_closing;
};

static conn *conns; /* all open client connections */

/* A client address and how many inference connections it holds. */
typedef struct peer {
    uint8_t addr[16];         /* IPv6, or IPv4 mapped into it */
    int n;
} peer;

static const void *peer_key(const void *it, size_t *n) { *n = 16; return ((const peer *)it)->addr; }
static hmap PEERS = {.key = peer_key};

static void peer_drop(peer *p) {
    assert(!p || p->n >= 0);
    if (p && !p->n) free(hmap_del(&PEERS, p->addr, 16));
}

/* Something that refuses clients, said once when it starts and once when
 * it has been quiet for EPISODE_QUIET_MS (with how many it refused). */
typedef struct {
    const char *what;
    long n;
    timer t;
} episode;

static void episode_end(void *ctx) {
    episode *e = ctx;
    ltg_log("%s: over, %ld connection(s) in all", e->what, e->n);
    e->n = 0;
}

static void episode_note(episode *e) {
    if (!e->n++) ltg_log("%s", e->what);
    if (!e->t.fire) timer_init(&e->t, episode_end, e);
    timer_set(&e->t, EPISODE_QUIET_MS);
}

static void conn_watch(conn *c) {
    if (c->state != CONN_CLOSED)
        loop_events(c->fd, (short)((c->read_paused ? 0 : POLLIN) | (c->want_out ? POLLOUT : 0)));
}

static void conn_to(conn *c, conn_state to);

static void conn_close(conn *c) {
    if (c->state == CONN_CLOSED) return;
    int busy = c->state == CONN_BUSY;
    conn_to(c, CONN_CLOSED);
    if (c->owner) c->owner_ops->gone(c->owner); /* it lets go of c */
    c->owner = NULL;
    if (busy && S.ended) S.ended(c); /* a request left unanswered, or half-sent */
    loop_close(c->fd);
    if (c->prev) c->prev->next = c->next;
    else conns = c->next;
    if (c->next) c->next->prev = c->prev;
    c->next_closing = S.closing;
    S.closing = c;
    S.nconns--;
    S.nadmin -= c->admin;
    if (c->peer) {
        c->peer->n--;
        peer_drop(c->peer);
    }
    c->peer = NULL;
}

static void conn_reap(void) {
    while (S.closing) {
        conn *c = S.closing;
        S.closing = c->next_closing;
        buf_free(&c->in);
        buf_free(&c->body);
        buf_free(&c->out);
        free(c);
    }
}

static void conn_send(conn *c, const void *p, size_t n) {
    if (c->state == CONN_CLOSED) return;
    buf_append(&c->out, p, n);
    c->queued += n;
    if (!c->pending) {
        c->pending = 1;
        c->next_pending = S.pending_writes;
        S.pending_writes = c;
    }
}

static void conn_process(conn *c);

/* An answer that closes the connection is written: rather than close at
 * once -- a client still sending its refused body would get a reset, and
 * its kernel would drop our answer with it -- shut our side down and read
 * and drop what still comes, for LINGER_MS at most (nginx's
 * lingering_close): time bounds it, the bytes are not kept. */
static void conn_linger(conn *c) {
    conn_to(c, CONN_LINGER);
    shutdown(c->fd, SHUT_WR);
    c->read_paused = 0;
    conn_watch(c);
}

/* Write what the connection has queued: 1 when all of it is written, 0
 * when the rest waits for POLLOUT (or the connection broke: closed). */
static int conn_flush(conn *c) {
    while (c->out_off < c->out.len) {
        ssize_t n = send(c->fd, c->out.p + c->out_off, c->out.len - c->out_off, MSG_NOSIGNAL);
        if (n > 0) {
            c->out_off += (size_t)n;
            c->written += (uint64_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (c->out_off > 65536) {
                buf_consume(&c->out, c->out_off);
                c->out_off = 0;
            }
            c->want_out = 1;
            conn_watch(c);
            return 0;
        }
        conn_close(c); /* the client went away */
        return 0;
    }
    c->out.len = c->out_off = 0;
    c->want_out = 0;
    return 1;
}

/* Everything queued is written: the connection closes (or lingers), its
 * owner hears it drained, or it goes on to its next request -- serving
 * may have stopped while the client did not read. */
static void conn_drained(conn *c) {
    if (c->close_after && c->linger && c->state != CONN_LINGER) {
        conn_linger(c);
        return;
    }
    if (c->close_after) {
        conn_close(c);
        return;
    }
    conn_watch(c);
    if (c->owner) c->owner_ops->drained(c->owner);
    else conn_process(c);
}

static void conn_flush_all(void) {
    while (S.pending_writes) {
        conn *c = S.pending_writes;
        S.pending_writes = c->next_pending;
        c->pending = 0;
        if (c->state != CONN_CLOSED && conn_flush(c)) conn_drained(c);
    }
}

static size_t conn_unsent(conn *c) { return c->out.len - c->out_off; }

/* The server's step before the loop sleeps (loop_hooks): the turn's
 * answers are written, closed connections freed. */
static int conn_tick(void) {
    conn_flush_all();
    conn_reap();
    return 0;
}

static const char *http_reason(int status) {
    static const struct { int status; const char *reason; } reasons[] = {
        {100, "Continue"}, {200, "OK"}, {201, "Created"}, {400, "Bad Request"}, {401, "Unauthorized"},
        {403, "Forbidden"}, {404, "Not Found"}, {405, "Method Not Allowed"}, {408, "Request Timeout"},
        {409, "Conflict"}, {412, "Precondition Failed"}, {413, "Content Too Large"}, {417, "Expectation Failed"},
        {426, "Upgrade Required"},
        {428, "Precondition Required"}, {429, "Too Many Requests"}, {431, "Request Header Fields Too Large"},
        {500, "Internal Server Error"}, {501, "Not Implemented"}, {502, "Bad Gateway"},
        {503, "Service Unavailable"}, {504, "Gateway Timeout"}};
    for (size_t i = 0; i < sizeof reasons / sizeof *reasons; i++)
        if (reasons[i].status == status) return reasons[i].reason;
    return status < 300 ? "OK" : status < 500 ? "Client Error" : "Server Error";
}

/* Write an answer's head. `length` < 0 means a chunked body follows.
 * `extra` is more header lines, each ending in CRLF. */
static void conn_head(conn *c, int status, const char *ctype, long long length, const char *extra) {
    c->keep_alive = c->req.keep_alive && !S.draining && !c->close_after;
    c->status = status;
    buf h = {0};
    buf_printf(&h, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\n", status, http_reason(status), ctype);
    if (length >= 0) buf_printf(&h, "Content-Length: %lld\r\n", length);
    else buf_puts(&h, "Transfer-Encoding: chunked\r\n");
    if (extra) buf_puts(&h, extra);
    if (!c->keep_alive) buf_puts(&h, "Connection: close\r\n");
    else if (c->req.minor == 0)
        buf_puts(&h, "Connection: keep-alive\r\n"); /* HTTP/1.0 closes unless told */
    buf_puts(&h, "\r\n");
    conn_send(c, h.p, h.len);
    buf_free(&h);
}

/* Request helpers shared by the control plane and the inference plane. */

/* The request target's path: up to its query, which is never part of it. */
static const char *request_path(const conn *c, size_t *n) {
    const char *t = c->in.p + c->req.target.off, *q = memchr(t, '?', c->req.target.len);
    *n = q ? (size_t)(q - t) : c->req.target.len;
    return t;
}

static int path_is(conn *c, const char *path) {
    size_t n;
    const char *t = request_path(c, &n);
    return n == strlen(path) && memcmp(t, path, n) == 0;
}

/* The value of the request's header `name`, into out (NUL-terminated;
 * "" when absent or too long to be a real one). */
static void conn_header(conn *c, const char *name, char *out, size_t cap) {
    size_t n;
    const char *v = http_header_get(c->in.p, c->req.h, c->req.nh, name, &n);
    out[0] = 0;
    if (v && n < cap) {
        memcpy(out, v, n);
        out[n] = 0;
    }
}

static int method_is(conn *c, const char *m) {
    return c->req.method.len == strlen(m) &&
           memcmp(c->in.p + c->req.method.off, m, c->req.method.len) == 0;
}


/* Before a request: nothing known of it yet. */
static void conn_fresh(conn *c) {
    /* the last request's: they point into bytes now gone */
    c->req.method = c->req.target = (slice){0, 0};
    c->req.nh = 0;
    c->began = 0;
    c->status = 0;
    c->queued_mark = c->queued;
    c->f = (req_facts){.attempts = -1, .tok = {-1}, .cost = -1};
}

/* The current request is answered: make room for the next one. */
static void conn_done(conn *c) {
    if (S.ended) S.ended(c);
    if (c->forwarded) {
        c->peer->n--;
        peer_drop(c->peer);
        c->peer = NULL;
        c->forwarded = 0;
    }
    conn_fresh(c);
    buf_consume(&c->in, c->head_len + c->body_raw);
    c->head_len = c->body_raw = c->body_in = c->scan = 0;
    c->body.len = 0;
    /* a large body's memory is not kept for the next request */
    if (c->body.cap > (1 << 20)) buf_free(&c->body);
    if (c->in.cap > (1 << 20) && c->in.len < 65536) {
        buf rest = {0};
        buf_append(&rest, c->in.p, c->in.len);
        buf_free(&c->in);
        c->in = rest;
    }
    c->cd = (chunk_decoder){0};
    c->rid[0] = 0;
    c->served++;
    c->close_after |= !c->keep_alive;
    /* IDLE for a closing answer too: its timer bounds a client that takes nothing */
    conn_to(c, c->in.len && !c->close_after ? CONN_HEAD : CONN_IDLE);
    /* the next request: conn_process()'s loop, or after the flush; a reply never re-enters the
     * parser */
    conn_send(c, "", 0);
}

/* A whole answer with a body. */
static void conn_reply(conn *c, int status, const char *ctype, const char *extra, const char *body,
                       size_t n) {
    conn_head(c, status, ctype, (long long)n, extra);
    /* RFC 9110 9.3.2: a HEAD answer has the head alone */
    if (!method_is(c, "HEAD")) conn_send(c, body, n);
    conn_done(c);
}

/* An error answered in the shape of the listener's API (S.error: the
 * gateway's route_error, section 20); `headers`: extra header lines (each
 * ending in CRLF), or NULL. */
static void conn_error(conn *c, int status, const char *code, const char *headers, const char *fmt,
                       ...) __attribute__((format(printf, 5, 6)));
static void conn_error(conn *c, int status, const char *code, const char *headers, const char *fmt,
                       ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    conn_to(c, CONN_BUSY);
    S.error(c, status, code, headers, msg);
}

/* Errors of the HTTP layer itself: the request's framing cannot be trusted,
 * so the answer closes the connection. */
static void conn_fail(conn *c, int status, const char *code, const char *msg) {
    c->close_after = c->linger = 1;
    c->req.keep_alive = 0;
    /* a head that did not parse: its method is maybe not this request's (a HEAD gets the body,
     * then the close) */
    if (!c->began) c->req.method = (slice){0, 0};
    conn_error(c, status, code, NULL, "%s", msg);
}

static void conn_timer(void *ctx) {
    conn *c = ctx;
    if (c->state == CONN_LINGER) {
        conn_close(c);
        return;
    }
    if (conn_unsent(c) && c->written != c->written_mark) { /* still writing: not idle */
        c->written_mark = c->written;
        timer_set(&c->t, S.idle_timeout_ms);
        return;
    }
    if (c->state == CONN_IDLE || conn_unsent(c)) { /* idle, or not reading what it asked for */
        conn_close(c);
        return;
    }
    conn_fail(c, 408, "request_timeout",
              c->state == CONN_HEAD
                      ? "the request head did not arrive in time"
                      : "the request body arrived too slowly (it must keep up 4 KiB/s, and "
                        "pause no longer than --head-timeout)");
}

/* A body has --head-timeout, and a second more per BODY_MIN_RATE bytes of
 * it -- decoded bytes: framing earns no time -- and no more than
 * --head-timeout without a byte of it (time earned is not idle time). */
static void conn_body_timer(conn *c) {
    int64_t body = c->req.chunked ? (int64_t)c->body.len : (int64_t)(c->in.len - c->head_len);
    if (c->state_at == S.now || body != c->body_seen) c->body_seen = body, c->body_at = S.now;
    int64_t rate = c->state_at + S.head_timeout_ms + body * 1000 / BODY_MIN_RATE,
            idle = c->body_at + S.head_timeout_ms;
    timer_set(&c->t, (rate < idle ? rate : idle) - S.now);
}

/* The one place a connection changes state: the transition is checked and
 * the timer armed for the state entered (see the notes above). */
static void conn_to(conn *c, conn_state to) {
    static const unsigned char next[] = {
        [CONN_IDLE] = 1 << CONN_HEAD | 1 << CONN_BUSY | 1 << CONN_LINGER | 1 << CONN_CLOSED,
        [CONN_HEAD] = 1 << CONN_BODY | 1 << CONN_BUSY | 1 << CONN_CLOSED,
        [CONN_BODY] = 1 << CONN_BUSY | 1 << CONN_CLOSED,
        [CONN_BUSY] = 1 << CONN_IDLE | 1 << CONN_HEAD | 1 << CONN_BUSY | 1 << CONN_CLOSED,
        [CONN_LINGER] = 1 << CONN_CLOSED,
        [CONN_CLOSED] = 0,
    };
    assert(next[c->state] >> to & 1);
    /* an error answer of a request in service */
    if (to == CONN_BUSY && c->state == CONN_BUSY) return;
    c->state = to;
    c->state_at = S.now;
    c->written_mark = c->written;
    switch (to) {
    case CONN_IDLE: timer_set(&c->t, S.idle_timeout_ms); break;
    case CONN_HEAD: timer_set(&c->t, S.head_timeout_ms); break;
    case CONN_BODY: conn_body_timer(c); break;
    case CONN_LINGER: timer_set(&c->t, LINGER_MS); break;
    case CONN_BUSY:
    case CONN_CLOSED: timer_stop(&c->t); break;
    }
}

static int conn_proxy(conn *c);
static int conn_forwarded(conn *c);

/* The next request's head, once it is all in: parsed and checked (HEAD ->
 * BODY). 0: not yet, or refused (the connection is failing). */
static int conn_take_head(conn *c) {
    if (c->proxy_pending && conn_proxy(c) <= 0) return 0;
    int n = http_head_end(c->in.p, c->in.len, &c->scan);
    if (n == LTG_AGAIN && c->in.len <= MAX_HEAD_BYTES) return 0;
    if (n == LTG_AGAIN || n > MAX_HEAD_BYTES) {
        conn_fail(c, 431, "headers_too_large", "the request head is larger than 16 KiB");
        return 0;
    }
    c->head_len = (size_t)n;
    if (http_parse_request(c->in.p, (size_t)n, &c->req) < 0) {
        int st = c->req.status;
        const char *code = st == 431   ? "headers_too_large"
                           : st == 501 ? "not_implemented"
                           : st == 417 ? "expectation_failed"
                                       : "bad_request";
        conn_fail(c, st, code, c->req.err);
        return 0;
    }
    c->began = S.now;
    c->refuse_body = 0;
    if (S.begin) S.begin(c);
    if (c->req.content_length > S.max_body) {
        char m[128];
        snprintf(m, sizeof m, "the request body is larger than %lld bytes (--max-body-mb)",
                 S.max_body);
        conn_fail(c, 413, "body_too_large", m);
        return 0;
    }
    conn_to(c, CONN_BODY);
    int has_body = c->req.chunked || c->req.content_length > 0;
    /* (a body that would be refused is not asked for: the refusal comes instead) */
    if (has_body && c->req.expect_continue && c->in.len == c->head_len && !c->refuse_body)
        conn_send(c, "HTTP/1.1 100 Continue\r\n\r\n", 25);
    return 1;
}

/* The body, decoded as far as it came. 1 once it is whole: its raw bytes
 * then leave the input, so that a request is held once (c->body). */
static int conn_take_body(conn *c) {
    if (c->req.chunked) {
        long k = chunk_decode(&c->cd, c->in.p + c->head_len + c->body_raw,
                              c->in.len - c->head_len - c->body_raw, &c->body);
        if (k < 0) {
            conn_fail(c, 400, "bad_request", "malformed chunked request body");
            return 0;
        }
        c->body_raw += (size_t)k;
        if ((long long)c->body.len > S.max_body) {
            conn_fail(c, 413, "body_too_large", "the request body is too large");
            return 0;
        }
        if ((long long)c->body_raw > RAW_BODY_MAX(S.max_body)) {
            /* framing is bytes too: 1-byte chunks or long extensions */
            conn_fail(c, 413, "body_too_large",
                      "the chunked request body's framing is too large for its data: send larger "
                      "chunks");
            return 0;
        }
        if (c->cd.state != CHUNK_DONE) return 0;
    } else if (c->req.content_length > 0) {
        size_t cl = (size_t)c->req.content_length;
        if (c->in.len - c->head_len < cl) return 0;
        buf_append(&c->body, c->in.p + c->head_len, cl);
        c->body_raw = cl;
    }
    if (!c->body.p) buf_reserve(&c->body, 0);
    memmove(c->in.p + c->head_len, c->in.p + c->head_len + c->body_raw,
            c->in.len - c->head_len - c->body_raw + 1);
    c->in.len -= c->body_raw;
    c->body_in = c->body_raw;
    c->body_raw = 0;
    return 1;
}

/* Parse and serve as many buffered requests as may be served now. */
static void conn_process(conn *c) {
    assert(!c->processing); /* see conn_done: nothing up the stack is parsing this connection */
    c->processing = 1;
    while (c->state <= CONN_BODY && !c->close_after && conn_unsent(c) < OUT_HIGH_WATER) {
        if (c->state == CONN_IDLE && !c->in.len) break;
        /* its first byte: the head's limit starts */
        if (c->state == CONN_IDLE) conn_to(c, CONN_HEAD);
        if (c->state == CONN_HEAD && !conn_take_head(c)) break;
        if (!conn_take_body(c)) {
            /* more of it to come: read on only for a request that may send it */
            if (c->state == CONN_BODY && c->refuse_body == 413)
                conn_fail(c, 413, "body_too_large", "this endpoint takes no request body");
            else if (c->state == CONN_BODY && c->refuse_body == 404)
                conn_fail(c, 404, "not_found", "no such endpoint (its body is not read)");
            else if (c->state == CONN_BODY && c->refuse_body)
                conn_fail(c, 401, c->admin ? "unauthorized" : "invalid_api_key",
                          "missing or invalid key: a request body is read only with a valid key "
                          "(Authorization: Bearer ..., or x-api-key on the inference plane)");
            break;
        }
        conn_to(c, CONN_BUSY);
        if (c->trusted && conn_forwarded(c) < 0) {
            conn_error(c, 429, "too_many_connections", "Retry-After: 1\r\n",
                       "your address holds --max-conns-per-ip connections through the gateway's "
                       "load balancer: retry shortly");
            continue;
        }
        S.serve(c);
    }
    c->processing = 0;
    if (c->state == CONN_CLOSED) return;
    /* Stop reading while answers wait past the high-water mark, or a request is served and 64
     * KiB of the next ones wait. */
    int paused = conn_unsent(c) >= OUT_HIGH_WATER ||
                 (c->state == CONN_BUSY && c->in.len > c->head_len + c->body_raw + 65536);
    if (paused != c->read_paused) {
        c->read_paused = paused;
        conn_watch(c);
    }
    if (c->state == CONN_BODY) conn_body_timer(c); /* more of it came: more time */
}

static void conn_read(conn *c) {
    while (c->state == CONN_LINGER) { /* dropped: the answer is out, the connection closes */
        char drop[READ_CHUNK];
        ssize_t n = recv(c->fd, drop, sizeof drop, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (n <= 0) {
            conn_close(c);
            return;
        }
    }
    for (int rounds = 0; rounds < 4; rounds++) {
        buf_reserve(&c->in, READ_CHUNK);
        ssize_t n = recv(c->fd, c->in.p + c->in.len, READ_CHUNK, 0);
        if (n > 0) {
            c->in.len += (size_t)n;
            c->in.p[c->in.len] = 0;
            if (n < READ_CHUNK) break;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        conn_close(c); /* the client closed, or the connection broke */
        return;
    }
    conn_process(c);
}

static void conn_io(void *ctx, int revents) {
    conn *c = ctx;
    if ((revents & POLLOUT) && conn_flush(c)) conn_drained(c);
    if (c->state != CONN_CLOSED && (revents & (POLLIN | POLLHUP | POLLERR))) conn_read(c);
}

static void conn_new(int fd, int admin, peer *p) {
    conn *c = xcalloc(1, sizeof *c);
    c->fd = fd;
    c->admin = admin;
    c->peer = p;
    c->state_at = S.now;
    if (p) p->n++;
    timer_init(&c->t, conn_timer, c);
    conn_fresh(c);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->next = conns;
    if (conns) conns->prev = c;
    conns = c;
    S.nconns++;
    S.nadmin += admin;
    loop_watch(fd, POLLIN, conn_io, c);
    timer_set(&c->t, S.idle_timeout_ms); /* CONN_IDLE's */
}

/* A listener's table is full: close a connection without a request in
 * service -- an idle keep-alive one first, then one of the client that
 * holds the most connections (behind a balancer, the real client), then
 * the one that has waited longest. 0 when every connection is being served. */
static int conn_shed(int admin) {
    conn *victim = NULL;
    int victim_idle = 0, victim_n = 0;
    for (conn *c = conns; c; c = c->next) {
        /* a keep-alive waiting */
        int idle =
                (c->state == CONN_IDLE && c->served && !conn_unsent(c)) || c->state == CONN_LINGER;
        int n = c->peer ? c->peer->n : 0;
        if (c->admin != admin || c->state == CONN_BUSY || c->state == CONN_CLOSED) continue;
        /* then: more connections, then older (the list is newest first) */
        int same = victim && idle == victim_idle;
        if (!victim || idle > victim_idle ||
            (same && (n > victim_n || (n == victim_n && c->state_at <= victim->state_at)))) {
            victim = c;
            victim_idle = idle;
            victim_n = n;
        }
    }
    if (victim) conn_close(victim);
    return victim != NULL;
}

/* ---- behind a load balancer: --trusted-proxies ----
 *
 * Behind a balancer every connection comes from the balancer's address, so
 * a per-address cap would cap everyone at once. A connection from an
 * address of --trusted-proxies is not capped itself; the client it speaks
 * for is, and is the one the access log names: given by a PROXY protocol
 * header (v1 or v2, HAProxy's send-proxy) at the connection's start, or by
 * X-Forwarded-For on each request (the rightmost address that is not a
 * trusted proxy: what nginx's $proxy_add_x_forwarded_for appends), never
 * both: after a PROXY header the connection's client is final. From
 * any other address both are ignored -- a PROXY header is bad HTTP, and a
 * client cannot name itself someone else. IPv6 clients are counted per /64
 * (one host has a /64 to pick addresses from). */
#define MAX_TRUSTED 32

static struct {
    uint8_t a[MAX_TRUSTED][16]; /* IPv6, or IPv4 mapped into it */
    int bits[MAX_TRUSTED];
    int n;
} TRUSTED;

/* The 16-byte form of a socket address (IPv4 mapped into IPv6). */
static void addr16(const struct sockaddr_storage *sa, uint8_t a[16]) {
    memset(a, 0, 16);
    if (sa->ss_family == AF_INET6) memcpy(a, &((const struct sockaddr_in6 *)sa)->sin6_addr, 16);
    else {
        a[10] = a[11] = 0xff;
        memcpy(a + 12, &((const struct sockaddr_in *)sa)->sin_addr, 4);
    }
}

static int addr16_parse(const char *s, size_t n, uint8_t a[16]) {
    char t[64];
    struct sockaddr_storage ss;
    if (n >= sizeof t) return LTG_ERR;
    memcpy(t, s, n);
    t[n] = 0;
    if (addr_parse(t, &ss) < 0) return LTG_ERR;
    addr16(&ss, a);
    return 0;
}

static int addr_is_v4(const uint8_t a[16]) {
    static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return memcmp(a, mapped, 12) == 0;
}

static int addr_trusted(const uint8_t a[16]) {
    for (int i = 0; i < TRUSTED.n; i++) {
        int bits = TRUSTED.bits[i], whole = bits / 8, rest = bits % 8;
        if (memcmp(a, TRUSTED.a[i], (size_t)whole) == 0 &&
            (!rest || ((a[whole] ^ TRUSTED.a[i][whole]) >> (8 - rest)) == 0))
            return 1;
    }
    return 0;
}

/* --trusted-proxies ADDR[/BITS][,...]: 0, or LTG_ERR with *why. */
static int trusted_parse(const char *list, const char **why) {
    *why = "expected addresses or networks, comma-separated: 10.0.0.0/8,192.168.1.5,fd00::/8";
    for (const char *p = list; *p;) {
        const char *end = strchr(p, ','), *slash;
        size_t n = end ? (size_t)(end - p) : strlen(p);
        slash = memchr(p, '/', n);
        if (TRUSTED.n == MAX_TRUSTED) { *why = "at most 32 addresses or networks"; return LTG_ERR; }
        uint8_t *a = TRUSTED.a[TRUSTED.n];
        if (addr16_parse(p, slash ? (size_t)(slash - p) : n, a) < 0) return LTG_ERR;
        long long bits = addr_is_v4(a) ? 32 : 128, max = bits;
        if (slash && (parse_ll(slash + 1, n - (size_t)(slash + 1 - p), max, &bits) < 0))
            return LTG_ERR;
        TRUSTED.bits[TRUSTED.n++] = (int)bits + (addr_is_v4(a) ? 96 : 0);
        p += n + (end ? 1 : 0);
    }
    return 0;
}

/* A PROXY protocol header at the start of in[0..n): its length, with the
 * client's address in a[16]; 0 when in does not start with one; LTG_AGAIN
 * when it is not whole yet; LTG_ERR when it is malformed. (v2 LOCAL, a
 * balancer's own health check, and v1 UNKNOWN leave a as it was.) */
static int proxy_header(const char *in, size_t n, uint8_t a[16]) {
    static const char v2[12] = {'\r', '\n', '\r', '\n', 0, '\r', '\n', 'Q', 'U', 'I', 'T', '\n'};
    if (n >= 1 && memcmp(in, v2, n < 12 ? n : 12) == 0) {
        if (n < 16) return LTG_AGAIN;
        const uint8_t *h = (const uint8_t *)in;
        size_t len = 16 + ((size_t)h[14] << 8 | h[15]);
        if (len > 16 + 512) return LTG_ERR;
        if (n < len) return LTG_AGAIN;
        if (h[12] >> 4 != 2 || (h[12] & 0x0F) > 1) return LTG_ERR;
        if ((h[12] & 0x0F) == 0) return (int)len; /* LOCAL */
        if (h[13] == 0x11 && len >= 16 + 12) {
            memset(a, 0, 10);
            a[10] = a[11] = 0xff;
            memcpy(a + 12, h + 16, 4);
        } else if (h[13] == 0x21 && len >= 16 + 36) memcpy(a, h + 16, 16);
        else if (h[13] >> 4 != 0)
            return LTG_ERR; /* AF_UNIX or garbage; 0x00: UNSPEC, a as it was */
        return (int)len;
    }
    if (n < 6 ? memcmp(in, "PROXY ", n) != 0 : memcmp(in, "PROXY ", 6) != 0) return 0;
    const char *eol = memchr(in, '\n', n < 107 ? n : 107);
    if (!eol) return n < 107 ? LTG_AGAIN : LTG_ERR;
    if (eol == in || eol[-1] != '\r') return LTG_ERR;
    const char *w[6];
    size_t wl[6];
    int nw = 0;
    for (const char *p = in + 6; p < eol - 1 && nw < 6;) {
        const char *sp = memchr(p, ' ', (size_t)(eol - 1 - p));
        size_t l = sp ? (size_t)(sp - p) : (size_t)(eol - 1 - p);
        w[nw] = p;
        wl[nw++] = l;
        p += l + 1;
    }
    if (nw >= 1 && wl[0] == 7 && memcmp(w[0], "UNKNOWN", 7) == 0) return (int)(eol - in + 1);
    uint8_t src[16], dst[16];
    long long port;
    int v4 = nw == 5 && wl[0] == 4 && memcmp(w[0], "TCP4", 4) == 0,
        v6 = nw == 5 && wl[0] == 4 && memcmp(w[0], "TCP6", 4) == 0;
    if ((!v4 && !v6) || addr16_parse(w[1], wl[1], src) < 0 || addr16_parse(w[2], wl[2], dst) < 0 ||
        addr_is_v4(src) != v4 || addr_is_v4(dst) != v4)
        return LTG_ERR;
    for (int k = 3; k < 5; k++)
        if (parse_ll(w[k], wl[k], 65535, &port) < 0) return LTG_ERR;
    memcpy(a, src, 16);
    return (int)(eol - in + 1);
}

/* The entry that counts a client address's inference connections (for
 * --max-conns-per-ip), made if it has none (a refused newcomer's new
 * entry, left at 0, goes with peer_drop). An IPv6 client is its /64. */
static peer *peer_of(const uint8_t addr[16]) {
    uint8_t a[16];
    memcpy(a, addr, 16);
    if (!addr_is_v4(a)) memset(a + 8, 0, 8);
    peer *p = hmap_get(&PEERS, a, 16);
    if (p) return p;
    p = xcalloc(1, sizeof *p);
    memcpy(p->addr, a, 16);
    hmap_put(&PEERS, p);
    return p;
}

static episode ep_per_ip;

/* A connection from a trusted proxy: its PROXY protocol header, if it
 * starts with one, names the client it is counted for. 1 when the head
 * may be read now, 0 to wait for more bytes, LTG_ERR when it was closed. */
static int conn_proxy(conn *c) {
    int n = proxy_header(c->in.p ? c->in.p : "", c->in.len, c->client);
    if (n == LTG_AGAIN) return 0;
    if (n < 0) {
        conn_fail(c, 400, "bad_request", "malformed PROXY protocol header");
        return LTG_ERR;
    }
    c->proxy_pending = 0;
    if (!n) return 1;
    buf_consume(&c->in, (size_t)n);
    c->proxied = 1;
    if (c->admin) return 1;
    peer *p = peer_of(c->client);
    if (p->n >= S.max_per_ip) {
        episode_note(&ep_per_ip);
        peer_drop(p);
        conn_close(c);
        return LTG_ERR;
    }
    p->n++;
    c->peer = p;
    return 1;
}

/* A request through a trusted proxy names its client in X-Forwarded-For
 * (the last such header): the rightmost address that is not a trusted
 * proxy. The connection counts for that client from now on; LTG_ERR when
 * that client holds --max-conns-per-ip connections already. A connection
 * that began with a PROXY header has its client from it, for all its
 * requests: an X-Forwarded-For on it is the client's own word. */
static int conn_forwarded(conn *c) {
    const char *v = NULL;
    size_t n = 0;
    if (c->proxied) return 0;
    for (int i = 0; i < c->req.nh; i++)
        if (ascii_casecmp_n(c->in.p + c->req.h[i].name.off, c->req.h[i].name.len,
                            "x-forwarded-for") == 0) {
            v = c->in.p + c->req.h[i].value.off;
            n = c->req.h[i].value.len;
        }
    uint8_t a[16];
    int found = 0;
    for (size_t end = n; v && end > 0 && !found;) {
        size_t start = end, s, e;
        while (start > 0 && v[start - 1] != ',') start--;
        for (s = start; s < end && (v[s] == ' ' || v[s] == '\t'); s++) {}
        for (e = end; e > s && (v[e - 1] == ' ' || v[e - 1] == '\t'); e--) {}
        /* not an address: nothing to its left is believed */
        if (addr16_parse(v + s, e - s, a) < 0) break;
        found = !addr_trusted(a);
        end = start ? start - 1 : 0;
    }
    if (!found) return 0;
    memcpy(c->client, a, 16);
    if (c->admin) return 0;
    peer *p = peer_of(a);
    if (p == c->peer) return 0;
    if (p->n >= S.max_per_ip) {
        episode_note(&ep_per_ip);
        peer_drop(p);
        return LTG_ERR;
    }
    if (c->peer) {
        c->peer->n--;
        peer_drop(c->peer);
    }
    /* for this request: a balancer's pooled connection is no one's between requests */
    p->n++;
    c->peer = p;
    c->forwarded = 1;
    return 0;
}


/* The bearer token of the request, or NULL. */
static const char *request_bearer(conn *c, size_t *n) {
    const char *v = http_header_get(c->in.p, c->req.h, c->req.nh, "authorization", n);
    if (!v || *n < 7 || ascii_casecmp_n(v, 7, "bearer ") != 0) return NULL;
    v += 7;
    *n -= 7;
    while (*n && *v == ' ') {
        v++;
        (*n)--;
    }
    return *n ? v : NULL;
}

/* ===== 7. Name resolution: /etc/hosts and a DNS client of its own =====
 *
 * IMPLEMENTATION NOTES
 * getaddrinfo() blocks, and in a static binary it would drag in NSS, so ltg
 * resolves names itself: a numeric address is used as it is; then
 * /etc/hosts (read at start-up); then a DNS query over UDP to the servers of
 * --resolv-conf (default /etc/resolv.conf; A records, recursion desired). Answers are cached for
 * their TTL (at most an hour), failures for a few seconds, so a dead name
 * does not cost a query per request. Every upstream connection that waits
 * for the same name joins one pending entry; one query serves them all.
 *
 * A query is retried on the next server after DNS_TIMEOUT_MS, DNS_TRIES
 * times in all. The answer must carry the query's random id and come from
 * the server asked. Only IPv4 answers are asked for (see the roadmap).
 */
enum { DNS_PENDING, DNS_OK, DNS_FAILED };

struct dns_entry {
    dns_entry *next;
    char name[256];
    int state;
    struct sockaddr_storage addr; /* port 0; the caller sets it */
    int64_t expires;              /* S.now ms; for a pending entry: unused */
    uint16_t qid;
    int tries;
    /* the socket of its query in flight (-1: none), connected to its server */
    int fd;
    timer t;
    upstream *waiters;
    const char *err;
};

typedef struct hosts_entry {
    struct hosts_entry *next;
    char *name;
    struct sockaddr_storage addr;
} hosts_entry;
static hosts_entry *hosts;

/* Read a whole small file (config, hosts, resolv.conf) into `out`. */
static int read_file(const char *path, buf *out) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return LTG_ERR;
    char tmp[8192];
    ssize_t n;
    while ((n = read(fd, tmp, sizeof tmp)) > 0) buf_append(out, tmp, (size_t)n);
    close(fd);
    if (!out->p) buf_reserve(out, 0);
    return n < 0 ? LTG_ERR : 0;
}

/* Call fn(word, ...) for each line of a text file split into words ('#' starts a comment). */
static void for_each_line(const char *path, void (*fn)(char **w, int n)) {
    buf b = {0};
    if (read_file(path, &b) < 0) { buf_free(&b); return; }
    char *save = NULL;
    for (char *line = strtok_r(b.p, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *w[16], *s2 = NULL;
        int n = 0;
        for (char *t = strtok_r(line, " \t\r", &s2); t && n < 16; t = strtok_r(NULL, " \t\r", &s2))
            w[n++] = t;
        if (n) fn(w, n);
    }
    buf_free(&b);
}

static void hosts_line(char **w, int n) {
    struct sockaddr_storage ss;
    if (addr_parse(w[0], &ss) < 0) return;
    for (int i = 1; i < n; i++) {
        hosts_entry *h = xcalloc(1, sizeof *h);
        h->name = xstrndup(w[i], strlen(w[i]));
        h->addr = ss;
        h->next = hosts;
        hosts = h;
    }
}

static void resolv_line(char **w, int n) {
    if (n < 2 || strcmp(w[0], "nameserver") != 0 || S.ndns_servers == 3) return;
    struct sockaddr_storage ss;
    if (addr_parse(w[1], &ss) < 0 || ss.ss_family != AF_INET) return; /* the query socket is IPv4 */
    addr_set_port(&ss, 53);
    S.dns_servers[S.ndns_servers++] = ss;
}

/* Build a DNS query for the A record of `name` into q; returns its length
 * or LTG_ERR when the name is not a valid host name. */
static int dns_build_query(const char *name, uint16_t id, uint8_t *q, size_t cap) {
    size_t n = strlen(name), i = 12;
    if (n == 0 || n > 253 || cap < n + 18) return LTG_ERR;
    memset(q, 0, 12);
    q[0] = (uint8_t)(id >> 8);
    q[1] = (uint8_t)id;
    q[2] = 0x01; /* RD: recursion desired */
    q[5] = 1;    /* one question */
    for (const char *p = name; *p;) {
        const char *dot = strchr(p, '.');
        size_t len = dot ? (size_t)(dot - p) : strlen(p);
        if (len == 0 || len > 63) {
            if (len == 0 && !dot[1]) break; /* a trailing dot: "example.com." */
            return LTG_ERR;
        }
        q[i++] = (uint8_t)len;
        memcpy(q + i, p, len);
        i += len;
        p += len + (dot ? 1 : 0);
    }
    q[i++] = 0;
    /* QTYPE A */
    q[i++] = 0;
    q[i++] = 1;
    /* QCLASS IN */
    q[i++] = 0;
    q[i++] = 1;
    return (int)i;
}

/* Skip a (possibly compressed) name at p[*i]; LTG_ERR past the end. */
static int dns_skip_name(const uint8_t *p, size_t n, size_t *i) {
    for (int labels = 0; labels < 128; labels++) {
        if (*i >= n) return LTG_ERR;
        uint8_t len = p[*i];
        if (len == 0) { (*i)++; return 0; }
        if ((len & 0xC0) == 0xC0) { if (*i + 2 > n) return LTG_ERR; *i += 2; return 0; }
        if (len & 0xC0) return LTG_ERR;
        *i += 1u + len;
    }
    return LTG_ERR;
}

/* Does the answer p[0..n) ask the one question of query q[0..qn) (its
 * name compared without case, as DNS does)? */
static int dns_same_question(const uint8_t *p, size_t n, const uint8_t *q, size_t qn) {
    if (n < qn || p[4] != 0 || p[5] != 1) return 0;
    for (size_t i = 12; i < qn; i++)
        if (tolower(p[i]) != tolower(q[i])) return 0;
    return 1;
}

/* Parse a DNS answer to query q (qn bytes: its id and its question): the
 * first A record, and the smallest TTL of the records on the way to it.
 * Returns 0, or LTG_ERR with *why. An answer whose id or question is not
 * the query's is not an answer to it: a spoofed reply must guess both, and
 * the source port of a socket opened for this query alone. */
static int dns_parse_answer(const uint8_t *p, size_t n, const uint8_t *q, size_t qn,
                            struct in_addr *addr, uint32_t *ttl, const char **why) {
    *why = "malformed DNS answer";
    if (n < 12) return LTG_ERR;
    if (p[0] != q[0] || p[1] != q[1] || !(p[2] & 0x80) || !dns_same_question(p, n, q, qn)) {
        *why = "DNS answer to another query";
        return LTG_ERR;
    }
    int rcode = p[3] & 0x0F;
    if (rcode == 3) { *why = "no such host (NXDOMAIN)"; return LTG_ERR; }
    if (rcode != 0) { *why = "DNS server failure"; return LTG_ERR; }
    if (p[2] & 0x02) { *why = "truncated DNS answer"; return LTG_ERR; }
    int qd = p[4] << 8 | p[5], an = p[6] << 8 | p[7];
    size_t i = 12;
    for (int k = 0; k < qd; k++) {
        if (dns_skip_name(p, n, &i) < 0 || i + 4 > n) return LTG_ERR;
        i += 4;
    }
    uint32_t min_ttl = DNS_MAX_TTL_S;
    for (int k = 0; k < an; k++) {
        if (dns_skip_name(p, n, &i) < 0 || i + 10 > n) return LTG_ERR;
        int type = p[i] << 8 | p[i + 1], rdlen = p[i + 8] << 8 | p[i + 9];
        uint32_t t = (uint32_t)p[i + 4] << 24 | (uint32_t)p[i + 5] << 16 | (uint32_t)p[i + 6] << 8 |
                     p[i + 7];
        i += 10;
        if (i + (size_t)rdlen > n) return LTG_ERR;
        if (t < min_ttl) min_ttl = t;
        if (type == 1 && rdlen == 4) {
            memcpy(addr, p + i, 4);
            *ttl = min_ttl;
            return 0;
        }
        i += (size_t)rdlen; /* a CNAME on the way: its TTL counted, its target follows */
    }
    *why = "the name has no IPv4 address";
    return LTG_ERR;
}

static void up_resolved(upstream *u, const struct sockaddr_storage *addr, const char *err);
static upstream **up_wait_link(upstream *u); /* the link of an upstream in a waiter list */

static void dns_finish(dns_entry *e, const char *err) {
    timer_stop(&e->t);
    if (e->fd >= 0) {
        loop_close(e->fd);
        e->fd = -1;
    }
    e->state = err ? DNS_FAILED : DNS_OK;
    e->err = err;
    if (err) e->expires = S.now + DNS_NEGATIVE_TTL_S * 1000;
    if (err) ltg_log("cannot resolve %s: %s", e->name, err);
    upstream *w = e->waiters;
    e->waiters = NULL;
    while (w) {
        upstream *next = *up_wait_link(w);
        up_resolved(w, err ? NULL : &e->addr, err);
        w = next;
    }
}

static void dns_readable(void *ctx, int revents);

/* Send e's query to its next server, from a socket of its own (a new
 * random source port each try, answers from that server alone). */
static void dns_send(dns_entry *e) {
    uint8_t q[300];
    int n = dns_build_query(e->name, e->qid, q, sizeof q);
    const struct sockaddr_storage *srv = &S.dns_servers[e->tries % S.ndns_servers];
    e->tries++;
    if (n < 0) { dns_finish(e, "invalid host name"); return; }
    if (e->fd >= 0) loop_close(e->fd);
    e->fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (e->fd < 0 || connect(e->fd, (const struct sockaddr *)srv, addr_len(srv)) < 0 ||
        send(e->fd, q, (size_t)n, 0) < 0)
        ltg_log("DNS query for %s: %s", e->name, strerror(errno)); /* the timer retries */
    if (e->fd >= 0) loop_watch(e->fd, POLLIN, dns_readable, e);
    timer_set(&e->t, DNS_TIMEOUT_MS);
}

static void dns_timeout(void *ctx) {
    dns_entry *e = ctx;
    if (e->tries >= DNS_TRIES) dns_finish(e, "DNS timed out");
    else dns_send(e);
}

/* Datagrams on e's socket (connected: only its server's). One that is not
 * an answer to its query is dropped, and the query waits on. */
static void dns_readable(void *ctx, int revents) {
    (void)revents;
    dns_entry *e = ctx;
    uint8_t p[1500], q[300];
    int qn = dns_build_query(e->name, e->qid, q, sizeof q);
    while (e->fd >= 0) {
        ssize_t n = recv(e->fd, p, sizeof p, 0);
        if (n < 0) return; /* EAGAIN, or an ICMP error for the query: its timer retries */
        struct in_addr a;
        uint32_t ttl;
        const char *why;
        if (dns_parse_answer(p, (size_t)n, q, (size_t)qn, &a, &ttl, &why) < 0) {
            if (strcmp(why, "DNS answer to another query") != 0) dns_finish(e, why);
            continue;
        }
        memset(&e->addr, 0, sizeof e->addr);
        ((struct sockaddr_in *)&e->addr)->sin_family = AF_INET;
        ((struct sockaddr_in *)&e->addr)->sin_addr = a;
        e->expires = S.now + (int64_t)ttl * 1000;
        dns_finish(e, NULL);
    }
}

/* Resolve `host` for upstream u. Returns 0 with *addr filled, LTG_AGAIN when
 * u will be called back through up_resolved() (u NULL: when the answer is
 * cached), or LTG_ERR with *err. */
static int dns_resolve(const char *host, upstream *u, struct sockaddr_storage *addr,
                       const char **err) {
    if (addr_parse(host, addr) == 0) return 0;
    for (hosts_entry *h = hosts; h; h = h->next)
        if (strcasecmp(h->name, host) == 0) { *addr = h->addr; return 0; }
    dns_entry *e;
    for (e = S.dns_cache; e; e = e->next)
        if (strcasecmp(e->name, host) == 0) break;
    if (e && e->state != DNS_PENDING && e->expires <= S.now) {
        e->state = DNS_PENDING;
        e->tries = 0;
        e->qid = 0;
    }
    if (e && e->state == DNS_OK) { *addr = e->addr; return 0; }
    if (e && e->state == DNS_FAILED) { *err = e->err; return LTG_ERR; }
    if (!S.ndns_servers) {
        *err = "no DNS server (nameserver in /etc/resolv.conf)";
        return LTG_ERR;
    }
    if (strlen(host) >= sizeof e->name) { *err = "host name too long"; return LTG_ERR; }
    if (!e) {
        e = xcalloc(1, sizeof *e);
        snprintf(e->name, sizeof e->name, "%s", host);
        timer_init(&e->t, dns_timeout, e);
        e->state = DNS_PENDING;
        e->fd = -1;
        e->next = S.dns_cache;
        S.dns_cache = e;
    }
    if (u) { /* NULL: a caller that asks again later (section 21) */
        *up_wait_link(u) = e->waiters;
        e->waiters = u;
    }
    if (!e->qid) {
        e->qid = (uint16_t)(rng_next() | 1);
        dns_send(e);
    }
    return LTG_AGAIN;
}

/* Forget u as a waiter (its exchange ended before the answer came). */
static void dns_cancel(upstream *u) {
    for (dns_entry *e = S.dns_cache; e; e = e->next)
        for (upstream **pp = &e->waiters; *pp; pp = up_wait_link(*pp))
            if (*pp == u) { *pp = *up_wait_link(u); return; }
}

static void dns_init(void) {
    /* even without /etc/hosts; entries go in front, so the file's own wins */
    hosts_line((char *[]){"127.0.0.1", "localhost"}, 2);
    for_each_line("/etc/hosts", hosts_line);
    for_each_line(S.resolv_conf, resolv_line);
    /* the resolver's documented default */
    if (!S.ndns_servers) resolv_line((char *[]){"nameserver", "127.0.0.1"}, 2);
}

/* ===== 8. TLS: trust anchors and the pump =====
 *
 * IMPLEMENTATION NOTES
 * HTTPS to providers is BearSSL's engine driven by the loop: no thread, no
 * blocking call. The engine is a state machine with four byte streams --
 * records to send, records received, plaintext in, plaintext out -- and it
 * says which it can move now (br_ssl_engine_current_state). tls_pump()
 * moves every one that can move without blocking, in BearSSL's own order
 * (records out first), and turns what the engine then waits for into poll
 * interest: records to send -> POLLOUT, records wanted -> POLLIN. Plaintext
 * the engine has already decrypted never makes the socket readable, so the
 * pump always drains it before it stops.
 *
 * Policy: TLS 1.2 only, ECDHE with AES-GCM or ChaCha20-Poly1305,
 * renegotiation off, SNI and host name checks on (a provider may turn
 * verification off with "tls_verify": false; ltg warns at start-up). The
 * trust anchors come from the system bundle or --ca-file, loaded once when
 * a provider needs them. Each provider keeps the parameters of its last
 * session, so a new connection resumes it (an abbreviated handshake, about
 * a tenth of the CPU); the pool keeps connections open anyway, so most
 * requests pay no handshake at all.
 *
 * BearSSL 0.6 speaks TLS 1.0-1.2 only and checks no revocation (OCSP, CRL);
 * it matches DNS names, not IP addresses, so an https provider given by IP
 * address gets no SNI and no name check (ltg warns). A connection's engine
 * and buffers live in one allocation that never moves: the engine holds
 * pointers into itself.
 */

/* A provider as the engine sees it -- where its connections go, how they
 * are secured, its pool of idle ones -- and what the gateway adds: its API
 * keys and the APIs it speaks. The catalog (section 10) fills it in. */
enum { API_OPENAI, API_ANTHROPIC };
/* The endpoints of the two APIs (section 18's WIRE rows, `ep`): a provider serves a set of them,
 * a bit each. An OpenAI-API provider serves all four of its own unless its `endpoints` says
 * otherwise; an Anthropic one, Messages and count_tokens. */
enum { EP_CHAT, EP_COMPLETIONS, EP_EMBEDDINGS, EP_RESPONSES, EP_MESSAGES, EP_COUNT_TOKENS };
static const char *const ep_names[] = {"chat", "completions", "embeddings", "responses",
                                       "messages", "count_tokens"};
#define EPS_OPENAI (1u << EP_CHAT | 1u << EP_COMPLETIONS | 1u << EP_EMBEDDINGS | 1u << EP_RESPONSES)
#define EPS_ANTHROPIC (1u << EP_MESSAGES | 1u << EP_COUNT_TOKENS)

struct provider {
    char *name, *host, *base_path, *hostport;
    char **keys;    /* its API keys (api_key_env, or api_key_envs: used in turn); nkeys 0: none */
    int nkeys, next_key;
    int64_t *key_bad_until; /* per key, S.now ms: a key the provider refused rests until then */
    int port, tls, tls_verify;
    int api;        /* API_OPENAI or API_ANTHROPIC: the APIs it speaks (section 18's WIRE) */
    unsigned endpoints; /* ... and which of that API's endpoints it serves (EP_* bits) */
    br_ssl_session_parameters session; /* the last TLS session, for resumption (section 8) */
    int have_session;
    upstream *idle; /* the pool: idle keep-alive connections, most recent first */
    int nidle, nbusy; /* ... and those serving a request */
    catalog *cat;
};
#define TLS_DEFAULT_CA "/etc/ssl/certs/ca-certificates.crt"

static struct {
    br_x509_trust_anchor *ta;
    size_t nta, cap;
    const char *ca_file;      /* --ca-file, or the system bundle */
    uint64_t full, resumed;   /* handshakes: the share of full ones is what pooling must keep low */
} TLS;

/* ---- trust anchors ---- */

static void dn_append(void *ctx, const void *p, size_t n) { buf_append(ctx, p, n); }

/* Turn one DER certificate into a trust anchor (its DN and key in one
 * allocation). Returns 0, or LTG_ERR for a certificate BearSSL cannot use. */
static int tls_add_anchor(const unsigned char *der, size_t n) {
    br_x509_decoder_context dc;
    buf dn = {0};
    br_x509_decoder_init(&dc, dn_append, &dn);
    br_x509_decoder_push(&dc, der, n);
    const br_x509_pkey *pk = br_x509_decoder_get_pkey(&dc);
    if (!pk || br_x509_decoder_last_error(&dc)) { buf_free(&dn); return LTG_ERR; }
    size_t keylen =
            pk->key_type == BR_KEYTYPE_RSA ? pk->key.rsa.nlen + pk->key.rsa.elen : pk->key.ec.qlen;
    unsigned char *blob = xmalloc(dn.len + keylen + 1);
    memcpy(blob, dn.p ? dn.p : "", dn.len);
    if (TLS.nta == TLS.cap) {
        TLS.cap = TLS.cap ? TLS.cap * 2 : 256;
        TLS.ta = xrealloc(TLS.ta, TLS.cap * sizeof *TLS.ta);
    }
    br_x509_trust_anchor *ta = &TLS.ta[TLS.nta++];
    ta->dn.data = blob;
    ta->dn.len = dn.len;
    ta->flags = br_x509_decoder_isCA(&dc) ? BR_X509_TA_CA : 0;
    ta->pkey = *pk;
    unsigned char *k = blob + dn.len;
    if (pk->key_type == BR_KEYTYPE_RSA) {
        memcpy(k, pk->key.rsa.n, pk->key.rsa.nlen);
        ta->pkey.key.rsa.n = k;
        memcpy(k + pk->key.rsa.nlen, pk->key.rsa.e, pk->key.rsa.elen);
        ta->pkey.key.rsa.e = k + pk->key.rsa.nlen;
    } else {
        memcpy(k, pk->key.ec.q, pk->key.ec.qlen);
        ta->pkey.key.ec.q = k;
    }
    buf_free(&dn);
    return 0;
}

/* Load every certificate of a PEM bundle (or one DER certificate) as a
 * trust anchor. Returns the count, or LTG_ERR with err set. */
static int tls_load_anchors(const char *path, char *err, size_t errlen) {
    buf f = {0}, der = {0};
    if (read_file(path, &f) < 0) {
        snprintf(err, errlen, "%s: cannot read the CA bundle: %s (give another with --ca-file)",
                 path, strerror(errno));
        return LTG_ERR;
    }
    size_t before = TLS.nta;
    int skipped = 0;
    const unsigned char *p = (const unsigned char *)f.p;
    if (f.len > 4 && p[0] == 0x30 && p[1] == 0x82 && (size_t)((p[2] << 8 | p[3]) + 4) == f.len) {
        /* one DER certificate */
        skipped += tls_add_anchor(p, f.len) < 0;
    } else {
        br_pem_decoder_context pc;
        br_pem_decoder_init(&pc);
        int in_cert = 0;
        buf_puts(&f, "\n"); /* a bundle whose last line has no newline keeps its last certificate */
        for (size_t off = 0; off < f.len;) {
            off += br_pem_decoder_push(&pc, f.p + off, f.len - off);
            switch (br_pem_decoder_event(&pc)) {
            case BR_PEM_BEGIN_OBJ:
                in_cert = strcmp(br_pem_decoder_name(&pc), "CERTIFICATE") == 0 ||
                          strcmp(br_pem_decoder_name(&pc), "X509 CERTIFICATE") == 0;
                der.len = 0;
                br_pem_decoder_setdest(&pc, in_cert ? dn_append : NULL, &der);
                break;
            case BR_PEM_END_OBJ:
                if (in_cert) skipped += tls_add_anchor((const unsigned char *)der.p, der.len) < 0;
                in_cert = 0;
                break;
            case BR_PEM_ERROR:
                snprintf(err, errlen, "%s: not a valid PEM file (near byte %zu)", path, off);
                buf_free(&f);
                buf_free(&der);
                while (TLS.nta > before) free(TLS.ta[--TLS.nta].dn.data); /* all or nothing */
                return LTG_ERR;
            }
        }
    }
    buf_free(&f);
    buf_free(&der);
    if (TLS.nta == before) {
        snprintf(err, errlen,
                 "%s: no usable certificate in it (%d skipped): give a PEM bundle of CA "
                 "certificates with --ca-file",
                 path, skipped);
        return LTG_ERR;
    }
    if (skipped)
        ltg_log("%s: %d certificate(s) skipped (a key type or encoding BearSSL does not take)",
                path, skipped);
    return (int)(TLS.nta - before);
}

/* ---- verification off: the leaf's key is taken, nothing is checked ---- */

typedef struct {
    const br_x509_class *vtable;
    br_x509_decoder_context dc;
    int certs;
} tls_noverify;

static void nv_start_chain(const br_x509_class **ctx, const char *name) {
    (void)name;
    ((tls_noverify *)(void *)ctx)->certs = 0;
}
static void nv_start_cert(const br_x509_class **ctx, uint32_t len) {
    (void)len;
    tls_noverify *nv = (tls_noverify *)(void *)ctx;
    if (nv->certs == 0) br_x509_decoder_init(&nv->dc, NULL, NULL);
}
static void nv_append(const br_x509_class **ctx, const unsigned char *p, size_t n) {
    tls_noverify *nv = (tls_noverify *)(void *)ctx;
    if (nv->certs == 0) br_x509_decoder_push(&nv->dc, p, n);
}
static void nv_end_cert(const br_x509_class **ctx) { ((tls_noverify *)(void *)ctx)->certs++; }
static unsigned nv_end_chain(const br_x509_class **ctx) {
    tls_noverify *nv = (tls_noverify *)(void *)ctx;
    return br_x509_decoder_get_pkey(&nv->dc) ? 0 : BR_ERR_X509_EMPTY_CHAIN;
}
static const br_x509_pkey *nv_get_pkey(const br_x509_class *const *ctx, unsigned *usages) {
    tls_noverify *nv = (tls_noverify *)(void *)ctx;
    if (usages) *usages = BR_KEYTYPE_KEYX | BR_KEYTYPE_SIGN;
    return br_x509_decoder_get_pkey(&nv->dc);
}
static const br_x509_class tls_noverify_class = {
    sizeof(tls_noverify), nv_start_chain, nv_start_cert, nv_append, nv_end_cert, nv_end_chain,
    nv_get_pkey
};

/* ---- a connection ---- */

typedef struct {
    br_ssl_client_context sc;
    br_x509_minimal_context xc;
    tls_noverify nv;
    unsigned char iobuf[BR_SSL_BUFSIZE_BIDI];
} tls_conn;

/* A BearSSL error in words, for the log, the attempt log and the answer. */
static const char *tls_error_words(int err, char *tmp, size_t n) {
    switch (err) {
    case BR_ERR_X509_NOT_TRUSTED:
        return "certificate not trusted (its CA is not in the trust anchors: see --ca-file)";
    case BR_ERR_X509_BAD_SERVER_NAME:
        return "certificate name mismatch (it is not for this host name)";
    case BR_ERR_X509_EXPIRED: return "certificate expired or not yet valid";
    case BR_ERR_X509_TIME_UNKNOWN: return "no clock to check the certificate's dates";
    case BR_ERR_BAD_VERSION: return "the server does not speak TLS 1.2";
    case BR_ERR_RECV_FATAL_ALERT + 70:
        return "server requires a protocol version ltg lacks (TLS 1.3 only?)";
    case BR_ERR_RECV_FATAL_ALERT + 40:
        return "the server refused the handshake (no common cipher suite?)";
    case BR_ERR_RECV_FATAL_ALERT + 112: return "the server does not know this host name (SNI)";
    }
    if (err >= BR_ERR_SEND_FATAL_ALERT)
        snprintf(tmp, n, "TLS alert %d sent by ltg", err - BR_ERR_SEND_FATAL_ALERT);
    else if (err >= BR_ERR_RECV_FATAL_ALERT)
        snprintf(tmp, n, "TLS alert %d from the server", err - BR_ERR_RECV_FATAL_ALERT);
    else if (err >= 32 && err < 64)
        snprintf(tmp, n, "certificate rejected (BearSSL X.509 error %d)", err);
    else snprintf(tmp, n, "TLS error %d", err);
    return tmp;
}

static const uint16_t tls_suites[] = {
    BR_TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, BR_TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
    BR_TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384, BR_TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
    BR_TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
    BR_TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256
};

/* A client engine for provider p, ready to say ClientHello (resuming p's
 * last session when it has one). NULL with *why on failure. */
static tls_conn *tls_new(provider *p, const char **why) {
    tls_conn *t = xmalloc(sizeof *t);
    br_ssl_engine_context *eng = &t->sc.eng;
    br_ssl_client_init_full(&t->sc, &t->xc, TLS.ta, TLS.nta);
    br_ssl_engine_set_versions(eng, BR_TLS12, BR_TLS12);
    br_ssl_engine_set_suites(eng, tls_suites, sizeof tls_suites / sizeof *tls_suites);
    br_ssl_engine_add_flags(eng, BR_OPT_NO_RENEGOTIATION);
    if (!p->tls_verify) {
        t->nv.vtable = &tls_noverify_class;
        br_ssl_engine_set_x509(eng, &t->nv.vtable);
    }
    br_ssl_engine_set_buffer(eng, t->iobuf, sizeof t->iobuf, 1);
    uint8_t seed[32];
    os_random(seed, sizeof seed); /* mixed into BearSSL's own seeding */
    br_ssl_engine_inject_entropy(eng, seed, sizeof seed);
    if (p->have_session) br_ssl_engine_set_session_parameters(eng, &p->session);
    struct sockaddr_storage ss;
    int ip = addr_parse(p->host, &ss) == 0; /* BearSSL matches names, not addresses */
    if (!br_ssl_client_reset(&t->sc, ip ? NULL : p->host, p->have_session)) {
        *why = "the TLS engine could not start (host name too long, or no randomness)";
        free(t);
        return NULL;
    }
    return t;
}

/* The handshake completed: count it, keep the session for the next connection. */
static void tls_handshake_done(provider *p, tls_conn *t) {
    br_ssl_session_parameters now;
    br_ssl_engine_get_session_parameters(&t->sc.eng, &now);
    int resumed = p->have_session && now.session_id_len == p->session.session_id_len &&
                  memcmp(now.session_id, p->session.session_id, now.session_id_len) == 0;
    if (resumed) TLS.resumed++;
    else TLS.full++;
    metric_add(M_TLS, 1, "provider", p->name, "kind", resumed ? "resumed" : "full", NULL);
    p->session = now;
    p->have_session = 1;
}

enum { PUMP_OK, PUMP_EOF, PUMP_ERR };
enum { SOCK_MOVED, SOCK_BLOCKED, SOCK_EOF, SOCK_ERR };

/* Records between the engine and the socket, one send (`out`) or one recv
 * (counted in *took); on SOCK_ERR, why holds the reason. */
static int tls_socket(br_ssl_engine_context *eng, int fd, int out, size_t *took, char *why,
                      size_t whylen) {
    size_t n;
    unsigned char *p =
        out ? br_ssl_engine_sendrec_buf(eng, &n) : br_ssl_engine_recvrec_buf(eng, &n);
    ssize_t r = out ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
    if (r > 0 && out) br_ssl_engine_sendrec_ack(eng, (size_t)r);
    else if (r > 0) {
        br_ssl_engine_recvrec_ack(eng, (size_t)r);
        *took += (size_t)r;
    }
    if (r > 0 || (r < 0 && errno == EINTR)) return SOCK_MOVED;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return SOCK_BLOCKED;
    if (r == 0 && !out) return SOCK_EOF; /* without close_notify: the HTTP framing decides */
    snprintf(why, whylen, "%s: %s", out ? "write" : "read", r < 0 ? strerror(errno) : "closed");
    return SOCK_ERR;
}

/* Move records and plaintext as far as they go without blocking: plaintext
 * from out[*sent..outlen) into the engine, decrypted plaintext onto `in`.
 * `reading` says whether to take records from the socket (not while the
 * client is slow). Sets *events to the poll interest; *ready turns 1 when
 * the handshake completes. On PUMP_ERR, why holds the reason. */
static int tls_pump(tls_conn *t, int fd, const char *out, size_t outlen, size_t *sent, buf *in,
                    int reading, int *ready, short *events, char *why, size_t whylen) {
    br_ssl_engine_context *eng = &t->sc.eng;
    int out_blocked = 0, in_blocked = 0, rc = PUMP_OK;
    /* bytes from the socket this call: at most 4 x READ_CHUNK, as a plain read (poll comes back
     * for the rest) */
    size_t took = 0;
    unsigned st;
    for (;;) {
        st = br_ssl_engine_current_state(eng);
        if (st & BR_SSL_CLOSED) {
            int err = br_ssl_engine_last_error(eng);
            if (!err) { rc = PUMP_EOF; break; } /* close_notify */
            char tmp[96];
            snprintf(why, whylen, "%s", tls_error_words(err, tmp, sizeof tmp));
            return PUMP_ERR;
        }
        if (!*ready && (st & (BR_SSL_SENDAPP | BR_SSL_RECVAPP))) *ready = 1;
        size_t n;
        unsigned char *p;
        if ((st & BR_SSL_SENDREC) && !out_blocked) {
            /* records out first, as BearSSL's run_until does */
            int k = tls_socket(eng, fd, 1, &took, why, whylen);
            if (k == SOCK_ERR) return PUMP_ERR;
            if (k == SOCK_MOVED) continue;
            out_blocked = 1;
        }
        if (st & BR_SSL_RECVAPP) {
            p = br_ssl_engine_recvapp_buf(eng, &n);
            buf_append(in, p, n);
            br_ssl_engine_recvapp_ack(eng, n);
            continue;
        }
        if ((st & BR_SSL_SENDAPP) && *sent < outlen) {
            p = br_ssl_engine_sendapp_buf(eng, &n);
            if (n > outlen - *sent) n = outlen - *sent;
            memcpy(p, out + *sent, n);
            br_ssl_engine_sendapp_ack(eng, n);
            *sent += n;
            /* the request is whole: send its last record now */
            if (*sent == outlen) br_ssl_engine_flush(eng, 0);
            continue;
        }
        if ((st & BR_SSL_RECVREC) && !in_blocked && reading && took < 4 * READ_CHUNK) {
            int k = tls_socket(eng, fd, 0, &took, why, whylen);
            if (k == SOCK_ERR) return PUMP_ERR;
            if (k == SOCK_EOF) { rc = PUMP_EOF; break; }
            if (k == SOCK_MOVED) continue;
            in_blocked = 1;
        }
        break;
    }
    st = br_ssl_engine_current_state(eng);
    *events = (short)(((st & BR_SSL_SENDREC) ? POLLOUT : 0) |
                      ((st & BR_SSL_RECVREC) && reading ? POLLIN : 0));
    return rc;
}

/* ===== 9. Upstream connections and the pool =====
 *
 * IMPLEMENTATION NOTES
 * An upstream connection carries one request at a time to one provider.
 * It is one state machine, and up_to() is the only place its state
 * changes: the transition is checked and the timer armed for the state
 * entered, so what the timer means follows from the state alone.
 *
 *   RESOLVING -> CONNECTING -> [HANDSHAKE] -> SENDING -> HEAD -> BODY -> DONE
 *                                                         \       \-> EOF -> DONE
 *   any of them -> FAILED                    DONE -> (pool) IDLE -> SENDING ...
 *
 *   state      polled for   the timer means
 *   RESOLVING  --           -- (the DNS client calls up_resolved)
 *   CONNECTING POLLOUT      the connect deadline (CONNECT_TIMEOUT_MS)
 *   HANDSHAKE  the pump's   the same deadline, run on (https only)
 *   SENDING    POLLOUT      --
 *   HEAD, BODY POLLIN       -- (the exchange times the attempt)
 *   EOF        --           now: the provider closed as data came; the
 *                           data is handed on first, the close next turn
 *   DONE       --           -- (the answer is whole)
 *   FAILED     --           now: tell the owner on the next turn (`err`)
 *   IDLE       --           the pool's idle timeout (POOL_IDLE_MS)
 *
 * It knows nothing of retries or clients. Its owner (an exchange) hears of
 * it through upstream_event (ltg.h) and reads the state, the head (once
 * up_has_head()), the decoded body in `body`, or `err`.
 *
 * What a failure means for a retry depends on how far the request got:
 * `wrote` counts the bytes of the request handed on, and nothing written
 * means nothing reached the provider. `local` marks a failure that was
 * ltg's own (out of fds), which no breaker should count.
 *
 * The pool keeps idle keep-alive connections per provider, most recent
 * first (the warmest), so the ones a burst left behind age out after
 * POOL_IDLE_MS. An idle connection is not polled: poll() costs time for
 * every fd on every turn, and a burst can leave dozens idle. Instead it is
 * checked with a non-blocking MSG_PEEK before reuse, so one the provider
 * closed in the meantime is dropped and never written to. Over TLS
 * (section 8) the engine sits between this code and the socket: up_write
 * and up_read hand bytes to tls_pump() instead of the kernel.
 */
typedef enum {
    UP_RESOLVING, UP_CONNECTING, UP_HANDSHAKE, UP_SENDING, UP_HEAD, UP_BODY, UP_EOF, UP_DONE,
    UP_FAILED, UP_IDLE
} up_state;

struct upstream {
    upstream *link;     /* next DNS waiter, or next idle connection in the pool */
    int fd;
    up_state state;
    provider *p;
    void *owner;        /* the request it serves (an exchange); NULL while idle */
    upstream_event *event; /* how it tells the owner of news (ltg.h) */
    buf out;            /* the request */
    size_t wrote;       /* bytes of `out` handed on: to the kernel, or over TLS to the engine */
    /* bytes from the provider not yet parsed (after DONE: bytes past the answer) */
    buf in;
    size_t scan;        /* http_head_end's resume point */
    buf head;           /* the response head, once it came (else empty); `resp` points into it */
    http_response resp;
    int paused;         /* the owner asked not to read (a slow client) */
    int local;          /* the failure was ltg's own (out of fds): the provider is not to blame */
    chunk_decoder cd;
    long long body_left;
    buf body;           /* decoded body bytes the exchange has not taken yet */
    timer t;            /* its meaning: see the table above */
    tls_conn *tls;      /* the TLS engine of an https provider (section 8), else NULL */
    char err[200];
};

static upstream **up_wait_link(upstream *u) { return &u->link; }

static int up_has_head(const upstream *u) { return u->head.len > 0; }

/* The answer is framed by the provider's close (no length, not chunked). */
static int up_until_eof(const upstream *u) {
    return !u->resp.chunked && u->resp.content_length < 0;
}

/* The one place a connection changes state (see the table above). */
static void up_to(upstream *u, up_state to) {
    static const unsigned short next[] = {
        [UP_RESOLVING] = 1 << UP_CONNECTING | 1 << UP_HANDSHAKE | 1 << UP_SENDING | 1 << UP_FAILED,
        [UP_CONNECTING] = 1 << UP_HANDSHAKE | 1 << UP_SENDING | 1 << UP_FAILED,
        [UP_HANDSHAKE] = 1 << UP_SENDING | 1 << UP_FAILED,
        [UP_SENDING] = 1 << UP_HEAD | 1 << UP_BODY | 1 << UP_EOF | 1 << UP_DONE | 1 << UP_FAILED,
        [UP_HEAD] = 1 << UP_BODY | 1 << UP_EOF | 1 << UP_DONE | 1 << UP_FAILED,
        [UP_BODY] = 1 << UP_EOF | 1 << UP_DONE | 1 << UP_FAILED,
        [UP_EOF] = 1 << UP_DONE | 1 << UP_FAILED,
        [UP_DONE] = 1 << UP_IDLE,
        [UP_FAILED] = 0,
        [UP_IDLE] = 1 << UP_SENDING,
    };
    assert(next[u->state] >> to & 1);
    up_state from = u->state;
    u->state = to;
    switch (to) {
    case UP_CONNECTING: timer_set(&u->t, CONNECT_TIMEOUT_MS); break;
    case UP_HANDSHAKE:
        /* else the deadline runs on */
        if (from != UP_CONNECTING) timer_set(&u->t, CONNECT_TIMEOUT_MS);
        break;
    case UP_EOF: timer_set(&u->t, 0); break;
    case UP_FAILED:
        if (u->fd >= 0) loop_events(u->fd, 0);
        timer_set(&u->t, 0);
        break;
    case UP_IDLE: timer_set(&u->t, POOL_IDLE_MS); break;
    default: timer_stop(&u->t); break;
    }
}

static void up_free(upstream *u) {
    timer_stop(&u->t);
    free(u->tls);
    if (u->fd >= 0) loop_close(u->fd);
    buf_free(&u->out);
    buf_free(&u->in);
    buf_free(&u->head);
    buf_free(&u->body);
    free(u);
}

/* Record a failure; the owner hears of it on the next loop turn. A whole
 * answer stands: nothing after it is a failure of the request. */
static void up_fail(upstream *u, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void up_fail(upstream *u, const char *fmt, ...) {
    if (u->state == UP_FAILED || u->state == UP_DONE) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(u->err, sizeof u->err, fmt, ap);
    va_end(ap);
    up_to(u, UP_FAILED);
}

/* The provider closed the connection: the end of an answer framed by the
 * close, or a failure. Returns 1 when the answer is complete. */
static int up_eof(upstream *u) {
    if (up_has_head(u) && up_until_eof(u)) {
        up_to(u, UP_DONE);
        return 1;
    }
    if (!up_has_head(u) && u->in.len == 0)
        up_fail(u, "%s closed the connection before answering", u->p->host);
    else up_fail(u, "%s closed the connection in the middle of its answer", u->p->host);
    return 0;
}

static void up_notify(void *ctx) {
    upstream *u = ctx;
    switch (u->state) {
    case UP_CONNECTING: up_fail(u, "connect to %s:%d timed out", u->p->host, u->p->port); return;
    case UP_HANDSHAKE: up_fail(u, "TLS handshake with %s timed out", u->p->host); return;
    case UP_EOF: /* see up_tls() */
        if (up_eof(u)) {
            loop_events(u->fd, 0);
            u->event(u->owner);
        }
        return; /* or up_eof() failed it: the failure is told on the next turn */
    case UP_FAILED: u->event(u->owner); return;
    case UP_IDLE: { /* the pool's idle timeout */
        provider *p = u->p;
        for (upstream **pp = &p->idle; *pp; pp = &(*pp)->link)
            if (*pp == u) {
                *pp = u->link;
                p->nidle--;
                break;
            }
        up_free(u);
        return;
    }
    default: assert(!"an upstream timer in a state without one"); return;
    }
}

static void up_io(void *ctx, int revents);

static void up_tls(upstream *u);

static void up_write(upstream *u) {
    if (u->tls) { up_tls(u); return; }
    while (u->wrote < u->out.len) {
        ssize_t n = send(u->fd, u->out.p + u->wrote, u->out.len - u->wrote, MSG_NOSIGNAL);
        if (n > 0) { u->wrote += (size_t)n; continue; }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            loop_events(u->fd, POLLOUT);
            return;
        }
        up_fail(u, "write to %s: %s", u->p->host, n < 0 ? strerror(errno) : "closed");
        return;
    }
    up_to(u, UP_HEAD);
    loop_events(u->fd, u->paused ? 0 : POLLIN);
}

static void up_connect(upstream *u, const struct sockaddr_storage *addr) {
    struct sockaddr_storage a = *addr;
    addr_set_port(&a, u->p->port);
    u->fd = socket(a.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (u->fd < 0 || u->fd >= S.nfds_cap) {
        if (u->fd >= 0) {
            close(u->fd);
            u->fd = -1;
            errno = EMFILE;
        }
        u->local = 1;
        up_fail(u, "no socket for %s: %s", u->p->host, strerror(errno));
        return;
    }
    int one = 1;
    /* a handshake is several small writes */
    setsockopt(u->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    loop_watch(u->fd, POLLOUT, up_io, u);
    const char *why;
    if (u->p->tls && !(u->tls = tls_new(u->p, &why))) { up_fail(u, "%s", why); return; }
    if (connect(u->fd, (struct sockaddr *)&a, addr_len(&a)) == 0) {
        if (u->tls) {
            up_to(u, UP_HANDSHAKE); /* the pump starts on POLLOUT */
        } else {
            up_to(u, UP_SENDING);
            up_write(u);
        }
    } else if (errno == EINPROGRESS) {
        up_to(u, UP_CONNECTING);
    } else {
        up_fail(u, "connect to %s:%d: %s", u->p->host, u->p->port, strerror(errno));
    }
}

/* DNS has answered for u (see dns_finish). */
static void up_resolved(upstream *u, const struct sockaddr_storage *addr, const char *err) {
    u->link = NULL;
    if (!addr) up_fail(u, "cannot resolve %s: %s", u->p->host, err);
    else up_connect(u, addr);
}

/* Parse what arrived: the head once (HEAD -> BODY or DONE; over TLS an
 * answer may come while the request is still SENDING), then body bytes
 * into u->body. */
static void up_parse(upstream *u) {
    while (u->state == UP_SENDING || u->state == UP_HEAD) {
        int n = http_head_end(u->in.p, u->in.len, &u->scan);
        if (n == LTG_AGAIN) {
            if (u->in.len > UP_MAX_HEAD_BYTES)
                up_fail(u, "response head from %s larger than %d KiB", u->p->host,
                        UP_MAX_HEAD_BYTES / 1024);
            return;
        }
        u->head.len = 0;
        buf_append(&u->head, u->in.p, (size_t)n);
        buf_consume(&u->in, (size_t)n);
        u->scan = 0;
        if (http_parse_response(u->head.p, u->head.len, &u->resp) < 0) {
            u->head.len = 0;
            up_fail(u, "malformed response from %s: %s", u->p->host, u->resp.err);
            return;
        }
        if (u->resp.status >= 100 && u->resp.status < 200) {
            /* 100 Continue and friends: wait for the real one */
            u->head.len = 0;
            continue;
        }
        u->body_left = u->resp.content_length;
        int empty = u->resp.status == 204 || u->resp.status == 304 ||
                    (!u->resp.chunked && u->resp.content_length == 0);
        up_to(u, empty ? UP_DONE : UP_BODY);
    }
    if (u->state != UP_BODY) return;
    int whole;
    if (u->resp.chunked) {
        long k = chunk_decode(&u->cd, u->in.p, u->in.len, &u->body);
        if (k < 0) { up_fail(u, "invalid chunked encoding from %s", u->p->host); return; }
        buf_consume(&u->in, (size_t)k);
        whole = u->cd.state == CHUNK_DONE;
    } else if (!up_until_eof(u)) {
        size_t take = u->in.len < (size_t)u->body_left ? u->in.len : (size_t)u->body_left;
        buf_append(&u->body, u->in.p, take);
        buf_consume(&u->in, take);
        u->body_left -= (long long)take;
        whole = u->body_left == 0;
    } else {
        buf_append(&u->body, u->in.p, u->in.len);
        u->in.len = 0;
        whole = 0; /* until the close */
    }
    if (whole) up_to(u, UP_DONE);
}

/* An https connection: the pump moves the handshake, the request and the
 * answer; then the same parsing as over plain TCP. */
static void up_tls(upstream *u) {
    char why[160];
    short events;
    size_t had = u->in.len;
    int ready = u->state != UP_HANDSHAKE;
    int r = tls_pump(u->tls, u->fd, u->out.p, u->out.len, &u->wrote, &u->in, !u->paused, &ready,
                     &events, why, sizeof why);
    if (r == PUMP_ERR) { up_fail(u, "TLS with %s: %s", u->p->host, why); return; }
    if (u->state == UP_HANDSHAKE && ready) {
        tls_handshake_done(u->p, u->tls);
        up_to(u, UP_SENDING); /* the connect and handshake deadline is met */
    }
    if (u->state == UP_SENDING && u->wrote == u->out.len) up_to(u, UP_HEAD);
    loop_events(u->fd, events);
    int got = u->in.len > had;
    if (got) {
        up_parse(u);
        if (u->state == UP_FAILED) return;
    }
    if (r == PUMP_EOF && u->state != UP_DONE) {
        if (got) up_to(u, UP_EOF); /* the data first, the close next turn */
        else if (!up_eof(u)) return;
    }
    int reading = u->state == UP_HEAD || u->state == UP_BODY || u->state == UP_EOF;
    if ((reading && got) || u->state == UP_DONE) {
        if (u->state == UP_DONE) loop_events(u->fd, 0);
        u->event(u->owner);
    }
}

static void up_read(upstream *u) {
    if (u->tls) { up_tls(u); return; }
    for (int rounds = 0; rounds < 4 && u->state != UP_DONE; rounds++) {
        buf_reserve(&u->in, READ_CHUNK);
        ssize_t n = recv(u->fd, u->in.p + u->in.len, READ_CHUNK, 0);
        if (n > 0) {
            u->in.len += (size_t)n;
            u->in.p[u->in.len] = 0;
            up_parse(u);
            if (u->state == UP_FAILED) return;
            if (n < READ_CHUNK) break;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (n == 0 && up_eof(u)) break;
        if (n < 0) up_fail(u, "read from %s: %s", u->p->host, strerror(errno));
        return;
    }
    if (u->state == UP_DONE) loop_events(u->fd, 0);
    u->event(u->owner);
}

static void up_io(void *ctx, int revents) {
    upstream *u = ctx;
    (void)revents; /* the state says what to do; errors surface from the call itself */
    switch (u->state) {
    case UP_CONNECTING: {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(u->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
            up_fail(u, "connect to %s:%d: %s", u->p->host, u->p->port, strerror(err));
            return;
        }
        up_to(u, u->tls ? UP_HANDSHAKE : UP_SENDING);
        up_write(u);
        return;
    }
    case UP_HANDSHAKE:
    case UP_SENDING: up_write(u); return;
    case UP_HEAD:
    case UP_BODY: up_read(u); return;
    default: return; /* RESOLVING, EOF, DONE, FAILED, IDLE: not polled (IDLE: see pool_take) */
    }
}

/* Take an idle pooled connection that is still open, or NULL. */
static upstream *pool_take(provider *p) {
    while (p->idle) {
        upstream *u = p->idle;
        p->idle = u->link;
        p->nidle--;
        u->link = NULL;
        timer_stop(&u->t);
        char c;
        ssize_t n = recv(u->fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return u;
        up_free(u); /* closed (0), unexpected bytes (> 0), or an error */
    }
    return NULL;
}

/* Start sending `req` (n bytes) to provider p for `owner`, told of news
 * through event(owner). Never fails synchronously: a failure is reported
 * on the next turn. */
static upstream *up_start(provider *p, void *owner, upstream_event *event, const char *req,
                          size_t n) {
    upstream *u = pool_take(p);
    int reused = u != NULL;
    if (reused) {
        u->out.len = u->wrote = 0;
        u->in.len = u->scan = u->head.len = u->body.len = 0;
        u->paused = 0;
        u->cd = (chunk_decoder){0};
    } else {
        u = xcalloc(1, sizeof *u); /* UP_RESOLVING */
        u->fd = -1;
        u->p = p;
        timer_init(&u->t, up_notify, u);
    }
    u->owner = owner;
    u->event = event;
    p->nbusy++;
    buf_append(&u->out, req, n);
    if (reused) {
        up_to(u, UP_SENDING);
        loop_watch(u->fd, POLLOUT, up_io, u);
        /* a TLS pump may read an answer: it runs from the loop, never inside up_start() */
        if (!u->tls) up_write(u);
        return u;
    }
    struct sockaddr_storage addr;
    const char *err = NULL;
    int r = dns_resolve(p->host, u, &addr, &err);
    if (r == 0) up_connect(u, &addr);
    else if (r == LTG_ERR) up_fail(u, "cannot resolve %s: %s", p->host, err);
    return u;
}

/* Stop or resume reading the provider (back-pressure from a slow client). */
static void up_pause(upstream *u, int pause) {
    if (u->paused == pause) return;
    u->paused = pause;
    if (u->state == UP_HEAD || u->state == UP_BODY) loop_events(u->fd, pause ? 0 : POLLIN);
}

/* The exchange is done with u: back to the pool if it can carry another
 * request, closed otherwise. */
static void up_release(upstream *u) {
    provider *p = u->p;
    p->nbusy--;
    if (u->state == UP_RESOLVING) dns_cancel(u);
    int whole = u->state == UP_DONE && u->wrote == u->out.len, leftover = whole && u->in.len > 0;
    int reusable = whole && !leftover && u->resp.keep_alive && !up_until_eof(u) &&
                   p->cat == S.cat && p->nidle < POOL_MAX_IDLE && !S.draining;
    if (leftover) ltg_log("%s sent bytes after its answer: connection closed, not pooled", p->host);
    if (!reusable) { up_free(u); return; }
    up_to(u, UP_IDLE);
    u->owner = NULL;
    u->body.len = 0;
    /* an idle connection keeps no large request's memory */
    if (u->out.cap > (1 << 20)) buf_free(&u->out);
    if (u->body.cap > (1 << 20)) buf_free(&u->body);
    loop_events(u->fd, 0);
    u->link = p->idle;
    p->idle = u;
    p->nidle++;
}

/* ===== 10. Catalog config =====
 *
 * IMPLEMENTATION NOTES
 * The catalog (README "The catalog config") names the providers, the model aliases
 * clients may ask for, their prices, and the admin keys. It is loaded at
 * start-up and again on SIGHUP; a catalog that fails any check is refused
 * whole, with a message naming the file, the field and the problem, and the
 * old one stays. Unknown fields are errors: a misspelt "input_usd_per_mtok"
 * must not silently price a model at zero.
 *
 * Requests in flight hold a reference on the catalog they started with, so
 * a reload never pulls a provider out from under them; the old catalog (and
 * its pool of idle connections) is freed when its last request ends.
 * Secrets from the environment are kept only as long as the catalog lives;
 * admin keys are kept only as their SHA-256.
 */
/* One route to a model: a provider and its name for the model. A model
 * alias has one, or several (README "Deployments"): an attempt picks one (section 11). */
typedef struct {
    provider *p;
    char *upstream;              /* the provider's name for the model */
    char *name;                  /* "provider/upstream_model": the attempt log's, the metrics' */
    model *m;
    int weight;                  /* 1..100 */
    int inflight;                /* attempts on it now */
    int credit;                  /* the smooth weighted round-robin's running credit */
    int cb_failures, cb_probing; /* the circuit breaker (section 11) */
    int64_t cb_open_until;       /* S.now ms; 0: closed */
} deployment;

#define MAX_DEPLOYMENTS 16

/* A model's prices in pico-USD per token (USD per million tokens x 10^6),
 * so that a cost is integer arithmetic, exact to the micro-USD: uncached
 * input, cache reads, 5-minute cache writes, 1-hour writes, output. */
enum { PRICE_IN, PRICE_CACHE_READ, PRICE_CACHE_WRITE, PRICE_CACHE_WRITE_1H, PRICE_OUT, NPRICE };
typedef struct { int64_t p[NPRICE]; } prices;
#define MAX_PRICE_USD 10000.0            /* USD per million tokens: no model costs more */

struct model {
    char *alias;
    deployment *dep;
    int ndep;
    int api;                     /* what its providers speak (API_*): every deployment the same */
    unsigned endpoints;          /* ... and the endpoints they serve (EP_* bits): the same too */
    prices price;                /* its prices per token class */
    /* ... and those of a request whose input passes long_above (0: none) */
    prices long_price;
    long long long_above;
    long long context_window, max_output_tokens, max_input_part_tokens;
    /* it takes a reasoning effort (chat) or a thinking budget (Anthropic) from a translated
     * request: "reasoning", by default true for an Anthropic model, false for another */
    int reasoning;
};

enum {
    PERM_ALL = 1, PERM_GROUPS_WRITE = 2, PERM_GROUPS_READ = 4, PERM_KEYS_WRITE = 8,
    PERM_KEYS_READ = 16, PERM_SPEND_READ = 32, PERM_USAGE_READ = 64, PERM_METRICS_READ = 128
};
static const char *perm_names[] = {
    "*", "llm_token_gateway.token_groups.write", "llm_token_gateway.token_groups.read",
    "llm_token_gateway.token_keys.write", "llm_token_gateway.token_keys.read",
    "llm_token_gateway.spend.read", "llm_token_gateway.usage.read",
    "llm_token_gateway.metrics.read"
};

typedef struct {
    uint8_t sha[32];
    int perms; /* PERM_* bits */
} admin_key;

struct catalog {
    provider *prov;
    int nprov;
    model *models;
    int nmodels;
    admin_key *admins;
    int nadmins;
    int refs;    /* requests in flight that use this catalog, plus 1 while current */
};

/* Compare two secrets in time that depends only on their lengths. */
static int secret_eq(const void *a, size_t an, const void *b, size_t bn) {
    const uint8_t *x = a, *y = b;
    uint8_t d = an != bn;
    for (size_t i = 0; i < an && i < bn; i++) d |= x[i] ^ y[i];
    return d == 0;
}

/* The prices that apply to a request of `in` input tokens on m. */
static const prices *model_prices(const model *m, long long in) {
    return m->long_above && in > m->long_above ? &m->long_price : &m->price;
}

/* What tokens t (each class within MAX_USAGE_TOKENS, the parts within
 * their wholes) cost on m, in micro-USD, to the nearest: exact, in
 * integers, a whole request priced at one tier as providers bill it. */
static int64_t tokens_cost(const model *m, const long long t[NTOK]) {
    const int64_t *p = model_prices(m, t[TOK_IN])->p;
    int64_t pico = (t[TOK_IN] - t[TOK_CACHE_READ] - t[TOK_CACHE_WRITE]) * p[PRICE_IN] +
                   t[TOK_CACHE_READ] * p[PRICE_CACHE_READ] +
                   (t[TOK_CACHE_WRITE] - t[TOK_CACHE_WRITE_1H]) * p[PRICE_CACHE_WRITE] +
                   t[TOK_CACHE_WRITE_1H] * p[PRICE_CACHE_WRITE_1H] + t[TOK_OUT] * p[PRICE_OUT];
    return (pico + 500000) / 1000000;
}

/* An attempt's worst case (README "Cost"): `in` input tokens at the
 * dearest input class, `out` output tokens; in micro-USD, rounded up, and
 * MAX_CHARGE + 1 for anything past MAX_CHARGE (no request may cost that). */
typedef struct {
    long long in, out;     /* tokens */
    int64_t in_cost, cost; /* micro-USD: the input part, the whole */
    int64_t out_price;     /* pico-USD per output token, at the tier of `in` */
} worst;

static worst worst_of(const model *m, long long in, long long out) {
    const int64_t *p = model_prices(m, in)->p;
    int64_t dearest = 0;
    for (int k = PRICE_IN; k <= PRICE_CACHE_WRITE_1H; k++)
        if (p[k] > dearest) dearest = p[k];
    double in_cost = ceil((double)in * (double)dearest / 1e6),
           cost = ceil(((double)in * (double)dearest + (double)out * (double)p[PRICE_OUT]) / 1e6);
    worst w = {in, out, 0, 0, p[PRICE_OUT]};
    w.in_cost = in_cost > MAX_CHARGE ? MAX_CHARGE + 1 : (int64_t)in_cost;
    w.cost = cost > MAX_CHARGE ? MAX_CHARGE + 1 : (int64_t)cost;
    return w;
}

static model *catalog_model(catalog *c, const char *s, size_t n) {
    for (int i = 0; i < c->nmodels; i++)
        if (strlen(c->models[i].alias) == n && memcmp(c->models[i].alias, s, n) == 0)
            return &c->models[i];
    return NULL;
}

static void catalog_free(catalog *c) {
    if (!c) return;
    for (int i = 0; i < c->nprov; i++) {
        provider *p = &c->prov[i];
        while (p->idle) {
            upstream *u = p->idle;
            p->idle = *up_wait_link(u);
            up_free(u);
        }
        free(p->name);
        free(p->host);
        free(p->base_path);
        free(p->hostport);
        for (int k = 0; k < p->nkeys; k++) {
            memset(p->keys[k], 0, strlen(p->keys[k]));
            free(p->keys[k]);
        }
        free(p->keys);
        free(p->key_bad_until);
    }
    for (int i = 0; i < c->nmodels; i++) {
        for (int k = 0; k < c->models[i].ndep; k++) {
            free(c->models[i].dep[k].upstream);
            free(c->models[i].dep[k].name);
        }
        free(c->models[i].alias);
        free(c->models[i].dep);
    }
    free(c->prov);
    free(c->models);
    free(c->admins);
    free(c);
}

static void catalog_release(catalog *c) {
    if (--c->refs == 0) catalog_free(c);
}

/* Split "http://host[:port][/path]" into its parts. */
static int url_parse(const char *url, provider *p, const char **why) {
    const char *s;
    if (strncmp(url, "http://", 7) == 0) {
        s = url + 7;
        p->tls = 0;
        p->port = 80;
    } else if (strncmp(url, "https://", 8) == 0) {
        s = url + 8;
        p->tls = 1;
        p->port = 443;
    } else { *why = "must start with http:// or https://"; return LTG_ERR; }
    const char *host_end, *rest;
    if (*s == '[') {
        host_end = strchr(s, ']');
        if (!host_end) { *why = "unterminated [IPv6] host"; return LTG_ERR; }
        p->host = xstrndup(s + 1, (size_t)(host_end - s - 1));
        rest = host_end + 1;
    } else {
        rest = s + strcspn(s, ":/?#");
        p->host = xstrndup(s, (size_t)(rest - s));
    }
    if (!*p->host) { *why = "has no host"; return LTG_ERR; }
    if (*rest == ':') {
        long long port;
        const char *pe = rest + 1 + strcspn(rest + 1, "/?#");
        if (parse_ll(rest + 1, (size_t)(pe - rest - 1), 65535, &port) < 0 || port == 0) {
            *why = "has an invalid port";
            return LTG_ERR;
        }
        p->port = (int)port;
        rest = pe;
    }
    if (*rest && *rest != '/') { *why = "may not have a query or fragment"; return LTG_ERR; }
    size_t plen = strlen(rest);
    while (plen && rest[plen - 1] == '/') plen--;
    p->base_path = xstrndup(rest, plen);
    char hp[300];
    int v6 = strchr(p->host, ':') != NULL;
    if (p->port == (p->tls ? 443 : 80)) snprintf(hp, sizeof hp, v6 ? "[%s]" : "%s", p->host);
    else snprintf(hp, sizeof hp, v6 ? "[%s]:%d" : "%s:%d", p->host, p->port);
    p->hostport = xstrndup(hp, strlen(hp));
    return 0;
}

typedef struct {
    const char *file, *s;
    json_tok *t;
    char *err;
    size_t errlen;
} cfg;

/* The message "file: where.key: ...". key may be NULL; where "" is the top level. */
static int cfg_fail(cfg *c, const char *where, const char *key, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));
static int cfg_fail(cfg *c, const char *where, const char *key, const char *fmt, ...) {
    int n = snprintf(c->err, c->errlen, "%s: %s%s%s: ", c->file, where, *where && key ? "." : "",
                     key ? key : "");
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < c->errlen) vsnprintf(c->err + n, c->errlen - (size_t)n, fmt, ap);
    va_end(ap);
    return LTG_ERR;
}

/* The value of the environment variable that string token k names, or
 * NULL after cfg_fail. A name that does not look like one (A-Z, 0-9, _)
 * may be a key pasted where its name belongs: it is not repeated. */
static const char *cfg_env(cfg *c, int k, const char *where, const char *key) {
    if (c->t[k].type != JSON_STRING) {
        cfg_fail(c, where, key, "must be the name of an environment variable");
        return NULL;
    }
    char *name = json_strdup(c->s, c->t, k);
    const char *val = getenv(name);
    size_t n = strlen(name);
    if (!val || !*val) {
        if (n && n <= 64 && strspn(name, "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") == n)
            cfg_fail(c, where, key, "environment variable %s is not set", name);
        else
            cfg_fail(c, where, key,
                     "no environment variable of that name is set (the value is not shown: it does "
                     "not look like "
                     "a variable name such as OPENAI_API_KEY; give the variable's name here, never "
                     "the key)");
        val = NULL;
    }
    free(name);
    return val;
}

/* A provider's keys: "api_key_env" (one variable) or "api_key_envs" (a
 * list, used in turn), each naming a variable that is set. */
static int cfg_keys(cfg *c, int v, const char *where, provider *p) {
    int one = json_get(c->s, c->t, v, "api_key_env"),
        list = json_get(c->s, c->t, v, "api_key_envs");
    if (one >= 0 && list >= 0)
        return cfg_fail(c, where, "api_key_envs", "give api_key_env or api_key_envs, not both");
    if (list >= 0 && (c->t[list].type != JSON_ARRAY || c->t[list].size < 1 || c->t[list].size > 16))
        return cfg_fail(c, where, "api_key_envs",
                        "must be a list of 1 to 16 environment variable names");
    int n = one >= 0 ? 1 : list >= 0 ? c->t[list].size : 0;
    p->keys = xcalloc((size_t)n + 1, sizeof *p->keys);
    p->key_bad_until = xcalloc((size_t)n + 1, sizeof *p->key_bad_until);
    for (int i = 0, e = one >= 0 ? one : list + 1; i < n; i++, e = c->t[e].next) {
        const char *val = cfg_env(c, e, where, one >= 0 ? "api_key_env" : "api_key_envs");
        if (!val) return LTG_ERR;
        p->keys[p->nkeys++] = xstrndup(val, strlen(val));
    }
    return 0;
}

/* Check that every member of object `obj` is one of `allowed` (NULL-terminated). */
static int cfg_only(cfg *c, int obj, const char *where, const char *const *allowed) {
    int i = obj + 1;
    for (int m = 0; m < c->t[obj].size; m++, i = c->t[i + 1].next) {
        int ok = 0;
        for (const char *const *a = allowed; *a; a++) ok |= json_eq(c->s, c->t, i, *a);
        char key[128];
        snprintf(key, sizeof key, "%.*s", (int)(c->t[i].end - c->t[i].start), c->s + c->t[i].start);
        if (!ok) return cfg_fail(c, where, key, "unknown field");
    }
    return 0;
}

static int cfg_price(cfg *c, int obj, const char *key, const char *where, double *out) {
    int v = json_get(c->s, c->t, obj, key);
    if (v < 0) return cfg_fail(c, where, key, "missing (a number: USD per million tokens)");
    if (json_number(c->s, c->t, v, out) < 0 || *out < 0 || *out > MAX_PRICE_USD)
        return cfg_fail(c, where, key, "must be a number from 0 to %.0f (USD per million tokens)",
                        MAX_PRICE_USD);
    return 0;
}

static int cfg_int(cfg *c, int obj, const char *key, const char *where, long long min,
                   long long *out) {
    int v = json_get(c->s, c->t, obj, key);
    if (v < 0) return 0;
    if (json_int(c->s, c->t, v, out) < 0 || *out < min || *out > 1000000000000LL)
        return cfg_fail(c, where, key, "must be a whole number >= %lld", min);
    return 0;
}

static void prices_set(prices *p, const double usd[NPRICE]) {
    for (int k = 0; k < NPRICE; k++) p->p[k] = llround(usd[k] * 1e6);
}

/* The prices of model md (its routes read: md->api known) from object v.
 * Input and output are required; a cache class left out costs what its
 * provider's API makes of the input price: Anthropic's published
 * multipliers, and for OpenAI's the input price itself, never less than a
 * provider bills. "long_context" is a second tier: its input and output
 * prices, the cache prices scaled with the input price. */
static int cfg_prices(cfg *c, int v, const char *where, model *md) {
    static const char *const names[NPRICE] = {
        "input_usd_per_mtok", "cache_read_usd_per_mtok", "cache_write_usd_per_mtok",
        "cache_write_1h_usd_per_mtok", "output_usd_per_mtok"
    };
    static const double anthropic[NPRICE] = {1, 0.1, 1.25, 2, 0}, openai[NPRICE] = {1, 1, 1, 1, 0};
    static const char *const long_fields[] = {
        "above_input_tokens", "input_usd_per_mtok", "output_usd_per_mtok", NULL
    };
    const double *by_api = md->api == API_ANTHROPIC ? anthropic : openai;
    double usd[NPRICE], lusd[NPRICE];
    for (int k = 0; k < NPRICE; k++) {
        int optional = k != PRICE_IN && k != PRICE_OUT;
        usd[k] = -1;
        if ((!optional || json_get(c->s, c->t, v, names[k]) >= 0) &&
            cfg_price(c, v, names[k], where, &usd[k]) < 0)
            return LTG_ERR;
    }
    for (int k = 0; k < NPRICE; k++)
        if (usd[k] < 0) usd[k] = usd[PRICE_IN] * by_api[k];
    prices_set(&md->price, usd);
    int lc = json_get(c->s, c->t, v, "long_context");
    if (lc < 0) return 0;
    char at[340];
    snprintf(at, sizeof at, "%s.long_context", where);
    if (c->t[lc].type != JSON_OBJECT)
        return cfg_fail(c, at, NULL,
                        "must be an object {\"above_input_tokens\": N, \"input_usd_per_mtok\": "
                        "..., \"output_usd_per_mtok\": ...}");
    if (cfg_only(c, lc, at, long_fields) < 0) return LTG_ERR;
    if (json_get(c->s, c->t, lc, "above_input_tokens") < 0)
        return cfg_fail(c, at, "above_input_tokens",
                        "missing (the input tokens past which a request is priced at this tier, "
                        "e.g. 200000)");
    if (cfg_int(c, lc, "above_input_tokens", at, 1, &md->long_above) < 0 ||
        cfg_price(c, lc, "input_usd_per_mtok", at, &lusd[PRICE_IN]) < 0 ||
        cfg_price(c, lc, "output_usd_per_mtok", at, &lusd[PRICE_OUT]) < 0)
        return LTG_ERR;
    for (int k = PRICE_CACHE_READ; k <= PRICE_CACHE_WRITE_1H; k++) {
        lusd[k] = usd[PRICE_IN] > 0 ? usd[k] * lusd[PRICE_IN] / usd[PRICE_IN]
                                    : lusd[PRICE_IN] * by_api[k];
        if (lusd[k] > MAX_PRICE_USD)
            return cfg_fail(c, at, "input_usd_per_mtok",
                            "makes %s %.2f USD per million tokens at this tier (the most is %.0f): "
                            "the cache prices scale with the input price",
                            names[k], lusd[k], MAX_PRICE_USD);
    }
    prices_set(&md->long_price, lusd);
    return 0;
}

/* Each member of a catalog section -- an object of at least one `what`, each member an object --
 * given to `one` with its name's token k and "section.name" for the messages: 0, or LTG_ERR.
 * The caller has made room for every member. */
static int cfg_section(cfg *c, catalog *cat, int obj, const char *section, const char *what,
                       int (*one)(cfg *c, catalog *cat, int k, const char *where)) {
    if (obj < 0 || c->t[obj].type != JSON_OBJECT || c->t[obj].size == 0)
        return cfg_fail(c, section, NULL, "must be an object with at least one %s", what);
    int k = obj + 1;
    for (int m = 0; m < c->t[obj].size; m++, k = c->t[k + 1].next) {
        char where[300];
        char *name = json_strdup(c->s, c->t, k);
        snprintf(where, sizeof where, "%s.%s", section, name);
        free(name);
        if (c->t[k + 1].type != JSON_OBJECT) return cfg_fail(c, where, NULL, "must be an object");
        if (one(c, cat, k, where) < 0) return LTG_ERR;
    }
    return 0;
}

/* Room for the members of a section (at least one, whatever it holds). */
static void *cfg_room(const cfg *c, int obj, size_t size) {
    int n = obj >= 0 && c->t[obj].type == JSON_OBJECT ? c->t[obj].size : 0;
    return xcalloc(n > 0 ? (size_t)n : 1, size);
}

/* A provider's "endpoints": the OpenAI endpoints it serves (all four when absent). */
static int cfg_endpoints(cfg *c, int v, const char *where, provider *p) {
    static const char *const want = "a non-empty array of \"chat\", \"completions\", "
                                    "\"responses\" and \"embeddings\": those the provider serves";
    int e = json_get(c->s, c->t, v, "endpoints");
    p->endpoints = p->api == API_ANTHROPIC ? EPS_ANTHROPIC : EPS_OPENAI;
    if (e < 0) return 0;
    if (p->api == API_ANTHROPIC)
        return cfg_fail(c, where, "endpoints",
                        "is for OpenAI-API providers (an Anthropic one serves messages and "
                        "count_tokens)");
    if (c->t[e].type != JSON_ARRAY || c->t[e].size == 0)
        return cfg_fail(c, where, "endpoints", "must be %s", want);
    p->endpoints = 0;
    for (int m = 0, i = e + 1; m < c->t[e].size; m++, i = c->t[i].next) {
        int k = EP_CHAT;
        while (k <= EP_RESPONSES && !json_eq(c->s, c->t, i, ep_names[k])) k++;
        if (k > EP_RESPONSES) return cfg_fail(c, where, "endpoints", "must be %s", want);
        p->endpoints |= 1u << k;
    }
    return 0;
}

static int cfg_provider(cfg *c, catalog *cat, int k, const char *where) {
    static const char *const fields[] = {
        "base_url", "api_key_env", "api_key_envs", "tls_verify", "api", "endpoints", NULL
    };
    provider *p = &cat->prov[cat->nprov++];
    p->name = json_strdup(c->s, c->t, k);
    p->tls_verify = 1;
    p->cat = cat;
    int v = k + 1;
    if (cfg_only(c, v, where, fields) < 0) return LTG_ERR;
    int u = json_get(c->s, c->t, v, "base_url");
    if (u < 0 || c->t[u].type != JSON_STRING)
        return cfg_fail(c, where, "base_url",
                        "missing (a string like \"http://127.0.0.1:9000/v1\")");
    char *url = json_strdup(c->s, c->t, u);
    const char *why;
    int r = url_parse(url, p, &why);
    free(url);
    if (r < 0) return cfg_fail(c, where, "base_url", "%s", why);
    if (cfg_keys(c, v, where, p) < 0) return LTG_ERR;
    int api = json_get(c->s, c->t, v, "api");
    if (api >= 0 && !json_eq(c->s, c->t, api, "openai") && !json_eq(c->s, c->t, api, "anthropic"))
        return cfg_fail(c, where, "api",
                        "must be \"openai\" (the default: chat, completions, responses, "
                        "embeddings) or \"anthropic\" (messages)");
    p->api = api >= 0 && json_eq(c->s, c->t, api, "anthropic") ? API_ANTHROPIC : API_OPENAI;
    if (cfg_endpoints(c, v, where, p) < 0) return LTG_ERR;
    int tv = json_get(c->s, c->t, v, "tls_verify");
    if (tv >= 0) {
        if (c->t[tv].type != JSON_TRUE && c->t[tv].type != JSON_FALSE)
            return cfg_fail(c, where, "tls_verify", "must be true or false");
        p->tls_verify = c->t[tv].type == JSON_TRUE;
    }
    return 0;
}

static int cfg_providers(cfg *c, catalog *cat, int obj) {
    cat->prov = cfg_room(c, obj, sizeof *cat->prov);
    return cfg_section(c, cat, obj, "providers", "provider", cfg_provider);
}

/* One deployment of md from object v (the model itself, or an element of
 * its "deployments"): a provider of the catalog, its name for the model,
 * a weight. */
static int cfg_deployment(cfg *c, catalog *cat, model *md, int v, const char *where) {
    deployment *d = &md->dep[md->ndep++];
    long long w = 1;
    int pv = json_get(c->s, c->t, v, "provider"), uv = json_get(c->s, c->t, v, "upstream_model");
    if (pv < 0 || c->t[pv].type != JSON_STRING)
        return cfg_fail(c, where, "provider", "missing (the name of a provider)");
    for (int k = 0; k < cat->nprov; k++)
        if (json_eq(c->s, c->t, pv, cat->prov[k].name)) d->p = &cat->prov[k];
    if (!d->p)
        return cfg_fail(c, where, "provider", "no provider named \"%.*s\"",
                        (int)(c->t[pv].end - c->t[pv].start), c->s + c->t[pv].start);
    if (uv < 0 || c->t[uv].type != JSON_STRING || c->t[uv].end == c->t[uv].start)
        return cfg_fail(c, where, "upstream_model", "missing (the provider's name for the model)");
    if (json_get(c->s, c->t, v, "weight") >= 0 &&
        (cfg_int(c, v, "weight", where, 1, &w) < 0 || w > 100))
        return cfg_fail(c, where, "weight", "must be a whole number from 1 to 100");
    d->upstream = json_strdup(c->s, c->t, uv);
    d->m = md;
    d->weight = (int)w;
    size_t n = strlen(d->p->name) + strlen(d->upstream) + 2;
    d->name = xmalloc(n);
    snprintf(d->name, n, "%s/%s", d->p->name, d->upstream);
    if (md->ndep > 1 && (d->p->api != md->api || d->p->endpoints != md->endpoints))
        return cfg_fail(c, where, "provider",
                        "\"%s\" %s than the model's first deployment: the deployments of one "
                        "model must be interchangeable",
                        d->p->name,
                        d->p->api != md->api ? "speaks another API" : "serves other endpoints");
    md->api = d->p->api;
    md->endpoints = d->p->endpoints;
    for (int k = 0; k < md->ndep - 1; k++)
        if (strcmp(md->dep[k].name, d->name) == 0)
            return cfg_fail(c, where, NULL, "deployment %s is listed twice", d->name);
    return 0;
}

/* A model's routes: "provider" and "upstream_model", or "deployments". */
static int cfg_routes(cfg *c, catalog *cat, model *md, int v, const char *where) {
    int dv = json_get(c->s, c->t, v, "deployments");
    static const char *const dep_fields[] = {"provider", "upstream_model", "weight", NULL};
    if (dv < 0) {
        md->dep = xcalloc(1, sizeof *md->dep);
        return json_get(c->s, c->t, v, "weight") >= 0
                       ? cfg_fail(c, where, "weight", "belongs to an element of \"deployments\"")
                       : cfg_deployment(c, cat, md, v, where);
    }
    if (json_get(c->s, c->t, v, "provider") >= 0 ||
        json_get(c->s, c->t, v, "upstream_model") >= 0 || json_get(c->s, c->t, v, "weight") >= 0)
        return cfg_fail(c, where, "deployments",
                        "give provider and upstream_model, or deployments, not both");
    if (c->t[dv].type != JSON_ARRAY || c->t[dv].size < 1 || c->t[dv].size > MAX_DEPLOYMENTS)
        return cfg_fail(c, where, "deployments",
                        "must be a list of 1 to %d {provider, upstream_model, weight} objects",
                        MAX_DEPLOYMENTS);
    md->dep = xcalloc((size_t)c->t[dv].size, sizeof *md->dep);
    int e = dv + 1;
    for (int k = 0; k < c->t[dv].size; k++, e = c->t[e].next) {
        char at[340];
        snprintf(at, sizeof at, "%s.deployments[%d]", where, k);
        if (c->t[e].type != JSON_OBJECT)
            return cfg_fail(c, at, NULL, "must be an object {provider, upstream_model, weight}");
        if (cfg_only(c, e, at, dep_fields) < 0 || cfg_deployment(c, cat, md, e, at) < 0)
            return LTG_ERR;
    }
    return 0;
}

static int cfg_model(cfg *c, catalog *cat, int k, const char *where) {
    static const char *const fields[] = {
        "provider", "upstream_model", "deployments", "weight", "input_usd_per_mtok",
        "output_usd_per_mtok", "cache_read_usd_per_mtok", "cache_write_usd_per_mtok",
        "cache_write_1h_usd_per_mtok", "long_context", "context_window", "max_output_tokens",
        "max_input_part_tokens", "reasoning", NULL
    };
    model *md = &cat->models[cat->nmodels++];
    md->alias = json_strdup(c->s, c->t, k);
    md->max_output_tokens = 4096;
    md->max_input_part_tokens = 2000;
    md->context_window = 200000;
    int v = k + 1;
    if (!*md->alias || strlen(md->alias) > ALIAS_MAX)
        return cfg_fail(c, "models", NULL, "an alias must be 1 to %d bytes (\"%.40s...\" is not)",
                        ALIAS_MAX, md->alias);
    if (cfg_only(c, v, where, fields) < 0 || cfg_routes(c, cat, md, v, where) < 0)
        return LTG_ERR;
    if (cfg_prices(c, v, where, md) < 0 ||
        cfg_int(c, v, "context_window", where, 1, &md->context_window) < 0 ||
        cfg_int(c, v, "max_output_tokens", where, 1, &md->max_output_tokens) < 0 ||
        cfg_int(c, v, "max_input_part_tokens", where, 1, &md->max_input_part_tokens) < 0)
        return LTG_ERR;
    int rv = json_get(c->s, c->t, v, "reasoning");
    md->reasoning = rv >= 0 ? c->t[rv].type == JSON_TRUE : md->api == API_ANTHROPIC;
    if (rv >= 0 && c->t[rv].type != JSON_TRUE && c->t[rv].type != JSON_FALSE)
        return cfg_fail(c, where, "reasoning", "must be true or false");
    for (int i = 0; i < cat->nmodels - 1; i++)
        if (strcmp(cat->models[i].alias, md->alias) == 0)
            return cfg_fail(c, where, NULL, "the alias is defined twice");
    return 0;
}

static int cfg_models(cfg *c, catalog *cat, int obj) {
    cat->models = cfg_room(c, obj, sizeof *cat->models);
    return cfg_section(c, cat, obj, "models", "model alias", cfg_model);
}

static int cfg_admin_keys(cfg *c, catalog *cat, int arr) {
    static const char *const fields[] = {"key_env", "key_sha256", "permissions", NULL};
    if (arr < 0) return 0;
    if (c->t[arr].type != JSON_ARRAY) return cfg_fail(c, "admin_keys", NULL, "must be an array");
    cat->admins = xcalloc((size_t)c->t[arr].size, sizeof *cat->admins);
    int v = arr + 1;
    for (int m = 0; m < c->t[arr].size; m++, v = c->t[v].next) {
        admin_key *a = &cat->admins[cat->nadmins++];
        char where[64];
        snprintf(where, sizeof where, "admin_keys[%d]", m);
        if (c->t[v].type != JSON_OBJECT) return cfg_fail(c, where, NULL, "must be an object");
        if (cfg_only(c, v, where, fields) < 0) return LTG_ERR;
        int ke = json_get(c->s, c->t, v, "key_env"), ks = json_get(c->s, c->t, v, "key_sha256");
        if ((ke < 0) == (ks < 0))
            return cfg_fail(c, where, NULL,
                            "give exactly one of key_env and key_sha256 (never the key itself)");
        if (ke >= 0) {
            const char *val = cfg_env(c, ke, where, "key_env");
            if (!val) return LTG_ERR;
            sha256(val, strlen(val), a->sha);
        } else {
            if (c->t[ks].type != JSON_STRING || c->t[ks].end - c->t[ks].start != 64 ||
                hex_decode(c->s + c->t[ks].start, 64, a->sha) < 0)
                return cfg_fail(c, where, "key_sha256", "must be 64 hex digits");
        }
        int pv = json_get(c->s, c->t, v, "permissions");
        if (pv < 0 || c->t[pv].type != JSON_ARRAY || c->t[pv].size == 0)
            return cfg_fail(c, where, "permissions", "missing (a non-empty array, e.g. [\"*\"])");
        int e = pv + 1;
        for (int k = 0; k < c->t[pv].size; k++, e = c->t[e].next) {
            int bit = 0;
            for (int b = 0; b < (int)(sizeof perm_names / sizeof *perm_names); b++)
                if (json_eq(c->s, c->t, e, perm_names[b])) bit = 1 << b;
            if (!bit)
                return cfg_fail(c, where, "permissions",
                                "unknown permission (allowed: \"*\", "
                                "llm_token_gateway.{token_groups,token_keys}.{read,write}, "
                                "llm_token_gateway.spend.read, llm_token_gateway.usage.read, "
                                "llm_token_gateway.metrics.read)");
            a->perms |= bit;
        }
    }
    return 0;
}

/* Load and check the catalog at `path`. Returns it (refs = 1), or NULL with
 * a message in err. `text`, when not NULL, is used instead of the file
 * (the unit tests feed configs this way). */
static catalog *catalog_load(const char *path, const char *text, char *err, size_t errlen) {
    buf b = {0};
    if (text) buf_puts(&b, text);
    else if (read_file(path, &b) < 0) {
        snprintf(err, errlen, "%s: cannot read: %s", path, strerror(errno));
        buf_free(&b);
        return NULL;
    }
    int max = (int)(b.len / 2 + 2);
    cfg c = {path, b.p, xcalloc((size_t)max, sizeof(json_tok)), err, errlen};
    catalog *cat = xcalloc(1, sizeof *cat);
    cat->refs = 1;
    json_result res;
    int ok = -1;
    if (json_parse(b.p, b.len, c.t, max, -1, &res) < 0) {
        snprintf(err, errlen, "%s: not valid JSON: %s at byte offset %zu", path, res.err,
                 res.err_offset);
    } else if (c.t[0].type != JSON_OBJECT) {
        snprintf(err, errlen, "%s: the catalog must be a JSON object", path);
    } else {
        static const char *const top[] = {"providers", "models", "admin_keys", NULL};
        if (json_get(b.p, c.t, 0, "dev_keys") >= 0) {
            cfg_fail(&c, "dev_keys", NULL,
                     "was removed: create a token group and a token key through the control plane "
                     "(README \"Token groups\", \"Token keys\")");
        } else
            ok = cfg_only(&c, 0, "", top) == 0 &&
                                 cfg_providers(&c, cat, json_get(b.p, c.t, 0, "providers")) == 0 &&
                                 cfg_models(&c, cat, json_get(b.p, c.t, 0, "models")) == 0 &&
                                 cfg_admin_keys(&c, cat, json_get(b.p, c.t, 0, "admin_keys")) == 0
                         ? 0
                         : -1;
    }
    free(c.t);
    buf_free(&b);
    if (ok < 0) { catalog_free(cat); return NULL; }
    return cat;
}

/* What a catalog's https providers need: the trust anchors, loaded once,
 * and a word about every provider whose certificates are not fully
 * checked. 0, or LTG_ERR with err set. */
static int tls_prepare(catalog *cat, char *err, size_t errlen) {
    for (int i = 0; i < cat->nprov; i++) {
        provider *p = &cat->prov[i];
        if (!p->tls) continue;
        if (!TLS.nta) {
            const char *path = TLS.ca_file ? TLS.ca_file : TLS_DEFAULT_CA;
            int n = tls_load_anchors(path, err, errlen);
            if (n < 0) return LTG_ERR;
            ltg_log("%s: %d trust anchor(s)", path, n);
        }
        struct sockaddr_storage ss;
        if (!p->tls_verify)
            ltg_log("warning: providers.%s: tls_verify is false: its certificates are not checked "
                    "at all",
                    p->name);
        else if (addr_parse(p->host, &ss) == 0)
            ltg_log("warning: providers.%s: an IP address: its certificate chain is checked but "
                    "not its name (BearSSL matches DNS names only)",
                    p->name);
    }
    return 0;
}

/* ===== 11. The attempt plan: retry, fallback, breakers, deployments =====
 *
 * IMPLEMENTATION NOTES
 * Retries live in one layer, here. Every upstream attempt ends in one
 * outcome, and the outcome alone decides the next step:
 *
 *   ok             2xx                            -> answer
 *   no_work        nothing reached the provider,  -> the same model again after the
 *                  429, 529                          backoff, while attempts remain;
 *                                                    then the next model
 *   indeterminate  timeout, 408, 5xx, connection  -> the next model: the provider may
 *                  lost after sending                have done (and billed) the work
 *   terminal       context length, other 4xx      -> answer with it: another model
 *                                                    or attempt would fail the same way
 *   unknown_model  404                            -> the next model
 *   circuit_open   the breaker skips the model    -> the next model, no call made
 *
 * Why these rows: a 429 or 529 says "not now" before any work was done, so
 * waiting and asking again is both safe and likely to work; a 5xx or a
 * timeout may come after the model generated (and billed) the answer, so
 * asking it again risks paying twice for the same failure, while another
 * model is a fresh chance; a context-length error is a property of the
 * request, and every other 4xx says the request itself is wrong.
 *
 * plan_next() is the whole decision: that table, line for line, and what
 * the facts of the moment add to it -- the deadline (no attempt starts at
 * or after it; a wait that would end past it moves to the next model), the
 * backoff or Retry-After, another deployment free now, a provider key
 * refused. It is pure (no sockets, no clock: the facts carry the time),
 * so the unit tests drive it row by row; attempt_decide() (section 18)
 * gathers the facts and exchange_step() acts on the answer.
 *
 * The circuit breaker, per deployment (a model's route: a provider and
 * its name for the model; a model has one or several): after 5
 * consecutive no_work or indeterminate outcomes the deployment is skipped
 * for 5 s; then one request is let through as a probe. Its success closes
 * the breaker, its failure opens it for another 5 s. A model whose every
 * breaker is open is skipped (outcome circuit_open, no upstream call, not
 * counted in x-ltg-attempts). Breakers live in the catalog, so a reload
 * starts them closed.
 *
 * Each attempt picks a deployment (deployment_pick): weighted, preferring
 * the fewest attempts in flight, skipping open breakers. A no_work retry
 * goes to another deployment of the same model at once when there is one
 * (its 429 says nothing of the other route), else to the same after the
 * backoff; indeterminate still moves to the next model (the work may be
 * done, on any route).
 */
#define BREAKER_FAILURES 5
#define BREAKER_OPEN_MS 5000
#define BACKOFF_CAP_MS 10000

/* see ltg.h */
attempt_plan plan_start(int nmodels, int max_attempts, int backoff, int delay_ms) {
    return (attempt_plan){nmodels, 0, 1, max_attempts, backoff, delay_ms};
}

/* see ltg.h */
plan_step plan_next(attempt_plan *p, const plan_facts *f) {
    plan_step s = {PLAN_GIVE_UP, 0, 0, 0};
    if (f->outcome == OUTCOME_OK || (f->outcome == OUTCOME_TERMINAL && !f->key_refused)) {
        s.action = PLAN_ANSWER;
        return s;
    }
    if (f->now >= f->deadline) {
        s.late = 1;
        return s;
    }
    if (f->key_refused) { /* the key, not the request: the same attempt again, not counted */
        s.action = PLAN_RETRY_NOW;
        s.next_key = 1;
        return s;
    }
    if (f->outcome == OUTCOME_NO_WORK && p->attempt < p->max_attempts) {
        p->attempt++;
        if (f->other_deployment) { /* its 429 says nothing of the model's other routes */
            s.action = PLAN_RETRY_NOW;
            return s;
        }
        unsigned jitter = f->jitter_permille;
        s.delay_ms = f->retry_after_ms >= 0
                             ? f->retry_after_ms
                             : backoff_ms(p->backoff, p->delay_ms, p->attempt, jitter);
        if (f->now + s.delay_ms < f->deadline) {
            s.action = PLAN_RETRY_AFTER;
            return s;
        }
        s.late = 1; /* the wait would end past the deadline: the next model may answer sooner */
    }
    if (p->model + 1 < p->nmodels) {
        /* no_work out of attempts, indeterminate, unknown_model, circuit_open, untranslatable */
        p->model++;
        p->attempt = 1;
        s.action = PLAN_NEXT_MODEL;
        s.late = 0;
    }
    return s;
}

/* see ltg.h */
attempt_outcome attempt_classify(int status, int reached) {
    if (status == 0) return reached ? OUTCOME_INDETERMINATE : OUTCOME_NO_WORK;
    if (status >= 200 && status < 300) return OUTCOME_OK;
    if (status == 429 || status == 529) return OUTCOME_NO_WORK;
    if (status == 404) return OUTCOME_UNKNOWN_MODEL;
    if (status == 408 || status >= 500) return OUTCOME_INDETERMINATE;
    /* 400, 401, 403, 413, 422, other 4xx; and a 1xx or 3xx no API should send */
    return OUTCOME_TERMINAL;
}

static int contains_nocase(const char *s, size_t n, const char *word) {
    size_t w = strlen(word);
    for (size_t i = 0; i + w <= n; i++)
        if (ascii_casecmp_n(s + i, w, word) == 0) return 1;
    return 0;
}

/* see ltg.h */
int attempt_context_length(int status, const char *body, size_t n) {
    if (status != 400 && status != 413) return 0;
    return contains_nocase(body, n, "context_length_exceeded") ||
           contains_nocase(body, n, "maximum context length") ||
           contains_nocase(body, n, "context length") ||
           contains_nocase(body, n, "context window") ||
           contains_nocase(body, n, "maximum number of tokens") ||
           contains_nocase(body, n, "prompt is too long");
}

/* see ltg.h */
const char *outcome_name(attempt_outcome o) {
    static const char *const names[] = {
        "ok", "no_work", "indeterminate", "terminal", "unknown_model", "circuit_open",
        "untranslatable"
    };
    return (unsigned)o < sizeof names / sizeof *names ? names[o] : "?";
}

/* see ltg.h */
long backoff_ms(int backoff, int delay_ms, int n, unsigned jitter_permille) {
    long base = delay_ms;
    if (backoff == BACKOFF_LINEAR) base *= n - 1;
    else if (backoff == BACKOFF_EXPONENTIAL) base <<= (n - 2 < 14 ? n - 2 : 14);
    base += base * (long)(jitter_permille > 200 ? 200 : jitter_permille) / 1000;
    return base < BACKOFF_CAP_MS ? base : BACKOFF_CAP_MS;
}

/* see ltg.h */
long retry_after_ms(const char *v, size_t n, long long now) {
    long long secs;
    if (parse_ll(v, n, 86400 * 365, &secs) == 0) return (long)(secs * 1000);
    char tmp[64];
    if (n >= sizeof tmp) return -1;
    memcpy(tmp, v, n);
    tmp[n] = 0;
    struct tm tm = {0};
    const char *end = strptime(tmp, "%a, %d %b %Y %H:%M:%S GMT", &tm);
    if (!end || *end) return -1;
    long long at = (long long)timegm(&tm);
    return at <= now ? 0 : (long)((at - now) * 1000);
}

/* Would the breaker let an attempt go to d now (closed, or half-open
 * with no probe out)? */
static int breaker_ready(const deployment *d, int64_t now) {
    return !d->cb_open_until || (now >= d->cb_open_until && !d->cb_probing);
}

/* May an attempt go to d now? In the half-open state the first caller
 * becomes the probe (*probe = 1) and the others are turned away. */
static int breaker_allows(deployment *d, int64_t now, int *probe) {
    *probe = 0;
    if (!breaker_ready(d, now)) return 0;
    d->cb_probing = *probe = d->cb_open_until != 0;
    return 1;
}

/* An attempt on d ended with outcome o (`probe`: it was the half-open probe). */
static void breaker_record(deployment *d, attempt_outcome o, int probe, int64_t now) {
    if (probe) d->cb_probing = 0;
    if (o == OUTCOME_NO_WORK || o == OUTCOME_INDETERMINATE) {
        if (probe || ++d->cb_failures >= BREAKER_FAILURES) {
            if (!d->cb_open_until || probe)
                ltg_log("circuit breaker for %s (%s): open for %d s", d->m->alias, d->name,
                        BREAKER_OPEN_MS / 1000);
            d->cb_open_until = now + BREAKER_OPEN_MS;
            d->cb_failures = 0;
        }
    } else if (o != OUTCOME_CIRCUIT_OPEN && o != OUTCOME_UNTRANSLATABLE) { /* it answered: up */
        if (d->cb_open_until) ltg_log("circuit breaker for %s (%s): closed", d->m->alias, d->name);
        d->cb_failures = 0;
        d->cb_open_until = 0;
    }
}

/* A probe whose result says nothing of the provider (its client left, ltg's own shortage, a
 * timeout its client shortened): its breaker hears nothing, and the next request probes. */
static void breaker_forget_probe(deployment *d) { d->cb_probing = 0; }

/* May deployment i of m take an attempt now, and is it not in `avoid`? */
static int deployment_free(const model *m, int i, uint32_t avoid, int64_t now) {
    return !(avoid >> i & 1) && breaker_ready(&m->dep[i], now);
}

/* The deployment of m for the next attempt, or -1 when every breaker is
 * open. Of those whose breaker lets a call through -- and that are not in
 * `avoid` (bit i: deployment i answered no_work in this request), while
 * one is not -- the fewest in flight for their weight; a tie goes by
 * smooth weighted round-robin (nginx's): each tied deployment gains its
 * weight in credit, the richest is chosen and pays the tie's total. In
 * sequence every deployment gets exactly its weight's share, interleaved;
 * under load a slow one, its attempts piling up, gets fewer new ones. */
static int deployment_pick(model *m, uint32_t avoid, int64_t now) {
    for (int pass = 0; pass < 2; pass++, avoid = 0) {
        int lo = -1, best = -1, total = 0;
        for (int i = 0; i < m->ndep; i++) {
            const deployment *d = &m->dep[i];
            if (deployment_free(m, i, avoid, now) &&
                (lo < 0 ||
                 (long)d->inflight * m->dep[lo].weight < (long)m->dep[lo].inflight * d->weight))
                lo = i;
        }
        for (int i = 0; lo >= 0 && i < m->ndep; i++) {
            deployment *d = &m->dep[i];
            if (!deployment_free(m, i, avoid, now) ||
                (long)d->inflight * m->dep[lo].weight != (long)m->dep[lo].inflight * d->weight)
                continue;
            d->credit += d->weight;
            total += d->weight;
            if (best < 0 || d->credit > m->dep[best].credit) best = i;
        }
        if (best >= 0) { m->dep[best].credit -= total; return best; }
    }
    return -1;
}

/* Is there a deployment of m outside `avoid` that could take an attempt now? */
static int deployment_other(const model *m, uint32_t avoid, int64_t now) {
    for (int i = 0; i < m->ndep; i++)
        if (deployment_free(m, i, avoid, now)) return 1;
    return 0;
}

/* ===== 12. The store: token groups, token keys, idempotency records =====
 *
 * IMPLEMENTATION NOTES
 * Policy lives in token groups; applications hold token keys, each bound to
 * one group. Both live in memory: a hash table by id for lookups, and a
 * vector in creation order for listing (a deleted entry leaves a NULL that
 * is squeezed out later, so positions stay put while a compaction walks
 * them). Token keys are also hashed by the SHA-256 of their secret, which
 * is all ltg ever keeps of a secret.
 *
 * Both kinds start with the same header (`stored`: id, name, allowance,
 * version, times) and are described by a row, a store_kind: its log
 * operations, its tables, and the functions that parse, validate, show
 * and place an item. The code that stores, replays and serves items is
 * written once over the row (store_put, store_apply, section 16's item_*).
 *
 * A change is made on a copy: the row's parse lays the request's fields
 * over it (PATCH: omitted kept, null clears), its validate checks the
 * whole result against the rules of the README's "Token groups" (a key's:
 * "Token keys"), and only a copy that passed is written to the log
 * (section 13) and then swapped in. A refused change therefore leaves
 * nothing behind, in memory or on disk. A group and a key each carry an
 * allowance -- a budget and rate limits -- parsed, checked and shown by
 * the same allow_* functions; what it counts is section 15's.
 *
 * Validation errors carry a JSON pointer (RFC 6901) to the offending value
 * and a message that says what is allowed. Catalog membership is checked
 * right after the required fields, before every other rule, so a typo in a
 * model name is reported as such rather than as a fallback rule it happens
 * to break.
 *
 * Idempotency records remember the first answer to a request for 24 hours, on both planes, in
 * one table. A change's is keyed by the admin key (its hash), the method, the path and the
 * client's Idempotency-Key, and written in the same log record as the change it answered, so a
 * retry after a crash finds either both or neither; an inference request's is section 15's.
 */
#define MAX_FALLBACKS 3
#define UNSET LLONG_MIN /* an optional integer set to null */
#define IDEM_TTL_MS (24LL * 3600 * 1000)
#define NAME_MAX_LEN 200

/* The names of backoff_kind (ltg.h), in its order. */
static const char *const backoff_names[] = {"constant", "linear", "exponential", NULL};

/* What every stored item starts with: its slot in the creation-order vector
 * and the size of its latest log record (for the compaction estimate). */
typedef struct {
    int vi;
    size_t rec_bytes;
} entry;

typedef struct {
    char *model;
    char *to[MAX_FALLBACKS];
    int n;
} fallback;

typedef struct {
    int max_attempts, retry_delay_ms, backoff, request_timeout_ms; /* request_timeout_ms 0: none */
    /* the whole request until its answer starts; 0: DEFAULT_DEADLINE_MS */
    int deadline_ms;
} retry_policy;

/* What a token group or a token key may spend and use (README "Budgets that cannot be overspent"):
 * the policy the API sets, and the use ltg counts against it. Only section
 * 14 writes the counts: the reservation path, period changes, retention and
 * the start-up sum. */
#define BUDGET_MONTH (-1)     /* budget_days of "1mo": the calendar month, UTC */
#define MICRO 1000000.0       /* money is counted in micro-USD */

static int64_t usd_to_micro(double usd) { return (int64_t)llround(usd * MICRO); }

typedef struct {
    int has_budget;           /* 0: uncapped */
    double max_budget;        /* USD */
    int budget_days;          /* 1, 7 or 30; BUDGET_MONTH; 0 = lifetime */
    long long rpm_limit, tpm_limit; /* requests, tokens per minute; UNSET = null: unlimited */
    /* wall ms the budget was set (its first period starts there); 0 = no budget */
    int64_t budget_anchor;
    /* a group's or a key's: spent in days retention deleted (section 14): in the period from
     * carry_start, by events before carry_to; carry_to 0: none */
    int64_t carry, carry_start, carry_to;
    /* Runtime, not logged (rebuilt from the ledger at start-up): */
    /* the last minute's requests and tokens, once a limit is met (section 15) */
    struct rl_window *rl;
    /* micro-USD: charged in the current period; held by requests in flight */
    int64_t spend, reserved;
    /* the period `spend` belongs to (see budget_refresh); its end, 0: none or not known */
    int64_t period_start, period_end;
} allowance;

/* The longest a's budget period lasts, in days (0: lifetime). */
static int allow_days(const allowance *a) {
    return a->budget_days == BUDGET_MONTH ? 31 : a->budget_days;
}

/* What a token group and a token key have in common, first in both: the
 * store's rows (store_kind, below) and the control plane's handlers work on
 * it whatever the kind. */
typedef struct {
    entry e;
    char id[37];
    char *name;
    allowance al;             /* its budget and rate limits (a key's beside its group's) */
    int blocked;
    long long version;
    int64_t created_at, updated_at; /* wall ms */
} stored;

typedef struct {
    stored s;
    char **allowed;
    int nallowed;
    fallback *fb;
    int nfb;
    int has_retries;          /* 0: "retries": null, the defaults apply */
    retry_policy retries;
    long long cache_ttl;      /* seconds; UNSET = null */
    long long max_parallel;   /* UNSET = null: unlimited */
    int inflight;             /* requests in flight (runtime, not logged) */
    int meters;               /* its abandoned answers metered now (runtime, section 18) */
} group;

typedef struct {
    stored s;
    char group_id[37];
    uint8_t hash[32];         /* SHA-256 of the secret */
} tkey;

/* An idempotency record: the first answer to a request that carried an Idempotency-Key, on
 * either plane. A change's answer is in the record (and the state log); an inference answer is
 * in its spend event, in the cache, or, while meters run, in its exchange. Both planes' records
 * are in one table; only the control plane's are part of the store's live state. */
typedef struct {
    entry e;
    uint8_t key[32];          /* SHA-256 of who asked, what, and the Idempotency-Key */
    uint8_t body[32];         /* SHA-256 of the request body */
    int inference;            /* 1: the inference plane's (not in the store's live state) */
    int done;                 /* 0: the first request is still in flight */
    int status;
    int64_t expires;          /* wall ms */
    long long version;        /* a change's answer: its ETag (0 for none) and its body */
    char *response;
    int stream;               /* an inference answer: an event stream, from model `served`, */
    char served[ALIAS_MAX + 1];
    int64_t day;              /* in the spend event at (day, off, len) of the ledger, */
    uint64_t off;
    uint32_t len;
    const buf *keep;          /* or, while that event waits for a meter, in the exchange, */
    int cached;               /* or in the cache (no copy kept: a tenant could fill the disk with */
    uint8_t cache_key[32];    /* copies of one answer): a retry runs again once it has left */
} idem;

typedef struct {
    void **p;
    int n, cap, live;
} vec;

static struct {
    hmap groups, keys, keys_by_hash, idems;
    vec gv, kv, iv;
    int frozen;               /* a compaction walks the vectors: positions must stay */
    size_t live_bytes;        /* what a snapshot of the live state would take */
    /* idempotency records expired since the last compaction: still in the log */
    int expired;
} ST;

static const void *group_key(const void *it, size_t *n) {
    *n = 36;
    return ((const group *)it)->s.id;
}
static const void *tkey_key(const void *it, size_t *n) { *n = 36; return ((const tkey *)it)->s.id; }
static const void *tkey_hash_key(const void *it, size_t *n) {
    *n = 32;
    return ((const tkey *)it)->hash;
}
static const void *idem_key(const void *it, size_t *n) { *n = 32; return ((const idem *)it)->key; }

static void store_init(void) {
    ST.groups.key = group_key;
    ST.keys.key = tkey_key;
    ST.keys_by_hash.key = tkey_hash_key;
    ST.idems.key = idem_key;
}

static void vec_add(vec *v, void *item) {
    if (v->n == v->cap) {
        v->cap = v->cap ? v->cap * 2 : 64;
        v->p = xrealloc(v->p, (size_t)v->cap * sizeof *v->p);
    }
    ((entry *)item)->vi = v->n;
    v->p[v->n++] = item;
    v->live++;
}

static void vec_squeeze(vec *v);

static void vec_del(vec *v, void *item) {
    v->p[((entry *)item)->vi] = NULL;
    v->live--;
    vec_squeeze(v);
}

/* Squeeze out the holes deletions left, unless a compaction is walking it. */
static void vec_squeeze(vec *v) {
    if (ST.frozen || v->n < 2 * v->live + 64) return;
    int k = 0;
    for (int i = 0; i < v->n; i++)
        if (v->p[i]) {
            ((entry *)v->p[i])->vi = k;
            v->p[k++] = v->p[i];
        }
    v->n = k;
}

/* A string token usable as a name: 1..max bytes once unescaped, and no
 * NUL (ltg's strings end at one, so it would silently cut the name). */
static int name_ok(const char *s, const json_tok *t, int i, size_t max) {
    if (t[i].type != JSON_STRING) return 0;
    buf b = {0};
    json_unescape(s, t, i, &b);
    int ok = b.len >= 1 && b.len <= max && (!b.p || !memchr(b.p, 0, b.len));
    buf_free(&b);
    return ok;
}

/* ---- validation errors ---- */

typedef struct {
    const char *code;         /* invalid_request, model_not_in_catalog, invalid_json */
    char pointer[256];        /* RFC 6901; empty: none */
    char detail[320];
} verr;

/* Append one reference token to a JSON pointer, escaping '~' and '/'. */
static void ptr_push(char *ptr, size_t cap, const char *token) {
    size_t n = strlen(ptr);
    if (n + 1 < cap) ptr[n++] = '/';
    for (const char *p = token; *p && n + 2 < cap; p++) {
        if (*p == '~') {
            ptr[n++] = '~';
            ptr[n++] = '0';
        } else if (*p == '/') {
            ptr[n++] = '~';
            ptr[n++] = '1';
        } else ptr[n++] = *p;
    }
    ptr[n] = 0;
}

/* The pointer /a/b and an invalid_request error about it. b may be NULL;
 * a NULL too: about the body as a whole (no pointer). */
static int verr_at(verr *e, const char *a, const char *b, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));
static int verr_at(verr *e, const char *a, const char *b, const char *fmt, ...) {
    e->pointer[0] = 0;
    if (a) ptr_push(e->pointer, sizeof e->pointer, a);
    if (b) ptr_push(e->pointer, sizeof e->pointer, b);
    e->code = "invalid_request";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->detail, sizeof e->detail, fmt, ap);
    va_end(ap);
    return LTG_ERR;
}

/* After verr_at: the error is about element i of the array it named. */
static int verr_index(verr *e, int i) {
    char idx[16];
    snprintf(idx, sizeof idx, "%d", i);
    ptr_push(e->pointer, sizeof e->pointer, idx);
    return LTG_ERR;
}

/* 0, or LTG_ERR with e set when object token `obj` has a key twice (at
 * pointer /where/<key>): which of two values would win is anybody's guess. */
static int no_duplicate_keys(const char *s, const json_tok *t, int obj, const char *where,
                             verr *e) {
    int k = json_duplicate_key(s, t, obj);
    if (k < 0) return 0;
    char *key = json_strdup(s, t, k);
    verr_at(e, where ? where : key, where ? key : NULL, "is given twice: send each key once");
    free(key);
    return LTG_ERR;
}

/* Is string token i a plain id: 36 characters of hex digits and '-' (no
 * escape that would make its bytes differ from its value)? */
static int is_uuid(const char *s, const json_tok *t, int i) {
    if (i < 0 || t[i].type != JSON_STRING || t[i].end - t[i].start != 36) return 0;
    for (uint32_t k = t[i].start; k < t[i].end; k++)
        if (!isxdigit((unsigned char)s[k]) && s[k] != '-') return 0;
    return 1;
}

/* ---- groups ---- */

static void group_clear_fallbacks(group *g) {
    for (int i = 0; i < g->nfb; i++) {
        free(g->fb[i].model);
        for (int k = 0; k < g->fb[i].n; k++) free(g->fb[i].to[k]);
    }
    free(g->fb);
    g->fb = NULL;
    g->nfb = 0;
}

static void group_free(stored *it) {
    group *g = (group *)it;
    if (!g) return;
    free(g->s.name);
    for (int i = 0; i < g->nallowed; i++) free(g->allowed[i]);
    free(g->allowed);
    group_clear_fallbacks(g);
    free(g->s.al.rl);
    free(g);
}

static stored *group_new(void) {
    group *g = xcalloc(1, sizeof *g);
    g->cache_ttl = UNSET;
    g->max_parallel = UNSET;
    g->s.al.rpm_limit = UNSET;
    g->s.al.tpm_limit = UNSET;
    return &g->s;
}

static char *xstrdup(const char *s) { return xstrndup(s, strlen(s)); }

/* A copy a change is made on: the rate window stays the live item's
 * (store_put moves it to the one that replaces it). */
static void stored_clone(stored *it, const stored *src) {
    it->al.rl = NULL;
    it->name = xstrdup(src->name);
}

static stored *group_clone(const stored *from) {
    const group *src = (const group *)from;
    group *g = xmalloc(sizeof *g);
    *g = *src;
    stored_clone(&g->s, &src->s);
    g->allowed = xcalloc((size_t)src->nallowed, sizeof *g->allowed);
    for (int i = 0; i < src->nallowed; i++) g->allowed[i] = xstrdup(src->allowed[i]);
    g->fb = xcalloc((size_t)src->nfb, sizeof *g->fb);
    for (int i = 0; i < src->nfb; i++) {
        g->fb[i].model = xstrdup(src->fb[i].model);
        g->fb[i].n = src->fb[i].n;
        for (int k = 0; k < src->fb[i].n; k++) g->fb[i].to[k] = xstrdup(src->fb[i].to[k]);
    }
    return &g->s;
}

/* The defaults of a retry policy: also what "retries": null means. */
static retry_policy retry_defaults(void) {
    return (retry_policy){1, 250, BACKOFF_EXPONENTIAL, 0, 0};
}

static int group_allows(const group *g, const char *alias) {
    for (int i = 0; i < g->nallowed; i++)
        if (strcmp(g->allowed[i], alias) == 0) return 1;
    return 0;
}

enum { PARSE_CREATE, PARSE_PATCH, PARSE_LOG };

static int parse_retries(const char *s, const json_tok *t, int v, group *g, verr *e) {
    if (t[v].type == JSON_NULL) { g->has_retries = 0; return 0; }
    if (t[v].type != JSON_OBJECT)
        return verr_at(e, "retries", NULL, "must be an object (or null for the defaults)");
    if (no_duplicate_keys(s, t, v, "retries", e) < 0) return LTG_ERR;
    retry_policy r = retry_defaults();
    int i = v + 1;
    for (int m = 0; m < t[v].size; m++, i = t[i + 1].next) {
        int x = i + 1;
        long long n = 0;
        char key[64];
        snprintf(key, sizeof key, "%.*s", (int)(t[i].end - t[i].start), s + t[i].start);
        if (json_eq(s, t, i, "backoff")) {
            int k = 0;
            while (backoff_names[k] && !json_eq(s, t, x, backoff_names[k])) k++;
            if (!backoff_names[k])
                return verr_at(e, "retries", "backoff",
                               "must be \"constant\", \"linear\" or \"exponential\"");
            r.backoff = k;
            continue;
        }
        int known = json_eq(s, t, i, "max_attempts") || json_eq(s, t, i, "retry_delay_ms") ||
                    json_eq(s, t, i, "request_timeout_ms") || json_eq(s, t, i, "deadline_ms");
        if (!known)
            return verr_at(e, "retries", key,
                           "unknown field (retries has max_attempts, retry_delay_ms, backoff, "
                           "request_timeout_ms, deadline_ms)");
        if (json_eq(s, t, i, "request_timeout_ms") && t[x].type == JSON_NULL) {
            r.request_timeout_ms = 0;
            continue;
        }
        if (json_int(s, t, x, &n) < 0) return verr_at(e, "retries", key, "must be a whole number");
        /* range-checked by group_validate */
        if (n < INT_MIN || n > INT_MAX) n = n < 0 ? INT_MIN : INT_MAX;
        if (json_eq(s, t, i, "max_attempts")) r.max_attempts = (int)n;
        else if (json_eq(s, t, i, "retry_delay_ms")) r.retry_delay_ms = (int)n;
        else if (json_eq(s, t, i, "deadline_ms"))
            r.deadline_ms = n == 0 ? -1 : (int)n; /* 0 is out of range, not the default */
        else
            /* 0 is out of range, not "none": use null for none */
            r.request_timeout_ms = n == 0 ? -1 : (int)n;
    }
    g->has_retries = 1;
    g->retries = r;
    return 0;
}

static int parse_fallbacks(const char *s, const json_tok *t, int v, group *g, verr *e) {
    group_clear_fallbacks(g);
    if (t[v].type == JSON_NULL) return 0;
    if (t[v].type != JSON_OBJECT)
        return verr_at(e, "fallbacks", NULL, "must be an object: model -> list of fallback models");
    if (no_duplicate_keys(s, t, v, "fallbacks", e) < 0) return LTG_ERR;
    g->fb = xcalloc((size_t)t[v].size, sizeof *g->fb);
    int i = v + 1;
    for (int m = 0; m < t[v].size; m++, i = t[i + 1].next) {
        fallback *f = &g->fb[g->nfb++];
        f->model = json_strdup(s, t, i);
        int a = i + 1;
        if (t[a].type != JSON_ARRAY)
            return verr_at(e, "fallbacks", f->model, "must be a list of model aliases");
        if (t[a].size > MAX_FALLBACKS)
            return verr_at(e, "fallbacks", f->model,
                           "has %d models: at most %d fallbacks per model", t[a].size,
                           MAX_FALLBACKS);
        int x = a + 1;
        for (int k = 0; k < t[a].size; k++, x = t[x].next) {
            if (!name_ok(s, t, x, 200)) {
                verr_at(e, "fallbacks", f->model, "must hold model aliases (strings)");
                return verr_index(e, k);
            }
            f->to[f->n++] = json_strdup(s, t, x);
        }
    }
    return 0;
}

static int parse_name(const char *s, const json_tok *t, int v, char **name, verr *e) {
    if (t[v].type != JSON_STRING)
        return verr_at(e, "name", NULL, "must be a string (it cannot be null)");
    if (!name_ok(s, t, v, NAME_MAX_LEN))
        return verr_at(e, "name", NULL, "must be 1 to %d bytes, without NUL", NAME_MAX_LEN);
    free(*name);
    *name = json_strdup(s, t, v);
    return 0;
}

static int parse_bool(const char *s, const json_tok *t, int v, int *out, verr *e) {
    (void)s;
    if (t[v].type != JSON_TRUE && t[v].type != JSON_FALSE)
        return verr_at(e, "blocked", NULL, "must be true or false");
    *out = t[v].type == JSON_TRUE;
    return 0;
}

/* The member at key token i, if it is one of an allowance's (max_budget,
 * budget_duration, rpm_limit, tpm_limit): laid over a, 1; 0 when it is
 * not one; LTG_ERR for a wrong type. */
static int allow_parse(const char *s, const json_tok *t, int i, allowance *a, int mode, verr *e) {
    int v = i + 1;
    long long n;
    double d;
    if (json_eq(s, t, i, "max_budget")) {
        if (t[v].type == JSON_NULL) a->has_budget = 0;
        else if (json_number(s, t, v, &d) < 0 || (mode == PARSE_LOG && (d < 0 || d > 1e9)))
            return verr_at(e, "max_budget", NULL, "must be a number of USD (or null for no cap)");
        else {
            a->has_budget = 1;
            a->max_budget = d;
        }
    } else if (json_eq(s, t, i, "budget_duration")) {
        if (t[v].type == JSON_NULL) a->budget_days = 0;
        else if (json_eq(s, t, v, "1d")) a->budget_days = 1;
        else if (json_eq(s, t, v, "7d")) a->budget_days = 7;
        else if (json_eq(s, t, v, "30d")) a->budget_days = 30;
        else if (json_eq(s, t, v, "1mo")) a->budget_days = BUDGET_MONTH;
        else
            return verr_at(e, "budget_duration", NULL,
                           "must be \"1d\", \"7d\", \"30d\", \"1mo\" (the calendar month, UTC) or "
                           "null (a lifetime budget)");
    } else if (json_eq(s, t, i, "rpm_limit") || json_eq(s, t, i, "tpm_limit")) {
        long long *f = json_eq(s, t, i, "rpm_limit") ? &a->rpm_limit : &a->tpm_limit;
        if (t[v].type == JSON_NULL) *f = UNSET;
        else if (json_int(s, t, v, &n) < 0)
            return verr_at(e, json_eq(s, t, i, "rpm_limit") ? "rpm_limit" : "tpm_limit", NULL,
                           "must be a whole number (or null for no limit)");
        else *f = n;
    } else if (mode == PARSE_LOG && json_eq(s, t, i, "budget_anchor") &&
               json_int(s, t, v, &n) == 0) {
        a->budget_anchor = n;
    } else if (mode == PARSE_LOG && json_eq(s, t, i, "carried") && t[v].type == JSON_ARRAY &&
               t[v].size == 3) {
        long long c[3];
        int x = v + 1;
        for (int k = 0; k < 3; k++, x = t[x].next)
            if (json_int(s, t, x, &c[k]) < 0)
                return verr_at(e, "carried", NULL, "must be three whole numbers");
        a->carry = c[0];
        a->carry_start = c[1];
        a->carry_to = c[2];
    } else
        return 0;
    return 1;
}

/* Is `d` a USD amount with at most six decimal places? */
static int usd_ok(double d) {
    double micro = d * 1e6;
    return fabs(micro - floor(micro + 0.5)) < 1e-6;
}

/* The rules of an allowance. A period must fit the ledger's retention. */
static int allow_validate(const allowance *a, verr *e) {
    int days = allow_days(a);
    if (a->has_budget && (a->max_budget < 0 || a->max_budget > 1e9 || !usd_ok(a->max_budget)))
        return verr_at(e, "max_budget", NULL,
                       "must be between 0 and 1000000000 USD with at most six decimal places (0 "
                       "denies every paid request, null is uncapped)");
    if (days > S.ledger_days)
        return verr_at(
                e, "budget_duration", NULL,
                "a %d-day period is longer than the %d days of spend events this gateway keeps "
                "(--ledger-days): choose a shorter period, or have the operator keep more days",
                days, S.ledger_days);
    if (a->rpm_limit != UNSET && (a->rpm_limit < 1 || a->rpm_limit > 1000000))
        return verr_at(e, "rpm_limit", NULL,
                       "must be between 1 and 1000000 requests a minute (or null for no limit)");
    if (a->tpm_limit != UNSET && (a->tpm_limit < 1 || a->tpm_limit > 1000000000))
        return verr_at(e, "tpm_limit", NULL,
                       "must be between 1 and 1000000000 tokens a minute (or null for no limit)");
    return 0;
}

/* A member (key token i) that only the log holds of a group or a key:
 * its id, version and times. 1 when it was one (and well formed). */
static int parse_log_common(const char *s, const json_tok *t, int i, char *id, long long *version,
                            int64_t *created, int64_t *updated) {
    int v = i + 1;
    long long n;
    if (json_eq(s, t, i, "id") && is_uuid(s, t, v)) {
        memcpy(id, s + t[v].start, 36);
        id[36] = 0;
        return 1;
    }
    int64_t *field = json_eq(s, t, i, "created_at")   ? created
                     : json_eq(s, t, i, "updated_at") ? updated
                                                      : NULL;
    if (json_eq(s, t, i, "version") && json_int(s, t, v, &n) == 0) *version = n;
    else if (field && json_int(s, t, v, &n) == 0) *field = n;
    else return 0;
    return 1;
}

/* A member (key token i, `key` its name) that neither a group nor a key
 * takes: read-only, or unknown (`fields` says what there is). */
static int field_refused(const char *s, const json_tok *t, int i, const char *key,
                         const char *fields, verr *e) {
    static const char *const readonly[] = {
        "id", "record_type", "version", "created_at", "updated_at", "spend", "reserved_spend",
        "budget_started_at", "resets_at", NULL
    };
    int ro = 0;
    for (const char *const *r = readonly; *r; r++) ro |= json_eq(s, t, i, *r);
    return ro ? verr_at(e, key, NULL, "is read-only: ltg sets it")
              : verr_at(e, key, NULL, "unknown field (%s)", fields);
}

/* allowed_models: a list of model aliases. */
static int parse_allowed(const char *s, const json_tok *t, int v, group *g, verr *e) {
    if (t[v].type != JSON_ARRAY)
        return verr_at(e, "allowed_models", NULL,
                       "must be a list of model aliases (it cannot be null)");
    for (int k = 0; k < g->nallowed; k++) free(g->allowed[k]);
    free(g->allowed);
    g->allowed = xcalloc((size_t)t[v].size, sizeof *g->allowed);
    g->nallowed = 0;
    int x = v + 1;
    for (int k = 0; k < t[v].size; k++, x = t[x].next) {
        if (!name_ok(s, t, x, 200)) {
            verr_at(e, "allowed_models", NULL, "must be a model alias (a string)");
            return verr_index(e, k);
        }
        g->allowed[g->nallowed++] = json_strdup(s, t, x);
    }
    return 0;
}

/* Lay the members of JSON object `obj` over g. PARSE_CREATE and PARSE_PATCH
 * take the API's writable fields; PARSE_LOG also takes what only the log
 * knows (id, version, timestamps). Checks types and field names only: the
 * rules are group_validate()'s. */
static int group_parse(const char *s, const json_tok *t, int obj, stored *it, int mode, verr *e) {
    group *g = (group *)it;
    if (t[obj].type != JSON_OBJECT) return verr_at(e, NULL, NULL, "the body must be a JSON object");
    if (no_duplicate_keys(s, t, obj, NULL, e) < 0) return LTG_ERR;
    int i = obj + 1;
    for (int m = 0; m < t[obj].size; m++, i = t[i + 1].next) {
        int v = i + 1;
        char key[128];
        snprintf(key, sizeof key, "%.*s",
                 (int)(t[i].end - t[i].start < 100 ? t[i].end - t[i].start : 100), s + t[i].start);
        long long n;
        int r;
        if (mode == PARSE_LOG &&
            parse_log_common(s, t, i, g->s.id, &g->s.version, &g->s.created_at, &g->s.updated_at)) {
            /* what only the log knows */
        } else if (json_eq(s, t, i, "name")) {
            if (parse_name(s, t, v, &g->s.name, e) < 0) return LTG_ERR;
        } else if (json_eq(s, t, i, "allowed_models")) {
            if (parse_allowed(s, t, v, g, e) < 0) return LTG_ERR;
        } else if (json_eq(s, t, i, "fallbacks")) {
            if (parse_fallbacks(s, t, v, g, e) < 0) return LTG_ERR;
        } else if (json_eq(s, t, i, "retries")) {
            if (parse_retries(s, t, v, g, e) < 0) return LTG_ERR;
        } else if ((r = allow_parse(s, t, i, &g->s.al, mode, e)) != 0) {
            if (r < 0) return LTG_ERR;
        } else if (json_eq(s, t, i, "cache_ttl")) {
            if (t[v].type == JSON_NULL) g->cache_ttl = UNSET;
            else if (json_int(s, t, v, &n) < 0)
                return verr_at(e, "cache_ttl", NULL, "must be a whole number of seconds (or null)");
            else g->cache_ttl = n;
        } else if (json_eq(s, t, i, "max_parallel_requests")) {
            if (t[v].type == JSON_NULL) g->max_parallel = UNSET;
            else if (json_int(s, t, v, &n) < 0)
                return verr_at(e, key, NULL, "must be a whole number (or null for no limit)");
            else g->max_parallel = n;
        } else if (json_eq(s, t, i, "blocked")) {
            if (parse_bool(s, t, v, &g->s.blocked, e) < 0) return LTG_ERR;
        } else {
            return field_refused(s, t, i, key,
                                 "a token group has name, allowed_models, fallbacks, retries, "
                                 "max_budget, budget_duration, cache_ttl, max_parallel_requests, "
                                 "rpm_limit, tpm_limit, blocked",
                                 e);
        }
    }
    return 0;
}

/* The rules of the README's "Token groups" over a whole group (after a PATCH: the merged
 * result). Catalog membership first. */
/* Every model the group names is in the catalog (checked before every
 * other rule: see the notes). */
static int group_in_catalog(const group *g, const catalog *cat, verr *e) {
    for (int i = 0; i < g->nallowed; i++)
        if (!catalog_model((catalog *)cat, g->allowed[i], strlen(g->allowed[i]))) {
            verr_at(e, "allowed_models", NULL,
                    "\"%.100s\" is not a model of this gateway's catalog (GET /v1/models with a "
                    "key lists them)",
                    g->allowed[i]);
            e->code = "model_not_in_catalog";
            return verr_index(e, i);
        }
    for (int i = 0; i < g->nfb; i++) {
        const fallback *f = &g->fb[i];
        if (!catalog_model((catalog *)cat, f->model, strlen(f->model))) {
            verr_at(e, "fallbacks", f->model, "\"%.100s\" is not a model of this gateway's catalog",
                    f->model);
            e->code = "model_not_in_catalog";
            return LTG_ERR;
        }
        for (int k = 0; k < f->n; k++)
            if (!catalog_model((catalog *)cat, f->to[k], strlen(f->to[k]))) {
                verr_at(e, "fallbacks", f->model,
                        "\"%.100s\" is not a model of this gateway's catalog", f->to[k]);
                e->code = "model_not_in_catalog";
                return verr_index(e, k);
            }
    }
    return 0;
}

static int group_validate(const stored *it, const catalog *cat, verr *e) {
    const group *g = (const group *)it;
    if (!g->s.name) return verr_at(e, "name", NULL, "is required (a name for the group)");
    if (!g->allowed)
        return verr_at(e, "allowed_models", NULL,
                       "is required (the model aliases this group may call; [] permits none)");
    if (group_in_catalog(g, cat, e) < 0) return LTG_ERR;
    if (!*g->s.name || strlen(g->s.name) > NAME_MAX_LEN)
        return verr_at(e, "name", NULL, "must be 1 to %d characters", NAME_MAX_LEN);
    for (int i = 0; i < g->nallowed; i++)
        for (int k = 0; k < i; k++)
            if (strcmp(g->allowed[i], g->allowed[k]) == 0) {
                verr_at(e, "allowed_models", NULL, "\"%.100s\" is listed twice", g->allowed[i]);
                return verr_index(e, i);
            }
    for (int i = 0; i < g->nfb; i++) {
        const fallback *f = &g->fb[i];
        if (!group_allows(g, f->model))
            return verr_at(e, "fallbacks", f->model,
                           "\"%.100s\" has fallbacks but is not in allowed_models", f->model);
        for (int k = 0; k < f->n; k++) {
            const char *why = NULL;
            if (strcmp(f->to[k], f->model) == 0) why = "a model cannot be its own fallback";
            else if (!group_allows(g, f->to[k])) why = "a fallback must also be in allowed_models";
            for (int j = 0; j < k && !why; j++)
                if (strcmp(f->to[j], f->to[k]) == 0) why = "is listed twice";
            if (why) {
                verr_at(e, "fallbacks", f->model, "\"%.100s\": %s", f->to[k], why);
                return verr_index(e, k);
            }
        }
    }
    if (g->has_retries) {
        const retry_policy *r = &g->retries;
        if (r->max_attempts < 1 || r->max_attempts > 5)
            return verr_at(e, "retries", "max_attempts", "must be between 1 and 5");
        if (r->retry_delay_ms < 0 || r->retry_delay_ms > 60000)
            return verr_at(e, "retries", "retry_delay_ms", "must be between 0 and 60000");
        if (r->request_timeout_ms &&
            (r->request_timeout_ms < 100 || r->request_timeout_ms > 600000))
            return verr_at(e, "retries", "request_timeout_ms",
                           "must be between 100 and 600000 (or null for none)");
        if (r->deadline_ms && (r->deadline_ms < 1000 || r->deadline_ms > 3600000))
            return verr_at(e, "retries", "deadline_ms",
                           "must be between 1000 and 3600000 (ms: the whole request until its "
                           "answer starts)");
    }
    if (allow_validate(&g->s.al, e) < 0) return LTG_ERR;
    if (g->cache_ttl != UNSET && (g->cache_ttl < 0 || g->cache_ttl > 30 * 86400))
        return verr_at(e, "cache_ttl", NULL, "must be between 0 and 2592000 seconds (or null)");
    if (g->max_parallel != UNSET && (g->max_parallel < 1 || g->max_parallel > 100000))
        return verr_at(e, "max_parallel_requests", NULL,
                       "must be between 1 and 100000 (or null for no limit; to stop all requests "
                       "set blocked)");
    return 0;
}

/* UTC midnight of the first day of the month `months` after the one of
 * wall ms t. */
static int64_t month_start(int64_t t, int months) {
    time_t secs = (time_t)(t / 1000);
    struct tm tm;
    gmtime_r(&secs, &tm);
    tm.tm_mday = 1;
    tm.tm_hour = tm.tm_min = tm.tm_sec = 0;
    tm.tm_mon += months;
    return (int64_t)timegm(&tm) * 1000;
}

/* The start of a's current budget period and its end (0: none). A period
 * of days follows its anchor; a calendar month (1mo) starts on the 1st,
 * 00:00 UTC -- the first one at the anchor. */
static void allow_period(const allowance *a, int64_t now, int64_t *start, int64_t *end) {
    *start = *end = 0;
    if (!a->has_budget || !a->budget_anchor) return;
    *start = a->budget_anchor;
    if (a->budget_days == BUDGET_MONTH) {
        int64_t m = month_start(now > a->budget_anchor ? now : a->budget_anchor, 0);
        if (m > *start) *start = m;
        *end = month_start(m, 1);
        return;
    }
    if (!a->budget_days) return;
    int64_t len = (int64_t)a->budget_days * 86400000;
    if (now > a->budget_anchor) *start = a->budget_anchor + (now - a->budget_anchor) / len * len;
    *end = *start + len;
}

/* What a group or key carries into the period that starts at `start` from days
 * the ledger deleted (section 14). */
static int64_t allow_carried(const allowance *a, int64_t start) {
    return a->carry_to && a->carry_start == start ? a->carry : 0;
}

/* What a has spent in the period that holds `now`: a pure read. The
 * period moves in budget_refresh (admission, settlement) and when a change
 * or start-up sets it again (allow_start, budget_recount, budget_rebuild);
 * a read past its end sees the new period's start (what was carried). */
static int64_t budget_spent(const allowance *a, int64_t now) {
    if (a->period_end && now >= a->period_start && now < a->period_end) return a->spend;
    int64_t start, end;
    allow_period(a, now, &start, &end);
    return start == a->period_start ? a->spend : allow_carried(a, start);
}

/* An allowance's policy, as the API sets it. */
static void allow_json(jwriter *w, const allowance *a) {
    char d[16];
    jw_key(w, "max_budget");
    if (a->has_budget) jw_usd(w, usd_to_micro(a->max_budget));
    else jw_null(w);
    jw_key(w, "budget_duration");
    if (a->budget_days) {
        snprintf(d, sizeof d, a->budget_days == BUDGET_MONTH ? "1mo" : "%dd", a->budget_days);
        jw_cstr(w, d);
    } else jw_null(w);
    jw_key(w, "rpm_limit"), jw_int_or_null(w, a->rpm_limit != UNSET, a->rpm_limit);
    jw_key(w, "tpm_limit"), jw_int_or_null(w, a->tpm_limit != UNSET, a->tpm_limit);
}

/* ... and its state: in the log, where its period is anchored; in the API,
 * what it spent (when `tracked`: a key's spend is counted only while it
 * has a budget), what is reserved, and its period. */
static void allow_state_json(jwriter *w, const allowance *a, int for_log, int tracked) {
    if (for_log) {
        jw_key(w, "budget_anchor"), jw_int(w, a->budget_anchor);
        if (a->carry_to) {
            jw_key(w, "carried"), jw_open(w, '[');
            jw_int(w, a->carry), jw_int(w, a->carry_start), jw_int(w, a->carry_to);
            jw_close(w, ']');
        }
        return;
    }
    int64_t start, end;
    allow_period(a, wall_ms(), &start, &end);
    jw_key(w, "spend");
    if (tracked) jw_usd(w, budget_spent(a, wall_ms()));
    else jw_null(w);
    jw_key(w, "reserved_spend"), jw_usd(w, a->reserved);
    jw_key(w, "budget_started_at");
    if (start) jw_time(w, start, 0);
    else jw_null(w);
    jw_key(w, "resets_at");
    if (end) jw_time(w, end, 0);
    else jw_null(w);
}

/* A change to an allowance (`cur`: before it). A budget's period is
 * anchored when the budget is set; changing the amount keeps the period,
 * changing the duration starts a new one. */
static void allow_reanchor(allowance *a, const allowance *cur, int64_t now) {
    if (!a->has_budget) a->budget_anchor = 0;
    else if (!cur->has_budget || a->budget_days != cur->budget_days) a->budget_anchor = now;
}

/* A new group's or key's allowance, made at `now`: its budget's period
 * starts, with nothing spent. */
static void allow_start(allowance *a, int64_t now) {
    int64_t end; /* (its period_end is set below) */
    if (a->has_budget) a->budget_anchor = now;
    allow_period(a, now, &a->period_start, &end);
    a->period_end = end;
}

/* A stored item's times: exact in the log, ISO 8601 in the API. */
static void stored_times_json(jwriter *w, int64_t created, int64_t updated, int for_log) {
    jw_key(w, "created_at");
    if (for_log) jw_int(w, created);
    else jw_time(w, created, 0);
    jw_key(w, "updated_at");
    if (for_log) jw_int(w, updated);
    else jw_time(w, updated, 0);
}

/* What every stored item's JSON opens with: id, the API's record_type, name. */
static void stored_json_open(jwriter *w, const stored *it, const char *record_type, int for_log) {
    jw_open(w, '{');
    jw_key(w, "id"), jw_cstr(w, it->id);
    if (!for_log) jw_key(w, "record_type"), jw_cstr(w, record_type);
    jw_key(w, "name"), jw_cstr(w, it->name);
}

/* A group as JSON: the API's shape, or the log's (exact integers, only
 * what cannot be derived). */
static void group_json(jwriter *w, const stored *it, int for_log) {
    const group *g = (const group *)it;
    stored_json_open(w, it, "token_group", for_log);
    jw_key(w, "allowed_models"), jw_open(w, '[');
    for (int i = 0; i < g->nallowed; i++) jw_cstr(w, g->allowed[i]);
    jw_close(w, ']');
    jw_key(w, "fallbacks"), jw_open(w, '{');
    for (int i = 0; i < g->nfb; i++) {
        jw_name(w, g->fb[i].model), jw_open(w, '[');
        for (int k = 0; k < g->fb[i].n; k++) jw_cstr(w, g->fb[i].to[k]);
        jw_close(w, ']');
    }
    jw_close(w, '}');
    jw_key(w, "retries");
    if (!g->has_retries) jw_null(w);
    else {
        jw_open(w, '{');
        jw_key(w, "max_attempts"), jw_int(w, g->retries.max_attempts);
        jw_key(w, "retry_delay_ms"), jw_int(w, g->retries.retry_delay_ms);
        jw_key(w, "backoff"), jw_cstr(w, backoff_names[g->retries.backoff]);
        jw_key(w, "request_timeout_ms");
        jw_int_or_null(w, g->retries.request_timeout_ms != 0, g->retries.request_timeout_ms);
        if (g->retries.deadline_ms) {
            /* absent: the default */
            jw_key(w, "deadline_ms"), jw_int(w, g->retries.deadline_ms);
        }
        jw_close(w, '}');
    }
    allow_json(w, &g->s.al);
    jw_key(w, "cache_ttl"), jw_int_or_null(w, g->cache_ttl != UNSET, g->cache_ttl);
    jw_key(w, "max_parallel_requests");
    jw_int_or_null(w, g->max_parallel != UNSET, g->max_parallel);
    jw_key(w, "blocked"), jw_bool(w, g->s.blocked);
    jw_key(w, "version"), jw_int(w, g->s.version);
    stored_times_json(w, g->s.created_at, g->s.updated_at, for_log);
    allow_state_json(w, &g->s.al, for_log, 1);
    jw_close(w, '}');
}

static group *group_find(const char *id) {
    return strlen(id) == 36 ? hmap_get(&ST.groups, id, 36) : NULL;
}

/* ---- token keys ---- */

static void tkey_free(stored *it) {
    if (!it) return;
    free(it->name);
    free(it->al.rl);
    free(it);
}

static stored *tkey_new(void) {
    tkey *k = xcalloc(1, sizeof *k);
    k->s.al.rpm_limit = UNSET;
    k->s.al.tpm_limit = UNSET;
    return &k->s;
}

static stored *tkey_clone(const stored *src) {
    tkey *k = xmalloc(sizeof *k);
    *k = *(const tkey *)src;
    stored_clone(&k->s, src);
    return &k->s;
}

/* Lay the members of JSON object `obj` over k, as group_parse() does for
 * a group: name, token_group_id (not in PARSE_PATCH: a key stays in its
 * group), blocked and the allowance; PARSE_LOG also what only the log
 * knows (id, sha256, version, times, the budget's anchor). */
static int tkey_parse(const char *s, const json_tok *t, int obj, stored *it, int mode, verr *e) {
    tkey *k = (tkey *)it;
    int hashed = 0;
    if (t[obj].type != JSON_OBJECT)
        return verr_at(e, NULL, NULL,
                       "the body must be a JSON object: {\"name\": ..., \"token_group_id\": ...}");
    if (no_duplicate_keys(s, t, obj, NULL, e) < 0) return LTG_ERR;
    int i = obj + 1, r;
    for (int m = 0; m < t[obj].size; m++, i = t[i + 1].next) {
        int v = i + 1;
        char key[128];
        snprintf(key, sizeof key, "%.*s",
                 (int)(t[i].end - t[i].start < 100 ? t[i].end - t[i].start : 100), s + t[i].start);
        if (mode == PARSE_LOG &&
            parse_log_common(s, t, i, k->s.id, &k->s.version, &k->s.created_at, &k->s.updated_at)) {
            /* what only the log knows */
        } else if (mode == PARSE_LOG && json_eq(s, t, i, "sha256")) {
            if (t[v].end - t[v].start != 64 || hex_decode(s + t[v].start, 64, k->hash) < 0)
                return verr_at(e, key, NULL, "must be 64 hex digits");
            hashed = 1;
        } else if ((r = allow_parse(s, t, i, &k->s.al, mode, e)) != 0) {
            if (r < 0) return LTG_ERR;
        } else if (json_eq(s, t, i, "name")) {
            if (parse_name(s, t, v, &k->s.name, e) < 0) return LTG_ERR;
        } else if (json_eq(s, t, i, "token_group_id") && mode != PARSE_PATCH) {
            if (!is_uuid(s, t, v)) return verr_at(e, key, NULL, "must be the id of a token group");
            memcpy(k->group_id, s + t[v].start, 36);
            k->group_id[36] = 0;
        } else if (json_eq(s, t, i, "token_group_id")) {
            return verr_at(e, key, NULL,
                           "cannot change: a key stays in its group (create a key in the other "
                           "group, then revoke this one)");
        } else if (json_eq(s, t, i, "blocked")) {
            if (parse_bool(s, t, v, &k->s.blocked, e) < 0) return LTG_ERR;
        } else {
            return field_refused(s, t, i, key,
                                 "a token key has name, token_group_id, max_budget, "
                                 "budget_duration, rpm_limit, tpm_limit, blocked",
                                 e);
        }
    }
    if (mode == PARSE_LOG && (!k->group_id[0] || !hashed))
        return verr_at(e, NULL, NULL, "a logged key has its token_group_id and sha256");
    return 0;
}

/* The rules over a whole key (after a PATCH: the merged result). */
static int tkey_validate(const stored *it, const catalog *cat, verr *e) {
    const tkey *k = (const tkey *)it;
    (void)cat;
    if (!k->s.name)
        return verr_at(e, "name", NULL, "is required: a string of 1 to %d bytes, without NUL",
                       NAME_MAX_LEN);
    if (!k->group_id[0])
        return verr_at(e, "token_group_id", NULL, "is required: the id of a token group");
    if (!group_find(k->group_id))
        return verr_at(e, "token_group_id", NULL, "no token group has this id");
    return allow_validate(&k->s.al, e);
}

static void tkey_json(jwriter *w, const stored *it, int for_log) {
    const tkey *k = (const tkey *)it;
    char hex[65];
    stored_json_open(w, it, "token_key", for_log);
    jw_key(w, "token_group_id"), jw_cstr(w, k->group_id);
    allow_json(w, &k->s.al);
    jw_key(w, "blocked"), jw_bool(w, k->s.blocked);
    jw_key(w, "version"), jw_int(w, k->s.version);
    if (for_log) {
        hex_encode(k->hash, 32, hex);
        jw_key(w, "sha256"), jw_cstr(w, hex);
    }
    stored_times_json(w, k->s.created_at, k->s.updated_at, for_log);
    allow_state_json(w, &k->s.al, for_log, k->s.al.has_budget);
    jw_close(w, '}');
}

static tkey *tkey_find(const char *id) {
    return strlen(id) == 36 ? hmap_get(&ST.keys, id, 36) : NULL;
}

/* A new key's secret: "ltg_sk_" and 256 random bits as 43 base64url
 * characters. Only its SHA-256 is kept. */
static void tkey_secret(stored *it, char out[64]) {
    static const char b64url[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    uint8_t raw[32];
    os_random(raw, sizeof raw);
    memcpy(out, "ltg_sk_", 8);
    for (int b = 0, o = 7; b < 256; b += 6) {
        int byte = b / 8, shift = b % 8;
        unsigned v = (unsigned)raw[byte] << 8 | (byte + 1 < 32 ? raw[byte + 1] : 0);
        out[o++] = b64url[(v >> (10 - shift)) & 63];
        out[o] = 0;
    }
    sha256(out, strlen(out), ((tkey *)it)->hash);
    memset(raw, 0, sizeof raw);
}

static const char *tkey_group(const stored *it) { return ((const tkey *)it)->group_id; }

/* ---- the kinds: a row each ---- */

/* What the store, the log and the control plane know of a kind of item, in
 * one row (Redis's command table): the handlers of section 16, the log's
 * replay and the snapshot work through it, whatever the kind. */
typedef struct store_kind {
    const char *noun;                      /* "token group": in messages */
    const char *put_op, *del_op;           /* the state log's operations */
    /* the ledger names its items by this letter and their id */
    char ledger;
    hmap *ids;                             /* by id */
    vec *all;                              /* in creation order */
    stored *(*make)(void);                 /* an empty item with its defaults */
    stored *(*clone)(const stored *it);    /* the copy a change is made on */
    void (*drop)(stored *it);
    int (*parse)(const char *s, const json_tok *t, int obj, stored *it, int mode, verr *e);
    /* the rules over a whole item */
    int (*validate)(const stored *it, const catalog *cat, verr *e);
    void (*json)(jwriter *w, const stored *it, int for_log);
    /* it is in the store, in place of old (or NULL): what else to do */
    void (*placed)(stored *it, stored *old);
    void (*forget)(stored *it);            /* it leaves the store: what else to do */
    void (*secret)(stored *it, char out[64]); /* made at creation, shown in that answer only */
    /* a list's query parameter: only the items of this parent */
    const char *filter;
    const char *(*parent)(const stored *it);
} store_kind;

static void group_placed(stored *it, stored *old) {
    if (old) ((group *)it)->inflight = ((group *)old)->inflight;
    if (old) ((group *)it)->meters = ((group *)old)->meters;
}

static void group_forget(stored *it);

static void tkey_placed(stored *it, stored *old) {
    (void)old;
    hmap_put(&ST.keys_by_hash, it); /* the same secret as old's: replaces it */
}

static void tkey_forget(stored *it) { hmap_del(&ST.keys_by_hash, ((tkey *)it)->hash, 32); }

static const store_kind GROUPS = {
    "token group", "put_group", "del_group", 'g', &ST.groups, &ST.gv, group_new, group_clone, group_free,
    group_parse, group_validate, group_json, group_placed, group_forget, NULL, NULL, NULL,
};
static const store_kind KEYS = {
    "token key", "put_key", "del_key", 'k', &ST.keys, &ST.kv, tkey_new, tkey_clone, tkey_free,
    tkey_parse, tkey_validate, tkey_json, tkey_placed, tkey_forget, tkey_secret, "token_group_id", tkey_group,
};
static const store_kind *const KINDS[] = {&GROUPS, &KEYS};

static stored *store_find(const store_kind *K, const char *id) {
    return strlen(id) == 36 ? hmap_get(K->ids, id, 36) : NULL;
}

/* ---- applying changes (from a handler, or from the log at start-up) ---- */

/* `it` replaces the item with its id, if any: what memory alone knows --
 * the money its requests in flight hold, the last minute's rate window --
 * moves over (its spend came with it: see item_commit). */
static void store_put(const store_kind *K, stored *it, size_t rec_bytes) {
    stored *old = hmap_get(K->ids, it->id, 36);
    hmap_put(K->ids, it); /* replaces old: before old is freed, since the table compares ids */
    if (old) {
        it->al.reserved = old->al.reserved;
        it->al.rl = old->al.rl;
        old->al.rl = NULL;
        it->e.vi = old->e.vi;
        K->all->p[it->e.vi] = it;
        ST.live_bytes -= old->e.rec_bytes;
    } else {
        vec_add(K->all, it);
    }
    K->placed(it, old);
    if (old) K->drop(old);
    it->e.rec_bytes = rec_bytes;
    ST.live_bytes += rec_bytes;
}

static void store_del(const store_kind *K, const char *id) {
    stored *it = hmap_del(K->ids, id, 36);
    if (!it) return;
    K->forget(it);
    vec_del(K->all, it);
    ST.live_bytes -= it->e.rec_bytes;
    K->drop(it);
}

/* A group leaves with its keys (logs before this version also name each
 * key in a del_key op of the same record: by then it is gone). */
static void group_forget(stored *it) {
    int frozen = ST.frozen;
    metric_forget(M_SPEND, "token_group", it->name, NULL);
    metric_forget(M_RATE_LIMITED, "token_group", it->name, NULL);
    ST.frozen = 1; /* the walk below must not have the vector squeezed under it */
    for (int i = 0; i < ST.kv.n; i++) {
        tkey *k = ST.kv.p[i];
        if (k && strcmp(k->group_id, it->id) == 0) store_del(&KEYS, k->s.id);
    }
    ST.frozen = frozen;
    vec_squeeze(&ST.kv);
}

static void idem_free(idem *r) {
    if (r) {
        free(r->response);
        free(r);
    }
}

/* A record out of the table (replaced or expired) leaves the live state and memory. */
static void idem_forget(idem *r) {
    if (!r->inference) {
        vec_del(&ST.iv, r);
        ST.live_bytes -= r->e.rec_bytes;
    }
    idem_free(r);
}

/* r takes the place of any record with its key; a change's joins the live state with the size
 * of its log record. */
static void idem_put(idem *r, size_t rec_bytes) {
    idem *old = hmap_get(&ST.idems, r->key, 32);
    hmap_put(&ST.idems, r); /* replaces old: before old is freed */
    if (old) idem_forget(old);
    if (!r->inference) {
        vec_add(&ST.iv, r);
        r->e.rec_bytes = rec_bytes;
        ST.live_bytes += rec_bytes;
    }
}

static int cache_holds(const uint8_t key[32]);

/* A finished record that can no longer answer: expired, or its answer has left the cache. */
static int idem_gone(const idem *r, int64_t now) {
    return r->done && (r->expires <= now || (r->cached && !cache_holds(r->cache_key)));
}

/* The live record of `key` on one plane, or NULL (a gone one waits for store_purge). */
static idem *idem_find(const uint8_t key[32], int inference, int64_t now) {
    idem *r = hmap_get(&ST.idems, key, 32);
    return r && r->inference == inference && !idem_gone(r, now) ? r : NULL;
}

/* A gone record leaves the table, the live state and memory. */
static void idem_drop(idem *r) {
    hmap_del(&ST.idems, r->key, 32);
    if (!r->inference) ST.expired++;
    idem_forget(r);
}

/* What both planes' records write: key, body hash, status. */
static void idem_json_head(jwriter *w, const idem *r) {
    char hex[65];
    hex_encode(r->key, 32, hex);
    jw_key(w, "k"), jw_cstr(w, hex);
    hex_encode(r->body, 32, hex);
    jw_key(w, "b"), jw_cstr(w, hex);
    jw_key(w, "s"), jw_int(w, r->status);
}

/* ...and read back: 0, or LTG_ERR. */
static int idem_parse_head(const char *p, const json_tok *t, int iv, idem *r) {
    int k = json_get(p, t, iv, "k"), b = json_get(p, t, iv, "b");
    long long st;
    if (k < 0 || b < 0 || t[k].end - t[k].start != 64 || t[b].end - t[b].start != 64 ||
        hex_decode(p + t[k].start, 64, r->key) < 0 || hex_decode(p + t[b].start, 64, r->body) < 0 ||
        json_int(p, t, json_get(p, t, iv, "s"), &st) < 0 || st < 0 || st > 999)
        return LTG_ERR;
    r->status = (int)st;
    r->done = 1;
    return 0;
}

/* A change's record, in its log record. */
static void idem_json(jwriter *w, const idem *r) {
    jw_open(w, '{');
    idem_json_head(w, r);
    jw_key(w, "v"), jw_int(w, r->version);
    jw_key(w, "r"), jw_cstr(w, r->response);
    jw_key(w, "x"), jw_int(w, r->expires);
    jw_close(w, '}');
}

/* The idempotency record of a change, unless it has expired: 0, or LTG_ERR. */
static int store_apply_idem(const char *p, const json_tok *t, int iv, size_t n) {
    idem head = {0};
    int r = json_get(p, t, iv, "r");
    long long ver, x;
    if (idem_parse_head(p, t, iv, &head) < 0 || r < 0 ||
        json_int(p, t, json_get(p, t, iv, "v"), &ver) < 0 ||
        json_int(p, t, json_get(p, t, iv, "x"), &x) < 0)
        return LTG_ERR;
    if (x <= wall_ms()) { ST.expired++; return 0; } /* garbage the next compaction leaves out */
    idem *rec = xmalloc(sizeof *rec);
    *rec = head;
    rec->version = ver;
    rec->expires = x;
    rec->response = json_strdup(p, t, r);
    idem_put(rec, n + 8);
    return 0;
}

/* Apply one log record's payload (section 13 calls this for every record
 * at start-up): {"ops":[{op: value}...], "idem": {...}}. Returns 0, or
 * LTG_ERR with a reason in err. */
static int store_apply(void *ctx, const char *p, size_t n, off_t at, char *err, size_t errlen) {
    (void)ctx;
    (void)at;
    int max = (int)(n / 2 + 4), rc = LTG_ERR;
    json_tok *t = xcalloc((size_t)max, sizeof *t);
    json_result res;
    verr e = {0};
    if (json_parse(p, n, t, max, -1, &res) < 0) {
        snprintf(err, errlen, "not JSON: %s at byte %zu", res.err, res.err_offset);
        goto done;
    }
    int ops = json_get(p, t, 0, "ops"), iv = json_get(p, t, 0, "idem"), o = ops + 1;
    cl_note_sid(p, t); /* a record of the shared stream carries its id (section 21) */
    if (ops < 0 || t[ops].type != JSON_ARRAY) {
        snprintf(err, errlen, "no \"ops\" list");
        goto done;
    }
    for (int k = 0; k < t[ops].size; k++, o = t[o].next) {
        int name = o + 1, v = o + 2; /* an op is an object of one member */
        char id[37];
        if (t[o].type != JSON_OBJECT || t[o].size != 1) {
            snprintf(err, errlen, "unknown operation");
            goto done;
        }
        const store_kind *K = NULL;
        int put = 0;
        for (size_t r = 0; r < sizeof KINDS / sizeof *KINDS; r++) {
            if (json_eq(p, t, name, KINDS[r]->put_op)) {
                K = KINDS[r];
                put = 1;
            }
            if (json_eq(p, t, name, KINDS[r]->del_op)) K = KINDS[r];
        }
        if (!K || (!put && !is_uuid(p, t, v))) {
            snprintf(err, errlen, "unknown operation");
            goto done;
        }
        if (!put) {
            memcpy(id, p + t[v].start, 36);
            id[36] = 0;
            store_del(K, id);
            continue;
        }
        stored *it = K->make();
        if (K->parse(p, t, v, it, PARSE_LOG, &e) < 0 || !it->id[0] || !it->name || !it->version) {
            snprintf(err, errlen, "bad %s: %.60s %.100s", K->noun, e.pointer, e.detail);
            K->drop(it);
            goto done;
        }
        store_put(K, it, n + 8);
    }
    if (iv >= 0 && store_apply_idem(p, t, iv, n) < 0) {
        snprintf(err, errlen, "bad idempotency record");
        goto done;
    }
    rc = 0;
done:
    free(t);
    return rc;
}

/* ===== 13. The append-only log =====
 *
 * IMPLEMENTATION NOTES
 * Two kinds of file share this code: DATA/state.log (groups, keys,
 * idempotency records; here) and the ledger's daily segments
 * (DATA/ledger/YYYY-MM-DD.log, section 14). Every acknowledged change is
 * one record in state.log, written and fsynced before the answer leaves
 * (Redis's appendfsync always); spend events are written at the end of
 * each loop turn and fsynced within 20 ms (Redis's everysec, tighter), by
 * the kernel beside the loop ("fsync off the loop" below). A
 * file opens with an 8-byte magic of its kind; a record is
 *
 *     [length: 4 bytes LE][CRC-32 of the payload: 4 bytes LE][payload]
 *
 * and the payload is JSON in state.log ({"ops":[...], "idem":{...}},
 * store_apply) and a small binary head plus JSON in the ledger (section 14).
 *
 * Replay at start-up streams the file through a buffer that holds one
 * record at a time (a mebibyte, more for a larger record): no file is ever
 * read whole, so replaying costs the memory of the state it rebuilds, not
 * of the file. A crash mid-write can only damage the end of the file, so a
 * last record that is cut short or fails its checksum is a torn write: the
 * file is truncated back to the last whole record, with a warning. A bad
 * record with whole records after it is not a torn write but damage, and
 * start-up stops with the file and offset: ltg will not guess which of your
 * changes to drop.
 *
 * Records stay in memory (`pending`) until they are fsynced. A failed write
 * or fsync (a full disk, an I/O error) cuts the file back to what is known
 * to be on disk and keeps the records: the next log_sync() writes them
 * again, so when space returns nothing is lost and nothing needs a restart.
 * After a failed fsync the kernel may have dropped the dirty pages
 * (PostgreSQL's "fsyncgate"), which is why the retry rewrites from ltg's own
 * copy rather than fsyncing again. A synchronous append (the state log's)
 * that fails is refused and leaves memory with its record: the change was
 * never made. While a file is failing, its owner refuses what it cannot
 * record (503 storage_unavailable).
 *
 * Compaction: when the file grows past twice what the live state needs (and
 * past 1 MiB), or when it holds idempotency records that expired and the
 * last compaction is an hour old, a snapshot is written to state.log.tmp a
 * few hundred items per loop turn, so the loop never stops for long.
 * Changes made meanwhile go to the old file as usual and are also kept
 * aside; when the snapshot is complete they are appended to it, the new
 * file is fsynced and renamed over the old one, and the directory is
 * fsynced. A crash at any point leaves either the old file or the new one,
 * each complete.
 */
#define LOG_MAGIC "LTGLOG1\n"
#define LOG_MAX_RECORD (64u << 20)
#define LOG_READ_CHUNK (1 << 20)          /* replay reads this much at a time */
#define COMPACT_MIN_BYTES (1 << 20)
#define COMPACT_STEP 500                  /* items per loop turn */
#define COMPACT_EXPIRED_MS (3600 * 1000)  /* expired idempotency records wait at most this long */

typedef struct {
    char path[256], dir[256];
    const char *magic;        /* the file's first 8 bytes */
    int fd;                   /* -1 until the file is open (log_write creates it) */
    off_t durable;            /* bytes written and fsynced */
    off_t size;               /* durable + pending: where the next record lands */
    buf pending;              /* records not yet fsynced, kept until they are */
    size_t written;           /* of those, bytes already written */
    size_t syncing;           /* of those, bytes an fsync in flight covers (log_sync_start) */
    double sync_t0;           /* when that fsync began */
    int failing;              /* the last write or fsync failed: log_sync() tries again */
    char why[320];            /* what failed, for the operator and for a 503 */
} logfile;

static logfile *cl_outbox_file(void); /* section 21's outbox, written with the ledger */

static struct {
    logfile f;                /* DATA/state.log */
    char tmp[256];
    /* compaction in progress: */
    int compacting, tmp_fd;
    off_t tmp_size;
    int gi, gend, ki, kend, ii, iend;
    buf tail;                 /* records appended while the snapshot is written */
    off_t retry_at;           /* after a failed compaction: not before the log reaches this */
    int64_t last_compaction;  /* wall ms: the last one's end, or start-up */
} LOG = {.f.fd = -1, .tmp_fd = -1};

/* Frame a payload as a record at the end of `out`. */
static void log_frame(buf *out, const char *payload, size_t n) {
    uint8_t h[8];
    put_le32(h, (uint32_t)n);
    put_le32(h + 4, crc32(payload, n));
    buf_append(out, h, 8);
    buf_append(out, payload, n);
}

static int write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return LTG_ERR;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return LTG_ERR;
    int r = fsync(fd);
    close(fd);
    return r;
}

/* A logfile for DIR/NAME, not open yet: the first write creates it. */
static void log_init(logfile *l, const char *dir, const char *name, const char *magic) {
    buf_free(&l->pending);
    *l = (logfile){.fd = -1, .magic = magic, .durable = 8, .size = 8};
    snprintf(l->dir, sizeof l->dir, "%.200s", dir);
    snprintf(l->path, sizeof l->path, "%.200s/%.40s", dir, name);
}

/* A write or fsync failed (errno `e`): say so once per episode. */
static int log_failed(logfile *l, const char *what, int e) {
    snprintf(l->why, sizeof l->why, "%s %s failed: %s", what, l->path, strerror(e));
    if (!l->failing)
        ltg_log("%s (retried; what cannot be recorded meanwhile is refused with 503)", l->why);
    l->failing = 1;
    return LTG_ERR;
}

/* Create the file with its magic, durably (file and directory fsynced). */
static int log_create(logfile *l) {
    int fd = open(l->path, O_RDWR | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
    if (fd < 0) return log_failed(l, "creating", errno);
    if (write_all(fd, l->magic, 8) < 0 || fsync(fd) < 0 || fsync_dir(l->dir) < 0) {
        int e = errno;
        close(fd);
        unlink(l->path);
        return log_failed(l, "creating", e);
    }
    l->fd = fd;
    l->durable = 8;
    return 0;
}

/* Write the pending records that are not written yet. After a failure the
 * file is first cut back to what was written before it. */
static int log_write(logfile *l) {
    if (l->written == l->pending.len && !l->failing) return 0;
    if (l->fd < 0 && log_create(l) < 0) return LTG_ERR;
    if (l->failing && ftruncate(l->fd, l->durable + (off_t)l->written) < 0)
        return log_failed(l, "cutting back", errno);
    if (write_all(l->fd, l->pending.p + l->written, l->pending.len - l->written) < 0) {
        int e = errno;
        if (ftruncate(l->fd, l->durable + (off_t)l->written) <
            0) { /* cut back again on the next try */
        }
        return log_failed(l, "writing", e);
    }
    l->written = l->pending.len;
    return 0;
}

/* The first n bytes of the pending records are durable: let them go. */
static void log_durable(logfile *l, size_t n) {
    l->durable += (off_t)n;
    buf_consume(&l->pending, n);
    l->written -= n;
    if (!l->pending.len && l->pending.cap > (1 << 20))
        buf_free(&l->pending); /* a backlog's memory is not kept */
    if (l->written < l->pending.len) return; /* a write failed since: still failing */
    if (l->failing) ltg_log("%s is written again", l->path);
    l->failing = 0;
}

/* An fsync failed: the file is cut back to what is durable, and every
 * pending record will be written again from ltg's own copy. */
static int log_unsynced(logfile *l, int e) {
    l->written = 0;
    if (ftruncate(l->fd, l->durable) < 0) { /* log_write cuts back first */ }
    return log_failed(l, "fsync of", e);
}

/* ---- fsync off the loop ----
 *
 * An fdatasync takes half a millisecond on a quiet disk and tens of them
 * on a busy one, and a request that arrives meanwhile waits for all of it.
 * Linux AIO runs IOCB_CMD_FDSYNC (Linux 4.18) in a kernel worker and
 * counts its end on an eventfd the loop polls, so the ledger's periodic
 * fsync costs the loop two system calls and no wait. The records stay
 * pending until it ends (log_synced), exactly as when ltg waits. Where AIO
 * is refused (an old kernel, a sandbox), log_sync() waits, as before.
 * The loop goes on writing each turn's records meanwhile, so a crash of
 * ltg itself still loses only the turn it dies in. */
#define AIO_MAX 8 /* fsyncs in flight: one per ledger day that is not sealed, the outbox */

static struct {
    aio_context_t ctx;
    int efd;      /* -1: no AIO, every fsync waits */
    int inflight; /* fsyncs running */
} AIO = {0, -1, 0};

static void log_synced(logfile *l, long res);

/* Take the fsyncs that ended; with `wait`, wait for one at least. */
static void aio_reap(int wait) {
    struct io_event ev[AIO_MAX];
    struct timespec zero = {0, 0};
    long n = syscall(SYS_io_getevents, AIO.ctx, wait ? 1 : 0, AIO_MAX, ev, wait ? NULL : &zero);
    for (long i = 0; i < n; i++) log_synced((logfile *)(uintptr_t)ev[i].data, (long)ev[i].res);
}

static void aio_ready(void *ctx, int revents) {
    (void)ctx;
    (void)revents;
    uint64_t count;
    if (read(AIO.efd, &count, sizeof count) == sizeof count) aio_reap(0);
}

/* AIO refused (`what` failed with errno): from now on every fsync waits. */
static void aio_off(const char *what) {
    ltg_log("no Linux AIO (%s: %s): the ledger's fsyncs wait on the loop", what, strerror(errno));
    if (AIO.efd >= 0) loop_close(AIO.efd);
    AIO.efd = -1;
}

/* At start-up: AIO if the kernel gives it. */
static void aio_start(void) {
    AIO.efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (AIO.efd >= 0) loop_watch(AIO.efd, POLLIN, aio_ready, NULL);
    if (AIO.efd < 0) aio_off("eventfd");
    else if (syscall(SYS_io_setup, AIO_MAX, &AIO.ctx) < 0) aio_off("io_setup");
}

/* Make the pending records durable: write them, fdatasync, and only then
 * let them go (an fsync already in flight is waited for first). A failed
 * fsync cuts the file back to what is durable; the records stay for the
 * next try. */
static int log_sync(logfile *l) {
    while (l->syncing) aio_reap(1);
    if (log_write(l) < 0) return LTG_ERR;
    if (!l->pending.len) return 0;
    double t0 = clock_s();
    int rc = fdatasync(l->fd);
    metric_observe(M_FSYNC, clock_s() - t0, NULL);
    if (rc < 0) return log_unsynced(l, errno);
    log_durable(l, l->pending.len);
    return 0;
}

/* The same without waiting: the records are written now and the kernel
 * fsyncs them; log_synced() lets them go. One fsync per file at a time
 * (l->syncing: a later one starts after it). */
static int log_sync_start(logfile *l) {
    if (l->syncing) return 0;
    if (AIO.efd < 0) return log_sync(l);
    if (log_write(l) < 0) return LTG_ERR;
    if (!l->pending.len) return 0;
    struct iocb cb = {.aio_data = (uintptr_t)l,
                      .aio_lio_opcode = IOCB_CMD_FDSYNC,
                      .aio_fildes = (uint32_t)l->fd,
                      .aio_flags = IOCB_FLAG_RESFD,
                      .aio_resfd = (uint32_t)AIO.efd};
    struct iocb *list[1] = {&cb};
    if (syscall(SYS_io_submit, AIO.ctx, 1, list) != 1) {
        /* a file system without it: no second try (once the others in flight are in) */
        if (!AIO.inflight) aio_off("io_submit");
        return log_sync(l);
    }
    AIO.inflight++;
    l->syncing = l->written;
    l->sync_t0 = clock_s();
    return 0;
}

/* An fsync started by log_sync_start ended with `res` (0, or -errno). */
static void log_synced(logfile *l, long res) {
    size_t n = l->syncing;
    l->syncing = 0;
    AIO.inflight--;
    metric_observe(M_FSYNC, clock_s() - l->sync_t0, NULL);
    if (res < 0) log_unsynced(l, (int)-res);
    else log_durable(l, n);
}

/* Append one record to l; with `sync`, make it durable before returning
 * (refused, it leaves memory too), otherwise it waits for log_sync() (the
 * ledger batches its events so: one write and one fsync for many). Returns
 * 0, or LTG_ERR with the reason in *why. */
static int log_append(logfile *l, const char *payload, size_t n, int sync, const char **why) {
    if (n > LOG_MAX_RECORD) { *why = "the record is too large to log"; return LTG_ERR; }
    log_frame(&l->pending, payload, n);
    l->size += (off_t)(n + 8);
    if (!sync || log_sync(l) == 0) return 0;
    assert(l->pending.len == n + 8); /* a synchronous log has no other pending record */
    l->pending.len = 0;
    l->size -= (off_t)(n + 8);
    l->written = 0;
    *why = l->why;
    /* cut back: whole again, the next change tries afresh */
    if (l->fd >= 0 && ftruncate(l->fd, l->durable) == 0) l->failing = 0;
    return LTG_ERR;
}

/* A change to the state log: durable before it is acknowledged, and kept
 * aside for a compaction in progress. */
static int state_append(const char *payload, size_t n, const char **why) {
    if (log_append(&LOG.f, payload, n, 1, why) < 0) return LTG_ERR;
    if (LOG.compacting) log_frame(&LOG.tail, payload, n);
    return 0;
}

typedef int log_apply_fn(void *ctx, const char *p, size_t n, off_t at, char *why, size_t whylen);

/* The bytes [at, at + n) of fd in b (whose first byte is file offset
 * *base), reading on when they are not there yet: NULL on a read error. */
static const uint8_t *log_bytes(int fd, buf *b, off_t *base, off_t at, size_t n) {
    if (at < *base || at + (off_t)n > *base + (off_t)b->len) {
        if (at >= *base && at <= *base + (off_t)b->len) buf_consume(b, (size_t)(at - *base));
        else b->len = 0;
        *base = at;
        while (b->len < n) {
            size_t want = n - b->len > LOG_READ_CHUNK ? n - b->len : LOG_READ_CHUNK;
            buf_reserve(b, want);
            ssize_t r = pread(fd, b->p + b->len, want, *base + (off_t)b->len);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) return NULL;
            b->len += (size_t)r;
        }
    }
    return (const uint8_t *)b->p + (at - *base);
}

/* Replay l's `end` bytes: apply(ctx, ...) gets every record's payload and
 * its offset in the file, from the record at `from` (0: the first; a
 * ledger day whose index file holds the first ones starts past them). A
 * torn last record is cut off; a damaged record before whole ones stops
 * start-up. Returns 0, or LTG_ERR with a message for the operator in err. */
static int log_replay(logfile *l, off_t end, off_t from, const char *name, log_apply_fn *apply,
                      void *ctx, char *err, size_t errlen) {
    int64_t t0 = clock_ms();
    off_t off = from > 8 ? from : 8, base = 0;
    size_t records = 0;
    buf b = {0};
    int fd = l->fd, rc = LTG_ERR;
    const uint8_t *h = log_bytes(fd, &b, &base, 0, 8);
    if (!h || memcmp(h, l->magic, 8) != 0) {
        snprintf(err, errlen, h ? "%s: not an ltg %s (bad magic at offset 0)" : "%s: %s", l->path,
                 h ? name : strerror(errno));
        goto done;
    }
    while (off < end) {
        off_t left = end - off;
        h = left >= 8 ? log_bytes(fd, &b, &base, off, 8) : NULL;
        uint32_t len = h ? get_le32(h) : 0;
        int torn = left < 8 || len > LOG_MAX_RECORD || (off_t)len > left - 8;
        const uint8_t *rec = torn ? NULL : log_bytes(fd, &b, &base, off, 8 + (size_t)len);
        if (!torn && !rec) { snprintf(err, errlen, "%s: %s", l->path, strerror(errno)); goto done; }
        int bad_sum = !torn && crc32(rec + 8, len) != get_le32(rec + 4);
        if (torn || (bad_sum && off + 8 + len == end)) {
            ltg_log("warning: %s: the last record (offset %lld) is torn, a crash mid-write: "
                    "truncating to %lld bytes",
                    l->path, (long long)off, (long long)off);
            if (ftruncate(fd, off) < 0 || fsync(fd) < 0) {
                snprintf(err, errlen, "%s: cannot truncate the torn record: %s", l->path,
                         strerror(errno));
                goto done;
            }
            break;
        }
        char why[200];
        if (bad_sum || apply(ctx, (const char *)rec + 8, len, off + 8, why, sizeof why) < 0) {
            snprintf(err, errlen,
                     "%s: damaged record at offset %lld (%.100s) with whole records after it: not "
                     "a torn write, so ltg will not drop it; restore the file from a backup",
                     l->path, (long long)off, bad_sum ? "checksum mismatch" : why);
            goto done;
        }
        off += 8 + (off_t)len;
        records++;
    }
    l->durable = l->size = off;
    rc = 0;
    ltg_log("%s: replayed %zu records in %lld ms", l->path, records, (long long)(clock_ms() - t0));
done:
    buf_free(&b);
    return rc;
}

/* Open (or create) DIR/NAME and replay it (log_replay). Returns 0, or
 * LTG_ERR with a message for the operator in err. */
static int log_open(logfile *l, const char *dir, const char *name, const char *magic, off_t from,
                    log_apply_fn *apply, void *ctx, char *err, size_t errlen) {
    if (strlen(dir) > 200) {
        snprintf(err, errlen, "--data: the path is longer than 200 bytes");
        return LTG_ERR;
    }
    log_init(l, dir, name, magic);
    int fd = open(l->path, O_RDWR | O_APPEND | O_CLOEXEC);
    struct stat st;
    if (fd < 0 && errno != ENOENT) {
        snprintf(err, errlen, "%s: %s", l->path, strerror(errno));
        return LTG_ERR;
    }
    if (fd < 0 || (fstat(fd, &st) == 0 && st.st_size < 8)) {
        /* new, or a crash while it was being created */
        if (fd >= 0) close(fd);
        if (log_create(l) < 0) {
            snprintf(err, errlen, "cannot initialise: %.300s", l->why);
            return LTG_ERR;
        }
        return 0;
    }
    l->fd = fd;
    return log_replay(l, st.st_size, from, name, apply, ctx, err, errlen);
}

/* The record that recreates one stored item (K NULL: an idempotency
 * record), for the snapshot. */
static void snapshot_item(buf *out, const store_kind *K, void *item) {
    buf p = {0};
    jwriter w;
    jw_init(&w, &p);
    jw_open(&w, '{');
    if (K) {
        jw_key(&w, "ops"), jw_open(&w, '['), jw_open(&w, '{'), jw_name(&w, K->put_op);
        K->json(&w, item, 1);
        jw_close(&w, '}'), jw_close(&w, ']');
    } else {
        jw_key(&w, "ops"), jw_open(&w, '['), jw_close(&w, ']');
        jw_key(&w, "idem");
        idem_json(&w, item);
    }
    jw_close(&w, '}');
    log_frame(out, p.p, p.len);
    buf_free(&p);
}

static void compact_abandon(const char *why) {
    ltg_log("compaction of %s abandoned: %s (the log stays as it was)", LOG.f.path, why);
    if (LOG.tmp_fd >= 0) close(LOG.tmp_fd);
    LOG.tmp_fd = -1;
    unlink(LOG.tmp);
    LOG.compacting = ST.frozen = 0;
    buf_free(&LOG.tail);
    LOG.retry_at = LOG.f.size * 2;
}

/* Garbage past the live state, or expired idempotency records an hour old. */
static int compact_due(int64_t now) {
    if (LOG.compacting || LOG.f.fd < 0 || LOG.f.failing || LOG.f.size <= COMPACT_MIN_BYTES ||
        LOG.f.size < LOG.retry_at)
        return 0;
    return (size_t)LOG.f.size > 2 * ST.live_bytes ||
           (ST.expired && now - LOG.last_compaction >= COMPACT_EXPIRED_MS);
}

static void compact_start(void) {
    LOG.tmp_fd = open(LOG.tmp, O_RDWR | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
    if (LOG.tmp_fd < 0) { compact_abandon(strerror(errno)); return; }
    buf head = {0}, sid = {0};
    buf_append(&head, LOG_MAGIC, 8);
    if (cl_applied()[0]) { /* where the shared stream is read from (section 21), kept */
        buf_printf(&sid, "{\"sid\":\"%s\",\"ops\":[]}", cl_applied());
        log_frame(&head, sid.p, sid.len);
    }
    int rc = write_all(LOG.tmp_fd, head.p, head.len);
    LOG.tmp_size = (off_t)head.len;
    buf_free(&head);
    buf_free(&sid);
    if (rc < 0) { compact_abandon(strerror(errno)); return; }
    LOG.compacting = ST.frozen = 1;
    LOG.gi = LOG.ki = LOG.ii = 0;
    /* items added later are in the tail */
    LOG.gend = ST.gv.n;
    LOG.kend = ST.kv.n;
    LOG.iend = ST.iv.n;
    ltg_log("compacting %s: %lld bytes for about %zu bytes of live state", LOG.f.path,
            (long long)LOG.f.size, ST.live_bytes);
}

/* One step of a compaction: a few hundred items, or the switch-over. */
static void compact_step(int64_t now) {
    buf out = {0};
    int budget = COMPACT_STEP;
    for (; LOG.gi < LOG.gend && budget; LOG.gi++)
        if (ST.gv.p[LOG.gi]) {
            snapshot_item(&out, &GROUPS, ST.gv.p[LOG.gi]);
            budget--;
        }
    for (; LOG.gi == LOG.gend && LOG.ki < LOG.kend && budget; LOG.ki++)
        if (ST.kv.p[LOG.ki]) {
            snapshot_item(&out, &KEYS, ST.kv.p[LOG.ki]);
            budget--;
        }
    for (; LOG.ki == LOG.kend && LOG.ii < LOG.iend && budget; LOG.ii++) {
        idem *r = ST.iv.p[LOG.ii];
        if (r && r->expires > now) {
            snapshot_item(&out, NULL, r);
            budget--;
        }
    }
    if (out.len && write_all(LOG.tmp_fd, out.p, out.len) < 0) {
        buf_free(&out);
        compact_abandon(strerror(errno));
        return;
    }
    LOG.tmp_size += (off_t)out.len;
    buf_free(&out);
    if (LOG.gi < LOG.gend || LOG.ki < LOG.kend || LOG.ii < LOG.iend) return;
    /* The snapshot is written: add what changed meanwhile, make it durable, switch. */
    if (write_all(LOG.tmp_fd, LOG.tail.p, LOG.tail.len) < 0 || fsync(LOG.tmp_fd) < 0) {
        compact_abandon(strerror(errno));
        return;
    }
    if (rename(LOG.tmp, LOG.f.path) < 0) { compact_abandon(strerror(errno)); return; }
    if (fsync_dir(LOG.f.dir) < 0)
        ltg_log("warning: fsync of %s failed: %s", LOG.f.dir, strerror(errno));
    off_t before = LOG.f.size;
    close(LOG.f.fd);
    LOG.f.fd = LOG.tmp_fd;
    LOG.tmp_fd = -1;
    LOG.f.durable = LOG.f.size = LOG.tmp_size + (off_t)LOG.tail.len;
    buf_free(&LOG.tail);
    LOG.compacting = ST.frozen = 0;
    LOG.retry_at = 0;
    LOG.last_compaction = now;
    ST.expired = 0;
    vec_squeeze(&ST.gv);
    vec_squeeze(&ST.kv);
    vec_squeeze(&ST.iv);
    ltg_log("compacted %s: %lld -> %lld bytes", LOG.f.path, (long long)before,
            (long long)LOG.f.size);
}

/* ===== 14. The ledger: daily segments, index files, retention, the chain =====
 *
 * IMPLEMENTATION NOTES
 * Every inference request that reached dispatch or the cache leaves one
 * spend event (README "The consumption ledger"), but a free one
 * (count_tokens). The ledger keeps them in one file per UTC day,
 * DATA/ledger/YYYY-MM-DD.log, framed like the state log (section 13). The
 * day's file is the open segment; when the day ends it is sealed, never to
 * be written again. Beside each log is its index file, YYYY-MM-DD.idx, a
 * sequence of chunks, each the index of the events that follow the last
 * chunk's. The open day indexes its newest events in memory; when they
 * would hold more than --ledger-index-mb (16 MiB: a few hundred thousand
 * events), they are appended to the index file as a chunk and memory
 * starts again; at midnight the rest becomes the last chunk. So memory
 * holds at most that much whatever the day or the history, and the rest
 * is read from disk with pread(): a few small reads for each chunk a
 * query touches.
 *
 *   OPEN --(the day ends)--> SEALING --(its last chunk written)--> SEALED
 *
 * A record's payload is a fixed binary head -- what the index needs: time,
 * charge, every token class, status, key, group, model -- then the
 * event's JSON as the API shows it, then, for an idempotent request, its
 * replay record. Replaying a day reads the heads and never parses the
 * JSON. The head of version 1 had no cache or reasoning counts: such
 * records still read, with those 0. ledger_add() writes only what
 * rec_decode() takes back, so ltg never refuses a ledger it wrote.
 *
 * The index in memory (ledger_mem) keeps 72 bytes per event in file order,
 * which is time order (created_at never goes back: a clock stepping
 * backwards is clamped), and for each key and group the positions of its
 * events, each with its time and the running sum of their charges (16
 * bytes). It counts what it allocates; before an event that could take it
 * past the limit, it is spilled. A chunk holds the same, laid out to be
 * read in place:
 *
 *   head       counts, the log bytes it covers, each section's place, CRCs
 *   offsets    each event's record in the log (and one past the last)
 *   names      its keys, groups and models, sorted (binary search),
 *              each with what its events charged
 *   positions  a key's events, and a group's, each with its time and the
 *              running sum of their charges (a budget period that starts
 *              mid-day needs what was spent after its start)
 *   rows       its rollups: usage per (group, model), and per model
 *   replays    the events that carry an idempotent answer
 *
 * It is written in the host's byte order (the head says which; another is
 * rebuilt). At start-up each chunk is checked whole against its CRCs and
 * against the one before it (the next events, the next log bytes); the
 * first that fails, and all after it, are cut off, and the log is
 * replayed from the last good chunk on: a crash mid-chunk, a missing or
 * damaged file, an older format all end as a rebuilt index. It is never
 * fsynced: it can always be made again (the records a chunk names are
 * fsynced before it is written). Every read from it is bounds-checked and
 * every event read back is checked against its own record's CRC, so a file
 * damaged while ltg runs gives wrong answers at worst, never a crash.
 * Queries read a day part by part, chunk after chunk, then memory.
 *
 * Retention: a sealed day older than --ledger-days is deleted (log and
 * index, logged with size and count). A budget period may not be longer
 * than the retention (group_validate), so deleting a day never takes
 * events of a current period -- but for a lifetime budget (or a retention
 * lowered under a period): what a group or key with a budget spent in that
 * day is first carried into its record in the state log (`carried`, the
 * period it belongs to, and the day it runs to), so its spend never
 * shrinks; a group without a budget shows only the days kept.
 *
 * The chain (--ledger-key-env; README "An auditable ledger"): a day begun
 * with a key is chained. Its log's first record is its link -- the head of
 * the chain it continues (the newest chained day's last event's chain, or
 * 32 zero bytes, the seed) -- and each of its events ends with its chain,
 * HMAC-SHA-256 of the chain before it and the record's own bytes up to it
 * (chain_of). So each day can be checked alone from its link, and the days
 * against each other (`ltg verify`, at the end of this section). A day is
 * chained from its first record or not at all: a key given mid-day chains
 * the next day on. The index file's chunks carry the day's link and its
 * head after them, so GET /spend/chain reads no log.
 *
 * A failed write or fsync keeps the events in memory (section 13) and
 * ledger_writable() says so: inference then refuses new requests with 503
 * before dispatch, since nothing may be served that cannot be metered, and
 * a timer retries every second until the disk takes them. So does a chunk
 * of today that cannot be written: its events stay in memory (past the
 * limit only by the requests already in flight), tried again every 10 s.
 */
#define SEG_MAGIC "LTGSEG1\n"
#define IDX_MAGIC "LTGIDX5\n"       /* 5: chunks that carry the chain (1-4 are rebuilt) */
#define LEDGER_V1_MAGIC "LTGLED1\n"      /* DATA/ledger.log of earlier versions, migrated once */
#define DAY_MS 86400000LL
#define LEDGER_SYNC_MS 20
#define LEDGER_RETRY_MS 1000             /* a failing ledger is retried this often */
#define IDX_RETRY_MS 10000               /* an index file that could not be written */
#define REC_HEAD_V1 104                  /* a record's head before the token classes */
#define REC_HEAD 120
#define REC_HEAD_V3 136                  /* ... and the stream id */
#define CHAIN_LEN 32                     /* an HMAC-SHA-256 */
#define LINK_LEN 48                      /* the record that begins a chained day */
#define IDX_ENDIAN 0x01020304u

enum { EV_SUCCEEDED, EV_FAILED, EV_PARTIAL, EV_ABANDONED };
static const char *const ev_status_names[] = {"succeeded", "failed", "partial", "abandoned"};
/* EVF_ESTIMATED: usage_status "estimated"; EVF_CHAINED: the record ends with its chain */
enum { EVF_CACHE_HIT = 1, EVF_REPLAY = 2, EVF_ESTIMATED = 4, EVF_CHAINED = 8 };

static void put_le64(uint8_t *p, uint64_t v) {
    put_le32(p, (uint32_t)v);
    put_le32(p + 4, (uint32_t)(v >> 32));
}
static uint64_t get_le64(const uint8_t *p) { return get_le32(p) | (uint64_t)get_le32(p + 4) << 32; }

/* ---- records ---- */

/* A spend event's record, decoded: pointers into its payload, which is
 *   [0] version 2   [1] status (EV_*)   [2] flags (EVF_*)   [3] model length
 *   [4] input tokens   [8] output tokens   [12] event JSON length   (u32 LE)
 *   [16] created_at, wall ms   [24] charged, micro-USD              (i64 LE)
 *   [32] key id   [68] group id   (36 bytes each)
 *   [104] cache read, cache write, 1-hour cache write, reasoning tokens (u32 LE)
 *   [120] the model alias, the event's JSON, the replay record's JSON
 * Version 1 (before the token classes) has no [104..120): its classes read
 * as 0, and everything else as version 2. Version 3 is an event of the
 * cluster's shared ledger (section 21): [120] its id in the stream
 * ltg:events (ms, then sequence; u64 LE), then the alias at [136]. A
 * chained record (EVF_CHAINED) ends with its chain: 32 bytes after the
 * replay record. */
typedef struct {
    int64_t at, charged;
    uint32_t tok[NTOK];
    uint8_t status, flags;
    const char *key, *group, *model, *event, *replay;
    size_t model_len, event_len, replay_len;
    uint64_t sid[2];            /* version 3: its stream id; {0, 0} otherwise */
    const uint8_t *chain;       /* EVF_CHAINED: its last CHAIN_LEN bytes; else NULL */
} rec_view;

/* Where each token class is in the head. */
static const uint8_t rec_class_at[NTOK] = {4, 104, 108, 112, 8, 116};

static void rec_encode(buf *out, const rec_view *v) {
    int v3 = v->sid[0] != 0;
    uint8_t h[REC_HEAD_V3] = {v3 ? 3 : 2, v->status, v->flags, (uint8_t)v->model_len};
    for (int k = 0; k < NTOK; k++) put_le32(h + rec_class_at[k], v->tok[k]);
    put_le32(h + 12, (uint32_t)v->event_len);
    put_le64(h + 16, (uint64_t)v->at);
    put_le64(h + 24, (uint64_t)v->charged);
    memcpy(h + 32, v->key, 36);
    memcpy(h + 68, v->group, 36);
    put_le64(h + 120, v->sid[0]);
    put_le64(h + 128, v->sid[1]);
    buf_append(out, h, v3 ? REC_HEAD_V3 : REC_HEAD);
    buf_append(out, v->model, v->model_len);
    buf_append(out, v->event, v->event_len);
    buf_append(out, v->replay, v->replay_len);
}

static int rec_decode(const char *p, size_t n, rec_view *v) {
    const uint8_t *h = (const uint8_t *)p;
    size_t head = n < 1 ? 1 : h[0] == 1 ? REC_HEAD_V1 : h[0] == 3 ? REC_HEAD_V3 : REC_HEAD;
    if (n < head || h[0] < 1 || h[0] > 3 || h[1] > EV_ABANDONED ||
        h[2] > (EVF_CACHE_HIT | EVF_REPLAY | EVF_ESTIMATED | EVF_CHAINED))
        return LTG_ERR;
    size_t tail = h[2] & EVF_CHAINED ? CHAIN_LEN : 0;
    *v = (rec_view){.at = (int64_t)get_le64(h + 16),
                    .charged = (int64_t)get_le64(h + 24),
                    .status = h[1],
                    .flags = h[2]};
    for (int k = 0; k < NTOK; k++)
        v->tok[k] = rec_class_at[k] + 4u <= head ? get_le32(h + rec_class_at[k]) : 0;
    if (h[0] == 3) v->sid[0] = get_le64(h + 120), v->sid[1] = get_le64(h + 128);
    v->model_len = h[3];
    v->event_len = get_le32(h + 12);
    if (head + v->model_len + v->event_len + tail > n) return LTG_ERR;
    v->key = p + 32;
    v->group = p + 68;
    v->model = p + head;
    v->event = v->model + v->model_len;
    v->replay = v->event + v->event_len;
    v->replay_len = n - head - v->model_len - v->event_len - tail;
    v->chain = tail ? h + n - CHAIN_LEN : NULL;
    for (int i = 32; i < 104; i++) /* two ids: hex digits and dashes */
        if (!isxdigit(h[i]) && h[i] != '-') return LTG_ERR;
    if (!v->model_len || memchr(v->model, 0, v->model_len) || v->charged < 0 ||
        v->charged > MAX_CHARGE)
        return LTG_ERR;
    return (v->flags & EVF_REPLAY) && !v->replay_len ? LTG_ERR : 0;
}

/* ---- the chain (README "An auditable ledger") ---- */

/* An event's chain: HMAC-SHA-256 (BearSSL's, on ltg's SHA-256: section 2),
 * under the ledger's key, of the chain before it and of its record's bytes
 * up to its own chain. */
static void chain_of(const br_hmac_key_context *key, const uint8_t prev[CHAIN_LEN], const void *p,
                     size_t n, uint8_t out[CHAIN_LEN]) {
    br_hmac_context h;
    br_hmac_init(&h, key, 0);
    br_hmac_update(&h, prev, CHAIN_LEN);
    br_hmac_update(&h, p, n);
    br_hmac_out(&h, out);
}

/* A chained day's first record, its link: [0] 0 (no event's version)
 * [8] the day whose chain it continues (its midnight, i64 LE; 0: none,
 * the seed) [16] that chain's head, or 32 zero bytes, the seed. */
static void link_encode(buf *out, int64_t day, const uint8_t head[CHAIN_LEN]) {
    uint8_t l[LINK_LEN] = {0};
    put_le64(l + 8, (uint64_t)day);
    memcpy(l + 16, head, CHAIN_LEN);
    buf_append(out, l, sizeof l);
}

static int link_decode(const char *p, size_t n, int64_t *day, uint8_t head[CHAIN_LEN]) {
    if (n != LINK_LEN || p[0] != 0) return LTG_ERR;
    *day = (int64_t)get_le64((const uint8_t *)p + 8);
    memcpy(head, p + 16, CHAIN_LEN);
    return 0;
}

/* ---- a day's index: the events in memory ---- */

typedef struct {
    int64_t at;                 /* created_at, wall ms */
    uint64_t off;               /* the record's payload in its segment's log */
    uint32_t len;
    uint32_t key, group, model; /* in the name table */
    uint32_t tok[NTOK];
    uint8_t status, flags;      /* EV_*, EVF_* */
    /* micro-USD charged to the group's budget (the cost is in the event) */
    int64_t charged;
} ledger_entry;

/* One event of a key or a group: its position, its time (ms after
 * midnight), and what that name's events charged up to it. */
typedef struct { uint32_t pos, ms; int64_t cum; } idx_gpos;

typedef struct {
    uint32_t idx;
    idx_gpos *pos;              /* a key's or group's events, in order */
    uint32_t npos, cap;
    char s[];                   /* 'k' key, 'g' group or 'm' model, then the id or alias */
} lname;

static const void *lname_key(const void *it, size_t *n) {
    *n = strlen(((const lname *)it)->s);
    return ((const lname *)it)->s;
}

typedef struct {
    int64_t day;                /* its midnight: positions' times are kept from it */
    ledger_entry *ix;
    uint32_t n, cap;
    uint32_t *rep, nrep, repcap; /* the events that carry an idempotent answer */
    lname **names;
    uint32_t nnames, names_cap;
    uint32_t pos_cap_max;       /* the largest name's `cap` */
    hmap by_name;
    size_t bytes;               /* what all of it allocated: at most --ledger-index-mb */
} ledger_mem;

/* elements of an index array's first allocation; each growth doubles it */
#define MEM_FIRST 16

/* Room for one more element after the n of array p (*cap of them, of `size` bytes each),
 * counted in *bytes. */
static void *mem_grow(void *p, uint32_t n, uint32_t *cap, size_t size, size_t *bytes) {
    if (n < *cap) return p;
    uint32_t more = *cap ? *cap : MEM_FIRST;
    *cap += more;
    *bytes += (size_t)more * size;
    return xrealloc(p, (size_t)*cap * size);
}

/* What mem_grow would add to that array. */
static size_t grow_bytes(uint32_t n, uint32_t cap, size_t size) {
    return n < cap ? 0 : (size_t)(cap ? cap : MEM_FIRST) * size;
}

/* The most indexing one more event can allocate: every array grows, the
 * key, group and model are all new names, and each of the two position
 * lists it joins is the largest. */
static size_t mem_worst(const ledger_mem *m) {
    size_t slots = (m->by_name.used + 3) * 4 > m->by_name.cap * 3
                           ? (m->by_name.cap ? m->by_name.cap : 64)
                           : 0;
    size_t names = 3 * (sizeof(lname) + ALIAS_MAX + 2) +
                   grow_bytes(m->nnames + 2, m->names_cap, sizeof(lname *)) +
                   slots * sizeof(void *);
    size_t lists = 2 * (size_t)(m->pos_cap_max > MEM_FIRST ? m->pos_cap_max : MEM_FIRST) *
                   sizeof(idx_gpos);
    return grow_bytes(m->n, m->cap, sizeof(ledger_entry)) +
           grow_bytes(m->nrep, m->repcap, sizeof *m->rep) + names + lists;
}

/* The index of name kind+s[0..n) in m, UINT32_MAX when absent. */
static uint32_t mem_find(const ledger_mem *m, char kind, const char *s, size_t n) {
    char k[ALIAS_MAX + 2];
    if (n > ALIAS_MAX) n = ALIAS_MAX;
    k[0] = kind;
    memcpy(k + 1, s, n);
    const lname *it = hmap_get(&m->by_name, k, n + 1);
    return it ? it->idx : UINT32_MAX;
}

/* The same, added when absent. */
static uint32_t mem_name(ledger_mem *m, char kind, const char *s, size_t n) {
    uint32_t i = mem_find(m, kind, s, n);
    if (i != UINT32_MAX) return i;
    if (n > ALIAS_MAX) n = ALIAS_MAX;
    lname *it = xcalloc(1, sizeof *it + n + 2);
    m->bytes += sizeof *it + n + 2;
    it->s[0] = kind;
    memcpy(it->s + 1, s, n);
    it->idx = m->nnames;
    m->names = mem_grow(m->names, m->nnames, &m->names_cap, sizeof *m->names, &m->bytes);
    m->names[m->nnames++] = it;
    size_t slots = m->by_name.cap;
    hmap_put(&m->by_name, it);
    m->bytes += (m->by_name.cap - slots) * sizeof(void *);
    return it->idx;
}

static void posting_add(ledger_mem *m, lname *it, const ledger_entry *e) {
    it->pos = mem_grow(it->pos, it->npos, &it->cap, sizeof *it->pos, &m->bytes);
    if (it->cap > m->pos_cap_max) m->pos_cap_max = it->cap;
    int64_t ms = e->at - m->day, cum = it->npos ? it->pos[it->npos - 1].cum : 0;
    idx_gpos g = {m->n, (uint32_t)(ms < 0 ? 0 : ms > DAY_MS ? DAY_MS : ms), cum + e->charged};
    it->pos[it->npos++] = g;
}

/* Index one record (its payload at file offset `off`). */
static void mem_add(ledger_mem *m, const rec_view *v, uint64_t off, uint32_t len) {
    ledger_entry e = {v->at,
                      off,
                      len,
                      mem_name(m, 'k', v->key, 36),
                      mem_name(m, 'g', v->group, 36),
                      mem_name(m, 'm', v->model, v->model_len),
                      {0},
                      v->status,
                      v->flags,
                      v->charged};
    memcpy(e.tok, v->tok, sizeof e.tok);
    /* file order is time order: the index's searches rely on it */
    assert(!m->n || e.at >= m->ix[m->n - 1].at);
    m->ix = mem_grow(m->ix, m->n, &m->cap, sizeof *m->ix, &m->bytes);
    posting_add(m, m->names[e.key], &e); /* filters need no scan */
    posting_add(m, m->names[e.group], &e);
    if (e.flags & EVF_REPLAY) {
        m->rep = mem_grow(m->rep, m->nrep, &m->repcap, sizeof *m->rep, &m->bytes);
        m->rep[m->nrep++] = m->n;
    }
    m->ix[m->n++] = e;
}

static void mem_free(ledger_mem *m) {
    for (uint32_t i = 0; i < m->nnames; i++) {
        free(m->names[i]->pos);
        free(m->names[i]);
    }
    free(m->ix);
    free(m->rep);
    free(m->names);
    free(m->by_name.slot);
    *m = (ledger_mem){.day = m->day, .by_name.key = lname_key};
}

/* ---- segments and their index files ---- */

typedef enum { SEG_OPEN, SEG_SEALING, SEG_SEALED } seg_state;

enum {
    SEC_OFFSETS, SEC_NAMES, SEC_STRINGS, SEC_KEYPOS, SEC_GROUPPOS, SEC_ROWS, SEC_MODELROWS,
    SEC_REPLAYS, NSEC
};

typedef struct {
    long long requests, succeeded, failed, partial, abandoned, cache_hits, tok[NTOK];
    int64_t spend, reserved;
} usage_row;

/* a name; its positions in KEYPOS or GROUPPOS; what its events charged */
typedef struct { uint32_t str, len, first, n; int64_t spent; } idx_name;
/* model: in NAMES; "" group: all */
typedef struct { char group[36]; uint32_t model; usage_row u; } idx_row;

static const size_t sec_elem[NSEC] = {
    8, sizeof(idx_name), 1, sizeof(idx_gpos), sizeof(idx_gpos), sizeof(idx_row), sizeof(idx_row), 4
};

/* The head of one chunk of an index file. */
typedef struct {
    char magic[8];
    uint32_t endian, nevents;
    uint32_t first;             /* the day's number of its first event */
    uint32_t chained;           /* the day is chained: its link, and the chain after this chunk */
    int64_t day, last_at;
    uint64_t log_from, log_to;  /* the log bytes its events' records fill */
    uint64_t end;               /* where in the file the chunk ends: the next one begins */
    uint64_t sec[NSEC][2];      /* each section's place in the file, and its length */
    uint8_t link[CHAIN_LEN], head[CHAIN_LEN];
    uint32_t crc;               /* of the chunk's bytes after its head */
    uint32_t head_crc;          /* of the head before this field */
} idx_header;

typedef struct {
    int64_t day;                /* its midnight, UTC wall ms */
    seg_state state;
    logfile f;                  /* OPEN, SEALING: its log, and the events not yet fsynced */
    idx_header *chunk;          /* the chunks of its index file, in order */
    uint32_t nchunk, chunk_cap;
    ledger_mem mem;             /* OPEN, SEALING: the events after the last chunk */
    /* a chunk could not be written: said once, tried again at retry_at */
    int idx_failing;
    int64_t retry_at;           /* (S.now) */
    /* a chained day: the head its link continues, and its newest chained event's chain */
    int chained;
    uint8_t link[CHAIN_LEN], head[CHAIN_LEN];
} segment;

static struct {
    char dir[256];              /* DATA/ledger */
    segment **seg;              /* the retained days, oldest first: the open one is last */
    int nseg, cap;
    /* the latest event's created_at: the ledger's time never goes back */
    int64_t last_at;
    int keyed;                  /* --ledger-key-env: new days are chained with this key */
    br_hmac_key_context key;
} LG;

static int64_t day_of(int64_t ms) { return ms - ((ms % DAY_MS) + DAY_MS) % DAY_MS; }

/* DIR/YYYY-MM-DD<ext>, or the bare name when dir is NULL. */
static void seg_path(int64_t day, const char *ext, const char *dir, char *out, size_t cap) {
    char d[64];
    iso_time(day, d);
    if (dir) snprintf(out, cap, "%.200s/%.10s%.8s", dir, d, ext);
    else snprintf(out, cap, "%.10s%.8s", d, ext);
}

static segment *seg_new(int64_t day) {
    segment *s = xcalloc(1, sizeof *s);
    char name[32];
    s->day = day;
    s->state = SEG_OPEN;
    s->mem = (ledger_mem){.day = day, .by_name.key = lname_key};
    seg_path(day, ".log", NULL, name, sizeof name);
    log_init(&s->f, LG.dir, name, SEG_MAGIC);
    int i = LG.nseg;
    if (LG.nseg == LG.cap) {
        LG.cap = LG.cap ? LG.cap * 2 : 32;
        LG.seg = xrealloc(LG.seg, (size_t)LG.cap * sizeof *LG.seg);
    }
    while (i > 0 && LG.seg[i - 1]->day > day) {
        LG.seg[i] = LG.seg[i - 1];
        i--;
    }
    LG.seg[i] = s;
    LG.nseg++;
    return s;
}

static void seg_free(segment *s) {
    buf_free(&s->f.pending);
    mem_free(&s->mem);
    free(s->chunk);
    free(s);
}

static segment *seg_open(void) {
    segment *s = LG.nseg ? LG.seg[LG.nseg - 1] : NULL;
    return s && s->state == SEG_OPEN ? s : NULL;
}

/* The events of s in its index file's chunks, and in all. */
static uint32_t seg_chunked(const segment *s) {
    return s->nchunk ? s->chunk[s->nchunk - 1].first + s->chunk[s->nchunk - 1].nevents : 0;
}
static uint32_t seg_count(const segment *s) { return seg_chunked(s) + s->mem.n; }

/* The time of s's last event (its midnight when it has none). */
static int64_t seg_last_at(const segment *s) {
    if (s->mem.n) return s->mem.ix[s->mem.n - 1].at;
    return s->nchunk ? s->chunk[s->nchunk - 1].last_at : s->day;
}

static void seg_index(segment *s, const rec_view *v, uint64_t off, uint32_t len);

/* Replay one record of a segment into its index (log_replay's callback).
 * Its time is kept within the day and after the event before it, as it
 * was written: the index relies on both. */
static int seg_apply(void *ctx, const char *p, size_t n, off_t at, char *why, size_t whylen) {
    segment *s = ctx;
    rec_view v;
    int64_t day;
    /* the first record (past the magic and its frame) may be the link of a chained day */
    if (at == 16 && link_decode(p, n, &day, s->link) == 0) {
        s->chained = 1;
        memcpy(s->head, s->link, CHAIN_LEN);
        return 0;
    }
    if (rec_decode(p, n, &v) < 0) {
        snprintf(why, whylen, "not a spend event record");
        return LTG_ERR;
    }
    int64_t first = seg_last_at(s);
    v.at = v.at < first ? first : v.at >= s->day + DAY_MS ? s->day + DAY_MS - 1 : v.at;
    seg_index(s, &v, (uint64_t)at, (uint32_t)n);
    if (v.chain && s->chained) memcpy(s->head, v.chain, CHAIN_LEN);
    return 0;
}

/* Element i (count of them) of section `sec` of chunk h of an index file
 * open as fd: 0, or LTG_ERR when out of bounds or unreadable. */
static int idx_read(const idx_header *h, int fd, int sec, uint64_t i, size_t count, void *out) {
    uint64_t n = h->sec[sec][1] / sec_elem[sec], bytes = count * sec_elem[sec];
    if (i > n || count > n - i) return LTG_ERR;
    return pread(fd, out, bytes, (off_t)(h->sec[sec][0] + i * sec_elem[sec])) == (ssize_t)bytes
                   ? 0
                   : LTG_ERR;
}

/* One more chunk of s's index file, its head kept in memory. */
static void seg_add_chunk(segment *s, const idx_header *h) {
    if (s->nchunk == s->chunk_cap) {
        s->chunk_cap = s->chunk_cap ? s->chunk_cap * 2 : 4;
        s->chunk = xrealloc(s->chunk, s->chunk_cap * sizeof *s->chunk);
    }
    s->chunk[s->nchunk++] = *h;
    s->chained = (int)h->chained;
    memcpy(s->link, h->link, CHAIN_LEN);
    memcpy(s->head, h->head, CHAIN_LEN);
}

/* Writes an index file through a buffer, summing its CRC. */
typedef struct {
    int fd, err;
    buf b;
    uint64_t off;
    uint32_t crc;
} idx_out;

static void io_put(idx_out *o, const void *p, size_t n) {
    o->crc = crc32_more(o->crc, p, n);
    buf_append(&o->b, p, n);
    o->off += n;
    if (o->b.len < (1 << 20)) return;
    if (!o->err && write_all(o->fd, o->b.p, o->b.len) < 0) o->err = errno;
    o->b.len = 0;
}

static void io_begin(idx_out *o, idx_header *h, int sec) { h->sec[sec][0] = o->off; }
static void io_end(idx_out *o, idx_header *h, int sec) { h->sec[sec][1] = o->off - h->sec[sec][0]; }

static const ledger_mem *sort_mem; /* for the comparators: qsort has no context */

static int name_cmp(const void *a, const void *b) {
    return strcmp(sort_mem->names[*(const uint32_t *)a]->s,
                  sort_mem->names[*(const uint32_t *)b]->s);
}

static int row_cmp(const void *a, const void *b) {
    const idx_row *x = a, *y = b;
    int c = memcmp(x->group, y->group, 36);
    return c ? c : (x->model > y->model) - (x->model < y->model);
}

static void usage_add(usage_row *r, const ledger_entry *e) {
    r->requests++;
    r->succeeded += e->status == EV_SUCCEEDED;
    r->failed += e->status == EV_FAILED;
    r->partial += e->status == EV_PARTIAL;
    r->abandoned += e->status == EV_ABANDONED;
    r->cache_hits += (e->flags & EVF_CACHE_HIT) != 0;
    for (int k = 0; k < NTOK; k++) r->tok[k] += e->tok[k];
    r->spend += e->charged;
}

static void usage_sum(usage_row *r, const usage_row *x) {
    r->requests += x->requests;
    r->succeeded += x->succeeded;
    r->failed += x->failed;
    r->partial += x->partial;
    r->abandoned += x->abandoned;
    r->cache_hits += x->cache_hits;
    for (int k = 0; k < NTOK; k++) r->tok[k] += x->tok[k];
    r->spend += x->spend;
}

/* The rollups of a chunk: one row per (group, model) in `rows`, sorted,
 * and one per model (group "") in `models`. Models are named by their
 * rank in the sorted name table. A group's events are its position list,
 * so the rows are made group by group, a model's row found through
 * last[model]: the row it had in the group being walked, if any. */
static void idx_rollups(const ledger_mem *m, const uint32_t *rank, buf *rows, buf *models) {
    usage_row *per_model = xcalloc(m->nnames, sizeof *per_model);
    size_t *last = xcalloc(m->nnames, sizeof *last); /* row index + 1 */
    for (uint32_t g = 0; g < m->nnames; g++) {
        const lname *gn = m->names[g];
        size_t first = rows->len / sizeof(idx_row);
        for (uint32_t k = 0; gn->s[0] == 'g' && k < gn->npos; k++) {
            const ledger_entry *e = &m->ix[gn->pos[k].pos];
            if (last[e->model] <= first) { /* the model's first event in this group: a new row */
                idx_row r = {{0}, rank[e->model], {0}};
                memcpy(r.group, gn->s + 1, 36);
                buf_append(rows, &r, sizeof r);
                last[e->model] = rows->len / sizeof(idx_row);
            }
            usage_add(&((idx_row *)(void *)rows->p)[last[e->model] - 1].u, e);
            usage_add(&per_model[e->model], e);
        }
    }
    if (rows->len) qsort(rows->p, rows->len / sizeof(idx_row), sizeof(idx_row), row_cmp);
    for (uint32_t k = 0; k < m->nnames; k++)
        if (per_model[k].requests) {
            idx_row r = {{0}, rank[k], per_model[k]};
            buf_append(models, &r, sizeof r);
        }
    free(per_model);
    free(last);
}

/* The names of a chunk, sorted (order: their indexes in sorted order,
 * rank: the inverse), their strings, and each key's and group's
 * positions: in memory already as the file keeps them. */
static void idx_names(idx_out *o, idx_header *h, const ledger_mem *m, uint32_t *order,
                      uint32_t *rank) {
    for (uint32_t i = 0; i < m->nnames; i++) order[i] = i;
    sort_mem = m;
    if (m->nnames) qsort(order, m->nnames, sizeof *order, name_cmp);
    for (uint32_t r = 0; r < m->nnames; r++) rank[order[r]] = r;
    uint32_t str = 0, kfirst = 0, gfirst = 0;
    io_begin(o, h, SEC_NAMES);
    for (uint32_t r = 0; r < m->nnames; r++) {
        const lname *nm = m->names[order[r]];
        idx_name d = {str, (uint32_t)strlen(nm->s), nm->s[0] == 'k' ? kfirst : gfirst, nm->npos,
                      nm->npos ? nm->pos[nm->npos - 1].cum : 0};
        if (nm->s[0] == 'k') kfirst += nm->npos;
        else if (nm->s[0] == 'g') gfirst += nm->npos;
        str += d.len;
        io_put(o, &d, sizeof d);
    }
    io_end(o, h, SEC_NAMES);
    io_begin(o, h, SEC_STRINGS);
    for (uint32_t r = 0; r < m->nnames; r++)
        io_put(o, m->names[order[r]]->s, strlen(m->names[order[r]]->s));
    io_end(o, h, SEC_STRINGS);
    for (int sec = SEC_KEYPOS; sec <= SEC_GROUPPOS; sec++) { /* keys' positions, then groups' */
        io_begin(o, h, sec);
        for (uint32_t r = 0; r < m->nnames; r++) {
            const lname *nm = m->names[order[r]];
            if (nm->s[0] == (sec == SEC_KEYPOS ? 'k' : 'g'))
                io_put(o, nm->pos, nm->npos * sizeof *nm->pos);
        }
        io_end(o, h, sec);
    }
}

/* Append s's events in memory to its index file as a chunk (see the notes
 * above), written where the last chunk ends; their records must be
 * durable. 0, or LTG_ERR with errno set (a chunk half written is cut off,
 * or written over by the next try). */
static int idx_write(segment *s) {
    const ledger_mem *m = &s->mem;
    char path[300];
    seg_path(s->day, ".idx", LG.dir, path, sizeof path);
    uint64_t at = s->nchunk ? s->chunk[s->nchunk - 1].end : 0;
    idx_header h = {.endian = IDX_ENDIAN,
                    .nevents = m->n,
                    .first = seg_chunked(s),
                    .day = s->day,
                    .last_at = seg_last_at(s),
                    .chained = (uint32_t)s->chained};
    memcpy(h.magic, IDX_MAGIC, 8);
    memcpy(h.link, s->link, CHAIN_LEN);
    memcpy(h.head, s->head, CHAIN_LEN);
    h.log_from = s->nchunk ? s->chunk[s->nchunk - 1].log_to : 8;
    h.log_to = m->n ? m->ix[m->n - 1].off + m->ix[m->n - 1].len : h.log_from;
    idx_out o = {.fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | (at ? 0 : O_TRUNC), 0600),
                 .off = at + sizeof h};
    if (o.fd < 0) return LTG_ERR;
    if (lseek(o.fd, (off_t)o.off, SEEK_SET) < 0) o.err = errno;
    io_begin(&o, &h, SEC_OFFSETS);
    for (size_t i = 0; i <= m->n; i++) {
        /* one past the last: every record's length is a difference */
        uint64_t off = i < m->n ? m->ix[i].off : h.log_to + 8;
        io_put(&o, &off, 8);
    }
    io_end(&o, &h, SEC_OFFSETS);
    uint32_t *order = xcalloc(m->nnames, sizeof *order), *rank = xcalloc(m->nnames, sizeof *rank);
    idx_names(&o, &h, m, order, rank);
    buf rows = {0}, models = {0};
    idx_rollups(m, rank, &rows, &models);
    io_begin(&o, &h, SEC_ROWS);
    io_put(&o, rows.p, rows.len);
    io_end(&o, &h, SEC_ROWS);
    io_begin(&o, &h, SEC_MODELROWS);
    io_put(&o, models.p, models.len);
    io_end(&o, &h, SEC_MODELROWS);
    buf_free(&rows);
    buf_free(&models);
    free(order);
    free(rank);
    io_begin(&o, &h, SEC_REPLAYS);
    io_put(&o, m->rep, m->nrep * sizeof *m->rep);
    io_end(&o, &h, SEC_REPLAYS);
    if (!o.err && write_all(o.fd, o.b.p, o.b.len) < 0) o.err = errno;
    buf_free(&o.b);
    h.end = o.off;
    h.crc = o.crc;
    h.head_crc = crc32(&h, offsetof(idx_header, head_crc));
    if (!o.err && pwrite(o.fd, &h, sizeof h, (off_t)at) != (ssize_t)sizeof h)
        o.err = errno ? errno : EIO;
    if (o.err && ftruncate(o.fd, (off_t)at) < 0) { /* the next start cuts it */ }
    if (close(o.fd) < 0 && !o.err) o.err = errno;
    if (o.err) { errno = o.err; return LTG_ERR; }
    seg_add_chunk(s, &h);
    return 0;
}

/* Is h, read at offset `at` of an index file of `size` bytes, the head of
 * the next chunk of s, about log bytes from `from` within `log_size`? */
static int idx_head_ok(const segment *s, const idx_header *h, uint64_t at, uint64_t size,
                       uint64_t from, uint64_t log_size) {
    if (memcmp(h->magic, IDX_MAGIC, 8) || h->endian != IDX_ENDIAN ||
        h->head_crc != crc32(h, offsetof(idx_header, head_crc)))
        return 0;
    if (h->day != s->day || h->first != seg_chunked(s) || h->log_from != from || h->log_to < from ||
        h->log_to > log_size)
        return 0;
    if (h->end > size || h->end < at + sizeof *h ||
        h->sec[SEC_OFFSETS][1] != ((uint64_t)h->nevents + 1) * 8)
        return 0;
    for (int i = 0; i < NSEC; i++)
        if (h->sec[i][0] < at + sizeof *h || h->sec[i][0] > h->end ||
            h->sec[i][1] > h->end - h->sec[i][0] || h->sec[i][1] % sec_elem[i])
            return 0;
    return 1;
}

/* Read s's index file at start-up: its chunks, in order, each whole (its
 * CRCs), of this day, and about the log bytes after the one before,
 * within the log's `log_size` bytes. What follows the last of them -- a
 * chunk a crash cut short, or a file of an older format -- is cut off.
 * Returns where in the log the events no chunk holds begin. */
static uint64_t idx_load(segment *s, uint64_t log_size) {
    char path[300];
    seg_path(s->day, ".idx", LG.dir, path, sizeof path);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    uint64_t at = 0, from = 8; /* a log's first record follows its magic */
    if (fd < 0 || fstat(fd, &st) < 0) {
        if (fd >= 0) close(fd);
        return from;
    }
    char *chunk = xmalloc(LOG_READ_CHUNK);
    idx_header h;
    while (at + sizeof h <= (uint64_t)st.st_size &&
           pread(fd, &h, sizeof h, (off_t)at) == (ssize_t)sizeof h &&
           idx_head_ok(s, &h, at, (uint64_t)st.st_size, from, log_size)) {
        uint32_t crc = 0;
        ssize_t r = 1;
        for (uint64_t o = at + sizeof h; o < h.end && r > 0; o += (uint64_t)r) {
            size_t want = h.end - o < LOG_READ_CHUNK ? (size_t)(h.end - o) : LOG_READ_CHUNK;
            if ((r = pread(fd, chunk, want, (off_t)o)) > 0) crc = crc32_more(crc, chunk, (size_t)r);
        }
        if (r <= 0 || crc != h.crc) break;
        seg_add_chunk(s, &h);
        at = h.end;
        from = h.log_to;
    }
    if (at < (uint64_t)st.st_size && ftruncate(fd, (off_t)at) < 0)
        ltg_log("ledger: cannot cut %s back to its whole chunks: %s", path, strerror(errno));
    free(chunk);
    close(fd);
    return from;
}

/* Write s's events in memory out as a chunk of its index file, first
 * making their records durable, and let them go from memory: 0, or
 * LTG_ERR: a log that will not sync is tried again after LEDGER_RETRY_MS,
 * an index file that will not be written (said once) after IDX_RETRY_MS. */
static int seg_spill(segment *s) {
    if (log_sync(&s->f) < 0) {
        s->retry_at = S.now + LEDGER_RETRY_MS;
        return LTG_ERR;
    }
    if (idx_write(s) < 0) {
        if (!s->idx_failing)
            ltg_log("ledger: the index of %s cannot be written (%s): its events stay in memory, "
                    "tried again every %d s",
                    s->f.path, strerror(errno), IDX_RETRY_MS / 1000);
        s->idx_failing = 1;
        s->retry_at = S.now + IDX_RETRY_MS;
        return LTG_ERR;
    }
    if (s->idx_failing) ltg_log("ledger: the index of %s is written", s->f.path);
    s->idx_failing = 0;
    mem_free(&s->mem);
    return 0;
}

/* Index one event of s. When the events in memory may not take one more
 * within --ledger-index-mb, they are first spilled to the index file;
 * while that fails they stay, and ledger_writable() refuses new requests. */
static void seg_index(segment *s, const rec_view *v, uint64_t off, uint32_t len) {
    if (s->mem.n && s->mem.bytes + mem_worst(&s->mem) > (size_t)S.ledger_index &&
        S.now >= s->retry_at)
        seg_spill(s);
    mem_add(&s->mem, v, off, len);
}

/* s's index is on disk: let its memory and its log go. */
static void seg_sealed(segment *s) {
    if (s->f.fd >= 0) close(s->f.fd);
    buf_free(&s->f.pending);
    s->f.fd = -1;
    mem_free(&s->mem);
    s->state = SEG_SEALED;
}

/* Write a sealing segment's last chunk once its events are durable. */
static void seg_seal_step(segment *s) {
    if (s->state != SEG_SEALING || s->f.pending.len || s->f.failing || S.now < s->retry_at) return;
    if ((s->mem.n || !s->nchunk) && seg_spill(s) < 0) return;
    seg_sealed(s);
}

/* ---- what a query sees of one day ----
 *
 * A day is read in parts: each chunk of its index file, then the events
 * still in memory. The part being read is v->h (NULL: memory); the few
 * functions below that read one part are the ones that tell memory from
 * file (with view_usage and ledger_replays), and every query is written
 * once, over them. Positions are
 * the day's: an event's number in it. */

typedef struct {
    segment *s;
    int fd, log_fd;             /* its index file and (a sealed day) its log, open for the query */
    uint32_t limit;             /* the events it may see: a snapshot's bound */
    char kind;                  /* 0: every event; 'k' or 'g': those of one key or group */
    const char *id;
    const idx_header *h;        /* the part being read: a chunk, or NULL for the events in memory */
    uint32_t first, n;          /* its first event's position, its events */
    const lname *nm;            /* the name looked up (view_name) -- in memory: it, or NULL; */
    idx_name dn;                /* its events in the part (n = 0 when absent); */
    int sec;                    /* in a chunk: the section of its positions */
} seg_view;

static uint32_t seg_parts(const segment *s) { return s->nchunk + (s->state != SEG_SEALED); }

/* The name kind+id in a chunk's sorted table: 1 found, 0 absent, LTG_ERR. */
static int idx_find(const seg_view *v, char kind, const char *id, idx_name *out) {
    char want[ALIAS_MAX + 2], got[ALIAS_MAX + 2];
    size_t wn = (size_t)snprintf(want, sizeof want, "%c%s", kind, id);
    uint64_t lo = 0, hi = v->h->sec[SEC_NAMES][1] / sizeof(idx_name);
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        idx_name nm;
        if (idx_read(v->h, v->fd, SEC_NAMES, mid, 1, &nm) < 0 || nm.len > ALIAS_MAX + 1 ||
            idx_read(v->h, v->fd, SEC_STRINGS, nm.str, nm.len, got) < 0)
            return LTG_ERR;
        int c = memcmp(got, want, nm.len < wn ? nm.len : wn);
        if (!c) c = (nm.len > wn) - (nm.len < wn);
        if (!c) { *out = nm; return 1; }
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return 0;
}

/* Look up name kind+id in the part: how many events it has there, or LTG_ERR. */
static int64_t view_name(seg_view *v, char kind, const char *id) {
    v->nm = NULL;
    v->dn = (idx_name){0};
    v->sec = kind == 'k' ? SEC_KEYPOS : SEC_GROUPPOS;
    if (v->h) return idx_find(v, kind, id, &v->dn) < 0 ? LTG_ERR : (int64_t)v->dn.n;
    uint32_t k = mem_find(&v->s->mem, kind, id, strlen(id));
    if (k == UINT32_MAX) return 0;
    v->nm = v->s->mem.names[k];
    v->dn.n = v->nm->npos;
    v->dn.spent = v->nm->npos ? v->nm->pos[v->nm->npos - 1].cum : 0;
    return v->dn.n;
}

/* The rank-th event of the part's name. */
static int view_gpos(const seg_view *v, uint64_t rank, idx_gpos *g) {
    if (!v->h) { *g = v->nm->pos[rank]; return 0; }
    return idx_read(v->h, v->fd, v->sec, v->dn.first + rank, 1, g);
}

/* The position of the rank-th event the view shows in its part: 0, or LTG_ERR. */
static int view_pos(const seg_view *v, uint64_t rank, uint32_t *pos) {
    idx_gpos g = {(uint32_t)rank, 0, 0};
    if (v->kind && view_gpos(v, rank, &g) < 0) return LTG_ERR;
    *pos = v->first + g.pos;
    return 0;
}

/* How many events of the part the view shows (those before its limit), or LTG_ERR. */
static int64_t view_count(const seg_view *v) {
    uint32_t lim = v->limit > v->first ? v->limit - v->first : 0;
    if (!v->kind) return lim < v->n ? lim : v->n;
    uint64_t lo = 0, hi = v->dn.n;
    if (lim >= v->n) return hi;
    while (lo < hi) { /* the first of its events at or after the limit */
        uint64_t mid = lo + (hi - lo) / 2;
        idx_gpos g;
        if (view_gpos(v, mid, &g) < 0) return LTG_ERR;
        if (g.pos < lim) lo = mid + 1;
        else hi = mid;
    }
    return (int64_t)lo;
}

/* Read part c of the view's day (chunk c; c == nchunk: the events in
 * memory): how many of its events the view shows, or LTG_ERR. */
static int64_t view_part(seg_view *v, uint32_t c) {
    const segment *s = v->s;
    v->h = c < s->nchunk ? &s->chunk[c] : NULL;
    v->first = v->h ? v->h->first : seg_chunked(s);
    v->n = v->h ? v->h->nevents : s->mem.n;
    if (v->kind && view_name(v, v->kind, v->id) < 0) return LTG_ERR;
    return view_count(v);
}

static void view_close(seg_view *v) {
    if (v->fd >= 0) close(v->fd);
    if (v->log_fd >= 0) close(v->log_fd);
    v->fd = v->log_fd = -1;
}

/* Open the view of s: every event, or those of kind+id, before position
 * `limit`. 0, or LTG_ERR (a file that cannot be read; logged). */
static int view_open(seg_view *v, segment *s, char kind, const char *id, uint32_t limit) {
    *v = (seg_view){.s = s, .fd = -1, .log_fd = -1, .limit = limit, .kind = kind, .id = id};
    char path[300];
    seg_path(s->day, ".idx", LG.dir, path, sizeof path);
    if (s->nchunk && (v->fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) goto fail;
    seg_path(s->day, ".log", LG.dir, path, sizeof path);
    if (s->state == SEG_SEALED && (v->log_fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) goto fail;
    return 0;
fail:
    ltg_log("ledger: cannot read %s: %s", path, strerror(errno));
    view_close(v);
    return LTG_ERR;
}

/* Bytes [off, off + n) of a segment's log: from the file, or, for what is
 * not durable yet, from the events waiting in memory. */
static int seg_read(const seg_view *v, uint64_t off, size_t n, char *out) {
    const logfile *f = &v->s->f;
    if (v->s->state != SEG_SEALED && off >= (uint64_t)f->durable) {
        if (off + n > (uint64_t)f->size) return LTG_ERR;
        memcpy(out, f->pending.p + (off - (uint64_t)f->durable), n);
        return 0;
    }
    int fd = v->s->state == SEG_SEALED ? v->log_fd : f->fd;
    return pread(fd, out, n, (off_t)off) == (ssize_t)n ? 0 : LTG_ERR;
}

/* Where the record at position `pos` of the day is: its payload's offset and length. */
static int view_loc(const seg_view *v, uint32_t pos, uint64_t *off, uint32_t *len) {
    const segment *s = v->s;
    uint32_t lo = 0, hi = s->nchunk, inmem = seg_chunked(s);
    if (pos >= inmem) {
        if (pos - inmem >= s->mem.n) return LTG_ERR;
        *off = s->mem.ix[pos - inmem].off;
        *len = s->mem.ix[pos - inmem].len;
        return 0;
    }
    while (hi - lo > 1) { /* the chunk that holds it */
        uint32_t mid = lo + (hi - lo) / 2;
        if (s->chunk[mid].first <= pos) lo = mid;
        else hi = mid;
    }
    uint64_t o[2];
    if (idx_read(&s->chunk[lo], v->fd, SEC_OFFSETS, pos - s->chunk[lo].first, 2, o) < 0 ||
        o[0] < 16 || o[1] < o[0] + 8 || o[1] - o[0] - 8 > LOG_MAX_RECORD)
        return LTG_ERR;
    *off = o[0];
    *len = (uint32_t)(o[1] - o[0] - 8);
    return 0;
}

/* The record whose payload is [off, off + len) of v's log, read into
 * rec, checked against its CRC, and decoded into *rv: 0, or LTG_ERR. */
static int seg_record_at(const seg_view *v, uint64_t off, uint32_t len, buf *rec, rec_view *rv) {
    rec->len = 0;
    if (off < 16 || len > LOG_MAX_RECORD) return LTG_ERR;
    buf_reserve(rec, (size_t)len + 8);
    if (seg_read(v, off - 8, (size_t)len + 8, rec->p) < 0 || get_le32((uint8_t *)rec->p) != len ||
        get_le32((uint8_t *)rec->p + 4) != crc32(rec->p + 8, len) ||
        rec_decode(rec->p + 8, len, rv) < 0)
        return LTG_ERR;
    rec->len = (size_t)len + 8;
    return 0;
}

/* The record at position `pos` of the day (see seg_record_at): 0, or LTG_ERR (logged). */
static int view_record(const seg_view *v, uint32_t pos, buf *rec, rec_view *rv) {
    uint64_t off;
    uint32_t len;
    if (view_loc(v, pos, &off, &len) == 0 && seg_record_at(v, off, len, rec, rv) == 0) return 0;
    ltg_log("ledger: %s: the event at position %u cannot be read back (a damaged index file is "
            "rebuilt at the next start)",
            v->s->f.path, pos);
    return LTG_ERR;
}

/* What the part's name (view_name) charged at or after `since` (wall ms):
 * all of it, less the running sum before its first event since then. */
static int64_t view_spent_since(const seg_view *v, int64_t since) {
    int64_t ms = since - v->s->day;
    uint64_t lo = 0, hi = v->dn.n;
    idx_gpos g;
    while (lo < hi) { /* the first event at or after `since` */
        uint64_t mid = lo + (hi - lo) / 2;
        if (view_gpos(v, mid, &g) < 0) return 0;
        if ((int64_t)g.ms < ms) lo = mid + 1;
        else hi = mid;
    }
    return v->dn.spent - (lo > 0 && view_gpos(v, lo - 1, &g) == 0 ? g.cum : 0);
}

/* What group or key `id` (kind 'g' or 'k') spent in s at or after `since` (wall ms). */
static int64_t seg_spent_since(segment *s, char kind, const char *id, int64_t since) {
    seg_view v;
    int64_t sum = 0;
    if (view_open(&v, s, kind, id, UINT32_MAX) == 0)
        for (uint32_t c = 0; c < seg_parts(s); c++)
            if (view_part(&v, c) > 0) sum += view_spent_since(&v, since);
    view_close(&v);
    return sum;
}

/* The names of the part, each with what its events charged there: fn(the
 * view, "k<id>", "g<id>" or "m<alias>", its length, that sum, ctx). */
static void view_names(seg_view *v,
                       void (*fn)(seg_view *v, const char *name, size_t len, int64_t spent,
                                  void *ctx),
                       void *ctx) {
    if (!v->h) {
        for (uint32_t k = 0; k < v->s->mem.nnames; k++) {
            const lname *nm = v->s->mem.names[k];
            fn(v, nm->s, strlen(nm->s), nm->npos ? nm->pos[nm->npos - 1].cum : 0, ctx);
        }
        return;
    }
    uint64_t nn = v->h->sec[SEC_NAMES][1] / sizeof(idx_name), ns = v->h->sec[SEC_STRINGS][1];
    idx_name *names = xmalloc(nn * sizeof *names + 1);
    char *str = xmalloc(ns + 1);
    if (idx_read(v->h, v->fd, SEC_NAMES, 0, nn, names) == 0 &&
        idx_read(v->h, v->fd, SEC_STRINGS, 0, ns, str) == 0)
        for (uint64_t r = 0; r < nn; r++)
            if (names[r].len > 0 && names[r].len <= ALIAS_MAX + 1 && names[r].str <= ns &&
                names[r].len <= ns - names[r].str)
                fn(v, str + names[r].str, names[r].len, names[r].spent, ctx);
    free(names);
    free(str);
}

static void budget_refresh(allowance *a, int64_t now);

/* The stored item a day's name stands for (its kind's letter, then its id:
 * "g<id>", "k<id>"), and its kind; NULL when there is none. */
static stored *ledger_item(const char *name, const store_kind **kind) {
    for (size_t i = 0; i < sizeof KINDS / sizeof *KINDS; i++)
        if (KINDS[i]->ledger == name[0]) {
            *kind = KINDS[i];
            return store_find(KINDS[i], name + 1);
        }
    return NULL;
}

/* The allowance a day's name counts its events in (kind and id: "g<id>",
 * "k<id>"): a group's, or a key's with a budget (a key's spend is counted
 * for its budget alone); NULL for others. */
static allowance *name_allowance(const char *name) {
    const store_kind *K;
    stored *it = ledger_item(name, &K);
    return it && (K == &GROUPS || it->al.has_budget) ? &it->al : NULL;
}

typedef void spend_fn(const char *name, allowance *a, int64_t spent, void *ctx);
typedef struct { int64_t now; spend_fn *fn; void *ctx; } spends_walk;

static void spends_one(seg_view *v, const char *s, size_t len, int64_t spent, void *ctx) {
    spends_walk *w = ctx;
    char name[38];
    if (len != 37 || (s[0] != 'g' && s[0] != 'k')) return;
    memcpy(name, s, 37);
    name[37] = 0;
    allowance *a = name_allowance(name);
    if (!a) return;
    budget_refresh(a, w->now);
    if (v->s->day + DAY_MS <= a->period_start) return;
    if (v->s->day < a->period_start) {
        /* the period starts within the day: the running sums say what came after */
        view_name(v, name[0], name + 1);
        spent = view_spent_since(v, a->period_start);
    }
    w->fn(name, a, spent, w->ctx);
}

/* For each group, and each key with a budget, that has events in day s
 * and whose current period (brought up to `now`) takes in some of the
 * day: fn(its name, its allowance, what it spent in one part of s within
 * that period), once for each part it has events in. A chunk's names are
 * read whole, with each one's total; only for the day a period starts
 * in are the running sums searched: a few reads a chunk, whatever its
 * events. */
static void seg_spends(segment *s, int64_t now, spend_fn *fn, void *ctx) {
    seg_view v;
    spends_walk w = {now, fn, ctx};
    if (view_open(&v, s, 0, NULL, UINT32_MAX) == 0)
        for (uint32_t c = 0; c < seg_parts(s); c++)
            if (view_part(&v, c) > 0) view_names(&v, spends_one, &w);
    view_close(&v);
}

/* ---- writing ---- */

/* Write and fsync every day whose events wait in memory (`wait`: before
 * returning; otherwise off the loop, log_sync_start). While one fails, try
 * again every second; while one's fsync runs, look again in 20 ms for the
 * events that came meanwhile. */
static void ledger_sync(void *ctx);
static timer ledger_sync_timer = {.slot = -1, .fire = ledger_sync};

/* The files written so, for i from 0 to LG.nseg: the days not sealed and,
 * last, with --cluster, the outbox (section 21); NULL for the others. */
static logfile *ledger_file(int i) {
    if (i == LG.nseg) return cl_outbox_file();
    return LG.seg[i]->state != SEG_SEALED ? &LG.seg[i]->f : NULL;
}

static void ledger_sync_all(int wait) {
    int failing = 0, syncing = 0;
    for (int i = 0; i <= LG.nseg; i++) {
        logfile *f = ledger_file(i);
        if (!f || (!f->pending.len && !f->failing)) continue;
        failing |= (wait ? log_sync(f) : log_sync_start(f)) < 0;
        syncing |= f->syncing > 0;
    }
    if (failing) timer_set(&ledger_sync_timer, LEDGER_RETRY_MS);
    else if (syncing) timer_set(&ledger_sync_timer, LEDGER_SYNC_MS);
}

static void ledger_sync_soon(void) {
    if (ledger_sync_timer.slot < 0) timer_set(&ledger_sync_timer, LEDGER_SYNC_MS);
}

static void ledger_sync(void *ctx) {
    (void)ctx;
    ledger_sync_all(0);
}

/* May events be recorded now? Not while a day's log fails to take them,
 * nor while today's index is full and cannot be spilled. */
static int ledger_writable(const char **why) {
    logfile *ob = cl_outbox_file();
    if (ob && ob->failing) { *why = ob->why; return 0; }
    if (ob && cl_outbox_full()) {
        *why = "the outbox of events for the shared store (Redis) is full: Redis has been out of "
               "reach too long";
        return 0;
    }
    for (int i = 0; i < LG.nseg; i++) {
        const segment *s = LG.seg[i];
        if (s->state != SEG_SEALED && s->f.failing) { *why = s->f.why; return 0; }
        if (s->state == SEG_OPEN && s->idx_failing) {
            *why = "today's index file cannot be written (see the log)";
            return 0;
        }
    }
    return 1;
}

/* The event's "created_at" says its record's time, when ledger_add moved
 * it (a clock that went back; with --cluster, the stream's time). */
static void rec_stamp(buf *p, const rec_view *v) {
    static const char name[] = "\"created_at\":\"";
    char ts[64], *e = p->p + (p->len - v->replay_len - v->event_len);
    char *at = memmem(e, v->event_len, name, sizeof name - 1);
    iso_time(v->at, ts);
    at = at ? at + sizeof name - 1 : NULL;
    if (at && strlen(ts) == 24 && at + 24 < e + v->event_len && at[24] == '"') memcpy(at, ts, 24);
}

/* The chain's head: the newest chained day's (and that day), or the seed. */
static const uint8_t *chain_head(int64_t *day) {
    static const uint8_t seed[CHAIN_LEN];
    for (int i = LG.nseg - 1; i >= 0; i--)
        if (LG.seg[i]->chained) {
            *day = LG.seg[i]->day;
            return LG.seg[i]->head;
        }
    *day = 0;
    return seed;
}

/* Chain the new day s: its first record links it to the chain's head. */
static void chain_begin(segment *s) {
    int64_t day;
    const uint8_t *head = chain_head(&day);
    const char *why;
    buf l = {0};
    link_encode(&l, day, head);
    if (log_append(&s->f, l.p, l.len, 0, &why) == 0) {
        s->chained = 1;
        memcpy(s->link, head, CHAIN_LEN);
        memcpy(s->head, head, CHAIN_LEN);
    }
    buf_free(&l);
}

/* Append one event (v, whose time is set here: `now`, or the last event's
 * if the clock went back, and never in a day already sealed). Returns
 * where its record went, for a replay. With a key, a new day begins with
 * its link, and each event of a chained day ends with its chain. */
static int ledger_add(rec_view *v, int64_t now, int64_t *day, uint64_t *off, uint32_t *len) {
    const segment *last = LG.nseg ? LG.seg[LG.nseg - 1] : NULL;
    int64_t floor = !last ? 0 : last->state == SEG_OPEN ? LG.last_at : last->day + DAY_MS;
    v->at = now > floor ? now : floor;
    LG.last_at = v->at;
    segment *s = seg_open();
    if (!s || s->day < day_of(v->at)) {
        if (s) s->state = SEG_SEALING; /* the day is over */
        s = seg_new(day_of(v->at));
    }
    if (v->charged > MAX_CHARGE)
        ltg_log("ledger: a charge of %lld micro-USD recorded as %lld, the most one event may hold",
                (long long)v->charged, MAX_CHARGE);
    if (v->charged > MAX_CHARGE) v->charged = MAX_CHARGE;
    if (LG.keyed && !s->chained && s->f.size == 8) chain_begin(s);
    v->flags = (uint8_t)((v->flags & ~EVF_CHAINED) | (LG.keyed && s->chained ? EVF_CHAINED : 0));
    buf p = {0};
    uint8_t chain[CHAIN_LEN];
    rec_encode(&p, v);
    rec_stamp(&p, v);
    if (v->flags & EVF_CHAINED) {
        chain_of(&LG.key, s->head, p.p, p.len, chain);
        buf_append(&p, chain, CHAIN_LEN);
    }
    rec_view back;
    const char *why = "a record its own reader would refuse (a bug: see the log)";
    *day = s->day;
    *off = (uint64_t)s->f.size + 8;
    *len = (uint32_t)p.len;
    /* never a ledger ltg cannot start on */
    int rc = rec_decode(p.p, p.len, &back) < 0 ? LTG_ERR : log_append(&s->f, p.p, p.len, 0, &why);
    if (rc < 0) ltg_log("ledger: an event was not recorded: %s", why);
    else {
        seg_index(s, v, *off, *len);
        if (v->flags & EVF_CHAINED) memcpy(s->head, chain, CHAIN_LEN);
        metric_add(M_LEDGER, 1, NULL);
        ledger_sync_soon();
    }
    buf_free(&p);
    return rc;
}

/* ---- retention ---- */

/* a carried spend before budget_carry */
typedef struct { allowance *a; int64_t carry, start, to; } carry_undo;
static void budget_carry(allowance *a, int64_t spent, segment *s, carry_undo *undo);
static void budget_uncarry(const carry_undo *undo);
static void budget_forget(group *g, int64_t spent);
static int carried_covers(const allowance *a, const segment *s);

/* What ledger_retire carries: the state log's ops, the undo of each. */
typedef struct { jwriter *w; carry_undo *ch; int nch; segment *s; } carrying;

/* A group with a budget, or a key with one, spent in the day retention
 * deletes, in its current period: carried once, all of the day's. */
static void carry_spend(const char *name, allowance *a, int64_t spent, void *ctx) {
    (void)spent;
    carrying *c = ctx;
    const store_kind *K;
    stored *it = ledger_item(name, &K);
    /* no budget, or carried already: by another part of the day, or before */
    if (!it || !it->al.has_budget || carried_covers(a, c->s)) return;
    c->ch = xrealloc(c->ch, (size_t)(c->nch + 1) * sizeof *c->ch);
    budget_carry(a, seg_spent_since(c->s, name[0], name + 1, a->period_start), c->s,
                 &c->ch[c->nch++]);
    jw_open(c->w, '{');
    jw_name(c->w, K->put_op);
    K->json(c->w, it, 1);
    jw_close(c->w, '}');
}

/* A group without a budget shows what its kept days spent: this one's goes. */
static void forget_spend(seg_view *v, const char *s, size_t len, int64_t spent, void *ctx) {
    (void)v;
    (void)ctx;
    char id[37];
    if (len != 37 || s[0] != 'g') return;
    memcpy(id, s + 1, 36);
    id[36] = 0;
    group *g = group_find(id);
    if (g && !g->s.al.has_budget) budget_forget(g, spent);
}

/* Delete the oldest day, a sealed one. What a group or a key with a budget
 * spent in it within its current period (a lifetime budget's) is first
 * carried into its record in the state log; a group without a budget shows
 * the spend of the days kept, so it loses the day's. */
static int ledger_retire(segment *s, int64_t now) {
    buf ops = {0};
    jwriter w;
    carrying c = {&w, NULL, 0, s};
    jw_init(&w, &ops), jw_open(&w, '[');
    seg_spends(s, now, carry_spend, &c);
    jw_close(&w, ']');
    const char *why = "";
    buf rec = {0};
    buf_printf(&rec, "{\"ops\":%s}", ops.p);
    int rc = c.nch ? state_append(rec.p, rec.len, &why) : 0;
    for (int i = 0; rc < 0 && i < c.nch; i++) budget_uncarry(&c.ch[i]);
    buf_free(&ops);
    buf_free(&rec);
    free(c.ch);
    int nch = c.nch;
    char path[300];
    seg_view v = {.fd = -1, .log_fd = -1};
    int readable = rc == 0 && view_open(&v, s, 0, NULL, UINT32_MAX) == 0; /* before the log goes */
    seg_path(s->day, ".log", LG.dir, path, sizeof path);
    if (rc < 0)
        ltg_log("ledger: %s not deleted yet: the state log refused what it carries (%s)", path,
                why);
    else if (unlink(path) < 0 && errno != ENOENT) {
        ltg_log("ledger: cannot delete %s: %s", path, strerror(errno));
        rc = LTG_ERR;
    }
    for (uint32_t k = 0; rc == 0 && readable && k < seg_parts(s); k++)
        if (view_part(&v, k) > 0) view_names(&v, forget_spend, NULL);
    view_close(&v);
    if (rc < 0) return LTG_ERR;
    seg_path(s->day, ".idx", LG.dir, path, sizeof path);
    unlink(path);
    fsync_dir(LG.dir);
    ltg_log("ledger: deleted %s (%llu bytes, %u events): older than --ledger-days %d%s", s->f.path,
            (unsigned long long)(s->nchunk ? s->chunk[s->nchunk - 1].log_to : 0), seg_count(s),
            S.ledger_days,
            nch ? "; what lifetime budgets spent in it is carried in their groups and keys" : "");
    memmove(LG.seg, LG.seg + 1, (size_t)--LG.nseg * sizeof *LG.seg);
    seg_free(s);
    return 0;
}

/* The first day the ledger keeps (UTC midnight, wall ms). */
static int64_t ledger_retained_from(int64_t now) {
    return day_of(now) - (int64_t)S.ledger_days * DAY_MS;
}

/* Called each loop turn: the turn's events are written, a day that ended
 * is sealed, a chunk that could not be written tried again, one expired
 * day deleted. */
static void ledger_tick(int64_t now) {
    for (int i = 0; i <= LG.nseg; i++) {
        logfile *f = ledger_file(i);
        if (f && !f->failing && f->written < f->pending.len && log_write(f) < 0)
            timer_set(&ledger_sync_timer, LEDGER_RETRY_MS);
    }
    for (int i = 0; i < LG.nseg; i++) {
        segment *s = LG.seg[i];
        if (s->state == SEG_OPEN && s->day < day_of(now) && cl_day_over(s->day + DAY_MS))
            s->state = SEG_SEALING;
        if (s->state == SEG_OPEN && s->idx_failing && S.now >= s->retry_at) seg_spill(s);
        seg_seal_step(s);
    }
    if (LG.nseg && LG.seg[0]->state == SEG_SEALED && LG.seg[0]->day < ledger_retained_from(now))
        ledger_retire(LG.seg[0], now);
}

/* ---- the migration from the single-file ledger (version 1) ----
 *
 * Earlier versions kept every event in one DATA/ledger.log. At the first
 * start-up of this one, its events are rewritten into daily segments and
 * the file removed; nothing else in this section knows it existed. */

/* A migrated event appended to its day's segment (*cur, a new one each
 * day; the events are in time order, as the ledger never went back). */
static int migrate_write(segment **cur, rec_view *v, char *err, size_t errlen) {
    if (v->at < LG.last_at) v->at = LG.last_at;
    LG.last_at = v->at;
    if (!*cur || (*cur)->day < day_of(v->at)) {
        if (*cur && (log_sync(&(*cur)->f) < 0 || close((*cur)->f.fd) < 0)) {
            snprintf(err, errlen, "%s", (*cur)->f.why);
            return LTG_ERR;
        }
        if (*cur) (*cur)->f.fd = -1;
        *cur = seg_new(day_of(v->at));
    }
    buf rec = {0};
    rec_encode(&rec, v);
    const char *why;
    int rc = log_append(&(*cur)->f, rec.p, rec.len, 0, &why);
    if (rc == 0 && (*cur)->f.pending.len > (4 << 20)) rc = log_sync(&(*cur)->f);
    buf_free(&rec);
    if (rc < 0) snprintf(err, errlen, "%s", (*cur)->f.why);
    return rc;
}

/* One event of a version-1 ledger.log, rewritten into the day's segment. */
static int ledger_migrate_apply(void *ctx, const char *p, size_t n, off_t at, char *err,
                                size_t errlen) {
    (void)at;
    segment **cur = ctx;
    json_tok t[96];
    json_result res;
    if (json_parse(p, n, t, 96, 2, &res) < 0) {
        snprintf(err, errlen, "not JSON: %s at byte %zu", res.err, res.err_offset);
        return LTG_ERR;
    }
    int e = json_get(p, t, 0, "e"), r = json_get(p, t, 0, "r");
    long long when, charged, in = 0, out = 0;
    if (e < 0 || json_int(p, t, json_get(p, t, 0, "t"), &when) < 0 ||
        json_int(p, t, json_get(p, t, 0, "c"), &charged) < 0) {
        snprintf(err, errlen, "not a spend event");
        return LTG_ERR;
    }
    int ki = json_get(p, t, e, "token_key_id"), gi = json_get(p, t, e, "token_group_id"),
        mv = json_get(p, t, e, "model");
    if (mv < 0 || t[mv].type != JSON_STRING) mv = json_get(p, t, e, "requested_model");
    if (!is_uuid(p, t, ki) || !is_uuid(p, t, gi) || mv < 0 || t[mv].type != JSON_STRING ||
        t[mv].end - t[mv].start > ALIAS_MAX) {
        snprintf(err, errlen, "a spend event without its key, group or model");
        return LTG_ERR;
    }
    json_int(p, t, json_get(p, t, e, "input_tokens"), &in);
    json_int(p, t, json_get(p, t, e, "output_tokens"), &out);
    int st = json_get(p, t, e, "status"), hit = json_get(p, t, e, "cache_hit");
    rec_view v = {.at = when,
                  .charged = charged,
                  .tok = {[TOK_IN] = (uint32_t)in, [TOK_OUT] = (uint32_t)out},
                  .status = (uint8_t)(json_eq(p, t, st, "failed")    ? EV_FAILED
                                      : json_eq(p, t, st, "partial") ? EV_PARTIAL
                                                                     : EV_SUCCEEDED),
                  .flags = (uint8_t)((hit >= 0 && t[hit].type == JSON_TRUE ? EVF_CACHE_HIT : 0) |
                                     (r >= 0 ? EVF_REPLAY : 0)),
                  .key = p + t[ki].start,
                  .group = p + t[gi].start,
                  .model = p + t[mv].start,
                  .model_len = t[mv].end - t[mv].start,
                  .event = p + t[e].start,
                  .event_len = t[e].end - t[e].start,
                  .replay = r >= 0 ? p + t[r].start : "",
                  .replay_len = r >= 0 ? t[r].end - t[r].start : 0};
    return migrate_write(cur, &v, err, errlen);
}

/* An earlier version kept one DATA/ledger.log: split it into daily
 * segments, once. They are written to DATA/ledger.new, which is renamed
 * to DATA/ledger only when whole; the old file goes last. A crash at any
 * point leaves the old file (the migration starts again) or the new
 * directory (and the old file is dropped). */
static int ledger_migrate(const char *data, char *err, size_t errlen) {
    char old[300], tmpdir[240], path[320];
    snprintf(old, sizeof old, "%.200s/ledger.log", data);
    snprintf(tmpdir, sizeof tmpdir, "%.200s/ledger.new", data);
    struct stat st;
    if (stat(old, &st) < 0) return 0;
    if (stat(LG.dir, &st) == 0) { unlink(old); return 0; } /* the crash came after the switch */
    DIR *d = opendir(tmpdir);
    for (struct dirent *de; d && (de = readdir(d));)
        if (de->d_name[0] != '.') {
            snprintf(path, sizeof path, "%s/%.60s", tmpdir, de->d_name);
            unlink(path);
        }
    if (d) closedir(d);
    if (mkdir(tmpdir, 0700) < 0 && errno != EEXIST) {
        snprintf(err, errlen, "%s: %s", tmpdir, strerror(errno));
        return LTG_ERR;
    }
    char dir[256];
    memcpy(dir, LG.dir, sizeof dir);
    snprintf(LG.dir, sizeof LG.dir, "%.240s", tmpdir);
    segment *cur = NULL;
    logfile f = {.fd = -1};
    ltg_log("ledger: migrating %s into daily segments under %s", old, dir);
    int rc = log_open(&f, data, "ledger.log", LEDGER_V1_MAGIC, 0, ledger_migrate_apply, &cur, err,
                      errlen);
    if (f.fd >= 0) close(f.fd);
    if (rc == 0 && cur && (log_sync(&cur->f) < 0 || close(cur->f.fd) < 0)) {
        rc = LTG_ERR;
        snprintf(err, errlen, "%s", cur->f.why);
    }
    int nseg = LG.nseg;
    while (LG.nseg) seg_free(LG.seg[--LG.nseg]); /* start-up opens them again */
    memcpy(LG.dir, dir, sizeof dir);
    LG.last_at = 0;
    if (rc < 0) return LTG_ERR;
    if (fsync_dir(tmpdir) < 0 || rename(tmpdir, LG.dir) < 0 || fsync_dir(data) < 0 ||
        unlink(old) < 0 || fsync_dir(data) < 0) {
        snprintf(err, errlen, "migrating the ledger into %s: %s", LG.dir, strerror(errno));
        return LTG_ERR;
    }
    ltg_log("ledger: migrated %s into %d daily segment(s); it is removed", old, nseg);
    return 0;
}

static int i64_cmp(const void *a, const void *b) {
    return (*(const int64_t *)a > *(const int64_t *)b) -
           (*(const int64_t *)a < *(const int64_t *)b);
}

/* The logs of directory `dir` (made if missing), each named by a number
 * that name(dir, file, &number) reads (0: not one of them), in order: a
 * malloc'd array (of *n; never NULL but on an error, in err). */
static int64_t *dir_logs(const char *dir, int (*name)(const char *, const char *, int64_t *),
                         size_t *n, char *err, size_t errlen) {
    DIR *d = mkdir(dir, 0700) < 0 && errno != EEXIST ? NULL : opendir(dir);
    if (!d) { snprintf(err, errlen, "%s: %s", dir, strerror(errno)); return NULL; }
    int64_t *v = xmalloc(sizeof *v), x;
    *n = 0;
    for (struct dirent *de; (de = readdir(d));)
        if (name(dir, de->d_name, &x)) {
            v = xrealloc(v, (*n + 1) * sizeof *v);
            v[(*n)++] = x;
        }
    closedir(d);
    qsort(v, *n, sizeof *v, i64_cmp);
    return v;
}

/* A day's log by its name, YYYY-MM-DD.log by its midnight (`ltg verify` reads
 * with it: it changes nothing). */
static int day_log_name(const char *dir, const char *file, int64_t *ms) {
    char day[16];
    (void)dir;
    if (strlen(file) != 14 || strcmp(file + 10, ".log") != 0) return 0;
    snprintf(day, sizeof day, "%.10s", file);
    return parse_day(day, ms) == 0;
}

/* The same, where ltg starts: a .tmp file an interrupted write left goes. */
static int seg_name(const char *dir, const char *file, int64_t *ms) {
    char path[320];
    size_t n = strlen(file);
    if (n > 4 && strcmp(file + n - 4, ".tmp") == 0) {
        snprintf(path, sizeof path, "%s/%.60s", dir, file);
        unlink(path);
    }
    return day_log_name(dir, file, ms);
}

/* ---- start-up ---- */

/* Open DATA/ledger at start-up: migrate an old ledger.log, check every
 * sealed day's index file (or rebuild it from its log, one day in memory
 * at a time), replay the open day, and delete what is past retention.
 * 0, or LTG_ERR with a message in err. */
static int ledger_open(const char *data, int64_t now, char *err, size_t errlen) {
    snprintf(LG.dir, sizeof LG.dir, "%.200s/ledger", data);
    if (ledger_migrate(data, err, errlen) < 0) return LTG_ERR;
    size_t ndays;
    int64_t *days = dir_logs(LG.dir, seg_name, &ndays, err, errlen);
    if (!days) return LTG_ERR;
    int rc = 0;
    for (size_t i = 0; i < ndays && rc == 0; i++) {
        segment *s = seg_new(days[i]);
        struct stat st;
        /* with --cluster, the stream says when a day is over (cl_day_over) */
        int open_day = i == ndays - 1 && (days[i] >= day_of(now) || cl_on());
        uint64_t from = stat(s->f.path, &st) == 0 ? idx_load(s, (uint64_t)st.st_size) : 8;
        if (!open_day && s->nchunk && from == (uint64_t)st.st_size) {
            s->state = SEG_SEALED;
            continue;
        }
        char name[32];
        seg_path(s->day, ".log", NULL, name, sizeof name);
        if (!open_day)
            ltg_log("ledger: rebuilding the index of %s from its log%s", s->f.path,
                    s->nchunk ? " (past the chunks its index file holds)" : "");
        rc = log_open(&s->f, LG.dir, name, SEG_MAGIC, (off_t)from, seg_apply, s, err, errlen);
        if (!open_day && rc == 0) {
            s->state = SEG_SEALING;
            seg_seal_step(s);
        }
    }
    free(days);
    if (rc < 0) return LTG_ERR;
    for (int i = 0; i < LG.nseg; i++)
        if (seg_count(LG.seg[i]) && seg_last_at(LG.seg[i]) > LG.last_at)
            LG.last_at = seg_last_at(LG.seg[i]);
    while (LG.nseg && LG.seg[0]->state == SEG_SEALED &&
           LG.seg[0]->day < ledger_retained_from(now) && ledger_retire(LG.seg[0], now) == 0) {
    }
    const segment *o = seg_open();
    if (o && o->chained && !LG.keyed)
        ltg_log("warning: ledger: %s is chained, and ltg runs without --ledger-key-env: its "
                "events from now on carry no chain, and `ltg verify` will report the day broken "
                "at the first of them",
                o->f.path);
    if (o && !o->chained && LG.keyed && o->f.size > 8)
        ltg_log("ledger: %s began without the chain and stays so: the chain begins with the next "
                "day's log",
                o->f.path);
    return 0;
}

/* --ledger-key-env VAR: the chain's key, the variable's bytes (32 at least). */
static int ledger_key(const char *var, br_hmac_key_context *key, char *err, size_t errlen) {
    const char *k = getenv(var);
    size_t n = k ? strlen(k) : 0;
    if (n < 32) {
        snprintf(err, errlen,
                 "--ledger-key-env %.64s: %s (make one with: head -c 32 /dev/urandom | base64)",
                 var, n ? "the key is shorter than 32 bytes" : "the variable is not set, or empty");
        return LTG_ERR;
    }
    br_hmac_key_init(key, &LTG_SHA256, k, n);
    return 0;
}

/* The stream id of the newest event, "ms-seq" into out (32 bytes), when it
 * has one (an event of the cluster's shared ledger, section 21); else "". */
static void ledger_last_sid(char out[32]) {
    out[0] = 0;
    segment *s = NULL;
    for (int i = LG.nseg - 1; i >= 0 && !s; i--)
        if (seg_count(LG.seg[i])) s = LG.seg[i];
    seg_view v;
    rec_view rv;
    buf rec = {0};
    if (s && view_open(&v, s, 0, NULL, UINT32_MAX) == 0) {
        if (view_record(&v, seg_count(s) - 1, &rec, &rv) == 0 && rv.sid[0])
            snprintf(out, 32, "%llu-%llu", (unsigned long long)rv.sid[0],
                     (unsigned long long)rv.sid[1]);
        view_close(&v);
    }
    buf_free(&rec);
}

/* ---- queries ---- */

typedef struct {
    int64_t start, end;         /* [start, end): whole UTC days */
    const char *key, *group;    /* filters, NULL for none */
    int64_t snap_day;           /* a snapshot: the events of days before snap_day, */
    uint32_t snap_n;            /* and the first snap_n of that day */
} ledger_query;

/* An event as the API shows it: its JSON, with its chain when it has one. */
static void event_json(jwriter *w, const rec_view *rv) {
    size_t n = rv->event_len;
    if (!rv->chain || n < 2 || rv->event[n - 1] != '}') { jw_raw(w, rv->event, n); return; }
    char hex[2 * CHAIN_LEN + 1];
    hex_encode(rv->chain, CHAIN_LEN, hex);
    jw_raw(w, rv->event, n - 1);
    buf_printf(w->out, ",\"chain\":\"%s\"}", hex);
}

/* The events of q, from the skip-th on, at most `size` of them, into w;
 * returns how many q has in all. */
static size_t ledger_page(const ledger_query *q, size_t skip, size_t size, jwriter *w) {
    size_t total = 0;
    buf rec = {0};
    for (int i = 0; i < LG.nseg; i++) {
        segment *s = LG.seg[i];
        if (s->day < q->start || s->day >= q->end || s->day > q->snap_day) continue;
        seg_view v;
        rec_view rv;
        uint32_t pos;
        const char *id = q->key ? q->key : q->group;
        if (view_open(&v, s,
                      q->key     ? 'k'
                      : q->group ? 'g'
                                 : 0,
                      id, s->day == q->snap_day ? q->snap_n : UINT32_MAX) == 0)
            for (uint32_t c = 0; c < seg_parts(s); c++) {
                int64_t n = view_part(&v, c);
                /* A key belongs to one group for life: with both filters, its first event says
                 * whether any match. */
                if (n > 0 && q->key && q->group &&
                    (view_pos(&v, 0, &pos) < 0 || view_record(&v, pos, &rec, &rv) < 0 ||
                     memcmp(rv.group, q->group, 36) != 0))
                    n = 0;
                for (int64_t r = skip > total ? (int64_t)(skip - total) : 0;
                     n > 0 && r < n && total + (size_t)r < skip + size; r++)
                    if (view_pos(&v, (uint64_t)r, &pos) == 0 &&
                        view_record(&v, pos, &rec, &rv) == 0)
                        event_json(w, &rv);
                if (n > 0) total += (size_t)n;
            }
        view_close(&v);
    }
    buf_free(&rec);
    return total;
}

/* A model's usage in a summary. */
typedef struct {
    char alias[ALIAS_MAX + 1];
    usage_row u;
} model_usage;

static void model_usage_add(model_usage **mu, int *n, const char *alias, size_t len,
                            const usage_row *u) {
    int i = 0;
    while (i < *n && (strlen((*mu)[i].alias) != len || memcmp((*mu)[i].alias, alias, len) != 0))
        i++;
    if (i == *n) {
        *mu = xrealloc(*mu, (size_t)(*n + 1) * sizeof **mu);
        memset(&(*mu)[i], 0, sizeof **mu);
        memcpy((*mu)[i].alias, alias, len < ALIAS_MAX ? len : ALIAS_MAX);
        (*n)++;
    }
    usage_sum(&(*mu)[i].u, u);
}

/* The part's usage, of the view's group or of all, per model: into day
 * and, by alias, into *mu. In memory its events are summed; a chunk has
 * its rollups, the group's rows or the per-model ones. */
static void view_usage(const seg_view *v, usage_row *day, model_usage **mu, int *nmu) {
    const ledger_mem *m = &v->s->mem;
    if (!v->h) {
        usage_row *per = xcalloc(m->nnames, sizeof *per);
        uint32_t n = v->kind ? v->nm->npos : m->n;
        for (uint32_t k = 0; k < n; k++) {
            const ledger_entry *e = &m->ix[v->kind ? v->nm->pos[k].pos : k];
            usage_add(&per[e->model], e);
        }
        for (uint32_t k = 0; k < m->nnames; k++)
            if (per[k].requests) {
                usage_sum(day, &per[k]);
                model_usage_add(mu, nmu, m->names[k]->s + 1, strlen(m->names[k]->s + 1), &per[k]);
            }
        free(per);
        return;
    }
    int sec = v->kind ? SEC_ROWS : SEC_MODELROWS;
    uint64_t nrows = v->h->sec[sec][1] / sizeof(idx_row), lo = 0, hi = nrows;
    idx_row row;
    char want[36] = {0};
    if (v->kind) memcpy(want, v->id, 36);
    while (v->kind && lo < hi) { /* the group's first row */
        uint64_t mid = lo + (hi - lo) / 2;
        if (idx_read(v->h, v->fd, sec, mid, 1, &row) < 0) return;
        if (memcmp(row.group, want, 36) < 0) lo = mid + 1;
        else hi = mid;
    }
    for (uint64_t r = lo; r < nrows && idx_read(v->h, v->fd, sec, r, 1, &row) == 0 &&
                          memcmp(row.group, want, 36) == 0;
         r++) {
        idx_name nm;
        char alias[ALIAS_MAX + 2];
        if (idx_read(v->h, v->fd, SEC_NAMES, row.model, 1, &nm) < 0 || nm.len < 2 ||
            nm.len > ALIAS_MAX + 1 || idx_read(v->h, v->fd, SEC_STRINGS, nm.str, nm.len, alias) < 0)
            continue;
        usage_sum(day, &row.u);
        model_usage_add(mu, nmu, alias + 1, nm.len - 1, &row.u);
    }
}

/* Usage of the days [start, start + days), of one group or all: per day
 * (by_day[days]), per model (*mu, *nmu) and in all (total). */
static void ledger_usage(int64_t start, int days, const char *gid, usage_row *by_day,
                         usage_row *total, model_usage **mu, int *nmu) {
    for (int i = 0; i < LG.nseg; i++) {
        segment *s = LG.seg[i];
        if (s->day < start || s->day >= start + days * DAY_MS) continue;
        usage_row *day = &by_day[(s->day - start) / DAY_MS];
        seg_view v;
        if (view_open(&v, s, gid ? 'g' : 0, gid, UINT32_MAX) == 0)
            for (uint32_t c = 0; c < seg_parts(s); c++)
                if (view_part(&v, c) > 0) view_usage(&v, day, mu, nmu);
        usage_sum(total, day);
        view_close(&v);
    }
}

/* Every spend event since `since` that carries an idempotent answer:
 * fn(its record, where it is). */
static void ledger_replays(int64_t since, void (*fn)(const rec_view *rv, int64_t day, uint64_t off,
                                                     uint32_t len)) {
    buf rec = {0};
    for (int i = 0; i < LG.nseg; i++) {
        segment *s = LG.seg[i];
        seg_view v;
        rec_view rv;
        if (s->day + DAY_MS <= since || view_open(&v, s, 0, NULL, UINT32_MAX) < 0) continue;
        for (uint32_t c = 0; c < seg_parts(s); c++) {
            view_part(&v, c);
            uint32_t n = v.h ? (uint32_t)(v.h->sec[SEC_REPLAYS][1] / 4) : s->mem.nrep;
            for (uint32_t k = 0; k < n; k++) {
                uint32_t pos = v.h ? 0 : s->mem.rep[k];
                uint64_t off;
                uint32_t len;
                if (v.h && idx_read(v.h, v.fd, SEC_REPLAYS, k, 1, &pos) < 0) continue;
                pos += v.first;
                if (view_record(&v, pos, &rec, &rv) == 0 && rv.at >= since &&
                    view_loc(&v, pos, &off, &len) == 0)
                    fn(&rv, s->day, off, len);
            }
        }
        view_close(&v);
    }
    buf_free(&rec);
}

/* ---- ltg verify: the chain, checked offline ----
 *
 * `ltg verify --data DIR [--ledger-key-env VAR] [--from DAY] [--head
 * DAY:HEX]...` reads DIR/ledger's logs as a replay does, a day at a time
 * through one buffer, and changes nothing: its memory does not grow with
 * the history. Each chained day's events are chained again from its link
 * and compared with the chains they carry; each link with the head of the
 * chained day before it; each head given with the chain as it stands at
 * the end of that day. One line per day; exit 0 only when all verify. */

typedef struct {
    br_hmac_key_context key;
    int keyed;
    int chained;                /* a chained day verified last: head is where it ends */
    uint8_t head[CHAIN_LEN];
    int64_t head_day;
    char last[128];             /* its last event, "event ID at offset N" */
    int64_t first_day, last_day; /* the days read so far (0: none), whatever they held */
    int last_failed;            /* ... the last one did not verify */
    struct { int64_t day; uint8_t head[CHAIN_LEN]; int done; } *given; /* --head */
    int ngiven, failed;
} verifier;

/* "event ID at offset N" of the record p (payload n bytes) framed at off. */
static void verify_what(const char *p, size_t n, off_t off, char *out, size_t cap) {
    rec_view v;
    const char *k = rec_decode(p, n, &v) == 0 ? memmem(v.event, v.event_len, "\"id\":\"", 6) : NULL;
    const char *e = k ? memchr(k + 6, '"', v.event_len - (size_t)(k + 6 - v.event)) : NULL;
    if (e && e - k < 70)
        snprintf(out, cap, "event %.*s at offset %lld", (int)(e - k - 6), k + 6, (long long)off);
    else snprintf(out, cap, "the record at offset %lld", (long long)off);
}

/* A day's link (continuing day lday's head) against the chain so far:
 * why is set when it does not continue it; note says where a chain begins. */
static void verify_begin(verifier *V, const char *path, int64_t lday, const uint8_t *lhead,
                         char *note, size_t notecap, char *why, size_t cap) {
    char ld[64] = "the seed", vd[64], a[2 * CHAIN_LEN + 1], b[2 * CHAIN_LEN + 1];
    if (!V->keyed) {
        fprintf(stderr, "ltg verify: %s is chained: give its key with --ledger-key-env VAR\n",
                path);
        exit(2);
    }
    if (lday) iso_time(lday, ld);
    if (!V->chained && lday && V->first_day && lday >= V->first_day) {
        /* the day it continues was read here, and holds no chain that verified */
        if (lday == V->last_day && V->last_failed)
            snprintf(note, notecap, " (continues %.10s's head; that day failed)", ld);
        else
            snprintf(why, cap, "its link continues %.10s's head, but %.10s here %s", ld, ld,
                     lday == V->last_day ? "carries no chain: it was rewritten without it"
                     : lday > V->last_day ? "is missing"
                                          : "is not the day before it: days were rewritten");
        return;
    }
    if (!V->chained) { /* before the first day read: deleted by retention, or before --from */
        snprintf(note, notecap, lday ? " (continues %.10s's head, not verified here)"
                                     : " (the chain begins here, from the seed)", ld);
        return;
    }
    if (memcmp(lhead, V->head, CHAIN_LEN) == 0) return;
    iso_time(V->head_day, vd);
    hex_encode(lhead, CHAIN_LEN, a), hex_encode(V->head, CHAIN_LEN, b);
    if (lday == V->head_day)
        snprintf(why, cap, "its link continues %.10s's head %.16s..., but %.10s ends at %.16s... "
                 "after its %s: %.10s was truncated or changed", ld, a, vd, b, V->last, vd);
    else
        snprintf(why, cap, "its link continues %.10s%s, but the chained day before it here is "
                 "%.10s: %s", ld, lday ? "'s head" : "", vd,
                 lday > V->head_day ? "a day between them is missing" : "it was changed");
}

/* The heads given for days before `before` (with `before` itself: at),
 * against the chain as it stands. */
static void verify_given(verifier *V, int64_t before, int at, const uint8_t *head) {
    for (int i = 0; i < V->ngiven; i++) {
        if (V->given[i].done || V->given[i].day > before || (!at && V->given[i].day == before))
            continue;
        char d[64], a[2 * CHAIN_LEN + 1], b[2 * CHAIN_LEN + 1];
        const uint8_t *h = at && V->given[i].day == before ? head : V->chained ? V->head : NULL;
        V->given[i].done = 1;
        iso_time(V->given[i].day, d);
        hex_encode(V->given[i].head, CHAIN_LEN, a);
        if (h && memcmp(h, V->given[i].head, CHAIN_LEN) == 0) {
            printf("%.10s head %s matches the head given\n", d, a);
            continue;
        }
        V->failed++;
        if (!h) printf("%.10s FAILED: the head %.16s... is given, but no verified chain reaches "
                       "the day here\n", d, a);
        else {
            hex_encode(h, CHAIN_LEN, b);
            printf("%.10s FAILED: the head given is %.16s..., the ledger here ends the day at "
                   "%.16s... (after its %s): events were removed or changed\n", d, a, b, V->last);
        }
    }
}

/* One day being verified: where its chain stands, and what went wrong. */
typedef struct {
    const char *path;
    int chained;                /* its link began a chain */
    long long events;
    uint8_t cur[CHAIN_LEN];     /* the chain after its last event verified */
    char what[128], why[512], note[160];
} vday;

/* One whole record of the day (payload p of len bytes, framed at off). */
static void verify_record(verifier *V, vday *D, const char *p, uint32_t len, off_t off) {
    rec_view rv;
    int64_t lday;
    uint8_t want[CHAIN_LEN];
    verify_what(p, len, off, D->what, sizeof D->what);
    if (off == 8 && link_decode(p, len, &lday, D->cur) == 0) {
        verify_begin(V, D->path, lday, D->cur, D->note, sizeof D->note, D->why, sizeof D->why);
        D->chained = !D->why[0];
        return;
    }
    if (rec_decode(p, len, &rv) < 0)
        snprintf(D->why, sizeof D->why, "%s is not a spend event", D->what);
    else if (!D->chained != !rv.chain)
        snprintf(D->why, sizeof D->why, "%s %s", D->what,
                 D->chained ? "carries no chain in a chained day"
                            : "carries a chain in a day without a link");
    else if (D->chained) {
        chain_of(&V->key, D->cur, p, len - CHAIN_LEN, want);
        if (memcmp(want, rv.chain, CHAIN_LEN) != 0)
            snprintf(D->why, sizeof D->why, "%s does not verify: it was changed, an event "
                     "before it was removed or moved, or the key is not this ledger's", D->what);
        memcpy(D->cur, want, CHAIN_LEN);
    }
    if (D->why[0]) return;
    D->events++;
    memcpy(V->last, D->what, sizeof V->last);
}

/* Verify one day's log, framed as replay reads it, and print its line. */
static void verify_day(verifier *V, const char *dir, int64_t day, int newest) {
    char path[320], d[64], hex[2 * CHAIN_LEN + 1];
    vday D = {.path = path};
    seg_path(day, ".log", dir, path, sizeof path);
    iso_time(day, d);
    verify_given(V, day, 0, NULL);
    buf b = {0};
    off_t base = 0, off = 8, end = 0;
    struct stat st;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    const uint8_t *h = fd < 0 || fstat(fd, &st) < 0 ? NULL : log_bytes(fd, &b, &base, 0, 8);
    if (!h || memcmp(h, SEG_MAGIC, 8) != 0)
        snprintf(D.why, sizeof D.why, "%s: %s", path, h ? "not a ledger log" : strerror(errno));
    else end = st.st_size;
    while (!D.why[0] && off < end) {
        off_t left = end - off;
        h = left >= 8 ? log_bytes(fd, &b, &base, off, 8) : NULL;
        uint32_t len = h ? get_le32(h) : 0;
        const uint8_t *r = !h || len > LOG_MAX_RECORD || (off_t)len > left - 8
                                   ? NULL
                                   : log_bytes(fd, &b, &base, off, 8 + (size_t)len);
        int bad_sum = r && crc32(r + 8, len) != get_le32(r + 4);
        if (newest && (!r || (bad_sum && off + 8 + (off_t)len == end))) { /* as replay sees it */
            snprintf(D.note, sizeof D.note, " (a torn last record at offset %lld, a crash "
                     "mid-write: ltg cuts it off at its next start)", (long long)off);
            break;
        }
        if (!r)
            snprintf(D.why, sizeof D.why, "a record cut short at offset %lld: the day was "
                     "truncated", (long long)off);
        else if (bad_sum) {
            verify_what((const char *)r + 8, len, off, D.what, sizeof D.what);
            snprintf(D.why, sizeof D.why, "%s fails its checksum: it was changed", D.what);
        } else verify_record(V, &D, (const char *)r + 8, len, off);
        off += 8 + (off_t)len;
    }
    if (fd >= 0) close(fd);
    buf_free(&b);
    if (!D.why[0] && !D.chained && V->chained)
        snprintf(D.why, sizeof D.why, "no chain (%lld events) after chained days: the chain "
                 "stops here", D.events);
    if (D.why[0]) {
        printf("%.10s FAILED: %s\n", d, D.why);
        V->failed++;
        V->chained = 0; /* what follows is verified on its own */
    } else if (D.chained) {
        hex_encode(D.cur, CHAIN_LEN, hex);
        printf("%.10s ok %lld events, head %s%s\n", d, D.events, hex, D.note);
        V->chained = 1;
        memcpy(V->head, D.cur, CHAIN_LEN);
        V->head_day = day;
    } else printf("%.10s no chain: %lld events%s\n", d, D.events, D.note);
    if (!V->first_day) V->first_day = day;
    V->last_day = day;
    V->last_failed = D.why[0] != 0;
    verify_given(V, day, 1, D.why[0] || !D.chained ? NULL : D.cur);
}

/* ===== 15. Budgets and rate limits, the cache, idempotent inference =====
 *
 * IMPLEMENTATION NOTES
 * Budgets. A group's (or a key's) spend in its current period is the sum
 * of what its events charged since the period began; it lives in its
 * allowance with `reserved`, the worst cases of the requests in flight.
 * Only this section writes that state. The reservation path -- one for
 * budgets and rate limits, below -- admits a request only if spend +
 * reserved + its own worst case fits every budget it answers to (the loop
 * is single-threaded, so concurrent requests cannot together pass it),
 * and replaces the reservation by what the request was charged when it
 * settles. budget_refresh() starts a new period, budget_carry() and
 * budget_forget() follow retention, and budget_recount() sums a spend
 * again from the ledger. At start-up budget_rebuild() does that for every
 * group and every key with a budget from each day's names, which carry
 * what each one's events charged (and, for the day a period starts in,
 * from the running sums of its events), plus what retention carried: no
 * sealed log is read, and a day costs a few reads however busy it was.
 *
 * The cache holds whole non-streaming 200 answers whose usage the
 * provider reported, by (group, endpoint, requested model, body), for the
 * group's cache_ttl, least recently used out first within --cache-mb.
 *
 * Idempotent inference (README "Idempotent inference"): the first whole answer to a request with
 * an Idempotency-Key (up to REPLAY_MAX_BYTES; not a failure, not a cached one) is kept in that
 * request's spend event, on disk; memory keeps only where it is, in the store's idempotency
 * record (about 300 bytes a request, for 24 hours), and a replay reads it back.
 *
 * Rate limits (a group's or a key's rpm_limit, tpm_limit) slide over the last 60
 * seconds, counted in one slot per second (1.4 KiB a limited group or key): a
 * request is admitted only if it fits both, with its worst case of tokens
 * (the body's bytes / 3, what a previous response and file parts add, and
 * its output limit times the answers asked for), and the worst case is
 * replaced by the real usage when it settles. The check and the count
 * happen in the same admission, on one thread: concurrent requests cannot
 * together pass a limit, as with budgets.
 *
 * Response pins: which model and deployment made a Responses API response,
 * so that a follow-up naming it in previous_response_id goes there (its
 * provider holds the conversation). In memory only, by name, for 24
 * hours, at most PIN_MAX, oldest out first: a ring of them, and a hash
 * table by id.
 */

/* Bring a's period up to date: a new period starts with nothing spent
 * (but what a group or key carried into it). Within the period it knows the end
 * of, nothing is computed (a calendar month's takes the C library's date
 * functions; every request asks several times). */
static void budget_refresh(allowance *a, int64_t now) {
    if (a->period_end && now >= a->period_start && now < a->period_end) return;
    int64_t start, end;
    allow_period(a, now, &start, &end);
    if (start != a->period_start) {
        a->period_start = start;
        a->spend = allow_carried(a, start);
    }
    a->period_end = end;
}

/* Micro-USD left in a's period at `now`, or -1 when uncapped. */
static int64_t budget_left(const allowance *a, int64_t now) {
    if (!a->has_budget) return -1;
    int64_t left = usd_to_micro(a->max_budget) - budget_spent(a, now) - a->reserved;
    return left > 0 ? left : 0;
}

static double budget_remaining(const allowance *a, int64_t now) {
    return a->has_budget ? (double)budget_left(a, now) / MICRO : -1;
}

/* Would `more` micro-USD fit a's budget at `now`? */
static int budget_fits(const allowance *a, int64_t more, int64_t now) {
    return !a->has_budget ||
           budget_spent(a, now) + a->reserved + more <= usd_to_micro(a->max_budget);
}

static void budget_recount(allowance *a, char kind, const char *id, int64_t now);

/* After a change to a (of group or key `id`, kind 'g' or 'k'): when it
 * moved the period, what was spent in the new one is summed again. */
static void budget_follow(allowance *a, char kind, const char *id, int64_t now) {
    int64_t start, end;
    allow_period(a, now, &start, &end);
    if (start != a->period_start) budget_recount(a, kind, id, now);
    a->period_end = end; /* a new duration may end the same period elsewhere */
}

/* Day s is to be deleted, in a's current budget period (a lifetime
 * budget's; a's period up to date): what it spent there, `spent`, is
 * carried. `undo` keeps what was carried before, for budget_uncarry when
 * the state log refuses the change. */
static void budget_carry(allowance *a, int64_t spent, segment *s, carry_undo *undo) {
    *undo = (carry_undo){a, a->carry, a->carry_start, a->carry_to};
    a->carry = allow_carried(a, a->period_start) + spent;
    a->carry_start = a->period_start;
    a->carry_to = s->day + DAY_MS;
}

static void budget_uncarry(const carry_undo *u) {
    u->a->carry = u->carry;
    u->a->carry_start = u->start;
    u->a->carry_to = u->to;
}

/* A day of a group without a budget is deleted: what it spent goes from
 * the spend it shows, which counts the days kept. */
static void budget_forget(group *g, int64_t spent) { g->s.al.spend -= spent; }

/* Does the carried spend of a cover day s (it was counted before s was deleted)? */
static int carried_covers(const allowance *a, const segment *s) {
    return a->carry_to > s->day && a->carry_start == a->period_start;
}

/* The spend in its current period of a, the allowance of group or key
 * `id` (kind 'g' or 'k'), summed again from the ledger after a change
 * that moved the period's start. */
static void budget_recount(allowance *a, char kind, const char *id, int64_t now) {
    int64_t start, end;
    allow_period(a, now, &start, &end);
    a->period_start = start;
    a->period_end = end;
    a->spend = allow_carried(a, start);
    for (int i = 0; i < LG.nseg; i++)
        if (LG.seg[i]->day + DAY_MS > start && !carried_covers(a, LG.seg[i]))
            a->spend += seg_spent_since(LG.seg[i], kind, id, start);
}

/* Add what a group or key spent in a sealed day, unless carried already. */
static void rebuild_add(const char *name, allowance *a, int64_t spent, void *ctx) {
    (void)name;
    if (!carried_covers(a, ctx)) a->spend += spent;
}

static void warn_long_period(const allowance *a, const char *what, const char *id) {
    if (a->has_budget && allow_days(a) > S.ledger_days)
        ltg_log("warning: %s %s has a budget period of %d days, longer than --ledger-days %d: what "
                "retention deletes of it is carried",
                what, id, allow_days(a), S.ledger_days);
}

/* Every group's and budgeted key's spend at start-up (see the notes above). */
static void budget_rebuild(int64_t now) {
    for (size_t k = 0; k < sizeof KINDS / sizeof *KINDS; k++)
        for (int i = 0; i < KINDS[k]->all->n; i++) {
            stored *it = KINDS[k]->all->p[i];
            if (!it) continue;
            /* no period yet: budget_refresh starts the current one */
            it->al.period_start = -1;
            it->al.period_end = 0;
            budget_refresh(&it->al, now);
            warn_long_period(&it->al, KINDS[k]->noun, it->id);
        }
    for (int i = 0; i < LG.nseg; i++) seg_spends(LG.seg[i], now, rebuild_add, LG.seg[i]);
}

/* ---- the cache ---- */

typedef struct cache_entry {
    uint8_t key[32];
    struct cache_entry *prev, *next; /* LRU: head is the most recent */
    char *body;
    size_t len;
    char served[ALIAS_MAX + 1]; /* the alias that answered */
    long long tok[NTOK];  /* its usage */
    int64_t expires;      /* S.now ms */
} cache_entry;

static const void *cache_key(const void *it, size_t *n) {
    *n = 32;
    return ((const cache_entry *)it)->key;
}

static struct {
    hmap map;
    cache_entry *head, *tail;
    size_t bytes, limit;
} CACHE = {.map.key = cache_key};

static void cache_unlink(cache_entry *e) {
    if (e->prev) e->prev->next = e->next;
    else CACHE.head = e->next;
    if (e->next) e->next->prev = e->prev;
    else CACHE.tail = e->prev;
    e->prev = e->next = NULL;
}

static void cache_drop(cache_entry *e) {
    cache_unlink(e);
    hmap_del(&CACHE.map, e->key, 32);
    CACHE.bytes -= e->len + sizeof *e;
    free(e->body);
    free(e);
}

/* The key of a cacheable answer: group, requested model, body. */
static void cache_keyof(const char *group_id, const char *path, const char *alias, const char *body,
                        size_t n, uint8_t out[32]) {
    br_sha256_context h;
    br_sha256_init(&h);
    br_sha256_update(&h, group_id, strlen(group_id) + 1);
    br_sha256_update(&h, path, strlen(path) + 1);
    br_sha256_update(&h, alias, strlen(alias) + 1);
    br_sha256_update(&h, body, n);
    br_sha256_out(&h, out);
}

/* Is there a live answer under key? (It changes nothing: no LRU move.) */
static int cache_holds(const uint8_t key[32]) {
    cache_entry *e = hmap_get(&CACHE.map, key, 32);
    return e && e->expires > S.now;
}

static cache_entry *cache_get(const uint8_t key[32]) {
    cache_entry *e = hmap_get(&CACHE.map, key, 32);
    if (!e) return NULL;
    if (e->expires <= S.now) { cache_drop(e); return NULL; }
    cache_unlink(e);
    e->next = CACHE.head;
    if (CACHE.head) CACHE.head->prev = e;
    CACHE.head = e;
    if (!CACHE.tail) CACHE.tail = e;
    return e;
}

static void cache_put(const uint8_t key[32], const char *body, size_t n, const char *served,
                      const long long tok[NTOK], int64_t ttl_ms) {
    if (n + sizeof(cache_entry) > CACHE.limit) return;
    cache_entry *old = hmap_get(&CACHE.map, key, 32);
    if (old) cache_drop(old);
    while (CACHE.tail && CACHE.bytes + n + sizeof(cache_entry) > CACHE.limit)
        cache_drop(CACHE.tail);
    cache_entry *e = xcalloc(1, sizeof *e);
    memcpy(e->key, key, 32);
    e->body = xmalloc(n ? n : 1);
    memcpy(e->body, body, n);
    e->len = n;
    snprintf(e->served, sizeof e->served, "%s", served);
    memcpy(e->tok, tok, sizeof e->tok);
    e->expires = S.now + ttl_ms;
    e->next = CACHE.head;
    if (CACHE.head) CACHE.head->prev = e;
    CACHE.head = e;
    if (!CACHE.tail) CACHE.tail = e;
    hmap_put(&CACHE.map, e);
    CACHE.bytes += n + sizeof *e;
}

/* ---- idempotent inference ---- */

/* The replay record written with a spend event: the first answer itself. */
static void inf_idem_json(buf *out, const idem *r, const char *answer, size_t n) {
    jwriter w;
    jw_init(&w, out);
    jw_open(&w, '{');
    idem_json_head(&w, r);
    jw_key(&w, "st"), jw_bool(&w, r->stream);
    jw_key(&w, "m"), jw_cstr(&w, r->served);
    jw_key(&w, "a"), jw_str(&w, answer, n);
    jw_close(&w, '}');
}

/* The replay record of an event found at start-up (ledger_replays). */
static void inf_idem_restore(const rec_view *rv, int64_t day, uint64_t off, uint32_t len) {
    const char *p = rv->replay;
    json_tok t[16];
    json_result res;
    idem head = {.inference = 1};
    if (json_parse(p, rv->replay_len, t, 16, 1, &res) < 0 || idem_parse_head(p, t, 0, &head) < 0)
        return;

    int m = json_get(p, t, 0, "m"), str = json_get(p, t, 0, "st");
    if (m < 0) return;
    idem *rec = xmalloc(sizeof *rec);
    *rec = head;
    rec->stream = str >= 0 && t[str].type == JSON_TRUE;
    rec->day = day;
    rec->off = off;
    rec->len = len;
    rec->expires = rv->at + IDEM_TTL_MS;
    snprintf(rec->served, sizeof rec->served, "%.*s", (int)(t[m].end - t[m].start), p + t[m].start);
    idem_put(rec, 0); /* a later answer for the same key wins */
}

/* The first answer of r, read back from its spend event into out: 0, or
 * LTG_ERR when the day is gone or the record cannot be read. */
static int inf_idem_answer(const idem *r, buf *out) {
    segment *s = NULL;
    for (int i = 0; i < LG.nseg && !s; i++)
        if (LG.seg[i]->day == r->day) s = LG.seg[i];
    seg_view v;
    rec_view rv;
    buf rec = {0};
    json_tok t[16];
    json_result res;
    int rc = LTG_ERR, a;
    if (s && view_open(&v, s, 0, NULL, UINT32_MAX) >= 0) {
        if (seg_record_at(&v, r->off, r->len, &rec, &rv) == 0 &&
            json_parse(rv.replay, rv.replay_len, t, 16, 1, &res) == 0 &&
            (a = json_get(rv.replay, t, 0, "a")) >= 0 && t[a].type == JSON_STRING) {
            out->len = 0;
            json_unescape(rv.replay, t, a, out);
            if (!out->p) buf_reserve(out, 0);
            rc = 0;
        }
        view_close(&v);
    }
    buf_free(&rec);
    return rc;
}

/* Expired idempotency records leave memory (and so the live state). */
static void store_purge(int64_t now) {
    ST.frozen = 1; /* no squeeze under the walk */
    for (size_t i = 0; i < ST.idems.cap; i++) {
        idem *r = ST.idems.slot[i];
        if (r && r != HMAP_TOMB && idem_gone(r, now)) idem_drop(r);
    }
    ST.frozen = 0;
    vec_squeeze(&ST.iv);
}

/* Called by the loop before it sleeps: the ledger's turn (section 14),
 * expired idempotency records leave memory once a minute, and a
 * compaction takes its next step. Returns 1 while a compaction remains (the
 * loop then polls without waiting). */
static int store_tick(void) {
    static int64_t purged;
    int64_t now = wall_ms();
    ledger_tick(now);
    if (S.now - purged > 60000 && !ST.frozen) {
        purged = S.now;
        store_purge(now);
    }
    if (compact_due(now)) compact_start();
    if (!LOG.compacting) return 0;
    compact_step(now);
    return LOG.compacting;
}

/* ---- rate limits: requests and tokens in the last 60 seconds ---- */
#define RL_SLOTS 60

typedef struct rl_window {
    int64_t sec[RL_SLOTS];            /* the second (S.now / 1000) a slot counts; older: empty */
    int64_t req[RL_SLOTS], tok[RL_SLOTS];
} rl_window;

static int64_t rl_used(const rl_window *w, int64_t now, int tokens) {
    int64_t sum = 0;
    for (int i = 0; w && i < RL_SLOTS; i++)
        if (w->sec[i] > now - RL_SLOTS) sum += tokens ? w->tok[i] : w->req[i];
    return sum;
}

/* Seconds until `need` more fits under `limit`, as the oldest seconds leave. */
static long rl_wait(const rl_window *w, int64_t now, int tokens, int64_t need, int64_t limit) {
    int64_t used = rl_used(w, now, tokens);
    for (int64_t sec = now - RL_SLOTS + 1; sec <= now; sec++) {
        int i = (int)(sec % RL_SLOTS);
        if (w->sec[i] != sec) continue;
        used -= tokens ? w->tok[i] : w->req[i];
        if (used + need <= limit) return (long)(sec + RL_SLOTS - now);
    }
    return RL_SLOTS;
}

/* Does a request of `tokens` (worst case) fit a's limits now? 0, or the
 * seconds to wait (*which names the limit). */
static long rate_check(const allowance *a, int requests, int64_t tokens, const char **which) {
    int64_t now = S.now / 1000;
    if (requests && a->rpm_limit != UNSET && rl_used(a->rl, now, 0) + 1 > a->rpm_limit) {
        *which = "rpm_limit";
        return rl_wait(a->rl, now, 0, 1, a->rpm_limit);
    }
    if (a->tpm_limit != UNSET && rl_used(a->rl, now, 1) + tokens > a->tpm_limit) {
        *which = "tpm_limit";
        return rl_wait(a->rl, now, 1, tokens, a->tpm_limit);
    }
    return 0;
}

/* Count `requests` (1, or 0 for a later attempt of one) of `tokens`
 * (worst case) in a's window, in second `sec` -- unless that second has
 * left the window. */
static void rate_count(allowance *a, int requests, int64_t tokens, int64_t sec) {
    if (a->rpm_limit == UNSET && a->tpm_limit == UNSET) return;
    if (!a->rl) a->rl = xcalloc(1, sizeof *a->rl);
    int i = (int)(sec % RL_SLOTS);
    if (a->rl->sec[i] > sec) return;
    if (a->rl->sec[i] != sec) {
        a->rl->sec[i] = sec;
        a->rl->req[i] = 0;
        a->rl->tok[i] = 0;
    }
    a->rl->req[i] += requests;
    a->rl->tok[i] += tokens;
}

/* The request counted `reserved` tokens in second `sec`; it used `used`. */
static void rate_settle(allowance *a, int64_t sec, int64_t reserved, int64_t used) {
    if (!a->rl || !sec) return;
    int i = (int)(sec % RL_SLOTS);
    if (a->rl->sec[i] != sec) return; /* that second has left the window */
    a->rl->tok[i] += used - reserved;
    if (a->rl->tok[i] < 0) a->rl->tok[i] = 0;
}

/* ---- the reservation path: budgets and rate limits, together ----
 *
 * A request answers to its key's allowance and its group's. It is held
 * against all of them in one call and settled in one call:
 * hold_reserve() checks every rate limit, then every budget, and holds the
 * worst case in all of them or in none; hold_settle() replaces the hold by
 * what the request was charged and used (a release is a settle of
 * nothing). They are the seam for a store that several ltg instances
 * share: it replaces these two, not the callers. */
typedef struct hold {
    int64_t cost;   /* micro-USD held against each budget */
    int64_t tok;    /* tokens counted in each window */
    int64_t sec;    /* the second they are counted in */
    int held;       /* something is held (a later attempt adds to it) */
    /* with --cluster, held in the shared store (section 21): its id there ("" none), and the
     * list of live ones, whose leases are renewed */
    char cid[40];
    char scope[2][39];  /* the key's and the group's there: "k:<id>", "g:<id>" */
    int64_t less, fewer; /* shrunk here, not there yet: sent before a later attempt's hold */
    struct hold *prev, *next;
} hold;

typedef struct {
    int who;            /* the allowance that refused: its index */
    const char *limit;  /* "rpm_limit", "tpm_limit" or "max_budget" */
    long wait;          /* a rate limit's seconds until enough frees */
} hold_refusal;

static int hold_reserve(allowance *const al[], int n, int64_t cost, int64_t tok, int64_t now,
                        hold *h, hold_refusal *why) {
    /* a later attempt of a request held already: the request itself is counted */
    int more = h->held;
    /* admission: where a budget period ends */
    for (int i = 0; i < n; i++) budget_refresh(al[i], now);
    for (int i = 0; i < n; i++)
        if ((why->wait = rate_check(al[i], !more, tok, &why->limit))) {
            why->who = i;
            return LTG_ERR;
        }
    for (int i = 0; i < n; i++)
        if (!budget_fits(al[i], cost, now)) {
            *why = (hold_refusal){i, "max_budget", 0};
            return LTG_ERR;
        }
    if (!more) *h = (hold){.sec = S.now / 1000, .held = 1};
    h->cost += cost;
    h->tok += tok;
    for (int i = 0; i < n; i++) {
        al[i]->reserved += cost;
        rate_count(al[i], !more, tok, h->sec);
    }
    return 0;
}

/* The request held *h: it was charged `charged` micro-USD and used `used`
 * tokens. An allowance gone meanwhile (its key or group deleted) is NULL. */
static void cl_settle(hold *h, int end, int64_t cost, int64_t tok, int64_t now,
                      const buf *event);

static void hold_settle(allowance *const al[], int n, hold *h, int64_t charged, int64_t used,
                        int64_t now, const buf *event) {
    /* with --cluster the settle and the event go to the shared store; what
     * was spent is counted when the event comes back from it (cl_event) */
    if (cl_on() && ((h->cid[0] && h->held) || event)) cl_settle(h, 1, charged, used, now, event);
    for (int i = 0; h->held && !h->cid[0] && i < n; i++) {
        if (!al[i]) continue;
        budget_refresh(al[i], now);
        al[i]->reserved -= h->cost;
        al[i]->spend += cl_on() ? 0 : charged;
        /* what is held is what requests in flight hold: no more is let go */
        assert(al[i]->reserved >= 0);
        rate_settle(al[i], h->sec, h->tok, used);
    }
    *h = (hold){0};
}

/* One attempt of the request holding *h is billed: `less` micro-USD and
 * `fewer` tokens of its worst case were not used, and are let go now, so
 * that a later attempt is admitted against what was really spent (the
 * rest of the hold is settled with the request). */
static void hold_shrink(allowance *const al[], int n, hold *h, int64_t less, int64_t fewer) {
    if (h->cid[0] && h->held) { /* the settle that ends the request lets all go at once */
        h->less += less;
        h->fewer += fewer;
    }
    for (int i = 0; h->held && !h->cid[0] && i < n; i++) {
        if (!al[i]) continue;
        al[i]->reserved -= less;
        rate_settle(al[i], h->sec, fewer, 0);
    }
    if (h->held) {
        h->cost -= less;
        h->tok -= fewer;
    }
}

/* ---- response pins (previous_response_id) ---- */
#define PIN_MAX 32768
#define PIN_TTL_MS (24LL * 3600 * 1000)

typedef struct {
    int64_t at;      /* S.now when made */
    size_t idlen;
    /* its input and output: what a follow-up's provider adds to the input (-1: unknown) */
    long long tokens;
    /* the group's id (36), the response id: the key (idlen bytes); NUL, the alias, NUL, the
     * deployment, NUL */
    char text[];
} pin;

static const void *pin_key(const void *it, size_t *n) {
    *n = ((const pin *)it)->idlen;
    return ((const pin *)it)->text;
}
static struct {
    hmap map;
    pin **ring;      /* PIN_MAX slots, oldest at `head` */
    int head, n;
} PINS = {.map = {.key = pin_key}};

static void pin_drop_oldest(void) {
    pin *p = PINS.ring[PINS.head];
    PINS.ring[PINS.head] = NULL;
    PINS.head = (PINS.head + 1) % PIN_MAX;
    PINS.n--;
    if (hmap_get(&PINS.map, p->text, p->idlen) == p) hmap_del(&PINS.map, p->text, p->idlen);
    free(p);
}

static void pins_expire(void) {
    while (PINS.n && PINS.ring[PINS.head]->at + PIN_TTL_MS <= S.now) pin_drop_oldest();
}

/* A pin is the group's: another group's key neither finds it nor learns
 * that it exists (its follow-up goes where it asks, and the provider,
 * which holds the conversation under its own account, decides). */
static pin *pin_find(const char *gid, const char *id, size_t n) {
    char k[36 + 256];
    if (n > 256) return NULL;
    memcpy(k, gid, 36);
    memcpy(k + 36, id, n);
    return hmap_get(&PINS.map, k, 36 + n);
}

/* Response `id` (n bytes) of a request of `group` was made by `alias` on
 * deployment `dep` (gid: the group's id). */
static void pin_put(const char *gid, const char *id, size_t n, const char *alias, const char *dep) {
    if (!n || n > 256) return; /* an id is short; a long one is not a provider's */
    if (!PINS.ring) PINS.ring = xcalloc(PIN_MAX, sizeof *PINS.ring);
    pins_expire();
    if (PINS.n == PIN_MAX) pin_drop_oldest(); /* full: the oldest makes room */
    size_t kn = 36 + n, an = strlen(alias), dn = strlen(dep);
    pin *p = xcalloc(1, sizeof *p + kn + an + dn + 3);
    p->at = S.now;
    p->idlen = kn;
    p->tokens = -1;
    memcpy(p->text, gid, 36);
    memcpy(p->text + 36, id, n);
    memcpy(p->text + kn + 1, alias, an);
    memcpy(p->text + kn + an + 2, dep, dn);
    /* an id made twice: the newer wins; the older leaves with its ring slot */
    hmap_put(&PINS.map, p);
    PINS.ring[(PINS.head + PINS.n++) % PIN_MAX] = p;
}

/* The alias that made response `id` for `group`, or NULL; *dep gets its
 * deployment's name, *tokens its usage (-1: unknown). */
static const char *pin_get(const char *gid, const char *id, size_t n, const char **dep,
                           long long *tokens) {
    pins_expire();
    pin *p = pin_find(gid, id, n);
    if (!p) return NULL;
    const char *alias = p->text + p->idlen + 1;
    *dep = alias + strlen(alias) + 1;
    *tokens = p->tokens;
    return alias;
}

/* Response `id` of `group` used `tokens` in all, input and output. */
static void pin_tokens(const char *gid, const char *id, long long tokens) {
    pin *p = pin_find(gid, id, strlen(id));
    if (p) p->tokens = tokens;
}

/* ===== 16. The control plane =====
 *
 * IMPLEMENTATION NOTES
 * /v2/llm_token_gateway on the admin listener (README "The control plane"). Every request
 * names an admin key from the catalog; a key's permissions decide what it
 * may do (a write permission includes the matching read). Bodies and errors
 * follow JSON:API's shape: {"data":...}, {"errors":[...]}.
 *
 * A change goes through the same steps, in this order:
 *   1. Idempotency-Key: a key seen before with the same body answers the
 *      stored first answer (x-ltg-replayed: true); with another body, 409.
 *      This comes before If-Match on purpose: a client retrying a PATCH
 *      that did succeed must get its answer, not a 412 about its own change.
 *   2. If-Match (PATCH, DELETE): missing 428, stale 412 with the version.
 *   3. Parse and validate on a copy (section 12): 400 changes nothing.
 *   4. One log record with the change and its idempotency record, fsynced
 *      (section 13); only then the copy replaces the original in memory.
 * Groups and keys are served by the same handlers (item_get, item_list,
 * item_create, item_update, item_delete) over their row of section 12;
 * admin_change is the one step every change takes.
 */
#define API_PREFIX "/v2/llm_token_gateway"

typedef struct {
    int perms;
    uint8_t sha[32];
} admin_who;

static const char *error_title(const char *code, int status) {
    static const struct { const char *code, *title; } titles[] = {
        {"invalid_request", "Invalid request"}, {"invalid_json", "Invalid JSON"},
        {"model_not_in_catalog", "Model not in catalog"}, {"precondition_failed", "Stale If-Match"},
        {"precondition_required", "If-Match required"}, {"idempotency_conflict", "Idempotency key reused"},
        {"idempotency_key_required", "Idempotency-Key required"}, {"permission_denied", "Permission denied"},
        {"unauthorized", "Unauthorized"}, {"not_found", "Not found"}, {"storage_unavailable", "Storage unavailable"}};
    for (size_t i = 0; i < sizeof titles / sizeof *titles; i++)
        if (strcmp(titles[i].code, code) == 0) return titles[i].title;
    return http_reason(status);
}

/* A JSON:API error; `pointer` may be NULL, `current_version` 0 for none. */
static void admin_error(conn *c, int status, const char *code, const char *pointer,
                        long long current_version, const char *fmt, ...) {
    char detail[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    buf b = {0}, h = {0};
    jwriter w;
    jw_init(&w, &b);
    jw_open(&w, '{'), jw_key(&w, "errors"), jw_open(&w, '['), jw_open(&w, '{');
    jw_key(&w, "code"), jw_cstr(&w, code);
    jw_key(&w, "title"), jw_cstr(&w, error_title(code, status));
    jw_key(&w, "detail"), jw_cstr(&w, detail);
    if (pointer && *pointer) {
        jw_key(&w, "source"), jw_open(&w, '{');
        jw_key(&w, "pointer"), jw_cstr(&w, pointer);
        jw_close(&w, '}');
    }
    jw_key(&w, "meta"), jw_open(&w, '{');
    if (current_version) {
        jw_key(&w, "current_version"), jw_int(&w, current_version);
    }
    jw_close(&w, '}');
    jw_close(&w, '}'), jw_close(&w, ']'), jw_close(&w, '}');
    buf_printf(&h, "Cache-Control: no-store\r\nX-Request-ID: %s\r\n", c->rid);
    if (status == 401) buf_puts(&h, "WWW-Authenticate: Bearer\r\n");
    conn_to(c, CONN_BUSY);
    conn_reply(c, status, "application/json", h.p, b.p, b.len);
    buf_free(&b);
    buf_free(&h);
}

static void admin_verr(conn *c, const verr *e) {
    admin_error(c, 400, e->code, e->pointer, 0, "%s", e->detail);
}

/* A success: {"data": ...} already in `body`; version > 0 adds the ETag. */
static void admin_reply(conn *c, int status, long long version, int replayed, const char *body,
                        size_t n) {
    buf h = {0};
    buf_printf(&h, "Cache-Control: no-store\r\nX-Request-ID: %s\r\n", c->rid);
    if (version > 0) buf_printf(&h, "ETag: \"%lld\"\r\n", version);
    if (replayed) buf_puts(&h, "x-ltg-replayed: true\r\n");
    conn_reply(c, status, "application/json", h.p, body, n);
    buf_free(&h);
}

/* The permissions of the admin keys whose SHA-256 is sha, into *perms: 1 when one matched.
 * Every key is compared: the time does not say which matched. */
static int admin_perms(const uint8_t sha[32], int *perms) {
    int found = 0;
    *perms = 0;
    for (int i = 0; i < S.cat->nadmins; i++)
        if (secret_eq(sha, 32, S.cat->admins[i].sha, 32)) {
            *perms |= S.cat->admins[i].perms;
            found = 1;
        }
    return found;
}

/* Who is asking: 0 with *who filled, or LTG_ERR after answering 401. */
static int admin_auth(conn *c, admin_who *who) {
    size_t n;
    const char *key = request_bearer(c, &n);
    if (!key) {
        admin_error(c, 401, "unauthorized", NULL, 0,
                    "missing admin key: send Authorization: Bearer <admin key>");
        return LTG_ERR;
    }
    if (n >= 7 && memcmp(key, "ltg_sk_", 7) == 0) {
        admin_error(c, 401, "unauthorized", NULL, 0,
                    "a token key cannot manage the gateway: token keys are for the inference "
                    "plane; use an admin key");
        return LTG_ERR;
    }
    sha256(key, n, who->sha);
    if (!admin_perms(who->sha, &who->perms)) {
        admin_error(c, 401, "unauthorized", NULL, 0, "unknown admin key");
        return LTG_ERR;
    }
    return 0;
}

/* Does the request carry one of the catalog's admin keys (route_body_allowed)? */
static int admin_key_known(conn *c) {
    size_t n;
    uint8_t sha[32];
    int perms;
    const char *key = request_bearer(c, &n);
    if (!key) return 0;
    sha256(key, n, sha);
    return admin_perms(sha, &perms);
}

/* Does `who` hold permission bit `need`? Answers 403 when not. A write
 * permission includes the matching read. */
static int admin_allowed(conn *c, const admin_who *who, int need) {
    int have = who->perms;
    if (have & PERM_GROUPS_WRITE) have |= PERM_GROUPS_READ;
    if (have & PERM_KEYS_WRITE) have |= PERM_KEYS_READ;
    if ((have & PERM_ALL) || (have & need)) return 1;
    int bit = 0;
    while ((1 << bit) != need) bit++;
    admin_error(c, 403, "permission_denied", NULL, 0, "this admin key lacks the permission %s",
                perm_names[bit]);
    return 0;
}

/* Decode %XX escapes of s[0..n) into out (NUL-terminated, truncated to cap). */
static void percent_decode(const char *s, size_t n, char *out, size_t cap) {
    size_t k = 0;
    for (size_t i = 0; i < n && k + 1 < cap; i++) {
        if (s[i] == '%' && i + 2 < n && hexval((unsigned char)s[i + 1]) >= 0 &&
            hexval((unsigned char)s[i + 2]) >= 0)
            out[k++] =
                    (char)(hexval((unsigned char)s[i + 1]) << 4 | hexval((unsigned char)s[i + 2])),
            i += 2;
        else out[k++] = s[i] == '+' ? ' ' : s[i];
    }
    out[k] = 0;
}

/* The value of query parameter `name` (or its alias), decoded; NULL if absent. */
static const char *query_get(conn *c, const char *name, const char *alias, char *out, size_t cap) {
    const char *t = c->in.p + c->req.target.off, *end = t + c->req.target.len;
    const char *q = memchr(t, '?', (size_t)(end - t));
    if (!q) return NULL;
    for (const char *p = q + 1; p < end;) {
        const char *amp = memchr(p, '&', (size_t)(end - p));
        if (!amp) amp = end;
        const char *eq = memchr(p, '=', (size_t)(amp - p));
        char key[64];
        percent_decode(p, (size_t)((eq ? eq : amp) - p), key, sizeof key);
        if (strcmp(key, name) == 0 || (alias && strcmp(key, alias) == 0)) {
            if (eq) percent_decode(eq + 1, (size_t)(amp - eq - 1), out, cap);
            else out[0] = 0;
            return out;
        }
        p = amp + 1;
    }
    return NULL;
}

/* page[number] and page[size] (README "The consumption ledger"); 0, or LTG_ERR after a 400. */
static int page_params(conn *c, int *number, int *size) {
    char v[32];
    long long n;
    *number = 1;
    *size = 50;
    if (query_get(c, "page[number]", "page_number", v, sizeof v)) {
        if (parse_ll(v, strlen(v), 1000000000, &n) < 0 || n < 1) {
            admin_error(c, 400, "invalid_request", NULL, 0,
                        "page[number] must be a whole number >= 1");
            return LTG_ERR;
        }
        *number = (int)n;
    }
    if (query_get(c, "page[size]", "page_size", v, sizeof v)) {
        if (parse_ll(v, strlen(v), 1000000000, &n) < 0 || n < 1 || n > 1000) {
            admin_error(c, 400, "invalid_request", NULL, 0,
                        "page[size] must be between 1 and 1000");
            return LTG_ERR;
        }
        *size = (int)n;
    }
    return 0;
}

/* "meta" of a list, left open for what the caller adds. */
static void page_meta(jwriter *w, int number, int size, int total) {
    int pages = (total + size - 1) / size;
    jw_key(w, "meta"), jw_open(w, '{');
    jw_key(w, "page_number"), jw_int(w, number);
    jw_key(w, "page_size"), jw_int(w, size);
    jw_key(w, "total_results"), jw_int(w, total);
    jw_key(w, "total_pages"), jw_int(w, pages);
    jw_key(w, "has_more"), jw_bool(w, number < pages);
}

/* If-Match against `version`: 1 when it matches, 0 after answering 428/412/400. */
static int if_match(conn *c, long long version) {
    size_t n;
    const char *v = http_header_get(c->in.p, c->req.h, c->req.nh, "if-match", &n);
    if (!v) {
        admin_error(c, 428, "precondition_required", NULL, 0,
                    "this change needs If-Match: \"<version>\" (the ETag of your last read)");
        return 0;
    }
    if (n == 1 && *v == '*') return 1;
    if (n >= 2 && v[0] == 'W' && v[1] == '/') {
        v += 2;
        n -= 2;
    }
    if (n >= 2 && v[0] == '"' && v[n - 1] == '"') {
        v++;
        n -= 2;
    }
    long long want;
    if (parse_ll(v, n, LLONG_MAX / 2, &want) < 0) {
        admin_error(c, 400, "invalid_request", NULL, 0,
                    "If-Match must be a quoted version, like \"3\"");
        return 0;
    }
    if (want != version) {
        admin_error(
                c, 412, "precondition_failed", NULL, version,
                "the resource is at version %lld, not %lld: read it again and reapply your change",
                version, want);
        return 0;
    }
    return 1;
}

typedef struct {
    uint8_t key[32], body[32];
} idem_ticket;

/* Step 1 of a change. Returns 1 to go on (ticket filled), 0 when answered
 * (a replay, a conflict, or a missing key). */
static int idem_begin(conn *c, const admin_who *who, idem_ticket *tk) {
    size_t n;
    const char *v = http_header_get(c->in.p, c->req.h, c->req.nh, "idempotency-key", &n);
    if (!v || n == 0 || n > 255) {
        admin_error(c, 400, "idempotency_key_required", NULL, 0,
                    "every POST, PATCH and DELETE needs an Idempotency-Key header (1 to 255 "
                    "characters, e.g. a UUID)");
        return 0;
    }
    br_sha256_context h;
    br_sha256_init(&h);
    br_sha256_update(&h, who->sha, 32);
    br_sha256_update(&h, c->in.p + c->req.method.off, c->req.method.len);
    br_sha256_update(&h, " ", 1);
    size_t pn;
    const char *path = request_path(c, &pn);
    br_sha256_update(&h, path, pn);
    br_sha256_update(&h, "\n", 1);
    br_sha256_update(&h, v, n);
    br_sha256_out(&h, tk->key);
    sha256(c->body.p, c->body.len, tk->body);
    idem *r = idem_find(tk->key, 0, wall_ms());
    if (!r) return 1;
    if (memcmp(r->body, tk->body, 32) != 0) {
        admin_error(c, 409, "idempotency_conflict", NULL, 0,
                    "this Idempotency-Key was used for a different request body: use a new key for "
                    "a new change");
        return 0;
    }
    admin_reply(c, r->status, r->version, 1, r->response, strlen(r->response));
    return 0;
}

/* With --cluster, a change goes through the shared store instead (section 21). */
static void cl_change(conn *c, const buf *rec, const idem *r, const stored *it, long long base,
                      const char *parent, int status, const buf *reply, int del);

/* Step 4 of every change: log `ops` (a JSON array) with the idempotency
 * record of its answer -- `kept` (a body) with `kept_status` and
 * `version` -- fsync, and only then apply it to memory (`it` put in the
 * store, or, with `del`, deleted from it) and answer `reply` with
 * `status`. (They differ for a key's creation alone: its answer shows the
 * secret once, a replay of it does not.) When the log refuses: 503,
 * nothing applied, a new item dropped. */
static void admin_change(conn *c, const idem_ticket *tk, const buf *ops, const store_kind *K,
                         stored *it, int del, int status, long long version, const buf *reply,
                         int kept_status, const buf *kept) {
    idem *r = xcalloc(1, sizeof *r);
    memcpy(r->key, tk->key, 32);
    memcpy(r->body, tk->body, 32);
    r->done = 1;
    r->status = kept_status;
    r->version = version;
    r->response = xstrdup(kept->p);
    r->expires = wall_ms() + IDEM_TTL_MS;
    buf p = {0};
    jwriter w;
    jw_init(&w, &p);
    jw_open(&w, '{');
    jw_key(&w, "ops"), jw_raw(&w, ops->p, ops->len);
    jw_key(&w, "idem");
    idem_json(&w, r);
    jw_close(&w, '}');
    if (cl_on()) { /* the shared stream decides, and every instance applies it (section 21) */
        const char *parent = K == &KEYS ? ((const tkey *)it)->group_id : "";
        cl_change(c, &p, r, it, del ? it->version : version - 1, parent, status, reply, del);
        idem_free(r);
        if (!del) K->drop(it);
        buf_free(&p);
        return;
    }
    const char *why;
    int rc = state_append(p.p, p.len, &why);
    size_t idem_bytes = p.len - ops->len;
    buf_free(&p);
    if (rc < 0) {
        idem_free(r);
        if (!del) K->drop(it);
        admin_error(c, 503, "storage_unavailable", NULL, 0, "%s", why);
        return;
    }
    idem_put(r, idem_bytes);
    if (del) store_del(K, it->id);
    else store_put(K, it, ops->len + 8); /* what the change alone would take in a snapshot */
    admin_reply(c, status, version, 0, reply->p, reply->len);
}

/* Parse an admin request body; 0, or LTG_ERR after a 400 invalid_json. */
static int admin_body(conn *c, json_tok **t) {
    *t = NULL;
    if (c->body.len > (1 << 20)) {
        admin_error(c, 413, "body_too_large", NULL, 0, "control-plane bodies are limited to 1 MiB");
        return LTG_ERR;
    }
    int max = (int)(c->body.len / 2 + 4);
    *t = xcalloc((size_t)max, sizeof **t);
    json_result res;
    if (json_parse(c->body.p, c->body.len, *t, max, -1, &res) == 0) return 0;
    admin_error(c, 400, "invalid_json", NULL, 0,
                "the body is not valid JSON: %s at byte offset %zu", res.err, res.err_offset);
    free(*t);
    *t = NULL;
    return LTG_ERR;
}

static void data_open(jwriter *w, buf *b) {
    jw_init(w, b);
    jw_open(w, '{');
    jw_key(w, "data");
}

/* {"data": it}, as the API shows it. */
static void item_body(buf *b, const store_kind *K, const stored *it) {
    jwriter w;
    data_open(&w, b);
    K->json(&w, it, 0);
    jw_close(&w, '}');
}

/* The {id} of a path names no item of kind K: 404 -- unless it is a
 * change whose Idempotency-Key has a kept answer (the retry of a DELETE
 * that did succeed): that answer, again. NULL when answered. */
static stored *admin_item(conn *c, const admin_who *who, const store_kind *K, const char *id) {
    stored *it = store_find(K, id);
    if (it) return it;
    idem_ticket tk;
    size_t n;
    if (!method_is(c, "GET") &&
        http_header_get(c->in.p, c->req.h, c->req.nh, "idempotency-key", &n) &&
        !idem_begin(c, who, &tk))
        return NULL;
    admin_error(c, 404, "not_found", NULL, 0, "no %s has this id", K->noun);
    return NULL;
}

/* Step 3: lay the body over `it` and check the result; 0, or LTG_ERR
 * after a 400 (it dropped). Frees the tokens either way. */
static int item_parse(conn *c, const store_kind *K, json_tok *t, stored *it, int mode) {
    verr e = {0};
    int bad = K->parse(c->body.p, t, 0, it, mode, &e) < 0 || K->validate(it, S.cat, &e) < 0;
    free(t);
    if (!bad) return 0;
    admin_verr(c, &e);
    K->drop(it);
    return LTG_ERR;
}

/* GET /token_groups/{id}, GET /token_keys/{id} */
static void item_get(conn *c, const admin_who *who, const char *id, const store_kind *K) {
    stored *it = admin_item(c, who, K, id);
    if (!it) return;
    buf b = {0};
    item_body(&b, K, it);
    admin_reply(c, 200, it->version, 0, b.p, b.len);
    buf_free(&b);
}

/* Step 4 for a new or changed item: log its new state with the answer,
 * then swap it in (or drop it when the log refused). A new key's answer
 * also shows its secret. */
static void item_commit(conn *c, const idem_ticket *tk, const store_kind *K, stored *it, int status,
                        const char *secret) {
    budget_follow(&it->al, K->ledger, it->id, wall_ms());
    buf ops = {0}, body = {0}, shown = {0};
    jwriter w;
    jw_init(&w, &ops);
    jw_open(&w, '[');
    jw_open(&w, '{');
    jw_name(&w, K->put_op);
    K->json(&w, it, 1);
    jw_close(&w, '}');
    jw_close(&w, ']');
    item_body(&body, K, it);
    if (secret) { /* the answer is the replay's data plus the secret */
        buf_append(&shown, body.p, body.len - 2);
        buf_printf(&shown, ",\"token\":\"%s\"}}", secret);
    }
    admin_change(c, tk, &ops, K, it, 0, status, it->version, secret ? &shown : &body,
                 secret ? 200 : status, &body);
    if (secret) memset(shown.p, 0, shown.len);
    buf_free(&ops);
    buf_free(&body);
    buf_free(&shown);
}

/* POST /token_groups, POST /token_keys (a key's secret is shown in this
 * answer and never again). */
static void item_create(conn *c, const admin_who *who, const char *id, const store_kind *K) {
    (void)id;
    idem_ticket tk;
    json_tok *t;
    if (!idem_begin(c, who, &tk) || admin_body(c, &t) < 0) return;
    stored *it = K->make();
    if (item_parse(c, K, t, it, PARSE_CREATE) < 0) return;
    uuid_new(it->id);
    it->version = 1;
    it->created_at = it->updated_at = wall_ms();
    allow_start(&it->al, it->created_at);
    char secret[64] = "";
    if (K->secret) K->secret(it, secret);
    item_commit(c, &tk, K, it, 201, K->secret ? secret : NULL);
    memset(secret, 0, sizeof secret);
}

/* PATCH /token_groups/{id}, PATCH /token_keys/{id}: omitted fields kept,
 * null clears; a change that changes nothing makes no new version. */
static void item_update(conn *c, const admin_who *who, const char *id, const store_kind *K) {
    stored *cur = admin_item(c, who, K, id);
    if (!cur) return;
    idem_ticket tk;
    json_tok *t;
    if (!idem_begin(c, who, &tk) || !if_match(c, cur->version) || admin_body(c, &t) < 0) return;
    stored *it = K->clone(cur);
    if (item_parse(c, K, t, it, PARSE_PATCH) < 0) return;
    buf before = {0}, after = {0};
    jwriter w;
    jw_init(&w, &before);
    K->json(&w, cur, 1);
    jw_init(&w, &after);
    K->json(&w, it, 1);
    int same = before.len == after.len && memcmp(before.p, after.p, before.len) == 0;
    buf_free(&before);
    buf_free(&after);
    if (same) { /* nothing to log */
        K->drop(it);
        item_get(c, who, id, K);
        return;
    }
    it->version = cur->version + 1;
    it->updated_at = wall_ms();
    allow_reanchor(&it->al, &cur->al, it->updated_at);
    item_commit(c, &tk, K, it, 200, NULL);
}

/* DELETE /token_groups/{id} (the group and all its keys, in one record),
 * DELETE /token_keys/{id}: from now on its key or keys get 401. */
static void item_delete(conn *c, const admin_who *who, const char *id, const store_kind *K) {
    stored *it = admin_item(c, who, K, id);
    if (!it) return;
    idem_ticket tk;
    if (!idem_begin(c, who, &tk) || !if_match(c, it->version)) return;
    buf ops = {0}, body = {0};
    jwriter w;
    jw_init(&w, &ops);
    jw_open(&w, '[');
    jw_open(&w, '{');
    jw_name(&w, K->del_op), jw_cstr(&w, it->id);
    jw_close(&w, '}');
    jw_close(&w, ']');
    item_body(&body, K, it);
    admin_change(c, &tk, &ops, K, it, 1, 200, 0, &body, 200, &body);
    buf_free(&ops);
    buf_free(&body);
}

/* GET /token_groups, GET /token_keys (a token_group_id filter: only that
 * group's keys): a page of them in creation order. */
static void item_list(conn *c, const admin_who *who, const char *id, const store_kind *K) {
    (void)who;
    (void)id;
    int number, size;
    if (page_params(c, &number, &size) < 0) return;
    char parent[64], alias[64];
    snprintf(alias, sizeof alias, "filter[%s]", K->filter ? K->filter : "");
    const char *filter = K->filter ? query_get(c, K->filter, alias, parent, sizeof parent) : NULL;
    buf b = {0};
    jwriter w;
    jw_init(&w, &b), jw_open(&w, '{'), jw_key(&w, "data"), jw_open(&w, '[');
    long long skip = (long long)(number - 1) * size;
    int shown = 0, total = 0;
    for (int i = 0; i < K->all->n; i++) {
        const stored *it = K->all->p[i];
        if (!it || (filter && strcmp(K->parent(it), filter) != 0)) continue;
        total++;
        if (skip) skip--;
        else if (shown < size) {
            K->json(&w, it, 0);
            shown++;
        }
    }
    jw_close(&w, ']');
    page_meta(&w, number, size, total);
    jw_close(&w, '}'), jw_close(&w, '}');
    admin_reply(c, 200, 0, 0, b.p, b.len);
    buf_free(&b);
}

/* The half-open UTC date range [start_date, end_date) of a ledger query:
 * both or neither (neither: yesterday), at most 31 days. 0, or LTG_ERR
 * after a 400. */
static int range_params(conn *c, int64_t *start, int64_t *end) {
    char a[32], b[32];
    const char *sa = query_get(c, "start_date", NULL, a, sizeof a),
               *sb = query_get(c, "end_date", NULL, b, sizeof b);
    if (!sa && !sb) {
        *end = wall_ms() / 86400000 * 86400000;
        *start = *end - 86400000;
        return 0;
    }
    const char *why = NULL;
    if (!sa || !sb)
        why = "give both start_date and end_date (YYYY-MM-DD), or neither for yesterday";
    else if (parse_day(sa, start) < 0) why = "start_date must be a date: YYYY-MM-DD";
    else if (parse_day(sb, end) < 0) why = "end_date must be a date: YYYY-MM-DD";
    else if (*start >= *end)
        why = "start_date must be before end_date (the range is [start_date, end_date))";
    else if (*end - *start > 31LL * 86400000) why = "the range may span at most 31 days";
    if (why) { admin_error(c, 400, "invalid_request", NULL, 0, "%s", why); return LTG_ERR; }
    return 0;
}

/* meta.retained_from: the range reaches before the first day kept. */
static void retained_from_meta(jwriter *w, int64_t start) {
    int64_t from = ledger_retained_from(wall_ms());
    if (start >= from) return;
    jw_key(w, "retained_from"), jw_time(w, from, 1);
}

/* GET /spend/events (README "The consumption ledger"). A snapshot is the ledger's last day and
 * how many events it had: later pages see the days before it and that
 * many of its events, however many arrive meanwhile. */
static void spend_events(conn *c, const admin_who *who, const char *id, const store_kind *K) {
    (void)K;
    (void)who;
    (void)id;
    int64_t start, end;
    int number, size;
    if (range_params(c, &start, &end) < 0 || page_params(c, &number, &size) < 0) return;
    /* zeroed: an id is compared as 36 bytes */
    char kid[64] = "", gid[64] = "", snap[64], filters[256];
    ledger_query q = {start,
                      end,
                      query_get(c, "token_key_id", NULL, kid, sizeof kid),
                      query_get(c, "token_group_id", NULL, gid, sizeof gid),
                      0,
                      0};
    snprintf(filters, sizeof filters, "%lld|%lld|%s|%s", (long long)start, (long long)end,
             q.key ? kid : "", q.group ? gid : "");
    unsigned long long fh = (unsigned long long)hash_bytes(filters, strlen(filters)), h;
    const segment *last = LG.nseg ? LG.seg[LG.nseg - 1] : NULL;
    long long day = last ? last->day / DAY_MS : 0;
    unsigned n = last ? seg_count(last) : 0;
    if (query_get(c, "page[snapshot]", "snapshot", snap, sizeof snap)) {
        const segment *at = NULL;
        if (sscanf(snap, "%lld-%u-%16llx", &day, &n, &h) == 3)
            for (int i = 0; i < LG.nseg; i++) at = LG.seg[i]->day == day * DAY_MS ? LG.seg[i] : at;
        if (sscanf(snap, "%lld-%u-%16llx", &day, &n, &h) != 3 ||
            (last && day > last->day / DAY_MS) || (at && n > seg_count(at))) {
            admin_error(c, 400, "invalid_request", NULL, 0,
                        "page[snapshot] is not a snapshot this ledger gave out");
            return;
        }
        if (h != fh) {
            admin_error(c, 409, "snapshot_mismatch", NULL, 0,
                        "the filters changed since this snapshot was taken: start again from page "
                        "1 without page[snapshot]");
            return;
        }
    }
    q.snap_day = day * DAY_MS;
    q.snap_n = n;
    buf b = {0}, snap_out = {0};
    jwriter w;
    jw_init(&w, &b), jw_open(&w, '{'), jw_key(&w, "data"), jw_open(&w, '[');
    size_t total = ledger_page(&q, (size_t)(number - 1) * (size_t)size, (size_t)size, &w);
    jw_close(&w, ']');
    page_meta(&w, number, size, (int)total);
    buf_printf(&snap_out, "%lld-%u-%016llx", day, n, fh);
    jw_key(&w, "snapshot"), jw_cstr(&w, snap_out.p);
    retained_from_meta(&w, start);
    jw_close(&w, '}'), jw_close(&w, '}');
    admin_reply(c, 200, 0, 0, b.p, b.len);
    buf_free(&b);
    buf_free(&snap_out);
}

static void usage_json(jwriter *w, const usage_row *r) {
    jw_key(w, "requests"), jw_int(w, r->requests);
    jw_key(w, "succeeded_requests"), jw_int(w, r->succeeded);
    jw_key(w, "failed_requests"), jw_int(w, r->failed);
    jw_key(w, "partial_requests"), jw_int(w, r->partial);
    jw_key(w, "abandoned_requests"), jw_int(w, r->abandoned);
    jw_key(w, "cache_hits"), jw_int(w, r->cache_hits);
    for (int k = 0; k < NTOK; k++) {
        jw_name(w, tok_names[k]), jw_int(w, r->tok[k]);
    }
    jw_key(w, "spend"), jw_usd(w, r->spend);
    jw_key(w, "reserved_spend"), jw_usd(w, r->reserved);
}

/* GET /usage/summary (README "The consumption ledger"): totals, every day of the range, each
 * model -- from the days' rollups, and today's events. */
static void usage_summary(conn *c, const admin_who *who, const char *id, const store_kind *K) {
    (void)K;
    (void)who;
    (void)id;
    int64_t start, end;
    if (range_params(c, &start, &end) < 0) return;
    char gid[64] = "";
    const char *gf = query_get(c, "token_group_id", NULL, gid, sizeof gid);
    int days = (int)((end - start) / DAY_MS), nmu = 0;
    usage_row total = {0}, by_day[31] = {{0}};
    model_usage *mu = NULL;
    ledger_usage(start, days, gf, by_day, &total, &mu, &nmu);
    int64_t now = wall_ms();
    if (now >= start && now < end) /* what requests in flight hold now belongs to today */
        for (int i = 0; i < ST.gv.n; i++) {
            group *g = ST.gv.p[i];
            if (!g || (gf && strcmp(gid, g->s.id) != 0)) continue;
            total.reserved += g->s.al.reserved;
            by_day[(now - start) / DAY_MS].reserved += g->s.al.reserved;
        }
    buf b = {0};
    jwriter w;
    jw_init(&w, &b), jw_open(&w, '{'), jw_key(&w, "data"), jw_open(&w, '{');
    jw_key(&w, "token_group_id"), jw_cstr(&w, gf ? gid : NULL);
    jw_key(&w, "start_date"), jw_time(&w, start, 1);
    jw_key(&w, "end_date"), jw_time(&w, end, 1);
    jw_key(&w, "totals"), jw_open(&w, '{');
    usage_json(&w, &total);
    jw_close(&w, '}');
    jw_key(&w, "by_day"), jw_open(&w, '[');
    for (int d = 0; d < days; d++) {
        jw_open(&w, '{');
        jw_key(&w, "date"), jw_time(&w, start + (int64_t)d * DAY_MS, 1);
        usage_json(&w, &by_day[d]);
        jw_close(&w, '}');
    }
    jw_close(&w, ']');
    jw_key(&w, "by_model"), jw_open(&w, '[');
    for (int k = 0; k < nmu; k++) {
        jw_open(&w, '{');
        jw_key(&w, "model"), jw_cstr(&w, mu[k].alias);
        usage_json(&w, &mu[k].u);
        jw_close(&w, '}');
    }
    jw_close(&w, ']');
    jw_close(&w, '}');
    if (start < ledger_retained_from(now)) {
        jw_key(&w, "meta"), jw_open(&w, '{');
        retained_from_meta(&w, start);
        jw_close(&w, '}');
    }
    jw_close(&w, '}');
    admin_reply(c, 200, 0, 0, b.p, b.len);
    buf_free(&b);
    free(mu);
}

/* GET /spend/chain?date=YYYY-MM-DD (README "An auditable ledger"): the
 * day's events and its chain's head -- after its last event, or for a day
 * without events the head that went through it: the link of the next
 * chained day, or the newest head. A day still open may grow. */
static void spend_chain(conn *c, const admin_who *who, const char *id, const store_kind *K) {
    (void)K, (void)who, (void)id;
    char d[32];
    int64_t day, now = wall_ms(), hday;
    const char *ds = query_get(c, "date", NULL, d, sizeof d);
    if (!ds || parse_day(ds, &day) < 0 || day > now) {
        admin_error(c, 400, "invalid_request", NULL, 0,
                    "date must be a day (YYYY-MM-DD) that has begun, UTC");
        return;
    }
    if (day < ledger_retained_from(now)) {
        admin_error(c, 404, "not_found", NULL, 0,
                    "%s is older than the ledger keeps (--ledger-days %d)", ds, S.ledger_days);
        return;
    }
    const segment *s = NULL, *next = NULL;
    for (int i = LG.nseg - 1; i >= 0; i--) {
        if (LG.seg[i]->day == day) s = LG.seg[i];
        if (LG.seg[i]->day > day && LG.seg[i]->chained) next = LG.seg[i];
    }
    const uint8_t *newest = chain_head(&hday), *head = hday ? newest : NULL;
    if (s) head = s->chained ? s->head : NULL;
    else if (next) head = next->link;
    if (!head) {
        admin_error(c, 409, "not_chained", NULL, 0,
                    LG.keyed ? "%s is not chained: it began before ltg had --ledger-key-env "
                               "(the chain begins with the next day's log)"
                             : "%s is not chained: ltg runs without --ledger-key-env",
                    ds);
        return;
    }
    char hex[2 * CHAIN_LEN + 1];
    hex_encode(head, CHAIN_LEN, hex);
    buf b = {0};
    jwriter w;
    jw_init(&w, &b), jw_open(&w, '{'), jw_key(&w, "data"), jw_open(&w, '{');
    jw_key(&w, "date"), jw_time(&w, day, 1);
    jw_key(&w, "events"), jw_int(&w, s ? seg_count(s) : 0);
    jw_key(&w, "head"), jw_cstr(&w, hex);
    jw_key(&w, "sealed"), jw_bool(&w, day_of(now) > day && (!s || s->state == SEG_SEALED));
    jw_close(&w, '}'), jw_close(&w, '}');
    admin_reply(c, 200, 0, 0, b.p, b.len);
    buf_free(&b);
}

/* The control plane's endpoints: a path under API_PREFIX ("{id}" is one
 * segment), a method, the permission it needs, its handler, and the kind
 * of item it serves (NULL: none). */
typedef struct {
    const char *method, *path;
    int perm;
    void (*serve)(conn *c, const admin_who *who, const char *id, const store_kind *K);
    const store_kind *kind;
} admin_endpoint;

static const admin_endpoint admin_endpoints[] = {
    {"GET", "/token_groups", PERM_GROUPS_READ, item_list, &GROUPS},
    {"POST", "/token_groups", PERM_GROUPS_WRITE, item_create, &GROUPS},
    {"GET", "/token_groups/{id}", PERM_GROUPS_READ, item_get, &GROUPS},
    {"PATCH", "/token_groups/{id}", PERM_GROUPS_WRITE, item_update, &GROUPS},
    {"DELETE", "/token_groups/{id}", PERM_GROUPS_WRITE, item_delete, &GROUPS},
    {"GET", "/token_keys", PERM_KEYS_READ, item_list, &KEYS},
    {"POST", "/token_keys", PERM_KEYS_WRITE, item_create, &KEYS},
    {"GET", "/token_keys/{id}", PERM_KEYS_READ, item_get, &KEYS},
    {"PATCH", "/token_keys/{id}", PERM_KEYS_WRITE, item_update, &KEYS},
    {"DELETE", "/token_keys/{id}", PERM_KEYS_WRITE, item_delete, &KEYS},
    {"GET", "/spend/events", PERM_SPEND_READ, spend_events, NULL},
    {"GET", "/spend/chain", PERM_SPEND_READ, spend_chain, NULL},
    {"GET", "/usage/summary", PERM_USAGE_READ, usage_summary, NULL},
};

/* Does `path` match `pattern`? The {id} segment goes to id. */
static int route_match(const char *pattern, const char *path, char *id, size_t cap) {
    const char *brace = strstr(pattern, "{id}");
    size_t pre = brace ? (size_t)(brace - pattern) : strlen(pattern);
    if (strncmp(pattern, path, pre) != 0) return 0;
    if (!brace) return path[pre] == 0;
    if (!path[pre] || strchr(path + pre, '/')) return 0;
    snprintf(id, cap, "%s", path + pre);
    return 1;
}

/* Everything under /v2/llm_token_gateway: the key, then the table. */
static void admin_route(conn *c) {
    size_t n, plen = strlen(API_PREFIX);
    const char *t = request_path(c, &n);
    char path[256], id[64] = "", allow[64] = "";
    snprintf(path, sizeof path, "%.*s", (int)(n - plen < 200 ? n - plen : 200), t + plen);
    admin_who who;
    if (admin_auth(c, &who) < 0) return;
    const admin_endpoint *hit = NULL;
    for (size_t i = 0; i < sizeof admin_endpoints / sizeof *admin_endpoints; i++) {
        const admin_endpoint *e = &admin_endpoints[i];
        if (!route_match(e->path, path, id, sizeof id)) continue;
        snprintf(allow + strlen(allow), sizeof allow - strlen(allow), "%s%s", allow[0] ? ", " : "",
                 e->method);
        if (method_is(c, e->method)) hit = e;
    }
    if (!allow[0]) {
        admin_error(c, 404, "not_found", NULL, 0,
                    "no such endpoint (the control plane has /token_groups, /token_keys, "
                    "/spend/events, /spend/chain and /usage/summary)");
    } else if (!hit) {
        admin_error(c, 405, "method_not_allowed", NULL, 0, "use %s on %.100s", allow, path);
    } else if (admin_allowed(c, &who, hit->perm)) {
        hit->serve(c, &who, id, hit->kind);
    }
}

/* ===== 17. Translation: one API for every model =====
 *
 * IMPLEMENTATION NOTES
 * A fallback chain may cross API families (README "One API for every model"): a client of
 * Anthropic's Messages reaches a model behind OpenAI's chat completions, a chat client reaches
 * Claude, and a Responses client (Codex) a model whose provider serves chat alone (its
 * `endpoints`). Which pairs: xl_translates(). The client's API decides the answer's shape; each
 * attempt's provider decides what is sent. Section 18 asks three things of this one, and nothing
 * here calls it back:
 *
 *   xl_request()  the client's body, read as slices of itself (jv_*, section 3: no token array
 *                 but the top level admission parsed, no copy per field) and written for the
 *                 provider's API with the JSON writer.
 *                 Each field is mapped, dropped -- a hint, named in x-ltg-dropped -- or refused:
 *                 400 untranslatable_field, its JSON Pointer in `param`. Admission runs it up
 *                 to the first model of the chain that can take the request (none: that 400),
 *                 and that model's first attempt sends what it made; any other attempt runs it
 *                 for its own model. The body's top-level members are found once (xl_fields),
 *                 so each byte is walked a bounded number of times.
 *   xl_answer()   a provider's whole answer in the client's API (a Responses object's id is
 *                 the request's: resp_<x-ltg-request-id>); xl_error() its error.
 *   xl_feed()     a stream, one provider event at a time: a decoder per provider API turns the
 *                 event into neutral events (text, reasoning, a tool call's start and its
 *                 argument fragments, the finish, a ping), an encoder per client API writes
 *                 them in the client's grammar. Each encoder is a machine: one enum, its
 *                 transitions asserted. It writes nothing before the first content, so that
 *                 an attempt that fails before it still fails over.
 *
 * Money is not translated: section 18 meters the provider's own usage with the provider API's
 * classes; the client sees those counts in its own API's terms (chat's prompt_tokens includes
 * cache reads and writes, Anthropic's input_tokens leaves them out).
 *
 * Tool names and ids are mapped injectively: a name longer than chat's 64 bytes becomes 55
 * bytes of it and 8 hex digits of its SHA-256 (and back in the answer); an id Anthropic would
 * refuse (^[a-zA-Z0-9_-]+$) has its other bytes replaced and the same 8 digits appended.
 * Reasoning from a chat model is not shown to an Anthropic client: replayed to Claude it would
 * be a thinking block without Anthropic's signature, which Claude refuses.
 */
/* An inference error's body up to its "code": OpenAI's
 * {"error":{"message","type","param"..., or Anthropic's
 * {"type":"error","error":{"type","message"...; the caller adds what it
 * has and closes both objects. `type`: OpenAI's error type, or NULL for
 * the one of the status. */
static void error_open(jwriter *w, int status, int anthropic, const char *msg,
                       const char *openai_type, const char *param) {
    const char *type = openai_type && !anthropic    ? openai_type
                       : status == 401              ? "authentication_error"
                       : status == 403              ? "permission_error"
                       : status == 404              ? "not_found_error"
                       : status == 429              ? "rate_limit_error"
                       : anthropic && status == 413 ? "request_too_large"
                       : anthropic && status == 529 ? "overloaded_error"
                       : anthropic && status == 402 ? "billing_error"
                       : anthropic && status == 504 ? "timeout_error"
                       : status >= 500              ? "api_error"
                                                    : "invalid_request_error";
    jw_open(w, '{');
    if (anthropic) {
        jw_key(w, "type"), jw_lit(w, "error");
    }
    jw_key(w, "error"), jw_open(w, '{');
    if (anthropic) {
        jw_key(w, "type"), jw_cstr(w, type);
    }
    jw_key(w, "message"), jw_cstr(w, msg);
    if (!anthropic) {
        jw_key(w, "type"), jw_cstr(w, type);
    }
    if (!anthropic || param) { /* the field at fault, a JSON Pointer */
        jw_key(w, "param"), jw_cstr(w, param);
    }
}

typedef enum { XL_NONE, XL_CHAT, XL_MESSAGES, XL_RESPONSES, XL_NAPI } xl_api; /* XL_NONE: none */

#define XL_MAX_TOOLS 64          /* tool calls in one streamed answer */

/* Does ltg translate a request of client API `from` for a provider of API `to`? Messages and
 * chat both ways; Responses to chat, and to Messages through chat. */
static int xl_translates(xl_api from, xl_api to) {
    return (from == XL_MESSAGES && to == XL_CHAT) || (from == XL_CHAT && to == XL_MESSAGES) ||
           (from == XL_RESPONSES && (to == XL_CHAT || to == XL_MESSAGES));
}
#define XL_MAX_BUFFERED (8 << 20) /* a stream's tool arguments held back to keep blocks in order */
#define XL_MAX_DROPPED 16        /* dropped field names named in x-ltg-dropped */

/* What translating a request found: the field refused, or the hints dropped. */
typedef struct {
    char param[160];             /* the refused field's JSON Pointer ("" when none refused) */
    char msg[400];               /* why, naming the field and the target API */
    char dropped[600];           /* the dropped hints' pointers, comma-separated */
    char names[XL_MAX_DROPPED][32]; /* ... each field name once (the metric's label) */
    int ndropped;
    int include_usage;           /* a chat client asked for the usage chunk */
} xl_verdict;

/* What xl_request needs of the attempt's model. */
typedef struct {
    const char *upstream;        /* the provider's name for the model */
    long long max_output_tokens; /* Anthropic's max_tokens when the client gave none */
    int reasoning;               /* it takes a reasoning effort (chat) or thinking (Anthropic) */
} xl_target;

#define XL_MAX_FIELDS 48         /* the longest field table, with room (at most 64: xlq.has) */

/* One request being translated: the client's body, the writer, the verdict; and its top-level
 * members, found once by xl_fields (the body's largest values are walked once, not per field). */
typedef struct {
    const char *s;
    size_t n;
    jwriter w;
    xl_verdict *v;
    const xl_target *to;
    const json_tok *top;               /* the body's top level as json_parse stored it, or NULL */
    json_tok vals[XL_MAX_FIELDS];      /* each field's value, by its index in the table ... */
    uint64_t has;                      /* ... when its bit is set */
} xlq;

static int xl_refuse(xlq *q, const char *param, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
static int xl_refuse(xlq *q, const char *param, const char *fmt, ...) {
    va_list ap;
    snprintf(q->v->param, sizeof q->v->param, "%s", param);
    va_start(ap, fmt);
    vsnprintf(q->v->msg, sizeof q->v->msg, fmt, ap);
    va_end(ap);
    return LTG_ERR;
}

/* A hint left out: its pointer in x-ltg-dropped, once per field name. */
static void xl_drop(xlq *q, const char *param, const char *name) {
    xl_verdict *v = q->v;
    for (int i = 0; i < v->ndropped; i++)
        if (strcmp(v->names[i], name) == 0) return;
    if (v->ndropped == XL_MAX_DROPPED) return;
    snprintf(v->names[v->ndropped++], sizeof v->names[0], "%s", name);
    size_t len = strlen(v->dropped);
    snprintf(v->dropped + len, sizeof v->dropped - len, "%s%s", len ? "," : "", param);
}

/* Write value v as the body has it. */
static void xl_copy(xlq *q, const json_tok *v) {
    uint32_t at, len;
    jv_raw(v, &at, &len);
    jw_raw(&q->w, q->s + at, len);
}

/* Is string token v empty or white space only (escapes counted as text)? */
static int xl_blank(const char *s, const json_tok *v) {
    for (uint32_t i = v->start; i < v->end; i++)
        if (!strchr(" \t\r\n", s[i])) {
            if (s[i] != '\\' || !strchr("nrt", s[i + 1])) return 0;
            i++;
        }
    return 1;
}

/* The JSON Pointer base[/key][/i][/key2] (i < 0 and NULL keys left out) in out, cut to fit
 * as snprintf would; base may be out. One is made per message and block translated: snprintf
 * would cost more than the walk. */
static const char *xl_ptr(char *out, size_t cap, const char *base, const char *key, int i,
                          const char *key2) {
    char num[12];
    int d = sizeof num - 1, index = i >= 0;
    num[d] = 0;
    if (index) do num[--d] = (char)('0' + i % 10); while (i /= 10);
    const char *parts[] = {key, index ? num + d : NULL, key2};
    size_t n = strlen(base);
    if (n > cap - 1) n = cap - 1;
    if (base != out) memcpy(out, base, n);
    for (int j = 0; j < 3; j++) {
        if (!parts[j]) continue;
        if (n + 1 < cap) out[n++] = '/';
        size_t l = strlen(parts[j]);
        if (l > cap - 1 - n) l = cap - 1 - n;
        memcpy(out + n, parts[j], l);
        n += l;
    }
    out[n] = 0;
    return out;
}

/* Block b (at p/i) left without its cache_control, named: chat providers cache by themselves. */
static void xl_cache_drop(xlq *q, const json_tok *b, const char *p, int i) {
    json_tok c;
    char d[240];
    if (!jv_get(q->s, q->n, b, "cache_control", &c)) return;
    xl_ptr(d, sizeof d, p, NULL, i, "cache_control");
    xl_drop(q, d, "cache_control");
}

/* The JSON-escaped text of text parts `arr` (objects {"type":T,"text":...}; a string is one
 * text), joined by newlines, into `out` without quotes: what a system prompt or a tool
 * result of several blocks becomes in an API that takes one string. Returns LTG_ERR with the
 * refusal when a part is not text. */
static int xl_join(xlq *q, const json_tok *arr, const char *path, const char *text_type,
                   buf *out) {
    size_t pos = 0;
    json_tok k, e, t;
    char p[160];
    if (arr->type == JSON_STRING) {
        buf_append(out, q->s + arr->start, arr->end - arr->start);
        return 0;
    }
    for (int i = 0; jv_next(q->s, q->n, arr, &pos, &k, &e); i++) {
        xl_ptr(p, sizeof p, path, NULL, i, NULL);
        if (e.type == JSON_STRING) {
            t = e;
        } else if (!jv_get(q->s, q->n, &e, "type", &t) || !json_eq(q->s, &t, 0, text_type) ||
                   !jv_get(q->s, q->n, &e, "text", &t) || t.type != JSON_STRING) {
            buf_free(out); /* a refusal: nothing for the caller to free */
            return xl_refuse(q, p, "%s: only text parts can be carried here", p);
        }
        xl_cache_drop(q, &e, path, i);
        if (out->len) buf_puts(out, "\\n");
        buf_append(out, q->s + t.start, t.end - t.start);
    }
    return 0;
}

/* Chat's name for Anthropic tool `name` (escaped; Anthropic's are plain ASCII): itself up to
 * 64 bytes, else 55 bytes of it, "_" and 8 hex digits of its SHA-256. */
static void xl_chat_name(const char *name, size_t n, char out[65]) {
    uint8_t h[32];
    if (n <= 64) {
        snprintf(out, 65, "%.*s", (int)n, name);
        return;
    }
    sha256(name, n, h);
    memcpy(out, name, 55);
    out[55] = '_';
    hex_encode(h, 4, out + 56);
    out[64] = 0;
}

/* Anthropic's id for a tool call id (unescaped): itself when Anthropic takes it
 * (^[a-zA-Z0-9_-]{1,64}$), else its first 64 bytes with every other byte "_", then "_" and 8
 * hex digits of its SHA-256 -- one id never becomes another's. */
static void xl_anthropic_id(const char *id, size_t n, char out[74]) {
    int ok = n > 0 && n <= 64;
    size_t k = n < 64 ? n : 64;
    for (size_t i = 0; i < k; i++) {
        int c = (unsigned char)id[i];
        out[i] = isalnum(c) || c == '_' || c == '-' ? (char)c : '_';
        ok &= out[i] == c;
    }
    out[k] = 0;
    if (ok) return;
    uint8_t h[32];
    sha256(id, n, h);
    out[k] = '_';
    hex_encode(h, 4, out + k + 1);
    out[k + 9] = 0;
}

/* Write an id, Anthropic's way, from string token v. */
static void xl_write_id(xlq *q, const json_tok *v) {
    buf b = {0};
    char id[74];
    json_unescape(q->s, v, 0, &b);
    xl_anthropic_id(b.p ? b.p : "", b.len, id);
    jw_cstr(&q->w, id);
    buf_free(&b);
}

/* A top-level field and what becomes of it across translation. */
typedef struct xl_field {
    const char *name;
    enum { XF_MAP, XF_DROP, XF_REFUSE } fate;
    const char *why;             /* XF_REFUSE: what the target lacks */
} xl_field;

/* A field table's rows are written once, as X(name, fate, why) in a NAME_ROWS macro: they make
 * both the table (XL_ROW) and an enum of its indices (M2C_model, ...), which xl_get takes. */
#define XL_ROW(name, fate, why) {#name, fate, why},

/* Top-level member k: v of the body, one of `fields`, else it is refused: a member ltg does
 * not know cannot be carried. A drop is named. */
static int xl_member(xlq *q, const json_tok *k, const json_tok *v, const xl_field *fields,
                    const char *target) {
    char p[160];
    int i = 0;
    while (fields[i].name && !((q->s[k->start] == fields[i].name[0] || q->s[k->start] == '\\') &&
                               json_eq(q->s, k, 0, fields[i].name)))
        i++; /* the first byte first (unless it is an escape) */
    assert(i < XL_MAX_FIELDS);
    if (fields[i].name && !(q->has >> i & 1)) /* the first of a repeated name, as jv_get */
        q->vals[i] = *v, q->has |= 1ULL << i;
    if (fields[i].name && fields[i].fate == XF_MAP) return 0;
    snprintf(p, sizeof p, "/%.*s", (int)(k->end - k->start < 100 ? k->end - k->start : 100),
             q->s + k->start);
    if (!fields[i].name)
        return xl_refuse(q, p, "%s cannot be carried to %s: ltg does not know it", p, target);
    if (fields[i].fate == XF_DROP) xl_drop(q, p, fields[i].name);
    if (fields[i].fate == XF_REFUSE && v->type != JSON_NULL && v->type != JSON_FALSE)
        return xl_refuse(q, p, "%s cannot be carried to %s: %s", p, target, fields[i].why);
    return 0;
}

/* Every top-level member of the body through xl_member, from the tokens admission parsed when
 * there are (q->top: the members are not walked again), else walked. */
static int xl_fields(xlq *q, const json_tok *root, const xl_field *fields, const char *target) {
    size_t pos = 0;
    json_tok k, v;
    q->has = 0;
    if (q->top) {
        for (int m = 0, i = 1; m < q->top[0].size; m++, i = q->top[i + 1].next)
            if (xl_member(q, &q->top[i], &q->top[i + 1], fields, target) < 0) return LTG_ERR;
        return 0;
    }
    while (jv_next(q->s, q->n, root, &pos, &k, &v))
        if (xl_member(q, &k, &v, fields, target) < 0) return LTG_ERR;
    return 0;
}

/* Top-level member `field` (its index in the table xl_fields used: every member of the body is
 * in it, or the body was refused); 0 when the body has none, *v then an empty null. */
static int xl_get(const xlq *q, int field, json_tok *v) {
    *v = (json_tok){JSON_NULL, 0, 0, 0, 0};
    if (!(q->has >> field & 1)) return 0;
    *v = q->vals[field];
    return 1;
}

/* n bytes already JSON-escaped (a slice of a string token) as a string value. */
static void xl_slice(jwriter *w, const char *p, size_t n) {
    jw_sep(w);
    buf_puts(w->out, "\"");
    if (n) buf_append(w->out, p, n);
    buf_puts(w->out, "\"");
}

/* Text already JSON-escaped (json_tok bytes, or several joined) as a string value. */
static void xl_escaped(jwriter *w, const buf *text) {
    jw_sep(w);
    buf_puts(w->out, "\"");
    if (text->len) buf_append(w->out, text->p, text->len);
    buf_puts(w->out, "\"");
}

/* A stream asked of chat, with its usage: ltg meters the provider's counts. */
static void xl_chat_stream(xlq *q) {
    jw_key(&q->w, "stream"), jw_bool(&q->w, 1);
    jw_key(&q->w, "stream_options"), jw_raw(&q->w, "{\"include_usage\":true}", 22);
}

/* ---- requests: Anthropic Messages to OpenAI chat ---- */

#define M2C_ROWS(X) \
    X(model, XF_MAP, NULL) X(messages, XF_MAP, NULL) X(system, XF_MAP, NULL) \
    X(max_tokens, XF_MAP, NULL) X(stop_sequences, XF_MAP, NULL) X(stream, XF_MAP, NULL) \
    X(temperature, XF_MAP, NULL) X(top_p, XF_MAP, NULL) X(tools, XF_MAP, NULL) \
    X(tool_choice, XF_MAP, NULL) X(metadata, XF_MAP, NULL) X(thinking, XF_MAP, NULL) \
    X(output_config, XF_MAP, NULL) X(output_format, XF_MAP, NULL) X(top_k, XF_DROP, NULL) \
    X(service_tier, XF_DROP, NULL) X(context_management, XF_DROP, NULL) \
    X(cache_control, XF_DROP, NULL) X(inference_geo, XF_DROP, NULL) \
    X(mcp_servers, XF_REFUSE, "MCP servers are run by Anthropic") \
    X(container, XF_REFUSE, "containers are Anthropic's")
#define M2C_ENUM(name, fate, why) M2C_##name,
enum { M2C_ROWS(M2C_ENUM) M2C_N };
_Static_assert(M2C_N <= XL_MAX_FIELDS, "a field's bit in xlq.has, its value in vals");
static const xl_field M2C_FIELDS[] = {M2C_ROWS(XL_ROW) {NULL, XF_MAP, NULL}};

/* An image or document block of a user turn as a chat content part. */
static int m2c_media(xlq *q, const json_tok *b, int image, const char *p) {
    json_tok src, t, mt, data;
    char pp[220];
    xl_ptr(pp, sizeof pp, p, "source", -1, NULL);
    if (!jv_get(q->s, q->n, b, "source", &src) || !jv_get(q->s, q->n, &src, "type", &t))
        return xl_refuse(q, pp, "%s: a source {type, ...} is needed", pp);
    int url = json_eq(q->s, &t, 0, "url"), b64 = json_eq(q->s, &t, 0, "base64");
    if (!(image ? url || b64 : b64))
        return xl_refuse(q, pp, "%s: OpenAI chat takes %s", pp,
                         image ? "images by URL or base64" : "documents as base64 PDF only");
    if (url && jv_get(q->s, q->n, &src, "url", &data)) {
        jw_open(&q->w, '{');
        jw_key(&q->w, "type"), jw_lit(&q->w, "image_url");
        jw_key(&q->w, "image_url"), jw_open(&q->w, '{');
        jw_key(&q->w, "url"), xl_copy(q, &data);
        jw_close(&q->w, '}'), jw_close(&q->w, '}');
        return 0;
    }
    if (!jv_get(q->s, q->n, &src, "media_type", &mt) || mt.type != JSON_STRING ||
        !jv_get(q->s, q->n, &src, "data", &data) || data.type != JSON_STRING)
        return xl_refuse(q, pp, "%s: media_type and data are needed", pp);
    buf u = {0};
    buf_puts(&u, "\"data:");
    buf_append(&u, q->s + mt.start, mt.end - mt.start);
    buf_puts(&u, ";base64,");
    buf_append(&u, q->s + data.start, data.end - data.start);
    buf_puts(&u, "\"");
    jw_open(&q->w, '{');
    jw_key(&q->w, "type"), jw_cstr(&q->w, image ? "image_url" : "file");
    jw_name(&q->w, image ? "image_url" : "file"), jw_open(&q->w, '{');
    if (!image) {
        jw_key(&q->w, "filename"), jw_lit(&q->w, "document.pdf");
    }
    jw_name(&q->w, image ? "url" : "file_data"), jw_raw(&q->w, u.p, u.len);
    jw_close(&q->w, '}'), jw_close(&q->w, '}');
    buf_free(&u);
    return 0;
}

/* The tool results of user turn `content`, each a chat "tool" message, in order: they come
 * before the turn's other content (the call they answer is the message before). */
static int m2c_tool_results(xlq *q, const json_tok *content, const char *p) {
    size_t pos = 0;
    json_tok k, b, t, id, c;
    char pp[200];
    for (int i = 0; jv_next(q->s, q->n, content, &pos, &k, &b); i++) {
        if (!jv_get(q->s, q->n, &b, "type", &t) || !json_eq(q->s, &t, 0, "tool_result")) continue;
        xl_cache_drop(q, &b, p, i);
        xl_ptr(pp, sizeof pp, p, NULL, i, NULL);
        if (!jv_get(q->s, q->n, &b, "tool_use_id", &id) || id.type != JSON_STRING)
            return xl_refuse(q, pp, "%s: a tool_result needs its tool_use_id", pp);
        buf text = {0}, joined = {0};
        if (jv_get(q->s, q->n, &b, "is_error", &t) && t.type == JSON_TRUE)
            buf_puts(&text, "Error: ");
        char cp[220];
        xl_ptr(cp, sizeof cp, pp, "content", -1, NULL);
        int r = jv_get(q->s, q->n, &b, "content", &c) ? xl_join(q, &c, cp, "text", &joined) : 0;
        if (r < 0) { /* xl_join's verdict, said for a tool message (copied: xl_refuse writes it) */
            char rp[sizeof q->v->param], rm[sizeof q->v->msg];
            snprintf(rp, sizeof rp, "%s", q->v->param);
            snprintf(rm, sizeof rm, "%s", q->v->msg);
            buf_free(&text);
            buf_free(&joined);
            return xl_refuse(q, rp, "%.300s (a chat tool message is text only)", rm);
        }
        if (joined.len) buf_append(&text, joined.p, joined.len);
        else buf_puts(&text, "(no output)");
        buf_free(&joined);
        jw_open(&q->w, '{');
        jw_key(&q->w, "role"), jw_lit(&q->w, "tool");
        jw_key(&q->w, "tool_call_id"), xl_copy(q, &id);
        jw_key(&q->w, "content"), xl_escaped(&q->w, &text);
        jw_close(&q->w, '}');
        buf_free(&text);
    }
    return 0;
}

/* A user turn: its tool results, then its other blocks as one chat user message (one string
 * when they are all text). */
static int m2c_user(xlq *q, const json_tok *content, const char *p) {
    if (content->type == JSON_STRING) {
        jw_open(&q->w, '{');
        jw_key(&q->w, "role"), jw_lit(&q->w, "user");
        jw_key(&q->w, "content"), xl_copy(q, content);
        jw_close(&q->w, '}');
        return 0;
    }
    if (m2c_tool_results(q, content, p) < 0) return LTG_ERR;
    size_t pos = 0;
    json_tok k, b, t;
    int parts = 0, media = 0;
    char pp[200];
    for (int i = 0; jv_next(q->s, q->n, content, &pos, &k, &b); i++)
        if (jv_get(q->s, q->n, &b, "type", &t) && !json_eq(q->s, &t, 0, "tool_result")) {
            parts++;
            media |= !json_eq(q->s, &t, 0, "text");
            xl_cache_drop(q, &b, p, i);
        }
    if (!parts) return 0;
    jw_open(&q->w, '{');
    jw_key(&q->w, "role"), jw_lit(&q->w, "user");
    jw_key(&q->w, "content");
    if (!media) { /* text alone: one string, which every chat server takes */
        buf text = {0};
        pos = 0;
        while (jv_next(q->s, q->n, content, &pos, &k, &b))
            if (jv_get(q->s, q->n, &b, "type", &t) && json_eq(q->s, &t, 0, "text") &&
                jv_get(q->s, q->n, &b, "text", &t) && !xl_blank(q->s, &t)) {
                if (text.len) buf_puts(&text, "\\n");
                buf_append(&text, q->s + t.start, t.end - t.start);
            }
        xl_escaped(&q->w, &text);
        buf_free(&text);
    } else {
        jw_open(&q->w, '[');
        pos = 0;
        for (int i = 0; jv_next(q->s, q->n, content, &pos, &k, &b); i++) {
            xl_ptr(pp, sizeof pp, p, NULL, i, NULL);
            jv_get(q->s, q->n, &b, "type", &t);
            if (json_eq(q->s, &t, 0, "tool_result")) continue;
            if (json_eq(q->s, &t, 0, "text")) {
                if (!jv_get(q->s, q->n, &b, "text", &t) || xl_blank(q->s, &t)) continue;
                jw_open(&q->w, '{');
                jw_key(&q->w, "type"), jw_lit(&q->w, "text");
                jw_key(&q->w, "text"), xl_copy(q, &t);
                jw_close(&q->w, '}');
            } else if (json_eq(q->s, &t, 0, "image") || json_eq(q->s, &t, 0, "document")) {
                if (m2c_media(q, &b, json_eq(q->s, &t, 0, "image"), pp) < 0) return LTG_ERR;
            } else {
                return xl_refuse(q, pp, "%s: a %.*s block has no OpenAI chat equivalent", pp,
                                 (int)(t.end - t.start), q->s + t.start);
            }
        }
        jw_close(&q->w, ']');
    }
    jw_close(&q->w, '}');
    return 0;
}

/* One tool_use block as an entry of chat's tool_calls: its input's bytes as the arguments. */
static void m2c_tool_call(xlq *q, const json_tok *b) {
    json_tok id, name, input;
    char cn[65];
    jv_get(q->s, q->n, b, "id", &id);
    jv_get(q->s, q->n, b, "name", &name);
    xl_chat_name(q->s + name.start, name.end - name.start, cn);
    jw_open(&q->w, '{');
    jw_key(&q->w, "id"), xl_copy(q, &id);
    jw_key(&q->w, "type"), jw_lit(&q->w, "function");
    jw_key(&q->w, "function"), jw_open(&q->w, '{');
    jw_key(&q->w, "name"), jw_cstr(&q->w, cn);
    if (jv_get(q->s, q->n, b, "input", &input)) {
        jw_key(&q->w, "arguments"), jw_str(&q->w, q->s + input.start, input.end - input.start);
    } else {
        jw_key(&q->w, "arguments"), jw_lit(&q->w, "{}");
    }
    jw_close(&q->w, '}'), jw_close(&q->w, '}');
}

/* An assistant turn: its text joined as "content", its tool_use blocks as "tool_calls";
 * thinking is dropped (another provider cannot read it). */
static int m2c_assistant(xlq *q, const json_tok *content, const char *p) {
    jw_open(&q->w, '{');
    jw_key(&q->w, "role"), jw_lit(&q->w, "assistant");
    if (content->type == JSON_STRING) {
        jw_key(&q->w, "content"), xl_copy(q, content);
        jw_close(&q->w, '}');
        return 0;
    }
    size_t pos = 0;
    json_tok k, b, t;
    buf text = {0};
    int calls = 0;
    char pp[200];
    for (int i = 0; jv_next(q->s, q->n, content, &pos, &k, &b); i++) {
        xl_ptr(pp, sizeof pp, p, NULL, i, NULL);
        jv_get(q->s, q->n, &b, "type", &t);
        xl_cache_drop(q, &b, p, i);
        if (json_eq(q->s, &t, 0, "text") && jv_get(q->s, q->n, &b, "text", &t)) {
            if (xl_blank(q->s, &t)) continue; /* blank text: chat servers refuse it too */
            if (text.len) buf_puts(&text, "\\n");
            buf_append(&text, q->s + t.start, t.end - t.start);
        } else if (json_eq(q->s, &t, 0, "tool_use")) {
            json_tok id, nm;
            if (!jv_get(q->s, q->n, &b, "id", &id) || id.type != JSON_STRING ||
                !jv_get(q->s, q->n, &b, "name", &nm) || nm.type != JSON_STRING) {
                buf_free(&text);
                return xl_refuse(q, pp, "%s: a tool_use needs its id and its name", pp);
            }
            calls++;
        } else if (json_eq(q->s, &t, 0, "thinking") || json_eq(q->s, &t, 0, "redacted_thinking")) {
            xl_drop(q, pp, "thinking");
        } else {
            buf_free(&text);
            return xl_refuse(q, pp, "%s: a %.*s block has no OpenAI chat equivalent", pp,
                             (int)(t.end - t.start), q->s + t.start);
        }
    }
    jw_key(&q->w, "content");
    if (text.len || !calls) {
        xl_escaped(&q->w, &text);
    } else {
        jw_null(&q->w);
    }
    buf_free(&text);
    if (calls) {
        jw_key(&q->w, "tool_calls"), jw_open(&q->w, '[');
        pos = 0;
        while (jv_next(q->s, q->n, content, &pos, &k, &b))
            if (jv_get(q->s, q->n, &b, "type", &t) && json_eq(q->s, &t, 0, "tool_use"))
                m2c_tool_call(q, &b);
        jw_close(&q->w, ']');
    }
    jw_close(&q->w, '}');
    return 0;
}

/* A system prompt (a string or text blocks, at `p`) as chat's system message. */
static int m2c_system(xlq *q, const json_tok *sys, const char *p) {
    buf text = {0};
    if (xl_join(q, sys, p, "text", &text) < 0) return LTG_ERR;
    jw_open(&q->w, '{');
    jw_key(&q->w, "role"), jw_lit(&q->w, "system");
    jw_key(&q->w, "content"), xl_escaped(&q->w, &text);
    jw_close(&q->w, '}');
    buf_free(&text);
    return 0;
}

/* The turns: the system prompt first; a system turn among them (Claude Code sends them, with
 * the mid-conversation-system beta) stays where it is, as chat allows. */
static int m2c_messages(xlq *q) {
    static const char *const names[] = {"role", "content", NULL};
    json_tok msgs, m, f[2], *role = &f[0], *content = &f[1], sys;
    size_t pos = 0;
    unsigned got;
    char p[64];
    jw_key(&q->w, "messages"), jw_open(&q->w, '[');
    if (xl_get(q, M2C_system, &sys) && m2c_system(q, &sys, "/system") < 0) return LTG_ERR;
    if (!xl_get(q, M2C_messages, &msgs) || msgs.type != JSON_ARRAY)
        return xl_refuse(q, "/messages", "/messages: an array of turns is needed");
    for (int i = 0; jv_next_members(q->s, q->n, &msgs, &pos, names, f, &got, &m); i++) {
        xl_ptr(p, sizeof p, "/messages", NULL, i, NULL);
        if (got != 3 || (content->type != JSON_STRING && content->type != JSON_ARRAY))
            return xl_refuse(q, p, "%s: a turn needs a role and a content", p);
        xl_ptr(p, sizeof p, "/messages", NULL, i, "content");
        int r = json_eq(q->s, role, 0, "user")        ? m2c_user(q, content, p)
                : json_eq(q->s, role, 0, "assistant") ? m2c_assistant(q, content, p)
                : json_eq(q->s, role, 0, "system")    ? m2c_system(q, content, p)
                                                       : xl_refuse(q, p, "%s: a role of "
                                                                   "user, assistant or system", p);
        if (r < 0) return LTG_ERR;
    }
    jw_close(&q->w, ']');
    return 0;
}

/* "tools" (client tools only: Anthropic's server tools run at Anthropic) and "tool_choice". */
static int m2c_tools(xlq *q) {
    json_tok tools, tl, k, t, tc;
    size_t pos = 0;
    char p[64], cn[65];
    if (!xl_get(q, M2C_tools, &tools) || tools.type != JSON_ARRAY) return 0;
    jw_key(&q->w, "tools"), jw_open(&q->w, '[');
    for (int i = 0; jv_next(q->s, q->n, &tools, &pos, &k, &tl); i++) {
        xl_ptr(p, sizeof p, "/tools", NULL, i, "type");
        if (jv_get(q->s, q->n, &tl, "type", &t) && !json_eq(q->s, &t, 0, "custom"))
            return xl_refuse(q, p, "%s: the server tool \"%.*s\" has no OpenAI chat equivalent",
                             p, (int)(t.end - t.start), q->s + t.start);
        if (!jv_get(q->s, q->n, &tl, "name", &t) || t.type != JSON_STRING)
            return xl_refuse(q, p, "/tools/%d: a tool needs a name", i);
        xl_chat_name(q->s + t.start, t.end - t.start, cn);
        jw_open(&q->w, '{');
        jw_key(&q->w, "type"), jw_lit(&q->w, "function");
        jw_key(&q->w, "function"), jw_open(&q->w, '{');
        jw_key(&q->w, "name"), jw_cstr(&q->w, cn);
        if (jv_get(q->s, q->n, &tl, "description", &t)) {
            jw_key(&q->w, "description"), xl_copy(q, &t);
        }
        jw_key(&q->w, "parameters");
        if (jv_get(q->s, q->n, &tl, "input_schema", &t)) xl_copy(q, &t);
        else jw_raw(&q->w, "{\"type\":\"object\",\"properties\":{}}", 33);
        jw_close(&q->w, '}'), jw_close(&q->w, '}');
        xl_cache_drop(q, &tl, "/tools", i);
    }
    jw_close(&q->w, ']');
    if (!xl_get(q, M2C_tool_choice, &tc)) return 0;
    jv_get(q->s, q->n, &tc, "type", &t);
    jw_key(&q->w, "tool_choice");
    if (json_eq(q->s, &t, 0, "tool") && jv_get(q->s, q->n, &tc, "name", &t)) {
        xl_chat_name(q->s + t.start, t.end - t.start, cn);
        jw_open(&q->w, '{');
        jw_key(&q->w, "type"), jw_lit(&q->w, "function");
        jw_key(&q->w, "function"), jw_open(&q->w, '{');
        jw_key(&q->w, "name"), jw_cstr(&q->w, cn);
        jw_close(&q->w, '}'), jw_close(&q->w, '}');
    } else {
        jw_cstr(&q->w, json_eq(q->s, &t, 0, "any")    ? "required"
                       : json_eq(q->s, &t, 0, "none") ? "none"
                                                      : "auto");
    }
    if (jv_get(q->s, q->n, &tc, "disable_parallel_tool_use", &t) && t.type == JSON_TRUE) {
        jw_key(&q->w, "parallel_tool_calls"), jw_bool(&q->w, 0);
    }
    return 0;
}

/* Anthropic's thinking budget (or adaptive effort) as chat's reasoning_effort: to a model that
 * takes one; else a hint dropped. */
static void m2c_reasoning(xlq *q) {
    json_tok th, t, oc, eff;
    int has_eff = xl_get(q, M2C_output_config, &oc) &&
                  jv_get(q->s, q->n, &oc, "effort", &eff) && eff.type == JSON_STRING;
    long long budget = 0;
    if (!xl_get(q, M2C_thinking, &th) || !jv_get(q->s, q->n, &th, "type", &t) ||
        json_eq(q->s, &t, 0, "disabled")) {
        if (has_eff && !q->to->reasoning) xl_drop(q, "/output_config/effort", "effort");
        else if (has_eff) jw_key(&q->w, "reasoning_effort"), xl_copy(q, &eff);
        return;
    }
    if (!q->to->reasoning) {
        xl_drop(q, "/thinking", "thinking");
        return;
    }
    jw_key(&q->w, "reasoning_effort");
    if (has_eff) {
        xl_copy(q, &eff);
        return;
    }
    if (jv_get(q->s, q->n, &th, "budget_tokens", &t)) json_int(q->s, &t, 0, &budget);
    jw_cstr(&q->w, budget && budget < 2048 ? "low" : budget && budget < 4096 ? "medium" : "high");
}

/* The rest: the output limit, stops, sampling, the user, structured output, streaming. */
static int m2c_options(xlq *q) {
    json_tok v, k, e, t;
    size_t pos = 0;
    int n = 0;
    if (xl_get(q, M2C_max_tokens, &v)) jw_key(&q->w, "max_tokens"), xl_copy(q, &v);
    if (xl_get(q, M2C_stop_sequences, &v) && v.type == JSON_ARRAY) {
        while (jv_next(q->s, q->n, &v, &pos, &k, &e)) n++;
        if (n > 4)
            return xl_refuse(q, "/stop_sequences",
                             "/stop_sequences: OpenAI chat takes at most 4 stop sequences");
        if (n) jw_key(&q->w, "stop"), xl_copy(q, &v);
    }
    static const int same[] = {M2C_temperature, M2C_top_p};
    for (int i = 0; i < 2; i++)
        if (xl_get(q, same[i], &v)) jw_name(&q->w, M2C_FIELDS[same[i]].name), xl_copy(q, &v);
    if (xl_get(q, M2C_metadata, &v)) {
        if (jv_get(q->s, q->n, &v, "user_id", &t) && t.type == JSON_STRING)
            jw_key(&q->w, "user"), xl_copy(q, &t);
        pos = 0;
        while (jv_next(q->s, q->n, &v, &pos, &k, &e))
            if (!json_eq(q->s, &k, 0, "user_id")) xl_drop(q, "/metadata", "metadata");
    }
    m2c_reasoning(q);
    /* structured output: output_config.format, or the beta's top-level output_format */
    int fmt = xl_get(q, M2C_output_config, &v) && jv_get(q->s, q->n, &v, "format", &e);
    const char *fp = fmt ? "/output_config/format" : "/output_format";
    if (fmt || (xl_get(q, M2C_output_format, &e) && e.type != JSON_NULL)) {
        if (!jv_get(q->s, q->n, &e, "schema", &t))
            return xl_refuse(q, fp, "%s: a json_schema format with its schema", fp);
        jw_key(&q->w, "response_format"), jw_open(&q->w, '{');
        jw_key(&q->w, "type"), jw_lit(&q->w, "json_schema");
        jw_key(&q->w, "json_schema"), jw_open(&q->w, '{');
        jw_key(&q->w, "name"), jw_lit(&q->w, "output");
        jw_key(&q->w, "schema"), xl_copy(q, &t);
        jw_close(&q->w, '}'), jw_close(&q->w, '}');
    }
    if (xl_get(q, M2C_stream, &v) && v.type == JSON_TRUE) xl_chat_stream(q);
    return 0;
}

static int m2c_request(xlq *q, const json_tok *root) {
    if (xl_fields(q, root, M2C_FIELDS, "OpenAI chat") < 0) return LTG_ERR;
    jw_open(&q->w, '{');
    jw_key(&q->w, "model"), jw_cstr(&q->w, q->to->upstream);
    if (m2c_messages(q) < 0 || m2c_tools(q) < 0 || m2c_options(q) < 0)
        return LTG_ERR;
    jw_close(&q->w, '}');
    return 0;
}

/* ---- requests: OpenAI chat to Anthropic Messages ---- */

#define C2M_ROWS(X) \
    X(model, XF_MAP, NULL) X(messages, XF_MAP, NULL) X(max_tokens, XF_MAP, NULL) \
    X(max_completion_tokens, XF_MAP, NULL) X(temperature, XF_MAP, NULL) X(top_p, XF_MAP, NULL) \
    X(stop, XF_MAP, NULL) X(stream, XF_MAP, NULL) X(stream_options, XF_MAP, NULL) \
    X(tools, XF_MAP, NULL) X(tool_choice, XF_MAP, NULL) X(parallel_tool_calls, XF_MAP, NULL) \
    X(response_format, XF_MAP, NULL) X(user, XF_MAP, NULL) X(reasoning_effort, XF_MAP, NULL) \
    X(n, XF_MAP, NULL) X(seed, XF_DROP, NULL) X(frequency_penalty, XF_DROP, NULL) \
    X(presence_penalty, XF_DROP, NULL) X(logit_bias, XF_DROP, NULL) X(metadata, XF_DROP, NULL) \
    X(store, XF_DROP, NULL) X(service_tier, XF_DROP, NULL) X(verbosity, XF_DROP, NULL) \
    X(prompt_cache_key, XF_DROP, NULL) X(safety_identifier, XF_DROP, NULL) \
    X(prompt_cache_retention, XF_DROP, NULL) \
    X(logprobs, XF_REFUSE, "Anthropic gives no log probabilities") \
    X(top_logprobs, XF_REFUSE, "Anthropic gives no log probabilities") \
    X(audio, XF_REFUSE, "Anthropic answers no audio") \
    X(modalities, XF_REFUSE, "Anthropic answers text only") \
    X(prediction, XF_REFUSE, "Anthropic has no predicted outputs") \
    X(web_search_options, XF_REFUSE, "Anthropic's web search is a server tool ltg does not map") \
    X(functions, XF_REFUSE, "the legacy functions: send tools") \
    X(function_call, XF_REFUSE, "the legacy function_call: send tool_choice")
#define C2M_ENUM(name, fate, why) C2M_##name,
enum { C2M_ROWS(C2M_ENUM) C2M_N };
_Static_assert(C2M_N <= XL_MAX_FIELDS, "a field's bit in xlq.has, its value in vals");
static const xl_field C2M_FIELDS[] = {C2M_ROWS(XL_ROW) {NULL, XF_MAP, NULL}};

/* A data: URL's media type and base64 data (escaped, as in the body); 0 when it is not one. */
static int c2m_data_url(const char *s, const json_tok *u, json_tok *mt, json_tok *data) {
    const char *p = s + u->start, *end = s + u->end;
    const char *semi = memchr(p, ';', (size_t)(end - p));
    if (u->end - u->start < 5 || memcmp(p, "data:", 5) != 0 || !semi ||
        (size_t)(end - semi) < 8 || memcmp(semi, ";base64,", 8) != 0)
        return 0;
    *mt = (json_tok){JSON_STRING, u->start + 5, (uint32_t)(semi - s), 0, 0};
    *data = (json_tok){JSON_STRING, (uint32_t)(semi + 8 - s), u->end, 0, 0};
    return 1;
}

/* A chat content part (text, image_url, file) as an Anthropic block. */
static int c2m_part(xlq *q, const json_tok *part, const char *p) {
    json_tok t, v, u, mt, data;
    if (part->type == JSON_STRING || !jv_get(q->s, q->n, part, "type", &t))
        return xl_refuse(q, p, "%s: a content part {type, ...} is needed", p);
    int text = json_eq(q->s, &t, 0, "text") || json_eq(q->s, &t, 0, "refusal");
    int image = json_eq(q->s, &t, 0, "image_url"), file = json_eq(q->s, &t, 0, "file");
    if (text) {
        if (!jv_get(q->s, q->n, part, json_eq(q->s, &t, 0, "text") ? "text" : "refusal", &v) ||
            v.type != JSON_STRING || xl_blank(q->s, &v))
            return 0; /* Anthropic refuses a blank text block; it carries nothing */
        jw_open(&q->w, '{');
        jw_key(&q->w, "type"), jw_lit(&q->w, "text");
        jw_key(&q->w, "text"), xl_copy(q, &v);
        jw_close(&q->w, '}');
        return 0;
    }
    if (!image && !file)
        return xl_refuse(q, p, "%s: a %.*s part has no Anthropic Messages equivalent", p,
                         (int)(t.end - t.start), q->s + t.start);
    if (!jv_get(q->s, q->n, part, image ? "image_url" : "file", &v) ||
        !jv_get(q->s, q->n, &v, image ? "url" : "file_data", &u) || u.type != JSON_STRING)
        return xl_refuse(q, p, "%s: %s", p,
                         image ? "an image_url with its url"
                               : "Anthropic takes a file as file_data (a file_id lives at OpenAI)");
    if (image && jv_get(q->s, q->n, &v, "detail", &t)) xl_drop(q, p, "detail");
    jw_open(&q->w, '{');
    jw_key(&q->w, "type"), jw_cstr(&q->w, image ? "image" : "document");
    jw_key(&q->w, "source"), jw_open(&q->w, '{');
    if (c2m_data_url(q->s, &u, &mt, &data)) {
        buf b = {0};
        jw_key(&q->w, "type"), jw_lit(&q->w, "base64");
        buf_append(&b, q->s + mt.start, mt.end - mt.start);
        jw_key(&q->w, "media_type"), xl_escaped(&q->w, &b); /* slices of a string: no quotes */
        b.len = 0;
        buf_append(&b, q->s + data.start, data.end - data.start);
        jw_key(&q->w, "data"), xl_escaped(&q->w, &b);
        buf_free(&b);
    } else if (image) {
        jw_key(&q->w, "type"), jw_lit(&q->w, "url");
        jw_key(&q->w, "url"), xl_copy(q, &u);
    } else {
        return xl_refuse(q, p, "%s: file_data must be a data: URL with base64", p);
    }
    jw_close(&q->w, '}'), jw_close(&q->w, '}');
    return 0;
}

/* A chat message's content (a string, or parts) as blocks of the open Anthropic turn. */
static int c2m_content(xlq *q, const json_tok *c, const char *p) {
    size_t pos = 0;
    json_tok k, part;
    char pp[200];
    if (c->type == JSON_STRING) {
        if (xl_blank(q->s, c)) return 0;
        jw_open(&q->w, '{');
        jw_key(&q->w, "type"), jw_lit(&q->w, "text");
        jw_key(&q->w, "text"), xl_copy(q, c);
        jw_close(&q->w, '}');
        return 0;
    }
    if (c->type != JSON_ARRAY) return 0; /* null: no content */
    for (int i = 0; jv_next(q->s, q->n, c, &pos, &k, &part); i++) {
        xl_ptr(pp, sizeof pp, p, NULL, i, NULL);
        if (c2m_part(q, &part, pp) < 0) return LTG_ERR;
    }
    return 0;
}

/* An assistant's tool call as a tool_use block: its arguments, a JSON string, must hold an
 * object ("" is {}), which becomes "input" as it is. */
static int c2m_tool_use(xlq *q, const json_tok *call, const char *p) {
    json_tok f, name, args, id;
    if (!jv_get(q->s, q->n, call, "function", &f) || !jv_get(q->s, q->n, &f, "name", &name) ||
        name.type != JSON_STRING || !jv_get(q->s, q->n, call, "id", &id) || id.type != JSON_STRING)
        return xl_refuse(q, p, "%s: a tool call needs its id and function.name", p);
    buf a = {0};
    json_tok tt[1];
    json_result res;
    if (jv_get(q->s, q->n, &f, "arguments", &args) && args.type == JSON_STRING)
        json_unescape(q->s, &args, 0, &a);
    int empty = a.len == 0;
    if (!empty && (json_parse(a.p, a.len, tt, 1, 0, &res) < 0 || tt[0].type != JSON_OBJECT)) {
        buf_free(&a);
        return xl_refuse(q, p, "%s/function/arguments: Anthropic takes tool input as a JSON "
                         "object, and these arguments are not one", p);
    }
    jw_open(&q->w, '{');
    jw_key(&q->w, "type"), jw_lit(&q->w, "tool_use");
    jw_key(&q->w, "id"), xl_write_id(q, &id);
    jw_key(&q->w, "name"), xl_copy(q, &name);
    jw_key(&q->w, "input"), jw_raw(&q->w, empty ? "{}" : a.p, empty ? 2 : a.len);
    jw_close(&q->w, '}');
    buf_free(&a);
    return 0;
}

/* A chat message's members (a missing one is null), found as the messages are walked. */
enum { CM_ROLE, CM_CONTENT, CM_CALLS, CM_REASONING, CM_CALL_ID, CM_N };
static const char *const CM_NAMES[] = {"role", "content", "tool_calls", "reasoning_content",
                                       "tool_call_id", NULL};

/* An assistant message (its members f): one Anthropic turn, its text then its tool calls. */
static int c2m_assistant(xlq *q, const json_tok *f, unsigned got, const char *p) {
    json_tok k, call;
    const json_tok *c = &f[CM_CONTENT], *calls = &f[CM_CALLS];
    size_t pos = 0;
    char pp[200];
    xl_ptr(pp, sizeof pp, p, "reasoning_content", -1, NULL);
    if (got >> CM_REASONING & 1) xl_drop(q, pp, "reasoning_content");
    int has_calls = calls->type == JSON_ARRAY;
    jw_open(&q->w, '{');
    jw_key(&q->w, "role"), jw_lit(&q->w, "assistant");
    jw_key(&q->w, "content");
    if (c->type == JSON_STRING && !xl_blank(q->s, c) &&
        (!has_calls || calls->end - calls->start <= 2)) { /* text alone stays a string */
        xl_copy(q, c), jw_close(&q->w, '}');
        return 0;
    }
    jw_open(&q->w, '[');
    size_t at = q->w.out->len;
    xl_ptr(pp, sizeof pp, p, "content", -1, NULL);
    if (c2m_content(q, c, pp) < 0) return LTG_ERR;
    if (has_calls)
        for (int i = 0; jv_next(q->s, q->n, calls, &pos, &k, &call); i++) {
            xl_ptr(pp, sizeof pp, p, "tool_calls", i, NULL);
            if (c2m_tool_use(q, &call, pp) < 0) return LTG_ERR;
        }
    if (q->w.out->len == at) { /* Anthropic refuses an empty turn: "(empty)" stands for it */
        jw_open(&q->w, '{');
        jw_key(&q->w, "type"), jw_lit(&q->w, "text");
        jw_key(&q->w, "text"), jw_lit(&q->w, "(empty)");
        jw_close(&q->w, '}');
    }
    jw_close(&q->w, ']'), jw_close(&q->w, '}');
    return 0;
}

/* A tool message (its members f) as a tool_result block of the user turn that follows the
 * call. */
static int c2m_tool_result(xlq *q, const json_tok *f, const char *p) {
    const json_tok *id = &f[CM_CALL_ID], *c = &f[CM_CONTENT];
    buf text = {0};
    char pp[200];
    if (id->type != JSON_STRING)
        return xl_refuse(q, p, "%s: a tool message needs its tool_call_id", p);
    xl_ptr(pp, sizeof pp, p, "content", -1, NULL);
    if (c->type != JSON_NULL && xl_join(q, c, pp, "text", &text) < 0) return LTG_ERR;
    jw_open(&q->w, '{');
    jw_key(&q->w, "type"), jw_lit(&q->w, "tool_result");
    jw_key(&q->w, "tool_use_id"), xl_write_id(q, id);
    if (text.len) jw_key(&q->w, "content"), xl_escaped(&q->w, &text);
    jw_close(&q->w, '}');
    buf_free(&text);
    return 0;
}

/* The system and developer messages, in order, become Anthropic's top-level "system": one with
 * a string content stays a string, several are text blocks, written into sys (a writer inside
 * the array) as the turns are. */
typedef struct {
    jwriter w;
    buf blocks;
    json_tok first;   /* the first one's content */
    int count, first_i;
} c2m_sys;

static int c2m_system_add(xlq *q, c2m_sys *sys, const json_tok *c, int i) {
    char p[80];
    jwriter turns = q->w;
    int rc = 0;
    if (sys->count++ == 0) {
        sys->first = *c, sys->first_i = i;
        return 0;
    }
    q->w = sys->w; /* the blocks go to sys */
    if (sys->count == 2) {
        xl_ptr(p, sizeof p, "/messages", NULL, sys->first_i, "content");
        rc = c2m_content(q, &sys->first, p);
    }
    xl_ptr(p, sizeof p, "/messages", NULL, i, "content");
    if (rc == 0) rc = c2m_content(q, c, p);
    sys->w = q->w, q->w = turns;
    return rc;
}

/* "system", after the turns. */
static int c2m_system(xlq *q, c2m_sys *sys) {
    char p[80];
    const json_tok *first = &sys->first;
    if (sys->count == 0 || (sys->count == 1 && first->type == JSON_STRING && xl_blank(q->s, first)))
        return 0;
    jw_key(&q->w, "system");
    if (sys->count == 1 && first->type == JSON_STRING) return xl_copy(q, first), 0;
    jw_open(&q->w, '[');
    if (sys->count == 1) {
        xl_ptr(p, sizeof p, "/messages", NULL, sys->first_i, "content");
        if (c2m_content(q, first, p) < 0) return LTG_ERR;
    } else {
        buf_append(q->w.out, sys->blocks.p, sys->blocks.len);
    }
    jw_close(&q->w, ']');
    return 0;
}

/* The turns. Consecutive tool messages are one user turn, right after the assistant's calls,
 * and a user message that follows them joins that turn after its results -- Anthropic wants
 * every result immediately after its call. Each message is walked once. */
static int c2m_messages(xlq *q, const json_tok *msgs, c2m_sys *sys, int *last_calls) {
    size_t pos = 0;
    json_tok m, f[CM_N], *role = &f[CM_ROLE], *c = &f[CM_CONTENT];
    unsigned got;
    char p[64], pp[80];
    int open = 0; /* a user turn is open */
    jw_key(&q->w, "messages"), jw_open(&q->w, '[');
    for (int i = 0; jv_next_members(q->s, q->n, msgs, &pos, CM_NAMES, f, &got, &m); i++) {
        xl_ptr(p, sizeof p, "/messages", NULL, i, NULL);
        if (!(got >> CM_ROLE & 1)) return xl_refuse(q, p, "%s: a message needs a role", p);
        int user = json_eq(q->s, role, 0, "user"), tool = json_eq(q->s, role, 0, "tool");
        if (json_eq(q->s, role, 0, "system") || json_eq(q->s, role, 0, "developer")) {
            if (c2m_system_add(q, sys, c, i) < 0) return LTG_ERR;
            continue;
        }
        if (!user && !tool && !json_eq(q->s, role, 0, "assistant"))
            return xl_refuse(q, p, "%s/role: no Anthropic Messages equivalent", p);
        if (!user && !tool) {
            if (open) jw_close(&q->w, ']'), jw_close(&q->w, '}');
            open = 0;
            *last_calls = f[CM_CALLS].type == JSON_ARRAY && f[CM_CALLS].end - f[CM_CALLS].start > 2;
            if (c2m_assistant(q, f, got, p) < 0) return LTG_ERR;
            continue;
        }
        if (!open && user && c->type == JSON_STRING && !xl_blank(q->s, c)) {
            jw_open(&q->w, '{'); /* a string stays a string */
            jw_key(&q->w, "role"), jw_lit(&q->w, "user");
            jw_key(&q->w, "content"), xl_copy(q, c);
            jw_close(&q->w, '}');
            continue;
        }
        if (!open) {
            jw_open(&q->w, '{');
            jw_key(&q->w, "role"), jw_lit(&q->w, "user");
            jw_key(&q->w, "content"), jw_open(&q->w, '[');
        }
        open = tool; /* a user message closes the turn its results opened */
        xl_ptr(pp, sizeof pp, p, "content", -1, NULL);
        if (tool ? c2m_tool_result(q, f, p) < 0 : c2m_content(q, c, pp) < 0) return LTG_ERR;
        if (!open) jw_close(&q->w, ']'), jw_close(&q->w, '}');
    }
    if (open) jw_close(&q->w, ']'), jw_close(&q->w, '}');
    jw_close(&q->w, ']');
    return 0;
}

/* "tools", "tool_choice" and parallel_tool_calls. */
static int c2m_tools(xlq *q) {
    json_tok tools, k, tl, t, f, v;
    size_t pos = 0;
    char p[64];
    int has = xl_get(q, C2M_tools, &tools) && tools.type == JSON_ARRAY &&
              tools.end - tools.start > 2;
    if (has) {
        jw_key(&q->w, "tools"), jw_open(&q->w, '[');
        for (int i = 0; jv_next(q->s, q->n, &tools, &pos, &k, &tl); i++) {
            xl_ptr(p, sizeof p, "/tools", NULL, i, "type");
            if (!jv_get(q->s, q->n, &tl, "type", &t) || !json_eq(q->s, &t, 0, "function") ||
                !jv_get(q->s, q->n, &tl, "function", &f) || !jv_get(q->s, q->n, &f, "name", &v))
                return xl_refuse(q, p, "%s: only function tools have an Anthropic equivalent", p);
            jw_open(&q->w, '{');
            jw_key(&q->w, "name"), xl_copy(q, &v);
            if (jv_get(q->s, q->n, &f, "description", &v))
                jw_key(&q->w, "description"), xl_copy(q, &v);
            jw_key(&q->w, "input_schema");
            if (jv_get(q->s, q->n, &f, "parameters", &v)) xl_copy(q, &v);
            else jw_raw(&q->w, "{\"type\":\"object\",\"properties\":{}}", 33);
            if (jv_get(q->s, q->n, &f, "strict", &v)) jw_key(&q->w, "strict"), xl_copy(q, &v);
            jw_close(&q->w, '}');
        }
        jw_close(&q->w, ']');
    }
    json_tok tc, par;
    int choice = xl_get(q, C2M_tool_choice, &tc);
    int serial = xl_get(q, C2M_parallel_tool_calls, &par) && par.type == JSON_FALSE;
    if (!has || (!choice && !serial)) return 0;
    jw_key(&q->w, "tool_choice"), jw_open(&q->w, '{');
    if (choice && tc.type == JSON_OBJECT && jv_get(q->s, q->n, &tc, "function", &f) &&
        jv_get(q->s, q->n, &f, "name", &v)) {
        jw_key(&q->w, "type"), jw_lit(&q->w, "tool");
        jw_key(&q->w, "name"), xl_copy(q, &v);
    } else {
        jw_key(&q->w, "type");
        jw_cstr(&q->w, choice && json_eq(q->s, &tc, 0, "required") ? "any"
                       : choice && json_eq(q->s, &tc, 0, "none")   ? "none"
                                                                   : "auto");
    }
    if (serial) jw_key(&q->w, "disable_parallel_tool_use"), jw_bool(&q->w, 1);
    jw_close(&q->w, '}');
    return 0;
}

/* chat's reasoning_effort as Anthropic's thinking budget (1024, 2048, 4096 tokens for low,
 * medium, high), below max_tokens. Off when the history ends in a tool call: its turn has no
 * thinking block signed by Anthropic, which Claude then requires. */
static int c2m_thinking(xlq *q, long long max_tokens, int last_calls) {
    json_tok e;
    if (!xl_get(q, C2M_reasoning_effort, &e) || e.type != JSON_STRING) return 0;
    if (json_eq(q->s, &e, 0, "none") || json_eq(q->s, &e, 0, "minimal")) return 0;
    if (!q->to->reasoning || last_calls) {
        xl_drop(q, "/reasoning_effort", "reasoning_effort");
        return 0;
    }
    long long budget = json_eq(q->s, &e, 0, "low") ? 1024 : json_eq(q->s, &e, 0, "medium") ? 2048
                                                                                             : 4096;
    if (budget >= max_tokens) budget = max_tokens - 1;
    if (budget < 1024)
        return xl_refuse(q, "/reasoning_effort",
                         "/reasoning_effort: Anthropic's thinking needs max_tokens above 1024");
    jw_key(&q->w, "thinking"), jw_open(&q->w, '{');
    jw_key(&q->w, "type"), jw_lit(&q->w, "enabled");
    jw_key(&q->w, "budget_tokens"), jw_int(&q->w, budget);
    jw_close(&q->w, '}');
    return 0;
}

/* The output limit (the model's max_output_tokens when the client gave none: Anthropic needs
 * one), stops, sampling, structured output, the user, streaming. */
static int c2m_options(xlq *q, int last_calls) {
    json_tok v, k, e;
    long long max = 0, n;
    size_t pos = 0;
    static const int limits[] = {C2M_max_completion_tokens, C2M_max_tokens};
    for (int i = 0; i < 2 && !max; i++)
        if (xl_get(q, limits[i], &v) && json_int(q->s, &v, 0, &n) == 0) max = n;
    jw_key(&q->w, "max_tokens"), jw_int(&q->w, max > 0 ? max : q->to->max_output_tokens);
    if (xl_get(q, C2M_n, &v) && json_int(q->s, &v, 0, &n) == 0 && n > 1)
        return xl_refuse(q, "/n", "/n: Anthropic makes one answer per request");
    if (xl_get(q, C2M_stop, &v) && v.type != JSON_NULL) {
        jw_key(&q->w, "stop_sequences"), jw_open(&q->w, '[');
        if (v.type == JSON_STRING) e = v;
        for (int i = 0; v.type == JSON_STRING ? i == 0 : jv_next(q->s, q->n, &v, &pos, &k, &e);
             i++) {
            if (e.type != JSON_STRING || xl_blank(q->s, &e))
                return xl_refuse(q, "/stop", "/stop: Anthropic refuses a blank stop sequence");
            xl_copy(q, &e);
        }
        jw_close(&q->w, ']');
    }
    double temp;
    if (xl_get(q, C2M_temperature, &v) && v.type != JSON_NULL) {
        if (json_number(q->s, &v, 0, &temp) < 0 || temp > 1)
            return xl_refuse(q, "/temperature",
                             "/temperature: Anthropic takes 0 to 1 (chat's 0 to 2 does not fit)");
        jw_key(&q->w, "temperature"), xl_copy(q, &v);
    }
    if (xl_get(q, C2M_top_p, &v) && v.type != JSON_NULL)
        jw_key(&q->w, "top_p"), xl_copy(q, &v);
    if (c2m_thinking(q, max > 0 ? max : q->to->max_output_tokens, last_calls) < 0)
        return LTG_ERR;
    if (xl_get(q, C2M_response_format, &v) && jv_get(q->s, q->n, &v, "type", &e) &&
        !json_eq(q->s, &e, 0, "text")) {
        if (!json_eq(q->s, &e, 0, "json_schema") || !jv_get(q->s, q->n, &v, "json_schema", &k) ||
            !jv_get(q->s, q->n, &k, "schema", &e))
            return xl_refuse(q, "/response_format",
                             "/response_format: Anthropic takes a json_schema, not json_object");
        jw_key(&q->w, "output_config"), jw_open(&q->w, '{');
        jw_key(&q->w, "format"), jw_open(&q->w, '{');
        jw_key(&q->w, "type"), jw_lit(&q->w, "json_schema");
        jw_key(&q->w, "schema"), xl_copy(q, &e);
        jw_close(&q->w, '}'), jw_close(&q->w, '}');
    }
    if (xl_get(q, C2M_user, &v) && v.type == JSON_STRING) {
        jw_key(&q->w, "metadata"), jw_open(&q->w, '{');
        jw_key(&q->w, "user_id"), xl_copy(q, &v);
        jw_close(&q->w, '}');
    }
    if (xl_get(q, C2M_stream, &v) && v.type == JSON_TRUE)
        jw_key(&q->w, "stream"), jw_bool(&q->w, 1);
    if (xl_get(q, C2M_stream_options, &v) &&
        jv_get(q->s, q->n, &v, "include_usage", &e) && e.type == JSON_TRUE)
        q->v->include_usage = 1;
    return 0;
}

static int c2m_request(xlq *q, const json_tok *root) {
    json_tok msgs;
    int last_calls = 0, rc;
    c2m_sys sys = {0};
    if (xl_fields(q, root, C2M_FIELDS, "Anthropic Messages") < 0) return LTG_ERR;
    if (!xl_get(q, C2M_messages, &msgs) || msgs.type != JSON_ARRAY)
        return xl_refuse(q, "/messages", "/messages: an array of messages is needed");
    jw_open(&q->w, '{');
    jw_key(&q->w, "model"), jw_cstr(&q->w, q->to->upstream);
    jw_init(&sys.w, &sys.blocks);
    sys.w.depth = 1; /* inside the array c2m_system opens */
    rc = c2m_messages(q, &msgs, &sys, &last_calls) < 0 || c2m_system(q, &sys) < 0 ||
         c2m_tools(q) < 0 || c2m_options(q, last_calls) < 0 ? LTG_ERR : 0;
    buf_free(&sys.blocks);
    if (rc == 0) jw_close(&q->w, '}');
    return rc;
}

/* ---- requests: OpenAI Responses to OpenAI chat ---- */

#define R2C_ROWS(X) \
    X(model, XF_MAP, NULL) X(input, XF_MAP, NULL) X(instructions, XF_MAP, NULL) \
    X(tools, XF_MAP, NULL) X(tool_choice, XF_MAP, NULL) X(parallel_tool_calls, XF_MAP, NULL) \
    X(text, XF_MAP, NULL) X(reasoning, XF_MAP, NULL) X(max_output_tokens, XF_MAP, NULL) \
    X(temperature, XF_MAP, NULL) X(top_p, XF_MAP, NULL) X(user, XF_MAP, NULL) \
    X(stream, XF_MAP, NULL) X(store, XF_MAP, NULL) X(include, XF_DROP, NULL) \
    X(metadata, XF_DROP, NULL) X(service_tier, XF_DROP, NULL) X(prompt_cache_key, XF_DROP, NULL) \
    X(safety_identifier, XF_DROP, NULL) X(truncation, XF_DROP, NULL) \
    X(stream_options, XF_DROP, NULL) X(prompt_cache_retention, XF_DROP, NULL) \
    X(client_metadata, XF_DROP, NULL) \
    X(previous_response_id, XF_REFUSE, \
      "the response it names was not kept (its model is translated): send the whole input") \
    X(conversation, XF_REFUSE, "a conversation is kept at OpenAI") \
    X(prompt, XF_REFUSE, "a stored prompt is kept at OpenAI") \
    X(background, XF_REFUSE, "a background response runs at OpenAI") \
    X(top_logprobs, XF_REFUSE, "ltg does not carry log probabilities across APIs") \
    X(max_tool_calls, XF_REFUSE, "OpenAI chat has no limit on tool calls")
#define R2C_ENUM(name, fate, why) R2C_##name,
enum { R2C_ROWS(R2C_ENUM) R2C_N };
_Static_assert(R2C_N <= XL_MAX_FIELDS, "a field's bit in xlq.has, its value in vals");
static const xl_field R2C_FIELDS[] = {R2C_ROWS(XL_ROW) {NULL, XF_MAP, NULL}};

/* What r2c_input has written of the current assistant message: none, its text (the object
 * open after "content"), or its tool calls (the "tool_calls" array open). */
typedef enum { R2C_NONE, R2C_TEXT, R2C_CALLS } r2c_open;

typedef struct {
    r2c_open open;
    json_tok calls[XL_MAX_TOOLS]; /* the call_ids of the last calls written, their outputs next */
    int ncalls, outputs;          /* ... how many, and whether outputs have begun */
} r2c_state;

static void r2c_close(xlq *q, r2c_state *st) {
    if (st->open == R2C_CALLS) jw_close(&q->w, ']');
    if (st->open != R2C_NONE) jw_close(&q->w, '}');
    st->open = R2C_NONE;
}

/* The text of parts `c` (input_text, output_text, refusal), joined by newlines, escaped. */
static void r2c_join(xlq *q, const json_tok *c, buf *out) {
    size_t pos = 0;
    json_tok k, part, t;
    while (jv_next(q->s, q->n, c, &pos, &k, &part)) {
        jv_get(q->s, q->n, &part, "type", &t);
        if (!jv_get(q->s, q->n, &part, json_eq(q->s, &t, 0, "refusal") ? "refusal" : "text", &t) ||
            t.type != JSON_STRING)
            continue;
        if (out->len) buf_puts(out, "\\n");
        buf_append(out, q->s + t.start, t.end - t.start);
    }
}

/* One content part with media among its siblings, as a chat part: input_image by URL,
 * input_file with its data, text. */
static int r2c_part(xlq *q, const json_tok *part, const char *pp) {
    json_tok t, v;
    jv_get(q->s, q->n, part, "type", &t);
    jw_open(&q->w, '{');
    if (json_eq(q->s, &t, 0, "input_image")) {
        if (!jv_get(q->s, q->n, part, "image_url", &v) || v.type != JSON_STRING)
            return xl_refuse(q, pp, "%s: an image by image_url (a file_id is kept at OpenAI)", pp);
        jw_key(&q->w, "type"), jw_lit(&q->w, "image_url");
        jw_key(&q->w, "image_url"), jw_open(&q->w, '{');
        jw_key(&q->w, "url"), xl_copy(q, &v);
        if (jv_get(q->s, q->n, part, "detail", &v)) jw_key(&q->w, "detail"), xl_copy(q, &v);
        jw_close(&q->w, '}');
    } else if (json_eq(q->s, &t, 0, "input_file")) {
        if (!jv_get(q->s, q->n, part, "file_data", &v) || v.type != JSON_STRING)
            return xl_refuse(q, pp, "%s: a file by file_data (a file_id or file_url is not "
                             "carried)", pp);
        jw_key(&q->w, "type"), jw_lit(&q->w, "file");
        jw_key(&q->w, "file"), jw_open(&q->w, '{');
        if (jv_get(q->s, q->n, part, "filename", &t))
            jw_key(&q->w, "filename"), xl_copy(q, &t);
        jw_key(&q->w, "file_data"), xl_copy(q, &v);
        jw_close(&q->w, '}');
    } else {
        jv_get(q->s, q->n, part, json_eq(q->s, &t, 0, "refusal") ? "refusal" : "text", &v);
        jw_key(&q->w, "type"), jw_lit(&q->w, "text");
        jw_key(&q->w, "text");
        if (v.type == JSON_STRING) xl_copy(q, &v);
        else jw_lit(&q->w, "");
    }
    jw_close(&q->w, '}');
    return 0;
}

/* Content parts of a message item (or a string) as chat content: text alone joined into one
 * string, which every chat server takes; with images or files, parts. */
static int r2c_content(xlq *q, const json_tok *c, const char *p) {
    size_t pos = 0;
    json_tok k, part, t;
    int media = 0;
    char pp[200];
    if (c->type == JSON_STRING) return xl_copy(q, c), 0;
    if (c->type != JSON_ARRAY) return xl_refuse(q, p, "%s: a string or an array of parts", p);
    for (int i = 0; jv_next(q->s, q->n, c, &pos, &k, &part); i++) {
        xl_ptr(pp, sizeof pp, p, NULL, i, "type");
        jv_get(q->s, q->n, &part, "type", &t);
        if (json_eq(q->s, &t, 0, "input_image") || json_eq(q->s, &t, 0, "input_file")) {
            media = 1;
        } else if (!json_eq(q->s, &t, 0, "input_text") && !json_eq(q->s, &t, 0, "output_text") &&
                   !json_eq(q->s, &t, 0, "refusal")) {
            return xl_refuse(q, pp, "%s: a %.*s part has no OpenAI chat equivalent", pp,
                             (int)(t.end - t.start), q->s + t.start);
        }
    }
    if (!media) {
        buf text = {0};
        r2c_join(q, c, &text);
        xl_escaped(&q->w, &text);
        buf_free(&text);
        return 0;
    }
    jw_open(&q->w, '[');
    pos = 0;
    for (int i = 0; jv_next(q->s, q->n, c, &pos, &k, &part); i++) {
        xl_ptr(pp, sizeof pp, p, NULL, i, NULL);
        if (r2c_part(q, &part, pp) < 0) return LTG_ERR;
    }
    jw_close(&q->w, ']');
    return 0;
}

/* A tool's "name" for chat: its own, or NS__name for a tool of namespace ns (xl_tool_of names
 * the answer's calls back). */
static void r2c_name(xlq *q, const json_tok *ns, const json_tok *name) {
    jw_key(&q->w, "name");
    if (!ns) {
        xl_copy(q, name);
        return;
    }
    jw_sep(&q->w);
    buf_puts(q->w.out, "\"");
    buf_append(q->w.out, q->s + ns->start, ns->end - ns->start);
    buf_puts(q->w.out, "__");
    buf_append(q->w.out, q->s + name->start, name->end - name->start);
    buf_puts(q->w.out, "\"");
}

/* A function_call or custom_tool_call item as an entry of the assistant message's tool_calls
 * (opened after its text, if any): a custom tool's free-form input becomes the arguments
 * {"input": ...} of the function it is to chat (r2c_tools). */
static int r2c_call(xlq *q, r2c_state *st, const json_tok *item, int custom, const char *p) {
    json_tok id, name, v;
    if (!jv_get(q->s, q->n, item, "call_id", &id) || id.type != JSON_STRING ||
        !jv_get(q->s, q->n, item, "name", &name) || name.type != JSON_STRING)
        return xl_refuse(q, p, "%s: a call needs its call_id and name", p);
    if (st->open == R2C_NONE) {
        jw_open(&q->w, '{');
        jw_key(&q->w, "role"), jw_lit(&q->w, "assistant");
        jw_key(&q->w, "content"), jw_null(&q->w);
    }
    if (st->open != R2C_CALLS) {
        jw_key(&q->w, "tool_calls"), jw_open(&q->w, '[');
        st->ncalls = 0;
    }
    st->open = R2C_CALLS;
    if (st->ncalls < XL_MAX_TOOLS) st->calls[st->ncalls++] = id;
    jw_open(&q->w, '{');
    jw_key(&q->w, "id"), xl_copy(q, &id);
    jw_key(&q->w, "type"), jw_lit(&q->w, "function");
    jw_key(&q->w, "function"), jw_open(&q->w, '{');
    int namespaced = jv_get(q->s, q->n, item, "namespace", &v) && v.type == JSON_STRING;
    r2c_name(q, namespaced ? &v : NULL, &name); /* as r2c_tool names it */
    jw_key(&q->w, "arguments");
    if (custom) { /* {"input":"..."} as a string */
        buf a = {0};
        jv_get(q->s, q->n, item, "input", &v);
        buf_puts(&a, "{\"input\":");
        if (v.type == JSON_STRING) buf_append(&a, q->s + v.start - 1, v.end - v.start + 2);
        else buf_puts(&a, "\"\"");
        buf_puts(&a, "}");
        jw_str(&q->w, a.p, a.len);
        buf_free(&a);
    } else if (jv_get(q->s, q->n, item, "arguments", &v) && v.type == JSON_STRING) {
        xl_copy(q, &v);
    } else {
        jw_lit(&q->w, "{}");
    }
    jw_close(&q->w, '}'), jw_close(&q->w, '}');
    return 0;
}

/* A function_call_output or custom_tool_call_output item: a tool message when it answers one of
 * the calls just written (chat wants each result right after its call), else user text -- a
 * result whose call is gone. */
static int r2c_output(xlq *q, r2c_state *st, const json_tok *item, const char *p) {
    json_tok id, out;
    buf text = {0};
    int match = 0;
    if (!jv_get(q->s, q->n, item, "call_id", &id) || id.type != JSON_STRING)
        return xl_refuse(q, p, "%s: an output needs its call_id", p);
    for (int i = 0; i < st->ncalls && !match; i++)
        match = st->calls[i].end - st->calls[i].start == id.end - id.start &&
                memcmp(q->s + st->calls[i].start, q->s + id.start, id.end - id.start) == 0;
    jv_get(q->s, q->n, item, "output", &out);
    if (out.type == JSON_STRING) buf_append(&text, q->s + out.start, out.end - out.start);
    else if (out.type == JSON_ARRAY) r2c_join(q, &out, &text);
    r2c_close(q, st);
    if (!match) st->ncalls = 0;
    jw_open(&q->w, '{');
    if (match) {
        jw_key(&q->w, "role"), jw_lit(&q->w, "tool");
        jw_key(&q->w, "tool_call_id"), xl_copy(q, &id);
        jw_key(&q->w, "content"), xl_escaped(&q->w, &text);
    } else {
        buf u = {0};
        buf_puts(&u, "The result of tool call ");
        buf_append(&u, q->s + id.start, id.end - id.start);
        buf_puts(&u, ":\\n");
        if (text.len) buf_append(&u, text.p, text.len);
        jw_key(&q->w, "role"), jw_lit(&q->w, "user");
        jw_key(&q->w, "content"), xl_escaped(&q->w, &u);
        buf_free(&u);
    }
    jw_close(&q->w, '}');
    buf_free(&text);
    return 0;
}

/* A message item: an assistant's text opens an assistant message its calls may join (one
 * message, as DeepSeek requires); the others are a message each (developer is system). */
static int r2c_message(xlq *q, r2c_state *st, const json_tok *item, const char *p) {
    json_tok role, c;
    char pp[200];
    jv_get(q->s, q->n, item, "role", &role);
    jv_get(q->s, q->n, item, "content", &c);
    int assistant = json_eq(q->s, &role, 0, "assistant");
    if (!assistant && !json_eq(q->s, &role, 0, "user") && !json_eq(q->s, &role, 0, "system") &&
        !json_eq(q->s, &role, 0, "developer"))
        return xl_refuse(q, p, "%s/role: user, assistant, system or developer", p);
    r2c_close(q, st);
    st->ncalls = 0;
    xl_ptr(pp, sizeof pp, p, "content", -1, NULL);
    jw_open(&q->w, '{');
    jw_key(&q->w, "role");
    if (assistant) {
        buf text = {0};
        jw_lit(&q->w, "assistant");
        if (c.type == JSON_ARRAY) r2c_join(q, &c, &text);
        else if (c.type == JSON_STRING) buf_append(&text, q->s + c.start, c.end - c.start);
        jw_key(&q->w, "content");
        if (text.len) xl_escaped(&q->w, &text);
        else jw_null(&q->w); /* as chat writes an assistant's turn of calls alone */
        buf_free(&text);
        st->open = R2C_TEXT; /* left open: calls may follow */
        return 0;
    }
    if (json_eq(q->s, &role, 0, "user")) jw_lit(&q->w, "user");
    else jw_lit(&q->w, "system");
    jw_key(&q->w, "content");
    if (r2c_content(q, &c, pp) < 0) return LTG_ERR;
    jw_close(&q->w, '}');
    return 0;
}

/* "instructions", then the input items in order, as chat's messages. */
static int r2c_input(xlq *q) {
    json_tok in, k, item, t;
    size_t pos = 0;
    r2c_state st = {0};
    char p[64];
    jw_key(&q->w, "messages"), jw_open(&q->w, '[');
    if (xl_get(q, R2C_instructions, &t) && t.type == JSON_STRING && !xl_blank(q->s, &t)) {
        jw_open(&q->w, '{');
        jw_key(&q->w, "role"), jw_lit(&q->w, "system");
        jw_key(&q->w, "content"), xl_copy(q, &t);
        jw_close(&q->w, '}');
    }
    if (!xl_get(q, R2C_input, &in) || (in.type != JSON_STRING && in.type != JSON_ARRAY))
        return xl_refuse(q, "/input", "/input: a string or an array of items is needed");
    if (in.type == JSON_STRING) {
        jw_open(&q->w, '{');
        jw_key(&q->w, "role"), jw_lit(&q->w, "user");
        jw_key(&q->w, "content"), xl_copy(q, &in);
        jw_close(&q->w, '}');
    }
    for (int i = 0; in.type == JSON_ARRAY && jv_next(q->s, q->n, &in, &pos, &k, &item); i++) {
        int r = 0;
        xl_ptr(p, sizeof p, "/input", NULL, i, NULL);
        if (!jv_get(q->s, q->n, &item, "type", &t) || json_eq(q->s, &t, 0, "message")) {
            r = r2c_message(q, &st, &item, p);
        } else if (json_eq(q->s, &t, 0, "function_call") ||
                   json_eq(q->s, &t, 0, "custom_tool_call")) {
            r = r2c_call(q, &st, &item, json_eq(q->s, &t, 0, "custom_tool_call"), p);
        } else if (json_eq(q->s, &t, 0, "function_call_output") ||
                   json_eq(q->s, &t, 0, "custom_tool_call_output")) {
            r = r2c_output(q, &st, &item, p);
        } else if (json_eq(q->s, &t, 0, "reasoning")) {
            xl_drop(q, p, "reasoning"); /* another model's reasoning, which it cannot read */
        } else {
            return xl_refuse(q, p, "%s: a %.*s item has no OpenAI chat equivalent", p,
                             (int)(t.end - t.start), q->s + t.start);
        }
        if (r < 0) return LTG_ERR;
    }
    r2c_close(q, &st);
    jw_close(&q->w, ']');
    return 0;
}

/* A custom tool (Codex's apply_patch: free-form input, perhaps a grammar) as a chat function of
 * one string parameter, "input", the grammar in its description. */
static void r2c_custom_tool(xlq *q, const json_tok *tl) {
    json_tok v, f, syn, def;
    buf d = {0};
    if (jv_get(q->s, q->n, tl, "description", &v) && v.type == JSON_STRING)
        buf_append(&d, q->s + v.start, v.end - v.start);
    if (jv_get(q->s, q->n, tl, "format", &f) && jv_get(q->s, q->n, &f, "definition", &def) &&
        def.type == JSON_STRING) {
        jv_get(q->s, q->n, &f, "syntax", &syn);
        buf_puts(&d, "\\n\\nThe input follows this ");
        if (syn.type == JSON_STRING) buf_append(&d, q->s + syn.start, syn.end - syn.start);
        buf_puts(&d, " grammar:\\n");
        buf_append(&d, q->s + def.start, def.end - def.start);
    }
    jw_key(&q->w, "description"), xl_escaped(&q->w, &d);
    jw_key(&q->w, "parameters");
    static const char params[] = "{\"type\":\"object\",\"properties\":{\"input\":{\"type\":"
                                 "\"string\",\"description\":\"the whole input of the tool, as "
                                 "free-form text\"}},\"required\":[\"input\"],"
                                 "\"additionalProperties\":false}";
    jw_raw(&q->w, params, sizeof params - 1);
    buf_free(&d);
}

/* A function or custom tool as a chat function; one of namespace ns (NULL: none) is named
 * NS__name (the answer's calls are named back: xl_tool_of). */
static int r2c_tool(xlq *q, const json_tok *tl, const json_tok *ns, const char *p) {
    json_tok t, v;
    jv_get(q->s, q->n, tl, "type", &t);
    int custom = json_eq(q->s, &t, 0, "custom");
    if (!custom && !json_eq(q->s, &t, 0, "function"))
        return xl_refuse(q, p, "%s: the built-in tool \"%.*s\" runs at OpenAI; OpenAI chat has "
                         "no equivalent", p, (int)(t.end - t.start), q->s + t.start);
    if (!jv_get(q->s, q->n, tl, "name", &v) || v.type != JSON_STRING)
        return xl_refuse(q, p, "%s: a tool needs a name", p);
    jw_open(&q->w, '{');
    jw_key(&q->w, "type"), jw_lit(&q->w, "function");
    jw_key(&q->w, "function"), jw_open(&q->w, '{');
    r2c_name(q, ns, &v);
    if (custom) {
        r2c_custom_tool(q, tl);
    } else {
        if (jv_get(q->s, q->n, tl, "description", &v)) jw_key(&q->w, "description"), xl_copy(q, &v);
        jw_key(&q->w, "parameters");
        if (jv_get(q->s, q->n, tl, "parameters", &v) && v.type == JSON_OBJECT) xl_copy(q, &v);
        else jw_raw(&q->w, "{\"type\":\"object\",\"properties\":{}}", 33);
        if (jv_get(q->s, q->n, tl, "strict", &v) && v.type != JSON_NULL)
            jw_key(&q->w, "strict"), xl_copy(q, &v);
    }
    jw_close(&q->w, '}'), jw_close(&q->w, '}');
    return 0;
}

/* "tools" (flat in Responses, nested in chat; a namespace's tools each a function of their
 * own), "tool_choice", "parallel_tool_calls". web_search and tool_search, which Codex declares
 * by default, run at OpenAI and a chat model cannot call them: dropped, named. The other
 * built-in tools are refused. */
static int r2c_tools(xlq *q) {
    json_tok tools, k, tl, t, v, inner, ns;
    size_t pos = 0, ipos;
    char p[64], pp[80];
    if (!xl_get(q, R2C_tools, &tools) || tools.type != JSON_ARRAY || tools.end - tools.start <= 2)
        return 0;
    size_t at = q->w.out->len; /* a list left empty is taken back: chat servers refuse [] */
    uint64_t commas = q->w.need_comma;
    jw_key(&q->w, "tools"), jw_open(&q->w, '[');
    size_t first = q->w.out->len;
    for (int i = 0; jv_next(q->s, q->n, &tools, &pos, &k, &tl); i++) {
        xl_ptr(p, sizeof p, "/tools", NULL, i, "type");
        jv_get(q->s, q->n, &tl, "type", &t);
        if (json_eq(q->s, &t, 0, "web_search") || json_eq(q->s, &t, 0, "web_search_preview") ||
            json_eq(q->s, &t, 0, "tool_search")) {
            xl_drop(q, xl_ptr(pp, sizeof pp, "/tools", NULL, i, NULL),
                    json_eq(q->s, &t, 0, "tool_search") ? "tool_search" : "web_search");
        } else if (json_eq(q->s, &t, 0, "namespace")) {
            if (!jv_get(q->s, q->n, &tl, "name", &ns) || ns.type != JSON_STRING ||
                !jv_get(q->s, q->n, &tl, "tools", &inner) || inner.type != JSON_ARRAY)
                return xl_refuse(q, p, "%s: a namespace needs its name and tools", p);
            ipos = 0;
            for (int j = 0; jv_next(q->s, q->n, &inner, &ipos, &k, &v); j++) {
                xl_ptr(pp, sizeof pp, "/tools", NULL, i, NULL);
                xl_ptr(pp, sizeof pp, pp, "tools", j, "type");
                if (r2c_tool(q, &v, &ns, pp) < 0) return LTG_ERR;
            }
        } else if (r2c_tool(q, &tl, NULL, p) < 0) {
            return LTG_ERR;
        }
    }
    jw_close(&q->w, ']');
    if (q->w.out->len == first + 1) { /* none left: no tools, no choice among them */
        q->w.out->len = at, q->w.out->p[at] = 0, q->w.need_comma = commas;
        return 0;
    }
    if (xl_get(q, R2C_tool_choice, &v) && v.type == JSON_STRING) {
        jw_key(&q->w, "tool_choice"), xl_copy(q, &v);
    } else if (v.type == JSON_OBJECT) {
        jv_get(q->s, q->n, &v, "type", &t);
        if (!(json_eq(q->s, &t, 0, "function") || json_eq(q->s, &t, 0, "custom")) ||
            !jv_get(q->s, q->n, &v, "name", &k))
            return xl_refuse(q, "/tool_choice", "/tool_choice: OpenAI chat takes auto, none, "
                             "required or one function by name");
        jw_key(&q->w, "tool_choice"), jw_open(&q->w, '{');
        jw_key(&q->w, "type"), jw_lit(&q->w, "function");
        jw_key(&q->w, "function"), jw_open(&q->w, '{');
        jw_key(&q->w, "name"), xl_copy(q, &k);
        jw_close(&q->w, '}'), jw_close(&q->w, '}');
    }
    if (xl_get(q, R2C_parallel_tool_calls, &v) && (v.type == JSON_TRUE || v.type == JSON_FALSE))
        jw_key(&q->w, "parallel_tool_calls"), xl_copy(q, &v);
    return 0;
}

/* The output limit, sampling, the user, structured output (text.format), the reasoning effort,
 * streaming (with its usage). */
static int r2c_options(xlq *q) {
    json_tok v, f, t;
    static const int same[] = {R2C_temperature, R2C_top_p, R2C_user};
    if (xl_get(q, R2C_max_output_tokens, &v) && v.type == JSON_NUMBER)
        jw_key(&q->w, "max_tokens"), xl_copy(q, &v);
    for (int i = 0; i < 3; i++)
        if (xl_get(q, same[i], &v) && v.type != JSON_NULL)
            jw_name(&q->w, R2C_FIELDS[same[i]].name), xl_copy(q, &v);
    if (xl_get(q, R2C_text, &v)) {
        if (jv_get(q->s, q->n, &v, "verbosity", &t)) xl_drop(q, "/text/verbosity", "verbosity");
        jv_get(q->s, q->n, &v, "format", &f);
        jv_get(q->s, q->n, &f, "type", &t);
        if (json_eq(q->s, &t, 0, "json_object")) {
            jw_key(&q->w, "response_format"), jw_raw(&q->w, "{\"type\":\"json_object\"}", 22);
        } else if (json_eq(q->s, &t, 0, "json_schema")) {
            static const char *const keep[] = {"name", "schema", "strict", "description"};
            jw_key(&q->w, "response_format"), jw_open(&q->w, '{');
            jw_key(&q->w, "type"), jw_lit(&q->w, "json_schema");
            jw_key(&q->w, "json_schema"), jw_open(&q->w, '{');
            for (int i = 0; i < 4; i++)
                if (jv_get(q->s, q->n, &f, keep[i], &t)) jw_name(&q->w, keep[i]), xl_copy(q, &t);
            jw_close(&q->w, '}'), jw_close(&q->w, '}');
        }
    }
    if (xl_get(q, R2C_reasoning, &v)) {
        if (jv_get(q->s, q->n, &v, "summary", &t) && t.type != JSON_NULL)
            xl_drop(q, "/reasoning/summary", "summary");
        if (jv_get(q->s, q->n, &v, "effort", &t) && t.type == JSON_STRING) {
            if (q->to->reasoning) jw_key(&q->w, "reasoning_effort"), xl_copy(q, &t);
            else xl_drop(q, "/reasoning/effort", "effort");
        }
    }
    if (xl_get(q, R2C_stream, &v) && v.type == JSON_TRUE) xl_chat_stream(q);
    return 0;
}

static int r2c_request(xlq *q, const json_tok *root) {
    if (xl_fields(q, root, R2C_FIELDS, "OpenAI chat") < 0) return LTG_ERR;
    jw_open(&q->w, '{');
    jw_key(&q->w, "model"), jw_cstr(&q->w, q->to->upstream);
    if (r2c_input(q) < 0 || r2c_tools(q) < 0 || r2c_options(q) < 0) return LTG_ERR;
    jw_close(&q->w, '}');
    return 0;
}

static int xl_request(xl_api from, xl_api to, const char *s, size_t n, const json_tok *top,
                      const xl_target *t, buf *out, xl_verdict *v);

/* A Responses body for Anthropic: to chat, then chat to Messages. A refusal of the second step
 * names the field in chat's form of the request, which it says. */
static int xl_request_via_chat(const char *s, size_t n, const json_tok *top, const xl_target *t,
                               buf *out, xl_verdict *v) {
    buf mid = {0};
    xl_verdict *v2 = xmalloc(sizeof *v2);
    int r = xl_request(XL_RESPONSES, XL_CHAT, s, n, top, t, &mid, v);
    if (r == 0) r = xl_request(XL_CHAT, XL_MESSAGES, mid.p, mid.len, NULL, t, out, v2);
    if (r == 0) {
        v->include_usage = v2->include_usage;
        for (int i = 0; i < v2->ndropped && v->ndropped < XL_MAX_DROPPED; i++) { /* as xl_drop */
            const char *name = v2->names[i];
            size_t len = strlen(v->dropped);
            snprintf(v->names[v->ndropped++], sizeof v->names[0], "%s", name);
            /* the field in the client's body: the effort is Responses' own; any other (an
             * image's detail) by its name */
            snprintf(v->dropped + len, sizeof v->dropped - len, "%s%s%s", len ? "," : "",
                     strcmp(name, "reasoning_effort") == 0 ? "/reasoning/effort" : "/",
                     strcmp(name, "reasoning_effort") == 0 ? "" : name);
        }
    } else if (v2->param[0] && !v->param[0]) {
        snprintf(v->param, sizeof v->param, "%s", v2->param);
        snprintf(v->msg, sizeof v->msg, "%.300s (in the request's chat form)", v2->msg);
    }
    free(v2);
    buf_free(&mid);
    return r;
}

/* The client's body s[0..n) (of API `from`, validated whole by admission; top: its top level
 * as admission's json_parse stored it, or NULL) for a provider of API `to`, into `out`
 * (emptied first). 0, or LTG_ERR with v->param and v->msg: a field that cannot be carried. */
static int xl_request(xl_api from, xl_api to, const char *s, size_t n, const json_tok *top,
                      const xl_target *t, buf *out, xl_verdict *v) {
    xlq q = {.s = s, .n = n, .v = v, .to = t, .top = top};
    if (from == XL_RESPONSES && to == XL_MESSAGES) /* through chat: Codex on Claude */
        return xl_request_via_chat(s, n, top, t, out, v);
    *v = (xl_verdict){0};
    out->len = 0;
    buf_reserve(out, n + 256); /* about the body's size: room made once, not doubled into */
    jw_init(&q.w, out);
    json_tok root = jv_doc(s, n);
    assert(xl_translates(from, to) && root.type == JSON_OBJECT);
    return from == XL_MESSAGES ? m2c_request(&q, &root)
           : from == XL_CHAT   ? c2m_request(&q, &root)
                               : r2c_request(&q, &root);
}

/* ---- answers ---- */

/* How an answer stopped, in neutral terms, and each API's word for it. */
typedef enum { XF_NONE, XF_STOP, XF_LENGTH, XF_TOOL, XF_FILTER } xl_finish;
static const char *const XF_CHAT[] = {"stop", "stop", "length", "tool_calls", "content_filter"};
static const char *const XF_ANTHROPIC[] = {"end_turn", "end_turn", "max_tokens", "tool_use",
                                           "refusal"};

static xl_finish xl_finish_of(const char *s, const json_tok *v) {
    static const struct { const char *word; xl_finish f; } words[] = {
        {"stop", XF_STOP},         {"end_turn", XF_STOP},     {"stop_sequence", XF_STOP},
        {"pause_turn", XF_STOP},   {"length", XF_LENGTH},     {"max_tokens", XF_LENGTH},
        {"model_context_window_exceeded", XF_LENGTH},         {"tool_calls", XF_TOOL},
        {"function_call", XF_TOOL}, {"tool_use", XF_TOOL},    {"content_filter", XF_FILTER},
        {"refusal", XF_FILTER},
    };
    for (size_t i = 0; v->type == JSON_STRING && i < sizeof words / sizeof *words; i++)
        if (json_eq(s, v, 0, words[i].word)) return words[i].f;
    return v->type == JSON_STRING ? XF_STOP : XF_NONE;
}

/* Usage in the client's terms, from the provider's classes u (TOK_IN includes the cache). */
static void xl_usage_json(jwriter *w, xl_api client, const long long u[NTOK]) {
    jw_open(w, '{');
    if (client == XL_MESSAGES) {
        jw_key(w, "input_tokens"), jw_int(w, u[TOK_IN] - u[TOK_CACHE_READ] - u[TOK_CACHE_WRITE]);
        jw_key(w, "cache_creation_input_tokens"), jw_int(w, u[TOK_CACHE_WRITE]);
        jw_key(w, "cache_read_input_tokens"), jw_int(w, u[TOK_CACHE_READ]);
        jw_key(w, "output_tokens"), jw_int(w, u[TOK_OUT]);
    } else if (client == XL_RESPONSES) {
        jw_key(w, "input_tokens"), jw_int(w, u[TOK_IN]);
        jw_key(w, "input_tokens_details"), jw_open(w, '{');
        jw_key(w, "cached_tokens"), jw_int(w, u[TOK_CACHE_READ]);
        jw_close(w, '}');
        jw_key(w, "output_tokens"), jw_int(w, u[TOK_OUT]);
        jw_key(w, "output_tokens_details"), jw_open(w, '{');
        jw_key(w, "reasoning_tokens"), jw_int(w, u[TOK_REASONING]);
        jw_close(w, '}');
        jw_key(w, "total_tokens"), jw_int(w, u[TOK_IN] + u[TOK_OUT]);
    } else {
        jw_key(w, "prompt_tokens"), jw_int(w, u[TOK_IN]);
        jw_key(w, "completion_tokens"), jw_int(w, u[TOK_OUT]);
        jw_key(w, "total_tokens"), jw_int(w, u[TOK_IN] + u[TOK_OUT]);
        jw_key(w, "prompt_tokens_details"), jw_open(w, '{');
        jw_key(w, "cached_tokens"), jw_int(w, u[TOK_CACHE_READ]);
        jw_close(w, '}');
        jw_key(w, "completion_tokens_details"), jw_open(w, '{');
        jw_key(w, "reasoning_tokens"), jw_int(w, u[TOK_REASONING]);
        jw_close(w, '}');
        if (u[TOK_CACHE_WRITE]) /* chat has no field of its own for them */
            jw_key(w, "cache_creation_input_tokens"), jw_int(w, u[TOK_CACHE_WRITE]);
    }
    jw_close(w, '}');
}

/* The client's name for the tool a chat model called `name` (escaped): the Anthropic tool of
 * the request (req) whose chat name it is, else itself. */
static void xl_client_name(const char *req, size_t rn, const char *name, size_t n, buf *out) {
    json_tok root = jv_doc(req, rn), tools, k, tl, t;
    size_t pos = 0;
    char cn[65];
    if (n == 64 && jv_get(req, rn, &root, "tools", &tools) && tools.type == JSON_ARRAY)
        while (jv_next(req, rn, &tools, &pos, &k, &tl))
            if (jv_get(req, rn, &tl, "name", &t)) {
                xl_chat_name(req + t.start, t.end - t.start, cn);
                if (memcmp(cn, name, 64) == 0) {
                    buf_append(out, req + t.start, t.end - t.start);
                    return;
                }
            }
    buf_append(out, name, n);
}

/* An answer's "id" (the provider's, after `prefix`) and "model", as the provider named them
 * (their tokens in s, null when absent). */
static void xl_answer_names(jwriter *w, const char *s, const json_tok *id, const json_tok *mdl,
                            const char *prefix) {
    jw_key(w, "id"), jw_sep(w);
    buf_cat(w->out, "\"", prefix, NULL);
    if (id->type == JSON_STRING) buf_append(w->out, s + id->start, id->end - id->start);
    buf_append(w->out, "\"", 1);
    jw_key(w, "model");
    if (mdl->type == JSON_STRING) jw_raw(w, s + mdl->start - 1, mdl->end - mdl->start + 2);
    else jw_lit(w, "");
}

/* A chat tool call as a tool_use block: its arguments must hold a JSON object ("" is {}),
 * its id one Anthropic takes, its name the client's. */
static int xl_tool_use(jwriter *w, const char *s, size_t n, const json_tok *call, const char *req,
                       size_t rn) {
    buf a = {0}, nm = {0}, idv = {0};
    json_tok f = {0}, t, tt[1];
    json_result res;
    char aid[74];
    jv_get(s, n, call, "function", &f);
    if (jv_get(s, n, &f, "arguments", &t) && t.type == JSON_STRING) json_unescape(s, &t, 0, &a);
    int bad = a.len && (json_parse(a.p, a.len, tt, 1, 0, &res) < 0 || tt[0].type != JSON_OBJECT);
    if (jv_get(s, n, call, "id", &t) && t.type == JSON_STRING) json_unescape(s, &t, 0, &idv);
    xl_anthropic_id(idv.p ? idv.p : "call", idv.p ? idv.len : 4, aid);
    if (jv_get(s, n, &f, "name", &t)) xl_client_name(req, rn, s + t.start, t.end - t.start, &nm);
    if (!bad) {
        jw_open(w, '{');
        jw_key(w, "type"), jw_lit(w, "tool_use");
        jw_key(w, "id"), jw_cstr(w, aid);
        jw_key(w, "name"), xl_escaped(w, &nm);
        jw_key(w, "input"), jw_raw(w, a.len ? a.p : "{}", a.len ? a.len : 2);
        jw_close(w, '}');
    }
    buf_free(&a), buf_free(&nm), buf_free(&idv);
    return bad ? LTG_ERR : 0;
}

/* A chat completion as an Anthropic message. LTG_ERR with *why when a tool call's arguments
 * are not a JSON object (Anthropic's input must be one). */
/* A chat completion's parts, one walk of each object (what is not there is null): r its id,
 * model and choices; c the first choice's message and finish_reason; m that message's content,
 * tool_calls and reasoning_content. */
static void xl_chat_parts(const char *s, size_t n, json_tok r[3], json_tok c[2], json_tok m[3]) {
    static const char *const names[] = {"id", "model", "choices", NULL},
                             *const choice[] = {"message", "finish_reason", NULL},
                             *const message[] = {"content", "tool_calls", "reasoning_content",
                                                 NULL};
    json_tok root = jv_doc(s, n), c0;
    size_t pos = 0;
    unsigned got;
    jv_members(s, n, &root, names, r);
    for (int i = 0; i < 2; i++) c[i] = (json_tok){JSON_NULL, 0, 0, 0, 0};
    if (r[2].type == JSON_ARRAY) jv_next_members(s, n, &r[2], &pos, choice, c, &got, &c0);
    jv_members(s, n, &c[0], message, m);
}

static int xl_chat_to_message(const char *s, size_t n, const char *req, size_t rn,
                              const long long u[NTOK], buf *out, const char **why) {
    json_tok r[3], c[2], m[3], k, call, *v = &m[0], *calls = &m[1];
    size_t pos = 0;
    jwriter w;
    xl_chat_parts(s, n, r, c, m);
    jw_init(&w, out);
    jw_open(&w, '{');
    xl_answer_names(&w, s, &r[0], &r[1], "msg_");
    jw_key(&w, "type"), jw_lit(&w, "message");
    jw_key(&w, "role"), jw_lit(&w, "assistant");
    jw_key(&w, "content"), jw_open(&w, '[');
    int tools = 0;
    if (v->type == JSON_STRING && !xl_blank(s, v)) {
        jw_open(&w, '{');
        jw_key(&w, "type"), jw_lit(&w, "text");
        jw_key(&w, "text"), jw_raw(&w, s + v->start - 1, v->end - v->start + 2);
        jw_close(&w, '}');
    }
    pos = 0;
    if (calls->type == JSON_ARRAY)
        for (; jv_next(s, n, calls, &pos, &k, &call); tools++)
            if (xl_tool_use(&w, s, n, &call, req, rn) < 0) {
                *why = "answered a tool call whose arguments are not a JSON object";
                return LTG_ERR;
            }
    jw_close(&w, ']');
    xl_finish fin = c[1].type != JSON_NULL ? xl_finish_of(s, &c[1]) : XF_STOP;
    if (tools) fin = XF_TOOL; /* a tool call ends with the tool stop reason, whatever was said */
    else if (fin == XF_TOOL) fin = XF_STOP;
    jw_key(&w, "stop_reason"), jw_cstr(&w, XF_ANTHROPIC[fin]);
    jw_key(&w, "stop_sequence"), jw_null(&w);
    jw_key(&w, "usage"), xl_usage_json(&w, XL_MESSAGES, u);
    jw_close(&w, '}');
    return 0;
}

/* Member `name` of object o, a string, as it is written ("" when it is none). */
static void xl_member_string(jwriter *w, const char *s, size_t n, const json_tok *o,
                             const char *name) {
    json_tok t;
    if (jv_get(s, n, o, name, &t) && t.type == JSON_STRING)
        jw_raw(w, s + t.start - 1, t.end - t.start + 2);
    else
        jw_lit(w, "");
}

/* An Anthropic answer's tool_use blocks as chat's "tool_calls": each input's bytes, the
 * arguments string. */
static void xl_tool_calls(jwriter *w, const char *s, size_t n, const json_tok *content) {
    size_t pos = 0;
    json_tok k, b, t;
    jw_key(w, "tool_calls"), jw_open(w, '[');
    while (jv_next(s, n, content, &pos, &k, &b)) {
        if (!jv_get(s, n, &b, "type", &t) || !json_eq(s, &t, 0, "tool_use")) continue;
        jw_open(w, '{');
        jw_key(w, "id"), xl_member_string(w, s, n, &b, "id");
        jw_key(w, "type"), jw_lit(w, "function");
        jw_key(w, "function"), jw_open(w, '{');
        jw_key(w, "name"), xl_member_string(w, s, n, &b, "name");
        jw_key(w, "arguments");
        if (jv_get(s, n, &b, "input", &t)) jw_str(w, s + t.start, t.end - t.start);
        else jw_lit(w, "{}");
        jw_close(w, '}'), jw_close(w, '}');
    }
    jw_close(w, ']');
}

/* An Anthropic message as a chat completion. */
static void xl_message_to_chat(const char *s, size_t n, const long long u[NTOK], buf *out) {
    static const char *const names[] = {"id", "model", "content", "stop_reason", NULL};
    json_tok root = jv_doc(s, n), r[4], content, k, b, t, one = {0};
    size_t pos = 0;
    buf text = {0}, think = {0}; /* the text of several blocks, joined */
    int tools = 0;
    jwriter w;
    jv_members(s, n, &root, names, r); /* one walk */
    content = r[2];
    jw_init(&w, out);
    jw_open(&w, '{');
    xl_answer_names(&w, s, &r[0], &r[1], "chatcmpl-");
    jw_key(&w, "object"), jw_lit(&w, "chat.completion");
    jw_key(&w, "created"), jw_int(&w, wall_ms() / 1000);
    jw_key(&w, "choices"), jw_open(&w, '['), jw_open(&w, '{');
    jw_key(&w, "index"), jw_int(&w, 0);
    jw_key(&w, "message"), jw_open(&w, '{');
    jw_key(&w, "role"), jw_lit(&w, "assistant");
    int has = content.type == JSON_ARRAY, texts = 0;
    while (has && jv_next(s, n, &content, &pos, &k, &b)) {
        jv_get(s, n, &b, "type", &t);
        int is_text = json_eq(s, &t, 0, "text");
        buf *into = is_text ? &text : json_eq(s, &t, 0, "thinking") ? &think : NULL;
        tools += json_eq(s, &t, 0, "tool_use");
        if (!into || !jv_get(s, n, &b, is_text ? "text" : "thinking", &t) ||
            t.type != JSON_STRING)
            continue;
        if (is_text && texts++ == 0) { /* one text block, the usual answer: written as it is */
            one = t;
            continue;
        }
        if (is_text && texts == 2) buf_append(&text, s + one.start, one.end - one.start);
        buf_append(into, s + t.start, t.end - t.start);
    }
    jw_key(&w, "content");
    if (texts == 1) jw_raw(&w, s + one.start - 1, one.end - one.start + 2);
    else if (text.len || !tools) xl_escaped(&w, &text);
    else jw_null(&w);
    if (think.len) jw_key(&w, "reasoning_content"), xl_escaped(&w, &think);
    if (tools) xl_tool_calls(&w, s, n, &content);
    jw_close(&w, '}');
    xl_finish fin = r[3].type != JSON_NULL ? xl_finish_of(s, &r[3]) : XF_STOP;
    if (tools) fin = XF_TOOL;
    else if (fin == XF_TOOL) fin = XF_STOP;
    jw_key(&w, "finish_reason"), jw_cstr(&w, XF_CHAT[fin]);
    jw_key(&w, "logprobs"), jw_null(&w);
    jw_close(&w, '}'), jw_close(&w, ']');
    jw_key(&w, "usage"), xl_usage_json(&w, XL_CHAT, u);
    jw_close(&w, '}');
    buf_free(&text);
    buf_free(&think);
}

/* The tool of the Responses request req whose chat name is `name` (escaped): a top-level one
 * of that name, or a tool of namespace NS, chat's NS__name (r2c_tools). 0 when none; else
 * *custom (it takes free-form input) and *nsn, the length of the namespace in name (0: none;
 * the name within it starts at name + nsn + 2). */
static int xl_tool_of(const char *req, size_t rn, const char *name, size_t n, int *custom,
                      size_t *nsn) {
    json_tok root = jv_doc(req, rn), tools, k, tl, t, in, it;
    size_t pos = 0, ipos;
    *custom = 0, *nsn = 0;
    if (!jv_get(req, rn, &root, "tools", &tools) || tools.type != JSON_ARRAY) return 0;
    while (jv_next(req, rn, &tools, &pos, &k, &tl)) {
        if (!jv_get(req, rn, &tl, "name", &t)) continue;
        size_t l = t.end - t.start;
        jv_get(req, rn, &tl, "type", &it);
        if (l == n && memcmp(req + t.start, name, n) == 0) {
            *custom = json_eq(req, &it, 0, "custom");
            return 1;
        }
        if (!json_eq(req, &it, 0, "namespace") || n <= l + 2 || memcmp(req + t.start, name, l) ||
            memcmp(name + l, "__", 2) || !jv_get(req, rn, &tl, "tools", &in))
            continue;
        ipos = 0;
        while (in.type == JSON_ARRAY && jv_next(req, rn, &in, &ipos, &k, &tl))
            if (jv_get(req, rn, &tl, "name", &t) && t.end - t.start == n - l - 2 &&
                memcmp(req + t.start, name + l + 2, n - l - 2) == 0) {
                jv_get(req, rn, &tl, "type", &it);
                *custom = json_eq(req, &it, 0, "custom"), *nsn = l;
                return 1;
            }
    }
    return 0;
}

/* A call's "name" (and "namespace") in Responses' terms, from its chat name (escaped) and the
 * length of the namespace in it (xl_tool_of). */
static void xl_call_name(jwriter *w, const char *name, size_t n, size_t nsn) {
    jw_key(w, "name"), xl_slice(w, name + (nsn ? nsn + 2 : 0), n - (nsn ? nsn + 2 : 0));
    if (nsn) jw_key(w, "namespace"), xl_slice(w, name, nsn);
}

/* A custom tool's input, a JSON string, from a chat call's arguments (escaped, as the answer
 * or the stream had them): their "input", else the arguments whole. */
static void xl_custom_input(jwriter *w, const char *esc, size_t n) {
    buf a = {0};
    json_tok t[64], e = {JSON_STRING, 0, (uint32_t)n, 0, 0};
    json_result res;
    int in = -1;
    if (n) json_unescape(esc, &e, 0, &a);
    if (a.len && json_parse(a.p, a.len, t, 64, 1, &res) == 0) in = json_get(a.p, t, 0, "input");
    if (in >= 0 && t[in].type == JSON_STRING)
        jw_raw(w, a.p + t[in].start - 1, t[in].end - t[in].start + 2);
    else
        jw_str(w, a.p ? a.p : "", a.len);
    buf_free(&a);
}

/* A chat tool call as a Responses output item: function_call, or custom_tool_call for a custom
 * tool of the request, its input the "input" of the arguments (else the arguments whole). */
static void xl_call_item(jwriter *w, const char *s, size_t n, const json_tok *call, int i,
                         const char *rid, const char *req, size_t rn) {
    json_tok f, id, name, args;
    char iid[64];
    jv_get(s, n, call, "function", &f);
    jv_get(s, n, call, "id", &id);
    jv_get(s, n, &f, "name", &name);
    jv_get(s, n, &f, "arguments", &args);
    int custom;
    size_t nsn, nl = name.type == JSON_STRING ? name.end - name.start : 0;
    xl_tool_of(req, rn, s + name.start, nl, &custom, &nsn);
    jw_open(w, '{');
    jw_key(w, "type");
    if (custom) jw_lit(w, "custom_tool_call");
    else jw_lit(w, "function_call");
    snprintf(iid, sizeof iid, "%s_%s_%d", custom ? "ctc" : "fc", rid, i);
    jw_key(w, "id"), jw_cstr(w, iid);
    jw_key(w, "call_id");
    if (id.type == JSON_STRING) jw_raw(w, s + id.start - 1, id.end - id.start + 2);
    else jw_cstr(w, iid);
    xl_call_name(w, s + name.start, nl, nsn);
    if (custom) {
        jw_key(w, "input");
        if (args.type == JSON_STRING) xl_custom_input(w, s + args.start, args.end - args.start);
        else jw_lit(w, "");
    } else {
        jw_key(w, "arguments");
        if (args.type == JSON_STRING) jw_raw(w, s + args.start - 1, args.end - args.start + 2);
        else jw_lit(w, "{}");
    }
    jw_key(w, "status"), jw_lit(w, "completed");
    jw_close(w, '}');
}

/* A Responses answer's "status" and "incomplete_details" for an answer that stopped so (XF_NONE:
 * still in progress). */
static void xl_resp_status(jwriter *w, xl_finish fin) {
    int incomplete = fin == XF_LENGTH || fin == XF_FILTER;
    jw_key(w, "status");
    if (fin == XF_NONE) jw_lit(w, "in_progress");
    else if (incomplete) jw_lit(w, "incomplete");
    else jw_lit(w, "completed");
    jw_key(w, "incomplete_details");
    if (!incomplete) {
        jw_null(w);
        return;
    }
    jw_open(w, '{');
    jw_key(w, "reason");
    if (fin == XF_LENGTH) jw_lit(w, "max_output_tokens");
    else jw_lit(w, "content_filter");
    jw_close(w, '}');
}

/* A chat completion as a Responses object: the id minted from the request's (rid), an optional
 * reasoning item, the message item with its text, an item per tool call; a length or content
 * filter stop makes it incomplete. */
static void xl_chat_to_response(const char *s, size_t n, const char *req, size_t rn,
                                const char *rid, const long long u[NTOK], buf *out) {
    json_tok r[3], c[2], m[3], k, call;
    size_t pos = 0;
    char id[64];
    jwriter w;
    xl_chat_parts(s, n, r, c, m);
    jw_init(&w, out);
    jw_open(&w, '{');
    snprintf(id, sizeof id, "resp_%s", rid);
    jw_key(&w, "id"), jw_cstr(&w, id);
    jw_key(&w, "object"), jw_lit(&w, "response");
    jw_key(&w, "created_at"), jw_int(&w, wall_ms() / 1000);
    xl_resp_status(&w, c[1].type != JSON_NULL ? xl_finish_of(s, &c[1]) : XF_STOP);
    jw_key(&w, "model");
    if (r[1].type == JSON_STRING) jw_raw(&w, s + r[1].start - 1, r[1].end - r[1].start + 2);
    else jw_lit(&w, "");
    jw_key(&w, "output"), jw_open(&w, '[');
    if (m[2].type == JSON_STRING && !xl_blank(s, &m[2])) {
        jw_open(&w, '{');
        jw_key(&w, "type"), jw_lit(&w, "reasoning");
        snprintf(id, sizeof id, "rs_%s", rid);
        jw_key(&w, "id"), jw_cstr(&w, id);
        jw_key(&w, "summary"), jw_open(&w, '['), jw_open(&w, '{');
        jw_key(&w, "type"), jw_lit(&w, "summary_text");
        jw_key(&w, "text"), jw_raw(&w, s + m[2].start - 1, m[2].end - m[2].start + 2);
        jw_close(&w, '}'), jw_close(&w, ']');
        jw_close(&w, '}');
    }
    if (m[0].type == JSON_STRING && m[0].end > m[0].start) {
        jw_open(&w, '{');
        jw_key(&w, "type"), jw_lit(&w, "message");
        snprintf(id, sizeof id, "msg_%s", rid);
        jw_key(&w, "id"), jw_cstr(&w, id);
        jw_key(&w, "status"), jw_lit(&w, "completed");
        jw_key(&w, "role"), jw_lit(&w, "assistant");
        jw_key(&w, "content"), jw_open(&w, '['), jw_open(&w, '{');
        jw_key(&w, "type"), jw_lit(&w, "output_text");
        jw_key(&w, "text"), jw_raw(&w, s + m[0].start - 1, m[0].end - m[0].start + 2);
        jw_key(&w, "annotations"), jw_raw(&w, "[]", 2);
        jw_close(&w, '}'), jw_close(&w, ']');
        jw_close(&w, '}');
    }
    pos = 0;
    for (int i = 0; m[1].type == JSON_ARRAY && jv_next(s, n, &m[1], &pos, &k, &call); i++)
        xl_call_item(&w, s, n, &call, i, rid, req, rn);
    jw_close(&w, ']');
    jw_key(&w, "store"), jw_bool(&w, 0);
    jw_key(&w, "usage"), xl_usage_json(&w, XL_RESPONSES, u);
    jw_close(&w, '}');
}

/* A provider's whole answer s[0..n) (validated by usage_read) in the client's API, into out;
 * u: the provider's usage classes; req: the client's body. LTG_ERR with *why when it cannot be
 * carried. */
static int xl_answer(xl_api from, xl_api client, const char *s, size_t n, const char *req,
                     size_t rn, const char *rid, const long long u[NTOK], buf *out,
                     const char **why) {
    out->len = 0;
    buf_reserve(out, n + 512); /* chat's answer is a few hundred bytes longer than Anthropic's */
    if (client == XL_RESPONSES && from == XL_MESSAGES) { /* Claude's, through chat's form */
        buf mid = {0};
        xl_message_to_chat(s, n, u, &mid);
        xl_chat_to_response(mid.p, mid.len, req, rn, rid, u, out);
        buf_free(&mid);
        return 0;
    }
    if (client == XL_RESPONSES) {
        xl_chat_to_response(s, n, req, rn, rid, u, out);
        return 0;
    }
    if (from == XL_CHAT && client == XL_MESSAGES)
        return xl_chat_to_message(s, n, req, rn, u, out, why);
    xl_message_to_chat(s, n, u, out);
    return 0;
}

/* A provider's error answer (status, body s[0..n), any shape or none) for a client of the other
 * API: the status it gets (Anthropic's 529 is chat's 503 and back; a quota is 402 to Anthropic,
 * 429 insufficient_quota to chat), the provider's message and type. */
/* What a provider's error answer s[0..n) says, into msg (unescaped; "" when nothing): its
 * error.message (OpenAI's and Anthropic's), or a top-level message, or a text body's first line.
 * Its error.code (else error.type) into code when code is not NULL. */
static void provider_message(const char *s, size_t n, buf *msg, buf *code) {
    json_tok t[1], root, err, v;
    json_result res;
    if (s && json_parse(s, n, t, 1, 0, &res) == 0) {
        size_t pos = 0;
        json_tok first;
        root = jv_doc(s, n);
        /* Google's OpenAI shim wraps its error in an array: its first element */
        if (root.type == JSON_ARRAY && !jv_next(s, n, &root, &pos, &v, &first)) return;
        if (root.type == JSON_ARRAY) root = first;
        int e = jv_get(s, n, &root, "error", &err) && err.type == JSON_OBJECT;
        if (jv_get(s, n, e ? &err : &root, "message", &v) && v.type == JSON_STRING)
            json_unescape(s, &v, 0, msg);
        if (e && code && (jv_get(s, n, &err, "code", &v) || jv_get(s, n, &err, "type", &v)) &&
            v.type == JSON_STRING)
            json_unescape(s, &v, 0, code);
        return;
    }
    for (size_t i = 0; s && i < n && i < 200 && s[i] != '\n' && s[i] != '\r'; i++)
        buf_append(msg, (unsigned char)s[i] < 0x20 ? " " : s + i, 1);
}

/* Does an error's code say the provider's quota is spent (OpenAI's, Anthropic's word)? */
static int provider_quota(const buf *code) {
    return code->p && (strcmp(code->p, "insufficient_quota") == 0 ||
                       strcmp(code->p, "billing_error") == 0);
}

static int xl_error(xl_api client, int status, const char *s, size_t n, buf *out) {
    buf msg = {0}, code = {0};
    provider_message(s, n, &msg, &code);
    int quota = provider_quota(&code);
    int to = client == XL_MESSAGES ? (status == 503 ? 529 : quota ? 402 : status)
                                   : (status == 529 ? 503 : quota ? 429 : status);
    jwriter w;
    jw_init(&w, out);
    const char *type = client != XL_MESSAGES && quota       ? "insufficient_quota"
                       : client != XL_MESSAGES && to == 503 ? "service_unavailable_error"
                                                            : NULL;
    error_open(&w, to, client == XL_MESSAGES, msg.len ? msg.p : "the provider answered an error",
               type, NULL);
    jw_key(&w, "code"), jw_cstr(&w, client != XL_MESSAGES && quota ? "insufficient_quota"
                                    : code.p                   ? code.p
                                                               : "upstream_error");
    jw_close(&w, '}'), jw_close(&w, '}');
    buf_free(&msg);
    buf_free(&code);
    return to;
}

/* ---- streams: a decoder per provider API, an encoder per client API ---- */

/* A neutral event: what a provider's stream event says, in no API's words. Text is JSON-escaped,
 * as the event had it. */
typedef enum { XE_TEXT, XE_REASONING, XE_TOOL, XE_ARGS, XE_FINISH, XE_PING, XE_END } xe_kind;
typedef struct {
    xe_kind kind;
    int index;                   /* XE_TOOL, XE_ARGS: the call's place in the answer */
    const char *s;               /* XE_TEXT, XE_REASONING, XE_ARGS: the text; XE_TOOL: the id */
    size_t n;
    const char *name;            /* XE_TOOL: the tool's name */
    size_t nn;
    xl_finish finish;            /* XE_FINISH */
} xe;

/* The Anthropic encoder's machine: nothing sent yet; message_start sent and no block open; a
 * text or a tool_use block open; message_stop sent. */
typedef enum { AE_WAIT, AE_IDLE, AE_TEXT, AE_TOOL, AE_DONE } ae_state;
/* The chat encoder's: nothing sent yet; chunks flowing; [DONE] sent. */
typedef enum { CE_WAIT, CE_FLOWING, CE_DONE } ce_state;
/* The Responses encoder's: nothing sent yet; response.created sent and no item open; a
 * reasoning or a message item open; response.completed (or .incomplete) sent. */
typedef enum { RE_WAIT, RE_IDLE, RE_REASONING, RE_TEXT, RE_DONE } re_state;
/* A Responses output item: a reasoning summary or a message (ref: its run of seg[]), a
 * function or a custom tool call (ref: its tools[] entry). */
typedef enum { RI_REASONING, RI_MESSAGE, RI_CALL, RI_CUSTOM } re_kind;
typedef struct {
    unsigned char kind, ref;
    unsigned short nsn;          /* a call's: its namespace's length in its chat name (0: none) */
} re_item_t;
#define RE_MAX_SEGMENTS 8        /* runs of text or reasoning in one streamed Responses answer */

/* A tool call of a chat stream on its way to an Anthropic client, whose blocks come one after
 * another: it is live (its block open, its fragments passed on as they come), held (another is
 * live: its arguments wait, it goes whole at the end), or closed. */
typedef struct {
    int index;                   /* chat's "index" */
    enum { XT_HELD, XT_LIVE, XT_CLOSED } st;
    int named;                   /* its id and name came */
    size_t sent;                 /* argument bytes passed on */
    buf id, name, args;          /* escaped, as the stream had them */
} xl_tool;

typedef struct xl_stream xl_stream;
struct xl_stream {
    xl_api provider, client;
    ae_state ae;
    ce_state ce;
    int block;                   /* Anthropic: the next block's index */
    int ntools, live;            /* live: the tools[] index whose block is open (-1: none) */
    size_t held;                 /* argument bytes held */
    int any_tool;
    xl_finish finish;
    int include_usage;           /* a chat client asked for the usage chunk */
    long long estimate;          /* the input ltg estimates, for message_start */
    char id[96], model[160];     /* the answer's id and model, escaped */
    /* an Anthropic provider: the kind of each content block so far, and the tool ordinal */
    unsigned char kinds[256];
    int ntool_blocks;
    const char *req;             /* the client's body: tool names mapped back */
    size_t rn;
    buf head, d;                 /* chat: each chunk's opening, made once; a delta's scratch */
    /* a Responses client: the machine, the next sequence_number, the time, the request's id,
     * the output items so far and the text of each run */
    re_state re;
    long long seq, created;
    char rid[32];
    re_item_t items[XL_MAX_TOOLS + RE_MAX_SEGMENTS];
    int nitems, nseg;
    buf seg[RE_MAX_SEGMENTS];
    /* not zeroed (xl_stream_new): each entry is set before it is read */
    int ordinal[256];            /* each tool_use block's, set with its kinds[] */
    xl_tool tools[XL_MAX_TOOLS]; /* the first ntools */
};

static xl_stream *xl_stream_new(xl_api from, xl_api client, int include_usage,
                                long long estimate, const char *req, size_t rn) {
    xl_stream *x = xmalloc(sizeof *x); /* 7 KiB, most of it tools[]: zeroed up to there */
    memset(x, 0, offsetof(xl_stream, ordinal));
    x->provider = from, x->client = client, x->live = -1, x->include_usage = include_usage;
    x->estimate = estimate, x->req = req, x->rn = rn;
    return x;
}

static void xl_stream_free(xl_stream *x) {
    if (!x) return;
    for (int i = 0; i < x->ntools; i++) {
        buf_free(&x->tools[i].id);
        buf_free(&x->tools[i].name);
        buf_free(&x->tools[i].args);
    }
    for (int i = 0; i < x->nseg; i++) buf_free(&x->seg[i]);
    buf_free(&x->head);
    buf_free(&x->d);
    free(x);
}

/* One SSE event, as Anthropic names them: "event: NAME" and its data. */
static void ae_event(buf *out, const char *name, const buf *data) {
    buf_cat(out, "event: ", name, "\ndata: ", NULL);
    buf_append(out, data->p, data->len);
    buf_puts(out, "\n\n");
}

static void ae_to(xl_stream *x, ae_state to) {
    static const unsigned char next[] = {
        [AE_WAIT] = 1 << AE_IDLE,
        [AE_IDLE] = 1 << AE_TEXT | 1 << AE_TOOL | 1 << AE_DONE,
        [AE_TEXT] = 1 << AE_IDLE,
        [AE_TOOL] = 1 << AE_IDLE,
        [AE_DONE] = 0,
    };
    assert(next[x->ae] >> to & 1);
    x->ae = to;
}

/* message_start, with ltg's estimate of the input (the provider's counts come in message_delta,
 * which Anthropic's SDKs copy over it). */
static void ae_start(xl_stream *x, buf *out) {
    buf d = {0};
    buf_cat(&d, "{\"type\":\"message_start\",\"message\":{\"id\":\"msg_", x->id,
            "\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"", x->model,
            "\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{"
            "\"input_tokens\":", NULL);
    buf_uint(&d, x->estimate > 0 ? (unsigned long long)x->estimate : 0);
    buf_puts(&d, ",\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":0,"
             "\"output_tokens\":1}}}");
    ae_event(out, "message_start", &d);
    buf_free(&d);
    ae_to(x, AE_IDLE);
}

static void ae_delta(xl_stream *x, const char *type, const char *field, const char *s, size_t n,
                     buf *out) {
    buf_puts(out, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":");
    buf_uint(out, (unsigned)x->block); /* one per event: no printf */
    buf_cat(out, ",\"delta\":{\"type\":\"", type, "\",\"", field, "\":\"", NULL);
    buf_append(out, s, n);
    buf_puts(out, "\"}}\n\n");
}

static void ae_stop_block(xl_stream *x, buf *out) {
    if (x->ae != AE_TEXT && x->ae != AE_TOOL) return;
    buf d = {0};
    if (x->ae == AE_TOOL && !x->tools[x->live].sent) /* a call without arguments: {} */
        ae_delta(x, "input_json_delta", "partial_json", "{}", 2, out);
    buf_puts(&d, "{\"type\":\"content_block_stop\",\"index\":");
    buf_uint(&d, (unsigned)x->block++);
    buf_puts(&d, "}");
    ae_event(out, "content_block_stop", &d);
    buf_free(&d);
    if (x->ae == AE_TOOL) x->tools[x->live].st = XT_CLOSED, x->live = -1;
    ae_to(x, AE_IDLE);
}

/* Tool i's block opens (its arguments so far go with it). */
static void ae_open_tool(xl_stream *x, int i, buf *out) {
    xl_tool *t = &x->tools[i];
    buf d = {0}, nm = {0};
    char aid[74];
    buf raw = {0};
    json_tok tok = {JSON_STRING, 0, (uint32_t)t->id.len, 0, 0};
    if (t->id.len) json_unescape(t->id.p, &tok, 0, &raw);
    else buf_printf(&raw, "toolu_ltg_%s_%d", x->id, t->index);
    xl_anthropic_id(raw.p, raw.len, aid);
    xl_client_name(x->req, x->rn, t->name.p ? t->name.p : "", t->name.len, &nm);
    buf_printf(&d, "{\"type\":\"content_block_start\",\"index\":%d,\"content_block\":"
               "{\"type\":\"tool_use\",\"id\":\"%s\",\"name\":\"", x->block, aid);
    buf_append(&d, nm.p, nm.len);
    buf_puts(&d, "\",\"input\":{}}}");
    ae_event(out, "content_block_start", &d);
    ae_to(x, AE_TOOL);
    x->live = i;
    t->st = XT_LIVE;
    x->any_tool = 1;
    if (t->args.len) ae_delta(x, "input_json_delta", "partial_json", t->args.p, t->args.len, out);
    t->sent = t->args.len;
    x->held -= t->args.len;
    t->args.len = 0;
    buf_free(&d), buf_free(&nm), buf_free(&raw);
}

static xl_tool *ae_tool(xl_stream *x, int index, const char **why) {
    for (int i = 0; i < x->ntools; i++)
        if (x->tools[i].index == index) return &x->tools[i];
    if (x->ntools == XL_MAX_TOOLS) {
        *why = "more tool calls in one answer than ltg carries (64)";
        return NULL;
    }
    x->tools[x->ntools] = (xl_tool){.index = index};
    return &x->tools[x->ntools++];
}

/* The end: the open block closed, the held tools each whole, then message_delta with the stop
 * reason (a tool call's whatever was said) and the provider's counts, and message_stop. */
static void ae_end(xl_stream *x, const long long u[NTOK], buf *out) {
    if (x->ae == AE_WAIT) ae_start(x, out);
    ae_stop_block(x, out);
    for (int i = 0; i < x->ntools; i++)
        if (x->tools[i].st == XT_HELD) {
            ae_open_tool(x, i, out);
            ae_stop_block(x, out);
        }
    xl_finish f = x->any_tool ? XF_TOOL : x->finish == XF_TOOL ? XF_STOP : x->finish;
    buf d = {0};
    jwriter w;
    jw_init(&w, &d);
    jw_open(&w, '{');
    jw_key(&w, "type"), jw_lit(&w, "message_delta");
    jw_key(&w, "delta"), jw_open(&w, '{');
    jw_key(&w, "stop_reason"), jw_cstr(&w, XF_ANTHROPIC[f]);
    jw_key(&w, "stop_sequence"), jw_null(&w);
    jw_close(&w, '}');
    jw_key(&w, "usage"), xl_usage_json(&w, XL_MESSAGES, u);
    jw_close(&w, '}');
    ae_event(out, "message_delta", &d);
    d.len = 0;
    buf_puts(&d, "{\"type\":\"message_stop\"}");
    ae_event(out, "message_stop", &d);
    buf_free(&d);
    ae_to(x, AE_DONE);
}

/* One neutral event for an Anthropic client. 1 when the client's stream is whole; LTG_ERR with
 * *why. */
static int ae_put(xl_stream *x, const xe *e, const long long u[NTOK], buf *out,
                  const char **why) {
    if (x->ae == AE_DONE) return 1;
    if (e->kind == XE_END) {
        ae_end(x, u, out);
        return 1;
    }
    if (e->kind == XE_FINISH) x->finish = e->finish;
    if (e->kind == XE_PING && x->ae != AE_WAIT) {
        buf_puts(out, "event: ping\ndata: {\"type\":\"ping\"}\n\n");
    }
    if (e->kind == XE_TEXT && e->n) {
        if (x->ae == AE_WAIT) ae_start(x, out);
        if (x->ae == AE_TOOL) ae_stop_block(x, out);
        if (x->ae == AE_IDLE) {
            buf d = {0};
            buf_printf(&d, "{\"type\":\"content_block_start\",\"index\":%d,\"content_block\":"
                       "{\"type\":\"text\",\"text\":\"\"}}", x->block);
            ae_event(out, "content_block_start", &d);
            buf_free(&d);
            ae_to(x, AE_TEXT);
        }
        ae_delta(x, "text_delta", "text", e->s, e->n, out);
    }
    if (e->kind != XE_TOOL && e->kind != XE_ARGS) return 0;
    xl_tool *t = ae_tool(x, e->index, why);
    if (!t) return LTG_ERR;
    if (e->kind == XE_TOOL && !t->named) {
        t->named = 1;
        buf_append(&t->id, e->s, e->n);
        buf_append(&t->name, e->name, e->nn);
    }
    if (e->kind == XE_ARGS && t->st == XT_LIVE) {
        if (e->n) ae_delta(x, "input_json_delta", "partial_json", e->s, e->n, out);
        t->sent += e->n;
    } else if (e->kind == XE_ARGS && t->st == XT_CLOSED) {
        *why = "a tool call's arguments went on after its block was closed";
        return LTG_ERR;
    } else if (e->kind == XE_ARGS) {
        buf_append(&t->args, e->s, e->n);
        if ((x->held += e->n) > XL_MAX_BUFFERED) {
            *why = "more tool arguments held back than ltg keeps (8 MiB)";
            return LTG_ERR;
        }
    }
    if (t->named && t->st == XT_HELD && x->live < 0) { /* the first call goes live */
        if (x->ae == AE_WAIT) ae_start(x, out);
        ae_stop_block(x, out);
        ae_open_tool(x, (int)(t - x->tools), out);
    }
    return 0;
}

static void ce_to(xl_stream *x, ce_state to) {
    static const unsigned char next[] = {
        [CE_WAIT] = 1 << CE_FLOWING | 1 << CE_DONE,
        [CE_FLOWING] = 1 << CE_DONE,
        [CE_DONE] = 0,
    };
    assert(next[x->ce] >> to & 1);
    x->ce = to;
}

/* A chat chunk: `delta` (the members, written) and finish_reason, or `choices` empty with the
 * usage. */
static void ce_chunk(xl_stream *x, const buf *delta, const char *finish, const long long *u,
                     buf *out) {
    if (!x->head.len) /* the same id, time and model in every chunk, as OpenAI's */
        buf_printf(&x->head, "data: {\"id\":\"chatcmpl-%s\",\"object\":\"chat.completion.chunk\","
                   "\"created\":%lld,\"model\":\"%s\",\"choices\":", x->id,
                   (long long)(wall_ms() / 1000), x->model);
    buf_append(out, x->head.p, x->head.len);
    if (u) {
        buf b = {0};
        jwriter w;
        jw_init(&w, &b);
        xl_usage_json(&w, XL_CHAT, u);
        buf_cat(out, "[],\"usage\":", b.p, "}\n\n", NULL);
        buf_free(&b);
        return;
    }
    buf_puts(out, "[{\"index\":0,\"delta\":{");
    if (x->ce == CE_WAIT) buf_puts(out, "\"role\":\"assistant\"");
    if (x->ce == CE_WAIT && delta->len) buf_puts(out, ",");
    buf_append(out, delta->p, delta->len);
    buf_puts(out, "},\"logprobs\":null,\"finish_reason\":");
    buf_cat(out, finish ? "\"" : "null", finish ? finish : "", finish ? "\"" : "", "}]}\n\n", NULL);
    if (x->ce == CE_WAIT) ce_to(x, CE_FLOWING);
}

/* One neutral event for a chat client. 1 when its stream is whole. */
static int ce_put(xl_stream *x, const xe *e, const long long u[NTOK], buf *out) {
    buf *d = &x->d;
    d->len = 0;
    if (x->ce == CE_DONE) return 1;
    switch (e->kind) {
    case XE_TEXT:
    case XE_REASONING:
        if (!e->n) break;
        buf_cat(d, e->kind == XE_TEXT ? "\"content\":\"" : "\"reasoning_content\":\"", NULL);
        buf_append(d, e->s, e->n);
        buf_puts(d, "\"");
        ce_chunk(x, d, NULL, NULL, out);
        break;
    case XE_TOOL:
        x->any_tool = 1;
        buf_printf(d, "\"tool_calls\":[{\"index\":%d,\"id\":\"", e->index);
        buf_append(d, e->s, e->n);
        buf_puts(d, "\",\"type\":\"function\",\"function\":{\"name\":\"");
        buf_append(d, e->name, e->nn);
        buf_puts(d, "\",\"arguments\":\"\"}}]");
        ce_chunk(x, d, NULL, NULL, out);
        break;
    case XE_ARGS:
        if (!e->n) break;
        buf_printf(d, "\"tool_calls\":[{\"index\":%d,\"function\":{\"arguments\":\"", e->index);
        buf_append(d, e->s, e->n);
        buf_puts(d, "\"}}]");
        ce_chunk(x, d, NULL, NULL, out);
        break;
    case XE_FINISH:
        x->finish = e->finish;
        break;
    case XE_PING:
        if (x->ce != CE_WAIT) buf_puts(out, ": ping\n\n");
        break;
    case XE_END: {
        xl_finish f = x->any_tool ? XF_TOOL : x->finish == XF_TOOL ? XF_STOP : x->finish;
        ce_chunk(x, d, XF_CHAT[f], NULL, out);
        if (x->include_usage) ce_chunk(x, d, NULL, u, out);
        buf_puts(out, "data: [DONE]\n\n");
        ce_to(x, CE_DONE);
        return 1;
    }
    }
    return 0;
}

/* ---- the Responses encoder: a chat provider's stream for a Responses client (Codex) ----
 * Responses' events repeat what they carry: each .done event and response.completed hold the
 * whole text and arguments, so the encoder keeps them (at most XL_MAX_BUFFERED). Text and
 * reasoning stream as they come, each run an item of its own (a message, a reasoning summary);
 * tool calls, whose chat fragments may interleave, go whole at the end, an item each (a custom
 * tool's a custom_tool_call, its input the "input" of the arguments). Every event has its
 * sequence_number; the response's id is the request's. */

static void re_to(xl_stream *x, re_state to) {
    static const unsigned char next[] = {
        [RE_WAIT] = 1 << RE_IDLE,
        [RE_IDLE] = 1 << RE_REASONING | 1 << RE_TEXT | 1 << RE_DONE,
        [RE_REASONING] = 1 << RE_IDLE,
        [RE_TEXT] = 1 << RE_IDLE,
        [RE_DONE] = 0,
    };
    assert(next[x->re] >> to & 1);
    x->re = to;
}

/* One event: its type, its sequence number, then the members written in b (emptied). */
static void re_event(xl_stream *x, buf *out, const char *type, buf *b) {
    buf_cat(out, "event: ", type, "\ndata: {\"type\":\"", type, "\",\"sequence_number\":", NULL);
    buf_uint(out, (unsigned long long)x->seq++);
    buf_puts(out, ",");
    buf_append(out, b->p, b->len);
    buf_puts(out, "}\n\n");
    b->len = 0;
}

/* Item k's id: its kind's prefix, the request's id, its place. */
static void re_item_id(const xl_stream *x, int k, char id[80]) {
    static const char *const prefix[] = {"rs", "msg", "fc", "ctc"};
    snprintf(id, 80, "%s_%s_%d", prefix[x->items[k].kind], x->rid, k);
}

/* Item k as JSON: whole (done), or as it is added (in progress: no text, no arguments). */
static void re_item(const xl_stream *x, jwriter *w, int k, int done) {
    const re_item_t *it = &x->items[k];
    char id[80];
    re_item_id(x, k, id);
    jw_open(w, '{');
    jw_key(w, "id"), jw_cstr(w, id);
    if (it->kind == RI_REASONING) {
        jw_key(w, "type"), jw_lit(w, "reasoning");
        jw_key(w, "summary"), jw_open(w, '[');
        if (done) {
            jw_open(w, '{');
            jw_key(w, "type"), jw_lit(w, "summary_text");
            jw_key(w, "text"), xl_escaped(w, &x->seg[it->ref]);
            jw_close(w, '}');
        }
        jw_close(w, ']');
    } else if (it->kind == RI_MESSAGE) {
        jw_key(w, "type"), jw_lit(w, "message");
        jw_key(w, "status"), jw_cstr(w, done ? "completed" : "in_progress");
        jw_key(w, "role"), jw_lit(w, "assistant");
        jw_key(w, "content"), jw_open(w, '[');
        if (done) {
            jw_open(w, '{');
            jw_key(w, "type"), jw_lit(w, "output_text");
            jw_key(w, "text"), xl_escaped(w, &x->seg[it->ref]);
            jw_key(w, "annotations"), jw_raw(w, "[]", 2);
            jw_close(w, '}');
        }
        jw_close(w, ']');
    } else {
        const xl_tool *t = &x->tools[it->ref];
        jw_key(w, "type");
        if (it->kind == RI_CUSTOM) jw_lit(w, "custom_tool_call");
        else jw_lit(w, "function_call");
        jw_key(w, "status"), jw_cstr(w, done ? "completed" : "in_progress");
        jw_key(w, "call_id"), xl_escaped(w, &t->id);
        xl_call_name(w, t->name.p ? t->name.p : "", t->name.len, it->nsn);
        if (it->kind == RI_CUSTOM) {
            jw_key(w, "input");
            if (done) xl_custom_input(w, t->args.p, t->args.len);
            else jw_lit(w, "");
        } else {
            jw_key(w, "arguments");
            if (done) xl_escaped(w, &t->args);
            else jw_lit(w, "");
        }
    }
    jw_close(w, '}');
}

/* The response: in progress (no output yet), or whole with its items and usage. */
static void re_response(const xl_stream *x, jwriter *w, const long long *u) {
    char id[64];
    snprintf(id, sizeof id, "resp_%s", x->rid);
    jw_open(w, '{');
    jw_key(w, "id"), jw_cstr(w, id);
    jw_key(w, "object"), jw_lit(w, "response");
    jw_key(w, "created_at"), jw_int(w, x->created);
    xl_resp_status(w, !u ? XF_NONE : x->finish == XF_NONE ? XF_STOP : x->finish);
    jw_key(w, "model"), jw_sep(w);
    buf_cat(w->out, "\"", x->model, "\"", NULL);
    jw_key(w, "output"), jw_open(w, '[');
    for (int k = 0; u && k < x->nitems; k++) re_item(x, w, k, 1);
    jw_close(w, ']');
    jw_key(w, "store"), jw_bool(w, 0);
    jw_key(w, "usage");
    if (u) xl_usage_json(w, XL_RESPONSES, u);
    else jw_null(w);
    jw_close(w, '}');
}

/* An event about item k: "item_id", "output_index" (and content or summary index 0), then the
 * rest the caller writes into w. */
static void re_about(const xl_stream *x, jwriter *w, int k, const char *index) {
    char id[80];
    re_item_id(x, k, id);
    jw_key(w, "item_id"), jw_cstr(w, id);
    jw_key(w, "output_index"), jw_int(w, k);
    if (index) jw_name(w, index), jw_int(w, 0);
}

/* Item k added (output_item.added), or done (output_item.done). */
static void re_item_event(xl_stream *x, int k, int done, buf *out) {
    jwriter w;
    jw_init(&w, &x->d);
    w.depth = 1; /* inside the event's object, after its type */
    jw_key(&w, "output_index"), jw_int(&w, k);
    jw_key(&w, "item"), re_item(x, &w, k, done);
    re_event(x, out, done ? "response.output_item.done" : "response.output_item.added", &x->d);
}

static void re_start(xl_stream *x, buf *out) {
    jwriter w;
    x->created = wall_ms() / 1000;
    for (int i = 0; i < 2; i++) {
        jw_init(&w, &x->d);
        w.depth = 1;
        jw_key(&w, "response"), re_response(x, &w, NULL);
        re_event(x, out, i ? "response.in_progress" : "response.created", &x->d);
    }
    re_to(x, RE_IDLE);
}

/* The open text or reasoning run done: its text, its part, its item. */
static void re_close(xl_stream *x, buf *out) {
    if (x->re != RE_TEXT && x->re != RE_REASONING) return;
    int k = x->nitems - 1, text = x->re == RE_TEXT;
    const buf *seg = &x->seg[x->items[k].ref];
    jwriter w;
    jw_init(&w, &x->d);
    w.depth = 1;
    re_about(x, &w, k, text ? "content_index" : "summary_index");
    jw_key(&w, "text"), xl_escaped(&w, seg);
    re_event(x, out, text ? "response.output_text.done" : "response.reasoning_summary_text.done",
             &x->d);
    jw_init(&w, &x->d);
    w.depth = 1;
    re_about(x, &w, k, text ? "content_index" : "summary_index");
    jw_key(&w, "part"), jw_open(&w, '{');
    jw_key(&w, "type"), jw_cstr(&w, text ? "output_text" : "summary_text");
    jw_key(&w, "text"), xl_escaped(&w, seg);
    if (text) jw_key(&w, "annotations"), jw_raw(&w, "[]", 2);
    jw_close(&w, '}');
    re_event(x, out, text ? "response.content_part.done" : "response.reasoning_summary_part.done",
             &x->d);
    re_item_event(x, k, 1, out);
    re_to(x, RE_IDLE);
}

/* A run of text or reasoning opens: its item, its part. */
static int re_open(xl_stream *x, re_state to, buf *out, const char **why) {
    if (x->nseg == RE_MAX_SEGMENTS) {
        *why = "text and reasoning alternate more often than ltg carries to Responses (8 runs)";
        return LTG_ERR;
    }
    int k = x->nitems++, text = to == RE_TEXT;
    x->items[k] = (re_item_t){text ? RI_MESSAGE : RI_REASONING, (unsigned char)x->nseg++, 0};
    re_item_event(x, k, 0, out);
    jwriter w;
    jw_init(&w, &x->d);
    w.depth = 1;
    re_about(x, &w, k, text ? "content_index" : "summary_index");
    jw_key(&w, "part"), jw_open(&w, '{');
    jw_key(&w, "type"), jw_cstr(&w, text ? "output_text" : "summary_text");
    jw_key(&w, "text"), jw_lit(&w, "");
    if (text) jw_key(&w, "annotations"), jw_raw(&w, "[]", 2);
    jw_close(&w, '}');
    re_event(x, out, text ? "response.content_part.added" : "response.reasoning_summary_part.added",
             &x->d);
    re_to(x, to);
    return 0;
}

/* Text or reasoning (escaped) of the stream: into the open run of its kind, opened if need be. */
static int re_text(xl_stream *x, re_state to, const char *s, size_t n, buf *out,
                   const char **why) {
    if (x->re == RE_WAIT) re_start(x, out);
    if (x->re != to) {
        re_close(x, out);
        if (re_open(x, to, out, why) < 0) return LTG_ERR;
    }
    buf *seg = &x->seg[x->items[x->nitems - 1].ref];
    if ((x->held += n) > XL_MAX_BUFFERED) {
        *why = "more text than ltg keeps for Responses' done events (8 MiB)";
        return LTG_ERR;
    }
    buf_append(seg, s, n);
    jwriter w;
    jw_init(&w, &x->d);
    w.depth = 1;
    re_about(x, &w, x->nitems - 1, to == RE_TEXT ? "content_index" : "summary_index");
    jw_key(&w, "delta"), jw_sep(&w);
    buf_cat(w.out, "\"", NULL);
    buf_append(w.out, s, n);
    buf_cat(w.out, "\"", NULL);
    re_event(x, out, to == RE_TEXT ? "response.output_text.delta"
                                   : "response.reasoning_summary_text.delta", &x->d);
    return 0;
}

/* The end: the open run done, each call whole (added, its arguments or input, done), then
 * response.completed (or .incomplete) with every item and the usage. */
static void re_end(xl_stream *x, const long long u[NTOK], buf *out) {
    jwriter w;
    if (x->re == RE_WAIT) re_start(x, out);
    re_close(x, out);
    for (int i = 0; i < x->ntools; i++) {
        const xl_tool *t = &x->tools[i];
        int k = x->nitems++;
        int custom;
        size_t nsn;
        xl_tool_of(x->req, x->rn, t->name.p ? t->name.p : "", t->name.len, &custom, &nsn);
        x->items[k] = (re_item_t){custom ? RI_CUSTOM : RI_CALL, (unsigned char)i,
                                  (unsigned short)nsn};
        re_item_event(x, k, 0, out);
        jw_init(&w, &x->d);
        w.depth = 1;
        re_about(x, &w, k, NULL);
        jw_key(&w, "delta");
        if (custom) xl_custom_input(&w, t->args.p, t->args.len);
        else xl_escaped(&w, &t->args);
        re_event(x, out, custom ? "response.custom_tool_call_input.delta"
                                : "response.function_call_arguments.delta", &x->d);
        jw_init(&w, &x->d);
        w.depth = 1;
        re_about(x, &w, k, NULL);
        jw_name(&w, custom ? "input" : "arguments");
        if (custom) xl_custom_input(&w, t->args.p, t->args.len);
        else xl_escaped(&w, &t->args);
        re_event(x, out, custom ? "response.custom_tool_call_input.done"
                                : "response.function_call_arguments.done", &x->d);
        re_item_event(x, k, 1, out);
    }
    if (x->ntools) x->finish = XF_TOOL; /* not incomplete: the calls are whole */
    jw_init(&w, &x->d);
    w.depth = 1;
    jw_key(&w, "response"), re_response(x, &w, u);
    re_event(x, out, x->finish == XF_LENGTH || x->finish == XF_FILTER ? "response.incomplete"
                                                                      : "response.completed",
             &x->d);
    re_to(x, RE_DONE);
}

/* One neutral event for a Responses client. 1 when its stream is whole. */
static int re_put(xl_stream *x, const xe *e, const long long u[NTOK], buf *out,
                  const char **why) {
    if (x->re == RE_DONE) return 1;
    switch (e->kind) {
    case XE_TEXT:
    case XE_REASONING:
        if (e->n && re_text(x, e->kind == XE_TEXT ? RE_TEXT : RE_REASONING, e->s, e->n, out,
                            why) < 0)
            return LTG_ERR;
        break;
    case XE_TOOL:
    case XE_ARGS: {
        xl_tool *t = ae_tool(x, e->index, why);
        if (!t) return LTG_ERR;
        if (x->re == RE_WAIT) re_start(x, out); /* a call is content: the head goes */
        if (e->kind == XE_TOOL && !t->named) {
            t->named = 1;
            buf_append(&t->id, e->s, e->n);
            buf_append(&t->name, e->name, e->nn);
        } else if (e->kind == XE_ARGS) {
            buf_append(&t->args, e->s, e->n);
            if ((x->held += e->n) > XL_MAX_BUFFERED) {
                *why = "more tool arguments held back than ltg keeps (8 MiB)";
                return LTG_ERR;
            }
        }
        break;
    }
    case XE_FINISH:
        x->finish = e->finish;
        break;
    case XE_PING:
        if (x->re != RE_WAIT) buf_puts(out, ": ping\n\n");
        break;
    case XE_END:
        re_end(x, u, out);
        return 1;
    }
    return 0;
}

static int xl_put(xl_stream *x, const xe *e, const long long u[NTOK], buf *out,
                  const char **why) {
    return x->client == XL_MESSAGES    ? ae_put(x, e, u, out, why)
           : x->client == XL_RESPONSES ? re_put(x, e, u, out, why)
                                       : ce_put(x, e, u, out);
}

/* The answer's id and model (tokens of s, null when absent), once: from the first event that
 * names them. */
static void xl_names(xl_stream *x, const char *s, const json_tok *id, const json_tok *mdl) {
    size_t len;
    if (!x->id[0] && id->type == JSON_STRING) {
        len = id->end - id->start < 80 ? id->end - id->start : 80;
        memcpy(x->id, s + id->start, len), x->id[len] = 0;
    }
    if (!x->model[0] && mdl->type == JSON_STRING) {
        len = mdl->end - mdl->start < 150 ? mdl->end - mdl->start : 150;
        while (len < mdl->end - mdl->start && len && s[mdl->start + len - 1] == '\\')
            len--; /* an escape cut in two */
        memcpy(x->model, s + mdl->start, len), x->model[len] = 0;
    }
    for (char *p = x->id; *p; p++) /* an id goes into ids of its own: keep it plain */
        if (!isalnum((unsigned char)*p) && *p != '_' && *p != '-') *p = '_';
}

/* Where a decoder's neutral events go: the client's encoder, with the usage so far and the
 * output. */
typedef struct {
    xl_stream *x;
    const long long *u;
    buf *out;
    const char **why;
} xl_sink;

static int xe_put(xl_sink *k, xe e) { return xl_put(k->x, &e, k->u, k->out, k->why); }

static xe xe_of(xe_kind kind) { return (xe){kind, 0, NULL, 0, NULL, 0, XF_NONE}; }

/* An event of text (string token v of s): XE_TEXT, XE_REASONING, or XE_ARGS of call `index`. */
static xe xe_text(xe_kind kind, int index, const char *s, const json_tok *v) {
    xe e = xe_of(kind);
    e.index = index;
    e.s = s + v->start;
    e.n = v->end - v->start;
    return e;
}

/* XE_TOOL: call `index` begins, its id and name (string tokens of s; an empty id: none). */
static xe xe_tool(int index, const char *s, const json_tok *id, const json_tok *name) {
    xe e = xe_text(XE_TOOL, index, s, id);
    e.name = s + name->start;
    e.nn = name->end - name->start;
    return e;
}

static xe xe_finish(const char *s, const json_tok *v) {
    xe e = xe_of(XE_FINISH);
    e.finish = xl_finish_of(s, v);
    return e;
}

/* The entries of a chat delta's tool_calls: a call's start when it names its tool, then its
 * argument fragment. Keyed by "index": an id comes only with the first. */
static int xl_chat_calls(xl_sink *k, const char *s, size_t n, const json_tok *calls) {
    static const char *const names[] = {"index", "id", "function", NULL},
                             *const fnames[] = {"name", "arguments", NULL};
    size_t pos = 0;
    json_tok key, call, c[3], f[2];
    int r = 0;
    while (r == 0 && jv_next(s, n, calls, &pos, &key, &call)) {
        long long index = 0;
        if (jv_members(s, n, &call, names, c) & 1) json_int(s, &c[0], 0, &index);
        if (c[1].type != JSON_STRING) c[1] = (json_tok){JSON_STRING, 0, 0, 0, 0}; /* no id: "" */
        jv_members(s, n, &c[2], fnames, f);
        if (f[0].type == JSON_STRING && f[0].end > f[0].start)
            r = xe_put(k, xe_tool((int)index, s, &c[1], &f[0]));
        if (r == 0 && f[1].type == JSON_STRING && f[1].end > f[1].start)
            r = xe_put(k, xe_text(XE_ARGS, (int)index, s, &f[1]));
    }
    return r;
}

/* A chat provider's event (its data s[0..n), JSON or [DONE]) as neutral events. */
static int xl_from_chat(xl_sink *k, const char *s, size_t n) {
    enum { C_ERROR, C_CHOICES, C_ID, C_MODEL, C_DELTA = 0, C_FINISH };
    static const char *const names[] = {"error", "choices", "id", "model", NULL},
                             *const choice[] = {"delta", "finish_reason", NULL},
                             /* two names for the reasoning, then the text and the calls */
                             *const deltas[] = {"reasoning_content", "reasoning", "content",
                                                "tool_calls", NULL};
    if (n == 6 && memcmp(s, "[DONE]", 6) == 0) return xe_put(k, xe_of(XE_END));
    json_tok root = jv_doc(s, n), m[4], c[2], d[4], key, c0;
    size_t pos = 0;
    int r = 0;
    unsigned got = jv_members(s, n, &root, names, m), cg, dg; /* one walk of each object */
    if (got >> C_ERROR & 1) {
        *k->why = "the provider's stream carried an error";
        return LTG_ERR;
    }
    xl_names(k->x, s, &m[C_ID], &m[C_MODEL]);
    if (m[C_CHOICES].type != JSON_ARRAY || !jv_next(s, n, &m[C_CHOICES], &pos, &key, &c0))
        return 0; /* the usage chunk: section 18 has read it */
    cg = jv_members(s, n, &c0, choice, c);
    dg = jv_members(s, n, &c[C_DELTA], deltas, d);
    for (int i = 0; i < 3 && r == 0; i++)
        if (dg >> i & 1 && d[i].type == JSON_STRING)
            r = xe_put(k, xe_text(i < 2 ? XE_REASONING : XE_TEXT, 0, s, &d[i]));
    if (r == 0 && dg >> 3 & 1 && d[3].type == JSON_ARRAY) r = xl_chat_calls(k, s, n, &d[3]);
    if (r == 0 && cg >> C_FINISH & 1 && c[C_FINISH].type == JSON_STRING)
        r = xe_put(k, xe_finish(s, &c[C_FINISH]));
    return r;
}

/* content_block_start: a tool_use block is a call's start (numbered among the tool blocks); a
 * text or thinking block says nothing until its deltas. */
static int xl_block_start(xl_sink *k, const char *s, size_t n, const json_tok *root, int i) {
    json_tok b, v, id = {JSON_STRING, 0, 0, 0, 0}, nm = id;
    xl_stream *x = k->x;
    if (!jv_get(s, n, root, "content_block", &b) || !jv_get(s, n, &b, "type", &v)) return 0;
    x->kinds[i] = json_eq(s, &v, 0, "tool_use") ? 't' : json_eq(s, &v, 0, "thinking") ? 'r' : 'x';
    if (x->kinds[i] != 't') return 0;
    jv_get(s, n, &b, "id", &id);
    jv_get(s, n, &b, "name", &nm);
    x->ordinal[i] = x->ntool_blocks++;
    return xe_put(k, xe_tool(x->ordinal[i], s, &id, &nm));
}

/* An Anthropic provider's event (`name`, its data s[0..n)) as neutral events. */
static int xl_from_messages(xl_sink *k, const char *name, const char *s, size_t n) {
    enum { M_INDEX, M_DELTA, M_MESSAGE };
    static const char *const names[] = {"index", "delta", "message", NULL};
    static const char *const deltas[] = {"text", "thinking", "partial_json", "stop_reason", NULL};
    json_tok root = jv_doc(s, n), m[3], d[4];
    long long i = 0;
    xl_stream *x = k->x;
    if (strcmp(name, "ping") == 0) return xe_put(k, xe_of(XE_PING));
    if (strcmp(name, "message_stop") == 0) return xe_put(k, xe_of(XE_END));
    if (strcmp(name, "error") == 0) {
        *k->why = "the provider's stream carried an error";
        return LTG_ERR;
    }
    unsigned got = jv_members(s, n, &root, names, m); /* one walk of the event */
    if (got >> M_MESSAGE & 1 && strcmp(name, "message_start") == 0) {
        json_tok id, mdl; /* two lookups stop sooner than one walk of the whole message */
        jv_get(s, n, &m[M_MESSAGE], "id", &id), jv_get(s, n, &m[M_MESSAGE], "model", &mdl);
        xl_names(x, s, &id, &mdl);
    }
    if (got >> M_INDEX & 1) json_int(s, &m[M_INDEX], 0, &i);
    if (i < 0 || i >= 256) {
        *k->why = "more content blocks than ltg carries (256)";
        return LTG_ERR;
    }
    if (strcmp(name, "content_block_start") == 0) return xl_block_start(k, s, n, &root, (int)i);
    unsigned dg = jv_members(s, n, &m[M_DELTA], deltas, d);
    for (int j = 0; j < 3; j++)
        if (dg >> j & 1 && d[j].type != JSON_STRING) {
            *k->why = "a content_block_delta whose text is not a string";
            return LTG_ERR;
        }
    if (strcmp(name, "content_block_delta") == 0) {
        if (dg & 1) return xe_put(k, xe_text(XE_TEXT, 0, s, &d[0]));
        if (dg >> 1 & 1) return xe_put(k, xe_text(XE_REASONING, 0, s, &d[1]));
        if (dg >> 2 & 1 && x->kinds[i] == 't')
            return xe_put(k, xe_text(XE_ARGS, x->ordinal[i], s, &d[2]));
        return 0; /* a signature: nothing a chat client reads */
    }
    if (strcmp(name, "message_delta") == 0 && dg >> 3 & 1) return xe_put(k, xe_finish(s, &d[3]));
    return 0;
}

/* One event of a provider's stream, translated: the client's events appended to `out` (nothing
 * before the answer's first content). u: the provider's usage so far, as classes. Returns 1
 * once the client's stream is whole, 0 while it goes on, LTG_ERR with *why (the provider's
 * stream carried an error, or something the client's API cannot say). */
static int xl_feed(xl_stream *x, const char *ev, size_t evn, const buf *data,
                   const long long u[NTOK], buf *out, const char **why) {
    xl_sink k = {x, u, out, why};
    char name[40] = "";
    const char *p = ev + 6 + (evn > 6 && ev[6] == ' ');
    if (evn > 6 && memcmp(ev, "event:", 6) == 0) {
        size_t nn = strcspn(p, "\r\n");
        memcpy(name, p, nn < sizeof name - 1 ? nn : sizeof name - 1);
        name[nn < sizeof name - 1 ? nn : sizeof name - 1] = 0;
    }
    if (!data->len) return xe_put(&k, xe_of(XE_PING)); /* a comment: a keep-alive */
    if (x->provider == XL_CHAT) return xl_from_chat(&k, data->p, data->len);
    if (!name[0]) { /* the event's name is its data's type */
        json_tok root = jv_doc(data->p, data->len), t;
        if (jv_get(data->p, data->len, &root, "type", &t))
            snprintf(name, sizeof name, "%.*s", (int)(t.end - t.start < 39 ? t.end - t.start : 39),
                     data->p + t.start);
    }
    return xl_from_messages(&k, name, data->p, data->len);
}

/* The provider's stream ended: whole when it had finished (a chat stream may leave out
 * [DONE]), else LTG_ERR. */
static int xl_feed_end(xl_stream *x, const long long u[NTOK], buf *out, const char **why) {
    if (x->ae == AE_DONE || x->ce == CE_DONE || x->re == RE_DONE) return 1;
    xl_sink k = {x, u, out, why};
    if (x->provider == XL_CHAT && x->finish != XF_NONE) return xe_put(&k, xe_of(XE_END));
    *why = "the stream ended before its answer did";
    return LTG_ERR;
}

/* ===== 18. Inference: the proxy path =====
 *
 * IMPLEMENTATION NOTES
 * An exchange is one inference request on its way through ltg. It owns
 * the request body (moved from the connection), the plan (section 11), the log of its attempts,
 * the upstream connection of the current attempt, its hold on the key's
 * and the group's budgets and rate limits,
 * and two timers: the deadline of the whole request, and `t`, which is by
 * turns the current attempt's timeout, the backoff before the next
 * attempt, and (once a stream flows) its idle limit.
 *
 *   inference_call(): the admission checks, each a refusal or nothing --
 *     key, body, model, options, overrides, idempotency (a replay answers
 *     here), parallel, storage, the hold (budgets and rate limits) -- then
 *     a cached answer, or the exchange:
 *
 *   exchange_step() -> exchange_attempt() -> up_start() ... exchange_upstream()
 *        ^                                                         |
 *        |          attempt_decide(): outcome, log, breaker, plan_next()
 *        +--- PLAN_RETRY_NOW, PLAN_NEXT_MODEL (a loop)                 |
 *        +--- PLAN_RETRY_AFTER: X_BACKOFF, the timer ------------------+
 *             PLAN_ANSWER: the answer is relayed, or the stream starts
 *             PLAN_GIVE_UP: the error (504 when the deadline ended it)
 *
 *   exchange_settle(): the answering attempt is billed; exchange_book(),
 *   once no attempt is metered any more: what every attempt was charged
 *   replaces the hold, the spend event is written, the replay record
 *   filled
 *
 * attempt_decide() turns an attempt's result into an outcome and asks the
 * plan (a client that leaves is logged by exchange_abort); exchange_step()
 * alone acts on the plan's step; x_state
 * says what the timer means meanwhile. A client that leaves cuts the
 * attempt: it is logged indeterminate (its breaker hears nothing of it)
 * and billed like any attempt given up on.
 *
 * Money (README "Cost"): every attempt is held before it starts (its own
 * worst case, attempt_hold; the first at admission; with --cluster, a
 * request the shared store decides waits in X_HOLDING for each hold, and
 * its first is taken once its exchange exists: section 21) and billed once when
 * it is over (attempt_bill): its provider's usage at its model's prices,
 * nothing when nothing reached the provider, else ltg's estimate. A whole
 * answer given up on after its request reached the provider is read on
 * without a client by a meter (meter_start) for its usage; the request's
 * spend event waits for its last meter, and the exchange lives until
 * then, its client long gone.
 *
 * The client sees one of two shapes:
 *   - a whole answer (non-streaming, or any error): ltg waits for the
 *     provider's complete body, then writes head and body at once, with
 *     the request's cost and the budget left in the headers;
 *   - a stream: when the provider answers 200 with text/event-stream, each
 *     complete SSE event is sent on as one HTTP chunk the moment it is
 *     whole. The client's head goes out with the first event, not before:
 *     until then an attempt can still fail over without the client having
 *     seen a byte. After it, a failure ends the stream with an explicit SSE
 *     error event and no [DONE], so no client mistakes half an answer for a
 *     whole one.
 *
 * Streams are metered: chat and completions streams are asked for a usage
 * chunk (stream_options.include_usage), passed on only to a client that
 * asked for it itself; the Responses API and Anthropic's Messages carry
 * their usage in their own events (response.completed; message_start and
 * message_delta).
 *
 * One pipeline, several APIs: what differs between OpenAI's chat,
 * completions, responses and embeddings and Anthropic's messages is a row
 * of WIRE (the wire-format subsection below): paths, streaming, usage
 * names and where a stream carries them, the output limit, how a cut
 * stream ends, the error shape. A model whose provider speaks another API
 * than the client's is reached through section 17 (the row the attempt is
 * sent as is x->up; the client's, x->kind).
 *
 * Timing. The per-attempt timeout (request_timeout_ms) runs to the response
 * head, or for a stream to its first event. The deadline (x-ltg-deadline,
 * 600 s by default) bounds everything before the answer starts: no attempt
 * starts after it (a retry whose backoff would end past it is skipped), a
 * running attempt is cut when it passes, and the client gets 504 at once.
 * A started stream is then bounded by --stream-idle-seconds and
 * --max-stream-seconds instead.
 *
 * A client that goes away cancels its upstream request (a stream's
 * connection is closed; a whole answer is read on by a meter for its
 * usage) -- unless the request
 * carries an Idempotency-Key: then it runs to its end without the client,
 * and its answer waits for the client's retry, which is the point of the
 * key. Back-pressure: when the client does not read and more than
 * OUT_HIGH_WATER bytes wait for it, ltg stops reading the provider.
 */

/* An inference error: OpenAI's shape, or Anthropic's on its endpoints
 * (the server's errors come here through route_error). */
static void inference_error(conn *c, int status, const char *code, const char *headers,
                            const char *msg) {
    buf b = {0}, extra = {0};
    if (headers) buf_puts(&extra, headers);
    jwriter w;
    jw_init(&w, &b);
    error_open(&w, status, c->f.anthropic, msg, NULL, c->f.param);
    jw_key(&w, "code"), jw_cstr(&w, code);
    jw_close(&w, '}'), jw_close(&w, '}');
    if (c->rid[0])
        buf_printf(&extra, "x-ltg-request-id: %s\r\nX-Request-ID: %s\r\nx-ltg-attempts: 0\r\n",
                   c->rid, c->rid);
    conn_reply(c, status, "application/json", extra.p, b.p, b.len);
    buf_free(&b);
    buf_free(&extra);
}

#define MAX_CHAIN (1 + MAX_FALLBACKS)
#define MAX_ATTEMPT_LOG (MAX_CHAIN * 5)
#define REPLAY_MAX_BYTES (8 << 20) /* the largest answer kept for an idempotent replay */
/* With --cluster, the largest spend event sent to the shared stream, a kept answer in it; an
 * event with its answer larger than this goes without it (every reader takes it whole). */
#define CL_MAX_EVENT ((16 << 20) - 65536)

enum { CACHE_NONE, CACHE_MISS, CACHE_BYPASS, CACHE_HIT };

/* An exchange is attempting (an upstream request in flight), waiting the
 * backoff before its next attempt, or relaying a stream that has started;
 * its timer `t` means the request timeout, the backoff, or the stream's
 * idle limit accordingly. */
typedef enum { X_ATTEMPTING, X_BACKOFF, X_RELAYING, X_HOLDING } x_state;

typedef struct {
    uint32_t at, end;     /* the bytes of the client's body it replaces */
    char *text;           /* what replaces them */
} body_edit;

/* A provider's usage counts as its API names them (raw[TOK_IN] is
 * Anthropic's uncached input): each read only when present. */
typedef struct {
    long long raw[NTOK];
    int seen;             /* a usage object came */
    int final;            /* ... with the final counts (a stream's message_start has not) */
    int bad;              /* a count that cannot be true: see usage_read */
} usage_counts;

/* What a request says of its size, for the worst case of an attempt. */
typedef struct {
    long long prompt;     /* the body's bytes / 3, rounded up */
    /* what the provider adds: a previous response's tokens (-1: unknown, the model's
     * context_window) */
    long long added;
    /* image, audio and file parts: each up to the model's max_input_part_tokens */
    long long parts;
    /* the largest output limit in the body (0: none, the model's max_output_tokens) */
    long long out;
    long long n;          /* answers asked for: n, times best_of */
} worst_shape;

/* The worst case of an attempt on m (README "Cost"): its input at the
 * dearest input class, its output limit times the answers asked for. */
static worst worst_case(const worst_shape *r, const model *m) {
    double in = (double)r->prompt + (double)(r->added < 0 ? m->context_window : r->added) +
                (double)r->parts * (double)m->max_input_part_tokens;
    double out = (double)(r->out > 0 ? r->out : m->max_output_tokens) * (double)r->n;
    return worst_of(m, (long long)fmin(in, 1e13), (long long)fmin(out, 1e13));
}

typedef struct {
    int model;            /* index in the chain */
    int dep;              /* its deployment, -1 for none (a skipped model) */
    int attempt;          /* from 1, per model */
    int status;           /* upstream HTTP status, 0 when none came */
    attempt_outcome outcome;
    int ms;
    char error[100];      /* why it did not succeed, "" for a success */
    worst w;              /* its worst case, held before it started */
    long long tok[NTOK];  /* what it was charged for: the provider's usage, or ltg's estimate */
    int64_t cost;         /* micro-USD */
    /* the cost is ltg's estimate: the provider's usage never came, or could not be true */
    int estimated;
    int billed;           /* tok, cost and estimated are final */
    int pending;          /* it is being metered (meter_start) */
    char span[17];        /* the span id its request's traceparent gave it ("" none) */
    const wire_kind *up;  /* the API it was sent as (its provider's; NULL: no call made) */
} attempt_entry;

struct exchange {
    conn *c;              /* NULL once the client left an idempotent request */
    char rid[32];
    char group_id[37], key_id[37]; /* by id: the group may be changed or deleted meanwhile */
    catalog *cat;         /* held: the models and providers live in it */
    model *chain[MAX_CHAIN];
    int nchain;
    int stream, cache_mode;
    int hide_usage;       /* ltg asked for the usage chunk: keep it from the client */
    const wire_kind *kind;/* the client's API (the wire format, below) */
    const wire_kind *up;  /* the current attempt's: its provider's (another: translated) */
    /* translated (section 17): the current attempt's body, its stream, its answer, the hints
     * it dropped; per model of the chain, why the request cannot go to it ("": it can) */
    buf xbody, xanswer;
    xl_stream *xs;
    char dropped[600];
    char untranslatable[MAX_CHAIN][100];
    xl_verdict *pre;      /* admission's translation, in xbody: for model pre_model (its first */
    int pre_model;        /* deployment's upstream name), its verdict; NULL once not in xbody */
    int last_xl;          /* the last failure was a translated attempt's */
    buf body;             /* the client's body */
    body_edit edit[2];    /* the body's rewrites, in body order */
    int nedit;
    retry_policy rp;      /* the group's, with the request's overrides */
    long long deadline_ms;
    attempt_plan plan;
    attempt_entry log[MAX_ATTEMPT_LOG];
    int nlog;
    int attempts;         /* upstream attempts made: x-ltg-attempts */
    upstream *u;          /* the current attempt's connection */
    buf req;
    x_state state;        /* X_RELAYING: the client has the answer's head, no failover after this */
    int dep;              /* the current attempt's deployment of its model */
    deployment *busy;     /* the deployment its connection counts in flight on (NULL: none) */
    /* previous_response_id's deployment of chain[0] (-1: none): its attempts while its breaker
     * lets them */
    int pin;
    /* deployments of the current model that answered no_work (bit i: dep[i]) */
    uint32_t avoid;
    int avoid_model;      /* ... the chain index of that model */
    int probe;            /* the current attempt is its deployment's breaker probe */
    int pinned;           /* its response id is pinned to its model (section 15) */
    /* its client set a timeout or deadline shorter than its group's: its timeouts are not the
     * provider's */
    int shortened;
    char pin_id[257];     /* ... that id ("" when none) */
    /* the client's, passed on to an Anthropic provider */
    char anthropic_version[64], anthropic_beta[256];
    char tracestate[512];  /* the client's, passed on to every provider */
    char trace_id[33], trace_flags[3], span[17]; /* its trace; the current attempt's span */
    /* the provider key of the current attempt (-1: none); keys refused during it */
    int key, key_tries;
    int detached;         /* idempotent, its client gone: it runs on alone */
    int64_t started, attempt_started, answered_at;
    timer deadline, t;
    int last_status;      /* of the last failure: what the client gets when all fail */
    int last_quota;       /* ... and it said the provider's quota is spent (insufficient_quota) */
    char last_reason[200];
    /* its attempts' worst cases, held against its key's and group's allowances (section 15) */
    hold hold;
    int shared;           /* held in the shared store (--cluster, section 21) */
    struct cl_wait *cl_wait; /* its call there while X_HOLDING */
    worst_shape shape;    /* what its attempts' worst cases are made of */
    worst w;              /* the current attempt's */
    usage_counts usage;   /* the current attempt's, as the provider reported it */
    size_t relayed;       /* bytes of the current stream relayed */
    int metering;         /* attempts of it still read without their client (see meter_start) */
    /* exchange_settle said how it ended; it is over for its client (exchange_end) */
    int settled, ended;
    int http_status, ev_status, served, cache_hit; /* how it ended, for its spend event */
    long long cache_tok[NTOK]; /* a cache hit's usage: its answer's */
    buf keep;             /* the answer its replay record keeps, while attempts are metered */
    int keep_set;         /* ... there is one */
    idem *idem;           /* the replay record this request fills */
    buf record;           /* a stream's events, for that record */
    buf event;            /* the data of the stream's event being read (stream_take) */
    int record_full;      /* too long to keep for a replay */
    int whole;            /* the stream's last event was relayed (stream_last) */
    uint8_t cache_key[32];
};

static model *exchange_model(exchange *x) { return x->chain[x->plan.model]; }
static deployment *exchange_dep(exchange *x) { return &exchange_model(x)->dep[x->dep]; }

/* The current attempt's upstream connection is done with: back to the pool
 * (or closed), and its deployment has one attempt fewer in flight. */
static void exchange_let_go(exchange *x) {
    if (!x->u) return;
    up_release(x->u);
    x->u = NULL;
    x->busy->inflight--;
    assert(x->busy->inflight >= 0);
    x->busy = NULL;
}

/* ---- the wire format: one row per API kind ----
 *
 * What ltg reads and writes of a provider's API, in one place: the table
 * of API kinds (WIRE: a row per endpoint, saying what differs), the request
 * it sends (exchange_build: the client's body with "model" rewritten, and
 * a stream's request for its usage), the usage it reads from an answer or
 * an event (usage_read), the edit that asks a stream for it (usage_edit),
 * what one SSE event is (stream_take), and how a stream broken after its
 * start is ended (stream_cut). Another API kind is another row. */
enum { CUT_DATA, CUT_EVENT, CUT_ANTHROPIC }; /* how a broken stream ends: see stream_cut() */

struct wire_kind {
    const char *path, *upstream; /* the client's path; the provider's, under its base URL */
    const char *name;            /* the API's name in events and logs ("chat", "messages"...) */
    int ep;                      /* its endpoint (EP_*): a provider that serves it is sent it */
    xl_api xl;                   /* the API translation speaks for it (XL_NONE: none) */
    /* the providers that speak it (API_*), and the shape of ltg's errors */
    int api;
    int stream;                  /* it may stream */
    /* a stream must ask for its usage (stream_options.include_usage) */
    int ask_usage;
    /* where its "usage" has each token class (a.b: member b of member a) */
    const char *usage[NTOK];
    /* its input count leaves out cache reads and writes (Anthropic's) */
    int in_adds_cache;
    const char *max_out[2];      /* the body's limit on output tokens, for the worst case */
    /* in a stream event, the member that holds "usage" (or the event itself) */
    const char *event_usage;
    /* ... and that usage is the final count (else a later event's is) */
    int event_usage_final;
    int cut;
    /* its answers name a response a follow-up may continue (section 15) */
    int pins;
    int free;                    /* costs nothing: no budget, no spend event (count_tokens) */
};

/* Where each API's usage object keeps each token class, in tok_names' order. */
/* chat's, completions', embeddings' */
#define USAGE_PROMPT                                                                     \
    .usage = {"prompt_tokens", "prompt_tokens_details.cached_tokens", NULL, NULL,        \
              "completion_tokens", "completion_tokens_details.reasoning_tokens"}
/* the Responses API's */
#define USAGE_IO                                                                         \
    .usage = {"input_tokens", "input_tokens_details.cached_tokens", NULL, NULL,          \
              "output_tokens", "output_tokens_details.reasoning_tokens"}
/* Anthropic's, whose input_tokens leaves the cached ones out */
#define USAGE_ANTHROPIC                                                                  \
    .usage = {"input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens",  \
              "cache_creation.ephemeral_1h_input_tokens", "output_tokens", NULL},         \
    .in_adds_cache = 1

static const wire_kind WIRE[] = {
    {"/v1/chat/completions", "/chat/completions", "chat", EP_CHAT, XL_CHAT, API_OPENAI,
     .stream = 1, .ask_usage = 1, USAGE_PROMPT, .max_out = {"max_tokens", "max_completion_tokens"},
     .cut = CUT_DATA},
    {"/v1/completions", "/completions", "completions", EP_COMPLETIONS, XL_NONE, API_OPENAI,
     .stream = 1, .ask_usage = 1, USAGE_PROMPT, .max_out = {"max_tokens"}, .cut = CUT_DATA},
    {"/v1/embeddings", "/embeddings", "embeddings", EP_EMBEDDINGS, XL_NONE, API_OPENAI,
     USAGE_PROMPT, .cut = CUT_DATA},
    {"/v1/responses", "/responses", "responses", EP_RESPONSES, XL_RESPONSES, API_OPENAI,
     .stream = 1, USAGE_IO, .max_out = {"max_output_tokens"}, .event_usage = "response",
     .event_usage_final = 1, .cut = CUT_EVENT, .pins = 1},
    {"/v1/messages", "/messages", "messages", EP_MESSAGES, XL_MESSAGES, API_ANTHROPIC, .stream = 1,
     USAGE_ANTHROPIC, .max_out = {"max_tokens"}, .event_usage = "message", .cut = CUT_ANTHROPIC},
    {"/v1/messages/count_tokens", "/messages/count_tokens", "count_tokens", EP_COUNT_TOKENS,
     XL_NONE, API_ANTHROPIC, USAGE_ANTHROPIC, .cut = CUT_ANTHROPIC, .free = 1},
};

/* The row a translated request is sent as: chat's or Messages'. */
static const wire_kind *wire_of(xl_api xl) { return &WIRE[xl == XL_MESSAGES ? 4 : 0]; }

/* Does m's provider serve kind's endpoint (the request is then sent as it is)? */
static int model_native(const model *m, const wire_kind *kind) {
    return m->endpoints >> kind->ep & 1;
}

/* The API translation speaks for a model's provider: Messages, or chat where it serves chat
 * (XL_NONE: neither). */
static xl_api model_xl(const model *m) {
    return m->api == API_ANTHROPIC ? XL_MESSAGES : m->endpoints >> EP_CHAT & 1 ? XL_CHAT : XL_NONE;
}

/* Why a request of `kind` cannot reach m at all: m's provider does not serve it, and ltg does
 * not translate it to what the provider serves. */
static void model_unreachable(char out[100], const wire_kind *kind, const model *m) {
    char eps[80] = "", msg[300];
    for (int k = 0; k <= EP_COUNT_TOKENS; k++)
        if (m->endpoints >> k & 1)
            snprintf(eps + strlen(eps), sizeof eps - strlen(eps), "%s%s", eps[0] ? ", " : "",
                     ep_names[k]);
    snprintf(msg, sizeof msg, "%s's provider serves %s, not %s, and ltg does not translate %s to "
             "those", m->alias, eps, kind->name, kind->name);
    snprintf(out, 100, "%.99s", msg); /* the attempt log's room */
}

/* The value of member path `path` ("a" or "a.b") of object token obj. */
static int json_path(const char *s, const json_tok *t, int obj, const char *path) {
    const char *dot = strchr(path, '.');
    if (!dot) return json_get(s, t, obj, path);
    char first[64];
    size_t n = (size_t)(dot - path) < sizeof first ? (size_t)(dot - path) : sizeof first - 1;
    memcpy(first, path, n);
    first[n] = 0;
    return json_get(s, t, json_get(s, t, obj, first), dot + 1);
}

/* Read a provider's JSON answer or stream event s[0..n) of kind k: its
 * usage is the member "usage", or inside member `in` when there is one
 * (a Responses event's "response", an Anthropic message_start's
 * "message"). Returns LTG_ERR when it is not JSON; else 1 when it has a
 * usage object (2 when inside `in`) -- each count present updates u (a
 * message_delta may tell the output alone); one that is not a whole
 * number from 0 to MAX_USAGE_TOKENS sets u->bad -- and 0 when not.
 * *no_choices: it has no "choices", or an empty one (a stream's usage-only
 * chunk). An event or a small answer is parsed once, down to the counts
 * (at most 128 values); past that one level is stored at a time, then the
 * next object is parsed on its own: an answer's size does not matter, be
 * it a thousand embeddings. */
static int usage_read(const wire_kind *k, const char *in, const char *s, size_t n, usage_counts *uc,
                      int *no_choices) {
    json_tok t[128];
    json_result res;
    *no_choices = 1;
    /* an event or a small answer: one parse down to the counts (in, usage, a class's object,
     * its count); else one level at a time */
    int whole = json_parse(s, n, t, 128, 4, &res) == 0, root = 0;
    if (!whole && json_parse(s, n, t, 128, 1, &res) < 0) /* not JSON, or too many members */
        return json_parse(s, n, t, 1, 0, &res) < 0 ? LTG_ERR : 0;
    int ch = json_get(s, t, 0, "choices");
    *no_choices = ch < 0 || (t[ch].type == JSON_ARRAY && t[ch].size == 0);
    int outer = in ? json_get(s, t, 0, in) : -1,
        inside = outer >= 0 && t[outer].type == JSON_OBJECT;
    if (inside && whole) {
        root = outer;
    } else if (inside) {
        s += t[outer].start;
        n = t[outer].end - t[outer].start;
        if (json_parse(s, n, t, 128, 1, &res) < 0) return 0;
    }
    int u = json_get(s, t, root, "usage");
    if (u < 0 || t[u].type != JSON_OBJECT) return 0;
    uc->seen = 1;
    if (!whole) {
        s += t[u].start;
        n = t[u].end - t[u].start;
        u = 0;
        /* a usage no provider sends */
        if (json_parse(s, n, t, 128, 2, &res) < 0) { uc->bad = 1; return inside ? 2 : 1; }
    }
    for (int c = 0; c < NTOK; c++) {
        long long v;
        int i = k->usage[c] ? json_path(s, t, u, k->usage[c]) : -1;
        if (i < 0 || t[i].type == JSON_NULL) continue;
        if (json_int(s, t, i, &v) < 0 || v < 0 || v > MAX_USAGE_TOKENS) uc->bad = 1;
        else uc->raw[c] = v;
    }
    return inside ? 2 : 1;
}

/* The token classes of counts uc of kind k (README "Cost"): LTG_ERR when
 * they cannot all be true -- a part larger than its whole. */
static int usage_classes(const wire_kind *k, const usage_counts *uc, long long t[NTOK]) {
    memcpy(t, uc->raw, sizeof uc->raw);
    if (k->in_adds_cache) t[TOK_IN] += t[TOK_CACHE_READ] + t[TOK_CACHE_WRITE];
    /* a provider that counts reasoning apart: output all the same */
    if (t[TOK_REASONING] > t[TOK_OUT]) t[TOK_OUT] += t[TOK_REASONING];
    if (uc->bad || t[TOK_CACHE_READ] + t[TOK_CACHE_WRITE] > t[TOK_IN] ||
        t[TOK_CACHE_WRITE_1H] > t[TOK_CACHE_WRITE])
        return LTG_ERR;
    return 0;
}

/* How a stream's body asks for its usage chunk: an edit (text NULL when the
 * client asked for it already; *hide then 0). LTG_ERR with *why when
 * stream_options is not an object. */
static int usage_edit(const char *body, const json_tok *t, int so, body_edit *e, int *hide,
                      const char **why) {
    *hide = 1;
    if (so < 0) {
        *e = (body_edit){t[0].end - 1, t[0].end - 1,
                         xstrdup(",\"stream_options\":{\"include_usage\":true}")};
        return 0;
    }
    if (t[so].type == JSON_NULL) {
        *e = (body_edit){t[so].start, t[so].end, xstrdup("{\"include_usage\":true}")};
        return 0;
    }
    json_tok st[64];
    json_result res;
    const char *o = body + t[so].start;
    if (t[so].type != JSON_OBJECT || json_parse(o, t[so].end - t[so].start, st, 64, 1, &res) < 0) {
        *why = "\"stream_options\" must be an object, e.g. {\"include_usage\": true}";
        return LTG_ERR;
    }
    int iu = json_get(o, st, 0, "include_usage");
    if (iu >= 0 && st[iu].type == JSON_TRUE) {
        *e = (body_edit){0, 0, NULL};
        *hide = 0;
        return 0;
    }
    int q = iu >= 0 && st[iu].type == JSON_STRING; /* a string's token excludes its quotes */
    /* ltg meters every stream */
    if (iu >= 0)
        *e = (body_edit){t[so].start + st[iu].start - q, t[so].start + st[iu].end + q,
                         xstrdup("true")};
    else
        *e = (body_edit){
                t[so].start + 1, t[so].start + 1,
                xstrdup(st[0].size ? "\"include_usage\":true," : "\"include_usage\":true")};
    return 0;
}

/* The provider's next key in turn that is not resting (all are: the next
 * anyway); -1 when it has none. */
static int provider_key(provider *p) {
    for (int i = 0; i < p->nkeys; i++) {
        int k = (p->next_key + i) % p->nkeys;
        if (p->key_bad_until[k] <= S.now) { p->next_key = (k + 1) % p->nkeys; return k; }
    }
    if (!p->nkeys) return -1;
    int k = p->next_key;
    p->next_key = (k + 1) % p->nkeys;
    return k;
}

/* Build the request for the current model: the client's body with its
 * rewrites ("model" to the provider's name for it, and a stream's usage
 * request), and the provider's key. */
static void exchange_build(exchange *x) {
    deployment *d = exchange_dep(x);
    provider *p = d->p;
    buf name = {0};
    jwriter w;
    jw_init(&w, &name);
    jw_cstr(&w, d->upstream);
    x->edit[0].text = name.p; /* edit 0 is always "model" */
    int xl = x->up != x->kind; /* translated: the body is xbody, model and all */
    size_t len = xl ? x->xbody.len : x->body.len;
    for (int i = 0; !xl && i < x->nedit; i++)
        len += strlen(x->edit[i].text) - (x->edit[i].end - x->edit[i].at);
    x->req.len = 0;
    buf_printf(&x->req,
               "POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: "
               "application/json\r\nContent-Length: %zu\r\n"
               "Accept: %s\r\nAccept-Encoding: identity\r\nUser-Agent: ltg/0.1\r\n",
               p->base_path, x->up->upstream, p->hostport, len,
               x->stream ? "text/event-stream" : "application/json");
    x->key = provider_key(p);
    const char *key = x->key >= 0 ? p->keys[x->key] : NULL;
    if (p->api == API_ANTHROPIC) {
        if (key) buf_cat(&x->req, "x-api-key: ", key, "\r\n", NULL);
        buf_cat(&x->req, "anthropic-version: ",
                x->anthropic_version[0] ? x->anthropic_version : "2023-06-01", "\r\n", NULL);
        if (x->anthropic_beta[0])
            buf_cat(&x->req, "anthropic-beta: ", x->anthropic_beta, "\r\n", NULL);
    } else if (key) buf_cat(&x->req, "Authorization: Bearer ", key, "\r\n", NULL);
    hex_encode((const uint8_t *)(uint64_t[]){rng_next()}, 8, x->span); /* a span per attempt */
    buf_cat(&x->req, "traceparent: 00-", x->trace_id, "-", x->span, "-", x->trace_flags, "\r\n",
            NULL);
    if (x->tracestate[0]) buf_cat(&x->req, "tracestate: ", x->tracestate, "\r\n", NULL);
    buf_puts(&x->req, "\r\n");
    uint32_t at = 0; /* the body with its edits, straight into the request: no copy between */
    if (xl) buf_append(&x->req, x->xbody.p, x->xbody.len);
    for (int i = 0; !xl && i < x->nedit; i++) {
        buf_append(&x->req, x->body.p + at, x->edit[i].at - at);
        buf_puts(&x->req, x->edit[i].text);
        at = x->edit[i].end;
    }
    if (!xl) buf_append(&x->req, x->body.p + at, x->body.len - at);
    x->edit[0].text = NULL;
    buf_free(&name);
}

/* A Responses API answer (or, in a stream, the event whose "response"
 * names it) gives the response's id: pinned to the model that made it. */
static void response_pin(exchange *x, const char *s, size_t n, int event) {
    json_tok t[128];
    json_result res;
    if (!x->kind->pins || x->pinned || json_parse(s, n, t, 128, 1, &res) < 0) return;
    if (event) {
        int r = json_get(s, t, 0, "response");
        if (r < 0 || t[r].type != JSON_OBJECT) return;
        s += t[r].start;
        n = t[r].end - t[r].start;
        if (json_parse(s, n, t, 128, 1, &res) < 0) return;
    }
    int id = json_get(s, t, 0, "id");
    if (id < 0 || t[id].type != JSON_STRING) return;
    buf v = {0};
    json_unescape(s, t, id, &v);
    pin_put(x->group_id, v.p, v.len, exchange_model(x)->alias, exchange_dep(x)->name);
    x->pinned = 1;
    /* its usage follows: exchange_settle */
    snprintf(x->pin_id, sizeof x->pin_id, "%s", v.len < sizeof x->pin_id ? v.p : "");
    buf_free(&v);
}

/* Take one SSE event of a stream: its usage, if any, is noted in the
 * exchange, a Responses answer's id pinned to its model. Returns LTG_ERR
 * when its data is neither JSON nor [DONE]; SSE_EMPTY when it has none (a
 * comment, a keep-alive); SSE_HIDE for the usage chunk ltg asked for on
 * its own (kept from the client); else SSE_RELAY. */
enum { SSE_RELAY, SSE_EMPTY, SSE_HIDE };

/* Is this event (its data in `data`) the last word of its stream -- chat's and completions'
 * [DONE], Anthropic's message_stop, a Responses stream's response.completed, .incomplete or
 * .failed -- after which a client has the whole answer? The event's name is its `event:` line
 * or, without one, its data's "type". */
static int stream_last(const char *ev, size_t n, const buf *data) {
    static const char *const last[] = {"message_stop", "response.completed",
                                       "response.incomplete", "response.failed"};
    if (data->len == 6 && memcmp(data->p, "[DONE]", 6) == 0) return 1;
    const char *name = NULL;
    size_t len = 0;
    if (n > 6 && memcmp(ev, "event:", 6) == 0) {
        name = ev + 6 + (ev[6] == ' ');
        len = strcspn(name, "\r\n");
    } else if (data->len > 10 && memcmp(data->p, "{\"type\":\"", 9) == 0) {
        name = data->p + 9;
        const char *q = memchr(name, '"', data->len - 9);
        len = q ? (size_t)(q - name) : 0;
    }
    for (size_t i = 0; name && i < sizeof last / sizeof last[0]; i++)
        if (len == strlen(last[i]) && memcmp(name, last[i], len) == 0) return 1;
    return 0;
}

static int stream_take(exchange *x, const char *ev, size_t n) {
    buf *data = &x->event;
    if (!sse_event_data(ev, n, data) || !data->len) return SSE_EMPTY;
    if (x->up == x->kind) x->whole |= stream_last(ev, n, data); /* translated: xl_feed says */
    if (data->len == 6 && memcmp(data->p, "[DONE]", 6) == 0) return SSE_RELAY;
    if (x->up == x->kind) response_pin(x, data->p, data->len, 1);
    int no_choices, r = usage_read(x->up, x->up->event_usage, data->p, data->len, &x->usage,
                                   &no_choices);
    if (r <= 0) return r < 0 ? LTG_ERR : SSE_RELAY;
    /* message_start's count is not the last word */
    x->usage.final |= r == 1 || x->up->event_usage_final;
    return x->hide_usage && no_choices ? SSE_HIDE : SSE_RELAY;
}

/* The SSE event that ends a stream broken after its start, so a client
 * can tell a cut answer from a whole one. */
static void stream_cut(exchange *x, const char *msg, buf *out) {
    buf b = {0};
    jwriter w;
    jw_init(&w, &b);
    if (x->kind->cut == CUT_ANTHROPIC) {
        /* Anthropic's error shape (api_error), as its answers have it */
        error_open(&w, 500, 1, msg, NULL, NULL);
        jw_close(&w, '}');
    } else if (x->kind->cut == CUT_EVENT) {
        jw_open(&w, '{');
        jw_key(&w, "type"), jw_lit(&w, "error");
        jw_key(&w, "code"), jw_lit(&w, "stream_interrupted");
        jw_key(&w, "message"), jw_cstr(&w, msg);
    } else {
        jw_open(&w, '{');
        jw_key(&w, "error"), jw_open(&w, '{');
        jw_key(&w, "message"), jw_cstr(&w, msg);
        jw_key(&w, "type"), jw_lit(&w, "upstream_error");
        jw_key(&w, "code"), jw_lit(&w, "stream_interrupted");
        jw_close(&w, '}');
    }
    jw_close(&w, '}');
    buf_printf(out, "%sdata: %s\n\n", x->kind->cut != CUT_DATA ? "event: error\n" : "", b.p);
    buf_free(&b);
}

static void x_send(exchange *x, const void *p, size_t n) {
    if (x->c) conn_send(x->c, p, n);
}

static void x_head(exchange *x, int status, const char *ctype, long long length,
                   const char *extra) {
    if (x->c) conn_head(x->c, status, ctype, length, extra);
}

/* The request no longer counts among its group's requests in flight
 * (max_parallel): its client has its answer, or left. Once. */
static void exchange_leave(exchange *x) {
    if (x->ended) return;
    x->ended = 1;
    group *g = group_find(x->group_id);
    if (g) g->inflight--;
}

/* Section 21's, for an exchange held in the shared store (--cluster). */
static int cl_hold(exchange *x, int first);
static void cl_refuse_first(exchange *x, tkey *k, group *g, const hold_refusal *why,
                            int64_t cost, double left);
static void cl_forget(exchange *x);

/* x's record of its Idempotency-Key goes: from the table when no answer is
 * kept (a retry runs afresh). With --cluster it was never in the table
 * (the store holds the claim; the answer comes back with the event). */
static void exchange_idem_free(exchange *x) {
    if (x->idem && cl_on()) idem_free(x->idem);
    else if (x->idem && !x->idem->done) idem_drop(x->idem);
    x->idem = NULL;
}

static void exchange_free(exchange *x) {
    exchange_leave(x);
    cl_forget(x);
    if (x->probe) breaker_forget_probe(exchange_dep(x));
    S.ndetached -= x->detached;
    exchange_idem_free(x);
    timer_stop(&x->deadline);
    timer_stop(&x->t);
    exchange_let_go(x);
    for (int i = 0; i < x->nedit; i++) free(x->edit[i].text);
    buf_free(&x->req);
    buf_free(&x->body);
    buf_free(&x->record);
    buf_free(&x->keep);
    buf_free(&x->event);
    buf_free(&x->xbody);
    free(x->pre);
    buf_free(&x->xanswer);
    xl_stream_free(x->xs);
    catalog_release(x->cat);
    S.nexchanges--;
    free(x);
}

/* The request is over for its client, whose connection (if it is still
 * there) goes on to its next request. The exchange is freed once its
 * spend event is written: now, or when the last of its metered attempts
 * is billed (meter_end). */
static void exchange_end(exchange *x) {
    conn *c = x->c;
    x->c = NULL;
    if (c) c->owner = NULL;
    if (x->metering) {
        /* what it holds but its meters goes now: the answer's connection, its group's slot, its
         * timers */
        exchange_leave(x);
        exchange_let_go(x);
        timer_stop(&x->deadline);
        timer_stop(&x->t);
    } else {
        exchange_free(x);
    }
    if (c) conn_done(c);
}

/* The x-ltg headers every inference answer carries (README "Retries and fallback"). */
static void exchange_headers(exchange *x, int status, buf *h) {
    buf_cat(h, "x-ltg-request-id: ", x->rid, "\r\nX-Request-ID: ", x->rid, "\r\n", NULL);
    buf_puts(h, "x-ltg-attempts: ");
    buf_uint(h, (unsigned)x->attempts);
    buf_puts(h, "\r\n");
    if (status >= 200 && status < 300)
        buf_cat(h, "x-ltg-served-model: ", exchange_model(x)->alias, "\r\n", NULL);
    if (status >= 200 && status < 300 && x->up != x->kind && x->dropped[0])
        buf_cat(h, "x-ltg-dropped: ", x->dropped, "\r\n", NULL);
    if (x->cache_mode == CACHE_MISS) buf_puts(h, "x-ltg-cache: miss\r\n");
    if (x->cache_mode == CACHE_BYPASS) buf_puts(h, "x-ltg-cache: bypass\r\n");
    if (x->cache_mode == CACHE_HIT) buf_puts(h, "x-ltg-cache: hit\r\n");
}

/* What a non-streaming answer cost, and what the group has left (README "Budgets that cannot
 * be overspent"). */
static void exchange_cost_headers(exchange *x, int64_t cost, buf *h) {
    buf_puts(h, "x-ltg-cost: ");
    buf_usd(h, cost > 0 ? cost : 0);
    group *g = group_find(x->group_id);
    int64_t left = g ? budget_left(&g->s.al, wall_ms()) : -1;
    if (left >= 0) {
        buf_puts(h, "\r\nx-ltg-budget-remaining: ");
        buf_usd(h, left);
    }
    buf_puts(h, "\r\n");
}

/* The token classes of tok, as members of the object being written. */
static void tokens_json(jwriter *w, const long long tok[NTOK]) {
    for (int k = 0; k < NTOK; k++) {
        jw_name(w, tok_names[k]), jw_int(w, tok[k]);
    }
}

/* The attempt log as JSON (the shape of the ledger's attempt_log). An
 * attempt still metered (only in a live error answer) has no cost yet. */
static void exchange_attempts_json(exchange *x, jwriter *w) {
    jw_open(w, '[');
    for (int i = 0; i < x->nlog; i++) {
        attempt_entry *e = &x->log[i];
        jw_open(w, '{');
        jw_key(w, "model"), jw_cstr(w, x->chain[e->model]->alias);
        jw_key(w, "deployment");
        jw_cstr(w, e->dep >= 0 ? x->chain[e->model]->dep[e->dep].name : NULL);
        jw_key(w, "attempt"), jw_int(w, e->attempt);
        jw_key(w, "status"), jw_int(w, e->status);
        jw_key(w, "outcome"), jw_cstr(w, outcome_name(e->outcome));
        jw_key(w, "ms"), jw_int(w, e->ms);
        jw_key(w, "span_id"), jw_str_or_null(w, e->span);
        jw_key(w, "api"), jw_cstr(w, e->up ? e->up->name : NULL);
        if (e->error[0]) {
            jw_key(w, "error"), jw_cstr(w, e->error);
        }
        if (e->billed) {
            tokens_json(w, e->tok);
            jw_key(w, "cost"), jw_usd(w, e->cost);
            jw_key(w, "usage_status"), jw_cstr(w, e->estimated ? "estimated" : "reported");
        }
        jw_close(w, '}');
    }
    jw_close(w, ']');
}

/* Log the current attempt (`at`: its place in the plan): its upstream status
 * (0 when none came), its outcome, and why it failed (NULL for a success). A skipped model's
 * entry costs nothing; an attempt's is billed when it is over. */
static void attempt_log(exchange *x, const attempt_plan *at, int status, attempt_outcome o,
                        const char *why) {
    metric_add(M_ATTEMPTS, 1, "model", x->chain[at->model]->alias, "outcome", outcome_name(o),
               NULL);
    assert(x->nlog < MAX_ATTEMPT_LOG); /* at most max_attempts (5) entries per model of the chain */
    int skipped = o == OUTCOME_CIRCUIT_OPEN || o == OUTCOME_UNTRANSLATABLE;
    int ms = skipped ? 0 : (int)(S.now - x->attempt_started);
    attempt_entry *e = &x->log[x->nlog++];
    *e = (attempt_entry){at->model,
                         skipped ? -1 : x->dep,
                         at->attempt,
                         status,
                         o,
                         ms,
                         "",
                         x->w,
                         {0},
                         0,
                         0,
                         skipped,
                         0,
                         "",
                         skipped ? NULL : x->up};
    if (!skipped) memcpy(e->span, x->span, sizeof e->span);
    if (why) snprintf(e->error, sizeof e->error, "%.99s", why);
}

/* Send one piece of the stream as an HTTP chunk (and keep it for a replay). */
static void exchange_chunk(exchange *x, const char *p, size_t n) {
    char size[32];
    int k = snprintf(size, sizeof size, "%zx\r\n", n);
    x_send(x, size, (size_t)k);
    x_send(x, p, n);
    x_send(x, "\r\n", 2);
    x->relayed += n;
    if (x->idem && x->record.len + n <= REPLAY_MAX_BYTES) buf_append(&x->record, p, n);
    else if (x->idem) x->record_full = 1;
}

static int up_is_stream(const upstream *u);

/* ---- what an attempt is charged (README "Cost") ----
 *
 * Every attempt is billed once, when it is over: with the usage its
 * provider reported, at the prices of the model it ran on; with nothing
 * when no byte of it reached the provider or the provider refused it with
 * an error status; otherwise with ltg's estimate, marked so -- the input
 * part of the attempt's worst case, plus for a stream the output relayed
 * (a token for every 3 bytes, at most the worst case's output), or for a
 * whole answer the whole worst case. A stream cut after Anthropic's
 * message_start has that event's input counts, and the output estimated.
 * A whole answer the request gave up on is first read to its end without
 * a client (meter_start), so that the provider's own count bills it. */
static void attempt_price(exchange *x, attempt_entry *e, const upstream *u, const usage_counts *uc,
                          size_t relayed) {
    model *m = x->chain[e->model];
    int reached = u && (u->wrote > 0 || up_has_head(u)),
        status = u && up_has_head(u) ? u->resp.status : 0;
    int whole = !x->stream || (u && up_has_head(u) && !up_is_stream(u));
    long long t[NTOK] = {0}, out_est = whole ? e->w.out : (long long)(relayed / 3);
    if (out_est > e->w.out) out_est = e->w.out;
    const wire_kind *k = e->up ? e->up : x->kind; /* the provider's API counts its usage */
    if (k->free || !reached || status >= 300) return; /* nothing a provider bills */
    int ok = uc->seen && usage_classes(k, uc, t) == 0;
    if (uc->seen && !ok)
        ltg_log("providers.%s: %s reported a usage that cannot be true (a count not a whole number "
                "from 0 to %d, or a part larger than its whole): charged ltg's estimate",
                m->dep[e->dep].p->name, m->alias, MAX_USAGE_TOKENS);
    if (ok && !uc->final && !whole && t[TOK_OUT] < out_est) {
        /* a cut stream's first count */
        t[TOK_OUT] = out_est;
        e->estimated = 1;
    }
    if (ok) {
        memcpy(e->tok, t, sizeof t);
        e->cost = tokens_cost(m, t);
    } else {
        e->estimated = 1;
        e->tok[TOK_IN] = e->w.in;
        e->tok[TOK_OUT] = out_est;
        e->cost = whole ? e->w.cost : e->w.in_cost + (out_est * e->w.out_price + 999999) / 1000000;
        /* two roundings up: never past what was held */
        if (e->cost > e->w.cost) e->cost = e->w.cost;
    }
}

/* The allowances the request answers to, by id: its key's and its group's
 * (NULL for one deleted meanwhile). */
static void exchange_allowances(const exchange *x, allowance *al[2]) {
    tkey *k = tkey_find(x->key_id);
    group *g = group_find(x->group_id);
    al[0] = k ? &k->s.al : NULL;
    al[1] = g ? &g->s.al : NULL;
}

/* Bill attempt e (attempt_price), once: what its worst case held beyond
 * that is let go at once (hold_shrink), so a later attempt is admitted
 * against what was really spent. */

static void attempt_bill(exchange *x, attempt_entry *e, const upstream *u, const usage_counts *uc,
                         size_t relayed) {
    model *m = x->chain[e->model];
    allowance *al[2];
    attempt_price(x, e, u, uc, relayed);
    e->billed = 1;
    exchange_allowances(x, al);
    hold_shrink(al, 2, &x->hold, e->w.cost - e->cost,
                e->w.in + e->w.out - e->tok[TOK_IN] - e->tok[TOK_OUT]);
    if (!e->estimated && e->cost > e->w.cost) {
        ltg_log("%s: the provider reported more than ltg held for the attempt (%lld input, %lld "
                "output tokens, %.6f USD held): "
                "its context_window, max_output_tokens or max_input_part_tokens may be wrong",
                m->alias, e->tok[TOK_IN], e->tok[TOK_OUT], (double)e->w.cost / MICRO);
        metric_add(M_HOLD_EXCEEDED, 1, "model", m->alias, NULL);
    }
}

/* The request's figures: the sums of its attempts' (a cache hit's: its
 * answer's tokens, at no cost). Returns the cost; *estimated when an
 * attempt's was ltg's estimate. */
static int64_t exchange_sum(const exchange *x, long long tok[NTOK], int *estimated) {
    int64_t cost = 0;
    *estimated = 0;
    memcpy(tok, x->cache_tok, sizeof x->cache_tok);
    for (int i = 0; i < x->nlog; i++) {
        const attempt_entry *e = &x->log[i];
        if (!e->billed) continue;
        for (int k = 0; k < NTOK; k++) tok[k] += e->tok[k];
        cost += e->cost;
        *estimated |= e->estimated;
    }
    return cost;
}

/* The spend event (README "The consumption ledger") into e: its figures
 * (tok, cost, estimated: the attempts' sums), made at `now`. */
static void exchange_event_json(exchange *x, const model *m, const long long tok[NTOK],
                                int64_t cost, int estimated, int64_t now, buf *e) {
    char id[37], ts[64];
    jwriter w;
    jw_init(&w, e);
    uuid_new(id);
    iso_time(now, ts);
    jw_open(&w, '{');
    jw_key(&w, "id"), jw_cstr(&w, id);
    jw_key(&w, "record_type"), jw_lit(&w, "spend_event");
    jw_key(&w, "request_id"), jw_cstr(&w, x->rid);
    jw_key(&w, "trace_id"), jw_str_or_null(&w, x->trace_id);
    jw_key(&w, "created_at"), jw_cstr(&w, ts);
    jw_key(&w, "endpoint"), jw_cstr(&w, x->kind->path);
    jw_key(&w, "client_api"), jw_cstr(&w, x->kind->name);
    jw_key(&w, "token_key_id"), jw_cstr(&w, x->key_id);
    jw_key(&w, "token_group_id"), jw_cstr(&w, x->group_id);
    jw_key(&w, "requested_model"), jw_cstr(&w, x->chain[0]->alias);
    jw_key(&w, "model"), jw_cstr(&w, m ? m->alias : NULL);
    jw_key(&w, "attempts"), jw_int(&w, x->attempts);
    jw_key(&w, "status"), jw_cstr(&w, ev_status_names[x->ev_status]);
    jw_key(&w, "http_status"), jw_int(&w, x->http_status);
    jw_key(&w, "cache_hit"), jw_bool(&w, x->cache_hit);
    tokens_json(&w, tok);
    jw_key(&w, "cost"), jw_usd(&w, cost);
    jw_key(&w, "usage_status"), jw_cstr(&w, estimated ? "estimated" : "reported");
    /* to the answer, not to the last meter */
    jw_key(&w, "latency_ms"), jw_int(&w, x->answered_at - x->started);
    jw_key(&w, "attempt_log");
    exchange_attempts_json(x, &w);
    jw_close(&w, '}');
}

/* The metrics of a booked request: every attempt's tokens by class, and what its group spent. */
static void exchange_count(const exchange *x, const group *g, const model *m, int64_t cost) {
    for (int i = 0; i < x->nlog; i++)
        for (int c = 0; c < NTOK; c++) {
            static const char *const type[NTOK] = {
                "input", "cache_read", "cache_write", NULL, "output", "reasoning"
            };
            if (type[c] && x->log[i].tok[c])
                metric_add(M_TOKENS, (double)x->log[i].tok[c], "model",
                           x->chain[x->log[i].model]->alias, "type", type[c], NULL);
        }
    if (cost > 0 && g)
        metric_add(M_SPEND, (double)cost / MICRO, "token_group", g->s.name, "model",
                   m ? m->alias : x->chain[0]->alias, NULL);
}

/* The request's idempotency record has its answer: from model m (NULL: none), x's status, as a
 * stream or not, for 24 hours from now. */
static void idem_answered(idem *r, const exchange *x, const model *m, int64_t now) {
    r->done = 1;
    r->status = x->http_status;
    r->stream = x->state == X_RELAYING;
    r->expires = now + IDEM_TTL_MS;
    snprintf(r->served, sizeof r->served, "%s", m ? m->alias : "");
}

/* An idempotent request keeps a whole answer (a success, or the
 * provider's own refusal) in its event for its retries; a failure, or an
 * answer too large to keep, is not kept, so a retry tries afresh. A cached
 * answer is found again in the cache. */
static void exchange_keep(exchange *x, idem *r, model *m, const char *keep, size_t keep_len,
                          int64_t now, buf *replay) {
    if (x->cache_hit) { /* see idem.cached: no copy of a cached answer is kept */
        if (cl_on()) return; /* nor shared: the claim goes with the event, a retry runs again */
        idem_answered(r, x, m, now);
        r->status = 200;
        r->stream = 0; /* the cache's answer is replayed whole */
        r->cached = 1;
        memcpy(r->cache_key, x->cache_key, 32);
    } else if (keep && keep_len <= REPLAY_MAX_BYTES) {
        idem_answered(r, x, m, now);
        r->done = 0; /* until its event is written */
        inf_idem_json(replay, r, keep, keep_len);
    }
}

/* The request's replay record is in the ledger at [off, off + len) of day
 * (`written`): its answer is replayed from there from now on; not written,
 * a retry runs again. */
static void idem_recorded(idem *r, int written, int64_t now, int64_t day, uint64_t off,
                          uint32_t len) {
    r->done = written;
    r->keep = NULL;
    if (!written) return;
    r->expires = now + IDEM_TTL_MS;
    r->day = day;
    r->off = off;
    r->len = len;
}

/* The spend event is written (README "The consumption ledger") and the
 * hold replaced by what the request was charged: when it is settled and no
 * attempt of it is metered any more. `keep`: the answer its replay record
 * keeps, if any. */
static void exchange_book(exchange *x, const char *keep, size_t keep_len) {
    long long tok[NTOK];
    int estimated;
    int64_t cost = exchange_sum(x, tok, &estimated);
    model *m = x->served >= 0 ? x->chain[x->served] : NULL;
    group *g = group_find(x->group_id);
    allowance *al[2];
    /* the ledger never goes back in time */
    int64_t now = wall_ms() > LG.last_at ? wall_ms() : LG.last_at;
    int64_t used = x->cache_hit ? 0 : tok[TOK_IN] + tok[TOK_OUT];
    exchange_allowances(x, al);
    exchange_count(x, g, m, cost);
    if (x->kind->free) { /* counting tokens costs nothing and leaves no event */
        hold_settle(al, 2, &x->hold, cost, used, now, NULL);
        return;
    }
    buf e = {0};
    exchange_event_json(x, m, tok, cost, estimated, now, &e);
    buf replay = {0};
    idem *r = x->idem;
    if (r) exchange_keep(x, r, m, keep, keep_len, now, &replay);
    const char *model_name = m ? m->alias : x->chain[0]->alias;
    rec_view v = {.at = now,
                  .charged = cost,
                  .status = (uint8_t)x->ev_status,
                  .flags = (uint8_t)((x->cache_hit ? EVF_CACHE_HIT : 0) |
                                     (replay.len ? EVF_REPLAY : 0) |
                                     (estimated ? EVF_ESTIMATED : 0)),
                  .key = x->key_id,
                  .group = x->group_id,
                  .model = model_name,
                  .model_len = strlen(model_name),
                  .event = e.p,
                  .event_len = e.len,
                  .replay = replay.len ? replay.p : "",
                  .replay_len = replay.len};
    for (int c = 0; c < NTOK; c++) v.tok[c] = tok[c] > UINT32_MAX ? UINT32_MAX : (uint32_t)tok[c];
    int64_t day;
    uint64_t off;
    uint32_t len;
    if (cl_on()) { /* the event goes to the shared ledger, and comes back to this one from it */
        buf rec = {0};
        rec_encode(&rec, &v);
        if (rec.len > CL_MAX_EVENT && v.replay_len) { /* every reader must take it whole */
            v.replay = "", v.replay_len = 0, v.flags &= (uint8_t)~EVF_REPLAY;
            rec.len = 0;
            rec_encode(&rec, &v); /* the answer is not kept: a retry runs again */
        }
        hold_settle(al, 2, &x->hold, cost, used, now, &rec);
        buf_free(&rec);
        exchange_idem_free(x); /* its answer comes back with the event (cl_event) */
    } else {
        hold_settle(al, 2, &x->hold, cost, used, now, NULL);
        int written = ledger_add(&v, now, &day, &off, &len) == 0;
        if (r && replay.len) idem_recorded(r, written, now, day, off, len);
    }
    buf_free(&e);
    buf_free(&replay);
}

/* The request is answered (or cut, or left by its client): the attempt
 * that answered is billed, the access log learns the figures, and the
 * spend event is written -- now, or when its last metered attempt is
 * billed (meter_end). `served`: the chain index of the model that
 * answered, or -1. Returns the cost known now (metered attempts not yet
 * in it), micro-USD, for the answer's x-ltg-cost. */
static int64_t exchange_settle(exchange *x, int http_status, int ev_status, int served,
                               int cache_hit, const char *keep, size_t keep_len) {
    attempt_entry *e = x->nlog ? &x->log[x->nlog - 1] : NULL;
    if (e && !e->billed && !e->pending) attempt_bill(x, e, x->u, &x->usage, x->relayed);
    if (x->pin_id[0] && e && e->billed)
        pin_tokens(x->group_id, x->pin_id, e->tok[TOK_IN] + e->tok[TOK_OUT]);
    x->http_status = http_status;
    x->ev_status = ev_status;
    x->served = served;
    x->cache_hit = cache_hit;
    x->settled = 1;
    x->answered_at = S.now;
    long long tok[NTOK];
    int estimated;
    int64_t cost = exchange_sum(x, tok, &estimated);
    if (x->c) {
        req_facts *f = &x->c->f;
        snprintf(f->served, sizeof f->served, "%s", served >= 0 ? x->chain[served]->alias : "");
        f->attempts = x->attempts;
        f->cost = cost;
        f->estimated = estimated;
        memcpy(f->tok, tok, sizeof tok);
    }
    if (!x->metering) exchange_book(x, keep, keep_len);
    else if (keep && x->idem && keep_len <= REPLAY_MAX_BYTES) {
        /* a retry meanwhile is answered from memory */
        idem *r = x->idem;
        buf_append(&x->keep, keep, keep_len);
        x->keep_set = 1;
        idem_answered(r, x, served >= 0 ? x->chain[served] : NULL, wall_ms());
        r->keep = &x->keep;
    }
    return cost;
}

/* No answer to relay: an error in the endpoint's API shape whose attempts list
 * every attempt; or, once a stream has started, the SSE error event. */
static void exchange_fail(exchange *x, int status, const char *code, const char *msg) {
    buf b = {0}, h = {0};
    if (x->state == X_RELAYING) {
        exchange_settle(x, 200, EV_PARTIAL, x->plan.model, 0, NULL, 0);
        stream_cut(x, msg, &h);
        exchange_chunk(x, h.p, h.len);
        /* the chunked framing ends cleanly: the connection stays usable */
        x_send(x, "0\r\n\r\n", 5);
    } else {
        jwriter w;
        jw_init(&w, &b);
        /* a spent quota is no rate limit: nothing tells the client to try again */
        int quota = strcmp(code, "insufficient_quota") == 0, anthropic = x->kind->api == API_ANTHROPIC;
        if (x->last_xl && x->kind->xl == XL_MESSAGES && status == 503) status = 529;
        if (x->last_xl && x->kind->xl != XL_MESSAGES && status == 529) status = 503;
        if (quota && anthropic) status = 402;
        error_open(&w, status, anthropic, msg,
                   quota ? code : status == 504 ? "timeout_error" : "upstream_error", NULL);
        int64_t cost = exchange_settle(x, status, EV_FAILED, -1, 0, NULL, 0);
        jw_key(&w, "code"), jw_cstr(&w, code);
        jw_key(&w, "attempts");
        exchange_attempts_json(x, &w);
        jw_close(&w, '}'), jw_close(&w, '}');
        exchange_headers(x, status, &h);
        exchange_cost_headers(x, cost, &h);
        if ((status == 503 || status == 429) && !quota) buf_puts(&h, "Retry-After: 1\r\n");
        x_head(x, status, "application/json", (long long)b.len, h.p);
        x_send(x, b.p, b.len);
    }
    buf_free(&b);
    buf_free(&h);
    exchange_end(x);
}

/* A provider that quotes the key it was sent (an error message may) must
 * not pass it on to the client, the cache or the ledger: it is masked in
 * place, byte for byte, so lengths and JSON stay what they were. */
static void mask_provider_key(const provider *p, char *s, size_t n) {
    for (int i = 0; s && i < p->nkeys; i++) {
        size_t k = strlen(p->keys[i]);
        for (char *q = s; (q = memmem(q, n - (size_t)(q - s), p->keys[i], k)); q += k)
            memset(q, '*', k);
    }
}

/* Relay the provider's whole answer (a success, or a terminal error), with
 * what it cost. */
static void exchange_relay(exchange *x) {
    upstream *u = x->u;
    int status = u->resp.status, ok = status >= 200 && status < 300;
    mask_provider_key(exchange_dep(x)->p, u->body.p, u->body.len);
    size_t n;
    const char *ct = http_header_get(u->head.p, u->resp.h, u->resp.nh, "content-type", &n);
    char ctype[128];
    snprintf(ctype, sizeof ctype, "%.*s", ct ? (int)(n < 127 ? n : 127) : 16,
             ct ? ct : "application/json");
    const char *body = u->body.p ? u->body.p : "";
    size_t len = u->body.len;
    if (x->up != x->kind) { /* translated: the answer, or the provider's error, in the client's */
        if (!ok) status = xl_error(x->kind->xl, status, u->body.p, u->body.len, &x->xanswer);
        body = x->xanswer.p ? x->xanswer.p : "";
        len = x->xanswer.len;
        snprintf(ctype, sizeof ctype, "application/json");
    }
    if (ok && u->body.p) response_pin(x, body, len, 0); /* the minted id of a translated one */
    int64_t cost = exchange_settle(x, status, ok ? EV_SUCCEEDED : EV_FAILED,
                                   ok ? x->plan.model : -1, 0, body, len);
    const attempt_entry *e = &x->log[x->nlog - 1];
    if (ok && x->cache_mode == CACHE_MISS && status == 200 && !e->estimated) {
        group *g = group_find(x->group_id);
        if (g && g->cache_ttl > 0)
            cache_put(x->cache_key, body, len, exchange_model(x)->alias, e->tok,
                      g->cache_ttl * 1000);
    }
    buf h = {0};
    exchange_headers(x, status, &h);
    exchange_cost_headers(x, cost, &h);
    x_head(x, status, ctype, (long long)len, h.p);
    x_send(x, body, len);
    buf_free(&h);
    exchange_end(x);
}

static void exchange_upstream(void *owner);

/* The provider's usage so far as token classes (zeros when it cannot be true: the ledger then
 * bills ltg's estimate, attempt_price). */
static void exchange_classes(const exchange *x, long long t[NTOK]) {
    if (usage_classes(x->up, &x->usage, t) < 0) memset(t, 0, sizeof(long long) * NTOK);
}

/* A translated attempt's whole answer, in the client's API, into xanswer (section 17); NULL,
 * or why it cannot be. */
static const char *exchange_translate_answer(exchange *x) {
    long long t[NTOK];
    const char *why = NULL;
    upstream *u = x->u;
    exchange_classes(x, t);
    mask_provider_key(exchange_dep(x)->p, u->body.p, u->body.len);
    if (xl_answer(model_xl(exchange_model(x)), x->kind->xl, u->body.p ? u->body.p : "",
                  u->body.len, x->body.p, x->body.len, x->rid, t, &x->xanswer, &why) < 0)
        return why;
    return NULL;
}

/* How an attempt ended, as the exchange saw it. */
typedef struct {
    int status;           /* the upstream's HTTP status, 0 when none came */
    int reached;          /* a byte of the request was handed to the provider */
    const char *error;    /* why it failed otherwise than by its status (NULL: the status says) */
    int timeout;          /* the error is a timeout: as the last failure, 504 (else 502) */
    /* no call made: 1, every breaker of the model's deployments is open; 2, the request cannot
     * be translated to its API */
    int skipped;
} attempt_result;

/* Is the upstream's answer a stream (200, text/event-stream)? */
static int up_is_stream(const upstream *u) {
    size_t n;
    const char *ct = up_has_head(u)
                             ? http_header_get(u->head.p, u->resp.h, u->resp.nh, "content-type", &n)
                             : NULL;
    return u->resp.status == 200 && ct && n >= 17 &&
           ascii_casecmp_n(ct, 17, "text/event-stream") == 0;
}

/* The one place an exchange changes state: another attempt, a backoff,
 * or the stream's start -- and nothing after a stream has started. */
static void exchange_to(exchange *x, x_state to) {
    static const unsigned char next[] = {
        [X_ATTEMPTING] = 1 << X_ATTEMPTING | 1 << X_BACKOFF | 1 << X_RELAYING | 1 << X_HOLDING,
        [X_BACKOFF] = 1 << X_ATTEMPTING,
        [X_RELAYING] = 0,
        [X_HOLDING] = 1 << X_ATTEMPTING,
    };
    assert(next[x->state] >> to & 1);
    x->state = to;
}

/* PLAN_ANSWER: a whole answer is relayed (a success, or a terminal
 * refusal); a stream's first event starts the client's stream. */
static void exchange_answer(exchange *x) {
    if (x->u->resp.status / 100 == 2)
        metric_observe(M_TTFT, (double)(S.now - x->started) / 1000, "model",
                       exchange_model(x)->alias, NULL);
    if (!x->stream || !up_is_stream(x->u)) { exchange_relay(x); return; }
    buf h = {0};
    exchange_headers(x, 200, &h);
    buf_puts(&h, "Cache-Control: no-cache\r\n");
    x_head(x, 200, "text/event-stream", -1, h.p);
    buf_free(&h);
    exchange_to(x, X_RELAYING);
    /* from now on the deadline is the stream's limit */
    timer_set(&x->deadline, (int64_t)S.max_stream_s * 1000);
}

/* PLAN_GIVE_UP: the error, with every attempt. */
static void exchange_give_up(exchange *x, int late) {
    char msg[400];
    if (late) {
        snprintf(msg, sizeof msg, "no answer within the deadline of %lld ms; the last failure: %s",
                 x->deadline_ms, x->last_reason);
        exchange_fail(x, 504, "deadline_exceeded", msg);
    } else if (!x->attempts) {
        exchange_fail(x, 503, "circuit_open",
                      "every model of this request is failing (circuit breaker open): retry in a "
                      "few seconds");
    } else {
        snprintf(msg, sizeof msg, "every attempt failed; the last: %s", x->last_reason);
        exchange_fail(x, x->last_status, x->last_quota ? "insufficient_quota" : "upstream_error",
                      msg);
    }
}

/* A provider with several keys answered 401 or 403: may its next key be
 * tried (README "The catalog config": api_key_envs)? */
static int key_refused(exchange *x, const attempt_result *r) {
    if (r->error || r->skipped || (r->status != 401 && r->status != 403) || x->key < 0) return 0;
    return x->key_tries < exchange_dep(x)->p->nkeys - 1; /* not skipped: x->dep is a deployment */
}

/* ... it is: that key rests for KEY_REST_MS, and the attempt is made again
 * at once with the next one, not counted as an attempt. */
static void key_rest(exchange *x, int status) {
    provider *p = exchange_dep(x)->p;
    p->key_bad_until[x->key] = S.now + KEY_REST_MS;
    ltg_log("providers.%s: key %d (of 0..%d) answered %d: not used for %d s", p->name, x->key,
            p->nkeys - 1, status, KEY_REST_MS / 1000);
    char idx[16];
    snprintf(idx, sizeof idx, "%d", x->key);
    metric_add(M_KEY_FAILS, 1, "provider", p->name, "key", idx, NULL);
    x->key_tries++;
    x->attempts--;
    exchange_let_go(x);
}

/* ---- metering: an abandoned whole answer, read to its end ----
 *
 * A non-streaming attempt that the request gives up on after a byte of it
 * reached the provider (its timeout fired, the deadline passed, the client
 * left) may still be computed, and billed. Its connection is not closed:
 * a meter takes it over and reads the answer without relaying it, for at
 * most --meter-abandoned-seconds and METER_MAX_BODY bytes, and the attempt
 * is billed with the usage the answer reports (or, when none comes, its
 * estimate). The request's spend event waits for its last meter. At most
 * METER_MAX meters at a time: past that, one is closed and billed its
 * estimate -- the oldest of the group that holds the most (meter_victim),
 * so that one tenant's abandoned calls never cost another its meter. */
typedef struct meter {
    struct meter *prev, *next;  /* METERS, oldest first */
    exchange *x;
    int entry;                  /* its attempt, in x->log */
    upstream *u;
    timer t;                    /* --meter-abandoned-seconds */
} meter;

static struct {
    meter *head, *tail;
    int n;
} METERS;

/* The meter is done (the answer came, the connection failed, or its time
 * is up): its attempt is billed, and the request's event written when it
 * was the last. */
static void meter_end(meter *m) {
    exchange *x = m->x;
    upstream *u = m->u;
    attempt_entry *e = &x->log[m->entry];
    usage_counts uc = {0};
    int no_choices;
    if (u->state == UP_DONE && u->resp.status / 100 == 2)
        uc.final = usage_read(e->up ? e->up : x->kind, NULL, u->body.p ? u->body.p : "", u->body.len, &uc,
                              &no_choices) > 0;
    e->pending = 0;
    attempt_bill(x, e, u, &uc, 0);
    group *g = group_find(x->group_id);
    if (g && g->meters > 0) g->meters--;
    *(m->prev ? &m->prev->next : &METERS.head) = m->next;
    *(m->next ? &m->next->prev : &METERS.tail) = m->prev;
    METERS.n--;
    timer_stop(&m->t);
    up_release(u);
    free(m);
    if (--x->metering || !x->settled) return;
    exchange_book(x, x->keep_set ? (x->keep.p ? x->keep.p : "") : NULL, x->keep.len);
    if (x->ended) exchange_free(x);
}

static void meter_event(void *owner) {
    meter *m = owner;
    upstream *u = m->u;
    if (u->state == UP_FAILED || u->state == UP_DONE || u->body.len > METER_MAX_BODY) meter_end(m);
}

static void meter_timer(void *ctx) { meter_end(ctx); }

/* The meter closed when x needs one and all are taken: the oldest of the group holding the
 * most meters (a deleted group's first; x's own group on a tie). */
static meter *meter_victim(const exchange *x) {
    const group *own = group_find(x->group_id), *vg = NULL;
    meter *victim = NULL;
    int most = -1;
    for (meter *m = METERS.head; m; m = m->next) {
        const group *g = group_find(m->x->group_id);
        int n = g ? g->meters : INT_MAX;
        if (n > most || (n == most && g == own && vg != own)) most = n, victim = m, vg = g;
    }
    return victim;
}

/* The current attempt's connection, its answer still to come, goes to a
 * meter; the attempt is no longer the exchange's. */
static void meter_start(exchange *x, attempt_entry *e) {
    /* one is closed, billed its estimate */
    if (METERS.n >= S.max_meters && METERS.head) meter_end(meter_victim(x));
    group *g = group_find(x->group_id);
    if (g) g->meters++;
    meter *m = xcalloc(1, sizeof *m);
    m->x = x;
    m->entry = (int)(e - x->log);
    m->u = x->u;
    m->prev = METERS.tail;
    *(METERS.tail ? &METERS.tail->next : &METERS.head) = m;
    METERS.tail = m;
    METERS.n++;
    timer_init(&m->t, meter_timer, m);
    timer_set(&m->t, (int64_t)S.meter_s * 1000);
    x->metering++;
    e->pending = 1;
    x->u->owner = m;
    x->u->event = meter_event;
    up_pause(x->u, 0);
    x->u = NULL;
    x->busy->inflight--;
    x->busy = NULL;
}

/* Every meter, at exit: closed, and billed what is known. */
static void meters_close(void) {
    while (METERS.head) meter_end(METERS.head);
}

/* The current attempt is over and not the answer: billed now -- or, a
 * whole answer that may still come, metered -- and its connection let go. */
static void attempt_over(exchange *x) {
    attempt_entry *e = &x->log[x->nlog - 1];
    upstream *u = x->u;
    int refused = u && up_has_head(u) && u->resp.status >= 300,
        big = u && (u->body.len > METER_MAX_BODY || u->resp.content_length > METER_MAX_BODY);
    if (!e->billed && u && u->wrote > 0 && u->state != UP_DONE && u->state != UP_FAILED &&
        !refused && !big && !x->stream && !x->kind->free && S.meter_s > 0) {
        meter_start(x, e);
        return;
    }
    if (!e->billed) attempt_bill(x, e, u, &x->usage, x->relayed);
    exchange_let_go(x);
}

/* The next attempt's worst case does not fit: the request ends here, and
 * the answer says why. `a`: the allowance that refused (NULL: the attempt
 * may cost more than MAX_CHARGE); `wait`: a rate limit's seconds; `left`:
 * USD left in its budget. */
static void attempt_refused(exchange *x, const allowance *a, long wait, double left) {
    model *m = exchange_model(x);
    group *g = group_find(x->group_id);
    const char *whose = a && g && a == &g->s.al ? "this key's group" : "this key";
    char msg[400];
    if (a && wait)
        snprintf(msg, sizeof msg,
                 "the next attempt, on %s, may use up to %lld tokens, and %s allows %lld a minute: "
                 "the request ends here",
                 m->alias, x->w.in + x->w.out, whose, a->tpm_limit);
    else if (!a)
        snprintf(msg, sizeof msg,
                 "the next attempt, on %s, may cost more than %.0f USD (its output limit times the "
                 "answers asked for): the request ends here",
                 m->alias, MAX_CHARGE / MICRO);
    else
        snprintf(msg, sizeof msg,
                 "the next attempt, on %s, may cost up to %.6f USD, and the budget of %s has %.6f "
                 "USD left: the request ends here",
                 m->alias, (double)x->w.cost / MICRO, whose, left);
    exchange_fail(x,
                  !a     ? 400
                  : wait ? 429
                         : 403,
                  !a     ? "invalid_request"
                  : wait ? "rate_limited"
                         : "budget_exceeded",
                  msg);
}

#define CL_UNAVAILABLE                                                                             \
    "the shared store (Redis) cannot decide this request's budget or limits now: it goes no "      \
    "further; retry"

/* Before an attempt starts, its worst case joins the request's hold
 * (README "Cost"; the first attempt's was held at admission). 0, LTG_AGAIN
 * when the shared store decides (the exchange waits in X_HOLDING), or
 * LTG_ERR when it does not fit the key's or the group's budget or token
 * limit: the request ended there, and the answer says why. */
static int attempt_hold(exchange *x) {
    model *m = exchange_model(x);
    x->w = worst_case(&x->shape, m);
    if (x->kind->free || (x->attempts == 0 && x->plan.model == 0)) return 0;
    if (x->shared && x->w.cost <= MAX_CHARGE) {
        if (cl_hold(x, 0) == LTG_AGAIN) return LTG_AGAIN;
        exchange_fail(x, 503, "store_unavailable", CL_UNAVAILABLE);
        return LTG_ERR;
    }
    tkey *k = tkey_find(x->key_id);
    group *g = group_find(x->group_id);
    allowance *al[2];
    int n = 0;
    if (k) al[n++] = &k->s.al;
    if (g) al[n++] = &g->s.al;
    hold_refusal why = {0, "max_budget", 0};
    if (x->w.cost <= MAX_CHARGE &&
        hold_reserve(al, n, x->w.cost, x->w.in + x->w.out, wall_ms(), &x->hold, &why) == 0)
        return 0;
    const allowance *a = x->w.cost <= MAX_CHARGE ? al[why.who] : NULL;
    attempt_refused(x, a, why.wait, a ? budget_remaining(a, wall_ms()) : 0);
    return LTG_ERR;
}

/* An attempt ended: the one place where its result becomes an outcome
 * (but for a cut by its client: exchange_abort)
 * (README "Retries and fallback"), is logged and told to the breaker, and
 * the plan decides what comes next; the caller acts on the step. */
/* "answered 429", and what the provider said of it: "answered 429: Rate limit reached" (a
 * provider key it quotes masked: the attempt log is kept). 1 when it says its quota is spent. */
static int attempt_answered_why(int status, const upstream *u, const provider *p, char *why,
                                size_t cap) {
    buf msg = {0}, code = {0};
    if (u && status >= 300) provider_message(u->body.p, u->body.len, &msg, &code);
    if (p && msg.len) mask_provider_key(p, msg.p, msg.len);
    snprintf(why, cap, "answered %d%s%.*s", status, msg.len ? ": " : "", (int)msg.len,
             msg.len ? msg.p : "");
    int quota = provider_quota(&code);
    buf_free(&msg);
    buf_free(&code);
    return quota;
}

static plan_step attempt_decide(exchange *x, const attempt_result *r) {
    model *m = exchange_model(x);
    upstream *u = x->u;
    deployment *d = r->skipped ? NULL : exchange_dep(x);
    attempt_outcome o = r->skipped == 2 ? OUTCOME_UNTRANSLATABLE
                        : r->skipped ? OUTCOME_CIRCUIT_OPEN
                        : r->error ? attempt_classify(0, r->reached)
                                   : attempt_classify(r->status, 1);
    if (d && o == OUTCOME_NO_WORK) x->avoid |= 1u << x->dep;
    plan_facts f = {
        .outcome = o,
        .key_refused = key_refused(x, r),
        .retry_after_ms = -1,
        .now = S.now,
        .deadline = x->started + x->deadline_ms,
    };
    if (o == OUTCOME_NO_WORK) { /* what only a retry of the same model needs */
        size_t n;
        const char *v = u && up_has_head(u) ? http_header_get(u->head.p, u->resp.h, u->resp.nh,
                                                              "retry-after", &n)
                                            : NULL;
        f.other_deployment = x->pin < 0 && deployment_other(m, x->avoid, S.now);
        f.retry_after_ms = v ? retry_after_ms(v, n, (long long)(wall_ms() / 1000)) : -1;
        f.jitter_permille = (unsigned)(rng_next() % 201);
    }
    attempt_plan was = x->plan;
    plan_step s = plan_next(&x->plan, &f);
    timer_stop(&x->t);
    if (s.next_key) {
        key_rest(x, r->status);
        return s;
    }
    x->key_tries = 0;
    char why[200];
    int quota = 0;
    /* before the release: it may be u->err */
    if (r->error) snprintf(why, sizeof why, "%s", r->error);
    else if (u && attempt_context_length(r->status, u->body.p, u->body.len))
        snprintf(why, sizeof why, "context length exceeded (%d)", r->status);
    else quota = attempt_answered_why(r->status, u, d ? d->p : NULL, why, sizeof why);
    attempt_log(x, &was, r->status, o, o == OUTCOME_OK ? NULL : why);
    /* Told to the breaker: what ltg would have seen of the provider without this client. ltg's own
     * shortage says nothing of it, nor does a timeout the client set shorter than its group's (a
     * tenant must not open another tenant's breaker with x-ltg-request-timeout: 100). */
    if (d && ((u && u->local) || (r->timeout && x->shortened))) {
        if (x->probe) breaker_forget_probe(d);
    } else if (d) {
        breaker_record(d, o, x->probe, S.now);
    }
    x->probe = 0;
    if (s.action == PLAN_ANSWER) return s;
    if (!r->skipped) {
        x->last_xl = x->up != x->kind;
        x->last_status = r->error ? (r->timeout ? 504 : 502) : r->status;
        x->last_quota = quota && r->status == 429;
        snprintf(x->last_reason, sizeof x->last_reason, "%.60s: %.130s", m->alias, why);
    }
    attempt_over(x);
    return s;
}

enum { ATTEMPT_STARTED, ATTEMPT_REFUSED, ATTEMPT_SKIPPED, ATTEMPT_UNTRANSLATABLE };

/* The attempt's request in its provider's API (section 17): the client's own when the provider
 * speaks it; else translated for its model into xbody, what it drops named for x-ltg-dropped.
 * LTG_ERR when it cannot be carried: why is the model's entry in untranslatable. */
static int exchange_translate(exchange *x) {
    model *m = exchange_model(x);
    xl_verdict v;
    x->up = x->kind;
    xl_stream_free(x->xs); /* a translated attempt before this one leaves nothing behind */
    x->xs = NULL;
    x->dropped[0] = 0;
    if (model_native(m, x->kind)) return 0;
    char *why = x->untranslatable[x->plan.model];
    if (!xl_translates(x->kind->xl, model_xl(m))) {
        model_unreachable(why, x->kind, m);
        return LTG_ERR;
    }
    xl_target t = {exchange_dep(x)->upstream, m->max_output_tokens, m->reasoning};
    if (x->pre && x->pre_model == x->plan.model && strcmp(m->dep[0].upstream, t.upstream) == 0) {
        v = *x->pre; /* admission made it: the same body for the same target */
    } else {
        free(x->pre);
        x->pre = NULL; /* xbody is about to hold another */
        if (xl_request(x->kind->xl, model_xl(m), x->body.p, x->body.len, NULL, &t, &x->xbody,
                       &v) < 0) {
            snprintf(why, sizeof x->untranslatable[0], "%.99s", v.msg);
            return LTG_ERR;
        }
    }
    x->up = wire_of(model_xl(m));
    snprintf(x->dropped, sizeof x->dropped, "%s", v.dropped);
    metric_add(M_TRANSLATED, 1, "from", x->kind->name, "to", x->up->name, NULL);
    for (int i = 0; i < v.ndropped; i++) metric_add(M_XL_DROPPED, 1, "field", v.names[i], NULL);
    x->xs = x->stream ? xl_stream_new(model_xl(m), x->kind->xl, v.include_usage, x->shape.prompt,
                                      x->body.p, x->body.len)
                      : NULL;
    if (x->xs) memcpy(x->xs->rid, x->rid, sizeof x->xs->rid); /* a Responses answer's id */
    return 0;
}

static void exchange_attempt_held(exchange *x);
static void exchange_attempt_go(exchange *x);

/* Start the attempt the plan points at, on a deployment of its model
 * (section 11; the next key stays on the same one, a follow-up of a
 * Responses answer goes to the one that made it while its breaker lets
 * it). ATTEMPT_REFUSED: its worst case does not fit (the request ended);
 * ATTEMPT_SKIPPED: every breaker of the model is open, no call made. */
static int exchange_attempt(exchange *x, int next_key) {
    model *m = exchange_model(x);
    exchange_to(x, X_ATTEMPTING);
    if (x->avoid_model != x->plan.model) {
        x->avoid = 0;
        x->avoid_model = x->plan.model;
    }
    if (!next_key) {
        if (x->untranslatable[x->plan.model][0]) return ATTEMPT_UNTRANSLATABLE;
        int pinned = x->pin >= 0 && breaker_ready(&m->dep[x->pin], S.now);
        x->dep = pinned ? x->pin : deployment_pick(m, x->avoid, S.now);
        if (x->dep < 0) return ATTEMPT_SKIPPED;
        if (exchange_translate(x) < 0) return ATTEMPT_UNTRANSLATABLE;
        int held = attempt_hold(x);
        if (held == LTG_AGAIN) return ATTEMPT_STARTED; /* once the shared store says so */
        if (held < 0) return ATTEMPT_REFUSED;
        exchange_attempt_held(x);
        return ATTEMPT_STARTED;
    }
    exchange_attempt_go(x);
    return ATTEMPT_STARTED;
}

/* The attempt's worst case is held: its deployment's breaker lets it go. */
static void exchange_attempt_held(exchange *x) {
    breaker_allows(&exchange_model(x)->dep[x->dep], S.now, &x->probe);
    exchange_attempt_go(x);
}

/* The attempt goes out: built, timed, on a connection of its deployment. */
static void exchange_attempt_go(exchange *x) {
    assert(!x->u); /* the last attempt's connection went back in attempt_decide */
    x->usage = (usage_counts){0}; /* an earlier attempt's usage is not this one's */
    x->relayed = 0;
    exchange_build(x);
    x->attempts++;
    x->attempt_started = S.now;
    if (x->rp.request_timeout_ms > 0) timer_set(&x->t, x->rp.request_timeout_ms);
    x->busy = exchange_dep(x);
    x->busy->inflight++;
    x->u = S.up_open(x->busy->p, x, exchange_upstream, x->req.p, x->req.len);
    buf_free(&x->req); /* the connection has its own copy; the next attempt builds its own */
}

/* Act on the plan's step. An attempt to start now may find its model's
 * every breaker open: that is an attempt's end of its own (circuit_open),
 * decided here again -- a loop, never a recursion. */
static void exchange_step(exchange *x, plan_step s) {
    while (s.action == PLAN_RETRY_NOW || s.action == PLAN_NEXT_MODEL) {
        int a = exchange_attempt(x, s.next_key);
        if (a == ATTEMPT_STARTED || a == ATTEMPT_REFUSED) return;
        if (a == ATTEMPT_SKIPPED)
            s = attempt_decide(x, &(attempt_result){.error = "skipped: the circuit breaker is open",
                                                    .skipped = 1});
        else
            s = attempt_decide(x, &(attempt_result){.error = x->untranslatable[x->plan.model],
                                                    .skipped = 2});
    }
    if (s.action == PLAN_ANSWER) {
        exchange_answer(x);
    } else if (s.action == PLAN_RETRY_AFTER) {
        exchange_to(x, X_BACKOFF);
        timer_set(&x->t, s.delay_ms); /* exchange_timer starts the attempt when it fires */
    } else {
        exchange_give_up(x, s.late);
    }
}

static void attempt_end(exchange *x, const attempt_result *r) {
    exchange_step(x, attempt_decide(x, r));
}

/* The attempt the plan points at, now: the first, or after the backoff. */
static void exchange_start(exchange *x) { exchange_step(x, (plan_step){.action = PLAN_RETRY_NOW}); }

/* The current attempt failed without an answer: `why`, a timeout or not. */
static void attempt_failed(exchange *x, const char *why, int timeout) {
    upstream *u = x->u;
    /* a byte of the request went out, or an answer came */
    int reached = u->wrote > 0 || up_has_head(u);
    attempt_end(x, &(attempt_result){.status = up_has_head(u) ? u->resp.status : 0,
                                     .reached = reached,
                                     .error = why,
                                     .timeout = timeout});
}

/* The current attempt was answered with `status`; `why`: the answer is
 * not what it must be (NULL: it is). */
static void attempt_answered(exchange *x, int status, const char *why) {
    attempt_end(x, &(attempt_result){.status = status, .reached = 1, .error = why});
}

/* `t` fired: what it means is the exchange's state. */
static void exchange_timer(void *ctx) {
    exchange *x = ctx;
    char msg[160];
    upstream *u = x->u;
    switch (x->state) {
    case X_BACKOFF: /* the wait before the next attempt is over */
        exchange_start(x);
        return;
    case X_ATTEMPTING: /* the attempt's request timeout */
        snprintf(msg, sizeof msg, "no %s within the request timeout of %d ms",
                 x->stream ? "first event" : "answer", x->rp.request_timeout_ms);
        attempt_failed(x, msg, 1);
        return;
    case X_HOLDING: /* waiting for the shared store, whose link has its own timeout */
        return;
    case X_RELAYING: /* a started stream went quiet */
        if (u && u->paused)
            snprintf(msg, sizeof msg, "the client did not take the stream for %d s",
                     S.stream_idle_s);
        else
            snprintf(msg, sizeof msg, "the stream from %s stalled for %d s",
                     exchange_model(x)->alias, S.stream_idle_s);
        exchange_fail(x, 504, "stream_interrupted", msg);
        return;
    }
}

/* The deadline passed before the answer started: the running attempt is
 * cut (and nothing starts after it). Or a started stream ran for
 * --max-stream-seconds: it is cut. */
static void exchange_deadline(void *ctx) {
    exchange *x = ctx;
    char msg[160];
    if (x->state == X_RELAYING) {
        snprintf(msg, sizeof msg,
                 "the stream from %s ran past the limit of %d s (--max-stream-seconds)",
                 exchange_model(x)->alias, S.max_stream_s);
        exchange_fail(x, 504, "stream_interrupted", msg);
    } else if (x->state == X_BACKOFF || x->state == X_HOLDING) {
        exchange_give_up(x, 1);
    } else {
        snprintf(msg, sizeof msg, "no answer within the deadline of %lld ms", x->deadline_ms);
        attempt_failed(x, msg, 1);
    }
}

/* The provider's stream broke: while the client has seen nothing the
 * attempt fails over; after that the client's stream ends with the error
 * event. */
static void stream_broken(exchange *x, const char *why) {
    if (x->state != X_RELAYING) {
        attempt_answered(x, 200, why);
        return;
    }
    char msg[256];
    snprintf(msg, sizeof msg, "%s: %s", exchange_model(x)->alias, why);
    exchange_fail(x, 502, "stream_interrupted", msg);
}

/* A stream the client has whole: a success, its replay record (if any) its events. */
static void stream_succeeded(exchange *x) {
    exchange_settle(x, 200, EV_SUCCEEDED, x->plan.model, 0,
                    x->record_full ? NULL
                    : x->record.p  ? x->record.p
                                   : "",
                    x->record.len);
}

/* Relay the stream's complete events; end it when the provider's body ends. */
static void exchange_relay_translated(exchange *x);

static void exchange_relay_stream(exchange *x) {
    upstream *u = x->u;
    size_t off = 0, n;
    if (x->xs) {
        exchange_relay_translated(x);
        return;
    }
    while ((n = sse_event_len(u->body.p + off, u->body.len - off)) > 0) {
        char *ev = u->body.p + off;
        off += n;
        mask_provider_key(exchange_dep(x)->p, ev, n);
        int r = stream_take(x, ev, n);
        if (r < 0) { stream_broken(x, "an SSE event whose data is not JSON"); return; }
        /* a comment is not the answer's start */
        if (r == SSE_HIDE || (r == SSE_EMPTY && x->state != X_RELAYING)) continue;
        if (x->state != X_RELAYING) attempt_answered(x, 200, NULL); /* the first event: a success */
        exchange_chunk(x, ev, n);
    }
    buf_consume(&u->body, off);
    if (x->state == X_RELAYING) timer_set(&x->t, (int64_t)S.stream_idle_s * 1000);
    if (u->state == UP_DONE) {
        if (x->state != X_RELAYING) {
            stream_broken(x, "the stream ended before its first event");
            return;
        }
        if (u->body.len) { /* no final blank line: pass the rest on */
            mask_provider_key(exchange_dep(x)->p, u->body.p, u->body.len);
            exchange_chunk(x, u->body.p, u->body.len);
        }
        x_send(x, "0\r\n\r\n", 5);
        stream_succeeded(x);
        exchange_end(x);
        return;
    }
    if (u->body.len > 1024 * 1024) { stream_broken(x, "an SSE event larger than 1 MiB"); return; }
    if (x->c && conn_unsent(x->c) > OUT_HIGH_WATER) up_pause(u, 1);
}

/* A translated stream (section 17): each of the provider's events in, the client's events out,
 * the client's head with the first of them (before it, a failure still fails over). */
static void exchange_relay_translated(exchange *x) {
    upstream *u = x->u;
    size_t off = 0, n;
    buf out = {0};
    const char *why = NULL;
    long long t[NTOK];
    int r = 0;
    while (r >= 0 && (n = sse_event_len(u->body.p + off, u->body.len - off)) > 0) {
        char *ev = u->body.p + off;
        off += n;
        mask_provider_key(exchange_dep(x)->p, ev, n);
        if (stream_take(x, ev, n) < 0) {
            r = LTG_ERR, why = "an SSE event whose data is not JSON";
            break;
        }
        exchange_classes(x, t);
        out.len = 0;
        r = xl_feed(x->xs, ev, n, &x->event, t, &out, &why);
        if (r >= 0 && out.len && x->state != X_RELAYING) attempt_answered(x, 200, NULL);
        if (r >= 0 && out.len) exchange_chunk(x, out.p, out.len);
        if (r == 1) x->whole = 1;
    }
    buf_consume(&u->body, off);
    if (r >= 0 && u->state == UP_DONE && !x->whole) {
        exchange_classes(x, t);
        out.len = 0;
        r = xl_feed_end(x->xs, t, &out, &why);
        if (r >= 0 && out.len && x->state != X_RELAYING) attempt_answered(x, 200, NULL);
        if (r >= 0 && out.len) exchange_chunk(x, out.p, out.len);
        x->whole = r == 1;
    }
    buf_free(&out);
    if (r < 0) { stream_broken(x, why); return; }
    if (x->state == X_RELAYING) timer_set(&x->t, (int64_t)S.stream_idle_s * 1000);
    if (u->state == UP_DONE) {
        x_send(x, "0\r\n\r\n", 5);
        stream_succeeded(x);
        exchange_end(x);
        return;
    }
    if (u->body.len > 1024 * 1024) { stream_broken(x, "an SSE event larger than 1 MiB"); return; }
    if (x->c && conn_unsent(x->c) > OUT_HIGH_WATER) up_pause(u, 1);
}

/* The client has read what was waiting: resume the provider. */
static void exchange_drained(void *owner) {
    exchange *x = owner;
    if (x->u && x->u->paused) up_pause(x->u, 0);
}

/* News from the upstream connection (section 9): an attempt's result, or
 * more of a stream. */
static void exchange_upstream(void *owner) {
    exchange *x = owner;
    upstream *u = x->u;
    /* no failover once it started */
    if (u->state == UP_FAILED && x->state == X_RELAYING) { stream_broken(x, u->err); return; }
    if (u->state == UP_FAILED) {
        attempt_failed(x, u->err, 0);
        return;
    }
    if (!up_has_head(u)) return;
    int status = u->resp.status;
    if (x->stream && up_is_stream(u)) { exchange_relay_stream(x); return; }
    /* the head came: the attempt's timeout is met; the deadline bounds the body */
    timer_stop(&x->t);
    if (u->body.len > UP_MAX_BODY_BYTES || u->resp.content_length > UP_MAX_BODY_BYTES) {
        attempt_answered(x, status, "an answer larger than 64 MiB");
        return;
    }
    if (u->state != UP_DONE) return;
    int no_choices, r = status >= 200 && status < 300
                                ? usage_read(x->up, NULL, u->body.p ? u->body.p : "", u->body.len,
                                             &x->usage, &no_choices)
                                : 0;
    char reason[100];
    /* a success must be JSON */
    snprintf(reason, sizeof reason, "answered %d with a body that is not JSON", status);
    x->usage.final = r > 0;
    const char *why = r < 0 ? reason : NULL;
    if (!why && status / 100 == 2 && x->up != x->kind) why = exchange_translate_answer(x);
    attempt_answered(x, status, why);
}

/* The client went away (see conn_close). Without an Idempotency-Key the
 * request is cancelled -- the running attempt is logged as cut
 * (indeterminate, its breaker told nothing) and billed, a whole answer
 * metered (attempt_over); the request is abandoned, 499 -- with one it
 * runs on, and its answer waits for the client's retry. */
static void exchange_abort(void *owner) {
    exchange *x = owner;
    x->c->owner = NULL;
    if (x->state == X_HOLDING && !x->hold.held) { /* not admitted yet: no event (section 21) */
        x->c = NULL;
        exchange_free(x);
        return;
    }
    if (x->state == X_RELAYING && x->whole && !conn_unsent(x->c)) {
        /* the client took the stream's last event, then closed before the provider's end of
         * stream: it has the whole answer, so the request succeeded */
        stream_succeeded(x);
        x->c = NULL; /* after the settle, which tells the access log */
        exchange_end(x);
        return;
    }
    if (x->idem && S.ndetached < S.max_conns) { /* it runs on alone (bounded: each holds an fd) */
        x->c = NULL;
        x->detached = 1;
        S.ndetached++;
        if (x->u && x->u->paused) up_pause(x->u, 0); /* nobody to wait for now */
        return;
    }
    if (x->u && x->state == X_ATTEMPTING) {
        /* not the provider's doing: its breaker hears nothing of it */
        attempt_log(x, &x->plan, up_has_head(x->u) ? x->u->resp.status : 0, OUTCOME_INDETERMINATE,
                    "the client closed the connection");
        if (x->probe) breaker_forget_probe(exchange_dep(x));
        x->probe = 0;
        attempt_over(x);
    }
    /* 499: nginx's "client closed the request"; a stream that started is billed as far as it
     * went */
    exchange_settle(x, 499, EV_ABANDONED, x->state == X_RELAYING ? x->plan.model : -1, 0, NULL, 0);
    x->c = NULL; /* after the settle, which tells the access log */
    exchange_end(x);
}

/* The exchange as its client connection's owner (ltg.h). */
static const conn_owner exchange_owner = {exchange_abort, exchange_drained};

/* An idempotent request's first answer, again (README "Idempotent inference"), read back
 * from its spend event. */
static void inference_replay(conn *c, const idem *r) {
    buf h = {0}, answer = {0};
    cache_entry *hit = r->cached ? cache_get(r->cache_key) : NULL; /* idem_find saw it there */
    if (hit) buf_append(&answer, hit->body, hit->len);
    else if (r->keep) buf_append(&answer, r->keep->p ? r->keep->p : "", r->keep->len);
    else if (inf_idem_answer(r, &answer) < 0) {
        conn_error(c, 503, "storage_unavailable", NULL,
                   "the first answer to this Idempotency-Key cannot be read back from the ledger "
                   "(see ltg's log)");
        return;
    }
    buf_printf(&h,
               "x-ltg-request-id: %s\r\nX-Request-ID: %s\r\nx-ltg-attempts: 0\r\nx-ltg-replayed: "
               "true\r\n%s",
               c->rid, c->rid, hit ? "x-ltg-cache: hit\r\n" : "");
    if (r->status >= 200 && r->status < 300)
        buf_printf(&h, "x-ltg-served-model: %s\r\n", r->served);
    if (r->stream) {
        char size[32];
        int k = snprintf(size, sizeof size, "%zx\r\n", answer.len);
        conn_head(c, r->status, "text/event-stream", -1, h.p);
        if (answer.len) {
            conn_send(c, size, (size_t)k);
            conn_send(c, answer.p, answer.len);
            conn_send(c, "\r\n", 2);
        }
        conn_send(c, "0\r\n\r\n", 5);
        conn_done(c);
    } else conn_reply(c, r->status, "application/json", h.p, answer.p, answer.len);
    buf_free(&h);
    buf_free(&answer);
}


/* ---- admission: parse, a list of checks, start ---- */

/* What admission learns of an inference request, check by check. */
typedef struct {
    conn *c;
    const wire_kind *kind;    /* the endpoint's API (NULL: GET /v1/models) */
    tkey *key;
    group *g;
    const char *body;
    json_tok *t;              /* its top-level tokens (MAX_BODY_FIELDS) */
    int mv;                   /* the "model" token */
    buf name;                 /* the alias asked for */
    model *chain[MAX_CHAIN];  /* [M] + fallbacks[M], as far as the catalog still has them */
    int nchain;
    int stream, bypass, hide; /* hide: ltg asks for the usage chunk itself */
    worst_shape shape;        /* for the worst case */
    long long deadline_ms;
    retry_policy rp;
    body_edit usage;          /* a stream's request for its usage */
    const char *ik;           /* Idempotency-Key, or NULL */
    size_t ikn;
    uint8_t idem_key[32], body_hash[32];
    idem *replay;             /* an earlier request with the same key */
    hold hold;                /* its worst case, once held */
    int pin_dep;              /* previous_response_id's deployment of chain[0], or -1 */
    /* a timeout or deadline shorter than the group's (see exchange.shortened) */
    int shortened;
    char retry_after[40];     /* a rate limit's Retry-After header line */
    int shared;               /* decided by the shared store (--cluster: section 21) */
    /* per model of the chain, why the request cannot be translated to its API ("": it can, or
     * it was not tried: the attempt tries), and the first translation that went, for its attempt */
    char untranslatable[MAX_CHAIN][100];
    buf xbody;
    xl_verdict xv;
    int xmodel;               /* the chain index whose translation xbody holds, or -1 */
} admission;

/* A refusal: status, code, message, and header lines (each ending in CRLF). */
typedef struct {
    int status;
    const char *code, *headers;
    char msg[400];
    char param[160];          /* the field refused, a JSON Pointer ("" none) */
} refusal;

enum { ADMIT, REFUSE, REPLAY };

static int refuse(refusal *r, int status, const char *code, const char *headers, const char *fmt,
                  ...) __attribute__((format(printf, 5, 6)));
static int refuse(refusal *r, int status, const char *code, const char *headers, const char *fmt,
                  ...) {
    va_list ap;
    *r = (refusal){status, code, headers, "", ""};
    va_start(ap, fmt);
    vsnprintf(r->msg, sizeof r->msg, fmt, ap);
    va_end(ap);
    return REFUSE;
}

/* The token key the request's credential names, whose group exists, or NULL: from
 * Authorization: Bearer, or x-api-key (Anthropic's clients send it, to /v1/models too), *secret
 * the credential (NULL: none). Only the SHA-256 of the presented secret is looked up. */
static tkey *request_tkey(conn *c, const char **secret, size_t *n) {
    uint8_t h[32];
    *secret = request_bearer(c, n);
    if (!*secret) {
        *secret = http_header_get(c->in.p, c->req.h, c->req.nh, "x-api-key", n);
        if (*secret && !*n) *secret = NULL;
    }
    if (!*secret) return NULL;
    sha256(*secret, *n, h);
    tkey *k = hmap_get(&ST.keys_by_hash, h, 32);
    return k && group_find(k->group_id) && secret_eq(k->hash, 32, h, 32) ? k : NULL;
}

/* Does the request carry a token key of the store's (route_body_allowed)? */
static int token_key_known(conn *c) {
    const char *secret;
    size_t n;
    return request_tkey(c, &secret, &n) != NULL;
}

static int admit_key(admission *a, refusal *r) {
    size_t n;
    const char *secret;
    int anthropic = a->kind && a->kind->api == API_ANTHROPIC;
    a->key = request_tkey(a->c, &secret, &n);
    if (!secret)
        return refuse(r, 401, "invalid_api_key", NULL, "missing API key: send the header %s",
                      anthropic ? "x-api-key: ltg_sk_... (or Authorization: Bearer ltg_sk_...)"
                                : "Authorization: Bearer ltg_sk_... (or x-api-key: ltg_sk_...)");
    a->g = a->key ? group_find(a->key->group_id) : NULL;
    if (!a->g)
        return refuse(r, 401, "invalid_api_key", NULL,
                      "invalid API key: unknown or revoked (admin keys are not accepted here)");
    if (a->key->s.blocked)
        return refuse(r, 403, "key_blocked", NULL,
                      "this token key is blocked (an admin unblocks it: PATCH /token_keys/{id} "
                      "with \"blocked\": false)");
    return a->g->s.blocked
                   ? refuse(r, 403, "group_blocked", NULL, "this key's token group is blocked")
                   : ADMIT;
}

/* json_scan's callback: an image, audio or file part of a prompt, in any
 * API's shape (a "type" that names one). */
static void count_part(void *ctx, const char *name, size_t nlen, const char *v, size_t vlen) {
    static const char *const kinds[] = {
        "image_url", "input_image", "image", "input_audio", "input_file", "file", "document", NULL
    };
    /* compared unescaped */
    json_tok tn = {JSON_STRING, 0, (uint32_t)nlen, 0, 1},
             tv = {JSON_STRING, 0, (uint32_t)vlen, 0, 1};
    if (!json_eq(name, &tn, 0, "type")) return;
    for (int i = 0; kinds[i]; i++)
        if (json_eq(v, &tv, 0, kinds[i])) (*(long long *)ctx)++;
}

/* A JSON object, each member name once in every object, with a "model". */
static int admit_body(admission *a, refusal *r) {
    json_result res;
    a->body = a->c->body.p;
    if (json_parse(a->body, a->c->body.len, a->t, MAX_BODY_FIELDS, 1, &res) < 0)
        return refuse(r, 400, "invalid_json", NULL,
                      "the request body is not valid JSON: %s at byte offset %zu", res.err,
                      res.err_offset);
    if (a->t[0].type != JSON_OBJECT)
        return refuse(r, 400, "invalid_request", NULL, "the request body must be a JSON object");
    /* providers disagree on which wins: a second "model" could pass the checks */
    int dup = json_duplicate_key(a->body, a->t, 0);
    if (dup >= 0)
        return refuse(r, 400, "invalid_request", NULL,
                      "the request body has the key \"%.*s\" twice: send each top-level key once",
                      (int)(a->t[dup].end - a->t[dup].start > 100
                                    ? 100
                                    : a->t[dup].end - a->t[dup].start),
                      a->body + a->t[dup].start);
    a->shape = (worst_shape){(long long)(a->c->body.len + 2) / 3, 0, 0, 0, 1};
    if (json_scan(a->body, a->c->body.len, count_part, &a->shape.parts, &res) < 0) {
        /* the same, deeper: "stream_options" twice... */
        const char *at = a->body + res.err_offset;
        size_t n = 0;
        while (n < 100 && res.err_offset + n < a->c->body.len &&
               (at[n] != '"' || (n && at[n - 1] == '\\')))
            n++;
        if (!strstr(res.err, "repeated"))
            return refuse(r, 400, "invalid_request", NULL,
                          "the request body is refused: %s (byte offset %zu)", res.err,
                          res.err_offset);
        return refuse(r, 400, "invalid_request", NULL,
                      "the request body has the member \"%.*s\" twice in one object (byte offset "
                      "%zu): send each member once -- ltg and a provider could read it differently",
                      (int)n, at, res.err_offset);
    }
    a->mv = json_get(a->body, a->t, 0, "model");
    if (a->mv < 0 || a->t[a->mv].type != JSON_STRING)
        return refuse(r, 400, "invalid_request", NULL,
                      "the request needs a \"model\": one of the gateway's model aliases (GET "
                      "/v1/models)");
    json_unescape(a->body, a->t, a->mv, &a->name);
    if (!a->name.p) buf_reserve(&a->name, 0);
    return ADMIT;
}

/* A model the group allows and the catalog has; the chain of its
 * fallbacks. A follow-up to a response ltg remembers goes to the model that
 * made it, alone: its provider holds the conversation. */
static int admit_model(admission *a, refusal *r) {
    const group *g = a->g;
    model *m = catalog_model(S.cat, a->name.p, a->name.len);
    if (!group_allows(g, a->name.p))
        return refuse(
                r, 403, "model_not_allowed", NULL,
                "this key may not call \"%.200s\" (GET /v1/models lists the models it may call)",
                a->name.p);
    if (!m)
        return refuse(r, 404, "model_not_found", NULL,
                      "the model \"%.200s\" is no longer in this gateway's catalog", a->name.p);
    int prev = a->kind && a->kind->pins ? json_get(a->body, a->t, 0, "previous_response_id") : -1;
    const char *pinned = NULL, *dep = NULL;
    if (prev >= 0 && a->t[prev].type == JSON_STRING) {
        buf id = {0};
        /* the conversation the provider adds: the model's context_window, or what the pin knows */
        a->shape.added = -1;
        json_unescape(a->body, a->t, prev, &id);
        /* it lives in the pin, not in id */
        pinned = id.p ? pin_get(a->g->s.id, id.p, id.len, &dep, &a->shape.added) : NULL;
        buf_free(&id);
    }
    if (pinned) {
        if (!group_allows(g, pinned))
            return refuse(r, 403, "model_not_allowed", NULL,
                          "previous_response_id names a response of \"%.200s\", which this key may "
                          "not call",
                          pinned);
        /* a translated model's: its previous_response_id is refused with the body (section 17) */
        if (!(m = catalog_model(S.cat, pinned, strlen(pinned))))
            return refuse(r, 404, "model_not_found", NULL,
                          "previous_response_id names a response of \"%.200s\", no longer in this "
                          "gateway's catalog",
                          pinned);
        a->chain[a->nchain++] = m;
        for (int i = 0; i < m->ndep; i++)
            /* its provider holds the conversation */
            if (strcmp(m->dep[i].name, dep) == 0) a->pin_dep = i;
        return ADMIT;
    }
    a->chain[a->nchain++] = m;
    for (int i = 0; i < g->nfb; i++)
        for (int k = 0; strcmp(g->fb[i].model, a->name.p) == 0 && k < g->fb[i].n; k++) {
            model *f = catalog_model(S.cat, g->fb[i].to[k], strlen(g->fb[i].to[k]));
            /* of any API: section 17 translates */
            if (f && a->nchain < MAX_CHAIN) a->chain[a->nchain++] = f;
        }
    return ADMIT;
}

/* Can the request be carried to each model of the chain whose provider speaks another API
 * (section 17)? One that cannot is skipped, its attempt log entry saying why; when none can,
 * the answer is why the requested model cannot. Embeddings and legacy completions are not
 * translated; Anthropic's count_tokens is answered by ltg's estimate (count_estimate). */
static int admit_translation(admission *a, refusal *r) {
    int first = -1;
    if (a->kind->free) return ADMIT;
    for (int i = 0; i < a->nchain; i++) { /* to the first model that can take it */
        model *m = a->chain[i];
        xl_target t = {m->dep[0].upstream, m->max_output_tokens, m->reasoning};
        if (model_native(m, a->kind)) return ADMIT;
        if (!xl_translates(a->kind->xl, model_xl(m))) {
            model_unreachable(a->untranslatable[i], a->kind, m);
        } else if (xl_request(a->kind->xl, model_xl(m), a->body, a->c->body.len, a->t, &t,
                              &a->xbody, &a->xv) < 0) {
            snprintf(a->untranslatable[i], sizeof a->untranslatable[0], "%.99s", a->xv.msg);
            if (first < 0) refuse(r, 400, "untranslatable_field", NULL, "%s", a->xv.msg);
            if (first < 0) snprintf(r->param, sizeof r->param, "%s", a->xv.param);
            first = i;
        } else {
            a->xmodel = i;
            return ADMIT;
        }
    }
    if (first >= 0) return REFUSE;
    model *m = a->chain[0];
    if (m->api != a->kind->api && a->kind->xl == XL_NONE)
        return refuse(r, 400, "invalid_request", NULL,
                      "the model \"%.200s\" is served through %s, and %s is not translated: call "
                      "it on %s",
                      a->name.p, m->api == API_ANTHROPIC ? "Anthropic's Messages API" : "OpenAI's API",
                      a->kind->path,
                      m->api == API_ANTHROPIC ? "/v1/messages" : "/v1/chat/completions");
    return refuse(r, 400, "invalid_request", NULL, "%s", a->untranslatable[0]);
}

/* "stream"; the limits on output tokens the kind names ("max_tokens"...:
 * the largest counts) and the answers asked for ("n", "best_of": the
 * provider makes the larger of them), for the worst case; a stream's
 * usage request. */
static int admit_options(admission *a, refusal *r) {
    static const char *const answers[] = {"n", "best_of"};
    const json_tok *t = a->t;
    const char *why;
    int sv = json_get(a->body, t, 0, "stream");
    long long v;
    a->stream = sv >= 0 && t[sv].type == JSON_TRUE;
    if (sv >= 0 && t[sv].type != JSON_TRUE && t[sv].type != JSON_FALSE && t[sv].type != JSON_NULL)
        return refuse(r, 400, "invalid_request", NULL, "\"stream\" must be true or false");
    if (a->stream && !a->kind->stream)
        return refuse(r, 400, "invalid_request", NULL,
                      "this endpoint does not stream: remove \"stream\"");
    for (int i = 0; i < 2 && a->kind->max_out[i]; i++) {
        int mt = json_get(a->body, t, 0, a->kind->max_out[i]);
        if (mt < 0 || t[mt].type == JSON_NULL) continue;
        if (json_int(a->body, t, mt, &v) < 0 || v < 1)
            return refuse(r, 400, "invalid_request", NULL, "\"%s\" must be a whole number >= 1",
                          a->kind->max_out[i]);
        if (v > a->shape.out) a->shape.out = v;
    }
    for (int i = 0; i < 2; i++) {
        int nv = json_get(a->body, t, 0, answers[i]);
        if (nv < 0 || t[nv].type == JSON_NULL) continue;
        if (json_int(a->body, t, nv, &v) < 0 || v < 1 || v > 128)
            return refuse(r, 400, "invalid_request", NULL,
                          "\"%s\" must be a whole number from 1 to 128", answers[i]);
        if (v > a->shape.n) a->shape.n = v;
    }
    if (a->stream && a->kind->ask_usage &&
        usage_edit(a->body, t, json_get(a->body, t, 0, "stream_options"), &a->usage, &a->hide,
                   &why) < 0)
        return refuse(r, 400, "invalid_request", NULL, "%s", why);
    return ADMIT;
}

/* The group's retry policy with the request's x-ltg-* overrides (README "Per-request
 * overrides"). */
static int admit_overrides(admission *a, refusal *r) {
    static const struct { const char *name; long long lo, hi; } ov[] = {
        {"x-ltg-max-attempts", 1, 5}, {"x-ltg-retry-delay", 0, 60000}, {"x-ltg-request-timeout", 100, 600000}, {"x-ltg-deadline", 100, 3600000}};
    const http_request *q = &a->c->req;
    a->rp = a->g->has_retries ? a->g->retries : retry_defaults();
    long long v[4] = {a->rp.max_attempts, a->rp.retry_delay_ms, a->rp.request_timeout_ms,
                      a->rp.deadline_ms ? a->rp.deadline_ms : DEFAULT_DEADLINE_MS};
    size_t n;
    for (int i = 0; i < 4; i++) {
        const char *h = http_header_get(a->c->in.p, q->h, q->nh, ov[i].name, &n);
        long long own = v[i];
        if (h && (parse_ll(h, n, LLONG_MAX / 2, &v[i]) < 0 || v[i] < ov[i].lo || v[i] > ov[i].hi))
            return refuse(r, 400, "invalid_request", NULL,
                          "the header %s must be a whole number from %lld to %lld", ov[i].name,
                          ov[i].lo, ov[i].hi);
        /* a request timeout of 0 is none */
        if (h && i >= 2 && (v[i] < own || (i == 2 && own == 0))) a->shortened = 1;
    }
    a->rp.max_attempts = (int)v[0];
    a->rp.retry_delay_ms = (int)v[1];
    a->rp.request_timeout_ms = (int)v[2];
    a->deadline_ms = v[3];
    const char *b = http_header_get(a->c->in.p, q->h, q->nh, "x-ltg-backoff", &n);
    int k = 0;
    while (b && backoff_names[k] && ascii_casecmp_n(b, n, backoff_names[k]) != 0) k++;
    if (b && !backoff_names[k])
        return refuse(r, 400, "invalid_request", NULL,
                      "the header x-ltg-backoff must be constant, linear or exponential");
    if (b) a->rp.backoff = k;
    const char *cb = http_header_get(a->c->in.p, q->h, q->nh, "x-ltg-cache", &n);
    a->bypass = cb != NULL;
    if (cb && ascii_casecmp_n(cb, n, "bypass") != 0)
        return refuse(r, 400, "invalid_request", NULL,
                      "the header x-ltg-cache takes one value: bypass");
    return ADMIT;
}

/* Idempotency-Key (README "Idempotent inference"), keyed by the token key: one client's keys
 * never meet another's. A finished first request is replayed. */
static int allow_shared(const tkey *k, const group *g);

/* With --cluster, a request whose key or group has a budget, a rate limit
 * or max_parallel_requests, or that carries an Idempotency-Key, is decided
 * by the shared store (section 21), not here (`shared`): the key is claimed
 * there with the first hold, so that one instance runs the request. */
static int admit_shared(admission *a, refusal *r) {
    if (!cl_on()) return ADMIT;
    if (cl_behind()) /* its keys and groups may be stale: a revoked key would still pass */
        return refuse(r, 503, "store_unavailable", NULL,
                      "this instance missed changes to keys and groups, and serves nothing until "
                      "its operator restores its state (see its log)");
    if (cl_stale())
        return refuse(r, 503, "store_unavailable", "Retry-After: 1\r\n",
                      "this instance has not heard from the shared store (Redis) for a while: a "
                      "key revoked meanwhile could not be refused, so it serves nothing until it "
                      "hears again");
    if (a->kind->free) return ADMIT;
    size_t n;
    a->shared = allow_shared(a->key, a->g) ||
                http_header_get(a->c->in.p, a->c->req.h, a->c->req.nh, "idempotency-key", &n);
    return ADMIT;
}

/* An Idempotency-Key already used: with another body (`conflict`), or its
 * first request still running (with --cluster, or its answer not yet read
 * from the shared ledger). */
static int idem_refuse(refusal *r, int conflict) {
    if (conflict)
        return refuse(r, 409, "idempotency_conflict", NULL,
                      "this Idempotency-Key was used with a different request body: use a new key "
                      "for a new request");
    return refuse(r, 409, "idempotency_in_flight", "Retry-After: 1\r\n",
                  "the first request with this Idempotency-Key is still in flight: retry "
                  "shortly to get its answer");
}

static int admit_idempotency(admission *a, refusal *r) {
    a->ik = http_header_get(a->c->in.p, a->c->req.h, a->c->req.nh, "idempotency-key", &a->ikn);
    if (!a->ik) return ADMIT;
    if (a->ikn == 0 || a->ikn > 255)
        return refuse(r, 400, "invalid_request", NULL,
                      "Idempotency-Key must be 1 to 255 characters");
    br_sha256_context h;
    br_sha256_init(&h);
    br_sha256_update(&h, a->key->s.id, 36);
    br_sha256_update(&h, a->ik, a->ikn);
    br_sha256_out(&h, a->idem_key);
    sha256(a->body, a->c->body.len, a->body_hash);
    a->replay = idem_find(a->idem_key, 1, wall_ms());
    if (!a->replay) return ADMIT;
    if (memcmp(a->replay->body, a->body_hash, 32) != 0) return idem_refuse(r, 1);
    if (!a->replay->done) return idem_refuse(r, 0);
    return REPLAY;
}

static int parallel_refuse(const group *g, refusal *r) {
    return refuse(
            r, 429, "too_many_parallel_requests", "Retry-After: 1\r\n",
            "this key's group allows %lld requests at a time and all are in flight: retry shortly",
            g->max_parallel);
}

static int admit_parallel(admission *a, refusal *r) {
    const group *g = a->g;
    if (g->max_parallel <= 0 || g->inflight < g->max_parallel || a->shared) return ADMIT;
    return parallel_refuse(g, r);
}

/* Nothing is served that cannot be metered (section 14). */
static int admit_storage(admission *a, refusal *r) {
    const char *why; /* for ltg's log, which has said it: a tenant learns nothing of the disk */
    if (a->kind->free || ledger_writable(&why)) return ADMIT; /* a free request leaves no event */
    return refuse(r, 503, "storage_unavailable", "Retry-After: 1\r\n",
                  "spend events cannot be recorded now: nothing is sent upstream until they can");
}

/* The worst case -- of cost (section 15) and of tokens (the prompt's
 * bytes / 3 and the output limit) -- is held against the key's and the
 * group's budgets and rate limits: the last check, so that a request
 * refused by another holds nothing. */
/* A hold refused (by hold_reserve, or by the shared store: section 21):
 * the answer. `left`: USD left in the budget that refused. */
static int hold_refuse(admission *a, refusal *r, const hold_refusal *why, int64_t cost,
                       double left) {
    static const char *const whose[2] = {"this key", "this key's group"};
    const allowance *w = why->who ? &a->g->s.al : &a->key->s.al;
    if (why->wait) {
        metric_add(M_RATE_LIMITED, 1, "token_group", a->g->s.name, "scope",
                   why->who ? "group" : "key", "limit", why->limit, NULL);
        snprintf(a->retry_after, sizeof a->retry_after, "Retry-After: %ld\r\n", why->wait);
        return refuse(r, 429, "rate_limited", a->retry_after,
                      "%s allows %lld %s a minute and the last minute used them: retry after %ld s",
                      whose[why->who], why->limit[0] == 'r' ? w->rpm_limit : w->tpm_limit,
                      why->limit[0] == 'r' ? "requests" : "tokens", why->wait);
    }
    return refuse(r, 403, "budget_exceeded", NULL,
                  "the budget of %s, %.6f USD%s, has %.6f USD left, and this request may cost up "
                  "to %.6f USD",
                  whose[why->who], w->max_budget, w->budget_days ? " per period" : "", left,
                  (double)cost / MICRO);
}

static int admit_hold(admission *a, refusal *r) {
    if (a->kind->free) return ADMIT;
    allowance *al[2] = {&a->key->s.al, &a->g->s.al};
    static const char *const whose[2] = {"this key", "this key's group"};
    /* the first attempt's: each later one is held when it starts */
    worst w0 = worst_case(&a->shape, a->chain[0]);
    int64_t cost = w0.cost, tok = w0.in + w0.out;
    if (cost > MAX_CHARGE)
        return refuse(r, 400, "invalid_request", NULL,
                      "this request may cost more than %.0f USD (its output limit times the "
                      "answers it asks for): lower them",
                      MAX_CHARGE / MICRO);
    for (int i = 0; i < 2; i++)
        if (al[i]->tpm_limit != UNSET && tok > al[i]->tpm_limit)
            return refuse(r, 400, "invalid_request", NULL,
                          "this request may use up to %lld tokens, more than the tpm_limit of %s, "
                          "%lld a minute: lower its output limit",
                          (long long)tok, whose[i], al[i]->tpm_limit);
    if (a->shared) return ADMIT; /* held in the shared store once its exchange is made */
    hold_refusal why;
    if (hold_reserve(al, 2, cost, tok, wall_ms(), &a->hold, &why) == 0) return ADMIT;
    return hold_refuse(a, r, &why, cost, budget_remaining(al[why.who], wall_ms()));
}

/* The checks, in order: the first that does not admit decides. */
static int (*const admission_checks[])(admission *, refusal *) = {
    admit_key, admit_body, admit_model, admit_translation, admit_options, admit_overrides,
    admit_shared,
    admit_idempotency, admit_parallel, admit_storage, admit_hold
};

/* A refused request's answer: the error, and what it cost (nothing) and
 * what the group has left (README "Budgets that cannot be overspent"). */
static void inference_refuse(admission *a, const refusal *r) {
    buf h = {0};
    if (r->headers) buf_puts(&h, r->headers);
    buf_puts(&h, "x-ltg-cost: 0.000000\r\n");
    if (a->g && a->g->s.al.has_budget)
        buf_printf(&h, "x-ltg-budget-remaining: %.6f\r\n",
                   budget_remaining(&a->g->s.al, wall_ms()));
    a->c->f.param = r->param[0] ? r->param : NULL;
    conn_error(a->c, r->status, r->code, h.p, "%s", r->msg);
    a->c->f.param = NULL;
    buf_free(&h);
}

/* What admission found of translation (section 17): the models the request cannot go to, and
 * the first translation it made, which that model's first attempt sends. */
static void exchange_take_translation(exchange *x, admission *a) {
    memcpy(x->untranslatable, a->untranslatable, sizeof x->untranslatable);
    if (a->xmodel < 0) return;
    x->xbody = a->xbody, a->xbody = (buf){0};
    x->pre = xmalloc(sizeof *x->pre);
    *x->pre = a->xv;
    x->pre_model = a->xmodel;
}

/* Admitted: the exchange, with the body's rewrites in body order. */
static exchange *exchange_new(admission *a) {
    exchange *x = xcalloc(1, sizeof *x);
    x->c = a->c;
    x->cat = S.cat;
    x->stream = a->stream;
    x->kind = a->kind;
    x->up = a->kind;
    x->hide_usage = a->hide;
    exchange_take_translation(x, a);
    x->cat->refs++;
    S.nexchanges++;
    memcpy(x->rid, a->c->rid, sizeof x->rid);
    memcpy(x->group_id, a->g->s.id, 37);
    memcpy(x->key_id, a->key->s.id, 37);
    memcpy(x->chain, a->chain, sizeof x->chain);
    x->nchain = a->nchain;
    conn_header(a->c, "anthropic-version", x->anthropic_version, sizeof x->anthropic_version);
    conn_header(a->c, "anthropic-beta", x->anthropic_beta, sizeof x->anthropic_beta);
    conn_header(a->c, "tracestate", x->tracestate, sizeof x->tracestate);
    memcpy(x->trace_id, a->c->f.trace_id, sizeof x->trace_id);
    memcpy(x->trace_flags, a->c->f.trace_flags, sizeof x->trace_flags);
    /* "model": see exchange_build */
    x->edit[x->nedit++] = (body_edit){a->t[a->mv].start - 1, a->t[a->mv].end + 1, NULL};
    if (a->usage.text) {
        x->edit[x->nedit++] = a->usage;
        a->usage.text = NULL;
    }
    if (x->nedit == 2 && x->edit[1].at < x->edit[0].at) {
        body_edit e = x->edit[0];
        x->edit[0] = x->edit[1];
        x->edit[1] = e;
    }
    x->rp = a->rp;
    x->deadline_ms = a->deadline_ms;
    x->plan = plan_start(a->nchain, a->rp.max_attempts, a->rp.backoff, a->rp.retry_delay_ms);
    x->pin = a->pin_dep;
    x->shortened = a->shortened;
    x->started = S.now;
    x->hold = a->hold; /* held by admit_hold */
    x->shared = a->shared;
    x->shape = a->shape;
    a->g->inflight++;
    timer_init(&x->deadline, exchange_deadline, x);
    timer_init(&x->t, exchange_timer, x);
    if (a->g->cache_ttl > 0) x->cache_mode = a->stream || a->bypass ? CACHE_BYPASS : CACHE_MISS;
    if (x->cache_mode == CACHE_MISS)
        cache_keyof(a->g->s.id, a->kind->path, a->name.p, a->body, a->c->body.len, x->cache_key);
    /* the body moves to the exchange: a request is held once */
    x->body = a->c->body;
    a->c->body = (buf){0};
    if (a->ik) {
        /* the replay record this request fills (a cached answer too: its retry gets the same) */
        x->idem = xcalloc(1, sizeof *x->idem);
        x->idem->inference = 1;
        memcpy(x->idem->key, a->idem_key, 32);
        memcpy(x->idem->body, a->body_hash, 32);
        if (!cl_on()) idem_put(x->idem, 0); /* in place of a gone record with the same key */
    }
    return x;
}

/* What admission learnt, for the access log and the metrics (section 19):
 * the key, its group, and the model asked for when the catalog has it. */
static void admission_facts(const admission *a) {
    req_facts *f = &a->c->f;
    if (a->key) memcpy(f->key_id, a->key->s.id, 37);
    if (a->g) memcpy(f->group_id, a->g->s.id, 37);
    /* a client cannot mint a label value */
    model *m = a->name.p ? catalog_model(S.cat, a->name.p, a->name.len) : NULL;
    if (m) snprintf(f->requested, sizeof f->requested, "%s", m->alias);
}

/* Admitted and held: a cached answer, or the first attempt. Every check
 * ran first: a cached answer never bypasses policy. */
static void inference_go(exchange *x) {
    conn *c = x->c;
    cache_entry *hit = x->cache_mode == CACHE_MISS ? cache_get(x->cache_key) : NULL;
    if (x->cache_mode != CACHE_NONE) {
        c->f.cache = hit ? "hit" : x->cache_mode == CACHE_MISS ? "miss" : "bypass";
        metric_add(M_CACHE, 1, "result", c->f.cache, NULL);
    }
    if (!hit) {
        timer_set(&x->deadline, x->deadline_ms);
        exchange_start(x);
        return;
    }
    memcpy(x->cache_tok, hit->tok, sizeof x->cache_tok);
    x->cache_mode = CACHE_HIT;
    for (int i = 0; i < x->nchain; i++)
        if (strcmp(x->chain[i]->alias, hit->served) == 0) x->plan.model = i;
    int64_t cost = exchange_settle(x, 200, EV_SUCCEEDED, x->plan.model, 1, hit->body, hit->len);
    buf h = {0};
    exchange_headers(x, 200, &h);
    exchange_cost_headers(x, cost, &h);
    x->c = NULL;
    c->owner = NULL;
    exchange_free(x);
    conn_reply(c, 200, "application/json", h.p, hit->body, hit->len);
    buf_free(&h);
}

/* Admitted: the exchange, which owns the connection from now on. With
 * --cluster, a request decided by the shared store is held there first
 * (section 21: its answer goes on with inference_go). */
static void inference_start(admission *a) {
    exchange *x = exchange_new(a);
    a->c->owner = x;
    a->c->owner_ops = &exchange_owner;
    if (!x->shared) {
        inference_go(x);
        return;
    }
    x->w = worst_case(&x->shape, x->chain[0]);
    if (cl_hold(x, 1) != LTG_AGAIN) cl_refuse_first(x, a->key, a->g, NULL, 0, 0);
}

/* count_tokens for a model that does not speak Messages: ltg's own estimate of the input, the
 * figure its holds use (a token per 3 bytes of the body), with no call upstream: Claude Code
 * asks it to decide when to compact a conversation. */
static void count_estimate(admission *a) {
    buf b = {0}, h = {0};
    buf_printf(&b, "{\"input_tokens\":%lld}", a->shape.prompt);
    buf_printf(&h, "x-ltg-request-id: %s\r\nX-Request-ID: %s\r\nx-ltg-estimated: true\r\n",
               a->c->rid, a->c->rid);
    conn_reply(a->c, 200, "application/json", h.p, b.p, b.len);
    buf_free(&b);
    buf_free(&h);
}

/* POST to an inference endpoint (a row of WIRE): parse, admit, start. */
static void inference_call(conn *c, const wire_kind *kind) {
    json_tok t[MAX_BODY_FIELDS];
    admission a = {.c = c, .kind = kind, .t = t, .pin_dep = -1, .xmodel = -1};
    refusal r;
    int v = ADMIT;
    for (size_t i = 0; v == ADMIT && i < sizeof admission_checks / sizeof *admission_checks; i++)
        v = admission_checks[i](&a, &r);
    admission_facts(&a);
    if (v == REFUSE) inference_refuse(&a, &r);
    else if (v == REPLAY) inference_replay(c, a.replay);
    else if (kind->free && !model_native(a.chain[0], kind)) count_estimate(&a);
    else inference_start(&a);
    free(a.usage.text);
    buf_free(&a.name);
    buf_free(&a.xbody);
}

static void model_json(jwriter *w, const model *m) {
    jw_open(w, '{');
    jw_key(w, "id"), jw_cstr(w, m->alias);
    jw_key(w, "object"), jw_lit(w, "model");
    jw_key(w, "created"), jw_int(w, 0);
    jw_key(w, "owned_by"), jw_cstr(w, m->dep[0].p->name);
    jw_close(w, '}');
}

/* GET /v1/models: the aliases this key may call, in OpenAI's list shape;
 * GET /v1/models/{id}: one of them, or 404. */
static void inference_models(conn *c, const char *id) {
    admission a = {.c = c};
    refusal r;
    int v = admit_key(&a, &r);
    admission_facts(&a);
    if (v != ADMIT) { inference_refuse(&a, &r); return; }
    const group *g = a.g;
    model *one = id ? catalog_model(S.cat, id, strlen(id)) : NULL;
    if (id && (!one || !group_allows(g, id))) {
        conn_error(c, 404, "model_not_found", NULL,
                   "no model \"%.200s\" for this key (GET /v1/models lists the models it may call)",
                   id);
        return;
    }
    buf b = {0}, h = {0};
    jwriter w;
    jw_init(&w, &b);
    if (one) model_json(&w, one);
    else {
        jw_open(&w, '{');
        jw_key(&w, "object"), jw_lit(&w, "list");
        jw_key(&w, "data"), jw_open(&w, '[');
        for (int i = 0; i < g->nallowed; i++) {
            model *m = catalog_model(S.cat, g->allowed[i], strlen(g->allowed[i]));
            if (m) model_json(&w, m); /* else dropped from the catalog by a reload */
        }
        jw_close(&w, ']'), jw_close(&w, '}');
    }
    buf_printf(&h, "x-ltg-request-id: %s\r\nX-Request-ID: %s\r\n", c->rid, c->rid);
    conn_reply(c, 200, "application/json", h.p, b.p, b.len);
    buf_free(&b);
    buf_free(&h);
}

/* ===== 19. Observability: metrics and the access log =====
 *
 * IMPLEMENTATION NOTES
 * Counters and histograms are recorded where things happen, in section
 * 2's table (attempts in section 18, TLS handshakes in 8, fsyncs in 13,
 * spend events in 14...). GET /metrics writes them out, then the gauges,
 * read from live state at that moment: budgets, breakers, pools,
 * connections, /proc/self. When a request is over, the server calls
 * request_ended() (S.ended): it counts an inference request and writes the
 * access log line, from what the server recorded (status, bytes, times)
 * and what the gateway learnt (req_facts). The turn's lines gather in one
 * buffer, written by a before-sleep step in one write(); past ALOG_MAX
 * unwritten (a full disk) lines are dropped, and that is said once.
 */
#define LTG_VERSION "0.1.0"
#define ALOG_MAX (1 << 20)

static struct {
    int fd;           /* -1: --access-log off */
    const char *path; /* NULL: stderr */
    buf b;            /* lines not yet written */
    long dropped;     /* lines lost while the log would not take them */
} ALOG = {.fd = 2};

static const struct { const char *name, *type, *help; } FAMILY[NFAMILIES] = {
    [M_REQUESTS] = {"ltg_requests_total", "counter", "Inference requests answered or left by their client, by the HTTP status sent."},
    [M_DURATION] = {"ltg_request_duration_seconds", "histogram", "Inference requests, from their arrival to their last byte handed to the socket."},
    [M_ATTEMPTS] = {"ltg_attempts_total", "counter", "Upstream attempts by outcome."},
    [M_TTFT] = {"ltg_time_to_first_token_seconds", "histogram", "From a request's arrival to the first SSE event relayed, or the whole answer."},
    [M_TOKENS] = {"ltg_tokens_total", "counter", "Tokens charged, by class (cache_read, cache_write and reasoning are parts of input and output)."},
    [M_HOLD_EXCEEDED] = {"ltg_hold_exceeded_total", "counter", "Attempts whose provider reported more than ltg held for them: that model's bound is wrong."},
    [M_SPEND] = {"ltg_spend_usd_total", "counter", "USD charged to token groups."},
    [M_TLS] = {"ltg_tls_handshakes_total", "counter", "TLS handshakes with providers, full or resumed."},
    [M_CACHE] = {"ltg_cache_lookups_total", "counter", "Response cache lookups."},
    [M_LEDGER] = {"ltg_ledger_events_total", "counter", "Spend events written to the ledger."},
    [M_FSYNC] = {"ltg_log_fsync_seconds", "histogram", "Each fdatasync of the state log or the ledger."},
    [M_KEY_FAILS] = {"ltg_provider_key_failures_total", "counter", "A provider key answered 401 or 403 and rested (key: its index, never the key)."},
    [M_RATE_LIMITED] = {"ltg_rate_limited_total", "counter", "Requests refused with 429 rate_limited, by group, the limit's scope (key or group) and limit."},
    [M_CLUSTER_CALL] = {"ltg_cluster_call_seconds", "histogram", "With --cluster: calls on the command link to the shared store, from queued to answered."},
    [M_DROPPED] = {"ltg_metrics_series_dropped_total", "counter", "Observations not recorded: the series table was full."},
    [M_TRANSLATED] = {"ltg_translated_requests_total", "counter", "Attempts sent translated, by the client's API and the provider's."},
    [M_XL_DROPPED] = {"ltg_dropped_fields_total", "counter", "Hints left out of translated attempts, by field."},
};

/* --access-log FILE (or "off"); at start-up and on SIGUSR1. */
static int access_open(char *err, size_t errlen) {
    if (!ALOG.path || strcmp(ALOG.path, "off") == 0) { ALOG.fd = ALOG.path ? -1 : 2; return 0; }
    int fd = open(ALOG.path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
    if (fd < 0) {
        snprintf(err, errlen, "--access-log %s: %s", ALOG.path, strerror(errno));
        return LTG_ERR;
    }
    if (ALOG.fd > 2) close(ALOG.fd);
    ALOG.fd = fd;
    return 0;
}

static void access_reopen(void) {
    char err[PATH_MAX + 64];
    if (access_open(err, sizeof err) < 0)
        ltg_log("SIGUSR1: %s: the access log stays the file it was", err);
}

/* Before the loop sleeps: the turn's lines, in one write. */
static int access_flush(void) {
    while (ALOG.b.len && ALOG.fd >= 0) {
        ssize_t w = write(ALOG.fd, ALOG.b.p, ALOG.b.len);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break; /* a full disk: kept, up to ALOG_MAX */
        buf_consume(&ALOG.b, (size_t)w);
    }
    if (ALOG.dropped && !ALOG.b.len) {
        ltg_log("access log: %ld line(s) lost while it could not be written", ALOG.dropped);
        ALOG.dropped = 0;
    }
    if (ALOG.b.cap > ALOG_MAX && !ALOG.b.len) buf_free(&ALOG.b);
    return 0;
}


static void jw_ll_or_null(jwriter *w, long long v) {
    if (v < 0) jw_null(w);
    else jw_int(w, v);
}

/* The server's word that a request is over (S.ended, ltg.h). */
static void request_ended(conn *c) {
    const req_facts *f = &c->f;
    int status = c->status ? c->status : 499; /* no head sent: the client left first */
    int64_t began = c->began ? c->began : S.now, ms = S.now - began;
    if (f->endpoint) {
        char st[16];
        snprintf(st, sizeof st, "%d", status);
        metric_add(M_REQUESTS, 1, "endpoint", f->endpoint, "requested_model", f->requested,
                   "served_model", status / 100 == 2 ? f->served : "", "status", st, NULL);
        metric_observe(M_DURATION, (double)ms / 1000, "endpoint", f->endpoint, "requested_model",
                       f->requested, NULL);
    }
    if (ALOG.fd < 0) return;
    if (ALOG.b.len > ALOG_MAX) { ALOG.dropped++; return; }
    char path[512];
    size_t q;
    const char *t = request_path(c, &q); /* the path alone: a query is never logged */
    snprintf(path, sizeof path, "%.*s", (int)(q < 500 ? q : 500), t);
    jwriter w;
    jw_init(&w, &ALOG.b);
    jw_open(&w, '{');
    jw_key(&w, "ts"), jw_time(&w, wall_ms() - ms, 0);
    jw_key(&w, "request_id"), jw_str_or_null(&w, c->rid);
    jw_key(&w, "trace_id"), jw_str_or_null(&w, f->trace_id);
    char client[INET6_ADDRSTRLEN];
    inet_ntop(addr_is_v4(c->client) ? AF_INET : AF_INET6,
              addr_is_v4(c->client) ? c->client + 12 : c->client, client, sizeof client);
    jw_key(&w, "client"), jw_cstr(&w, client);
    jw_key(&w, "plane"), jw_cstr(&w, c->admin ? "admin" : "inference");
    jw_key(&w, "method"), jw_str(&w, c->in.p + c->req.method.off, c->req.method.len);
    jw_key(&w, "path"), jw_str_or_null(&w, path);
    jw_key(&w, "status"), jw_int(&w, status);
    jw_key(&w, "ms"), jw_int(&w, ms);
    jw_key(&w, "bytes_in"), jw_int(&w, (long long)(c->head_len + c->body_raw + c->body_in));
    jw_key(&w, "bytes_out"), jw_int(&w, (long long)(c->queued - c->queued_mark));
    jw_key(&w, "token_key_id"), jw_str_or_null(&w, f->key_id);
    jw_key(&w, "token_group_id"), jw_str_or_null(&w, f->group_id);
    jw_key(&w, "requested_model"), jw_str_or_null(&w, f->requested);
    jw_key(&w, "served_model"), jw_str_or_null(&w, f->served);
    jw_key(&w, "client_api"), jw_cstr(&w, f->client_api);
    jw_key(&w, "attempts"), jw_ll_or_null(&w, f->attempts);
    for (int k = 0; k < NTOK; k++) {
        jw_name(&w, tok_names[k]), jw_ll_or_null(&w, f->tok[TOK_IN] < 0 ? -1 : f->tok[k]);
    }
    jw_key(&w, "cost");
    if (f->cost >= 0) jw_usd(&w, f->cost);
    else jw_null(&w);
    jw_key(&w, "usage_status");
    jw_cstr(&w, f->cost < 0 ? NULL : f->estimated ? "estimated" : "reported");
    jw_key(&w, "cache"), jw_cstr(&w, f->cache);
    jw_close(&w, '}');
    buf_puts(&ALOG.b, "\n");
}

static void metric_head(buf *b, const char *name, const char *type, const char *help) {
    buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* One sample: name{labels} value, the labels of `key` (n bytes, without the
 * family byte) and one more, `extra`, if given. */
static void metric_sample(buf *b, const char *name, const char *suffix, const char *labels,
                          size_t n, const char *extra, double v) {
    buf_printf(b, "%s%s", name, suffix);
    if (n || extra)
        buf_printf(b, "{%.*s%s%s}", (int)n, labels, n && extra ? "," : "", extra ? extra : "");
    buf_printf(b, " %.15g\n", v);
}

/* The table's series (section 2), family by family. */
static void metrics_series(buf *b) {
    for (int fam = 0; fam < NFAMILIES; fam++) {
        const char *name = FAMILY[fam].name;
        metric_head(b, name, FAMILY[fam].type, FAMILY[fam].help);
        for (size_t i = 0; i < METRICS.cap; i++) {
            series *s = METRICS.slot[i];
            if (!s || s == HMAP_TOMB || s->key[0] != fam) continue;
            const char *labels = s->key + 1;
            size_t n = s->n - 1;
            if (!s->b) { metric_sample(b, name, "", labels, n, NULL, s->v); continue; }
            char le[32];
            for (int k = 0; k < NBUCKETS; k++) {
                snprintf(le, sizeof le, "le=\"%g\"", BUCKETS[k]);
                metric_sample(b, name, "_bucket", labels, n, le, (double)s->b[k]);
            }
            metric_sample(b, name, "_bucket", labels, n, "le=\"+Inf\"", (double)s->b[NBUCKETS]);
            metric_sample(b, name, "_sum", labels, n, NULL, s->v);
            metric_sample(b, name, "_count", labels, n, NULL, (double)s->b[NBUCKETS]);
        }
    }
}

/* A gauge's sample, its labels as name, value pairs ending with NULL. */
static void gauge(buf *b, const char *name, double v, ...) {
    char key[SERIES_KEY_MAX];
    va_list ap;
    va_start(ap, v);
    size_t n = series_keyv(key, 0, ap);
    va_end(ap);
    metric_sample(b, name, "", key + 1, n - 1, NULL, v);
}

static double START_TIME; /* wall clock seconds, when main() began */

/* The process's own gauges, as Prometheus's client libraries name them. */
static void metrics_process(buf *b) {
    long pages = 0, fds = -1; /* the directory's own fd is not counted */
    FILE *f = fopen("/proc/self/statm", "re");
    if (f && fscanf(f, "%*s %ld", &pages) != 1) pages = 0;
    if (f) fclose(f);
    DIR *d = opendir("/proc/self/fd");
    for (struct dirent *e; d && (e = readdir(d));) fds += e->d_name[0] != '.';
    if (d) closedir(d);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    metric_head(b, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.");
    gauge(b, "process_resident_memory_bytes", (double)pages * (double)sysconf(_SC_PAGESIZE), NULL);
    metric_head(b, "process_open_fds", "gauge", "Number of open file descriptors.");
    gauge(b, "process_open_fds", (double)fds, NULL);
    metric_head(b, "process_cpu_seconds_total", "counter",
                "Total user and system CPU time spent in seconds.");
    gauge(b, "process_cpu_seconds_total",
          (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
                  (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6,
          NULL);
    metric_head(b, "process_start_time_seconds", "gauge",
                "Start time of the process since unix epoch in seconds.");
    gauge(b, "process_start_time_seconds", START_TIME, NULL);
    metric_head(b, "ltg_build_info", "gauge", "Always 1: the version of ltg running.");
    gauge(b, "ltg_build_info", 1, "version", LTG_VERSION, NULL);
}

/* The gauges, read from live state now. */
static void metrics_gauges(buf *b) {
    int64_t now = wall_ms();
    metric_head(b, "ltg_budget_remaining_usd", "gauge",
                "USD left in the current budget period (groups with a budget).");
    for (int i = 0; i < ST.gv.n; i++) {
        group *g = ST.gv.p[i];
        if (g && g->s.al.has_budget)
            gauge(b, "ltg_budget_remaining_usd", budget_remaining(&g->s.al, now), "token_group",
                  g->s.name, NULL);
    }
    metric_head(b, "ltg_reserved_usd", "gauge",
                "USD held by requests in flight (groups with a budget).");
    for (int i = 0; i < ST.gv.n; i++) {
        group *g = ST.gv.p[i];
        if (g && g->s.al.has_budget)
            gauge(b, "ltg_reserved_usd", (double)g->s.al.reserved / MICRO, "token_group", g->s.name,
                  NULL);
    }
    metric_head(b, "ltg_circuit_open", "gauge",
                "1 while the circuit breaker of the model's deployment is open.");
    for (int i = 0; i < S.cat->nmodels; i++)
        for (int k = 0; k < S.cat->models[i].ndep; k++) {
            const deployment *d = &S.cat->models[i].dep[k];
            gauge(b, "ltg_circuit_open", d->cb_open_until > S.now, "model", d->m->alias,
                  "deployment", d->name, NULL);
        }
    metric_head(b, "ltg_deployment_in_flight", "gauge",
                "Attempts in flight on the model's deployment (the catalog in use).");
    for (int i = 0; i < S.cat->nmodels; i++)
        for (int k = 0; k < S.cat->models[i].ndep; k++) {
            const deployment *d = &S.cat->models[i].dep[k];
            gauge(b, "ltg_deployment_in_flight", d->inflight, "model", d->m->alias, "deployment",
                  d->name, NULL);
        }
    metric_head(b, "ltg_upstream_connections", "gauge",
                "Connections to providers: serving a request, or idle in the pool.");
    for (int i = 0; i < S.cat->nprov; i++) {
        provider *p = &S.cat->prov[i];
        gauge(b, "ltg_upstream_connections", p->nbusy, "provider", p->name, "state", "active",
              NULL);
        gauge(b, "ltg_upstream_connections", p->nidle, "provider", p->name, "state", "idle", NULL);
    }
    metric_head(b, "ltg_client_connections", "gauge", "Open client connections.");
    gauge(b, "ltg_client_connections", S.nconns - S.nadmin, "listener", "inference", NULL);
    gauge(b, "ltg_client_connections", S.nadmin, "listener", "admin", NULL);
    metrics_process(b);
}

/* GET /metrics on the admin listener: the Prometheus text format 0.0.4. */
static void metrics_reply(conn *c) {
    admin_who who;
    if (S.metrics_auth && (admin_auth(c, &who) < 0 || !admin_allowed(c, &who, PERM_METRICS_READ)))
        return;
    buf b = {0};
    metrics_series(&b);
    metrics_gauges(&b);
    if (cl_on()) cl_metrics(&b);
    conn_reply(c, 200, "text/plain; version=0.0.4; charset=utf-8", "Cache-Control: no-store\r\n",
               b.p, b.len);
    buf_free(&b);
}

/* ===== 20. Routing =====
 *
 * IMPLEMENTATION NOTES
 * Both listeners share the HTTP server; `conn.admin` says which one a
 * connection came from, and so which endpoints and which error shape it
 * gets: the control plane (section 16) and /metrics on the admin listener,
 * the OpenAI and Anthropic APIs (section 18) on the inference listener,
 * /healthz and /readyz on both. One table, ROUTES, says it for both
 * listeners; route() finds the row, counts an inference request under its
 * endpoint, answers 404 or 405 itself, and calls the row's handler. The
 * control plane's paths are one row, routed further by its own table
 * (admin_endpoints: each path's permission and item kind).
 */
/* GET (or HEAD: some load balancers probe with it) /healthz, the liveness
 * check, always 200; /readyz, 503 while draining or while a log cannot be
 * written (section 13: what cannot be recorded is refused), saying which
 * -- never its path or the system's error: anyone may ask, and ltg's own
 * log has them. */
static void probe_reply(conn *c, int ready) {
    const char *status = ready ? "ready" : "ok", *why = NULL, *unused;
    if (ready && S.draining) status = "draining";
    else if (ready && !ledger_writable(&unused)) {
        status = "storage_unavailable";
        why = "the ledger cannot be written (see ltg's log)";
    } else if (ready && LOG.f.failing) {
        status = "storage_unavailable";
        why = "the state log cannot be written (see ltg's log)";
    } else if (ready && (why = cl_unready())) {
        status = "store_unavailable";
    }
    buf b = {0};
    jwriter w;
    jw_init(&w, &b), jw_open(&w, '{'), jw_key(&w, "status"), jw_cstr(&w, status);
    if (why) {
        jw_key(&w, "detail"), jw_cstr(&w, why);
    }
    jw_close(&w, '}');
    conn_reply(c, ready && strcmp(status, "ready") ? 503 : 200, "application/json",
               "Cache-Control: no-store\r\n", b.p, b.len);
    buf_free(&b);
}

/* S.error: JSON:API's shape on the admin listener (README "The control
 * plane"), the OpenAI or Anthropic API's on the inference one. */
static void route_error(conn *c, int status, const char *code, const char *headers,
                        const char *msg) {
    /* its own headers: the extra ones are the inference plane's */
    if (c->admin) admin_error(c, status, code, NULL, 0, "%s", msg);
    else inference_error(c, status, code, headers, msg);
}

/* The handlers of ROUTES: `rest` is what follows the row's path ("" for the
 * path itself; of a sub-path, what comes after its '/'). */
static void serve_probe(conn *c, const char *rest, const wire_kind *kind) {
    (void)rest, (void)kind;
    probe_reply(c, path_is(c, "/readyz"));
}

static void serve_metrics(conn *c, const char *rest, const wire_kind *kind) {
    (void)rest, (void)kind;
    metrics_reply(c);
}

static void serve_admin(conn *c, const char *rest, const wire_kind *kind) {
    (void)rest, (void)kind;
    admin_route(c);
}

static void serve_models(conn *c, const char *rest, const wire_kind *kind) {
    (void)kind;
    char id[ALIAS_MAX * 3];
    percent_decode(rest, strlen(rest), id, sizeof id);
    inference_models(c, *rest ? id : NULL);
}

static void serve_api(conn *c, const char *rest, const wire_kind *kind) {
    (void)rest;
    inference_call(c, kind);
}

/* Every path of both listeners, in one table: where it is served, whether
 * its sub-paths are its own ("/v1/models/{id}"; the control plane's are
 * routed by its own table, admin_endpoints), the method it takes (NULL:
 * the handler's table decides) and HEAD too (a probe's), and its handler.
 * An inference API's row names its wire kind, whose path it is. */
enum { ON_INFERENCE = 1, ON_ADMIN = 2, ON_BOTH = 3 };
typedef struct {
    int on, sub;
    const char *path, *method;
    int head;
    void (*serve)(conn *c, const char *rest, const wire_kind *kind);
    const wire_kind *kind;
} route_row;

static const route_row ROUTES[] = {
    {ON_BOTH, 0, "/", "GET", 1, serve_probe, NULL}, /* a client's first probe: as /healthz */
    {ON_BOTH, 0, "/healthz", "GET", 1, serve_probe, NULL},
    {ON_BOTH, 0, "/readyz", "GET", 1, serve_probe, NULL},
    {ON_ADMIN, 0, "/metrics", "GET", 1, serve_metrics, NULL},
    {ON_ADMIN, 1, API_PREFIX, NULL, 0, serve_admin, NULL},
    {ON_INFERENCE, 0, NULL, "POST", 0, serve_api, &WIRE[0]},
    {ON_INFERENCE, 0, NULL, "POST", 0, serve_api, &WIRE[1]},
    {ON_INFERENCE, 0, NULL, "POST", 0, serve_api, &WIRE[2]},
    {ON_INFERENCE, 0, NULL, "POST", 0, serve_api, &WIRE[3]},
    {ON_INFERENCE, 0, NULL, "POST", 0, serve_api, &WIRE[4]},
    {ON_INFERENCE, 0, NULL, "POST", 0, serve_api, &WIRE[5]},
    {ON_INFERENCE, 1, "/v1/models", "GET", 0, serve_models, NULL},
};
_Static_assert(sizeof WIRE / sizeof *WIRE == 6, "a row of ROUTES for each row of WIRE");

/* The row of c's path on c's listener, or NULL; rest: what follows its
 * path (at most cap - 1 bytes of it; cap 0: not asked). */
static const route_row *route_find(conn *c, char *rest, size_t cap) {
    size_t n;
    const char *t = request_path(c, &n);
    for (size_t i = 0; i < sizeof ROUTES / sizeof *ROUTES; i++) {
        const route_row *r = &ROUTES[i];
        const char *path = r->kind ? r->kind->path : r->path;
        size_t len = strlen(path);
        if (!(r->on & (c->admin ? ON_ADMIN : ON_INFERENCE)) || n < len || memcmp(t, path, len) != 0)
            continue;
        if (n == len || (r->sub && t[len] == '/' && n > len + 1)) {
            size_t k = n == len ? 0 : n - len - 1;
            if (cap) snprintf(rest, cap, "%.*s", (int)(k < cap ? k : cap - 1), t + n - k);
            return r;
        }
    }
    return NULL;
}

/* An inference call's trace: its traceparent's (W3C Trace Context level 1:
 * a version, a trace id and a parent id that are not all zeros, flags; a
 * later version may add fields), or, without one that parses, a new trace. */
static void trace_start(conn *c) {
    char tp[128];
    conn_header(c, "traceparent", tp, sizeof tp);
    size_t n = strlen(tp);
    int ok = n >= 55 && tp[2] == '-' && tp[35] == '-' && tp[52] == '-' &&
             (n == 55 || (memcmp(tp, "00", 2) != 0 && tp[55] == '-')) && memcmp(tp, "ff", 2) != 0;
    for (size_t i = 0; ok && i < 55; i++)
        ok = i == 2 || i == 35 || i == 52 || isdigit((unsigned char)tp[i]) ||
             (tp[i] >= 'a' && tp[i] <= 'f');
    ok = ok && strspn(tp + 3, "0") < 32 && strspn(tp + 36, "0") < 16;
    if (ok) {
        memcpy(c->f.trace_id, tp + 3, 32);
        memcpy(c->f.trace_flags, tp + 53, 2);
    } else {
        uint64_t r[2] = {rng_next(), rng_next() | 1}; /* never all zeros */
        hex_encode((const uint8_t *)r, 16, c->f.trace_id);
        memcpy(c->f.trace_flags, "00", 2);
    }
    c->f.trace_id[32] = c->f.trace_flags[2] = 0;
}

static int admin_key_known(conn *c);
static int token_key_known(conn *c);

/* A request whose body did not come with its head is read on only for a key that may send it:
 * a token key of the store's for an inference API, an admin key for the control plane (a
 * route that takes no body, or an unknown path, for none). Else the server refuses it
 * (c->refuse_body, ltg.h) once its first read leaves it unfinished, so a caller without a key
 * holds no more than that read. */
static void route_body_allowed(conn *c, const route_row *row) {
    int pending = c->req.chunked || (c->req.content_length > 0 &&
                                      c->in.len - c->head_len < (size_t)c->req.content_length);
    if (!pending) return;
    if (!row) c->refuse_body = 404;
    else if (row->kind) c->refuse_body = token_key_known(c) ? 0 : 401;
    else if (row->serve == serve_admin) c->refuse_body = admin_key_known(c) ? 0 : 401;
    else c->refuse_body = 413;
}

/* S.begin: a request's head is in. Its id, and what its path says: the
 * endpoint it is counted by, the shape of its errors, its trace; a body that is still to come
 * is read only for a known key (route_body_allowed). */
static void route_begin(conn *c) {
    /* "req_" and 96 random bits in hex, without printf: every request makes one. Nothing in
     * it counts (a caller who sees two ids learns nothing of the traffic between them). */
    uint64_t r[2] = {rng_next(), rng_next()};
    memcpy(c->rid, "req_", 4);
    hex_encode((const uint8_t *)r, 12, c->rid + 4);
    c->rid[28] = 0;
    const route_row *row = route_find(c, NULL, 0);
    /* an inference request is counted by its endpoint, an unknown path as "other"; a probe not */
    if (!c->admin && (!row || row->on == ON_INFERENCE)) {
        c->f.endpoint = !row ? "other" : row->kind ? row->kind->path : row->path;
        c->f.anthropic = row && row->kind && row->kind->api == API_ANTHROPIC;
        c->f.client_api = row && row->kind ? row->kind->name : NULL;
        if (row && row->kind) trace_start(c);
    }
    route_body_allowed(c, row);
}

/* A WebSocket handshake (RFC 6455 4.1): a GET asking to upgrade to it. */
static int websocket_asked(conn *c) {
    size_t n;
    const char *up = http_header_get(c->in.p, c->req.h, c->req.nh, "upgrade", &n);
    return method_is(c, "GET") && up && header_has_token(up, n, "websocket");
}

/* S.serve: the request, whole, to its row's handler (route_begin named it). */
static void route(conn *c) {
    char rest[ALIAS_MAX * 3];
    const route_row *row = route_find(c, rest, sizeof rest);
    if (!row && c->admin) {
        admin_error(c, 404, "not_found", NULL, 0, "no such endpoint: the control plane is under "
                    API_PREFIX " (and /metrics, /healthz, /readyz)");
    } else if (!row) {
        conn_error(c, 404, "not_found", NULL,
                   "no such endpoint (ltg serves /v1/chat/completions, /v1/completions, "
                   "/v1/responses, /v1/embeddings, /v1/messages and /v1/models)");
    } else if (row->kind && websocket_asked(c)) {
        /* Codex's Responses over WebSocket: 426 has it fall back to HTTP at once (a 405, after
         * another try) */
        conn_error(c, 426, "websocket_unsupported", "Upgrade: HTTP/1.1\r\n",
                   "ltg serves %s over HTTP only: POST it (WebSocket is not served)",
                   row->kind->path);
    } else if (row->method && !method_is(c, row->method) && !(row->head && method_is(c, "HEAD"))) {
        conn_error(c, 405, "method_not_allowed", NULL, "use %s for %s", row->method,
                   row->kind ? row->kind->path : row->path);
    } else {
        row->serve(c, rest, row->kind);
    }
}

/* ===== 21. Several instances: the Redis link =====
 *
 * IMPLEMENTATION NOTES
 * With --cluster redis://HOST:PORT[/DB], several ltg processes share one
 * Redis or Valkey primary and behave as one gateway (README "Several
 * instances"). RESP2 is written here like HTTP and JSON: a command is an
 * array of bulk strings; a reply is parsed into resp_tok, a flat array in
 * document order like the JSON reader's tokens.
 *
 * Two links, each one TCP connection in the loop. CMD carries the calls,
 * pipelined: the calls of a turn leave in one write, and the replies come
 * back in order, matched to a FIFO of callbacks. TAIL is blocked in
 * XREAD on the shared stream and doubles as the heartbeat. On every
 * (re)connect a link authenticates, selects its database and asks ROLE,
 * which must say master (a replica answers reads and refuses writes); CMD
 * then loads ltg's functions (FUNCTION LOAD REPLACE) before it takes a
 * call. A failure -- a refused connect, a reply that does not parse, no
 * reply within CL_TIMEOUT_MS -- closes the link and fails its pending calls
 * (their callers answer 503), and a timer reconnects after a backoff
 * (CL_BACKOFF_MIN_MS doubling to CL_BACKOFF_MAX_MS, with jitter), for ever.
 * An answer READONLY (the primary was demoted), the UNBLOCKED that ends a
 * blocked XREAD when that happens, or ERR Function not found (the server
 * lost the functions) fails the link too. With
 * sentinel://, a third link asks a Sentinel where the primary is before
 * each (re)connect (cl_discover), so a failover is followed by itself.
 *
 * The control plane (section 16's admin_change) does not write the local
 * log first. A change is one call of ltg_cp_v1, which checks the item's
 * version and the Idempotency-Key in Redis and appends the record to the
 * stream ltg:log, all or nothing. Every instance -- the writer too --
 * applies ltg:log in order through store_apply(), the code that replays the
 * state log at start-up, after appending the record with its stream id
 * ("sid") to its own state log: a restart replays the local copy and reads
 * the stream from the last sid. The writer answers once its reader has
 * applied its record, so what it answered, it shows.
 *
 * A change built on a copy the stream has moved past (another instance
 * changed the item first) is refused by the function with the stream's
 * last id; the writer waits until it has applied that far and runs the
 * request again on the fresh copy: with If-Match, that is a 412; without,
 * the change applies to the newer item.
 *
 * The ledger is shared the same way. An instance does not write its own
 * spend events: each goes, inside the settle of its request, to the stream
 * ltg:events (through the outbox, "the shared money" below), and every
 * instance -- the one that served it too -- reads that stream with ltg:log
 * and adds each event to its ledger at the stream's time with its stream
 * id (cl_event). So every instance's days hold the same records in the
 * same order, and a restart reads the stream on from the newest event its
 * ledger has (ledger_last_sid). An idempotent request's kept answer rides
 * in its event, so every instance can replay it; the key itself is claimed
 * in the store with the request's first hold (ltg_hold_v1), so that one
 * instance runs it.
 */
#define CL_TIMEOUT_MS 3000       /* no reply this long: the link is lost */
#define CL_BACKOFF_MIN_MS 100
#define CL_BACKOFF_MAX_MS 5000
#define CL_BLOCK_MS 1000         /* XREAD's wait: the heartbeat */
#define CL_READ_COUNT 16         /* records per XREAD */
#define CL_MAX_SENTINELS 8
#define CL_DAY_GRACE_MS 60000    /* a ledger day is sealed once read this long after its end */
#define CL_EVENTS_KEEP_MS 172800000 /* ltg:events keeps no more than this (48 h) */
#define CL_MAX_CALLS 4096        /* calls in flight on a link; beyond, refused at once */
#define CL_CHANGE_TRIES 3        /* runs of one change whose copy was stale */
#define STR_(x) #x
#define STR(x) STR_(x)         /* a number macro as a string */
#define RESP_MAX_TOKS 1024
#define RESP_MAX_DEPTH 8
/* One string of a reply: a change's record (its item and answer: bodies <= 1 MiB), or a spend
 * event with the answer its replay keeps (CL_MAX_EVENT, section 18), and room to spare. */
#define RESP_MAX_BULK (CL_MAX_EVENT + 65536)
/* A reply's bytes: one entry of each stream read whole. A read of CL_READ_COUNT entries that
 * comes to more fails, and the reader reads on one entry at a time (cl_tail_read). */
#define RESP_MAX_REPLY ((size_t)2 * RESP_MAX_BULK + 65536)
#define CL_MAX_FIELDS 64         /* an entry's fields and values: ltg's have 2 to 8 */

typedef struct {
    char type;                /* '+' '-' ':' '$' '*', or '_' for a null */
    long long num;            /* ':' its value, '*' its element count */
    size_t off, len;          /* '+' '-' '$': the text */
    int next;                 /* the token after this one and its elements */
} resp_tok;

/* One reply element at *at into t[*nt...]: 1 (with *at past it), 0 when the
 * bytes end first, LTG_ERR when it is malformed or too big. */
static int resp_elem(const char *p, size_t n, size_t *at, resp_tok *t, int max, int *nt,
                     int depth) {
    const char *nl = memchr(p + *at, '\n', n - *at);
    if (!nl) return n - *at > 4096 ? LTG_ERR : 0;
    size_t line = *at + 1, end = (size_t)(nl - p);
    if (end == *at || p[end - 1] != '\r' || *nt >= max || depth > RESP_MAX_DEPTH) return LTG_ERR;
    resp_tok *k = &t[(*nt)++];
    *k = (resp_tok){.type = p[*at], .off = line, .len = end - 1 - line};
    *at = end + 1;
    if (k->type != '+' && k->type != '-') {
        int neg = k->len > 1 && p[line] == '-';
        long long v;
        if (!k->type || !strchr(":$*", k->type) ||
            parse_ll(p + line + neg, k->len - (size_t)neg, LLONG_MAX, &v) < 0)
            return LTG_ERR;
        k->num = neg ? -v : v;
        if (k->type != ':' && neg) k->type = '_';
    }
    if (k->type == '$') {
        if (k->num > RESP_MAX_BULK) return LTG_ERR;
        if (n - *at < (size_t)k->num + 2) return 0;
        k->off = *at;
        k->len = (size_t)k->num;
        if (memcmp(p + *at + k->len, "\r\n", 2) != 0) return LTG_ERR;
        *at += k->len + 2;
    }
    for (long long i = 0; k->type == '*' && i < k->num; i++) {
        int r = resp_elem(p, n, at, t, max, nt, depth + 1);
        if (r <= 0) return r;
    }
    k->next = *nt;
    return 1;
}

/* What a server sent, for ltg's log: at most n - 1 bytes, a byte that is not printable ASCII
 * (a newline would begin a forged log line) as \xHH, cut with "..." when longer. */
static void log_escape(const char *p, size_t len, char *out, size_t n) {
    size_t o = 0;
    for (size_t i = 0; i < len && o + 8 < n; i++) {
        unsigned char ch = (unsigned char)p[i];
        if (ch >= 0x20 && ch < 0x7f && ch != '\\') out[o++] = (char)ch;
        else o += (size_t)snprintf(out + o, n - o, "\\x%02x", ch);
        if (i + 1 < len && o + 8 >= n) o += (size_t)snprintf(out + o, n - o, "...");
    }
    out[o] = 0;
}

/* Is token i the bulk or simple string s? */
static int resp_is(const char *p, const resp_tok *t, int i, const char *s) {
    return (t[i].type == '$' || t[i].type == '+') && t[i].len == strlen(s) &&
           memcmp(p + t[i].off, s, t[i].len) == 0;
}

/* "what: " and an error reply's text (or that the reply is not one ltg can
 * read), into out, for ltg's log. */
static const char *resp_why(const char *what, const char *p, const resp_tok *t, char *out,
                            size_t n) {
    if (t[0].type == '-') {
        char text[160];
        log_escape(p + t[0].off, t[0].len, text, sizeof text);
        snprintf(out, n, "%s: %s", what, text);
    } else snprintf(out, n, "%s: an answer ltg cannot read", what);
    return out;
}

/* A command: an array of bulk strings. */
typedef struct {
    const char *p;
    size_t n;
} rarg;
#define RA(s) ((rarg){(s), strlen(s)})

static void resp_cmd(buf *b, const rarg *a, int argc) {
    buf_printf(b, "*%d\r\n", argc);
    for (int i = 0; i < argc; i++) {
        buf_printf(b, "$%zu\r\n", a[i].n);
        buf_append(b, a[i].p, a[i].n);
        buf_append(b, "\r\n", 2);
    }
}

/* A call's callback: the reply in p, its tokens t (t[0] the reply); t is
 * NULL when there will be none (the link was lost). */
typedef void rl_reply(void *ctx, const char *p, const resp_tok *t);

enum { RL_DOWN, RL_CONNECTING, RL_HELLO, RL_UP };

typedef struct rlink {
    const char *name;         /* "command", "stream": for ltg's log */
    int fd, state, backoff_ms;
    buf in, out;
    struct {
        rl_reply *fn;
        void *ctx;
        int64_t at;           /* S.now when queued */
    } *q;                     /* calls awaiting their reply, a ring */
    int qhead, qlen, qcap;
    timer t;                  /* the reconnect backoff, or the reply timeout */
    int64_t due;              /* S.now by which the oldest call's reply must be in */
    int discover;             /* with Sentinel: waits for the primary's address */
    void (*hello)(struct rlink *); /* queue the link's own handshake calls */
    void (*up)(struct rlink *);    /* the handshake is done */
    char said[256];           /* why it failed, as last logged: a new reason is logged once */
    resp_tok tok[RESP_MAX_TOKS];
} rlink;

/* One pending control-plane change (its admin connection waits). */
typedef struct cl_pending {
    struct cl_pending *next;
    conn *c;                  /* NULL once its client left */
    char sid[32];             /* answer once the stream is applied up to here */
    int status, tries;
    long long version;
    buf reply;                /* the answer (a new key's shows its secret: wiped) */
    int rerun;                /* stale: run the request again, not answer */
    timer t;
} cl_pending;

static struct {
    const char *url, *password_env; /* --cluster, --cluster-password-env */
    const char *sen_password_env;   /* --cluster-sentinel-password-env */
    char *sen_password;
    char host[256];           /* the primary (with Sentinel: as it last said) */
    int port, db;
    char *password;
    rlink cmd, tail;
    /* sentinel://: the Sentinels, asked in turn for the primary of `master` */
    char master[128];
    struct { char host[256]; int port; } sen[CL_MAX_SENTINELS];
    int nsen, seni;
    rlink sent;
    char applied[32];         /* the last ltg:log id applied ("ms-seq"; "" none) */
    char ev_applied[32];      /* the last ltg:events id in the ledger ("" none) */
    int64_t read_at;          /* wall ms when the pending XREAD was sent */
    int64_t caught_up;        /* ... of the last that found every event there was */
    int64_t heard;            /* S.now of the tail link's last reply */
    int stale_ms;             /* --cluster-stale-after: not heard this long, nothing is served */
    double lag;               /* seconds from the last record's XADD to its apply here */
    /* the stream link's last read failed (its reply too large, or not RESP): 1, read one entry
     * at a time; 2, that failed too: the entry that cannot be read is found and skipped */
    int unread;
    long long skipped;        /* entries skipped so (ltg_cluster_skipped_total) */
    int lost;                 /* the stream ends before what this instance applied */
    int behind;               /* ... or was trimmed past it: this instance missed changes */
    cl_pending *waiting;       /* changes whose answer waits for the reader */
    int changes;              /* ... and all pending, waiting or calling */
} CL;

/* "ms-seq" ids, compared as the pairs of numbers they are. */
static int sid_cmp(const char *a, const char *b) {
    unsigned long long am = 0, as = 0, bm = 0, bs = 0;
    sscanf(a, "%llu-%llu", &am, &as);
    sscanf(b, "%llu-%llu", &bm, &bs);
    return am != bm ? (am < bm ? -1 : 1) : as != bs ? (as < bs ? -1 : 1) : 0;
}

static void rl_connect(void *ctx);

/* Lose the link: close it, fail what waits on it, reconnect later. */
/* Where link l connects: the primary, or the Sentinel asked now. */
static const char *rl_host(const rlink *l, int *port) {
    int i = CL.seni;
    *port = l == &CL.sent ? CL.sen[i].port : CL.port;
    return l == &CL.sent ? CL.sen[i].host : CL.host;
}

/* Close l's connection, with nothing to say (rl_fail says why, and retries). */
static void rl_close(rlink *l) {
    if (l->fd >= 0) loop_close(l->fd);
    l->fd = -1;
    l->state = RL_DOWN;
    l->in.len = l->out.len = 0;
    timer_stop(&l->t);
}

static void rl_fail(rlink *l, const char *why) {
    int port;
    const char *host = rl_host(l, &port);
    if (l->state == RL_UP) ltg_log("cluster: %s link to %s:%d lost: %s", l->name, host, port, why);
    else if (strncmp(why, l->said, sizeof l->said - 1) != 0)
        ltg_log("cluster: %s link to %s:%d: %s (retrying)", l->name, host, port, why);
    snprintf(l->said, sizeof l->said, "%s", why);
    rl_close(l);
    if (l == &CL.sent) CL.seni = (CL.seni + 1) % CL.nsen; /* the next Sentinel, next time */
    while (l->qlen) { /* a callback may queue again: on a link that is down, it fails */
        int i = l->qhead;
        l->qhead = (l->qhead + 1) % l->qcap;
        l->qlen--;
        l->q[i].fn(l->q[i].ctx, NULL, NULL);
    }
    int64_t jitter = (int64_t)(rng_next() % (uint64_t)(l->backoff_ms / 2 + 1));
    timer_set(&l->t, l->backoff_ms / 2 + jitter);
    l->backoff_ms = l->backoff_ms * 2 > CL_BACKOFF_MAX_MS ? CL_BACKOFF_MAX_MS : l->backoff_ms * 2;
}

static void rl_timer(void *ctx) {
    rlink *l = ctx;
    if (l->state == RL_DOWN) rl_connect(l);
    else rl_fail(l, "no reply within 3 s");
}

/* Queue a call (a command already in RESP); LTG_ERR (and no callback)
 * when the link cannot take it. */
static int rl_call_raw(rlink *l, rl_reply *fn, void *ctx, const buf *cmd) {
    if (l->state == RL_DOWN || l->state == RL_CONNECTING || l->qlen == CL_MAX_CALLS)
        return LTG_ERR;
    if (l->qlen == l->qcap) {
        int cap = l->qcap ? l->qcap * 2 : 16;
        void *q = xcalloc((size_t)cap, sizeof *l->q);
        for (int i = 0; i < l->qlen; i++)
            memcpy((char *)q + (size_t)i * sizeof *l->q, &l->q[(l->qhead + i) % l->qcap],
                   sizeof *l->q);
        free(l->q);
        l->q = q;
        l->qcap = cap;
        l->qhead = 0;
    }
    int i = (l->qhead + l->qlen++) % l->qcap;
    l->q[i].fn = fn;
    l->q[i].ctx = ctx;
    l->q[i].at = S.now;
    buf_append(&l->out, cmd->p, cmd->len);
    loop_events(l->fd, POLLIN | POLLOUT);
    if (l->qlen == 1) {
        l->due = S.now + CL_TIMEOUT_MS;
        timer_set(&l->t, CL_TIMEOUT_MS);
    }
    return 0;
}

static int rl_call(rlink *l, rl_reply *fn, void *ctx, const rarg *a, int argc) {
    buf cmd = {0};
    resp_cmd(&cmd, a, argc);
    int rc = rl_call_raw(l, fn, ctx, &cmd);
    buf_free(&cmd);
    return rc;
}

/* Is the reply just read an error that begins with `prefix`? */
static int rl_error_is(const rlink *l, const char *prefix) {
    size_t n = strlen(prefix);
    const resp_tok *t = &l->tok[0];
    return t->type == '-' && t->len >= n && !memcmp(l->in.p + t->off, prefix, n);
}

/* Replies in: each to the oldest waiting call. After it, an answer that
 * says the server no longer takes ltg's writes fails the link. */
static void rl_replies(rlink *l) {
    while (l->state != RL_DOWN && l->in.len) {
        size_t at = 0;
        int nt = 0, r = resp_elem(l->in.p, l->in.len, &at, l->tok, RESP_MAX_TOKS, &nt, 0);
        if (r == 0 && l->in.len > RESP_MAX_REPLY) r = LTG_ERR;
        if (r == 0) return;
        if (r < 0 && l == &CL.tail) CL.unread = CL.unread ? 2 : 1; /* see cl_tail_read */
        if (r < 0 || !l->qlen) {
            rl_fail(l, r < 0 && l == &CL.tail ? "a read too large to take, or not RESP: read "
                                                "again in smaller steps"
                       : r < 0                  ? "a reply that is not RESP"
                                                : "a reply to no call");
            return;
        }
        int i = l->qhead;
        l->qhead = (l->qhead + 1) % l->qcap;
        l->qlen--;
        l->due = S.now + CL_TIMEOUT_MS;
        int fd = l->fd;
        if (l == &CL.cmd) metric_observe(M_CLUSTER_CALL, (double)(S.now - l->q[i].at) / 1000, NULL);
        l->q[i].fn(l->q[i].ctx, l->in.p, l->tok);
        if (l->fd != fd) return; /* the callback failed the link */
        if (rl_error_is(l, "READONLY")) {
            rl_fail(l, "the server is a replica now (READONLY): the primary moved");
            return;
        }
        if (rl_error_is(l, "ERR Function not found")) {
            rl_fail(l, "the server lost ltg's functions (flushed, or made a replica): loaded again "
                       "on reconnecting");
            return;
        }
        buf_consume(&l->in, at);
    }
}

static void rl_io(void *ctx, int revents) {
    rlink *l = ctx;
    if (l->state == RL_CONNECTING) {
        int err = 0;
        socklen_t n = sizeof err;
        getsockopt(l->fd, SOL_SOCKET, SO_ERROR, &err, &n);
        if (err || (revents & (POLLERR | POLLHUP))) {
            rl_fail(l, strerror(err ? err : ECONNREFUSED));
            return;
        }
        l->state = RL_HELLO;
        l->due = S.now + CL_TIMEOUT_MS;
        loop_events(l->fd, POLLIN);
        l->hello(l);
    }
    if (l->out.len && (revents & POLLOUT)) {
        ssize_t n = send(l->fd, l->out.p, l->out.len, MSG_NOSIGNAL);
        if (n < 0 && errno != EAGAIN) { rl_fail(l, strerror(errno)); return; }
        if (n > 0) buf_consume(&l->out, (size_t)n);
        if (!l->out.len) loop_events(l->fd, POLLIN);
    }
    if (revents & (POLLIN | POLLHUP | POLLERR)) {
        for (;;) {
            buf_reserve(&l->in, READ_CHUNK);
            ssize_t n = recv(l->fd, l->in.p + l->in.len, READ_CHUNK, 0);
            if (n > 0) { l->in.len += (size_t)n; continue; }
            if (n == 0) { /* what came before the close is answered first */
                int fd = l->fd;
                rl_replies(l);
                if (l->fd == fd && l->state != RL_DOWN)
                    rl_fail(l, "the server closed the connection");
                return;
            }
            if (errno == EAGAIN || errno == EINTR) break;
            rl_fail(l, strerror(errno));
            return;
        }
        rl_replies(l);
    }
    if (l->state != RL_DOWN && l->qlen) timer_set(&l->t, l->due - S.now);
    else if (l->state != RL_DOWN) timer_stop(&l->t); /* an idle link waits for nothing */
}

static void cl_discover(rlink *l);

static void rl_connect(void *ctx) {
    rlink *l = ctx;
    struct sockaddr_storage ss;
    const char *err = NULL;
    int port;
    if (CL.nsen && l != &CL.sent && !l->discover) { cl_discover(l); return; }
    l->discover = 0;
    const char *host = rl_host(l, &port);
    int r = dns_resolve(host, NULL, &ss, &err);
    if (r == LTG_AGAIN) { timer_set(&l->t, 50); return; } /* the answer will be cached */
    if (r < 0) { rl_fail(l, err); return; }
    addr_set_port(&ss, port);
    l->fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (l->fd < 0) { rl_fail(l, strerror(errno)); return; }
    setsockopt(l->fd, IPPROTO_TCP, TCP_NODELAY, &(int){1}, sizeof(int));
    if (connect(l->fd, (struct sockaddr *)&ss, addr_len(&ss)) < 0 && errno != EINPROGRESS) {
        rl_fail(l, strerror(errno));
        return;
    }
    l->state = RL_CONNECTING;
    loop_watch(l->fd, POLLOUT, rl_io, l);
    timer_set(&l->t, CL_TIMEOUT_MS);
}

/* With sentinel://, each (re)connect of a link to the primary first asks a
 * Sentinel where the primary is (a failover moves it): link l waits, and
 * the Sentinel link, one call long, asks the Sentinels in turn. */
static void cl_discover(rlink *l) {
    l->discover = 1;
    if (CL.sent.state == RL_DOWN && CL.sent.t.slot < 0) rl_connect(&CL.sent);
}

/* SENTINEL get-master-addr-by-name's answer: [ip, port], or null (a name it does not know). */
static void cl_sentinel_reply(void *ctx, const char *p, const resp_tok *t) {
    rlink *l = ctx;
    long long port;
    char why[200];
    if (!t) return;
    if (t[0].type != '*' || t[0].num != 2 || t[1].type != '$' || t[2].type != '$' ||
        t[1].len >= sizeof CL.host || parse_ll(p + t[2].off, t[2].len, 65535, &port) < 0) {
        rl_fail(l, t[0].type == '-' ? resp_why("SENTINEL", p, t, why, sizeof why)
                                    : "it does not know the primary's name (see --cluster)");
        return;
    }
    char host[sizeof CL.host];
    snprintf(host, sizeof host, "%.*s", (int)t[1].len, p + t[1].off);
    if (!t[1].len || strspn(host, "0123456789abcdefghijklmnopqrstuvwxyz"
                                  "ABCDEFGHIJKLMNOPQRSTUVWXYZ.-_:") != t[1].len) {
        char shown[80];
        log_escape(p + t[1].off, t[1].len, shown, sizeof shown);
        snprintf(why, sizeof why, "it named a primary that is not a host name or address: %s",
                 shown);
        rl_fail(l, why);
        return;
    }
    if (strcmp(host, CL.host) != 0 || port != CL.port)
        ltg_log("cluster: Sentinel %s:%d says the primary of %s is %s:%lld", CL.sen[CL.seni].host,
                CL.sen[CL.seni].port, CL.master, host, port);
    memcpy(CL.host, host, sizeof host);
    CL.port = (int)port;
    rl_close(l);
    l->backoff_ms = CL_BACKOFF_MIN_MS;
    rlink *links[2] = {&CL.cmd, &CL.tail};
    for (int i = 0; i < 2; i++)
        if (links[i]->discover) rl_connect(links[i]);
}

static void rl_hello_reply(void *ctx, const char *p, const resp_tok *t);

/* The Sentinel link's handshake: AUTH (with --cluster-sentinel-password-env), then the one
 * question. */
static void cl_sentinel_ask(rlink *l) {
    if (CL.sen_password)
        rl_call(l, rl_hello_reply, l, (rarg[]){RA("AUTH"), RA(CL.sen_password)}, 2);
    rl_call(l, cl_sentinel_reply, l,
            (rarg[]){RA("SENTINEL"), RA("get-master-addr-by-name"), RA(CL.master)}, 3);
}

/* The handshake: AUTH, SELECT, ROLE (each reply checked), then the link's own. */
static void rl_hello_reply(void *ctx, const char *p, const resp_tok *t) {
    rlink *l = ctx;
    if (!t) return;
    char why[200];
    if (t[0].type == '-') rl_fail(l, resp_why("the handshake", p, t, why, sizeof why));
}

static void rl_role_reply(void *ctx, const char *p, const resp_tok *t) {
    rlink *l = ctx;
    if (!t) return;
    if (t[0].type == '-') { /* -LOADING after a restart, -NOAUTH...: said, and again later */
        rl_hello_reply(ctx, p, t);
        return;
    }
    if (t[0].type != '*' || t[0].num < 1 || !resp_is(p, t, 1, "master")) {
        rl_fail(l, "the server is not a primary (ROLE): ltg writes to the primary only");
        return;
    }
    if (l->up) l->up(l);
}

static void rl_hello(rlink *l) {
    char db[16];
    snprintf(db, sizeof db, "%d", CL.db);
    if (CL.password) rl_call(l, rl_hello_reply, l, (rarg[]){RA("AUTH"), RA(CL.password)}, 2);
    if (CL.db) rl_call(l, rl_hello_reply, l, (rarg[]){RA("SELECT"), RA(db)}, 2);
    rl_call(l, rl_role_reply, l, (rarg[]){RA("ROLE")}, 1);
}

/* ltg's functions in Redis: one library, its names versioned, so that an
 * instance never calls code of another version during a rolling upgrade
 * (a new version adds ltg_cp_v2 beside ltg_cp_v1, and the old instances
 * keep calling theirs). Loaded by every instance on every connect. The
 * control plane's, ltg_cp_v1, then the money's: ltg_hold_v1,
 * ltg_settle_v1 and _v2, ltg_renew_v1, and the reader's ltg_peek_v1 and
 * ltg_info_v1 (their keys and arguments are described in
 * the Lua; see "the shared money" below).
 *
 * ltg_cp_v1: one control-plane change, all or nothing.
 *   KEYS: ltg:log (the stream), ltg:ver (item id -> version, or "deleted"),
 *         the change's idempotency key (a hash, kept IDEM_TTL_MS)
 *   ARGV: item id, the version the change was built on (0: a new item),
 *         its parent group's id ("" none), the record, the body's SHA-256,
 *         the kept answer's status, version and body, the new version (or
 *         "deleted"), the idempotency key's lifetime in ms
 *   Returns {"ok", stream id}, {"replay", status, version, body},
 *   {"conflict"} (the key was used with another body), or {"stale", the
 *   stream's last id} (the item or its group changed first). */
static const char CL_LIBRARY[] =
    "#!lua name=ltg_v1\n"
    "local function cp(keys, a)\n"
    "  local kept = redis.call('HMGET', keys[3], 'body', 'status', 'version', 'answer')\n"
    "  if kept[1] then\n"
    "    if kept[1] ~= a[5] then return {'conflict'} end\n"
    "    return {'replay', kept[2], kept[3], kept[4]}\n"
    "  end\n"
    "  local cur = redis.call('HGET', keys[2], a[1]) or '0'\n"
    "  if a[3] ~= '' and redis.call('HEXISTS', keys[2], a[3]) == 0 then cur = 'gone' end\n"
    "  if cur ~= a[2] then\n"
    "    local last = redis.call('XREVRANGE', keys[1], '+', '-', 'COUNT', 1)\n"
    "    return {'stale', last[1] and last[1][1] or '0-0'}\n"
    "  end\n"
    "  local id = redis.call('XADD', keys[1], '*', 'r', a[4])\n"
    "  if a[9] ~= 'deleted' then redis.call('HSET', keys[2], a[1], a[9]) end\n"
    "  for i = 11, #a do -- a deletion: the item's (and a group's keys') versions and counts go\n"
    "    redis.call('HDEL', keys[2], string.sub(a[i], 3))\n"
    "    for _, k in ipairs({'ltg:b:', 'ltg:r:', 'ltg:h:', 'ltg:par:'}) do\n"
    "      redis.call('DEL', k .. a[i])\n"
    "    end\n"
    "  end\n"
    "  redis.call('HSET', keys[3], 'body', a[5], 'status', a[6], 'version', a[7], 'answer', a[8])\n"
    "  redis.call('PEXPIRE', keys[3], a[10])\n"
    "  return {'ok', id}\n"
    "end\n"
    "redis.register_function('ltg_cp_v1', cp)\n"
    "-- The money and the windows. A scope is \"k:<key id>\" or \"g:<group id>\".\n"
    "--   ltg:b:<scope>    hash: p (the budget period's start, ms), spent, held (nano-USD)\n"
    "--   ltg:r:<scope>    hash: r<second> requests, t<second> tokens, of the last 60 s\n"
    "--   ltg:h:<scope>    zset: hold id -> the end of its lease (ms, Redis's clock)\n"
    "--   ltg:par:<scope>  zset: hold id -> the end of its lease (a group's requests in flight)\n"
    "--   ltg:hv           hash: hold id -> \"cost tokens second par claim scope...\"\n"
    "--                    (par: the group's scope when it holds a parallel slot, else -;\n"
    "--                    claim: its Idempotency-Key's, else -)\n"
    "--   ltg:ik:<sha>     hash: body (the request's SHA-256), sid (its event's id in\n"
    "--                    ltg:events once answered): the claim of an Idempotency-Key\n"
    "--   ltg:seq:<owner>  the last settle applied from that instance (a boot of it)\n"
    "--   ltg:insts        hash: instance -> \"<last ltg:log id applied> <ms>\" (ltg_trim_v1)\n"
    "local function now_ms()\n"
    "  local t = redis.call('TIME')\n"
    "  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
    "end\n"
    "local function words(s)\n"
    "  local w = {}\n"
    "  for x in string.gmatch(s, '%S+') do w[#w + 1] = x end\n"
    "  return w\n"
    "end\n"
    "-- Let hold `id` go: its cost leaves each scope's held, its slot its group.\n"
    "local function release(id)\n"
    "  local v = redis.call('HGET', 'ltg:hv', id)\n"
    "  if not v then return nil end\n"
    "  local f = words(v)\n"
    "  for i = 6, #f do -- a scope deleted meanwhile has no counts left to lower\n"
    "    if redis.call('EXISTS', 'ltg:b:' .. f[i]) == 1 then\n"
    "      redis.call('HINCRBY', 'ltg:b:' .. f[i], 'held', -tonumber(f[1]))\n"
    "    end\n"
    "    redis.call('ZREM', 'ltg:h:' .. f[i], id)\n"
    "  end\n"
    "  if f[4] ~= '-' then redis.call('ZREM', 'ltg:par:' .. f[4], id) end\n"
    "  redis.call('HDEL', 'ltg:hv', id)\n"
    "  return f\n"
    "end\n"
    "-- Holds whose lease ended (their instance died) go.\n"
    "local function reap(zset, now)\n"
    "  for _, id in ipairs(redis.call('ZRANGEBYSCORE', zset, '-inf', now)) do\n"
    "    if not release(id) then redis.call('ZREM', zset, id) end\n"
    "  end\n"
    "end\n"
    "-- A scope's spent and held, in the period that starts at p (a later period\n"
    "-- starts with nothing spent; an earlier p is a caller behind: the current one).\n"
    "local function budget(scope, p)\n"
    "  local b = 'ltg:b:' .. scope\n"
    "  if p > tonumber(redis.call('HGET', b, 'p') or '-1') then\n"
    "    redis.call('HSET', b, 'p', p, 'spent', 0)\n"
    "  end\n"
    "  local v = redis.call('HMGET', b, 'spent', 'held')\n"
    "  return tonumber(v[1] or '0'), tonumber(v[2] or '0')\n"
    "end\n"
    "-- Seconds until `need` more requests (kind r) or tokens (t) fit under\n"
    "-- `limit` in the 60 s up to second `sec` (0: now; -1 limit: none).\n"
    "local function window(scope, kind, sec, need, limit)\n"
    "  local all = redis.call('HGETALL', 'ltg:r:' .. scope)\n"
    "  local used, per, old = 0, {}, {}\n"
    "  for i = 1, #all, 2 do\n"
    "    local s = tonumber(string.sub(all[i], 2))\n"
    "    if s <= sec - 60 then old[#old + 1] = all[i]\n"
    "    elseif string.sub(all[i], 1, 1) == kind then\n"
    "      used = used + tonumber(all[i + 1])\n"
    "      per[#per + 1] = {s, tonumber(all[i + 1])}\n"
    "    end\n"
    "  end\n"
    "  if #old > 0 then redis.call('HDEL', 'ltg:r:' .. scope, unpack(old)) end\n"
    "  if limit < 0 or used + need <= limit then return 0 end\n"
    "  table.sort(per, function(x, y) return x[1] < y[1] end)\n"
    "  for _, e in ipairs(per) do\n"
    "    used = used - e[2]\n"
    "    if used + need <= limit then return e[1] + 60 - sec end\n"
    "  end\n"
    "  return 60\n"
    "end\n"
    "-- ltg_hold_v1: ARGV hold id, first (1: the request's first attempt, which\n"
    "-- counts a request and takes a parallel slot), cost (nano-USD), tokens,\n"
    "-- lease (ms), the group's scope and its max_parallel_requests (-1: none),\n"
    "-- the Idempotency-Key's claim ('' none) and the body's SHA-256, then per\n"
    "-- scope: scope, budget cap (-1: none), period start, rpm, tpm. All or\n"
    "-- nothing: {'ok', second, spent, held, spent, held...}, {'refused', scope\n"
    "-- index from 0, limit, seconds to wait or nano-USD left}, or {'claimed',\n"
    "-- 'conflict' (another body), 'busy' (its request runs) or 'done', sid}.\n"
    "local function hold(keys, a)\n"
    "  local id, first, cost, tok = a[1], a[2] == '1', tonumber(a[3]), tonumber(a[4])\n"
    "  local now = now_ms()\n"
    "  local sec, lease = math.floor(now / 1000), now + tonumber(a[5])\n"
    "  local par, maxpar, claim = a[6], tonumber(a[7]), a[8]\n"
    "  local n = (#a - 9) / 5\n"
    "  local function arg(i, k) return a[9 + 5 * i + k] end\n"
    "  if first and claim ~= '' then\n"
    "    local c = redis.call('HMGET', claim, 'body', 'sid')\n"
    "    if c[1] and c[1] ~= a[9] then return {'claimed', 'conflict'} end\n"
    "    if c[2] then return {'claimed', 'done', c[2]} end\n"
    "    if c[1] then return {'claimed', 'busy'} end\n"
    "  end\n"
    "  for i = 0, n - 1 do reap('ltg:h:' .. arg(i, 1), now) end\n"
    "  if first and maxpar >= 0 then\n"
    "    reap('ltg:par:' .. par, now)\n"
    "    if redis.call('ZCARD', 'ltg:par:' .. par) >= maxpar then\n"
    "      return {'refused', n - 1, 'max_parallel_requests', 1}\n"
    "    end\n"
    "  end\n"
    "  for i = 0, n - 1 do\n"
    "    local w = first and window(arg(i, 1), 'r', sec, 1, tonumber(arg(i, 4))) or 0\n"
    "    if w > 0 then return {'refused', i, 'rpm_limit', w} end\n"
    "    w = window(arg(i, 1), 't', sec, tok, tonumber(arg(i, 5)))\n"
    "    if w > 0 then return {'refused', i, 'tpm_limit', w} end\n"
    "  end\n"
    "  for i = 0, n - 1 do\n"
    "    local cap = tonumber(arg(i, 2))\n"
    "    local spent, held = budget(arg(i, 1), tonumber(arg(i, 3)))\n"
    "    if cap >= 0 and spent + held + cost > cap then\n"
    "      return {'refused', i, 'max_budget', math.max(cap - spent - held, 0)}\n"
    "    end\n"
    "  end\n"
    "  local v = redis.call('HGET', 'ltg:hv', id)\n"
    "  local f = v and words(v) or {0, 0, sec, maxpar >= 0 and par or '-', '-'}\n"
    "  if first and claim ~= '' then\n"
    "    f[5] = claim\n"
    "    redis.call('HSET', claim, 'body', a[9])\n"
    "    redis.call('PEXPIRE', claim, tonumber(a[5]))\n"
    "  end\n"
    "  local got, scopes = {'ok', tonumber(f[3])}, ''\n"
    "  for i = 0, n - 1 do\n"
    "    local scope = arg(i, 1)\n"
    "    scopes = scopes .. ' ' .. scope\n"
    "    redis.call('HINCRBY', 'ltg:b:' .. scope, 'held', cost)\n"
    "    redis.call('ZADD', 'ltg:h:' .. scope, lease, id)\n"
    "    if tonumber(arg(i, 4)) >= 0 or tonumber(arg(i, 5)) >= 0 then\n"
    "      if first then redis.call('HINCRBY', 'ltg:r:' .. scope, 'r' .. sec, 1) end\n"
    "      redis.call('HINCRBY', 'ltg:r:' .. scope, 't' .. f[3], tok)\n"
    "      redis.call('EXPIRE', 'ltg:r:' .. scope, 120)\n"
    "    end\n"
    "    local spent, held = budget(scope, tonumber(arg(i, 3)))\n"
    "    got[#got + 1] = spent\n"
    "    got[#got + 1] = held\n"
    "  end\n"
    "  if first and maxpar >= 0 then redis.call('ZADD', 'ltg:par:' .. par, lease, id) end\n"
    "  local sum = (tonumber(f[1]) + cost) .. ' ' .. (tonumber(f[2]) + tok)\n"
    "  redis.call('HSET', 'ltg:hv', id, sum .. ' ' .. table.concat(f, ' ', 3, 5) .. scopes)\n"
    "  return got\n"
    "end\n"
    "-- ltg_settle_v1: ARGV owner, seq, hold id ('' none), what ('end' or 'shrink'),\n"
    "-- cost (nano-USD: charged, or let go), tokens (used, or let go), the spend\n"
    "-- event ('' none), then per scope: scope, period start. Applied once per\n"
    "-- (owner, seq): a repeat after a lost reply is {'dup'}. An end charges `cost`\n"
    "-- even when the hold's lease ran out meanwhile, and adds the event to\n"
    "-- ltg:events (fields o owner, q seq, e event, b \"scope spent held...\");\n"
    "-- {'ok', spent, held...} per scope.\n"
    "local function settle(keys, a)\n"
    "  local seqkey, seq = 'ltg:seq:' .. a[1], tonumber(a[2])\n"
    "  if tonumber(redis.call('GET', seqkey) or '0') >= seq then return {'dup'} end\n"
    "  redis.call('SET', seqkey, seq, 'EX', 2592000)\n"
    "  local id, cost, tok = a[3], tonumber(a[5]), tonumber(a[6])\n"
    "  local v = redis.call('HGET', 'ltg:hv', id)\n"
    "  local f = v and words(v)\n"
    "  local sec, got = math.floor(now_ms() / 1000), {'ok'}\n"
    "  if f and a[4] == 'end' then release(id) end\n"
    "  if f and a[4] == 'shrink' then\n"
    "    for i = 6, #f do redis.call('HINCRBY', 'ltg:b:' .. f[i], 'held', -cost) end\n"
    "    local left = (tonumber(f[1]) - cost) .. ' ' .. (tonumber(f[2]) - tok)\n"
    "    redis.call('HSET', 'ltg:hv', id, left .. ' ' .. table.concat(f, ' ', 3))\n"
    "  end\n"
    "  local b = {}\n"
    "  for i = 8, #a, 2 do\n"
    "    if a[4] == 'end' then\n"
    "      budget(a[i], tonumber(a[i + 1]))\n"
    "      redis.call('HINCRBY', 'ltg:b:' .. a[i], 'spent', cost)\n"
    "    end\n"
    "    local delta = a[4] == 'end' and f and tok - tonumber(f[2]) or -tok\n"
    "    local r, slot = 'ltg:r:' .. a[i], 't' .. (f and f[3] or '')\n"
    "    if f and tonumber(f[3]) > sec - 60 and redis.call('HEXISTS', r, slot) == 1 then\n"
    "      if redis.call('HINCRBY', r, slot, delta) < 0 then redis.call('HSET', r, slot, 0) end\n"
    "    end\n"
    "    local spent, held = budget(a[i], tonumber(a[i + 1]))\n"
    "    got[#got + 1] = spent\n"
    "    got[#got + 1] = held\n"
    "    b[#b + 1] = a[i] .. ' ' .. spent .. ' ' .. held\n"
    "  end\n"
    "  local sid = a[7] ~= '' and redis.call('XADD', 'ltg:events', '*', 'o', a[1], 'q', a[2],\n"
    "                                       'e', a[7], 'b', table.concat(b, ' '))\n"
    "  if f and f[5] ~= '-' and a[4] == 'end' then -- a kept answer is replayed from the ledger\n"
    "    if sid and bit.band(string.byte(a[7], 3), 2) ~= 0 then\n"
    "      redis.call('HSET', f[5], 'sid', sid)\n"
    "      redis.call('PEXPIRE', f[5], 86400000)\n"
    "    else redis.call('DEL', f[5]) end\n"
    "  end\n"
    "  return got\n"
    "end\n"
    "-- ltg_renew_v1: ARGV lease (ms), then hold ids: each lease extended (its\n"
    "-- request still runs); {ids whose hold is gone}.\n"
    "local function renew(keys, a)\n"
    "  local lease, gone = now_ms() + tonumber(a[1]), {}\n"
    "  for i = 2, #a do\n"
    "    local v = redis.call('HGET', 'ltg:hv', a[i])\n"
    "    if not v then gone[#gone + 1] = a[i] else\n"
    "      local f = words(v)\n"
    "      for j = 6, #f do redis.call('ZADD', 'ltg:h:' .. f[j], 'XX', lease, a[i]) end\n"
    "      if f[4] ~= '-' then redis.call('ZADD', 'ltg:par:' .. f[4], 'XX', lease, a[i]) end\n"
    "      if f[5] ~= '-' then redis.call('PEXPIRE', f[5], tonumber(a[1])) end\n"
    "    end\n"
    "  end\n"
    "  return gone\n"
    "end\n"
    "-- ltg_trim_v1: ARGV this instance (a boot of it), the last ltg:log id and the\n"
    "-- last ltg:events id it applied. Each stream keeps what an instance heard from\n"
    "-- in 7 days has not applied yet; ltg:events no more than CL_EVENTS_KEEP_MS.\n"
    "local function before(x, y)\n"
    "  local xm, xs = string.match(x, '(%d+)-(%d+)')\n"
    "  local ym, ys = string.match(y, '(%d+)-(%d+)')\n"
    "  xm, xs, ym, ys = tonumber(xm), tonumber(xs), tonumber(ym), tonumber(ys)\n"
    "  return xm < ym or (xm == ym and xs < ys)\n"
    "end\n"
    "local function trim(keys, a)\n"
    "  local now, low, lowev = now_ms(), nil, nil\n"
    "  local keep = (now - tonumber(a[4])) .. '-0'\n"
    "  redis.call('HSET', 'ltg:insts', a[1], a[2] .. ' ' .. now .. ' ' .. a[3])\n"
    "  local all = redis.call('HGETALL', 'ltg:insts')\n"
    "  for i = 1, #all, 2 do\n"
    "    local f = words(all[i + 1])\n"
    "    if tonumber(f[2]) < now - 7 * 86400000 then redis.call('HDEL', 'ltg:insts', all[i])\n"
    "    else\n"
    "      if not low or before(f[1], low) then low = f[1] end\n"
    "      if not lowev or before(f[3] or '0-0', lowev) then lowev = f[3] or '0-0' end\n"
    "    end\n"
    "  end\n"
    "  if before(lowev, keep) then lowev = keep end\n"
    "  redis.call('XTRIM', 'ltg:events', 'MINID', lowev)\n"
    "  return redis.call('XTRIM', 'ltg:log', 'MINID', low)\n"
    "end\n"
    "-- ltg_peek_v1: ARGV the last ltg:log id and the last ltg:events id read. The\n"
    "-- next entry of each, as {id ('' none), bytes, fields}: what the reader cannot\n"
    "-- take whole, it skips.\n"
    "local function peek(keys, a)\n"
    "  local out = {}\n"
    "  for i, k in ipairs({'ltg:log', 'ltg:events'}) do\n"
    "    local e = redis.call('XRANGE', k, '(' .. a[i], '+', 'COUNT', 1)[1]\n"
    "    local n = 0\n"
    "    for _, v in ipairs(e and e[2] or {}) do n = n + #v end\n"
    "    out[#out + 1] = e and e[1] or ''\n"
    "    out[#out + 1] = n\n"
    "    out[#out + 1] = e and #e[2] or 0\n"
    "  end\n"
    "  return out\n"
    "end\n"
    "redis.register_function('ltg_peek_v1', peek)\n"
    "-- ltg_info_v1: ARGV a stream. What XINFO STREAM says of it, but for its first\n"
    "-- and last entries: an error for a stream that does not exist.\n"
    "local function info(keys, a)\n"
    "  local r = redis.pcall('XINFO', 'STREAM', a[1])\n"
    "  if r.err then return r end\n"
    "  local out = {}\n"
    "  for i = 1, #r, 2 do\n"
    "    if type(r[i + 1]) ~= 'table' then\n"
    "      out[#out + 1] = r[i]\n"
    "      out[#out + 1] = r[i + 1]\n"
    "    end\n"
    "  end\n"
    "  return out\n"
    "end\n"
    "redis.register_function('ltg_info_v1', info)\n"
    "redis.register_function('ltg_trim_v1', trim)\n"
    "redis.register_function('ltg_hold_v1', hold)\n"
    "redis.register_function('ltg_settle_v1', settle)\n"
    "-- ltg_settle_v2: ltg_settle_v1's, with prev after seq: the number of the op\n"
    "-- of this owner that must be applied first (0: none). One sent while that one\n"
    "-- was refused (NOREPLICAS, OOM, BUSY in the middle of a pipeline) is not applied\n"
    "-- either: {'gap', last applied}; it is sent again after it, in order.\n"
    "local function settle2(keys, a)\n"
    "  local last = tonumber(redis.call('GET', 'ltg:seq:' .. a[1]) or '0')\n"
    "  if last >= tonumber(a[2]) then return {'dup'} end\n"
    "  if last < tonumber(a[3]) then return {'gap', last} end\n"
    "  table.remove(a, 3)\n"
    "  return settle(keys, a)\n"
    "end\n"
    "redis.register_function('ltg_settle_v2', settle2)\n"
    "redis.register_function('ltg_renew_v1', renew)\n";

static void cl_tail_read(void);
static void cl_outbox_pump(void);

static void cl_loaded(void *ctx, const char *p, const resp_tok *t) {
    rlink *l = ctx;
    if (!t) return;
    char why[200];
    if (t[0].type == '-') {
        rl_fail(l, resp_why("FUNCTION LOAD", p, t, why, sizeof why));
        return;
    }
    l->state = RL_UP;
    l->backoff_ms = CL_BACKOFF_MIN_MS;
    ltg_log("cluster: command link to %s:%d up (functions ltg_v1 loaded)", CL.host, CL.port);
    cl_outbox_pump(); /* what a lost link left unacknowledged, again, in order */
}

static void cl_cmd_up(rlink *l) {
    rarg a[] = {RA("FUNCTION"), RA("LOAD"), RA("REPLACE"), {CL_LIBRARY, sizeof CL_LIBRARY - 1}};
    rl_call(l, cl_loaded, l, a, 4);
}

/* What XINFO STREAM says of a stream: its last id, its first, and whether it
 * was trimmed. 0; LTG_AGAIN for an empty stream (-ERR no such key: not made
 * yet); LTG_ERR for another error (-LOADING while a restarted Redis reads
 * its append-only file...: the link fails, and asks again later). */
typedef struct {
    char last[32], first[32];
    int trimmed;
} xinfo;

static int xinfo_read(rlink *l, const char *p, const resp_tok *t, xinfo *x) {
    long long length = 0, added = 0;
    *x = (xinfo){"0-0", "0-0", 0};
    if (t[0].type == '*') /* pairs of a name and its value */
        for (int i = 1, n = 0; n + 1 < t[0].num; n += 2, i = t[t[i].next].next) {
            const resp_tok *v = &t[t[i].next];
            char *into = resp_is(p, t, i, "last-generated-id")         ? x->last
                         : resp_is(p, t, i, "recorded-first-entry-id") ? x->first
                                                                       : NULL;
            if (into && v->type == '$' && v->len < sizeof x->last)
                snprintf(into, sizeof x->last, "%.*s", (int)v->len, p + v->off);
            if (resp_is(p, t, i, "length") && v->type == ':') length = v->num;
            if (resp_is(p, t, i, "entries-added") && v->type == ':') added = v->num;
        }
    else if (t[0].type != '-' || t[0].len < 15 ||
             memcmp(p + t[0].off, "ERR no such key", 15) != 0) {
        char why[200];
        rl_fail(l, resp_why("XINFO STREAM", p, t, why, sizeof why));
        return LTG_ERR;
    }
    x->trimmed = added > length;
    return t[0].type == '*' ? 0 : LTG_AGAIN;
}

/* ltg:events: a ledger that the stream was trimmed past (an instance away
 * longer than it keeps) misses events; one that Redis lost events from has
 * some the others may not. Both are said; the reader goes on. */
static void cl_events_checked(void *ctx, const char *p, const resp_tok *t) {
    rlink *l = ctx;
    xinfo x;
    if (!t || xinfo_read(l, p, t, &x) == LTG_ERR) return;
    const char *had = CL.ev_applied[0] ? CL.ev_applied : "0-0";
    if (x.trimmed && sid_cmp(had, x.first) < 0)
        ltg_log("cluster: ltg:events was trimmed past this instance's ledger (it has events to "
                "%s; the stream begins at %s): the events between are missing here; copy the "
                "sealed days of DATA/ledger from another instance (README \"Several instances\")",
                had, x.first);
    if (sid_cmp(x.last, had) < 0)
        ltg_log("cluster: ltg:events ends at %s, before %s, which this instance's ledger has: "
                "Redis lost events (restarted without its append-only file, or a failover lost "
                "them)", x.last, had);
    l->state = RL_UP;
    l->backoff_ms = CL_BACKOFF_MIN_MS;
    CL.heard = S.now;
    ltg_log("cluster: stream link to %s:%d up, reading ltg:log after %s, ltg:events after %s",
            CL.host, CL.port, CL.applied[0] ? CL.applied : "its start", had);
    cl_tail_read();
}

/* What XINFO STREAM says of ltg:log, asked before reading it. A stream
 * whose last id is before what this instance applied lost changes (a
 * Redis restarted without its append-only file, a failover to a replica
 * that had not received them); one trimmed past what it applied (an
 * instance away longer than the trim keeps) cannot give it what it missed. */
static void cl_tail_checked(void *ctx, const char *p, const resp_tok *t) {
    rlink *l = ctx;
    xinfo x;
    if (!t || xinfo_read(l, p, t, &x) == LTG_ERR) return;
    int lost = CL.applied[0] && sid_cmp(x.last, CL.applied) < 0;
    /* trimmed (ltg_trim_v1 keeps what every instance applied): what it applied is gone too */
    int behind = x.trimmed && sid_cmp(CL.applied[0] ? CL.applied : "0-0", x.first) < 0;
    if (lost && !CL.lost)
        ltg_log("cluster: the shared stream ltg:log ends at %s, before %s, which this instance "
                "applied: Redis lost changes (restarted without its append-only file, or a "
                "failover lost them); control-plane changes are refused until it is restored "
                "(README \"Several instances\")", x.last, CL.applied);
    if (behind && !CL.behind)
        ltg_log("cluster: ltg:log was trimmed past what this instance applied (%s; it begins at "
                "%s): it missed changes, and serves nothing until its state log is replaced by a "
                "copy of another instance's (README \"Several instances\")",
                CL.applied[0] ? CL.applied : "nothing", x.first);
    CL.lost = lost;
    CL.behind = behind;
}

/* The stream link loads the functions too (it may come up first), then asks ltg_info_v1 of
 * both streams: XINFO STREAM's own answer holds the first and last entries whole, which may be
 * ones it cannot read (cl_peeked). */
static void cl_tail_up(rlink *l) {
    rarg load[] = {RA("FUNCTION"), RA("LOAD"), RA("REPLACE"), {CL_LIBRARY, sizeof CL_LIBRARY - 1}};
    rl_call(l, rl_hello_reply, l, load, 4);
    rl_call(l, cl_tail_checked, l, (rarg[]){RA("FCALL"), RA("ltg_info_v1"), RA("0"), RA("ltg:log")},
            4);
    rl_call(l, cl_events_checked, l,
            (rarg[]){RA("FCALL"), RA("ltg_info_v1"), RA("0"), RA("ltg:events")}, 4);
}

/* Answer the changes the reader has now caught up with. */
static void cl_changes_due(void);
static void scope_seen(const char *scope, long long spent, long long held);

/* Apply one record of ltg:log: into memory, then into the local state log
 * with its sid. A record that does not apply is skipped (and never logged:
 * a replay would stop at it); LTG_ERR when the local log refused it -- the
 * reader then reads it again after a backoff (applying a record twice
 * changes nothing). */
static int cl_apply(const char *sid, const char *p, size_t n) {
    char prev[sizeof CL.applied], err[200];
    const char *why;
    int rc = 0;
    memcpy(prev, CL.applied, sizeof prev);
    buf rec = {0};
    buf_printf(&rec, "{\"sid\":\"%s\",", sid);
    buf_append(&rec, p + 1, n - 1); /* the record's own members after it */
    if (store_apply(NULL, rec.p, rec.len, 0, err, sizeof err) < 0)
        ltg_log("cluster: record %s of ltg:log does not apply here (skipped): %s", sid, err);
    else if ((rc = state_append(rec.p, rec.len, &why)) < 0)
        ltg_log("cluster: record %s of ltg:log is not in the state log yet: %s", sid, why);
    buf_free(&rec);
    if (rc < 0) memcpy(CL.applied, prev, sizeof prev);
    else snprintf(CL.applied, sizeof CL.applied, "%s", sid);
    CL.lag = (double)(wall_ms() - strtoll(sid, NULL, 10)) / 1000; /* Redis's clock against ours */
    return rc;
}

/* One entry of ltg:log (its tokens from e in t): applied; LTG_ERR when the state log
 * refused it. */
static int cl_log_entry(const char *sid, const char *p, const resp_tok *t, int e) {
    const resp_tok *rec = NULL;
    for (long long j = 0, f = e + 3; j + 1 < t[e + 2].num; j += 2, f = t[t[f].next].next)
        if (resp_is(p, t, (int)f, "r")) rec = &t[t[f].next];
    if (!rec || rec->type != '$' || rec->len < 2 || p[rec->off] != '{') {
        ltg_log("cluster: record %s of ltg:log is not ltg's (skipped)", sid);
        snprintf(CL.applied, sizeof CL.applied, "%s", sid);
        return 0;
    }
    return cl_apply(sid, p + rec->off, rec->len);
}

/* One entry of ltg:events, a spend event (field e, the record its instance
 * made) with the store's spent and held of its scopes after it (field b):
 * into the ledger, at the stream's time and with its id (record version
 * 3), so that every instance's days hold the same records in the same
 * order. What a scope without a budget spent is counted here; a budget's
 * is the store's. */
static int cl_event(const char *sid, const char *p, const resp_tok *t, int e) {
    const resp_tok *ev = NULL, *b = NULL;
    for (long long j = 0, f = e + 3; j + 1 < t[e + 2].num; j += 2, f = t[t[f].next].next) {
        if (resp_is(p, t, (int)f, "e")) ev = &t[t[f].next];
        if (resp_is(p, t, (int)f, "b")) b = &t[t[f].next];
    }
    rec_view v;
    unsigned long long ms = 0, seq = 0;
    sscanf(sid, "%llu-%llu", &ms, &seq);
    snprintf(CL.ev_applied, sizeof CL.ev_applied, "%s", sid);
    if (!ev || ev->type != '$' || rec_decode(p + ev->off, ev->len, &v) < 0 || v.sid[0] || !ms) {
        ltg_log("cluster: entry %s of ltg:events is not an event of ltg's (skipped)", sid);
        return 0;
    }
    v.sid[0] = ms, v.sid[1] = seq;
    int64_t day;
    uint64_t off;
    uint32_t len;
    if (ledger_add(&v, (int64_t)ms, &day, &off, &len) < 0) return 0; /* logged */
    if (v.flags & EVF_REPLAY) inf_idem_restore(&v, day, off, len); /* replayed here too */
    char id[2][37];
    snprintf(id[0], sizeof id[0], "%.36s", v.key);
    snprintf(id[1], sizeof id[1], "%.36s", v.group);
    stored *st[2] = {(stored *)tkey_find(id[0]), (stored *)group_find(id[1])};
    for (int i = 0; i < 2; i++)
        if (st[i] && !st[i]->al.has_budget) {
            budget_refresh(&st[i]->al, v.at);
            st[i]->al.spend += v.charged;
        }
    /* b is "scope spent held" for each of two scopes at most: copied out, NUL-terminated, since
     * a reply's bytes are not (sscanf must not read past the field) */
    char scope[40], bs[256];
    long long spent, held;
    int used;
    snprintf(bs, sizeof bs, "%.*s", b && b->type == '$' && b->len < sizeof bs ? (int)b->len : 0,
             b ? p + b->off : "");
    for (const char *q = bs; sscanf(q, "%39s %lld %lld%n", scope, &spent, &held, &used) == 3;
         q += used)
        scope_seen(scope, spent, held);
    return 0;
}

/* XREAD's answer: null (nothing new within CL_BLOCK_MS), or
 * [[stream, [[id, [field, value...]]...]]...], ltg:log's and ltg:events's. */
static void cl_tail_reply(void *ctx, const char *p, const resp_tok *t) {
    (void)ctx;
    if (!t) return;
    CL.heard = S.now;
    int ok = t[0].type == '_' || t[0].type == '*', events = 0;
    for (long long k = 0, s = 1; ok && t[0].type == '*' && k < t[0].num; k++, s = t[s].next) {
        ok = t[s].type == '*' && t[s].num == 2 && t[s + 2].type == '*';
        int log = ok && resp_is(p, t, (int)s + 1, "ltg:log");
        for (long long i = 0, e = s + 3; ok && i < t[s + 2].num; i++, e = t[e].next) {
            char sid[sizeof CL.applied];
            ok = t[e].type == '*' && t[e].num == 2 && t[e + 1].type == '$' &&
                 t[e + 1].len < sizeof sid && t[e + 2].type == '*';
            if (!ok) break;
            snprintf(sid, sizeof sid, "%.*s", (int)t[e + 1].len, p + t[e + 1].off);
            events += !log;
            if ((log ? cl_log_entry : cl_event)(sid, p, t, (int)e) < 0) {
                cl_changes_due();
                rl_fail(&CL.tail, "the state log refused a record");
                return;
            }
        }
    }
    if (ok && CL.read_at && events < CL_READ_COUNT && !CL.unread)
        CL.caught_up = CL.read_at; /* all there was */
    /* read one at a time after a read too large: whole reads again after a small entry */
    if (ok && CL.unread && CL.tail.in.len < RESP_MAX_BULK / CL_READ_COUNT) CL.unread = 0;
    cl_changes_due();
    if (!ok) { /* -UNBLOCKED when the server is made a replica, say */
        char why[200];
        rl_fail(&CL.tail, resp_why("XREAD", p, t, why, sizeof why));
        return;
    }
    cl_tail_read();
}

/* ltg_peek_v1's answer: the next entry of ltg:log and of ltg:events, each as its id ("" none),
 * bytes and fields. One that the reader cannot take whole (past RESP_MAX_BULK or
 * CL_MAX_FIELDS: no instance writes one) is skipped, said and counted, and the reader reads on:
 * a stream is never wedged on one entry. */
static void cl_peeked(void *ctx, const char *p, const resp_tok *t) {
    (void)ctx;
    if (!t) return;
    char why[200], *applied[2] = {CL.applied, CL.ev_applied};
    static const char *const names[2] = {"ltg:log", "ltg:events"};
    if (t[0].type != '*' || t[0].num != 6) {
        rl_fail(&CL.tail, resp_why("ltg_peek_v1", p, t, why, sizeof why));
        return;
    }
    int found = 0;
    for (int i = 0, k = 1; i < 2; i++, k += 3) {
        if (t[k].type != '$' || !t[k].len || t[k].len >= sizeof CL.applied ||
            t[k + 1].type != ':' || t[k + 2].type != ':' ||
            (t[k + 1].num <= RESP_MAX_BULK && t[k + 2].num <= CL_MAX_FIELDS))
            continue;
        snprintf(applied[i], sizeof CL.applied, "%.*s", (int)t[k].len, p + t[k].off);
        ltg_log("cluster: entry %s of %s is %lld bytes in %lld fields, more than ltg reads (%d "
                "bytes, %d fields; no instance writes one): skipped%s", applied[i], names[i],
                t[k + 1].num, t[k + 2].num, RESP_MAX_BULK, CL_MAX_FIELDS,
                i ? ": the event it held is not in this ledger" : ": the change it held is not "
                "applied here");
        CL.skipped++;
        found = 1;
    }
    if (!found) ltg_log("cluster: a read of the shared streams failed, though no entry is too "
                        "large to read: read again");
    CL.unread = 1;
    cl_tail_read();
}

/* Read on: ltg:log, and ltg:events while the ledger can take them; after a read that failed,
 * one entry at a time (CL.unread), and after that failed too, the entry that cannot be read is
 * found first (cl_peeked). */
static void cl_tail_read(void) {
    const char *why;
    int events = ledger_writable(&why);
    const char *last[2] = {CL.applied[0] ? CL.applied : "0-0",
                           CL.ev_applied[0] ? CL.ev_applied : "0-0"};
    if (CL.unread == 2) {
        rl_call(&CL.tail, cl_peeked, NULL,
                (rarg[]){RA("FCALL"), RA("ltg_peek_v1"), RA("0"), RA(last[0]), RA(last[1])}, 5);
        return;
    }
    rarg a[] = {RA("XREAD"), RA("COUNT"), RA(CL.unread ? "1" : STR(CL_READ_COUNT)), RA("BLOCK"),
                RA(STR(CL_BLOCK_MS)), RA("STREAMS"), RA("ltg:log"), RA("ltg:events"),
                RA(last[0]), RA(last[1])};
    if (!events) a[7] = a[8]; /* STREAMS ltg:log <id> */
    CL.read_at = events ? wall_ms() : 0;
    rl_call(&CL.tail, cl_tail_reply, NULL, a, events ? 10 : 8);
}

/* Is the day that ends at `end` over in the shared ledger: has the stream
 * been read to its end a minute after it (Redis's clock and this one may
 * differ, and an event is added to the stream before it is read)? Without
 * --cluster, a day is over at its end. */
static int cl_day_over(int64_t end) {
    return !CL.url || CL.caught_up >= end + CL_DAY_GRACE_MS;
}

/* The changes: the admin connection waits, owned by its change. */
static void cl_change_gone(void *owner) { ((cl_pending *)owner)->c = NULL; }
static void cl_change_drained(void *owner) { (void)owner; }
static const conn_owner cl_change_owner = {cl_change_gone, cl_change_drained};

/* The connection again without its change, to answer; NULL when its client left. */
static conn *cl_change_end(cl_pending *ch) {
    conn *c = ch->c;
    for (cl_pending **pp = &CL.waiting; *pp; pp = &(*pp)->next)
        if (*pp == ch) { *pp = ch->next; break; }
    timer_stop(&ch->t);
    if (ch->reply.p) memset(ch->reply.p, 0, ch->reply.len);
    buf_free(&ch->reply);
    free(ch);
    CL.changes--;
    if (c) c->owner = NULL;
    return c;
}

static int CL_RERUN; /* the tries before this run of a request, while it runs again */

/* The reader has applied the change's record (or the stream's tail it was
 * stale against): answer, or run the request again on the fresh copy. */
static void cl_change_done(cl_pending *ch) {
    int status = ch->status, rerun = ch->rerun, tries = ch->tries + 1;
    long long version = ch->version;
    buf reply = ch->reply;
    ch->reply = (buf){0};
    conn *c = cl_change_end(ch);
    if (c && !rerun) admin_reply(c, status, version, 0, reply.p, reply.len);
    else if (c && tries >= CL_CHANGE_TRIES)
        admin_error(c, 503, "storage_unavailable", NULL, 0,
                    "this item kept changing on other instances while this change was made: "
                    "retry");
    else if (c) {
        CL_RERUN = tries;
        route(c);
        CL_RERUN = 0;
    }
    if (reply.p) memset(reply.p, 0, reply.len);
    buf_free(&reply);
}

static void cl_changes_due(void) {
    for (cl_pending *ch = CL.waiting, *next; ch; ch = next) {
        next = ch->next;
        if (sid_cmp(CL.applied, ch->sid) >= 0) cl_change_done(ch);
    }
}

static void cl_change_late(void *ctx) {
    cl_pending *ch = ctx;
    conn *c = cl_change_end(ch);
    if (c)
        admin_error(c, 503, "storage_unavailable", NULL, 0,
                    "the change is recorded in the shared store, but this instance has not "
                    "read it back yet: retry with the same Idempotency-Key to see its answer");
}

/* ltg_cp_v1's answer (see CL_LIBRARY). */
static void cl_change_reply(void *ctx, const char *p, const resp_tok *t) {
    cl_pending *ch = ctx;
    int n = t && t[0].type == '*' ? (int)t[0].num : 0;
    if (n == 2 && (resp_is(p, t, 1, "ok") || resp_is(p, t, 1, "stale")) && t[2].type == '$' &&
        t[2].len < sizeof ch->sid) {
        ch->rerun = resp_is(p, t, 1, "stale");
        memcpy(ch->sid, p + t[2].off, t[2].len);
        ch->sid[t[2].len] = 0;
        if (sid_cmp(CL.applied, ch->sid) >= 0) { cl_change_done(ch); return; }
        ch->next = CL.waiting;
        CL.waiting = ch;
        timer_set(&ch->t, CL_TIMEOUT_MS);
        return;
    }
    long long status, version;
    if (n == 4 && resp_is(p, t, 1, "replay") && t[2].type == '$' && t[3].type == '$' &&
        t[4].type == '$' && parse_ll(p + t[2].off, t[2].len, 599, &status) == 0 &&
        parse_ll(p + t[3].off, t[3].len, LLONG_MAX, &version) == 0) {
        conn *c = cl_change_end(ch);
        if (c) admin_reply(c, (int)status, version, 1, p + t[4].off, t[4].len);
        return;
    }
    int conflict = n == 1 && resp_is(p, t, 1, "conflict");
    char why[200];
    if (t && !conflict) ltg_log("cluster: %s", resp_why("ltg_cp_v1", p, t, why, sizeof why));
    conn *c = cl_change_end(ch);
    if (c && conflict)
        admin_error(c, 409, "idempotency_conflict", NULL, 0,
                    "this Idempotency-Key was used for a different request body: use a new key for "
                    "a new change");
    else if (c)
        admin_error(c, 503, "storage_unavailable", NULL, 0,
                    "the shared store (Redis) did not take the change: nothing was changed; retry");
}

/* admin_change's way with --cluster: the record (`rec`, with its
 * idempotency record `r`) goes to ltg_cp_v1, checked against the version
 * `base` of item `id` (and that its group `parent` still is); the answer
 * `reply` waits until this instance has applied it. */
static void cl_change(conn *c, const buf *rec, const idem *r, const stored *it, long long base,
                      const char *parent, int status, const buf *reply, int del) {
    char idem_key[12 + 65], body[65], base_s[24], st[8], ver[24], ttl[24];
    memcpy(idem_key, "ltg:idem:cp:", 12);
    hex_encode(r->key, 32, idem_key + 12);
    hex_encode(r->body, 32, body);
    snprintf(base_s, sizeof base_s, "%lld", base);
    snprintf(st, sizeof st, "%d", r->status);
    snprintf(ver, sizeof ver, "%lld", r->version);
    snprintf(ttl, sizeof ttl, "%lld", (long long)IDEM_TTL_MS);
    cl_pending *ch = xcalloc(1, sizeof *ch);
    ch->c = c;
    ch->status = status;
    ch->version = r->version;
    ch->tries = CL_RERUN;
    buf_append(&ch->reply, reply->p, reply->len);
    timer_init(&ch->t, cl_change_late, ch);
    CL.changes++;
    /* a deletion names the scopes whose counts go: the item's, and a group's keys' */
    int n = 0, most = del ? ST.kv.n + 1 : 0;
    char(*scopes)[39] = xcalloc((size_t)most + 1, sizeof *scopes);
    rarg *a = xcalloc((size_t)most + 16, sizeof *a);
    int argc = 0;
    rarg fixed[] = {RA("FCALL"), RA("ltg_cp_v1"), RA("3"), RA("ltg:log"), RA("ltg:ver"),
                    RA(idem_key), RA(it->id), RA(base_s), RA(parent), {rec->p, rec->len},
                    RA(body), RA(st), RA(ver), RA(r->response), RA(del ? "deleted" : ver), RA(ttl)};
    for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++) a[argc++] = fixed[i];
    if (del) snprintf(scopes[n++], 39, "%c:%s", parent[0] ? 'k' : 'g', it->id);
    for (int i = 0; del && !parent[0] && i < ST.kv.n; i++)
        if (ST.kv.p[i] && strcmp(((tkey *)ST.kv.p[i])->group_id, it->id) == 0)
            snprintf(scopes[n++], 39, "k:%s", ((tkey *)ST.kv.p[i])->s.id);
    for (int i = 0; i < n; i++) a[argc++] = RA(scopes[i]);
    const char *why = cl_unready();
    int rc = why ? LTG_ERR : rl_call(&CL.cmd, cl_change_reply, ch, a, argc);
    free(a);
    free(scopes);
    if (rc < 0) {
        cl_change_end(ch);
        admin_error(c, 503, "storage_unavailable", NULL, 0, "%s: nothing was changed; retry",
                    why ? why : "the shared store (Redis) cannot take more calls now");
        return;
    }
    c->owner = ch;
    c->owner_ops = &cl_change_owner;
}

/* ---- the shared money: holds in the store, settles exactly once ----
 *
 * With --cluster, a request whose key or group has a budget, a rate limit
 * or max_parallel_requests (exchange's `shared`) is held in the store, not
 * in memory: its first hold (inference_start) and each later attempt's
 * (attempt_hold) are one call of ltg_hold_v1 each, all or nothing over the
 * key's and the group's scopes, on the primary's clock; the exchange waits
 * in X_HOLDING for the answer. A hold is a lease, renewed every
 * CL_RENEW_MS while its request runs: the holds of an instance that died
 * run out within CL_LEASE_MS. Settles and shrinks (hold_settle,
 * hold_shrink) go through an outbox, in order, each numbered: ltg_settle_v2
 * applies one number once and only after the one before it, so one sent again
 * after a lost reply charges nothing twice, and one sent after a settle Redis
 * refused (in the same pipeline) waits for it to be sent again first. What
 * the store answers -- spent and held per scope -- is what GET and
 * x-ltg-budget-remaining show. */
#define CL_LEASE_MS 20000
#define CL_RENEW_MS 5000

/* A call of ltg_hold_v1 waiting for its answer; x NULL once its exchange
 * is gone (a hold granted then is let go at once). */
typedef struct cl_wait {
    exchange *x;
    int first;
    int64_t cost, tok;        /* micro-USD, tokens */
    char id[40];
} cl_wait;

/* One settle or shrink not yet acknowledged, in the outbox. */
typedef struct cl_op {
    struct cl_op *next;
    unsigned long long file;  /* the outbox file that holds it */
    buf cmd;                  /* the whole FCALL, to send again after a lost link */
    char scope[2][39];        /* whose spend the answer updates ("" none) */
    int sent;
} cl_op;

static struct {
    char owner[17];           /* this boot of this instance: random */
    unsigned long long holds, seq;
    hold *live;               /* holds held, renewed */
    cl_op *head, *last;       /* the outbox, in order */
    int n;                    /* ... its ops */
    size_t bytes;             /* ... and their commands' bytes */
    char dir[256];            /* DATA/outbox */
    logfile f;                /* the outbox file ops are appended to */
    unsigned long long file;  /* ... its number */
    timer renew;
} CLM;

/* Does this request need a decision all instances share? */
static int allow_shared(const tkey *k, const group *g) {
    const allowance *al[2] = {&k->s.al, &g->s.al};
    int shared = g->max_parallel != UNSET;
    for (int i = 0; i < 2; i++)
        shared |= al[i]->has_budget || al[i]->rpm_limit != UNSET || al[i]->tpm_limit != UNSET;
    return shared;
}

/* The allowance of scope "k:<id>" or "g:<id>", or NULL (deleted). */
static allowance *scope_allowance(const char *scope) {
    stored *st = scope[0] == 'k' ? (stored *)tkey_find(scope + 2) : (stored *)group_find(scope + 2);
    return st ? &st->al : NULL;
}

/* The store's spent and held of a scope (nano-USD), shown from now on: a
 * budget's (a scope without one shows the events applied, cl_event). */
static void scope_seen(const char *scope, long long spent, long long held) {
    allowance *a = scope_allowance(scope);
    if (!a || !a->has_budget) return;
    budget_refresh(a, wall_ms());
    a->spend = spent / 1000;
    a->reserved = held / 1000;
}

/* ---- the outbox ----
 *
 * Every settle and shrink, with the spend event an end carries, is
 * appended to an outbox file, DATA/outbox/<number>.log (framed like the
 * state log, fsynced with the ledger's days), and sent at once; it stays
 * in memory until the store acknowledges it, and is sent again, in order,
 * after a lost link. A file past CL_OUTBOX_FILE is closed (fsynced) and a
 * new one begun; a closed file goes once every op in it is acknowledged.
 * At start-up the files left by a crash are read back and sent again,
 * under their own boot's numbers: ltg_settle_v2 applies each once. So a
 * request served while Redis is out of reach has its event kept and
 * shipped when Redis returns, and one served just before a crash too. The
 * ops in memory are bounded by CL_OUTBOX_MAX bytes: past it, inference is
 * refused as when the ledger cannot be written (cl_outbox_full). */
#define CL_OUTBOX_FILE (1 << 20)
#define CL_OUTBOX_MAX (64u << 20)
#define OUTBOX_MAGIC "LTGOUT1\n"

static void cl_outbox_name(unsigned long long n, char name[32]) {
    snprintf(name, 32, "%020llu.log", n);
}

static void cl_op_add(cl_op *op) {
    if (CLM.last) CLM.last->next = op;
    else CLM.head = op;
    CLM.last = op;
    CLM.n++;
    CLM.bytes += op->cmd.len;
}

/* Journal op in the current outbox file (a new one past CL_OUTBOX_FILE,
 * once the old one is durable). A failed write keeps it in memory and says
 * so through ledger_writable (the file is retried with the ledger's). */
static void cl_journal(cl_op *op) {
    char name[32];
    const char *why;
    if (CLM.f.size > CL_OUTBOX_FILE && log_sync(&CLM.f) == 0) {
        if (CLM.f.fd >= 0) close(CLM.f.fd);
        cl_outbox_name(++CLM.file, name);
        log_init(&CLM.f, CLM.dir, name, OUTBOX_MAGIC);
    }
    op->file = CLM.file;
    if (log_append(&CLM.f, op->cmd.p, op->cmd.len, 0, &why) < 0)
        ltg_log("cluster: a settle was not journaled: %s", why);
    ledger_sync_soon();
}

/* The outbox's file for the ledger's writes and fsyncs; NULL without --cluster. */
static logfile *cl_outbox_file(void) { return CL.url ? &CLM.f : NULL; }

static int cl_outbox_full(void) { return CLM.bytes > CL_OUTBOX_MAX; }

/* An op's command, parsed into t (NULL when it is not an ltg_settle_v2's, as an older
 * version's ltg_settle_v1 is not). */
static resp_tok *cl_op_parse(const cl_op *op) {
    static resp_tok t[RESP_MAX_TOKS];
    size_t at = 0;
    int nt = 0;
    if (resp_elem(op->cmd.p, op->cmd.len, &at, t, RESP_MAX_TOKS, &nt, 0) <= 0 || t[0].type != '*' ||
        t[0].num < 6 || !resp_is(op->cmd.p, t, 2, "ltg_settle_v2"))
        return NULL;
    return t;
}

/* Its number, for ltg's log ("?" for an older version's). */
static const char *cl_op_seq(const cl_op *op) {
    static char seq[24];
    const resp_tok *t = cl_op_parse(op);
    snprintf(seq, sizeof seq, "%.*s", t && t[5].len < 20 ? (int)t[5].len : 1,
             t ? op->cmd.p + t[5].off : "?");
    return seq;
}

/* The op applied before it becomes `prev`: its command is written again. */
static void cl_op_prev(cl_op *op, const char *prev) {
    const resp_tok *t = cl_op_parse(op);
    if (!t) return;
    rarg a[40];
    int argc = 0;
    for (int i = 1; i < t[0].next && argc < 40; i++)
        a[argc++] = i == 6 ? RA(prev) : (rarg){op->cmd.p + t[i].off, t[i].len};
    buf cmd = {0};
    resp_cmd(&cmd, a, argc);
    CLM.bytes += cmd.len - op->cmd.len;
    buf_free(&op->cmd);
    op->cmd = cmd;
}

static void cl_settled(void *ctx, const char *p, const resp_tok *t) {
    cl_op *op = ctx;
    if (!t) { op->sent = 0; return; } /* the link was lost: sent again when it is back */
    char why[200];
    if (t[0].type == '-') { /* READONLY, NOREPLICAS, LOADING...: again, once reconnected */
        op->sent = 0;
        rl_fail(&CL.cmd, resp_why("ltg_settle_v2", p, t, why, sizeof why));
        return;
    }
    if (t[0].type == '*' && t[0].num >= 1 && resp_is(p, t, 1, "gap")) {
        /* an op before it was refused: all again, in order, once reconnected. At the head of
         * the outbox, the op before it is in no outbox any more (its journal write failed
         * before a crash): it is sent again without waiting for it. */
        if (op == CLM.head) {
            ltg_log("cluster: settle %s waits for one that is lost: sent again without it",
                    cl_op_seq(op));
            cl_op_prev(op, "0");
        }
        op->sent = 0;
        rl_fail(&CL.cmd, "a settle was refused in the middle of a pipeline: the settles from it "
                         "on are sent again, in order");
        return;
    }
    if (t[0].type == '*' && t[0].num >= 1 && (resp_is(p, t, 1, "ok") || resp_is(p, t, 1, "dup"))) {
        for (int i = 0, k = 2; i < 2 && op->scope[i][0] && k + 1 <= t[0].num; i++, k += 2)
            if (t[k].type == ':' && t[k + 1].type == ':')
                scope_seen(op->scope[i], t[k].num, t[k + 1].num);
    } else
        ltg_log("cluster: a settle had an answer ltg cannot read (dropped)");
    assert(op == CLM.head);
    CLM.head = op->next;
    if (!CLM.head) CLM.last = NULL;
    CLM.n--;
    CLM.bytes -= op->cmd.len;
    if (op->file != CLM.file && (!CLM.head || CLM.head->file != op->file)) {
        char name[32], path[300];
        cl_outbox_name(op->file, name);
        snprintf(path, sizeof path, "%s/%s", CLM.dir, name);
        if (unlink(path) < 0) ltg_log("cluster: %s: %s", path, strerror(errno));
    }
    buf_free(&op->cmd);
    free(op);
}

/* Settles the store has not acknowledged (a drain waits for them, within --drain-seconds;
 * what is left then is logged). */
static int cl_unsettled(void) { return CLM.n; }

/* Send what the outbox has not sent (all of it after a lost link). */
static void cl_outbox_pump(void) {
    for (cl_op *op = CLM.head; op && CL.cmd.state == RL_UP; op = op->next) {
        if (op->sent) continue;
        if (rl_call_raw(&CL.cmd, cl_settled, op, &op->cmd) < 0) return;
        op->sent = 1;
    }
}

/* One op of an outbox file left by an earlier boot (log_replay's callback). What comes first
 * of its boot's ops waits for none (those before it were applied, or are lost); the others, for
 * the one before them, as when they were sent. */
static int cl_outbox_load(void *ctx, const char *p, size_t n, off_t at, char *why, size_t len) {
    (void)ctx, (void)at, (void)why, (void)len;
    static char owner[64], seq[24];
    cl_op *op = xcalloc(1, sizeof *op);
    op->file = CLM.file;
    buf_append(&op->cmd, p, n);
    cl_op_add(op);
    const resp_tok *t = cl_op_parse(op);
    if (!t || t[4].len >= sizeof owner || t[5].len >= sizeof seq) return 0;
    int same = CLM.n > 1 && strlen(owner) == t[4].len && !memcmp(owner, p + t[4].off, t[4].len);
    char prev[24];
    snprintf(prev, sizeof prev, "%s", same ? seq : "0");
    snprintf(owner, sizeof owner, "%.*s", (int)t[4].len, p + t[4].off);
    snprintf(seq, sizeof seq, "%.*s", (int)t[5].len, p + t[5].off);
    cl_op_prev(op, prev);
    return 0;
}

/* An outbox file, <20 digits>.log, by its number. */
static int cl_outbox_number(const char *dir, const char *file, int64_t *n) {
    long long v;
    (void)dir;
    *n = strlen(file) == 24 && sscanf(file, "%20lld.log", &v) == 1 && v >= 0 ? v : -1;
    return *n >= 0;
}

/* At start-up: the outbox files an earlier boot left, read back to be sent
 * again; new ops go to a file numbered after them. */
static int cl_outbox_open(const char *data, char *err, size_t errlen) {
    snprintf(CLM.dir, sizeof CLM.dir, "%.200s/outbox", data);
    size_t n;
    char name[32];
    int64_t *files = dir_logs(CLM.dir, cl_outbox_number, &n, err, errlen);
    if (!files) return LTG_ERR;
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        logfile f = {.fd = -1};
        int had = CLM.n;
        cl_outbox_name((unsigned long long)files[i], name);
        CLM.file = (unsigned long long)files[i];
        rc = log_open(&f, CLM.dir, name, OUTBOX_MAGIC, 0, cl_outbox_load, NULL, err, errlen);
        if (f.fd >= 0) close(f.fd);
        buf_free(&f.pending);
        if (rc == 0 && CLM.n == had) unlink(f.path); /* nothing in it: no op will take it away */
    }
    if (CLM.n) ltg_log("cluster: %d settle(s) of an earlier run found in %s: sent again", CLM.n,
                       CLM.dir);
    free(files);
    cl_outbox_name(++CLM.file, name);
    log_init(&CLM.f, CLM.dir, name, OUTBOX_MAGIC);
    return rc;
}

static void cl_live(hold *h, int add) {
    if (add) {
        h->prev = NULL;
        h->next = CLM.live;
        if (CLM.live) CLM.live->prev = h;
        CLM.live = h;
        return;
    }
    if (h->prev) h->prev->next = h->next;
    else if (CLM.live == h) CLM.live = h->next;
    if (h->next) h->next->prev = h->prev;
    h->prev = h->next = NULL;
}

/* An exchange goes: a call of ltg_hold_v1 still out finds no one; its hold leaves the list. */
static void cl_forget(exchange *x) {
    if (x->cl_wait) x->cl_wait->x = NULL;
    if (x->hold.cid[0]) cl_live(&x->hold, 0);
}

/* hold_settle's and hold_shrink's way with --cluster: one numbered op in
 * the outbox. `end`: the request is over (`cost` charged, `tok` used, the
 * spend event, a ledger record, in `event`: NULL for none); else a shrink
 * (`cost` and `tok` let go). A request held in memory (no h->cid) sends
 * only its event. The scopes' periods are this instance's view; the store
 * never moves a period back. */
static void cl_settle(hold *h, int end, int64_t cost, int64_t tok, int64_t now,
                      const buf *event) {
    cl_op *op = xcalloc(1, sizeof *op);
    char num[6][24];
    snprintf(num[0], 24, "%llu", ++CLM.seq);
    snprintf(num[1], 24, "%lld", (long long)cost * 1000);
    snprintf(num[2], 24, "%lld", (long long)tok);
    snprintf(num[5], 24, "%llu", CLM.seq - 1); /* the op before it, applied first */
    rarg a[15] = {RA("FCALL"), RA("ltg_settle_v2"), RA("0"), RA(CLM.owner), RA(num[0]), RA(num[5]),
                  RA(h->cid), RA(end ? "end" : "shrink"), RA(num[1]), RA(num[2]),
                  event ? (rarg){event->p, event->len} : RA("")};
    int argc = 11;
    for (int i = 0; i < 2 && h->cid[0] && h->scope[i][0]; i++) {
        allowance *al = scope_allowance(h->scope[i]);
        int64_t start, e;
        if (!al) continue; /* deleted: nothing of it is counted any more */
        allow_period(al, now, &start, &e);
        snprintf(num[3 + i], 24, "%lld", (long long)start);
        a[argc++] = RA(h->scope[i]);
        a[argc++] = RA(num[3 + i]);
        memcpy(op->scope[i], h->scope[i], sizeof op->scope[i]);
    }
    resp_cmd(&op->cmd, a, argc);
    cl_journal(op);
    cl_op_add(op);
    if (end) cl_live(h, 0);
    cl_outbox_pump();
}

static void cl_renewed(void *ctx, const char *p, const resp_tok *t) {
    (void)ctx;
    char why[200];
    if (t && t[0].type == '-')
        ltg_log("cluster: %s", resp_why("ltg_renew_v1 or ltg_trim_v1", p, t, why, sizeof why));
    if (t && t[0].type == '*' && t[0].num > 0)
        ltg_log("cluster: %lld hold(s) had run out of their lease before it was renewed (the "
                "store was out of reach for over %d s): their requests go on, and are charged "
                "when they end", t[0].num, CL_LEASE_MS / 1000);
}

/* Every CL_RENEW_MS: the leases of the holds of requests still running. */
static void cl_renew(void *ctx) {
    (void)ctx;
    timer_set(&CLM.renew, CL_RENEW_MS);
    /* what this instance applied, so that the stream keeps what it has not (ltg_trim_v1) */
    if (CL.cmd.state == RL_UP && !CL.lost && !CL.behind)
        rl_call(&CL.cmd, cl_renewed, NULL,
                (rarg[]){RA("FCALL"), RA("ltg_trim_v1"), RA("0"), RA(CLM.owner),
                         RA(CL.applied[0] ? CL.applied : "0-0"),
                         RA(CL.ev_applied[0] ? CL.ev_applied : "0-0"),
                         RA(STR(CL_EVENTS_KEEP_MS))},
                7);
    int n = 2;
    for (hold *h = CLM.live; h; h = h->next) n++;
    if (n == 2 || CL.cmd.state != RL_UP) return;
    rarg *a = xcalloc((size_t)n + 2, sizeof *a);
    int argc = 0;
    a[argc++] = RA("FCALL"), a[argc++] = RA("ltg_renew_v1"), a[argc++] = RA("0");
    a[argc++] = RA(STR(CL_LEASE_MS));
    for (hold *h = CLM.live; h; h = h->next) a[argc++] = RA(h->cid);
    rl_call(&CL.cmd, cl_renewed, NULL, a, argc);
    free(a);
}

/* A first hold refused (`why`; NULL: the store could not answer): as
 * admission refuses, and the exchange goes without a spend event. */
static void cl_refuse_first(exchange *x, tkey *k, group *g, const hold_refusal *why,
                            int64_t cost, double left) {
    admission a = {.c = x->c, .key = k, .g = g};
    refusal r;
    if (!why || !k || !g) refuse(&r, 503, "store_unavailable", NULL, "%s", CL_UNAVAILABLE);
    else if (why->limit[0] == 'i') idem_refuse(&r, why->limit[12] == 'c'); /* "idempotency_..." */
    else if (why->limit[4] == 'p') parallel_refuse(g, &r); /* "max_parallel_requests" */
    else hold_refuse(&a, &r, why, cost, left);
    conn *c = x->c;
    x->c = NULL;
    if (c) c->owner = NULL;
    exchange_free(x);
    if (c) inference_refuse(&a, &r);
}

/* The store refused x's hold (or could not answer: t is not a refusal):
 * the first, like admission, without a spend event; a later one ends the
 * request (attempt_refused). */
static void cl_refused(exchange *x, const cl_wait *w, const char *p, const resp_tok *t) {
    static const char *const limits[] = {"rpm_limit", "tpm_limit", "max_budget",
                                         "max_parallel_requests"};
    tkey *k = tkey_find(x->key_id);
    group *g = group_find(x->group_id);
    hold_refusal why = {0, NULL, 0};
    double left = 0;
    if (k && g && t && t[0].type == '*' && t[0].num == 4 && resp_is(p, t, 1, "refused") &&
        t[2].type == ':' && (t[2].num == 0 || t[2].num == 1) && t[4].type == ':')
        for (size_t i = 0; i < sizeof limits / sizeof *limits; i++)
            if (resp_is(p, t, 3, limits[i])) why = (hold_refusal){(int)t[2].num, limits[i], 0};
    if (why.limit && why.limit[4] == 'b') left = (double)t[4].num / 1e9; /* nano-USD left */
    else if (why.limit) why.wait = (long)t[4].num;                      /* seconds */
    /* the Idempotency-Key's claim: another body; or its request runs, or ran on another
     * instance and its answer has not reached this one's ledger yet */
    if (k && g && t && t[0].type == '*' && t[0].num >= 2 && resp_is(p, t, 1, "claimed"))
        why.limit = resp_is(p, t, 2, "conflict") ? "idempotency_conflict" : "idempotency_in_flight";
    allowance *al[2] = {k ? &k->s.al : NULL, g ? &g->s.al : NULL};
    if (!why.limit && !w->first)
        exchange_fail(x, 503, "store_unavailable", CL_UNAVAILABLE);
    else if (!w->first)
        attempt_refused(x, al[why.who], why.wait, left);
    else
        cl_refuse_first(x, k, g, why.limit ? &why : NULL, w->cost, left);
}

/* ltg_hold_v1's answer: {'ok', second, spent, held...} or a refusal. */
static void cl_held(void *ctx, const char *p, const resp_tok *t) {
    cl_wait *w = ctx;
    exchange *x = w->x;
    int ok = t && t[0].type == '*' && t[0].num >= 2 && resp_is(p, t, 1, "ok") && t[2].type == ':';
    if (x && x->settled) { /* it ended meanwhile (its deadline, its client), its settle sent */
        x->cl_wait = NULL;
        x = NULL;
    }
    if (!x) { /* its exchange is gone: a first hold let go (a later one went with its settle) */
        if (ok && w->first) {
            hold h = {.cid = ""};
            memcpy(h.cid, w->id, sizeof h.cid);
            cl_settle(&h, 1, 0, 0, wall_ms(), NULL);
        }
        free(w);
        return;
    }
    x->cl_wait = NULL;
    exchange_to(x, X_ATTEMPTING);
    hold *h = &x->hold;
    if (!ok) {
        if (!h->held) h->cid[0] = 0; /* nothing is held under it */
        cl_refused(x, w, p, t);
        free(w);
        return;
    }
    if (!h->held) {
        h->held = 1;
        h->sec = t[2].num;
        cl_live(h, 1);
    }
    h->cost += w->cost;
    h->tok += w->tok;
    for (int i = 0; i < 2 && 4 + 2 * i <= t[0].num; i++)
        if (t[3 + 2 * i].type == ':' && t[4 + 2 * i].type == ':')
            scope_seen(h->scope[i], t[3 + 2 * i].num, t[4 + 2 * i].num);
    int first = w->first;
    free(w);
    if (first) inference_go(x);
    else exchange_attempt_held(x);
}

/* Hold x->w, the worst case of x's next attempt (or, `first`, of its
 * first, at admission), in the store. LTG_AGAIN: the answer goes to
 * cl_held; LTG_ERR: the store cannot be asked now. */
static int cl_hold(exchange *x, int first) {
    tkey *k = tkey_find(x->key_id);
    group *g = group_find(x->group_id);
    if (!k || !g || cl_unready()) return LTG_ERR;
    hold *h = &x->hold;
    if (h->less || h->fewer) { /* what earlier attempts did not use, let go first (in order) */
        cl_settle(h, 0, h->less, h->fewer, wall_ms(), NULL);
        h->less = h->fewer = 0;
    }
    if (!h->cid[0]) {
        snprintf(h->cid, sizeof h->cid, "%s:%llu", CLM.owner, ++CLM.holds);
        snprintf(h->scope[0], sizeof h->scope[0], "k:%s", k->s.id);
        snprintf(h->scope[1], sizeof h->scope[1], "g:%s", g->s.id);
    }
    allowance *al[2] = {&k->s.al, &g->s.al};
    char num[12][24];
    int nn = 0, argc = 0;
    rarg a[22];
    char claim[8 + 65] = "", body[65] = "";
    if (first && x->idem) { /* the Idempotency-Key, claimed with the first hold */
        memcpy(claim, "ltg:ik:", 7);
        hex_encode(x->idem->key, 32, claim + 7);
        hex_encode(x->idem->body, 32, body);
    }
#define NUM(v) (snprintf(num[nn], 24, "%lld", (long long)(v)), nn++, RA(num[nn - 1]))
    a[argc++] = RA("FCALL"), a[argc++] = RA("ltg_hold_v1"), a[argc++] = RA("0");
    a[argc++] = RA(h->cid), a[argc++] = RA(first ? "1" : "0");
    a[argc++] = NUM(x->w.cost * 1000), a[argc++] = NUM(x->w.in + x->w.out);
    a[argc++] = RA(STR(CL_LEASE_MS)), a[argc++] = RA(h->scope[1]);
    a[argc++] = NUM(g->max_parallel == UNSET ? -1 : g->max_parallel);
    a[argc++] = RA(claim), a[argc++] = RA(body);
    for (int i = 0; i < 2; i++) {
        int64_t start, end;
        allow_period(al[i], wall_ms(), &start, &end);
        a[argc++] = RA(h->scope[i]);
        a[argc++] = NUM(al[i]->has_budget ? usd_to_micro(al[i]->max_budget) * 1000 : -1);
        a[argc++] = NUM(start);
        a[argc++] = NUM(al[i]->rpm_limit == UNSET ? -1 : al[i]->rpm_limit);
        a[argc++] = NUM(al[i]->tpm_limit == UNSET ? -1 : al[i]->tpm_limit);
    }
#undef NUM
    cl_wait *w = xcalloc(1, sizeof *w);
    *w = (cl_wait){x, first, x->w.cost, x->w.in + x->w.out, ""};
    memcpy(w->id, h->cid, sizeof w->id);
    if (rl_call(&CL.cmd, cl_held, w, a, argc) < 0) {
        free(w);
        return LTG_ERR;
    }
    x->cl_wait = w;
    timer_stop(&x->t); /* an attempt's timeout that did not fire: not this wait's */
    exchange_to(x, X_HOLDING);
    return LTG_AGAIN;
}

/* HOST[:PORT] (HOST may be [an IPv6 address]) at *u, up to one of `stop`:
 * into host and port (`port` unless it says one); NULL, or what is wrong. */
static const char *cl_hostport(const char **u, const char *stop, char host[256], int *port) {
    const char *end;
    long long v;
    size_t n;
    if (**u == '[') { /* an IPv6 address */
        end = strchr(*u, ']');
        if (!end) return "--cluster: an IPv6 address needs its closing ]";
        snprintf(host, 256, "%.*s", (int)(end - *u - 1), *u + 1);
        *u = end + 1;
    } else {
        char seps[8];
        snprintf(seps, sizeof seps, ":%s", stop);
        if (!(n = strcspn(*u, seps)) || n >= 256) return "--cluster: no host name, or too long";
        snprintf(host, 256, "%.*s", (int)n, *u);
        *u += n;
    }
    if (**u == ':') {
        n = strcspn(++*u, stop);
        if (parse_ll(*u, n, 65535, &v) < 0 || !v) return "--cluster: the port is not 1 to 65535";
        *port = (int)v;
        *u += n;
    }
    return NULL;
}

/* --cluster redis://HOST[:PORT][/DB] or
 * sentinel://HOST[:PORT][,HOST[:PORT]...]/MASTER_NAME[/DB] (and the
 * password from --cluster-password-env): NULL, or what is wrong with it. */
static const char *cl_parse(void) {
    const char *u = CL.url, *why;
    long long v;
    if (strncmp(u, "sentinel://", 11) == 0) {
        u += 11;
        do {
            if (CL.nsen == CL_MAX_SENTINELS) return "--cluster: more than 8 Sentinels";
            CL.sen[CL.nsen].port = 26379;
            why = cl_hostport(&u, ",/", CL.sen[CL.nsen].host, &CL.sen[CL.nsen].port);
            if (why) return why;
            CL.nsen++;
        } while (*u == ',' && *++u);
        size_t n = *u == '/' ? strcspn(++u, "/") : 0;
        if (!n || n >= sizeof CL.master)
            return "--cluster: expected sentinel://HOST[:PORT][,HOST[:PORT]...]/MASTER_NAME[/DB]";
        snprintf(CL.master, sizeof CL.master, "%.*s", (int)n, u);
        u += n;
    } else if (strncmp(u, "redis://", 8) == 0) {
        u += 8;
        CL.port = 6379;
        if ((why = cl_hostport(&u, "/", CL.host, &CL.port))) return why;
    } else if (strncmp(u, "rediss://", 9) == 0) {
        return "--cluster: rediss:// (TLS to Redis) is not supported: keep Redis on loopback or a "
               "private network, or reach it through a TLS tunnel (stunnel, spiped) and give "
               "redis:// of the tunnel's local end";
    } else
        return "--cluster: expected redis://HOST[:PORT][/DB] or sentinel://HOST[:PORT]/MASTER_NAME";
    if (*u == '/' && u[1]) {
        if (parse_ll(u + 1, strlen(u + 1), 1000000, &v) < 0)
            return "--cluster: the database (after /) is not a number";
        CL.db = (int)v;
    } else if (*u && strcmp(u, "/") != 0)
        return "--cluster: expected redis://HOST[:PORT][/DB] or sentinel://HOST[:PORT]/MASTER_NAME";
    const char *envs[2] = {CL.password_env, CL.sen_password_env};
    char **into[2] = {&CL.password, &CL.sen_password};
    for (int i = 0; i < 2; i++) {
        static char pwhy[300];
        const char *pw = envs[i] ? getenv(envs[i]) : NULL;
        if (!envs[i]) continue;
        snprintf(pwhy, sizeof pwhy, "--cluster-%spassword-env: the environment variable %.200s "
                 "is not set (or empty)", i ? "sentinel-" : "", envs[i]);
        if (!pw || !*pw) return pwhy;
        if (i && !CL.nsen) return "--cluster-sentinel-password-env: --cluster names no Sentinels";
        *into[i] = xstrdup(pw);
    }
    return NULL;
}

static void rl_init(rlink *l, const char *name, void (*up)(rlink *)) {
    l->name = name;
    l->fd = -1;
    l->backoff_ms = CL_BACKOFF_MIN_MS;
    l->hello = rl_hello;
    l->up = up;
    timer_init(&l->t, rl_timer, l);
}

/* Open both links (main, once the state log is replayed: CL.applied is
 * where the stream is read from). */
static void cl_start(void) {
    ledger_last_sid(CL.ev_applied);
    uint64_t r = rng_next();
    for (int i = 0; i < 16; i++) CLM.owner[i] = "0123456789abcdef"[(r >> (60 - 4 * i)) & 15];
    timer_init(&CLM.renew, cl_renew, NULL);
    timer_set(&CLM.renew, CL_RENEW_MS);
    rl_init(&CL.cmd, "command", cl_cmd_up);
    rl_init(&CL.tail, "stream", cl_tail_up);
    rl_init(&CL.sent, "sentinel", NULL);
    CL.sent.hello = cl_sentinel_ask;
    if (CL.nsen) snprintf(CL.host, sizeof CL.host, "(not known yet)");
    rl_connect(&CL.cmd);
    rl_connect(&CL.tail);
}

static int cl_on(void) { return CL.url != NULL; }
static int cl_behind(void) { return CL.behind; }

/* Has this instance not heard from the store for --cluster-stale-after? Its keys and groups may
 * then be stale: a key revoked meanwhile would still pass. */
static int cl_stale(void) { return CL.url && S.now - CL.heard > CL.stale_ms; }
static const char *cl_applied(void) { return CL.applied; }

/* Is the link usable? NULL, or why not (for /readyz). */
static const char *cl_unready(void) {
    if (!CL.url) return NULL;
    if (CL.lost) return "the shared store lost changes this instance applied (see ltg's log)";
    if (CL.behind)
        return "this instance missed changes the shared stream no longer has (see ltg's log)";
    if (CL.cmd.state != RL_UP || CL.tail.state != RL_UP)
        return "the shared store (Redis) cannot be reached (see ltg's log)";
    return NULL;
}

/* GET /metrics: the link's state. */
static void cl_metrics(buf *b) {
    metric_head(b, "ltg_cluster_up", "gauge",
                "1 while both links to the shared store (Redis) are up, else 0.");
    gauge(b, "ltg_cluster_up", !cl_unready(), NULL);
    metric_head(b, "ltg_cluster_heard_seconds", "gauge",
                "Seconds since the stream link last had an answer from the shared store.");
    gauge(b, "ltg_cluster_heard_seconds", (double)(S.now - CL.heard) / 1000, NULL);
    metric_head(b, "ltg_cluster_stream_lag_seconds", "gauge",
                "From the shared stream's last record applied here being added to its apply "
                "(the two clocks' difference included).");
    gauge(b, "ltg_cluster_stream_lag_seconds", CL.lag, NULL);
    metric_head(b, "ltg_cluster_unsettled", "gauge",
                "Settles the shared store has not acknowledged yet (the outbox).");
    gauge(b, "ltg_cluster_unsettled", cl_unsettled(), NULL);
    metric_head(b, "ltg_cluster_skipped_total", "counter",
                "Entries of the shared streams skipped, too large to read (see ltg's log).");
    gauge(b, "ltg_cluster_skipped_total", (double)CL.skipped, NULL);
}

/* Section 12's replay: a record applied from the stream carries its id, "sid". */
static void cl_note_sid(const char *p, const json_tok *t) {
    int v = json_get(p, t, 0, "sid");
    size_t n = v >= 0 && t[v].type == JSON_STRING ? t[v].end - t[v].start : sizeof CL.applied;
    if (n < sizeof CL.applied)
        snprintf(CL.applied, sizeof CL.applied, "%.*s", (int)n, p + t[v].start);
}


/* ===== 22. main =====
 *
 * IMPLEMENTATION NOTES
 * Start-up: options (a table), the catalog, the listeners bound (a busy
 * port stops ltg before it touches --data), the data directory and its
 * lock, the state log replayed, the ledger opened (its days checked,
 * today's replayed, old ones retired) and the budgets summed from it, the
 * fd table sized from the connection cap, signals, resolver; then the
 * loop. SIGTERM/SIGINT start a drain: the listeners close (a new
 * connection is refused), idle connections close, requests in flight
 * finish (at most --drain-seconds), and ltg exits 0. SIGHUP reloads the
 * catalog.
 */
static timer accept_pause, drain_timer;

static void listeners_watch(short events) {
    if (S.listen_fd >= 0) loop_events(S.listen_fd, events);
    if (S.admin_fd >= 0) loop_events(S.admin_fd, events);
}

static void accept_resume(void *ctx) {
    (void)ctx;
    listeners_watch(POLLIN);
}

static episode ep_per_ip = {.what = "connections: a client address holds --max-conns-per-ip "
                                    "inference connections; its next ones are closed at once"},
               ep_shed = {.what = "connections: a listener is full; the connections waiting "
                                  "longest without a request in service are closed to make room"},
               ep_full = {.what = "connections: every connection of a listener is being served; "
                                  "new ones are closed at once"};

/* Out of fds (or kernel memory), accept() fails and the listener stays
 * readable: rather than spin, stop watching it for 100 ms, and say so once
 * per episode. The connections wait in the kernel's backlog meanwhile. */
static void listener_accept(void *ctx, int revents) {
    static int shedding;
    (void)revents;
    int lfd = *(int *)ctx, admin = ctx == &S.admin_fd;
    for (int i = 0; i < 64; i++) {
        struct sockaddr_storage sa = {0};
        socklen_t sl = sizeof sa;
        int fd = accept4(lfd, (struct sockaddr *)&sa, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                if (!shedding)
                    ltg_log("accept: %s: new connections wait (retried every 100 ms)",
                            strerror(errno));
                shedding = 1;
                listeners_watch(0);
                timer_set(&accept_pause, 100);
            }
            return;
        }
        if (shedding) {
            ltg_log("accepting connections again");
            shedding = 0;
        }
        uint8_t a[16];
        addr16(&sa, a);
        int trusted = addr_trusted(a); /* a balancer: the client it speaks for is counted, not it */
        peer *p = admin || trusted ? NULL : peer_of(a);
        int full = admin ? S.nadmin >= S.max_admin : S.nconns - S.nadmin >= S.max_conns;
        if (p && p->n >= S.max_per_ip) episode_note(&ep_per_ip);
        else if (full && !conn_shed(admin)) episode_note(&ep_full);
        else if (fd < S.nfds_cap) {
            if (full) episode_note(&ep_shed);
            conn_new(fd, admin, p);
            memcpy(conns->client, a, 16);
            conns->trusted = conns->proxy_pending = trusted;
            continue;
        }
        close(fd); /* refused: closed at once */
        peer_drop(p);
    }
}

static int listen_on(const char *spec, const char **why) {
    char host[64];
    const char *colon = strrchr(spec, ':');
    long long port;
    *why = "expected ADDR:PORT, e.g. 127.0.0.1:8080";
    if (!colon || colon == spec || (size_t)(colon - spec) >= sizeof host) return LTG_ERR;
    if (parse_ll(colon + 1, strlen(colon + 1), 65535, &port) < 0) return LTG_ERR;
    snprintf(host, sizeof host, "%.*s", (int)(colon - spec), spec);
    if (host[0] == '[' && host[strlen(host) - 1] == ']') {
        memmove(host, host + 1, strlen(host));
        host[strlen(host) - 1] = 0;
    }
    struct sockaddr_storage a;
    if (strcmp(host, "localhost") == 0) snprintf(host, sizeof host, "127.0.0.1");
    if (addr_parse(host, &a) < 0) {
        *why = "the address must be numeric (IPv4 or [IPv6])";
        return LTG_ERR;
    }
    addr_set_port(&a, (int)port);
    int fd = socket(a.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1;
    if (fd < 0) { *why = strerror(errno); return LTG_ERR; }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&a, addr_len(&a)) < 0 || listen(fd, 1024) < 0) {
        *why = strerror(errno);
        close(fd);
        return LTG_ERR;
    }
    return fd;
}

static void drain_start(void) {
    S.draining = 1;
    S.drain_until = S.now + (int64_t)S.drain_seconds * 1000;
    timer_set(&drain_timer, (int64_t)S.drain_seconds * 1000);
    ltg_log("draining: %d connection(s) open, at most %d s", S.nconns, S.drain_seconds);
    loop_close(S.listen_fd);
    loop_close(S.admin_fd);
    S.listen_fd = S.admin_fd = -1;
    for (conn *c = conns, *next; c; c = next) {
        next = c->next;
        if (c->state == CONN_IDLE && !c->in.len && !conn_unsent(c)) conn_close(c);
    }
}

static void config_reload(void) {
    char err[512];
    catalog *cat = catalog_load(S.config_path, NULL, err, sizeof err);
    if (cat && tls_prepare(cat, err, sizeof err) < 0) {
        catalog_free(cat);
        cat = NULL;
    }
    if (!cat) { ltg_log("SIGHUP: config refused, the old one stays: %s", err); return; }
    catalog *old = S.cat;
    S.cat = cat;
    catalog_release(old);
    ltg_log("SIGHUP: config taken: %d provider(s), %d model(s)", cat->nprov, cat->nmodels);
}

static void loop_signals(void) {
    if (S.got_hup) {
        S.got_hup = 0;
        config_reload();
    }
    if (S.got_usr1) {
        S.got_usr1 = 0;
        access_reopen();
    }
    if (S.got_term && !S.draining) drain_start();
}

static int loop_should_exit(void) {
    return S.draining &&
           ((S.nconns == 0 && S.nexchanges == 0 && !cl_unsettled()) || S.now >= S.drain_until);
}

static void sig_pipe_read(void *ctx, int revents) {
    (void)ctx;
    (void)revents;
    char tmp[64];
    while (read(S.sig_pipe[0], tmp, sizeof tmp) > 0) {}
}

/* it only wakes the loop: loop_should_exit() decides */
static void drain_expired(void *ctx) { (void)ctx; }

/* mkdir -p: DIR and the parents it lacks (0700). */
static int mkdir_p(const char *dir) {
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) { errno = ENAMETOOLONG; return LTG_ERR; }
    for (char *q = p + 1; *q; q++)
        if (*q == '/') {
            *q = 0;
            if (mkdir(p, 0700) < 0 && errno != EEXIST) return LTG_ERR;
            *q = '/';
        }
    return mkdir(p, 0700) < 0 && errno != EEXIST ? LTG_ERR : 0;
}

/* The options' defaults (the tests start from them too). */
static void options_default(void) {
    S.resolv_conf = "/etc/resolv.conf";
    S.listen_addr = "127.0.0.1:8080";
    S.admin_addr = "127.0.0.1:8081";
    S.max_conns = 1024;
    S.drain_seconds = 10;
    S.max_body = 8LL << 20;
    S.head_timeout_ms = 10000;
    S.idle_timeout_ms = 120000;
    S.cache_mb = 64;
    S.max_stream_s = 3600; /* 128,000 output tokens at 40 a second take 53 minutes */
    S.stream_idle_s = 120;
    S.meter_s = 300;
    S.ledger_days = 90;
    S.ledger_index = 16LL << 20;
    CL.stale_ms = 60000;
}

#ifndef LTG_NO_MAIN
static const char USAGE[] =
        "usage: ltg --config FILE --data DIR [options]\n"
        "  --config FILE            the catalog: providers, models, admin keys (JSON)\n"
        "  --data DIR               token groups, keys and the ledger (created if missing)\n"
        "  --listen ADDR:PORT       the inference plane (default 127.0.0.1:8080)\n"
        "  --admin-listen ADDR:PORT the control plane and /metrics (default 127.0.0.1:8081)\n"
        "  --access-log FILE|off    one JSON line per request (default: stderr); reopened on "
        "SIGUSR1\n  --metrics-auth           GET /metrics needs an admin key with "
        "llm_token_gateway.metrics.read\n"
        "  --ledger-days N          days of spend events kept (default 90)\n"
        "  --ledger-index-mb N      memory for today's ledger index (default 16): past it, spilled "
        "to its index file\n"
        "  --ledger-key-env VAR     chain the ledger's events with the key in this environment "
        "variable\n  --cache-mb N             memory for the response cache (default 64)\n"
        "  --max-conns N            inference connections (default 1024)\n"
        "  --max-conns-per-ip N     inference connections per client address (default a quarter of "
        "--max-conns)\n"
        "  --trusted-proxies LIST   load balancers (ADDR[/BITS],...) whose PROXY header or "
        "X-Forwarded-For names the client\n"
        "  --drain-seconds N        on SIGTERM, how long requests in flight may finish (default "
        "10)\n  --max-body-mb N          request body limit (default 8)\n"
        "  --head-timeout S         a request head must arrive within S seconds (default 10)\n"
        "  --idle-timeout S         an idle keep-alive connection is closed after S seconds "
        "(default 120)\n"
        "  --max-stream-seconds S   a started stream is cut after S seconds (default 3600)\n"
        "  --stream-idle-seconds S  a started stream is cut after S seconds without an event "
        "(default 120)\n"
        "  --meter-abandoned-seconds S  an answer given up on is still read S seconds for its "
        "usage (default 300, 0: closed)\n"
        "  --ca-file FILE           trust anchors for https:// providers (default: the system "
        "bundle)\n"
        "  --resolv-conf FILE       where the name servers are (default /etc/resolv.conf)\n"
        "  --cluster redis://HOST[:PORT][/DB]  share groups and keys with other ltg instances\n"
        "                           through this Redis or Valkey primary\n"
        "  --cluster-password-env VAR  its password, from this environment variable\n"
        "  --cluster-sentinel-password-env VAR  the Sentinels' password (sentinel:// only)\n"
        "  --version, --help        print the version, or this, and exit\n"
        "Signals: SIGTERM/SIGINT drain and exit, SIGHUP reloads the catalog, SIGUSR1 reopens the "
        "access log.\n";

static void usage(const char *text, const char *why) {
    fprintf(stderr, "ltg: %s\n%s", why, text);
    exit(2);
}

static const char VERIFY_USAGE[] =
        "usage: ltg verify --data DIR [--ledger-key-env VAR] [--from YYYY-MM-DD] "
        "[--head YYYY-MM-DD:HEX]...\n"
        "  checks the chain of DIR/ledger's spend events, offline: one line per day; exit 0 only\n"
        "  when every day verifies and every head given (from GET /spend/chain) matches\n";

static int verify_main(int argc, char **argv) {
    verifier V = {0};
    const char *data = NULL, *var = NULL;
    char dir[300], err[512], why[128];
    int64_t from = INT64_MIN, day;
    for (int i = 2; i < argc; i += 2) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        snprintf(why, sizeof why, "%.40s needs a value", o);
        if (!v) usage(VERIFY_USAGE, why);
        if (strcmp(o, "--data") == 0) data = v;
        else if (strcmp(o, "--ledger-key-env") == 0) var = v;
        else if (strcmp(o, "--from") == 0 && parse_day(v, &from) == 0) continue;
        else if (strcmp(o, "--head") == 0 && strlen(v) == 11 + 2 * CHAIN_LEN && v[10] == ':') {
            char d[11];
            snprintf(d, sizeof d, "%.10s", v);
            V.given = xrealloc(V.given, (size_t)(V.ngiven + 1) * sizeof *V.given);
            V.given[V.ngiven].done = 0;
            if (parse_day(d, &V.given[V.ngiven].day) < 0 ||
                hex_decode(v + 11, 2 * CHAIN_LEN, V.given[V.ngiven].head) < 0)
                usage(VERIFY_USAGE,
                      "--head is YYYY-MM-DD:HEX, the day's head from GET /spend/chain");
            V.ngiven++;
        } else {
            snprintf(why, sizeof why, "%.40s %.40s: %s", o, v,
                     strcmp(o, "--from") == 0 ? "not a day (YYYY-MM-DD)"
                     : strcmp(o, "--head") == 0 ? "not YYYY-MM-DD:HEX (64 hex digits)"
                                                : "unknown option");
            usage(VERIFY_USAGE, why);
        }
    }
    if (!data) usage(VERIFY_USAGE, "--data DIR is required");
    if ((V.keyed = var != NULL) && ledger_key(var, &V.key, err, sizeof err) < 0)
        usage(VERIFY_USAGE, err);
    snprintf(dir, sizeof dir, "%.200s/ledger", data);
    struct stat st;
    size_t n = 0;
    int64_t *days = stat(dir, &st) == 0 ? dir_logs(dir, day_log_name, &n, err, sizeof err) : NULL;
    if (!days) {
        fprintf(stderr, "ltg verify: %s: %s\n", dir, errno ? strerror(errno) : err);
        return 2;
    }
    long long verified = 0;
    for (size_t i = 0; i < n; i++)
        if ((day = days[i]) >= from) verify_day(&V, dir, day, i == n - 1), verified++;
    verify_given(&V, INT64_MAX, 0, NULL);
    if (V.failed) printf("FAILED: %d problem(s) in %lld day(s)\n", V.failed, verified);
    else printf("verified: %lld day(s)\n", verified);
    free(days);
    free(V.given);
    return V.failed ? 1 : 0;
}

/* The command line: each option a string, or a whole number in a range
 * that is scaled into its field (seconds to ms, MiB to bytes). */
typedef struct {
    const char *name;
    const char **str;         /* a string option, or a number into one of: */
    int *i;
    long long *ll;
    long long min, max, scale;
    int flag;                 /* takes no value: sets *i to 1 */
} option;

static const option options[] = {
    {"--config", .str = &S.config_path}, {"--data", .str = &S.data_dir}, {"--listen", .str = &S.listen_addr},
    {"--admin-listen", .str = &S.admin_addr}, {"--resolv-conf", .str = &S.resolv_conf}, {"--ca-file", .str = &TLS.ca_file},
    {"--cluster", .str = &CL.url}, {"--cluster-password-env", .str = &CL.password_env},
    {"--cluster-sentinel-password-env", .str = &CL.sen_password_env},
    {"--cluster-stale-after", NULL, &CL.stale_ms, NULL, 1, 86400, 1000, 0},
    {"--access-log", .str = &ALOG.path}, {"--metrics-auth", .i = &S.metrics_auth, .flag = 1}, {"--trusted-proxies", .str = &S.trusted_proxies},
    {"--max-conns", NULL, &S.max_conns, NULL, 1, 1000000, 1, 0},
    {"--max-conns-per-ip", NULL, &S.max_per_ip, NULL, 1, 1000000, 1, 0},
    {"--drain-seconds", NULL, &S.drain_seconds, NULL, 1, 1000000, 1, 0},
    {"--max-body-mb", NULL, NULL, &S.max_body, 1, 1000000, 1 << 20, 0},
    {"--cache-mb", NULL, NULL, &S.cache_mb, 1, 1000000, 1, 0},
    {"--head-timeout", NULL, &S.head_timeout_ms, NULL, 1, 1000000, 1000, 0},
    {"--idle-timeout", NULL, &S.idle_timeout_ms, NULL, 1, 1000000, 1000, 0},
    {"--max-stream-seconds", NULL, &S.max_stream_s, NULL, 1, 1000000, 1, 0},
    {"--stream-idle-seconds", NULL, &S.stream_idle_s, NULL, 1, 1000000, 1, 0},
    {"--meter-abandoned-seconds", NULL, &S.meter_s, NULL, 0, 3600, 1, 0},
    {"--ledger-days", NULL, &S.ledger_days, NULL, 1, 3650, 1, 0},
    {"--ledger-index-mb", NULL, NULL, &S.ledger_index, 1, 4096, 1 << 20, 0},
    {"--ledger-key-env", .str = &S.ledger_key_env},
};

/* The defaults, then the command line over them; exits 2 on a bad one. */
static void options_parse(int argc, char **argv) {
    options_default();
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--version") == 0) { printf("ltg %s\n", LTG_VERSION); exit(0); }
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(USAGE, stdout);
            exit(0);
        }
        size_t k = 0;
        while (k < sizeof options / sizeof *options && strcmp(options[k].name, argv[i]) != 0) k++;
        char why[256];
        snprintf(why, sizeof why, "unknown option %.200s", argv[i]);
        if (k == sizeof options / sizeof *options) usage(USAGE, why);
        const option *o = &options[k];
        if (o->flag) { *o->i = 1; continue; }
        const char *v = ++i < argc ? argv[i] : NULL;
        snprintf(why, sizeof why, "%s needs a value", o->name);
        if (!v) usage(USAGE, why);
        long long n;
        if (o->str) { *o->str = v; continue; }
        if (parse_ll(v, strlen(v), o->max, &n) < 0 || n < o->min) {
            fprintf(stderr, "ltg: %s needs a whole number from %lld to %lld, not \"%s\"\n", o->name,
                    o->min, o->max, v);
            exit(2);
        }
        if (o->i) *o->i = (int)(n * o->scale);
        else *o->ll = n * o->scale;
    }
    const char *why = CL.url ? cl_parse() : NULL;
    if (why) usage(USAGE, why);
}

/* --data: made if missing, locked against a second ltg, the state log
 * replayed, the ledger opened (section 14) and the budgets summed from
 * it. 0, or LTG_ERR with a message for the operator. */
static int state_open(char *err, size_t errlen) {
    char lock[PATH_MAX];
    if (mkdir_p(S.data_dir) < 0) {
        snprintf(err, errlen,
                 "--data %s: cannot create it: %s (create it, or give a directory ltg may write)",
                 S.data_dir, strerror(errno));
        return LTG_ERR;
    }
    snprintf(lock, sizeof lock, "%s/lock", S.data_dir);
    int lock_fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0600); /* held until ltg exits */
    if (lock_fd < 0 || flock(lock_fd, LOCK_EX | LOCK_NB) < 0) {
        /* two writers would interleave their records */
        snprintf(err, errlen, "--data %s: %s", S.data_dir,
                 lock_fd < 0 ? strerror(errno) : "another ltg is using this directory");
        return LTG_ERR;
    }
    store_init();
    snprintf(LOG.tmp, sizeof LOG.tmp, "%.200s/state.log.tmp", S.data_dir);
    unlink(LOG.tmp); /* a compaction that a crash interrupted: the old file is whole */
    if (log_open(&LOG.f, S.data_dir, "state.log", LOG_MAGIC, 0, store_apply, NULL, err, errlen) < 0)
        return LTG_ERR;
    int64_t now = wall_ms();
    LOG.last_compaction = now;
    LG.keyed = S.ledger_key_env != NULL;
    if (LG.keyed && ledger_key(S.ledger_key_env, &LG.key, err, errlen) < 0) return LTG_ERR;
    if (ledger_open(S.data_dir, now, err, errlen) < 0) return LTG_ERR;
    if (CL.url && cl_outbox_open(S.data_dir, err, errlen) < 0) return LTG_ERR;
    budget_rebuild(now);
    ledger_replays(now - IDEM_TTL_MS, inf_idem_restore);
    CACHE.limit = (size_t)S.cache_mb << 20;
    long long events = 0;
    for (int i = 0; i < LG.nseg; i++) events += seg_count(LG.seg[i]);
    ltg_log("state: %d token group(s), %d token key(s); ledger: %lld spend event(s) in %d day(s), "
            "kept %d days",
            ST.gv.live, ST.kv.live, events, LG.nseg, S.ledger_days);
    return 0;
}

/* The fd table: room for every client with one upstream connection, as
 * many idempotent requests whose clients left, the control plane, and a
 * margin; a lower hard limit lowers the caps to fit. */
static void fds_budget(void) {
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    S.max_admin = S.max_conns < ADMIN_MAX_CONNS ? S.max_conns : ADMIN_MAX_CONNS;
    S.max_meters = S.max_conns < METER_MAX ? S.max_conns : METER_MAX;
    rlim_t want = (rlim_t)S.max_conns * 3 + (rlim_t)S.max_meters + (rlim_t)S.max_admin + 64;
    if (rl.rlim_cur < want) {
        rl.rlim_cur = want < rl.rlim_max ? want : rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    S.nfds_cap = (int)(rl.rlim_cur < want ? rl.rlim_cur : want);
    if ((rlim_t)S.nfds_cap < want) {
        int fit = (S.nfds_cap - 64) / 5;
        S.max_conns = fit > 1 ? fit : 1;
        if (S.max_admin > S.max_conns) S.max_admin = S.max_conns;
        if (S.max_meters > S.max_conns) S.max_meters = S.max_conns;
        ltg_log("the fd limit (ulimit -n %d) caps connections at %d", S.nfds_cap, S.max_conns);
    }
    /* one address, a quarter of the table */
    if (!S.max_per_ip) S.max_per_ip = S.max_conns / 4 > 0 ? S.max_conns / 4 : 1;
    if (S.max_per_ip > S.max_conns) S.max_per_ip = S.max_conns;
    S.fds = xcalloc((size_t)S.nfds_cap, sizeof *S.fds);
    S.pfds = xcalloc((size_t)S.nfds_cap, sizeof *S.pfds);
}

/* Signals reach the loop through a self-pipe: the handler sets a flag and
 * writes a byte that wakes poll(); the loop acts on the flag. */
static int signals_install(void) {
    if (pipe2(S.sig_pipe, O_NONBLOCK | O_CLOEXEC) < 0) return LTG_ERR;
    loop_watch(S.sig_pipe[0], POLLIN, sig_pipe_read, NULL);
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL);
    return 0;
}

/* What the loop serves from its first turn: the listeners, the resolver,
 * the fsyncs off the loop, the links of --cluster. */
static void loop_start(void) {
    timer_init(&accept_pause, accept_resume, NULL);
    timer_init(&drain_timer, drain_expired, NULL);
    dns_init();
    aio_start();
    if (CL.url) cl_start();
    loop_watch(S.listen_fd, POLLIN, listener_accept, &S.listen_fd);
    loop_watch(S.admin_fd, POLLIN, listener_accept, &S.admin_fd);
}

/* At exit: what stopping leaves undone, and the TLS handshakes made. */
static void stop_report(void) {
    const char *lost;
    if (!ledger_writable(&lost))
        ltg_log("stopping with spend events that could not be written (%s): they are lost", lost);
    if (cl_unsettled())
        ltg_log("cluster: stopping with %d settle(s) the shared store has not acknowledged: they "
                "are kept in DATA/outbox and sent at the next start (the holds they end run out "
                "with their leases meanwhile)", cl_unsettled());
    if (TLS.full + TLS.resumed)
        ltg_log("TLS handshakes: %llu full, %llu resumed", (unsigned long long)TLS.full,
                (unsigned long long)TLS.resumed);
}

int main(int argc, char **argv) {
    char err[512];
    const char *why;
    START_TIME = (double)wall_ms() / 1000;
    if (argc > 1 && strcmp(argv[1], "verify") == 0) return verify_main(argc, argv);
    options_parse(argc, argv);
    if (!S.config_path)
        usage(USAGE, "--config FILE is required: the catalog of providers, models and admin keys");
    if (!S.data_dir)
        usage(USAGE, "--data DIR is required: the directory that keeps token groups, keys and the "
                     "ledger");
    if (access_open(err, sizeof err) < 0) { fprintf(stderr, "ltg: %s\n", err); return 1; }
    if (S.trusted_proxies && trusted_parse(S.trusted_proxies, &why) < 0) {
        fprintf(stderr, "ltg: --trusted-proxies %s: %s\n", S.trusted_proxies, why);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    rng_seed();
    S.now = clock_ms();
    S.cat = catalog_load(S.config_path, NULL, err, sizeof err);
    if (!S.cat || tls_prepare(S.cat, err, sizeof err) < 0) {
        fprintf(stderr, "ltg: %s\n", err);
        return 1;
    }
    /* The ports first: a busy one stops ltg before it touches --data. */
    if ((S.listen_fd = listen_on(S.listen_addr, &why)) < 0) {
        fprintf(stderr, "ltg: --listen %s: %s\n", S.listen_addr, why);
        return 1;
    }
    if ((S.admin_fd = listen_on(S.admin_addr, &why)) < 0) {
        fprintf(stderr, "ltg: --admin-listen %s: %s\n", S.admin_addr, why);
        return 1;
    }
    if (state_open(err, sizeof err) < 0) { fprintf(stderr, "ltg: %s\n", err); return 1; }
    fds_budget();
    S.hooks = (loop_hooks){{conn_tick, store_tick, access_flush}, loop_signals, loop_should_exit};
    S.begin = route_begin;
    S.serve = route;
    S.ended = request_ended;
    S.error = route_error;
    S.up_open = up_start;
    if (signals_install() < 0) { perror("ltg: pipe"); return 1; }
    loop_start();
    ltg_log("listening on %s (inference) and %s (admin); %d provider(s), %d model(s)",
            S.listen_addr, S.admin_addr, S.cat->nprov, S.cat->nmodels);
    loop_run();
    meters_close(); /* what the drain left metered is billed what is known: no event is lost */
    ledger_sync_all(1);
    stop_report();
    access_flush();
    ltg_log("stopped");
    return 0;
}
#endif
