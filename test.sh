#!/usr/bin/env bash
# test.sh -- runs every test of ltg: the unit tests and the integration
# suite, against the release build and again under AddressSanitizer and
# UndefinedBehaviorSanitizer, and a short pass of each fuzz target (the
# suites run at the same time; each one's output is shown whole, in order).
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
dir=$(mktemp -d) skipped=$dir/skipped
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait; rm -rf "$dir"' EXIT
trap 'exit 130' INT TERM     # (through the EXIT trap: the suites still running are stopped)
: >"$skipped"

# start N CMD...: start suite number N in the background, its output into $dir/N.log (its exit
# status into $dir/N.rc). Suites run at the same time; each is shown whole, in order, by show.
start() {
  local n=$1; shift
  (
    "$@" >"$dir/$n.log" 2>&1 &
    c=$!
    trap 'kill -TERM $c 2>/dev/null' TERM
    wait $c
    rc=$?
    if kill -0 $c 2>/dev/null; then wait $c; rc=$?; fi   # the wait was cut by our TERM
    echo $rc >"$dir/$n.rc"
  ) &
  pids+=($!)
}

# show N NAME: wait for suite N, show its output, add up its closing line ("N passed, M failed[,
# K skipped]"). Its exit status counts too: a suite that exits non-zero after a clean line (a
# leak LeakSanitizer reports at exit, say) is one more failure. Its "skip - ..." lines are kept,
# to be named at the end.
show() {
  local n=$1 name=$2 log=$dir/$1.log
  while [ ! -e "$dir/$n.rc" ]; do sleep 0.5; done
  echo "=== $name"
  cat "$log"
  local rc last
  rc=$(cat "$dir/$n.rc")
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

# The unit tests take a second; then the integration suite against both builds and the fuzz pass
# run at the same time (most of the integration suite's time is waiting, and each of its runs
# has its own ports and directories: tests/integration.py --jobs).
start 1 ./tests/unit
start 2 ./tests/unit-asan
show 1 "unit"
show 2 "unit (asan+ubsan)"
start 3 python3 tests/integration.py --ltg ./ltg --mock ./tests/mock
start 4 python3 tests/integration.py --ltg ./ltg-asan --mock ./tests/mock
# A short pass of every fuzz target over its seeds (the crashes found so far among them);
# `make fuzz` installs clang's libFuzzer when it can, or says what to install.
start 5 make --no-print-directory fuzz FUZZ_SECONDS=5
show 3 "integration"
show 4 "integration (asan+ubsan)"
show 5 "fuzz (5 s per target)"
pids=()

if [ -s "$skipped" ]; then
  echo "skipped:"
  sed 's/^/  /' "$skipped"
fi
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" = 0 ]
