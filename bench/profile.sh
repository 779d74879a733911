#!/usr/bin/env bash
# Instructions per request of single-mode ticketd under `cycle`, by function.
#
#   bench/profile.sh [DEPTH]        (make profile; DEPTH defaults to 16)
#
# Builds ticketd with `--cfg ticketd_profile` (the engine's acquire and
# release, the outbox push and the loop's phases kept out of line, so the
# table tells them apart; nothing else differs) into target/profile, runs it
# under callgrind idle and then for PROFILE_REQUESTS (200,000) requests of
# `cycle` over 50 connections, and prints each function's own instructions
# (callees not included) of the loaded run less the idle one, divided by
# the requests answered. PLACES=semaphore:8 (or shared, exclusive) makes
# every acquire a protocol 1.2 Acquire With Limit of those places (the
# `--places` of ticket-bench). Set PROFILE_BIN to profile another build instead
# (the shipped one: target/release/ticketd, where those functions are
# inlined into `Server::turn`).
set -euo pipefail
cd "$(dirname "$0")/.."
DEPTH=${1:-16}
N=${PROFILE_REQUESTS:-200000}
PORT=${PROFILE_PORT:-18590}
OUT=${PROFILE_OUT:-target/bench}
mkdir -p "$OUT"
cargo build --release -q -p ticketd-bench --bin ticket-bench
BENCH=target/release/ticket-bench
BIN=${PROFILE_BIN:-}
if [[ -z $BIN ]]; then
    RUSTFLAGS="--cfg ticketd_profile" CARGO_TARGET_DIR=target/profile \
        cargo build --release -q -p ticketd --bin ticketd
    BIN=target/profile/release/ticketd
fi
for n in 0 "$N"; do
    valgrind --tool=callgrind --callgrind-out-file="$OUT/profile.$n.out" \
        "$BIN" --listen "127.0.0.1:$PORT" --log-level warn >"$OUT/profile.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do
        (echo >"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
        sleep 0.1
    done
    if ((n > 0)); then
        "$BENCH" --backend ticketd --server "127.0.0.1:$PORT" --mode cycle --depth "$DEPTH" \
            --connections 50 --requests "$n" ${PLACES:+--places "$PLACES"} --quiet --json >"$OUT/profile.json"
    else
        sleep 1
    fi
    kill -TERM "$pid"
    wait "$pid" || true
done
python3 - "$OUT/profile.0.out" "$OUT/profile.$N.out" "$OUT/profile.json" <<'PY'
import json, re, subprocess, sys

def own(path):
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--auto=no", "--threshold=100", path],
        capture_output=True, text=True, check=True).stdout
    by_fn = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)", line)
        if not m or "PROGRAM TOTALS" in line:
            continue
        name = re.sub(r"^(\?\?\?|[^ ]*\.(rs|c|S)):", "", m.group(2))
        name = re.sub(r" \[[^]]*\]$", "", name)
        by_fn[name] = by_fn.get(name, 0) + int(m.group(1).replace(",", ""))
    return by_fn

idle, loaded = own(sys.argv[1]), own(sys.argv[2])
answered = json.load(open(sys.argv[3]))["requests"]
rows = sorted(((v - idle.get(k, 0)) / answered, k) for k, v in loaded.items())
total = sum(v for v, _ in rows)
print(f"{answered} requests answered; {total:.1f} instructions per request, less an idle run")
for v, k in reversed(rows):
    if v >= 0.5:
        print(f"{v:8.1f}  {k[:140]}")
PY
