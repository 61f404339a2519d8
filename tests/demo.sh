#!/usr/bin/env bash
# tests/demo.sh -- `make demo`: ltg in front of the bundled mock provider,
# walked through in readable steps: provision a token group and a key on the
# control plane, call models with the key, see a refused policy change and a
# stale write, and revoke the key. Needs nothing outside loopback and no API
# key. Everything it starts, it stops.
set -u
cd "$(dirname "$0")/.."
for tool in curl python3; do
  command -v $tool >/dev/null || { echo "the demo needs $tool: sudo apt-get install $tool"; exit 1; }
done

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
MOCK_PORT=$(free_port) LTG_PORT=$(free_port) ADMIN_PORT=$(free_port)
dir=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT

sed "s/127.0.0.1:9000/127.0.0.1:$MOCK_PORT/" examples/ltg.example.json > "$dir/ltg.json"
export MOCK_API_KEY=demo-provider-key LTG_ADMIN_KEY=demo-admin-key-$$
BASE=http://127.0.0.1:$LTG_PORT
ADMIN=http://127.0.0.1:$ADMIN_PORT/v2/llm_token_gateway

tests/mock --port "$MOCK_PORT" 2>"$dir/mock.log" & pids+=($!)
./ltg --config "$dir/ltg.json" --data "$dir/data" --listen 127.0.0.1:$LTG_PORT --admin-listen 127.0.0.1:$ADMIN_PORT --access-log "$dir/access.log" 2>"$dir/ltg.log" & pids+=($!)
for _ in $(seq 50); do curl -sf "$BASE/healthz" >/dev/null && break; sleep 0.1; done

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
# show CMD...: print the command (secrets shortened), run it, print its output.
quote() { local a; for a in "$@"; do if [[ $a =~ ^[A-Za-z0-9_./:=@%+-]+$ ]]; then printf '%s ' "$a"; else printf "'%s' " "${a//\'/\'\\\'\'}"; fi; done; }
show() { printf '$ %s\n' "$(quote "$@" | sed -E "s/$LTG_ADMIN_KEY/\$LTG_ADMIN_KEY/g; s/ltg_sk_[A-Za-z0-9_-]+/\$KEY/g")"; "$@"; echo; }
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
admin() { curl -s -H "Authorization: Bearer $LTG_ADMIN_KEY" "$@"; }

step "1. Provision a token group: Kimi-K3 falls back to GLM-5.3-Flash, 2 attempts, a 10 USD daily budget"
GROUP_BODY='{"name":"gateway-fallbacks-demo","allowed_models":["Kimi-K3","GLM-5.3-Flash"],"fallbacks":{"Kimi-K3":["GLM-5.3-Flash"]},"retries":{"max_attempts":2,"retry_delay_ms":250,"backoff":"exponential"},"max_budget":10,"budget_duration":"1d"}'
echo "\$ curl -s \$ADMIN/token_groups -H 'Authorization: Bearer \$LTG_ADMIN_KEY' -H 'Idempotency-Key: …' -d '$GROUP_BODY'"
admin -D "$dir/h1" "$ADMIN/token_groups" -H "Idempotency-Key: demo-group-$$" -d "$GROUP_BODY" > "$dir/group.json"
python3 -m json.tool "$dir/group.json"
GROUP=$(field 'd["data"]["id"]' < "$dir/group.json")
echo "ETag: $(grep -i '^etag' "$dir/h1" | tr -d '\r' | cut -d' ' -f2)"

step "2. Issue a token key for the group: the secret is shown this once, ltg keeps only its SHA-256"
admin "$ADMIN/token_keys" -H "Idempotency-Key: demo-key-$$" -d "{\"name\":\"demo-app\",\"token_group_id\":\"$GROUP\"}" > "$dir/key.json"
KEY=$(field 'd["data"]["token"]' < "$dir/key.json")
KEY_ID=$(field 'd["data"]["id"]' < "$dir/key.json")
echo "token key $KEY_ID: ${KEY:0:12}… (the application holds this; it cannot manage the gateway)"

step "3. The application calls a model with its key"
show curl -s -D - "$BASE/v1/chat/completions" -H "Authorization: Bearer $KEY" \
  -d '{"model":"Kimi-K3","messages":[{"role":"user","content":"Hello"}]}'
echo "What the provider received: $(curl -s "http://127.0.0.1:$MOCK_PORT/_mock/last" | field '"model=" + json.loads(d["body"])["model"] + ", authorization=" + d["headers"]["authorization"]')"

step "4. A streamed call: SSE events relayed one by one as the provider sends them"
show curl -s -N "$BASE/v1/chat/completions" -H "Authorization: Bearer $KEY" \
  -d '{"model":"GLM-5.3-Flash","stream":true,"mock":"event_delay_ms=200","messages":[{"role":"user","content":"Hello"}]}'

step "5. Forced failover on a stream: the primary's first event comes after 3 s; the request allows 1 s"
echo "(the mock is told to make kimi-k3 slow for one call: POST /_mock/script)"
curl -s -o /dev/null "http://127.0.0.1:$MOCK_PORT/_mock/script" -d '{"model":"kimi-k3","steps":["first_event_delay_ms=3000"]}'
show curl -s -N -D "$dir/h5" -o "$dir/b5" "$BASE/v1/chat/completions" -H "Authorization: Bearer $KEY" \
  -H 'x-ltg-request-timeout: 1000' -H 'x-ltg-max-attempts: 1' \
  -d '{"model":"Kimi-K3","stream":true,"messages":[{"role":"user","content":"Hello"}]}'
hdr() { grep -i "^$1:" "$dir/h5" | tr -d '\r' | cut -d' ' -f2; }
echo "requested model: Kimi-K3"
echo "served model:    $(hdr x-ltg-served-model)   (x-ltg-served-model)"
echo "attempts:        $(hdr x-ltg-attempts)               (x-ltg-attempts: the primary timed out, the fallback answered)"
echo "request id:      $(hdr x-ltg-request-id)"
echo "stream complete: $(grep -c '^data: ' "$dir/b5") events, last: $(grep '^data: ' "$dir/b5" | tail -n 1)"

step "6. The primary fails with 503: the gateway moves to the fallback (and never retries a 503 on the same model)"
curl -s -o /dev/null "http://127.0.0.1:$MOCK_PORT/_mock/script" -d '{"model":"kimi-k3","steps":["status=503"]}'
show curl -s -o /dev/null -w 'HTTP %{http_code}, served by %header{x-ltg-served-model}, %header{x-ltg-attempts} attempts\n' \
  "$BASE/v1/chat/completions" -H "Authorization: Bearer $KEY" -d '{"model":"Kimi-K3","messages":[{"role":"user","content":"Hello"}]}'

step "7. The same failover, found again in the consumption ledger"
REQ_ID=$(hdr x-ltg-request-id)
TODAY=$(date -u +%F) TOMORROW=$(date -u -d tomorrow +%F)
echo "\$ curl -s -g \"\$ADMIN/spend/events?start_date=$TODAY&end_date=$TOMORROW&token_group_id=$GROUP\" -H 'Authorization: Bearer \$LTG_ADMIN_KEY'"
admin -g "$ADMIN/spend/events?start_date=$TODAY&end_date=$TOMORROW&token_group_id=$GROUP&page[size]=100" | python3 -c '
import json, sys
rid = sys.argv[1]
for e in json.load(sys.stdin)["data"]:
    if e["request_id"] == rid:
        print("request %s: requested %s -> served %s, %d attempts, status %s, cost %.6f USD" % (
            rid, e["requested_model"], e["model"], e["attempts"], e["status"], e["cost"]))
        for a in e["attempt_log"]:
            print("  attempt_log: %-14s attempt %d  status %3d  %-13s %5d ms  %s" % (a["model"], a["attempt"], a["status"], a["outcome"], a["ms"], a.get("error", "")))' "$REQ_ID"
echo
echo "the usage summary of the group today:"
admin "$ADMIN/usage/summary?token_group_id=$GROUP&start_date=$TODAY&end_date=$TOMORROW" | python3 -c '
import json, sys
d = json.load(sys.stdin)["data"]; t = d["totals"]
print("  totals: %d requests (%d succeeded, %d failed, %d partial), %d input + %d output tokens, %.6f USD" % (
    t["requests"], t["succeeded_requests"], t["failed_requests"], t["partial_requests"], t["input_tokens"], t["output_tokens"], t["spend"]))
for m in d["by_model"]:
    print("  %-14s %d requests, %.6f USD" % (m["model"], m["requests"], m["spend"]))'

step "8. A model outside the group's allowed_models is refused before any provider call"
show curl -s -w ' (HTTP %{http_code})' "$BASE/v1/chat/completions" -H "Authorization: Bearer $KEY" \
  -d '{"model":"Local-Llama","messages":[{"role":"user","content":"Hello"}]}'

step "9. An invalid policy update (max_attempts 9) is refused with 400, and the group is unchanged"
show curl -s -w ' (HTTP %{http_code})' -X PATCH "$ADMIN/token_groups/$GROUP" -H "Authorization: Bearer $LTG_ADMIN_KEY" \
  -H 'If-Match: "1"' -H "Idempotency-Key: demo-bad-$$" -d '{"retries":{"max_attempts":9}}'
echo "version is still $(admin "$ADMIN/token_groups/$GROUP" | field 'd["data"]["version"]'), max_attempts still $(admin "$ADMIN/token_groups/$GROUP" | field 'd["data"]["retries"]["max_attempts"]')"

step "10. A valid update with the current ETag, then a second writer with the stale one gets 412"
show curl -s -o /dev/null -w 'HTTP %{http_code}, ETag %header{etag}' -X PATCH "$ADMIN/token_groups/$GROUP" -H "Authorization: Bearer $LTG_ADMIN_KEY" \
  -H 'If-Match: "1"' -H "Idempotency-Key: demo-ok-$$" -d '{"retries":{"max_attempts":3,"retry_delay_ms":100,"backoff":"linear"}}'
show curl -s -w ' (HTTP %{http_code})' -X PATCH "$ADMIN/token_groups/$GROUP" -H "Authorization: Bearer $LTG_ADMIN_KEY" \
  -H 'If-Match: "1"' -H "Idempotency-Key: demo-stale-$$" -d '{"name":"renamed"}'

step "11. Teardown: revoke the key; from now on it gets 401"
show curl -s -w ' (HTTP %{http_code})' -X DELETE "$ADMIN/token_keys/$KEY_ID" -H "Authorization: Bearer $LTG_ADMIN_KEY" \
  -H 'If-Match: "1"' -H "Idempotency-Key: demo-revoke-$$"
show curl -s -w ' (HTTP %{http_code})' "$BASE/v1/chat/completions" -H "Authorization: Bearer $KEY" \
  -d '{"model":"Kimi-K3","messages":[{"role":"user","content":"Hello"}]}'

step "12. What an operator sees: the metrics (GET /metrics on the admin listener, Prometheus format)"
echo "\$ curl -s http://127.0.0.1:\$ADMIN_PORT/metrics | grep -E '^ltg_(requests|attempts)_total'"
curl -s "http://127.0.0.1:$ADMIN_PORT/metrics" | grep -E '^ltg_(requests|attempts)_total' | sed 's/^/  /'
echo
echo "and the access log (--access-log FILE): one JSON line per request, never a secret; the failover's:"
grep "\"request_id\":\"$REQ_ID\"" "$dir/access.log" | sed 's/^/  /'

step "Done. ltg's own log:"
sed 's/^/  /' "$dir/ltg.log"
