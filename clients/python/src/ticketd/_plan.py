"""Deadline arithmetic and argument checks of one call (PROTOCOL §3, §5.3), kept
apart from sockets so every rule can be checked with made-up instants.

All instants are ``time.monotonic()`` seconds. An acquire with ``wait > 0``
has one deadline ``D = start + normalised wait``: it may be written only
before ``D``, its wire wait is the time left until ``D`` rounded *up* to whole
seconds, an ``A`` that reaches the caller after ``D`` is not handed over, and
a request that may have been sent but has no reply by ``D + 1 s`` is given
up. ``wait = 0`` and releases run under a separate 5 s transport deadline.
"""

from __future__ import annotations

import math
from typing import NamedTuple

#: The longest wait the wire carries; longer waits are clamped to it.
MAX_WAIT_S = 255
#: The longest lease the wire carries.
MAX_LEASE_S = 255
#: Transport deadline of a ``wait = 0`` acquire and of a release.
TRANSPORT_DEADLINE_S = 5.0
#: How long past ``D`` a reply is still waited for: the wire wait was rounded
#: up, so the server may answer up to a second after ``D``.
RESPONSE_GRACE_S = 1.0
#: The server's default ``--max-key-bytes``.
DEFAULT_MAX_KEY_BYTES = 1024
#: The most any server accepts for ``--max-key-bytes``.
MAX_KEY_BYTES_CEILING = 65536


def normalise_wait(wait: float) -> float:
    """The caller's wait in seconds, clamped to 0..=255. Negative, NaN and
    non-numbers are refused (``ValueError`` / ``TypeError``)."""
    if isinstance(wait, bool) or not isinstance(wait, (int, float)):
        raise TypeError(f"wait must be a number of seconds, not {type(wait).__name__}")
    if math.isnan(wait):
        raise ValueError("wait is NaN")
    if wait < 0:
        raise ValueError(f"wait of {wait!r} s is negative")
    return float(min(wait, MAX_WAIT_S))


def wire_wait_s(remaining: float) -> int | None:
    """The wait byte for ``remaining`` seconds until ``D``: whole seconds
    rounded up, at most 255; ``None`` when nothing remains (not sent)."""
    if remaining <= 0:
        return None
    return min(math.ceil(remaining), MAX_WAIT_S)


def lease_s(lease: float) -> int:
    """The lease byte: whole seconds in 1..=255. The client never rounds a
    lease: 1.5 is refused, not turned into 1 or 2."""
    if isinstance(lease, bool) or not isinstance(lease, (int, float)):
        raise TypeError(f"lease must be whole seconds, not {type(lease).__name__}")
    if isinstance(lease, float) and (math.isnan(lease) or math.isinf(lease)):
        raise ValueError(f"a lease of {lease!r} s is not a whole number of seconds")
    if lease <= 0:
        raise ValueError(f"a lease of {lease!r} s is not allowed: it must be 1..=255")
    if lease > MAX_LEASE_S:
        raise ValueError(f"a lease of {lease!r} s is over the 255 s maximum")
    if lease != int(lease):
        raise ValueError(f"a lease of {lease!r} s is not a whole number of seconds")
    return int(lease)


def check_key(key: str, max_key_bytes: int) -> bytes:
    """The key as the wire carries it: UTF-8, 1..=max_key_bytes bytes, no
    newline. Refused with ``ValueError`` / ``TypeError`` otherwise."""
    if not isinstance(key, str):
        raise TypeError(f"key must be str, not {type(key).__name__}")
    if not key:
        raise ValueError("the key is empty")
    if "\n" in key:
        raise ValueError("the key contains a newline")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the key is not valid UTF-8 text: {e}") from None
    if len(raw) > max_key_bytes:
        raise ValueError(f"the key is {len(raw)} bytes long, the limit is {max_key_bytes}")
    return raw


class Plan(NamedTuple):
    """Every instant that governs one call."""

    #: ``D`` of an acquire with ``wait > 0``; ``None`` for ``wait = 0``,
    #: releases and extends, which carry no wait.
    wait_deadline: float | None
    #: Written only before this; still queued then, it is dropped unsent.
    send_deadline: float
    #: An ``A`` observed by the caller after this is not handed over.
    gate: float
    #: Possibly sent and still unanswered at this instant: given up.
    give_up: float

    def wire_wait_at(self, now: float) -> int | None:
        """The wait byte to write at ``now``, or ``None``: must not be sent."""
        if now >= self.send_deadline:
            return None
        if self.wait_deadline is None:
            return 0
        return wire_wait_s(self.wait_deadline - now)


def acquire_plan(start: float, wait: float) -> Plan:
    """The plan of an acquire that started at ``start`` (``wait`` normalised)."""
    if wait <= 0:
        # One direct attempt under the transport deadline: no rounded-up
        # wire wait, so no grace either.
        return transport_plan(start)
    d = start + wait
    return Plan(d, d, d, d + RESPONSE_GRACE_S)


def transport_plan(start: float) -> Plan:
    """The plan of a release (or a ``wait = 0`` acquire) started at ``start``."""
    t = start + TRANSPORT_DEADLINE_S
    return Plan(None, t, t, t)


def extend_plan(start: float, until: float) -> Plan:
    """The plan of one extend attempt made at ``start``: sent, and answered,
    within the transport deadline and never after ``until`` (the ticket's
    conservative expiry, or the keep-alive's renewal deadline)."""
    t = min(start + TRANSPORT_DEADLINE_S, until)
    return Plan(None, t, t, t)
