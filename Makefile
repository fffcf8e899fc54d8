# The two commands of the quick start are `make run` and `make test`.
GO ?= go

.PHONY: run deps test build bench bench-scale fuzz vet clean soak cluster cluster-down cluster-start dist

# The server on its embedded defaults with a demo fleet of simulated devices.
run:
	$(GO) run ./cmd/companion serve --demo

# What the tests need, when it is missing: Debian's mosquitto,
# mosquitto-clients, dbus, postgresql, curl and systemd (systemd-analyze)
# with apt-get (as root or with sudo without a password; otherwise it stops,
# printing the command), and
# NATS Server into bin/ from the Go module proxy (scripts/deps).
deps:
	GO=$(GO) scripts/deps

# Every test, with the race detector, after deps. cmd/companion's tests
# that mostly wait (for NATS clusters, replicas, processes, timeouts) run
# side by side (t.Parallel), eight at a time, and four packages at once
# (-p 4; many wait on engines more than they compute), cmd/companion and
# store/postgres, the longest, named first so that they start first (named
# after ./..., store/postgres started fifth-last and ended last, 30 s after
# cmd/companion, 2026-12-02). On a 2-core machine the
# whole took 7m49s from a fresh clone, cmd/companion 6.5 minutes of it
# (2026-11-30); on the slower 2-core machine of 2026-12-02 (its bare
# command path half as fast) cmd/companion alone took 6m54s with eight at
# a time, and with four at a time among the other packages passed the 10
# minutes of its timeout, a hang guard, now 20. Two packages at once took
# 10m07s. Four first found a hang of the server's shutdown
# (docs/reliability.md, bug 231, fixed).
test: deps
	$(GO) test -race -count=1 -p 4 -parallel 8 -timeout 20m ./cmd/companion ./store/postgres ./...

build:
	mkdir -p bin
	$(GO) build -o bin/ ./cmd/...

# Release packages for operators (README, "Packages"): both binaries for
# each of DIST_PLATFORMS, static (CGO_ENABLED=0), -trimpath, stamped with
# VERSION (their --version prints it), named COMMAND-OS-ARCH (linux/arm is
# GOARM=7, named armv7), the systemd units of packaging/systemd, and
# SHA256SUMS of it all, into DIST (the test builds into a temp dir).
DIST ?= dist
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo devel)
DIST_PLATFORMS ?= linux/amd64 linux/arm64 linux/arm
dist:
	mkdir -p $(DIST)/systemd
	rm -f $(DIST)/companion-* $(DIST)/SHA256SUMS
	@set -e; for p in $(DIST_PLATFORMS); do \
	  os=$${p%/*}; arch=$${p#*/}; name=$$arch; \
	  [ "$$arch" = arm ] && name=armv7; \
	  for c in companion companion-bridge; do \
	    echo "dist: $$c $$os/$$arch $(VERSION)"; \
	    CGO_ENABLED=0 GOOS=$$os GOARCH=$$arch GOARM=7 $(GO) build -trimpath \
	      -ldflags "-s -w -X main.version=$(VERSION)" \
	      -o $(DIST)/$$c-$$os-$$name ./cmd/$$c; \
	  done; \
	done
	cp packaging/systemd/*.service packaging/systemd/*.env $(DIST)/systemd/
	cd $(DIST) && sha256sum companion-* systemd/* > SHA256SUMS

# Benchmarks print figures; no test asserts speed. The package benchmarks
# first, then the command path against the bare forwarder it is built on
# (cmd/companion/benchpath_test.go), whose line of CONTRACT §12 ends the
# output. BENCH_SECONDS, BENCH_ROUNDS, BENCH_DEVICES, BENCH_E2E_CLIENTS,
# BENCH_ACCEPT_CLIENTS, BENCH_PROFILE_DIR and BENCH_BARE_SYNC tune it
# (docs/performance.md). Before it, a line compares both with the bare
# forwarder made durable: one fdatasync per group before its 202.
bench: deps
	$(GO) test -run '^$$' -bench . -benchmem -skip '^(BenchmarkCommandPath|BenchmarkStoreScale|BenchmarkReplicas)$$' ./...
	$(GO) test -run '^$$' -bench '^BenchmarkCommandPath$$' -benchtime 1x -timeout 30m ./cmd/companion | tee bench.out
	@grep -E '^(durable|bench):' bench.out | tail -2

# Not part of bench, whose packages run side by side and would disturb its
# latencies: the store with 1,000,000 devices of 10,000 users read through
# the HTTP API (store/scale_test.go), about a minute and 2 GB in a temp dir;
# its last 'scale:' line is the one in docs/performance.md. SCALE_DEVICES,
# SCALE_CLIENTS and SCALE_CPUPROFILE tune it.
bench-scale:
	$(GO) test -run '^$$' -bench '^BenchmarkStoreScale$$' -benchtime 1x -timeout 30m ./store

# Not part of bench: one replica against three on PostgreSQL and three NATS
# nodes (cmd/companion/benchreplicas_test.go), one 'replicas:' line per
# configuration with the CPU per command of each kind of process, which
# docs/scale-out.md sizes from. BENCH_SECONDS, BENCH_DEVICES,
# BENCH_E2E_CLIENTS, BENCH_ACCEPT_CLIENTS and BENCH_REPLICAS tune it.
.PHONY: bench-cluster
bench-cluster: deps
	$(GO) test -run '^$$' -bench '^BenchmarkReplicas$$' -benchtime 1x -timeout 30m ./cmd/companion | tee bench-cluster.out
	@grep '^replicas:' bench-cluster.out | tail -2

# Not part of test: SOAK_MINUTES of mixed load against the real binaries and
# Mosquitto with random SIGKILLs of the server, the bridge and the broker; it
# fails if an accepted command is lost or a device executes one twice.
# SOAK_LOG_DIR, when set, keeps every process's log there.
SOAK_MINUTES ?= 10
SOAK_LOG_DIR ?=
soak: deps
	PROC_LOG_DIR=$(SOAK_LOG_DIR) SOAK_MINUTES=$(SOAK_MINUTES) $(GO) test -tags soak -run '^TestSoak$$' -count=1 -timeout 0 -v ./cmd/companion

# The same soak on CONTRACT §11's cluster (cmd/companion/soak_cluster_test.go):
# PostgreSQL, three NATS nodes and three replicas, the load spread over the
# replicas, with random SIGKILLs of a replica, a NATS node or PostgreSQL.
# The replicas log at debug; so does the bridge. With SOAK_LOG_DIR the
# NATS consumers' unacknowledged counts are sampled there too
# (consumers.log).
.PHONY: soak-cluster
soak-cluster: deps
	PROC_LOG_DIR=$(SOAK_LOG_DIR) SOAK_MINUTES=$(SOAK_MINUTES) $(GO) test -tags soak -run '^TestSoakCluster$$' -count=1 -timeout 0 -v ./cmd/companion

# The cluster of CONTRACT §11 on one machine, to try (docs/scale-out.md,
# "Try the cluster"): three NATS nodes, PostgreSQL, three replicas and a
# bridge with simulated devices, detached, on free ports under cluster/,
# which holds cluster.json, the logs and the data (scripts/cluster). When
# one is up already it says so and starts nothing. cluster-down stops it.
cluster: deps build
	$(GO) run ./scripts/cluster -dir cluster -bin bin up

cluster-down:
	$(GO) run ./scripts/cluster -dir cluster down

# Starts again pieces of the running cluster that were killed or stopped:
# make cluster-start PIECE="replica-2 nats-1" (names as in cluster.json's pids).
cluster-start:
	@test -n "$(PIECE)" || { echo 'say which: make cluster-start PIECE="replica-2 nats-1" (the names of cluster/cluster.json pids)'; exit 2; }
	$(GO) run ./scripts/cluster -dir cluster start $(PIECE)

vet:
	gofmt -l . | (! grep .)
	$(GO) vet ./...

clean:
	rm -rf bin data bench.out dist

# Each fuzz target for FUZZTIME (seed corpora run in `make test` already).
FUZZTIME ?= 30s
fuzz:
	@for pkg in $$($(GO) list ./...); do \
	  for t in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
	    echo "== $$pkg $$t"; \
	    $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
	  done; \
	done
