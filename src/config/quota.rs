//! The flags of the quotas per identity and of the memory budget
//! (docs/SECURITY.md, "Quotas and the memory budget").

use std::time::Duration;

use super::{count, flag, seconds, Config, ConfigError, Why};

/// Default for `--max-conns-per-identity`: half of `--max-conns`.
pub const DEFAULT_MAX_CONNS_PER_IDENTITY: usize = super::DEFAULT_MAX_CONNS / 2;
/// Default for `--max-handshakes-per-identity`: TLS handshakes one source
/// address may have under way at once.
pub const DEFAULT_MAX_HANDSHAKES_PER_IDENTITY: usize = 64;
/// Default for `--handshake-timeout`: seconds a TLS handshake may take
/// from the accept.
pub const DEFAULT_HANDSHAKE_TIMEOUT_S: u64 = 10;
/// The smallest `--max-memory`: below it, a server could hardly hold a
/// few connections' buffers.
pub const MIN_MAX_MEMORY: u64 = 1024 * 1024;

const _: () = assert!(DEFAULT_HANDSHAKE_TIMEOUT_S < super::DEFAULT_FRAME_TIMEOUT_S);

/// A number of bytes, with an optional suffix K, M or G (powers of 1024).
pub(super) fn bytes(s: &str) -> Result<u64, Why> {
    let bad = || Why::from("expected a number of bytes, with K, M or G for KiB, MiB or GiB");
    let (digits, unit) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 1 << 20),
        Some(b'G' | b'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    n.checked_mul(unit)
        .ok_or_else(|| Why::from("too large for this machine"))
}

/// Takes `--max-keys-per-identity`, `--max-waiters-per-identity`,
/// `--max-conns-per-identity`, `--max-handshakes-per-identity`,
/// `--handshake-timeout` and `--max-memory`.
pub(super) fn take_quotas(
    args: &mut pico_args::Arguments,
    c: &mut Config,
) -> Result<(), ConfigError> {
    if let Some(v) = flag(args, "--max-keys-per-identity", count)? {
        c.engine.max_keys_per_holder = v;
    }
    if let Some(v) = flag(args, "--max-waiters-per-identity", count)? {
        c.engine.max_waiters_per_holder = v;
    }
    if let Some(v) = flag(args, "--max-conns-per-identity", count)? {
        c.max_conns_per_identity = v;
    }
    if let Some(v) = flag(args, "--max-handshakes-per-identity", count)? {
        c.max_handshakes_per_identity = v;
    }
    if let Some(v) = flag(args, "--handshake-timeout", seconds)? {
        c.handshake_timeout = Duration::from_secs(v);
    }
    if let Some(v) = flag(args, "--max-memory", bytes)? {
        c.engine.max_memory = v;
    }
    Ok(())
}

impl Config {
    /// The quotas' checks.
    pub(super) fn validate_quotas(&self) -> Result<(), ConfigError> {
        let fail = |m: String| Err(ConfigError::Invalid(m));
        if self.engine.max_keys_per_holder == 0
            || self.engine.max_waiters_per_holder == 0
            || self.max_conns_per_identity == 0
            || self.max_handshakes_per_identity == 0
        {
            return fail(
                "--max-keys-per-identity, --max-waiters-per-identity, \
                 --max-conns-per-identity and --max-handshakes-per-identity must be at least 1"
                    .into(),
            );
        }
        if self.handshake_timeout < Duration::from_secs(1) {
            return fail("--handshake-timeout must be at least 1 second".into());
        }
        if self.engine.max_memory < MIN_MAX_MEMORY {
            return fail(format!(
                "--max-memory must be at least {MIN_MAX_MEMORY} bytes (1M)"
            ));
        }
        Ok(())
    }

    /// How long a TLS handshake may take: `--handshake-timeout`, or
    /// `--frame-timeout` when that is shorter.
    #[must_use]
    pub fn handshake_limit(&self) -> Duration {
        match self.frame_timeout {
            Some(f) => f.min(self.handshake_timeout),
            None => self.handshake_timeout,
        }
    }

    /// The quotas as `name=value` pairs, for the start-up log line.
    pub(super) fn describe_quotas(&self) -> String {
        format!(
            "max_keys_per_identity={} max_waiters_per_identity={} max_conns_per_identity={} \
             max_handshakes_per_identity={} handshake_timeout_s={} max_memory={}",
            self.engine.max_keys_per_holder,
            self.engine.max_waiters_per_holder,
            self.max_conns_per_identity,
            self.max_handshakes_per_identity,
            self.handshake_limit().as_secs(),
            self.engine.max_memory,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::{parse_args, Parsed};
    use super::*;

    fn parse(args: &[&str]) -> Result<Parsed, ConfigError> {
        parse_args(args.iter().map(std::ffi::OsString::from).collect())
    }

    #[test]
    fn byte_counts_take_binary_suffixes() {
        assert_eq!(bytes("4096"), Ok(4096));
        assert_eq!(bytes("64K"), Ok(65536));
        assert_eq!(bytes("256M"), Ok(256 << 20));
        assert_eq!(bytes("2g"), Ok(2 << 30));
        for bad in ["", "M", "1.5G", "-1", "1T", "1 M", "99999999999999999999"] {
            assert!(bytes(bad).is_err(), "{bad}");
        }
        assert!(bytes("99999999999G").is_err());
    }

    #[test]
    fn quota_flags_land_in_their_fields_and_are_checked() {
        let Ok(Parsed::Run(c)) = parse(&[
            "--max-keys-per-identity",
            "10",
            "--max-waiters-per-identity",
            "11",
            "--max-conns-per-identity",
            "12",
            "--max-handshakes-per-identity",
            "13",
            "--handshake-timeout",
            "3",
            "--max-memory",
            "8M",
        ]) else {
            panic!("flags should parse")
        };
        assert_eq!(c.engine.max_keys_per_holder, 10);
        assert_eq!(c.engine.max_waiters_per_holder, 11);
        assert_eq!(c.max_conns_per_identity, 12);
        assert_eq!(c.max_handshakes_per_identity, 13);
        assert_eq!(c.handshake_limit(), Duration::from_secs(3));
        assert_eq!(c.engine.max_memory, 8 << 20);
        for (args, needle) in [
            (&["--max-memory", "1000"][..], "--max-memory"),
            (&["--max-memory", "lots"][..], "--max-memory"),
            (&["--handshake-timeout", "0"][..], "--handshake-timeout"),
            (
                &["--max-conns-per-identity", "0"][..],
                "--max-conns-per-identity",
            ),
        ] {
            let e = parse(args).unwrap_err();
            assert!(e.to_string().contains(needle), "{args:?}: {e}");
        }
    }

    #[test]
    fn a_shorter_frame_timeout_bounds_the_handshake_too() {
        let c = Config::default();
        assert_eq!(c.handshake_limit(), Duration::from_secs(10));
        let Ok(Parsed::Run(c)) = parse(&["--frame-timeout", "2"]) else {
            panic!("refused");
        };
        assert_eq!(c.handshake_limit(), Duration::from_secs(2));
        let Ok(Parsed::Run(c)) = parse(&["--frame-timeout", "0"]) else {
            panic!("refused");
        };
        assert_eq!(c.handshake_limit(), Duration::from_secs(10));
    }
}
