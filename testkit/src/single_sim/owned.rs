//! Requests and replies decoded with their keys copied, so that the buffer
//! they came from can be drained.

use super::*;

/// A decoded request with its key copied, so the buffer can be drained.
pub(super) enum OwnedReq {
    Acquire {
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        key: String,
        /// `None` for a plain `A`.
        places: Option<Places>,
    },
    Release {
        token: u64,
        key: String,
    },
    Extend {
        lease_s: u8,
        token: u64,
        key: String,
    },
}

impl From<Request<'_>> for OwnedReq {
    fn from(r: Request<'_>) -> Self {
        match r {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            } => OwnedReq::Acquire {
                wait_s,
                lease_s,
                owner,
                key: key.to_string(),
                places: None,
            },
            Request::AcquireWithLimit {
                wait_s,
                lease_s,
                owner,
                limit,
                mode,
                key,
            } => OwnedReq::Acquire {
                wait_s,
                lease_s,
                owner,
                key: key.to_string(),
                places: Some(Places { limit, mode }),
            },
            Request::Release { token, key } => OwnedReq::Release {
                token,
                key: key.to_string(),
            },
            Request::Extend {
                lease_s,
                token,
                key,
            } => OwnedReq::Extend {
                lease_s,
                token,
                key: key.to_string(),
            },
        }
    }
}

/// A decoded reply with its key copied.
pub(super) enum OwnedReply {
    /// `A`, `T`, `B` or `L` (op byte), matched by owner; `L` carries the
    /// key's limit as its token.
    Owner { op: u8, owner: u64, token: u64 },
    /// `R` or `N`, matched by token and key.
    Release {
        released: bool,
        token: u64,
        key: String,
    },
    /// `E` or `X`, matched by token and key.
    Extend {
        extended: bool,
        token: u64,
        key: String,
    },
}

impl From<Reply<'_>> for OwnedReply {
    fn from(r: Reply<'_>) -> Self {
        match r {
            Reply::Acquired { token, owner, .. } => OwnedReply::Owner {
                op: b'A',
                owner,
                token,
            },
            Reply::Timeout { owner, .. } => OwnedReply::Owner {
                op: b'T',
                owner,
                token: 0,
            },
            Reply::Busy { owner, .. } => OwnedReply::Owner {
                op: b'B',
                owner,
                token: 0,
            },
            Reply::LimitMismatch { owner, limit, .. } => OwnedReply::Owner {
                op: b'L',
                owner,
                token: u64::from(limit),
            },
            Reply::Released { token, key } => OwnedReply::Release {
                released: true,
                token,
                key: key.to_string(),
            },
            Reply::NotReleased { token, key } => OwnedReply::Release {
                released: false,
                token,
                key: key.to_string(),
            },
            Reply::Extended { token, key } => OwnedReply::Extend {
                extended: true,
                token,
                key: key.to_string(),
            },
            Reply::NotExtended { token, key } => OwnedReply::Extend {
                extended: false,
                token,
                key: key.to_string(),
            },
        }
    }
}
