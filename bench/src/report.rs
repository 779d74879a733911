//! What one run measured ([`Report`]): its rates and server CPU figures,
//! printed as the text report or as one flat JSON object (the field names
//! `bench/*.sh` pick out of it).

use std::fmt::Write as _;

use crate::args::{keys_name, mode_name, Args, BackendKind};
use crate::gen::{Mode, Renew, Stats};

/// The outcome of one run.
#[derive(Debug)]
pub struct Report {
    /// The command line it ran with.
    pub args: Args,
    /// Measured seconds.
    pub elapsed_s: f64,
    /// What the workers counted.
    pub stats: Stats,
    /// (grants checked, grants out of FIFO order), for contended ticketd runs.
    pub fifo: Option<(u64, u64)>,
    /// Server CPU seconds during the measured window.
    pub server_cpu_s: Option<f64>,
}

/// Nanoseconds in microseconds.
fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

impl Report {
    /// Requests answered per second.
    #[must_use]
    pub fn requests_per_s(&self) -> f64 {
        self.stats.replies as f64 / self.elapsed_s.max(1e-9)
    }

    /// Grants per second.
    #[must_use]
    pub fn grants_per_s(&self) -> f64 {
        self.stats.grants as f64 / self.elapsed_s.max(1e-9)
    }

    /// Extends answered `E` per second.
    #[must_use]
    pub fn extends_per_s(&self) -> f64 {
        self.stats.extended as f64 / self.elapsed_s.max(1e-9)
    }

    /// Locks held: `--locks` in `extend` mode, one per slot in `extend-flood`.
    #[must_use]
    pub fn locks_held(&self) -> usize {
        let c = &self.args.cfg;
        match c.mode {
            Mode::Extend => c.locks,
            _ => c.connections * c.depth,
        }
    }

    /// Server CPU microseconds per answered extend (extend modes; the few
    /// acquires in the measured window are charged to the extends).
    #[must_use]
    pub fn server_cpu_us_per_extend(&self) -> Option<f64> {
        let answered = self.stats.extended + self.stats.not_extended;
        self.server_cpu_s
            .filter(|_| answered > 0 && self.args.cfg.mode.extends())
            .map(|s| s * 1e6 / answered as f64)
    }

    /// The server's CPU time over the measured window, in percent of one core.
    #[must_use]
    pub fn server_cpu_core_pct(&self) -> Option<f64> {
        self.server_cpu_s
            .map(|s| s * 100.0 / self.elapsed_s.max(1e-9))
    }

    /// Server CPU microseconds per answered request.
    #[must_use]
    pub fn server_cpu_us_per_request(&self) -> Option<f64> {
        // Probes are requests the server answered too.
        let answered = self.stats.replies + self.stats.probes;
        self.server_cpu_s
            .filter(|_| answered > 0)
            .map(|s| s * 1e6 / answered as f64)
    }

    fn backend_name(&self) -> &'static str {
        match self.args.backend {
            BackendKind::Ticketd => "ticketd",
            BackendKind::Redis => "redis",
            BackendKind::Etcd => "etcd",
        }
    }

    /// One flat JSON object (numbers and short strings only, so shell tools
    /// can pick fields out of it).
    // Long because it is one report, field by field, in print order.
    #[must_use]
    pub fn to_json(&self) -> String {
        let s = &self.stats;
        let c = &self.args.cfg;
        let mut j = String::from("{");
        let _ = write!(
            j,
            "\"backend\":\"{}\",\"mode\":\"{}\",\"keys\":\"{}\",\"connections\":{},\"depth\":{},\"wait_s\":{},\"lease_s\":{},",
            self.backend_name(),
            mode_name(c.mode),
            keys_name(c.keys),
            c.connections,
            c.depth,
            c.wait_s,
            c.lease_s
        );
        let _ = write!(
            j,
            "\"elapsed_s\":{:.3},\"requests\":{},\"requests_per_s\":{:.0},\"grants\":{},\"grants_per_s\":{:.0},\"not_granted\":{},\"busy\":{},\"released\":{},\"not_released\":{},\"polls\":{},\"probes\":{},",
            self.elapsed_s,
            s.replies,
            self.requests_per_s(),
            s.grants,
            self.grants_per_s(),
            s.not_granted,
            s.busy,
            s.released,
            s.not_released,
            s.polls,
            s.probes
        );
        let _ = write!(
            j,
            "\"p50_us\":{:.1},\"p99_us\":{:.1},\"p999_us\":{:.1},\"max_us\":{:.1}",
            us(s.latency.quantile(0.5)),
            us(s.latency.quantile(0.99)),
            us(s.latency.quantile(0.999)),
            us(s.latency.max())
        );
        if c.mode == Mode::Contended {
            let w = &s.wait_to_grant;
            let _ = write!(
                j,
                ",\"wait_p50_us\":{:.1},\"wait_p99_us\":{:.1},\"wait_p999_us\":{:.1},\"wait_max_us\":{:.1}",
                us(w.quantile(0.5)),
                us(w.quantile(0.99)),
                us(w.quantile(0.999)),
                us(w.max())
            );
        }
        if let Some((checked, bad)) = self.fifo {
            let _ = write!(j, ",\"fifo_checked\":{checked},\"fifo_violations\":{bad}");
        }
        if c.mode.extends() {
            let _ = write!(
                j,
                ",\"locks\":{},\"extended\":{},\"not_extended\":{},\"extends_per_s\":{:.0}",
                self.locks_held(),
                s.extended,
                s.not_extended,
                self.extends_per_s()
            );
        }
        if let (Some(cpu), Some(per)) = (self.server_cpu_s, self.server_cpu_us_per_request()) {
            let _ = write!(
                j,
                ",\"server_cpu_s\":{cpu:.2},\"server_cpu_us_per_request\":{per:.3}"
            );
        }
        if let Some(pct) = self.server_cpu_core_pct() {
            let _ = write!(j, ",\"server_cpu_core_pct\":{pct:.3}");
        }
        if let Some(per) = self.server_cpu_us_per_extend() {
            let _ = write!(j, ",\"server_cpu_us_per_extend\":{per:.3}");
        }
        j.push('}');
        j
    }

    /// The human-readable report.
    // Long because it is one report, line by line, in print order.
    #[must_use]
    pub fn to_text(&self) -> String {
        let s = &self.stats;
        let c = &self.args.cfg;
        let mut t = String::new();
        if c.mode.extends() {
            return self.extend_text();
        }
        let _ = writeln!(
            t,
            "{} {}: {} connections, depth {}, keys {}, wait {} s, lease {} s, {:.1} s measured",
            self.backend_name(),
            mode_name(c.mode),
            c.connections,
            c.depth,
            keys_name(c.keys),
            c.wait_s,
            c.lease_s,
            self.elapsed_s
        );
        let _ = writeln!(
            t,
            "  requests/s {:>12.0}   grants/s {:>12.0}",
            self.requests_per_s(),
            self.grants_per_s()
        );
        let _ = writeln!(
            t,
            "  answered {}  granted {}  not granted {}  busy {}  released {}  not released {}{}",
            s.replies,
            s.grants,
            s.not_granted,
            s.busy,
            s.released,
            s.not_released,
            match (s.polls, s.probes) {
                (0, 0) => String::new(),
                (polls, 0) => format!("  polls {polls}"),
                (_, probes) => format!("  fifo probes {probes}"),
            }
        );
        let _ = writeln!(
            t,
            "  latency    p50 {:>9.1} us  p99 {:>9.1} us  p99.9 {:>9.1} us  max {:>9.1} us",
            us(s.latency.quantile(0.5)),
            us(s.latency.quantile(0.99)),
            us(s.latency.quantile(0.999)),
            us(s.latency.max())
        );
        if c.mode == Mode::Contended {
            let w = &s.wait_to_grant;
            let _ = writeln!(
                t,
                "  wait→grant p50 {:>9.1} us  p99 {:>9.1} us  p99.9 {:>9.1} us  max {:>9.1} us",
                us(w.quantile(0.5)),
                us(w.quantile(0.99)),
                us(w.quantile(0.999)),
                us(w.max())
            );
            match self.fifo {
                Some((checked, 0)) => {
                    let _ = writeln!(t, "  fifo       {checked} grants, all in queue order");
                }
                Some((checked, bad)) => {
                    let _ = writeln!(t, "  fifo       {checked} grants, {bad} OUT OF QUEUE ORDER");
                }
                None if self.args.backend == BackendKind::Redis => {
                    let _ = writeln!(t, "  fifo       n/a (no server-side queue: clients poll)");
                }
                None => {
                    let _ = writeln!(t, "  fifo       not checked (no fencing tokens)");
                }
            }
        }
        if let (Some(cpu), Some(per)) = (self.server_cpu_s, self.server_cpu_us_per_request()) {
            let _ = writeln!(t, "  server cpu {cpu:.2} s = {per:.3} us per request");
        }
        t
    }
}

impl Report {
    /// The human-readable report of an extend run.
    fn extend_text(&self) -> String {
        let s = &self.stats;
        let c = &self.args.cfg;
        let mut t = String::new();
        let pace = if c.mode == Mode::Extend && c.renew == Renew::Single {
            format!(
                "each extended every {:.1} s, alone",
                f64::from(c.lease_s) / 3.0
            )
        } else if c.mode == Mode::Extend {
            format!(
                "each extended every {:.1} s, coalesced per connection as the client does",
                f64::from(c.lease_s) / 3.0
            )
        } else {
            format!("depth {}, extended back to back", c.depth)
        };
        let _ = writeln!(
            t,
            "{} {}: {} locks on {} connections, {pace}, lease {} s, {:.1} s measured",
            self.backend_name(),
            mode_name(c.mode),
            self.locks_held(),
            c.connections,
            c.lease_s,
            self.elapsed_s
        );
        let _ = writeln!(
            t,
            "  extends/s  {:>12.0}   extended (E) {}  not extended (X) {}{}",
            self.extends_per_s(),
            s.extended,
            s.not_extended,
            if s.not_extended > 0 { "  FAILED" } else { "" }
        );
        let _ = writeln!(
            t,
            "  answered {}  granted {}  busy {}",
            s.replies, s.grants, s.busy
        );
        let _ = writeln!(
            t,
            "  extend latency p50 {:>9.1} us  p99 {:>9.1} us  p99.9 {:>9.1} us  max {:>9.1} us",
            us(s.latency.quantile(0.5)),
            us(s.latency.quantile(0.99)),
            us(s.latency.quantile(0.999)),
            us(s.latency.max())
        );
        if let (Some(cpu), Some(pct)) = (self.server_cpu_s, self.server_cpu_core_pct()) {
            let per = self
                .server_cpu_us_per_extend()
                .map_or_else(|| "-".to_string(), |p| format!("{p:.3}"));
            let _ = writeln!(
                t,
                "  server cpu {cpu:.2} s = {per} us per extend = {pct:.2} % of one core"
            );
        }
        t
    }
}
