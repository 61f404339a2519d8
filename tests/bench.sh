#!/usr/bin/env bash
# tests/bench.sh -- ltg against nginx, same upstream, same run.
#
#     tests/bench.sh             (or: make bench)
#
# Starts the mock provider (tests/mock) as a fast fixed-answer upstream, nginx
# as a plain keep-alive reverse proxy to it (one worker, two servers: with a
# JSON-lines access log to a file, buffered, and without), and ltg twice
# (its access log to a file, and --access-log off), one provider (the mock)
# and one model alias. The load is wrk: POST /v1/chat/completions with a
# small JSON body, keep-alive. Each comparison is a pair, nginx against ltg,
# run in BENCH_ROUNDS rounds of A B B A: requests/s and CPU per request at 64
# connections with the logs and without; the tail at 1 connection (p99 over
# BENCH_P99_SECONDS runs, alternating A B and B A); 1 connection beside
# 1,000 idle keep-alive clients; short streams at 64 connections. It prints
# the medians, the median of the rounds' ratios ltg/nginx and their spread,
# and one summary line per target, met or not. Then several instances on one
# Redis (issue 24): one ltg against one with --cluster, every request held and
# settled in Redis; one with --cluster against three behind HAProxy.
#
# Then translation (README "One API for every model"): one ltg with three
# providers, the same mock spoken to in OpenAI's APIs, in Anthropic Messages,
# and in chat alone. A chat client reaching the Anthropic model (translated)
# against the same chat request to the OpenAI-chat model (passed through), a
# Messages client reaching the OpenAI-chat model (translated) against the same
# Messages request to the Anthropic model (passed through), and a Responses
# client reaching the chat-only model (translated) against the same Responses
# request to the OpenAI model (passed through), each whole and streamed: six
# pairs at 64 connections, interleaved; target: translated >= 0.9x.
#
# Then the same over HTTPS: a second mock in TLS mode (certificates from
# tests/tls-certs.sh, DNS:localhost), ltg with an https:// provider and
# --ca-file, nginx proxy_pass https:// with upstream keepalive, SNI, name
# checks, verification against the test CA and session reuse. At 64
# connections it reports requests/s, latency, CPU microseconds per request,
# the TLS handshakes the mock saw during each run, and the share of ltg's
# requests that paid a full handshake (from the "TLS handshakes: N full,
# M resumed" line ltg logs when it stops, over the requests the mock counted
# for ltg's upstream model; target: under 1 %).
#
# Environment:
#   BENCH_SECONDS   seconds per measured run (default 5)
#   BENCH_ROUNDS    rounds of each pair (default 3)
#   BENCH_P99_SECONDS  seconds per run of the 1-connection tail (default 10)
#   BENCH_IDLE_CLIENTS idle keep-alive clients held beside the 1-connection runs (1000; 0 skips)
#   BENCH_WARMUP    seconds of warm-up per target (default 1)
#   BENCH_STRICT=1  exit 1 when a target is missed (default: report only)
#   BENCH_PIN=0     do not pin the 1-connection runs to one core (see below)
#   BENCH_TLS=0     skip the HTTPS section (it needs the openssl command)
#   BENCH_CLUSTER=0 skip the several-instances section (it needs redis-server and haproxy)
#   BENCH_PROFILE=1 perf record ltg during its 64-connection run and print the top of the
#                   profile (make profile: LTG_BIN=./ltg-profile, symbols kept; needs perf)
#   BENCH_HISTORY_EVENTS  events of the long-history section (10000000; 0 skips it)
#   BENCH_TODAY_EVENTS    events of the busy-day section, all of them today (10000000; 0 skips it)
#   BENCH_TRAFFIC_BASE    the revision measured as "before" in the traffic section (b40c800,
#                   the last before deployments and rate limits; empty skips that section)
#   BENCH_TRAFFIC_ROUNDS  its interleaved rounds (4)
#   BENCH_TRAFFIC_SAME=1  give that base the same catalog, limits and budgets (a base that has them)
#   BENCH_BASE      the git revision measured as "before" there (2a946e7; empty skips it)
#   BENCH_CHAIN_BASE      the revision measured as "before" in the chained-ledger section
#                         (60e14ca, before issue 25; empty skips the section)
#   BENCH_CHAIN_ROUNDS    its interleaved rounds (4)
#   BENCH_BEFORE    the revision measured as "the build before" (HEAD~1; empty skips it): this
#                   build against it, the same catalog and flags, interleaved
#   BENCH_BEFORE_ROUNDS   its interleaved rounds (6)
#   BENCH_TRANSLATE=0     skip the translation section (chat <-> Messages, Responses -> chat: six pairs)
#   BENCH_TRANSLATE_ROUNDS  its interleaved rounds per pair (8: on this VM one round's ratio
#                         spreads by 0.1 or more, and the target is the median's)
#
# The 1-connection runs are pinned (taskset) to one core, the same for both
# sides: wrk, the mock and the proxy under test all on the last CPU.
# Unpinned, one request ping-pongs between cores and each cross-core wake-up
# (an IPI, costly in a VM) adds tens of microseconds at random, which drowns
# the proxies' own cost; pinned, it is literally one core against one core.
# The 64-connection runs are not pinned: wrk -t2, the mock and the proxy share
# all cores.
#
# Everything listens on 127.0.0.1, on free ports picked at run time; every
# process started here is stopped on exit. nginx and wrk are installed from
# Debian when missing (root with apt-get). Exit status: 0 when the benchmark
# ran (and, with BENCH_STRICT=1, the targets were met), 1 otherwise.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
PATH=$PATH:/usr/sbin:/sbin

SECS=${BENCH_SECONDS:-5}
WARM=${BENCH_WARMUP:-1}
STRICT=${BENCH_STRICT:-0}
PIN=${BENCH_PIN:-1}
TLS=${BENCH_TLS:-1}
CLUSTER=${BENCH_CLUSTER:-1}
case $SECS in '' | *[!0-9]* | 0) echo "bench: BENCH_SECONDS must be a whole number >= 1" >&2; exit 1 ;; esac
case $WARM in '' | *[!0-9]*) echo "bench: BENCH_WARMUP must be a whole number >= 0" >&2; exit 1 ;; esac

ALIAS=Bench-Model          # the alias clients send
UPSTREAM_MODEL=bench-model # what ltg sends upstream (same length: same answer size)
TOKEN_KEY=""   # the token key, provisioned through the control plane once ltg is up
BODY='{"model":"'$ALIAS'","messages":[{"role":"user","content":"hi"}]}'

die() { echo "bench: $*" >&2; exit 1; }

# ---------------------------------------------------------------- cleanup
T=$(mktemp -d /tmp/ltg-bench.XXXXXX) || die "mktemp failed"
PIDS=()
POLICY_RC_CREATED=0
cleanup() {
    local p
    for p in "${PIDS[@]}"; do
        kill -TERM "$p" 2>/dev/null
    done
    for p in "${PIDS[@]}"; do
        # wait only works for our children; fall back to polling
        for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null
        wait "$p" 2>/dev/null
    done
    [ "$POLICY_RC_CREATED" = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ -n "${BENCH_KEEP_TMP:-}" ] || rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- tools
install_tools() {
    local want=() pkg
    command -v wrk >/dev/null || want+=(wrk)
    command -v curl >/dev/null || want+=(curl)
    if [ "$CLUSTER" = 1 ]; then
        command -v redis-server >/dev/null || want+=(redis-server)
        command -v haproxy >/dev/null || want+=(haproxy)
    fi
    if ! command -v nginx >/dev/null; then
        # nginx-light is the smallest build with the proxy and upstream keepalive.
        pkg=nginx
        if apt-cache policy nginx-light 2>/dev/null | grep -q 'Candidate: [0-9]'; then pkg=nginx-light; fi
        want+=("$pkg")
    fi
    [ ${#want[@]} -eq 0 ] && return 0
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null ||
        die "missing ${want[*]}: run  sudo apt-get install -y ${want[*]}"
    echo "bench: installing ${want[*]}" >&2
    # Keep the nginx package from starting its system service on port 80.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && POLICY_RC_CREATED=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -qq "${want[@]}" >"$T/apt.log" 2>&1; then
        apt-get update -qq >>"$T/apt.log" 2>&1
        # nginx-light may be unknown before the update; plain nginx always exists
        want=("${want[@]/nginx-light/nginx}")
        apt-get install -y -qq "${want[@]}" >>"$T/apt.log" 2>&1 || { tail -20 "$T/apt.log" >&2; die "apt-get install ${want[*]} failed"; }
    fi
    if [ "$POLICY_RC_CREATED" = 1 ]; then rm -f /usr/sbin/policy-rc.d; POLICY_RC_CREATED=0; fi
    command -v wrk >/dev/null && command -v nginx >/dev/null && command -v curl >/dev/null || die "tools still missing after install"
    [ "$CLUSTER" = 0 ] || { command -v redis-server >/dev/null && command -v haproxy >/dev/null; } ||
        die "redis-server or haproxy still missing after install"
}
install_tools

[ -x ./ltg ] && [ -x tests/mock ] || die "build first: make ltg tests/mock"

# ---------------------------------------------------------------- ports
# Free ports below the ephemeral range, so that wrk's and the proxies' client
# sockets never take them between the probe and the bind.
read -r EPH_LO _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || EPH_LO=32768
PORT_LO=$((EPH_LO > 13024 ? EPH_LO - 12000 : 1024))
USED_PORTS=" "
free_port() {
    local p
    for _ in $(seq 1 200); do
        p=$((PORT_LO + RANDOM % (EPH_LO - PORT_LO)))
        case $USED_PORTS in *" $p "*) continue ;; esac
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            USED_PORTS="$USED_PORTS$p "
            echo "$p"
            return 0
        fi
    done
    die "no free port found"
}

# wait_http URL PID LOG: until URL answers (any HTTP status) or PID dies.
wait_http() {
    for _ in $(seq 1 100); do
        kill -0 "$2" 2>/dev/null || { echo "--- $3:" >&2; tail -20 "$3" >&2; return 1; }
        if curl -s -o /dev/null -m 1 "$1"; then return 0; fi
        sleep 0.05
    done
    echo "--- $3:" >&2; tail -20 "$3" >&2
    return 1
}

# ---------------------------------------------------------------- /proc helpers
TCK=$(getconf CLK_TCK)
cpu_ticks() { # utime + stime of the whole process (all threads)
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || { echo 0; return; }
    s=${s##*) }   # after the comm field, which may hold spaces
    # after comm, $1 is field 3 (state): utime (field 14) is ${12}, stime (15) ${13}
    set -- $s
    echo $((${12} + ${13}))
}
hwm_kb() { awk '/^VmHWM:/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
now_ms() { date +%s%3N; }

# ---------------------------------------------------------------- upstream: the mock
"$ROOT/tests/mock" --port 0 2>"$T/mock.log" &
MOCK_PID=$!
PIDS+=("$MOCK_PID")
MOCK_PORT=
for _ in $(seq 1 100); do
    MOCK_PORT=$(sed -n 's/.*listening on 127\.0\.0\.1:\([0-9]*\).*/\1/p' "$T/mock.log" | head -n1)
    [ -n "$MOCK_PORT" ] && break
    kill -0 "$MOCK_PID" 2>/dev/null || break
    sleep 0.05
done
[ -n "$MOCK_PORT" ] || { cat "$T/mock.log" >&2; die "the mock did not start"; }
MOCK_URL=http://127.0.0.1:$MOCK_PORT

# ---------------------------------------------------------------- upstream over HTTPS: the mock in TLS mode
# The certificates name localhost only (BearSSL matches DNS names, not
# addresses): clients say https://localhost:PORT and connect to 127.0.0.1.
MOCK_TLS_PORT=
CURL_TLS=()
if [ "$TLS" = 1 ] && ! command -v openssl >/dev/null; then
    echo "bench: no openssl command: skipping the HTTPS section (apt-get install openssl)" >&2
    TLS=0
fi
if [ "$TLS" = 1 ]; then
    sh "$ROOT/tests/tls-certs.sh" "$T/certs" || die "tests/tls-certs.sh failed"
    "$ROOT/tests/mock" --port 0 --tls-cert "$T/certs/localhost.pem" --tls-key "$T/certs/localhost.key" 2>"$T/mock-tls.log" &
    MOCK_TLS_PID=$!
    PIDS+=("$MOCK_TLS_PID")
    for _ in $(seq 1 100); do
        MOCK_TLS_PORT=$(sed -n 's/.*listening on 127\.0\.0\.1:\([0-9]*\).*/\1/p' "$T/mock-tls.log" | head -n1)
        [ -n "$MOCK_TLS_PORT" ] && break
        kill -0 "$MOCK_TLS_PID" 2>/dev/null || break
        sleep 0.05
    done
    [ -n "$MOCK_TLS_PORT" ] || { cat "$T/mock-tls.log" >&2; die "the TLS mock did not start"; }
    MOCK_TLS_URL=https://localhost:$MOCK_TLS_PORT
    # curl checks the mock's certificate against the test CA, as ltg and nginx do
    CURL_TLS=(--cacert "$T/certs/ca.pem" --resolve "localhost:$MOCK_TLS_PORT:127.0.0.1")
fi

# ---------------------------------------------------------------- nginx
start_nginx() {
    local try tls_conf
    mkdir -p "$T/nginx"
    for try in 1 2 3; do
        NGINX_PORT=$(free_port)
        NGINX_NOLOG_PORT=$(free_port)
        NGINX_TLS_PORT=
        tls_conf=
        if [ "$TLS" = 1 ]; then
            NGINX_TLS_PORT=$(free_port)
            # the same worker, a second server: HTTPS to the TLS mock, verified
            # as ltg does it (SNI, the name localhost, the test CA), with
            # keep-alive and session reuse
            tls_conf="
    upstream mock_tls {
        server 127.0.0.1:$MOCK_TLS_PORT;
        keepalive 64;
        keepalive_requests 100000000;
    }
    server {
        listen 127.0.0.1:$NGINX_TLS_PORT;
        location / {
            proxy_pass https://mock_tls;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_ssl_server_name on;
            proxy_ssl_name localhost;
            proxy_ssl_trusted_certificate $T/certs/ca.pem;
            proxy_ssl_verify on;
            proxy_ssl_session_reuse on;
        }
    }"
        fi
        cat >"$T/nginx/nginx.conf" <<EOF
# generated by tests/bench.sh: a plain keep-alive reverse proxy to the mock,
# twice: with an access log of JSON lines (buffered, as nginx allows) and
# without one (and, for the HTTPS section, one to the TLS mock)
$( [ "$(id -u)" = 0 ] && echo "user root;" )
worker_processes 1;
daemon off;
pid $T/nginx/nginx.pid;
error_log $T/nginx/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    log_format jsonl escape=json '{"time":"\$time_iso8601","client":"\$remote_addr",'
        '"method":"\$request_method","path":"\$request_uri","status":\$status,'
        '"bytes":\$body_bytes_sent,"duration_s":\$request_time,'
        '"upstream_s":"\$upstream_response_time","request_id":"\$request_id"}';
    client_body_temp_path $T/nginx/body;
    proxy_temp_path $T/nginx/proxy;
    fastcgi_temp_path $T/nginx/fastcgi;
    uwsgi_temp_path $T/nginx/uwsgi;
    scgi_temp_path $T/nginx/scgi;
    keepalive_requests 100000000;
    upstream mock {
        server 127.0.0.1:$MOCK_PORT;
        keepalive 64;
        keepalive_requests 100000000;
    }
    server {
        listen 127.0.0.1:$NGINX_PORT;
        access_log $T/nginx/access.log jsonl buffer=64k flush=1s;
        location / {
            proxy_pass http://mock;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
    server {
        listen 127.0.0.1:$NGINX_NOLOG_PORT;
        location / {
            proxy_pass http://mock;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }$tls_conf
}
EOF
        nginx -p "$T/nginx" -e "$T/nginx/error.log" -c "$T/nginx/nginx.conf" 2>>"$T/nginx/error.log" &
        NGINX_MASTER=$!
        PIDS+=("$NGINX_MASTER")
        if wait_http "http://127.0.0.1:$NGINX_PORT/" "$NGINX_MASTER" "$T/nginx/error.log" 2>/dev/null; then
            NGINX_PID=$(pgrep -P "$NGINX_MASTER" | head -n1)
            [ -n "$NGINX_PID" ] || die "no nginx worker under master $NGINX_MASTER"
            PIDS+=("$NGINX_PID")   # after its master: stopped with it, killed if it lingers
            return 0
        fi
        kill "$NGINX_MASTER" 2>/dev/null; wait "$NGINX_MASTER" 2>/dev/null
    done
    tail -20 "$T/nginx/error.log" >&2
    die "nginx did not start"
}
start_nginx

# ---------------------------------------------------------------- ltg
# provision_key ADMIN_PORT VAR [MODELS]: a token group allowing the alias (or
# MODELS, the inside of a JSON array of names), and a token key for it, into
# the variable VAR.
provision_key() {
    local admin="http://127.0.0.1:$1/v2/llm_token_gateway" gid key
    gid=$(curl -s "$admin/token_groups" -H "Authorization: Bearer $LTG_BENCH_ADMIN_KEY" -H "Idempotency-Key: bench-g-$$" \
          -d "{\"name\":\"bench\",\"allowed_models\":[${3:-\"$ALIAS\"}]}" | sed -n 's/.*"id":"\([^"]*\)".*/\1/p' | head -n 1)
    [ -n "$gid" ] || die "could not create a token group"
    key=$(curl -s "$admin/token_keys" -H "Authorization: Bearer $LTG_BENCH_ADMIN_KEY" -H "Idempotency-Key: bench-k-$$" \
          -d "{\"name\":\"bench\",\"token_group_id\":\"$gid\"}" | sed -n 's/.*"token":"\(ltg_sk_[^"]*\)".*/\1/p')
    [ -n "$key" ] || die "could not create a token key"
    printf -v "$2" '%s' "$key"
}

# launch_ltg NAME CONFIG [FLAG...]: ltg on free ports with --data $T/NAME-data,
# logging to $T/NAME.log; sets L_PORT, L_ADMIN_PORT, L_PID once it answers.
launch_ltg() {
    local name=$1 config=$2 try
    shift 2
    for try in 1 2 3; do
        L_PORT=$(free_port)
        L_ADMIN_PORT=$(free_port)
        "${LTG_BIN:-$ROOT/ltg}" --config "$config" --data "$T/$name-data" --listen "127.0.0.1:$L_PORT" \
            --admin-listen "127.0.0.1:$L_ADMIN_PORT" "$@" 2>>"$T/$name.log" &
        L_PID=$!
        PIDS+=("$L_PID")
        if wait_http "http://127.0.0.1:$L_PORT/healthz" "$L_PID" "$T/$name.log" 2>/dev/null; then
            return 0
        fi
        kill "$L_PID" 2>/dev/null; wait "$L_PID" 2>/dev/null
        grep -q "listen" "$T/$name.log" || break   # not a port clash: do not retry
    done
    tail -20 "$T/$name.log" >&2
    die "$name did not start"
}

# build_at REV OUT: ltg.c and ltg.h of git revision REV built into OUT; 1 when this clone has no REV
build_at() {
    git -C "$ROOT" cat-file -e "$1^{commit}" 2>/dev/null || return 1
    rm -rf "$T/src-$1" && mkdir -p "$T/src-$1"
    git -C "$ROOT" archive "$1" ltg.c ltg.h | tar -x -C "$T/src-$1"
    ${CC:-cc} -O2 -std=c11 -w -static -o "$2" "$T/src-$1/ltg.c" $(ls /usr/lib/*/libbearssl.a | head -n 1) -lm ||
        die "building $1 failed"
}

start_ltg() {
    cat >"$T/ltg.json" <<EOF
{
  "providers": { "mock": { "base_url": "$MOCK_URL/v1", "api_key_env": "LTG_BENCH_MOCK_KEY" } },
  "models": {
    "$ALIAS": { "provider": "mock", "upstream_model": "$UPSTREAM_MODEL",
                "input_usd_per_mtok": 0.60, "output_usd_per_mtok": 2.50 }
  },
  "admin_keys": [ { "key_env": "LTG_BENCH_ADMIN_KEY", "permissions": ["*"] } ]
}
EOF
    export LTG_BENCH_MOCK_KEY=sk-bench-upstream LTG_BENCH_ADMIN_KEY=bench-admin-$$
    # the access log to a file (ltg's default is stderr, which goes to $T/ltg.log here);
    # the connection caps raised for the idle-clients runs, which hold 1,000 from one address
    launch_ltg ltg "$T/ltg.json" --access-log "$T/ltg-access.log" --max-conns 4096 --max-conns-per-ip 4096
    LTG_PORT=$L_PORT LTG_ADMIN_PORT=$L_ADMIN_PORT LTG_PID=$L_PID
    provision_key "$LTG_ADMIN_PORT" TOKEN_KEY
    launch_ltg ltg-nolog "$T/ltg.json" --access-log off
    LTG_NOLOG_PORT=$L_PORT LTG_NOLOG_PID=$L_PID
    provision_key "$L_ADMIN_PORT" NOLOG_KEY
}
start_ltg

# The HTTPS section's ltg: its own process, so that the handshake counts it
# logs when it stops are those of the HTTPS runs alone. The same alias, sent
# to the TLS mock; the trust anchor is the test CA.
start_ltg_tls() {
    cat >"$T/ltg-tls.json" <<EOF
{
  "providers": { "mock-tls": { "base_url": "$MOCK_TLS_URL/v1", "api_key_env": "LTG_BENCH_MOCK_KEY" } },
  "models": {
    "$ALIAS": { "provider": "mock-tls", "upstream_model": "$UPSTREAM_MODEL",
                "input_usd_per_mtok": 0.60, "output_usd_per_mtok": 2.50 }
  },
  "admin_keys": [ { "key_env": "LTG_BENCH_ADMIN_KEY", "permissions": ["*"] } ]
}
EOF
    launch_ltg ltg-tls "$T/ltg-tls.json" --ca-file "$T/certs/ca.pem"
    LTG_TLS_PORT=$L_PORT LTG_TLS_PID=$L_PID
    provision_key "$L_ADMIN_PORT" TLS_TOKEN_KEY
}
[ "$TLS" = 1 ] && start_ltg_tls

# ---------------------------------------------------------------- correctness first
# One request through each; the answer must be 200 and the mock's own body
# (its "id" and "created" differ per request and are left out of the compare).
normalize() { sed -e 's/"id":"[^"]*"/"id":"X"/' -e 's/"created":[0-9]*/"created":0/' "$1"; }
post() { # URL OUT BODY [TOKEN] -> prints the status
    curl -s "${CURL_TLS[@]}" -o "$2" -D "$2.head" -w '%{http_code}' -m 5 -X POST "$1/v1/chat/completions" \
        -H 'Content-Type: application/json' -H "Authorization: Bearer ${4:-$TOKEN_KEY}" --data-binary "$3"
}
BODY_UP=${BODY/\"$ALIAS\"/\"$UPSTREAM_MODEL\"}
CHECK_FAIL=0
st=$(post "$MOCK_URL" "$T/ref-alias" "$BODY")
[ "$st" = 200 ] || die "the mock answered $st to the bench request: $(cat "$T/ref-alias")"
st=$(post "$MOCK_URL" "$T/ref-up" "$BODY_UP")
[ "$st" = 200 ] || die "the mock answered $st to the bench request: $(cat "$T/ref-up")"
check() { # NAME URL REF [TOKEN]
    local st
    st=$(post "$2" "$T/check-$1" "$BODY" "${4:-}")
    if [ "$st" != 200 ]; then
        echo "bench: $1 answered $st (want 200): $(head -c 500 "$T/check-$1")" >&2; CHECK_FAIL=1; return
    fi
    if ! diff <(normalize "$3") <(normalize "$T/check-$1") >"$T/check-$1.diff"; then
        echo "bench: $1 answered 200 but not with the mock's body:" >&2; cat "$T/check-$1.diff" >&2; CHECK_FAIL=1
    fi
}
check nginx "http://127.0.0.1:$NGINX_PORT" "$T/ref-alias"
check ltg "http://127.0.0.1:$LTG_PORT" "$T/ref-up"
check nginx-nolog "http://127.0.0.1:$NGINX_NOLOG_PORT" "$T/ref-alias"
check ltg-nolog "http://127.0.0.1:$LTG_NOLOG_PORT" "$T/ref-up" "$NOLOG_KEY"
if [ "$CHECK_FAIL" = 0 ] && ! grep -qi "^x-ltg-served-model: $ALIAS" "$T/check-ltg.head"; then
    echo "bench: ltg's answer lacks x-ltg-served-model: $ALIAS" >&2; CHECK_FAIL=1
fi
if [ "$TLS" = 1 ]; then
    # over HTTPS: the TLS mock's own answers, to the alias (what nginx relays)
    # and to the upstream name (what ltg sends and relays)
    st=$(post "$MOCK_TLS_URL" "$T/ref-tls-alias" "$BODY")
    [ "$st" = 200 ] || die "the TLS mock answered $st to the bench request: $(cat "$T/ref-tls-alias")"
    st=$(post "$MOCK_TLS_URL" "$T/ref-tls-up" "$BODY_UP")
    [ "$st" = 200 ] || die "the TLS mock answered $st to the bench request: $(cat "$T/ref-tls-up")"
    check nginx-tls "http://127.0.0.1:$NGINX_TLS_PORT" "$T/ref-tls-alias"
    check ltg-tls "http://127.0.0.1:$LTG_TLS_PORT" "$T/ref-tls-up" "$TLS_TOKEN_KEY"
fi
[ "$CHECK_FAIL" = 0 ] || die "correctness check failed; nothing measured"

# ---------------------------------------------------------------- wrk
write_lua() { # FILE TOKEN [BODY] [PATH]: PATH /v1/messages adds anthropic-version, as Anthropic's SDKs send it
local path=${4:-/v1/chat/completions} extra=
[ "$path" = /v1/messages ] && extra='wrk.headers["anthropic-version"] = "2023-06-01"'
cat >"$1" <<EOF
wrk.method = "POST"
wrk.path = "$path"
wrk.body = '${3:-$BODY}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer $2"
$extra

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%d duration_us=%d p50_us=%d p99_us=%d max_us=%d status=%d connect=%d read=%d write=%d timeout=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.max,
    e.status, e.connect, e.read, e.write, e.timeout))
end
EOF
}
write_lua "$T/post.lua" "$TOKEN_KEY"
write_lua "$T/post-nolog.lua" "$NOLOG_KEY"
[ "$TLS" = 1 ] && write_lua "$T/post-tls.lua" "$TLS_TOKEN_KEY"
LUA=$T/post.lua   # the script of the runs; the HTTPS section switches it

# run_wrk NAME URL PID THREADS CONNS KEY: measured run; sets R_<KEY>_* globals
declare -A R
ERRORS_SEEN=0
ERRORS_NOTE=
TLS_ERRORS_SEEN=0
run_wrk() {
    local name=$1 url=$2 pid=$3 t=$4 c=$5 key=$6 out="$T/wrk-$1-$6.txt" c0 c1 line
    c0=$(cpu_ticks "$pid")
    $WRK_PREFIX wrk -t"$t" -c"$c" -d"${SECS}s" --timeout 5s --latency -s "$LUA" "$url" >"$out" 2>&1
    c1=$(cpu_ticks "$pid")
    line=$(grep '^BENCH ' "$out")
    if [ -z "$line" ]; then
        cat "$out" >&2
        if ! kill -0 "$pid" 2>/dev/null; then
            [ -f "$T/$name.log" ] && tail -n 5 "$T/$name.log" >&2
            die "$name (pid $pid) died during the benchmark"
        fi
        die "wrk gave no result for $name at $c connection(s)"
    fi
    local requests duration_us p50_us p99_us max_us status connect read write timeout kv
    for kv in ${line#BENCH }; do local "$kv"; done
    R[$name,$key,rps]=$(awk -v r="$requests" -v d="$duration_us" 'BEGIN {printf "%.0f", r / (d / 1e6)}')
    R[$name,$key,p50]=$p50_us
    R[$name,$key,p99]=$p99_us
    R[$name,$key,cpu]=$(awk -v t=$((c1 - c0)) -v k="$TCK" -v r="$requests" 'BEGIN {printf "%.1f", r ? t * 1e6 / k / r : 0}')
    R[$name,$key,errs]="non-2xx/3xx=$status connect=$connect read=$read write=$write timeout=$timeout"
    R[$name,$key,requests]=$requests
    if [ $((status + connect + read + write + timeout)) -ne 0 ]; then
        echo "bench: $name at $c connection(s): $requests requests, errors: ${R[$name,$key,errs]}" >&2
        sed -n '/Socket errors\|Non-2xx/p' "$out" >&2
        case $name in
            ltg | ltg-nolog) ERRORS_SEEN=1; ERRORS_NOTE="$ERRORS_NOTE $name $c conn(s): ${R[$name,$key,errs]};" ;;
            ltg-tls) TLS_ERRORS_SEEN=1 ;;
        esac
    fi
}

# mock_stats: the counters of the mock the runs go to (STAT_URL);
# mock_stat FIELD [JSON]: one of them, from JSON or asked afresh
STAT_URL=$MOCK_URL
mock_stats() { curl -s "${CURL_TLS[@]}" -m 2 "$STAT_URL/_mock/stats"; }
mock_stat() {
    local v
    v=$(printf '%s' "${2:-$(mock_stats)}" | sed -n "s/.*\"$1\":\([0-9]*\).*/\1/p" | head -n1)
    echo "${v:-0}"
}

# Pinning: PIN_CPU is the last CPU we may run on; pin PID... moves every thread
# of each process there, unpin puts back the CPUs they had.
WRK_PREFIX=
PIN_CPU=
declare -A AFFINITY
if [ "$PIN" = 1 ] && command -v taskset >/dev/null; then
    PIN_CPU=$(taskset -c -p $$ 2>/dev/null | sed 's/.*: //' | tr ',' '\n' | sed 's/.*-//' | sort -n | tail -n1)
    [ "$(nproc)" -gt 1 ] || PIN_CPU=
fi
pin() {
    local p
    for p in "$@"; do
        AFFINITY[$p]=$(taskset -c -p "$p" 2>/dev/null | sed 's/.*: //')
        taskset -a -c -p "$PIN_CPU" "$p" >/dev/null 2>&1
    done
}
unpin() {
    local p
    for p in "$@"; do
        [ -n "${AFFINITY[$p]:-}" ] && taskset -a -c -p "${AFFINITY[$p]}" "$p" >/dev/null 2>&1
    done
}

# measure NAME KEY THREADS CONNS: one measured run of one target, plus the
# connections the mock accepted meanwhile (a pooling proxy opens none).
# The 1-connection runs are pinned to one core when PIN_CPU is set.
measure() {
    local name=$1 before after pids s0 s1
    echo "bench: $name, $4 connection(s), ${SECS} s" >&2
    s0=$(mock_stats)
    before=$(mock_stat connections "$s0")
    pids=("$MOCK_PID")
    [ "${PID_OF[$name]}" = "$MOCK_PID" ] || pids+=("${PID_OF[$name]}")
    WRK_PREFIX=
    if [ "$4" = 1 ] && [ -n "$PIN_CPU" ]; then
        pin "${pids[@]}"
        WRK_PREFIX="taskset -c $PIN_CPU"
    fi
    local perf_pid=
    if [ "${BENCH_PROFILE:-0}" = 1 ] && [ "$name" = ltg ] && [ "$2" = log1.2 ]; then
        perf record -F 999 -g -p "${PID_OF[$name]}" -o "$T/perf.data" -- sleep "$SECS" \
            >"$T/perf.log" 2>&1 &
        perf_pid=$!
    fi
    run_wrk "$name" "${URL[$name]}" "${PID_OF[$name]}" "$3" "$4" "$2"
    [ -n "$perf_pid" ] && wait "$perf_pid"
    [ -n "$WRK_PREFIX" ] && unpin "${pids[@]}"
    WRK_PREFIX=
    s1=$(mock_stats)
    after=$(mock_stat connections "$s1")
    R[$name,$2,upconns]=$((after - before))
    # TLS handshakes the mock completed during the run: all, and the resumed ones
    R[$name,$2,hs]=$(($(mock_stat tls_handshakes "$s1") - $(mock_stat tls_handshakes "$s0")))
    R[$name,$2,resumed]=$(($(mock_stat tls_resumed "$s1") - $(mock_stat tls_resumed "$s0")))
    kill -0 "${PID_OF[$name]}" 2>/dev/null || die "$name (pid ${PID_OF[$name]}) died during the benchmark"
}

# ---------------------------------------------------------------- conditions
CPU_MODEL=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
NGINX_VER=$(nginx -v 2>&1 | sed 's/.*nginx\///')
WRK_VER=$(wrk -v 2>&1 | head -n1 | awk '{print $2}')
LTG_REV=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "?")
git -C "$ROOT" diff --quiet HEAD -- ltg.c ltg.h 2>/dev/null || LTG_REV="$LTG_REV + uncommitted changes to ltg.c/ltg.h"
if [ ltg.c -nt ltg ] || [ ltg.h -nt ltg ]; then
    LTG_REV="$LTG_REV (WARNING: ./ltg is older than its sources: run make ltg)"
    echo "bench: warning: ./ltg is older than ltg.c/ltg.h; measuring it anyway" >&2
fi

# Each comparison is a pair, nginx (A) against ltg (B), measured in ROUNDS
# rounds of A B B A (each run after its own warm-up), so that a drift of the
# machine over minutes (this VM's throughput wanders by 20 %) falls on both
# sides alike. A round gives one ratio, the mean of B's two runs over the
# mean of A's; the report is the median of the rounds' ratios and their
# spread (lowest-highest). Two pairs: both with an access log to a file
# (nginx: JSON lines, buffer=64k flush=1s; ltg: its JSON line per request,
# written once per loop turn) and both without. ltg keeps its durable
# ledger, token-key auth, budgets and metrics in both.
ROUNDS=${BENCH_ROUNDS:-3}
P99_SECS=${BENCH_P99_SECONDS:-10}
IDLE_CLIENTS=${BENCH_IDLE_CLIENTS:-1000}
case $ROUNDS$P99_SECS$IDLE_CLIENTS in *[!0-9]*) die "BENCH_ROUNDS, BENCH_P99_SECONDS, BENCH_IDLE_CLIENTS are whole numbers" ;; esac
TARGETS=(mock-direct nginx ltg nginx-nolog ltg-nolog)
declare -A URL=([mock-direct]=$MOCK_URL [nginx]=http://127.0.0.1:$NGINX_PORT [ltg]=http://127.0.0.1:$LTG_PORT
                [nginx-nolog]=http://127.0.0.1:$NGINX_NOLOG_PORT [ltg-nolog]=http://127.0.0.1:$LTG_NOLOG_PORT)
declare -A PID_OF=([mock-direct]=$MOCK_PID [nginx]=$NGINX_PID [ltg]=$LTG_PID
                   [nginx-nolog]=$NGINX_PID [ltg-nolog]=$LTG_NOLOG_PID)
declare -A LUA_OF=([mock-direct]=$T/post.lua [nginx]=$T/post.lua [ltg]=$T/post.lua
                   [nginx-nolog]=$T/post.lua [ltg-nolog]=$T/post-nolog.lua)
LOADAVG=$(cut -d' ' -f1-3 /proc/loadavg)
START=$(date +%s)
curl -s -m 2 -X POST "$MOCK_URL/_mock/reset" >/dev/null
warm_up() { # NAME
    [ "$WARM" -gt 0 ] || return 0
    echo "bench: $1, warm-up ${WARM} s at 64 connections" >&2
    wrk -t2 -c64 -d"${WARM}s" -s "$LUA" "${URL[$1]}" >>"$T/warm-$1.txt" 2>&1
}
# pair_rounds A B THREADS CONNS TAG ORDER: ROUNDS rounds; ORDER abba runs
# A B B A in each, ab alternates A B and B A from one round to the next.
# Run i of round r of target X is R[X,TAGr.i,*].
pair_rounds() {
    local a=$1 b=$2 t=$3 c=$4 tag=$5 order r n i seq
    for r in $(seq "$ROUNDS"); do
        seq="$a $b $b $a"
        [ "$6" = ab ] && { seq="$a $b"; [ $((r % 2)) = 0 ] && seq="$b $a"; }
        i=0
        for n in $seq; do
            i=$((i + 1))
            LUA=${LUA_OF[$n]}
            warm_up "$n"
            measure "$n" "$tag$r.$i" "$t" "$c"
        done
    done
    LUA=$T/post.lua
}
# pair_stat A B TAG METRIC: "median-of-A median-of-B ratio-median ratio-low ratio-high",
# the medians over all runs, the ratios B/A per round
pair_stat() {
    local a=$1 b=$2 tag=$3 m=$4 k side rest
    for k in "${!R[@]}"; do
        case $k in "$a,$tag"*",$m") side=A ;; "$b,$tag"*",$m") side=B ;; *) continue ;; esac
        rest=${k#*,"$tag"}
        echo "$side ${rest%%.*} ${R[$k]}"
    done | awk '
        { s[$1, $2] += $3; n[$1, $2]++; r[$2] = 1; v[$1] = v[$1] " " $3 }
        END {
            printf "%s|%s|", v["A"], v["B"]
            for (x in r) if (n["A", x] && n["B", x] && s["A", x] > 0)
                printf " %.4f", (s["B", x] / n["B", x]) / (s["A", x] / n["A", x])
            print ""
        }' | {
        IFS='|' read -r va vb ratios
        # shellcheck disable=SC2086
        echo "$(median $va) $(median $vb) $(median $ratios)" \
            "$(printf '%s\n' $ratios | sort -n | head -n1) $(printf '%s\n' $ratios | sort -n | tail -n1)"
    }
}
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

# The reference: the mock alone, once at each connection count.
warm_up mock-direct
measure mock-direct c1 1 1
measure mock-direct c64 2 64
# Throughput and CPU at 64 connections, both pairs.
pair_rounds nginx ltg 2 64 log abba
pair_rounds nginx-nolog ltg-nolog 2 64 nolog abba
# The tail at 1 connection, with the logs: P99_SECS runs, pinned as above.
SECS=$P99_SECS pair_rounds nginx ltg 1 1 tail ab
# 1 connection while IDLE_CLIENTS keep-alive clients (each served one
# request, then silent) stay connected to each of nginx and ltg.
idle_hold() { # PORT N SECONDS: hold N connections open, printing "held K" once they are
    python3 - "$@" <<'PY'
import socket, sys, time
port, n, secs = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
socks, ok = [], 0
for _ in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n")
    socks.append(s)
for s in socks:
    s.settimeout(10)
    if s.recv(4096).startswith(b"HTTP/1.1 "):
        ok += 1
print("held", ok, flush=True)
time.sleep(secs)
PY
}
for n in "${TARGETS[@]}"; do R[$n,hwm]=$(hwm_kb "${PID_OF[$n]}"); done   # before the idle clients
IDLE_OK=1
if [ "$IDLE_CLIENTS" -gt 0 ]; then
    idle_secs=$((ROUNDS * 4 * (SECS + WARM) + 60))
    idle_hold "$NGINX_PORT" "$IDLE_CLIENTS" "$idle_secs" >"$T/idle-nginx.txt" 2>&1 &
    IDLE_N=$!
    idle_hold "$LTG_PORT" "$IDLE_CLIENTS" "$idle_secs" >"$T/idle-ltg.txt" 2>&1 &
    IDLE_L=$!
    PIDS+=("$IDLE_N" "$IDLE_L")
    for _ in $(seq 1 300); do
        grep -q held "$T/idle-nginx.txt" && grep -q held "$T/idle-ltg.txt" && break
        sleep 0.1
    done
    for f in nginx ltg; do
        grep -q "^held $IDLE_CLIENTS\$" "$T/idle-$f.txt" ||
            { echo "bench: idle clients of $f: $(cat "$T/idle-$f.txt")" >&2; IDLE_OK=0; }
    done
    WARM=0 pair_rounds nginx ltg 1 1 idle abba   # a warm-up would add 64 more clients
    R[nginx,hwm_idle]=$(hwm_kb "$NGINX_PID") R[ltg,hwm_idle]=$(hwm_kb "$LTG_PID")
    kill "$IDLE_N" "$IDLE_L" 2>/dev/null
fi
ELAPSED=$(($(date +%s) - START))

# after the load, ltg must still answer correctly
check ltg-after "http://127.0.0.1:$LTG_PORT" "$T/ref-up"
[ "$CHECK_FAIL" = 0 ] || ERRORS_SEEN=1

# ---------------------------------------------------------------- report
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 == 0) print "n/a"; else printf "%.2fx", a / b }'; }
mb() { awk -v k="$1" 'BEGIN {printf "%.1f MiB", k / 1024}'; }
# stat_row LABEL A B TAG METRIC: a table row from pair_stat; sets S_MED S_LO S_HI
stat_row() {
    local ma mb_ rest
    read -r ma mb_ S_MED S_LO S_HI <<<"$(pair_stat "$2" "$3" "$4" "$5")"
    printf '| %s | %s | %s | %.2fx | %.2f-%.2f |\n' "$1" "$ma" "$mb_" "$S_MED" "$S_LO" "$S_HI"
}
# The figures later sections compare with: the medians of the log pair.
read -r "R[nginx,c64,rps]" "R[ltg,c64,rps]" _ <<<"$(pair_stat nginx ltg log rps)"

echo
echo "## ltg vs nginx (same upstream, same run)"
echo
echo "- machine: $(nproc) cores ($CPU_MODEL), $(uname -sr); load average before the runs: $LOADAVG"
if [ -n "$PIN_CPU" ]; then
    echo "- 1-connection runs: wrk, the mock and the proxy all pinned to CPU $PIN_CPU, the same for both sides"
    echo "  (cross-core wake-ups in this VM add random tens of us; BENCH_PIN=0 to unpin); 64-connection runs:"
    echo "  nothing pinned, wrk -t2, the mock and the proxy share all cores"
else
    echo "- nothing pinned: wrk, the mock and the proxy share all cores"
fi
echo "- load: wrk $WRK_VER, POST /v1/chat/completions, ${#BODY}-byte JSON body, keep-alive; ${SECS} s per run"
echo "  (the tail: ${P99_SECS} s), each after ${WARM} s of warm-up at 64 connections (not in the idle-clients runs)"
echo "- pairs: nginx then ltg in $ROUNDS rounds of A B B A (the tail: A B, then B A, ...); a round's ratio is"
echo "  ltg's mean over nginx's mean in that round; shown: the medians over all runs, the median of the"
echo "  rounds' ratios and their spread (lowest-highest)"
echo "- upstream: tests/mock (fixed small JSON answer, one thread per connection), 127.0.0.1:$MOCK_PORT"
echo "- nginx $NGINX_VER: worker_processes 1 (ltg is single-threaded: one core against one core), upstream"
echo "  keepalive 64, proxy_http_version 1.1; access log: JSON lines to a file, buffer=64k flush=1s, or off"
echo "- ltg $LTG_REV: one provider (the mock), one alias, token-key auth, the durable ledger (every"
echo "  event fdatasync'ed before its turn ends), metrics; access log: to a file, or --access-log off"
echo "- CPU us/req = (utime+stime of the proxy process over the run) / requests; latency: wrk's, in us"
echo "- reference, the mock alone: ${R[mock-direct,c1,rps]} requests/s at 1 connection (p50 ${R[mock-direct,c1,p50]} us,"
echo "  p99 ${R[mock-direct,c1,p99]} us), ${R[mock-direct,c64,rps]} at 64"
echo
echo "| metric | nginx | ltg | ltg/nginx (median) | spread of the rounds |"
echo "| --- | ---: | ---: | ---: | ---: |"
stat_row "requests/s, 64 conns, access logs on" nginx ltg log rps; RPS_LOG="$S_MED $S_LO $S_HI"
stat_row "requests/s, 64 conns, access logs off" nginx-nolog ltg-nolog nolog rps; RPS_NOLOG="$S_MED $S_LO $S_HI"
stat_row "CPU us/request, 64 conns, access logs on" nginx ltg log cpu; CPU_LOG="$S_MED $S_LO $S_HI"
stat_row "CPU us/request, 64 conns, access logs off" nginx-nolog ltg-nolog nolog cpu
stat_row "p99 latency us, 64 conns, access logs on" nginx ltg log p99
stat_row "requests/s, 1 conn (${P99_SECS} s runs)" nginx ltg tail rps
stat_row "p50 latency us, 1 conn" nginx ltg tail p50
stat_row "p99 latency us, 1 conn" nginx ltg tail p99; P99_1="$S_MED $S_LO $S_HI"
if [ "$IDLE_CLIENTS" -gt 0 ]; then
    stat_row "requests/s, 1 conn, $IDLE_CLIENTS idle clients" nginx ltg idle rps; IDLE_R="$S_MED $S_LO $S_HI"
    stat_row "CPU us/request, 1 conn, $IDLE_CLIENTS idle clients" nginx ltg idle cpu
fi
echo "| peak RSS (VmHWM), with logs | $(mb "${R[nginx,hwm]}") | $(mb "${R[ltg,hwm]}") | $(ratio "${R[ltg,hwm]}" "${R[nginx,hwm]}") | |"
[ "$IDLE_CLIENTS" -gt 0 ] &&
    echo "| peak RSS with $IDLE_CLIENTS idle clients | $(mb "${R[nginx,hwm_idle]}") | $(mb "${R[ltg,hwm_idle]}") | $(ratio "${R[ltg,hwm_idle]}" "${R[nginx,hwm_idle]}") | |"
echo
echo "p99 at 1 conn, each run (us): nginx $(for k in "${!R[@]}"; do case $k in nginx,tail*,p99) echo -n "${R[$k]} ";; esac; done)/" \
     "ltg $(for k in "${!R[@]}"; do case $k in ltg,tail*,p99) echo -n "${R[$k]} ";; esac; done)"
echo "nginx master RSS (not counted above): $(mb "$(hwm_kb "$NGINX_MASTER")"); benchmark time ${ELAPSED} s"
echo
if [ -s "$T/perf.data" ]; then
    echo "### ltg's profile at 64 connections (perf, self time, top 25)"
    echo
    echo '```'
    perf report -i "$T/perf.data" --no-children --stdio --sort symbol 2>/dev/null |
        grep -E '^ +[0-9.]+%' | head -n 25
    echo '```'
    echo
fi
pct() { awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 == 0) print "n/a"; else printf "%.3f %%", 100 * a / b }'; }

# ---------------------------------------------------------------- the HTTPS runs
# After the plain table, so that it is out even if these runs fail. The same
# load at 64 connections, to the TLS mock: wrk speaking TLS to it
# (mock-direct), nginx's second server, and ltg-tls. Each gets a warm-up
# first, which opens its upstream connections (ltg resumes the session of
# the correctness check's connection; nginx its own cached session).
if [ "$TLS" = 1 ]; then
    TLS_TARGETS=(mock-direct-tls nginx-tls ltg-tls)
    URL[mock-direct-tls]=https://127.0.0.1:$MOCK_TLS_PORT
    URL[nginx-tls]=http://127.0.0.1:$NGINX_TLS_PORT
    URL[ltg-tls]=http://127.0.0.1:$LTG_TLS_PORT
    PID_OF[mock-direct-tls]=$MOCK_TLS_PID
    PID_OF[nginx-tls]=$NGINX_PID
    PID_OF[ltg-tls]=$LTG_TLS_PID
    LUA=$T/post-tls.lua
    STAT_URL=$MOCK_TLS_URL
    TLS_LOADAVG=$(cut -d' ' -f1-3 /proc/loadavg)
    TLS_START=$(date +%s)
    for n in "${TLS_TARGETS[@]}"; do warm_up "$n"; measure "$n" c64 2 64; done
    R[ltg-tls,hwm]=$(hwm_kb "$LTG_TLS_PID")
    TLS_ELAPSED=$(($(date +%s) - TLS_START))
    check ltg-tls-after "http://127.0.0.1:$LTG_TLS_PORT" "$T/ref-tls-up" "$TLS_TOKEN_KEY"
    [ "$CHECK_FAIL" = 0 ] || TLS_ERRORS_SEEN=1
    # Every request ltg-tls sent, warm-ups and checks included: the mock counts
    # them under the upstream name, which only ltg sends.
    TLS_REQS=$(mock_stat "$UPSTREAM_MODEL")
    # ltg logs its handshake counts when it stops.
    kill -TERM "$LTG_TLS_PID" 2>/dev/null
    wait "$LTG_TLS_PID" 2>/dev/null
    for i in "${!PIDS[@]}"; do [ "${PIDS[$i]}" = "$LTG_TLS_PID" ] && unset 'PIDS[i]'; done   # gone: not ours to kill later
    TLS_LINE=$(grep -o 'TLS handshakes: [0-9]* full, [0-9]* resumed' "$T/ltg-tls.log" | tail -n1)
    TLS_FULL=$(printf '%s' "$TLS_LINE" | sed -n 's/.*: \([0-9]*\) full.*/\1/p')
    TLS_RESUMED=$(printf '%s' "$TLS_LINE" | sed -n 's/.* \([0-9]*\) resumed.*/\1/p')
    STAT_URL=$MOCK_URL   # the sections after this one count the plain mock's requests
fi

if [ "$TLS" = 1 ]; then
    echo "## ltg vs nginx over HTTPS (same TLS upstream, same run)"
    echo
    echo "- upstream: tests/mock in TLS mode (TLS 1.2 with BearSSL, ECDSA P-256 certificate for DNS:localhost from a"
    echo "  test CA, a session cache), 127.0.0.1:$MOCK_TLS_PORT; mock-direct is wrk speaking TLS to it (OpenSSL)"
    echo "- nginx: the same single worker, a second server: proxy_pass https:// with upstream keepalive 64,"
    echo "  proxy_ssl_server_name on, proxy_ssl_name localhost, proxy_ssl_verify on against the test CA,"
    echo "  proxy_ssl_session_reuse on"
    echo "- ltg: a second process (so that its handshake counts are these runs'), provider https://localhost:$MOCK_TLS_PORT/v1,"
    echo "  --ca-file the test CA"
    echo "- load: as above at 64 connections (wrk -t2 -c64), ${SECS} s per run, each after ${WARM} s of warm-up;"
    echo "  load average before: $TLS_LOADAVG; time ${TLS_ELAPSED} s"
    echo "- handshakes during a run: what the mock completed between the start and the end of the measured run;"
    echo "  wrk ends each warm-up with requests in flight, and a proxy closes the upstream connection of a request"
    echo "  whose client left, so a run starts by replacing those (ltg: resumed handshakes)"
    echo
    echo "| metric | mock-direct | nginx | ltg | ltg/nginx |"
    echo "| --- | ---: | ---: | ---: | ---: |"
    trow() { # LABEL METRIC
        local m=${R[mock-direct-tls,c64,$2]} n=${R[nginx-tls,c64,$2]} l=${R[ltg-tls,c64,$2]}
        echo "| $1 | $m | $n | $l | $(ratio "$l" "$n") |"
    }
    trow "requests/s, 64 conns" rps
    trow "p50 latency us, 64 conns" p50
    trow "p99 latency us, 64 conns" p99
    trow "CPU us/request, 64 conns" cpu
    echo "| TLS handshakes during the run (of them resumed) | ${R[mock-direct-tls,c64,hs]} (${R[mock-direct-tls,c64,resumed]}) | ${R[nginx-tls,c64,hs]} (${R[nginx-tls,c64,resumed]}) | ${R[ltg-tls,c64,hs]} (${R[ltg-tls,c64,resumed]}) | |"
    echo "| connections the mock accepted during the run | ${R[mock-direct-tls,c64,upconns]} | ${R[nginx-tls,c64,upconns]} | ${R[ltg-tls,c64,upconns]} | |"
    echo
    if [ -n "$TLS_LINE" ]; then
        echo "ltg's stop line: \"$TLS_LINE\" for $TLS_REQS requests to the https provider (warm-ups and checks"
        echo "included): full handshakes $TLS_FULL / $TLS_REQS = $(pct "$TLS_FULL" "$TLS_REQS"), any handshake $((TLS_FULL + TLS_RESUMED)) / $TLS_REQS = $(pct $((TLS_FULL + TLS_RESUMED)) "$TLS_REQS");"
    else
        echo "ltg did not log its \"TLS handshakes: N full, M resumed\" line when it stopped (see $T/ltg-tls.log);"
    fi
    echo "ltg (HTTPS) peak RSS $(mb "${R[ltg-tls,hwm]}")"
    echo
fi

# ---------------------------------------------------------------- short streams
# The same request with "stream": true: the mock answers 3 content events, the
# finish event and [DONE] (and, to ltg, which asks for it, the usage chunk,
# which ltg keeps from the client). At 64 connections, nginx (its default
# proxy_buffering) against ltg, which relays every event as it comes.
STREAM_BODY='{"model":"'$ALIAS'","messages":[{"role":"user","content":"hi"}],"stream":true}'
write_lua "$T/stream.lua" "$TOKEN_KEY" "$STREAM_BODY"
LUA=$T/stream.lua
curl -s -m 5 -X POST "http://127.0.0.1:$LTG_PORT/v1/chat/completions" -H "Authorization: Bearer $TOKEN_KEY" \
    -d "$STREAM_BODY" >"$T/stream-check.txt"
[ "$(grep -c '"content":"word' "$T/stream-check.txt")" = 3 ] && grep -q '^data: \[DONE\]' "$T/stream-check.txt" ||
    die "ltg's stream answer is not the mock's 3 events and [DONE]: $(head -c 300 "$T/stream-check.txt")"
LUA_OF[nginx]=$T/stream.lua LUA_OF[ltg]=$T/stream.lua
pair_rounds nginx ltg 2 64 stream abba
LUA_OF[nginx]=$T/post.lua LUA_OF[ltg]=$T/post.lua
echo "### short streams (5 SSE events each), 64 connections, access logs on, $ROUNDS rounds of A B B A"
echo
echo "| metric | nginx | ltg | ltg/nginx (median) | spread of the rounds |"
echo "| --- | ---: | ---: | ---: | ---: |"
stat_row "requests/s" nginx ltg stream rps; STREAM_R="$S_MED $S_LO $S_HI"
stat_row "CPU us/request" nginx ltg stream cpu
stat_row "p99 latency us" nginx ltg stream p99
echo

# ---------------------------------------------------------------- several instances
# --cluster on the hot path (issue 24). A group and a key with a budget and an
# rpm_limit set never to refuse, so that every request is held and settled in
# the shared store (ltg_hold_v1, ltg_settle_v1). Pairs in rounds of A B B A as
# above, at 64 connections: one instance without --cluster against one with it
# (the same limits, held in memory or in Redis); then one instance with
# --cluster against three behind HAProxy (which adds a hop of its own; on 2
# cores, wrk, the mock, Redis, HAProxy and three ltg share them).
if [ "$CLUSTER" = 1 ]; then
    CL_PORT=$(free_port)
    mkdir -p "$T/redis"
    redis-server --port "$CL_PORT" --bind 127.0.0.1 --dir "$T/redis" --appendonly yes --appendfsync always \
        --save '' --maxmemory-policy noeviction --logfile "$T/redis/redis.log" &
    PIDS+=($!)
    for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$CL_PORT") 2>/dev/null && break; sleep 0.1; done
    limited_key() { # ADMIN_PORT VAR: a group and key with a budget and an rpm_limit that never refuse
        local ca="http://127.0.0.1:$1/v2/llm_token_gateway" gid
        gid=$(curl -s "$ca/token_groups" -H "Authorization: Bearer $LTG_BENCH_ADMIN_KEY" -H "Idempotency-Key: bench-cg-$$-$1" \
              -d "{\"name\":\"bench-cluster\",\"allowed_models\":[\"$ALIAS\"],\"max_budget\":1000000,\"budget_duration\":\"1d\",\"rpm_limit\":1000000}" |
              sed -n 's/.*"id":"\([^"]*\)".*/\1/p' | head -n 1)
        printf -v "$2" '%s' "$(curl -s "$ca/token_keys" -H "Authorization: Bearer $LTG_BENCH_ADMIN_KEY" -H "Idempotency-Key: bench-ck-$$-$1" \
              -d "{\"name\":\"bench\",\"token_group_id\":\"$gid\"}" | sed -n 's/.*"token":"\(ltg_sk_[^"]*\)".*/\1/p')"
        [ -n "${!2}" ] || die "could not provision the cluster section's group and key"
    }
    launch_ltg ltg-solo "$T/ltg.json"
    URL[ltg-solo]=http://127.0.0.1:$L_PORT PID_OF[ltg-solo]=$L_PID
    limited_key "$L_ADMIN_PORT" SOLO_KEY
    declare -A CL_HTTP CL_ADMIN
    CL_PIDS=()
    for i in 1 2 3; do
        launch_ltg "ltg-cl$i" "$T/ltg.json" --cluster "redis://127.0.0.1:$CL_PORT"
        CL_HTTP[$i]=$L_PORT CL_ADMIN[$i]=$L_ADMIN_PORT
        CL_PIDS+=("$L_PID")
    done
    URL[ltg-cluster]=http://127.0.0.1:${CL_HTTP[1]} PID_OF[ltg-cluster]=${CL_PIDS[0]}
    limited_key "${CL_ADMIN[1]}" CL_KEY
    LB_PORT=$(free_port)
    printf '%s\n' "global" "    maxconn 4096" "defaults" "    mode http" "    timeout connect 2s" \
        "    timeout client 60s" "    timeout server 60s" "frontend ltg" "    bind 127.0.0.1:$LB_PORT" \
        "    default_backend ltgs" "backend ltgs" "    balance roundrobin" \
        "    server ltg1 127.0.0.1:${CL_HTTP[1]}" "    server ltg2 127.0.0.1:${CL_HTTP[2]}" \
        "    server ltg3 127.0.0.1:${CL_HTTP[3]}" >"$T/haproxy.cfg"
    haproxy -f "$T/haproxy.cfg" -db >"$T/haproxy.log" 2>&1 &
    HA_PID=$!
    PIDS+=("$HA_PID")
    for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:$LB_PORT/healthz" && break; sleep 0.1; done
    URL[ltg-three]=http://127.0.0.1:$LB_PORT PID_OF[ltg-three]=$HA_PID
    write_lua "$T/post-solo.lua" "$SOLO_KEY"
    write_lua "$T/post-cluster.lua" "$CL_KEY"
    LUA_OF[ltg-solo]=$T/post-solo.lua LUA_OF[ltg-cluster]=$T/post-cluster.lua LUA_OF[ltg-three]=$T/post-cluster.lua
    for n in ltg-solo ltg-cluster ltg-three; do
        k=$CL_KEY
        [ "$n" = ltg-solo ] && k=$SOLO_KEY
        st=$(curl -s -o /dev/null -w '%{http_code}' -m 5 "${URL[$n]}/v1/chat/completions" -H "Authorization: Bearer $k" --data-binary "$BODY")
        [ "$st" = 200 ] || die "$n answered $st to the bench request"
    done
    fcalls() { redis-cli -p "$CL_PORT" info commandstats | sed -n 's/^cmdstat_fcall:calls=\([0-9]*\).*/\1/p'; }
    pair_rounds ltg-solo ltg-cluster 2 64 cl abba
    CL_CALLS0=$(fcalls)
    CL_REQS0=$(mock_stat "$UPSTREAM_MODEL")
    LUA=$T/post-cluster.lua
    wrk -t2 -c64 -d"${SECS}s" -s "$LUA" "${URL[ltg-cluster]}" >/dev/null 2>&1
    CL_PER_REQ=$(awk -v c=$(($(fcalls) - CL_CALLS0)) -v r=$(($(mock_stat "$UPSTREAM_MODEL") - CL_REQS0)) \
        'BEGIN { printf "%.2f", r ? c / r : 0 }')
    LUA=$T/post.lua
    pair_rounds ltg-cluster ltg-three 2 64 three abba
    echo "### several instances (--cluster, one Redis), 64 connections, $ROUNDS rounds of A B B A"
    echo
    echo "- a group and key with a budget and an rpm_limit that never refuse: every request held and settled in the"
    echo "  store; Redis $(redis-server --version | sed -n 's/.*v=\([0-9.]*\).*/\1/p'), appendfsync always, on this VM's disk"
    echo "- Redis function calls per request with --cluster: $CL_PER_REQ (FCALLs over the requests the mock saw"
    echo "  in one more ${SECS} s run; renewals and trims included)"
    echo "- three: three ltg instances with --cluster behind HAProxy (round robin); its CPU column is HAProxy's"
    echo
    echo "| metric | A | B | B/A (median) | spread of the rounds |"
    echo "| --- | ---: | ---: | ---: | ---: |"
    stat_row "requests/s: one instance (A) vs one with --cluster (B)" ltg-solo ltg-cluster cl rps; CL_R="$S_MED $S_LO $S_HI"
    stat_row "CPU us/request of ltg: the same" ltg-solo ltg-cluster cl cpu
    stat_row "p99 latency us: the same" ltg-solo ltg-cluster cl p99
    stat_row "requests/s: one with --cluster (A) vs three behind HAProxy (B)" ltg-cluster ltg-three three rps; THREE_R="$S_MED $S_LO $S_HI"
    echo
fi

# ---------------------------------------------------------------- traffic
# Deployments and limits on the hot path (issue 15): ltg-traffic is this
# build with the bench alias spread over two deployments (both to the mock,
# weights 1:1: every request picks one) and rate limits and a budget on its
# group and on its key, set high enough never to refuse (every request is
# checked, held and settled in both); ltg-before is BENCH_TRAFFIC_BASE built
# here, one deployment, no limits: ltg as it was before the issue. The two
# alternate, BENCH_TRAFFIC_ROUNDS rounds of a warm-up and a 64-connection
# run each, in the order A B, B A, A B... so that a drift of the machine
# (this VM's throughput wanders by 20 % over minutes) falls on both;
# medians compared.
TRAFFIC_BASE=${BENCH_TRAFFIC_BASE-b40c800}
TRAFFIC_ROUNDS=${BENCH_TRAFFIC_ROUNDS:-4}
# interleave A B ROUNDS: ROUNDS rounds of a warm-up and a 64-connection run of each (URL, PID_OF
# and LUA_OF[name] set), in the order A B, B A, A B... so that a drift of the machine (this VM's
# throughput wanders by 20 % over minutes) falls on both; each one's requests/s into RUNS[name]
declare -A RUNS=() LUA_OF=()
interleave() {
    local round n order
    for round in $(seq "$3"); do
        order="$1 $2"
        [ $((round % 2)) = 0 ] && order="$2 $1"
        for n in $order; do
            LUA=${LUA_OF[$n]}
            warm_up "$n"
            measure "$n" "c64r$round" 2 64
            RUNS[$n]="${RUNS[$n]:-} ${R[$n,c64r$round,rps]}"
        done
    done
    LUA=$T/post.lua
}
if [ -n "$TRAFFIC_BASE" ] && build_at "$TRAFFIC_BASE" "$T/ltg-before"; then
    cat >"$T/ltg-traffic.json" <<EOF
{
  "providers": { "mock": { "base_url": "$MOCK_URL/v1", "api_key_env": "LTG_BENCH_MOCK_KEY" } },
  "models": {
    "$ALIAS": { "deployments": [ { "provider": "mock", "upstream_model": "bench-mode1" },
                                 { "provider": "mock", "upstream_model": "bench-mode2" } ],
                "input_usd_per_mtok": 0.60, "output_usd_per_mtok": 2.50 }
  },
  "admin_keys": [ { "key_env": "LTG_BENCH_ADMIN_KEY", "permissions": ["*"] } ]
}
EOF
    # traffic_key ADMIN_PORT VAR: a group and a key with the limits, the key's secret into VAR
    traffic_key() {
        local ta="http://127.0.0.1:$1/v2/llm_token_gateway" limits='"rpm_limit":1000000,"tpm_limit":1000000000,"max_budget":1000000,"budget_duration":"1mo"' gid
        gid=$(curl -s "$ta/token_groups" -H "Authorization: Bearer $LTG_BENCH_ADMIN_KEY" -H "Idempotency-Key: bench-tg-$$-$1" \
              -d "{\"name\":\"bench\",\"allowed_models\":[\"$ALIAS\"],$limits}" | sed -n 's/.*"id":"\([^"]*\)".*/\1/p' | head -n 1)
        printf -v "$2" '%s' "$(curl -s "$ta/token_keys" -H "Authorization: Bearer $LTG_BENCH_ADMIN_KEY" -H "Idempotency-Key: bench-tk-$$-$1" \
              -d "{\"name\":\"bench\",\"token_group_id\":\"$gid\",$limits}" | sed -n 's/.*"token":"\(ltg_sk_[^"]*\)".*/\1/p')"
        [ -n "${!2}" ] || die "could not provision the traffic section's group and key"
    }
    launch_ltg ltg-traffic "$T/ltg-traffic.json"
    TR_PORT=$L_PORT TR_PID=$L_PID
    traffic_key "$L_ADMIN_PORT" TR_KEY
    if [ "${BENCH_TRAFFIC_SAME:-0}" = 1 ]; then # the base with the same catalog and limits (one that has them): the cost of what came since
        LTG_BIN=$T/ltg-before launch_ltg ltg-before "$T/ltg-traffic.json"
        BEFORE_PORT=$L_PORT BEFORE_PID=$L_PID
        traffic_key "$L_ADMIN_PORT" BEFORE_KEY
    else
        LTG_BIN=$T/ltg-before launch_ltg ltg-before "$T/ltg.json"
        BEFORE_PORT=$L_PORT BEFORE_PID=$L_PID
        provision_key "$L_ADMIN_PORT" BEFORE_KEY
    fi
    write_lua "$T/post-traffic.lua" "$TR_KEY"
    write_lua "$T/post-before.lua" "$BEFORE_KEY"
    URL[ltg-traffic]=http://127.0.0.1:$TR_PORT URL[ltg-before]=http://127.0.0.1:$BEFORE_PORT
    PID_OF[ltg-traffic]=$TR_PID PID_OF[ltg-before]=$BEFORE_PID
    LUA_OF[ltg-traffic]=$T/post-traffic.lua LUA_OF[ltg-before]=$T/post-before.lua
    s0=$(mock_stats)
    interleave ltg-before ltg-traffic "$TRAFFIC_ROUNDS"
    s1=$(mock_stats)
    TR_A=$(($(mock_stat bench-mode1 "$s1") - $(mock_stat bench-mode1 "$s0")))
    TR_B=$(($(mock_stat bench-mode2 "$s1") - $(mock_stat bench-mode2 "$s0")))
    # shellcheck disable=SC2086
    TR_BEFORE=$(median ${RUNS[ltg-before]}) TR_NOW=$(median ${RUNS[ltg-traffic]})
    TR_ERR=${R[ltg-traffic,c64r1,errs]}
    for round in $(seq "$TRAFFIC_ROUNDS"); do
        case ${R[ltg-traffic,c64r$round,errs]} in *=[1-9]*) ERRORS_SEEN=1; TR_ERR=${R[ltg-traffic,c64r$round,errs]} ;; esac
    done
    echo "### deployments and limits on the hot path (same run, interleaved)"
    echo
    if [ "${BENCH_TRAFFIC_SAME:-0}" = 1 ]; then
        echo "- ltg-before: $TRAFFIC_BASE; ltg-traffic: this build; both with the alias over two deployments (1:1) and"
    else
        echo "- ltg-before: $TRAFFIC_BASE (before issue 15), one deployment, no limits; ltg-traffic: this build, the alias"
        echo -n "  over two deployments (1:1) and"
    fi
    echo "  rpm_limit, tpm_limit and a 1mo budget on both the group and the key (never reached)"
    echo "- $TRAFFIC_ROUNDS rounds, each: ${WARM} s warm-up and ${SECS} s at 64 connections of each, in the order A B, B A, A B..."
    echo
    echo "| metric | ltg-before | ltg-traffic | ratio |"
    echo "| --- | ---: | ---: | ---: |"
    echo "| requests/s, 64 conns (median; the runs) | $TR_BEFORE (${RUNS[ltg-before]# }) | $TR_NOW (${RUNS[ltg-traffic]# }) | $(ratio "$TR_NOW" "$TR_BEFORE") |"
    echo "| requests to each deployment (warm-ups included) | | $TR_A : $TR_B | |"
    echo
    TRAFFIC_T=$(awk -v a="$TR_NOW" -v b="$TR_BEFORE" 'BEGIN {print (a >= 0.97 * b) ? 1 : 0}')
    kill "$BEFORE_PID" "$TR_PID" 2>/dev/null; wait "$BEFORE_PID" "$TR_PID" 2>/dev/null
fi

# ---------------------------------------------------------------- the chain
# The chained ledger (issue 25): ltg-chained is this build with
# --ledger-key-env (one HMAC-SHA-256 of each spend event's record);
# ltg-unchained is BENCH_CHAIN_BASE (default 60e14ca, the build before the
# issue) built here, the same catalog; interleaved as above. Then ltg verify
# reads what ltg-chained wrote: its time per event.
CHAIN_BASE=${BENCH_CHAIN_BASE-60e14ca}
CHAIN_ROUNDS=${BENCH_CHAIN_ROUNDS:-4}
LTG_BENCH_LEDGER_KEY=$(head -c 32 /dev/urandom | base64)
export LTG_BENCH_LEDGER_KEY
# versus REV BEFORE NOW ROUNDS [ARG...]: git revision REV built here (as BEFORE) and this build
# (as NOW, with ARGs) on the same catalog, each with a key of its own, interleaved for ROUNDS
# rounds; their medians into AB_BEFORE and AB_NOW. 1 when REV cannot be built here.
versus() {
    local rev=$1 before=$2 now=$3 rounds=$4 now_pid before_pid
    shift 4
    build_at "$rev" "$T/$before" || return 1
    launch_ltg "$now" "$T/ltg.json" "$@"
    now_pid=$L_PID URL[$now]=http://127.0.0.1:$L_PORT PID_OF[$now]=$L_PID
    provision_key "$L_ADMIN_PORT" AB_KEY
    write_lua "$T/post-$now.lua" "$AB_KEY"
    LTG_BIN=$T/$before launch_ltg "$before" "$T/ltg.json"
    before_pid=$L_PID URL[$before]=http://127.0.0.1:$L_PORT PID_OF[$before]=$L_PID
    provision_key "$L_ADMIN_PORT" AB_KEY
    write_lua "$T/post-$before.lua" "$AB_KEY"
    LUA_OF[$now]=$T/post-$now.lua LUA_OF[$before]=$T/post-$before.lua
    interleave "$before" "$now" "$rounds"
    # shellcheck disable=SC2086
    AB_BEFORE=$(median ${RUNS[$before]}) AB_NOW=$(median ${RUNS[$now]})
    kill "$before_pid" "$now_pid" 2>/dev/null; wait "$before_pid" "$now_pid" 2>/dev/null
    return 0
}
if [ -n "$CHAIN_BASE" ] && versus "$CHAIN_BASE" ltg-unchained ltg-chained "$CHAIN_ROUNDS" \
        --ledger-key-env LTG_BENCH_LEDGER_KEY; then
    CH_BEFORE=$AB_BEFORE CH_NOW=$AB_NOW
    t0=$(now_ms)
    "$ROOT/ltg" verify --data "$T/ltg-chained-data" --ledger-key-env LTG_BENCH_LEDGER_KEY >"$T/verify.out" 2>&1 ||
        { tail -5 "$T/verify.out" >&2; die "ltg verify failed on ltg-chained's ledger"; }
    V_MS=$(( $(now_ms) - t0 ))
    V_EVENTS=$(awk '/ ok [0-9]+ events/ {n += $3} END {print n + 0}' "$T/verify.out")
    echo "### the chained ledger (same run, interleaved)"
    echo
    echo "- ltg-unchained: $CHAIN_BASE (before issue 25); ltg-chained: this build with --ledger-key-env"
    echo "- $CHAIN_ROUNDS rounds, each: ${WARM} s warm-up and ${SECS} s at 64 connections of each, in the order A B, B A, A B..."
    echo
    echo "| metric | ltg-unchained | ltg-chained | ratio |"
    echo "| --- | ---: | ---: | ---: |"
    echo "| requests/s, 64 conns (median; the runs) | $CH_BEFORE (${RUNS[ltg-unchained]# }) | $CH_NOW (${RUNS[ltg-chained]# }) | $(ratio "$CH_NOW" "$CH_BEFORE") |"
    echo "| ltg verify of what ltg-chained wrote | | $V_EVENTS events in $V_MS ms ($(awk -v m="$V_MS" -v n="$V_EVENTS" 'BEGIN {printf "%.2f", n ? m * 1000 / n : 0}') µs each) | |"
    echo
    CHAIN_T=$(awk -v a="$CH_NOW" -v b="$CH_BEFORE" 'BEGIN {print (a >= 0.97 * b) ? 1 : 0}')
fi

# This build against the build before it (BENCH_BEFORE, default HEAD~1 of this clone: set it to
# the revision a change started from), the same catalog and flags, interleaved as above.
BEFORE=${BENCH_BEFORE-HEAD~1}
BEFORE_ROUNDS=${BENCH_BEFORE_ROUNDS:-6}
if [ -n "$BEFORE" ] && versus "$BEFORE" ltg-before-build ltg-this-build "$BEFORE_ROUNDS"; then
    echo "### this build against the build before (same run, interleaved)"
    echo
    echo "- ltg-before-build: $BEFORE ($(git -C "$ROOT" rev-parse --short "$BEFORE" 2>/dev/null)); ltg-this-build: this tree"
    echo "- $BEFORE_ROUNDS rounds, each: ${WARM} s warm-up and ${SECS} s at 64 connections of each, in the order A B, B A, A B..."
    echo
    echo "| metric | before | this build | ratio |"
    echo "| --- | ---: | ---: | ---: |"
    echo "| requests/s, 64 conns (median; the runs) | $AB_BEFORE (${RUNS[ltg-before-build]# }) | $AB_NOW (${RUNS[ltg-this-build]# }) | $(ratio "$AB_NOW" "$AB_BEFORE") |"
    echo
    BEFORE_T=$(awk -v a="$AB_NOW" -v b="$AB_BEFORE" 'BEGIN {print (a >= 0.97 * b) ? 1 : 0}')
fi

# ---------------------------------------------------------------- translation
# One API for every model (README): ltg-translate is this build with two providers, the same mock
# spoken to in each API: Bench-Chat (bench-chat upstream) on "mock", OpenAI chat, and Bench-Anth
# (bench-anth) on "mock-anth", "api": "anthropic". The names have the same length, so the mock's
# answers have the same size. Four pairs, A the pass-through and B the translation, the same
# request body but its model: a chat client to Bench-Chat (A) and to Bench-Anth (B: chat ->
# Messages -> chat), whole and streamed; a Messages client to Bench-Anth (A) and to Bench-Chat
# (B: Messages -> chat -> Messages), whole and streamed. The bodies: a system prompt and three
# turns, about 1.4 KB. One process serves both sides of every pair (its access log to a file);
# TRANSLATE_ROUNDS rounds of a warm-up and a 64-connection run of each, A B, B A, ... Each of
# the eight requests is checked once first (200, the answer's shape in the client's API, the
# API the mock was spoken to); every answer under the load is counted from the access log.
TRANSLATE=${BENCH_TRANSLATE:-1}
TRANSLATE_ROUNDS=${BENCH_TRANSLATE_ROUNDS:-8}
case $TRANSLATE_ROUNDS in '' | *[!0-9]* | 0) die "BENCH_TRANSLATE_ROUNDS must be a whole number >= 1" ;; esac
TX_PAIRS=(chat chat-stream messages messages-stream responses responses-stream)
declare -A TX_LABEL=([chat]="chat client -> Anthropic provider" [chat-stream]="chat client -> Anthropic provider, streamed"
                     [messages]="Messages client -> OpenAI-chat provider" [messages-stream]="Messages client -> OpenAI-chat provider, streamed"
                     [responses]="Responses client -> chat-only provider" [responses-stream]="Responses client -> chat-only provider, streamed")
declare -A TX_T=() TX_R=()
if [ "$TRANSLATE" = 1 ]; then
    cat >"$T/ltg-translate.json" <<EOF
{
  "providers": { "mock": { "base_url": "$MOCK_URL/v1", "api_key_env": "LTG_BENCH_MOCK_KEY" },
                 "mock-anth": { "base_url": "$MOCK_URL/v1", "api": "anthropic", "api_key_env": "LTG_BENCH_MOCK_KEY" },
                 "mock-text": { "base_url": "$MOCK_URL/v1", "endpoints": ["chat"], "api_key_env": "LTG_BENCH_MOCK_KEY" } },
  "models": {
    "Bench-Chat": { "provider": "mock", "upstream_model": "bench-chat",
                    "input_usd_per_mtok": 0.60, "output_usd_per_mtok": 2.50 },
    "Bench-Anth": { "provider": "mock-anth", "upstream_model": "bench-anth",
                    "input_usd_per_mtok": 0.60, "output_usd_per_mtok": 2.50 },
    "Bench-Text": { "provider": "mock-text", "upstream_model": "bench-text",
                    "input_usd_per_mtok": 0.60, "output_usd_per_mtok": 2.50 }
  },
  "admin_keys": [ { "key_env": "LTG_BENCH_ADMIN_KEY", "permissions": ["*"] } ]
}
EOF
    launch_ltg ltg-translate "$T/ltg-translate.json" --access-log "$T/ltg-translate-access.log"
    TX_URL=http://127.0.0.1:$L_PORT TX_PID=$L_PID
    provision_key "$L_ADMIN_PORT" TX_KEY '"Bench-Chat","Bench-Anth","Bench-Text"'
    # no quote, apostrophe or backslash in the texts: the bodies go into wrk's Lua as '...'
    TX_SYS="You are a careful senior engineer who reviews pull requests for a small C codebase. Answer in plain prose, at most three short paragraphs, and quote the exact lines you mean. Prefer small, safe changes over rewrites; say so when you are unsure and explain how to check. Never invent functions or flags that the code does not have."
    TX_U1="Here is a function from our HTTP parser. It reads the request line into a fixed buffer and splits it on spaces: static int parse_line(char *buf, size_t n, struct req *r) { char *sp = memchr(buf, 32, n); if (!sp) return -1; r->method = buf; r->method_len = sp - buf; char *sp2 = memchr(sp + 1, 32, n - (sp + 1 - buf)); if (!sp2) return -1; r->path = sp + 1; r->path_len = sp2 - sp - 1; return 0; } Is the length arithmetic right when the line ends right after the second space?"
    TX_A1="Mostly, yes. The first memchr is bounded by n, and the second by n - (sp + 1 - buf), the number of bytes after the first space, so neither can read past the buffer. When the line ends right after the second space, path_len is correct and the version is simply empty, which the caller should reject: nothing here checks that a version follows. One more edge: a request line that starts with a space gives a method of length zero."
    TX_U2="Good points. Could you suggest the smallest change that rejects an empty method and an empty version, and tell me which of our existing tests would need a new case?"
    TX_TURNS='{"role":"user","content":"'$TX_U1'"},{"role":"assistant","content":"'$TX_A1'"},{"role":"user","content":"'$TX_U2'"}'
    tx_body() { # API MODEL [STREAM]: the request body, chat, messages or responses, "stream": true when STREAM is given
        local s=
        [ -n "${3:-}" ] && s=',"stream":true'
        if [ "$1" = responses ]; then
            echo '{"model":"'$2'","max_output_tokens":512,"temperature":0.2,"instructions":"'$TX_SYS'","input":['$TX_TURNS']'$s'}'
        elif [ "$1" = chat ]; then
            echo '{"model":"'$2'","max_tokens":512,"temperature":0.2,"messages":[{"role":"system","content":"'$TX_SYS'"},'$TX_TURNS']'$s'}'
        else
            echo '{"model":"'$2'","max_tokens":512,"temperature":0.2,"system":"'$TX_SYS'","messages":['$TX_TURNS']'$s'}'
        fi
    }
    # tx_check NAME PATH BODY UPSTREAM: one request; 200, x-ltg-served-model, the answer in the
    # client's API (the mock's text, or its 3 deltas and the stream's end), and the mock spoken to
    # in UPSTREAM's provider's API (bench-anth: /v1/messages; bench-chat: /v1/chat/completions)
    tx_check() {
        local name=$1 path=$2 body=$3 up=$4 out="$T/check-$1" st hv=() served want_up got_up n
        [ "$path" = /v1/messages ] && hv=(-H 'anthropic-version: 2023-06-01')
        st=$(curl -s -o "$out" -D "$out.head" -w '%{http_code}' -m 5 -X POST "$TX_URL$path" -H 'Content-Type: application/json' \
             -H "Authorization: Bearer $TX_KEY" "${hv[@]}" --data-binary "$body")
        [ "$st" = 200 ] || { echo "bench: $name answered $st (want 200): $(head -c 500 "$out")" >&2; return 1; }
        served=Bench-Chat
        [ "$up" = bench-anth ] && served=Bench-Anth
        [ "$up" = bench-text ] && served=Bench-Text
        grep -qi "^x-ltg-served-model: $served" "$out.head" || { echo "bench: $name: no x-ltg-served-model: $served" >&2; return 1; }
        case $path:$body in
            /v1/chat/completions:*'"stream":true}')
                n=$(grep -c '"delta":{[^}]*"content":"word "' "$out")
                [ "$n" = 3 ] && grep -q '^data: \[DONE\]' "$out" ;;
            /v1/chat/completions:*)
                grep -q '"object":"chat.completion".*"content":"Hello from '"$up"'\."' "$out" ;;
            /v1/responses:*'"stream":true}')
                n=$(grep -c '"type":"response.output_text.delta".*"delta":"word "' "$out")
                [ "$n" = 3 ] && grep -q '^event: response.completed' "$out" ;;
            /v1/responses:*)
                grep -q '"object":"response".*"text":"Hello from '"$up"'\."' "$out" ;;
            /v1/messages:*'"stream":true}')
                n=$(grep -c '"type":"text_delta","text":"word "' "$out")
                [ "$n" = 3 ] && grep -q '^event: message_stop' "$out" ;;
            *)
                grep -q '"type":"message".*"text":"Hello from '"$up"'\."' "$out" ;;
        esac || { echo "bench: $name answered 200 but not in its client's API: $(head -c 500 "$out")" >&2; return 1; }
        want_up=/v1/chat/completions
        [ "$up" = bench-anth ] && want_up=/v1/messages
        [ "$path:$up" = /v1/responses:bench-chat ] && want_up=/v1/responses
        got_up=$(curl -s -m 2 "$MOCK_URL/_mock/last" | sed -n 's/^{"method":"POST","path":"\([^"]*\)".*"model\\":\\"\([^\\"]*\)\\".*/\1 \2/p')
        [ "$got_up" = "$want_up $up" ] || { echo "bench: $name: the mock saw \"$got_up\", want \"$want_up $up\"" >&2; return 1; }
    }
    TX_OK=1
    declare -A TX_A TX_B
    for p in "${TX_PAIRS[@]}"; do
        api=${p%-stream} s=
        [ "$p" != "$api" ] && s=1
        path=/v1/chat/completions pass=Bench-Chat tr=Bench-Anth
        [ "$api" = messages ] && path=/v1/messages pass=Bench-Anth tr=Bench-Chat
        [ "$api" = responses ] && path=/v1/responses pass=Bench-Chat tr=Bench-Text
        a=tx-$p-pass b=tx-$p-translated
        TX_A[$p]=$a TX_B[$p]=$b
        for side in "$a $pass" "$b $tr"; do
            read -r n m <<<"$side"
            body=$(tx_body "$api" "$m" $s)
            up=bench-chat
            [ "$m" = Bench-Anth ] && up=bench-anth
            [ "$m" = Bench-Text ] && up=bench-text
            tx_check "$n" "$path" "$body" "$up" || TX_OK=0
            write_lua "$T/post-$n.lua" "$TX_KEY" "$body" "$path"
            URL[$n]=$TX_URL PID_OF[$n]=$TX_PID LUA_OF[$n]=$T/post-$n.lua
        done
    done
    TX_BYTES_CHAT=$(tx_body chat Bench-Anth | wc -c) TX_BYTES_MSG=$(tx_body messages Bench-Chat | wc -c)
    TX_BYTES_RESP=$(tx_body responses Bench-Text | wc -c)
    if [ "$TX_OK" = 1 ]; then
        TX_START=$(date +%s)
        s0=$(mock_stats)
        for p in "${TX_PAIRS[@]}"; do interleave "${TX_A[$p]}" "${TX_B[$p]}" "$TRANSLATE_ROUNDS"; done
        s1=$(mock_stats)
        TX_ELAPSED=$(($(date +%s) - TX_START))
        TX_UP_ANTH=$(($(mock_stat bench-anth "$s1") - $(mock_stat bench-anth "$s0")))
        TX_UP_CHAT=$(($(mock_stat bench-chat "$s1") - $(mock_stat bench-chat "$s0")))
        TX_UP_TEXT=$(($(mock_stat bench-text "$s1") - $(mock_stat bench-text "$s0")))
        kill -TERM "$TX_PID" 2>/dev/null; wait "$TX_PID" 2>/dev/null   # its access log flushed and closed
        # every answer under the load (warm-ups included), by client API, model and status
        TX_STATUS=$(sed -n 's/.*"path":"\([^"]*\)","status":\([0-9]*\),.*"requested_model":"\([^"]*\)".*/\1 \3 \2/p' \
                    "$T/ltg-translate-access.log" | sort | uniq -c | awk '{printf "%s%s %s %s: %s", (NR > 1 ? "; " : ""), $2, $3, $4, $1}')
        # 499: a client gone, as wrk leaves its requests in flight at the end of each run
        TX_BAD=$(grep '"plane":"inference"' "$T/ltg-translate-access.log" | grep -v '"status":499,' | grep -vc '"status":200,')
        TX_LINES=$(wc -l <"$T/ltg-translate-access.log")
        [ "$TX_BAD" = 0 ] || { ERRORS_SEEN=1; ERRORS_NOTE="$ERRORS_NOTE translation: $TX_BAD answers other than 200 in the access log;"; }
        echo "### translation: chat <-> Messages, Responses -> chat (same run, same process, interleaved)"
        echo
        echo "- ltg-translate: this build, providers mock (OpenAI, every endpoint), mock-anth (\"api\": \"anthropic\") and"
        echo "  mock-text (\"endpoints\": [\"chat\"]), the same mock; Bench-Chat on the first, Bench-Anth on the second,"
        echo "  Bench-Text on the third; a Responses client's pass-through is Bench-Chat's own /v1/responses; access log to a file"
        echo "- bodies: a system prompt and three turns, max_tokens, temperature: chat $TX_BYTES_CHAT bytes, Messages"
        echo "  $TX_BYTES_MSG bytes, Responses $TX_BYTES_RESP bytes (and \"stream\": true); A and B differ in the model alone"
        echo "- per pair $TRANSLATE_ROUNDS rounds, each: ${WARM} s warm-up and ${SECS} s at 64 connections of each, A B, B A, ...;"
        echo "  time ${TX_ELAPSED} s; the mock saw $TX_UP_ANTH requests to bench-anth (Messages), $TX_UP_CHAT to bench-chat"
        echo "  (chat and Responses), $TX_UP_TEXT to bench-text (chat)"
        echo "- answers in the access log ($TX_LINES lines, warm-ups and checks included; path, model, status: count): $TX_STATUS"
        echo
        echo "| requests/s, 64 conns (median; the runs) | pass-through (A) | translated (B) | B/A | rounds' B/A | CPU us/req A, B |"
        echo "| --- | ---: | ---: | ---: | ---: | ---: |"
        for p in "${TX_PAIRS[@]}"; do
            a=${TX_A[$p]} b=${TX_B[$p]} rr= ca= cb=
            for r in $(seq "$TRANSLATE_ROUNDS"); do
                rr="$rr $(awk -v x="${R[$b,c64r$r,rps]}" -v y="${R[$a,c64r$r,rps]}" 'BEGIN {printf "%.2f", y ? x / y : 0}')"
                ca="$ca ${R[$a,c64r$r,cpu]}" cb="$cb ${R[$b,c64r$r,cpu]}"
                for n in "$a" "$b"; do
                    case ${R[$n,c64r$r,errs]} in *=[1-9]*)
                        ERRORS_SEEN=1; ERRORS_NOTE="$ERRORS_NOTE $n round $r: ${R[$n,c64r$r,errs]};" ;;
                    esac
                done
            done
            # shellcheck disable=SC2086
            ma=$(median ${RUNS[$a]}) mb_=$(median ${RUNS[$b]})
            # shellcheck disable=SC2086
            TX_R[$p]="$(ratio "$mb_" "$ma") ($mb_ / $ma; rounds$rr)"
            TX_T[$p]=$(awk -v a="$mb_" -v b="$ma" 'BEGIN {print (b > 0 && a >= 0.9 * b) ? 1 : 0}')
            # shellcheck disable=SC2086
            echo "| ${TX_LABEL[$p]} | $ma (${RUNS[$a]# }) | $mb_ (${RUNS[$b]# }) | $(ratio "$mb_" "$ma") | $(printf '%s\n' $rr | sort -n | head -n1)-$(printf '%s\n' $rr | sort -n | tail -n1) | $(median $ca), $(median $cb) |"
        done
        echo
        if grep -v 'listening on\|ltg: state:' "$T/ltg-translate.log" | grep -q .; then
            echo "ltg-translate logged (last 10 lines):"
            grep -v 'listening on\|ltg: state:' "$T/ltg-translate.log" | tail -n 10 | sed 's/^/    /'
            echo
        fi
    else
        kill -TERM "$TX_PID" 2>/dev/null; wait "$TX_PID" 2>/dev/null
        ERRORS_SEEN=1; ERRORS_NOTE="$ERRORS_NOTE translation: a check before the load failed (nothing measured);"
        echo "### translation: a check before the load failed (see above); nothing measured"
        echo
    fi
fi

# ---------------------------------------------------------------- targets
MISSED=0
verdict() { if [ "$1" = 1 ]; then echo "MET"; else echo "NOT MET"; MISSED=1; fi; }
# target LABEL OP LIMIT "MEDIAN LOW HIGH": one summary line, met when the median ratio
# is OP (>= or <=) LIMIT
target() {
    local med lo hi ok
    read -r med lo hi <<<"$4"
    ok=$(awk -v m="$med" -v l="$3" -v op="$2" 'BEGIN {print (m != "" && (op == ">=" ? m >= l : m <= l)) ? 1 : 0}')
    printf -- '- %s %s %sx nginx: %s (median %.2fx, rounds %.2f-%.2f)\n' "$1" "$2" "$3" "$(verdict "$ok")" "$med" "$lo" "$hi"
}
LIMIT_KB=15360
t3=$(( R[ltg,hwm] <= LIMIT_KB ? 1 : 0 ))
echo "### targets"
echo
target "requests/s at 64 conns, access logs on," ">=" 0.8 "$RPS_LOG"
target "requests/s at 64 conns, access logs off," ">=" 0.8 "$RPS_NOLOG"
target "CPU us/request at 64 conns, access logs on," "<=" 1.5 "$CPU_LOG"
target "p99 at 1 conn (${P99_SECS} s runs)" "<=" 2 "$P99_1"
target "short streams/s at 64 conns" ">=" 0.8 "$STREAM_R"
if [ "$IDLE_CLIENTS" -gt 0 ]; then
    [ "$IDLE_OK" = 1 ] || IDLE_R="0 0 0"
    target "requests/s at 1 conn with $IDLE_CLIENTS idle clients" ">=" 0.5 "$IDLE_R"
fi
if [ "$CLUSTER" = 1 ]; then
    read -r med lo hi <<<"$CL_R"
    printf -- '- --cluster, every request held and settled in Redis: %.2fx one instance without (rounds %.2f-%.2f; reported)\n' "$med" "$lo" "$hi"
    read -r med lo hi <<<"$THREE_R"
    printf -- '- three instances behind HAProxy: %.2fx one (rounds %.2f-%.2f; reported)\n' "$med" "$lo" "$hi"
fi
echo "- ltg peak RSS <= 15 MiB ($LIMIT_KB kB): $(verdict "$t3") (${R[ltg,hwm]} kB, with today's ledger index" \
     "of the events of these runs, up to --ledger-index-mb: 16 MiB by default)"
[ -n "${CHAIN_T:-}" ] && echo "- the chained ledger: requests/s at 64 conns no lower than before issue 25 (>= 0.97x): $(verdict "$CHAIN_T") ($(ratio "$CH_NOW" "$CH_BEFORE"))"
[ -n "${BEFORE_T:-}" ] && echo "- this build: requests/s at 64 conns no lower than the build before, $BEFORE (>= 0.97x): $(verdict "$BEFORE_T") ($(ratio "$AB_NOW" "$AB_BEFORE"))"
if [ "$TRANSLATE" = 1 ]; then
    for p in "${TX_PAIRS[@]}"; do
        [ "${TX_T[$p]:-0}" = 1 ] || MISSED=1   # verdict runs in a subshell here
        echo "- translation, ${TX_LABEL[$p]}: requests/s at 64 conns >= 0.9x the pass-through's: $(verdict "${TX_T[$p]:-0}") (${TX_R[$p]:-not measured})"
    done
fi
[ -n "${TRAFFIC_T:-}" ] && echo "- two deployments and limits on: requests/s at 64 conns no lower than before issue 15 (>= 0.97x, the run-to-run noise): $(verdict "$TRAFFIC_T") ($(ratio "$TR_NOW" "$TR_BEFORE"))"
echo "- ltg errors under load (non-2xx, socket errors): $( [ "$ERRORS_SEEN" = 0 ] && echo none || echo "SEEN:${ERRORS_NOTE:- the check after the load failed}")"
if [ "$TLS" = 1 ]; then
    if [ -n "$TLS_LINE" ] && [ "${TLS_REQS:-0}" -gt 0 ]; then
        t5=$(awk -v f="$TLS_FULL" -v n="$TLS_REQS" 'BEGIN {print (f < 0.01 * n) ? 1 : 0}')
    else
        t5=0
    fi
    echo "- HTTPS: ltg requests that paid a full TLS handshake < 1 %: $(verdict "$t5") ($TLS_FULL of $TLS_REQS: $(pct "${TLS_FULL:-0}" "$TLS_REQS"))"
    echo "- HTTPS: ltg requests/s at 64 conns: $(ratio "${R[ltg-tls,c64,rps]}" "${R[nginx-tls,c64,rps]}") nginx's (reported, no target)"
    echo "- HTTPS: ltg errors under load (non-2xx, socket errors): $( [ "$TLS_ERRORS_SEEN" = 0 ] && echo none || echo "SEEN: ${R[ltg-tls,c64,errs]:-the check after the load failed}")"
fi

# ---------------------------------------------------------------- start-up replay
# Target (issue 3): replaying a state log of 100,000 groups + keys takes under
# a second. The log is written here in ltg's own format (magic, then records
# of length, CRC-32, JSON payload), one record per item as a compaction
# writes them; ltg reports the replay time itself at start-up.
REPLAY_N=${BENCH_REPLAY_ITEMS:-100000}
mkdir -p "$T/replay"
python3 - "$T/replay/state.log" "$REPLAY_N" "$ALIAS" <<'PY'
import hashlib, json, struct, sys, uuid, zlib
path, n, alias = sys.argv[1], int(sys.argv[2]), sys.argv[3]
t = 1795970000000
with open(path, "wb") as out:
    out.write(b"LTGLOG1\n")
    def rec(obj):
        p = json.dumps(obj, separators=(",", ":")).encode()
        out.write(struct.pack("<II", len(p), zlib.crc32(p)) + p)
    for i in range(n // 2):
        gid = str(uuid.uuid4())
        rec({"ops": [{"put_group": {"id": gid, "name": "group-%d" % i, "allowed_models": [alias], "fallbacks": {},
             "retries": {"max_attempts": 2, "retry_delay_ms": 250, "backoff": "exponential", "request_timeout_ms": None},
             "max_budget": 10, "budget_duration": "1d", "cache_ttl": None, "max_parallel_requests": None,
             "blocked": False, "version": 1, "created_at": t + i, "updated_at": t + i, "budget_anchor": t + i}}]})
        rec({"ops": [{"put_key": {"id": str(uuid.uuid4()), "name": "key-%d" % i, "token_group_id": gid, "version": 1,
             "sha256": hashlib.sha256(b"ltg_sk_%d" % i).hexdigest(), "created_at": t + i, "updated_at": t + i}}]})
PY
RP=$(free_port) RA=$(free_port)
"$ROOT/ltg" --config "$T/ltg.json" --data "$T/replay" --listen "127.0.0.1:$RP" --admin-listen "127.0.0.1:$RA" 2>"$T/replay.log" &
REPLAY_PID=$!
PIDS+=("$REPLAY_PID")
wait_http "http://127.0.0.1:$RP/healthz" "$REPLAY_PID" "$T/replay.log" 2>/dev/null || die "ltg did not start on the replay log"
REPLAY_RSS=$(hwm_kb "$REPLAY_PID")
kill "$REPLAY_PID" 2>/dev/null; wait "$REPLAY_PID" 2>/dev/null
REPLAY_MS=$(sed -n 's/.*replayed \([0-9]*\) records in \([0-9]*\) ms.*/\2/p' "$T/replay.log")
REPLAY_REC=$(sed -n 's/.*replayed \([0-9]*\) records in.*/\1/p' "$T/replay.log")
echo
echo "### start-up replay"
echo
echo "- $REPLAY_REC records ($((REPLAY_N / 2)) groups + $((REPLAY_N / 2)) keys, $(( $(stat -c %s "$T/replay/state.log") / 1048576 )) MiB) replayed in $REPLAY_MS ms; peak RSS after replay $REPLAY_RSS kB"
t4=$(( ${REPLAY_MS:-99999} < 1000 ? 1 : 0 ))
echo "- replay of 100,000 groups+keys under 1 s: $(verdict "$t4")"
echo

# ---------------------------------------------------------------- a long history
# Targets (issue 11, API.md 6): with 10,000,000 spend events retained over 30
# days, start-up <= 1 s with a peak RSS <= steady + 32 MiB, steady RssAnon <=
# 64 MiB (--cache-mb 16), a page of /spend/events (filtered or not) < 10 ms, a
# 31-day /usage/summary < 50 ms; and the c=64 requests/s with that history
# no worse than without it. The history is written by tests/ledger-gen, which
# is ltg's own ledger code (ltg.c built without main) fed each event's time:
# 30 sealed days with their index files, today's open. Queries are timed with
# curl over loopback (the whole HTTP exchange: an upper bound), best of 5.
#
# "before" is the design this replaced (one ledger.log read whole at start-up,
# a 64-byte index entry in memory per event, for ever), measured in this run
# on BENCH_BASE (a git revision, default 2a946e7, the last one before it) with
# BENCH_BASE_EVENTS (1,000,000) events and scaled to the history's size: its
# start-up time and memory grow linearly with the events (it reads the file
# whole and indexes every event), so the scaled figure is what it would be.
HIST_N=${BENCH_HISTORY_EVENTS:-10000000}
BASE=${BENCH_BASE-2a946e7}
BASE_N=${BENCH_BASE_EVENTS:-1000000}
# The helpers of this section and the next.
kb() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status" 2>/dev/null; }
# time_query PATH...: best of 5, in ms, from the admin API at $HA (an answer other than 200 is
# said, and counts as 999999 ms)
time_query() {
    local best=999999 ms st i
    for i in 1 2 3 4 5; do
        read -r st ms < <(curl -s -o "$T/query.out" -w '%{http_code} %{time_total}\n' "$HA$1" -H "Authorization: Bearer $LTG_BENCH_ADMIN_KEY")
        if [ "$st" != 200 ]; then
            echo "bench: GET $1 answered $st: $(head -c 300 "$T/query.out")" >&2
            break
        fi
        ms=$(awk -v t="$ms" 'BEGIN {printf "%.1f", t * 1000}')
        best=$(awk -v a="$ms" -v b="$best" 'BEGIN {print (a < b) ? a : b}')
    done
    echo "$best"
}
# start_timed BINARY DATA LOG [FLAG...]: ltg on free ports (--cache-mb 16, then the flags); sets S_PORT,
# S_ADMIN, S_PID and S_MS, the milliseconds from its start until /healthz answers
start_timed() {
    local t0 bin=$1 data=$2 log=$3
    shift 3
    S_PORT=$(free_port) S_ADMIN=$(free_port) t0=$(now_ms)
    "$bin" --config "$T/ltg.json" --data "$data" --listen "127.0.0.1:$S_PORT" --admin-listen "127.0.0.1:$S_ADMIN" --cache-mb 16 "$@" 2>"$log" &
    S_PID=$!
    PIDS+=("$S_PID")
    for _ in $(seq 60000); do curl -s -o /dev/null -m 1 "http://127.0.0.1:$S_PORT/healthz" && break; kill -0 "$S_PID" 2>/dev/null || break; sleep 0.01; done
    S_MS=$(( $(now_ms) - t0 ))
    kill -0 "$S_PID" 2>/dev/null || { tail -5 "$log" >&2; die "$bin did not start on $data"; }
}
hist_ok() { verdict "$(awk "BEGIN {print ($1) ? 1 : 0}")"; }
if [ "$HIST_N" -gt 0 ]; then
t0=$(now_ms)
read -r HGID HKID < <(LEDGER_KEY=$LTG_BENCH_LEDGER_KEY "$ROOT/tests/ledger-gen" "$T/history" "$HIST_N" 30 100) || die "tests/ledger-gen failed"
GEN_S=$(( ($(now_ms) - t0) / 1000 ))
HIST_DISK=$(du -sb "$T/history/ledger" | cut -f1)
start_timed "$ROOT/ltg" "$T/history" "$T/history.log" --ledger-key-env LTG_BENCH_LEDGER_KEY
HP=$S_PORT HAP=$S_ADMIN HIST_PID=$S_PID HIST_START_MS=$S_MS
HIST_PEAK=$(kb "$HIST_PID" VmHWM)
HA="http://127.0.0.1:$HAP/v2/llm_token_gateway"
D0=$(date -u -d '-30 days' +%F) D1=$(date -u -d '-1 day' +%F) D2=$(date -u -d '+1 day' +%F) DM=$(date -u -d '-15 days' +%F)
DS=$D0 # 31 days: today and the 30 before ([DS, D2); the most /usage/summary takes)
provision_key "$HAP" HIST_KEY
write_lua "$T/post-history.lua" "$HIST_KEY"
LUA=$T/post-history.lua
wrk -t2 -c64 -d"${WARM}s" -s "$LUA" "http://127.0.0.1:$HP" >/dev/null 2>&1
run_wrk ltg-history "http://127.0.0.1:$HP" "$HIST_PID" 2 64 c64
HIST_ANON=$(kb "$HIST_PID" RssAnon) HIST_RSS=$(kb "$HIST_PID" VmRSS)
q_page=$(time_query "/spend/events?start_date=$D0&end_date=$D2&page%5Bsize%5D=50")
q_deep=$(time_query "/spend/events?start_date=$D0&end_date=$D2&page%5Bsize%5D=50&page%5Bnumber%5D=150000")
q_big=$(time_query "/spend/events?start_date=$DM&end_date=$D2&page%5Bsize%5D=1000&page%5Bnumber%5D=3000")
q_group=$(time_query "/spend/events?start_date=$D0&end_date=$D2&token_group_id=$HGID&page%5Bsize%5D=100")
q_gdeep=$(time_query "/spend/events?start_date=$D0&end_date=$D2&token_group_id=$HGID&page%5Bsize%5D=100&page%5Bnumber%5D=900")
q_key=$(time_query "/spend/events?start_date=$D0&end_date=$D2&token_key_id=$HKID&page%5Bsize%5D=100&page%5Bnumber%5D=200")
q_sum=$(time_query "/usage/summary?start_date=$DS&end_date=$D2")
q_gsum=$(time_query "/usage/summary?start_date=$DS&end_date=$D2&token_group_id=$HGID")
HIST_EVENTS=$(sed -n 's/.*ledger: \([0-9]*\) spend event(s).*/\1/p' "$T/history.log")
kill "$HIST_PID" 2>/dev/null; wait "$HIST_PID" 2>/dev/null
# ltg verify of the whole chained history (issue 25): its time, and its peak RSS where GNU time is
t0=$(now_ms)
if [ -x /usr/bin/time ]; then
    /usr/bin/time -f %M -o "$T/verify-hist.rss" "$ROOT/ltg" verify --data "$T/history" --ledger-key-env LTG_BENCH_LEDGER_KEY >"$T/verify-hist.out" 2>&1
else "$ROOT/ltg" verify --data "$T/history" --ledger-key-env LTG_BENCH_LEDGER_KEY >"$T/verify-hist.out" 2>&1; fi ||
    { tail -5 "$T/verify-hist.out" >&2; die "ltg verify failed on the long history"; }
HV_MS=$(( $(now_ms) - t0 )) HV_RSS=$(cat "$T/verify-hist.rss" 2>/dev/null || echo "?")
HV_EVENTS=$(awk '/ ok [0-9]+ events/ {n += $3} END {print n + 0}' "$T/verify-hist.out")

# before: BASE built here, on a ledger.log of BASE_N events in its format
BASE_NOTE="not measured (BENCH_BASE empty)"
if [ -n "$BASE" ] && build_at "$BASE" "$T/base-ltg"; then
    mkdir -p "$T/base-data"
    python3 - "$T/base-data/ledger.log" "$BASE_N" <<'PY'
import json, struct, sys, uuid, zlib, datetime
path, n = sys.argv[1], int(sys.argv[2])
end = int(datetime.datetime.now(datetime.timezone.utc).timestamp() * 1000)
start = end - 30 * 86400000
groups = [str(uuid.uuid4()) for _ in range(100)]
keys = [str(uuid.uuid4()) for _ in range(200)]
with open(path, "wb") as out:
    out.write(b"LTGLED1\n")
    for i in range(n):
        t = start + i * (30 * 86400000) // n
        iso = datetime.datetime.fromtimestamp(t / 1000, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        k = i % 200
        e = {"id": str(uuid.uuid4()), "record_type": "spend_event", "request_id": "req_%024x" % i, "created_at": iso,
             "token_key_id": keys[k], "token_group_id": groups[k // 2], "requested_model": "Bench-Model", "model": "Bench-Model",
             "attempts": 1, "status": "succeeded", "http_status": 200, "cache_hit": False, "input_tokens": 20,
             "output_tokens": 3, "cost": 0.00002, "usage_status": "reported", "latency_ms": 12,
             "attempt_log": [{"model": "Bench-Model", "attempt": 1, "status": 200, "outcome": "ok", "ms": 11}]}
        p = b'{"t":%d,"c":20,"e":%s}' % (t, json.dumps(e, separators=(",", ":")).encode())
        out.write(struct.pack("<II", len(p), zlib.crc32(p)) + p)
PY
    start_timed "$T/base-ltg" "$T/base-data" "$T/base.log"
    BASE_PID=$S_PID BASE_START_MS=$S_MS
    BASE_PEAK=$(kb "$BASE_PID" VmHWM) BASE_ANON=$(kb "$BASE_PID" RssAnon)
    kill "$BASE_PID" 2>/dev/null; wait "$BASE_PID" 2>/dev/null
    BASE_DISK=$(stat -c %s "$T/base-data/ledger.log")
    scale() { awk -v v="$1" -v n="$HIST_N" -v b="$BASE_N" 'BEGIN {printf "%.0f", v * n / b}'; }
    B_START=$(scale "$BASE_START_MS") B_PEAK=$(scale "$BASE_PEAK") B_ANON=$(scale "$BASE_ANON")
    BASE_NOTE="$BASE with $BASE_N events: start-up $BASE_START_MS ms, peak RSS $BASE_PEAK kB, RssAnon $BASE_ANON kB, $((BASE_DISK / BASE_N)) bytes per event"
fi
echo "### a long history: $HIST_N events over 30 days"
echo
echo "- written by tests/ledger-gen in ${GEN_S} s; ltg counted $HIST_EVENTS events at start-up; before: $BASE_NOTE"
echo
echo "| metric | before (scaled to $HIST_N events) | now | target |"
echo "| --- | ---: | ---: | --- |"
echo "| start-up to /healthz | ${B_START:-?} ms | $HIST_START_MS ms | <= 1000 ms: $(hist_ok "$HIST_START_MS <= 1000") |"
echo "| peak RSS at start-up | ${B_PEAK:-?} kB | $HIST_PEAK kB | <= steady + 32 MiB: $(hist_ok "$HIST_PEAK <= $HIST_RSS + 32768") (steady $HIST_RSS kB) |"
echo "| steady RssAnon (--cache-mb 16, after load) | ${B_ANON:-?} kB | $HIST_ANON kB | <= 64 MiB: $(hist_ok "$HIST_ANON <= 65536") |"
echo "| ltg verify of the whole history | | $HV_EVENTS events in $HV_MS ms, peak RSS $HV_RSS kB | (reported) |"
echo "| disk per event (logs and index files) | $(( ${BASE_DISK:-0} / BASE_N )) B | $(( HIST_DISK / HIST_N )) B | (reported) |"
echo "| /spend/events, page 1 of 30 days | | $q_page ms | < 10 ms: $(hist_ok "$q_page < 10") |"
echo "| /spend/events, page 150,000 of 30 days | | $q_deep ms | < 10 ms: $(hist_ok "$q_deep < 10") |"
echo "| /spend/events, 1,000 events of page 3,000 | | $q_big ms | < 10 ms: $(hist_ok "$q_big < 10") |"
echo "| /spend/events, one group, page 1 | | $q_group ms | < 10 ms: $(hist_ok "$q_group < 10") |"
echo "| /spend/events, one group, page 900 | | $q_gdeep ms | < 10 ms: $(hist_ok "$q_gdeep < 10") |"
echo "| /spend/events, one key, page 200 | | $q_key ms | < 10 ms: $(hist_ok "$q_key < 10") |"
echo "| /usage/summary, 31 days | | $q_sum ms | < 50 ms: $(hist_ok "$q_sum < 50") |"
echo "| /usage/summary, 31 days, one group | | $q_gsum ms | < 50 ms: $(hist_ok "$q_gsum < 50") |"
echo "| requests/s at 64 conns with this history | | ${R[ltg-history,c64,rps]} | no worse than without: $(ratio "${R[ltg-history,c64,rps]}" "${R[ltg,c64,rps]}") of ltg's, $(ratio "${R[ltg-history,c64,rps]}" "${R[nginx,c64,rps]}") of nginx's |"
echo
fi

# ---------------------------------------------------------------- a busy day
# Targets (API.md 11): the open day's index in memory has a bound (--ledger-index-mb,
# 16 MiB by default) and is spilled to its index file in sealed chunks beyond it, so
# that a day of 10,000,000 events keeps steady RssAnon <= 64 MiB (--cache-mb 16); a
# page of today's events < 10 ms (filtered or not, page 1 or deep); today's
# /usage/summary < 50 ms. tests/ledger-gen writes BENCH_TODAY_EVENTS events all
# today (DAYS 0: from midnight UTC to now) with ltg's own code at the default bound,
# so the index file holds the chunks ltg would have spilled; ltg starts on it with
# the default bound, loads those chunks and replays only the log past the last.
TODAY_N=${BENCH_TODAY_EVENTS:-10000000}
if [ "$TODAY_N" -gt 0 ]; then
t0=$(now_ms)
read -r TGID TKID < <("$ROOT/tests/ledger-gen" "$T/today" "$TODAY_N" 0 100) || die "tests/ledger-gen failed"
TGEN_S=$(awk -v ms=$(( $(now_ms) - t0 )) 'BEGIN {printf "%.1f", ms / 1000}')
TDAY=$(ls "$T/today/ledger" | sed -n 's/\.log$//p' | tail -n 1)
TD1=$(date -u -d "$TDAY +1 day" +%F)
TIDX=$T/today/ledger/$TDAY.idx
[ -f "$TIDX" ] || die "tests/ledger-gen wrote no index file for $TDAY"
TODAY_DISK=$(du -sb "$T/today/ledger" | cut -f1)
idx_chunks() { grep -o -a -F 'LTGIDX5' "$1" | wc -l; } # every chunk begins with the magic
TIDX_SIZE=$(stat -c %s "$TIDX") TCHUNKS=$(idx_chunks "$TIDX")
start_timed "$ROOT/ltg" "$T/today" "$T/today.log"
TP=$S_PORT TAP=$S_ADMIN TODAY_PID=$S_PID TODAY_START_MS=$S_MS
TODAY_PEAK=$(kb "$TODAY_PID" VmHWM)
HA="http://127.0.0.1:$TAP/v2/llm_token_gateway"
provision_key "$TAP" TODAY_KEY
write_lua "$T/post-today.lua" "$TODAY_KEY"
LUA=$T/post-today.lua
wrk -t2 -c64 -d"${WARM}s" -s "$LUA" "http://127.0.0.1:$TP" >/dev/null 2>&1
run_wrk ltg-today "http://127.0.0.1:$TP" "$TODAY_PID" 2 64 c64
LUA=$T/post.lua
TODAY_ANON=$(kb "$TODAY_PID" RssAnon) TODAY_RSS=$(kb "$TODAY_PID" VmRSS)
TR="start_date=$TDAY&end_date=$TD1"
# the middle pages: of 50 events of the day, of 100 of a group (2 of every 200 events), of a key (1 of 200)
half() { echo $(( $1 / 2 > 1 ? $1 / 2 : 1 )); }
TDEEP=$(half $(( TODAY_N / 50 ))) TGDEEP=$(half $(( TODAY_N / 100 / 100 ))) TKDEEP=$(half $(( TODAY_N / 200 / 100 )))
t_page=$(time_query "/spend/events?$TR&page%5Bsize%5D=50")
t_deep=$(time_query "/spend/events?$TR&page%5Bsize%5D=50&page%5Bnumber%5D=$TDEEP")
t_group=$(time_query "/spend/events?$TR&token_group_id=$TGID&page%5Bsize%5D=100")
t_gdeep=$(time_query "/spend/events?$TR&token_group_id=$TGID&page%5Bsize%5D=100&page%5Bnumber%5D=$TGDEEP")
t_key=$(time_query "/spend/events?$TR&token_key_id=$TKID&page%5Bsize%5D=100&page%5Bnumber%5D=$TKDEEP")
t_sum=$(time_query "/usage/summary?$TR")
t_gsum=$(time_query "/usage/summary?$TR&token_group_id=$TGID")
TODAY_EVENTS=$(sed -n 's/.*ledger: \([0-9]*\) spend event(s).*/\1/p' "$T/today.log")
TODAY_REPLAYED=$(sed -n "s|.*/ledger/$TDAY\.log: replayed \([0-9]*\) records in \([0-9]*\) ms.*|\1 records in \2 ms|p" "$T/today.log")
TODAY_TOTAL=$(curl -s "$HA/spend/events?$TR&page%5Bsize%5D=1" -H "Authorization: Bearer $LTG_BENCH_ADMIN_KEY" | sed -n 's/.*"total_results":\([0-9]*\).*/\1/p')
kill "$TODAY_PID" 2>/dev/null; wait "$TODAY_PID" 2>/dev/null
TCHUNKS_AFTER=$(idx_chunks "$TIDX")
echo "### a busy day: $TODAY_N events today ($TDAY, from midnight UTC to the run)"
echo
echo "- written by tests/ledger-gen (--ledger-index-mb 16) in ${TGEN_S} s; $(( TODAY_DISK / 1048576 )) MiB on disk;"
echo "  ltg counted $TODAY_EVENTS events at start-up and replayed ${TODAY_REPLAYED:-?} of today's log (the rest from the chunks);"
echo "  after the load the day held $TODAY_TOTAL events and its index file $TCHUNKS_AFTER chunk(s)"
echo
echo "| metric | now | target |"
echo "| --- | ---: | --- |"
echo "| start-up to /healthz | $TODAY_START_MS ms | (reported) |"
echo "| peak RSS at start-up (VmHWM) | $TODAY_PEAK kB | (reported) |"
echo "| steady RssAnon (--cache-mb 16, --ledger-index-mb 16, after load) | $TODAY_ANON kB | <= 64 MiB: $(hist_ok "$TODAY_ANON <= 65536") (VmRSS $TODAY_RSS kB) |"
echo "| today's index file (as tests/ledger-gen left it) | $(( TIDX_SIZE / 1048576 )) MiB in $TCHUNKS chunk(s) | (reported) |"
echo "| /spend/events today, page 1 | $t_page ms | < 10 ms: $(hist_ok "$t_page < 10") |"
echo "| /spend/events today, page $TDEEP of 50 | $t_deep ms | < 10 ms: $(hist_ok "$t_deep < 10") |"
echo "| /spend/events today, one group, page 1 | $t_group ms | < 10 ms: $(hist_ok "$t_group < 10") |"
echo "| /spend/events today, one group, page $TGDEEP of 100 | $t_gdeep ms | < 10 ms: $(hist_ok "$t_gdeep < 10") |"
echo "| /spend/events today, one key, page $TKDEEP of 100 | $t_key ms | < 10 ms: $(hist_ok "$t_key < 10") |"
echo "| /usage/summary, today | $t_sum ms | < 50 ms: $(hist_ok "$t_sum < 50") |"
echo "| /usage/summary, today, one group | $t_gsum ms | < 50 ms: $(hist_ok "$t_gsum < 50") |"
echo "| requests/s at 64 conns on this day | ${R[ltg-today,c64,rps]} | (reported) $(ratio "${R[ltg-today,c64,rps]}" "${R[ltg,c64,rps]}") of ltg's without it |"
echo
fi

if grep -v 'listening on' "$T/ltg.log" | grep -q .; then
    echo
    echo "ltg logged during the benchmark (last 10 lines):"
    grep -v 'listening on' "$T/ltg.log" | tail -n 10 | sed 's/^/    /'
fi
if [ "$TLS" = 1 ] && grep -v 'listening on\|trust anchor' "$T/ltg-tls.log" | grep -q .; then
    echo
    echo "ltg (HTTPS) logged during the benchmark (last 10 lines):"
    grep -v 'listening on\|trust anchor' "$T/ltg-tls.log" | tail -n 10 | sed 's/^/    /'
fi

[ "$ERRORS_SEEN" = 0 ] && [ "$TLS_ERRORS_SEEN" = 0 ] || exit 1
[ "$STRICT" = 1 ] && [ "$MISSED" = 1 ] && exit 1
exit 0
