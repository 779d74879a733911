"""Places (protocol 1.2, PROTOCOL §6): how many holders a key admits at once
and which of its places an acquire asks for. A counting semaphore of N is a
limit of N in shared mode; a read/write lock is the limit
:data:`READ_WRITE_LIMIT`, shared for readers and exclusive for writers."""

from __future__ import annotations

from typing import Literal, NamedTuple

from . import _proto

#: ``"shared"``: one of the key's places; ``"exclusive"``: the whole key.
Mode = Literal["shared", "exclusive"]

#: The limit of a read/write lock: as many readers as the wire can count.
READ_WRITE_LIMIT = _proto.MAX_LIMIT


class Places(NamedTuple):
    """What an acquire with places asks for: one place of ``limit`` in
    ``"shared"`` mode, or all of them in ``"exclusive"`` mode. Every caller of
    a key must give the key's own ``limit`` (1..=65535)."""

    limit: int
    mode: Mode = "shared"

    @classmethod
    def semaphore(cls, limit: int) -> Places:
        """One permit of a counting semaphore of ``limit`` places."""
        return cls(limit, "shared")

    @classmethod
    def shared(cls) -> Places:
        """A reader's place in a read/write lock."""
        return cls(READ_WRITE_LIMIT, "shared")

    @classmethod
    def exclusive(cls) -> Places:
        """A writer's hold of a read/write lock."""
        return cls(READ_WRITE_LIMIT, "exclusive")


def check_places(places: Places) -> tuple[int, int]:
    """The wire's ``limit`` and ``mode`` bytes of ``places``. A limit of 0 (or
    over 65535) and an unknown mode are refused with ``ValueError`` /
    ``TypeError`` before anything is sent."""
    if not isinstance(places, Places):
        raise TypeError(f"places must be ticketd.Places, not {type(places).__name__}")
    limit = places.limit
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, not {type(limit).__name__}")
    if limit == 0:
        raise ValueError("a limit of 0 admits no holder: it must be 1..=65535")
    if not 1 <= limit <= _proto.MAX_LIMIT:
        raise ValueError(f"a limit of {limit} is outside 1..=65535")
    if places.mode == "shared":
        return limit, _proto.MODE_SHARED
    if places.mode == "exclusive":
        return limit, _proto.MODE_EXCLUSIVE
    raise ValueError(f"mode must be 'shared' or 'exclusive', not {places.mode!r}")
