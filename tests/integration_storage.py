"""Integration tests: bounded state on disk (issue #11; API.md 6): the ledger's daily segments and
their index files, retention, the migration of an earlier version's single ledger.log, spend through
SIGKILL, and a full disk.

tests/integration.py imports this file at start-up and runs its tests with the others; to run only
these:

    python3 tests/integration.py --ltg ./ltg --mock tests/mock -k storage

Each test runs an ltg of its own (it.Aux) on its own --data. Days other than today are made the way
an operator's disk would hold them: a day's log copied under another date (its events keep their
JSON; ltg indexes them within that day), or an earlier version's ledger.log written here record by
record (framing and CRC-32 as ltg writes them). The disk-full test mounts a 4 MiB tmpfs as --data
(root only: skipped with the reason otherwise), fills it, and frees it again.
"""

import integration as it

import datetime
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
import uuid
import zlib

import integration_ledger as L

check = it.check


def ledger_dir(a):
    return os.path.join(a.data_dir, "ledger")


def day_files(a, ext=".log"):
    return sorted(n for n in os.listdir(ledger_dir(a)) if n.endswith(ext))


def day_range(first, days):
    """start_date=...&end_date=... for [today + first, today + first + days)."""
    return "start_date=%s&end_date=%s" % (L.day(first), L.day(first + days))


def events(a, query):
    """Every event of a query (pages of 1000 under one snapshot), and the last page's meta."""
    out, page, snap = [], 1, None
    while True:
        q = query + "&page[size]=1000&page[number]=%d" % page + ("&page[snapshot]=" + snap if snap else "")
        j = L.spend_page(q, a.admin_port)
        out += j["data"]
        snap = j["meta"]["snapshot"]
        if not j["meta"]["has_more"]:
            return out, j["meta"]
        page += 1


def provision(a, **group):
    gid = L.new_group("storage", port=a.admin_port, **group)
    key, token = it.create_key(gid, port=a.admin_port)
    return gid, key["id"], token


def spend_of(a, gid):
    return it.get_group(gid, port=a.admin_port)[0]["spend"]


def calls(a, token, n, tag, stream=False):
    for i in range(n):
        L.ok200(L.call(token, it.chat_body(content="%s %d" % (tag, i), stream=stream), port=a.port), "%s %d" % (tag, i))


# ===== restarts ===================================================================================

@it.test("storage: SIGKILL then a restart: every group's spend (daily, lifetime, uncapped) and every event exactly as before")
def t_storage_sigkill():
    with it.running(it.Aux("storage-kill-" + os.urandom(3).hex())) as a:
        groups = [provision(a, max_budget=5, budget_duration="1d"), provision(a, max_budget=5), provision(a)]
        for n, (gid, kid, token) in enumerate(groups):
            calls(a, token, 5 + n, "kill %d" % n)
            calls(a, token, 2, "kill stream %d" % n, stream=True)
        before = [(spend_of(a, g), events(a, L.wide() + "&token_group_id=" + g)[0]) for g, _, _ in groups]
        check(all(len(e) >= 7 for _, e in before), "events before the kill: %r" % [len(e) for _, e in before])
        check(day_files(a), "no day of the ledger under %s: %r" % (ledger_dir(a), os.listdir(a.data_dir)))
        a.kill()
        a.start()
        for (gid, _, _), (spend, evs) in zip(groups, before):
            check(spend_of(a, gid) == spend, "group %s: spend %r after SIGKILL and a restart, %r before" % (gid, spend_of(a, gid), spend))
            check(events(a, L.wide() + "&token_group_id=" + gid)[0] == evs, "group %s: its events changed through the kill" % gid)


# ===== migration ==================================================================================

def v1_record(payload):
    data = json.dumps(payload, separators=(",", ":")).encode()
    return struct.pack("<II", len(data), zlib.crc32(data) & 0xFFFFFFFF) + data


def v1_event(gid, kid, when, cost_micro, n):
    iso = when.strftime("%Y-%m-%dT%H:%M:%S.") + "%03dZ" % (when.microsecond // 1000)
    return {"id": str(uuid.uuid4()), "record_type": "spend_event", "request_id": "req_migrated%02d" % n, "created_at": iso,
            "token_key_id": kid, "token_group_id": gid, "requested_model": "Kimi-K3", "model": "Kimi-K3", "attempts": 1,
            "status": "succeeded", "http_status": 200, "cache_hit": False, "input_tokens": 10 + n, "output_tokens": 2,
            "cost": cost_micro / 1e6, "usage_status": "reported", "latency_ms": 5,
            "attempt_log": [{"model": "Kimi-K3", "attempt": 1, "status": 200, "outcome": "ok", "ms": 5}]}


@it.test("storage: an earlier version's single ledger.log is split into daily segments at start-up, once, every event kept")
def t_storage_migration():
    with it.running(it.Aux("storage-migrate-" + os.urandom(3).hex())) as a:
        gid, kid, token = provision(a)
        a.stop()
        shutil.rmtree(ledger_dir(a))            # as an earlier version left it: no ledger/, one ledger.log
        now = datetime.datetime.now(datetime.timezone.utc)
        want, blob = [], b"LTGLED1\n"
        for n, days_ago in enumerate([3, 3, 2, 0, 0]):
            when = (now - datetime.timedelta(days=days_ago)).replace(hour=1 + n, minute=0, second=0, microsecond=0)
            if days_ago == 0:                   # earlier today, in order, even just after midnight
                midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
                when = midnight + (now - midnight) * (n + 1) / 10
            ev = v1_event(gid, kid, when, 100 * (n + 1), n)
            blob += v1_record({"t": int(when.timestamp() * 1000), "c": 100 * (n + 1), "e": ev})
            want.append(ev)
        with open(os.path.join(a.data_dir, "ledger.log"), "wb") as f:
            f.write(blob)
        a.start()
        text = a.text_since_start()
        check("ledger: migrating" in text and "migrated" in text, "no word of the migration in the log: %r" % text[-600:])
        check(not os.path.exists(os.path.join(a.data_dir, "ledger.log")), "ledger.log is still there after the migration")
        check(day_files(a) == [L.day(-3) + ".log", L.day(-2) + ".log", L.day(0) + ".log"], "the days: %r" % day_files(a))
        check(len(day_files(a, ".idx")) == 2, "the sealed days have their index files: %r" % os.listdir(ledger_dir(a)))
        got, _ = events(a, day_range(-3, 4) + "&token_group_id=" + gid)
        check(got == want, "the events after the migration:\n%r\nwant\n%r" % (got[:2], want[:2]))
        check(abs(spend_of(a, gid) - 0.0015) < 1e-9, "the uncapped group's spend is its events': %r" % spend_of(a, gid))
        j = it.check_admin_ok(it.admin("GET", "/usage/summary?token_group_id=%s&%s" % (gid, day_range(-3, 4)), port=a.admin_port), 200, "summary")
        check([d["requests"] for d in j["data"]["by_day"]] == [2, 1, 0, 2], "by_day after the migration: %r" % j["data"]["by_day"])
        calls(a, token, 2, "after migration")
        a.stop()
        a.start()
        check("ledger: migrating" not in a.text_since_start(), "a second start migrated again")
        check(len(events(a, day_range(-3, 4) + "&token_group_id=" + gid)[0]) == 7, "the events after a second start")


# ===== index files and retention ==================================================================

@it.test("storage: a sealed day's index file, damaged or missing, is rebuilt at start-up; queries answer the same")
def t_storage_index_rebuilt():
    with it.running(it.Aux("storage-index-" + os.urandom(3).hex())) as a:
        gid, kid, token = provision(a)
        calls(a, token, 6, "index")
        a.stop()
        today = os.path.join(ledger_dir(a), day_files(a)[-1])
        old = os.path.join(ledger_dir(a), L.day(-1) + ".log")       # yesterday: the same events, sealed
        shutil.copy(today, old)
        os.remove(today)
        a.start()
        idx = old[:-4] + ".idx"
        check(os.path.exists(idx), "yesterday got no index file: %r" % os.listdir(ledger_dir(a)))
        q = day_range(-1, 1)
        first, _ = events(a, q)
        by_key, _ = events(a, q + "&token_key_id=" + kid)
        check(len(first) == 6 and by_key == first, "yesterday's events: %d, by key %d" % (len(first), len(by_key)))
        summary = it.admin("GET", "/usage/summary?" + q, port=a.admin_port).json()
        for damage in ("flip", "cut", "remove"):
            a.stop()
            data = bytearray(open(idx, "rb").read())
            if damage == "flip":
                data[len(data) // 2] ^= 0x40
                open(idx, "wb").write(bytes(data))
            elif damage == "cut":
                open(idx, "wb").write(bytes(data[:len(data) // 3]))
            else:
                os.remove(idx)
            a.start()
            text = a.text_since_start()
            check("rebuilding the index of " + old in text, "%s index file: no rebuild in the log: %r" % (damage, text[-500:]))
            check(events(a, q)[0] == first, "%s index file: the events differ after the rebuild" % damage)
            check(events(a, q + "&token_key_id=" + kid)[0] == by_key, "%s index file: by key" % damage)
            check(it.admin("GET", "/usage/summary?" + q, port=a.admin_port).json() == summary, "%s index file: the summary" % damage)
        a.stop()
        a.start()
        check("rebuilding" not in a.text_since_start(), "a good index file was rebuilt again")


@it.test("storage: retention: days older than --ledger-days are deleted (logged); queries say meta.retained_from; "
         "a budget period longer than the retention is refused")
def t_storage_retention():
    with it.running(it.Aux("storage-retain-" + os.urandom(3).hex(), args=["--ledger-days", "3"])) as a:
        gid, kid, token = provision(a)
        calls(a, token, 3, "retain")
        a.stop()
        today = os.path.join(ledger_dir(a), day_files(a)[-1])
        for back in (10, 4, 3, 1):
            shutil.copy(today, os.path.join(ledger_dir(a), L.day(-back) + ".log"))
        a.start()
        text = a.text_since_start()
        for back, gone in ((10, True), (4, True), (3, False), (1, False)):
            name = L.day(-back) + ".log"
            check(os.path.exists(os.path.join(ledger_dir(a), name)) != gone, "%s: %s" % (name, "not deleted" if gone else "deleted"))
            check(("deleted %s/%s" % (ledger_dir(a), name) in text) == gone, "%s: the deletion %s in the log: %r"
                  % (name, "not" if gone else "", text[-800:]))
        check("older than --ledger-days 3" in text and "3 events" in text, "the deletion's log line: %r" % text[-600:])
        j = L.spend_page(day_range(-5, 6), a.admin_port)
        check(j["meta"].get("retained_from") == L.day(-3), "meta.retained_from of a range reaching back 5 days: %r" % j["meta"])
        check(j["meta"]["total_results"] == 9, "what is kept is answered: %r" % j["meta"])
        j = L.spend_page(day_range(-3, 4), a.admin_port)
        check("retained_from" not in j["meta"], "a range within the retention has no retained_from: %r" % j["meta"])
        s = it.admin("GET", "/usage/summary?" + day_range(-10, 11), port=a.admin_port).json()
        check(s.get("meta", {}).get("retained_from") == L.day(-3) and s["data"]["totals"]["requests"] == 9, "the summary: %r" % s.get("meta"))
        r = it.admin("POST", "/token_groups", it.group_body(name="weekly", max_budget=1, budget_duration="7d"), port=a.admin_port)
        it.check_admin_error(r, 400, "invalid_request", "/budget_duration")
        check("--ledger-days" in r.json()["errors"][0]["detail"], "the refusal says why: %r" % r.body[:300])
        it.check_admin_ok(it.admin("POST", "/token_groups", it.group_body(name="daily", max_budget=1, budget_duration="1d"),
                                   port=a.admin_port), 201, "a daily budget within the retention")


# ===== a full disk ================================================================================

def mount_tmpfs(size):
    """A tmpfs of `size` mounted on a new directory (root only): its path. TestSkip when refused."""
    if os.geteuid() != 0:
        raise it.TestSkip("mounting a tmpfs needs root (this test fills a real filesystem)")
    mnt = tempfile.mkdtemp(prefix="ltg-full-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%s" % size, "tmpfs", mnt], capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(mnt)
        raise it.TestSkip("mount -t tmpfs refused: %s" % (r.stderr.strip() or r.returncode))
    return mnt


def fill(path):
    """Write into `path` until the filesystem is full: how many bytes."""
    n, chunk = 0, b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        for size in (65536, 4096, 512, 1):
            while True:
                try:
                    n += f.write(chunk[:size])
                except OSError:
                    break
    return n


def readyz(port):
    return it.one_request(port, "GET", "/readyz", auth=None, timeout=10)


@it.test("storage: a full disk (a 4 MiB tmpfs): inference 503 storage_unavailable before dispatch and /readyz says so; "
         "the control plane refuses; when space returns ltg resumes by itself; nothing is lost; budgets hold")
def t_storage_disk_full():
    mnt = mount_tmpfs("4m")
    a = it.Aux("storage-full-" + os.urandom(3).hex())
    a.data_dir = os.path.join(mnt, "data")
    filler = os.path.join(mnt, "filler")
    try:
        a.start()
        gid, kid, token = provision(a, max_budget=1)
        body = lambda i: it.chat_body(content="full %d" % i, max_tokens=5)
        answered = 0
        for i in range(5):
            L.ok200(L.call(token, body(i), port=a.port), "before the disk fills")
            answered += 1
        fill(filler)
        # The first events after the disk filled may still fit in a page the file had; then a write
        # fails, and from that turn on nothing is dispatched.
        refused = None
        for i in range(100):
            r = L.call(token, body(100 + i), port=a.port)
            if r.status == 503:
                refused = r
                break
            check(r.status == 200, "a call while the disk fills: %s" % r.brief())
            answered += 1
        check(refused is not None, "100 calls answered 200 on a full disk")
        it.check_openai_error(refused, 503, "storage_unavailable")
        check(a.data_dir.encode() not in refused.body and b"No space" not in refused.body,
              "the refusal shows a tenant the data path or the system's error: %r" % refused.body)
        upstream = L.upstream_calls()
        for i in range(5):
            it.check_openai_error(L.call(token, body(200 + i), port=a.port), 503, "storage_unavailable")
        check(L.upstream_calls() == upstream, "a call refused for storage reached the provider")
        for p in (a.port, a.admin_port):
            r = readyz(p)
            check(r.status == 503 and r.json().get("status") == "storage_unavailable", "/readyz on a full disk: %s" % r.brief())
            check(b"/" not in r.body.replace(b"ltg's log", b"") and b"No space" not in r.body,
                  "/readyz shows the data path or the system's error to anyone: %r" % r.body)
            check(it.one_request(p, "GET", "/healthz", auth=None).status == 200, "/healthz stays 200 (liveness)")
        made = []                                 # a change may still fit in a page the state log had
        for i in range(50):
            r = it.admin("POST", "/token_groups", it.group_body(name="on-full-disk-%d" % i), port=a.admin_port)
            if r.status != 201:
                break
            made.append("on-full-disk-%d" % i)
        it.check_admin_error(r, 503, "storage_unavailable")
        refused = "on-full-disk-%d" % len(made)
        os.remove(filler)                         # space returns
        it.wait_until(lambda: "ltg did not resume after the space returned: /readyz %s" % readyz(a.port).brief(),
                      lambda: readyz(a.port).status == 200, 30 * it.SLOW, step=0.2)
        check(a.proc.poll() is None, "ltg exited")
        L.ok200(L.call(token, body(300), port=a.port), "after the space returned")
        answered += 1
        it.check_admin_ok(it.admin("POST", "/token_groups", it.group_body(name="after-full-disk"), port=a.admin_port), 201, "a change after")
        names = [g["name"] for g in it.list_all("token_groups", port=a.admin_port)]
        check(refused not in names and all(m in names for m in made), "after the full disk: %s refused, %r made, the groups %r" % (refused, made, names))
        evs, _ = events(a, L.wide() + "&token_group_id=" + gid)
        check(len(evs) == answered, "%d spend events for %d answered calls" % (len(evs), answered))
        spend = spend_of(a, gid)
        check(abs(float(spend) - sum(e["cost"] or 0 for e in evs)) < 1e-9, "spend %s is not the sum of its events" % spend)
        # The budget: a little more than spent; calls until it is gone. Spend never passes it, through a SIGKILL.
        cap = round(float(spend) + 0.0003, 6)
        L.patch_group(gid, {"max_budget": cap}, port=a.admin_port)
        for i in range(300):
            r = L.call(token, body(400 + i), port=a.port)
            if r.status == 403:
                break
            L.ok200(r, "spending the budget")
        it.check_openai_error(r, 403, "budget_exceeded")
        spend = spend_of(a, gid)
        check(float(spend) <= cap, "spend %s passed max_budget %s" % (spend, cap))
        a.kill()
        a.start()
        check(spend_of(a, gid) == spend, "spend %s after SIGKILL and a restart, %s before" % (spend_of(a, gid), spend))
        it.check_openai_error(L.call(token, body(999), port=a.port), 403, "budget_exceeded")
        a.stop()
    finally:
        a.close()
        subprocess.run(["umount", "-l", mnt])
        os.rmdir(mnt)


if __name__ == "__main__":   # this file alone: python3 tests/integration_storage.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
