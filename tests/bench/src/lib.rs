//! What the bench's two harnesses share: `keyhome-compare` (src/main.rs, every system through
//! its usual async client, but Redis's one-connection latency through its blocking one) and
//! `keyhome-lean` (src/bin/keyhome-lean.rs, blocking clients): the
//! keyhome cluster they start, the Redis lock they use, how they describe the machine, and how
//! they summarize samples.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use keyhome::config::LockSettings;
use keyhome_epoch::Timing;
use keyhome_sim::cluster::Options;

pub mod redis_lock;

/// Any failure of a run, with what went wrong.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

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

/// The median round trip of one byte between two threads over a Unix socket pair, from
/// `round_trips` of them (at least one; at most about a second's worth): the cost of the process
/// wake-ups every lock handoff is a chain of, as this machine charges it now. The threads are not
/// pinned: when the scheduler puts both on one CPU the figure is that CPU's (several times lower
/// on a VM that halts idle vCPUs), so read it beside the run it describes, not on its own.
pub fn wakeup_round_trip(round_trips: usize) -> std::io::Result<Duration> {
    if round_trips == 0 {
        return Err(std::io::Error::other("no round trips asked for"));
    }
    let (mut near, mut far) = UnixStream::pair()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut byte = [0u8];
        while far.read(&mut byte)? == 1 {
            far.write_all(&byte)?;
        }
        Ok(())
    });
    let mut samples = Vec::with_capacity(round_trips);
    let mut measure = || -> std::io::Result<()> {
        let budget = Instant::now() + Duration::from_secs(1);
        let mut byte = [0u8];
        while samples.len() < round_trips && Instant::now() < budget {
            let start = Instant::now();
            near.write_all(&byte)?;
            near.read_exact(&mut byte)?;
            samples.push(start.elapsed());
        }
        Ok(())
    };
    let measured = measure();
    drop(near); // the echo reads the end of the stream and returns
    // The echo's own error, if it had one, is the cause of ours.
    echo.join().map_err(|_| std::io::Error::other("the echo thread panicked"))??;
    measured?;
    Ok(percentile(&mut samples, 0.5))
}

/// [`wakeup_round_trip`] over 20 000 round trips, for a report: "17.3 µs", or why it was not
/// measured.
pub fn wakeup_line() -> String {
    match wakeup_round_trip(20_000) {
        Ok(rtt) => format!("{:.1} µs", micros(rtt)),
        Err(e) => format!("not measured ({e})"),
    }
}

/// One line on the machine for a run's header: its idle polling and its wake-up round trip.
pub fn machine_line() -> String {
    format!(
        "machine: {}; a wake-up round trip between two threads (Unix socket, p50): {}",
        keyhome::machine::IdlePolling::read(),
        wakeup_line()
    )
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
