#!/usr/bin/env python3
"""Integration tests for ltg: the real binary against the mock provider, over loopback sockets.

    python3 tests/integration.py --ltg ./ltg --mock tests/mock [-k SUBSTRING] [-v] [--wrap CMD [--slow N]]
                                 [--jobs N | --file NAME [--shard I/N]]

Every file (this one and each tests/integration_*.py) runs in a process of its own, --jobs (6) at a
time, with its own harness: mock, ports, temporary and data directories. Its lines are printed
whole when it ends, under a `--- FILE: N passed, M failed` line; the last line sums them all.
--jobs 1 runs every file in this process, one after the other, on one harness. --file NAME (or
`python3 tests/integration_NAME.py ...`) runs one file.

It picks free loopback ports, writes a catalog config into a temporary directory, starts the mock
provider and ltg, waits for both /healthz, runs every test and stops what it started (also when a
test fails or the runner is interrupted). One line per test: `ok - name`, `FAIL - name: reason`
or `skip - name: reason`; the last line is `N passed, M failed` and the exit code is 1 when any
test failed.

Credentials: the catalog has the admin key LTG_ADMIN_KEY (permissions ["*"]) and a few admin keys
with limited permissions (LIMITED_KEYS: some given by key_sha256, some by key_env). After ltg starts,
the harness provisions a token group (every catalog model) and a token key through the control
plane, and the inference tests use that key (TOKEN, H.token). The key lives in --data: a restart on
the same data dir must keep it (checked), a new data dir gets a new one.

The control-plane tests (API.md 3) check status, error code, source.pointer, headers and bodies of
every endpoint; the inference-auth tests API.md 4's refusals. Tests that damage the state log, kill
ltg, reload its catalog or run the README's walkthrough start their own ltg (Aux: same catalog,
own ports, --data and log) so that the main one is not disturbed. When ltg cannot start on the main
--data (a replay that crashes), that data dir is set aside and the next tests start on an empty one,
so that one bug fails one test rather than all that follow.

--wrap "valgrind ..." puts that command before every ltg the harness starts (`make valgrind`); the
harness's start-up and shutdown waits are then multiplied by --slow (default 5 with --wrap). A
valgrind report in an ltg's log fails the test during which it was written, as a sanitizer's does;
leaks are reported when ltg exits, so at the end every ltg still running is stopped with SIGTERM
and its log checked ("clean exits").

The DNS tests run a fake DNS server on UDP port 53 of another loopback address (127.0.0.2) and
start ltg with --resolv-conf naming it; binding port 53 needs root, so without it they are
skipped.

HTTP-level tests talk raw sockets on purpose: byte-by-byte sends, pipelining and malformed input
cannot be written with a client library. Timing checks only use ordering evidence with wide
margins, so that a slow, busy machine does not make them flaky.

Standard library only.
"""

import argparse
import contextlib
import datetime
import errno
import fcntl
import hashlib
import http.client
import itertools
import json
import os
import random
import re
import resource
import selectors
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

# What each attempt_log entry says it was charged (README "Cost").
ATTEMPT_BILL = {"input_tokens", "cache_read_tokens", "cache_write_tokens", "cache_write_1h_tokens", "output_tokens",
                "reasoning_tokens", "cost", "usage_status"}

ADMIN_KEY = "admin-secret-key-for-tests"          # permissions ["*"], given by key_env LTG_ADMIN_KEY
PROVIDER_KEY = "secret-provider-key"
API = "/v2/llm_token_gateway"                    # the control plane's base path

# Admin keys with limited permissions (API.md 3.6), for the permission tests: name -> (the key, how
# the catalog gives it: "sha256" for key_sha256, or the name of the environment variable of key_env,
# its permissions).
P_GROUPS_READ = "llm_token_gateway.token_groups.read"
P_GROUPS_WRITE = "llm_token_gateway.token_groups.write"
P_KEYS_READ = "llm_token_gateway.token_keys.read"
P_KEYS_WRITE = "llm_token_gateway.token_keys.write"
P_SPEND_READ = "llm_token_gateway.spend.read"
P_USAGE_READ = "llm_token_gateway.usage.read"
LIMITED_KEYS = {
    "groups_read": ("admin-groups-read-key-0001", "sha256", [P_GROUPS_READ]),
    "groups_write": ("admin-groups-write-key-0002", "LTG_IT_GROUPS_WRITE_KEY", [P_GROUPS_WRITE]),
    "keys_read": ("admin-keys-read-key-0003", "LTG_IT_KEYS_READ_KEY", [P_KEYS_READ]),
    "keys_write": ("admin-keys-write-key-0004", "sha256", [P_KEYS_WRITE]),
    "spend": ("admin-spend-usage-key-0005", "sha256", [P_SPEND_READ, P_USAGE_READ]),
    "metrics": ("admin-metrics-read-key-0006", "sha256", ["llm_token_gateway.metrics.read"]),
}


def limited_key(name):
    return LIMITED_KEYS[name][0]


class _TokenKey:
    """The default credential of the inference-plane helpers: the token key (ltg_sk_...) that the
    harness provisions through the control plane after ltg starts (H.token)."""

    def __repr__(self):
        return "TOKEN"


TOKEN = _TokenKey()

VERBOSE = False
WRAP = []       # --wrap: a command prefix for every ltg started (e.g. valgrind and its options)
SLOW = 1.0      # --slow: the factor for the harness's start-up and shutdown waits


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

    def __init__(self, port, timeout=10.0, nodelay=False, source=None):
        # source: a loopback address of its own (127.0.0.2...), for the limits per client address
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                             source_address=(source, 0) if source else None)
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


def http_request(method, path, body=None, headers=None, host="127.0.0.1", auth=TOKEN,
                 content_type="application/json"):
    """Serialize a request. body may be a dict (JSON-encoded), str or bytes. auth: a bearer key,
    None for no Authorization header, or TOKEN for the harness's token key."""
    if auth is TOKEN:
        auth = H.token
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


def one_request(port, method, path, body=None, headers=None, auth=TOKEN, timeout=15.0):
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


def sse_datas(r):
    """The data of each event of an SSE answer."""
    return [event_data(t) for _, t in sse_events(r)]


def check_whole_stream(r, upstream_model, what):
    """A complete stream: event-stream, chunked, 3 content events from upstream_model, finish stop, one
    [DONE] last."""
    ct = r.header("content-type") or ""
    check(ct.startswith("text/event-stream"), "%s: Content-Type %r, want text/event-stream" % (what, ct))
    check(r.chunked, "%s: a stream must be chunked" % what)
    datas = sse_datas(r)
    check(datas and datas[-1] == "[DONE]" and datas.count("[DONE]") == 1,
          "%s: the stream does not end with one [DONE]: %r" % (what, [d[:80] for d in datas[-3:]]))
    contents, finish = 0, None
    for d in datas[:-1]:
        try:
            o = json.loads(d)
        except ValueError:
            raise TestFailure("%s: an event that is not JSON was relayed: %r" % (what, d[:100]))
        check("error" not in o, "%s: an error event in a whole stream: %r" % (what, d[:200]))
        check(o.get("model") == upstream_model, "%s: an event from %r, want %r" % (what, o.get("model"), upstream_model))
        ch = o.get("choices") or []
        if ch and ch[0].get("delta", {}).get("content"):
            contents += 1
        if ch and ch[0].get("finish_reason"):
            finish = ch[0]["finish_reason"]
    check(contents == 3 and finish == "stop", "%s: %d content events and finish %r, want 3 and stop"
          % (what, contents, finish))


def proc_status_kib(pid, field):
    """A size (KiB) of /proc/PID/status: VmRSS, VmHWM..."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise TestFailure("no %s in /proc/%d/status" % (field, pid))


def rss_kib(pid):
    return proc_status_kib(pid, "VmRSS")


def event_data(ev_text):
    """The data: payload of an SSE event (data lines joined)."""
    lines = [l[5:].lstrip(" ") if l.startswith("data:") else None for l in ev_text.split("\n")]
    return "\n".join(l for l in lines if l is not None)


def sse_named(r):
    """The events of an SSE answer that carry data (comments left out), each (its event: name or
    None, its data parsed as JSON, or the text when it is not JSON: "[DONE]")."""
    out = []
    for _, text in sse_events(r):
        name, data = None, []
        for line in text.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if not data:
            continue
        d = "\n".join(data)
        try:
            d = json.loads(d)
        except ValueError:
            pass
        out.append((name, d))
    return out


_INSTALLED = {}         # package -> why it could not be installed ("" when it was, or not tried)


def debian_tool(name, package):
    """The path of the command `name` (Debian package `package`): installed with apt-get when missing
    and we are root; TestSkip saying what to install when it cannot be had."""
    def find():
        return shutil.which(name) or next((p for p in ("/usr/sbin/" + name, "/usr/bin/" + name) if os.access(p, os.X_OK)), None)
    path = find()
    if path:
        return path
    if package not in _INSTALLED:
        with install_lock():
            _install_debian(find, package)
    path = find()
    if path:
        return path
    why = _INSTALLED.get(package, "")
    raise TestSkip("%s not found: install the Debian package %s (apt-get install -y %s)%s"
                      % (name, package, package, "; " + why if why else ""))


def _install_debian(find, package):
    """debian_tool's apt-get install of `package` (under install_lock()): its outcome in _INSTALLED."""
    why = ""
    if find():
        pass            # another run installed it while we waited for the lock
    elif os.geteuid() != 0:
        why = "not root, so not installed by the test"
    elif not shutil.which("apt-get"):
        why = "no apt-get"
    else:
        logpath = os.path.join(H.tmp, "apt-%s.log" % package)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        # Keep the package from starting its system service (nginx on port 80) while it installs.
        policy, made = "/usr/sbin/policy-rc.d", False
        if not os.path.exists(policy):
            try:
                with open(policy, "w") as f:
                    f.write("#!/bin/sh\nexit 101\n")
                os.chmod(policy, 0o755)
                made = True
            except OSError:
                pass
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=120", package]
        ok = False
        try:
            with open(logpath, "ab") as logf:
                for cmd in (install, ["apt-get", "update", "-q"], install):
                    try:
                        rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env,
                                            timeout=900).returncode
                    except (OSError, subprocess.TimeoutExpired) as e:
                        rc = "%s" % e
                    if cmd is install and rc == 0:
                        ok = True
                        break
        finally:
            if made:
                try:
                    os.unlink(policy)
                except OSError:
                    pass
        if not ok:
            why = "apt-get install -y %s failed (see %s)" % (package, logpath)
    _INSTALLED[package] = why


def ledger_event(a, g, rid, wait=15.0):
    """The spend event of request rid in group g (g.gid) of ltg a, waited for (bounded): an attempt
    given up on is metered until its answer comes, and the event written after it (README "Cost")."""
    today = datetime.datetime.now(datetime.timezone.utc).date()
    q = "/spend/events?start_date=%s&end_date=%s&token_group_id=%s&page[size]=1000" % (
        today - datetime.timedelta(days=1), today + datetime.timedelta(days=2), g.gid)
    deadline = time.monotonic() + wait
    while True:
        j = check_admin_ok(admin("GET", q, port=a.admin_port), 200, "GET /spend/events")
        for e in j["data"]:
            if e.get("request_id") == rid:
                return e
        if time.monotonic() > deadline:
            raise TestFailure("no spend event with request_id %s among %d events of the group after %g s" % (rid, len(j["data"]), wait))
        time.sleep(0.1)


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

# The first line of a report: a sanitizer's, or valgrind's ("==PID== Invalid read of size 8", "... are
# definitely lost in loss record ...", "ERROR SUMMARY: 3 errors ...").
VALGRIND_REPORT = re.compile(r"^==\d+== (Invalid (read|write|free)|Mismatched free|Conditional jump|Use of uninit"
                             r"|Syscall param|Source and destination overlap|Process terminating"
                             r"|.* (definitely|indirectly|possibly) lost in loss record|ERROR SUMMARY: [1-9])")


def sanitizer_line(text):
    """The first line of a sanitizer or valgrind report in text (with valgrind's first frames), or None."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "runtime error:" in line or "AddressSanitizer" in line or "LeakSanitizer" in line:
            return line.strip()
        if VALGRIND_REPORT.match(line):
            frames = [l.split("== ", 1)[1].strip() for l in lines[i + 1:i + 5] if re.match(r"^==\d+== +(at|by) ", l)]
            return " | ".join([line.strip()] + frames)
    return None


def ltg_argv(argv):
    """An ltg command line, with the --wrap prefix."""
    return WRAP + argv


class _PortBlock:
    """The loopback ports this process gives out: a block of PORT_BLOCK ports below the kernel's
    ephemeral range, claimed with an flock held until the process exits, so that the runs of
    --jobs (and any other run of this suite on the machine) never pick the same port, and no
    outgoing connection (whose source port is ephemeral) can take one between free_port() and
    the bind of the process it is meant for. Without a free block (or room below the ephemeral
    range), the kernel picks, as bind(port 0) does."""

    def __init__(self):
        self.base = None        # the first port of the block; None: not claimed yet
        self.lock = None        # the open lock file (its flock is the claim)
        self.next = 0

    def _claim(self):
        self.base = 0
        try:
            with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
                eph_lo = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            eph_lo = 32768
        nblocks = (eph_lo - PORT_LOW) // PORT_BLOCK
        d = os.path.join(tempfile.gettempdir(), "ltg-it-ports")
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            return
        for b in range(max(nblocks, 0)):
            try:
                f = open(os.path.join(d, "block-%d.lock" % b), "a")
            except OSError:
                return
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            self.lock, self.base = f, PORT_LOW + b * PORT_BLOCK
            return

    def take(self):
        """A port of the block that nothing is bound to now (nor in TIME_WAIT on: no SO_REUSEADDR)."""
        if self.base is None:
            self._claim()
        for _ in range(2 * PORT_BLOCK if self.base else 0):
            port = self.base + self.next
            self.next = (self.next + 1) % PORT_BLOCK
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
            finally:
                s.close()
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        return port


PORT_LOW, PORT_BLOCK = 10000, 1000
_PORTS = _PortBlock()


def free_port():
    """A loopback port nobody listens on, for a process this run starts (see _PortBlock)."""
    return _PORTS.take()


@contextlib.contextmanager
def install_lock():
    """Held while a test installs a tool (apt-get, npm): one install at a time among the
    concurrent runs of --jobs, which would otherwise race for dpkg's lock or tests/node_modules.
    Check again whether the tool is there once it is held."""
    with open(os.path.join(tempfile.gettempdir(), "ltg-it-install.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
        self.mock_port, self.port, self.admin_port = free_port(), free_port(), free_port()
        # A port that is bound but never listens: connecting to it is refused, and nobody else
        # can take it while we hold it. The "down" provider points here.
        self.dead_sock = socket.socket()
        self.dead_sock.bind(("127.0.0.1", free_port()))
        self.dead_port = self.dead_sock.getsockname()[1]
        self.config_path = os.path.join(self.tmp, "catalog.json")
        self.data_dir = os.path.join(self.tmp, "data")
        os.makedirs(self.data_dir)
        self.config = {
            "providers": {
                "mock": catalog_provider(self.mock_port),
                "down": catalog_provider(self.dead_port),
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
        }
        for key, how, perms in LIMITED_KEYS.values():
            if how == "sha256":
                self.config["admin_keys"].append({"key_sha256": hashlib.sha256(key.encode()).hexdigest(),
                                                  "permissions": perms})
            else:
                self.config["admin_keys"].append({"key_env": how, "permissions": perms})
        # The DNS tests: one provider (and one model, served by the mock as kimi-k3) per host name,
        # so that each test starts with a name ltg has never resolved. See FakeDNS.
        for key, host in DNS_HOSTS.items():
            self.config["providers"]["dns-" + key] = catalog_provider(self.mock_port, host=host)
            self.config["models"][dns_model(key)] = {"provider": "dns-" + key, "upstream_model": "kimi-k3",
                                                     "input_usd_per_mtok": 0.60, "output_usd_per_mtok": 2.50}
        with open(self.config_path, "w") as f:
            json.dump(self.config, f, indent=2)
        self.dns = None                 # FakeDNS serving the nameserver of {tmp}/resolv.conf
        self.dns_dropper = None         # FakeDNS that never answers: the first nameserver of resolv-two.conf
        self.dns_error = None           # why the fake DNS servers cannot run (TestSkip or TestFailure)
        self.env = dict(os.environ)
        self.env["MOCK_KEY"] = PROVIDER_KEY
        self.env["LTG_ADMIN_KEY"] = ADMIN_KEY
        for key, how, perms in LIMITED_KEYS.values():
            if how != "sha256":
                self.env[how] = key
        # The token key the inference tests use (TOKEN), provisioned through the control plane
        # after ltg starts; it lives in data_dir, so a restart on the same data dir keeps it.
        self.token = None
        self.group_id = None
        self.key_id = None
        self.provisioned_dir = None
        self.data_sets = 0              # --data dirs set aside because ltg could not start on them
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
        # "{tmp}" in a test's flags stands for the temporary directory (unknown when tests are
        # declared).
        return ltg_argv([self.ltg_bin, "--config", self.config_path, "--data", self.data_dir,
                         "--listen", "127.0.0.1:%d" % self.port,
                         "--admin-listen", "127.0.0.1:%d" % self.admin_port] + [a.replace("{tmp}", self.tmp) for a in extra])

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
        deadline = time.monotonic() + 10 * SLOW
        ready = set()
        while time.monotonic() < deadline:
            if self.ltg_proc.poll() is not None:
                msg = "ltg exited with %s during start-up:\n%s" % (self.ltg_proc.returncode, tail(self.ltg_log_path))
                if os.path.exists(os.path.join(self.data_dir, "state.log")):
                    # ltg cannot start on this --data (e.g. its replay crashes): set it aside, so that
                    # one bug fails one test, not every test after it.
                    self.data_sets += 1
                    aside = "%s.set-aside-%d" % (self.data_dir, self.data_sets)
                    os.rename(self.data_dir, aside)
                    os.makedirs(self.data_dir)
                    msg += "\n(its --data was moved to %s; the next tests start on an empty one)" % aside
                raise RuntimeError(msg)
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
                self.provision()
                return
            time.sleep(0.05)
        raise RuntimeError("ltg not ready (GET /healthz on both listeners) within %g s:\n" % (10 * SLOW)
                           + tail(self.ltg_log_path))

    def _admin_closing(self, method, path, body=None, headers=None):
        """One control-plane request on a connection that is closed on both sides before this
        returns (as start_ltg's health checks: matters for --max-conns)."""
        with Conn(self.admin_port, timeout=15) as c:
            h = {"Connection": "close"}
            h.update(headers or {})
            c.send(http_request(method, API + path, body, h, auth=ADMIN_KEY))
            r = c.read_final_response(15)
            c.wait_closed(5)
        return r

    def provision(self):
        """The token group and token key the inference tests use (TOKEN). After a restart on the
        same data dir the key must still be there; a new data dir gets a new group and key."""
        if self.token and self.provisioned_dir == (self.data_dir, self.data_sets):
            r = self._admin_closing("GET", "/token_keys/" + self.key_id)
            if r.status != 200:
                raise RuntimeError("the harness's token key %s is gone after a restart on the same --data "
                                   "(GET /token_keys/%s -> %s)" % (self.key_id, self.key_id, r.brief()))
            return
        models = list(self.config["models"])
        r = self._admin_closing("POST", "/token_groups", {"name": "integration-harness", "allowed_models": models},
                                {"Idempotency-Key": "harness-group-%s" % os.urandom(8).hex()})
        if r.status != 201:
            raise RuntimeError("provisioning: POST /token_groups -> %s" % r.brief())
        gid = r.json()["data"]["id"]
        r = self._admin_closing("POST", "/token_keys", {"name": "integration-harness", "token_group_id": gid},
                                {"Idempotency-Key": "harness-key-%s" % os.urandom(8).hex()})
        if r.status != 201:
            raise RuntimeError("provisioning: POST /token_keys -> %s" % r.brief())
        d = r.json()["data"]
        self.token, self.group_id, self.key_id = d["token"], gid, d["id"]
        self.provisioned_dir = (self.data_dir, self.data_sets)

    def ltg_alive(self):
        return self.ltg_proc is not None and self.ltg_proc.poll() is None

    def stop_ltg(self):
        p = self.ltg_proc
        if p is None:
            return
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
                rc = p.wait(timeout=12 * SLOW)
                if rc != 0:
                    self.exit_problems.append("ltg %s exited with code %r after SIGTERM"
                                              % (" ".join(self.ltg_args or ()), rc))
            except subprocess.TimeoutExpired:
                self.exit_problems.append("ltg %s still running %g s after SIGTERM"
                                          % (" ".join(self.ltg_args or ()), 12 * SLOW))
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
        return sanitizer_line(text)

    def shutdown(self):
        for p in (self.ltg_proc, self.mock_proc):
            if p is not None and p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        self.dead_sock.close()
        for d in (self.dns, self.dns_dropper):
            if d is not None:
                d.stop()
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


# ===== a fake DNS server for ltg's stub resolver ==================================================
# ltg resolves provider host names itself: /etc/hosts, then A queries over UDP to the nameservers
# of --resolv-conf (port 53 only). The DNS tests point it at FakeDNS on a loopback address other
# than 127.0.0.1 (all of 127/8 is loopback on Linux). Binding port 53 needs root: without it the
# DNS tests are skipped.

# Host names of the DNS tests' providers (one each: a test starts with a name ltg never resolved).
DNS_HOSTS = {
    "basic": "mock.ltg.test",
    "ttl": "ttl.ltg.test",
    "nx": "nx.ltg.test",
    "drop": "drop.ltg.test",
    "badid": "badid.ltg.test",
    "spoof": "spoof.ltg.test",
    "shared": "shared.ltg.test",
    "cname": "cname.ltg.test",
    "gone": "gone.ltg.test",
    "rotate": "rotate.ltg.test",
}
# Where the fake servers may listen: the first free one of these.
DNS_ADDRS = ["127.0.0.2"] + ["127.0.53.%d" % i for i in range(2, 30)]
# A loopback address where nothing listens on the mock's port: a decoy answer points there, so a
# call that used it would fail (connection refused -> 502).
DNS_DECOY_ADDR = "127.0.0.3"


def dns_model(key):
    return "DNS-" + key


def dns_encode_name(name):
    out = b""
    for label in name.rstrip(".").split("."):
        out += bytes([len(label)]) + label.encode("ascii")
    return out + b"\0"


class FakeDNS:
    """A UDP DNS server on ADDR:53 whose answers the tests choose, per name, in `table`:

        table[name] = {                  (every key optional)
            "a": ["127.0.0.1", ...],     the A records (default: 127.0.0.1)
            "ttl": 60,                   their TTL
            "rcode": 3,                  answer with this rcode and no records (3 = NXDOMAIN)
            "drop": True,                never answer
            "cname": "target.name",      answer a CNAME to target, then target's A records ("a")
            "cname_ttl": 300,            the CNAME record's TTL (default: ttl)
            "hold": threading.Event(),   answer only once the event is set
            "bad_id_first": "ip",        first answer with another query id (A record ip), then the real one
            "spoof_first": "ip",         first answer with the right id from another port (A record ip),
                                         then the real one from port 53
        }

    A name not in the table gets `default` (NXDOMAIN unless changed). Every query received is
    recorded in `queries` as (monotonic time, name, id, qtype, flags); `answered` records
    (time, name, id) of each real answer sent.
    """

    def __init__(self, addr):
        self.addr = addr
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind((addr, 53))
        except OSError:
            self.sock.close()
            raise
        self.sock.settimeout(0.2)
        self.side = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)   # for spoof_first
        self.side.bind((addr, 0))
        self.table = {}
        self.default = {"rcode": 3}
        self.lock = threading.Lock()
        self.queries = []
        self.answered = []
        self.errors = []
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, name="fake-dns-" + addr, daemon=True)
        self.thread.start()

    def stop(self):
        self.stopping = True
        self.thread.join(5)
        self.sock.close()
        self.side.close()

    # --- what the tests look at ---

    def count(self, name):
        """Query packets received for name (retries included)."""
        with self.lock:
            return sum(1 for q in self.queries if q[1] == name.lower())

    def ids(self, name):
        """Distinct query ids received for name: one per resolution (ltg's retries keep the id)."""
        with self.lock:
            return sorted(set(q[2] for q in self.queries if q[1] == name.lower()))

    def of(self, name):
        with self.lock:
            return [q for q in self.queries if q[1] == name.lower()]

    def times(self, name):
        with self.lock:
            return [q[0] for q in self.queries if q[1] == name.lower()]

    def last_answer_time(self, name):
        with self.lock:
            ts = [a[0] for a in self.answered if a[1] == name.lower()]
        return ts[-1] if ts else None

    def wait_queries(self, name, n, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.count(name) >= n:
                return True
            time.sleep(0.02)
        return self.count(name) >= n

    # --- the server ---

    def _serve(self):
        while not self.stopping:
            try:
                pkt, peer = self.sock.recvfrom(4096)
            except socket.timeout:
                continue
            except OSError:
                if self.stopping:
                    return
                continue
            try:
                self._handle(pkt, peer)
            except Exception as e:   # a malformed query must not stop the server
                with self.lock:
                    self.errors.append("%r from %s: %r" % (pkt[:64], peer, e))

    @staticmethod
    def _parse(pkt):
        if len(pkt) < 17:
            raise ValueError("short query")
        qid, flags, qd = struct.unpack("!HHH", pkt[:6])
        if flags & 0x8000 or qd != 1:
            raise ValueError("not a query with one question")
        i = 12
        labels = []
        while True:
            n = pkt[i]
            i += 1
            if n == 0:
                break
            if n & 0xC0:
                raise ValueError("compressed name in a query")
            labels.append(pkt[i:i + n].decode("ascii"))
            i += n
        qtype, qclass = struct.unpack("!HH", pkt[i:i + 4])
        i += 4
        return qid, flags, ".".join(labels).lower(), pkt[12:i], qtype

    @staticmethod
    def _build(qid, qflags, question, qtype, entry, a_override=None):
        rcode = entry.get("rcode", 0)
        ttl = entry.get("ttl", 60)
        flags = 0x8000 | (qflags & 0x7900) | 0x0400 | 0x0080 | rcode   # QR, opcode+RD copied, AA, RA
        answers = []
        if rcode == 0 and qtype == 1:
            addrs = [a_override] if a_override else entry.get("a", ["127.0.0.1"])
            owner = b"\xc0\x0c"          # a pointer to the question's name
            if entry.get("cname"):
                target = dns_encode_name(entry["cname"])
                answers.append(owner + struct.pack("!HHIH", 5, 1, entry.get("cname_ttl", ttl), len(target)) + target)
                # The A records' owner is the CNAME's target: a pointer to that rdata.
                owner = struct.pack("!H", 0xC000 | (12 + len(question) + 2 + 10))
            for a in addrs:
                answers.append(owner + struct.pack("!HHIH", 1, 1, ttl, 4) + socket.inet_aton(a))
        hdr = struct.pack("!HHHHHH", qid, flags, 1, len(answers), 0, 0)
        return hdr + question + b"".join(answers)

    def _handle(self, pkt, peer):
        qid, qflags, name, question, qtype = self._parse(pkt)
        with self.lock:
            self.queries.append((time.monotonic(), name, qid, qtype, qflags))
            entry = dict(self.table.get(name, self.default))
        if entry.get("drop"):
            return

        def answer():
            if entry.get("bad_id_first"):
                self.sock.sendto(self._build(qid ^ 0x5A5A, qflags, question, qtype, entry,
                                             a_override=entry["bad_id_first"]), peer)
            if entry.get("spoof_first"):
                self.side.sendto(self._build(qid, qflags, question, qtype, entry,
                                             a_override=entry["spoof_first"]), peer)
            with self.lock:
                self.answered.append((time.monotonic(), name, qid))
            self.sock.sendto(self._build(qid, qflags, question, qtype, entry), peer)

        hold = entry.get("hold")
        if hold is None:
            answer()
        else:
            def later():
                if hold.wait(60) and not self.stopping:
                    try:
                        answer()
                    except OSError:
                        pass
            threading.Thread(target=later, daemon=True).start()


def start_fake_dns(exclude=()):
    """A FakeDNS on the first free address of DNS_ADDRS. TestSkip when port 53 needs privileges
    we lack."""
    last = None
    for addr in DNS_ADDRS:
        if addr in exclude:
            continue
        try:
            return FakeDNS(addr)
        except PermissionError as e:
            raise TestSkip("cannot bind UDP %s:53 (binding port 53 needs root): %s" % (addr, e))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise TestFailure("cannot bind UDP %s:53: %s" % (addr, e))
            last = e
    raise TestFailure("no free UDP port 53 on %s..%s: %s" % (DNS_ADDRS[0], DNS_ADDRS[-1], last))


def need_dns():
    """Start the fake DNS server (once) and write {tmp}/resolv.conf naming it."""
    if H.dns_error:
        raise H.dns_error
    if H.dns is None:
        try:
            H.dns = start_fake_dns()
        except (TestSkip, TestFailure) as e:
            H.dns_error = e
            raise
        with open(os.path.join(H.tmp, "resolv.conf"), "w") as f:
            f.write("# written by tests/integration.py\nsearch ltg.test\noptions ndots:1\n"
                    "nameserver %s\n" % H.dns.addr)


def need_dns_two():
    """Also a second fake server that never answers, named first in {tmp}/resolv-two.conf."""
    need_dns()
    if H.dns_dropper is None:
        try:
            H.dns_dropper = start_fake_dns(exclude=(H.dns.addr,))
        except TestFailure as e:
            raise TestFailure("the second fake DNS server: %s" % e)
        H.dns_dropper.default = {"drop": True}
        with open(os.path.join(H.tmp, "resolv-two.conf"), "w") as f:
            f.write("nameserver %s\nnameserver %s\n" % (H.dns_dropper.addr, H.dns.addr))


RESOLV_ARGS = ("--resolv-conf", "{tmp}/resolv.conf")
RESOLV_TWO_ARGS = ("--resolv-conf", "{tmp}/resolv-two.conf")


H = None  # the Harness


# ===== the tests ==================================================================================
# Each test is a function; the decorator records its name and the ltg flags it needs.

TESTS = []


def test(name, ltg_args=(), fresh=False, needs=None):
    """needs: a function run before ltg is (re)started for the test; it prepares what the test
    needs outside ltg, or raises TestSkip."""
    def deco(fn):
        TESTS.append((name, fn, tuple(ltg_args), fresh, needs))
        fn.test_module = fn.__module__      # main(only=...) runs one file's tests
        return fn
    return deco


# --- 1. health ---

@test("healthz on both listeners")
def t_healthz():
    for port, what in ((H.port, "inference"), (H.admin_port, "admin")):
        r = one_request(port, "GET", "/healthz", auth=None)
        check(r.status == 200, "%s listener: GET /healthz -> %s" % (what, r.brief()))
        check(r.json() == {"status": "ok"}, "%s listener: body %r" % (what, r.body))
        # HEAD: the GET's head (Content-Length 15) and no body. A GET follows on the same
        # connection, written together with the HEAD: a body after the HEAD's head would be read
        # as the GET's status line.
        with Conn(port) as c:
            c.send(http_request("HEAD", "/healthz", auth=None) + http_request("GET", "/healthz", auth=None))
            r = c.read_response(head_request=True)
            check(r.status == 200, "%s listener: HEAD /healthz -> %d" % (what, r.status))
            check(r.header("content-length") == "15", "%s listener: HEAD /healthz Content-Length %r, want 15 "
                  "(the GET's)" % (what, r.header("content-length")))
            check(r.header("transfer-encoding") is None, "%s listener: HEAD /healthz is chunked" % what)
            try:
                r2 = c.read_response()
            except TestFailure as e:
                raise TestFailure("%s listener: after HEAD /healthz: %s (a body after the head?)" % (what, e))
            check(r2.status == 200 and r2.json() == {"status": "ok"},
                  "%s listener: the GET after HEAD /healthz: %s" % (what, r2.brief()))
            check(c.buf == b"", "%s listener: extra bytes after the GET: %r" % (what, c.buf[:100]))


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
        check(H.token not in v, "the client's key leaked upstream in header %s: %r" % (k, v))
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
        seen = [during]

        def upstream_closed():
            seen[0] = H.mock_stats(ctl)["open_connections"]
            return seen[0] < during
        wait_until(lambda: "the upstream connection stayed open after the client left (mock open_connections %d "
                   "during the stream, %d after the client closed)" % (during, seen[0]), upstream_closed, 10 * SLOW, 0.1)
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


@test("idle keep-alive clients: a request on a connection idle past HOT_MS is answered")
def t_idle_clients_swept():
    conns = []
    try:
        for _ in range(100):
            c = Conn(H.port)
            conns.append(c)
            c.send(http_request("GET", "/healthz", auth=None))
            check(c.read_final_response().status == 200, "an idle client's first request")
        # Time must pass on purpose: past HOT_MS (1 s) every one of them is polled only in a sweep;
        # ltg shows nothing of an fd gone cold, so there is no condition to wait for instead.
        time.sleep(1.5)
        for i, c in enumerate(conns[::10]):
            c.send(http_request("POST", "/v1/chat/completions", chat_body(content="cold %d" % i)))
            r = c.read_final_response(10)
            check(r.status == 200, "a request on a connection idle for 1.5 s: %s" % r.brief())
        with Conn(H.port) as c:
            c.send(http_request("GET", "/healthz", auth=None))
            check(c.read_final_response(10).status == 200, "a new client beside 100 idle ones")
    finally:
        for c in conns:
            c.close()


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
                time.sleep(0.002)   # a pace: the bytes arrive apart, in many reads
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


@test("Expect: 100-continue; a key that may not send the body gets its 401 instead")
def t_expect_continue():
    body = json.dumps(chat_body(content="after continue")).encode()
    # The harness's key: 100 Continue, then the body. A key that may not send one: its 401 instead
    # of 100 Continue, and the body is not asked for.
    for key, want in ((TOKEN, 100), ("ltg_sk_" + "q" * 43, 401)):
        head = http_request("POST", "/v1/chat/completions", None, auth=key,
                            headers={"Expect": "100-continue", "Content-Length": str(len(body)),
                                     "Content-Type": "application/json"})
        with Conn(H.port) as c:
            c.send(head)
            r = c.read_head(10)
            check(r.status == want, "Expect: 100-continue with %s key: %d before the body, want %d"
                  % ("the harness's" if key is TOKEN else "a bad", r.status, want))
            if want == 100:
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
        time.sleep(0.3)     # a pace, well within the 1 s: the head comes in two pieces
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


@test("--max-conns 2: a third connection takes the place of the one idle longest; while both serve, it is closed at once",
      ltg_args=("--max-conns", "2", "--max-conns-per-ip", "2"))
def t_max_conns():
    a = Conn(H.port)
    b = Conn(H.port)
    c = None
    try:
        for x in (a, b):        # a, then b: a has been idle longest
            x.send(http_request("GET", "/healthz", auth=None))
            r = x.read_final_response()
            check(r.status == 200, "one of the first two connections: %s" % r.brief())
        with Conn(H.port, source="127.0.0.2") as third:   # another address: this one is at --max-conns-per-ip
            third.send(http_request("GET", "/healthz", auth=None, headers={"Connection": "close"}))
            r = third.read_final_response(5)
            check(r.status == 200, "the third connection: %s" % r.brief())
            check(third.wait_closed(5), "ltg did not close the third after its answer (Connection: close)")
        check(a.wait_closed(4), "the connection idle longest was not closed to make room")
        # Both serving a slow call: nothing to shed, the next connection is closed at once.
        c = Conn(H.port)
        c.send(http_request("GET", "/healthz", auth=None))
        check(c.read_final_response(3).status == 200, "a connection after the third left")
        slow = chat_body(directive="head_delay_ms=3000")
        before = H.mock_stats()["requests"]
        for x in (b, c):
            x.send(http_request("POST", "/v1/chat/completions", slow))
        wait_until("both slow calls in service (reached the mock)",
                   lambda: H.mock_stats()["requests"] >= before + 2, 10 * SLOW, 0.02)
        with Conn(H.port, source="127.0.0.2") as late:
            check(late.wait_closed(4), "a connection while both were serving was not closed")
            check(not late.buf or late.buf.startswith(b"HTTP/1.1 503"), "it got unexpected bytes %r" % late.buf[:200])
        for x in (b, c):
            r = x.read_final_response(15)
            check(r.status == 200, "the calls in service: %s" % r.brief())
    finally:
        for x in (a, b, c):
            if x:
                x.close()


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
    r = one_request(H.port, "POST", "/v1/chat/completions", body, auth=H.token + "x")
    check_openai_error(r, 401, "invalid_api_key")
    with Conn(H.port) as c:
        c.send(http_request("POST", "/v1/chat/completions", body, auth=None,
                            headers={"Authorization": "Basic " + H.token}))
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


@test("unknown model alias -> 403 model_not_allowed")
def t_unknown_model():
    # A group's allowed_models are catalog aliases, so a name that is no alias is outside them:
    # API.md 4, 403 model_not_allowed, before anything reaches a provider. (404 model_not_found
    # is left for an allowed model that a reload dropped from the catalog: see "inference: a model
    # dropped from the catalog by SIGHUP".)
    before = H.mock_stats()["requests"]
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(model="No-Such-Model"))
    check_openai_error(r, 403, "model_not_allowed")
    # The upstream name is not an alias.
    r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(model="kimi-k3"))
    check_openai_error(r, 403, "model_not_allowed")
    r = one_request(H.port, "POST", "/v1/embeddings", {"model": "No-Such-Model", "input": "x"})
    check_openai_error(r, 403, "model_not_allowed")
    check(H.mock_stats()["requests"] == before, "a refused model reached the provider")


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

@test("upstream 503 -> 503 naming the attempt (API.md 4.3); a terminal 400 relayed as it is")
def t_upstream_503():
    # 503 is `indeterminate`: no other attempt of the same model, and this group has no fallbacks,
    # so every attempt failed: the status of the last failure and an OpenAI-shaped body whose
    # error.attempts lists the attempts (API.md 4.3).
    for stream in (False, True):
        what = "stream" if stream else "non-stream"
        r = one_request(H.port, "POST", "/v1/chat/completions", chat_body(stream=stream, directive="status=503"))
        e = check_openai_error(r, 503)
        check("503" in e["message"], "%s: error.message does not name the reason: %r" % (what, e["message"]))
        att = e.get("attempts")
        check(isinstance(att, list) and len(att) == 1, "%s: error.attempts %r, want one attempt" % (what, att))
        a = att[0]
        check(a.get("model") == "Kimi-K3" and a.get("attempt") == 1 and a.get("status") == 503
              and a.get("outcome") == "indeterminate" and isinstance(a.get("ms"), int),
              "%s: the attempt %r" % (what, a))
        check(r.header("x-ltg-attempts") == "1", "%s: x-ltg-attempts: %r" % (what, r.header("x-ltg-attempts")))
        check(r.header("x-ltg-request-id"), "%s: x-ltg-request-id missing on an error answer" % what)
        check((r.header("content-type") or "").startswith("application/json"),
              "%s: the error is not JSON: %r" % (what, r.header("content-type")))
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


# --- 14. name resolution: the DNS stub resolver against a fake DNS server ---
# Each test has its own provider host name (DNS_HOSTS), so it starts with a name ltg never
# resolved; query counts are taken relative to the count before the test's calls.

def dns_call(key, timeout=30.0):
    # The mock closes the connection after answering ("close"), so that no pooled keep-alive
    # connection spares the next call its name lookup.
    return one_request(H.port, "POST", "/v1/chat/completions", chat_body(model=dns_model(key), directive="close"),
                       timeout=timeout)


def check_dns_served(r, key, what="the call"):
    check(r.status == 200, "%s for %s (%s): %s" % (what, dns_model(key), DNS_HOSTS[key], r.brief()))
    content = r.json()["choices"][0]["message"]["content"]
    check(content == "Hello from kimi-k3.", "%s: content %r (not the mock's answer)" % (what, content))
    check(r.header("x-ltg-served-model") == dns_model(key),
          "%s: x-ltg-served-model %r" % (what, r.header("x-ltg-served-model")))


def check_dns_sane():
    """The fake servers could parse every query ltg sent."""
    for d in (H.dns, H.dns_dropper):
        if d is not None:
            with d.lock:
                errs = list(d.errors)
            check(not errs, "the fake DNS server %s got queries it could not parse: %s" % (d.addr, "; ".join(errs[:3])))


def dns_setup(key, **entry):
    name = DNS_HOSTS[key]
    with H.dns.lock:
        H.dns.table[name] = entry
    return name, H.dns.count(name)


@test("dns: a provider host name is resolved through --resolv-conf's nameserver", ltg_args=RESOLV_ARGS, needs=need_dns)
def t_dns_basic():
    name, before = dns_setup("basic", a=["127.0.0.1"], ttl=60)
    r = dns_call("basic")
    check_dns_served(r, "basic")
    qs = H.dns.of(name)[before:]
    check(len(qs) == 1, "the fake DNS server saw %d queries for %s, want exactly 1" % (len(qs), name))
    _, _, qid, qtype, qflags = qs[0]
    check(qtype == 1, "the query asked for type %d, want 1 (A)" % qtype)
    check(qflags & 0x0100, "the query does not set RD (recursion desired): flags 0x%04x" % qflags)
    check(H.mock_last().get("headers", {}).get("host", "").split(":")[0] == name,
          "the upstream Host header should carry the provider's host name: %r"
          % H.mock_last().get("headers", {}).get("host"))
    # A second call is served from the cache (TTL 60).
    check_dns_served(dns_call("basic"), "basic", "a second call")
    check(H.dns.count(name) - before == 1, "a second call within the TTL queried again (%d queries)"
          % (H.dns.count(name) - before))
    check_dns_sane()


@test("dns: answers are cached for their TTL, then asked again", ltg_args=RESOLV_ARGS, needs=need_dns)
def t_dns_ttl():
    name, before = dns_setup("ttl", a=["127.0.0.1"], ttl=2)
    check_dns_served(dns_call("ttl"), "ttl", "the first call")
    check(H.dns.count(name) - before == 1, "the first call made %d queries, want 1" % (H.dns.count(name) - before))
    t_ans = H.dns.last_answer_time(name)
    for i in range(2):
        check_dns_served(dns_call("ttl"), "ttl", "call %d within the TTL" % (i + 2))
    within = time.monotonic() - t_ans
    n = H.dns.count(name) - before
    check(n == 1, "two calls %.1f s after a TTL 2 answer made %d new queries, want 0 (cached)" % (within, n - 1))
    # Well past the TTL: the next call asks again, once. (Time must pass on purpose: the TTL runs on
    # ltg's clock, and nothing shows it expired but the next query.)
    time.sleep(max(0.0, t_ans + 3.5 - time.monotonic()))
    check_dns_served(dns_call("ttl"), "ttl", "the call after the TTL")
    n = H.dns.count(name) - before
    check(n == 2, "the call 3.5 s after a TTL 2 answer made %d new queries, want exactly 1" % (n - 1))
    check_dns_served(dns_call("ttl"), "ttl", "the call after the new answer")
    check(H.dns.count(name) - before == 2, "the new answer was not cached")
    check_dns_sane()


@test("dns: NXDOMAIN -> 502 naming the host, cached for 5 s", ltg_args=RESOLV_ARGS, needs=need_dns)
def t_dns_nxdomain():
    name, before = dns_setup("nx", rcode=3)
    r = dns_call("nx")
    e = check_openai_error(r, 502)
    check(name in e["message"] and "NXDOMAIN" in e["message"],
          "the message should name the host %s and say NXDOMAIN: %r" % (name, e["message"]))
    check(H.dns.count(name) - before == 1, "%d queries, want 1" % (H.dns.count(name) - before))
    t_ans = H.dns.last_answer_time(name)
    # Within 5 s: the failure is cached, no new query.
    r = dns_call("nx")
    e = check_openai_error(r, 502)
    check("NXDOMAIN" in e["message"], "the second call's message %r" % e["message"])
    check(H.dns.count(name) - before == 1, "a second call %.1f s after NXDOMAIN queried again (negative "
          "answers are cached 5 s)" % (time.monotonic() - t_ans))
    # The name now exists; after the negative cache expired, a call asks again and gets through.
    with H.dns.lock:
        H.dns.table[name] = {"a": ["127.0.0.1"], "ttl": 60}
    time.sleep(max(0.0, t_ans + 6.5 - time.monotonic()))     # on purpose: the 5 s negative TTL must run out
    check_dns_served(dns_call("nx"), "nx", "a call 6.5 s after NXDOMAIN")
    check(H.dns.count(name) - before == 2, "a call after the negative TTL made %d new queries, want 1"
          % (H.dns.count(name) - before - 1))
    check_dns_sane()


@test("dns: no answer -> 502 after the tries; the loop never blocks", ltg_args=RESOLV_ARGS, needs=need_dns)
def t_dns_timeout():
    name, before = dns_setup("drop", drop=True)
    with H.dns.lock:
        H.dns.table.setdefault(DNS_HOSTS["basic"], {"a": ["127.0.0.1"], "ttl": 60})
    result = {}

    def call():
        try:
            result["r"] = dns_call("drop", timeout=60)
        except Exception as e:
            result["e"] = e
        result["t"] = time.monotonic()

    th = threading.Thread(target=call)
    t0 = time.monotonic()
    th.start()
    try:
        check(H.dns.wait_queries(name, before + 1, 15), "no query for %s reached the fake DNS server" % name)
        # ltg is waiting for DNS: it must go on serving everything else meanwhile.
        for port, what in ((H.port, "inference"), (H.admin_port, "admin")):
            r = one_request(port, "GET", "/healthz", auth=None, timeout=15)
            check(r.status == 200, "%s listener: GET /healthz while a name resolves: %s" % (what, r.brief()))
        check_dns_served(dns_call("basic"), "basic", "a call to another provider while a name resolves")
        healthz_done = time.monotonic()
        pending = th.is_alive()
    finally:
        th.join(60)
    check(not th.is_alive(), "the call waiting for DNS got no answer within 60 s")
    if "e" in result:
        raise TestFailure("the call waiting for DNS: %s" % result["e"])
    check(pending, "the health checks were answered only %.1f s after the call for %s started, after "
          "that call's 502 (its DNS tries are 2 s apart): ltg blocks while it resolves a name"
          % (healthz_done - t0, name))
    e = check_openai_error(result["r"], 502)
    check(name in e["message"] and "timed out" in e["message"],
          "the message should name the host %s and say DNS timed out: %r" % (name, e["message"]))
    qs = H.dns.times(name)[before:]
    check(len(qs) == 3, "%d queries for %s, want 3 tries" % (len(qs), name))
    check(qs[-1] - qs[0] >= 3.0, "the 3 tries came within %.1f s: they should be 2 s apart" % (qs[-1] - qs[0]))
    check(result["t"] - t0 < 30, "the 502 came only after %.0f s" % (result["t"] - t0))
    # The failure is cached too: a call right after fails at once, without a query.
    r = dns_call("drop")
    e = check_openai_error(r, 502)
    check("timed out" in e["message"], "a call right after the DNS timeout: %r" % e["message"])
    check(len(H.dns.times(name)) - before == 3, "a call right after the DNS timeout queried again (failures "
          "are cached 5 s)")
    check_dns_sane()


@test("dns: an answer with another query id is ignored", ltg_args=RESOLV_ARGS, needs=need_dns)
def t_dns_bad_id():
    # The answer with the wrong id points at an address where nothing listens: using it fails.
    name, before = dns_setup("badid", a=["127.0.0.1"], ttl=60, bad_id_first=DNS_DECOY_ADDR)
    check_dns_served(dns_call("badid"), "badid")
    check(H.dns.count(name) - before == 1, "%d queries, want 1: the real answer followed the wrong one at once"
          % (H.dns.count(name) - before))
    check_dns_sane()


@test("dns: an answer from another port of the server is ignored", ltg_args=RESOLV_ARGS, needs=need_dns)
def t_dns_spoof():
    name, before = dns_setup("spoof", a=["127.0.0.1"], ttl=60, spoof_first=DNS_DECOY_ADDR)
    check_dns_served(dns_call("spoof"), "spoof")
    check(H.dns.count(name) - before == 1, "%d queries, want 1" % (H.dns.count(name) - before))
    check_dns_sane()


@test("dns: concurrent calls for a name not yet cached share one query", ltg_args=RESOLV_ARGS, needs=need_dns)
def t_dns_shared():
    # TTL 0: the answer is not reusable afterwards, so a call that did not wait for this query
    # would make one of its own.
    hold = threading.Event()
    name, before = dns_setup("shared", a=["127.0.0.1"], ttl=0, hold=hold)
    before_ids = len(H.dns.ids(name))
    results = [None, None]
    sent = [threading.Event(), threading.Event()]

    def worker(i):
        try:
            with Conn(H.port, timeout=60) as c:
                c.send(http_request("POST", "/v1/chat/completions",
                                    chat_body(model=dns_model("shared"), directive="close")))
                sent[i].set()
                results[i] = c.read_final_response(60)
        except Exception as e:
            results[i] = e
            sent[i].set()

    ths = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    try:
        for t in ths:
            t.start()
        for ev in sent:
            check(ev.wait(15), "a request could not be sent")
        check(H.dns.wait_queries(name, before + 1, 15), "no query for %s reached the fake DNS server" % name)
        # ltg has read the second request: both attempts wait for the pending query.
        wait_until(lambda: "both calls for %s waiting for its name (ltg_deployment_in_flight %g)"
                   % (dns_model("shared"), metric_sum(H.admin_port, "ltg_deployment_in_flight", model=dns_model("shared"))),
                   lambda: metric_sum(H.admin_port, "ltg_deployment_in_flight", model=dns_model("shared")) >= 2,
                   10 * SLOW, 0.02)
    finally:
        hold.set()
        for t in ths:
            t.join(60)
    for i, r in enumerate(results):
        if not isinstance(r, Response):
            raise TestFailure("call %d: %r" % (i + 1, r))
        check_dns_served(r, "shared", "call %d" % (i + 1))
    ids = H.dns.ids(name)
    check(len(ids) - before_ids == 1, "two concurrent calls made %d DNS queries (ids %r), want 1 shared"
          % (len(ids) - before_ids, ids))
    check_dns_sane()


@test("dns: a CNAME chain is followed to the A record", ltg_args=RESOLV_ARGS, needs=need_dns)
def t_dns_cname():
    name, before = dns_setup("cname", cname="edge.cdn.ltg.test", a=["127.0.0.1"], ttl=60, cname_ttl=300)
    check_dns_served(dns_call("cname"), "cname")
    check(H.dns.count(name) - before == 1, "%d queries, want 1" % (H.dns.count(name) - before))
    check(H.dns.count("edge.cdn.ltg.test") == 0, "ltg asked for the CNAME's target although the answer "
          "carried its A record")
    check_dns_served(dns_call("cname"), "cname", "a second call")
    check(H.dns.count(name) - before == 1, "the CNAME answer was not cached")
    check_dns_sane()


@test("dns: a client that leaves while its name resolves", ltg_args=RESOLV_ARGS, needs=need_dns)
def t_dns_client_gone():
    hold = threading.Event()
    name, before = dns_setup("gone", a=["127.0.0.1"], ttl=60, hold=hold)
    try:
        with Conn(H.port, timeout=15) as c:
            c.send(http_request("POST", "/v1/chat/completions", chat_body(model=dns_model("gone"), directive="close")))
            check(H.dns.wait_queries(name, before + 1, 15), "no query for %s reached the fake DNS server" % name)
        # ltg sees the close while the query is pending
        wait_until("ltg closing the departed client's connection while its name resolves",
                   lambda: metric_sum(H.admin_port, "ltg_client_connections", listener="inference") == 0,
                   10 * SLOW, 0.02)
    finally:
        hold.set()
    # ... and then the answer, with nobody waiting for it
    wait_until("the fake DNS server answering the held query for %s" % name,
               lambda: H.dns.last_answer_time(name) is not None, 10 * SLOW, 0.02)
    r = one_request(H.port, "GET", "/healthz", auth=None)
    check(r.status == 200, "healthz after the answer came for a departed client: %s" % r.brief())
    check_dns_served(dns_call("gone"), "gone", "a later call")
    check(H.dns.count(name) - before == 1, "the answer that came after the client left was not cached "
          "(%d queries)" % (H.dns.count(name) - before))
    check_dns_sane()


@test("dns: a query the first nameserver drops is retried on the next", ltg_args=RESOLV_TWO_ARGS,
      needs=need_dns_two)
def t_dns_rotate():
    name, before = dns_setup("rotate", a=["127.0.0.1"], ttl=60)
    before_drop = H.dns_dropper.count(name)
    check_dns_served(dns_call("rotate"), "rotate")
    n1 = H.dns_dropper.count(name) - before_drop
    n2 = H.dns.count(name) - before
    check(n1 == 1 and n2 == 1, "queries: %d to the first nameserver (%s, never answers), %d to the second "
          "(%s); want 1 and 1" % (n1, H.dns_dropper.addr, n2, H.dns.addr))
    check_dns_sane()


# --- 15. SIGTERM drain ---

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


# --- 16. the control plane (API.md 3) ---
# Helpers: admin() sends one control-plane request (an Idempotency-Key of its own on POST, PATCH
# and DELETE unless told otherwise); check_admin_ok / check_admin_error check the shape every answer
# shares (Cache-Control: no-store, X-Request-ID, JSON, {"data"} or {"errors"}).

AUTO = object()       # admin(): make the default (a fresh Idempotency-Key, the full admin key)
ANY = object()        # check_admin_error(): do not check source.pointer
_idem_counter = itertools.count(1)

GROUP_FIELDS = ("name", "allowed_models", "fallbacks", "retries", "max_budget", "budget_duration",
                "cache_ttl", "max_parallel_requests", "blocked")
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
SECRET_RE = re.compile(r"^ltg_sk_[A-Za-z0-9_-]{43,}$")
ISO_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
TWO = ["Kimi-K3", "GLM-5.3-Flash"]


def new_idem(tag="it"):
    return "%s-%d-%d-%s" % (tag, os.getpid(), next(_idem_counter), os.urandom(4).hex())


def admin(method, path, body=None, key=AUTO, idem=AUTO, if_match=None, headers=None, port=None,
          timeout=15.0, conn=None):
    """One control-plane request; path is relative to /v2/llm_token_gateway. if_match: an int
    (sent quoted) or the raw header value."""
    hdrs = {}
    if idem is AUTO:
        idem = new_idem() if method in ("POST", "PATCH", "DELETE") else None
    if idem is not None:
        hdrs["Idempotency-Key"] = idem
    if if_match is not None:
        hdrs["If-Match"] = '"%d"' % if_match if isinstance(if_match, int) else if_match
    hdrs.update(headers or {})
    auth = ADMIN_KEY if key is AUTO else key
    if conn is not None:
        conn.send(http_request(method, API + path, body, hdrs, auth=auth))
        return conn.read_final_response(timeout)
    return one_request(port or H.admin_port, method, API + path, body, hdrs, auth=auth, timeout=timeout)


def check_admin_common(r, what):
    check(r.header("cache-control") == "no-store", "%s: Cache-Control %r, want no-store"
          % (what, r.header("cache-control")))
    check(r.header("x-request-id"), "%s: no X-Request-ID (headers %r)" % (what, r.headers))
    check((r.header("content-type") or "").startswith("application/json"), "%s: Content-Type %r"
          % (what, r.header("content-type")))


def check_admin_ok(r, status, what="the answer"):
    check(r.status == status, "%s: expected %d, got %s" % (what, status, r.brief()))
    check_admin_common(r, what)
    j = r.json()
    check(isinstance(j, dict) and "data" in j and "errors" not in j, "%s: body %r" % (what, r.body[:300]))
    return j


def check_admin_error(r, status, code, pointer=ANY, what="the answer"):
    """A JSON:API error: {"errors":[{"code","title","detail","source"?,"meta"}]}. pointer: ANY, None
    (no source.pointer), or the RFC 6901 pointer expected."""
    check(r.status == status, "%s: expected %d %s, got %s" % (what, status, code, r.brief()))
    check_admin_common(r, what)
    check(r.header("etag") is None, "%s: an error answer carries ETag %r" % (what, r.header("etag")))
    check(r.header("x-ltg-replayed") is None, "%s: an error answer says x-ltg-replayed" % what)
    j = r.json()
    check(isinstance(j, dict) and isinstance(j.get("errors"), list) and j["errors"] and "data" not in j,
          "%s: not a JSON:API error body: %r" % (what, r.body[:300]))
    e = j["errors"][0]
    for f in ("code", "title", "detail", "meta"):
        check(f in e, "%s: errors[0] lacks %s: %r" % (what, f, r.body[:300]))
    check(code is ANY or e["code"] == code, "%s: code %r, want %r (%r)" % (what, e["code"], code, r.body[:300]))
    check(isinstance(e["title"], str) and e["title"], "%s: empty title" % what)
    check(isinstance(e["detail"], str) and e["detail"], "%s: empty detail" % what)
    check(isinstance(e["meta"], dict), "%s: meta %r is not an object" % (what, e["meta"]))
    got = (e.get("source") or {}).get("pointer")
    if pointer is None:
        check(got is None, "%s: source.pointer %r, want none (%r)" % (what, got, r.body[:300]))
    elif pointer is not ANY:
        check(got == pointer, "%s: source.pointer %r, want %r (detail %r)" % (what, got, pointer, e["detail"]))
    return e


def etag_of(r, what="the answer"):
    v = r.header("etag")
    check(v is not None and re.match(r'^"\d+"$', v), "%s: ETag %r is not a quoted version" % (what, v))
    return int(v[1:-1])


def group_body(**kw):
    b = {"name": "g-" + new_idem(), "allowed_models": list(TWO)}
    b.update(kw)
    return b


def create_group(body=None, port=None, key=AUTO, **kw):
    """POST /token_groups; returns data (checks 201, ETag "1", version 1)."""
    b = group_body(**kw) if body is None else body
    r = admin("POST", "/token_groups", b, port=port, key=key)
    d = check_admin_ok(r, 201, "POST /token_groups %r" % b)["data"]
    check(etag_of(r) == 1 and d.get("version") == 1, "a new group: ETag %r, version %r" % (r.header("etag"), d.get("version")))
    return d


def get_group(gid, port=None):
    """GET /token_groups/{id}: (data, ETag version)."""
    r = admin("GET", "/token_groups/" + gid, port=port)
    d = check_admin_ok(r, 200, "GET /token_groups/%s" % gid)["data"]
    v = etag_of(r, "GET /token_groups/%s" % gid)
    check(v == d["version"], "ETag %d != version %r" % (v, d["version"]))
    return d, v


def create_key(gid, name=None, port=None, key=AUTO):
    """POST /token_keys; returns (data without the secret, the secret)."""
    r = admin("POST", "/token_keys", {"name": name or "k-" + new_idem(), "token_group_id": gid}, port=port, key=key)
    d = dict(check_admin_ok(r, 201, "POST /token_keys")["data"])
    check(etag_of(r) == 1 and d.get("version") == 1, "a new key: ETag %r, version %r" % (r.header("etag"), d.get("version")))
    token = d.pop("token", None)
    check(isinstance(token, str) and SECRET_RE.match(token), "the new key's token %r is not ltg_sk_ + 43 url-safe "
          "characters" % token)
    return d, token


def check_x_headers(r, status, attempts, served=None, what="the answer"):
    """API.md 4.1: x-ltg-attempts on every answer, x-ltg-served-model on 2xx only, request ids."""
    check(r.status == status, "%s: status %d, want %d: %s" % (what, r.status, status, r.brief()))
    got = r.header_all("x-ltg-attempts")
    check(got == [str(attempts)], "%s: x-ltg-attempts %r, want %r" % (what, got, str(attempts)))
    sm = r.header_all("x-ltg-served-model")
    if 200 <= status < 300:
        check(sm == [served], "%s: x-ltg-served-model %r, want %r" % (what, sm, served))
    else:
        check(sm == [], "%s: x-ltg-served-model %r on a %d answer (only 2xx answers carry it)" % (what, sm, status))
    rid = r.header("x-ltg-request-id")
    check(rid and r.header("x-request-id") == rid, "%s: x-ltg-request-id %r / X-Request-ID %r"
          % (what, rid, r.header("x-request-id")))


class Provisioned:
    """A token group made for a test, and a token key of it."""
    def __init__(self, gid, token):
        self.gid, self.token = gid, token


def provision(a, prefix, models, fallbacks=None, retries=None):
    """A group named prefix-... allowing `models` (with `fallbacks`, `retries` when given) and a
    key of it, on the control plane of Aux `a`."""
    body = {"name": prefix + "-" + new_idem(), "allowed_models": list(models)}
    if fallbacks is not None:
        body["fallbacks"] = fallbacks
    if retries is not None:
        body["retries"] = retries
    d = create_group(body, port=a.admin_port)
    _, token = create_key(d["id"], port=a.admin_port)
    return Provisioned(d["id"], token)


def list_all(kind, query="", port=None):
    """Every item of GET /token_groups or /token_keys (pages of 1000)."""
    out = []
    page = 1
    while True:
        sep = "&" if query else ""
        r = admin("GET", "/%s?%s%spage[size]=1000&page[number]=%d" % (kind, query, sep, page), port=port)
        j = check_admin_ok(r, 200, "list %s" % kind)
        out += j["data"]
        if not j["meta"]["has_more"]:
            return out
        page += 1


def group_total(port=None):
    r = admin("GET", "/token_groups?page[size]=1", port=port)
    return check_admin_ok(r, 200, "GET /token_groups")["meta"]["total_results"]


def chat_with(token, model="Kimi-K3", **kw):
    return one_request(H.port, "POST", "/v1/chat/completions", chat_body(model=model, **kw), auth=token)


def check_group_fields(d, body, what="the group"):
    for f, v in body.items():
        check(d.get(f) == v, "%s: %s is %r, want %r" % (what, f, d.get(f), v))


@test("control plane: create and get a token group (201, ETag, defaults, read-only fields)")
def t_cp_group_create_get():
    full = {"name": "support-backend", "allowed_models": ["Kimi-K3", "GLM-5.3-Flash", "Down-Model"],
            "fallbacks": {"Kimi-K3": ["GLM-5.3-Flash", "Down-Model"]},
            "retries": {"max_attempts": 2, "retry_delay_ms": 250, "backoff": "linear", "request_timeout_ms": 10000},
            "max_budget": 10.5, "budget_duration": "1d", "cache_ttl": 300, "max_parallel_requests": 20,
            "blocked": False}
    r = admin("POST", "/token_groups", full)
    j = check_admin_ok(r, 201, "create")
    check(r.header("etag") == '"1"', "create: ETag %r, want \"1\"" % r.header("etag"))
    check(r.header("x-ltg-replayed") is None, "a first answer says x-ltg-replayed")
    d = j["data"]
    check(UUID_RE.match(d.get("id", "")), "id %r is not a UUID" % d.get("id"))
    check(d.get("record_type") == "token_group", "record_type %r" % d.get("record_type"))
    check_group_fields(d, full, "the created group")
    check(d.get("version") == 1, "version %r" % d.get("version"))
    for f in ("created_at", "updated_at", "budget_started_at", "resets_at"):
        check(isinstance(d.get(f), str) and ISO_RE.match(d[f]), "%s %r is not an ISO time" % (f, d.get(f)))
    check(d.get("spend") == 0 and d.get("reserved_spend") == 0, "spend %r, reserved_spend %r" % (d.get("spend"), d.get("reserved_spend")))
    # A 1d budget: the period starts when it is set and lasts a day.
    t0 = datetime.datetime.strptime(d["budget_started_at"][:19], "%Y-%m-%dT%H:%M:%S")
    t1 = datetime.datetime.strptime(d["resets_at"][:19], "%Y-%m-%dT%H:%M:%S")
    check(t1 - t0 == datetime.timedelta(days=1), "budget period %s .. %s is not one day" % (d["budget_started_at"], d["resets_at"]))
    g, v = get_group(d["id"])
    check(v == 1, "GET: ETag %d, want 1" % v)
    check(g == d, "GET differs from the create answer:\n  %r\n  %r" % (g, d))
    # The smallest body: the optional fields take their defaults.
    d = create_group(group_body(name="minimal", allowed_models=[]))
    want = {"name": "minimal", "allowed_models": [], "fallbacks": {}, "retries": None, "max_budget": None,
            "budget_duration": None, "cache_ttl": None, "max_parallel_requests": None, "blocked": False,
            "budget_started_at": None, "resets_at": None}
    check_group_fields(d, want, "a minimal group")
    # Edges that are allowed: 3 fallbacks, the ends of every range.
    five = ["Kimi-K3", "GLM-5.3-Flash", "Down-Model", dns_model("basic"), dns_model("ttl")]
    for extra in ({"fallbacks": {"Kimi-K3": five[1:4]}},
                  {"retries": {"max_attempts": 1, "retry_delay_ms": 0, "backoff": "constant", "request_timeout_ms": 100}},
                  {"retries": {"max_attempts": 5, "retry_delay_ms": 60000, "backoff": "exponential", "request_timeout_ms": 600000}},
                  {"max_budget": 0, "budget_duration": "30d", "cache_ttl": 0, "max_parallel_requests": 1, "blocked": True}):
        b = group_body(allowed_models=five, **extra)
        check_group_fields(create_group(b), b, "a group with %r" % extra)


@test("control plane: list token groups, pagination (page[number], page[size], aliases, %5B%5D)")
def t_cp_group_list():
    mine = [create_group(group_body(name="list-%d" % i))["id"] for i in range(7)]
    every = list_all("token_groups")
    ids = [g["id"] for g in every]
    check(len(set(ids)) == len(ids), "the list shows a group twice")
    check(ids[-7:] == mine, "the list is not in creation order, or lacks new groups: last 7 %r, want %r" % (ids[-7:], mine))
    total = len(ids)
    # Defaults: page 1, size 50.
    r = admin("GET", "/token_groups")
    j = check_admin_ok(r, 200, "GET /token_groups")
    m = j["meta"]
    want = {"page_number": 1, "page_size": 50, "total_results": total, "total_pages": (total + 49) // 50,
            "has_more": total > 50}
    for k, v in want.items():
        check(m.get(k) == v, "default meta.%s = %r, want %r (meta %r)" % (k, m.get(k), v, m))
    check([g["id"] for g in j["data"]] == ids[:50], "the default page is not the first 50 groups")
    # Pages of 3, walked to the end with each spelling of the parameters.
    pages = (total + 2) // 3
    spellings = ["page[number]=%d&page[size]=3", "page_number=%d&page_size=3",
                 "page%%5Bnumber%%5D=%d&page%%5Bsize%%5D=3", "page%%5bsize%%5d=3&page_number=%d"]
    for sp in spellings:
        seen = []
        for n in range(1, pages + 1):
            q = sp % n
            r = admin("GET", "/token_groups?" + q)
            j = check_admin_ok(r, 200, "GET ?%s" % q)
            m = j["meta"]
            want = {"page_number": n, "page_size": 3, "total_results": total, "total_pages": pages,
                    "has_more": n < pages}
            for k, v in want.items():
                check(m.get(k) == v, "?%s: meta.%s = %r, want %r" % (q, k, m.get(k), v))
            seen += [g["id"] for g in j["data"]]
        check(seen == ids, "?%s: walking the pages gave %d groups, not the list of %d in order" % (sp, len(seen), total))
    # Past the end: an empty page.
    r = admin("GET", "/token_groups?page[number]=%d&page[size]=3" % (pages + 1))
    j = check_admin_ok(r, 200, "a page past the end")
    check(j["data"] == [] and j["meta"]["has_more"] is False and j["meta"]["total_results"] == total,
          "a page past the end: %r" % r.body[:300])
    # Far past the end: (number - 1) * size is past 2^32 (it once wrapped to page 1).
    for kind in ("token_groups", "token_keys", "spend/events"):
        r = admin("GET", "/%s?page[number]=67108865&page[size]=64" % kind)
        j = check_admin_ok(r, 200, "/%s, a page far past the end" % kind)
        check(j["data"] == [] and j["meta"]["page_number"] == 67108865, "/%s, a page far past the end: %r" % (kind, r.body[:300]))
    # Limits.
    check_admin_ok(admin("GET", "/token_groups?page[size]=1000"), 200, "page[size]=1000")
    for q in ("page[size]=1001", "page_size=1001", "page%5Bsize%5D=1001", "page[size]=0", "page[number]=0",
              "page[size]=abc", "page[number]=-1", "page[size]="):
        check_admin_error(admin("GET", "/token_groups?" + q), 400, "invalid_request", what="GET ?%s" % q)
    check_admin_error(admin("GET", "/token_keys?page[size]=1001"), 400, "invalid_request", what="keys ?page[size]=1001")


@test("control plane: PATCH semantics (omitted kept, null clears, nested replaced whole, version, ETag)")
def t_cp_group_patch():
    body = {"name": "patch-me", "allowed_models": ["Kimi-K3", "GLM-5.3-Flash", "Down-Model"],
            "fallbacks": {"Kimi-K3": ["GLM-5.3-Flash"], "GLM-5.3-Flash": ["Down-Model"]},
            "retries": {"max_attempts": 3, "retry_delay_ms": 100, "backoff": "linear", "request_timeout_ms": 5000},
            "max_budget": 10, "budget_duration": "7d", "cache_ttl": 300, "max_parallel_requests": 5, "blocked": False}
    d = create_group(body)
    gid = d["id"]
    state = {f: d[f] for f in GROUP_FIELDS}
    version = 1
    steps = [
        ({"name": "renamed"}, {"name": "renamed"}),
        ({"retries": {"max_attempts": 2}},   # replaced whole: the other members take their defaults
         {"retries": {"max_attempts": 2, "retry_delay_ms": 250, "backoff": "exponential", "request_timeout_ms": None}}),
        ({"fallbacks": {"GLM-5.3-Flash": ["Kimi-K3"]}}, {"fallbacks": {"GLM-5.3-Flash": ["Kimi-K3"]}}),
        ({"blocked": True, "cache_ttl": 60}, {"blocked": True, "cache_ttl": 60}),
        ({"max_budget": None, "budget_duration": None, "cache_ttl": None, "max_parallel_requests": None,
          "retries": None, "fallbacks": None},
         {"max_budget": None, "budget_duration": None, "cache_ttl": None, "max_parallel_requests": None,
          "retries": None, "fallbacks": {}}),
        ({"allowed_models": ["GLM-5.3-Flash"], "blocked": False}, {"allowed_models": ["GLM-5.3-Flash"], "blocked": False}),
        ({"retries": {"request_timeout_ms": None, "backoff": "constant"}},
         {"retries": {"max_attempts": 1, "retry_delay_ms": 250, "backoff": "constant", "request_timeout_ms": None}}),
    ]
    prev_updated = d["updated_at"]
    for patch, change in steps:
        r = admin("PATCH", "/token_groups/" + gid, patch, if_match=version)
        j = check_admin_ok(r, 200, "PATCH %r" % patch)
        version += 1
        check(etag_of(r) == version, "PATCH %r: ETag %r, want \"%d\"" % (patch, r.header("etag"), version))
        g = j["data"]
        check(g["version"] == version, "PATCH %r: version %r, want %d" % (patch, g["version"], version))
        state.update(change)
        for f in GROUP_FIELDS:
            check(g[f] == state[f], "after PATCH %r: %s is %r, want %r" % (patch, f, g[f], state[f]))
        check(g["id"] == gid and g["created_at"] == d["created_at"], "PATCH changed id or created_at")
        check(g["updated_at"] >= prev_updated, "updated_at went back: %s -> %s" % (prev_updated, g["updated_at"]))
        prev_updated = g["updated_at"]
        got, v = get_group(gid)
        check(v == version and got == g, "GET after PATCH %r: ETag %d, body differs from the PATCH answer" % (patch, v))
    # A budget set by PATCH starts a period then; changing only the amount keeps it.
    r = admin("PATCH", "/token_groups/" + gid, {"max_budget": 5, "budget_duration": "1d"}, if_match=version)
    g = check_admin_ok(r, 200, "PATCH a budget")["data"]
    version += 1
    check(g["budget_started_at"] and g["resets_at"], "a budget set by PATCH has no period: %r" % g)
    r = admin("PATCH", "/token_groups/" + gid, {"max_budget": 6}, if_match=version)
    g2 = check_admin_ok(r, 200, "PATCH the amount")["data"]
    version += 1
    check(g2["budget_started_at"] == g["budget_started_at"], "changing the amount moved the period: %s -> %s"
          % (g["budget_started_at"], g2["budget_started_at"]))
    # If-Match: * and a weak ETag are accepted.
    r = admin("PATCH", "/token_groups/" + gid, {"name": "star"}, if_match="*")
    check(check_admin_ok(r, 200, "If-Match: *")["data"]["version"] == version + 1, "If-Match: * did not bump the version")
    version += 1
    r = admin("PATCH", "/token_groups/" + gid, {"name": "weak"}, if_match='W/"%d"' % version)
    check_admin_ok(r, 200, "If-Match: W/\"%d\"" % version)
    version += 1
    check(get_group(gid)[1] == version, "final ETag")


def invalid_group_cases():
    """(what, body, code, pointer) for bodies that break one rule of API.md 3.1 each; the bodies
    are whole groups (for create) and also used as patches over a valid group."""
    five = ["Kimi-K3", "GLM-5.3-Flash", "Down-Model", dns_model("basic"), dns_model("ttl")]
    C, I = "model_not_in_catalog", "invalid_request"
    return [
        # catalog membership (checked first)
        ("allowed model not in catalog", {"allowed_models": ["Kimi-K3", "Nope-Model"]}, C, "/allowed_models/1"),
        ("fallback target not in catalog", {"fallbacks": {"Kimi-K3": ["Nope-Model"]}}, C, "/fallbacks/Kimi-K3/0"),
        ("fallback key not in catalog", {"fallbacks": {"Nope-Model": ["Kimi-K3"]}}, C, "/fallbacks/Nope-Model"),
        ("catalog before retries", {"allowed_models": ["Nope-Model"], "retries": {"max_attempts": 0}}, C, "/allowed_models/0"),
        ("catalog before allowed_models membership", {"fallbacks": {"Kimi-K3": ["Down-Model", "Nope-Model"]}}, C,
         "/fallbacks/Kimi-K3/1"),
        ("catalog before self", {"fallbacks": {"Kimi-K3": ["Kimi-K3", "Nope-Model"]}}, C, "/fallbacks/Kimi-K3/1"),
        ("pointer escaping ~ and /", {"fallbacks": {"a/b~c": ["Kimi-K3"]}}, C, "/fallbacks/a~1b~0c"),
        # fallbacks and allowed_models
        ("fallback key not allowed", {"fallbacks": {"Down-Model": ["Kimi-K3"]}}, I, "/fallbacks/Down-Model"),
        ("fallback target not allowed", {"fallbacks": {"Kimi-K3": ["GLM-5.3-Flash", "Down-Model"]}}, I, "/fallbacks/Kimi-K3/1"),
        ("fallback to itself", {"fallbacks": {"Kimi-K3": ["GLM-5.3-Flash", "Kimi-K3"]}}, I, "/fallbacks/Kimi-K3/1"),
        ("duplicate fallback", {"fallbacks": {"Kimi-K3": ["GLM-5.3-Flash", "GLM-5.3-Flash"]}}, I, "/fallbacks/Kimi-K3/1"),
        ("4 fallbacks", {"allowed_models": five, "fallbacks": {"Kimi-K3": five[1:]}}, I, "/fallbacks/Kimi-K3"),
        ("allowed model twice", {"allowed_models": ["Kimi-K3", "GLM-5.3-Flash", "Kimi-K3"]}, I, "/allowed_models/2"),
        # ranges
        ("max_attempts 0", {"retries": {"max_attempts": 0}}, I, "/retries/max_attempts"),
        ("max_attempts 6", {"retries": {"max_attempts": 6}}, I, "/retries/max_attempts"),
        ("retry_delay_ms -1", {"retries": {"retry_delay_ms": -1}}, I, "/retries/retry_delay_ms"),
        ("retry_delay_ms 60001", {"retries": {"retry_delay_ms": 60001}}, I, "/retries/retry_delay_ms"),
        ("request_timeout_ms 99", {"retries": {"request_timeout_ms": 99}}, I, "/retries/request_timeout_ms"),
        ("request_timeout_ms 600001", {"retries": {"request_timeout_ms": 600001}}, I, "/retries/request_timeout_ms"),
        ("request_timeout_ms 0", {"retries": {"request_timeout_ms": 0}}, I, "/retries/request_timeout_ms"),
        ("max_budget -1", {"max_budget": -1}, I, "/max_budget"),
        ("cache_ttl -1", {"cache_ttl": -1}, I, "/cache_ttl"),
        ("cache_ttl -2", {"cache_ttl": -2}, I, "/cache_ttl"),
        ("max_parallel_requests 0", {"max_parallel_requests": 0}, I, "/max_parallel_requests"),
        ("max_parallel_requests -1", {"max_parallel_requests": -1}, I, "/max_parallel_requests"),
        ("empty name", {"name": ""}, I, "/name"),
        # unknown and read-only fields
        ("unknown field", {"frobnicate": 1}, I, "/frobnicate"),
        ("unknown field in retries", {"retries": {"max_attempts": 2, "frobnicate": 1}}, I, "/retries/frobnicate"),
        ("read-only version", {"version": 7}, I, "/version"),
        ("read-only id", {"id": "00000000-0000-0000-0000-000000000000"}, I, "/id"),
        ("read-only spend", {"spend": 0}, I, "/spend"),
        # wrong types
        ("name a number", {"name": 5}, I, "/name"),
        ("name null", {"name": None}, I, "/name"),
        ("allowed_models a string", {"allowed_models": "Kimi-K3"}, I, "/allowed_models"),
        ("allowed_models null", {"allowed_models": None}, I, "/allowed_models"),
        ("allowed_models holds a number", {"allowed_models": ["Kimi-K3", 5]}, I, "/allowed_models/1"),
        ("fallbacks a list", {"fallbacks": ["Kimi-K3"]}, I, "/fallbacks"),
        ("fallbacks list a string", {"fallbacks": {"Kimi-K3": "GLM-5.3-Flash"}}, I, "/fallbacks/Kimi-K3"),
        ("fallbacks list holds a number", {"fallbacks": {"Kimi-K3": [5]}}, I, "/fallbacks/Kimi-K3/0"),
        ("retries a number", {"retries": 3}, I, "/retries"),
        ("max_attempts a string", {"retries": {"max_attempts": "2"}}, I, "/retries/max_attempts"),
        ("max_attempts a fraction", {"retries": {"max_attempts": 2.5}}, I, "/retries/max_attempts"),
        ("backoff unknown", {"retries": {"backoff": "random"}}, I, "/retries/backoff"),
        ("backoff a number", {"retries": {"backoff": 1}}, I, "/retries/backoff"),
        ("max_budget a string", {"max_budget": "10"}, I, "/max_budget"),
        ("budget_duration 2d", {"budget_duration": "2d"}, I, "/budget_duration"),
        ("cache_ttl a string", {"cache_ttl": "300"}, I, "/cache_ttl"),
        ("max_parallel_requests a bool", {"max_parallel_requests": True}, I, "/max_parallel_requests"),
        ("blocked a string", {"blocked": "yes"}, I, "/blocked"),
        ("blocked null", {"blocked": None}, I, "/blocked"),
    ]


def check_invalid_json(r, body, what):
    e = check_admin_error(r, 400, "invalid_json", None, what)
    m = re.search(r"byte offset (\d+)", e["detail"])
    check(m, "%s: detail %r does not give the byte offset" % (what, e["detail"]))
    off = int(m.group(1))
    check(0 <= off <= len(body), "%s: byte offset %d outside the %d-byte body" % (what, off, len(body)))
    return off


NOT_JSON = [(b'{"name": "x" "allowed_models": []}', 13), (b'{"name": "x",', 13), (b'', 0),
            (b'{"name": "x", "allowed_models": [}', 33), (b'not json', 0)]


def each_case(cases, fn):
    """Run fn(case) for every case; fail at the end with every case that failed (a table test
    reports all its broken rules at once)."""
    fails = []
    for case in cases:
        try:
            fn(case)
        except TestFailure as e:
            fails.append(str(e))
    check(not fails, "%d of %d cases failed: %s" % (len(fails), len(cases), " | ".join(fails)))


@test("control plane: invalid create bodies -> 400 with code and pointer, nothing created")
def t_cp_create_invalid():
    before = group_total()
    made = []

    def one(case):
        what, patch, code, pointer = case
        b = group_body(name="invalid-" + what)
        b.update(patch)
        r = admin("POST", "/token_groups", b)
        if r.status == 201:
            made.append(r.json()["data"]["id"])
        check_admin_error(r, 400, code, pointer, "create with %s %r" % (what, patch))
    each_case(invalid_group_cases(), one)
    before += len(made)
    # Required fields.
    check_admin_error(admin("POST", "/token_groups", {"allowed_models": TWO}), 400, "invalid_request", "/name",
                      "create without name")
    check_admin_error(admin("POST", "/token_groups", {"name": "x"}), 400, "invalid_request", "/allowed_models",
                      "create without allowed_models")
    check_admin_error(admin("POST", "/token_groups", []), 400, "invalid_request", None, "create with a JSON array")
    for raw, off in NOT_JSON:
        got = check_invalid_json(admin("POST", "/token_groups", raw), raw, "create with body %r" % raw)
        check(got == off, "create with body %r: byte offset %d, want %d" % (raw, got, off))
    check(group_total() == before, "refused creates made groups: %d -> %d" % (before, group_total()))


@test("control plane: invalid PATCH bodies -> 400, the group (version, ETag, body) unchanged")
def t_cp_patch_invalid():
    base = {"name": "patch-invalid", "allowed_models": ["Kimi-K3", "GLM-5.3-Flash"],
            "fallbacks": {"Kimi-K3": ["GLM-5.3-Flash"]},
            "retries": {"max_attempts": 2, "retry_delay_ms": 10, "backoff": "constant", "request_timeout_ms": 1000},
            "max_budget": 3, "budget_duration": "30d", "cache_ttl": 5, "max_parallel_requests": 4, "blocked": False}
    gid = create_group(base)["id"]
    good, v0 = get_group(gid)
    cases = [(w, p, c, ptr) for w, p, c, ptr in invalid_group_cases()]
    # Rules that only a merged result breaks: a fallback left without its allowed model.
    cases.append(("allowed_models dropping a fallback's model", {"allowed_models": ["Kimi-K3"]},
                  "invalid_request", "/fallbacks/Kimi-K3/0"))
    cases.append(("allowed_models dropping a fallback key", {"allowed_models": ["GLM-5.3-Flash"]},
                  "invalid_request", "/fallbacks/Kimi-K3"))
    cases.append(("a JSON array", [], "invalid_request", None))
    def one(case):
        what, patch, code, pointer = case
        snap, v1 = get_group(gid)
        r = admin("PATCH", "/token_groups/" + gid, patch, if_match=v1)
        try:
            check_admin_error(r, 400, code, pointer, "PATCH with %s %r" % (what, patch))
        finally:
            now, v = get_group(gid)
            if v != v1:              # it went through: undo it, so that the next case starts the same
                b = {f: good[f] for f in GROUP_FIELDS}
                check_admin_ok(admin("PATCH", "/token_groups/" + gid, b, if_match=v), 200, "undo")
        check(v == v1 and now["version"] == v1, "after the refused PATCH (%s): ETag %d, version %r, want %d"
              % (what, v, now["version"], v1))
        check(now == snap, "after the refused PATCH (%s) the group changed:\n  %r\n  %r" % (what, now, snap))
    each_case(cases, one)
    snap, v1 = get_group(gid)
    for raw, off in NOT_JSON:
        got = check_invalid_json(admin("PATCH", "/token_groups/" + gid, raw, if_match=v1), raw, "PATCH with %r" % raw)
        check(got == off, "PATCH with body %r: byte offset %d, want %d" % (raw, got, off))
        check(get_group(gid) == (snap, v1), "after PATCH with %r the group changed" % raw)
    # The group still takes a valid change at the version it had.
    r = admin("PATCH", "/token_groups/" + gid, {"name": "still-fine"}, if_match=v1)
    check(check_admin_ok(r, 200, "a valid PATCH after the refused ones")["data"]["version"] == v1 + 1, "version")


def no_duplicate_keys(raw, what):
    """Parse raw JSON, failing on an object with a key twice."""
    def hook(pairs):
        keys = [k for k, _ in pairs]
        dups = sorted(set(k for k in keys if keys.count(k) > 1))
        check(not dups, "%s: the JSON has the key(s) %r twice: %r" % (what, dups, raw[:400]))
        return dict(pairs)
    return json.loads(raw, object_pairs_hook=hook)


@test("control plane: a model named twice in fallbacks never yields a group with duplicate JSON keys")
def t_cp_duplicate_fallbacks():
    three = ["Kimi-K3", "GLM-5.3-Flash", "Down-Model"]
    # A model named twice in fallbacks: refused, or one list wins; never a group whose JSON has
    # the model twice (clients would each pick a different list, and so would the planner).
    raw = ('{"name":"dup-fallbacks","allowed_models":%s,"fallbacks":{"Kimi-K3":["GLM-5.3-Flash"],'
           '"Kimi-K3":["Down-Model"]}}' % json.dumps(three)).encode()
    r = admin("POST", "/token_groups", raw)
    if r.status == 400:
        check_admin_error(r, 400, "invalid_request", ANY, "fallbacks with a model twice")
    else:
        check_admin_ok(r, 201, "fallbacks with a model twice")
        d = no_duplicate_keys(r.body, "the answer to a create with a fallbacks key twice")["data"]
        check(len(d["fallbacks"]) == 1, "fallbacks %r" % d["fallbacks"])
        g = admin("GET", "/token_groups/" + d["id"])
        no_duplicate_keys(g.body, "GET of a group created with a fallbacks key twice")


@test("control plane: names round-trip exactly (escapes, non-ASCII; a NUL kept or refused, never cut)")
def t_cp_names():
    names = ['q"\\ \n\t\u00e9 \u2713 \U0001F600 </script> /~ \x01', "a\x00b"]
    for want in names:
        for ascii_only in (True, False):
            body = json.dumps({"name": want, "allowed_models": []}, ensure_ascii=ascii_only).encode("utf-8")
            r = admin("POST", "/token_groups", body)
            if r.status == 400 and "\x00" in want:
                check_admin_error(r, 400, "invalid_request", "/name", "a name with a NUL")
                continue
            d = check_admin_ok(r, 201, "create named %r" % want)["data"]
            check(d["name"] == want, "the name %r came back as %r" % (want, d["name"]))
            check(get_group(d["id"])[0]["name"] == want, "GET: the name %r came back otherwise" % want)
            kb = json.dumps({"name": want, "token_group_id": d["id"]}, ensure_ascii=ascii_only).encode("utf-8")
            r = admin("POST", "/token_keys", kb)
            if r.status == 400 and "\x00" in want:
                check_admin_error(r, 400, "invalid_request", "/name", "a key name with a NUL")
                continue
            k = check_admin_ok(r, 201, "a key named %r" % want)["data"]
            check(k["name"] == want, "the key name %r came back as %r" % (want, k["name"]))


@test("control plane: DELETE a token group -> 200 as it was, then 404; its keys are revoked")
def t_cp_group_delete():
    d = create_group(group_body(name="to-delete"))
    gid = d["id"]
    k1, s1 = create_key(gid)
    k2, s2 = create_key(gid)
    other = create_group(group_body(name="not-deleted"))
    k3, s3 = create_key(other["id"])
    check(chat_with(s1).status == 200, "the key works before the delete")
    r = admin("PATCH", "/token_groups/" + gid, {"name": "to-delete-v2"}, if_match=1)
    check_admin_ok(r, 200, "PATCH before delete")
    before, v = get_group(gid)
    check_admin_error(admin("DELETE", "/token_groups/" + gid), 428, "precondition_required", None, "DELETE without If-Match")
    e = check_admin_error(admin("DELETE", "/token_groups/" + gid, if_match=1), 412, "precondition_failed", None,
                          "DELETE with a stale If-Match")
    check(e["meta"].get("current_version") == 2, "412 meta %r" % e["meta"])
    idem = new_idem()
    r = admin("DELETE", "/token_groups/" + gid, idem=idem, if_match=2)
    j = check_admin_ok(r, 200, "DELETE")
    check(j["data"] == before, "DELETE's body is not the group as it was:\n  %r\n  %r" % (j["data"], before))
    check_admin_error(admin("GET", "/token_groups/" + gid), 404, "not_found", None, "GET after DELETE")
    check(gid not in [g["id"] for g in list_all("token_groups")], "the deleted group is still listed")
    for k in (k1, k2):
        check_admin_error(admin("GET", "/token_keys/" + k["id"]), 404, "not_found", None, "GET a key of the deleted group")
    j = check_admin_ok(admin("GET", "/token_keys?token_group_id=" + gid), 200, "keys of the deleted group")
    check(j["data"] == [] and j["meta"]["total_results"] == 0, "keys of the deleted group still listed: %r" % j)
    check_openai_error(chat_with(s1), 401, "invalid_api_key")
    check_openai_error(one_request(H.port, "GET", "/v1/models", auth=s2), 401, "invalid_api_key")
    # The other group and its key are untouched.
    check(chat_with(s3).status == 200, "a key of another group stopped working")
    check_admin_ok(admin("GET", "/token_keys/" + k3["id"]), 200, "a key of another group")
    # The same DELETE again: its first answer. A new DELETE: 404. PATCH: 404.
    r = admin("DELETE", "/token_groups/" + gid, idem=idem, if_match=2)
    check_admin_ok(r, 200, "the DELETE replayed")
    check(r.json()["data"] == before, "the replayed DELETE's body differs")
    check(r.header("x-ltg-replayed") == "true", "the replayed DELETE lacks x-ltg-replayed: true")
    check_admin_error(admin("DELETE", "/token_groups/" + gid, if_match=2), 404, "not_found", None, "a second DELETE")
    check_admin_error(admin("PATCH", "/token_groups/" + gid, {"name": "x"}, if_match=2), 404, "not_found", None,
                      "PATCH a deleted group")
    check_admin_error(admin("POST", "/token_keys", {"name": "late", "token_group_id": gid}), 400, "invalid_request",
                      "/token_group_id", "a key for a deleted group")


@test("control plane: token keys: create (secret once), list (?token_group_id=), get, DELETE revokes")
def t_cp_keys():
    g1 = create_group(group_body(name="keys-1"))["id"]
    g2 = create_group(group_body(name="keys-2"))["id"]
    r = admin("POST", "/token_keys", {"name": "first", "token_group_id": g1})
    j = check_admin_ok(r, 201, "POST /token_keys")
    check(r.header("etag") == '"1"', "ETag %r" % r.header("etag"))
    d = j["data"]
    s1 = d.get("token")
    check(isinstance(s1, str) and SECRET_RE.match(s1), "token %r" % s1)
    check(UUID_RE.match(d.get("id", "")), "id %r" % d.get("id"))
    check(d.get("record_type") == "token_key" and d.get("name") == "first" and d.get("token_group_id") == g1
          and d.get("version") == 1, "key body %r" % {k: v for k, v in d.items() if k != "token"})
    for f in ("created_at", "updated_at"):
        check(isinstance(d.get(f), str) and ISO_RE.match(d[f]), "%s %r" % (f, d.get(f)))
    k1 = {k: v for k, v in d.items() if k != "token"}
    k2, s2 = create_key(g1, "second")
    k3, s3 = create_key(g2, "third")
    check(len({s1, s2, s3}) == 3, "two keys got the same secret")
    # GET: no secret, same fields.
    r = admin("GET", "/token_keys/" + k1["id"])
    got = check_admin_ok(r, 200, "GET /token_keys/{id}")["data"]
    check(etag_of(r) == 1, "GET key ETag")
    check(got == k1, "GET differs from the create answer (without token):\n  %r\n  %r" % (got, k1))
    check("token" not in got and s1.encode() not in r.body, "GET shows the secret")
    # Lists: filtered by group, and all.
    r = admin("GET", "/token_keys?token_group_id=" + g1)
    j = check_admin_ok(r, 200, "list ?token_group_id")
    check([k["id"] for k in j["data"]] == [k1["id"], k2["id"]], "keys of group 1: %r" % [k["id"] for k in j["data"]])
    check(j["meta"]["total_results"] == 2 and j["meta"]["total_pages"] == 1 and j["meta"]["has_more"] is False,
          "meta %r" % j["meta"])
    check(all("token" not in k for k in j["data"]) and s1.encode() not in r.body and s2.encode() not in r.body,
          "the list shows a secret")
    r = admin("GET", "/token_keys?token_group_id=%s&page[size]=1&page[number]=2" % g1)
    j = check_admin_ok(r, 200, "keys page 2 of 2")
    check([k["id"] for k in j["data"]] == [k2["id"]] and j["meta"]["total_pages"] == 2 and j["meta"]["has_more"] is False,
          "page 2: %r" % r.body[:300])
    r = admin("GET", "/token_keys?page_size=1&page_number=1&token_group_id=" + g1)
    j = check_admin_ok(r, 200, "keys page 1 of 2 (aliases)")
    check([k["id"] for k in j["data"]] == [k1["id"]] and j["meta"]["has_more"] is True, "page 1: %r" % r.body[:300])
    every = list_all("token_keys")
    ids = [k["id"] for k in every]
    check(len(set(ids)) == len(ids), "a key listed twice")
    check(ids[-3:] == [k1["id"], k2["id"], k3["id"]], "the full list lacks the new keys in order")
    check(all("token" not in k for k in every), "the full list shows a secret")
    r = admin("GET", "/token_keys?token_group_id=00000000-0000-0000-0000-000000000000")
    j = check_admin_ok(r, 200, "keys of an unknown group")
    check(j["data"] == [] and j["meta"]["total_results"] == 0, "keys of an unknown group: %r" % r.body[:200])
    # Invalid creates.
    for body, pointer in (({"token_group_id": g1}, "/name"), ({"name": 5, "token_group_id": g1}, "/name"),
                          ({"name": "", "token_group_id": g1}, "/name"), ({"name": "x"}, "/token_group_id"),
                          ({"name": "x", "token_group_id": 5}, "/token_group_id"),
                          ({"name": "x", "token_group_id": "00000000-0000-0000-0000-000000000000"}, "/token_group_id"),
                          ({"name": "x", "token_group_id": g1, "frobnicate": 1}, "/frobnicate")):
        check_admin_error(admin("POST", "/token_keys", body), 400, "invalid_request", pointer, "POST /token_keys %r" % body)
    check_admin_error(admin("POST", "/token_keys", [1]), 400, "invalid_request", None, "POST /token_keys [1]")
    check_invalid_json(admin("POST", "/token_keys", b'{"name":'), b'{"name":', "POST /token_keys not JSON")
    check(len(check_admin_ok(admin("GET", "/token_keys?token_group_id=" + g1), 200, "list")["data"]) == 2,
          "a refused key create made a key")
    # Both keys work; revoke one.
    for s in (s1, s2, s3):
        check(chat_with(s).status == 200, "a new key does not work")
    check_admin_error(admin("DELETE", "/token_keys/" + k1["id"]), 428, "precondition_required", None, "DELETE key without If-Match")
    e = check_admin_error(admin("DELETE", "/token_keys/" + k1["id"], if_match=2), 412, "precondition_failed", None,
                          "DELETE key with a stale If-Match")
    check(e["meta"].get("current_version") == 1, "412 meta %r" % e["meta"])
    check(chat_with(s1).status == 200, "a refused DELETE revoked the key")
    r = admin("DELETE", "/token_keys/" + k1["id"], if_match=1)
    j = check_admin_ok(r, 200, "DELETE key")
    check(j["data"] == k1, "DELETE key body %r, want the key as it was %r" % (j["data"], k1))
    check_admin_error(admin("GET", "/token_keys/" + k1["id"]), 404, "not_found", None, "GET a revoked key")
    check_openai_error(chat_with(s1), 401, "invalid_api_key")
    check_openai_error(one_request(H.port, "POST", "/v1/embeddings", {"model": "Kimi-K3", "input": "x"}, auth=s1),
                       401, "invalid_api_key")
    check(chat_with(s2).status == 200, "revoking one key revoked another")
    check([k["id"] for k in check_admin_ok(admin("GET", "/token_keys?token_group_id=" + g1), 200, "list")["data"]]
          == [k2["id"]], "the revoked key is still listed")
    check_admin_error(admin("DELETE", "/token_keys/" + k1["id"], if_match=1), 404, "not_found", None, "DELETE a revoked key")


@test("control plane: unknown ids -> 404, wrong methods -> 405, unknown paths -> 404")
def t_cp_404_405():
    gid = create_group(group_body(name="for-405"))["id"]
    kid = create_key(gid)[0]["id"]
    nobody = "00000000-0000-4000-8000-000000000000"
    for method, path, body in (("GET", "/token_groups/" + nobody, None), ("PATCH", "/token_groups/" + nobody, {"name": "x"}),
                               ("DELETE", "/token_groups/" + nobody, None), ("GET", "/token_groups/not-a-uuid", None),
                               ("GET", "/token_keys/" + nobody, None), ("DELETE", "/token_keys/" + nobody, None),
                               ("PATCH", "/token_keys/" + nobody, {"name": "x"}),
                               ("GET", "/token_keys/" + gid, None), ("GET", "/token_groups/" + kid, None)):
        check_admin_error(admin(method, path, body, if_match=1), 404, "not_found", None, "%s %s" % (method, path))
    for method, path in (("PUT", "/token_groups"), ("DELETE", "/token_groups"), ("PATCH", "/token_groups"),
                         ("POST", "/token_groups/" + gid), ("PUT", "/token_groups/" + gid),
                         ("PUT", "/token_keys"), ("DELETE", "/token_keys"), ("PATCH", "/token_keys"),
                         ("POST", "/token_keys/" + kid), ("PUT", "/token_keys/" + kid)):
        check_405(admin(method, path, {"name": "x"}, if_match=1), "%s %s" % (method, path))
    check(get_group(gid)[1] == 1, "a 405 changed the group")
    for path in ("", "/", "/nope", "/token_groups/%s/keys" % gid, "/token_groupsx", "/spend/nope"):
        check_admin_error(admin("GET", path), 404, "not_found", None, "GET %s%s" % (API, path))
    # The control plane is not on the inference listener, nor the OpenAI API on the admin one.
    r = one_request(H.port, "GET", API + "/token_groups", auth=ADMIN_KEY)
    check(r.status == 404, "GET %s/token_groups on the inference listener: %s" % (API, r.brief()))
    r = one_request(H.admin_port, "GET", "/v1/models", auth=H.token)
    check(r.status == 404, "GET /v1/models on the admin listener: %s" % r.brief())


def check_405(r, what):
    check(r.status == 405, "%s: expected 405, got %s" % (what, r.brief()))
    check_admin_common(r, what)
    j = r.json()
    check(isinstance(j.get("errors"), list) and j["errors"] and j["errors"][0].get("code"), "%s: body %r" % (what, r.body[:200]))


@test("control plane: If-Match missing -> 428, stale -> 412 with current_version")
def t_cp_if_match():
    gid = create_group(group_body(name="if-match"))["id"]
    g0, _ = get_group(gid)
    check_admin_error(admin("PATCH", "/token_groups/" + gid, {"name": "x"}), 428, "precondition_required", None,
                      "PATCH without If-Match")
    e = check_admin_error(admin("PATCH", "/token_groups/" + gid, {"name": "x"}, if_match=5), 412,
                          "precondition_failed", None, "PATCH with If-Match \"5\" at version 1")
    check(e["meta"].get("current_version") == 1, "412: meta.current_version %r, want 1" % e["meta"])
    check(get_group(gid) == (g0, 1), "a refused PATCH changed the group")
    check_admin_ok(admin("PATCH", "/token_groups/" + gid, {"name": "v2"}, if_match=1), 200, "PATCH at version 1")
    e = check_admin_error(admin("PATCH", "/token_groups/" + gid, {"name": "lost update"}, if_match=1), 412,
                          "precondition_failed", None, "a second writer with the stale ETag")
    check(e["meta"].get("current_version") == 2, "412: meta.current_version %r, want 2" % e["meta"])
    check(get_group(gid)[0]["name"] == "v2", "the stale write went through")
    r = admin("PATCH", "/token_groups/" + gid, {"name": "x"}, if_match='"abc"')
    check(r.status in (400, 412), "If-Match \"abc\": %s" % r.brief())
    check(get_group(gid)[1] == 2, "a bad If-Match changed the group")


@test("control plane: Idempotency-Key: required, replays, conflicts, scope")
def t_cp_idempotency():
    before = group_total()
    # Missing -> 400 on every change, and nothing happens.
    gid = create_group(group_body(name="idem-target"))["id"]
    kid = create_key(gid)[0]["id"]
    before += 1
    for method, path, body in (("POST", "/token_groups", group_body(name="no-idem")),
                               ("PATCH", "/token_groups/" + gid, {"name": "no-idem"}),
                               ("DELETE", "/token_groups/" + gid, None),
                               ("POST", "/token_keys", {"name": "no-idem", "token_group_id": gid}),
                               ("DELETE", "/token_keys/" + kid, None)):
        r = admin(method, path, body, idem=None, if_match=1)
        check_admin_error(r, 400, "idempotency_key_required", None, "%s %s without Idempotency-Key" % (method, path))
    check(group_total() == before, "a change without Idempotency-Key went through")
    check(get_group(gid)[1] == 1, "a PATCH without Idempotency-Key changed the group")
    check_admin_ok(admin("GET", "/token_keys/" + kid), 200, "the key after a DELETE without Idempotency-Key")

    # Create, replayed: the same answer, no second group.
    idem = new_idem()
    body = group_body(name="idem-create")
    r1 = admin("POST", "/token_groups", body, idem=idem)
    j1 = check_admin_ok(r1, 201, "the first create")
    check(r1.header("x-ltg-replayed") is None, "the first answer says x-ltg-replayed %r" % r1.header("x-ltg-replayed"))
    r2 = admin("POST", "/token_groups", body, idem=idem)
    check_admin_ok(r2, 201, "the replayed create")
    check(r2.body == r1.body, "the replay's body differs:\n  %r\n  %r" % (r1.body[:300], r2.body[:300]))
    check(r2.header("etag") == r1.header("etag") == '"1"', "ETags %r / %r" % (r1.header("etag"), r2.header("etag")))
    check(r2.header("x-ltg-replayed") == "true", "the replay lacks x-ltg-replayed: true (headers %r)" % r2.headers)
    check(r2.header("x-request-id") and r2.header("x-request-id") != r1.header("x-request-id"),
          "the replay reuses the first X-Request-ID %r" % r1.header("x-request-id"))
    names = [g["name"] for g in list_all("token_groups")]
    check(names.count("idem-create") == 1, "the replay made a second group (%d named idem-create)" % names.count("idem-create"))
    # Same key, another body -> 409; nothing created.
    r = admin("POST", "/token_groups", group_body(name="idem-create-other"), idem=idem)
    check_admin_error(r, 409, "idempotency_conflict", None, "the same key with another body")
    check("idem-create-other" not in [g["name"] for g in list_all("token_groups")], "the conflicting create made a group")
    new_gid = j1["data"]["id"]

    # Token key create, replayed: 200, no secret, no second key.
    kidem = new_idem()
    kbody = {"name": "idem-key", "token_group_id": new_gid}
    r1 = admin("POST", "/token_keys", kbody, idem=kidem)
    k = check_admin_ok(r1, 201, "key create")["data"]
    secret = k.pop("token")
    r2 = admin("POST", "/token_keys", kbody, idem=kidem)
    j2 = check_admin_ok(r2, 200, "the replayed key create (200, API.md 3.2)")
    check("token" not in j2["data"] and secret.encode() not in r2.body, "the replay shows the secret again")
    check(j2["data"] == k, "the replayed key differs: %r vs %r" % (j2["data"], k))
    check(r2.header("x-ltg-replayed") == "true" and r2.header("etag") == '"1"', "replay headers %r" % r2.headers)
    keys = check_admin_ok(admin("GET", "/token_keys?token_group_id=" + new_gid), 200, "list")["data"]
    check([x["id"] for x in keys] == [k["id"]], "the replayed key create made another key: %r" % keys)
    check_admin_error(admin("POST", "/token_keys", {"name": "other", "token_group_id": new_gid}, idem=kidem), 409,
                      "idempotency_conflict", None, "a key create with a reused key")

    # PATCH replayed after a later change: its If-Match is stale now, but it gets its first answer.
    pidem = new_idem()
    r1 = admin("PATCH", "/token_groups/" + new_gid, {"name": "idem-v2"}, idem=pidem, if_match=1)
    check_admin_ok(r1, 200, "PATCH v2")
    check_admin_ok(admin("PATCH", "/token_groups/" + new_gid, {"name": "idem-v3"}, if_match=2), 200, "PATCH v3")
    r2 = admin("PATCH", "/token_groups/" + new_gid, {"name": "idem-v2"}, idem=pidem, if_match=1)
    check_admin_ok(r2, 200, "the replayed PATCH (stale If-Match)")
    check(r2.body == r1.body and r2.header("etag") == r1.header("etag") == '"2"' and r2.header("x-ltg-replayed") == "true",
          "the replayed PATCH: %s ETag %r replayed %r, want the first answer (ETag \"2\")"
          % (r2.brief(), r2.header("etag"), r2.header("x-ltg-replayed")))
    g, v = get_group(new_gid)
    check(v == 3 and g["name"] == "idem-v3", "the replay changed the group: version %d name %r" % (v, g["name"]))
    check_admin_error(admin("PATCH", "/token_groups/" + new_gid, {"name": "idem-other"}, idem=pidem, if_match=3), 409,
                      "idempotency_conflict", None, "a PATCH with a reused key and another body")

    # DELETE (key) replayed.
    didem = new_idem()
    r1 = admin("DELETE", "/token_keys/" + k["id"], idem=didem, if_match=1)
    check_admin_ok(r1, 200, "DELETE key")
    r2 = admin("DELETE", "/token_keys/" + k["id"], idem=didem, if_match=1)
    check_admin_ok(r2, 200, "the replayed DELETE key")
    check(r2.body == r1.body and r2.header("x-ltg-replayed") == "true", "the replayed DELETE: %s" % r2.brief())

    # A refused change is not remembered: the same key with a fixed body goes through.
    fidem = new_idem()
    check_admin_error(admin("POST", "/token_groups", group_body(name="fixme", retries={"max_attempts": 9}), idem=fidem),
                      400, "invalid_request", "/retries/max_attempts", "an invalid create")
    r = admin("POST", "/token_groups", group_body(name="fixed"), idem=fidem)
    check_admin_ok(r, 201, "the fixed create under the same Idempotency-Key")
    check(r.header("x-ltg-replayed") is None, "the fixed create was a replay")

    # Scope: the same Idempotency-Key from another admin key, or on another path, is another change.
    sidem = new_idem()
    body = group_body(name="scoped")
    a = check_admin_ok(admin("POST", "/token_groups", body, idem=sidem), 201, "create as *")["data"]
    r = admin("POST", "/token_groups", body, idem=sidem, key=limited_key("groups_write"))
    b = check_admin_ok(r, 201, "the same key from another admin key")["data"]
    check(a["id"] != b["id"] and r.header("x-ltg-replayed") is None, "another admin key got the first one's answer")
    r = admin("PATCH", "/token_groups/" + a["id"], {"name": "scoped-2"}, idem=sidem, if_match=1)
    check_admin_ok(r, 200, "the same Idempotency-Key on PATCH")
    check(r.header("x-ltg-replayed") is None, "a PATCH got a POST's answer")


@test("control plane: idempotent replays survive a restart (same --data)", fresh=True)
def t_cp_idempotency_restart():
    gbody = group_body(name="restart-create \u00e9\u2713\U0001F600 \"q\" \\ \n\t\x01 /~")
    gi, ki, pi, di = new_idem(), new_idem(), new_idem(), new_idem()
    rg = admin("POST", "/token_groups", gbody, idem=gi)
    gid = check_admin_ok(rg, 201, "create")["data"]["id"]
    kbody = {"name": "restart-key", "token_group_id": gid}
    rk = admin("POST", "/token_keys", kbody, idem=ki)
    key = check_admin_ok(rk, 201, "key create")["data"]
    secret = key.pop("token")
    k2, s2 = create_key(gid, "restart-key-2")
    rp = admin("PATCH", "/token_groups/" + gid, {"cache_ttl": 9}, idem=pi, if_match=1)
    check_admin_ok(rp, 200, "PATCH")
    check_admin_ok(admin("PATCH", "/token_groups/" + gid, {"cache_ttl": 10}, if_match=2), 200, "PATCH 3")
    rd = admin("DELETE", "/token_keys/" + k2["id"], idem=di, if_match=1)
    check_admin_ok(rd, 200, "DELETE key")
    before_g, before_v = get_group(gid)
    before_groups = list_all("token_groups")
    before_keys = list_all("token_keys")
    H.start_ltg(H.ltg_args or ())   # SIGTERM, then a new ltg on the same --data
    check(get_group(gid) == (before_g, before_v), "the group differs after the restart")
    check(list_all("token_groups") == before_groups, "the group list differs after the restart")
    check(list_all("token_keys") == before_keys, "the key list differs after the restart")
    for what, (method, path, body, idem, im, first, status) in {
            "create": ("POST", "/token_groups", gbody, gi, None, rg, 201),
            "PATCH": ("PATCH", "/token_groups/" + gid, {"cache_ttl": 9}, pi, 1, rp, 200),
            "DELETE": ("DELETE", "/token_keys/" + k2["id"], None, di, 1, rd, 200)}.items():
        r = admin(method, path, body, idem=idem, if_match=im)
        check_admin_ok(r, status, "the %s replayed after a restart" % what)
        check(r.body == first.body, "the %s replayed after a restart: body differs:\n  %r\n  %r" % (what, first.body[:300], r.body[:300]))
        check(r.header("etag") == first.header("etag"), "the %s replayed after a restart: ETag %r, first %r"
              % (what, r.header("etag"), first.header("etag")))
        check(r.header("x-ltg-replayed") == "true", "the %s replayed after a restart lacks x-ltg-replayed" % what)
    r = admin("POST", "/token_keys", kbody, idem=ki)
    j = check_admin_ok(r, 200, "the key create replayed after a restart")
    check(j["data"] == key and secret.encode() not in r.body, "the replayed key create: %r" % r.body[:300])
    check_admin_error(admin("POST", "/token_groups", group_body(name="other"), idem=gi), 409, "idempotency_conflict",
                      None, "a reused key with another body after a restart")
    after = get_group(gid)
    check(after == (before_g, before_v), "the replays changed the group:\n  before %r\n  after  %r" % ((before_g, before_v), after))
    check(list_all("token_groups") == before_groups, "the replays changed the group list")
    # (Inference last: a call may change the group's spend.)
    check(chat_with(secret).status == 200, "a token key stopped working after the restart")
    check_openai_error(chat_with(s2), 401, "invalid_api_key")


def data_files(d):
    out = []
    for root, _, files in os.walk(d):
        for f in files:
            out.append(os.path.join(root, f))
    return out


def check_secrets_absent(d, secrets):
    files = data_files(d)
    check(files, "no files in %s" % d)
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        for name, s in secrets:
            check(s.encode() not in data, "%s (%s) appears in %s" % (name, s[:12] + "...", f))


@test("control plane: a token key's secret is shown once and kept nowhere in --data")
def t_cp_secret_storage():
    gid = create_group(group_body(name="secrets"))["id"]
    keys = [create_key(gid, "secret-%d" % i) for i in range(3)]
    for k, s in keys:
        check(chat_with(s).status == 200, "a key does not work")
        r = admin("GET", "/token_keys/" + k["id"])
        check(s.encode() not in r.body, "GET shows the secret")
    r = admin("GET", "/token_keys?page[size]=1000")
    check(all(s.encode() not in r.body for _, s in keys), "the list shows a secret")
    secrets = [("token key", s) for _, s in keys] + [("the harness's token key", H.token), ("the admin key", ADMIN_KEY)]
    secrets += [("admin key " + n, v[0]) for n, v in LIMITED_KEYS.items()]
    check_secrets_absent(H.data_dir, secrets)
    # A secret is ltg_sk_ and at least 43 URL-safe characters; the 43 carry 256 bits, so the
    # characters of many keys are spread over the whole alphabet.
    chars = set("".join(s[7:] for _, s in keys))
    check(len(chars) >= 30, "3 secrets use only %d distinct characters" % len(chars))


@test("control plane: admin auth: missing, unknown, token key -> 401 (before anything else)")
def t_cp_auth():
    gid = create_group(group_body(name="auth"))["id"]
    kid, secret = create_key(gid)
    before = group_total()
    calls = [("GET", "/token_groups", None), ("POST", "/token_groups", group_body(name="unauth")),
             ("GET", "/token_groups/" + gid, None), ("PATCH", "/token_groups/" + gid, {"name": "x"}),
             ("DELETE", "/token_groups/" + gid, None), ("GET", "/token_keys", None),
             ("POST", "/token_keys", {"name": "x", "token_group_id": gid}), ("GET", "/token_keys/" + kid["id"], None),
             ("DELETE", "/token_keys/" + kid["id"], None)]
    for key, what in ((None, "no key"), ("not-a-key", "an unknown key"), (ADMIN_KEY + "x", "the admin key + x"),
                      (ADMIN_KEY[:-1], "a prefix of the admin key"), (secret, "a token key"),
                      (H.token, "the harness's token key"), ("ltg_sk_" + "A" * 43, "an unknown ltg_sk_ key")):
        for method, path, body in calls:
            r = admin(method, path, body, key=key, if_match=1)
            check_admin_error(r, 401, ANY, None, "%s %s with %s" % (method, path, what))
    with Conn(H.admin_port) as c:
        c.send(http_request("GET", API + "/token_groups", auth=None, headers={"Authorization": "Basic " + ADMIN_KEY}))
        check_admin_error(c.read_final_response(), 401, ANY, None, "Basic auth with the admin key")
    with Conn(H.admin_port) as c:
        c.send(http_request("GET", API + "/token_groups", auth=None, headers={"Authorization": "Bearer"}))
        check_admin_error(c.read_final_response(), 401, ANY, None, "an empty Bearer")
    check(group_total() == before and get_group(gid)[1] == 1, "an unauthenticated change went through")
    check(chat_with(secret).status == 200, "an unauthenticated DELETE revoked the key")
    # healthz needs no key.
    check(one_request(H.admin_port, "GET", "/healthz", auth=None).status == 200, "admin /healthz")


@test("control plane: permissions (API.md 3.6) -> 403 permission_denied naming the permission")
def t_cp_permissions():
    gid = create_group(group_body(name="perms"))["id"]
    kid = create_key(gid)[0]["id"]
    # (admin key, [(method, path, body, expected status, missing permission)])
    def plan(gid, kid):
        return {
            "groups_read": [("GET", "/token_groups", None, 200, None), ("GET", "/token_groups/" + gid, None, 200, None),
                            ("POST", "/token_groups", group_body(name="p"), 403, P_GROUPS_WRITE),
                            ("PATCH", "/token_groups/" + gid, {"name": "p"}, 403, P_GROUPS_WRITE),
                            ("DELETE", "/token_groups/" + gid, None, 403, P_GROUPS_WRITE),
                            ("GET", "/token_keys", None, 403, P_KEYS_READ),
                            ("GET", "/token_keys/" + kid, None, 403, P_KEYS_READ),
                            ("POST", "/token_keys", {"name": "p", "token_group_id": gid}, 403, P_KEYS_WRITE),
                            ("DELETE", "/token_keys/" + kid, None, 403, P_KEYS_WRITE)],
            "keys_read": [("GET", "/token_keys", None, 200, None), ("GET", "/token_keys/" + kid, None, 200, None),
                          ("GET", "/token_keys?token_group_id=" + gid, None, 200, None),
                          ("POST", "/token_keys", {"name": "p", "token_group_id": gid}, 403, P_KEYS_WRITE),
                          ("DELETE", "/token_keys/" + kid, None, 403, P_KEYS_WRITE),
                          ("GET", "/token_groups", None, 403, P_GROUPS_READ),
                          ("GET", "/token_groups/" + gid, None, 403, P_GROUPS_READ),
                          ("POST", "/token_groups", group_body(name="p"), 403, P_GROUPS_WRITE),
                          ("PATCH", "/token_groups/" + gid, {"name": "p"}, 403, P_GROUPS_WRITE)],
            "spend": [("GET", "/token_groups", None, 403, P_GROUPS_READ), ("GET", "/token_keys", None, 403, P_KEYS_READ),
                      ("POST", "/token_groups", group_body(name="p"), 403, P_GROUPS_WRITE),
                      ("PATCH", "/token_groups/" + gid, {"name": "p"}, 403, P_GROUPS_WRITE),
                      ("DELETE", "/token_keys/" + kid, None, 403, P_KEYS_WRITE),
                      ("POST", "/token_keys", {"name": "p", "token_group_id": gid}, 403, P_KEYS_WRITE)],
            "keys_write": [("GET", "/token_groups", None, 403, P_GROUPS_READ),
                           ("POST", "/token_groups", group_body(name="p"), 403, P_GROUPS_WRITE),
                           ("GET", "/token_keys/" + kid, None, 200, None)],
            "groups_write": [("GET", "/token_keys", None, 403, P_KEYS_READ),
                             ("POST", "/token_keys", {"name": "p", "token_group_id": gid}, 403, P_KEYS_WRITE),
                             ("GET", "/token_groups/" + gid, None, 200, None)],
        }
    before = group_total()
    for name, calls in plan(gid, kid).items():
        for method, path, body, status, perm in calls:
            what = "%s %s with the %s key" % (method, path, name)
            r = admin(method, path, body, key=limited_key(name), if_match=1)
            if status == 200:
                check_admin_ok(r, 200, what)
            else:
                e = check_admin_error(r, 403, "permission_denied", None, what)
                check(perm in e["detail"], "%s: detail %r does not name %s" % (what, e["detail"], perm))
    check(group_total() == before and get_group(gid)[1] == 1, "a refused change went through")
    check_admin_ok(admin("GET", "/token_keys/" + kid), 200, "the key after refused DELETEs")
    # The write keys can do their writes (a write permission includes its read, README).
    gw = limited_key("groups_write")
    d = create_group(group_body(name="by-groups-write"), key=gw)
    check_admin_ok(admin("GET", "/token_groups/" + d["id"], key=gw), 200, "GET by groups.write")
    check_admin_ok(admin("GET", "/token_groups", key=gw), 200, "list by groups.write")
    check_admin_ok(admin("PATCH", "/token_groups/" + d["id"], {"name": "by-gw-2"}, key=gw, if_match=1), 200, "PATCH by groups.write")
    kw = limited_key("keys_write")
    k, s = create_key(d["id"], key=kw)
    check(chat_with(s).status == 200, "a key made by keys.write does not work")
    check_admin_ok(admin("GET", "/token_keys?token_group_id=" + d["id"], key=kw), 200, "list keys by keys.write")
    check_admin_ok(admin("DELETE", "/token_keys/" + k["id"], key=kw, if_match=1), 200, "DELETE key by keys.write")
    check_admin_ok(admin("DELETE", "/token_groups/" + d["id"], key=gw, if_match=2), 200, "DELETE group by groups.write")
    # *: everything (the other tests use it); one more of each kind here.
    d = create_group(group_body(name="by-star"))
    k, s = create_key(d["id"])
    check_admin_ok(admin("DELETE", "/token_keys/" + k["id"], if_match=1), 200, "DELETE key by *")
    check_admin_ok(admin("DELETE", "/token_groups/" + d["id"], if_match=1), 200, "DELETE group by *")


# --- 17. inference auth (API.md 4) ---

@test("inference: unknown, revoked and admin keys -> 401 OpenAI-shaped")
def t_inf_auth_401():
    gid = create_group(group_body(name="inf-401"))["id"]
    k, s = create_key(gid)
    check(chat_with(s).status == 200, "the new key does not work")
    check_admin_ok(admin("DELETE", "/token_keys/" + k["id"], if_match=1), 200, "revoke")
    before = H.mock_stats()["requests"]
    bad = [("an unknown key", "ltg_sk_" + "B" * 43), ("a revoked key", s), ("the admin key", ADMIN_KEY),
           ("a limited admin key", limited_key("spend")), ("a secret's prefix", H.token[:-1]),
           ("a secret + x", H.token + "x"), ("no key", None)]
    for what, key in bad:
        check_openai_error(chat_with(key), 401, "invalid_api_key")
        check_openai_error(one_request(H.port, "POST", "/v1/embeddings", {"model": "Kimi-K3", "input": "x"}, auth=key),
                           401, "invalid_api_key")
        r = one_request(H.port, "GET", "/v1/models", auth=key)
        check_openai_error(r, 401, "invalid_api_key")
        check(chat_with(key, stream=True).status == 401, "%s: a stream was not refused" % what)
    check(H.mock_stats()["requests"] == before, "a refused call reached the provider")


@test("inference: a blocked group -> 403 group_blocked, unblocked works again")
def t_inf_blocked():
    gid = create_group(group_body(name="inf-blocked"))["id"]
    k, s = create_key(gid)
    check(chat_with(s).status == 200, "before blocking")
    check_admin_ok(admin("PATCH", "/token_groups/" + gid, {"blocked": True}, if_match=1), 200, "block")
    before = H.mock_stats()["requests"]
    check_openai_error(chat_with(s), 403, "group_blocked")
    check_openai_error(chat_with(s, stream=True), 403, "group_blocked")
    check_openai_error(one_request(H.port, "POST", "/v1/embeddings", {"model": "Kimi-K3", "input": "x"}, auth=s),
                       403, "group_blocked")
    check(H.mock_stats()["requests"] == before, "a blocked group's call reached the provider")
    check(chat_with(H.token).status == 200, "blocking one group blocked another")
    check_admin_ok(admin("PATCH", "/token_groups/" + gid, {"blocked": False}, if_match=2), 200, "unblock")
    check(chat_with(s).status == 200, "after unblocking")


@test("inference: a model outside allowed_models -> 403 model_not_allowed")
def t_inf_model_not_allowed():
    gid = create_group(group_body(name="inf-models", allowed_models=["GLM-5.3-Flash"]))["id"]
    k, s = create_key(gid)
    before = H.mock_stats()["requests"]
    for model in ("Kimi-K3", "Down-Model", "No-Such-Model"):
        check_openai_error(chat_with(s, model=model), 403, "model_not_allowed")
        check_openai_error(chat_with(s, model=model, stream=True), 403, "model_not_allowed")
        check_openai_error(one_request(H.port, "POST", "/v1/embeddings", {"model": model, "input": "x"}, auth=s),
                           403, "model_not_allowed")
    check(H.mock_stats()["requests"] == before, "a refused model reached the provider")
    r = chat_with(s, model="GLM-5.3-Flash")
    check(r.status == 200 and r.header("x-ltg-served-model") == "GLM-5.3-Flash", "an allowed model: %s" % r.brief())
    # The policy follows a PATCH at once.
    check_admin_ok(admin("PATCH", "/token_groups/" + gid, {"allowed_models": ["Kimi-K3"]}, if_match=1), 200, "PATCH")
    check_openai_error(chat_with(s, model="GLM-5.3-Flash"), 403, "model_not_allowed")
    check(chat_with(s, model="Kimi-K3").status == 200, "a newly allowed model")
    # An empty allowed_models permits nothing.
    check_admin_ok(admin("PATCH", "/token_groups/" + gid, {"allowed_models": []}, if_match=2), 200, "PATCH []")
    check_openai_error(chat_with(s, model="Kimi-K3"), 403, "model_not_allowed")


@test("inference: max_parallel_requests 1 -> the second in flight gets 429 with Retry-After: 1")
def t_inf_parallel():
    gid = create_group(group_body(name="inf-parallel", max_parallel_requests=1))["id"]
    k1, s1 = create_key(gid)
    k2, s2 = create_key(gid)
    # The slow request takes 4-5 s, so that the next two are answered while it is in flight even on
    # a slow machine; the delay doubles as a mark the mock's log can tell apart.
    delay = 4000 + random.randint(0, 999)
    directive = "head_delay_ms=%d" % delay
    result = {}

    def slow():
        try:
            result["r"] = chat_with(s1, directive=directive)
        except Exception as e:
            result["e"] = e
        result["t"] = time.monotonic()

    th = threading.Thread(target=slow)
    th.start()
    try:
        wait_until("the slow request reaching the mock",
                   lambda: any(e.get("directive") == directive for e in H.mock_stats().get("log", [])),
                   15 * SLOW, 0.05)
        refused = []
        for key in (s1, s2):       # the limit is the group's: another key of the group is refused too
            r = chat_with(key)
            refused.append((time.monotonic(), r))
        in_flight = th.is_alive()
    finally:
        th.join(30)
    check("e" not in result, "the slow request: %r" % result.get("e"))
    check(result["r"].status == 200, "the slow request: %s" % result["r"].brief())
    check(in_flight, "the slow request finished before the second was answered: the timing proves nothing")
    for t, r in refused:
        check_openai_error(r, 429, "too_many_parallel_requests")
        check(r.header("retry-after") == "1", "429 Retry-After %r, want 1" % r.header("retry-after"))
        check(t < result["t"], "the 429 came after the first request finished")
    r = chat_with(s2)
    check(r.status == 200, "after the first finished, a new request: %s" % r.brief())
    # Other groups are not limited by this one.
    check(chat_with(H.token).status == 200, "another group's request")
    # A finished stream and an upstream failure free their slots too.
    r = chat_with(s1, stream=True)
    check(r.status == 200, "a stream: %s" % r.brief())
    r = chat_with(s1, directive="status=503")
    check(r.status == 503, "a 503: %s" % r.brief())
    r = chat_with(s1, model="GLM-5.3-Flash", directive="reset")
    check(r.status == 502, "a reset: %s" % r.brief())
    for i in range(3):
        r = chat_with(s1)
        check(r.status == 200, "call %d after a stream and failures: %s (a slot leaked?)" % (i + 1, r.brief()))


@test("inference: GET /v1/models lists exactly the key's group's allowed models")
def t_inf_models():
    allowed = ["GLM-5.3-Flash", "Down-Model", "Kimi-K3"]
    gid = create_group(group_body(name="inf-list", allowed_models=allowed))["id"]
    k, s = create_key(gid)
    r = one_request(H.port, "GET", "/v1/models", auth=s)
    check(r.status == 200, "GET /v1/models: %s" % r.brief())
    j = r.json()
    check(j.get("object") == "list", "object %r" % j.get("object"))
    ids = [m.get("id") for m in j.get("data", [])]
    check(sorted(ids) == sorted(allowed) and len(ids) == len(allowed), "models %r, want %r" % (ids, allowed))
    check(all(m.get("object") == "model" for m in j["data"]), "entries %r" % j["data"])
    r = one_request(H.port, "GET", "/v1/models", auth=H.token)
    ids = [m["id"] for m in r.json()["data"]]
    check(sorted(ids) == sorted(H.config["models"]), "the harness key's models %r" % ids)
    check_admin_ok(admin("PATCH", "/token_groups/" + gid, {"allowed_models": ["Kimi-K3"]}, if_match=1), 200, "PATCH")
    ids = [m["id"] for m in one_request(H.port, "GET", "/v1/models", auth=s).json()["data"]]
    check(ids == ["Kimi-K3"], "after PATCH: %r" % ids)
    check_admin_ok(admin("PATCH", "/token_groups/" + gid, {"allowed_models": []}, if_match=2), 200, "PATCH []")
    j = one_request(H.port, "GET", "/v1/models", auth=s).json()
    check(j.get("data") == [], "after PATCH []: %r" % j)


# --- 18. other ltg processes: the state log, crashes, a catalog reload, the README ---

# Catalogs and calls for the test files that run an ltg of their own.

def catalog_copy():
    """A deep copy of the harness's catalog, for a test file to extend."""
    return json.loads(json.dumps(H.config))


def catalog_model(provider, upstream, in_usd=0.50, out_usd=1.00):
    """A model entry of a catalog."""
    return {"provider": provider, "upstream_model": upstream, "input_usd_per_mtok": in_usd, "output_usd_per_mtok": out_usd}


class ModelPool:
    """The models alias % 1 .. alias % n of a test file's catalog, on `provider`, each with its alias
    in lower case as its upstream model: add_to() puts them in the catalog; take() hands out models
    no test took before, so that no two tests share the mock's scripts and counters or ltg's
    circuit breakers."""

    def __init__(self, alias, n, provider="mock"):
        self.alias, self.n, self.provider = alias, n, provider
        self.taken = 0

    @staticmethod
    def upstream(alias):
        """The upstream model the mock sees for a model of a pool."""
        return alias.lower()

    def add_to(self, cfg):
        for i in range(1, self.n + 1):
            cfg["models"][self.alias % i] = catalog_model(self.provider, self.upstream(self.alias % i))

    def take(self, k=1):
        """k models no test took before (a list)."""
        out = []
        for _ in range(k):
            self.taken += 1
            check(self.taken <= self.n, "the model pool %s..%s is exhausted: make it larger"
                  % (self.alias % 1, self.alias % self.n))
            out.append(self.alias % self.taken)
        return out

    def take_one(self):
        return self.take(1)[0]


def catalog_provider(port, host="127.0.0.1", scheme="http", **more):
    """A provider entry whose key is MOCK_KEY's, at scheme://host:port/v1; `more` are its other fields (api=...)."""
    return dict({"base_url": "%s://%s:%d/v1" % (scheme, host, port), "api_key_env": "MOCK_KEY"}, **more)


def write_catalog(cfg, name):
    """Write catalog `cfg` as {tmp}/catalog-NAME.json; returns its path."""
    path = os.path.join(H.tmp, "catalog-%s.json" % name)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


_CATALOGS = {}      # name -> the path catalog_file() wrote


def catalog_file(name, build):
    """The catalog of a test file's own ltg: build() (a catalog) written as {tmp}/catalog-NAME.json on
    first use; its path."""
    if name not in _CATALOGS:
        _CATALOGS[name] = write_catalog(build(), name)
    return _CATALOGS[name]


def start_refused(aux):
    """Start `aux` expecting ltg to refuse to start (a bad catalog): (exit code, what it logged).
    The Aux is closed after."""
    try:
        return aux.start_fails()
    finally:
        aux.close()


def check_catalog_refusals(tag, cases):
    """Each case (what, cfg, words): an ltg on catalog `cfg` (tag TAG-bad-I, its catalog written as
    {tmp}/catalog-TAG-bad-I.json) must refuse to start, exit code not 0, and say every one of
    `words`. One failure names every case that did not."""
    failures = []
    for i, (what, cfg, words) in enumerate(cases):
        name = "%s-bad-%d" % (tag, i)
        rc, text = start_refused(Aux(name, config=write_catalog(cfg, name)))
        if rc == 0:
            failures.append("%s: exit code 0" % what)
        elif not all(w in text for w in words):
            failures.append("%s: the message does not say %s: %r" % (what, " and ".join(repr(w) for w in words),
                                                                    text.strip()[-300:]))
    check(not failures, "; ".join(failures))


def timed_call(port, token, model, stream=False, headers=None, timeout=60.0, path="/v1/chat/completions", body=None,
               **extra):
    """One inference request on a connection of its own; the Response has .t0 (when it was sent)
    and .elapsed (s)."""
    if body is None:
        body = chat_body(model=model, stream=stream, **extra)
    t0 = time.monotonic()
    with Conn(port, timeout=timeout) as c:
        c.send(http_request("POST", path, body, headers, auth=token))
        r = c.read_final_response(timeout)
    r.t0, r.elapsed = t0, time.monotonic() - t0
    return r


# These run their own ltg (same catalog, own ports and --data), so that they can damage its log,
# kill it, or use the README's ports, without touching the main one.

def free_ports(n):
    return [free_port() for _ in range(n)]


# Sockets of hostile clients (integration_hostile_clients.py, integration_bounds.py).

def raise_fd_limit(need):
    """This process will hold `need` sockets: raise the soft RLIMIT_NOFILE (up to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < need:
            raise TestSkip("needs %d open files, the hard limit is %d" % (need, hard))


def closed_by_peer(socks, timeout):
    """Wait until the peer closes each socket (EOF or reset): {socket: bytes received} of those
    that closed within timeout."""
    sel = selectors.DefaultSelector()
    got = {}
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
        got[s] = b""
    closed = {}
    deadline = time.monotonic() + timeout
    while got and time.monotonic() < deadline:
        for key, _ in sel.select(max(0.0, min(0.5, deadline - time.monotonic()))):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                got[s] += data
                continue
            sel.unregister(s)
            closed[s] = got.pop(s)
    sel.close()
    return closed


def close_all(socks):
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


def healthz_ok(port, timeout=5.0, source=None):
    """GET /healthz with Connection: close, read until ltg closes: when this returns, the connection
    no longer counts against --max-conns. `source`: another loopback address to call from."""
    try:
        with Conn(port, timeout=timeout, source=source) as c:
            c.send(http_request("GET", "/healthz", auth=None, headers={"Connection": "close"}))
            r = c.read_final_response(timeout)
            c.wait_closed(timeout)
        return r.status == 200
    except (OSError, EOFError, TestFailure):
        return False


def wait_until(what, fn, timeout, step=0.2):
    """Poll fn() until true, within timeout; fail naming `what` (a string, or a function that says
    it when the time is up: what was seen by then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(step)
    raise TestFailure("%s: not within %g s" % (what() if callable(what) else what, timeout))


_METRIC_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_sum(admin_port, name, **labels):
    """The sum of the samples of `name` in GET /metrics on an ltg's admin listener whose labels
    include `labels` (0 when there are none). Read on a connection closed on both sides before
    this returns (as healthz_ok: it never counts against --max-conns afterwards)."""
    with Conn(admin_port, timeout=30) as c:
        c.send(http_request("GET", "/metrics", auth=None, headers={"Connection": "close"}))
        r = c.read_final_response(30)
        c.wait_closed(10)
    check(r.status == 200, "GET /metrics: %s" % r.brief())
    total = 0.0
    for line in r.body.decode("utf-8", "replace").splitlines():
        if line.startswith(name + "{"):
            lab, _, val = line[len(name) + 1:].rpartition("} ")
        elif line.startswith(name + " "):
            lab, val = "", line[len(name) + 1:]
        else:
            continue
        have = dict(_METRIC_LABEL.findall(lab))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(val.split()[0])
    return total


def held_conns(port, n):
    """n connections ltg has accepted (each answered one GET /healthz), kept open."""
    out = []
    for _ in range(n):
        c = Conn(port)
        out.append(c)
        c.send(http_request("GET", "/healthz", auth=None))
        r = c.read_final_response()
        check(r.status == 200, "a connection within the cap: %s" % r.brief())
    return out


class Aux:
    """Another ltg: the catalog of the harness (or `config`), its own --data, ports and log; `args`
    are more flags, `env` replaces the harness's environment, `preexec` runs in the child before ltg
    (or the --wrap command) starts."""

    every = []      # every Aux made: those still running are stopped and checked at the end

    def __init__(self, tag, ports=None, config=None, args=(), env=None, preexec=None):
        self.tag = tag
        self.data_dir = os.path.join(H.tmp, "data-" + tag)
        self.config_path = config or H.config_path
        self.port, self.admin_port = ports or free_ports(2)
        self.args = list(args)
        self.env = env
        self.preexec = preexec
        self.log_path = os.path.join(H.tmp, "ltg-%s.log" % tag)
        self.log = open(self.log_path, "ab")
        self.proc = None
        self.started_at = 0          # log offset at the last start
        Aux.every.append(self)

    def spawn(self):
        self.log.write((" ".join(["\n==== starting ltg"] + self.args) + "\n").encode())
        self.log.flush()
        self.started_at = os.path.getsize(self.log_path)
        self.proc = subprocess.Popen(ltg_argv([H.ltg_bin, "--config", self.config_path, "--data", self.data_dir,
                                               "--listen", "127.0.0.1:%d" % self.port,
                                               "--admin-listen", "127.0.0.1:%d" % self.admin_port] + self.args),
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     env=self.env or H.env, preexec_fn=self.preexec)

    def start(self, timeout=20):
        self.spawn()
        timeout *= SLOW
        deadline = time.monotonic() + timeout
        ready = set()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TestFailure("ltg (%s) exited with %s during start-up: %s" % (self.tag, self.proc.returncode,
                                                                                    self.text_since_start()[-600:]))
            for p in (self.port, self.admin_port):
                if p not in ready:
                    try:
                        if one_request(p, "GET", "/healthz", auth=None, timeout=2).status == 200:
                            ready.add(p)
                    except Exception:
                        pass
            if len(ready) == 2:
                return
            time.sleep(0.05)
        raise TestFailure("ltg (%s) not ready within %d s: %s" % (self.tag, timeout, self.text_since_start()[-600:]))

    def start_fails(self, timeout=20):
        """Start ltg and expect it to exit at start-up: (exit code, what it logged)."""
        self.spawn()
        timeout *= SLOW
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TestFailure("ltg (%s) was expected to refuse to start but still runs after %d s" % (self.tag, timeout))
        self.proc = None
        return rc, self.text_since_start()

    def text_since_start(self):
        return self.text_since(self.started_at)

    def text_since(self, at):
        """Its log from offset `at` (an earlier log_size())."""
        with open(self.log_path, "rb") as f:
            f.seek(at)
            return f.read().decode("utf-8", "replace")

    def log_size(self):
        return os.path.getsize(self.log_path)

    def report_since(self, at):
        """The first line of a sanitizer or valgrind report in its log after offset `at`, or None."""
        return sanitizer_line(self.text_since(at))

    def stop(self):
        if self.proc is None:
            return
        p, self.proc = self.proc, None
        p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(timeout=15 * SLOW)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise TestFailure("ltg (%s) still running %g s after SIGTERM" % (self.tag, 15 * SLOW))
        check(rc == 0, "ltg (%s) exited with %r after SIGTERM: %s" % (self.tag, rc, self.text_since_start()[-400:]))

    def kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self):
        """Kill it if it runs; fail on a sanitizer report in its log."""
        self.kill()
        self.log.close()
        san = self.report_since(0)
        if san:
            raise TestFailure("sanitizer report in the log of ltg (%s): %s" % (self.tag, san))

    def admin(self, method, path, body=None, **kw):
        return admin(method, path, body, port=self.admin_port, **kw)


@contextlib.contextmanager
def running(aux):
    """`with running(Aux(...)) as a:` a test's own ltg: `aux` started; at the end of the block
    stopped (it must exit 0 on SIGTERM) and, whatever happened, closed (a sanitizer report in its
    log fails)."""
    try:
        aux.start()
        yield aux
        aux.stop()
    finally:
        aux.close()


class AuxSlot:
    """The ltg of the tests of one integration_*.py file: make(n) makes the n-th Aux; get() starts
    one on first use, and a new one if the last died."""

    def __init__(self, make):
        self.make = make
        self.aux = None
        self.n = 0

    def get(self):
        a = self.aux
        if a is not None and a.proc is not None and a.proc.poll() is None:
            return a
        if a is not None:
            try:
                a.close()
            except Exception:
                pass        # its sanitizer report, if any, failed the test during which it died
        self.n += 1
        self.aux = self.make(self.n)
        self.aux.start()
        return self.aux

    def test(self, name, what):
        """A decorator: register test `name`, which runs fn(the Aux) with run()."""
        def deco(fn):
            runner = lambda: self.run(fn, what)
            runner.__module__ = fn.__module__       # whose test it is, for main(only=...)
            test(name)(runner)
            return fn
        return deco

    def run(self, fn, what):
        """fn(the Aux); then fail on a sanitizer report written meanwhile to its log, or on its death
        (`what` names it in the messages)."""
        a = self.get()
        at = a.log_size()
        err = None
        try:
            fn(a)
        except Exception as e:
            err = e
        san = a.report_since(at)
        if san:
            raise TestFailure("sanitizer report in the log of %s: %s%s" % (what, san, " (and: %s)" % err if err else ""))
        if a.proc is None or a.proc.poll() is not None:
            rc = a.proc.returncode if a.proc is not None else None
            raise TestFailure("%s exited with code %r during the test%s; its log: %s"
                              % (what, rc, " (%s)" % err if err else "", a.text_since_start()[-500:]))
        if err:
            raise err

    def stop_test(self, module, name, none_ran):
        """Register test `name` of `module` (the file's __name__), to be its last: stop(none_ran)."""
        runner = lambda: self.stop(none_ran)
        runner.__module__ = module      # whose test it is, for main(only=...)
        test(name)(runner)

    def stop(self, none_ran):
        """The last test of the file: the Aux exits 0 on SIGTERM and its log holds no sanitizer
        report; TestSkip(none_ran) if there is none."""
        a, self.aux = self.aux, None
        if a is None:
            raise TestSkip(none_ran)
        try:
            if a.proc is not None:
                a.stop()
        finally:
            a.close()


@test("state log: a torn tail is truncated with a warning; damage and a bad magic stop start-up")
def t_log_damage():
    a = Aux("log")
    try:
        a.start()
        gid = create_group(group_body(name="log-1", max_budget=2, budget_duration="7d"), port=a.admin_port)["id"]
        check_admin_ok(a.admin("PATCH", "/token_groups/" + gid, {"name": "log-1b", "cache_ttl": 60}, if_match=1), 200, "PATCH")
        k, secret = create_key(gid, port=a.admin_port)
        g2 = create_group(group_body(name="log-2"), port=a.admin_port)["id"]
        check_admin_ok(a.admin("DELETE", "/token_groups/" + g2, if_match=1), 200, "DELETE")
        state = (list_all("token_groups", port=a.admin_port), list_all("token_keys", port=a.admin_port))
        a.stop()
        path = os.path.join(a.data_dir, "state.log")
        check_secrets_absent(a.data_dir, [("a token key", secret), ("the admin key", ADMIN_KEY)])
        with open(path, "rb") as f:
            good = f.read()
        check(good[:8] == b"LTGLOG1\n", "the log does not start with the magic: %r" % good[:8])
        # Walk the records: [len LE32][crc LE32][payload].
        offs = []
        off = 8
        while off < len(good):
            n = struct.unpack("<I", good[off:off + 4])[0]
            offs.append(off)
            off += 8 + n
        check(off == len(good) and len(offs) >= 5, "the log is not %d whole records: ends at %d of %d"
              % (len(offs), off, len(good)))

        # 1. A torn tail: a header claiming 100 bytes, and 10 of them.
        with open(path, "ab") as f:
            f.write(struct.pack("<II", 100, 0) + b"0123456789")
        a.start()
        text = a.text_since_start()
        check("torn" in text, "no warning about a torn record in ltg's log: %r" % text[-500:])
        check(os.path.getsize(path) == len(good), "the torn record was not cut off: %d bytes, want %d"
              % (os.path.getsize(path), len(good)))
        check((list_all("token_groups", port=a.admin_port), list_all("token_keys", port=a.admin_port)) == state,
              "the state differs after a torn tail")
        r = one_request(a.port, "GET", "/v1/models", auth=secret)
        check(r.status == 200, "the key after the torn-tail restart: %s" % r.brief())
        a.stop()
        with open(path, "rb") as f:
            check(f.read() == good, "the log changed beyond the cut")

        # 2. A last record whose checksum fails is a torn write too: that change is dropped.
        bad = bytearray(good)
        bad[offs[-1] + 8 + 2] ^= 0x20
        with open(path, "wb") as f:
            f.write(bad)
        a.start()
        check("torn" in a.text_since_start(), "no warning about a last record with a bad checksum")
        check(os.path.getsize(path) == offs[-1], "the bad last record was not cut off")
        g, _ = get_group(g2, port=a.admin_port)     # the last record was the DELETE of g2
        check(g["name"] == "log-2", "after dropping the last record: %r" % g)
        a.stop()
        with open(path, "wb") as f:
            f.write(good)

        # 3. A damaged first record with whole records after it: start-up stops.
        bad = bytearray(good)
        bad[20] ^= 0x01
        with open(path, "wb") as f:
            f.write(bad)
        rc, text = a.start_fails()
        check(rc != 0, "ltg started (exit %r) on a log with a damaged first record" % rc)
        check(path in text and "offset 8" in text, "the message should name %s and \"offset 8\": %r" % (path, text[-500:]))
        with open(path, "rb") as f:
            check(f.read() == bytes(bad), "ltg changed a damaged log it refused")
        check(not port_open(a.admin_port), "something listens on the refused ltg's admin port")

        # 4. A changed magic.
        bad = bytearray(good)
        bad[3] ^= 0x01
        with open(path, "wb") as f:
            f.write(bad)
        rc, text = a.start_fails()
        check(rc != 0, "ltg started (exit %r) on a log with a changed magic" % rc)
        check(path in text, "the message should name %s: %r" % (path, text[-500:]))

        # The original file still works.
        with open(path, "wb") as f:
            f.write(good)
        a.start()
        check((list_all("token_groups", port=a.admin_port), list_all("token_keys", port=a.admin_port)) == state,
              "the state differs after the restores")
        a.stop()
    finally:
        a.close()


@test("control plane: many creates and deletes: lists, pages and keys stay right, also after a restart")
def t_cp_churn():
    a = Aux("churn")
    try:
        a.start()
        groups = []          # [(id, key id, secret)] in creation order
        for i in range(120):
            gid = create_group(group_body(name="churn-%03d" % i), port=a.admin_port)["id"]
            k, s = create_key(gid, port=a.admin_port)
            groups.append((gid, k["id"], s))
        rng = random.Random(7)
        doomed = set(rng.sample(range(120), 100))
        for i in sorted(doomed, key=lambda _: rng.random()):
            check_admin_ok(a.admin("DELETE", "/token_groups/" + groups[i][0], if_match=1), 200, "DELETE churn-%03d" % i)
        # A few more groups and keys after the deletions, and some keys revoked alone.
        extra = []
        for i in range(5):
            gid = create_group(group_body(name="churn-late-%d" % i), port=a.admin_port)["id"]
            k, s = create_key(gid, port=a.admin_port)
            extra.append((gid, k["id"], s))
        alive = [groups[i] for i in range(120) if i not in doomed] + extra
        revoked = set()
        for gid, kid, s in alive[::4]:
            check_admin_ok(a.admin("DELETE", "/token_keys/" + kid, if_match=1), 200, "revoke")
            revoked.add(kid)

        def verify(when):
            every = list_all("token_groups", port=a.admin_port)
            check([g["id"] for g in every] == [g for g, _, _ in alive], "%s: the group list is not the %d live "
                  "groups in creation order (%d listed)" % (when, len(alive), len(every)))
            seen = []
            for n in range(1, 100):
                j = check_admin_ok(a.admin("GET", "/token_groups?page[size]=7&page[number]=%d" % n), 200, "page")
                seen += [g["id"] for g in j["data"]]
                if not j["meta"]["has_more"]:
                    break
            check(seen == [g["id"] for g in every], "%s: pages of 7 differ from the list" % when)
            keys = list_all("token_keys", port=a.admin_port)
            want = [k for _, k, _ in alive if k not in revoked]
            check([k["id"] for k in keys] == want, "%s: the key list is not the %d live keys in order" % (when, len(want)))
            for gid, kid, s in alive:
                j = check_admin_ok(a.admin("GET", "/token_keys?token_group_id=" + gid), 200, "keys of a group")
                check([k["id"] for k in j["data"]] == ([] if kid in revoked else [kid]), "%s: keys of %s: %r"
                      % (when, gid, j["data"]))
                r = one_request(a.port, "GET", "/v1/models", auth=s)
                check(r.status == (401 if kid in revoked else 200), "%s: /v1/models with a %s key: %s"
                      % (when, "revoked" if kid in revoked else "live", r.brief()))
            for i in sorted(doomed)[:20]:
                gid, kid, s = groups[i]
                check_admin_error(a.admin("GET", "/token_groups/" + gid), 404, "not_found", None, "%s: a deleted group" % when)
                check(one_request(a.port, "GET", "/v1/models", auth=s).status == 401, "%s: a deleted group's key works" % when)
        verify("before the restart")
        a.stop()
        a.start()
        verify("after the restart")
        a.stop()
    finally:
        a.close()


@test("state log: crash consistency: 20+ SIGKILLs while groups are created")
def t_log_crash():
    a = Aux("crash")
    stop = threading.Event()
    up = threading.Event()
    lock = threading.Lock()
    acked = {}          # name -> (id, body) of every create answered 201
    unknown = {}        # name -> (Idempotency-Key, body) of creates with no answer (killed)
    errors = []
    counter = itertools.count()

    def client():
        while not stop.is_set():
            if not up.wait(0.2):
                continue
            i = next(counter)
            name = "crash-%05d" % i
            body = {"name": name, "allowed_models": TWO, "cache_ttl": i % 7,
                    "retries": {"max_attempts": 1 + i % 5, "retry_delay_ms": i, "backoff": "linear",
                                "request_timeout_ms": None}}
            idem = "crash-%d-%s" % (i, os.urandom(4).hex())
            with lock:
                try:
                    r = a.admin("POST", "/token_groups", body, idem=idem, timeout=20)
                except Exception:
                    unknown[name] = (idem, body)
                    up.clear()
                    continue
                if r.status == 201:
                    acked[name] = (r.json()["data"]["id"], body)
                else:
                    errors.append("create %s: %s" % (name, r.brief()))
                    stop.set()

    checked = set()     # names already read one by one after a restart
    stats = {"torn": 0, "retried": 0}

    def verify(round_no, final=False):
        # ltg started cleanly: a torn tail is fine, damage is not.
        text = a.text_since_start()
        check("damaged" not in text, "round %d: ltg reports damage: %r" % (round_no, text[-400:]))
        stats["torn"] += "torn" in text
        # The creates with no answer: retried with the same key and body, each is created once.
        for name, (idem, body) in list(unknown.items()):
            stats["retried"] += 1
            r = a.admin("POST", "/token_groups", body, idem=idem, timeout=20)
            check(r.status == 201, "round %d: retrying the unanswered create %s: %s" % (round_no, name, r.brief()))
            acked[name] = (r.json()["data"]["id"], body)
            del unknown[name]
        every = list_all("token_groups", port=a.admin_port)
        names = [g["name"] for g in every]
        ids = [g["id"] for g in every]
        check(len(set(names)) == len(names), "round %d: a group is listed twice: %r"
              % (round_no, sorted(n for n in set(names) if names.count(n) > 1)[:5]))
        check(len(set(ids)) == len(ids), "round %d: an id is listed twice" % round_no)
        by_id = {g["id"]: g for g in every}
        # Every acknowledged group is listed with its fields; those acknowledged since the last
        # check (and, at the end, all) are also read one by one.
        fresh = [n for n in acked if n not in checked] if not final else list(acked)
        for name, (gid, body) in acked.items():
            check(gid in by_id, "round %d: the acknowledged group %s (%s) is not listed" % (round_no, name, gid))
            check_group_fields(by_id[gid], body, "round %d: group %s (listed)" % (round_no, name))
        with Conn(a.admin_port, timeout=20) as c:
            for name in fresh:
                gid, body = acked[name]
                r = admin("GET", "/token_groups/" + gid, conn=c)
                check(r.status == 200, "round %d: GET the acknowledged group %s: %s" % (round_no, name, r.brief()))
                d = r.json()["data"]
                check_group_fields(d, body, "round %d: group %s" % (round_no, name))
                check(d == by_id[gid], "round %d: GET and list differ for %s" % (round_no, name))
                checked.add(name)
        check(set(names) == set(acked), "round %d: groups nobody was told about: %r"
              % (round_no, sorted(set(names) - set(acked))[:5]))

    th = threading.Thread(target=client, daemon=True)
    t0 = time.monotonic()
    kills = 0
    try:
        a.start()
        th.start()
        while kills < 20 or (kills < 40 and time.monotonic() - t0 < 30):
            check(time.monotonic() - t0 < 150, "the crash test took too long (%d kills)" % kills)
            up.set()
            time.sleep(random.uniform(0.05, 0.4))     # on purpose: a random moment of the client's work to kill at
            a.kill()
            kills += 1
            a.start()
            with lock:
                up.clear()
                check(not errors, "; ".join(errors[:3]))
                verify(kills)
        stop.set()
        up.set()
        th.join(30)
        check(not errors, "; ".join(errors[:3]))
        with lock:
            verify(kills + 1, final=True)
        log("crash test: %d kills, %d groups, %d starts after a torn tail, %d unanswered creates retried, %.1f s"
            % (kills, len(acked), stats["torn"], stats["retried"], time.monotonic() - t0))
        check(len(acked) >= kills, "only %d creates in %d rounds: the client hardly ran" % (len(acked), kills))
        a.stop()
    finally:
        stop.set()
        up.set()
        th.join(30)
        a.close()


@test("inference: a model dropped from the catalog by SIGHUP -> 404 model_not_found")
def t_inf_catalog_drop():
    path = os.path.join(H.tmp, "catalog-reload.json")
    with open(path, "w") as f:
        json.dump(H.config, f)
    a = Aux("reload", config=path)
    try:
        a.start()
        gid = create_group(group_body(name="reload", allowed_models=["Kimi-K3", "GLM-5.3-Flash"]), port=a.admin_port)["id"]
        k, s = create_key(gid, port=a.admin_port)
        r = one_request(a.port, "POST", "/v1/chat/completions", chat_body(model="GLM-5.3-Flash"), auth=s)
        check(r.status == 200, "before the reload: %s" % r.brief())
        cfg = json.loads(json.dumps(H.config))
        del cfg["models"]["GLM-5.3-Flash"]
        with open(path, "w") as f:
            json.dump(cfg, f)
        at = os.path.getsize(a.log_path)
        a.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10 * SLOW
        while time.monotonic() < deadline:
            r = one_request(a.port, "POST", "/v1/chat/completions", chat_body(model="GLM-5.3-Flash"), auth=s)
            if r.status != 200:
                break
            time.sleep(0.1)     # backoff: polling for the reload
        check_openai_error(r, 404, "model_not_found")
        ids = [m["id"] for m in one_request(a.port, "GET", "/v1/models", auth=s).json()["data"]]
        check(ids == ["Kimi-K3"], "/v1/models after the reload: %r" % ids)
        r = one_request(a.port, "POST", "/v1/chat/completions", chat_body(model="Kimi-K3"), auth=s)
        check(r.status == 200, "a model still in the catalog: %s" % r.brief())
        # The group still names the dropped model; a PATCH that keeps it is refused as not in the catalog.
        e = check_admin_error(a.admin("PATCH", "/token_groups/" + gid, {"name": "x"}, if_match=1), 400,
                              "model_not_in_catalog", "/allowed_models/1", "PATCH a group naming a dropped model")
        check_admin_ok(a.admin("PATCH", "/token_groups/" + gid, {"allowed_models": ["Kimi-K3"]}, if_match=1), 200,
                       "PATCH dropping the model")
        a.stop()
    finally:
        a.close()


# The README's quick start runs as written: tests/integration_readme.py.


# --- 19. the official OpenAI node SDK ---

# Every npm package the tests install, pinned: (version on Node.js >= 22, version on an older node).
# The current majors of `openai`, the AI SDK and @langchain/openai need Node.js 22 ("engines"); on
# an older node (Debian 12's 18, or 20) the last release that supports it. @ai-sdk/* majors go
# with `ai`'s: ai 7 / provider 4, ai 6 / provider 3. zod is the AI SDK's and LangChain's peer
# dependency, installed by users alongside. They are installed all together, once, by
# node_packages(): `npm install --no-save` removes what it was not named, so a file that
# installed only its own would pull another's from under a client running meanwhile.
NPM_PINS = {
    "openai":            ("7.59.0",  "6.49.0"),
    "ai":                ("7.0.173", "6.0.326"),
    "@ai-sdk/openai":    ("4.0.118", "3.0.141"),
    "@ai-sdk/anthropic": ("4.0.105", "3.0.140"),
    "@langchain/openai": ("1.6.0",   "1.5.8"),     # 1.5.9 and later need Node.js 22 (and openai 7)
    "@langchain/core":   ("1.4.0",   "1.4.0"),     # node >= 20
    "@anthropic-ai/sdk": ("1.15.0",  "1.15.0"),    # no engines field
    "zod":               ("4.6.7",   "4.6.7"),
}
# The coding agents (integration_agents.py), in tests/agents/node_modules: a prefix of their own,
# so that neither install removes the other's packages.
AGENT_PINS = {
    "@anthropic-ai/claude-code": ("2.1.197", "2.1.197"),   # a native binary; its postinstall links it
    "@openai/codex":             ("0.171.0", "0.171.0"),   # bin/codex.js (node >= 16) and a native binary
}
NPM_INSTALL_TIMEOUT = 300
_node_ready = {}   # node_packages()'s outcome per prefix, once per process: {"node": path} or {"skip": why}


def npm_installed(name, prefix=HERE):
    """The version of PREFIX/node_modules/NAME, or None."""
    try:
        with open(os.path.join(prefix, "node_modules", *name.split("/"), "package.json")) as f:
            return json.load(f).get("version")
    except (OSError, ValueError):
        return None


def node_packages(pins=None, prefix=HERE):
    """The node binary, with every package of `pins` (NPM_PINS) in PREFIX/node_modules (one npm
    install of them all when one is missing or differs, under install_lock); TestSkip when that
    cannot be."""
    if prefix not in _node_ready:
        with install_lock():     # one npm install at a time (--jobs)
            _node_ready[prefix] = _node_install(pins or NPM_PINS, prefix)
    if "skip" in _node_ready[prefix]:
        raise TestSkip(_node_ready[prefix]["skip"])
    return _node_ready[prefix]["node"]


def _node_install(pins, prefix):
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node:
        return {"skip": "no node"}
    p = subprocess.run([node, "-p", "process.versions.node"], stdout=subprocess.PIPE, timeout=30)
    new = int((p.stdout.decode().strip() or "0").split(".")[0]) >= 22
    specs = ["%s@%s" % (name, v[0] if new else v[1]) for name, v in sorted(pins.items())]
    off = [s for s in specs if npm_installed(s.rsplit("@", 1)[0], prefix) != s.rsplit("@", 1)[1]]
    if not off:
        return {"node": node}
    if not npm:
        return {"skip": "no npm, and %s/node_modules lacks %s" % (os.path.relpath(prefix), " ".join(off))}
    os.makedirs(prefix, exist_ok=True)
    try:
        p = subprocess.run([npm, "install", "--prefix", prefix, "--no-save", "--no-audit", "--no-fund"] + specs,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=NPM_INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"skip": "npm install %s took more than %d s" % (" ".join(specs), NPM_INSTALL_TIMEOUT)}
    off = [s for s in specs if npm_installed(s.rsplit("@", 1)[0], prefix) != s.rsplit("@", 1)[1]]
    if p.returncode != 0 or off:
        return {"skip": "npm install %s failed (exit %d; still missing: %s): %s"
                        % (" ".join(specs), p.returncode, " ".join(off) or "-",
                           p.stdout.decode(errors="replace").strip()[-400:])}
    return {"node": node}


@test("sdk")
def t_sdk():
    node = node_packages()
    p = subprocess.run([node, os.path.join(HERE, "sdk_test.mjs"),
                        "http://127.0.0.1:%d/v1" % H.port, H.token],
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=120)
    out = p.stdout.decode(errors="replace").strip()
    check(p.returncode == 0, "sdk_test.mjs exited %d: %s" % (p.returncode, out[-600:]))


# ===== runner =====================================================================================

def test_files():
    """The files of the suite, by module name: this one ("integration") and each integration_*.py."""
    import glob
    return ["integration"] + sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(HERE, "integration_*.py")))


def main(only=None):
    """Run every test (integration.py and each tests/integration_*.py), or only those of the
    module `only` (a file run on its own: `python3 tests/integration_ledger.py --ltg ... --mock ...`).
    Every file at once, --jobs of them running at a time, each in a process of its own (run_jobs);
    --jobs 1: one after the other in this process, on one harness."""
    global H, VERBOSE, WRAP, SLOW
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ltg", required=True)
    ap.add_argument("--mock", required=True)
    ap.add_argument("-k", action="append", default=[], help="run only tests whose name contains this")
    ap.add_argument("-v", action="store_true", help="show ltg's log tail on failures")
    ap.add_argument("--wrap", default="", help="a command put before every ltg started, e.g. \"valgrind -q\"")
    ap.add_argument("--slow", type=float, help="the factor for start-up and shutdown waits (5 with --wrap)")
    ap.add_argument("--jobs", "-j", type=int,
                    help="how many files run at a time, each in its own process with its own mock, ports and "
                         "directories (default %d, %d with --wrap; 1: all in this process, one after the other)"
                         % (JOBS, JOBS_WRAP))
    ap.add_argument("--file", help="only the tests of this file: integration (integration.py's own) or "
                                   "integration_NAME (or NAME)")
    ap.add_argument("--shard", help="I/N: only the I-th of N slices of the tests of --file (how --jobs splits a long file)")
    args = ap.parse_args()
    VERBOSE = args.v
    WRAP = shlex.split(args.wrap)
    SLOW = args.slow or (5.0 if WRAP else 1.0)
    for what, path in (("ltg", args.ltg), ("mock", args.mock)):
        if not os.access(path, os.X_OK):
            print("FAIL - setup: %s binary %s is missing or not executable" % (what, path))
            print("0 passed, 1 failed")
            return 1
    shard = (1, 1)
    if args.shard:
        m = re.match(r"^(\d+)/(\d+)$", args.shard)
        if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
            ap.error("--shard wants I/N with 1 <= I <= N: %r" % args.shard)
        shard = (int(m.group(1)), int(m.group(2)))

    # More tests live in tests/integration_*.py (retries and fallback, the ledger...): they
    # `import integration` (this file, the harness) and register themselves with @test. Run on
    # its own, a file calls main(only=its module) and only its tests run.
    import importlib
    if args.file:
        f = os.path.basename(args.file)
        f = f[:-3] if f.endswith(".py") else f
        if f != "integration" and not f.startswith("integration_"):
            f = "integration_" + f
        if f not in test_files():
            ap.error("--file: no tests/%s.py (the files: %s)" % (f, " ".join(test_files())))
        if f == "integration":
            only = __name__     # this file's own tests ("__main__" when it is the script)
        else:
            importlib.import_module(f)
            only = f
    if only is None:
        jobs = args.jobs or (JOBS_WRAP if WRAP else JOBS)
        if jobs > 1:
            return run_jobs(args, jobs)
        for f in test_files()[1:]:
            importlib.import_module(f)

    passed = failed = skipped = 0
    prev_crashed = False     # the last test failed with ltg dead
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
        selected = [t for t in TESTS if (not args.k or any(k.lower() in t[0].lower() for k in args.k))
                    and (only is None or t[1].test_module == only)]
        i, n = shard
        for name, fn, ltg_args, fresh, needs in selected[len(selected) * (i - 1) // n:len(selected) * i // n]:
            try:
                if needs:
                    needs()
                sets = H.data_sets
                try:
                    if fresh:
                        H.start_ltg(ltg_args)
                    else:
                        H.ensure_ltg(ltg_args)
                except RuntimeError as e:
                    if H.data_sets == sets:
                        raise
                    # ltg could not start on the --data of the tests before; the test itself runs
                    # on an empty one. Counted as a failure of its own unless the test before
                    # already failed with ltg dead (the same bug, most likely).
                    msg = "ltg start-up before \"%s\": %s" % (name, str(e).replace("\n", " "))
                    if prev_crashed:
                        print("   # (after the crash above) " + msg[:300], file=sys.stderr, flush=True)
                    else:
                        print("FAIL - " + msg, flush=True)
                        failed += 1
                    H.start_ltg(ltg_args)
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
                prev_crashed = False
            except TestSkip as e:
                print("skip - %s: %s" % (name, e), flush=True)
                skipped += 1
                prev_crashed = False
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
                prev_crashed = crashed
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
            others = [a for a in Aux.every if not a.log.closed]    # not closed by a test: integration_*.py's
            for a in others:
                try:
                    a.stop()
                except TestFailure as e:
                    problems.append(str(e))
                san = a.report_since(0)
                if san:
                    problems.append("sanitizer report in the log of ltg (%s): %s" % (a.tag, san))
            if problems:
                print("FAIL - clean exits: %s" % "; ".join(problems), flush=True)
                failed += 1
            else:
                print("ok - clean exits (SIGTERM -> exit 0, no sanitizer report; and %d other ltgs)" % len(others), flush=True)
                passed += 1
    except KeyboardInterrupt:
        print("FAIL - interrupted")
        failed += 1
    finally:
        for a in Aux.every:     # those still running (-k, an interrupt, a test that failed)
            a.kill()
        H.shutdown()
        if failed == 0:
            shutil.rmtree(H.tmp, ignore_errors=True)
        else:
            print("# logs kept in %s" % H.tmp, file=sys.stderr)
    print("%d passed, %d failed" % (passed, failed) + (", %d skipped" % skipped if skipped else ""))
    return 1 if failed else 0


# ===== --jobs: every file at once ==================================================================

JOBS = 6            # files running at a time: mostly they wait (timeouts, sleeps), so more than the cores
JOBS_WRAP = 2       # with --wrap (valgrind): each ltg takes a core

# How many slices (--shard) a long file is run in, so that it does not end long after the others.
SHARDS = {"integration": 3, "integration_retries": 3}

# Roughly how long each file takes (s, release build, this 2-core machine): only to start the
# longest first, so that the run ends soon after the longest one. Wrong or missing values only
# cost balance.
EXPECTED_S = {"integration_retries": 165, "integration_bounds": 92, "integration": 87, "integration_hostile_clients": 53,
              "integration_ledger": 24, "integration_tls": 22, "integration_proxies": 20, "integration_deployments": 18}


def run_jobs(args, jobs):
    """Run each file (each slice of a sharded one) as `integration.py --file F [--shard I/N]`, `jobs`
    at a time, longest first; print each one's lines whole once it ends, headed by its file and
    summary; the last line sums them all. A run that prints no summary, or exits non-zero, fails."""
    here = os.path.join(HERE, "integration.py")
    common = ["--ltg", args.ltg, "--mock", args.mock] + [a for k in args.k for a in ("-k", k)]
    common += (["-v"] if args.v else []) + (["--wrap", args.wrap] if args.wrap else [])
    common += ["--slow", str(args.slow)] if args.slow else []
    units = []      # (label, argv, expected seconds)
    for f in test_files():
        n = SHARDS.get(f, 1)
        for i in range(1, n + 1):
            label = f + ".py" + (" %d/%d" % (i, n) if n > 1 else "")
            argv = [sys.executable, here, "--file", f] + (["--shard", "%d/%d" % (i, n)] if n > 1 else []) + common
            units.append((label, argv, EXPECTED_S.get(f, os.path.getsize(os.path.join(HERE, f + ".py")) / 500) / n))
    units.sort(key=lambda u: -u[2])
    out_dir = tempfile.mkdtemp(prefix="ltg-it-jobs-")
    summary = re.compile(r"^(\d+) passed, (\d+) failed(?:, (\d+) skipped)?$")
    passed = failed = skipped = 0
    running = []    # (proc, label, output file, start time)
    pending = list(units)
    limit = 1800 * SLOW     # a file that runs longer than this is stuck: stopped, and failed

    def on_signal(signum, frame):
        raise KeyboardInterrupt()
    signal.signal(signal.SIGTERM, on_signal)

    def report(label, path, rc, seconds, note=""):
        nonlocal passed, failed, skipped
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
        last = None
        for j, line in enumerate(lines):
            if summary.match(line):
                last = j
        body = [l for j, l in enumerate(lines) if j != last]
        if last is None:
            body.append("FAIL - %s: ended without a summary line%s, exit status %s" % (label, note, rc))
            failed += 1
            head = "no summary"
        else:
            m = summary.match(lines[last])
            p, f, k = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
            passed, failed, skipped = passed + p, failed + f, skipped + k
            head = lines[last]
            if rc != 0 and f == 0:
                body.append("FAIL - %s: exited with status %s after \"%s\"" % (label, rc, lines[last]))
                failed += 1
        if body or head != "0 passed, 0 failed":    # (-k: the files none of whose tests match say nothing)
            print("--- %s: %s (%.0f s)" % (label, head, seconds))
            for l in body:
                print(l)
            sys.stdout.flush()

    try:
        while pending or running:
            while pending and len(running) < jobs:
                label, argv, _ = pending.pop(0)
                path = os.path.join(out_dir, label.replace(" ", "-").replace("/", "of") + ".out")
                with open(path, "wb") as outf:
                    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=outf, stderr=subprocess.STDOUT)
                running.append((proc, label, path, time.monotonic()))
            time.sleep(0.2)
            for r in list(running):
                proc, label, path, t0 = r
                note = ""
                if proc.poll() is None:
                    if time.monotonic() - t0 < limit:
                        continue
                    note = " (still running after %.0f s: stopped)" % limit
                    _stop_child(proc)
                running.remove(r)
                report(label, path, proc.returncode, time.monotonic() - t0, note)
    except KeyboardInterrupt:
        for proc, label, path, t0 in running:
            _stop_child(proc)
            report(label, path, proc.returncode, time.monotonic() - t0, " (interrupted)")
        print("FAIL - interrupted (%s not run)" % (", ".join(u[0] for u in pending) or "all files started"))
        failed += 1
    shutil.rmtree(out_dir, ignore_errors=True)
    print("%d passed, %d failed" % (passed, failed) + (", %d skipped" % skipped if skipped else ""))
    return 1 if failed else 0


def _stop_child(proc):
    """SIGTERM (the run stops what it started and prints its summary), then SIGKILL after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.modules["integration"] = sys.modules["__main__"]   # the files it loads `import integration`: this one, not a copy
    sys.exit(main())
