#!/usr/bin/env bash
# tests/cluster-demo.sh -- `make cluster-demo`: three ltg instances as one
# gateway on one box, sharing a Redis, behind HAProxy (which asks each one's
# /readyz), in front of the bundled mock provider. The tour: a change made on
# one instance read on another, a stale write refused wherever it is sent, a
# budget that holds across all three under parallel load, a key revoked
# everywhere at once, and Redis stopped and started again. Debian's
# redis-server and haproxy are installed when missing (root with apt-get);
# otherwise it says what to install. Loopback only; everything it starts, it
# stops.
set -u
cd "$(dirname "$0")/.."
PATH=$PATH:/usr/sbin:/sbin
need=()
for t in redis-server:redis-server haproxy:haproxy curl:curl python3:python3; do
  command -v "${t%%:*}" >/dev/null || need+=("${t#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing ${need[*]}"
    made=0
    # keep the packages from starting their system services
    [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made=1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null 2>&1; }
    [ "$made" = 1 ] && rm -f /usr/sbin/policy-rc.d
  fi
  for t in redis-server haproxy curl python3; do
    command -v "$t" >/dev/null || { echo "the cluster demo needs $t: sudo apt-get install -y ${need[*]}"; exit 1; }
  done
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
MOCK_PORT=$(free_port) REDIS_PORT=$(free_port) LB_PORT=$(free_port)
dir=$(mktemp -d)
pids=()
cleanup() {
  kill "${pids[@]}" 2>/dev/null
  redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1
  wait 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT

sed "s/127.0.0.1:9000/127.0.0.1:$MOCK_PORT/" examples/ltg.example.json > "$dir/ltg.json"
export MOCK_API_KEY=demo-provider-key LTG_ADMIN_KEY=demo-admin-key-$$

start_redis() {
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$dir" --appendonly yes --appendfsync always \
    --save '' --maxmemory-policy noeviction --daemonize yes --logfile "$dir/redis.log"
  for _ in $(seq 50); do [ "$(redis-cli -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ] && return; sleep 0.1; done
  echo "redis-server did not start:"; tail -5 "$dir/redis.log"; exit 1
}
tests/mock --port "$MOCK_PORT" 2>"$dir/mock.log" & pids+=($!)
start_redis
declare -a PORT ADMIN_PORT
for i in 1 2 3; do
  PORT[$i]=$(free_port) ADMIN_PORT[$i]=$(free_port)
  ./ltg --config "$dir/ltg.json" --data "$dir/data$i" --listen "127.0.0.1:${PORT[$i]}" \
    --admin-listen "127.0.0.1:${ADMIN_PORT[$i]}" --cluster "redis://127.0.0.1:$REDIS_PORT" \
    --access-log "$dir/access$i.log" 2>"$dir/ltg$i.log" & pids+=($!)
done
cat > "$dir/haproxy.cfg" <<EOF
global
    log stdout format raw local0 err
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
frontend ltg
    bind 127.0.0.1:$LB_PORT
    default_backend ltgs
backend ltgs
    balance roundrobin
    option httpchk GET /readyz
    server ltg1 127.0.0.1:${PORT[1]} check inter 500ms fall 2 rise 1
    server ltg2 127.0.0.1:${PORT[2]} check inter 500ms fall 2 rise 1
    server ltg3 127.0.0.1:${PORT[3]} check inter 500ms fall 2 rise 1
EOF
haproxy -f "$dir/haproxy.cfg" -db >"$dir/haproxy.log" 2>&1 & pids+=($!)
for i in 1 2 3; do
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:${PORT[$i]}/readyz" >/dev/null && break; sleep 0.1; done
done
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$LB_PORT/healthz" >/dev/null && break; sleep 0.1; done

LB=http://127.0.0.1:$LB_PORT
adm() { echo "http://127.0.0.1:${ADMIN_PORT[$1]}/v2/llm_token_gateway"; }
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
admin() { curl -s -H "Authorization: Bearer $LTG_ADMIN_KEY" "$@"; }
# the call of the tour: the mock answers it with max_tokens of output, so that it costs about its worst case
BODY='{"model":"Kimi-K3","max_tokens":1000,"mock":"head_delay_ms=300 events=1000","messages":[{"role":"user","content":"Hello"}]}'
chat() { curl -s -o /dev/null -w '%{http_code}\n' "$LB/v1/chat/completions" -H "Authorization: Bearer $1" -d "$BODY"; }

echo "three ltg instances (inference ports ${PORT[1]}, ${PORT[2]}, ${PORT[3]}) on redis://127.0.0.1:$REDIS_PORT,"
echo "HAProxy on 127.0.0.1:$LB_PORT in front of them (round robin, health check GET /readyz)"

step "1. A token group made on instance 1, with a budget that fits exactly 5 worst cases of the call below"
# the worst case of that call at Kimi-K3's prices (0.60 / 2.50 USD per million tokens): its
# bytes / 3 of input and max_tokens 1000 of output
WORST=$(python3 -c "import math; print(math.ceil(((len('$BODY') + 2) // 3) * 0.60 + 1000 * 2.50))")
admin "$(adm 1)/token_groups" -H "Idempotency-Key: cdemo-g-$$" \
  -d "{\"name\":\"cluster-demo\",\"allowed_models\":[\"Kimi-K3\"],\"max_budget\":$(python3 -c "print(($WORST * 5 + 1) / 1e6)"),\"budget_duration\":\"1d\"}" > "$dir/g.json"
GROUP=$(field 'd["data"]["id"]' < "$dir/g.json")
echo "group $GROUP: max_budget $(field 'd["data"]["max_budget"]' < "$dir/g.json") USD (5 x $WORST micro-USD + 1)"
echo "instance 3 reads it at once: version $(admin "$(adm 3)/token_groups/$GROUP" | field 'd["data"]["version"]')," \
  "name $(admin "$(adm 3)/token_groups/$GROUP" | field 'd["data"]["name"]')"
admin "$(adm 2)/token_keys" -H "Idempotency-Key: cdemo-k-$$" -d "{\"name\":\"demo-app\",\"token_group_id\":\"$GROUP\"}" > "$dir/k.json"
KEY=$(field 'd["data"]["token"]' < "$dir/k.json") KEY_ID=$(field 'd["data"]["id"]' < "$dir/k.json")
admin "$(adm 2)/token_keys" -H "Idempotency-Key: cdemo-k3-$$" -d "{\"name\":\"demo-app-2\",\"token_group_id\":\"$GROUP\"}" > "$dir/k3.json"
KEY2=$(field 'd["data"]["token"]' < "$dir/k3.json")
echo "a token key issued on instance 2: ${KEY:0:12}…"

step "2. 30 calls at once through HAProxy, spread over the three: the budget admits exactly 5"
calls=()
for i in $(seq 30); do chat "$KEY" > "$dir/call$i" & calls+=($!); done
wait "${calls[@]}"
cat "$dir"/call* | sort | uniq -c | awk '{print "  " $1 " x HTTP " $2}'
for i in 1 2 3; do
  echo "  instance $i answered $(grep -c '"path":"/v1/chat/completions"' "$dir/access$i.log") of them," \
    "$(grep '"path":"/v1/chat/completions"' "$dir/access$i.log" | grep -c '"status":200') with 200"
done
sleep 0.3
echo "the shared store's count for the group: $(redis-cli -p "$REDIS_PORT" hget "ltg:b:g:$GROUP" spent) nano-USD spent," \
  "$(redis-cli -p "$REDIS_PORT" hget "ltg:b:g:$GROUP" held) held"
echo "one more call is refused on any instance:"
curl -s "$LB/v1/chat/completions" -H "Authorization: Bearer $KEY" -d "$BODY" | field 'd["error"]["message"]' | sed 's/^/  /'

step "3. A stale If-Match is 412 wherever it is sent"
admin -o /dev/null -w '  PATCH on instance 1 with If-Match "1": HTTP %{http_code}, ETag %header{etag}\n' -X PATCH "$(adm 1)/token_groups/$GROUP" \
  -H 'If-Match: "1"' -H "Idempotency-Key: cdemo-p1-$$" -d '{"name":"cluster-demo-renamed"}'
admin -w '  (HTTP %{http_code}: the same If-Match on instance 3)\n' -X PATCH "$(adm 3)/token_groups/$GROUP" \
  -H 'If-Match: "1"' -H "Idempotency-Key: cdemo-p2-$$" -d '{"name":"another-name"}' | sed 's/^/  /'

step "4. The key revoked on instance 3: every instance refuses it at once"
admin -o /dev/null -w '  DELETE on instance 3: HTTP %{http_code}\n' -X DELETE "$(adm 3)/token_keys/$KEY_ID" -H 'If-Match: "1"' -H "Idempotency-Key: cdemo-d-$$"
for i in 1 2 3; do
  echo "  instance $i: HTTP $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:${PORT[$i]}/v1/chat/completions" -H "Authorization: Bearer $KEY" -d "$BODY")"
done

step "5. Redis stopped: changes and budgeted calls get 503 (uncapped ones are served), /readyz says why"
admin "$(adm 1)/token_groups" -H "Idempotency-Key: cdemo-g2-$$" -d '{"name":"uncapped","allowed_models":["Kimi-K3"]}' > "$dir/g2.json"
admin "$(adm 1)/token_keys" -H "Idempotency-Key: cdemo-k2-$$" -d "{\"name\":\"uncapped-app\",\"token_group_id\":\"$(field 'd["data"]["id"]' < "$dir/g2.json")\"}" > "$dir/k2.json"
FREE=$(field 'd["data"]["token"]' < "$dir/k2.json")
redis-cli -p "$REDIS_PORT" shutdown >/dev/null 2>&1
sleep 1
echo "  instance 1 /readyz: $(curl -s "http://127.0.0.1:${PORT[1]}/readyz") (HTTP $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:${PORT[1]}/readyz"))"
echo "  a change: $(admin -X POST "$(adm 2)/token_groups" -H "Idempotency-Key: cdemo-g3-$$" -d '{"name":"x","allowed_models":["Kimi-K3"]}' | field 'd["errors"][0]["code"] + ": " + d["errors"][0]["detail"]')"
echo "  a call of the group with a budget: $(curl -s "http://127.0.0.1:${PORT[2]}/v1/chat/completions" -H "Authorization: Bearer $KEY2" -d "$BODY" | field 'd["error"]["code"] + ": " + d["error"]["message"]')"
echo "  a call of an uncapped group: HTTP $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:${PORT[2]}/v1/chat/completions" -H "Authorization: Bearer $FREE" -d "$BODY")"
echo "  ltg_cluster_up on instance 2: $(curl -s "http://127.0.0.1:${ADMIN_PORT[2]}/metrics" | grep '^ltg_cluster_up')"
start_redis
for i in 1 2 3; do  # each instance reconnects by itself; HAProxy sends to those ready
  for _ in $(seq 150); do curl -sf "http://127.0.0.1:${PORT[$i]}/readyz" >/dev/null && break; sleep 0.1; done
done
sleep 1.2  # HAProxy's health check (every 500 ms) sees them back
echo "Redis started again (its append-only file kept): instance 1 /readyz: $(curl -s "http://127.0.0.1:${PORT[1]}/readyz")"
echo "  a call of an uncapped group through HAProxy: HTTP $(curl -s -o /dev/null -w '%{http_code}' "$LB/v1/chat/completions" -H "Authorization: Bearer $FREE" -d "$BODY")"

step "6. One ledger: every instance answers for every call, whichever instance served it"
FROM=$(date -u -d yesterday +%F) TO=$(date -u -d '2 days' +%F)
for _ in $(seq 100); do  # the call kept through the outage reaches every ledger once shipped
  n=$(admin "$(adm 3)/spend/events?start_date=$FROM&end_date=$TO&page%5Bsize%5D=1000" | field 'd["meta"]["total_results"]')
  [ "$n" = 7 ] && break; sleep 0.1
done
for i in 1 2 3; do
  admin "$(adm "$i")/spend/events?start_date=$FROM&end_date=$TO&page%5Bsize%5D=1000" |
    field '"  instance %d: %d events, their ids hashed %s" % ('"$i"', d["meta"]["total_results"],
           __import__("hashlib").sha256(" ".join(e["id"] for e in d["data"]).encode()).hexdigest()[:16])'
done

step "Done. What instance 1 logged of the cluster:"
grep 'cluster:' "$dir/ltg1.log" | sed 's/^/  /'
