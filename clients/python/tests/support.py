"""Test support: the real ``ticketd`` binary started on port 0, a raw
connection that asks the server directly what it holds, a fault-injecting
proxy and a black-hole listener.

The proxy parses the client's byte stream and keeps a log of every request
it *received* from a client and every request it *forwarded* to the server
(with the wait byte as forwarded), so a test can prove what the server could
have seen: "this acquire reached the server exactly once", "its wait byte
was 3". Faults are chosen per connection, in accept order.

A delayed *connect* cannot be made by a proxy that has already accepted (the
kernel completes the handshake before any accept); :class:`Blackhole` does
it instead: a listener whose backlog is full, so every connect hangs.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[3]


def ticketd_binary() -> Path:
    """The server binary: ``$TICKETD_BIN``, else the newest of
    ``target/{debug,release}/ticketd`` in this repository, else built now
    with cargo."""
    env = os.environ.get("TICKETD_BIN")
    if env:
        return Path(env)
    found = [REPO / "target" / p / "ticketd" for p in ("debug", "release")]
    found = [p for p in found if p.exists()]
    if found:
        return max(found, key=lambda p: p.stat().st_mtime)
    subprocess.run(
        ["cargo", "build", "--all-features", "--bin", "ticketd", "--bin", "ticket"],
        cwd=REPO,
        check=True,
    )
    return REPO / "target" / "debug" / "ticketd"


def ticket_binary() -> Path:
    """The Rust ``ticket`` command: ``$TICKET_BIN``, else the one beside the
    server binary, else the newest under ``target/``, else built now."""
    env = os.environ.get("TICKET_BIN")
    if env:
        return Path(env)
    beside = ticketd_binary().with_name("ticket")
    if beside.exists():
        return beside
    found = [REPO / "target" / p / "ticket" for p in ("debug", "release")]
    found = [p for p in found if p.exists()]
    if found:
        return max(found, key=lambda p: p.stat().st_mtime)
    subprocess.run(["cargo", "build", "--all-features", "--bin", "ticket"], cwd=REPO, check=True)
    return REPO / "target" / "debug" / "ticket"


class Ticketd:
    """A real ticketd process on 127.0.0.1, port 0; its stderr is drained
    into :attr:`log` so the pipe never fills."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [str(ticketd_binary()), "--listen", "127.0.0.1:0", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert self.proc.stderr is not None
        self.log: list[str] = []
        addr = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline().decode("utf-8", "replace")
            if not line:
                break
            self.log.append(line)
            m = re.search(r"listening on (\S+)", line)
            if m:
                addr = m.group(1)
                break
        if addr is None:
            self.proc.kill()
            raise RuntimeError(f"ticketd did not start: {''.join(self.log)}")
        self.addr = addr
        host, port = addr.rsplit(":", 1)
        self.sockaddr = (host, int(port))
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drain.start()

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.log.append(raw.decode("utf-8", "replace"))

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def raw(self) -> Raw:
        return Raw(self.sockaddr)

    def holds(self, key: str) -> bool:
        """Whether the server holds ``key`` now: a raw wait-0 acquire is
        answered T (if it is granted instead, it is given back at once)."""
        with self.raw() as r:
            op, a, _ = r.acquire(key, wait=0, lease=1, owner=0xFEED)
            if op == "T":
                return True
            assert op == "A", op
            r.release(key, a)
            return False


class Raw:
    """A plain socket to the server speaking the wire protocol by hand."""

    def __init__(self, sockaddr: tuple[str, int]) -> None:
        self.sock = socket.create_connection(sockaddr, timeout=10)
        self.buf = b""

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> tuple[str, int, str]:
        """One reply: (op, token or owner, key)."""
        while True:
            if self.buf:
                header = 17 if self.buf[0:1] == b"A" else 9
                nl = self.buf.find(b"\n", header)
                if len(self.buf) >= header and nl >= 0:
                    frame, self.buf = self.buf[: nl + 1], self.buf[nl + 1 :]
                    (a,) = struct.unpack_from(">Q", frame, 1)
                    return frame[0:1].decode(), a, frame[header:-1].decode()
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("server closed the raw connection")
            self.buf += chunk

    def acquire(self, key: str, wait: int, lease: int, owner: int) -> tuple[str, int, str]:
        self.send(struct.pack(">cBBQ", b"A", wait, lease, owner) + key.encode() + b"\n")
        return self.recv()

    def release(self, key: str, token: int) -> tuple[str, int, str]:
        self.send(struct.pack(">cQ", b"R", token) + key.encode() + b"\n")
        return self.recv()


# -- the fault proxy ---------------------------------------------------------

FORWARD = "forward"
#: Read the client's requests and forward none; the connection stays open.
DROP_REQUESTS = "drop_requests"
#: Read the client's first bytes, forward nothing, close the connection.
DROP_AND_CLOSE = "drop_and_close"
#: Forward requests; swallow every reply.
STALL_REPLIES = "stall_replies"


@dataclass(frozen=True)
class CutAfter:
    """Forward exactly this many client bytes, then close both sides; no
    reply gets back to the client once the last of them is forwarded."""

    n: int


@dataclass(frozen=True)
class DelayForward:
    """Hold every client chunk this long before forwarding it."""

    seconds: float


@dataclass(frozen=True)
class Inject:
    """Send these bytes to the client as soon as it connects, as if the
    server had, then forward everything as usual."""

    data: bytes


@dataclass(frozen=True)
class StallRepliesFor:
    """Forward everything, but swallow the replies for this key whose op
    is one of ``ops`` (by default an Extend's ``E`` and ``X``)."""

    key: str
    ops: str = "EX"


Fault = object


@dataclass(frozen=True)
class Req:
    """A request as the proxy saw it, on connection ``conn``."""

    conn: int
    op: str  # "A", "R" or "E"
    key: str
    wait: int = 0
    lease: int = 0
    owner: int = 0
    token: int = 0


def parse_requests(buf: bytearray, conn: int, out: list[Req]) -> None:
    """Moves every whole request at the front of ``buf`` into ``out``."""
    while buf:
        header = {0x41: 11, 0x52: 9, 0x45: 10}.get(buf[0])
        if header is None or len(buf) < header:
            return
        nl = buf.find(b"\n", header)
        if nl < 0:
            return
        key = bytes(buf[header:nl]).decode("utf-8", "replace")
        if buf[0] == 0x41:
            _, wait, lease, owner = struct.unpack_from(">cBBQ", buf)
            out.append(Req(conn, "A", key, wait=wait, lease=lease, owner=owner))
        elif buf[0] == 0x52:
            (token,) = struct.unpack_from(">Q", buf, 1)
            out.append(Req(conn, "R", key, token=token))
        else:
            _, lease, token = struct.unpack_from(">cBQ", buf)
            out.append(Req(conn, "E", key, lease=lease, token=token))
        del buf[: nl + 1]


class Proxy:
    """Listens on 127.0.0.1 (or on a unix socket path) and forwards to the
    server at ``upstream``, applying each connection's fault."""

    def __init__(self, upstream: tuple[str, int], unix_path: str | None = None) -> None:
        self.upstream = upstream
        if unix_path is None:
            self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.listener.bind(("127.0.0.1", 0))
            host, port = self.listener.getsockname()
            self.addr = f"{host}:{port}"
        else:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(unix_path)
            self.addr = f"unix:{unix_path}"
        self.listener.listen(64)
        self.lock = threading.Lock()
        self.default: Fault = FORWARD
        self.faults: dict[int, Fault] = {}
        self.received: list[Req] = []
        self.forwarded: list[Req] = []
        self.closed_by_client: list[int] = []
        self.accepted = 0
        self._socks: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def set_fault(self, fault: Fault) -> None:
        with self.lock:
            self.default = fault

    def set_fault_for(self, conn: int, fault: Fault) -> None:
        with self.lock:
            self.faults[conn] = fault

    def received_for(self, key: str) -> list[Req]:
        with self.lock:
            return [r for r in self.received if r.key == key]

    def forwarded_for(self, key: str, op: str | None = None) -> list[Req]:
        with self.lock:
            return [r for r in self.forwarded if r.key == key and (op is None or r.op == op)]

    def wait_until(self, timeout: float, pred: Callable[[Proxy], bool]) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred(self):
                return True
            time.sleep(0.005)
        return pred(self)

    def cut_connections(self) -> None:
        """Closes every connection made so far, both sides; new ones are
        accepted as before."""
        with self.lock:
            socks = list(self._socks)
            self._socks.clear()
        for s in socks:
            _kill(s)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self.listener.close()
        with self.lock:
            socks = list(self._socks)
        for s in socks:
            _kill(s)

    def _accept_loop(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                conn = self.accepted
                self.accepted += 1
                fault = self.faults.get(conn, self.default)
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self._socks += [client, server]
            cut = threading.Event()
            if isinstance(fault, Inject):
                with contextlib.suppress(OSError):
                    client.sendall(fault.data)
            threading.Thread(
                target=self._up, args=(conn, fault, client, server, cut), daemon=True
            ).start()
            threading.Thread(
                target=self._down, args=(fault, client, server, cut), daemon=True
            ).start()

    def _up(
        self,
        conn: int,
        fault: Fault,
        client: socket.socket,
        server: socket.socket,
        cut: threading.Event,
    ) -> None:
        rbuf = bytearray()
        fbuf = bytearray()
        sent = 0
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                with self.lock:
                    if not self._stop:
                        self.closed_by_client.append(conn)
                _kill(client)
                _kill(server)
                return
            with self.lock:
                rbuf += data
                parse_requests(rbuf, conn, self.received)
            if fault == DROP_AND_CLOSE:
                _kill(client)
                _kill(server)
                return
            if fault == DROP_REQUESTS:
                continue
            if isinstance(fault, DelayForward):
                time.sleep(fault.seconds)
            if isinstance(fault, CutAfter):
                data = data[: max(0, fault.n - sent)]
                if sent + len(data) >= fault.n:
                    # No reply gets back once the last byte is forwarded.
                    cut.set()
            # Logged before it is sent, so that a reply can never reach the
            # client before the log shows what the server could have seen.
            with self.lock:
                fbuf += data
                parse_requests(fbuf, conn, self.forwarded)
            try:
                server.sendall(data)
            except OSError:
                _kill(client)
                return
            sent += len(data)
            if isinstance(fault, CutAfter) and sent >= fault.n:
                _kill(client)
                _kill(server)
                return

    def _down(
        self, fault: Fault, client: socket.socket, server: socket.socket, cut: threading.Event
    ) -> None:
        pending = bytearray()
        while True:
            try:
                data = server.recv(65536)
            except OSError:
                data = b""
            if not data:
                _kill(client)
                return
            if fault == STALL_REPLIES or cut.is_set():
                continue
            if isinstance(fault, StallRepliesFor):
                pending += data
                data = _drop_replies_for(pending, fault.key.encode(), fault.ops.encode())
                if not data:
                    continue
            try:
                client.sendall(data)
            except OSError:
                _kill(server)
                return


def _drop_replies_for(buf: bytearray, key: bytes, ops: bytes) -> bytes:
    """Takes every whole reply off the front of ``buf``; returns all but
    those for ``key`` with an op in ``ops``."""
    out = bytearray()
    while buf:
        header = 17 if buf[0] == 0x41 else 9
        nl = buf.find(b"\n", header)
        if len(buf) < header or nl < 0:
            break
        if bytes(buf[header:nl]) != key or buf[0] not in ops:
            out += buf[: nl + 1]
        del buf[: nl + 1]
    return bytes(out)


def _kill(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)


class Blackhole:
    """A loopback port whose accept queue is full: connects to it hang until
    the connecting side gives up."""

    def __init__(self) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        host, port = self.listener.getsockname()
        self.addr = f"{host}:{port}"
        self._fillers: list[socket.socket] = []
        for _ in range(8):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(0.3)
            try:
                s.connect((host, port))
            except OSError:
                s.close()
                break
            self._fillers.append(s)

    def close(self) -> None:
        for s in self._fillers:
            s.close()
        self.listener.close()


def refused_addr() -> str:
    """A loopback address where nothing listens (connect is refused)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    host, port = s.getsockname()
    s.close()
    return f"{host}:{port}"


# -- certificates ------------------------------------------------------------


def openssl(cwd: Path, *args: str) -> None:
    """Runs ``openssl ARGS`` in ``cwd``; raises with its output if it fails."""
    p = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {p.stderr}")


def make_certs(d: Path) -> Path:
    """Two CAs (``ca``, ``other``), a server certificate for localhost and
    127.0.0.1 from ``ca``, and a client certificate from each CA
    (``client``, ``stranger``), made by ``openssl`` in ``d``."""
    (d / "server.ext").write_text(
        "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth\n"
    )
    (d / "client.ext").write_text("basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    for ca in ("ca", "other"):
        openssl(d, "req", "-x509", *ec, "-days", "2", "-subj", f"/CN=test {ca}",
                "-keyout", f"{ca}-key.pem", "-out", f"{ca}.pem")  # fmt: skip
    for leaf, ca, ext in (
        ("server", "ca", "server.ext"),
        ("client", "ca", "client.ext"),
        ("stranger", "other", "client.ext"),
    ):
        openssl(d, "req", *ec, "-subj", f"/CN={leaf}", "-keyout", f"{leaf}-key.pem",
                "-out", f"{leaf}.csr")  # fmt: skip
        openssl(d, "x509", "-req", "-in", f"{leaf}.csr", "-CA", f"{ca}.pem", "-CAkey",
                f"{ca}-key.pem", "-CAcreateserial", "-days", "2", "-extfile", ext,
                "-out", f"{leaf}.pem")  # fmt: skip
    return d
