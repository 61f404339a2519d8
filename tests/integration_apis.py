"""Integration tests: the other OpenAI APIs clients call -- the Responses API (plain and streamed,
usage, the stream's error event, failover before the first byte, previous_response_id pinned to
the model that made the response), legacy completions, GET /v1/models/{model}, and the ledger's
`endpoint` (README "The inference plane").

Every test provisions its own group and key on the harness's ltg, and scripts the mock per
upstream model. Runs alone: python3 tests/integration_apis.py --ltg ./ltg --mock tests/mock
"""

import datetime
import json
import time

import integration as it

check = it.check


def script(model, steps):
    it.H.mock_post("/_mock/script", {"model": model, "steps": steps})


def key_for(allowed, fallbacks=None, **kw):
    g = it.create_group(it.group_body(allowed_models=allowed, fallbacks=fallbacks or {}, **kw))
    return g, it.create_key(g["id"])[1]


def post(path, body, token, timeout=30.0):
    return it.one_request(it.H.port, "POST", path, body, auth=token, timeout=timeout)


def spend_event(g, rid):
    """The spend event of request rid, among its group's of the days around today (UTC)."""
    today = datetime.datetime.now(datetime.timezone.utc).date()
    q = "/spend/events?start_date=%s&end_date=%s&token_group_id=%s&page[size]=1000" % (
        today - datetime.timedelta(days=1), today + datetime.timedelta(days=2), g["id"])
    for e in it.check_admin_ok(it.admin("GET", q), 200, "GET /spend/events")["data"]:
        if e["request_id"] == rid:
            return e
    raise it.TestFailure("no spend event for %s" % rid)


def resp_body(model="Kimi-K3", stream=False, **kw):
    b = {"model": model, "input": "Hello", **kw}
    if stream:
        b["stream"] = True
    return b


@it.test("responses: POST /v1/responses relayed, usage metered, the ledger's endpoint, the x-ltg headers")
def t_responses():
    g, token = key_for(["Kimi-K3"])
    r = post("/v1/responses", resp_body(), token)
    check(r.status == 200, "status %s" % r.brief())
    j = r.json()
    check(j.get("object") == "response" and j.get("model") == "kimi-k3", "the response: %r" % j)
    check(r.header("x-ltg-served-model") == "Kimi-K3" and r.header("x-ltg-attempts") == "1", "headers %r" % r.headers)
    e = spend_event(g, r.header("x-ltg-request-id"))
    u = j["usage"]
    check(e["endpoint"] == "/v1/responses" and e["input_tokens"] == u["input_tokens"] and e["output_tokens"] == u["output_tokens"]
          and e["cost"] > 0, "the spend event %r (usage %r)" % (e, u))
    c = post("/v1/chat/completions", it.chat_body(), token)
    check(spend_event(g, c.header("x-ltg-request-id"))["endpoint"] == "/v1/chat/completions", "a chat event's endpoint")


@it.test("responses: a stream relayed event by event, its usage from response.completed; a cut ends with event: error")
def t_responses_stream():
    g, token = key_for(["Kimi-K3"])
    r = post("/v1/responses", resp_body(stream=True), token)
    check(r.status == 200 and (r.header("content-type") or "").startswith("text/event-stream"), "status %s" % r.brief())
    ev = it.sse_named(r)
    names = [n for n, _ in ev]
    check(names and names[0] == "response.created" and names[-1] == "response.completed", "the events: %r" % names)
    done = ev[-1][1]["response"]["usage"]
    e = spend_event(g, r.header("x-ltg-request-id"))
    check(e["status"] == "succeeded" and e["input_tokens"] == done["input_tokens"] and e["output_tokens"] == done["output_tokens"],
          "the event %r, usage %r" % (e, done))
    check(not any(d == "[DONE]" for _, d in ev), "ltg added a [DONE] to a Responses stream")
    script("kimi-k3", ["events=5 cut_after=2"])
    r = post("/v1/responses", resp_body(stream=True), token)
    ev = it.sse_named(r)
    check(ev and ev[-1][0] == "error" and ev[-1][1].get("type") == "error" and ev[-1][1].get("code") == "stream_interrupted"
          and ev[-1][1].get("message"), "the end of a cut stream: %r" % ev[-3:])
    check(spend_event(g, r.header("x-ltg-request-id"))["status"] == "partial", "a cut stream's event")


@it.test("responses: failover before the first byte; previous_response_id pins the follow-up to the model that made it")
def t_responses_pin():
    g, token = key_for(["Kimi-K3", "GLM-5.3-Flash"], {"Kimi-K3": ["GLM-5.3-Flash"]})
    script("kimi-k3", ["status=503"])
    r = post("/v1/responses", resp_body(stream=True), token)
    check(r.status == 200 and r.header("x-ltg-served-model") == "GLM-5.3-Flash" and r.header("x-ltg-attempts") == "2",
          "a stream failed over: %s" % r.brief())
    rid = it.sse_named(r)[0][1]["response"]["id"]
    # The follow-up asks for Kimi-K3, but its conversation lives with GLM-5.3-Flash.
    f = post("/v1/responses", resp_body(previous_response_id=rid), token)
    check(f.status == 200 and f.header("x-ltg-served-model") == "GLM-5.3-Flash" and f.json().get("model") == "glm-5.3-flash",
          "the follow-up went to %r" % f.header("x-ltg-served-model"))
    # Pinned: not failed over. The pinned model failing is the answer.
    script("glm-5.3-flash", ["status=503"])
    f = post("/v1/responses", resp_body(previous_response_id=rid), token)
    check(f.status == 503 and f.header("x-ltg-attempts") == "1", "a pinned model that fails: %s" % f.brief())
    # A plain answer pins too.
    p = post("/v1/responses", resp_body(model="GLM-5.3-Flash"), token)
    pid = p.json()["id"]
    f = post("/v1/responses", resp_body(previous_response_id=pid), token)
    check(f.header("x-ltg-served-model") == "GLM-5.3-Flash", "pinned by a non-streamed answer: %r" % f.header("x-ltg-served-model"))
    # Another group's key naming the id learns nothing of it: the pin is the group's, and its
    # request goes to the model it asked for (its provider decides what the id means to it).
    _, other = key_for(["Kimi-K3"])
    f = post("/v1/responses", resp_body(previous_response_id=pid), other)
    check(f.status == 200 and f.header("x-ltg-served-model") == "Kimi-K3" and b"GLM" not in f.body,
          "another group's key: %s" % f.brief())
    # The group itself, once it may no longer call the pinned model: 403, naming it.
    d, v = it.get_group(g["id"])
    it.check_admin_ok(it.admin("PATCH", "/token_groups/" + g["id"], {"allowed_models": ["Kimi-K3"], "fallbacks": {}}, if_match=v),
                      200, "PATCH allowed_models")
    f = post("/v1/responses", resp_body(previous_response_id=pid), token)
    it.check_openai_error(f, 403, "model_not_allowed")
    check("GLM-5.3-Flash" in f.json()["error"]["message"], "the refusal names the model: %r" % f.body)
    # An id ltg does not know goes to the model asked for.
    f = post("/v1/responses", resp_body(previous_response_id="resp_unknown"), token)
    check(f.header("x-ltg-served-model") == "Kimi-K3", "an unknown id: %r" % f.header("x-ltg-served-model"))


@it.test("completions: POST /v1/completions plain and streamed, metered as chat")
def t_completions():
    g, token = key_for(["Kimi-K3"])
    r = post("/v1/completions", {"model": "Kimi-K3", "prompt": "Say hi", "max_tokens": 16}, token)
    check(r.status == 200 and r.json().get("object") == "text_completion", "status %s" % r.brief())
    e = spend_event(g, r.header("x-ltg-request-id"))
    check(e["endpoint"] == "/v1/completions" and e["output_tokens"] == r.json()["usage"]["completion_tokens"], "the event %r" % e)
    s = post("/v1/completions", {"model": "Kimi-K3", "prompt": "Say hi", "stream": True}, token)
    ev = it.sse_named(s)
    check(ev and ev[-1][1] == "[DONE]" and all(d.get("choices") for _, d in ev[:-1]),
          "a completions stream (the usage chunk ltg asked for is kept from the client): %r" % ev[-3:])
    e = spend_event(g, s.header("x-ltg-request-id"))
    check(e["usage_status"] == "reported" and e["output_tokens"] > 0, "a stream's usage: %r" % e)
    bad = post("/v1/completions", {"model": "Kimi-K3", "prompt": "x", "max_tokens": 0}, token)
    it.check_openai_error(bad, 400, "invalid_request")


@it.test("models: GET /v1/models/{model}: one allowed model, or 404 model_not_found")
def t_model_one():
    _, token = key_for(["Kimi-K3"])
    r = it.one_request(it.H.port, "GET", "/v1/models/Kimi-K3", auth=token)
    check(r.status == 200 and r.json().get("id") == "Kimi-K3" and r.json().get("object") == "model", "one model: %s" % r.brief())
    for name in ("GLM-5.3-Flash", "No-Such-Model"):
        it.check_openai_error(it.one_request(it.H.port, "GET", "/v1/models/" + name, auth=token), 404, "model_not_found")
    r = it.one_request(it.H.port, "GET", "/v1/models/Kimi-K3", auth="ltg_sk_" + "y" * 43)
    check(r.status == 401, "a bad key: %d" % r.status)


# ---- Anthropic's Messages API, on an ltg of its own with two Anthropic models ----

def anthropic_ltg(tag):
    cfg = it.catalog_copy()
    cfg["providers"]["anth"] = dict(cfg["providers"]["mock"], api="anthropic")
    cfg["models"]["Claude-M"] = it.catalog_model("anth", "claude-m", 3.0, 15.0)
    cfg["models"]["Claude-B"] = it.catalog_model("anth", "claude-b", 3.0, 15.0)
    return it.Aux(tag, config=it.write_catalog(cfg, tag))


def msg_body(model="Claude-M", stream=False):
    b = {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": "Hello"}]}
    if stream:
        b["stream"] = True
    return b


def anthropic_error(r, status, etype):
    check(r.status == status, "status %d, want %d: %r" % (r.status, status, r.body[:300]))
    j = r.json()
    check(j.get("type") == "error" and j["error"].get("type") == etype and j["error"].get("message"),
          "an Anthropic-shaped %s error: %r" % (etype, j))
    return j


@it.test("messages: POST /v1/messages with x-api-key or Bearer; the provider gets x-api-key and anthropic-version; usage metered")
def t_messages():
    a = anthropic_ltg("anthropic")
    try:
        a.start()
        g = it.create_group(it.group_body(allowed_models=["Claude-M", "Claude-B", "Kimi-K3"],
                                          fallbacks={"Claude-M": ["Kimi-K3", "Claude-B"]}), port=a.admin_port)
        token = it.create_key(g["id"], port=a.admin_port)[1]
        for hdr in ({"x-api-key": token}, {"Authorization": "Bearer " + token}):
            r = it.one_request(a.port, "POST", "/v1/messages", msg_body(), hdr, auth=None)
            check(r.status == 200 and r.json().get("type") == "message" and r.header("x-ltg-served-model") == "Claude-M",
                  "with %s: %s" % (list(hdr), r.brief()))
        last = it.H.mock_get("/_mock/last")
        check(last["headers"].get("x-api-key") == it.PROVIDER_KEY and last["headers"].get("anthropic-version") == "2023-06-01"
              and "authorization" not in last["headers"], "what the provider got: %r" % last["headers"])
        r = it.one_request(a.port, "POST", "/v1/messages", msg_body(), {"x-api-key": token, "anthropic-version": "2023-01-01"}, auth=None)
        check(it.H.mock_get("/_mock/last")["headers"].get("anthropic-version") == "2023-01-01", "the client's anthropic-version is passed on")
        e = spend_event_at(a, g, r.header("x-ltg-request-id"))
        u = r.json()["usage"]
        check(e["endpoint"] == "/v1/messages" and e["input_tokens"] == u["input_tokens"] and e["output_tokens"] == u["output_tokens"],
              "the spend event %r" % e)
        # A stream: usage from message_start (input) and message_delta (output).
        s = it.one_request(a.port, "POST", "/v1/messages", msg_body(stream=True), {"x-api-key": token}, auth=None)
        ev = it.sse_named(s)
        check([n for n, _ in ev][0] == "message_start" and ev[-1][0] == "message_stop", "the stream: %r" % [n for n, _ in ev])
        delta = [d for n, d in ev if n == "message_delta"][0]
        e = spend_event_at(a, g, s.header("x-ltg-request-id"))
        check(e["status"] == "succeeded" and e["output_tokens"] == delta["usage"]["output_tokens"] and
              e["input_tokens"] == ev[0][1]["message"]["usage"]["input_tokens"], "a stream's usage: %r" % e)
        # 529 is no_work; the OpenAI fallback serves, translated (integration_translate.py has the rest).
        script("claude-m", ["status=529"])
        r = it.one_request(a.port, "POST", "/v1/messages", msg_body(), {"x-api-key": token}, auth=None)
        check(r.status == 200 and r.header("x-ltg-served-model") == "Kimi-K3" and r.header("x-ltg-attempts") == "2"
              and r.json().get("type") == "message", "529: %s" % r.brief())
        log = spend_event_at(a, g, r.header("x-ltg-request-id"))["attempt_log"]
        check([(x["model"], x["outcome"], x["api"]) for x in log] == [("Claude-M", "no_work", "messages"), ("Kimi-K3", "ok", "chat")],
              "the attempts %r" % log)
        # "prompt is too long": terminal, the provider's answer relayed.
        script("claude-m", ["context_length"])
        r = it.one_request(a.port, "POST", "/v1/messages", msg_body(), {"x-api-key": token}, auth=None)
        j = anthropic_error(r, 400, "invalid_request_error")
        check("prompt is too long" in j["error"]["message"] and r.header("x-ltg-attempts") == "1", "too long: %r" % j)
        # A stream cut after its start ends with Anthropic's error event.
        script("claude-m", ["events=5 cut_after=2"])
        s = it.one_request(a.port, "POST", "/v1/messages", msg_body(stream=True), {"x-api-key": token}, auth=None)
        last_ev = it.sse_named(s)[-1]
        check(last_ev[0] == "error" and last_ev[1].get("type") == "error" and last_ev[1]["error"].get("type") == "api_error",
              "the end of a cut stream: %r" % (last_ev,))
        # Every attempt failing: Anthropic's shape, with the attempts.
        script("claude-m", ["status=500"])
        script("kimi-k3", ["status=503"])
        script("claude-b", ["status=503"])
        r = it.one_request(a.port, "POST", "/v1/messages", msg_body(), {"x-api-key": token}, auth=None)
        j = anthropic_error(r, 503, "api_error")
        check(len(j["error"].get("attempts", [])) == 3, "the attempts in the error: %r" % j)
        # ltg's own refusals in Anthropic's shape; an endpoint that is not translated says where to call.
        anthropic_error(it.one_request(a.port, "POST", "/v1/messages", msg_body(), auth=None), 401, "authentication_error")
        anthropic_error(it.one_request(a.port, "POST", "/v1/messages", msg_body("Nope"), {"x-api-key": token}, auth=None),
                        403, "permission_error")
        o = it.one_request(a.port, "POST", "/v1/embeddings", {"model": "Claude-B", "input": "x"}, auth=token)
        it.check_openai_error(o, 400, "invalid_request")
        check(b"/v1/messages" in o.body, "the refusal says where to call it: %r" % o.body)
        a.stop()
    finally:
        a.close()


@it.test("messages: POST /v1/messages/count_tokens is relayed, costs nothing and leaves no spend event")
def t_count_tokens():
    a = anthropic_ltg("anthropic-count")
    try:
        a.start()
        g = it.create_group(it.group_body(allowed_models=["Claude-M"], max_budget=0), port=a.admin_port)
        token = it.create_key(g["id"], port=a.admin_port)[1]
        body = {"model": "Claude-M", "messages": [{"role": "user", "content": "Hello"}]}
        r = it.one_request(a.port, "POST", "/v1/messages/count_tokens", body, {"x-api-key": token}, auth=None)
        check(r.status == 200 and isinstance(r.json().get("input_tokens"), int), "count_tokens: %s" % r.brief())
        check(r.header("x-ltg-cost") == "0.000000", "its cost: %r" % r.header("x-ltg-cost"))
        m = it.one_request(a.port, "POST", "/v1/messages", msg_body(), {"x-api-key": token}, auth=None)
        anthropic_error(m, 403, "permission_error")       # a budget of 0 refuses every paid request
        check(spend_events_at(a, g) == [], "count_tokens left a spend event")
        # Counting tokens is free of the rate limits too: it never uses up rpm_limit.
        g2 = it.create_group(it.group_body(allowed_models=["Claude-M"], rpm_limit=2), port=a.admin_port)
        t2 = it.create_key(g2["id"], port=a.admin_port)[1]
        for _ in range(3):
            r = it.one_request(a.port, "POST", "/v1/messages/count_tokens", body, {"x-api-key": t2}, auth=None)
            check(r.status == 200, "count_tokens under rpm_limit 2: %s" % r.brief())
        m = it.one_request(a.port, "POST", "/v1/messages", msg_body(), {"x-api-key": t2}, auth=None)
        check(m.status == 200, "a message after three count_tokens under rpm_limit 2: %s" % m.brief())
        a.stop()
    finally:
        a.close()


@it.test("provider keys: api_key_envs used in turn; a 401 rests that key 60 s and the attempt is made again with the next")
def t_provider_keys():
    cfg = it.catalog_copy()
    cfg["providers"]["two-keys"] = {"base_url": cfg["providers"]["mock"]["base_url"], "api_key_envs": ["LTG_IT_K1", "LTG_IT_K2"]}
    cfg["models"]["Two-Keys"] = it.catalog_model("two-keys", "two-keys-model")
    a = it.Aux("provider-keys", config=it.write_catalog(cfg, "provider-keys"),
               env=dict(it.H.env, LTG_IT_K1="prov-key-one", LTG_IT_K2="prov-key-two"))
    try:
        a.start()
        g = it.create_group(it.group_body(allowed_models=["Two-Keys"]), port=a.admin_port)
        token = it.create_key(g["id"], port=a.admin_port)[1]

        def send():
            r = it.one_request(a.port, "POST", "/v1/chat/completions", it.chat_body("Two-Keys"), auth=token)
            return r, it.H.mock_get("/_mock/last")["headers"].get("authorization")
        seen = [send()[1] for _ in range(2)]
        check(seen == ["Bearer prov-key-one", "Bearer prov-key-two"], "keys in turn: %r" % seen)
        script("two-keys-model", ["status=401"])
        before = it.H.mock_stats().get("calls", {}).get("two-keys-model", 0)
        r, last = send()
        check(r.status == 200 and r.header("x-ltg-attempts") == "1" and last == "Bearer prov-key-two",
              "a 401 on key one: %s, last key %r" % (r.brief(), last))
        check(it.H.mock_stats()["calls"]["two-keys-model"] - before == 2, "the attempt was not made again with the next key")
        check("providers.two-keys: key 0 (of 0..1) answered 401: not used for 60 s" in a.text_since_start(), "no log line for the resting key")
        check("prov-key-" not in a.text_since_start(), "a provider key in ltg's log")
        seen = [send()[1] for _ in range(2)]
        check(seen == ["Bearer prov-key-two"] * 2, "the resting key is not used: %r" % seen)
        m = it.one_request(a.admin_port, "GET", "/metrics", auth=None).body.decode()
        check('ltg_provider_key_failures_total{provider="two-keys",key="0"} 1' in m, "the metric: %r" %
              [l for l in m.splitlines() if "key_failures" in l])
        # Both keys refused: the second 401 is the answer (terminal), one attempt.
        script("two-keys-model", ["status=401", "status=401"])
        r, _ = send()
        check(r.status == 401 and r.header("x-ltg-attempts") == "1", "every key refused: %s" % r.brief())
        a.stop()
    finally:
        a.close()


def spend_events_at(a, g):
    today = datetime.datetime.now(datetime.timezone.utc).date()
    q = "/spend/events?start_date=%s&end_date=%s&token_group_id=%s&page[size]=1000" % (
        today - datetime.timedelta(days=1), today + datetime.timedelta(days=2), g["id"])
    return it.check_admin_ok(it.admin("GET", q, port=a.admin_port), 200, "GET /spend/events")["data"]


def close_after_last(port, path, body, headers, auth, last):
    """Stream `body`, read it up to the event that ends it (`last`, as Codex and other clients
    do), close at once: the request id and everything read. The mock's end of stream comes 3 s
    after that event, so the close always comes first."""
    c = it.Conn(port, timeout=20)
    try:
        c.send(it.http_request("POST", path, body, headers=headers, auth=auth))
        r = c.read_head(20)
        check(r.status == 200, "%s: status %d" % (path, r.status))
        got, deadline = b"", time.monotonic() + 20
        while last not in got:
            chunk = c.read_chunk(deadline)
            check(chunk is not None, "%s: the stream ended before %r: %r" % (path, last, got[-300:]))
            got += chunk
        return r.header("x-ltg-request-id"), got
    finally:
        c.close()


def wait_event(find, what, timeout=15.0):
    """The spend event find() returns (it raises until it is written), waited for."""
    timeout *= it.SLOW
    deadline = time.monotonic() + timeout
    while True:
        try:
            return find()
        except it.TestFailure:
            if time.monotonic() > deadline:
                raise it.TestFailure("%s: no spend event within %g s" % (what, timeout))
            time.sleep(0.1)     # backoff: polling for the event


@it.test("streams: a client that closes as soon as it has the last event (chat's [DONE], Messages' "
         "message_stop, Responses' response.completed), before the provider's end of stream: "
         "succeeded, billed its usage; one that closes before it: abandoned")
def t_close_after_last_event():
    slow_end = "end_delay_ms=3000"
    g, token = key_for(["Kimi-K3"])
    cases = [("/v1/chat/completions", it.chat_body(stream=True, directive=slow_end), b"data: [DONE]"),
             ("/v1/responses", dict(resp_body(stream=True), mock=slow_end), b"event: response.completed")]
    for path, body, last in cases:
        rid, got = close_after_last(it.H.port, path, body, None, token, last)
        e = wait_event(lambda: spend_event(g, rid), path)
        check(e["status"] == "succeeded" and e["http_status"] == 200 and e["output_tokens"] > 0 and
              e["usage_status"] == "reported", "%s: the client had the whole stream: %r" % (path, e))
    # Closed before the last event: the client does not have the answer.
    rid, _ = close_after_last(it.H.port, "/v1/chat/completions",
                              it.chat_body(stream=True, directive="events=3 event_delay_ms=2000"), None, token,
                              b"data: ")
    e = wait_event(lambda: spend_event(g, rid), "cut")
    check(e["status"] == "abandoned" and e["http_status"] == 499, "closed mid-stream: %r" % e)
    a = anthropic_ltg("close-after-last")
    try:
        a.start()
        g = it.create_group(it.group_body(allowed_models=["Claude-M"]), port=a.admin_port)
        token = it.create_key(g["id"], port=a.admin_port)[1]
        body = dict(msg_body(stream=True), mock=slow_end)
        rid, _ = close_after_last(a.port, "/v1/messages", body, {"x-api-key": token}, None,
                                  b"event: message_stop")
        e = wait_event(lambda: spend_event_at(a, g, rid), "/v1/messages")
        check(e["status"] == "succeeded" and e["http_status"] == 200 and e["output_tokens"] > 0,
              "/v1/messages: the client had the whole stream: %r" % e)
    finally:
        a.close()


def spend_event_at(a, g, rid):
    for e in spend_events_at(a, g):
        if e["request_id"] == rid:
            return e
    raise it.TestFailure("no spend event for %s" % rid)


if __name__ == "__main__":   # this file alone: python3 tests/integration_apis.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
