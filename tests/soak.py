#!/usr/bin/env python3
"""Soak test for ltg: a bounded run of mixed load with failure injection, then RSS and fds checked.

    python3 tests/soak.py --ltg ./ltg --mock tests/mock [--seconds 180] [--clients 16]

It starts the mock provider and ltg on free loopback ports with a temporary --data and a catalog like
the integration harness's (a mock provider, a "down" provider whose port refuses connections, a few
models with fallbacks), provisions token groups and keys through the control plane, and runs
--clients concurrent clients for --seconds. Each request is of one kind (KINDS below): plain and
streamed chats, embeddings, cached calls, idempotent calls and their replays, a fallback past the
down provider, failures injected through the mock's directives (503, 429, reset, close, a stream cut,
a hang cut by x-ltg-deadline, a slow head), clients that leave mid-stream or before the answer,
control-plane reads and updates, spend and usage reads, and a SIGHUP every 20 s. Every answer is
checked against the statuses its kind allows.

ltg's VmRSS and its open fds are sampled every 5 s. The reference is the first sample after the
warm-up (the first 20 % of the run). When the load stops, the clients close their connections and
the run waits (at most 45 s) for ltg's idle pooled upstream connections to expire (30 s), then takes
the last sample. The fds are classified (files, pipes, listeners, client connections, upstream
connections...; FIXED_FDS): "same fd count" means that the fds that are not connections are the same
at the end as after the warm-up, class by class, and that at the end no connection is left, so the
total equals the count ltg had idle before the load. RSS may grow by what ltg legitimately keeps:
the ledger index (64 bytes per spend event; its big arrays grow by mremap, so that is exact), the
control plane's idempotency records (2 KiB allowed per change, at most one a second), plus a fixed
4 MiB of allocator slack: over a few hundred thousand requests, a leak of a few bytes per request.

The failures go to a model of their own ("Flaky") that mostly answers: its circuit breaker opens
after 5 failures in a row, and a model that failed every time would be skipped (503 circuit_open,
accepted for a Flaky call) rather than called. "Down-Model" (connection refused, a fallback to a
healthy model) keeps its breaker busy instead.

The checks, each one line: ltg alive at the end, no unexpected status, fds stable, RSS stable within
the bound, exit 0 on SIGTERM. The last line is "N passed, M failed". Standard library only.
"""

import argparse
import datetime
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

API = "/v2/llm_token_gateway"
ADMIN_KEY = "soak-admin-" + os.urandom(12).hex()
PROVIDER_KEY = "soak-provider-key"
SAMPLE_EVERY = 5.0          # seconds between RSS/fd samples
POOL_SETTLE = 45.0          # the longest wait for idle pooled connections to expire (POOL_IDLE_MS 30 s)
PATCH_EVERY = 1.0           # at most one control-plane change per second, all clients together
IDEM_KEYS = 4               # Idempotency-Keys per client (a bounded pool: replays, not growth)
CACHED_BODIES = 8           # distinct bodies of the cached kind


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Failure(Exception):
    pass


# ===== the processes ================================================================================

class Setup:
    def __init__(self, ltg, mock):
        self.tmp = tempfile.mkdtemp(prefix="ltg-soak-")
        self.mock_port, self.port, self.admin_port = free_ports(3)
        self.dead = socket.socket()                 # bound, never listening: connections are refused
        self.dead.bind(("127.0.0.1", 0))
        self.dead_port = self.dead.getsockname()[1]
        self.env = dict(os.environ, MOCK_KEY=PROVIDER_KEY, LTG_ADMIN_KEY=ADMIN_KEY)
        mock_url = "http://127.0.0.1:%d/v1" % self.mock_port

        def model(provider, upstream, inp, out):
            return {"provider": provider, "upstream_model": upstream,
                    "input_usd_per_mtok": inp, "output_usd_per_mtok": out}
        self.config = {
            "providers": {
                "mock": {"base_url": mock_url, "api_key_env": "MOCK_KEY"},
                "down": {"base_url": "http://127.0.0.1:%d/v1" % self.dead_port, "api_key_env": "MOCK_KEY"},
            },
            "models": {
                "Kimi-K3": model("mock", "kimi-k3", 0.60, 2.50),
                "GLM-5.3-Flash": model("mock", "glm-5.3-flash", 0.10, 0.40),
                "Flaky": model("mock", "flaky", 0.20, 0.80),
                "Down-Model": model("down", "down-model", 0.10, 0.40),
            },
            "admin_keys": [{"key_env": "LTG_ADMIN_KEY", "permissions": ["*"]}],
        }
        self.config_path = os.path.join(self.tmp, "catalog.json")
        with open(self.config_path, "w") as f:
            json.dump(self.config, f, indent=2)
        self.data = os.path.join(self.tmp, "data")
        self.mock_log = open(os.path.join(self.tmp, "mock.log"), "ab")
        self.ltg_log_path = os.path.join(self.tmp, "ltg.log")
        self.ltg_log = open(self.ltg_log_path, "ab")
        self.mock = subprocess.Popen([mock, "--port", str(self.mock_port)], stdin=subprocess.DEVNULL,
                                     stdout=self.mock_log, stderr=self.mock_log, env=self.env)
        self.ltg = subprocess.Popen([ltg, "--config", self.config_path, "--data", self.data,
                                     "--listen", "127.0.0.1:%d" % self.port,
                                     "--admin-listen", "127.0.0.1:%d" % self.admin_port],
                                    stdin=subprocess.DEVNULL, stdout=self.ltg_log, stderr=self.ltg_log, env=self.env)
        for p in (self.mock_port, self.port, self.admin_port):
            self.wait_port(p)

    def wait_port(self, port):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for proc in (self.mock, self.ltg):
                if proc.poll() is not None:
                    raise Failure("%s exited with %s at start-up; logs in %s" % (proc.args[0], proc.returncode, self.tmp))
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise Failure("port %d not listening within 10 s; logs in %s" % (port, self.tmp))

    def admin(self, method, path, body=None, headers=None):
        c = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=30)
        try:
            h = {"Authorization": "Bearer " + ADMIN_KEY}
            if method != "GET":
                h["Idempotency-Key"] = "soak-" + os.urandom(8).hex()
            h.update(headers or {})
            c.request(method, API + path, body=None if body is None else json.dumps(body), headers=h)
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def provision(self):
        """Groups: "main" (fallbacks, 2 attempts, no cache), "cached" (cache_ttl 60) and "spare" (the
        control-plane updates); a token key for the first two."""
        def group(body):
            st, b = self.admin("POST", "/token_groups", body)
            if st != 201:
                raise Failure("POST /token_groups -> %d %r" % (st, b[:300]))
            return json.loads(b)["data"]["id"]

        def key(gid):
            st, b = self.admin("POST", "/token_keys", {"name": "soak", "token_group_id": gid})
            if st != 201:
                raise Failure("POST /token_keys -> %d %r" % (st, b[:300]))
            return json.loads(b)["data"]["token"]
        models = list(self.config["models"])
        retries = {"max_attempts": 2, "retry_delay_ms": 10, "backoff": "constant"}
        self.main_group = group({"name": "soak-main", "allowed_models": models, "retries": retries,
                                 "fallbacks": {"Kimi-K3": ["GLM-5.3-Flash"], "Down-Model": ["GLM-5.3-Flash"]}})
        self.cache_group = group({"name": "soak-cached", "allowed_models": models, "cache_ttl": 60})
        self.spare_group = group({"name": "soak-spare", "allowed_models": models})
        self.main_key = key(self.main_group)
        self.cache_key = key(self.cache_group)

    def close(self, keep):
        for p in (self.ltg, self.mock):
            if p.poll() is None:
                p.kill()
                p.wait()
        self.dead.close()
        self.mock_log.close()
        self.ltg_log.close()
        if keep:
            print("# logs kept in %s" % self.tmp)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


# ===== what ltg holds: RSS and fds ===================================================================

def net_sockets():
    """inode -> (protocol, local port, remote port, TCP state) for every socket of the system."""
    out = {}
    for proto in ("tcp", "tcp6", "udp", "udp6", "unix"):
        try:
            with open("/proc/net/" + proto) as f:
                next(f)
                for line in f:
                    c = line.split()
                    if proto == "unix":
                        out[c[6]] = ("unix", 0, 0, "")
                    else:
                        out[c[9]] = (proto[:3], int(c[1].rsplit(":", 1)[1], 16), int(c[2].rsplit(":", 1)[1], 16), c[3])
        except OSError:
            pass
    return out


# The classes of fds that are not connections: the same after the warm-up and at the end.
FIXED_FDS = ("file", "pipe", "anon", "listen", "udp", "unix", "tcp-other", "socket")


def sample(s):
    """ltg's VmRSS (KiB) and its fds by class: FIXED_FDS ("socket": one in no table of /proc/net, such as
    an unbound UDP socket), "client" and "upstream" connections, and "gone" (a socket closed between
    the listing of the fds and the reading of /proc/net)."""
    pid = s.ltg.pid
    with open("/proc/%d/status" % pid) as f:
        rss = int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1))
    fd_dir = "/proc/%d/fd" % pid
    targets = []
    for fd in os.listdir(fd_dir):
        try:
            targets.append((fd, os.readlink(os.path.join(fd_dir, fd))))
        except OSError:
            pass                                # closed meanwhile
    net = net_sockets()                         # after the listing: every socket listed existed before
    kinds = dict.fromkeys(FIXED_FDS + ("client", "upstream", "gone"), 0)
    for fd, target in targets:
        m = re.match(r"socket:\[(\d+)\]$", target)
        if not m:
            kinds["file" if target.startswith("/") else "pipe" if target.startswith("pipe:") else "anon"] += 1
            continue
        t = net.get(m.group(1))
        if t is None:
            try:
                still = os.readlink(os.path.join(fd_dir, fd)) == target
            except OSError:
                still = False
            kinds["socket" if still else "gone"] += 1
        elif t[0] != "tcp":
            kinds[t[0]] += 1
        elif t[3] == "0A":
            kinds["listen"] += 1
        elif t[1] in (s.port, s.admin_port):
            kinds["client"] += 1
        elif t[2] in (s.mock_port, s.dead_port):
            kinds["upstream"] += 1
        else:
            kinds["tcp-other"] += 1
    kinds["total"] = len(targets)
    return rss, kinds


def spend_events(s):
    """The number of spend events in the ledger (the usage summary's request count, all groups)."""
    today = datetime.datetime.now(datetime.timezone.utc).date()
    q = "/usage/summary?start_date=%s&end_date=%s" % (today - datetime.timedelta(days=1), today + datetime.timedelta(days=2))
    st, b = s.admin("GET", q)
    if st != 200:
        raise Failure("GET %s -> %d %r" % (q, st, b[:200]))
    return json.loads(b)["data"]["totals"]["requests"]


# ===== the load =====================================================================================

def chat(model="Kimi-K3", mock=None, stream=False, content=None):
    """A chat body; `mock` is the mock provider's directive (see the top of tests/mock.c)."""
    b = {"model": model, "messages": [{"role": "user", "content": content or "soak %d" % random.getrandbits(32)}]}
    if stream:
        b["stream"] = True
    if mock:
        b["mock"] = mock
    return b


class Load:
    """The clients, what they did and what went wrong."""

    def __init__(self, s, clients):
        self.s = s
        self.clients = clients
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.done = {}          # kind -> requests
        self.errors = {}        # kind -> unexpected outcomes
        self.examples = []      # the first few unexpected outcomes, in words
        self.notes = {}         # counters of interest: cache hits, replays, circuit_open...
        self.admin_changes = 0
        self.next_patch = 0.0
        self.spare_version = 1
        self.kinds = [(name, w, getattr(self, "k_" + name)) for name, w in KINDS]
        self.total_w = sum(w for _, w, _ in self.kinds)

    def note(self, what, n=1):
        with self.lock:
            self.notes[what] = self.notes.get(what, 0) + n

    def record(self, kind, problem=None):
        with self.lock:
            self.done[kind] = self.done.get(kind, 0) + 1
            if problem:
                self.errors[kind] = self.errors.get(kind, 0) + 1
                if len(self.examples) < 12:
                    self.examples.append("%s: %s" % (kind, problem))

    # --- one client ---

    def client(self, i):
        rnd = random.Random(i)
        st = {"conn": None, "idem": {}, "i": i}
        while not self.stop.is_set():
            x = rnd.uniform(0, self.total_w)
            for name, w, fn in self.kinds:
                x -= w
                if x <= 0:
                    break
            try:
                problem = fn(st, rnd)
            except (OSError, http.client.HTTPException, ValueError) as e:
                problem = "%s: %s" % (type(e).__name__, e)
                if st["conn"]:
                    st["conn"].close()
                st["conn"] = None
            self.record(name, problem)
        if st["conn"]:
            st["conn"].close()

    def request(self, st, method, path, body=None, key=None, headers=None, port=None):
        """One request on the client's keep-alive connection: (status, headers, body)."""
        if port is not None:            # the control plane: a connection of its own each time
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        else:
            if st["conn"] is None:
                st["conn"] = http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=30)
            c = st["conn"]
        h = {"Authorization": "Bearer " + (key or self.s.main_key)}
        if body is not None:
            h["Content-Type"] = "application/json"
        h.update(headers or {})
        try:
            c.request(method, path, body=None if body is None else json.dumps(body), headers=h)
            r = c.getresponse()
            data = r.read()
            if r.getheader("Connection", "").lower() == "close" and port is None:
                c.close()
                st["conn"] = None
            return r.status, r, data
        finally:
            if port is not None:
                c.close()

    def expect(self, st, body, statuses, key=None, headers=None, path="/v1/chat/completions", flaky=False):
        """Send; None when the status is one of `statuses` (or, for a Flaky call, 503 circuit_open)."""
        status, r, data = self.request(st, "POST", path, body, key, headers)
        if status in statuses:
            return None, r, data
        if flaky and status == 503 and b'"circuit_open"' in data:
            self.note("circuit_open")
            return None, r, data
        return "status %d (expected %s): %r" % (status, sorted(statuses), data[:200]), r, data

    # --- the kinds: each returns None or what went wrong ---

    def k_chat(self, st, rnd):
        return self.expect(st, chat(), {200})[0]

    def k_flaky_chat(self, st, rnd):
        return self.expect(st, chat(model="Flaky"), {200}, flaky=True)[0]

    def k_flaky_stream(self, st, rnd):
        p, r, data = self.expect(st, chat(model="Flaky", stream=True), {200}, flaky=True)
        if p is None and r.status == 200 and b"data: [DONE]" not in data:
            p = "stream without [DONE]: %r" % data[-200:]
        return p

    def k_stream(self, st, rnd):
        p, r, data = self.expect(st, chat(stream=True, mock="events=%d" % rnd.randint(1, 8)), {200})
        if p is None and b"data: [DONE]" not in data:
            p = "stream without [DONE]: %r" % data[-200:]
        return p

    def k_embed(self, st, rnd):
        return self.expect(st, {"model": "GLM-5.3-Flash", "input": ["soak", "load %d" % rnd.getrandbits(16)]},
                           {200}, path="/v1/embeddings")[0]

    def k_cached(self, st, rnd):
        body = chat(content="cached question %d" % rnd.randrange(CACHED_BODIES))
        p, r, data = self.expect(st, body, {200}, key=self.s.cache_key)
        if p is None:
            self.note("cache " + (r.getheader("x-ltg-cache") or "?"))
        return p

    def k_idem(self, st, rnd):
        n = rnd.randrange(IDEM_KEYS)
        key = "soak-%d-%d" % (st["i"], n)
        body = chat(content="idempotent %d %d" % (st["i"], n), model="GLM-5.3-Flash")
        p, r, data = self.expect(st, body, {200}, headers={"Idempotency-Key": key})
        if p is None:
            replayed = r.getheader("x-ltg-replayed") == "true"
            self.note("idempotent replays" if replayed else "idempotent first calls")
            if replayed != (key in st["idem"]):
                p = "x-ltg-replayed %r on call %d of key %s" % (r.getheader("x-ltg-replayed"), st["idem"].get(key, 0) + 1, key)
            st["idem"][key] = st["idem"].get(key, 0) + 1
        return p

    def k_idem_conflict(self, st, rnd):
        used = sorted(st["idem"])
        if not used:
            return self.k_idem(st, rnd)
        body = chat(content="another body", model="GLM-5.3-Flash")
        p, r, data = self.expect(st, body, {409}, headers={"Idempotency-Key": rnd.choice(used)})
        if p is None and b"idempotency_conflict" not in data:
            p = "409 without idempotency_conflict: %r" % data[:200]
        return p

    def k_down_fallback(self, st, rnd):
        p, r, data = self.expect(st, chat(model="Down-Model"), {200})
        if p is None and r.getheader("x-ltg-served-model") != "GLM-5.3-Flash":
            p = "served by %r, not the fallback" % r.getheader("x-ltg-served-model")
        return p

    def k_fail_503(self, st, rnd):
        return self.expect(st, chat(model="Flaky", mock="status=503"), {503}, flaky=True)[0]

    def k_fail_429(self, st, rnd):
        return self.expect(st, chat(model="Flaky", mock="status=429"), {429}, flaky=True)[0]

    def k_fail_reset(self, st, rnd):
        return self.expect(st, chat(model="Flaky", mock="reset"), {502}, flaky=True)[0]

    def k_fail_close(self, st, rnd):
        return self.expect(st, chat(model="Flaky", mock="close"), {200}, flaky=True)[0]

    def k_fail_cut(self, st, rnd):
        p, r, data = self.expect(st, chat(model="Flaky", stream=True, mock="events=6 cut_after=%d" % rnd.randint(1, 4)),
                                 {200}, flaky=True)
        if p is None and r.status == 200 and (b"stream_interrupted" not in data or b"[DONE]" in data):
            p = "a cut stream should end with stream_interrupted and no [DONE]: %r" % data[-200:]
        return p

    def k_fail_hang(self, st, rnd):
        p, r, data = self.expect(st, chat(model="Flaky", mock="hang"), {504}, headers={"x-ltg-deadline": "300"}, flaky=True)
        return p

    def k_slow_head(self, st, rnd):
        return self.expect(st, chat(model="Flaky", mock="head_delay_ms=%d" % rnd.randint(20, 120)), {200}, flaky=True)[0]

    def raw(self, body, key=None):
        b = json.dumps(body).encode()
        head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
                "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (key or self.s.main_key, len(b)))
        c = socket.create_connection(("127.0.0.1", self.s.port), timeout=30)
        c.sendall(head.encode() + b)
        return c

    def k_leave_stream(self, st, rnd):
        """A client that leaves after the first event of a long stream."""
        c = self.raw(chat(stream=True, mock="events=40 event_delay_ms=25"))
        try:
            got = b""
            while b"data:" not in got and len(got) < 65536:
                d = c.recv(4096)
                if not d:
                    return "closed before the first event: %r" % got[:200]
                got += d
            if not got.startswith(b"HTTP/1.1 200"):
                return "expected a 200 stream: %r" % got[:200]
            return None
        finally:
            c.close()

    def k_leave_early(self, st, rnd):
        """A client that leaves before the answer starts (ltg's event: 499)."""
        c = self.raw(chat(mock="head_delay_ms=300"))
        time.sleep(rnd.uniform(0.02, 0.1))
        c.close()
        return None

    def k_admin_read(self, st, rnd):
        port = self.s.admin_port
        h = {"Authorization": "Bearer " + ADMIN_KEY}
        path = rnd.choice(["/token_groups", "/token_groups/" + self.s.main_group, "/token_keys?token_group_id=" + self.s.main_group,
                           "/token_groups?page[number]=1&page[size]=2"])
        status, r, data = self.request(st, "GET", API + path, headers=h, port=port)
        return None if status == 200 else "GET %s -> %d %r" % (path, status, data[:200])

    def k_admin_patch(self, st, rnd):
        """A change of the spare group, at most one a second (each keeps an idempotency record 24 h)."""
        with self.lock:
            now = time.monotonic()
            if now < self.next_patch:
                go = False
            else:
                go, self.next_patch = True, now + PATCH_EVERY
        if not go:
            return self.k_admin_read(st, rnd)
        h = {"Authorization": "Bearer " + ADMIN_KEY, "If-Match": "*", "Idempotency-Key": "soak-" + os.urandom(8).hex()}
        body = {"name": "soak-spare-%d" % rnd.randrange(1000), "max_parallel_requests": rnd.choice([None, 5, 50])}
        status, r, data = self.request(st, "PATCH", API + "/token_groups/" + self.s.spare_group, body, headers=h,
                                       port=self.s.admin_port)
        if status != 200:
            return "PATCH -> %d %r" % (status, data[:200])
        with self.lock:
            self.admin_changes += 1
        return None

    def k_spend_read(self, st, rnd):
        today = datetime.datetime.now(datetime.timezone.utc).date()
        rng = "start_date=%s&end_date=%s" % (today, today + datetime.timedelta(days=1))
        path = rnd.choice(["/spend/events?%s&page[size]=50" % rng,
                           "/spend/events?%s&token_group_id=%s&page[size]=20&page[number]=2" % (rng, self.s.main_group),
                           "/usage/summary?%s&token_group_id=%s" % (rng, self.s.main_group)])
        status, r, data = self.request(st, "GET", API + path, headers={"Authorization": "Bearer " + ADMIN_KEY},
                                       port=self.s.admin_port)
        return None if status == 200 else "GET %s -> %d %r" % (path, status, data[:200])


# The kinds of request and their weights (out of the sum). Flaky's failures (fail_503, fail_429,
# fail_reset, fail_hang) are about 6 % of its calls, so that its breaker rarely opens.
KINDS = [
    ("chat", 10), ("stream", 8), ("embed", 6), ("cached", 6), ("idem", 5), ("idem_conflict", 1),
    ("down_fallback", 3), ("flaky_chat", 20), ("flaky_stream", 8), ("fail_close", 1), ("fail_cut", 1.5),
    ("slow_head", 1), ("fail_503", 0.6), ("fail_429", 0.6), ("fail_reset", 0.4), ("fail_hang", 0.4),
    ("leave_stream", 2), ("leave_early", 1.5), ("admin_read", 2), ("admin_patch", 1), ("spend_read", 1.5),
]


# ===== the run ======================================================================================

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ltg", required=True)
    ap.add_argument("--mock", required=True)
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--clients", type=int, default=16)
    args = ap.parse_args()
    checks = []                 # (ok, line)

    def check(ok, line):
        checks.append(ok)
        print("%s - %s" % ("ok" if ok else "FAIL", line), flush=True)

    try:
        s = Setup(os.path.abspath(args.ltg), os.path.abspath(args.mock))
    except Failure as e:
        print("FAIL - setup: %s" % e)
        print("0 passed, 1 failed")
        return 1
    ok_all = False
    try:
        s.provision()
        rss0, fds0 = sample(s)
        print("# idle before the load: RSS %d KiB, fds %s" % (rss0, fds0), flush=True)
        load = Load(s, args.clients)
        threads = [threading.Thread(target=load.client, args=(i,), daemon=True) for i in range(args.clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        warm_at = t0 + args.seconds * 0.2
        end_at = t0 + args.seconds
        warm = None             # (rss, fds, events, admin changes, requests) after the warm-up
        samples = []            # (t, rss, events) from the warm-up on
        next_sample = t0
        next_hup = t0 + 20
        hups = 0
        while True:
            now = time.monotonic()
            if now >= end_at or s.ltg.poll() is not None:
                break
            if now >= next_hup:
                s.ltg.send_signal(signal.SIGHUP)
                hups += 1
                next_hup += 20
            if now >= next_sample or (warm is None and now >= warm_at):
                try:
                    rss, fds = sample(s)
                    ev = spend_events(s)
                except (OSError, Failure) as e:      # ltg died meanwhile: the checks below say so
                    print("# sampling failed: %s" % e)
                    break
                with load.lock:
                    req = sum(load.done.values())
                print("# t=%4.0fs RSS %6d KiB  fds %3d (clients %2d, upstream %2d)  events %7d  requests %7d"
                      % (now - t0, rss, fds["total"], fds["client"], fds["upstream"], ev, req), flush=True)
                if now >= warm_at:
                    if warm is None:
                        warm = (rss, fds, ev, load.admin_changes, req)
                    samples.append((now - t0, rss, ev))
                while next_sample <= now:
                    next_sample += SAMPLE_EVERY
            time.sleep(min(0.2, max(0.0, min(next_sample, next_hup, end_at) - time.monotonic())))
        load.stop.set()
        for t in threads:
            t.join(60)
        stuck = sum(t.is_alive() for t in threads)
        elapsed = time.monotonic() - t0
        alive = s.ltg.poll() is None
        if warm is None and alive:
            print("# the run ended before the warm-up did: --seconds too short")

        # Settle: every client connection closed, the idle pooled upstream connections expired.
        settle_t = time.monotonic()
        while alive and time.monotonic() - settle_t < POOL_SETTLE:
            rss, fds = sample(s)
            if fds["client"] == 0 and fds["upstream"] == 0:
                break
            time.sleep(1)
        settled = time.monotonic() - settle_t

        # The figures.
        total = sum(load.done.values())
        print("# %d requests in %.0f s (%.0f/s) from %d clients, %d SIGHUPs; %d client(s) stuck"
              % (total, elapsed, total / elapsed, args.clients, hups, stuck))
        for name, _ in KINDS:
            print("#   %-14s %7d  unexpected %d" % (name, load.done.get(name, 0), load.errors.get(name, 0)))
        print("# notes: %s" % ", ".join("%s %d" % kv for kv in sorted(load.notes.items())))
        for e in load.examples:
            print("#   unexpected: %s" % e)
        print("# ltg's log, lines by shape:")
        with open(s.ltg_log_path, "rb") as f:
            shapes = {}
            for line in f.read().decode("utf-8", "replace").splitlines():
                shape = re.sub(r"\d+", "N", re.sub(r"^\S+Z ", "", line))
                shapes[shape] = shapes.get(shape, 0) + 1
        for shape, n in sorted(shapes.items(), key=lambda kv: -kv[1])[:10]:
            print("#   %6d  %s" % (n, shape[:150]))

        check(alive and stuck == 0, "ltg alive at the end of the load%s" %
              ("" if alive else " (exited with %s)" % s.ltg.returncode) + (", %d client(s) stuck" % stuck if stuck else ""))
        errors = sum(load.errors.values())
        check(errors == 0 and total > 0, "no unexpected status: %d unexpected in %d requests" % (errors, total))
        if alive and warm is not None:
            rss1, fds1 = sample(s)
            ev1 = spend_events(s)
            rss_w, fds_w, ev_w, adm_w, req_w = warm
            print("# after the warm-up: RSS %d KiB, fds %s, %d events" % (rss_w, fds_w, ev_w))
            print("# at the end (settled in %.0f s): RSS %d KiB, fds %s, %d events" % (settled, rss1, fds1, ev1))
            fixed_w = {k: fds_w[k] for k in FIXED_FDS if fds_w[k]}
            fixed_1 = {k: fds1[k] for k in FIXED_FDS if fds1[k]}
            check(fixed_1 == fixed_w and fds1["client"] == fds1["upstream"] == fds1["gone"] == 0
                  and fds1["total"] == fds0["total"],
                  "fds stable: %d after the warm-up (%d of them connections, open or closing), %d at the end with none left, %d idle "
                  "before the load; the others %s then, %s at the end"
                  % (fds_w["total"], fds_w["total"] - sum(fixed_w.values()), fds1["total"], fds0["total"], fixed_w, fixed_1))
            dev, dadm = ev1 - ev_w, load.admin_changes - adm_w
            grown = (rss1 - rss_w) * 1024
            allowed = 64 * dev + 2048 * dadm + (4 << 20)
            unexplained = grown - 64 * dev
            if len(samples) >= 3:
                # The trend under load: RSS against spend events over the samples after the warm-up.
                me = sum(e for _, _, e in samples) / len(samples)
                mr = sum(r for _, r, _ in samples) / len(samples)
                var = sum((e - me) ** 2 for _, _, e in samples)
                if var:
                    print("# RSS under load grew %.1f B per spend event (least squares over %d samples)"
                          % (1024 * sum((e - me) * (r - mr) for _, r, e in samples) / var, len(samples)))
            print("# RSS: +%d KiB after the warm-up over %d events (%.0f B/event) and %d control-plane changes; "
                  "%d B beyond 64 B/event (%.1f B per request)"
                  % (grown // 1024, dev, grown / dev if dev else 0, dadm, unexplained,
                     unexplained / max(1, total - req_w)))
            check(grown <= allowed, "RSS stable: %d -> %d KiB (+%d KiB), bound +%d KiB (64 B x %d events + 2 KiB x %d "
                  "changes + 4 MiB)" % (rss_w, rss1, grown // 1024, allowed // 1024, dev, dadm))
        else:
            check(False, "fds stable: no sample to compare (ltg dead or the run too short)")
            check(False, "RSS stable: no sample to compare")
        if alive:
            s.ltg.send_signal(signal.SIGTERM)
            try:
                rc = s.ltg.wait(30)
            except subprocess.TimeoutExpired:
                rc = "still running 30 s after SIGTERM"
            check(rc == 0, "ltg exits 0 on SIGTERM (got %s)" % rc)
        else:
            check(False, "ltg exits 0 on SIGTERM: it was not running")
        ok_all = all(checks)
    except Failure as e:
        check(False, str(e))
    finally:
        s.close(keep=not ok_all)
    passed = sum(1 for c in checks if c)
    print("%d passed, %d failed" % (passed, len(checks) - passed))
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
