"""Integration tests: real clients. The npm SDKs users point at ltg -- the official `openai` SDK, the
Vercel AI SDK (`ai` with `@ai-sdk/openai`), LangChain (`@langchain/openai`), and for Anthropic's API
`@anthropic-ai/sdk` and `@ai-sdk/anthropic` -- each pinned (NPM_PINS in integration.py), installed into the git-ignored
tests/node_modules when missing, and used as documented, unmodified but for the base URL, the key
and its own retries turned off (README "Point your client at it"). tests/sdk_clients.mjs holds the
client code; this file provisions a group and key, runs it, and checks what it saw, failover
included (x-ltg-served-model, x-ltg-attempts through the SDKs' response headers), and the usage
ltg relays: the cache counts a scripted upstream answer reports read back unchanged by the `openai`
SDK (completion.usage) and by @anthropic-ai/sdk (message.usage).

Skipped, with the reason, when node or npm is missing or the install fails.
Runs alone: python3 tests/integration_sdks.py --ltg ./ltg --mock tests/mock
"""

import copy
import json
import os
import subprocess

import integration as it

check = it.check

CLIENTS = os.path.join(it.HERE, "sdk_clients.mjs")
RUN_TIMEOUT = 120    # seconds one run of sdk_clients.mjs may take


def run_clients(which, port, token, checks=None):
    """Run sdk_clients.mjs WHICH against ltg on `port`; check it exited 0 and, unless `checks` is
    None, printed that many "ok" lines; return what it saw (its RESULT: per call, the headers)."""
    node = it.node_packages()
    try:
        p = subprocess.run([node, CLIENTS, "http://127.0.0.1:%d/v1" % port, token, which],
                           cwd=it.HERE, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace")
        raise it.TestFailure("sdk_clients.mjs %s still running after %d s: %s" % (which, RUN_TIMEOUT, out[-800:]))
    out = p.stdout.decode(errors="replace").strip()
    lines = out.split("\n")
    it.log("sdk_clients.mjs %s:\n%s" % (which, out))
    fails = [l for l in lines if l.startswith("FAIL")]
    check(p.returncode == 0, "sdk_clients.mjs %s exited %d: %s" % (which, p.returncode,
                                                                    " | ".join(fails) or out[-800:]))
    oks = [l for l in lines if l.startswith("ok ")]
    if checks is not None:
        check(len(oks) == checks, "%s: expected %d check%s, passed: %r" % (which, checks, "s" if checks > 1 else "", oks))
    result = {}
    for l in lines:
        if l.startswith("RESULT "):
            result = json.loads(l[7:])
    return result


def key_for(allowed, fallbacks=None, port=None):
    g = it.create_group(it.group_body(allowed_models=allowed, fallbacks=fallbacks or {}), port=port)
    return it.create_key(g["id"], port=port)[1]


@it.test("sdks: the openai Node SDK: chat, responses (plain, stream: true, responses.stream), "
         "completions, embeddings (default base64), x-ltg headers via withResponse()/asResponse()")
def t_sdk_openai():
    result = run_clients("openai", it.H.port, key_for(it.TWO), 7)
    check(result.get("chat") == {"served": "Kimi-K3", "attempts": "1"}, "the headers seen: %r" % result)


@it.test("sdks: the Vercel AI SDK (ai + @ai-sdk/openai): generateText/streamText on the default "
         "provider (Responses API) and provider.chat(), embed(); result.response.headers")
def t_sdk_vercel_ai():
    result = run_clients("ai", it.H.port, key_for(it.TWO), 4)
    check(result.get("ai generateText responses", {}).get("served") == "Kimi-K3", "the headers seen: %r" % result)


@it.test("sdks: LangChain (@langchain/openai): ChatOpenAI invoke and stream (chat and Responses), OpenAIEmbeddings")
def t_sdk_langchain():
    run_clients("langchain", it.H.port, key_for(it.TWO), 3)


@it.test("sdks: a failover (Kimi-K3 503 -> GLM-5.3-Flash) seen by the openai SDK and the AI SDK: "
         "x-ltg-served-model GLM-5.3-Flash, x-ltg-attempts 2")
def t_sdk_failover():
    it.node_packages()      # a skip before the mock is scripted
    token = key_for(it.TWO, {"Kimi-K3": ["GLM-5.3-Flash"]})
    for which, call in (("failover-openai", "failover chat"), ("failover-ai", "failover ai generateText")):
        it.H.mock_post("/_mock/script", {"model": "kimi-k3", "steps": ["status=503"]})
        try:
            result = run_clients(which, it.H.port, token)
        except BaseException:
            it.H.mock_reset()      # the step, if the SDK never reached ltg, must not hit a later test
            raise
        check(result.get(call) == {"served": "GLM-5.3-Flash", "attempts": "2"},
              "%s: the headers seen: %r" % (which, result))


# Anthropic's API, on an ltg of its own whose catalog adds a provider declaring "api":"anthropic"
# (the mock serves /v1/messages and /v1/messages/count_tokens) and the model Claude-M on it.

def anthropic_ltg(tag):
    """An Aux (not started) on the harness's catalog with the provider anth and Claude-M on it."""
    cfg = copy.deepcopy(it.H.config)
    cfg["providers"]["anth"] = it.catalog_provider(it.H.mock_port, api="anthropic")
    cfg["models"]["Claude-M"] = {"provider": "anth", "upstream_model": "claude-mock",
                                 "input_usd_per_mtok": 3.0, "output_usd_per_mtok": 15.0}
    # a provider that serves chat alone: a Responses client's requests to it are translated
    cfg["providers"]["chatonly"] = it.catalog_provider(it.H.mock_port, endpoints=["chat"])
    cfg["models"]["GLM-Chat"] = {"provider": "chatonly", "upstream_model": "glm-chat-mock",
                                 "input_usd_per_mtok": 0.6, "output_usd_per_mtok": 2.2}
    return it.Aux(tag, config=it.write_catalog(cfg, tag))


@it.test("sdks: Anthropic's API (POST /v1/messages, /v1/messages/count_tokens) through @anthropic-ai/sdk "
         "(create, stream, countTokens) and @ai-sdk/anthropic (generateText, streamText)")
def t_sdk_anthropic():
    it.node_packages()
    with it.running(anthropic_ltg("sdks-anthropic")) as a:
        token = key_for(["Kimi-K3", "GLM-5.3-Flash", "Claude-M"], port=a.admin_port)
        run_clients("anthropic", a.port, token, 6)


@it.test("sdks: translated -- the openai SDK (create, a stream, the stream helper on a tool call) and "
         "the AI SDK's provider.chat() on Claude-M, an Anthropic model; @anthropic-ai/sdk (create, "
         "stream().finalMessage(), countTokens, a tool call whole and streamed) and @ai-sdk/anthropic on "
         "Kimi-K3, an OpenAI-chat model; the openai SDK's responses.create and responses.stream() on a "
         "chat-only model and on Claude-M")
def t_sdk_translated():
    it.node_packages()
    with it.running(anthropic_ltg("sdks-translated")) as a:
        token = key_for(["Kimi-K3", "Claude-M"], port=a.admin_port)
        it.H.mock_post("/_mock/script", {"model": "claude-mock", "steps": ["ok", "ok", "tool_call", "ok", "ok"]})
        run_clients("translate-openai", a.port, token, 4)
        it.H.mock_post("/_mock/reset", {})
        result = run_clients("translate-anthropic", a.port, token, 4)
        check(result.get("translated messages") == {"served": "Kimi-K3", "attempts": "1"}, "the headers seen: %r" % result)
        # a tool call from the chat model, whole and streamed, read as tool_use blocks
        it.H.mock_post("/_mock/script", {"model": "kimi-k3", "steps": ["ok", "ok", "tool_call", "tool_call"]})
        run_clients("translate-anthropic-tools", a.port, token, 4)
        # the Responses API on a chat-only model and on Claude
        token = key_for(["GLM-Chat", "Claude-M"], port=a.admin_port)
        result = run_clients("translate-responses", a.port, token, 4)
        check(result.get("translated responses GLM-Chat") == {"served": "GLM-Chat", "attempts": "1"}, "the headers seen: %r" % result)


# The usage ltg relays, read by the SDKs: the upstream answer is scripted (POST /_mock/script on the
# upstream model, one step) with cache counts, and the SDK's parsed usage must carry them unchanged.

def run_scripted(which, port, token, upstream, directive):
    """Script `upstream`'s next answer with `directive`, run sdk_clients.mjs WHICH: its RESULT."""
    it.node_packages()      # a skip before the mock is scripted
    it.H.mock_post("/_mock/script", {"model": upstream, "steps": [directive]})
    try:
        result = run_clients(which, port, token, 1)
    except BaseException:
        it.H.mock_reset()      # the step, if the SDK never reached ltg, must not hit a later test
        raise
    usage = result.get("usage")
    check(isinstance(usage, dict), "%s: the SDK's usage %r" % (which, usage))
    return usage


@it.test("sdks: the openai SDK reads the relayed usage unchanged: chat (not streamed), prompt_tokens 5000, "
         "prompt_tokens_details.cached_tokens 4096, completion_tokens 7")
def t_sdk_openai_usage():
    token = key_for(it.TWO)
    u = run_scripted("usage-openai", it.H.port, token, "kimi-k3", "input_tokens=5000 cached_tokens=4096 output_tokens=7")
    got = (u.get("prompt_tokens"), (u.get("prompt_tokens_details") or {}).get("cached_tokens"), u.get("completion_tokens"))
    check(got == (5000, 4096, 7), "completion.usage %r: prompt_tokens, cached_tokens, completion_tokens %r, want "
          "(5000, 4096, 7)" % (u, got))


@it.test("sdks: @anthropic-ai/sdk reads the relayed usage unchanged: messages.create (not streamed), input_tokens 12, "
         "cache_read_input_tokens 48000, cache_creation_input_tokens 2000, output_tokens 100")
def t_sdk_anthropic_usage():
    it.node_packages()
    with it.running(anthropic_ltg("sdks-anthropic-usage")) as a:
        token = key_for(["Claude-M"], port=a.admin_port)
        u = run_scripted("usage-anthropic", a.port, token, "claude-mock",
                         "input_tokens=12 cached_tokens=48000 cache_write=2000 output_tokens=100")
        got = (u.get("input_tokens"), u.get("cache_read_input_tokens"), u.get("cache_creation_input_tokens"), u.get("output_tokens"))
        check(got == (12, 48000, 2000, 100), "message.usage %r: input_tokens, cache_read_input_tokens, "
              "cache_creation_input_tokens, output_tokens %r, want (12, 48000, 2000, 100)" % (u, got))


if __name__ == "__main__":   # this file alone: python3 tests/integration_sdks.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
