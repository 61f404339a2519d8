/*
 * mock.c -- a fake model provider, OpenAI's and Anthropic's APIs, for ltg's
 * tests and benchmarks.
 *
 *     tests/mock --port PORT      (127.0.0.1 only; --port 0 picks a free port)
 *     tests/mock --port PORT --tls-cert CHAIN.pem --tls-key KEY.pem
 *     tests/mock --port PORT --tls-stall
 *
 * With --tls-cert and --tls-key it speaks HTTPS (TLS 1.2, BearSSL) instead of
 * plain HTTP, control endpoints included; see section 9 for the details and
 * tests/tls-certs.sh for certificates. --tls-stall accepts connections and
 * never answers, not even the TLS ClientHello, for handshake deadline tests.
 *
 * It answers POST to these paths, under any prefix (/v1/chat/completions,
 * /openai/v1/chat/completions, ...), with canned bodies that echo the
 * request's "model", and it fails on demand:
 *
 *     /chat/completions        a chat.completion, or a stream of chunks then [DONE]
 *     /completions             the legacy text_completion, plain or streamed alike
 *     /embeddings              one embedding per input (a list of strings or of
 *                              token lists: one each), the floats 0.1, 0.2, 0.3,
 *                              as a JSON array or, for
 *                              "encoding_format":"base64" (what the OpenAI SDKs ask
 *                              for), a base64 string of the little-endian float32
 *                              bytes; any other encoding_format gets OpenAI's 400
 *     /responses               a Responses API response (previous_response_id,
 *                              instructions, max_output_tokens echoed, nothing
 *                              remembered), or its stream of named events that ends
 *                              with response.completed (no [DONE])
 *     /messages                an Anthropic message, or its stream (message_start ...
 *                              message_stop); 401 without x-api-key, 400 without
 *                              anthropic-version, errors in Anthropic's shape
 *     /messages/count_tokens   Anthropic's {"input_tokens":N}, same headers required
 *
 * A whole answer's text is "Hello from MODEL."; a stream sends events=N deltas
 * of "word " each. Usage, for every API: input (prompt) tokens are a quarter of
 * the request body's bytes (at least 1), output (completion) tokens are N (3
 * by default), every other count 0, unless the usage directives (below) say
 * otherwise. The OpenAI streams end with a usage chunk when the request has
 * stream_options.include_usage; the Responses and Anthropic streams always
 * carry usage. The usage objects have every field the providers send, in
 * their order (P input, X cached, W cache writes, W1h of them 1-hour ones,
 * C output, R reasoning):
 *
 *     chat, completions     "usage":{"prompt_tokens":P,"completion_tokens":C,
 *                           "total_tokens":P+C,"prompt_tokens_details":
 *                           {"cached_tokens":X,"audio_tokens":0},
 *                           "completion_tokens_details":{"reasoning_tokens":R,
 *                           "audio_tokens":0,"accepted_prediction_tokens":0,
 *                           "rejected_prediction_tokens":0}}; a stream with
 *                           include_usage has "usage":null in every chunk but
 *                           the last before [DONE], whose "choices" is [] and
 *                           whose "usage" is the object above; without it no
 *                           chunk has a "usage" member
 *     embeddings            "usage":{"prompt_tokens":P,"total_tokens":P}
 *     responses             "usage":{"input_tokens":P,"input_tokens_details":
 *                           {"cached_tokens":X},"output_tokens":C,
 *                           "output_tokens_details":{"reasoning_tokens":R},
 *                           "total_tokens":P+C} in the body and in
 *                           response.completed's response; "usage":null in
 *                           response.created's and response.in_progress's
 *     messages              "usage":{"input_tokens":P,"cache_creation_input_tokens":W,
 *                           "cache_read_input_tokens":X,"cache_creation":
 *                           {"ephemeral_5m_input_tokens":W-W1h,
 *                           "ephemeral_1h_input_tokens":W1h},"output_tokens":C,
 *                           "service_tier":"standard","server_tool_use":
 *                           {"web_search_requests":0}}; a stream's message_start
 *                           has the same with "output_tokens":1 and without
 *                           server_tool_use; its message_delta's, cumulative and
 *                           final: input_tokens, cache_creation_input_tokens,
 *                           cache_read_input_tokens, output_tokens (C) and
 *                           server_tool_use
 *     count_tokens          {"input_tokens":P}, not a usage object: usage= and
 *                           bad_usage= leave it alone
 *
 * A failure is chosen per request by a *directive*, a space-separated list of
 * tokens, taken from the per-model script queue (see POST /_mock/script) or
 * else from a top-level string field "mock" in the body:
 *
 *     status=N             answer N with an error body in the API's shape, with
 *                          the type its provider uses for N (Anthropic: 529
 *                          overloaded_error, 413 request_too_large, ...)
 *     quota                (OpenAI APIs) 429 (or status=N) with OpenAI's quota
 *                          error: type and code insufficient_quota, "You exceeded
 *                          your current quota, ..." (Anthropic says it with
 *                          status=402, billing_error)
 *     context_length       400 context_length_exceeded (Anthropic: "prompt is too
 *                          long: 9000 tokens > 8192 maximum")
 *     retry_after=S        add "Retry-After: S"
 *     head_delay_ms=N      wait before the response head
 *     first_event_delay_ms=N, event_delay_ms=N, events=N    shape a stream: the
 *                          opening events go at once (in one write with the head,
 *                          as a provider sends what it has at once; so do the
 *                          closing events with the body's end, when nothing paces
 *                          them), each delta in a write of its own, the first
 *                          delta N ms later
 *     end_delay_ms=N       a stream's body ends N ms after its last event (as a
 *                          provider's end of stream may come in a later read)
 *     cut_after=N          stream: close abruptly after N content events (deltas)
 *     reset                read the request, then reset the connection (RST)
 *     close                answer with "Connection: close", then close
 *     framing=length|chunked|eof    how a non-stream body is delimited
 *     hang                 never answer; wait until the peer closes
 *     ok                   a normal answer
 *     tool_call            an answer that asks for one call of the coding agents'
 *                          shell tool, running "echo mock-tool-$((6*7))" (whose
 *                          output, mock-tool-42, shows that it ran): chat and
 *                          Messages, a call of Claude Code's Bash, its arguments
 *                          {"command":"echo mock-tool-$((6*7))"} in both (chat: a
 *                          tool_calls entry call_mock_N, content null,
 *                          finish_reason tool_calls; Messages: a tool_use
 *                          toolu_mock_N, stop_reason tool_use); Responses, a
 *                          function_call of Codex's exec_command ({"cmd"});
 *                          streamed or not (completions answers text as ever);
 *                          1 output token
 *     tools=N              (1..8; chat and Messages) N parallel calls instead:
 *                          call i (from 0) is tool_<i>, its arguments exactly
 *                          {"i":<i>,"city":"Paris <i>"} (no spaces), its id
 *                          call_mock_N_<i> or toolu_mock_N_<i>; not with tool_call
 *     text_first           with tool_call or tools=N: the text "Let me check."
 *                          before the calls (chat: content; Messages: a text block)
 *     reasoning=N          (chat and Messages; at most 100000) N reasoning deltas
 *                          of "think " before the answer: chat, delta
 *                          reasoning_content (a whole answer: message.
 *                          reasoning_content, the N joined); Messages, a thinking
 *                          block first, signed (the base64 of "mock thinking
 *                          signature N"), the thinking joined in a whole answer
 *     finish=REASON        (1 to 31 of a-z, 0-9, _) the finish_reason of chat and
 *                          completions, the stop_reason of Messages, whole and
 *                          streamed: finish=stop with tool_call (as GLM ends its
 *                          tool turns), finish=max_tokens, finish=refusal, ...
 *     stream_error=TYPE    (as finish=) a stream ends with an error event: right
 *                          after its first event (Messages: message_start;
 *                          Responses: response.created; chat and completions
 *                          have none, the error comes first), or with cut_after=N
 *                          after N deltas (or, when there are fewer, before the
 *                          closing events); then the body ends cleanly, the
 *                          connection stays open. Messages: event: error, data:
 *                          {"type":"error","error":{"type":"TYPE","message":
 *                          "Overloaded"}} ("mock stream error TYPE" for a TYPE
 *                          other than overloaded_error); chat and completions:
 *                          data: {"error":{"message":"...","type":"TYPE","code":
 *                          null}} (for server_error OpenAI's message "The server
 *                          had an error while processing your request. Sorry
 *                          about that!"); Responses: event: error, {"type":
 *                          "error","code":"TYPE","message":...,"param":null,
 *                          "sequence_number":N}
 *     keepalive            keep-alives in a stream: the OpenAI APIs send a
 *                          comment, ": keep-alive", before each delta and
 *                          before the first event after them (chat: the finish),
 *                          half-way through the event_delay_ms or
 *                          first_event_delay_ms before it; Messages an extra
 *                          event: ping between two deltas (the stream's usual
 *                          ping after the first content_block_start stays)
 *     bytewise             every byte of the answer (its head and its body, whole
 *                          or streamed, any API) in a write of its own (each a
 *                          TCP segment: TCP_NODELAY is on), with a 20 us pause
 *                          after each of the answer's first 16384 bytes: about
 *                          0.1 ms a byte, half a second for a stream of 4 KiB
 *
 * and hostile answers, each bounded, each ended as soon as the peer leaves:
 *
 *     body_mb=N            a 200 whose body is N MiB of filler (not JSON),
 *                          framed as framing= says: length declares all N MiB
 *                          up front; "filler_bytes" in the stats counts it
 *     head_kb=N, head_lines=N   one extra header of N KiB, or N header lines
 *     garble=KIND          break the answer (a stream: after garble_after=N
 *                          good content events, default 0): chunk_size (a
 *                          chunk-size line that is not hex), chunk_long (a
 *                          chunk longer than its size), html (the body or
 *                          one event's data is "<html>oops</html>"), truncated
 *                          (the JSON cut in half, framed right), huge (2 MiB
 *                          of event data with no blank line; a body: 2 MiB
 *                          of filler)
 *     trickle_ms=N         send the head of a non-stream answer (even to a
 *                          stream request), then its body one byte every N ms,
 *                          all but the last byte
 *     junk_after_ms=N      after a whole answer, junk on the same connection
 *                          N ms later (0: in the same write); nothing more
 *     content_kb=N         a whole answer whose text is N KiB of "x"
 *     raw_status=N         write N (0..999, three digits: raw_status=0 is
 *                          "HTTP/1.1 000 OK") as the status line's number in
 *                          place of the real status, the rest of the answer
 *                          unchanged
 *
 * After broken framing, a trickle or junk the mock answers nothing more on
 * that connection and waits (at most a minute) for the peer to close. A
 * stream that never ends is events=N with event_delay_ms=M.
 *
 * Chat and Messages stream calls, reasoning and text as the providers do.
 * Chat: the deltas {"reasoning_content":"think "}, then the text, {"content":
 * "word "} each (with calls: text_first's one {"content":"Let me check."}),
 * then each call's opening chunk, {"tool_calls":[{"index":i,"id":ID,"type":
 * "function","function":{"name":NAME,"arguments":""}}]} (call 0's also with
 * "role":"assistant","content":null), then the calls' arguments, each in
 * three pieces (cut at a third and two thirds of their bytes), round-robin
 * (call 0's first piece, call 1's first, ..., call 0's second, ...), each
 * chunk {"tool_calls":[{"index":i,"function":{"arguments":PIECE}}]} but one:
 * with two calls or more, the second pieces of calls 0 and 1 share a chunk,
 * two entries in its tool_calls; then delta {} with the finish_reason, the
 * usage chunk if asked for, [DONE]. Messages: the content blocks one after
 * the other at indexes 0, 1, ..., each its content_block_start, its deltas
 * and its content_block_stop: thinking ({"type":"thinking","thinking":"",
 * "signature":""}, a thinking_delta "think " each, then a signature_delta),
 * text ({"type":"text","text":""}, text_delta), tool_use ({"type":"tool_use",
 * "id":ID,"name":NAME,"input":{}}, an input_json_delta per piece). All these
 * deltas are the content events that cut_after, garble_after and
 * event_delay_ms count; with calls, events=N only sets the output tokens.
 *
 * The usage an answer reports (each N a token count, at most 10^18):
 *
 *     input_tokens=N       the prompt's tokens: OpenAI's prompt_tokens (Responses:
 *                          input_tokens), cached tokens included; Anthropic's
 *                          input_tokens, cache reads and writes excluded
 *     cached_tokens=N      OpenAI's cached_tokens; Anthropic's cache_read_input_tokens
 *     cache_write=N, cache_write_1h=N   Anthropic's cache_creation_input_tokens
 *                          (all cache writes) and, of them, ephemeral_1h_input_tokens
 *                          (at most cache_write; the rest are ephemeral_5m); OpenAI
 *                          has no such fields
 *     output_tokens=N      completion_tokens / output_tokens (default: events=N)
 *     reasoning_tokens=N   OpenAI's reasoning_tokens (Anthropic has none); a
 *                          part of output_tokens, as OpenAI counts them
 *     usage=none           no usage object in any body or event: an OpenAI stream
 *                          sends no usage chunk (nor "usage":null) even when
 *                          asked; a response object and Anthropic's message_start
 *                          and message_delta have no "usage" member
 *     bad_usage=KIND       the input count (prompt_tokens, input_tokens) written
 *                          as -5 (negative), 12.5 (fraction) or "12" (string),
 *                          every other field as usual (total_tokens from the
 *                          real count)
 *
 * The counts are taken as given: nothing checks that cached_tokens fits in
 * input_tokens or reasoning_tokens in output_tokens.
 *
 * What it refuses, as the real APIs do. A request that breaks one of these
 * rules is answered at once, whatever its directive says, with 400
 * invalid_request_error in the API's shape and the provider's message (OpenAI:
 * with its param and code); it still takes its step of the script and counts
 * in "calls" and "requests", and in "refused", its log entry saying why (ltg's
 * translations must never be refused). N is a message's index, K a block's:
 *
 *   /messages (/messages/count_tokens: all but the first three)
 *     max_tokens missing ("max_tokens: Field required"), not an integer or < 1
 *     temperature not a number, or not in 0..1 (null is fine)
 *     a stop_sequences entry that is only whitespace
 *     system neither a string nor a list of text blocks (null is fine)
 *     messages missing, not a list, or empty
 *     a role other than user and assistant ("messages.N.role: Input should be
 *       'user' or 'assistant'"); system too when the anthropic-beta header has
 *       mid-conversation-system (as Claude Code sends it)
 *     empty content ("" or []) but in a final assistant message
 *     a text block, or a string content, that is empty or only whitespace
 *       ("messages: text content blocks must contain non-whitespace text")
 *     a tool_use whose id is not ^[a-zA-Z0-9_-]+$, or whose input is not an
 *       object ("messages.N.content.K.tool_use.input: Input should be an object")
 *     an assistant message's tool_use ids not all answered by the tool_result
 *       blocks that the next message, a user one, starts with ("messages.N:
 *       `tool_use` ids were found without `tool_result` blocks immediately
 *       after: ID, ID. Each `tool_use` block must have a corresponding
 *       `tool_result` block in the next message.", N the assistant message)
 *     a tool_result whose tool_use_id is not ^[a-zA-Z0-9_-]+$, or names no
 *       tool_use of the message just before ("messages.N.content.K: unexpected
 *       `tool_use_id` found in `tool_result` blocks: ID. Each `tool_result`
 *       block must have a corresponding `tool_use` block in the previous
 *       message.")
 *   /chat/completions
 *     more than 4 stop entries ("Invalid 'stop': array too long. ...")
 *     a tools[i].function.name longer than 64, or not ^[a-zA-Z0-9_-]+$
 *     messages missing ("Missing required parameter: 'messages'."), not an
 *       array, or empty
 *     a tool message with no assistant message with tool_calls before it (the
 *       tool messages between them aside: "Invalid parameter: messages with
 *       role 'tool' must be a response to a preceeding message with
 *       'tool_calls'."), without a tool_call_id, or whose tool_call_id is none
 *       of that message's ("Invalid parameter: 'tool_call_id' of 'ID' not
 *       found in 'tool_calls' of previous message.")
 *     an assistant message's tool_calls not all answered by the tool messages
 *       right after it ("An assistant message with 'tool_calls' must be
 *       followed by tool messages responding to each 'tool_call_id'. The
 *       following tool_call_ids did not have response messages: ID, ID")
 *
 * Control endpoints: POST /_mock/script, POST /_mock/answer, GET /_mock/stats,
 * GET /_mock/last (the last request's method, path, headers, lowercased, and
 * body: what ltg sent as x-api-key, say), POST /_mock/reset. /_mock/last's "body" is the
 * body as received (a chunked one decoded) as a JSON string, the very same
 * text when it is UTF-8 (a byte that is not becomes U+FFFD), and its
 * "body_base64" the exact bytes. /_mock/stats counts the requests "refused"
 * (above) and a refused request's log entry has "refused", the message.
 * An Anthropic request refused for a missing header takes no step of the
 * script and is not counted.
 *
 * POST /_mock/answer {"model":"m","status":200,"content_type":"text/event-stream",
 * "body":"event: ping\ndata: {}\n\n"} queues one exact answer for the next
 * request whose "model" is m (at most ANSWERS_MAX a model, each at most
 * ANSWER_MAX bytes; status 200..599, default 200; content_type default
 * application/json): that request is answered with this status, this
 * Content-Type and these bytes, the JSON string decoded (\uXXXX as UTF-8),
 * whatever the request asked (a stream or not). It takes its answer where it
 * takes its script step, so a refused request uses one up too. Its directive
 * (script or "mock" field) still shapes the delivery: head_delay_ms, reset,
 * hang, close, retry_after, raw_status, head_kb, head_lines, bytewise, and
 * framing= (length by default; chunked sends a chunk, in a write of its own,
 * per SSE event: the bytes up to and with each "\n\n"; eof closes after
 * the body); its other tokens are ignored. It answers {"model":"m",
 * "queued":N}, or 400 when the queue is full or the body is not as above.
 * POST /_mock/reset empties the queues.
 * Connections whose first request is a control request are left out of
 * "connections" and "open_connections" (and, over TLS, out of
 * "tls_handshakes" and "tls_resumed"), so that a test reading the stats sees
 * only the connections that ltg made.
 *
 * How it works: one thread per connection with blocking I/O, one mutex around
 * the shared state. That is the simplest design that serves hundreds of
 * connections and tens of thousands of small requests a second on loopback,
 * which is all a test upstream needs. Every wait polls the socket for a peer
 * close (POLLRDHUP), so a connection the peer drops is counted as closed at
 * once, even in the middle of a delay or a hang.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <bearssl.h>

#define HEAD_MAX      (64 * 1024)        /* a longer request head gets 431 */
#define BODY_MAX      (64 * 1024 * 1024) /* a longer request gets 413 */
#define HEADERS_MAX   100
#define READ_CHUNK    16384
#define MODEL_MAX     128
#define DIRECTIVE_MAX 512
#define LOG_MAX       1000
#define HOSTILE_WAIT_MS 60000            /* the longest wait for the peer after a hostile answer */
#define TOKENS_MAX    1000000000000000000LL  /* the largest token count a directive sets */
#define FILLER_PIECE  65536
#define BYTEWISE_PAUSE_US 20             /* bytewise: the pause after each byte ... */
#define BYTEWISE_PAUSES 16384            /* ... of the first this many bytes of an answer */
#define WORD_MAX      32                 /* a directive's word value (finish=, stream_error=), with its NUL */
#define CALLS_MAX     8                  /* tools=N: at most this many parallel calls */
#define REASONING_MAX 100000             /* reasoning=N: at most this many deltas */
#define ANSWERS_MAX   8                  /* POST /_mock/answer: answers queued per model ... */
#define ANSWER_MAX    (1024 * 1024)      /* ... each at most this many bytes */
#define TYPE_MAX      128                /* ... its Content-Type, with its NUL */

static char filler[FILLER_PIECE];        /* 'x' bytes: body_mb and garble=huge send them */

/* ===== 1. Small utilities ===== */

static void die(const char *what)
{
    perror(what);
    exit(1);
}

static long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

/* A growable byte buffer. Each connection keeps a few and reuses them, so a
 * keep-alive connection stops allocating after its first requests. */
struct buf {
    char *data;
    size_t len, cap;
};

static void buf_reserve(struct buf *b, size_t extra)
{
    if (b->cap - b->len >= extra)
        return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap - b->len < extra)
        cap *= 2;
    if (!(b->data = realloc(b->data, cap)))
        die("realloc");
    b->cap = cap;
}

static void buf_append(struct buf *b, const void *p, size_t n)
{
    buf_reserve(b, n);
    memcpy(b->data + b->len, p, n);
    b->len += n;
}

static void buf_puts(struct buf *b, const char *s) { buf_append(b, s, strlen(s)); }

__attribute__((format(printf, 2, 3)))
static void buf_printf(struct buf *b, const char *fmt, ...)
{
    va_list ap;
    buf_reserve(b, 64);
    va_start(ap, fmt);
    int n = vsnprintf(b->data + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if ((size_t)n >= b->cap - b->len) {
        buf_reserve(b, (size_t)n + 1);
        va_start(ap, fmt);
        vsnprintf(b->data + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
    }
    b->len += (size_t)n;
}

/* The length of the UTF-8 sequence at p (at most n bytes), or 0 if it is
 * not a valid one (RFC 3629: no overlong forms, no surrogates, <= U+10FFFF). */
static size_t utf8_len(const unsigned char *p, size_t n)
{
    size_t len = p[0] >= 0xf0 ? 4 : p[0] >= 0xe0 ? 3 : 2;
    if (p[0] < 0xc2 || p[0] > 0xf4 || n < len)
        return 0;
    for (size_t i = 1; i < len; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    if ((p[0] == 0xe0 && p[1] < 0xa0) || (p[0] == 0xed && p[1] >= 0xa0)
        || (p[0] == 0xf0 && p[1] < 0x90) || (p[0] == 0xf4 && p[1] >= 0x90))
        return 0;
    return len;
}

/* Appends s as a quoted JSON string. UTF-8 passes through untouched; a
 * byte that is no part of valid UTF-8 becomes U+FFFD, so that the JSON is
 * always valid (GET /_mock/last also gives a body's exact bytes in base64). */
static void buf_json_string(struct buf *b, const char *s, size_t n)
{
    buf_reserve(b, n + 2);
    b->data[b->len++] = '"';
    for (size_t i = 0, k; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\') {
            char esc[2] = { '\\', (char)ch };
            buf_append(b, esc, 2);
        } else if (ch < 0x20) {
            buf_printf(b, "\\u%04x", ch);
        } else if (ch < 0x80) {
            buf_append(b, &s[i], 1);
        } else if ((k = utf8_len((const unsigned char *)s + i, n - i)) > 0) {
            buf_append(b, &s[i], k);
            i += k - 1;
        } else {
            buf_puts(b, "\\ufffd");
        }
    }
    buf_append(b, "\"", 1);
}

static void put_string(struct buf *b, const char *s) { buf_json_string(b, s, strlen(s)); }

/* Appends the n bytes at p as a quoted base64 string (RFC 4648, padded). */
static void buf_base64_string(struct buf *b, const unsigned char *p, size_t n)
{
    static const char digits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    buf_append(b, "\"", 1);
    for (size_t i = 0; i < n; i += 3) {
        unsigned long v = (unsigned long)p[i] << 16;
        if (i + 1 < n)
            v |= (unsigned long)p[i + 1] << 8;
        if (i + 2 < n)
            v |= p[i + 2];
        char quad[4] = { digits[v >> 18 & 63], digits[v >> 12 & 63],
                         i + 1 < n ? digits[v >> 6 & 63] : '=', i + 2 < n ? digits[v & 63] : '=' };
        buf_append(b, quad, 4);
    }
    buf_append(b, "\"", 1);
}

/* ===== 2. Reading JSON just enough =====
 *
 * IMPLEMENTATION NOTES
 * The mock needs a handful of top-level fields, so instead of a parser it
 * walks the top-level object and skips every value it does not want. Skipping
 * respects strings and nesting, so a "model" inside a message is never taken
 * for the top-level one. Malformed JSON simply yields "field not found".
 */

static const char *json_ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n'))
        p++;
    return p;
}

/* p is at '"'; returns the position after the closing quote (the first quote no odd run of
 * backslashes escapes), or NULL. memchr finds the quotes: a conversation is mostly strings, and
 * the mock's CPU shares the machine with the gateway it tests. */
static const char *json_skip_string(const char *p, const char *end)
{
    for (p++; p < end;) {
        const char *q = memchr(p, '"', (size_t)(end - p)), *b;
        if (!q)
            return NULL;
        for (b = q; b[-1] == '\\'; b--) /* stops at the opening quote at the latest */
            ;
        if ((q - b) % 2 == 0)
            return q + 1;
        p = q + 1;
    }
    return NULL;
}

/* Returns the position after the value that starts at p, or NULL. */
static const char *json_skip_value(const char *p, const char *end)
{
    if (p >= end)
        return NULL;
    if (*p == '"')
        return json_skip_string(p, end);
    if (*p == '{' || *p == '[') {
        int depth = 0;
        while (p < end) {
            if (*p == '"') {
                if (!(p = json_skip_string(p, end)))
                    return NULL;
                continue;
            }
            if (*p == '{' || *p == '[')
                depth++;
            else if ((*p == '}' || *p == ']') && --depth == 0)
                return p + 1;
            p++;
        }
        return NULL;
    }
    const char *start = p;                /* number, true, false, null */
    while (p < end && !strchr(",}] \t\r\n", *p))
        p++;
    return p > start ? p : NULL;
}

/* Finds key in the object [p, end). On success *value and *value_end span
 * the raw value text. Keys are compared raw (no escapes in the keys we use). */
static int json_find(const char *p, const char *end, const char *key,
                     const char **value, const char **value_end)
{
    size_t key_len = strlen(key);
    p = json_ws(p, end);
    if (p >= end || *p++ != '{')
        return 0;
    for (;;) {
        p = json_ws(p, end);
        if (p >= end || *p != '"')
            return 0;
        const char *k = p + 1, *k_end = json_skip_string(p, end);
        if (!k_end)
            return 0;
        p = json_ws(k_end, end);
        if (p >= end || *p++ != ':')
            return 0;
        const char *v = json_ws(p, end);
        if (!(p = json_skip_value(v, end)))
            return 0;
        if ((size_t)(k_end - 1 - k) == key_len && !memcmp(k, key, key_len)) {
            *value = v;
            *value_end = p;
            return 1;
        }
        p = json_ws(p, end);
        if (p >= end || *p++ != ',')
            return 0;
    }
}

/* Copies the JSON string at [p, end) into out (NUL-terminated, truncated to
 * cap). It only ever reads model names and directives, so an escape keeps
 * just the escaped character and a \uXXXX becomes '?'. Returns 0, or -1 if
 * [p, end) is not a string. */
static int json_string_decode(const char *p, const char *end, char *out, size_t cap)
{
    size_t n = 0;
    if (p >= end || *p != '"' || json_skip_string(p, end) != end)
        return -1;
    for (p++; p < end - 1 && n + 1 < cap; p++) {
        if (*p == '\\' && *++p == 'u') {
            p += end - 1 - p > 4 ? 4 : end - 2 - p;    /* skip the hex digits */
            out[n++] = '?';
        } else {
            out[n++] = *p;
        }
    }
    out[n] = '\0';
    return 0;
}

static long json_hex4(const char *p, const char *end)
{
    char hex[5], *hex_end;
    if (end - p < 4 || !isxdigit((unsigned char)p[0]))
        return -1;
    memcpy(hex, p, 4);
    hex[4] = '\0';
    long u = strtol(hex, &hex_end, 16);
    return *hex_end ? -1 : u;
}

static void buf_utf8(struct buf *b, long u)
{
    static const unsigned char lead[] = { 0, 0, 0xc0, 0xe0, 0xf0 };
    unsigned char s[4];
    size_t n = u < 0x80 ? 1 : u < 0x800 ? 2 : u < 0x10000 ? 3 : 4;
    for (size_t i = n - 1; i > 0; i--, u >>= 6)
        s[i] = (unsigned char)(0x80 | (u & 0x3f));
    s[0] = (unsigned char)(n == 1 ? u : lead[n] | u);
    buf_append(b, s, n);
}

/* Appends the JSON string at [p, end) to b, decoded exactly (unlike
 * json_string_decode): every escape, a \uXXXX as UTF-8, a surrogate pair as
 * one code point, a lone surrogate as U+FFFD. Returns 0, or -1 if [p, end)
 * is not a string or has a bad escape. */
static int json_string_bytes(const char *p, const char *end, struct buf *b)
{
    static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
    if (p >= end || *p != '"' || json_skip_string(p, end) != end)
        return -1;
    for (p++; p < end - 1; p++) {
        const char *k;
        long u, lo;
        if (*p != '\\') {
            buf_append(b, p, 1);
        } else if (*++p != 'u') {
            if (!(k = strchr(from, *p)))
                return -1;
            buf_append(b, &to[k - from], 1);
        } else if ((u = json_hex4(p + 1, end - 1)) < 0) {
            return -1;
        } else {
            p += 4;
            if (u >= 0xd800 && u < 0xdc00 && end - 1 - p >= 7 && p[1] == '\\' && p[2] == 'u'
                && (lo = json_hex4(p + 3, end - 1)) >= 0xdc00 && lo < 0xe000) {
                u = 0x10000 + ((u - 0xd800) << 10) + (lo - 0xdc00);
                p += 6;
            } else if (u >= 0xd800 && u < 0xe000) {
                u = 0xfffd;
            }
            buf_utf8(b, u);
        }
    }
    return 0;
}

/* Reads a top-level string field into out; out is "" if it is absent. */
static int json_get_string(const char *body, size_t len, const char *key, char *out, size_t cap)
{
    const char *v, *v_end;
    out[0] = '\0';
    return json_find(body, body + len, key, &v, &v_end)
        && json_string_decode(v, v_end, out, cap) == 0;
}

static int json_is_true(const char *body, const char *end, const char *key)
{
    const char *v, *v_end;
    return json_find(body, end, key, &v, &v_end) && v_end - v == 4 && !memcmp(v, "true", 4);
}

/* Steps through the array at [arr, end): *at is NULL before the first
 * element. Each call sets *v and *v_end to the next element and returns 1;
 * after the last one (or at malformed JSON) it returns 0. */
static int json_next(const char *arr, const char *end, const char **at, const char **v, const char **v_end)
{
    const char *p;
    if (!*at) {
        p = json_ws(arr, end);
        if (p >= end || *p != '[')
            return 0;
        p = json_ws(p + 1, end);
        if (p < end && *p == ']')
            return 0;
    } else {
        p = json_ws(*at, end);
        if (p >= end || *p != ',')
            return 0;
        p = json_ws(p + 1, end);
    }
    if (!(*v_end = json_skip_value(p, end)))
        return 0;
    *v = p;
    *at = *v_end;
    return 1;
}

/* Is the value [v, v_end) the string lit (written without escapes)? */
static int json_is(const char *v, const char *v_end, const char *lit)
{
    size_t n = strlen(lit);
    return (size_t)(v_end - v) == n + 2 && *v == '"' && !memcmp(v + 1, lit, n);
}

/* Is the string [v, v_end) empty or only whitespace: space, \t, \n, \r,
 * raw or escaped, \f, and \u0009 .. \u000d or \u0020? */
static int json_blank(const char *v, const char *v_end)
{
    for (const char *p = v + 1; p < v_end - 1; p++) {
        if (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
            continue;
        if (*p != '\\' || p + 1 >= v_end - 1)
            return 0;
        if (strchr("ntrf", *++p))
            continue;
        if (*p != 'u' || v_end - 1 - p < 5)
            return 0;
        char hex[5] = { p[1], p[2], p[3], p[4], 0 }, *hex_end;
        long u = strtol(hex, &hex_end, 16);
        if (*hex_end || !((u >= 9 && u <= 13) || u == 32))
            return 0;
        p += 4;
    }
    return 1;
}

/* Is the value [v, v_end) a string of 1 or more of a-z, A-Z, 0-9, '_' and
 * '-' (the pattern ^[a-zA-Z0-9_-]+$)? */
static int json_is_name(const char *v, const char *v_end)
{
    if (v_end - v < 3 || *v != '"')
        return 0;
    for (const char *p = v + 1; p < v_end - 1; p++)
        if (!isalnum((unsigned char)*p) && *p != '_' && *p != '-')
            return 0;
    return 1;
}

/* Reads the number [v, v_end) into *x. Returns 0, or -1 if it is no number. */
static int json_number(const char *v, const char *v_end, double *x)
{
    char num[64], *num_end;
    if (v_end - v < 1 || v_end - v >= (long)sizeof num || !strchr("-0123456789", *v))
        return -1;
    memcpy(num, v, (size_t)(v_end - v));
    num[v_end - v] = '\0';
    *x = strtod(num, &num_end);
    return *num_end ? -1 : 0;
}

/* ===== 3. Directives ===== */

enum framing { FRAMING_LENGTH, FRAMING_CHUNKED, FRAMING_EOF };
enum garble { GARBLE_NONE, GARBLE_CHUNK_SIZE, GARBLE_CHUNK_LONG, GARBLE_HTML, GARBLE_TRUNCATED, GARBLE_HUGE };
enum bad_usage { BAD_USAGE_NONE, BAD_USAGE_NEGATIVE, BAD_USAGE_FRACTION, BAD_USAGE_STRING };

/* The token counts an answer reports (section 7 writes them in each API's
 * shape). In a directive, input and output are -1 until set: the answer
 * then makes them up from the request. */
struct usage {
    long long input;             /* OpenAI: with the cached tokens; Anthropic: without cache reads and writes */
    long long cached;            /* cache reads */
    long long cache_write, cache_write_1h;      /* Anthropic: cache writes, and of them the 1-hour ones */
    long long output, reasoning; /* reasoning: OpenAI, part of output */
    int none;                    /* usage=none: no usage object at all */
    int bad;                     /* enum bad_usage: how the input count is written */
};

struct directive {
    long status;                 /* 0: a normal answer */
    long retry_after;            /* -1: no Retry-After header */
    long head_delay_ms, first_event_delay_ms, event_delay_ms;
    long end_delay_ms;           /* a stream: between its last event and the end of its body */
    long events;                 /* content events in a stream (and, by default, output tokens) */
    long cut_after;              /* -1: never cut */
    long context_length, quota, reset, close, hang;    /* flags */
    int framing;                 /* enum framing */
    long body_mb, head_kb, head_lines;          /* hostile answers: 0 is off */
    int garble;                  /* enum garble */
    long garble_after, trickle_ms;
    long junk_after_ms;          /* -1: no junk */
    long content_kb;             /* a whole answer's text: N KiB of "x" (0: the usual greeting) */
    long raw_status;             /* -1: the status line says the real status; else this number */
    long tool_call;              /* answer with one call of the agent's shell tool, not text */
    long tools;                  /* answer with N parallel calls tool_0 .. tool_<N-1> (0: off) */
    long text_first;             /* with calls: a text ("Let me check.") before them */
    long reasoning;              /* N reasoning deltas (a thinking block) before the answer */
    long bytewise, keepalive;    /* flags: one byte per write; keep-alive comments or pings */
    char finish[WORD_MAX];       /* the finish_reason / stop_reason to send ("": the usual one) */
    char stream_error[WORD_MAX]; /* a stream ends with an error event of this type ("": none) */
    struct usage usage;
};

static const struct directive directive_ok = {
    .retry_after = -1, .events = 3, .cut_after = -1, .framing = FRAMING_LENGTH, .junk_after_ms = -1,
    .raw_status = -1,
    .usage = { .input = -1, .output = -1 },
};

/* The tokens that set one field: a flag to 1, a number (at most 10^9) or a
 * token count (a long long, at most TOKENS_MAX) to its value, or a word (a
 * char[WORD_MAX]: 1 to WORD_MAX-1 of a-z, 0-9 and '_') to itself. */
enum token_kind { TOKEN_FLAG, TOKEN_NUMBER, TOKEN_COUNT, TOKEN_WORD };

static const struct { const char *name; size_t offset; enum token_kind kind; } directive_tokens[] = {
    { "status", offsetof(struct directive, status), TOKEN_NUMBER },
    { "retry_after", offsetof(struct directive, retry_after), TOKEN_NUMBER },
    { "head_delay_ms", offsetof(struct directive, head_delay_ms), TOKEN_NUMBER },
    { "first_event_delay_ms", offsetof(struct directive, first_event_delay_ms), TOKEN_NUMBER },
    { "event_delay_ms", offsetof(struct directive, event_delay_ms), TOKEN_NUMBER },
    { "end_delay_ms", offsetof(struct directive, end_delay_ms), TOKEN_NUMBER },
    { "events", offsetof(struct directive, events), TOKEN_NUMBER },
    { "cut_after", offsetof(struct directive, cut_after), TOKEN_NUMBER },
    { "context_length", offsetof(struct directive, context_length), TOKEN_FLAG },
    { "quota", offsetof(struct directive, quota), TOKEN_FLAG },
    { "reset", offsetof(struct directive, reset), TOKEN_FLAG },
    { "close", offsetof(struct directive, close), TOKEN_FLAG },
    { "hang", offsetof(struct directive, hang), TOKEN_FLAG },
    { "body_mb", offsetof(struct directive, body_mb), TOKEN_NUMBER },
    { "head_kb", offsetof(struct directive, head_kb), TOKEN_NUMBER },
    { "head_lines", offsetof(struct directive, head_lines), TOKEN_NUMBER },
    { "garble_after", offsetof(struct directive, garble_after), TOKEN_NUMBER },
    { "trickle_ms", offsetof(struct directive, trickle_ms), TOKEN_NUMBER },
    { "junk_after_ms", offsetof(struct directive, junk_after_ms), TOKEN_NUMBER },
    { "content_kb", offsetof(struct directive, content_kb), TOKEN_NUMBER },
    { "raw_status", offsetof(struct directive, raw_status), TOKEN_NUMBER },
    { "tool_call", offsetof(struct directive, tool_call), TOKEN_FLAG },
    { "tools", offsetof(struct directive, tools), TOKEN_NUMBER },
    { "text_first", offsetof(struct directive, text_first), TOKEN_FLAG },
    { "reasoning", offsetof(struct directive, reasoning), TOKEN_NUMBER },
    { "bytewise", offsetof(struct directive, bytewise), TOKEN_FLAG },
    { "keepalive", offsetof(struct directive, keepalive), TOKEN_FLAG },
    { "finish", offsetof(struct directive, finish), TOKEN_WORD },
    { "stream_error", offsetof(struct directive, stream_error), TOKEN_WORD },
    { "input_tokens", offsetof(struct directive, usage.input), TOKEN_COUNT },
    { "cached_tokens", offsetof(struct directive, usage.cached), TOKEN_COUNT },
    { "cache_write", offsetof(struct directive, usage.cache_write), TOKEN_COUNT },
    { "cache_write_1h", offsetof(struct directive, usage.cache_write_1h), TOKEN_COUNT },
    { "output_tokens", offsetof(struct directive, usage.output), TOKEN_COUNT },
    { "reasoning_tokens", offsetof(struct directive, usage.reasoning), TOKEN_COUNT },
};

/* The tokens that choose one of named values: the field (an int) is set to
 * the value's index in names (NULL-terminated; "" is never a value). */
static const char *const framing_names[] = { "length", "chunked", "eof", NULL };
static const char *const garble_names[] = { "", "chunk_size", "chunk_long", "html", "truncated", "huge", NULL };
static const char *const usage_names[] = { "", "none", NULL };
static const char *const bad_usage_names[] = { "", "negative", "fraction", "string", NULL };

static const struct { const char *name; size_t offset; const char *const *names; } directive_choices[] = {
    { "framing", offsetof(struct directive, framing), framing_names },
    { "garble", offsetof(struct directive, garble), garble_names },
    { "usage", offsetof(struct directive, usage.none), usage_names },
    { "bad_usage", offsetof(struct directive, usage.bad), bad_usage_names },
};

/* Sets the choice token tok=value in *d. Returns 0, or -1 if tok is no
 * choice or value is none of its names. */
static int directive_choice(struct directive *d, const char *tok, const char *value)
{
    for (size_t i = 0; i < sizeof directive_choices / sizeof *directive_choices; i++) {
        if (strcmp(tok, directive_choices[i].name))
            continue;
        for (int k = 0; *value && directive_choices[i].names[k]; k++)
            if (!strcmp(value, directive_choices[i].names[k])) {
                *(int *)((char *)d + directive_choices[i].offset) = k;
                return 0;
            }
        return -1;
    }
    return -1;
}

/* Parses text into *d. On a bad token returns -1 with a message in why. */
static int directive_parse(const char *text, struct directive *d, char *why, size_t why_cap)
{
    char copy[DIRECTIVE_MAX], *save, *tok;
    *d = directive_ok;
    snprintf(copy, sizeof copy, "%s", text);
    for (tok = strtok_r(copy, " ", &save); tok; tok = strtok_r(NULL, " ", &save)) {
        char *value = strchr(tok, '='), *num_end;
        if (value)
            *value++ = '\0';
        if (!value && !strcmp(tok, "ok"))
            continue;
        if (value && directive_choice(d, tok, value) == 0)
            continue;
        size_t i = 0, n = sizeof directive_tokens / sizeof *directive_tokens;
        while (i < n && strcmp(tok, directive_tokens[i].name))
            i++;
        if (i == n || !value != (directive_tokens[i].kind == TOKEN_FLAG))
            goto bad;
        char *field = (char *)d + directive_tokens[i].offset;
        if (directive_tokens[i].kind == TOKEN_WORD) {
            size_t len = strlen(value);
            if (!len || len >= WORD_MAX || strspn(value, "abcdefghijklmnopqrstuvwxyz0123456789_") != len)
                goto bad;
            memcpy(field, value, len + 1);
            continue;
        }
        long long v = value ? strtoll(value, &num_end, 10) : 1;
        long long max = directive_tokens[i].kind == TOKEN_COUNT ? TOKENS_MAX : 1000000000;
        if (value && (num_end == value || *num_end || v < 0 || v > max))
            goto bad;
        if (directive_tokens[i].kind == TOKEN_COUNT)
            *(long long *)field = v;
        else
            *(long *)field = (long)v;
    }
    if (d->usage.cache_write_1h > d->usage.cache_write) {
        snprintf(why, why_cap, "mock directive cache_write_1h=%lld is more than cache_write=%lld",
                 d->usage.cache_write_1h, d->usage.cache_write);
        return -1;
    }
    if (d->status && (d->status < 400 || d->status > 599)) {
        snprintf(why, why_cap, "mock directive status=%ld is not an error status (400..599)", d->status);
        return -1;
    }
    if (d->head_kb > 16384 || d->head_lines > 100000) {
        snprintf(why, why_cap, "mock directive head_kb (at most 16384) or head_lines (at most 100000) too large");
        return -1;
    }
    if (d->raw_status > 999) {
        snprintf(why, why_cap, "mock directive raw_status=%ld is more than three digits", d->raw_status);
        return -1;
    }
    if (d->tools > CALLS_MAX || (d->tools && d->tool_call)) {
        snprintf(why, why_cap, "mock directive tools=%ld: at most %d calls, and not with tool_call", d->tools, CALLS_MAX);
        return -1;
    }
    if (d->reasoning > REASONING_MAX) {
        snprintf(why, why_cap, "mock directive reasoning=%ld is more than %d", d->reasoning, REASONING_MAX);
        return -1;
    }
    if (d->context_length && !d->status)
        d->status = 400;
    if (d->quota && !d->status)
        d->status = 429;
    return 0;
bad:
    snprintf(why, why_cap, "bad mock directive '%s' (in '%s')", tok, text);
    return -1;
}

/* ===== 4. Shared state: counters, scripts, the log, the last request ===== */

struct model {                   /* what the mock knows about one upstream model */
    char name[MODEL_MAX];
    long calls;
    long long filler_bytes;      /* body_mb: the filler sent for it */
    char **steps;                /* the scripted directives, a FIFO: steps[first..count) */
    size_t first, count, cap;
    struct canned {              /* POST /_mock/answer's, a ring: answers[(next + i) % MAX] */
        long status;             /* 0: none */
        char type[TYPE_MAX];
        struct buf body;
    } answers[ANSWERS_MAX];
    size_t answers_next, answers_len;
};

struct log_entry {
    long t_ms;
    char model[MODEL_MAX], directive[DIRECTIVE_MAX], path[256];
    char refused[256];           /* why the mock refused the request ("": it did not) */
};

static struct {
    pthread_mutex_t lock;        /* guards everything below */
    long start_ms;
    long connections, open_connections, requests;
    long refused;                /* requests refused as the real APIs would (invalid bodies) */
    long tls_handshakes, tls_resumed, tls_failed;   /* TLS mode only */
    unsigned epoch;              /* bumped by /_mock/reset */
    unsigned long next_id;       /* for "chatcmpl-mock-N"; never reset */
    struct model *models;
    size_t nmodels;
    struct log_entry log[LOG_MAX];
    size_t log_next, log_len;    /* a ring: the last LOG_MAX inference requests */
    struct buf last_head, last_body;  /* the last request that was not a control request */
    char last_sni[256];          /* the TLS server name (SNI) of its connection */
} mock = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* Finds or adds the record of a model. Caller holds the lock. */
static struct model *mock_model(const char *name)
{
    for (size_t i = 0; i < mock.nmodels; i++)
        if (!strcmp(mock.models[i].name, name))
            return &mock.models[i];
    if (!(mock.models = realloc(mock.models, (mock.nmodels + 1) * sizeof *mock.models)))
        die("realloc");
    struct model *m = &mock.models[mock.nmodels++];
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", name);
    return m;
}

static void model_push_step(struct model *m, const char *step)
{
    if (m->count == m->cap) {
        m->cap = m->cap ? m->cap * 2 : 8;
        if (!(m->steps = realloc(m->steps, m->cap * sizeof *m->steps)))
            die("realloc");
    }
    if (!(m->steps[m->count++] = strdup(step)))
        die("strdup");
}

/* Takes the model's next queued answer, if any, into *a, which then owns its
 * body (a->status is 0 if there was none). Caller holds the lock. */
static void model_pop_answer(struct model *m, struct canned *a)
{
    a->status = 0;
    if (!m->answers_len)
        return;
    struct canned *q = &m->answers[m->answers_next];
    *a = *q;
    memset(q, 0, sizeof *q);
    m->answers_next = (m->answers_next + 1) % ANSWERS_MAX;
    m->answers_len--;
}

static unsigned long mock_begin_request(const char *model, const char *path, size_t path_len,
                                        const char *body_directive, char *directive, size_t cap,
                                        const char *refused, struct canned *answer)
{
    pthread_mutex_lock(&mock.lock);
    struct model *m = mock_model(model);
    model_pop_answer(m, answer);
    if (m->first < m->count) {
        snprintf(directive, cap, "%s", m->steps[m->first]);
        free(m->steps[m->first++]);
        if (m->first == m->count)
            m->first = m->count = 0;
    } else {
        snprintf(directive, cap, "%s", body_directive[0] ? body_directive : "ok");
    }
    m->calls++;
    mock.requests++;
    struct log_entry *e = &mock.log[mock.log_next];
    mock.log_next = (mock.log_next + 1) % LOG_MAX;
    if (mock.log_len < LOG_MAX)
        mock.log_len++;
    e->t_ms = now_ms() - mock.start_ms;
    snprintf(e->model, sizeof e->model, "%s", model);
    snprintf(e->directive, sizeof e->directive, "%s", directive);
    snprintf(e->path, sizeof e->path, "%.*s", (int)path_len, path);
    snprintf(e->refused, sizeof e->refused, "%.*s", (int)sizeof e->refused - 1, refused ? refused : "");
    mock.refused += refused != NULL;
    unsigned long id = ++mock.next_id;
    pthread_mutex_unlock(&mock.lock);
    return id;
}

static void mock_reset(void)
{
    pthread_mutex_lock(&mock.lock);
    for (size_t i = 0; i < mock.nmodels; i++) {
        for (size_t j = mock.models[i].first; j < mock.models[i].count; j++)
            free(mock.models[i].steps[j]);
        free(mock.models[i].steps);
        for (size_t j = 0; j < ANSWERS_MAX; j++)
            free(mock.models[i].answers[j].body.data);
    }
    mock.nmodels = 0;
    mock.connections = mock.requests = mock.refused = 0;
    mock.tls_handshakes = mock.tls_resumed = mock.tls_failed = 0;
    mock.log_next = mock.log_len = 0;
    mock.last_head.len = mock.last_body.len = 0;
    mock.epoch++;
    pthread_mutex_unlock(&mock.lock);
}

/* ===== 5. HTTP/1.1 requests =====
 *
 * IMPLEMENTATION NOTES
 * http_parse() is a pure function of the bytes received so far: it returns
 * the length of the first complete request (head and body), HTTP_AGAIN, or
 * an error, and every pointer it sets points into the caller's buffer. The
 * connection simply calls it again after each recv(). That re-scans a large
 * chunked body once per recv(), a shortcut that is harmless for a test tool.
 */

enum { HTTP_AGAIN = -1, HTTP_BAD = -2, HTTP_HEAD_TOO_BIG = -3, HTTP_BODY_TOO_BIG = -4, HTTP_CLOSED = -5 };

struct header {
    const char *name, *value;
    size_t name_len, value_len;
};

struct request {
    const char *method, *path;
    size_t method_len, path_len;       /* path_len stops before any '?' */
    struct header headers[HEADERS_MAX];
    int nheaders;
    size_t head_len;                   /* 0 until the head is complete */
    size_t content_length;
    int chunked, want_close, expect_continue;
    const char *body;                  /* after conn_read_request: the decoded body */
    size_t body_len;
};

static int slice_is(const char *s, size_t n, const char *lit)
{
    return strlen(lit) == n && !strncasecmp(s, lit, n);
}

static int slice_has(const char *s, size_t n, const char *word)
{
    size_t w = strlen(word);
    for (size_t i = 0; i + w <= n; i++)
        if (!strncasecmp(s + i, word, w))
            return 1;
    return 0;
}

/* Parses the head: request line and headers. Returns the head length. */
static long http_parse_head(const char *buf, size_t len, struct request *r)
{
    r->head_len = 0;
    const char *end = memmem(buf, len, "\r\n\r\n", 4);
    if (!end)
        return len > HEAD_MAX ? HTTP_HEAD_TOO_BIG : HTTP_AGAIN;
    if (end - buf > HEAD_MAX)
        return HTTP_HEAD_TOO_BIG;
    const char *stop = end + 2, *p = buf;            /* every line ends in CRLF before stop */
    const char *le = memmem(p, (size_t)(stop - p), "\r\n", 2);
    const char *sp1 = memchr(p, ' ', (size_t)(le - p));
    const char *sp2 = sp1 ? memchr(sp1 + 1, ' ', (size_t)(le - sp1 - 1)) : NULL;
    if (!sp2 || sp1 == p || sp2 == sp1 + 1)
        return HTTP_BAD;
    int http10 = slice_is(sp2 + 1, (size_t)(le - sp2 - 1), "HTTP/1.0");
    if (!http10 && !slice_is(sp2 + 1, (size_t)(le - sp2 - 1), "HTTP/1.1"))
        return HTTP_BAD;
    r->method = p;
    r->method_len = (size_t)(sp1 - p);
    r->path = sp1 + 1;
    const char *query = memchr(r->path, '?', (size_t)(sp2 - r->path));
    r->path_len = (size_t)((query ? query : sp2) - r->path);
    r->nheaders = 0;
    r->content_length = 0;
    r->chunked = r->expect_continue = 0;
    r->want_close = http10;
    for (p = le + 2; p < stop; p = le + 2) {
        le = memmem(p, (size_t)(stop - p), "\r\n", 2);
        const char *colon = memchr(p, ':', (size_t)(le - p));
        if (!colon || colon == p || r->nheaders == HEADERS_MAX)
            return HTTP_BAD;
        const char *v = colon + 1, *v_end = le;
        while (v < v_end && (*v == ' ' || *v == '\t')) v++;
        while (v_end > v && (v_end[-1] == ' ' || v_end[-1] == '\t')) v_end--;
        struct header *h = &r->headers[r->nheaders++];
        *h = (struct header){ p, v, (size_t)(colon - p), (size_t)(v_end - v) };
        if (slice_is(h->name, h->name_len, "content-length")) {
            char *num_end;
            unsigned long long n = strtoull(v, &num_end, 10);
            if (num_end != v_end || v == v_end)
                return HTTP_BAD;
            if (n > BODY_MAX)
                return HTTP_BODY_TOO_BIG;
            r->content_length = (size_t)n;
        } else if (slice_is(h->name, h->name_len, "transfer-encoding")) {
            r->chunked = slice_has(v, h->value_len, "chunked");
        } else if (slice_is(h->name, h->name_len, "connection")) {
            if (slice_has(v, h->value_len, "close")) r->want_close = 1;
            else if (slice_has(v, h->value_len, "keep-alive")) r->want_close = 0;
        } else if (slice_is(h->name, h->name_len, "expect")) {
            r->expect_continue = slice_has(v, h->value_len, "100-continue");
        }
    }
    r->head_len = (size_t)(end + 4 - buf);
    return (long)r->head_len;
}

/* Walks a chunked body; appends the data to out if out is not NULL.
 * Returns the bytes of chunked encoding (through the final CRLF). */
static long chunked_decode(const char *p, size_t len, struct buf *out)
{
    size_t i = 0;
    for (;;) {
        const char *nl = memchr(p + i, '\n', len - i);
        if (!nl)
            return HTTP_AGAIN;
        size_t size = 0, digits = 0;
        for (; i < len && p[i] && strchr("0123456789abcdefABCDEF", p[i]); i++, digits++) {
            size = size * 16 + (size_t)(p[i] <= '9' ? p[i] - '0' : (p[i] | 0x20) - 'a' + 10);
            if (size > BODY_MAX)
                return HTTP_BODY_TOO_BIG;
        }
        if (!digits)
            return HTTP_BAD;
        i = (size_t)(nl - p) + 1;                  /* skip extensions and CRLF */
        if (size == 0) {                           /* trailers end at an empty line */
            for (;;) {
                if (!(nl = memchr(p + i, '\n', len - i)))
                    return HTTP_AGAIN;
                size_t line = (size_t)(nl - (p + i));
                i = (size_t)(nl - p) + 1;
                if (line == 0 || (line == 1 && p[i - 2] == '\r'))
                    return (long)i;
            }
        }
        if (len - i < size + 2)
            return HTTP_AGAIN;
        if (out)
            buf_append(out, p + i, size);
        i += size;
        if (p[i] != '\r' || p[i + 1] != '\n')
            return HTTP_BAD;
        i += 2;
    }
}

/* Parses one whole request. For a chunked body, r->body is still encoded. */
static long http_parse(const char *buf, size_t len, struct request *r)
{
    long head = http_parse_head(buf, len, r);
    if (head < 0)
        return head;
    r->body = buf + head;
    if (r->chunked) {
        long n = chunked_decode(r->body, len - (size_t)head, NULL);
        if (n < 0)
            return n;
        r->body_len = (size_t)n;
    } else {
        if (len - (size_t)head < r->content_length)
            return HTTP_AGAIN;
        r->body_len = r->content_length;
    }
    return head + (long)r->body_len;
}

static const struct header *request_header(const struct request *r, const char *name)
{
    for (int i = 0; i < r->nheaders; i++)
        if (slice_is(r->headers[i].name, r->headers[i].name_len, name) && r->headers[i].value_len)
            return &r->headers[i];
    return NULL;
}

/* ===== 6. Connections: reading, writing, waiting ===== */

/* A connection's TLS state (TLS mode only, see section 9). BearSSL allocates
 * nothing: the server context, the blocking I/O wrapper and the record
 * buffers all live here, in one heap block that never moves. */
struct tls {
    br_ssl_server_context sc;    /* first: BearSSL's server context pointer is a struct tls pointer */
    br_sslio_context io;
    int cached;                  /* the session cache found the session the client offered */
    unsigned char cached_id[32]; /* ... under this ID */
    unsigned char iobuf[BR_SSL_BUFSIZE_BIDI];
};

struct conn {
    int fd;
    int counted;                 /* counts in connections/open_connections */
    unsigned epoch;              /* mock.epoch when it was counted */
    struct tls *tls;             /* NULL: plain HTTP */
    int resumed;                 /* TLS: the handshake resumed a cached session */
    int abrupt;                  /* TLS: end without close_notify (cut_after, reset) */
    int bytewise;                /* the answer being sent goes out one byte per write */
    int batching;                /* conn_send collects into batch, for one write (conn_flush) */
    struct buf batch;
    long pauses;                 /* bytewise: the pauses left to this answer */
    struct buf in;               /* received bytes not yet consumed */
    struct buf body;             /* a decoded chunked request body */
    struct buf json;             /* the answer body (or SSE event) being built */
    struct buf out;              /* the bytes of the next write */
};

/* The socket I/O under BearSSL's blocking wrapper: ctx points at the fd.
 * Both return the bytes moved, or -1 (EOF counts as an error). */
static int sock_read(void *ctx, unsigned char *p, size_t n)
{
    for (;;) {
        ssize_t got = recv(*(int *)ctx, p, n, 0);
        if (got < 0 && errno == EINTR)
            continue;
        return got > 0 ? (int)got : -1;
    }
}

static int sock_write(void *ctx, const unsigned char *p, size_t n)
{
    for (;;) {
        ssize_t w = send(*(int *)ctx, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        return w > 0 ? (int)w : -1;
    }
}

/* Sends n bytes. Over TLS every call is flushed, so each write (each SSE
 * event, say) leaves at once, in records of its own. */
static int conn_write(struct conn *c, const char *p, size_t n)
{
    if (c->tls)
        return br_sslio_write_all(&c->tls->io, p, n) < 0 || br_sslio_flush(&c->tls->io) < 0 ? -1 : 0;
    while (n > 0) {
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Sends n bytes, or, for a bytewise answer, each byte in a write of its own
 * (TCP_NODELAY is on: each is a segment of its own, a TLS record over TLS),
 * with a pause of BYTEWISE_PAUSE_US after each of the first BYTEWISE_PAUSES
 * bytes of the answer, so that the reader mostly gets them one at a time
 * and an answer of a few KiB still takes well under a second. */
static int conn_send(struct conn *c, const char *p, size_t n)
{
    if (c->batching) {
        buf_append(&c->batch, p, n);
        return 0;
    }
    if (!c->bytewise)
        return conn_write(c, p, n);
    for (size_t i = 0; i < n; i++) {
        if (conn_write(c, p + i, 1) < 0)
            return -1;
        if (c->pauses > 0) {
            struct timespec ts = { 0, BYTEWISE_PAUSE_US * 1000L };
            c->pauses--;
            nanosleep(&ts, NULL);
        }
    }
    return 0;
}

/* What conn_send collected while batching, in one write (bytewise still splits it). */
static int conn_flush(struct conn *c)
{
    c->batching = 0;
    int r = c->batch.len ? conn_send(c, c->batch.data, c->batch.len) : 0;
    c->batch.len = 0;
    return r;
}

/* Receives at most n bytes; returns how many, or <= 0 on EOF or error. */
static ssize_t conn_recv(struct conn *c, void *p, size_t n)
{
    if (c->tls)
        return br_sslio_read(&c->tls->io, p, n);
    for (;;) {
        ssize_t got = recv(c->fd, p, n, 0);
        if (got >= 0 || errno != EINTR)
            return got;
    }
}

/* Waits ms milliseconds (forever if ms < 0). Returns -1 as soon as the peer
 * closes or resets the connection: POLLRDHUP reports the peer's FIN even
 * when a pipelined request sits unread in the socket. */
static int conn_wait(struct conn *c, long ms)
{
    long deadline = now_ms() + ms;
    for (;;) {
        long left = ms < 0 ? -1 : deadline - now_ms();
        if (ms >= 0 && left <= 0)
            return 0;
        struct pollfd pfd = { .fd = c->fd, .events = POLLRDHUP };
        int n = poll(&pfd, 1, (int)left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n != 0)
            return -1;
    }
}

/* Has the peer closed or reset the connection? Does not wait. */
static int conn_gone(struct conn *c)
{
    struct pollfd pfd = { .fd = c->fd, .events = POLLRDHUP };
    return poll(&pfd, 1, 0) > 0;
}

/* After a hostile answer: send nothing more, wait (bounded) for the peer to
 * leave, and end the connection without a TLS close_notify. Returns 0. */
static int conn_linger(struct conn *c)
{
    conn_wait(c, HOSTILE_WAIT_MS);
    c->abrupt = 1;
    return 0;
}

/* Reads until c->in holds a whole request. Returns its length or an HTTP_ code. */
static long conn_read_request(struct conn *c, struct request *r)
{
    int continue_sent = 0;
    for (;;) {
        long n = http_parse(c->in.data, c->in.len, r);
        if (n >= 0 && r->chunked) {
            c->body.len = 0;
            chunked_decode(r->body, r->body_len, &c->body);
            r->body = c->body.data ? c->body.data : "";
            r->body_len = c->body.len;
        }
        if (n != HTTP_AGAIN)
            return n;
        if (r->head_len && r->expect_continue && !continue_sent) {
            static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
            if (conn_send(c, cont, sizeof cont - 1) < 0)
                return HTTP_CLOSED;
            continue_sent = 1;
        }
        if (c->in.len > HEAD_MAX + BODY_MAX)
            return HTTP_BODY_TOO_BIG;
        buf_reserve(&c->in, READ_CHUNK);
        ssize_t got = conn_recv(c, c->in.data + c->in.len, c->in.cap - c->in.len);
        if (got <= 0)
            return HTTP_CLOSED;
        c->in.len += (size_t)got;
    }
}

/* The reason phrase of each status the mock is likely to send, and the
 * error that status=N answers with: OpenAI's type and code, Anthropic's type
 * (its errors page: other 4xx are invalid_request_error, other 5xx api_error). */
static const struct status { long status; const char *reason, *type, *code, *anthropic_type; } statuses[] = {
    { 200, "OK", NULL, NULL, NULL },
    { 400, "Bad Request", "invalid_request_error", "invalid_request", "invalid_request_error" },
    { 401, "Unauthorized", "authentication_error", "invalid_api_key", "authentication_error" },
    { 402, "Payment Required", "invalid_request_error", "payment_required", "billing_error" },
    { 403, "Forbidden", "permission_error", "permission_denied", "permission_error" },
    { 404, "Not Found", "not_found_error", "model_not_found", "not_found_error" },
    { 405, "Method Not Allowed", "invalid_request_error", "method_not_allowed", "invalid_request_error" },
    { 408, "Request Timeout", "timeout_error", "timeout", "invalid_request_error" },
    { 413, "Content Too Large", "invalid_request_error", "request_too_large", "request_too_large" },
    { 429, "Too Many Requests", "rate_limit_error", "rate_limit_exceeded", "rate_limit_error" },
    { 431, "Request Header Fields Too Large", "invalid_request_error", "request_too_large", "invalid_request_error" },
    { 500, "Internal Server Error", "server_error", "internal_error", "api_error" },
    { 502, "Bad Gateway", "server_error", "bad_gateway", "api_error" },
    { 503, "Service Unavailable", "server_error", "service_unavailable", "api_error" },
    { 504, "Gateway Timeout", "server_error", "gateway_timeout", "timeout_error" },
    { 529, "Overloaded", "server_error", "overloaded", "overloaded_error" },
};

static struct status status_info(long status)
{
    for (size_t i = 0; i < sizeof statuses / sizeof *statuses; i++)
        if (statuses[i].status == status)
            return statuses[i];
    return (struct status){ status, "Mock Status", status >= 500 ? "server_error" : "invalid_request_error",
                            "mock_error", status >= 500 ? "api_error" : "invalid_request_error" };
}

/* Writes the status line and the headers every answer shares into c->out. */
static void put_head(struct conn *c, long status, const char *content_type,
                     const struct directive *d, int keep)
{
    c->out.len = 0;
    buf_printf(&c->out, d->raw_status >= 0 ? "HTTP/1.1 %03ld %s\r\nContent-Type: %s\r\n" : "HTTP/1.1 %ld %s\r\nContent-Type: %s\r\n",
               d->raw_status >= 0 ? d->raw_status : status, status_info(status).reason, content_type);
    if (d->retry_after >= 0)
        buf_printf(&c->out, "Retry-After: %ld\r\n", d->retry_after);
    if (!keep)
        buf_puts(&c->out, "Connection: close\r\n");
    if (d->head_kb) {
        buf_puts(&c->out, "X-Mock-Filler: ");
        buf_reserve(&c->out, (size_t)d->head_kb * 1024);
        memset(c->out.data + c->out.len, 'h', (size_t)d->head_kb * 1024);
        c->out.len += (size_t)d->head_kb * 1024;
        buf_puts(&c->out, "\r\n");
    }
    for (long i = 0; i < d->head_lines; i++)
        buf_printf(&c->out, "X-Mock-Line-%ld: %ld\r\n", i, i);
}

static const char junk[] = "junk after the answer: not HTTP\r\n";

/* Sends c->json as a whole answer in one write, framed as d says.
 * Returns 1 to keep the connection open, 0 to close it. garble=chunk_size
 * and chunk_long break the chunked framing; junk_after_ms sends junk after
 * the answer. Both then linger without answering. */
static int send_answer(struct conn *c, const struct request *r, const struct directive *d, long status)
{
    int bad_chunk = d->garble == GARBLE_CHUNK_SIZE || d->garble == GARBLE_CHUNK_LONG;
    enum framing framing = bad_chunk ? FRAMING_CHUNKED : d->framing;
    int keep = !r->want_close && !d->close && framing != FRAMING_EOF;
    put_head(c, status, "application/json", d, keep);
    if (framing == FRAMING_LENGTH)
        buf_printf(&c->out, "Content-Length: %zu\r\n\r\n", c->json.len);
    else if (d->garble == GARBLE_CHUNK_SIZE)
        buf_puts(&c->out, "Transfer-Encoding: chunked\r\n\r\nzz\r\n");
    else if (framing == FRAMING_CHUNKED)                /* chunk_long: the size says half */
        buf_printf(&c->out, "Transfer-Encoding: chunked\r\n\r\n%zx\r\n", bad_chunk ? c->json.len / 2 : c->json.len);
    else
        buf_puts(&c->out, "\r\n");
    buf_append(&c->out, c->json.data, c->json.len);
    if (framing == FRAMING_CHUNKED)
        buf_puts(&c->out, "\r\n0\r\n\r\n");       /* the body is never empty */
    if (d->junk_after_ms == 0)
        buf_puts(&c->out, junk);
    if (conn_send(c, c->out.data, c->out.len) < 0)
        return 0;
    if (d->junk_after_ms > 0 && conn_wait(c, d->junk_after_ms) == 0)
        conn_send(c, junk, sizeof junk - 1);
    if (bad_chunk || d->junk_after_ms >= 0)
        return conn_linger(c);
    return keep;
}

/* Ends the head in c->out with the framing of a body of len bytes. */
static void put_framing(struct conn *c, int framing, long long len)
{
    if (framing == FRAMING_LENGTH)
        buf_printf(&c->out, "Content-Length: %lld\r\n\r\n", len);
    else if (framing == FRAMING_CHUNKED)
        buf_puts(&c->out, "Transfer-Encoding: chunked\r\n\r\n");
    else
        buf_puts(&c->out, "\r\n");
}

/* body_mb=N: a 200 head, then N MiB of filler as fast as the peer reads,
 * in pieces; stops at once when the peer leaves. */
static int send_filler(struct conn *c, const struct request *r, const struct directive *d, const char *model)
{
    long long total = (long long)d->body_mb << 20;
    int keep = !r->want_close && !d->close && d->framing != FRAMING_EOF;
    put_head(c, 200, "application/json", d, keep);
    put_framing(c, d->framing, total);
    if (conn_send(c, c->out.data, c->out.len) < 0)
        return 0;
    for (long long sent = 0; sent < total; sent += FILLER_PIECE) {
        char size_line[32];
        int n = snprintf(size_line, sizeof size_line, "%x\r\n", FILLER_PIECE);
        if (conn_gone(c)
            || (d->framing == FRAMING_CHUNKED && conn_send(c, size_line, (size_t)n) < 0)
            || conn_send(c, filler, FILLER_PIECE) < 0
            || (d->framing == FRAMING_CHUNKED && conn_send(c, "\r\n", 2) < 0)) {
            c->abrupt = 1;
            return 0;
        }
        pthread_mutex_lock(&mock.lock);
        mock_model(model)->filler_bytes += FILLER_PIECE;
        pthread_mutex_unlock(&mock.lock);
    }
    if (d->framing == FRAMING_CHUNKED && conn_send(c, "0\r\n\r\n", 5) < 0)
        return 0;
    return keep;
}

/* trickle_ms=N: the head with the body's true Content-Length, then the body
 * one byte every N ms, never its last byte. */
static int send_trickle(struct conn *c, const struct request *r, const struct directive *d)
{
    put_head(c, 200, "application/json", d, !r->want_close);
    buf_printf(&c->out, "Content-Length: %zu\r\n\r\n", c->json.len);
    if (conn_send(c, c->out.data, c->out.len) < 0)
        return 0;
    for (size_t i = 0; i + 1 < c->json.len; i++)
        if (conn_wait(c, d->trickle_ms) < 0 || conn_send(c, c->json.data + i, 1) < 0)
            return 0;
    return conn_linger(c);
}

/* Writes an error body into c->json: OpenAI's shape, where a NULL code or
 * param is sent as null (as OpenAI does for a plain invalid value), or
 * Anthropic's, which has neither. */
static void put_error(struct conn *c, int anthropic, const char *type, const char *code, const char *param,
                      const char *message)
{
    c->json.len = 0;
    if (anthropic) {
        buf_printf(&c->json, "{\"type\":\"error\",\"error\":{\"type\":\"%s\",\"message\":", type);
        buf_json_string(&c->json, message, strlen(message));
        buf_puts(&c->json, "}}");
        return;
    }
    buf_puts(&c->json, "{\"error\":{\"message\":");
    buf_json_string(&c->json, message, strlen(message));
    buf_printf(&c->json, ",\"type\":\"%s\",\"param\":", type);
    if (param)
        put_string(&c->json, param);
    else
        buf_puts(&c->json, "null");
    buf_puts(&c->json, ",\"code\":");
    if (code)
        buf_printf(&c->json, "\"%s\"}}", code);
    else
        buf_puts(&c->json, "null}}");
}

/* An OpenAI-shaped error answer, for requests that no API answers. */
static int send_error(struct conn *c, const struct request *r, const struct directive *d,
                      long status, const char *type, const char *code, const char *message)
{
    put_error(c, 0, type, code, NULL, message);
    return send_answer(c, r, d, status);
}

/* ===== 7. Inference answers =====
 *
 * IMPLEMENTATION NOTES
 * Each API the mock speaks is one row of apis[] (at the end of this
 * section): the path it answers, whether it is Anthropic's, the message of
 * its context_length error, a function that writes a whole answer and, for
 * an API that streams, one that writes the events of a stream. Everything
 * the APIs share is done once: serve_inference() reads the directive and
 * plays the delays, resets, hangs, errors and hostile answers, and
 * send_stream() gives every stream the same shape, the one a chat stream
 * always had:
 *
 *     the head, the opening events at once (Responses: response.created ...;
 *     Anthropic: message_start, content_block_start, ping), first_event_delay_ms,
 *     the deltas (events=N of them, one "word " each; cut_after and
 *     garble_after count them), the closing events (chat: finish, usage,
 *     [DONE]), each event after the first delta event_delay_ms after the last.
 *
 * A stream is told by its step numbers: steps 0 .. opening-1 open it, step
 * `opening` is a delta (answer.step says which), the `closing` steps after
 * it end it. For chat and Messages the deltas are planned first (chat_plan,
 * messages_plan): parts of a kind each (words, reasoning, calls ...), the
 * deltas of each Anthropic content block one part; the event functions find
 * a delta's part with plan_at(). The token
 * counts are the same for every API (a quarter of the request body's bytes
 * in, at least 1, events=N out, or the directive's) and each API's usage
 * shape is written by one put_*_usage() function.
 */

struct answer;
struct refusal;

/* Writes the event of a stream's step into c->json and returns its SSE
 * event name ("" for a bare data: line), or NULL to send nothing at that
 * step. Events that must come before it in the same write (an Anthropic
 * block's stop and the next one's start) it puts in c->out with sse_chunk(). */
typedef const char *event_fn(struct conn *c, struct answer *a, int step);

struct chunk_shape {             /* how an OpenAI stream's chunks look */
    const char *id_prefix, *object;
    const char *delta;           /* a delta's "choices" (NULL: chat's, from the answer's plan) */
    const char *finish;          /* the finish chunk's "choices", up to the finish_reason's value */
};

struct api {
    const char *path;            /* the request path ends with it */
    int anthropic;               /* needs x-api-key and anthropic-version; Anthropic's errors */
    const char *context_message; /* the context_length directive's error message */
    int (*body)(struct conn *c, struct answer *a);  /* a whole answer into c->json; returns its status */
    event_fn *event;             /* NULL: never streams */
    int opening, closing;        /* the stream's steps before and after the delta */
    const struct chunk_shape *chunks;   /* OpenAI chat and completions streams */
    int (*refused)(const struct request *r, struct refusal *why);  /* NULL: any body will do */
    void (*plan)(struct answer *a);     /* NULL: a stream's content is its events=N deltas */
};

/* A stream's content, for chat and messages, is planned as parts, each
 * `n` content steps (deltas) of one kind; for Anthropic each part is a
 * content block of its own. */
enum part_kind {
    PART_WORDS,                  /* "word " each (events=N) */
    PART_TEXT,                   /* text_first's one "Let me check." */
    PART_REASONING,              /* "think " each; Anthropic: and then the signature */
    PART_CALL_OPEN,              /* chat: each call's opening chunk */
    PART_CALL_ARGS,              /* chat: the chunks of the calls' argument pieces */
    PART_TOOL,                   /* Anthropic: one call's block, its input in pieces */
};

struct part {
    enum part_kind kind;
    int call;                    /* PART_TOOL: which call */
    long n;
};

#define PARTS_MAX   (CALLS_MAX + 2)
#define ARG_PIECES  3            /* each call's arguments are streamed in this many pieces */
#define LET_ME_CHECK "Let me check."
#define THINK       "think "

struct answer {                  /* what every part of one answer shares */
    const struct api *api;
    const struct request *r;
    unsigned long id;
    long created;
    long events;                 /* a stream's "word " deltas (events=N) */
    struct usage usage;          /* the counts made up or the directive's */
    long seq;                    /* Responses streams: the next sequence_number */
    int stream, include_usage;   /* include_usage: an OpenAI stream ends with a usage chunk */
    char model[MODEL_MAX];
    const char *text;            /* a whole answer's content: the greeting, content_kb of "x", "Let me check." */
    size_t text_len;
    int tool_call;               /* the directive's tool_call (Responses: Codex's exec_command) */
    int codex_tool;              /* ... and the request offers Codex's exec_command: that one */
    int ncalls;                  /* chat and messages: the calls asked for (tool_call: 1, tools=N: N) */
    int text_first;              /* with calls: "Let me check." before them */
    long reasoning;              /* chat and messages: reasoning=N */
    const char *finish;          /* finish=, or NULL */
    const char *stream_error;    /* stream_error=, or NULL */
    struct part parts[PARTS_MAX];   /* a stream's content: parts[0 .. nparts) */
    int nparts;
    long steps;                  /* a stream's content steps: events=N, or the parts' n added up */
    long step;                   /* the content step being written */
    int block;                   /* Anthropic streams: the content block open (a part's index) */
};

/* tool_call: the command the agents' shell tools are asked to run, whose output
 * ("mock-tool-42") proves that the tool ran; Claude Code's Bash takes
 * {"command"}, Codex's exec_command {"cmd"}. Chat asks for Bash, as Messages, unless
 * the request offers exec_command (Codex through a gateway that translates). */
#define TOOL_COMMAND "echo mock-tool-$((6*7))"
#define ANTHROPIC_TOOL_INPUT "{\"command\":\"" TOOL_COMMAND "\"}"
#define RESPONSES_TOOL_ARGS "{\"cmd\":\"" TOOL_COMMAND "\"}"

/* Call i of an answer: tool_call's Bash, or tools=N's tool_<i>. The id has
 * the API's prefix ("call_mock_", "toolu_mock_") and the answer's number
 * (tools=N: and "_<i>"); the arguments are a JSON object's text. */
struct call {
    char id[64], name[16], args[64];
    size_t args_len;
};

static void get_call(const struct answer *a, int i, const char *prefix, struct call *k)
{
    if (a->tool_call) {
        snprintf(k->id, sizeof k->id, "%s%lu", prefix, a->id);
        snprintf(k->name, sizeof k->name, a->codex_tool ? "exec_command" : "Bash");
        k->args_len = (size_t)snprintf(k->args, sizeof k->args, "%s",
                                       a->codex_tool ? RESPONSES_TOOL_ARGS : ANTHROPIC_TOOL_INPUT);
    } else {
        snprintf(k->id, sizeof k->id, "%s%lu_%d", prefix, a->id, i);
        snprintf(k->name, sizeof k->name, "tool_%d", i);
        k->args_len = (size_t)snprintf(k->args, sizeof k->args, "{\"i\":%d,\"city\":\"Paris %d\"}", i, i);
    }
}

/* Piece f (0 .. ARG_PIECES-1) of a call's arguments, as a JSON string:
 * the arguments are cut at a third and at two thirds of their bytes. */
static void put_piece(struct buf *b, const struct call *k, int f)
{
    size_t from = k->args_len * (size_t)f / ARG_PIECES, to = k->args_len * (size_t)(f + 1) / ARG_PIECES;
    buf_json_string(b, k->args + from, to - from);
}

/* The finish_reason (OpenAI) or stop_reason (Anthropic) of the answer. */
static const char *finish_reason(const struct answer *a)
{
    if (a->finish)
        return a->finish;
    if (a->api->anthropic)
        return a->ncalls ? "tool_use" : "end_turn";
    return a->ncalls ? "tool_calls" : "stop";
}

static void plan_add(struct answer *a, enum part_kind kind, int call, long n)
{
    a->parts[a->nparts++] = (struct part){ kind, call, n };
    a->steps += n;
}

/* Chat: the reasoning, then the text, or "Let me check." and the calls:
 * each call's opening chunk, then the argument pieces round-robin (call 0's
 * first, call 1's first, ..., call 0's second, ...), the second pieces of
 * calls 0 and 1 in one chunk when there are two calls or more. */
static void chat_plan(struct answer *a)
{
    if (a->reasoning)
        plan_add(a, PART_REASONING, 0, a->reasoning);
    if (!a->ncalls) {
        plan_add(a, PART_WORDS, 0, a->events);
        return;
    }
    if (a->text_first)
        plan_add(a, PART_TEXT, 0, 1);
    plan_add(a, PART_CALL_OPEN, 0, a->ncalls);
    plan_add(a, PART_CALL_ARGS, 0, ARG_PIECES * a->ncalls - (a->ncalls > 1));
}

/* Messages: a thinking block (its deltas, then its signature), then a text
 * block, or "Let me check." and a tool_use block per call. */
static void messages_plan(struct answer *a)
{
    if (a->reasoning)
        plan_add(a, PART_REASONING, 0, a->reasoning + 1);
    if (!a->ncalls) {
        plan_add(a, PART_WORDS, 0, a->events);
        return;
    }
    if (a->text_first)
        plan_add(a, PART_TEXT, 0, 1);
    for (int i = 0; i < a->ncalls; i++)
        plan_add(a, PART_TOOL, i, ARG_PIECES);
}

/* The part that content step a->step falls in, and the step's index in it
 * (a step past the end, which garble_after may ask for, is the last one). */
static const struct part *plan_at(const struct answer *a, long *k)
{
    long s = a->step;
    int j = 0;
    while (j + 1 < a->nparts && s >= a->parts[j].n) {
        s -= a->parts[j].n;
        j++;
    }
    *k = s < a->parts[j].n ? s : a->parts[j].n > 0 ? a->parts[j].n - 1 : 0;
    return &a->parts[j];
}

/* The answer's text: in a stream, the deltas sent ("word " each). */
static void put_text(struct buf *b, const struct answer *a)
{
    if (!a->stream) {
        buf_json_string(b, a->text, a->text_len);
        return;
    }
    buf_puts(b, "\"");
    for (long i = 0; i < a->events; i++)
        buf_puts(b, "word ");
    buf_puts(b, "\"");
}

/* reasoning=N's whole text: "think " N times. */
static void put_reasoning(struct buf *b, const struct answer *a)
{
    buf_puts(b, "\"");
    for (long i = 0; i < a->reasoning; i++)
        buf_puts(b, THINK);
    buf_puts(b, "\"");
}

/* The SSE bytes of the event in c->json: its size, appending them to c->out,
 * and appending them as one HTTP chunk of their own. */
static size_t sse_size(const struct conn *c, const char *name)
{
    return (*name ? strlen(name) + 8 : 0) + c->json.len + 8;      /* "event: NAME\n" "data: " JSON "\n\n" */
}

static void sse_put(struct conn *c, const char *name)
{
    if (*name)
        buf_printf(&c->out, "event: %s\n", name);
    buf_puts(&c->out, "data: ");
    buf_append(&c->out, c->json.data, c->json.len);
    buf_puts(&c->out, "\n\n\r\n");
}

static void sse_chunk(struct conn *c, const char *name)
{
    buf_printf(&c->out, "%zx\r\n", sse_size(c, name));
    sse_put(c, name);
}

/* The raw JSON value of the request's top-level field key, or null. */
static void put_echo(struct buf *b, const struct answer *a, const char *key)
{
    const char *v, *v_end;
    if (json_find(a->r->body, a->r->body + a->r->body_len, key, &v, &v_end))
        buf_append(b, v, (size_t)(v_end - v));
    else
        buf_puts(b, "null");
}

/* --- Usage: each put_*_usage() writes its shape as the member ,"usage":...
 * (nothing at all for usage=none) --- */

/* The input count, or the hostile value that bad_usage= asks for. */
static void put_input_tokens(struct buf *b, const struct usage *u)
{
    static const char *const bad[] = { "", "-5", "12.5", "\"12\"" };   /* by enum bad_usage */
    if (u->bad)
        buf_puts(b, bad[u->bad]);
    else
        buf_printf(b, "%lld", u->input);
}

/* OpenAI chat and legacy completions: CompletionUsage, every detail present. */
static void put_openai_usage(struct buf *b, const struct answer *a)
{
    const struct usage *u = &a->usage;
    if (u->none)
        return;
    buf_puts(b, ",\"usage\":{\"prompt_tokens\":");
    put_input_tokens(b, u);
    buf_printf(b, ",\"completion_tokens\":%lld,\"total_tokens\":%lld,"
               "\"prompt_tokens_details\":{\"cached_tokens\":%lld,\"audio_tokens\":0},"
               "\"completion_tokens_details\":{\"reasoning_tokens\":%lld,\"audio_tokens\":0,"
               "\"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}}",
               u->output, u->input + u->output, u->cached, u->reasoning);
}

/* OpenAI embeddings: input only. */
static void put_embeddings_usage(struct buf *b, const struct answer *a)
{
    const struct usage *u = &a->usage;
    if (u->none)
        return;
    buf_puts(b, ",\"usage\":{\"prompt_tokens\":");
    put_input_tokens(b, u);
    buf_printf(b, ",\"total_tokens\":%lld}", u->input);
}

/* OpenAI Responses: null in a response still in progress. */
static void put_responses_usage(struct buf *b, const struct answer *a, int done)
{
    const struct usage *u = &a->usage;
    if (u->none)
        return;
    if (!done) {
        buf_puts(b, ",\"usage\":null");
        return;
    }
    buf_puts(b, ",\"usage\":{\"input_tokens\":");
    put_input_tokens(b, u);
    buf_printf(b, ",\"input_tokens_details\":{\"cached_tokens\":%lld},\"output_tokens\":%lld,"
               "\"output_tokens_details\":{\"reasoning_tokens\":%lld},\"total_tokens\":%lld}",
               u->cached, u->output, u->reasoning, u->input + u->output);
}

/* Anthropic's three: a whole message's, message_start's (one output token
 * so far) and message_delta's (cumulative, final; no cache_creation). */
enum anthropic_usage { USAGE_MESSAGE, USAGE_START, USAGE_DELTA };

static void put_anthropic_usage(struct buf *b, const struct answer *a, enum anthropic_usage which)
{
    const struct usage *u = &a->usage;
    if (u->none)
        return;
    buf_puts(b, ",\"usage\":{\"input_tokens\":");
    put_input_tokens(b, u);
    buf_printf(b, ",\"cache_creation_input_tokens\":%lld,\"cache_read_input_tokens\":%lld",
               u->cache_write, u->cached);
    if (which != USAGE_DELTA)
        buf_printf(b, ",\"cache_creation\":{\"ephemeral_5m_input_tokens\":%lld,\"ephemeral_1h_input_tokens\":%lld}",
                   u->cache_write - u->cache_write_1h, u->cache_write_1h);
    buf_printf(b, ",\"output_tokens\":%lld", which == USAGE_START ? 1 : u->output);
    if (which != USAGE_DELTA)
        buf_puts(b, ",\"service_tier\":\"standard\"");
    if (which != USAGE_START)
        buf_puts(b, ",\"server_tool_use\":{\"web_search_requests\":0}");
    buf_puts(b, "}");
}

/* --- OpenAI chat completions, legacy completions, embeddings --- */

static int chat_body(struct conn *c, struct answer *a)
{
    struct buf *b = &c->json;
    struct call k;
    buf_printf(b, "{\"id\":\"chatcmpl-mock-%lu\",\"object\":\"chat.completion\",\"created\":%ld,\"model\":",
               a->id, a->created);
    put_string(b, a->model);
    buf_puts(b, ",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":");
    if (a->ncalls && !a->text_first)
        buf_puts(b, "null");
    else
        put_text(b, a);
    if (a->reasoning) {
        buf_puts(b, ",\"reasoning_content\":");
        put_reasoning(b, a);
    }
    if (a->ncalls) {
        buf_puts(b, ",\"tool_calls\":[");
        for (int i = 0; i < a->ncalls; i++) {
            get_call(a, i, "call_mock_", &k);
            buf_printf(b, "%s{\"id\":\"%s\",\"type\":\"function\",\"function\":{\"name\":\"%s\",\"arguments\":",
                       i ? "," : "", k.id, k.name);
            buf_json_string(b, k.args, k.args_len);
            buf_puts(b, "}}");
        }
        buf_puts(b, "]");
    }
    buf_puts(b, "},\"finish_reason\":");
    put_string(b, finish_reason(a));
    buf_puts(b, "}]");
    put_openai_usage(b, a);
    buf_puts(b, "}");
    return 200;
}

static int completion_body(struct conn *c, struct answer *a)
{
    buf_printf(&c->json, "{\"id\":\"cmpl-mock-%lu\",\"object\":\"text_completion\",\"created\":%ld,\"model\":",
               a->id, a->created);
    put_string(&c->json, a->model);
    buf_puts(&c->json, ",\"choices\":[{\"text\":");
    put_text(&c->json, a);
    buf_puts(&c->json, ",\"index\":0,\"logprobs\":null,\"finish_reason\":");
    put_string(&c->json, finish_reason(a));
    buf_puts(&c->json, "}]");
    put_openai_usage(&c->json, a);
    buf_puts(&c->json, "}");
    return 200;
}

/* A chat stream's content step a->step, the "choices" of its chunk. */
static void put_chat_choices(struct buf *b, struct answer *a)
{
    long k;
    const struct part *p = plan_at(a, &k);
    struct call call;
    buf_puts(b, "[{\"index\":0,\"delta\":{");
    if (p->kind == PART_REASONING) {
        buf_puts(b, "\"reasoning_content\":\"" THINK "\"");
    } else if (p->kind == PART_WORDS) {
        buf_puts(b, "\"content\":\"word \"");
    } else if (p->kind == PART_TEXT) {
        buf_puts(b, "\"content\":\"" LET_ME_CHECK "\"");
    } else if (p->kind == PART_CALL_OPEN) {          /* call k opens: its index, id, name */
        get_call(a, (int)k, "call_mock_", &call);
        buf_printf(b, "%s\"tool_calls\":[{\"index\":%ld,\"id\":\"%s\",\"type\":\"function\","
                   "\"function\":{\"name\":\"%s\",\"arguments\":\"\"}}]",
                   k ? "" : "\"role\":\"assistant\",\"content\":null,", k, call.id, call.name);
    } else {                     /* PART_CALL_ARGS: piece x of them all is call x % N's piece x / N */
        long n = a->ncalls, x = n > 1 && k > n ? k + 1 : k, last = x + (n > 1 && k == n);
        buf_puts(b, "\"tool_calls\":[");
        for (long y = x; y <= last; y++) {
            get_call(a, (int)(y % n), "call_mock_", &call);
            buf_printf(b, "%s{\"index\":%ld,\"function\":{\"arguments\":", y > x ? "," : "", y % n);
            put_piece(b, &call, (int)(y / n));
            buf_puts(b, "}}");
        }
        buf_puts(b, "]");
    }
    buf_puts(b, "},\"finish_reason\":null}]");
}

/* Steps: 0 a delta, 1 the finish chunk, 2 the usage chunk (if the request
 * asked for it with stream_options.include_usage), 3 [DONE]. */
static const char *openai_event(struct conn *c, struct answer *a, int step)
{
    const struct chunk_shape *shape = a->api->chunks;
    if (step == 2 && !a->include_usage)
        return NULL;
    c->json.len = 0;
    if (step == 3) {
        buf_puts(&c->json, "[DONE]");
        return "";
    }
    buf_printf(&c->json, "{\"id\":\"%s%lu\",\"object\":\"%s\",\"created\":%ld,\"model\":",
               shape->id_prefix, a->id, shape->object, a->created);
    put_string(&c->json, a->model);
    buf_puts(&c->json, ",\"choices\":");
    if (step == 0 && !shape->delta) {
        put_chat_choices(&c->json, a);
    } else if (step == 0) {
        buf_puts(&c->json, shape->delta);
    } else if (step == 1) {
        buf_puts(&c->json, shape->finish);
        put_string(&c->json, finish_reason(a));
        buf_puts(&c->json, "}]");
    } else {
        buf_puts(&c->json, "[]");
    }
    if (step == 2)
        put_openai_usage(&c->json, a);
    else if (a->include_usage)   /* as OpenAI does: every other chunk says "usage":null */
        buf_puts(&c->json, ",\"usage\":null");
    buf_puts(&c->json, "}");
    return "";
}

static const struct chunk_shape chat_chunks = { "chatcmpl-mock-", "chat.completion.chunk", NULL,
    "[{\"index\":0,\"delta\":{},\"finish_reason\":",
};

static const struct chunk_shape completion_chunks = { "cmpl-mock-", "text_completion",
    "[{\"text\":\"word \",\"index\":0,\"logprobs\":null,\"finish_reason\":null}]",
    "[{\"text\":\"\",\"index\":0,\"logprobs\":null,\"finish_reason\":",
};

/* The embedding of every answer: a JSON array of numbers ("float", the
 * default) or the float32 values' little-endian bytes in base64. */
static const float embedding[] = { 0.1f, 0.2f, 0.3f };

static void buf_embedding(struct buf *b, int base64)
{
    size_t n = sizeof embedding / sizeof *embedding;
    if (base64) {
        unsigned char bytes[sizeof embedding];
        for (size_t i = 0; i < n; i++) {
            uint32_t bits;
            memcpy(&bits, &embedding[i], 4);
            for (int k = 0; k < 4; k++)
                bytes[4 * i + k] = (unsigned char)(bits >> 8 * k);
        }
        buf_base64_string(b, bytes, sizeof bytes);
        return;
    }
    for (size_t i = 0; i < n; i++)
        buf_printf(b, "%c%g", i ? ',' : '[', (double)embedding[i]);
    buf_puts(b, "]");
}

/* How many embeddings a request asks for: one per element of an "input"
 * that is a list of strings or of token lists; else one (a string, or one
 * list of token ids). At most 2048, OpenAI's limit. */
static long embedding_inputs(const struct request *r)
{
    const char *v, *end, *body_end = r->body + r->body_len;
    long n = 0;
    if (!json_find(r->body, body_end, "input", &v, &end) || *v != '[')
        return 1;
    const char *p = json_ws(v + 1, end);
    if (p >= end || (*p != '"' && *p != '['))
        return 1;
    while (p && p < end && *p != ']' && n < 2048) {
        n++;
        p = json_skip_value(p, end);
        p = p ? json_ws(p, end) : NULL;
        if (p && *p == ',')
            p = json_ws(p + 1, end);
    }
    return n ? n : 1;
}

static int embeddings_body(struct conn *c, struct answer *a)
{
    char format[32], why[128];          /* absent (or not a string): "float" */
    json_get_string(a->r->body, a->r->body_len, "encoding_format", format, sizeof format);
    if (*format && strcmp(format, "float") && strcmp(format, "base64")) {
        snprintf(why, sizeof why, "Invalid value for 'encoding_format' = %s. "
                 "Supported values: ['float', 'base64'].", format);
        put_error(c, 0, "invalid_request_error", NULL, NULL, why);
        return 400;
    }
    buf_puts(&c->json, "{\"object\":\"list\",\"data\":[");
    for (long i = 0, n = embedding_inputs(a->r); i < n; i++) {
        buf_printf(&c->json, "%s{\"object\":\"embedding\",\"index\":%ld,\"embedding\":", i ? "," : "", i);
        buf_embedding(&c->json, !strcmp(format, "base64"));
        buf_puts(&c->json, "}");
    }
    buf_puts(&c->json, "],\"model\":");
    put_string(&c->json, a->model);
    put_embeddings_usage(&c->json, a);
    buf_puts(&c->json, "}");
    return 200;
}

/* --- OpenAI Responses ---
 * One output item, a message "msg_mock_N" with one output_text part. The
 * mock keeps no state: previous_response_id, instructions and
 * max_output_tokens are only echoed. */

static void put_part(struct buf *b, const struct answer *a, int done)
{
    buf_puts(b, "{\"type\":\"output_text\",\"annotations\":[],\"logprobs\":[],\"text\":");
    if (done)
        put_text(b, a);
    else
        buf_puts(b, "\"\"");
    buf_puts(b, "}");
}

static void put_item(struct buf *b, const struct answer *a, int done)
{
    if (a->tool_call) {
        buf_printf(b, "{\"type\":\"function_call\",\"id\":\"fc_mock_%lu\",\"call_id\":\"call_mock_%lu\","
                   "\"name\":\"exec_command\",\"arguments\":", a->id, a->id);
        put_string(b, done ? RESPONSES_TOOL_ARGS : "");
        buf_printf(b, ",\"status\":\"%s\"}", done ? "completed" : "in_progress");
        return;
    }
    buf_printf(b, "{\"type\":\"message\",\"id\":\"msg_mock_%lu\",\"status\":\"%s\",\"role\":\"assistant\",\"content\":[",
               a->id, done ? "completed" : "in_progress");
    if (done)
        put_part(b, a, 1);
    buf_puts(b, "]}");
}

/* The response object, completed or (in a stream's first events) in progress. */
static void put_response(struct buf *b, const struct answer *a, int done)
{
    buf_printf(b, "{\"id\":\"resp_mock_%lu\",\"object\":\"response\",\"created_at\":%ld,\"status\":\"%s\","
               "\"background\":false,\"error\":null,\"incomplete_details\":null,\"instructions\":",
               a->id, a->created, done ? "completed" : "in_progress");
    put_echo(b, a, "instructions");
    buf_puts(b, ",\"max_output_tokens\":");
    put_echo(b, a, "max_output_tokens");
    buf_puts(b, ",\"model\":");
    put_string(b, a->model);
    buf_puts(b, ",\"output\":[");
    if (done)
        put_item(b, a, 1);
    buf_puts(b, "],\"parallel_tool_calls\":true,\"previous_response_id\":");
    put_echo(b, a, "previous_response_id");
    buf_puts(b, ",\"reasoning\":{\"effort\":null,\"summary\":null},\"store\":true,\"temperature\":1.0,"
             "\"text\":{\"format\":{\"type\":\"text\"}},\"tool_choice\":\"auto\",\"tools\":[],\"top_p\":1.0,"
             "\"truncation\":\"disabled\"");
    put_responses_usage(b, a, done);
    buf_puts(b, ",\"user\":null,\"metadata\":{}}");
}

static int responses_body(struct conn *c, struct answer *a)
{
    put_response(&c->json, a, 1);
    return 200;
}

/* Every event is named by its type and numbered; the stream ends with
 * response.completed, without [DONE]. */
static const char *responses_event(struct conn *c, struct answer *a, int step)
{
    static const char *const types[] = {
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    };
    static const char *const tool_types[] = {       /* tool_call: no content part (steps 3 and 6) */
        NULL, NULL, NULL, NULL, "response.function_call_arguments.delta", "response.function_call_arguments.done", NULL,
    };
    struct buf *b = &c->json;
    b->len = 0;
    if (a->tool_call && step >= 3 && step <= 6) {
        if (!tool_types[step])
            return NULL;         /* stream_step() sends nothing for this step */
        buf_printf(b, "{\"type\":\"%s\",\"sequence_number\":%ld,\"item_id\":\"fc_mock_%lu\",\"output_index\":0,\"%s\":",
                   tool_types[step], a->seq++, a->id, step == 4 ? "delta" : "arguments");
        put_string(b, RESPONSES_TOOL_ARGS);
        buf_puts(b, "}");
        return tool_types[step];
    }
    buf_printf(b, "{\"type\":\"%s\",\"sequence_number\":%ld", types[step], a->seq++);
    switch (step) {
    case 0: case 1: case 8:
        buf_puts(b, ",\"response\":");
        put_response(b, a, step == 8);
        break;
    case 2: case 7:
        buf_puts(b, ",\"output_index\":0,\"item\":");
        put_item(b, a, step == 7);
        break;
    default:                     /* the events of the content part */
        buf_printf(b, ",\"item_id\":\"msg_mock_%lu\",\"output_index\":0,\"content_index\":0", a->id);
        if (step == 3 || step == 6) {
            buf_puts(b, ",\"part\":");
            put_part(b, a, step == 6);
        } else if (step == 4) {
            buf_puts(b, ",\"delta\":\"word \",\"logprobs\":[]");
        } else {
            buf_puts(b, ",\"text\":");
            put_text(b, a);
            buf_puts(b, ",\"logprobs\":[]");
        }
    }
    buf_puts(b, "}");
    return types[step];
}

/* --- Anthropic Messages and count_tokens --- */

/* reasoning=N: the thinking block's signature, base64 as Anthropic's are
 * (of "mock thinking signature N": no one checks it but the mock's tests). */
static void put_signature(struct buf *b, const struct answer *a)
{
    char sig[64];
    int n = snprintf(sig, sizeof sig, "mock thinking signature %lu", a->id);
    buf_base64_string(b, (const unsigned char *)sig, (size_t)n);
}

static void put_message(struct buf *b, const struct answer *a, int done)
{
    struct call k;
    const char *sep = "";
    buf_printf(b, "{\"id\":\"msg_mock_%lu\",\"type\":\"message\",\"role\":\"assistant\",\"model\":", a->id);
    put_string(b, a->model);
    if (!done) {                 /* message_start: no content yet */
        buf_puts(b, ",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null");
        put_anthropic_usage(b, a, USAGE_START);
        buf_puts(b, "}");
        return;
    }
    buf_puts(b, ",\"content\":[");
    if (a->reasoning) {
        buf_puts(b, "{\"type\":\"thinking\",\"thinking\":");
        put_reasoning(b, a);
        buf_puts(b, ",\"signature\":");
        put_signature(b, a);
        buf_puts(b, "}");
        sep = ",";
    }
    if (!a->ncalls || a->text_first) {
        buf_printf(b, "%s{\"type\":\"text\",\"text\":", sep);
        put_text(b, a);
        buf_puts(b, "}");
        sep = ",";
    }
    for (int i = 0; i < a->ncalls; i++, sep = ",") {
        get_call(a, i, "toolu_mock_", &k);
        buf_printf(b, "%s{\"type\":\"tool_use\",\"id\":\"%s\",\"name\":\"%s\",\"input\":%s}", sep, k.id, k.name, k.args);
    }
    buf_puts(b, "],\"stop_reason\":");
    put_string(b, finish_reason(a));
    buf_puts(b, ",\"stop_sequence\":null");
    put_anthropic_usage(b, a, USAGE_MESSAGE);
    buf_puts(b, "}");
}

static int messages_body(struct conn *c, struct answer *a)
{
    put_message(&c->json, a, 1);
    return 200;
}

static int count_tokens_body(struct conn *c, struct answer *a)
{
    buf_printf(&c->json, "{\"input_tokens\":%lld}", a->usage.input);
    return 200;
}

/* content_block_start of block (part) j. */
static void put_block_start(struct buf *b, const struct answer *a, int j)
{
    const struct part *p = &a->parts[j];
    struct call k;
    buf_printf(b, "{\"type\":\"content_block_start\",\"index\":%d,\"content_block\":", j);
    if (p->kind == PART_REASONING) {
        buf_puts(b, "{\"type\":\"thinking\",\"thinking\":\"\",\"signature\":\"\"}}");
    } else if (p->kind == PART_TOOL) {
        get_call(a, p->call, "toolu_mock_", &k);
        buf_printf(b, "{\"type\":\"tool_use\",\"id\":\"%s\",\"name\":\"%s\",\"input\":{}}}", k.id, k.name);
    } else {
        buf_puts(b, "{\"type\":\"text\",\"text\":\"\"}}");
    }
}

/* Until block j is the open one: stops the open block and starts the
 * next, each event an SSE chunk in c->out, ahead of the step's own event. */
static void blocks_catch_up(struct conn *c, struct answer *a, int j)
{
    while (a->block < j) {
        c->json.len = 0;
        buf_printf(&c->json, "{\"type\":\"content_block_stop\",\"index\":%d}", a->block++);
        sse_chunk(c, "content_block_stop");
        c->json.len = 0;
        put_block_start(&c->json, a, a->block);
        sse_chunk(c, "content_block_start");
    }
}

/* The content blocks of the plan, one after the other (index = part);
 * message_delta carries the stop reason and the usage, cumulative and final. */
static const char *messages_event(struct conn *c, struct answer *a, int step)
{
    static const char *const types[] = {
        "message_start", "content_block_start", "ping",
        "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    };
    struct buf *b = &c->json;
    long k;
    const struct part *p = plan_at(a, &k);
    struct call call;
    if (step == 3 || step == 4)  /* a delta of block j, or the last block's stop */
        blocks_catch_up(c, a, step == 3 ? (int)(p - a->parts) : a->nparts - 1);
    b->len = 0;
    if (step == 1) {
        a->block = 0;
        put_block_start(b, a, 0);
        return types[step];
    }
    buf_printf(b, "{\"type\":\"%s\"", types[step]);
    if (step == 0) {
        buf_puts(b, ",\"message\":");
        put_message(b, a, 0);
    } else if (step == 3) {
        buf_printf(b, ",\"index\":%d,\"delta\":", a->block);
        if (p->kind == PART_REASONING && k < a->reasoning) {
            buf_puts(b, "{\"type\":\"thinking_delta\",\"thinking\":\"" THINK "\"}");
        } else if (p->kind == PART_REASONING) {
            buf_puts(b, "{\"type\":\"signature_delta\",\"signature\":");
            put_signature(b, a);
            buf_puts(b, "}");
        } else if (p->kind == PART_TOOL) {
            get_call(a, p->call, "toolu_mock_", &call);
            buf_puts(b, "{\"type\":\"input_json_delta\",\"partial_json\":");
            put_piece(b, &call, (int)k);
            buf_puts(b, "}");
        } else {
            buf_printf(b, "{\"type\":\"text_delta\",\"text\":\"%s\"}", p->kind == PART_TEXT ? LET_ME_CHECK : "word ");
        }
    } else if (step == 4) {
        buf_printf(b, ",\"index\":%d", a->block);
    } else if (step == 5) {
        buf_puts(b, ",\"delta\":{\"stop_reason\":");
        put_string(b, finish_reason(a));
        buf_puts(b, ",\"stop_sequence\":null}");
        put_anthropic_usage(b, a, USAGE_DELTA);
    }
    buf_puts(b, "}");
    return types[step];
}

/* --- What the mock refuses, as the real APIs do ---
 *
 * IMPLEMENTATION NOTES
 * The rules of the top comment, checked by walking the body's JSON with
 * json_find() and json_next(): one pass over the messages, each rule a few
 * lines. A body that is no JSON mostly ends up as a missing field. Tool
 * call ids are compared as the raw text between their quotes (an Anthropic
 * id with an escape fails the id pattern first); at most IDS_MAX are kept
 * for one message, and a message with more is refused too.
 */

#define IDS_MAX 256

struct refusal {
    char why[1024];
    const char *param, *code;    /* OpenAI's error fields (NULL: null) */
    char param_buf[64];
};

__attribute__((format(printf, 2, 3)))
static int refuse(struct refusal *f, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->why, sizeof f->why, fmt, ap);
    va_end(ap);
    return 1;
}

/* OpenAI's param for messages[i]: "messages.[i].field". */
static void refuse_param(struct refusal *f, long i, const char *field)
{
    snprintf(f->param_buf, sizeof f->param_buf, "messages.[%ld].%s", i, field);
    f->param = f->param_buf;
}

struct ids {                     /* one message's tool call ids: the raw text between their quotes */
    const char *id[IDS_MAX];
    int len[IDS_MAX];
    char answered[IDS_MAX];
    int n;
};

static int ids_add(struct ids *s, const char *v, const char *v_end)
{
    if (s->n == IDS_MAX)
        return -1;
    s->id[s->n] = v + 1;
    s->len[s->n] = (int)(v_end - v - 2);
    s->answered[s->n++] = 0;
    return 0;
}

/* The index of the id that the JSON string [v, v_end) names in s, or -1. */
static int ids_find(const struct ids *s, const char *v, const char *v_end)
{
    for (int i = 0; i < s->n; i++)
        if (s->len[i] == v_end - v - 2 && !memcmp(s->id[i], v + 1, (size_t)s->len[i]))
            return i;
    return -1;
}

/* The ids of s not answered, ", " between them, into out; returns how many. */
static int ids_unanswered(const struct ids *s, char *out, size_t cap)
{
    size_t len = 0;
    int n = 0;
    out[0] = '\0';
    for (int i = 0; i < s->n; i++)
        if (!s->answered[i] && len < cap)
            len += (size_t)snprintf(out + len, cap - len, "%s%.*s", n++ ? ", " : "", s->len[i], s->id[i]);
    return n;
}

static int json_is_null(const char *v, const char *v_end)
{
    return v_end - v == 4 && !memcmp(v, "null", 4);
}

#define BLANK_TEXT "messages: text content blocks must contain non-whitespace text"
#define EMPTY_CONTENT "messages.%ld: all messages must have non-empty content except for the optional final assistant message"
#define ANTHROPIC_ID "String should match pattern '^[a-zA-Z0-9_-]+$'"

/* The content blocks of Anthropic's messages[i]. prev holds the tool_use
 * ids of the message before (an assistant's; else it is empty): the
 * tool_result blocks this message starts with answer them. mine gets this
 * message's tool_use ids. */
static int anthropic_blocks_refused(const char *content, const char *end, long i, int user, int may_be_empty,
                                    struct ids *prev, struct ids *mine, struct refusal *f)
{
    const char *at = NULL, *b, *b_end, *t, *t_end, *v, *v_end;
    long k = 0;
    int leading = 1, found;
    for (; json_next(content, end, &at, &b, &b_end); k++) {
        if (*b != '{' || !json_find(b, b_end, "type", &t, &t_end) || *t != '"')
            return refuse(f, "messages.%ld.content.%ld: Input should be a content block (an object with a type)", i, k);
        leading = leading && json_is(t, t_end, "tool_result");
        if (json_is(t, t_end, "text")) {
            if (!json_find(b, b_end, "text", &v, &v_end) || *v != '"')
                return refuse(f, "messages.%ld.content.%ld.text.text: Field required", i, k);
            if (json_blank(v, v_end))
                return refuse(f, BLANK_TEXT);
        } else if (json_is(t, t_end, "tool_use")) {
            if (!json_find(b, b_end, "id", &v, &v_end) || !json_is_name(v, v_end))
                return refuse(f, "messages.%ld.content.%ld.tool_use.id: " ANTHROPIC_ID, i, k);
            if (ids_add(mine, v, v_end) < 0)
                return refuse(f, "messages.%ld: more than %d tool_use blocks (the mock's limit)", i, IDS_MAX);
            if (!json_find(b, b_end, "input", &v, &v_end))
                return refuse(f, "messages.%ld.content.%ld.tool_use.input: Field required", i, k);
            if (*v != '{')
                return refuse(f, "messages.%ld.content.%ld.tool_use.input: Input should be an object", i, k);
        } else if (json_is(t, t_end, "tool_result")) {
            if (!json_find(b, b_end, "tool_use_id", &v, &v_end) || !json_is_name(v, v_end))
                return refuse(f, "messages.%ld.content.%ld.tool_result.tool_use_id: " ANTHROPIC_ID, i, k);
            if (!user || (found = ids_find(prev, v, v_end)) < 0)
                return refuse(f, "messages.%ld.content.%ld: unexpected `tool_use_id` found in `tool_result` blocks: %.*s. "
                              "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
                              i, k, (int)(v_end - v - 2), v + 1);
            if (leading)
                prev->answered[found] = 1;
        }
    }
    if (!k && !may_be_empty)
        return refuse(f, EMPTY_CONTENT, i);
    return 0;
}

/* Anthropic's /messages (count_tokens: only what it shares with /messages). */
static int anthropic_refused(const struct request *r, int count_tokens, struct refusal *f)
{
    const char *body = r->body, *end = body + r->body_len, *v, *v_end, *at, *e, *e_end, *t, *t_end;
    struct ids ids[2], *prev = &ids[0], *mine = &ids[1], *swap;
    char list[512];
    double x;
    long i;
    if (!count_tokens) {
        if (!json_find(body, end, "max_tokens", &v, &v_end))
            return refuse(f, "max_tokens: Field required");
        if (json_number(v, v_end, &x) < 0 || memchr(v, '.', (size_t)(v_end - v)) || memchr(v, 'e', (size_t)(v_end - v))
            || memchr(v, 'E', (size_t)(v_end - v)))
            return refuse(f, "max_tokens: Input should be a valid integer");
        if (x < 1)
            return refuse(f, "max_tokens: Input should be greater than or equal to 1");
        if (json_find(body, end, "temperature", &v, &v_end) && !json_is_null(v, v_end)) {
            if (json_number(v, v_end, &x) < 0)
                return refuse(f, "temperature: Input should be a valid number");
            if (x > 1 || x < 0)
                return refuse(f, "temperature: Input should be %s", x > 1 ? "less than or equal to 1" : "greater than or equal to 0");
        }
        if (json_find(body, end, "stop_sequences", &v, &v_end))
            for (at = NULL; json_next(v, v_end, &at, &e, &e_end); )
                if (*e == '"' && json_blank(e, e_end))
                    return refuse(f, "stop_sequences: each stop sequence must contain non-whitespace characters");
    }
    if (json_find(body, end, "system", &v, &v_end) && *v != '"' && !json_is_null(v, v_end)) {
        int ok = *v == '[';
        for (at = NULL; ok && json_next(v, v_end, &at, &e, &e_end); )
            ok = *e == '{' && json_find(e, e_end, "type", &t, &t_end) && json_is(t, t_end, "text")
                && json_find(e, e_end, "text", &t, &t_end) && *t == '"';
        if (!ok)
            return refuse(f, "system: Input should be a valid string or a list of text blocks");
    }
    if (!json_find(body, end, "messages", &v, &v_end))
        return refuse(f, "messages: Field required");
    if (*v != '[')
        return refuse(f, "messages: Input should be a valid list");
    prev->n = 0;
    const struct header *beta = request_header(r, "anthropic-beta");
    int system_ok = beta && slice_has(beta->value, beta->value_len, "mid-conversation-system");
    for (i = 0, at = NULL; json_next(v, v_end, &at, &e, &e_end); i++) {
        const char *peek = at, *role, *role_end, *c, *c_end;
        int last = !json_next(v, v_end, &peek, &t, &t_end), user, assistant;
        if (*e != '{')
            return refuse(f, "messages.%ld: Input should be a valid dictionary", i);
        if (!json_find(e, e_end, "role", &role, &role_end))
            return refuse(f, "messages.%ld.role: Field required", i);
        user = json_is(role, role_end, "user");
        assistant = json_is(role, role_end, "assistant");
        if (!user && !assistant && !(system_ok && json_is(role, role_end, "system")))
            return refuse(f, "messages.%ld.role: Input should be 'user' or 'assistant'", i);
        if (!json_find(e, e_end, "content", &c, &c_end))
            return refuse(f, "messages.%ld.content: Field required", i);
        mine->n = 0;
        if (*c == '"' && c_end - c == 2 && !(last && assistant))
            return refuse(f, EMPTY_CONTENT, i);
        if (*c == '"' && c_end - c > 2 && json_blank(c, c_end))
            return refuse(f, BLANK_TEXT);
        if (*c != '"' && *c != '[')
            return refuse(f, "messages.%ld.content: Input should be a valid string or a list of content blocks", i);
        if (*c == '[' && anthropic_blocks_refused(c, c_end, i, user, last && assistant, prev, mine, f))
            return 1;
        if (prev->n && ids_unanswered(prev, list, sizeof list))
            return refuse(f, "messages.%ld: `tool_use` ids were found without `tool_result` blocks immediately after: %s. "
                          "Each `tool_use` block must have a corresponding `tool_result` block in the next message.", i - 1, list);
        if (!assistant)
            mine->n = 0;         /* only an assistant's tool_use blocks ask for results */
        swap = prev;
        prev = mine;
        mine = swap;
    }
    if (!i)
        return refuse(f, "messages: at least one message is required");
    if (prev->n && ids_unanswered(prev, list, sizeof list))
        return refuse(f, "messages.%ld: `tool_use` ids were found without `tool_result` blocks immediately after: %s. "
                      "Each `tool_use` block must have a corresponding `tool_result` block in the next message.", i - 1, list);
    return 0;
}

static int messages_refused(const struct request *r, struct refusal *f) { return anthropic_refused(r, 0, f); }
static int count_tokens_refused(const struct request *r, struct refusal *f) { return anthropic_refused(r, 1, f); }

#define UNANSWERED_CALLS "An assistant message with 'tool_calls' must be followed by tool messages responding to each " \
    "'tool_call_id'. The following tool_call_ids did not have response messages: %s"

/* OpenAI's /chat/completions. */
static int chat_refused(const struct request *r, struct refusal *f)
{
    const char *body = r->body, *end = body + r->body_len, *v, *v_end, *at, *e, *e_end, *t, *t_end;
    struct ids calls;
    char list[512];
    long i, asked = -1;          /* asked: the assistant message whose tool calls are being answered */
    if (json_find(body, end, "stop", &v, &v_end) && *v == '[') {
        for (i = 0, at = NULL; json_next(v, v_end, &at, &e, &e_end); i++) {}
        f->param = "stop";
        f->code = "array_above_max_length";
        if (i > 4)
            return refuse(f, "Invalid 'stop': array too long. Expected an array with maximum length 4, "
                          "but got an array with length %ld instead.", i);
    }
    if (json_find(body, end, "tools", &v, &v_end))
        for (i = 0, at = NULL; json_next(v, v_end, &at, &e, &e_end); i++) {
            if (*e != '{' || !json_find(e, e_end, "function", &t, &t_end) || *t != '{'
                || !json_find(t, t_end, "name", &t, &t_end) || *t != '"')
                continue;
            snprintf(f->param_buf, sizeof f->param_buf, "tools[%ld].function.name", i);
            f->param = f->param_buf;
            f->code = "string_above_max_length";
            if (t_end - t - 2 > 64)
                return refuse(f, "Invalid 'tools[%ld].function.name': string too long. Expected a string with maximum "
                              "length 64, but got a string with length %ld instead.", i, (long)(t_end - t - 2));
            f->code = "invalid_value";
            if (!json_is_name(t, t_end))
                return refuse(f, "Invalid 'tools[%ld].function.name': string does not match pattern. Expected a string "
                              "that matches the pattern '^[a-zA-Z0-9_-]+$'.", i);
        }
    f->param = "messages";
    if (!json_find(body, end, "messages", &v, &v_end)) {
        f->code = "missing_required_parameter";
        return refuse(f, "Missing required parameter: 'messages'.");
    }
    f->code = "invalid_type";
    if (*v != '[')
        return refuse(f, "Invalid type for 'messages': expected an array of objects, but got something else instead.");
    f->code = NULL;
    calls.n = 0;
    for (i = 0, at = NULL; json_next(v, v_end, &at, &e, &e_end); i++) {
        const char *role, *role_end;
        int found;
        refuse_param(f, i, "role");
        if (*e != '{' || !json_find(e, e_end, "role", &role, &role_end))
            return refuse(f, "Invalid 'messages[%ld]': expected an object with a 'role'.", i);
        if (json_is(role, role_end, "tool")) {
            if (asked < 0)
                return refuse(f, "Invalid parameter: messages with role 'tool' must be a response to a preceeding "
                              "message with 'tool_calls'.");
            refuse_param(f, i, "tool_call_id");
            if (!json_find(e, e_end, "tool_call_id", &t, &t_end) || *t != '"')
                return refuse(f, "Missing parameter 'tool_call_id': messages with role 'tool' must have a 'tool_call_id'.");
            if ((found = ids_find(&calls, t, t_end)) < 0)
                return refuse(f, "Invalid parameter: 'tool_call_id' of '%.*s' not found in 'tool_calls' of previous message.",
                              (int)(t_end - t - 2), t + 1);
            calls.answered[found] = 1;
            continue;
        }
        if (asked >= 0 && ids_unanswered(&calls, list, sizeof list)) {
            refuse_param(f, asked, "role");
            return refuse(f, UNANSWERED_CALLS, list);
        }
        asked = -1;
        calls.n = 0;
        if (json_is(role, role_end, "assistant") && json_find(e, e_end, "tool_calls", &t, &t_end)) {
            const char *at2 = NULL, *k, *k_end, *id, *id_end;
            while (json_next(t, t_end, &at2, &k, &k_end))
                if (*k == '{' && json_find(k, k_end, "id", &id, &id_end) && *id == '"' && ids_add(&calls, id, id_end) < 0)
                    return refuse(f, "Invalid 'messages[%ld].tool_calls': more than %d (the mock's limit).", i, IDS_MAX);
            asked = calls.n ? i : -1;
        }
    }
    if (!i) {
        f->param = "messages";
        f->code = "empty_array";
        return refuse(f, "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty "
                      "array instead.");
    }
    if (asked >= 0 && ids_unanswered(&calls, list, sizeof list)) {
        refuse_param(f, asked, "role");
        return refuse(f, UNANSWERED_CALLS, list);
    }
    return 0;
}

/* --- What the APIs share --- */

#define OPENAI_QUOTA "You exceeded your current quota, please check your plan and billing details."
#define OPENAI_CONTEXT "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens."

/* The first row whose path ends the request's path answers it:
 * "/chat/completions" must come before "/completions". */
static const struct api apis[] = {
    { "/chat/completions", 0, OPENAI_CONTEXT, chat_body, openai_event, 0, 3, &chat_chunks, chat_refused, chat_plan },
    { "/completions", 0, OPENAI_CONTEXT, completion_body, openai_event, 0, 3, &completion_chunks, NULL, NULL },
    { "/embeddings", 0, OPENAI_CONTEXT, embeddings_body, NULL, 0, 0, NULL, NULL, NULL },
    { "/responses", 0, "Your input exceeds the context window of this model. Please adjust your input and try again.",
      responses_body, responses_event, 4, 4, NULL, NULL, NULL },
    { "/messages", 1, "prompt is too long: 9000 tokens > 8192 maximum", messages_body, messages_event, 3, 3, NULL,
      messages_refused, messages_plan },
    { "/messages/count_tokens", 1, "prompt is too long: 9000 tokens > 8192 maximum", count_tokens_body, NULL, 0, 0, NULL,
      count_tokens_refused, NULL },
};

/* An error in the API's shape, with the type its provider uses for the status. */
static int send_api_error(struct conn *c, const struct request *r, const struct directive *d,
                          const struct api *api, long status, const char *code, const char *message)
{
    struct status st = status_info(status);
    put_error(c, api->anthropic, api->anthropic ? st.anthropic_type : st.type, code, NULL, message);
    return send_answer(c, r, d, status);
}

/* The error that status=N (or context_length) produces. */
static int send_directed_error(struct conn *c, const struct request *r, const struct directive *d,
                               const struct api *api)
{
    char message[64];
    if (d->context_length)
        return send_api_error(c, r, d, api, d->status, "context_length_exceeded", api->context_message);
    if (d->quota && !api->anthropic) {
        put_error(c, 0, "insufficient_quota", "insufficient_quota", NULL, OPENAI_QUOTA);
        return send_answer(c, r, d, d->status);
    }
    snprintf(message, sizeof message, d->status == 529 && api->anthropic ? "Overloaded" : "mock error %ld", d->status);
    return send_api_error(c, r, d, api, d->status, status_info(d->status).code, message);
}

/* The pause before a stream's next event: ms, and, for keepalive, the
 * keep-alive half-way through it (an OpenAI stream's comment line, an
 * Anthropic ping), in a write of its own. Returns -1 if the peer has gone. */
static int stream_pause(struct conn *c, const struct answer *a, long ms, int keepalive)
{
    static const char comment[] = ": keep-alive\n\n", ping[] = "event: ping\ndata: {\"type\":\"ping\"}\n\n";
    if (keepalive) {
        const char *ev = a->api->anthropic ? ping : comment;
        char chunk[64];
        int n = snprintf(chunk, sizeof chunk, "%zx\r\n%s\r\n", strlen(ev), ev);
        if ((ms / 2 && conn_wait(c, ms / 2) < 0) || conn_send(c, chunk, (size_t)n) < 0)
            return -1;
        ms -= ms / 2;
    }
    return ms && conn_wait(c, ms) < 0 ? -1 : 0;
}

/* Sends a stream's step, if it has an event: the events it puts in c->out
 * and its own, each one SSE event in one HTTP chunk, after stream_pause().
 * Returns 1 if it sent an event, 0 if the step has none, -1 if the peer
 * has gone. */
static int stream_step(struct conn *c, struct answer *a, int step, long ms, int keepalive)
{
    c->out.len = 0;
    const char *name = a->api->event(c, a, step);
    if (!name)
        return 0;
    sse_chunk(c, name);
    if (stream_pause(c, a, ms, keepalive) < 0 || conn_send(c, c->out.data, c->out.len) < 0)
        return -1;
    return 1;
}

/* garble=KIND in a stream: the event that breaks it, a broken delta (of
 * content step a->step), after a pause of ms. Returns 0 to go on with the
 * stream, -1 when the connection is done. */
static int stream_garble(struct conn *c, const struct directive *d, struct answer *a, long ms)
{
    c->out.len = 0;
    const char *name = a->api->event(c, a, a->api->opening);
    if (d->garble == GARBLE_HTML || d->garble == GARBLE_TRUNCATED) {
        if (d->garble == GARBLE_HTML) {
            c->json.len = 0;
            buf_puts(&c->json, "<html>oops</html>");
        } else {
            c->json.len /= 2;
        }
        sse_chunk(c, name);
        return stream_pause(c, a, ms, 0) < 0 || conn_send(c, c->out.data, c->out.len) < 0 ? -1 : 0;
    }
    if (stream_pause(c, a, ms, 0) < 0)
        return -1;
    c->out.len = 0;              /* the broken event alone */
    if (d->garble == GARBLE_HUGE) {              /* "data: " and 2 MiB, no blank line */
        if (conn_send(c, "6\r\ndata: \r\n", 11) < 0)
            return -1;
        buf_printf(&c->out, "%x\r\n", FILLER_PIECE);
        for (int i = 0; i < (2 << 20) / FILLER_PIECE; i++)
            if (conn_gone(c) || conn_send(c, c->out.data, c->out.len) < 0
                || conn_send(c, filler, FILLER_PIECE) < 0 || conn_send(c, "\r\n", 2) < 0) {
                c->abrupt = 1;
                return -1;
            }
        return conn_send(c, "2\r\n\n\n\r\n", 7);
    }
    if (d->garble == GARBLE_CHUNK_SIZE)
        buf_puts(&c->out, "zz\r\n");
    else                                         /* chunk_long: the size says half */
        buf_printf(&c->out, "%zx\r\n", sse_size(c, name) / 2);
    sse_put(c, name);
    conn_send(c, c->out.data, c->out.len);
    conn_linger(c);
    return -1;
}

/* stream_error=TYPE: the API's error event, then the end of the body, a
 * clean one. Returns what send_stream() does. */
static int stream_fail(struct conn *c, struct answer *a, int keep)
{
    const char *type = a->stream_error, *name = "";
    c->out.len = c->json.len = 0;
    if (a->api->anthropic) {
        name = "error";
        buf_printf(&c->json, "{\"type\":\"error\",\"error\":{\"type\":\"%s\",\"message\":\"%s%s\"}}", type,
                   strcmp(type, "overloaded_error") ? "mock stream error " : "Overloaded",
                   strcmp(type, "overloaded_error") ? type : "");
    } else if (!a->api->chunks) {                 /* Responses */
        name = "error";
        buf_printf(&c->json, "{\"type\":\"error\",\"code\":\"%s\",\"message\":\"mock stream error %s\","
                   "\"param\":null,\"sequence_number\":%ld}", type, type, a->seq++);
    } else {
        buf_printf(&c->json, "{\"error\":{\"message\":\"%s%s\",\"type\":\"%s\",\"code\":null}}",
                   strcmp(type, "server_error") ? "mock stream error "
                   : "The server had an error while processing your request. Sorry about that!",
                   strcmp(type, "server_error") ? type : "", type);
    }
    sse_chunk(c, name);
    buf_puts(&c->out, "0\r\n\r\n");
    return conn_send(c, c->out.data, c->out.len) < 0 ? 0 : keep;
}

/* cut_after=N: the stream ends there, abruptly, or with stream_error's event. */
static int stream_cut(struct conn *c, struct answer *a, int keep)
{
    if (a->stream_error)
        return stream_fail(c, a, keep);
    c->abrupt = 1;
    return 0;
}

/* Keep-alives: an OpenAI stream's comment goes in the pause before each
 * content event and the finish (the first closing event), an Anthropic
 * ping in the pause between two deltas. */
static int send_stream(struct conn *c, const struct request *r, const struct directive *d, struct answer *a)
{
    const struct api *api = a->api;
    int keep = !r->want_close && !d->close, n = 0, sent;
    int comment = d->keepalive && !api->anthropic, ping = d->keepalive && api->anthropic;
    int fail_first = a->stream_error && d->cut_after < 0;   /* after the first opening event */
    put_head(c, 200, "text/event-stream", d, keep);
    buf_puts(&c->out, "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n");
    c->batching = 1;             /* the head and the opening events in one write, as providers do */
    if (conn_send(c, c->out.data, c->out.len) < 0)
        return 0;
    for (int step = 0; step < (fail_first && api->opening ? 1 : api->opening); step++)
        if (stream_step(c, a, step, 0, 0) < 0)
            return 0;
    if (conn_flush(c) < 0)
        return 0;
    if (fail_first)
        return stream_fail(c, a, keep);
    if (stream_pause(c, a, d->first_event_delay_ms, comment) < 0)
        return 0;
    for (a->step = 0; a->step < a->steps; a->step++) {
        if (a->step == d->cut_after)
            return stream_cut(c, a, keep);
        if (d->garble && a->step == d->garble_after && stream_garble(c, d, a, n++ ? d->event_delay_ms : 0) < 0)
            return 0;
        if ((sent = stream_step(c, a, api->opening, n ? d->event_delay_ms : 0, n && (comment || ping))) < 0)
            return 0;
        n += sent;
    }
    if (d->cut_after >= 0)       /* cut_after >= the deltas: cut before the closing events */
        return stream_cut(c, a, keep);
    if (d->garble && d->garble_after >= a->steps && stream_garble(c, d, a, n++ ? d->event_delay_ms : 0) < 0)
        return 0;
    /* the closing events and the body's end in one write, unless something paces them */
    c->batching = !d->event_delay_ms && !comment && !d->end_delay_ms;
    for (int step = api->opening + 1; step <= api->opening + api->closing; step++) {
        if ((sent = stream_step(c, a, step, n ? d->event_delay_ms : 0, n && comment && step == api->opening + 1)) < 0)
            return 0;
        n += sent;
    }
    if (d->end_delay_ms && conn_wait(c, d->end_delay_ms) < 0)
        return 0;
    if (conn_send(c, "0\r\n\r\n", 5) < 0 || conn_flush(c) < 0)
        return 0;
    return keep;
}

/* POST /_mock/answer's answer, its bytes as given, framed as framing= says:
 * chunked sends a chunk, in a write of its own, per SSE event. */
static int send_canned(struct conn *c, const struct request *r, const struct directive *d,
                       const struct canned *ans)
{
    const char *body = ans->body.data ? ans->body.data : "";
    size_t len = ans->body.len;
    int keep = !r->want_close && !d->close && d->framing != FRAMING_EOF;
    put_head(c, ans->status, ans->type, d, keep);
    put_framing(c, d->framing, (long long)len);
    if (d->framing != FRAMING_CHUNKED) {
        buf_append(&c->out, body, len);
        return conn_send(c, c->out.data, c->out.len) < 0 ? 0 : keep;
    }
    if (conn_send(c, c->out.data, c->out.len) < 0)
        return 0;
    for (size_t i = 0, n; i < len; i += n) {
        const char *ev_end = memmem(body + i, len - i, "\n\n", 2);
        n = ev_end ? (size_t)(ev_end + 2 - (body + i)) : len - i;
        c->out.len = 0;
        buf_printf(&c->out, "%zx\r\n", n);
        buf_append(&c->out, body + i, n);
        buf_puts(&c->out, "\r\n");
        if (conn_send(c, c->out.data, c->out.len) < 0)
            return 0;
    }
    return conn_send(c, "0\r\n\r\n", 5) < 0 ? 0 : keep;
}

static int serve_answer(struct conn *c, const struct request *r, const struct api *api,
                        struct canned *canned);

static int serve_inference(struct conn *c, const struct request *r, const struct api *api)
{
    struct canned canned = { .status = 0 };
    int keep = serve_answer(c, r, api, &canned);
    free(canned.body.data);
    return keep;
}

/* Answers an inference request; *canned receives its POST /_mock/answer answer, if any. */
static int serve_answer(struct conn *c, const struct request *r, const struct api *api,
                        struct canned *canned)
{
    struct answer a = { .api = api, .r = r, .created = (long)time(NULL) };
    char body_directive[DIRECTIVE_MAX], directive[DIRECTIVE_MAX], why[DIRECTIVE_MAX + 64];
    const char *end = r->body + r->body_len, *v, *v_end;
    /* Anthropic refuses a request without these before it reads the body;
     * so does the mock, before it takes a step of the script. */
    if (api->anthropic && !request_header(r, "x-api-key"))
        return send_api_error(c, r, &directive_ok, api, 401, NULL, "x-api-key header is required");
    if (api->anthropic && !request_header(r, "anthropic-version"))
        return send_api_error(c, r, &directive_ok, api, 400, NULL, "anthropic-version: header is required");
    json_get_string(r->body, r->body_len, "model", a.model, sizeof a.model);
    json_get_string(r->body, r->body_len, "mock", body_directive, sizeof body_directive);
    a.stream = api->event && json_is_true(r->body, end, "stream");
    a.include_usage = json_is_true(r->body, end, "include_usage")
        || (json_find(r->body, end, "stream_options", &v, &v_end) && json_is_true(v, v_end, "include_usage"));
    struct refusal no = { .param = NULL };
    int refused = api->refused && api->refused(r, &no);
    a.id = mock_begin_request(a.model, r->path, r->path_len, body_directive, directive, sizeof directive,
                              refused ? no.why : NULL, canned);
    if (refused) {               /* at once, whatever the directive says */
        put_error(c, api->anthropic, "invalid_request_error", no.code, no.param, no.why);
        return send_answer(c, r, &directive_ok, 400);
    }

    struct directive d;
    if (directive_parse(directive, &d, why, sizeof why) < 0)
        return send_api_error(c, r, &directive_ok, api, 400, "mock_bad_directive", why);
    c->bytewise = (int)d.bytewise;
    c->pauses = BYTEWISE_PAUSES;
    if (d.tool_call)
        d.events = 1;            /* Responses: one delta carries the whole tool input */
    a.events = d.events;
    a.tool_call = (int)d.tool_call;
    static const char exec_command[] = "\"name\":\"exec_command\"";
    a.codex_tool = memmem(r->body, r->body_len, exec_command, sizeof exec_command - 1) != NULL;
    if (api->plan) {             /* chat and messages */
        a.ncalls = d.tools ? (int)d.tools : (int)d.tool_call;
        a.text_first = a.ncalls && d.text_first;
        a.reasoning = d.reasoning;
        api->plan(&a);
    } else {
        a.steps = a.events;
    }
    a.finish = d.finish[0] ? d.finish : NULL;
    a.stream_error = d.stream_error[0] ? d.stream_error : NULL;
    a.usage = d.usage;
    if (a.usage.input < 0)
        a.usage.input = r->body_len / 4 ? (long long)(r->body_len / 4) : 1;
    if (a.usage.output < 0)
        a.usage.output = d.events;
    a.include_usage = a.include_usage && !a.usage.none;
    if (d.head_delay_ms && conn_wait(c, d.head_delay_ms) < 0)
        return 0;
    if (d.reset) {
        struct linger lg = { .l_onoff = 1, .l_linger = 0 };
        setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        c->abrupt = 1;
        return 0;
    }
    if (d.hang) {
        conn_wait(c, -1);
        return 0;
    }
    if (canned->status)
        return send_canned(c, r, &d, canned);
    if (d.body_mb || d.head_kb || d.head_lines || d.garble || d.trickle_ms || d.junk_after_ms >= 0) {
        struct timeval tv = { .tv_sec = HOSTILE_WAIT_MS / 1000 };  /* a peer that stops reading */
        setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }
    if (d.status)
        return send_directed_error(c, r, &d, api);
    if (d.body_mb)
        return send_filler(c, r, &d, a.model);
    if (a.stream && !d.trickle_ms)
        return send_stream(c, r, &d, &a);

    char greeting[MODEL_MAX + 16], *content = greeting;
    a.stream = 0;                /* trickle_ms: a whole answer, even to a stream request */
    a.text_len = (size_t)snprintf(greeting, sizeof greeting, "Hello from %s.", a.model);
    if (d.content_kb > 0) {
        a.text_len = (size_t)d.content_kb << 10;
        if (!(content = malloc(a.text_len)))
            die("malloc");
        memset(content, 'x', a.text_len);
    }
    a.text = content;
    if (a.text_first) {
        a.text = LET_ME_CHECK;
        a.text_len = strlen(LET_ME_CHECK);
    }
    c->json.len = 0;
    long status = api->body(c, &a);
    if (content != greeting)
        free(content);
    if (status != 200)
        return send_answer(c, r, &d, status);
    if (d.garble == GARBLE_HTML) {
        c->json.len = 0;
        buf_puts(&c->json, "<html>oops</html>");
    } else if (d.garble == GARBLE_TRUNCATED) {
        c->json.len /= 2;
    } else if (d.garble == GARBLE_HUGE) {
        c->json.len = 0;
        buf_reserve(&c->json, 2 << 20);
        memset(c->json.data, 'x', 2 << 20);
        c->json.len = 2 << 20;
    }
    if (d.trickle_ms)
        return send_trickle(c, r, &d);
    return send_answer(c, r, &d, 200);
}

/* ===== 8. Control endpoints ===== */

/* Walks the JSON array of steps that starts at p. With m == NULL it only
 * checks that every step is a valid directive (message in why); otherwise it
 * appends the steps to m. Checking first means a typo queues nothing. */
static int script_steps(const char *p, const char *end, struct model *m, char *why, size_t why_cap)
{
    char step[DIRECTIVE_MAX];
    struct directive d;
    for (p = json_ws(p + 1, end); p < end && *p != ']'; p = json_ws(p, end)) {
        const char *v_end = json_skip_value(p, end);
        if (!v_end || json_string_decode(p, v_end, step, sizeof step) < 0) {
            snprintf(why, why_cap, "each step must be a string");
            return -1;
        }
        if (!m && directive_parse(step, &d, why, why_cap) < 0)
            return -1;
        if (m)
            model_push_step(m, step);
        p = json_ws(v_end, end);
        if (p < end && *p == ',')
            p++;
    }
    return 0;
}

/* POST /_mock/script {"model":"m","steps":["status=503","ok"]} */
static int control_script(struct conn *c, const struct request *r)
{
    char model[MODEL_MAX], why[DIRECTIVE_MAX + 64];
    const char *end = r->body + r->body_len, *steps, *steps_end;
    if (!json_get_string(r->body, r->body_len, "model", model, sizeof model) || !model[0]
        || !json_find(r->body, end, "steps", &steps, &steps_end) || *steps != '[')
        return send_error(c, r, &directive_ok, 400, "invalid_request_error", "invalid_request",
                          "expected {\"model\":\"...\",\"steps\":[\"directive\",...]}");
    if (script_steps(steps, steps_end, NULL, why, sizeof why) < 0)
        return send_error(c, r, &directive_ok, 400, "invalid_request_error", "mock_bad_directive", why);
    pthread_mutex_lock(&mock.lock);
    struct model *m = mock_model(model);
    script_steps(steps, steps_end, m, why, sizeof why);
    size_t queued = m->count - m->first;
    pthread_mutex_unlock(&mock.lock);
    c->json.len = 0;
    buf_puts(&c->json, "{\"model\":");
    buf_json_string(&c->json, model, strlen(model));
    buf_printf(&c->json, ",\"queued\":%zu}", queued);
    return send_answer(c, r, &directive_ok, 200);
}

/* POST /_mock/answer {"model":"m","status":200,"content_type":"...","body":"..."} */
static int control_answer(struct conn *c, const struct request *r)
{
    char model[MODEL_MAX], type[TYPE_MAX] = "application/json";
    const char *end = r->body + r->body_len, *v, *v_end;
    double status = 200;
    struct canned ans = { .status = 0 };
    int bad = !json_get_string(r->body, r->body_len, "model", model, sizeof model) || !model[0]
        || !json_find(r->body, end, "body", &v, &v_end)
        || json_string_bytes(v, v_end, &ans.body) < 0 || ans.body.len > ANSWER_MAX;
    if (!bad && json_find(r->body, end, "status", &v, &v_end))
        bad = json_number(v, v_end, &status) < 0 || status != (long)status
            || status < 200 || status > 599;
    if (!bad && json_find(r->body, end, "content_type", &v, &v_end))
        bad = json_string_decode(v, v_end, type, sizeof type) < 0 || !type[0]
            || strcspn(type, "\r\n") != strlen(type);
    if (bad) {
        free(ans.body.data);
        return send_error(c, r, &directive_ok, 400, "invalid_request_error", "invalid_request",
                          "expected {\"model\":\"...\",\"status\":200..599,"
                          "\"content_type\":\"...\",\"body\":\"...\"}, a body of at most 1 MiB");
    }
    ans.status = (long)status;
    snprintf(ans.type, sizeof ans.type, "%s", type);
    pthread_mutex_lock(&mock.lock);
    struct model *m = mock_model(model);
    size_t queued = m->answers_len;
    int full = queued == ANSWERS_MAX;
    if (!full) {
        m->answers[(m->answers_next + queued) % ANSWERS_MAX] = ans;
        m->answers_len = ++queued;
    }
    pthread_mutex_unlock(&mock.lock);
    if (full) {
        free(ans.body.data);
        return send_error(c, r, &directive_ok, 400, "invalid_request_error", "mock_queue_full",
                          "this model's answer queue is full (8 answers)");
    }
    c->json.len = 0;
    buf_puts(&c->json, "{\"model\":");
    buf_json_string(&c->json, model, strlen(model));
    buf_printf(&c->json, ",\"queued\":%zu}", queued);
    return send_answer(c, r, &directive_ok, 200);
}

static int control_stats(struct conn *c, const struct request *r)
{
    c->json.len = 0;
    pthread_mutex_lock(&mock.lock);
    buf_printf(&c->json, "{\"connections\":%ld,\"open_connections\":%ld,\"requests\":%ld,\"refused\":%ld,"
               "\"tls_handshakes\":%ld,\"tls_resumed\":%ld,\"tls_failed\":%ld,\"calls\":{",
               mock.connections, mock.open_connections, mock.requests, mock.refused,
               mock.tls_handshakes, mock.tls_resumed, mock.tls_failed);
    for (size_t i = 0, n = 0; i < mock.nmodels; i++)
        if (mock.models[i].calls) {
            buf_puts(&c->json, n++ ? "," : "");
            buf_json_string(&c->json, mock.models[i].name, strlen(mock.models[i].name));
            buf_printf(&c->json, ":%ld", mock.models[i].calls);
        }
    buf_puts(&c->json, "},\"filler_bytes\":{");
    for (size_t i = 0, n = 0; i < mock.nmodels; i++)
        if (mock.models[i].filler_bytes) {
            buf_puts(&c->json, n++ ? "," : "");
            buf_json_string(&c->json, mock.models[i].name, strlen(mock.models[i].name));
            buf_printf(&c->json, ":%lld", mock.models[i].filler_bytes);
        }
    buf_puts(&c->json, "},\"log\":[");
    for (size_t i = 0; i < mock.log_len; i++) {
        const struct log_entry *e = &mock.log[(mock.log_next + LOG_MAX - mock.log_len + i) % LOG_MAX];
        buf_puts(&c->json, i ? ",{\"model\":" : "{\"model\":");
        buf_json_string(&c->json, e->model, strlen(e->model));
        buf_printf(&c->json, ",\"t_ms\":%ld,\"directive\":", e->t_ms);
        buf_json_string(&c->json, e->directive, strlen(e->directive));
        buf_puts(&c->json, ",\"path\":");
        buf_json_string(&c->json, e->path, strlen(e->path));
        if (e->refused[0]) {
            buf_puts(&c->json, ",\"refused\":");
            buf_json_string(&c->json, e->refused, strlen(e->refused));
        }
        buf_puts(&c->json, "}");
    }
    pthread_mutex_unlock(&mock.lock);
    buf_puts(&c->json, "]}");
    return send_answer(c, r, &directive_ok, 200);
}

/* Keeps a copy of a request for GET /_mock/last: the raw head, parsed again
 * when asked for, and the decoded body. */
static void mock_keep_last(const struct conn *c, const struct request *r)
{
    pthread_mutex_lock(&mock.lock);
    mock.last_head.len = mock.last_body.len = 0;
    buf_append(&mock.last_head, c->in.data, r->head_len);
    buf_append(&mock.last_body, r->body, r->body_len);
    snprintf(mock.last_sni, sizeof mock.last_sni, "%s",
             c->tls ? br_ssl_engine_get_server_name(&c->tls->sc.eng) : "");
    pthread_mutex_unlock(&mock.lock);
}

static int control_last(struct conn *c, const struct request *r)
{
    struct request last;
    c->json.len = 0;
    pthread_mutex_lock(&mock.lock);
    if (!mock.last_head.len || http_parse_head(mock.last_head.data, mock.last_head.len, &last) < 0) {
        pthread_mutex_unlock(&mock.lock);
        return send_error(c, r, &directive_ok, 404, "not_found_error", "not_found", "no request received yet");
    }
    buf_puts(&c->json, "{\"method\":");
    buf_json_string(&c->json, last.method, last.method_len);
    buf_puts(&c->json, ",\"path\":");
    buf_json_string(&c->json, last.path, strcspn(last.path, " "));   /* with its query */
    buf_puts(&c->json, ",\"headers\":{");
    for (int i = 0; i < last.nheaders; i++) {
        const struct header *h = &last.headers[i];
        char name[256];
        size_t n = h->name_len < sizeof name ? h->name_len : sizeof name;
        for (size_t j = 0; j < n; j++)
            name[j] = (char)tolower((unsigned char)h->name[j]);
        buf_puts(&c->json, i ? "," : "");
        buf_json_string(&c->json, name, n);
        buf_puts(&c->json, ":");
        buf_json_string(&c->json, h->value, h->value_len);
    }
    buf_puts(&c->json, "},\"body\":");
    buf_json_string(&c->json, mock.last_body.data ? mock.last_body.data : "", mock.last_body.len);
    buf_puts(&c->json, ",\"body_base64\":");
    buf_base64_string(&c->json, (const unsigned char *)(mock.last_body.data ? mock.last_body.data : ""),
                      mock.last_body.len);
    if (c->tls) {                /* the SNI the client sent, "" if none */
        buf_puts(&c->json, ",\"tls_server_name\":");
        buf_json_string(&c->json, mock.last_sni, strlen(mock.last_sni));
    }
    pthread_mutex_unlock(&mock.lock);
    buf_puts(&c->json, "}");
    return send_answer(c, r, &directive_ok, 200);
}

static int serve_control(struct conn *c, const struct request *r)
{
    const char *m = r->method, *p = r->path;
    size_t ml = r->method_len, pl = r->path_len;
    if (slice_is(p, pl, "/_mock/script") && slice_is(m, ml, "POST"))
        return control_script(c, r);
    if (slice_is(p, pl, "/_mock/answer") && slice_is(m, ml, "POST"))
        return control_answer(c, r);
    if (slice_is(p, pl, "/_mock/stats") && slice_is(m, ml, "GET"))
        return control_stats(c, r);
    if (slice_is(p, pl, "/_mock/last") && slice_is(m, ml, "GET"))
        return control_last(c, r);
    if (slice_is(p, pl, "/_mock/reset") && slice_is(m, ml, "POST")) {
        mock_reset();
        c->json.len = 0;
        buf_puts(&c->json, "{\"status\":\"ok\"}");
        return send_answer(c, r, &directive_ok, 200);
    }
    return send_error(c, r, &directive_ok, 404, "not_found_error", "not_found",
                      "unknown mock control endpoint (or wrong method)");
}

/* ===== 9. TLS =====
 *
 * IMPLEMENTATION NOTES
 * With --tls-cert and --tls-key every connection speaks TLS 1.2 through
 * BearSSL's blocking wrapper, br_sslio, over the connection's socket. The
 * connection thread runs the handshake first thing (tls_accept); after that
 * conn_recv is br_sslio_read, and conn_send is br_sslio_write_all followed by
 * br_sslio_flush. conn_wait still polls the bare socket: a client that goes
 * away sends close_notify and then FIN, and POLLRDHUP reports the FIN.
 *
 * The chain and the key are read once at start-up: the PEM objects with
 * br_pem_decoder, the key (RSA or EC, raw or PKCS#8) with br_skey_decoder,
 * whose context then holds the key for the life of the process. The server
 * profile is BearSSL's "full" one for the key's type. For an EC key BearSSL
 * also wants the key type of the CA that signed the leaf (the static ECDH
 * suites depend on it); that is the leaf's signature algorithm.
 *
 * Resumption: one LRU session cache serves all connections. The LRU is not
 * thread-safe, so it sits behind a mutex in a cache class of our own. BearSSL
 * does not tell whether a handshake resumed, so the class's load() notes the
 * session ID it found for the connection, and the handshake resumed if the
 * session ends up with that ID: a full handshake draws a fresh random one.
 * (A found session is not always resumed: not if the client no longer offers
 * its cipher suite or version.)
 *
 * Closing: a graceful end (Connection: close, framing=eof, an error answer)
 * sends close_notify without waiting for the client's. An abrupt one
 * (cut_after, reset) does not, so a client can tell a truncated answer.
 *
 * What tests see: GET /_mock/stats counts "tls_handshakes" (completed),
 * "tls_resumed" (of those, resumed) and "tls_failed" (handshakes that did not
 * complete: a client that rejected the certificate, say); GET /_mock/last
 * adds "tls_server_name", the SNI its connection sent ("" if none).
 */

#define CHAIN_MAX  8
#define PEM_MAX    16
#define CACHE_SIZE 1000          /* sessions; each takes 100 bytes */

static struct {
    int on;                      /* --tls-cert and --tls-key were given */
    int stall;                   /* --tls-stall */
    br_x509_certificate chain[CHAIN_MAX];
    size_t chain_len;
    br_skey_decoder_context key; /* holds the decoded private key */
    unsigned issuer_key_type;    /* BR_KEYTYPE_RSA or BR_KEYTYPE_EC */
} tls_conf;

/* The shared session cache: BearSSL's LRU behind a mutex. */
struct locked_cache {
    const br_ssl_session_cache_class *vtable;   /* first: BearSSL hands us &vtable */
    pthread_mutex_t lock;
    br_ssl_session_cache_lru lru;
    unsigned char store[CACHE_SIZE * 100];
};

static void locked_cache_save(const br_ssl_session_cache_class **ctx, br_ssl_server_context *sc,
                              const br_ssl_session_parameters *params)
{
    struct locked_cache *lc = (struct locked_cache *)(void *)ctx;
    pthread_mutex_lock(&lc->lock);
    lc->lru.vtable->save(&lc->lru.vtable, sc, params);
    pthread_mutex_unlock(&lc->lock);
}

static int locked_cache_load(const br_ssl_session_cache_class **ctx, br_ssl_server_context *sc,
                             br_ssl_session_parameters *params)
{
    struct locked_cache *lc = (struct locked_cache *)(void *)ctx;
    pthread_mutex_lock(&lc->lock);
    int found = lc->lru.vtable->load(&lc->lru.vtable, sc, params);
    pthread_mutex_unlock(&lc->lock);
    if (found) {
        struct tls *t = (struct tls *)(void *)sc;           /* sc is its first member */
        t->cached = 1;
        memcpy(t->cached_id, params->session_id, sizeof t->cached_id);
    }
    return found;
}

static const br_ssl_session_cache_class locked_cache_class = {
    sizeof(struct locked_cache), locked_cache_save, locked_cache_load,
};

static struct locked_cache tls_cache = { .vtable = &locked_cache_class, .lock = PTHREAD_MUTEX_INITIALIZER };

__attribute__((format(printf, 2, 3), noreturn))
static void tls_die(const char *path, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "mock: %s: ", path);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

struct pem_object {
    char name[128];              /* "CERTIFICATE", "EC PRIVATE KEY", ... */
    struct buf der;
};

static void pem_append(void *ctx, const void *p, size_t n) { buf_append(ctx, p, n); }

/* Decodes the PEM objects of a file into objs (zeroed by the caller) and
 * returns how many there are. Exits on any error. */
static size_t pem_read(const char *path, struct pem_object *objs)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        tls_die(path, "%s", strerror(errno));
    br_pem_decoder_context pc;
    br_pem_decoder_init(&pc);
    unsigned char chunk[4096];
    size_t n = 0, got;
    int inside = 0, eof = 0;
    while (!eof) {
        if ((got = fread(chunk, 1, sizeof chunk, f)) == 0) {
            chunk[0] = '\n';                    /* ends a last line that has no newline */
            got = 1;
            eof = 1;
        }
        for (const unsigned char *p = chunk; got > 0; ) {
            size_t used = br_pem_decoder_push(&pc, p, got);
            p += used;
            got -= used;
            switch (br_pem_decoder_event(&pc)) {
            case BR_PEM_BEGIN_OBJ:
                if (n == PEM_MAX)
                    tls_die(path, "more than %d PEM objects", PEM_MAX);
                snprintf(objs[n].name, sizeof objs[n].name, "%s", br_pem_decoder_name(&pc));
                br_pem_decoder_setdest(&pc, pem_append, &objs[n].der);
                inside = 1;
                break;
            case BR_PEM_END_OBJ:
                n++;
                inside = 0;
                break;
            case BR_PEM_ERROR:
                tls_die(path, "not valid PEM");
            }
        }
    }
    if (ferror(f))
        tls_die(path, "read error");
    fclose(f);
    if (inside)
        tls_die(path, "truncated PEM object");
    return n;
}

static void no_dn(void *ctx, const void *p, size_t n) { (void)ctx; (void)p; (void)n; }

/* Does the private key belong to the leaf's public key? Compares the RSA
 * modulus or the EC point, recomputed from the private key. */
static int key_matches(const br_x509_pkey *pk)
{
    unsigned char pub[1024];
    if (pk->key_type == BR_KEYTYPE_EC) {
        const br_ec_private_key *sk = br_skey_decoder_get_ec(&tls_conf.key);
        size_t len = sk && sk->curve == pk->key.ec.curve
            ? br_ec_compute_pub(br_ec_get_default(), NULL, pub, sk) : 0;
        return len && len == pk->key.ec.qlen && !memcmp(pub, pk->key.ec.q, len);
    }
    const br_rsa_private_key *sk = br_skey_decoder_get_rsa(&tls_conf.key);
    br_rsa_compute_modulus modulus = br_rsa_compute_modulus_get_default();
    size_t len = sk ? modulus(NULL, sk) : 0;
    if (!len || len > sizeof pub || !modulus(pub, sk))
        return 0;
    const unsigned char *a = pub, *b = pk->key.rsa.n;
    size_t alen = len, blen = pk->key.rsa.nlen;
    for (; alen && !*a; a++, alen--) {}                    /* compare without leading zeros */
    for (; blen && !*b; b++, blen--) {}
    return alen == blen && !memcmp(a, b, alen);
}

/* Reads the certificate chain (leaf first) and the private key. */
static void tls_load(const char *cert_path, const char *key_path)
{
    static struct pem_object certs[PEM_MAX], keys[PEM_MAX];  /* the chain points into certs */
    size_t n = pem_read(cert_path, certs);
    for (size_t i = 0; i < n; i++)
        if (!strcmp(certs[i].name, "CERTIFICATE") || !strcmp(certs[i].name, "X509 CERTIFICATE")) {
            if (tls_conf.chain_len == CHAIN_MAX)
                tls_die(cert_path, "more than %d certificates", CHAIN_MAX);
            tls_conf.chain[tls_conf.chain_len++] = (br_x509_certificate){
                (unsigned char *)certs[i].der.data, certs[i].der.len };
        }
    if (!tls_conf.chain_len)
        tls_die(cert_path, "no CERTIFICATE in it");

    n = pem_read(key_path, keys);
    size_t k = 0;
    while (k < n && strcmp(keys[k].name, "PRIVATE KEY") && strcmp(keys[k].name, "EC PRIVATE KEY")
           && strcmp(keys[k].name, "RSA PRIVATE KEY"))
        k++;
    if (k == n)
        tls_die(key_path, "no PRIVATE KEY, EC PRIVATE KEY or RSA PRIVATE KEY in it");
    br_skey_decoder_init(&tls_conf.key);
    br_skey_decoder_push(&tls_conf.key, keys[k].der.data, keys[k].der.len);
    if (br_skey_decoder_last_error(&tls_conf.key))
        tls_die(key_path, "cannot decode the key (BearSSL error %d)", br_skey_decoder_last_error(&tls_conf.key));

    br_x509_decoder_context dc;
    br_x509_decoder_init(&dc, no_dn, NULL);
    br_x509_decoder_push(&dc, tls_conf.chain[0].data, tls_conf.chain[0].data_len);
    const br_x509_pkey *pk = br_x509_decoder_get_pkey(&dc);
    if (!pk)
        tls_die(cert_path, "cannot decode the first certificate (BearSSL error %d)",
                br_x509_decoder_last_error(&dc));
    if (pk->key_type != br_skey_decoder_key_type(&tls_conf.key) || !key_matches(pk))
        tls_die(key_path, "this key does not belong to the first certificate of %s", cert_path);
    tls_conf.issuer_key_type = (unsigned)br_x509_decoder_get_signer_key_type(&dc);
    if (!tls_conf.issuer_key_type)
        tls_conf.issuer_key_type = pk->key_type;
    br_ssl_session_cache_lru_init(&tls_cache.lru, tls_cache.store, sizeof tls_cache.store);
    tls_conf.on = 1;
}

/* Runs the server side of the handshake and counts it. Returns 0 when the
 * connection is ready for HTTP, -1 if the handshake failed. */
static int tls_accept(struct conn *c)
{
    static const char *alpn[] = { "http/1.1" };
    struct tls *t = c->tls = malloc(sizeof *t);
    if (!t)
        die("malloc");
    t->cached = 0;
    if (br_skey_decoder_key_type(&tls_conf.key) == BR_KEYTYPE_RSA)
        br_ssl_server_init_full_rsa(&t->sc, tls_conf.chain, tls_conf.chain_len,
                                    br_skey_decoder_get_rsa(&tls_conf.key));
    else
        br_ssl_server_init_full_ec(&t->sc, tls_conf.chain, tls_conf.chain_len, tls_conf.issuer_key_type,
                                   br_skey_decoder_get_ec(&tls_conf.key));
    br_ssl_engine_set_versions(&t->sc.eng, BR_TLS12, BR_TLS12);
    br_ssl_engine_add_flags(&t->sc.eng, BR_OPT_NO_RENEGOTIATION);
    br_ssl_engine_set_protocol_names(&t->sc.eng, alpn, 1);
    br_ssl_engine_set_buffer(&t->sc.eng, t->iobuf, sizeof t->iobuf, 1);
    br_ssl_server_set_cache(&t->sc, &tls_cache.vtable);
    br_sslio_init(&t->io, &t->sc.eng, sock_read, &c->fd, sock_write, &c->fd);
    /* br_sslio_flush runs the engine until it takes application data, that
     * is, through the whole handshake. */
    int ok = br_ssl_server_reset(&t->sc) && br_sslio_flush(&t->io) == 0;
    if (ok && t->cached) {
        br_ssl_session_parameters sp;
        br_ssl_engine_get_session_parameters(&t->sc.eng, &sp);
        c->resumed = !memcmp(sp.session_id, t->cached_id, sizeof t->cached_id);
    }
    pthread_mutex_lock(&mock.lock);
    if (c->epoch == mock.epoch) {
        mock.tls_handshakes += ok;
        mock.tls_resumed += c->resumed;
        mock.tls_failed += !ok;
    }
    pthread_mutex_unlock(&mock.lock);
    return ok ? 0 : -1;
}

/* Sends close_notify and does not wait for the client's answer. */
static void tls_close_notify(struct conn *c)
{
    br_ssl_engine_context *eng = &c->tls->sc.eng;
    unsigned char *rec;
    size_t len;
    br_ssl_engine_close(eng);
    while ((rec = br_ssl_engine_sendrec_buf(eng, &len)) != NULL) {
        int w = sock_write(&c->fd, rec, len);
        if (w < 0)
            break;
        br_ssl_engine_sendrec_ack(eng, (size_t)w);
    }
}

/* ===== 10. Connection threads and main ===== */

static int path_ends_with(const struct request *r, const char *suffix)
{
    size_t n = strlen(suffix);
    return r->path_len >= n && !memcmp(r->path + r->path_len - n, suffix, n);
}

/* Answers one request. Returns 1 to keep the connection open. */
static int conn_route(struct conn *c, const struct request *r)
{
    if (r->path_len >= 7 && !memcmp(r->path, "/_mock/", 7))
        return serve_control(c, r);
    mock_keep_last(c, r);
    size_t i = 0, n = sizeof apis / sizeof *apis;
    while (i < n && !path_ends_with(r, apis[i].path))
        i++;
    if (i == n)
        return send_error(c, r, &directive_ok, 404, "invalid_request_error", "not_found", "unknown path");
    if (!slice_is(r->method, r->method_len, "POST"))
        return send_api_error(c, r, &directive_ok, &apis[i], 405, "method_not_allowed", "use POST");
    int keep = serve_inference(c, r, &apis[i]);
    c->bytewise = 0;
    return keep;
}

/* Answers requests until one ends the connection. Returns 1 if that end is
 * graceful (over TLS: send close_notify), 0 if the peer left or the end is abrupt. */
static int conn_serve(struct conn *c)
{
    struct request r;
    int first = 1;
    buf_reserve(&c->in, READ_CHUNK);
    for (;;) {
        long n = conn_read_request(c, &r);
        if (n == HTTP_CLOSED)
            return 0;
        if (n < 0) {
            static const struct request bare = { .want_close = 1 };
            long status = n == HTTP_HEAD_TOO_BIG ? 431 : n == HTTP_BODY_TOO_BIG ? 413 : 400;
            send_error(c, &bare, &directive_ok, status, "invalid_request_error", "bad_request",
                       "mock could not read the request");
            return 1;
        }
        if (first && r.path_len >= 7 && !memcmp(r.path, "/_mock/", 7)) {
            pthread_mutex_lock(&mock.lock);          /* a test's control connection */
            mock.open_connections--;
            if (c->epoch == mock.epoch) {
                mock.connections--;
                mock.tls_handshakes -= c->tls != NULL;
                mock.tls_resumed -= c->resumed;
            }
            c->counted = 0;
            pthread_mutex_unlock(&mock.lock);
        }
        first = 0;
        int keep = conn_route(c, &r);
        c->in.len -= (size_t)n;
        memmove(c->in.data, c->in.data + n, c->in.len);
        if (!keep)
            return !c->abrupt;
    }
}

static void *conn_main(void *arg)
{
    struct conn *c = arg;
    if (tls_conf.stall)
        conn_wait(c, -1);                            /* read nothing, answer nothing */
    else if ((!tls_conf.on || tls_accept(c) == 0) && conn_serve(c) && c->tls)
        tls_close_notify(c);
    close(c->fd);
    if (c->counted) {
        pthread_mutex_lock(&mock.lock);
        mock.open_connections--;
        pthread_mutex_unlock(&mock.lock);
    }
    free(c->tls);
    free(c->in.data);
    free(c->body.data);
    free(c->json.data);
    free(c->out.data);
    free(c->batch.data);
    free(c);
    return NULL;
}

static void usage(const char *argv0)
{
    fprintf(stderr, "usage: %s --port PORT [--tls-cert CHAIN.pem --tls-key KEY.pem | --tls-stall]\n", argv0);
    exit(2);
}

int main(int argc, char **argv)
{
    const char *port = NULL, *cert = NULL, *key = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tls-stall"))
            tls_conf.stall = 1;
        else if (i + 1 == argc)
            usage(argv[0]);
        else if (!strcmp(argv[i], "--port"))
            port = argv[++i];
        else if (!strcmp(argv[i], "--tls-cert"))
            cert = argv[++i];
        else if (!strcmp(argv[i], "--tls-key"))
            key = argv[++i];
        else
            usage(argv[0]);
    }
    if (!port || !cert != !key || (cert && tls_conf.stall))
        usage(argv[0]);
    if (cert)
        tls_load(cert, key);
    signal(SIGPIPE, SIG_IGN);
    memset(filler, 'x', sizeof filler);
    mock.start_ms = now_ms();

    int one = 1, lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in addr = { .sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port)),
                                .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t addr_len = sizeof addr;
    if (lfd < 0)
        die("socket");
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0)
        die("bind");
    if (listen(lfd, SOMAXCONN) < 0)
        die("listen");
    getsockname(lfd, (struct sockaddr *)&addr, &addr_len);
    fprintf(stderr, "mock: listening on 127.0.0.1:%d%s\n", ntohs(addr.sin_port),
            tls_conf.on ? " (TLS)" : tls_conf.stall ? " (stalling every connection)" : "");

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);   /* buffers live on the heap */
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE)
                usleep(10000);                       /* out of fds: let some close */
            continue;
        }
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct conn *c = calloc(1, sizeof *c);
        if (!c)
            die("calloc");
        c->fd = fd;
        c->counted = 1;
        pthread_mutex_lock(&mock.lock);
        mock.connections++;
        mock.open_connections++;
        c->epoch = mock.epoch;
        pthread_mutex_unlock(&mock.lock);
        pthread_t tid;
        if (pthread_create(&tid, &attr, conn_main, c) != 0) {
            pthread_mutex_lock(&mock.lock);
            mock.open_connections--;
            pthread_mutex_unlock(&mock.lock);
            close(fd);
            free(c);
        }
    }
}
