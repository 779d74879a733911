//! The admin port's JSON: a lock, and strings escaped.

use std::fmt::Write as _;

use crate::engine::{LockInfo, PermitsInfo};

/// `{"key":..,"token":..,"sequence":..,"holder":..,"expires_in_ms":..,
/// "waiters":..,"held_for_ms":..}`. The token is `null` unless `full`: a
/// token releases its grant, so only `--admin-identity` reads it; anyone
/// reads its sequence (the token without its random bits), which orders
/// grants as tokens do. `holder` names the identity that took the grant
/// when it is known (`name_of` a holder number). A key of limit 2 or more
/// is [`permits_json`].
pub(super) fn lock_json(
    out: &mut String,
    key: &str,
    info: &LockInfo,
    full: bool,
    name_of: &dyn Fn(u64) -> Option<String>,
) {
    if let Some(permits) = &info.permits {
        return permits_json(out, key, info.waiters, permits, full, name_of);
    }
    let holder = name_of(info.holder);
    let holder = holder.as_deref();
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

/// A key of limit 2 or more (PROTOCOL §6): `{"key":..,"limit":..,
/// "holders":[{"token":..,"sequence":..,"holder":..,"mode":..,
/// "expires_in_ms":..,"held_for_ms":..},..],"waiters":..,
/// "waiters_shared":..,"waiters_exclusive":..}`, the holders oldest first,
/// each shown as [`lock_json`] shows a mutex's grant.
fn permits_json(
    out: &mut String,
    key: &str,
    waiters: usize,
    p: &PermitsInfo,
    full: bool,
    name_of: &dyn Fn(u64) -> Option<String>,
) {
    out.push_str("{\"key\":");
    json_str(out, key);
    let _ = write!(out, ",\"limit\":{},\"holders\":[", p.limit);
    for (i, g) in p.grants.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"token\":");
        json_opt(out, full.then_some(g.token));
        let _ = write!(
            out,
            ",\"sequence\":{},\"holder\":",
            g.token >> crate::token::RANDOM_BITS
        );
        match name_of(g.holder) {
            Some(h) => json_str(out, &h),
            None => out.push_str("null"),
        }
        let _ = write!(out, ",\"mode\":\"{}\",\"expires_in_ms\":", g.mode);
        json_opt(out, g.expires_in_ms);
        out.push_str(",\"held_for_ms\":");
        json_opt(out, g.held_for_ms);
        out.push('}');
    }
    let _ = write!(
        out,
        "],\"waiters\":{waiters},\"waiters_shared\":{},\"waiters_exclusive\":{}}}",
        p.waiters_shared,
        waiters - p.waiters_shared
    );
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
