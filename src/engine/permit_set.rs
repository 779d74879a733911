//! The grants of a key of limit 2 or more: a [`PermitSet`], its grants in
//! a [`Grants`] list that keeps a single grant in place.

use super::Slot;
use crate::time::Millis;

/// Grant vectors of deleted keys kept for new ones, at most (each of at
/// most [`SPARE_GRANTS_CAPACITY`] grants: under 170 KB in all), so that a
/// key taken by two or more holders at once, over and over, does not
/// allocate every time.
pub(super) const SPARE_GRANT_VECS: usize = 64;
/// See [`SPARE_GRANT_VECS`].
pub(super) const SPARE_GRANTS_CAPACITY: usize = 64;

/// The grants of a key registered with a limit of 2 or more.
#[derive(Debug)]
pub(super) struct PermitSet<T> {
    /// How many grants the key admits at once (PROTOCOL §6.2).
    pub(super) limit: u16,
    /// The grants standing, oldest first. An exclusive grant is alone.
    pub(super) grants: Grants<T>,
}

/// One grant of a [`PermitSet`].
#[derive(Debug)]
pub(super) struct Permit<T> {
    pub(super) slot: Slot<T>,
    /// Taken in exclusive mode: no other grant stands beside it.
    pub(super) exclusive: bool,
}

impl<T> PermitSet<T> {
    /// Whether an acquire in this mode fits beside the grants standing
    /// (the queue aside): exclusive when none stands, shared when no
    /// exclusive grant does and a place is free.
    #[inline]
    pub(super) fn fits(&self, exclusive: bool) -> bool {
        if exclusive {
            return self.grants.is_empty();
        }
        self.grants.len() < usize::from(self.limit)
            && !self.grants.first().is_some_and(|g| g.exclusive)
    }

    /// The earliest lease end among the grants (NEVER without grants).
    #[inline]
    pub(super) fn earliest_end(&self) -> Millis {
        self.grants
            .iter()
            .map(|g| g.slot.expires_at)
            .min()
            .unwrap_or(Millis::NEVER)
    }
}

/// The grants of a [`PermitSet`], oldest first: none or one in place, so
/// that a key held by one holder at a time (the common case of a
/// semaphore or a read lock) never allocates; once two stand at once, a
/// vector, which the key keeps until it is deleted. Reads as a slice.
#[derive(Debug)]
pub(super) enum Grants<T> {
    /// None or one grant.
    Small(Option<Permit<T>>),
    /// Any number of grants.
    Many(Vec<Permit<T>>),
}

impl<T> Default for Grants<T> {
    fn default() -> Self {
        Grants::Small(None)
    }
}

impl<T> std::ops::Deref for Grants<T> {
    type Target = [Permit<T>];

    #[inline]
    fn deref(&self) -> &[Permit<T>] {
        match self {
            Grants::Small(one) => one.as_slice(),
            Grants::Many(v) => v,
        }
    }
}

impl<T> std::ops::DerefMut for Grants<T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut [Permit<T>] {
        match self {
            Grants::Small(one) => one.as_mut_slice(),
            Grants::Many(v) => v,
        }
    }
}

impl<'a, T> IntoIterator for &'a Grants<T> {
    type Item = &'a Permit<T>;
    type IntoIter = std::slice::Iter<'a, Permit<T>>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T> Grants<T> {
    /// One grant, in place.
    #[inline]
    pub(super) fn one(permit: Permit<T>) -> Self {
        Grants::Small(Some(permit))
    }

    /// Adds `permit` after the others. A second grant moves both into a
    /// vector: one of `spares` if there is one, else a new one.
    #[inline]
    pub(super) fn push(&mut self, permit: Permit<T>, spares: &mut Vec<Vec<Permit<T>>>) {
        match self {
            Grants::Small(one @ None) => *one = Some(permit),
            Grants::Small(Some(_)) => {
                let mut v = spares.pop().unwrap_or_else(|| Vec::with_capacity(4));
                if let Grants::Small(Some(first)) = std::mem::replace(self, Grants::Small(None)) {
                    v.push(first);
                }
                v.push(permit);
                *self = Grants::Many(v);
            }
            Grants::Many(v) => v.push(permit),
        }
    }

    /// Removes and returns the grant at `pos` (which must be one).
    #[inline]
    pub(super) fn remove(&mut self, pos: usize) -> Permit<T> {
        match self {
            Grants::Small(one) => {
                debug_assert_eq!(pos, 0);
                one.take().expect("the position of a grant")
            }
            Grants::Many(v) => v.remove(pos),
        }
    }

    /// Keeps the grants for which `keep` returns true, in order.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&Permit<T>) -> bool) {
        match self {
            Grants::Small(one) => {
                if one.as_ref().is_some_and(|p| !keep(p)) {
                    *one = None;
                }
            }
            Grants::Many(v) => v.retain(keep),
        }
    }

    /// Gives this list's vector, emptied, to `spares` (unless it holds
    /// [`SPARE_GRANT_VECS`] already or the vector is larger than
    /// [`SPARE_GRANTS_CAPACITY`]): the key is being deleted.
    #[inline(always)]
    pub(super) fn recycle(self, spares: &mut Vec<Vec<Permit<T>>>) {
        if let Grants::Many(v) = self {
            keep_spare(v, spares);
        }
    }
}

/// [`Grants::recycle`] of a vector.
#[inline(never)]
fn keep_spare<T>(mut v: Vec<Permit<T>>, spares: &mut Vec<Vec<Permit<T>>>) {
    if spares.len() < SPARE_GRANT_VECS && v.capacity() <= SPARE_GRANTS_CAPACITY {
        v.clear();
        spares.push(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn permit(token: u64) -> Permit<()> {
        Permit {
            slot: Slot {
                token,
                holder: 0,
                expires_at: Millis(token * 10),
                granted_at: Millis::ZERO,
                tag: (),
            },
            exclusive: false,
        }
    }

    fn tokens(g: &Grants<()>) -> Vec<u64> {
        g.iter().map(|p| p.slot.token).collect()
    }

    /// One grant stays in place; a second moves both into a spare vector,
    /// in order; removals and `retain` keep the order; a deleted key's
    /// vector goes back to the spares, emptied, and a single grant's list
    /// gives none.
    #[test]
    fn grants_keep_one_in_place_and_more_in_a_spare_vector() {
        let mut spares: Vec<Vec<Permit<()>>> = vec![Vec::with_capacity(8)];
        let mut g = Grants::one(permit(1));
        assert!(matches!(g, Grants::Small(Some(_))));
        assert_eq!(tokens(&g), [1]);
        g.push(permit(2), &mut spares);
        assert!(spares.is_empty(), "the spare vector was taken");
        g.push(permit(3), &mut spares);
        g.push(permit(4), &mut spares);
        assert_eq!(tokens(&g), [1, 2, 3, 4]);
        assert_eq!(g.remove(1).slot.token, 2);
        g.retain(|p| p.slot.token != 3);
        assert_eq!(tokens(&g), [1, 4]);
        g.recycle(&mut spares);
        assert_eq!(spares.len(), 1);
        assert!(spares[0].is_empty() && spares[0].capacity() >= 8);

        let mut g = Grants::default();
        g.push(permit(5), &mut spares);
        assert_eq!(spares.len(), 1, "a first grant takes no vector");
        g.retain(|p| p.slot.token != 5);
        assert!(g.is_empty());
        g.push(permit(6), &mut spares);
        assert_eq!(g.remove(0).slot.token, 6);
        g.recycle(&mut spares);
        assert_eq!(spares.len(), 1);
    }

    /// `fits`: an exclusive acquire only into an empty set, a shared one
    /// while a place is free and no exclusive grant stands.
    #[test]
    fn fits_follows_the_mode_and_the_limit() {
        let mut spares = Vec::new();
        let mut set = PermitSet {
            limit: 2,
            grants: Grants::default(),
        };
        assert!(set.fits(true) && set.fits(false));
        set.grants.push(permit(1), &mut spares);
        assert!(!set.fits(true) && set.fits(false));
        set.grants.push(permit(2), &mut spares);
        assert!(!set.fits(false));
        assert_eq!(set.earliest_end(), Millis(10));
        let mut set = PermitSet {
            limit: 2,
            grants: Grants::one(Permit {
                exclusive: true,
                ..permit(3)
            }),
        };
        assert!(!set.fits(false));
        set.grants.remove(0);
        assert_eq!(set.earliest_end(), Millis::NEVER);
    }
}
