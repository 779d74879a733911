"""The deadline arithmetic, argument checks, codec and owners on their own,
with made-up instants and bytes (no server)."""

from __future__ import annotations

import math
import os
import socket
import struct
import threading
import time

import pytest

import ticketd
from ticketd import _owner, _plan, _proto


def test_wire_wait_rounds_up_to_whole_seconds_and_caps_at_255() -> None:
    assert _plan.wire_wait_s(0) is None
    assert _plan.wire_wait_s(-1) is None
    assert _plan.wire_wait_s(1e-9) == 1
    assert _plan.wire_wait_s(0.999) == 1
    assert _plan.wire_wait_s(1.0) == 1
    assert _plan.wire_wait_s(1.001) == 2
    assert _plan.wire_wait_s(2.999) == 3
    assert _plan.wire_wait_s(255) == 255
    assert _plan.wire_wait_s(255.5) == 255
    assert _plan.wire_wait_s(1e12) == 255


def test_wait_is_clamped_to_255_and_nonsense_is_refused() -> None:
    assert _plan.normalise_wait(1000) == 255
    assert _plan.normalise_wait(math.inf) == 255
    assert _plan.normalise_wait(7) == 7
    assert _plan.normalise_wait(0.25) == 0.25
    for bad in (-0.001, -5, math.nan):
        with pytest.raises(ValueError):
            _plan.normalise_wait(bad)
    for wrong in ("5", None, True):
        with pytest.raises(TypeError):
            _plan.normalise_wait(wrong)  # type: ignore[arg-type]
    plan = _plan.acquire_plan(100.0, _plan.normalise_wait(1e9))
    assert plan.wait_deadline == 355.0
    assert plan.wire_wait_at(100.0) == 255


def test_one_deadline_governs_sending_the_gate_and_the_grace() -> None:
    start = 1000.0
    plan = _plan.acquire_plan(start, 5)
    d = start + 5
    assert plan.send_deadline == d
    assert plan.gate == d
    assert plan.give_up == d + 1
    assert plan.wire_wait_at(start) == 5
    # A connection that took 2 s leaves a wait 2 s shorter, never a fresh 5.
    assert plan.wire_wait_at(start + 2) == 3
    assert plan.wire_wait_at(start + 2.001) == 3
    assert plan.wire_wait_at(d - 0.001) == 1
    # Reaching D unsent: not sent at all.
    assert plan.wire_wait_at(d) is None
    assert plan.wire_wait_at(d + 1) is None


def test_wait_zero_is_one_attempt_under_the_transport_deadline() -> None:
    start = 50.0
    plan = _plan.acquire_plan(start, 0)
    assert plan == _plan.transport_plan(start)
    assert plan.wait_deadline is None
    assert plan.send_deadline == start + 5
    assert plan.give_up == start + 5
    # The wire wait stays 0 however long connecting took.
    assert plan.wire_wait_at(start + 4) == 0
    assert plan.wire_wait_at(start + 5) is None


def test_an_extend_attempt_ends_at_the_transport_deadline_or_the_expiry() -> None:
    # The expiry comes first: everything ends there.
    plan = _plan.extend_plan(40.0, 42.0)
    assert plan.wire_wait_at(41.9) == 0
    assert plan.wire_wait_at(42.0) is None
    assert plan.give_up == 42.0
    # A long lease: one attempt lasts the transport deadline, then another.
    plan = _plan.extend_plan(40.0, 100.0)
    assert plan.send_deadline == plan.give_up == 45.0


def test_lease_must_be_whole_seconds_from_1_to_255() -> None:
    assert _plan.lease_s(1) == 1
    assert _plan.lease_s(255) == 255
    assert _plan.lease_s(30.0) == 30
    for bad in (0, -1, 256, 1.5, 0.1, math.nan, math.inf):
        with pytest.raises(ValueError):
            _plan.lease_s(bad)
    for wrong in ("30", None, True):
        with pytest.raises(TypeError):
            _plan.lease_s(wrong)  # type: ignore[arg-type]


def test_keys_are_checked_before_anything_is_sent() -> None:
    assert _plan.check_key("k", 8) == b"k"
    assert _plan.check_key("12345678", 8) == b"12345678"
    with pytest.raises(ValueError, match="empty"):
        _plan.check_key("", 8)
    with pytest.raises(ValueError, match="newline"):
        _plan.check_key("a\nb", 8)
    with pytest.raises(ValueError, match="9 bytes"):
        _plan.check_key("123456789", 8)
    # The limit counts bytes, not characters.
    with pytest.raises(ValueError, match="11 bytes"):
        _plan.check_key("éééé é", 8)
    with pytest.raises(ValueError, match="UTF-8"):
        _plan.check_key("\udc80", 8)
    with pytest.raises(TypeError):
        _plan.check_key(b"k", 8)  # type: ignore[arg-type]


def test_requests_encode_as_the_spec_examples() -> None:
    # PROTOCOL §1: acquire wait=5 lease=30 owner=0x0A0B key="db".
    assert _proto.encode_acquire(5, 30, 0x0A0B, b"db") == bytes.fromhex(
        "41 05 1E 00 00 00 00 00 00 0A 0B 64 62 0A"
    )
    # PROTOCOL §5.1: extend token=7 key="db" by 30 s.
    assert _proto.encode_extend(30, 7, b"db") == bytes.fromhex(
        "45 1E 00 00 00 00 00 00 00 07 64 62 0A"
    )
    assert _proto.encode_release(7, b"db") == bytes.fromhex("52 00 00 00 00 00 00 00 07 64 62 0A")


def test_a_reply_header_may_contain_newlines() -> None:
    grant = bytes.fromhex("41 00 00 00 00 00 00 00 0A 00 00 00 00 00 00 0A 0B 64 62 0A")
    for cut in range(len(grant)):
        assert _proto.decode_reply(grant[:cut], 0, 1024) is None, cut
    d = _proto.decode_reply(grant + b"T", 0, 1024)
    assert isinstance(d, _proto.Frame)
    assert d.reply == _proto.Reply(_proto.OP_ACQUIRE, 10, 0x0A0B, "db")
    assert d.used == len(grant)
    x = _proto.decode_reply(b"X" + (7).to_bytes(8, "big") + b"db\n", 0, 1024)
    assert isinstance(x, _proto.Frame)
    assert x.reply == _proto.Reply(_proto.OP_NOT_EXTENDED, 7, 0, "db")


def test_a_malformed_reply_stream_is_detected_within_bounded_input() -> None:
    assert isinstance(_proto.decode_reply(b"Z", 0, 8), _proto.Malformed)
    t = b"T" + bytes(8)
    assert isinstance(_proto.decode_reply(t + b"\n", 0, 8), _proto.Malformed)
    assert isinstance(_proto.decode_reply(t + b"\xff\n", 0, 8), _proto.Malformed)
    assert _proto.decode_reply(t + b"x" * 8, 0, 8) is None
    assert isinstance(_proto.decode_reply(t + b"x" * 9, 0, 8), _proto.Malformed)


def test_owners_are_unique_across_threads_and_spread() -> None:
    out: list[list[int]] = []

    def draw() -> None:
        out.append([_owner.next_owner() for _ in range(20_000)])

    ts = [threading.Thread(target=draw) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    seen = {o for chunk in out for o in chunk}
    assert len(seen) == 80_000
    assert all(0 <= o < 1 << 64 for o in seen)
    a, b = _owner.next_owner(), _owner.next_owner()
    assert bin(a ^ b).count("1") > 8, (hex(a), hex(b))


def test_mix_is_a_bijection_on_a_sample() -> None:
    xs = list(range(10_000)) + [(1 << 64) - 1 - i for i in range(10_000)]
    assert len({_owner.mix(x) for x in xs}) == len(xs)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_draws_owners_from_a_new_base() -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(w, _owner.next_owner().to_bytes(8, "big"))
        os._exit(0)
    os.close(w)
    child = int.from_bytes(os.read(r, 8), "big")
    os.waitpid(pid, 0)
    os.close(r)
    # The parent's next few owners never include the child's first one.
    assert child not in {_owner.next_owner() for _ in range(1000)}


def test_client_settings_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="no server address"):
        ticketd.Client([])
    with pytest.raises(ValueError, match="pool_size"):
        ticketd.Client("127.0.0.1:1", pool_size=0)
    with pytest.raises(ValueError, match="pool_size"):
        ticketd.Client("127.0.0.1:1", pool_size=65)
    with pytest.raises(ValueError, match="connect_timeout"):
        ticketd.Client("127.0.0.1:1", connect_timeout=0)
    with pytest.raises(ValueError, match="max_key_bytes"):
        ticketd.Client("127.0.0.1:1", max_key_bytes=65537)
    for bad in ("localhost", "127.0.0.1:", ":7470", "127.0.0.1:0", "127.0.0.1:x", "unix:"):
        with pytest.raises(ValueError):
            ticketd.Client(bad)
    with pytest.raises(ValueError, match="cannot resolve"):
        ticketd.Client("no-such-host.invalid:7470")
    c = ticketd.Client(["127.0.0.1:7470", "[::1]:7470", "unix:/run/ticketd.sock"])
    assert c.addresses == ["127.0.0.1:7470", "[::1]:7470", "unix:/run/ticketd.sock"]
    c.close()


def test_a_session_matches_replies_in_any_order_by_owner_and_by_token_and_key() -> None:
    """Five pipelined requests on one connection, answered in reverse order
    by a fake server on the other end of a socket pair: each call gets its
    own reply. Two releases share a token and differ by key; a release and
    an extend share token and key and differ by kind (R/N against E/X)."""
    from ticketd._session import ACQUIRE, ANSWERED, EXTEND, RELEASE, Call, Session
    from ticketd._transport import Plain

    ours, theirs = socket.socketpair()
    s = Session(Plain(ours), 1024, "pair")
    s.start()
    try:
        plan = _plan.transport_plan(time.monotonic())
        calls = [
            Call(ACQUIRE, b"k1", plan, owner=11, lease_s=5),
            Call(ACQUIRE, b"k2", plan, owner=22, lease_s=5),
            Call(RELEASE, b"x", plan, token=5),
            Call(RELEASE, b"y", plan, token=5),
            Call(EXTEND, b"x", plan, token=5, lease_s=9),
        ]
        for c in calls:
            assert s.submit(c)
        want = b"".join(
            [
                _proto.encode_acquire(0, 5, 11, b"k1"),
                _proto.encode_acquire(0, 5, 22, b"k2"),
                _proto.encode_release(5, b"x"),
                _proto.encode_release(5, b"y"),
                _proto.encode_extend(9, 5, b"x"),
            ]
        )
        theirs.settimeout(5)
        got = b""
        while len(got) < len(want):
            got += theirs.recv(4096)
        assert got == want
        u64 = struct.Struct(">Q").pack
        theirs.sendall(
            b"E" + u64(5) + b"x\n"
            + b"N" + u64(5) + b"y\n"
            + b"R" + u64(5) + b"x\n"
            + b"T" + u64(22) + b"k2\n"
            + b"A" + u64(9) + u64(11) + b"k1\n"
        )  # fmt: skip
        outcomes = [s.await_call(c) for c in calls]
        assert outcomes == [ANSWERED] * 5
        assert [(chr(c.reply_op), c.reply_token) for c in calls] == [
            ("A", 9),
            ("T", 22),
            ("R", 5),
            ("N", 5),
            ("E", 5),
        ]
    finally:
        s.close("test over")
        s.join()
        theirs.close()
