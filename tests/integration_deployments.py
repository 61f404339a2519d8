"""Integration tests: deployments -- several routes behind one model alias (README "Deployments";
the catalog's models.ALIAS.deployments): the weighted choice (least in flight for its weight, ties
by smooth weighted round-robin), a no_work failure retried at once on another deployment while an
indeterminate one moves to the next model, circuit breakers per deployment, the deployment named in
the ledger's attempt_log and in error.attempts, ltg_circuit_open and ltg_deployment_in_flight per
deployment, /v1/responses follow-ups pinned to the deployment that made the response, and the
catalog's refusals of a bad deployments list.

tests/integration.py imports this file at start-up and runs its tests with the others; to run only
these:

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k deployments
    python3 tests/integration_deployments.py --ltg ./ltg --mock tests/mock

Isolation. These tests run on an ltg of their own (the harness's Aux: the same binary, its own
ports, --data and log), whose catalog is the harness's plus models reserved to this file, all
served by the harness's mock:

    Dep-W31      mock/dp-w31-a (weight 3), mock/dp-w31-b (weight 1)
    Dep-W532     mock/dp-w532-a (5), mock/dp-w532-b (3), mock/dp-w532-c (2)
    Dep-2P       mock/dp-2p-a, dep-mock2/dp-2p-b (default weights; dep-mock2 is a second provider
                 whose base_url is the same mock)
    Dep-P01...   a pool of 1:1 pairs mock/dp-pNN-a, mock/dp-pNN-b
    Dep-R1...    down/dp-rN-a (a loopback port that refuses connections), mock/dp-rN-b
    DP-FB-01...  plain models (provider mock, upstream dp-fb-NN), the fallbacks

Each test takes fresh models from the pools, so neither the mock's per-model scripts and counters
(calls are counted per upstream model name, which is how a test tells which deployment served) nor
ltg's per-deployment breakers and round-robin credits carry over from one test to another. Each
test provisions its own token group and key through that ltg's control plane. A deployment is
scripted with POST /_mock/script on its upstream name: a "mock" directive in the body would apply
to whichever deployment gets the request.

Choices that depend on the round-robin's order are never assumed: where a test needs the first
attempt on a given deployment it sends calls (at most a few) until one lands there, or scripts
both deployments alike so that whichever is chosen first behaves the same.

That ltg is started by the first test that needs it (again if it died) and stopped by the last test
of this file, which checks that it exits 0 on SIGTERM; every test also fails on a sanitizer report
written to its log during the test. Waits are bounded and generous (a slow, busy 2-core machine);
durations are asserted only where the contract is about time (a retry "at once" against a
Retry-After of 30 s), with seconds of slack.
"""

import datetime
import json
import re
import threading
import time

import integration as it

check = it.check

NPAIRS = 24          # Dep-P01..Dep-P24
NREFUSED = 4         # Dep-R1..Dep-R4
FALLBACKS = it.ModelPool("DP-FB-%02d", 12)  # DP-FB-01..DP-FB-12

_S = {"pair": 0, "refused": 0}


# ===== the dedicated ltg ==========================================================================

def dep(provider, upstream, weight=None):
    d = {"provider": provider, "upstream_model": upstream}
    if weight is not None:
        d["weight"] = weight
    return d


def dep_model(*deps, in_usd=0.50, out_usd=1.00):
    return {"deployments": list(deps), "input_usd_per_mtok": in_usd, "output_usd_per_mtok": out_usd}


def _catalog():
    cfg = it.catalog_copy()
    cfg["providers"]["dep-mock2"] = dict(cfg["providers"]["mock"])
    m = cfg["models"]
    m["Dep-W31"] = dep_model(dep("mock", "dp-w31-a", 3), dep("mock", "dp-w31-b", 1))
    m["Dep-W532"] = dep_model(dep("mock", "dp-w532-a", 5), dep("mock", "dp-w532-b", 3), dep("mock", "dp-w532-c", 2))
    m["Dep-2P"] = dep_model(dep("mock", "dp-2p-a"), dep("dep-mock2", "dp-2p-b"))
    for i in range(1, NPAIRS + 1):
        m["Dep-P%02d" % i] = dep_model(dep("mock", "dp-p%02d-a" % i), dep("mock", "dp-p%02d-b" % i))
    for i in range(1, NREFUSED + 1):
        m["Dep-R%d" % i] = dep_model(dep("down", "dp-r%d-a" % i), dep("mock", "dp-r%d-b" % i))
    FALLBACKS.add_to(cfg)
    return cfg


def _config_path():
    return it.catalog_file("deployments", _catalog)


_LTG = it.AuxSlot(lambda n: it.Aux("deployments-%d" % n, config=_config_path()))


def dtest(name):
    """Register a test ("deployments: " + name) that gets the dedicated ltg as its argument."""
    return _LTG.test("deployments: " + name, "the deployments ltg")


# ===== models, groups, calls ======================================================================

class Pair:
    """A model of two deployments: its alias, the upstream names a and b (what the mock counts),
    and the deployment names ltg logs (provider/upstream_model)."""

    def __init__(self, alias, a, b, prov_a="mock", prov_b="mock"):
        self.alias, self.a, self.b = alias, a, b
        self.dep = {a: "%s/%s" % (prov_a, a), b: "%s/%s" % (prov_b, b)}

    def other(self, up):
        return self.b if up == self.a else self.a


def fresh_pair():
    _S["pair"] += 1
    i = _S["pair"]
    check(i <= NPAIRS, "integration_deployments: the pool of pairs (NPAIRS=%d) is exhausted" % NPAIRS)
    return Pair("Dep-P%02d" % i, "dp-p%02d-a" % i, "dp-p%02d-b" % i)


def fresh_refused():
    _S["refused"] += 1
    i = _S["refused"]
    check(i <= NREFUSED, "integration_deployments: the pool of refused pairs (NREFUSED=%d) is exhausted" % NREFUSED)
    return Pair("Dep-R%d" % i, "dp-r%d-a" % i, "dp-r%d-b" % i, prov_a="down")


fb_up = it.ModelPool.upstream       # the upstream name the mock sees for a fallback


def group(a, models, fallbacks=None, retries=None):
    return it.provision(a, "deployments", models, fallbacks, retries)


def script(up, steps):
    it.H.mock_post("/_mock/script", {"model": up, "steps": list(steps)})


def calls(*ups):
    """The mock's call counts of these upstream names: one int, or a tuple for several."""
    c = it.H.mock_stats().get("calls", {})
    got = tuple(c.get(u, 0) for u in ups)
    return got[0] if len(got) == 1 else got


def mock_times(up):
    """The mock's t_ms of every call of this upstream model, in order."""
    return [e["t_ms"] for e in it.H.mock_stats().get("log", []) if e.get("model") == up]


def first_called(*ups):
    """Which of these upstream names the mock was called for first (its log is in arrival order)."""
    for e in it.H.mock_stats().get("log", []):
        if e.get("model") in ups:
            return e["model"]
    raise it.TestFailure("the mock's log has no call of %r" % (ups,))


def call(a, g, model, **kw):
    """One inference request to ltg `a` with group g's key; see it.timed_call (.elapsed in s)."""
    return it.timed_call(a.port, g.token, model, **kw)


def answered_by(r):
    """The upstream model that wrote a whole chat answer ("Hello from MODEL.")."""
    try:
        content = r.json()["choices"][0]["message"]["content"]
    except Exception:
        raise it.TestFailure("not a chat completion: %s" % r.brief())
    m = re.match(r"^Hello from (.+)\.$", content)
    check(m, "unexpected content %r" % content)
    return m.group(1)


def check_served(r, alias, up, attempts=1, what="the answer"):
    """A 200 for `alias` with `attempts` attempts, whose body was written by upstream model `up`."""
    it.check_x_headers(r, 200, attempts, alias, what)
    got = answered_by(r)
    check(got == up, "%s: answered by %r, want %r" % (what, got, up))


def check_attempt_list(att, expect, what):
    """att: the ledger's attempt_log or error.attempts. expect: [(model, deployment, attempt, status,
    outcome)], status None for any. Every entry has exactly model, deployment, attempt, status, span_id,
    outcome, ms, and error on a failed attempt."""
    check(isinstance(att, list), "%s: %r is not a list" % (what, att))
    brief = [(x.get("model"), x.get("deployment"), x.get("attempt"), x.get("status"), x.get("outcome"))
             if isinstance(x, dict) else x for x in att]
    brief = [(b[0], b[1], b[2], None if w[3] is None else b[3], b[4]) if isinstance(b, tuple) else b
             for b, w in zip(brief, expect)] + brief[len(expect):]
    check(brief == [tuple(w) for w in expect], "%s: %r, want %r" % (what, brief, [tuple(w) for w in expect]))
    for x in att:
        fields = {"model", "deployment", "attempt", "status", "outcome", "ms", "span_id", "api"} | ({"error"} if x["outcome"] != "ok" else set())
        fields |= it.ATTEMPT_BILL if set(x) & it.ATTEMPT_BILL else set()  # no bill yet: an attempt still metered (a live answer)
        check(set(x) == fields, "%s: entry %r: fields must be exactly %s" % (what, x, ", ".join(sorted(fields))))
        check(isinstance(x["ms"], int) and x["ms"] >= 0, "%s: entry %r: ms is not a whole number >= 0" % (what, x))
        if x["outcome"] == "circuit_open":
            check(x["status"] == 0 and x["ms"] == 0, "%s: a circuit_open entry has status 0 and ms 0: %r" % (what, x))


def check_fail(r, status, attempts, expect, code="upstream_error", what="the answer"):
    """ltg's own failure answer: OpenAI-shaped, error.code, error.attempts as expected."""
    it.check_x_headers(r, status, attempts, what=what)
    e = it.check_openai_error(r, status, code)
    check_attempt_list(e.get("attempts"), expect, what + ": error.attempts")
    return e


ledger_event = it.ledger_event


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric(a, name, **labels):
    """The value of the one sample of `name` whose labels are exactly `labels` (None if absent)."""
    text = it.one_request(a.admin_port, "GET", "/metrics", auth=None, timeout=30).body.decode("utf-8", "replace")
    found = []
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        lab, _, val = line[len(name) + 1:].rpartition("} ")
        if dict(_LABEL.findall(lab)) == labels:
            found.append(float(val))
    check(len(found) <= 1, "%s%r: %d samples" % (name, labels, len(found)))
    return found[0] if found else None


def check_metric(a, name, want, **labels):
    got = metric(a, name, **labels)
    check(got == want, "%s{%s} = %r, want %r" % (name, ",".join('%s="%s"' % kv for kv in sorted(labels.items())), got, want))


def first_on(a, g, p, up, n=4, **kw):
    """Send calls of pair p (at most n) until one makes its first attempt on deployment `up` (the
    mock's count of `up` grows); the calls before it must be served by the other deployment in one
    attempt. Returns (that response, the mock's counts (a, b) just before it)."""
    for i in range(n):
        before = calls(p.a, p.b)
        r = call(a, g, p.alias, **kw)
        if calls(up) > before[(p.a, p.b).index(up)]:
            return r, before
        check_served(r, p.alias, p.other(up), 1, "call %d (on %s, before one reached %s)" % (i + 1, p.other(up), up))
    raise it.TestFailure("%d calls of %s, 1:1, and none reached deployment %s: the choice is not shared" % (n, p.alias, up))


# ===== the weighted choice ========================================================================

def run_sequence(a, g, alias, n, ups):
    """n calls of alias, one after another on one keep-alive connection: {upstream: answers}, the
    order of the upstreams, and the last response."""
    counts = {u: 0 for u in ups}
    order = []
    r = None
    with it.Conn(a.port, timeout=30) as c:
        for i in range(n):
            c.send(it.http_request("POST", "/v1/chat/completions", it.chat_body(model=alias), auth=g.token))
            r = c.read_final_response(30)
            it.check_x_headers(r, 200, 1, alias, "%s call %d" % (alias, i + 1))
            u = answered_by(r)
            check(u in counts, "%s call %d: answered by %r, not one of its deployments %r" % (alias, i + 1, u, ups))
            counts[u] += 1
            order.append(u)
    return counts, order, r


def check_shares(alias, counts, weights, n, what):
    """Each deployment's share within 8% of its weight's (the issue's tolerance). The smooth weighted
    round-robin makes sequential calls split exactly (300/100 for 3:1 over 400): -v says whether
    they did."""
    total_w = sum(weights.values())
    for u, w in weights.items():
        want = n * w / total_w
        check(abs(counts[u] - want) <= 0.08 * want,
              "%s: %s got %d of %d calls, want %g (weight %d of %d) within 8%%; all %r"
              % (what, u, counts[u], n, want, w, total_w, counts))
    exact = all(counts[u] * total_w == n * w for u, w in weights.items())
    it.log("%s: %r over %d calls (%s)" % (what, counts, n, "exactly the weights" if exact else "NOT exact"))


@dtest("weights 3:1 (400 sequential calls), 5:3:2 (200) and the default 1:1 on two providers (100): each "
       "deployment gets its weight's share (within 8%), one attempt each, the alias in x-ltg-served-model")
def t_dep_weights(a):
    g = group(a, ["Dep-W31", "Dep-W532", "Dep-2P"])
    for alias, weights, n in (("Dep-W31", {"dp-w31-a": 3, "dp-w31-b": 1}, 400),
                              ("Dep-W532", {"dp-w532-a": 5, "dp-w532-b": 3, "dp-w532-c": 2}, 200),
                              ("Dep-2P", {"dp-2p-a": 1, "dp-2p-b": 1}, 100)):
        before = calls(*weights)
        counts, order, last = run_sequence(a, g, alias, n, list(weights))
        check_shares(alias, counts, weights, n, alias)
        # What the mock saw agrees with the answers (no hidden extra attempts).
        after = calls(*weights)
        check({u: y - x for u, x, y in zip(weights, before, after)} == counts,
              "%s: the mock's calls %r differ from the answers' deployments %r" % (alias, dict(zip(weights, after)), counts))
        # The ledger names the deployment that served, provider/upstream_model.
        prov = {"dp-2p-b": "dep-mock2"}.get(order[-1], "mock")
        e = ledger_event(a, g, last.header("x-ltg-request-id"))
        check_attempt_list(e.get("attempt_log"), [(alias, "%s/%s" % (prov, order[-1]), 1, 200, "ok")],
                           "%s: the ledger's attempt_log" % alias)
        check(e.get("model") == alias and e.get("requested_model") == alias,
              "%s: the spend event's model %r, requested_model %r (the alias)" % (alias, e.get("model"), e.get("requested_model")))
    # Two providers, streams too: both deployments serve, each stream whole.
    seen = set()
    for i in range(6):
        r = call(a, g, "Dep-2P", stream=True)
        it.check_x_headers(r, 200, 1, "Dep-2P", "stream %d" % (i + 1))
        datas = [it.event_data(t) for _, t in it.sse_events(r)]
        check(datas and datas[-1] == "[DONE]", "stream %d does not end with [DONE]: %r" % (i + 1, datas[-3:]))
        models = {json.loads(d).get("model") for d in datas[:-1]}
        check(len(models) == 1 and models <= {"dp-2p-a", "dp-2p-b"}, "stream %d: events from %r" % (i + 1, models))
        seen |= models
    check(seen == {"dp-2p-a", "dp-2p-b"}, "6 streams of Dep-2P (1:1) were all served by %r" % seen)
    # The price is the model's: the same request costs the same on either deployment.
    costs = {}
    for i in range(4):
        r = call(a, g, "Dep-2P")
        costs.setdefault(answered_by(r), set()).add(r.header("x-ltg-cost"))
    check(len(costs) == 2 and len(set().union(*costs.values())) == 1,
          "x-ltg-cost per deployment %r: want one price, from both deployments" % costs)
    # GET /v1/models lists each alias once, not its deployments.
    ids = [m.get("id") for m in it.one_request(a.port, "GET", "/v1/models", auth=g.token).json().get("data", [])]
    check(sorted(ids) == ["Dep-2P", "Dep-W31", "Dep-W532"], "GET /v1/models: %r" % ids)


@dtest("least in flight: while one deployment holds a slow call, new calls go to the other; "
       "ltg_deployment_in_flight shows 1 and 0")
def t_dep_least_in_flight(a):
    p = fresh_pair()
    g = group(a, [p.alias])
    slow_ms = 6000
    res = {}

    def slow_call():
        try:
            res["r"] = call(a, g, p.alias, timeout=60)
        except Exception as e:
            res["e"] = e

    # The first wave: calls one at a time until one is held by the slow deployment a (its script:
    # every call waits 6 s before its head); those that reach b first are answered at once.
    script(p.a, ["head_delay_ms=%d" % slow_ms] * 3)
    slow = None
    for i in range(3):
        before = calls(p.a, p.b)
        th = threading.Thread(target=slow_call)
        th.start()
        deadline = time.monotonic() + 15
        while sum(calls(p.a, p.b)) == sum(before) and time.monotonic() < deadline:
            time.sleep(0.02)
        now = calls(p.a, p.b)
        check(sum(now) == sum(before) + 1, "wave call %d: the mock saw %r calls, before %r" % (i + 1, now, before))
        if now[0] > before[0]:
            slow = th
            t_slow = time.monotonic()
            break
        th.join(30)
        check("r" in res, "wave call %d: %r" % (i + 1, res.get("e")))
        check_served(res.pop("r"), p.alias, p.b, 1, "wave call %d (on b)" % (i + 1))
    check(slow is not None, "3 calls of a 1:1 model and none reached deployment a")
    try:
        check_metric(a, "ltg_deployment_in_flight", 1, model=p.alias, deployment=p.dep[p.a])
        check_metric(a, "ltg_deployment_in_flight", 0, model=p.alias, deployment=p.dep[p.b])
        # While a holds its call: 8 calls one after another, all to b (0 in flight against 1).
        before = calls(p.a, p.b)
        for i in range(8):
            r = call(a, g, p.alias, timeout=30)
            check_served(r, p.alias, p.b, 1, "call %d while a is busy" % (i + 1))
            check(r.elapsed < slow_ms / 1000.0 / 2, "call %d while a is busy took %.1f s" % (i + 1, r.elapsed))
        check(calls(p.a, p.b) == (before[0], before[1] + 8), "while a is busy: calls (a, b) %r, want %r"
              % (calls(p.a, p.b), (before[0], before[1] + 8)))
        still = slow.is_alive()
        check(still, "the slow call on a ended before the calls to b did (%.1f s): the timing proves nothing"
              % (time.monotonic() - t_slow))
    finally:
        slow.join(60)
    check("r" in res, "the slow call: %r" % res.get("e"))
    check_served(res["r"], p.alias, p.a, 1, "the slow call")
    check(res["r"].elapsed >= slow_ms / 1000.0 - 0.1, "the slow call took %.1f s, its head delay is %d ms"
          % (res["r"].elapsed, slow_ms))
    check_metric(a, "ltg_deployment_in_flight", 0, model=p.alias, deployment=p.dep[p.a])
    check_metric(a, "ltg_deployment_in_flight", 0, model=p.alias, deployment=p.dep[p.b])


# ===== failures: no_work on another deployment at once, indeterminate to the next model ============

@dtest("no_work (429 with Retry-After 30, 529, refused) is retried at once on the other deployment: "
       "x-ltg-attempts 2, the alias served, the ledger names both deployments")
def t_dep_no_work(a):
    for st in (429, 529):
        p = fresh_pair()
        # A backoff of 5 s and a Retry-After of 30 s: neither may delay the retry on b.
        g = group(a, [p.alias], retries={"max_attempts": 3, "retry_delay_ms": 5000, "backoff": "constant"})
        script(p.a, ["status=%d retry_after=30" % st])
        r, before = first_on(a, g, p, p.a)
        what = "%d on a" % st
        check_served(r, p.alias, p.b, 2, what)
        check(r.elapsed < 3.0, "%s: answered after %.1f s; the retry on b must not wait the backoff (5 s) or "
              "the Retry-After (30 s)" % (what, r.elapsed))
        check(calls(p.a, p.b) == (before[0] + 1, before[1] + 1), "%s: calls (a, b) %r, want %r"
              % (what, calls(p.a, p.b), (before[0] + 1, before[1] + 1)))
        ta, tb = mock_times(p.a)[-1], mock_times(p.b)[-1]
        check(0 <= tb - ta < 1500, "%s: b was called %d ms after a's %d" % (what, tb - ta, st))
        e = ledger_event(a, g, r.header("x-ltg-request-id"))
        check_attempt_list(e.get("attempt_log"), [(p.alias, p.dep[p.a], 1, st, "no_work"), (p.alias, p.dep[p.b], 2, 200, "ok")],
                           "%s: the ledger's attempt_log" % what)
        check(e.get("attempts") == 2 and e.get("model") == p.alias, "%s: the spend event's attempts %r, model %r"
              % (what, e.get("attempts"), e.get("model")))
    # Connection refused on the deployment of provider "down": the mock's deployment serves at once.
    p = fresh_refused()
    g = group(a, [p.alias], retries={"max_attempts": 2, "retry_delay_ms": 5000, "backoff": "constant"})
    served = {1: 0, 2: 0}
    for i in range(4):
        r = call(a, g, p.alias)
        n = int(r.header("x-ltg-attempts") or 0)
        check_served(r, p.alias, p.b, n if n in (1, 2) else 1, "refused, call %d" % (i + 1))
        check(r.elapsed < 3.0, "refused, call %d: answered after %.1f s (the retry waited?)" % (i + 1, r.elapsed))
        served[n] += 1
        if n == 2:
            e = ledger_event(a, g, r.header("x-ltg-request-id"))
            check_attempt_list(e.get("attempt_log"), [(p.alias, p.dep[p.a], 1, 0, "no_work"), (p.alias, p.dep[p.b], 2, 200, "ok")],
                               "refused: the ledger's attempt_log")
    check(served[2] >= 1, "4 calls of %s (down/... and mock/..., 1:1): none tried the refusing deployment first" % p.alias)
    check(calls(p.b) == 4, "refused: the mock's deployment got %d calls, want 4" % calls(p.b))


@dtest("no_work on every deployment: one attempt each at once, then the failure; error.attempts names each "
       "deployment; max_attempts 1 means no retry on the other deployment")
def t_dep_no_work_all(a):
    p = fresh_pair()
    g = group(a, [p.alias], retries={"max_attempts": 2, "retry_delay_ms": 5000, "backoff": "constant"})
    script(p.a, ["status=429 retry_after=30"])
    script(p.b, ["status=429 retry_after=30"])
    r = call(a, g, p.alias)
    check(calls(p.a, p.b) == (1, 1), "both 429: calls (a, b) %r, want one each" % (calls(p.a, p.b),))
    first = first_called(p.a, p.b)
    e = check_fail(r, 429, 2, [(p.alias, p.dep[first], 1, 429, "no_work"), (p.alias, p.dep[p.other(first)], 2, 429, "no_work")],
                   what="both 429")
    check(r.elapsed < 3.0, "both 429: answered after %.1f s (no wait before the second deployment)" % r.elapsed)
    ev = ledger_event(a, g, r.header("x-ltg-request-id"))
    check(ev.get("attempt_log") == e["attempts"], "the ledger's attempt_log %r differs from error.attempts %r"
          % (ev.get("attempt_log"), e["attempts"]))
    # max_attempts 1: a 429 on a is that model's one attempt; the fallback serves, b is not called.
    p = fresh_pair()
    fb = FALLBACKS.take_one()
    g = group(a, [p.alias, fb], {p.alias: [fb]}, {"max_attempts": 1, "retry_delay_ms": 0})
    script(p.a, ["status=429"])
    r, before = first_on(a, g, p, p.a)
    it.check_x_headers(r, 200, 2, fb, "max_attempts 1, 429 on a")
    check(answered_by(r) == fb_up(fb), "max_attempts 1: answered by %r, want the fallback" % answered_by(r))
    check(calls(p.a, p.b) == (before[0] + 1, before[1]), "max_attempts 1: calls (a, b) %r, want %r"
          % (calls(p.a, p.b), (before[0] + 1, before[1])))
    e = ledger_event(a, g, r.header("x-ltg-request-id"))
    check_attempt_list(e.get("attempt_log"), [(p.alias, p.dep[p.a], 1, 429, "no_work"), (fb, "mock/" + fb_up(fb), 1, 200, "ok")],
                       "max_attempts 1: the ledger's attempt_log")


@dtest("indeterminate (503, a request timeout) moves to the next model, never to the other deployment")
def t_dep_indeterminate(a):
    for what, steps, retries, headers in (
            ("503", ["status=503"], {"max_attempts": 3, "retry_delay_ms": 0}, {}),
            ("timeout", ["head_delay_ms=4000"], {"max_attempts": 3, "retry_delay_ms": 0}, {"x-ltg-request-timeout": "500"})):
        p = fresh_pair()
        fb = FALLBACKS.take_one()
        g = group(a, [p.alias, fb], {p.alias: [fb]}, retries)
        # Both deployments fail alike: whichever is chosen first fails, and the other must not be tried.
        script(p.a, steps)
        script(p.b, steps)
        r = call(a, g, p.alias, headers=headers)
        it.check_x_headers(r, 200, 2, fb, what)
        check(answered_by(r) == fb_up(fb), "%s: answered by %r, want the fallback %s" % (what, answered_by(r), fb))
        check(r.elapsed < 3.5, "%s: answered after %.1f s" % (what, r.elapsed))
        # On purpose: a moment for a late call of the other deployment to show (a negative check; the
        # call made reached the mock before ltg answered).
        time.sleep(0.1)
        ca, cb = calls(p.a, p.b)
        check(ca + cb == 1, "%s: calls (a, b) (%d, %d): want one call of one deployment" % (what, ca, cb))
        tried = p.a if ca else p.b
        e = ledger_event(a, g, r.header("x-ltg-request-id"))
        check_attempt_list(e.get("attempt_log"), [(p.alias, p.dep[tried], 1, 503 if what == "503" else 0, "indeterminate"),
                                                  (fb, "mock/" + fb_up(fb), 1, 200, "ok")], "%s: the ledger's attempt_log" % what)
    # No fallback: the 503 is the answer, one attempt, the other deployment untouched.
    p = fresh_pair()
    g = group(a, [p.alias], retries={"max_attempts": 3, "retry_delay_ms": 0})
    script(p.a, ["status=503"])
    script(p.b, ["status=503"])
    r = call(a, g, p.alias)
    ca, cb = calls(p.a, p.b)
    check(ca + cb == 1, "503 alone: calls (a, b) (%d, %d)" % (ca, cb))
    check_fail(r, 503, 1, [(p.alias, p.dep[p.a if ca else p.b], 1, 503, "indeterminate")], what="503 alone")


# ===== breakers per deployment ====================================================================

@dtest("breakers per deployment: 5 failures open one, the model serves from the other; both open: "
       "circuit_open (deployment null), the fallback serves; ltg_circuit_open per deployment; probes close them")
def t_dep_breakers(a):
    p = fresh_pair()
    fb = FALLBACKS.take_one()
    g = group(a, [p.alias])
    g2 = group(a, [p.alias, fb], {p.alias: [fb]})
    for u in (p.a, p.b):
        check_metric(a, "ltg_circuit_open", 0, model=p.alias, deployment=p.dep[u])
    # a fails 5 times in a row (b's successes in between are b's): a's breaker opens.
    script(p.a, ["status=503"] * 5)
    for i in range(20):
        r = call(a, g, p.alias)
        if r.status == 503:
            check_fail(r, 503, 1, [(p.alias, p.dep[p.a], 1, 503, "indeterminate")], what="a failing, call %d" % (i + 1))
        else:
            check_served(r, p.alias, p.b, 1, "a failing, call %d" % (i + 1))
        if calls(p.a) >= 5:
            break
    check(calls(p.a) == 5, "20 calls of a 1:1 model: a got %d, want 5" % calls(p.a))
    t_a_open = time.monotonic()
    check_metric(a, "ltg_circuit_open", 1, model=p.alias, deployment=p.dep[p.a])
    check_metric(a, "ltg_circuit_open", 0, model=p.alias, deployment=p.dep[p.b])
    # a skipped: every call goes to b, one attempt, and a's skip is not an attempt.
    nb = calls(p.b)
    for i in range(6):
        r = call(a, g, p.alias)
        check_served(r, p.alias, p.b, 1, "a open, call %d" % (i + 1))
    check(calls(p.a, p.b) == (5, nb + 6), "a open: calls (a, b) %r, want %r" % (calls(p.a, p.b), (5, nb + 6)))
    e = ledger_event(a, g, r.header("x-ltg-request-id"))
    check_attempt_list(e.get("attempt_log"), [(p.alias, p.dep[p.b], 1, 200, "ok")], "a open: the ledger's attempt_log")
    # b fails 5 times too: both open.
    script(p.b, ["status=500"] * 5)
    for i in range(5):
        t_b_failing = time.monotonic()      # b's breaker opens during its 5th failure: after this
        r = call(a, g, p.alias)
        check_fail(r, 500, 1, [(p.alias, p.dep[p.b], 1, 500, "indeterminate")], what="a open, b failing, call %d" % (i + 1))
    check(calls(p.a, p.b) == (5, nb + 11), "b failing: calls (a, b) %r" % (calls(p.a, p.b),))
    # a's breaker opened at t_a_open and stays open 5 s: these checks must be done by then (no
    # more than a couple of seconds even on a slow machine); a failure after 5 s says so.
    try:
        for stream in (False, True):
            what = "both open%s" % (" (stream)" if stream else "")
            r = call(a, g, p.alias, stream=stream)
            check_fail(r, 503, 0, [(p.alias, None, 1, 0, "circuit_open")], code="circuit_open", what=what)
            check(r.header("retry-after") == "1", "%s: Retry-After %r, want 1" % (what, r.header("retry-after")))
        r = call(a, g2, p.alias)
        it.check_x_headers(r, 200, 1, fb, "both open, with a fallback")
        e = ledger_event(a, g2, r.header("x-ltg-request-id"))
        check_attempt_list(e.get("attempt_log"), [(p.alias, None, 1, 0, "circuit_open"), (fb, "mock/" + fb_up(fb), 1, 200, "ok")],
                           "both open: the ledger's attempt_log")
        for u in (p.a, p.b):
            check_metric(a, "ltg_circuit_open", 1, model=p.alias, deployment=p.dep[u])
    except it.TestFailure as ex:
        took = time.monotonic() - t_a_open
        if took < 4.5:
            raise
        raise it.TestFailure("%s (the checks with a open took %.1f s: a's 5 s may have run out)" % (ex, took))
    check(calls(p.a, p.b) == (5, nb + 11), "both open: calls (a, b) %r: a skipped model makes no call" % (calls(p.a, p.b),))
    # After 5 s each lets a probe through (ltg_circuit_open back to 0); successes close them, and
    # both serve again.
    it.wait_until(lambda: "the breakers still open: ltg_circuit_open (a, b) %r" % ([metric(a, "ltg_circuit_open", model=p.alias,
                                                                                    deployment=p.dep[u]) for u in (p.a, p.b)],),
                  lambda: all(metric(a, "ltg_circuit_open", model=p.alias, deployment=p.dep[u]) == 0 for u in (p.a, p.b)),
                  20 * it.SLOW, step=0.05)
    check(time.monotonic() - t_b_failing >= 4.95, "b's breaker let a probe through %.2f s after it opened, before its 5 s"
          % (time.monotonic() - t_b_failing))
    got = set()
    for i in range(6):
        r = call(a, g, p.alias)
        it.check_x_headers(r, 200, 1, p.alias, "after 5 s, call %d" % (i + 1))
        got.add(answered_by(r))
    check(got == {p.a, p.b}, "after the breakers' 5 s: 6 calls answered by %r, want both deployments" % got)
    for u in (p.a, p.b):
        check_metric(a, "ltg_circuit_open", 0, model=p.alias, deployment=p.dep[u])


# ===== the Responses API: pinned to the deployment ================================================

def post_response(a, g, model, stream=False, **kw):
    body = {"model": model, "input": "Hello", **kw}
    if stream:
        body["stream"] = True
    return it.timed_call(a.port, g.token, model, path="/v1/responses", body=body, timeout=30)


def response_of(r, what):
    """(id, upstream model) of a Responses answer, plain or streamed."""
    check(r.status == 200, "%s: %s" % (what, r.brief()))
    if (r.header("content-type") or "").startswith("text/event-stream"):
        first = json.loads(it.event_data(it.sse_events(r)[0][1]))
        resp = first.get("response") or {}
    else:
        resp = r.json()
    check(resp.get("object") == "response" and resp.get("id"), "%s: not a response: %r" % (what, r.body[:300]))
    return resp["id"], resp.get("model")


@dtest("/v1/responses: a follow-up naming previous_response_id goes to the deployment that made the response")
def t_dep_responses_pin(a):
    p = fresh_pair()
    g = group(a, [p.alias])
    r = post_response(a, g, p.alias)
    it.check_x_headers(r, 200, 1, p.alias, "the first response")
    rid, x = response_of(r, "the first response")
    check(x in (p.a, p.b), "the first response came from %r" % x)
    # A second response on the other deployment (1:1: the next call, or the one after).
    for i in range(3):
        r = post_response(a, g, p.alias, stream=(i == 0))
        rid2, y = response_of(r, "response %d" % (i + 2))
        if y != x:
            break
    check(y == p.other(x), "3 more responses of a 1:1 model all came from %s" % x)
    pins = {rid: x, rid2: y}
    for pid, up in pins.items():
        before = calls(p.a, p.b)
        for i in range(6):      # unpinned, 6 calls one after another would go 3 and 3
            r = post_response(a, g, p.alias, stream=(i % 3 == 2), previous_response_id=pid)
            it.check_x_headers(r, 200, 1, p.alias, "follow-up %d of %s" % (i + 1, pid))
            _, got = response_of(r, "follow-up %d of %s" % (i + 1, pid))
            check(got == up, "follow-up %d of %s (made by %s) went to %s" % (i + 1, pid, up, got))
        want = tuple(b + (6 if u == up else 0) for u, b in zip((p.a, p.b), before))
        check(calls(p.a, p.b) == want, "follow-ups of %s: calls (a, b) %r, want %r" % (pid, calls(p.a, p.b), want))
        e = ledger_event(a, g, r.header("x-ltg-request-id"))
        check_attempt_list(e.get("attempt_log"), [(p.alias, p.dep[up], 1, 200, "ok")], "a follow-up's attempt_log")
    # A follow-up's own response pins too (a chain of turns stays on its deployment).
    r = post_response(a, g, p.alias, previous_response_id=rid)
    rid3, up = response_of(r, "a turn")
    for i in range(3):
        r = post_response(a, g, p.alias, previous_response_id=rid3)
        rid3, got = response_of(r, "turn %d" % (i + 2))
        check(got == x, "turn %d of a conversation made on %s went to %s" % (i + 2, x, got))


@dtest("/v1/responses: a pinned deployment whose breaker is open gives way to the other deployment")
def t_dep_responses_pin_open(a):
    p = fresh_pair()
    g = group(a, [p.alias], retries={"max_attempts": 1})
    r = post_response(a, g, p.alias)
    rid, x = response_of(r, "the response")
    y = p.other(x)
    # Failing 5 times (each follow-up's 503 is its answer: pinned, not moved to the other
    # deployment) opens its breaker; then the follow-ups go to the other deployment.
    script(x, ["status=503"] * 5)
    before = calls(x, y)
    for i in range(5):
        r = post_response(a, g, p.alias, previous_response_id=rid)
        check_fail(r, 503, 1, [(p.alias, p.dep[x], 1, 503, "indeterminate")], what="pinned deployment failing, %d" % (i + 1))
    check(calls(x, y) == (before[0] + 5, before[1]), "pinned deployment failing: calls (pinned, other) %r, want %r"
          % (calls(x, y), (before[0] + 5, before[1])))
    check_metric(a, "ltg_circuit_open", 1, model=p.alias, deployment=p.dep[x])
    for i in range(2):
        r = post_response(a, g, p.alias, previous_response_id=rid)
        it.check_x_headers(r, 200, 1, p.alias, "the pinned deployment open, follow-up %d" % (i + 1))
        _, got = response_of(r, "the pinned deployment open, follow-up %d" % (i + 1))
        check(got == y, "with the pinned deployment's breaker open follow-up %d went to %s, want the other (%s)"
              % (i + 1, got, y))


@dtest("/v1/responses: a 429 on the pinned deployment (breaker closed) is retried on it after the backoff, "
       "not on the other deployment")
def t_dep_responses_pin_429(a):
    p = fresh_pair()
    delay = 600
    g = group(a, [p.alias], retries={"max_attempts": 2, "retry_delay_ms": delay, "backoff": "constant"})
    r = post_response(a, g, p.alias)
    rid, x = response_of(r, "the response")
    y = p.other(x)
    # Its breaker is closed, so the retry is made on it again, after the backoff (every deployment
    # this request may use has answered no_work): the other's provider does not hold the conversation.
    for i in range(3):
        what = "429 on the pinned deployment %s, follow-up %d" % (x, i + 1)
        script(x, ["status=429"])
        before = calls(x, y)
        r = post_response(a, g, p.alias, previous_response_id=rid)
        it.check_x_headers(r, 200, 2, p.alias, what)
        _, got = response_of(r, what)
        e = ledger_event(a, g, r.header("x-ltg-request-id"))
        if calls(y) != before[1]:
            raise it.TestFailure("%s: the retry went to the other deployment %s, %d ms after the 429 (answered by %s, calls "
                                 "(pinned, other) %r, want %r); the ledger's attempt_log %s"
                                 % (what, y, mock_times(y)[-1] - mock_times(x)[-1], got, calls(x, y),
                                    (before[0] + 2, before[1]), json.dumps(e.get("attempt_log"))))
        check(calls(x) == before[0] + 2 and got == x, "%s: answered by %s, calls (pinned, other) %r, want %r"
              % (what, got, calls(x, y), (before[0] + 2, before[1])))
        check_attempt_list(e.get("attempt_log"), [(p.alias, p.dep[x], 1, 429, "no_work"), (p.alias, p.dep[x], 2, 200, "ok")],
                           what + ": the ledger's attempt_log")
        t = mock_times(x)
        gap = t[-1] - t[-2]
        check(delay - 5 <= gap <= delay * 1.2 + 600, "%s: the retry came %d ms after the 429, want the backoff of %d ms"
              % (what, gap, delay))


# ===== the catalog ================================================================================

def bad_catalog(model, extra_providers=None):
    cfg = it.catalog_copy()
    cfg["providers"].update(extra_providers or {})
    cfg["models"]["Bad"] = model
    return cfg


@it.test("deployments: a bad deployments list stops start-up with a message naming the field")
def t_dep_catalog_refused():
    prices = {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1}
    ok = {"provider": "mock", "upstream_model": "bad-a"}
    anth = {"dep-anthropic": it.catalog_provider(it.H.mock_port, api="anthropic")}
    cases = [
        ("weight 0", dict(prices, deployments=[dict(ok, weight=0)]), None, "models.Bad.deployments[0].weight",
         "must be a whole number from 1 to 100"),
        ("weight 101", dict(prices, deployments=[ok, dict(ok, upstream_model="bad-b", weight=101)]), None,
         "models.Bad.deployments[1].weight", "1 to 100"),
        ("weight 2.5", dict(prices, deployments=[dict(ok, weight=2.5)]), None, "models.Bad.deployments[0].weight", None),
        ("an empty list", dict(prices, deployments=[]), None, "models.Bad.deployments", "1 to 16"),
        ("17 deployments", dict(prices, deployments=[dict(ok, upstream_model="bad-%d" % i) for i in range(17)]), None,
         "models.Bad.deployments", "1 to 16"),
        ("not a list", dict(prices, deployments=ok), None, "models.Bad.deployments", None),
        ("provider and deployments", dict(prices, provider="mock", upstream_model="x", deployments=[ok]), None,
         "models.Bad.deployments", "not both"),
        ("an unknown provider", dict(prices, deployments=[ok, dict(ok, provider="nowhere")]), None,
         "models.Bad.deployments[1].provider", "nowhere"),
        ("no upstream_model", dict(prices, deployments=[{"provider": "mock"}]), None,
         "models.Bad.deployments[0].upstream_model", None),
        ("an unknown field", dict(prices, deployments=[dict(ok, region="eu")]), None, "models.Bad.deployments[0].region", None),
        ("not an object", dict(prices, deployments=[ok, "mock/bad-b"]), None, "models.Bad.deployments[1]", None),
        ("a deployment twice", dict(prices, deployments=[ok, dict(ok)]), None, "models.Bad.deployments[1]", "twice"),
        ("weight outside deployments", dict(prices, provider="mock", upstream_model="x", weight=2), None, "models.Bad.weight", None),
        ("two APIs", dict(prices, deployments=[ok, {"provider": "dep-anthropic", "upstream_model": "bad-b"}]), anth,
         "models.Bad.deployments[1].provider", None),
    ]
    it.check_catalog_refusals("deployments", [(what, bad_catalog(model, prov), [field + ":"] + ([phrase] if phrase else []))
                                              for what, model, prov, field, phrase in cases])


# ===== last: the dedicated ltg exits cleanly ======================================================

_LTG.stop_test(__name__, "deployments: the deployments ltg exits 0 on SIGTERM, no sanitizer report in its log",
               "no deployments test ran")


if __name__ == "__main__":   # this file alone: python3 tests/integration_deployments.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
