"""Integration tests: retries and fallback (API.md 4.1-4.3; README "Retries and fallback" and
"Per-request overrides").

tests/integration.py imports this file at start-up and runs its tests with the others; to run only
these:

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k retries

Every test asserts what ltg answered (status, x-ltg-served-model, x-ltg-attempts, the error body's
error.attempts entries {model, attempt, status, outcome, ms}) AND what the mock provider saw: its
count of calls per upstream model and, for the timing tests, the gaps between those calls in its
log (t_ms, stamped by the mock when a request arrives).

Isolation. These tests run on an ltg of their own (the harness's Aux: the same binary, its own
ports, --data and log), whose catalog is the harness's plus a pool of models reserved to this file:
RT-001... (provider "mock", upstream rt-001...), RD-01... (provider "down": a loopback port that
refuses connections) and RB-1... (provider "rt-blackhole": a loopback port where a connect never
completes, for the connect-timeout row). Each test takes fresh models from the pool (`fresh()`), so neither the mock's
per-model scripts and counters nor ltg's per-alias circuit breakers carry over from one test to
another, and the failures provoked here never open a breaker of the main ltg (Kimi-K3...). Each
test provisions its own token group (allowed models, fallbacks, retries) and token key through the
control plane. Models are scripted with POST /_mock/script, one directive per call.

That ltg is started by the first test that needs it (again if it died) and stopped by the last test
of this file, which checks that it exits 0 on SIGTERM; every test also fails on a sanitizer report
written to its log during the test.

Timing: where ltg must wait, the lower bound is exact (less 5 ms for the mock's clock rounding);
upper bounds carry hundreds of ms of slack (jitter is at most +20 %), so that a slow, busy machine or
the sanitizer build does not make them flaky.
"""

import integration as it

import datetime
import json
import os
import re
import select
import socket
import threading
import time

POOL = it.ModelPool("RT-%03d", 240)                   # RT-001..RT-240 on the mock
DOWN = it.ModelPool("RD-%02d", 12, provider="down")    # RD-01..RD-12 on the refusing port

_S = {}


check = it.check


# ===== the dedicated ltg ==========================================================================

def _catalog():
    cfg = it.catalog_copy()
    POOL.add_to(cfg)
    DOWN.add_to(cfg)
    cfg["providers"]["rt-blackhole"] = it.catalog_provider(_blackhole_port())
    it.ModelPool("RB-%d", 3, provider="rt-blackhole").add_to(cfg)
    return cfg


def _config_path():
    return it.catalog_file("retries", _catalog)


def _blackhole_port():
    """A loopback port where a connect never completes: a listener with a backlog of 0 whose one
    queue slot is taken by a connection nobody accepts, so that the kernel drops later SYNs."""
    if "bh" not in _S:
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(0)
        filler = socket.socket()
        filler.settimeout(2)
        try:
            filler.connect(ls.getsockname())
        except OSError:
            pass
        _S["bh"] = (ls, filler)
    return _S["bh"][0].getsockname()[1]


def _blackhole_works():
    """Does a connect to the blackhole port stay pending (this machine drops SYNs to a full queue)?"""
    c = socket.socket()
    c.setblocking(False)
    try:
        try:
            c.connect(("127.0.0.1", _blackhole_port()))
        except BlockingIOError:
            pass
        _, w, _ = select.select([], [c], [], 0.5)
        return not w
    finally:
        c.close()


# An attempt given up on is read on for its usage (README "Cost"); 3 s keeps such tests short.
_LTG = it.AuxSlot(lambda n: it.Aux("retries-%d" % n, config=_config_path(), args=("--meter-abandoned-seconds", "3")))


def rtest(name):
    """Register a test ("retries: " + name) that gets the dedicated ltg as its argument."""
    return _LTG.test("retries: " + name, "the retries ltg")


# ===== models, groups, calls ======================================================================

fresh = POOL.take                   # fresh(n): n models of the pool that no test used before
up = it.ModelPool.upstream          # the upstream name the mock sees for a pool alias


def group(a, models, fallbacks=None, retries=None):
    return it.provision(a, "retries", models, fallbacks, retries)


def script(alias, steps):
    it.H.mock_post("/_mock/script", {"model": up(alias), "steps": list(steps)})


def stats():
    return it.H.mock_stats()


def calls(alias, st=None):
    st = st or stats()
    return st.get("calls", {}).get(up(alias), 0)


def check_calls(expect, what):
    """expect: {alias: calls the mock saw for it}."""
    st = stats()
    got = {m: calls(m, st) for m in expect}
    check(got == expect, "%s: calls at the mock %r, want %r" % (what, got, expect))


def quiet(seconds):
    """Let `seconds` pass on purpose before check_calls() asserts that no MORE calls came (no late
    retry, no fallback): a negative check, which no condition can express. Every call it expects
    reached the mock before ltg answered (the mock counts a call when it arrives), so a slow
    machine can only make the check more lenient, never fail it."""
    time.sleep(seconds)


def times(alias):
    """The mock's t_ms of every call of this model, in order."""
    return [e["t_ms"] for e in stats().get("log", []) if e.get("model") == up(alias)]


def gaps(alias):
    t = times(alias)
    return [b - a for a, b in zip(t, t[1:])]


def call(a, g, model, **kw):
    """One inference request to ltg `a` with group g's key (or a token); see it.timed_call."""
    return it.timed_call(a.port, g.token if isinstance(g, it.Provisioned) else g, model, **kw)


def check_fail(r, status, attempts, expect, code="upstream_error", what="the answer"):
    """ltg's own failure answer: OpenAI-shaped, error.code, error.attempts as expected.
    expect: [(model, attempt, status, outcome) or (..., (ms_lo, ms_hi))]."""
    it.check_x_headers(r, status, attempts, what=what)
    check((r.header("content-type") or "").startswith("application/json"),
          "%s: Content-Type %r, want JSON" % (what, r.header("content-type")))
    e = it.check_openai_error(r, status, code)
    check_attempt_list(e.get("attempts"), expect, what + ": error.attempts")
    return e


def check_attempt_list(att, expect, what):
    check(isinstance(att, list), "%s: %r is not a list" % (what, att))
    brief = [(x.get("model"), x.get("attempt"), x.get("status"), x.get("outcome")) if isinstance(x, dict) else x
             for x in att]
    want = [tuple(x[:4]) for x in expect]
    # an expected status of None matches any
    brief = [(b[0], b[1], None if w[2] is None else b[2], b[3]) if isinstance(b, tuple) and len(b) == 4 else b
             for b, w in zip(brief, want)] + brief[len(want):]
    check(brief == want, "%s: %r, want %r" % (what, brief, want))
    for x, w in zip(att, expect):
        # "error" (why the attempt did not succeed) is ltg's addition to the API.md shape: on every
        # failed attempt, never on a success.
        fields = {"model", "deployment", "attempt", "status", "outcome", "ms", "span_id", "api"} | ({"error"} if x.get("outcome") != "ok" else set())
        # what the attempt was charged (README "Cost"); not yet in a live answer while it is metered
        fields |= it.ATTEMPT_BILL if set(x) & it.ATTEMPT_BILL else set()
        check(set(x) == fields, "%s: entry %r: fields must be exactly %s" % (what, x, ", ".join(sorted(fields))))
        # span_id: the span of the attempt's traceparent (README "Trace context"); none for a skip
        check(re.fullmatch(r"[0-9a-f]{16}", x["span_id"] or "") if x["outcome"] != "circuit_open" else x["span_id"] is None,
              "%s: entry %r: span_id" % (what, x))
        # "deployment" names the route the attempt took (API.md 9): provider/upstream_model, null
        # for a model skipped by its breakers.
        with open(_config_path()) as f:
            m = json.load(f)["models"].get(x["model"], {})
        want_dep = None if x["outcome"] == "circuit_open" else "%s/%s" % (m.get("provider"), m.get("upstream_model"))
        check(x["deployment"] == want_dep, "%s: entry %r: deployment %r, want %r" % (what, x, x["deployment"], want_dep))
        check(x.get("outcome") == "ok" or (isinstance(x["error"], str) and x["error"]),
              "%s: entry %r: error must say why" % (what, x))
        check(isinstance(x["ms"], int) and x["ms"] >= 0, "%s: entry %r: ms is not a whole number >= 0" % (what, x))
        if x["outcome"] == "circuit_open":
            check(x["status"] == 0 and x["ms"] == 0, "%s: a circuit_open entry has status 0 and ms 0: %r" % (what, x))
        if len(w) > 4:
            lo, hi = w[4]
            check(lo <= x["ms"] <= hi, "%s: entry %r: ms %d not within [%d, %d]" % (what, x, x["ms"], lo, hi))


ledger_event = it.ledger_event


def check_gaps(alias, want_ms, what, slack=450):
    """The gaps between the mock's calls of alias: each at least want (the backoff, or the
    Retry-After), at most want * 1.2 (jitter) + slack."""
    g = gaps(alias)
    check(len(g) == len(want_ms), "%s: %d gaps between calls at the mock (%r), want %d" % (what, len(g), g, len(want_ms)))
    for i, (got, w) in enumerate(zip(g, want_ms)):
        check(got >= w - 5, "%s: gap %d before attempt %d is %d ms, shorter than %d ms (all gaps %r)"
              % (what, i + 1, i + 2, got, w, g))
        check(got <= w * 1.2 + slack, "%s: gap %d before attempt %d is %d ms, longer than %d ms + 20%% jitter + %d ms "
              "slack (all gaps %r)" % (what, i + 1, i + 2, got, w, slack, g))
    return g


def content_of(r):
    return r.json()["choices"][0]["message"]["content"]


def check_served_body(r, alias, what):
    check(content_of(r) == "Hello from %s." % up(alias), "%s: the body is not %s's answer: %r"
          % (what, alias, r.body[:200]))


# ===== the classic scenarios ======================================================================

@rtest("healthy primary: one call, served by it, x-ltg-attempts 1 (stream too)")
def t_rt_healthy(a):
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
    r = call(a, g, A)
    it.check_x_headers(r, 200, 1, A, "non-stream")
    check_served_body(r, A, "non-stream")
    r = call(a, g, A, stream=True)
    it.check_x_headers(r, 200, 1, A, "stream")
    it.check_whole_stream(r, up(A), "stream")
    check_calls({A: 2, B: 0}, "healthy primary")
    e = ledger_event(a, g, r.header("x-ltg-request-id"))
    check_attempt_list(e.get("attempt_log"), [(A, 1, 200, "ok")], "the ledger's attempt_log")


# The classic scenarios, one row each: the group's retries, what the mock answers A and B in turn,
# the request's headers; then what the client must see (status, x-ltg-attempts, the model that
# served), the attempt log (the ledger's), the calls each model got, and at most how long it took.
SCENARIOS = [
    ("429 then ok: the same model again, x-ltg-attempts 2", {"max_attempts": 3, "retry_delay_ms": 50},
     {"A": ["status=429", "ok"]}, {}, 200, 2, "A", [("A", 1, 429, "no_work"), ("A", 2, 200, "ok")], {"A": 2, "B": 0}, None),
    ("primary 503 with a healthy fallback: the primary called once, served by the fallback", {"max_attempts": 3, "retry_delay_ms": 0},
     {"A": ["status=503", "ok", "ok"]}, {}, 200, 2, "B", [("A", 1, 503, "indeterminate"), ("B", 1, 200, "ok")], {"A": 1, "B": 1}, None),
    ("unknown model (404 at the provider): the fallback serves", {"max_attempts": 3, "retry_delay_ms": 0},
     {"A": ["status=404", "ok", "ok"]}, {}, 200, 2, "B", [("A", 1, 404, "unknown_model"), ("B", 1, 200, "ok")], {"A": 1, "B": 1}, None),
    ("slow primary, tight x-ltg-request-timeout: the fallback serves, the primary is not retried",
     {"max_attempts": 3, "retry_delay_ms": 0}, {"A": ["head_delay_ms=5000", "ok", "ok"]}, {"x-ltg-request-timeout": "500"},
     200, 2, "B", [("A", 1, 0, "indeterminate", (400, 4000)), ("B", 1, 200, "ok")], {"A": 1, "B": 1}, 4.0),
]


def scenario(row):
    name, policy, scripts, headers, status, attempts, served, want_log, want_calls, max_s = row

    @rtest(name)
    def run(a):
        A, B = fresh(2)
        names = {"A": A, "B": B}
        g = group(a, [A, B], {A: [B]}, policy)
        for k, steps in scripts.items():
            script(names[k], steps)       # a later step would succeed: a call the plan forbids shows
        r = call(a, g, A, headers=headers)
        it.check_x_headers(r, status, attempts, names.get(served))
        if served:
            check_served_body(r, names[served], name)
        check(max_s is None or r.elapsed < max_s, "%s: the answer took %.1f s (at most %.1f)" % (name, r.elapsed, max_s or 0))
        check_calls({names[k]: n for k, n in want_calls.items()}, name)
        e = ledger_event(a, g, r.header("x-ltg-request-id"))
        check_attempt_list(e.get("attempt_log"), [(names[x[0]],) + tuple(x[1:]) for x in want_log], "the ledger's attempt_log")
        check(e.get("model") == names.get(served) and e.get("requested_model") == A and e.get("attempts") == attempts,
              "the spend event: model %r requested_model %r attempts %r" % (e.get("model"), e.get("requested_model"), e.get("attempts")))


for _row in SCENARIOS:
    scenario(_row)


@rtest("every model down: the status of the last failure, error.attempts lists every attempt")
def t_rt_all_down(a):
    A, B, C = fresh(3)
    g = group(a, [A, B, C], {A: [B, C]}, {"max_attempts": 2, "retry_delay_ms": 0})
    script(A, ["status=503"])
    script(B, ["status=500"])
    script(C, ["status=429", "status=429"])
    r = call(a, g, A)
    e = check_fail(r, 429, 4, [(A, 1, 503, "indeterminate"), (B, 1, 500, "indeterminate"),
                               (C, 1, 429, "no_work"), (C, 2, 429, "no_work")])
    check(C in e["message"] and "429" in e["message"], "error.message should name the last reason (%s, 429): %r"
          % (C, e["message"]))
    check_calls({A: 1, B: 1, C: 2}, "all down")
    ev = ledger_event(a, g, r.header("x-ltg-request-id"))
    check(ev.get("attempt_log") == e["attempts"], "the ledger's attempt_log %r differs from error.attempts %r"
          % (ev.get("attempt_log"), e["attempts"]))
    check(ev.get("status") == "failed" and ev.get("http_status") == 429 and ev.get("model") is None,
          "the spend event: status %r http_status %r model %r" % (ev.get("status"), ev.get("http_status"), ev.get("model")))

    # The last failure a connection failure: 502.
    A, = fresh(1)
    D = DOWN.take_one()
    g = group(a, [A, D], {A: [D]}, {"max_attempts": 1})
    script(A, ["status=503"])
    r = call(a, g, A)
    check_fail(r, 502, 2, [(A, 1, 503, "indeterminate"), (D, 1, 0, "no_work")], what="last failure refused")
    check_calls({A: 1}, "last failure refused")

    # The last failure a timeout: 504.
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]}, {"max_attempts": 1, "request_timeout_ms": 500})
    script(A, ["status=502"])
    script(B, ["head_delay_ms=4000"])
    r = call(a, g, A)
    check_fail(r, 504, 2, [(A, 1, 502, "indeterminate"), (B, 1, 0, "indeterminate", (400, 3000))],
               what="last failure a timeout")
    check(r.elapsed < 3.5, "last failure a timeout: answered after %.1f s, the timeout is 0.5 s" % r.elapsed)
    check_calls({A: 1, B: 1}, "last failure a timeout")


@rtest("upstream 401: one call, no fallback, the provider's 401 relayed")
def t_rt_401(a):
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
    script(A, ["status=401", "ok", "ok"])
    r = call(a, g, A)
    it.check_x_headers(r, 401, 1)
    e = it.check_openai_error(r, 401, "invalid_api_key")
    check(e["message"] == "mock error 401" and "attempts" not in e,
          "a terminal answer is the provider's own, relayed as it is: %r" % r.body[:300])
    check_calls({A: 1, B: 0}, "upstream 401")


# ===== every row of the outcome table =============================================================

@rtest("outcome no_work: 429 and 529 retried on the same model while attempts remain, then the next")
def t_rt_no_work(a):
    for s in (429, 529):
        A, B = fresh(2)
        g = group(a, [A, B], {A: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
        script(A, ["status=%d" % s] * 3 + ["ok"])
        script(B, ["status=503"])
        r = call(a, g, A)
        check_fail(r, 503, 4, [(A, 1, s, "no_work"), (A, 2, s, "no_work"), (A, 3, s, "no_work"),
                               (B, 1, 503, "indeterminate")], what="%d x3 then 503" % s)
        check_calls({A: 3, B: 1}, "%d x3 then 503" % s)
        # And a retry that works: the same model serves.
        A, B = fresh(2)
        g = group(a, [A, B], {A: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
        script(A, ["status=%d" % s, "status=%d" % s, "ok"])
        r = call(a, g, A)
        it.check_x_headers(r, 200, 3, A, "%d x2 then ok" % s)
        check_calls({A: 3, B: 0}, "%d x2 then ok" % s)


@rtest("outcome indeterminate: 408, 500, 501, 502, 503, 504, reset -> the next model, never the same again")
def t_rt_indeterminate(a):
    for d, st in (("status=408", 408), ("status=500", 500), ("status=501", 501), ("status=502", 502),
                  ("status=503", 503), ("status=504", 504), ("reset", 0)):
        A, B = fresh(2)
        g = group(a, [A, B], {A: [B]}, {"max_attempts": 5, "retry_delay_ms": 0})
        script(A, [d, "ok", "ok", "ok", "ok"])     # a retry of A would succeed: none may be made
        script(B, ["status=503"])
        r = call(a, g, A)
        check_fail(r, 503, 2, [(A, 1, st, "indeterminate"), (B, 1, 503, "indeterminate")], what=d)
        quiet(0.05)     # no late retry of A
        check_calls({A: 1, B: 1}, d)
    # A timeout with max_attempts 5 and no fallback: one call, 504.
    A, = fresh(1)
    g = group(a, [A], None, {"max_attempts": 5, "retry_delay_ms": 0, "request_timeout_ms": 300})
    script(A, ["head_delay_ms=3000", "ok", "ok", "ok", "ok"])
    r = call(a, g, A)
    check_fail(r, 504, 1, [(A, 1, 0, "indeterminate")], what="timeout, max_attempts 5")
    check_calls({A: 1}, "timeout, max_attempts 5")


@rtest("outcome no_work: connection refused retried on the same model up to max_attempts, then the next")
def t_rt_refused(a):
    D = DOWN.take_one()
    B, = fresh(1)
    g = group(a, [D, B], {D: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
    script(B, ["status=503"])
    r = call(a, g, D)
    check_fail(r, 503, 4, [(D, 1, 0, "no_work"), (D, 2, 0, "no_work"), (D, 3, 0, "no_work"),
                           (B, 1, 503, "indeterminate")], what="refused x3 then 503")
    check_calls({B: 1}, "refused x3 then 503")
    # Then a healthy fallback serves.
    D = DOWN.take_one()
    B, = fresh(1)
    g = group(a, [D, B], {D: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
    r = call(a, g, D)
    it.check_x_headers(r, 200, 4, B, "refused x3 then ok")
    check_calls({B: 1}, "refused x3 then ok")
    e = ledger_event(a, g, r.header("x-ltg-request-id"))
    check_attempt_list(e.get("attempt_log"), [(D, 1, 0, "no_work"), (D, 2, 0, "no_work"), (D, 3, 0, "no_work"),
                                              (B, 1, 200, "ok")], "the ledger's attempt_log")
    # Alone: 502, a connection failure.
    D = DOWN.take_one()
    g = group(a, [D], None, {"max_attempts": 2, "retry_delay_ms": 0})
    r = call(a, g, D)
    check_fail(r, 502, 2, [(D, 1, 0, "no_work"), (D, 2, 0, "no_work")], what="refused alone")


@rtest("outcome no_work: a request timeout before anything was sent (the connect never completes) -> same model again")
def t_rt_connect_timeout(a):
    # README, choices: "Request timeout without a byte sent (still resolving or connecting) counts as
    # no_work: nothing reached the provider, so the same model may be tried again."
    if not _blackhole_works():
        raise it.TestSkip("a connect to a full listen queue completes on this machine: no blackhole port")
    BH = "RB-1"
    B, = fresh(1)
    g = group(a, [BH, B], {BH: [B]}, {"max_attempts": 2, "retry_delay_ms": 0, "request_timeout_ms": 300})
    r = call(a, g, BH)
    it.check_x_headers(r, 200, 3, B)
    check(r.elapsed < 4.0, "answered after %.2f s (two timeouts of 0.3 s, then the fallback)" % r.elapsed)
    check_calls({B: 1}, "connect timeouts")
    e = ledger_event(a, g, r.header("x-ltg-request-id"))
    check_attempt_list(e.get("attempt_log"), [("RB-1", 1, 0, "no_work", (250, 3000)), ("RB-1", 2, 0, "no_work", (250, 3000)),
                                              (B, 1, 200, "ok")], "the ledger's attempt_log")


@rtest("outcome terminal: context length exceeded (400 and 413) relayed, one call, no fallback")
def t_rt_context_length(a):
    for d, st in (("context_length", 400), ("status=413 context_length", 413)):
        A, B = fresh(2)
        g = group(a, [A, B], {A: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
        script(A, [d, "ok", "ok"])
        r = call(a, g, A)
        it.check_x_headers(r, st, 1, what=d)
        e = it.check_openai_error(r, st, "context_length_exceeded")
        check("maximum context length" in e["message"] and "attempts" not in e,
              "%s: the provider's answer should be relayed as it is: %r" % (d, r.body[:300]))
        quiet(0.05)     # no late retry, no fallback
        check_calls({A: 1, B: 0}, d)


@rtest("outcome terminal: 400, 403, 409, 422 relayed, one call, no fallback")
def t_rt_terminal(a):
    codes = {400: "invalid_request", 403: "permission_denied", 409: "mock_error", 422: "mock_error"}
    for st, code in codes.items():
        for stream in (False, True):
            what = "%d%s" % (st, " (stream)" if stream else "")
            A, B = fresh(2)
            g = group(a, [A, B], {A: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
            script(A, ["status=%d" % st, "ok", "ok"])     # a retry of A would succeed: none may be made
            r = call(a, g, A, stream=stream)
            it.check_x_headers(r, st, 1, what=what)
            e = it.check_openai_error(r, st, code)
            check(e["message"] == "mock error %d" % st and "attempts" not in e,
                  "%s: the provider's answer should be relayed as it is: %r" % (what, r.body[:300]))
            quiet(0.05)     # no late retry, no fallback
            check_calls({A: 1, B: 0}, what)


@rtest("outcome unknown_model: 404 -> the next model, never the same again")
def t_rt_unknown_model(a):
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
    script(A, ["status=404", "ok", "ok"])
    script(B, ["status=503"])
    r = call(a, g, A)
    check_fail(r, 503, 2, [(A, 1, 404, "unknown_model"), (B, 1, 503, "indeterminate")])
    check_calls({A: 1, B: 1}, "404 then 503")
    # Alone: the provider's 404 is the last failure.
    A, = fresh(1)
    g = group(a, [A], None, {"max_attempts": 3, "retry_delay_ms": 0})
    script(A, ["status=404", "ok"])
    r = call(a, g, A)
    check_fail(r, 404, 1, [(A, 1, 404, "unknown_model")], what="404 alone")
    check_calls({A: 1}, "404 alone")


# ===== timing =====================================================================================

@rtest("backoff constant, linear, exponential: the gaps between calls at the provider")
def t_rt_backoff(a):
    base = 300
    for mode, mult in (("constant", (1, 1, 1)), ("linear", (1, 2, 3)), ("exponential", (1, 2, 4))):
        A, = fresh(1)
        g = group(a, [A], None, {"max_attempts": 4, "retry_delay_ms": base, "backoff": mode})
        script(A, ["status=429"] * 3 + ["ok"])
        r = call(a, g, A)
        it.check_x_headers(r, 200, 4, A, mode)
        check_calls({A: 4}, mode)
        check_gaps(A, [base * m for m in mult], mode)


@rtest("backoff is capped at 10 s (retry_delay_ms 60000)")
def t_rt_backoff_cap(a):
    A, = fresh(1)
    g = group(a, [A], None, {"max_attempts": 2, "retry_delay_ms": 60000, "backoff": "constant"})
    script(A, ["status=529", "ok"])
    r = call(a, g, A, timeout=40)
    it.check_x_headers(r, 200, 2, A)
    check_calls({A: 2}, "capped backoff")
    g = gaps(A)
    check(len(g) == 1 and 9995 <= g[0] <= 10000 + 800,
          "the gap between the calls is %r ms, want 10 s (the cap, jitter included)" % g)


@rtest("Retry-After (seconds) replaces the backoff, longer or shorter; a 503's is no reason to retry")
def t_rt_retry_after(a):
    # Longer than the backoff (0): waited.
    A, = fresh(1)
    g = group(a, [A], None, {"max_attempts": 2, "retry_delay_ms": 0, "backoff": "constant"})
    script(A, ["status=429 retry_after=1", "ok"])
    r = call(a, g, A)
    it.check_x_headers(r, 200, 2, A, "Retry-After 1, delay 0")
    check_calls({A: 2}, "Retry-After 1, delay 0")
    check_gaps(A, [1000], "Retry-After 1, delay 0", slack=600)
    # Shorter than the backoff (3000): replaces it.
    A, = fresh(1)
    g = group(a, [A], None, {"max_attempts": 2, "retry_delay_ms": 3000, "backoff": "constant"})
    script(A, ["status=529 retry_after=1", "ok"])
    r = call(a, g, A)
    it.check_x_headers(r, 200, 2, A, "Retry-After 1, delay 3000")
    gp = gaps(A)
    check(len(gp) == 1 and 995 <= gp[0] < 2500, "Retry-After 1 with a backoff of 3 s: gap %r ms, want ~1000" % gp)
    # Retry-After: 0 with a backoff of 2000: at once.
    A, = fresh(1)
    g = group(a, [A], None, {"max_attempts": 2, "retry_delay_ms": 2000, "backoff": "constant"})
    script(A, ["status=429 retry_after=0", "ok"])
    r = call(a, g, A)
    it.check_x_headers(r, 200, 2, A, "Retry-After 0, delay 2000")
    gp = gaps(A)
    check(len(gp) == 1 and gp[0] < 1000, "Retry-After 0 with a backoff of 2 s: gap %r ms, want ~0" % gp)
    # A 503 with Retry-After is still indeterminate: no second call.
    A, = fresh(1)
    g = group(a, [A], None, {"max_attempts": 3, "retry_delay_ms": 0})
    script(A, ["status=503 retry_after=1", "ok"])
    r = call(a, g, A)
    check_fail(r, 503, 1, [(A, 1, 503, "indeterminate")], what="503 with Retry-After")
    quiet(1.3)      # past the Retry-After of 1 s: still no second call
    check_calls({A: 1}, "503 with Retry-After")


@rtest("deadline: a hanging provider -> 504 deadline_exceeded at the deadline, the attempt listed")
def t_rt_deadline_hang(a):
    A, = fresh(1)
    g = group(a, [A], None, {"max_attempts": 3, "retry_delay_ms": 0})
    script(A, ["hang"])
    r = call(a, g, A, headers={"x-ltg-deadline": "1500"})
    check_fail(r, 504, 1, [(A, 1, 0, "indeterminate", (1300, 4000))], code="deadline_exceeded", what="hang")
    check(1.4 <= r.elapsed <= 4.0, "hang: answered after %.2f s, the deadline is 1.5 s" % r.elapsed)
    quiet(0.2)      # no retry after the deadline
    check_calls({A: 1}, "hang")
    # A stream whose first event never comes in time.
    A, = fresh(1)
    g = group(a, [A], None, {"max_attempts": 3, "retry_delay_ms": 0})
    script(A, ["first_event_delay_ms=6000"])
    r = call(a, g, A, stream=True, headers={"x-ltg-deadline": "1500"})
    # (its status: the head came (200) but no event; either 200 or 0 is fair, so not checked)
    check_fail(r, 504, 1, [(A, 1, None, "indeterminate", (1300, 4000))], code="deadline_exceeded",
               what="stream, late first event")
    check(1.4 <= r.elapsed <= 4.0, "stream: answered after %.2f s, the deadline is 1.5 s" % r.elapsed)
    check_calls({A: 1}, "stream, late first event")


@rtest("deadline: a group's retries.deadline_ms is the default; x-ltg-deadline still overrides it")
def t_rt_deadline_group(a):
    A, = fresh(1)
    g = group(a, [A], None, {"max_attempts": 1, "deadline_ms": 1500})
    script(A, ["head_delay_ms=6000"])
    r = call(a, g, A)
    check_fail(r, 504, 1, [(A, 1, 0, "indeterminate", (1300, 4000))], code="deadline_exceeded", what="the group's deadline")
    check(1.4 <= r.elapsed <= 4.0, "answered after %.2f s, the group's deadline is 1.5 s" % r.elapsed)
    script(A, ["head_delay_ms=2500"])
    r = call(a, g, A, headers={"x-ltg-deadline": "8000"})
    it.check_x_headers(r, 200, 1, A, "x-ltg-deadline over the group's deadline")


@rtest("defaults for long calls: 35 s to the answer's head is served (the deadline is 600 s); a keep-alive idle 95 s is kept")
def t_rt_long_call(a):
    A, = fresh(1)
    g = group(a, [A])
    with it.Conn(a.port, timeout=200) as idle:
        idle.send(it.http_request("GET", "/v1/models", auth=g.token))
        check(idle.read_final_response(15).status == 200, "the first request of the idle connection")
        t0 = time.monotonic()
        script(A, ["head_delay_ms=35000"])
        r = call(a, g, A, timeout=120)
        it.check_x_headers(r, 200, 1, A, "a provider that takes 35 s")
        # Time passes on purpose: the connection must stay idle for 95 s (the Codex-style pool
        # reuses a connection idle 90 s; ltg's default idle timeout is 120 s).
        time.sleep(max(0.0, 95 - (time.monotonic() - t0)))
        idle.send(it.http_request("GET", "/v1/models", auth=g.token))
        check(idle.read_final_response(15).status == 200, "the connection idle for 95 s was closed (the default is 120 s)")


@rtest("deadline cuts a long plan short: timeouts, then the deadline; later models never called")
def t_rt_deadline_plan(a):
    A, B, C = fresh(3)
    g = group(a, [A, B, C], {A: [B, C]}, {"max_attempts": 3, "retry_delay_ms": 0, "request_timeout_ms": 1000})
    script(A, ["hang"])
    script(B, ["hang"])
    r = call(a, g, A, headers={"x-ltg-deadline": "1600"})
    check_fail(r, 504, 2, [(A, 1, 0, "indeterminate", (900, 2500)), (B, 1, 0, "indeterminate", (100, 2000))],
               code="deadline_exceeded")
    check(1.5 <= r.elapsed <= 4.0, "answered after %.2f s, the deadline is 1.6 s" % r.elapsed)
    quiet(0.2)      # C is never called, not even late
    check_calls({A: 1, B: 1, C: 0}, "deadline over a plan of three")


@rtest("deadline: a retry whose wait would pass it is not made: the next model at once (Retry-After, backoff)")
def t_rt_deadline_retry(a):
    # Retry-After 5 s, deadline 2.5 s: the plan moves on to the fallback at once.
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
    script(A, ["status=429 retry_after=5", "ok"])
    r = call(a, g, A, headers={"x-ltg-deadline": "2500"})
    it.check_x_headers(r, 200, 2, B, "Retry-After past the deadline")
    check(r.elapsed < 1.5, "Retry-After past the deadline: the fallback answered after %.2f s, want at once" % r.elapsed)
    check_calls({A: 1, B: 1}, "Retry-After past the deadline")
    # A backoff of 5 s, deadline 2.5 s: the same.
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]}, {"max_attempts": 3, "retry_delay_ms": 5000, "backoff": "constant"})
    script(A, ["status=429", "ok"])
    r = call(a, g, A, headers={"x-ltg-deadline": "2500"})
    it.check_x_headers(r, 200, 2, B, "backoff past the deadline")
    check(r.elapsed < 1.5, "backoff past the deadline: the fallback answered after %.2f s, want at once" % r.elapsed)
    check_calls({A: 1, B: 1}, "backoff past the deadline")


@rtest("deadline: a retry past it with no model left -> 504 deadline_exceeded at once")
def t_rt_deadline_retry_last(a):
    # README: "A retry past the deadline is skipped and the plan moves to the next model at once
    # (which may still answer in time); only when nothing can start before the deadline is the
    # answer 504." API.md 4.3: "an attempt whose start (after its delay) would fall after the
    # deadline is not made [...] The client then gets 504 deadline_exceeded at once, not later."
    problems = []
    for what, retries, steps in (
            ("Retry-After 5 s, deadline 2.5 s", {"max_attempts": 3, "retry_delay_ms": 0}, ["status=429 retry_after=5", "ok"]),
            ("backoff 5 s, deadline 2.5 s", {"max_attempts": 3, "retry_delay_ms": 5000, "backoff": "constant"},
             ["status=429", "ok"])):
        A, = fresh(1)
        g = group(a, [A], None, retries)
        script(A, steps)
        r = call(a, g, A, headers={"x-ltg-deadline": "2500"})
        check(r.elapsed < 1.5, "%s: answered after %.2f s, want at once (not at the deadline, not after the wait)"
              % (what, r.elapsed))
        quiet(0.3)      # the skipped retry is not made late either
        check_calls({A: 1}, what)
        try:
            check_fail(r, 504, 1, [(A, 1, 429, "no_work")], code="deadline_exceeded", what=what)
        except it.TestFailure as e:
            problems.append(str(e))
    check(not problems, "; ".join(problems))


# ===== per-request overrides ======================================================================

@rtest("override x-ltg-max-attempts changes the attempts per model")
def t_rt_ov_max_attempts(a):
    A1, A2, A3, A4 = fresh(4)
    g = group(a, [A1, A2, A3, A4], None, {"max_attempts": 1, "retry_delay_ms": 0})
    script(A1, ["status=429", "ok"])
    r = call(a, g, A1)
    check_fail(r, 429, 1, [(A1, 1, 429, "no_work")], what="group's max_attempts 1")
    script(A2, ["status=429", "ok"])
    r = call(a, g, A2, headers={"x-ltg-max-attempts": "2"})
    it.check_x_headers(r, 200, 2, A2, "x-ltg-max-attempts 2")
    script(A3, ["status=429"] * 4 + ["ok"])
    r = call(a, g, A3, headers={"x-ltg-max-attempts": "5"})
    it.check_x_headers(r, 200, 5, A3, "x-ltg-max-attempts 5")
    check_calls({A1: 1, A2: 2, A3: 5}, "x-ltg-max-attempts")
    # Lower than the group's.
    g = group(a, [A4], None, {"max_attempts": 4, "retry_delay_ms": 0})
    script(A4, ["status=429", "ok"])
    r = call(a, g, A4, headers={"x-ltg-max-attempts": "1"})
    check_fail(r, 429, 1, [(A4, 1, 429, "no_work")], what="x-ltg-max-attempts 1 on a group of 4")
    check_calls({A4: 1}, "x-ltg-max-attempts 1 on a group of 4")


@rtest("override x-ltg-retry-delay changes the backoff base")
def t_rt_ov_retry_delay(a):
    A, B = fresh(2)
    g = group(a, [A, B], None, {"max_attempts": 2, "retry_delay_ms": 0, "backoff": "constant"})
    script(A, ["status=429", "ok"])
    r = call(a, g, A, headers={"x-ltg-retry-delay": "800"})
    it.check_x_headers(r, 200, 2, A, "x-ltg-retry-delay 800")
    check_gaps(A, [800], "x-ltg-retry-delay 800 on a group of 0")
    script(B, ["status=429", "ok"])
    r = call(a, g, B)
    it.check_x_headers(r, 200, 2, B, "the group's delay 0")
    gb = gaps(B)
    check(len(gb) == 1 and gb[0] < 600, "the group's delay 0: gap %r ms" % gb)
    C, = fresh(1)
    g = group(a, [C], None, {"max_attempts": 2, "retry_delay_ms": 4000, "backoff": "constant"})
    script(C, ["status=429", "ok"])
    r = call(a, g, C, headers={"x-ltg-retry-delay": "0"})
    it.check_x_headers(r, 200, 2, C, "x-ltg-retry-delay 0")
    gc = gaps(C)
    check(len(gc) == 1 and gc[0] < 1500, "x-ltg-retry-delay 0 on a group of 4000: gap %r ms" % gc)


@rtest("override x-ltg-backoff changes the backoff shape")
def t_rt_ov_backoff(a):
    A, B, C = fresh(3)
    g = group(a, [A, B, C], None, {"max_attempts": 4, "retry_delay_ms": 300, "backoff": "constant"})
    script(A, ["status=429"] * 3 + ["ok"])
    r = call(a, g, A, headers={"x-ltg-backoff": "linear"})
    it.check_x_headers(r, 200, 4, A, "x-ltg-backoff linear")
    check_gaps(A, [300, 600, 900], "x-ltg-backoff linear")
    script(B, ["status=429"] * 3 + ["ok"])
    r = call(a, g, B, headers={"x-ltg-backoff": "exponential"})
    it.check_x_headers(r, 200, 4, B, "x-ltg-backoff exponential")
    check_gaps(B, [300, 600, 1200], "x-ltg-backoff exponential")
    script(C, ["status=429"] * 3 + ["ok"])
    r = call(a, g, C)
    it.check_x_headers(r, 200, 4, C, "the group's constant")
    check_gaps(C, [300, 300, 300], "the group's constant")


@rtest("override x-ltg-request-timeout bounds each attempt")
def t_rt_ov_request_timeout(a):
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]}, {"max_attempts": 1})
    script(A, ["head_delay_ms=3000"])
    r = call(a, g, A, headers={"x-ltg-request-timeout": "500"})
    it.check_x_headers(r, 200, 2, B, "x-ltg-request-timeout 500")
    check(r.elapsed < 2.5, "x-ltg-request-timeout 500: answered after %.2f s" % r.elapsed)
    check_calls({A: 1, B: 1}, "x-ltg-request-timeout 500")
    # Without it (the group has none) the slow answer is waited for.
    script(A, ["head_delay_ms=1500"])
    r = call(a, g, A)
    it.check_x_headers(r, 200, 1, A, "no request timeout")
    check(r.elapsed >= 1.4, "no request timeout: answered after %.2f s, before the provider's 1.5 s" % r.elapsed)
    check_calls({A: 2, B: 1}, "no request timeout")
    # Longer than the group's: the group's 500 ms would cut a 1.5 s answer.
    C, D = fresh(2)
    g = group(a, [C, D], {C: [D]}, {"max_attempts": 1, "request_timeout_ms": 500})
    script(C, ["head_delay_ms=1500"])
    r = call(a, g, C, headers={"x-ltg-request-timeout": "10000"})
    it.check_x_headers(r, 200, 1, C, "x-ltg-request-timeout 10000 on a group of 500")
    check_calls({C: 1, D: 0}, "x-ltg-request-timeout 10000 on a group of 500")


@rtest("override x-ltg-deadline bounds the whole request")
def t_rt_ov_deadline(a):
    A, B = fresh(2)
    g = group(a, [A, B], None, {"max_attempts": 1})
    script(A, ["head_delay_ms=4000"])
    r = call(a, g, A, headers={"x-ltg-deadline": "800"})
    check_fail(r, 504, 1, [(A, 1, 0, "indeterminate", (700, 3000))], code="deadline_exceeded", what="x-ltg-deadline 800")
    check(0.75 <= r.elapsed <= 3.0, "x-ltg-deadline 800: answered after %.2f s" % r.elapsed)
    script(B, ["head_delay_ms=1000"])
    r = call(a, g, B, headers={"x-ltg-deadline": "5000"})
    it.check_x_headers(r, 200, 1, B, "x-ltg-deadline 5000, answer after 1 s")
    check_calls({A: 1, B: 1}, "x-ltg-deadline")


@rtest("overrides out of range or not a number -> 400 invalid_request naming the header; bounds accepted")
def t_rt_ov_invalid(a):
    A, = fresh(1)
    g = group(a, [A], None, {"max_attempts": 1})
    bad = {
        "x-ltg-max-attempts": ["0", "6", "-1", "abc", "", "2.5", "99999999999999999999"],
        "x-ltg-retry-delay": ["-1", "60001", "abc", "1.5", ""],
        "x-ltg-request-timeout": ["99", "600001", "0", "abc", "-100"],
        "x-ltg-deadline": ["99", "3600001", "0", "fast", "1e3"],
        "x-ltg-backoff": ["quadratic", "", "1", "constant,linear"],
    }
    for h, values in bad.items():
        for v in values:
            for stream in (False, True):
                what = "%s: %r%s" % (h, v, " (stream)" if stream else "")
                r = call(a, g, A, stream=stream, headers={h: v})
                it.check_x_headers(r, 400, 0, what=what)
                e = it.check_openai_error(r, 400, "invalid_request")
                check(h in e["message"].lower(), "%s: error.message does not name the header: %r" % (what, e["message"]))
    check_calls({A: 0}, "invalid overrides (nothing may reach the provider)")
    good = {
        "x-ltg-max-attempts": ["1", "5"],
        "x-ltg-retry-delay": ["0", "60000"],
        "x-ltg-request-timeout": ["100", "600000"],
        "x-ltg-deadline": ["3600000"],
        "x-ltg-backoff": ["constant", "linear", "exponential"],
    }
    n = 0
    for h, values in good.items():
        for v in values:
            r = call(a, g, A, headers={h: v})
            it.check_x_headers(r, 200, 1, A, "%s: %s (in range)" % (h, v))
            n += 1
    r = call(a, g, A, headers={"x-ltg-deadline": "100"})
    check(r.status in (200, 504), "x-ltg-deadline: 100 (in range): %s" % r.brief())
    check_calls({A: n + 1}, "overrides in range")
    # Header names are case-insensitive, and the blanks around a value are not part of it.
    B, = fresh(1)
    g = group(a, [B], None, {"max_attempts": 1, "retry_delay_ms": 0})
    script(B, ["status=429", "status=429", "ok"])
    r = call(a, g, B, headers={"X-LTG-Max-Attempts": "3"})
    it.check_x_headers(r, 200, 3, B, "X-LTG-Max-Attempts: 3")
    script(B, ["status=429", "ok"])
    r = call(a, g, B, headers={"x-ltg-max-attempts": " 2  "})
    it.check_x_headers(r, 200, 2, B, "x-ltg-max-attempts with blanks around the value")
    check_calls({B: 5}, "header case and blanks")


# ===== streaming failover =========================================================================

@rtest("stream failover: a primary whose first event is too late -> the fallback's whole stream (seed demo)")
def t_rt_stream_seed_demo(a):
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]})
    script(A, ["first_event_delay_ms=3000"])
    r = call(a, g, A, stream=True, headers={"x-ltg-request-timeout": "1000", "x-ltg-max-attempts": "1"})
    it.check_x_headers(r, 200, 2, B)
    it.check_whole_stream(r, up(B), "the fallback's stream")
    check(r.elapsed < 2.9, "the stream was served after %.2f s: the primary's first event (3 s) was waited for"
          % r.elapsed)
    check_calls({A: 1, B: 1}, "seed demo")
    e = ledger_event(a, g, r.header("x-ltg-request-id"))
    att = e.get("attempt_log") or []
    check([(x.get("model"), x.get("attempt"), x.get("outcome")) for x in att]
          == [(A, 1, "indeterminate"), (B, 1, "ok")], "the ledger's attempt_log: %r" % att)


@rtest("stream failover before the first byte: a 503, or a stream that ends before its first event")
def t_rt_stream_failover(a):
    for d in ("status=503", "cut_after=0", "reset"):
        A, B = fresh(2)
        g = group(a, [A, B], {A: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
        script(A, [d, "ok", "ok"])
        r = call(a, g, A, stream=True)
        it.check_x_headers(r, 200, 2, B, d)
        it.check_whole_stream(r, up(B), d)
        check_calls({A: 1, B: 1}, d)
    # Every attempt failing before the first byte: an ordinary JSON error with every attempt.
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]}, {"max_attempts": 2, "retry_delay_ms": 0})
    script(A, ["status=429", "status=429"])
    script(B, ["status=502"])
    r = call(a, g, A, stream=True)
    check_fail(r, 502, 3, [(A, 1, 429, "no_work"), (A, 2, 429, "no_work"), (B, 1, 502, "indeterminate")],
               what="stream, every attempt failed")
    check_calls({A: 2, B: 1}, "stream, every attempt failed")


@rtest("stream cut after its first event: stream_interrupted error event, no [DONE], no failover")
def t_rt_stream_cut(a):
    A, B = fresh(2)
    g = group(a, [A, B], {A: [B]}, {"max_attempts": 3, "retry_delay_ms": 0})
    script(A, ["cut_after=1", "ok", "ok"])
    r = call(a, g, A, stream=True)
    it.check_x_headers(r, 200, 1, A)
    check((r.header("content-type") or "").startswith("text/event-stream"), "Content-Type %r" % r.header("content-type"))
    datas = it.sse_datas(r)
    check("[DONE]" not in datas, "a cut stream must not carry [DONE]: %r" % datas)
    check(len(datas) == 2, "want the one event sent before the cut and the error event, got %r" % datas)
    first = json.loads(datas[0])
    check(first.get("model") == up(A) and first["choices"][0]["delta"].get("content"),
          "the first event should be A's content: %r" % datas[0])
    last = json.loads(datas[-1])
    err = last.get("error") if isinstance(last, dict) else None
    check(isinstance(err, dict) and err.get("code") == "stream_interrupted" and err.get("type") == "upstream_error"
          and isinstance(err.get("message"), str) and err["message"],
          "the last event should be {\"error\":{message, type upstream_error, code stream_interrupted}}: %r" % datas[-1])
    quiet(0.5)      # no failover after the cut, not even late
    check_calls({A: 1, B: 0}, "cut stream")
    e = ledger_event(a, g, r.header("x-ltg-request-id"))
    check(e.get("status") == "partial" and e.get("http_status") == 200 and e.get("model") == A,
          "the spend event of a cut stream: status %r http_status %r model %r"
          % (e.get("status"), e.get("http_status"), e.get("model")))


# ===== circuit breaker ============================================================================

def breaker_open(a, alias):
    """ltg_circuit_open of alias (one deployment) on ltg a's /metrics: is its breaker open?"""
    r = it.one_request(a.admin_port, "GET", "/metrics", auth=None, timeout=30)
    check(r.status == 200, "GET /metrics: %s" % r.brief())
    m = re.search(r'^ltg_circuit_open\{model="%s",[^}]*\} (\S+)$' % re.escape(alias), r.body.decode("utf-8", "replace"), re.M)
    check(m, "no ltg_circuit_open series for %s on /metrics" % alias)
    return float(m.group(1)) != 0


def wait_probe_due(a, alias, since, what):
    """Wait (bounded) until the breaker of alias lets a probe through (ltg_circuit_open back to 0);
    `since`: a time before the breaker opened, so that it must have been at least 5 s."""
    it.wait_until("%s: the breaker of %s still open" % (what, alias), lambda: not breaker_open(a, alias),
                  20 * it.SLOW, step=0.05)
    took = time.monotonic() - since
    check(took >= 4.95, "%s: the breaker of %s let a probe through %.2f s after it opened, before its 5 s"
          % (what, alias, took))


def _wait_call(alias, n, timeout=10.0):
    it.wait_until(lambda: "the mock's calls of %s: %d, want %d" % (alias, calls(alias), n),
                  lambda: calls(alias) >= n, timeout, step=0.02)


@rtest("circuit breaker: 5 failures open it; skipped; one probe after 5 s; a failed probe reopens; success closes")
def t_rt_breaker(a):
    P, F = fresh(2)
    g = group(a, [P, F], {P: [F]})
    script(P, ["status=503"] * 5)
    for i in range(5):
        t_open_lo = time.monotonic()     # the breaker opens during the 5th call: after this
        r = call(a, g, P)
        it.check_x_headers(r, 200, 2, F, "failure %d of the primary" % (i + 1))
        check_calls({P: i + 1, F: i + 1}, "failure %d of the primary" % (i + 1))
    # Open: skipped, no call, not counted in x-ltg-attempts, logged as circuit_open.
    r = call(a, g, P)
    it.check_x_headers(r, 200, 1, F, "the breaker open")
    check_calls({P: 5, F: 6}, "the breaker open")
    e = ledger_event(a, g, r.header("x-ltg-request-id"))
    check_attempt_list(e.get("attempt_log"), [(P, 1, 0, "circuit_open"), (F, 1, 200, "ok")],
                       "the ledger's attempt_log with the breaker open")
    check(e.get("attempts") == 1, "the spend event's attempts %r, want 1 (a skip is not an attempt)" % e.get("attempts"))
    script(F, ["status=503"])
    r = call(a, g, P)
    check_fail(r, 503, 1, [(P, 1, 0, "circuit_open"), (F, 1, 503, "indeterminate")], what="the breaker open, F failing")
    check_calls({P: 5, F: 7}, "the breaker open, F failing")
    # Still open 3 s after. Time passes on purpose (the breaker stays open 5 s; no state to poll
    # says "3 s"); counted from before the 5th failure, so that it is at least 2 s before the
    # breaker may let a probe through, however long that call took.
    time.sleep(max(0, t_open_lo + 3.0 - time.monotonic()))
    r = call(a, g, P)
    it.check_x_headers(r, 200, 1, F, "the breaker open after 3 s")
    check_calls({P: 5, F: 8}, "the breaker open after 3 s")
    # After 5 s: one probe; it fails: open again at once.
    wait_probe_due(a, P, t_open_lo, "the first probe")
    script(P, ["status=503"])
    t_open_lo = time.monotonic()        # the failed probe opens it again: after this
    r = call(a, g, P)
    it.check_x_headers(r, 200, 2, F, "the probe (failing)")
    check_calls({P: 6, F: 9}, "the probe (failing)")
    r = call(a, g, P)
    it.check_x_headers(r, 200, 1, F, "after a failed probe")
    check_calls({P: 6, F: 10}, "after a failed probe")
    # After 5 s more: one probe (slow, so that another request comes while it runs: turned away).
    wait_probe_due(a, P, t_open_lo, "the second probe")
    script(P, ["head_delay_ms=3000"])
    res = {}

    def probe():
        try:
            res["r"] = call(a, g, P)
        except Exception as ex:
            res["e"] = ex

    th = threading.Thread(target=probe)
    th.start()
    try:
        _wait_call(P, 7)
        r = call(a, g, P)
        it.check_x_headers(r, 200, 1, F, "during the probe")
        still = th.is_alive()
    finally:
        th.join(30)
    check("e" not in res, "the probe: %r" % res.get("e"))
    it.check_x_headers(res["r"], 200, 1, P, "the probe (succeeding)")
    check(still, "the probe finished before the other request was answered: the timing proves nothing")
    check_calls({P: 7, F: 11}, "the probe and a request during it")
    # Closed.
    for i in range(2):
        r = call(a, g, P)
        it.check_x_headers(r, 200, 1, P, "closed, call %d" % (i + 1))
    check_calls({P: 9, F: 11}, "closed")


@rtest("circuit breaker: a probe whose client leaves does not keep the model skipped")
def t_rt_breaker_probe_gone(a):
    P, F = fresh(2)
    g = group(a, [P, F], {P: [F]})
    script(P, ["status=500"] * 5)
    for i in range(5):
        t_open_lo = time.monotonic()     # the breaker opens during the 5th call: after this
        it.check_x_headers(call(a, g, P), 200, 2, F, "failure %d" % (i + 1))
    it.check_x_headers(call(a, g, P), 200, 1, F, "open")
    wait_probe_due(a, P, t_open_lo, "the probe")
    script(P, ["hang"])
    with it.Conn(a.port, timeout=10) as c:
        c.send(it.http_request("POST", "/v1/chat/completions", it.chat_body(model=P), auth=g.token))
        _wait_call(P, 6)
        open_before = stats().get("open_connections", 0)
    # ltg sees the client gone and cancels the probe (the breaker forgets it at once); the probe's
    # upstream connection is read on for its usage for --meter-abandoned-seconds (3 s here), then
    # closed, which the mock counts.
    it.wait_until(lambda: "the probe's upstream connection still open after its client left (the mock counts %d "
                          "open connections, %d before)" % (stats().get("open_connections", 0), open_before),
                  lambda: stats().get("open_connections", 0) < open_before, 20, step=0.05)
    r = call(a, g, P)
    it.check_x_headers(r, 200, 1, P, "after the probe's client left (the next request is the probe)")
    check_calls({P: 7, F: 6}, "after the probe's client left")


@rtest("circuit breaker: no_work (refused, 429) opens it too; the breaker is the alias's, across groups")
def t_rt_breaker_no_work(a):
    D = DOWN.take_one()
    F, = fresh(1)
    g = group(a, [D, F], {D: [F]}, {"max_attempts": 5, "retry_delay_ms": 0})
    r = call(a, g, D)
    it.check_x_headers(r, 200, 6, F, "refused x5")
    r = call(a, g, D)
    it.check_x_headers(r, 200, 1, F, "refused model open")
    e = ledger_event(a, g, r.header("x-ltg-request-id"))
    check_attempt_list(e.get("attempt_log"), [(D, 1, 0, "circuit_open"), (F, 1, 200, "ok")], "the ledger's attempt_log")
    g2 = group(a, [D])
    r = call(a, g2, D)
    check_fail(r, 503, 0, [(D, 1, 0, "circuit_open")], code="circuit_open", what="another group, the same alias")
    check(r.header("retry-after") == "1", "503 circuit_open: Retry-After %r, want 1" % r.header("retry-after"))
    check_calls({F: 2}, "refused")
    # 429 x5 in one request.
    Q, F = fresh(2)
    g = group(a, [Q, F], {Q: [F]}, {"max_attempts": 5, "retry_delay_ms": 0})
    script(Q, ["status=429"] * 5)
    r = call(a, g, Q)
    it.check_x_headers(r, 200, 6, F, "429 x5")
    r = call(a, g, Q)
    it.check_x_headers(r, 200, 1, F, "429 x5, then open")
    check_calls({Q: 5, F: 2}, "429 x5")


@rtest("circuit breaker: every model of the request skipped -> 503 circuit_open, no call")
def t_rt_breaker_all(a):
    X, Y = fresh(2)
    g = group(a, [X, Y], {X: [Y]})
    script(X, ["status=503"] * 5)
    script(Y, ["status=500"] * 5)
    for i in range(5):
        r = call(a, g, X)
        check_fail(r, 500, 2, [(X, 1, 503, "indeterminate"), (Y, 1, 500, "indeterminate")], what="failure %d" % (i + 1))
    for stream in (False, True):
        what = "both open%s" % (" (stream)" if stream else "")
        r = call(a, g, X, stream=stream)
        check_fail(r, 503, 0, [(X, 1, 0, "circuit_open"), (Y, 1, 0, "circuit_open")], code="circuit_open", what=what)
        check(r.header("retry-after") == "1", "%s: Retry-After %r, want 1" % (what, r.header("retry-after")))
    r = call(a, g, Y)
    check_fail(r, 503, 0, [(Y, 1, 0, "circuit_open")], code="circuit_open", what="Y alone")
    check_calls({X: 5, Y: 5}, "both open")
    e = ledger_event(a, g, r.header("x-ltg-request-id"))
    check(e.get("attempts") == 0 and e.get("http_status") == 503, "the spend event: attempts %r http_status %r"
          % (e.get("attempts"), e.get("http_status")))
    # A model that failed, then only open ones: the failure's status, not circuit_open.
    Z, = fresh(1)
    g = group(a, [Z, X, Y], {Z: [X, Y]})
    script(Z, ["status=502"])
    r = call(a, g, Z)
    check_fail(r, 502, 1, [(Z, 1, 502, "indeterminate"), (X, 1, 0, "circuit_open"), (Y, 1, 0, "circuit_open")],
               what="a failure, then open models")
    check_calls({Z: 1, X: 5, Y: 5}, "a failure, then open models")


@rtest("circuit breaker: a success or a terminal answer between failures resets the count")
def t_rt_breaker_reset(a):
    T, = fresh(1)
    g = group(a, [T])
    script(T, ["status=503"] * 4 + ["status=400"] + ["status=502"] * 4 + ["ok"] + ["status=504"] * 4)
    want = [503] * 4 + [400] + [502] * 4 + [200] + [504] * 4 + [200]
    for i, st in enumerate(want):
        r = call(a, g, T)
        check(r.status == st, "call %d: %s, want %d (a breaker opened without 5 consecutive failures?)"
              % (i + 1, r.brief(), st))
    check_calls({T: len(want)}, "reset count")


# ===== headers on every answer ====================================================================

@rtest("x-ltg-attempts on every answer, x-ltg-served-model on 2xx only (chat, stream, embeddings)")
def t_rt_headers(a):
    A, B, C, E1, E2 = fresh(5)
    g = group(a, [A, B, C, E1, E2], {A: [B], E1: [E2]}, {"max_attempts": 2, "retry_delay_ms": 0})
    cases = [
        # (what, script of A, stream, status, attempts, served)
        ("ok", [], False, 200, 1, A),
        ("ok stream", [], True, 200, 1, A),
        ("fallback", ["status=500"], False, 200, 2, B),
        ("fallback stream", ["status=500"], True, 200, 2, B),
        ("retry", ["status=429"], False, 200, 2, A),
        ("retry stream", ["status=529"], True, 200, 2, A),
        ("terminal", ["status=422"], False, 422, 1, None),
        ("terminal stream", ["status=400"], True, 400, 1, None),
        ("cut stream", ["cut_after=2"], True, 200, 1, A),
    ]
    for what, steps, stream, status, attempts, served in cases:
        if steps:
            script(A, steps)
        r = call(a, g, A, stream=stream)
        it.check_x_headers(r, status, attempts, served, what)
    # Every attempt failing, stream or not.
    for stream in (False, True):
        script(A, ["status=503"])
        script(B, ["status=429", "status=429"])
        r = call(a, g, A, stream=stream)
        it.check_x_headers(r, 429, 3, what="all failed%s" % (" (stream)" if stream else ""))
    # Refused before dispatch: 0 attempts.
    r = call(a, g, C, headers={"x-ltg-max-attempts": "9"})
    it.check_x_headers(r, 400, 0, what="a bad override")
    r = call(a, g, "Kimi-K3")
    it.check_x_headers(r, 403, 0, what="a model not allowed")
    r = call(a, g, C, body=b"{not json")
    it.check_x_headers(r, 400, 0, what="a body that is not JSON")
    check_calls({C: 0}, "refused before dispatch")
    # Embeddings: the same plan and headers.
    emb = lambda m: {"model": m, "input": "hello"}
    r = call(a, g, E1, path="/v1/embeddings", body=emb(E1))
    it.check_x_headers(r, 200, 1, E1, "embeddings")
    check(r.json().get("object") == "list", "embeddings body: %r" % r.body[:200])
    script(E1, ["status=503"])
    r = call(a, g, E1, path="/v1/embeddings", body=emb(E1))
    it.check_x_headers(r, 200, 2, E2, "embeddings, fallback")
    script(E1, ["status=503"])
    script(E2, ["status=504"])
    r = call(a, g, E1, path="/v1/embeddings", body=emb(E1))
    check_fail(r, 504, 2, [(E1, 1, 503, "indeterminate"), (E2, 1, 504, "indeterminate")], what="embeddings, all failed")
    check_calls({E1: 3, E2: 2}, "embeddings")


# ===== last: the dedicated ltg exits cleanly ======================================================

_LTG.stop_test(__name__, "retries: the retries ltg exits 0 on SIGTERM, no sanitizer report in its log",
               "no retries test ran")


if __name__ == "__main__":   # this file alone: python3 tests/integration_retries.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
