"""Integration tests of the mock itself: the directives and refusals that the translation tests
(Anthropic Messages <-> OpenAI chat) lean on, asked of tests/mock directly, without ltg, and
checked against its top comment: tool_call and tools=N on chat and messages, whole and streamed
(the calls reassembled from their pieces), text_first, finish=, reasoning=, bytewise, keepalive,
stream_error=, the request refusals "as the real APIs do", and GET /_mock/last's body.

Runs alone: python3 tests/integration_mock.py --ltg ./ltg --mock tests/mock
"""

import base64
import json
import time

import integration as it

check = it.check

ANTH = {"x-api-key": "mock-test", "anthropic-version": "2023-06-01"}
BASH_ARGS = '{"command":"echo mock-tool-$((6*7))"}'
USER = [{"role": "user", "content": "hi"}]


def post(path, body, headers=None):
    return it.one_request(it.H.mock_port, "POST", path, body, headers, auth=None)


def chat(directive, stream=False, **extra):
    body = {"model": "mock-chat", "messages": USER, "mock": directive}
    if stream:
        body["stream"] = True
    body.update(extra)
    return post("/v1/chat/completions", body)


def msgs(directive, stream=False, **extra):
    body = {"model": "mock-anth", "max_tokens": 64, "messages": USER, "mock": directive}
    if stream:
        body["stream"] = True
    body.update(extra)
    return post("/v1/messages", body, ANTH)


def ok(r, what):
    check(r.status == 200, "%s: %s" % (what, r.brief()))
    return r


def events(r):
    """A stream's events: [(name or None, data: parsed JSON, or "[DONE]", or the comment)]."""
    out = []
    for _, text in it.sse_events(r):
        name, data = None, None
        for line in text.split("\n"):
            if line.startswith(":"):
                data = line
            elif line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
        out.append((name, data))
    return out


def tools_args(i):
    return '{"i":%d,"city":"Paris %d"}' % (i, i)


def chat_assemble(evs, what):
    """An OpenAI chat stream put together: content, reasoning, calls {index: [id, name, args]},
    finish_reason, how many chunks carried two calls' pieces; checks each call opens (id, type,
    name, arguments "") before its pieces, which name neither id nor name."""
    got = {"content": "", "reasoning": "", "calls": {}, "finish": None, "two": 0}
    for _, d in evs:
        if not isinstance(d, dict):
            continue
        for ch in d["choices"]:
            delta = ch["delta"]
            got["content"] += delta.get("content") or ""
            got["reasoning"] += delta.get("reasoning_content") or ""
            tcs = delta.get("tool_calls") or []
            got["two"] += len(tcs) > 1
            for tc in tcs:
                if "id" in tc:
                    check(tc["index"] not in got["calls"] and tc["type"] == "function"
                          and tc["function"]["arguments"] == "", "%s: a call's opening chunk %r" % (what, tc))
                    got["calls"][tc["index"]] = [tc["id"], tc["function"]["name"], ""]
                else:
                    check(tc["index"] in got["calls"] and set(tc) == {"index", "function"}
                          and set(tc["function"]) == {"arguments"}, "%s: a piece before its call opened, or with more: %r" % (what, tc))
                    got["calls"][tc["index"]][2] += tc["function"]["arguments"]
            if ch.get("finish_reason"):
                got["finish"] = ch["finish_reason"]
    return got


def anth_assemble(evs, what):
    """An Anthropic stream put together: its blocks in order ({type, text/thinking/signature or
    id, name, input}), the stop_reason; checks the events' order (start, deltas, stop per block,
    indexes 0, 1, ...)."""
    blocks, open_, stop = [], None, None
    names = [n for n, _ in evs]
    check(names[0] == "message_start" and names[-1] == "message_stop", "%s: events %r" % (what, names))
    for name, d in evs:
        if name == "content_block_start":
            check(open_ is None and d["index"] == len(blocks), "%s: a block starts at %r" % (what, d))
            b = dict(d["content_block"])
            check(b.get("input", {}) == {}, "%s: tool_use starts with input {}: %r" % (what, b))
            b["partial"] = ""
            blocks.append(b)
            open_ = d["index"]
        elif name == "content_block_delta":
            check(d["index"] == open_, "%s: a delta of block %r while %r is open" % (what, d["index"], open_))
            x, b = d["delta"], blocks[open_]
            if x["type"] == "text_delta":
                b["text"] += x["text"]
            elif x["type"] == "thinking_delta":
                b["thinking"] += x["thinking"]
            elif x["type"] == "signature_delta":
                b["signature"] += x["signature"]
            elif x["type"] == "input_json_delta":
                b["partial"] += x["partial_json"]
        elif name == "content_block_stop":
            check(d["index"] == open_, "%s: stop of %r while %r is open" % (what, d["index"], open_))
            open_ = None
        elif name == "message_delta":
            stop = d["delta"]["stop_reason"]
    check(open_ is None, "%s: a block is left open" % what)
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b["partial"])
        del b["partial"]
    return blocks, stop


@it.test("mock: tool_call on chat: the whole answer's tool_calls (Bash, the same JSON as the Anthropic input), "
         "finish tool_calls; the stream opens the call with role and id, its arguments in pieces, then the finish and usage")
def t_mock_chat_tool_call():
    j = ok(chat("tool_call"), "whole").json()
    m = j["choices"][0]["message"]
    check(m["role"] == "assistant" and m["content"] is None and j["choices"][0]["finish_reason"] == "tool_calls",
          "the message %r" % j["choices"][0])
    tc = m["tool_calls"]
    check(len(tc) == 1 and tc[0]["id"] == "call_mock_%s" % j["id"].rsplit("-", 1)[1] and tc[0]["type"] == "function"
          and tc[0]["function"] == {"name": "Bash", "arguments": BASH_ARGS}, "the call %r" % tc)
    a = ok(msgs("tool_call"), "messages").json()
    check(json.loads(tc[0]["function"]["arguments"]) == a["content"][0]["input"], "chat's arguments, Messages' input")
    evs = events(ok(chat("tool_call", True, stream_options={"include_usage": True}), "stream"))
    first = evs[0][1]["choices"][0]["delta"]
    check(first.get("role") == "assistant" and first.get("content", 1) is None and first["tool_calls"][0]["id"].startswith("call_mock_"),
          "the first chunk %r" % first)
    got = chat_assemble(evs, "stream")
    pieces = sum(1 for _, d in evs if isinstance(d, dict) and d["choices"] and "id" not in (d["choices"][0]["delta"].get("tool_calls") or [{"id": 0}])[0])
    check(list(got["calls"].values()) == [[first["tool_calls"][0]["id"], "Bash", BASH_ARGS]] and pieces >= 3,
          "the call put together %r, %d pieces" % (got["calls"], pieces))
    check(got["finish"] == "tool_calls" and evs[-1][1] == "[DONE]" and evs[-2][1]["choices"] == []
          and evs[-2][1]["usage"]["completion_tokens"] == 1, "the end of the stream %r" % evs[-3:])
    fin = evs[-3][1]["choices"][0]
    check(fin["delta"] == {} and fin["finish_reason"] == "tool_calls", "the finish chunk %r" % fin)


@it.test("mock: tools=N (1..8) on chat and messages, whole and streamed, with and without text_first: N calls tool_<i> "
         "with {\"i\":i,\"city\":\"Paris i\"}; chat's pieces interleaved, two calls' in one chunk; Anthropic one block each")
def t_mock_tools():
    for n in range(1, 9):
        for tf in (False, True):
            d = "tools=%d%s" % (n, " text_first" if tf else "")
            want = [("tool_%d" % i, tools_args(i)) for i in range(n)]
            m = ok(chat(d), d).json()["choices"][0]
            check([(c["function"]["name"], c["function"]["arguments"]) for c in m["message"]["tool_calls"]] == want
                  and m["message"]["content"] == ("Let me check." if tf else None) and m["finish_reason"] == "tool_calls",
                  "%s: chat %r" % (d, m))
            evs = events(ok(chat(d, True), d + " stream"))
            got = chat_assemble(evs, d)
            check([tuple(got["calls"][i][1:]) for i in range(n)] == want and len(set(c[0] for c in got["calls"].values())) == n
                  and got["content"] == ("Let me check." if tf else "") and (n == 1 or got["two"] >= 1),
                  "%s: chat stream %r" % (d, got))
            if n > 1:                            # call 1's first piece comes before call 0's second
                order = [tc["index"] for _, e in evs if isinstance(e, dict) for tc in (e["choices"][0]["delta"].get("tool_calls") or [])
                         if "id" not in tc]
                check(order[:2] == [0, 1], "%s: the pieces' order %r" % (d, order))
            a = ok(msgs(d), d + " messages").json()
            blocks = [b for b in a["content"] if b["type"] == "tool_use"]
            check([(b["name"], b["input"]) for b in blocks] == [(x, json.loads(y)) for x, y in want] and a["stop_reason"] == "tool_use"
                  and (a["content"][0] == {"type": "text", "text": "Let me check."}) == tf, "%s: messages %r" % (d, a))
            blocks, stop = anth_assemble(events(ok(msgs(d, True), d + " messages stream")), d)
            check([(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"] == [(x, json.loads(y)) for x, y in want]
                  and stop == "tool_use" and (blocks[0] == {"type": "text", "text": "Let me check."}) == tf,
                  "%s: messages stream %r" % (d, blocks))
    evs = events(ok(msgs("tools=2", True), "pieces"))
    pieces = [e["delta"]["partial_json"] for n_, e in evs if n_ == "content_block_delta" and e["index"] == 0]
    check(pieces == ['{"i":0,"', 'city":"P', 'aris 0"}'], "the input's pieces %r" % pieces)


@it.test("mock: finish=REASON overrides chat's finish_reason and Anthropic's stop_reason, whole and streamed")
def t_mock_finish():
    j = ok(chat("tool_call finish=stop"), "chat").json()["choices"][0]
    check(j["finish_reason"] == "stop" and j["message"]["tool_calls"], "chat %r" % j)
    check(chat_assemble(events(chat("tool_call finish=stop", True)), "chat stream")["finish"] == "stop", "chat stream")
    check(ok(chat("finish=length"), "length").json()["choices"][0]["finish_reason"] == "length", "chat length")
    for reason in ("max_tokens", "refusal"):
        check(ok(msgs("finish=" + reason), reason).json()["stop_reason"] == reason, "messages " + reason)
        check(anth_assemble(events(msgs("finish=" + reason, True)), reason)[1] == reason, "messages stream " + reason)
    r = chat("finish=Stop")
    check(r.status == 400 and "bad mock directive" in r.json()["error"]["message"], "finish=Stop: %s" % r.brief())


@it.test("mock: reasoning=N: chat's reasoning_content (N deltas \"think \" before the content); messages' thinking "
         "block first (thinking deltas, a signature_delta), then the text")
def t_mock_reasoning():
    m = ok(chat("reasoning=3"), "chat").json()["choices"][0]["message"]
    check(m["reasoning_content"] == "think " * 3 and m["content"].startswith("Hello from"), "chat %r" % m)
    evs = events(chat("reasoning=3 events=2", True))
    kinds = [list(e["choices"][0]["delta"]) for _, e in evs if isinstance(e, dict) and e["choices"] and e["choices"][0]["delta"]]
    check(kinds == [["reasoning_content"]] * 3 + [["content"]] * 2, "chat stream's deltas %r" % kinds)
    check(chat_assemble(evs, "chat")["reasoning"] == "think " * 3, "chat stream's reasoning")
    a = ok(msgs("reasoning=2"), "messages").json()["content"]
    check(a[0]["type"] == "thinking" and a[0]["thinking"] == "think " * 2 and a[0]["signature"] and a[1]["type"] == "text",
          "messages %r" % a)
    evs = events(msgs("reasoning=2 events=1", True))
    start = [e for n, e in evs if n == "content_block_start"][0]["content_block"]
    check(start == {"type": "thinking", "thinking": "", "signature": ""}, "the thinking block's start %r" % start)
    blocks, stop = anth_assemble(evs, "messages stream")
    check(blocks[0]["type"] == "thinking" and blocks[0]["thinking"] == "think " * 2
          and base64.b64decode(blocks[0]["signature"]).startswith(b"mock thinking signature"), "thinking %r" % blocks)
    check(blocks[1] == {"type": "text", "text": "word "} and stop == "end_turn", "the text after it %r" % blocks)


def read_closed(path, body, hdr):
    """One request with Connection: close, read to the mock's close: (the reads it took, the bytes)."""
    with it.Conn(it.H.mock_port) as c:
        c.send(it.http_request("POST", path, body, dict(hdr, Connection="close"), auth=None))
        reads, data = 0, b""
        while True:
            d = c.sock.recv(65536)
            if not d:
                return reads, data
            reads += 1
            data += d


@it.test("mock: bytewise: a stream and a whole answer come one byte per write (the reader gets many small reads), "
         "a stream of a few KiB in well under 2 s")
def t_mock_bytewise():
    for path, body, hdr in (("/v1/chat/completions", {"model": "bw", "messages": USER, "mock": "bytewise events=20 tools=3", "stream": True}, {}),
                            ("/v1/messages", {"model": "bw", "max_tokens": 9, "messages": USER, "mock": "bytewise tools=2", "stream": True}, ANTH),
                            ("/v1/chat/completions", {"model": "bw", "messages": USER, "mock": "bytewise"}, {})):
        t0 = time.monotonic()
        reads, data = read_closed(path, body, hdr)
        dt = time.monotonic() - t0
        check(dt < 2.0 * it.SLOW and reads > len(data) // 4 and data.endswith(b"0\r\n\r\n" if body.get("stream") else b"}"),
              "%s: %d bytes in %d reads, %.2f s" % (path, len(data), reads, dt))


@it.test("mock: keepalive: chat streams have ': keep-alive' comments before each content chunk and the finish; "
         "Anthropic streams a ping between deltas")
def t_mock_keepalive():
    evs = events(chat("keepalive events=2", True))
    shape = ["ka" if d == ": keep-alive" else "done" if d == "[DONE]" else "finish" if d["choices"][0]["finish_reason"] else "delta"
             for _, d in evs]
    check(shape == ["ka", "delta", "ka", "delta", "ka", "finish", "done"], "chat %r" % shape)
    names = [n for n, _ in events(msgs("keepalive events=3", True))]
    check(names == ["message_start", "content_block_start", "ping", "content_block_delta", "ping", "content_block_delta", "ping",
                    "content_block_delta", "content_block_stop", "message_delta", "message_stop"], "messages %r" % names)


@it.test("mock: stream_error=TYPE: Anthropic's event: error after message_start (or after cut_after=N deltas), chat's "
         "data: {\"error\"}; the body then ends cleanly and the connection serves the next request")
def t_mock_stream_error():
    evs = events(ok(msgs("stream_error=overloaded_error", True), "messages"))
    check([n for n, _ in evs] == ["message_start", "error"]
          and evs[1][1] == {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, "messages %r" % evs)
    evs = events(msgs("stream_error=api_error cut_after=2", True))
    names = [n for n, _ in evs]
    check(names[-1] == "error" and names.count("content_block_delta") == 2 and evs[-1][1]["error"]["type"] == "api_error",
          "messages after 2 deltas %r" % names)
    evs = events(chat("stream_error=server_error", True))
    check(len(evs) == 1 and evs[0][1]["error"]["type"] == "server_error" and evs[0][1]["error"]["code"] is None, "chat %r" % evs)
    evs = events(chat("stream_error=server_error cut_after=1", True))
    check(len(evs) == 2 and evs[0][1]["choices"][0]["delta"] == {"content": "word "} and "error" in evs[1][1], "chat after 1 %r" % evs)
    with it.Conn(it.H.mock_port) as c:           # a clean end: the same connection goes on
        for d in ("stream_error=overloaded_error", "ok"):
            c.send(it.http_request("POST", "/v1/messages", {"model": "se", "max_tokens": 5, "messages": USER, "mock": d, "stream": True},
                                   ANTH, auth=None))
            r = c.read_final_response()
            check(r.status == 200 and r.chunked, "%s on a kept connection: %s" % (d, r.brief()))


def refused(path, body, headers, want, what):
    r = post(path, body, headers)
    anth = "/messages" in path
    msg = (r.json()["error"]["message"] if r.status == 400 else "")
    check(r.status == 400 and want in msg and r.json()["error"]["type"] == "invalid_request_error"
          and (r.json().get("type") == "error") == anth, "%s: want 400 %r, got %s" % (what, want, r.brief()))
    return r.json()


def tool_use(id_, inp=None):
    return {"type": "tool_use", "id": id_, "name": "f", "input": {} if inp is None else inp}


def tool_result(id_):
    return {"type": "tool_result", "tool_use_id": id_, "content": "ok"}


@it.test("mock: what /v1/messages refuses, as Anthropic does: max_tokens, roles, blank text, temperature, tool_use input "
         "and ids, tool_use without tool_result right after, a stray tool_result, system, stop_sequences; and what it takes")
def t_mock_refuse_messages():
    before = it.H.mock_stats()["refused"]

    def body(messages=None, **kw):
        b = {"model": "rf", "max_tokens": 16, "messages": USER if messages is None else messages}
        b.update(kw)
        return b
    asst = lambda *blocks: {"role": "assistant", "content": list(blocks)}
    user = lambda *blocks: {"role": "user", "content": list(blocks)}
    text = lambda t: {"type": "text", "text": t}
    cases = [
        ({"model": "rf", "messages": USER}, "max_tokens: Field required"),
        (body(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
        (body(max_tokens="5"), "max_tokens: Input should be a valid integer"),
        (body(max_tokens=1.5), "max_tokens: Input should be a valid integer"),
        (body([{"role": "system", "content": "x"}]), "messages.0.role: Input should be 'user' or 'assistant'"),
        (body([{"role": "tool", "content": "x"}]), "messages.0.role"),
        (body([user(text(""))]), "messages: text content blocks must contain non-whitespace text"),
        (body([user(text(" \n\t"))]), "messages: text content blocks must contain non-whitespace text"),
        (body([{"role": "user", "content": "\u0020\n"}]), "non-whitespace text"),
        (body(temperature=1.5), "temperature: Input should be less than or equal to 1"),
        (body([user(text("hi")), asst(tool_use("toolu_1", "{}"))]), "messages.1.content.0.tool_use.input: Input should be an object"),
        (body([user(text("hi")), asst(tool_use("toolu_1"), tool_use("toolu_2")), user(tool_result("toolu_1"))]),
         "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_2."),
        (body([user(text("hi")), asst(tool_use("toolu_1")), user(text("first"), tool_result("toolu_1"))]),
         "`tool_use` ids were found without `tool_result` blocks immediately after: toolu_1"),
        (body([user(text("hi")), asst(tool_use("toolu_1")), asst(text("x"))]), "immediately after: toolu_1"),
        (body([user(text("hi")), asst(tool_use("toolu_1"))]), "messages.1: `tool_use` ids were found"),
        (body([user(text("hi")), asst(tool_use("toolu_1")), user(tool_result("toolu_9"))]),
         "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_9"),
        (body([user(tool_result("toolu_1"))]), "messages.0.content.0: unexpected `tool_use_id`"),
        (body([user(text("hi")), asst(tool_use("call.1"))]), "tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'"),
        (body(system={"text": "x"}), "system: Input should be a valid string or a list of text blocks"),
        (body(system=[{"type": "image"}]), "system:"),
        (body(stop_sequences=["end", " \n"]), "stop_sequences: each stop sequence must contain non-whitespace"),
        ({"model": "rf", "max_tokens": 5}, "messages: Field required"),
        (body([]), "messages: at least one message is required"),
        (body([{"role": "user", "content": ""}]), "messages.0: all messages must have non-empty content"),
    ]
    for b, want in cases:
        refused("/v1/messages", b, ANTH, want, json.dumps(b)[:160])
    refused("/v1/messages/count_tokens", {"model": "rf", "messages": [{"role": "assistant", "content": [tool_use("toolu_1")]}]},
            ANTH, "`tool_use` ids were found", "count_tokens")
    after = it.H.mock_stats()
    check(after["refused"] == before + len(cases) + 1 and after["log"][-1].get("refused", "").startswith("messages.0"),
          "the stats count the refusals: %r, the log says why: %r" % (after["refused"], after["log"][-1]))
    good = [
        body(system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}], temperature=1, stop_sequences=["x"],
             messages=[user(text("hi")),
                       asst({"type": "thinking", "thinking": "t", "signature": "s"}, text("calling"), tool_use("toolu_01A-b"),
                            tool_use("toolu_2", {"a": [1]})),
                       user(tool_result("toolu_2"), {"type": "tool_result", "tool_use_id": "toolu_01A-b", "content": [text("r")]}, text("more")),
                       {"role": "assistant", "content": ""}]),
        body(system="a string", temperature=0, messages=[user(text("hi")), asst(text("x")), user(text("y"))]),
        body([{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}]),
        {"model": "rf", "max_tokens": 5, "messages": USER, "system": None, "temperature": None},
    ]
    for b in good:
        check(post("/v1/messages", b, ANTH).status == 200, "a good body is refused: %r" % b)
    beta = dict(ANTH, **{"anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07"})
    check(post("/v1/messages", body([user(text("hi")), {"role": "system", "content": "ctx"}]), beta).status == 200,
          "a system message with the mid-conversation-system beta (as Claude Code sends it)")
    check(post("/v1/messages/count_tokens", {"model": "rf", "messages": USER}, ANTH).status == 200, "count_tokens needs no max_tokens")


@it.test("mock: what /v1/chat/completions refuses, as OpenAI does: tool messages that answer no tool call, tool calls "
         "left unanswered, bad function names, more than 4 stop sequences, no messages; and what it takes")
def t_mock_refuse_chat():
    def body(messages=None, **kw):
        b = {"model": "rf", "messages": USER if messages is None else messages}
        b.update(kw)
        return b
    call = lambda id_: {"id": id_, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    asst = lambda *ids: {"role": "assistant", "content": None, "tool_calls": [call(i) for i in ids]}
    tool = lambda id_: {"role": "tool", "tool_call_id": id_, "content": "r"}
    fn = lambda name: [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
    unanswered = "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'."
    cases = [
        (body(USER + [tool("c1")]), "messages with role 'tool' must be a response to a preceeding message with 'tool_calls'",
         "messages.[1].role"),
        (body(USER + [asst("c1"), tool("c9")]), "'tool_call_id' of 'c9' not found in 'tool_calls' of previous message",
         "messages.[2].tool_call_id"),
        (body(USER + [asst("c1", "c2"), tool("c1"), {"role": "user", "content": "x"}]), unanswered + " The following "
         "tool_call_ids did not have response messages: c2", "messages.[1].role"),
        (body(USER + [asst("c1")]), unanswered, "messages.[1].role"),
        (body(USER + [asst("c1"), tool("c1"), {"role": "assistant", "content": "x"}, tool("c1")]), "must be a response", None),
        (body(tools=fn("a" * 65)), "string too long. Expected a string with maximum length 64, but got a string with length 65",
         "tools[0].function.name"),
        (body(tools=fn("get weather")), "string does not match pattern", "tools[0].function.name"),
        (body(stop=["a", "b", "c", "d", "e"]), "Invalid 'stop': array too long", "stop"),
        ({"model": "rf"}, "Missing required parameter: 'messages'.", "messages"),
        (body([]), "Invalid 'messages': empty array.", "messages"),
    ]
    for b, want, param in cases:
        e = refused("/v1/chat/completions", b, None, want, json.dumps(b)[:160])["error"]
        check(param is None or e["param"] == param, "%s: param %r, want %r" % (want, e["param"], param))
    good = [body([{"role": "system", "content": "s"}] + USER + [asst("c1", "c2"), tool("c2"), tool("c1"), {"role": "user", "content": "x"},
                 asst("c3"), tool("c3")], stop=["a", "b", "c", "d"], tools=fn("a" * 64) + fn("get_weather-2")),
            body(stop="one"), body(USER + [{"role": "assistant", "content": "x", "tool_calls": []}, {"role": "user", "content": "y"}])]
    for b in good:
        check(post("/v1/chat/completions", b).status == 200, "a good body is refused: %r" % b)


@it.test("mock: GET /_mock/last gives the body as received: a JSON string of the same text (chunked bodies decoded), "
         "and body_base64 its exact bytes, invalid UTF-8 included")
def t_mock_last_body():
    bodies = [json.dumps({"model": "lb", "messages": [{"role": "user", "content": "h\u00e9 \u2028 \U0001F600 \x00\x1f \"q\" \\ /\t"}]},
                         ensure_ascii=False).encode(),
              b'{"model":"lb","messages":[{"role":"user","content":"bad \xff\xed\xa0\x80\xc0\xaf"}]}']
    for b in bodies:
        for chunked in (False, True):
            hdr = {"Transfer-Encoding": "chunked"} if chunked else {}
            data = it.chunked(b, [7, 1, 300]) if chunked else b
            with it.Conn(it.H.mock_port) as c:
                c.send(it.http_request("POST", "/v1/chat/completions", data, hdr, auth=None))
                ok(c.read_final_response(), "the request")
            last = it.H.mock_last()
            check(base64.b64decode(last["body_base64"]) == b, "body_base64 (chunked %s)" % chunked)
            valid = b is bodies[0]
            check((last["body"].encode("utf-8") == b) == valid, "body as a string (chunked %s): %r" % (chunked, last["body"][:80]))


def answer(model, body, status=200, content_type=None):
    a = {"model": model, "status": status, "body": body}
    if content_type:
        a["content_type"] = content_type
    return json.loads(it.H.mock_post("/_mock/answer", a))


@it.test("mock: POST /_mock/answer queues exact answers per model (status, Content-Type, the body's bytes, \\u escapes "
         "as UTF-8), first in first out, whatever the request asked; framing=chunked sends a chunk per SSE event, "
         "bytewise a byte per write; a refused request uses one up; at most 8 queued, bad bodies refused")
def t_mock_answer():
    sse = 'event: message_start\ndata: {"a":"h\u00e9 \U0001F600"}\n\nevent:message_stop\ndata:{}\n\n'
    check(answer("ans", sse, content_type="text/event-stream") == {"model": "ans", "queued": 1}, "the first answer")
    check(answer("ans", "Service Unavailable", 503, "text/plain")["queued"] == 2, "the second answer")
    it.H.mock_post("/_mock/script", {"model": "ans", "steps": ["framing=chunked", "status=500"]})
    r = msgs("", model="ans")
    check(r.status == 200 and r.header("content-type") == "text/event-stream" and r.body == sse.encode(),
          "the stream, to a request that did not ask for one: %s %r" % (r.brief(), r.header("content-type")))
    check([d for _, d in r.chunks] == [sse[:sse.index("\n\n") + 2].encode(), sse[sse.index("\n\n") + 2:].encode()],
          "a chunk per event: %r" % [d for _, d in r.chunks])
    r = chat("", model="ans")
    check(r.status == 503 and r.header("content-type") == "text/plain" and r.body == b"Service Unavailable"
          and r.header("content-length") == "19", "the 503, framed by length (status=500 ignored): %s" % r.brief())
    check(b"Hello from ans." in ok(chat("", model="ans"), "after the queue").body, "the queue is empty: a canned answer again")
    answer("ans", "x" * 3000, content_type="text/event-stream")
    reads, data = read_closed("/v1/chat/completions", {"model": "ans", "messages": USER, "mock": "bytewise framing=eof"}, {})
    check(data.endswith(b"\r\n\r\n" + b"x" * 3000) and b"content-length" not in data.lower() and reads > len(data) // 4,
          "bytewise framing=eof: %d bytes in %d reads, %r" % (len(data), reads, data[:120]))
    answer("ans", '{"ok":1}')
    r = msgs("", model="ans", max_tokens=0)
    check(r.status == 400 and b"max_tokens" in r.body, "the refusal: %s" % r.brief())
    check(b"Hello from ans." in ok(chat("", model="ans"), "after the refusal").body, "the refused request took the answer")
    for i in range(8):
        answer("full", "%d" % i)
    for bad in ({"model": "full", "body": "9"}, {"model": "ans2", "body": 5}, {"model": "ans2"}, {"body": "x"},
                {"model": "ans2", "body": "x", "status": 199}, {"model": "ans2", "body": "x", "status": 600},
                {"model": "ans2", "body": "x", "content_type": ""}, {"model": "ans2", "body": "x" * ((1 << 20) + 1)}):
        r = post("/_mock/answer", bad)
        check(r.status == 400, "%r: %s" % ({k: v if k != "body" or len(str(v)) < 20 else "..." for k, v in bad.items()}, r.brief()))
    got = [chat("", model="full").body for _ in range(9)]
    check(got[:8] == [b"%d" % i for i in range(8)] and b"Hello from full." in got[8], "the queue in order: %r" % got)
    answer("ans", "late")
    it.H.mock_reset()
    check(b"Hello from ans." in chat("", model="ans").body, "POST /_mock/reset empties the queues")
