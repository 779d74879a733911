# ticketd developer targets. `make help` lists them.
CARGO ?= cargo

.PHONY: help build run test lint doc bench vendor-check clean

help:
	@echo "build         release build of ticketd and ticket"
	@echo "run           start ticketd on 127.0.0.1:7470 (single mode)"
	@echo "test          the full test suite (cargo test)"
	@echo "lint          cargo fmt --check and clippy -D warnings"
	@echo "doc           cargo doc with warnings as errors"
	@echo "bench         ticketd vs Redis vs the limit server vs etcd (BENCH_SECONDS=3 for a quick run)"
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

bench:
	bash bench/run.sh

clean:
	$(CARGO) clean
