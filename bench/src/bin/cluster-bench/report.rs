//! `cluster-bench`'s summary: the rows of systems measured, round by
//! round, and what is printed of them once every round is done: each
//! system's median, and the ratios between them, each taken within its
//! round.

use crate::args::Options;
use crate::drivers::Run;

/// The median of `v` (NaN when empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// One system's runs, one per round.
pub(crate) struct Row {
    /// The label it is printed with.
    name: String,
    /// Its runs, in round order.
    pub(crate) runs: Vec<Run>,
}

/// Every system's row, in print order, and where each one is (`None`
/// when left out); and lease renewal on the plaintext cluster.
pub(crate) struct Table {
    /// The rows, in print order.
    pub(crate) rows: Vec<Row>,
    /// The plaintext cluster.
    pub(crate) cluster: usize,
    /// The cluster with peer TLS.
    pub(crate) tls: Option<usize>,
    /// The cluster with several requests in flight per locker.
    pub(crate) deep: Option<usize>,
    /// Single-mode ticketd.
    pub(crate) single: Option<usize>,
    /// The cluster limit, every locker on its leader.
    pub(crate) limit: Option<usize>,
    /// The cluster limit, lockers spread.
    pub(crate) spread: Option<usize>,
    /// etcd through its JSON gateway.
    pub(crate) etcd: Option<usize>,
    /// etcd through its own gRPC client.
    pub(crate) native: Option<usize>,
    /// Extends per second, one per round.
    pub(crate) extends: Vec<f64>,
    /// Extends per second over the same round's cycles per second.
    pub(crate) extend_vs_cycle: Vec<f64>,
    /// Server CPU microseconds per extend, per round where known.
    pub(crate) extend_us: Vec<f64>,
}

impl Table {
    /// The empty rows of the systems `o` asks for.
    pub(crate) fn new(o: &Options) -> Table {
        let mut rows: Vec<Row> = Vec::new();
        let mut row = |name: &str| -> usize {
            rows.push(Row {
                name: name.to_string(),
                runs: Vec::new(),
            });
            rows.len() - 1
        };
        let depth = o.depth;
        let cluster = row("ticketd 3-node cluster:");
        let tls = o.peer_tls.then(|| row("  same, peer TLS:"));
        let deep = (depth > 1).then(|| row(&format!("  same, {depth} in flight each:")));
        let single = o.single.then(|| row("single-mode ticketd:"));
        let limit = o.limit.is_some().then(|| row("cluster limit:"));
        let spread = (o.limit.is_some() && o.spread_limit).then(|| row("  same, lockers spread:"));
        let etcd = o.etcd.then(|| row("etcd, JSON gateway:"));
        let native = o.native.is_some().then(|| row("etcd, native gRPC client:"));
        Table {
            rows,
            cluster,
            tls,
            deep,
            single,
            limit,
            spread,
            etcd,
            native,
            extends: Vec::new(),
            extend_vs_cycle: Vec::new(),
            extend_us: Vec::new(),
        }
    }

    /// Each system's median cycles/s and server CPU per request, and the
    /// plaintext cluster's extends.
    pub(crate) fn print_medians(&self, o: &Options) {
        let (rounds, clients, seconds) = (o.rounds, o.clients, o.seconds);
        let what = if rounds > 1 {
            format!("median of {rounds} rounds")
        } else {
            "one round".to_string()
        };
        println!("-- {what}, {clients} clients, {seconds} s per run");
        for r in &self.rows {
            let rate = median(r.runs.iter().map(|x| x.rate).collect());
            let cpu: Vec<f64> = r.runs.iter().filter_map(|x| x.cpu_us).collect();
            let cpu = if cpu.is_empty() {
                String::new()
            } else {
                format!(", server CPU {:.1} us/request", median(cpu))
            };
            println!("{:<26}{rate:.0} cycles/s{cpu}", r.name);
        }
        if o.extend {
            println!(
                "  same lockers, extends:   {:.0} extends/s ({:.2}x cycles/s), server CPU {} us/extend",
                median(self.extends.clone()),
                median(self.extend_vs_cycle.clone()),
                if self.extend_us.is_empty() {
                    "?".to_string()
                } else {
                    format!("{:.1}", median(self.extend_us.clone()))
                }
            );
        }
    }

    /// Row `a`'s figure `f` over row `b`'s, each within its round, then
    /// the median over the rounds.
    fn ratio(&self, a: usize, b: usize, f: fn(&Run) -> Option<f64>) -> f64 {
        median(
            self.rows[a]
                .runs
                .iter()
                .zip(&self.rows[b].runs)
                .filter_map(|(x, y)| Some(f(x)? / f(y)?))
                .collect(),
        )
    }

    /// The ratios among ticketd's rows and its ceilings.
    pub(crate) fn print_ticketd_ratios(&self, depth: usize) {
        let rate = |x: &Run| Some(x.rate);
        let cpu = |x: &Run| x.cpu_us;
        let cluster = self.cluster;
        if let Some(t) = self.tls {
            println!(
                "ratio: cluster with peer TLS / plaintext = {:.2}x",
                self.ratio(t, cluster, rate)
            );
        }
        if let Some(d) = self.deep {
            println!(
                "ratio: cluster at depth {depth} / depth 1 = {:.2}x",
                self.ratio(d, cluster, rate)
            );
        }
        if let Some(c) = self.single {
            println!(
                "ratio: cluster / single-mode ticketd = {:.2}x",
                self.ratio(cluster, c, rate)
            );
        }
        if let Some(l) = self.limit {
            println!(
                "ratio: cluster / cluster limit = {:.2}x",
                self.ratio(cluster, l, rate)
            );
            println!(
                "ratio: cluster CPU per request / cluster limit's = {:.2}x",
                self.ratio(cluster, l, cpu)
            );
        }
        if let (Some(l), Some(sp)) = (self.limit, self.spread) {
            println!(
                "ratio: cluster limit, lockers spread / every locker on its leader = {:.2}x",
                self.ratio(sp, l, rate)
            );
            println!(
                "ratio: cluster / cluster limit with lockers spread = {:.2}x",
                self.ratio(cluster, sp, rate)
            );
            println!(
                "ratio: cluster CPU per request / cluster limit's with lockers spread = {:.2}x",
                self.ratio(cluster, sp, cpu)
            );
        }
    }

    /// The ratios of ticketd's rows to etcd's.
    pub(crate) fn print_etcd_ratios(&self) {
        let rate = |x: &Run| Some(x.rate);
        let cluster = self.cluster;
        if let Some(n) = self.native {
            println!(
                "ratio: cluster / etcd (native gRPC client) = {:.1}x",
                self.ratio(cluster, n, rate)
            );
            if let Some(l) = self.limit {
                println!(
                    "ratio: cluster limit / etcd (native gRPC client) = {:.1}x",
                    self.ratio(l, n, rate)
                );
            }
        }
        if let Some(e) = self.etcd {
            println!(
                "ratio: cluster / etcd (JSON gateway) = {:.1}x",
                self.ratio(cluster, e, rate)
            );
            if let Some(l) = self.limit {
                println!(
                    "ratio: cluster limit / etcd (JSON gateway) = {:.1}x",
                    self.ratio(l, e, rate)
                );
            }
            if let Some(c) = self.single {
                println!(
                    "ratio: single-mode ticketd / etcd = {:.1}x",
                    self.ratio(c, e, rate)
                );
            }
        }
    }
}
