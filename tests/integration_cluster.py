"""Integration tests: several ltg instances as one gateway on a real Redis (README "Several
instances", issue #24).

Each test starts Debian's redis-server (installed when we can; skipped with the reason otherwise)
on a port of its own, with the settings the README asks for (appendonly yes, appendfsync always,
maxmemory-policy noeviction), and three ltg instances (it.Aux) with --cluster pointing at it.

1. The control plane through one stream: a group made on one instance is read on the others; the
   same Idempotency-Key sent to another instance replays the answer; with another body, 409; the
   link's metrics.
2. Nine PATCHes with one If-Match sent to the three at once: exactly one 200, eight 412, and the
   three show the same version.
3. A key deleted on one instance is refused (401) by the others within 1 s.
4. An instance stopped while another changes a group reads the change when it starts again (its
   local state log, then the stream from where it left off).
5. Redis stopped: control-plane writes 503 storage_unavailable with nothing changed, a budgeted
   request 503 store_unavailable (an uncapped one served), /readyz 503, ltg_cluster_up 0; Redis
   back (its append-only file kept): ltg reconnects by itself and writes work again.
6. Redis restarted without its append-only file: each instance notices, says so in its log and
   /readyz, and refuses control-plane changes.
7. Budgets, rate limits and parallel slots are decided by the store, on every instance at once:
   64 parallel requests over three instances against a group budget that fits exactly 4 worst
   cases (4 served, the store's spend their sum, nothing held after); rpm_limit 10;
   max_parallel_requests 3; tpm_limit of 5 worst cases; a fallback's hold against what the first attempt really spent; an
   instance SIGKILLed with a hold (its lease runs out).
8. One ledger: requests served by three instances, with and without a budget, are the same
   events in the same order on every instance (the segment files byte for byte), /usage/summary
   the same everywhere; Redis stopped: an uncapped group's events are kept and shipped when it is
   back, each once; an instance SIGKILLed with events not shipped sends them when it starts again,
   and those already shipped are not counted twice.
9. The store holds what is live: the stream trimmed, a deleted group's counts gone; a late
   instance serves nothing until given a peer's state log.
10. An inference Idempotency-Key is claimed in the store: replayed by the other instances, 409
   with another body, 409 idempotency_in_flight on another instance while it runs; a cached answer
   is not copied (a retry runs again). Events too large for a small reader (a kept 6 MiB answer;
   17 MiB entries no instance writes, skipped and counted) never wedge the streams.
11. Sentinel: a primary with a replica (min-replicas-to-write 1): the replica paused, the lone
   primary refuses writes (a budgeted request 503, an uncapped one served and shipped later);
   the primary killed, the replica promoted and found by both instances, nothing acknowledged
   lost.
12. --cluster-stale-after: an instance that has not heard from Redis refuses even uncapped
   requests, and serves again once it hears.
13. A replica is not a primary: ltg does not use it, and leaves a primary demoted under it. make cluster-demo runs to its end. A bad
   --cluster exits 2 with a message.

Runs alone: python3 tests/integration.py --ltg ./ltg --mock tests/mock --file cluster
"""

import integration as it
import integration_traffic as traffic

import contextlib
import os
import subprocess
import threading
import time

check = it.check


class Redis:
    """A redis-server of the test's own: its port, its directory, started and stopped."""

    def __init__(self, tag, args=()):
        self.bin = it.debian_tool("redis-server", "redis-server")
        self.port = it.free_ports(1)[0]
        self.dir = os.path.join(it.H.tmp, "redis-" + tag)
        os.makedirs(self.dir, exist_ok=True)
        self.args = list(args)
        self.log_path = os.path.join(self.dir, "redis.log")
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(
            [self.bin, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--maxmemory-policy", "noeviction", "--logfile", self.log_path] + self.args,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        it.wait_until("redis-server answering PING on port %d" % self.port, lambda: self.ping() == "+PONG", 10 * it.SLOW, 0.05)
        return self

    def cmd(self, *args, whole=False):
        """One command on a connection of its own: the reply's first line (RESP), or its lines."""
        import socket
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(("*%d\r\n" % len(args) + "".join("$%d\r\n%s\r\n" % (len(a.encode()), a) for a in args)).encode())
            lines = s.recv(65536).decode("utf-8", "replace").split("\r\n")
            return lines if whole else lines[0]

    def budget(self, scope):
        """What the store holds of a scope ("g:<id>", "k:<id>"): {"spent": nano-USD, "held": ...}."""
        lines = self.cmd("HGETALL", "ltg:b:" + scope, whole=True)
        vals = [l for l in lines[1:] if l and not l.startswith("$")]
        return {k: int(v) for k, v in zip(vals[::2], vals[1::2])}

    def ping(self):
        try:
            return self.cmd("PING")
        except OSError:
            return None

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    @property
    def url(self):
        return "redis://127.0.0.1:%d" % self.port


@contextlib.contextmanager
def cluster(tag, n=3, redis_args=(), args=()):
    """A Redis and n ltg instances on it (with args): (redis, [Aux...]); all stopped at the end."""
    r = Redis(tag, redis_args).start()
    auxes = [it.Aux("cl-%s-%d-%s" % (tag, i, os.urandom(2).hex()), args=["--cluster", r.url] + list(args)) for i in range(n)]
    try:
        for a in auxes:
            a.start()
        for a in auxes:
            wait_ready(a)
        yield r, auxes
        for a in auxes:
            if a.proc is not None:
                a.stop()
    finally:
        for a in auxes:
            a.close()
        r.stop()


def ready(a):
    try:
        return it.one_request(a.admin_port, "GET", "/readyz", auth=None, timeout=5).status == 200
    except Exception:
        return False


def wait_ready(a, timeout=10):
    it.wait_until(lambda: "ltg (%s) ready on the cluster: %s" % (a.tag, a.text_since_start()[-400:]),
                  lambda: ready(a), timeout * it.SLOW, 0.05)


@it.test("cluster: a group made on one instance is read on the other two; its Idempotency-Key sent to "
         "another instance replays the answer, and with another body gets 409")
def t_cluster_cp_shared():
    with cluster("cp") as (_, (a, b, c)):
        body = it.group_body()
        r = it.admin("POST", "/token_groups", body, idem="cl-g-1", port=a.admin_port)
        d = it.check_admin_ok(r, 201, "POST on the first instance")["data"]
        for x in (b, c):
            got, v = it.get_group(d["id"], port=x.admin_port)
            check(v == 1 and got["name"] == body["name"], "%s shows %r at version %d" % (x.tag, got["name"], v))
        r = it.admin("POST", "/token_groups", body, idem="cl-g-1", port=b.admin_port)
        check(r.status == 201 and r.header("x-ltg-replayed") == "true" and r.json()["data"]["id"] == d["id"],
              "the same Idempotency-Key on another instance: %s" % r.brief())
        r = it.admin("POST", "/token_groups", it.group_body(), idem="cl-g-1", port=c.admin_port)
        it.check_admin_error(r, 409, "idempotency_conflict", what="the same key, another body, a third instance")
        r = it.admin("GET", "/token_groups", port=c.admin_port)
        names = [g["name"] for g in it.check_admin_ok(r, 200)["data"]]
        check(names.count(body["name"]) == 1, "one group, not two: %r" % names)
        m = it.one_request(a.admin_port, "GET", "/metrics", auth=None).body.decode()
        for want in ("\nltg_cluster_up 1\n", "\nltg_cluster_unsettled 0\n", "\nltg_cluster_call_seconds_count ",
                     "\nltg_cluster_stream_lag_seconds ", "# TYPE ltg_cluster_call_seconds histogram\n"):
            check(want in m, "the metrics lack %r: %r" % (want, [l for l in m.splitlines() if "cluster" in l]))


@it.test("cluster: nine PATCHes with one If-Match sent to three instances at once: exactly one 200, eight 412, "
         "and all three show the same version")
def t_cluster_if_match_race():
    with cluster("race") as (_, auxes):
        gid = it.create_group(port=auxes[0].admin_port)["id"]
        for a in auxes:
            it.wait_until("%s has the group" % a.tag, lambda a=a: it.admin("GET", "/token_groups/" + gid, port=a.admin_port).status == 200,
                          5 * it.SLOW, 0.05)
        out = [None] * 9
        go = threading.Event()

        def one(i):
            go.wait()
            out[i] = it.admin("PATCH", "/token_groups/" + gid, {"name": "race-%d" % i}, if_match=1,
                              port=auxes[i % 3].admin_port)
        ths = [threading.Thread(target=one, args=(i,)) for i in range(9)]
        for t in ths:
            t.start()
        go.set()
        for t in ths:
            t.join(60)
        st = sorted(r.status for r in out)
        check(st == [200] + [412] * 8, "statuses %r, want one 200 and eight 412" % st)
        winner = [r for r in out if r.status == 200][0].json()["data"]["name"]
        for a in auxes:
            d, v = it.get_group(gid, port=a.admin_port)
            check(v == 2 and d["name"] == winner, "%s: version %d name %r, want 2 %r" % (a.tag, v, d["name"], winner))


@it.test("cluster: a token key deleted on one instance is refused (401) by the other two within 1 s")
def t_cluster_revoke():
    with cluster("revoke") as (_, (a, b, c)):
        gid = it.create_group(port=a.admin_port)["id"]
        kd, token = it.create_key(gid, port=a.admin_port)
        for x in (b, c):
            it.wait_until("%s serves the new key" % x.tag,
                          lambda x=x: it.one_request(x.port, "POST", "/v1/chat/completions", it.chat_body(), auth=token).status == 200,
                          5 * it.SLOW, 0.05)
        r = it.admin("DELETE", "/token_keys/" + kd["id"], if_match=1, port=a.admin_port)
        it.check_admin_ok(r, 200, "DELETE on the first instance")
        t0 = time.monotonic()
        for x in (b, c):
            it.wait_until("%s refuses the deleted key" % x.tag,
                          lambda x=x: it.one_request(x.port, "POST", "/v1/chat/completions", it.chat_body(), auth=token).status == 401,
                          1.0 * it.SLOW, 0.02)
        check(time.monotonic() - t0 <= 1.0 * it.SLOW, "refused by both within %g s" % (time.monotonic() - t0))


@it.test("cluster: an instance stopped while another changes a group sees the change when it starts again, "
         "and so does its state log after a second restart without Redis's help")
def t_cluster_restart():
    with cluster("restart") as (r, (a, b, c)):
        g = it.create_group(port=a.admin_port)
        it.wait_until("the third instance has the group", lambda: it.admin("GET", "/token_groups/" + g["id"], port=c.admin_port).status == 200,
                      5 * it.SLOW, 0.05)
        c.stop()
        rr = it.admin("PATCH", "/token_groups/" + g["id"], {"name": "changed-while-down"}, if_match=1, port=b.admin_port)
        it.check_admin_ok(rr, 200, "PATCH on the second instance")
        c.start()
        wait_ready(c)
        it.wait_until("the restarted instance shows the change",
                      lambda: it.get_group(g["id"], port=c.admin_port)[0]["name"] == "changed-while-down", 5 * it.SLOW, 0.05)
        # Its own copy: with Redis gone, a restart still knows the group as it was last applied.
        c.stop()
        r.stop()
        c.start()
        d, v = it.get_group(g["id"], port=c.admin_port)
        check(v == 2 and d["name"] == "changed-while-down", "from its state log alone: version %d name %r" % (v, d["name"]))
        r.start()
        for x in (a, b, c):
            wait_ready(x, 15)


@it.test("cluster: Redis stopped: control-plane writes 503 storage_unavailable and change nothing, /readyz 503, "
         "ltg_cluster_up 0; Redis back with its append-only file: reconnected by itself, writes work again")
def t_cluster_redis_down():
    with cluster("down", n=2) as (r, (a, b)):
        g = it.create_group(port=a.admin_port)
        _, capped = group_key(a, max_budget=5, budget_duration="1d")
        _, free = group_key(a)
        it.wait_until("the other instance has the keys", lambda: it.one_request(b.port, "POST", "/v1/chat/completions",
                      it.chat_body(), auth=free).status == 200, 5 * it.SLOW, 0.05)
        r.stop()
        it.wait_until("/readyz 503 once Redis is gone", lambda: not ready(a), 10 * it.SLOW, 0.05)
        rd = it.one_request(a.admin_port, "GET", "/readyz", auth=None)
        check(rd.status == 503 and rd.json().get("status") == "store_unavailable", "/readyz: %s" % rd.brief())
        m = it.one_request(a.admin_port, "GET", "/metrics", auth=None).body.decode()
        check("\nltg_cluster_up 0\n" in m, "ltg_cluster_up while Redis is down: %r"
              % [l for l in m.splitlines() if l.startswith("ltg_cluster")])
        rr = it.admin("PATCH", "/token_groups/" + g["id"], {"name": "while-redis-down"}, if_match=1, port=a.admin_port)
        it.check_admin_error(rr, 503, "storage_unavailable", what="a PATCH while Redis is down")
        rr = it.admin("POST", "/token_groups", it.group_body(), port=b.admin_port)
        it.check_admin_error(rr, 503, "storage_unavailable", what="a POST while Redis is down")
        d, v = it.get_group(g["id"], port=a.admin_port)
        check(v == 1 and d["name"] == g["name"], "nothing changed: version %d name %r" % (v, d["name"]))
        before = kimi_calls()
        x = it.one_request(b.port, "POST", "/v1/chat/completions", it.chat_body(), auth=capped)
        it.check_openai_error(x, 503, "store_unavailable")
        check(kimi_calls() == before, "a request with a budget reached the provider while Redis was down")
        x = it.one_request(b.port, "POST", "/v1/chat/completions", it.chat_body(), auth=free)
        check(x.status == 200, "an uncapped group while Redis is down: %s" % x.brief())
        r.start()
        for x in (a, b):
            wait_ready(x, 15)
        m = it.one_request(a.admin_port, "GET", "/metrics", auth=None).body.decode()
        check("\nltg_cluster_up 1\n" in m, "ltg_cluster_up once Redis is back")
        rr = it.admin("PATCH", "/token_groups/" + g["id"], {"name": "after"}, if_match=1, port=a.admin_port)
        it.check_admin_ok(rr, 200, "a PATCH once Redis is back")
        it.wait_until("the other instance shows it", lambda: it.get_group(g["id"], port=b.admin_port)[1] == 2, 5 * it.SLOW, 0.05)
        log = a.text_since_start()
        check("lost" in log and "up (functions ltg_v1 loaded)" in log, "ltg's log tells of the loss and the return: %r" % log[-600:])
        same_ledgers((a, b), 2)     # the uncapped requests' events, one of them kept through the outage


@it.test("cluster: Redis restarted without its append-only file: each instance notices the stream lost what it "
         "applied, says so in its log and /readyz, and refuses control-plane changes with 503")
def t_cluster_redis_lost():
    with cluster("lost", n=2, redis_args=["--appendonly", "no"]) as (r, (a, b)):
        g = it.create_group(port=a.admin_port)
        it.wait_until("the other instance has the group", lambda: it.admin("GET", "/token_groups/" + g["id"], port=b.admin_port).status == 200,
                      5 * it.SLOW, 0.05)
        r.stop()
        r.start()
        for x in (a, b):
            it.wait_until(lambda x=x: "%s notices the loss: %s" % (x.tag, x.text_since_start()[-500:]),
                          lambda x=x: "Redis lost changes" in x.text_since_start(), 15 * it.SLOW, 0.1)
            rd = it.one_request(x.admin_port, "GET", "/readyz", auth=None)
            check(rd.status == 503 and "lost changes" in rd.json().get("detail", ""), "/readyz: %s" % rd.brief())
        rr = it.admin("PATCH", "/token_groups/" + g["id"], {"name": "after-loss"}, if_match=1, port=a.admin_port)
        e = it.check_admin_error(rr, 503, "storage_unavailable", what="a PATCH after the loss")
        check("lost changes" in e["detail"], "the message: %r" % e["detail"])
        check(it.get_group(g["id"], port=b.admin_port)[0]["name"] == g["name"], "the group is still served as it was")


@it.test("cluster: ltg does not use a replica (ROLE): /readyz 503 and its log says the server is not a primary; a primary "
         "demoted under ltg refuses its next write (READONLY) or its reader's ROLE, and ltg leaves it")
def t_cluster_replica():
    primary = Redis("primary").start()
    replica = Redis("replica", ["--replicaof", "127.0.0.1", str(primary.port)]).start()
    a = it.Aux("cl-replica-" + os.urandom(2).hex(), args=["--cluster", replica.url])
    try:
        a.start()
        it.wait_until("ltg's log names the replica", lambda: "not a primary" in a.text_since_start(), 10 * it.SLOW, 0.05)
        check(not ready(a), "/readyz answered ready on a replica")
        r = it.admin("POST", "/token_groups", it.group_body(), port=a.admin_port)
        it.check_admin_error(r, 503, "storage_unavailable", what="a POST through a replica")
        a.stop()
        # A primary demoted while ltg is connected: its first write is refused (READONLY), and ltg
        # leaves it.
        b = it.Aux("cl-demoted-" + os.urandom(2).hex(), args=["--cluster", primary.url])
        b.start()
        wait_ready(b)
        it.create_group(port=b.admin_port)
        other = Redis("other").start()
        try:
            check(primary.cmd("REPLICAOF", "127.0.0.1", str(other.port)) == "+OK", "REPLICAOF")
            r = it.admin("POST", "/token_groups", it.group_body(), port=b.admin_port)
            it.check_admin_error(r, 503, "storage_unavailable", what="a POST on a demoted primary")
            # Which link learns it first is a race: the write (READONLY), or the stream's reader,
            # whose blocked XREAD the demotion ends (and the reconnection's ROLE says "not a primary").
            it.wait_until("ltg leaves the demoted primary", lambda: any(
                w in b.text_since_start() for w in ("replica now (READONLY)", "not a primary (ROLE)"))
                and not ready(b), 10 * it.SLOW, 0.05)
            b.stop()
        finally:
            b.close()
            other.stop()
    finally:
        a.close()
        replica.stop()
        primary.stop()


def spread(auxes, n, token, body):
    """n requests at once, request i to instance i % 3, each on its own connection: the responses."""
    return traffic.parallel(n, token, body, ports=[a.port for a in auxes])


def group_key(a, **kw):
    gid = it.create_group(port=a.admin_port, **dict({"allowed_models": ["Kimi-K3"]}, **kw))["id"]
    return gid, it.create_key(gid, port=a.admin_port)[1]


def everywhere(gid, auxes):
    """Wait until every instance of auxes has group gid (and so its keys)."""
    for a in auxes:
        it.wait_until("%s has the group" % a.tag, lambda a=a: it.admin("GET", "/token_groups/" + gid, port=a.admin_port).status == 200,
                      5 * it.SLOW, 0.05)


def kimi_calls():
    return it.H.mock_stats().get("calls", {}).get("kimi-k3", 0)


@it.test("cluster: a group budget that fits exactly 4 worst cases, 64 parallel requests over three instances: 4 "
         "served, 60 refused 403 budget_exceeded, 4 calls upstream; the store's spend is the sum of the answers' "
         "costs, nothing held after, and every instance shows it")
def t_cluster_budget_parallel():
    with cluster("budget") as (r, auxes):
        m = 2000
        body = traffic.body_off5(mock="head_delay_ms=300 events=%d" % m, max_tokens=m)
        worst = traffic.worst_micro(body, m)
        gid, token = group_key(auxes[0], max_budget=(4 * worst + 1) / 1e6, budget_duration="1d")
        everywhere(gid, auxes)
        before = kimi_calls()
        rs = spread(auxes, 64, token, body)
        ok = [x for x in rs if x.status == 200]
        check(len(ok) == 4, "served %d of 64, want 4: %r" % (len(ok), sorted(set(x.status for x in rs))))
        for x in rs:
            if x.status != 200:
                it.check_openai_error(x, 403, "budget_exceeded")
                check("the budget of this key's group" in x.json()["error"]["message"], "the refusal: %r" % x.body[:300])
        check(kimi_calls() - before == 4, "the provider saw %d calls, want 4" % (kimi_calls() - before))
        costs = [traffic.micro(x.header("x-ltg-cost")) for x in ok]
        check(all(0 < c < worst for c in costs), "costs %r, each under the worst case %d" % (costs, worst))
        it.wait_until(lambda: "the store's spend %r, want %d nano-USD and nothing held" % (r.budget("g:" + gid), sum(costs) * 1000),
                      lambda: r.budget("g:" + gid) == {"p": r.budget("g:" + gid).get("p"), "spent": sum(costs) * 1000, "held": 0},
                      10 * it.SLOW, 0.1)
        check(sum(costs) <= 4 * worst + 1, "spent %d over the budget %d" % (sum(costs), 4 * worst + 1))
        x = it.one_request(auxes[2].port, "POST", "/v1/chat/completions", body, auth=token)
        it.check_openai_error(x, 403, "budget_exceeded")
        check(kimi_calls() - before == 4, "a refused request reached the provider")


@it.test("cluster: rpm_limit 10 under 64 parallel requests over three instances: exactly 10 served, 54 refused 429 "
         "rate_limited with Retry-After; max_parallel_requests 3: 3 served at once, the others 429; tpm_limit of 5 worst "
         "cases: 5 served; the three ledgers the same")
def t_cluster_rpm_parallel():
    with cluster("rpm") as (_, auxes):
        gid, token = group_key(auxes[0], rpm_limit=10)
        pgid, ptoken = group_key(auxes[0], max_parallel_requests=3)
        everywhere(pgid, auxes)
        before = kimi_calls()
        rs = spread(auxes, 64, token, it.chat_body(directive="head_delay_ms=300"))
        st = sorted(x.status for x in rs)
        check(st.count(200) == 10 and st.count(429) == 54, "rpm_limit 10: %r" % st)
        for x in rs:
            if x.status == 429:
                traffic.check_limited(x, "a refused request")
        check(kimi_calls() - before == 10, "the provider saw %d calls, want 10" % (kimi_calls() - before))
        rs = spread(auxes, 30, ptoken, it.chat_body(directive="head_delay_ms=1500"))
        st = sorted(x.status for x in rs)
        check(st.count(200) == 3 and st.count(429) == 27, "max_parallel_requests 3: %r" % st)
        for x in rs:
            if x.status == 429:
                it.check_openai_error(x, 429, "too_many_parallel_requests")
        # A slot goes when the store applies the request's settle, a moment after its answer.
        it.wait_until("a request once the three are done is served",
                      lambda: it.one_request(auxes[1].port, "POST", "/v1/chat/completions", it.chat_body(), auth=ptoken).status == 200,
                      5 * it.SLOW, 0.05)
        # tpm_limit: the worst cases held at once never pass it, whichever instance holds them.
        body = it.chat_body(directive="head_delay_ms=1000", max_tokens=300)
        worst = traffic.worst_tokens(body, 300)
        tgid, ttoken = group_key(auxes[0], tpm_limit=worst * 5 + worst // 2)
        everywhere(tgid, auxes)
        before = kimi_calls()
        rs = spread(auxes, 64, ttoken, body)
        st = sorted(x.status for x in rs)
        check(st.count(200) == 5 and st.count(429) == 59, "tpm_limit of 5 worst cases: %r" % st)
        check(kimi_calls() - before == 5, "the provider saw %d calls, want 5" % (kimi_calls() - before))
        traffic.check_limited([x for x in rs if x.status == 429][0], "over the tpm_limit")
        # Settled with the real usage, a few tokens each: the minute has room again.
        it.wait_until("a request fits again once the five are settled", lambda: it.one_request(
            auxes[2].port, "POST", "/v1/chat/completions", body, auth=ttoken).status == 200, 10 * it.SLOW, 0.1)
        same_ledgers(auxes, 10 + 3 + 1 + 5 + 1)


@it.test("cluster: a fallback's attempt is held in the store too, against what the first really spent: a budget that "
         "fits one worst case, a 503 on the first model (nothing charged), the fallback served; the store's spend is the "
         "answer's cost, nothing held after")
def t_cluster_fallback_hold():
    with cluster("fallback", n=1) as (r, (a,)):
        body = traffic.body_off5(max_tokens=1000)
        worst = traffic.worst_micro(body, 1000)     # Kimi-K3's; GLM-5.3-Flash's is lower
        d = it.create_group({"name": "fb-" + it.new_idem(), "allowed_models": ["Kimi-K3", "GLM-5.3-Flash"],
                             "fallbacks": {"Kimi-K3": ["GLM-5.3-Flash"]}, "max_budget": (worst + 1) / 1e6,
                             "budget_duration": "1d"}, port=a.admin_port)
        token = it.create_key(d["id"], port=a.admin_port)[1]
        it.H.mock_post("/_mock/script", {"model": "kimi-k3", "steps": ["status=503"]})
        x = it.one_request(a.port, "POST", "/v1/chat/completions", body, auth=token)
        check(x.status == 200 and x.header("x-ltg-served-model") == "GLM-5.3-Flash" and x.header("x-ltg-attempts") == "2",
              "served by the fallback after one attempt: %s %r %r" % (x.brief(), x.header("x-ltg-served-model"), x.header("x-ltg-attempts")))
        cost = traffic.micro(x.header("x-ltg-cost"))
        it.wait_until(lambda: "the store: %r, want spent %d" % (r.budget("g:" + d["id"]), cost * 1000),
                      lambda: r.budget("g:" + d["id"]).get("spent") == cost * 1000 and r.budget("g:" + d["id"]).get("held") == 0,
                      10 * it.SLOW, 0.1)


@it.test("cluster: an instance SIGKILLed with a request in flight: its hold runs out within 30 s, and the budget it "
         "held is free again on the other instance")
def t_cluster_killed_lease():
    with cluster("kill", n=2) as (r, (a, b)):
        m = 2000
        slow = traffic.body_off5(mock="head_delay_ms=60000 events=%d" % m, max_tokens=m)
        body = traffic.body_off5(mock="events=%d" % m, max_tokens=m)
        worst = max(traffic.worst_micro(slow, m), traffic.worst_micro(body, m))
        gid, token = group_key(a, max_budget=(worst + 1) / 1e6, budget_duration="1d")
        it.wait_until("the other instance has the key", lambda: it.admin("GET", "/token_groups/" + gid, port=b.admin_port).status == 200,
                      5 * it.SLOW, 0.05)
        threading.Thread(target=lambda: _quiet(lambda: it.one_request(a.port, "POST", "/v1/chat/completions", slow, auth=token, timeout=90)),
                         daemon=True).start()
        it.wait_until("the slow request is held", lambda: r.budget("g:" + gid).get("held", 0) > 0, 10 * it.SLOW, 0.05)
        a.kill()
        t0 = time.monotonic()
        x = it.one_request(b.port, "POST", "/v1/chat/completions", body, auth=token)
        it.check_openai_error(x, 403, "budget_exceeded")
        it.wait_until("the dead instance's hold runs out", lambda: it.one_request(b.port, "POST", "/v1/chat/completions", body,
                      auth=token).status == 200, 30 * it.SLOW, 1.0)
        check(time.monotonic() - t0 <= 30 * it.SLOW, "freed after %.1f s" % (time.monotonic() - t0))
        a.start()       # the killed request left no event; the other's reaches the restarted one too
        wait_ready(a)
        same_ledgers((a, b), 1)


def ledger_of(a):
    """Every spend event a instance answers for, yesterday to tomorrow, in its order."""
    import datetime
    today = datetime.datetime.now(datetime.timezone.utc).date()
    q = "start_date=%s&end_date=%s&page[size]=1000" % (today - datetime.timedelta(days=1), today + datetime.timedelta(days=2))
    return it.check_admin_ok(it.admin("GET", "/spend/events?" + q, port=a.admin_port), 200)["data"]


def same_ledgers(auxes, n):
    """Wait until every instance answers for n events, then check they are the same, in the same order, and
    their segment files byte for byte: the events."""
    it.wait_until(lambda: "every instance has the %d events: %r" % (n, [len(ledger_of(a)) for a in auxes]),
                  lambda: all(len(ledger_of(a)) == n for a in auxes), 15 * it.SLOW, 0.1)
    first = ledger_of(auxes[0])
    ids = [e["id"] for e in first]
    check(len(set(ids)) == n, "an event twice: %r" % ids)
    for a in auxes[1:]:
        check(ledger_of(a) == first, "%s answers other events than %s" % (a.tag, auxes[0].tag))
    for a in auxes:
        check(not a.text_since(0).count("not an event of ltg's"), "%s skipped an event" % a.tag)
    days = sorted(f for f in os.listdir(os.path.join(auxes[0].data_dir, "ledger")) if f.endswith(".log"))
    for d in days:
        blobs = [open(os.path.join(a.data_dir, "ledger", d), "rb").read() for a in auxes]
        check(all(b == blobs[0] for b in blobs), "the segment %s differs between instances" % d)
    return first


@it.test("cluster: one ledger: requests served by three instances, with and without a budget, are the same events "
         "in the same order on every instance (their segment files byte for byte), each once; /usage/summary and a "
         "group's spend are the same everywhere and equal the answers' costs")
def t_cluster_one_ledger():
    import datetime
    with cluster("ledger") as (r, auxes):
        free_gid, free = group_key(auxes[0])
        capped_gid, capped = group_key(auxes[0], max_budget=5, budget_duration="1d")
        everywhere(capped_gid, auxes)
        costs = {free_gid: 0, capped_gid: 0}
        for i in range(12):
            gid, token = (free_gid, free) if i % 2 else (capped_gid, capped)
            x = it.one_request(auxes[i % 3].port, "POST", "/v1/chat/completions", it.chat_body(), auth=token)
            check(x.status == 200, "request %d: %s" % (i, x.brief()))
            costs[gid] += traffic.micro(x.header("x-ltg-cost"))
        events = same_ledgers(auxes, 12)
        at = [e["created_at"] for e in events]
        check(at == sorted(at) or at == sorted(at, reverse=True), "created_at out of order: %r" % at)
        today = datetime.datetime.now(datetime.timezone.utc).date()
        for gid in (free_gid, capped_gid):
            q = "/usage/summary?token_group_id=%s&start_date=%s&end_date=%s" % (gid, today - datetime.timedelta(days=1),
                                                                              today + datetime.timedelta(days=2))
            sums = [it.admin("GET", q, port=a.admin_port).body for a in auxes]
            check(all(s == sums[0] for s in sums), "/usage/summary differs between instances: %r" % sums)
            it.wait_until(lambda gid=gid: "every instance shows the group's spend %d micro-USD: %r" % (
                              costs[gid], [it.get_group(gid, port=a.admin_port)[0].get("spend") for a in auxes]),
                          lambda gid=gid: all(traffic.micro(str(it.get_group(gid, port=a.admin_port)[0]["spend"])) == costs[gid]
                                              for a in auxes), 5 * it.SLOW, 0.1)


@it.test("cluster: Redis stopped: requests of an uncapped group are served and their events kept; Redis back: every "
         "instance's ledger has each of them once, and the same; an instance SIGKILLed with events not shipped sends "
         "them when it starts again, and those already shipped are not counted twice")
def t_cluster_ledger_outage():
    with cluster("outage") as (r, (a, b, c)):
        _, free = group_key(a)
        it.wait_until("the others have the key", lambda: all(it.one_request(x.port, "POST", "/v1/chat/completions", it.chat_body(),
                      auth=free).status == 200 for x in (b, c)), 5 * it.SLOW, 0.05)
        n = len(same_ledgers((a, b, c), 2))
        r.stop()
        it.wait_until("/readyz 503 once Redis is gone", lambda: not ready(a) and not ready(c), 10 * it.SLOW, 0.05)
        for x in (a, a, b, c, c, c):
            y = it.one_request(x.port, "POST", "/v1/chat/completions", it.chat_body(), auth=free)
            check(y.status == 200, "an uncapped group while Redis is down: %s" % y.brief())
        m = it.one_request(c.admin_port, "GET", "/metrics", auth=None).body.decode()
        check("\nltg_cluster_unsettled 3\n" in m, "three events wait in the outbox: %r"
              % [l for l in m.splitlines() if l.startswith("ltg_cluster_unsettled")])
        c.kill()        # with three events not shipped, and the two before in its outbox file
        r.start()
        for x in (a, b):
            wait_ready(x, 15)
        c.start()
        wait_ready(c, 15)
        same_ledgers((a, b, c), n + 6)
        check("settle(s) of an earlier run found" in c.text_since_start(),
              "the restarted instance tells of its outbox: %r" % c.text_since_start()[-600:])
        outbox = sorted(os.listdir(os.path.join(c.data_dir, "outbox")))
        check(len(outbox) <= 1, "the outbox files of the earlier run are gone once shipped: %r" % outbox)


@it.test("cluster: Sentinel: a primary with a replica (min-replicas-to-write 1) and a Sentinel; the replica paused: "
         "the lone primary refuses writes, so a budgeted request is 503 and an uncapped one is served, its event "
         "shipped once the replica is back; the primary killed: the Sentinel promotes the replica, both instances find "
         "it by themselves, and nothing acknowledged is lost")
def t_cluster_sentinel():
    import signal
    primary = Redis("s-primary", ["--min-replicas-to-write", "1", "--min-replicas-max-lag", "2"]).start()
    replica = Redis("s-replica", ["--replicaof", "127.0.0.1", str(primary.port), "--repl-diskless-sync-delay", "0"]).start()
    sport = it.free_ports(1)[0]
    sdir = os.path.join(it.H.tmp, "sentinel")
    os.makedirs(sdir, exist_ok=True)
    conf = os.path.join(sdir, "sentinel.conf")
    with open(conf, "w") as f:
        f.write("port %d\nbind 127.0.0.1\ndir %s\nlogfile %s\n" % (sport, sdir, os.path.join(sdir, "sentinel.log")) +
                "sentinel monitor ltg 127.0.0.1 %d 1\n" % primary.port +
                "sentinel down-after-milliseconds ltg 1000\nsentinel failover-timeout ltg 5000\n")
    sentinel = subprocess.Popen([primary.bin, conf, "--sentinel"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    url = "sentinel://127.0.0.1:%d/ltg" % sport
    auxes = [it.Aux("cl-sent-%d-%s" % (i, os.urandom(2).hex()), args=["--cluster", url]) for i in range(2)]
    a, b = auxes
    try:
        # (the primary's full sync waits its repl-diskless-sync-delay, 5 s by default: a wide deadline)
        it.wait_until("the replica in sync", lambda: "master_link_status:up" in "".join(replica.cmd("INFO", "replication", whole=True)),
                      30 * it.SLOW, 0.1)
        for x in auxes:
            x.start()
        for x in auxes:
            wait_ready(x, 15)
        check("Sentinel 127.0.0.1:%d says the primary of ltg is 127.0.0.1:%d" % (sport, primary.port) in a.text_since_start(),
              "ltg's log names the primary the Sentinel gave: %r" % a.text_since_start()[-600:])
        gid, capped = group_key(a, max_budget=5, budget_duration="1d")
        _, free = group_key(a)
        everywhere(gid, (b,))
        x = it.one_request(b.port, "POST", "/v1/chat/completions", it.chat_body(), auth=capped)
        check(x.status == 200, "a budgeted request: %s" % x.brief())
        same_ledgers(auxes, 1)
        # The replica paused: the primary refuses writes within min-replicas-max-lag.
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            it.wait_until("the primary refuses writes", lambda: primary.cmd("SET", "ltg:probe", "1").startswith("-NOREPLICAS"),
                          15 * it.SLOW, 0.2)
            before = kimi_calls()
            x = it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body(), auth=capped)
            it.check_openai_error(x, 503, "store_unavailable")
            check(kimi_calls() == before, "a budgeted request reached the provider while the primary refused writes")
            r = it.admin("PATCH", "/token_groups/" + gid, {"name": "lone"}, if_match=1, port=a.admin_port)
            it.check_admin_error(r, 503, "storage_unavailable", what="a PATCH while the primary refuses writes")
            x = it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body(), auth=free)
            check(x.status == 200, "an uncapped request: %s" % x.brief())
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        same_ledgers(auxes, 2)
        r = it.admin("PATCH", "/token_groups/" + gid, {"name": "before-failover"}, if_match=1, port=a.admin_port)
        it.check_admin_ok(r, 200, "a PATCH once the replica is back")
        it.wait_until("the replica has every event", lambda: replica.cmd("XLEN", "ltg:events") == primary.cmd("XLEN", "ltg:events")
                      and replica.cmd("XLEN", "ltg:log") == primary.cmd("XLEN", "ltg:log"), 10 * it.SLOW, 0.1)
        # The primary killed: the Sentinel promotes the replica, and both instances find it.
        primary.proc.kill()
        primary.proc.wait()
        primary.proc = None
        for x in auxes:
            it.wait_until(lambda x=x: "%s finds the new primary: %s" % (x.tag, x.text_since_start()[-800:]),
                          lambda x=x: ("says the primary of ltg is 127.0.0.1:%d" % replica.port) in x.text_since_start() and ready(x),
                          40 * it.SLOW, 0.2)
        d, v = it.get_group(gid, port=b.admin_port)
        check(v == 2 and d["name"] == "before-failover", "the acknowledged change: version %d name %r" % (v, d["name"]))
        r = it.admin("PATCH", "/token_groups/" + gid, {"name": "after-failover"}, if_match=2, port=b.admin_port)
        it.check_admin_ok(r, 200, "a PATCH on the new primary")
        it.wait_until("the other instance shows it", lambda: it.get_group(gid, port=a.admin_port)[1] == 3, 5 * it.SLOW, 0.05)
        x = it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body(), auth=capped)
        check(x.status == 200, "a budgeted request on the new primary: %s" % x.brief())
        same_ledgers(auxes, 3)
        for x in auxes:
            x.stop()
    finally:
        for x in auxes:
            x.close()
        sentinel.terminate()
        sentinel.wait(10)
        replica.stop()
        primary.stop()


@it.test("cluster: a Sentinel with a password: without --cluster-sentinel-password-env ltg is refused and says so; "
         "with it, ltg finds the primary. A Sentinel that names a host that is not one (a newline in it) is not "
         "followed, and what it sent is logged escaped")
def t_cluster_sentinel_auth():
    import socket
    primary = Redis("sa-primary").start()
    sport = it.free_ports(1)[0]
    sdir = os.path.join(it.H.tmp, "sentinel-auth")
    os.makedirs(sdir, exist_ok=True)
    conf = os.path.join(sdir, "sentinel.conf")
    with open(conf, "w") as f:
        f.write("port %d\nbind 127.0.0.1\ndir %s\nlogfile %s\nrequirepass sentinel-secret\n"
                % (sport, sdir, os.path.join(sdir, "sentinel.log")) + "sentinel monitor ltg 127.0.0.1 %d 1\n" % primary.port)
    sentinel = subprocess.Popen([primary.bin, conf, "--sentinel"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    url = "sentinel://127.0.0.1:%d/ltg" % sport
    # A fake Sentinel: whatever it is asked, it names "evil\nhost" as the primary.
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen(8)
    fake.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                c, _ = fake.accept()
            except socket.timeout:
                continue
            with c:
                c.settimeout(2)
                try:
                    if c.recv(4096):
                        c.sendall(b"*2\r\n$9\r\nevil\nhost\r\n$4\r\n6379\r\n")
                except OSError:
                    pass
    th = threading.Thread(target=serve, daemon=True)
    th.start()
    auxes = [it.Aux("cl-sa-none-" + os.urandom(2).hex(), args=["--cluster", url]),
             it.Aux("cl-sa-pw-" + os.urandom(2).hex(), args=["--cluster", url, "--cluster-sentinel-password-env",
                                                             "LTG_IT_SENTINEL_PW"],
                    env=dict(it.H.env, LTG_IT_SENTINEL_PW="sentinel-secret")),
             it.Aux("cl-sa-evil-" + os.urandom(2).hex(), args=["--cluster", "sentinel://127.0.0.1:%d/ltg" % fake.getsockname()[1]])]
    none, pw, evil = auxes
    try:
        it.wait_until("the Sentinel answering", lambda: subprocess.run(
            ["redis-cli", "-p", str(sport), "-a", "sentinel-secret", "--no-auth-warning", "PING"], capture_output=True,
            text=True).stdout.strip() == "PONG", 10 * it.SLOW, 0.1)
        for x in auxes:
            x.start()
        wait_ready(pw, 15)
        check("says the primary of ltg is 127.0.0.1:%d" % primary.port in pw.text_since_start(), "with the password: %r"
              % pw.text_since_start()[-400:])
        it.wait_until(lambda: "without the password, ltg says it was refused: %r" % none.text_since_start()[-400:],
                      lambda: "NOAUTH" in none.text_since_start() or "Authentication required" in none.text_since_start(),
                      10 * it.SLOW, 0.1)
        check(not ready(none), "an instance the Sentinel refused is not ready")
        it.wait_until(lambda: "the fake Sentinel's host is refused: %r" % evil.text_since_start()[-400:],
                      lambda: "not a host name or address: evil\\x0ahost" in evil.text_since_start(), 10 * it.SLOW, 0.1)
        check(not any(l.startswith("host") for l in evil.text_since_start().split("\n")), "a log line began with what the "
              "Sentinel sent after its newline")
        check(not ready(evil), "an instance that was named a bad host is not ready")
        for x in auxes:
            x.stop()
    finally:
        stop.set()
        th.join(5)
        fake.close()
        for x in auxes:
            x.close()
        sentinel.terminate()
        sentinel.wait(10)
        primary.stop()


@it.test("cluster: an instance that has not heard from Redis for --cluster-stale-after refuses even uncapped requests "
         "(503 store_unavailable: a key revoked meanwhile could not be refused), and serves again once it hears")
def t_cluster_stale():
    with cluster("stale", n=1, args=["--cluster-stale-after", "2"]) as (r, (a,)):
        _, free = group_key(a)
        check(it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body(), auth=free).status == 200, "served")
        r.stop()
        served = [1]

        def refused():
            st = it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body(), auth=free).status
            served[0] += st == 200      # until stale, served (its event kept for Redis's return)
            return st == 503
        it.wait_until("refused once stale", refused, 10 * it.SLOW, 0.2)
        before = kimi_calls()
        x = it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body(), auth=free)
        it.check_openai_error(x, 503, "store_unavailable")
        check("has not heard from the shared store" in x.json()["error"]["message"], "the message: %r" % x.body[:300])
        check(kimi_calls() == before, "a refused request reached the provider")
        r.start()
        wait_ready(a, 15)
        check(it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body(), auth=free).status == 200, "served again")
        same_ledgers((a,), served[0] + 1)


def _quiet(fn):
    try:
        fn()
    except Exception:
        pass            # its instance was killed under it


@it.test("cluster: the store holds what is live, not history: ltg:log is trimmed to what every instance applied, a "
         "deleted group's versions and counts (and its keys') leave it; a new instance on a trimmed log serves nothing "
         "and says to copy a peer's state log, and with that copy it joins")
def t_cluster_trim():
    import shutil
    with cluster("trim", n=2) as (r, (a, b)):
        gid, token = group_key(a, max_budget=5, budget_duration="1d")
        kid = it.admin("GET", "/token_keys?token_group_id=" + gid, port=a.admin_port).json()["data"][0]["id"]
        x = it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body(), auth=token)
        check(x.status == 200, "a request of the group: %s" % x.brief())
        for i in range(5):
            it.create_group(port=b.admin_port)
        it.wait_until(lambda: "ltg:log trimmed to its last record: XLEN %s" % r.cmd("XLEN", "ltg:log"),
                      lambda: r.cmd("XLEN", "ltg:log") == ":1", 15 * it.SLOW, 0.2)
        check(r.cmd("HEXISTS", "ltg:ver", kid) == ":1" and r.cmd("EXISTS", "ltg:b:g:" + gid) == ":1",
              "the live group's version and counts are there")
        it.check_admin_ok(it.admin("DELETE", "/token_groups/" + gid, if_match=1, port=a.admin_port), 200)
        for k in ("ltg:b:g:" + gid, "ltg:b:k:" + kid, "ltg:r:g:" + gid):
            check(r.cmd("EXISTS", k) == ":0", "%s is still in the store after the group's deletion" % k)
        for i in (gid, kid):
            check(r.cmd("HEXISTS", "ltg:ver", i) == ":0", "the deleted %s's version is still in ltg:ver" % i)
        late = it.Aux("cl-trim-late-" + os.urandom(2).hex(), args=["--cluster", r.url])
        try:
            late.start()
            it.wait_until("the late instance says it missed changes", lambda: "trimmed past" in late.text_since_start(),
                          10 * it.SLOW, 0.05)
            rd = it.one_request(late.admin_port, "GET", "/readyz", auth=None)
            check(rd.status == 503 and "missed changes" in rd.json().get("detail", ""), "/readyz: %s" % rd.brief())
            late.stop()
            os.makedirs(late.data_dir, exist_ok=True)
            shutil.copy(os.path.join(b.data_dir, "state.log"), os.path.join(late.data_dir, "state.log"))
            late.start()
            wait_ready(late)
            names = sorted(g["name"] for g in it.check_admin_ok(it.admin("GET", "/token_groups", port=late.admin_port), 200)["data"])
            want = sorted(g["name"] for g in it.check_admin_ok(it.admin("GET", "/token_groups", port=b.admin_port), 200)["data"])
            check(names == want, "with a peer's state log: %r, want %r" % (names, want))
            late.stop()
        finally:
            late.close()


@it.test("cluster: an Idempotency-Key is claimed in the store: answered on one instance, replayed by the others "
         "(one call upstream, one event), 409 idempotency_conflict with another body; sent to two instances at once, "
         "one runs it and the other answers 409 idempotency_in_flight; a cached answer is not copied: a retry on another "
         "instance runs again")
def t_cluster_idempotency():
    with cluster("idem") as (_, (a, b, c)):
        gid, free = group_key(a)
        everywhere(gid, (b, c))
        before = kimi_calls()
        body = it.chat_body()
        first = it.one_request(a.port, "POST", "/v1/chat/completions", body, headers={"Idempotency-Key": "cl-inf-1"}, auth=free)
        check(first.status == 200, "the first request: %s" % first.brief())
        for x in (b, c, a):
            it.wait_until(lambda x=x: "%s replays the answer" % x.tag, lambda x=x: it.one_request(
                x.port, "POST", "/v1/chat/completions", body, headers={"Idempotency-Key": "cl-inf-1"}, auth=free).status == 200,
                5 * it.SLOW, 0.05)
            y = it.one_request(x.port, "POST", "/v1/chat/completions", body, headers={"Idempotency-Key": "cl-inf-1"}, auth=free)
            check(y.header("x-ltg-replayed") == "true" and y.body == first.body, "%s: %s %r" % (x.tag, y.brief(), y.header("x-ltg-replayed")))
        check(kimi_calls() - before == 1, "the provider saw %d calls, want 1" % (kimi_calls() - before))
        y = it.one_request(c.port, "POST", "/v1/chat/completions", it.chat_body(content="another"), headers={"Idempotency-Key": "cl-inf-1"},
                           auth=free)
        it.check_openai_error(y, 409, "idempotency_conflict")
        check(len([e for e in same_ledgers((a, b, c), 1)]) == 1, "one event")
        # Two instances at once: one runs it.
        slow = it.chat_body(directive="head_delay_ms=1500")
        out = [None, None]

        def one(i, x):
            out[i] = it.one_request(x.port, "POST", "/v1/chat/completions", slow, headers={"Idempotency-Key": "cl-inf-2"}, auth=free)
        before = kimi_calls()
        ths = [threading.Thread(target=one, args=(0, b)), threading.Thread(target=one, args=(1, c))]
        ths[0].start()
        # b has claimed the key once its call reaches the provider: only then does c send the same.
        it.wait_until("the first instance's call reaching the provider", lambda: kimi_calls() - before >= 1, 10 * it.SLOW, 0.02)
        ths[1].start()
        for t in ths:
            t.join(60)
        st = sorted(x.status for x in out)
        check(st == [200, 409], "statuses %r, want one 200 and one 409" % st)
        it.check_openai_error([x for x in out if x.status == 409][0], 409, "idempotency_in_flight")
        check(kimi_calls() - before == 1, "the provider saw %d calls, want 1" % (kimi_calls() - before))
        it.wait_until("the other instance replays it", lambda: it.one_request(c.port, "POST", "/v1/chat/completions", slow,
                      headers={"Idempotency-Key": "cl-inf-2"}, auth=free).header("x-ltg-replayed") == "true", 5 * it.SLOW, 0.05)
        same_ledgers((a, b, c), 2)
        # A cached answer is not copied into its event (as on one instance): its key's claim goes with
        # the event, and a retry on an instance whose cache lacks the answer runs again.
        cgid, cached = group_key(a, cache_ttl=600)
        everywhere(cgid, (b, c))
        x = it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body(content="cache me"), auth=cached)
        hit = it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body(content="cache me"),
                             headers={"Idempotency-Key": "cl-inf-3"}, auth=cached)
        check(x.status == 200 and hit.header("x-ltg-cache") == "hit", "a cache hit: %s %r" % (hit.brief(), hit.header("x-ltg-cache")))
        same_ledgers((a, b, c), 4)
        before = kimi_calls()
        y = it.one_request(b.port, "POST", "/v1/chat/completions", it.chat_body(content="cache me"),
                           headers={"Idempotency-Key": "cl-inf-3"}, auth=cached)
        check(y.status == 200 and y.header("x-ltg-replayed") is None and y.header("x-ltg-cache") == "miss" and
              kimi_calls() - before == 1, "the retry on another instance runs again: %s %r" % (y.brief(), y.header("x-ltg-cache")))


def redis_send(r, *args):
    """One command of any size on a connection of its own: the reply's first line."""
    import socket
    with socket.create_connection(("127.0.0.1", r.port), timeout=30) as s:
        parts = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else a.encode()
            parts += [b"$%d\r\n" % len(a), a, b"\r\n"]
        s.sendall(b"".join(parts))
        return s.recv(65536).split(b"\r\n")[0].decode()


def metric(a, name):
    text = it.one_request(a.admin_port, "GET", "/metrics", auth=None).body.decode()
    for line in text.split("\n"):
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


@it.test("cluster: events too large for a small reader never wedge the stream: an idempotent 6 MiB answer is "
         "kept, read by every instance and replayed by another; an entry of 17 MiB that no instance writes, in "
         "ltg:events and in ltg:log, is skipped, said and counted, and what follows it is read")
def t_cluster_large_events():
    with cluster("large", n=2) as (r, (a, b)):
        gid, free = group_key(a)
        everywhere(gid, (b,))
        body = it.chat_body(directive="content_kb=6144")
        first = it.one_request(a.port, "POST", "/v1/chat/completions", body, headers={"Idempotency-Key": "cl-big-1"},
                               auth=free, timeout=60)
        check(first.status == 200 and len(first.body) > 6 << 20, "the 6 MiB answer: %s" % first.brief())
        same_ledgers((a, b), 1)
        y = it.one_request(b.port, "POST", "/v1/chat/completions", body, headers={"Idempotency-Key": "cl-big-1"},
                           auth=free, timeout=60)
        check(y.header("x-ltg-replayed") == "true" and y.body == first.body, "another instance replays it: %s" % y.brief())
        # Entries no instance writes, each larger than a reader takes: skipped, and the streams read on.
        check(redis_send(r, "XADD", "ltg:events", "*", "e", b"x" * (17 << 20)).startswith("$"), "XADD to ltg:events")
        check(redis_send(r, "XADD", "ltg:log", "*", "r", b"{" + b" " * (17 << 20) + b"}").startswith("$"), "XADD to ltg:log")
        x = it.one_request(b.port, "POST", "/v1/chat/completions", it.chat_body(), auth=free)
        check(x.status == 200, "a request after them: %s" % x.brief())
        same_ledgers((a, b), 2)
        gid2 = it.create_group(port=b.admin_port, allowed_models=["Kimi-K3"])["id"]
        everywhere(gid2, (a, b))
        for z in (a, b):
            it.wait_until("%s counts the two skipped entries" % z.tag,
                          lambda z=z: metric(z, "ltg_cluster_skipped_total") == 2, 10 * it.SLOW, 0.1)
            text = z.text_since_start()
            check("of ltg:events is %d bytes in 2 fields, more than ltg reads" % ((17 << 20) + 1) in text and
                  "of ltg:log is" in text, "%s says what it skipped: %r" % (z.tag, text[-800:]))
            check(ready(z), "%s is ready" % z.tag)


class Injector:
    """A RESP proxy between ltg and a real Redis that answers the next settles it is told to with an
    error of its own, in their place in the pipeline, and forwards every other command. An injected
    error is held until a later settle has been forwarded and applied by Redis, so that the settle
    after the refused one is always in the same pipeline: the case to test."""

    def __init__(self, redis):
        import socket
        self.redis_port = redis.port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.errors = []            # the errors for the next settles, in order
        self.injected = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.accept, daemon=True)]
        self.threads[0].start()

    @property
    def url(self):
        return "redis://127.0.0.1:%d" % self.port

    def accept(self):
        import socket
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except socket.timeout:
                continue
            up = socket.create_connection(("127.0.0.1", self.redis_port))
            slots, later = [], threading.Condition()
            for fn in (self.client_side, self.server_side):
                th = threading.Thread(target=fn, args=(c, up, slots, later), daemon=True)
                th.start()
                self.threads.append(th)

    @staticmethod
    def element(f):
        """One RESP element read from file f, as its raw bytes and, for an array, its items' texts."""
        line = f.readline()
        if not line:
            raise EOFError
        raw, items = line, []
        if line[:1] == b"$" and int(line[1:]) >= 0:
            data = f.read(int(line[1:]) + 2)
            raw += data
            items.append(data[:-2])
        elif line[:1] == b"*" and int(line[1:]) > 0:
            for _ in range(int(line[1:])):
                r, i = Injector.element(f)
                raw += r
                items += i[:1]
        return raw, items

    def client_side(self, c, up, slots, later):
        f = c.makefile("rb")
        try:
            while True:
                raw, items = self.element(f)
                settle = len(items) > 1 and items[0].upper() == b"FCALL" and items[1].startswith(b"ltg_settle_")
                with self.lock:
                    err = self.errors.pop(0) if settle and self.errors else None
                with later:
                    if err:
                        slots.append(("error", err))
                    else:
                        up.sendall(raw)
                        slots.append(("settle" if settle else "redis", None))
                    later.notify_all()
        except (EOFError, OSError, ValueError):
            pass
        finally:
            up.close()

    def server_side(self, c, up, slots, later):
        f = up.makefile("rb")
        try:
            while True:
                with later:
                    later.wait_for(lambda: slots or self.stop.is_set(), 1)
                    if not slots:
                        if self.stop.is_set():
                            return
                        continue
                    kind, err = slots[0]
                    if kind == "error":     # held until a later settle reached Redis (10 s at most)
                        later.wait_for(lambda: any(k == "settle" for k, _ in slots[1:]), 10)
                    slots.pop(0)
                if kind == "error":
                    c.sendall(b"-" + err.encode() + b"\r\n")
                    with self.lock:
                        self.injected += 1
                else:
                    c.sendall(self.element(f)[0])
        except (EOFError, OSError, ValueError):
            pass
        finally:
            c.close()

    def close(self):
        self.stop.set()
        self.sock.close()


@it.test("cluster: settles are exactly once when Redis refuses one in the middle of a pipeline and applies the next "
         "(NOREPLICAS, OOM, BUSY injected by a proxy between real replies): every charge and event is there once, "
         "nothing left held")
def t_cluster_settle_refused_midway():
    r = Redis("inject").start()
    proxy = Injector(r)
    a = it.Aux("cl-inject-" + os.urandom(2).hex(), args=["--cluster", proxy.url])
    try:
        a.start()
        wait_ready(a)
        gid, capped = group_key(a, max_budget=5, budget_duration="1d")
        _, free = group_key(a)      # its request needs no call before its settle: nothing waits behind
        cost, n = 0, 0
        for err in ("NOREPLICAS Not enough good replicas to write.",
                    "OOM command not allowed when used memory > 'maxmemory'.",
                    "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."):
            with proxy.lock:
                proxy.errors.append(err)
            for token in (capped, free):    # the first one's settle is refused, the second's is applied
                x = it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body(), auth=token)
                check(x.status == 200, "%s: %s" % (err.split()[0], x.brief()))
                cost += traffic.micro(x.header("x-ltg-cost")) if token == capped else 0
                n += 1
            it.wait_until("the %s injected" % err.split()[0], lambda: proxy.injected == n // 2, 15 * it.SLOW, 0.05)
            it.wait_until(lambda: "%d events in the ledger after %s: %d" % (n, err.split()[0], len(ledger_of(a))),
                          lambda: len(ledger_of(a)) == n, 15 * it.SLOW, 0.1)
        events = ledger_of(a)
        check(len(set(e["request_id"] for e in events)) == n, "an event twice: %r" % [e["request_id"] for e in events])
        it.wait_until(lambda: "the store charged %d nano-USD with nothing held: %r" % (cost * 1000, r.budget("g:" + gid)),
                      lambda: r.budget("g:" + gid).get("spent") == cost * 1000 and r.budget("g:" + gid).get("held") == 0,
                      15 * it.SLOW, 0.1)
        a.stop()
    finally:
        a.close()
        proxy.close()
        r.stop()


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def redis_memory(r):
    for line in r.cmd("INFO", "memory", whole=True):
        if line.startswith("used_memory:"):
            return int(line.split(":")[1])
    return 0


@it.test("cluster: a $0 cache hit with a fresh Idempotency-Key copies no answer into Redis or any ledger (20 hits of "
         "a 1.2 MB answer: under 1 MB more in each); a retry of one runs again (a cache hit on its instance)")
def t_cluster_cache_hits_no_copy():
    with cluster("cache", n=2) as (r, (a, b)):
        gid, cached = group_key(a, cache_ttl=600)
        everywhere(gid, (b,))
        body = it.chat_body(directive="content_kb=1200")
        x = it.one_request(a.port, "POST", "/v1/chat/completions", body, auth=cached, timeout=30)
        check(x.status == 200 and x.header("x-ltg-cache") == "miss", "the first call: %s" % x.brief())
        same_ledgers((a, b), 1)
        mem0, led0 = redis_memory(r), [dir_bytes(os.path.join(z.data_dir, "ledger")) for z in (a, b)]
        for i in range(20):
            h = it.one_request(a.port, "POST", "/v1/chat/completions", body, headers={"Idempotency-Key": "cl-hit-%d" % i},
                               auth=cached, timeout=30)
            check(h.status == 200 and h.header("x-ltg-cache") == "hit" and h.body == x.body, "hit %d: %s" % (i, h.brief()))
        same_ledgers((a, b), 21)
        grown = redis_memory(r) - mem0
        check(grown < 1 << 20, "Redis grew by %d bytes for 20 cache hits" % grown)
        for z, before in zip((a, b), led0):
            g = dir_bytes(os.path.join(z.data_dir, "ledger")) - before
            check(g < 1 << 20, "%s's ledger grew by %d bytes for 20 cache hits" % (z.tag, g))
        again = it.one_request(a.port, "POST", "/v1/chat/completions", body, headers={"Idempotency-Key": "cl-hit-0"},
                               auth=cached, timeout=30)
        check(again.status == 200 and again.header("x-ltg-cache") == "hit" and again.body == x.body,
              "a retry of a hit: %s %r" % (again.brief(), again.header("x-ltg-cache")))


@it.test("cluster: make cluster-demo's tour runs to its end: the budget admits exactly 5 of 30 calls spread by HAProxy, "
         "a stale If-Match is 412, a revoked key is 401 everywhere, Redis stopped and started again, the same 7 events on the "
         "three instances")
def t_cluster_demo():
    it.debian_tool("redis-server", "redis-server")
    it.debian_tool("haproxy", "haproxy")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PATH=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    p = subprocess.run(["bash", os.path.join(here, "cluster-demo.sh")], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, env=env, timeout=180 * it.SLOW)
    out = p.stdout.decode("utf-8", "replace")
    check(p.returncode == 0, "the demo exited %d: %s" % (p.returncode, out[-1500:]))
    for want in ("5 x HTTP 200", "25 x HTTP 403", "(HTTP 412: the same If-Match on instance 3)", "instance 3: HTTP 401",
                 "a call of the group with a budget: store_unavailable", "instance 1 /readyz: {\"status\":\"ready\"}"):
        check(want in out, "the demo's output lacks %r: %s" % (want, out[-2500:]))
    import re
    ledgers = re.findall(r"instance \d: (\d+) events, their ids hashed (\w+)", out)
    check(len(ledgers) == 3 and len(set(ledgers)) == 1 and ledgers[0][0] == "7",
          "the three ledgers of the demo: %r" % ledgers)


@it.test("cluster: a bad --cluster exits 2 and says what to fix")
def t_cluster_bad_url():
    for url, says in (("http://127.0.0.1:6379", "expected redis://"), ("redis://127.0.0.1:99999", "port"),
                      ("redis://127.0.0.1:6379/x", "database"), ("sentinel://127.0.0.1:26379", "MASTER_NAME"),
                      ("sentinel://127.0.0.1:0/ltg", "port")):
        a = it.Aux("cl-bad-" + os.urandom(2).hex(), args=["--cluster", url])
        try:
            rc, text = a.start_fails()
            check(rc == 2 and says in text, "--cluster %s: exit %r, %r" % (url, rc, text[-300:]))
        finally:
            a.close()
    for args, says in ((["--cluster", "rediss://127.0.0.1:6380"], "not supported"),
                       (["--cluster", "redis://127.0.0.1:1", "--cluster-sentinel-password-env", "HOME"], "no Sentinels")):
        a = it.Aux("cl-bad-" + os.urandom(2).hex(), args=args)
        try:
            rc, text = a.start_fails()
            check(rc == 2 and says in text, "%s: exit %r, %r" % (args, rc, text[-300:]))
        finally:
            a.close()
    a = it.Aux("cl-bad-pw-" + os.urandom(2).hex(), args=["--cluster", "redis://127.0.0.1:1", "--cluster-password-env", "LTG_NO_SUCH_VAR"])
    try:
        rc, text = a.start_fails()
        check(rc == 2 and "LTG_NO_SUCH_VAR" in text and "not set" in text, "an unset password variable: exit %r, %r" % (rc, text[-300:]))
    finally:
        a.close()
