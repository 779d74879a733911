"""The lone caller's path: with nothing else in flight on its connection a
caller writes its own frame and reads its own reply on its own thread; a
caller that arrives meanwhile queues for the writer thread and gets its
reply from whoever holds the read role; the role goes back to the reader
thread when the caller that held it is done, however its call ended."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import pytest
from support import STALL_REPLIES, Proxy, Ticketd

import ticketd
from ticketd import _plan, _proto, _session, _transport

MakeClient = Callable[..., ticketd.Client]
MakeProxy = Callable[..., Proxy]
Seen = dict[tuple[int, str], list[str]]

pytestmark = pytest.mark.skipif(
    not _transport.CALLER_IO, reason="no poll() / MSG_DONTWAIT: every request goes through threads"
)


@pytest.fixture
def deliveries(monkeypatch: pytest.MonkeyPatch) -> Seen:
    """The name of the thread that delivered each reply, by session and key."""
    seen: Seen = {}
    real = _session.Session._deliver

    def record(self: _session.Session, r: object, by_caller: bool = False) -> str | None:
        key = getattr(r, "key", "")
        seen.setdefault((self.id, key), []).append(threading.current_thread().name)
        return real(self, r, by_caller)  # type: ignore[arg-type]

    monkeypatch.setattr(_session.Session, "_deliver", record)
    return seen


def only_session(c: ticketd.Client) -> _session.Session:
    live = c._pool.live()
    assert len(live) == 1
    return live[0]


def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return pred()


def test_a_lone_caller_writes_and_reads_on_its_own_thread(
    server: Ticketd, make_client: MakeClient, deliveries: Seen
) -> None:
    c = make_client(server.addr, pool_size=1)
    for _ in range(20):
        t = c.acquire("solo", wait=1, lease=5).ticket
        assert t is not None
        assert t.release() == "released"
    s = only_session(c)
    assert s.frames_written == 40
    assert s.frames_written_by_callers == 40
    assert s.replies_read_by_callers == 40
    assert s.replies_read_by_reader == 0
    me = threading.current_thread().name
    assert deliveries[(s.id, "solo")] == [me] * 40
    # Nothing was left in flight, nobody holds the read role.
    assert s._leader is None and not s._in_flight_locked()


def test_a_caller_arriving_while_another_holds_the_read_role_gets_its_reply(
    server: Ticketd, make_client: MakeClient, deliveries: Seen
) -> None:
    holder = make_client(server.addr).acquire("held", wait=1, lease=30).ticket
    assert holder is not None
    c = make_client(server.addr, pool_size=1)
    got: list[ticketd.AcquireResult] = []
    first = threading.Thread(
        target=lambda: got.append(c.acquire("held", wait=5, lease=5)), name="first-caller"
    )
    first.start()
    assert wait_for(lambda: len(c._pool.live()) == 1 and only_session(c)._leader is not None)
    s = only_session(c)
    # The first caller reads; this one queues, goes out through the writer
    # thread, and its reply is delivered by the first caller's thread.
    t = c.acquire("free", wait=1, lease=5).ticket
    assert t is not None
    assert deliveries[(s.id, "free")] == ["first-caller"]
    assert s.frames_written == 2 and s.frames_written_by_callers == 1
    assert first.is_alive()
    assert holder.release() == "released"
    first.join()
    assert got[0].outcome == "acquired"
    assert deliveries[(s.id, "held")] == ["first-caller"]
    assert s.replies_read_by_reader == 0
    tk = got[0].ticket
    assert tk is not None and tk.release() == "released"
    assert t.release() == "released"


def test_the_read_role_goes_back_to_the_reader_when_its_caller_times_out(
    server: Ticketd, make_client: MakeClient, deliveries: Seen
) -> None:
    direct = make_client(server.addr)
    h1 = direct.acquire("h1", wait=1, lease=30).ticket
    h2 = direct.acquire("h2", wait=1, lease=30).ticket
    assert h1 is not None and h2 is not None
    c = make_client(server.addr, pool_size=1)
    got: dict[str, ticketd.AcquireResult] = {}

    def acquire(key: str, wait: float) -> None:
        got[key] = c.acquire(key, wait=wait, lease=5)

    first = threading.Thread(target=acquire, args=("h1", 1), name="first-caller")
    first.start()
    assert wait_for(lambda: len(c._pool.live()) == 1 and only_session(c)._leader is not None)
    s = only_session(c)
    second = threading.Thread(target=acquire, args=("h2", 6), name="second-caller")
    second.start()
    assert wait_for(lambda: s.frames_written == 2)
    first.join()
    assert got["h1"].outcome == "timeout"
    # The first caller left with the second's request in flight: the
    # reader thread reads now.
    assert s._leader is None
    assert wait_for(lambda: s._reader_on)
    assert second.is_alive()
    assert h2.release() == "released"
    second.join()
    assert got["h2"].outcome == "acquired"
    assert deliveries[(s.id, "h1")] == ["first-caller"]
    by = deliveries[(s.id, "h2")]
    assert len(by) == 1 and by[0].startswith("ticketd-r"), by
    assert not s.dead
    # Idle again: the next lone caller reads for itself once more.
    assert wait_for(lambda: not s._reader_on)
    t = c.acquire("after", wait=1, lease=5).ticket
    assert t is not None and t.release() == "released"
    assert deliveries[(s.id, "after")] == [threading.current_thread().name] * 2
    tk = got["h2"].ticket
    assert tk is not None and tk.release() == "released"
    assert h1.release() == "released"


def test_a_caller_whose_reply_stalls_is_indeterminate_and_the_next_caller_reads_again(
    server: Ticketd,
    make_proxy: MakeProxy,
    make_client: MakeClient,
    deliveries: Seen,
) -> None:
    """The caller holding the read role gets no reply by D + 1 s: it closes
    exactly that connection (the request queued behind it ends
    indeterminate too, it may have been sent) and gives the role up; the
    next call, on a new connection, is written and read by its caller."""
    px = make_proxy(server)
    px.set_fault_for(0, STALL_REPLIES)
    c = make_client(px.addr, pool_size=1)
    got: dict[str, tuple[str, float]] = {}

    def acquire(key: str) -> None:
        start = time.monotonic()
        got[key] = (c.acquire(key, wait=1, lease=5).outcome, time.monotonic() - start)

    first = threading.Thread(target=acquire, args=("stalled",), name="first-caller")
    first.start()
    assert px.wait_until(5, lambda p: len(p.forwarded_for("stalled")) == 1)
    s = only_session(c)
    assert s._leader is not None
    second = threading.Thread(target=acquire, args=("behind",), name="second-caller")
    second.start()
    assert px.wait_until(5, lambda p: len(p.forwarded_for("behind")) == 1)
    first.join()
    second.join()
    assert got["stalled"][0] == "indeterminate"
    assert 1.95 <= got["stalled"][1] < 2.7, got
    assert got["behind"][0] == "indeterminate"
    assert s.dead and s._leader is None
    assert px.wait_until(1, lambda p: p.closed_by_client == [0])
    t = c.acquire("next", wait=1, lease=5).ticket
    assert t is not None and t.release() == "released"
    s2 = only_session(c)
    assert s2 is not s and s2.frames_written_by_callers == 2
    assert deliveries[(s2.id, "next")] == [threading.current_thread().name] * 2
    # Neither stalled request was delivered to anyone.
    assert (s.id, "stalled") not in deliveries and (s.id, "behind") not in deliveries


def test_a_lone_caller_past_its_deadline_leaves_the_writer_to_a_call_queued_meanwhile(
    server: Ticketd, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone caller whose send deadline has passed by the time it would
    write sends nothing; a call queued while it held the write role is then
    written by the writer thread at once, not left until its own deadline."""
    c = make_client(server.addr, pool_size=1)
    warm = c.acquire("warm", wait=1, lease=5).ticket
    assert warm is not None and warm.release() == "released"
    s = only_session(c)
    assert wait_for(lambda: not s._reader_on)
    now = time.monotonic()
    late = _session.Call(
        _session.ACQUIRE, b"late", _plan.Plan(None, now, now, now), owner=1, lease_s=5
    )
    queued = _session.Call(
        _session.ACQUIRE, b"queued", _plan.transport_plan(now), owner=2, lease_s=5
    )
    real = s._conn.recv_by

    def pre_read(timeout: float) -> bytes | None:
        # The lone caller's first look at the socket: another caller
        # queues meanwhile, while the write role is taken.
        monkeypatch.setattr(s._conn, "recv_by", real)
        assert s.submit(queued)
        return real(timeout)

    monkeypatch.setattr(s._conn, "recv_by", pre_read)
    assert s.run(late) == _session.NOT_SENT
    start = time.monotonic()
    assert s.await_call(queued) == _session.ANSWERED
    assert time.monotonic() - start < 1.0
    assert queued.reply_op == _proto.OP_ACQUIRE
    assert c.release("queued", queued.reply_token) == "released"


def test_a_caller_reading_when_its_session_is_closed_and_reaped_returns_at_once(
    server: Ticketd, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session of a caller that reads for itself is closed and joined
    (as the pool does when it reaps it) just before the caller waits for
    bytes, and a new connection opens at once. The caller still sees the
    end at once: its socket is not closed under it, so it never waits on
    whatever descriptor got the old number."""
    holder = make_client(server.addr)
    held = holder.acquire("held", wait=1, lease=30).ticket
    assert held is not None
    c = make_client(server.addr, pool_size=1)
    warm = c.acquire("warm", wait=1, lease=5).ticket
    assert warm is not None and warm.release() == "released"
    s = only_session(c)
    assert wait_for(lambda: not s._reader_on)
    real = s._conn.recv_by
    opened: list[socket.socket] = []

    def closed_meanwhile(timeout: float) -> bytes | None:
        if timeout > 0 and not opened:
            s.close("closed meanwhile")
            s.join()
            opened.append(socket.create_connection(server.sockaddr))
        return real(timeout)

    monkeypatch.setattr(s._conn, "recv_by", closed_meanwhile)
    call = _session.Call(
        _session.ACQUIRE, b"held", _plan.acquire_plan(time.monotonic(), 3), owner=7, lease_s=5
    )
    start = time.monotonic()
    try:
        assert s.run(call) == _session.LOST
        assert time.monotonic() - start < 1.0
    finally:
        for o in opened:
            o.close()
    assert held.release() == "released"
