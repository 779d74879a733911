//! The connection table: which queues each connection's waiters are in,
//! so that a disconnect visits only those.

use std::collections::HashMap;
use std::sync::Arc;

use super::ConnId;

/// No slot: the end of a free list in [`ConnWaiters::slots`].
pub(super) const NO_SLOT: u32 = u32::MAX;

/// Waiter and connection indices are `u32`: queued acquires beyond this are
/// answered Busy whatever `max_waiters` says, so no index can overflow.
pub(super) const WAITERS_CEILING: usize = (u32::MAX - 1) as usize;

/// Emptied slot lists kept for reuse, and the largest one kept: a connection
/// that queues now and then does not allocate once the engine is warm.
const SPARE_SLOT_LISTS: usize = 64;
const SPARE_SLOTS_MAX_LEN: usize = 64;

/// One entry of a connection's waiter list: 16 bytes.
#[derive(Debug)]
pub(super) enum ConnSlot {
    /// A waiter of the connection is queued on this key (the queue's own
    /// shared copy of the key).
    Queued(Arc<str>),
    /// Vacant; the next vacant entry, or [`NO_SLOT`].
    Free(u32),
}

/// The waiters of one connection, so that a disconnect visits only the
/// queues it is in. Exists while the connection has waiters.
#[derive(Debug)]
pub(super) struct ConnWaiters {
    pub(super) id: ConnId,
    /// The connection's holder number
    /// ([`Caller::holder`](super::Caller::holder)): its waiters' grants
    /// record it.
    pub(super) holder: u64,
    /// The key of each of the connection's waiters, at the index that waiter
    /// records in [`Waiter::slot`](super::waiters::Waiter::slot). Entries
    /// never move while in use.
    pub(super) slots: Vec<ConnSlot>,
    /// Head of the free list in `slots`, or [`NO_SLOT`].
    pub(super) free: u32,
    /// Waiters of this connection (the `Queued` entries of `slots`).
    pub(super) count: u32,
}

/// The connections that have waiters. A waiter names its connection by its
/// index here (4 bytes, not the 8 of a [`ConnId`]), which keeps a waiter at
/// 32 bytes with its slot index beside it.
#[derive(Debug, Default)]
pub(super) struct ConnTable {
    pub(super) index: HashMap<ConnId, u32>,
    pub(super) conns: slab::Slab<ConnWaiters>,
    pub(super) spare: Vec<Vec<ConnSlot>>,
}

impl ConnTable {
    /// Records a waiter of `conn` on `key`: its connection index and slot.
    /// The caller keeps the number of waiters at most [`WAITERS_CEILING`], so
    /// neither index can reach [`NO_SLOT`].
    pub(super) fn add(&mut self, conn: ConnId, holder: u64, key: Arc<str>) -> (u32, u32) {
        let idx = match self.index.get(&conn) {
            Some(&i) => i,
            None => {
                let slots = self.spare.pop().unwrap_or_else(|| Vec::with_capacity(1));
                let i = self.conns.insert(ConnWaiters {
                    id: conn,
                    holder,
                    slots,
                    free: NO_SLOT,
                    count: 0,
                });
                let i = u32::try_from(i).expect("connections with waiters < WAITERS_CEILING");
                self.index.insert(conn, i);
                i
            }
        };
        let cw = &mut self.conns[idx as usize];
        let slot = if cw.free == NO_SLOT {
            cw.slots.push(ConnSlot::Queued(key));
            u32::try_from(cw.slots.len() - 1).expect("waiters < WAITERS_CEILING")
        } else {
            let s = cw.free;
            let entry = std::mem::replace(&mut cw.slots[s as usize], ConnSlot::Queued(key));
            let ConnSlot::Free(next) = entry else {
                unreachable!("the free list holds only free entries")
            };
            cw.free = next;
            s
        };
        cw.count += 1;
        (idx, slot)
    }

    /// Forgets the waiter at (`idx`, `slot`) and returns its connection's id.
    /// The connection's entry goes when its last waiter does.
    pub(super) fn remove(&mut self, idx: u32, slot: u32) -> ConnId {
        let cw = &mut self.conns[idx as usize];
        cw.slots[slot as usize] = ConnSlot::Free(cw.free);
        cw.free = slot;
        cw.count -= 1;
        let id = cw.id;
        if cw.count == 0 {
            let cw = self.conns.remove(idx as usize);
            self.index.remove(&id);
            self.recycle(cw.slots);
        }
        id
    }

    pub(super) fn recycle(&mut self, mut slots: Vec<ConnSlot>) {
        if self.spare.len() < SPARE_SLOT_LISTS && slots.capacity() <= SPARE_SLOTS_MAX_LEN {
            slots.clear();
            self.spare.push(slots);
        }
    }
}
