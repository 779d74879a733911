//! The configuration's checks: ranges, values that must go together,
//! protected mode; and the start-up line's summary of the limits.

use super::{AdminListen, Config, ConfigError, MAX_CONNS_CEILING, MAX_UNIX_LISTENERS};
use crate::limits;

impl Config {
    /// Checks the values against their ranges and against each other.
    ///
    /// # Errors
    /// A message naming the offending flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |m: String| Err(ConfigError::Invalid(m));
        if self.max_conns == 0 || self.max_conns > MAX_CONNS_CEILING {
            return fail(format!("--max-conns must be 1..={MAX_CONNS_CEILING}"));
        }
        if self.max_key_bytes == 0 || self.max_key_bytes > limits::MAX_KEY_BYTES_CEILING {
            return fail(format!(
                "--max-key-bytes must be 1..={}",
                limits::MAX_KEY_BYTES_CEILING
            ));
        }
        if self.engine.sweep_interval_ms == 0 {
            return fail("--sweep-interval must be at least 1 second".into());
        }
        if self.engine.max_keys == 0
            || self.engine.max_waiters == 0
            || self.engine.max_waiters_per_key == 0
        {
            return fail(
                "--max-keys, --max-waiters and --max-waiters-per-key must be at least 1".into(),
            );
        }
        if self.max_lease_s == 0 {
            return fail("--max-lease must be 1..=255 seconds".into());
        }
        if self.max_frames_per_turn == 0 {
            return fail("--max-frames-per-turn must be at least 1".into());
        }
        self.validate_listeners()?;
        self.validate_quotas()?;
        let one_reply = limits::max_reply_frame(self.max_key_bytes);
        if self.out_soft_limit_bytes < one_reply {
            return fail(format!(
                "--out-soft-limit must hold at least one reply ({one_reply} bytes with --max-key-bytes {})",
                self.max_key_bytes
            ));
        }
        if self.out_hard_limit_bytes < self.out_soft_limit_bytes.saturating_add(one_reply) {
            return fail(format!(
                "--out-hard-limit must exceed --out-soft-limit by at least one reply ({one_reply} bytes)"
            ));
        }
        Ok(())
    }

    /// The listeners' checks: TLS where it applies, protected mode, the
    /// Unix sockets and who may use them.
    fn validate_listeners(&self) -> Result<(), ConfigError> {
        let fail = |m: String| Err(ConfigError::Invalid(m));
        if self.tls.is_some() && !cfg!(feature = "tls") {
            return fail(
                "--tls-cert: this ticketd was built without TLS (the `tls` feature)".into(),
            );
        }
        if self.tls.is_some() && !self.listen_tcp {
            return fail(
                "--tls-cert applies to the TCP listener: give --listen HOST:PORT (Unix \
                 sockets are guarded by their file mode and --allow-uid instead)"
                    .into(),
            );
        }
        if self.admin_tls.is_some() && !cfg!(feature = "tls") {
            return fail(
                "--admin-tls-cert: this ticketd was built without TLS (the `tls` feature)".into(),
            );
        }
        if self.admin_tls.is_some() && !matches!(self.admin_listen, Some(AdminListen::Tcp(_))) {
            return fail(
                "--admin-tls-cert applies to a TCP admin port: give --admin-listen HOST:PORT \
                 (a Unix socket is guarded by its file mode and --allow-uid instead)"
                    .into(),
            );
        }
        self.check_protected()?;
        if self.unix_listen.len() > MAX_UNIX_LISTENERS {
            return fail(format!("at most {MAX_UNIX_LISTENERS} --listen unix:/path"));
        }
        let admin_unix = matches!(self.admin_listen, Some(AdminListen::Unix(_)));
        if (!self.allow_uids.is_empty() || !self.allow_gids.is_empty())
            && self.unix_listen.is_empty()
            && !admin_unix
        {
            return fail(
                "--allow-uid and --allow-gid apply to Unix sockets: give --listen unix:/path \
                 or --admin-listen unix:/path"
                    .into(),
            );
        }
        Ok(())
    }

    /// True when clients reach the listener over plaintext from beyond
    /// this host: allowed only with `insecure` (and then warned about).
    #[must_use]
    pub fn plaintext_off_loopback(&self) -> bool {
        self.listen_tcp && !self.listen.ip().is_loopback() && self.tls.is_none()
    }

    /// True when the listener speaks TLS beyond this host without
    /// `--tls-client-ca`: protected mode accepts it (tokens and keys are
    /// encrypted, the server is proven to the client), and the start-up
    /// warns that anyone who reaches it can still take and hold any key.
    #[must_use]
    pub fn unauthenticated_tls_off_loopback(&self) -> bool {
        self.listen_tcp
            && !self.listen.ip().is_loopback()
            && self.tls.is_some()
            && !self.client_certs_required()
    }

    /// TLS on the client port with `--tls-client-ca`: only clients holding
    /// a certificate from that CA get to send a request.
    #[must_use]
    pub fn client_certs_required(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.client_ca.is_some())
    }

    /// HTTPS on the admin port with `--admin-tls-client-ca`: only clients
    /// holding a certificate from that CA reach it.
    #[must_use]
    pub fn admin_certs_required(&self) -> bool {
        self.admin_tls
            .as_ref()
            .is_some_and(|t| t.client_ca.is_some())
    }

    /// A TCP admin port beyond this host that does not require client
    /// certificates (plaintext with `insecure`, or HTTPS without
    /// `--admin-tls-client-ca`): warned about at start-up.
    #[must_use]
    pub fn admin_unauthenticated_off_loopback(&self) -> bool {
        matches!(&self.admin_listen, Some(AdminListen::Tcp(a)) if !a.ip().is_loopback())
            && !self.admin_certs_required()
    }

    /// Protected mode: a listener that is not loopback is refused unless
    /// `insecure` says otherwise.
    ///
    /// # Errors
    /// What to do, when the configuration is refused.
    pub fn check_protected(&self) -> Result<(), ConfigError> {
        if self.insecure {
            return Ok(());
        }
        if let Some(AdminListen::Tcp(addr)) = &self.admin_listen {
            if !addr.ip().is_loopback() && self.admin_tls.is_none() {
                return Err(ConfigError::Invalid(format!(
                    "--admin-listen {addr} is not a loopback address, and the admin port would \
                     speak plaintext: anyone who reaches it or listens in could read every key \
                     and token (and, in cluster mode, change the members). Listen on \
                     127.0.0.1, ::1 or unix:/path, serve HTTPS (--admin-tls-cert and \
                     --admin-tls-key, with --admin-tls-client-ca to require client \
                     certificates), or pass --insecure (docs/SECURITY.md)"
                )));
            }
        }
        if !self.plaintext_off_loopback() {
            return Ok(());
        }
        Err(ConfigError::Invalid(format!(
            "--listen {} is not a loopback address, and clients would speak plaintext, not \
             authenticated: anyone who reaches it could take, hold and release any lock, and \
             anyone who listens in could read tokens. Listen on 127.0.0.1 or ::1 (and let \
             clients reach it through something you trust), turn on TLS (--tls-cert and \
             --tls-key, with --tls-client-ca to require client certificates), or pass \
             --insecure to serve it anyway on a network you trust (docs/SECURITY.md)",
            self.listen
        )))
    }

    /// The limits as `name=value` pairs, for the start-up log line.
    #[must_use]
    pub fn describe_limits(&self) -> String {
        let frame_timeout_s = self.frame_timeout.map_or(0, |d| d.as_secs());
        format!(
            "max_conns={} max_keys={} max_waiters={} max_waiters_per_key={} max_key_bytes={} \
             sweep_interval_s={} max_hold_s={} max_frames_per_turn={} out_soft_limit={} \
             out_hard_limit={} frame_timeout_s={} max_lease_s={} {}",
            self.max_conns,
            self.engine.max_keys,
            self.engine.max_waiters,
            self.engine.max_waiters_per_key,
            self.max_key_bytes,
            self.engine.sweep_interval_ms / 1000,
            self.engine.max_hold_ms / 1000,
            self.max_frames_per_turn,
            self.out_soft_limit_bytes,
            self.out_hard_limit_bytes,
            frame_timeout_s,
            self.max_lease_s,
            self.describe_quotas(),
        )
    }
}
