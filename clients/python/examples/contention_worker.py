"""The Python worker of the cross-language contention test
(tests/client/languages.rs)::

    python3 contention_worker.py ADDR KEY CYCLES COUNTER_FILE

Each cycle acquires KEY (wait 30 s, lease 30 s) through the client in
``clients/python/src``, reads COUNTER_FILE as a decimal integer n (empty or
missing: 0), writes n+1 to it, prints "n token" and releases. Exit 2: not
acquired; 3: not released.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import ticketd  # noqa: E402


def bump(path: Path) -> int:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = ""
    n = int(text) if text else 0
    path.write_text(str(n + 1))
    return n


def main() -> int:
    if len(sys.argv) != 5:
        print("usage: contention_worker.py ADDR KEY CYCLES COUNTER_FILE", file=sys.stderr)
        return 1
    addr, key, cycles, counter = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    with ticketd.Client(addr) as client:
        for _ in range(cycles):
            res = client.acquire(key, wait=30, lease=30)
            if res.ticket is None:
                print(f"not acquired: {res.outcome}", file=sys.stderr)
                return 2
            n = bump(counter)
            print(f"{n} {res.ticket.token}", flush=True)
            outcome = res.ticket.release()
            if outcome != "released":
                print(f"not released: {outcome}", file=sys.stderr)
                return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
