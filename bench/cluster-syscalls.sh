#!/usr/bin/env bash
# System calls per committed request of each node of a 3-node cluster, or
# of the cluster limit's three processes, counted by `perf stat` on the
# kernel's syscall tracepoints (docs/CLUSTER.md, "System calls per request").
#
#   bench/cluster-syscalls.sh cluster|limit|limit-spread [CONNECTIONS] [REQUESTS] [DEPTH]
#
# cluster: a 3-node release cluster on loopback (fsync on, plaintext
# peers); node 1 ticks every 100 ms and the others every 1000 ms, so node 1
# is elected first and leads. The lockers are spread over the three nodes,
# as in `make bench-cluster`. limit: `cluster-limit-server`, every locker on
# its leader, as in `make bench-cluster`; limit-spread: the same with the
# lockers spread over its three processes (the followers forward). Once the
# service grants, `perf
# stat` attaches to every process (all its threads), `ticket-bench --mode
# cycle` runs exactly REQUESTS requests (each an acquire or a release, each
# one committed entry), and each process's counts are divided by REQUESTS.
# Tracing with tracepoints adds a few percent; unlike strace, it does not
# stop the process at each call, so batches keep their size. Each
# process's user and system CPU per request (from /proc, 10 ms ticks: run
# enough requests) close the table.
set -euo pipefail
# Build first: cargo build --release --bin ticketd --bin ticket-bench --bin cluster-limit-server
what=${1:?cluster, limit or limit-spread}
conns=${2:-50}
reqs=${3:-20000}
depth=${4:-1}
bin=${CB_BIN:-target/release/ticketd}
limit=${CB_LIMIT:-target/release/cluster-limit-server}
gen=${CB_GEN:-target/release/ticket-bench}
command -v perf >/dev/null || { echo "needs perf (linux-perf)" >&2; exit 2; }
tmp=$(mktemp -d)
. "$(dirname "$0")/warm-up.sh"
pids=()
perfs=()
cleanup() {
  for p in "${perfs[@]}" "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
names=()
case $what in
  cluster)
    peers="1=127.0.0.1:$(port),2=127.0.0.1:$(port),3=127.0.0.1:$(port)"
    addrs=()
    for i in 1 2 3; do
      cport=$(port)
      addrs+=("127.0.0.1:$cport")
      tick=1000; [ "$i" = 1 ] && tick=100
      "$bin" --cluster --id "$i" --peers "$peers" --data-dir "$tmp/n$i" --tick-ms "$tick" \
        --listen "127.0.0.1:$cport" --log-level warn 2>"$tmp/n$i.log" &
      pids+=($!)
    done
    names=(leader follower-2 follower-3)
    servers=$(IFS=,; echo "${addrs[*]}")
    ;;
  limit|limit-spread)
    f1=$(port) f2=$(port) l=$(port) c1=$(port) c2=$(port)
    s1=() s2=()
    [ "$what" = limit-spread ] && s1=("127.0.0.1:$c1") s2=("127.0.0.1:$c2")
    "$limit" follower "127.0.0.1:$f1" "$tmp/f1.log" "${s1[@]}" >/dev/null 2>"$tmp/f1.err" & pids+=($!)
    "$limit" follower "127.0.0.1:$f2" "$tmp/f2.log" "${s2[@]}" >/dev/null 2>"$tmp/f2.err" & pids+=($!)
    sleep 1
    "$limit" leader "127.0.0.1:$l" "$tmp/l.log" "127.0.0.1:$f1,127.0.0.1:$f2" \
      >/dev/null 2>"$tmp/l.err" & pids+=($!)
    names=(follower-1 follower-2 leader)
    servers="127.0.0.1:$l"
    [ "$what" = limit-spread ] && servers="127.0.0.1:$l,127.0.0.1:$c1,127.0.0.1:$c2"
    ;;
  *) echo "cluster, limit or limit-spread" >&2; exit 2 ;;
esac
warm_up "the service"
calls=(sendto sendmsg write writev pwrite64 recvfrom read readv epoll_wait epoll_pwait
       epoll_ctl fdatasync fsync futex accept4)
events=(-e raw_syscalls:sys_enter -e context-switches)
for c in "${calls[@]}"; do events+=(-e "syscalls:sys_enter_$c"); done
for k in 0 1 2; do
  perf stat -x, "${events[@]}" -p "${pids[$k]}" -o "$tmp/perf.$k" &
  perfs+=($!)
done
sleep 1
# User and system CPU of each process (all threads), in clock ticks.
cpu() { for k in 0 1 2; do awk '{print $14, $15}' "/proc/${pids[$k]}/stat"; done; }
cpu >"$tmp/cpu.before"
"$gen" --server "$servers" --connections "$conns" --depth "$depth" --mode cycle \
  --requests "$reqs" --quiet --json >"$tmp/report.json"
cpu >"$tmp/cpu.after"
for p in "${perfs[@]}"; do kill -INT "$p" 2>/dev/null || true; done
for p in "${perfs[@]}"; do wait "$p" 2>/dev/null || true; done
perfs=()
grep -oE '"(requests|busy|not_granted|not_released|elapsed_s)":[0-9.]+' "$tmp/report.json" | tr '\n' ' '
echo
getconf CLK_TCK >"$tmp/hz"
python3 - "$tmp" "${names[@]}" <<'PY'
import json, sys
tmp = sys.argv[1]; names = sys.argv[2:]
reqs = json.load(open(f"{tmp}/report.json"))["requests"]
rows = {}
for k, name in enumerate(names):
    for line in open(f"{tmp}/perf.{k}"):
        f = line.strip().split(",")
        if len(f) < 3 or not f[0].replace(".", "").isdigit():
            continue
        ev = f[2].split(":")[-1].replace("sys_enter_", "")
        ev = {"sys_enter": "all system calls", "context-switches": "context switches"}.get(ev, ev)
        rows.setdefault(ev, {})[name] = float(f[0]) / reqs
hz = int(open(f"{tmp}/hz").read())
before = [list(map(int, l.split())) for l in open(f"{tmp}/cpu.before")]
after = [list(map(int, l.split())) for l in open(f"{tmp}/cpu.after")]
for k, name in enumerate(names):
    for col, what in ((0, "user CPU µs"), (1, "system CPU µs")):
        rows.setdefault(what, {})[name] = (after[k][col] - before[k][col]) * 1e6 / hz / reqs
first = ["all system calls", "context switches"]
order = first + [e for e in rows if e not in first and "CPU" not in e] + ["user CPU µs", "system CPU µs"]
print("| per request | " + " | ".join(names) + " |")
print("|---|" + "---:|" * len(names))
for ev in order:
    vals = [rows[ev].get(n, 0.0) for n in names]
    if ev not in first and max(vals) < 0.0005:
        continue
    fmt = "{:.1f}" if "CPU" in ev else "{:.3f}"
    print(f"| {ev} | " + " | ".join(fmt.format(v) for v in vals) + " |")
PY
