//! Peer framing and the hello codec.

use super::READ_CHUNK;

/// The frame limit until [`Transport::set_max_frame_bytes`](super::Transport::set_max_frame_bytes) raises it, and
/// the least it can be.
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// Outbound bytes buffered per peer beyond one largest frame, before
/// messages are dropped (so appends can queue behind a snapshot).
pub const PEER_BUFFER_SLACK_BYTES: usize = 16 << 20;
/// The largest frame length the u32 prefix can carry.
const FRAME_LEN_CEILING: u64 = u32::MAX as u64;

/// The largest frame limit a build whose allocations hold at most
/// `max_alloc` bytes can serve: what the u32 length prefix carries, and no
/// more than lets a peer's outbound buffer (one frame plus
/// [`PEER_BUFFER_SLACK_BYTES`]) and a connection's receive buffer (one
/// frame plus a read) grow by doubling within one allocation. On a 64-bit
/// build that is the length prefix's 4 GiB; on a 32-bit one, 1,007 MiB.
#[must_use]
pub const fn frame_ceiling(max_alloc: u64) -> u64 {
    let around = PEER_BUFFER_SLACK_BYTES as u64 + READ_CHUNK as u64 + 4;
    let fits = (max_alloc / 2).saturating_sub(around);
    if fits < FRAME_LEN_CEILING {
        fits
    } else {
        FRAME_LEN_CEILING
    }
}

/// The frame limit for a lock table whose snapshot is at most `wanted`
/// bytes: `wanted`, raised to [`MAX_FRAME_BYTES`] and capped to
/// [`frame_ceiling`]`(max_alloc)`.
#[must_use]
pub fn frame_limit(wanted: u64, max_alloc: u64) -> u64 {
    wanted
        .max(MAX_FRAME_BYTES as u64)
        .min(frame_ceiling(max_alloc))
}

const HELLO_MAGIC: &[u8; 4] = b"TKTD";
/// The `voters` field of hellos: fixed, since members change at run time.
pub const MEMBERSHIP_MARK: u64 = 0x6d65_6d62_6572_7321;
const HELLO_VERSION: u8 = 1;
pub(super) const HELLO_LEN: usize = 4 + 1 + 8 * 6;

/// The first frame on a peer connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Hash of the cluster name.
    pub cluster: u64,
    /// The peer hello's membership marker: [`MEMBERSHIP_MARK`] (it was a
    /// hash of the voter ids while membership was static; the set changes
    /// now, and every node learns it from the log).
    pub voters: u64,
    /// The sender's node id.
    pub from: u64,
    /// The sender's data directory id.
    pub from_uuid: u64,
    /// The receiver's node id.
    pub to: u64,
    /// The receiver's data directory id as the sender first saw it (0: never).
    pub to_uuid: u64,
}

impl Hello {
    /// The frame (length prefix included).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(4 + HELLO_LEN);
        b.extend_from_slice(&(HELLO_LEN as u32).to_be_bytes());
        b.extend_from_slice(HELLO_MAGIC);
        b.push(HELLO_VERSION);
        for v in [
            self.cluster,
            self.voters,
            self.from,
            self.from_uuid,
            self.to,
            self.to_uuid,
        ] {
            b.extend_from_slice(&v.to_be_bytes());
        }
        b
    }

    /// Decodes a hello payload (without the length prefix).
    pub fn decode(p: &[u8]) -> Result<Hello, &'static str> {
        if p.len() != HELLO_LEN || &p[..4] != HELLO_MAGIC {
            return Err("not a ticketd peer hello");
        }
        if p[4] != HELLO_VERSION {
            return Err("unsupported peer protocol version");
        }
        let f = |i: usize| {
            let o = 5 + 8 * i;
            u64::from_be_bytes(p[o..o + 8].try_into().expect("8 bytes"))
        };
        Ok(Hello {
            cluster: f(0),
            voters: f(1),
            from: f(2),
            from_uuid: f(3),
            to: f(4),
            to_uuid: f(5),
        })
    }
}

/// The peer framing: the payload length of the first frame in `buf` once
/// all of it has arrived (the frame is `buf[4..4 + len]`), `None` while it is
/// incomplete, or why the connection must close (a frame over `max`). Before
/// the hello (`before_hello`) only a hello-sized frame is accepted, so a
/// stranger on the peer port cannot make us buffer a large frame. Public for
/// the fuzz targets.
#[doc(hidden)]
pub fn frame_len(buf: &[u8], before_hello: bool, max: usize) -> Result<Option<usize>, FrameError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    if before_hello && len != HELLO_LEN {
        return Err(FrameError::NotHello);
    }
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    if buf.len() - 4 < len {
        return Ok(None);
    }
    Ok(Some(len))
}

/// Why [`frame_len`] refuses a frame (and the connection closes).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Before the hello, a frame that is not hello-sized.
    NotHello,
    /// A frame over the limit.
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::NotHello => f.write_str("the first frame is not a hello"),
            FrameError::TooLarge { len, max } => {
                write!(f, "frame of {len} bytes is over the limit of {max}")
            }
        }
    }
}

impl std::error::Error for FrameError {}

/// FNV-1a, for the cluster name and voter set hashes.
#[must_use]
pub fn hash64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
