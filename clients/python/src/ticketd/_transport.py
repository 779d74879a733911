"""What a session reads and writes through: a plain socket, or TLS over one.

TLS runs on an :class:`ssl.SSLObject` with memory BIOs rather than an
``ssl.SSLSocket``, because a session's reader and writer threads use the
connection at the same time and one OpenSSL connection object must not be
used by two threads at once. The TLS state sits behind a lock that is never
held across a socket call: the writer encrypts under the lock and writes
the records after it; the reader reads records from the socket without it
and decrypts under it. So a writer blocked on a full socket never stops the
reader from draining the replies that would let the server read again.

Records the reader's side produces (a TLS 1.3 key update answer) stay in
the outgoing BIO, in order, and the writer sends them. The handshake runs
at connect, bounded by the connect timeout, before the threads start.

A caller alone on a connection writes and reads on its own thread
(:meth:`Plain.send_nowait`, :meth:`Plain.recv_by`): the session makes sure
that one thread at a time writes and one at a time reads, and the socket
stays in blocking mode for the writer and reader threads (the caller's
calls use ``MSG_DONTWAIT`` and ``poll``). Where those are missing
(:data:`CALLER_IO` false) every request goes through the threads.
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import ssl
import threading
import time
from typing import Callable

#: Bytes asked of the socket, and of the TLS object, per read.
READ_CHUNK = 8 * 1024
#: Whether a caller can write without blocking and wait for bytes with a
#: bound on its own thread.
CALLER_IO = hasattr(select, "poll") and hasattr(socket, "MSG_DONTWAIT")
_DONTWAIT: int = getattr(socket, "MSG_DONTWAIT", 0)


class Plain:
    """A connected socket, as is."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._poll: select.poll | None = None
        if CALLER_IO:
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)

    def send(self, data: bytes) -> None:
        """Writes all of ``data`` (the writer thread only)."""
        self.sock.sendall(data)

    def send_raw(self, data: bytes) -> None:
        """Writes bytes that are already in the socket's form (what a
        :meth:`send_nowait` left), blocking (the writer thread only)."""
        self.sock.sendall(data)

    def send_nowait(self, data: bytes) -> tuple[bool, bytes]:
        """Writes what the socket takes at once of ``data`` (non-empty).
        Returns ``(taken, rest)``: ``taken`` false means not one byte of
        ``data`` went anywhere (the socket was full); ``rest`` is what must
        still go to the socket, in order, before anything else (through
        :meth:`send_raw`). Raises ``OSError``."""
        try:
            n = self.sock.send(data, _DONTWAIT)
        except BlockingIOError:
            return False, b""
        return True, data[n:]

    def recv(self) -> bytes:
        """Some bytes, or ``b""`` at the end of the stream (the reader only)."""
        return self.sock.recv(READ_CHUNK)

    def recv_by(self, timeout: float) -> bytes | None:
        """What has come within ``timeout`` seconds (0: only what is there
        now): some bytes, ``b""`` at the end of the stream, or ``None`` when
        nothing came. Raises ``OSError``. Only with :data:`CALLER_IO`."""
        assert self._poll is not None
        if not self._poll.poll(max(0, math.ceil(timeout * 1000))):
            return None
        try:
            return self.sock.recv(READ_CHUNK, _DONTWAIT)
        except BlockingIOError:
            return None

    def has_output(self) -> bool:
        """Whether bytes wait for the writer that no request put there."""
        return False

    def shutdown(self) -> None:
        """Wakes a thread blocked in :meth:`send` or :meth:`recv`."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


class Tls(Plain):
    """TLS over a connected socket; see the module text."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_name: str) -> None:
        super().__init__(sock)
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._obj = context.wrap_bio(self._in, self._out, server_hostname=server_name)
        self._lock = threading.Lock()
        self._eof = False
        #: Called (without any lock of ours held) when the reader's side left
        #: records for the writer to send.
        self.on_output: Callable[[], None] | None = None

    def handshake(self, deadline: float) -> None:
        """Runs the handshake on the blocking socket, every read and write
        of it ending by ``deadline`` (``time.monotonic()``). Raises
        ``OSError`` (``ssl.SSLError`` and ``socket.timeout`` among them)."""
        while True:
            try:
                self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                pass
            self._flush_by(deadline)
            self._time_left(deadline)
            data = self.sock.recv(READ_CHUNK)
            if not data:
                raise ConnectionError("the server closed the connection during the TLS handshake")
            self._in.write(data)
        self._flush_by(deadline)

    def _time_left(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("the TLS handshake timed out")
        self.sock.settimeout(left)

    def _flush_by(self, deadline: float) -> None:
        out = self._out.read()
        if out:
            self._time_left(deadline)
            self.sock.sendall(out)

    def send(self, data: bytes) -> None:
        with self._lock:
            if data:
                self._obj.write(data)
            out = self._out.read()
        if out:
            self.sock.sendall(out)

    def has_output(self) -> bool:
        with self._lock:
            return self._out.pending > 0

    def send_nowait(self, data: bytes) -> tuple[bool, bytes]:
        # Once encrypted, the records must reach the socket (they carry
        # sequence numbers): counted as taken even if the socket took none.
        with self._lock:
            self._obj.write(data)
            out = self._out.read()
        try:
            n = self.sock.send(out, _DONTWAIT)
        except BlockingIOError:
            n = 0
        return True, out[n:]

    def recv(self) -> bytes:
        while True:
            if self._eof:
                return b""
            got = self._take(self.sock.recv(READ_CHUNK))
            if got is not None:
                return got
            # Only handshake or session-ticket records: read on.

    def recv_by(self, timeout: float) -> bytes | None:
        if self._eof:
            return b""
        data = super().recv_by(timeout)
        if data is None:
            return None
        return self._take(data)

    def _take(self, data: bytes) -> bytes | None:
        """Decrypts ``data`` from the socket: the application bytes, ``b""``
        at the end of the stream, ``None`` when it held no application data."""
        parts: list[bytes] = []
        with self._lock:
            if data:
                self._in.write(data)
            else:
                self._in.write_eof()
            eof = False
            while True:
                try:
                    chunk = self._obj.read(READ_CHUNK)
                except ssl.SSLWantReadError:
                    break
                except ssl.SSLZeroReturnError:
                    eof = True
                    break
                except ssl.SSLEOFError:
                    # The stream ended without close_notify: the end of
                    # the stream all the same (nothing more can come).
                    eof = True
                    break
                if not chunk:
                    eof = True
                    break
                parts.append(chunk)
            pending_out = self._out.pending > 0
        if eof or not data:
            self._eof = True
        if pending_out and self.on_output is not None:
            self.on_output()
        if parts:
            # Whatever came before the end is delivered first; the next
            # call sees the end.
            return b"".join(parts)
        if self._eof:
            return b""
        return None
