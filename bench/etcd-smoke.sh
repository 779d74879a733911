#!/usr/bin/env bash
# Both ways the cluster benchmark drives etcd, checked against a real etcd
# node: ticketd's load generator through etcd's JSON gateway, and etcd's own
# gRPC client (bench/etcd-native). Each must complete lock cycles with every
# lock released. Needs etcd (apt-get install etcd-server) and protoc (apt-get
# install protobuf-compiler); run from the repository root. CI runs it.
set -euo pipefail

TMP=$(mktemp -d)
EPID=
cleanup() {
    # Under `set -e` a failing command here would replace the exit status.
    if [[ -n $EPID ]]; then
        kill "$EPID" 2>/dev/null || true
        wait "$EPID" 2>/dev/null || true
    fi
    rm -rf "$TMP"
}
trap cleanup EXIT

cargo build --release --quiet -p ticketd-bench --bin ticket-bench
cargo build --release --quiet --manifest-path bench/etcd-native/Cargo.toml

# Ports below the ephemeral range, so no outgoing connection holds them.
CPORT=$((21000 + $$ % 500 * 2))
PPORT=$((CPORT + 1))
etcd --name smoke --data-dir "$TMP/etcd" \
    --listen-client-urls "http://127.0.0.1:$CPORT" \
    --advertise-client-urls "http://127.0.0.1:$CPORT" \
    --listen-peer-urls "http://127.0.0.1:$PPORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$PPORT" \
    --initial-cluster "smoke=http://127.0.0.1:$PPORT" \
    --log-level error >"$TMP/etcd.log" 2>&1 &
EPID=$!
for _ in $(seq 200); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$CPORT") 2>/dev/null; then break; fi
    sleep 0.05
done

fail() { echo "etcd smoke: $*" >&2; cat "$TMP/etcd.log" >&2; exit 1; }
field() { grep -o "\"$1\":[0-9.]*" <<<"$2" | head -1 | cut -d: -f2 || true; }

# The JSON gateway, through ticketd's load generator.
gw=$(target/release/ticket-bench --backend etcd --server "127.0.0.1:$CPORT" \
    --connections 4 --requests 400 --quiet --json) || fail "gateway run failed"
grants=$(field grants "$gw")
released=$(field released "$gw")
[[ ${grants:-0} -ge 200 ]] || fail "gateway: only ${grants:-no} grants: $gw"
[[ $grants == "$released" ]] || fail "gateway: $grants grants, $released released: $gw"

# etcd's own gRPC client.
native=$(bench/etcd-native/target/release/etcd-native-bench --server "127.0.0.1:$CPORT" \
    --lockers 4 --seconds 2 --warmup 0 --server-pid "$EPID") || fail "native run failed"
cycles=$(field cycles "$native")
[[ ${cycles:-0} -gt 0 ]] || fail "native: no lock cycle: $native"
[[ -n $(field server_cpu_us_per_request "$native") ]] || fail "native: no server CPU: $native"
# Counted before its leases are revoked (which would delete them).
[[ $(field keys_left "$native") == 0 ]] || fail "native: lock keys left behind: $native"

# The gateway's leases live on (600 s), so a lock it did not release would
# still be there: etcd must hold no key at all.
left=$(bench/etcd-native/target/release/etcd-native-bench --server "127.0.0.1:$CPORT" --count-keys) ||
    fail "could not count keys"
[[ $left == 0 ]] || fail "gateway: $left lock keys left in etcd"

echo "etcd smoke: gateway $grants grants, all released; native $cycles cycles; no lock key left"
