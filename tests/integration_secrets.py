"""Integration tests: secrets never leak, and header values with CR/LF are never reflected
(issue #7 point 5; API.md 2 "It never reaches a log, a ledger event or a response", API.md 3.3
"shown this once", README "ltg never logs a secret").

tests/integration.py imports this file at start-up and runs its tests with the others; to run only
these:

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k secrets

How. The tests run an ltg of their own (the harness's Aux, started by the first test that needs
it) whose catalog holds distinctive secrets made afresh for each run:

  - ADMIN_KEY: an admin key with every permission, given by key_env;
  - SHA_ADMIN_KEY: an admin key given by key_sha256 (read permissions only): its plaintext is sent
    in requests but is written nowhere;
  - PROVIDER_KEY: the providers' api key (api_key_env). The providers see it (checked: the proof
    that the secret is live); nobody else may;
  - every token key ltg issues: POST /token_keys shows it once, and that one answer is the only
    place where it may appear.

The tests then drive every path: the control plane's successes and every error status (400, 401
with keys that are variants of the real ones, 403, 404, 405, 409, 412, 428, 413, 431), inference
successes (plain, stream, embeddings, cache hit, idempotent replay) and errors (401 with a revoked
key, 403 model_not_allowed / group_blocked / budget_exceeded, 429, a provider's 401, failover, a
provider that is down, a cut stream, a deadline), SIGHUP with a good and bad catalogs, SIGKILL and
a restart on torn logs with replays, and SIGTERM. Every byte ltg sends back is recorded (RecConn),
and the last test searches, for every secret, in every answer (but a token key's own creation
answer), ltg's stdout+stderr and every file of its --data: the secret itself, any 16-character
piece of it (case-insensitive: an echo of a truncated or upper-cased key counts), its hex, and its
base64 (standard and URL-safe, at every alignment). A secret's SHA-256 is not searched: ltg keeps
those on purpose. The catalog file is the operator's and is not searched.

CR/LF reflection. Every answer's head must be well formed: a status line, then header lines whose
names are tokens and whose values hold no control character (no CR, LF or NUL), and no header named
Set-Cookie or X-Injected, whatever the client sent (bare CR, bare LF, NUL and obsolete line folding
in its header values, %0d%0a in its path and headers, CR/LF inside JSON strings: model names,
group names) and whatever a provider sent. tests/mock has no directive for hostile response headers,
so the provider-side tests use Hostile, a small provider in this file (its own loopback port) whose
answer per upstream model is raw bytes: bare CR, bare LF, NUL, folding in Content-Type, in the
reason phrase and in Retry-After, extra Set-Cookie / X-Injected headers, the provider key echoed in
a header and in an error body. JSON bodies must parse strictly (a raw CR or LF inside a JSON string
is an error).

Standard library only; servers on 127.0.0.1 only; every wait bounded.
"""

import atexit
import base64
import contextlib
import datetime
import hashlib
import json
import os
import re
import secrets
import signal
import socket
import threading
import time

import integration as it

check = it.check

# ===== the secrets ================================================================================

ADMIN_KEY = "adminkey-" + secrets.token_urlsafe(24)          # key_env LTG_SEC_ADMIN_KEY, ["*"]
SHA_ADMIN_KEY = "shaadmin-" + secrets.token_urlsafe(24)      # key_sha256, read permissions only
PROVIDER_KEY = "sk-provider-" + secrets.token_urlsafe(24)    # api_key_env LTG_SEC_PROVIDER_KEY
ENV = {"LTG_SEC_ADMIN_KEY": ADMIN_KEY, "LTG_SEC_PROVIDER_KEY": PROVIDER_KEY}
SHA_PERMS = ["llm_token_gateway.token_groups.read", "llm_token_gateway.token_keys.read",
             "llm_token_gateway.spend.read"]

# Header names that an injection would create.
INJECTED = ("set-cookie", "x-injected")

_S = {
    "aux": None,            # the Aux of every test but the misconfiguration and echo ones
    "hostile": None,        # the Hostile provider
    "config": None,         # path of the good catalog
    "secrets": {            # name -> secret: the three above, then every token key issued (add_token)
        "the admin key (key_env)": ADMIN_KEY,
        "the admin key (key_sha256)": SHA_ADMIN_KEY,
        "the provider key": PROVIDER_KEY,
    },
    "seen": [],             # every answer: {"label", "raw", "allow": set of secrets allowed in it}
    "main": None,           # (group id, token) of the group that allows every model
    "target": None,         # the Aux that call() talks to when not the main one (talking_to)
}


def add_token(name, token):
    _S["secrets"]["token key %s" % name] = token


# ===== searching for a secret =====================================================================

def forms(secret):
    """(what, bytes, case-insensitive?) to look for: the secret, every 16-character piece of it, its
    hex, and its base64 (standard and URL-safe) at each of the 3 alignments it can have inside a
    longer base64 text (the groups at the edges depend on the neighbours, so they are dropped)."""
    s = secret.encode()
    out = [("itself", s, False)]
    out += [("a 16-character piece", s[i:i + 16], True) for i in range(0, len(s) - 15)]
    out.append(("hex", s.hex().encode(), True))
    for pad in range(3):
        for enc, what in ((base64.b64encode, "base64"), (base64.urlsafe_b64encode, "url-safe base64")):
            e = enc(b"\0" * pad + s)
            out.append((what, e[4:-4], False))
    return out


_FORMS = {}


def leaks(data, allow=()):
    """[(secret name, form, offset)] of the secrets (but those in allow) found in the bytes data."""
    low = data.lower()
    found = []
    for name, s in _S["secrets"].items():
        if s in allow:
            continue
        if s not in _FORMS:
            _FORMS[s] = forms(s)
        for what, needle, nocase in _FORMS[s]:
            i = low.find(needle.lower()) if nocase else data.find(needle)
            if i >= 0:
                found.append((name, what, i))
                break
    return found


def check_no_leak(data, where, allow=()):
    found = leaks(data, allow)
    if found:
        name, what, i = found[0]
        raise it.TestFailure("%s (%s) appears in %s; near: %r" % (name, what, where, data[max(0, i - 150):i + 100]))


def check_not_echoed(r, presented):
    """The answer r does not quote the credential the client presented (nor 16 characters of it)."""
    p = presented.encode().lower()
    low = r.entry["raw"].lower()
    for i in range(len(p) - 15):                # (nothing to check in a value under 16 characters)
        check(low.find(p[i:i + 16]) < 0, "%s: the answer quotes the presented key %r: %r"
              % (r.entry["label"], presented, r.entry["raw"][:400]))


def check_search_works():
    """The search finds what it should: a secret, a piece of it upper-cased, its hex, its base64 at
    each alignment."""
    k = ADMIN_KEY.encode()
    for sample in (k, k[3:21].upper(), k.hex().upper().encode(), base64.b64encode(k),
                   base64.b64encode(b"u" + k), base64.urlsafe_b64encode(b"u:" + k)):
        check(leaks(b"<<" + sample + b">>"), "the secret search misses %r" % sample)
    check(not leaks(b"<<" + hashlib.sha256(k).hexdigest().encode() + b">>"), "the search flags a SHA-256")


def check_answers(since=0):
    """Every answer recorded since index `since` is free of secrets (but its allowed ones)."""
    for e in _S["seen"][since:]:
        check_no_leak(e["raw"], "the answer to %s" % e["label"], e["allow"])


# ===== recorded requests ==========================================================================

class RecConn(it.Conn):
    """it.Conn that keeps every byte it receives in self.raw."""

    def __init__(self, port, timeout=30.0):
        super().__init__(port, timeout=timeout)
        self.raw = b""

    def _fill(self, deadline):
        n = len(self.buf)
        try:
            super()._fill(deadline)
        finally:
            self.raw += self.buf[n:]


HEADER_LINE = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*$")
STATUS_LINE = re.compile(rb"^HTTP/1\.1 [1-5][0-9][0-9] [\t\x20-\x7e\x80-\xff]*$")


def check_head(raw, label):
    """raw starts with a well-formed response head: CRLF lines, no control character in a value,
    no injected header name."""
    end = raw.find(b"\r\n\r\n")
    check(end >= 0, "%s: no complete response head in %r" % (label, raw[:300]))
    lines = raw[:end].split(b"\r\n")
    check(STATUS_LINE.match(lines[0]), "%s: malformed status line %r" % (label, lines[0]))
    for line in lines[1:]:
        check(HEADER_LINE.match(line), "%s: malformed header line (a CR, LF or control byte in a value?) %r"
              % (label, line))
        name = line.split(b":", 1)[0].decode().lower()
        check(name not in INJECTED, "%s: the answer carries an injected header %r" % (label, line))


def check_json_body(r, label):
    ct = (r.header("content-type") or "").lower()
    if r.body and ct.startswith("application/json"):
        try:
            json.loads(r.body.decode("utf-8"), strict=True)
        except Exception as e:
            raise it.TestFailure("%s: the JSON body does not parse strictly (%s): %r" % (label, e, r.body[:300]))


def call(plane, method, path, body=None, headers=None, key=None, raw=None, label=None, timeout=30.0):
    """One request on its own connection to the Aux's inference ("inf") or admin ("admin") listener;
    `raw` replaces the serialized request. Records every byte of the answer; checks its head."""
    a = _S["target"] or aux()
    port = a.admin_port if plane == "admin" else a.port
    label = label or "%s %s" % (method, path)
    req = raw if raw is not None else it.http_request(method, path, body, headers, auth=key)
    entry = {"label": label, "raw": b"", "allow": set()}
    with RecConn(port, timeout=timeout) as c:
        try:
            c.send(req)
        except OSError:
            pass            # ltg may answer and close before it read all of a refused request
        try:
            r = c.read_final_response(timeout)
        finally:
            entry["raw"] = c.raw
            _S["seen"].append(entry)
    check_head(c.raw, label)
    check_json_body(r, label)
    r.entry = entry
    return r


@contextlib.contextmanager
def talking_to(a):
    """Within the block, call() (and so every helper below) talks to Aux a, not the main one."""
    _S["target"] = a
    try:
        yield
    finally:
        _S["target"] = None


AUTO = object()


def adm(method, path, body=None, key=ADMIN_KEY, idem=AUTO, if_match=None, headers=None, label=None):
    """A control-plane request (path relative to /v2/llm_token_gateway)."""
    h = {}
    if idem is AUTO:
        idem = it.new_idem("sec") if method in ("POST", "PATCH", "DELETE") else None
    if idem is not None:
        h["Idempotency-Key"] = idem
    if if_match is not None:
        h["If-Match"] = '"%d"' % if_match
    h.update(headers or {})
    return call("admin", method, it.API + path, body, h, key=key, label=label)


def inf(path, body=None, token=None, headers=None, method="POST", label=None, timeout=30.0):
    return call("inf", method, path, body, headers, key=token or main()[1], label=label, timeout=timeout)


def chat(model="Sec-A", token=None, headers=None, label=None, **kw):
    """A chat call; the content is unique (so nothing is a cache hit by accident) unless given."""
    kw.setdefault("content", "secrets %s" % it.new_idem())
    return inf("/v1/chat/completions", it.chat_body(model=model, **kw), token, headers, label=label)


def expect(r, status, what):
    check(r.status == status, "%s: expected %d, got %s" % (what, status, r.brief()))
    return r


def new_group(label, **kw):
    b = {"name": "sec-" + label, "allowed_models": ["Sec-A", "Sec-B"]}
    b.update(kw)
    r = expect(adm("POST", "/token_groups", b, label="create group " + label), 201, "create group " + label)
    return r.json()["data"]["id"]


def new_token(gid, label, idem=None):
    """POST /token_keys: (key id, token, idempotency key). The token may appear in this answer only,
    and there once, in data.token."""
    idem = idem or it.new_idem("sec-key")
    body = {"name": "sec-" + label, "token_group_id": gid}
    r = expect(adm("POST", "/token_keys", body, idem=idem, label="create token key " + label), 201,
               "create token key " + label)
    d = r.json()["data"]
    token = d["token"]
    check(isinstance(token, str) and it.SECRET_RE.match(token), "token %r" % token)
    add_token(label, token)
    r.entry["allow"].add(token)
    check(r.entry["raw"].count(token.encode()) == 1, "the creation answer shows the token more than once: %r"
          % r.entry["raw"][:600])
    head = r.entry["raw"][:r.entry["raw"].find(b"\r\n\r\n")]
    check(not leaks(head), "the token key is in the head of its creation answer: %r" % head)
    return d["id"], token, idem


# ===== the ltg of these tests =====================================================================

def sec_aux(tag, config):
    """it.Aux with the secrets of this file in its environment."""
    return it.Aux(tag, config=config, env=dict(it.H.env, **ENV))


def catalog():
    """The catalog of these tests: mock models (Sec-A, Sec-B), a refusing port (Sec-Down with a
    fallback, Sec-Dead without), the Hostile provider's models, and the two admin keys."""
    prov = {"api_key_env": "LTG_SEC_PROVIDER_KEY"}
    cfg = {
        "providers": {
            "sec-mock": dict(prov, base_url="http://127.0.0.1:%d/v1" % it.H.mock_port),
            "sec-down": dict(prov, base_url="http://127.0.0.1:%d/v1" % it.H.dead_port),
            "sec-hostile": dict(prov, base_url="http://127.0.0.1:%d/v1" % hostile().port),
        },
        "models": {},
        "admin_keys": [{"key_env": "LTG_SEC_ADMIN_KEY", "permissions": ["*"]},
                       {"key_sha256": hashlib.sha256(SHA_ADMIN_KEY.encode()).hexdigest(), "permissions": SHA_PERMS}],
    }
    price = {"input_usd_per_mtok": 0.60, "output_usd_per_mtok": 2.50}
    for alias, prov_name, up in (("Sec-A", "sec-mock", "sec-a"), ("Sec-B", "sec-mock", "sec-b"),
                                 ("Sec-Down", "sec-down", "sec-down"), ("Sec-Dead", "sec-down", "sec-dead")):
        cfg["models"][alias] = dict(price, provider=prov_name, upstream_model=up)
    for alias, up in HX_MODELS.items():
        cfg["models"][alias] = dict(price, provider="sec-hostile", upstream_model=up)
    return cfg


def write_catalog(cfg_or_text):
    text = cfg_or_text if isinstance(cfg_or_text, str) else json.dumps(cfg_or_text, indent=1)
    with open(_S["config"], "w") as f:
        f.write(text)


def config_path():
    """The good catalog's file (written on first use)."""
    if _S["config"] is None:
        _S["config"] = os.path.join(it.H.tmp, "catalog-secrets.json")
        write_catalog(catalog())
    return _S["config"]


def aux():
    """The Aux, started if it is not running (a death since the last call is a failure)."""
    a = _S["aux"]
    if a is None:
        a = _S["aux"] = sec_aux("secrets", config_path())
    if a.proc is not None and a.proc.poll() is not None:
        rc = a.proc.returncode
        a.proc = None
        raise it.TestFailure("the secrets ltg exited with code %r: %s" % (rc, a.text_since_start()[-600:]))
    if a.proc is None:
        a.start()
    return a


def main():
    """(group id, token) of a group allowing every model of the catalog, with a cache and a budget."""
    if _S["main"] is None:
        aux()
        models = list(catalog()["models"])
        gid = new_group("main", allowed_models=models, fallbacks={"Sec-A": ["Sec-B"], "Sec-Down": ["Sec-A"]},
                        cache_ttl=60, max_budget=100)
        _S["main"] = (gid, new_token(gid, "main")[1])
    return _S["main"]


def _cleanup():
    if _S["hostile"] is not None:
        _S["hostile"].stop()


atexit.register(_cleanup)


# ===== a hostile provider =========================================================================

def _chat_json(model):
    return json.dumps({"id": "chatcmpl-hx", "object": "chat.completion", "created": 0, "model": model,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


def _whole(status_line, headers, body):
    return (status_line + b"\r\n" + b"".join(h + b"\r\n" for h in headers)
            + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)


def _stream(headers, model):
    ev = json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": model,
                     "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]})
    out = b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in headers)
    out += b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    for data in ("data: %s\n\n" % ev, "data: [DONE]\n\n"):
        out += b"%x\r\n%s\r\n" % (len(data), data.encode())
    return out + b"0\r\n\r\n"


JSON_CT = b"Content-Type: application/json"
SSE_CT = b"Content-Type: text/event-stream"
ERR_BODY = b'{"error":{"message":"no","type":"invalid_request_error","param":null,"code":null}}'


def _ok(headers, model):
    return _whole(b"HTTP/1.1 200 OK", headers, _chat_json(model))


# alias -> (stream?, answer(upstream model, the Authorization value the provider received)).
HOSTILE = {
    # Bytes a header parser must refuse, in Content-Type: the one provider header ltg passes on.
    "HX-CT-CR": (False, lambda m, a: _ok([JSON_CT + b"\rX-Injected: cr"], m)),
    "HX-CT-LF": (False, lambda m, a: _ok([JSON_CT + b"\nX-Injected: lf"], m)),
    "HX-CT-FOLD": (False, lambda m, a: _ok([JSON_CT, b" X-Injected: fold"], m)),
    "HX-CT-NUL": (False, lambda m, a: _ok([JSON_CT + b"\0X-Injected: nul"], m)),
    "HX-CT-VT": (False, lambda m, a: _ok([JSON_CT + b"\x0bX-Injected: vt"], m)),
    # Well-formed but odd: percent-escapes, 300 bytes >= 0x80.
    "HX-CT-ENC": (False, lambda m, a: _ok([JSON_CT + b"%0d%0aX-Injected: enc"], m)),
    "HX-CT-LONG": (False, lambda m, a: _ok([JSON_CT + b"; p=" + b"\xe9" * 300], m)),
    # Headers ltg must not pass on: cookies, made-up names, the provider key.
    "HX-EXTRA": (False, lambda m, a: _ok([JSON_CT, b"Set-Cookie: s=stolen", b"X-Injected: 1",
                                          b"X-Echo-Auth: " + a], m)),
    "HX-403-EXTRA": (False, lambda m, a: _whole(b"HTTP/1.1 403 Forbidden", [JSON_CT, b"Set-Cookie: a=b",
                                                b"X-Injected: 403", b"WWW-Authenticate: Bearer " + a], ERR_BODY)),
    # CR in the reason phrase and in Retry-After.
    "HX-REASON-CR": (False, lambda m, a: _whole(b"HTTP/1.1 200 OK\rX-Injected: reason", [JSON_CT], _chat_json(m))),
    "HX-RA-CR": (False, lambda m, a: _whole(b"HTTP/1.1 429 Too Many Requests",
                                            [JSON_CT, b"Retry-After: 0\rX-Injected: ra"], ERR_BODY)),
    # The same for a stream.
    "HX-SSE-CR": (True, lambda m, a: _stream([SSE_CT + b"\rX-Injected: sse"], m)),
    "HX-SSE-EXTRA": (True, lambda m, a: _stream([SSE_CT, b"Set-Cookie: s=1", b"X-Injected: sse",
                                                 b"X-Echo-Auth: " + a], m)),
    # A provider whose 401 body quotes the key it was sent (a test of its own).
    "HX-ECHO-401": (False, lambda m, a: _whole(b"HTTP/1.1 401 Unauthorized", [JSON_CT], json.dumps(
        {"error": {"message": "Incorrect API key provided: %s" % a.decode("latin-1"),
                   "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode())),
}


HX_MODELS = {alias: alias.lower() for alias in HOSTILE}      # alias -> its upstream name


class Hostile:
    """A provider on 127.0.0.1 that answers upstream model m with the raw bytes of HOSTILE[alias]
    (one connection per answer, thread per connection). Records the Authorization values it got."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(32)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.auth = []
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, name="hostile-provider", daemon=True)
        self.thread.start()

    def stop(self):
        self.stopping = True
        self.thread.join(5)
        self.sock.close()

    def _serve(self):
        while not self.stopping:
            try:
                c, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c):
        try:
            c.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data and len(data) < 1 << 20:
                d = c.recv(65536)
                if not d:
                    return
                data += d
            head, body = data.split(b"\r\n\r\n", 1)
            m = re.search(rb"(?im)^content-length:[ \t]*(\d+)", head)
            n = int(m.group(1)) if m else 0
            while len(body) < n:
                d = c.recv(65536)
                if not d:
                    return
                body += d
            m = re.search(rb"(?im)^authorization:[ \t]*([^\r\n]*)", head)
            auth = m.group(1) if m else b""
            self.auth.append(auth.decode("latin-1"))
            model = json.loads(body[:n].decode("utf-8")).get("model", "")
            if model.upper() in HOSTILE:
                c.sendall(HOSTILE[model.upper()][1](model, auth))
        except Exception:
            pass
        finally:
            c.close()


def hostile():
    if _S["hostile"] is None:
        _S["hostile"] = Hostile()
    return _S["hostile"]


# ===== the tests ==================================================================================

def today(offset=0):
    return (datetime.datetime.now(datetime.timezone.utc).date() + datetime.timedelta(days=offset)).isoformat()


def key_variants(key):
    """Keys that are not `key` but close to it: what a typo or a truncation presents."""
    return [key + "x", key[:-1], key[:20], key.upper(), key[1:], key[::-1], key + " x"]


@it.test("secrets: control plane, success and every error status: no secret in any answer")
def t_secrets_control_plane():
    since = len(_S["seen"])
    gid, token = main()
    uuid0 = "00000000-0000-4000-8000-000000000000"
    # Successes, with both admin keys.
    expect(adm("GET", "/token_groups"), 200, "list groups")
    expect(adm("GET", "/token_groups/" + gid), 200, "get group")
    expect(adm("GET", "/token_groups", key=SHA_ADMIN_KEY, label="list groups (key_sha256 key)"), 200,
           "list groups with the key_sha256 admin key")
    expect(adm("GET", "/token_keys"), 200, "list keys")
    expect(adm("GET", "/token_keys?token_group_id=" + gid, key=SHA_ADMIN_KEY), 200, "list keys (key_sha256 key)")
    dates = "start_date=%s&end_date=%s" % (today(-1), today(2))
    expect(adm("GET", "/spend/events?" + dates), 200, "spend events")
    expect(adm("GET", "/usage/summary?token_group_id=%s&%s" % (gid, dates)), 200, "usage summary")
    g2 = new_group("cp")
    kid, _, kidem = new_token(g2, "cp")
    expect(adm("GET", "/token_keys/" + kid), 200, "get key")
    # The same Idempotency-Key and body: the first answer again, without the secret (API.md 3.2).
    r = expect(adm("POST", "/token_keys", {"name": "sec-cp", "token_group_id": g2}, idem=kidem,
                   label="replayed token key creation"), 200, "replayed token key creation")
    check("token" not in r.json()["data"], "the replayed creation shows a token: %r" % r.body[:300])
    expect(adm("PATCH", "/token_groups/" + g2, {"name": "sec-cp-2"}, if_match=1), 200, "patch")
    # 400s.
    expect(adm("POST", "/token_groups", {"name": "x", "allowed_models": ["Sec-A"], "retries": {"max_attempts": 9}}),
           400, "invalid retries")
    expect(adm("POST", "/token_groups", '{"name": "x", "allowed_models": [', label="invalid JSON"), 400, "invalid JSON")
    expect(adm("POST", "/token_groups", {"name": "x", "allowed_models": ["Nope"]}), 400, "model_not_in_catalog")
    expect(adm("POST", "/token_groups", {"name": "x", "allowed_models": ["Sec-A"]}, idem=None,
               label="POST without Idempotency-Key"), 400, "no Idempotency-Key")
    # 401: no key, keys close to the real ones, keys of the wrong kind, other schemes.
    expect(adm("GET", "/token_groups", key=None, label="no key"), 401, "no key")
    wrong = key_variants(ADMIN_KEY) + key_variants(SHA_ADMIN_KEY) + [token, PROVIDER_KEY, token[:-1]]
    for i, k in enumerate(wrong):
        r = expect(adm("GET", "/token_groups", key=k, label="admin GET with wrong key %d" % i), 401, "wrong key %d" % i)
        check_not_echoed(r, k)
        r = expect(adm("POST", "/token_groups", {"name": "x", "allowed_models": ["Sec-A"]}, key=k,
                       label="admin POST with wrong key %d" % i), 401, "POST with wrong key %d" % i)
        check_not_echoed(r, k)
    for i, v in enumerate(["Basic " + base64.b64encode(("admin:" + ADMIN_KEY).encode()).decode(),
                           "Token " + ADMIN_KEY, "Bearer", ADMIN_KEY, "Bearer " + ADMIN_KEY + " " + ADMIN_KEY]):
        r = expect(adm("GET", "/token_groups", key=None, headers={"Authorization": v},
                       label="Authorization form %d" % i), 401, "Authorization form %d" % i)
        check_not_echoed(r, v)
    # 403, 404, 405, 409, 412, 428.
    expect(adm("POST", "/token_groups", {"name": "x", "allowed_models": ["Sec-A"]}, key=SHA_ADMIN_KEY,
               label="POST with the read-only key_sha256 key"), 403, "permission_denied")
    expect(adm("GET", "/usage/summary?token_group_id=%s&%s" % (gid, dates), key=SHA_ADMIN_KEY,
               label="usage with the key_sha256 key"), 403, "permission_denied (usage)")
    expect(adm("GET", "/token_groups/" + uuid0), 404, "unknown group")
    expect(adm("GET", "/token_keys/" + uuid0), 404, "unknown key")
    expect(adm("GET", "/nothing-here"), 404, "unknown path")
    expect(adm("PUT", "/token_groups/" + g2, {"name": "x"}), 405, "PUT")
    expect(adm("DELETE", "/token_groups", if_match=1), 405, "DELETE on the collection")
    idem = it.new_idem("sec")
    expect(adm("POST", "/token_groups", {"name": "sec-i1", "allowed_models": ["Sec-A"]}, idem=idem), 201, "create")
    expect(adm("POST", "/token_groups", {"name": "sec-i2", "allowed_models": ["Sec-A"]}, idem=idem), 409,
           "idempotency_conflict")
    expect(adm("PATCH", "/token_groups/" + g2, {"name": "sec-cp-3"}, if_match=1), 412, "stale If-Match")
    expect(adm("PATCH", "/token_groups/" + g2, {"name": "sec-cp-3"}), 428, "no If-Match")
    # 413 (the head only: Content-Length over 8 MiB), 431, and a malformed head, each carrying the admin key.
    big = it.http_request("POST", it.API + "/token_groups", None, {"Content-Length": str(9 << 20),
                          "Idempotency-Key": it.new_idem(), "Content-Type": "application/json"}, auth=ADMIN_KEY)
    expect(call("admin", None, None, raw=big + b'{"name":', label="413 body"), 413, "413")
    long_head = it.http_request("GET", it.API + "/token_groups", None,
                                {"X-Pad-%d" % i: "p" * 500 for i in range(40)}, auth=ADMIN_KEY)
    expect(call("admin", None, None, raw=long_head, label="431 head"), 431, "431")
    bad = it.http_request("GET", it.API + "/token_groups", None, None, auth=ADMIN_KEY)[:-2] + b"no colon here\r\n\r\n"
    expect(call("admin", None, None, raw=bad, label="malformed header line"), 400, "malformed header line")
    expect(adm("DELETE", "/token_keys/" + kid, if_match=1), 200, "revoke")
    expect(adm("DELETE", "/token_groups/" + g2, if_match=2), 200, "delete group")
    check_answers(since)


@it.test("secrets: inference, success and every error: no secret in any answer")
def t_secrets_inference():
    since = len(_S["seen"])
    token = main()[1]
    # Successes; the provider got the provider key (the secret is live).
    expect(chat(), 200, "chat")
    last = it.H.mock_last()
    auth = {k.lower(): v for k, v in last.get("headers", {}).items()}.get("authorization")
    check(auth == "Bearer " + PROVIDER_KEY, "the mock got Authorization %r, not the provider key" % auth)
    r = expect(chat(stream=True, stream_options={"include_usage": True}), 200, "stream")
    check(b"[DONE]" in r.body, "stream: %r" % r.body[-200:])
    expect(inf("/v1/embeddings", {"model": "Sec-B", "input": "secrets"}), 200, "embeddings")
    expect(inf("/v1/models", method="GET"), 200, "models")
    body = it.chat_body(model="Sec-A", content="cache me")
    expect(inf("/v1/chat/completions", body), 200, "cache miss")
    r = expect(inf("/v1/chat/completions", body, label="cache hit"), 200, "cache hit")
    check(r.header("x-ltg-cache") == "hit", "x-ltg-cache %r" % r.header("x-ltg-cache"))
    ik = it.new_idem("sec-inf")
    expect(chat(content="idem", headers={"Idempotency-Key": ik}), 200, "idempotent first")
    r = expect(chat(content="idem", headers={"Idempotency-Key": ik}, label="idempotent replay"), 200, "replay")
    check(r.header("x-ltg-replayed") == "true", "x-ltg-replayed %r" % r.header("x-ltg-replayed"))
    expect(chat(content="other", headers={"Idempotency-Key": ik}), 409, "idempotency_conflict")
    # Failover (Sec-A 503 once, Sec-B answers), a provider that is down (with and without fallback).
    it.H.mock_post("/_mock/script", {"model": "sec-a", "steps": ["status=503"]})
    r = expect(chat(label="failover"), 200, "failover")
    check(r.header("x-ltg-served-model") == "Sec-B", "served by %r" % r.header("x-ltg-served-model"))
    expect(chat(model="Sec-Down", label="down, fallback"), 200, "down with fallback")
    expect(chat(model="Sec-Dead", label="down"), 502, "down")
    # The provider's errors: relayed (401, 403, 400) or failed over and summed up (500 everywhere).
    for st in (401, 403, 400):
        expect(chat(model="Sec-B", directive="status=%d" % st, label="provider %d" % st), st, "provider %d" % st)
    expect(chat(directive="status=500", label="provider 500 on every model"), 500, "500")
    expect(chat(directive="context_length", label="context length"), 400, "context length")
    r = expect(chat(stream=True, directive="cut_after=1", label="cut stream"), 200, "cut stream")
    check(b"stream_interrupted" in r.body, "cut stream: %r" % r.body[-300:])
    expect(chat(directive="head_delay_ms=3000", headers={"x-ltg-deadline": "300"}, label="deadline"), 504, "deadline")
    # Refusals: keys.
    expect(call("inf", "POST", "/v1/chat/completions", it.chat_body(model="Sec-A"), key=None, label="no key"),
           401, "no key")
    g2 = new_group("inf", allowed_models=["Sec-A"])
    kid, t2, _ = new_token(g2, "inf")
    expect(chat(token=t2), 200, "second key")
    expect(adm("DELETE", "/token_keys/" + kid, if_match=1), 200, "revoke")
    expect(chat(token=t2, label="revoked key"), 401, "revoked key")
    for i, k in enumerate(key_variants(token) + [ADMIN_KEY, SHA_ADMIN_KEY, PROVIDER_KEY]):
        check_not_echoed(expect(chat(token=k, label="inference with wrong key %d" % i), 401, "wrong key %d" % i), k)
    basic = "Basic " + base64.b64encode(("u:" + token).encode()).decode()
    r = expect(call("inf", "POST", "/v1/chat/completions", it.chat_body(model="Sec-A"), key=None,
                    headers={"Authorization": basic}, label="Basic auth"), 401, "Basic auth")
    check_not_echoed(r, basic)
    # Refusals: policy.
    g3 = new_group("small", allowed_models=["Sec-A"])
    t3 = new_token(g3, "small")[1]
    expect(chat(model="Sec-B", token=t3, label="model_not_allowed"), 403, "model_not_allowed")
    t4 = new_token(new_group("blocked", blocked=True), "blocked")[1]
    expect(chat(token=t4, label="group_blocked"), 403, "group_blocked")
    t5 = new_token(new_group("broke", max_budget=0), "broke")[1]
    expect(chat(token=t5, label="budget_exceeded"), 403, "budget_exceeded")
    t6 = new_token(new_group("narrow", max_parallel_requests=1), "narrow")[1]
    check_parallel_429(t6)
    # Refusals: the request.
    expect(inf("/v1/chat/completions", '{"model": "Sec-A", "messages": [', label="invalid JSON"), 400, "invalid JSON")
    expect(inf("/v1/chat/completions", {"messages": []}, label="no model"), 400, "no model")
    expect(chat(headers={"x-ltg-max-attempts": "9"}, label="override out of range"), 400, "override")
    expect(inf("/v1/nothing", {}, label="unknown path"), 404, "unknown path")
    expect(inf("/v1/chat/completions", method="GET", label="GET chat"), 405, "GET chat")
    big = it.http_request("POST", "/v1/chat/completions", None, {"Content-Length": str(9 << 20),
                          "Content-Type": "application/json"}, auth=token)
    expect(call("inf", None, None, raw=big + b'{"model":', label="inference 413"), 413, "413")
    long_head = it.http_request("POST", "/v1/chat/completions", None, {"X-Pad-%d" % i: "p" * 500 for i in range(40)},
                                auth=token)
    expect(call("inf", None, None, raw=long_head, label="inference 431"), 431, "431")
    check_answers(since)


def check_parallel_429(token):
    """One request held by the mock (head_delay_ms) and another on the same group: 429."""
    held = {}

    def slow():
        try:
            held["r"] = chat(token=token, directive="head_delay_ms=3000", label="held request")
        except Exception as e:
            held["e"] = e
    n0 = it.H.mock_stats()["requests"]
    th = threading.Thread(target=slow, daemon=True)
    th.start()
    try:
        # Held: it reached the mock, which keeps it 3 s.
        it.wait_until("the held request did not reach the mock", lambda: it.H.mock_stats()["requests"] > n0 or not th.is_alive(),
                      15 * it.SLOW, step=0.02)
        check(th.is_alive(), "the held request ended before a parallel one could be sent: %r"
              % (held.get("e") or held.get("r") and held["r"].brief()))
        r = chat(token=token, label="parallel request")
    finally:
        th.join(30)
    check(r.status == 429, "no 429 too_many_parallel_requests while a request was held: %s" % r.brief())
    check("e" not in held and held.get("r") is not None and held["r"].status == 200,
          "the held request: %r" % (held.get("e") or held.get("r") and held["r"].brief()))


# Bytes a client may put in header values: ltg refuses them (400) or ignores them, never echoes them.
CLIENT_JUNK = [("bare CR", b"a\rSet-Cookie: cr=1"), ("bare LF", b"a\nSet-Cookie: lf=1"),
               ("NUL", b"a\0Set-Cookie: nul=1"), ("fold", b"a\r\n Set-Cookie: fold=1"),
               ("encoded", b"a%0d%0aSet-Cookie:%20enc=1"), ("high bytes", b"\xc3\xa9\xff\xfeX-Injected: hi")]


def raw_request(method, path, token, extra_header, body=None):
    """A request with one header line given as raw bytes."""
    b = b"" if body is None else json.dumps(body).encode()
    return (b"%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n%s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (method.encode(), path.encode(), token.encode(), extra_header, len(b))) + b


@it.test("secrets: CR/LF and junk from clients (headers, path, JSON strings) are never reflected")
def t_secrets_client_crlf():
    since = len(_S["seen"])
    token = main()[1]
    names = [b"Idempotency-Key", b"X-Request-ID", b"x-ltg-backoff", b"x-ltg-max-attempts", b"x-ltg-deadline",
             b"x-ltg-cache", b"If-Match", b"User-Agent"]
    for what, junk in CLIENT_JUNK:
        for name in names:
            req = raw_request("POST", "/v1/chat/completions", token, name + b": " + junk,
                              it.chat_body(model="Sec-A", content="junk %s" % it.new_idem()))
            r = call("inf", None, None, raw=req, label="inference %s: %s" % (name.decode(), what))
            check(r.status in (200, 400), "inference %s %s: %s" % (name.decode(), what, r.brief()))
            req = raw_request("POST", it.API + "/token_groups", ADMIN_KEY, name + b": " + junk,
                              {"name": "sec-junk", "allowed_models": ["Sec-A"]})
            r = call("admin", None, None, raw=req, label="admin %s: %s" % (name.decode(), what))
            check(r.status in (200, 201, 400, 409), "admin %s %s: %s" % (name.decode(), what, r.brief()))
        call("inf", None, None, raw=raw_request("GET", "/v1/models", token, b"X-Extra: " + junk),
             label="extra header: " + what)
    # CR junk after the key in Authorization itself: refused, neither the key nor the junk echoed.
    for plane, key in (("inf", token), ("admin", ADMIN_KEY)):
        req = (b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\rX-Injected: 1\r\n\r\n"
               % ((it.API + "/token_groups" if plane == "admin" else "/v1/models").encode(), key.encode()))
        r = call(plane, None, None, raw=req, label="%s: CR after the key in Authorization" % plane)
        check(r.status in (400, 401), "%s: CR after the key in Authorization: %s" % (plane, r.brief()))
        check_not_echoed(r, key)
    # The client's X-Request-ID is not taken as ltg's.
    r = expect(chat(headers={"X-Request-ID": "client-chosen-id"}), 200, "client X-Request-ID")
    check(r.header("x-request-id") != "client-chosen-id", "ltg reflected the client's X-Request-ID")
    # CR/LF and an injection in the path.
    for path in ("/v1/models%0d%0aSet-Cookie:%20p=1", "/v1/models?x=%0d%0aSet-Cookie:%20q=1",
                 it.API + "/token_groups/%0d%0aSet-Cookie:%20r=1"):
        plane = "admin" if path.startswith(it.API) else "inf"
        call(plane, "GET", path, key=ADMIN_KEY if plane == "admin" else token, label="path " + path)
    # CR/LF inside JSON strings: a model name, a group name, an allowed model, an unknown field's name.
    for model in ("a\r\nSet-Cookie: m=1", "Sec-A\r\nX-Injected: 1", "\u2028Sec-A\u0085", "Sec-A\x00"):
        r = chat(model=model, label="model %r" % model)
        check(r.status in (400, 403, 404), "model %r: %s" % (model, r.brief()))
    r = expect(adm("POST", "/token_groups", {"name": "n\r\nSet-Cookie: g=1", "allowed_models": ["Sec-A"]},
                   label="group name with CR/LF"), 201, "group name with CR/LF")
    g = r.json()["data"]["id"]
    expect(adm("GET", "/token_groups/" + g), 200, "GET the group with CR/LF in its name")
    expect(adm("POST", "/token_groups", {"name": "x", "allowed_models": ["Sec-A\r\nX-Injected: 1"]}), 400,
           "allowed model with CR/LF")
    expect(adm("POST", "/token_groups", {"name": "x", "allowed_models": ["Sec-A"], "x\r\nSet-Cookie: u": 1}), 400,
           "unknown field with CR/LF")
    r = adm("PATCH", "/token_groups/" + g, {"name": "y"}, headers={"If-Match": '"1"\tX-Injected: 1'})
    check(r.status in (400, 412), "If-Match with junk: %s" % r.brief())
    check_answers(since)


@it.test("secrets: headers from a provider (CR/LF, NUL, Set-Cookie, its key) never reach a client")
def t_secrets_provider_headers():
    since = len(_S["seen"])
    hostile().auth.clear()
    for alias, (stream, _) in HOSTILE.items():
        if alias == "HX-ECHO-401":
            continue
        r = chat(model=alias, stream=stream, label="hostile provider " + alias)
        it.log("hostile %s -> %d %r" % (alias, r.status, r.headers))
        check(r.status in (200, 403, 429, 502), "%s: %s" % (alias, r.brief()))
        ct = r.header("content-type") or ""
        check("x-injected" not in ct.lower() or alias == "HX-CT-ENC", "%s: Content-Type %r" % (alias, ct))
    check(hostile().auth and all(a == "Bearer " + PROVIDER_KEY for a in hostile().auth),
          "the hostile provider did not get the provider key: %r" % hostile().auth[:3])
    check_answers(since)


@it.test("secrets: a provider's error body that quotes the provider key: not relayed, not stored")
def t_secrets_provider_echo():
    # API.md 2: the provider key "never reaches a log, a ledger event or a response". A provider
    # that quotes the key it was sent (OpenAI's 401 says "Incorrect API key provided: sk-...", masked;
    # this one does not mask it) puts it in the answer that ltg relays, and an idempotent request
    # keeps that answer in ledger.log for its replays. Its own ltg (and --data), and its answers
    # recorded with the provider key allowed, so that the sweep reports this case here only.
    a = sec_aux("secrets-echo", config_path())
    problems = []
    try:
        a.start()
        with talking_to(a):
            token = new_token(new_group("echo", allowed_models=["HX-ECHO-401"]), "echo")[1]
            ik = it.new_idem("sec-echo")
            for what in ("the answer", "its idempotent replay"):
                r = chat(model="HX-ECHO-401", token=token, content="echo", headers={"Idempotency-Key": ik},
                         label="a provider quoting its key: " + what)
                r.entry["allow"].add(PROVIDER_KEY)
                check(r.status == 401, "%s: %s" % (what, r.brief()))
                if leaks(r.entry["raw"]):
                    problems.append("the provider key is in %s (the provider's 401, relayed): %r"
                                    % (what, r.body[:200]))
        a.stop()
        for path in it.data_files(a.data_dir):
            with open(path, "rb") as f:
                if leaks(f.read()):
                    problems.append("the provider key is in --data file %s" % os.path.basename(path))
    finally:
        a.close()
    check(not problems, "; ".join(problems))


def wait_log(a, needle, count, timeout=20):
    """Wait until a's log (since its start) holds `needle` `count` times; return that text."""
    deadline = time.monotonic() + timeout
    while True:
        text = a.text_since_start()
        if text.count(needle) >= count or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def sighup_line(a, timeout=20):
    """SIGHUP a and return the one log line that it makes."""
    n = a.text_since_start().count("SIGHUP:")
    a.proc.send_signal(signal.SIGHUP)
    text = wait_log(a, "SIGHUP:", n + 1, timeout)
    lines = [l for l in text.splitlines() if "SIGHUP:" in l]
    check(len(lines) > n, "no log line about the SIGHUP within %d s" % timeout)
    return lines[n]


def sighup(a, needle):
    """SIGHUP a: its log line says `needle` and holds no secret."""
    line = sighup_line(a)
    check(needle in line, "after SIGHUP: %r, want %r" % (line, needle))
    check_no_leak(line.encode(), "the log line of a SIGHUP")


def bad_catalogs():
    """(what, catalog) that a reload must refuse: one wrong field each, or not JSON."""
    good = catalog()
    out = []
    c = json.loads(json.dumps(good))
    c["providers"]["sec-mock"]["api_key_env"] = "LTG_SEC_NOT_SET"
    out.append(("unset api_key_env", c))
    c = json.loads(json.dumps(good))
    c["admin_keys"][1]["key_sha256"] = hashlib.sha256(SHA_ADMIN_KEY.encode()).hexdigest()[:63] + "g"
    out.append(("bad key_sha256", c))
    c = json.loads(json.dumps(good))
    c["models"]["Sec-A"]["input_usd_per_mtok"] = -1
    out.append(("negative price", c))
    out.append(("invalid JSON", json.dumps(good)[:-40]))
    return out


@it.test("secrets: SIGHUP (taken, refused), SIGKILL and a restart on torn logs, replays after it")
def t_secrets_crash():
    since = len(_S["seen"])
    a = aux()
    token = main()[1]
    # Reloads: refused ones keep the old catalog, the good one is taken.
    try:
        for what, cfg in bad_catalogs():
            write_catalog(cfg)
            sighup(a, "refused")
            expect(chat(label="after a refused SIGHUP (%s)" % what), 200, "after a refused reload (%s)" % what)
    finally:
        write_catalog(catalog())
    sighup(a, "taken")
    expect(chat(label="after a taken SIGHUP"), 200, "after a taken reload")
    # State to replay: a key created with an Idempotency-Key, an idempotent chat, a revoked key.
    g = new_group("crash", allowed_models=["Sec-A", "Sec-B"], cache_ttl=60)
    _, t, kidem = new_token(g, "crash")
    ik = it.new_idem("sec-crash")
    first = expect(chat(token=t, content="before the crash", headers={"Idempotency-Key": ik}), 200, "idempotent chat")
    rid, rtok, _ = new_token(g, "crash-revoked")
    expect(adm("DELETE", "/token_keys/" + rid, if_match=1), 200, "revoke")
    # SIGKILL with a stream in flight, then torn tails on both logs.
    with RecConn(a.port) as c:
        c.send(it.http_request("POST", "/v1/chat/completions",
                               it.chat_body(model="Sec-A", stream=True, directive="event_delay_ms=300 events=30"),
                               {"Idempotency-Key": it.new_idem("sec-kill")}, auth=t))
        head = c.read_head(20)
        check(head.status == 200, "the stream before the kill: %d" % head.status)
        c.read_chunk(time.monotonic() + 20)
        a.kill()
        c.wait_closed(5)
        _S["seen"].append({"label": "a stream cut by SIGKILL", "raw": c.raw, "allow": set()})
        check_head(c.raw, "a stream cut by SIGKILL")
    for path in it.data_files(a.data_dir):   # state.log and the ledger's open day
        if path.endswith(".log"):
            with open(path, "ab") as f:
                f.write(b"\x00\x01\x02")
    check_data(a.data_dir)
    a.start()
    text = a.text_since_start()
    check("torn" in text, "no warning about the torn tails: %r" % text[-600:])
    # Replays after the restart: the key creation (200, no token), the chat (replayed), the keys.
    r = expect(adm("POST", "/token_keys", {"name": "sec-crash", "token_group_id": g}, idem=kidem,
                   label="key creation replayed after the crash"), 200, "key creation replayed after the crash")
    check("token" not in r.json()["data"], "the replayed creation shows a token: %r" % r.body[:300])
    r = expect(chat(token=t, content="before the crash", headers={"Idempotency-Key": ik},
                    label="idempotent chat replayed after the crash"), 200, "replay after the crash")
    check(r.header("x-ltg-replayed") == "true" and r.body == first.body, "not replayed: %r %r"
          % (r.header("x-ltg-replayed"), r.body[:200]))
    expect(chat(token=t), 200, "the key after the crash")
    expect(chat(token=rtok, label="revoked key after the crash"), 401, "the revoked key after the crash")
    expect(chat(token=token), 200, "the main key after the crash")
    check_answers(since)


def check_data(d):
    files = it.data_files(d)
    names = set(os.path.basename(f) for f in files)
    days = [n for n in names if re.match(r"^\d{4}-\d\d-\d\d\.log$", n)]
    check("state.log" in names and days, "--data %s holds %r, not state.log and a day of the ledger" % (d, names))
    for path in files:
        with open(path, "rb") as f:
            check_no_leak(f.read(), "--data file %s" % os.path.relpath(path, d))


@it.test("secrets: a key given where a variable name belongs is not logged (start-up and SIGHUP)")
def t_secrets_misconfig():
    # An operator's likely slip: the key itself in api_key_env or key_env (the name of a variable
    # is asked for). ltg refuses the catalog and names the field; the log must not carry the key.
    path = os.path.join(it.H.tmp, "catalog-secrets-misconfig.json")
    good = catalog()
    slips = []
    c = json.loads(json.dumps(good))
    c["providers"]["sec-mock"]["api_key_env"] = PROVIDER_KEY
    slips.append(("the provider key in api_key_env", c))
    c = json.loads(json.dumps(good))
    c["admin_keys"][0]["key_env"] = ADMIN_KEY
    slips.append(("the admin key in key_env", c))
    c = json.loads(json.dumps(good))
    c["admin_keys"][1]["key_sha256"] = SHA_ADMIN_KEY
    slips.append(("the admin key in key_sha256", c))
    a = sec_aux("secrets-misconfig", path)
    problems = []
    try:
        for what, cfg in slips:
            with open(path, "w") as f:
                json.dump(cfg, f)
            rc, out = a.start_fails()
            check(rc != 0, "%s: ltg started" % what)
            if leaks(out.encode()):
                problems.append("start-up with %s logs it: %r" % (what, out.strip()[-300:]))
        with open(path, "w") as f:
            json.dump(good, f)
        a.start()
        for what, cfg in slips:
            with open(path, "w") as f:
                json.dump(cfg, f)
            line = sighup_line(a)
            check("refused" in line, "%s: SIGHUP: %r" % (what, line))
            if leaks(line.encode()):
                problems.append("SIGHUP with %s logs it: %r" % (what, line))
        a.stop()
    finally:
        a.close()
    check(not problems, "; ".join(problems))


@it.test("secrets: ltg's log, every --data file and every answer are free of secrets (after SIGTERM)")
def t_secrets_sweep():
    check_search_works()
    a = aux()
    main()
    a.stop()                      # SIGTERM: exit 0 (checked by Aux.stop)
    text = a.text_since_start()
    check("stopped" in text, "no \"stopped\" line after SIGTERM: %r" % text[-300:])
    check_data(a.data_dir)
    a.log.flush()
    with open(a.log_path, "rb") as f:
        check_no_leak(f.read(), "ltg's stdout+stderr (%s)" % a.log_path)
    check_answers(0)
    check(len(_S["seen"]) > 0, "no answer was recorded")
    _S["aux"] = None
    _S["main"] = None
    a.close()                     # fails on a sanitizer report in its log


if __name__ == "__main__":   # this file alone: python3 tests/integration_secrets.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
