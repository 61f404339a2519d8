"""Integration tests: ltg behind a load balancer -- --trusted-proxies LIST (ADDR or ADDR/BITS,
IPv4 or IPv6, comma-separated). A connection from a trusted address is not itself counted against
--max-conns-per-ip; the client it speaks for is, and the access log's "client" field names it:
given by a PROXY protocol header (v1 text or v2 binary, HAProxy's send-proxy / send-proxy-v2) at
the connection's start, or by X-Forwarded-For on each request (the rightmost address that is not
a trusted proxy). A client over its cap: with PROXY its extra connection is closed at once, with
X-Forwarded-For the request gets 429 too_many_connections (Retry-After: 1). From an untrusted
address a PROXY header is a 400 and X-Forwarded-For is ignored. IPv6 clients are counted per /64.

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k proxies
    python3 tests/integration_proxies.py --ltg ./ltg --mock tests/mock

Everything runs on loopback. The "clients" are sockets bound to distinct loopback source
addresses (127.0.0.2, 127.0.0.3, ...: all of 127/8 is local on Linux); a real HAProxy (mode tcp,
send-proxy-v2) and a real nginx (proxy_http_version 1.1, upstream keepalive, X-Forwarded-For
$proxy_add_x_forwarded_for) pass them on as the client address. Both come from Debian packages
(`haproxy`, `nginx`): when missing they are installed with apt-get when we are root, else the test
that needs them is skipped saying what to install -- never passed silently. Their configurations
are written to a temporary directory and they run in the foreground as children of the test,
stopped at its end.

Every test runs its own ltg (it.Aux: the harness's catalog and mock, its own ports, --data, log and
--access-log), stopped at the test's end with SIGTERM (exit 0 expected) and its log checked for a
sanitizer report. The "held" phases are seconds long (slow upstream answers: the mock's directive
head_delay_ms), every wait is bounded, and timing is only checked as ordering with wide margins.
"""

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time

import integration as it

check = it.check

HELD_MS = 6000          # how long the abusive client's requests are held by the upstream (the mock)


# ===== Debian packages: haproxy, nginx ============================================================



def stop_proc(p, timeout=10):
    """SIGTERM, then SIGKILL after `timeout` s, of a child started here."""
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)


def wait_proxy_ready(port, proc, logpath, what, source="127.0.0.9", timeout=15):
    """Until GET /healthz through the proxy on `port` answers 200 (bounded); TestFailure with the
    proxy's log when it exits or does not get there."""
    timeout *= it.SLOW
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise it.TestFailure("%s exited with %s at start-up: %s" % (what, proc.returncode, read_text(logpath)[-800:]))
        try:
            with it.Conn(port, timeout=3, source=source) as c:
                c.send(it.http_request("GET", "/healthz", auth=None, headers={"Connection": "close"}))
                r = c.read_final_response(3)
                if r.status == 200:
                    return
                last = r.brief()
        except Exception as e:
            last = "%s: %s" % (type(e).__name__, e)
        time.sleep(0.1)     # backoff: polling for the proxy
    raise it.TestFailure("%s not relaying GET /healthz within %d s (last: %s): %s" % (what, timeout, last, read_text(logpath)[-800:]))


def read_text(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"


# ===== the ltg of a test ==========================================================================

class Gateway:
    """An ltg of the test's own with --access-log and `args`, and a token key of its own."""

    n = 0

    def __init__(self, tag, args):
        Gateway.n += 1
        self.tag = "proxies-%s-%d" % (tag, Gateway.n)
        self.alog = os.path.join(it.H.tmp, "access-%s.log" % self.tag)
        self.a = it.Aux(self.tag, args=["--access-log", self.alog] + list(args))
        self.token = None

    def __enter__(self):
        try:
            self.a.start()
            self.token = it.provision(self.a, "proxies", ["Kimi-K3"]).token
        except BaseException:
            self.a.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                check(self.a.proc is not None and self.a.proc.poll() is None,
                      "ltg (%s) died during the test (code %r): %s" % (self.tag, self.a.proc and self.a.proc.returncode,
                                                                      self.a.text_since_start()[-500:]))
                self.a.stop()
        finally:
            self.a.close()        # kills it if still running; fails on a sanitizer report in its log
        return False

    @property
    def port(self):
        return self.a.port

    def chat(self, directive=None, tag="", keep_alive=True):
        """The bytes of a chat request (its content unique: never a cache hit)."""
        h = {} if keep_alive else {"Connection": "close"}
        return it.http_request("POST", "/v1/chat/completions",
                               it.chat_body(directive=directive, content="proxies %s %s" % (tag, os.urandom(6).hex())),
                               headers=h, auth=self.token)

    def lines(self):
        """The access log's JSON lines (but health probes)."""
        text = read_text(self.alog) if os.path.exists(self.alog) else ""
        out = []
        for l in text.splitlines():
            if l.strip():
                try:
                    out.append(json.loads(l))
                except ValueError:
                    raise it.TestFailure("an access log line is not JSON: %r" % l[:300])
        return [l for l in out if l.get("path") not in ("/healthz", "/readyz")]

    def wait_lines(self, pred, want, timeout=15.0):
        """The access log lines matching pred, once there are at least `want` (bounded wait)."""
        deadline = time.monotonic() + timeout * it.SLOW
        while True:
            got = [l for l in self.lines() if pred(l)]
            if len(got) >= want or time.monotonic() > deadline:
                return got
            time.sleep(0.05)    # backoff: polling the access log

    def all_lines(self):
        """Every JSON line of the access log, health probes included."""
        return [json.loads(l) for l in read_text(self.alog).splitlines() if l.strip()] if os.path.exists(self.alog) else []


def chats(lines, client=None):
    return [l for l in lines if l["path"] == "/v1/chat/completions" and (client is None or l["client"] == client)]


def summary(lines):
    return [(l["client"], l["status"]) for l in lines]


# ===== clients ====================================================================================

class Outcome:
    """What one client connection got: kind "answer" (status, body, headers) or "closed" (bytes before
    the close), or "error"; t: when (monotonic)."""

    def __init__(self, kind, t, status=None, r=None, buf=b"", err=None):
        self.kind, self.t, self.status, self.r, self.buf, self.err = kind, t, status, r, buf, err

    def __repr__(self):
        if self.kind == "answer":
            return "%d %r" % (self.status, self.r.body[:120])
        if self.kind == "closed":
            return "closed(%r)" % self.buf[:80]
        return "error(%s)" % self.err


def request_on(c, data, timeout=40.0):
    """Send `data` on Conn c, read the answer: an Outcome."""
    try:
        c.send(data)
    except OSError as e:
        return Outcome("closed", time.monotonic(), buf=b"", err=str(e))
    return read_outcome(c, timeout)


def read_outcome(c, timeout=40.0):
    try:
        r = c.read_final_response(timeout)
        return Outcome("answer", time.monotonic(), status=r.status, r=r)
    except EOFError:
        return Outcome("closed", time.monotonic(), buf=c.buf)
    except OSError as e:
        return Outcome("closed", time.monotonic(), buf=c.buf, err=str(e))
    except it.TestFailure as e:
        return Outcome("error", time.monotonic(), buf=c.buf, err=str(e))


def in_threads(fns, timeout=60.0):
    """Run each fn() in a thread of its own; their results, in order (bounded wait)."""
    out = [None] * len(fns)

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as e:
            out[i] = Outcome("error", time.monotonic(), err="%s: %s" % (type(e).__name__, e))
    ts = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in ts:
        t.start()
    deadline = time.monotonic() + timeout
    for t in ts:
        t.join(max(0.1, deadline - time.monotonic()))
    check(not any(t.is_alive() for t in ts), "client threads still running after %g s" % timeout)
    return out


def one_via(port, data, source, timeout=40.0):
    """One request on a new connection from `source`: an Outcome."""
    try:
        c = it.Conn(port, timeout=timeout, source=source)
    except OSError as e:
        return Outcome("error", time.monotonic(), err="connect from %s: %s" % (source, e))
    with c:
        return request_on(c, data, timeout)


OTHERS = ["127.0.0.%d" % i for i in range(3, 8)]      # the well-behaved clients
ABUSER = "127.0.0.2"


def inference_conns(g):
    """ltg_client_connections{listener="inference"}, from the admin listener's /metrics."""
    text = it.one_request(g.a.admin_port, "GET", "/metrics", auth=None, timeout=30).body.decode("utf-8", "replace")
    for line in text.splitlines():
        if line.startswith('ltg_client_connections{listener="inference"} '):
            return float(line.rsplit(" ", 1)[1])
    check(False, "no ltg_client_connections{listener=\"inference\"} in /metrics")


def in_flight(g):
    """Attempts in flight upstream on the gateway's ltg (ltg_deployment_in_flight, summed)."""
    return it.metric_sum(g.a.admin_port, "ltg_deployment_in_flight")


def wait_settled(g, n, answered, what):
    """Until each of the abusive client's n requests has reached the upstream (in flight there) or
    been refused (answered() counts those): ltg has dealt with every one of them."""
    got = [0, 0]

    def settled():
        got[:] = [in_flight(g), answered()]
        return got[0] + got[1] >= n
    it.wait_until(lambda: "%s: the abusive client's %d requests dealt with by ltg (in flight upstream %d, refused %d)"
                  % (what, n, got[0], got[1]), settled, 20 * it.SLOW, 0.05)


def check_others_served(others, what):
    bad = [(OTHERS[i], o) for i, o in enumerate(others) if not (o.kind == "answer" and o.status == 200)]
    check(not bad, "%s: the other clients' requests, meanwhile, were not all answered 200: %r" % (what, bad))


# ===== PROXY protocol headers =====================================================================

V2_SIG = b"\r\n\r\n\x00\r\nQUIT\n"


def proxy_v1(family, src, dst, sport=40000, dport=80):
    return ("PROXY %s %s %s %d %d\r\n" % (family, src, dst, sport, dport)).encode()


def proxy_v2(src=None, dst=None, sport=40000, dport=80, local=False, version_command=None, fam=None, tlv=b""):
    """A v2 header: PROXY (0x21) over TCP4 or TCP6 (from the addresses' family), or LOCAL (0x20)."""
    if local:
        return V2_SIG + bytes([0x20, 0x00]) + struct.pack("!H", 0)
    if ":" in src:
        payload = socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, dst)
        f = 0x21
    else:
        payload = socket.inet_pton(socket.AF_INET, src) + socket.inet_pton(socket.AF_INET, dst)
        f = 0x11
    payload += struct.pack("!HH", sport, dport) + tlv
    return V2_SIG + bytes([version_command or 0x21, fam or f]) + struct.pack("!H", len(payload)) + payload


def healthz(close=False):
    return it.http_request("GET", "/healthz", auth=None, headers={"Connection": "close"} if close else {})


def models_req(g, close=False):
    """GET /v1/models with the gateway's token: logged in the access log (health probes are filtered)."""
    return it.http_request("GET", "/v1/models", auth=g.token, headers={"Connection": "close"} if close else {})


# ===== 1. behind HAProxy: PROXY protocol v2 =======================================================

HAPROXY_CFG = """global
    maxconn 512
defaults
    mode tcp
    timeout connect 5s
    timeout client 120s
    timeout server 120s
frontend fe
    bind 127.0.0.1:%(front)d
    default_backend be
backend be
    server ltg 127.0.0.1:%(ltg)d send-proxy-v2
"""


class Balancer:
    """A balancer in front of ltg, run in the foreground while the `with` block lasts: argv, its
    output to out_log; ready once its port answers (its log, logpath, says why not)."""

    def __init__(self, name, ltg_port):
        self.bin = it.debian_tool(name, name)
        self.name = name
        self.dir = os.path.join(it.H.tmp, "%s-%d" % (name, ltg_port))
        os.makedirs(self.dir, exist_ok=True)
        self.port = it.free_port()
        self.proc = None

    def __enter__(self):
        with open(self.out_log, "ab") as logf:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf)
        try:
            wait_proxy_ready(self.port, self.proc, self.logpath, self.name)
        except BaseException:
            stop_proc(self.proc)
            raise
        return self

    def __exit__(self, *a):
        stop_proc(self.proc)
        return False


class HAProxy(Balancer):
    def __init__(self, ltg_port):
        Balancer.__init__(self, "haproxy", ltg_port)
        self.cfg = os.path.join(self.dir, "haproxy.cfg")
        with open(self.cfg, "w") as f:
            f.write(HAPROXY_CFG % {"front": self.port, "ltg": ltg_port})
        self.logpath = self.out_log = os.path.join(self.dir, "haproxy.log")
        self.argv = [self.bin, "-f", self.cfg, "-db"]


@it.test("proxies: behind HAProxy (send-proxy-v2): one client's 10 connections, at most 4 served, others served "
         "meanwhile; the access log names the real clients")
def t_proxies_haproxy():
    with Gateway("haproxy", ["--trusted-proxies", "127.0.0.1", "--max-conns-per-ip", "4"]) as g, HAProxy(g.port) as hp:
        # The abusive client: 10 keep-alive connections, each with a request the upstream holds.
        conns = []
        try:
            for i in range(10):
                c = it.Conn(hp.port, timeout=40, source=ABUSER)
                conns.append(c)
                c.send(g.chat("head_delay_ms=%d" % HELD_MS, "abuse-%d" % i))
            t_sent = time.monotonic()
            held = [None] * 10

            def reader(i):
                held[i] = read_outcome(conns[i], 40)
            readers = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(10)]
            for t in readers:
                t.start()
            # The 10 connections through ltg: 4 held upstream, the rest closed.
            wait_settled(g, 10, lambda: len([o for o in held if o is not None]), "behind HAProxy")
            # Meanwhile 5 other clients, one request each.
            others = in_threads([lambda s=s: one_via(hp.port, g.chat(tag="other-" + s, keep_alive=False), s) for s in OTHERS])
            t_others = max(o.t for o in others)
            for t in readers:
                t.join(max(0.1, t_sent + 45 - time.monotonic()))
            check(not any(t.is_alive() for t in readers), "the abusive client's connections: no outcome within 45 s")
        finally:
            for c in conns:
                c.close()
        check_others_served(others, "behind HAProxy")
        served = [o for o in held if o.kind == "answer" and o.status == 200]
        refused = [o for o in held if o not in served]
        check(1 <= len(served) <= 4, "the abusive client's 10 connections: %d answered 200, want at most 4 (and some): %r"
              % (len(served), held))
        check(len(served) == 4, "the abusive client's 10 connections: %d answered 200, want 4 (the cap): %r" % (len(served), held))
        check(all(o.kind == "closed" or (o.kind == "answer" and o.status in (502, 503)) for o in refused),
              "the refused connections: want closed (or HAProxy's 502/503), got %r" % refused)
        check(max(o.t for o in refused) < min(o.t for o in served),
              "the refused connections were not closed before the held requests were answered (%.1f s vs %.1f s after sending)"
              % (max(o.t for o in refused) - t_sent, min(o.t for o in served) - t_sent))
        check(t_others < min(o.t for o in served), "the other clients were answered only after the held requests "
              "(%.1f s vs %.1f s)" % (t_others - t_sent, min(o.t for o in served) - t_sent))
        check("max-conns-per-ip" in g.a.text_since_start(), "ltg's log does not say a client address held "
              "--max-conns-per-ip connections: %s" % g.a.text_since_start()[-600:])
        # Its connections gone, the abusive client is served again. Gone means ltg has seen HAProxy
        # close them (asynchronously, after the client did): until then they still count.
        seen = [None]

        def all_gone():
            seen[0] = inference_conns(g)
            return seen[0] == 0
        it.wait_until(lambda: "ltg still counts %r inference connections after the client closed them" % seen[0],
                      all_gone, 15 * it.SLOW, 0.1)
        again = one_via(hp.port, g.chat(tag="abuse-again", keep_alive=False), ABUSER)
        check(again.kind == "answer" and again.status == 200, "the abusive client, its connections closed, "
              "is not served again: %r" % again)
        lines = g.wait_lines(lambda l: l["path"] == "/v1/chat/completions", 4 + 5 + 1)
        for s in OTHERS:
            mine = chats(lines, s)
            check(len(mine) == 1 and mine[0]["status"] == 200, "the access log's line for client %s: %r (all: %r)"
                  % (s, mine, summary(lines)))
        ab = chats(lines, ABUSER)
        check(len(ab) == 5 and all(l["status"] == 200 for l in ab), "the access log's lines for the abusive client %s: "
              "want 5 x 200 (4 held + 1 after), got %r (all: %r)" % (ABUSER, summary(ab), summary(lines)))
        check(not chats(lines, "127.0.0.1"), "lines naming the proxy 127.0.0.1 as the client: %r" % summary(lines))


# ===== 2. behind nginx: X-Forwarded-For ===========================================================

NGINX_CFG = """%(user)sworker_processes 1;
pid %(dir)s/nginx.pid;
error_log %(dir)s/error.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    client_body_temp_path %(dir)s/body;
    proxy_temp_path %(dir)s/proxy;
    fastcgi_temp_path %(dir)s/fastcgi;
    uwsgi_temp_path %(dir)s/uwsgi;
    scgi_temp_path %(dir)s/scgi;
    upstream ltg {
        server 127.0.0.1:%(ltg)d;
        keepalive 32;
    }
    server {
        listen 127.0.0.1:%(front)d;
        location / {
            proxy_pass http://ltg;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_read_timeout 120s;
            proxy_next_upstream off;
        }
    }
}
"""


class Nginx(Balancer):
    def __init__(self, ltg_port):
        Balancer.__init__(self, "nginx", ltg_port)
        self.cfg = os.path.join(self.dir, "nginx.conf")
        with open(self.cfg, "w") as f:
            f.write(NGINX_CFG % {"user": "user root;\n" if os.geteuid() == 0 else "", "dir": self.dir,
                                 "ltg": ltg_port, "front": self.port})
        self.logpath = os.path.join(self.dir, "error.log")
        self.out_log = os.path.join(self.dir, "stderr.log")
        self.argv = [self.bin, "-p", self.dir, "-e", self.logpath, "-c", self.cfg, "-g", "daemon off;"]


@it.test("proxies: behind nginx (X-Forwarded-For): one client's 10 concurrent requests, at most 4 served, the others "
         "429 too_many_connections; others served meanwhile; the access log names the real clients")
def t_proxies_nginx():
    with Gateway("nginx", ["--trusted-proxies", "127.0.0.1", "--max-conns-per-ip", "4"]) as g, Nginx(g.port) as ng:
        t_sent = time.monotonic()
        box = {}

        def abuse():
            box["held"] = in_threads([lambda i=i: one_via(ng.port, g.chat("head_delay_ms=%d" % HELD_MS, "abuse-%d" % i), ABUSER)
                                      for i in range(10)], timeout=50)
        t = threading.Thread(target=abuse, daemon=True)
        t.start()
        # The 10 requests through ltg: 4 held upstream, the rest answered 429 (the access log says).
        wait_settled(g, 10, lambda: len([l for l in chats(g.lines(), ABUSER) if l["status"] == 429]), "behind nginx")
        others = in_threads([lambda s=s: one_via(ng.port, g.chat(tag="other-" + s, keep_alive=False), s) for s in OTHERS])
        t_others = max(o.t for o in others)
        t.join(55)
        check(not t.is_alive() and "held" in box, "the abusive client's requests: no outcome within 55 s")
        held = box["held"]
        check_others_served(others, "behind nginx")
        served = [o for o in held if o.kind == "answer" and o.status == 200]
        refused = [o for o in held if o not in served]
        check(1 <= len(served) <= 4, "the abusive client's 10 requests: %d answered 200, want at most 4 (and some): %r"
              % (len(served), held))
        check(len(served) == 4, "the abusive client's 10 requests: %d answered 200, want 4 (the cap): %r" % (len(served), held))
        for o in refused:
            check(o.kind == "answer" and o.status == 429, "a refused request: want 429 too_many_connections, got %r" % o)
            it.check_openai_error(o.r, 429, "too_many_connections")
            check(o.r.header("retry-after") == "1", "the 429's Retry-After %r, want 1" % o.r.header("retry-after"))
        check(max(o.t for o in refused) < min(o.t for o in served),
              "the 429s came only after the held requests were answered (%.1f s vs %.1f s after sending)"
              % (max(o.t for o in refused) - t_sent, min(o.t for o in served) - t_sent))
        check(t_others < min(o.t for o in served), "the other clients were answered only after the held requests "
              "(%.1f s vs %.1f s)" % (t_others - t_sent, min(o.t for o in served) - t_sent))
        lines = g.wait_lines(lambda l: l["path"] == "/v1/chat/completions", 10 + 5)
        for s in OTHERS:
            mine = chats(lines, s)
            check(len(mine) == 1 and mine[0]["status"] == 200, "the access log's line for client %s: %r (all: %r)"
                  % (s, mine, summary(lines)))
        ab = chats(lines, ABUSER)
        check(sorted(l["status"] for l in ab) == [200] * 4 + [429] * 6,
              "the access log's lines for the abusive client %s: want 4 x 200 and 6 x 429, got %r (all: %r)"
              % (ABUSER, summary(ab), summary(lines)))
        check(not chats(lines, "127.0.0.1"), "lines naming the proxy 127.0.0.1 as the client: %r" % summary(lines))


@it.test("proxies: behind nginx, a client with nothing in flight is served although nginx keeps idle keep-alive "
         "connections that last carried its requests")
def t_proxies_nginx_idle_pool():
    # nginx keeps its upstream connections open (keepalive) and hands the next request to any idle
    # one. After client A's 4 concurrent requests are answered, nginx holds 4 idle connections
    # that last spoke for A; a request of another client answered after them leaves its connection
    # first in nginx's pool (nginx takes the most recently released one), so A's next request -- A
    # having no request in flight and no connection to nginx open -- goes on a connection that
    # spoke for someone else. A is not over its cap: it must be served.
    with Gateway("nginx-idle", ["--trusted-proxies", "127.0.0.1", "--max-conns-per-ip", "4"]) as g, Nginx(g.port) as ng:
        box = {}

        def burst():
            box["a"] = in_threads([lambda i=i: one_via(ng.port, g.chat("head_delay_ms=3000", "burst-%d" % i), ABUSER)
                                   for i in range(4)], timeout=50)
        t = threading.Thread(target=burst, daemon=True)
        t.start()
        it.wait_until(lambda: "client A's 4 requests in flight upstream (%g)" % in_flight(g), lambda: in_flight(g) >= 4,
                      20 * it.SLOW, 0.05)
        # Client B: its request is answered after A's four (a longer upstream delay).
        b = one_via(ng.port, g.chat("head_delay_ms=5000", "late-b", keep_alive=False), OTHERS[0])
        t.join(55)
        check(not t.is_alive() and "a" in box, "client A's burst: no outcome within 55 s")
        check(all(o.kind == "answer" and o.status == 200 for o in box["a"]), "client A's 4 concurrent requests (its cap): %r" % box["a"])
        check(b.kind == "answer" and b.status == 200, "client B's request: %r" % b)
        # A, with nothing in flight (ltg has finished every request), makes requests one at a time.
        it.wait_until(lambda: "nothing in flight upstream (%g)" % in_flight(g), lambda: in_flight(g) == 0, 10 * it.SLOW, 0.05)
        got = []
        for i in range(3):
            o = one_via(ng.port, g.chat(tag="after-%d" % i, keep_alive=False), ABUSER)
            got.append(o)
        bad = [o for o in got if not (o.kind == "answer" and o.status == 200)]
        lines = g.wait_lines(lambda l: l["path"] == "/v1/chat/completions", 4 + 1 + 3)
        check(not bad, "client %s, with no request in flight and no connection open, is refused: %r (access log: %r)"
              % (ABUSER, got, summary(lines)))


# ===== 3. without --trusted-proxies, or from an untrusted address =================================

def check_400_closed(c, what):
    r = read_outcome(c, 10)
    check(r.kind == "answer" and r.status == 400, "%s: want 400, got %r" % (what, r))
    check(c.wait_closed(5), "%s: the connection was not closed after the 400" % what)
    return r


@it.test("proxies: from an untrusted address (no --trusted-proxies, or not in it) a PROXY header is a 400 and "
         "X-Forwarded-For is ignored")
def t_proxies_untrusted():
    for args, what in (([], "without --trusted-proxies"), (["--trusted-proxies", "127.0.0.10,192.0.2.0/24"], "127.0.0.1 not trusted")):
        with Gateway("untrusted", args) as g:
            for hdr, kind in ((proxy_v1("TCP4", "203.0.113.9", "127.0.0.1"), "PROXY v1"),
                              (proxy_v2("203.0.113.9", "127.0.0.1"), "PROXY v2")):
                with it.Conn(g.port, timeout=10) as c:
                    c.send(hdr + models_req(g))
                    check_400_closed(c, "%s: a %s header sent directly" % (what, kind))
            r = it.one_request(g.port, "GET", "/v1/models", headers={"X-Forwarded-For": "203.0.113.9"}, auth=g.token)
            check(r.status == 200, "%s: GET /v1/models with X-Forwarded-For: %s" % (what, r.brief()))
            rid = r.header("x-ltg-request-id")
            lines = g.wait_lines(lambda l: l["request_id"] == rid, 1)
            check(len(lines) == 1 and lines[0]["client"] == "127.0.0.1",
                  "%s: the request with X-Forwarded-For: 203.0.113.9 is logged with client %r, want 127.0.0.1"
                  % (what, [l["client"] for l in lines]))
            check(not [l for l in g.all_lines() if l["client"] == "203.0.113.9"],
                  "%s: an access log line names 203.0.113.9: %r" % (what, summary(g.all_lines())))
            if args:
                # The control: from the trusted 127.0.0.10 the same header names the client.
                with it.Conn(g.port, timeout=10, source="127.0.0.10") as c:
                    o = request_on(c, it.http_request("GET", "/v1/models", headers={"X-Forwarded-For": "203.0.113.9"},
                                                      auth=g.token), 15)
                check(o.kind == "answer" and o.status == 200, "from the trusted 127.0.0.10: %r" % o)
                rid = o.r.header("x-ltg-request-id")
                lines = g.wait_lines(lambda l: l["request_id"] == rid, 1)
                check(len(lines) == 1 and lines[0]["client"] == "203.0.113.9",
                      "from the trusted 127.0.0.10, X-Forwarded-For: 203.0.113.9 is logged with client %r"
                      % [l["client"] for l in lines])


# ===== 4. PROXY v1 and v2 sent directly from a trusted address ====================================

@it.test("proxies: PROXY v1 (TCP4, TCP6, UNKNOWN) and v2 (TCP4, TCP6, LOCAL) from a trusted address name the "
         "client in the access log; X-Forwarded-For too; a malformed header is a 400")
def t_proxies_direct_headers():
    with Gateway("direct", ["--trusted-proxies", "127.0.0.1"]) as g:
        cases = [
            ("v1 TCP4", [proxy_v1("TCP4", "198.51.100.7", "127.0.0.1")], "198.51.100.7"),
            ("v1 TCP6", [proxy_v1("TCP6", "2001:db8::7", "::1")], "2001:db8::7"),
            ("v1 UNKNOWN", [b"PROXY UNKNOWN\r\n"], "127.0.0.1"),
            ("v2 TCP4", [proxy_v2("198.51.100.8", "127.0.0.1")], "198.51.100.8"),
            ("v2 TCP6", [proxy_v2("2001:db8:1:2::8", "2001:db8::1")], "2001:db8:1:2::8"),
            ("v2 LOCAL", [proxy_v2(local=True)], "127.0.0.1"),
            ("v2 TCP4 with a TLV", [proxy_v2("198.51.100.9", "127.0.0.1", tlv=b"\x04\x00\x03abc")], "198.51.100.9"),
            # Split: the header in pieces, a pause between them.
            ("v1 TCP4 in pieces", [b"PROXY TCP4 198.51", b".100.10 127.0.0.1 4", b"0000 80\r\n"], "198.51.100.10"),
            ("v2 TCP4 in pieces", [proxy_v2("198.51.100.11", "127.0.0.1")[:7], proxy_v2("198.51.100.11", "127.0.0.1")[7:20],
                                   proxy_v2("198.51.100.11", "127.0.0.1")[20:]], "198.51.100.11"),
        ]
        failures = []
        for what, pieces, client in cases:
            with it.Conn(g.port, timeout=15, nodelay=True) as c:
                for p in pieces[:-1]:
                    c.send(p)
                    time.sleep(0.2)     # a pace: each piece arrives on its own
                c.send(pieces[-1])
                # Two requests on the connection: both are the named client's.
                o1 = request_on(c, models_req(g), 15)
                o2 = request_on(c, models_req(g, close=True), 15)
            if not all(o.kind == "answer" and o.status == 200 for o in (o1, o2)):
                failures.append("%s: the requests after the header: %r, %r" % (what, o1, o2))
                continue
            rids = [o.r.header("x-ltg-request-id") for o in (o1, o2)]
            lines = g.wait_lines(lambda l: l["request_id"] in rids, 2)
            got = [l["client"] for l in lines]
            if got != [client, client]:
                failures.append("%s: logged client %r, want %r" % (what, got, client))
        # X-Forwarded-For from the trusted address: the rightmost address that is not trusted.
        for xff, client in (("203.0.113.9", "203.0.113.9"), ("198.51.100.1, 127.0.0.1", "198.51.100.1"),
                            ("10.1.1.1, 2001:db8::42", "2001:db8::42")):
            r = it.one_request(g.port, "GET", "/v1/models", headers={"X-Forwarded-For": xff}, auth=g.token)
            rid = r.header("x-ltg-request-id")
            lines = g.wait_lines(lambda l: l["request_id"] == rid, 1)
            if r.status != 200 or [l["client"] for l in lines] != [client]:
                failures.append("X-Forwarded-For: %s: %s, logged client %r, want %r" % (xff, r.brief(), [l["client"] for l in lines], client))
        malformed = [
            ("v1 unknown family", b"PROXY TCP5 198.51.100.7 127.0.0.1 40000 80\r\n"),
            ("v1 not an address", b"PROXY TCP4 not-an-address 127.0.0.1 40000 80\r\n"),
            ("v1 too few words", b"PROXY TCP4 198.51.100.7\r\n"),
            ("v1 LF without CR", b"PROXY TCP4 198.51.100.7 127.0.0.1 40000 80\n"),
            ("v1 over 107 bytes", b"PROXY TCP4 " + b"1" * 120 + b"\r\n"),
            ("v2 version 3", proxy_v2("198.51.100.7", "127.0.0.1", version_command=0x31)),
            ("v2 command 2", proxy_v2("198.51.100.7", "127.0.0.1", version_command=0x22)),
            ("v2 AF_UNIX", V2_SIG + bytes([0x21, 0x31]) + struct.pack("!H", 216) + b"\0" * 216),
            ("v2 TCP6 too short", V2_SIG + bytes([0x21, 0x21]) + struct.pack("!H", 12) + b"\0" * 12),
        ]
        for what, hdr in malformed:
            with it.Conn(g.port, timeout=15) as c:
                c.send(hdr + models_req(g))
                o = read_outcome(c, 10)
                closed = c.wait_closed(5)
            if not (o.kind == "answer" and o.status == 400 and closed):
                failures.append("malformed %s: want 400 and closed, got %r (closed %r)" % (what, o, closed))
        check(not failures, "; ".join(failures))


@it.test("proxies: a PROXY v1 header's other fields are checked too: the family matches the addresses, the "
         "destination is an address, the ports are 0..65535 in decimal (else 400)")
def t_proxies_v1_strict():
    # The PROXY protocol spec (HAProxy's proxy-protocol.txt, 2.1): TCP4 carries IPv4 addresses and
    # TCP6 IPv6 ones, both addresses and both ports are given, a port is 0..65535 in decimal; a
    # receiver must not guess at a line that breaks it.
    with Gateway("v1-strict", ["--trusted-proxies", "127.0.0.1"]) as g:
        bad = [
            ("TCP4 with an IPv6 source", b"PROXY TCP4 2001:db8::1 127.0.0.1 40000 80\r\n"),
            ("TCP6 with an IPv4 source", b"PROXY TCP6 198.51.100.1 ::1 40000 80\r\n"),
            ("a destination that is not an address", b"PROXY TCP4 198.51.100.1 not-an-address 40000 80\r\n"),
            ("source port 99999", b"PROXY TCP4 198.51.100.1 127.0.0.1 99999 80\r\n"),
            ("source port abc", b"PROXY TCP4 198.51.100.1 127.0.0.1 abc 80\r\n"),
        ]
        failures = []
        for what, hdr in bad:
            with it.Conn(g.port, timeout=15) as c:
                c.send(hdr + models_req(g))
                o = read_outcome(c, 10)
                closed = c.wait_closed(5)
            if not (o.kind == "answer" and o.status == 400 and closed):
                logged = ""
                if o.kind == "answer" and o.r.header("x-ltg-request-id"):
                    rid = o.r.header("x-ltg-request-id")
                    logged = ", logged as client %r" % [l["client"] for l in g.wait_lines(lambda l: l["request_id"] == rid, 1)]
                failures.append("%s (%r): want 400 and closed, got %r%s" % (what, hdr, o, logged))
        check(not failures, "; ".join(failures))


@it.test("proxies: after a PROXY header the connection's client is final: an X-Forwarded-For the client sends "
         "through it names no one else, in the access log or against --max-conns-per-ip, on any of its requests")
def t_proxies_proxy_then_xff():
    with Gateway("proxy-xff", ["--trusted-proxies", "127.0.0.1", "--max-conns-per-ip", "2"]) as g:
        held = []
        try:
            rids = []
            for i in range(2):
                c = it.Conn(g.port, timeout=15)
                held.append(c)
                c.send(proxy_v1("TCP4", "198.51.100.50", "127.0.0.1"))
                for j in range(2):   # each request names someone else
                    o = request_on(c, it.http_request("GET", "/v1/models", auth=g.token,
                                                      headers={"X-Forwarded-For": "203.0.113.%d" % (10 * i + j + 1)}), 15)
                    check(o.kind == "answer" and o.status == 200, "connection %d, request %d: %r" % (i, j, o))
                    rids.append(o.r.header("x-ltg-request-id"))
            lines = g.wait_lines(lambda l: l["request_id"] in rids, len(rids))
            check([l["client"] for l in lines] == ["198.51.100.50"] * len(rids),
                  "the access log's clients: %r" % [l["client"] for l in lines])
            # The PROXY client holds its 2 connections: a third is closed, whatever it forwards.
            with it.Conn(g.port, timeout=15) as c:
                c.send(proxy_v1("TCP4", "198.51.100.50", "127.0.0.1") +
                       it.http_request("GET", "/healthz", auth=None, headers={"X-Forwarded-For": "203.0.113.99"}))
                check(c.wait_closed(5) and not c.buf.startswith(b"HTTP/1.1 200"),
                      "a third connection of 198.51.100.50 (--max-conns-per-ip 2) was served: %r" % c.buf[:100])
        finally:
            for c in held:
                c.close()


# ===== 5. IPv6 clients counted per /64 ============================================================

def proxied_conn(port, hdr, timeout=15):
    """A connection that sends the PROXY header `hdr` and one GET /healthz: (Conn, Outcome)."""
    c = it.Conn(port, timeout=timeout)
    return c, request_on(c, hdr + healthz(), timeout)


@it.test("proxies: IPv6 clients are counted per /64 (PROXY v2 TCP6 from a trusted proxy, --max-conns-per-ip 2)")
def t_proxies_ipv6_64():
    with Gateway("v6", ["--trusted-proxies", "127.0.0.1", "--max-conns-per-ip", "2"]) as g:
        held = []
        try:
            def hdr(src):
                return proxy_v2(src, "2001:db8:ffff::1")
            for src in ("2001:db8::1", "2001:db8::2"):
                c, o = proxied_conn(g.port, hdr(src))
                held.append(c)
                check(o.kind == "answer" and o.status == 200, "the connection naming %s: %r" % (src, o))
            # The third among 2001:db8::/64: closed at once, no answer.
            with it.Conn(g.port, timeout=15) as c:
                c.send(hdr("2001:db8::3") + healthz())
                closed = c.wait_closed(5)
                check(closed and not c.buf.startswith(b"HTTP/1.1 200"),
                      "a third connection naming 2001:db8::3 (same /64 as ::1 and ::2, --max-conns-per-ip 2): %s"
                      % ("answered %r" % c.buf[:100] if c.buf else "still open after 5 s"))
            with it.Conn(g.port, timeout=15) as c:
                c.send(hdr("2001:db8::1:0:0:9") + healthz())   # 2001:db8:0:0:0:1::9, still the same /64
                check(c.wait_closed(5) and not c.buf.startswith(b"HTTP/1.1 200"),
                      "a connection naming 2001:db8::1:0:0:9 (same /64) was served: %r" % c.buf[:100])
            # Another /64: served.
            c, o = proxied_conn(g.port, hdr("2001:db8:0:1::1"))
            held.append(c)
            check(o.kind == "answer" and o.status == 200, "a connection naming 2001:db8:0:1::1 (another /64): %r" % o)
            c.send(models_req(g))
            o = read_outcome(c, 15)
            check(o.kind == "answer" and o.status == 200, "a request on it: %r" % o)
            rid = o.r.header("x-ltg-request-id")
            lines = g.wait_lines(lambda l: l["request_id"] == rid, 1)
            check([l["client"] for l in lines] == ["2001:db8:0:1::1"], "its access log line's client: %r" % lines)
            # IPv4 clients are counted each on its own: two of 198.51.100.1 fill its cap, .2 is served.
            for src in ("198.51.100.1", "198.51.100.1"):
                c, o = proxied_conn(g.port, proxy_v2(src, "127.0.0.1"))
                held.append(c)
                check(o.kind == "answer" and o.status == 200, "a connection naming %s: %r" % (src, o))
            with it.Conn(g.port, timeout=15) as c:
                c.send(proxy_v2("198.51.100.1", "127.0.0.1") + healthz())
                check(c.wait_closed(5) and not c.buf.startswith(b"HTTP/1.1 200"),
                      "a third connection naming 198.51.100.1 was served: %r" % c.buf[:100])
            c, o = proxied_conn(g.port, proxy_v2("198.51.100.2", "127.0.0.1"))
            held.append(c)
            check(o.kind == "answer" and o.status == 200, "a connection naming 198.51.100.2 (another IPv4 client): %r" % o)
            # One of the /64's connections closed: the /64 may have a new one.
            held[0].close()
            deadline = time.monotonic() + 10 * it.SLOW
            while True:
                with it.Conn(g.port, timeout=15) as c:
                    o = request_on(c, hdr("2001:db8::5") + healthz(close=True), 10)
                if (o.kind == "answer" and o.status == 200) or time.monotonic() > deadline:
                    break
                time.sleep(0.3)     # backoff: until ltg has seen the close
            check(o.kind == "answer" and o.status == 200, "after one of its two connections closed, a connection naming "
                  "2001:db8::5 (same /64): %r" % o)
        finally:
            for c in held:
                c.close()
        check("max-conns-per-ip" in g.a.text_since_start(), "ltg's log does not say a client address held "
              "--max-conns-per-ip connections")


if __name__ == "__main__":   # this file alone: python3 tests/integration_proxies.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
