//! `GET /v1/locks`: the query, and the pass over the key table in steps
//! of [`SCAN_STEP_BUCKETS`] buckets.

use std::collections::BTreeSet;

use crate::engine::LockTable;
use crate::time::Millis;

use super::decode::{decimal, percent_decode, BadRequest};
use super::json::json_str;
use super::{View, DEFAULT_PAGE, MAX_PAGE, SCAN_STEP_BUCKETS};

/// Times a listing restarts because the table grew before it answers with
/// what the last pass found.
const SCAN_RESTARTS: u8 = 3;

#[derive(Debug)]
pub(super) struct Listing {
    /// Full tokens for this reader (see [`View::shows_tokens`]).
    pub(super) full_tokens: bool,
    prefix: String,
    after: Option<String>,
    limit: usize,
    cursor: usize,
    buckets: usize,
    restarts: u8,
    /// The smallest `limit + 1` matching keys seen so far.
    found: BTreeSet<Box<str>>,
}

/// Advances a listing by one step; the JSON body once it is done.
pub(super) fn step_listing(l: &mut Listing, now: Millis, view: &View<'_>) -> Option<String> {
    let engine: &dyn LockTable = view.lock_table()?;
    if l.buckets != engine.key_buckets() {
        // The table grew (or this is the first step): the order of its
        // buckets changed, so start the pass again.
        if l.buckets != 0 {
            l.restarts += 1;
        }
        if l.restarts > SCAN_RESTARTS {
            // Answer with what was found rather than chase a growing table.
            l.cursor = usize::MAX;
        } else {
            l.buckets = engine.key_buckets();
            l.cursor = 0;
            l.found.clear();
        }
    }
    if l.cursor < l.buckets {
        let keep = l.limit + 1;
        let (prefix, after, found) = (&l.prefix, l.after.as_deref(), &mut l.found);
        l.cursor = engine.scan_keys(l.cursor, l.cursor + SCAN_STEP_BUCKETS, &mut |k| {
            if !k.starts_with(prefix.as_str()) || after.is_some_and(|a| k <= a) {
                return;
            }
            if found.len() < keep {
                found.insert(k.into());
            } else if found.last().is_some_and(|last| k < &**last) {
                found.insert(k.into());
                found.pop_last();
            }
        });
        if l.cursor < l.buckets {
            return None;
        }
    }
    let mut json = String::from("{\"locks\":[");
    let mut listed = 0;
    let mut last: Option<&str> = None;
    for key in l.found.iter().take(l.limit) {
        let Some(info) = engine.lock_info(now, key) else {
            continue;
        };
        if listed > 0 {
            json.push(',');
        }
        view.lock_json(&mut json, key, &info, l.full_tokens);
        listed += 1;
        last = Some(key);
    }
    json.push_str("],\"next\":");
    match last {
        Some(k) if l.found.len() > l.limit => json_str(&mut json, k),
        _ => json.push_str("null"),
    }
    json.push_str("}\n");
    Some(json)
}

pub(super) fn parse_listing(query: &str, max_key_bytes: usize) -> Result<Listing, BadRequest> {
    let mut prefix = None;
    let mut after = None;
    let mut limit = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value)?;
        let slot = match name {
            "prefix" => &mut prefix,
            "after" => &mut after,
            "limit" => &mut limit,
            _ => return Err(BadRequest::UnknownParameter(name.to_owned())),
        };
        if slot.is_some() {
            return Err(BadRequest::Repeated(name.to_owned()));
        }
        *slot = Some(value);
    }
    let limit = match limit {
        None => DEFAULT_PAGE,
        Some(v) => match decimal(&v).and_then(|n| usize::try_from(n).ok()) {
            Some(n) if (1..=MAX_PAGE).contains(&n) => n,
            _ => return Err(BadRequest::Limit(v)),
        },
    };
    let prefix = prefix.unwrap_or_default();
    if prefix.len() > max_key_bytes {
        return Err(BadRequest::LongerThanKeys("prefix", max_key_bytes));
    }
    if after.as_ref().is_some_and(|a| a.len() > max_key_bytes) {
        return Err(BadRequest::LongerThanKeys("after", max_key_bytes));
    }
    Ok(Listing {
        full_tokens: false,
        prefix,
        after,
        limit,
        cursor: 0,
        buckets: 0,
        restarts: 0,
        found: BTreeSet::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_queries_are_checked() {
        let l = parse_listing("prefix=a%2F&limit=5&after=a%2F1", 64).unwrap();
        assert_eq!((l.prefix.as_str(), l.limit), ("a/", 5));
        assert_eq!(l.after.as_deref(), Some("a/1"));
        assert_eq!(parse_listing("", 64).unwrap().limit, DEFAULT_PAGE);
        for bad in [
            "limit=0",
            "limit=1001",
            "limit=x",
            "foo=1",
            "limit=1&limit=2",
            "prefix=%",
            "limit=+5",
            "limit=%2B5",
            "limit=-1",
            "limit=%205",
            "limit=",
        ] {
            assert!(parse_listing(bad, 64).is_err(), "{bad}");
        }
    }
}
