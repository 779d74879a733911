"""The wire codec (PROTOCOL §1 and §5.1): requests out, replies in. No I/O.

Every frame ends with one ``0x0A`` byte, and its fixed binary header may
contain ``0x0A`` itself, so a reply is decoded by taking the header by count
for its op and only then looking for the newline that ends the key.
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Union

OP_ACQUIRE = 0x41  # 'A': request Acquire, reply Acquired
OP_RELEASE = 0x52  # 'R': request Release, reply Released
OP_EXTEND = 0x45  # 'E': request Extend, reply Extended (protocol 1.1)
OP_TIMEOUT = 0x54  # 'T'
OP_BUSY = 0x42  # 'B'
OP_NOT_RELEASED = 0x4E  # 'N'
OP_NOT_EXTENDED = 0x58  # 'X' (protocol 1.1)
NEWLINE = 0x0A

_U64 = struct.Struct(">Q")
_ACQ = struct.Struct(">cBBQ")
_REL = struct.Struct(">cQ")
_EXT = struct.Struct(">cBQ")

#: Fixed header length of each reply op; the key and its newline follow.
REPLY_HEADER = {
    OP_ACQUIRE: 17,
    OP_TIMEOUT: 9,
    OP_BUSY: 9,
    OP_RELEASE: 9,
    OP_NOT_RELEASED: 9,
    OP_NOT_EXTENDED: 9,
    OP_EXTEND: 9,
}


def encode_acquire(wait_s: int, lease_s: int, owner: int, key: bytes) -> bytes:
    """``'A' wait:u8 lease:u8 owner:u64 key '\\n'``."""
    return _ACQ.pack(b"A", wait_s, lease_s, owner) + key + b"\n"


def encode_release(token: int, key: bytes) -> bytes:
    """``'R' token:u64 key '\\n'``."""
    return _REL.pack(b"R", token) + key + b"\n"


def encode_extend(lease_s: int, token: int, key: bytes) -> bytes:
    """``'E' lease:u8 token:u64 key '\\n'`` (protocol 1.1)."""
    return _EXT.pack(b"E", lease_s, token) + key + b"\n"


class Reply(NamedTuple):
    """One decoded reply. ``a`` is the token for A/R/N/E/X and the owner for
    T/B; ``owner`` is set for A only."""

    op: int
    a: int
    owner: int
    key: str


class Malformed(NamedTuple):
    """The byte stream cannot be a reply stream any more."""

    reason: str


class Frame(NamedTuple):
    """A whole reply and the bytes it used."""

    reply: Reply
    used: int


Decoded = Union[Frame, Malformed, None]


def decode_reply(buf: bytes | bytearray, start: int, max_key_bytes: int) -> Decoded:
    """Decodes one reply at ``buf[start:]``: a :class:`Frame`, a
    :class:`Malformed`, or ``None`` if more bytes are needed. Never reads more
    than the header plus ``max_key_bytes + 1`` bytes looking for the newline,
    so a stream without one is malformed after a bounded amount of input."""
    if start >= len(buf):
        return None
    op = buf[start]
    header = REPLY_HEADER.get(op)
    if header is None:
        return Malformed(f"unknown reply op 0x{op:02x}")
    if len(buf) - start < header:
        return None
    key_start = start + header
    window_end = min(len(buf), key_start + max_key_bytes + 1)
    nl = buf.find(b"\n", key_start, window_end)
    if nl < 0:
        if window_end - key_start > max_key_bytes:
            return Malformed("reply key longer than max_key_bytes")
        return None
    if nl == key_start:
        return Malformed("reply with an empty key")
    try:
        key = bytes(buf[key_start:nl]).decode("utf-8")
    except UnicodeDecodeError:
        return Malformed("reply key is not UTF-8")
    (a,) = _U64.unpack_from(buf, start + 1)
    owner = _U64.unpack_from(buf, start + 9)[0] if op == OP_ACQUIRE else 0
    return Frame(Reply(op, a, owner, key), nl + 1 - start)
