"""Integration tests: cost (README "Cost") -- the token classes (input, cache reads, cache writes and
their 1-hour part, output, reasoning) that ltg reads from each API's usage object and records in
every spend event and attempt_log entry, in /usage/summary, the access log and ltg_tokens_total;
the catalog's prices per class (the Anthropic and OpenAI defaults of the cache prices, a
long_context tier priced for the whole request) and their refusals at start-up; exact costs to the
micro-USD on Chat Completions, Anthropic Messages (whole and streamed), the Responses API and
embeddings; reasoning tokens; abandoned answers, which ltg keeps reading for their usage
(--meter-abandoned-seconds) or charges its estimate; the worst case of an attempt held against a
budget (n, max_tokens vs max_completion_tokens, content parts, the 1-hour write price of an
Anthropic model), each fallback attempt admitted on its own; member names repeated deeper in the
body; usage that cannot be true (estimated, and the ledger still reads after a restart).

tests/integration.py imports this file at start-up and runs its tests with the others; to run only
these:

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k cost:
    python3 tests/integration_cost.py --ltg ./ltg --mock tests/mock

Isolation. These tests run on an ltg of their own (the harness's Aux: its own ports, --data, log and
--access-log), whose catalog is the harness's plus a provider "cost-anth" declaring
"api":"anthropic" (the same mock) and models reserved to this file, each with the prices a test
needs (MODELS below). Each test provisions its own token group and key, so that the group's events,
summary and spend are that test's alone; token metrics are compared before and after. A test that
needs another flag (--meter-abandoned-seconds 0) or a refused catalog starts an Aux of its own for
that part.

Expected costs are computed here, independently of ltg, from the prices below and the counts the
mock is told to report (its usage directives), with decimal arithmetic: uncached input x input +
cache reads x read + 5-minute writes x write + 1-hour writes x 1h + output x output, micro-USD
rounded to nearest. Worst cases (what a budget must fit before an attempt starts): ceil(body bytes
/ 3) input tokens, plus max_input_part_tokens (2000) per image/audio/file part, at the dearest input
price; the largest output limit (else max_output_tokens, 4096) times max(n, best_of); the sum
rounded up to the micro-USD.

Waits are bounded and generous (a slow, busy machine): an event is waited for up to 20 s; the
abandoned-answer tests close the client after 0.3 s of a 1.5 s delay and do not otherwise depend on
timing.
"""

import datetime
import decimal
import json
import os
import re
import time

import integration as it

check = it.check
D = decimal.Decimal

EVENT_WAIT = 20.0     # s: how long an event may take to reach the ledger (metered answers: seconds)
TOK = ("input_tokens", "cache_read_tokens", "cache_write_tokens", "cache_write_1h_tokens", "output_tokens",
       "reasoning_tokens")
MAX_OUTPUT_DEFAULT = 4096
PART_TOKENS_DEFAULT = 2000

# The models of this file: alias -> (provider, upstream, prices in USD per million tokens as
# strings; missing cache prices take the API's defaults; "long": (above_input_tokens, in, out)).
MODELS = {
    "Cost-Anth":     ("cost-anth", "cost-anth", {"in": "3", "out": "15"}),
    "Cost-Anth-LC":  ("cost-anth", "cost-anth-lc", {"in": "3", "out": "15", "long": (200000, "6", "22.5")}),
    "Cost-Anth-Bud": ("cost-anth", "cost-anth-bud", {"in": "3", "out": "15"}),
    "Cost-OAI":      ("mock", "cost-oai", {"in": "2", "out": "8", "read": "0.5"}),
    "Cost-OAI-LC":   ("mock", "cost-oai-lc", {"in": "2", "out": "8", "read": "0.5", "long": (100000, "4", "12")}),
    "Cost-Reason":   ("mock", "cost-reason", {"in": "2", "out": "8", "read": "0.5"}),
    "Cost-Resp":     ("mock", "cost-resp", {"in": "2", "out": "8", "read": "0.5"}),
    "Cost-Emb":      ("mock", "cost-emb", {"in": "0.13", "out": "0.13"}),
    "Cost-Bud":      ("mock", "cost-bud", {"in": "0.15", "out": "0.6"}),
    "Cost-FB-A":     ("mock", "cost-fb-a", {"in": "1.1", "out": "4.4"}),
    "Cost-FB-B":     ("mock", "cost-fb-b", {"in": "1.1", "out": "4.4"}),
    "Cost-Slow-A":   ("mock", "cost-slow-a", {"in": "2", "out": "8"}),
    "Cost-Slow-B":   ("mock", "cost-slow-b", {"in": "0.5", "out": "1"}),
    "Cost-Aband":    ("mock", "cost-aband", {"in": "2", "out": "8"}),
    "Cost-Dup":      ("mock", "cost-dup", {"in": "1", "out": "1"}),
    "Cost-Hostile":  ("mock", "cost-hostile", {"in": "1.5", "out": "6"}),
    "Cost-Max":      ("mock", "cost-max", {"in": "10000", "out": "10000"}),   # the largest price allowed
}

# ===== prices, computed here ======================================================================

class Price:
    """A model's prices in USD per million tokens = micro-USD per token (Decimal), cache defaults
    filled in as README "Cost" says."""

    def __init__(self, alias, long_tier=False):
        prov, _, p = MODELS[alias]
        self.anthropic = prov == "cost-anth"
        base_in = D(p["in"])
        if long_tier:
            _, lin, lout = p["long"]
            scale = D(lin) / base_in
            self.inp, self.out = D(lin), D(lout)
        else:
            scale = D(1)
            self.inp, self.out = base_in, D(p["out"])
        if self.anthropic:
            read, write, write1h = base_in * D("0.1"), base_in * D("1.25"), base_in * 2
        else:
            read, write, write1h = base_in, base_in, base_in
        self.read = D(p.get("read", read)) * scale
        self.write = D(p.get("write", write)) * scale
        self.write1h = D(p.get("write1h", write1h)) * scale

    def cost(self, inp, read=0, write=0, write1h=0, out=0):
        """micro-USD (int) of a request: inp inclusive of the cache reads and writes, write inclusive
        of its 1-hour part; rounded to nearest."""
        v = ((inp - read - write) * self.inp + read * self.read + (write - write1h) * self.write + write1h * self.write1h
             + out * self.out)
        return int(v.quantize(D(1), rounding=decimal.ROUND_HALF_UP))

    def dearest_input(self):
        return max(self.inp, self.read, self.write, self.write1h)


def model_price(alias, inp):
    """The Price of a request of `inp` input tokens on alias (its long_context tier past the mark)."""
    p = MODELS[alias][2]
    return Price(alias, long_tier="long" in p and inp > p["long"][0])


def ceil_d(v):
    return int(v.to_integral_value(rounding=decimal.ROUND_CEILING))


def count_parts(obj):
    kinds = {"image_url", "input_image", "image", "input_audio", "input_file", "file", "document"}
    if isinstance(obj, dict):
        return (1 if obj.get("type") in kinds else 0) + sum(count_parts(v) for v in obj.values())
    if isinstance(obj, list):
        return sum(count_parts(v) for v in obj)
    return 0


def worst_case(alias, body_bytes, limits=(), answers=1):
    """The worst case of one attempt on alias, micro-USD (int), for a body of these bytes (its
    output limits present and max(n, best_of))."""
    obj = json.loads(body_bytes)
    inp = -(-len(body_bytes) // 3) + count_parts(obj) * PART_TOKENS_DEFAULT
    out = (max(limits) if limits else MAX_OUTPUT_DEFAULT) * answers
    p = model_price(alias, inp)
    return ceil_d(inp * p.dearest_input() + out * p.out), inp, out


def usd(micro):
    """micro-USD as the 6-decimal string a max_budget is given in."""
    return "%d.%06d" % (micro // 1000000, micro % 1000000)


def to_micro(v, what):
    """A USD amount read as Decimal (parse_float) -> exact micro-USD int."""
    check(v is not None and not isinstance(v, bool) and isinstance(v, (int, D)), "%s: %r is not a number" % (what, v))
    m = D(v) * 1000000
    check(m == m.to_integral_value(), "%s: %r has more than 6 decimals" % (what, v))
    return int(m)


# ===== the dedicated ltg ==========================================================================

def _catalog():
    cfg = it.catalog_copy()
    cfg["providers"]["cost-anth"] = it.catalog_provider(it.H.mock_port, api="anthropic")
    for alias, (prov, up, p) in MODELS.items():
        m = {"provider": prov, "upstream_model": up, "input_usd_per_mtok": float(p["in"]),
             "output_usd_per_mtok": float(p["out"])}
        if "read" in p:
            m["cache_read_usd_per_mtok"] = float(p["read"])
        if "long" in p:
            m["long_context"] = {"above_input_tokens": p["long"][0], "input_usd_per_mtok": float(p["long"][1]),
                                 "output_usd_per_mtok": float(p["long"][2])}
        cfg["models"][alias] = m
    return cfg


def _config_path():
    return it.catalog_file("cost", _catalog)


def access_log_path(a):
    return os.path.join(it.H.tmp, "access-%s.log" % a.tag)


def _make(n, tag="cost-%d", args=()):
    a = it.Aux(tag % n, config=_config_path())
    a.args = ["--access-log", access_log_path(a)] + list(args)
    return a


_LTG = it.AuxSlot(_make)


def ctest(name):
    """Register a test ("cost: " + name) that gets the dedicated ltg as its argument."""
    return _LTG.test("cost: " + name, "the cost ltg")


# ===== calls, events ==============================================================================

class Group:
    def __init__(self, gid, token):
        self.gid, self.token = gid, token


def group(a, models, budget=None, **kw):
    """A group of these models (budget: its max_budget in micro-USD, sent as exact decimal text) and a key."""
    body = {"name": "cost-" + it.new_idem(), "allowed_models": list(models)}
    body.update(kw)
    if budget is not None:
        body["max_budget"] = "@BUDGET@"
        body = json.dumps(body).replace('"@BUDGET@"', usd(budget)).encode()
        r = it.admin("POST", "/token_groups", body, port=a.admin_port)
        d = it.check_admin_ok(r, 201, "POST /token_groups with max_budget %s" % usd(budget))["data"]
        _, token = it.create_key(d["id"], port=a.admin_port)
        return Group(d["id"], token)
    d = it.create_group(body, port=a.admin_port)
    _, token = it.create_key(d["id"], port=a.admin_port)
    return Group(d["id"], token)


def jdec(r, what):
    """The JSON body with its fractions as Decimal (money compared exactly)."""
    try:
        return json.loads(r.body.decode("utf-8"), parse_float=D)
    except Exception as e:
        raise it.TestFailure("%s: the body is not JSON (%s): %r" % (what, e, r.body[:300]))


def day(offset=0):
    return (datetime.datetime.now(datetime.timezone.utc).date() + datetime.timedelta(days=offset)).isoformat()


def wide():
    return "start_date=%s&end_date=%s" % (day(-1), day(2))


def events(a, g):
    r = it.admin("GET", "/spend/events?%s&token_group_id=%s&page[size]=1000" % (wide(), g.gid), port=a.admin_port)
    check(r.status == 200, "GET /spend/events: %s" % r.brief())
    return jdec(r, "GET /spend/events")["data"]


def event(a, g, rid, what="the request"):
    """The spend event of request rid, waited for (bounded)."""
    check(rid, "%s: no x-ltg-request-id" % what)
    deadline = time.monotonic() + EVENT_WAIT * it.SLOW
    while True:
        evs = events(a, g)
        for e in evs:
            if e.get("request_id") == rid:
                return e
        if time.monotonic() > deadline:
            raise it.TestFailure("%s: no spend event with request_id %s after %g s (the group has %d: %r)"
                                 % (what, rid, EVENT_WAIT * it.SLOW, len(evs), evs[-2:]))
        time.sleep(0.1)


def wait_n_events(a, g, n, what):
    deadline = time.monotonic() + EVENT_WAIT * it.SLOW
    while True:
        evs = events(a, g)
        if len(evs) >= n or time.monotonic() > deadline:
            check(len(evs) == n, "%s: %d spend events, want %d: %r" % (what, len(evs), n, evs))
            return evs
        time.sleep(0.1)


def classes(d):
    return dict((k, d.get(k)) for k in TOK)


def want_classes(inp=0, read=0, write=0, write1h=0, out=0, reasoning=0):
    return dict(zip(TOK, (inp, read, write, write1h, out, reasoning)))


def check_attempt_sums(e, what):
    """Each attempt_log entry has the six classes, cost and usage_status; the event's are their
    sums (estimated if any attempt's was)."""
    att = e.get("attempt_log")
    check(isinstance(att, list) and att, "%s: attempt_log %r" % (what, att))
    for x in att:
        if x.get("outcome") == "circuit_open":
            continue
        for f in TOK + ("cost", "usage_status"):
            check(f in x, "%s: the attempt_log entry %r lacks %s" % (what, x, f))
    billed = [x for x in att if "cost" in x]
    for f in TOK:
        s = sum(x[f] for x in billed)
        check(e.get(f) == s, "%s: the event's %s %r, but its attempts' sum to %d (attempt_log %r)" % (what, f, e.get(f), s, att))
    s = sum(to_micro(x["cost"], what + ": an attempt's cost") for x in billed)
    check(to_micro(e.get("cost"), what + ": cost") == s, "%s: the event's cost %r, but its attempts' sum to %s"
          % (what, e.get("cost"), usd(s)))
    est = any(x["usage_status"] == "estimated" for x in billed)
    check(e.get("usage_status") == ("estimated" if est else "reported"),
          "%s: the event's usage_status %r, its attempts' %r" % (what, e.get("usage_status"), [x["usage_status"] for x in billed]))


def check_cost_event(e, what, cost, tokens, usage_status="reported", status="succeeded", http_status=200):
    """An event with exactly these classes, cost (micro-USD) and usage_status; its one attempt the same."""
    check(e.get("status") == status and e.get("http_status") == http_status,
          "%s: status %r, http_status %r, want %r, %r" % (what, e.get("status"), e.get("http_status"), status, http_status))
    check(classes(e) == tokens, "%s: token classes %r, want %r" % (what, classes(e), tokens))
    got = to_micro(e.get("cost"), what + ": cost")
    check(got == cost, "%s: cost %r USD, want %s" % (what, e.get("cost"), usd(cost)))
    check(e.get("usage_status") == usage_status, "%s: usage_status %r, want %r" % (what, e.get("usage_status"), usage_status))
    check_attempt_sums(e, what)


def post(a, token, path, body, headers=None, timeout=30.0):
    """One request; body a dict or bytes. Anthropic's endpoint gets the key as x-api-key."""
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    h = dict(headers or {})
    if path.startswith("/v1/messages"):
        h["x-api-key"] = token
        return it.one_request(a.port, "POST", path, body, h, auth=None, timeout=timeout)
    return it.one_request(a.port, "POST", path, body, h, auth=token, timeout=timeout)


def ok200(r, what):
    check(r.status == 200, "%s: %s" % (what, r.brief()))
    return r


def msg_body(model, directive=None, stream=False, max_tokens=200, content="Hi"):
    b = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}
    if stream:
        b["stream"] = True
    if directive:
        b["mock"] = directive
    return b


def rid(r):
    return r.header("x-ltg-request-id")


def calls(up):
    return it.H.mock_stats().get("calls", {}).get(up, 0)


def script(up, steps):
    it.H.mock_post("/_mock/script", {"model": up, "steps": list(steps)})


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def token_metrics(a, model):
    """ltg_tokens_total{model=model,type=...}: {type: value} (absent types 0)."""
    text = it.one_request(a.admin_port, "GET", "/metrics", auth=None, timeout=30).body.decode("utf-8", "replace")
    out = dict((t, 0) for t in ("input", "output", "cache_read", "cache_write", "reasoning"))
    for line in text.splitlines():
        if not line.startswith("ltg_tokens_total{"):
            continue
        lab, _, val = line[len("ltg_tokens_total{"):].rpartition("} ")
        labels = dict(_LABEL.findall(lab))
        if labels.get("model") == model:
            check(labels.get("type") in out, "ltg_tokens_total: unknown type in %r" % line)
            out[labels["type"]] = int(float(val))
    return out


def access_line(a, request_id, timeout=15.0):
    """The access log line of request request_id (bounded wait), fractions as Decimal."""
    path = access_log_path(a)
    deadline = time.monotonic() + timeout * it.SLOW
    while True:
        if os.path.exists(path):
            with open(path) as f:
                for l in f.read().splitlines():
                    if request_id in l:
                        return json.loads(l, parse_float=D)
        if time.monotonic() > deadline:
            raise it.TestFailure("no access log line of request %s in %s after %g s" % (request_id, path, timeout))
        time.sleep(0.05)


def summary(a, g):
    r = it.admin("GET", "/usage/summary?token_group_id=%s&%s" % (g.gid, wide()), port=a.admin_port)
    check(r.status == 200, "GET /usage/summary: %s" % r.brief())
    return jdec(r, "GET /usage/summary")["data"]


def group_spend(a, g):
    r = it.admin("GET", "/token_groups/" + g.gid, port=a.admin_port)
    check(r.status == 200, "GET /token_groups/%s: %s" % (g.gid, r.brief()))
    return to_micro(jdec(r, "GET the group")["data"]["spend"], "the group's spend")


def check_spend_is_sum(a, g, what):
    evs = events(a, g)
    s = sum(to_micro(e["cost"], what + ": an event's cost") for e in evs)
    got = group_spend(a, g)
    check(got == s, "%s: the group's spend %s, but its %d events cost %s in all" % (what, usd(got), len(evs), usd(s)))


def sse_datas(r, what):
    check(r.status == 200, "%s: %s" % (what, r.brief()))
    return it.sse_datas(r)


# ===== exact costs ================================================================================

A_DIRECTIVE = "input_tokens=12 cached_tokens=48000 cache_write=2000 output_tokens=100"
A_COST = 23436                       # 12 x 3 + 48000 x 0.3 + 2000 x 3.75 + 100 x 15 micro-USD
A_TOKENS = want_classes(50012, 48000, 2000, 0, 100, 0)


@ctest("Anthropic Messages, $3/$15 with the default cache prices: 12 uncached + 48000 cache reads + 2000 "
       "writes + 100 output cost 0.023436 USD, input_tokens 50012 (inclusive), whole and streamed; the same classes "
       "in the attempt_log, /usage/summary (totals, by_day, by_model), the access log and ltg_tokens_total")
def t_cost_anthropic(a):
    check(Price("Cost-Anth").cost(50012, 48000, 2000, 0, 100) == A_COST, "the test's own arithmetic")
    g = group(a, ["Cost-Anth"])
    m0 = token_metrics(a, "Cost-Anth")
    r = ok200(post(a, g.token, "/v1/messages", msg_body("Cost-Anth", A_DIRECTIVE)), "the whole message")
    u = jdec(r, "the message").get("usage", {})
    check(u.get("input_tokens") == 12 and u.get("cache_read_input_tokens") == 48000 and
          u.get("cache_creation_input_tokens") == 2000 and u.get("output_tokens") == 100,
          "the client's usage is the provider's, unchanged: %r" % u)
    check(r.header("x-ltg-cost") == "0.023436", "x-ltg-cost %r, want 0.023436" % r.header("x-ltg-cost"))
    e1 = event(a, g, rid(r), "the whole message")
    check_cost_event(e1, "the whole message", A_COST, A_TOKENS)

    s = post(a, g.token, "/v1/messages", msg_body("Cost-Anth", A_DIRECTIVE, stream=True))
    datas = sse_datas(s, "the streamed message")
    check(any('"message_stop"' in d for d in datas), "the stream has no message_stop: %r" % datas[-3:])
    e2 = event(a, g, rid(s), "the streamed message")
    check_cost_event(e2, "the streamed message", A_COST, A_TOKENS)

    # /usage/summary: totals, by_day, by_model each have the classes, twice over.
    d = summary(a, g)
    twice = dict((k, 2 * v) for k, v in A_TOKENS.items())
    rows = [("totals", d["totals"])] + [("by_day " + x["date"], x) for x in d["by_day"] if x.get("requests")] + \
           [("by_model " + str(x.get("model")), x) for x in d["by_model"]]
    check(len(rows) == 3, "the summary: one day and one model with requests expected: %r" % d)
    for what, row in rows:
        check(classes(row) == twice, "/usage/summary %s: classes %r, want %r" % (what, classes(row), twice))
        check(row.get("requests") == 2 and row.get("abandoned_requests") == 0,
              "/usage/summary %s: requests %r, abandoned_requests %r" % (what, row.get("requests"), row.get("abandoned_requests")))
        check(to_micro(row.get("spend"), what) == 2 * A_COST, "/usage/summary %s: spend %r, want %s" % (what, row.get("spend"), usd(2 * A_COST)))
    check(d["by_model"][0].get("model") == "Cost-Anth", "by_model: %r" % d["by_model"])

    # The access log: one line per request with the classes, the cost and usage_status.
    for resp, what in ((r, "whole"), (s, "streamed")):
        line = access_line(a, rid(resp))
        check(classes(line) == A_TOKENS, "the access log line (%s): classes %r, want %r" % (what, classes(line), A_TOKENS))
        check(to_micro(line.get("cost"), "access log cost") == A_COST and line.get("usage_status") == "reported",
              "the access log line (%s): cost %r, usage_status %r" % (what, line.get("cost"), line.get("usage_status")))

    # ltg_tokens_total{model,type}: input (inclusive), output, cache_read, cache_write, reasoning.
    m1 = token_metrics(a, "Cost-Anth")
    delta = dict((k, m1[k] - m0[k]) for k in m1)
    want = {"input": 2 * 50012, "output": 200, "cache_read": 96000, "cache_write": 4000, "reasoning": 0}
    check(delta == want, "ltg_tokens_total{model=\"Cost-Anth\"} grew by %r, want %r" % (delta, want))
    check_spend_is_sum(a, g, "the Anthropic calls")


@ctest("OpenAI chat, $2 in / $8 out / $0.5 cache reads: 50000 prompt tokens (48000 cached) + 100 output cost 0.0288 "
       "USD, whole and streamed; the client's usage relayed unchanged")
def t_cost_openai_chat(a):
    d = "input_tokens=50000 cached_tokens=48000 output_tokens=100"
    want = Price("Cost-OAI").cost(50000, 48000, 0, 0, 100)
    check(want == 28800, "the test's own arithmetic: %d" % want)
    g = group(a, ["Cost-OAI"])
    r = ok200(post(a, g.token, "/v1/chat/completions", it.chat_body(model="Cost-OAI", directive=d)), "the chat")
    u = jdec(r, "the chat").get("usage", {})
    check(u.get("prompt_tokens") == 50000 and (u.get("prompt_tokens_details") or {}).get("cached_tokens") == 48000
          and u.get("completion_tokens") == 100, "the client's usage: %r" % u)
    check(r.header("x-ltg-cost") == "0.028800", "x-ltg-cost %r, want 0.028800" % r.header("x-ltg-cost"))
    check_cost_event(event(a, g, rid(r)), "the chat", want, want_classes(50000, 48000, 0, 0, 100))
    s = post(a, g.token, "/v1/chat/completions", it.chat_body(model="Cost-OAI", directive=d, stream=True))
    sse_datas(s, "the chat stream")
    check_cost_event(event(a, g, rid(s)), "the chat stream (usage asked for by ltg)", want, want_classes(50000, 48000, 0, 0, 100))
    check_spend_is_sum(a, g, "the chat calls")


@ctest("1-hour cache writes on the $3 Anthropic model cost 2x input ($6), 5-minute ones 1.25x; a long_context tier "
       "(OpenAI and Anthropic) prices the whole request at its rates once input_tokens pass above_input_tokens")
def t_cost_1h_and_long_context(a):
    g = group(a, ["Cost-Anth", "Cost-Anth-LC", "Cost-OAI-LC"])
    p = Price("Cost-Anth")
    cases = [
        # (what, alias, path, directive, (inclusive input, read, write, write1h, output), want micro-USD)
        ("all writes 1-hour", "Cost-Anth", "/v1/messages", "input_tokens=10 cache_write=1000 cache_write_1h=1000 output_tokens=20",
         (1010, 0, 1000, 1000, 20), 10 * 3 + 1000 * 6 + 20 * 15),
        ("1500 writes, 500 of them 1-hour", "Cost-Anth", "/v1/messages",
         "input_tokens=10 cached_tokens=100 cache_write=1500 cache_write_1h=500 output_tokens=20",
         (1610, 100, 1500, 500, 20), 10 * 3 + 100 * 0.3 + 1000 * 3.75 + 500 * 6 + 20 * 15),
        ("OpenAI at the mark (100000: the base prices)", "Cost-OAI-LC", "/v1/chat/completions",
         "input_tokens=100000 cached_tokens=50000 output_tokens=1000", (100000, 50000, 0, 0, 1000), 50000 * 2 + 50000 * 0.5 + 1000 * 8),
        ("OpenAI past the mark (100001: $4/$12, reads 0.5 x 4/2)", "Cost-OAI-LC", "/v1/chat/completions",
         "input_tokens=100001 cached_tokens=50000 output_tokens=1000", (100001, 50000, 0, 0, 1000), 50001 * 4 + 50000 * 1 + 1000 * 12),
        ("Anthropic past the mark by its inclusive input (100 + 150000 reads + 60000 writes > 200000: $6/$22.5)",
         "Cost-Anth-LC", "/v1/messages", "input_tokens=100 cached_tokens=150000 cache_write=60000 cache_write_1h=10000 output_tokens=10",
         (210100, 150000, 60000, 10000, 10), 100 * 6 + 150000 * 0.6 + 50000 * 7.5 + 10000 * 12 + 10 * 22.5),
        ("Anthropic under the mark (the same with 40000 reads)", "Cost-Anth-LC", "/v1/messages",
         "input_tokens=100 cached_tokens=40000 cache_write=60000 cache_write_1h=10000 output_tokens=10",
         (100100, 40000, 60000, 10000, 10), 100 * 3 + 40000 * 0.3 + 50000 * 3.75 + 10000 * 6 + 10 * 15),
    ]
    fails = []
    for what, alias, path, directive, tk, approx in cases:
        want = model_price(alias, tk[0]).cost(*tk)
        check(want == int(round(approx)), "the test's own arithmetic for %s: %d vs %r" % (what, want, approx))
        body = msg_body(alias, directive) if path == "/v1/messages" else it.chat_body(model=alias, directive=directive)
        r = post(a, g.token, path, body)
        if r.status != 200:
            fails.append("%s: %s" % (what, r.brief()))
            continue
        try:
            check_cost_event(event(a, g, rid(r), what), what, want, want_classes(*tk))
        except it.TestFailure as e:
            fails.append(str(e))
    check(p.write1h == 6 and p.write == D("3.75") and p.read == D("0.3"), "the test's own defaults")
    check(not fails, "; ".join(fails))
    check_spend_is_sum(a, g, "these calls")


@ctest("reasoning tokens: reasoning_tokens=64 of output_tokens=100 are recorded (event, attempt, metric) and "
       "the cost counts the 100 output tokens once")
def t_cost_reasoning(a):
    g = group(a, ["Cost-Reason"])
    m0 = token_metrics(a, "Cost-Reason")
    r = ok200(post(a, g.token, "/v1/chat/completions",
                   it.chat_body(model="Cost-Reason", directive="input_tokens=1000 reasoning_tokens=64 output_tokens=100")), "the chat")
    want = Price("Cost-Reason").cost(1000, 0, 0, 0, 100)
    check(want == 2800, "the test's own arithmetic")
    check_cost_event(event(a, g, rid(r)), "the chat", want, want_classes(1000, 0, 0, 0, 100, 64))
    m1 = token_metrics(a, "Cost-Reason")
    delta = dict((k, m1[k] - m0[k]) for k in m1)
    check(delta == {"input": 1000, "output": 100, "cache_read": 0, "cache_write": 0, "reasoning": 64},
          "ltg_tokens_total{model=\"Cost-Reason\"} grew by %r" % delta)


@ctest("Responses API: input_tokens_details.cached_tokens priced at the cache-read price (whole and streamed); "
       "embeddings: prompt_tokens only, at the input price")
def t_cost_responses_embeddings(a):
    g = group(a, ["Cost-Resp", "Cost-Emb"])
    d = "input_tokens=50000 cached_tokens=48000 output_tokens=100 reasoning_tokens=30"
    want = Price("Cost-Resp").cost(50000, 48000, 0, 0, 100)
    r = ok200(post(a, g.token, "/v1/responses", {"model": "Cost-Resp", "input": "Hi", "mock": d}), "the response")
    u = jdec(r, "the response").get("usage", {})
    check(u.get("input_tokens") == 50000 and (u.get("input_tokens_details") or {}).get("cached_tokens") == 48000,
          "the client's usage: %r" % u)
    check_cost_event(event(a, g, rid(r)), "the response", want, want_classes(50000, 48000, 0, 0, 100, 30))
    s = post(a, g.token, "/v1/responses", {"model": "Cost-Resp", "input": "Hi", "mock": d, "stream": True})
    sse_datas(s, "the streamed response")
    check_cost_event(event(a, g, rid(s)), "the streamed response", want, want_classes(50000, 48000, 0, 0, 100, 30))

    r = ok200(post(a, g.token, "/v1/embeddings", {"model": "Cost-Emb", "input": "hello", "mock": "input_tokens=12345"}), "the embeddings")
    want = Price("Cost-Emb").cost(12345)          # 12345 x 0.13 = 1604.85 -> 1605
    check(want == 1605, "the test's own arithmetic")
    check_cost_event(event(a, g, rid(r)), "the embeddings", want, want_classes(12345))


# ===== abandoned answers ==========================================================================

@ctest("abandoned: a client that leaves a whole answer after it reached the provider -- ltg reads the answer on, "
       "the event is abandoned, http_status 499, with the provider's usage priced (reported); a stream left "
       "mid-way: abandoned, 499, estimated, cost > 0; abandoned_requests in /usage/summary")
def t_cost_abandoned(a):
    g = group(a, ["Cost-Aband"])
    up = "cost-aband"
    want = Price("Cost-Aband").cost(1000, 0, 0, 0, 50)
    # The provider answers after 3 s: the client leaves well before, however slow the machine.
    body = it.chat_body(model="Cost-Aband", directive="head_delay_ms=3000 input_tokens=1000 output_tokens=50")
    n0 = calls(up)
    with it.Conn(a.port, timeout=10) as c:
        c.send(it.http_request("POST", "/v1/chat/completions", body, auth=g.token))
        it.wait_until(lambda: "the request did not reach the mock (its calls of %s: %d, %d before)" % (up, calls(up), n0),
                      lambda: calls(up) > n0, 10 * it.SLOW, step=0.05)
        check(calls(up) == n0 + 1, "the mock got %d calls of %s, want 1" % (calls(up) - n0, up))
        time.sleep(0.3)     # on purpose: the client lingers a moment, then leaves while the provider thinks
    evs = wait_n_events(a, g, 1, "the whole answer left")
    check_cost_event(evs[0], "the whole answer left", want, want_classes(1000, 0, 0, 0, 50), "reported", "abandoned", 499)

    # A stream left in the middle: what was relayed is estimated.
    body = it.chat_body(model="Cost-Aband", stream=True, directive="events=50 event_delay_ms=100")
    with it.Conn(a.port, timeout=10) as c:
        c.send(it.http_request("POST", "/v1/chat/completions", body, auth=g.token))
        r = c.read_head(timeout=15)
        check(r.status == 200 and rid(r), "the stream: %s" % r.brief())
        got = b""
        deadline = time.monotonic() + 15 * it.SLOW
        while got.count(b"data:") < 3 and time.monotonic() < deadline:
            got += c.read_chunk(deadline) or b""
        check(got.count(b"data:") >= 3, "three events of the stream did not come: %r" % got[:300])
    e = event(a, g, rid(r), "the stream left")
    what = "the stream left"
    check(e.get("status") == "abandoned" and e.get("http_status") == 499,
          "%s: status %r, http_status %r, want abandoned, 499" % (what, e.get("status"), e.get("http_status")))
    check(e.get("usage_status") == "estimated", "%s: usage_status %r, want estimated" % (what, e.get("usage_status")))
    check(to_micro(e.get("cost"), what) > 0, "%s: cost %r, want > 0" % (what, e.get("cost")))
    check_attempt_sums(e, what)
    d = summary(a, g)
    check(d["totals"].get("abandoned_requests") == 2 and d["totals"].get("requests") == 2,
          "/usage/summary totals: abandoned_requests %r of requests %r, want 2 of 2" % (d["totals"].get("abandoned_requests"), d["totals"].get("requests")))
    check_spend_is_sum(a, g, "the abandoned requests")


def run_timeout_case(a, g, what):
    """Cost-Slow-A scripted slow (its answer reports 1000 in, 50 out), the request's timeout 100 ms,
    the fallback Cost-Slow-B serves: the event, once the first attempt is metered."""
    script("cost-slow-a", ["head_delay_ms=1500 input_tokens=1000 output_tokens=50"])
    body = json.dumps(it.chat_body(model="Cost-Slow-A")).encode()
    r = post(a, g.token, "/v1/chat/completions", body, {"x-ltg-request-timeout": "100", "x-ltg-max-attempts": "1"})
    it.check_x_headers(r, 200, 2, "Cost-Slow-B", what)
    e = event(a, g, rid(r), what)
    att = e.get("attempt_log") or []
    check(len(att) == 2 and att[0].get("model") == "Cost-Slow-A" and att[1].get("model") == "Cost-Slow-B",
          "%s: attempt_log %r" % (what, att))
    check_attempt_sums(e, what)
    it.log("%s: attempt_log %r" % (what, att))
    return e, att, body


@ctest("abandoned attempts: x-ltg-request-timeout 100 ms on a 1.5 s answer, the fallback serving -- the first "
       "attempt is read on and charged its reported usage (cost > 0), the event's cost the sum of its attempts'; "
       "with --meter-abandoned-seconds 0 it is charged its estimate (estimated); the group's spend is its events'")
def t_cost_timeout_metered(a):
    g = group(a, ["Cost-Slow-A", "Cost-Slow-B"], fallbacks={"Cost-Slow-A": ["Cost-Slow-B"]})
    what = "timeout, metered"
    e, att, _ = run_timeout_case(a, g, what)
    check(att[0].get("usage_status") == "reported", "%s: the first attempt's usage_status %r, want reported (%r)"
          % (what, att[0].get("usage_status"), att[0]))
    want = Price("Cost-Slow-A").cost(1000, 0, 0, 0, 50)
    check(to_micro(att[0].get("cost"), what) == want and classes(att[0]) == want_classes(1000, 0, 0, 0, 50),
          "%s: the first attempt charged %r for %r, want %s for 1000 in, 50 out" % (what, att[0].get("cost"), classes(att[0]), usd(want)))
    check(e.get("status") == "succeeded" and e.get("http_status") == 200, "%s: status %r, http_status %r"
          % (what, e.get("status"), e.get("http_status")))
    check_spend_is_sum(a, g, what)

    # The same with --meter-abandoned-seconds 0: the connection is closed, the attempt charged its estimate.
    b = _make(0, tag="cost-meter0-%d", args=["--meter-abandoned-seconds", "0"])
    try:
        b.start()
        g0 = group(b, ["Cost-Slow-A", "Cost-Slow-B"], fallbacks={"Cost-Slow-A": ["Cost-Slow-B"]})
        what = "timeout, --meter-abandoned-seconds 0"
        e, att, body = run_timeout_case(b, g0, what)
        w, inp, out = worst_case("Cost-Slow-A", body)
        check(att[0].get("usage_status") == "estimated" and to_micro(att[0].get("cost"), what) > 0,
              "%s: the first attempt: usage_status %r, cost %r, want estimated, > 0 (%r)" % (what, att[0].get("usage_status"),
                                                                                           att[0].get("cost"), att[0]))
        # A whole answer that never came: its estimate is the attempt's worst case.
        check(to_micro(att[0].get("cost"), what) == w and att[0].get("input_tokens") == inp and att[0].get("output_tokens") == out,
              "%s: the first attempt charged %r for %d in, %r out, want its worst case %s (%d in, %d out)"
              % (what, att[0].get("cost"), att[0].get("input_tokens"), att[0].get("output_tokens"), usd(w), inp, out))
        check(e.get("usage_status") == "estimated", "%s: the event's usage_status %r" % (what, e.get("usage_status")))
        check_spend_is_sum(b, g0, what)
        b.stop()
    finally:
        b.close()


# ===== the worst case, held ========================================================================

def patch_budget(a, g, micro):
    r = it.admin("GET", "/token_groups/" + g.gid, port=a.admin_port)
    v = it.etag_of(r)
    r = it.admin("PATCH", "/token_groups/" + g.gid, ('{"max_budget": %s}' % usd(micro)).encode(), if_match=v, port=a.admin_port)
    check(r.status == 200, "PATCH max_budget %s: %s" % (usd(micro), r.brief()))


def check_refused_unsent(a, token, path, body, up, what):
    n0 = calls(up)
    r = post(a, token, path, body)
    check(r.status == 403, "%s: expected 403 budget_exceeded, got %s" % (what, r.brief()))
    err = jdec(r, what).get("error", {})
    check(err.get("code") == "budget_exceeded", "%s: error %r" % (what, err))
    check(calls(up) == n0, "%s: the mock was called %d time(s)" % (what, calls(up) - n0))
    return err


@ctest("worst case held: a budget of exactly one request's worst case admits it and 1 micro-USD less refuses it; "
       "\"n\": 4 times the output refused before anything reaches the provider; max_tokens < max_completion_tokens: "
       "the larger counts; an image part adds 2000 input tokens; an Anthropic model's input at its 1-hour write price")
def t_cost_worst_case(a):
    up = "cost-bud"
    # n: 1 fits exactly, n: 4 does not; max_tokens 64.
    one = json.dumps(it.chat_body(model="Cost-Bud", max_tokens=64)).encode()
    four = json.dumps(it.chat_body(model="Cost-Bud", max_tokens=64, n=4)).encode()
    w1, _, _ = worst_case("Cost-Bud", one, (64,))
    w4, _, _ = worst_case("Cost-Bud", four, (64,), 4)
    g = group(a, ["Cost-Bud"], budget=w1 - 1)
    check_refused_unsent(a, g.token, "/v1/chat/completions", one, up, "n 1, a budget 1 micro-USD under its worst case %s" % usd(w1))
    patch_budget(a, g, w1)
    check_refused_unsent(a, g.token, "/v1/chat/completions", four, up, "n 4 (worst case %s) on a budget of %s" % (usd(w4), usd(w1)))
    ok200(post(a, g.token, "/v1/chat/completions", one), "n 1 on a budget of exactly its worst case %s" % usd(w1))

    # max_tokens 10 and max_completion_tokens 1000: the budget fits 10, not 1000.
    both = json.dumps(it.chat_body(model="Cost-Bud", max_tokens=10, max_completion_tokens=1000)).encode()
    w_small, _, _ = worst_case("Cost-Bud", both, (10,))
    w_large, _, _ = worst_case("Cost-Bud", both, (10, 1000))
    check(w_large > w_small, "the test's own arithmetic")
    g2 = group(a, ["Cost-Bud"], budget=w_large - 1)
    check_refused_unsent(a, g2.token, "/v1/chat/completions", both, up,
                         "max_tokens 10, max_completion_tokens 1000 (worst case %s) on a budget of %s" % (usd(w_large), usd(w_large - 1)))
    patch_budget(a, g2, w_large)
    ok200(post(a, g2.token, "/v1/chat/completions", both), "the same on a budget of exactly %s" % usd(w_large))

    # No output limit: max_output_tokens 4096; an image_url part: + 2000 input tokens.
    img = {"model": "Cost-Bud", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}
    img = json.dumps(img).encode()
    w_img, inp, _ = worst_case("Cost-Bud", img)
    check(inp == -(-len(img) // 3) + 2000, "the test's own arithmetic")
    g3 = group(a, ["Cost-Bud"], budget=w_img - 1)
    check_refused_unsent(a, g3.token, "/v1/chat/completions", img, up, "an image part, no limit (worst case %s)" % usd(w_img))
    patch_budget(a, g3, w_img)
    ok200(post(a, g3.token, "/v1/chat/completions", img), "the image request on a budget of exactly %s" % usd(w_img))

    # Anthropic: the dearest input class is the 1-hour write, 2 x $3.
    ab = json.dumps(msg_body("Cost-Anth-Bud", max_tokens=300)).encode()
    w_a, inp, out = worst_case("Cost-Anth-Bud", ab, (300,))
    check(w_a == inp * 6 + out * 15, "the test's own arithmetic")
    g4 = group(a, ["Cost-Anth-Bud"], budget=w_a - 1)
    check_refused_unsent(a, g4.token, "/v1/messages", ab, "cost-anth-bud",
                         "Anthropic, %d input tokens at $6 + 300 output at $15 = %s, on a budget of %s" % (inp, usd(w_a), usd(w_a - 1)))
    patch_budget(a, g4, w_a)
    ok200(post(a, g4.token, "/v1/messages", ab), "the Anthropic request on a budget of exactly %s" % usd(w_a))


@ctest("a fallback attempt is admitted on its own: the first times out and is metered (held still), the budget "
       "fits it but not first + second -> 403 budget_exceeded, error.attempts lists the first, nothing reaches the "
       "second model; with first + second it is served; a first refused 500 is billed 0 and lets its hold go")
def t_cost_fallback_hold(a):
    body = json.dumps(it.chat_body(model="Cost-FB-A", max_tokens=100)).encode()
    w, _, _ = worst_case("Cost-FB-A", body, (100,))
    w2, _, _ = worst_case("Cost-FB-B", body, (100,))
    # The first attempt times out and is metered (its answer may still be billed): its hold stays,
    # so the fallback's own worst case does not fit.
    g = group(a, ["Cost-FB-A", "Cost-FB-B"], fallbacks={"Cost-FB-A": ["Cost-FB-B"]}, budget=w + w2 - 1)
    script("cost-fb-a", ["head_delay_ms=2500"])
    na, nb = calls("cost-fb-a"), calls("cost-fb-b")
    r = post(a, g.token, "/v1/chat/completions", body, {"x-ltg-max-attempts": "1", "x-ltg-request-timeout": "300"})
    check(r.status == 403, "a budget of %s for two attempts of %s and %s: expected 403, got %s" % (usd(w + w2 - 1), usd(w), usd(w2), r.brief()))
    err = jdec(r, "the 403").get("error", {})
    check(err.get("code") == "budget_exceeded", "error %r" % err)
    att = err.get("attempts")
    check(isinstance(att, list) and len(att) == 1 and att[0].get("model") == "Cost-FB-A",
          "error.attempts %r, want the first attempt (Cost-FB-A) only" % att)
    check(calls("cost-fb-a") == na + 1 and calls("cost-fb-b") == nb,
          "the mock's calls: Cost-FB-A +%d, Cost-FB-B +%d, want +1, +0" % (calls("cost-fb-a") - na, calls("cost-fb-b") - nb))
    e = event(a, g, rid(r), "the refused fallback")
    check(e.get("http_status") == 403, "the event: http_status %r" % e.get("http_status"))
    check_attempt_sums(e, "the refused fallback")

    g2 = group(a, ["Cost-FB-A", "Cost-FB-B"], fallbacks={"Cost-FB-A": ["Cost-FB-B"]}, budget=w + w2)
    script("cost-fb-a", ["head_delay_ms=2500"])
    r = post(a, g2.token, "/v1/chat/completions", body, {"x-ltg-max-attempts": "1", "x-ltg-request-timeout": "300"})
    it.check_x_headers(r, 200, 2, "Cost-FB-B", "a budget of exactly first + second")
    # A first attempt the provider refused (500) is billed 0 at once and its hold let go: the fallback
    # needs only its own worst case to fit.
    g3 = group(a, ["Cost-FB-A", "Cost-FB-B"], fallbacks={"Cost-FB-A": ["Cost-FB-B"]}, budget=max(w, w2))
    script("cost-fb-a", ["status=500"])
    r = post(a, g3.token, "/v1/chat/completions", body, {"x-ltg-max-attempts": "1"})
    it.check_x_headers(r, 200, 2, "Cost-FB-B", "a budget of the larger worst case, the first attempt refused 500")


# ===== bodies and usage that cannot be taken as they are ==============================================

@ctest("a member name repeated in a nested object (stream_options.include_usage twice) is 400 invalid_request "
       "naming it, and nothing goes upstream; a repeated top-level member still 400")
def t_cost_duplicate_members(a):
    g = group(a, ["Cost-Dup"])
    n0 = calls("cost-dup")
    raw = (b'{"model":"Cost-Dup","messages":[{"role":"user","content":"Hi"}],"stream":true,'
           b'"stream_options":{"include_usage":true,"include_usage":false}}')
    r = post(a, g.token, "/v1/chat/completions", raw)
    e = it.check_openai_error(r, 400, "invalid_request")
    check("include_usage" in e.get("message", ""), "the message does not name include_usage: %r" % e.get("message"))
    raw2 = b'{"model":"Cost-Dup","messages":[{"role":"user","content":"Hi","content":"again"}]}'
    r = post(a, g.token, "/v1/chat/completions", raw2)
    e = it.check_openai_error(r, 400, "invalid_request")
    check("content" in e.get("message", ""), "a message's content twice: the message does not name content: %r" % e.get("message"))
    raw3 = b'{"model":"Cost-Dup","messages":[{"role":"user","content":"Hi"}],"model":"Cost-Dup"}'
    r = post(a, g.token, "/v1/chat/completions", raw3)
    e = it.check_openai_error(r, 400, "invalid_request")
    check("model" in e.get("message", ""), "model twice: the message does not name model: %r" % e.get("message"))
    check(calls("cost-dup") == n0, "the mock was called %d time(s)" % (calls("cost-dup") - n0))
    check(events(a, g) == [], "refused requests left spend events: %r" % events(a, g))


@ctest("usage that cannot be true: input_tokens 10^15 -> estimated (the worst case, under $1000), the log names the "
       "provider, and ltg restarts on the same --data and lists the event; bad_usage negative, fraction, string -> "
       "estimated; usage=none on a whole answer -> estimated at the whole worst case")
def t_cost_hostile_usage(a):
    g = group(a, ["Cost-Hostile"])
    at = a.log_size()
    body = json.dumps(it.chat_body(model="Cost-Hostile", directive="input_tokens=1000000000000000 output_tokens=5",
                                   max_tokens=50)).encode()
    w, inp, out = worst_case("Cost-Hostile", body, (50,))
    r = ok200(post(a, g.token, "/v1/chat/completions", body), "input_tokens 10^15")
    e = event(a, g, rid(r), "input_tokens 10^15")
    c = to_micro(e.get("cost"), "cost")
    check(e.get("usage_status") == "estimated", "input_tokens 10^15: usage_status %r, want estimated" % e.get("usage_status"))
    check(0 < c <= w and c < 1000 * 1000000, "input_tokens 10^15: cost %r, want the estimate, > 0 and at most the worst case %s"
          % (e.get("cost"), usd(w)))
    check_attempt_sums(e, "input_tokens 10^15")
    it.log("input_tokens 10^15: cost %s, worst case %s, event %r" % (e.get("cost"), usd(w), e))
    it.wait_until(lambda: "ltg's log does not name the provider (providers.mock): %r" % a.text_since(at)[-500:],
                  lambda: "providers.mock" in a.text_since(at), 15 * it.SLOW, step=0.1)

    # Restart on the same --data: it starts, and the event is still there.
    a.stop()
    a.start()
    after = [x for x in events(a, g) if x.get("request_id") == rid(r)]
    check(len(after) == 1 and after[0].get("cost") == e.get("cost") and after[0].get("usage_status") == "estimated",
          "after a restart on the same --data the event is %r (before: %r)" % (after, e))

    fails = []
    for kind in ("negative", "fraction", "string"):
        body = json.dumps(it.chat_body(model="Cost-Hostile", directive="bad_usage=" + kind, max_tokens=50)).encode()
        w, _, _ = worst_case("Cost-Hostile", body, (50,))
        r = post(a, g.token, "/v1/chat/completions", body)
        if r.status != 200:
            fails.append("bad_usage=%s: %s" % (kind, r.brief()))
            continue
        x = event(a, g, rid(r), "bad_usage=" + kind)
        cx = to_micro(x.get("cost"), "cost")
        if x.get("usage_status") != "estimated" or not 0 < cx <= w:
            fails.append("bad_usage=%s: usage_status %r, cost %r (worst case %s)" % (kind, x.get("usage_status"), x.get("cost"), usd(w)))
    body = json.dumps(it.chat_body(model="Cost-Hostile", directive="usage=none", max_tokens=50)).encode()
    w, inp, out = worst_case("Cost-Hostile", body, (50,))
    r = post(a, g.token, "/v1/chat/completions", body)
    if r.status != 200:
        fails.append("usage=none: %s" % r.brief())
    else:
        x = event(a, g, rid(r), "usage=none")
        if x.get("usage_status") != "estimated" or to_micro(x.get("cost"), "cost") != w:
            fails.append("usage=none: usage_status %r, cost %r, want estimated, the worst case %s (%d in, %d out)"
                         % (x.get("usage_status"), x.get("cost"), usd(w), inp, out))
    check(not fails, "; ".join(fails))
    check_spend_is_sum(a, g, "the hostile usages")


# ===== the catalog's prices ==========================================================================

@it.test("cost: the catalog refuses a price above 10000 or below 0 and an unknown price field, naming it "
         "(ltg exits non-zero); 10000 itself is taken (Cost-Max)")
def t_cost_catalog_refusals():
    base = _catalog()
    cases = [
        ("input 10000.01", {"input_usd_per_mtok": 10000.01, "output_usd_per_mtok": 1}, "input_usd_per_mtok"),
        ("a negative cache read price", {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1, "cache_read_usd_per_mtok": -0.5},
         "cache_read_usd_per_mtok"),
        ("output 20000", {"input_usd_per_mtok": 1, "output_usd_per_mtok": 20000}, "output_usd_per_mtok"),
        ("a long_context output 10001", {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1,
                                         "long_context": {"above_input_tokens": 1000, "input_usd_per_mtok": 2, "output_usd_per_mtok": 10001}},
         "output_usd_per_mtok"),
        ("an unknown field", {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1, "cache_write_2h_usd_per_mtok": 1},
         "cache_write_2h_usd_per_mtok"),
        ("an unknown long_context field", {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1,
                                           "long_context": {"above_input_tokens": 1000, "input_usd_per_mtok": 2,
                                                            "output_usd_per_mtok": 3, "cache_read_usd_per_mtok": 1}},
         "cache_read_usd_per_mtok"),
    ]
    _LTG.get()      # the cost ltg runs: its catalog has Cost-Max at 10000 USD per million tokens in and out

    def with_bad(prices):       # the cost catalog and the model Bad at these prices
        cfg = json.loads(json.dumps(base))
        cfg["models"]["Bad"] = dict({"provider": "cost-anth", "upstream_model": "bad"}, **prices)
        return cfg
    it.check_catalog_refusals("cost", [(what, with_bad(prices), (field, "models.Bad")) for what, prices, field in cases])


# ===== last: the dedicated ltg exits cleanly ======================================================

_LTG.stop_test(__name__, "cost: the cost ltg exits 0 on SIGTERM, no sanitizer report in its log", "no cost test ran")


if __name__ == "__main__":   # this file alone: python3 tests/integration_cost.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
