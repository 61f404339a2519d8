# ltg -- build, test, demo, bench.
#   make            the static, stripped gateway ./ltg
#   make test       ./test.sh: unit + integration tests, again under ASan+UBSan, a short fuzz pass
#   make cluster-demo  tests/cluster-demo.sh: three instances on one Redis behind HAProxy
#   make bench      tests/bench.sh: ltg against nginx, same upstream, same run
#   make profile    the same with ./ltg-profile (symbols, frame pointers) under perf record
#   make fuzz       tests/fuzz.c under libFuzzer+ASan+UBSan, FUZZ_SECONDS (10) per target
#   make valgrind   the integration suite with every ltg under valgrind's memcheck
#   make soak       tests/soak.sh: SOAK_SECONDS (180) of mixed load; RSS and fds stable
#   make install    the binary, the example catalog, the systemd unit, the logrotate snippet
#                   (PREFIX=/usr/local, DESTDIR= for staging; never overwrites /etc/ltg/ltg.json)
CC ?= cc
CFLAGS ?= -O2
WARN = -std=c11 -Wall -Wextra -Wshadow
SAN = -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all

all: ltg

# BearSSL is the one library. Install it when we can (root with apt),
# otherwise say exactly what to run.
deps:
	@if [ ! -f /usr/include/bearssl.h ] || ! ls /usr/lib/*/libbearssl.a >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing libbearssl-dev"; \
	    (apt-get install -y -qq libbearssl-dev >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null && apt-get install -y -qq libbearssl-dev >/dev/null)) || exit 1; \
	  else \
	    echo "ltg needs BearSSL: run  sudo apt-get install libbearssl-dev"; exit 1; \
	  fi; \
	fi

BEARSSL = $$(ls /usr/lib/*/libbearssl.a | head -n 1)

ltg: ltg.c ltg.h | deps
	$(CC) $(CFLAGS) $(WARN) $(CFLAGS_EXTRA) -static -s -o $@ ltg.c $(BEARSSL) -lm

ltg-asan: ltg.c ltg.h | deps
	$(CC) $(SAN) $(WARN) $(CFLAGS_EXTRA) -o $@ ltg.c $(BEARSSL) -lm

# For valgrind: dynamic (memcheck cannot replace a static glibc's malloc), -O1 -g.
ltg-valgrind: ltg.c ltg.h | deps
	$(CC) -O1 -g $(WARN) $(CFLAGS_EXTRA) -o $@ ltg.c $(BEARSSL) -lm

# The unit tests include ltg.c without its main(), so the start-up helpers
# that only main() calls are unused there: hence -Wno-unused-function.
tests/unit: tests/unit.c tests/reset.h tests/fixtures.h ltg.c ltg.h | deps
	$(CC) -O1 -g $(WARN) -Wno-unused-function $(CFLAGS_EXTRA) -o $@ tests/unit.c $(BEARSSL) -lm

tests/unit-asan: tests/unit.c tests/reset.h tests/fixtures.h ltg.c ltg.h | deps
	$(CC) $(SAN) $(WARN) -Wno-unused-function $(CFLAGS_EXTRA) -o $@ tests/unit.c $(BEARSSL) -lm

# The benchmark's history: spend events written through ltg's own ledger code.
tests/ledger-gen: tests/ledger-gen.c ltg.c ltg.h | deps
	$(CC) -O2 $(WARN) -Wno-unused-function $(CFLAGS_EXTRA) -o $@ tests/ledger-gen.c $(BEARSSL) -lm

tests/mock: tests/mock.c | deps
	$(CC) -O2 -std=c11 -Wall -Wextra $(CFLAGS_EXTRA) -pthread -o $@ tests/mock.c $(BEARSSL)

test: ltg ltg-asan tests/unit tests/unit-asan tests/mock tests/ledger-gen
	./test.sh

demo: ltg tests/mock
	tests/demo.sh

# Three instances on one Redis behind HAProxy (installs redis-server and haproxy when it can).
cluster-demo: ltg tests/mock
	tests/cluster-demo.sh

bench: ltg tests/mock tests/ledger-gen
	tests/bench.sh

# A symbolised build for perf: what make bench measures, with -g and frame pointers, not stripped.
ltg-profile: ltg.c ltg.h | deps
	$(CC) $(CFLAGS) -g -fno-omit-frame-pointer $(WARN) $(CFLAGS_EXTRA) -static -o $@ ltg.c $(BEARSSL) -lm

profile: ltg-profile tests/mock tests/ledger-gen
	@command -v perf >/dev/null || apt-get install -y -qq linux-perf >/dev/null 2>&1 || \
	  { echo "make profile needs perf: sudo apt-get install linux-perf"; exit 1; }
	LTG_BIN=./ltg-profile BENCH_PROFILE=1 BENCH_TLS=0 BENCH_HISTORY_EVENTS=0 BENCH_TODAY_EVENTS=0 \
	  BENCH_TRAFFIC_BASE= BENCH_BASE= tests/bench.sh

# The whole integration suite with every ltg it starts run under memcheck:
# any invalid access, use of uninitialised memory or leak (definite, indirect
# or possible, reported when ltg exits on SIGTERM) fails the test it happened
# in, or the closing "clean exits" check (--vgdb=no: an ltg a test kills
# leaves no FIFO in /tmp). valgrind is installed when we can.
VALGRIND = valgrind --leak-check=full --show-leak-kinds=definite,indirect,possible \
  --errors-for-leak-kinds=definite,indirect,possible --error-exitcode=99 --track-fds=no -q --vgdb=no

valgrind: ltg-valgrind tests/mock
	@if ! command -v valgrind >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing valgrind"; \
	    (apt-get install -y -qq valgrind >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null && apt-get install -y -qq valgrind >/dev/null)) || exit 1; \
	  else \
	    echo "make valgrind needs valgrind: run  sudo apt-get install valgrind"; exit 1; \
	  fi; \
	fi
	python3 tests/integration.py --ltg ./ltg-valgrind --mock ./tests/mock --wrap "$(VALGRIND)"

# SOAK_SECONDS (180) of mixed load with failure injection against ./ltg;
# checks that its RSS and open fds stay flat after the warm-up.
soak: ltg tests/mock
	tests/soak.sh

# Fuzzing: one libFuzzer target of tests/fuzz.c per name, built with clang
# (ASan+UBSan) as tests/fuzz-<name>, run for FUZZ_SECONDS over a scratch
# copy of its seeds in tests/fuzz/<name>/ (new inputs never land in the
# repo). Fails if any target crashes; the crashing input is kept in the
# scratch directory it names. libFuzzer comes with libclang-rt-14-dev:
# installed when we can (root with apt), otherwise we say what to run.
FUZZ_SECONDS ?= 10
FUZZ_TARGETS = http_request http_response json config log_replay dns stored tls_anchors resp xl
FUZZ_CC ?= clang
FUZZ_FLAGS = -O1 -g -fsanitize=fuzzer,address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all

fuzz: | deps
	@if ! echo 'int LLVMFuzzerTestOneInput(const char *d, long n) { return 0; }' | \
	    $(FUZZ_CC) -fsanitize=fuzzer -x c -o /dev/null - >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    pkgs=libclang-rt-14-dev; command -v $(FUZZ_CC) >/dev/null || pkgs="clang $$pkgs"; \
	    echo "installing $$pkgs"; \
	    (apt-get install -y -qq $$pkgs >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null && apt-get install -y -qq $$pkgs >/dev/null)) || exit 1; \
	  else \
	    echo "make fuzz needs clang's libFuzzer: run  sudo apt-get install clang libclang-rt-14-dev"; exit 1; \
	  fi; \
	fi
	@$(MAKE) --no-print-directory $(FUZZ_TARGETS:%=tests/fuzz-%)
	@pass=0 fail=0; \
	for t in $(FUZZ_TARGETS); do \
	  work=$$(mktemp -d "$${TMPDIR:-/tmp}/ltg-fuzz-$$t.XXXXXX") || exit 1; \
	  mkdir "$$work/corpus" && cp tests/fuzz/$$t/* "$$work/corpus/" || exit 1; \
	  scratch=$$(mktemp -d /dev/shm/ltg-fuzz-$$t.XXXXXX 2>/dev/null || mktemp -d "$$work/scratch.XXXXXX") || exit 1; \
	  if LTG_FUZZ_TMP="$$scratch" UBSAN_OPTIONS=$${UBSAN_OPTIONS:-print_stacktrace=1} tests/fuzz-$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 -close_fd_mask=2 -print_final_stats=1 \
	       -artifact_prefix="$$work/" "$$work/corpus" >"$$work/fuzz.log" 2>&1; then \
	    rm -rf "$$scratch"; \
	    echo "fuzz $$t: $$(grep -h 'stat::number_of_executed_units' "$$work/fuzz.log" | awk '{print $$2}') inputs in $(FUZZ_SECONDS) s, no crash"; \
	    rm -rf "$$work"; pass=$$((pass + 1)); \
	  else \
	    rm -rf "$$scratch"; fail=$$((fail + 1)); \
	    input=$$(ls "$$work"/crash-* "$$work"/leak-* "$$work"/timeout-* "$$work"/oom-* 2>/dev/null | head -n 1); \
	    for s in tests/fuzz/$$t/*; do cmp -s "$$s" "$$input" && input="$$input (= the seed $$s)"; done; \
	    echo "fuzz $$t: FAILED; the input: $$input"; \
	    echo "  the log: $$work/fuzz.log; replay: tests/fuzz-$$t INPUT"; \
	    grep -h -m 1 -E 'ERROR: |check failed|runtime error' "$$work/fuzz.log" | sed 's/^/  /'; \
	  fi; \
	done; \
	echo "fuzz: $$pass passed, $$fail failed"; \
	[ $$fail = 0 ]

# tests/fuzz-<name>: the target FUZZ_<NAME> of tests/fuzz.c.
tests/fuzz-%: tests/fuzz.c tests/reset.h tests/fixtures.h ltg.c ltg.h | deps
	$(FUZZ_CC) $(FUZZ_FLAGS) $(WARN) -Wno-unused-function $(CFLAGS_EXTRA) -DFUZZ_$$(echo $* | tr a-z A-Z) -o $@ tests/fuzz.c $(BEARSSL) -lm

# install: the files an operator needs, where a Debian box looks for them.
# The unit goes where systemd looks for units of PREFIX (/usr/local/lib/
# systemd/system for the default), with the binary's path filled in; the
# catalog is copied to /etc/ltg/ltg.json only when none is there yet.
PREFIX ?= /usr/local
DESTDIR ?=
SYSCONFDIR ?= /etc
LTG ?= ltg
install: ltg
	@$(MAKE) --no-print-directory install-files

# install-files: install $(LTG) as it is (the tests install the binary under test).
install-files:
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/ltg $(DESTDIR)$(PREFIX)/lib/systemd/system \
	  $(DESTDIR)$(SYSCONFDIR)/ltg $(DESTDIR)$(SYSCONFDIR)/logrotate.d
	install -m 755 $(LTG) $(DESTDIR)$(PREFIX)/bin/ltg
	install -m 644 examples/ltg.example.json $(DESTDIR)$(PREFIX)/share/ltg/ltg.example.json
	sed 's#@BINDIR@#$(PREFIX)/bin#' examples/ltg.service > $(DESTDIR)$(PREFIX)/lib/systemd/system/ltg.service
	chmod 644 $(DESTDIR)$(PREFIX)/lib/systemd/system/ltg.service
	install -m 644 examples/ltg.logrotate $(DESTDIR)$(SYSCONFDIR)/logrotate.d/ltg
	[ -e $(DESTDIR)$(SYSCONFDIR)/ltg/ltg.json ] || install -m 644 examples/ltg.example.json $(DESTDIR)$(SYSCONFDIR)/ltg/ltg.json

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/ltg $(DESTDIR)$(PREFIX)/share/ltg/ltg.example.json \
	  $(DESTDIR)$(PREFIX)/lib/systemd/system/ltg.service $(DESTDIR)$(SYSCONFDIR)/logrotate.d/ltg
	-rmdir $(DESTDIR)$(PREFIX)/share/ltg 2>/dev/null

clean:
	rm -f ltg ltg-asan ltg-valgrind ltg-profile tests/unit tests/unit-asan tests/mock tests/ledger-gen $(FUZZ_TARGETS:%=tests/fuzz-%)

.PHONY: all deps test demo cluster-demo bench profile fuzz valgrind soak install install-files uninstall clean
