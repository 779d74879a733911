//! `ticket cluster status | add | promote | remove`: a cluster's members,
//! over the admin port.

use std::ffi::OsString;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use ticketd::client::admin::{self, Json};

use crate::admin::{
    admin_addr, admin_get, admin_request, admin_tls, num, parse_json, print_out, HELP_ADMIN,
};
use crate::args::finish;
use crate::{exit, failed, Exit};

/// How long `ticket cluster add/promote/remove` looks for a leader that
/// takes the change (an election may be under way).
const CHANGE_DEADLINE: Duration = Duration::from_secs(20);
/// How long one admin port gets to answer a change in that search.
const CHANGE_TRY_TIMEOUT: Duration = Duration::from_secs(3);

/// `ticket cluster status`.
pub(crate) fn cluster(args: Vec<OsString>) -> Result<u8, Exit> {
    let mut args = pico_args::Arguments::from_vec(args);
    if args.contains(["-h", "--help"]) {
        print!("{HELP_ADMIN}");
        return Ok(exit::OK);
    }
    match args.subcommand().map_err(|e| Exit::usage(e.to_string()))? {
        Some(s) if s == "status" => {}
        Some(s) if s == "add" || s == "promote" || s == "remove" => {
            return cluster_change(&s, args);
        }
        Some(other) => return Err(Exit::usage(format!("unknown cluster subcommand {other:?}"))),
        None => {
            return Err(Exit::usage(
                "cluster: missing subcommand (status, add, promote, remove)",
            ))
        }
    }
    let json = args.contains("--json");
    let addr = admin_addr(&mut args)?;
    finish(args)?;
    let body = admin_get(&addr, "/v1/cluster")?
        .ok_or_else(|| failed(format!("{addr} is not a cluster node")))?;
    if json {
        return print_out(&body);
    }
    let v = parse_json(&body)?;
    print_out(&cluster_text(&v))
}

/// `ticket cluster status`: the node's view and a table of the members.
fn cluster_text(v: &Json) -> String {
    let leader = v.get("leader").and_then(Json::as_u64).unwrap_or(0);
    let mut text = format!(
        "node {}: leader {}, term {}, commit {}, applied {}\n\n",
        num(v.get("id")),
        if leader == 0 {
            "none".to_string()
        } else {
            leader.to_string()
        },
        num(v.get("term")),
        num(v.get("commit")),
        num(v.get("applied")),
    );
    let mut rows = vec![vec![
        "ID".to_string(),
        "ADDRESS".into(),
        "ROLE".into(),
        "MATCH".into(),
        "REACHABLE".into(),
    ]];
    for (list, learner) in [("voters", false), ("learners", true)] {
        for m in v.get(list).map(Json::items).unwrap_or(&[]) {
            let id = m.get("id").and_then(Json::as_u64).unwrap_or(0);
            let role = match (learner, id == leader) {
                (true, _) => "learner",
                (false, true) => "leader",
                (false, false) => "voter",
            };
            rows.push(vec![
                id.to_string(),
                m.get("address")
                    .and_then(Json::as_str)
                    .unwrap_or("-")
                    .to_owned(),
                role.into(),
                num(m.get("match")),
                match m.get("reachable") {
                    Some(Json::Bool(true)) => "yes".into(),
                    Some(Json::Bool(false)) => "no".into(),
                    _ => "-".into(),
                },
            ]);
        }
    }
    text.push_str(&admin::table(&rows));
    if matches!(v.get("joint"), Some(Json::Bool(true))) {
        let outgoing: Vec<String> = v
            .get("voters_outgoing")
            .map(Json::items)
            .unwrap_or(&[])
            .iter()
            .filter_map(Json::as_u64)
            .map(|id| id.to_string())
            .collect();
        text.push_str(&format!(
            "joint configuration: the voters above and the outgoing voters {} must both \
             agree until the change completes\n",
            outgoing.join(",")
        ));
    }
    text
}

/// The most entries a learner may lag the leader's commit to be promoted.
const CATCH_UP_ENTRIES: u64 = 100;

/// The node of `cluster add | promote | remove`: `ID`, or `ID=HOST:PORT`
/// for add.
fn parse_member(sub: &str, what: &str) -> Result<(u64, Option<SocketAddr>), Exit> {
    let usage = |m: String| Exit::usage(format!("cluster {sub}: {m}"));
    let (id, address) = match (sub, what.split_once('=')) {
        ("add", Some((id, a))) => (id, Some(a)),
        ("add", None) => return Err(usage(format!("{what:?}: give ID=HOST:PORT"))),
        (_, None) => (what, None),
        (_, Some(_)) => return Err(usage(format!("{what:?}: give the node id only"))),
    };
    let id: u64 = id
        .parse()
        .ok()
        .filter(|i| *i > 0)
        .ok_or_else(|| usage(format!("{id:?} is not a node id (1, 2, ...)")))?;
    let address = match address {
        Some(a) => Some(
            a.to_socket_addrs()
                .ok()
                .and_then(|mut i| i.next())
                .ok_or_else(|| usage(format!("{a:?} is not a HOST:PORT that resolves")))?,
        ),
        None => None,
    };
    Ok((id, address))
}

/// The admin request that makes the change.
fn member_request(
    sub: &str,
    id: u64,
    address: Option<SocketAddr>,
    force: bool,
) -> (String, &'static str) {
    match sub {
        "add" => (
            format!(
                "/v1/cluster/members/{id}?address={}",
                admin::percent_encode(&address.map(|a| a.to_string()).unwrap_or_default())
            ),
            "POST",
        ),
        "promote" => (format!("/v1/cluster/members/{id}/promote"), "POST"),
        _ => (
            format!(
                "/v1/cluster/members/{id}{}",
                if force { "?force=true" } else { "" }
            ),
            "DELETE",
        ),
    }
}

/// `ticket cluster add | promote | remove`.
fn cluster_change(sub: &str, mut args: pico_args::Arguments) -> Result<u8, Exit> {
    let usage = |m: String| Exit::usage(format!("cluster {sub}: {m}"));
    let learner_only = sub == "add" && args.contains("--learner");
    let force = sub == "remove" && args.contains("--force");
    let catch_up: u64 = if sub == "add" {
        args.opt_value_from_str("--catch-up-timeout")
            .map_err(|e| usage(e.to_string()))?
            .unwrap_or(60)
    } else {
        60
    };
    let mut admins: Vec<String> = args
        .values_from_str("--admin")
        .map_err(|e| usage(e.to_string()))?;
    if admins.is_empty() {
        admins.push(ticketd::config::DEFAULT_ADMIN_LISTEN.to_owned());
    }
    admin_tls(&mut args)?;
    let what: String = args
        .free_from_str()
        .map_err(|_| usage("missing the node (ID, or ID=HOST:PORT for add)".into()))?;
    finish(args)?;
    let (id, address) = parse_member(sub, &what)?;
    let (target, method) = member_request(sub, id, address, force);
    let leader = send_change(&admins, method, &target)?;
    match sub {
        "add" => {
            eprintln!("node {id} added as a learner (via {leader})");
            // The change is over once raft has left the joint configuration.
            wait_applied(&leader, |v| member_of(v, "learners", id))?;
            if learner_only {
                return Ok(exit::OK);
            }
            wait_caught_up(&leader, id, Duration::from_secs(catch_up))?;
            let target = format!("/v1/cluster/members/{id}/promote");
            let leader = send_change(&admins, "POST", &target)?;
            wait_applied(&leader, |v| member_of(v, "voters", id))?;
            eprintln!("node {id} promoted to voter");
        }
        "promote" => {
            wait_applied(&leader, |v| member_of(v, "voters", id))?;
            eprintln!("node {id} promoted to voter");
        }
        _ => {
            // The leader may have removed itself: any node will do.
            let _ = wait_applied(&leader, |v| {
                !member_of(v, "voters", id) && !member_of(v, "learners", id)
            });
            eprintln!("node {id} removed; its id is never accepted again");
        }
    }
    Ok(exit::OK)
}

fn member_of(v: &Json, list: &str, id: u64) -> bool {
    v.get(list)
        .map(Json::items)
        .unwrap_or(&[])
        .iter()
        .any(|m| m.get("id").and_then(Json::as_u64) == Some(id))
}

/// Sends a change to the first admin port that is the leader's; returns
/// that address.
fn send_change(admins: &[String], method: &str, target: &str) -> Result<String, Exit> {
    let deadline = Instant::now() + CHANGE_DEADLINE;
    loop {
        let mut why = Vec::new();
        let mut retry = false;
        for a in admins {
            // A node that does not answer (stopped, partitioned) must not
            // use up the whole deadline: each port gets a short turn.
            let left = deadline.saturating_duration_since(Instant::now());
            let timeout = CHANGE_TRY_TIMEOUT.min(left).max(Duration::from_millis(100));
            match admin_request(a, method, target, timeout) {
                Ok((200, _)) => return Ok(a.clone()),
                Ok((421, body)) => why.push(format!("{a}: {}", body.trim())),
                Ok((503, body)) => {
                    retry = true;
                    why.push(format!("{a}: {}", body.trim()));
                }
                Ok((status, body)) => {
                    return Err(failed(format!("{a}: {status}: {}", body.trim())));
                }
                Err(e) if e.status == exit::USAGE => return Err(e),
                Err(e) => {
                    // Unreachable now; it may be the leader once it is back.
                    retry = true;
                    why.push(e.message);
                }
            }
        }
        if !retry || Instant::now() >= deadline {
            return Err(failed(format!(
                "no admin port took the change: {}",
                why.join("; ")
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until `ok` holds of the leader's `/v1/cluster` and no change is
/// pending.
fn wait_applied(addr: &str, ok: impl Fn(&Json) -> bool) -> Result<(), Exit> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(body)) = admin_get(addr, "/v1/cluster") {
            if let Ok(v) = Json::parse(&body) {
                let pending = matches!(v.get("change_pending"), Some(Json::Bool(true)));
                if ok(&v) && !pending {
                    return Ok(());
                }
            }
        }
        if Instant::now() >= deadline {
            return Err(failed(format!(
                "{addr}: the change did not apply within 10 s (ticket cluster status)"
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until learner `id`'s match index is within [`CATCH_UP_ENTRIES`]
/// of the leader's commit, at most `limit`.
fn wait_caught_up(addr: &str, id: u64, limit: Duration) -> Result<(), Exit> {
    let start = Instant::now();
    loop {
        let last = match admin_get(addr, "/v1/cluster") {
            Ok(Some(body)) => match Json::parse(&body) {
                Ok(v) => {
                    let commit = v.get("commit").and_then(Json::as_u64).unwrap_or(0);
                    let me = v
                        .get("learners")
                        .map(Json::items)
                        .unwrap_or(&[])
                        .iter()
                        .find(|m| m.get("id").and_then(Json::as_u64) == Some(id));
                    match me.and_then(|m| m.get("match")).and_then(Json::as_u64) {
                        Some(matched) if matched + CATCH_UP_ENTRIES >= commit && matched > 0 => {
                            eprintln!(
                                "node {id} caught up in {:.1} s (match {matched}, commit \
                                 {commit})",
                                start.elapsed().as_secs_f64()
                            );
                            return Ok(());
                        }
                        Some(matched) => {
                            let reachable = !matches!(
                                me.and_then(|m| m.get("reachable")),
                                Some(Json::Bool(false))
                            );
                            format!(
                                "its log reaches index {matched}, the leader's commit is \
                                 {commit} ({} behind){}",
                                commit.saturating_sub(matched),
                                if reachable {
                                    ""
                                } else {
                                    "; the leader has not heard from it recently \
                                     (is it running and reachable?)"
                                }
                            )
                        }
                        None => format!(
                            "{addr} is no longer the leader, or node {id} is no longer a \
                             learner"
                        ),
                    }
                }
                Err(e) => e.to_string(),
            },
            Ok(None) => format!("{addr} is not a cluster node"),
            Err(e) => e.message,
        };
        if start.elapsed() >= limit {
            return Err(failed(format!(
                "node {id} did not catch up within {} s, so it stays a learner (not \
                 promoted): {last}. Fix it and run `ticket cluster promote {id}`, or \
                 `ticket cluster remove {id}`",
                limit.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
