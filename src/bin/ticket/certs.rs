//! `ticket certs init`: a cluster CA and one certificate per node.

use std::ffi::OsString;

use crate::{exit, Exit};

pub(crate) const HELP_CERTS: &str = "\
ticket certs init: make a cluster CA and one certificate per node for peer TLS

USAGE:
    ticket certs init DIR [--cluster-name NAME] [--nodes N]

Writes DIR/ca.pem, DIR/ca-key.pem and, for each node id 1..=N,
DIR/nodeN.pem (subjectAltName DNS nodeN.NAME) and DIR/nodeN-key.pem. Keys
are created 0600; nothing that exists is overwritten. Give node N
--peer-tls-cert DIR/nodeN.pem --peer-tls-key DIR/nodeN-key.pem
--peer-tls-ca DIR/ca.pem and --cluster-name NAME (docs/SECURITY.md). Keep
ca-key.pem off the nodes.

OPTIONS:
    --cluster-name NAME   the nodes' --cluster-name [ticketd]
    --nodes N             how many nodes [3]
";

/// `ticket certs init DIR`: see [`HELP_CERTS`].
pub(crate) fn certs(args: Vec<OsString>) -> Result<u8, Exit> {
    if args.iter().any(|a| a == "--help" || a == "-h") {
        print!("{HELP_CERTS}");
        return Ok(exit::OK);
    }
    certs_init(args)
}

#[cfg(feature = "cluster")]
fn certs_init(args: Vec<OsString>) -> Result<u8, Exit> {
    let mut args = pico_args::Arguments::from_vec(args);
    match args.subcommand() {
        Ok(Some(s)) if s == "init" => {}
        Ok(Some(s)) => return Err(Exit::usage(format!("certs: unknown subcommand {s:?}"))),
        Ok(None) => return Err(Exit::usage("certs: missing subcommand (init)")),
        Err(e) => return Err(Exit::usage(format!("certs: {e}"))),
    }
    let cluster_name: String = args
        .opt_value_from_str("--cluster-name")
        .map_err(|e| Exit::usage(format!("certs init: --cluster-name: {e}")))?
        .unwrap_or_else(|| "ticketd".to_owned());
    let nodes: u64 = args
        .opt_value_from_str("--nodes")
        .map_err(|e| Exit::usage(format!("certs init: --nodes: {e}")))?
        .unwrap_or(3);
    let dir: Option<std::path::PathBuf> = args
        .opt_free_from_os_str(|s| Ok::<_, std::convert::Infallible>(s.into()))
        .map_err(|e| Exit::usage(format!("certs init: {e}")))?;
    let Some(dir) = dir else {
        return Err(Exit::usage("certs init: missing DIR"));
    };
    let rest = args.finish();
    if let Some(extra) = rest.first() {
        return Err(Exit::usage(format!("certs init: unexpected {extra:?}")));
    }
    let opts = ticketd::cluster::certs::InitOptions {
        dir,
        cluster_name,
        nodes,
    };
    match ticketd::cluster::certs::init(&opts) {
        Ok(files) => {
            for f in files {
                println!("{}", f.display());
            }
            Ok(exit::OK)
        }
        Err(e) if e.is_usage() => Err(Exit::usage(format!("certs init: {e}"))),
        Err(e) => Err(Exit {
            status: exit::FAILED,
            message: format!("certs init: {e}"),
        }),
    }
}

#[cfg(not(feature = "cluster"))]
fn certs_init(_args: Vec<OsString>) -> Result<u8, Exit> {
    Err(Exit::usage(
        "certs: this build has no cluster mode (built without the `cluster` feature)",
    ))
}
