"""Fresh acquire owners (PROTOCOL §3): unique within the process, unlikely to
collide across processes.

An owner is ``mix(base + n)``: ``base`` is 64 bits from :mod:`secrets`, drawn
once per process (and again in a forked child, which would otherwise repeat
its parent's owners), ``n`` a process-wide counter. ``mix`` (the splitmix64
finaliser) is a bijection on 64-bit integers, so two calls in one process
never share an owner, and consecutive owners are spread over the range.
"""

from __future__ import annotations

import os
import secrets
import threading

_MASK = (1 << 64) - 1
_lock = threading.Lock()
_base = secrets.randbits(64)
_counter = 0


def _reseed() -> None:
    global _base, _counter
    _base = secrets.randbits(64)
    _counter = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed)


def mix(z: int) -> int:
    """The splitmix64 finaliser: a bijection, so distinct inputs stay distinct."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def next_owner() -> int:
    """A fresh owner for one acquire call."""
    global _counter
    with _lock:
        n = _counter
        _counter += 1
        base = _base
    return mix((base + n) & _MASK)
