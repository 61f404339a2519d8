"""Integration tests: traffic limits -- a group's rpm_limit and tpm_limit, sliding over 60 s,
tokens reserved at the worst case and settled with the real usage, 429 rate_limited with a
Retry-After, nothing sent upstream; 64 requests in parallel never pass a limit (README "Token
groups", "Rate limits").

Then a token key's own policy (README "Token keys"): its max_budget/budget_duration, rpm_limit,
tpm_limit and blocked, validated, shown, changed by PATCH /token_keys/{id} (If-Match,
Idempotency-Key), enforced beside its group's (a request must fit both; the message says whose),
never passed by parallel requests, counted in ltg_rate_limited_total{scope="key"}, and kept across
a restart (the key's spend rebuilt from the ledger). The "1mo" budget period, on groups and keys.

Runs alone: python3 tests/integration_traffic.py --ltg ./ltg --mock tests/mock
"""

import datetime
import json
import math
import threading
import time

import integration as it

check = it.check


def key_for(**kw):
    g = it.create_group(it.group_body(allowed_models=["Kimi-K3"], **kw))
    return g, it.create_key(g["id"])[1]


def calls():
    return it.H.mock_stats().get("calls", {}).get("kimi-k3", 0)


def parallel(n, token, body, ports=None):
    """n requests at once, each on its own connection: their responses. token: one token key, or a
    list of them used in turn (request i uses token[i % len(token)]); ports: the inference ports to
    spread them over the same way (the harness's ltg's when None)."""
    out = [None] * n
    go = threading.Event()
    tokens = token if isinstance(token, list) else [token]
    ports = ports or [it.H.port]

    def one(i):
        go.wait()
        try:
            out[i] = it.one_request(ports[i % len(ports)], "POST", "/v1/chat/completions", body, auth=tokens[i % len(tokens)],
                                    timeout=60)
        except Exception as e:          # a failure to connect is the test's failure, below
            out[i] = e
    ths = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ths:
        t.start()
    go.set()
    for t in ths:
        t.join(90)
    bad = [r for r in out if not hasattr(r, "status")]
    check(not bad, "%d of %d parallel requests got no answer: %r" % (len(bad), n, bad[:2]))
    return out


def check_limited(r, what):
    it.check_openai_error(r, 429, "rate_limited")
    ra = r.header("retry-after")
    check(ra and ra.isdigit() and 1 <= int(ra) <= 60, "%s: Retry-After %r" % (what, ra))


@it.test("rate limits: rpm_limit 10 under 64 parallel requests: exactly 10 served, 54 refused 429 with Retry-After, none sent upstream")
def t_rpm_parallel():
    g, token = key_for(rpm_limit=10)
    before = calls()
    rs = parallel(64, token, it.chat_body(directive="head_delay_ms=300"))
    ok = [r for r in rs if r.status == 200]
    refused = [r for r in rs if r.status == 429]
    check(len(ok) == 10 and len(refused) == 54, "served %d, refused %d: %r" % (len(ok), len(refused), sorted(set(r.status for r in rs))))
    for r in refused[:5]:
        check_limited(r, "a refused request")
        check(r.header("x-ltg-attempts") == "0", "a refused request made attempts")
    check(calls() - before == 10, "the provider saw %d calls, want 10" % (calls() - before))
    m = it.one_request(it.H.admin_port, "GET", "/metrics", auth=None).body.decode()
    check('ltg_rate_limited_total{token_group="%s",scope="group",limit="rpm_limit"} 54' % g["name"] in m, "the metric: %r"
          % [l for l in m.splitlines() if l.startswith("ltg_rate_limited_total")])


@it.test("rate limits: tpm_limit reserves the worst case (parallel requests never pass it) and settles with the real usage")
def t_tpm():
    body = it.chat_body(directive="head_delay_ms=500", max_tokens=300)
    worst = (len(it.json.dumps(body).encode()) + 2) // 3 + 300     # the body's bytes / 3, plus max_tokens
    g, token = key_for(tpm_limit=worst * 5 + worst // 2)              # room for 5 worst cases at once
    before = calls()
    rs = parallel(64, token, body)
    ok = [r for r in rs if r.status == 200]
    check(len(ok) == 5 and all(r.status in (200, 429) for r in rs), "served %d of 64 (want 5): %r" % (len(ok), sorted(set(r.status for r in rs))))
    check(calls() - before == 5, "the provider saw %d calls, want 5" % (calls() - before))
    check_limited([r for r in rs if r.status == 429][0], "over the tpm_limit")
    # Settled with the real usage (a few tokens each): the minute has room again at once.
    r = it.one_request(it.H.port, "POST", "/v1/chat/completions", body, auth=token, timeout=60)
    check(r.status == 200, "after the settle, a request fits again: %s" % r.brief())
    # A request whose worst case alone passes the limit can never fit: 400, saying what to change.
    big = it.chat_body(max_tokens=worst * 10)
    it.check_openai_error(it.one_request(it.H.port, "POST", "/v1/chat/completions", big, auth=token), 400, "invalid_request")


@it.test("rate limits: validated (1..1000000 requests, 1..1000000000 tokens, or null), shown, kept across a PATCH")
def t_rate_fields():
    for f, bad in (("rpm_limit", 0), ("rpm_limit", 1000001), ("tpm_limit", 0), ("tpm_limit", "x")):
        r = it.admin("POST", "/token_groups", it.group_body(**{f: bad}))
        e = it.check_admin_error(r, 400, "invalid_request", "/" + f, "%s %r" % (f, bad))
        check(f in e["source"]["pointer"], "the pointer: %r" % e)
    g = it.create_group(it.group_body(rpm_limit=5, tpm_limit=1000))
    check(g["rpm_limit"] == 5 and g["tpm_limit"] == 1000, "the group: %r" % g)
    r = it.admin("PATCH", "/token_groups/" + g["id"], {"name": "renamed"}, if_match=1)
    d = it.check_admin_ok(r, 200, "PATCH")["data"]
    check(d["rpm_limit"] == 5 and d["tpm_limit"] == 1000, "after a PATCH: %r" % d)
    r = it.admin("PATCH", "/token_groups/" + g["id"], {"rpm_limit": None}, if_match=2)
    check(it.check_admin_ok(r, 200, "PATCH null")["data"]["rpm_limit"] is None, "null clears it")
    # The minute's window belongs to the live group: a PATCH that changes nothing, or is refused,
    # must leave it alone (under ASan a freed window is a report).
    g, token = key_for(rpm_limit=100)
    chat = lambda: it.one_request(it.H.port, "POST", "/v1/chat/completions", it.chat_body(), auth=token)
    check(chat().status == 200, "the first call")
    it.check_admin_ok(it.admin("PATCH", "/token_groups/" + g["id"], {"rpm_limit": 100}, if_match=1), 200, "a PATCH that changes nothing")
    check(chat().status == 200, "a call after a PATCH that changed nothing")
    it.check_admin_error(it.admin("PATCH", "/token_groups/" + g["id"], {"rpm_limit": 0}, if_match=1), 400, "invalid_request", "/rpm_limit")
    check(chat().status == 200, "a call after a refused PATCH")
    it.check_admin_ok(it.admin("PATCH", "/token_groups/" + g["id"], {"rpm_limit": 3}, if_match=1), 200, "a PATCH that lowers it")
    check(chat().status == 429, "the 4th call of the minute under rpm_limit 3: the window survived the change")


# ===== a token key's own policy ===================================================================

KEY_FIELDS = ("id", "record_type", "name", "token_group_id", "max_budget", "budget_duration", "rpm_limit",
              "tpm_limit", "blocked", "version", "created_at", "updated_at", "spend", "reserved_spend",
              "budget_started_at", "resets_at")
POLICY_FIELDS = ("name", "max_budget", "budget_duration", "rpm_limit", "tpm_limit", "blocked")
READ_ONLY = ("id", "record_type", "version", "created_at", "updated_at", "spend", "reserved_spend",
             "budget_started_at", "resets_at")
KIMI_IN, KIMI_OUT = 0.60, 2.50          # Kimi-K3's prices in the harness catalog: micro-USD per token
DAY_MS = 86400000


def micro(v):
    """A USD amount (JSON number or header text) in micro-USD; None stays None."""
    return None if v is None else int(round(float(v) * 1e6))


def iso_ms(s):
    """An ISO 8601 UTC time (...Z) as epoch ms."""
    check(isinstance(s, str) and it.ISO_RE.match(s), "not an ISO 8601 UTC time: %r" % (s,))
    base, frac = (s[:-1].split(".") + ["0"])[:2]
    t = datetime.datetime.strptime(base, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    return int(t.timestamp() * 1000) + int((frac + "000")[:3])


def now_ms():
    return int(time.time() * 1000)


def kimi_group(**kw):
    return it.create_group(it.group_body(allowed_models=["Kimi-K3"], **kw))


def new_key(gid, **policy):
    """POST /token_keys with a key's own policy: (data without the secret, the secret)."""
    body = {"name": "kp-" + it.new_idem(), "token_group_id": gid}
    body.update(policy)
    r = it.admin("POST", "/token_keys", body)
    d = dict(it.check_admin_ok(r, 201, "POST /token_keys %r" % body)["data"])
    check(it.etag_of(r) == 1 and d.get("version") == 1, "a new key: ETag %r, version %r" % (r.header("etag"), d.get("version")))
    token = d.pop("token", None)
    check(isinstance(token, str) and it.SECRET_RE.match(token), "the new key's token %r" % (token,))
    missing = [f for f in KEY_FIELDS if f not in d]
    check(not missing, "the create answer lacks %r: %r" % (missing, d))
    return d, token


def get_key(kid, secret=None):
    """GET /token_keys/{id}: the key (its ETag checked against its version; never the secret)."""
    r = it.admin("GET", "/token_keys/" + kid)
    d = it.check_admin_ok(r, 200, "GET /token_keys/%s" % kid)["data"]
    check(it.etag_of(r, "GET /token_keys/%s" % kid) == d.get("version"), "ETag %r, version %r" % (r.header("etag"), d.get("version")))
    missing = [f for f in KEY_FIELDS if f not in d]
    check(not missing, "GET /token_keys/%s lacks %r: %r" % (kid, missing, d))
    check(d["record_type"] == "token_key", "record_type %r" % d["record_type"])
    check("token" not in d and (secret is None or secret.encode() not in r.body), "GET shows the secret: %r" % r.body[:300])
    return d


def patch_key(kid, fields, if_match, idem=it.AUTO):
    return it.admin("PATCH", "/token_keys/" + kid, fields, if_match=if_match, idem=idem)


def patched(kid, fields, if_match, want_version):
    """A PATCH that succeeds: the key it answers (200, ETag == version == want_version), which GET shows too."""
    r = patch_key(kid, fields, if_match)
    d = it.check_admin_ok(r, 200, "PATCH /token_keys %r" % fields)["data"]
    check(d.get("version") == want_version and it.etag_of(r) == want_version,
          "PATCH %r: version %r, ETag %r, want %d" % (fields, d.get("version"), r.header("etag"), want_version))
    check("token" not in d, "the PATCH answer shows the secret")
    got = get_key(kid)
    check(got == d, "GET after PATCH %r differs from its answer:\n  %r\n  %r" % (fields, got, d))
    return d


def list_all_keys():
    return it.list_all("token_keys")


def chat(token, body, timeout=60):
    return it.one_request(it.H.port, "POST", "/v1/chat/completions", body, auth=token, timeout=timeout)


def err_message(r):
    return r.json()["error"]["message"]


def names_key(msg):
    """The message names the key itself (not its group)."""
    return "this key" in msg and "this key's group" not in msg


def rate_metric(group_name, scope, limit):
    """ltg_rate_limited_total{token_group,scope,limit} from GET /metrics, or None when absent."""
    m = it.one_request(it.H.admin_port, "GET", "/metrics", auth=None).body.decode()
    pre = 'ltg_rate_limited_total{token_group="%s",scope="%s",limit="%s"} ' % (group_name, scope, limit)
    vals = [l[len(pre):] for l in m.splitlines() if l.startswith(pre)]
    check(len(vals) <= 1, "the series %s appears %d times" % (pre, len(vals)))
    return int(float(vals[0])) if vals else None


def all_rate_metrics(group_name):
    m = it.one_request(it.H.admin_port, "GET", "/metrics", auth=None).body.decode()
    return [l for l in m.splitlines() if l.startswith('ltg_rate_limited_total{token_group="%s",' % group_name)]


def key_events(kid):
    """The key's spend events over [yesterday, the day after tomorrow), through pages of 1000."""
    today = datetime.datetime.now(datetime.timezone.utc).date()
    q = "start_date=%s&end_date=%s&token_key_id=%s" % ((today - datetime.timedelta(days=1)).isoformat(),
                                                         (today + datetime.timedelta(days=2)).isoformat(), kid)
    out, snap = [], None
    for page in range(1, 50):
        pq = q + "&page[size]=1000&page[number]=%d" % page + ("&page[snapshot]=" + snap if snap else "")
        j = it.check_admin_ok(it.admin("GET", "/spend/events?" + pq), 200, "GET /spend/events?" + pq)
        snap = snap or j["meta"].get("snapshot")
        out += j["data"]
        if not j["meta"].get("has_more"):
            return out
    raise it.TestFailure("more than 49 pages of events for key %s" % kid)


def wait_key_events(kid, n, timeout=20.0):
    """The key's events once there are at least n (or what there is after timeout s)."""
    deadline = time.monotonic() + timeout
    evs = key_events(kid)
    while len(evs) < n and time.monotonic() < deadline:
        time.sleep(0.1)
        evs = key_events(kid)
    return evs


def settled(kid, timeout=20.0):
    """GET the key once nothing is reserved on it any more (bounded wait)."""
    deadline = time.monotonic() + timeout
    d = get_key(kid)
    while micro(d["reserved_spend"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        d = get_key(kid)
    check(micro(d["reserved_spend"]) == 0, "reserved_spend %r %g s after every answer" % (d["reserved_spend"], timeout))
    return d


def worst_tokens(body, max_tokens):
    return (len(json.dumps(body).encode()) + 2) // 3 + max_tokens


def worst_micro(body, max_tokens):
    """A request's worst-case cost at Kimi-K3 (micro-USD), computed as ltg does: the body's bytes / 3
    (rounded up) at the input price, max_tokens at the output price, rounded up."""
    prompt = (len(json.dumps(body).encode()) + 2) // 3
    return int(math.ceil(prompt * KIMI_IN + max_tokens * KIMI_OUT))


def real_micro(r):
    """What an answer's usage costs at Kimi-K3 (micro-USD)."""
    u = r.json()["usage"]
    return int(round(u["prompt_tokens"] * KIMI_IN + u["completion_tokens"] * KIMI_OUT))


def next_month_first(ms):
    """The first day of the month after the UTC month of epoch ms: (date string, epoch ms of its 00:00 UTC)."""
    t = datetime.datetime.fromtimestamp(ms / 1000.0, datetime.timezone.utc)
    y, m = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
    first = datetime.datetime(y, m, 1, tzinfo=datetime.timezone.utc)
    return first.date().isoformat(), int(first.timestamp() * 1000)


@it.test("key policy: a key's own limits are shown on create, GET and list (defaults null/false, spend null without a budget, never the secret)")
def t_key_fields():
    g = kimi_group()
    t0 = now_ms()
    plain, s_plain = new_key(g["id"])
    full, s_full = new_key(g["id"], max_budget=2.5, budget_duration="7d", rpm_limit=60, tpm_limit=200000)
    t1 = now_ms()
    blocked, s_blocked = new_key(g["id"], blocked=True)
    want_plain = {"record_type": "token_key", "token_group_id": g["id"], "max_budget": None, "budget_duration": None,
                  "rpm_limit": None, "tpm_limit": None, "blocked": False, "spend": None, "budget_started_at": None,
                  "resets_at": None}
    for f, v in want_plain.items():
        check(plain[f] == v, "a key without a policy: %s is %r, want %r (%r)" % (f, plain[f], v, plain))
    check(micro(plain["reserved_spend"]) == 0, "a new key's reserved_spend %r" % plain["reserved_spend"])
    for f, v in {"max_budget": 2.5, "budget_duration": "7d", "rpm_limit": 60, "tpm_limit": 200000, "blocked": False}.items():
        check(full[f] == v, "a key with a policy: %s is %r, want %r (%r)" % (f, full[f], v, full))
    check(micro(full["spend"]) == 0 and micro(full["reserved_spend"]) == 0, "a new budget's spend %r / reserved %r"
          % (full["spend"], full["reserved_spend"]))
    start = iso_ms(full["budget_started_at"])
    check(t0 - 1000 <= start <= t1 + 1000, "budget_started_at %r is not the moment of the create" % full["budget_started_at"])
    check(iso_ms(full["resets_at"]) == start + 7 * DAY_MS, "7d: resets_at %r, budget_started_at %r"
          % (full["resets_at"], full["budget_started_at"]))
    check(blocked["blocked"] is True, "blocked at create: %r" % blocked)
    # GET and the group's list show the same, without the secret.
    for d, s in ((plain, s_plain), (full, s_full), (blocked, s_blocked)):
        check(get_key(d["id"], s) == d, "GET differs from the create answer (without token): %r" % d)
    r = it.admin("GET", "/token_keys?token_group_id=" + g["id"])
    listed = it.check_admin_ok(r, 200, "the group's keys")["data"]
    check(listed == [plain, full, blocked], "the list differs from the keys: %r" % listed)
    check(all(s.encode() not in r.body for s in (s_plain, s_full, s_blocked)), "the list shows a secret")
    # A key without a budget counts no spend: after a paid call its spend is still null.
    check(chat(s_plain, it.chat_body()).status == 200, "a call with the key without a policy")
    d = settled(plain["id"])
    check(d["spend"] is None, "a key without a budget shows spend %r after a call (want null)" % d["spend"])
    check(d["version"] == 1, "a call changed the key's version: %r" % d)
    # The one with a budget counts what it spent: the answer's x-ltg-cost.
    r = chat(s_full, it.chat_body())
    check(r.status == 200, "a call with the key with a policy: %s" % r.brief())
    d = settled(full["id"])
    check(micro(d["spend"]) == micro(r.header("x-ltg-cost")) > 0, "the key's spend %r after a call that cost %r"
          % (d["spend"], r.header("x-ltg-cost")))
    # blocked at create: refused.
    it.check_openai_error(chat(s_blocked, it.chat_body()), 403, "key_blocked")


def bad_policy_cases(k):
    """(fields, pointer, a piece of the detail or None): refused on a create, and on a PATCH of k (a key
    with a budget), whatever else the body holds."""
    cases = [
        ({"rpm_limit": 0}, "/rpm_limit", None), ({"rpm_limit": 1000001}, "/rpm_limit", None),
        ({"rpm_limit": -5}, "/rpm_limit", None), ({"rpm_limit": 2.5}, "/rpm_limit", None),
        ({"rpm_limit": "10"}, "/rpm_limit", None), ({"rpm_limit": True}, "/rpm_limit", None),
        ({"tpm_limit": 0}, "/tpm_limit", None), ({"tpm_limit": 1000000001}, "/tpm_limit", None),
        ({"tpm_limit": "x"}, "/tpm_limit", None), ({"tpm_limit": [5]}, "/tpm_limit", None),
        ({"max_budget": -1, "budget_duration": "1d"}, "/max_budget", None),
        ({"max_budget": 1000000001, "budget_duration": "1d"}, "/max_budget", None),
        ({"max_budget": 1.0000001, "budget_duration": "1d"}, "/max_budget", None),
        ({"max_budget": "1", "budget_duration": "1d"}, "/max_budget", None),
        ({"max_budget": 1, "budget_duration": "2d"}, "/budget_duration", None),
        ({"max_budget": 1, "budget_duration": "1m"}, "/budget_duration", None),
        ({"max_budget": 1, "budget_duration": "1MO"}, "/budget_duration", None),
        ({"max_budget": 1, "budget_duration": 7}, "/budget_duration", None),
        ({"blocked": "yes"}, "/blocked", None), ({"blocked": 1}, "/blocked", None),
        ({"name": ""}, "/name", None), ({"name": 5}, "/name", None),
        ({"frobnicate": 1}, "/frobnicate", None), ({"rpm_limit": 5, "tpm_limt": 5}, "/tpm_limt", None),
    ]
    for f in READ_ONLY:          # even set to the value it has
        cases.append(({f: k[f]}, "/" + f, "is read-only"))
    return cases


@it.test("key policy: validation on create and PATCH (ranges, unknown and read-only fields, token_group_id cannot change; a budget without a period is a lifetime one); a refused one changes nothing")
def t_key_validation():
    g = kimi_group()
    k, secret = new_key(g["id"], max_budget=2, budget_duration="7d", rpm_limit=10, tpm_limit=1000)
    k0, _ = new_key(g["id"])
    cases = bad_policy_cases(k)
    for fields, pointer, detail in cases:
        body = {"name": "kp-bad", "token_group_id": g["id"]}
        body.update(fields)
        e = it.check_admin_error(it.admin("POST", "/token_keys", body), 400, "invalid_request", pointer, "POST /token_keys %r" % fields)
        check(detail is None or detail in e["detail"], "POST %r: detail %r lacks %r" % (fields, e["detail"], detail))
    keys = it.check_admin_ok(it.admin("GET", "/token_keys?token_group_id=" + g["id"]), 200, "the group's keys")["data"]
    check([x["id"] for x in keys] == [k["id"], k0["id"]], "a refused create made a key: %r" % [x["name"] for x in keys])
    # PATCH: the same refusals, also beside a valid change; and what only a PATCH can get wrong.
    patch_cases = [(f if "name" in f else dict(f, name="renamed-by-a-refused-patch"), p, d) for f, p, d in cases]
    patch_cases += [({"token_group_id": g["id"]}, "/token_group_id", "cannot change"),
                    ({"token_group_id": it.create_group(it.group_body())["id"]}, "/token_group_id", "cannot change")]
    for fields, pointer, detail in patch_cases:
        e = it.check_admin_error(patch_key(k["id"], fields, 1), 400, "invalid_request", pointer, "PATCH %r" % fields)
        check(detail is None or detail in e["detail"], "PATCH %r: detail %r lacks %r" % (fields, e["detail"], detail))
    check(get_key(k["id"]) == k, "a refused PATCH changed the key: %r" % get_key(k["id"]))
    # A budget without a period is a lifetime one (as a group's): accepted, never reset.
    life, _ = new_key(g["id"], max_budget=3)
    check(life["max_budget"] == 3 and life["budget_duration"] is None and life["budget_started_at"] and life["resets_at"] is None
          and life["spend"] == 0, "a lifetime key budget: %r" % life)
    r = chat(secret, it.chat_body(max_tokens=10))       # under its tpm_limit of 1000
    check(r.status == 200, "the key works after the refused PATCHes: %s" % r.brief())
    # The bounds themselves are accepted.
    for policy in ({"rpm_limit": 1, "tpm_limit": 1000000000, "max_budget": 0, "budget_duration": "1d"},
                   {"rpm_limit": 1000000, "tpm_limit": 1, "max_budget": 1000000000, "budget_duration": "30d"},
                   {"max_budget": 0.000001, "budget_duration": "1mo"}, {"max_budget": 12.345678, "budget_duration": "7d"}):
        d, _ = new_key(g["id"], **policy)
        for f, v in policy.items():
            check(d[f] == v if f != "max_budget" else micro(d[f]) == micro(v), "create %r: %s is %r" % (policy, f, d[f]))
    d = patched(k0["id"], {"rpm_limit": 1000000, "tpm_limit": 1000000000, "max_budget": 1000000000, "budget_duration": "1d"}, 1, 2)
    check(d["rpm_limit"] == 1000000 and d["tpm_limit"] == 1000000000 and micro(d["max_budget"]) == micro(1e9) and d["budget_duration"] == "1d",
          "PATCH to the bounds: %r" % d)


@it.test("key policy: PATCH /token_keys/{id}: If-Match (428, 412), Idempotency-Key (required, replayed, 409), omitted kept, null clears, no-op keeps the version, list order kept")
def t_key_patch():
    g = kimi_group()
    before, _ = new_key(g["id"])
    k, secret = new_key(g["id"], max_budget=2, budget_duration="7d", rpm_limit=10, tpm_limit=100000)
    after, _ = new_key(g["id"])
    kid = k["id"]
    order = [x["id"] for x in list_all_keys()]
    it.check_admin_error(patch_key(kid, {"name": "x"}, None), 428, "precondition_required", None, "PATCH without If-Match")
    e = it.check_admin_error(patch_key(kid, {"name": "x"}, 5), 412, "precondition_failed", None, "PATCH with If-Match \"5\" at 1")
    check(e["meta"].get("current_version") == 1, "412: meta %r" % e["meta"])
    it.check_admin_error(patch_key(kid, {"name": "x"}, 1, idem=None), 400, "idempotency_key_required", None, "PATCH without Idempotency-Key")
    check(get_key(kid) == k, "a refused PATCH changed the key")
    state = {f: k[f] for f in POLICY_FIELDS}
    version = 1
    prev = k
    steps = [
        ({"name": "renamed"}, {"name": "renamed"}),
        ({"rpm_limit": None}, {"rpm_limit": None}),
        ({"tpm_limit": 5000, "rpm_limit": 7, "blocked": True}, {"tpm_limit": 5000, "rpm_limit": 7, "blocked": True}),
        ({"blocked": False, "max_budget": 3}, {"blocked": False, "max_budget": 3}),
        ({"max_budget": None, "budget_duration": None, "tpm_limit": None}, {"max_budget": None, "budget_duration": None, "tpm_limit": None}),
        ({"max_budget": 1.5, "budget_duration": "1d"}, {"max_budget": 1.5, "budget_duration": "1d"}),
    ]
    for fields, change in steps:
        version += 1
        d = patched(kid, fields, version - 1, version)
        state.update(change)
        for f in POLICY_FIELDS:
            check(d[f] == state[f], "after PATCH %r: %s is %r, want %r" % (fields, f, d[f], state[f]))
        check(d["id"] == kid and d["token_group_id"] == g["id"] and d["created_at"] == k["created_at"], "PATCH %r moved id/group/created_at" % fields)
        check(d["updated_at"] >= prev["updated_at"], "updated_at went back: %s -> %s" % (prev["updated_at"], d["updated_at"]))
        if "max_budget" in fields and fields["max_budget"] is not None and "budget_duration" not in fields:
            check(d["budget_started_at"] == prev["budget_started_at"] and d["resets_at"] == prev["resets_at"],
                  "changing only the amount moved the period: %r -> %r" % (prev["budget_started_at"], d["budget_started_at"]))
        if d["max_budget"] is None:
            check(d["spend"] is None and d["budget_started_at"] is None and d["resets_at"] is None,
                  "the budget cleared, still: spend %r, period %r .. %r" % (d["spend"], d["budget_started_at"], d["resets_at"]))
        else:
            check(micro(d["spend"]) is not None and d["budget_started_at"] and d["resets_at"], "a budget without its period: %r" % d)
        prev = d
    # A PATCH that changes nothing keeps the version (and answers the key, ETag its version).
    r = patch_key(kid, {"rpm_limit": 7, "name": "renamed", "max_budget": 1.5}, version)
    d = it.check_admin_ok(r, 200, "a PATCH that changes nothing")["data"]
    check(d["version"] == version and it.etag_of(r) == version and d == get_key(kid), "a no-op PATCH: version %r, ETag %r, want %d"
          % (d["version"], r.header("etag"), version))
    # If-Match: * matches any version.
    version += 1
    r = patch_key(kid, {"name": "star"}, "*")
    check(it.check_admin_ok(r, 200, "If-Match: *")["data"]["version"] == version, "If-Match: * did not make version %d" % version)
    # Replays: the same Idempotency-Key gets the first answer, even after a later change (its If-Match stale by then).
    idem = it.new_idem("kp-patch")
    r1 = patch_key(kid, {"name": "idem-first"}, version, idem=idem)
    it.check_admin_ok(r1, 200, "the PATCH to replay")
    check(r1.header("x-ltg-replayed") is None, "a first answer says x-ltg-replayed")
    version += 1
    patched(kid, {"name": "idem-later"}, version, version + 1)
    r2 = patch_key(kid, {"name": "idem-first"}, version, idem=idem)
    it.check_admin_ok(r2, 200, "the replayed PATCH")
    check(r2.body == r1.body and r2.header("etag") == r1.header("etag") == '"%d"' % version and r2.header("x-ltg-replayed") == "true",
          "the replay: %s ETag %r replayed %r; first %s ETag %r" % (r2.brief(), r2.header("etag"), r2.header("x-ltg-replayed"),
                                                                   r1.brief(), r1.header("etag")))
    version += 1
    d = get_key(kid)
    check(d["version"] == version and d["name"] == "idem-later", "the replay changed the key: %r" % d)
    it.check_admin_error(patch_key(kid, {"name": "idem-other"}, version, idem=idem), 409, "idempotency_conflict", None,
                         "the same Idempotency-Key with another body")
    check(get_key(kid) == d, "the conflicting PATCH changed the key")
    # The key keeps its place, in its group's list and in the whole list; the others are untouched.
    listed = it.check_admin_ok(it.admin("GET", "/token_keys?token_group_id=" + g["id"]), 200, "the group's keys")["data"]
    check([x["id"] for x in listed] == [before["id"], kid, after["id"]], "the group's keys after the PATCHes: %r" % [x["name"] for x in listed])
    check(listed[0] == before and listed[2] == after and listed[1] == d, "the list differs from the keys")
    check([x["id"] for x in list_all_keys()] == order, "the PATCHes moved the key in GET /token_keys")
    check(chat(secret, it.chat_body()).status == 200, "the key works after the PATCHes")


@it.test("key policy: blocked: true -> 403 key_blocked, nothing sent upstream; unblocking works at once; the group's other keys unaffected")
def t_key_blocked():
    g = kimi_group()
    k, secret = new_key(g["id"])
    other, s_other = new_key(g["id"])
    check(chat(secret, it.chat_body()).status == 200, "the key before it is blocked")
    patched(k["id"], {"blocked": True}, 1, 2)
    before = calls()
    for body, path in ((it.chat_body(), "/v1/chat/completions"), (it.chat_body(stream=True), "/v1/chat/completions"),
                       ({"model": "Kimi-K3", "input": "x"}, "/v1/embeddings")):
        r = it.one_request(it.H.port, "POST", path, body, auth=secret, timeout=30)
        it.check_openai_error(r, 403, "key_blocked")
    check(calls() == before, "a blocked key's calls reached the provider: %d" % (calls() - before))
    check(chat(s_other, it.chat_body()).status == 200, "blocking a key blocked another key of its group")
    patched(k["id"], {"blocked": False}, 2, 3)
    r = chat(secret, it.chat_body())
    check(r.status == 200, "right after the unblock: %s" % r.brief())
    check(calls() == before + 2, "after the unblock the provider saw %d calls, want 2" % (calls() - before))


@it.test("key policy: key rpm_limit 10 under 64 parallel requests: exactly 10 served, 54 refused 429 naming this key, Retry-After, none upstream, no ledger event, metric scope=key")
def t_key_rpm_parallel():
    g = kimi_group()                          # the group has no limit: the key's applies
    k, token = new_key(g["id"], rpm_limit=10)
    before = calls()
    rs = parallel(64, token, it.chat_body(directive="head_delay_ms=300"))
    ok = [r for r in rs if r.status == 200]
    refused = [r for r in rs if r.status == 429]
    check(len(ok) == 10 and len(refused) == 54, "served %d, refused %d: %r" % (len(ok), len(refused), sorted(set(r.status for r in rs))))
    for r in refused:
        check_limited(r, "a refused request")
        check(r.header("x-ltg-attempts") == "0", "a refused request made attempts: %r" % r.header("x-ltg-attempts"))
        check(names_key(err_message(r)), "a refusal by the key's rpm_limit does not name this key: %r" % err_message(r))
    check(calls() - before == 10, "the provider saw %d calls, want 10" % (calls() - before))
    evs = wait_key_events(k["id"], 10)
    check(len(evs) == 10, "the key has %d spend events, want 10 (one per served request, none for a 429)" % len(evs))
    check(rate_metric(g["name"], "key", "rpm_limit") == 54 and rate_metric(g["name"], "group", "rpm_limit") is None,
          "the metric: %r" % all_rate_metrics(g["name"]))
    # The minute is used up: the next call too is refused, and the key's rpm_limit counts no more.
    r = chat(token, it.chat_body())
    check_limited(r, "the 65th request of the minute")
    check(rate_metric(g["name"], "key", "rpm_limit") == 55, "the metric after one more: %r" % all_rate_metrics(g["name"]))


@it.test("key policy: key tpm_limit reserves the worst case (parallel requests never pass it), settles with the real usage, 400 for a request that can never fit")
def t_key_tpm():
    body = it.chat_body(directive="head_delay_ms=500", max_tokens=300)
    worst = worst_tokens(body, 300)
    g = kimi_group(tpm_limit=1000000)         # the group's is far higher: the key's applies
    k, token = new_key(g["id"], tpm_limit=worst * 5 + worst // 2)
    before = calls()
    rs = parallel(64, token, body)
    ok = [r for r in rs if r.status == 200]
    refused = [r for r in rs if r.status == 429]
    check(len(ok) == 5 and len(refused) == 59, "served %d of 64 (want 5, 59 refused): %r" % (len(ok), sorted(set(r.status for r in rs))))
    check(calls() - before == 5, "the provider saw %d calls, want 5" % (calls() - before))
    for r in refused:
        check_limited(r, "over the key's tpm_limit")
        check(names_key(err_message(r)), "a refusal by the key's tpm_limit does not name this key: %r" % err_message(r))
    check(rate_metric(g["name"], "key", "tpm_limit") == 59 and rate_metric(g["name"], "group", "tpm_limit") is None,
          "the metric: %r" % all_rate_metrics(g["name"]))
    check(len(wait_key_events(k["id"], 5)) == 5, "the key's spend events: want 5, one per served request")
    # Settled with the real usage (a few tokens each): the minute has room again at once.
    r = chat(token, body)
    check(r.status == 200, "after the settle, a request fits again: %s" % r.brief())
    # A request whose worst case alone passes the key's limit can never fit: 400, naming the key.
    r = chat(token, it.chat_body(max_tokens=worst * 10))
    it.check_openai_error(r, 400, "invalid_request")
    check(names_key(err_message(r)), "the 400 does not name this key: %r" % err_message(r))
    check(calls() - before == 6, "the provider saw %d calls, want 6" % (calls() - before))


def body_off5(**kw):
    """A chat body whose prompt tokens (bytes / 3, rounded up) are not a multiple of 5: its worst-case
    input cost (x 0.60) is then never near a whole micro-USD, so rounding cannot move the boundary."""
    for pad in range(12):
        body = it.chat_body(content="worst case" + "." * pad, **kw)
        if ((len(json.dumps(body).encode()) + 2) // 3) % 5:
            return body
    raise it.TestFailure("no padding gives a prompt off a multiple of 5")


@it.test("key policy: the worst case held against a key is exact: bytes / 3 + max_tokens (or the model's 4096) at Kimi-K3's prices, for its budget and its tpm_limit")
def t_key_worst_case():
    g = kimi_group()
    before = calls()
    for mt in (None, 100):
        body = body_off5() if mt is None else body_off5(max_tokens=mt)
        out = 4096 if mt is None else mt
        tok, cost = worst_tokens(body, out), worst_micro(body, out)
        what = "max_tokens %s" % mt
        # The budget: exactly the worst case fits; a micro-USD less does not.
        k, s = new_key(g["id"], max_budget=cost / 1e6, budget_duration="1d")
        r = chat(s, body)
        check(r.status == 200, "%s: a key budget of exactly the worst case (%d micro-USD) refused: %s" % (what, cost, r.brief()))
        check(micro(settled(k["id"])["spend"]) == micro(r.header("x-ltg-cost")) == real_micro(r) < cost,
              "%s: the key's spend %r, the answer's cost %r, want the real cost %d" % (what, settled(k["id"])["spend"], r.header("x-ltg-cost"), real_micro(r)))
        k, s = new_key(g["id"], max_budget=(cost - 1) / 1e6, budget_duration="1d")
        r = chat(s, body)
        it.check_openai_error(r, 403, "budget_exceeded")
        check("the budget of this key" in err_message(r), "%s: %r" % (what, err_message(r)))
        # The tpm_limit: exactly the worst case fits; one token less can never fit (400).
        k, s = new_key(g["id"], tpm_limit=tok)
        r = chat(s, body)
        check(r.status == 200, "%s: a tpm_limit of exactly the worst case (%d tokens) refused: %s" % (what, tok, r.brief()))
        k, s = new_key(g["id"], tpm_limit=tok - 1)
        r = chat(s, body)
        it.check_openai_error(r, 400, "invalid_request")
        check(names_key(err_message(r)) and str(tok) in err_message(r), "%s: the 400 should name this key and the %d tokens: %r"
              % (what, tok, err_message(r)))
    check(calls() - before == 4, "the provider saw %d calls, want 4 (the refused ones sent nothing)" % (calls() - before))


@it.test("key policy: a key budget that fits exactly 4 worst cases: 4 of 64 parallel requests served, the rest 403 budget_exceeded naming this key; spend <= max_budget, the real cost")
def t_key_budget_parallel():
    m = 2000                                  # the mock answers events=N output tokens: the real cost is near the worst
    body = body_off5(mock="head_delay_ms=300 events=%d" % m, max_tokens=m)
    worst = worst_micro(body, m)
    n = 4
    budget = n * worst + 1                    # + 1 micro-USD: ltg's and Python's doubles may round apart
    g = kimi_group(max_budget=100, budget_duration="1d")   # the group's budget is far higher: the key's applies
    k, token = new_key(g["id"], max_budget=budget / 1e6, budget_duration="1d")
    check(micro(k["max_budget"]) == budget, "max_budget %r, want %d micro-USD" % (k["max_budget"], budget))
    before = calls()
    rs = parallel(64, token, body)
    ok = [r for r in rs if r.status == 200]
    refused = [r for r in rs if r.status != 200]
    check(len(ok) == n, "served %d of 64, want %d: %r" % (len(ok), n, sorted(set(r.status for r in rs))))
    for r in refused:
        it.check_openai_error(r, 403, "budget_exceeded")
        msg = err_message(r)
        check("the budget of this key" in msg and "this key's group" not in msg, "the refusal does not name this key's budget: %r" % msg)
        check(micro(r.header("x-ltg-cost")) == 0, "a refused request cost %r" % r.header("x-ltg-cost"))
    check(calls() - before == n, "the provider saw %d calls, want %d" % (calls() - before, n))
    d = settled(k["id"])
    costs = [micro(r.header("x-ltg-cost")) for r in ok]
    for r, c in zip(ok, costs):
        check(r.json()["usage"]["completion_tokens"] == m, "the mock's usage: %r" % r.json()["usage"])
        check(c == real_micro(r) and 0 < c < worst, "x-ltg-cost %r: want the real cost %d (under the worst case %d)" % (c, real_micro(r), worst))
    check(micro(d["spend"]) == sum(costs), "the key's spend %r, want the sum of its answers' costs %d" % (d["spend"], sum(costs)))
    check(micro(d["spend"]) <= micro(d["max_budget"]), "the key spent %r over its max_budget %r" % (d["spend"], d["max_budget"]))
    gd, _ = it.get_group(g["id"])
    check(micro(gd["spend"]) == sum(costs) and micro(gd["reserved_spend"]) == 0, "the group's spend %r / reserved %r, want %d / 0"
          % (gd["spend"], gd["reserved_spend"], sum(costs)))
    # What is left is less than a worst case: the next one is refused too, nothing sent.
    r = chat(token, body)
    it.check_openai_error(r, 403, "budget_exceeded")
    check("the budget of this key" in err_message(r), "the later refusal: %r" % err_message(r))
    check(calls() - before == n, "a refused request reached the provider")
    check(len(wait_key_events(k["id"], n)) == n, "the key's events: want %d" % n)


@it.test("key policy: a request must fit both the key's and the group's limits: the lower applies; two keys of rpm_limit 5 in a group of 8 serve 8 together")
def t_key_and_group():
    # A key's rpm_limit under its group's.
    g = kimi_group(rpm_limit=100)
    k, token = new_key(g["id"], rpm_limit=3)
    rs = parallel(64, token, it.chat_body(directive="head_delay_ms=200"))
    check(sum(r.status == 200 for r in rs) == 3 and sum(r.status == 429 for r in rs) == 61,
          "key 3 under group 100: %r" % sorted(r.status for r in rs))
    check(all(names_key(err_message(r)) for r in rs if r.status == 429), "a refusal does not name this key")
    check(rate_metric(g["name"], "key", "rpm_limit") == 61 and rate_metric(g["name"], "group", "rpm_limit") is None,
          "the metric: %r" % all_rate_metrics(g["name"]))
    # Two keys of rpm_limit 5 in a group of 8: 32 requests each, at once.
    g = kimi_group(rpm_limit=8)
    (ka, sa), (kb, sb) = new_key(g["id"], rpm_limit=5), new_key(g["id"], rpm_limit=5)
    before = calls()
    rs = parallel(64, [sa, sb], it.chat_body(directive="head_delay_ms=300"))
    a_ok = sum(r.status == 200 for r in rs[0::2])
    b_ok = sum(r.status == 200 for r in rs[1::2])
    check(a_ok + b_ok == 8 and a_ok <= 5 and b_ok <= 5, "served %d + %d (want 8 together, at most 5 each): %r"
          % (a_ok, b_ok, sorted(r.status for r in rs)))
    refused = [r for r in rs if r.status != 200]
    for r in refused:
        check_limited(r, "a refusal under two keys' and a group's rpm_limit")
    # The key that served fewer than 5 never reached its own limit: its refusals are all the group's.
    by_group = [r for r in refused if "this key's group" in err_message(r)]
    check(len(by_group) >= 6, "%d refusals name this key's group, want at least 6: %r" % (len(by_group), [err_message(r) for r in refused[:3]]))
    check(calls() - before == 8, "the provider saw %d calls, want 8" % (calls() - before))
    kc, gc = rate_metric(g["name"], "key", "rpm_limit") or 0, rate_metric(g["name"], "group", "rpm_limit") or 0
    check(kc + gc == 56 and gc == len(by_group), "the metric (key %d, group %d; %d messages name the group): %r"
          % (kc, gc, len(by_group), all_rate_metrics(g["name"])))
    # Budgets: a key's budget of 0 refuses with the key's name, a group's of 0 with the group's.
    before = calls()
    g = kimi_group(max_budget=100, budget_duration="7d")
    k, token = new_key(g["id"], max_budget=0, budget_duration="1d")
    r = chat(token, it.chat_body())
    it.check_openai_error(r, 403, "budget_exceeded")
    check("the budget of this key" in err_message(r) and "this key's group" not in err_message(r), "key budget 0: %r" % err_message(r))
    g = kimi_group(max_budget=0, budget_duration="7d")
    k, token = new_key(g["id"], max_budget=100, budget_duration="1d")
    r = chat(token, it.chat_body())
    it.check_openai_error(r, 403, "budget_exceeded")
    check("the budget of this key's group" in err_message(r), "group budget 0: %r" % err_message(r))
    check(calls() == before, "a request over a budget reached the provider")


@it.test("key policy: budget_duration \"1mo\" on groups and keys: resets_at is the 1st of next month 00:00:00 UTC, budget_started_at when the budget was set")
def t_key_month():
    t0 = now_ms()
    g = kimi_group(max_budget=5, budget_duration="1mo")
    k, token = new_key(g["id"], max_budget=1, budget_duration="1mo")
    k7, _ = new_key(g["id"], max_budget=1, budget_duration="7d")
    t1 = now_ms()
    gd, _ = it.get_group(g["id"])
    check(gd["budget_duration"] == "1mo", "the group's budget_duration %r" % gd["budget_duration"])

    def check_month(d, lo, hi, what):
        check(d["budget_duration"] == "1mo", "%s: budget_duration %r" % (what, d["budget_duration"]))
        start = iso_ms(d["budget_started_at"])
        check(lo - 1000 <= start <= hi + 1000, "%s: budget_started_at %r is not when the budget was set" % (what, d["budget_started_at"]))
        day, ms = next_month_first(start)
        check(d["resets_at"][:10] == day and d["resets_at"][10:19] == "T00:00:00" and iso_ms(d["resets_at"]) == ms,
              "%s: resets_at %r, want %sT00:00:00Z (budget_started_at %r)" % (what, d["resets_at"], day, d["budget_started_at"]))

    check_month(gd, t0, t1, "the group")
    check_month(get_key(k["id"]), t0, t1, "the key")
    # A PATCH to 1mo starts a new period then.
    t2 = now_ms()
    d = patched(k7["id"], {"budget_duration": "1mo"}, 1, 2)
    t3 = now_ms()
    check_month(d, t2, t3, "the key PATCHed from 7d")
    check(iso_ms(d["budget_started_at"]) >= iso_ms(k7["budget_started_at"]), "the new period began before the old one")
    gd = it.check_admin_ok(it.admin("PATCH", "/token_groups/" + g["id"], {"budget_duration": "7d"}, if_match=1), 200, "group to 7d")["data"]
    check(gd["budget_duration"] == "7d", "the group PATCHed to 7d: %r" % gd)
    t4 = now_ms()
    gd = it.check_admin_ok(it.admin("PATCH", "/token_groups/" + g["id"], {"budget_duration": "1mo"}, if_match=2), 200, "group to 1mo")["data"]
    check_month(gd, t4, now_ms(), "the group PATCHed back to 1mo")
    listed = it.check_admin_ok(it.admin("GET", "/token_keys?token_group_id=" + g["id"]), 200, "the group's keys")["data"]
    check([x["budget_duration"] for x in listed] == ["1mo", "1mo"], "the list: %r" % [x["budget_duration"] for x in listed])
    for bad in ("2mo", "1 mo", "month", "1mo "):
        it.check_admin_error(it.admin("POST", "/token_groups", it.group_body(max_budget=1, budget_duration=bad)), 400,
                             "invalid_request", "/budget_duration", "a group's budget_duration %r" % bad)
        it.check_admin_error(it.admin("POST", "/token_keys", {"name": "kp-bad", "token_group_id": g["id"], "max_budget": 1,
                                                            "budget_duration": bad}), 400, "invalid_request", "/budget_duration",
                             "a key's budget_duration %r" % bad)
    # The month's budget counts spend like any other.
    r = chat(token, it.chat_body())
    check(r.status == 200, "a call under a 1mo budget: %s" % r.brief())
    check(micro(settled(k["id"])["spend"]) == micro(r.header("x-ltg-cost")) > 0, "the 1mo key's spend after a call")


@it.test("key policy: a key's policy, version and spend survive a restart (same --data): spend rebuilt from the ledger, only what was spent under a budget", fresh=True)
def t_key_restart():
    g = kimi_group()
    a, sa = new_key(g["id"], max_budget=1, budget_duration="1mo", rpm_limit=50, tpm_limit=100000)
    b, sb = new_key(g["id"])                                   # spends before it has a budget, then after
    c, sc = new_key(g["id"], max_budget=1, budget_duration="1d")   # spends, then its budget is removed
    d, sd = new_key(g["id"], rpm_limit=20)                     # blocked by a PATCH
    cost = {}

    def spend_on(token, kid, n, what):
        for i in range(n):
            r = chat(token, it.chat_body(content="%s %d" % (what, i)))
            check(r.status == 200, "%s, call %d: %s" % (what, i, r.brief()))
            cost[kid] = cost.get(kid, 0) + micro(r.header("x-ltg-cost"))
    spend_on(sa, a["id"], 3, "key a")
    spend_on(sb, b["id"], 2, "key b before its budget")
    check(settled(b["id"])["spend"] is None, "key b without a budget shows a spend")
    time.sleep(0.02)    # times are in ms: a charge in the very ms the budget is set belongs to its period
    patched(b["id"], {"max_budget": 2, "budget_duration": "7d"}, 1, 2)
    cost[b["id"]] = 0
    check(micro(get_key(b["id"])["spend"]) == 0, "a budget set after spending counts what came before: %r" % get_key(b["id"])["spend"])
    spend_on(sb, b["id"], 2, "key b under its budget")
    spend_on(sc, c["id"], 1, "key c")
    patched(c["id"], {"max_budget": None, "budget_duration": None}, 1, 2)
    patched(d["id"], {"blocked": True, "name": "blocked-before-restart"}, 1, 2)
    patched(a["id"], {"name": "a-renamed", "tpm_limit": 90000}, 1, 2)
    keys = {x["id"]: settled(x["id"]) for x in (a, b, c, d)}
    check(micro(keys[a["id"]]["spend"]) == cost[a["id"]] > 0, "key a's spend %r, want %d" % (keys[a["id"]]["spend"], cost[a["id"]]))
    check(micro(keys[b["id"]]["spend"]) == cost[b["id"]] > 0, "key b's spend %r, want %d (only what it spent under its budget)"
          % (keys[b["id"]]["spend"], cost[b["id"]]))
    check(keys[c["id"]]["spend"] is None, "key c's budget removed, its spend is %r" % keys[c["id"]]["spend"])
    order = [x["id"] for x in list_all_keys()]
    it.H.start_ltg(it.H.ltg_args or ())                         # SIGTERM, then a new ltg on the same --data
    for kid, was in keys.items():
        now = get_key(kid)
        check(now == was, "key %s differs after the restart:\n  before %r\n  after  %r" % (was["name"], was, now))
    check([x["id"] for x in list_all_keys()] == order, "the keys' order differs after the restart")
    it.check_openai_error(chat(sd, it.chat_body()), 403, "key_blocked")
    for token, kid in ((sa, a["id"]), (sb, b["id"])):
        r = chat(token, it.chat_body(content="after the restart"))
        check(r.status == 200, "a call after the restart: %s" % r.brief())
        now = settled(kid)
        check(micro(now["spend"]) == cost[kid] + micro(r.header("x-ltg-cost")), "spend %r after a call after the restart, want %d"
              % (now["spend"], cost[kid] + micro(r.header("x-ltg-cost"))))
    check(chat(sc, it.chat_body()).status == 200 and settled(c["id"])["spend"] is None, "key c after the restart")
    # The restarted ltg still enforces the key's policy: a budget of 0 on key a refuses it.
    patched(a["id"], {"max_budget": 0}, 2, 3)
    r = chat(sa, it.chat_body())
    it.check_openai_error(r, 403, "budget_exceeded")
    check("the budget of this key" in err_message(r), "after the restart: %r" % err_message(r))


if __name__ == "__main__":   # this file alone: python3 tests/integration_traffic.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
