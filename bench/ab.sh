#!/usr/bin/env bash
# Server CPU per request of two ticketd builds, in alternating rounds of
# the same run: cycle at depth 16 over 50 connections, uncontended keys.
#
#   bench/ab.sh BIN_A BIN_B [ROUNDS]      (ROUNDS defaults to 10)
#
# Each round starts A, measures it, stops it, then does the same for B
# (ticket-bench --server-pid reads the server's CPU time), so that noise
# from the rest of the machine falls on both alike. Prints each round's
# µs of server CPU per request and B/A, then the median of the rounds'
# own ratios and the ratio of the medians. Used to price a change: build
# the commit before it as A (a git worktree) and the change as B.
set -euo pipefail
cd "$(dirname "$0")/.."
A=${1:?usage: bench/ab.sh BIN_A BIN_B [ROUNDS]}
B=${2:?usage: bench/ab.sh BIN_A BIN_B [ROUNDS]}
ROUNDS=${3:-10}
SECONDS_PER_CELL=${AB_SECONDS:-5}
cargo build --release -q -p ticketd-bench --bin ticket-bench
BENCH=target/release/ticket-bench

cell() { # bin port -> µs of server CPU per request
    "$1" --listen "127.0.0.1:$2" --log-level warn >/dev/null 2>&1 &
    local pid=$!
    for _ in $(seq 1 200); do
        (echo >"/dev/tcp/127.0.0.1/$2") 2>/dev/null && break
        sleep 0.05
    done
    local j
    j=$("$BENCH" --json --quiet --server-pid "$pid" --server "127.0.0.1:$2" \
        --duration "$SECONDS_PER_CELL" --warmup 1 --connections 50 --mode cycle \
        --keys uncontended --depth 16)
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    printf '%s' "$j" | sed -n 's/.*"server_cpu_us_per_request":\([^,}]*\).*/\1/p'
}

results=()
for r in $(seq 1 "$ROUNDS"); do
    a=$(cell "$A" 18701)
    b=$(cell "$B" 18702)
    echo "round $r: A $a µs, B $b µs, B/A $(python3 -c "print(f'{$b/$a:.3f}')")"
    results+=("$a $b")
done
printf '%s\n' "${results[@]}" | python3 -c '
import statistics, sys
rows = [tuple(map(float, l.split())) for l in sys.stdin if l.strip()]
a = [x for x, _ in rows]; b = [y for _, y in rows]
print(f"median A {statistics.median(a):.3f} µs, median B {statistics.median(b):.3f} µs per request")
print(f"B/A: median of the rounds ratios {statistics.median([y / x for x, y in rows]):.3f}, "
      f"ratio of the medians {statistics.median(b) / statistics.median(a):.3f}")
'
