//! The admin port's JSON: a lock, and strings escaped.

use std::fmt::Write as _;

use crate::engine::LockInfo;

/// `{"key":..,"token":..,"sequence":..,"holder":..,"expires_in_ms":..,
/// "waiters":..,"held_for_ms":..}`. The token is `null` unless `full`: a
/// token releases its grant, so only `--admin-identity` reads it; anyone
/// reads its sequence (the token without its random bits), which orders
/// grants as tokens do. `holder` names the identity that took the grant
/// when it is known.
pub(super) fn lock_json(
    out: &mut String,
    key: &str,
    info: &LockInfo,
    full: bool,
    holder: Option<&str>,
) {
    out.push_str("{\"key\":");
    json_str(out, key);
    out.push_str(",\"token\":");
    json_opt(out, full.then_some(info.token));
    let _ = write!(
        out,
        ",\"sequence\":{},\"holder\":",
        info.token >> crate::token::RANDOM_BITS
    );
    match holder {
        Some(h) => json_str(out, h),
        None => out.push_str("null"),
    }
    out.push_str(",\"expires_in_ms\":");
    json_opt(out, info.expires_in_ms);
    let _ = write!(out, ",\"waiters\":{},\"held_for_ms\":", info.waiters);
    json_opt(out, info.held_for_ms);
    out.push('}');
}

fn json_opt(out: &mut String, v: Option<u64>) {
    match v {
        Some(v) => {
            let _ = write!(out, "{v}");
        }
        None => out.push_str("null"),
    }
}

/// A JSON string: `"`, `\` and control characters escaped.
pub fn json_str(out: &mut String, s: &str) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_escape_quotes_and_controls() {
        let mut s = String::new();
        json_str(&mut s, "a\"b\\c\u{1}\u{e9}");
        assert_eq!(s, "\"a\\\"b\\\\c\\u0001\u{e9}\"");
    }
}
