#!/usr/bin/env bash
# Instructions per committed request of one cluster node, counted by
# callgrind (docs/CLUSTER.md, "Instructions per request").
#
#   bench/cluster-callgrind.sh leader|follower [CONNECTIONS] [REQUESTS] [DEPTH] [OUT]
#
# Starts a 3-node cluster (release build, fsync on, plaintext peers unless
# PEER_TLS=1) on loopback with node 1 under callgrind. As the leader it
# ticks every 100 ms and the others every 1000 ms, so it is elected first;
# as a follower it ticks every 10 s and never campaigns. The counters are
# zeroed once the cluster grants, then `ticket-bench --mode cycle` runs
# REQUESTS requests (acquire or release, each committed) over CONNECTIONS
# lockers spread over the three nodes, and the counters are dumped to
# OUT (default callgrind.out.ROLE). The request count is printed from the
# generator's JSON report, with the command that reads OUT.
set -euo pipefail
# Build first: cargo build --release --bin ticketd --bin ticket --bin ticket-bench
role=${1:?leader or follower}
conns=${2:-50}
reqs=${3:-20000}
depth=${4:-1}
out=${5:-callgrind.out.$role}
bin=${CB_BIN:-target/release/ticketd}
ticket=${CB_TICKET:-target/release/ticket}
gen=${CB_GEN:-target/release/ticket-bench}
tmp=$(mktemp -d)
# No part of an earlier profile may pass for this one's.
rm -f "$out" "$out".[0-9]*
. "$(dirname "$0")/warm-up.sh"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
peers="1=127.0.0.1:$(port),2=127.0.0.1:$(port),3=127.0.0.1:$(port)"
case $role in
  leader) t1=100 t2=1000 ;;
  follower) t1=10000 t2=100 ;;
  *) echo "role: leader or follower" >&2; exit 2 ;;
esac
tls=()
if [ "${PEER_TLS:-0}" = 1 ]; then
  "$ticket" certs init "$tmp/certs" --cluster-name ticketd --nodes 3 >/dev/null
fi
addrs=()
for i in 1 2 3; do
  cport=$(port)
  addrs+=("127.0.0.1:$cport")
  tick=$t2; [ "$i" = 1 ] && tick=$t1
  args=(--cluster --id "$i" --peers "$peers" --data-dir "$tmp/n$i" --tick-ms "$tick"
        --listen "127.0.0.1:$cport" --log-level "${CB_LOG_LEVEL:-warn}")
  if [ "${PEER_TLS:-0}" = 1 ]; then
    args+=(--peer-tls-cert "$tmp/certs/node$i.pem" --peer-tls-key "$tmp/certs/node$i-key.pem"
           --peer-tls-ca "$tmp/certs/ca.pem")
  fi
  if [ "$i" = 1 ]; then
    valgrind --tool=callgrind --callgrind-out-file="$out" --dump-instr=no \
      "$bin" "${args[@]}" 2>"$tmp/vg.log" &
  else
    "$bin" "${args[@]}" 2>"$tmp/n$i.log" &
  fi
  pids+=($!)
done
vgpid=${pids[0]}
servers=$(IFS=,; echo "${addrs[*]}")
# Warm up until every request is granted through every node (the cluster
# has a leader and node 1 applies what it is sent).
warm_up "the cluster"
callgrind_control -z "$vgpid" >/dev/null
"$gen" --server "$servers" --connections "$conns" --depth "$depth" --mode cycle \
  --requests "$reqs" --quiet --json >"$tmp/report.json"
callgrind_control -d "$vgpid" >/dev/null
# A dump on request is written to OUT.1; OUT itself is written when the node
# exits, with what ran after the dump (its shutdown). The dump is the
# profile: wait for it, stop the cluster, and keep it as OUT.
for _ in $(seq 100); do [ -s "$out.1" ] && break; sleep 0.1; done
grep -oE '"(requests|busy|not_granted|not_released)":[0-9]+' "$tmp/report.json"
if [ -n "${CB_LOGS:-}" ]; then tail -n 20 "$tmp"/*.log; fi
grep -o '"elapsed_s":[0-9.]*' "$tmp/report.json"
requests=$(grep -oE '"requests":[0-9]+' "$tmp/report.json" | cut -d: -f2)
cleanup
trap - EXIT
[ -s "$out.1" ] || { echo "callgrind wrote no dump at $out.1" >&2; exit 1; }
mv -f "$out.1" "$out"
echo "profile: $out (bench/callgrind-buckets.py $out $requests)"
