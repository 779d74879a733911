//! Raft messages on the wire: the payload of a peer frame is the protobuf
//! encoding of one raft `Message`.
//!
//! raft-rs (with its `protobuf-codec` feature) generates its messages with
//! rust-protobuf 2, and that runtime encodes and decodes every message
//! here but one part: the entries of an append are written by hand
//! ([`encode_entries`]), byte for byte as protobuf writes them. Raft sends
//! each follower whose progress matches the same entries, so a turn's
//! appends share one encoding of them ([`EntriesKey`] tells when), and
//! writing an entry's few fields directly costs less than the
//! `CodedOutputStream`'s checks per field. Decoding stays protobuf's
//! ([`decode_message`]), from a `Bytes` copy of the frame so that entries
//! share it rather than allocate each; a test checks the hand-written bytes
//! against protobuf's for every kind of entry.

use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};

/// Frames at least this long are decoded from a `Bytes` copy of their own.
pub(super) const SHARED_DECODE_BYTES: usize = 128;

/// Decodes one frame's message. A frame long enough to carry entries is
/// first copied into a `Bytes` of its own and decoded from that: each
/// entry's data is then a slice of it, where decoding from the read buffer
/// allocates one buffer per entry (and raft's clone of each into its log
/// one more). Short frames (acknowledgements, heartbeats, votes) carry no
/// data and are decoded in place.
pub(super) fn decode_message(payload: &[u8]) -> protobuf::ProtobufResult<Message> {
    if payload.len() >= SHARED_DECODE_BYTES {
        let mut v = Vec::new();
        if v.try_reserve_exact(payload.len()).is_ok() {
            v.extend_from_slice(payload);
            return Message::parse_from_carllerche_bytes(&bytes::Bytes::from(v));
        }
    }
    Message::parse_from_bytes(payload)
}

/// What identifies an append's entries within one turn: the first and the
/// last entry's index, term and data. Entries with the same index and term
/// are the same entry (Raft's log matching), and raft hands each follower
/// clones of its log's `Bytes`, so equal keys mean equal entries. `None`
/// for any other message, or an append without entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct EntriesKey {
    count: usize,
    first: (u64, u64, usize, usize),
    last: (u64, u64, usize, usize),
}

impl EntriesKey {
    pub(super) fn of(m: &Message) -> Option<EntriesKey> {
        if m.msg_type != MessageType::MsgAppend || m.has_snapshot() {
            return None;
        }
        let id =
            |e: &raft::eraftpb::Entry| (e.index, e.term, e.data.as_ptr() as usize, e.data.len());
        Some(EntriesKey {
            count: m.entries.len(),
            first: id(m.entries.first()?),
            last: id(m.entries.last()?),
        })
    }
}

/// The entries as a message's field 7 (tag, length, entry, for each),
/// byte for byte as protobuf writes them; `None` if they are over `max`
/// bytes. Written here rather than with protobuf's `CodedOutputStream`,
/// whose checks per field cost more than the bytes: an entry is its
/// fields in protobuf's order (type, term, index, data, context, then the
/// deprecated `sync_log`), each left out when it has its default value. An
/// entry with unknown fields (none of raft's have them) is written by
/// protobuf.
pub(super) fn encode_entries(entries: &[raft::eraftpb::Entry], max: usize) -> Option<Vec<u8>> {
    let mut total = 0usize;
    for e in entries {
        let n = entry_size(e)?;
        total = total
            .saturating_add(n)
            .saturating_add(1 + varint_len_u64(n as u64));
    }
    if total > max {
        return None;
    }
    let mut block = Vec::new();
    block.try_reserve_exact(total).ok()?;
    for e in entries {
        if protobuf::rt::unknown_fields_size(e.get_unknown_fields()) != 0 {
            let written = {
                let mut os = protobuf::CodedOutputStream::vec(&mut block);
                os.write_tag(7, protobuf::wire_format::WireTypeLengthDelimited)
                    .and_then(|()| os.write_raw_varint32(e.compute_size()))
                    .and_then(|()| e.write_to_with_cached_sizes(&mut os))
                    .and_then(|()| os.flush())
            };
            written.ok()?;
            continue;
        }
        block.push(0x3a); // field 7, length-delimited
        put_varint(&mut block, entry_size(e)? as u64);
        let kind = protobuf::ProtobufEnum::value(&e.entry_type);
        if kind != 0 {
            block.push(0x08); // field 1, varint: an int32, sign-extended
            put_varint(&mut block, i64::from(kind) as u64);
        }
        if e.term != 0 {
            block.push(0x10);
            put_varint(&mut block, e.term);
        }
        if e.index != 0 {
            block.push(0x18);
            put_varint(&mut block, e.index);
        }
        if !e.data.is_empty() {
            block.push(0x22);
            put_varint(&mut block, e.data.len() as u64);
            block.extend_from_slice(&e.data);
        }
        if !e.context.is_empty() {
            block.push(0x32);
            put_varint(&mut block, e.context.len() as u64);
            block.extend_from_slice(&e.context);
        }
        if e.sync_log {
            block.extend_from_slice(&[0x28, 1]);
        }
    }
    (block.len() == total).then_some(block)
}

/// The encoded size of one entry (without its field 7 tag and length), as
/// protobuf's `compute_size` counts it; `None` past protobuf's u32 sizes.
fn entry_size(e: &raft::eraftpb::Entry) -> Option<usize> {
    let unknown = protobuf::rt::unknown_fields_size(e.get_unknown_fields());
    if unknown != 0 {
        return Some(e.compute_size() as usize);
    }
    let field = |n: u64| 1 + varint_len_u64(n);
    let bytes = |n: usize| 1 + varint_len_u64(n as u64) + n;
    let kind = protobuf::ProtobufEnum::value(&e.entry_type);
    let mut n = 0usize;
    if kind != 0 {
        n += field(i64::from(kind) as u64);
    }
    if e.term != 0 {
        n += field(e.term);
    }
    if e.index != 0 {
        n += field(e.index);
    }
    if !e.data.is_empty() {
        n += bytes(e.data.len());
    }
    if !e.context.is_empty() {
        n += bytes(e.context.len());
    }
    if e.sync_log {
        n += 2;
    }
    u32::try_from(n).ok().map(|_| n)
}

/// Appends `v` as a protobuf varint.
fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Bytes of `n` as a protobuf varint.
fn varint_len_u64(n: u64) -> usize {
    (64 - n.leading_zeros() as usize).max(1).div_ceil(7)
}
