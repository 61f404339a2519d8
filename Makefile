# ltg -- build, test, demo, bench.
#   make            the static, stripped gateway ./ltg
#   make test       ./test.sh: unit + integration tests, then again under ASan+UBSan
#   make bench      tests/bench.sh: ltg against nginx, same upstream, same run
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

# The unit tests include ltg.c without its main(), so the start-up helpers
# that only main() calls are unused there: hence -Wno-unused-function.
tests/unit: tests/unit.c ltg.c ltg.h | deps
	$(CC) -O1 -g $(WARN) -Wno-unused-function $(CFLAGS_EXTRA) -o $@ tests/unit.c $(BEARSSL) -lm

tests/unit-asan: tests/unit.c ltg.c ltg.h | deps
	$(CC) $(SAN) $(WARN) -Wno-unused-function $(CFLAGS_EXTRA) -o $@ tests/unit.c $(BEARSSL) -lm

tests/mock: tests/mock.c | deps
	$(CC) -O2 -std=c11 -Wall -Wextra $(CFLAGS_EXTRA) -pthread -o $@ tests/mock.c $(BEARSSL)

test: ltg ltg-asan tests/unit tests/unit-asan tests/mock
	./test.sh

demo: ltg tests/mock
	tests/demo.sh

bench: ltg tests/mock
	tests/bench.sh

clean:
	rm -f ltg ltg-asan tests/unit tests/unit-asan tests/mock

.PHONY: all deps test demo bench clean
