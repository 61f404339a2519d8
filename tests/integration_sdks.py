"""Integration tests: real clients. The npm SDKs users point at ltg -- the official `openai` SDK, the
Vercel AI SDK (`ai` with `@ai-sdk/openai`), LangChain (`@langchain/openai`), and for Anthropic's API
`@anthropic-ai/sdk` and `@ai-sdk/anthropic` -- each pinned below, installed into the git-ignored
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
import shutil
import subprocess

import integration as it

check = it.check

CLIENTS = os.path.join(it.HERE, "sdk_clients.mjs")
NODE_MODULES = os.path.join(it.HERE, "node_modules")

# Every npm package the tests install, pinned: (version on Node.js >= 22, version on an older node).
# The current majors of the AI SDK and of @langchain/openai need Node.js 22 ("engines"); on an
# older node (Debian 12's 18, or 20) the last release that supports it, as openai_sdk_version()
# in integration.py does for `openai` -- whose pin is that function's, so that t_sdk and these
# tests agree on it (one `npm install --no-save` removes what another did not name).
# @ai-sdk/* majors go with `ai`'s: ai 7 / provider 4, ai 6 / provider 3. zod is the AI SDK's and
# LangChain's peer dependency, installed by users alongside.
NPM_PINS = {
    "ai":                ("7.0.173", "6.0.326"),
    "@ai-sdk/openai":    ("4.0.118", "3.0.141"),
    "@ai-sdk/anthropic": ("4.0.105", "3.0.140"),
    "@langchain/openai": ("1.6.0",   "1.5.8"),     # 1.5.9 and later need Node.js 22 (and openai 7)
    "@langchain/core":   ("1.4.0",   "1.4.0"),     # node >= 20
    "@anthropic-ai/sdk": ("1.15.0",  "1.15.0"),    # no engines field
    "zod":               ("4.6.7",   "4.6.7"),
}
INSTALL_TIMEOUT = 300
RUN_TIMEOUT = 120

_ready = {}      # the outcome of ensure_sdks(), once per run: {"node": path} or {"skip": reason}


def node_major(node):
    p = subprocess.run([node, "-p", "process.versions.node"], stdout=subprocess.PIPE, timeout=30)
    return int((p.stdout.decode().strip() or "0").split(".")[0])


def wanted(node):
    """{package: version} for this node."""
    new = node_major(node) >= 22
    pins = {name: (v[0] if new else v[1]) for name, v in NPM_PINS.items()}
    pins["openai"] = it.openai_sdk_version(node)
    return pins


def installed(name):
    try:
        with open(os.path.join(NODE_MODULES, *name.split("/"), "package.json")) as f:
            return json.load(f).get("version")
    except (OSError, ValueError):
        return None


def ensure_sdks():
    """The node binary, with every pinned package in tests/node_modules (one npm install of them
    all when one is missing or differs); TestSkip when that cannot be."""
    if not _ready:
        with it.install_lock():     # one npm install at a time in tests/node_modules (--jobs)
            _ready.update(_ensure())
    if "skip" in _ready:
        raise it.TestSkip(_ready["skip"])
    return _ready["node"]


def _ensure():
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node:
        return {"skip": "no node"}
    pins = wanted(node)
    specs = ["%s@%s" % kv for kv in sorted(pins.items())]
    off = [s for s in specs if installed(s.rsplit("@", 1)[0]) != s.rsplit("@", 1)[1]]
    if not off:
        return {"node": node}
    if not npm:
        return {"skip": "no npm, and tests/node_modules lacks %s" % " ".join(off)}
    try:
        p = subprocess.run([npm, "install", "--prefix", it.HERE, "--no-save", "--no-audit", "--no-fund"] + specs,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"skip": "npm install %s took more than %d s" % (" ".join(specs), INSTALL_TIMEOUT)}
    off = [s for s in specs if installed(s.rsplit("@", 1)[0]) != s.rsplit("@", 1)[1]]
    if p.returncode != 0 or off:
        return {"skip": "npm install %s failed (exit %d; still missing: %s): %s"
                        % (" ".join(specs), p.returncode, " ".join(off) or "-",
                           p.stdout.decode(errors="replace").strip()[-400:])}
    return {"node": node}


def run_clients(which, port, token):
    """Run sdk_clients.mjs WHICH against ltg on `port`; check it exited 0; return (the headers it
    saw, per call, its "ok" lines)."""
    node = ensure_sdks()
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
    result = {}
    for l in lines:
        if l.startswith("RESULT "):
            result = json.loads(l[7:])
    return result, [l for l in lines if l.startswith("ok ")]


def key_for(allowed, fallbacks=None, port=None):
    g = it.create_group(it.group_body(allowed_models=allowed, fallbacks=fallbacks or {}), port=port)
    return it.create_key(g["id"], port=port)[1]


@it.test("sdks: the openai Node SDK: chat, responses (plain, stream: true, responses.stream), "
         "completions, embeddings (default base64), x-ltg headers via withResponse()/asResponse()")
def t_sdk_openai():
    token = key_for(it.TWO)
    result, oks = run_clients("openai", it.H.port, token)
    check(len(oks) == 7, "expected 7 checks, passed: %r" % oks)
    check(result.get("chat") == {"served": "Kimi-K3", "attempts": "1"}, "the headers seen: %r" % result)


@it.test("sdks: the Vercel AI SDK (ai + @ai-sdk/openai): generateText/streamText on the default "
         "provider (Responses API) and provider.chat(), embed(); result.response.headers")
def t_sdk_vercel_ai():
    token = key_for(it.TWO)
    result, oks = run_clients("ai", it.H.port, token)
    check(len(oks) == 4, "expected 4 checks, passed: %r" % oks)
    check(result.get("ai generateText responses", {}).get("served") == "Kimi-K3", "the headers seen: %r" % result)


@it.test("sdks: LangChain (@langchain/openai): ChatOpenAI invoke and stream (chat and Responses), OpenAIEmbeddings")
def t_sdk_langchain():
    token = key_for(it.TWO)
    _, oks = run_clients("langchain", it.H.port, token)
    check(len(oks) == 3, "expected 3 checks, passed: %r" % oks)


@it.test("sdks: a failover (Kimi-K3 503 -> GLM-5.3-Flash) seen by the openai SDK and the AI SDK: "
         "x-ltg-served-model GLM-5.3-Flash, x-ltg-attempts 2")
def t_sdk_failover():
    ensure_sdks()      # a skip before the mock is scripted
    token = key_for(it.TWO, {"Kimi-K3": ["GLM-5.3-Flash"]})
    for which, call in (("failover-openai", "failover chat"), ("failover-ai", "failover ai generateText")):
        it.H.mock_post("/_mock/script", {"model": "kimi-k3", "steps": ["status=503"]})
        try:
            result, _ = run_clients(which, it.H.port, token)
        except BaseException:
            it.H.mock_reset()      # the step, if the SDK never reached ltg, must not hit a later test
            raise
        check(result.get(call) == {"served": "GLM-5.3-Flash", "attempts": "2"},
              "%s: the headers seen: %r" % (which, result))


# Anthropic's API, on an ltg of its own whose catalog adds a provider declaring "api":"anthropic"
# (the mock serves /v1/messages and /v1/messages/count_tokens) and the model Claude-M on it.

def anthropic_catalog():
    cfg = copy.deepcopy(it.H.config)
    cfg["providers"]["anth"] = {"base_url": "http://127.0.0.1:%d/v1" % it.H.mock_port, "api_key_env": "MOCK_KEY",
                                "api": "anthropic"}
    cfg["models"]["Claude-M"] = {"provider": "anth", "upstream_model": "claude-mock",
                                 "input_usd_per_mtok": 3.0, "output_usd_per_mtok": 15.0}
    return cfg


@it.test("sdks: Anthropic's API (POST /v1/messages, /v1/messages/count_tokens) through @anthropic-ai/sdk "
         "(create, stream, countTokens) and @ai-sdk/anthropic (generateText, streamText)")
def t_sdk_anthropic():
    ensure_sdks()
    a = it.Aux("sdks-anthropic", config=it.write_catalog(anthropic_catalog(), "sdks-anthropic"))
    try:
        a.start()
        token = key_for(["Kimi-K3", "GLM-5.3-Flash", "Claude-M"], port=a.admin_port)
        _, oks = run_clients("anthropic", a.port, token)
        check(len(oks) == 6, "expected 6 checks, passed: %r" % oks)
        a.stop()
    finally:
        a.close()


# The usage ltg relays, read by the SDKs: the upstream answer is scripted (POST /_mock/script on the
# upstream model, one step) with cache counts, and the SDK's parsed usage must carry them unchanged.

def run_scripted(which, port, token, upstream, directive):
    """Script `upstream`'s next answer with `directive`, run sdk_clients.mjs WHICH: its RESULT."""
    ensure_sdks()      # a skip before the mock is scripted
    it.H.mock_post("/_mock/script", {"model": upstream, "steps": [directive]})
    try:
        result, oks = run_clients(which, port, token)
    except BaseException:
        it.H.mock_reset()      # the step, if the SDK never reached ltg, must not hit a later test
        raise
    check(len(oks) == 1, "%s: expected 1 check, passed: %r" % (which, oks))
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
    ensure_sdks()
    a = it.Aux("sdks-anthropic-usage", config=it.write_catalog(anthropic_catalog(), "sdks-anthropic-usage"))
    try:
        a.start()
        token = key_for(["Claude-M"], port=a.admin_port)
        u = run_scripted("usage-anthropic", a.port, token, "claude-mock",
                         "input_tokens=12 cached_tokens=48000 cache_write=2000 output_tokens=100")
        got = (u.get("input_tokens"), u.get("cache_read_input_tokens"), u.get("cache_creation_input_tokens"), u.get("output_tokens"))
        check(got == (12, 48000, 2000, 100), "message.usage %r: input_tokens, cache_read_input_tokens, "
              "cache_creation_input_tokens, output_tokens %r, want (12, 48000, 2000, 100)" % (u, got))
        a.stop()
    finally:
        a.close()


if __name__ == "__main__":   # this file alone: python3 tests/integration_sdks.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
