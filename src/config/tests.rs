//! The command line parsed and checked, flag by flag.

use super::*;
use std::ffi::OsString;

fn parse(args: &[&str]) -> Result<Parsed, ConfigError> {
    parse_args(args.iter().map(OsString::from).collect())
}

#[test]
fn no_flags_gives_the_documented_defaults() {
    assert_eq!(parse(&[]), Ok(Parsed::Run(Config::default())));
    assert_eq!(Config::default().listen.to_string(), DEFAULT_LISTEN);
}

#[test]
fn every_flag_lands_in_its_field() {
    let Ok(Parsed::Run(c)) = parse(&[
        "--listen",
        "127.0.0.1:0",
        "--max-conns",
        "5",
        "--max-keys",
        "6",
        "--max-waiters",
        "7",
        "--max-waiters-per-key",
        "3",
        "--max-key-bytes",
        "100",
        "--sweep-interval",
        "2",
        "--max-hold",
        "600",
        "--max-frames-per-turn",
        "9",
        "--out-soft-limit",
        "1000",
        "--out-hard-limit",
        "2000",
        "--frame-timeout",
        "0",
        "--data-dir",
        "/tmp/x",
        "--log-level",
        "debug",
        "--restart-grace",
        "off",
        "--max-lease",
        "30",
    ]) else {
        panic!("flags should parse")
    };
    assert_eq!(c.listen.port(), 0);
    assert_eq!(c.max_conns, 5);
    assert_eq!(c.engine.max_keys, 6);
    assert_eq!(c.engine.max_waiters, 7);
    assert_eq!(c.engine.max_waiters_per_key, 3);
    assert_eq!(c.max_key_bytes, 100);
    assert_eq!(c.engine.sweep_interval_ms, 2000);
    assert_eq!(c.engine.max_hold_ms, 600_000);
    assert_eq!(c.max_frames_per_turn, 9);
    assert_eq!(
        (c.out_soft_limit_bytes, c.out_hard_limit_bytes),
        (1000, 2000)
    );
    assert_eq!(c.frame_timeout, None);
    assert_eq!(c.data_dir, Some(PathBuf::from("/tmp/x")));
    assert_eq!(c.log_level, LevelFilter::Debug);
    assert_eq!(c.restart_grace, RestartGrace::Off);
    assert_eq!(c.max_lease_s, 30);
}

#[test]
fn bad_values_name_the_flag() {
    let e = parse(&["--max-conns", "lots"]).unwrap_err();
    assert!(
        e.to_string().contains("--max-conns") && e.to_string().contains("lots"),
        "{e}"
    );
    let e = parse(&["--max-key-bytes", "70000"]).unwrap_err();
    assert!(e.to_string().contains("--max-key-bytes"), "{e}");
    let e = parse(&["--bogus"]).unwrap_err();
    assert!(e.to_string().contains("--bogus"), "{e}");
    let e = parse(&["--listen"]).unwrap_err();
    assert!(e.to_string().contains("--listen"), "{e}");
    let e = parse(&["--out-soft-limit", "10"]).unwrap_err();
    assert!(e.to_string().contains("--out-soft-limit"), "{e}");
    for bad in ["0", "256", "x"] {
        let e = parse(&["--max-lease", bad]).unwrap_err();
        assert!(e.to_string().contains("--max-lease"), "{e}");
    }
    let e = parse(&["--restart-grace", "sometimes"]).unwrap_err();
    assert!(e.to_string().contains("--restart-grace"), "{e}");
    let e = parse(&["--log-level", "loud"]).unwrap_err();
    assert!(e.to_string().contains("--log-level"), "{e}");
}

#[test]
fn errors_carry_the_flag_and_the_value() {
    assert_eq!(
        parse(&["--max-conns", "lots"]).unwrap_err(),
        ConfigError::Value {
            flag: "--max-conns",
            value: "lots".into(),
            why: "expected a whole number".into(),
        }
    );
    assert_eq!(
        parse(&["--allow-uid", "root"]).unwrap_err(),
        ConfigError::Value {
            flag: "--allow-uid",
            value: "root".into(),
            why: "expected a number".into(),
        }
    );
    assert_eq!(
        parse(&["--max-lease"]).unwrap_err(),
        ConfigError::NoValue {
            flag: "--max-lease"
        }
    );
    assert_eq!(
        parse(&["--max-keys", "1", "--max-keys", "2"]).unwrap_err(),
        ConfigError::Repeated { flag: "--max-keys" }
    );
    let e = parse(&["--nope=1"]).unwrap_err();
    assert_eq!(
        e,
        ConfigError::Unknown {
            arg: "--nope=1".into()
        }
    );
    assert_eq!(
        e.to_string(),
        "unknown argument '--nope=1' (write the value after a space: --nope 1)"
    );
    assert!(matches!(
        parse(&["--listen", "0.0.0.0:7470"]).unwrap_err(),
        ConfigError::Invalid(m) if m.starts_with("--listen 0.0.0.0:7470 is not a loopback")
    ));
}

#[test]
fn a_flag_given_twice_is_named_as_such() {
    for args in [
        &["--listen", "127.0.0.1:0", "--listen", "127.0.0.1:1"][..],
        &["--max-conns", "5", "--max-conns", "6"][..],
        &["--max-conns", "5", "--max-conns"][..],
        &["--data-dir", "/a", "--data-dir", "/b"][..],
    ] {
        let e = parse(args).unwrap_err();
        assert!(
            e.to_string().contains(args[0]) && e.to_string().contains("more than once"),
            "{args:?}: {e}"
        );
    }
}

#[test]
fn every_key_length_the_help_allows_starts_with_default_output_limits() {
    for n in ["1", "1024", "65518", "65519", "65536"] {
        let Ok(Parsed::Run(c)) = parse(&["--max-key-bytes", n]) else {
            panic!("--max-key-bytes {n} should start");
        };
        assert!(c.out_soft_limit_bytes >= DEFAULT_OUT_SOFT_LIMIT_BYTES);
        assert!(c.out_hard_limit_bytes >= DEFAULT_OUT_HARD_LIMIT_BYTES);
    }
    // Limits given explicitly are still checked against the key length.
    let e = parse(&["--max-key-bytes", "65536", "--out-soft-limit", "65536"]).unwrap_err();
    assert!(e.to_string().contains("--out-soft-limit"), "{e}");
}

#[test]
fn an_empty_data_dir_is_refused() {
    let e = parse(&["--data-dir", ""]).unwrap_err();
    assert!(e.to_string().contains("--data-dir"), "{e}");
}

#[test]
fn an_equals_sign_gets_a_hint() {
    let e = parse(&["--max-conns=5"]).unwrap_err();
    assert!(e.to_string().contains("--max-conns 5"), "{e}");
}

#[test]
#[cfg(feature = "tls")]
fn admin_tls_flags_go_together_and_https_protects_an_admin_port_off_loopback() {
    let e = parse(&["--admin-listen", "0.0.0.0:7471"]).unwrap_err();
    assert!(
        e.to_string().contains("--admin-listen 0.0.0.0:7471")
            && e.to_string().contains("--insecure"),
        "{e}"
    );
    let tls = [
        "--admin-listen",
        "0.0.0.0:7471",
        "--admin-tls-cert",
        "c.pem",
        "--admin-tls-key",
        "k.pem",
    ];
    let Ok(Parsed::Run(c)) = parse(&tls) else {
        panic!("HTTPS is refused off loopback: {:?}", parse(&tls));
    };
    assert!(
        c.admin_unauthenticated_off_loopback(),
        "HTTPS alone is warned about"
    );
    let mut args = tls.to_vec();
    args.extend(["--admin-tls-client-ca", "ca.pem"]);
    let Ok(Parsed::Run(c)) = parse(&args) else {
        panic!("{:?}", parse(&args));
    };
    assert!(c.admin_certs_required() && c.tls.is_none());
    assert!(!c.admin_unauthenticated_off_loopback());
    assert!(parse(&["--admin-listen", "0.0.0.0:7471", "--insecure"]).is_ok());
    let e = parse(&[
        "--admin-listen",
        "127.0.0.1:7471",
        "--admin-tls-cert",
        "c.pem",
    ])
    .unwrap_err();
    assert!(e.to_string().contains("--admin-tls-key"), "{e}");
    let e = parse(&[
        "--admin-listen",
        "unix:/tmp/a.sock",
        "--admin-tls-cert",
        "c.pem",
        "--admin-tls-key",
        "k.pem",
    ])
    .unwrap_err();
    assert!(e.to_string().contains("TCP admin port"), "{e}");
}

#[test]
#[cfg(feature = "tls")]
fn tls_is_protected_and_without_a_client_ca_is_warned_about() {
    let tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem"];
    let mut args = vec!["--listen", "0.0.0.0:7470"];
    args.extend(tls);
    let Ok(Parsed::Run(c)) = parse(&args) else {
        panic!("TLS is refused off loopback: {:?}", parse(&args));
    };
    assert!(!c.plaintext_off_loopback() && c.unauthenticated_tls_off_loopback());
    let e = parse(&["--listen", "0.0.0.0:7470"]).unwrap_err();
    assert!(
        e.to_string().contains("plaintext") && e.to_string().contains("--tls-cert"),
        "{e}"
    );
    args.extend(["--tls-client-ca", "ca.pem"]);
    let Ok(Parsed::Run(c)) = parse(&args) else {
        panic!("TLS with a client CA is refused off loopback");
    };
    assert!(c.client_certs_required() && !c.plaintext_off_loopback());
    assert!(!c.unauthenticated_tls_off_loopback());
    assert_eq!(
        c.tls,
        Some(TlsFiles {
            cert: "c.pem".into(),
            key: "k.pem".into(),
            client_ca: Some("ca.pem".into()),
        })
    );
    let e = parse(&["--tls-cert", "c.pem"]).unwrap_err();
    assert!(e.to_string().contains("--tls-key"), "{e}");
    let e = parse(&["--tls-client-ca", "ca.pem"]).unwrap_err();
    assert!(e.to_string().contains("--tls-cert"), "{e}");
    let e = parse(&[
        "--listen",
        "unix:/tmp/x.sock",
        "--tls-cert",
        "c",
        "--tls-key",
        "k",
    ])
    .unwrap_err();
    assert!(e.to_string().contains("TCP listener"), "{e}");
}

#[test]
fn protected_mode_refuses_plaintext_off_loopback_unless_insecure() {
    for addr in ["0.0.0.0:7470", "[::]:0", "192.0.2.1:7470"] {
        let e = parse(&["--listen", addr]).unwrap_err();
        assert!(
            e.to_string().contains("not a loopback address"),
            "{addr}: {e}"
        );
        assert!(e.to_string().contains("--insecure"), "{addr}: {e}");
        let Ok(Parsed::Run(c)) = parse(&["--listen", addr, "--insecure"]) else {
            panic!("{addr} --insecure is refused");
        };
        assert!(c.insecure && c.plaintext_off_loopback());
    }
    for addr in ["127.0.0.1:0", "[::1]:0", "localhost:0"] {
        let Ok(Parsed::Run(c)) = parse(&["--listen", addr]) else {
            panic!("{addr} is refused");
        };
        assert!(!c.plaintext_off_loopback());
    }
}

#[test]
fn unix_sockets_beside_one_tcp_address() {
    let Ok(Parsed::Run(c)) = parse(&[
        "--listen",
        "unix:/run/a.sock",
        "--listen",
        "127.0.0.1:9",
        "--listen",
        "unix:/run/b.sock",
        "--socket-mode",
        "0600",
        "--allow-uid",
        "5",
        "--allow-uid",
        "6",
        "--allow-gid",
        "7",
    ]) else {
        panic!("refused");
    };
    assert!(c.listen_tcp && c.listen.port() == 9);
    assert_eq!(
        c.unix_listen,
        [PathBuf::from("/run/a.sock"), PathBuf::from("/run/b.sock")]
    );
    assert_eq!(
        (c.socket_mode, &c.allow_uids[..], &c.allow_gids[..]),
        (0o600, &[5, 6][..], &[7][..])
    );
    let Ok(Parsed::Run(c)) = parse(&["--listen", "unix:/run/a.sock"]) else {
        panic!("refused");
    };
    assert!(!c.listen_tcp && !c.plaintext_off_loopback());
    assert_eq!(c.socket_mode, DEFAULT_SOCKET_MODE);
    for (args, needle) in [
        (&["--listen", "unix:"][..], "needs a path"),
        (
            &["--listen", "unix:/a", "--socket-mode", "888"][..],
            "--socket-mode",
        ),
        (
            &["--listen", "unix:/a", "--allow-uid", "x"][..],
            "--allow-uid",
        ),
        (&["--allow-gid", "3"][..], "give --listen unix:/path"),
    ] {
        let e = parse(args).unwrap_err();
        assert!(e.to_string().contains(needle), "{args:?}: {e}");
    }
}

#[test]
fn the_admin_port_takes_an_address_or_a_unix_socket() {
    let Ok(Parsed::Run(c)) = parse(&["--admin-listen", "127.0.0.1:7471"]) else {
        panic!("refused");
    };
    assert_eq!(
        c.admin_listen,
        Some(AdminListen::Tcp("127.0.0.1:7471".parse().unwrap()))
    );
    let Ok(Parsed::Run(c)) = parse(&[
        "--admin-listen",
        "unix:/run/t/admin.sock",
        "--allow-uid",
        "5",
    ]) else {
        panic!("refused");
    };
    let unix = AdminListen::Unix(PathBuf::from("/run/t/admin.sock"));
    assert_eq!(unix.to_string(), "unix:/run/t/admin.sock");
    assert_eq!(c.admin_listen, Some(unix));
    assert_eq!(c.allow_uids, [5]);
    for bad in ["unix:", "nowhere", "127.0.0.1"] {
        let e = parse(&["--admin-listen", bad]).unwrap_err();
        assert!(e.to_string().contains("--admin-listen"), "{bad:?}: {e}");
    }
}

#[test]
fn ipv6_and_host_names_are_listen_addresses() {
    let Ok(Parsed::Run(c)) = parse(&["--listen", "[::1]:0"]) else {
        panic!("[::1]:0 should parse");
    };
    assert!(c.listen.is_ipv6() && c.listen.ip().is_loopback());
    let Ok(Parsed::Run(c)) = parse(&["--listen", "localhost:7"]) else {
        panic!("localhost:7 should parse");
    };
    assert!(c.listen.ip().is_loopback() && c.listen.port() == 7);
    for bad in ["[::1]", "127.0.0.1", "127.0.0.1:65536", ":0", ""] {
        let e = parse(&["--listen", bad]).unwrap_err();
        assert!(e.to_string().contains("--listen"), "{bad:?}: {e}");
    }
}

#[test]
fn help_and_version_win_over_everything_else() {
    assert_eq!(parse(&["--max-conns", "x", "--help"]), Ok(Parsed::Help));
    assert_eq!(parse(&["-V"]), Ok(Parsed::Version));
}
