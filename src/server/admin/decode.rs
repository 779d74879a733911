//! Paths and queries decoded and checked: percent-decoding, keys, decimal
//! numbers, and why a request is answered 400.

use std::fmt;

use super::MAX_PAGE;

/// Why a path or a query is answered 400.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum BadRequest {
    /// A `%` not followed by two hex digits, at this byte.
    PercentEncoding(usize),
    /// Not UTF-8 once percent-decoded.
    NotUtf8,
    /// `/v1/locks/` with no key.
    EmptyKey,
    /// A key over `--max-key-bytes`.
    KeyTooLong(usize),
    /// A key with a newline.
    KeyNewline,
    /// A query parameter `/v1/locks` does not take.
    UnknownParameter(String),
    /// A query parameter given twice.
    Repeated(String),
    /// `limit` out of range.
    Limit(String),
    /// `prefix` or `after` longer than any key can be.
    LongerThanKeys(&'static str, usize),
}

impl fmt::Display for BadRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadRequest::PercentEncoding(i) => write!(f, "bad percent-encoding at byte {i}"),
            BadRequest::NotUtf8 => f.write_str("not UTF-8 once percent-decoded"),
            BadRequest::EmptyKey => f.write_str("empty key"),
            BadRequest::KeyTooLong(max) => write!(f, "key longer than {max} bytes"),
            BadRequest::KeyNewline => f.write_str("a key cannot contain a newline"),
            BadRequest::UnknownParameter(name) => write!(
                f,
                "unknown query parameter {name:?}: expected prefix, limit, after"
            ),
            BadRequest::Repeated(name) => write!(f, "query parameter {name} given twice"),
            BadRequest::Limit(v) => write!(f, "limit must be 1..={MAX_PAGE}, not {v:?}"),
            BadRequest::LongerThanKeys(what, max) => {
                write!(f, "{what} longer than the longest key ({max} bytes)")
            }
        }
    }
}

/// A key from a request path: percent-decoded, UTF-8, 1..=`max` bytes,
/// no newline (PROTOCOL §1).
pub(super) fn decode_key(raw: &str, max: usize) -> Result<String, BadRequest> {
    let key = percent_decode(raw)?;
    if key.is_empty() {
        return Err(BadRequest::EmptyKey);
    }
    if key.len() > max {
        return Err(BadRequest::KeyTooLong(max));
    }
    if key.contains('\n') {
        return Err(BadRequest::KeyNewline);
    }
    Ok(key)
}

/// A number written in decimal digits only: no sign, no space, no empty
/// string (Rust's integer parsing would take `+5` for 5).
pub(super) fn decimal(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `%XX` escapes decoded; the result must be UTF-8. `+` stays `+`.
pub(super) fn percent_decode(s: &str) -> Result<String, BadRequest> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    // Exactly two hex digits (RFC 3986 `pct-encoded`): `from_str_radix`
    // would also take a sign, decoding `%+1` as 0x01.
    let digit = |j: usize| b.get(j).and_then(|&c| char::from(c).to_digit(16));
    while i < b.len() {
        if b[i] == b'%' {
            match (digit(i + 1), digit(i + 2)) {
                // Two hex digits make at most 0xff.
                (Some(hi), Some(lo)) => out.push(u8::try_from(hi << 4 | lo).unwrap_or(u8::MAX)),
                _ => return Err(BadRequest::PercentEncoding(i)),
            }
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| BadRequest::NotUtf8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding_takes_escapes_and_refuses_bad_ones() {
        assert_eq!(percent_decode("a%2Fb%20c+d").unwrap(), "a/b c+d");
        assert_eq!(percent_decode("%e2%82%ac").unwrap(), "\u{20ac}");
        assert_eq!(percent_decode("a%2"), Err(BadRequest::PercentEncoding(1)));
        assert_eq!(percent_decode("a%zz"), Err(BadRequest::PercentEncoding(1)));
        // A sign is no hex digit.
        assert_eq!(percent_decode("a%+1"), Err(BadRequest::PercentEncoding(1)));
        assert_eq!(percent_decode("%-1"), Err(BadRequest::PercentEncoding(0)));
        assert_eq!(percent_decode("%4"), Err(BadRequest::PercentEncoding(0)));
        assert_eq!(percent_decode("%41%4a%4A"), Ok("AJJ".to_owned()));
        assert_eq!(percent_decode("%ff"), Err(BadRequest::NotUtf8));
    }

    proptest::proptest! {
        /// Every string survives being percent-encoded byte by byte (upper
        /// or lower case hex) and decoded.
        #[test]
        fn percent_decoding_inverts_encoding(s in ".{0,16}", upper: bool) {
            let encoded: String = s
                .bytes()
                .map(|b| if upper { format!("%{b:02X}") } else { format!("%{b:02x}") })
                .collect();
            proptest::prop_assert_eq!(percent_decode(&encoded), Ok(s));
        }

        /// Any input decodes to at most its own length or is refused; a
        /// refusal names a `%` at or after which the escape is bad.
        #[test]
        fn percent_decoding_never_panics(s in "[%0-9a-fA-F+\\-z\u{e9}]{0,12}") {
            match percent_decode(&s) {
                Ok(d) => proptest::prop_assert!(d.len() <= s.len()),
                Err(BadRequest::PercentEncoding(i)) => {
                    proptest::prop_assert_eq!(s.as_bytes()[i], b'%');
                }
                Err(e) => proptest::prop_assert_eq!(e, BadRequest::NotUtf8),
            }
        }
    }

    #[test]
    fn a_key_is_checked_like_one_on_the_wire() {
        assert_eq!(decode_key("db%2F1", 10).unwrap(), "db/1");
        assert_eq!(decode_key("", 10), Err(BadRequest::EmptyKey));
        assert_eq!(decode_key("a%0Ab", 10), Err(BadRequest::KeyNewline));
        assert_eq!(
            decode_key("abcdefghijk", 10),
            Err(BadRequest::KeyTooLong(10))
        );
        assert_eq!(
            decode_key("abcdefghijk", 10).unwrap_err().to_string(),
            "key longer than 10 bytes"
        );
    }

    #[test]
    fn numbers_are_decimal_digits_only() {
        assert_eq!(decimal("0"), Some(0));
        assert_eq!(decimal("0042"), Some(42));
        assert_eq!(decimal("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            "+2",
            "-2",
            " 2",
            "2 ",
            "0x2",
            "18446744073709551616",
            "\u{663}",
        ] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
    }
}
