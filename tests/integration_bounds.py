"""Integration tests: every byte and every slot has a bound, against hostile clients too (issue #11,
point 6).

tests/integration.py imports this file at start-up and runs its tests with the others; to run only
these:

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k bounds

1. A client that pipelines 48 MiB of requests and never reads an answer: ltg stops reading from it
   once its unsent answers pass the high-water mark, so its memory grows by little, and the
   connection is closed after --idle-timeout without progress.
2. --max-conns-per-ip: one client address holds at most that many inference connections, another
   address is served meanwhile, and the episode is logged once.
3. A request body must keep up 4 KiB/s after --head-timeout: a trickled body gets 408 in time, a
   slow but steady one is served.
4. slowhttptest (Debian's package, installed when we can: skipped with the reason otherwise) from
   one address: slowloris, slow body and slow read, 1000 connections each, on each listener, while a
   client on another loopback address (127.0.0.2) calls once a second: every one of its calls
   succeeds. (slowhttptest sends no key, so its slow bodies are refused as their heads arrive; a
   keyed slow body is test 3's.)
5. A full listener sheds a connection of the client that holds the most, not the oldest one of
   another client.

Each test runs an ltg of its own (it.Aux) with short timeouts.
"""

import integration as it

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time

check = it.check
OTHER = "127.0.0.2"      # a second client address (all of 127/8 is loopback on Linux)


def other_call(port, method, path, body=None, auth=it.TOKEN, timeout=10.0):
    """One request from the other address, on a connection of its own."""
    with it.Conn(port, timeout=timeout, source=OTHER) as c:
        c.send(it.http_request(method, path, body, {"Connection": "close"}, auth=auth))
        return c.read_final_response(timeout)


# How many connections an attack of 1000 from one address holds once it is in full swing: the
# inference listener lets an address hold a quarter of --max-conns (1024), the control plane's
# holds 64 in all (its oldest idle ones shed for newcomers).
ATTACK_HOLDS = {"inference": 200, "admin": 48}


def client_connections(a, plane):
    """ltg_client_connections of listener `plane` on a's /metrics (scraped from the other address)."""
    r = other_call(a.admin_port, "GET", "/metrics", auth=None)
    check(r.status == 200, "GET /metrics: %s" % r.brief())
    m = re.search(r'^ltg_client_connections\{listener="%s"\} (\S+)$' % plane, r.body.decode("utf-8", "replace"), re.M)
    check(m, "no ltg_client_connections{listener=\"%s\"} on /metrics" % plane)
    return int(float(m.group(1)))


def provisioned(a):
    gid = it.create_group(port=a.admin_port)["id"]
    return it.create_key(gid, port=a.admin_port)[1]


@it.test("bounds: a client that pipelines 48 MiB of requests and never reads: ltg stops reading it, its memory "
         "grows by little, and the connection is closed after --idle-timeout")
def t_bounds_pipelining():
    # Under AddressSanitizer every freed buffer waits in a quarantine (256 MiB by default), which
    # is RSS the release build does not have: a small one keeps the measure about ltg.
    env = dict(it.H.env)
    env["ASAN_OPTIONS"] = (env.get("ASAN_OPTIONS", "") + ":quarantine_size_mb=1").lstrip(":")
    a = it.Aux("bounds-pipe-" + os.urandom(3).hex(), args=["--idle-timeout", "3", "--head-timeout", "3"], env=env)
    try:
        a.start()
        pid = a.proc.pid
        rss0 = it.rss_kib(pid)
        s = socket.create_connection(("127.0.0.1", a.port), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        one = it.http_request("GET", "/healthz", auth=None)
        chunk = one * ((1 << 20) // len(one))
        sent, stop = [0], [False]

        def push():
            s.settimeout(2)
            try:
                while not stop[0] and sent[0] < 48 << 20:
                    sent[0] += s.send(chunk)
            except OSError:
                pass                                # blocked (TCP pushes back), or closed by ltg
        th = threading.Thread(target=push, daemon=True)
        th.start()
        th.join(30)
        stop[0] = True
        grown = it.rss_kib(pid) - rss0
        it.log("pipelined %d bytes before TCP pushed back; ltg's RSS grew by %d KiB" % (sent[0], grown))
        bound = (64 if it.WRAP else 8) * 1024       # under valgrind the process measured is valgrind, shadow memory and all
        check(grown < bound, "ltg's RSS grew by %d KiB for a client that never reads (it sent %d bytes)" % (grown, sent[0]))
        check(sent[0] < 48 << 20, "all 48 MiB went in: ltg kept reading from a client that does not read")
        closed = it.closed_by_peer([s], 30)
        check(s in closed, "the connection that takes nothing was not closed within 30 s")
        s.close()
        check(it.healthz_ok(a.port), "ltg serves others after it")
        a.stop()
    finally:
        a.close()


@it.test("bounds: --max-conns-per-ip 4: a fifth connection from one address is closed at once, another address is "
         "served; logged once per episode")
def t_bounds_per_ip():
    a = it.Aux("bounds-ip-" + os.urandom(3).hex(), args=["--max-conns", "32", "--max-conns-per-ip", "4"])
    held = []
    try:
        a.start()
        token = provisioned(a)
        held = it.held_conns(a.port, 4)
        for i in range(3):
            with it.Conn(a.port) as fifth:
                check(fifth.wait_closed(15), "connection %d over the cap of one address was not closed" % (5 + i))
                check(not fifth.buf, "it got %r" % fifth.buf[:100])
        r = other_call(a.port, "POST", "/v1/chat/completions", it.chat_body(), auth=token)
        check(r.status == 200, "another address, while the first is at its cap: %s" % r.brief())
        check(it.healthz_ok(a.admin_port), "the control plane is not counted against the address")
        text = a.text_since_start()
        starts = [l for l in text.splitlines() if "holds --max-conns-per-ip" in l and ": over," not in l]
        check(len(starts) == 1, "the episode is not logged once: %r" % text[-600:])
        held.pop().close()
        it.wait_until("a new connection from the address after one of its four closed", lambda: it.healthz_ok(a.port, 3), 10)
        a.stop()
    finally:
        it.close_all([c.sock for c in held])
        a.close()


@it.test("bounds: a full listener sheds an idle connection of the client holding the most connections, "
         "not an older one of another client")
def t_bounds_shed_most():
    a = it.Aux("bounds-shed-" + os.urandom(3).hex(), args=["--max-conns", "6", "--max-conns-per-ip", "5"])
    conns = []

    def idle(source):           # a keep-alive connection that has been served once
        c = it.Conn(a.port, source=source)
        conns.append(c)
        c.send(it.http_request("GET", "/healthz", auth=None))
        check(c.read_final_response(5).status == 200, "a first request from %s" % source)
        return c

    def served(c):
        c.send(it.http_request("GET", "/healthz", auth=None))
        return c.read_final_response(5).status == 200

    try:
        a.start()
        other = idle(OTHER)     # the oldest, of a client with one connection
        time.sleep(0.1)         # on purpose: ltg's clock (ms) must see it older than the next
        hog = []
        for _ in range(5):      # a client with five, the listener full
            hog.append(idle("127.0.0.1"))
            time.sleep(0.02)    # on purpose, as above: each older than the next
        with it.Conn(a.port, source="127.0.0.3") as new:
            new.send(it.http_request("GET", "/healthz", auth=None, headers={"Connection": "close"}))
            check(new.read_final_response(5).status == 200, "the newcomer was not served")
        check(hog[0].wait_closed(15), "the oldest connection of the client holding five was not closed to make room")
        check(served(other), "the other client's connection, older but its only one, was shed")
        for c in hog[1:]:
            check(served(c), "another connection of the client holding five was closed too")
        a.stop()
    finally:
        for c in conns:
            c.close()
        a.close()


@it.test("bounds: a request body must keep up 4 KiB/s after --head-timeout: a trickled one gets 408, a steady one is served")
def t_bounds_slow_body():
    a = it.Aux("bounds-body-" + os.urandom(3).hex(), args=["--head-timeout", "2"])
    try:
        a.start()
        token = provisioned(a)
        head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n" % token).encode()
        with it.Conn(a.port, timeout=30) as c:
            c.send(head)
            t0, status = time.monotonic(), None
            while status is None and time.monotonic() - t0 < 20:
                try:
                    c.send(b" ")
                except OSError:
                    pass                            # ltg has answered and may have closed
                try:
                    status = c.read_final_response(0.5).status
                except it.TestFailure:
                    continue                        # nothing yet: trickle on
                except EOFError:
                    break
            dt = time.monotonic() - t0
            check(status == 408, "a body trickled a byte per half second: %r after %.1f s" % (status, dt))
            check(1.5 <= dt <= 8, "the trickled body was refused after %.1f s (--head-timeout 2)" % dt)
        body = json.dumps(it.chat_body(content="x" * 40000)).encode()
        head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (token, len(body))).encode()
        with it.Conn(a.port, timeout=30) as c:
            c.send(head)
            for i in range(0, len(body), 4096):     # 40 KB over about 5 s: 8 KiB/s, above the floor
                c.send(body[i:i + 4096])
                time.sleep(0.5)                     # on purpose, the pace
            r = c.read_final_response(20)
            check(r.status == 200, "a body that keeps up 8 KiB/s for 5 s: %s" % r.brief())
        a.stop()
    finally:
        a.close()


def need_slowhttptest():
    if shutil.which("slowhttptest"):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        with it.install_lock():     # one apt-get at a time (--jobs)
            it.log("installing slowhttptest (Debian package)")
            for cmd in (["apt-get", "install", "-y", "-qq", "slowhttptest"], ["apt-get", "update", "-qq"],
                        ["apt-get", "install", "-y", "-qq", "slowhttptest"]):
                if shutil.which("slowhttptest"):
                    return
                subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
            if shutil.which("slowhttptest"):
                return
    raise it.TestSkip("slowhttptest is not installed and cannot be: sudo apt-get install slowhttptest")


ATTACKS = [
    ("slowloris", ["-H", "-i", "2", "-x", "24"]),
    ("slow body", ["-B", "-i", "2", "-s", "1000000", "-x", "10"]),
    ("slow read", ["-X", "-k", "10", "-n", "2", "-w", "1", "-y", "8", "-z", "1"]),
]


@it.test("bounds: slowhttptest from one address (slowloris, slow body, slow read; 1000 connections) on both "
         "listeners: every call from another address succeeds meanwhile")
def t_bounds_slowhttptest():
    need_slowhttptest()
    it.raise_fd_limit(4096)
    a = it.Aux("bounds-slowhttp-" + os.urandom(3).hex(), args=["--head-timeout", "10"])
    try:
        a.start()
        token = provisioned(a)
        for plane, port in (("inference", a.port), ("admin", a.admin_port)):
            for name, flags in ATTACKS:
                path = "/healthz" if name == "slow read" else ("/v1/chat/completions" if plane == "inference" else it.API + "/token_groups")
                cmd = ["slowhttptest", "-c", "1000", "-r", "250", "-l", "14", "-p", "3", "-u", "http://127.0.0.1:%d%s" % (port, path)] + flags
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                fails, done = [], 0
                try:
                    # The attack has its connections (slowhttptest opens 250 a second). Its slow bodies
                    # carry no key: each is refused (401) as soon as its head is in, so it holds
                    # nothing, and may even be done before the calls.
                    seen = []
                    it.wait_until(lambda: "%s on the %s listener: ltg holds %r client connections, want %d"
                                          % (name, plane, seen[-1:], ATTACK_HOLDS[plane]),
                                  lambda: seen.append(client_connections(a, plane)) or seen[-1] >= ATTACK_HOLDS[plane]
                                          or proc.poll() is not None or name == "slow body",
                                  30 * it.SLOW, step=0.1)
                    check(proc.poll() is None or name == "slow body",
                          "slowhttptest (%s) exited with %r before the calls" % (name, proc.returncode))
                    for i in range(8):
                        t0 = time.monotonic()
                        try:
                            if plane == "inference":
                                r = other_call(port, "POST", "/v1/chat/completions", it.chat_body(content="legit %d" % i), auth=token)
                            else:
                                r = other_call(port, "GET", it.API + "/token_groups?page[size]=1", auth=it.ADMIN_KEY)
                            if r.status != 200:
                                fails.append(r.brief())
                        except (OSError, EOFError, it.TestFailure) as e:
                            fails.append(repr(e))
                        done += 1
                        time.sleep(max(0, 1 - (time.monotonic() - t0)))     # on purpose, the pace: a call a second
                finally:
                    proc.terminate()
                    try:
                        proc.wait(10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                check(not fails, "%s on the %s listener: %d of %d calls from another address failed: %r"
                      % (name, plane, len(fails), done, fails[:3]))
                check(a.proc.poll() is None, "ltg exited during the %s on the %s listener" % (name, plane))
                it.wait_until("the attack's connections gone", lambda: it.healthz_ok(port, 3), 30)
        text = a.text_since_start()
        check("holds --max-conns-per-ip" in text, "no word of the address over its cap in the log: %r" % text[-500:])
        a.stop()
    finally:
        a.close()


if __name__ == "__main__":   # this file alone: python3 tests/integration_bounds.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
