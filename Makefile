# The two commands of the quick start are `make run` and `make test`.
GO ?= go

.PHONY: run deps test build bench bench-scale fuzz vet clean soak

# The server on its embedded defaults with a demo fleet of simulated devices.
run:
	$(GO) run ./cmd/companion serve --demo

# What the tests need, when it is missing: Debian's mosquitto,
# mosquitto-clients, dbus, postgresql and curl with apt-get (as root or with
# sudo without a password; otherwise it stops, printing the command), and
# NATS Server into bin/ from the Go module proxy (scripts/deps).
deps:
	GO=$(GO) scripts/deps

# Every test, with the race detector, after deps.
test: deps
	$(GO) test -race -count=1 -timeout 9m ./...

build:
	mkdir -p bin
	$(GO) build -o bin/ ./cmd/...

# Benchmarks print figures; no test asserts speed. The package benchmarks
# first, then the command path against the bare forwarder it is built on
# (cmd/companion/benchpath_test.go), whose line of CONTRACT §12 ends the
# output. BENCH_SECONDS, BENCH_ROUNDS, BENCH_DEVICES, BENCH_E2E_CLIENTS,
# BENCH_ACCEPT_CLIENTS and BENCH_PROFILE_DIR tune it (docs/performance.md).
bench: deps
	$(GO) test -run '^$$' -bench . -benchmem -skip '^(BenchmarkCommandPath|BenchmarkStoreScale)$$' ./...
	$(GO) test -run '^$$' -bench '^BenchmarkCommandPath$$' -benchtime 1x -timeout 30m ./cmd/companion | tee bench.out
	@grep '^bench:' bench.out | tail -1

# Not part of bench, whose packages run side by side and would disturb its
# latencies: the store with 1,000,000 devices of 10,000 users read through
# the HTTP API (store/scale_test.go), about a minute and 2 GB in a temp dir;
# its last 'scale:' line is the one in docs/performance.md. SCALE_DEVICES,
# SCALE_CLIENTS and SCALE_CPUPROFILE tune it.
bench-scale:
	$(GO) test -run '^$$' -bench '^BenchmarkStoreScale$$' -benchtime 1x -timeout 30m ./store

# Not part of test: SOAK_MINUTES of mixed load against the real binaries and
# Mosquitto with random SIGKILLs of the server, the bridge and the broker; it
# fails if an accepted command is lost or a device executes one twice.
SOAK_MINUTES ?= 10
soak: deps
	SOAK_MINUTES=$(SOAK_MINUTES) $(GO) test -tags soak -run '^TestSoak$$' -count=1 -timeout 0 -v ./cmd/companion

vet:
	gofmt -l . | (! grep .)
	$(GO) vet ./...

clean:
	rm -rf bin data bench.out

# Each fuzz target for FUZZTIME (seed corpora run in `make test` already).
FUZZTIME ?= 30s
fuzz:
	@for pkg in $$($(GO) list ./...); do \
	  for t in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
	    echo "== $$pkg $$t"; \
	    $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
	  done; \
	done
