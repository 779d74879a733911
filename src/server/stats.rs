//! [`Stats`]: the server's counters since start.

/// Counters for tests, examples and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections accepted and served.
    pub accepted: u64,
    /// Connections accepted and closed at once because of `max_conns`.
    pub refused: u64,
    /// Unix-socket client connections closed at once: the peer's uid and
    /// gid are not in `--allow-uid` / `--allow-gid`.
    pub refused_peer: u64,
    /// Connections closed for malformed input.
    pub malformed: u64,
    /// Connections closed at the output hard limit or for a timeout.
    pub limit_closes: u64,
    /// Times accepting paused for lack of file descriptors.
    pub accept_pauses: u64,
    /// Loop turns.
    pub turns: u64,
    /// Identities whose guess budget paused reads (too many `N` and
    /// `X` answers).
    pub throttled: u64,
    /// Wrong-token answers (`N`, `X`) charged to identities' guess budgets.
    pub guesses: u64,
    /// Connections accepted and closed at once because their identity had
    /// `--max-conns-per-identity` open (or, for a client certificate's
    /// identity, closed when their handshake was done).
    pub refused_identity: u64,
    /// TLS connections accepted and closed at once because their source
    /// address had `--max-handshakes-per-identity` handshakes under way.
    pub refused_handshakes: u64,
    /// Connections accepted and closed at once because the connections'
    /// buffers alone filled `--max-memory`.
    pub refused_memory: u64,
    /// Admin connections accepted and closed at once (too many open).
    pub admin_refused: u64,
    /// Unix-socket admin connections closed at once: the peer's uid and
    /// gid are not in `--allow-uid` / `--allow-gid`.
    pub admin_refused_peer: u64,
    /// Well-formed requests handled: acquire, release, extend.
    pub requests: [u64; 3],
    /// Replies sent: acquired, timeout, busy, released, not released,
    /// extended, not extended.
    pub replies: [u64; 7],
}
