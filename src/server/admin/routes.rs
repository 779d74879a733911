//! The admin API's paths: what each request line is answered with.

use std::net::SocketAddr;

use crate::metrics;
use crate::service::{MemberChange, Refusal, RefusalKind};
use crate::time::Millis;

use super::decode::{decimal, decode_key, percent_decode};
use super::http::respond;
use super::json::json_str;
use super::listing::parse_listing;
use super::metrics::render_metrics;
use super::{AdminConn, State, View};

/// Answers one request line: the member-change paths, then the GET paths.
/// Long because it is one match over the admin API's paths, read as its
/// table of contents; each arm is a few lines.
pub(super) fn route(c: &mut AdminConn, now: Millis, method: &str, target: &str, view: &View<'_>) {
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    if let Some(rest) = path.strip_prefix("/v1/cluster/members/") {
        return match parse_member_change(method, rest, query.unwrap_or("")) {
            Ok(change) => c.state = State::Change(change),
            Err((status, why)) => respond(c, status, "text/plain", &format!("{why}\n")),
        };
    }
    let known = matches!(
        path,
        "/livez" | "/readyz" | "/metrics" | "/v1/locks" | "/v1/cluster"
    ) || path.starts_with("/v1/locks/");
    if !known {
        return respond(c, 404, "text/plain", &format!("no such path: {path}\n"));
    }
    if method != "GET" {
        return respond(c, 405, "text/plain", "only GET is served\n");
    }
    match path {
        "/livez" => respond(c, 200, "text/plain", "ok\n"),
        "/readyz" if view.stopping => respond(c, 503, "text/plain", "not ready: shutting down\n"),
        "/readyz" => match view.readiness(now) {
            Ok(()) => respond(c, 200, "text/plain", "ok\n"),
            Err(why) => respond(c, 503, "text/plain", &format!("not ready: {why}\n")),
        },
        "/metrics" => {
            let text = render_metrics(now, view);
            respond(c, 200, metrics::CONTENT_TYPE, &text);
        }
        "/v1/cluster" => match view.observed.and_then(|o| o.cluster_json(now)) {
            Some(json) => respond(c, 200, "application/json", &json),
            None => respond(c, 404, "text/plain", "not a cluster node\n"),
        },
        "/v1/locks" => match parse_listing(query.unwrap_or(""), view.max_key_bytes) {
            Ok(mut listing) => {
                listing.full_tokens = view.shows_tokens(c);
                if view.lock_table().is_none() {
                    return respond(c, 503, "text/plain", "no lock table\n");
                }
                c.state = State::Listing(Box::new(listing));
            }
            Err(why) => respond(c, 400, "text/plain", &format!("{why}\n")),
        },
        _ => {
            let raw = &path["/v1/locks/".len()..];
            let key = match decode_key(raw, view.max_key_bytes) {
                Ok(k) => k,
                Err(why) => return respond(c, 400, "text/plain", &format!("{why}\n")),
            };
            if query.is_some() {
                return respond(c, 400, "text/plain", "/v1/locks/KEY takes no query\n");
            }
            let Some(engine) = view.lock_table() else {
                return respond(c, 503, "text/plain", "no lock table\n");
            };
            match engine.lock_info(now, &key) {
                Some(info) => {
                    let mut json = String::new();
                    view.lock_json(&mut json, &key, &info, view.shows_tokens(c));
                    json.push('\n');
                    respond(c, 200, "application/json", &json);
                }
                None => {
                    let mut json = String::from("{\"error\":\"not registered\",\"key\":");
                    json_str(&mut json, &key);
                    json.push_str("}\n");
                    respond(c, 404, "application/json", &json);
                }
            }
        }
    }
}

/// `POST /v1/cluster/members/ID?address=HOST:PORT` (add a learner),
/// `POST /v1/cluster/members/ID/promote`, `DELETE
/// /v1/cluster/members/ID[?force=true]`.
fn parse_member_change(
    method: &str,
    rest: &str,
    query: &str,
) -> Result<MemberChange, (u16, String)> {
    let (id, action) = match rest.split_once('/') {
        Some((id, action)) => (id, Some(action)),
        None => (rest, None),
    };
    let id: u64 = decimal(id)
        .filter(|id| *id > 0)
        .ok_or_else(|| (400, format!("bad node id {id:?}: a number from 1")))?;
    let mut address = None;
    let mut force = false;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value).map_err(|e| (400, e.to_string()))?;
        match name {
            "address" => {
                address = Some(value.parse::<SocketAddr>().map_err(|_| {
                    (
                        400,
                        format!("address={value:?}: not an IP:PORT peer address"),
                    )
                })?);
            }
            "force" => {
                force = match value.as_str() {
                    "true" | "1" | "" => true,
                    "false" | "0" => false,
                    _ => return Err((400, format!("force={value:?}: true or false"))),
                };
            }
            _ => return Err((400, format!("unknown parameter {name:?}"))),
        }
    }
    match (method, action) {
        ("POST", None) => match address {
            Some(address) if !force => Ok(MemberChange::Add { id, address }),
            Some(_) => Err((400, "force applies to DELETE only".into())),
            None => Err((400, "adding a node needs ?address=IP:PORT".into())),
        },
        ("POST", Some("promote")) if address.is_none() && !force => {
            Ok(MemberChange::Promote { id })
        }
        ("POST", Some("promote")) => Err((400, "promote takes no parameters".into())),
        ("DELETE", None) if address.is_none() => Ok(MemberChange::Remove { id, force }),
        ("DELETE", None) => Err((400, "remove takes only ?force=true".into())),
        (_, Some(a)) if a != "promote" => Err((404, format!("no such action {a:?}"))),
        _ => Err((
            405,
            "members take POST (add, promote) and DELETE (remove)".into(),
        )),
    }
}

/// The HTTP answer to a membership change: 200 with what was proposed,
/// a refusal's status by its kind with its message, 404 when the service
/// takes no membership changes.
pub(super) fn change_answer(outcome: Option<Result<String, Refusal>>) -> (u16, String) {
    match outcome {
        None => (404, "not a cluster node\n".to_owned()),
        Some(Ok(what)) => {
            let mut j = String::from("{\"proposed\":");
            json_str(&mut j, &what);
            j.push_str("}\n");
            (200, j)
        }
        Some(Err(r)) => {
            let status = match r.kind {
                RefusalKind::Invalid => 400,
                RefusalKind::Conflict => 409,
                RefusalKind::NotLeader => 421,
                RefusalKind::Unavailable => 503,
            };
            (status, format!("{}\n", r.message))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_outcomes_get_their_http_status() {
        let refused = |kind| {
            Some(Err(Refusal {
                kind,
                message: "why".into(),
            }))
        };
        assert_eq!(change_answer(None).0, 404);
        assert_eq!(
            change_answer(Some(Ok("remove 3".into()))),
            (200, "{\"proposed\":\"remove 3\"}\n".to_owned())
        );
        assert_eq!(
            change_answer(refused(RefusalKind::Invalid)),
            (400, "why\n".to_owned())
        );
        assert_eq!(change_answer(refused(RefusalKind::Conflict)).0, 409);
        assert_eq!(change_answer(refused(RefusalKind::NotLeader)).0, 421);
        assert_eq!(change_answer(refused(RefusalKind::Unavailable)).0, 503);
    }

    #[test]
    fn member_changes_take_a_decimal_node_id() {
        assert!(parse_member_change("DELETE", "2", "").is_ok());
        for bad in ["+2", "0", "", "2x", "-2"] {
            let err = parse_member_change("DELETE", bad, "").err();
            assert_eq!(err.map(|(status, _)| status), Some(400), "{bad:?}");
        }
    }
}
