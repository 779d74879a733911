#!/usr/bin/env bash
# How long `ticket cluster add` takes to catch up and promote a new node of
# a three-node cluster holding ADD_LOCKS locks, and the lock cycles/s the
# cluster keeps meanwhile, against its steady rate (release build, fsync
# on, loopback, one host).
#
#   bench/membership-add.sh            # 100,000 held locks
#   ADD_LOCKS=10000 bench/membership-add.sh
#
# Environment (all optional):
#   ADD_LOCKS=100000     locks held (lease 255 s) before the node is added
#   ADD_CLIENTS=50       lockers of the cycle load
#   ADD_STEADY_S=5       seconds of the steady-rate measurement
#   ADD_OUT=target/bench where the JSON results and node logs go
#   ADD_NO_BUILD=1       use the binaries already in target/release (and
#                        ADD_LOADGEN, default target/release/ticket-bench)
#
# Everything listens on loopback only and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

LOCKS=${ADD_LOCKS:-100000}
CLIENTS=${ADD_CLIENTS:-50}
STEADY=${ADD_STEADY_S:-5}
OUT=${ADD_OUT:-target/bench}
mkdir -p "$OUT"
if [ -z "${ADD_NO_BUILD:-}" ]; then
  cargo build --release --bin ticketd --bin ticket -p ticketd --features cluster >&2
  cargo build --release -p ticketd-bench --bin ticket-bench >&2
fi
BIN=target/release
LOADGEN=${ADD_LOADGEN:-$BIN/ticket-bench}
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

PEERS3="1=127.0.0.1:17601,2=127.0.0.1:17602,3=127.0.0.1:17603"
PEERS4="$PEERS3,4=127.0.0.1:17604"
start() { # id extra...
  local id=$1; shift
  "$BIN/ticketd" --cluster --id "$id" --data-dir "$WORK/n$id" \
    --listen "127.0.0.1:1761$id" --admin-listen "127.0.0.1:1762$id" \
    --max-keys $((LOCKS + 100000)) "$@" >"$OUT/member-add-node$id.log" 2>&1 &
  PIDS+=($!)
}
for i in 1 2 3; do start "$i" --peers "$PEERS3"; done
start 4 --join --peers "$PEERS4"
SERVERS="127.0.0.1:17611,127.0.0.1:17612,127.0.0.1:17613"
ADMINS=(--admin 127.0.0.1:17621 --admin 127.0.0.1:17622 --admin 127.0.0.1:17623)
ready() { # a leader that serves: one acquire through node 1 is granted
  "$BIN/ticket" cluster status --admin 127.0.0.1:17621 2>/dev/null |
    grep -Eq '^[0-9]+ +[0-9.:]+ +leader'
}
for _ in $(seq 150); do ready && break; sleep 0.2; done
sleep 1

echo "holding $LOCKS locks..." >&2
"$LOADGEN" --server "$SERVERS" --mode acquire --requests "$LOCKS" \
  --lease 255 --connections 50 --depth 16 --quiet --json >"$OUT/member-add-fill.json"
HELD=$(grep -o '"grants":[0-9]*' "$OUT/member-add-fill.json" | head -1 | cut -d: -f2)
if [ "$HELD" != "$LOCKS" ]; then
  echo "only $HELD of $LOCKS locks granted (see $OUT/member-add-fill.json)" >&2
  exit 1
fi
echo "steady cycle rate ($STEADY s)..." >&2
"$LOADGEN" --server "$SERVERS" --mode cycle --connections "$CLIENTS" \
  --duration "$STEADY" --quiet --json >"$OUT/member-add-steady.json"

echo "adding node 4 under the same load..." >&2
# The load runs in 2-s windows (one JSON line each, with its start and end
# time) until the add is over; the windows that overlap it are averaged.
touch "$WORK/run"
(
  while [ -f "$WORK/run" ]; do
    s0=$(date +%s.%N)
    r=$("$LOADGEN" --server "$SERVERS" --mode cycle --connections "$CLIENTS" \
      --duration 2 --quiet --json | grep -o '"grants_per_s":[0-9]*' | cut -d: -f2)
    echo "$s0 $(date +%s.%N) $r"
  done
) >"$OUT/member-add-windows.txt" &
LOAD=$!
PIDS+=($LOAD)
sleep 3
T0=$(date +%s.%N)
"$BIN/ticket" cluster add 4=127.0.0.1:17604 --catch-up-timeout 300 "${ADMINS[@]}" \
  2>"$OUT/member-add-cli.txt"
T1=$(date +%s.%N)
rm -f "$WORK/run"
wait "$LOAD" 2>/dev/null || true
ADD_S=$(echo "$T1 - $T0" | bc)
STEADY_RATE=$(grep -o '"grants_per_s":[0-9]*' "$OUT/member-add-steady.json" | cut -d: -f2)
DURING_RATE=$(awk -v t0="$T0" -v t1="$T1" '$2 > t0 && $1 < t1 { s += $3; n++ }
  END { if (n) printf "%d", s / n; else print "" }' "$OUT/member-add-windows.txt")
echo "locks held:            $LOCKS"
echo "ticket cluster add:    ${ADD_S} s (catch-up and promote)"
sed 's/^/    /' "$OUT/member-add-cli.txt"
echo "cycles/s steady:       $STEADY_RATE"
echo "cycles/s during add:   ${DURING_RATE:-none} (mean of the 2-s windows overlapping the add)"
if [ -n "${DURING_RATE:-}" ] && [ -n "$STEADY_RATE" ] && [ "$STEADY_RATE" -gt 0 ]; then
  echo "ratio:                 $(echo "scale=2; $DURING_RATE / $STEADY_RATE" | bc)"
fi
