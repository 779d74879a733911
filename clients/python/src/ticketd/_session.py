"""One connection to a server: a writer thread, a reader thread, and the
table that matches pipelined replies to the calls waiting for them.

A caller alone on the connection (nothing queued, nothing in flight, no
write under way) does not hand its request to the threads: it writes its
own frame without blocking and takes the *read role*, reading the socket on
its own thread until its reply comes, delivering any other reply it reads
to the caller waiting for it. It then gives the role back: to the reader
thread while other requests are still in flight, else to nobody (the reader
thread sleeps until a write puts a request in flight; after it had replies
to read it goes on reading for :data:`LINGER_S` first). Callers that arrive
while a request is in flight queue for the writer thread, which batches
them into one write; whoever holds the read role reads their replies. One
thread at a time writes to the socket, one at a time reads from it.

A call is *queued* while it sits in the session's queue: not one byte of it
has been handed to the socket, so it can still be withdrawn and retried
elsewhere. Whoever writes it (the writer thread, or its lone caller) marks
it *sent* before its bytes go to the socket, which is the conservative
reading of "may have been sent": from then on it is never sent again (an
Extend may be sent again as a new call, PROTOCOL §5.3; an Acquire or a Release
never). Replies are matched, A/T/B/L by owner, R/N and E/X by token and key,
in any order.

One lock per session guards the queue, the tables and every call's phase,
so "is it still queued?" has one answer for the writer, the reader and the
waiting caller.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Callable

from . import _proto
from ._plan import Plan, transport_plan
from ._transport import CALLER_IO, Plain, Tls

#: Most bytes the writer hands to one ``sendall``: bounds how many queued
#: requests one stalled write turns from "unsent" into "may have been sent".
BATCH_BYTES = 16 * 1024
ACQUIRE = "A"
RELEASE = "R"
EXTEND = "E"

QUEUED = 0
SENT = 1
DONE = 2

#: How a call ended: a reply matched it.
ANSWERED = "answered"
#: Withdrawn before any byte of it reached a socket: safe to retry.
NOT_SENT = "not_sent"
#: It may have been sent and no reply can come any more.
LOST = "lost"

#: How often a reader thread with nothing to read looks whether the
#: session was aborted (:meth:`Session.abort` may not take the lock) and
#: whether the server closed the idle connection.
PARKED_CHECK_S = 0.25
#: How long a reader thread that had replies to read goes on reading after
#: nothing is in flight any more, before it leaves the read role to the
#: next lone caller: requests that follow one another closely then need no
#: wake-up of the reader.
LINGER_S = 0.05

_session_ids = itertools.count(1)


class Call:
    """One request and the caller (if any) waiting for it, on one session."""

    __slots__ = (
        "kind",
        "key",
        "key_str",
        "owner",
        "token",
        "lease_s",
        "limit",
        "mode",
        "plan",
        "phase",
        "written_at",
        "outcome",
        "reply_op",
        "reply_token",
        "reply_limit",
        "cv",
        "on_done",
    )

    def __init__(
        self,
        kind: str,
        key: bytes,
        plan: Plan,
        *,
        owner: int = 0,
        token: int = 0,
        lease_s: int = 0,
        limit: int = 0,
        mode: int = 0,
    ) -> None:
        self.kind = kind
        self.key = key
        self.key_str = key.decode("utf-8")
        self.owner = owner
        self.token = token
        self.lease_s = lease_s
        #: An acquire with places (protocol 1.2): the key's limit and the
        #: mode byte, sent as ``P``; 0 for a plain acquire, sent as ``A``.
        self.limit = limit
        self.mode = mode
        self.plan = plan
        self.phase = QUEUED
        self.written_at = 0.0
        self.outcome: str | None = None
        self.reply_op = 0
        self.reply_token = 0
        #: The key's limit an ``L`` carried (protocol 1.2).
        self.reply_limit = 0
        self.cv: threading.Condition | None = None
        #: Called (under the session lock) when the call ends, for a caller
        #: that does not wait in :meth:`Session.await_call`.
        self.on_done: Callable[[], None] | None = None

    def _finish(self, outcome: str) -> None:
        if self.phase != DONE:
            self.phase = DONE
            self.outcome = outcome
            if self.cv is not None:
                self.cv.notify_all()
            if self.on_done is not None:
                self.on_done()

    def _answer(self, op: int, token: int, limit: int = 0) -> None:
        if self.phase == SENT:
            self.reply_op = op
            self.reply_token = token
            self.reply_limit = limit
            self._finish(ANSWERED)


class Session:
    """A connected socket with its writer and reader threads."""

    def __init__(self, conn: Plain, max_key_bytes: int, peer: str) -> None:
        self.id = next(_session_ids)
        self.peer = peer
        self._conn = conn
        self._max_key_bytes = max_key_bytes
        self._lock = threading.Lock()
        self._writer_cv = threading.Condition(self._lock)
        self._reader_cv = threading.Condition(self._lock)
        self._dead = False
        self._aborted = False
        #: Set when the transport holds bytes of its own for the writer (TLS
        #: records the reader's side produced).
        self._flush = False
        self.why: str | None = None
        self._queue: deque[Call] = deque()
        self._acquires: dict[int, Call] = {}
        self._by_token: dict[tuple[str, int], list[Call]] = {}
        #: The read role: the call whose caller reads on its own thread, or
        #: the reader thread (``_reader_on``), or nobody (neither).
        self._leader: Call | None = None
        #: The session was joined while a caller held the read role: that
        #: caller closes the socket when it leaves.
        self._close_on_leave = False
        #: (Without :data:`CALLER_IO` the reader thread always reads.)
        self._reader_on = not CALLER_IO
        #: A thread (the writer, or a lone caller) is writing to the socket.
        self._writing = False
        #: Socket bytes a lone caller's write left for the writer to send.
        self._pending_out = b""
        #: Received bytes not yet decoded; only the read role touches them.
        self._buf = bytearray()
        self.frames_written = 0
        #: Frames written by their own caller, and replies read by a caller
        #: (rather than by the writer and reader threads).
        self.frames_written_by_callers = 0
        self.replies_read_by_callers = 0
        self.replies_read_by_reader = 0
        self._threads: list[threading.Thread] = []
        if isinstance(conn, Tls):
            conn.on_output = self._wake_writer

    def _wake_writer(self) -> None:
        with self._lock:
            self._flush = True
            self._writer_cv.notify()

    def start(self) -> None:
        """Starts both threads (daemons: they never keep a process alive)."""
        for name, target in (("w", self._writer_loop), ("r", self._reader_loop)):
            t = threading.Thread(target=target, name=f"ticketd-{name}{self.id}", daemon=True)
            self._threads.append(t)
            t.start()

    @property
    def dead(self) -> bool:
        with self._lock:
            return self._dead

    def run(self, call: Call) -> str | None:
        """Sends ``call`` and waits for it to end (see :meth:`await_call`):
        on the caller's own thread when the connection is otherwise idle,
        else through the writer thread. Returns the outcome, or ``None`` if
        the session is already dead (the call is untouched and can go
        elsewhere)."""
        with self._lock:
            if self._dead:
                return None
            lone = (
                CALLER_IO
                and self._leader is None
                and not self._reader_on
                and not self._writing
                and not self._queue
                and not self._flush
                and not self._pending_out
            )
            if lone:
                # No condition: the caller reads for itself and never waits
                # on one.
                self._leader = call
                self._writing = True
        if lone:
            return self._lead(call)
        if not self.submit(call):
            return None
        return self.await_call(call)

    def submit(self, call: Call) -> bool:
        """Queues ``call`` for the writer; ``False`` if the session is already
        dead (the call is untouched and can go elsewhere)."""
        with self._lock:
            if self._dead:
                return False
            call.cv = threading.Condition(self._lock)
            self._queue.append(call)
            self._writer_cv.notify()
            return True

    def await_call(self, call: Call) -> str:
        """Waits for ``call`` (queued here) to end, enforcing its plan:
        withdrawn unsent at its send deadline; given up, with this session
        closed, at its give-up instant if it may have been sent and has no
        reply. Returns the outcome."""
        cv = call.cv
        assert cv is not None, "await_call on a call that was never submitted"
        with self._lock:
            while True:
                ended = self._check_plan_locked(call)
                if ended is not None:
                    return ended
                limit = call.plan.send_deadline if call.phase == QUEUED else call.plan.give_up
                cv.wait(limit - time.monotonic())

    def check(self, call: Call) -> str | None:
        """The outcome of ``call`` (submitted here) if it has ended, else
        ``None``; enforces its plan as :meth:`await_call` does, for a caller
        that does not wait there."""
        with self._lock:
            return self._check_plan_locked(call)

    def _check_plan_locked(self, call: Call) -> str | None:
        """The outcome if ``call`` has ended or its plan ends it now."""
        if call.phase == DONE:
            assert call.outcome is not None
            return call.outcome
        now = time.monotonic()
        limit = call.plan.send_deadline if call.phase == QUEUED else call.plan.give_up
        if now < limit:
            return None
        if call.phase == QUEUED:
            self._queue.remove(call)
            call._finish(NOT_SENT)
            return NOT_SENT
        # Sent and unanswered at the give-up instant. Close exactly this
        # session: a reply can no longer be told apart from a late one, and
        # the server must not keep a queued acquire for a caller that has
        # gone.
        self._close_locked("no reply by the call's deadline")
        return call.outcome or LOST

    # -- a lone caller ------------------------------------------------------

    def _lead(self, call: Call) -> str:
        """Writes ``call`` and reads until it ends, on the caller's thread;
        holds the read role and (until its frame is out) the write role."""
        writing = True
        try:
            # Whatever the server sent while the connection was idle is read
            # first: an end of stream or a reset found here shows the
            # connection dead while the call is still definitely unsent.
            while True:
                try:
                    chunk = self._conn.recv_by(0)
                except OSError as e:
                    return self._unsent_on_dead(call, f"read failed: {e}")
                if chunk is None:
                    break
                if not chunk:
                    return self._unsent_on_dead(call, "connection closed by the server")
                why, _ = self._consume(chunk, True)
                if why is not None:
                    return self._unsent_on_dead(call, why)
            with self._lock:
                if self._dead:
                    call._finish(NOT_SENT)
                    return NOT_SENT
                # The wire wait is computed here, just before the write.
                frame = self._register_locked(call, time.monotonic())
                if frame is None:
                    return NOT_SENT
                self.frames_written_by_callers += 1
            try:
                taken, rest = self._conn.send_nowait(frame)
            except OSError as e:
                self.close(f"write failed: {e}")
                return call.outcome or LOST
            with self._lock:
                self._writing = writing = False
                if not taken:
                    # The socket took not one byte: still unsent, so it
                    # goes first in the queue and the writer sends it (with
                    # its wire wait computed again).
                    self._unregister_locked(call)
                    call.phase = QUEUED
                    self.frames_written -= 1
                    self.frames_written_by_callers -= 1
                    self._queue.appendleft(call)
                self._pending_out = rest
                if self._queue or self._pending_out or self._flush:
                    self._writer_cv.notify()
            return self._read_for(call)
        finally:
            with self._lock:
                if writing:
                    # Nothing was written: a call queued while the write
                    # role was taken is the writer's now.
                    self._writing = False
                    self._writer_cv.notify()
                self._leader = None
                if not self._dead and self._in_flight_locked():
                    self._reader_on = True
                    self._reader_cv.notify()
                close_now, self._close_on_leave = self._close_on_leave, False
            if close_now:
                self._conn.close()

    def _unsent_on_dead(self, call: Call, why: str) -> str:
        with self._lock:
            self._close_locked(why)
            call._finish(NOT_SENT)
        return NOT_SENT

    def _read_for(self, call: Call) -> str:
        """Reads and delivers replies until ``call`` ends (the read role)."""
        while True:
            with self._lock:
                ended = self._check_plan_locked(call)
                if ended is not None:
                    return ended
                limit = call.plan.send_deadline if call.phase == QUEUED else call.plan.give_up
            try:
                chunk = self._conn.recv_by(limit - time.monotonic())
            except OSError as e:
                self.close(f"read failed: {e}")
                continue
            if chunk is None:
                continue
            if not chunk:
                self.close("connection closed by the server")
                continue
            why, _ = self._consume(chunk, True)
            if why is not None:
                self.close(why)

    # -- closing -------------------------------------------------------------

    def close(self, why: str) -> None:
        """Closes the session: queued calls end NOT_SENT, calls that may have
        been sent end LOST, both threads stop."""
        with self._lock:
            self._close_locked(why)

    def _close_locked(self, why: str) -> None:
        if self._dead:
            return
        self._dead = True
        self.why = why
        while self._queue:
            self._queue.popleft()._finish(NOT_SENT)
        for call in self._acquires.values():
            call._finish(LOST)
        self._acquires.clear()
        for calls in self._by_token.values():
            for call in calls:
                call._finish(LOST)
        self._by_token.clear()
        self._writer_cv.notify_all()
        self._reader_cv.notify_all()
        # Wakes the reader (recv returns b"") and a writer blocked in sendall.
        self._conn.shutdown()

    def abort(self) -> None:
        """Shuts the socket down without the session lock; the reader then
        closes the session. For finalisers only."""
        self._aborted = True
        self._conn.shutdown()

    def join(self) -> None:
        """Joins both threads and closes the socket; only after :meth:`close`.
        A caller still holding the read role closes the socket itself when
        it leaves: closed under it, its descriptor's number could go to a
        new connection, and the caller would wait on that one."""
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join()
        with self._lock:
            if self._leader is not None:
                self._close_on_leave = True
                return
        self._conn.close()

    # -- writer ----------------------------------------------------------

    def _writer_loop(self) -> None:
        mine = False
        while True:
            with self._lock:
                if mine:
                    # The last write is done (no caller can have taken the
                    # write role meanwhile: it needs it free).
                    self._writing = mine = False
                while not self._dead and (
                    self._writing or not (self._queue or self._flush or self._pending_out)
                ):
                    self._writer_cv.wait()
                if self._dead:
                    return
                flush, self._flush = self._flush, False
                pending, self._pending_out = self._pending_out, b""
                buf = self._take_batch_locked()
                if not buf and not flush and not pending:
                    continue
                self._writing = mine = True
                if buf and self._leader is None and not self._reader_on:
                    # Requests go in flight with nobody reading: wake the
                    # reader thread before their bytes leave.
                    self._reader_on = True
                    self._reader_cv.notify()
            try:
                if pending:
                    self._conn.send_raw(pending)
                if buf or flush:
                    self._conn.send(buf)
            except OSError as e:
                self.close(f"write failed: {e}")
                return

    def _register_locked(self, call: Call, now: float) -> bytes | None:
        """Encodes ``call`` with its wire wait at ``now`` and enters it in the
        reply tables, marked sent; ``None`` (and NOT_SENT) if its send
        deadline has passed."""
        wait_s = call.plan.wire_wait_at(now)
        if wait_s is None:
            # Reached its deadline unsent: never sent at all.
            call._finish(NOT_SENT)
            return None
        if call.kind == ACQUIRE:
            if call.limit:
                frame = _proto.encode_acquire_with_limit(
                    wait_s, call.lease_s, call.owner, call.limit, call.mode, call.key
                )
            else:
                frame = _proto.encode_acquire(wait_s, call.lease_s, call.owner, call.key)
            old = self._acquires.get(call.owner)
            if old is not None:
                # Owners are fresh per call; should one ever repeat, the
                # older call can no longer be told apart.
                old._finish(LOST)
            self._acquires[call.owner] = call
        elif call.kind == RELEASE:
            frame = _proto.encode_release(call.token, call.key)
            self._by_token.setdefault((RELEASE, call.token), []).append(call)
        else:
            frame = _proto.encode_extend(call.lease_s, call.token, call.key)
            self._by_token.setdefault((EXTEND, call.token), []).append(call)
        call.phase = SENT
        call.written_at = now
        self.frames_written += 1
        return frame

    def _unregister_locked(self, call: Call) -> None:
        if call.kind == ACQUIRE:
            if self._acquires.get(call.owner) is call:
                del self._acquires[call.owner]
            return
        k = (RELEASE if call.kind == RELEASE else EXTEND, call.token)
        calls = self._by_token.get(k)
        if calls and call in calls:
            calls.remove(call)
            if not calls:
                del self._by_token[k]

    def _take_batch_locked(self) -> bytes:
        # The wire wait is computed here, just before the write.
        now = time.monotonic()
        parts: list[bytes] = []
        size = 0
        while self._queue and size < BATCH_BYTES:
            frame = self._register_locked(self._queue.popleft(), now)
            if frame is not None:
                parts.append(frame)
                size += len(frame)
        return b"".join(parts)

    # -- reader ----------------------------------------------------------

    def _in_flight_locked(self) -> bool:
        return bool(self._acquires or self._by_token)

    def _reader_loop(self) -> None:
        #: When nothing was last in flight, if the reader keeps reading.
        idle_since: float | None = None
        while True:
            look = False
            with self._lock:
                while not self._dead and not self._reader_on:
                    if self._aborted:
                        self._close_locked("the client was dropped")
                        break
                    if (
                        not self._reader_cv.wait(PARKED_CHECK_S)
                        and not self._dead
                        and not self._reader_on
                        and self._leader is None
                    ):
                        # Idle a while: take the read role for a moment to
                        # see whether the server closed the connection, so
                        # that a dead session leaves the pool unused.
                        self._reader_on = look = True
                if self._dead:
                    return
                # How long to wait for bytes: 0 for a look, the rest of the
                # lingering time with nothing in flight, else until they come.
                wait: float | None = None
                if look:
                    wait = 0.0
                elif idle_since is not None and not self._in_flight_locked():
                    wait = max(0.0, idle_since + LINGER_S - time.monotonic())
            try:
                chunk = self._conn.recv() if wait is None else self._conn.recv_by(wait)
            except InterruptedError:
                continue
            except OSError as e:
                self.close(f"read failed: {e}")
                return
            idle = True
            if chunk is not None:
                if not chunk:
                    self.close("connection closed by the server")
                    return
                why, idle = self._consume(chunk, False)
                if why is not None:
                    self.close(why)
                    return
            if not CALLER_IO or not idle:
                continue
            with self._lock:
                if self._in_flight_locked():
                    continue
                now = time.monotonic()
                if look or (idle_since is not None and now >= idle_since + LINGER_S):
                    # Nothing more to read: sleep until a write needs it,
                    # so that a lone caller can read for itself.
                    self._reader_on = False
                    idle_since = None
                elif idle_since is None:
                    # Busy a moment ago: keep reading a little while, so
                    # that the next batch needs no wake-up.
                    idle_since = now

    def _consume(self, chunk: bytes, by_caller: bool) -> tuple[str | None, bool]:
        """Decodes every whole reply and delivers them, under one taking of
        the lock (the read role only). Returns why the session must close
        (or ``None``) and whether nothing is in flight any more."""
        buf = self._buf
        buf += chunk
        pos = 0
        replies: list[_proto.Reply] = []
        bad: str | None = None
        while True:
            d = _proto.decode_reply(buf, pos, self._max_key_bytes)
            if d is None:
                break
            if isinstance(d, _proto.Malformed):
                bad = f"malformed reply from the server: {d.reason}"
                break
            pos += d.used
            replies.append(d.reply)
        # Bounded: what stays is at most one incomplete, maximal reply.
        del buf[:pos]
        why: str | None = None
        with self._lock:
            if not self._dead:
                for r in replies:
                    why = self._deliver(r, by_caller)
                    if why is not None:
                        break
            idle = not self._in_flight_locked()
        return why or bad, idle

    def _deliver(self, r: _proto.Reply, by_caller: bool = False) -> str | None:
        """Hands ``r`` to its call (under the lock); why the session must
        close, or ``None``."""
        if by_caller:
            self.replies_read_by_callers += 1
        else:
            self.replies_read_by_reader += 1
        if r.op in (_proto.OP_ACQUIRE, _proto.OP_TIMEOUT, _proto.OP_BUSY, _proto.OP_LIMIT_MISMATCH):
            owner = r.owner if r.op == _proto.OP_ACQUIRE else r.a
            call = self._acquires.pop(owner, None)
            if call is None:
                if r.op == _proto.OP_ACQUIRE:
                    # A grant nobody waits for: give it back at once
                    # rather than leave the key held for a lease.
                    self._enqueue_orphan_release_locked(r.key, r.a)
                return None
            if call.key_str != r.key:
                call._finish(LOST)
                return "reply key does not match the request"
            if r.op == _proto.OP_LIMIT_MISMATCH and not call.limit:
                # An L answers only an Acquire With Limit: a server that
                # sends one for an A cannot be trusted with this call.
                call._finish(LOST)
                return "LimitMismatch reply to a plain acquire"
            call._answer(r.op, r.a, r.limit)
            return None
        kind: str | None
        kind = RELEASE if r.op in (_proto.OP_RELEASE, _proto.OP_NOT_RELEASED) else EXTEND
        calls = self._by_token.get((kind, r.a))
        if not calls:
            return None
        for i, c in enumerate(calls):
            if c.key_str == r.key:
                del calls[i]
                if not calls:
                    del self._by_token[(kind, r.a)]
                c._answer(r.op, r.a)
                break
        return None

    def _enqueue_orphan_release_locked(self, key: str, token: int) -> None:
        call = Call(RELEASE, key.encode("utf-8"), transport_plan(time.monotonic()), token=token)
        call.cv = threading.Condition(self._lock)
        self._queue.append(call)
        self._writer_cv.notify()
