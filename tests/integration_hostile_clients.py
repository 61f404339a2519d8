"""Integration tests: hostile clients (issue #7, point 2; API.md 5 "Limits and bad input").

tests/integration.py imports this file at start-up and runs its tests with the others; to run only
these:

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k "hostile client"

What they cover, one test each:

1. Request smuggling and malformed framing, on both listeners: Content-Length with
   Transfer-Encoding, conflicting or malformed Content-Lengths, transfer codings other than
   "chunked", obsolete line folding, bare LF, bare CR, NUL bytes, a space before the colon, bad
   chunk sizes. Each answer must be 400 (501 for an unsupported transfer coding) with
   "Connection: close", the connection must be closed, and the request pipelined behind it (a chat
   call, or a token-group create on the control plane) must not run: the mock's request count and
   the number of token groups are unchanged at the end. The cases of tests/integration.py
   ("malformed request line", "header without colon / bad framing") are not repeated.
   Two narrower RFC 9112 rules have a test of their own: an HTTP/1.0 request with
   Transfer-Encoding must not keep its connection (6.1), two Host headers are a 400 (3.2).
2. Slowloris: 300 connections trickle a request head that never ends while a normal client makes
   20 calls; each call is answered promptly, and every slow connection gets 408 and is closed
   --head-timeout after its first byte (trickling does not extend it).
3. The connection cap: (a) --max-conns with a burst of extra connections on each listener: the
   control plane has a cap of its own (min(64, --max-conns)), so a full inference listener does not
   lock the operator out; the held connections keep working, freed slots are served, and the count
   is exact afterwards (no slot leaked by the refused ones); (b) a low `ulimit -n` (an ltg of its
   own, started with RLIMIT_NOFILE 128): ltg logs the cap it derives, survives a flood of more
   connections than it has fds, then a flood of idempotent calls whose clients leave (each that
   runs on keeps an upstream connection: ltg lets at most --max-conns do so and budgets fds for
   them, so the fds never run out and a new client is served meanwhile), and exits 0 on SIGTERM.
4. A client that never reads a ~55 MB stream (small SO_RCVBUF): ltg's RSS stays bounded and the
   mock is held back (what its sockets took, read with ss(8), stops growing far below the stream's
   size); then the client reads it all and gets every event.
5. A client that stops reading a 12 MiB answer (keep-alive, and with Connection: close) is closed
   after --idle-timeout without progress; an idempotent stream whose client stopped reading and
   then left runs to its end without it (no longer held back), and the retry gets it replayed.
6. Another tenant's abandoned calls: one group fills every meter (--max-conns 8: 8 meters), and
   the meter closed to make room is its own oldest, not the quiet group's, whose abandoned answer
   is still read to its end and billed what the provider reported.
7. A body sent all but its last byte, before any key is checked: closed after --idle-timeout with
   nothing flowing; many such bodies at once are capped by the bytes held for unchecked requests.

Timing bounds are wide (a 2-core machine, busy, and the ASan build); lower bounds are only used
where ltg must wait (the 408).
"""

import integration as it

import json
import os
import re
import resource
import selectors
import shutil
import socket
import subprocess
import threading
import types
import time

check = it.check
raise_fd_limit = it.raise_fd_limit
closed_by_peer = it.closed_by_peer
close_all = it.close_all
healthz_ok = it.healthz_ok
wait_until = it.wait_until
held_conns = it.held_conns


# ===== helpers ====================================================================================

def raw_exchange(port, raw, timeout=10.0):
    """Send raw bytes on a new connection: (the first answer or None if closed without one,
    closed within 5 s after it, bytes received after that answer)."""
    with it.Conn(port, timeout=timeout) as c:
        try:
            c.send(raw)
        except OSError:
            pass                        # ltg may close before reading everything
        try:
            r = c.read_final_response(timeout)
        except EOFError:
            return None, True, c.buf
        closed = c.wait_closed(5)
        return r, closed, c.buf


def open_conns(port, n):
    """n connected sockets (non-blocking), opened as fast as possible."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setblocking(False)
        out.append(s)
    return out


def chat_ok(port, token=it.TOKEN, timeout=10.0, source=None):
    """Is a chat call answered 200? source: a loopback address of its own (127.0.0.2...), so that
    the connections a flood holds from 127.0.0.1 (--max-conns-per-ip) do not count against it."""
    try:
        with it.Conn(port, timeout=timeout, source=source) as c:
            c.send(it.http_request("POST", "/v1/chat/completions", it.chat_body(), auth=token))
            return c.read_final_response(timeout).status == 200
    except (OSError, EOFError, it.TestFailure):
        return False


def check_serves(port, admin_port, token=it.TOKEN, what=""):
    """A chat call and /healthz on both listeners succeed on new connections."""
    for p, name in ((port, "inference"), (admin_port, "admin")):
        check(healthz_ok(p), "%sGET /healthz on the %s listener failed" % (what, name))
    r = it.one_request(port, "POST", "/v1/chat/completions", it.chat_body(), auth=token)
    check(r.status == 200, "%sa chat call: %s" % (what, r.brief()))


def mock_requests():
    return it.H.mock_stats()["requests"]


def open_fds(pid):
    try:
        return len(os.listdir("/proc/%d/fd" % pid))
    except OSError:
        return 0


def mock_socket_bytes():
    """What the mock has handed to the kernel on its connections so far: for each socket whose local
    port is the mock's, the bytes the peer acknowledged plus those still queued (ss -ti). None
    without ss(8)."""
    if not shutil.which("ss"):
        return None
    out = subprocess.run(["ss", "-tinH", "state", "established", "( sport = :%d )" % it.H.mock_port],
                         capture_output=True, text=True, timeout=10).stdout
    total = 0
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 4 and cols[0].isdigit() and cols[1].isdigit():
            total += int(cols[1])                       # Send-Q: queued, not yet acknowledged
        m = re.search(r"\bbytes_acked:(\d+)", line)
        if m:
            total += int(m.group(1))
    return total


# ===== 1. request smuggling and malformed framing =================================================

def framing_cases(start, body):
    """(what, raw request, expected status): malformed framings of one POST. `start` is the request
    line and the headers every case shares (each ending in CRLF); `body` its JSON body."""
    n = b"%d" % len(body)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    c = b"%d" % len(chunked)
    crlf = b"\r\n"

    def cl(v):
        return b"Content-Length: " + v + crlf

    def te(v):
        return b"Transfer-Encoding: " + v + crlf

    def bad_chunk(size_line):
        return start + te(b"chunked") + crlf + size_line + body + b"\r\n0\r\n\r\n"

    return [
        # Two framings at once: the classic CL.TE / TE.CL smuggling shapes.
        ("Content-Length and Transfer-Encoding: chunked", start + cl(c) + te(b"chunked") + crlf + chunked, 400),
        ("Transfer-Encoding: chunked, then Content-Length", start + te(b"chunked") + cl(c) + crlf + chunked, 400),
        ("Content-Length: 0 and Transfer-Encoding: chunked", start + cl(b"0") + te(b"chunked") + crlf + chunked, 400),
        ("two different Content-Length lines (N, then 0)", start + cl(n) + cl(b"0") + crlf + body, 400),
        ("Content-Length: N, 0 (a list)", start + cl(n + b", 0") + crlf + body, 400),
        ("Content-Length: +N", start + cl(b"+" + n) + crlf + body, 400),
        ("Content-Length in hex", start + cl(b"0x%x" % len(body)) + crlf + body, 400),
        # Transfer codings ltg does not implement: 501 (RFC 9112 6.1), and close.
        ("Transfer-Encoding: gzip, chunked", start + te(b"gzip, chunked") + crlf + chunked, 501),
        ("Transfer-Encoding: chunked, chunked", start + te(b"chunked, chunked") + crlf + chunked, 501),
        ("two Transfer-Encoding: chunked lines", start + te(b"chunked") + te(b"chunked") + crlf + chunked, 501),
        ("Transfer-Encoding: identity with Content-Length", start + cl(n) + te(b"identity") + crlf + body, 501),
        # Line syntax that parsers read differently.
        ("obsolete line folding", start + b"X-Folded: a\r\n b\r\n" + cl(n) + crlf + body, 400),
        ("Transfer-Encoding folded onto a continuation line", start + b"Transfer-Encoding:\r\n chunked\r\n" + crlf + chunked, 400),
        ("Content-Length folded onto a continuation line", start + b"Content-Length:\r\n\t" + n + crlf + crlf + body, 400),
        ("bare LF line endings throughout", (start + cl(n) + crlf).replace(b"\r\n", b"\n") + body, 400),
        ("a header line ending in a bare LF (then Transfer-Encoding)", start + b"X-A: b\n" + te(b"chunked") + crlf + chunked, 400),
        ("bare CR inside a header value (then Transfer-Encoding)", start + b"X-A: b\r" + te(b"chunked") + crlf + chunked, 400),
        ("bare CR in a header name", start + b"X-\rA: b\r\n" + cl(n) + crlf + body, 400),
        ("NUL in the request target", start.replace(b" HTTP/1.1", b"\x00 HTTP/1.1", 1) + cl(n) + crlf + body, 400),
        ("NUL in a header name", start + b"X-\x00A: b\r\n" + cl(n) + crlf + body, 400),
        ("NUL in a header value", start + b"X-A: a\x00b\r\n" + cl(n) + crlf + body, 400),
        ("Content-Length with a space before the colon", start + b"Content-Length : " + n + crlf + crlf + body, 400),
        ("Transfer-Encoding with a space before the colon", start + b"Transfer-Encoding : chunked\r\n" + crlf + chunked, 400),
        ("Transfer-Encoding with a tab before the colon", start + b"Transfer-Encoding\t: chunked\r\n" + crlf + chunked, 400),
        # Chunk sizes (the body's framing, refused after the head).
        ("chunk size -N", bad_chunk(b"-%x\r\n" % len(body)), 400),
        ("chunk size 0xN", bad_chunk(b"0x%x\r\n" % len(body)), 400),
        ("chunk size of 17 hex digits", bad_chunk(b"1" + b"0" * 16 + b"\r\n"), 400),
        ("chunk size line ending in a bare LF", bad_chunk(b"%x\n" % len(body)), 400),
        ("empty chunk size line", bad_chunk(b"\r\n%x\r\n" % len(body)), 400),
        ("NUL in a chunk extension", bad_chunk(b"%x;a=\x00\r\n" % len(body)), 400),
        ("chunk data not followed by CRLF", start + te(b"chunked") + crlf + b"%x\r\n%sXX0\r\n\r\n" % (len(body), body), 400),
    ]


def check_refused(port, what, raw, status):
    """raw is refused with `status`, Connection: close, the connection closed, nothing after."""
    r, closed, rest = raw_exchange(port, raw)
    check(r is not None, "%s: the connection was closed without an answer" % what)
    check(r.status == status, "%s: expected %d, got %s" % (what, status, r.brief()))
    check((r.header("connection") or "").lower() == "close", "%s: the %d answer lacks Connection: close (headers %r)"
          % (what, status, r.headers))
    check(closed, "%s: the connection was still open 5 s after the %d answer" % (what, status))
    check(rest == b"", "%s: bytes after the %d answer (the pipelined request was served?): %r" % (what, status, rest[:200]))


@it.test("hostile client: request smuggling and malformed framing -> 400/501 and close; the pipelined "
         "request never runs (both listeners)")
def t_smuggling():
    H = it.H
    requests0, groups0 = mock_requests(), it.group_total()
    # The inference plane: a chat call, with a chat call pipelined behind it.
    chat = json.dumps(it.chat_body(model="GLM-5.3-Flash", content="smuggled")).encode()
    start = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
             b"Content-Type: application/json\r\n" % H.token.encode())
    smuggled = it.http_request("POST", "/v1/chat/completions", chat)
    for what, raw, status in framing_cases(start, chat):
        check_refused(H.port, "inference: " + what, raw + smuggled, status)
    # The control plane: a token-group create, with another one pipelined behind it.
    start = (b"POST %s/token_groups HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
             b"Content-Type: application/json\r\nIdempotency-Key: %s\r\n"
             % (it.API.encode(), it.ADMIN_KEY.encode(), it.new_idem("smuggle").encode()))
    group = json.dumps({"name": "smuggled-outer", "allowed_models": ["Kimi-K3"]}).encode()
    smuggled = it.http_request("POST", it.API + "/token_groups", {"name": "smuggled-inner", "allowed_models": ["Kimi-K3"]},
                               {"Idempotency-Key": it.new_idem("smuggle")}, auth=it.ADMIN_KEY)
    for what, raw, status in framing_cases(start, group):
        check_refused(H.admin_port, "admin: " + what, raw + smuggled, status)
    check(H.ltg_alive(), "ltg died")
    check(mock_requests() == requests0, "the mock received %d request(s) during the refused ones (a smuggled "
          "request reached the provider)" % (mock_requests() - requests0))
    check(it.group_total() == groups0, "token groups went from %d to %d: a refused or smuggled create ran"
          % (groups0, it.group_total()))
    check_serves(H.port, H.admin_port, what="after the malformed requests: ")
    # The control: the same two calls, well framed, are both answered and both reach the mock.
    requests0 = mock_requests()
    with it.Conn(H.port) as c:
        c.send(it.http_request("POST", "/v1/chat/completions", chat) + it.http_request("POST", "/v1/chat/completions", chat))
        for i in range(2):
            r = c.read_final_response()
            check(r.status == 200, "well-framed pipelined call %d: %s" % (i + 1, r.brief()))
    check(mock_requests() == requests0 + 2, "two well-framed calls: the mock counted %d" % (mock_requests() - requests0))


@it.test("hostile client: an HTTP/1.0 request with Transfer-Encoding is not kept alive (RFC 9112 6.1)")
def t_http10_transfer_encoding():
    # RFC 9112 6.1: a server that receives an HTTP/1.0 message with Transfer-Encoding MUST treat its
    # framing as faulty and close the connection after processing it, even with keep-alive: an
    # HTTP/1.0 front end does not know chunked and reads the body as the next request.
    requests0 = mock_requests()
    body = json.dumps(it.chat_body(content="http/1.0 chunked")).encode()
    raw = (b"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
           b"Content-Type: application/json\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"%x\r\n%s\r\n0\r\n\r\n" % (it.H.token.encode(), len(body), body))
    raw += it.http_request("POST", "/v1/chat/completions", it.chat_body(content="smuggled"))
    r, closed, rest = raw_exchange(it.H.port, raw)
    check(r is not None, "the connection was closed without an answer")
    check(r.status in (200, 400), "status %s" % r.brief())
    check(rest == b"", "the request pipelined behind it was answered too (%r): the connection was kept"
          % rest[:60])
    check(closed, "the connection was still open 5 s after the answer")
    ran = mock_requests() - requests0
    check(ran <= (1 if r.status == 200 else 0), "%d call(s) reached the mock: the pipelined one ran" % ran)


@it.test("hostile client: two Host headers -> 400 and close (RFC 9112 3.2)")
def t_two_hosts():
    raw = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n"
    for port, what in ((it.H.port, "inference"), (it.H.admin_port, "admin")):
        check_refused(port, "%s: two Host headers" % what, raw, 400)


# ===== 2. slowloris ===============================================================================

SLOW_CONNS = 300
HEAD_TIMEOUT = 4


@it.test("hostile client: slowloris: 300 connections trickling a head; 20 calls served promptly, each slow "
         "one gets 408 and is closed after --head-timeout",
         ltg_args=("--head-timeout", str(HEAD_TIMEOUT), "--max-conns-per-ip", str(SLOW_CONNS + 50)))
def t_slowloris():
    H = it.H
    raise_fd_limit(SLOW_CONNS + 256)
    slow = []                   # [socket, time of its first byte, bytes trickled]
    state = {"answers": {}, "stop": False}

    def trickle():
        """Every 0.5 s: read what the slow connections got, and send one more byte of a header that
        never ends to those not answered yet. Stops when all are closed or told to."""
        answers = state["answers"]
        sel = selectors.DefaultSelector()
        for i, (s, _, _) in enumerate(slow):
            sel.register(s, selectors.EVENT_READ, i)
        got = [b""] * len(slow)
        deadline = time.monotonic() + HEAD_TIMEOUT + 40
        next_send = time.monotonic()
        while len(answers) < len(slow) and not state["stop"] and time.monotonic() < deadline:
            for key, _ in sel.select(0.1):
                i = key.data
                try:
                    data = slow[i][0].recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                got[i] += data
                if not data:
                    sel.unregister(slow[i][0])
                    answers[i] = (time.monotonic(), got[i])
            if time.monotonic() >= next_send:
                next_send += 0.5
                for i, entry in enumerate(slow):
                    if i not in answers and not got[i]:
                        try:
                            entry[0].send(b"a")
                            entry[2] += 1
                        except OSError:
                            pass
        sel.close()

    try:
        for s in open_conns(H.port, SLOW_CONNS):
            s.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            slow.append([s, time.monotonic(), 0])
        opened = time.monotonic()
        th = threading.Thread(target=trickle, name="slowloris", daemon=True)
        th.start()
        # The normal client: 20 calls, each on a new connection, spread over the first 2 s while the
        # slow ones trickle.
        for i in range(20):
            time.sleep(0.1)     # a pace: the calls spread over the trickling
            t0 = time.monotonic()
            r = it.one_request(H.port, "POST", "/v1/chat/completions", it.chat_body(content="normal %d" % i), timeout=10)
            dt = time.monotonic() - t0
            check(r.status == 200, "normal call %d among %d slow connections: %s" % (i, SLOW_CONNS, r.brief()))
            check(dt < 5, "normal call %d took %.1f s among %d slow connections" % (i, dt, SLOW_CONNS))
        it.log("20 calls in %.2f s; %d slow connection(s) answered so far"
               % (time.monotonic() - opened, len(state["answers"])))
        check(healthz_ok(H.admin_port), "the admin listener did not answer among the slow connections")
        th.join(HEAD_TIMEOUT + 45)
        state["stop"] = True
        answers = state["answers"]
        check(len(answers) == len(slow), "%d of %d slow connections still open %d s after their first byte "
              "(--head-timeout %d)" % (len(slow) - len(answers), len(slow), HEAD_TIMEOUT + 40, HEAD_TIMEOUT))
        for i, (s, t_first, trickled) in enumerate(slow):
            t_end, data = answers[i]
            dt = t_end - t_first
            check(data.startswith(b"HTTP/1.1 408 "), "slow connection %d: closed with %r instead of a 408"
                  % (i, data[:80]))
            check(dt >= HEAD_TIMEOUT - 0.5, "slow connection %d: closed %.2f s after its first byte, before "
                  "--head-timeout %d" % (i, dt, HEAD_TIMEOUT))
            check(dt <= HEAD_TIMEOUT + 20, "slow connection %d: closed only %.1f s after its first byte "
                  "(--head-timeout %d)" % (i, dt, HEAD_TIMEOUT))
        most = sorted(t for _, _, t in slow)[len(slow) // 2]
        check(most >= 2, "the slow connections trickled only %d byte(s) each (median): the test did not "
              "test trickling" % most)
    finally:
        state["stop"] = True
        close_all(s for s, _, _ in slow)
    check_serves(H.port, H.admin_port, what="after the slowloris: ")


# ===== 3. the connection cap and fd exhaustion ====================================================

MAX_CONNS = 8


def check_burst_refused(port, n, what):
    """n new connections at once: each closed by ltg within 5 s, with no answer or a 503."""
    socks = open_conns(port, n)
    try:
        closed = closed_by_peer(socks, 5)
        check(len(closed) == n, "%s: %d of %d connections over the cap were still open after 5 s"
              % (what, n - len(closed), n))
        for data in closed.values():
            check(not data or data.startswith(b"HTTP/1.1 503"), "%s: a connection over the cap got %r"
                  % (what, data[:100]))
    finally:
        close_all(socks)


@it.test("hostile client: --max-conns 8: while every connection serves, bursts of extra ones are closed at once; "
         "then idle ones make room; the control plane has a cap of its own, so an inference flood never locks it out",
         ltg_args=("--max-conns", str(MAX_CONNS), "--max-conns-per-ip", str(MAX_CONNS)))
def t_max_conns_burst():
    H = it.H
    raise_fd_limit(512)
    busy, admin, burst = [], [], []
    try:
        # Every inference slot serving a slow call: nothing can be shed.
        before = mock_requests()
        for i in range(MAX_CONNS):
            c = it.Conn(H.port, timeout=30)
            busy.append(c)
            c.send(it.http_request("POST", "/v1/chat/completions", it.chat_body(directive="head_delay_ms=6000", content="busy %d" % i)))
        wait_until(lambda: "the %d slow calls in service (the mock has %d of them)" % (MAX_CONNS, mock_requests() - before),
                   lambda: mock_requests() - before >= MAX_CONNS, 10 * it.SLOW, 0.02)
        check_burst_refused(H.port, 150, "inference burst while every connection serves")
        check(healthz_ok(H.admin_port), "the control plane refused a connection while the inference listener was full")
        for c in busy:
            r = c.read_final_response(30)
            check(r.status == 200, "a call in service during the burst: %s" % r.brief())
        # All idle now: a newcomer takes the place of the one idle longest; the others keep working.
        check(healthz_ok(H.port, source="127.0.0.2"), "a newcomer (another address) while every connection was idle")
        shed = closed_by_peer([c.sock for c in busy], 3)
        check(len(shed) == 1, "%d held connections closed to make room for one newcomer" % len(shed))
        for c in busy:
            if c.sock in shed:
                continue
            c.send(it.http_request("POST", "/v1/chat/completions", it.chat_body()))
            r = c.read_final_response()
            check(r.status == 200, "a held connection after the newcomer: %s" % r.brief())
        # The control plane, min(64, --max-conns) slots: a burst of idle connections takes the places
        # of the held idle ones, and the operator still gets in.
        admin = held_conns(H.admin_port, MAX_CONNS)
        burst = open_conns(H.admin_port, 30)
        # The burst taken (the operator comes after it): ltg has accepted it once the held idle
        # connections it makes room for are closed.
        shed = closed_by_peer([c.sock for c in admin], 10 * it.SLOW)
        check(healthz_ok(H.admin_port), "the control plane after a burst of idle connections")
        r = it.admin("GET", "/token_groups?page[size]=1")
        check(r.status == 200, "an admin call after the burst: %s" % r.brief())
        check(len(shed) == MAX_CONNS, "the held idle admin connections were not "
              "closed to make room for newer ones")
    finally:
        close_all([c.sock for c in busy + admin] + burst)


# ltg caps itself at (128 - 64) / 5 = 12 connections per listener (and 12 metered answers); under
# valgrind, which keeps some of the fds for itself, at fewer.
NOFILE = 128


def orphan_calls(port, token, n, tag):
    """n idempotent calls to a mock that never answers (deadline 6 s), each client leaving at once:
    ltg keeps serving each without its client, so each keeps an upstream connection open until its
    deadline."""
    body = it.chat_body(directive="hang", content="orphan")
    sent = 0
    for i in range(n):
        try:
            with it.Conn(port, timeout=2) as c:
                c.send(it.http_request("POST", "/v1/chat/completions", body, auth=token,
                                       headers={"Idempotency-Key": "%s-%d" % (tag, i), "x-ltg-deadline": "6000"}))
                sent += 1
        except OSError:
            pass
        time.sleep(0.01)        # paced: a burst would mostly meet the connection cap, not make orphans
    return sent


@it.test("hostile client: ulimit -n 128: floods of connections and of calls whose clients leave stay within "
         "the fds ltg budgets; it serves throughout and exits 0")
def t_fd_exhaustion():
    raise_fd_limit(1024)
    # The hanging calls, cut at their deadline, are metered (README "Cost"): 2 s, so their fds come back soon.
    aux = it.Aux("nofile", args=["--meter-abandoned-seconds", "2"],
                 preexec=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE)))
    try:
        aux.start()
        pid = aux.proc.pid
        m = re.search(r"caps connections at (\d+)", aux.text_since_start())
        check(m, "ltg did not log the connection cap it derives from ulimit -n %d: %s" % (NOFILE, aux.text_since_start()[-400:]))
        cap = int(m.group(1))
        check(1 <= cap <= (NOFILE - 64) // 4, "ltg caps connections at %d with ulimit -n %d, want 1 to %d"
              % (cap, NOFILE, (NOFILE - 64) // 4))
        gid = it.create_group(port=aux.admin_port)["id"]
        token = it.create_key(gid, port=aux.admin_port)[1]
        check_serves(aux.port, aux.admin_port, token, "before the floods: ")
        # (1) 350 connections at once, more than ltg has fds: at most `cap` stay open on each listener.
        flood = open_conns(aux.port, 300) + open_conns(aux.admin_port, 50)
        try:
            closed = closed_by_peer(flood, 5)
            kept = len(flood) - len(closed)
            check(aux.proc.poll() is None, "ltg exited with %r during the connection flood" % aux.proc.returncode)
            check(kept <= 2 * cap, "%d connections kept open with a cap of %d per listener" % (kept, cap))
            check(kept >= cap // 2, "only %d connections of the flood were kept, the cap is %d" % (kept, cap))
            it.log("connection flood: %d kept, ltg holds %d fds (limit %d)" % (kept, open_fds(pid), NOFILE))
        finally:
            close_all(flood)
        wait_until("serving after the connection flood", lambda: healthz_ok(aux.port, 3), 10 * it.SLOW)
        check_serves(aux.port, aux.admin_port, token, "after the connection flood: ")
        # (2) Idempotent calls whose clients leave run on without them, each holding an upstream
        # connection; ltg lets at most --max-conns do so (the others are cancelled), and budgets fds
        # for them, so the fds never run out and new clients are served meanwhile.
        log_at = len(aux.text_since_start())
        base, peak = open_fds(pid), [0]

        def watch():
            end = time.monotonic() + 10
            while time.monotonic() < end and aux.proc and aux.proc.poll() is None:
                peak[0] = max(peak[0], open_fds(pid))
                time.sleep(0.05)    # a sampler's pace
        w = threading.Thread(target=watch, daemon=True)
        w.start()
        sent = orphan_calls(aux.port, token, 150, it.new_idem("orphan"))
        # From another address: the flood's last clients, closing as ltg reads them, may still hold
        # 127.0.0.1's --max-conns-per-ip (3 here) when the loaded machine runs ltg late.
        check(chat_ok(aux.port, token, source="127.0.0.2"),
              "a chat call from another address while calls whose clients left were running was not answered 200")
        w.join(12)
        check(aux.proc.poll() is None, "ltg exited with %r during the flood of calls" % aux.proc.returncode)
        it.log("call flood: %d sent, peak %d fds of %d" % (sent, peak[0], NOFILE))
        check(peak[0] >= base + cap // 2, "the calls whose clients left never held %d upstream connections (fds: %d before, "
              "peak %d): the test did not test what it says" % (cap // 2, base, peak[0]))
        check(peak[0] < NOFILE, "ltg's fds reached the limit: %d of %d" % (peak[0], NOFILE))
        logged = aux.text_since_start()[log_at:]
        check("Too many open files" not in logged, "ltg ran out of fds: %r" % logged[-400:])
        wait_until("the calls whose clients left ended", lambda: open_fds(pid) < NOFILE // 2, 30 * it.SLOW, step=0.5)
        # (The hanging calls that ran on time out at their deadline: Kimi-K3's breaker may be open 5 s.)
        wait_until("a chat call answered 200 after the flood of calls", lambda: chat_ok(aux.port, token), 30 * it.SLOW, step=0.5)
        check_serves(aux.port, aux.admin_port, token, "after the flood of calls: ")
        aux.stop()                              # SIGTERM: exit 0 within 15 s (checked by Aux)
    finally:
        aux.close()                             # kills it if still running; fails on a sanitizer report


# ===== 4. a client that never reads its stream ====================================================

STREAM_EVENTS = 300000
STREAM_BYTES = STREAM_EVENTS * 170  # about 170 bytes an event on the wire: ~50 MB
RSS_SLACK_KIB = 16 * 1024


def tcp_state(ports):
    """ss -tinme of the established connections on these local or remote ports, for a failure message."""
    if not shutil.which("ss"):
        return "(no ss)"
    flt = " or ".join("sport = :%d or dport = :%d" % (p, p) for p in ports)
    out = subprocess.run(["ss", "-tinmeoH", "state", "established", "( %s )" % flt],
                         capture_output=True, text=True, timeout=10).stdout
    return " | ".join(" ".join(l.split()) for l in out.replace("\n\t", " ").splitlines())


def count_stream(sock, timeout):
    """Read a chunked SSE answer to its end: (status line, number of "data: " lines, its last bytes).
    Fails `timeout` s after it starts, naming what was read, how long ago the last byte came and the
    TCP state of both hops (client-ltg, ltg-mock), so that a stall says where it is."""
    sock.settimeout(1)
    start = last_byte = time.monotonic()
    deadline, got = start + timeout, [0]

    def recv(size):
        nonlocal last_byte
        while True:
            if time.monotonic() >= deadline:
                raise it.TestFailure(
                    "the stream did not end within %.0f s: %d bytes read, the last %.1f s ago; TCP: %s"
                    % (timeout, got[0], time.monotonic() - last_byte,
                       tcp_state((sock.getsockname()[1], it.H.mock_port))))
            try:
                data = sock.recv(size)
            except socket.timeout:
                continue
            got[0] += len(data)
            last_byte = time.monotonic()
            return data

    head = b""
    while b"\r\n\r\n" not in head:
        data = recv(65536)
        check(data, "closed before the answer's head")
        head += data
    head, buf = head.split(b"\r\n\r\n", 1)
    n, tail, last = 0, b"", b""
    while True:
        window = tail + buf             # tail is shorter than "data: ": no line is counted twice
        n += window.count(b"data: ")
        tail = window[-5:]
        last = (last + buf)[-64:]
        if last.endswith(b"\r\n0\r\n\r\n"):
            it.log("the stream read in %.1f s" % (time.monotonic() - start))
            return head.split(b"\r\n", 1)[0], n, last
        buf = recv(1 << 20)
        check(buf, "the stream was closed before its end (%d events read)" % n)


def wait_mock_stall(pid, rss0, sent0, timeout=30):
    """Sample what the mock's sockets took every 0.5 s until it stays the same for 1.5 s, past what
    must pass before any stall (sent0 + ltg's 256 KiB high-water mark): that value, or None without
    ss(8) (then just wait 5 s). Fails if ltg's RSS passes the bound meanwhile."""
    samples = []
    deadline = time.monotonic() + (timeout if shutil.which("ss") else 5)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        grown = it.rss_kib(pid) - rss0
        check(grown < RSS_SLACK_KIB, "ltg's RSS grew by %d KiB while its client read nothing" % grown)
        samples.append(mock_socket_bytes())
        if samples[-1] is not None and len(samples) >= 4 and samples[-1] == samples[-4] > sent0 + (256 << 10):
            return samples[-1]
    if samples and samples[-1] is not None:
        raise it.TestFailure("the mock kept sending for %d s to a client that read nothing (%d bytes taken)"
                             % (timeout, samples[-1]))
    return None


@it.test("hostile client: a client that never reads a 55 MB stream: ltg's memory stays bounded, the "
         "provider is held back, the stream is whole when read")
def t_never_reads():
    H = it.H
    pid = H.ltg_proc.pid
    it.read_stream(it.chat_body(stream=True, directive="events=2000 event_delay_ms=0"))  # warm up
    rss0 = it.rss_kib(pid)
    sent0 = mock_socket_bytes()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", H.port))
    try:
        s.sendall(it.http_request("POST", "/v1/chat/completions",
                                  it.chat_body(stream=True, directive="events=%d event_delay_ms=0" % STREAM_EVENTS)))
        stalled = wait_mock_stall(pid, rss0, sent0)
        time.sleep(2)
        grown = it.rss_kib(pid) - rss0
        it.log("never-reading client: RSS +%d KiB; the mock's sockets took %s bytes"
               % (grown, None if stalled is None else stalled - sent0))
        check(grown < RSS_SLACK_KIB, "ltg's RSS grew by %d KiB while its client read nothing (bound %d KiB)"
              % (grown, RSS_SLACK_KIB))
        if stalled is None:
            it.log("no ss(8): the provider's back-pressure is not checked")
        else:
            check(mock_socket_bytes() == stalled, "the mock sent more 2 s after it had stalled")
            check(stalled - sent0 < STREAM_BYTES // 2, "the mock sent %d bytes of the %d of the stream to a client "
                  "that read nothing" % (stalled - sent0, STREAM_BYTES))
        # Now read it all: every event, then [DONE] and the last chunk. The 4 KiB receive buffer
        # made the stall quick; read with it, the kernel drops most segments that arrive (each
        # larger than the buffer), and each drop waits for a retransmission timer that doubles:
        # under load, one stall of up to two minutes (the test's flake). A reader has a buffer.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 10)
        status, n, last = count_stream(s, 120)
        check(status.startswith(b"HTTP/1.1 200"), "status line %r" % status)
        check(n == STREAM_EVENTS + 2, "%d data lines, want %d (%d events, the finish event, [DONE])"
              % (n, STREAM_EVENTS + 2, STREAM_EVENTS))
        check(last.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), "the stream does not end with [DONE]: %r" % last)
    finally:
        s.close()
    grown = it.rss_kib(pid) - rss0
    check(grown < RSS_SLACK_KIB, "ltg's RSS grew by %d KiB after the stream" % grown)
    check_serves(H.port, H.admin_port, what="after the never-reading client: ")


ANSWER_KB = 12 * 1024            # a non-stream answer larger than the kernel's socket buffers


def drain(sock, timeout):
    """Read until EOF (True) or `timeout` seconds pass (False); returns (eof, bytes read)."""
    sock.settimeout(0.5)
    got, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = sock.recv(1 << 20)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return True, got
        if not data:
            return True, got
        got += len(data)
    return False, got


def ltg_side_open(sock):
    """Whether ltg's end of the client socket `sock`'s connection is still ESTABLISHED (ss -tn): it
    shows ltg's close before a client that reads nothing could see it. None without ss(8)."""
    if not shutil.which("ss"):
        return None
    out = subprocess.run(["ss", "-tnH", "state", "established", "( sport = :%d and dport = :%d )"
                          % (it.H.port, sock.getsockname()[1])], capture_output=True, text=True, timeout=10).stdout
    return bool(out.strip())


def wait_held_back(sent0, timeout):
    """Until what the mock's sockets took (mock_socket_bytes) has grown past sent0 and then stays the
    same for 1 s: the provider is held back (or done). False without ss(8)."""
    if mock_socket_bytes() is None:
        return False
    samples = []

    def still():
        samples.append(mock_socket_bytes())
        return len(samples) >= 5 and samples[-1] == samples[-5] > sent0
    wait_until(lambda: "the mock's sockets to stop taking bytes (%s after %d)" % (samples[-5:], sent0), still, timeout, 0.25)
    return True


@it.test("hostile client: a client that stops reading a 12 MiB answer (keep-alive, or Connection: close) "
         "is closed after --idle-timeout without progress", ltg_args=("--idle-timeout", "2"))
def t_stops_reading_answer():
    H = it.H
    for headers in ({}, {"Connection": "close"}):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", H.port))
        try:
            s.sendall(it.http_request("POST", "/v1/chat/completions",
                                      it.chat_body(directive="content_kb=%d" % ANSWER_KB), headers=headers))
            what = headers or "keep-alive"
            if ltg_side_open(s) is None:
                # Without ss(8) nothing shows ltg's close to a client that reads nothing: let
                # --idle-timeout 2 pass without a byte taken, with a wide margin.
                time.sleep(8)
            else:
                wait_until("%s: ltg closing the connection of a client that reads nothing (--idle-timeout 2)" % what,
                           lambda: not ltg_side_open(s), 20 * it.SLOW, 0.1)
            eof, got = drain(s, 10 * it.SLOW)
            check(eof, "%s: the connection was still open after the client read nothing (--idle-timeout 2)" % what)
            check(got < ANSWER_KB << 10, "%s: the whole answer (%d bytes) arrived: the test did not test what it says"
                  % (headers or "keep-alive", got))
        finally:
            s.close()
    check_serves(H.port, H.admin_port, what="after the clients that stopped reading: ")


@it.test("hostile client: an idempotent stream whose client stopped reading, then left, runs to its end; "
         "the retry gets it replayed")
def t_detached_paused_stream():
    H = it.H
    body = it.chat_body(stream=True, directive="events=20000 event_delay_ms=0")
    key = it.new_idem("paused-detached")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", H.port))
    try:
        sent0 = mock_socket_bytes()
        s.sendall(it.http_request("POST", "/v1/chat/completions", body, headers={"Idempotency-Key": key}))
        # ltg holds the stream back: its client reads nothing.
        if not wait_held_back(sent0, 30 * it.SLOW):
            time.sleep(2)       # without ss(8) nothing shows it: give it the time
    finally:
        s.close()
    deadline = time.monotonic() + 30 * it.SLOW
    while True:
        r = it.one_request(H.port, "POST", "/v1/chat/completions", body, headers={"Idempotency-Key": key}, timeout=30)
        if r.status != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.5)         # backoff: still running without its client
    check(r.status == 200 and r.header("x-ltg-replayed") == "true",
          "the retry: %s, x-ltg-replayed %r (the stream did not run to its end)" % (r.brief(), r.header("x-ltg-replayed")))
    check(r.body.count(b"data: ") == 20000 + 2, "the replay holds %d data lines, want %d"
          % (r.body.count(b"data: "), 20000 + 2))


# ===== 5. another tenant's abandoned calls =========================================================

@it.test("hostile client: a tenant whose abandoned calls fill every meter closes its own oldest, not another "
         "tenant's: that one is still read to its end and billed what the provider reported")
def t_meters_per_group():
    a = it.Aux("meters-" + os.urandom(2).hex(), args=["--max-conns", "8"])   # 8 meters at most
    try:
        a.start()
        gids = [it.create_group(port=a.admin_port, allowed_models=["Kimi-K3"])["id"] for _ in range(2)]
        tokens = [it.create_key(g, port=a.admin_port)[1] for g in gids]
        hdr = {"x-ltg-request-timeout": "100", "x-ltg-max-attempts": "1"}

        def abandoned(token, delay):
            body = it.chat_body(directive="head_delay_ms=%d input_tokens=1000 output_tokens=5" % delay)
            r = it.one_request(a.port, "POST", "/v1/chat/completions", body, headers=hdr, auth=token, timeout=30)
            check(r.status == 504, "an attempt past its timeout: %s" % r.brief())
            return r.header("x-ltg-request-id")
        quiet = abandoned(tokens[0], 6000)      # the quiet tenant's one meter, the oldest
        for _ in range(12):                     # the noisy tenant's: more than all the meters there are
            abandoned(tokens[1], 20000)
        e = it.ledger_event(a, types.SimpleNamespace(gid=gids[0]), quiet, wait=30 * it.SLOW)
        att = e["attempt_log"][0]
        check(att.get("usage_status") == "reported" and att.get("input_tokens") == 1000 and att.get("output_tokens") == 5,
              "the quiet tenant's abandoned attempt was billed %r for %r in, %r out (%s): its meter was closed by "
              "another tenant's calls" % (att.get("cost"), att.get("input_tokens"), att.get("output_tokens"),
                                          att.get("usage_status")))
    finally:
        a.close()


# ===== 7. bodies held before a key is checked ======================================================

def body_head(path, length, token):
    """A POST's head only, with Content-Length `length` and the bearer token (it.TOKEN: the harness's; None: none)."""
    token = it.H.token if token is it.TOKEN else token
    auth = "Authorization: Bearer %s\r\n" % token if token else ""
    return ("POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path, length, auth)).encode()


@it.test("hostile client: a body sent all but its last byte is closed (408) --head-timeout after its last byte, "
         "however much time its size earned; a body still to come is read only for a valid key: without one, 401 at "
         "once on either plane (413 on a path that takes no body), and 16 such 8 MiB bodies hold no memory",
         ltg_args=("--head-timeout", "2"))
def t_body_before_key():
    H = it.H
    pid = H.ltg_proc.pid
    body = b'{"model":"Kimi-K3","messages":[{"role":"user","content":"' + b"x" * (1 << 20) + b'"}]}'
    with it.Conn(H.port, timeout=30) as c:
        start = time.monotonic()
        c.send(body_head("/v1/chat/completions", len(body), it.TOKEN) + body[:-1])
        r = c.read_final_response(30)
        took = time.monotonic() - start
        check(r.status == 408 and took < 15, "a 1 MiB body stalled before its last byte: %d after %.1f s (its size "
              "earned 256 s; --head-timeout 2 without a byte)" % (r.status, took))
    rss0 = it.rss_kib(pid)
    socks = []
    try:
        for port, path, token, status in ((H.port, "/v1/chat/completions", None, 401),
                                          (H.port, "/v1/chat/completions", "ltg_sk_" + "z" * 43, 401),
                                          (H.admin_port, it.API + "/token_groups", "not-an-admin-key", 401),
                                          (H.port, "/healthz", None, 413)):
            with it.Conn(port, timeout=15) as c:
                c.send(body_head(path, 8 << 20, token) + b"{" * 4096)
                r = c.read_final_response(10)
                check(r.status == status, "%s with %s and a body to come: %s, want %d" % (path, token, r.brief(), status))
                check(c.wait_closed(10), "%s: the connection stayed open after the refusal" % path)
        for _ in range(16):
            s = socket.create_connection(("127.0.0.1", H.port), timeout=15)
            s.sendall(body_head("/v1/chat/completions", 8 << 20, None))
            socks.append(s)
        for s in socks:             # as much as each can send before its 401
            try:
                s.sendall(b"x" * (1 << 20))
            except OSError:
                pass
        grown = it.rss_kib(pid) - rss0
        check(grown < 8 * 1024, "16 bodies of callers without a key grew ltg's RSS by %d KiB" % grown)
    finally:
        for s in socks:
            s.close()
    check_serves(H.port, H.admin_port, what="after the bodies without a key: ")


if __name__ == "__main__":   # this file alone: python3 tests/integration_hostile_clients.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
