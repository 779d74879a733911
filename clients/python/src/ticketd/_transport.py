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
the outgoing BIO, in order, and the writer sends them: only the writer
thread ever writes to the socket once the session runs. The handshake runs
at connect, bounded by the connect timeout, before the threads start.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from typing import Callable

#: Bytes asked of the socket, and of the TLS object, per read.
READ_CHUNK = 8 * 1024


class Plain:
    """A connected socket, as is."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, data: bytes) -> None:
        """Writes all of ``data`` (the writer thread only)."""
        self.sock.sendall(data)

    def recv(self) -> bytes:
        """Some bytes, or ``b""`` at the end of the stream (the reader only)."""
        return self.sock.recv(READ_CHUNK)

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

    def recv(self) -> bytes:
        while True:
            if self._eof:
                return b""
            data = self.sock.recv(READ_CHUNK)
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
            # Only handshake or session-ticket records: read on.
