#!/usr/bin/env python3
"""Acquire+release cycles per second through the Python client, for 1 and
16 threads, beside redis-py's ``Lock`` on a local Redis in the same run.

Each thread cycles on a key of its own (no contention: this measures the
client and the round trip, not queueing). ticketd's threads share one
``ticketd.Client`` (requests pipelined over its pool); Redis's share one
``redis.Redis`` (its connection pool, one connection per busy thread).
Rounds alternate between the two so that machine noise hits both alike.

    python clients/python/bench.py                  # starts ticketd and redis-server itself
    python clients/python/bench.py --seconds 5 --rounds 3 --threads 1,16,64
    python clients/python/bench.py --ticketd 127.0.0.1:7470 --redis 127.0.0.1:6379

Starting servers needs ``target/{release,debug}/ticketd`` (or
``--ticketd-bin``) and ``redis-server`` on the PATH; the Redis part needs
``pip install redis`` and is skipped, saying so, without it.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "src"))

import ticketd  # noqa: E402

REPO = HERE.parents[1]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def start_ticketd(binary: str | None) -> tuple[subprocess.Popen[bytes], str, str]:
    if binary is None:
        found = [REPO / "target" / p / "ticketd" for p in ("release", "debug")]
        found = [p for p in found if p.exists()]
        if not found:
            sys.exit("no target/{release,debug}/ticketd: cargo build --release --bin ticketd")
        binary = str(found[0])
    proc = subprocess.Popen(
        [binary, "--listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    assert proc.stderr is not None
    for raw in proc.stderr:
        line = raw.decode("utf-8", "replace")
        m = re.search(r"listening on (\S+)", line)
        if m:
            # Keep draining so the pipe never fills.
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, m.group(1), binary
    proc.kill()
    sys.exit("ticketd did not start")


def start_redis() -> tuple[subprocess.Popen[bytes] | None, str | None]:
    exe = shutil.which("redis-server")
    if exe is None:
        return None, None
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.02)
    proc.kill()
    return None, None


def run_threads(n: int, seconds: float, cycle: Callable[[int], None]) -> float:
    """Cycles per second of ``n`` threads calling ``cycle(thread_index)``."""
    counts = [0] * n
    errors: list[BaseException] = []
    start_gate = threading.Barrier(n + 1)
    stop_at = [0.0]

    def work(i: int) -> None:
        start_gate.wait()
        done = 0
        try:
            while time.monotonic() < stop_at[0]:
                cycle(i)
                done += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        counts[i] = done

    ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    stop_at[0] = time.monotonic() + seconds
    start = time.monotonic()
    start_gate.wait()
    for t in ts:
        t.join()
    elapsed = time.monotonic() - start
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


def ticketd_cycle(client: ticketd.Client) -> Callable[[int], None]:
    def cycle(i: int) -> None:
        t = client.acquire(f"bench-{i}", wait=10, lease=30).ticket
        if t is None:
            raise RuntimeError("ticketd: not acquired")
        if t.release() != "released":
            raise RuntimeError("ticketd: not released")

    return cycle


def redis_cycle(r: Any) -> Callable[[int], None]:
    def cycle(i: int) -> None:
        lock = r.lock(f"bench-{i}", timeout=30, blocking_timeout=10)
        if not lock.acquire():
            raise RuntimeError("redis: not acquired")
        lock.release()

    return cycle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ticketd", help="HOST:PORT of a running ticketd (default: start one)")
    ap.add_argument("--ticketd-bin", help="ticketd binary to start")
    ap.add_argument("--redis", help="HOST:PORT of a running Redis (default: start redis-server)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per measurement (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--threads", default="1,16", help="thread counts (default 1,16)")
    ap.add_argument("--pool-size", type=int, default=2, help="ticketd client connections")
    args = ap.parse_args()
    threads = [int(x) for x in args.threads.split(",")]

    procs: list[subprocess.Popen[bytes]] = []
    try:
        if args.ticketd:
            taddr, tbin = args.ticketd, "(running)"
        else:
            p, taddr, tbin = start_ticketd(args.ticketd_bin)
            procs.append(p)
        client = ticketd.Client(taddr, pool_size=args.pool_size)
        r = None
        raddr = args.redis
        redis: Any = None
        try:
            redis = importlib.import_module("redis")
        except ImportError:
            print("redis-py not installed (pip install redis): Redis column skipped")
        if redis is not None:
            if raddr is None:
                rp, raddr = start_redis()
                if rp is not None:
                    procs.append(rp)
            if raddr is None:
                print("no redis-server on the PATH and no --redis: Redis column skipped")
            else:
                host, port = raddr.rsplit(":", 1)
                r = redis.Redis(host=host, port=int(port), max_connections=max(threads) + 4)
                r.ping()
        print(f"ticketd {tbin} at {taddr}; redis {raddr or '-'}; python {sys.version.split()[0]}")
        print(f"{args.rounds} rounds x {args.seconds:g} s per cell, median shown")
        tcycle = ticketd_cycle(client)
        rcycle = redis_cycle(r) if r is not None else None
        # Warm up connections and code paths.
        run_threads(max(threads), 0.3, tcycle)
        if rcycle:
            run_threads(max(threads), 0.3, rcycle)
        print(f"{'threads':>8} {'ticketd/s':>12} {'redis-py/s':>12} {'ratio':>7}")
        for n in threads:
            ts: list[float] = []
            rs: list[float] = []
            for _ in range(args.rounds):
                ts.append(run_threads(n, args.seconds, tcycle))
                if rcycle:
                    rs.append(run_threads(n, args.seconds, rcycle))
            tm = statistics.median(ts)
            if rs:
                rm = statistics.median(rs)
                print(f"{n:>8} {tm:>12.0f} {rm:>12.0f} {tm / rm:>7.2f}")
            else:
                print(f"{n:>8} {tm:>12.0f} {'-':>12} {'-':>7}")
        client.close()
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


if __name__ == "__main__":
    main()
