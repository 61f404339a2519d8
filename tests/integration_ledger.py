"""Integration tests: the consumption ledger, usage reports, budgets, cache and idempotent inference
(API.md 3.4, 4.1, 4.4, 4.5; README "Spend: the ledger, budgets, cache, idempotent inference").

Loaded by tests/integration.py at start-up (it imports every tests/integration_*.py); the tests
register themselves with the runner's @test and use its harness (it.H) at call time.

Every test provisions its own token group(s) and key(s) through the control plane, so that the
events, spend and cache entries it checks are its own. Upstream calls are counted at the mock
(GET /_mock/stats: the total of inference requests, and the log of directives, where a request is
marked by a head_delay_ms value of its own). Tests that restart ltg, damage its ledger or need
another catalog (a free model, admin keys with only one permission) run their own ltg (it.Aux).

Dates: the ledger's ranges are UTC days. Queries that are not about date boundaries use the range
[yesterday, the day after tomorrow), so that a run across midnight UTC still finds its events.

Money is compared in micro-USD (ltg writes USD with six decimals): an event's cost is
round(input_tokens x input price + output_tokens x output price) with prices per million tokens.
"""

import datetime
import hashlib
import json
import math
import os
import random
import re
import struct
import subprocess
import threading
import time

import integration as it

check = it.check

FREE_MODEL = {"provider": "mock", "upstream_model": "glm-5.3-flash", "input_usd_per_mtok": 0, "output_usd_per_mtok": 0}
TOKEN_CLASSES = ("input_tokens", "cache_read_tokens", "cache_write_tokens", "cache_write_1h_tokens", "output_tokens",
                 "reasoning_tokens")
EVENT_FIELDS = ("id", "request_id", "trace_id", "created_at", "endpoint", "token_key_id", "token_group_id", "requested_model", "model",
                "attempts", "status", "http_status", "cache_hit") + TOKEN_CLASSES + ("cost", "usage_status", "latency_ms", "attempt_log")
USAGE_FIELDS = ("requests", "succeeded_requests", "failed_requests", "partial_requests", "abandoned_requests", "cache_hits") + \
    TOKEN_CLASSES + ("spend", "reserved_spend")
DEFAULT_MAX_OUTPUT = 4096

# Admin keys of the catalog of the Aux tests that need them (key_sha256): one permission each.
SPEND_ONLY_KEY = "admin-ledger-spend-only-0006"
USAGE_ONLY_KEY = "admin-ledger-usage-only-0007"


# ===== small helpers ===============================================================================

def price(model):
    """(input, output) USD per million tokens of a catalog model (the harness's catalog, or the free
    model of the Aux catalogs), or None."""
    m = it.H.config["models"].get(model) or (FREE_MODEL if model == "Free-Model" else None)
    return (m["input_usd_per_mtok"], m["output_usd_per_mtok"]) if m else None


def day(offset=0):
    """The UTC date today + offset days, as YYYY-MM-DD."""
    d = datetime.datetime.now(datetime.timezone.utc).date() + datetime.timedelta(days=offset)
    return d.isoformat()


def wide():
    """start_date and end_date of a range that holds every event of this run: [yesterday, today + 2)."""
    return "start_date=%s&end_date=%s" % (day(-1), day(2))


def micro(v):
    """A USD amount (JSON number or header text) in micro-USD."""
    return int(round(float(v) * 1e6))


def iso_ms(s):
    """An ISO 8601 UTC time (…Z) as epoch ms."""
    check(isinstance(s, str) and it.ISO_RE.match(s), "not an ISO 8601 UTC time: %r" % (s,))
    base, frac = (s[:-1].split(".") + ["0"])[:2]
    t = datetime.datetime.strptime(base, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    return int(t.timestamp() * 1000) + int((frac + "000")[:3])


def body_bytes(body):
    return len(json.dumps(body).encode()) if isinstance(body, (dict, list)) else len(body)


def worst_case(body, max_tokens=None, models=("Kimi-K3",)):
    """ltg's reservation of a request in micro-USD (API.md 4.5): ceil(bytes / 3) prompt tokens at the
    input price plus max_tokens (or the model's default) at the output price, at the dearest model;
    computed with the same double arithmetic as ltg."""
    prompt = (body_bytes(body) + 2) // 3
    worst = 0.0
    for m in models:
        pin, pout = price(m)
        w = prompt * pin + (max_tokens if max_tokens else DEFAULT_MAX_OUTPUT) * pout
        worst = max(worst, w)
    return int(math.ceil(worst))


def call(token, body, headers=None, port=None, path="/v1/chat/completions", timeout=40.0):
    return it.one_request(port or it.H.port, "POST", path, body, headers, auth=token, timeout=timeout)


def rid_of(r, what):
    rid = r.header("x-ltg-request-id")
    check(rid, "%s: no x-ltg-request-id (headers %r)" % (what, r.headers))
    check(r.header("x-request-id") == rid, "%s: X-Request-ID %r != x-ltg-request-id %r"
          % (what, r.header("x-request-id"), rid))
    return rid


def ok200(r, what):
    check(r.status == 200, "%s: expected 200, got %s" % (what, r.brief()))
    return r


def upstream_calls():
    """Inference requests the mock has received (all models)."""
    return it.H.mock_stats()["requests"]


def mock_marks(directive):
    """How many requests with this directive the mock's log holds."""
    return sum(1 for e in it.H.mock_stats().get("log", []) if e.get("directive") == directive)


def wait_marks(directive, n, timeout=20.0):
    it.wait_until(lambda: "the mock's requests with directive %r: %d, want %d" % (directive, mock_marks(directive), n),
                  lambda: mock_marks(directive) >= n, timeout, step=0.05)


def unique_delay(base):
    """A head_delay_ms directive with a value of its own (it marks the request in the mock's log)."""
    return "head_delay_ms=%d" % (base + random.randint(0, 997))


def last_prompt_tokens():
    """The prompt tokens the mock reported for the last request it received: its body bytes / 4."""
    n = len(it.H.mock_last()["body"].encode("utf-8"))
    return max(n // 4, 1)


def script(model, steps):
    it.H.mock_post("/_mock/script", {"model": model, "steps": steps})


class Bg:
    """A function run in a thread: its result or exception, and when it finished."""

    def __init__(self, fn):
        self.result = None
        self.error = None
        self.t_done = None
        self.th = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.th.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except BaseException as e:  # reported by join()
            self.error = e
        self.t_done = time.monotonic()

    def alive(self):
        return self.th.is_alive()

    def join(self, timeout=60.0):
        self.th.join(timeout)
        check(not self.th.is_alive(), "a background request did not finish within %d s" % timeout)
        if self.error is not None:
            raise self.error
        return self.result


def new_group(name, port=None, **kw):
    return it.create_group(it.group_body(name="%s-%s" % (name, os.urandom(3).hex()), **kw), port=port)["id"]


def patch_group(gid, fields, port=None, what="PATCH"):
    d, v = it.get_group(gid, port)
    r = it.admin("PATCH", "/token_groups/" + gid, fields, if_match=v, port=port)
    return it.check_admin_ok(r, 200, "%s %r" % (what, fields))["data"]


def revoke(kid, port=None):
    it.check_admin_ok(it.admin("DELETE", "/token_keys/" + kid, if_match=1, port=port), 200, "revoke key %s" % kid)


def spend_query(query, port=None, key=it.AUTO):
    return it.admin("GET", "/spend/events?" + query, key=key, port=port)


def spend_page(query, port=None, what=None):
    r = spend_query(query, port)
    j = it.check_admin_ok(r, 200, what or "GET /spend/events?%s" % query)
    check(isinstance(j.get("data"), list), "%s: data is not a list: %r" % (what or query, r.body[:300]))
    check(isinstance(j.get("meta"), dict), "%s: no meta: %r" % (what or query, r.body[:300]))
    return j


def events_of(gid=None, kid=None, port=None, extra=""):
    """Every event of the wide range (filtered), in ledger order, through pages of 1000 under one
    snapshot."""
    q = wide()
    if gid:
        q += "&token_group_id=" + gid
    if kid:
        q += "&token_key_id=" + kid
    q += extra
    out, page, snap = [], 1, None
    while True:
        pq = q + "&page[size]=1000&page[number]=%d" % page + ("&page[snapshot]=" + snap if snap else "")
        j = spend_page(pq, port)
        snap = snap or j["meta"].get("snapshot")
        out += j["data"]
        if not j["meta"].get("has_more"):
            return out
        page += 1


def event_by_rid(events, what):
    m = {}
    for ev in events:
        check(ev.get("request_id") not in m, "%s: two events for request %r" % (what, ev.get("request_id")))
        m[ev.get("request_id")] = ev
    return m


def wait_events(gid, n, port=None, timeout=15.0, kid=None):
    """The group's events once there are at least n of them."""
    deadline = time.monotonic() + timeout
    evs = []
    while time.monotonic() < deadline:
        evs = events_of(gid, kid=kid, port=port)
        if len(evs) >= n:
            return evs
        time.sleep(0.1)
    raise it.TestFailure("expected %d spend event(s) for group %s within %d s, have %d: %r"
                         % (n, gid, timeout, len(evs), evs[-3:]))


def check_event_shape(ev, what):
    """Every field of API.md 3.4 with its type, and the rules that tie them together."""
    check(isinstance(ev, dict), "%s: an event is not an object: %r" % (what, ev))
    for f in EVENT_FIELDS:
        check(f in ev, "%s: the event lacks %s: %r" % (what, f, ev))
    check(isinstance(ev["id"], str) and ev["id"], "%s: id %r" % (what, ev["id"]))
    check(isinstance(ev["request_id"], str) and ev["request_id"], "%s: request_id %r" % (what, ev["request_id"]))
    check(re.fullmatch(r"[0-9a-f]{32}", ev["trace_id"] or "") and ev["trace_id"] != "0" * 32, "%s: trace_id %r" % (what, ev["trace_id"]))
    iso_ms(ev["created_at"])
    for f in ("token_key_id", "token_group_id", "requested_model", "status", "usage_status"):
        check(isinstance(ev[f], str) and ev[f], "%s: %s %r" % (what, f, ev[f]))
    check(ev["model"] is None or (isinstance(ev["model"], str) and ev["model"]), "%s: model %r" % (what, ev["model"]))
    for f in ("attempts", "http_status", "latency_ms"):
        check(isinstance(ev[f], int) and not isinstance(ev[f], bool) and ev[f] >= 0, "%s: %s %r" % (what, f, ev[f]))
    check(ev["status"] in ("succeeded", "failed", "partial", "abandoned"), "%s: status %r" % (what, ev["status"]))
    check(ev["usage_status"] in ("reported", "estimated"), "%s: usage_status %r" % (what, ev["usage_status"]))
    check(isinstance(ev["cache_hit"], bool), "%s: cache_hit %r" % (what, ev["cache_hit"]))
    c = ev["cost"]
    check(isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 0, "%s: cost %r (never null)" % (what, c))
    check(isinstance(ev["attempt_log"], list), "%s: attempt_log %r" % (what, ev["attempt_log"]))
    for a in [ev] + ev["attempt_log"]:
        for f in TOKEN_CLASSES:
            v = a.get(f)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 0, "%s: %s %r in %r" % (what, f, v, a))
    for a in ev["attempt_log"]:
        check(isinstance(a, dict) and set(a) >= {"model", "attempt", "status", "outcome", "ms", "cost", "usage_status"},
              "%s: an attempt_log entry %r" % (what, a))
        check(isinstance(a["attempt"], int) and a["attempt"] >= 1, "%s: attempt_log attempt %r" % (what, a))
        check(isinstance(a["status"], int) and isinstance(a["ms"], int) and a["ms"] >= 0, "%s: attempt_log %r" % (what, a))
        if a["usage_status"] == "reported" and price(a["model"]) is not None:  # the provider's usage at the model's prices
            pin, pout = price(a["model"])
            want = a["input_tokens"] * pin + a["output_tokens"] * pout    # this suite's catalog prices no cache class apart
            check(abs(a["cost"] * 1e6 - want) <= 0.5 + 1e-6,
                  "%s: attempt cost %r USD, but %d input x %s + %d output x %s per million tokens = %.6f USD"
                  % (what, a["cost"], a["input_tokens"], pin, a["output_tokens"], pout, want / 1e6))
    made = sum(1 for a in ev["attempt_log"] if a["outcome"] != "circuit_open")
    check(made == ev["attempts"], "%s: attempts %r but attempt_log lists %d upstream attempts: %r"
          % (what, ev["attempts"], made, ev["attempt_log"]))
    if ev["cache_hit"]:
        check(ev["attempts"] == 0 and ev["cost"] == 0 and ev["attempt_log"] == [],
              "%s: a cache hit must have attempts 0, cost 0, no attempt: %r" % (what, ev))
    else:  # the event's figures are its attempts' sums
        for f in TOKEN_CLASSES:
            check(ev[f] == sum(a[f] for a in ev["attempt_log"]), "%s: %s %r is not its attempts' sum: %r" % (what, f, ev[f], ev))
        check(micro(ev["cost"]) == sum(micro(a["cost"]) for a in ev["attempt_log"]), "%s: cost %r is not its attempts' sum: %r"
              % (what, ev["cost"], ev))
        want = "estimated" if any(a["usage_status"] == "estimated" for a in ev["attempt_log"]) else "reported"
        check(ev["usage_status"] == want, "%s: usage_status %r, its attempts say %r" % (what, ev["usage_status"], want))
    if ev["status"] == "partial":
        check(ev["http_status"] == 200, "%s: a partial event has http_status %r, want 200" % (what, ev["http_status"]))


def check_event(ev, what, **want):
    check_event_shape(ev, what)
    for k, v in want.items():
        if k == "attempt_log":
            got = [(a["model"], a["attempt"], a["status"], a["outcome"]) for a in ev["attempt_log"]]
            check(got == v, "%s: attempt_log %r, want %r" % (what, got, v))
        elif k == "cost" and v is not None:
            check(ev["cost"] is not None and micro(ev["cost"]) == micro(v), "%s: cost %r, want %r" % (what, ev["cost"], v))
        else:
            check(ev[k] == v, "%s: %s is %r, want %r (event %r)" % (what, k, ev[k], v, ev))


def aux_config(tag):
    """The harness's catalog plus a free model and two admin keys with one permission each."""
    cfg = it.catalog_copy()
    cfg["models"]["Free-Model"] = dict(FREE_MODEL)
    cfg["admin_keys"] = list(cfg["admin_keys"]) + [
        {"key_sha256": hashlib.sha256(SPEND_ONLY_KEY.encode()).hexdigest(), "permissions": [it.P_SPEND_READ]},
        {"key_sha256": hashlib.sha256(USAGE_ONLY_KEY.encode()).hexdigest(), "permissions": [it.P_USAGE_READ]},
    ]
    return it.write_catalog(cfg, tag)


def stream_parts(r, what):
    """(the data payloads of a stream's events, the usage chunks among them, ended with [DONE])."""
    check(r.status == 200, "%s: %s" % (what, r.brief()))
    datas = [it.event_data(t) for _, t in it.sse_events(r)]
    usage = []
    for d in datas:
        if d == "[DONE]":
            continue
        try:
            o = json.loads(d)
        except ValueError:
            raise it.TestFailure("%s: an event is not JSON: %r" % (what, d[:200]))
        if isinstance(o, dict) and o.get("choices") == [] and "usage" in o:
            usage.append(o["usage"])
    return datas, usage, bool(datas) and datas[-1] == "[DONE]"


# ===== 1. one event per request ====================================================================

@it.test("ledger: one spend event per dispatched request with every field of API.md 3.4; refusals and replays make none")
def t_ledger_events():
    H = it.H
    gid = new_group("ledger-events", fallbacks={"Kimi-K3": ["GLM-5.3-Flash"]}, cache_ttl=60,
                    max_parallel_requests=1, max_budget=5)
    k1, s1 = it.create_key(gid)
    k2, s2 = it.create_key(gid)
    want = {}          # request id -> (what, expected fields)
    header_cost = {}   # request id -> x-ltg-cost
    no_event = []      # (what, request id or None)
    calls0 = upstream_calls()

    # A plain success (a cache miss).
    body_a = it.chat_body(content="ledger events: a plain success")
    r = ok200(call(s1, body_a), "the success")
    check(r.header("x-ltg-cache") == "miss", "the first call on a cached group: x-ltg-cache %r" % r.header("x-ltg-cache"))
    rid = rid_of(r, "the success")
    tok_a = last_prompt_tokens()
    want[rid] = ("the success", dict(requested_model="Kimi-K3", model="Kimi-K3", attempts=1, status="succeeded",
                                    http_status=200, cache_hit=False, usage_status="reported", input_tokens=tok_a,
                                    output_tokens=3, token_key_id=k1["id"],
                                    attempt_log=[("Kimi-K3", 1, 200, "ok")]))
    header_cost[rid] = r.header("x-ltg-cost")

    # The same body again: a cache hit.
    r = ok200(call(s1, body_a), "the cache hit")
    check(r.header("x-ltg-cache") == "hit", "the second identical call: x-ltg-cache %r" % r.header("x-ltg-cache"))
    rid = rid_of(r, "the cache hit")
    want[rid] = ("the cache hit", dict(requested_model="Kimi-K3", model="Kimi-K3", attempts=0, status="succeeded",
                                      http_status=200, cache_hit=True, cost=0, input_tokens=tok_a, output_tokens=3,
                                      usage_status="reported", attempt_log=[]))
    header_cost[rid] = r.header("x-ltg-cost")

    # A 503 from Kimi-K3, then its fallback answers.
    script("kimi-k3", ["status=503"])
    r = ok200(call(s1, it.chat_body(content="ledger events: a fallback after a 503")), "the fallback")
    check(r.header("x-ltg-served-model") == "GLM-5.3-Flash" and r.header("x-ltg-attempts") == "2",
          "the fallback: served %r after %r attempts" % (r.header("x-ltg-served-model"), r.header("x-ltg-attempts")))
    rid = rid_of(r, "the fallback")
    want[rid] = ("the fallback", dict(requested_model="Kimi-K3", model="GLM-5.3-Flash", attempts=2, status="succeeded",
                                     http_status=200, cache_hit=False, usage_status="reported",
                                     input_tokens=last_prompt_tokens(), output_tokens=3,
                                     attempt_log=[("Kimi-K3", 1, 503, "indeterminate"), ("GLM-5.3-Flash", 1, 200, "ok")]))
    header_cost[rid] = r.header("x-ltg-cost")

    # A terminal 400: relayed, no fallback.
    r = call(s1, it.chat_body(content="ledger events: a terminal 400", directive="status=400"))
    check(r.status == 400, "the terminal 400: %s" % r.brief())
    rid = rid_of(r, "the terminal 400")
    want[rid] = ("the terminal 400", dict(requested_model="Kimi-K3", model=None, attempts=1, status="failed",
                                         http_status=400, cache_hit=False, cost=0, usage_status="reported",
                                         input_tokens=0, output_tokens=0,     # a refusal is not billed
                                         attempt_log=[("Kimi-K3", 1, 400, "terminal")]))

    # A stream cut after its first event: partial, http_status 200.
    r = call(s1, it.chat_body(content="ledger events: a cut stream", stream=True, directive="cut_after=1"))
    datas, _, done = stream_parts(r, "the cut stream")
    check(not done and any("stream_interrupted" in d for d in datas),
          "the cut stream should end with the stream_interrupted error event and no [DONE]: %r" % datas[-2:])
    rid = rid_of(r, "the cut stream")
    want[rid] = ("the cut stream", dict(requested_model="Kimi-K3", model="Kimi-K3", attempts=1, status="partial",
                                       http_status=200, cache_hit=False, usage_status="estimated"))  # its usage never came

    # max_parallel_requests 1: a slow request in flight, the next ones get 429 and leave no event.
    slow_directive = unique_delay(3000)
    marks = mock_marks(slow_directive)
    body_slow = it.chat_body(content="ledger events: the slow one", directive=slow_directive)
    slow = Bg(lambda: call(s1, body_slow))
    wait_marks(slow_directive, marks + 1)
    for what, key in (("429 (same key)", s1), ("429 (other key)", s2)):
        r = call(key, it.chat_body(content="ledger events: refused, parallel"))
        it.check_openai_error(r, 429, "too_many_parallel_requests")
        no_event.append((what, r.header("x-ltg-request-id")))
    check(slow.alive(), "the slow request ended before the 429s were answered: the test proves nothing")
    r = ok200(slow.join(), "the slow request")
    rid = rid_of(r, "the slow request")
    want[rid] = ("the slow request", dict(model="Kimi-K3", attempts=1, status="succeeded", http_status=200,
                                         cache_hit=False, usage_status="reported", output_tokens=3))
    header_cost[rid] = r.header("x-ltg-cost")

    # The second key: one event, then revoked: 401, no event.
    r = ok200(call(s2, it.chat_body(content="ledger events: the second key")), "the second key")
    rid = rid_of(r, "the second key")
    want[rid] = ("the second key", dict(token_key_id=k2["id"], model="Kimi-K3", status="succeeded"))
    revoke(k2["id"])
    r = call(s2, it.chat_body(content="ledger events: revoked"))
    it.check_openai_error(r, 401, "invalid_api_key")
    no_event.append(("401 (revoked key)", r.header("x-ltg-request-id")))

    # Refused before dispatch: a model outside allowed_models, a budget too small for the worst case.
    before = upstream_calls()
    r = call(s1, it.chat_body(model="Down-Model", content="ledger events: not allowed"))
    it.check_openai_error(r, 403, "model_not_allowed")
    no_event.append(("403 model_not_allowed", r.header("x-ltg-request-id")))
    r = call(s1, it.chat_body(content="ledger events: over budget", max_tokens=10 ** 7))
    it.check_openai_error(r, 403, "budget_exceeded")
    no_event.append(("403 budget_exceeded", r.header("x-ltg-request-id")))
    check(upstream_calls() == before, "a request refused before dispatch reached the provider")

    # An idempotent request: one event; its replay none.
    idem = {"Idempotency-Key": "ledger-events-" + os.urandom(6).hex()}
    body_i = it.chat_body(content="ledger events: idempotent")
    r = ok200(call(s1, body_i, idem), "the idempotent request")
    rid = rid_of(r, "the idempotent request")
    want[rid] = ("the idempotent request", dict(model="Kimi-K3", status="succeeded", attempts=1))
    header_cost[rid] = r.header("x-ltg-cost")
    r = ok200(call(s1, body_i, idem), "its replay")
    check(r.header("x-ltg-replayed") == "true", "the replay: x-ltg-replayed %r" % r.header("x-ltg-replayed"))
    no_event.append(("the idempotent replay", r.header("x-ltg-request-id")))

    evs = events_of(gid)
    got = event_by_rid(evs, "group events")
    missing = [w for rid, (w, _) in want.items() if rid not in got]
    check(not missing, "no spend event for: %s (the group's events: %r)" % (", ".join(missing), [e.get("request_id") for e in evs]))
    extra = [e for e in evs if e["request_id"] not in want]
    for what, rid in no_event:
        check(rid is None or rid not in got, "%s made a spend event: %r" % (what, got.get(rid)))
    check(not extra, "%d spend event(s) nobody expected (a refusal or a replay?): %r" % (len(extra), extra))
    for rid, (what, fields) in want.items():
        check_event(got[rid], what, request_id=rid, token_group_id=gid, **fields)
    for rid, hc in header_cost.items():
        ev = got[rid]
        check(hc is not None, "%s: no x-ltg-cost header" % want[rid][0])
        check(micro(hc) == micro(ev["cost"] or 0), "%s: x-ltg-cost %r but the event's cost is %r" % (want[rid][0], hc, ev["cost"]))
    check(len(set(e["id"] for e in evs)) == len(evs), "two events share an id: %r" % [e["id"] for e in evs])
    times = [iso_ms(e["created_at"]) for e in evs]
    check(times == sorted(times), "events are not in created_at order: %r" % [e["created_at"] for e in evs])
    check(upstream_calls() - calls0 == 8, "the mock saw %d calls, want 8 (success, 503 + fallback, 400, stream, slow, "
          "second key, idempotent)" % (upstream_calls() - calls0))


@it.test("ledger: a client that leaves: abandoned with http_status 499, mid-stream (charged) or before the answer (its answer "
         "read to the end and charged the usage it reports)")
def t_ledger_client_gone():
    gid = new_group("ledger-gone")
    k, s = it.create_key(gid)
    # Mid-stream first (its checks do not depend on the other's).
    c = it.Conn(it.H.port, timeout=20)
    try:
        c.send(it.http_request("POST", "/v1/chat/completions",
                               it.chat_body(content="gone mid-stream", stream=True, directive="event_delay_ms=400 events=30"),
                               auth=s))
        r = c.read_head(20)
        check(r.status == 200, "the stream: %d" % r.status)
        first = c.read_chunk(time.monotonic() + 20)
        check(first and b"data:" in first, "the stream's first chunk %r" % first)
    finally:
        c.close()
    ev = wait_events(gid, 1)[0]
    check_event(ev, "the stream whose client left", status="abandoned", http_status=499, model="Kimi-K3",
                token_key_id=k["id"], attempts=1)
    check(ev["cost"] > 0, "a stream that reached the provider costs something: %r" % ev)
    # Before the answer's head.
    d = unique_delay(2000)
    marks = mock_marks(d)
    c = it.Conn(it.H.port, timeout=20)
    try:
        c.send(it.http_request("POST", "/v1/chat/completions", it.chat_body(content="gone", directive=d), auth=s))
        wait_marks(d, marks + 1)
    finally:
        c.close()
    evs = wait_events(gid, 2)
    check(len(evs) == 2, "events %r" % evs)
    check_event(evs[1], "the request whose client left before the answer", status="abandoned", http_status=499,
                model=None, usage_status="reported", requested_model="Kimi-K3", token_key_id=k["id"])
    check(evs[1]["cost"] > 0 and evs[1]["attempt_log"][0]["input_tokens"] > 0, "the answer it did not wait for was billed: %r" % evs[1])


# ===== 2. query rules =============================================================================

@it.test("ledger: /spend/events ranges, filters, pages, aliases, %5B%5D, snapshots, permissions")
def t_ledger_query():
    day_at_start = day(0)
    gid = new_group("ledger-query")
    other = new_group("ledger-query-empty")
    ka, sa = it.create_key(gid)
    kb, sb = it.create_key(gid)
    rids = []
    who = "aababaa"
    for i, s in enumerate(sa if w == "a" else sb for w in who):
        r = ok200(call(s, it.chat_body(content="ledger query %d" % i)), "call %d" % i)
        rids.append(rid_of(r, "call %d" % i))
    n = len(rids)
    g = "token_group_id=" + gid

    def ids(j):
        return [e["request_id"] for e in j["data"]]

    def bad(q, status=400, code=it.ANY, what=None):
        what = what or "GET /spend/events?%s" % q
        r = spend_query(q)
        check(r.status == status, "%s: expected %d, got %s (GET /spend/events?%s)" % (what, status, r.brief(), q))
        it.check_admin_error(r, status, code, what=what)

    # Ranges: half-open UTC days.
    j = spend_page("%s&%s&page[size]=1000" % (wide(), g))
    check(ids(j) == rids, "the wide range: %r, want %r" % (ids(j), rids))
    today = day(0)
    if today == day_at_start:
        j = spend_page("start_date=%s&end_date=%s&%s" % (today, day(1), g))
        check(ids(j) == rids, "[today, tomorrow): %r, want %r" % (ids(j), rids))
        for a, b in ((day(-1), today), (day(1), day(2)), (day(-5), day(-1))):
            j = spend_page("start_date=%s&end_date=%s&%s" % (a, b, g))
            check(j["data"] == [] and j["meta"]["total_results"] == 0,
                  "[%s, %s) holds today's events (the range is half-open): %r" % (a, b, ids(j)))
        # Neither date: yesterday, so none of today's events.
        j = spend_page(g)
        check(j["data"] == [] and j["meta"]["total_results"] == 0,
              "no dates (yesterday) returned today's events: %r" % ids(j))
    # At most 31 days; exactly 31 is fine.
    j = spend_page("start_date=%s&end_date=%s&%s" % (day(-29), day(2), g))
    check(ids(j) == rids, "a 31-day range: %r" % ids(j))
    bad("start_date=%s&end_date=%s&%s" % (day(-30), day(2), g), what="a 32-day range")
    bad("start_date=2026-01-01&end_date=2026-02-02", what="a 32-day range")
    bad("start_date=%s&end_date=%s" % (today, today), what="start_date == end_date")
    bad("start_date=%s&end_date=%s" % (day(1), today), what="start_date > end_date")
    bad("start_date=%s" % today, what="start_date alone")
    bad("end_date=%s" % today, what="end_date alone")
    # Bad dates, each next to a good one that would make a valid range if the bad one were read
    # leniently (so that a 400 is the date's, not the range's).
    for a, b in (("2026-02-30", "2026-03-10"), ("2026-13-01", "2027-01-10"), ("2026-01-00", "2026-01-10"),
                 ("2026-1-05", "2026-01-10"), ("26-01-05", "0026-01-10"), ("2026/01/05", "2026-01-10"),
                 ("20260105", "2026-01-10"), ("", "2026-01-10"), ("2026-01-05T00:00:00Z", "2026-01-10"),
                 ("2026-01-0a", "2026-01-10"), ("yesterday", "2026-01-10"), ("2025-02-29", "2025-03-10"),
                 ("2026-01-05x", "2026-01-10"), ("2026-01-5", "2026-01-10")):
        bad("start_date=%s&end_date=%s" % (a, b), what="start_date=%r" % a)
    for a, b in (("2026-02-20", "2026-02-30"), ("2026-12-20", "2026-13-01"), ("2026-01-01", "2026-1-10"),
                 ("2026-01-01", "2026/01/10"), ("2026-01-01", "20260110"), ("2026-01-01", ""),
                 ("2026-01-01", "2026-01-10T00:00:00Z"), ("2026-01-01", "2026-01-1a"), ("2026-01-01", "tomorrow")):
        bad("start_date=%s&end_date=%s" % (a, b), what="end_date=%r" % b)

    # Pages: meta, aliases, percent-encoded brackets.
    j = spend_page("%s&%s" % (wide(), g))
    m = j["meta"]
    check(m.get("page_size") == 50 and m.get("page_number") == 1, "default meta %r" % m)
    pages = []
    snap = None
    for p in range(1, 6):
        j = spend_page("%s&%s&page[size]=2&page[number]=%d" % (wide(), g, p))
        m = j["meta"]
        for f in ("page_number", "page_size", "total_results", "total_pages", "has_more", "snapshot"):
            check(f in m, "page %d: meta lacks %s: %r" % (p, f, m))
        check((m["page_number"], m["page_size"], m["total_results"], m["total_pages"], m["has_more"]) ==
              (p, 2, n, 4, p < 4), "page %d meta %r, want total 7, 4 pages" % (p, m))
        check(isinstance(m["snapshot"], str) and m["snapshot"], "meta.snapshot %r" % m["snapshot"])
        check(ids(j) == rids[(p - 1) * 2:p * 2], "page %d: %r, want %r" % (p, ids(j), rids[(p - 1) * 2:p * 2]))
        pages.append(ids(j))
    for q in ("page_number=3&page_size=2", "page%5Bnumber%5D=3&page%5Bsize%5D=2", "page%5bnumber%5d=3&page_size=2"):
        j = spend_page("%s&%s&%s" % (wide(), g, q))
        check(ids(j) == pages[2] and j["meta"]["page_number"] == 3 and j["meta"]["page_size"] == 2,
              "%s: %r %r, want %r" % (q, ids(j), j["meta"], pages[2]))
    spend_page("%s&%s&page[size]=1000" % (wide(), g))
    bad("%s&page[size]=1001" % wide(), what="page[size]=1001")
    bad("%s&page_size=1001" % wide(), what="page_size=1001")
    bad("%s&page%%5Bsize%%5D=1001" % wide(), what="page%5Bsize%5D=1001")
    bad("%s&page[size]=0" % wide(), what="page[size]=0")
    bad("%s&page[number]=0" % wide(), what="page[number]=0")

    # Filters.
    of_a = [r for r, w in zip(rids, who) if w == "a"]
    of_b = [r for r, w in zip(rids, who) if w == "b"]
    for q, want_ids in (("token_key_id=" + ka["id"], of_a),
                        ("token_key_id=" + kb["id"], of_b),
                        ("%s&token_key_id=%s" % (g, kb["id"]), of_b),
                        ("token_group_id=" + other, []),
                        ("%s&token_key_id=%s" % (g, it.H.key_id), []),
                        ("token_key_id=no-such-key", [])):
        j = spend_page("%s&%s&page[size]=1000" % (wide(), q))
        check(ids(j) == want_ids and j["meta"]["total_results"] == len(want_ids),
              "filter %s: %r, want %r" % (q, ids(j), want_ids))
    j = spend_page("%s&page[size]=1000" % wide())
    check(set(rids) <= set(ids(j)) or j["meta"]["total_results"] > 1000, "no filter: this group's events are missing")

    # Snapshots: later pages see the events of page 1's moment.
    j = spend_page("%s&%s&page[size]=2" % (wide(), g))
    snap = j["meta"]["snapshot"]
    first = ids(j)
    new = [rid_of(ok200(call(sa, it.chat_body(content="ledger query late %d" % i)), "late call"), "late call")
           for i in range(3)]
    seen = list(first)
    for p in range(2, 6):
        j = spend_page("%s&%s&page[size]=2&page[number]=%d&page[snapshot]=%s" % (wide(), g, p, snap))
        m = j["meta"]
        check(m["total_results"] == n and m["total_pages"] == 4 and m["has_more"] == (p < 4),
              "page %d under the snapshot: meta %r, want the 7 events of the snapshot" % (p, m))
        check(m.get("snapshot") == snap, "page %d: meta.snapshot %r, want %r" % (p, m.get("snapshot"), snap))
        seen += ids(j)
    check(seen == rids, "the pages under the snapshot: %r, want exactly %r (new: %r)" % (seen, rids, new))
    j = spend_page("%s&%s&page_size=2&page_number=1&snapshot=%s" % (wide(), g, snap))
    check(ids(j) == first, "page 1 under the snapshot (alias snapshot=): %r, want %r" % (ids(j), first))
    j = spend_page("%s&%s&page%%5Bsize%%5D=2&page%%5Bnumber%%5D=4&page%%5Bsnapshot%%5D=%s" % (wide(), g, snap))
    check(ids(j) == rids[6:], "page 4 under the snapshot (%%5B%%5D): %r" % ids(j))
    j = spend_page("%s&%s&page[size]=1000" % (wide(), g))
    check(ids(j) == rids + new and j["meta"]["total_results"] == n + 3, "without the snapshot: %r" % ids(j))
    for q in ("%s&%s&token_key_id=%s" % (wide(), g, ka["id"]),
              "start_date=%s&end_date=%s&%s" % (day(-2), day(2), g),
              wide(),
              "%s&token_group_id=%s" % (wide(), other)):
        r = spend_query("%s&page[size]=2&page[number]=2&page[snapshot]=%s" % (q, snap))
        it.check_admin_error(r, 409, "snapshot_mismatch", what="other filters under the snapshot (%s)" % q)
    r = spend_query("%s&%s&page[snapshot]=not-a-snapshot" % (wide(), g))
    check(400 <= r.status < 500, "a made-up snapshot: %s" % r.brief())

    # Permissions: spend.read (the harness's limited keys).
    for path in ("/spend/events?" + wide(), "/usage/summary?" + wide()):
        r = it.admin("GET", path, key=it.limited_key("groups_read"))
        it.check_admin_error(r, 403, "permission_denied", what="GET %s with only token_groups.read" % path)
        r = it.admin("GET", path, key=it.limited_key("spend"))
        it.check_admin_ok(r, 200, "GET %s with spend.read and usage.read" % path)
        r = it.admin("GET", path, key=sa)
        it.check_admin_error(r, 401, it.ANY, what="GET %s with a token key" % path)

    # Lenient date parsing: each part must be digits.
    for a in ("2026-01-%2B5", "2026-01-%205", "2026-%2B1-05", "2026-01-%2D5"):
        bad("start_date=%s&end_date=2026-01-10" % a, what="start_date=%r (percent-decoded)" % a)


@it.test("ledger: /spend/events needs spend.read, /usage/summary needs usage.read (one without the other)")
def t_ledger_permissions():
    with it.running(it.Aux("ledger-perms-" + os.urandom(3).hex(), config=aux_config("perms"))) as a:
        ev = "/spend/events?" + wide()
        us = "/usage/summary?" + wide()
        it.check_admin_ok(it.admin("GET", ev, key=SPEND_ONLY_KEY, port=a.admin_port), 200, "events with spend.read")
        it.check_admin_error(it.admin("GET", us, key=SPEND_ONLY_KEY, port=a.admin_port), 403, "permission_denied",
                             what="the summary with only spend.read")
        it.check_admin_ok(it.admin("GET", us, key=USAGE_ONLY_KEY, port=a.admin_port), 200, "the summary with usage.read")
        it.check_admin_error(it.admin("GET", ev, key=USAGE_ONLY_KEY, port=a.admin_port), 403, "permission_denied",
                             what="the events with only usage.read")
        it.check_admin_error(it.admin("GET", ev, key=it.limited_key("groups_read"), port=a.admin_port), 403,
                             "permission_denied", what="the events with only token_groups.read")


# ===== 3. usage summary ===========================================================================

def charged_of(ev, reservations):
    """What an event charged the group, in micro-USD: its cost, always (README "Cost")."""
    return micro(ev["cost"])


def usage_rows(evs, reservations):
    def empty():
        return dict((f, 0) for f in USAGE_FIELDS)

    def add(row, ev):
        row["requests"] += 1
        row[ev["status"] + "_requests"] += 1
        row["cache_hits"] += 1 if ev["cache_hit"] else 0
        for f in TOKEN_CLASSES:
            row[f] += ev[f]
        row["spend"] += charged_of(ev, reservations)

    total, by_day, by_model = empty(), {}, {}
    for ev in evs:
        add(total, ev)
        add(by_day.setdefault(ev["created_at"][:10], empty()), ev)
        add(by_model.setdefault(ev["model"] or ev["requested_model"], empty()), ev)
    return total, by_day, by_model


def check_row(got, want, what):
    check(isinstance(got, dict), "%s: %r" % (what, got))
    for f in USAGE_FIELDS:
        check(f in got, "%s lacks %s: %r" % (what, f, got))
        g = micro(got[f]) if f in ("spend", "reserved_spend") else got[f]
        check(g == want[f], "%s: %s is %r, want %s (row %r)"
              % (what, f, got[f], "%.6f" % (want[f] / 1e6) if f in ("spend", "reserved_spend") else want[f], got))


@it.test("ledger: /usage/summary totals, by_day (zero days too), by_model agree with the events")
def t_usage_summary():
    day_at_start = day(0)
    gid = new_group("usage-summary", cache_ttl=60)
    k, s = it.create_key(gid)
    res = {}
    ok200(call(s, it.chat_body(content="summary one")), "call 1")
    r = ok200(call(s, it.chat_body(content="summary one")), "the cache hit")
    check(r.header("x-ltg-cache") == "hit", "the cache hit: x-ltg-cache %r" % r.header("x-ltg-cache"))
    ok200(call(s, it.chat_body(model="GLM-5.3-Flash", content="summary glm")), "the GLM call")
    check(call(s, it.chat_body(content="summary 400", directive="status=400")).status == 400, "the 400")
    cut = it.chat_body(content="summary cut", stream=True, directive="cut_after=1", max_tokens=10)
    r = call(s, cut)
    check(r.status == 200, "the cut stream: %s" % r.brief())
    res[rid_of(r, "the cut stream")] = worst_case(cut, 10)
    r = call(s, it.chat_body(model="GLM-5.3-Flash", content="summary stream", stream=True, directive="events=5"))
    stream_parts(r, "the GLM stream")
    evs = events_of(gid)
    check(len(evs) == 6, "6 events expected, got %d: %r" % (len(evs), evs))
    total, by_day, by_model = usage_rows(evs, res)
    check(total["cache_hits"] == 1 and total["partial_requests"] == 1 and total["failed_requests"] == 1,
          "the events themselves: %r" % total)

    r = it.admin("GET", "/usage/summary?token_group_id=%s&%s" % (gid, wide()))
    d = it.check_admin_ok(r, 200, "GET /usage/summary")["data"]
    for f in ("totals", "by_day", "by_model"):
        check(f in d, "the summary lacks %s: %r" % (f, d))
    check_row(d["totals"], total, "totals")
    dates = [day(-1), day(0), day(1)]
    check([row.get("date") for row in d["by_day"]] == dates, "by_day dates %r, want %r (every day of the range)"
          % ([row.get("date") for row in d["by_day"]], dates))
    zero = dict((f, 0) for f in USAGE_FIELDS)
    for row in d["by_day"]:
        check_row(row, by_day.get(row["date"], zero), "by_day %s" % row["date"])
    got_models = dict((row.get("model"), row) for row in d["by_model"])
    check(sorted(got_models) == sorted(by_model), "by_model models %r, want %r" % (sorted(got_models), sorted(by_model)))
    for m, want in by_model.items():
        check_row(got_models[m], want, "by_model %s" % m)
    # The group's spend is what its events charged (uncapped: what it has spent so far).
    g, _ = it.get_group(gid)
    check(micro(g["spend"]) == total["spend"], "the group's spend %r, but its events charged %.6f" % (g["spend"], total["spend"] / 1e6))

    # Ranges as for the events: 31 days gives 31 rows, 32 is 400, neither is yesterday.
    r = it.admin("GET", "/usage/summary?token_group_id=%s&start_date=%s&end_date=%s" % (gid, day(-29), day(2)))
    d = it.check_admin_ok(r, 200, "a 31-day summary")["data"]
    check(len(d["by_day"]) == 31 and d["by_day"][0]["date"] == day(-29) and d["by_day"][-1]["date"] == day(1),
          "a 31-day summary: %d rows from %r to %r" % (len(d["by_day"]), d["by_day"][0].get("date"), d["by_day"][-1].get("date")))
    check_row(d["totals"], total, "31-day totals")
    r = it.admin("GET", "/usage/summary?token_group_id=%s&start_date=%s&end_date=%s" % (gid, day(-30), day(2)))
    it.check_admin_error(r, 400, it.ANY, what="a 32-day summary")
    r = it.admin("GET", "/usage/summary?token_group_id=%s&start_date=%s" % (gid, day(0)))
    it.check_admin_error(r, 400, it.ANY, what="a summary with start_date alone")
    if day(0) == day_at_start:
        r = it.admin("GET", "/usage/summary?token_group_id=%s" % gid)
        d = it.check_admin_ok(r, 200, "a summary without dates")["data"]
        check([row.get("date") for row in d["by_day"]] == [day(-1)], "no dates: by_day %r, want yesterday only" % d["by_day"])
        check_row(d["totals"], zero, "no dates (yesterday): totals")
    # Without a group: every group, so at least this one's.
    r = it.admin("GET", "/usage/summary?" + wide())
    d = it.check_admin_ok(r, 200, "a summary of every group")["data"]
    check(d["totals"]["requests"] >= total["requests"], "every group: totals %r" % d["totals"])
    r = it.admin("GET", "/usage/summary?token_group_id=%s&%s" % (new_group("usage-empty"), wide()))
    check_row(it.check_admin_ok(r, 200, "a group without events")["data"]["totals"], zero, "a group without events")


# ===== 4. budgets =================================================================================

@it.test("budget: concurrent requests never pass max_budget; the rest get 403 budget_exceeded without an upstream call")
def t_budget_concurrent():
    H = it.H
    directive = unique_delay(5000)
    n = 6

    def body(i):
        return it.chat_body(content="budget-%02d" % i, directive=directive, max_tokens=1000)

    w = worst_case(body(0), 1000)
    check(all(worst_case(body(i), 1000) == w for i in range(n)), "bodies of different sizes")
    budget = 2 * w + w // 2            # two fit, a third does not
    gid = new_group("budget-concurrent", allowed_models=["Kimi-K3"], max_budget=budget / 1e6)
    k, s = it.create_key(gid)
    g0, _ = it.get_group(gid)
    check(micro(g0["max_budget"]) == budget and micro(g0["spend"]) == 0 and micro(g0["reserved_spend"]) == 0,
          "the new group: %r" % g0)
    marks = mock_marks(directive)
    calls0 = upstream_calls()
    barrier = threading.Barrier(n)
    sent = [None] * n

    def worker(i):
        data = it.http_request("POST", "/v1/chat/completions", body(i), auth=s)
        barrier.wait(20)
        with it.Conn(H.port, timeout=60) as c:
            c.send(data)
            sent[i] = time.monotonic()
            r = c.read_final_response(60)
            return time.monotonic(), r

    workers = [Bg(lambda i=i: worker(i)) for i in range(n)]
    wait_marks(directive, marks + 2)
    # While the two admitted requests are in flight, their reservations show.
    g1, _ = it.get_group(gid)
    r = it.admin("GET", "/usage/summary?token_group_id=%s&%s" % (gid, wide()))
    summ = it.check_admin_ok(r, 200, "the summary in flight")["data"]
    t_read = time.monotonic()
    results = [x.join(90) for x in workers]
    oks = [(t, r) for t, r in results if r.status == 200]
    refused = [(t, r) for t, r in results if r.status != 200]
    first_ok = min([t for t, _ in oks] or [time.monotonic()])
    check(max(sent) < first_ok, "a request was sent only after an admitted one had finished (%.1f s late): the "
          "machine is too slow for this test's timing" % (max(sent) - first_ok))
    check(len(oks) == 2, "%d of %d concurrent requests were admitted; with a budget for 2 worst cases (%d micro-USD "
          "each, budget %d) exactly 2 fit: %r" % (len(oks), n, w, budget, [r.brief() for _, r in results]))
    for t, r in refused:
        it.check_openai_error(r, 403, "budget_exceeded")
        check(t < first_ok, "a 403 came after an admitted request finished: it waited")
    check(mock_marks(directive) == marks + 2 and upstream_calls() - calls0 == 2,
          "the mock saw %d calls, want 2: a refused request reached the provider" % (upstream_calls() - calls0))
    if t_read < first_ok:
        check(micro(g1["reserved_spend"]) == 2 * w, "reserved_spend in flight %r, want 2 x %d micro-USD"
              % (g1["reserved_spend"], w))
        check(micro(g1["spend"]) == 0, "spend in flight %r, want 0" % g1["spend"])
    evs = events_of(gid)
    check(len(evs) == 2, "2 events expected, got %r" % evs)
    byrid = event_by_rid(evs, "budget events")
    for t, r in oks:
        ev = byrid.get(rid_of(r, "an admitted request"))
        check(ev is not None, "no event for an admitted request")
        check_event(ev, "an admitted request", status="succeeded", model="Kimi-K3")
        check(micro(r.header("x-ltg-cost")) == micro(ev["cost"]), "x-ltg-cost %r, event cost %r" % (r.header("x-ltg-cost"), ev["cost"]))
        left = r.header("x-ltg-budget-remaining")
        check(left is not None and 0 <= micro(left) <= budget, "x-ltg-budget-remaining %r" % left)
    g2, _ = it.get_group(gid)
    spent = sum(micro(ev["cost"]) for ev in evs)
    check(micro(g2["spend"]) == spent, "spend after the requests %r, want the sum of their costs %.6f" % (g2["spend"], spent / 1e6))
    check(micro(g2["reserved_spend"]) == 0, "reserved_spend after the requests %r" % g2["reserved_spend"])
    check(spent <= budget, "spend %d passed the budget %d" % (spent, budget))
    # x-ltg-budget-remaining: the budget minus what is spent (nothing in flight).
    r = ok200(call(s, it.chat_body(content="budget after", max_tokens=1000)), "a call after")
    ev = event_by_rid(events_of(gid), "")[rid_of(r, "a call after")]
    check(micro(r.header("x-ltg-cost")) == micro(ev["cost"]), "x-ltg-cost %r, event %r" % (r.header("x-ltg-cost"), ev["cost"]))
    g3, _ = it.get_group(gid)
    check(micro(g3["spend"]) == spent + micro(ev["cost"]), "spend %r after one more call" % g3["spend"])
    left = r.header("x-ltg-budget-remaining")
    check(left is not None and micro(left) == budget - micro(g3["spend"]),
          "x-ltg-budget-remaining %r, want max_budget - spend = %.6f" % (left, (budget - micro(g3["spend"])) / 1e6))
    # A stream over the budget is refused the same way; an uncapped group has no budget header.
    before = upstream_calls()
    it.check_openai_error(call(s, it.chat_body(content="budget stream", stream=True, max_tokens=10 ** 6)), 403, "budget_exceeded")
    check(upstream_calls() == before, "a refused stream reached the provider")
    r = ok200(call(it.H.token, it.chat_body(content="uncapped")), "an uncapped group's call")
    check(r.header("x-ltg-cost") is not None and r.header("x-ltg-budget-remaining") is None,
          "uncapped: x-ltg-cost %r, x-ltg-budget-remaining %r (want absent)" % (r.header("x-ltg-cost"), r.header("x-ltg-budget-remaining")))
    # Last (so that a failure here hides nothing above): the summary showed the reservations too.
    if t_read < first_ok:
        check(micro(summ["totals"]["reserved_spend"]) == 2 * w, "GET /usage/summary?token_group_id= while 2 requests "
              "were in flight: totals.reserved_spend %r, want %.6f (GET /token_groups/{id} said reserved_spend %r)"
              % (summ["totals"]["reserved_spend"], 2 * w / 1e6, g1["reserved_spend"]))
        rows = [(row["date"], row["reserved_spend"]) for row in summ["by_day"] if micro(row["reserved_spend"])]
        check(rows == [(day(0), summ["totals"]["reserved_spend"])], "the summary in flight: by_day reserved %r" % rows)


@it.test("budget: the reservation is the first attempt's worst case (bytes / 3, the largest output limit or the default) "
         "at its model's prices, to the micro-dollar (a fallback is held when it starts)")
def t_budget_worst_case():
    gid = new_group("budget-worst", max_budget=1, fallbacks={"GLM-5.3-Flash": ["Kimi-K3"]})
    k, s = it.create_key(gid)
    gid2 = new_group("budget-worst-nofb", max_budget=1)
    k2, s2 = it.create_key(gid2)
    cases = (("GLM alone, max_tokens 100", gid2, s2, it.chat_body(model="GLM-5.3-Flash", content="w1", max_tokens=100),
              100, ("GLM-5.3-Flash",)),
             ("GLM with a Kimi-K3 fallback: GLM's prices, the first attempt's", gid, s,
              it.chat_body(model="GLM-5.3-Flash", content="w2", max_tokens=100), 100, ("GLM-5.3-Flash",)),
             ("max_completion_tokens", gid2, s2, it.chat_body(model="Kimi-K3", content="w3 " + "x" * 301,
                                                            max_completion_tokens=50), 50, ("Kimi-K3",)),
             ("no max_tokens: the model's max_output_tokens (4096)", gid2, s2, it.chat_body(model="Kimi-K3", content="w4"),
              None, ("Kimi-K3",)),
             ("a stream: the client's body", gid2, s2, it.chat_body(model="Kimi-K3", content="w5", stream=True, max_tokens=7),
              7, ("Kimi-K3",)))
    for what, g, key, body, mt, models in cases:
        w = worst_case(body, mt, models)
        spend = micro(it.get_group(g)[0]["spend"])
        n0 = upstream_calls()
        patch_group(g, {"max_budget": (spend + w - 1) / 1e6})
        r = call(key, body)
        it.check_openai_error(r, 403, "budget_exceeded")
        check(upstream_calls() == n0, "%s: a refused request reached the provider" % what)
        patch_group(g, {"max_budget": (spend + w) / 1e6})
        r = call(key, body)
        check(r.status == 200, "%s: with exactly the worst case (%d micro-USD) left the request must be admitted "
              "(spend + reserved + worst <= max_budget): %s" % (what, w, r.brief()))
        if body.get("stream"):
            stream_parts(r, what)


@it.test("idempotent inference: a first answer that came from the cache is replayed too (no second event)")
def t_idempotent_cache_hit():
    gid = new_group("idem-cache", cache_ttl=60)
    k, s = it.create_key(gid)
    b = it.chat_body(content="idem and cache")
    ok200(call(s, b), "the call that fills the cache")
    h = {"Idempotency-Key": "idem-cache-" + os.urandom(6).hex()}
    r1 = ok200(call(s, b, h), "the first call with the key (a cache hit)")
    check(r1.header("x-ltg-cache") == "hit", "the first keyed call: x-ltg-cache %r" % r1.header("x-ltg-cache"))
    r2 = ok200(call(s, b, h), "its retry")
    check(r2.body == r1.body, "the retry's body differs")
    n = len(events_of(gid))
    check(r2.header("x-ltg-replayed") == "true" and n == 2,
          "the retry of a keyed request answered from the cache: x-ltg-replayed %r, x-ltg-cache %r, %d events "
          "(want the first answer replayed, x-ltg-replayed: true, and no event: API.md 4.4)"
          % (r2.header("x-ltg-replayed"), r2.header("x-ltg-cache"), n))


@it.test("budget: max_budget 0 denies a paid request, not a free model")
def t_budget_zero():
    with it.running(it.Aux("ledger-zero-" + os.urandom(3).hex(), config=aux_config("zero"))) as a:
        gid = new_group("budget-zero", port=a.admin_port, allowed_models=["Kimi-K3", "Free-Model"], max_budget=0)
        k, s = it.create_key(gid, port=a.admin_port)
        before = upstream_calls()
        it.check_openai_error(call(s, it.chat_body(content="paid"), port=a.port), 403, "budget_exceeded")
        it.check_openai_error(call(s, it.chat_body(content="paid", max_tokens=1), port=a.port), 403, "budget_exceeded")
        check(upstream_calls() == before, "a paid request on a zero budget reached the provider")
        r = ok200(call(s, it.chat_body(model="Free-Model", content="free"), port=a.port), "the free model")
        check(upstream_calls() == before + 1, "the free model's call did not reach the provider")
        check(r.header("x-ltg-served-model") == "Free-Model", "served %r" % r.header("x-ltg-served-model"))
        check(micro(r.header("x-ltg-cost") or -1) == 0, "x-ltg-cost %r" % r.header("x-ltg-cost"))
        check(micro(r.header("x-ltg-budget-remaining") or -1) == 0, "x-ltg-budget-remaining %r" % r.header("x-ltg-budget-remaining"))
        stream_parts(call(s, it.chat_body(model="Free-Model", content="free stream", stream=True), port=a.port), "a free stream")
        evs = events_of(gid, port=a.admin_port)
        check(len(evs) == 2, "events %r" % evs)
        for ev in evs:
            check_event(ev, "a free call", model="Free-Model", status="succeeded")
            check(micro(ev["cost"]) == 0, "a free call cost %r" % ev["cost"])
        g, _ = it.get_group(gid, port=a.admin_port)
        check(micro(g["spend"]) == 0 and micro(g["reserved_spend"]) == 0, "the group %r" % g)


@it.test("budget: spend survives a restart (same --data), capped and uncapped groups")
def t_budget_restart():
    with it.running(it.Aux("ledger-restart-" + os.urandom(3).hex())) as a:
        p = a.admin_port
        capped = new_group("spend-restart-capped", port=p, max_budget=1, budget_duration="7d")
        lifetime = new_group("spend-restart-lifetime", port=p, max_budget=1)
        uncapped = new_group("spend-restart-uncapped", port=p)
        groups = (("capped (7d)", capped), ("capped (lifetime)", lifetime), ("uncapped", uncapped))
        for what, gid in groups:
            k, s = it.create_key(gid, port=p)
            ok200(call(s, it.chat_body(content="restart 1"), port=a.port), what)
            ok200(call(s, it.chat_body(model="GLM-5.3-Flash", content="restart 2"), port=a.port), what)
            check(call(s, it.chat_body(content="restart cut", stream=True, directive="cut_after=1", max_tokens=10),
                       port=a.port).status == 200, what)
        before = dict((gid, it.get_group(gid, port=p)[0]) for _, gid in groups)
        evs_before = dict((gid, events_of(gid, port=p)) for _, gid in groups)
        for what, gid in groups:
            check(micro(before[gid]["spend"]) > 0, "%s: spend %r before the restart" % (what, before[gid]["spend"]))
        a.stop()
        a.start()
        for what, gid in groups:
            g, _ = it.get_group(gid, port=p)
            check(events_of(gid, port=p) == evs_before[gid], "%s: the events changed across the restart" % what)
            check(g["spend"] == before[gid]["spend"], "%s: spend %r before the restart, %r after"
                  % (what, before[gid]["spend"], g["spend"]))
            check(micro(g["reserved_spend"]) == 0, "%s: reserved_spend %r after the restart" % (what, g["reserved_spend"]))
            check(g["budget_started_at"] == before[gid]["budget_started_at"] and g["resets_at"] == before[gid]["resets_at"],
                  "%s: the period moved across the restart: %r/%r -> %r/%r" % (what, before[gid]["budget_started_at"],
                  before[gid]["resets_at"], g["budget_started_at"], g["resets_at"]))


@it.test("budget: a PATCH of budget_duration starts a new period (budget_started_at moves, spend 0); of max_budget keeps it")
def t_budget_period():
    gid = new_group("budget-period", max_budget=1, budget_duration="7d")
    k, s = it.create_key(gid)
    g0, _ = it.get_group(gid)
    start0 = iso_ms(g0["budget_started_at"])
    check(abs(start0 - iso_ms(g0["created_at"])) <= 1000, "the first period starts at %r, created_at %r"
          % (g0["budget_started_at"], g0["created_at"]))
    check(iso_ms(g0["resets_at"]) == start0 + 7 * 86400000, "7d: resets_at %r, budget_started_at %r" % (g0["resets_at"], g0["budget_started_at"]))
    r = ok200(call(s, it.chat_body(content="period 1")), "call 1")
    c1 = micro(r.header("x-ltg-cost"))
    check(c1 > 0 and micro(r.header("x-ltg-budget-remaining")) == 1000000 - c1,
          "x-ltg-cost %r, x-ltg-budget-remaining %r" % (r.header("x-ltg-cost"), r.header("x-ltg-budget-remaining")))
    g1, _ = it.get_group(gid)
    check(micro(g1["spend"]) == c1, "spend %r after one call costing %d micro-USD" % (g1["spend"], c1))
    time.sleep(0.02)    # on purpose: times are in ms; a PATCH in the same ms could not show a period moving
    d = patch_group(gid, {"max_budget": 2})
    check(d["budget_started_at"] == g0["budget_started_at"] and micro(d["spend"]) == c1,
          "a new max_budget must keep the period: budget_started_at %r -> %r, spend %r"
          % (g0["budget_started_at"], d["budget_started_at"], d["spend"]))
    time.sleep(0.02)    # on purpose, as above: the new period must start a later ms
    d = patch_group(gid, {"budget_duration": "30d"})
    start1 = iso_ms(d["budget_started_at"])
    check(start1 > start0, "a new budget_duration must start a new period: budget_started_at %r -> %r"
          % (g0["budget_started_at"], d["budget_started_at"]))
    check(micro(d["spend"]) == 0, "spend in the new period %r, want 0" % d["spend"])
    check(iso_ms(d["resets_at"]) == start1 + 30 * 86400000, "30d: resets_at %r" % d["resets_at"])
    g2, _ = it.get_group(gid)
    check(micro(g2["spend"]) == 0 and g2["budget_started_at"] == d["budget_started_at"], "GET after the PATCH: %r" % g2)
    r = ok200(call(s, it.chat_body(content="period 2")), "call 2")
    c2 = micro(r.header("x-ltg-cost"))
    check(micro(r.header("x-ltg-budget-remaining")) == 2000000 - c2,
          "x-ltg-budget-remaining %r in the new period, want 2 - %.6f" % (r.header("x-ltg-budget-remaining"), c2 / 1e6))
    g3, _ = it.get_group(gid)
    check(micro(g3["spend"]) == c2, "spend %r in the new period, want only the new call's %.6f" % (g3["spend"], c2 / 1e6))
    time.sleep(0.02)    # on purpose, as above
    d = patch_group(gid, {"budget_duration": None})
    check(d["resets_at"] is None and iso_ms(d["budget_started_at"]) > start1 and micro(d["spend"]) == 0,
          "lifetime: a new period with no end: %r" % d)


# ===== 5. streams are metered ======================================================================

@it.test("ledger: streams are metered: usage without include_usage stays hidden but reaches the event")
def t_ledger_stream_metered():
    gid = new_group("stream-metered")
    k, s = it.create_key(gid)
    cases = (("no stream_options", {}, False, 3),
             ("include_usage true", {"stream_options": {"include_usage": True}}, True, 3),
             ("include_usage false", {"stream_options": {"include_usage": False}}, False, 3),
             ("no stream_options, 5 events", {"directive": "events=5"}, False, 5))
    rids = []
    for what, extra, client_wants, n_out in cases:
        r = call(s, it.chat_body(content="metered " + what, stream=True, **extra))
        datas, usage, done = stream_parts(r, what)
        check(done, "%s: no [DONE]" % what)
        up = json.loads(it.H.mock_last()["body"])
        check((up.get("stream_options") or {}).get("include_usage") is True,
              "%s: ltg did not ask the provider for usage: stream_options %r" % (what, up.get("stream_options")))
        tokens = last_prompt_tokens()
        if client_wants:
            check(len(usage) == 1 and usage[0].get("prompt_tokens") == tokens and usage[0].get("completion_tokens") == n_out,
                  "%s: the client asked for the usage chunk: %r" % (what, usage))
        else:
            check(not usage, "%s: the client did not ask for usage but got %r" % (what, usage))
        rids.append((what, rid_of(r, what), tokens, n_out))
    got = event_by_rid(events_of(gid), "stream events")
    for what, rid, tokens, n_out in rids:
        check(rid in got, "%s: no event" % what)
        check_event(got[rid], what, status="succeeded", usage_status="reported", input_tokens=tokens,
                    output_tokens=n_out, model="Kimi-K3", http_status=200)
        check(got[rid]["cost"] is not None, "%s: no cost" % what)


# ===== 6. cache ====================================================================================

@it.test("cache: hit without upstream call, miss, bypass (stream, header), policy before cache")
def t_cache():
    gid = new_group("cache", cache_ttl=60)
    k1, s1 = it.create_key(gid)
    k2, s2 = it.create_key(gid)
    b = it.chat_body(content="cache me")
    n0 = upstream_calls()
    r1 = ok200(call(s1, b), "the first call")
    check(r1.header("x-ltg-cache") == "miss" and r1.header("x-ltg-attempts") == "1",
          "the first call: x-ltg-cache %r, x-ltg-attempts %r" % (r1.header("x-ltg-cache"), r1.header("x-ltg-attempts")))
    check(upstream_calls() == n0 + 1, "the first call did not reach the provider")
    r2 = ok200(call(s1, b), "the second call")
    check(r2.header("x-ltg-cache") == "hit", "the second identical call: x-ltg-cache %r" % r2.header("x-ltg-cache"))
    check(r2.header("x-ltg-attempts") == "0", "a hit: x-ltg-attempts %r" % r2.header("x-ltg-attempts"))
    check(r2.header("x-ltg-served-model") == "Kimi-K3", "a hit: x-ltg-served-model %r" % r2.header("x-ltg-served-model"))
    check(micro(r2.header("x-ltg-cost") or -1) == 0, "a hit: x-ltg-cost %r" % r2.header("x-ltg-cost"))
    check(r2.body == r1.body, "the hit's body differs from the first answer")
    check(upstream_calls() == n0 + 1, "a cache hit reached the provider")
    ok200(call(s2, b), "another key of the group")
    check(upstream_calls() == n0 + 1, "the cache is per group: another key of the group missed")
    evs = event_by_rid(events_of(gid), "cache events")
    e1, e2 = evs[rid_of(r1, "r1")], evs[rid_of(r2, "r2")]
    check_event(e1, "the miss", cache_hit=False, attempts=1)
    check_event(e2, "the hit", cache_hit=True, attempts=0, cost=0, model="Kimi-K3", input_tokens=e1["input_tokens"],
                output_tokens=e1["output_tokens"], status="succeeded", http_status=200)
    # A different body misses; a stream bypasses.
    r = ok200(call(s1, it.chat_body(content="cache me too")), "another body")
    check(r.header("x-ltg-cache") == "miss" and upstream_calls() == n0 + 2, "another body: x-ltg-cache %r" % r.header("x-ltg-cache"))
    r = call(s1, it.chat_body(content="cache me", stream=True))
    stream_parts(r, "a stream")
    check(r.header("x-ltg-cache") == "bypass", "a stream on a cached group: x-ltg-cache %r" % r.header("x-ltg-cache"))
    check(upstream_calls() == n0 + 3, "the stream did not reach the provider")
    r = call(s1, it.chat_body(content="cache me", stream=True))
    check(r.header("x-ltg-cache") == "bypass" and upstream_calls() == n0 + 4, "a second stream was served from a cache")
    # x-ltg-cache: bypass neither reads nor writes.
    byp = {"x-ltg-cache": "bypass"}
    r = ok200(call(s1, b, byp), "bypass on a cached body")
    check(r.header("x-ltg-cache") == "bypass" and upstream_calls() == n0 + 5,
          "x-ltg-cache: bypass read the cache: x-ltg-cache %r" % r.header("x-ltg-cache"))
    bz = it.chat_body(content="never cached")
    ok200(call(s1, bz, byp), "bypass on a new body")
    r = ok200(call(s1, bz), "the new body without bypass")
    check(r.header("x-ltg-cache") == "miss" and upstream_calls() == n0 + 7,
          "x-ltg-cache: bypass wrote the cache: the next call says %r" % r.header("x-ltg-cache"))
    r = ok200(call(s1, bz), "the new body again")
    check(r.header("x-ltg-cache") == "hit" and upstream_calls() == n0 + 7, "the new body again: %r" % r.header("x-ltg-cache"))
    it.check_openai_error(call(s1, b, {"x-ltg-cache": "please"}), 400)
    # Policy before the cache.
    revoke(k2["id"])
    it.check_openai_error(call(s2, b), 401, "invalid_api_key")
    patch_group(gid, {"blocked": True})
    it.check_openai_error(call(s1, b), 403, "group_blocked")
    patch_group(gid, {"blocked": False, "max_budget": 0})
    it.check_openai_error(call(s1, b), 403, "budget_exceeded")
    patch_group(gid, {"max_budget": None, "allowed_models": ["GLM-5.3-Flash"]})
    it.check_openai_error(call(s1, b), 403, "model_not_allowed")
    check(upstream_calls() == n0 + 7, "a refused request reached the provider")
    patch_group(gid, {"allowed_models": list(it.TWO)})
    ok200(call(s1, b), "allowed again")
    # Another group with the same body: its own cache.
    g2 = new_group("cache-other", cache_ttl=60)
    _, so = it.create_key(g2)
    n1 = upstream_calls()
    r = ok200(call(so, b), "another group")
    check(r.header("x-ltg-cache") == "miss" and upstream_calls() == n1 + 1, "another group was served from this one's cache")
    # A group without cache_ttl: no x-ltg-cache header.
    r = ok200(call(it.H.token, b), "an uncached group")
    check(r.header("x-ltg-cache") is None, "a group without a cache: x-ltg-cache %r" % r.header("x-ltg-cache"))


@it.test("cache: an entry expires after cache_ttl")
def t_cache_ttl():
    gid = new_group("cache-ttl", cache_ttl=1)
    k, s = it.create_key(gid)
    b = it.chat_body(content="short-lived")
    n0 = upstream_calls()
    t0 = time.monotonic()
    r = ok200(call(s, b), "the first call")
    check(r.header("x-ltg-cache") == "miss", "first: %r" % r.header("x-ltg-cache"))
    r = ok200(call(s, b), "at once")
    if time.monotonic() - t0 < 0.8:
        check(r.header("x-ltg-cache") == "hit" and upstream_calls() == n0 + 1, "within the TTL: x-ltg-cache %r"
              % r.header("x-ltg-cache"))
    # Time passes on purpose: the 1 s TTL must expire (polling for a miss would accept any expiry).
    time.sleep(2.1)
    n1 = upstream_calls()
    r = ok200(call(s, b), "after the TTL")
    check(r.header("x-ltg-cache") == "miss" and upstream_calls() == n1 + 1,
          "2 s after a 1 s TTL: x-ltg-cache %r, upstream calls +%d" % (r.header("x-ltg-cache"), upstream_calls() - n1))


# ===== 7. idempotent inference =====================================================================

@it.test("idempotent inference: replay, conflict, in flight, per token key, kept answers, a client that leaves")
def t_idempotent():
    gid = new_group("idem")
    k, s = it.create_key(gid)
    k2, s2 = it.create_key(gid)

    def key():
        return {"Idempotency-Key": "idem-" + os.urandom(8).hex()}

    want_rids = []
    # Same key, same body: the first answer again, no upstream call, no event, no charge.
    h = key()
    b = it.chat_body(content="idem first")
    n0 = upstream_calls()
    r1 = ok200(call(s, b, h), "the first call")
    check(r1.header("x-ltg-replayed") is None, "the first call says x-ltg-replayed %r" % r1.header("x-ltg-replayed"))
    want_rids.append(rid_of(r1, "first"))
    spend1 = it.get_group(gid)[0]["spend"]
    r2 = ok200(call(s, b, h), "the replay")
    check(r2.header("x-ltg-replayed") == "true" and r2.header("x-ltg-attempts") == "0",
          "the replay: x-ltg-replayed %r, x-ltg-attempts %r" % (r2.header("x-ltg-replayed"), r2.header("x-ltg-attempts")))
    check(r2.body == r1.body, "the replay's body differs from the first answer")
    check(r2.header("x-ltg-served-model") == "Kimi-K3", "the replay: x-ltg-served-model %r" % r2.header("x-ltg-served-model"))
    check(upstream_calls() == n0 + 1, "the replay reached the provider")
    check(it.get_group(gid)[0]["spend"] == spend1, "the replay was charged")
    # Other body: 409 idempotency_conflict.
    it.check_openai_error(call(s, it.chat_body(content="idem other"), h), 409, "idempotency_conflict")
    it.check_openai_error(call(s, it.chat_body(content="idem first", stream=True), h), 409, "idempotency_conflict")
    check(upstream_calls() == n0 + 1, "a conflict reached the provider")
    # Keys are per token key: another key of the group with the same Idempotency-Key is a new request.
    r = ok200(call(s2, b, h), "another token key")
    check(r.header("x-ltg-replayed") is None and upstream_calls() == n0 + 2, "another token key got the first key's answer")
    want_rids.append(rid_of(r, "other key"))
    # In flight: 409 with Retry-After (same body); another body is still a conflict.
    h = key()
    d = unique_delay(3000)
    marks = mock_marks(d)
    bf = it.chat_body(content="idem in flight", directive=d)
    first = Bg(lambda: call(s, bf, h))
    wait_marks(d, marks + 1)
    r = call(s, bf, h)
    still = first.alive()
    it.check_openai_error(r, 409)
    check(r.header("retry-after") is not None, "409 in flight without Retry-After: %r" % r.headers)
    check(still, "the first request ended before the in-flight check was answered: the test proves nothing")
    it.check_openai_error(call(s, it.chat_body(content="idem in flight, other"), h), 409, "idempotency_conflict")
    r1 = ok200(first.join(), "the in-flight request")
    want_rids.append(rid_of(r1, "in flight"))
    r = ok200(call(s, bf, h), "after it ended")
    check(r.header("x-ltg-replayed") == "true" and r.body == r1.body, "after the first ended: not its replay")
    check(mock_marks(d) == marks + 1, "the in-flight request reached the provider twice")
    # A client that leaves before the answer: ltg finishes without it, the retry gets the answer.
    h = key()
    d = unique_delay(2000)
    marks = mock_marks(d)
    bl = it.chat_body(content="idem leaves", directive=d)
    c = it.Conn(it.H.port, timeout=20)
    try:
        c.send(it.http_request("POST", "/v1/chat/completions", bl, h, auth=s))
        wait_marks(d, marks + 1)
    finally:
        c.close()
    deadline = time.monotonic() + 30
    in_flight = 0
    while True:
        r = call(s, bl, h)
        if r.status == 409 and time.monotonic() < deadline:
            it.check_openai_error(r, 409)
            check(r.header("retry-after") is not None, "409 in flight without Retry-After")
            in_flight += 1
            time.sleep(0.3)
            continue
        break
    check(r.status == 200, "the retry after the client left: %s (the request was not finished without its client?)" % r.brief())
    check(r.header("x-ltg-replayed") == "true" and r.header("x-ltg-attempts") == "0",
          "the retry after the client left was not a replay: x-ltg-replayed %r" % r.header("x-ltg-replayed"))
    check(mock_marks(d) == marks + 1, "the retry after the client left reached the provider again (%d calls)"
          % (mock_marks(d) - marks))
    # A whole refusal of the provider is kept; a failure is not.
    h = key()
    b4 = it.chat_body(content="idem refused", directive="status=400")
    n1 = upstream_calls()
    r1 = call(s, b4, h)
    check(r1.status == 400, "the refusal: %s" % r1.brief())
    want_rids.append(rid_of(r1, "refusal"))
    r = call(s, b4, h)
    check(r.status == 400 and r.header("x-ltg-replayed") == "true" and r.body == r1.body and upstream_calls() == n1 + 1,
          "a provider's 400 is a whole answer: its retry should replay it: %s replayed %r" % (r.brief(), r.header("x-ltg-replayed")))
    h = key()
    b5 = it.chat_body(content="idem failed", directive="status=503")
    r = call(s, b5, h)
    check(r.status == 503, "the failure: %s" % r.brief())
    want_rids.append(rid_of(r, "failure"))
    r = call(s, b5, h)
    check(r.status == 503 and r.header("x-ltg-replayed") is None and upstream_calls() == n1 + 3,
          "a failure is not kept: its retry should try afresh: %s replayed %r" % (r.brief(), r.header("x-ltg-replayed")))
    want_rids.append(rid_of(r, "failure retried"))
    # A stream: its replay is its events.
    h = key()
    bs = it.chat_body(content="idem stream", stream=True)
    r1 = call(s, bs, h)
    d1, _, done = stream_parts(r1, "the stream")
    check(done, "the stream: no [DONE]")
    want_rids.append(rid_of(r1, "stream"))
    n2 = upstream_calls()
    r = call(s, bs, h)
    d2, usage, done = stream_parts(r, "the stream's replay")
    check(r.header("x-ltg-replayed") == "true" and d2 == d1 and not usage and upstream_calls() == n2,
          "the stream's replay: replayed %r, events %r, want %r" % (r.header("x-ltg-replayed"), d2[:3], d1[:3]))
    # Bad keys.
    it.check_openai_error(call(s, it.chat_body(content="idem long"), {"Idempotency-Key": "x" * 256}), 400)
    # One event per request that reached the provider, none for replays.
    evs = events_of(gid)
    rids = [e["request_id"] for e in evs]
    for rid in want_rids:
        check(rid in rids, "no event for request %s" % rid)
    check(len(evs) == len(want_rids) + 1, "%d events, want %d (+1 for the client that left): a replay or a conflict "
          "made one? %r" % (len(evs), len(want_rids) + 1, rids))


@it.test("idempotent inference: replays survive a restart (same --data)")
def t_idempotent_restart():
    with it.running(it.Aux("ledger-idem-" + os.urandom(3).hex())) as a:
        gid = new_group("idem-restart", port=a.admin_port, max_budget=1)   # capped: its spend is rebuilt
        k, s = it.create_key(gid, port=a.admin_port)
        h1 = {"Idempotency-Key": "restart-" + os.urandom(6).hex()}
        h2 = {"Idempotency-Key": "restart-stream-" + os.urandom(6).hex()}
        b1 = it.chat_body(content="survive a restart")
        b2 = it.chat_body(content="survive a restart, streamed", stream=True)
        r1 = ok200(call(s, b1, h1, port=a.port), "the first call")
        s1 = call(s, b2, h2, port=a.port)
        d1, _, _ = stream_parts(s1, "the first stream")
        spend = it.get_group(gid, port=a.admin_port)[0]["spend"]
        a.stop()
        a.start()
        n0 = upstream_calls()
        r = ok200(call(s, b1, h1, port=a.port), "the retry after the restart")
        check(r.header("x-ltg-replayed") == "true" and r.header("x-ltg-attempts") == "0" and r.body == r1.body,
              "after a restart: not the first answer (x-ltg-replayed %r)" % r.header("x-ltg-replayed"))
        r = call(s, b2, h2, port=a.port)
        d2, _, _ = stream_parts(r, "the stream's retry after the restart")
        check(r.header("x-ltg-replayed") == "true" and d2 == d1, "the stream after a restart: %r" % d2[:3])
        it.check_openai_error(call(s, it.chat_body(content="another body"), h1, port=a.port), 409, "idempotency_conflict")
        check(upstream_calls() == n0, "a replay after the restart reached the provider")
        check(len(events_of(gid, port=a.admin_port)) == 2, "events after the replays")
        check(it.get_group(gid, port=a.admin_port)[0]["spend"] == spend, "a replay after the restart was charged")


# ===== 8. ledger recovery ==========================================================================

@it.test("ledger: a torn last record is cut off at start-up with a warning; events and spend intact")
def t_ledger_torn():
    with it.running(it.Aux("ledger-torn-" + os.urandom(3).hex())) as a:
        p = a.admin_port
        gid = new_group("torn", port=p, max_budget=1)
        k, s = it.create_key(gid, port=p)
        for i in range(3):
            ok200(call(s, it.chat_body(content="torn %d" % i), port=a.port), "call %d" % i)
        evs = events_of(gid, port=p)
        g0 = it.get_group(gid, port=p)[0]
        check(len(evs) == 3, "events %r" % evs)
        a.stop()
        days = sorted(n for n in os.listdir(os.path.join(a.data_dir, "ledger")) if n.endswith(".log"))
        path = os.path.join(a.data_dir, "ledger", days[-1])   # the open day (today, unless midnight passed)
        size = os.path.getsize(path)
        payload = b'\x01\x00\x00\x01' + b'\x00' * 26
        with open(path, "ab") as f:
            f.write(struct.pack("<II", 400, 0x12345678) + payload)   # says 400 bytes, has 30
        a.start()
        text = a.text_since_start()
        check(any("warning" in l and path in l for l in text.splitlines()),
              "no warning about the torn record of %s in the log: %r" % (path, text[-500:]))
        check(os.path.getsize(path) == size, "the day's log is %d bytes after recovery, want %d (cut back to the last "
              "whole record)" % (os.path.getsize(path), size))
        check(events_of(gid, port=p) == evs, "the events changed after recovery")
        g1 = it.get_group(gid, port=p)[0]
        check(g1["spend"] == g0["spend"], "spend %r before, %r after recovery" % (g0["spend"], g1["spend"]))
        # The ledger takes new events after the cut, and they replay.
        ok200(call(s, it.chat_body(content="torn after"), port=a.port), "a call after recovery")
        evs2 = events_of(gid, port=p)
        check(len(evs2) == 4 and evs2[:3] == evs, "events after recovery %r" % evs2)
        spend2 = it.get_group(gid, port=p)[0]["spend"]
        a.stop()
        a.start()
        check("warning" not in a.text_since_start(), "a second restart warned again: %r" % a.text_since_start()[-400:])
        check(events_of(gid, port=p) == evs2, "the events after a second restart")
        check(it.get_group(gid, port=p)[0]["spend"] == spend2, "spend after a second restart")
        a.stop()
        # A damaged record with whole records after it is not a torn write: start-up stops.
        data = bytearray(open(path, "rb").read())
        backup = bytes(data)
        data[8 + 8 + 5] ^= 0x20               # inside the first record's payload
        with open(path, "wb") as f:
            f.write(bytes(data))
        rc, text = a.start_fails()
        check(rc != 0, "ltg started on a ledger damaged in the middle")
        check(path in text, "the refusal does not name %s: %r" % (path, text[-400:]))
        with open(path, "wb") as f:
            f.write(backup)
        a.start()
        check(events_of(gid, port=p) == evs2, "the events after restoring the ledger")


# ===== 9. a busy day: today's index spilled in chunks ==============================================

def idx_chunks(path):
    """The chunks of an index file: its LTGIDX5 magics (every chunk starts with one)."""
    with open(path, "rb") as f:
        return f.read().count(b"LTGIDX5\n")


def replayed_of(text, log_path):
    """N of the "LOG: replayed N records in M ms" line ltg logged for log_path, or None."""
    m = re.findall(re.escape(log_path) + r": replayed (\d+) records in \d+ ms", text)
    return int(m[-1]) if m else None


@it.test("ledger: a busy day (--ledger-index-mb 1): today's index spilled in chunks; totals, pages in order, filters, "
         "usage, live events and a restart that replays only past the last chunk")
def t_ledger_busy_day():
    gen = os.path.join(os.path.dirname(it.H.mock_bin), "ledger-gen")
    check(os.access(gen, os.X_OK), "no %s: build it with make tests/ledger-gen" % gen)
    n, ngroups = 30000, 10
    nkeys = 2 * ngroups                 # tests/ledger-gen: event i is of key i % nkeys, of group key / 2
    a = it.Aux("ledger-busy-" + os.urandom(3).hex(), args=["--ledger-index-mb", "1"])
    try:
        r = subprocess.run([gen, a.data_dir, str(n), "0", str(ngroups), "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=300 * it.SLOW)
        check(r.returncode == 0, "tests/ledger-gen exited with %d: %r" % (r.returncode, r.stderr[-400:]))
        ids = r.stdout.decode().split()
        check(len(ids) == 2, "tests/ledger-gen printed %r, want a group id and a key id" % r.stdout)
        gen_gid, gen_kid = ids              # group 3 and key 6 (its first key)
        ldir = os.path.join(a.data_dir, "ledger")
        logs = sorted(f for f in os.listdir(ldir) if f.endswith(".log"))
        check(len(logs) == 1, "tests/ledger-gen with DAYS 0 wrote %r, want one day" % logs)
        gday = logs[0][:10]                 # today, when it ran (a run across midnight queries from it on)
        log_path = os.path.join(ldir, logs[0])
        idx_path = os.path.join(ldir, gday + ".idx")
        check(os.path.exists(idx_path), "tests/ledger-gen wrote no index file: %r" % os.listdir(ldir))
        chunks = idx_chunks(idx_path)
        check(chunks > 1, "%s holds %d chunk(s), want more than one (%d events, --ledger-index-mb 1)" % (idx_path, chunks, n))
        d1 = (datetime.date.fromisoformat(gday) + datetime.timedelta(days=2)).isoformat()
        rng = "start_date=%s&end_date=%s" % (gday, d1)
        key_n = len(range(6, n, nkeys))
        group_n = key_n + len(range(7, n, nkeys))
        by_model = {"Bench-Fallback": 0, "Bench-Mini": 0, "Bench-Model": 0}
        for i in range(n):
            by_model["Bench-Fallback" if i % 7 == 0 else "Bench-Mini" if i % 5 == 0 else "Bench-Model"] += 1

        def total(q):
            return spend_page(rng + q + "&page[size]=1", port=a.admin_port)["meta"]["total_results"]

        def walk():
            """Every event of the range, pages of 1000 under one snapshot."""
            out, page, snap = [], 1, None
            while True:
                j = spend_page(rng + "&page[size]=1000&page[number]=%d" % page + ("&page[snapshot]=" + snap if snap else ""),
                               port=a.admin_port)
                snap = snap or j["meta"].get("snapshot")
                out += j["data"]
                if not j["meta"].get("has_more"):
                    return out
                check(page < 1000, "more than 1000 pages of 1000 events")
                page += 1

        def check_day(extra, what):
            """The generated day as ledger-gen wrote it, plus `extra` events of this test's own."""
            p = a.admin_port
            t = spend_page(rng + "&page[size]=1", port=p)["meta"]["total_results"]
            check(t == n + extra, "%s: /spend/events total_results %d, want %d" % (what, t, n + extra))
            evs = walk()
            check(len(evs) == n + extra, "%s: the pages hold %d events, want %d" % (what, len(evs), n + extra))
            key_of = [evs[i]["token_key_id"] for i in range(nkeys)]
            for i, ev in enumerate(evs[:n]):     # in the generator's order, each of its key (round robin)
                if ev["request_id"] != "req_%024x" % i or ev["token_key_id"] != key_of[i % nkeys]:
                    raise it.TestFailure("%s: event %d of the day is %r of key %r, want req_%024x of key %r (chunk "
                                         "boundaries mixed up?)" % (what, i, ev["request_id"], ev["token_key_id"], i,
                                                                    key_of[i % nkeys]))
            check(key_of[6] == gen_kid and evs[6]["token_group_id"] == gen_gid, "%s: event 6 is of key %r group %r, "
                  "ledger-gen printed %r %r" % (what, key_of[6], evs[6]["token_group_id"], gen_kid, gen_gid))
            at = [iso_ms(ev["created_at"]) for ev in evs]
            for i in range(1, len(at)):
                if at[i] < at[i - 1]:
                    raise it.TestFailure("%s: event %d at %s comes after event %d at %s" % (what, i, evs[i]["created_at"],
                                                                                             i - 1, evs[i - 1]["created_at"]))
            # Pages of a size that does not divide the day: page 1, one in the middle, the last, each with
            # the next (or the one before), sizes right and created_at never going back across them.
            size = 700
            pages = (n + extra + size - 1) // size
            mid = pages // 2
            got = {}
            for pg in (1, 2, mid, mid + 1, pages - 1, pages):
                j = spend_page(rng + "&page[size]=%d&page[number]=%d" % (size, pg), port=p)
                want = min(size, n + extra - (pg - 1) * size)
                check(len(j["data"]) == want, "%s: page %d of %d holds %d events, want %d" % (what, pg, size, len(j["data"]), want))
                check(j["meta"]["total_pages"] == pages and j["meta"]["has_more"] == (pg < pages),
                      "%s: page %d: meta %r, want %d pages" % (what, pg, j["meta"], pages))
                check([e["id"] for e in j["data"]] == [e["id"] for e in evs[(pg - 1) * size:pg * size]],
                      "%s: page %d of %d is not the walk's events %d..%d" % (what, pg, size, (pg - 1) * size, pg * size - 1))
                got[pg] = [iso_ms(e["created_at"]) for e in j["data"]]
            for pg in (1, mid, pages - 1):
                check(got[pg][-1] <= got[pg + 1][0], "%s: page %d ends at %d ms, page %d starts earlier at %d ms"
                      % (what, pg, got[pg][-1], pg + 1, got[pg + 1][0]))
            # One key, one group: the round robin's counts, their pages in the day's order.
            j = spend_page(rng + "&token_key_id=%s&page[size]=100&page[number]=3" % gen_kid, port=p)
            check(j["meta"]["total_results"] == key_n, "%s: key %s: total_results %d, want %d (every %d-th event)"
                  % (what, gen_kid, j["meta"]["total_results"], key_n, nkeys))
            check([e["request_id"] for e in j["data"]] == ["req_%024x" % i for i in range(6 + 200 * nkeys, n, nkeys)][:100],
                  "%s: page 3 of key %s is not its events 200..299" % (what, gen_kid))
            j = spend_page(rng + "&token_group_id=%s&page[size]=100&page[number]=%d" % (gen_gid, group_n // 100 // 2), port=p)
            check(j["meta"]["total_results"] == group_n, "%s: group %s: total_results %d, want %d"
                  % (what, gen_gid, j["meta"]["total_results"], group_n))
            gi = [i for i in range(n) if i % nkeys in (6, 7)]
            first = (group_n // 100 // 2 - 1) * 100
            check([e["request_id"] for e in j["data"]] == ["req_%024x" % i for i in gi[first:first + 100]],
                  "%s: a middle page of group %s is not its events %d..%d" % (what, gen_gid, first, first + 99))
            # /usage/summary of the range: the day's events, by model, and one group's.
            u = it.check_admin_ok(a.admin("GET", "/usage/summary?" + rng), 200, "%s: /usage/summary" % what)["data"]
            check(u["totals"]["requests"] == n + extra and u["totals"]["succeeded_requests"] == n + extra,
                  "%s: /usage/summary totals %r, want %d requests" % (what, u["totals"], n + extra))
            check(sum(d["requests"] for d in u["by_day"]) == n + extra and u["by_day"][0]["date"] == gday,
                  "%s: /usage/summary by_day %r" % (what, [(d["date"], d["requests"]) for d in u["by_day"]]))
            m = dict((r["model"], r["requests"]) for r in u["by_model"])
            for model, c in by_model.items():
                check(m.get(model) == c, "%s: /usage/summary by_model %r: %r requests, want %d" % (what, model, m.get(model), c))
            g = it.check_admin_ok(a.admin("GET", "/usage/summary?%s&token_group_id=%s" % (rng, gen_gid)), 200,
                                  "%s: /usage/summary of a group" % what)["data"]
            check(g["totals"]["requests"] == group_n and micro(g["totals"]["spend"]) == 20 * group_n,
                  "%s: /usage/summary of group %s: %r, want %d requests and %d micro-USD"
                  % (what, gen_gid, g["totals"], group_n, 20 * group_n))
            return evs

        a.start()
        text = a.text_since_start()
        rep = replayed_of(text, log_path)
        check(rep is not None and rep < n // 2, "start-up replayed %r records of %s (want well under %d: the chunks are "
              "loaded, not replayed): %r" % (rep, log_path, n, text[-600:]))
        check_day(0, "after ledger-gen")
        # A few live requests: the day's totals grow by exactly that many, the last events.
        gid = new_group("busy-day", port=a.admin_port)
        k, s = it.create_key(gid, port=a.admin_port)
        live = 3
        for i in range(live):
            ok200(call(s, it.chat_body(content="busy day %d" % i), port=a.port), "live call %d" % i)
        wait_events(gid, live, port=a.admin_port)
        evs = check_day(live, "after %d live calls" % live)
        check([e["token_key_id"] for e in evs[n:]] == [k["id"]] * live,
              "the live events are not the last of the day: %r" % [e["request_id"] for e in evs[n - 1:]])
        check(total("&token_group_id=" + gid) == live, "the live group's events")
        a.stop()
        chunks2 = idx_chunks(idx_path)
        check(chunks2 >= chunks, "%s held %d chunks, %d after a restart" % (idx_path, chunks, chunks2))
        a.start()
        text = a.text_since_start()
        rep2 = replayed_of(text, log_path)
        check(rep2 is not None and rep2 < n // 2, "the restart replayed %r records of %s (want well under %d): %r"
              % (rep2, log_path, n, text[-600:]))
        evs2 = check_day(live, "after a restart")
        check(evs2 == evs, "the events changed across the restart")
        a.stop()
    finally:
        a.close()
    # A spill by ltg itself, under live requests: a day that fills the events in memory up to a few
    # short of a chunk (the chunks of the first are all alike: (events - replayed) / chunks each), then
    # requests past it. The chunk appears while ltg runs; a snapshot taken before it still reads.
    per = (n - rep) // chunks
    check(per > 100, "%d events in %d chunks" % (n - rep, chunks))
    n2 = 3 * per + per - 4
    b = it.Aux("ledger-busy2-" + os.urandom(3).hex(), args=["--ledger-index-mb", "1"])
    try:
        r = subprocess.run([gen, b.data_dir, str(n2), "0", str(ngroups), "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=300 * it.SLOW)
        check(r.returncode == 0, "tests/ledger-gen exited with %d: %r" % (r.returncode, r.stderr[-400:]))
        ldir = os.path.join(b.data_dir, "ledger")
        gday = sorted(f for f in os.listdir(ldir) if f.endswith(".log"))[0][:10]
        log_path, idx_path = os.path.join(ldir, gday + ".log"), os.path.join(ldir, gday + ".idx")
        rng = "start_date=%s&end_date=%s" % (gday, (datetime.date.fromisoformat(gday) + datetime.timedelta(days=2)).isoformat())
        check(idx_chunks(idx_path) == 3, "%d events at %d a chunk: %d chunks, want 3" % (n2, per, idx_chunks(idx_path)))
        b.start()
        rep = replayed_of(b.text_since_start(), log_path)
        check(rep is not None and per - 12 <= rep < per, "start-up replayed %r records of %s, want a few short of a "
              "chunk's %d" % (rep, log_path, per))
        j = spend_page(rng + "&page[size]=1000", port=b.admin_port)
        snap, total0 = j["meta"]["snapshot"], j["meta"]["total_results"]
        check(total0 == n2, "total_results %d, want %d" % (total0, n2))
        last = spend_page(rng + "&page[size]=1000&page[number]=%d" % j["meta"]["total_pages"], port=b.admin_port)["data"]
        gid = new_group("busy-day-spill", port=b.admin_port)
        k, s = it.create_key(gid, port=b.admin_port)
        live = per - rep + 8                # past a chunk's worth
        for i in range(live):
            ok200(call(s, it.chat_body(content="busy day spill %d" % i), port=b.port), "live call %d" % i)
        wait_events(gid, live, port=b.admin_port)
        check(idx_chunks(idx_path) == 4, "after %d live events past a chunk's worth: %d chunks in %s, want 4"
              % (live, idx_chunks(idx_path), idx_path))

        def walk(q, snap=None):
            out, page = [], 1
            while True:
                j = spend_page(rng + q + "&page[size]=1000&page[number]=%d" % page + ("&page[snapshot]=" + snap if snap else ""),
                               port=b.admin_port)
                out += j["data"]
                if not j["meta"].get("has_more"):
                    return out, j["meta"]["total_results"]
                page += 1
        for what in ("live", "after a restart"):
            evs, t = walk("")
            check(t == len(evs) == n2 + live, "%s: %d events (total_results %d), want %d" % (what, len(evs), t, n2 + live))
            check([e["request_id"] for e in evs[:n2]] == ["req_%024x" % i for i in range(n2)],
                  "%s: the generated events are not all there in order" % what)
            check([e["token_key_id"] for e in evs[n2:]] == [k["id"]] * live, "%s: the live events are not the last" % what)
            at = [iso_ms(e["created_at"]) for e in evs]
            check(all(at[i - 1] <= at[i] for i in range(1, len(at))), "%s: created_at goes back" % what)
            ks, t = walk("&token_key_id=" + k["id"])
            check(t == live and [e["id"] for e in ks] == [e["id"] for e in evs[n2:]], "%s: the live key's events %d, want %d"
                  % (what, t, live))
            old, t = walk("", snap)
            check(t == n2 and old[-len(last):] == last and len(old) == n2,
                  "%s: under the snapshot taken before the spill: %d events (total_results %d), want %d" % (what, len(old), t, n2))
            u = it.check_admin_ok(b.admin("GET", "/usage/summary?" + rng), 200, "/usage/summary")["data"]["totals"]
            check(u["requests"] == n2 + live, "%s: /usage/summary requests %d, want %d" % (what, u["requests"], n2 + live))
            g = it.check_admin_ok(b.admin("GET", "/usage/summary?%s&token_group_id=%s" % (rng, gid)), 200,
                                  "/usage/summary of the live group")["data"]["totals"]
            check(g["requests"] == live, "%s: /usage/summary of the live group: %d requests, want %d" % (what, g["requests"], live))
            if what == "live":
                b.stop()
                b.start()
                rep2 = replayed_of(b.text_since_start(), log_path)
                check(rep2 is not None and rep2 < live, "the restart replayed %r records, want fewer than the %d live events "
                      "(the %d before them, and some of them, are in the new chunk)" % (rep2, live, rep))
        b.stop()
    finally:
        b.close()


if __name__ == "__main__":   # this file alone: python3 tests/integration_ledger.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
