#!/usr/bin/env bash
# test.sh -- runs every test of ltg: the unit tests and the integration
# suite, first against the release build, then again under AddressSanitizer
# and UndefinedBehaviorSanitizer, then a short pass of each fuzz target.
# `make test` builds what it needs and calls this. The last line is
# "N passed, M failed, K skipped" (the skipped ones named, with why, just
# before it); the exit status is 0 only when nothing failed.
set -u
cd "$(dirname "$0")"

# The integration suite is Python 3 (standard library only).
if ! command -v python3 >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -qq python3 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq python3; } >/dev/null 2>&1
  fi
  command -v python3 >/dev/null || { echo "the tests need python3: run  sudo apt-get install python3"; echo "0 passed, 1 failed"; exit 1; }
fi

pass=0 fail=0 skip=0
log=$(mktemp) skipped=$(mktemp)
trap 'rm -f "$log" "$skipped"' EXIT

# run NAME CMD...: run one suite, show its output, add up its closing line
# ("N passed, M failed[, K skipped]"). Its exit status counts too: a suite
# that exits non-zero after a clean line (a leak LeakSanitizer reports at
# exit, say) is one more failure. Its "skip - ..." lines are kept, to be
# named at the end.
run() {
  local name=$1; shift
  echo "=== $name"
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]} last
  grep -a '^skip - ' "$log" | sed "s/^skip - /$name: /" >>"$skipped"
  last=$(grep -a -E '^([a-z-]+: )?[0-9]+ passed, [0-9]+ failed' "$log" | tail -n 1)
  if [ -z "$last" ]; then
    echo "FAIL - $name ended without a summary line (crashed?), exit status $rc"
    fail=$((fail + 1))
    return
  fi
  local p f k
  p=$(sed -E 's/^([a-z-]+: )?([0-9]+) passed, ([0-9]+) failed.*/\2/' <<<"$last")
  f=$(sed -E 's/^([a-z-]+: )?([0-9]+) passed, ([0-9]+) failed.*/\3/' <<<"$last")
  k=$(sed -n -E 's/.*, ([0-9]+) skipped.*/\1/p' <<<"$last")
  pass=$((pass + p)) fail=$((fail + f)) skip=$((skip + ${k:-0}))
  if [ "$rc" != 0 ] && [ "$f" = 0 ]; then
    echo "FAIL - $name exited with status $rc after \"$last\""
    fail=$((fail + 1))
  fi
}

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

run "unit" ./tests/unit
run "unit (asan+ubsan)" ./tests/unit-asan
run "integration" python3 tests/integration.py --ltg ./ltg --mock ./tests/mock
run "integration (asan+ubsan)" python3 tests/integration.py --ltg ./ltg-asan --mock ./tests/mock
# A short pass of every fuzz target over its seeds (the crashes found so far among them);
# `make fuzz` installs clang's libFuzzer when it can, or says what to install.
run "fuzz (5 s per target)" make --no-print-directory fuzz FUZZ_SECONDS=5

if [ -s "$skipped" ]; then
  echo "skipped:"
  sed 's/^/  /' "$skipped"
fi
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" = 0 ]
