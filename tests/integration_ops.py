"""Integration tests: what an operator sees and runs -- the access log (one JSON line per request,
--access-log FILE|off, reopened on SIGUSR1), --metrics-auth, --version and --help, and a failed
start that leaves nothing behind (README "Running it in production" and "Observability").

Every test runs its own ltg (it.Aux) so that the log it reads holds its requests alone.
Runs alone: python3 tests/integration_ops.py --ltg ./ltg --mock tests/mock
"""

import json
import os
import signal
import socket
import subprocess
import time

import integration as it

check = it.check
FIELDS = ("ts", "request_id", "trace_id", "client", "plane", "method", "path", "status", "ms", "bytes_in", "bytes_out", "token_key_id",
          "token_group_id", "requested_model", "served_model", "client_api", "attempts", "input_tokens", "cache_read_tokens",
          "cache_write_tokens", "cache_write_1h_tokens", "output_tokens", "reasoning_tokens", "cost", "usage_status", "cache")


def access_lines(path, want, timeout=15.0):
    """The JSON lines of the access log at `path` but the harness's health probes, once there are at
    least `want` (bounded wait: ltg writes them at the end of a loop turn)."""
    deadline = time.monotonic() + timeout * it.SLOW
    while True:
        lines = []
        if os.path.exists(path):
            with open(path) as f:
                lines = [json.loads(l) for l in f.read().splitlines() if l.strip()]
            lines = [l for l in lines if l["path"] not in ("/healthz", "/readyz")]
        if len(lines) >= want or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def access_ltg(tag):
    """An Aux (not started) with --access-log naming a file of its own: (the Aux, the file's path)."""
    path = os.path.join(it.H.tmp, "%s-%d.log" % (tag, os.getpid()))
    return it.Aux(tag, args=["--access-log", path]), path


def provision(a):
    g = it.create_group(it.group_body(cache_ttl=300), port=a.admin_port)
    k, token = it.create_key(g["id"], port=a.admin_port)
    return g, k, token


@it.test("access log: one JSON line per request on both planes, with the request's facts and never a secret")
def t_access_log():
    a, path = access_ltg("access-log")
    with it.running(a):
        g, k, token = provision(a)
        body = it.chat_body(content="an access log test")
        ok = it.one_request(a.port, "POST", "/v1/chat/completions", body, auth=token)
        check(ok.status == 200, "the chat call: %d" % ok.status)
        hit = it.one_request(a.port, "POST", "/v1/chat/completions", body, auth=token)
        check(hit.header("x-ltg-cache") == "hit", "the second call was not a cache hit")
        bad = it.one_request(a.port, "GET", "/v1/models", auth="ltg_sk_" + "x" * 43)
        check(bad.status == 401, "a bad key: %d" % bad.status)
        lst = it.admin("GET", "/token_keys?token_group_id=" + g["id"], port=a.admin_port)
        check(lst.status == 200, "the admin list: %d" % lst.status)
        # A client that leaves before its answer: 499.
        n0 = it.H.mock_stats()["requests"]
        s = socket.create_connection(("127.0.0.1", a.port))
        s.sendall(it.http_request("POST", "/v1/chat/completions", it.chat_body(directive="head_delay_ms=3000"), auth=token))
        it.wait_until("the request of the client that leaves did not reach the mock",
                      lambda: it.H.mock_stats()["requests"] > n0, 15 * it.SLOW, step=0.05)
        s.close()
        # A big request, then a head that does not parse, pipelined: the second line must not
        # read the first request's target (its bytes are gone; under ASan, a report).
        s = socket.create_connection(("127.0.0.1", a.port))
        big = b"x" * (1536 * 1024)     # not JSON: 400; its body is read, since the key may send one
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                  b"Content-Length: %d\r\n\r\n" % (token.encode(), len(big)) + big + b"\x01\r\n\r\n")
        s.settimeout(20)
        got = b""
        while got.count(b"HTTP/1.1 ") < 2:
            d = s.recv(65536)
            if not d:
                break
            got += d
        s.close()
        check(got.count(b"HTTP/1.1 400") == 2, "the pipelined pair: %r" % got[:300])
        lines = access_lines(path, 2 + 2 + 1 + 1 + 1 + 2)     # provisioning, chat x2, 401, list, 499, the pair
        bad_head = [l for l in lines if l["status"] == 400 and l["path"] is None]
        check(len(bad_head) == 1 and bad_head[0]["method"] == "", "the unparsed head's line: %r" % bad_head)
        lines = [l for l in lines if l["status"] not in (400, 404)]
        check(len(lines) == 7, "%d access log lines, want 7: %r" % (len(lines), lines))
        for l in lines:
            check(tuple(l) == FIELDS, "the fields of a line: %r" % list(l))
            check("?" not in (l["path"] or ""), "a query in the logged path: %r" % l["path"])
        text = open(path).read()
        for secret in (token, it.ADMIN_KEY, it.PROVIDER_KEY, "an access log test", "Hello from"):
            check(secret not in text, "the access log holds %r" % secret[:12])
        by_status = {}
        for l in lines:
            by_status.setdefault((l["plane"], l["status"]), []).append(l)
        first = by_status[("inference", 200)][0]
        check(first["request_id"] == ok.header("x-ltg-request-id"), "the request id: %r" % first["request_id"])
        check(first["method"] == "POST" and first["path"] == "/v1/chat/completions", "method, path: %r" % first)
        check(first["token_key_id"] == k["id"] and first["token_group_id"] == g["id"], "the key and group: %r" % first)
        check(first["requested_model"] == "Kimi-K3" and first["served_model"] == "Kimi-K3" and first["attempts"] == 1,
              "the models and attempts: %r" % first)
        check(first["cache"] == "miss" and first["input_tokens"] > 0 and first["output_tokens"] > 0 and first["cost"] > 0 and
              first["usage_status"] == "reported" and first["cache_read_tokens"] == 0, "the usage of the first call: %r" % first)
        check(first["bytes_in"] > len(json.dumps(body)) and first["bytes_out"] >= len(ok.body), "the bytes: %r" % first)
        again = by_status[("inference", 200)][1]
        check(again["cache"] == "hit" and again["attempts"] == 0 and again["cost"] == 0, "the cache hit: %r" % again)
        refused = by_status[("inference", 401)][0]
        check(refused["token_key_id"] is None and refused["attempts"] is None and refused["path"] == "/v1/models",
              "the refused call: %r" % refused)
        adm = [l for l in lines if l["plane"] == "admin"]
        check(len(adm) == 3 and adm[-1]["path"] == "/v2/llm_token_gateway/token_keys" and adm[-1]["method"] == "GET",
              "the admin lines: %r" % adm)
        gone = by_status.get(("inference", 499))
        check(gone and gone[0]["requested_model"] == "Kimi-K3" and gone[0]["served_model"] is None,
              "the client that left: %r" % by_status)
        check(not [l for l in a.text_since_start().splitlines() if l.startswith("{")],
              "JSON lines on stderr although --access-log names a file")


@it.test("access log: SIGUSR1 reopens the file (logrotate); a failed reopen keeps the old one; off is off")
def t_access_log_reopen():
    a, path = access_ltg("access-reopen")
    try:
        a.start()
        it.one_request(a.port, "GET", "/v1/models")
        check(len(access_lines(path, 1)) == 1, "no line before the rotation")
        os.rename(path, path + ".1")
        a.proc.send_signal(signal.SIGUSR1)
        it.wait_until("SIGUSR1 did not create a new access log", lambda: os.path.exists(path), 15 * it.SLOW, step=0.05)
        it.one_request(a.port, "GET", "/v1/models")
        check(len(access_lines(path, 1)) == 1 and len(access_lines(path + ".1", 1)) == 1,
              "after the rotation: the new file and the old one should hold one line each")
        # A reopen that fails (the path is now a directory): ltg says so and keeps its file.
        os.rename(path, path + ".2")
        os.mkdir(path)
        at = a.log_size()
        a.proc.send_signal(signal.SIGUSR1)
        it.wait_until(lambda: "no log line for a failed reopen: %r" % a.text_since(at),
                      lambda: "stays the file it was" in a.text_since(at), 15 * it.SLOW, step=0.05)
        it.one_request(a.port, "GET", "/v1/models")
        check(len(access_lines(path + ".2", 2)) == 2, "the line after a failed reopen is not in the file ltg had")
        a.stop()
        os.rmdir(path)
        # --access-log off: no line anywhere.
        a.args = ["--access-log", "off"]
        a.start()
        it.one_request(a.port, "GET", "/v1/models")
        it.one_request(a.port, "GET", "/healthz", auth=None)
        a.stop()
        check(not [l for l in a.text_since_start().splitlines() if l.startswith("{")], "--access-log off still logs")
        # A file that cannot be opened stops the start, naming it.
        a.args = ["--access-log", os.path.join(it.H.tmp, "no-such-dir", "access.log")]
        rc, text = a.start_fails()
        check(rc == 1 and "--access-log" in text and "no-such-dir" in text, "an unopenable access log: rc %r %r" % (rc, text[-300:]))
    finally:
        a.close()


@it.test("--metrics-auth: /metrics then needs an admin key with llm_token_gateway.metrics.read")
def t_metrics_auth():
    a = it.Aux("metrics-auth", args=["--metrics-auth"])
    try:
        a.start()
        r = it.one_request(a.admin_port, "GET", "/metrics", auth=None)
        check(r.status == 401, "no key: %d" % r.status)
        r = it.one_request(a.admin_port, "GET", "/metrics", auth=it.limited_key("spend"))
        check(r.status == 403 and b"llm_token_gateway.metrics.read" in r.body, "a key without the permission: %d %r" % (r.status, r.body[:200]))
        for key in (it.limited_key("metrics"), it.ADMIN_KEY):
            r = it.one_request(a.admin_port, "GET", "/metrics", auth=key)
            check(r.status == 200 and b"ltg_build_info" in r.body, "a key with it: %d" % r.status)
        a.stop()
    finally:
        a.close()
    r = it.one_request(it.H.admin_port, "GET", "/metrics", auth=None)
    check(r.status == 200 and r.header("content-type").startswith("text/plain; version=0.0.4"),
          "without --metrics-auth, /metrics needs no key: %d %r" % (r.status, r.header("content-type")))


@it.test("--version and --help print to stdout and exit 0; a bad option exits 2 with the usage")
def t_version_help():
    ltg = it.H.ltg_bin
    v = subprocess.run([ltg, "--version"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
    check(v.returncode == 0 and v.stdout.decode().startswith("ltg ") and v.stdout.count(b"\n") == 1 and not v.stderr,
          "--version: rc %d %r %r" % (v.returncode, v.stdout, v.stderr))
    h = subprocess.run([ltg, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
    out = h.stdout.decode()
    check(h.returncode == 0 and not h.stderr, "--help: rc %d %r" % (h.returncode, h.stderr))
    for opt in ("--config FILE", "--data DIR", "--access-log", "--metrics-auth", "--listen", "--admin-listen",
                "--ledger-days", "--version"):
        check(opt in out, "--help does not mention %s" % opt)
    check("[--data" not in out, "--help shows --data as optional")
    for argv, what in ((["--bogus"], "unknown option --bogus"), (["--config"], "--config needs a value"),
                       (["--config", "x"], "--data DIR is required"), (["--max-conns", "0"], "--max-conns")):
        p = subprocess.run([ltg] + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
        err = p.stderr.decode()
        check(p.returncode == 2 and what in err and not p.stdout, "ltg %s: rc %d %r" % (" ".join(argv), p.returncode, err[:300]))


@it.test("a failed start (the port is taken) leaves no --data directory behind")
def t_failed_start_no_data():
    a = it.Aux("busy-port", ports=(it.H.port, it.H.admin_port))
    a.data_dir = os.path.join(it.H.tmp, "never-made", "data")
    try:
        rc, text = a.start_fails()
        check(rc == 1 and "Address already in use" in text, "a busy port: rc %r %r" % (rc, text[-300:]))
        check(not os.path.exists(os.path.join(it.H.tmp, "never-made")), "the failed start created --data")
    finally:
        a.close()


if __name__ == "__main__":   # this file alone: python3 tests/integration_ops.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
