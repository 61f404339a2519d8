"""Integration tests: the README is the front door, and it is tested.

The quick start's shell blocks (every ```sh block between "## Quick start" and the next "## ")
run as one bash script, exactly as a newcomer pastes them, in a scratch directory laid out like a
clone (./ltg, tests/mock, examples/ltg.example.json). Only the ports change: the README's 8080,
8081 and 9000 become free ones, so the test runs beside anything else on the machine. The script
starts its own mock and ltg (with `&`) and stops them (`kill %1 %2`); the test checks what it
printed and that it stopped them. The provider presets and their models load as a catalog. The
unit file of examples/ is checked with systemd-analyze, and `make install` into a DESTDIR.

Runs alone: python3 tests/integration_readme.py --ltg ./ltg --mock tests/mock
"""

import json
import os
import re
import shutil
import subprocess
import tempfile

import integration as it

check = it.check
ROOT = os.path.join(it.HERE, "..")


def readme_section(title):
    """The ```sh blocks of the README's section `title`, joined, in order."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    m = re.search(r"^## %s\n(.*?)(?=^## )" % re.escape(title), text, re.S | re.M)
    if not m:
        raise it.TestFailure("README.md has no section \"## %s\"" % title)
    blocks = re.findall(r"^```sh\n(.*?)^```", m.group(1), re.S | re.M)
    check(blocks, "the README's %s has no ```sh block" % title)
    return "\n".join(blocks)


@it.test("README: the quick start runs as written, start to stop")
def t_quick_start():
    for tool in ("bash", "curl", "make"):
        if not shutil.which(tool):
            raise it.TestSkip("no %s" % tool)
    script = readme_section("Quick start")
    for port in ("127.0.0.1:8080", "127.0.0.1:8081", "127.0.0.1:9000", "--port 9000"):
        check(port in script, "the quick start no longer uses %s: the test's port rewrite needs it" % port)
    ltg_port, admin_port, mock_port = it.free_ports(3)
    script = (script.replace("127.0.0.1:8080", "127.0.0.1:%d" % ltg_port)
                    .replace("127.0.0.1:8081", "127.0.0.1:%d" % admin_port)
                    .replace("127.0.0.1:9000", "127.0.0.1:%d" % mock_port)
                    .replace("--port 9000", "--port %d" % mock_port))
    # A clone, as far as the quick start can tell: `make ltg tests/mock` finds both built.
    work = tempfile.mkdtemp(dir=it.H.tmp, prefix="readme-")
    os.makedirs(os.path.join(work, "tests"))
    os.makedirs(os.path.join(work, "examples"))
    os.symlink(it.H.ltg_bin, os.path.join(work, "ltg"))
    os.symlink(it.H.mock_bin, os.path.join(work, "tests", "mock"))
    with open(os.path.join(ROOT, "examples", "ltg.example.json")) as f:
        catalog = f.read()
    check("127.0.0.1:9000" in catalog, "examples/ltg.example.json does not point at the mock on 9000")
    with open(os.path.join(work, "examples", "ltg.example.json"), "w") as f:
        f.write(catalog.replace("127.0.0.1:9000", "127.0.0.1:%d" % mock_port))
    env = {k: v for k, v in it.H.env.items() if k not in ("LTG_ADMIN_KEY", "MOCK_API_KEY")}
    p = subprocess.Popen(["bash", "-e", "-c", script], cwd=work, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, err = p.communicate()
        raise it.TestFailure("the quick start ran for more than 180 s: %r" % out.decode(errors="replace")[-600:])
    finally:
        try:
            os.killpg(p.pid, 9)     # what it left running, if it failed half-way
        except ProcessLookupError:
            pass
    out, err = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    check(p.returncode == 0, "the quick start exited %d:\n%s\nstderr:\n%s" % (p.returncode, out[-800:], err[-800:]))
    bad = it.sanitizer_line(err)
    check(bad is None, "a sanitizer report from the quick start's ltg: %s" % bad)
    check("Hello from kimi-k3." in out, "the first call printed no completion: %r" % out[:800])
    check(re.search(r"(?im)^x-ltg-served-model: GLM-5\.3-Flash\r?$", out), "the failover was not served by the fallback: %r" % out)
    check(re.search(r"(?im)^x-ltg-attempts: 2\r?$", out), "the failover did not take 2 attempts: %r" % out)
    check("'outcome': 'indeterminate'" in out or "'outcome': 'ok'" in out, "the ledger's attempt_log was not shown: %r" % out)
    check(re.search(r'(?m)^ltg_attempts_total\{.*outcome="indeterminate".*\} 1$', out),
          "the metrics do not show the failed attempt: %r" % out)
    check(out.rstrip().endswith(" 401"), "the last line is not the revoked key's 401: %r" % out[-300:])
    # One access log line per request, JSON, to stderr; never the key.
    lines = [l for l in err.splitlines() if l.startswith("{")]
    check(len(lines) >= 10, "the access log (stderr) has %d JSON lines: %r" % (len(lines), err[-800:]))
    check("ltg_sk_" not in err, "a token key in the quick start's logs")
    check(not os.path.exists(os.path.join(work, "key.json")) and not os.path.exists(os.path.join(work, "page1.json")),
          "the quick start left its scratch files behind")
    check(os.path.isdir(os.path.join(work, "ltg-data")), "no ./ltg-data after the quick start")
    check(not it.port_open(ltg_port) and not it.port_open(mock_port), "the quick start left ltg or the mock running")


@it.test("README: the provider presets and their models load as a catalog (endpoints included)")
def t_presets():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"^```json\n(.*?)^```", text, re.S | re.M)
    provs = [b for b in blocks if b.startswith('"openai":')]
    check(len(provs) == 1, "one ```json block of provider presets, starting with \"openai\": (%d)" % len(provs))
    models = blocks[blocks.index(provs[0]) + 1]
    cfg = {"providers": json.loads("{" + provs[0] + "}"), "models": json.loads("{" + models + "}"),
           "admin_keys": [{"key_env": "LTG_ADMIN_KEY", "permissions": ["*"]}]}
    check(cfg["providers"]["groq"].get("endpoints") == ["chat", "responses"], "groq's endpoints %r" % cfg["providers"]["groq"])
    env = dict(it.H.env, LTG_ADMIN_KEY="admin-presets-key")
    for p in cfg["providers"].values():
        if "api_key_env" in p:
            env[p["api_key_env"]] = "sk-presets-not-a-key"
    a = it.Aux("presets", config=it.write_catalog(cfg, "presets"), env=env)
    try:
        a.start()
        a.stop()
    finally:
        a.close()


@it.test("install: make install into a DESTDIR; the unit passes systemd-analyze verify")
def t_install():
    if not shutil.which("make"):
        raise it.TestSkip("no make")
    dest = tempfile.mkdtemp(dir=it.H.tmp, prefix="destdir-")
    # The binary under test is installed, not rebuilt: LTG= names it (an ASan build in the ASan pass).
    p = subprocess.run(["make", "-s", "-C", ROOT, "install-files", "DESTDIR=" + dest, "PREFIX=/usr",
                        "LTG=" + it.H.ltg_bin], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    check(p.returncode == 0, "make install failed: %s" % p.stdout.decode(errors="replace")[-600:])
    for f in ("usr/bin/ltg", "usr/share/ltg/ltg.example.json", "usr/lib/systemd/system/ltg.service",
              "etc/logrotate.d/ltg", "etc/ltg/ltg.json"):
        check(os.path.isfile(os.path.join(dest, f)), "make install did not install %s" % f)
    unit = open(os.path.join(dest, "usr/lib/systemd/system/ltg.service")).read()
    check("ExecStart=/usr/bin/ltg " in unit, "the installed unit does not run /usr/bin/ltg: %r" % unit[-800:])
    for want in ("DynamicUser=yes", "StateDirectory=ltg", "ProtectSystem=strict", "NoNewPrivileges=yes",
                 "ExecReload=/bin/kill -HUP $MAINPID", "--data /var/lib/ltg"):
        check(want in unit, "the unit lacks %s" % want)
    # An existing catalog is never overwritten.
    with open(os.path.join(dest, "etc/ltg/ltg.json"), "w") as f:
        f.write("{\"mine\": true}\n")
    p = subprocess.run(["make", "-s", "-C", ROOT, "install-files", "DESTDIR=" + dest, "PREFIX=/usr",
                        "LTG=" + it.H.ltg_bin], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    check(p.returncode == 0 and open(os.path.join(dest, "etc/ltg/ltg.json")).read() == "{\"mine\": true}\n",
          "a second make install overwrote /etc/ltg/ltg.json")
    v = subprocess.run([os.path.join(dest, "usr/bin/ltg"), "--version"], stdout=subprocess.PIPE, timeout=30)
    check(v.returncode == 0 and v.stdout.startswith(b"ltg "), "the installed ltg --version: %r" % v.stdout)
    if not shutil.which("systemd-analyze"):
        raise it.TestSkip("files installed; no systemd-analyze to verify the unit (apt-get install systemd)")
    # verify resolves ExecStart: point it at the installed binary's real path.
    path = os.path.join(it.H.tmp, "ltg.service")
    with open(path, "w") as f:
        f.write(unit.replace("ExecStart=/usr/bin/ltg ", "ExecStart=%s " % os.path.join(dest, "usr/bin/ltg")))
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", path], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=60)
    text = p.stdout.decode(errors="replace")
    check(p.returncode == 0 and "ltg.service" not in text, "systemd-analyze verify: rc %d %s" % (p.returncode, text))


if __name__ == "__main__":   # this file alone: python3 tests/integration_readme.py --ltg ./ltg --mock tests/mock
    import sys
    sys.exit(it.main(only=__name__))
