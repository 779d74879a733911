//! [`ReadBuf`]: the one read buffer of everything that reads frames from a
//! byte stream (the server's connections, the client's reader, the
//! benchmark's load generator and limit servers).
//!
//! Received bytes live in one zero-initialised `Vec<u8>` between a start
//! and an end: a reader reads into the free end ([`ReadBuf::spare`] or
//! [`ReadBuf::read_from`]), decodes frames from the front
//! ([`ReadBuf::data`]) and [`consume`](ReadBuf::consume)s what it handled.
//! [`ReadBuf::make_room`] moves the unhandled bytes to the front only when
//! the free end is too short, and grows the buffer only when that is not
//! enough, never beyond a cap the caller gives (its largest frame): one
//! incomplete frame that does not fit grows it, complete frames not yet
//! handled do not. No allocation happens on the way of a frame that fits.
//!
//! ```
//! use ticketd::readbuf::ReadBuf;
//!
//! let mut b = ReadBuf::new(16);
//! assert!(b.make_room(1, 64));
//! let mut input: &[u8] = b"A 1 k\nR 2";
//! assert_eq!(b.read_from(&mut input).unwrap(), 9);
//! let line = b.data().iter().position(|&c| c == b'\n').unwrap();
//! assert_eq!(&b.data()[..line], b"A 1 k");
//! b.consume(line + 1);
//! assert_eq!(b.data(), b"R 2", "the frame not yet complete stays");
//! ```

use std::io::{self, Read};

/// A read buffer: `buf[start..end]` is received and not yet handled;
/// `buf.len()` is the capacity (zeroed once when it grows).
#[derive(Debug, Clone)]
pub struct ReadBuf {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    initial: usize,
}

impl ReadBuf {
    /// An empty buffer of `initial` bytes, the size that
    /// [`ReadBuf::shrink_if_empty`] returns it to (0: no memory until the
    /// first [`ReadBuf::make_room`]).
    pub fn new(initial: usize) -> Self {
        ReadBuf {
            buf: vec![0; initial],
            start: 0,
            end: 0,
            initial,
        }
    }

    /// The received bytes not yet handled.
    #[inline]
    pub fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// How many received bytes are not yet handled.
    #[inline]
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Nothing received is left unhandled.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The buffer's size now (what it holds plus what it has room for).
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// The first `n` bytes of [`ReadBuf::data`] are handled.
    ///
    /// # Panics
    ///
    /// With debug assertions, when `n` is more than [`ReadBuf::len`] (a
    /// caller's bug; without them the next [`ReadBuf::data`] panics).
    #[inline]
    pub fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.len(), "consumed more than was received");
        self.start += n;
    }

    /// Drops every unhandled byte.
    #[inline]
    pub fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }

    /// Makes at least `want` bytes free at the end for a read, if it can:
    /// forgets the handled bytes, moves the unhandled ones to the front when
    /// the free end is shorter than `want`, and grows the buffer (doubling,
    /// up to `cap` bytes) when that is still not enough. Returns whether any
    /// room is free: false only when the buffer is full and at `cap` (it
    /// holds `cap` unhandled bytes). With `want` 1 it moves bytes only when
    /// the buffer is full, and grows only when it is full of one incomplete
    /// frame.
    #[inline]
    pub fn make_room(&mut self, want: usize, cap: usize) -> bool {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.buf.len() - self.end < want && self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.buf.len() - self.end < want && self.buf.len() < cap {
            let grown = (self.buf.len() * 2).max(self.end + want).min(cap);
            self.buf.resize(grown, 0);
        }
        self.end < self.buf.len()
    }

    /// The free end of the buffer, to read into; then [`ReadBuf::filled`].
    #[inline]
    pub fn spare(&mut self) -> &mut [u8] {
        &mut self.buf[self.end..]
    }

    /// How many bytes [`ReadBuf::spare`] offers.
    #[inline]
    pub fn spare_len(&self) -> usize {
        self.buf.len() - self.end
    }

    /// `n` bytes were read into the front of [`ReadBuf::spare`].
    ///
    /// # Panics
    ///
    /// When `n` is more than [`ReadBuf::spare_len`] (a caller's bug).
    #[inline]
    pub fn filled(&mut self, n: usize) {
        assert!(n <= self.spare_len(), "filled more than the spare room");
        self.end += n;
    }

    /// One `read` from `r` into the free end, retrying `Interrupted`;
    /// returns what `read` returned (0: the end of the stream, or no room:
    /// call [`ReadBuf::make_room`] first).
    #[inline]
    pub fn read_from<R: Read + ?Sized>(&mut self, r: &mut R) -> io::Result<usize> {
        loop {
            match r.read(&mut self.buf[self.end..]) {
                Ok(n) => {
                    // A reader that claims more than it was offered is
                    // broken; never move past the buffer for it.
                    let n = n.min(self.buf.len() - self.end);
                    self.end += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Appends `bytes` received some other way (a sans-IO caller is handed
    /// them), growing the buffer as much as they need: the caller bounds
    /// what it appends and handles what is complete before appending more.
    pub fn append(&mut self, bytes: &[u8]) {
        self.make_room(bytes.len(), usize::MAX);
        self.spare()[..bytes.len()].copy_from_slice(bytes);
        self.end += bytes.len();
    }

    /// Gives a grown buffer back (to its initial size) once it is empty, so
    /// a reader that once received a long frame does not keep the memory.
    pub fn shrink_if_empty(&mut self) {
        if self.start == self.end && self.buf.len() > self.initial {
            self.buf = vec![0; self.initial];
            self.start = 0;
            self.end = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out its bytes in the given pieces.
    struct Pieces<'a>(Vec<&'a [u8]>);

    impl Read for Pieces<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let Some(first) = self.0.first_mut() else {
                return Ok(0);
            };
            let n = first.len().min(out.len());
            out[..n].copy_from_slice(&first[..n]);
            *first = &first[n..];
            if first.is_empty() {
                self.0.remove(0);
            }
            Ok(n)
        }
    }

    /// Reads `r` to its end through `b`, splitting at newlines.
    fn lines(b: &mut ReadBuf, r: &mut impl Read, cap: usize) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        loop {
            while let Some(i) = b.data().iter().position(|&c| c == b'\n') {
                out.push(b.data()[..i].to_vec());
                b.consume(i + 1);
            }
            assert!(b.make_room(1, cap), "a line longer than the cap");
            if b.read_from(r).unwrap() == 0 {
                return out;
            }
        }
    }

    #[test]
    fn a_frame_split_across_reads_is_whole_once_its_last_piece_arrives() {
        let mut b = ReadBuf::new(4);
        let mut r = Pieces(vec![b"A 1 ", b"key", b"\nR 2 key\nE", b" 3 k\n"]);
        let got = lines(&mut b, &mut r, 64);
        assert_eq!(got, [&b"A 1 key"[..], b"R 2 key", b"E 3 k"]);
        assert!(b.is_empty());
    }

    #[test]
    fn full_of_handled_and_unhandled_bytes_it_compacts_rather_than_grows() {
        let mut b = ReadBuf::new(8);
        let mut r: &[u8] = b"abcdefgh";
        b.read_from(&mut r).unwrap();
        b.consume(5);
        assert!(b.make_room(1, 1024));
        assert_eq!(b.capacity(), 8, "room came from moving, not growing");
        assert_eq!(b.data(), b"fgh");
        assert_eq!(b.spare_len(), 5);
        // Free room at the end that is long enough is used as it is.
        b.consume(1);
        assert!(b.make_room(3, 1024));
        assert_eq!((b.data(), b.spare_len()), (&b"gh"[..], 5));
        // Asking for more than is free at the end moves the bytes first.
        assert!(b.make_room(6, 1024));
        assert_eq!((b.data(), b.capacity()), (&b"gh"[..], 8));
    }

    #[test]
    fn it_grows_for_one_incomplete_frame_up_to_the_cap_and_no_further() {
        let mut b = ReadBuf::new(4);
        let long = [b'x'; 100];
        let mut r: &[u8] = &long;
        let mut sizes = Vec::new();
        while b.make_room(1, 20) {
            b.read_from(&mut r).unwrap();
            sizes.push(b.capacity());
        }
        assert_eq!(sizes, [4, 8, 16, 20]);
        assert_eq!(b.len(), 20, "full at the cap");
        assert_eq!(b.spare_len(), 0);
        assert_eq!(b.read_from(&mut r).unwrap(), 0, "no room: nothing read");
        // Once handled, the room comes back; once empty, the memory too.
        b.consume(20);
        b.shrink_if_empty();
        assert_eq!(b.capacity(), 4);
        assert!(b.make_room(1, 20));
    }

    #[test]
    fn a_cap_below_the_initial_size_never_grows_it() {
        let mut b = ReadBuf::new(16);
        assert!(b.make_room(32, 8));
        assert_eq!(b.capacity(), 16);
    }

    #[test]
    fn append_grows_for_what_it_is_given_and_keeps_what_was_unhandled() {
        let mut b = ReadBuf::new(0);
        assert_eq!(b.capacity(), 0, "no memory before the first bytes");
        b.append(b"R 1 ke");
        b.consume(2);
        b.append(b"y\nA 2 a-much-longer-key\n");
        assert_eq!(b.data(), b"1 key\nA 2 a-much-longer-key\n");
        b.consume(b.len());
        b.shrink_if_empty();
        assert_eq!(b.capacity(), 0);
    }

    #[test]
    fn clear_drops_unhandled_bytes_and_keeps_the_memory() {
        let mut b = ReadBuf::new(4);
        let mut r: &[u8] = b"abcdef";
        assert!(b.make_room(1, 8));
        b.read_from(&mut r).unwrap();
        assert!(b.make_room(1, 8));
        b.read_from(&mut r).unwrap();
        assert_eq!(b.data(), b"abcdef");
        b.clear();
        assert!(b.is_empty());
        assert_eq!(b.capacity(), 8);
    }

    #[test]
    fn filled_after_writing_into_spare_makes_the_bytes_data() {
        let mut b = ReadBuf::new(4);
        b.spare()[..2].copy_from_slice(b"hi");
        b.filled(2);
        assert_eq!(b.data(), b"hi");
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "consumed more than was received")]
    fn consuming_more_than_received_is_a_bug_caught_at_once() {
        let mut b = ReadBuf::new(4);
        b.filled(1);
        b.consume(2);
    }
}
