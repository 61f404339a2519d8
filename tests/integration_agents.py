"""Integration tests: coding agents through ltg, unmodified -- Claude Code and Codex CLI from npm
(pinned in integration.AGENT_PINS, installed in tests/agents), run non-interactively against ltg
and the mock as the README's recipes say (`claude -p ... --output-format json`, `codex exec
--json`): a plain answer, a tool loop (the mock's tool_call directive asks for one run of the
agent's shell tool, then answers), a failover the agent sees as success, and the agent's own
account of its usage equal to ltg's ledger. Skipped, with the reason, without node and npm.
Every other traffic is refused: the agents get a proxy that is closed for anything but loopback.

And the edges the agents found, which run without them: GET /v1/models with x-api-key, a body
over --max-body-mb on /v1/messages (Anthropic's shape, and its access-log line), HEAD /, a
WebSocket upgrade of /v1/responses (426: Codex falls back to HTTP at once), and
--max-stream-seconds' default.

Runs alone: python3 tests/integration_agents.py --ltg ./ltg --mock tests/mock
"""

import datetime
import json
import os
import shutil
import subprocess

import integration as it

check = it.check

AGENTS = os.path.join(it.HERE, "agents")
# Claude Code's default model and the prices its own table gives it (USD per million tokens; the
# cache classes default to Anthropic's multipliers, which are its table's too), a fallback at the
# same prices, a model behind OpenAI chat (translated) at them too, and Codex's models.
MODELS = {
    "claude-opus-4-8": ("anth", "claude-opus-4-8", 5.0, 25.0),
    "claude-opus-4-8-b": ("anth", "claude-opus-4-8-b", 5.0, 25.0),
    "glm-4.6": ("mock", "glm-4.6", 5.0, 25.0),
    "gpt-5.5": ("mock", "gpt-5.5", 1.25, 10.0),
    "gpt-5.5-b": ("mock", "gpt-5.5-b", 1.25, 10.0),
    # behind a provider that serves chat alone: Codex's requests translated
    "glm-5.3-flash": ("chatonly", "glm-5.3-flash", 0.6, 2.2),
}
_ltg = {}


def ltg():
    """This file's ltg: the harness's catalog with an Anthropic provider and the agents' models,
    an access log of its own."""
    if "aux" not in _ltg:
        cfg = it.catalog_copy()
        cfg["providers"]["anth"] = dict(cfg["providers"]["mock"], api="anthropic")
        cfg["providers"]["chatonly"] = dict(cfg["providers"]["mock"], endpoints=["chat"])
        for alias, (prov, up, i, o) in MODELS.items():
            cfg["models"][alias] = it.catalog_model(prov, up, i, o)
        _ltg["access"] = os.path.join(it.H.tmp, "agents-access-%d.log" % os.getpid())
        a = it.Aux("agents", config=it.write_catalog(cfg, "agents"), args=["--access-log", _ltg["access"]])
        a.start()
        _ltg["aux"] = a
    return _ltg["aux"]


def group_key(allowed, fallbacks=None):
    a = ltg()
    g = it.create_group(it.group_body(allowed_models=allowed, fallbacks=fallbacks or {}), port=a.admin_port)
    return g, it.create_key(g["id"], port=a.admin_port)[1]


def events_of(g, want, timeout=15.0):
    """The group's spend events, oldest first, once there are `want`."""
    a = ltg()
    today = datetime.datetime.now(datetime.timezone.utc).date()
    q = "/spend/events?start_date=%s&end_date=%s&token_group_id=%s&page[size]=100" % (
        today - datetime.timedelta(days=1), today + datetime.timedelta(days=2), g["id"])
    got = []

    def enough():
        got[:] = it.check_admin_ok(it.admin("GET", q, port=a.admin_port), 200, "GET /spend/events")["data"]
        return len(got) >= want
    it.wait_until("%d spend events" % want, enough, timeout * it.SLOW, 0.1)
    return sorted(got, key=lambda e: e["created_at"])


def script(model, steps):
    it.H.mock_post("/_mock/script", {"model": model, "steps": steps})


def agent_env(home, extra):
    """A bare environment: a home of its own, and a proxy that is closed for everything but
    loopback, so that nothing leaves the machine (an agent that tried would fail, not leak)."""
    env = {"PATH": os.path.join(AGENTS, "node_modules", ".bin") + ":" + os.path.dirname(shutil.which("node") or "/usr/bin/node")
           + ":/usr/bin:/bin", "HOME": home, "TERM": "dumb", "LANG": "C.UTF-8",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "NO_PROXY": "127.0.0.1,localhost"}
    env.update(extra)
    return env


def run(argv, env, timeout=120):
    os.makedirs(env["HOME"], exist_ok=True)
    p = subprocess.run(argv, env=env, cwd=env["HOME"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=timeout * it.SLOW)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


# ----- Claude Code -----

def claude(token, prompt, tag, model=None):
    """`claude -p PROMPT --output-format json` through ltg, as the README's recipe (with
    ANTHROPIC_MODEL=model for a model other than its default): its JSON."""
    it.node_packages(it.AGENT_PINS, AGENTS)
    home = os.path.join(it.H.tmp, "claude-home-" + tag)
    extra = {"ANTHROPIC_MODEL": model} if model else {}
    env = agent_env(home, dict(extra, **{
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:%d" % ltg().port, "ANTHROPIC_AUTH_TOKEN": token,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_MAX_RETRIES": "0", "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK": "1"}))
    rc, out, err = run(["claude", "-p", prompt, "--output-format", "json"], env)
    try:
        j = json.loads(out)
    except ValueError:
        raise it.TestFailure("claude exited %d without its JSON: %r %r" % (rc, out[-400:], err[-400:]))
    check(rc == 0 and not j.get("is_error"), "claude exited %d: %r" % (rc, {k: j.get(k) for k in ("subtype", "is_error", "result", "api_error_status")}))
    return j


def check_claude_usage(j, evs):
    """Claude Code's own account (usage, total_cost_usd from its price table) against the ledger:
    Anthropic's input_tokens leave out the cache's, which ltg's count."""
    u = j["usage"]
    mine = {"input": u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"],
            "cache_read": u["cache_read_input_tokens"], "cache_write": u["cache_creation_input_tokens"],
            "output": u["output_tokens"]}
    ledger = {"input": sum(e["input_tokens"] for e in evs), "cache_read": sum(e["cache_read_tokens"] for e in evs),
              "cache_write": sum(e["cache_write_tokens"] for e in evs), "output": sum(e["output_tokens"] for e in evs)}
    check(mine == ledger, "Claude Code's usage %r, the ledger's %r" % (mine, ledger))
    cost = sum(e["cost"] for e in evs)
    # ltg charges whole micro-USD, rounded up; Claude Code adds floats
    check(abs(j["total_cost_usd"] - cost) < 1e-6 * len(evs), "total_cost_usd %r, the ledger's %r" % (j["total_cost_usd"], cost))


@it.test("agents: Claude Code (claude -p --output-format json) through ltg: its default model's alias, the answer; "
         "its usage and total_cost_usd equal the ledger's event")
def t_claude_plain():
    g, token = group_key(["claude-opus-4-8"])
    j = claude(token, "say hi", "plain")
    check("word" in j.get("result", ""), "the answer: %r" % j.get("result"))
    evs = events_of(g, 1)
    check(len(evs) == 1 and evs[0]["endpoint"] == "/v1/messages" and evs[0]["model"] == "claude-opus-4-8"
          and evs[0]["status"] == "succeeded", "the event: %r" % evs)
    check_claude_usage(j, evs)


@it.test("agents: Claude Code's tool loop through ltg: the mock asks for one Bash call, Claude Code runs it and sends "
         "its output back, then the answer; two events, their sum its usage and cost")
def t_claude_tool():
    g, token = group_key(["claude-opus-4-8"])
    script("claude-opus-4-8", ["tool_call", "ok"])
    j = claude(token, "run the tool", "tool")
    last = it.H.mock_get("/_mock/last")
    check("mock-tool-42" in json.dumps(last.get("body", last)), "the second request carries the tool's output")
    check(j.get("num_turns", 0) >= 2, "num_turns %r" % j.get("num_turns"))
    evs = events_of(g, 2)
    check(len(evs) == 2 and all(e["status"] == "succeeded" for e in evs), "the events: %r" % evs)
    check_claude_usage(j, evs)


@it.test("agents: a failover Claude Code sees as success: 529 on its model, ltg's fallback serves, one request and "
         "exit 0 for Claude Code, attempts 2 in the ledger")
def t_claude_failover():
    g, token = group_key(["claude-opus-4-8", "claude-opus-4-8-b"], {"claude-opus-4-8": ["claude-opus-4-8-b"]})
    script("claude-opus-4-8", ["status=529"])
    j = claude(token, "say hi", "failover")
    evs = events_of(g, 1)
    check(len(evs) == 1 and evs[0]["attempts"] == 2 and evs[0]["model"] == "claude-opus-4-8-b"
          and [x["outcome"] for x in evs[0]["attempt_log"]] == ["no_work", "ok"], "the event: %r" % evs)
    check_claude_usage(j, evs)


@it.test("agents: Claude Code on a model behind OpenAI chat (ANTHROPIC_MODEL=glm-4.6): ltg translates its Messages "
         "request to chat and the chat stream back; the answer, the attempt's api chat, its usage and cost the ledger's")
def t_claude_on_chat_plain():
    g, token = group_key(["glm-4.6"])
    j = claude(token, "say hi", "chat-plain", model="glm-4.6")
    check("word" in j.get("result", ""), "the answer: %r" % j.get("result"))
    last = it.H.mock_get("/_mock/last")
    check(last["path"].endswith("/chat/completions") and json.loads(last["body"])["model"] == "glm-4.6",
          "the mock was spoken to in chat: %s" % last["path"])
    evs = events_of(g, 1)
    check(len(evs) == 1 and evs[0]["model"] == "glm-4.6" and evs[0]["client_api"] == "messages"
          and [x["api"] for x in evs[0]["attempt_log"]] == ["chat"], "the event: %r" % evs)
    check_claude_usage(j, evs)


@it.test("agents: Claude Code's tool loop on a chat model: the mock's chat tool_calls (Bash) reach Claude Code as a "
         "tool_use, it runs it and its tool_result reaches the mock as a tool message; usage and cost the ledger's")
def t_claude_on_chat_tool():
    g, token = group_key(["glm-4.6"])
    script("glm-4.6", ["tool_call", "ok"])
    j = claude(token, "run the tool", "chat-tool", model="glm-4.6")
    body = json.loads(it.H.mock_get("/_mock/last")["body"])
    tool = [m for m in body["messages"] if m.get("role") == "tool"]
    check(len(tool) == 1 and "mock-tool-42" in json.dumps(tool[0]), "the second request's tool message: %r" % tool)
    calls = [m for m in body["messages"] if m.get("tool_calls")]
    check(calls and calls[-1]["tool_calls"][0]["id"] == tool[0]["tool_call_id"], "the call and its result pair up")
    check(j.get("num_turns", 0) >= 2, "num_turns %r" % j.get("num_turns"))
    evs = events_of(g, 2)
    check(len(evs) == 2 and all(e["status"] == "succeeded" for e in evs), "the events: %r" % evs)
    check_claude_usage(j, evs)


@it.test("agents: Claude Code's model answers 529, ltg fails over to the chat model (translated): exit 0, one "
         "event with attempts 2 (messages, then chat), usage and cost the ledger's")
def t_claude_failover_to_chat():
    g, token = group_key(["claude-opus-4-8", "glm-4.6"], {"claude-opus-4-8": ["glm-4.6"]})
    script("claude-opus-4-8", ["status=529"])
    j = claude(token, "say hi", "failover-chat")
    check("word" in j.get("result", ""), "the answer: %r" % j.get("result"))
    evs = events_of(g, 1)
    check(len(evs) == 1 and evs[0]["attempts"] == 2 and evs[0]["model"] == "glm-4.6"
          and [(x["outcome"], x["api"]) for x in evs[0]["attempt_log"]] == [("no_work", "messages"), ("ok", "chat")],
          "the event: %r" % evs)
    check_claude_usage(j, evs)


# ----- Codex CLI -----

CODEX_CONFIG = """model = "%(model)s"
model_provider = "ltg"
check_for_update_on_startup = false

[analytics]
enabled = false

[features]
plugins = false

[model_providers.ltg]
name = "ltg"
base_url = "http://127.0.0.1:%(port)d/v1"
env_key = "LTG_TOKEN_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""


def codex(token, prompt, tag, model="gpt-5.5", extra="", ok=True):
    """`codex exec --json PROMPT` through ltg, as the README's recipe (`extra`: more lines of its
    provider's table): its events (JSON lines)."""
    it.node_packages(it.AGENT_PINS, AGENTS)
    home = os.path.join(it.H.tmp, "codex-home-" + tag)
    os.makedirs(os.path.join(home, ".codex"), exist_ok=True)
    with open(os.path.join(home, ".codex", "config.toml"), "w") as f:
        f.write(CODEX_CONFIG % {"model": model, "port": ltg().port} + extra)
    env = agent_env(home, {"CODEX_HOME": os.path.join(home, ".codex"), "LTG_TOKEN_KEY": token})
    rc, out, err = run(["codex", "exec", "--json", "--skip-git-repo-check", "--ephemeral", prompt], env)
    evs = []
    for line in out.splitlines():
        try:
            evs.append(json.loads(line))
        except ValueError:
            pass
    done = any(e.get("type") == "turn.completed" for e in evs)
    check(ok == (rc == 0 and done), "codex exited %d: %r %r" % (rc, out[-600:], err[-400:]))
    return evs


def access_all():
    """Every access-log line of this file's ltg but the harness's probes, in order."""
    with open(_ltg["access"]) as f:
        return [l for l in map(json.loads, filter(str.strip, f.read().splitlines()))
                if l["path"] not in ("/healthz", "/readyz")]


def check_codex_usage(cevs, evs):
    u = [e for e in cevs if e.get("type") == "turn.completed"][-1]["usage"]
    mine = {"input": u["input_tokens"], "cache_read": u["cached_input_tokens"], "output": u["output_tokens"],
            "reasoning": u["reasoning_output_tokens"]}
    ledger = {"input": sum(e["input_tokens"] for e in evs), "cache_read": sum(e["cache_read_tokens"] for e in evs),
              "output": sum(e["output_tokens"] for e in evs), "reasoning": sum(e["reasoning_tokens"] for e in evs)}
    check(mine == ledger, "Codex's usage %r, the ledger's %r" % (mine, ledger))


def check_codex_ran(cevs):
    """Codex ran the mock's tool call: a command_execution whose output is the mock's."""
    runs = [e["item"] for e in cevs if e.get("type") == "item.completed"
            and e.get("item", {}).get("type") == "command_execution"]
    check(runs and "mock-tool-42" in runs[0].get("aggregated_output", json.dumps(runs[0])),
          "the command it ran: %r (Codex said %r)" % (runs, cevs[-6:]))


@it.test("agents: Codex CLI (codex exec --json) through ltg on the Responses API: the answer; its turn's usage equals "
         "the ledger's event")
def t_codex_plain():
    g, token = group_key(["gpt-5.5"])
    cevs = codex(token, "say hi", "plain")
    msgs = [e["item"].get("text", "") for e in cevs if e.get("type") == "item.completed"
            and e.get("item", {}).get("type") == "agent_message"]
    check(any("word" in m for m in msgs), "the answer: %r" % msgs)
    evs = events_of(g, 1)
    check(len(evs) == 1 and evs[0]["endpoint"] == "/v1/responses" and evs[0]["status"] == "succeeded", "the event: %r" % evs)
    check_codex_usage(cevs, evs)


@it.test("agents: Codex's tool loop through ltg: the mock asks for one exec_command, Codex runs it and sends its "
         "output back, then the answer; two events, their sum its usage")
def t_codex_tool():
    g, token = group_key(["gpt-5.5"])
    script("gpt-5.5", ["tool_call", "ok"])
    cevs = codex(token, "run the tool", "tool")
    check_codex_ran(cevs)
    check("mock-tool-42" in json.dumps(it.H.mock_get("/_mock/last")), "the second request carries the tool's output")
    evs = events_of(g, 2)
    check(len(evs) == 2 and all(e["status"] == "succeeded" for e in evs), "the events: %r" % evs)
    check_codex_usage(cevs, evs)


@it.test("agents: Codex on a model behind a chat-only provider (its Responses translated): the answer, then a tool "
         "loop -- the model calls exec_command, Codex runs it and sends its output back as a tool message; its "
         "usage equals the ledger's")
def t_codex_chat_only():
    g, token = group_key(["glm-5.3-flash"])
    cevs = codex(token, "say hi", "chat-plain", model="glm-5.3-flash")
    msgs = [e["item"].get("text", "") for e in cevs if e.get("type") == "item.completed"
            and e.get("item", {}).get("type") == "agent_message"]
    check(any("word" in m for m in msgs), "the answer: %r" % msgs)
    sent = it.H.mock_get("/_mock/last")
    check(sent["path"].endswith("/chat/completions"), "sent to %r" % sent["path"])
    evs = events_of(g, 1)
    check(len(evs) == 1 and evs[0]["endpoint"] == "/v1/responses" and evs[0]["status"] == "succeeded", "the event: %r" % evs)
    check_codex_usage(cevs, evs)
    script("glm-5.3-flash", ["tool_call", "ok"])
    cevs = codex(token, "run the tool", "chat-tool", model="glm-5.3-flash")
    check_codex_ran(cevs)
    last = json.loads(it.H.mock_get("/_mock/last")["body"])
    tools = [m for m in last["messages"] if m["role"] == "tool"]
    check(tools and "mock-tool-42" in tools[0]["content"], "the second request's tool message: %r" % last["messages"][-3:])
    evs = events_of(g, 3)
    check(len(evs) == 3, "the events: %r" % evs)
    check_codex_usage(cevs, evs[1:])


@it.test("agents: Codex on Claude (its Responses translated to Messages): a tool loop -- Claude calls exec_command, "
         "Codex runs it and its output goes back as a tool_result; and a failover from a chat-only model answering "
         "503 to Claude, attempts 2; its usage equals the ledger's")
def t_codex_claude():
    g, token = group_key(["claude-opus-4-8"])
    script("claude-opus-4-8", ["tool_call", "ok"])
    cevs = codex(token, "run the tool", "claude-tool", model="claude-opus-4-8")
    check_codex_ran(cevs)
    last = it.H.mock_get("/_mock/last")
    check(last["path"].endswith("/messages") and "tool_result" in last["body"] and "mock-tool-42" in last["body"],
          "the second request: %r" % last["body"][-400:])
    evs = events_of(g, 2)
    check(len(evs) == 2 and all(e["status"] == "succeeded" for e in evs), "the events: %r" % evs)
    check_codex_usage(cevs, evs)
    g, token = group_key(["glm-5.3-flash", "claude-opus-4-8"], {"glm-5.3-flash": ["claude-opus-4-8"]})
    script("glm-5.3-flash", ["status=503"])
    cevs = codex(token, "say hi", "claude-failover", model="glm-5.3-flash")
    evs = events_of(g, 1)
    check(len(evs) == 1 and evs[0]["attempts"] == 2 and evs[0]["model"] == "claude-opus-4-8", "the event: %r" % evs)
    check_codex_usage(cevs, evs)


@it.test("agents: a failover Codex sees as success: 503 on its model, ltg's fallback serves; attempts 2 in the ledger")
def t_codex_failover():
    g, token = group_key(["gpt-5.5", "gpt-5.5-b"], {"gpt-5.5": ["gpt-5.5-b"]})
    script("gpt-5.5", ["status=503"])
    cevs = codex(token, "say hi", "failover")
    evs = events_of(g, 1)
    check(len(evs) == 1 and evs[0]["attempts"] == 2 and evs[0]["model"] == "gpt-5.5-b", "the event: %r" % evs)
    check_codex_usage(cevs, evs)


@it.test("agents: Codex with the recipe's request_max_retries and stream_max_retries 0: a model the key may not call "
         "is one 403 model_not_allowed, not six; with supports_websockets, ltg's 426 has it fall back to HTTP at once")
def t_codex_retries_websocket():
    a = ltg()
    g = it.create_group(it.group_body(allowed_models=["gpt-5.5"]), port=a.admin_port)
    token = it.create_key(g["id"], port=a.admin_port)[1]
    it.wait_until("the key's access-log line", lambda: access_all()[-1]["path"].endswith("/token_keys"), 15 * it.SLOW, 0.05)
    before = len(access_all())
    cevs = codex(token, "say hi", "refused", model="gpt-6.2-sol", ok=False)
    check(any(e.get("type") == "turn.failed" for e in cevs), "Codex's events: %r" % cevs[-3:])
    it.wait_until("the refusal's access-log line", lambda: len(access_all()) > before, 15 * it.SLOW, 0.05)
    lines = [(l["method"], l["path"], l["status"]) for l in access_all()[before:]]
    check(lines == [("POST", "/v1/responses", 403)], "what Codex sent: %r" % lines)
    before += 1
    codex(token, "say hi", "websocket", extra="supports_websockets = true\n")
    it.wait_until("the call's access-log lines", lambda: len(access_all()) >= before + 2, 15 * it.SLOW, 0.05)
    lines = [(l["method"], l["path"], l["status"]) for l in access_all()[before:]]
    check(lines == [("GET", "/v1/responses", 426), ("POST", "/v1/responses", 200)],
          "one upgrade refused, then the call over HTTP: %r" % lines)


# ----- the edges (no agent needed) -----

def access_line(rid, timeout=15.0):
    """The access-log line of request rid, once ltg has written it (at the end of a loop turn)."""
    found = []

    def there():
        with open(_ltg["access"]) as f:
            found[:] = [l for l in map(json.loads, filter(str.strip, f.read().splitlines())) if l["request_id"] == rid]
        return found
    it.wait_until("the access-log line of %s" % rid, there, timeout * it.SLOW, 0.05)
    return found[0]


@it.test("agents' edges: GET /v1/models and /v1/models/{id} take the key in x-api-key (Claude Code's model "
         "discovery); HEAD / and GET / answer 200 (Claude Code's warm-up)")
def t_edges_models_root():
    a = ltg()
    g, token = group_key(["claude-opus-4-8"])
    hdr = {"x-api-key": token, "anthropic-version": "2023-06-01"}
    r = it.one_request(a.port, "GET", "/v1/models?limit=1000", None, hdr, auth=None)
    check(r.status == 200 and [m["id"] for m in r.json()["data"]] == ["claude-opus-4-8"], "GET /v1/models: %s" % r.brief())
    r = it.one_request(a.port, "GET", "/v1/models/claude-opus-4-8", None, hdr, auth=None)
    check(r.status == 200 and r.json()["id"] == "claude-opus-4-8", "GET /v1/models/{id}: %s" % r.brief())
    r = it.one_request(a.port, "GET", "/v1/models", None, {"x-api-key": "ltg_sk_nope"}, auth=None)
    it.check_openai_error(r, 401)
    with it.Conn(a.port) as c:
        c.send(b"HEAD / HTTP/1.1\r\nHost: x\r\nUser-Agent: Bun/1.4.0\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
        h = c.read_response(10, head_request=True)
        check(h.status == 200 and not h.body, "HEAD /: %s" % h.brief())
        r = c.read_final_response(10)
        check(r.status == 200 and r.json().get("status") == "ok", "GET / after it, on the same connection: %s" % r.brief())


@it.test("agents' edges: a body over --max-body-mb on /v1/messages gets 413 in Anthropic's shape (request_too_large) "
         "with its request id, and its access-log line names the method and the id")
def t_edges_413():
    a = ltg()
    with it.Conn(a.port) as c:
        c.send(it.http_request("POST", "/v1/messages?beta=true", None, auth=None,
                               headers={"Content-Length": str(8 * 1024 * 1024 + 1), "Content-Type": "application/json",
                                        "x-api-key": "ltg_sk_whatever", "anthropic-version": "2023-06-01"}))
        r = c.read_final_response(10)
    j = r.json()
    check(r.status == 413 and j.get("type") == "error" and j["error"].get("type") == "request_too_large"
          and "--max-body-mb" in j["error"].get("message", ""), "413: %s" % r.brief())
    rid = r.header("x-ltg-request-id")
    check(rid and rid.startswith("req_"), "its request id: %r" % rid)
    line = access_line(rid)
    check(line["method"] == "POST" and line["status"] == 413 and line["path"].startswith("/v1/messages"),
          "its access-log line: %r" % line)


@it.test("agents' edges: a WebSocket upgrade of /v1/responses (Codex's supports_websockets) is 426, so Codex falls "
         "back to HTTP at once; --max-stream-seconds defaults to an hour")
def t_edges_websocket_stream_default():
    a = ltg()
    g, token = group_key(["gpt-5.5"])
    r = it.one_request(a.port, "GET", "/v1/responses", None,
                       {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "openai-beta": "responses_websockets=2026-02-06"},
                       auth=token)
    it.check_openai_error(r, 426, "websocket_unsupported")
    check("POST" in r.json()["error"]["message"], "the message says what to do: %r" % r.body)
    r = it.one_request(a.port, "GET", "/v1/responses", None, auth=token)
    it.check_openai_error(r, 405)
    p = subprocess.run([it.H.ltg_bin, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
    out = p.stdout.decode()
    check("--max-stream-seconds S" in out and "(default 3600)" in out.split("--max-stream-seconds S", 1)[1].split("\n")[0],
          "--help: %r" % [l for l in out.splitlines() if "max-stream" in l])


if __name__ == "__main__":   # this file alone: python3 tests/integration_agents.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
