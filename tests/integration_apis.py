"""Integration tests: the other OpenAI APIs clients call -- the Responses API (plain and streamed,
usage, the stream's error event, failover before the first byte, previous_response_id pinned to
the model that made the response), legacy completions, GET /v1/models/{model}, and the ledger's
`endpoint` (README "The inference plane").

Every test provisions its own group and key on the harness's ltg, and scripts the mock per
upstream model. Runs alone: python3 tests/integration_apis.py --ltg ./ltg --mock tests/mock
"""

import datetime
import json

import integration as it

check = it.check


def script(model, steps):
    it.H.mock_post("/_mock/script", {"model": model, "steps": steps})


def key_for(allowed, fallbacks=None, **kw):
    g = it.create_group(it.group_body(allowed_models=allowed, fallbacks=fallbacks or {}, **kw))
    return g, it.create_key(g["id"])[1]


def post(path, body, token, timeout=30.0):
    return it.one_request(it.H.port, "POST", path, body, auth=token, timeout=timeout)


def events(r):
    """(event name or None, data as JSON or text) of an SSE body."""
    out = []
    for _, text in it.sse_events(r):
        name, data = None, []
        for line in text.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        d = "\n".join(data)
        try:
            d = json.loads(d)
        except ValueError:
            pass
        out.append((name, d))
    return out


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
    ev = events(r)
    names = [n for n, _ in ev]
    check(names and names[0] == "response.created" and names[-1] == "response.completed", "the events: %r" % names)
    done = ev[-1][1]["response"]["usage"]
    e = spend_event(g, r.header("x-ltg-request-id"))
    check(e["status"] == "succeeded" and e["input_tokens"] == done["input_tokens"] and e["output_tokens"] == done["output_tokens"],
          "the event %r, usage %r" % (e, done))
    check(not any(d == "[DONE]" for _, d in ev), "ltg added a [DONE] to a Responses stream")
    script("kimi-k3", ["events=5 cut_after=2"])
    r = post("/v1/responses", resp_body(stream=True), token)
    ev = events(r)
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
    rid = events(r)[0][1]["response"]["id"]
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
    # A key whose group may not call the pinned model: 403.
    _, other = key_for(["Kimi-K3"])
    f = post("/v1/responses", resp_body(previous_response_id=pid), other)
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
    ev = events(s)
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


if __name__ == "__main__":   # this file alone: python3 tests/integration_apis.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
