"""Integration tests: HTTP details found by acceptance checks (issue #12, point 8).

tests/integration.py imports this file at start-up and runs its tests with the others; to run only
these:

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k "http:"

1. An answer to HEAD never carries a body, whatever its status, on both listeners (RFC 9110 9.3.2):
   the request pipelined after it is answered in its own right.
2. An absolute-form target (RFC 9112 3.2.2) is served as its path.
3. x-ltg-cost and x-ltg-budget-remaining on every non-streaming chat answer: a success, a refusal
   before dispatch, and the gateway's own error after every attempt failed.
4. An HTTP/1.0 client that asks for keep-alive is told so and kept; one that does not is closed.
5. A request refused for its size (413, 431) reaches a client that is still sending: ltg reads and
   drops what follows for a moment before it closes (no reset swallows the answer).
6. --data whose parents do not exist is created.
"""

import integration as it

import json
import os
import socket
import time

check = it.check


def raw_head(port, method, path, auth=None):
    return it.http_request(method, path, auth=auth)


@it.test("http: an answer to HEAD has no body, whatever its status, on both listeners; the next request is framed right")
def t_http_head():
    H = it.H
    cases = [(H.port, "/v1/models", None, 405), (H.port, "/nowhere", it.TOKEN, 404), (H.port, "/v1/chat/completions", it.TOKEN, 405),
             (H.port, "/healthz", None, 200), (H.port, "/readyz", None, 200), (H.admin_port, it.API + "/token_groups", None, 401),
             (H.admin_port, it.API + "/nowhere", it.ADMIN_KEY, 404), (H.admin_port, "/healthz", None, 200)]
    for port, path, auth, status in cases:
        with it.Conn(port) as c:
            c.send(it.http_request("HEAD", path, auth=auth) + it.http_request("GET", "/healthz", auth=None))
            head = c.read_head(10)
            check(head.status == status, "HEAD %s: %d, want %d" % (path, head.status, status))
            n = int(head.header("content-length") or 0)
            check(n > 0 or status == 200, "HEAD %s: Content-Length %d (the length a GET would have)" % (path, n))
            r = c.read_final_response(10)   # the next answer starts right after the head
            check(r.status == 200 and r.json() == {"status": "ok"}, "after HEAD %s the next answer is %s" % (path, r.brief()))


@it.test("http: an absolute-form request target is served as its path (RFC 9112 3.2.2)")
def t_http_absolute_form():
    H = it.H
    with it.Conn(H.port) as c:
        c.send(it.http_request("GET", "http://127.0.0.1:%d/v1/models" % H.port))
        r = c.read_final_response(10)
        check(r.status == 200 and r.json().get("object") == "list", "GET http://.../v1/models: %s" % r.brief())
        c.send(it.http_request("POST", "HTTP://localhost/v1/chat/completions?x=1", it.chat_body()))
        r = c.read_final_response(15)
        check(r.status == 200, "POST HTTP://localhost/v1/chat/completions?x=1: %s" % r.brief())
    with it.Conn(H.admin_port) as c:
        c.send(it.http_request("GET", "http://example.com%s/token_groups?page[size]=1" % it.API, auth=it.ADMIN_KEY))
        r = c.read_final_response(10)
        check(r.status == 200, "an absolute-form control-plane GET: %s" % r.brief())
    r, closed, _ = raw(H.port, b"GET http:/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    check(r is not None and r.status == 400 and closed, "a malformed absolute form: %s" % (r and r.brief()))


def raw(port, data, timeout=10):
    with it.Conn(port, timeout=timeout) as c:
        c.send(data)
        try:
            r = c.read_final_response(timeout)
        except EOFError:
            return None, True, c.buf
        return r, c.wait_closed(5), c.buf


@it.test("http: x-ltg-cost and x-ltg-budget-remaining on every non-streaming chat answer, refusals and "
         "gateway errors included")
def t_http_cost_headers():
    gid = it.create_group(it.group_body(name="cost-headers", allowed_models=["Kimi-K3", "GLM-5.3-Flash"],
                                        fallbacks={"Kimi-K3": ["GLM-5.3-Flash"]}, max_budget=5))["id"]
    token = it.create_key(gid)[1]
    cases = [("a success", it.chat_body(), 200),
             ("a model the group may not call", it.chat_body(model="Down-Model"), 403),
             ("an invalid max_tokens", it.chat_body(max_tokens=0), 400),
             ("every attempt failed", it.chat_body(directive="status=503"), 503)]
    for what, body, status in cases:
        r = it.one_request(it.H.port, "POST", "/v1/chat/completions", body, auth=token, timeout=30)
        check(r.status == status, "%s: %s, want %d" % (what, r.brief(), status))
        cost = r.header("x-ltg-cost")
        left = r.header("x-ltg-budget-remaining")
        check(cost is not None and float(cost) >= 0, "%s: x-ltg-cost %r" % (what, cost))
        check(status == 200 or float(cost) == 0, "%s: it cost %r" % (what, cost))
        check(left is not None and 0 < float(left) <= 5, "%s: x-ltg-budget-remaining %r" % (what, left))
    r = it.one_request(it.H.port, "POST", "/v1/chat/completions", it.chat_body(), auth="ltg_sk_unknown")
    check(r.status == 401 and r.header("x-ltg-cost") == "0.000000" and r.header("x-ltg-budget-remaining") is None,
          "an unknown key: %s (cost %r, remaining %r)" % (r.brief(), r.header("x-ltg-cost"), r.header("x-ltg-budget-remaining")))


@it.test("http: an HTTP/1.0 client asking for keep-alive is told Connection: keep-alive and kept; one that does not is closed")
def t_http10_keepalive():
    H = it.H
    req = "GET /healthz HTTP/1.0\r\n%s\r\n"
    with it.Conn(H.port) as c:
        for i in range(2):
            c.send(req % "Connection: keep-alive\r\n")
            r = c.read_final_response(10)
            check(r.status == 200 and (r.header("connection") or "").lower() == "keep-alive",
                  "HTTP/1.0 keep-alive request %d: %s, Connection %r" % (i + 1, r.brief(), r.header("connection")))
    with it.Conn(H.port) as c:
        c.send(req % "")
        r = c.read_final_response(10)
        check(r.status == 200 and (r.header("connection") or "").lower() == "close" and c.wait_closed(5),
              "a plain HTTP/1.0 request: %s, Connection %r" % (r.brief(), r.header("connection")))


def refused_while_sending(port, head, more, status):
    """Send `head` and all of `more` before reading a byte: the answer must still be there (a close
    with unread bytes would reset the connection, and the client's kernel would drop the answer)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=15)
    try:
        s.sendall(head + more)
    except OSError as e:
        check(False, "ltg reset the connection while the client was still sending: %r" % e)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            got = s.recv(65536)
            if not got:
                break
            data += got
    except OSError as e:
        data += b" [%r]" % e
    s.close()
    check(data.startswith(b"HTTP/1.1 %d " % status), "the answer to a client still sending: %r, want %d" % (data[:120], status))


@it.test("http: a request refused for its size (413, 431) reaches a client that is still sending",
         ltg_args=("--max-body-mb", "1"))
def t_http_lingering_close():
    H = it.H
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
            "Content-Length: %d\r\n\r\n" % (H.token, 64 << 20)).encode()
    refused_while_sending(H.port, head, b"x" * (48 << 20), 413)    # more than the sockets buffer
    refused_while_sending(H.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ", b"y" * (16 << 20), 431)
    check(it.one_request(H.port, "GET", "/healthz", auth=None).status == 200, "ltg serves after them")


@it.test("http: request ids count nothing: two unauthenticated calls' ids, in any of their digits, "
         "do not tell how many requests came between them")
def t_http_request_ids_random():
    ids = []
    for _ in range(40):
        r = it.one_request(it.H.port, "GET", "/v1/no-such-path", auth=None)
        rid = r.header("x-ltg-request-id") or ""
        it.check(len(rid) == 28 and rid.startswith("req_"), "the id %r" % rid)
        ids.append(int(rid[4:], 16))
    # Any run of 16 or 32 bits that counted would move by a small step from one id to the
    # next (other tests' requests come between); 96 random bits, split so, almost never do.
    for bits in (16, 32):
        for shift in range(0, 96 - bits + 1, 4):
            part = [(v >> shift) & ((1 << bits) - 1) for v in ids]
            steps = [(b - a) % (1 << bits) for a, b in zip(part, part[1:])]
            small = sum(1 for d in steps if d < 64)
            it.check(small < len(steps) // 2, "bits %d..%d of the request ids count: steps %r"
                     % (shift, shift + bits - 1, steps[:10]))


@it.test("http: --data whose parents do not exist is created")
def t_http_data_parents():
    a = it.Aux("data-parents-" + os.urandom(3).hex())
    a.data_dir = os.path.join(it.H.tmp, "no-such-parent-" + os.urandom(3).hex(), "nor-this", "data")
    try:
        a.start()
        check(os.path.isdir(os.path.join(a.data_dir, "ledger")), "no ledger under the created %s" % a.data_dir)
        a.stop()
    finally:
        a.close()


if __name__ == "__main__":   # this file alone: python3 tests/integration_http.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
