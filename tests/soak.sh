#!/usr/bin/env bash
# soak.sh -- SOAK_SECONDS (default 180) of mixed load with failure injection
# against the release ./ltg and the mock provider, from SOAK_CLIENTS (16)
# concurrent clients; then checks that ltg is alive, answered nothing
# unexpected, kept its open fds and RSS flat after the warm-up, and exits 0 on
# SIGTERM. `make soak` builds what it needs and calls this; the load and the
# checks are tests/soak.py (Python 3, standard library only). The last line
# is "N passed, M failed"; the exit status is 0 only when nothing failed.
set -u
cd "$(dirname "$0")/.."
command -v python3 >/dev/null || { echo "the soak needs python3: run  sudo apt-get install python3"; echo "0 passed, 1 failed"; exit 1; }
exec python3 tests/soak.py --ltg ./ltg --mock tests/mock --seconds "${SOAK_SECONDS:-180}" --clients "${SOAK_CLIENTS:-16}"
