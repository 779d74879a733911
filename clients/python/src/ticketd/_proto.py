"""The wire codec (PROTOCOL §1, §5.1 and §6.1): requests out, replies in. No I/O.

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
OP_ACQUIRE_WITH_LIMIT = 0x50  # 'P': request Acquire With Limit (protocol 1.2)
OP_LIMIT_MISMATCH = 0x4C  # 'L': reply LimitMismatch (protocol 1.2)
MODE_SHARED = 0x53  # 'S': a shared place of an Acquire With Limit
MODE_EXCLUSIVE = 0x58  # 'X': the whole key, in an Acquire With Limit
#: The most places a key admits: the largest ``limit`` the wire carries.
MAX_LIMIT = 65535
NEWLINE = 0x0A

_U64 = struct.Struct(">Q")
_ACQ = struct.Struct(">cBBQ")
_REL = struct.Struct(">cQ")
_EXT = struct.Struct(">cBQ")
_PERMIT = struct.Struct(">cBBQHB")
_U16 = struct.Struct(">H")

#: Fixed header length of each reply op; the key and its newline follow.
REPLY_HEADER = {
    OP_ACQUIRE: 17,
    OP_TIMEOUT: 9,
    OP_BUSY: 9,
    OP_RELEASE: 9,
    OP_NOT_RELEASED: 9,
    OP_NOT_EXTENDED: 9,
    OP_EXTEND: 9,
    OP_LIMIT_MISMATCH: 11,
}


def encode_acquire(wait_s: int, lease_s: int, owner: int, key: bytes) -> bytes:
    """``'A' wait:u8 lease:u8 owner:u64 key '\\n'``."""
    return _ACQ.pack(b"A", wait_s, lease_s, owner) + key + b"\n"


def encode_acquire_with_limit(
    wait_s: int, lease_s: int, owner: int, limit: int, mode: int, key: bytes
) -> bytes:
    """``'P' wait:u8 lease:u8 owner:u64 limit:u16 mode:u8 key '\\n'`` (protocol
    1.2); ``mode`` is :data:`MODE_SHARED` or :data:`MODE_EXCLUSIVE`."""
    return _PERMIT.pack(b"P", wait_s, lease_s, owner, limit, mode) + key + b"\n"


def encode_release(token: int, key: bytes) -> bytes:
    """``'R' token:u64 key '\\n'``."""
    return _REL.pack(b"R", token) + key + b"\n"


def encode_extend(lease_s: int, token: int, key: bytes) -> bytes:
    """``'E' lease:u8 token:u64 key '\\n'`` (protocol 1.1)."""
    return _EXT.pack(b"E", lease_s, token) + key + b"\n"


class Reply(NamedTuple):
    """One decoded reply. ``a`` is the token for A/R/N/E/X and the owner for
    T/B/L; ``owner`` is set for A only; ``limit``, the key's limit, for L
    only (protocol 1.2)."""

    op: int
    a: int
    owner: int
    key: str
    limit: int = 0


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
    limit = _U16.unpack_from(buf, start + 9)[0] if op == OP_LIMIT_MISMATCH else 0
    return Frame(Reply(op, a, owner, key, limit), nl + 1 - start)
