//! Deterministic simulation of keyhome clusters.
//!
//! One seed fixes a whole run: cluster size, timing, clock rates, network delay, loss,
//! duplication, reordering, partitions, crashes, disk latency and operator changes. The
//! [`check::Checker`] holds the invariants against simulated real time after every event.

pub mod check;
pub mod clock;
pub mod rng;
pub mod scenario;
pub mod world;

pub use check::{Kind, Violation};
pub use scenario::{Options, Scenario};
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
