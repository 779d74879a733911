"""A small pool of sessions shared by every thread using one client.

Slots fill lazily, one connection each, round-robin over the server
addresses; a dead session is reaped the next time anyone looks for a
session, so the pool never holds more than ``size`` connections. Finding a
session never blocks past the caller's send deadline: connecting is capped
by it, and with nothing reachable the caller backs off and tries again until
the deadline passes.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Any, NamedTuple

from ._session import Session
from ._transport import Plain, Tls

FIRST_BACKOFF_S = 0.01
MAX_BACKOFF_S = 0.5

_CONNECTING = "connecting"


class Address(NamedTuple):
    """One place to connect to: a resolved TCP address or a unix socket path."""

    family: int
    sockaddr: tuple[Any, ...] | str
    text: str
    #: The host as given (without brackets): the name a TLS server's
    #: certificate is checked against. Empty for a unix socket.
    host: str = ""


def resolve(text: str) -> list[Address]:
    """Turns ``host:port``, ``[v6]:port`` or ``unix:/path`` into addresses.
    Raises ``ValueError`` for a malformed or unresolvable address."""
    if not isinstance(text, str):
        raise TypeError(f"a server address must be str, not {type(text).__name__}")
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if not path:
            raise ValueError(f"server address {text!r} has no socket path")
        if not hasattr(socket, "AF_UNIX"):
            raise ValueError(f"server address {text!r}: unix sockets are not available here")
        return [Address(socket.AF_UNIX, path, text)]
    host, sep, port_s = text.rpartition(":")
    if not sep or not host or not port_s:
        raise ValueError(f"server address {text!r} is not host:port or unix:/path")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_s, 10)
    except ValueError:
        raise ValueError(f"server address {text!r} has no valid port") from None
    if not 0 < port < 65536:
        raise ValueError(f"server address {text!r} has a port out of range")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"cannot resolve server address {text!r}: {e}") from None
    out: list[Address] = []
    for family, _, _, _, sockaddr in infos:
        a = Address(family, sockaddr, text, host)
        if a not in out:
            out.append(a)
    if not out:
        raise ValueError(f"cannot resolve server address {text!r}: no address found")
    return out


class TlsDial(NamedTuple):
    """How to speak TLS to the TCP addresses."""

    context: ssl.SSLContext
    #: Checked against every server's certificate instead of each host.
    server_name: str | None


def _connect(addr: Address, timeout: float, max_key_bytes: int, tls: TlsDial | None) -> Session:
    """Connects (and, over TCP with ``tls``, runs the TLS handshake), all
    within ``timeout``; raises ``OSError`` (``ssl.SSLError`` among them)."""
    deadline = time.monotonic() + timeout
    sock = socket.socket(addr.family, socket.SOCK_STREAM)
    conn: Plain
    try:
        sock.settimeout(timeout)
        sock.connect(addr.sockaddr)
        unix = addr.family == getattr(socket, "AF_UNIX", None)
        if not unix:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None and not unix:
            t = Tls(sock, tls.context, tls.server_name or addr.host)
            # The rest of the connect timeout bounds the handshake.
            t.handshake(deadline)
            conn = t
        else:
            conn = Plain(sock)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    s = Session(conn, max_key_bytes, addr.text)
    try:
        s.start()
    except BaseException:
        s.close("cannot start the session's threads")
        sock.close()
        raise
    return s


class Pool:
    """Up to ``size`` sessions over ``addrs``."""

    def __init__(
        self,
        addrs: list[Address],
        size: int,
        connect_timeout: float,
        max_key_bytes: int,
        tls: TlsDial | None = None,
    ) -> None:
        self.addrs = addrs
        self._tls = tls
        self._connect_timeout = connect_timeout
        self._max_key_bytes = max_key_bytes
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._slots: list[None | str | Session] = [None] * size
        self._rr = 0
        self._next_addr = 0
        self.last_error: str | None = None
        self.closed = False
        #: Dead sessions taken out of their slots but not yet joined.
        self._unjoined: list[Session] = []

    def live(self) -> list[Session]:
        with self._lock:
            return [s for s in self._slots if isinstance(s, Session) and not s.dead]

    def get_nowait(self) -> Session | int | None:
        """What :meth:`get` would pick, without ever blocking: a live
        session; or the index of the empty slot whose turn it is, now
        claimed, which the caller has filled by a thread that may block
        (:meth:`fill`); or ``None`` (the pool is closed, or someone else is
        connecting with nothing live: look again shortly). Dead sessions
        are taken out here and joined by the next :meth:`fill`."""
        with self._lock:
            if self.closed:
                return None
            self._unjoined += self._reap_locked()
            return self._pick_locked(0.0)

    def fill(self, i: int, send_deadline: float) -> Session | None:
        """Connects the slot ``i`` claimed by :meth:`get_nowait` (blocking,
        as :meth:`get` does); the session, or ``None``."""
        with self._lock:
            dead, self._unjoined = self._unjoined, []
        for d in dead:
            d.join()
        return self._fill(i, send_deadline)

    def unclaim(self, i: int) -> None:
        """Gives back the slot ``i`` claimed by :meth:`get_nowait` unfilled."""
        with self._lock:
            self._slots[i] = None
            self._cv.notify_all()

    def get(self, send_deadline: float) -> Session | None:
        """A live session, connecting one if the next slot is empty; ``None``
        once ``send_deadline`` passes with none found (or the pool is closed)."""
        backoff = FIRST_BACKOFF_S
        while True:
            now = time.monotonic()
            if now >= send_deadline:
                return None
            with self._lock:
                if self.closed:
                    return None
                dead = self._reap_locked()
                if not dead:
                    got = self._pick_locked(min(send_deadline - now, MAX_BACKOFF_S))
                    if isinstance(got, Session):
                        return got
                    slot = -1 if got is None else got
                else:
                    slot = -1
            if dead:
                for s in dead:
                    s.join()
                continue
            if slot >= 0:
                found = self._fill(slot, send_deadline)
                if found is not None:
                    return found
                if self.closed:
                    return None
                # Nothing reachable: pause, never past the deadline.
                left = send_deadline - time.monotonic()
                if left > 0:
                    time.sleep(min(backoff, left))
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _pick_locked(self, wait_s: float) -> Session | int | None:
        """The slot whose turn it is: its live session, or its index, now
        claimed for this caller to fill; or, when someone else is connecting
        it, any other live session, else ``None`` after waiting up to
        ``wait_s`` for them (rather than open a connection per caller)."""
        i = self._rr % len(self._slots)
        self._rr += 1
        slot = self._slots[i]
        if isinstance(slot, Session):
            return slot
        if slot == _CONNECTING:
            live = self._any_live_locked()
            if live is None and wait_s > 0:
                self._cv.wait(wait_s)
            return live
        self._slots[i] = _CONNECTING
        return i

    def _fill(self, i: int, send_deadline: float) -> Session | None:
        try:
            s: Session | None = self._connect_any(send_deadline)
            err: str | None = None
        except OSError as e:
            s, err = None, str(e)
        with self._lock:
            if s is not None and not self.closed:
                self._slots[i] = s
                self._cv.notify_all()
                return s
            self._slots[i] = None
            self._cv.notify_all()
            if s is None:
                if err is not None:
                    self.last_error = err
                return self._any_live_locked()
        s.close("client closed")
        s.join()
        return None

    def _connect_any(self, send_deadline: float) -> Session:
        """Tries every address once, from the next in rotation, each connect
        capped by the connect timeout and by the send deadline."""
        with self._lock:
            first = self._next_addr
            self._next_addr += 1
        last: str | None = None
        for k in range(len(self.addrs)):
            addr = self.addrs[(first + k) % len(self.addrs)]
            left = send_deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return _connect(
                    addr, min(self._connect_timeout, left), self._max_key_bytes, self._tls
                )
            except OSError as e:
                what = "timed out" if isinstance(e, socket.timeout) else str(e)
                if isinstance(e, ssl.SSLError):
                    what = f"TLS: {what}"

                last = f"{addr.text} ({_fmt(addr)}): cannot connect: {what}"
            except RuntimeError as e:  # no thread to spare
                last = f"{addr.text}: cannot start a session: {e}"
            # Kept even if a later address answers: it explains a slow call.
            with self._lock:
                self.last_error = last
        raise OSError(last or "the deadline passed before connecting")

    def _any_live_locked(self) -> Session | None:
        for s in self._slots:
            if isinstance(s, Session) and not s.dead:
                return s
        return None

    def _reap_locked(self) -> list[Session]:
        dead: list[Session] = []
        for i, s in enumerate(self._slots):
            if isinstance(s, Session) and s.dead:
                dead.append(s)
                self._slots[i] = None
        return dead

    def abandon(self) -> None:
        """Shuts every session's socket down without taking any lock, for a
        client garbage collected without :meth:`close`: the finaliser may
        run on any thread, even one inside a session's critical section.
        Each reader then sees the shutdown and closes its session itself."""
        self.closed = True
        for s in list(self._slots):
            if isinstance(s, Session):
                s.abort()

    def close(self) -> None:
        """Closes every session and joins its threads; later gets return None."""
        with self._lock:
            self.closed = True
            self._cv.notify_all()
            sessions = [s for s in self._slots if isinstance(s, Session)]
            sessions += self._unjoined
            self._unjoined = []
            self._slots = [None] * len(self._slots)
        for s in sessions:
            s.close("client closed")
        for s in sessions:
            s.join()


def _fmt(addr: Address) -> str:
    if isinstance(addr.sockaddr, str):
        return addr.sockaddr
    host, port = addr.sockaddr[0], addr.sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
