"""Integration tests: GET /metrics on the admin listener (API.md 7, Observability), read by hand, by
promtool and by a real Prometheus server.

Loaded by tests/integration.py at start-up (it imports every tests/integration_*.py); the tests
register themselves with the runner's @test and use its harness (it.H) at call time. This file alone:

    python3 tests/integration_metrics.py --ltg ./ltg --mock tests/mock

Isolation. Every test runs its own ltg (it.Aux: the same binary, its own ports, --data and log) whose
catalog is the harness's plus five models of its own (Metrics-TAG-A, -B, -E, -F, -N, upstream
metrics-tag-a...), so that every request, attempt, token and dollar the metrics show was made by
the test, and the mock's per-model call counts are the test's alone. Each test provisions one
token group (with a budget, a cache and the fallback F -> B) and one token key, then sends the
same known traffic on the inference plane (drive()):

    1  chat A, non-stream               200, 1 attempt  (A ok)
    2  chat A, stream                   200, 1 attempt  (A ok)
    3  embeddings E                     200, 1 attempt  (E ok)
    4  GET /v1/models                   200, no attempt
    5  chat A, a body of its own        200, 1 attempt  (A ok), x-ltg-cache: miss
    6  the same body again              200, 0 attempts, x-ltg-cache: hit
    7  chat F, the mock answers 503     200 from the fallback B: 2 attempts (F indeterminate, B ok)
    8  chat N, the mock answers 404     404, 1 attempt  (N unknown_model), no fallback
    9  chat A with a bad token key      401, no attempt
   10  chat with a model that is no alias   403 model_not_allowed, no attempt

What counts as a request in ltg_requests_total (and in ltg_request_duration_seconds): every request
under /v1/ on the inference plane (chat completions, embeddings, models), refused ones (401, 403)
included; not /healthz or /readyz, and nothing on the admin listener (the control plane, /metrics
itself). So the 10 above, and nothing that the harness sends to start ltg or provision the group.

Numbers are compared with what ltg itself says elsewhere: the group's spend (GET /token_groups/ID),
the ledger's event count (GET /spend/events), the response headers (x-ltg-attempts,
x-ltg-served-model, x-ltg-cache) and the calls the mock received.

promtool and prometheus come with the Debian package `prometheus`; when they are missing, the tests
that need them install it (apt-get, as root) or are skipped saying what to install. Every wait is
bounded and generous (a slow, busy 2-core machine); no test asserts a duration.
"""

import collections
import datetime
import http.client
import json
import math
import os
import random
import re
import shutil
import signal
import string
import subprocess
import tempfile
import time
import urllib.parse

import integration as it

check = it.check

CONTENT_TYPE_VERSION = "0.0.4"
MAX_BUDGET = 100.0                      # USD, the test group's budget
LEDGER_WAIT = 15.0                      # s: spend events reach the ledger within 20 ms; generous
SCRAPE_TIMEOUT = 30.0
PROM_WAIT = 60.0                        # s: Prometheus start-up, then until a scrape shows the traffic
PROM_DOWN = 15.0                        # s: a target down (with an error) that long fails the wait early

OUTCOMES = ("ok", "no_work", "indeterminate", "terminal", "unknown_model", "circuit_open")

# The families of API.md 7: name -> (TYPE, the labels every sample carries).
FAMILIES = {
    "ltg_requests_total": ("counter", ("endpoint", "requested_model", "served_model", "status")),
    "ltg_attempts_total": ("counter", ("model", "outcome")),
    "ltg_request_duration_seconds": ("histogram", ("endpoint", "requested_model")),
    "ltg_time_to_first_token_seconds": ("histogram", ("model",)),
    "ltg_tokens_total": ("counter", ("model", "type")),
    "ltg_spend_usd_total": ("counter", ("token_group", "model")),
    "ltg_budget_remaining_usd": ("gauge", ("token_group",)),
    "ltg_reserved_usd": ("gauge", ("token_group",)),
    "ltg_circuit_open": ("gauge", ("model",)),
    "ltg_upstream_connections": ("gauge", ("provider", "state")),
    "ltg_tls_handshakes_total": ("counter", ("provider", "kind")),
    "ltg_client_connections": ("gauge", ("listener",)),
    "ltg_cache_lookups_total": ("counter", ("result",)),
    "ltg_ledger_events_total": ("counter", ()),
    "ltg_log_fsync_seconds": ("histogram", ()),
    "process_resident_memory_bytes": ("gauge", ()),
    "process_open_fds": ("gauge", ()),
    "process_cpu_seconds_total": ("counter", ()),
    "process_start_time_seconds": ("gauge", ()),
    "ltg_build_info": ("gauge", ("version",)),
}
# The label values the contract fixes.
LABEL_DOMAINS = {
    ("ltg_attempts_total", "outcome"): set(OUTCOMES),
    ("ltg_tokens_total", "type"): {"input", "output"},
    ("ltg_upstream_connections", "state"): {"active", "idle"},
    ("ltg_tls_handshakes_total", "kind"): {"full", "resumed"},
    ("ltg_cache_lookups_total", "result"): {"hit", "miss", "bypass"},
}
# Histograms whose buckets run from 5 ms to 300 s (API.md 7).
WIDE_BUCKETS = ("ltg_request_duration_seconds", "ltg_time_to_first_token_seconds")


# ===== the text exposition format 0.0.4 ==============================================================

NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
TYPES = ("counter", "gauge", "histogram", "summary", "untyped")


class Exposition:
    """A parsed exposition: families (# TYPE / # HELP) and samples [(name, labels dict, value)].
    Parsing is strict where Prometheus is: a malformed line, a second TYPE for a family, a TYPE
    after the family's samples, a family's samples not together, or the same series twice is a
    TestFailure (promtool, when present, checks more)."""

    def __init__(self, text):
        self.text = text
        self.types = {}                 # family -> TYPE
        self.helps = {}                 # family -> HELP text
        self.samples = []               # (sample name, labels, value)
        self.family_of = []             # the family of each sample, in order
        seen_series = set()
        done = set()                    # families whose samples ended (another family's came after)
        current = None
        for no, line in enumerate(text.split("\n"), 1):
            if line.strip() == "":
                continue
            where = "line %d %r" % (no, line[:200])
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("TYPE", "HELP"):
                    name = parts[2]
                    check(NAME_RE.fullmatch(name), "%s: bad metric name" % where)
                    if parts[1] == "TYPE":
                        t = parts[3].strip() if len(parts) > 3 else ""
                        check(t in TYPES, "%s: unknown TYPE %r" % (where, t))
                        check(name not in self.types, "%s: a second TYPE line for %s" % (where, name))
                        check(name not in self.family_of, "%s: the TYPE of %s comes after its samples" % (where, name))
                        self.types[name] = t
                    else:
                        check(name not in self.helps, "%s: a second HELP line for %s" % (where, name))
                        self.helps[name] = parts[3] if len(parts) > 3 else ""
                continue
            name, labels, value = parse_sample(line, where)
            fam = self._family(name)
            if fam != current:
                check(fam not in done, "%s: the samples of %s are not together" % (where, fam))
                if current is not None:
                    done.add(current)
                current = fam
            key = (name, frozenset(labels.items()))
            check(key not in seen_series, "%s: the same series twice" % where)
            seen_series.add(key)
            self.samples.append((name, labels, value))
            self.family_of.append(fam)

    def _family(self, name):
        if name in self.types:
            return name
        for suffix in ("_bucket", "_sum", "_count"):
            base = name[:-len(suffix)]
            if name.endswith(suffix) and self.types.get(base) in ("histogram", "summary"):
                if suffix == "_bucket":
                    check(self.types[base] == "histogram", "%s: _bucket samples of a summary" % name)
                return base
        return name                     # untyped

    def series(self, name, match=None):
        """[(labels, value)] of the samples named `name` whose labels include `match`."""
        match = match or {}
        return [(l, v) for n, l, v in self.samples
                if n == name and all(l.get(k) == w for k, w in match.items())]

    def of_family(self, fam):
        return [(n, l, v) for (n, l, v), f in zip(self.samples, self.family_of) if f == fam]

    def total(self, name, match=None):
        return sum(v for _, v in self.series(name, match))

    def one(self, name, match=None, what=None):
        s = self.series(name, match)
        check(len(s) == 1, "%s: want one series %s%s, got %d: %r"
              % (what or name, name, fmt_labels(match or {}), len(s), s[:5]))
        return s[0][1]

    def by(self, name, keys, match=None):
        """{(label values of keys): sum of values} over the non-zero samples named `name`."""
        out = collections.Counter()
        for l, v in self.series(name, match):
            if v != 0:
                out[tuple(l.get(k, "") for k in keys)] += v
        return dict(out)


def fmt_labels(labels):
    return "{%s}" % ",".join('%s="%s"' % kv for kv in sorted(labels.items())) if labels else ""


def parse_sample(line, where):
    """name{labels} value [timestamp] -> (name, labels, value)."""
    m = NAME_RE.match(line)
    check(m, "%s: no metric name" % where)
    name, i, n = m.group(0), m.end(), len(line)
    labels = {}
    if i < n and line[i] == "{":
        i += 1
        while True:
            while i < n and line[i] in " \t":
                i += 1
            check(i < n, "%s: unterminated label set" % where)
            if line[i] == "}":
                i += 1
                break
            lm = LABEL_RE.match(line, i)
            check(lm, "%s: bad label name at column %d" % (where, i + 1))
            lname, i = lm.group(0), lm.end()
            while i < n and line[i] in " \t":
                i += 1
            check(i < n and line[i] == "=", "%s: no = after label %s" % (where, lname))
            i += 1
            while i < n and line[i] in " \t":
                i += 1
            check(i < n and line[i] == '"', "%s: label %s: value not quoted" % (where, lname))
            i += 1
            val = []
            while True:
                check(i < n, "%s: label %s: unterminated value" % (where, lname))
                ch = line[i]
                if ch == "\\":
                    check(i + 1 < n and line[i + 1] in '\\"n', "%s: label %s: bad escape" % (where, lname))
                    val.append("\n" if line[i + 1] == "n" else line[i + 1])
                    i += 2
                elif ch == '"':
                    i += 1
                    break
                else:
                    val.append(ch)
                    i += 1
            check(lname not in labels, "%s: label %s twice" % (where, lname))
            labels[lname] = "".join(val)
            while i < n and line[i] in " \t":
                i += 1
            check(i < n and line[i] in ",}", "%s: label %s: no , or } after the value" % (where, lname))
            if line[i] == ",":
                i += 1
    rest = line[i:].split()
    check(line[i:i + 1] in (" ", "\t") and len(rest) in (1, 2), "%s: want `name{labels} value [timestamp]`" % where)
    try:
        value = float(rest[0])
    except ValueError:
        raise it.TestFailure("%s: value %r is not a number" % (where, rest[0]))
    if len(rest) == 2:
        check(re.fullmatch(r"-?\d+", rest[1]), "%s: timestamp %r is not an integer" % (where, rest[1]))
    return name, labels, value


def check_content_type(ct):
    """text/plain; version=0.0.4, charset=utf-8 allowed."""
    parts = [p.strip() for p in (ct or "").split(";")]
    check(parts[0].lower() == "text/plain", "Content-Type %r, want text/plain; version=0.0.4" % ct)
    params = {}
    for p in parts[1:]:
        k, _, v = p.partition("=")
        params[k.strip().lower()] = v.strip().strip('"')
    check(params.get("version") == CONTENT_TYPE_VERSION, "Content-Type %r: want version=0.0.4" % ct)
    check(set(params) <= {"version", "charset"}, "Content-Type %r: parameters other than version and charset" % ct)
    check(params.get("charset", "utf-8").lower() == "utf-8", "Content-Type %r: charset other than utf-8" % ct)


# ===== what the exposition must show =================================================================

def check_families(ex):
    """Every family of API.md 7 with its TYPE and HELP; every sample with the family's labels and
    the label values the contract fixes; counters >= 0, nothing NaN."""
    missing = [f for f in FAMILIES if f not in ex.types]
    check(not missing, "families missing (no # TYPE line): %s" % ", ".join(missing))
    for fam, (typ, labels) in FAMILIES.items():
        check(ex.types[fam] == typ, "# TYPE %s %s, want %s" % (fam, ex.types[fam], typ))
        check(fam in ex.helps, "no # HELP line for %s (promtool check metrics wants one)" % fam)
        for name, l, v in ex.of_family(fam):
            where = "%s%s %r" % (name, fmt_labels(l), v)
            lacking = [k for k in labels if k not in l]
            check(not lacking, "%s: lacks the label(s) %s" % (where, ", ".join(lacking)))
            check(not math.isnan(v), "%s: NaN" % where)
            if typ == "counter" or name.endswith(("_bucket", "_count")):
                check(v >= 0 and not math.isinf(v), "%s: a counter must be finite and >= 0" % where)
            for (f, k), domain in LABEL_DOMAINS.items():
                if f == fam:
                    check(l.get(k) in domain, "%s: %s=%r is none of %s" % (where, k, l.get(k), sorted(domain)))
    for s_l, v in ex.series("ltg_requests_total"):
        check(re.fullmatch(r"[1-5]\d\d", s_l["status"]), "ltg_requests_total%s: status is not an HTTP status" % fmt_labels(s_l))
    for s_l, v in ex.series("ltg_circuit_open"):
        check(v in (0, 1), "ltg_circuit_open%s %r: want 0 or 1" % (fmt_labels(s_l), v))
    for fam in (f for f, (t, _) in FAMILIES.items() if t == "histogram"):
        check_histogram(ex, fam, wide=fam in WIDE_BUCKETS)


def check_histogram(ex, fam, wide=False):
    """Each series: buckets cumulative, the last one le="+Inf" equal to _count, a _sum; for the wide
    ones the finite bounds run from 0.005 to 300. Returns {labels without le: _count}."""
    counts = {frozenset(l.items()): v for l, v in ex.series(fam + "_count")}
    sums = {frozenset(l.items()): v for l, v in ex.series(fam + "_sum")}
    buckets = collections.defaultdict(list)
    for l, v in ex.series(fam + "_bucket"):
        check("le" in l, "%s_bucket%s: no le label" % (fam, fmt_labels(l)))
        rest = dict(l)
        le = rest.pop("le")
        try:
            bound = float(le)
        except ValueError:
            raise it.TestFailure("%s_bucket%s: le=%r is not a number" % (fam, fmt_labels(l), le))
        check(le != "Inf" and le != "inf", "%s_bucket: write the last bound le=\"+Inf\", not %r" % (fam, le))
        buckets[frozenset(rest.items())].append((bound, le, v))
    check(counts, "%s: no series (no %s_count sample)" % (fam, fam))
    check(set(buckets) == set(counts), "%s: the label sets of _bucket and _count differ: %r vs %r"
          % (fam, sorted(map(sorted, buckets)), sorted(map(sorted, counts))))
    check(set(sums) == set(counts), "%s: the label sets of _sum and _count differ" % fam)
    for key, bs in buckets.items():
        what = "%s%s" % (fam, fmt_labels(dict(key)))
        bs.sort()
        check(len(set(b for b, _, _ in bs)) == len(bs), "%s: a bucket bound twice" % what)
        check(bs[-1][1] == "+Inf", "%s: the last bucket is le=%r, want le=\"+Inf\"" % (what, bs[-1][1]))
        for (b0, _, v0), (b1, le1, v1) in zip(bs, bs[1:]):
            check(v1 >= v0, "%s: buckets not cumulative: le=%s has %r after %r" % (what, le1, v1, v0))
        check(bs[-1][2] == counts[key], "%s: le=\"+Inf\" is %r but _count is %r" % (what, bs[-1][2], counts[key]))
        check(sums[key] >= 0 and not math.isinf(sums[key]), "%s_sum %r" % (what, sums[key]))
        if wide:
            finite = [b for b, _, _ in bs if not math.isinf(b)]
            check(finite and abs(finite[0] - 0.005) < 1e-12 and abs(finite[-1] - 300) < 1e-9,
                  "%s: finite bucket bounds %r, want from 0.005 to 300" % (what, finite))
    return {key: counts[key] for key in counts}


class Traffic:
    """The known traffic that drive() sends on one ltg's inference plane, and what it expects the
    metrics to say of it."""

    def __init__(self, tag):
        self.tag = tag
        self.m = {k: "Metrics-%s-%s" % (tag, k) for k in ("A", "B", "E", "F", "N")}
        self.group_name = "metrics-%s-%s" % (tag, os.urandom(4).hex())
        self.group_id = None
        self.token = None
        self.bad_key = "ltg_sk_" + "".join(random.choice(string.ascii_letters + string.digits) for _ in range(43))
        self.bogus_model = "no-such-model-%s" % os.urandom(4).hex()
        self.requests = 0                               # requests sent under /v1/ on the inference plane
        self.by_status = collections.Counter()          # HTTP status (str) -> requests
        self.attempts = collections.Counter()           # (alias, outcome) -> upstream attempts
        self.header_attempts = 0                        # the sum of x-ltg-attempts
        self.cache = collections.Counter()              # x-ltg-cache value -> answers
        self.request_ids = []
        self.started_wall = None                        # time.time() just before ltg started

    def upstream(self, k):
        return self.m[k].lower()

    def catalog(self):
        cfg = it.catalog_copy()
        for k in self.m:
            cfg["models"][self.m[k]] = it.catalog_model("mock", self.upstream(k), 3.0, 15.0)
        return cfg

    def secrets(self):
        """(what, text) that no byte of the exposition may hold."""
        out = [("the token key's secret", self.token), ("the bad key of the 401", self.bad_key),
               ("the admin key", it.ADMIN_KEY), ("the provider key", it.PROVIDER_KEY),
               ("the model name that is no alias", self.bogus_model)]
        out += [("the request id %s" % rid, rid) for rid in self.request_ids]
        return [(w, s) for w, s in out if s]


def send(a, t, method, path, body=None, auth=None, status=200, attempts=None, served=None, what=""):
    """One inference request, counted in t; checks what the traffic needs (status, x-ltg-attempts,
    x-ltg-served-model): a failure here is about the traffic, not the metrics."""
    r = it.one_request(a.port, method, path, body, auth=auth or t.token, timeout=60)
    t.requests += 1
    t.by_status[str(r.status)] += 1
    check(r.status == status, "the traffic: %s: expected %d, got %s" % (what, status, r.brief()))
    if r.header("x-ltg-request-id"):
        t.request_ids.append(r.header("x-ltg-request-id"))
    if r.header("x-request-id"):
        t.request_ids.append(r.header("x-request-id"))
    if r.header("x-ltg-cache"):
        t.cache[r.header("x-ltg-cache")] += 1
    if r.header("x-ltg-attempts") is not None:
        t.header_attempts += int(r.header("x-ltg-attempts"))
    if attempts is not None:
        check(r.header("x-ltg-attempts") == str(attempts), "the traffic: %s: x-ltg-attempts %r, want %d"
              % (what, r.header("x-ltg-attempts"), attempts))
    if served is not None:
        check(r.header("x-ltg-served-model") == served, "the traffic: %s: x-ltg-served-model %r, want %s"
              % (what, r.header("x-ltg-served-model"), served))
    return r


def chat(t, k, content, **kw):
    return it.chat_body(model=t.m[k], content="%s [%s %s]" % (content, t.tag, os.urandom(4).hex()), **kw)


def drive(a, t):
    """Provision the group and key, send the traffic of the top comment, and check that the mock
    got exactly the upstream calls that the attempts say."""
    m = t.m
    g = it.create_group({"name": t.group_name, "allowed_models": [m[k] for k in "ABEFN"],
                         "fallbacks": {m["F"]: [m["B"]]}, "max_budget": MAX_BUDGET, "budget_duration": "30d",
                         "cache_ttl": 300}, port=a.admin_port)
    t.group_id = g["id"]
    _, t.token = it.create_key(t.group_id, port=a.admin_port)
    before = it.H.mock_stats().get("calls", {})
    check(not any(before.get(t.upstream(k)) for k in m), "the mock already counts calls for this test's models: %r" % before)

    chat_path = "/v1/chat/completions"
    send(a, t, "POST", chat_path, chat(t, "A", "metrics one"), attempts=1, served=m["A"], what="chat A")
    t.attempts[(m["A"], "ok")] += 1
    r = send(a, t, "POST", chat_path, chat(t, "A", "metrics stream", stream=True), attempts=1, served=m["A"],
             what="chat A (stream)")
    check(it.event_data(it.sse_events(r)[-1][1]) == "[DONE]", "the traffic: the stream did not end with [DONE]")
    t.attempts[(m["A"], "ok")] += 1
    send(a, t, "POST", "/v1/embeddings", {"model": m["E"], "input": "metrics"}, attempts=1, served=m["E"],
         what="embeddings E")
    t.attempts[(m["E"], "ok")] += 1
    r = send(a, t, "GET", "/v1/models", what="GET /v1/models")
    ids = sorted(x.get("id") for x in r.json().get("data", []))
    check(ids == sorted(m.values()), "the traffic: GET /v1/models lists %r" % ids)
    cached = chat(t, "A", "metrics cached")
    r = send(a, t, "POST", chat_path, cached, attempts=1, served=m["A"], what="chat A (to be cached)")
    check(r.header("x-ltg-cache") == "miss", "the traffic: the first call of a cached body: x-ltg-cache %r"
          % r.header("x-ltg-cache"))
    t.attempts[(m["A"], "ok")] += 1
    r = send(a, t, "POST", chat_path, cached, attempts=0, served=m["A"], what="chat A (the cached body again)")
    check(r.header("x-ltg-cache") == "hit", "the traffic: the same body again: x-ltg-cache %r, want hit"
          % r.header("x-ltg-cache"))
    it.H.mock_post("/_mock/script", {"model": t.upstream("F"), "steps": ["status=503"]})
    send(a, t, "POST", chat_path, chat(t, "F", "metrics failover"), attempts=2, served=m["B"],
         what="chat F (503) failing over to B")
    t.attempts[(m["F"], "indeterminate")] += 1
    t.attempts[(m["B"], "ok")] += 1
    it.H.mock_post("/_mock/script", {"model": t.upstream("N"), "steps": ["status=404"]})
    r = send(a, t, "POST", chat_path, chat(t, "N", "metrics unknown model"), status=404, attempts=1,
             what="chat N (404 at the provider)")
    check(r.header("x-ltg-served-model") is None, "the traffic: a 404 names a served model")
    t.attempts[(m["N"], "unknown_model")] += 1
    send(a, t, "POST", chat_path, chat(t, "A", "metrics bad key"), auth=t.bad_key, status=401, what="a bad key")
    send(a, t, "POST", chat_path, it.chat_body(model=t.bogus_model), status=403, what="a model that is no alias")

    check(t.header_attempts == sum(t.attempts.values()), "the traffic: x-ltg-attempts add up to %d, the plan "
          "says %d" % (t.header_attempts, sum(t.attempts.values())))
    after = it.H.mock_stats().get("calls", {})
    want = collections.Counter()
    for (alias, outcome), n in t.attempts.items():
        want[alias.lower()] += n
    got = {t.upstream(k): after.get(t.upstream(k), 0) for k in m}
    check(got == {u: want.get(u, 0) for u in got}, "the traffic: the mock got the calls %r, the attempts say %r"
          % (got, dict(want)))


def check_counts(ex, t):
    """ltg_requests_total, ltg_attempts_total and the histograms' counts against the traffic t."""
    m = t.m
    got = ex.total("ltg_requests_total")
    check(got == t.requests, "sum(ltg_requests_total) = %r, but %d requests were sent under /v1/ on the "
          "inference plane (%s)" % (got, t.requests, dict(t.by_status)))
    by_status = {k[0]: v for k, v in ex.by("ltg_requests_total", ["status"]).items()}
    check(by_status == dict(t.by_status), "ltg_requests_total by status %r, want %r" % (by_status, dict(t.by_status)))
    # served_model: the alias that answered, "" when none did.
    rows = ex.by("ltg_requests_total", ["requested_model", "served_model", "status"])
    for (req, served, status), want in (((m["A"], m["A"], "200"), 4), ((m["E"], m["E"], "200"), 1),
                                        ((m["F"], m["B"], "200"), 1), ((m["N"], "", "404"), 1)):
        check(rows.get((req, served, status)) == want,
              "ltg_requests_total{requested_model=%r,served_model=%r,status=%r} = %r, want %d (all: %r)"
              % (req, served, status, rows.get((req, served, status)), want, rows))
    for l, v in ex.series("ltg_requests_total"):
        if l["status"] != "200" and v:
            check(l["served_model"] == "", "ltg_requests_total%s: an error answer has a served_model" % fmt_labels(l))
    # Chat and embeddings are different endpoints.
    ep = lambda req: {l["endpoint"] for l, v in ex.series("ltg_requests_total", {"requested_model": req}) if v}
    check(len(ep(m["A"])) == 1 and len(ep(m["E"])) == 1 and ep(m["A"]) != ep(m["E"]),
          "ltg_requests_total: endpoint of the chat calls %r, of the embeddings call %r: want one each, different"
          % (ep(m["A"]), ep(m["E"])))

    att = ex.by("ltg_attempts_total", ["model", "outcome"])
    check(att == dict(t.attempts), "ltg_attempts_total (non-zero series) %r, want %r" % (att, dict(t.attempts)))

    counts = check_histogram(ex, "ltg_request_duration_seconds", wide=True)
    n = sum(counts.values())
    check(n == t.requests, "ltg_request_duration_seconds: _count adds up to %r, want %d (one per request)" % (n, t.requests))
    by_req = collections.Counter()
    for key, v in counts.items():
        by_req[dict(key).get("requested_model")] += v
    # The 401's requested_model may be "" (the body of an unauthenticated call need not be read).
    check(by_req.get(m["A"], 0) in (4, 5) and by_req.get(m["F"]) == 1,
          "ltg_request_duration_seconds_count by requested_model %r: want 4 (or 5 with the 401) for %s, 1 for %s"
          % (dict(by_req), m["A"], m["F"]))
    ttft = check_histogram(ex, "ltg_time_to_first_token_seconds", wide=True)
    a_ttft = sum(v for key, v in ttft.items() if dict(key).get("model") == m["A"])
    check(a_ttft >= 1, "ltg_time_to_first_token_seconds{model=%r}: _count %r after a stream it served" % (m["A"], a_ttft))


def check_misc(ex, t):
    """Tokens, cache lookups, circuits, connections, the label values, the process and build."""
    m = t.m
    for k in ("A", "B"):
        for typ in ("input", "output"):
            v = ex.total("ltg_tokens_total", {"model": m[k], "type": typ})
            check(v > 0, "ltg_tokens_total{model=%r,type=%r} = %r after calls it served" % (m[k], typ, v))
    check(ex.total("ltg_tokens_total", {"model": m["E"], "type": "input"}) > 0,
          "ltg_tokens_total{model=%r,type=\"input\"}: no tokens after the embeddings call" % m["E"])
    hits = ex.total("ltg_cache_lookups_total", {"result": "hit"})
    check(hits == t.cache["hit"], "ltg_cache_lookups_total{result=\"hit\"} = %r, but %d answer(s) said "
          "x-ltg-cache: hit" % (hits, t.cache["hit"]))
    for res in ("miss", "bypass"):
        if t.cache[res]:
            v = ex.total("ltg_cache_lookups_total", {"result": res})
            check(v >= 1, "ltg_cache_lookups_total{result=%r} = %r, but %d answer(s) said x-ltg-cache: %s"
                  % (res, v, t.cache[res], res))
    check(ex.series("ltg_circuit_open", {"model": m["F"]}),
          "ltg_circuit_open{model=%r}: no series for a model that failed once" % m["F"])
    for k in "ABEFN":
        for l, v in ex.series("ltg_circuit_open", {"model": m[k]}):
            check(v == 0, "ltg_circuit_open%s = %r: no breaker of this test should be open" % (fmt_labels(l), v))
    conns = ex.total("ltg_client_connections")
    check(conns >= 1, "sum(ltg_client_connections) = %r while the scrape's own connection is open" % conns)
    for l, v in ex.series("ltg_upstream_connections") + ex.series("ltg_client_connections"):
        check(v >= 0 and v == int(v), "a connection gauge %s = %r" % (fmt_labels(l), v))

    # Label values are catalog aliases and group names, never a secret, a request id or a client's string.
    cfg = t.catalog()
    aliases, providers = set(cfg["models"]), set(cfg["providers"])
    for name, l, v in ex.samples:
        for k in ("requested_model", "served_model", "model"):
            if k in l:
                check(l[k] in aliases or l[k] == "", "%s%s: %s=%r is not a catalog alias" % (name, fmt_labels(l), k, l[k]))
        if "provider" in l and name.startswith("ltg_"):
            check(l["provider"] in providers, "%s%s: provider=%r is not a catalog provider" % (name, fmt_labels(l), l["provider"]))
    for what, secret in t.secrets():
        check(secret not in ex.text, "the exposition holds %s (%r...)" % (what, secret[:12]))

    # The process.
    rss = ex.one("process_resident_memory_bytes")
    fds = ex.one("process_open_fds")
    cpu = ex.one("process_cpu_seconds_total")
    start = ex.one("process_start_time_seconds")
    check(rss > 100000, "process_resident_memory_bytes %r" % rss)
    check(fds >= 3 and fds == int(fds), "process_open_fds %r" % fds)
    now = time.time()
    check(0 <= cpu <= (now - t.started_wall) * 2 + 10, "process_cpu_seconds_total %r for a process %d s old"
          % (cpu, now - t.started_wall))
    check(t.started_wall - 120 <= start <= now + 5, "process_start_time_seconds %r: ltg was started at %r (Unix time, "
          "seconds)" % (start, t.started_wall))
    bi = ex.series("ltg_build_info")
    check(len(bi) == 1 and bi[0][1] == 1 and bi[0][0].get("version"), "ltg_build_info: want one sample, value 1, "
          "a non-empty version: %r" % bi)
    try:
        p = subprocess.run([it.H.ltg_bin, "--version"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, timeout=30)
        out = p.stdout.decode("utf-8", "replace").strip()
    except (OSError, subprocess.TimeoutExpired):
        p, out = None, ""
    if p is not None and p.returncode == 0 and out.startswith("ltg "):
        check(bi[0][0]["version"] == out[4:].strip(), "ltg_build_info{version=%r}, but ltg --version says %r"
              % (bi[0][0]["version"], out))
    fsync = check_histogram(ex, "ltg_log_fsync_seconds")
    check(sum(fsync.values()) >= 1, "ltg_log_fsync_seconds_count %r after a group and a key were created "
          "(each fsynced before its answer)" % sum(fsync.values()))


def check_group_gauges(ex, t, group):
    """Spend, budget and reservation of the test's group against GET /token_groups/ID (`group`)."""
    name = t.group_name
    spend = float(group["spend"])
    check(spend > 0, "the traffic: the group's spend is %r after paid calls" % spend)
    got = ex.total("ltg_spend_usd_total", {"token_group": name})
    check(ex.series("ltg_spend_usd_total", {"token_group": name}) and abs(got - spend) <= 1e-5,
          "sum(ltg_spend_usd_total{token_group=%r}) = %r, the group's spend is %r (the label is the group's "
          "name)" % (name, got, spend))
    per_model = ex.by("ltg_spend_usd_total", ["model"], {"token_group": name})
    check(set(k[0] for k in per_model) <= {t.m["A"], t.m["B"], t.m["E"]},
          "ltg_spend_usd_total: spend on models that served nothing: %r" % per_model)
    rem = ex.one("ltg_budget_remaining_usd", {"token_group": name})
    check(abs(rem - (MAX_BUDGET - spend)) <= 1e-5, "ltg_budget_remaining_usd{token_group=%r} = %r, want %r - %r"
          % (name, rem, MAX_BUDGET, spend))
    res = ex.one("ltg_reserved_usd", {"token_group": name})
    check(res == 0, "ltg_reserved_usd{token_group=%r} = %r with no request in flight" % (name, res))


def ledger_total(a):
    r = it.admin("GET", "/spend/events?start_date=%s&end_date=%s&page[size]=1" % (day(-1), day(2)), port=a.admin_port)
    return it.check_admin_ok(r, 200, "GET /spend/events")["meta"]["total_results"]


def day(offset):
    return (datetime.datetime.now(datetime.timezone.utc).date() + datetime.timedelta(days=offset)).isoformat()


# ===== scraping ===================================================================================

def scrape(a, what="GET /metrics"):
    """GET /metrics on a's admin listener, no credentials: (Response, Exposition)."""
    with it.Conn(a.admin_port, timeout=SCRAPE_TIMEOUT) as c:
        c.send(it.http_request("GET", "/metrics", auth=None, headers={"Connection": "close"}))
        r = c.read_final_response(SCRAPE_TIMEOUT)
    check(r.status == 200, "%s on the admin listener, no credentials: %s" % (what, r.brief()))
    check_content_type(r.header("content-type"))
    try:
        text = r.body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise it.TestFailure("%s: the body is not UTF-8: %s" % (what, e))
    check(text.endswith("\n"), "%s: the body does not end with a newline" % what)
    return r, Exposition(text)


def counter_values(ex):
    """{(sample name, labels): value} of every counter sample and histogram count, bucket and sum."""
    out = {}
    for (name, l, v), fam in zip(ex.samples, ex.family_of):
        if ex.types.get(fam) in ("counter", "histogram"):
            out[(name, frozenset(l.items()))] = v
    return out


def sighup(a, timeout=20):
    """SIGHUP a (same catalog): wait for its log line saying the config was taken."""
    n = a.text_since_start().count("SIGHUP:")
    a.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + timeout * it.SLOW
    while True:
        lines = [l for l in a.text_since_start().splitlines() if "SIGHUP:" in l]
        if len(lines) > n or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    check(len(lines) > n, "no log line about the SIGHUP within %d s" % timeout)
    check("taken" in lines[n], "the SIGHUP on an unchanged catalog: %r" % lines[n])


def with_ltg(tag, fn):
    """Run fn(aux, traffic) on an ltg of its own with this file's catalog; it must exit 0 on SIGTERM
    and log no sanitizer report."""
    t = Traffic(tag)
    a = it.Aux("metrics-" + tag, config=it.write_catalog(t.catalog(), "metrics-" + tag))
    try:
        t.started_wall = time.time()
        a.start()
        fn(a, t)
        a.stop()
    finally:
        a.close()


def scrape_with_ledger(a, t):
    """Scrape until ltg_ledger_events_total matches the ledger's event count (events reach the
    ledger at the end of a loop turn; bounded); check it matches; return (Response, Exposition)."""
    want = ledger_total(a)
    deadline = time.monotonic() + LEDGER_WAIT
    while True:
        r, ex = scrape(a)
        got = ex.total("ltg_ledger_events_total") if "ltg_ledger_events_total" in ex.types else None
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
        want = ledger_total(a)
    check(got == want, "ltg_ledger_events_total = %r, the ledger holds %d event(s)" % (got, want))
    return r, ex


# ===== the tests ==================================================================================

@it.test("metrics: GET /metrics after known traffic: families, types, counts, histograms, no secrets; "
         "counters survive SIGHUP")
def t_metrics_exposition():
    def body(a, t):
        drive(a, t)
        group = it.get_group(t.group_id, port=a.admin_port)[0]
        r, ex = scrape_with_ledger(a, t)
        check_families(ex)
        check_counts(ex, t)
        check_group_gauges(ex, t, group)
        check_misc(ex, t)
        # The credentials of the control plane are not needed, and the scrapes count as nothing.
        r2, ex2 = scrape(a, "a second GET /metrics")
        check(ex2.total("ltg_requests_total") == t.requests, "a scrape changed sum(ltg_requests_total): %r -> %r"
              % (ex.total("ltg_requests_total"), ex2.total("ltg_requests_total")))

        # SIGHUP: a reload keeps every counter.
        before = counter_values(ex2)
        sighup(a)
        _, ex3 = scrape(a, "GET /metrics after SIGHUP")
        check_families(ex3)
        after = counter_values(ex3)
        lost = [(n, dict(l)) for (n, l) in before if (n, l) not in after]
        check(not lost, "after SIGHUP these counter series are gone: %r" % lost[:5])
        down = [(n, dict(l), before[(n, l)], after[(n, l)]) for (n, l) in before if after[(n, l)] < before[(n, l)]]
        check(not down, "after SIGHUP these counters went down (reset?): %r" % down[:5])
        check(ex3.total("ltg_requests_total") == t.requests and ex3.by("ltg_attempts_total", ["model", "outcome"]) == dict(t.attempts),
              "after SIGHUP: requests %r (want %d), attempts %r (want %r)" % (ex3.total("ltg_requests_total"), t.requests,
                                                                             ex3.by("ltg_attempts_total", ["model", "outcome"]), dict(t.attempts)))
        check(abs(ex3.one("process_start_time_seconds") - ex.one("process_start_time_seconds")) < 1,
              "process_start_time_seconds changed on SIGHUP")
        # And they go on counting from there.
        send(a, t, "POST", "/v1/chat/completions", chat(t, "A", "metrics after sighup"), attempts=1,
             served=t.m["A"], what="chat A after SIGHUP")
        t.attempts[(t.m["A"], "ok")] += 1
        _, ex4 = scrape(a, "GET /metrics after SIGHUP and one more call")
        check(ex4.total("ltg_requests_total") == t.requests, "after SIGHUP and one more call: sum(ltg_requests_total) "
              "= %r, want %d" % (ex4.total("ltg_requests_total"), t.requests))
        check(ex4.by("ltg_attempts_total", ["model", "outcome"]) == dict(t.attempts),
              "after SIGHUP and one more call: ltg_attempts_total %r, want %r"
              % (ex4.by("ltg_attempts_total", ["model", "outcome"]), dict(t.attempts)))
        for what, secret in t.secrets():
            check(secret not in ex4.text, "the exposition after SIGHUP holds %s" % what)
    with_ltg("expo", body)


@it.test("metrics: promtool check metrics passes on GET /metrics")
def t_metrics_promtool():
    promtool = prometheus_tool("promtool")

    def body(a, t):
        drive(a, t)
        r, ex = scrape_with_ledger(a, t)
        promtool_check(promtool, r.body)
    with_ltg("promtool", body)


@it.test("metrics: a real Prometheus scraping ltg every second sees the requests and attempts sent")
def t_metrics_prometheus():
    prom = prometheus_tool("prometheus")

    def body(a, t):
        drive(a, t)
        outcomes = collections.Counter()
        for (_, o), n in t.attempts.items():
            outcomes[o] += n
        run_prometheus(prom, a.admin_port, [
            ("sum(ltg_requests_total)", {(): t.requests}),
            ("sum(ltg_attempts_total)", {(): sum(t.attempts.values())}),
            ("sum by (outcome) (ltg_attempts_total > 0)", {(o,): n for o, n in outcomes.items()}),
            ("sum(ltg_request_duration_seconds_count)", {(): t.requests}),
            ('sum(ltg_request_duration_seconds_bucket{le="+Inf"})', {(): t.requests}),
            ("count(ltg_build_info == 1)", {(): 1}),
        ])
    with_ltg("prom", body)


# ===== promtool and Prometheus ======================================================================

def prometheus_tool(name):
    """The path of promtool or prometheus (Debian package `prometheus`), installed when missing."""
    return it.debian_tool(name, "prometheus")


def promtool_check(promtool, body):
    """promtool check metrics < body: exit 0 (its lint problems, e.g. a missing HELP, exit 3)."""
    try:
        p = subprocess.run([promtool, "check", "metrics"], input=body, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=120)
    except subprocess.TimeoutExpired:
        raise it.TestFailure("promtool check metrics ran over 120 s")
    out = p.stdout.decode("utf-8", "replace").strip()
    check(p.returncode == 0, "promtool check metrics exited %d: %s" % (p.returncode, out[:1500]))


def prom_get(port, path, timeout=10):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def prom_query(port, q):
    """An instant query: {(label values of the result's labels, sorted by name): value}."""
    status, body = prom_get(port, "/api/v1/query?" + urllib.parse.urlencode({"query": q}))
    check(status == 200, "Prometheus: query %r -> %d %r" % (q, status, body[:300]))
    j = json.loads(body)
    check(j.get("status") == "success" and j["data"]["resultType"] == "vector", "Prometheus: query %r: %r" % (q, j))
    out = {}
    for s in j["data"]["result"]:
        key = tuple(v for _, v in sorted(s["metric"].items()))
        out[key] = float(s["value"][1])
    return out


def prom_targets(port):
    try:
        status, body = prom_get(port, "/api/v1/targets")
        return [(t.get("scrapeUrl"), t.get("health"), t.get("lastError"))
                for t in json.loads(body)["data"]["activeTargets"]]
    except Exception as e:
        return "(targets unreadable: %s)" % e


def run_prometheus(prom, target_port, queries):
    """Start Prometheus on a free loopback port scraping 127.0.0.1:target_port/metrics every 1 s, wait
    (bounded) until every query gives its expected result, check the target is up, stop it.
    queries: [(PromQL, {result labels tuple: value})]."""
    d = tempfile.mkdtemp(prefix="prometheus-", dir=it.H.tmp)
    port = it.free_port()
    cfg = os.path.join(d, "prometheus.yml")
    with open(cfg, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                "scrape_configs:\n  - job_name: ltg\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
                "    metrics_path: /metrics\n    static_configs:\n      - targets: [\"127.0.0.1:%d\"]\n" % target_port)
    logpath = os.path.join(d, "prometheus.log")
    logf = open(logpath, "ab")
    proc = subprocess.Popen([prom, "--config.file=" + cfg, "--storage.tsdb.path=" + os.path.join(d, "data"),
                             "--web.listen-address=127.0.0.1:%d" % port, "--storage.tsdb.retention.time=1h",
                             "--log.level=warn"],
                            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, cwd=d)

    def log_tail():
        return it.tail(logpath, 10)

    try:
        deadline = time.monotonic() + PROM_WAIT * it.SLOW
        while True:
            check(proc.poll() is None, "Prometheus exited with %r at start-up:\n%s" % (proc.returncode, log_tail()))
            try:
                if prom_get(port, "/-/ready", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            check(time.monotonic() < deadline, "Prometheus not ready within %d s:\n%s" % (PROM_WAIT * it.SLOW, log_tail()))
            time.sleep(0.2)
        deadline = time.monotonic() + PROM_WAIT * it.SLOW
        pending = list(queries)
        down_since = None           # when the target was first seen down (with an error) in a row
        while pending:
            q, want = pending[0]
            got = prom_query(port, q)
            if got == want:
                pending.pop(0)
                continue
            check(proc.poll() is None, "Prometheus exited with %r:\n%s" % (proc.returncode, log_tail()))
            targets = prom_targets(port)
            if isinstance(targets, list) and targets and targets[0][1] == "down" and targets[0][2]:
                down_since = down_since or time.monotonic()
                check(time.monotonic() - down_since < PROM_DOWN * it.SLOW, "Prometheus: the ltg target has been down "
                      "for %d s: %r (%s = %r, want %r)" % (PROM_DOWN * it.SLOW, targets, q, got, want))
            else:
                down_since = None
            if time.monotonic() > deadline:
                raise it.TestFailure("Prometheus: %s = %r, want %r after %d s of scrapes every 1 s; targets: %r"
                                     % (q, got, want, PROM_WAIT * it.SLOW, targets))
            time.sleep(0.5)
        targets = prom_targets(port)
        check(isinstance(targets, list) and len(targets) == 1 and targets[0][1] == "up" and not targets[0][2],
              "Prometheus: the ltg target is not up with no error: %r" % (targets,))
        up = prom_query(port, 'up{job="ltg"}')
        check(list(up.values()) == [1.0], "Prometheus: up{job=\"ltg\"} = %r" % up)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        logf.close()


if __name__ == "__main__":   # this file alone: python3 tests/integration_metrics.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
