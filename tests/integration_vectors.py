"""Integration tests: the peers' translation test vectors (tests/vectors/translation, copied from
agentgateway, Envoy AI Gateway and LiteLLM; LICENSES.md there names each file's source) run
against the real ltg and the mock. Directions "chat->messages" (an OpenAI chat client, an
Anthropic Messages provider) and "messages->chat" (the reverse); Responses is not translated yet.

- kind "request": the vector's input goes to ltg on the client's path (its model replaced by an
  alias on the other API's provider); what the mock received (GET /_mock/last) is compared with
  the expected provider request.
- kind "response" / "stream": the vector's input is queued as the mock's exact answer (POST
  /_mock/answer: its status, Content-Type, bytes; a stream's events joined by blank lines); a
  minimal client request goes to ltg; ltg's answer is compared with the expected client answer.
  Streams run twice: as they are (a chunk per event) and bytewise (a byte per write).

How a vector is compared (structurally, parsed JSON):
- "compare": only these keys of the *summary* (below) are compared; "skip_fields": dotted paths
  not compared (the reason is printed); "skip": the case is not run, counted and its reason
  printed; "expected_status": an error -- the status, and the message (see errors()).
- A summary is what a client or provider makes of a body or a stream: text (joined), reasoning,
  stop (finish_reason / stop_reason), tool_calls [{name, args (parsed)}], usage (only the counts
  the vector names; chat's cached_tokens is prompt_tokens_details.cached_tokens, absent = 0; an
  Anthropic stream's usage is message_start's overwritten by message_delta's, as the SDKs do),
  terminated ([DONE] / message_stop). A request's summary is its top-level fields plus
  "parallel" (chat's parallel_tool_calls; Messages' not tool_choice.disable_parallel_tool_use).
- A whole expected stream (no "compare") is compared as its full summary and, for Anthropic
  streams, the sequence of its events (runs of content_block_delta as one, pings left out): the
  chunking of deltas is not part of the contract (API.md 14: each provider event translated as it
  arrives).
- Requests are compared exactly (an extra field changes what the provider sees); answers as the
  expected being contained in ltg's (a client reads the fields it knows; ltg may add some), lists
  item by item.

Normalisations (NORMALISE below), each a value ltg must legitimately differ in, nothing else:
- "model" of a request: the peer's client model name is the catalog's upstream model for our alias.
- "max_tokens" of a Messages request whose chat client gave none: the peer's default (4096, 0)
  becomes the catalog's max_output_tokens (API.md 14, "Defaults the target needs").
- chat requests: max_completion_tokens and max_tokens are one field (note 1a: which one is a
  provider option); "stream": false is an absent stream.
- content: a string s and [{"type":"text","text":s}] are the same (both APIs define them so), in
  chat and Messages messages and in Messages' system; in a chat request, a list of text parts only
  and their texts joined by newlines are the same (ltg sends a Messages turn's text blocks as one
  string, which every chat server takes; README "One API for every model").
- chat tool call arguments (a JSON string) are compared parsed; a tool message's content by
  containment (the vectors' notes: an "Error: " prefix for is_error is allowed, note 1a).
- answers: "[id]" is any non-empty id, "[date]" any integer; "model" may be the alias the client
  asked for or the provider's model.

Runs alone: python3 tests/integration_vectors.py --ltg ./ltg --mock tests/mock
"""

import glob
import json
import os

import integration as it

check = it.check

VECTORS = os.path.join(it.HERE, "vectors", "translation")
DIRECTIONS = ("chat->messages", "messages->chat")
MAX_OUT = 7777          # the catalog's max_output_tokens: not the peers' 4096
POOL_A = it.ModelPool("VecA-%d", 80, provider="anth")      # Anthropic-API models, one per case
POOL_C = it.ModelPool("VecC-%d", 80)                       # chat models, one per case

# Local verdicts on vectors that lie outside API.md 14 (the contract rules where peers differ): id ->
# {"skip": reason}, {"skip_fields": {path: reason}}, {"refused": (pointer, reason)} (ltg refuses the
# request: 400 untranslatable_field at that pointer) or {"unskip": True} (the vector's own skip
# lifted). The copied JSON files are never edited.
USAGE = "API.md 14 (Usage and money): the client sees usage converted into its API's terms"
LOCAL = {
    "agentgateway.chat-messages.request.reasoning_max": {"skip_fields": {
        "thinking.budget_tokens": "peer's budget is its 4096 default max_tokens - 1; with our max_output_tokens (API.md 14 "
                                  "Defaults) the budget rule (>= 1024, < max_tokens, note 1b) holds at 4096"}},
    "agentgateway.messages-chat.request.gpt_adaptive_thinking_with_tools": {"skip_fields": {
        "reasoning_effort": "the vector's own note: 'reasoning_effort none for GPT (not compared)'; API.md 14 maps an effort, "
                            "and {type: adaptive} names none"}},
    "agentgateway.messages-chat.request.structured-output": {"skip_fields": {
        "response_format.json_schema.name": "Anthropic's output_config.format has no name: the chat name is minted, "
                                            "any name carries the schema (API.md 14 maps structured output)"}},
    "agentgateway.chat-messages.request.tool-call": {"skip": "the peer sends the two tool results as two user turns; "
                                                     "note 1b coalesces consecutive tool messages into one user turn, as "
                                                     "Anthropic requires every tool_result in the next message (the mock "
                                                     "refuses the peer's shape)"},
    "envoy.messages-chat.request.text_and_tool_use": {"skip": "the history ends in a tool_use with no tool_result, which "
                                                      "OpenAI chat refuses (the mock refuses it as OpenAI does); API.md 14 "
                                                      "does not say how ltg carries an unanswered call"},
    # a field ltg refuses where the peer drops it: the case holds ltg's refusal, its JSON Pointer
    "agentgateway.messages-chat.request.reasoning": {"refused": (
        "/output_format", "\"output_format\": \"markdown\" is not Anthropic's structured-output format "
        "(an object, type json_schema, with its schema): ltg refuses what it cannot carry (API.md 14 Fields), "
        "agentgateway drops it silently")},
    # the vector's own skip, lifted: Claude Code sends system turns (its mid-conversation-system beta),
    # and ltg carries them as chat system messages where they stand
    "agentgateway.messages-chat.request.system_message": {"unskip": True},
    "envoy.chat-messages.response.redacted_thinking": {"skip_fields": {
        "choices.0.message.reasoning_content": "envoy's own object form; note 2: redacted_thinking is dropped"}},
    "envoy.chat-messages.response.thinking": {"skip_fields": {
        "choices.0.message.reasoning_content": "envoy's own object form; note 2: thinking -> reasoning_content, a string"}},
}
for _id in ("agentgateway.chat-messages.response.basic", "agentgateway.chat-messages.response.multiple_text_blocks",
            "agentgateway.chat-messages.response.thinking", "agentgateway.chat-messages.response.tool"):
    LOCAL[_id] = {"skip_fields": {
        "service_tier": "agentgateway's vendor field: API.md 14 names no service_tier in a chat answer",
        "usage.total_tokens": "follows the peer's prompt_tokens (skipped by the vector): " + USAGE + ", prompt includes cache",
        "usage.prompt_tokens_details.cache_write_tokens": "agentgateway's vendor field, not in API.md 14 or note 2",
        "usage.cache_read_input_tokens": "agentgateway's vendor copy of cached_tokens, not in API.md 14 or note 2"}}
for _id in ("agentgateway.messages-chat.response.audio", "agentgateway.messages-chat.response.basic",
            "agentgateway.messages-chat.response.cache_write", "agentgateway.messages-chat.response.tool_call"):
    LOCAL[_id] = {"skip_fields": {"usage.service_tier": "the chat provider's service_tier is no Anthropic usage count; "
                                                        "API.md 14 does not carry it"}}
for _id in ("envoy.chat-messages.response.text", "envoy.chat-messages.response.tool_use"):
    LOCAL[_id] = {"skip_fields": {"usage.prompt_tokens_details.cache_creation_tokens": "envoy's vendor field; note 2 names "
                                                                                        "cache_creation_input_tokens"}}
LOCAL["agentgateway.chat-messages.stream.stream_message_delta_usage"] = {"skip_fields": {
    "usage.total_tokens": "follows the peer's prompt_tokens (skipped by the vector): " + USAGE}}

_ltg = {}


def ltg():
    """This file's ltg: the harness's catalog with an Anthropic provider (the same mock, speaking
    Anthropic's API) and a model per case on each provider; one key whose group allows them all,
    one attempt per request (an error vector is answered once)."""
    if "aux" not in _ltg:
        cfg = it.catalog_copy()
        cfg["providers"]["anth"] = dict(cfg["providers"]["mock"], api="anthropic")
        for pool in (POOL_A, POOL_C):
            pool.add_to(cfg)
            for i in range(1, pool.n + 1):
                cfg["models"][pool.alias % i]["max_output_tokens"] = MAX_OUT
        a = it.Aux("vectors", config=it.write_catalog(cfg, "vectors"))
        a.start()
        models = [p.alias % i for p in (POOL_A, POOL_C) for i in range(1, p.n + 1)]
        g = it.create_group(it.group_body(allowed_models=models, retries={"max_attempts": 1}), port=a.admin_port)
        _ltg.update(aux=a, token=it.create_key(g["id"], port=a.admin_port)[1])
    return _ltg["aux"]


def load(direction, kind):
    out = []
    for f in sorted(glob.glob(os.path.join(VECTORS, "*.json"))):
        with open(f) as fh:
            v = json.load(fh)
        if v["direction"] == direction and v["kind"] == kind:
            loc = LOCAL.get(v["id"], {})
            if "skip" in loc:
                v["skip"] = "(local) " + loc["skip"]
            if loc.get("unskip"):
                v.pop("skip", None)
            if "refused" in loc:
                v["expected_status"], v["refused"] = 400, loc["refused"]
            v["skip_fields"] = dict(v.get("skip_fields") or {}, **loc.get("skip_fields", {}))
            out.append(v)
    return out


def post(path, body, timeout=30.0):
    return it.one_request(ltg().port, "POST", path, body, auth=_ltg["token"], timeout=timeout)


# ----- summaries -----

def args_of(s):
    try:
        return json.loads(s) if s else {}
    except ValueError:
        return s


def text_of(content):
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content or [] if p.get("type") == "text")


def chat_usage(u):
    if not isinstance(u, dict):
        return None
    out = {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens") if k in u}
    out["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return out


def chat_summary(x):
    """x: a chat.completion, or a stream as [(name, data)]."""
    s = {"text": "", "reasoning": "", "stop": None, "tool_calls": [], "usage": None, "terminated": False}
    if isinstance(x, dict):
        ch = (x.get("choices") or [{}])[0]
        m = ch.get("message") or {}
        s.update(text=m.get("content") or "", reasoning=m.get("reasoning_content") or "", stop=ch.get("finish_reason"),
                 usage=chat_usage(x.get("usage")), terminated=True,
                 tool_calls=[{"name": t["function"]["name"], "args": args_of(t["function"].get("arguments"))}
                             for t in m.get("tool_calls") or []])
        return s
    calls = {}
    for _, d in x:
        if d == "[DONE]":
            s["terminated"] = True
            continue
        if d.get("usage"):
            s["usage"] = chat_usage(d["usage"])
        for ch in d.get("choices") or []:
            delta = ch.get("delta") or {}
            s["text"] += delta.get("content") or ""
            s["reasoning"] += delta.get("reasoning_content") or ""
            for t in delta.get("tool_calls") or []:
                c = calls.setdefault(t.get("index", 0), {"name": "", "args": ""})
                f = t.get("function") or {}
                c["name"] += f.get("name") or ""
                c["args"] += f.get("arguments") or ""
            if ch.get("finish_reason"):
                s["stop"] = ch["finish_reason"]
    s["tool_calls"] = [{"name": c["name"], "args": args_of(c["args"])} for _, c in sorted(calls.items())]
    return s


def anth_summary(x):
    """x: a Messages message, or a stream as [(name, data)]."""
    s = {"text": "", "reasoning": "", "stop": None, "tool_calls": [], "usage": None, "terminated": False}
    if isinstance(x, dict):
        for b in x.get("content") or []:
            if b.get("type") == "text":
                s["text"] += b.get("text") or ""
            elif b.get("type") == "thinking":
                s["reasoning"] += b.get("thinking") or ""
            elif b.get("type") == "tool_use":
                s["tool_calls"].append({"name": b.get("name"), "args": b.get("input")})
        s.update(stop=x.get("stop_reason"), usage=x.get("usage"), terminated=True)
        return s
    blocks, usage = {}, {}
    for name, d in x:
        if not isinstance(d, dict):
            continue
        t = d.get("type")
        if t == "message_start":
            usage.update((d.get("message") or {}).get("usage") or {})
        elif t == "content_block_start":
            blocks[d["index"]] = dict(d["content_block"], json="")
        elif t == "content_block_delta":
            b, delta = blocks.setdefault(d["index"], {"type": "?", "json": ""}), d["delta"]
            if delta.get("type") == "text_delta":
                b["text"] = (b.get("text") or "") + delta["text"]
            elif delta.get("type") == "thinking_delta":
                b["thinking"] = (b.get("thinking") or "") + delta["thinking"]
            elif delta.get("type") == "input_json_delta":
                b["json"] += delta["partial_json"]
        elif t == "message_delta":
            s["stop"] = (d.get("delta") or {}).get("stop_reason")
            usage.update(d.get("usage") or {})
        elif t == "message_stop":
            s["terminated"] = True
    for _, b in sorted(blocks.items()):
        if b["type"] == "text":
            s["text"] += b.get("text") or ""
        elif b["type"] == "thinking":
            s["reasoning"] += b.get("thinking") or ""
        elif b["type"] == "tool_use":
            s["tool_calls"].append({"name": b.get("name"), "args": args_of(b["json"]) if b["json"] else b.get("input")})
    s["usage"] = usage or None
    return s


def anth_grammar(evs):
    names = [n for n, _ in evs if n != "ping"]
    return [n for i, n in enumerate(names) if not (n == "content_block_delta" and i and names[i - 1] == n)]


def request_summary(body):
    s = dict(body)
    tc = body.get("tool_choice")
    s["parallel"] = body.get("parallel_tool_calls")
    if isinstance(tc, dict) and "disable_parallel_tool_use" in tc:
        s["parallel"] = not tc["disable_parallel_tool_use"]
    return s


# ----- normalisation and comparison -----

def norm_content(c, chat_api=False):
    if isinstance(c, list) and len(c) == 1 and isinstance(c[0], dict) and set(c[0]) == {"type", "text"} and c[0]["type"] == "text":
        return c[0]["text"]
    if chat_api and isinstance(c, list) and c and all(isinstance(x, dict) and set(x) == {"type", "text"}
                                                      and x["type"] == "text" for x in c):
        return "\n".join(x["text"] for x in c)
    return c


def norm_request(body, chat_api):
    """NORMALISE, for a request either side: the content forms, chat's max_tokens field and stream."""
    b = json.loads(json.dumps(body))
    if "system" in b:
        b["system"] = norm_content(b["system"])
    for m in b.get("messages") or []:
        if "content" in m:
            m["content"] = norm_content(m["content"], chat_api)
        for t in m.get("tool_calls") or []:
            t["function"]["arguments"] = args_of(t["function"].get("arguments"))
        if chat_api and m.get("content", 0) is None and m.get("tool_calls"):
            del m["content"]     # chat: an assistant's content null is an absent one
    if chat_api:
        if "max_completion_tokens" in b:
            b["max_tokens"] = b.pop("max_completion_tokens")
        if b.get("stream") is False:
            del b["stream"]
    return b


def drop(d, path):
    """Removes the dotted path (a number indexes a list) from d, in place, if there."""
    parts = path.split(".")
    for p in parts[:-1]:
        if isinstance(d, list) and p.isdigit():
            d = d[int(p)] if int(p) < len(d) else None
        else:
            d = d.get(p) if isinstance(d, dict) else None
        if d is None:
            return
    if isinstance(d, dict):
        d.pop(parts[-1], None)


def norm_answer(x):
    """NORMALISE, for a whole chat answer: tool call arguments parsed."""
    x = json.loads(json.dumps(x))
    for ch in x.get("choices") or [] if isinstance(x, dict) else []:
        for t in (ch.get("message") or {}).get("tool_calls") or []:
            t["function"]["arguments"] = args_of(t["function"].get("arguments"))
    return x


def diff(want, got, path, subset, alias, out):
    """Appends to out each difference between want and got as 'path: want W, got G'."""
    if want == "[id]" and path.endswith("id"):
        ok = isinstance(got, str) and got != ""
    elif path == "id" and subset and isinstance(want, str) and isinstance(got, str):
        ok = want in got     # an answer's id: ltg's prefix (chatcmpl-, msg_) + the provider's (note 2, ids)
    elif want == "[date]":
        ok = isinstance(got, int)
    elif path in ("model",) and alias and got == alias:
        ok = True
    elif isinstance(want, dict) and isinstance(got, dict):
        for k in want:
            if k == "content" and want.get("__tool__") and isinstance(got.get(k), str) and want[k] in got[k]:
                continue     # a tool message's content: by containment
            if k not in got:
                out.append("%s.%s: want %s, missing" % (path, k, json.dumps(want[k])[:200]))
            else:
                diff(want[k], got[k], (path + "." if path else "") + k, subset, alias, out)
        if not subset:
            out.extend("%s.%s: not wanted, got %s" % (path, k, json.dumps(got[k])[:200]) for k in got if k not in want)
        return
    elif isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (w, g) in enumerate(zip(want, got)):
            diff(w, g, "%s[%d]" % (path, i), subset, alias, out)
        return
    else:
        ok = want == got
    if not ok:
        out.append("%s: want %s, got %s" % (path or "(all)", json.dumps(want)[:300], json.dumps(got)[:300]))


def tag_tool_messages(b):
    for m in b.get("messages") or []:
        if m.get("role") == "tool" and isinstance(m.get("content"), str):
            m["__tool__"] = True
    return b


def compare(v, want, got, subset, alias=None):
    """The differences (a list of strings) between want and got, honouring skip_fields."""
    want, got = json.loads(json.dumps(want)), json.loads(json.dumps(got))
    for p in v["skip_fields"]:
        drop(want, p)
        drop(got, p)
    out = []
    diff(want, got, "", subset, alias, out)
    return out


# ----- running the cases -----

class Tally:
    def __init__(self, what):
        self.what, self.ran, self.failed, self.skipped = what, 0, [], []

    def skip(self, v):
        self.skipped.append("%s: %s" % (v["id"], v["skip"]))

    def fail(self, v, how, problems):
        self.failed.append("%s%s:\n      %s" % (v["id"], how, "\n      ".join(problems)))

    def end(self):
        print("  %s: %d run, %d failed, %d skipped" % (self.what, self.ran, len(self.failed), len(self.skipped)))
        for s in self.skipped:
            print("    skipped %s" % s)
        for sf in self.sfields:
            print("    not compared %s" % sf)
        for f in self.failed:
            print("    FAILED %s" % f)
        check(not self.failed, "%d of %d cases failed (above): %s" % (len(self.failed), self.ran,
                                                                    ", ".join(f.split(":")[0] for f in self.failed)))


def tally(what, vs):
    t = Tally(what)
    t.sfields = ["%s %s: %s" % (v["id"], p, r) for v in vs for p, r in v["skip_fields"].items()]
    return t


def upstream_of(alias):
    return it.ModelPool.upstream(alias)


def run_requests(direction):
    vs = load(direction, "request")
    t = tally("%s requests" % direction, vs)
    to_anth = direction == "chat->messages"
    for v in vs:
        if v.get("skip"):
            t.skip(v)
            continue
        t.ran += 1
        alias = (POOL_A if to_anth else POOL_C).take_one()
        body = dict(v["input"], model=alias)
        before = it.H.mock_stats()["calls"].get(upstream_of(alias), 0)
        r = post("/v1/chat/completions" if to_anth else "/v1/messages", body)
        calls = it.H.mock_stats()["calls"].get(upstream_of(alias), 0) - before
        if v.get("expected_status"):
            err = (r.json() if r.body[:1] == b"{" else {}).get("error") or {}
            problems = []
            if r.status != v["expected_status"]:
                problems.append("status: want %d, got %s" % (v["expected_status"], r.brief()))
            if err.get("code") != "untranslatable_field":
                problems.append("error.code: want untranslatable_field (API.md 14), got %r" % (err,))
            if v.get("refused") and err.get("param") != v["refused"][0]:
                problems.append("error.param: want %r (%s), got %r" % (v["refused"][0], v["refused"][1], err))
            if calls:
                problems.append("an upstream call was made (API.md 14: refused, no upstream call)")
            if problems:
                t.fail(v, "", problems)
            continue
        if r.status != 200 or not calls:
            t.fail(v, "", ["ltg answered %s after %d upstream calls" % (r.brief(), calls)])
            continue
        sent = json.loads(it.H.mock_last()["body"])
        want = dict(v["expected"])
        if "model" in want:
            want["model"] = upstream_of(alias)
        gave_max = any(k in v["input"] for k in ("max_tokens", "max_completion_tokens"))
        if to_anth and "max_tokens" in want and not gave_max:
            want["max_tokens"] = MAX_OUT
        want, got = tag_tool_messages(norm_request(want, not to_anth)), tag_tool_messages(norm_request(sent, not to_anth))
        if v.get("compare"):
            ws, gs = request_summary(want), request_summary(got)
            want = {k: ws.get(k) for k in v["compare"]}
            got = {k: gs.get(k) for k in v["compare"]}
        problems = compare(v, want, got, subset=False)
        if problems:
            t.fail(v, "", problems + ["sent: %s" % json.dumps(sent)[:600]])
    t.end()


def run_answers(direction, kind):
    vs = load(direction, kind)
    t = tally("%s %ss" % (direction, kind), vs)
    to_anth = direction == "chat->messages"
    summary = chat_summary if to_anth else anth_summary
    for v in vs:
        if v.get("skip"):
            t.skip(v)
            continue
        for how in (("", "framing=chunked"), (" (bytewise)", "framing=chunked bytewise")) if kind == "stream" else (("", "ok"),):
            t.ran += 1
            alias = (POOL_A if to_anth else POOL_C).take_one()
            up = upstream_of(alias)
            inp = v["input"]
            if kind == "stream":
                raw, ctype = "".join(e["raw"] + "\n\n" for e in inp), "text/event-stream"
            else:
                raw, ctype = inp if isinstance(inp, str) else json.dumps(inp), "application/json"
            it.H.mock_post("/_mock/answer", {"model": up, "status": v.get("upstream_status", 200),
                                             "content_type": v.get("upstream_content_type", ctype), "body": raw})
            it.H.mock_post("/_mock/script", {"model": up, "steps": [how[1]]})
            body = {"model": alias, "messages": [{"role": "user", "content": "Hi"}]}
            if not to_anth:
                body["max_tokens"] = 100
            if kind == "stream":
                body["stream"] = True
                if to_anth:
                    body["stream_options"] = {"include_usage": True}
            r = post("/v1/chat/completions" if to_anth else "/v1/messages", body)
            problems = []
            if v.get("expected_status"):
                problems = errors(v, r, to_anth)
            elif r.status != 200:
                problems = ["ltg answered %s" % r.brief()]
            else:
                problems = answer_problems(v, r, kind, summary, alias)
            if problems:
                t.fail(v, how[0], problems)
    t.end()


def errors(v, r, to_chat_client):
    """An error vector: the status; the provider's message kept (contained in ltg's, which may say
    more); for an Anthropic client its shape and error.type (the vectors assert them)."""
    out = []
    if r.status != v["expected_status"]:
        out.append("status: want %d, got %d" % (v["expected_status"], r.status))
    try:
        j = json.loads(r.body)
    except ValueError:
        return out + ["not JSON: %r" % r.body[:200]]
    err, want = j.get("error") if isinstance(j.get("error"), dict) else {}, v["expected"]["error"]
    if want["message"] not in (err.get("message") or ""):
        out.append("error.message: want %r in it, got %r" % (want["message"], err.get("message")))
    if not to_chat_client and (j.get("type") != "error" or err.get("type") != want["type"]):
        out.append("shape: want type error, error.type %r; got %s" % (want["type"], json.dumps(j)[:300]))
    return out


def answer_problems(v, r, kind, summary, alias):
    if kind == "stream":
        got = it.sse_named(r)
    else:
        got = json.loads(r.body)
    exp = v["expected"]
    if isinstance(exp, dict) and "summary" in exp:
        gs = summary(got)
        want = {k: exp["summary"].get(k) for k in v["compare"]}
        gotc = {k: gs.get(k) for k in v["compare"]}
    elif v.get("compare") or kind == "stream":
        es, gs = summary(exp if kind != "stream" else [(e["event"], e["data"]) for e in exp]), summary(got)
        keys = v.get("compare") or list(es)
        want, gotc = {k: es.get(k) for k in keys}, {k: gs.get(k) for k in keys}
        if kind == "stream" and not v.get("compare") and summary is anth_summary:
            want["events"] = anth_grammar([(e["event"], e["data"]) for e in exp])
            gotc["events"] = anth_grammar(got)
    else:
        exp, got = norm_answer(exp), norm_answer(got)
        problems = compare(v, exp, got, subset=True, alias=alias)
        return problems and problems + ["got: %s" % json.dumps(got)[:600]]
    if isinstance(want.get("usage"), dict) and isinstance(gotc.get("usage"), dict):
        gotc["usage"] = {k: gotc["usage"].get(k) for k in want["usage"]}      # only the counts the vector names
    problems = compare(v, want, gotc, subset=False)
    if problems and kind == "stream":
        return problems + ["got: %s" % " ".join(json.dumps(d.get("delta") if isinstance(d, dict) and "delta" in d else d)[:160]
                                                 for _, d in got)[:1500]]
    return problems and problems + ["got: %s" % json.dumps(got)[:600]]


for _d in DIRECTIONS:
    it.test("vectors: %s requests: the peers' client requests, what ltg sends the provider" % _d)(
        lambda d=_d: run_requests(d))
    it.test("vectors: %s responses: the peers' provider answers, what ltg answers the client" % _d)(
        lambda d=_d: run_answers(d, "response"))
    it.test("vectors: %s streams: the peers' provider streams, whole and bytewise, what ltg streams the client" % _d)(
        lambda d=_d: run_answers(d, "stream"))
