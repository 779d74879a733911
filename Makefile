# ticketd developer targets. `make help` lists them.
CARGO ?= cargo

.PHONY: help build run test lint doc bench vendor-check clean

help:
	@echo "build         release build of ticketd and ticket"
	@echo "run           start ticketd on 127.0.0.1:7470 (single mode)"
	@echo "test          the full test suite (cargo test)"
	@echo "lint          cargo fmt --check and clippy -D warnings"
	@echo "doc           cargo doc with warnings as errors"
	@echo "sim           cluster simulation over SEEDS seeds from FIRST (make sim SEEDS=500)"
	@echo "bench-cluster 3-node cluster vs one etcd node, lock cycles/s (CLIENTS=50)"
	@echo "clean         remove build output"

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

clean:
	$(CARGO) clean

# Cluster simulation over many seeds: `make sim SEEDS=500 FIRST=1`.
SEEDS ?= 100
FIRST ?= 1
.PHONY: sim
sim:
	SIM_SEEDS=$(SEEDS) SIM_FIRST=$(FIRST) $(CARGO) test --release --test cluster_sim many_seeds -- --nocapture

# Lock cycles/s of a 3-node cluster (fsync on) against one etcd node, same
# client count: `make bench-cluster CLIENTS=50 BENCH_SECONDS=10`.
CLIENTS ?= 50
BENCH_SECONDS ?= 10
.PHONY: bench-cluster
bench-cluster:
	$(CARGO) build --release --bin ticketd --example cluster_bench
	./target/release/examples/cluster_bench --clients $(CLIENTS) --seconds $(BENCH_SECONDS) --etcd
