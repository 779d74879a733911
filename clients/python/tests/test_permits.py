"""Protocol 1.2 (PROTOCOL §6): semaphores and read/write locks. The codec
against the §6.1 example, the session's matching of ``L``, and the client
against the real single-mode ``ticketd``."""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Callable

import pytest
from support import DelayForward, Proxy, Ticketd

import ticketd
from ticketd import _plan, _proto

MakeClient = Callable[..., ticketd.Client]
MakeProxy = Callable[..., Proxy]

#: PROTOCOL §6.1: a permit of ``pool``, a semaphore of 8, wait=5, lease=30,
#: owner 7, and the answer when ``pool`` is registered with a limit of 4.
SPEC_REQUEST = bytes.fromhex("50 05 1E 00 00 00 00 00 00 00 07 00 08 53 70 6F 6F 6C 0A")
SPEC_REPLY = bytes.fromhex("4C 00 00 00 00 00 00 00 07 00 04 70 6F 6F 6C 0A")


def test_acquire_with_limit_encodes_as_the_spec_example() -> None:
    frame = _proto.encode_acquire_with_limit(5, 30, 7, 8, _proto.MODE_SHARED, b"pool")
    assert frame == SPEC_REQUEST
    x = _proto.encode_acquire_with_limit(0, 1, 0x0A, 65535, _proto.MODE_EXCLUSIVE, b"k")
    assert x == b"P\x00\x01" + (0x0A).to_bytes(8, "big") + b"\xff\xffXk\n"


def test_limit_mismatch_decodes_as_the_spec_example_and_only_when_whole() -> None:
    for cut in range(len(SPEC_REPLY)):
        assert _proto.decode_reply(SPEC_REPLY[:cut], 0, 1024) is None, cut
    d = _proto.decode_reply(SPEC_REPLY + b"T", 0, 1024)
    assert isinstance(d, _proto.Frame)
    assert d.used == len(SPEC_REPLY)
    assert d.reply == _proto.Reply(_proto.OP_LIMIT_MISMATCH, 7, 0, "pool", 4)
    # Its header may hold newlines: owner 0x0A, limit 0x0A0A.
    nl = b"L" + (0x0A).to_bytes(8, "big") + b"\n\n" + b"k\n"
    d = _proto.decode_reply(nl, 0, 1024)
    assert isinstance(d, _proto.Frame)
    assert d.reply == _proto.Reply(_proto.OP_LIMIT_MISMATCH, 0x0A, 0, "k", 0x0A0A)
    assert isinstance(_proto.decode_reply(SPEC_REPLY[:11] + b"\n", 0, 1024), _proto.Malformed)


def test_places_and_their_arguments_are_checked_before_anything_is_sent() -> None:
    assert ticketd.Places.semaphore(8) == ticketd.Places(8, "shared")
    assert ticketd.Places.shared() == ticketd.Places(65535, "shared")
    assert ticketd.Places.exclusive() == ticketd.Places(ticketd.READ_WRITE_LIMIT, "exclusive")
    c = ticketd.Client("127.0.0.1:1")
    try:
        with pytest.raises(ValueError, match="limit of 0"):
            c.acquire_permit("k", 0)
        with pytest.raises(ValueError, match="limit of 0"):
            c.acquire_with("k", ticketd.Places(0, "exclusive"))
        with pytest.raises(ValueError):
            c.acquire_permit("k", 65536)
        with pytest.raises(TypeError):
            c.acquire_permit("k", 2.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="mode"):
            c.acquire_with("k", ticketd.Places(2, "both"))  # type: ignore[arg-type]
        assert c.connected_sessions() == 0
    finally:
        c.close()


def test_a_session_matches_l_by_owner_and_takes_an_l_for_a_plain_acquire_as_untrusted() -> None:
    """A fake server on a socket pair: an ``L`` answers the Acquire With
    Limit it names by owner, with the key's limit; an ``L`` for a plain
    acquire (sent as ``A``) loses that call and closes the session."""
    from ticketd._session import ACQUIRE, ANSWERED, LOST, Call, Session
    from ticketd._transport import Plain

    ours, theirs = socket.socketpair()
    s = Session(Plain(ours), 1024, "pair")
    s.start()
    try:
        plan = _plan.transport_plan(time.monotonic())
        permit = Call(ACQUIRE, b"pool", plan, owner=7, lease_s=30, limit=8, mode=_proto.MODE_SHARED)
        plain = Call(ACQUIRE, b"m", plan, owner=9, lease_s=5)
        assert s.submit(permit)
        want = _proto.encode_acquire_with_limit(0, 30, 7, 8, _proto.MODE_SHARED, b"pool")
        theirs.settimeout(5)
        got = b""
        while len(got) < len(want):
            got += theirs.recv(4096)
        assert got == want
        # Split across reads.
        theirs.sendall(SPEC_REPLY[:5])
        time.sleep(0.05)
        theirs.sendall(SPEC_REPLY[5:])
        assert s.await_call(permit) == ANSWERED
        assert (permit.reply_op, permit.reply_limit) == (_proto.OP_LIMIT_MISMATCH, 4)
        assert s.submit(plain)
        want = _proto.encode_acquire(0, 5, 9, b"m")
        got = b""
        while len(got) < len(want):
            got += theirs.recv(4096)
        assert got == want
        theirs.sendall(b"L" + struct.pack(">QH", 9, 1) + b"m\n")
        assert s.await_call(plain) == LOST
        deadline = time.monotonic() + 5
        while not s.dead and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.dead
    finally:
        s.close("test over")
        s.join()
        theirs.close()


def _in_background(
    call: Callable[[], ticketd.AcquireResult],
) -> tuple[threading.Thread, list[ticketd.AcquireResult]]:
    """Runs ``call`` on a thread; its result lands in the list."""
    out: list[ticketd.AcquireResult] = []
    th = threading.Thread(target=lambda: out.append(call()), daemon=True)
    th.start()
    return th, out


def test_a_semaphore_of_two_against_the_real_server(
    server: Ticketd, make_client: MakeClient
) -> None:
    c = make_client(server.addr)
    first = c.acquire_permit("sem", 2, wait=1, lease=30)
    second = c.acquire_permit("sem", 2, wait=1, lease=30)
    assert first.outcome == second.outcome == "acquired"
    assert first.ticket is not None and second.ticket is not None
    assert first.ticket.token < second.ticket.token
    # Full: a third with wait 0 times out at once, not queued.
    third = c.acquire_permit("sem", 2, wait=0, lease=30)
    assert (third.outcome, third.ticket) == ("timeout", None)
    # Another limit is answered with the key's own, never retried.
    other = c.acquire_permit("sem", 3, wait=1, lease=30)
    assert (other.outcome, other.limit, other.ticket) == ("limit_mismatch", 2, None)
    assert c.acquire_with("sem", ticketd.Places(3, "exclusive"), wait=0).limit == 2
    # A queued permit goes in when a holder releases.
    th, out = _in_background(lambda: c.acquire_permit("sem", 2, wait=10, lease=30))
    time.sleep(0.3)
    assert not out, "granted while both places were held"
    assert first.ticket.release() == "released"
    th.join(10)
    assert [r.outcome for r in out] == ["acquired"]
    queued = out[0].ticket
    assert queued is not None and queued.token > second.ticket.token
    assert second.ticket.release() == "released"
    assert queued.release() == "released"


def test_a_full_semaphore_times_out_at_the_deadline(
    server: Ticketd, make_client: MakeClient
) -> None:
    c = make_client(server.addr)
    held = c.acquire_permit("one", 1, wait=1, lease=30)
    assert held.outcome == "acquired"
    start = time.monotonic()
    res = c.acquire_permit("one", 1, wait=1, lease=30)
    took = time.monotonic() - start
    assert res.outcome == "timeout"
    assert 0.9 <= took < 2.0 + _plan.RESPONSE_GRACE_S


def test_a_read_write_lock_against_the_real_server(
    server: Ticketd, make_client: MakeClient
) -> None:
    c = make_client(server.addr, pool_size=4)
    r1 = c.acquire_shared("rw", wait=1, lease=30).ticket
    r2 = c.acquire_shared("rw", wait=1, lease=30).ticket
    assert r1 is not None and r2 is not None and r1.token < r2.token
    th, out = _in_background(lambda: c.acquire_exclusive("rw", wait=10, lease=30))
    time.sleep(0.3)
    assert not out, "a writer granted beside readers"
    # The queued writer holds back a later reader.
    late = c.acquire_shared("rw", wait=0, lease=30)
    assert late.outcome == "timeout"
    assert r1.release() == "released"
    time.sleep(0.2)
    assert not out, "a writer granted beside a reader"
    assert r2.release() == "released"
    th.join(10)
    assert [r.outcome for r in out] == ["acquired"]
    writer = out[0].ticket
    assert writer is not None and writer.token > r2.token
    assert writer.release() == "released"


def test_a_late_permit_is_given_back_at_once_not_at_the_end_of_its_lease(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    # Requests reach the server 1.5 s late, so its queue outlives D.
    px.set_fault_for(0, DelayForward(1.5))
    direct = make_client(server.addr)
    holder = direct.acquire_permit("late", 1, wait=1, lease=30).ticket
    assert holder is not None
    c = make_client(px.addr, pool_size=1)
    start = time.monotonic()
    th, got = _in_background(lambda: c.acquire_permit("late", 1, wait=2, lease=30))
    # Hand the place over after D (start + 2 s) but before D + 1 s.
    time.sleep(2.3)
    assert holder.release() == "released"
    th.join(10)
    assert [r.outcome for r in got] == ["indeterminate"]
    # The late grant was released long before its 30 s lease.
    t = direct.acquire_permit("late", 1, wait=5, lease=1).ticket
    assert t is not None and t.token > holder.token + 1
    assert time.monotonic() - start < 8
