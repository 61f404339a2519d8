"""Integration tests: hostile providers (issue #7 point 3; API.md 4.3 outcomes, 3.4 attempt_log).

tests/integration.py imports this file at start-up and runs its tests with the others; to run only
these:

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k "hostile provider"

A provider that answers with an endless body, a giant head, broken chunked framing, a 200 that is
not JSON, one enormous SSE event, an answer that never ends, or bytes after a whole answer must
cost ltg bounded memory and time, and each case must end in the outcome of API.md 4.3:

- before the answer starts (a non-stream answer, or a stream before its first event is relayed):
  the attempt is `indeterminate` (status: the provider's, or 0 when no head could be parsed), the
  fallback serves; without a fallback the client gets 502 whose error.attempts lists the attempt;
- after a stream's first event: the stream ends with the SSE error event `stream_interrupted` and
  no [DONE], and the ledger event is `partial`;
- an answer that never ends: cut at the deadline (504 `deadline_exceeded`), or for a started
  stream after --max-stream-seconds;
- junk after a whole answer: the answer is a success, the connection is not used again.

Every attempt_log entry of a failed attempt (in the ledger and in error.attempts) carries an
`error` string saying why. Each case checks the client's answer, x-ltg-attempts and
x-ltg-served-model, the calls the mock saw, the ledger's spend event, the time it took, and the
RSS of ltg (/proc/PID/status VmRSS, and VmHWM, its peak); after each test ltg must answer /healthz.

The mock's hostile directives (tests/mock.c, top comment): body_mb, head_kb, head_lines,
garble=chunk_size|chunk_long|html|truncated|huge with garble_after, trickle_ms, junk_after_ms;
a stream that never ends is events=N event_delay_ms=M.

Isolation, as in integration_retries.py: these tests run on an ltg of their own (it.Aux) whose
catalog is the harness's plus models reserved to this file: HP-01... (provider "mock", upstream
hp-01...), fresh for every case (so neither the mock's scripts and counters nor ltg's circuit
breakers carry over), and HPS-1... each on a provider of its own (the same mock under another
name), whose connection pool only that one test uses. The stream-duration test starts one more
ltg with --max-stream-seconds 2.
"""

import integration as it

import datetime
import json
import os
import time

POOL = it.ModelPool("HP-%02d", 80)  # HP-01..HP-80 on the mock
NSOLO = 4            # HPS-1..HPS-4, one provider each
MIB = 1 << 20
RSS_SLACK_MIB = 100  # ltg's RSS may grow by at most this much over its RSS at start (ASan: see rss_slack_kib)

check = it.check


# ===== the dedicated ltg ==========================================================================

def _catalog():
    cfg = it.catalog_copy()
    POOL.add_to(cfg)
    for i in range(1, NSOLO + 1):
        cfg["providers"]["hp-solo-%d" % i] = it.catalog_provider(it.H.mock_port)
        cfg["models"]["HPS-%d" % i] = it.catalog_model("hp-solo-%d" % i, "hps-%d" % i)
    return cfg


def _config_path():
    return it.catalog_file("hostile", _catalog)


class Ltg(it.Aux):
    """it.Aux on this file's catalog and environment, with extra command-line flags."""

    def __init__(self, tag, args=()):
        it.Aux.__init__(self, tag, config=_config_path(), args=args, env=_env())
        self.rss0 = None             # VmRSS (KiB) once started

    def start(self, timeout=20):
        it.Aux.start(self, timeout)
        self.rss0 = it.rss_kib(self.proc.pid)


def _env():
    """The harness's environment, with ASan's quarantine of freed memory (256 MiB by default) cut to
    16 MiB: the memory checks measure ltg, not the sanitizer (no effect on the release build)."""
    env = dict(it.H.env)
    env["ASAN_OPTIONS"] = ":".join(x for x in (env.get("ASAN_OPTIONS"), "quarantine_size_mb=16") if x)
    return env


# An answer given up on is metered (README "Cost"): a body that never ends holds its spend event
# back for --meter-abandoned-seconds; 2 s keeps the tests that wait for the event short.
_LTG = it.AuxSlot(lambda n: Ltg("hostile-%d" % n, args=("--meter-abandoned-seconds", "2")))


def rss_slack_kib():
    # Under ASan a growing buffer is copied on every realloc (the release build's glibc moves a
    # large block with mremap), and freed blocks wait in the quarantine (see _env): more slack.
    # Under --wrap (valgrind) the process measured is valgrind itself, with its shadow memory and
    # its own queue of freed blocks: twice the slack again.
    asan = "asan" in os.path.basename(it.H.ltg_bin)
    return (RSS_SLACK_MIB + (100 if asan else 0) + (200 if it.WRAP else 0)) * 1024


def check_rss(a, what):
    """ltg's resident memory now (VmRSS) and at its peak so far (VmHWM: malloc gives large blocks
    back at once, so the peak is what shows a body held whole) within its start + the slack."""
    rss, hwm = it.rss_kib(a.proc.pid), it.proc_status_kib(a.proc.pid, "VmHWM")
    it.log("%s: ltg's VmRSS %d KiB, VmHWM %d KiB (VmRSS at start %d KiB)" % (what, rss, hwm, a.rss0))
    for name, v in (("VmRSS", rss), ("VmHWM (its peak)", hwm)):
        check(v <= a.rss0 + rss_slack_kib(), "%s: ltg's %s is %d MiB, its start %d MiB + %d MiB allowed"
              % (what, name, v // 1024, a.rss0 // 1024, rss_slack_kib() // 1024))


def check_healthy(a, what):
    try:
        r = it.one_request(a.port, "GET", "/healthz", auth=None, timeout=10)
    except Exception as e:
        raise it.TestFailure("%s: GET /healthz afterwards failed: %s" % (what, e))
    check(r.status == 200, "%s: GET /healthz afterwards: %s" % (what, r.brief()))


def hptest(name):
    """Register a test ("hostile provider: " + name) that gets the dedicated ltg as its argument;
    afterwards ltg must be alive, healthy, within its RSS bound and free of sanitizer reports."""
    def deco(fn):
        def checked(a):
            fn(a)
            check_rss(a, "after the test")
            check_healthy(a, "after the test")
        _LTG.test("hostile provider: " + name, "the hostile-provider ltg")(checked)
        return fn
    return deco


# ===== models, groups, calls, checks ==============================================================

fresh = POOL.take                   # fresh(n): n models of the pool that no test used before
up = it.ModelPool.upstream          # the upstream name the mock sees for an alias


class Group:
    def __init__(self, gid, token):
        self.gid, self.token = gid, token


def group(a, models, fallbacks=None):
    """A group of its own; 2 attempts per model, so that a retry of an indeterminate attempt on the
    same model (which must not happen) would show in the mock's calls."""
    body = {"name": "hostile-" + it.new_idem(), "allowed_models": list(models),
            "retries": {"max_attempts": 2, "retry_delay_ms": 0}}
    if fallbacks is not None:
        body["fallbacks"] = fallbacks
    d = it.create_group(body, port=a.admin_port)
    _, token = it.create_key(d["id"], port=a.admin_port)
    return Group(d["id"], token)


def script(alias, steps):
    it.H.mock_post("/_mock/script", {"model": up(alias), "steps": list(steps)})


def check_calls(expect, what):
    """expect: {alias: calls the mock saw for it}."""
    st = it.H.mock_stats()
    got = {m: st.get("calls", {}).get(up(m), 0) for m in expect}
    check(got == expect, "%s: calls at the mock %r, want %r" % (what, got, expect))


def call(a, g, model, stream=False, headers=None, timeout=60.0):
    """One chat request; the Response has .elapsed (s)."""
    t0 = time.monotonic()
    with it.Conn(a.port, timeout=timeout) as c:
        c.send(it.http_request("POST", "/v1/chat/completions", it.chat_body(model=model, stream=stream),
                               headers, auth=g.token))
        r = c.read_final_response(timeout)
    r.elapsed = time.monotonic() - t0
    return r


def check_headers(r, status, attempts, served=None, what="the answer"):
    """API.md 4.1: x-ltg-attempts always, x-ltg-served-model on 2xx only."""
    check(r.status == status, "%s: status %d, want %d: %s" % (what, r.status, status, r.brief()))
    got = r.header_all("x-ltg-attempts")
    check(got == [str(attempts)], "%s: x-ltg-attempts %r, want %r" % (what, got, str(attempts)))
    sm = r.header_all("x-ltg-served-model")
    want = [served] if 200 <= status < 300 else []
    check(sm == want, "%s: x-ltg-served-model %r, want %r" % (what, sm, want))


def check_attempts(att, expect, what):
    """att: an attempt_log or error.attempts; expect: [(model, attempt, status, outcome)], a status
    of None matching any. A failed attempt (any outcome but ok) must say why in a non-empty
    `error` string."""
    check(isinstance(att, list), "%s: %r is not a list" % (what, att))
    brief = [(x.get("model"), x.get("attempt"), x.get("status"), x.get("outcome")) if isinstance(x, dict) else x
             for x in att]
    want = [tuple(w) for w in expect]
    cmp = [(b[0], b[1], None if w[2] is None else b[2], b[3]) if isinstance(b, tuple) else b
           for b, w in zip(brief, want)] + brief[len(want):]
    check(cmp == want, "%s: %r, want %r" % (what, brief, want))
    for x in att:
        check(set(x) >= {"model", "attempt", "status", "outcome", "ms"},
              "%s: entry %r lacks some of model, attempt, status, outcome, ms" % (what, x))
        check(isinstance(x["ms"], int) and x["ms"] >= 0, "%s: entry %r: ms is not a whole number >= 0" % (what, x))
        if x["outcome"] != "ok":
            check(isinstance(x.get("error"), str) and x["error"].strip(),
                  "%s: the failed attempt %r has no error string saying why" % (what, x))
            it.log("%s: %s attempt %d: %s" % (what, x["model"], x["attempt"], x["error"]))


ledger_event = it.ledger_event


def check_event(a, g, r, status, http_status, model, expect, what):
    e = ledger_event(a, g, r.header("x-ltg-request-id"))
    check((e.get("status"), e.get("http_status"), e.get("model")) == (status, http_status, model),
          "%s: the spend event has status %r http_status %r model %r, want %r %r %r"
          % (what, e.get("status"), e.get("http_status"), e.get("model"), status, http_status, model))
    check_attempts(e.get("attempt_log"), expect, what + ": the ledger's attempt_log")
    return e


def check_interrupted(r, upstream_model, n_before, what):
    """A started stream cut by ltg: n_before content events of upstream_model, then the SSE error
    event stream_interrupted as the last event, no [DONE]."""
    check((r.header("content-type") or "").startswith("text/event-stream"),
          "%s: Content-Type %r" % (what, r.header("content-type")))
    datas = it.sse_datas(r)
    check("[DONE]" not in datas, "%s: a cut stream must not carry [DONE]: %r" % (what, [d[:80] for d in datas]))
    check(len(datas) >= 2, "%s: want content events and the error event, got %r" % (what, [d[:80] for d in datas]))
    for d in datas[:-1]:
        try:
            o = json.loads(d)
        except ValueError:
            raise it.TestFailure("%s: an event that is not JSON was relayed: %r" % (what, d[:100]))
        check(o.get("model") == upstream_model and (o.get("choices") or [{}])[0].get("delta", {}).get("content"),
              "%s: every event before the error should be a content event of %s: %r" % (what, upstream_model, d[:200]))
    if n_before is not None:
        check(len(datas) - 1 == n_before, "%s: %d events before the error event, want %d"
              % (what, len(datas) - 1, n_before))
    try:
        err = json.loads(datas[-1]).get("error")
    except (ValueError, AttributeError):
        err = None
    check(isinstance(err, dict) and err.get("code") == "stream_interrupted" and err.get("type") == "upstream_error"
          and isinstance(err.get("message"), str) and err["message"],
          "%s: the last event should be {\"error\":{message, type upstream_error, code stream_interrupted}}: %r"
          % (what, datas[-1][:300]))
    it.log("%s: %s" % (what, err["message"]))


def check_elapsed(r, limit, what):
    check(r.elapsed < limit, "%s: answered after %.1f s, want under %.0f s" % (what, r.elapsed, limit))


def filler_sent(alias):
    return it.H.mock_stats().get("filler_bytes", {}).get(up(alias), 0)


def settled_filler_sent(alias, quiet=0.5, timeout=15.0):
    """filler_sent(alias) once it stops growing: unchanged for `quiet` s (bounded wait; the mock counts
    a piece once its send returned, and stops when its peer leaves or stops reading)."""
    deadline = time.monotonic() + timeout * it.SLOW
    last, since = filler_sent(alias), time.monotonic()
    while time.monotonic() - since < quiet:
        check(time.monotonic() < deadline, "the mock still sends filler of %s after %g s (%d MiB so far)"
              % (alias, timeout * it.SLOW, last // MIB))
        time.sleep(0.05)
        now = filler_sent(alias)
        if now != last:
            last, since = now, time.monotonic()
    return last


# ===== before the answer starts: indeterminate, the fallback serves ===============================
# (what, the directive, the failed attempt's status: the provider's, 0 when no head was parsed,
#  the longest the request may take in s)

NON_STREAM = [
    ("an endless body declared by a Content-Length of 1 GiB", "body_mb=1024", 200, 20),
    ("an endless body framed by the close", "body_mb=256 framing=eof", 200, 20),
    ("an endless chunked body", "body_mb=256 framing=chunked", 200, 20),
    ("a 100 KiB response head", "head_kb=100", 0, 10),
    ("a response head of 200 header lines", "head_lines=200", 0, 10),
    ("a chunk-size line that is not hex", "garble=chunk_size", 200, 10),
    ("a chunk longer than its size", "garble=chunk_long", 200, 10),
    ("a 200 whose body is HTML", "garble=html", 200, 10),
    ("a 200 whose JSON is cut in half (framed right)", "garble=truncated", 200, 10),
]


def run_non_stream(a, what, directive, status, limit):
    # With a fallback: A's attempt is indeterminate (never retried on A), B serves.
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]})
    script(A, [directive, "ok"])
    r = call(a, g, A)
    check_headers(r, 200, 2, B, what)
    check(r.json()["choices"][0]["message"]["content"] == "Hello from %s." % up(B),
          "%s: the body is not %s's answer: %r" % (what, B, r.body[:200]))
    check_elapsed(r, limit, what)
    check_calls({A: 1, B: 1}, what)
    check_event(a, g, r, "succeeded", 200, B, [(A, 1, status, "indeterminate"), (B, 1, 200, "ok")], what)
    check_rss(a, what)
    # Without one: 502, error.attempts lists the attempt and says why.
    A, = fresh(1)
    g = group(a, [A])
    script(A, [directive, "ok"])
    r = call(a, g, A)
    w = what + " (no fallback)"
    check_headers(r, 502, 1, what=w)
    e = it.check_openai_error(r, 502)
    check_attempts(e.get("attempts"), [(A, 1, status, "indeterminate")], w + ": error.attempts")
    check_elapsed(r, limit, w)
    check_calls({A: 1}, w)
    ev = check_event(a, g, r, "failed", 502, None, [(A, 1, status, "indeterminate")], w)
    check(ev.get("attempt_log") == e["attempts"], "%s: the ledger's attempt_log %r differs from error.attempts %r"
          % (w, ev.get("attempt_log"), e["attempts"]))
    check_rss(a, w)


def non_stream_test(what, directive, status, limit):
    @hptest("non-stream, %s: indeterminate, the fallback serves; alone: 502" % what)
    def t(a):
        run_non_stream(a, what, directive, status, limit)
    return t


for _case in NON_STREAM:
    non_stream_test(*_case)


@hptest("non-stream, a Content-Length over 64 MiB fails at the head: the body is not read")
def t_hp_length_at_head(a):
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]})
    script(A, ["body_mb=1024"])
    r = call(a, g, A)
    check_headers(r, 200, 2, B)
    sent = settled_filler_sent(A)
    check(sent < 32 * MIB, "the mock sent %d MiB of a body declared as 1 GiB before ltg gave up: a Content-Length "
          "over 64 MiB should fail when the head arrives" % (sent // MIB))


STREAM_BEFORE = [
    ("a 100 KiB response head", "head_kb=100", 0),
    ("a chunk-size line that is not hex", "garble=chunk_size", 200),
    ("a chunk longer than its size", "garble=chunk_long", 200),
    ("a first event whose data is HTML", "garble=html", 200),
    ("a first event whose JSON is cut in half", "garble=truncated", 200),
    ("a first event of 2 MiB", "garble=huge", 200),
]


def stream_before_test(what, directive, status):
    @hptest("stream, %s before the first event: indeterminate, the fallback's whole stream" % what)
    def t(a):
        A, B = fresh(2)
        g = group(a, [A, B], {A: [B]})
        script(A, [directive, "ok"])
        r = call(a, g, A, stream=True)
        check_headers(r, 200, 2, B, what)
        it.check_whole_stream(r, up(B), what)
        check_elapsed(r, 10, what)
        check_calls({A: 1, B: 1}, what)
        check_event(a, g, r, "succeeded", 200, B, [(A, 1, status, "indeterminate"), (B, 1, 200, "ok")], what)
    return t


for _case in STREAM_BEFORE:
    stream_before_test(*_case)


# ===== after a stream's first event: stream_interrupted, partial ==================================
# event_delay_ms spaces the events so that the good ones reach ltg, and are relayed, before the bad
# one: broken framing that arrives in the same read as good events fails the attempt before they are
# relayed, and then a failover is right (nothing had reached the client).

STREAM_AFTER = [
    ("a chunk-size line that is not hex", "garble=chunk_size garble_after=2 event_delay_ms=300"),
    ("a chunk longer than its size", "garble=chunk_long garble_after=2 event_delay_ms=300"),
    ("an event whose data is HTML", "garble=html garble_after=2 event_delay_ms=300"),
    ("an event whose JSON is cut in half", "garble=truncated garble_after=2 event_delay_ms=300"),
    ("an event of 2 MiB", "garble=huge garble_after=2 event_delay_ms=300"),
]


def stream_after_test(what, directive):
    @hptest("stream, %s after 2 events: stream_interrupted, no [DONE], ledger partial" % what)
    def t(a):
        A, B = fresh(2)
        g = group(a, [A, B], {A: [B]})
        script(A, [directive, "ok"])
        r = call(a, g, A, stream=True)
        check_headers(r, 200, 1, A, what)
        check_interrupted(r, up(A), 2, what)
        check_elapsed(r, 10, what)
        check_calls({A: 1, B: 0}, what)
        check_event(a, g, r, "partial", 200, A, [(A, 1, 200, "ok")], what)
    return t


for _case in STREAM_AFTER:
    stream_after_test(*_case)


# ===== answers that never end =====================================================================

@hptest("non-stream, a body that trickles a byte a second and never ends: 504 deadline_exceeded at the deadline")
def t_hp_trickle(a):
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]})
    script(A, ["trickle_ms=1000"])
    r = call(a, g, A, headers={"x-ltg-deadline": "1500"})
    check_headers(r, 504, 1)
    e = it.check_openai_error(r, 504, "deadline_exceeded")
    check_attempts(e.get("attempts"), [(A, 1, 200, "indeterminate")], "error.attempts")
    check(r.elapsed >= 1.4, "answered after %.2f s, before the deadline of 1.5 s" % r.elapsed)
    check_elapsed(r, 6, "a trickling body, deadline 1.5 s")
    check_calls({A: 1, B: 0}, "trickle")
    check_event(a, g, r, "failed", 504, None, [(A, 1, 200, "indeterminate")], "trickle")


@hptest("stream that never ends: cut after --max-stream-seconds 2 with stream_interrupted, ledger partial")
def t_hp_endless_stream(a):
    b = Ltg("hostile-max-stream", ["--max-stream-seconds", "2"])
    try:
        try:
            b.start()
        except it.TestFailure as e:
            raise it.TestFailure("ltg --max-stream-seconds 2 does not start: %s" % e)
        at = b.log_size()
        A, B = fresh(2)
        g = group(b, [A, B], {A: [B]})
        script(A, ["events=100000 event_delay_ms=100"])    # 10 events a second for ~3 hours
        r = call(b, g, A, stream=True)
        check_headers(r, 200, 1, A, "endless stream")
        check_interrupted(r, up(A), None, "endless stream")
        check(r.elapsed >= 1.9, "the stream was cut after %.2f s, before --max-stream-seconds 2" % r.elapsed)
        check_elapsed(r, 8, "an endless stream, --max-stream-seconds 2")
        n = len(it.sse_datas(r)) - 1
        check(n >= 5, "only %d events relayed in %.1f s of a stream of 10 a second" % (n, r.elapsed))
        check_calls({A: 1, B: 0}, "endless stream")
        check_event(b, g, r, "partial", 200, A, [(A, 1, 200, "ok")], "endless stream")
        check_rss(b, "endless stream")
        check_healthy(b, "endless stream")
        san = b.report_since(at)
        check(not san, "sanitizer report in the log of ltg --max-stream-seconds 2: %s" % san)
        b.stop()
    finally:
        b.close()


@hptest("stream that goes quiet after its first event: cut after --stream-idle-seconds 2 (default 120) "
        "with stream_interrupted, ledger partial")
def t_hp_quiet_stream(a):
    b = Ltg("hostile-stream-idle", ["--stream-idle-seconds", "2"])
    try:
        try:
            b.start()
        except it.TestFailure as e:
            raise it.TestFailure("ltg --stream-idle-seconds 2 does not start: %s" % e)
        A, B = fresh(2)
        g = group(b, [A, B], {A: [B]})
        script(A, ["events=3 first_event_delay_ms=0 event_delay_ms=20000"])   # one delta, then 20 s of silence
        r = call(b, g, A, stream=True)
        check_headers(r, 200, 1, A, "a quiet stream")
        check_interrupted(r, up(A), 1, "a quiet stream")
        msg = json.loads(it.sse_datas(r)[-1])["error"].get("message", "")
        check("stalled for 2 s" in msg, "the error event should say the stream stalled for 2 s: %r" % msg)
        check(r.elapsed >= 1.9, "the stream was cut after %.2f s, before --stream-idle-seconds 2" % r.elapsed)
        check_elapsed(r, 15, "a quiet stream, --stream-idle-seconds 2 (the next event was 20 s away)")
        check_calls({A: 1, B: 0}, "a quiet stream")
        check_event(b, g, r, "partial", 200, A, [(A, 1, 200, "ok")], "a quiet stream")
        check_healthy(b, "a quiet stream")
        b.stop()
    finally:
        b.close()


# ===== bytes after a whole answer =================================================================

def mock_connections():
    return it.H.mock_stats()["connections"]


def bytes_waiting_from(port):
    """Does a connection to 127.0.0.1:port (ltg's end) hold received bytes nobody read yet (the
    rx_queue of /proc/net/tcp)?"""
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[2] == "0100007F:%04X" % port and fields[3] == "01" and int(fields[4].split(":")[1], 16) > 0:
                return True
    return False


def junk_test(solo, delay_ms):
    @hptest("junk %s after a whole answer: the answer served (ok), the connection not reused"
            % ("in the same write" if delay_ms == 0 else "%d ms" % delay_ms))
    def t(a):
        # HPS-n is the only model of its provider: that provider's pool holds only this test's connections.
        S = "HPS-%d" % solo
        g = group(a, [S])
        script(S, ["junk_after_ms=%d" % delay_ms])
        c0 = mock_connections()
        at = a.log_size()
        r = call(a, g, S)
        check_headers(r, 200, 1, S, "the answer followed by junk")
        check(r.json()["choices"][0]["message"]["content"] == "Hello from %s." % up(S),
              "the answer followed by junk: body %r" % r.body[:200])
        check_event(a, g, r, "succeeded", 200, S, [(S, 1, 200, "ok")], "the answer followed by junk")
        c1 = mock_connections()
        check(c1 == c0 + 1, "the first request to a fresh provider: %d connections at the mock, want 1" % (c1 - c0))
        # The junk is there before the next request: read with the answer (ltg says so and does not
        # pool the connection), or waiting unread on the pooled connection.
        it.wait_until("the junk after the answer did not reach ltg (no log line about it, no bytes waiting on a "
                      "connection to the mock)",
                      lambda: "sent bytes after its answer" in a.text_since(at) or bytes_waiting_from(it.H.mock_port),
                      10 * it.SLOW, step=0.02)
        r = call(a, g, S)
        check_headers(r, 200, 1, S, "the next request")
        c2 = mock_connections()
        check(c2 == c1 + 1, "the next request made %d new connections: the one with junk after its answer must "
              "not be reused (want 1 new)" % (c2 - c1))
        r = call(a, g, S)        # and a clean connection is reused: the count above means something
        check_headers(r, 200, 1, S, "the third request")
        c3 = mock_connections()
        check(c3 == c2, "the third request made %d new connections, want 0 (the second one's was clean)" % (c3 - c2))
        check_calls({S: 3}, "junk")
    return t


junk_test(1, 0)
junk_test(2, 200)


# ===== last: the dedicated ltg exits cleanly ======================================================

_LTG.stop_test(__name__, "hostile provider: its ltg exits 0 on SIGTERM, no sanitizer report in its log",
               "no hostile-provider test ran")


if __name__ == "__main__":   # this file alone: python3 tests/integration_hostile_providers.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
