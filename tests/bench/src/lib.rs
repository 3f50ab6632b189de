//! What the bench's two harnesses share: `keyhome-compare` (src/main.rs, every system through
//! its usual async client) and `keyhome-lean` (src/bin/keyhome-lean.rs, blocking clients): the
//! keyhome cluster they start, the Redis lock they use, and how they summarize samples.

use std::time::Duration;

use keyhome::config::LockSettings;
use keyhome_epoch::Timing;
use keyhome_sim::cluster::Options;

pub mod redis_lock;

/// Nodes (keyhome), members (etcd, ZooKeeper) and hot-key contenders.
pub const NODES: usize = 3;

/// The keyhome cluster both harnesses start: [`NODES`] nodes, with leases long enough that
/// renewals are rare in a run and short enough that a fresh node's restart quarantine (one
/// delegation lease) ends in seconds.
pub fn cluster_options() -> Options {
    let timing = Timing {
        home_lease: Duration::from_secs(2),
        max_delegation_lease: Duration::from_secs(5),
        clock_rate_ppm: 10_000,
    };
    let locks = LockSettings { delegation_lease_ms: 5000, ..LockSettings::default() };
    Options { nodes: NODES as u64, timing, locks }
}

/// `/proc/loadavg`, as the kernel writes it.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_owned()
}

/// The `p` quantile (0 to 1) of `samples`, which it sorts; zero if there are none.
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort();
    samples[((samples.len() - 1) as f64 * p).round() as usize]
}

pub fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
