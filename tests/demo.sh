#!/usr/bin/env bash
# tests/demo.sh -- `make demo`: ltg in front of the bundled mock provider,
# walked through in readable steps. Needs nothing outside loopback and no
# API key. Everything it starts, it stops.
set -u
cd "$(dirname "$0")/.."
command -v curl >/dev/null || { echo "the demo needs curl: sudo apt-get install curl"; exit 1; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo $((20000 + RANDOM % 20000)); }
MOCK_PORT=$(free_port) LTG_PORT=$(free_port) ADMIN_PORT=$(free_port)
dir=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT

sed "s/127.0.0.1:9000/127.0.0.1:$MOCK_PORT/" ltg.example.json > "$dir/ltg.json"
export MOCK_API_KEY=demo-provider-key LTG_ADMIN_KEY=demo-admin-key
KEY=ltg-dev-key-change-me
BASE=http://127.0.0.1:$LTG_PORT

tests/mock --port "$MOCK_PORT" 2>"$dir/mock.log" & pids+=($!)
./ltg --config "$dir/ltg.json" --data "$dir/data" --listen 127.0.0.1:$LTG_PORT --admin-listen 127.0.0.1:$ADMIN_PORT 2>"$dir/ltg.log" & pids+=($!)
for _ in $(seq 50); do curl -sf "$BASE/healthz" >/dev/null && break; sleep 0.1; done

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
show() { printf '$ %s\n' "$*"; "$@"; echo; }

step "1. ltg is up (the mock provider plays Kimi-K3 and GLM-5.3-Flash on port $MOCK_PORT)"
show curl -s "$BASE/healthz"

step "2. The models this key may call"
show curl -s "$BASE/v1/models" -H "Authorization: Bearer $KEY"

step "3. A chat call: ltg rewrites the alias to the provider's model and injects the provider's key"
show curl -s -D - "$BASE/v1/chat/completions" -H "Authorization: Bearer $KEY" \
  -d '{"model":"Kimi-K3","messages":[{"role":"user","content":"Hello"}]}'
echo "What the provider received (the mock's record):"
curl -s "http://127.0.0.1:$MOCK_PORT/_mock/last" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("  model:", json.loads(d["body"])["model"], "| authorization:", d["headers"].get("authorization"))'

step "4. A streamed call: SSE events relayed one by one as the provider sends them"
show curl -s -N "$BASE/v1/chat/completions" -H "Authorization: Bearer $KEY" \
  -d '{"model":"GLM-5.3-Flash","stream":true,"mock":"event_delay_ms=300","messages":[{"role":"user","content":"Hello"}]}'

step "5. The provider fails (503): the failure is relayed and x-ltg-served-model is absent"
show curl -s -D - "$BASE/v1/chat/completions" -H "Authorization: Bearer $KEY" \
  -d '{"model":"Kimi-K3","mock":"status=503","messages":[{"role":"user","content":"Hello"}]}'

step "6. A key ltg does not know gets 401"
show curl -s -w ' (HTTP %{http_code})' "$BASE/v1/chat/completions" -H "Authorization: Bearer not-a-key" -d '{}'

step "7. Upstream connections were kept alive and reused"
curl -s "http://127.0.0.1:$MOCK_PORT/_mock/stats" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("  %d requests reached the provider over %d TCP connection(s)" % (d["requests"], d["connections"]))'

step "Done. ltg's log:"
sed 's/^/  /' "$dir/ltg.log"
