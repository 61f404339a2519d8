"""Integration tests: the auditable ledger (API.md 13; README "An auditable ledger") and trace context
(README "Trace context").

Loaded by tests/integration.py (it imports every tests/integration_*.py); the tests register
themselves with the runner's @test and use its harness (it.H) at call time.

The chain is checked three ways: by ltg verify (offline), by GET /spend/chain, and by this file
itself, which computes every event's HMAC-SHA-256 from the segment's bytes as the README defines it
(the previous chain, then the record up to its own chain) -- so the construction is tested against
its description, not only against ltg's own reading of it.

Tampering is done as an attacker would: records rewritten with a valid CRC, so that only the chain
can tell. Histories of several days come from tests/ledger-gen (ltg's own ledger code, fed each
event's clock) with LEDGER_KEY set.
"""

import datetime
import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import zlib

import integration as it
import integration_ledger as L

check = it.check

KEY = "chain-test-key-0123456789abcdef-0123456789"        # at least 32 bytes
OTHER_KEY = "another-key-0123456789abcdef-0123456789abcd"
KEY_VAR = "LTG_TEST_LEDGER_KEY"
LINK_LEN, CHAIN_LEN = 48, 32
EVF_CHAINED = 8


def keyed_env(key=KEY):
    env = dict(it.H.env)
    env[KEY_VAR] = key
    env["LEDGER_KEY"] = key          # tests/ledger-gen's
    return env


# ===== the segment's bytes ============================================================================

def records(path):
    """[(offset of the frame, payload)] of a day's log."""
    data = open(path, "rb").read()
    check(data[:8] == b"LTGSEG1\n", "%s: magic %r" % (path, data[:8]))
    out, off = [], 8
    while off + 8 <= len(data):
        n, crc = struct.unpack_from("<II", data, off)
        p = data[off + 8:off + 8 + n]
        check(len(p) == n and zlib.crc32(p) == crc, "%s: record at %d is not whole or fails its CRC" % (path, off))
        out.append((off, p))
        off += 8 + n
    check(off == len(data), "%s: %d stray bytes at the end" % (path, len(data) - off))
    return out


def write_records(path, payloads):
    """A day's log made of these payloads, each framed with a valid CRC (as an attacker would)."""
    with open(path, "wb") as f:
        f.write(b"LTGSEG1\n")
        for p in payloads:
            f.write(struct.pack("<II", len(p), zlib.crc32(p)) + p)


def event_id(p):
    i = p.find(b'"id":"')
    return p[i + 6:i + 42].decode() if i >= 0 else None


def offsets(payloads, i):
    """The frame offset of payload i once these payloads are written."""
    return 8 + sum(8 + len(p) for p in payloads[:i])


def chain_of_day(path, key=KEY, prev=None):
    """Recompute a chained day: (link's head, [each event's chain]); checks each against the record."""
    recs = records(path)
    check(recs and len(recs[0][1]) == LINK_LEN and recs[0][1][0] == 0, "%s does not begin with a link" % path)
    link = recs[0][1][16:48]
    if prev is not None:
        check(link == prev, "%s: its link %s is not the head before it %s" % (path, link.hex(), prev.hex()))
    head, chains = link, []
    for off, p in recs[1:]:
        check(p[2] & EVF_CHAINED, "%s: the event at %d is not chained" % (path, off))
        want = hmac.new(key.encode(), head + p[:-CHAIN_LEN], hashlib.sha256).digest()
        check(p[-CHAIN_LEN:] == want, "%s: the event at %d carries chain %s, HMAC-SHA-256(key, previous chain || "
              "record) is %s" % (path, off, p[-CHAIN_LEN:].hex(), want.hex()))
        head = want
        chains.append(want.hex())
    return link, chains


def day_logs(data_dir):
    ldir = os.path.join(data_dir, "ledger")
    return [os.path.join(ldir, f) for f in sorted(os.listdir(ldir)) if f.endswith(".log")]


# ===== ltg verify ====================================================================================

def verify(data_dir, *args, key=KEY, key_var=True):
    env = dict(it.H.env)
    if key is not None:
        env[KEY_VAR] = key
    argv = [it.H.ltg_bin, "verify", "--data", data_dir] + (["--ledger-key-env", KEY_VAR] if key_var else []) + list(args)
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=120 * it.SLOW)
    return r.returncode, r.stdout.decode(), r.stderr.decode()


def day_lines(out):
    """{day: its line} of verify's output."""
    return {l[:10]: l for l in out.splitlines() if re.match(r"\d{4}-\d\d-\d\d ", l)}


def heads_of(out):
    return {d: re.search(r"head ([0-9a-f]{64})", l).group(1) for d, l in day_lines(out).items() if " ok " in l}


def generated(tag, days=4, events=4000, key=KEY):
    """A chained history of `days` days before today and today (tests/ledger-gen): its data dir."""
    gen = os.path.join(os.path.dirname(it.H.mock_bin), "ledger-gen")
    check(os.access(gen, os.X_OK), "no %s: build it with make tests/ledger-gen" % gen)
    d = os.path.join(it.H.tmp, "data-" + tag)
    shutil.rmtree(d, ignore_errors=True)
    env = dict(it.H.env)
    if key:
        env["LEDGER_KEY"] = key
    else:
        env.pop("LEDGER_KEY", None)
    r = subprocess.run([gen, d, str(events), str(days), "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                       timeout=300 * it.SLOW)
    check(r.returncode == 0, "tests/ledger-gen exited with %d: %r" % (r.returncode, r.stderr[-400:]))
    return d


def copy_of(src, tag):
    d = os.path.join(it.H.tmp, "data-" + tag)
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d)
    return d


def expect_failed(data_dir, day, words, what, *args, key=KEY):
    rc, out, err = verify(data_dir, *args, key=key)
    check(rc == 1, "%s: ltg verify exited %d, want 1: %s %s" % (what, rc, out[-800:], err[-300:]))
    line = day_lines(out).get(day, "")
    check("FAILED" in line, "%s: the line of %s does not say FAILED: %r (all: %s)" % (what, day, line, out[-900:]))
    for w in words:
        check(w in line, "%s: the line of %s does not name %r: %r" % (what, day, w, line))
    check(out.rstrip().splitlines()[-1].startswith("FAILED"), "%s: the last line %r" % (what, out.splitlines()[-1:]))
    return out


@it.test("chain: ltg verify finds a changed byte, a changed charge, a removed event, two swapped, a truncated day, a "
         "deleted day, the oldest days rewritten without their chain, a wrong head, a wrong key -- each named by day, "
         "event id and offset; --from, heads that match")
def t_chain_verify_tamper():
    base = generated("chain-base-" + os.urandom(3).hex())
    logs = day_logs(base)
    check(len(logs) == 5, "ledger-gen wrote %r, want 5 days" % logs)
    days = [os.path.basename(p)[:10] for p in logs]
    rc, out, err = verify(base)
    check(rc == 0, "a history as written: ltg verify exited %d: %s %s" % (rc, out[-800:], err[-300:]))
    lines = day_lines(out)
    check(sorted(lines) == days, "one line per day: %r for %r" % (list(lines), days))
    heads = heads_of(out)
    check(sorted(heads) == days, "every day ok with its head: %s" % out)
    check("from the seed" in lines[days[0]], "the first day begins the chain from the seed: %r" % lines[days[0]])
    # Recompute it all here, as the README defines it: each day's link is the day before's head.
    prev = bytes(CHAIN_LEN)
    for p in logs:
        link, chains = chain_of_day(p, prev=prev)
        n = int(re.search(r" ok (\d+) events", lines[os.path.basename(p)[:10]]).group(1))
        check(n == len(chains), "%s: verify counts %d events, the log has %d" % (p, n, len(chains)))
        prev = bytes.fromhex(chains[-1])
        check(heads[os.path.basename(p)[:10]] == chains[-1], "%s: verify's head is not the last event's chain" % p)
    day2 = days[1]

    def tampered(what, fn):
        d = copy_of(base, "chain-t-" + os.urandom(3).hex())
        path = os.path.join(d, "ledger", day2 + ".log")
        payloads = [p for _, p in records(path)]
        fn(path, payloads)
        return d, payloads

    # A changed byte in an event's JSON, its CRC made good: the chain alone tells.
    def change_byte(path, ps):
        p = bytearray(ps[10])
        i = p.find(b'"status":"succeeded"')
        p[i + 10] = ord("S")
        ps[10] = bytes(p)
        write_records(path, ps)
    d, ps = tampered("byte", change_byte)
    expect_failed(d, day2, ["event " + event_id(ps[10]), "offset %d" % offsets(ps, 10), "does not verify"],
                  "a changed byte")
    shutil.rmtree(d)

    # The same without fixing the CRC: a damaged record, named.
    d = copy_of(base, "chain-crc-" + os.urandom(3).hex())
    path = os.path.join(d, "ledger", day2 + ".log")
    ps = [p for _, p in records(path)]
    raw = bytearray(open(path, "rb").read())
    raw[offsets(ps, 5) + 8 + 200] ^= 1
    open(path, "wb").write(bytes(raw))
    expect_failed(d, day2, ["offset %d" % offsets(ps, 5), "checksum"], "a changed byte, CRC not fixed")
    shutil.rmtree(d)

    # A changed charge in the record's binary head (what budgets are summed from).
    def change_charge(path, ps):
        p = bytearray(ps[7])
        struct.pack_into("<q", p, 24, struct.unpack_from("<q", p, 24)[0] + 1)
        ps[7] = bytes(p)
        write_records(path, ps)
    d, ps = tampered("charge", change_charge)
    expect_failed(d, day2, ["event " + event_id(ps[7]), "offset %d" % offsets(ps, 7)], "a changed charge")
    shutil.rmtree(d)

    # An event removed: the one after it no longer verifies.
    def remove(path, ps):
        del ps[20]
        write_records(path, ps)
    d, ps = tampered("removed", remove)
    expect_failed(d, day2, ["event " + event_id(ps[20]), "offset %d" % offsets(ps, 20)], "an event removed")
    shutil.rmtree(d)

    # Two events swapped.
    def swap(path, ps):
        ps[30], ps[31] = ps[31], ps[30]
        write_records(path, ps)
    d, ps = tampered("swapped", swap)
    expect_failed(d, day2, ["event " + event_id(ps[30]), "offset %d" % offsets(ps, 30)], "two events swapped")
    shutil.rmtree(d)

    # A sealed day truncated after whole records: the next day's link says so, naming where it ends now.
    def truncate(path, ps):
        del ps[-5:]
        write_records(path, ps)
    d, ps = tampered("truncated", truncate)
    expect_failed(d, days[2], [day2, "truncated", "event " + event_id(ps[-1]), "offset %d" % offsets(ps, len(ps) - 1)],
                  "a day truncated")
    shutil.rmtree(d)

    # A day cut mid-record (not the newest day): truncated.
    d = copy_of(base, "chain-cut-" + os.urandom(3).hex())
    path = os.path.join(d, "ledger", day2 + ".log")
    os.truncate(path, os.path.getsize(path) - 10)
    expect_failed(d, day2, ["cut short", "truncated"], "a day cut mid-record")
    shutil.rmtree(d)

    # A day deleted from the middle.
    d = copy_of(base, "chain-deleted-" + os.urandom(3).hex())
    for ext in (".log", ".idx"):
        os.unlink(os.path.join(d, "ledger", days[2] + ext))
    expect_failed(d, days[3], [days[2], "missing"], "a day deleted from the middle")
    shutil.rmtree(d)

    # The oldest chained days rewritten without their chain, by someone without the key (link, chains
    # and the chained flag gone, events removed and charges zeroed, CRCs made good): the next day's
    # link names a day on disk that is not chained to it.
    d = copy_of(base, "chain-unchained-" + os.urandom(3).hex())
    for day in days[:2]:
        path = os.path.join(d, "ledger", day + ".log")
        ps = []
        for _, p in records(path)[1:11]:
            p = bytearray(p[:-CHAIN_LEN])
            p[2] &= ~EVF_CHAINED & 0xff
            struct.pack_into("<q", p, 24, 0)
            ps.append(bytes(p))
        write_records(path, ps)
    expect_failed(d, days[2], [day2, "no chain", "rewritten"], "the oldest chained days rewritten unchained")
    shutil.rmtree(d)

    # Heads: the right ones match, a wrong one is named, and the newest events removed show only against a head.
    right = ["--head", "%s:%s" % (day2, heads[day2]), "--head", "%s:%s" % (days[-1], heads[days[-1]])]
    rc, out, err = verify(base, *right)
    check(rc == 0 and out.count("matches the head given") == 2, "heads that match: %d %s %s" % (rc, out, err))
    wrong = "%s:%s" % (day2, heads[days[3]])
    expect_failed(base, day2, ["head given"], "a wrong head", "--head", wrong)
    d = copy_of(base, "chain-newest-" + os.urandom(3).hex())
    path = os.path.join(d, "ledger", days[-1] + ".log")
    ps = [p for _, p in records(path)]
    write_records(path, ps[:-3])
    rc, out, err = verify(d)
    check(rc == 0, "the newest events removed, no head given: undetectable, as the README says (%d %s)" % (rc, out))
    expect_failed(d, days[-1], ["head given", "event " + event_id(ps[-4])], "the newest events removed, against its head",
                  "--head", "%s:%s" % (days[-1], heads[days[-1]]))
    shutil.rmtree(d)

    # A wrong key: the first event of every day.
    out = expect_failed(base, days[0], ["event " + event_id(records(logs[0])[1][1]), "offset 64"], "a wrong key",
                        key=OTHER_KEY)
    check(out.count("FAILED") == len(days) + 1, "a wrong key fails every day: %s" % out)
    # No key for a chained ledger: a usage error that says what to give.
    rc, out, err = verify(base, key_var=False)
    check(rc == 2 and "--ledger-key-env" in err, "no key: %d %r" % (rc, err))
    # --from: the first day verified continues a head it cannot check, and says so.
    rc, out, err = verify(base, "--from", days[2])
    lines = day_lines(out)
    check(rc == 0 and sorted(lines) == days[2:] and "not verified here" in lines[days[2]], "--from: %d %s" % (rc, out))
    # Bad arguments.
    for args in (["--from", "yesterday"], ["--head", "2026-01-01:abc"], ["--frob", "1"]):
        rc, out, err = verify(base, *args)
        check(rc == 2 and "usage" in err, "ltg verify %r: %d %r" % (args, rc, err))


@it.test("chain: a live ledger -- events carry chain, /spend/chain gives the head (spend.read), the chain goes on "
         "across a restart, SIGHUP and a torn tail; retention deletes whole days and the first kept day verifies")
def t_chain_live():
    cfg = L.aux_config("chain-live")
    a = it.Aux("chain-live-" + os.urandom(3).hex(), config=cfg, env=keyed_env(), args=["--ledger-key-env", KEY_VAR])
    with it.running(a):
        p = a.admin_port
        gid = L.new_group("chain", port=p)
        kid, s = it.create_key(gid, port=p)
        for i in range(3):
            L.ok200(L.call(s, it.chat_body(content="chain %d" % i), port=a.port), "call %d" % i)
        evs = L.wait_events(gid, 3, port=p)
        check(all(re.fullmatch(r"[0-9a-f]{64}", e.get("chain") or "") for e in evs), "events without chain: %r" % evs)
        today = evs[-1]["created_at"][:10]
        r = it.admin("GET", "/spend/chain?date=" + today, port=p)
        j = it.check_admin_ok(r, 200, "GET /spend/chain")["data"]
        check(j == {"date": today, "events": 3, "head": evs[-1]["chain"], "sealed": False}, "/spend/chain %r" % j)
        r = it.admin("GET", "/spend/chain?date=" + today, key=L.USAGE_ONLY_KEY, port=p)
        check(r.status == 403, "/spend/chain with usage.read only: %s" % r.brief())
        r = it.admin("GET", "/spend/chain?date=" + today, key=L.SPEND_ONLY_KEY, port=p)
        check(r.status == 200, "/spend/chain with spend.read: %s" % r.brief())
        for q, want in (("", 400), ("?date=2026-13-01", 400), ("?date=2999-01-01", 400), ("?date=2000-01-01", 404)):
            r = it.admin("GET", "/spend/chain" + q, port=p)
            check(r.status == want, "/spend/chain%s: %s, want %d" % (q, r.brief(), want))
        # SIGHUP (the catalog reloaded), then a restart: the chain goes on.
        a.proc.send_signal(signal.SIGHUP)
        L.ok200(L.call(s, it.chat_body(content="after hup"), port=a.port), "after SIGHUP")
        a.stop()
        a.start()
        L.ok200(L.call(s, it.chat_body(content="after restart"), port=a.port), "after a restart")
        evs = L.wait_events(gid, 5, port=p)
        a.stop()
        log = day_logs(a.data_dir)[-1]
        link, chains = chain_of_day(log)
        check(chains == [e["chain"] for e in evs], "the chains the API shows are the log's, recomputed: %r vs %r"
              % (chains, [e["chain"] for e in evs]))
        # A torn tail (a crash mid-write): cut at start-up, and the chain goes on from the last whole event.
        size = os.path.getsize(log)
        with open(log, "ab") as f:
            f.write(struct.pack("<II", 400, 0x12345678) + b"\x03\x00\x08" + b"\x00" * 40)
        rc, out, err = verify(a.data_dir)
        check(rc == 0 and "torn last record" in out, "verify with a torn tail on the newest day: %d %s" % (rc, out))
        a.start()
        check(os.path.getsize(log) == size, "the torn tail was not cut")
        L.ok200(L.call(s, it.chat_body(content="after the tear"), port=a.port), "after a torn tail")
        evs = L.wait_events(gid, 6, port=p)
        a.stop()
        rc, out, err = verify(a.data_dir)
        check(rc == 0 and " ok 6 events" in out, "verify after a restart, SIGHUP and a tear: %d %s %s" % (rc, out, err))
        check(chain_of_day(log)[1] == [e["chain"] for e in evs], "the chain after the tear")

    # Retention: a history of 5 days, ltg keeping 3, deletes whole days; the first kept verifies; /spend/chain of a
    # sealed day is its head, as verify computes it.
    d = generated("chain-keep-" + os.urandom(3).hex())
    rc, out, err = verify(d)
    heads = heads_of(out)
    days = sorted(heads)
    b = it.Aux("chain-keep-" + os.urandom(3).hex(), env=keyed_env(), args=["--ledger-key-env", KEY_VAR, "--ledger-days", "3"])
    shutil.rmtree(b.data_dir, ignore_errors=True)
    shutil.move(d, b.data_dir)
    with it.running(b):
        j = it.check_admin_ok(it.admin("GET", "/spend/chain?date=" + days[-2], port=b.admin_port), 200, "a sealed day")
        check(j["data"]["head"] == heads[days[-2]] and j["data"]["sealed"], "/spend/chain of %s: %r, verify says %s"
              % (days[-2], j, heads[days[-2]]))
        r = it.admin("GET", "/spend/chain?date=" + days[0], port=b.admin_port)
        check(r.status == 404, "a day retention deleted: %s" % r.brief())
    kept = sorted(os.path.basename(p)[:10] for p in day_logs(b.data_dir))
    check(len(kept) < len(days) and kept == days[-len(kept):], "--ledger-days 3 kept %r of %r" % (kept, days))
    rc, out, err = verify(b.data_dir, "--head", "%s:%s" % (days[-1], heads[days[-1]]))
    check(rc == 0 and "not verified here" in day_lines(out)[kept[0]], "the first kept day: %d %s %s" % (rc, out, err))


@it.test("chain: an upgrade -- days written without a key verify as 'no chain', the first chained day starts from the "
         "seed; a day begun without the key stays unchained (409 not_chained); a bad key stops start-up")
def t_chain_upgrade():
    d = generated("chain-up-" + os.urandom(3).hex(), days=2, events=600, key=None)
    a = it.Aux("chain-up-" + os.urandom(3).hex(), env=keyed_env(), args=["--ledger-key-env", KEY_VAR])
    shutil.rmtree(a.data_dir, ignore_errors=True)
    shutil.move(d, a.data_dir)
    today = os.path.basename(day_logs(a.data_dir)[-1])[:10]
    rc, out, err = verify(a.data_dir, key_var=False)
    check(rc == 0 and out.count("no chain") == 3, "an unchained ledger, no key: %d %s %s" % (rc, out, err))
    with it.running(a):
        check("stays so" in a.text_since_start(), "no word that today stays unchained: %s" % a.text_since_start()[-600:])
        r = it.admin("GET", "/spend/chain?date=" + today, port=a.admin_port)
        check(r.status == 409 and "not_chained" in r.body.decode(), "/spend/chain of an unchained day: %s" % r.brief())
    # Today's log gone (as at midnight): the next day written is chained, from the seed.
    for ext in (".log", ".idx"):
        if os.path.exists(os.path.join(a.data_dir, "ledger", today + ext)):
            os.unlink(os.path.join(a.data_dir, "ledger", today + ext))
    with it.running(it.Aux(a.tag, env=keyed_env(), args=["--ledger-key-env", KEY_VAR])) as a:
        gid = L.new_group("chain-up", port=a.admin_port)
        kid, s = it.create_key(gid, port=a.admin_port)
        L.ok200(L.call(s, it.chat_body(content="first chained"), port=a.port), "the first chained event")
        L.wait_events(gid, 1, port=a.admin_port)
    rc, out, err = verify(a.data_dir)
    lines = day_lines(out)
    check(rc == 0 and out.count("no chain") == 2 and "from the seed" in lines.get(today, ""),
          "an upgraded ledger: %d %s %s" % (rc, out, err))
    link, chains = chain_of_day(day_logs(a.data_dir)[-1], prev=bytes(CHAIN_LEN))
    # Without the key, on a chained day: ltg starts, says what it means, and verify reports it.
    with it.running(it.Aux(a.tag)) as b:
        check("carry no chain" in b.text_since_start(), "no warning without the key: %s" % b.text_since_start()[-600:])
        L.ok200(L.call(s, it.chat_body(content="unchained"), port=b.port), "a call without the key")
        L.wait_events(gid, 2, port=b.admin_port)
    expect_failed(a.data_dir, today, ["carries no chain"], "an unchained event in a chained day")
    for env, words in (({}, "not set"), ({KEY_VAR: "short"}, "shorter than 32")):
        e = dict(it.H.env)
        e.pop(KEY_VAR, None)
        e.update(env)
        c = it.Aux("chain-badkey-" + os.urandom(3).hex(), env=e, args=["--ledger-key-env", KEY_VAR])
        rc, text = c.start_fails()
        check(rc != 0 and words in text and "--ledger-key-env" in text, "start-up with %r: %d %r" % (env, rc, text[-300:]))


@it.test("trace context: a W3C traceparent reaches the provider with the client's trace id and a new span per attempt, "
         "tracestate passed on; the spend event and the access log carry trace_id; without one ltg starts a trace")
def t_trace_context():
    alog = os.path.join(it.H.tmp, "access-trace-%s.log" % os.urandom(3).hex())
    a = it.Aux("trace-" + os.urandom(3).hex(), args=["--access-log", alog])
    with it.running(a):
        gid = L.new_group("trace", port=a.admin_port, retries={"max_attempts": 3, "retry_delay_ms": 1})
        kid, s = it.create_key(gid, port=a.admin_port)
        trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        tp = "00-%s-%s-01" % (trace, parent)
        L.script("kimi-k3", ["status=429", "ok"])
        r = L.call(s, it.chat_body(content="traced"), headers={"traceparent": tp, "tracestate": "vendor=abc"},
                   port=a.port)
        L.ok200(r, "a traced call")
        got = {k.lower(): v for k, v in it.H.mock_last()["headers"].items()}
        m = re.fullmatch(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01", got.get("traceparent", ""))
        check(m and m.group(1) == trace and m.group(2) != parent, "the provider's traceparent %r for %r" %
              (got.get("traceparent"), tp))
        check(got.get("tracestate") == "vendor=abc", "tracestate %r" % got.get("tracestate"))
        ev = L.wait_events(gid, 1, port=a.admin_port)[-1]
        check(ev.get("trace_id") == trace, "the event's trace_id %r" % ev.get("trace_id"))
        spans = [e.get("span_id") for e in ev["attempt_log"]]
        check(len(spans) == 2 and len(set(spans)) == 2 and spans[-1] == m.group(2) and parent not in spans,
              "a span per attempt: %r (the provider saw %s)" % (spans, m.group(2)))
        # None, or one that does not parse (upper case, all zeros, version ff): a new trace.
        for h in ({}, {"traceparent": tp.upper()}, {"traceparent": "00-%s-%s-01" % ("0" * 32, parent)},
                  {"traceparent": "ff-%s-%s-01" % (trace, parent)}, {"traceparent": tp + "-x"}):
            L.ok200(L.call(s, it.chat_body(content="untraced"), headers=h, port=a.port), "call with %r" % h)
            got = {k.lower(): v for k, v in it.H.mock_last()["headers"].items()}
            m = re.fullmatch(r"00-([0-9a-f]{32})-([0-9a-f]{16})-00", got.get("traceparent", ""))
            check(m and m.group(1) != trace and m.group(1) != "0" * 32, "%r: the provider got %r" % (h, got.get("traceparent")))
        # A later version may add fields: its trace is kept.
        L.ok200(L.call(s, it.chat_body(content="v1"), headers={"traceparent": "01-%s-%s-01-extra" % (trace, parent)},
                       port=a.port), "a later version")
        evs = L.wait_events(gid, 7, port=a.admin_port)
        check(evs[-1]["trace_id"] == trace, "a later version's trace: %r" % evs[-1]["trace_id"])
        a.stop()
    lines = [json.loads(l) for l in open(alog) if '"plane":"inference"' in l]
    traced = [l for l in lines if l.get("path") == "/v1/chat/completions"]
    check(len(traced) == 7 and [l["trace_id"] for l in traced] == [e["trace_id"] for e in evs],
          "the access log's trace_id: %r, the events': %r" % ([l.get("trace_id") for l in traced], [e["trace_id"] for e in evs]))
