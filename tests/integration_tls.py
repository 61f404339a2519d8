"""Integration tests: HTTPS to providers (README "Real providers over HTTPS"; ltg.c section 8, and
`up_tls` in section 9).

tests/integration.py imports this file at start-up and runs its tests with the others; to run only
these:

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k tls:

What they need: the openssl command (tests/tls-certs.sh makes a test CA and certificates in
{tmp}/tls-certs; without openssl every test here is skipped) and tests/mock built with its TLS mode.

Upstreams: mock providers of their own, in TLS mode (tests/mock --tls-cert --tls-key), one per
role, so that each one's counters (connections, tls_handshakes, tls_resumed, tls_failed) are ltg's
doing alone:

    good      localhost.pem (DNS:localhost, signed by ca.pem)  the functional tests
    count     localhost.pem                                    connection reuse: 1 connection, 1 handshake
    resume    localhost.pem                                    session resumption (its own ltg)
    restart   localhost.pem                                    restarted on its port: a dead pooled connection
    wrong     wrong.pem (DNS:wrong.example)                    "certificate name mismatch"
    expired   expired.pem (January 2020)                       "certificate expired or not yet valid"
    stall     --tls-stall: accepts, never answers              the handshake deadline

The certificates carry DNS names only, so every provider is https://localhost:PORT/v1 (ltg resolves
localhost from /etc/hosts). The tests read a mock's counters over HTTPS themselves (a control
connection, which the mock leaves out of its counters), without verifying its certificate.

ltg: these tests run on ltgs of their own (the harness's Aux with extra flags: the same binary, own
ports, --data and log), on a catalog that is the harness's plus the TLS providers and models below:

    "tls"       --ca-file ca.pem         most tests
    "otherca"   --ca-file other-ca.pem   the chain is not trusted; tls_verify false still works
    "resume"    --ca-file ca.pem         only the resumption test talks to it, so that its stop line
                                         "TLS handshakes: N full, M resumed" counts that test alone

Each is started on first use (again if it died) and stopped by the test that needs its stop line or
by the last test of this file, which checks that every one exits 0 on SIGTERM with no sanitizer
report in its log; every test also fails on a sanitizer report written during the test to the log
of any of them. Start-up refusals (a --ca-file that is missing or holds no certificate) and a
SIGHUP reload that adds the first https provider use short-lived ltgs of their own.

What else is pinned down, because the TLS path is ltg's own code (tls_pump, up_tls) and not the
plain one: a pooled connection reused for the next call, streams relayed event by event (and so
bounded by x-ltg-deadline only until the first event), a 3 MiB request body, a long stream to a
client that reads slowly (ltg's back-pressure pauses and resumes the TLS reader), an answer
delimited by close_notify, a stream cut without close_notify (200, the events that came, then an
SSE error event: as over plain HTTP), a reset, and a provider restart (its session forgotten: a
full handshake, no failed attempt).

Timing: the handshake deadline is ltg's connect deadline (10 s, CONNECT_TIMEOUT_MS) or the request's
x-ltg-deadline, whichever comes first; the checks have seconds of slack above and 0.5 s below.
"""

import integration as it

import atexit
import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time

CONNECT_TIMEOUT_S = 10.0

# alias -> (provider, upstream model)
TLS_MODELS = {
    "TLS-Good": ("tls-good", "tls-good"),
    "TLS-Trust-A": ("tls-good", "tls-good"),     # the wrong-CA tests: one alias each, so that the
    "TLS-Trust-B": ("tls-good", "tls-good"),     # failures of one never open the circuit breaker
    "TLS-Trust-C": ("tls-good", "tls-good"),     # of the next
    "TLS-Stream": ("tls-good", "tls-stream"),
    "TLS-Big": ("tls-good", "tls-big"),
    "TLS-Close": ("tls-good", "tls-close"),
    "TLS-Cut": ("tls-good", "tls-cut"),
    "TLS-Count": ("tls-count", "tls-count"),
    "TLS-Resume": ("tls-resume", "tls-resume"),
    "TLS-Wrong": ("tls-wrong", "tls-wrong"),
    "TLS-Expired": ("tls-expired", "tls-expired"),
    "TLS-Stall": ("tls-stall", "tls-stall"),
    "TLS-Stall-2": ("tls-stall", "tls-stall-2"),
    "TLS-NoVerify": ("tls-noverify", "tls-noverify"),
    "TLS-Restart": ("tls-restart", "tls-restart"),
}
PLAIN = "Kimi-K3"       # the harness's model on its plain-HTTP mock: a "good provider" for fallbacks

# mock role -> (cert file, key file) in the certs dir, or None for --tls-stall
MOCK_ROLES = {
    "good": ("localhost.pem", "localhost.key"),
    "count": ("localhost.pem", "localhost.key"),
    "resume": ("localhost.pem", "localhost.key"),
    "restart": ("localhost.pem", "localhost.key"),
    "wrong": ("wrong.pem", "wrong.key"),
    "expired": ("expired.pem", "expired.key"),
    "stall": None,
}
PROVIDER_MOCK = {"tls-good": "good", "tls-count": "count", "tls-resume": "resume", "tls-wrong": "wrong",
                 "tls-expired": "expired", "tls-stall": "stall", "tls-noverify": "good", "tls-restart": "restart"}

STOP_LINE_RE = re.compile(r"TLS handshakes: (\d+) full, (\d+) resumed")

_S = {"certs": None, "certs_error": None, "mocks": {}, "auxes": {}, "tokens": {}, "n": 0}


check = it.check


# ===== certificates and the TLS mocks =============================================================

def certs():
    """The directory of tests/tls-certs.sh's files (made once); TestSkip without openssl."""
    if _S["certs_error"]:
        raise _S["certs_error"]
    if _S["certs"] is None:
        d = os.path.join(it.H.tmp, "tls-certs")
        if shutil.which("openssl") is None:
            _S["certs_error"] = it.TestSkip("the openssl command is missing (tests/tls-certs.sh needs it)")
            raise _S["certs_error"]
        p = subprocess.run(["sh", os.path.join(it.HERE, "tls-certs.sh"), d], stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
        if p.returncode != 0:
            _S["certs_error"] = it.TestFailure("tests/tls-certs.sh failed: %s" % p.stdout.decode(errors="replace")[-500:])
            raise _S["certs_error"]
        _S["certs"] = d
    return _S["certs"]


def cert(name):
    return os.path.join(certs(), name)


class TlsMock:
    """One tests/mock in TLS mode (or --tls-stall) on a port of its own."""

    def __init__(self, role):
        self.role = role
        self.port = 0
        self.proc = None
        self.log_path = os.path.join(it.H.tmp, "mock-tls-%s.log" % role)
        self.start()

    def args(self):
        files = MOCK_ROLES[self.role]
        if files is None:
            return ["--tls-stall"]
        return ["--tls-cert", cert(files[0]), "--tls-key", cert(files[1])]

    def start(self):
        """Start it (again on the same port once it has one)."""
        with open(self.log_path, "ab") as log:
            at = log.tell()
            self.proc = subprocess.Popen([it.H.mock_bin, "--port", str(self.port)] + self.args(),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                f.seek(at)
                m = re.search(rb"listening on 127\.0\.0\.1:(\d+)", f.read())
            if m:
                self.port = int(m.group(1))
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise it.TestFailure("the TLS mock (%s) did not start: %s" % (self.role, it.tail(self.log_path, 5)))

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    # --- control, over HTTPS, without checking the certificate (the tests check ltg's checks) ---

    def _ctl(self, method, path, body=None):
        check(MOCK_ROLES[self.role] is not None, "the stalling mock has no control endpoints")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        c = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=20, context=ctx)
        try:
            c.request(method, path, body=None if body is None else json.dumps(body),
                      headers={"Content-Type": "application/json"} if body is not None else {})
            r = c.getresponse()
            data = r.read()
            if r.status != 200:
                raise it.TestFailure("TLS mock (%s) %s %s -> %d %r" % (self.role, method, path, r.status, data[:200]))
            return json.loads(data)
        finally:
            c.close()

    def stats(self):
        return self._ctl("GET", "/_mock/stats")

    def last(self):
        return self._ctl("GET", "/_mock/last")

    def reset(self):
        self._ctl("POST", "/_mock/reset", {})

    def script(self, upstream_model, steps):
        self._ctl("POST", "/_mock/script", {"model": upstream_model, "steps": list(steps)})


def mock(role):
    m = _S["mocks"].get(role)
    if m is None:
        m = _S["mocks"][role] = TlsMock(role)
    elif m.proc is None or m.proc.poll() is not None:
        m.start()
    return m


def settled_stats(m, want, timeout=3.0):
    """The mock's stats once want(stats) holds, or the last ones after timeout: the mock counts a
    failed handshake when its thread sees the client's alert, which may be just after ltg answered."""
    deadline = time.monotonic() + timeout
    while True:
        st = m.stats()
        if want(st) or time.monotonic() >= deadline:
            return st
        time.sleep(0.05)


def in_flight(a, alias):
    """ltg_deployment_in_flight of model alias on ltg a's /metrics (0 when it has no series)."""
    r = it.one_request(a.admin_port, "GET", "/metrics", auth=None)
    check(r.status == 200, "GET /metrics: %s" % r.brief())
    m = re.search(r'^ltg_deployment_in_flight\{model="%s",[^}]*\} (\d+)$' % re.escape(alias),
                  r.body.decode("utf-8", "replace"), re.M)
    return int(m.group(1)) if m else 0


def calls_of(st, upstream_model):
    return st.get("calls", {}).get(upstream_model, 0)


# ===== the catalog and the ltgs ===================================================================

def _catalog():
    for role in MOCK_ROLES:
        mock(role)
    cfg = it.catalog_copy()
    for name, role in PROVIDER_MOCK.items():
        cfg["providers"][name] = it.catalog_provider(_S["mocks"][role].port, host="localhost", scheme="https")
    cfg["providers"]["tls-noverify"]["tls_verify"] = False
    for alias, (prov, up) in TLS_MODELS.items():
        cfg["models"][alias] = it.catalog_model(prov, up)
    return cfg


def config_path():
    return it.catalog_file("tls", _catalog)


def tls_aux(tag, extra, config=None):
    """An Aux with extra command-line flags ("{certs}" in them stands for the certs dir)."""
    return it.Aux(tag, config=config or config_path(), args=[a.replace("{certs}", certs()) for a in extra])


AUX_FLAGS = {
    "tls": ["--ca-file", "{certs}/ca.pem"],
    "otherca": ["--ca-file", "{certs}/other-ca.pem"],
    "resume": ["--ca-file", "{certs}/ca.pem"],
}


def aux(name):
    """The ltg `name` of AUX_FLAGS, started on first use and again if it died (a new log section,
    the same --data: its token key survives)."""
    a = _S["auxes"].get(name)
    if a is not None and a.proc is not None and a.proc.poll() is None:
        return a
    if a is None:
        _S["n"] += 1
        a = _S["auxes"][name] = tls_aux("tls-%s-%d" % (name, _S["n"]), AUX_FLAGS[name])
    a.start()
    return a


DEFAULT_RETRIES = {"max_attempts": 2, "retry_delay_ms": 0}


def token(a, fallbacks=None, retries=None):
    """A token key on ltg `a` for every TLS model and the plain one; with fallbacks or retries a
    new group, otherwise the one kept for that ltg (2 attempts per model, no delay: a TLS
    failure is no_work, so it is tried twice)."""
    key = a.tag
    if fallbacks is None and retries is None and key in _S["tokens"]:
        return _S["tokens"][key]
    body = {"name": "tls-" + it.new_idem(), "allowed_models": sorted(TLS_MODELS) + [PLAIN],
            "retries": DEFAULT_RETRIES if retries is None else retries}
    if fallbacks is not None:
        body["fallbacks"] = fallbacks
    d = it.create_group(body, port=a.admin_port)
    k, secret = it.create_key(d["id"], port=a.admin_port)
    if fallbacks is None and retries is None:
        _S["tokens"][key] = secret
    return secret


def _kill_mocks():
    for m in list(_S["mocks"].values()):
        try:
            m.stop()
        except Exception:
            pass


atexit.register(_kill_mocks)


def ttest(name):
    """Register a test ("tls: " + name). After it, the log of every TLS ltg is checked for a
    sanitizer report written meanwhile, and an ltg that was running and died (rather than being
    stopped by the test) fails it."""
    def deco(fn):
        def run():
            certs()
            before = {n: (a, a.log_size(), a.proc) for n, a in _S["auxes"].items()}
            err = None
            try:
                fn()
            except Exception as e:
                err = e
            for n, a in _S["auxes"].items():
                at = before[n][1] if n in before else 0
                san = a.report_since(at)
                if san:
                    raise it.TestFailure("sanitizer report in the log of ltg (%s): %s%s"
                                         % (a.tag, san, " (and: %s)" % err if err else ""))
                was_dead = n in before and (before[n][2] is None or before[n][2].poll() is not None) \
                    and before[n][2] is a.proc
                if a.proc is not None and a.proc.poll() is not None and not was_dead:
                    rc = a.proc.returncode
                    raise it.TestFailure("ltg (%s) exited with code %r during the test%s; its log: %s"
                                         % (a.tag, rc, " (%s)" % err if err else "", a.text_since_start()[-600:]))
            if err:
                raise err
        run.__name__ = fn.__name__
        it.test("tls: " + name)(run)
        return fn
    return deco


# ===== calls ======================================================================================

def call(a, tok, model, **kw):
    """One inference request to ltg `a`; see it.timed_call."""
    return it.timed_call(a.port, tok, model, **kw)


def check_ok(r, served, upstream, what):
    check(r.status == 200, "%s: %s" % (what, r.brief()))
    check(r.header("x-ltg-served-model") == served, "%s: x-ltg-served-model %r, want %r"
          % (what, r.header("x-ltg-served-model"), served))
    j = r.json()
    check(j.get("model") == upstream, "%s: the body's model %r, want %r" % (what, j.get("model"), upstream))
    return j


def check_tls_failure(r, status, alias, words, what, attempts=None):
    """ltg's failure answer for a TLS failure: OpenAI-shaped, `words` in error.message, every
    attempt of `alias` in error.attempts with outcome no_work and no status (nothing reached the
    provider)."""
    e = it.check_openai_error(r, status)
    msg = e.get("message") or ""
    check(words in msg, "%s: error.message %r does not say %r" % (what, msg, words))
    att = e.get("attempts")
    check(isinstance(att, list) and att, "%s: error.attempts %r" % (what, att))
    mine = [x for x in att if x.get("model") == alias]
    check(mine, "%s: no attempt of %s in error.attempts %r" % (what, alias, att))
    for x in mine:
        check(x.get("outcome") == "no_work" and x.get("status") in (0, None),
              "%s: attempt %r, want outcome no_work and no status (nothing reached the provider)" % (what, x))
    if attempts is not None:
        check(len(att) == attempts and r.header("x-ltg-attempts") == str(attempts),
              "%s: %d attempts listed, x-ltg-attempts %r, want %d: %r"
              % (what, len(att), r.header("x-ltg-attempts"), attempts, att))
    return e


def stream_events(r):
    """The data payloads of a streamed answer, each with the time its event arrived."""
    return [(t, it.event_data(ev)) for t, ev in it.sse_events(r)]


def check_stream(r, served, upstream, n_content, what):
    check(r.status == 200, "%s: %s" % (what, r.brief()))
    check((r.header("content-type") or "").startswith("text/event-stream"), "%s: Content-Type %r"
          % (what, r.header("content-type")))
    check(r.chunked, "%s: not chunked (headers %r)" % (what, r.headers))
    check(r.header("x-ltg-served-model") == served, "%s: x-ltg-served-model %r" % (what, r.header("x-ltg-served-model")))
    evs = stream_events(r)
    datas = [d for _, d in evs]
    check(datas and datas[-1] == "[DONE]", "%s: the stream does not end with [DONE]: %r" % (what, datas[-3:]))
    check(datas.count("[DONE]") == 1, "%s: [DONE] more than once" % what)
    content = 0
    finish = None
    for d in datas[:-1]:
        o = json.loads(d)
        check(o.get("object") == "chat.completion.chunk" and o.get("model") == upstream,
              "%s: event %r" % (what, d[:200]))
        for ch in o.get("choices", []):
            if ch.get("delta", {}).get("content"):
                check(finish is None, "%s: content after finish_reason" % what)
                content += 1
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
    check(content == n_content, "%s: %d content events, want %d" % (what, content, n_content))
    check(finish == "stop", "%s: no finish_reason stop" % what)
    return evs


def stop_line(a, text):
    m = STOP_LINE_RE.findall(text)
    check(m, "ltg (%s) did not log \"TLS handshakes: N full, M resumed\" when it stopped: %s"
          % (a.tag, text[-600:]))
    full, resumed = m[-1]
    return int(full), int(resumed)


# ===== the tests ==================================================================================

@ttest("a call over HTTPS: 200 with the mock's body, SNI localhost, Authorization injected; embeddings too")
def t_tls_call():
    a = aux("tls")
    tok = token(a)
    m = mock("good")
    st0 = m.stats()
    r = call(a, tok, "TLS-Good", content="over https")
    j = check_ok(r, "TLS-Good", "tls-good", "the call")
    check(j["choices"][0]["message"]["content"] == "Hello from tls-good.", "content %r" % j["choices"][0])
    check(r.header("x-ltg-attempts") == "1", "x-ltg-attempts %r" % r.header("x-ltg-attempts"))
    last = m.last()
    check(last.get("tls_server_name") == "localhost", "the SNI the mock saw: %r, want localhost"
          % last.get("tls_server_name"))
    check(last.get("path") == "/v1/chat/completions", "upstream path %r" % last.get("path"))
    hdrs = last.get("headers", {})
    check(hdrs.get("authorization") == "Bearer " + it.PROVIDER_KEY,
          "upstream Authorization %r, want Bearer <MOCK_KEY>" % hdrs.get("authorization"))
    check(hdrs.get("host") == "localhost:%d" % m.port, "upstream Host %r" % hdrs.get("host"))
    fwd = json.loads(last["body"])
    check(fwd.get("model") == "tls-good" and fwd["messages"][0]["content"] == "over https", "forwarded body %r" % fwd)
    check(tok not in json.dumps(hdrs), "the client's token key reached the provider")
    st1 = m.stats()
    check(calls_of(st1, "tls-good") - calls_of(st0, "tls-good") == 1, "the mock counted %d calls, want 1"
          % (calls_of(st1, "tls-good") - calls_of(st0, "tls-good")))
    check(st1.get("tls_failed") == st0.get("tls_failed"), "a handshake failed at the mock: %r" % st1)
    # Embeddings over the same provider.
    r = call(a, tok, None, path="/v1/embeddings", body={"model": "TLS-Good", "input": "hello"})
    check(r.status == 200 and r.json().get("data", [{}])[0].get("embedding") == [0.1, 0.2, 0.3],
          "embeddings over https: %s" % r.brief())
    check(m.last().get("path") == "/v1/embeddings", "embeddings upstream path %r" % m.last().get("path"))


@ttest("a stream over HTTPS arrives event by event and ends in [DONE]")
def t_tls_stream():
    a = aux("tls")
    tok = token(a)
    r = call(a, tok, "TLS-Stream", stream=True, directive="event_delay_ms=300 events=4")
    evs = check_stream(r, "TLS-Stream", "tls-stream", 4, "the stream")
    times = [t for t, _ in evs if t is not None]
    check(len(times) == len(evs), "events not delimited")
    # The mock spends 4 x 300 ms between its events: they must arrive spread out, one by one, not
    # decrypted and relayed in a burst at the end.
    check(times[-1] - times[0] >= 0.6, "the first event arrived only %.0f ms before the last: the stream "
          "was buffered" % ((times[-1] - times[0]) * 1000))
    gaps = [b - a_ for a_, b in zip(times, times[1:4])]
    check(sum(1 for g in gaps if g >= 0.15) >= 2, "events arrived in bursts, not one by one: gaps %r ms"
          % [round(g * 1000) for g in gaps])
    # The deadline bounds the wait for the answer to start, not the stream: a stream that starts at
    # once and lasts longer than x-ltg-deadline is relayed whole.
    r = call(a, tok, "TLS-Stream", stream=True, directive="event_delay_ms=300 events=4",
             headers={"x-ltg-deadline": "1000"})
    check(r.status == 200, "a stream that starts at once and lasts 1.2 s, x-ltg-deadline 1000: %s (the events "
          "were not relayed as they came, so the deadline saw no answer)" % r.brief())
    check_stream(r, "TLS-Stream", "tls-stream", 4, "a stream longer than its deadline")
    # include_usage: the usage chunk passes; without it, ltg's own usage request stays hidden.
    r = call(a, tok, "TLS-Stream", stream=True, stream_options={"include_usage": True})
    evs = check_stream(r, "TLS-Stream", "tls-stream", 3, "the stream with include_usage")
    check(sum(1 for _, d in evs if d != "[DONE]" and json.loads(d).get("usage")) == 1,
          "with include_usage: %r" % [d[:80] for _, d in evs])


@ttest("10 sequential calls reuse one connection: the mock accepts 1 connection, 1 handshake")
def t_tls_reuse():
    a = aux("tls")
    tok = token(a)
    m = mock("count")
    m.reset()
    for i in range(10):
        r = call(a, tok, "TLS-Count", content="call %d" % i)
        check_ok(r, "TLS-Count", "tls-count", "call %d" % (i + 1))
    st = m.stats()
    check(st.get("requests") == 10, "the mock saw %r requests, want 10" % st.get("requests"))
    check(st.get("connections") == 1, "10 sequential calls: the mock accepted %r connections, want 1"
          % st.get("connections"))
    check(st.get("tls_handshakes") == 1 and st.get("tls_failed") == 0,
          "10 sequential calls: %r handshakes (%r failed), want 1" % (st.get("tls_handshakes"), st.get("tls_failed")))


@ttest("new connections resume the TLS session: mock tls_resumed >= 1, stop line \"1 full, N resumed\"")
def t_tls_resume():
    a = aux("resume")
    tok = token(a)
    m = mock("resume")
    m.reset()
    r = call(a, tok, "TLS-Resume")
    check_ok(r, "TLS-Resume", "tls-resume", "the first call (a full handshake)")
    # Four concurrent calls, each held 600 ms by the mock: ltg needs four connections, the pooled
    # one and three new ones, which resume the session of the first.
    n = 4
    results = [None] * n

    def worker(i):
        try:
            results[i] = call(a, tok, "TLS-Resume", directive="head_delay_ms=600", content="concurrent %d" % i)
        except Exception as e:
            results[i] = e

    ths = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    for i, r in enumerate(results):
        check(not isinstance(r, Exception) and r is not None, "concurrent call %d: %r" % (i, r))
        check_ok(r, "TLS-Resume", "tls-resume", "concurrent call %d" % i)
    st = m.stats()
    check(st.get("requests") == n + 1, "the mock saw %r requests, want %d" % (st.get("requests"), n + 1))
    conns = st.get("connections")
    check(conns is not None and conns >= 2, "%d concurrent calls after one: the mock accepted %r connections, "
          "want more than 1" % (n, conns))
    check(st.get("tls_handshakes") == conns, "the mock: %r handshakes for %r connections" % (st.get("tls_handshakes"), conns))
    check(st.get("tls_resumed", 0) >= 1, "no new connection resumed the session at the mock: %r" % st)
    check(st.get("tls_resumed") == conns - 1, "the mock: %r of %r handshakes resumed, want all but the first"
          % (st.get("tls_resumed"), conns))
    check(st.get("tls_failed") == 0, "the mock: %r failed handshakes" % st.get("tls_failed"))
    # The stop line of this ltg, which made no other TLS connection.
    at = a.started_at
    a.stop()
    full, resumed = stop_line(a, a.text_since(at))
    check(full == 1, "ltg's stop line says %d full handshakes, want 1" % full)
    check(resumed == st.get("tls_resumed"), "ltg's stop line says %d resumed, the mock %r" % (resumed, st.get("tls_resumed")))


# A certificate ltg must refuse, one row each: the ltg (its --ca-file), the alias, the mock that
# presents the chain, and the words ltg's error says. Every row: 502, each attempt no_work, one failed
# handshake per attempt at the mock and no request; a stream fails the same way, before its head.
CERT_FAILURES = [
    ("wrong CA (--ca-file other-ca.pem)", "otherca", "TLS-Trust-A", "good", "not trusted"),
    ("a certificate for another name (DNS:wrong.example)", "tls", "TLS-Wrong", "wrong", "name mismatch"),
    ("an expired certificate", "tls", "TLS-Expired", "expired", "expired"),
]


def cert_failure(row):
    what, aux_name, alias, role, words = row

    @ttest('%s: 502 "%s", outcome no_work, the provider never reached; a stream too' % (what, words))
    def run():
        a = aux(aux_name)
        tok = token(a)
        m = mock(role)
        for how, kw in (("the call", {}), ("the stream", {"stream": True})):
            st0 = m.stats()
            r = call(a, tok, alias, **kw)
            check_tls_failure(r, 502, alias, words, "%s, %s" % (what, how), attempts=2)
            st1 = settled_stats(m, lambda st: st.get("tls_failed", 0) - st0.get("tls_failed", 0) >= 2)
            failed = st1.get("tls_failed", 0) - st0.get("tls_failed", 0)
            check(st1.get("requests") == st0.get("requests") and failed == 2,
                  "%s, %s: the mock saw %d requests and %d failed handshakes, want none and 2 (one per attempt)"
                  % (what, how, st1.get("requests", 0) - st0.get("requests", 0), failed))


for _row in CERT_FAILURES:
    cert_failure(_row)


@ttest("wrong CA: a fallback on a good provider answers")
def t_tls_wrong_ca_fallback():
    a = aux("otherca")
    tok = token(a, fallbacks={"TLS-Trust-B": [PLAIN]}, retries={"max_attempts": 1, "retry_delay_ms": 0})
    r = call(a, tok, "TLS-Trust-B")
    check(r.status == 200, "with a fallback: %s" % r.brief())
    check(r.header("x-ltg-served-model") == PLAIN, "served by %r, want %s" % (r.header("x-ltg-served-model"), PLAIN))
    check(r.header("x-ltg-attempts") == "2", "x-ltg-attempts %r, want 2" % r.header("x-ltg-attempts"))
    check(r.json().get("model") == "kimi-k3", "body %r" % r.body[:200])
    r = call(a, tok, "TLS-Trust-B", stream=True)
    check(r.status == 200 and r.header("x-ltg-served-model") == PLAIN, "a stream with a fallback: %s" % r.brief())


@ttest("tls_verify false: the same untrusted chain is accepted (with a start-up warning)")
def t_tls_noverify():
    a = aux("otherca")
    tok = token(a)
    text = a.text_since(0)
    check(re.search(r"tls-noverify.*tls_verify is false", text), "no start-up warning about tls_verify false: %s"
          % text[-600:])
    m = mock("good")
    r = call(a, tok, "TLS-NoVerify")
    check_ok(r, "TLS-NoVerify", "tls-noverify", "tls_verify false")
    check(m.last().get("tls_server_name") == "localhost", "SNI %r" % m.last().get("tls_server_name"))
    # The next call reuses the connection; verification stays off only for this provider.
    r = call(a, tok, "TLS-NoVerify", stream=True)
    check_stream(r, "TLS-NoVerify", "tls-noverify", 3, "a stream, tls_verify false")
    r = call(a, tok, "TLS-Trust-C")
    check_tls_failure(r, 502, "TLS-Trust-C", "not trusted", "the verified provider on the same mock")


@ttest("an expired certificate with a fallback on a good https provider: the fallback serves")
def t_tls_expired_fallback():
    a = aux("tls")
    tok = token(a, fallbacks={"TLS-Expired": ["TLS-Good"]}, retries={"max_attempts": 1, "retry_delay_ms": 0})
    r = call(a, tok, "TLS-Expired")
    check_ok(r, "TLS-Good", "tls-good", "the fallback after an expired certificate")


@ttest("a server that stalls the handshake: x-ltg-deadline 2000 -> 504 after 2 s")
def t_tls_stall_deadline():
    a = aux("tls")
    tok = token(a)
    mock("stall")
    r = call(a, tok, "TLS-Stall", headers={"x-ltg-deadline": "2000"}, timeout=30)
    e = it.check_openai_error(r, 504, "deadline_exceeded")
    check(1.9 <= r.elapsed <= 5.0, "answered after %.2f s, want about 2 s (the request's deadline)" % r.elapsed)
    att = e.get("attempts") or []
    check(att and all(x.get("model") == "TLS-Stall" for x in att), "error.attempts %r" % att)
    # The stalled handshake did not block ltg: a call to another provider meanwhile answers at once.
    res = {}

    def stalled():
        try:
            res["r"] = call(a, tok, "TLS-Stall-2", headers={"x-ltg-deadline": "2000"}, timeout=30)
        except Exception as e:
            res["e"] = e

    th = threading.Thread(target=stalled)
    th.start()
    it.wait_until("the second stalled call's attempt is not in flight (ltg_deployment_in_flight of TLS-Stall-2)",
                  lambda: in_flight(a, "TLS-Stall-2") >= 1 or not th.is_alive(), 10 * it.SLOW, step=0.02)
    check(th.is_alive(), "the second stalled call ended before a call to another provider could be made: %s"
          % (res["r"].brief() if "r" in res else repr(res.get("e"))))
    r = call(a, tok, "TLS-Good", timeout=10)
    check_ok(r, "TLS-Good", "tls-good", "a call while a handshake stalls")
    check(r.elapsed < 1.5, "a call to another provider took %.2f s while a handshake stalled" % r.elapsed)
    th.join(30)
    check("r" in res and res["r"].status == 504, "the second stalled call: %s"
          % (res["r"].brief() if "r" in res else repr(res.get("e"))))


@ttest("a server that stalls the handshake, no deadline header: \"TLS handshake ... timed out\" after 10 s")
def t_tls_stall_timeout():
    a = aux("tls")
    tok = token(a, retries={"max_attempts": 1, "retry_delay_ms": 0})
    mock("stall")
    r = call(a, tok, "TLS-Stall-2", timeout=40)
    check_tls_failure(r, 502, "TLS-Stall-2", "TLS handshake with localhost timed out", "the call", attempts=1)
    check(CONNECT_TIMEOUT_S - 0.5 <= r.elapsed <= CONNECT_TIMEOUT_S + 4,
          "answered after %.2f s, want about %.0f s (the connect and handshake deadline)" % (r.elapsed, CONNECT_TIMEOUT_S))


@ttest("a large request body (3 MiB) and a large stream (about 3 MiB) to a client that reads slowly")
def t_tls_large():
    a = aux("tls")
    tok = token(a)
    m = mock("good")
    content = "".join(chr(ord("a") + i % 26) for i in range(3 << 20))
    r = call(a, tok, "TLS-Big", content=content, timeout=60)
    check_ok(r, "TLS-Big", "tls-big", "a 3 MiB request")
    last = m.last()
    fwd = json.loads(last["body"])
    check(fwd["messages"][0]["content"] == content, "the forwarded content differs (%d chars, want %d)"
          % (len(fwd["messages"][0]["content"]), len(content)))
    # A long stream to a client that does not read for 2 s: ltg stops reading the provider (its
    # back-pressure) and must resume it, with every event intact.
    n = 20000
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    s.settimeout(60)
    s.connect(("127.0.0.1", a.port))
    c = it.Conn.__new__(it.Conn)
    c.sock, c.buf, c.eof = s, b"", False
    with c:
        c.send(it.http_request("POST", "/v1/chat/completions",
                               it.chat_body(model="TLS-Big", stream=True, directive="events=%d" % n), auth=tok))
        time.sleep(2.0)     # on purpose: the client does not read for 2 s (ltg must stop reading, then resume)
        r = c.read_final_response(120)
    check_stream(r, "TLS-Big", "tls-big", n, "a stream of %d events read slowly" % n)


@ttest("an answer delimited by the close (close_notify, then FIN), and one with Connection: close")
def t_tls_close():
    a = aux("tls")
    tok = token(a)
    # framing=eof: no Content-Length, not chunked: the body ends with the connection. Its last bytes
    # and the close_notify often come in one read: 20 calls, each with a short deadline, so that
    # a hang shows, and fails in seconds.
    for i in range(20):
        r = call(a, tok, "TLS-Close", directive="framing=eof", headers={"x-ltg-deadline": "3000"})
        j = check_ok(r, "TLS-Close", "tls-close", "an answer delimited by the close (call %d of 20)" % (i + 1))
        check(j["choices"][0]["message"]["content"] == "Hello from tls-close.", "body %r" % r.body[:200])
        check(r.elapsed < 2.0, "an answer delimited by the close took %.2f s" % r.elapsed)
    r = call(a, tok, "TLS-Close", directive="close", headers={"x-ltg-deadline": "5000"})
    check_ok(r, "TLS-Close", "tls-close", "an answer with Connection: close")
    r = call(a, tok, "TLS-Close")
    check_ok(r, "TLS-Close", "tls-close", "the call after the closes (a new connection)")


@ttest("a stream cut without close_notify: 200, its events, an SSE error event; a reset: 502 indeterminate")
def t_tls_cut():
    a = aux("tls")
    tok = token(a)
    # A stream cut after 2 events without close_notify: as over plain HTTP, the events that came,
    # then an SSE error event, no [DONE].
    r = call(a, tok, "TLS-Cut", stream=True, directive="cut_after=2")
    check(r.status == 200, "a cut stream: %s" % r.brief())
    datas = [d for _, d in stream_events(r)]
    check("[DONE]" not in datas, "a cut stream ended with [DONE]: %r" % datas)
    check(len(datas) == 3 and "stream_interrupted" in datas[-1],
          "a cut stream: want its 2 events, then an error event: %r" % [d[:80] for d in datas])
    # The mock resets the connection after reading the request: indeterminate, 502.
    r = call(a, tok, "TLS-Cut", directive="reset")
    e = it.check_openai_error(r, 502)
    check([x.get("outcome") for x in e.get("attempts", [])] == ["indeterminate"],
          "a reset after the request was sent: attempts %r, want one indeterminate" % e.get("attempts"))
    r = call(a, tok, "TLS-Cut")
    check_ok(r, "TLS-Cut", "tls-cut", "the call after the reset")


@ttest("a provider restart: the dead pooled connection is dropped, the next call handshakes afresh")
def t_tls_restart():
    a = aux("tls")
    tok = token(a)
    m = mock("restart")
    for i in range(2):
        check_ok(call(a, tok, "TLS-Restart"), "TLS-Restart", "tls-restart", "call %d" % (i + 1))
    m.stop()
    m.start()          # same port, empty session cache
    r = call(a, tok, "TLS-Restart")
    check_ok(r, "TLS-Restart", "tls-restart", "the call after the restart")
    check(r.header("x-ltg-attempts") == "1", "x-ltg-attempts %r: the dead pooled connection was used"
          % r.header("x-ltg-attempts"))
    st = m.stats()
    check(st.get("connections") == 1 and st.get("tls_handshakes") == 1 and st.get("tls_resumed") == 0,
          "after the restart: %r (want 1 connection, 1 full handshake: the server forgot the session)" % st)
    r = call(a, tok, "TLS-Restart")
    check_ok(r, "TLS-Restart", "tls-restart", "the call after that")


@ttest("--ca-file missing, or holding no certificate: start-up refused, naming the file")
def t_tls_ca_file_bad():
    d = os.path.join(it.H.tmp, "tls-bad-ca")
    os.makedirs(d, exist_ok=True)
    missing = os.path.join(d, "no-such-bundle.pem")
    nocert = os.path.join(d, "not-a-cert.pem")
    shutil.copy(cert("localhost.key"), nocert)          # PEM, but a key
    empty = os.path.join(d, "empty.pem")
    open(empty, "w").close()
    text_file = os.path.join(d, "text.pem")
    with open(text_file, "w") as f:
        f.write("this is not a certificate\n")
    for path, what in ((missing, "a missing file"), (nocert, "a PEM file with only a private key"),
                       (empty, "an empty file"), (text_file, "a text file")):
        _S["n"] += 1
        a = tls_aux("tls-badca-%d" % _S["n"], ["--ca-file", path])
        try:
            rc, text = a.start_fails(timeout=20)
            check(rc != 0, "%s: ltg exited %r" % (what, rc))
            check(path in text, "%s: the start-up error does not name %s: %r" % (what, path, text[-400:]))
            check("listening" not in text, "%s: ltg listened before refusing: %r" % (what, text[-400:]))
        finally:
            a.close()
    # Without an https provider the file is not read: start-up goes on.
    _S["n"] += 1
    a = tls_aux("tls-badca-%d" % _S["n"], ["--ca-file", missing], config=it.H.config_path)
    try:
        a.start()
        a.stop()
    finally:
        a.close()


@ttest("SIGHUP adding the first https provider loads --ca-file then (refused while it is missing)")
def t_tls_reload():
    plain = it.catalog_copy()
    with_tls = it.catalog_copy()
    with_tls["providers"]["tls-good"] = it.catalog_provider(mock("good").port, host="localhost", scheme="https")
    with_tls["models"]["TLS-Good"] = it.catalog_model("tls-good", "tls-good")
    for ca, taken in (("{certs}/ca.pem", True), ("{certs}/no-such-ca.pem", False)):
        _S["n"] += 1
        path = it.write_catalog(plain, "tls-reload-%d" % _S["n"])
        a = tls_aux("tls-reload-%d" % _S["n"], ["--ca-file", ca], config=path)
        try:
            a.start()
            gid = it.create_group(it.group_body(name="tls-reload", allowed_models=["Kimi-K3"]), port=a.admin_port)["id"]
            k, tok = it.create_key(gid, port=a.admin_port)
            with open(path, "w") as f:
                json.dump(with_tls, f)
            at = a.log_size()
            a.proc.send_signal(signal.SIGHUP)
            it.wait_until(lambda: "no log line about the SIGHUP: %r" % a.text_since(at)[-400:],
                          lambda: re.search(r"SIGHUP: config (taken|refused)[^\n]*\n", a.text_since(at)), 20 * it.SLOW,
                          step=0.05)
            text = a.text_since(at)
            if taken:
                check("config taken" in text, "the reload adding an https provider: %r" % text[-400:])
                it.check_admin_ok(a.admin("PATCH", "/token_groups/" + gid, {"allowed_models": ["Kimi-K3", "TLS-Good"]},
                                          if_match=1), 200, "PATCH")
                r = call(a, tok, "TLS-Good")
                check_ok(r, "TLS-Good", "tls-good", "the https provider after the reload")
            else:
                check("refused" in text and "no-such-ca.pem" in text,
                      "the reload with a missing --ca-file: %r (want refused, naming the file)" % text[-400:])
                r = call(a, tok, "Kimi-K3")
                check(r.status == 200, "the old catalog after a refused reload: %s" % r.brief())
            a.stop()
        finally:
            a.close()


# ===== last: the TLS ltgs exit cleanly ============================================================

@it.test("tls: the TLS ltgs exit 0 on SIGTERM, no sanitizer report in their logs")
def t_tls_zz_stop():
    auxes, _S["auxes"] = _S["auxes"], {}
    problems = []
    try:
        if not auxes:
            raise it.TestSkip("no TLS test ran")
        for name, a in auxes.items():
            try:
                if a.proc is not None and a.proc.poll() is not None:
                    problems.append("ltg (%s) had already exited with code %r" % (a.tag, a.proc.returncode))
                    a.proc = None
                elif a.proc is not None:
                    a.stop()
            except it.TestFailure as e:
                problems.append(str(e))
            try:
                a.close()
            except it.TestFailure as e:
                problems.append(str(e))
    finally:
        for m in _S["mocks"].values():
            m.stop()
    check(not problems, "; ".join(problems))


if __name__ == "__main__":   # this file alone: python3 tests/integration_tls.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
