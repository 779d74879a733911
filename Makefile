# ticketd developer targets. `make help` lists them.
CARGO ?= cargo

.PHONY: help build run test lint doc bench vendor-check example clean

help:
	@echo "build         release build of ticketd and ticket"
	@echo "run           start ticketd on 127.0.0.1:7470 (single mode)"
	@echo "test          the full test suite (cargo test)"
	@echo "lint          cargo fmt --check and clippy -D warnings"
	@echo "doc           cargo doc with warnings as errors"
	@echo "bench         ticketd vs Redis vs the limit server vs etcd (BENCH_SECONDS=3 for a quick run)"
	@echo "vendor-check  cargo vendor, then build offline from it (with and without default features)"
	@echo "example       run examples/step_server (a server stepped turn by turn)"
	@echo "sim           cluster simulation over SEEDS seeds from FIRST (make sim SEEDS=500)"
	@echo "clean         remove build output"
	@echo "engine-memory bytes per held key and per waiter, hot-path allocations (release)"

build:
	$(CARGO) build --release

run:
	$(CARGO) run --release --bin ticketd

test:
	$(CARGO) test --all-features

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets --all-features -- -D warnings
	$(CARGO) clippy --all-targets --no-default-features -- -D warnings

doc:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --all-features

bench:
	bash bench/run.sh

vendor-check:
	./.ci/vendor-check

example:
	$(CARGO) run --example step_server

clean:
	$(CARGO) clean

.PHONY: engine-memory
engine-memory:
	$(CARGO) run --release --example engine_memory
# Cluster simulation over many seeds: `make sim SEEDS=500 FIRST=1`.
SEEDS ?= 100
FIRST ?= 1
.PHONY: sim
sim:
	SIM_SEEDS=$(SEEDS) SIM_FIRST=$(FIRST) $(CARGO) test --release --test cluster_sim many_seeds -- --nocapture
