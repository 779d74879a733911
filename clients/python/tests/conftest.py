"""Fixtures: a fresh real ticketd per test, proxies in front of it, and
clients that are closed when the test ends."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import Proxy, Ticketd  # noqa: E402

import ticketd  # noqa: E402


@pytest.fixture
def start_server() -> Iterator[Callable[..., Ticketd]]:
    started: list[Ticketd] = []

    def start(*args: str) -> Ticketd:
        s = Ticketd(*args)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def server(start_server: Callable[..., Ticketd]) -> Ticketd:
    return start_server()


@pytest.fixture
def make_proxy() -> Iterator[Callable[..., Proxy]]:
    made: list[Proxy] = []

    def make(server: Ticketd, **kw: Any) -> Proxy:
        p = Proxy(server.sockaddr, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def make_client() -> Iterator[Callable[..., ticketd.Client]]:
    made: list[ticketd.Client] = []

    def make(address: Any, **kw: Any) -> ticketd.Client:
        c = ticketd.Client(address, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
