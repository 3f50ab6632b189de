//! Deterministic simulation of keyhome clusters.
//!
//! One seed fixes a whole run: cluster size, timing, clock rates, network delay, loss,
//! duplication, reordering, partitions, crashes, disk latency and operator changes. The
//! [`check::Checker`] holds the invariants against simulated real time after every event.
//!
//! Also the harness for real clusters: [`cluster`] starts `keyhome run` processes on loopback,
//! and [`chaos`] attacks them (relayed network faults, kills, pauses, membership changes) while
//! clients lock, checking the guarantees from outside.

use std::ops::Range;

pub mod chaos;
pub mod check;
pub mod clock;
pub mod cluster;
pub mod disk;
pub mod fake_node;
pub mod fuzz;
pub mod hostile;
pub mod locks;
pub mod queue;
pub mod rng;
pub mod runner;
pub mod scenario;
pub mod world;

pub use check::{Kind, Violation};
pub use scenario::{BUG_NAMES, Options, SPARE_LEARNS_FROM_A_STRANGER, Scenario, bug_switch};
pub use world::{Stats, World};

/// The outcome of one seed.
#[derive(Debug)]
pub struct Report {
    pub seed: u64,
    pub violations: Vec<Violation>,
    pub stats: Stats,
}

impl runner::SeedOutcome for Report {
    type Kind = Kind;
    fn seed(&self) -> u64 {
        self.seed
    }
    fn first_violation(&self) -> Option<(Kind, String)> {
        self.violations.first().map(|v| (v.kind, v.to_string()))
    }
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
    runner::run_parallel(seeds, threads, stop_at_first, |seed| {
        let report = run_seed(seed, options);
        let failed = !report.violations.is_empty();
        (report, failed)
    })
}
