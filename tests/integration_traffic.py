"""Integration tests: traffic limits -- a group's rpm_limit and tpm_limit, sliding over 60 s,
tokens reserved at the worst case and settled with the real usage, 429 rate_limited with a
Retry-After, nothing sent upstream; 64 requests in parallel never pass a limit (README "Token
groups", "Rate limits").

Runs alone: python3 tests/integration_traffic.py --ltg ./ltg --mock tests/mock
"""

import threading

import integration as it

check = it.check


def key_for(**kw):
    g = it.create_group(it.group_body(allowed_models=["Kimi-K3"], **kw))
    return g, it.create_key(g["id"])[1]


def calls():
    return it.H.mock_stats().get("calls", {}).get("kimi-k3", 0)


def parallel(n, token, body):
    """n requests at once, each on its own connection: their responses."""
    out = [None] * n
    go = threading.Event()

    def one(i):
        go.wait()
        try:
            out[i] = it.one_request(it.H.port, "POST", "/v1/chat/completions", body, auth=token, timeout=60)
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
    check('ltg_rate_limited_total{token_group="%s",limit="rpm_limit"} 54' % g["name"] in m, "the metric: %r"
          % [l for l in m.splitlines() if l.startswith("ltg_rate_limited_total")])


@it.test("rate limits: tpm_limit reserves the worst case (parallel requests never pass it) and settles with the real usage")
def t_tpm():
    body = it.chat_body(directive="head_delay_ms=500", max_tokens=300)
    worst = (len(it.json.dumps(body).encode()) + 2) // 3 + 300     # the body's bytes / 3, plus max_tokens
    g, token = key_for(tpm_limit=worst * 5 + worst // 2)              # room for 5 worst cases at once
    before = calls()
    rs = parallel(32, token, body)
    ok = [r for r in rs if r.status == 200]
    check(len(ok) == 5 and all(r.status in (200, 429) for r in rs), "served %d of 32 (want 5): %r" % (len(ok), sorted(set(r.status for r in rs))))
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


if __name__ == "__main__":   # this file alone: python3 tests/integration_traffic.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
