"""Integration tests: one API for every model (README "One API for every model"). A chain that
crosses API families -- Claude on an Anthropic provider falling back to GLM on an OpenAI-chat
provider, and the reverse -- is translated, not skipped: the request in the provider's API, the
answer (whole or streamed, tool calls included) in the client's, the errors in the client's
shape, the ledger metering the provider's own usage. What cannot be carried is refused with its
JSON Pointer, or skipped in a chain with an `untranslatable` entry.

Runs alone: python3 tests/integration_translate.py --ltg ./ltg --mock tests/mock
"""

import datetime
import json

import integration as it

check = it.check

# alias: (provider, upstream model, input USD/M, output USD/M)
MODELS = {
    "Claude": ("anth", "claude-up", 3.0, 15.0),
    "GLM": ("mock", "glm-up", 0.6, 2.2),
    "Claude-b": ("anth", "claude-b-up", 3.0, 15.0),
    # the error tests' own: the failures they provoke open these models' circuit breakers
    "Claude-err": ("anth", "claude-err", 3.0, 15.0),
    "GLM-err": ("mock", "glm-err", 0.6, 2.2),
    # behind a provider that serves chat only ("endpoints"), and one that serves all four
    "GLM-chat": ("chatonly", "glm-chat-up", 0.6, 2.2),
    "GPT": ("mock", "gpt-up", 1.0, 4.0),
}
_ltg = {}


def ltg():
    """This file's ltg: the harness's catalog with an Anthropic provider (the same mock, speaking
    Anthropic's API) and the models above."""
    if "aux" not in _ltg:
        cfg = it.catalog_copy()
        cfg["providers"]["anth"] = dict(cfg["providers"]["mock"], api="anthropic")
        cfg["providers"]["chatonly"] = dict(cfg["providers"]["mock"], endpoints=["chat"])
        for alias, (prov, up, i, o) in MODELS.items():
            cfg["models"][alias] = dict(it.catalog_model(prov, up, i, o), max_output_tokens=8000)
        a = it.Aux("translate", config=it.write_catalog(cfg, "translate"))
        a.start()
        _ltg["aux"] = a
    return _ltg["aux"]


def group_key(allowed, fallbacks=None):
    a = ltg()
    g = it.create_group(it.group_body(allowed_models=allowed, fallbacks=fallbacks or {}), port=a.admin_port)
    return g, it.create_key(g["id"], port=a.admin_port)[1]


def script(model, steps):
    it.H.mock_post("/_mock/script", {"model": model, "steps": steps})


def post(path, body, token, headers=None, timeout=30.0):
    return it.one_request(ltg().port, "POST", path, body, headers=headers, auth=token, timeout=timeout)


def jbody(r):
    try:
        return json.loads(r.body)
    except ValueError:
        raise it.TestFailure("not JSON (%d): %r" % (r.status, r.body[:300]))


def spend_event(g, rid, timeout=15.0):
    a = ltg()
    today = datetime.datetime.now(datetime.timezone.utc).date()
    q = "/spend/events?start_date=%s&end_date=%s&token_group_id=%s&page[size]=100" % (
        today - datetime.timedelta(days=1), today + datetime.timedelta(days=2), g["id"])
    got = []

    def found():
        got[:] = [e for e in it.check_admin_ok(it.admin("GET", q, port=a.admin_port), 200, "GET /spend/events")["data"]
                  if e["request_id"] == rid]
        return got
    it.wait_until("the spend event of %s" % rid, found, timeout * it.SLOW, 0.1)
    return got[0]


def scripted_events(g, token, upstream, usage, calls):
    """Each (path, body) of `calls` with `upstream`'s answer scripted to `usage`: each 200, and
    its spend event; with the last answer."""
    evs, r = [], None
    for path, body in calls:
        script(upstream, [usage])
        r = post(path, body, token)
        check(r.status == 200, "%s: %d %r" % (path, r.status, r.body[:300]))
        evs.append(spend_event(g, r.header("x-ltg-request-id")))
    return evs, r


def messages_body(model, content="Hi", **kw):
    b = {"model": model, "max_tokens": 100, "messages": [{"role": "user", "content": content}]}
    b.update(kw)
    return b


def chat(model, content="Hi", **kw):
    b = {"model": model, "messages": [{"role": "user", "content": content}]}
    b.update(kw)
    return b


def last_sent():
    last = it.H.mock_last()
    return last["path"], json.loads(last["body"])


@it.test("translate: Claude answers 529, its fallback GLM (OpenAI chat) answers a Messages client in "
         "Anthropic's shape; x-ltg-attempts 2; the ledger's attempts say messages then chat")
def t_failover_messages_to_chat():
    g, token = group_key(["Claude", "GLM"], {"Claude": ["GLM"]})
    script("claude-up", ["status=529"])
    r = post("/v1/messages", messages_body("Claude"), token)
    check(r.status == 200, "status %d: %r" % (r.status, r.body[:300]))
    check(r.header("x-ltg-served-model") == "GLM" and r.header("x-ltg-attempts") == "2",
          "headers %r %r" % (r.header("x-ltg-served-model"), r.header("x-ltg-attempts")))
    j = jbody(r)
    check(j["type"] == "message" and j["role"] == "assistant" and j["content"][0]["type"] == "text"
          and j["content"][0]["text"] == "Hello from glm-up." and j["stop_reason"] == "end_turn",
          "the answer: %r" % j)
    path, sent = last_sent()
    check(path.endswith("/chat/completions") and sent["model"] == "glm-up" and sent["max_tokens"] == 100
          and sent["messages"] == [{"role": "user", "content": "Hi"}], "sent %s %r" % (path, sent))
    u = j["usage"]
    ev = spend_event(g, r.header("x-ltg-request-id"))
    check(ev["client_api"] == "messages" and [a["api"] for a in ev["attempt_log"]] == ["messages", "chat"]
          and [a["outcome"] for a in ev["attempt_log"]] == ["no_work", "ok"], "the event: %r" % ev)
    check(u["input_tokens"] == ev["input_tokens"] and u["output_tokens"] == ev["output_tokens"],
          "usage %r, the ledger %r" % (u, ev))


@it.test("translate: an OpenAI chat client on Claude: the request in Anthropic's shape (max_tokens the "
         "model's max_output_tokens, system hoisted), the answer a chat.completion with its usage")
def t_chat_to_claude():
    g, token = group_key(["Claude"])
    r = post("/v1/chat/completions", chat("Claude", messages=[{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "Hi"}]), token)
    check(r.status == 200, "status %d: %r" % (r.status, r.body[:300]))
    j = jbody(r)
    check(j["object"] == "chat.completion" and j["choices"][0]["message"]["content"] == "Hello from claude-up."
          and j["choices"][0]["finish_reason"] == "stop", "the answer: %r" % j)
    path, sent = last_sent()
    check(path.endswith("/messages") and sent["max_tokens"] == 8000
          and sent["system"] == "Be brief."
          and sent["messages"] == [{"role": "user", "content": "Hi"}],
          "sent %s %r" % (path, sent))
    ev = spend_event(g, r.header("x-ltg-request-id"))
    u = j["usage"]
    check(u["prompt_tokens"] == ev["input_tokens"] and u["completion_tokens"] == ev["output_tokens"]
          and ev["attempt_log"][0]["api"] == "messages" and ev["client_api"] == "chat", "usage %r, event %r" % (u, ev))


@it.test("translate: streams both ways -- a Messages client on GLM gets message_start ... message_stop "
         "with the provider's counts in message_delta; a chat client on Claude gets chunks, the usage "
         "chunk it asked for and [DONE]")
def t_streams():
    g, token = group_key(["Claude", "GLM"])
    r = post("/v1/messages", messages_body("GLM", stream=True), token)
    check(r.status == 200, "status %d: %r" % (r.status, r.body[:300]))
    ev = it.sse_named(r)
    names = [n for n, _ in ev]
    check(names[0] == "message_start" and names[-1] == "message_stop" and names[-2] == "message_delta"
          and "content_block_start" in names and "content_block_stop" in names, "events %r" % names)
    text = "".join(d["delta"]["text"] for n, d in ev if n == "content_block_delta")
    check(text == "word word word ", "text %r" % text)
    spend = spend_event(g, r.header("x-ltg-request-id"))
    md = [d for n, d in ev if n == "message_delta"][0]
    check(md["delta"]["stop_reason"] == "end_turn" and md["usage"]["output_tokens"] == spend["output_tokens"]
          and md["usage"]["input_tokens"] == spend["input_tokens"], "message_delta %r, event %r" % (md, spend))
    r = post("/v1/chat/completions", chat("Claude", stream=True, stream_options={"include_usage": True}), token)
    check(r.status == 200, "status %d: %r" % (r.status, r.body[:300]))
    datas = [d for _, d in it.sse_named(r)]
    check(datas[-1] == "[DONE]" and datas[-2]["choices"] == [] and datas[-3]["choices"][0]["finish_reason"] == "stop",
          "chunks %r" % datas[-3:])
    check(datas[0]["choices"][0]["delta"].get("role") == "assistant", "first chunk %r" % datas[0])
    text = "".join(d["choices"][0]["delta"].get("content") or "" for d in datas[:-2])
    check(text == "word word word ", "text %r" % text)


@it.test("translate: refused with its JSON Pointer -- n=2 to Claude (400 untranslatable_field, param /n); "
         "a chain whose first model cannot take it skips it, logged untranslatable, not counted")
def t_untranslatable():
    _, alone = group_key(["Claude"])
    r = post("/v1/chat/completions", chat("Claude", n=2), alone)
    check(r.status == 400, "status %d: %r" % (r.status, r.body[:300]))
    e = jbody(r)["error"]
    check(e["code"] == "untranslatable_field" and e["param"] == "/n" and "Anthropic" in e["message"],
          "the error %r" % e)
    g, token = group_key(["Claude", "GLM"], {"Claude": ["GLM"]})
    r = post("/v1/chat/completions", chat("Claude", n=2), token)
    check(r.status == 200 and r.header("x-ltg-served-model") == "GLM" and r.header("x-ltg-attempts") == "1",
          "%d %r %r" % (r.status, r.header("x-ltg-attempts"), r.body[:200]))
    ev = spend_event(g, r.header("x-ltg-request-id"))
    a = ev["attempt_log"]
    check(len(a) == 2 and a[0]["outcome"] == "untranslatable" and a[0]["status"] == 0 and a[0]["ms"] == 0
          and "/n" in a[0]["error"] and a[0]["api"] is None and a[1]["outcome"] == "ok", "attempt_log %r" % a)
    body = messages_body("GLM", tools=[{"type": "web_search_20250305", "name": "web_search"}])
    r = post("/v1/messages", body, token)
    e = jbody(r)
    check(r.status == 400 and e["type"] == "error" and e["error"]["code"] == "untranslatable_field"
          and e["error"]["param"] == "/tools/0/type", "%d %r" % (r.status, e))


@it.test("translate: a provider's endpoints -- what it does not serve is never sent to it: refused (no call) "
         "for a model alone, skipped as untranslatable in a chain; what it serves passes as it is")
def t_endpoints():
    g, token = group_key(["GLM-chat", "GPT"], {"GLM-chat": ["GPT"]})
    _, alone = group_key(["GLM-chat"])
    before = it.H.mock_get("/_mock/stats")
    for path, body in (("/v1/embeddings", {"model": "GLM-chat", "input": "Hi"}),):
        r = post(path, body, alone)
        e = jbody(r).get("error") or {}
        check(r.status == 400 and e.get("code") == "invalid_request" and "serves chat, not" in e.get("message", ""),
              "%s: %d %r" % (path, r.status, r.body[:300]))
    check(it.H.mock_get("/_mock/stats")["requests"] == before["requests"], "the provider was sent what it does not serve")
    r = post("/v1/embeddings", {"model": "GLM-chat", "input": "Hi"}, token)
    check(r.status == 200 and r.header("x-ltg-served-model") == "GPT" and r.header("x-ltg-attempts") == "1",
          "the chain: %d %r %r" % (r.status, r.header("x-ltg-served-model"), r.body[:200]))
    a = spend_event(g, r.header("x-ltg-request-id"))["attempt_log"]
    check(len(a) == 2 and a[0]["outcome"] == "untranslatable" and a[0]["status"] == 0 and "serves chat, not embeddings"
          in a[0]["error"] and a[1]["outcome"] == "ok", "attempt_log %r" % a)
    r = post("/v1/chat/completions", chat("GLM-chat"), alone)
    check(r.status == 200 and r.header("x-ltg-dropped") is None, "chat, served: %d %r" % (r.status, r.body[:200]))
    r = post("/v1/messages", messages_body("GLM-chat"), alone)
    check(r.status == 200 and jbody(r)["type"] == "message", "Messages, translated to chat: %d %r" % (r.status, r.body[:200]))


@it.test("translate: a Responses client on a chat-only model -- the request sent as chat (instructions, items, a "
         "custom tool as a function), the answer a Responses object (resp_ + the request id, the text, a call as a "
         "function_call), usage and cost a direct chat call's; previous_response_id naming it refused")
def t_responses():
    g, token = group_key(["GLM-chat"])
    usage = "input_tokens=1200 cached_tokens=300 reasoning_tokens=20 output_tokens=77"
    body = {"model": "GLM-chat", "instructions": "be brief", "store": False,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            "tools": [{"type": "custom", "name": "apply_patch", "description": "Edit files.",
                       "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}}]}
    evs, r = scripted_events(g, token, "glm-chat-up", usage,
                                (("/v1/chat/completions", chat("GLM-chat")), ("/v1/responses", body)))
    j = jbody(r)
    sent = it.H.mock_get("/_mock/last")
    want = json.loads(sent["body"])
    check(sent["path"].endswith("/chat/completions") and want["messages"][0] == {"role": "system", "content": "be brief"}
          and want["messages"][1] == {"role": "user", "content": "Hi"}
          and want["tools"][0]["function"]["name"] == "apply_patch"
          and want["tools"][0]["function"]["parameters"]["required"] == ["input"], "sent %r" % sent)
    msg = [o for o in j["output"] if o["type"] == "message"]
    check(j["object"] == "response" and j["id"] == "resp_" + r.header("x-ltg-request-id") and j["status"] == "completed"
          and msg and msg[0]["content"][0]["type"] == "output_text" and msg[0]["content"][0]["text"]
          and j["usage"]["input_tokens"] == 1200 and j["usage"]["input_tokens_details"]["cached_tokens"] == 300
          and j["usage"]["output_tokens"] == 77 and j["store"] is False, "the answer %r" % j)
    keys = ("input_tokens", "cache_read_tokens", "reasoning_tokens", "output_tokens", "cost")
    check({k: evs[0][k] for k in keys} == {k: evs[1][k] for k in keys} and evs[1]["client_api"] == "responses",
          "direct %r, translated %r" % tuple({k: e[k] for k in keys + ("client_api",)} for e in evs))
    script("glm-chat-up", ["tool_call"])
    r = post("/v1/responses", body, token)
    calls = [o for o in jbody(r)["output"] if o["type"] == "function_call"]
    check(r.status == 200 and len(calls) == 1 and calls[0]["call_id"].startswith("call_mock")
          and "mock-tool" in calls[0]["arguments"], "a call: %d %r" % (r.status, r.body[:400]))
    for extra, param in (({"previous_response_id": j["id"]}, "/previous_response_id"),):
        r = post("/v1/responses", dict(body, **extra), token)
        e = jbody(r).get("error") or {}
        check(r.status == 400 and e.get("code") == "untranslatable_field" and e.get("param") == param,
              "%s: %d %r" % (param, r.status, r.body[:300]))


@it.test("translate: a Responses client on a chat-only model, streamed whole and one byte per write -- one resp_ "
         "id, sequence numbers 0, 1, 2..., reasoning and text items with their deltas and whole .done, three "
         "parallel calls as function_call items whole at the end, response.completed with every item and the "
         "ledger's usage; the same items as the answer not streamed")
def t_responses_stream():
    g, token = group_key(["GLM-chat"])
    body = {"model": "GLM-chat", "input": "Hi", "stream": True}
    seen = []
    for bytewise in ("", " bytewise"):
        script("glm-chat-up", ["tools=3 text_first reasoning=2 finish=stop" + bytewise])
        r = post("/v1/responses", body, token)
        check(r.status == 200 and (r.header("content-type") or "").startswith("text/event-stream"),
              "status %d: %r" % (r.status, r.body[:300]))
        evs = [(n, d) for n, d in it.sse_named(r)]
        names = [n for n, _ in evs]
        check(all(isinstance(d, dict) and d.get("type") == n for n, d in evs), "event names and types %r" % names)
        check([d["sequence_number"] for _, d in evs] == list(range(len(evs))), "sequence numbers %r" % evs)
        check(names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed",
              "the events %r" % names)
        rid = r.header("x-ltg-request-id")
        check(all(d["response"]["id"] == "resp_" + rid for n, d in evs if "response" in d), "one id")
        text = "".join(d["delta"] for n, d in evs if n == "response.output_text.delta")
        done = [d["text"] for n, d in evs if n == "response.output_text.done"]
        final = evs[-1][1]["response"]
        items = [(o["type"], o.get("name"), json.loads(o["arguments"]) if "arguments" in o else None)
                 for o in final["output"]]
        check(text == "Let me check." and done == [text] and items[0][0] == "reasoning" and items[1][0] == "message"
              and [i[1] for i in items[2:]] == ["tool_0", "tool_1", "tool_2"]
              and [i[2] for i in items[2:]] == calls_want(3), "text %r, done %r, items %r" % (text, done, items))
        ev = spend_event(g, rid)
        check(final["usage"]["output_tokens"] == ev["output_tokens"] and final["usage"]["input_tokens"]
              == ev["input_tokens"] and ev["client_api"] == "responses", "usage %r, the ledger %r" % (final["usage"], ev))
        seen.append(items)
    script("glm-chat-up", ["tools=3 text_first reasoning=2 finish=stop"])
    j = jbody(post("/v1/responses", dict(body, stream=False), token))
    whole = [(o["type"], o.get("name"), json.loads(o["arguments"]) if "arguments" in o else None)
             for o in j["output"]]
    check(seen[0] == seen[1] == whole, "whole %r, streamed %r" % (whole, seen))


@it.test("translate: a Responses client on Claude (through chat's form) -- sent as Messages (instructions as "
         "system), the answer and the stream (two parallel calls, text first) in Responses' shape, usage and cost "
         "a direct Messages call's")
def t_responses_claude():
    g, token = group_key(["Claude"])
    usage = "input_tokens=1200 cached_tokens=300 cache_write=500 output_tokens=77"
    body = {"model": "Claude", "instructions": "be brief", "input": "Hi"}
    evs, r = scripted_events(g, token, "claude-up", usage,
                                (("/v1/messages", messages_body("Claude")), ("/v1/responses", body)))
    sent = it.H.mock_get("/_mock/last")
    want = json.loads(sent["body"])
    check(sent["path"].endswith("/messages") and want.get("system") == "be brief"
          and want["messages"] == [{"role": "user", "content": "Hi"}] and want["max_tokens"] == 8000, "sent %r" % sent)
    j = jbody(r)
    check(j["object"] == "response" and j["output"][-1]["type"] == "message" and j["usage"]["input_tokens"] == 2000
          and j["usage"]["input_tokens_details"]["cached_tokens"] == 300, "the answer %r" % j)
    keys = ("input_tokens", "cache_read_tokens", "cache_write_tokens", "output_tokens", "cost")
    check({k: evs[0][k] for k in keys} == {k: evs[1][k] for k in keys}, "direct %r, translated %r"
          % tuple({k: e[k] for k in keys} for e in evs))
    for bytewise in ("", " bytewise"):
        script("claude-up", ["tools=2 text_first" + bytewise])
        r = post("/v1/responses", dict(body, stream=True), token)
        evs = it.sse_named(r)
        final = evs[-1][1]
        check(r.status == 200 and evs[-1][0] == "response.completed"
              and [d["sequence_number"] for _, d in evs] == list(range(len(evs))), "events %r" % [n for n, _ in evs])
        items = final["response"]["output"]
        check([o["type"] for o in items] == ["message", "function_call", "function_call"]
              and items[0]["content"][0]["text"] == "Let me check."
              and [json.loads(o["arguments"]) for o in items[1:]] == calls_want(2), "items %r" % items)
        ev = spend_event(g, r.header("x-ltg-request-id"))
        check(final["response"]["usage"]["output_tokens"] == ev["output_tokens"], "usage %r, the ledger %r"
              % (final["response"]["usage"], ev))


@it.test("translate: count_tokens for a model behind OpenAI chat: ltg's estimate, x-ltg-estimated, no call")
def t_count_tokens():
    g, token = group_key(["GLM"])
    before = it.H.mock_get("/_mock/stats")
    r = post("/v1/messages/count_tokens", {"model": "GLM", "messages": [{"role": "user", "content": "Hi"}]}, token)
    check(r.status == 200 and r.header("x-ltg-estimated") == "true" and jbody(r)["input_tokens"] > 0,
          "%d %r %r" % (r.status, r.headers, r.body))
    check(it.H.mock_get("/_mock/stats")["requests"] == before["requests"], "the mock was called")


def anthropic_stream(ev):
    """Reassembles a Messages stream, holding it to its grammar: message_start first, blocks at
    indexes 0, 1, ... each opened, fed and closed before the next, one message_delta, then
    message_stop last. Returns (blocks, stop_reason, the message_delta's usage)."""
    names = [n for n, _ in ev if n != "ping"]
    check(names[:1] == ["message_start"] and names[-2:] == ["message_delta", "message_stop"]
          and names.count("message_delta") == 1, "the events %r" % names)
    blocks, open_, md = [], None, None
    for n, d in ev:
        if n == "content_block_start":
            check(open_ is None and d["index"] == len(blocks), "a block opened at %r with %r open" % (d["index"], open_))
            b = dict(d["content_block"])
            b["json"] = ""
            blocks.append(b)
            open_ = d["index"]
        elif n == "content_block_delta":
            check(d["index"] == open_, "a delta for block %r, open %r" % (d["index"], open_))
            x, b = d["delta"], blocks[open_]
            if x["type"] == "text_delta":
                b["text"] += x["text"]
            elif x["type"] == "input_json_delta":
                b["json"] += x["partial_json"]
            else:
                check(x["type"] in ("thinking_delta", "signature_delta"), "delta %r" % x)
        elif n == "content_block_stop":
            check(d["index"] == open_, "stop %r, open %r" % (d["index"], open_))
            open_ = None
        elif n == "message_delta":
            check(open_ is None, "message_delta with block %r open" % open_)
            md = d
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.pop("json") or "{}")
        else:
            b.pop("json")
    return blocks, md["delta"]["stop_reason"], md["usage"]


def chat_stream(datas):
    """Reassembles a chat stream: the role in the first chunk, text, reasoning, tool calls by
    index (id and name first, then arguments), one finish_reason, the usage chunk, [DONE] last.
    Returns (text, reasoning, [(id, name, arguments)], finish_reason, usage)."""
    check(datas[-1] == "[DONE]" and datas[0]["choices"][0]["delta"].get("role") == "assistant",
          "first %r, last %r" % (datas[0], datas[-1]))
    text, reasoning, calls, finish, usage = "", "", {}, [], None
    for d in datas[:-1]:
        if d.get("usage"):
            usage = d["usage"]
        for c in d["choices"]:
            x = c["delta"]
            text += x.get("content") or ""
            reasoning += x.get("reasoning_content") or ""
            for t in x.get("tool_calls") or []:
                if t["index"] not in calls:
                    check(t.get("id") and t["function"].get("name"), "a call opened without id and name: %r" % t)
                    calls[t["index"]] = [t["id"], t["function"]["name"], ""]
                calls[t["index"]][2] += t["function"].get("arguments") or ""
            if c.get("finish_reason"):
                finish.append(c["finish_reason"])
    check(len(finish) == 1 and sorted(calls) == list(range(len(calls))), "finishes %r, calls %r" % (finish, calls))
    return text, reasoning, [tuple(calls[i]) for i in sorted(calls)], finish[0], usage


def calls_want(n):
    return [{"i": i, "city": "Paris %d" % i} for i in range(n)]


@it.test("translate: a Messages client on GLM, three parallel calls with interleaved argument pieces (two calls "
         "in one chunk), text first, reasoning and GLM's finish stop -- streamed whole and one byte per write, "
         "and not streamed: one text block, three tool_use blocks in order, stop_reason tool_use, no thinking")
def t_stream_tools_messages_on_chat():
    g, token = group_key(["GLM"])
    seen = []
    for bytewise in ("", " bytewise"):
        script("glm-up", ["tools=3 text_first reasoning=2 finish=stop" + bytewise])
        r = post("/v1/messages", messages_body("GLM", stream=True), token)
        check(r.status == 200, "status %d: %r" % (r.status, r.body[:300]))
        blocks, stop, usage = anthropic_stream(it.sse_named(r))
        check([b["type"] for b in blocks] == ["text", "tool_use", "tool_use", "tool_use"]
              and blocks[0]["text"] == "Let me check." and stop == "tool_use", "blocks %r, stop %r" % (blocks, stop))
        check([b["input"] for b in blocks[1:]] == calls_want(3) and [b["name"] for b in blocks[1:]]
              == ["tool_0", "tool_1", "tool_2"], "the calls %r" % blocks[1:])
        ev = spend_event(g, r.header("x-ltg-request-id"))
        check(usage["output_tokens"] == ev["output_tokens"] and usage["input_tokens"] == ev["input_tokens"],
              "usage %r, the ledger %r" % (usage, ev))
        seen.append([(b["type"], b.get("text"), b.get("name"), b.get("input")) for b in blocks])
    script("glm-up", ["tools=3 text_first reasoning=2 finish=stop"])
    j = jbody(post("/v1/messages", messages_body("GLM"), token))
    whole = [(b["type"], b.get("text"), b.get("name"), b.get("input")) for b in j["content"]]
    check(seen[0] == seen[1] == whole and j["stop_reason"] == "tool_use", "whole %r, streamed %r" % (whole, seen))


@it.test("translate: a chat client on Claude, three parallel calls, text first and thinking -- streamed whole and "
         "one byte per write, and not streamed: tool_calls by index with their arguments, reasoning_content, "
         "finish tool_calls, the usage chunk (inclusive counts) and [DONE]")
def t_stream_tools_chat_on_messages():
    g, token = group_key(["Claude"])
    seen = []
    for bytewise in ("", " bytewise"):
        script("claude-up", ["tools=3 text_first reasoning=2 cached_tokens=4 cache_write=6" + bytewise])
        r = post("/v1/chat/completions", chat("Claude", stream=True, stream_options={"include_usage": True}), token)
        check(r.status == 200, "status %d: %r" % (r.status, r.body[:300]))
        text, reasoning, calls, finish, usage = chat_stream([d for _, d in it.sse_named(r)])
        check(text == "Let me check." and reasoning == "think think " and finish == "tool_calls",
              "text %r, reasoning %r, finish %r" % (text, reasoning, finish))
        check([json.loads(a) for _, _, a in calls] == calls_want(3) and [n for _, n, _ in calls]
              == ["tool_0", "tool_1", "tool_2"], "the calls %r" % calls)
        ev = spend_event(g, r.header("x-ltg-request-id"))
        check(usage["prompt_tokens"] == ev["input_tokens"] and usage["completion_tokens"] == ev["output_tokens"]
              and usage["prompt_tokens_details"]["cached_tokens"] == ev["cache_read_tokens"] == 4,
              "usage %r, the ledger %r" % (usage, ev))
        seen.append((text, reasoning, [(n, json.loads(a)) for _, n, a in calls]))
    script("claude-up", ["tools=3 text_first reasoning=2 cached_tokens=4 cache_write=6"])
    m = jbody(post("/v1/chat/completions", chat("Claude"), token))["choices"][0]
    whole = (m["message"]["content"], m["message"].get("reasoning_content"),
             [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in m["message"]["tool_calls"]])
    check(seen[0] == seen[1] == whole and m["finish_reason"] == "tool_calls", "whole %r, streamed %r" % (whole, seen))


@it.test("translate: cut streams end as the client's API ends them -- an error event after the head reaches a "
         "Messages client on GLM as Anthropic's event: error, a chat client on Claude as chat's error chunk; "
         "an error before any content fails over to the fallback, which passes through with nothing of the translated attempt left")
def t_stream_errors():
    g, token = group_key(["Claude", "GLM"], {"Claude": ["GLM"]})
    script("glm-up", ["stream_error=server_error cut_after=1"])
    r = post("/v1/messages", messages_body("GLM", stream=True), token)
    ev = it.sse_named(r)
    check(r.status == 200 and ev[-1][0] == "error" and ev[-1][1]["type"] == "error"
          and "message_stop" not in [n for n, _ in ev], "events %r" % ev[-3:])
    script("claude-up", ["stream_error=api_error cut_after=1"])
    r = post("/v1/chat/completions", chat("Claude", stream=True), token)
    datas = [d for _, d in it.sse_named(r)]
    check(r.status == 200 and isinstance(datas[-1], dict) and "error" in datas[-1], "chunks %r" % datas[-3:])
    script("claude-up", ["stream_error=overloaded_error"])
    r = post("/v1/chat/completions", chat("Claude", stream=True), token)
    datas = [d for _, d in it.sse_named(r)]
    check(r.status == 200 and r.header("x-ltg-served-model") == "GLM" and datas[-1] == "[DONE]",
          "%d %r %r" % (r.status, r.header("x-ltg-served-model"), datas[-2:]))
    ev = spend_event(g, r.header("x-ltg-request-id"))
    check([a["outcome"] for a in ev["attempt_log"]][-1] == "ok" and len(ev["attempt_log"]) == 2, "attempts %r" % ev["attempt_log"])
    # the fallback passed through: nothing of the translated attempt before it (its stream, what it dropped)
    script("claude-up", ["status=529"])
    r = post("/v1/chat/completions", chat("Claude", seed=7), token)
    check(r.status == 200 and r.header("x-ltg-served-model") == "GLM" and r.header("x-ltg-dropped") is None
          and last_sent()[1].get("seed") == 7, "%d %r %r" % (r.status, r.header("x-ltg-dropped"), r.body[:200]))
    script("claude-up", ["status=529"])
    r = post("/v1/chat/completions", chat("Claude", seed=7, stream=True), token)
    datas = [d for _, d in it.sse_named(r)]
    check(r.status == 200 and r.header("x-ltg-dropped") is None and datas[-1] == "[DONE]", "%d %r" % (r.status, datas[-2:]))


@it.test("translate: keep-alives are passed on -- chat's ': keep-alive' comments reach a Messages client as "
         "event: ping, Anthropic's pings reach a chat client as a comment")
def t_stream_pings():
    g, token = group_key(["Claude", "GLM"])
    script("glm-up", ["keepalive"])
    r = post("/v1/messages", messages_body("GLM", stream=True), token)
    names = [n for n, _ in it.sse_named(r)]
    check(r.status == 200 and names.count("ping") >= 3, "events %r" % names)
    script("claude-up", ["keepalive"])
    r = post("/v1/chat/completions", chat("Claude", stream=True), token)
    raw = [t for _, t in it.sse_events(r)]
    check(r.status == 200 and sum(1 for t in raw if t.startswith(":")) >= 2, "events %r" % raw)


def one_try(allowed):
    a = ltg()
    body = it.group_body(allowed_models=allowed, retries={"max_attempts": 1})
    g = it.create_group(body, port=a.admin_port)
    return g, it.create_key(g["id"], port=a.admin_port)[1]


# upstream status (mock directive) -> (a Messages client's status, type), (a chat client's status, type). A
# terminal answer (400, 401, 403, 413) is the provider's, translated; the others are ltg's own after the
# last attempt (README "Retries and fallback"), in the client's shape.
ERRORS = [
    ("status=400", (400, "invalid_request_error"), (400, "invalid_request_error")),
    ("status=401", (401, "authentication_error"), (401, "authentication_error")),
    ("status=403", (403, "permission_error"), (403, "permission_error")),
    ("status=404", (404, "not_found_error"), (404, "upstream_error")),
    ("status=413", (413, "request_too_large"), (413, "invalid_request_error")),
    ("status=429", (429, "rate_limit_error"), (429, "upstream_error")),
    ("status=500", (500, "api_error"), (500, "upstream_error")),
    ("status=504", (504, "timeout_error"), (504, "timeout_error")),
]


@it.test("translate: errors classified on the provider's status, answered in the client's shape with the "
         "provider's message: 400/401/403/404/413, 429 with Retry-After, 500, 504; 529 <-> 503 and quota "
         "errors (402 billing_error, 429 insufficient_quota) both ways")
def t_errors():
    _, token = one_try(["Claude-err", "GLM-err"])
    for directive, (ms, mt), (cs, ct) in ERRORS:
        script("glm-err", [directive])
        r = post("/v1/messages", messages_body("GLM-err"), token)
        e = jbody(r)
        check(r.status == ms and e.get("type") == "error" and e["error"]["type"] == mt and e["error"]["message"],
              "%s from a chat provider to a Messages client: %d %r" % (directive, r.status, e))
        check(ms != 429 or r.header("retry-after"), "429 without Retry-After: %r" % r.headers)
        script("claude-err", [directive])
        r = post("/v1/chat/completions", chat("Claude-err"), token)
        e = jbody(r)["error"]
        check(r.status == cs and e["type"] == ct and e["message"],
              "%s from Anthropic to a chat client: %d %r" % (directive, r.status, e))
        check(cs != 429 or r.header("retry-after"), "429 without Retry-After: %r" % r.headers)
    script("glm-err", ["status=503"])
    r = post("/v1/messages", messages_body("GLM-err"), token)
    check(r.status == 529 and jbody(r)["error"]["type"] == "overloaded_error", "503 -> %d %r" % (r.status, r.body[:200]))
    script("claude-err", ["status=529"])
    r = post("/v1/chat/completions", chat("Claude-err"), token)
    check(r.status == 503 and jbody(r)["error"]["type"] == "upstream_error" and r.header("retry-after"),
          "529 -> %d %r" % (r.status, r.body[:200]))
    # quota: OpenAI's 429 insufficient_quota and Anthropic's 402 billing_error are not made retryable
    script("glm-err", ["status=429 quota"])
    r = post("/v1/messages", messages_body("GLM-err"), token)
    check(r.status == 402 and jbody(r)["error"]["type"] == "billing_error" and not r.header("retry-after"),
          "quota -> %d %r" % (r.status, r.body[:200]))
    script("claude-err", ["status=402"])
    r = post("/v1/chat/completions", chat("Claude-err"), token)
    e = jbody(r)["error"]
    check(r.status == 429 and e["type"] == "insufficient_quota" and e["code"] == "insufficient_quota"
          and not r.header("retry-after"), "billing_error -> %d %r %r" % (r.status, e, r.headers))


@it.test("translate: money stays exact -- a translated call costs what a direct one costs, to the micro-USD: chat "
         "client on Claude with cache reads and 5-minute and 1-hour writes against Claude directly; Messages "
         "client on GLM with cached and reasoning tokens against GLM directly")
def t_cost_exact():
    g, token = group_key(["Claude", "GLM"])
    usage = "input_tokens=1200 cached_tokens=300 cache_write=500 cache_write_1h=200 output_tokens=77"
    evs, r = scripted_events(g, token, "claude-up", usage,
                                (("/v1/messages", messages_body("Claude")), ("/v1/chat/completions", chat("Claude"))))
    keys = ("input_tokens", "cache_read_tokens", "cache_write_tokens", "cache_write_1h_tokens", "output_tokens", "cost")
    check([{k: e[k] for k in keys} for e in evs][0] == [{k: e[k] for k in keys} for e in evs][1]
          and evs[0]["cache_write_1h_tokens"] == 200 and evs[0]["cost"] > 0, "direct %r, translated %r"
          % tuple({k: e[k] for k in keys} for e in evs))
    usage = "input_tokens=1200 cached_tokens=300 reasoning_tokens=20 output_tokens=77"
    evs, r = scripted_events(g, token, "glm-up", usage,
                                (("/v1/chat/completions", chat("GLM")), ("/v1/messages", messages_body("GLM"))))
    keys = ("input_tokens", "cache_read_tokens", "reasoning_tokens", "output_tokens", "cost")
    check({k: evs[0][k] for k in keys} == {k: evs[1][k] for k in keys} and evs[0]["reasoning_tokens"] == 20,
          "direct %r, translated %r" % tuple({k: e[k] for k in keys} for e in evs))


if __name__ == "__main__":   # this file alone: python3 tests/integration_translate.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
