"""TLS (the ``ssl`` module) and unix socket addresses against the real
``ticketd``: its ``--tls-cert``/``--tls-key`` TCP listener with certificates
made by ``openssl`` at test time, and its ``--listen unix:PATH`` listener.
What the server holds is asked over the plaintext unix socket."""

from __future__ import annotations

import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import pytest
from support import Ticketd, make_certs

import ticketd

MakeClient = Callable[..., ticketd.Client]


@pytest.fixture(scope="module")
def certs() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ticketd-py-tls-") as d:
        yield make_certs(Path(d))


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Short: a unix socket path is limited to about 100 bytes.
    with tempfile.TemporaryDirectory(prefix="tkd") as d:
        yield Path(d)


def tls_server(
    start_server: Callable[..., Ticketd], certs: Path, sock: Path, *extra: str
) -> Ticketd:
    return start_server(
        "--listen",
        f"unix:{sock}",
        "--tls-cert",
        str(certs / "server.pem"),
        "--tls-key",
        str(certs / "server-key.pem"),
        *extra,
    )


def holds(c: ticketd.Client, key: str) -> bool:
    """Whether the server holds ``key``: a wait-0 acquire is answered T (if
    it is granted instead, it is given back at once)."""
    res = c.acquire(key, wait=0, lease=1)
    if res.ticket is not None:
        assert res.ticket.release() == "released"
        return False
    assert res.outcome == "timeout", res.outcome
    return True


def test_acquire_extend_release_over_tls_against_the_real_server(
    start_server: Callable[..., Ticketd], certs: Path, sock_dir: Path, make_client: MakeClient
) -> None:
    sock = sock_dir / "t.sock"
    server = tls_server(start_server, certs, sock)
    plain = make_client(f"unix:{sock}")
    # The certificate names 127.0.0.1 and localhost: both addresses check.
    for addr in (server.addr, server.addr.replace("127.0.0.1", "localhost")):
        c = make_client(addr, tls_ca=certs / "ca.pem", pool_size=1)
        t = c.acquire("tls", wait=1, lease=5).ticket
        assert t is not None, c.last_connect_error
        assert holds(plain, "tls")
        assert t.extend(10) == "extended"
        assert t.release() == "released"
        assert not holds(plain, "tls")
    # A plaintext client on the TLS port gets nothing: the server closes it.
    bare = make_client(server.addr, pool_size=1)
    assert bare.acquire("tls", wait=1, lease=5).outcome in ("timeout", "indeterminate")
    assert not holds(plain, "tls")


def test_many_threads_pipeline_over_tls_on_two_connections(
    start_server: Callable[..., Ticketd], certs: Path, sock_dir: Path, make_client: MakeClient
) -> None:
    """The reader and the writer of each connection use one TLS session at
    once: eight threads, replies in any order (each thread's waits on one
    shared key queue behind the others' cycles on their own keys)."""
    sock = sock_dir / "t.sock"
    server = tls_server(start_server, certs, sock)
    c = make_client(server.addr, tls_ca=certs / "ca.pem", pool_size=2)
    problems: list[str] = []
    grants: list[int] = []
    inside = threading.Lock()

    def work(i: int) -> None:
        for j in range(40):
            key = "shared" if j % 4 == 0 else f"own-{i}"
            t = c.acquire(key, wait=10, lease=10).ticket
            if t is None:
                problems.append(f"{key}: not acquired")
                continue
            if key == "shared":
                if not inside.acquire(blocking=False):
                    problems.append("two holders of shared")
                grants.append(t.token)
                inside.release()
            if t.release() != "released":
                problems.append(f"{key}: release")

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert problems == []
    assert len(grants) == 8 * 10
    assert all(a < b for a, b in zip(grants, grants[1:]))
    assert c.connected_sessions() <= 2


def test_a_server_certificate_from_another_ca_or_for_another_name_is_refused(
    start_server: Callable[..., Ticketd], certs: Path, sock_dir: Path, make_client: MakeClient
) -> None:
    sock = sock_dir / "t.sock"
    server = tls_server(start_server, certs, sock)
    plain = make_client(f"unix:{sock}")
    for kw in (
        {"tls_ca": certs / "other.pem"},
        {"tls_ca": certs / "ca.pem", "tls_server_name": "db.example"},
    ):
        c = make_client(server.addr, pool_size=1, **kw)
        # On a loaded machine one handshake can outlast a short wait, and
        # the attempt the deadline cuts short is the error kept: a few
        # tries, each of which must be refused before a byte of the request
        # was sent (definitely not acquired, no later than the wait).
        err = ""
        for _ in range(3):
            start = time.monotonic()
            res = c.acquire("k", wait=1.0, lease=5)
            assert res.outcome == "timeout", (kw, res)
            assert time.monotonic() - start < 2.0
            err = c.last_connect_error or ""
            if "certificate verify failed" in err:
                break
        assert "TLS" in err and "certificate verify failed" in err, err
    assert not holds(plain, "k")
    # The name the certificate does carry works.
    good = make_client(server.addr, tls_ca=certs / "ca.pem", tls_server_name="localhost")
    t = good.acquire("k", wait=1, lease=5).ticket
    assert t is not None and t.release() == "released"


def test_a_client_certificate_is_presented_when_the_server_requires_one(
    start_server: Callable[..., Ticketd], certs: Path, sock_dir: Path, make_client: MakeClient
) -> None:
    sock = sock_dir / "t.sock"
    server = tls_server(start_server, certs, sock, "--tls-client-ca", str(certs / "ca.pem"))
    plain = make_client(f"unix:{sock}")
    ca = certs / "ca.pem"
    for kw in ({}, {"tls_cert": certs / "stranger.pem", "tls_key": certs / "stranger-key.pem"}):
        c = make_client(server.addr, tls_ca=ca, pool_size=1, **kw)
        # TLS 1.3 ends the client's side of the handshake before the server
        # has judged the certificate, so the refusal may come after the
        # request was written: never a grant either way.
        assert c.acquire("m", wait=0.5, lease=5).outcome in ("timeout", "indeterminate")
        assert not holds(plain, "m")
    c = make_client(
        server.addr, tls_ca=ca, tls_cert=certs / "client.pem", tls_key=certs / "client-key.pem"
    )
    t = c.acquire("m", wait=1, lease=5).ticket
    assert t is not None, c.last_connect_error
    assert holds(plain, "m")
    assert t.release() == "released"
    # A ready SSLContext does the same.
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(certs / "client.pem"), str(certs / "client-key.pem"))
    t = make_client(server.addr, ssl_context=ctx).acquire("m", wait=1, lease=5).ticket
    assert t is not None and t.release() == "released"


def test_a_tls_handshake_that_stalls_is_bounded_by_the_connect_timeout(
    certs: Path, make_client: MakeClient
) -> None:
    # A listener that accepts (the kernel does) and never answers the
    # ClientHello.
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(64)
    try:
        host, port = mute.getsockname()
        c = make_client(f"{host}:{port}", tls_ca=certs / "ca.pem", pool_size=1, connect_timeout=0.5)
        start = time.monotonic()
        res = c.acquire("k", wait=2, lease=5)
        took = time.monotonic() - start
        # No handshake ends, so the request is never sent: Timeout at D.
        assert res.outcome == "timeout"
        assert 1.95 <= took < 2.5, took
        assert "timed out" in (c.last_connect_error or ""), c.last_connect_error
    finally:
        mute.close()


def test_tls_settings_are_checked_at_construction(certs: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="TLS settings"):
        ticketd.Client("127.0.0.1:1", tls_ca=tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="TLS settings"):
        ticketd.Client("127.0.0.1:1", tls_ca=certs / "server.csr")
    with pytest.raises(ValueError, match="go together"):
        ticketd.Client("127.0.0.1:1", tls_ca=certs / "ca.pem", tls_cert=certs / "client.pem")
    with pytest.raises(ValueError, match="without a CA"):
        ticketd.Client("127.0.0.1:1", tls_server_name="localhost")
    with pytest.raises(ValueError, match="not both"):
        ticketd.Client(
            "127.0.0.1:1", tls_ca=certs / "ca.pem", ssl_context=ssl.create_default_context()
        )


def test_the_servers_unix_socket_serves_the_client_and_stays_plaintext_under_tls(
    start_server: Callable[..., Ticketd], certs: Path, sock_dir: Path, make_client: MakeClient
) -> None:
    sock = sock_dir / "u.sock"
    server = tls_server(start_server, certs, sock)
    # tls_ca applies to the TCP address only; the unix one stays plaintext.
    c = make_client([f"unix:{sock}"], tls_ca=certs / "ca.pem")
    t = c.acquire("u", wait=1, lease=5).ticket
    assert t is not None, c.last_connect_error
    other = make_client(server.addr, tls_ca=certs / "ca.pem")
    assert holds(other, "u")
    assert t.extend(5) == "extended"
    with c.lock("u2", wait=1, lease=3) as t2:
        assert holds(other, "u2")
        assert not t2.lost.is_set()
    assert not holds(other, "u2")
    assert t.release() == "released"
    assert not holds(other, "u")
