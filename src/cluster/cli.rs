//! `ticketd --cluster ...`: the command line of cluster mode and the daemon
//! around [`ClusterService`].
//!
//! Cluster flags are taken first; every other flag is the server's
//! ([`Config::take_flags`]), so `--listen`, `--max-conns`, the limits and
//! `--log-level` mean what they mean in single mode. `--data-dir` is
//! required.

use std::ffi::OsString;
use std::process::ExitCode;

use crate::cluster::node::DEFAULT_LEADER_SYNC_MS;
use crate::cluster::service::{ClusterConfig, ClusterService};
use crate::cluster::state::StateMachine;
use crate::cluster::tls::TlsFiles;
use crate::config::{reject_leftovers, Config, ConfigError, RestartGrace, DEFAULT_MAX_LEASE_S};
use crate::limits::MAX_ALLOC_BYTES;
use crate::server::Server;

/// Default for `--cluster-name`.
pub const DEFAULT_CLUSTER_NAME: &str = "ticketd";
/// Default for `--tick-ms`.
pub const DEFAULT_TICK_MS: u64 = 100;

/// Cluster mode's help text.
pub const HELP: &str = "\
ticketd --cluster: one node of a replicated ticketd cluster (Raft)

USAGE:
    ticketd --cluster --id N --peers 1=HOST:PORT,2=HOST:PORT,3=HOST:PORT \\
            --data-dir DIR --listen ADDR [--join] [FLAGS]

CLUSTER FLAGS:
    --id N                 this node's id, one of the ids in --peers
    --peers LIST           every node as ID=HOST:PORT; this node listens for
                           peers on its own entry. Identical on every node
                           at the first start; later the replicated
                           configuration's addresses win (a difference is
                           logged)
    --data-dir DIR         write-ahead log and snapshots (required)
    --cluster-name NAME    peers with another name are refused [ticketd]
    --tick-ms MS           Raft tick; elections after 10-20 ticks [100]
    --leader-sync-ms MS    while its live followers form a majority without
                           it, the leader syncs its own log this often
                           instead of once per batch (their fsyncs commit
                           entries; it applies them from its log); 0 syncs
                           every batch (docs/CLUSTER.md) [5]
    --join                 a new node: on an empty data dir, start with no
                           configuration and wait to be added with
                           `ticket cluster add ID=HOST:PORT`; --peers then
                           needs this node and at least one member. Once
                           the data dir holds a configuration (learnt from
                           the leader), it wins over --peers

PEER SECURITY (docs/SECURITY.md):
    --peer-tls-cert FILE   this node's certificate (PEM), naming
                           node<ID>.<cluster-name> in its subjectAltName
    --peer-tls-key FILE    its private key (PEM)
    --peer-tls-ca FILE     the cluster CA (PEM); peers must chain to it
                           and name the node id they claim. The three go
                           together; `ticket certs init DIR --nodes 3`
                           makes them all.
    --insecure-peers       allow plaintext peers on non-loopback --peers
                           (anyone who reaches a peer port can then pose
                           as a node); without it such a cluster needs
                           peer TLS

Every single-mode flag (--listen, --max-conns, limits, --log-level, ...) is
accepted too; see `ticketd --help`. Lock limits must be equal on every node.
Not --max-hold, --restart-grace or --max-lease: a cluster restart keeps every
lease in the replicated state (WAL and snapshot), so it needs no grace.
";

/// Parses a cluster-mode command line (with `--cluster` in it).
///
/// # Errors
/// A message naming the flag.
pub fn parse(args: Vec<OsString>) -> Result<(Config, ClusterConfig), ConfigError> {
    let mut args = pico_args::Arguments::from_vec(args);
    let _ = args.contains("--cluster");
    let id: u64 = args
        .opt_value_from_str("--id")
        .map_err(|e| ConfigError::Invalid(format!("--id: {e}")))?
        .ok_or_else(|| ConfigError::Invalid("cluster mode needs --id N".into()))?;
    let peers: String = args
        .opt_value_from_str("--peers")
        .map_err(|e| ConfigError::Invalid(format!("--peers: {e}")))?
        .ok_or_else(|| ConfigError::Invalid("cluster mode needs --peers 1=HOST:PORT,...".into()))?;
    let peers = ClusterConfig::parse_peers(&peers)?;
    let cluster_name: String = args
        .opt_value_from_str("--cluster-name")
        .map_err(|e| ConfigError::Invalid(format!("--cluster-name: {e}")))?
        .unwrap_or_else(|| DEFAULT_CLUSTER_NAME.to_owned());
    let tick_ms: u64 = args
        .opt_value_from_str("--tick-ms")
        .map_err(|e| ConfigError::Invalid(format!("--tick-ms: {e}")))?
        .unwrap_or(DEFAULT_TICK_MS);
    if !(10..=10_000).contains(&tick_ms) {
        return Err(ConfigError::Invalid("--tick-ms must be 10..=10000".into()));
    }
    let leader_sync_ms: u64 = args
        .opt_value_from_str("--leader-sync-ms")
        .map_err(|e| ConfigError::Invalid(format!("--leader-sync-ms: {e}")))?
        .unwrap_or(DEFAULT_LEADER_SYNC_MS);
    if leader_sync_ms > 1000 {
        return Err(ConfigError::Invalid(
            "--leader-sync-ms must be 0..=1000".into(),
        ));
    }
    let tls = take_tls_files(&mut args)?;
    let insecure_peers = args.contains("--insecure-peers");
    let join = args.contains("--join");
    check_cluster_name(&cluster_name)?;
    let config = Config::take_flags(&mut args)?;
    reject_leftovers(args)?;
    reject_single_mode_flags(&config)?;
    if !peers.contains_key(&id) {
        return Err(ConfigError::Invalid(format!(
            "--id {id} is not among the ids of --peers ({:?})",
            peers.keys().collect::<Vec<_>>()
        )));
    }
    let Some(data_dir) = config.data_dir.clone() else {
        return Err(ConfigError::Invalid(
            "cluster mode needs --data-dir DIR".into(),
        ));
    };
    // A 32-bit build cannot hold the snapshot of the fullest table the
    // default limits allow: refuse such limits now, not when it fills.
    StateMachine::check_snapshot_fits(&config.engine, config.max_key_bytes, MAX_ALLOC_BYTES)?;
    let cluster = ClusterConfig {
        id,
        peers,
        data_dir,
        cluster_name,
        limits: config.engine.clone(),
        max_key_bytes: config.max_key_bytes,
        tick_ms,
        leader_sync_ms,
        tls,
        insecure_peers,
        insecure_data_dir: config.insecure,
        join,
    };
    cluster.check_protected()?;
    Ok((config, cluster))
}

/// Refuses the single-mode flags that mean nothing in a cluster.
fn reject_single_mode_flags(config: &Config) -> Result<(), ConfigError> {
    if config.engine.max_hold_ms > 0 {
        // The replicated state machine reads no clock, so it cannot tell
        // how long a grant has been held.
        return Err(ConfigError::Invalid(
            "--max-hold is a single-mode flag; cluster mode has no hold cap".into(),
        ));
    }
    // A cluster restart keeps every lease in the replicated state (WAL and
    // snapshot), so there is no grace to turn off; and the state machine
    // applies the protocol's full lease range on every node alike.
    if config.restart_grace != RestartGrace::Auto {
        return Err(ConfigError::Invalid(
            "--restart-grace is a single-mode flag; a cluster restart keeps every lease in \
             the replicated state, so it needs no grace"
                .into(),
        ));
    }
    if config.max_lease_s != DEFAULT_MAX_LEASE_S {
        return Err(ConfigError::Invalid(
            "--max-lease is a single-mode flag; cluster mode grants the protocol's leases of \
             1..=255 s"
                .into(),
        ));
    }
    Ok(())
}

/// The peer TLS files: all three flags, or none.
fn take_tls_files(args: &mut pico_args::Arguments) -> Result<Option<TlsFiles>, ConfigError> {
    let mut tls_file = |flag: &'static str| -> Result<Option<std::path::PathBuf>, ConfigError> {
        args.opt_value_from_os_str(flag, |s| {
            Ok::<_, std::convert::Infallible>(std::path::PathBuf::from(s))
        })
        .map_err(|e| ConfigError::Invalid(format!("{flag}: {e}")))
    };
    let cert = tls_file("--peer-tls-cert")?;
    let key = tls_file("--peer-tls-key")?;
    let ca = tls_file("--peer-tls-ca")?;
    match (cert, key, ca) {
        (None, None, None) => Ok(None),
        (Some(cert), Some(key), Some(ca)) => Ok(Some(TlsFiles { cert, key, ca })),
        _ => Err(ConfigError::Invalid(
            "--peer-tls-cert, --peer-tls-key and --peer-tls-ca go together: give all \
             three (`ticket certs init DIR` makes them)"
                .into(),
        )),
    }
}

/// A cluster name is part of the DNS names in peer certificates.
fn check_cluster_name(cluster_name: &str) -> Result<(), ConfigError> {
    if cluster_name.is_empty()
        || !cluster_name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return Err(ConfigError::Invalid(format!(
            "--cluster-name {cluster_name:?}: letters, digits, '-' and '.' only (it is part \
             of the DNS names in peer certificates)"
        )));
    }
    Ok(())
}

/// Runs the cluster-mode daemon: the exit status of `ticketd --cluster`.
#[must_use]
pub fn main(args: Vec<OsString>) -> ExitCode {
    if args.iter().any(|a| a == "-h" || a == "--help") {
        print!("{HELP}");
        return ExitCode::SUCCESS;
    }
    let (config, cluster) = match parse(args) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("ticketd: {e}\nTry 'ticketd --cluster --help' for the list of flags.");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = simple_logger::SimpleLogger::new()
        .with_level(config.log_level)
        .with_utc_timestamps()
        .init()
    {
        eprintln!("ticketd: cannot start logging: {e}");
        return ExitCode::from(1);
    }
    let mut service = match ClusterService::open(&cluster) {
        Ok(s) => s,
        Err(e) => {
            log::error!("cannot start cluster node {}: {e}", cluster.id);
            return ExitCode::from(1);
        }
    };
    service.set_stop_on_fatal(true);
    let listen = config.listen;
    let mut server = match Server::bind(config, service) {
        Ok(s) => s,
        Err(e) => {
            log::error!("cannot listen on {listen}: {e}");
            return ExitCode::from(1);
        }
    };
    // After the start-up line, which comes first.
    if cluster.tls.is_none() && cluster.insecure_peers && !cluster.peers_all_loopback() {
        log::warn!(
            "--insecure-peers: peers speak plaintext over the network; anyone who can reach \
             a peer port can pose as a node (docs/SECURITY.md)"
        );
    }
    if let Err(e) = server.handle_signals() {
        log::error!("cannot install signal handlers: {e}");
        return ExitCode::from(1);
    }
    let result = server.run();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("event loop failed: {e}");
            // The node must stop now, as it is: its disk may hang, and
            // dropping it would wait for a running fdatasync first.
            std::mem::forget(server);
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_off_loopback_need_tls_or_insecure_peers() {
        // Limits small enough for a 32-bit build (the cross-check runs this
        // under qemu-arm), which refuses the default ones.
        let base = "--cluster --id 1 --peers 1=10.0.0.1:7001,2=127.0.0.1:7002 --data-dir /tmp/x \
                    --max-keys 1000";
        let e = parse(args(base)).unwrap_err().to_string();
        assert!(e.contains("ticket certs init"), "{e}");
        assert!(e.contains("--insecure-peers"), "{e}");
        let (_, k) = parse(args(&format!("{base} --insecure-peers"))).unwrap();
        assert!(k.insecure_peers && k.tls.is_none());
        let (_, k) = parse(args(&format!(
            "{base} --peer-tls-cert c.pem --peer-tls-key k.pem --peer-tls-ca ca.pem"
        )))
        .unwrap();
        assert_eq!(k.tls.unwrap().ca, std::path::PathBuf::from("ca.pem"));
        let (_, k) = parse(args(
            "--cluster --id 1 --peers 1=127.0.0.1:7001,2=[::1]:7002 --data-dir /tmp/x --max-keys 1000",
        ))
        .unwrap();
        assert!(k.peers_all_loopback());
    }

    fn args(s: &str) -> Vec<OsString> {
        s.split_whitespace().map(OsString::from).collect()
    }

    #[test]
    fn a_full_command_line_parses() {
        let (c, k) = parse(args(
            "--cluster --id 2 --peers 1=127.0.0.1:7001,2=127.0.0.1:7002,3=127.0.0.1:7003 \
             --data-dir /tmp/x --listen 127.0.0.1:0 --max-keys 50",
        ))
        .unwrap();
        assert_eq!(k.id, 2);
        assert_eq!(k.peers.len(), 3);
        assert_eq!(k.limits.max_keys, 50);
        assert_eq!(c.listen.port(), 0);
        assert_eq!(k.tick_ms, DEFAULT_TICK_MS);
        assert_eq!(k.leader_sync_ms, DEFAULT_LEADER_SYNC_MS);
        let (_, k) = parse(args(
            "--cluster --id 1 --peers 1=127.0.0.1:7001 --data-dir /tmp/x --max-keys 50 \
             --leader-sync-ms 0",
        ))
        .unwrap();
        assert_eq!(k.leader_sync_ms, 0);
    }

    #[test]
    fn limits_whose_snapshot_this_build_cannot_hold_are_a_command_line_error() {
        let line = "--cluster --id 1 --peers 1=127.0.0.1:7001 --data-dir /tmp/x";
        // The defaults: accepted on a 64-bit build, refused on a 32-bit one.
        let defaults = parse(args(line));
        if usize::BITS == 64 {
            assert!(defaults.is_ok());
        } else {
            let e = defaults.unwrap_err().to_string();
            assert!(e.contains("--max-keys") && e.contains("32-bit"), "{e}");
        }
        // A table no build can snapshot in one allocation is refused anywhere.
        let huge = format!("{line} --max-keys 100000000000000000 --max-key-bytes 65536");
        if let Err(e) = parse(args(&huge)) {
            assert!(e.to_string().contains("--max-keys"), "{e}");
        } else {
            panic!("a table of 6.5 ZB was accepted");
        }
        // A small table is fine everywhere.
        assert!(parse(args(&format!("{line} --max-keys 100000"))).is_ok());
    }

    /// Single mode's restart flags would do nothing in cluster mode: refused,
    /// saying why.
    #[test]
    fn restart_grace_and_max_lease_are_single_mode_flags() {
        let line = "--cluster --id 1 --peers 1=127.0.0.1:7001 --data-dir /tmp/x --max-keys 1000";
        for (flag, value) in [("--restart-grace", "off"), ("--max-lease", "10")] {
            let e = parse(args(&format!("{line} {flag} {value}")))
                .unwrap_err()
                .to_string();
            assert!(e.contains(flag) && e.contains("single-mode"), "{e}");
        }
        assert!(parse(args(&format!(
            "{line} --restart-grace auto --max-lease 255"
        )))
        .is_ok());
    }

    #[test]
    fn missing_or_inconsistent_flags_are_errors() {
        for bad in [
            "--cluster --peers 1=127.0.0.1:7001 --data-dir /tmp/x",
            "--cluster --id 1 --data-dir /tmp/x",
            "--cluster --id 1 --peers 1=127.0.0.1:7001",
            "--cluster --id 4 --peers 1=127.0.0.1:7001 --data-dir /tmp/x",
            "--cluster --id 1 --peers 1=127.0.0.1:7001 --data-dir /tmp/x --bogus",
            "--cluster --id 1 --peers 1=127.0.0.1:7001 --data-dir /tmp/x --tick-ms 1",
            "--cluster --id 1 --peers 1=127.0.0.1:7001 --data-dir /tmp/x --leader-sync-ms 1001",
            "--cluster --id 1 --peers 1=127.0.0.1:7001 --data-dir /tmp/x --leader-sync-ms -1",
            "--cluster --id 1 --peers 1=127.0.0.1:7001 --data-dir /tmp/x --peer-tls-cert c",
            "--cluster --id 1 --peers 1=127.0.0.1:7001 --data-dir /tmp/x --cluster-name a/b",
            "--cluster --id 1 --peers 1=127.0.0.1:7001 --data-dir /tmp/x --cluster-name ''",
        ] {
            assert!(parse(args(bad)).is_err(), "{bad}");
        }
    }
}
