"""The client, its tickets and the keep-alive lock (PROTOCOL §3, §5.3 and §6.3)."""

from __future__ import annotations

import os
import ssl
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

from . import _owner, _plan, _proto
from ._places import Places, check_places
from ._pool import Address, Pool, TlsDial, resolve
from ._session import ACQUIRE, ANSWERED, EXTEND, LOST, NOT_SENT, QUEUED, RELEASE, Call, Session

AcquireOutcome = Literal["acquired", "timeout", "busy", "limit_mismatch", "indeterminate"]
ReleaseOutcome = Literal["released", "not_held", "indeterminate"]
ExtendOutcome = Literal["extended", "lost"]
ExtendTokenOutcome = Literal["extended", "not_held", "indeterminate"]

#: Connections a client keeps by default.
DEFAULT_POOL_SIZE = 2
#: Largest pool accepted.
MAX_POOL_SIZE = 64
#: Default cap on one connection attempt, in seconds.
DEFAULT_CONNECT_TIMEOUT_S = 1.0


class NotAcquired(Exception):
    """Raised by :meth:`Client.lock` when the lock was not acquired.

    ``outcome`` is ``"timeout"``, ``"busy"`` or ``"indeterminate"``; in every
    case the caller must not enter the critical section."""

    def __init__(self, key: str, outcome: AcquireOutcome) -> None:
        super().__init__(f"lock {key!r} not acquired: {outcome}")
        self.key = key
        self.outcome: AcquireOutcome = outcome


class _RetryPause:
    """Pauses between retries of a call whose session died: the first retry
    is immediate, later ones back off (10 ms doubling to 500 ms), so a server
    that accepts and drops connections does not see a connect storm. Never
    sleeps past ``until``."""

    def __init__(self, until: float) -> None:
        self._next = 0.0
        self._until = until

    def pause(self) -> None:
        left = self._until - time.monotonic()
        if left > 0 and self._next > 0:
            time.sleep(min(self._next, left))
        self._next = min(max(self._next * 2, 0.01), 0.5)


class AcquireResult:
    """What :meth:`Client.acquire` returns: ``outcome``, ``ticket`` when the
    outcome is ``"acquired"`` (else ``None``), and ``limit``, the limit the
    key is registered with, when the outcome is ``"limit_mismatch"`` (an
    acquire with places only, protocol 1.2; else ``None``)."""

    __slots__ = ("outcome", "ticket", "limit")

    def __init__(
        self, outcome: AcquireOutcome, ticket: Ticket | None = None, limit: int | None = None
    ) -> None:
        self.outcome: AcquireOutcome = outcome
        self.ticket: Ticket | None = ticket
        self.limit: int | None = limit

    @property
    def acquired(self) -> bool:
        """Whether the lock is held (``outcome == "acquired"``)."""
        return self.ticket is not None

    def __repr__(self) -> str:
        if self.limit is not None:
            return f"AcquireResult(outcome={self.outcome!r}, limit={self.limit})"
        return f"AcquireResult(outcome={self.outcome!r}, ticket={self.ticket!r})"


class Ticket:
    """A lock this process holds, as granted by the server.

    Pass :attr:`token` to the resource you guard: tokens only grow, so the
    resource can reject a request carrying a token lower than one it has
    seen. :attr:`expires_at` (on ``time.monotonic()``) is conservative: the
    moment the acquire (or the last successful extend) was handed to the
    socket, plus the lease, so the server's lease always ends later.

    :attr:`lost` is a ``threading.Event`` set the moment the ticket is known
    lost: an extend answered ``X``, or the conservative expiry reached while
    a keep-alive (:meth:`Client.lock`) was renewing it. A holder told "lost"
    must stop using the token.

    A ticket that is garbage collected while still held is released in the
    background; :meth:`release` releases it and reports the outcome;
    :meth:`detach` stops managing it."""

    def __init__(
        self, client: Client, key: str, key_raw: bytes, token: int, lease_s: int, expires_at: float
    ) -> None:
        self._client = client
        self._key = key
        self._key_raw = key_raw
        self._token = token
        self._lease_s = lease_s
        self._expires_at = expires_at
        #: When the request that set the expiry (the acquire, or the last
        #: Extend answered E) was written.
        self._renewed_at = expires_at - lease_s
        self._extend_lock = threading.Lock()
        self._armed = True
        self._released = False
        self.lost = threading.Event()

    @property
    def key(self) -> str:
        """The key this ticket holds."""
        return self._key

    @property
    def token(self) -> int:
        """The fencing token of the grant (an extension keeps it)."""
        return self._token

    @property
    def lease(self) -> int:
        """The lease, in seconds, of the grant or of its last extension."""
        return self._lease_s

    @property
    def expires_at(self) -> float:
        """When the lock must be considered lost, on ``time.monotonic()``."""
        return self._expires_at

    def remaining(self) -> float:
        """Seconds left until :attr:`expires_at`, 0 once it has passed."""
        return max(0.0, self._expires_at - time.monotonic())

    def is_expired(self) -> bool:
        """Whether :attr:`expires_at` has passed."""
        return time.monotonic() >= self._expires_at

    def is_lost(self) -> bool:
        """Whether the token must not be used any more: :attr:`lost` is set
        or :attr:`expires_at` has passed."""
        return self.lost.is_set() or self.is_expired()

    def extend(self, lease: float | None = None) -> ExtendOutcome:
        """Renews the grant for ``lease`` seconds (default: the current
        :attr:`lease`); needs a protocol 1.1 server. Returns ``"extended"``
        (the expiry is now the time the answered Extend was written plus
        ``lease``) or ``"lost"`` (an ``X``, or no ``E`` before the current
        expiry); once lost, always lost. A lease shorter than the time left
        counts at once, answered or not: from the call on, the expiry is no
        later than the call's start plus ``lease``. Bad arguments raise before anything
        is sent, and so does nothing once the local expiry has passed."""
        lease_s = self._lease_s if lease is None else _plan.lease_s(lease)
        with self._extend_lock:
            # A shorter lease may take effect on the server before its
            # answer comes back: from now on the expiry is no later than
            # now + lease.
            if not self.lost.is_set() and time.monotonic() < self._expires_at:
                self._expires_at = min(self._expires_at, time.monotonic() + lease_s)
            return self._extend_locked(lease_s, self._expires_at)

    def _extend_locked(
        self, lease_s: int, until: float, stop: threading.Event | None = None
    ) -> ExtendOutcome:
        if self._released:
            # Released by its holder: not held, but nothing was lost.
            return "lost"
        if self.lost.is_set() or time.monotonic() >= self._expires_at:
            # Expired locally or lost before: lost for good, nothing sent.
            self._mark_lost()
            return "lost"
        got = self._client._extend_until(self._key_raw, self._token, lease_s, until, stop)
        if got is None:
            if stop is not None and stop.is_set():
                # The keep-alive was stopped between attempts: its holder
                # is releasing the lock, nothing was lost.
                return "lost"
            self._mark_lost()
            return "lost"
        # Counted from the write, never from the reply.
        self._renewed_at = got
        self._expires_at = got + lease_s
        self._lease_s = lease_s
        return "extended"

    def release(self) -> ReleaseOutcome:
        """Releases the lock and waits for the outcome (at most the 5 s
        transport deadline). ``"indeterminate"`` also covers "no server
        reachable, nothing sent": the lease ends the lock then."""
        self._armed = False
        self._released = True
        return self._client._release_raw(self._key_raw, self._token)

    def _release_in_background(self) -> None:
        self._armed = False
        self._released = True
        self._client._release_in_background(self._key_raw, self._token)

    def detach(self) -> tuple[str, int]:
        """Stops managing the lock without releasing it; returns key and
        token. The lease, or :meth:`Client.release`, ends it."""
        self._armed = False
        return self._key, self._token

    def _mark_lost(self) -> None:
        self.lost.set()

    def __del__(self) -> None:
        try:
            if self._armed:
                self._armed = False
                self._client._release_in_background(self._key_raw, self._token)
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        return (
            f"Ticket(key={self._key!r}, token={self._token}, lease={self._lease_s}, "
            f"remaining={self.remaining():.3f})"
        )


class Client:
    """A thread-safe handle on a small pool of connections to a ticketd
    server, or to the nodes of a cluster.

    ``address`` is ``"host:port"``, ``"unix:/path"``, or a list of them
    (connections rotate over them and skip the ones that do not answer).
    Addresses are resolved here; connections open lazily, on the first call
    that needs one. A bad setting raises ``ValueError`` / ``TypeError``.

    TLS (1.3 or 1.2) to every TCP address: ``tls_ca`` (a PEM file of the CA
    certificates to trust), with ``tls_cert`` and ``tls_key`` for servers
    that ask for a client certificate (``ticketd --tls-client-ca``) and
    ``tls_server_name`` to check every server's certificate against that
    name instead of each address's host; or a ready ``ssl_context``. Unix
    socket addresses stay plaintext."""

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        pool_size: int = DEFAULT_POOL_SIZE,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        max_key_bytes: int = _plan.DEFAULT_MAX_KEY_BYTES,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_server_name: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        texts = [address] if isinstance(address, str) else list(address)
        if not texts:
            raise ValueError("no server address was given")
        if isinstance(pool_size, bool) or not isinstance(pool_size, int):
            raise TypeError("pool_size must be an int")
        if not 1 <= pool_size <= MAX_POOL_SIZE:
            raise ValueError(f"pool_size must be within 1..={MAX_POOL_SIZE}")
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, (int, float)):
            raise TypeError("connect_timeout must be a number of seconds")
        if not connect_timeout > 0:
            raise ValueError("connect_timeout must be above zero")
        if isinstance(max_key_bytes, bool) or not isinstance(max_key_bytes, int):
            raise TypeError("max_key_bytes must be an int")
        if not 1 <= max_key_bytes <= _plan.MAX_KEY_BYTES_CEILING:
            raise ValueError(f"max_key_bytes must be within 1..={_plan.MAX_KEY_BYTES_CEILING}")
        tls = _tls_dial(tls_ca, tls_cert, tls_key, tls_server_name, ssl_context)
        addrs: list[Address] = []
        for t in texts:
            addrs.extend(resolve(t))
        self._max_key_bytes = max_key_bytes
        self._pool = Pool(addrs, pool_size, float(connect_timeout), max_key_bytes, tls)
        # A client dropped without close() still ends its connections and
        # their threads (tickets and background releases keep it alive).
        weakref.finalize(self, self._pool.abandon)
        self._bg_lock = threading.Lock()
        self._bg_queue: deque[tuple[bytes, int, _plan.Plan]] = deque()
        self._bg_running = False
        self._renewer = _Renewer(self._pool)

    # -- public API -------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """The resolved addresses, as ``host:port`` or the unix path."""
        return [a.text for a in self._pool.addrs]

    @property
    def last_connect_error(self) -> str | None:
        """The last connection failure, if any: explains a ``"timeout"`` that
        came from an unreachable server rather than from a held key."""
        return self._pool.last_error

    def connected_sessions(self) -> int:
        """Connections currently open, for diagnostics."""
        return len(self._pool.live())

    def acquire(self, key: str, wait: float = 10, lease: float = 30) -> AcquireResult:
        """Asks for ``key``, queueing up to ``wait`` seconds (fractions
        allowed, clamped to 255) for a grant that lives ``lease`` seconds
        (whole, 1..=255). Returns within ``wait`` + 1 s (5 s for ``wait=0``).
        Raises only for bad arguments, before anything is sent."""
        return self.acquire_with(key, None, wait, lease)

    def acquire_permit(
        self, key: str, limit: int, wait: float = 10, lease: float = 30
    ) -> AcquireResult:
        """One permit of ``key`` as a counting semaphore of ``limit`` places
        (protocol 1.2, PROTOCOL §6): at most ``limit`` holders at once, each
        with a ticket of its own. ``"limit_mismatch"`` (with
        ``result.limit``) when the key is registered with another limit. As
        :meth:`acquire` otherwise; a limit of 0 raises ``ValueError``."""
        return self.acquire_with(key, Places.semaphore(limit), wait, lease)

    def acquire_shared(self, key: str, wait: float = 10, lease: float = 30) -> AcquireResult:
        """A reader's place in the read/write lock ``key`` (protocol 1.2):
        held beside other readers, never beside a writer, and not before a
        writer that queued first. As :meth:`acquire` otherwise."""
        return self.acquire_with(key, Places.shared(), wait, lease)

    def acquire_exclusive(self, key: str, wait: float = 10, lease: float = 30) -> AcquireResult:
        """A writer's hold of the read/write lock ``key`` (protocol 1.2):
        alone, after every reader and writer that queued first. As
        :meth:`acquire` otherwise."""
        return self.acquire_with(key, Places.exclusive(), wait, lease)

    def acquire_with(
        self, key: str, places: Places | None, wait: float = 10, lease: float = 30
    ) -> AcquireResult:
        """The general acquire: with ``places``, one of ``places.limit``
        places in ``places.mode``, sent as an Acquire With Limit (protocol
        1.2); with ``None``, a mutex (:meth:`acquire`). A server older than
        1.2 closes the connection on an Acquire With Limit, so the outcome
        there is ``"indeterminate"``. Raises only for bad arguments (a limit
        of 0 among them), before anything is sent."""
        raw = _plan.check_key(key, self._max_key_bytes)
        lease_s = _plan.lease_s(lease)
        wait_n = _plan.normalise_wait(wait)
        limit, mode = check_places(places) if places is not None else (0, 0)
        self._check_open()
        plan = _plan.acquire_plan(time.monotonic(), wait_n)
        owner = _owner.next_owner()
        backoff = _RetryPause(plan.send_deadline)
        while True:
            # Retried only from here, and only while definitely unsent: same
            # owner, same plan, another session.
            session = self._pool.get(plan.send_deadline)
            if session is None:
                return AcquireResult("timeout")
            call = Call(ACQUIRE, raw, plan, owner=owner, lease_s=lease_s, limit=limit, mode=mode)
            outcome = session.run(call)
            if outcome is None or outcome == NOT_SENT:
                backoff.pause()
                continue
            if outcome == LOST:
                return AcquireResult("indeterminate")
            if call.reply_op == _proto.OP_TIMEOUT:
                return AcquireResult("timeout")
            if call.reply_op == _proto.OP_BUSY:
                return AcquireResult("busy")
            if call.reply_op == _proto.OP_LIMIT_MISMATCH:
                # Final: never retried with another limit.
                return AcquireResult("limit_mismatch", limit=call.reply_limit)
            # The handover gate: a grant seen after D is not handed to a
            # caller who was promised an answer by D.
            if time.monotonic() > plan.gate:
                self._release_in_background(raw, call.reply_token)
                return AcquireResult("indeterminate")
            t = Ticket(self, key, raw, call.reply_token, lease_s, call.written_at + lease_s)
            return AcquireResult("acquired", t)

    def release(self, key: str, token: int) -> ReleaseOutcome:
        """Releases ``token`` on ``key``, from any process: locks belong to
        tokens, not connections. Waits at most the 5 s transport deadline."""
        raw = _plan.check_key(key, self._max_key_bytes)
        _check_token(token)
        return self._release_raw(raw, token)

    def extend(self, key: str, token: int, lease: float) -> ExtendTokenOutcome:
        """Extends the grant ``token`` of ``key`` to live ``lease`` seconds
        from about now, from any process, under the 5 s transport deadline
        (protocol 1.1). ``"extended"``, ``"not_held"`` (``X``: gone, not this
        token, or capped) or ``"indeterminate"`` (no reply in time). A holder
        of a :class:`Ticket` calls :meth:`Ticket.extend` instead, which keeps
        the conservative expiry."""
        raw = _plan.check_key(key, self._max_key_bytes)
        _check_token(token)
        lease_s = _plan.lease_s(lease)
        until = time.monotonic() + _plan.TRANSPORT_DEADLINE_S
        x = self._extend_attempts(raw, token, lease_s, until)
        if isinstance(x, float):
            return "extended"
        return "not_held" if x == "x" else "indeterminate"

    @contextmanager
    def lock(
        self, key: str, wait: float = 10, lease: float = 30, renew_every: float | None = None
    ) -> Iterator[Ticket]:
        """Acquires ``key`` (raising :class:`NotAcquired` if not acquired),
        renews it in the background every ``renew_every`` seconds (default a
        third of the lease; needs a protocol 1.1 server) and releases it on
        exit, also when the body raises. ``ticket.lost`` is set the moment
        the lock is lost: an ``X``, or no ``E`` by the renewal deadline, a
        tenth of the lease before the conservative expiry."""
        lease_s = _plan.lease_s(lease)
        if renew_every is not None:
            if isinstance(renew_every, bool) or not isinstance(renew_every, (int, float)):
                raise TypeError("renew_every must be a number of seconds")
            if not 0 < renew_every < 0.9 * lease_s:
                raise ValueError(
                    "renew_every must be above zero and below the renewal deadline "
                    "(nine tenths of the lease)"
                )
        res = self.acquire(key, wait, lease_s)
        t = res.ticket
        if t is None:
            raise NotAcquired(key, res.outcome)
        every = float(renew_every) if renew_every is not None else lease_s / 3.0
        renewal = self._renewer.add(t, every)
        if renewal is None:
            # No thread, no renewals: the holder must know at once.
            t._mark_lost()
        try:
            yield t
        finally:
            # Stop renewing (waiting for an attempt in flight, at most the
            # transport deadline), then release.
            if renewal is not None:
                self._renewer.stop(renewal)
            if t.lost.is_set():
                # Lost (an X, or no E by the renewal deadline: the server
                # is gone or cut off): its lease ends it within a tenth of
                # a lease. The release goes to the background, so the block
                # does not wait out the transport deadline for a server
                # that is not there.
                t._release_in_background()
            else:
                t.release()

    def close(self) -> None:
        """Closes every connection and joins their threads. Later acquires
        raise ``RuntimeError``; held locks end with their leases."""
        with self._bg_lock:
            self._bg_queue.clear()
        self._pool.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.addresses!r})"

    # -- internals ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._pool.closed:
            raise RuntimeError("the client is closed")

    def _release_raw(self, raw: bytes, token: int) -> ReleaseOutcome:
        return self._release_plan(raw, token, _plan.transport_plan(time.monotonic()))

    def _release_plan(self, raw: bytes, token: int, plan: _plan.Plan) -> ReleaseOutcome:
        backoff = _RetryPause(plan.send_deadline)
        while True:
            session = self._pool.get(plan.send_deadline)
            if session is None:
                # Nothing was sent; the lease ends the lock.
                return "indeterminate"
            call = Call(RELEASE, raw, plan, token=token)
            outcome = session.run(call)
            if outcome is None or outcome == NOT_SENT:
                backoff.pause()
                continue
            if outcome != ANSWERED:
                return "indeterminate"
            return "released" if call.reply_op == _proto.OP_RELEASE else "not_held"

    def _extend_until(
        self,
        raw: bytes,
        token: int,
        lease_s: int,
        until: float,
        stop: threading.Event | None = None,
    ) -> float | None:
        """Sends the Extend until an ``E`` or ``X`` matches or ``until``
        passes; the write time of the attempt answered ``E``, else ``None``
        (``X``, or no answer by ``until``). An attempt with no reply within
        the transport deadline is given up (its connection closed) and sent
        again elsewhere: applying it twice only moves the caller's own
        expiry. An ``E`` matched at or after ``until`` counts for nothing.
        ``stop`` set ends the attempts before the next one."""
        x = self._extend_attempts(raw, token, lease_s, until, stop)
        return x if isinstance(x, float) else None

    def _extend_attempts(
        self,
        raw: bytes,
        token: int,
        lease_s: int,
        until: float,
        stop: threading.Event | None = None,
    ) -> float | Literal["x", "no_answer"]:
        backoff = _RetryPause(until)
        while True:
            now = time.monotonic()
            if now >= until or self._pool.closed or (stop is not None and stop.is_set()):
                return "no_answer"
            plan = _plan.extend_plan(now, until)
            session = self._pool.get(plan.send_deadline)
            if session is None:
                backoff.pause()
                continue
            call = Call(EXTEND, raw, plan, token=token, lease_s=lease_s)
            if session.run(call) == ANSWERED:
                if call.reply_op == _proto.OP_NOT_EXTENDED:
                    return "x"
                if time.monotonic() < until:
                    return call.written_at
            # Not sent, sent into a connection that died, or no reply in
            # time: the next round gives up or sends it again.
            backoff.pause()

    def _release_in_background(self, raw: bytes, token: int) -> None:
        """Queues a release nobody waits for; a short-lived thread works the
        queue and ends when it is empty. The transport deadline runs from
        now, so a backlog with no server reachable is given up within 5 s."""
        if self._pool.closed:
            return
        with self._bg_lock:
            self._bg_queue.append((raw, token, _plan.transport_plan(time.monotonic())))
            if self._bg_running:
                return
            self._bg_running = True
        try:
            threading.Thread(target=self._bg_loop, name="ticketd-release", daemon=True).start()
        except RuntimeError:
            # No thread to spare: the leases reclaim these locks instead.
            with self._bg_lock:
                self._bg_running = False
                self._bg_queue.clear()

    def _bg_loop(self) -> None:
        while True:
            with self._bg_lock:
                if not self._bg_queue:
                    self._bg_running = False
                    return
                raw, token, plan = self._bg_queue.popleft()
            self._release_plan(raw, token, plan)

    def _background_busy(self) -> bool:
        with self._bg_lock:
            return self._bg_running


def _tls_dial(
    ca: str | os.PathLike[str] | None,
    cert: str | os.PathLike[str] | None,
    key: str | os.PathLike[str] | None,
    server_name: str | None,
    context: ssl.SSLContext | None,
) -> TlsDial | None:
    """The TLS settings, with the files read now; ``ValueError`` for a file
    that cannot be read or a combination that makes no sense."""
    if server_name is not None and (not isinstance(server_name, str) or not server_name):
        raise ValueError("tls_server_name must be a non-empty str")
    if context is not None:
        if not isinstance(context, ssl.SSLContext):
            raise TypeError("ssl_context must be an ssl.SSLContext")
        if ca is not None or cert is not None or key is not None:
            raise ValueError("give either ssl_context or tls_ca/tls_cert/tls_key, not both")
        return TlsDial(context, server_name)
    if ca is None:
        if cert is not None or key is not None or server_name is not None:
            raise ValueError("a client certificate or a server name without a CA file (tls_ca)")
        return None
    if (cert is None) != (key is None):
        raise ValueError("tls_cert and tls_key go together")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=os.fspath(ca))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert is not None and key is not None:
            ctx.load_cert_chain(os.fspath(cert), os.fspath(key))
    except (OSError, ValueError) as e:
        raise ValueError(f"TLS settings: {e}") from None
    return TlsDial(ctx, server_name)


def _check_token(token: int) -> None:
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"token must be an int, not {type(token).__name__}")
    if not 0 <= token < 1 << 64:
        raise ValueError(f"token {token} is not a 64-bit unsigned integer")


class _Renewal:
    """One :meth:`Client.lock` keep-alive, worked by the client's renewer."""

    __slots__ = (
        "ticket",
        "every",
        "stopping",
        "done",
        "renewing",
        "until",
        "call",
        "session",
        "retry_at",
        "pause",
        "connecting",
        "connected",
    )

    def __init__(self, ticket: Ticket, every: float) -> None:
        self.ticket = ticket
        self.every = every
        #: Set (under the renewer's lock) when the holder leaves the block.
        self.stopping = False
        #: Set once the renewer is done with it: nothing of it in flight.
        self.done = threading.Event()
        #: A renewal is under way: the ticket's extend lock is held, as a
        #: call to :meth:`Ticket.extend` would hold it.
        self.renewing = False
        #: The renewal deadline of the renewal under way.
        self.until = 0.0
        self.call: Call | None = None
        self.session: Session | None = None
        self.retry_at = 0.0
        self.pause = 0.0
        #: A thread is opening a connection for the next attempt; then the
        #: session it found (or ``None``). Both under the renewer's lock.
        self.connecting = False
        self.connected: Session | None = None


class _Renewer:
    """One thread per client renewing every :meth:`Client.lock` ticket.

    Each ticket is renewed with its own lease every ``every`` seconds,
    counted from the write of the grant or of the last extension answered
    ``E``. A renewal must be answered by its *renewal deadline*, a tenth of
    the lease before the conservative expiry; otherwise, or on an ``X``,
    ``ticket.lost`` is set while the lease still runs and that ticket's
    renewals end. An attempt with no reply within the transport deadline is
    given up (its connection closed) and sent again, as
    :meth:`Ticket.extend` does. Attempts are queued on a connection and
    watched, never waited for, so one ticket's stalled renewal never delays
    another's; nor does opening a connection, which a short-lived thread
    does when none is open. The thread runs while any keep-alive does."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._entries: list[_Renewal] = []
        self._running = False
        self._kicked = False
        #: The pause after a connection attempt for the renewals that found
        #: nothing reachable; doubles while they keep failing.
        self._connect_pause = 0.0

    def add(self, t: Ticket, every: float) -> _Renewal | None:
        """Starts renewing ``t``; ``None`` if no thread could be started."""
        r = _Renewal(t, every)
        with self._lock:
            self._entries.append(r)
            self._kicked = True
            self._cv.notify()
            if self._running:
                return r
            self._running = True
        try:
            threading.Thread(target=self._loop, name="ticketd-renew", daemon=True).start()
        except RuntimeError:
            with self._lock:
                self._running = False
                self._entries.remove(r)
            return None
        return r

    def stop(self, r: _Renewal) -> None:
        """Ends the renewals of ``r``, waiting for an attempt in flight."""
        with self._lock:
            r.stopping = True
            self._kicked = True
            self._cv.notify()
        r.done.wait()

    def kick(self) -> None:
        """An attempt ended (called under its session's lock)."""
        with self._lock:
            self._kicked = True
            self._cv.notify()

    def running(self) -> bool:
        with self._lock:
            return self._running

    def _connect(self, r: _Renewal, slot: int, send_deadline: float) -> bool:
        """Has a short-lived thread fill the pool's claimed ``slot`` for the
        next attempt of ``r``; ``False`` (with the slot given back) if no
        thread could be started."""
        with self._lock:
            r.connecting = True
        try:
            threading.Thread(
                target=self._connect_slot,
                args=(r, slot, send_deadline),
                name="ticketd-connect",
                daemon=True,
            ).start()
        except RuntimeError:
            with self._lock:
                r.connecting = False
            self._pool.unclaim(slot)
            return False
        return True

    def _connect_slot(self, r: _Renewal, slot: int, send_deadline: float) -> None:
        got: Session | None = None
        try:
            got = self._pool.fill(slot, send_deadline)
            with self._lock:
                pause = self._connect_pause
                self._connect_pause = 0.0 if got is not None else min(max(pause * 2, 0.01), 0.5)
            if got is None:
                # Nothing reachable: pause before the next attempt claims
                # the slot again, as Pool.get does, never past the deadline.
                time.sleep(max(0.0, min(pause, send_deadline - time.monotonic())))
        finally:
            with self._lock:
                # What Pool.get would have returned: that attempt goes there.
                r.connected = got
                r.connecting = False
                self._kicked = True
                self._cv.notify()

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    self._entries = [r for r in self._entries if not r.done.is_set()]
                    if not self._entries:
                        self._running = False
                        return
                    entries = list(self._entries)
                    self._kicked = False
                # Never under our lock: a session calls kick() under its own.
                wake = min(self._step(r) for r in entries)
                if wake == float("inf"):
                    # Every one of them ended: look at the list again.
                    continue
                with self._lock:
                    if not self._kicked:
                        self._cv.wait(max(0.0, wake - time.monotonic()))
        except BaseException:
            # Never leave a holder believing in renewals that stopped.
            with self._lock:
                for r in self._entries:
                    r.ticket._mark_lost()
                    r.done.set()
                self._entries = []
                self._running = False
            raise

    def _end(self, r: _Renewal, lost: bool) -> float:
        if lost:
            r.ticket._mark_lost()
        if r.renewing:
            r.renewing = False
            r.ticket._extend_lock.release()
        r.done.set()
        return float("inf")

    def _step(self, r: _Renewal) -> float:
        """Moves ``r`` on; returns when it next needs the thread."""
        t = r.ticket
        if r.call is not None:
            assert r.session is not None
            outcome = r.session.check(r.call)
            if outcome is None:
                c = r.call
                return c.plan.send_deadline if c.phase == QUEUED else c.plan.give_up
            call, r.call, r.session = r.call, None, None
            now = time.monotonic()
            if outcome == ANSWERED:
                if call.reply_op == _proto.OP_NOT_EXTENDED:
                    return self._end(r, lost=True)
                if now < r.until:
                    # Counted from the write, never from the reply.
                    t._renewed_at = call.written_at
                    t._expires_at = call.written_at + call.lease_s
                    r.renewing = False
                    t._extend_lock.release()
                    return self._step(r)
            # Not sent, sent into a connection that died, no reply in time,
            # or an E too late to count: sent again after a pause.
            r.retry_at = now + r.pause
            r.pause = min(max(r.pause * 2, 0.01), 0.5)
        now = time.monotonic()
        if r.renewing:
            if r.stopping:
                # Stopped between attempts: the holder is releasing.
                return self._end(r, lost=False)
            if now >= r.until or self._pool.closed:
                return self._end(r, lost=True)
            if now < r.retry_at:
                return min(r.retry_at, r.until)
            plan = _plan.extend_plan(now, r.until)
            with self._lock:
                if r.connecting:
                    # Kicked when that connection attempt ends.
                    return r.until
                fresh, r.connected = r.connected, None
            got: Session | int | None = fresh
            if fresh is None or fresh.dead:
                got = self._pool.get_nowait()
            if got is None and not self._pool.closed:
                # Someone else is connecting: look again shortly.
                return min(now + 0.02, r.until)
            if isinstance(got, int):
                if self._connect(r, got, plan.send_deadline):
                    # Opening a connection may take the whole connect
                    # timeout: another thread does it, and kicks this one
                    # when it is done, so every other lock is still told
                    # lost in time.
                    return r.until
                got = None
            session = got
            call = Call(EXTEND, t._key_raw, plan, token=t._token, lease_s=t._lease_s)
            call.on_done = self.kick
            if session is None or not session.submit(call):
                r.retry_at = time.monotonic() + r.pause
                r.pause = min(max(r.pause * 2, 0.01), 0.5)
                return min(r.retry_at, r.until)
            r.call, r.session = call, session
            return plan.give_up
        if r.stopping:
            return self._end(r, lost=False)
        wake = t._renewed_at + r.every
        if now < wake:
            return wake
        if not t._extend_lock.acquire(blocking=False):
            # The holder is extending it right now: look again shortly.
            return now + 0.01
        r.renewing = True
        if t._released:
            return self._end(r, lost=False)
        r.until = t._expires_at - t._lease_s / 10.0
        if t.lost.is_set() or now >= r.until:
            return self._end(r, lost=True)
        r.retry_at = now
        r.pause = 0.0
        return self._step(r)
