"""A blocking, thread-safe Python client for the ticketd lock server.

It follows the rules of ticketd's official client to the letter (PROTOCOL §3,
§5.3 and §6.3, in docs/PROTOCOL.md): a caller is never told ``"acquired"`` unless
it holds the lock, and never enters a critical section on a guess::

    import ticketd

    client = ticketd.Client("127.0.0.1:7470")
    res = client.acquire("db-migration", wait=10, lease=30)
    if res.outcome == "acquired":
        t = res.ticket
        ...                      # pass t.token to the resource as a fence
        t.release()

    with client.lock("db-migration", wait=10, lease=30) as t:
        ...                      # renewed in the background; stop if t.lost.is_set()
    client.close()

Standard library only.
"""

from ._client import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_POOL_SIZE,
    MAX_POOL_SIZE,
    AcquireOutcome,
    AcquireResult,
    Client,
    ExtendOutcome,
    ExtendTokenOutcome,
    NotAcquired,
    ReleaseOutcome,
    Ticket,
)
from ._places import READ_WRITE_LIMIT, Mode, Places
from ._plan import (
    DEFAULT_MAX_KEY_BYTES,
    MAX_LEASE_S,
    MAX_WAIT_S,
    RESPONSE_GRACE_S,
    TRANSPORT_DEADLINE_S,
)

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_MAX_KEY_BYTES",
    "DEFAULT_POOL_SIZE",
    "MAX_LEASE_S",
    "MAX_POOL_SIZE",
    "MAX_WAIT_S",
    "READ_WRITE_LIMIT",
    "RESPONSE_GRACE_S",
    "TRANSPORT_DEADLINE_S",
    "AcquireOutcome",
    "AcquireResult",
    "Client",
    "ExtendOutcome",
    "ExtendTokenOutcome",
    "Mode",
    "NotAcquired",
    "Places",
    "ReleaseOutcome",
    "Ticket",
]

__version__ = "0.1.0"
