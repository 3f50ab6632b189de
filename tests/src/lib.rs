//! Deterministic simulation of keyhome clusters.
//!
//! One seed fixes a whole run: cluster size, timing, clock rates, network delay, loss,
//! duplication, reordering, partitions, crashes, disk latency and operator changes. The
//! [`check::Checker`] holds the invariants against simulated real time after every event.

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub mod check;
pub mod clock;
pub mod locks;
pub mod rng;
pub mod scenario;
pub mod world;

pub use check::{Kind, Violation};
pub use scenario::{BUG_NAMES, Options, Scenario, bug_switch};
pub use world::{Stats, World};

/// The outcome of one seed.
#[derive(Debug)]
pub struct Report {
    pub seed: u64,
    pub violations: Vec<Violation>,
    pub stats: Stats,
}

/// Runs one seed to its end.
pub fn run_seed(seed: u64, options: &Options) -> Report {
    let mut world = World::new(seed, Scenario::generate(seed, options));
    world.run();
    Report { seed, violations: std::mem::take(&mut world.checker.violations), stats: world.stats }
}

/// Runs `seeds` on `threads` worker threads; the reports come back sorted by seed. With
/// `stop_at_first`, workers stop taking new seeds once one seed has failed (seeds already running
/// finish), so the reports then end at or shortly after the first failing seed found.
pub fn run_seeds(seeds: Range<u64>, options: &Options, threads: usize, stop_at_first: bool) -> Vec<Report> {
    let next = AtomicU64::new(seeds.start);
    let failed = AtomicBool::new(false);
    let reports = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, 64) {
            s.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= seeds.end || (stop_at_first && failed.load(Ordering::Relaxed)) {
                        break;
                    }
                    let report = run_seed(seed, options);
                    if !report.violations.is_empty() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    reports.lock().unwrap_or_else(|e| e.into_inner()).push(report);
                }
            });
        }
    });
    let mut reports = reports.into_inner().unwrap_or_else(|e| e.into_inner());
    reports.sort_by_key(|r| r.seed);
    reports
}
