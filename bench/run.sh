#!/usr/bin/env bash
# `make bench`: ticketd side by side with Redis locks, the protocol's limit
# server and etcd, on this machine, in one run. Prints one table with ratios.
#
# Environment (all optional):
#   BENCH_SECONDS=10       measured seconds per throughput cell (3 for a quick try)
#   BENCH_WARMUP=2         warm-up seconds per cell
#   BENCH_ROUNDS=3         rounds of the whole matrix; each cell reports its median
#   BENCH_LOCKS=1000000    held locks for the bytes-per-lock measurement
#   BENCH_IDLE_STARTS=5    fresh starts whose median is ticketd's idle RSS
#   BENCH_CG_REQUESTS=200000  requests per callgrind run (0 skips callgrind)
#   BENCH_OUT=target/bench    where raw JSON results and callgrind files go
#   BENCH_SKIP_MINIMAL=1   skip the --no-default-features size build
#   BENCH_SKIP_CLUSTER=1   skip the 3-node cluster vs etcd part
#   BENCH_CLUSTER_CLIENTS=50  lockers in the cluster part
#   BENCH_KEEPALIVE_LOCKS=100000   kept-alive locks (--mode extend, 30 s lease)
#   BENCH_KEEPALIVE_SECONDS=25     measured seconds of that run (several renewals)
#
# Everything it starts listens on loopback only and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

SECS=${BENCH_SECONDS:-10}
WARM=${BENCH_WARMUP:-2}
ROUNDS=${BENCH_ROUNDS:-3}
LOCKS=${BENCH_LOCKS:-1000000}
IDLE_STARTS=${BENCH_IDLE_STARTS:-5}
[[ $IDLE_STARTS =~ ^[1-9][0-9]*$ ]] || { echo "BENCH_IDLE_STARTS must be a whole number of at least 1, not '$IDLE_STARTS'" >&2; exit 2; }
CG_REQUESTS=${BENCH_CG_REQUESTS:-200000}
OUT=${BENCH_OUT:-target/bench}
TICKETD_PORT=17470
LIMIT_PORT=17480
REDIS_PORT=17379
ETCD_CLIENT_PORT=17390
ETCD_PEER_PORT=17391
CG_PORT=17490
KEEPALIVE_PORT=17471
ADMIN_TICKETD_PORT=17472
ADMIN_PORT=17473
TLS_TICKETD_PORT=17474
TLS_REDIS_PORT=17380
KEEPALIVE_LOCKS=${BENCH_KEEPALIVE_LOCKS:-100000}
KEEPALIVE_SECS=${BENCH_KEEPALIVE_SECONDS:-25}

mkdir -p "$OUT"
# Rounds of an earlier run must not join this run's medians.
rm -f "$OUT"/*.r[0-9]*.json
TMP=$(mktemp -d /tmp/ticketd-bench.XXXXXX)
PIDS=()

cleanup() {
    local p
    for p in "${PIDS[@]}"; do
        kill -TERM "$p" 2>/dev/null || true
    done
    for p in "${PIDS[@]}"; do
        wait "$p" 2>/dev/null || true
    done
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log() { printf '== %s\n' "$*" >&2; }

# ---------------------------------------------------------------- setup
need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v openssl >/dev/null || need_apt+=(openssl)
command -v etcd >/dev/null || need_apt+=(etcd-server)
command -v valgrind >/dev/null || need_apt+=(valgrind)
# protoc builds etcd's gRPC client (bench/etcd-native) for the cluster part.
[[ -n ${BENCH_SKIP_CLUSTER:-} ]] || command -v protoc >/dev/null || need_apt+=(protobuf-compiler)
if ((${#need_apt[@]})); then
    log "installing ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

log "building release binaries"
cargo build --release --quiet --bin ticketd --bin ticket-bench --bin limit-server --bin cluster-bench --bin cluster-limit-server
TICKETD=target/release/ticketd
BENCH=target/release/ticket-bench
LIMIT=target/release/limit-server

# wait_port PORT SECONDS: until something accepts on 127.0.0.1:PORT.
wait_port() {
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    echo "nothing listens on port $1 after $2 s" >&2
    return 1
}

# wait_sock PATH SECONDS: until a Unix socket exists at PATH.
wait_sock() {
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        [[ -S $1 ]] && return 0
        sleep 0.1
    done
    echo "no Unix socket at $1 after $2 s" >&2
    return 1
}

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }

# median_of EVEN_FORMAT: the median of the numbers on stdin, one per line
# ("-", a missing figure, is skipped; "-" if nothing is left): the middle
# one as given, or the mean of the middle two printed with EVEN_FORMAT.
median_of() {
    sort -g | awk -v fmt="$1" '$1 != "-" { a[++n] = $1 }
        END { if (n == 0) { print "-"; exit }
              if (n % 2) print a[(n + 1) / 2]; else printf fmt "\n", (a[n / 2] + a[n / 2 + 1]) / 2 }'
}

# stop PID: SIGTERM, wait for it, forget it.
stop() {
    kill -TERM "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    local keep=() p
    for p in "${PIDS[@]}"; do
        [[ $p == "$1" ]] || keep+=("$p")
    done
    PIDS=("${keep[@]}")
}

start_ticketd() {
    "$TICKETD" --listen "127.0.0.1:$TICKETD_PORT" --log-level warn "$@" &
    PID=$!
    PIDS+=("$PID")
    wait_port "$TICKETD_PORT" 10
}

# A second ticketd for the keep-alive run: its 100,000 locks outlive the run
# by a lease, and must not sit in the server the other cells measure.
start_keepalive_ticketd() {
    "$TICKETD" --listen "127.0.0.1:$KEEPALIVE_PORT" --log-level warn &
    PID=$!
    PIDS+=("$PID")
    wait_port "$KEEPALIVE_PORT" 10
}

# A second ticketd with its admin port on, scraped (GET /metrics) ten times
# a second for as long as it runs, to show what the admin port costs a
# cycle.
start_admin_ticketd() {
    "$TICKETD" --listen "127.0.0.1:$ADMIN_TICKETD_PORT" --admin-listen "127.0.0.1:$ADMIN_PORT" \
        --log-level warn &
    PID=$!
    PIDS+=("$PID")
    wait_port "$ADMIN_TICKETD_PORT" 10
    wait_port "$ADMIN_PORT" 10
    (
        while :; do
            if exec 3<>"/dev/tcp/127.0.0.1/$ADMIN_PORT"; then
                printf 'GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n' >&3
                cat <&3 >/dev/null
                exec 3>&-
            fi
            sleep 0.1
        done
    ) 2>/dev/null &
    SCRAPER=$!
    PIDS+=("$SCRAPER")
}

start_redis() {
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
        --daemonize no --loglevel warning --dir "$TMP" "$@" >"$TMP/redis.log" 2>&1 &
    PID=$!
    PIDS+=("$PID")
    wait_port "$REDIS_PORT" 10
}

# TLS rows: one CA and a server certificate for 127.0.0.1 (openssl), the
# same files for ticketd (--tls-cert) and Redis (--tls-port).
make_certs() {
    local d="$TMP/tls"
    mkdir -p "$d"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
        -subj /CN=bench-ca -keyout "$d/ca-key.pem" -out "$d/ca.pem" 2>/dev/null
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=bench \
        -keyout "$d/server-key.pem" -out "$d/server.csr" 2>/dev/null
    printf 'basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1\n' >"$d/server.ext"
    openssl x509 -req -in "$d/server.csr" -CA "$d/ca.pem" -CAkey "$d/ca-key.pem" \
        -CAcreateserial -days 2 -extfile "$d/server.ext" -out "$d/server.pem" 2>/dev/null
}

start_tls_ticketd() {
    "$TICKETD" --listen "127.0.0.1:$TLS_TICKETD_PORT" --log-level warn \
        --tls-cert "$TMP/tls/server.pem" --tls-key "$TMP/tls/server-key.pem" &
    PID=$!
    PIDS+=("$PID")
    wait_port "$TLS_TICKETD_PORT" 10
}

start_tls_redis() {
    redis-server --port 0 --tls-port "$TLS_REDIS_PORT" --bind 127.0.0.1 --save '' \
        --appendonly no --daemonize no --loglevel warning --dir "$TMP" \
        --tls-cert-file "$TMP/tls/server.pem" --tls-key-file "$TMP/tls/server-key.pem" \
        --tls-ca-cert-file "$TMP/tls/ca.pem" --tls-auth-clients no >"$TMP/redis-tls.log" 2>&1 &
    PID=$!
    PIDS+=("$PID")
    wait_port "$TLS_REDIS_PORT" 10
}

start_limit() {
    "$LIMIT" "127.0.0.1:$LIMIT_PORT" >/dev/null &
    PID=$!
    PIDS+=("$PID")
    wait_port "$LIMIT_PORT" 10
}

start_etcd() {
    rm -rf "$TMP/etcd"
    etcd --name bench --data-dir "$TMP/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
        --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "bench=http://127.0.0.1:$ETCD_PEER_PORT" \
        --log-level error >"$TMP/etcd.log" 2>&1 &
    PID=$!
    PIDS+=("$PID")
    wait_port "$ETCD_CLIENT_PORT" 20
}

# jget JSON FIELD: a number or string field of the bench tool's flat JSON.
jget() { printf '%s' "$1" | sed -n "s/.*\"$2\":\"\{0,1\}\([^,\"}]*\).*/\1/p"; }

# ratio A B [DIGITS]
ratio() { awk -v a="$1" -v b="$2" -v d="${3:-2}" 'BEGIN { if (a == "" || a == "-" || b == "" || b == "-" || b + 0 == 0) print "-"; else printf "%.*f", d, a / b }'; }

# bench NAME ROUND PID ARGS...: one run of a cell, kept in $OUT/NAME.rROUND.json.
bench() {
    local name=$1 round=$2 pid=$3 j
    shift 3
    "$BENCH" --json --quiet --server-pid "$pid" "$@" >"$OUT/$name.r$round.json"
    j=$(cat "$OUT/$name.r$round.json")
    printf '   %-22s round %s: %10s req/s  p99 %9s us  wait p99 %9s us  server %6s us/req\n' \
        "$name" "$round" "$(jget "$j" requests_per_s)" "$(jget "$j" p99_us)" \
        "$(jget "$j" wait_p99_us)" "$(jget "$j" server_cpu_us_per_request)" >&2
}

# bench_extend NAME ROUND PID ARGS...: like bench, for the extend modes. A
# run with any X (not extended) exits 1 and stops make bench.
bench_extend() {
    local name=$1 round=$2 pid=$3 j
    shift 3
    "$BENCH" --json --quiet --server-pid "$pid" "$@" >"$OUT/$name.r$round.json"
    j=$(cat "$OUT/$name.r$round.json")
    printf '   %-22s round %s: %10s extends/s  X %s  p99 %9s us  server %6s us/extend  %6s %% of a core\n' \
        "$name" "$round" "$(jget "$j" extends_per_s)" "$(jget "$j" not_extended)" "$(jget "$j" p99_us)" \
        "$(jget "$j" server_cpu_us_per_extend)" "$(jget "$j" server_cpu_core_pct)" >&2
}

# median NAME FIELD: $OUT/NAME.json becomes the round with the median FIELD.
# Rounds of all cells are interleaved, so a burst of load from elsewhere on a
# shared machine hits one round of every cell, not every round of one cell.
median() {
    local f picked
    picked=$(for f in "$OUT/$1".r*.json; do
        printf '%s %s\n' "$(jget "$(cat "$f")" "$2")" "$f"
    done | sort -g | awk '{ a[NR] = $2 } END { print a[int((NR + 1) / 2)] }')
    cp "$picked" "$OUT/$1.json"
}

# ---------------------------------------------------------------- footprint
log "footprint: idle RSS and bytes per held lock ($LOCKS locks, 24-byte keys)"
# ticketd's idle RSS moves by tens of KiB from one start to the next: most
# of it is clean file pages the kernel maps around each page fault (64 KiB
# fault-around windows), and where ASLR puts the startup code decides how
# many windows it touches (docs/BENCHMARKS.md). The figure is the median of
# IDLE_STARTS fresh starts, each read one second after it listens.
IDLE_SAMPLES=()
for ((i = 0; i < IDLE_STARTS; i++)); do
    start_ticketd
    sleep 1
    IDLE_SAMPLES+=("$(rss_kib "$PID")")
    stop "$PID"
done
T_IDLE=$(printf '%s\n' "${IDLE_SAMPLES[@]}" | median_of "%.0f")
log "ticketd idle RSS KiB over $IDLE_STARTS starts: ${IDLE_SAMPLES[*]} (median $T_IDLE)"
# Bytes per held lock: one process, its own idle RSS against the same
# process holding the locks. The locks come from one identity (one
# connection from 127.0.0.1), so its key quota is raised to the table's
# default size; the default memory budget (256 MiB) holds a million
# 24-byte keys.
start_ticketd --max-keys-per-identity 1000000
sleep 1
T_BASE=$(rss_kib "$PID")
"$BENCH" --server "127.0.0.1:$TICKETD_PORT" --mode acquire --lease 255 \
    --depth 64 --requests "$LOCKS" --quiet --json >"$OUT/mem-ticketd.json"
T_HELD=$(rss_kib "$PID")
T_LOCKS=$(jget "$(cat "$OUT/mem-ticketd.json")" grants)
stop "$PID"

start_redis
sleep 1
R_IDLE=$(rss_kib "$PID")
"$BENCH" --backend redis --server "127.0.0.1:$REDIS_PORT" --mode acquire --lease 255 \
    --depth 64 --requests "$LOCKS" --quiet --json >"$OUT/mem-redis.json"
R_HELD=$(rss_kib "$PID")
R_LOCKS=$(jget "$(cat "$OUT/mem-redis.json")" grants)
stop "$PID"

start_etcd
sleep 3
E_IDLE=$(rss_kib "$PID")
stop "$PID"

T_BPL=$(awk -v a="$T_BASE" -v b="$T_HELD" -v n="$T_LOCKS" 'BEGIN { printf "%.0f", (b - a) * 1024 / n }')
R_BPL=$(awk -v a="$R_IDLE" -v b="$R_HELD" -v n="$R_LOCKS" 'BEGIN { printf "%.0f", (b - a) * 1024 / n }')

strip_size() {
    cp "$1" "$TMP/stripped"
    strip "$TMP/stripped"
    stat -c %s "$TMP/stripped"
}
SIZE_DEFAULT=$(strip_size "$TICKETD")
SIZE_MINIMAL=-
if [[ -z ${BENCH_SKIP_MINIMAL:-} ]]; then
    log "building ticketd without default features (target/bench-minimal)"
    cargo build --release --quiet --no-default-features --features server --bin ticketd --target-dir target/bench-minimal
    SIZE_MINIMAL=$(strip_size target/bench-minimal/release/ticketd)
fi

# ---------------------------------------------------------------- throughput
# The same ticketd and Redis also listen on a Unix socket, for the Unix
# rows beside the loopback TCP ones.
start_ticketd --listen "unix:$TMP/t.sock"
TPID=$PID
wait_sock "$TMP/t.sock" 10
start_redis --unixsocket "$TMP/r.sock"
RPID=$PID
wait_sock "$TMP/r.sock" 10
start_limit
LPID=$PID
start_etcd
EPID=$PID
start_admin_ticketd
APID=$PID
make_certs
start_tls_ticketd
TTPID=$PID
start_tls_redis
TRPID=$PID

common=(--duration "$SECS" --warmup "$WARM" --connections 50 --mode cycle --keys uncontended)
contended=(--duration "$SECS" --warmup "$WARM" --connections 100 --mode contended --keys hot:10 --wait 5)
for ((round = 1; round <= ROUNDS; round++)); do
    log "throughput round $round of $ROUNDS (${SECS} s + ${WARM} s warm-up per cell)"
    for d in 1 16 64; do
        bench "cycle-d$d-ticketd" "$round" "$TPID" --server "127.0.0.1:$TICKETD_PORT" "${common[@]}" --depth "$d"
        bench "cycle-d$d-limit" "$round" "$LPID" --server "127.0.0.1:$LIMIT_PORT" "${common[@]}" --depth "$d"
        bench "cycle-d$d-redis" "$round" "$RPID" --backend redis --server "127.0.0.1:$REDIS_PORT" "${common[@]}" --depth "$d"
        bench "cycle-d$d-ticketd-unix" "$round" "$TPID" --server "unix:$TMP/t.sock" "${common[@]}" --depth "$d"
        bench "cycle-d$d-redis-unix" "$round" "$RPID" --backend redis --server "unix:$TMP/r.sock" "${common[@]}" --depth "$d"
    done
    # Protocol 1.2 at depth 16: a semaphore's place (N = 8) and a read/write
    # lock's shared hold, each a cycle of an acquire with places and its
    # release, beside the mutex cycle to compare their server CPU.
    bench cycle-d16-semaphore8 "$round" "$TPID" --server "127.0.0.1:$TICKETD_PORT" "${common[@]}" \
        --depth 16 --places semaphore:8
    bench cycle-d16-shared "$round" "$TPID" --server "127.0.0.1:$TICKETD_PORT" "${common[@]}" \
        --depth 16 --places shared
    # TLS (1.3, the same certificate for both): cycle at depth 1, 16 and 64.
    for d in 1 16 64; do
        bench "cycle-d$d-ticketd-tls" "$round" "$TTPID" --server "127.0.0.1:$TLS_TICKETD_PORT" \
            --tls-ca "$TMP/tls/ca.pem" "${common[@]}" --depth "$d"
        bench "cycle-d$d-redis-tls" "$round" "$TRPID" --backend redis --server "127.0.0.1:$TLS_REDIS_PORT" \
            --tls-ca "$TMP/tls/ca.pem" "${common[@]}" --depth "$d"
    done
    bench cycle-d64-ticketd-admin "$round" "$APID" --server "127.0.0.1:$ADMIN_TICKETD_PORT" "${common[@]}" --depth 64
    # Extend flood beside cycle: the same connections and depth, one lock per
    # slot extended back to back, to compare an extend's server CPU with a
    # cycle's (an acquire and a release).
    bench_extend "extend-flood-d16" "$round" "$TPID" --server "127.0.0.1:$TICKETD_PORT" \
        --duration "$SECS" --warmup "$WARM" --connections 50 --depth 16 --mode extend-flood --lease 30
    # Kept-alive locks at a 30 s lease, each extended every 10 s, on a fresh
    # server; the warm-up covers the acquires.
    start_keepalive_ticketd
    KPID=$PID
    bench_extend keepalive "$round" "$KPID" --server "127.0.0.1:$KEEPALIVE_PORT" \
        --duration "$KEEPALIVE_SECS" --warmup "$WARM" --connections 50 --mode extend \
        --locks "$KEEPALIVE_LOCKS" --lease 30
    stop "$KPID"
    # The same locks renewed one round trip each (--renew single), as a
    # client with a renewal thread per lock does: what coalescing saves.
    start_keepalive_ticketd
    KPID=$PID
    bench_extend keepalive-single "$round" "$KPID" --server "127.0.0.1:$KEEPALIVE_PORT" \
        --duration "$KEEPALIVE_SECS" --warmup "$WARM" --connections 50 --mode extend \
        --locks "$KEEPALIVE_LOCKS" --lease 30 --renew single
    stop "$KPID"
    # The FIFO check makes the tool exit 1 on a violation; the table reports it.
    bench contended-ticketd "$round" "$TPID" --server "127.0.0.1:$TICKETD_PORT" "${contended[@]}" || true
    # Redis clients poll: every 10 ms (generous), and every 100 ms (redis-py's default).
    bench contended-redis "$round" "$RPID" --backend redis --server "127.0.0.1:$REDIS_PORT" "${contended[@]}"
    bench contended-redis-poll100 "$round" "$RPID" --backend redis --server "127.0.0.1:$REDIS_PORT" \
        "${contended[@]}" --poll-ms 100
    # etcd: one locker (and lease) per connection, lock requests block. A
    # fresh etcd for each cell: etcd 3.4's gateway does not cancel the lock
    # requests of clients that went away, and after one contended cell
    # (90 waiters dropped at its end) a second one never gets a grant.
    stop "$EPID"
    start_etcd
    EPID=$PID
    bench cycle-d1-etcd "$round" "$EPID" --backend etcd --server "127.0.0.1:$ETCD_CLIENT_PORT" "${common[@]}" --depth 1
    stop "$EPID"
    start_etcd
    EPID=$PID
    bench contended-etcd "$round" "$EPID" --backend etcd --server "127.0.0.1:$ETCD_CLIENT_PORT" "${contended[@]}"
done
for d in 1 16 64; do
    for s in ticketd limit redis ticketd-unix redis-unix; do median "cycle-d$d-$s" requests_per_s; done
done
median cycle-d1-etcd requests_per_s
median cycle-d64-ticketd-admin requests_per_s
for d in 1 16 64; do
    for s in ticketd-tls redis-tls; do median "cycle-d$d-$s" requests_per_s; done
done
median extend-flood-d16 server_cpu_us_per_extend
median cycle-d16-semaphore8 server_cpu_us_per_request
median cycle-d16-shared server_cpu_us_per_request
median keepalive server_cpu_core_pct
median keepalive-single server_cpu_core_pct
for s in ticketd redis redis-poll100 etcd; do median "contended-$s" wait_p99_us; done
stop "$TPID"
stop "$RPID"
stop "$TTPID"
stop "$TRPID"
stop "$LPID"
stop "$EPID"
stop "$SCRAPER"
stop "$APID"

# ---------------------------------------------------------------- callgrind
# cg VAR NAME PORT MODE CMD...: sets VAR to the instructions per request of
# a server under callgrind, MODE cycle or extend-flood (with CG_PLACES set,
# every acquire asks for those places, protocol 1.2). A run with no load is subtracted, so start-up and
# idle cost do not count. (No command substitution: the servers it starts
# must stay in this shell's PIDS so the exit trap can stop them.)
cg() {
    local var=$1 name=$2 port=$3 mode=$4 n
    shift 4
    local ir=()
    for n in 0 "$CG_REQUESTS"; do
        valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.$name.$n.out" \
            "$@" >"$TMP/cg.log" 2>&1 &
        local pid=$!
        PIDS+=("$pid")
        wait_port "$port" 60
        if ((n > 0)); then
            local backend=ticketd
            [[ $name == redis ]] && backend=redis
            "$BENCH" --backend "$backend" --server "127.0.0.1:$port" --mode "$mode" --depth 16 \
                --connections 50 --requests "$n" ${CG_PLACES:+--places "$CG_PLACES"} \
                --quiet --json >"$OUT/cg-$name.json"
        fi
        stop "$pid"
        ir+=("$(awk '/^(summary|totals):/ {print $2; exit}' "$OUT/callgrind.$name.$n.out")")
    done
    local answered
    answered=$(jget "$(cat "$OUT/cg-$name.json")" requests)
    printf -v "$var" '%s' "$(awk -v a="${ir[0]}" -v b="${ir[1]}" -v n="$answered" 'BEGIN { printf "%.0f", (b - a) / n }')"
}
IR_T=- IR_L=- IR_R=- IR_X=- IR_S=- IR_SH=-
if ((CG_REQUESTS > 0)); then
    log "callgrind: $CG_REQUESTS requests, cycle and extend-flood, depth 16, 50 connections"
    cg IR_T ticketd "$CG_PORT" cycle "$TICKETD" --listen "127.0.0.1:$CG_PORT" --log-level warn
    # 800 acquires (one lock per slot) are among the extend run's requests.
    cg IR_X ticketd-extend "$CG_PORT" extend-flood "$TICKETD" --listen "127.0.0.1:$CG_PORT" --log-level warn
    CG_PLACES=semaphore:8 cg IR_S ticketd-semaphore8 "$CG_PORT" cycle "$TICKETD" --listen "127.0.0.1:$CG_PORT" --log-level warn
    CG_PLACES=shared cg IR_SH ticketd-shared "$CG_PORT" cycle "$TICKETD" --listen "127.0.0.1:$CG_PORT" --log-level warn
    cg IR_L limit "$CG_PORT" cycle "$LIMIT" "127.0.0.1:$CG_PORT"
    cg IR_R redis "$CG_PORT" cycle redis-server --port "$CG_PORT" --bind 127.0.0.1 --save '' \
        --appendonly no --daemonize no --loglevel warning --dir "$TMP"
fi

# ---------------------------------------------------------------- table
# Every round of every throughput cell, and ticketd's ratio to a peer round
# by round (the same minutes).
# rounds NAME FIELD: the field of each round of a cell, space-separated.
rounds() {
    local r out=()
    for ((r = 1; r <= ROUNDS; r++)); do
        out+=("$(jget "$(cat "$OUT/$1.r$r.json")" "$2")")
    done
    echo "${out[*]}"
}
# round_ratios A B FIELD [B_FIELD]: A's field over B's (or B's B_FIELD),
# round by round.
round_ratios() {
    local r out=()
    for ((r = 1; r <= ROUNDS; r++)); do
        out+=("$(ratio "$(jget "$(cat "$OUT/$1.r$r.json")" "$3")" "$(jget "$(cat "$OUT/$2.r$r.json")" "${4:-$3}")")")
    done
    echo "${out[*]}"
}
# median_ratio A B FIELD [B_FIELD]: the median of A's field over B's, round by round.
# Each round runs every cell within the same minutes, so a ratio is judged
# on the rounds' own ratios, never on two medians taken from different rounds.
median_ratio() {
    # shellcheck disable=SC2046 # one word per round
    printf '%s\n' $(round_ratios "$@") | median_of "%.2f"
}

J() { cat "$OUT/$1.json"; }
rps() { jget "$(J "$1")" requests_per_s; }
cpu() { jget "$(J "$1")" server_cpu_us_per_request; }

row() { printf '%-38s %10s %10s %10s %10s %8s %8s  %s\n' "$@"; }
echo
echo "ticketd benchmark: $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ), ${SECS} s per cell, median of $ROUNDS rounds"
row "workload (50 connections)" ticketd redis limit etcd "t/redis" "t/limit" "target"
row "---" --- --- --- --- --- --- ---
for d in 1 16 64; do
    t=$(rps "cycle-d$d-ticketd") r=$(rps "cycle-d$d-redis") l=$(rps "cycle-d$d-limit")
    case $d in 1) tgt="t/redis >= 1.1, t/limit >= 0.95" ;; 16) tgt="t/redis >= 3, t/limit >= 0.9" ;; 64) tgt="t/redis >= 6, t/limit >= 0.9" ;; esac
    e=""
    [[ $d == 1 ]] && e=$(rps cycle-d1-etcd)
    row "cycle depth $d, requests/s" "$t" "$r" "$l" "$e" "$(median_ratio "cycle-d$d-ticketd" "cycle-d$d-redis" requests_per_s)" \
        "$(median_ratio "cycle-d$d-ticketd" "cycle-d$d-limit" requests_per_s)" "$tgt"
done
t=$(rps cycle-d64-ticketd-admin) b=$(rps cycle-d64-ticketd)
row "cycle depth 64, admin port scraped 10/s" "$t" "" "" "" "" "" "admin/plain $(median_ratio cycle-d64-ticketd-admin cycle-d64-ticketd requests_per_s) (target: within noise of 1)"
for d in 1 16 64; do
    t=$(rps "cycle-d$d-ticketd-tls") r=$(rps "cycle-d$d-redis-tls") b=$(rps "cycle-d$d-ticketd")
    tp=$(median_ratio "cycle-d$d-ticketd-tls" "cycle-d$d-ticketd" requests_per_s)
    tgt="TLS/plaintext $tp"
    [[ $d == 16 ]] && tgt="t/redis >= 3; TLS/plaintext $tp (target >= 0.6)"
    row "cycle depth $d over TLS, requests/s" "$t" "$r" "" "" "$(median_ratio "cycle-d$d-ticketd-tls" "cycle-d$d-redis-tls" requests_per_s)" "" "$tgt"
done
for d in 1 16 64; do
    t=$(rps "cycle-d$d-ticketd-unix") r=$(rps "cycle-d$d-redis-unix")
    bt=$(rps "cycle-d$d-ticketd") br=$(rps "cycle-d$d-redis")
    row "cycle depth $d, Unix socket, req/s" "$t" "$r" "" "" "$(median_ratio "cycle-d$d-ticketd-unix" "cycle-d$d-redis-unix" requests_per_s)" "" \
        "unix/TCP: ticketd $(median_ratio "cycle-d$d-ticketd-unix" "cycle-d$d-ticketd" requests_per_s), redis $(median_ratio "cycle-d$d-redis-unix" "cycle-d$d-redis" requests_per_s)"
done
t=$(cpu cycle-d16-ticketd) r=$(cpu cycle-d16-redis) l=$(cpu cycle-d16-limit)
row "cycle depth 16, server CPU us/req" "$t" "$r" "$l" "" "$(median_ratio cycle-d16-ticketd cycle-d16-redis server_cpu_us_per_request)" \
    "$(median_ratio cycle-d16-ticketd cycle-d16-limit server_cpu_us_per_request)" "t/limit <= 2"
row "semaphore (N = 8) cycle d16, server CPU us/req" "$(cpu cycle-d16-semaphore8)" "" "" "" "" "" \
    "semaphore/mutex $(median_ratio cycle-d16-semaphore8 cycle-d16-ticketd server_cpu_us_per_request) (target <= 1.2)"
row "shared-lock cycle d16, server CPU us/req" "$(cpu cycle-d16-shared)" "" "" "" "" "" \
    "shared/mutex $(median_ratio cycle-d16-shared cycle-d16-ticketd server_cpu_us_per_request) (target <= 1.2)"
row "instructions/request, depth 16" "$IR_T" "$IR_R" "$IR_L" "" "$(ratio "$IR_T" "$IR_R")" "$(ratio "$IR_T" "$IR_L")" "ticketd <= 500"
row "  the same, semaphore (N = 8) cycle" "$IR_S" "" "" "" "" "" "semaphore/mutex $(ratio "$IR_S" "$IR_T")"
row "  the same, shared-lock cycle" "$IR_SH" "" "" "" "" "" "shared/mutex $(ratio "$IR_SH" "$IR_T")"
ct=$(J contended-ticketd) cr=$(J contended-redis) ce=$(J contended-etcd)
cr100=$(J contended-redis-poll100)
for f in wait_p99_us wait_p50_us grants_per_s; do
    t=$(jget "$ct" $f) r=$(jget "$cr" $f) r100=$(jget "$cr100" $f) e=$(jget "$ce" $f)
    case $f in
    wait_p99_us) label="contended 100 on 10 keys: p99 wait us" tgt="t/redis <= 0.2" ;;
    wait_p50_us) label="contended: p50 wait us" tgt="" ;;
    *) label="contended: grants/s" tgt="" ;;
    esac
    row "$label" "$t" "$r" "" "$e" "$(ratio "$t" "$r")" "" "$tgt (redis polling every 100 ms: $r100)"
done
fifo="$(jget "$ct" fifo_violations) of $(jget "$ct" fifo_checked) grants out of order"
row "contended: FIFO check (ticketd)" "" "" "" "" "" "" "$fifo (must be 0)"
row "bytes per held lock ($T_LOCKS / $R_LOCKS)" "$T_BPL" "$R_BPL" "" "" "$(ratio "$T_BPL" "$R_BPL")" "" "t/redis <= 0.7"
row "idle RSS KiB" "$T_IDLE" "$R_IDLE" "" "$E_IDLE" "$(ratio "$T_IDLE" "$R_IDLE")" "" "ticketd <= 3072"
# Renewal: a cycle is an acquire and a release, so its per-request figure
# is their mean; an extend must cost no more than that release.
xf=$(J extend-flood-d16) ka=$(J keepalive) ks=$(J keepalive-single)
t=$(cpu cycle-d16-ticketd) x=$(jget "$xf" server_cpu_us_per_extend)
row "extend flood d16, extends/s" "$(jget "$xf" extends_per_s)" "" "" "" "" "" "cycle d16: $(rps cycle-d16-ticketd) req/s"
row "server CPU us per extend vs per cycle request" "$x" "" "" "" "" "" "per cycle request (acquire+release)/2: $t, extend/that $(median_ratio extend-flood-d16 cycle-d16-ticketd server_cpu_us_per_extend server_cpu_us_per_request) (target <= 1)"
row "instructions per extend vs per cycle request" "$IR_X" "" "" "" "" "" "per cycle request: $IR_T, extend/that $(ratio "$IR_X" "$IR_T")"
row "$KEEPALIVE_LOCKS kept-alive locks, 30 s lease: % of one core" "$(jget "$ka" server_cpu_core_pct)" "" "" "" "" "" "$(jget "$ka" extends_per_s) extends/s, $(jget "$ka" server_cpu_us_per_extend) us each, coalesced as the client renews (target < 2 %)"
row "  the same, one round trip per extend" "$(jget "$ks" server_cpu_core_pct)" "" "" "" "" "" "$(jget "$ks" extends_per_s) extends/s, $(jget "$ks" server_cpu_us_per_extend) us each (--renew single)"
row "extend runs: X (not extended)" "$(jget "$xf" not_extended) + $(jget "$ka" not_extended) + $(jget "$ks" not_extended)" "" "" "" "" "" "must be 0"
row "stripped binary bytes" "$SIZE_DEFAULT" "" "" "" "" "" "without default features: $SIZE_MINIMAL"

# ---------------------------------------------------------------- rounds
# Every round of every throughput cell, in round order.
echo
echo "rounds, in order (the table shows each cell's median round):"
for d in 1 16 64; do
    for s in ticketd limit redis; do
        printf '  %-30s %s\n' "cycle d$d $s req/s:" "$(rounds "cycle-d$d-$s" requests_per_s)"
    done
    printf '  %-30s %s\n' "cycle d$d t/limit:" "$(round_ratios "cycle-d$d-ticketd" "cycle-d$d-limit" requests_per_s)"
    printf '  %-30s %s\n' "cycle d$d t/redis:" "$(round_ratios "cycle-d$d-ticketd" "cycle-d$d-redis" requests_per_s)"
done
for d in 1 16 64; do
    for s in ticketd-tls redis-tls; do
        printf '  %-30s %s\n' "cycle d$d $s req/s:" "$(rounds "cycle-d$d-$s" requests_per_s)"
    done
    printf '  %-30s %s\n' "cycle d$d TLS t/redis:" "$(round_ratios "cycle-d$d-ticketd-tls" "cycle-d$d-redis-tls" requests_per_s)"
    printf '  %-30s %s\n' "cycle d$d TLS/plaintext:" "$(round_ratios "cycle-d$d-ticketd-tls" "cycle-d$d-ticketd" requests_per_s)"
done
for d in 1 16 64; do
    for s in ticketd-unix redis-unix; do
        printf '  %-30s %s\n' "cycle d$d $s req/s:" "$(rounds "cycle-d$d-$s" requests_per_s)"
    done
    printf '  %-30s %s\n' "cycle d$d t unix/TCP:" "$(round_ratios "cycle-d$d-ticketd-unix" "cycle-d$d-ticketd" requests_per_s)"
done
printf '  %-30s %s\n' "cycle d16 ticketd CPU us:" "$(rounds cycle-d16-ticketd server_cpu_us_per_request)"
printf '  %-30s %s\n' "cycle d16 limit CPU us:" "$(rounds cycle-d16-limit server_cpu_us_per_request)"
printf '  %-30s %s\n' "semaphore8/mutex CPU:" "$(round_ratios cycle-d16-semaphore8 cycle-d16-ticketd server_cpu_us_per_request)"
printf '  %-30s %s\n' "shared/mutex CPU:" "$(round_ratios cycle-d16-shared cycle-d16-ticketd server_cpu_us_per_request)"
printf '  %-30s %s\n' "contended t p99 wait us:" "$(rounds contended-ticketd wait_p99_us)"
printf '  %-30s %s\n' "contended redis p99 us:" "$(rounds contended-redis wait_p99_us)"

# ---------------------------------------------------------------- targets
# check LABEL VALUE OP LIMIT [DETAIL]: one line, held or missed (OP is >=,
# <=, < or ==); "not measured" when the value is missing.
check() {
    local verdict
    verdict=$(awk -v v="$2" -v op="$3" -v l="$4" 'BEGIN {
        if (v == "" || v == "-") { print "not measured"; exit }
        ok = (op == ">=" && v + 0 >= l + 0) || (op == "<=" && v + 0 <= l + 0) ||
             (op == "<" && v + 0 < l + 0) || (op == "==" && v + 0 == l + 0)
        print (ok ? "held" : "MISSED") }')
    printf '  %-7s %-44s %s %s %s%s\n' "$verdict" "$1" "$2" "$3" "$4" "${5:+  ($5)}"
}
# check_rounds LABEL OP LIMIT A B FIELD [B_FIELD]: the target on the median
# of A's field over B's round by round, and in how many rounds it held.
check_rounds() {
    local label=$1 op=$2 lim=$3 med
    shift 3
    med=$(median_ratio "$@")
    # shellcheck disable=SC2046 # one word per round
    set -- $(round_ratios "$@")
    local held
    held=$(printf '%s\n' "$@" | awk -v op="$op" -v l="$lim" '
        $1 != "-" { n++; if ((op == ">=" && $1 + 0 >= l + 0) || (op == "<=" && $1 + 0 <= l + 0)) h++ }
        END { printf "%d of %d rounds", h, n }')
    check "$label" "$med" "$op" "$lim" "$held: $*"
}
echo
x_total=$(awk -v a="$(jget "$xf" not_extended)" -v b="$(jget "$ka" not_extended)" 'BEGIN { if (a == "" || b == "") print "-"; else print a + b }')
echo "targets (ratios: the median of the rounds' own ratios; other figures: the median round):"
for d in 1 16 64; do
    case $d in 1) want_l=0.95 want_r=1.1 ;; 16) want_l=0.9 want_r=3 ;; *) want_l=0.9 want_r=6 ;; esac
    check_rounds "cycle depth $d, ticketd / limit" ">=" "$want_l" "cycle-d$d-ticketd" "cycle-d$d-limit" requests_per_s
    check_rounds "cycle depth $d, ticketd / redis" ">=" "$want_r" "cycle-d$d-ticketd" "cycle-d$d-redis" requests_per_s
done
check_rounds "cycle depth 16 TLS, ticketd / redis" ">=" 3 cycle-d16-ticketd-tls cycle-d16-redis-tls requests_per_s
check_rounds "cycle depth 16, ticketd TLS / plaintext" ">=" 0.6 cycle-d16-ticketd-tls cycle-d16-ticketd requests_per_s
check_rounds "cycle depth 16, server CPU ticketd / limit" "<=" 2 cycle-d16-ticketd cycle-d16-limit server_cpu_us_per_request
check "instructions per request, depth 16" "$IR_T" "<=" 500 "limit server: $IR_L"
check_rounds "semaphore (N = 8) / mutex cycle, server CPU" "<=" 1.2 cycle-d16-semaphore8 cycle-d16-ticketd server_cpu_us_per_request
check_rounds "shared-lock / mutex cycle, server CPU" "<=" 1.2 cycle-d16-shared cycle-d16-ticketd server_cpu_us_per_request
check "contended p99 wait, ticketd / redis" "$(ratio "$(jget "$ct" wait_p99_us)" "$(jget "$cr" wait_p99_us)")" "<=" 0.2
check "contended FIFO violations" "$(jget "$ct" fifo_violations)" "==" 0 "of $(jget "$ct" fifo_checked) grants"
check "bytes per held lock, ticketd / redis" "$(ratio "$T_BPL" "$R_BPL")" "<=" 0.7 "$T_BPL and $R_BPL bytes"
check "idle RSS KiB" "$T_IDLE" "<=" 3072
check_rounds "server CPU per extend / per cycle request" "<=" 1 extend-flood-d16 cycle-d16-ticketd server_cpu_us_per_extend server_cpu_us_per_request
check "kept-alive locks, % of one core" "$(jget "$ka" server_cpu_core_pct)" "<" 2
check "extend runs: X (not extended)" "$x_total" "==" 0
echo "raw results: $OUT/*.json"

# ---------------------------------------------------------------- cluster
# A 3-node ticketd cluster (fsync on) against one etcd node (through its
# JSON gateway and its own gRPC client), lock cycles/s with the same
# lockers, with two ceilings: one single-mode ticketd (no replication, no
# disk) and the cluster limit (three processes that answer once two of them
# hold a request on disk, nothing more); the five interleaved in each round.
if [[ -z ${BENCH_SKIP_CLUSTER:-} ]]; then
    echo
    echo "cluster: 3 ticketd nodes (fsync on) vs one etcd node, ${BENCH_CLUSTER_CLIENTS:-50} lockers"
    log "building etcd's native gRPC client driver (bench/etcd-native)"
    cargo build --release --quiet --manifest-path bench/etcd-native/Cargo.toml
    ./target/release/cluster-bench --clients "${BENCH_CLUSTER_CLIENTS:-50}" \
        --seconds "$SECS" --rounds "$ROUNDS" --etcd \
        --etcd-native bench/etcd-native/target/release/etcd-native-bench |
        sed -n '/^-- median\|^-- one/,$p'
    echo "target: cluster / etcd >= 10"
fi
