//! The node's clock: a boot-time monotonic clock, the only clock the protocol cores are fed.
//!
//! Rust's `std::time::Instant` (and tokio's) read `CLOCK_MONOTONIC`, which stops while the machine
//! is suspended. A lease holder that trusted it would, after a resume, believe its leases still
//! had the time they had before the suspend while every other node's clock had moved on. This
//! clock reads `CLOCK_BOOTTIME`, which keeps counting through a suspend, so a suspended holder
//! finds its deadlines passed when it wakes. The remaining error (rate drift) is what the epoch's
//! `clock_rate_ppm` bound covers: every deadline the cores compute is widened by that margin.
//!
//! Timers are slept on tokio's clock, which may wake late after a suspend; the runtime therefore
//! never sleeps longer than [`MAX_SLEEP`] at a time and re-reads this clock on every wake.

use std::time::Duration;

use keyhome_epoch::Instant;

/// Longest single sleep of a timer loop: after a suspend, deadlines are noticed within this long.
pub const MAX_SLEEP: Duration = Duration::from_millis(250);

/// `CLOCK_BOOTTIME`, as [`Instant`]s counted from the moment the clock was created.
#[derive(Clone, Copy, Debug)]
pub struct BootClock {
    /// `CLOCK_BOOTTIME` at creation, in nanoseconds.
    origin: u64,
}

impl BootClock {
    pub fn new() -> BootClock {
        BootClock { origin: boottime_nanos() }
    }

    /// The current reading. Never decreases.
    #[inline]
    pub fn now(&self) -> Instant {
        Instant::from_nanos(boottime_nanos().saturating_sub(self.origin))
    }

    /// How long from now until `at` (zero if it has passed).
    pub fn until(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.now())
    }

    /// `at` as a raw `CLOCK_BOOTTIME` reading in nanoseconds, for another process of this machine
    /// that reads that clock (the guard of `keyhome lock`).
    pub fn raw_nanos(&self, at: Instant) -> u64 {
        self.origin.saturating_add(at.as_nanos())
    }

    /// The raw `CLOCK_BOOTTIME` reading now, in nanoseconds (as [`BootClock::raw_nanos`] gives
    /// instants). Async-signal-safe (a vDSO read and integer arithmetic): a forked child may call
    /// it before it execs.
    pub fn raw_now() -> u64 {
        boottime_nanos()
    }
}

impl Default for BootClock {
    fn default() -> BootClock {
        BootClock::new()
    }
}

/// `CLOCK_BOOTTIME` in nanoseconds (saturating: u64 nanoseconds last 584 years). Integer
/// arithmetic only: every lock and unlock reads the clock.
fn boottime_nanos() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}
