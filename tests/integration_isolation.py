"""Integration tests: isolation between clients and tenants (README "Hardening"): a chunked request
body bounded in raw bytes (white space after a chunk size counted toward the 1,024 bytes of its
line; framing at most 2 x --max-body-mb + 64 KiB; the minimum rate counted on decoded bytes), on
both listeners; a client's own shorter x-ltg-request-timeout / x-ltg-deadline never opens the
circuit breaker another group uses; a cache hit with a fresh Idempotency-Key stores no copy of the
answer in the ledger (its retry is answered from the cache); previous_response_id pins per group;
request ids that are distinct and not a linear generator's; DNS answers whose question is not the
query's are ignored; a provider status line "HTTP/1.1 000" is a malformed answer (502 or the
fallback), never relayed as status 0.

tests/integration.py imports this file at start-up and runs its tests with the others; to run only
these:

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k isolation:
    python3 tests/integration_isolation.py --ltg ./ltg --mock tests/mock

Isolation (of the tests). These tests run on an ltg of their own (the harness's Aux: its own ports,
--data and log), started with --head-timeout 2 (the body-rate test waits seconds, not tens of
seconds), --max-body-mb 2 (the raw bound is then 4 MiB + 64 KiB) and --meter-abandoned-seconds 2 (an
attempt given up on ends soon), whose catalog is the harness's plus models reserved to this file
(MODELS below, every one served by the harness's mock under an upstream name of its own, so that
the mock's per-model scripts and counters are this file's), and a provider whose host name only
the fake DNS server knows. Each test provisions its own token groups and keys through that ltg's
control plane. The DNS test needs root (UDP port 53 of a loopback address) and is skipped without.

That ltg is started by the first test that needs it (again if it died) and stopped by the last test
of this file, which checks that it exits 0 on SIGTERM; every test also fails on a sanitizer report
written to its log during the test. Waits are bounded and generous (a slow, busy machine); time is
asserted only where the contract is about time (a body that earns no time gets 408 within seconds,
not never), with many seconds of slack.
"""

import datetime
import glob
import os
import re
import select
import struct
import time

import integration as it

check = it.check

HEAD_TIMEOUT_S = 2
MAX_BODY_MB = 2
RAW_MAX = 2 * MAX_BODY_MB * (1 << 20) + 65536      # README: raw chunked bytes at most 2 x --max-body-mb + 64 KiB

DNS_HOST = "wrongq.ltg.test"          # known only to the fake DNS server
DNS_OTHER = "elsewhere.ltg.test"      # the question of the answer that must be ignored

# alias -> upstream model (the mock's name)
MODELS = {
    "ISO-Breaker": "iso-breaker",
    "ISO-Breaker-D": "iso-breaker-d",
    "ISO-Cache": "iso-cache",
    "ISO-Resp-A": "iso-resp-a",
    "ISO-Resp-B": "iso-resp-b",
    "ISO-Status": "iso-status",
    "ISO-Status-FB": "iso-status-fb",
}

# ===== the dedicated ltg ==========================================================================

def _catalog():
    cfg = it.catalog_copy()
    for alias, up in MODELS.items():
        cfg["models"][alias] = it.catalog_model("mock", up)
    cfg["providers"]["iso-dns"] = it.catalog_provider(it.H.mock_port, host=DNS_HOST)
    cfg["models"]["ISO-DNS"] = it.catalog_model("iso-dns", "kimi-k3")
    return cfg


def _config_path():
    return it.catalog_file("isolation", _catalog)


def _resolv_path():
    return os.path.join(it.H.tmp, "resolv-isolation.conf")


def _make(n):
    # The resolv.conf may name no server yet (the DNS test writes it when it can bind port 53);
    # ltg reads it at start-up, so the DNS test starts an ltg of its own.
    return it.Aux("isolation-%d" % n, config=_config_path(),
                  args=["--head-timeout", str(HEAD_TIMEOUT_S), "--max-body-mb", str(MAX_BODY_MB),
                        "--meter-abandoned-seconds", "2"])


_LTG = it.AuxSlot(_make)


def itest(name):
    """Register a test ("isolation: " + name) that gets the dedicated ltg as its argument."""
    return _LTG.test("isolation: " + name, "the isolation ltg")


def group(a, models, **kw):
    body = {"name": "iso-" + it.new_idem(), "allowed_models": list(models)}
    body.update(kw)
    d = it.create_group(body, port=a.admin_port)
    _, token = it.create_key(d["id"], port=a.admin_port)
    return it.Provisioned(d["id"], token)


def mock_calls(up):
    """The mock's call count of this upstream model."""
    return it.H.mock_stats().get("calls", {}).get(up, 0)


def script(up, steps):
    """The mock's next answers for upstream model `up` (a directive in the body would reach a fallback too)."""
    it.H.mock_post("/_mock/script", {"model": up, "steps": list(steps)})


def events_of(a, g):
    today = datetime.datetime.now(datetime.timezone.utc).date()
    q = "/spend/events?start_date=%s&end_date=%s&token_group_id=%s&page[size]=1000" % (
        today - datetime.timedelta(days=1), today + datetime.timedelta(days=2), g.gid)
    return it.check_admin_ok(it.admin("GET", q, port=a.admin_port), 200, "GET /spend/events")["data"]


def ledger_bytes(a):
    files = glob.glob(os.path.join(a.data_dir, "ledger", "*.log"))
    check(files, "no ledger segment (%s/ledger/*.log)" % a.data_dir)
    return sum(os.path.getsize(f) for f in files)


def send_quietly(c, data):
    """Send; False once ltg stopped reading (it answered and closed)."""
    try:
        c.sock.sendall(data)
        return True
    except OSError:
        return False


def answered(c):
    """True when ltg has sent something (or closed): readable without blocking."""
    r, _, _ = select.select([c.sock], [], [], 0)
    return bool(r)


def chunked_head(a, path):
    """A chunked POST's head with a key that may send a body on its listener (a body still to come
    is read only for one): an admin key on the control plane, a token key of a group of a's."""
    key = it.ADMIN_KEY if path.startswith(it.API) else group(a, ["ISO-Cache"]).token
    return ("POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            "Authorization: Bearer %s\r\n\r\n" % (path, key)).encode()


LISTENERS = (("inference", lambda a: a.port, "/v1/chat/completions"),
             ("admin", lambda a: a.admin_port, it.API + "/token_groups"))


# ===== 1. chunked request bodies ==================================================================

@itest("a chunk size followed by 2000 spaces -> 400 bad_request and close, on both listeners "
       "(white space counts toward the size line's 1,024 bytes)")
def t_iso_chunk_size_spaces(a):
    for what, port, path in LISTENERS:
        with it.Conn(port(a), timeout=20) as c:
            body = b"5" + b" " * 2000 + b"\r\nhello\r\n0\r\n\r\n"
            send_quietly(c, chunked_head(a, path) + body)
            r = c.read_final_response(15)
            check(r.status == 400, "%s listener: a chunk size followed by 2000 spaces: %s, want 400 bad_request"
                  % (what, r.brief()))
            code = None
            try:
                j = r.json()
                code = (j.get("error") or {}).get("code") if "error" in j else (j.get("errors") or [{}])[0].get("code")
            except it.TestFailure:
                pass
            check(code == "bad_request", "%s listener: 400 with code %r, want bad_request: %r" % (what, code, r.body[:300]))
            check(c.wait_closed(10), "%s listener: the connection stays open after the 400" % what)
        # 1,000 spaces are within the line's bound: the body is taken (then refused for what it
        # says, {"x":1}: anything but 400 bad_request for its framing).
        with it.Conn(port(a), timeout=20) as c:
            data = b'{"x":1}'
            body = b"%x" % len(data) + b" " * 1000 + b"\r\n" + data + b"\r\n0\r\n\r\n"
            c.send(chunked_head(a, path) + body)
            r = c.read_final_response(15)
            check(400 <= r.status < 500 and b"bad_request" not in r.body and b"chunk" not in r.body,
                  "%s listener: a chunk size followed by 1000 spaces (within the line's 1,024 bytes): %s, want the "
                  "body taken and refused for what it says, not for its framing" % (what, r.brief()))


def one_byte_chunks(n):
    """n chunks of 1 data byte, each with a 1000-byte chunk extension: 1008 raw bytes a decoded byte."""
    one = b"1;" + b"e" * 1000 + b"\r\n" + b" " + b"\r\n"
    return one * n


@itest("1-byte chunks with 1000-byte extensions -> 413 body_too_large once the framing passes 2 x --max-body-mb "
       "+ 64 KiB, before ltg's memory grows (inference listener; the admin listener too)")
def t_iso_chunk_framing_bound(a):
    pid = a.proc.pid
    piece = one_byte_chunks(256)                     # ~252 KiB
    limit = 40 << 20
    for what, port, path in LISTENERS:
        rss0 = it.rss_kib(pid)
        peak = rss0
        sent = 0
        with it.Conn(port(a), timeout=30) as c:
            ok = send_quietly(c, chunked_head(a, path))
            while ok and sent < limit and not answered(c):
                ok = send_quietly(c, piece)
                if ok:
                    sent += len(piece)
                if (sent // len(piece)) % 8 == 0:
                    peak = max(peak, it.rss_kib(pid))
            peak = max(peak, it.rss_kib(pid))
            check(answered(c) or not ok or select.select([c.sock], [], [], 15)[0],
                  "%s listener: no answer after %d raw bytes of 1-byte chunks with 1000-byte extensions (%d decoded; "
                  "the bound is %d raw bytes): ltg keeps reading framing; its RSS grew by %.1f MiB"
                  % (what, sent, sent // 1008, RAW_MAX, (peak - rss0) / 1024.0))
            try:
                r = c.read_final_response(20)
            except EOFError:
                raise it.TestFailure("%s listener: the connection closed without an answer after %d raw bytes of 1-byte "
                                     "chunks" % (what, sent))
            check(r.status == 413, "%s listener: %d raw bytes of 1-byte chunks with 1000-byte extensions (%d decoded): "
                  "%s, want 413 body_too_large after at most %d raw bytes" % (what, sent, sent // 1008, r.brief(), RAW_MAX))
            check(b"body_too_large" in r.body, "%s listener: 413 without body_too_large: %r" % (what, r.body[:300]))
            # ltg answers once it has read past the bound; what was still in flight in the
            # sockets' buffers is the slack (a few MiB at most on loopback).
            check(sent <= RAW_MAX + (16 << 20), "%s listener: the 413 came only after %d raw bytes (the bound is %d)"
                  % (what, sent, RAW_MAX))
        grew = (peak - rss0) / 1024.0
        it.log("%s listener: 413 after %d raw bytes sent, RSS %.1f -> peak %.1f MiB" % (what, sent, rss0 / 1024.0, peak / 1024.0))
        if what == "inference":
            check(grew < 64, "%s listener: ltg's RSS grew by %.1f MiB (from %.1f MiB) while %d raw bytes of framing "
                  "arrived, want < 64 MiB" % (what, grew, rss0 / 1024.0, sent))
    # ltg serves on.
    r = it.one_request(a.port, "GET", "/healthz", auth=None)
    check(r.status == 200, "GET /healthz after the framing floods: %s" % r.brief())


@itest("a chunked body that sends only framing (chunk extensions, one data byte a KiB) earns no time: 408 soon "
       "after --head-timeout, the connection closed")
def t_iso_chunk_rate_decoded(a):
    per_send = one_byte_chunks(20)            # ~20 KiB raw, 20 decoded bytes: 5x the 4 KiB/s raw, 1/200th decoded
    t0 = time.monotonic()
    limit = 20.0
    r = None
    with it.Conn(a.port, timeout=30) as c:
        ok = send_quietly(c, chunked_head(a, "/v1/chat/completions"))
        while ok and time.monotonic() - t0 < limit and not answered(c):
            ok = send_quietly(c, per_send)
            time.sleep(0.2)                      # on purpose, the pace: ~100 KiB/s raw, ~100 decoded bytes/s
        dt = time.monotonic() - t0
        check(answered(c) or not ok, "ltg still reads a body of framing (about 100 KiB/s raw, 100 decoded bytes/s) "
              "after %.1f s: the minimum rate (4 KiB/s after --head-timeout %d s) counts raw bytes, not decoded ones"
              % (dt, HEAD_TIMEOUT_S))
        try:
            r = c.read_final_response(10)
        except EOFError:
            raise it.TestFailure("the connection closed after %.1f s without a 408" % dt)
        it.log("a body of framing: %d after %.1f s" % (r.status, dt))
        check(r.status == 408, "a body of framing: %s after %.1f s, want 408 request_timeout" % (r.brief(), dt))
        check(dt >= HEAD_TIMEOUT_S * 0.5, "the 408 came after %.1f s, before --head-timeout %d s" % (dt, HEAD_TIMEOUT_S))
        check(c.wait_closed(10), "the connection stays open after the 408")
    # Zero progress: a chunk of 4000 bytes announced, and its data never sent after the first byte.
    t0 = time.monotonic()
    with it.Conn(a.port, timeout=30) as c:
        c.send(chunked_head(a, "/v1/chat/completions") + b"fa0\r\n{")
        r = c.read_final_response(20)
        dt = time.monotonic() - t0
        check(r.status == 408, "a chunk announced and not sent: %s after %.1f s, want 408" % (r.brief(), dt))
        check(dt < 15, "a chunk announced and not sent: the 408 came after %.1f s" % dt)


# ===== 2. the circuit breaker hears only what ltg would have seen without the client =============

@itest("six calls of one group timed out by their own x-ltg-request-timeout: 200 do not open the breaker: "
       "another group's call to the same model is served by it")
def t_iso_breaker_client_timeout(a):
    alias, up = "ISO-Breaker", MODELS["ISO-Breaker"]
    ga = group(a, [alias])
    gb = group(a, [alias])
    for i in range(6):
        r = it.timed_call(a.port, ga.token, alias, headers={"x-ltg-request-timeout": "200"}, directive="head_delay_ms=1500",
                          content="breaker A %d" % i, timeout=30)
        check(not (r.status == 503 and b"circuit_open" in r.body), "group A call %d: 503 circuit_open: the group's own "
              "x-ltg-request-timeout: 200 opened the model's breaker after %d calls: %s" % (i + 1, i, r.brief()))
        check(r.status == 504, "group A call %d (x-ltg-request-timeout: 200, the model answers after 1.5 s): %s, "
              "want 504" % (i + 1, r.brief()))
    r = it.timed_call(a.port, gb.token, alias, content="breaker B", timeout=30)
    it.check_x_headers(r, 200, 1, alias, "group B's call after group A's six timeouts (a breaker opened by "
                       "another tenant's own timeouts?)")


@itest("six calls timed out by their own x-ltg-deadline do not open the breaker either (with a fallback: "
       "the fallback serves them), and the model serves the next call itself")
def t_iso_breaker_client_deadline(a):
    alias, fb = "ISO-Breaker-D", "ISO-Status-FB"
    ga = group(a, [alias, fb], fallbacks={alias: [fb]})
    gb = group(a, [alias])
    script(MODELS[alias], ["head_delay_ms=1500"] * 6)
    for i in range(6):
        r = it.timed_call(a.port, ga.token, alias, headers={"x-ltg-deadline": "300"},
                          content="deadline A %d" % i, timeout=30)
        check(r.status in (200, 504), "group A call %d: %s" % (i + 1, r.brief()))
        if r.status == 200:
            check(r.header("x-ltg-served-model") == fb, "group A call %d served by %r, want the fallback %s"
                  % (i + 1, r.header("x-ltg-served-model"), fb))
    r = it.timed_call(a.port, gb.token, alias, content="deadline B", timeout=30)
    it.check_x_headers(r, 200, 1, alias, "group B's call after group A's six timeouts")


# ===== 3. a cache hit with a fresh Idempotency-Key stores no copy ===================================

@itest("50 cache hits of a 100 KiB answer, each with a fresh Idempotency-Key, add far less than 50 copies to the "
       "ledger; a retry of one key is answered from the cache (x-ltg-replayed: true, same body, no new event)")
def t_iso_cache_hit_idem(a):
    alias = "ISO-Cache"
    g = group(a, [alias], cache_ttl=60)
    body = it.chat_body(model=alias, directive="content_kb=100", content="cache fill")
    r = it.timed_call(a.port, g.token, alias, body=body, timeout=30)
    it.check_x_headers(r, 200, 1, alias, "the call that fills the cache")
    check(len(r.body) > 100 * 1024, "the answer is only %d bytes (content_kb=100)" % len(r.body))
    first = r.json()["choices"][0]["message"]["content"]
    it.ledger_event(a, g, r.header("x-ltg-request-id"))
    size0 = ledger_bytes(a)
    keys = []
    rids = []
    for i in range(50):
        k = "iso-cache-%d-%s" % (i, os.urandom(6).hex())
        r = it.timed_call(a.port, g.token, alias, body=body, headers={"Idempotency-Key": k}, timeout=30)
        check(r.status == 200, "hit %d: %s" % (i + 1, r.brief()))
        check(r.header("x-ltg-cache") == "hit", "call %d with a fresh Idempotency-Key: x-ltg-cache %r, want hit"
              % (i + 1, r.header("x-ltg-cache")))
        keys.append((k, r.body))
        rids.append(r.header("x-ltg-request-id"))
    it.ledger_event(a, g, rids[-1], wait=20)
    grew = ledger_bytes(a) - size0
    check(grew < 1 << 20, "50 cache hits of a %d-byte answer, each with a fresh Idempotency-Key, grew the ledger by %d "
          "bytes (%.1f answers' worth): copies of the cached answer are stored" % (len(first), grew, grew / len(first)))
    n_before = len(events_of(a, g))
    k, want = keys[17]
    r = it.timed_call(a.port, g.token, alias, body=body, headers={"Idempotency-Key": k}, timeout=30)
    check(r.status == 200, "the retry of a key whose first answer was a cache hit: %s" % r.brief())
    check(r.header("x-ltg-replayed") == "true", "the retry: x-ltg-replayed %r, want true" % r.header("x-ltg-replayed"))
    check(r.body == want, "the retry's body differs from the first answer's (%d vs %d bytes)" % (len(r.body), len(want)))
    # A marker request after it: once its event is in, the retry's would be too.
    r2 = it.timed_call(a.port, g.token, alias, body=it.chat_body(model=alias, content="cache marker"), timeout=30)
    check(r2.status == 200, "the marker call: %s" % r2.brief())
    it.ledger_event(a, g, r2.header("x-ltg-request-id"))
    n_after = len(events_of(a, g))
    check(n_after == n_before + 1, "events of the group: %d before the retry, %d after it and one more call: the "
          "retry made %d events, want none" % (n_before, n_after, n_after - n_before - 1))


# ===== 4. previous_response_id pins are per group ==================================================

def post_response(a, g, model, **kw):
    body = {"model": model, "input": "Hello", **kw}
    return it.timed_call(a.port, g.token, model, path="/v1/responses", body=body, timeout=30)


@itest("previous_response_id naming another group's response: routed to the model asked for, never to (or "
       "naming) the model that made it; no 403 naming that model")
def t_iso_pins_per_group(a):
    ma, mb = "ISO-Resp-A", "ISO-Resp-B"
    ga = group(a, [ma])
    r = post_response(a, ga, ma)
    it.check_x_headers(r, 200, 1, ma, "group A's response")
    rid = r.json().get("id")
    check(isinstance(rid, str) and rid, "group A's response has no id: %r" % r.body[:300])
    # A's own follow-up is pinned (the feature works at all).
    r = post_response(a, ga, ma, previous_response_id=rid)
    it.check_x_headers(r, 200, 1, ma, "group A's own follow-up")
    names = (ma.encode(), MODELS[ma].encode())
    # B may not call A's model.
    gb = group(a, [mb])
    before = mock_calls(MODELS[ma])
    r = post_response(a, gb, mb, previous_response_id=rid)
    check(not any(n in r.body for n in names), "group B's follow-up of group A's response: the answer names A's model: %s"
          % r.brief())
    it.check_x_headers(r, 200, 1, mb, "group B (may not call %s) naming group A's response" % ma)
    check(r.json().get("model") == MODELS[mb], "group B's follow-up answered by upstream %r, want %s"
          % (r.json().get("model"), MODELS[mb]))
    # B may call both: still what it asked for, not A's model.
    gb2 = group(a, [ma, mb])
    r = post_response(a, gb2, mb, previous_response_id=rid)
    it.check_x_headers(r, 200, 1, mb, "group B (may call both) naming group A's response, asking for %s" % mb)
    check(r.json().get("model") == MODELS[mb], "group B's follow-up answered by upstream %r, want %s"
          % (r.json().get("model"), MODELS[mb]))
    check(mock_calls(MODELS[ma]) == before, "the other groups' follow-ups reached A's model (%d calls, want %d)"
          % (mock_calls(MODELS[ma]), before))


# ===== 5. ids, DNS =================================================================================

def linear_complexity(bits):
    """Berlekamp-Massey over GF(2): the length of the shortest LFSR that makes the bit list."""
    n = len(bits)
    c, b = 1, 1            # polynomials as ints, bit i = coefficient of x^i
    l, m = 0, 1
    s = 0                  # s: bits[i-l..i] reversed, as an int (bit j = bits[i-j])
    for i in range(n):
        s = (s << 1 | bits[i]) & ((1 << (n + 1)) - 1)
        d = bin(c & s).count("1") & 1
        # c's coefficient j pairs with bits[i-j] = bit j of s.
        if d == 0:
            m += 1
        elif 2 * l <= i:
            t = c
            c ^= b << m
            l, b, m = i + 1 - l, t, 1
        else:
            c ^= b << m
            m += 1
    return l


MASK64 = (1 << 64) - 1


def undo_xoshiro_starstar(v):
    """xoshiro256**'s output is rotl(s1 * 5, 7) * 9: the state word s1, a linear function of the seed."""
    v = (v * pow(9, -1, 1 << 64)) & MASK64
    v = ((v >> 7) | (v << 57)) & MASK64
    return (v * pow(5, -1, 1 << 64)) & MASK64


@itest("x-ltg-request-id: 1800 ids are distinct, req_ + 24 hex digits, and no bit of them follows a short "
       "linear recurrence (an xorshift/xoshiro state read back from the ids)")
def t_iso_request_ids(a):
    n, window, step = 1800, 900, 100
    ids = []
    with it.Conn(a.port, timeout=30) as c:
        for i in range(n):
            # Refused before dispatch (no key): an id, and (mostly) nothing else drawn from the generator.
            c.send(it.http_request("POST", "/v1/chat/completions", it.chat_body(model="ISO-Cache"), auth=None))
            r = c.read_final_response(15)
            check(r.status == 401, "request %d without a key: %s" % (i + 1, r.brief()))
            rid = r.header("x-ltg-request-id")
            check(rid is not None and re.match(r"^req_[0-9a-f]{24}$", rid), "request %d: x-ltg-request-id %r is not req_ "
                  "+ 24 hex digits" % (i + 1, rid))
            ids.append(rid)
    check(len(set(ids)) == n, "%d distinct ids among %d" % (len(set(ids)), n))
    # The first 64 bits of each id, as they are and with xoshiro256**'s output function undone: a
    # random bit sequence of `window` bits has linear complexity about window/2 (450); a bit of any
    # xorshift-family state of 256 bits has at most 256, whatever the (constant) stride of draws
    # between two ids. Windows, so that another draw now and then (an event's id) does not hide it.
    words = [int(x[4:20], 16) for x in ids]
    for what, seq in (("the first 64 bits", words),
                      ("the first 64 bits, xoshiro256**'s output function undone", [undo_xoshiro_starstar(w) for w in words])):
        for start in range(0, n - window + 1, step):
            part = seq[start:start + window]
            for bit in (0, 1, 31, 32, 63):
                lc = linear_complexity([(w >> bit) & 1 for w in part])
                it.log("ids %d..%d, %s, bit %d: linear complexity %d" % (start, start + window - 1, what, bit, lc))
                check(lc > window * 3 // 8, "request ids %d..%d: %s: bit %d follows a linear recurrence of length %d "
                      "(random: about %d): the next id can be computed from the ones seen"
                      % (start + 1, start + window, what, bit, lc, window // 2))


def _wrong_question_handler(dns, orig):
    """FakeDNS._handle, but a query for DNS_HOST first gets an answer with its id and the question
    DNS_OTHER (an A record of DNS_DECOY_ADDR: a call that used it would fail), then the real one."""
    def handle(pkt, peer):
        qid, qflags, name, question, qtype = dns._parse(pkt)
        if name == DNS_HOST and qtype == 1:
            other_q = it.dns_encode_name(DNS_OTHER) + struct.pack("!HH", 1, 1)
            dns.sock.sendto(dns._build(qid, qflags, other_q, qtype, {"a": [it.DNS_DECOY_ADDR]}), peer)
        return orig(pkt, peer)
    return handle


@it.test("isolation: dns: an answer with the query's id but another question is ignored; the real answer that "
         "follows serves the call")
def t_iso_dns_wrong_question():
    it.need_dns()            # TestSkip without root
    d = it.H.dns
    if not getattr(d, "_iso_wrapped", False):
        d._handle = _wrong_question_handler(d, d._handle)
        d._iso_wrapped = True
    with d.lock:
        d.table[DNS_HOST] = {"a": ["127.0.0.1"], "ttl": 60}
    with open(_resolv_path(), "w") as f:
        f.write("nameserver %s\n" % d.addr)
    aux = it.Aux("isolation-dns", config=_config_path(), args=["--resolv-conf", _resolv_path()])
    try:
        aux.start()
        g = group(aux, ["ISO-DNS"])
        before = d.count(DNS_HOST)
        r = it.timed_call(aux.port, g.token, "ISO-DNS", directive="close", timeout=60)
        check(r.status == 200, "a call whose name's first answer carries another question (%s -> %s): %s"
              % (DNS_OTHER, it.DNS_DECOY_ADDR, r.brief()))
        check(r.json()["choices"][0]["message"]["content"] == "Hello from kimi-k3.", "not the mock's answer: %r"
              % r.body[:200])
        check(r.header("x-ltg-served-model") == "ISO-DNS", "x-ltg-served-model %r" % r.header("x-ltg-served-model"))
        check(d.count(DNS_HOST) - before >= 1, "no query for %s reached the fake DNS server" % DNS_HOST)
        with d.lock:
            errs = list(d.errors)
        check(not errs, "the fake DNS server could not parse ltg's queries: %s" % "; ".join(errs[:3]))
        aux.stop()
    finally:
        aux.close()


# ===== 6. a provider's status line outside 100-599 ==================================================

@itest("a provider status line HTTP/1.1 000 OK -> 502 (never a status 0 relayed); with a fallback the fallback serves")
def t_iso_status_000(a):
    m, fb = "ISO-Status", "ISO-Status-FB"
    g = group(a, [m])
    with it.Conn(a.port, timeout=30) as c:
        c.send(it.http_request("POST", "/v1/chat/completions", it.chat_body(model=m, directive="raw_status=0"), auth=g.token))
        c._fill(time.monotonic() + 20)
        line = c.buf.split(b"\r\n", 1)[0]
        check(line.startswith(b"HTTP/1.1 502"), "a provider's HTTP/1.1 000 OK: the client's status line is %r, want "
              "HTTP/1.1 502" % line[:80])
        r = c.read_final_response(20)
    it.check_openai_error(r, 502)
    gf = group(a, [m, fb], fallbacks={m: [fb]})
    script(MODELS[m], ["raw_status=0"])
    r = it.timed_call(a.port, gf.token, m, timeout=30)
    check(r.status == 200 and r.header("x-ltg-served-model") == fb,
          "HTTP/1.1 000 OK with a fallback: %s served by %r, want 200 from %s" % (r.brief(), r.header("x-ltg-served-model"), fb))
    check(r.header("x-ltg-attempts") == "2", "x-ltg-attempts %r, want 2" % r.header("x-ltg-attempts"))
    # 999 is no status either.
    r = it.timed_call(a.port, g.token, m, directive="raw_status=999", timeout=30)
    check(r.status == 502, "a provider's HTTP/1.1 999 OK: %s, want 502" % r.brief())


# ===== last: the dedicated ltg exits cleanly ======================================================

_LTG.stop_test(__name__, "isolation: the isolation ltg exits 0 on SIGTERM, no sanitizer report in its log",
               "no isolation test ran")


if __name__ == "__main__":   # this file alone: python3 tests/integration_isolation.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
