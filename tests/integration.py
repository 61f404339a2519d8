#!/usr/bin/env python3
"""Integration tests for ltg: the real binary against the mock provider, over loopback sockets.

    python3 tests/integration.py --ltg ./ltg --mock tests/mock [-k SUBSTRING] [-v]

It picks free loopback ports, writes a catalog config into a temporary directory, starts the mock
provider and ltg, waits for both /healthz, runs every test and stops what it started (also when a
test fails or the runner is interrupted). One line per test: `ok - name`, `FAIL - name: reason`
or `skip - name: reason`; the last line is `N passed, M failed` and the exit code is 1 when any
test failed.

HTTP-level tests talk raw sockets on purpose: byte-by-byte sends, pipelining and malformed input
cannot be written with a client library. Timing checks only use ordering evidence with wide
margins, so that a slow, busy machine does not make them flaky.

Standard library only.
"""

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

DEV_KEY = "dev-key-1"
ADMIN_KEY = "admin-secret-key-for-tests"
PROVIDER_KEY = "secret-provider-key"

VERBOSE = False


class TestFailure(Exception):
    pass


class TestSkip(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise TestFailure(msg)


def log(*a):
    if VERBOSE:
        print("   #", *a, file=sys.stderr, flush=True)


# ===== raw HTTP/1.1 client ==========================================================================

class Response:
    def __init__(self, status, reason, headers):
        self.status = status
        self.reason = reason
        self.headers = headers          # list of (lower-case name, value), in order
        self.body = b""
        self.chunked = False
        self.chunks = []                # [(monotonic time, bytes)] for chunked bodies

    def header(self, name):
        name = name.lower()
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def header_all(self, name):
        name = name.lower()
        return [v for k, v in self.headers if k == name]

    def json(self):
        try:
            return json.loads(self.body.decode("utf-8"))
        except Exception as e:
            raise TestFailure("response body is not JSON (%s): %r" % (e, self.body[:300]))

    def brief(self):
        return "%d %r" % (self.status, self.body[:300])


class Conn:
    """One client TCP connection with a receive buffer."""

    def __init__(self, port, timeout=10.0, nodelay=False):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        if nodelay:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.eof = False

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def send(self, data):
        if isinstance(data, str):
            data = data.encode()
        self.sock.sendall(data)

    def _fill(self, deadline):
        """Read more bytes into buf; raise EOFError at end of stream, TestFailure on timeout."""
        if self.eof:
            raise EOFError("connection closed by peer")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TestFailure("timed out waiting for data (have %r)" % self.buf[:200])
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            raise TestFailure("timed out waiting for data (have %r)" % self.buf[:200])
        except ConnectionResetError:
            self.eof = True
            raise EOFError("connection reset by peer")
        if not data:
            self.eof = True
            raise EOFError("connection closed by peer")
        self.buf += data

    def read_line(self, deadline):
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                line, self.buf = self.buf[:i], self.buf[i + 2:]
                return line
            if len(self.buf) > 1 << 20:
                raise TestFailure("line too long")
            self._fill(deadline)

    def read_exact(self, n, deadline):
        while len(self.buf) < n:
            self._fill(deadline)
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def read_head(self, timeout=15.0):
        """Read a status line and headers. Returns a Response without body."""
        deadline = time.monotonic() + timeout
        line = self.read_line(deadline)
        parts = line.decode("latin-1").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise TestFailure("bad status line %r" % line)
        try:
            status = int(parts[1])
        except ValueError:
            raise TestFailure("bad status line %r" % line)
        headers = []
        while True:
            h = self.read_line(deadline)
            if h == b"":
                break
            if b":" not in h:
                raise TestFailure("bad response header line %r" % h)
            k, v = h.split(b":", 1)
            headers.append((k.decode("latin-1").strip().lower(), v.decode("latin-1").strip()))
        r = Response(status, parts[2] if len(parts) > 2 else "", headers)
        r.version = parts[0]
        return r

    def read_chunk(self, deadline):
        """Read one chunk of a chunked body: its data, or None after the last chunk and trailers."""
        line = self.read_line(deadline)
        size_s = line.split(b";", 1)[0].strip()
        try:
            size = int(size_s, 16)
        except ValueError:
            raise TestFailure("bad chunk size line %r" % line)
        if size == 0:
            while self.read_line(deadline) != b"":
                pass
            return None
        data = self.read_exact(size, deadline)
        crlf = self.read_exact(2, deadline)
        if crlf != b"\r\n":
            raise TestFailure("chunk data not followed by CRLF: %r" % crlf)
        return data

    def read_body(self, r, timeout=15.0, head_request=False):
        deadline = time.monotonic() + timeout
        if head_request or 100 <= r.status < 200 or r.status in (204, 304):
            return r
        te = (r.header("transfer-encoding") or "").lower()
        cl = r.header("content-length")
        if "chunked" in te:
            r.chunked = True
            parts = []
            while True:
                c = self.read_chunk(deadline)
                if c is None:
                    break
                r.chunks.append((time.monotonic(), c))
                parts.append(c)
            r.body = b"".join(parts)
        elif cl is not None:
            r.body = self.read_exact(int(cl), deadline)
        else:
            # Delimited by close.
            try:
                while True:
                    self._fill(deadline)
            except EOFError:
                pass
            r.body, self.buf = self.buf, b""
        return r

    def read_response(self, timeout=15.0, head_request=False):
        r = self.read_head(timeout)
        return self.read_body(r, timeout, head_request)

    def read_final_response(self, timeout=15.0):
        """Skip 1xx interim responses."""
        while True:
            r = self.read_response(timeout)
            if r.status >= 200:
                return r

    def wait_closed(self, timeout):
        """True if the peer closes (EOF or reset) within timeout. Data received before is kept
        in self.buf."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._fill(deadline)
        except EOFError:
            return True
        except TestFailure:
            return False


def http_request(method, path, body=None, headers=None, host="127.0.0.1", auth=DEV_KEY,
                 content_type="application/json"):
    """Serialize a request. body may be a dict (JSON-encoded), str or bytes."""
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode()
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: %s" % host]
    if auth is not None:
        lines.append("Authorization: Bearer %s" % auth)
    hdrs = dict(headers or {})
    if body is not None:
        if content_type and "Content-Type" not in hdrs:
            lines.append("Content-Type: %s" % content_type)
        if "Content-Length" not in hdrs and "Transfer-Encoding" not in hdrs:
            lines.append("Content-Length: %d" % len(body))
    for k, v in hdrs.items():
        lines.append("%s: %s" % (k, v))
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def chat_body(model="Kimi-K3", directive=None, stream=False, content="Hi", **extra):
    b = {"model": model, "messages": [{"role": "user", "content": content}]}
    if stream:
        b["stream"] = True
    if directive:
        b["mock"] = directive
    b.update(extra)
    return b


def one_request(port, method, path, body=None, headers=None, auth=DEV_KEY, timeout=15.0):
    with Conn(port, timeout=timeout) as c:
        c.send(http_request(method, path, body, headers, auth=auth))
        return c.read_final_response(timeout)


def sse_events(r):
    """Split a chunked text/event-stream body into events: [(time the event completed, text)].
    The text is the event without its trailing blank line."""
    events = []
    pending = b""
    for t, data in r.chunks:
        pending += data
        while True:
            i = pending.find(b"\n\n")
            if i < 0:
                break
            ev, pending = pending[:i], pending[i + 2:]
            if ev.strip():
                events.append((t, ev.decode("utf-8")))
    if pending.strip():
        events.append((None, pending.decode("utf-8")))
    return events


def event_data(ev_text):
    """The data: payload of an SSE event (data lines joined)."""
    lines = [l[5:].lstrip(" ") if l.startswith("data:") else None for l in ev_text.split("\n")]
    return "\n".join(l for l in lines if l is not None)


def check_openai_error(r, status, code=None):
    check(r.status == status, "expected status %d, got %s" % (status, r.brief()))
    j = r.json()
    check(isinstance(j, dict) and isinstance(j.get("error"), dict),
          "error body is not OpenAI-shaped {\"error\":{...}}: %r" % r.body[:300])
    e = j["error"]
    for f in ("message", "type", "param", "code"):
        check(f in e, "error body lacks error.%s: %r" % (f, r.body[:300]))
    check(isinstance(e["message"], str) and e["message"], "error.message empty: %r" % r.body[:300])
    if code is not None:
        check(e["code"] == code, "expected error.code %r, got %r (body %r)" % (code, e["code"], r.body[:300]))
    check(r.header("x-ltg-served-model") is None,
          "x-ltg-served-model must be absent on an error answer, got %r" % r.header("x-ltg-served-model"))
    return e


# ===== the harness: ports, config, processes ======================================================

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def port_open(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


class Harness:
    def __init__(self, ltg, mock):
        self.ltg_bin = os.path.abspath(ltg)
        self.mock_bin = os.path.abspath(mock)
        self.tmp = tempfile.mkdtemp(prefix="ltg-it-")
        # Pick the ports while all sockets are held, so that none is picked twice.
        socks = []
        ports = []
        for _ in range(3):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
        for s in socks:
            s.close()
        self.mock_port, self.port, self.admin_port = ports
        # A port that is bound but never listens: connecting to it is refused, and nobody else
        # can take it while we hold it. The "down" provider points here.
        self.dead_sock = socket.socket()
        self.dead_sock.bind(("127.0.0.1", 0))
        self.dead_port = self.dead_sock.getsockname()[1]
        self.config_path = os.path.join(self.tmp, "catalog.json")
        self.data_dir = os.path.join(self.tmp, "data")
        os.makedirs(self.data_dir)
        self.config = {
            "providers": {
                "mock": {"base_url": "http://127.0.0.1:%d/v1" % self.mock_port, "api_key_env": "MOCK_KEY"},
                "down": {"base_url": "http://127.0.0.1:%d/v1" % self.dead_port, "api_key_env": "MOCK_KEY"},
            },
            "models": {
                "Kimi-K3": {"provider": "mock", "upstream_model": "kimi-k3",
                            "input_usd_per_mtok": 0.60, "output_usd_per_mtok": 2.50},
                "GLM-5.3-Flash": {"provider": "mock", "upstream_model": "glm-5.3-flash",
                                  "input_usd_per_mtok": 0.10, "output_usd_per_mtok": 0.40},
                "Down-Model": {"provider": "down", "upstream_model": "down-model",
                               "input_usd_per_mtok": 0.10, "output_usd_per_mtok": 0.40},
            },
            "admin_keys": [{"key_env": "LTG_ADMIN_KEY", "permissions": ["*"]}],
            "dev_keys": [DEV_KEY],
        }
        with open(self.config_path, "w") as f:
            json.dump(self.config, f, indent=2)
        self.env = dict(os.environ)
        self.env["MOCK_KEY"] = PROVIDER_KEY
        self.env["LTG_ADMIN_KEY"] = ADMIN_KEY
        self.mock_proc = None
        self.ltg_proc = None
        self.ltg_args = None
        self.ltg_log_path = os.path.join(self.tmp, "ltg.log")
        self.mock_log_path = os.path.join(self.tmp, "mock.log")
        self.ltg_log = None
        self.mock_log = None
        self.ltg_starts = 0
        self.exit_problems = []

    # --- mock ---

    def start_mock(self):
        if self.mock_log is None:
            self.mock_log = open(self.mock_log_path, "ab")
        self.mock_proc = subprocess.Popen([self.mock_bin, "--port", str(self.mock_port)],
                                          stdin=subprocess.DEVNULL, stdout=self.mock_log,
                                          stderr=self.mock_log, env=self.env)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.mock_proc.poll() is not None:
                raise RuntimeError("mock exited with %s:\n%s" % (self.mock_proc.returncode,
                                                                  tail(self.mock_log_path)))
            try:
                self.mock_get("/_mock/stats")
                return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("mock not ready within 10 s:\n" + tail(self.mock_log_path))

    def mock_get(self, path, conn=None):
        own = conn is None
        c = conn or http.client.HTTPConnection("127.0.0.1", self.mock_port, timeout=10)
        try:
            c.request("GET", path)
            r = c.getresponse()
            body = r.read()
            if r.status != 200:
                raise TestFailure("mock GET %s -> %d %r" % (path, r.status, body[:200]))
            return json.loads(body)
        finally:
            if own:
                c.close()

    def mock_post(self, path, obj, conn=None):
        own = conn is None
        c = conn or http.client.HTTPConnection("127.0.0.1", self.mock_port, timeout=10)
        try:
            c.request("POST", path, body=json.dumps(obj), headers={"Content-Type": "application/json"})
            r = c.getresponse()
            body = r.read()
            if r.status >= 300:
                raise TestFailure("mock POST %s -> %d %r" % (path, r.status, body[:200]))
            return body
        finally:
            if own:
                c.close()

    def mock_stats(self, conn=None):
        return self.mock_get("/_mock/stats", conn)

    def mock_last(self):
        return self.mock_get("/_mock/last")

    def mock_reset(self, conn=None):
        self.mock_post("/_mock/reset", {}, conn)

    # --- ltg ---

    def ltg_cmd(self, extra):
        return [self.ltg_bin, "--config", self.config_path, "--data", self.data_dir,
                "--listen", "127.0.0.1:%d" % self.port,
                "--admin-listen", "127.0.0.1:%d" % self.admin_port] + list(extra)

    def start_ltg(self, extra=()):
        self.stop_ltg()
        if self.ltg_log is None:
            self.ltg_log = open(self.ltg_log_path, "ab")
        self.ltg_log.write(("\n==== starting ltg %s\n" % " ".join(extra)).encode())
        self.ltg_log.flush()
        self.ltg_proc = subprocess.Popen(self.ltg_cmd(extra), stdin=subprocess.DEVNULL,
                                         stdout=self.ltg_log, stderr=self.ltg_log, env=self.env)
        self.ltg_args = tuple(extra)
        self.ltg_starts += 1
        deadline = time.monotonic() + 10
        ready = set()
        while time.monotonic() < deadline:
            if self.ltg_proc.poll() is not None:
                raise RuntimeError("ltg exited with %s during start-up:\n%s"
                                   % (self.ltg_proc.returncode, tail(self.ltg_log_path)))
            for p in (self.port, self.admin_port):
                if p in ready:
                    continue
                try:
                    # Connection: close and read to EOF, so that ltg has closed this connection
                    # before any test starts (matters for --max-conns).
                    with Conn(p, timeout=2) as c:
                        c.send(http_request("GET", "/healthz", auth=None, headers={"Connection": "close"}))
                        r = c.read_response(timeout=2)
                        c.wait_closed(2)
                    if r.status == 200:
                        ready.add(p)
                except Exception:
                    pass
            if len(ready) == 2:
                return
            time.sleep(0.05)
        raise RuntimeError("ltg not ready (GET /healthz on both listeners) within 10 s:\n"
                           + tail(self.ltg_log_path))

    def ltg_alive(self):
        return self.ltg_proc is not None and self.ltg_proc.poll() is None

    def stop_ltg(self):
        p = self.ltg_proc
        if p is None:
            return
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
                rc = p.wait(timeout=12)
                if rc != 0:
                    self.exit_problems.append("ltg %s exited with code %r after SIGTERM"
                                              % (" ".join(self.ltg_args or ()), rc))
            except subprocess.TimeoutExpired:
                self.exit_problems.append("ltg %s still running 12 s after SIGTERM" % " ".join(self.ltg_args or ()))
                p.kill()
                p.wait()
        self.ltg_proc = None
        self.ltg_args = None

    def ensure_ltg(self, extra=()):
        if not self.ltg_alive() or self.ltg_args != tuple(extra):
            self.start_ltg(extra)

    def log_size(self):
        try:
            return os.path.getsize(self.ltg_log_path)
        except OSError:
            return 0

    def sanitizer_report(self, since=0):
        """The first line of a sanitizer report written to ltg's log after offset `since`."""
        try:
            with open(self.ltg_log_path, "rb") as f:
                f.seek(since)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return None
        for line in text.splitlines():
            if "runtime error:" in line or "AddressSanitizer" in line or "LeakSanitizer" in line:
                return line.strip()
        return None

    def shutdown(self):
        for p in (self.ltg_proc, self.mock_proc):
            if p is not None and p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        self.dead_sock.close()
        for f in (self.ltg_log, self.mock_log):
            if f:
                f.close()


def tail(path, n=30):
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join("    | " + l for l in lines[-n:])
    except OSError:
        return "    | (no log)"


H = None  # the Harness


# ===== the tests ==================================================================================
# Each test is a function; the decorator records its name and the ltg flags it needs.

TESTS = []


def test(name, ltg_args=(), fresh=False):
    def deco(fn):
        TESTS.append((name, fn, tuple(ltg_args), fresh))
        return fn
    return deco


# --- 1. health ---

@test("healthz on both listeners")
def t_healthz():
    for port, what in ((H.port, "inference"), (H.admin_port, "admin")):
        r = one_request(port, "GET", "/healthz", auth=None)
        check(r.status == 200, "%s listener: GET /healthz -> %s" % (what, r.brief()))
        check(r.json() == {"status": "ok"}, "%s listener: body %r" % (what, r.body))


# --- 2. non-stream chat relay ---

@test("chat relay (non-stream)")
def t_chat_relay():
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body())
    check(r.status == 200, "status: %s" % r.brief())
    j = r.json()
    check(j.get("object") == "chat.completion", "object: %r" % j.get("object"))
    check(j.get("model") == "kimi-k3", "body model should be the upstream name kimi-k3: %r" % j.get("model"))
    content = j["choices"][0]["message"]["content"]
    check(content == "Hello from kimi-k3.", "content: %r" % content)
    check(r.header("content-length") is not None and not r.chunked,
          "a non-streaming answer must carry Content-Length (headers %r)" % r.headers)
    check(r.header("x-ltg-served-model") == "Kimi-K3", "x-ltg-served-model: %r" % r.header("x-ltg-served-model"))
    check(r.header("x-ltg-attempts") == "1", "x-ltg-attempts: %r" % r.header("x-ltg-attempts"))
    rid = r.header("x-ltg-request-id")
    check(rid, "x-ltg-request-id missing (headers %r)" % r.headers)
    check(r.header("x-request-id") == rid, "X-Request-ID %r != x-ltg-request-id %r" % (r.header("x-request-id"), rid))
    check(len(r.header_all("x-ltg-served-model")) == 1, "x-ltg-served-model repeated")
    # Request ids are per request.
    r2 = one_request(H.port, "POST", "/v1/chat/completions", chat_body())
    check(r2.status == 200, "second call: %s" % r2.brief())
    check(r2.header("x-ltg-request-id") and r2.header("x-ltg-request-id") != rid,
          "two requests got the same request id %r" % rid)


# --- 3. model rewrite, key injection ---

@test("model rewrite and provider key injection")
def t_rewrite_and_key():
    body = {
        "model": "Kimi-K3",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "h\u00e9llo \u2713 \"quoted\" \\ back\nslash"}],
        "temperature": 0.25,
        "max_tokens": 77,
        "top_p": 1e-3,
        "n": 1,
        "stop": ["\n\n", "END"],
        "user": "user-123",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                 "properties": {}}}}],
        "metadata": {"model": "not-this-one", "nested": {"model": "nor-this"}},
        "logit_bias": {"50256": -100},
    }
    raw = json.dumps(body, ensure_ascii=False).encode("utf-8")
    r = one_request(H.port, "POST", "/v1/chat/completions", raw,
                    headers={"X-Custom-Client-Header": "abc"})
    check(r.status == 200, "status: %s" % r.brief())
    last = H.mock_last()
    check(last.get("method") == "POST", "upstream method %r" % last.get("method"))
    check(last.get("path") == "/v1/chat/completions",
          "upstream path should be base_url path + /chat/completions, got %r" % last.get("path"))
    fwd = json.loads(last["body"])
    check(fwd.get("model") == "kimi-k3", "forwarded model %r, want kimi-k3" % fwd.get("model"))
    a = dict(body)
    b = dict(fwd)
    a.pop("model")
    b.pop("model")
    check(a == b, "the forwarded body differs beyond \"model\":\n  sent %r\n  got  %r" % (a, b))
    hdrs = {k.lower(): v for k, v in last.get("headers", {}).items()}
    check(hdrs.get("authorization") == "Bearer " + PROVIDER_KEY,
          "upstream Authorization %r, want Bearer <MOCK_KEY>" % hdrs.get("authorization"))
    for k, v in hdrs.items():
        check(DEV_KEY not in v, "the client's key leaked upstream in header %s: %r" % (k, v))
    if "content-length" in hdrs:
        check(int(hdrs["content-length"]) == len(last["body"].encode("utf-8")),
              "upstream Content-Length %s != forwarded body length %d"
              % (hdrs["content-length"], len(last["body"].encode("utf-8"))))
    # The key must not reach the client either.
    check(PROVIDER_KEY.encode() not in r.body and all(PROVIDER_KEY not in v for _, v in r.headers),
          "the provider key reached the client")


# --- 4. streaming ---

def read_stream(body, timeout=30.0, headers=None):
    with Conn(H.port, timeout=timeout) as c:
        t0 = time.monotonic()
        c.send(http_request("POST", "/v1/chat/completions", body, headers))
        r = c.read_final_response(timeout)
        return t0, r


def check_stream_shape(r, n_content, model="kimi-k3"):
    check(r.status == 200, "status: %s" % r.brief())
    ct = r.header("content-type") or ""
    check(ct.startswith("text/event-stream"), "Content-Type %r" % ct)
    check(r.chunked, "a streaming answer must be Transfer-Encoding: chunked (headers %r)" % r.headers)
    check(r.header("content-length") is None, "a streaming answer must not carry Content-Length")
    check(r.header("x-ltg-served-model") == "Kimi-K3", "x-ltg-served-model: %r" % r.header("x-ltg-served-model"))
    check(r.header("x-ltg-attempts") == "1", "x-ltg-attempts: %r" % r.header("x-ltg-attempts"))
    rid = r.header("x-ltg-request-id")
    check(rid and r.header("x-request-id") == rid, "request id headers: %r / %r"
          % (rid, r.header("x-request-id")))
    evs = sse_events(r)
    datas = [event_data(t) for _, t in evs]
    check(datas and datas[-1] == "[DONE]", "the stream must end with data: [DONE], events: %r" % datas[-3:])
    check(datas.count("[DONE]") == 1, "[DONE] more than once")
    objs = [json.loads(d) for d in datas[:-1]]
    contents = []
    finish = None
    usage_chunks = []
    for o in objs:
        check(o.get("object") == "chat.completion.chunk", "event object %r" % o.get("object"))
        check(o.get("model") == model, "event model %r" % o.get("model"))
        if o.get("choices") == [] and "usage" in o:
            usage_chunks.append(o)
            continue
        ch = o["choices"][0]
        if ch.get("delta", {}).get("content"):
            check(finish is None, "content after finish_reason")
            contents.append(ch["delta"]["content"])
        if ch.get("finish_reason"):
            finish = ch["finish_reason"]
    check(len(contents) == n_content, "expected %d content events, got %d: %r" % (n_content, len(contents), contents))
    check(finish == "stop", "no finish_reason stop")
    return evs, usage_chunks


@test("stream relay: SSE in order, [DONE], chunked")
def t_stream_relay():
    t0, r = read_stream(chat_body(stream=True))
    evs, usage = check_stream_shape(r, 3)
    check(not usage, "the client did not ask for usage (stream_options.include_usage) but got a "
                     "usage chunk: %r" % usage)


@test("stream relay with include_usage passes the usage chunk")
def t_stream_include_usage():
    t0, r = read_stream(chat_body(stream=True, stream_options={"include_usage": True}))
    evs, usage = check_stream_shape(r, 3)
    check(len(usage) == 1, "the client asked for include_usage: expected one usage chunk, got %r" % usage)
    u = usage[0]["usage"]
    check(u.get("total_tokens") == u.get("prompt_tokens", 0) + u.get("completion_tokens", 0),
          "usage %r" % u)


@test("stream events are relayed as they arrive")
def t_stream_incremental():
    t0, r = read_stream(chat_body(stream=True, directive="event_delay_ms=400 events=4"), timeout=40)
    evs, _ = check_stream_shape(r, 4)
    t_first = evs[0][0]
    t_last = evs[-1][0]
    check(t_first is not None and t_last is not None, "events not delimited")
    # The mock spends >= 4 * 400 ms between the first event and [DONE].
    gap = t_last - t_first
    check(gap >= 0.8, "the first event arrived only %.0f ms before the last: ltg buffers the stream"
          % (gap * 1000))
    # The events also arrive spread out, not in one burst at the end.
    times = [t for t, _ in evs if t is not None]
    check(times[1] - times[0] >= 0.15 or times[2] - times[1] >= 0.15,
          "events arrived in one burst: %r" % [round(t - t0, 3) for t in times])


# --- 5. embeddings ---

@test("embeddings relay")
def t_embeddings():
    r = one_request(H.port, "POST", "/v1/embeddings", {"model": "GLM-5.3-Flash", "input": "hello world"})
    check(r.status == 200, "status: %s" % r.brief())
    j = r.json()
    check(j.get("object") == "list", "object %r" % j.get("object"))
    check(j["data"][0]["embedding"] == [0.1, 0.2, 0.3], "embedding %r" % j["data"][0].get("embedding"))
    check(j.get("model") == "glm-5.3-flash", "model %r" % j.get("model"))
    check(r.header("x-ltg-served-model") == "GLM-5.3-Flash", "x-ltg-served-model: %r" % r.header("x-ltg-served-model"))
    check(r.header("x-ltg-attempts") == "1", "x-ltg-attempts: %r" % r.header("x-ltg-attempts"))
    check(r.header("x-ltg-request-id"), "x-ltg-request-id missing")
    last = H.mock_last()
    check(last.get("path") == "/v1/embeddings", "upstream path %r" % last.get("path"))
    fwd = json.loads(last["body"])
    check(fwd == {"model": "glm-5.3-flash", "input": "hello world"}, "forwarded body %r" % fwd)


# --- 6. upstream keep-alive ---

@test("upstream connections are reused (keep-alive pool)")
def t_upstream_keepalive():
    ctl = http.client.HTTPConnection("127.0.0.1", H.mock_port, timeout=10)
    try:
        H.mock_reset(ctl)
        for i in range(10):
            r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(content="call %d" % i))
            check(r.status == 200, "call %d: %s" % (i, r.brief()))
        st = H.mock_stats(ctl)
    finally:
        ctl.close()
    check(st.get("requests") == 10, "mock saw %r inference requests, want 10" % st.get("requests"))
    check(st.get("connections", 99) <= 2,
          "10 sequential calls opened %r upstream connections (want 1, at most 2)" % st.get("connections"))


# --- 7. client disconnect mid-stream ---

@test("client disconnect mid-stream closes the upstream")
def t_client_disconnect():
    ctl = http.client.HTTPConnection("127.0.0.1", H.mock_port, timeout=10)
    try:
        H.mock_stats(ctl)  # open the control connection before counting
        c = Conn(H.port, timeout=20)
        try:
            c.send(http_request("POST", "/v1/chat/completions",
                                chat_body(stream=True, directive="event_delay_ms=500 events=20")))
            r = c.read_head(20)
            check(r.status == 200, "status %d" % r.status)
            first = c.read_chunk(time.monotonic() + 20)
            check(first and b"data:" in first, "first chunk %r" % first)
            during = H.mock_stats(ctl)["open_connections"]
        finally:
            c.close()
        deadline = time.monotonic() + 5
        after = during
        while time.monotonic() < deadline:
            after = H.mock_stats(ctl)["open_connections"]
            if after < during:
                break
            time.sleep(0.1)
        check(after < during, "the upstream connection stayed open after the client left "
              "(mock open_connections %d during the stream, %d 5 s after the client closed)" % (during, after))
    finally:
        ctl.close()
    # ltg is still healthy.
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body())
    check(r.status == 200, "a call after the disconnect: %s" % r.brief())


# --- 8. client keep-alive, pipelining ---

@test("client keep-alive: two requests on one connection")
def t_client_keepalive():
    with Conn(H.port) as c:
        for i in range(2):
            c.send(http_request("POST", "/v1/chat/completions", chat_body(content="ka %d" % i)))
            r = c.read_final_response()
            check(r.status == 200, "request %d: %s" % (i, r.brief()))
            check((r.header("connection") or "").lower() != "close", "ltg closed a keep-alive connection")
        c.send(http_request("GET", "/healthz", auth=None))
        r = c.read_final_response()
        check(r.status == 200, "third request: %s" % r.brief())


@test("pipelining: two requests in one write, answers in order")
def t_pipelining():
    first = http_request("POST", "/v1/chat/completions",
                         chat_body(model="Kimi-K3", directive="head_delay_ms=500"))
    second = http_request("POST", "/v1/chat/completions", chat_body(model="GLM-5.3-Flash"))
    third = http_request("GET", "/healthz", auth=None)
    with Conn(H.port) as c:
        c.send(first + second + third)
        r1 = c.read_final_response(20)
        r2 = c.read_final_response(20)
        r3 = c.read_final_response(20)
    check(r1.status == 200 and r2.status == 200, "statuses %s / %s" % (r1.brief(), r2.brief()))
    check(r1.json().get("model") == "kimi-k3" and r1.header("x-ltg-served-model") == "Kimi-K3",
          "first answer is not the first request's: %r" % r1.body[:200])
    check(r2.json().get("model") == "glm-5.3-flash" and r2.header("x-ltg-served-model") == "GLM-5.3-Flash",
          "second answer is not the second request's: %r" % r2.body[:200])
    check(r3.status == 200 and r3.json() == {"status": "ok"}, "third answer: %s" % r3.brief())
    # A streaming answer followed by a pipelined plain one.
    with Conn(H.port, timeout=30) as c:
        c.send(http_request("POST", "/v1/chat/completions",
                            chat_body(stream=True, directive="event_delay_ms=100 events=3"))
               + http_request("POST", "/v1/chat/completions", chat_body(model="GLM-5.3-Flash")))
        r1 = c.read_final_response(20)
        r2 = c.read_final_response(20)
    check_stream_shape(r1, 3)
    check(r2.status == 200 and r2.json().get("model") == "glm-5.3-flash",
          "the request pipelined after a stream: %s" % r2.brief())


@test("Connection: close and HTTP/1.0 close after the answer")
def t_connection_close():
    with Conn(H.port) as c:
        c.send(http_request("GET", "/healthz", auth=None, headers={"Connection": "close"}))
        r = c.read_final_response()
        check(r.status == 200, "status %s" % r.brief())
        check(c.wait_closed(5), "ltg did not close after answering a Connection: close request")
    with Conn(H.port) as c:
        c.send(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
        r = c.read_final_response()
        check(r.status == 200, "HTTP/1.0 status %s" % r.brief())
        check(c.wait_closed(5), "ltg did not close after answering an HTTP/1.0 request without keep-alive")


@test("100 requests on one keep-alive connection")
def t_many_on_one_connection():
    with Conn(H.port) as c:
        for i in range(100):
            if i % 2:
                c.send(http_request("POST", "/v1/chat/completions", chat_body(content="n%d" % i)))
            else:
                c.send(http_request("POST", "/v1/embeddings", {"model": "Kimi-K3", "input": "n%d" % i}))
            r = c.read_final_response()
            check(r.status == 200, "request %d: %s" % (i, r.brief()))


@test("large request body (2 MiB) relayed intact")
def t_large_body():
    text = "".join(chr(ord("a") + i % 26) for i in range(2 * 1024 * 1024))
    body = chat_body(content=text)
    with Conn(H.port, timeout=30) as c:
        c.send(http_request("POST", "/v1/chat/completions", body))
        r = c.read_final_response(30)
    check(r.status == 200, "status %s" % r.brief())
    fwd = json.loads(H.mock_last()["body"])
    check(fwd["messages"][0]["content"] == text, "the forwarded content differs (length %d vs %d)"
          % (len(fwd["messages"][0]["content"]), len(text)))


# --- 9. byte by byte ---

@test("request sent one byte at a time")
def t_byte_by_byte():
    req = http_request("POST", "/v1/chat/completions", chat_body(content="slow client"))
    with Conn(H.port, nodelay=True, timeout=30) as c:
        for i in range(len(req)):
            c.sock.send(req[i:i + 1])
            if i % 4 == 3:
                time.sleep(0.002)
        r = c.read_final_response(20)
    check(r.status == 200, "status %s" % r.brief())
    check(r.json()["choices"][0]["message"]["content"] == "Hello from kimi-k3.", "body %r" % r.body[:200])
    fwd = json.loads(H.mock_last()["body"])
    check(fwd["messages"][0]["content"] == "slow client", "forwarded body %r" % fwd)


# --- 10. chunked request bodies, Expect: 100-continue ---

def chunked(data, sizes):
    out = b""
    i = 0
    k = 0
    while i < len(data):
        n = sizes[k % len(sizes)]
        part = data[i:i + n]
        # Upper- and lower-case hex, a chunk extension now and then.
        size = ("%X" if k % 2 else "%x") % len(part)
        ext = ";ext=1" if k % 3 == 2 else ""
        out += size.encode() + ext.encode() + b"\r\n" + part + b"\r\n"
        i += n
        k += 1
    return out + b"0\r\n\r\n"


@test("chunked request body")
def t_chunked_request():
    body = json.dumps(chat_body(content="chunked " * 20)).encode()
    req = http_request("POST", "/v1/chat/completions", chunked(body, [7, 30, 1, 200]),
                       headers={"Transfer-Encoding": "chunked"})
    with Conn(H.port) as c:
        c.send(req)
        r = c.read_final_response()
        check(r.status == 200, "status %s" % r.brief())
        fwd = json.loads(H.mock_last()["body"])
        check(fwd["messages"][0]["content"] == "chunked " * 20, "forwarded body %r" % fwd)
        # The connection is still usable after a chunked body.
        c.send(http_request("GET", "/healthz", auth=None))
        r = c.read_final_response()
        check(r.status == 200, "request after a chunked body: %s" % r.brief())


@test("Expect: 100-continue")
def t_expect_continue():
    body = json.dumps(chat_body(content="after continue")).encode()
    head = http_request("POST", "/v1/chat/completions", None,
                        headers={"Expect": "100-continue", "Content-Length": str(len(body)),
                                 "Content-Type": "application/json"})
    with Conn(H.port) as c:
        c.send(head)
        r = c.read_head(10)
        check(r.status == 100, "expected HTTP/1.1 100 Continue before the body, got %d" % r.status)
        c.send(body)
        r = c.read_final_response()
    check(r.status == 200, "status %s" % r.brief())
    check(r.json()["choices"][0]["message"]["content"] == "Hello from kimi-k3.", "body %r" % r.body[:200])


# --- 11. limits ---

@test("head over 16 KiB -> 431")
def t_head_too_large():
    with Conn(H.port) as c:
        head = "GET /healthz HTTP/1.1\r\nHost: x\r\n"
        for i in range(40):
            head += "X-Filler-%d: %s\r\n" % (i, "a" * 500)
        try:
            c.send(head.encode() + b"\r\n")
        except OSError:
            pass  # ltg may close before reading everything
        r = c.read_final_response()
        check(r.status == 431, "status %s" % r.brief())
        check(c.wait_closed(5), "connection not closed after 431")
    # A single long header line too (no CRLF at all within 16 KiB).
    with Conn(H.port) as c:
        try:
            c.send(b"GET /healthz HTTP/1.1\r\nX-Long: " + b"b" * 20000)
        except OSError:
            pass
        r = c.read_final_response()
        check(r.status == 431, "long header line: status %s" % r.brief())
        check(c.wait_closed(5), "connection not closed after 431")


@test("Content-Length over 8 MiB -> 413 after the head")
def t_body_too_large():
    with Conn(H.port) as c:
        c.send(http_request("POST", "/v1/chat/completions", None,
                            headers={"Content-Length": str(8 * 1024 * 1024 + 1),
                                     "Content-Type": "application/json"}))
        c.send(b'{"model":"Kimi-K3",')
        r = c.read_final_response(10)
        check(r.status == 413, "status %s" % r.brief())
        check(c.wait_closed(5), "connection not closed after 413")
    # Exactly 8 MiB is allowed... we don't send it; but a chunked body that grows past the limit is
    # refused too (sent in 1 MiB chunks, answer expected before 9 MiB have gone).
    with Conn(H.port, timeout=30) as c:
        c.send(http_request("POST", "/v1/chat/completions", None,
                            headers={"Transfer-Encoding": "chunked", "Content-Type": "application/json"}))
        chunk = b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n"
        try:
            for _ in range(10):
                c.sock.sendall(chunk)
        except OSError:
            pass
        r = c.read_final_response(15)
        check(r.status == 413, "chunked body over 8 MiB: status %s" % r.brief())


@test("head timeout -> 408 and close", ltg_args=("--head-timeout", "1"))
def t_head_timeout():
    with Conn(H.port, timeout=15) as c:
        t0 = time.monotonic()
        c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        r = c.read_final_response(10)
        dt = time.monotonic() - t0
        check(r.status == 408, "status %s" % r.brief())
        check(dt >= 0.5, "408 came after %.2f s, before the 1 s head timeout" % dt)
        check(c.wait_closed(5), "connection not closed after 408")
    # A connection that completes its head in time is not affected.
    with Conn(H.port, timeout=15) as c:
        c.send(b"GET /healthz HTTP/1.1\r\nHo")
        time.sleep(0.3)
        c.send(b"st: x\r\n\r\n")
        r = c.read_final_response()
        check(r.status == 200, "a head finished within the timeout: %s" % r.brief())


@test("malformed request line -> 400 and close")
def t_malformed_request_line():
    for bad in (b"GARBAGE\r\n\r\n",
                b"GET /healthz HTTP/9.9 extra\r\nHost: x\r\n\r\n",
                b"GET /healthz FOO/1.1\r\nHost: x\r\n\r\n",
                b"\x00\x01\x02 / HTTP/1.1\r\n\r\n"):
        with Conn(H.port) as c:
            c.send(bad)
            try:
                r = c.read_final_response(10)
            except EOFError:
                raise TestFailure("%r: connection closed without a 400 answer" % bad)
            check(r.status == 400, "%r: status %s" % (bad, r.brief()))
            check(c.wait_closed(5), "%r: connection not closed after 400" % bad)
    check(H.ltg_alive(), "ltg died")


@test("header without colon / bad framing -> 400 and close")
def t_malformed_header():
    cases = [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    ]
    for bad in cases:
        with Conn(H.port) as c:
            c.send(bad)
            try:
                r = c.read_final_response(10)
            except EOFError:
                raise TestFailure("%r: connection closed without a 400 answer" % bad)
            check(r.status == 400, "%r: status %s" % (bad, r.brief()))
            check(c.wait_closed(5), "%r: connection not closed after 400" % bad)
    check(H.ltg_alive(), "ltg died")


@test("--max-conns 2: the third connection is closed at once", ltg_args=("--max-conns", "2"))
def t_max_conns():
    a = Conn(H.port)
    b = Conn(H.port)
    try:
        # Make sure ltg has accepted both before the third arrives.
        for c in (a, b):
            c.send(http_request("GET", "/healthz", auth=None))
            r = c.read_final_response()
            check(r.status == 200, "one of the first two connections: %s" % r.brief())
        with Conn(H.port) as third:
            t0 = time.monotonic()
            closed = third.wait_closed(4)
            check(closed, "the third connection was not closed (waited 4 s)")
            check(not third.buf or third.buf.startswith(b"HTTP/1.1 503"),
                  "the third connection got unexpected bytes %r" % third.buf[:200])
        for c in (a, b):
            c.send(http_request("POST", "/v1/chat/completions", chat_body()))
            r = c.read_final_response()
            check(r.status == 200, "the first two still work: %s" % r.brief())
    finally:
        a.close()
    try:
        # With one slot free again, a new connection is served.
        deadline = time.monotonic() + 5
        last = None
        while time.monotonic() < deadline:
            try:
                with Conn(H.port) as c:
                    c.send(http_request("GET", "/healthz", auth=None))
                    r = c.read_final_response(3)
                    if r.status == 200:
                        break
                    last = r.brief()
            except (EOFError, OSError, TestFailure) as e:
                last = repr(e)
            time.sleep(0.2)
        else:
            raise TestFailure("after a connection closed, a new one was still refused: %s" % last)
    finally:
        b.close()


@test("idle keep-alive connection closed after --idle-timeout", ltg_args=("--idle-timeout", "1"))
def t_idle_timeout():
    with Conn(H.port, timeout=15) as c:
        c.send(http_request("GET", "/healthz", auth=None))
        r = c.read_final_response()
        check(r.status == 200, "status %s" % r.brief())
        t0 = time.monotonic()
        closed = c.wait_closed(8)
        dt = time.monotonic() - t0
        check(closed, "the idle connection was still open 8 s after its answer (idle timeout 1 s)")
        check(dt >= 0.5, "closed after %.2f s, before the 1 s idle timeout" % dt)
        check(c.buf == b"", "unexpected bytes before close: %r" % c.buf[:200])
    # A connection that never sends a byte is idle too.
    with Conn(H.port, timeout=15) as c:
        check(c.wait_closed(8), "a connection that never sent anything was still open after 8 s")
    # A busy connection is not idle: an upstream that takes 2.5 s to answer, and a slow stream
    # (4 x 400 ms), both outlive the 1 s idle timeout.
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(directive="head_delay_ms=2500"))
    check(r.status == 200, "a non-stream call whose upstream answers after 2.5 s: %s" % r.brief())
    try:
        t0, r = read_stream(chat_body(stream=True, directive="event_delay_ms=400 events=4"), timeout=40)
    except TestFailure as e:
        raise TestFailure("a 2 s stream with --idle-timeout 1: %s" % e)
    check_stream_shape(r, 4)


# --- 12. errors ---

@test("auth errors -> 401 OpenAI-shaped")
def t_auth_errors():
    body = chat_body()
    r = one_request(H.port, "POST", "/v1/chat/completions", body, auth=None)
    check_openai_error(r, 401, "invalid_api_key")
    r = one_request(H.port, "POST", "/v1/chat/completions", body, auth="not-a-key")
    check_openai_error(r, 401, "invalid_api_key")
    r = one_request(H.port, "POST", "/v1/chat/completions", body, auth=ADMIN_KEY)
    check_openai_error(r, 401, "invalid_api_key")
    r = one_request(H.port, "POST", "/v1/chat/completions", body, auth=DEV_KEY + "x")
    check_openai_error(r, 401, "invalid_api_key")
    with Conn(H.port) as c:
        c.send(http_request("POST", "/v1/chat/completions", body, auth=None,
                            headers={"Authorization": "Basic " + DEV_KEY}))
        check_openai_error(c.read_final_response(), 401, "invalid_api_key")
    r = one_request(H.port, "POST", "/v1/embeddings", {"model": "Kimi-K3", "input": "x"}, auth=None)
    check_openai_error(r, 401, "invalid_api_key")


@test("invalid JSON body -> 400 with byte offset")
def t_invalid_json():
    r = one_request(H.port, "POST", "/v1/chat/completions", b'{"model": "Kimi-K3", "messages": [}')
    e = check_openai_error(r, 400, "invalid_json")
    check("byte offset" in e["message"], "error.message lacks \"byte offset\": %r" % e["message"])
    r = one_request(H.port, "POST", "/v1/chat/completions", b'')
    check(r.status == 400, "empty body: %s" % r.brief())
    r = one_request(H.port, "POST", "/v1/chat/completions", b'{"model":"Kimi-K3"} trailing')
    check_openai_error(r, 400, "invalid_json")


@test("missing or invalid model field -> 400")
def t_missing_model():
    r = one_request(H.port, "POST", "/v1/chat/completions", {"messages": []})
    check_openai_error(r, 400, "invalid_request")
    r = one_request(H.port, "POST", "/v1/chat/completions", {"model": 5, "messages": []})
    check_openai_error(r, 400, "invalid_request")
    r = one_request(H.port, "POST", "/v1/chat/completions", [1, 2])
    check(r.status == 400, "a JSON array body: %s" % r.brief())


@test("unknown model alias -> 404")
def t_unknown_model():
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(model="No-Such-Model"))
    check_openai_error(r, 404, "model_not_found")
    # The upstream name is not an alias.
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(model="kimi-k3"))
    check_openai_error(r, 404, "model_not_found")


@test("unknown path -> 404, wrong method -> 405")
def t_unknown_path_and_method():
    r = one_request(H.port, "POST", "/v1/nope", chat_body())
    check_openai_error(r, 404, "not_found")
    r = one_request(H.port, "GET", "/nope")
    check(r.status == 404, "GET /nope: %s" % r.brief())
    r = one_request(H.port, "GET", "/v1/chat/completions")
    check(r.status == 405, "GET /v1/chat/completions: %s" % r.brief())
    check_openai_error(r, 405)
    r = one_request(H.port, "DELETE", "/v1/embeddings")
    check(r.status == 405, "DELETE /v1/embeddings: %s" % r.brief())
    # The connection stays usable after an error answer.
    with Conn(H.port) as c:
        c.send(http_request("POST", "/v1/nope", chat_body()))
        check(c.read_final_response().status == 404, "404 expected")
        c.send(http_request("GET", "/healthz", auth=None))
        check(c.read_final_response().status == 200, "request after a 404 on the same connection failed")


# --- 13. upstream failures ---

@test("upstream 503 relayed with its body")
def t_upstream_503():
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(directive="status=503"))
    e = check_openai_error(r, 503)
    check(e["message"] == "mock error 503", "the mock's body was not relayed: %r" % r.body[:300])
    check(r.header("x-ltg-attempts") == "1", "x-ltg-attempts: %r" % r.header("x-ltg-attempts"))
    check(r.header("x-ltg-request-id"), "x-ltg-request-id missing on an error answer")
    # The same for a streaming request: the error is relayed as JSON, not as SSE.
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(stream=True, directive="status=503"))
    e = check_openai_error(r, 503)
    check(e["message"] == "mock error 503", "stream: the mock's body was not relayed: %r" % r.body[:300])
    # A 400 context-length error is relayed as it is, too.
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(directive="context_length"))
    e = check_openai_error(r, 400, "context_length_exceeded")
    check("maximum context length" in e["message"], "message %r" % e["message"])
    # And the next call is fine.
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body())
    check(r.status == 200, "a call after an upstream error: %s" % r.brief())


@test("upstream down -> 502 OpenAI-shaped")
def t_upstream_down():
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(model="Down-Model"), timeout=30)
    check_openai_error(r, 502)
    check(r.header("x-ltg-request-id"), "x-ltg-request-id missing on 502")
    r = one_request(H.port, "POST", "/v1/chat/completions",
                    chat_body(model="Down-Model", stream=True), timeout=30)
    check_openai_error(r, 502)


@test("upstream reset -> 502")
def t_upstream_reset():
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(directive="reset"), timeout=30)
    check_openai_error(r, 502)
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body())
    check(r.status == 200, "a call after an upstream reset: %s" % r.brief())


@test("upstream framing (length, chunked, eof, close) -> Content-Length answer")
def t_upstream_framing():
    for d in ("framing=length", "framing=chunked", "framing=eof", "close", "close framing=chunked"):
        for i in range(2):   # the second call checks that the pool survived the first
            r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(directive=d))
            check(r.status == 200, "%s (call %d): %s" % (d, i + 1, r.brief()))
            check(r.header("content-length") is not None and not r.chunked,
                  "%s: a non-streaming answer must carry Content-Length" % d)
            j = r.json()
            check(j["choices"][0]["message"]["content"] == "Hello from kimi-k3.", "%s: body %r" % (d, r.body[:200]))
            check(r.header("x-ltg-served-model") == "Kimi-K3", "%s: x-ltg-served-model %r"
                  % (d, r.header("x-ltg-served-model")))


@test("upstream cut mid-stream -> SSE error event, no [DONE]")
def t_upstream_cut_stream():
    t0, r = read_stream(chat_body(stream=True, directive="cut_after=2"))
    check(r.status == 200, "status %s" % r.brief())
    datas = [event_data(t) for _, t in sse_events(r)]
    check("[DONE]" not in datas, "a cut stream must not end with [DONE]: %r" % datas[-2:])
    check(len(datas) >= 3, "events %r" % datas)
    contents = [d for d in datas[:-1] if '"content"' in d]
    check(len(contents) == 2, "expected the 2 events sent before the cut, got %r" % datas[:-1])
    last = json.loads(datas[-1])
    check(isinstance(last.get("error"), dict) and last["error"].get("code") == "stream_interrupted",
          "the last event should be an error event with code stream_interrupted: %r" % datas[-1])
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body())
    check(r.status == 200, "a call after a cut stream: %s" % r.brief())


@test("upstream restart: stale pooled connections are not fatal")
def t_upstream_restart():
    for i in range(2):
        r = one_request(H.port, "POST", "/v1/chat/completions", chat_body())
        check(r.status == 200, "warm-up call: %s" % r.brief())
    H.mock_proc.kill()
    H.mock_proc.wait()
    H.start_mock()
    for i in range(3):
        r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(content="after restart %d" % i))
        check(r.status == 200, "call %d after the provider restarted: %s" % (i + 1, r.brief()))
        check(r.header("x-ltg-served-model") == "Kimi-K3", "x-ltg-served-model %r" % r.header("x-ltg-served-model"))


@test("duplicate \"model\" keys cannot smuggle another model upstream")
def t_duplicate_model_key():
    # ltg authorizes and bills the alias it reads; an upstream whose JSON parser keeps the last
    # duplicate key (most do) must not see a different model. Refusing (400) or forwarding only
    # the rewritten model are both fine.
    raw = b'{"model":"Kimi-K3","messages":[{"role":"user","content":"x"}],"model":"gpt-4o"}'
    r = one_request(H.port, "POST", "/v1/chat/completions", raw)
    if r.status == 400:
        check_openai_error(r, 400)
        return
    check(r.status == 200, "status %s" % r.brief())
    fwd = H.mock_last()["body"]
    objects = []   # every object's key/value pairs, innermost first: the top level comes last
    json.loads(fwd, object_pairs_hook=lambda pairs: objects.append(pairs) or dict(pairs))
    models = [v for k, v in objects[-1] if k == "model"]
    check(set(models) == {"kimi-k3"}, "ltg checked Kimi-K3 but forwarded %r: an upstream that keeps the "
          "last duplicate key would serve %r" % (fwd, models[-1]))


@test("concurrent streams are relayed independently")
def t_concurrent_streams():
    results = [None] * 4
    errors = []

    def worker(i):
        try:
            model = "Kimi-K3" if i % 2 == 0 else "GLM-5.3-Flash"
            with Conn(H.port, timeout=30) as c:
                c.send(http_request("POST", "/v1/chat/completions",
                                    chat_body(model=model, stream=True, directive="event_delay_ms=200 events=5")))
                results[i] = (model, c.read_final_response(30))
        except Exception as e:
            errors.append("stream %d: %r" % (i, e))

    ths = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    t0 = time.monotonic()
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    dt = time.monotonic() - t0
    check(not errors, "; ".join(errors))
    for model, r in results:
        check(r.status == 200, "status %s" % r.brief())
        datas = [event_data(t) for _, t in sse_events(r)]
        check(datas[-1] == "[DONE]", "%s: no [DONE]" % model)
        up = "kimi-k3" if model == "Kimi-K3" else "glm-5.3-flash"
        for d in datas[:-1]:
            check(json.loads(d)["model"] == up, "%s: an event of another stream: %r" % (model, d))
        check(r.header("x-ltg-served-model") == model, "x-ltg-served-model %r" % r.header("x-ltg-served-model"))
    # 4 streams of ~1.2 s each, one at a time, would take >= 4.8 s.
    check(dt < 4.5, "4 concurrent streams took %.1f s: they were not served concurrently" % dt)


# --- 14. SIGTERM drain ---

@test("SIGTERM drains an in-flight stream, refuses new connections, exits 0", fresh=True)
def t_sigterm_drain():
    proc = H.ltg_proc
    with Conn(H.port, timeout=30) as c:
        c.send(http_request("POST", "/v1/chat/completions",
                            chat_body(stream=True, directive="event_delay_ms=300 events=5")))
        r = c.read_head(20)
        check(r.status == 200, "status %d" % r.status)
        parts = []
        first = c.read_chunk(time.monotonic() + 20)
        check(first and b"data:" in first, "first chunk %r" % first)
        parts.append(first)
        proc.send_signal(signal.SIGTERM)
        t_sig = time.monotonic()
        # New connections are refused (both listeners), soon after the signal.
        refused = {}
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and len(refused) < 2:
            for p in (H.port, H.admin_port):
                if p in refused:
                    continue
                try:
                    s = socket.create_connection(("127.0.0.1", p), timeout=1)
                    s.close()
                except ConnectionRefusedError:
                    refused[p] = time.monotonic() - t_sig
                except OSError:
                    pass
            time.sleep(0.05)
        # The in-flight stream completes.
        while True:
            ch = c.read_chunk(time.monotonic() + 20)
            if ch is None:
                break
            parts.append(ch)
    body = b"".join(parts).decode()
    evs = [event_data(e) for e in body.split("\n\n") if e.strip()]
    check(evs and evs[-1] == "[DONE]", "the drained stream did not end with [DONE]: %r" % evs[-2:])
    check(len([e for e in evs if e != "[DONE]"]) == 6, "expected 5 content events + the finish event, got %r" % evs)
    try:
        rc = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        raise TestFailure("ltg still running 15 s after SIGTERM with nothing in flight")
    check(rc == 0, "ltg exited with code %r after SIGTERM" % rc)
    check(H.port in refused, "a new connection to the inference listener was not refused after SIGTERM")
    check(H.admin_port in refused, "a new connection to the admin listener was not refused after SIGTERM")


@test("SIGTERM drain is bounded by --drain-seconds", ltg_args=("--drain-seconds", "1"), fresh=True)
def t_sigterm_drain_bounded():
    proc = H.ltg_proc
    with Conn(H.port, timeout=30) as c:
        c.send(http_request("POST", "/v1/chat/completions",
                            chat_body(stream=True, directive="event_delay_ms=500 events=30")))
        r = c.read_head(20)
        check(r.status == 200, "status %d" % r.status)
        first = c.read_chunk(time.monotonic() + 20)
        check(first and b"data:" in first, "first chunk %r" % first)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            raise TestFailure("ltg still running 10 s after SIGTERM with --drain-seconds 1 "
                              "(the stream would take 15 s)")
        dt = time.monotonic() - t0
        check(rc == 0, "exit code %r" % rc)
        check(c.wait_closed(5), "the client connection was not closed when ltg exited")
        check(b"[DONE]" not in c.buf, "the 15 s stream cannot have completed in %.1f s" % dt)


@test("SIGTERM with nothing in flight exits 0 at once", fresh=True)
def t_sigterm_idle():
    proc = H.ltg_proc
    # An idle keep-alive connection must not hold the drain open.
    with Conn(H.port) as c:
        c.send(http_request("GET", "/healthz", auth=None))
        check(c.read_final_response().status == 200, "healthz")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            raise TestFailure("ltg still running 8 s after SIGTERM with only an idle connection open")
    check(rc == 0, "exit code %r" % rc)


# --- 15. the official OpenAI node SDK ---

@test("sdk")
def t_sdk():
    node = shutil.which("node")
    npm = shutil.which("npm")
    mod = os.path.join(HERE, "node_modules", "openai")
    if not node:
        raise TestSkip("no node")
    if not os.path.isdir(mod):
        if not npm:
            raise TestSkip("no npm and tests/node_modules/openai is missing")
        try:
            p = subprocess.run([npm, "install", "--prefix", HERE, "--no-audit", "--no-fund",
                                "--no-save", "openai@4"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=120)
        except subprocess.TimeoutExpired:
            raise TestSkip("npm install openai@4 took more than 120 s")
        if p.returncode != 0 or not os.path.isdir(mod):
            raise TestSkip("npm install openai@4 failed: %s" % p.stdout.decode(errors="replace")[-300:])
    p = subprocess.run([node, os.path.join(HERE, "sdk_test.mjs"),
                        "http://127.0.0.1:%d/v1" % H.port, DEV_KEY],
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=120)
    out = p.stdout.decode(errors="replace").strip()
    check(p.returncode == 0, "sdk_test.mjs exited %d: %s" % (p.returncode, out[-600:]))


# ===== runner =====================================================================================

def main():
    global H, VERBOSE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ltg", required=True)
    ap.add_argument("--mock", required=True)
    ap.add_argument("-k", action="append", default=[], help="run only tests whose name contains this")
    ap.add_argument("-v", action="store_true", help="show ltg's log tail on failures")
    args = ap.parse_args()
    VERBOSE = args.v
    for what, path in (("ltg", args.ltg), ("mock", args.mock)):
        if not os.access(path, os.X_OK):
            print("FAIL - setup: %s binary %s is missing or not executable" % (what, path))
            print("0 passed, 1 failed")
            return 1

    passed = failed = skipped = 0
    H = Harness(args.ltg, args.mock)

    def on_signal(signum, frame):
        raise KeyboardInterrupt()
    signal.signal(signal.SIGTERM, on_signal)

    try:
        try:
            H.start_mock()
            H.start_ltg()
        except Exception as e:
            print("FAIL - setup: %s" % e)
            print("0 passed, 1 failed")
            return 1
        for name, fn, ltg_args, fresh in TESTS:
            if args.k and not any(k.lower() in name.lower() for k in args.k):
                continue
            try:
                if fresh:
                    H.start_ltg(ltg_args)
                else:
                    H.ensure_ltg(ltg_args)
                proc = H.ltg_proc
                log_at = H.log_size()
                try:
                    fn()
                finally:
                    san = H.sanitizer_report(log_at)
                    if san:
                        raise TestFailure("sanitizer report in ltg's log: %s" % san)
                if not fresh and proc.poll() is not None:
                    raise TestFailure("ltg exited with code %r during the test" % proc.returncode)
                print("ok - %s" % name, flush=True)
                passed += 1
            except TestSkip as e:
                print("skip - %s: %s" % (name, e), flush=True)
                skipped += 1
            except KeyboardInterrupt:
                raise
            except Exception as e:
                if isinstance(e, TestFailure):
                    reason = str(e)
                else:
                    reason = "%s: %s" % (type(e).__name__, e)
                    if VERBOSE:
                        traceback.print_exc()
                crashed = H.ltg_proc is not None and H.ltg_proc.poll() is not None
                if crashed and not fresh:
                    reason += " (ltg exited with code %r)" % H.ltg_proc.returncode
                print("FAIL - %s: %s" % (name, reason.replace("\n", " ")), flush=True)
                if VERBOSE:
                    print(tail(H.ltg_log_path, 15), file=sys.stderr)
                failed += 1
        # Last: every ltg this run stopped (and the one still running) exited 0 on SIGTERM, and no
        # sanitizer complained (leaks are reported at exit).
        if not args.k:
            H.stop_ltg()
            problems = list(H.exit_problems)
            san = H.sanitizer_report(0)
            if san:
                problems.append("sanitizer report in ltg's log: %s" % san)
            if problems:
                print("FAIL - clean exits: %s" % "; ".join(problems), flush=True)
                failed += 1
            else:
                print("ok - clean exits (SIGTERM -> exit 0, no sanitizer report)", flush=True)
                passed += 1
    except KeyboardInterrupt:
        print("FAIL - interrupted")
        failed += 1
    finally:
        H.shutdown()
        if failed == 0:
            shutil.rmtree(H.tmp, ignore_errors=True)
        else:
            print("# logs kept in %s" % H.tmp, file=sys.stderr)
    print("%d passed, %d failed" % (passed, failed) + (", %d skipped" % skipped if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
