# ticketd developer targets. `make help` lists them.
CARGO ?= cargo

.PHONY: help build run test lint doc bench profile vendor-check cross-check cross-sizes example example-test clean python-test typescript-test

help:
	@echo "build         release build of ticketd and ticket"
	@echo "run           start ticketd on 127.0.0.1:7470 (single mode)"
	@echo "test          the full test suite (cargo test)"
	@echo "lint          cargo fmt --check and clippy -D warnings"
	@echo "doc           cargo doc with warnings as errors"
	@echo "bench         ticketd vs Redis vs the limit server vs etcd (BENCH_SECONDS=3 for a quick run)"
	@echo "profile       callgrind of cycle at depth 16 (DEPTH=64, PLACES=semaphore:8), instructions per request by function"
	@echo "vendor-check  cargo vendor, then build offline from it (with and without default features)"
	@echo "cross-check   aarch64 and armv7 builds from vendored sources, tests under qemu (Debian toolchain)"
	@echo "cross-sizes   stripped release binary sizes per target and feature set"
	@echo "example       run examples/step_server (a server stepped turn by turn)"
	@echo "example-test  run examples/deterministic_test (the in-memory harness, no sockets)"
	@echo "sim           cluster simulation over SEEDS seeds from FIRST (make sim SEEDS=500; PERMITS=1)"
	@echo "bench-cluster 3-node cluster vs one etcd node and single mode, lock cycles/s (CLIENTS=50)"
	@echo "sim-single    single-mode simulation over SEEDS fresh seeds (FIRST= to choose); part of sim"
	@echo "clean         remove build output"
	@echo "python-test   the Python client (clients/python): ruff, mypy --strict, pytest against target/debug/ticketd"
	@echo "typescript-test the TypeScript client (clients/typescript): tsc --strict, node --test against target/debug/ticketd"
	@echo "fuzz          run every cargo-fuzz target for FUZZ_SECONDS each (default 60)"
	@echo "faults        the real-process fault tests (kill, stop, clock jumps, fds, abuse, disk full, cluster partitions)"
	@echo "engine-memory bytes per held key, per waiter and per permit holder, hot-path allocations (release)"

build:
	$(CARGO) build --release -p ticketd

run:
	$(CARGO) run --release -p ticketd --bin ticketd

test:
	$(CARGO) test --all-features

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets --all-features -- -D warnings
	$(CARGO) clippy --all-targets --no-default-features -- -D warnings
	$(CARGO) clippy -p ticketd --lib --no-default-features --features client -- -D warnings

doc:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --all-features

bench:
	bash bench/run.sh

DEPTH ?= 16
profile:
	bash bench/profile.sh $(DEPTH)

vendor-check:
	./.ci/vendor-check

# ARM builds with Debian's toolchain (installed when missing; never rustup),
# offline from vendored sources, tests under qemu-user: .ci/cross-check.
cross-check:
	./.ci/cross-check

cross-sizes:
	./.ci/cross-check --sizes x86_64-unknown-linux-gnu aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf

# The Python client's checks in a venv (clients/python/.venv), against the
# debug server and the Rust `ticket` command built here.
python-test:
	$(CARGO) build --all-features --bin ticketd --bin ticket
	TICKETD_BIN=$(CURDIR)/target/debug/ticketd clients/python/check.sh

# The TypeScript client's checks (npm ci, tsc, node --test, a bench smoke
# run), against the debug server built here.
typescript-test:
	$(CARGO) build --all-features --bin ticketd --bin ticket
	TICKETD_BIN=$(CURDIR)/target/debug/ticketd clients/typescript/check.sh

example:
	$(CARGO) run --example step_server

example-test:
	$(CARGO) run --example deterministic_test --features harness

clean:
	$(CARGO) clean

# Fuzzing (docs/RELIABILITY.md). Needs `cargo install cargo-fuzz`. With a
# nightly toolchain the targets build with AddressSanitizer; on stable they
# build without a sanitizer (`-s none`).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= decode_request decode_reply engine_ops engine_permits peer_decode wal_recovery
FUZZ_NIGHTLY := $(shell rustup toolchain list 2>/dev/null | grep -q '^nightly' && echo yes)
FUZZ_CARGO := $(if $(FUZZ_NIGHTLY),$(CARGO) +nightly fuzz,$(CARGO) fuzz)
FUZZ_FLAGS := $(if $(FUZZ_NIGHTLY),,-s none)

.PHONY: fuzz
fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
	  echo "== fuzz $$t for $(FUZZ_SECONDS) s"; \
	  mkdir -p fuzz/corpus/$$t; \
	  $(FUZZ_CARGO) run $(FUZZ_FLAGS) $$t fuzz/corpus/$$t fuzz/regressions/$$t \
	    -- -max_total_time=$(FUZZ_SECONDS) \
	    -print_final_stats=1 > fuzz/last-$$t.log 2>&1 \
	    || { tail -n 40 fuzz/last-$$t.log; echo "fuzz $$t FAILED: see fuzz/artifacts/$$t"; exit 1; }; \
	  grep -E '^(Done|stat::number_of_executed_units)' fuzz/last-$$t.log; \
	done

.PHONY: engine-memory
engine-memory:
	$(CARGO) run --release --example engine_memory
# Cluster simulation over many seeds: `make sim SEEDS=500 FIRST=1`. Half
# of the seeds make two of the four keys a semaphore and a read/write
# lock; PERMITS=1 makes every seed do it, PERMITS=0 none.
SEEDS ?= 100
FIRST ?= 1
PERMITS ?=
.PHONY: sim
sim: sim-single
	SIM_SEEDS=$(SEEDS) SIM_FIRST=$(FIRST) $(if $(PERMITS),SIM_PERMITS=$(PERMITS)) $(CARGO) test --release --test cluster sim::many_seeds -- --nocapture

# Lock cycles/s of a 3-node cluster (fsync on) against one etcd node (driven
# through its JSON gateway and through its own gRPC client, bench/etcd-native,
# which needs protoc: apt-get install protobuf-compiler) and one single-mode
# ticketd (the ceiling), same client count, rounds interleaved:
# `make bench-cluster CLIENTS=50 BENCH_SECONDS=10 BENCH_ROUNDS=3`.
CLIENTS ?= 50
BENCH_SECONDS ?= 10
BENCH_ROUNDS ?= 3
.PHONY: bench-cluster
bench-cluster:
	$(CARGO) build --release --bin ticketd --bin cluster-bench --bin cluster-limit-server
	$(CARGO) build --release --manifest-path bench/etcd-native/Cargo.toml
	./target/release/cluster-bench --clients $(CLIENTS) --seconds $(BENCH_SECONDS) \
	  --rounds $(BENCH_ROUNDS) --etcd --etcd-native bench/etcd-native/target/release/etcd-native-bench
# Single-mode simulation over SEEDS seeds: from FIRST when given on the
# command line, else from a seed taken from the clock (printed).
.PHONY: sim-single
sim-single:
	SIM_SEEDS=$(SEEDS) $(if $(filter command line,$(origin FIRST)),SIM_FIRST=$(FIRST)) \
	  $(CARGO) test --release --test engine sim_single::every_seed -- --nocapture

# Real-process fault tests (docs/RELIABILITY.md); part of `make test` too.
.PHONY: faults
faults:
	$(CARGO) test --test faults -- --nocapture
